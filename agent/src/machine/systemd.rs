//! systemd: its manager over D-Bus ([`Systemd`]: unit properties, start, stop, daemon-reload),
//! and the unit properties specd reads ([`UnitProps`]), typed from D-Bus or parsed from
//! `systemctl show` (which `specd diagnose` still runs: its gatherer collects text evidence).

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};

use crate::core::unit_state::{ActiveState, LoadState, ServiceResult, SubState, UnitFileState};
use crate::machine::dbus::{Address, Bus, Message, Value};

/// The properties specd reads.
pub const PROPS: &[&str] = &[
    "LoadState",
    "ActiveState",
    "SubState",
    "Result",
    "ExecMainCode",
    "ExecMainStatus",
    "ExecMainPID",
    "MainPID",
    "NRestarts",
    "ControlGroup",
    "NeedDaemonReload",
    "FragmentPath",
    "DropInPaths",
    "InvocationID",
    "ExecMainStartTimestampMonotonic",
    "ExecMainExitTimestampMonotonic",
    "TimeoutStopUSec",
    "UnitFileState",
];

/// A unit as `systemctl show` reports it.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct UnitProps {
    pub load_state: LoadState,
    pub active_state: ActiveState,
    pub sub_state: SubState,
    pub result: ServiceResult,
    pub exec_main_code: u32,
    pub exec_main_status: i32,
    pub main_pid: u32,
    pub n_restarts: u32,
    pub control_group: String,
    pub need_daemon_reload: bool,
    pub fragment_path: String,
    pub drop_in_paths: Vec<String>,
    pub invocation_id: String,
    pub exec_main_start_mono: u64,
    /// `masked`, `masked-runtime`, `enabled`... (a mask in /run may be shadowed by a unit file
    /// in /etc: `LoadState` is then `loaded`, but the mask is there).
    pub unit_file_state: UnitFileState,
}

impl UnitProps {
    /// From `systemctl show` (`Key=value` lines).
    pub fn parse(text: &str) -> UnitProps {
        let m: BTreeMap<&str, &str> = text.lines().filter_map(|l| l.split_once('=')).collect();
        UnitProps::read(&Text(m))
    }

    /// From the typed properties of D-Bus' `GetAll`: the same values as `systemctl show`.
    pub fn from_bus(p: &HashMap<String, Value>) -> UnitProps {
        UnitProps::read(p)
    }

    /// Each property read once, by its kind, from either source ([`Values`]).
    fn read(v: &impl Values) -> UnitProps {
        let s = |k: &str| v.text(k).unwrap_or_default();
        let n = |k: &str| v.number(k).unwrap_or(0);
        UnitProps {
            load_state: LoadState::parse(&s("LoadState")),
            active_state: ActiveState::parse(&s("ActiveState")),
            sub_state: SubState::parse(&s("SubState")),
            result: ServiceResult::parse(&s("Result")),
            exec_main_code: n("ExecMainCode") as u32,
            exec_main_status: n("ExecMainStatus") as i32,
            main_pid: n("MainPID") as u32,
            n_restarts: n("NRestarts") as u32,
            control_group: s("ControlGroup"),
            need_daemon_reload: v.flag("NeedDaemonReload"),
            fragment_path: s("FragmentPath"),
            drop_in_paths: v.list("DropInPaths"),
            invocation_id: v.id("InvocationID"),
            exec_main_start_mono: n("ExecMainStartTimestampMonotonic") as u64,
            unit_file_state: UnitFileState::parse(&s("UnitFileState")),
        }
    }

    /// Someone masked the unit (`systemctl mask`, with or without `--runtime`).
    pub fn is_masked(&self) -> bool {
        self.load_state == LoadState::Masked || self.unit_file_state.is_mask()
    }

    /// A process of the unit may be alive (running, starting, stopping, or about to restart).
    pub fn is_running(&self) -> bool {
        self.active_state.may_run() || self.main_pid > 0
    }

    pub fn is_stopped(&self) -> bool {
        self.active_state.is_stopped() && self.main_pid == 0
    }

    /// Exit status as systemd prints it: `3`, or `9/KILL` for a signal.
    pub fn exit_status(&self) -> String {
        match self.exec_main_code {
            1 => format!("{}", self.exec_main_status),
            2 | 3 => {
                let sig = nix::sys::signal::Signal::try_from(self.exec_main_status)
                    .map(|s| s.as_str().trim_start_matches("SIG").to_string())
                    .unwrap_or_default();
                format!("{}/{sig}", self.exec_main_status)
            }
            _ => "-".into(),
        }
    }
}

