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
//! Layout, from text to verdict:
//! - `parse`: journal JSON, `systemctl show`, the kernel ring buffer, unit files (pure);
//! - `assemble`: what the gatherer read ([`Raw`]) → one [`Evidence`] per instance (pure);
//! - `facts`: one instance's evidence → its facts, derived once (pure);
//! - `fatal`: the server's own fatal error in its output, by the engine's conventions (pure);
//! - `rules`: the ordered rule table, facts → [`Verdict`], first match wins (pure);
//! - `narrate`: one narration per verdict: the summary, the cited lines, notes (pure);
//! - `gather`: the gatherer behind [`JournalSource`] (`systemctl`, `journalctl`, the kernel
//!   ring buffer, `/proc`, the cgroup), and the waiters [`instance_verdict`], [`last_verdict`];
//! - `journal`: specd's own notes in the journal ([`journal_note`]);
//! - `command`: `specd diagnose` ([`run`]).

mod assemble;
mod facts;
mod fatal;
mod gather;
mod journal;
mod narrate;
mod parse;
mod rules;
mod text;

use anyhow::Result;
use serde::{Deserialize, Serialize};

pub use assemble::{Raw, assemble};
pub use gather::{JournalSource, gather, gather_newest, gather_raw};
pub use journal::journal_note;
pub use parse::format_us;
pub use text::render_text;

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

    /// The server itself failed: what it said before it ended is the cause.
    pub fn is_server_failure(self) -> bool {
        matches!(self, Verdict::Crash | Verdict::FailedStart | Verdict::StartLimitHit | Verdict::CudaOom)
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
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
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
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
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
    pub props: crate::machine::systemd::UnitProps,
    pub slice: String,
    /// The `argv[]` of the `ExecStart=` systemd has loaded (space-joined, as systemd prints it).
    pub loaded_exec_start: Option<String>,
    pub timeout_stop_us: Option<u64>,
    pub watchdog_us: Option<u64>,
    /// Units whose stop stops this one, with the dependency: `("BindsTo", "db.service")`.
    pub stop_deps: Vec<(String, String)>,
}

impl UnitView {
    /// The instance still runs (or is starting, stopping, reloading), and is not waiting to be
    /// restarted.
    pub fn is_live(&self) -> bool {
        self.props.active_state.may_run() && self.props.sub_state != crate::core::unit_state::SubState::AutoRestart
    }
}

/// What the gatherer asks `systemctl show` for beyond the reconciler's [`crate::machine::systemd::PROPS`].
const EXTRA_PROPS: &[&str] =
    &["Id", "Slice", "ExecStart", "WatchdogUSec", "BindsTo", "PartOf", "Requires", "Requisite"];

/// The `-p` argument of the gatherer's `systemctl show`: the reconciler's properties (which
/// [`UnitView::props`] parses) and diagnosis' own.
pub fn show_props() -> String {
    crate::machine::systemd::PROPS.iter().chain(EXTRA_PROPS).copied().collect::<Vec<_>>().join(",")
}

/// The journal fields the gatherer reads (`--output-fields`); the timestamps always come along.
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
    /// The server's own fatal error, one line in its words (a Python exception with its message,
    /// llama.cpp's first and last error lines), when the server's failure ended the instance
    /// (a crash, a failed start, the start limit, a CUDA OOM).
    pub engine_error: Option<String>,
}

