//! One narration per verdict: the summary a person reads, the lines it cites (timestamped, in
//! time order) and further notes. Pure; reads the facts the verdict was decided on.

use std::collections::BTreeSet;

use super::facts::{Exit, Facts, Requester, Stale};
use super::parse::{format_us, is_kernel_oom_line};
use super::{Evidence, EvidenceLine, Line, Origin, Verdict};
use crate::core::unit_state::ServiceResult;

/// What a narration tells.
pub(super) struct Story {
    pub summary: String,
    /// In time order.
    pub evidence: Vec<EvidenceLine>,
    pub notes: Vec<String>,
}

/// Where an instance that ended had got in its start, when it never said it serves: `it ended
/// while starting, in phase weights (3.2s into it, 45.0s after its start)`.
pub(super) fn start_phase(f: &Facts) -> Option<String> {
    let (phase, from) = f.start_phase?;
    let (start, end) = (f.started?, f.ended?);
    let s = |us: u64| us as f64 / 1e6;
    Some(format!(
        "it ended while starting, in phase {phase} ({:.1}s into it, {:.1}s after its start)",
        s(end.saturating_sub(from)),
        s(end.saturating_sub(start))
    ))
}

/// Tells the story of verdict `v` on the instance `ev`, whose facts are `f`.
pub(super) fn narrate(v: Verdict, ev: &Evidence, f: &Facts) -> Story {
    let mut c = Cites::default();
    let mut notes = Vec::new();
    let summary = match v {
        Verdict::Running => running(f, &mut c),
        Verdict::CudaOom => cuda_oom(f, &mut c),
        Verdict::StaleConfigStart => stale_config(ev, f, &mut c),
        Verdict::OomKill => oom_kill(ev, f, &mut c, &mut notes),
        Verdict::StopTimeoutKill => stop_timeout(f, &mut c, &mut notes),
        Verdict::Watchdog => watchdog(f, &mut c),
        Verdict::StartLimitHit => start_limit(f, &mut c),
        Verdict::FailedStart => failed_start(f, &mut c),
        Verdict::CleanStop => clean_stop(f, &mut c),
        Verdict::Crash => crash(f, &mut c),
        Verdict::Unknown => unknown(f, &mut c),
    };
    let mut evidence = c.evidence;
    evidence.sort_by(|a, b| a.time.cmp(&b.time));
    Story { summary, evidence, notes }
}

/// The cited lines, each once.
#[derive(Default)]
struct Cites {
    evidence: Vec<EvidenceLine>,
    seen: BTreeSet<(u64, String)>,
}

impl Cites {
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

    fn lines<'l>(&mut self, ls: impl IntoIterator<Item = Option<&'l Line>>) {
        for l in ls.into_iter().flatten() {
            self.line(l);
        }
    }

    fn text(&mut self, time_us: u64, source: Origin, text: String) {
        self.evidence.push(EvidenceLine {
            time: if time_us == 0 { "-".into() } else { format_us(time_us) },
            source,
            text,
        });
    }

    /// systemd's result properties, when they are this ended instance's.
    fn props(&mut self, f: &Facts) {
        if let Some(p) = f.props
            && !f.live
        {
            self.text(
                f.ended.unwrap_or(0),
                Origin::Systemctl,
                format!(
                    "Result={} ExecMainCode={} ExecMainStatus={} NRestarts={}",
                    p.props.result, p.props.exec_main_code, p.props.exec_main_status, p.props.n_restarts
                ),
            );
        }
    }

    /// The first line, the unit file's state and the command lines that differ.
    fn stale(&mut self, ev: &Evidence, f: &Facts) {
        let cfg = &ev.config;
        if let Some(first) = f.lines.first() {
            self.line(first);
        }
        self.text(
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
            self.text(0, Origin::Systemctl, format!("running: {}", cmd.join(" ")));
            self.text(0, Origin::Systemctl, format!("on disk: {}", disk.join(" ")));
            if let Some(l) = &cfg.loaded_exec_start {
                self.text(0, Origin::Systemctl, format!("systemd has loaded: {l}"));
            }
        }
    }
}

/// `2`, `2.5` (seconds, for µs).
fn fmt_secs(us: u64) -> String {
    let s = us as f64 / 1e6;
    if (s - s.round()).abs() < 0.05 { format!("{}", s.round() as u64) } else { format!("{s:.1}") }
}

