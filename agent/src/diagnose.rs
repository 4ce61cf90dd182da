//! Why did it die: classify how each instance of a unit ended, from evidence, and cite it.
//!
//! An *instance* is one run of a unit: one systemd invocation ID. For each one specd collects
//! what systemd, the server, the kernel and the people around it wrote ([`Evidence`]) and a pure
//! function ([`classify`]) turns that into a [`Diagnosis`]: a [`Verdict`], one line a person
//! reads, and the journal lines it rests on, with their timestamps.
//!
//! The point is to tell apart endings that look alike. A SIGKILL from systemd because a drain
//! outlived `TimeoutStopSec=` is not an OOM; an SGLang server that ran out of GPU memory also
//! ends with SIGKILL (it kills its own process tree), and that is a CUDA OOM, not a crash; a
//! SIGKILL from the kernel's OOM killer is recognised by the kernel's own line naming the unit's
//! cgroup, or by systemd's `Result=oom-kill` where systemd can see it (cgroup v2 memory
//! controller only: on a hybrid host systemd reports `Result=signal`, status 9).
//!
//! Layout: parsing (journal JSON, `systemctl show`, kernel log, unit files) and the classifier
//! are pure and take text; [`gather`] is the shell that runs `journalctl`/`systemctl` and reads
//! `/proc`, `/sys/fs/cgroup` and the kernel ring buffer, then calls [`assemble`]; [`run`] is the
//! `specd diagnose` command.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use anyhow::{Context, Result, bail};
use serde::Serialize;
use tokio::process::Command;

/// How many instances of a unit are diagnosed (newest first).
pub const MAX_INSTANCES: usize = 50;
/// How many of an instance's own output lines are read (its last ones).
pub const SERVICE_TAIL: usize = 400;
/// How long before systemd's "Stopping" line a request to stop counts as its cause.
const REQUEST_WINDOW_US: u64 = 30_000_000;

/// How an instance ended (or that it has not).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Verdict {
    /// systemd SIGKILLed it because a stop outlived `TimeoutStopSec=` (it was still draining).
    StopTimeoutKill,
    /// The kernel's OOM killer (global or a memory cgroup limit) killed it.
    OomKill,
    /// The engine ran out of GPU memory (its own message), whatever signal or status followed.
    CudaOom,
    /// It exited non-zero or died of a signal nobody asked for.
    Crash,
    /// It stopped sending watchdog keep-alives and systemd killed it.
    Watchdog,
    /// systemd gave up restarting it (`StartLimitBurst=` reached).
    StartLimitHit,
    /// It stopped because it was asked to (or exited 0 by itself).
    CleanStop,
    /// It never became ready: specd stopped it (to roll back, or to leave it stopped), after the
    /// server logged errors.
    FailedStart,
    /// It was started while the unit file on disk had changed without a daemon-reload: it runs
    /// systemd's old copy of the unit, not the file on disk.
    StaleConfigStart,
    /// It is the current instance and runs.
    Running,
    /// The evidence does not say.
    Unknown,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::StopTimeoutKill => "stop-timeout-kill",
            Verdict::OomKill => "oom-kill",
            Verdict::CudaOom => "cuda-oom",
            Verdict::Crash => "crash",
            Verdict::Watchdog => "watchdog",
            Verdict::StartLimitHit => "start-limit-hit",
            Verdict::CleanStop => "clean-stop",
            Verdict::FailedStart => "failed-start",
            Verdict::StaleConfigStart => "stale-config-start",
            Verdict::Running => "running",
            Verdict::Unknown => "unknown",
        }
    }

    /// The instance has ended (everything but `Running`, and `StaleConfigStart` of a live one).
    pub fn is_ending(self) -> bool {
        !matches!(self, Verdict::Running | Verdict::Unknown)
    }
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Who wrote a journal line.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Origin {
    /// systemd itself (PID 1), about a unit.
    Systemd,
    /// The unit's own processes (the server).
    #[default]
    Service,
    /// The kernel (`journalctl -k`, or the ring buffer).
    Kernel,
    /// specd (its stop markers, its log).
    Specd,
    /// A person's tools: sudo, polkit.
    Person,
    /// `systemctl show`, as observed now.
    Systemctl,
    /// Anything else.
    Other,
}

/// One journal entry, reduced to what diagnosis needs.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Line {
    /// Wall clock, microseconds since the epoch.
    pub time_us: u64,
    pub origin: Origin,
    pub pid: u32,
    /// `SYSLOG_IDENTIFIER`, else `_COMM`.
    pub ident: String,
    /// The unit the line is about (`UNIT`, `OBJECT_SYSTEMD_UNIT`) or from (`_SYSTEMD_UNIT`).
    pub unit: String,
    /// `INVOCATION_ID` (systemd's lines) or `_SYSTEMD_INVOCATION_ID` (the service's).
    pub invocation: Option<String>,
    /// `JOB_TYPE` of systemd's job lines (`start`, `stop`, `restart`).
    pub job_type: Option<String>,
    /// `SPECD_ACTION` of specd's notes (`stop`, `rollback`, `restore`).
    pub action: Option<String>,
    pub message: String,
}

/// What `systemctl show` says about the unit now. Only the newest instance has these.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct UnitView {
    pub id: String,
    /// The properties the reconciler reads too (state, result, exit status, pids, paths).
    #[serde(flatten)]
    pub props: crate::systemd::UnitProps,
    pub slice: String,
    /// The `argv[]` of the `ExecStart=` systemd has loaded (space-joined, as systemd prints it).
    pub loaded_exec_start: Option<String>,
    pub timeout_stop_us: Option<u64>,
    pub watchdog_us: Option<u64>,
    /// Units whose stop stops this one, with the dependency: `("BindsTo", "db.service")`.
    pub stop_deps: Vec<(String, String)>,
}

/// The dependencies through which another unit's stop stops this one.
const STOP_DEP_PROPS: &[&str] = &["BindsTo", "PartOf", "Requires", "Requisite"];

/// What [`gather`] asks `systemctl show` for beyond the reconciler's [`crate::systemd::PROPS`].
const EXTRA_PROPS: &[&str] =
    &["Id", "Slice", "ExecStart", "WatchdogUSec", "BindsTo", "PartOf", "Requires", "Requisite"];

/// The `-p` argument of [`gather`]'s `systemctl show`: the reconciler's properties (which
/// [`UnitView::props`] parses) and diagnosis' own.
pub fn show_props() -> String {
    crate::systemd::PROPS.iter().chain(EXTRA_PROPS).copied().collect::<Vec<_>>().join(",")
}

/// The journal fields [`gather`] reads (`--output-fields`); the timestamps always come along.
pub const JOURNAL_FIELDS: &str = "MESSAGE,_PID,_COMM,SYSLOG_IDENTIFIER,_SYSTEMD_UNIT,_SYSTEMD_INVOCATION_ID,INVOCATION_ID,UNIT,OBJECT_SYSTEMD_UNIT,JOB_TYPE,_TRANSPORT,_UID,PRIORITY,SPECD_ACTION,SPECD_INVOCATION_ID";

/// The unit as it is on disk, and the process that runs now: for "started with a stale config".
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ConfigCheck {
    /// systemd's `NeedDaemonReload=` now: the files on disk differ from what it has loaded.
    pub need_daemon_reload: bool,
    /// Newest modification time of the unit file and its drop-ins (µs since the epoch).
    pub unit_mtime_us: Option<u64>,
    /// The effective `ExecStart=` of the files on disk, as argv.
    pub disk_exec_start: Option<Vec<String>>,
    /// The `ExecStart=` systemd has loaded (space-joined argv).
    pub loaded_exec_start: Option<String>,
    /// `/proc/<MainPID>/cmdline` of the running instance.
    pub main_cmdline: Option<Vec<String>>,
}

/// Everything known about one instance of a unit.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Evidence {
    pub unit: String,
    /// The invocation ID; `None` when the journal had nothing for the unit and only systemd's
    /// current properties are known.
    pub invocation: Option<String>,
    /// `systemctl show` of the unit, when this is its newest instance (systemd keeps the
    /// result of the last run only).
    pub props: Option<UnitView>,
    /// The instance's journal: systemd's lines about it, its own output (the last
    /// [`SERVICE_TAIL`] lines), specd's markers. In time order.
    pub lines: Vec<Line>,
    /// Kernel OOM-killer lines that name this instance's cgroup (or its processes) in its time.
    pub kernel: Vec<Line>,
    /// Lines from elsewhere that may say who asked for a stop: sudo/polkit, specd, stop jobs of
    /// the units it depends on.
    pub requests: Vec<Line>,
    /// `oom_kill` of the cgroup's `memory.events` (v2) or `memory.oom_control` (v1), while the
    /// cgroup exists (the instance runs).
    pub oom_kill_count: Option<u64>,
    pub config: ConfigCheck,
}

impl Evidence {
    /// Whether this is the instance with invocation ID `id` (or a prefix of it, as shown).
    pub fn is_invocation(&self, id: &str) -> bool {
        self.invocation.as_deref().is_some_and(|i| i.starts_with(id))
    }
}

/// One line of evidence as a person reads it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct EvidenceLine {
    /// `2026-12-02T11:48:22.110Z`.
    pub time: String,
    pub source: Origin,
    pub text: String,
}

/// The verdict on one instance.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Diagnosis {
    pub unit: String,
    pub invocation: Option<String>,
    pub started: Option<String>,
    pub ended: Option<String>,
    pub verdict: Verdict,
    /// One line for a person.
    pub summary: String,
    /// Other findings about the instance (a stale config under another ending, an earlier
    /// CUDA OOM, a child killed by the OOM killer).
    pub notes: Vec<String>,
    pub evidence: Vec<EvidenceLine>,
}

// ---------------------------------------------------------------------------------------------
// Parsing (pure)

/// `2026-12-02T11:48:22.110Z` for microseconds since the epoch.
pub fn format_us(us: u64) -> String {
    let s = crate::state::format_time(us / 1_000_000);
    format!("{}.{:03}Z", s.trim_end_matches('Z'), (us % 1_000_000) / 1000)
}

fn json_str(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        // journald gives non-UTF-8 (or control-character) fields as arrays of bytes.
        serde_json::Value::Array(a) => {
            let bytes: Vec<u8> = a.iter().filter_map(|b| b.as_u64()).map(|b| b as u8).collect();
            Some(String::from_utf8_lossy(&bytes).into_owned())
        }
        serde_json::Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

/// Parses `journalctl -o json` output (one object a line; other lines are skipped).
pub fn parse_journal_json(text: &str) -> Vec<Line> {
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| {
            let f = |k: &str| v.get(k).and_then(json_str).filter(|s| !s.is_empty());
            let time_us = f("__REALTIME_TIMESTAMP")?.parse().ok()?;
            let pid: u32 = f("_PID").and_then(|p| p.parse().ok()).unwrap_or(0);
            let ident = f("SYSLOG_IDENTIFIER").or_else(|| f("_COMM")).unwrap_or_default();
            let transport = f("_TRANSPORT").unwrap_or_default();
            let origin = if transport == "kernel" {
                Origin::Kernel
            } else if pid == 1 && (ident == "systemd" || f("UNIT").is_some()) {
                Origin::Systemd
            } else if ident == "specd" {
                Origin::Specd
            } else if matches!(ident.as_str(), "sudo" | "polkitd" | "pkexec" | "run0" | "su") {
                Origin::Person
            } else if f("_SYSTEMD_INVOCATION_ID").is_some() || f("_SYSTEMD_UNIT").is_some() {
                Origin::Service
            } else {
                Origin::Other
            };
            let unit = match origin {
                Origin::Systemd => f("UNIT"),
                Origin::Service => f("_SYSTEMD_UNIT"),
                _ => f("OBJECT_SYSTEMD_UNIT").or_else(|| f("UNIT")),
            }
            .unwrap_or_default();
            let invocation = match origin {
                Origin::Systemd => f("INVOCATION_ID"),
                Origin::Service => f("_SYSTEMD_INVOCATION_ID"),
                _ => f("SPECD_INVOCATION_ID"),
            };
            Some(Line {
                time_us,
                origin,
                pid,
                ident,
                unit,
                invocation,
                job_type: f("JOB_TYPE"),
                action: if origin == Origin::Specd { f("SPECD_ACTION") } else { None },
                message: f("MESSAGE").unwrap_or_default(),
            })
        })
        .collect()
}