/// systemd's manager, over D-Bus ([`crate::machine::dbus`]), as `systemctl` talks to it: root through
/// systemd's private socket, others through the system bus. Cheap to clone (one shared
/// connection, opened on first use).
#[derive(Clone, Debug)]
pub struct Systemd {
    bus: Bus,
    reloads: Arc<Reloads>,
}

/// Reloads asked for at once are shared: systemd runs reloads one after another (about 20 ms
/// each, whatever changed), so 16 units written together would otherwise wait for 16 of them.
/// A caller is answered by any reload that systemd began after the caller asked, which is after
/// it wrote its unit file: with its success, or with its error (a wedged systemd costs the
/// callers one timeout, not one each).
#[derive(Debug, Default)]
struct Reloads {
    /// Reloads asked for so far.
    asked: AtomicU64,
    /// One reload at a time; it holds what the last reloads answered.
    answered: tokio::sync::Mutex<Answered>,
}

#[derive(Debug, Default)]
struct Answered {
    /// The asks (by number) the last successful reload served.
    ok: u64,
    /// The asks the last failed reload began after, and its error.
    failed: Option<(u64, String)>,
}

impl Reloads {
    /// Runs `reload`, unless a reload that began after this call asked has ended meanwhile
    /// (then its outcome is this call's).
    async fn share<F: Future<Output = Result<()>>>(&self, reload: impl FnOnce() -> F) -> Result<()> {
        let mine = self.asked.fetch_add(1, Ordering::SeqCst) + 1;
        let mut answered = self.answered.lock().await;
        if answered.ok >= mine {
            return Ok(());
        }
        if let Some((_, e)) = answered.failed.as_ref().filter(|(upto, _)| *upto >= mine) {
            bail!("{e}");
        }
        // This reload begins after every ask counted so far was made.
        let upto = self.asked.load(Ordering::SeqCst);
        match reload().await {
            Ok(()) => answered.ok = upto,
            Err(e) => {
                answered.failed = Some((upto, format!("{e:#}")));
                return Err(e);
            }
        }
        Ok(())
    }
}

const DEST: &str = "org.freedesktop.systemd1";
const MANAGER_PATH: &str = "/org/freedesktop/systemd1";
const MANAGER: &str = "org.freedesktop.systemd1.Manager";
/// How long a method call may take before specd gives up on it (sd-bus's default, which is
/// what `systemctl` waits).
const CALL_TIMEOUT: Duration = Duration::from_secs(25);
/// The longest specd waits for a start or stop job it waits on: a lost signal, or a stop that
/// never ends (`TimeoutStopSec=infinity` and a process that ignores SIGTERM), is then an error
/// and the unit's lock is let go; the job itself stays systemd's.
const JOB_WAIT: Duration = Duration::from_secs(15 * 60);

impl Default for Systemd {
    fn default() -> Self {
        Systemd::new(Address::systemd())
    }
}

impl Systemd {
    pub fn new(addr: Address) -> Systemd {
        Systemd { bus: Bus::new(addr), reloads: Arc::default() }
    }

    async fn call(&self, path: &str, interface: &str, member: &str, body: Vec<Value>) -> Result<Message> {
        let m = Message::call(DEST, path, interface, member, body);
        match tokio::time::timeout(CALL_TIMEOUT, self.bus.call(m)).await {
            Ok(r) => r,
            Err(_) => bail!("systemd did not answer {interface}.{member} within {} s", CALL_TIMEOUT.as_secs()),
        }
    }

    /// The unit's properties, all of its interfaces in one `GetAll` (as `systemctl show`
    /// asks); a unit systemd does not know is loaded for it and says `LoadState=not-found`.
    pub async fn show(&self, unit: &str) -> Result<UnitProps> {
        let path = unit_object_path(unit);
        let reply = self
            .call(&path, "org.freedesktop.DBus.Properties", "GetAll", vec![Value::Str(String::new())])
            .await
            .with_context(|| format!("reading the properties of {unit} from systemd"))?;
        let mut props = HashMap::new();
        if let Some(Value::Array(_, entries)) = reply.body.first() {
            for e in entries {
                if let Value::DictEntry(k, v) = e
                    && let Some(k) = k.as_str()
                {
                    props.insert(k.to_string(), v.unvariant().clone());
                }
            }
        }
        Ok(UnitProps::from_bus(&props))
    }