/// Why the instance ran a stale unit, in words.
pub(super) fn stale_reason(s: &Stale) -> String {
    let mut why = Vec::new();
    if let Some((started, changed)) = s.unreloaded {
        why.push(format!(
            "started at {} although the unit file changed on disk at {} and systemd was not reloaded since (NeedDaemonReload=yes)",
            format_us(started),
            format_us(changed)
        ));
    }
    if let Some((cmd, disk)) = s.differs {
        why.push(format!("its command line `{}` differs from the unit on disk `{}`", cmd.join(" "), disk.join(" ")));
    }
    why.join("; ")
}

/// Who asked for the stop, in words.
fn who(r: Option<&Requester>) -> String {
    match r {
        Some(Requester::Specd(_)) => "specd".into(),
        Some(Requester::Person { user: Some(u), line }) => format!("a person ({u}, via {})", line.ident),
        Some(Requester::Person { user: None, line }) => format!("a person (via {})", line.ident),
        Some(Requester::Dependency { relation, line }) => {
            let rel = relation.map(|r| format!(" ({r}={})", line.unit)).unwrap_or_default();
            format!("a dependency: {} was being stopped{rel}", line.unit)
        }
        Some(Requester::Restart) => "a restart request (the journal does not say whose)".into(),
        Some(Requester::Unattributed) => "a stop request the journal does not attribute".into(),
        None => "an unknown stop request".into(),
    }
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

fn running(f: &Facts, c: &mut Cites) -> String {
    c.lines([f.lines.first().copied()]);
    let Some(p) = f.props else { return "running".into() };
    let restarts = match p.props.n_restarts {
        0 => String::new(),
        n => format!(", {n} restarts so far"),
    };
    format!("running ({}/{}, main pid {}){restarts}", p.props.active_state, p.props.sub_state, p.props.main_pid)
}

fn cuda_oom(f: &Facts, c: &mut Cites) -> String {
    let Some(&(first, what)) = f.cuda.first() else { return "CUDA OOM".into() };
    if f.live {
        c.line(first);
        return format!("CUDA OOM: {what}; the server logged it and has not exited yet (it is failing)");
    }
    c.lines(f.cuda.iter().take(3).map(|(l, _)| Some(*l)));
    c.lines([f.exit_line, f.result_line]);
    c.props(f);
    let how = match f.exit {
        Some(e) if f.killed9() && !f.killed_by_systemd() => format!(
            "; it then ended with {} — sent by the server itself (SGLang kills its own process tree), not by systemd or the kernel",
            e.describe()
        ),
        Some(e) => format!("; it then ended with {}", e.describe()),
        None => String::new(),
    };
    format!("CUDA OOM: the server ran out of GPU memory ({what}){how}")
}

fn stale_config(ev: &Evidence, f: &Facts, c: &mut Cites) -> String {
    let why = f.stale.as_ref().map(stale_reason).unwrap_or_default();
    if f.live {
        c.stale(ev, f);
        return format!("stale-config start: {why} — it runs systemd's old copy of the unit, not the file on disk");
    }
    if let Some(stop) = f.stop_job {
        let summary = stopped_on_request(f, stop, c);
        c.stale(ev, f);
        return format!("stale-config start: {why}; it ran systemd's old copy of the unit, then ended by a {summary}");
    }
    ended_by_itself(f, c);
    c.stale(ev, f);
    format!("stale-config start: {why}; it ran systemd's old copy of the unit, then exited 0")
}

fn oom_kill(ev: &Evidence, f: &Facts, c: &mut Cites, notes: &mut Vec<String>) -> String {
    c.lines(ev.kernel.iter().filter(|l| is_kernel_oom_line(&l.message)).map(Some));
    c.lines([f.systemd_oom, f.exit_line, f.result_line]);
    c.props(f);
    let mut what = match f.kernel_killed {
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
    what.push_str(&match (&f.result, f.exit) {
        (Some(ServiceResult::OomKill), _) => " (Result=oom-kill)".to_string(),
        (r, Some(e)) => {
            format!(" ({}{})", e.describe(), r.as_ref().map(|r| format!(", Result={r}")).unwrap_or_default())
        }
        _ => String::new(),
    });
    if let Some((_, w)) = f.cuda.first() {
        notes.push(format!("the server also logged a CUDA OOM ({w})"));
    }
    format!("OOM kill: {what}")
}

fn stop_timeout(f: &Facts, c: &mut Cites, notes: &mut Vec<String>) -> String {
    c.lines([f.requester.as_ref().and_then(Requester::line)]);
    c.lines([f.stop_job, f.stop_timeout]);
    // How the server took the SIGTERM, and the last it said before the kill.
    let drain: Vec<&Line> =
        f.svc.iter().copied().filter(|l| f.stop_job.is_none_or(|s| l.time_us + 1_000_000 >= s.time_us)).collect();
    c.lines(drain.iter().take(1).chain(drain.iter().skip(1).rev().take(2)).map(|l| Some(*l)));
    c.lines(f.sigkills.iter().take(2).map(|l| Some(*l)));
    c.lines([f.exit_line, f.result_line]);
    c.props(f);
    // systemd's configured timeout when it is this instance's; else as the journal shows it.
    let after = match (f.props.and_then(|p| p.timeout_stop_us), f.stop_job, f.stop_timeout) {
        (Some(t), _, _) => format!("{} s after SIGTERM", fmt_secs(t)),
        (None, Some(s), Some(t)) => format!("{} s after SIGTERM", fmt_secs(t.time_us.saturating_sub(s.time_us))),
        _ => "after TimeoutStopSec".into(),
    };
    let still = match in_flight(&drain) {
        Some(n) => format!("while it was still draining ({n} requests in flight)"),
        None if !drain.is_empty() => "while it was still shutting down".to_string(),
        None => "while it had not exited after SIGTERM".to_string(),
    };
    let status = match f.exit {
        Some(e) if !f.killed9() => format!("; it ended with {}", e.describe()),
        _ => String::new(),
    };
    if let Some((l, w)) = f.cuda.first() {
        notes.push(format!("the server had logged a CUDA OOM at {} ({w})", format_us(l.time_us)));
    }
    format!(
        "stop-timeout SIGKILL: systemd killed the server {after} (TimeoutStopSec) {still}{status} — not an OOM; the stop was requested by {}",
        who(f.requester.as_ref())
    )
}

fn watchdog(f: &Facts, c: &mut Cites) -> String {
    c.lines([f.watchdog, f.exit_line, f.result_line]);
    c.lines(f.sys.iter().filter(|l| l.message.contains("Killing process")).map(|l| Some(*l)));
    c.props(f);
    let limit = f
        .props
        .and_then(|p| p.watchdog_us)
        .map(|w| format!(" (WatchdogSec={} s)", fmt_secs(w)))
        .or_else(|| {
            f.watchdog
                .and_then(|w| w.message.split_once("(limit "))
                .map(|(_, r)| format!(" (WatchdogSec={}", r.trim_end_matches('!')))
        })
        .unwrap_or_default();
    let status = f.exit.map(|e| format!("; it ended with {}", e.describe())).unwrap_or_default();
    format!("watchdog: the server stopped sending keep-alives{limit} and systemd killed it{status}")
}

/// What ended the (last) run, for the crash and start-limit summaries: a CUDA OOM, else the
/// exit with the server's own fatal error; without one, its first and last lines that look
/// like errors (its last lines when none does).
fn cause(f: &Facts, c: &mut Cites) -> String {
    if let Some((l, w)) = f.cuda.first() {
        c.line(l);
        return format!("CUDA OOM ({w})");
    }
    let ended = match f.exit {
        Some(e) => e.describe(),
        None => format!("Result={}", f.result.as_ref().map_or("?", |r| r.as_str())),
    };
    if let Some(e) = &f.fatal {
        c.lines(e.lines.iter().map(|l| Some(*l)));
        return format!("{ended}, the server's own error: \"{}\"", e.text);
    }
    let pick = if f.errors.is_empty() { &f.svc } else { &f.errors };
    let last5 = &pick[pick.len().saturating_sub(5)..];
    c.lines(last5.iter().map(|l| Some(*l)));
    // The first error is usually the cause (a missing file), the last one how it ended.
    let first = f.errors.first().copied().filter(|l| last5.last().copied() != Some(*l));
    c.lines([first]);
    let first = first.map(|l| format!(", first error: \"{}\"", l.message.trim())).unwrap_or_default();
    let last = last5.last().map(|l| format!(", last output: \"{}\"", l.message.trim())).unwrap_or_default();
    format!("{ended}{first}{last}")
}

fn start_limit(f: &Facts, c: &mut Cites) -> String {
    let cause = cause(f, c);
    c.lines([f.exit_line, f.result_line, f.start_limit]);
    c.lines(f.sys.iter().filter(|l| l.message.contains("restart counter is at")).map(|l| Some(*l)));
    c.props(f);
    let restarts = f
        .props
        .map(|p| p.props.n_restarts)
        .or_else(|| {
            f.sys.iter().rev().find_map(|l| {
                l.message.split_once("restart counter is at ").and_then(|(_, r)| r.trim_end_matches('.').parse().ok())
            })
        })
        .map(|n| format!(" after {n} restarts"))
        .unwrap_or_default();
    format!(
        "start-limit-hit: systemd gave up restarting the server{restarts} (StartLimitBurst reached); the last run ended with {cause}"
    )
}

/// specd stopped a new instance that had failed (to roll back, or to leave it stopped): what
/// the server said before is the story: its own fatal error, else its first and last lines
/// that look like errors.
fn failed_start(f: &Facts, c: &mut Cites) -> String {
    c.lines([f.requester.as_ref().and_then(Requester::line)]);
    if let Some(e) = &f.fatal {
        c.lines(e.lines.iter().map(|l| Some(*l)));
        c.lines([f.stop_job]);
        c.props(f);
        return format!(
            "failed start: the server did not start (the server's own error: \"{}\"); specd then stopped it",
            e.text
        );
    }
    c.lines(f.errors[f.errors.len().saturating_sub(5)..].iter().map(|l| Some(*l)));
    c.lines([f.stop_job]);
    c.props(f);
    c.lines([f.errors.first().copied()]);
    let (Some(first), Some(last)) = (f.errors.first(), f.errors.last()) else {
        return "failed start: the server did not start; specd then stopped it".into();
    };
    let (first, last) = (first.message.trim(), last.message.trim());
    let quoted = if first == last {
        format!("its last error: \"{last}\"")
    } else {
        format!("its first error: \"{first}\", its last: \"{last}\"")
    };
    format!("failed start: the server did not start ({quoted}); specd then stopped it")
}

fn clean_stop(f: &Facts, c: &mut Cites) -> String {
    match f.stop_job {
        Some(stop) => stopped_on_request(f, stop, c),
        None => ended_by_itself(f, c),
    }
}

/// A stop job (`stop`) ended it, the way a requested stop ends.
fn stopped_on_request(f: &Facts, stop: &Line, c: &mut Cites) -> String {
    c.lines([f.requester.as_ref().and_then(Requester::line)]);
    c.line(stop);
    c.lines([f.exit_line, f.result_line, f.success_line]);
    c.lines([f.sys.iter().copied().find(|l| l.message.starts_with("Stopped "))]);
    c.props(f);
    let took = f
        .ended
        .filter(|e| *e >= stop.time_us)
        .map(|e| match e - stop.time_us {
            d if d < 1_000_000 => " within a second of SIGTERM".to_string(),
            d => format!(" {} s after SIGTERM", fmt_secs(d)),
        })
        .unwrap_or_default();
    let how = match f.exit {
        Some(Exit::Killed(9)) => format!(
            ", then ended with SIGKILL{took} sent by the server itself (as SGLang does once drained), before TimeoutStopSec — not systemd, not the OOM killer"
        ),
        Some(e) => format!(" and ended with {}{took}", e.describe()),
        None => format!(" and ended{took}"),
    };
    format!("clean stop: stopped on request by {}{how}", who(f.requester.as_ref()))
}

/// Without a stop job, it exited 0 or ended on a terminating signal.
fn ended_by_itself(f: &Facts, c: &mut Cites) -> String {
    c.lines([f.exit_line, f.success_line]);
    c.props(f);
    let status = f.exit.map_or_else(|| "Result=success".to_string(), |e| e.describe());
    if f.sys.is_empty() {
        format!(
            "clean stop: it ended with {status}; the journal has nothing about this instance, so whether it was asked to stop is unknown"
        )
    } else if f.clean_signal() {
        format!(
            "clean stop: the server ended on {status} without a stop job (a signal sent with kill or `systemctl kill`, not a stop)"
        )
    } else {
        "clean stop: the server exited by itself with status 0".to_string()
    }
}

fn crash(f: &Facts, c: &mut Cites) -> String {
    let cause = cause(f, c);
    c.lines([f.start_timeout, f.exit_line, f.result_line]);
    c.props(f);
    let mut summary = match (f.start_timeout, f.stop_job) {
        (Some(_), _) => format!(
            "crash: the server did not finish starting within TimeoutStartSec and systemd terminated it ({cause})"
        ),
        (None, Some(s)) => {
            c.line(s);
            format!("crash: the server failed while stopping: {cause}")
        }
        (None, None) => format!("crash: the server died on its own: {cause}"),
    };
    if f.killed9() && f.stop_job.is_none() && !f.killed_by_systemd() {
        summary.push_str(
            " — SIGKILL outside any stop job: not from systemd; the kernel's OOM killer is the usual sender, but no kernel OOM line names this unit (is the kernel log readable?)",
        );
    } else if f.exit == Some(Exit::Exited(137)) {
        summary.push_str(" (137 = 128+9: a process the server waited for was SIGKILLed)");
    }
    summary
}

fn unknown(f: &Facts, c: &mut Cites) -> String {
    c.lines(f.lines.iter().rev().take(3).rev().map(|l| Some(*l)));
    "could not tell: the journal shows no end of this instance and systemd has no result for it".into()
}
