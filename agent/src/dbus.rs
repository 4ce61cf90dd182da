//! systemd's manager over D-Bus, the way `systemctl` talks to it: as root through systemd's
//! private socket (a direct connection, no bus daemon needed), otherwise the system bus.
//!
//! A start or a stop that is waited for ends on the job's `JobRemoved` signal, and its result
//! decides success as it does for `systemctl start`; a daemon-reload ends on the reply to
//! `Reload`, which systemd sends only once the reload is over. Property names and types are
//! systemd's (`src/core/dbus-unit.c`, `dbus-service.c`, `dbus-execute.h`).

use std::collections::HashMap;
use std::path::Path;
use std::pin::Pin;

use anyhow::{Context, Result, bail};
use futures_core::Stream;
use zbus::message::Type as MessageType;
use zbus::zvariant::{OwnedObjectPath, OwnedValue, Value};
use zbus::{Connection, MatchRule, MessageStream};

use crate::service::ActiveState;
use crate::systemd::UnitProps;

/// systemd's socket for direct connections (root only), as `systemctl` uses it.
pub const PRIVATE_SOCKET: &str = "/run/systemd/private";

const DEST: &str = "org.freedesktop.systemd1";
const PATH: &str = "/org/freedesktop/systemd1";
const MANAGER: &str = "org.freedesktop.systemd1.Manager";
const PROPERTIES: &str = "org.freedesktop.DBus.Properties";

/// `JobRemoved` signals that may wait in a waiter's queue before it reads them (the queue is
/// read as soon as the job is queued; a full queue would hold the connection's reader).
const JOB_QUEUE: usize = 4096;

/// How the connection reaches systemd.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// Peer to peer, on [`PRIVATE_SOCKET`].
    Private,
    /// Through the system bus's daemon.
    SystemBus,
}

/// A connection to systemd's manager. Cheap to clone (one shared connection).
#[derive(Clone, Debug)]
pub struct Manager {
    conn: Connection,
    route: Route,
    /// Tells connections apart (a new one replaces a closed one).
    id: u64,
}

impl Manager {
    /// As root, systemd's private socket if it is there; otherwise the system bus.
    pub async fn connect() -> Result<Manager> {
        if nix::unistd::geteuid().is_root() && Path::new(PRIVATE_SOCKET).exists() {
            match Manager::connect_private(Path::new(PRIVATE_SOCKET)).await {
                Ok(m) => return Ok(m),
                Err(e) => tracing::debug!("systemd's private socket: {e:#}; trying the system bus"),
            }
        }
        let conn = Connection::system().await.context("connecting to the system bus")?;
        Manager::subscribed(conn, Route::SystemBus).await
    }

    /// A direct connection to systemd's private socket at `path`.
    pub async fn connect_private(path: &Path) -> Result<Manager> {
        let stream = tokio::net::UnixStream::connect(path)
            .await
            .with_context(|| format!("connecting to {}", path.display()))?;
        let conn = zbus::connection::Builder::unix_stream(stream)
            .p2p()
            .build()
            .await
            .with_context(|| format!("D-Bus handshake with systemd on {}", path.display()))?;
        Manager::subscribed(conn, Route::Private).await
    }