    /// Starts the unit and waits for its job; a job that did not end `done` is an error naming
    /// its result (`failed`, `timeout`, `dependency`...).
    pub async fn start(&self, unit: &str) -> Result<()> {
        self.job("StartUnit", unit, true).await.with_context(|| format!("starting {unit}"))
    }

    /// Queues a stop; with `wait`, until the stop job ended.
    pub async fn stop(&self, unit: &str, wait: bool) -> Result<()> {
        self.job("StopUnit", unit, wait).await.with_context(|| format!("stopping {unit}"))
    }

    /// `systemctl enable UNIT`: the links its `[Install]` section asks for (`WantedBy=`...), then
    /// a reload, as `systemctl` does.
    pub async fn enable(&self, unit: &str) -> Result<()> {
        let args = vec![Value::strings(&[unit]), Value::Bool(false), Value::Bool(false)];
        self.call(MANAGER_PATH, MANAGER, "EnableUnitFiles", args).await.with_context(|| format!("enabling {unit}"))?;
        self.daemon_reload().await
    }

    /// `systemctl disable UNIT`: its links removed, then a reload.
    pub async fn disable(&self, unit: &str) -> Result<()> {
        let args = vec![Value::strings(&[unit]), Value::Bool(false)];
        self.call(MANAGER_PATH, MANAGER, "DisableUnitFiles", args)
            .await
            .with_context(|| format!("disabling {unit}"))?;
        self.daemon_reload().await
    }

    /// `systemctl daemon-reload`: returns once systemd has reloaded every unit file written
    /// before the call. Concurrent callers share a reload (see [`Reloads`]).
    pub async fn daemon_reload(&self) -> Result<()> {
        self.reloads
            .share(|| async {
                self.call(MANAGER_PATH, MANAGER, "Reload", vec![]).await.context("reloading systemd's units")?;
                Ok(())
            })
            .await
    }

    /// Queues a job (mode `replace`, as `systemctl` does) and, with `wait`, waits for its
    /// `JobRemoved` signal. The signals are listened to before the job is queued: the job may
    /// end before its reply is read.
    async fn job(&self, method: &str, unit: &str, wait: bool) -> Result<()> {
        let mut signals = if wait {
            let rule = format!(
                "type='signal',sender='{DEST}',path='{MANAGER_PATH}',interface='{MANAGER}',member='JobRemoved'"
            );
            let subscribe = Message::call(DEST, MANAGER_PATH, MANAGER, "Subscribe", vec![]);
            Some(self.bus.signals(&rule, Some(subscribe)).await?)
        } else {
            None
        };
        let reply = self
            .call(MANAGER_PATH, MANAGER, method, vec![Value::Str(unit.into()), Value::Str("replace".into())])
            .await?;
        let Some(signals) = signals.as_mut() else { return Ok(()) };
        let job = reply.body.first().and_then(Value::as_str).unwrap_or_default().to_string();
        match tokio::time::timeout(JOB_WAIT, Self::job_removed(signals, &job, unit)).await {
            Ok(r) => r,
            Err(_) => bail!("systemd's job {job} did not end within {} min", JOB_WAIT.as_secs() / 60),
        }
    }

    /// Until the `JobRemoved` signal of `job`: its result.
    async fn job_removed(signals: &mut crate::machine::dbus::Signals, job: &str, unit: &str) -> Result<()> {
        loop {
            let Some(s) = signals.next().await else {
                return Err(crate::machine::dbus::Lost(format!(
                    "the connection to systemd closed while waiting for job {job}"
                ))
                .into());
            };
            if s.member.as_deref() != Some("JobRemoved") || s.interface.as_deref() != Some(MANAGER) {
                continue;
            }
            // JobRemoved(u id, o job, s unit, s result)
            if s.body.get(1).and_then(Value::as_str) != Some(job) {
                continue;
            }
            let result = s.body.get(3).and_then(Value::as_str).unwrap_or_default();
            return match result {
                "done" | "skipped" => Ok(()),
                r => Err(anyhow!("the job ended with result '{r}' (see `specd diagnose {unit}`)")),
            };
        }
    }
}

impl Systemd {
    /// Units whose `ActiveState` changes, by name, as systemd signals them (`PropertiesChanged`
    /// on the unit's object), from now until the connection closes (`None`). The agent pokes a
    /// unit's worker with them, instead of looking at every unit on a timer.
    pub async fn state_changes(&self) -> Result<UnitChanges> {
        let rule = "type='signal',sender='org.freedesktop.systemd1',interface='org.freedesktop.DBus.Properties',member='PropertiesChanged'";
        let subscribe = Message::call(DEST, MANAGER_PATH, MANAGER, "Subscribe", vec![]);
        Ok(UnitChanges(self.bus.signals(rule, Some(subscribe)).await?))
    }
}

