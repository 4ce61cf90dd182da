//! The facts of one instance, derived once from its evidence: what systemd, the server, the
//! kernel and the people around it said, as plain values. Pure. The rules read only these; the
//! narration reads these and the lines they point to.

use super::fatal::{Fatal, Level, fatal, level};
use super::{Evidence, Line, Origin, REQUEST_WINDOW_US, UnitView};
use crate::core::unit_state::ServiceResult;

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
pub(super) enum Exit {
    Exited(i32),
    Killed(i32),
    Dumped(i32),
}

impl Exit {
    pub fn signal(self) -> Option<i32> {
        match self {
            Exit::Killed(s) | Exit::Dumped(s) => Some(s),
            Exit::Exited(_) => None,
        }
    }

    pub fn describe(self) -> String {
        match self {
            Exit::Exited(c) => format!("exit status {c}"),
            Exit::Killed(s) => format!("signal {s}/{}", sig_name(s)),
            Exit::Dumped(s) => format!("signal {s}/{} (core dumped)", sig_name(s)),
        }
    }

    /// From `ExecMainCode=` (`CLD_EXITED` 1, `CLD_KILLED` 2, `CLD_DUMPED` 3) and `ExecMainStatus=`.
    fn from_code(code: u32, status: i32) -> Exit {
        match code {
            1 => Exit::Exited(status),
            3 => Exit::Dumped(status),
            _ => Exit::Killed(status),
        }
    }
}

fn sig_name(s: i32) -> String {
    nix::sys::signal::Signal::try_from(s)
        .map(|s| s.as_str().trim_start_matches("SIG").to_string())
        .unwrap_or_else(|_| "?".into())
}

/// `X: Main process exited, code=killed, status=9/KILL`.
pub(super) fn parse_exit_line(m: &str) -> Option<Exit> {
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

/// Whether a message names the unit (`llm.service`, or `llm` as a word).
pub(super) fn mentions(m: &str, unit: &str) -> bool {
    let short = unit.strip_suffix(".service").unwrap_or(unit);
    m.split(|c: char| c.is_whitespace() || "\"'`,;:()[]{}=".contains(c)).any(|w| w == unit || w == short)
}

/// A line of the server's that reports an error: at error level in the engine's log format;
/// without a level, holding a word of failure. A warning or info line never is, whatever it
/// says (vLLM warns at every start that it "failed" to raise its ulimit).
pub(super) fn looks_like_error(m: &str) -> bool {
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
    match level(m) {
        Some(l) => l == Level::Error,
        None => WORDS.iter().any(|w| m.contains(w)),
    }
}

/// Who asked for a stop, as far as the journal says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Requester<'a> {
    /// specd's own note.
    Specd(&'a Line),
    /// A person's `systemctl stop/restart/kill…` (sudo's or polkit's line); the user when named.
    Person {
        user: Option<&'a str>,
        line: &'a Line,
    },
    /// A stop job of a unit this one depends on, in the same transaction; the dependency
    /// (`BindsTo`…) when systemd lists it.
    Dependency {
        relation: Option<&'a str>,
        line: &'a Line,
    },
    /// A restart job, nobody named.
    Restart,
    Unattributed,
}

impl<'a> Requester<'a> {
    /// The line that names the requester.
    pub fn line(&self) -> Option<&'a Line> {
        match self {
            Requester::Specd(l) | Requester::Person { line: l, .. } | Requester::Dependency { line: l, .. } => Some(l),
            Requester::Restart | Requester::Unattributed => None,
        }
    }
}