    /// Ask for the manager's signals. A direct connection gets them anyway; on the bus, systemd
    /// sends them only to subscribers.
    async fn subscribed(conn: Connection, route: Route) -> Result<Manager> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let m = Manager { conn, route, id };
        m.manager::<_, ()>("Subscribe", &()).await?;
        Ok(m)
    }

    pub fn route(&self) -> Route {
        self.route
    }

    /// The same connection.
    pub fn same(&self, other: &Manager) -> bool {
        self.id == other.id
    }

    async fn manager<B, R>(&self, method: &str, body: &B) -> Result<R>
    where
        B: serde::Serialize + zbus::zvariant::DynamicType,
        R: for<'d> serde::Deserialize<'d> + zbus::zvariant::Type,
    {
        let reply = self
            .conn
            .call_method(Some(DEST), PATH, Some(MANAGER), method, body)
            .await
            .with_context(|| format!("systemd {method}"))?;
        reply.body().deserialize().with_context(|| format!("systemd {method}: reading the reply"))
    }

    /// The unit's properties (the unit is loaded if it was not: an unknown unit is
    /// `LoadState=not-found`, as `systemctl show` says).
    pub async fn show(&self, unit: &str) -> Result<UnitProps> {
        let path: OwnedObjectPath = self.manager("LoadUnit", &(unit,)).await?;
        // One call for every interface of the unit (Unit, Service...), as `systemctl show` does.
        let reply = self
            .conn
            .call_method(Some(DEST), path.as_str(), Some(PROPERTIES), "GetAll", &("",))
            .await
            .with_context(|| format!("systemd: properties of {unit}"))?;
        let all: HashMap<String, OwnedValue> =
            reply.body().deserialize().with_context(|| format!("systemd: properties of {unit}"))?;
        Ok(props(&all))
    }

    /// `StartUnit(unit, "replace")`, until the job is over; an error unless it is `done`.
    pub async fn start(&self, unit: &str) -> Result<()> {
        self.job("StartUnit", unit, true).await
    }

    /// `StopUnit(unit, "replace")`; with `wait`, until the job is over, else only queued.
    pub async fn stop(&self, unit: &str, wait: bool) -> Result<()> {
        self.job("StopUnit", unit, wait).await
    }

    /// `Reload`: systemd answers once the reload is over.
    pub async fn daemon_reload(&self) -> Result<()> {
        self.manager::<_, ()>("Reload", &()).await
    }

    async fn job(&self, method: &str, unit: &str, wait: bool) -> Result<()> {
        // Listen before the job exists: its end cannot be missed.
        let mut removed = match wait {
            true => Some(self.job_removed().await?),
            false => None,
        };
        let job: OwnedObjectPath =
            self.manager(method, &(unit, "replace")).await.with_context(|| format!("{method} {unit}"))?;
        let Some(removed) = removed.as_mut() else { return Ok(()) };
        loop {
            let msg = std::future::poll_fn(|cx| Pin::new(&mut *removed).poll_next(cx))
                .await
                .with_context(|| format!("the connection to systemd ended while waiting for {method} {unit}"))?
                .with_context(|| format!("waiting for {method} {unit}"))?;
            let Ok((_id, path, _unit, result)) = msg.body().deserialize::<(u32, OwnedObjectPath, String, String)>()
            else {
                continue;
            };
            if path == job {
                return self.job_result(method, unit, &result).await;
            }
        }
    }

    /// What `systemctl` makes of a job's result: `done` and `skipped` succeed.
    async fn job_result(&self, method: &str, unit: &str, result: &str) -> Result<()> {
        let why = match result {
            "done" | "skipped" => return Ok(()),
            "canceled" => format!("Job for {unit} canceled."),
            "timeout" => format!("Job for {unit} timed out."),
            "dependency" => format!("A dependency job for {unit} failed."),
            "collected" => format!("Queued job for {unit} was garbage collected."),
            _ => {
                let service = match unit.ends_with(".service") {
                    true => self.show(unit).await.map(|p| p.result).unwrap_or_default(),
                    false => String::new(),
                };
                match explain(&service) {
                    Some(e) => format!("Job for {unit} failed because {e}."),
                    None => format!("Job for {unit} failed ({result})."),
                }
            }
        };
        bail!("{method} {unit}: {why}")
    }

    async fn job_removed(&self) -> Result<MessageStream> {
        let mut rule = MatchRule::builder().msg_type(MessageType::Signal).path(PATH)?.interface(MANAGER)?.member("JobRemoved")?;
        // A direct connection's messages have no sender.
        if self.route == Route::SystemBus {
            rule = rule.sender(DEST)?;
        }
        MessageStream::for_match_rule(rule.build(), &self.conn, Some(JOB_QUEUE))
            .await
            .context("listening for systemd's JobRemoved")
    }
}

/// The service's `Result` in `systemctl`'s words.
fn explain(result: &str) -> Option<&'static str> {
    Some(match result {
        "resources" => "of unavailable resources or another system error",
        "protocol" => "the service did not take the steps required by its unit configuration",
        "timeout" => "a timeout was exceeded",
        "exit-code" => "the control process exited with error code",
        "signal" => "a fatal signal was delivered to the control process",
        "core-dump" => "a fatal signal was delivered causing the control process to dump core",
        "watchdog" => "the service failed to send watchdog ping",
        "start-limit" => "start of the service was attempted too often",
        _ => return None,
    })
}