/// See [`Systemd::state_changes`].
pub struct UnitChanges(crate::machine::dbus::Signals);

impl UnitChanges {
    pub async fn next(&mut self) -> Option<String> {
        loop {
            let s = self.0.next().await?;
            if let Some(unit) = active_state_changed(&s) {
                return Some(unit);
            }
        }
    }
}

/// The unit a signal says changed its `ActiveState`: `PropertiesChanged(s interface,
/// a{sv} changed, as invalidated)` on a unit's object, for its `Unit` interface.
fn active_state_changed(s: &Message) -> Option<String> {
    if s.member.as_deref() != Some("PropertiesChanged") || s.body.first()?.as_str()? != "org.freedesktop.systemd1.Unit"
    {
        return None;
    }
    let named = |v: &Value| {
        matches!(v, Value::DictEntry(k, _) if k.as_str() == Some("ActiveState")) || v.as_str() == Some("ActiveState")
    };
    let changed = s.body.iter().skip(1).any(|v| matches!(v, Value::Array(_, items) if items.iter().any(named)));
    if !changed {
        return None;
    }
    unit_of_object_path(s.path.as_deref()?)
}

/// The inverse of [`unit_object_path`].
pub fn unit_of_object_path(path: &str) -> Option<String> {
    let escaped = path.strip_prefix("/org/freedesktop/systemd1/unit/")?.as_bytes();
    let mut out = Vec::with_capacity(escaped.len());
    let mut i = 0;
    while i < escaped.len() {
        if escaped[i] == b'_' {
            let hex = std::str::from_utf8(escaped.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(escaped[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// The object path of a unit: its name escaped as systemd does (every byte but ASCII letters
/// and digits, and a leading digit, as `_` and two hex digits).
pub fn unit_object_path(unit: &str) -> String {
    let mut p = String::from("/org/freedesktop/systemd1/unit/");
    if unit.is_empty() {
        p.push('_');
    }
    for (i, b) in unit.bytes().enumerate() {
        if b.is_ascii_alphabetic() || (b.is_ascii_digit() && i > 0) {
            p.push(b as char);
        } else {
            p.push_str(&format!("_{b:02x}"));
        }
    }
    p
}

/// A unit's properties by name, from `systemctl show`'s text or D-Bus' typed values: each kind
/// of value read one way per source, so that [`UnitProps::read`] fills every field once and both
/// sources give the same `UnitProps` (test `dbus_and_systemctl_show_agree`). A property that is
/// missing, or not of its kind, reads as empty or 0.
trait Values {
    /// A string (`ActiveState`, `ControlGroup`...).
    fn text(&self, key: &str) -> Option<String>;
    /// An integer of any width and sign (`MainPID`, `ExecMainStatus`, a timestamp).
    fn number(&self, key: &str) -> Option<i128>;
    /// A boolean (`yes` in text).
    fn flag(&self, key: &str) -> bool;
    /// A list of strings (space-separated in text).
    fn list(&self, key: &str) -> Vec<String>;
    /// A 128-bit ID as 32 hex digits (an array of bytes on D-Bus).
    fn id(&self, key: &str) -> String;
}

/// `systemctl show`'s `Key=value` lines.
struct Text<'a>(BTreeMap<&'a str, &'a str>);

impl Values for Text<'_> {
    fn text(&self, key: &str) -> Option<String> {
        self.0.get(key).map(|v| v.to_string())
    }
    fn number(&self, key: &str) -> Option<i128> {
        self.0.get(key).and_then(|v| v.parse().ok())
    }
    fn flag(&self, key: &str) -> bool {
        self.0.get(key) == Some(&"yes")
    }
    fn list(&self, key: &str) -> Vec<String> {
        self.0.get(key).map_or_else(Vec::new, |v| v.split_whitespace().map(str::to_string).collect())
    }
    fn id(&self, key: &str) -> String {
        self.text(key).unwrap_or_default()
    }
}

/// D-Bus' `GetAll` (variants unwrapped).
impl Values for HashMap<String, Value> {
    fn text(&self, key: &str) -> Option<String> {
        self.get(key).and_then(Value::as_str).map(str::to_string)
    }
    fn number(&self, key: &str) -> Option<i128> {
        match self.get(key)? {
            Value::Byte(n) => Some(i128::from(*n)),
            Value::I16(n) => Some(i128::from(*n)),
            Value::U16(n) => Some(i128::from(*n)),
            Value::I32(n) => Some(i128::from(*n)),
            Value::U32(n) => Some(i128::from(*n)),
            Value::I64(n) => Some(i128::from(*n)),
            Value::U64(n) => Some(i128::from(*n)),
            _ => None,
        }
    }
    fn flag(&self, key: &str) -> bool {
        matches!(self.get(key), Some(Value::Bool(true)))
    }
    fn list(&self, key: &str) -> Vec<String> {
        match self.get(key) {
            Some(Value::Array(_, items)) => items.iter().filter_map(Value::as_str).map(str::to_string).collect(),
            _ => Vec::new(),
        }
    }
    fn id(&self, key: &str) -> String {
        match self.get(key) {
            Some(Value::Array(_, bytes)) => bytes
                .iter()
                .filter_map(|b| if let Value::Byte(b) = b { Some(format!("{b:02x}")) } else { None })
                .collect(),
            _ => String::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_show_output() {
        let p = UnitProps::parse(
            "LoadState=loaded\nActiveState=failed\nSubState=failed\nResult=timeout\nExecMainCode=2\nExecMainStatus=9\nMainPID=0\nNRestarts=3\nNeedDaemonReload=yes\nDropInPaths=/etc/systemd/system/x.service.d/a.conf /run/systemd/system/x.service.d/b.conf\n",
        );
        assert_eq!(p.result, ServiceResult::Timeout);
        assert!(p.need_daemon_reload);
        assert_eq!(p.exit_status(), "9/KILL");
        assert_eq!(p.drop_in_paths.len(), 2);
        assert!(p.is_stopped());
    }

    /// The same unit, as `systemctl show` prints it and as D-Bus types it, reads the same.
    #[test]
    fn text_and_typed_properties_read_the_same() {
        let text = "LoadState=loaded\nActiveState=active\nSubState=running\nResult=success\nExecMainCode=0\nExecMainStatus=0\nMainPID=4242\nNRestarts=2\nControlGroup=/system.slice/x.service\nNeedDaemonReload=no\nFragmentPath=/etc/systemd/system/x.service\nDropInPaths=/etc/systemd/system/x.service.d/a.conf /run/systemd/system/x.service.d/b.conf\nInvocationID=00ff00ff00ff00ff00ff00ff00ff00ff\nExecMainStartTimestampMonotonic=123456789\nUnitFileState=enabled\n";
        let s = |v: &str| Value::Str(v.into());
        let bus: HashMap<String, Value> = [
            ("LoadState", s("loaded")),
            ("ActiveState", s("active")),
            ("SubState", s("running")),
            ("Result", s("success")),
            ("ExecMainCode", Value::I32(0)),
            ("ExecMainStatus", Value::I32(0)),
            ("MainPID", Value::U32(4242)),
            ("NRestarts", Value::U32(2)),
            ("ControlGroup", s("/system.slice/x.service")),
            ("NeedDaemonReload", Value::Bool(false)),
            ("FragmentPath", s("/etc/systemd/system/x.service")),
            (
                "DropInPaths",
                Value::Array(
                    "s".into(),
                    vec![s("/etc/systemd/system/x.service.d/a.conf"), s("/run/systemd/system/x.service.d/b.conf")],
                ),
            ),
            ("InvocationID", Value::Array("y".into(), [0u8, 255].repeat(8).into_iter().map(Value::Byte).collect())),
            ("ExecMainStartTimestampMonotonic", Value::U64(123_456_789)),
            ("UnitFileState", s("enabled")),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let p = UnitProps::parse(text);
        assert_eq!(p, UnitProps::from_bus(&bus));
        assert_eq!((p.main_pid, p.sub_state, p.unit_file_state), (4242, SubState::Running, UnitFileState::Enabled));
        // Nothing told reads as nothing, from either source.
        assert_eq!(UnitProps::parse(""), UnitProps::from_bus(&HashMap::new()));
        assert_eq!(UnitProps::parse(""), UnitProps::default());
    }
}

/// The D-Bus reader and the `systemctl show` parser on the same units of a real systemd (a
/// private one, as PID 1 of new namespaces), in several states.
#[cfg(test)]
mod bus_tests {
    use super::*;
    use specd_e2e::SystemdBox;

    /// systemd refuses its private socket to a process outside its pid namespace (it cannot
    /// name the peer's pid): the checks run in this same test binary, started inside the box.
    #[test]
    fn dbus_and_systemctl_show_agree() {
        let b = SystemdBox::boot().unwrap();
        let exe = std::env::current_exe().unwrap();
        let out = b
            .command(&[
                exe.to_str().unwrap(),
                "--exact",
                "machine::systemd::bus_tests::inside_the_box",
                "--include-ignored",
                "--nocapture",
            ])
            .env("SPECD_TEST_INSIDE_BOX", b.name())
            .output()
            .unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success() && text.contains("1 passed"), "{text}");
        b.shutdown().unwrap();
    }

    fn systemctl(args: &[&str]) -> String {
        let o = std::process::Command::new("systemctl").args(args).output().unwrap();
        assert!(o.status.success(), "systemctl {args:?}: {}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8(o.stdout).unwrap()
    }

    fn write(path: &str, text: &str) {
        std::fs::create_dir_all(std::path::Path::new(path).parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }

    const DIR: &str = "/etc/systemd/system";

    #[test]
    #[ignore = "runs inside a systemd box, started by dbus_and_systemctl_show_agree"]
    fn inside_the_box() {
        std::env::var("SPECD_TEST_INSIDE_BOX").expect("started by dbus_and_systemctl_show_agree, inside its box");
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let sd = Systemd::default();
        assert_eq!(sd.bus, Bus::new(Address::Peer(crate::machine::dbus::SYSTEMD_PRIVATE.into())));
        write(&format!("{DIR}/run.service"), "[Service]\nExecStart=/bin/sleep 1000\n");
        write(&format!("{DIR}/run.service.d/10-env.conf"), "[Service]\nEnvironment=A=1\n");
        write(&format!("{DIR}/killed.service"), "[Service]\nType=oneshot\nExecStart=/bin/sh -c 'kill -9 $$$$'\n");
        rt.block_on(sd.daemon_reload()).unwrap();
        systemctl(&["mask", "masked.service"]);

        started_failed_absent_and_masked(&rt, &sd);
        a_changed_file_needs_a_reload(&rt, &sd);
        reloads_asked_together_each_load_their_caller_s_file(&rt, &sd);
        enabled_and_disabled(&rt, &sd);
        stopped(&rt, &sd);
    }

    /// The unit's properties read over D-Bus.
    fn show(rt: &tokio::runtime::Runtime, sd: &Systemd, unit: &str) -> UnitProps {
        rt.block_on(sd.show(unit)).unwrap()
    }

    /// The unit's properties as `systemctl show` prints them.
    fn by_systemctl(unit: &str) -> UnitProps {
        UnitProps::parse(&systemctl(&["show", unit, "-p", &PROPS.join(",")]))
    }

    /// Running, through the D-Bus start (which waits for the job); a start job that fails; a
    /// unit systemd has no file for, and a masked one.
    fn started_failed_absent_and_masked(rt: &tokio::runtime::Runtime, sd: &Systemd) {
        rt.block_on(sd.start("run.service")).unwrap();
        let p = show(rt, sd, "run.service");
        assert_eq!(p.active_state, ActiveState::Active);
        assert!(p.main_pid > 0 && p.invocation_id.len() == 32, "{p:?}");
        assert_eq!(p.drop_in_paths, vec![format!("{DIR}/run.service.d/10-env.conf")]);
        assert_eq!(p, by_systemctl("run.service"));

        // A start job that fails names its result; the unit failed with a signal.
        let e = rt.block_on(sd.start("killed.service")).unwrap_err();
        assert!(format!("{e:#}").contains("starting killed.service: the job ended with result 'failed'"), "{e:#}");
        let p = show(rt, sd, "killed.service");
        assert_eq!(
            (p.active_state, p.result.clone(), p.exit_status().as_str()),
            (ActiveState::Failed, ServiceResult::Signal, "9/KILL")
        );
        assert_eq!(p, by_systemctl("killed.service"));

        let p = show(rt, sd, "nothere.service");
        assert_eq!(p.load_state, LoadState::NotFound);
        assert_eq!(p, by_systemctl("nothere.service"));
        let p = show(rt, sd, "masked.service");
        assert!(p.is_masked(), "{p:?}");
        assert_eq!(p, by_systemctl("masked.service"));
        let e = rt.block_on(sd.start("masked.service")).unwrap_err();
        assert!(format!("{e:#}").contains("org.freedesktop.systemd1.UnitMasked"), "{e:#}");
    }

    /// A changed file is seen as NeedDaemonReload (the unit is loaded while it runs).
    fn a_changed_file_needs_a_reload(rt: &tokio::runtime::Runtime, sd: &Systemd) {
        write(&format!("{DIR}/run.service"), "[Service]\nExecStart=/bin/sleep 999\n");
        let p = show(rt, sd, "run.service");
        assert!(p.need_daemon_reload, "{p:?}");
        assert_eq!(p, by_systemctl("run.service"));
        rt.block_on(sd.daemon_reload()).unwrap();
        assert!(!show(rt, sd, "run.service").need_daemon_reload);
    }

    /// Reloads asked together are shared, and each caller's file is loaded when its call
    /// returns, also when it wrote while another caller's reload ran.
    fn reloads_asked_together_each_load_their_caller_s_file(rt: &tokio::runtime::Runtime, sd: &Systemd) {
        for i in 0..8 {
            write(&format!("{DIR}/c{i}.service"), "[Service]\nExecStart=/bin/sleep 1000\n");
        }
        rt.block_on(sd.daemon_reload()).unwrap();
        for i in 0..8 {
            rt.block_on(sd.start(&format!("c{i}.service"))).unwrap();
        }
        let changed = rt.block_on(async {
            let mut each = tokio::task::JoinSet::new();
            for i in 0..8u64 {
                let sd = sd.clone();
                each.spawn(async move {
                    // Some write while an earlier caller's reload runs (one takes ~20 ms).
                    tokio::time::sleep(Duration::from_millis(4 * i)).await;
                    let unit = format!("c{i}.service");
                    write(&format!("{DIR}/{unit}"), &format!("[Service]\nExecStart=/bin/sleep {}\n", 2000 + i));
                    sd.daemon_reload().await.unwrap();
                    let p = sd.show(&unit).await.unwrap();
                    (unit, p)
                });
            }
            each.join_all().await
        });
        for (unit, p) in changed {
            assert!(!p.need_daemon_reload, "{unit} was not reloaded when its reload returned: {p:?}");
        }
    }

    /// Enabled and disabled over D-Bus, as `systemctl is-enabled` sees it.
    fn enabled_and_disabled(rt: &tokio::runtime::Runtime, sd: &Systemd) {
        write(
            &format!("{DIR}/inst.service"),
            "[Service]\nExecStart=/bin/sleep 1000\n[Install]\nWantedBy=multi-user.target\n",
        );
        rt.block_on(sd.daemon_reload()).unwrap();
        rt.block_on(sd.enable("inst.service")).unwrap();
        assert_eq!(systemctl(&["is-enabled", "inst.service"]).trim(), "enabled");
        assert_eq!(show(rt, sd, "inst.service").unit_file_state, UnitFileState::Enabled);
        rt.block_on(sd.disable("inst.service")).unwrap();
        let o = std::process::Command::new("systemctl").args(["is-enabled", "inst.service"]).output().unwrap();
        assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "disabled");
        let e = rt.block_on(sd.enable("nofile.service")).unwrap_err();
        assert!(format!("{e:#}").starts_with("enabling nofile.service: "), "{e:#}");
    }

    /// Stopped, waiting for the stop job (no process left running when it returns; systemd may
    /// send JobRemoved before it reaps the exited process, a zombie for a moment).
    fn stopped(rt: &tokio::runtime::Runtime, sd: &Systemd) {
        let pid = show(rt, sd, "run.service").main_pid;
        rt.block_on(sd.stop("run.service", true)).unwrap();
        let state = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| s.rsplit_once(") ").map(|(_, r)| r[..1].to_string()).unwrap_or_default())
            .unwrap_or_else(|_| "gone".into());
        assert!(matches!(state.as_str(), "gone" | "Z" | "X"), "pid {pid} is still there, state {state}");
        let p = show(rt, sd, "run.service");
        assert!(p.is_stopped(), "{p:?}");
        assert_eq!(p, by_systemctl("run.service"));
    }

    /// 16 callers, each asking after its own write, some while a reload runs: every caller
    /// returns only after a reload that began after it asked, and they share 4 reloads, not 16.
    #[tokio::test(start_paused = true)]
    async fn reloads_asked_together_are_shared_and_none_is_served_by_an_earlier_one() {
        use tokio::time::{Duration, Instant, sleep};
        let reloads = Arc::new(Reloads::default());
        let begun = Arc::new(std::sync::Mutex::new(Vec::<(Instant, Instant)>::new()));
        let t0 = Instant::now();
        let tasks: Vec<_> = (0..16u64)
            .map(|i| {
                let (reloads, begun) = (reloads.clone(), begun.clone());
                tokio::spawn(async move {
                    // Asks at 0, 3, 6 ... 45 ms; a reload takes 20 ms.
                    sleep(Duration::from_millis(3 * i)).await;
                    let asked = Instant::now();
                    reloads
                        .share(|| async {
                            let b = Instant::now();
                            sleep(Duration::from_millis(20)).await;
                            begun.lock().unwrap().push((b, Instant::now()));
                            Ok(())
                        })
                        .await
                        .unwrap();
                    (asked, Instant::now())
                })
            })
            .collect();
        for t in tasks {
            let (asked, returned) = t.await.unwrap();
            let served = begun.lock().unwrap().iter().any(|&(b, e)| b >= asked && e <= returned);
            assert!(served, "asked at {:?}: no reload began after it and ended before it returned", asked - t0);
        }
        // At 0 (serves 0), at 20 (serves the asks at 3..18), at 40 (21..39), at 60 (42, 45).
        assert_eq!(begun.lock().unwrap().len(), 4);
    }

    /// A failed reload answers the callers that asked before it began with its error (they do
    /// not each wait for a reload of their own); a caller that asks after it gets a new reload.
    #[tokio::test(start_paused = true)]
    async fn a_failed_reload_answers_the_callers_it_covered_and_later_ones_try_again() {
        use std::sync::atomic::AtomicUsize;
        use tokio::time::{Duration, sleep};
        let reloads = Arc::new(Reloads::default());
        let runs = Arc::new(AtomicUsize::new(0));
        let ask = |delay: u64, fails: bool| {
            let (reloads, runs) = (reloads.clone(), runs.clone());
            tokio::spawn(async move {
                sleep(Duration::from_millis(delay)).await;
                reloads
                    .share(|| async {
                        runs.fetch_add(1, Ordering::SeqCst);
                        sleep(Duration::from_millis(20)).await;
                        if fails { anyhow::bail!("systemd did not answer") } else { Ok(()) }
                    })
                    .await
            })
        };
        // 0 runs a reload that fails at 20; 5 and 10 asked before the next one began (at 20),
        // which fails too and answers both; 50 asks later and runs its own, which succeeds.
        let tasks = [ask(0, true), ask(5, true), ask(10, true)];
        let mut errors = 0;
        for t in tasks {
            errors += t.await.unwrap().is_err() as usize;
        }
        assert_eq!((errors, runs.load(Ordering::SeqCst)), (3, 2));
        ask(50, false).await.unwrap().unwrap();
        assert_eq!(runs.load(Ordering::SeqCst), 3);
    }

    #[test]
    fn object_paths_escape_as_systemd_does() {
        assert_eq!(unit_object_path("bench0.service"), "/org/freedesktop/systemd1/unit/bench0_2eservice");
        assert_eq!(unit_object_path("0a-b_c@x.service"), "/org/freedesktop/systemd1/unit/_30a_2db_5fc_40x_2eservice");
        for u in ["bench0.service", "0a-b_c@x.service", "m\\x2d1.service"] {
            assert_eq!(unit_of_object_path(&unit_object_path(u)).as_deref(), Some(u));
        }
        assert_eq!(unit_of_object_path("/org/freedesktop/systemd1/unit/a_2"), None);
        assert_eq!(unit_of_object_path("/org/freedesktop/systemd1/job/1"), None);
    }

    #[test]
    fn a_change_of_active_state_names_its_unit_and_other_changes_do_not() {
        let signal = |iface: &str, changed: &str| {
            let mut m = Message::call(
                "",
                &unit_object_path("m0.service"),
                "org.freedesktop.DBus.Properties",
                "PropertiesChanged",
                vec![],
            );
            m.body = vec![
                Value::Str(iface.into()),
                Value::Array(
                    "{sv}".into(),
                    vec![Value::DictEntry(
                        Box::new(Value::Str(changed.into())),
                        Box::new(Value::Variant(Box::new(Value::Str("x".into())))),
                    )],
                ),
                Value::Array("s".into(), vec![]),
            ];
            m
        };
        assert_eq!(
            active_state_changed(&signal("org.freedesktop.systemd1.Unit", "ActiveState")).as_deref(),
            Some("m0.service")
        );
        assert_eq!(active_state_changed(&signal("org.freedesktop.systemd1.Unit", "Description")), None);
        assert_eq!(active_state_changed(&signal("org.freedesktop.systemd1.Service", "ActiveState")), None);
    }
}
