//! How a reconcile's events read: on a terminal, in a pipe or a file (a one-shot command's
//! stderr), and in the agent's log.

use std::sync::Arc;
use std::time::Instant;

use crate::core::plan::Plan;
use crate::reconcile::{Event, Events};

/// Where the events of reconciles go.
#[derive(Clone, Copy, Debug)]
pub enum Sink {
    /// Progress lines on stderr, `[  12.3s] unit: message` (one-shot commands).
    Stderr,
    /// The agent's log.
    Log,
}

/// The one event sink: each event is described once, then written where `sink` says.
pub fn events(sink: Sink) -> Events {
    let t0 = Instant::now();
    match sink {
        Sink::Stderr => Arc::new(move |unit: &str, e: &Event| {
            let t = (t0.elapsed().as_secs_f64() * 1000.0).round() / 1000.0;
            let mut lines = crate::core::guard::lock(&STDERR);
            let out = lines.on(unit, t, e, Instant::now());
            write(&mut lines, out);
        }),
        Sink::Log => {
            let last = std::sync::Mutex::new(std::collections::HashMap::<String, Instant>::new());
            // A unit's last plan, and when it was logged: the same plan again soon (a replica
            // waiting for its group, asking every second) is logged now and then only.
            let plans = std::sync::Mutex::new(std::collections::HashMap::<String, (Plan, Instant)>::new());
            Arc::new(move |unit: &str, e: &Event| match e {
                Event::Plan(p) if p.steps.is_empty() => {
                    tracing::debug!(unit, sync = %p.sync, reasons = ?p.reasons, "observed")
                }
                Event::Plan(p) => {
                    let now = Instant::now();
                    let mut plans = crate::core::guard::lock(&plans);
                    let again = plans.get(unit).is_some_and(|(q, t)| q == p && now.duration_since(*t) < WAITING_EVERY);
                    if again {
                        tracing::debug!(unit, sync = %p.sync, reasons = ?p.reasons, plan = %steps(p), "reconciling")
                    } else {
                        plans.insert(unit.to_string(), (p.clone(), now));
                        tracing::info!(unit, sync = %p.sync, reasons = ?p.reasons, plan = %steps(p), "reconciling")
                    }
                }
                Event::Phase(m) => tracing::info!(unit, "{m}"),
                Event::Progress(m) => tracing::info!(unit, "  {m}"),
                Event::Waiting(m) => {
                    let now = Instant::now();
                    let mut last = crate::core::guard::lock(&last);
                    if last.get(unit).is_none_or(|t| now.duration_since(*t) >= WAITING_EVERY) {
                        last.insert(unit.to_string(), now);
                        tracing::info!(unit, "  {m}");
                    }
                }
                Event::Warning(m) => tracing::warn!(unit, "{m}"),
            })
        }
    }
}

/// How often a waiting line (loading, stopping, draining) is written to a pipe, a file or the
/// journal: a server that loads for minutes says so a few times, not every 2 s.
pub const WAITING_EVERY: std::time::Duration = std::time::Duration::from_secs(30);

/// The one stderr of this process, and what is pending on it.
static STDERR: std::sync::LazyLock<std::sync::Mutex<Lines>> = std::sync::LazyLock::new(|| {
    let mut lines = Lines::new(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    lines.journal = crate::machine::log::Stderr::detect().journal;
    std::sync::Mutex::new(lines)
});

/// Writes what [`Lines`] says: whole lines, clearing a line shown in place first.
fn write(lines: &mut Lines, out: Vec<Out>) {
    use std::io::Write;
    let mut err = std::io::stderr().lock();
    for o in out {
        let clear = if std::mem::take(&mut lines.in_place) { "\r\x1b[2K" } else { "" };
        let _ = match o {
            Out::Line(l) => writeln!(err, "{clear}{l}"),
            Out::InPlace(l) => {
                lines.in_place = true;
                write!(err, "{clear}{l}").and_then(|()| err.flush())
            }
        };
    }
}

/// Progress lines held back in a pipe are written before the command's own last words.
pub fn flush_progress() {
    let mut lines = crate::core::guard::lock(&STDERR);
    let out = lines.flush();
    write(&mut lines, out);
}

/// What to write.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Out {
    Line(String),
    /// A line shown in place of the last one shown in place (a terminal only).
    InPlace(String),
}

/// How progress reads on stderr. On a terminal, every event is a line of its own and a waiting
/// line is rewritten in place. In a pipe or a file (a CI log, `2>file`), a unit's phases and
/// results are joined on one line (`stopping x; stopped after 3.2s; cgroup empty; writing …`)
/// that is written once a waiting line is due (at most every [`WAITING_EVERY`] after the last
/// line), or before a plan, a warning or the command's own last words: a server that loads for
/// 2 minutes takes a handful of lines, not sixty.
struct Lines {
    tty: bool,
    /// stderr is the journal: a warning's line starts with its priority (`<4>`), so that
    /// `journalctl -p warning` finds it (the others are the stream's default, info).
    journal: bool,
    /// A waiting line is shown in place (the next line clears it first).
    in_place: bool,
    /// Per unit: what is held back for its next line.
    held: std::collections::BTreeMap<String, Held>,
    /// Per unit: when its last line was written.
    last: std::collections::BTreeMap<String, Instant>,
}