/// Parses the kernel ring buffer as `klogctl(SYSLOG_ACTION_READ_ALL)` (or `dmesg -r`) gives it:
/// `<4>[ 1073.557528] message`. `mono_to_real_us` is the wall clock at monotonic zero.
pub fn parse_kmsg(text: &str, mono_to_real_us: i64) -> Vec<Line> {
    text.lines()
        .filter_map(|l| {
            let l = l.trim_start();
            let l = match l.strip_prefix('<') {
                Some(r) => r.split_once('>')?.1,
                None => l,
            };
            let rest = l.trim_start().strip_prefix('[')?;
            let (ts, msg) = rest.split_once(']')?;
            let secs: f64 = ts.trim().parse().ok()?;
            let us = (secs * 1e6) as i64 + mono_to_real_us;
            Some(Line {
                time_us: us.max(0) as u64,
                origin: Origin::Kernel,
                ident: "kernel".into(),
                message: msg.trim().to_string(),
                ..Line::default()
            })
        })
        .collect()
}

/// Parses `systemctl show` output (`Key=value` lines).
pub fn parse_show(text: &str) -> UnitView {
    let m: BTreeMap<&str, &str> = text.lines().filter_map(|l| l.split_once('=')).collect();
    let s = |k: &str| m.get(k).copied().unwrap_or("").to_string();
    let words = |k: &str| -> Vec<String> { s(k).split_whitespace().map(str::to_string).collect() };
    let loaded_exec_start = m.get("ExecStart").and_then(|v| {
        let a = v.split_once("argv[]=")?.1;
        let end = a.find(" ; ").unwrap_or(a.len());
        Some(a[..end].trim().to_string())
    });
    let stop_deps = STOP_DEP_PROPS.iter().flat_map(|p| words(p).into_iter().map(|u| (p.to_string(), u))).collect();
    UnitView {
        id: s("Id"),
        props: crate::systemd::UnitProps::parse(text),
        slice: s("Slice"),
        loaded_exec_start,
        timeout_stop_us: m.get("TimeoutStopUSec").and_then(|v| parse_timespan_us(v)),
        watchdog_us: m.get("WatchdogUSec").and_then(|v| parse_timespan_us(v)).filter(|us| *us > 0),
        stop_deps,
    }
}

/// A systemd time span (`5min 30s`, `300ms`, `1h`, `90`, `infinity`) in microseconds.
pub fn parse_timespan_us(s: &str) -> Option<u64> {
    let s = s.trim();
    if s.is_empty() || s == "infinity" {
        return None;
    }
    let mut total = 0f64;
    for tok in s.split_whitespace() {
        let split = tok.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(tok.len());
        let (num, unit) = tok.split_at(split);
        let v: f64 = num.parse().ok()?;
        let mult = match unit {
            "" | "s" | "sec" => 1e6,
            "us" | "usec" => 1.0,
            "ms" | "msec" => 1e3,
            "m" | "min" => 60e6,
            "h" | "hr" => 3600e6,
            "d" => 86_400e6,
            _ => return None,
        };
        total += v * mult;
    }
    Some(total as u64)
}

fn fmt_secs(us: u64) -> String {
    let s = us as f64 / 1e6;
    if (s - s.round()).abs() < 0.05 { format!("{}", s.round() as u64) } else { format!("{s:.1}") }
}

/// The effective `ExecStart=` of a unit file and its drop-ins (in systemd's order): the last
/// non-empty assignment in `[Service]` after the last empty one. Continuation lines are joined.
pub fn effective_exec_start(files: &[&str]) -> Option<Vec<String>> {
    let mut exec: Option<String> = None;
    for text in files {
        let mut section = String::new();
        let mut pending = String::new();
        for raw in text.lines() {
            let l = raw.trim();
            if pending.is_empty() && (l.starts_with('#') || l.starts_with(';')) {
                continue;
            }
            if let Some(rest) = l.strip_suffix('\\') {
                pending.push_str(rest);
                pending.push(' ');
                continue;
            }
            let line = std::mem::take(&mut pending) + l;
            if line.starts_with('[') && line.ends_with(']') {
                section = line;
                continue;
            }
            if section != "[Service]" {
                continue;
            }
            if let Some((k, v)) = line.split_once('=')
                && k.trim() == "ExecStart"
            {
                let v = v.trim();
                exec = if v.is_empty() { None } else { Some(v.to_string()) };
            }
        }
    }
    let v = exec?;
    let v = v.trim_start_matches(['@', '-', ':', '+', '!']);
    Some(specd_spec::parse_command_line(v).unwrap_or_else(|| v.split_whitespace().map(str::to_string).collect()))
}

/// Kernel OOM-killer lines, grouped per kill: the `oom-kill:` summary line (cgroup, pid) and
/// the `Killed process` line.
#[derive(Clone, Debug, PartialEq, Eq)]
struct KernelKill {
    time_us: u64,
    pid: Option<u32>,
    memcg: Option<String>,
    lines: Vec<Line>,
}

fn kernel_kills(kernel: &[Line]) -> Vec<KernelKill> {
    let mut out: Vec<KernelKill> = Vec::new();
    let mut pending: Option<KernelKill> = None;
    for l in kernel {
        let m = &l.message;
        if let Some(rest) = m.strip_prefix("oom-kill:") {
            let kv: BTreeMap<&str, &str> = rest.split(',').filter_map(|p| p.split_once('=')).collect();
            if let Some(p) = pending.take() {
                out.push(p);
            }
            pending = Some(KernelKill {
                time_us: l.time_us,
                pid: kv.get("pid").and_then(|p| p.parse().ok()),
                memcg: kv.get("task_memcg").map(|s| s.to_string()),
                lines: vec![l.clone()],
            });
        } else if let Some(i) = m.find("Killed process ") {
            let pid: Option<u32> = m[i + 15..].split_whitespace().next().and_then(|p| p.parse().ok());
            match pending.take() {
                Some(mut p) if p.pid.is_none() || p.pid == pid => {
                    p.pid = pid;
                    p.lines.push(l.clone());
                    out.push(p);
                }
                other => {
                    out.extend(other);
                    out.push(KernelKill { time_us: l.time_us, pid, memcg: None, lines: vec![l.clone()] });
                }
            }
        }
    }
    out.extend(pending);
    out
}

/// Whether a kernel log line is one of the OOM killer's.
pub fn is_kernel_oom_line(m: &str) -> bool {
    m.starts_with("oom-kill:")
        || m.contains("Killed process ")
        || m.contains("invoked oom-killer")
        || m.starts_with("Memory cgroup out of memory")
        || m.starts_with("Out of memory")
}

// ---------------------------------------------------------------------------------------------
// Assembly: raw texts -> per-instance evidence (pure)

/// What [`gather`] reads, as text, so that tests can feed recorded output.
#[derive(Clone, Debug, Default)]
pub struct Raw {
    pub unit: String,
    /// `systemctl show UNIT` (at least [`show_props`]).
    pub show: String,
    /// `journalctl -o json` lines about the unit: systemd's, the service's, specd's markers.
    /// Any mix and order (the whole `journalctl -u UNIT -o json` will do).
    pub journal: String,
    /// `journalctl -o json` lines that may say who asked for a stop (sudo, polkit, specd, and
    /// systemd's stop jobs of the units this one depends on).
    pub context: String,
    /// Kernel lines (from `journalctl -k -o json` or the ring buffer).
    pub kernel: Vec<Line>,
    /// The unit file and drop-ins on disk (text), in systemd's order, and their newest mtime.
    pub unit_files: Vec<String>,
    pub unit_mtime_us: Option<u64>,
    /// `/proc/<MainPID>/cmdline` now.
    pub main_cmdline: Option<Vec<String>>,
    /// The live cgroup's OOM-kill count.
    pub oom_kill_count: Option<u64>,
}

/// Splits the journal into instances and attaches everything to each. Oldest first.
pub fn assemble(raw: &Raw) -> Vec<Evidence> {
    let view = parse_show(&raw.show);
    let unit = if raw.unit.is_empty() { view.id.clone() } else { raw.unit.clone() };
    let mut lines = parse_journal_json(&raw.journal);
    lines.sort_by_key(|l| l.time_us);
    lines.dedup();
    // Instances in order of first appearance.
    let mut order: Vec<String> = Vec::new();
    let mut by_id: BTreeMap<String, Vec<Line>> = BTreeMap::new();
    let mut loose: Vec<Line> = Vec::new();
    for l in lines {
        match l.invocation.clone() {
            Some(id) => {
                if !by_id.contains_key(&id) {
                    order.push(id.clone());
                }
                by_id.entry(id).or_default().push(l);
            }
            None => loose.push(l),
        }
    }
    if order.is_empty() && !view.props.invocation_id.is_empty() {
        order.push(view.props.invocation_id.clone());
    }
    let starts: Vec<u64> =
        order.iter().map(|id| by_id.get(id).and_then(|v| v.first()).map_or(0, |l| l.time_us)).collect();
    // Lines without an invocation ID (specd's markers, systemd's load warnings) belong to the
    // instance that was current when they were written.
    for l in loose {
        if order.is_empty() {
            break;
        }
        let i = starts.iter().rposition(|s| *s <= l.time_us).unwrap_or(0);
        by_id.entry(order[i].clone()).or_default().push(l);
    }
    let context = parse_journal_json(&raw.context);
    let kills = kernel_kills(&raw.kernel);
    let config_base = ConfigCheck {
        need_daemon_reload: view.props.need_daemon_reload,
        unit_mtime_us: raw.unit_mtime_us,
        disk_exec_start: {
            let files: Vec<&str> = raw.unit_files.iter().map(String::as_str).collect();
            effective_exec_start(&files)
        },
        loaded_exec_start: view.loaded_exec_start.clone(),
        main_cmdline: None,
    };
    let n = order.len();
    order
        .iter()
        .enumerate()
        .map(|(i, id)| {
            let mut ls = by_id.remove(id).unwrap_or_default();
            ls.sort_by_key(|l| l.time_us);
            // Only the last SERVICE_TAIL lines of the server's own output.
            let svc = ls.iter().filter(|l| l.origin == Origin::Service).count();
            if svc > SERVICE_TAIL {
                let mut skip = svc - SERVICE_TAIL;
                ls.retain(|l| {
                    if l.origin == Origin::Service && skip > 0 {
                        skip -= 1;
                        false
                    } else {
                        true
                    }
                });
            }
            let newest = i + 1 == n;
            let props = (newest && (view.props.invocation_id == *id || view.props.invocation_id.is_empty()))
                .then(|| view.clone());
            let start = ls.first().map_or(0, |l| l.time_us);
            let end = match starts.get(i + 1) {
                Some(next) => *next,
                None => u64::MAX,
            };
            let last = ls.last().map_or(start, |l| l.time_us);
            let pids: BTreeSet<u32> = ls.iter().filter(|l| l.origin == Origin::Service).map(|l| l.pid).collect();
            let lo = start.saturating_sub(1_000_000);
            let hi = if newest && props.as_ref().is_some_and(is_live) {
                u64::MAX
            } else {
                last.saturating_add(5_000_000).min(end)
            };
            let kernel = kills
                .iter()
                .filter(|k| k.time_us >= lo && k.time_us <= hi)
                .filter(|k| match (&k.memcg, k.pid) {
                    (Some(cg), _) => cg.split('/').any(|c| c == unit),
                    (None, Some(pid)) => pids.contains(&pid),
                    (None, None) => false,
                })
                .flat_map(|k| k.lines.clone())
                .collect();
            let stop_deps: BTreeSet<&str> = view.stop_deps.iter().map(|(_, u)| u.as_str()).collect();
            let requests = context
                .iter()
                .filter(|l| l.time_us + REQUEST_WINDOW_US >= start && l.time_us <= hi)
                .filter(|l| match l.origin {
                    Origin::Systemd => stop_deps.contains(l.unit.as_str()),
                    Origin::Specd => l.unit == unit || (l.unit.is_empty() && mentions(&l.message, &unit)),
                    Origin::Person => mentions(&l.message, &unit),
                    _ => false,
                })
                .cloned()
                .collect();
            let mut config = config_base.clone();
            if props.is_some() {
                config.main_cmdline = raw.main_cmdline.clone();
            }
            Evidence {
                unit: unit.clone(),
                invocation: Some(id.clone()),
                props: props.clone(),
                lines: ls,
                kernel,
                requests,
                oom_kill_count: if props.is_some() { raw.oom_kill_count } else { None },
                config,
            }
        })
        .collect()
}