/// Who asked for the stop whose systemd line is `stop`.
fn requester<'a>(ev: &'a Evidence, stop: &Line) -> Requester<'a> {
    let window = |l: &Line| l.time_us + REQUEST_WINDOW_US >= stop.time_us && l.time_us <= stop.time_us + 1_000_000;
    let candidates: Vec<&'a Line> = ev.lines.iter().chain(ev.requests.iter()).filter(|l| window(l)).collect();
    // specd's request is its note of a stop (`SPECD_ACTION`; the agent's own log lines are not
    // requests). A note about the instance before (stopped moments before this one started) is
    // not this stop's cause; one written after this instance started is, whichever instance it
    // names (a server that crashed and was restarted between specd's look and its stop).
    let started = ev.lines.iter().find(|l| l.origin != Origin::Specd).map(|l| l.time_us);
    let specd_stop = |l: &Line| {
        l.origin == Origin::Specd
            && l.action.is_some()
            && l.invocation.as_deref().is_none_or(|i| ev.is_invocation(i) || started.is_some_and(|s| l.time_us >= s))
    };
    if let Some(m) = candidates.iter().rev().find(|l| specd_stop(l)) {
        return Requester::Specd(m);
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
        return Requester::Person { user, line: m };
    }
    // A dependency's stop job is in the same transaction: within seconds, before or after ours
    // (a unit ordered after its dependency stops first).
    if let Some(m) = ev.requests.iter().find(|l| {
        l.origin == Origin::Systemd
            && l.unit != ev.unit
            && l.message.starts_with("Stopping ")
            && l.time_us.abs_diff(stop.time_us) <= 5_000_000
    }) {
        let relation =
            ev.props.as_ref().and_then(|p| p.stop_deps.iter().find(|(_, u)| *u == m.unit)).map(|(r, _)| r.as_str());
        return Requester::Dependency { relation, line: m };
    }
    if stop.job_type.as_deref() == Some("restart") || ev.lines.iter().any(|l| l.job_type.as_deref() == Some("restart"))
    {
        return Requester::Restart;
    }
    Requester::Unattributed
}

/// Why an instance runs (or ran) systemd's old copy of its unit rather than the file on disk.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Stale<'a> {
    /// (started, unit file changed), µs: it started after the change, and systemd still says
    /// `NeedDaemonReload=yes`.
    pub unreloaded: Option<(u64, u64)>,
    /// (running, on disk): its command line is systemd's loaded one, not the file's.
    pub differs: Option<(&'a [String], &'a [String])>,
}