/// A unit's line so far: its time and unit (`[  1.234s] u: `), then what happened, `; `-joined.
struct Held {
    at: String,
    parts: Vec<String>,
    /// The last part is a waiting line (the next one replaces it: only the latest figure counts).
    waiting: bool,
}

impl Held {
    fn line(&self) -> String {
        format!("{}{}", self.at, self.parts.join("; "))
    }
}

impl Lines {
    fn new(tty: bool) -> Lines {
        Lines { tty, journal: false, in_place: false, held: Default::default(), last: Default::default() }
    }

    fn on(&mut self, unit: &str, t: f64, e: &Event, now: Instant) -> Vec<Out> {
        let at = |m: &str| format!("[{t:7.3}s] {unit}: {m}");
        if self.tty {
            return vec![match e {
                Event::Plan(p) if p.steps.is_empty() => Out::Line(at(&format!("{}{}", p.sync, reasons(p)))),
                Event::Plan(p) => Out::Line(at(&format!("{}{}; plan: {}", p.sync, reasons(p), steps(p)))),
                Event::Phase(m) => Out::Line(at(m)),
                Event::Progress(m) => Out::Line(at(&format!("  {m}"))),
                Event::Waiting(m) => Out::InPlace(at(&format!("  {m}"))),
                Event::Warning(m) => Out::Line(at(&format!("WARNING: {m}"))),
            }];
        }
        let mut out: Vec<Out> = Vec::new();
        let due = self.last.get(unit).is_none_or(|l| now.duration_since(*l) >= WAITING_EVERY);
        let line = match e {
            Event::Phase(m) | Event::Progress(m) | Event::Waiting(m) => {
                let h = self.held.entry(unit.to_string()).or_insert_with(|| Held {
                    at: format!("[{t:7.3}s] {unit}: "),
                    parts: Vec::new(),
                    waiting: false,
                });
                let waiting = matches!(e, Event::Waiting(_));
                if waiting && h.waiting {
                    h.parts.pop();
                    // A line that only says how long it waited says when.
                    if h.parts.is_empty() {
                        h.at = format!("[{t:7.3}s] {unit}: ");
                    }
                }
                h.parts.push(m.clone());
                h.waiting = waiting;
                if !(waiting && due) {
                    return out;
                }
                self.held.remove(unit).map(|h| h.line()).unwrap_or_default()
            }
            Event::Plan(p) => {
                out.extend(self.held.remove(unit).map(|h| Out::Line(h.line())));
                match p.steps.is_empty() {
                    true => at(&format!("{}{}", p.sync, reasons(p))),
                    false => at(&format!("{}{}; plan: {}", p.sync, reasons(p), steps(p))),
                }
            }
            Event::Warning(m) => {
                out.extend(self.held.remove(unit).map(|h| Out::Line(h.line())));
                let p = if self.journal { "<4>" } else { "" };
                format!("{p}{}", at(&format!("WARNING: {m}")))
            }
        };
        self.last.insert(unit.to_string(), now);
        out.push(Out::Line(line));
        out
    }

    /// Whatever is held back, now.
    fn flush(&mut self) -> Vec<Out> {
        std::mem::take(&mut self.held).into_values().map(|h| Out::Line(h.line())).collect()
    }
}

/// A plan's steps as a person reads them: `Drain → Stop → …`.
fn steps(p: &Plan) -> String {
    p.steps.iter().map(|s| format!("{s:?}")).collect::<Vec<_>>().join(" → ")
}