fn is_live(v: &UnitView) -> bool {
    matches!(v.props.active_state.as_str(), "active" | "activating" | "deactivating" | "reloading")
        && v.props.sub_state != "auto-restart"
}

// ---------------------------------------------------------------------------------------------
// The classifier (pure)

/// The engines' own out-of-GPU-memory messages.
pub const CUDA_OOM_SIGNATURES: &[(&str, &str)] = &[
    ("CUDA out of memory", "PyTorch CUDA out of memory"),
    ("Not enough memory. Please try to increase --mem-fraction-static", "SGLang: not enough memory for the KV cache"),
    ("Capture cuda graph failed", "SGLang: CUDA graph capture failed (out of GPU memory)"),
    ("No available memory for the cache blocks", "vLLM: no available memory for the KV cache blocks"),
    ("CUDA error: out of memory", "CUDA runtime: out of memory"),
    ("cudaMalloc failed: out of memory", "llama.cpp: cudaMalloc failed: out of memory"),
];

fn cuda_signature(m: &str) -> Option<&'static str> {
    CUDA_OOM_SIGNATURES.iter().find(|(s, _)| m.contains(s)).map(|(_, what)| *what)
}

/// How the main process ended, as systemd reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Exit {
    Exited(i32),
    Killed(i32),
    Dumped(i32),
}

impl Exit {
    fn signal(self) -> Option<i32> {
        match self {
            Exit::Killed(s) | Exit::Dumped(s) => Some(s),
            Exit::Exited(_) => None,
        }
    }
    fn describe(self) -> String {
        match self {
            Exit::Exited(c) => format!("exit status {c}"),
            Exit::Killed(s) => format!("signal {s}/{}", sig_name(s)),
            Exit::Dumped(s) => format!("signal {s}/{} (core dumped)", sig_name(s)),
        }
    }
}

fn sig_name(s: i32) -> String {
    nix::sys::signal::Signal::try_from(s)
        .map(|s| s.as_str().trim_start_matches("SIG").to_string())
        .unwrap_or_else(|_| "?".into())
}

/// `X: Main process exited, code=killed, status=9/KILL`.
fn parse_exit_line(m: &str) -> Option<Exit> {
    let rest = m.split_once("Main process exited, code=")?.1;
    let (code, rest) = rest.split_once(", status=")?;
    let n: i32 = rest.split('/').next()?.trim().parse().ok()?;
    match code {
        "exited" => Some(Exit::Exited(n)),
        "killed" => Some(Exit::Killed(n)),
        "dumped" => Some(Exit::Dumped(n)),
        _ => None,
    }
}

fn quoted_after<'a>(m: &'a str, prefix: &str) -> Option<&'a str> {
    let rest = m.split_once(prefix)?.1;
    rest.split('\'').next()
}

/// The requests in flight the server last reported while draining.
fn in_flight(lines: &[&Line]) -> Option<u64> {
    const MARKS: &[&str] =
        &["Remaining number of requests ", "requests in flight: ", "in-flight requests: ", "in_flight=", "draining "];
    lines.iter().rev().find_map(|l| {
        MARKS.iter().find_map(|mk| {
            let i = l.message.find(mk)?;
            let digits: String = l.message[i + mk.len()..].chars().take_while(char::is_ascii_digit).collect();
            digits.parse().ok()
        })
    })
}

/// Whether a message names the unit (`llm.service`, or `llm` as a word).
fn mentions(m: &str, unit: &str) -> bool {
    let short = unit.strip_suffix(".service").unwrap_or(unit);
    m.split(|c: char| c.is_whitespace() || "\"'`,;:()[]{}=".contains(c)).any(|w| w == unit || w == short)
}

fn looks_like_error(m: &str) -> bool {
    const WORDS: &[&str] = &[
        "Error",
        "error",
        "ERROR",
        "Exception",
        "Traceback",
        "FATAL",
        "Fatal",
        "fatal",
        "panic",
        "failed",
        "Failed",
        "Killed",
        "Aborted",
        "Segmentation",
    ];
    WORDS.iter().any(|w| m.contains(w))
}

struct Builder {
    evidence: Vec<EvidenceLine>,
    seen: BTreeSet<(u64, String)>,
}

impl Builder {
    fn line(&mut self, l: &Line) {
        if self.seen.insert((l.time_us, l.message.clone())) {
            let who = match l.origin {
                Origin::Service | Origin::Other | Origin::Person | Origin::Specd => {
                    format!("{}[{}]: ", l.ident, l.pid)
                }
                _ => String::new(),
            };
            self.evidence.push(EvidenceLine {
                time: format_us(l.time_us),
                source: l.origin,
                text: format!("{who}{}", l.message),
            });
        }
    }
    fn text(&mut self, time_us: u64, source: Origin, text: String) {
        self.evidence.push(EvidenceLine {
            time: if time_us == 0 { "-".into() } else { format_us(time_us) },
            source,
            text,
        });
    }
}

/// Who asked for the stop whose systemd line is `stop`.
fn who_stopped(ev: &Evidence, stop: &Line) -> (String, Vec<Line>) {
    let window = |l: &Line| l.time_us + REQUEST_WINDOW_US >= stop.time_us && l.time_us <= stop.time_us + 1_000_000;
    let candidates: Vec<&Line> = ev.lines.iter().chain(ev.requests.iter()).filter(|l| window(l)).collect();
    if let Some(m) = candidates.iter().rev().find(|l| l.origin == Origin::Specd) {
        return ("specd".into(), vec![(*m).clone()]);
    }
    if let Some(m) = candidates.iter().rev().find(|l| {
        l.origin == Origin::Person
            && mentions(&l.message, &ev.unit)
            && ["stop", "restart", "kill", "isolate", "disable --now", "mask --now"]
                .iter()
                .any(|v| l.message.contains(v))
    }) {
        let user = match m.ident.as_str() {
            "sudo" => m.message.split(" : ").next().map(str::trim),
            _ => m.message.split("(owned by unix-user:").nth(1).and_then(|r| r.split(')').next()),
        }
        .filter(|u| !u.is_empty() && !u.contains(' '));
        let who = match user {
            Some(u) => format!("a person ({u}, via {})", m.ident),
            None => format!("a person (via {})", m.ident),
        };
        return (who, vec![(*m).clone()]);
    }
    let deps = ev.props.as_ref().map(|p| &p.stop_deps);
    // A dependency's stop job is in the same transaction: within seconds, before or after ours
    // (a unit ordered after its dependency stops first).
    if let Some(m) = ev.requests.iter().find(|l| {
        l.origin == Origin::Systemd
            && l.unit != ev.unit
            && l.message.starts_with("Stopping ")
            && l.time_us.abs_diff(stop.time_us) <= 5_000_000
    }) {
        let rel = deps
            .and_then(|d| d.iter().find(|(_, u)| *u == m.unit))
            .map(|(r, _)| format!(" ({}={})", r, m.unit))
            .unwrap_or_default();
        return (format!("a dependency: {} was being stopped{rel}", m.unit), vec![m.clone()]);
    }
    if stop.job_type.as_deref() == Some("restart") || ev.lines.iter().any(|l| l.job_type.as_deref() == Some("restart"))
    {
        return ("a restart request (the journal does not say whose)".into(), vec![]);
    }
    ("a stop request the journal does not attribute".into(), vec![])
}