impl<'a> Stale<'a> {
    fn of(ev: &'a Evidence, started: Option<u64>) -> Option<Stale<'a>> {
        let cfg = &ev.config;
        let unreloaded = match (cfg.need_daemon_reload, cfg.unit_mtime_us, started) {
            (true, Some(m), Some(s)) if m < s => Some((s, m)),
            _ => None,
        };
        let differs = match (&cfg.main_cmdline, &cfg.disk_exec_start) {
            (Some(cmd), Some(disk))
                if cmd != disk && cfg.loaded_exec_start.as_ref().is_none_or(|l| *l == cmd.join(" ")) =>
            {
                Some((cmd.as_slice(), disk.as_slice()))
            }
            _ => None,
        };
        (unreloaded.is_some() || differs.is_some()).then_some(Stale { unreloaded, differs })
    }
}

/// The facts of one instance. `Default` is an instance the journal says nothing about.
#[derive(Clone, Debug, Default)]
pub(super) struct Facts<'a> {
    /// All its lines, systemd's, its own (the server's), and the server's that look like errors.
    pub lines: Vec<&'a Line>,
    pub sys: Vec<&'a Line>,
    pub svc: Vec<&'a Line>,
    pub errors: Vec<&'a Line>,
    /// The server's own fatal error in its output (its last exception, its error lines).
    pub fatal: Option<Fatal<'a>>,
    /// systemd's properties, when they are this instance's.
    pub props: Option<&'a UnitView>,
    /// It runs now (systemd's properties say so).
    pub live: bool,
    /// First line, and when it ended (its exit, result or last systemd line), µs.
    pub started: Option<u64>,
    pub ended: Option<u64>,
    /// How the main process ended: systemd's properties, else its "Main process exited" line.
    pub exit: Option<Exit>,
    pub exit_line: Option<&'a Line>,
    /// systemd's `Result=`: its properties (once ended), else "Failed with result '…'", else
    /// `success` after "Deactivated successfully.".
    pub result: Option<ServiceResult>,
    pub result_line: Option<&'a Line>,
    pub success_line: Option<&'a Line>,
    /// systemd's stop (or restart) job of this instance.
    pub stop_job: Option<&'a Line>,
    /// Who asked for that stop.
    pub requester: Option<Requester<'a>>,
    /// specd stopped it to roll back: its note names this instance (or no instance).
    pub rolled_back: bool,
    /// systemd's lines: a stop outlived `TimeoutStopSec=`, a start `TimeoutStartSec=`, the
    /// watchdog fired, the start limit was hit, the OOM killer killed a process of the unit.
    pub stop_timeout: Option<&'a Line>,
    pub start_timeout: Option<&'a Line>,
    pub watchdog: Option<&'a Line>,
    pub start_limit: Option<&'a Line>,
    pub systemd_oom: Option<&'a Line>,
    /// systemd's own SIGKILLs ("Killing process … with signal SIGKILL").
    pub sigkills: Vec<&'a Line>,
    /// The kernel's "Killed process" line about this instance.
    pub kernel_killed: Option<&'a Line>,
    /// The server's CUDA OOM messages, with what each one means.
    pub cuda: Vec<(&'a Line, &'static str)>,
    pub stale: Option<Stale<'a>>,
    /// It never said it serves: the phase of its start its own lines told last, and when that
    /// began (µs) (`specd_spec::startup`, the engine whose lines tell the most).
    pub start_phase: Option<(&'static str, u64)>,
}

/// The phase a start that never said it serves was in last, and when it began.
fn start_phase(svc: &[&Line], started: Option<u64>) -> Option<(&'static str, u64)> {
    let lines: Vec<(u64, &str)> = svc.iter().map(|l| (l.time_us, l.message.as_str())).collect();
    let (_, t) = specd_spec::startup::of_any_engine(started?, &lines)?;
    t.ready_us.is_none().then(|| (t.current().phase, t.current().from_us))
}

impl<'a> Facts<'a> {
    /// Derives the facts of the instance `ev`.
    pub fn of(ev: &'a Evidence) -> Facts<'a> {
        let lines: Vec<&Line> = ev.lines.iter().collect();
        let sys: Vec<&Line> = lines.iter().copied().filter(|l| l.origin == Origin::Systemd).collect();
        let svc: Vec<&Line> = lines.iter().copied().filter(|l| l.origin == Origin::Service).collect();
        let find = |pred: &dyn Fn(&str) -> bool| sys.iter().copied().find(|l| pred(&l.message));
        let props = ev.props.as_ref();
        let live = props.is_some_and(UnitView::is_live);
        let started = lines.first().map(|l| l.time_us);

        let exit_line = sys.iter().copied().rfind(|l| parse_exit_line(&l.message).is_some());
        let exit = match props {
            Some(p) if p.props.exec_main_code != 0 => {
                Some(Exit::from_code(p.props.exec_main_code, p.props.exec_main_status))
            }
            _ => exit_line.and_then(|l| parse_exit_line(&l.message)),
        };
        let result_line = sys.iter().copied().rfind(|l| l.message.contains("Failed with result '"));
        let success_line = find(&|m| m.ends_with("Deactivated successfully.") || m.ends_with(": Succeeded."));
        let result = match props {
            Some(p) if !p.props.result.is_empty() && !live => Some(p.props.result.clone()),
            _ => result_line
                .and_then(|l| quoted_after(&l.message, "Failed with result '"))
                .map(ServiceResult::parse)
                .or_else(|| success_line.map(|_| ServiceResult::Success)),
        };
        let ended = exit_line.or(result_line).or(success_line).or(sys.last().copied()).map(|l| l.time_us);

        let stop_job = sys.iter().copied().find(|l| {
            l.message.starts_with("Stopping ") && l.job_type.as_deref().is_none_or(|j| j == "stop" || j == "restart")
        });
        let requester = stop_job.map(|s| requester(ev, s));
        let rolled_back = matches!(requester, Some(Requester::Specd(l))
            if l.action.as_deref() == Some("rollback") && l.invocation.as_deref().is_none_or(|i| ev.is_invocation(i)));

        Facts {
            errors: svc.iter().copied().filter(|l| looks_like_error(&l.message)).collect(),
            fatal: fatal(&svc),
            cuda: svc.iter().filter_map(|l| cuda_signature(&l.message).map(|w| (*l, w))).collect(),
            sigkills: sys.iter().copied().filter(|l| l.message.contains("with signal SIGKILL")).collect(),
            stop_timeout: find(&|m| {
                m.contains("State 'stop-sigterm' timed out. Killing.")
                    || m.contains("State 'final-sigterm' timed out. Killing.")
                    || m.contains("Stopping timed out. Killing.")
                    || m.contains("State 'stop-watchdog' timed out")
            }),
            start_timeout: find(&|m| m.contains("Starting timed out") || m.contains("State 'start' timed out")),
            watchdog: find(&|m| m.contains("Watchdog timeout")),
            start_limit: find(&|m| m.contains("Start request repeated too quickly")),
            systemd_oom: find(&|m| {
                m.contains("killed by the OOM killer") || m.contains("Failed with result 'oom-kill'")
            }),
            kernel_killed: ev.kernel.iter().find(|l| l.message.contains("Killed process ")),
            stale: Stale::of(ev, started),
            start_phase: start_phase(&svc, started),
            lines,
            sys,
            svc,
            props,
            live,
            started,
            ended,
            exit,
            exit_line,
            result,
            result_line,
            success_line,
            stop_job,
            requester,
            rolled_back,
        }
    }

    pub fn result_is(&self, r: ServiceResult) -> bool {
        self.result == Some(r)
    }

    /// The main process died of SIGKILL.
    pub fn killed9(&self) -> bool {
        self.exit.is_some_and(|e| e.signal() == Some(9))
    }

    /// systemd sent a SIGKILL itself.
    pub fn killed_by_systemd(&self) -> bool {
        !self.sigkills.is_empty()
    }

    /// The main process ended as a process ends after the kernel's OOM killer: SIGKILL, or
    /// status 137 (a shell whose child was SIGKILLed).
    pub fn sigkill_exit(&self) -> bool {
        self.killed9() || self.exit == Some(Exit::Exited(137))
    }

    /// Its end is what a requested stop looks like: exit 0, `Result=success`, a terminating
    /// signal, or a SIGKILL that systemd did not send (SGLang kills its own tree once drained).
    pub fn ended_as_asked(&self) -> bool {
        let by_status = match self.exit {
            None => self.result_is(ServiceResult::Success),
            Some(Exit::Exited(0)) => true,
            Some(Exit::Killed(s)) => matches!(s, 1 | 2 | 13 | 15) || (s == 9 && !self.killed_by_systemd()),
            _ => false,
        };
        by_status || self.result_is(ServiceResult::Success)
    }

    /// A stop job ended it, the way a requested stop ends.
    pub fn stopped_on_request(&self) -> bool {
        self.stop_job.is_some() && self.ended_as_asked()
    }

    /// A terminating signal (not SIGKILL) ended it, and systemd counts that a success.
    pub fn clean_signal(&self) -> bool {
        matches!(self.exit, Some(Exit::Killed(1 | 2 | 13 | 15)))
            && self.result.as_ref().is_none_or(|r| *r == ServiceResult::Success)
    }

    /// Without a stop job, it exited 0 (or on a terminating signal, or systemd says success).
    pub fn ended_cleanly_by_itself(&self) -> bool {
        self.stop_job.is_none()
            && (self.exit == Some(Exit::Exited(0))
                || self.clean_signal()
                || (self.exit.is_none() && self.result_is(ServiceResult::Success)))
    }
}