/// `: why; why`, or nothing when the plan has no reasons.
fn reasons(p: &Plan) -> String {
    if p.reasons.is_empty() { String::new() } else { format!(": {}", p.reasons.join("; ")) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::plan::Step;
    use crate::core::sync::SyncStatus;

    /// The events of an apply whose server loads for `load` seconds (a waiting line every 2 s),
    /// fed to `lines`: what it writes.
    fn apply_loading(lines: &mut Lines, load: u64) -> Vec<Out> {
        let t0 = Instant::now();
        let plan = Plan {
            sync: SyncStatus::OutOfSync,
            reasons: vec!["the unit file differs".into()],
            steps: vec![Step::Stop, Step::WaitStopped, Step::WriteUnit, Step::Reload, Step::Start, Step::WaitReady],
            toward: crate::core::plan::Toward::Desired,
        };
        let mut events = vec![
            (0, Event::Plan(plan)),
            (0, Event::Phase("stopping u".into())),
            (3, Event::Progress("stopped after 3.0s; cgroup empty".into())),
            (3, Event::Phase("writing /etc/systemd/system/u (unit 1234)".into())),
            (3, Event::Phase("daemon-reload".into())),
            (3, Event::Phase("starting u".into())),
            (3, Event::Progress("pid 42 runs the rendered ExecStart".into())),
            (3, Event::Phase("waiting for http://127.0.0.1:8000/health (up to 600s)".into())),
        ];
        events.extend((1..=load / 2).map(|k| (3 + 2 * k, Event::Waiting(format!("loading: {}s", 2 * k)))));
        events.extend([
            (3 + load, Event::Progress(format!("ready after {load}.0s"))),
            (3 + load, Event::Phase("proving that the server speculates (32-token generation)".into())),
            (4 + load, Event::Progress("the server speculates: accept rate 80%".into())),
            (4 + load, Event::Progress("the server reports the spec's args (4 checked)".into())),
        ]);
        let mut out = Vec::new();
        for (at, e) in events {
            let now = t0 + std::time::Duration::from_secs(at);
            out.extend(lines.on("u", at as f64, &e, now));
        }
        out.extend(lines.flush());
        out
    }

    #[test]
    fn a_server_that_loads_for_two_minutes_takes_six_lines_in_a_pipe_and_one_in_place_on_a_terminal() {
        let out = apply_loading(&mut Lines::new(false), 120);
        let text: Vec<String> = out
            .iter()
            .map(|o| match o {
                Out::Line(l) => l.clone(),
                Out::InPlace(l) => panic!("in place in a pipe: {l}"),
            })
            .collect();
        assert_eq!(text.len(), 6, "{text:#?}");
        let all = text.join("\n");
        for said in [
            "[  0.000s] u: OutOfSync: the unit file differs; plan: Stop → WaitStopped → WriteUnit → Reload → Start → WaitReady",
            "[  0.000s] u: stopping u; stopped after 3.0s; cgroup empty; writing /etc/systemd/system/u (unit 1234); daemon-reload; starting u; pid 42 runs the rendered ExecStart; waiting for http://127.0.0.1:8000/health (up to 600s); loading: 28s",
            "[ 61.000s] u: loading: 58s",
            "[ 91.000s] u: loading: 88s",
            "[121.000s] u: loading: 118s",
            "[123.000s] u: loading: 120s; ready after 120.0s; proving that the server speculates (32-token generation); the server speculates: accept rate 80%; the server reports the spec's args (4 checked)",
        ] {
            assert!(text.iter().any(|l| l == said), "{said:?} is not in:\n{all}");
        }

        // On a terminal: every line as it comes, the loading line rewritten in place.
        let out = apply_loading(&mut Lines::new(true), 120);
        let in_place = out.iter().filter(|o| matches!(o, Out::InPlace(_))).count();
        assert_eq!(in_place, 60);
        assert_eq!(out.len() - in_place, 12, "{out:#?}");
    }

    #[test]
    fn a_phase_held_back_in_a_pipe_is_written_before_a_warning_and_at_the_end() {
        let mut l = Lines::new(false);
        let now = Instant::now();
        assert!(l.on("u", 0.0, &Event::Phase("enabling u (at boot)".into()), now).is_empty());
        let out = l.on("u", 0.1, &Event::Warning("enabling u failed".into()), now);
        assert_eq!(
            out,
            [
                Out::Line("[  0.000s] u: enabling u (at boot)".into()),
                Out::Line("[  0.100s] u: WARNING: enabling u failed".into())
            ]
        );
        assert!(l.on("u", 0.2, &Event::Phase("proving".into()), now).is_empty());
        // A waiting line not due yet waits with the rest; another unit's lines are its own.
        assert!(l.on("u", 0.3, &Event::Waiting("loading: 0s".into()), now).is_empty());
        assert!(l.on("v", 0.3, &Event::Progress("ready".into()), now).is_empty());
        assert_eq!(
            l.flush(),
            [Out::Line("[  0.200s] u: proving; loading: 0s".into()), Out::Line("[  0.300s] v: ready".into())]
        );
        assert!(l.flush().is_empty());

        // Under journald, the warning's line carries its priority, and only it.
        let mut l = Lines { journal: true, ..Lines::new(false) };
        assert!(l.on("u", 0.0, &Event::Phase("enabling u (at boot)".into()), now).is_empty());
        let out = l.on("u", 0.1, &Event::Warning("enabling u failed".into()), now);
        assert_eq!(
            out,
            [
                Out::Line("[  0.000s] u: enabling u (at boot)".into()),
                Out::Line("<4>[  0.100s] u: WARNING: enabling u failed".into())
            ]
        );
    }

    #[test]
    fn a_plan_reads_as_its_steps_and_reasons() {
        let p = Plan {
            sync: SyncStatus::OutOfSync,
            reasons: vec!["a".into(), "b".into()],
            steps: vec![Step::Stop, Step::WaitStopped, Step::Start],
            toward: crate::core::plan::Toward::Desired,
        };
        assert_eq!(steps(&p), "Stop → WaitStopped → Start");
        assert_eq!(reasons(&p), ": a; b");
        assert_eq!(reasons(&Plan { reasons: vec![], ..p }), "");
    }
}