/// Classifies one instance. Precedence, first match wins:
/// live (running, or stale-config start) → kernel/cgroup OOM kill → stop-timeout SIGKILL →
/// watchdog → start-limit-hit (the cause of the last failure in the summary) → CUDA OOM →
/// clean stop (a stop job ended it in time, or it exited 0) → crash → unknown.
/// A stale-config start under another ending is a note; on a clean stop it is the verdict.
pub fn classify(ev: &Evidence) -> Diagnosis {
    let mut b = Builder { evidence: Vec::new(), seen: BTreeSet::new() };
    let mut notes: Vec<String> = Vec::new();
    let lines: Vec<&Line> = ev.lines.iter().collect();
    let sys: Vec<&Line> = lines.iter().copied().filter(|l| l.origin == Origin::Systemd).collect();
    let svc: Vec<&Line> = lines.iter().copied().filter(|l| l.origin == Origin::Service).collect();
    let props = ev.props.as_ref();
    let started = lines.first().map(|l| l.time_us);
    let find = |pred: &dyn Fn(&str) -> bool| sys.iter().copied().find(|l| pred(&l.message));

    // What systemd says: from its current properties when they are this instance's, else
    // from its journal lines.
    let exit_line = sys.iter().copied().rfind(|l| parse_exit_line(&l.message).is_some());
    let exit = match props {
        Some(p) if p.props.exec_main_code != 0 => Some(match p.props.exec_main_code {
            1 => Exit::Exited(p.props.exec_main_status),
            3 => Exit::Dumped(p.props.exec_main_status),
            _ => Exit::Killed(p.props.exec_main_status),
        }),
        _ => exit_line.and_then(|l| parse_exit_line(&l.message)),
    };
    let result_line = sys.iter().copied().rfind(|l| l.message.contains("Failed with result '"));
    let success_line = find(&|m| m.ends_with("Deactivated successfully.") || m.ends_with(": Succeeded."));
    let result: Option<String> = match props {
        Some(p) if !p.props.result.is_empty() && !is_live(p) => Some(p.props.result.clone()),
        _ => result_line
            .and_then(|l| quoted_after(&l.message, "Failed with result '"))
            .map(str::to_string)
            .or_else(|| success_line.map(|_| "success".to_string())),
    };
    let stop_job = sys.iter().copied().find(|l| {
        l.message.starts_with("Stopping ") && l.job_type.as_deref().is_none_or(|j| j == "stop" || j == "restart")
    });
    let stop_timeout = find(&|m| {
        m.contains("State 'stop-sigterm' timed out. Killing.")
            || m.contains("State 'final-sigterm' timed out. Killing.")
            || m.contains("Stopping timed out. Killing.")
            || m.contains("State 'stop-watchdog' timed out")
    });
    let start_timeout = find(&|m| m.contains("Starting timed out") || m.contains("State 'start' timed out"));
    let watchdog = find(&|m| m.contains("Watchdog timeout"));
    let limit = find(&|m| m.contains("Start request repeated too quickly"));
    let systemd_oom = find(&|m| m.contains("killed by the OOM killer") || m.contains("Failed with result 'oom-kill'"));
    let sigkills: Vec<&Line> = sys.iter().copied().filter(|l| l.message.contains("with signal SIGKILL")).collect();
    let cuda: Vec<(&Line, &'static str)> =
        svc.iter().filter_map(|l| cuda_signature(&l.message).map(|w| (*l, w))).collect();
    let live = props.is_some_and(is_live);
    let ended = exit_line.or(result_line).or(success_line).map(|l| l.time_us).or_else(|| sys.last().map(|l| l.time_us));

    // Stale config: started after the unit file changed, with no reload since (systemd still
    // says NeedDaemonReload=yes), or the running command line is systemd's old one.
    let mut stale: Option<String> = None;
    let cfg = &ev.config;
    if cfg.need_daemon_reload
        && let (Some(m), Some(s)) = (cfg.unit_mtime_us, started)
        && m < s
    {
        stale = Some(format!(
            "started at {} although the unit file changed on disk at {} and systemd was not reloaded since (NeedDaemonReload=yes)",
            format_us(s),
            format_us(m)
        ));
    }
    if let (Some(cmd), Some(disk)) = (&cfg.main_cmdline, &cfg.disk_exec_start)
        && cmd != disk
        && cfg.loaded_exec_start.as_ref().is_none_or(|l| *l == cmd.join(" "))
    {
        let why = format!("its command line `{}` differs from the unit on disk `{}`", cmd.join(" "), disk.join(" "));
        stale = Some(match stale {
            Some(s) => format!("{s}; {why}"),
            None => why,
        });
    }
    let stale_evidence = |b: &mut Builder| {
        if let Some(first) = lines.first() {
            b.line(first);
        }
        b.text(
            cfg.unit_mtime_us.unwrap_or(0),
            Origin::Systemctl,
            format!(
                "NeedDaemonReload={}; unit file modified {}",
                if cfg.need_daemon_reload { "yes" } else { "no" },
                cfg.unit_mtime_us.map_or("-".into(), format_us)
            ),
        );
        if let (Some(cmd), Some(disk)) = (&cfg.main_cmdline, &cfg.disk_exec_start)
            && cmd != disk
        {
            b.text(0, Origin::Systemctl, format!("running: {}", cmd.join(" ")));
            b.text(0, Origin::Systemctl, format!("on disk: {}", disk.join(" ")));
            if let Some(l) = &cfg.loaded_exec_start {
                b.text(0, Origin::Systemctl, format!("systemd has loaded: {l}"));
            }
        }
    };
    let props_line = |b: &mut Builder| {
        if let Some(p) = props
            && !is_live(p)
        {
            b.text(
                ended.unwrap_or(0),
                Origin::Systemctl,
                format!(
                    "Result={} ExecMainCode={} ExecMainStatus={} NRestarts={}",
                    p.props.result, p.props.exec_main_code, p.props.exec_main_status, p.props.n_restarts
                ),
            );
        }
    };

    let finish = |verdict: Verdict, summary: String, b: Builder, mut notes: Vec<String>| {
        if verdict != Verdict::StaleConfigStart
            && let Some(s) = &stale
        {
            notes.push(format!("stale-config start: {s}"));
        }
        let mut evidence = b.evidence;
        evidence.sort_by(|a, b| a.time.cmp(&b.time));
        Diagnosis {
            unit: ev.unit.clone(),
            invocation: ev.invocation.clone(),
            started: started.map(format_us),
            ended: if live { None } else { ended.map(format_us) },
            verdict,
            summary,
            notes,
            evidence,
        }
    };

    // Other findings, whatever the verdict.
    if let Some(n) = ev.oom_kill_count.filter(|n| *n > 0) {
        notes.push(format!(
            "the kernel OOM killer has killed {n} process(es) in this unit's cgroup (memory.events oom_kill)"
        ));
    }

    // 1. Live.
    if live {
        if let Some((l, what)) = cuda.first() {
            b.line(l);
            return finish(
                Verdict::CudaOom,
                format!("CUDA OOM: {what}; the server logged it and has not exited yet (it is failing)"),
                b,
                notes,
            );
        }
        if let Some(s) = stale.clone() {
            stale_evidence(&mut b);
            return finish(
                Verdict::StaleConfigStart,
                format!("stale-config start: {s} — it runs systemd's old copy of the unit, not the file on disk"),
                b,
                notes,
            );
        }
        if let Some(first) = lines.first() {
            b.line(first);
        }
        let p = props.expect("live implies props");
        return finish(
            Verdict::Running,
            format!(
                "running ({}/{}, main pid {}){}",
                p.props.active_state,
                p.props.sub_state,
                p.props.main_pid,
                if p.props.n_restarts > 0 {
                    format!(", {} restarts so far", p.props.n_restarts)
                } else {
                    String::new()
                }
            ),
            b,
            notes,
        );
    }

    // 2. Kernel / cgroup OOM kill.
    let kernel_killed = ev.kernel.iter().find(|l| l.message.contains("Killed process "));
    let sigkill_exit = exit.is_some_and(|e| e.signal() == Some(9) || e == Exit::Exited(137));
    if result.as_deref() == Some("oom-kill")
        || systemd_oom.is_some()
        || (kernel_killed.is_some() && (sigkill_exit || exit.is_none()))
    {
        for l in ev.kernel.iter().filter(|l| is_kernel_oom_line(&l.message)) {
            b.line(l);
        }
        if let Some(l) = systemd_oom {
            b.line(l);
        }
        for l in [exit_line, result_line].into_iter().flatten() {
            b.line(l);
        }
        props_line(&mut b);
        let mut what = match kernel_killed {
            Some(k) => {
                let victim = k
                    .message
                    .split_once("Killed process ")
                    .map(|(_, r)| r.split(" total-vm").next().unwrap_or(r).trim().to_string())
                    .unwrap_or_default();
                let scope = if k.message.starts_with("Memory cgroup out of memory") {
                    "the memory cgroup limit was reached"
                } else {
                    "the machine ran out of memory"
                };
                format!("the kernel's OOM killer killed process {victim}: {scope}")
            }
            None => "systemd reports that the kernel's OOM killer killed a process of the unit".to_string(),
        };
        what.push_str(&match (result.as_deref(), exit) {
            (Some("oom-kill"), _) => " (Result=oom-kill)".to_string(),
            (r, Some(e)) => format!(" ({}{})", e.describe(), r.map(|r| format!(", Result={r}")).unwrap_or_default()),
            _ => String::new(),
        });
        if let Some((_, w)) = cuda.first() {
            notes.push(format!("the server also logged a CUDA OOM ({w})"));
        }
        return finish(Verdict::OomKill, format!("OOM kill: {what}"), b, notes);
    }

    // 3. Stop timeout: systemd's SIGKILL after TimeoutStopSec.
    let killed9 = exit.is_some_and(|e| e.signal() == Some(9));
    if stop_timeout.is_some()
        || (result.as_deref() == Some("timeout") && (stop_job.is_some() || killed9) && start_timeout.is_none())
    {
        let (who, who_lines) = match stop_job {
            Some(s) => who_stopped(ev, s),
            None => ("an unknown stop request".into(), vec![]),
        };
        for l in &who_lines {
            b.line(l);
        }
        for l in [stop_job, stop_timeout].into_iter().flatten() {
            b.line(l);
        }
        let drain: Vec<&Line> =
            svc.iter().copied().filter(|l| stop_job.is_none_or(|s| l.time_us + 1_000_000 >= s.time_us)).collect();
        // How the server took the SIGTERM, and the last it said before the kill.
        for l in drain.iter().take(1).chain(drain.iter().skip(1).rev().take(2)) {
            b.line(l);
        }
        for l in sigkills.iter().take(2) {
            b.line(l);
        }
        for l in [exit_line, result_line].into_iter().flatten() {
            b.line(l);
        }
        props_line(&mut b);
        // systemd's configured timeout when it is this instance's; else as the journal shows it.
        let after = match (props.and_then(|p| p.timeout_stop_us), stop_job, stop_timeout) {
            (Some(t), _, _) => format!("{} s after SIGTERM", fmt_secs(t)),
            (None, Some(s), Some(t)) => format!("{} s after SIGTERM", fmt_secs(t.time_us.saturating_sub(s.time_us))),
            _ => "after TimeoutStopSec".into(),
        };
        let still = match in_flight(&drain) {
            Some(n) => format!("while it was still draining ({n} requests in flight)"),
            None if !drain.is_empty() => "while it was still shutting down".to_string(),
            None => "while it had not exited after SIGTERM".to_string(),
        };
        let status = match exit {
            Some(e) if !killed9 => format!("; it ended with {}", e.describe()),
            _ => String::new(),
        };
        if let Some((l, w)) = cuda.first() {
            notes.push(format!("the server had logged a CUDA OOM at {} ({w})", format_us(l.time_us)));
        }
        return finish(
            Verdict::StopTimeoutKill,
            format!(
                "stop-timeout SIGKILL: systemd killed the server {after} (TimeoutStopSec) {still}{status} — not an OOM; the stop was requested by {who}"
            ),
            b,
            notes,
        );
    }

    // 4. Watchdog.
    if result.as_deref() == Some("watchdog") || watchdog.is_some() {
        for l in [watchdog, exit_line, result_line].into_iter().flatten() {
            b.line(l);
        }
        for l in sys.iter().filter(|l| l.message.contains("Killing process")) {
            b.line(l);
        }
        props_line(&mut b);
        let limit_s = props
            .and_then(|p| p.watchdog_us)
            .map(|w| format!(" (WatchdogSec={} s)", fmt_secs(w)))
            .or_else(|| {
                watchdog
                    .and_then(|w| w.message.split_once("(limit "))
                    .map(|(_, r)| format!(" (WatchdogSec={}", r.trim_end_matches('!')))
            })
            .unwrap_or_default();
        let status = exit.map(|e| format!("; it ended with {}", e.describe())).unwrap_or_default();
        return finish(
            Verdict::Watchdog,
            format!("watchdog: the server stopped sending keep-alives{limit_s} and systemd killed it{status}"),
            b,
            notes,
        );
    }

    // What ended the (last) run, for crash and start-limit summaries.
    let last_errors = || -> Vec<&Line> {
        let errs: Vec<&Line> = svc.iter().copied().filter(|l| looks_like_error(&l.message)).collect();
        let pick = if errs.is_empty() { svc.clone() } else { errs };
        pick.iter().rev().take(5).rev().copied().collect()
    };
    let cause = |b: &mut Builder| -> String {
        if let Some((l, w)) = cuda.first() {
            b.line(l);
            return format!("CUDA OOM ({w})");
        }
        let errs = last_errors();
        for l in &errs {
            b.line(l);
        }
        // The first error is usually the cause (a missing file), the last one how it ended.
        let first = svc.iter().find(|l| looks_like_error(&l.message)).filter(|f| errs.last() != Some(f));
        if let Some(f) = first {
            b.line(f);
        }
        let first = first.map(|l| format!(", first error: \"{}\"", l.message.trim())).unwrap_or_default();
        let last = errs.last().map(|l| format!(", last output: \"{}\"", l.message.trim())).unwrap_or_default();
        let last = format!("{first}{last}");
        match exit {
            Some(e) => format!("{}{last}", e.describe()),
            None => format!("Result={}{last}", result.as_deref().unwrap_or("?")),
        }
    };

    // 5. Start limit.
    if result.as_deref() == Some("start-limit-hit") || limit.is_some() {
        let c = cause(&mut b);
        for l in [exit_line, result_line, limit].into_iter().flatten() {
            b.line(l);
        }
        for l in sys.iter().filter(|l| l.message.contains("restart counter is at")) {
            b.line(l);
        }
        props_line(&mut b);
        let restarts = props
            .map(|p| p.props.n_restarts)
            .or_else(|| {
                sys.iter().rev().find_map(|l| {
                    l.message
                        .split_once("restart counter is at ")
                        .and_then(|(_, r)| r.trim_end_matches('.').parse().ok())
                })
            })
            .map(|n| format!(" after {n} restarts"))
            .unwrap_or_default();
        return finish(
            Verdict::StartLimitHit,
            format!(
                "start-limit-hit: systemd gave up restarting the server{restarts} (StartLimitBurst reached); the last run ended with {c}"
            ),
            b,
            notes,
        );
    }

    // 6. CUDA OOM (even when SGLang then SIGKILLs its own process tree).
    if let Some((l, what)) = cuda.first() {
        for (l, _) in cuda.iter().take(3) {
            b.line(l);
        }
        b.line(l);
        for l in [exit_line, result_line].into_iter().flatten() {
            b.line(l);
        }
        props_line(&mut b);
        let how = match exit {
            Some(e) if killed9 && sigkills.is_empty() => format!(
                "; it then ended with {} — sent by the server itself (SGLang kills its own process tree), not by systemd or the kernel",
                e.describe()
            ),
            Some(e) => format!("; it then ended with {}", e.describe()),
            None => String::new(),
        };
        return finish(Verdict::CudaOom, format!("CUDA OOM: the server ran out of GPU memory ({what}){how}"), b, notes);
    }

    // 7. Clean stop: a stop job ended it in time; or it exited 0 by itself.
    let by_systemd_kill = !sigkills.is_empty();
    let clean_status = match exit {
        None => result.as_deref() == Some("success"),
        Some(Exit::Exited(0)) => true,
        Some(Exit::Killed(s)) => matches!(s, 1 | 2 | 13 | 15) || (s == 9 && !by_systemd_kill),
        _ => false,
    } || result.as_deref() == Some("success");
    if let Some(stop) = stop_job
        && clean_status
    {
        let (who, who_lines) = who_stopped(ev, stop);
        for l in &who_lines {
            b.line(l);
        }
        // specd stopped a new instance that had failed (to roll back, or to leave it stopped):
        // what the server said before is the story. The note names the instance it is about.
        let rollback = who_lines.iter().any(|l| {
            l.origin == Origin::Specd
                && l.action.as_deref() == Some("rollback")
                && l.invocation.as_deref().is_none_or(|i| ev.is_invocation(i))
        });
        let errs: Vec<&Line> = svc.iter().copied().filter(|l| looks_like_error(&l.message)).collect();
        if rollback && let (Some(first), Some(last)) = (errs.first(), errs.last()) {
            for l in &errs[errs.len().saturating_sub(5)..] {
                b.line(l);
            }
            b.line(stop);
            props_line(&mut b);
            b.line(first);
            let (first, last) = (first.message.trim(), last.message.trim());
            let quoted = if first == last {
                format!("its last error: \"{last}\"")
            } else {
                format!("its first error: \"{first}\", its last: \"{last}\"")
            };
            return finish(
                Verdict::FailedStart,
                format!("failed start: the server did not start ({quoted}); specd then stopped it"),
                b,
                notes,
            );
        }
        b.line(stop);
        for l in [exit_line, result_line, success_line].into_iter().flatten() {
            b.line(l);
        }
        if let Some(l) = sys.iter().find(|l| l.message.starts_with("Stopped ")) {
            b.line(l);
        }
        props_line(&mut b);
        let took = ended
            .filter(|e| *e >= stop.time_us)
            .map(|e| match e - stop.time_us {
                d if d < 1_000_000 => " within a second of SIGTERM".to_string(),
                d => format!(" {} s after SIGTERM", fmt_secs(d)),
            })
            .unwrap_or_default();
        let how = match exit {
            Some(Exit::Killed(9)) => format!(
                ", then ended with SIGKILL{took} sent by the server itself (as SGLang does once drained), before TimeoutStopSec — not systemd, not the OOM killer"
            ),
            Some(e) => format!(" and ended with {}{took}", e.describe()),
            None => format!(" and ended{took}"),
        };
        let summary = format!("clean stop: stopped on request by {who}{how}");
        if let Some(s) = stale.clone() {
            stale_evidence(&mut b);
            return finish(
                Verdict::StaleConfigStart,
                format!("stale-config start: {s}; it ran systemd's old copy of the unit, then ended by a {summary}"),
                b,
                notes,
            );
        }
        return finish(Verdict::CleanStop, summary, b, notes);
    }
    let clean_signal =
        matches!(exit, Some(Exit::Killed(1 | 2 | 13 | 15))) && result.as_deref().is_none_or(|r| r == "success");
    if stop_job.is_none()
        && (exit == Some(Exit::Exited(0)) || clean_signal || (exit.is_none() && result.as_deref() == Some("success")))
    {
        for l in [exit_line, success_line].into_iter().flatten() {
            b.line(l);
        }
        props_line(&mut b);
        let status = exit.map_or_else(|| "Result=success".to_string(), |e| e.describe());
        let summary = if sys.is_empty() {
            format!(
                "clean stop: it ended with {status}; the journal has nothing about this instance, so whether it was asked to stop is unknown"
            )
        } else if clean_signal {
            format!(
                "clean stop: the server ended on {status} without a stop job (a signal sent with kill or `systemctl kill`, not a stop)"
            )
        } else {
            "clean stop: the server exited by itself with status 0".to_string()
        };
        if let Some(s) = stale.clone() {
            stale_evidence(&mut b);
            return finish(
                Verdict::StaleConfigStart,
                format!("stale-config start: {s}; it ran systemd's old copy of the unit, then exited 0"),
                b,
                notes,
            );
        }
        return finish(Verdict::CleanStop, summary, b, notes);
    }

    // 8. Crash.
    if exit.is_some() || result.as_deref().is_some_and(|r| r != "success") {
        let c = cause(&mut b);
        for l in [start_timeout, exit_line, result_line].into_iter().flatten() {
            b.line(l);
        }
        props_line(&mut b);
        let mut summary = match (start_timeout, stop_job) {
            (Some(_), _) => format!(
                "crash: the server did not finish starting within TimeoutStartSec and systemd terminated it ({c})"
            ),
            (None, Some(s)) => {
                b.line(s);
                format!("crash: the server failed while stopping: {c}")
            }
            (None, None) => format!("crash: the server died on its own: {c}"),
        };
        if killed9 && stop_job.is_none() && !by_systemd_kill {
            summary.push_str(
                " — SIGKILL outside any stop job: not from systemd; the kernel's OOM killer is the usual sender, but no kernel OOM line names this unit (is the kernel log readable?)",
            );
        } else if exit == Some(Exit::Exited(137)) {
            summary.push_str(" (137 = 128+9: a process the server waited for was SIGKILLed)");
        }
        return finish(Verdict::Crash, summary, b, notes);
    }

    // 9. Nothing says.
    for l in lines.iter().rev().take(3).rev() {
        b.line(l);
    }
    finish(
        Verdict::Unknown,
        "could not tell: the journal shows no end of this instance and systemd has no result for it".into(),
        b,
        notes,
    )
}

// ---------------------------------------------------------------------------------------------
// specd's own stop markers

/// journald's native socket.
pub const JOURNAL_SOCKET: &str = "/run/systemd/journal/socket";

/// Writes a journal entry about `unit` from specd (`SYSLOG_IDENTIFIER=specd`,
/// `OBJECT_SYSTEMD_UNIT=unit`, so that `journalctl -u unit` shows it): call it right before
/// specd stops or restarts a unit, so that diagnosis can say "stopped by specd".
pub fn journal_note(unit: &str, action: &str, invocation: Option<&str>, message: &str) -> std::io::Result<()> {
    journal_note_to(Path::new(JOURNAL_SOCKET), unit, action, invocation, message)
}

/// [`journal_note`] to a given socket (tests). `invocation`: the instance the note is about.
pub fn journal_note_to(
    socket: &Path,
    unit: &str,
    action: &str,
    invocation: Option<&str>,
    message: &str,
) -> std::io::Result<()> {
    let clean = |s: &str| s.replace(['\n', '\r'], " ");
    let mut datagram = format!(
        "MESSAGE={}\nPRIORITY=5\nSYSLOG_IDENTIFIER=specd\nOBJECT_SYSTEMD_UNIT={}\nSPECD_ACTION={}\n",
        clean(message),
        clean(unit),
        clean(action)
    );
    if let Some(i) = invocation.filter(|i| !i.is_empty()) {
        datagram.push_str(&format!("SPECD_INVOCATION_ID={}\n", clean(i)));
    }
    let sock = std::os::unix::net::UnixDatagram::unbound()?;
    sock.send_to(datagram.as_bytes(), socket)?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The gatherer (I/O)

async fn output(cmd: &str, args: &[String]) -> Result<String> {
    let out = Command::new(cmd).args(args).output().await.with_context(|| format!("running {cmd}"))?;
    if !out.status.success() {
        bail!("{cmd} {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn s(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

async fn journal(matches: &[String], extra: &[String]) -> Result<String> {
    let mut args = s(&["--no-pager", "-o", "json", &format!("--output-fields={JOURNAL_FIELDS}")]);
    args.extend_from_slice(extra);
    args.extend_from_slice(matches);
    output("journalctl", &args).await
}

fn mtime_us(p: &Path) -> Option<u64> {
    let m = std::fs::metadata(p).ok()?.modified().ok()?;
    m.duration_since(std::time::UNIX_EPOCH).ok().map(|d| d.as_micros() as u64)
}

/// The wall clock at monotonic zero, in µs (to place kernel ring-buffer timestamps).
fn mono_to_real_us() -> i64 {
    let now = |c| {
        let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: clock_gettime writes one timespec into `t`.
        let r = unsafe { libc::clock_gettime(c, &mut t) };
        (r == 0).then(|| t.tv_sec * 1_000_000 + t.tv_nsec / 1000)
    };
    match (now(libc::CLOCK_REALTIME), now(libc::CLOCK_MONOTONIC)) {
        (Some(r), Some(m)) => r - m,
        _ => 0,
    }
}

/// The kernel ring buffer (`syslog(2)`, `SYSLOG_ACTION_READ_ALL`): needs CAP_SYSLOG.
fn read_ring_buffer() -> Option<String> {
    // SAFETY: klogctl with SYSLOG_ACTION_SIZE_BUFFER (10) takes no buffer.
    let size = unsafe { libc::klogctl(10, std::ptr::null_mut(), 0) };
    if size <= 0 {
        return None;
    }
    let mut buf = vec![0u8; size as usize];
    // SAFETY: READ_ALL (3) writes at most `size` bytes into `buf`, which has that length.
    let n = unsafe { libc::klogctl(3, buf.as_mut_ptr().cast(), size) };
    if n <= 0 {
        return None;
    }
    buf.truncate(n as usize);
    Some(String::from_utf8_lossy(&buf).into_owned())
}

/// The kernel's OOM-killer lines since `since_us`: from the journal (`journalctl -k`), else
/// (journald not reading the kernel log, as in containers) from the ring buffer.
pub async fn kernel_oom_lines(since_us: u64) -> Vec<Line> {
    let since = format!("--since=@{}", since_us / 1_000_000);
    let from_journal = journal(&[], &s(&["-k", &since])).await.map(|t| parse_journal_json(&t)).unwrap_or_default();
    let mut oom: Vec<Line> = from_journal.into_iter().filter(|l| is_kernel_oom_line(&l.message)).collect();
    if oom.is_empty()
        && let Some(text) = tokio::task::spawn_blocking(read_ring_buffer).await.ok().flatten()
    {
        oom = parse_kmsg(&text, mono_to_real_us())
            .into_iter()
            .filter(|l| l.time_us + 2_000_000 >= since_us && is_kernel_oom_line(&l.message))
            .collect();
    }
    oom
}

/// The live cgroup's OOM-kill count: cgroup v2 `memory.events` (unified or hybrid layout),
/// else v1 `memory.oom_control`.
pub fn oom_kill_count(control_group: &str) -> Option<u64> {
    if control_group.is_empty() {
        return None;
    }
    let cg = control_group.trim_start_matches('/');
    let root = Path::new("/sys/fs/cgroup");
    let candidates = [
        (root.join(cg).join("memory.events"), "oom_kill "),
        (root.join("unified").join(cg).join("memory.events"), "oom_kill "),
        (root.join("memory").join(cg).join("memory.oom_control"), "oom_kill "),
    ];
    candidates.iter().find_map(|(p, key)| {
        let t = std::fs::read_to_string(p).ok()?;
        t.lines().find_map(|l| l.strip_prefix(key)).and_then(|v| v.trim().parse().ok())
    })
}

/// Reads everything about `unit` from this host (see [`Raw`]): the output of its newest
/// `max_instances` instances (older ones have only systemd's lines).
pub async fn gather_raw(unit: &str, max_instances: usize) -> Result<Raw> {
    let show = output("systemctl", &s(&["show", unit, "-p", &show_props()])).await?;
    let view = parse_show(&show);
    if view.props.load_state == "not-found" && view.props.invocation_id.is_empty() {
        bail!("{unit}: no such unit");
    }
    // systemd's lines about the unit and specd's markers (small), then each instance's own
    // output (its last lines only: a server logs a lot).
    let sys =
        journal(&s(&["_PID=1", &format!("UNIT={unit}"), "+", "_UID=0", &format!("OBJECT_SYSTEMD_UNIT={unit}")]), &[])
            .await?;
    let sys_lines = parse_journal_json(&sys);
    let mut ids: Vec<&str> = Vec::new();
    for l in &sys_lines {
        if let Some(id) = l.invocation.as_deref()
            && !ids.contains(&id)
        {
            ids.push(id);
        }
    }
    if !view.props.invocation_id.is_empty() && !ids.contains(&view.props.invocation_id.as_str()) {
        ids.push(&view.props.invocation_id);
    }
    let keep = ids.len().saturating_sub(max_instances);
    // The unit's latest output, also the lines journald could not tag with an invocation ID (a
    // process that dies right after writing is gone before journald looks up its cgroup).
    let mut journal_text = sys.clone();
    journal_text.push_str(
        &journal(&[format!("_SYSTEMD_UNIT={unit}")], &s(&["-n", &(SERVICE_TAIL * 4).to_string()]))
            .await
            .unwrap_or_default(),
    );
    for id in &ids[keep..] {
        let svc = journal(&[format!("_SYSTEMD_INVOCATION_ID={id}")], &s(&["-n", &SERVICE_TAIL.to_string()]))
            .await
            .unwrap_or_default();
        journal_text.push_str(&svc);
    }
    let since_us = sys_lines
        .iter()
        .filter(|l| l.invocation.as_deref().is_some_and(|i| ids[keep..].contains(&i)))
        .map(|l| l.time_us)
        .min()
        .unwrap_or(0);
    let since = format!("--since=@{}", since_us.saturating_sub(REQUEST_WINDOW_US) / 1_000_000);
    let mut ctx_matches = s(&["SYSLOG_IDENTIFIER=specd", "SYSLOG_IDENTIFIER=sudo", "SYSLOG_IDENTIFIER=polkitd"]);
    for (_, dep) in &view.stop_deps {
        ctx_matches.extend(s(&["+", "_PID=1", &format!("UNIT={dep}")]));
    }
    let context = journal(&ctx_matches, std::slice::from_ref(&since)).await.unwrap_or_default();
    let kernel = kernel_oom_lines(since_us.saturating_sub(1_000_000)).await;
    let mut files = Vec::new();
    let mut mtime = None;
    for p in std::iter::once(&view.props.fragment_path).chain(view.props.drop_in_paths.iter()) {
        if p.is_empty() {
            continue;
        }
        if let Ok(t) = std::fs::read_to_string(p) {
            files.push(t);
            mtime = mtime.max(mtime_us(Path::new(p)));
        }
    }
    let main_cmdline = (view.props.main_pid > 0).then(|| crate::cgroup::cmdline(view.props.main_pid)).flatten();
    Ok(Raw {
        unit: unit.to_string(),
        oom_kill_count: oom_kill_count(&view.props.control_group),
        show,
        journal: journal_text,
        context,
        kernel,
        unit_files: files,
        unit_mtime_us: mtime,
        main_cmdline,
    })
}

/// The evidence for each instance of `unit` (oldest first), or for one instance
/// (`invocation`, a prefix of its ID will do).
pub async fn gather(unit: &str, invocation: Option<&str>) -> Result<Vec<Evidence>> {
    gather_newest(unit, invocation, if invocation.is_some() { usize::MAX } else { MAX_INSTANCES }).await
}

/// [`gather`] for the newest `n` instances only.
pub async fn gather_newest(unit: &str, invocation: Option<&str>, n: usize) -> Result<Vec<Evidence>> {
    let raw = gather_raw(unit, n).await?;
    let mut all = assemble(&raw);
    all.drain(..all.len().saturating_sub(n));
    if let Some(id) = invocation {
        all.retain(|e| e.is_invocation(id));
        if all.is_empty() {
            bail!("{unit}: no instance with invocation ID {id} in the journal");
        }
    }
    Ok(all)
}

/// Diagnoses every instance of `unit`, newest first.
pub async fn diagnose_unit(unit: &str) -> Result<Vec<Diagnosis>> {
    let ev = gather(unit, None).await?;
    Ok(ev.iter().rev().map(classify).collect())
}

/// The verdict on the newest instance that has ended (for `specd status` and history).
/// Reads only the two newest instances (the current one may still run).
pub async fn last_verdict(unit: &str) -> Option<Diagnosis> {
    let ev = gather_newest(unit, None, 2).await.ok()?;
    ev.iter().rev().map(classify).find(|d| d.verdict.is_ending() && d.ended.is_some())
}

/// The verdict on one instance (by invocation ID) once the journal shows it ended, waiting up to
/// `within` for the journal to catch up: journald takes the server's output and systemd's own
/// lines on different sockets, so right after a stop the instance's end may not be written yet.
pub async fn instance_verdict(unit: &str, invocation: &str, within: std::time::Duration) -> Option<Diagnosis> {
    let started = tokio::time::Instant::now();
    let mut pause = std::time::Duration::from_millis(25);
    loop {
        // No journal to read: nothing to wait for. No line of this instance yet: journald
        // lags behind a busy host (seconds, with several servers loading); wait for it.
        // A failed read (systemd busy with a daemon-reload, a journal file being rotated) is
        // tried again like a missing line.
        let d = match gather_raw(unit, 4).await {
            Ok(raw) => assemble(&raw).iter().filter(|e| e.is_invocation(invocation)).map(classify).next_back(),
            Err(e) => {
                tracing::debug!(unit, invocation, "reading the instance's journal: {e:#}");
                None
            }
        };
        let waited = started.elapsed();
        match d {
            Some(d) if d.verdict.is_ending() && d.ended.is_some() => return Some(d),
            other if waited >= within => {
                tracing::debug!(unit, invocation, verdict = ?other.map(|d| d.verdict), "no ending of the instance in the journal");
                return None;
            }
            _ => {}
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(std::time::Duration::from_millis(400));
    }
}

/// A diagnosis as text: the verdict first, then the evidence with timestamps.
pub fn render_text(d: &Diagnosis) -> String {
    let mut out = format!(
        "{} {} [{}]: {}\n  {}\n",
        d.unit,
        d.invocation.as_deref().map(|i| &i[..i.len().min(12)]).unwrap_or("-"),
        match (&d.started, &d.ended) {
            (Some(s), Some(e)) => format!("{s} .. {e}"),
            (Some(s), None) => format!("{s} .. now"),
            _ => "-".into(),
        },
        d.verdict,
        d.summary
    );
    for n in &d.notes {
        out.push_str(&format!("  note: {n}\n"));
    }
    for e in &d.evidence {
        let src = serde_json::to_value(e.source).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default();
        out.push_str(&format!("    {} {:<9} {}\n", e.time, src, e.text));
    }
    out
}

/// How many instances the text output shows per unit.
const TEXT_INSTANCES: usize = 10;

/// `specd diagnose [UNIT] [--json]`: every instance of the unit (or of every unit specd has
/// state for), newest first. Exit 0 when every unit's newest instance was diagnosed, 2 when
/// specd could not tell for one (no unit, no journal, unknown verdict).
pub async fn run(unit: Option<&str>, json: bool, state_dir: &Path) -> Result<u8> {
    let units = match unit {
        Some(u) => vec![u.to_string()],
        None => crate::state::Store::new(state_dir).units()?,
    };
    if units.is_empty() {
        eprintln!("specd diagnose: specd has no state for any unit in {}; name a unit", state_dir.display());
        return Ok(2);
    }
    let mut code = 0u8;
    let mut all: Vec<Diagnosis> = Vec::new();
    for u in &units {
        match diagnose_unit(u).await {
            Ok(ds) => {
                if ds.first().is_none_or(|d| d.verdict == Verdict::Unknown) {
                    code = 2;
                }
                if ds.is_empty() {
                    eprintln!("{u}: no instance in the journal and no result from systemd");
                }
                if !json {
                    for d in ds.iter().take(TEXT_INSTANCES) {
                        print!("{}", render_text(d));
                    }
                    if ds.len() > TEXT_INSTANCES {
                        println!("  ({} older instances not shown; --json has them all)", ds.len() - TEXT_INSTANCES);
                    }
                }
                all.extend(ds);
            }
            Err(e) => {
                eprintln!("{u}: {e:#}");
                code = 2;
            }
        }
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&all)?);
    }
    Ok(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/diagnose")
    }

    fn read_opt(name: &str) -> Option<String> {
        std::fs::read_to_string(dir().join(name)).ok()
    }

    /// A recorded (or written) case as the gatherer would have read it.
    fn fixture(name: &str) -> Raw {
        let meta: serde_json::Value =
            serde_json::from_str(&read_opt(&format!("{name}.meta.json")).expect("meta")).unwrap();
        let unit_files = (0..).map_while(|i| read_opt(&format!("{name}.unit{i}"))).collect();
        Raw {
            unit: meta["unit"].as_str().unwrap().to_string(),
            show: read_opt(&format!("{name}.show")).expect("show"),
            journal: read_opt(&format!("{name}.journal.json")).expect("journal"),
            context: read_opt(&format!("{name}.context.json")).unwrap_or_default(),
            kernel: parse_journal_json(&read_opt(&format!("{name}.kernel.json")).unwrap_or_default()),
            unit_files,
            unit_mtime_us: meta["unit_mtime_us"].as_u64(),
            main_cmdline: meta["main_cmdline"]
                .as_array()
                .map(|a| a.iter().map(|w| w.as_str().unwrap().to_string()).collect()),
            oom_kill_count: None,
        }
    }

    /// Diagnoses of every instance, oldest first.
    fn diagnose(raw: &Raw) -> Vec<Diagnosis> {
        assemble(raw).iter().map(classify).collect()
    }

    fn newest(raw: &Raw) -> Diagnosis {
        diagnose(raw).pop().expect("an instance")
    }

    fn has_evidence(d: &Diagnosis, text: &str) -> bool {
        d.evidence.iter().any(|e| e.text.contains(text))
    }

    #[track_caller]
    fn assert_contains(hay: &str, needle: &str) {
        assert!(hay.contains(needle), "{needle:?} not in {hay:?}");
    }

    #[test]
    fn stop_timeout_is_not_an_oom_and_names_specd() {
        let ds = diagnose(&fixture("stop-timeout-stale"));
        assert_eq!(ds.len(), 2, "{ds:#?}");
        let d = &ds[1];
        assert_eq!(d.verdict, Verdict::StopTimeoutKill, "{d:#?}");
        assert_contains(
            &d.summary,
            "stop-timeout SIGKILL: systemd killed the server 2 s after SIGTERM (TimeoutStopSec)",
        );
        assert_contains(&d.summary, "(16 requests in flight)");
        assert_contains(&d.summary, "not an OOM");
        assert_contains(&d.summary, "requested by specd");
        assert!(has_evidence(d, "State 'stop-sigterm' timed out. Killing."), "{d:#?}");
        assert!(has_evidence(d, "specd: stopping seed.service"), "{d:#?}");
        assert!(has_evidence(d, "Result=timeout ExecMainCode=2 ExecMainStatus=9"), "{d:#?}");
        // The seed: this instance had been restarted after the unit file changed, unreloaded.
        assert_eq!(d.notes.len(), 1, "{d:#?}");
        assert_contains(&d.notes[0], "stale-config start");
        assert_contains(&d.notes[0], "NeedDaemonReload=yes");
        // The evidence is in time order and timestamped.
        let times: Vec<&str> = d.evidence.iter().map(|e| e.time.as_str()).collect();
        assert!(times.windows(2).all(|w| w[0] <= w[1]), "{times:?}");
        assert!(times.iter().all(|t| t.starts_with("2026-12-02T") && t.ends_with('Z')), "{times:?}");
        // The instance before: the same ending, from the journal alone (no systemctl for it),
        // stopped by the restart; it started before the unit file changed: not stale.
        let d0 = &ds[0];
        assert_eq!(d0.verdict, Verdict::StopTimeoutKill, "{d0:#?}");
        assert_contains(&d0.summary, "not an OOM");
        assert_contains(&d0.summary, "requested by a restart request");
        assert!(d0.notes.is_empty(), "{d0:#?}");
        assert!(!has_evidence(d0, "Result=timeout ExecMainCode"), "{d0:#?}");
    }

    #[test]
    fn sglang_killing_itself_after_draining_is_a_clean_stop() {
        let d = newest(&fixture("clean-stop-sglang-selfkill"));
        assert_eq!(d.verdict, Verdict::CleanStop, "{d:#?}");
        assert_contains(&d.summary, "stopped on request by specd");
        assert_contains(&d.summary, "sent by the server itself");
        assert_contains(&d.summary, "not systemd, not the OOM killer");
        assert!(has_evidence(&d, "Main process exited, code=killed, status=9/KILL"), "{d:#?}");
    }

    #[test]
    fn cuda_oom_with_sigkill_is_cuda_oom_not_a_crash() {
        let d = newest(&fixture("cuda-oom-sglang"));
        assert_eq!(d.verdict, Verdict::CudaOom, "{d:#?}");
        assert_contains(&d.summary, "PyTorch CUDA out of memory");
        assert_contains(&d.summary, "signal 9/KILL");
        assert_contains(&d.summary, "not by systemd or the kernel");
        assert!(has_evidence(&d, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"), "{d:#?}");
        let d = newest(&fixture("cuda-oom-vllm"));
        assert_eq!(d.verdict, Verdict::CudaOom, "{d:#?}");
        assert_contains(&d.summary, "vLLM");
        assert_contains(&d.summary, "exit status 1");
    }

    #[test]
    fn exit_3_is_a_crash_with_the_last_error() {
        let d = newest(&fixture("crash-exit3"));
        assert_eq!(d.verdict, Verdict::Crash, "{d:#?}");
        assert_contains(&d.summary, "exit status 3");
        assert_contains(&d.summary, "ValueError: Unknown speculative algorithm name: EAGLE4");
        assert!(has_evidence(&d, "Traceback (most recent call last):"), "{d:#?}");
        assert!(has_evidence(&d, "Failed with result 'exit-code'."), "{d:#?}");
    }

    #[test]
    fn watchdog() {
        let d = newest(&fixture("watchdog"));
        assert_eq!(d.verdict, Verdict::Watchdog, "{d:#?}");
        assert_contains(&d.summary, "WatchdogSec=1 s");
        assert_contains(&d.summary, "signal 6/ABRT");
        assert!(has_evidence(&d, "Watchdog timeout (limit 1s)!"), "{d:#?}");
    }

    #[test]
    fn start_limit_names_the_cause_of_the_last_failure() {
        let ds = diagnose(&fixture("start-limit-cuda"));
        assert_eq!(ds.len(), 3, "{ds:#?}");
        let d = ds.last().unwrap();
        assert_eq!(d.verdict, Verdict::StartLimitHit, "{d:#?}");
        assert_contains(&d.summary, "after 3 restarts");
        assert_contains(&d.summary, "CUDA OOM (SGLang: not enough memory for the KV cache)");
        assert!(has_evidence(d, "Start request repeated too quickly."), "{d:#?}");
        // The earlier instances each died of the same CUDA OOM (their output had no invocation
        // ID: the process was gone before journald looked; it is placed by time).
        for d in &ds[..2] {
            assert_eq!(d.verdict, Verdict::CudaOom, "{d:#?}");
        }
    }

    #[test]
    fn memory_hog_on_hybrid_host_is_an_oom_kill_from_the_kernel_line() {
        let raw = fixture("oom-kill-hybrid");
        let d = newest(&raw);
        assert_eq!(d.verdict, Verdict::OomKill, "{d:#?}");
        assert_contains(&d.summary, "the kernel's OOM killer killed process ");
        assert_contains(&d.summary, " (tail): the memory cgroup limit was reached");
        assert_contains(&d.summary, "memory cgroup limit");
        // systemd on a v1 memory controller cannot tell: Result=signal.
        assert_contains(&d.summary, "signal 9/KILL, Result=signal");
        assert!(has_evidence(&d, "Memory cgroup out of memory: Killed process "), "{d:#?}");
        assert!(has_evidence(&d, "/specd-box-"), "the kernel's line names the unit's cgroup: {d:#?}");
        // Without the kernel's line, a SIGKILL nobody asked for is a crash, with the hint.
        let mut blind = raw.clone();
        blind.kernel.clear();
        let d = newest(&blind);
        assert_eq!(d.verdict, Verdict::Crash, "{d:#?}");
        assert_contains(&d.summary, "SIGKILL outside any stop job");
        assert_contains(&d.summary, "no kernel OOM line names this unit");
    }

    #[test]
    fn oom_kill_reported_by_systemd_on_cgroup_v2() {
        let raw = fixture("oom-kill-v2");
        let d = newest(&raw);
        assert_eq!(d.verdict, Verdict::OomKill, "{d:#?}");
        assert_contains(&d.summary, "(Result=oom-kill)");
        assert!(has_evidence(&d, "A process of this unit has been killed by the OOM killer."), "{d:#?}");
        assert!(has_evidence(&d, "oom-kill:constraint=CONSTRAINT_MEMCG"), "{d:#?}");
        // systemd's word alone is enough.
        let mut blind = raw.clone();
        blind.kernel.clear();
        assert_eq!(newest(&blind).verdict, Verdict::OomKill);
    }

    #[test]
    fn kernel_lines_of_other_units_do_not_count() {
        // These captures hold the hog's kernel lines too (same box, same time span).
        for name in ["clean-stop-dependency", "clean-stop-unattributed", "stale-config-running"] {
            let raw = fixture(name);
            assert!(!raw.kernel.is_empty(), "{name}: the fixture should carry the hog's lines");
            for ev in assemble(&raw) {
                assert!(ev.kernel.is_empty(), "{name}: {:?}", ev.kernel);
            }
        }
    }

    #[test]
    fn who_stopped_it() {
        let d = newest(&fixture("clean-stop-dependency"));
        assert_eq!(d.verdict, Verdict::CleanStop, "{d:#?}");
        assert_contains(&d.summary, "a dependency: db.service was being stopped (BindsTo=db.service)");
        assert!(has_evidence(&d, "Stopping db.service..."), "{d:#?}");

        let mut raw = fixture("clean-stop-unattributed");
        let d = newest(&raw);
        assert_eq!(d.verdict, Verdict::CleanStop, "{d:#?}");
        assert_contains(&d.summary, "a stop request the journal does not attribute");
        assert_contains(&d.summary, "and ended within a second of SIGTERM");

        // sudo's lines (written by hand), placed just before systemd's stop job.
        let stop = parse_journal_json(&raw.journal).into_iter().find(|l| l.message.starts_with("Stopping ")).unwrap();
        for (i, l) in read_opt("clean-stop-sudo.context.json").unwrap().lines().enumerate() {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["__REALTIME_TIMESTAMP"] = (stop.time_us - 40_000 + i as u64 * 1000).to_string().into();
            raw.context.push_str(&format!("{v}\n"));
        }
        let d = newest(&raw);
        assert_eq!(d.verdict, Verdict::CleanStop, "{d:#?}");
        assert_contains(&d.summary, "stopped on request by a person (alice, via sudo)");
        assert!(has_evidence(&d, "COMMAND=/usr/bin/systemctl stop db"), "{d:#?}");
    }

    #[test]
    fn stale_config_start_of_a_running_instance() {
        let ds = diagnose(&fixture("stale-config-running"));
        assert_eq!(ds.len(), 2, "{ds:#?}");
        let d = &ds[1];
        assert_eq!(d.verdict, Verdict::StaleConfigStart, "{d:#?}");
        assert_contains(&d.summary, "NeedDaemonReload=yes");
        assert_contains(&d.summary, "differs from the unit on disk");
        assert_contains(&d.summary, "--speculative-num-steps 3");
        assert_contains(&d.summary, "--speculative-num-steps 5");
        assert!(d.ended.is_none());
        // The instance the restart stopped had started before the edit.
        assert_eq!(ds[0].verdict, Verdict::CleanStop, "{:#?}", ds[0]);
        assert_contains(&ds[0].summary, "restart");
    }

    #[test]
    fn running_and_healthy() {
        let mut raw = fixture("stale-config-running");
        raw.show = raw.show.replace("NeedDaemonReload=yes", "NeedDaemonReload=no");
        raw.main_cmdline = None;
        let d = newest(&raw);
        assert_eq!(d.verdict, Verdict::Running, "{d:#?}");
        assert!(d.notes.is_empty(), "{d:#?}");
    }

    fn sys(t: u64, m: &str) -> Line {
        Line {
            time_us: t * 1_000_000,
            origin: Origin::Systemd,
            pid: 1,
            ident: "systemd".into(),
            unit: "x.service".into(),
            invocation: Some("i1".into()),
            job_type: m.starts_with("Stopping ").then(|| "stop".into()),
            action: None,
            message: m.into(),
        }
    }

    fn svc(t: u64, m: &str) -> Line {
        Line {
            time_us: t * 1_000_000,
            origin: Origin::Service,
            pid: 77,
            ident: "python3".into(),
            unit: "x.service".into(),
            invocation: Some("i1".into()),
            job_type: None,
            action: None,
            message: m.into(),
        }
    }

    fn ev(lines: Vec<Line>) -> Evidence {
        Evidence { unit: "x.service".into(), invocation: Some("i1".into()), lines, ..Default::default() }
    }

    fn note(t_ms: u64, action: &str, invocation: &str) -> Line {
        Line {
            time_us: t_ms * 1000,
            origin: Origin::Specd,
            pid: 9,
            ident: "specd".into(),
            unit: "x.service".into(),
            invocation: Some(invocation.into()),
            action: Some(action.into()),
            message: format!("specd: stopping x.service ({action})"),
            ..Default::default()
        }
    }

    #[test]
    fn a_failed_start_that_specd_stopped_quotes_the_server_s_first_and_last_errors() {
        let lines = |n: Line| {
            vec![
                sys(0, "Started x.service."),
                svc(1, "E gguf_init_from_file: failed to open GGUF file '/models/missing.gguf'"),
                svc(2, "E srv    load_model: failed to load draft model, '/models/missing.gguf'"),
                n,
                sys(10, "Stopping x.service..."),
                sys(10, "x.service: Deactivated successfully."),
            ]
        };
        let d = classify(&ev(lines(note(9_900, "rollback", "i1"))));
        assert_eq!(d.verdict, Verdict::FailedStart, "{d:#?}");
        assert_contains(
            &d.summary,
            "its first error: \"E gguf_init_from_file: failed to open GGUF file '/models/missing.gguf'\"",
        );
        assert_contains(
            &d.summary,
            "its last: \"E srv    load_model: failed to load draft model, '/models/missing.gguf'\"",
        );
        // A plain stop to apply a new unit is a clean stop, whatever the server logged before.
        assert_eq!(classify(&ev(lines(note(9_900, "stop", "i1")))).verdict, Verdict::CleanStop);
        // A rollback note about another instance does not make this one a failed start.
        assert_eq!(classify(&ev(lines(note(9_900, "rollback", "i0")))).verdict, Verdict::CleanStop);
    }

    #[test]
    fn precedence_stop_timeout_over_an_earlier_cuda_oom() {
        let d = classify(&ev(vec![
            sys(0, "Started x.service."),
            svc(5, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB."),
            sys(10, "Stopping x.service..."),
            sys(310, "x.service: State 'stop-sigterm' timed out. Killing."),
            sys(310, "x.service: Killing process 77 (python3) with signal SIGKILL."),
            sys(310, "x.service: Main process exited, code=killed, status=9/KILL"),
            sys(310, "x.service: Failed with result 'timeout'."),
        ]));
        assert_eq!(d.verdict, Verdict::StopTimeoutKill, "{d:#?}");
        assert_contains(&d.summary, "300 s after SIGTERM");
        assert_contains(&d.notes[0], "CUDA OOM");
    }

    #[test]
    fn precedence_properties_only_when_the_journal_is_gone() {
        let mut e = ev(vec![]);
        e.props = Some(parse_show(
            "Id=x.service\nActiveState=failed\nSubState=failed\nResult=timeout\nExecMainCode=2\nExecMainStatus=9\nInvocationID=i1\nTimeoutStopUSec=5min\n",
        ));
        let d = classify(&e);
        assert_eq!(d.verdict, Verdict::StopTimeoutKill, "{d:#?}");
        assert_contains(&d.summary, "300 s after SIGTERM (TimeoutStopSec) while it had not exited after SIGTERM");
        assert!(has_evidence(&d, "Result=timeout ExecMainCode=2 ExecMainStatus=9"), "{d:#?}");

        e.props = Some(parse_show(
            "ActiveState=failed\nResult=oom-kill\nExecMainCode=2\nExecMainStatus=9\nInvocationID=i1\n",
        ));
        assert_eq!(classify(&e).verdict, Verdict::OomKill);
        e.props =
            Some(parse_show("ActiveState=failed\nResult=signal\nExecMainCode=2\nExecMainStatus=9\nInvocationID=i1\n"));
        assert_eq!(classify(&e).verdict, Verdict::Crash);
        e.props = Some(parse_show(
            "ActiveState=failed\nResult=exit-code\nExecMainCode=1\nExecMainStatus=3\nInvocationID=i1\n",
        ));
        assert_eq!(classify(&e).verdict, Verdict::Crash);
        e.props = Some(parse_show(
            "ActiveState=failed\nResult=start-limit-hit\nExecMainCode=1\nExecMainStatus=1\nInvocationID=i1\n",
        ));
        assert_eq!(classify(&e).verdict, Verdict::StartLimitHit);
        e.props = Some(parse_show(
            "ActiveState=inactive\nResult=success\nExecMainCode=1\nExecMainStatus=0\nInvocationID=i1\n",
        ));
        let d = classify(&e);
        assert_eq!(d.verdict, Verdict::CleanStop);
        assert_contains(&d.summary, "whether it was asked to stop is unknown");
        e.props = Some(parse_show(
            "ActiveState=failed\nResult=watchdog\nExecMainCode=2\nExecMainStatus=6\nInvocationID=i1\n",
        ));
        assert_eq!(classify(&e).verdict, Verdict::Watchdog);
        e.props = Some(parse_show("ActiveState=inactive\nInvocationID=i1\n"));
        assert_eq!(classify(&e).verdict, Verdict::Unknown);
    }

    #[test]
    fn precedence_kernel_oom_over_cuda_text_and_signal() {
        let mut e = ev(vec![
            sys(0, "Started x.service."),
            svc(4, "RuntimeError: CUDA error: out of memory"),
            sys(5, "x.service: Main process exited, code=killed, status=9/KILL"),
            sys(5, "x.service: Failed with result 'signal'."),
        ]);
        assert_eq!(classify(&e).verdict, Verdict::CudaOom);
        e.kernel = vec![Line {
            time_us: 4_900_000,
            origin: Origin::Kernel,
            message: "Out of memory: Killed process 77 (python3) total-vm:1kB".into(),
            ..Default::default()
        }];
        let d = classify(&e);
        assert_eq!(d.verdict, Verdict::OomKill, "{d:#?}");
        assert_contains(&d.summary, "the machine ran out of memory");
        assert_contains(&d.notes[0], "CUDA OOM");
    }

    #[test]
    fn precedence_a_stop_that_ends_in_a_non_zero_exit_is_a_crash_while_stopping() {
        let d = classify(&ev(vec![
            sys(0, "Started x.service."),
            sys(10, "Stopping x.service..."),
            svc(10, "Exception in thread shutdown: boom"),
            sys(11, "x.service: Main process exited, code=exited, status=1/FAILURE"),
            sys(11, "x.service: Failed with result 'exit-code'."),
        ]));
        assert_eq!(d.verdict, Verdict::Crash, "{d:#?}");
        assert_contains(&d.summary, "failed while stopping");
    }

    #[test]
    fn exit_0_on_its_own_and_sigterm_from_kill() {
        let d = classify(&ev(vec![sys(0, "Started x.service."), sys(3, "x.service: Deactivated successfully.")]));
        assert_eq!(d.verdict, Verdict::CleanStop, "{d:#?}");
        assert_contains(&d.summary, "exited by itself with status 0");
        let d = classify(&ev(vec![
            sys(0, "Started x.service."),
            sys(3, "x.service: Main process exited, code=killed, status=15/TERM"),
            sys(3, "x.service: Deactivated successfully."),
        ]));
        assert_eq!(d.verdict, Verdict::CleanStop, "{d:#?}");
        assert_contains(&d.summary, "signal 15/TERM without a stop job");
    }

    #[test]
    fn start_timeout_is_not_a_stop_timeout() {
        let d = classify(&ev(vec![
            sys(0, "Starting x.service..."),
            sys(90, "x.service: start operation timed out. Terminating."),
            sys(90, "x.service: Starting timed out. Terminating."),
            sys(91, "x.service: Main process exited, code=killed, status=15/TERM"),
            sys(91, "x.service: Failed with result 'timeout'."),
        ]));
        assert_eq!(d.verdict, Verdict::Crash, "{d:#?}");
        assert_contains(&d.summary, "did not finish starting");
    }

    #[test]
    fn verdicts_serialize_kebab_case() {
        let all = [
            (Verdict::StopTimeoutKill, "stop-timeout-kill"),
            (Verdict::OomKill, "oom-kill"),
            (Verdict::CudaOom, "cuda-oom"),
            (Verdict::Crash, "crash"),
            (Verdict::Watchdog, "watchdog"),
            (Verdict::StartLimitHit, "start-limit-hit"),
            (Verdict::CleanStop, "clean-stop"),
            (Verdict::FailedStart, "failed-start"),
            (Verdict::StaleConfigStart, "stale-config-start"),
            (Verdict::Running, "running"),
            (Verdict::Unknown, "unknown"),
        ];
        for (v, s) in all {
            assert_eq!(serde_json::to_value(v).unwrap(), serde_json::json!(s));
            assert_eq!(v.as_str(), s);
        }
    }

    #[test]
    fn text_output_puts_the_verdict_first_then_timestamped_evidence() {
        let d = newest(&fixture("crash-exit3"));
        let t = render_text(&d);
        let mut lines = t.lines();
        let head = lines.next().unwrap();
        assert!(head.starts_with("crash.service ") && head.ends_with(": crash"), "{t}");
        assert_contains(lines.next().unwrap(), "crash: the server died on its own: exit status 3");
        assert!(
            lines.any(|l| l.trim_start().starts_with("2026-12-02T") && l.contains("status=3/NOTIMPLEMENTED")),
            "{t}"
        );
    }

    #[test]
    fn parses_the_pieces() {
        assert_eq!(parse_timespan_us("5min"), Some(300_000_000));
        assert_eq!(parse_timespan_us("1min 30s"), Some(90_000_000));
        assert_eq!(parse_timespan_us("300ms"), Some(300_000));
        assert_eq!(parse_timespan_us("infinity"), None);
        assert_eq!(parse_exit_line("x: Main process exited, code=dumped, status=11/SEGV"), Some(Exit::Dumped(11)));
        assert_eq!(parse_exit_line("x: Main process exited, code=exited, status=137/n/a"), Some(Exit::Exited(137)));
        assert_eq!(format_us(1_796_210_280_123_456), "2026-12-02T11:18:00.123Z");
        // Drop-ins override ExecStart=, an empty assignment resets it; continuations join.
        let unit =
            "[Unit]\nDescription=x\n[Service]\nExecStart=/usr/bin/python3 -m sglang.launch_server \\\n  --port 30000\n";
        assert_eq!(
            effective_exec_start(&[unit]).unwrap(),
            ["/usr/bin/python3", "-m", "sglang.launch_server", "--port", "30000"]
        );
        let drop_in = "[Service]\nExecStart=\nExecStart=-/bin/sleep \"1 2\"\n";
        assert_eq!(effective_exec_start(&[unit, drop_in]).unwrap(), ["/bin/sleep", "1 2"]);
        assert_eq!(effective_exec_start(&["[Service]\nExecStart=\n"]), None);
        // The ring buffer, placed on the wall clock.
        let k = parse_kmsg(
            "<6>[ 1073.557474] oom-kill:constraint=CONSTRAINT_MEMCG,task_memcg=/a/x.service,task=sh,pid=9,uid=0\n<3>[ 1073.557528] Memory cgroup out of memory: Killed process 9 (sh) total-vm:1kB\n",
            1_000_000,
        );
        assert_eq!(k.len(), 2);
        assert_eq!(k[0].time_us, 1_074_557_474);
        let kills = kernel_kills(&k);
        assert_eq!(kills.len(), 1);
        assert_eq!(kills[0].pid, Some(9));
        assert_eq!(kills[0].memcg.as_deref(), Some("/a/x.service"));
        assert_eq!(kills[0].lines.len(), 2);
        // journald's byte-array form of a message.
        let l = parse_journal_json(
            "{\"__REALTIME_TIMESTAMP\":\"5\",\"_PID\":\"7\",\"_SYSTEMD_UNIT\":\"x.service\",\"MESSAGE\":[104,105,27]}\n",
        );
        assert_eq!(l[0].message, "hi\u{1b}");
        assert_eq!(l[0].origin, Origin::Service);
    }

    #[test]
    fn journal_note_writes_a_native_entry_about_the_unit() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("socket");
        let sock = std::os::unix::net::UnixDatagram::bind(&p).unwrap();
        journal_note_to(&p, "llm.service", "stop", Some("i1"), "specd: stopping llm.service\nfor apply").unwrap();
        let mut buf = [0u8; 4096];
        let n = sock.recv(&mut buf).unwrap();
        let text = std::str::from_utf8(&buf[..n]).unwrap();
        assert_eq!(
            text,
            "MESSAGE=specd: stopping llm.service for apply\nPRIORITY=5\nSYSLOG_IDENTIFIER=specd\nOBJECT_SYSTEMD_UNIT=llm.service\nSPECD_ACTION=stop\nSPECD_INVOCATION_ID=i1\n"
        );
    }
}