/// `UnitProps` from the properties of `GetAll`; a missing one is empty or 0, as in
/// [`UnitProps::parse`].
fn props(all: &HashMap<String, OwnedValue>) -> UnitProps {
    let get = |k: &str| all.get(k).map(|v| &**v);
    let s = |k: &str| match get(k) {
        Some(Value::Str(s)) => s.to_string(),
        Some(Value::ObjectPath(p)) => p.to_string(),
        _ => String::new(),
    };
    let n = |k: &str| -> i64 {
        match get(k) {
            Some(Value::U8(v)) => i64::from(*v),
            Some(Value::I16(v)) => i64::from(*v),
            Some(Value::U16(v)) => i64::from(*v),
            Some(Value::I32(v)) => i64::from(*v),
            Some(Value::U32(v)) => i64::from(*v),
            Some(Value::I64(v)) => *v,
            Some(Value::U64(v)) => i64::try_from(*v).unwrap_or(i64::MAX),
            _ => 0,
        }
    };
    let strings = |k: &str| match get(k) {
        Some(Value::Array(a)) => a
            .inner()
            .iter()
            .filter_map(|v| match v {
                Value::Str(s) => Some(s.to_string()),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    };
    // An id128 as `systemctl` prints it: 32 lowercase hex digits (empty: no invocation).
    let id128 = |k: &str| match get(k) {
        Some(Value::Array(a)) => a
            .inner()
            .iter()
            .filter_map(|v| match v {
                Value::U8(b) => Some(format!("{b:02x}")),
                _ => None,
            })
            .collect(),
        _ => String::new(),
    };
    UnitProps {
        load_state: s("LoadState"),
        active_state: ActiveState::parse(&s("ActiveState")),
        sub_state: s("SubState"),
        result: s("Result"),
        exec_main_code: n("ExecMainCode") as u32,
        exec_main_status: n("ExecMainStatus") as i32,
        main_pid: n("MainPID") as u32,
        n_restarts: n("NRestarts") as u32,
        control_group: s("ControlGroup"),
        need_daemon_reload: matches!(get("NeedDaemonReload"), Some(Value::Bool(true))),
        fragment_path: s("FragmentPath"),
        drop_in_paths: strings("DropInPaths"),
        invocation_id: id128("InvocationID"),
        exec_main_start_mono: match get("ExecMainStartTimestampMonotonic") {
            Some(Value::U64(v)) => *v,
            _ => 0,
        },
        unit_file_state: s("UnitFileState"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn properties_become_unit_props_as_systemctl_prints_them() {
        let mut all: HashMap<String, OwnedValue> = HashMap::new();
        let mut put = |k: &str, v: Value| {
            all.insert(k.into(), v.try_to_owned().unwrap());
        };
        put("LoadState", Value::from("loaded"));
        put("ActiveState", Value::from("failed"));
        put("Result", Value::from("signal"));
        put("ExecMainCode", Value::I32(2));
        put("ExecMainStatus", Value::I32(9));
        put("MainPID", Value::U32(0));
        put("NRestarts", Value::U32(3));
        put("NeedDaemonReload", Value::Bool(true));
        put("DropInPaths", Value::from(vec!["/etc/x.service.d/a.conf", "/run/x.service.d/b.conf"]));
        put("InvocationID", Value::from(vec![0xabu8, 0x01, 0, 0xff]));
        put("ExecMainStartTimestampMonotonic", Value::U64(123_456));
        let p = props(&all);
        assert_eq!(p.active_state, ActiveState::Failed);
        assert_eq!(p.result, "signal");
        assert_eq!(p.exit_status(), "9/KILL");
        assert_eq!(p.n_restarts, 3);
        assert!(p.need_daemon_reload);
        assert_eq!(p.drop_in_paths, ["/etc/x.service.d/a.conf", "/run/x.service.d/b.conf"]);
        assert_eq!(p.invocation_id, "ab0100ff");
        assert_eq!(p.exec_main_start_mono, 123_456);
        assert!(p.is_stopped());
        assert_eq!(props(&HashMap::new()), UnitProps::default());
    }

    #[test]
    fn a_failed_service_is_explained_in_systemctl_s_words() {
        assert_eq!(explain("exit-code"), Some("the control process exited with error code"));
        assert_eq!(explain("success"), None);
    }
}
