//! What the commands share: the one-shot commands (`ops`) and the agent (`specd run`) both
//! reconcile on this host, in the same directories, for the same hostname, and report what a
//! reconcile does through one event sink. Below the commands, so that neither imports the other
//! and neither imports the command line.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use crate::cgroup::Layout;
use crate::host::RealHost;
use crate::plan::Plan;
use crate::reconcile::{Ctx, Event, Events, Shutdown};
use crate::state::Store;

/// Where specd keeps its state and writes unit files.
#[derive(Clone, Debug)]
pub struct Dirs {
    pub state_dir: PathBuf,
    pub unit_dir: PathBuf,
}

/// The hostname whose overlays apply: `over`, else this machine's.
pub fn hostname(over: Option<String>) -> String {
    over.unwrap_or_else(|| nix::unistd::gethostname().map(|h| h.to_string_lossy().into_owned()).unwrap_or_default())
}

/// The reconcile context on this host: the machine (with its cgroup layout), the unit and state
/// directories.
pub fn host_ctx(dirs: &Dirs, events: Events, shutdown: Shutdown) -> Ctx<RealHost> {
    Ctx {
        host: RealHost::new(Layout::host()),
        unit_dir: dirs.unit_dir.clone(),
        store: Store::new(&dirs.state_dir),
        events,
        shutdown,
        holds: crate::reconcile::Holds::Overridden,
    }
}

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
    Arc::new(move |unit: &str, e: &Event| match sink {
        Sink::Stderr => {
            let t = t0.elapsed().as_secs_f64();
            let t = (t * 1000.0).round() / 1000.0;
            match e {
                Event::Plan(p) => {
                    eprintln!("[{t:7.1}s] {unit}: {}{}", p.sync, reasons(p));
                    if !p.steps.is_empty() {
                        eprintln!("[{t:7.3}s] {unit}: plan: {}", steps(p));
                    }
                }
                Event::Phase(m) => eprintln!("[{t:7.3}s] {unit}: {m}"),
                Event::Progress(m) => eprintln!("[{t:7.3}s] {unit}:   {m}"),
                Event::Warning(m) => eprintln!("[{t:7.3}s] {unit}: WARNING: {m}"),
            }
        }
        Sink::Log => match e {
            Event::Plan(p) if p.steps.is_empty() => {
                tracing::debug!(unit, sync = %p.sync, reasons = ?p.reasons, "observed")
            }
            Event::Plan(p) => {
                tracing::info!(unit, sync = %p.sync, reasons = ?p.reasons, plan = %steps(p), "reconciling")
            }
            Event::Phase(m) => tracing::info!(unit, "{m}"),
            Event::Progress(m) => tracing::info!(unit, "  {m}"),
            Event::Warning(m) => tracing::warn!(unit, "{m}"),
        },
    })
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
    use crate::plan::{Step, SyncStatus};

    #[test]
    fn a_plan_reads_as_its_steps_and_reasons() {
        let p = Plan {
            sync: SyncStatus::OutOfSync,
            reasons: vec!["a".into(), "b".into()],
            steps: vec![Step::Stop, Step::WaitStopped, Step::Start],
        };
        assert_eq!(steps(&p), "Stop → WaitStopped → Start");
        assert_eq!(reasons(&p), ": a; b");
        assert_eq!(reasons(&Plan { reasons: vec![], ..p }), "");
    }
}