/// Classifies one instance: its facts are derived once, the first rule of [`rules::RULES`] that
/// holds gives the verdict, and that verdict's narration the summary and the cited lines.
/// A stale-config start under another ending is a note; on a clean stop it is the verdict.
pub fn classify(ev: &Evidence) -> Diagnosis {
    let f = facts::Facts::of(ev);
    let rule = rules::decide(&f);
    tracing::trace!(unit = ev.unit, invocation = ?ev.invocation, rule = rule.name, "diagnosed");
    let verdict = rule.verdict;
    let mut notes: Vec<String> = Vec::new();
    if let Some(n) = ev.oom_kill_count.filter(|n| *n > 0) {
        notes.push(format!(
            "the kernel OOM killer has killed {n} process(es) in this unit's cgroup (memory.events oom_kill)"
        ));
    }
    let story = narrate::narrate(verdict, ev, &f);
    notes.extend(story.notes);
    if let (false, Some(note)) = (f.live, narrate::start_phase(&f)) {
        notes.push(note);
    }
    if verdict != Verdict::StaleConfigStart
        && let Some(s) = &f.stale
    {
        notes.push(format!("stale-config start: {}", narrate::stale_reason(s)));
    }
    Diagnosis {
        unit: ev.unit.clone(),
        invocation: ev.invocation.clone(),
        started: f.started.map(format_us),
        ended: if f.live { None } else { f.ended.map(format_us) },
        verdict,
        summary: story.summary,
        notes,
        evidence: story.evidence,
        engine_error: f.fatal.filter(|_| verdict.is_server_failure()).map(|e| e.text),
    }
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

/// How long a read of what an instance said may take ([`said`]).
const SAID_WITHIN: std::time::Duration = std::time::Duration::from_secs(1);

/// What an instance wrote to its output after the journal's `cursor` (from its first line when
/// `None`): each line with the monotonic time (µs) the journal received it, and the cursor to
/// read on from (the last line's, or `cursor` when none came). `None`: the journal did not answer
/// within a second.
pub async fn said(invocation: &str, cursor: Option<&str>) -> Option<(Vec<(u64, String)>, Option<String>)> {
    if invocation.is_empty() || !invocation.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    // `--all`: a line over 4096 bytes (vLLM's engine config) would be null without it.
    let mut args = vec![
        format!("_SYSTEMD_INVOCATION_ID={invocation}"),
        "-ojson".into(),
        "--output-fields=MESSAGE".into(),
        "--all".into(),
        "--no-pager".into(),
    ];
    if let Some(c) = cursor {
        args.push(format!("--after-cursor={c}"));
    }
    let run = tokio::process::Command::new("journalctl").args(&args).kill_on_drop(true).output();
    let out = tokio::time::timeout(SAID_WITHIN, run).await.ok()?.ok()?;
    let (lines, last) = parse::said_lines(&String::from_utf8_lossy(&out.stdout));
    Some((lines, last.or_else(|| cursor.map(str::to_string))))
}

/// How long `first_said` reads an instance's journal for its line.
const FIRST_SAID_WITHIN: std::time::Duration = std::time::Duration::from_secs(5);

/// What follows `marker` on the first line of an instance's output that has it (an engine's
/// log of the args it runs with), from the journal; `Err` when the journal has no such line
/// or did not answer within 5 seconds. Reads from the instance's first line and stops at the
/// line: a server that ran for weeks has written much since.
pub async fn first_said(invocation: &str, marker: &str) -> Result<String, String> {
    use tokio::io::AsyncBufReadExt;
    if invocation.is_empty() || !invocation.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err("no running instance".into());
    }
    let read = async {
        let mut child = tokio::process::Command::new("journalctl")
            .args([&format!("_SYSTEMD_INVOCATION_ID={invocation}"), "-ocat", "--no-pager"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("journalctl: {e}"))?;
        let mut lines = tokio::io::BufReader::new(child.stdout.take().expect("piped")).lines();
        while let Some(line) = lines.next_line().await.map_err(|e| format!("reading the journal: {e}"))? {
            if let Some((_, after)) = line.split_once(marker) {
                return Ok(after.to_string());
            }
        }
        Err(format!("the instance's journal has no line with {:?} (yet)", marker.trim()))
    };
    tokio::time::timeout(FIRST_SAID_WITHIN, read)
        .await
        .unwrap_or_else(|_| Err(format!("the journal did not answer within {} s", FIRST_SAID_WITHIN.as_secs())))
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

#[cfg(test)]
mod tests;
