//! The agent's stop: every worker joined at a safe point, for as long as an apply carried past
//! its old instance's stop needs (`StopTimeout`: systemd is told, its drop-in keeps the time across
//! a reload).

use super::units::Units;
use super::*;
use crate::core::timing;
use crate::host::{Processes, ServiceManager};
use crate::reconcile::{self, Shutdown};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::sync::watch;

/// The agent's stop: applies in progress stop at their next safe point, every worker is joined
/// under the stop's deadline ([`stop_deadline`], asked of systemd as it moves: [`StopTimeout`]),
/// notices still queued get a last chance, the endpoints close.
pub(super) async fn stop(units: Units, stop_tx: watch::Sender<bool>, endpoints: Endpoints) {
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Stopping]);
    tracing::info!("stopping: applies in progress stop at their next safe point");
    let _ = stop_tx.send(true);
    let mut timeout = StopTimeout::new(&units.ctx.unit_dir, units.own_unit.as_deref());
    let handles = units.workers.into_iter().map(|(u, w)| (u, w.handle)).chain(units.leaving).collect();
    let late = join_at_stop(handles, &units.ctx.shutdown, |wait, carried| timeout.extend(wait, carried)).await;
    for u in late {
        tracing::warn!(unit = %u, "did not reach a safe point within the agent's stop; left as the agent exits");
    }
    // Notices still queued (a receiver that did not answer yet) get a last chance.
    crate::notify::flush(timing::NOTICES_WITHIN).await;
    endpoints.close();
    timeout.end();
    tracing::info!("stopped");
}

/// The service the agent runs as: the unit of its cgroup, if the agent is its main process (not
/// a `specd run` started by hand in a terminal, whose cgroup may be a user manager's unit).
pub(super) async fn own_main_unit<H: Processes + ServiceManager>(host: &H) -> Option<String> {
    let unit = host.own_unit()?;
    let props = host.show(&unit).await.ok()?;
    (props.main_pid == std::process::id()).then_some(unit)
}

/// What the agent's stop asks of systemd: that its unit's stop may take as long as its workers
/// need ([`stop_deadline`]), then its notices and its exit, whatever its `TimeoutStopSec=`.
///
/// Two ways, as systemd keeps one and not the other: `EXTEND_TIMEOUT_USEC=` (sd_notify(3),
/// systemd 236 and later) moves the running stop's timer, but a daemon-reload (the one the
/// stopping apply makes itself to load its new unit, or anyone's) sets that timer again from the
/// unit's configuration, at the time the stop began plus `TimeoutStopSec=` (systemd's
/// `service_coldplug_timeout`): once that has passed, systemd kills the agent at once. So while
/// an apply is carried past its old instance's stop, a drop-in of the agent's own unit
/// (`<unit dir>/<its unit>.d/zz-specd-stopping.conf`) also says the `TimeoutStopSec=` the stop
/// needs, which a reload loads; it is removed when the stop ends, and at the next start if the
/// agent was killed in its stop.
pub(super) struct StopTimeout {
    /// The drop-in, when the agent runs as a unit.
    pub(super) drop_in: Option<PathBuf>,
    pub(super) began: tokio::time::Instant,
    pub(super) wrote: bool,
}

impl StopTimeout {
    const DROP_IN: &str = "zz-specd-stopping.conf";

    pub(super) fn new(unit_dir: &Path, own_unit: Option<&str>) -> StopTimeout {
        let drop_in = own_unit.map(|u| unit_dir.join(format!("{u}.d")).join(Self::DROP_IN));
        StopTimeout { drop_in, began: tokio::time::Instant::now(), wrote: false }
    }

    /// The workers may take `wait` more (`carried`: the units whose apply is stopping an old
    /// instance).
    pub(super) fn extend(&mut self, wait: Duration, carried: &[String]) {
        let rest = wait + timing::NOTICES_WITHIN + timing::EXIT_WITHIN;
        let usec = format!("EXTEND_TIMEOUT_USEC={}", rest.as_micros());
        let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Custom(&usec)]);
        let Some(path) = self.drop_in.as_ref().filter(|_| !carried.is_empty()) else { return };
        // Whole seconds from the stop's beginning, rounded up.
        let secs = (self.began.elapsed() + rest).as_secs() + 1;
        let text = format!(
            "# Written by specd while it stops: an apply of {} goes on until its new instance is\n# started (removed when specd has stopped).\n[Service]\nTimeoutStopSec={secs}\n",
            carried.join(", ")
        );
        let written = path
            .parent()
            .map_or(Ok(()), crate::machine::atomic::ensure_dir)
            .and_then(|()| crate::machine::atomic::atomic_write(path, text.as_bytes(), 0o644));
        match written {
            Ok(()) => self.wrote = true,
            Err(e) => tracing::warn!(
                "stopping: could not write {} ({e:#}): a daemon-reload after the agent unit's TimeoutStopSec= would end the agent's stop",
                path.display()
            ),
        }
    }

    /// The stop is over: the drop-in removed.
    pub(super) fn end(self) {
        if let Some(p) = self.drop_in.filter(|_| self.wrote) {
            Self::remove(&p);
        }
    }

    /// A drop-in left by an agent killed in its stop, removed at the agent's start.
    pub(super) fn clear_leftover(unit_dir: &Path, own_unit: Option<&str>) {
        if let Some(p) = StopTimeout::new(unit_dir, own_unit).drop_in.filter(|p| p.exists()) {
            Self::remove(&p);
        }
    }

    pub(super) fn remove(p: &Path) {
        match std::fs::remove_file(p) {
            Ok(()) => {
                // Its directory too, if specd made it for the drop-in alone.
                if let Some(d) = p.parent() {
                    let _ = std::fs::remove_dir(d);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!("could not remove {}: {e}", p.display()),
        }
    }
}

/// When the agent's stop stops waiting for its workers: [`timing::STOP_WITHIN`] after the stop
/// began (`t0`) or, for an apply that is stopping its unit's old instance, after the end of that
/// stop's budget: such an apply goes on until its new instance is started (an apply never leaves
/// down a unit that was serving), however long the spec lets the old one take to stop.
pub(super) fn stop_deadline<'a>(
    t0: tokio::time::Instant,
    carried: impl IntoIterator<Item = &'a reconcile::CarriedApply>,
) -> tokio::time::Instant {
    carried.into_iter().map(|c| c.stop_ends).fold(t0, Ord::max) + timing::STOP_WITHIN
}

/// Join the workers under [`stop_deadline`], followed as applies begin and end their old
/// instance's stop; `extend` is told how long the agent may still wait, and for which units'
/// applies, each time that moves later. The units whose worker had not ended by then.
pub(super) async fn join_at_stop(
    handles: Vec<(String, tokio::task::JoinHandle<()>)>,
    shutdown: &Shutdown,
    mut extend: impl FnMut(Duration, &[String]),
) -> Vec<String> {
    let t0 = tokio::time::Instant::now();
    let mut carried = shutdown.carried();
    let deadline = async move {
        let mut told: Option<tokio::time::Instant> = None;
        loop {
            let (at, stopping) = {
                let c = carried.borrow_and_update();
                (stop_deadline(t0, c.values()), c.values().map(|c| c.unit.clone()).collect::<Vec<_>>())
            };
            if told.is_none_or(|t| at > t) {
                let wait = at.saturating_duration_since(tokio::time::Instant::now());
                if !stopping.is_empty() {
                    tracing::info!(
                        "stopping: waiting up to {} s for the apply of {} to start its new instance after its old one's stop",
                        wait.as_secs(),
                        stopping.join(", ")
                    );
                }
                extend(wait, &stopping);
                told = Some(at);
            }
            tokio::select! {
                _ = tokio::time::sleep_until(at) => return,
                r = carried.changed() => if r.is_err() {
                    return tokio::time::sleep_until(at).await;
                },
            }
        }
    };
    join_within(handles, deadline).await
}

/// Wait for every task until one shared `deadline`; the units whose task had not finished by
/// then (they are left running, and end with the process).
pub(super) async fn join_within(
    handles: Vec<(String, tokio::task::JoinHandle<()>)>,
    deadline: impl std::future::Future<Output = ()>,
) -> Vec<String> {
    tokio::pin!(deadline);
    let mut passed = false;
    let mut late = Vec::new();
    for (unit, mut h) in handles {
        if !passed {
            tokio::select! {
                biased;
                _ = &mut h => continue,
                _ = &mut deadline => passed = true,
            }
        }
        if !h.is_finished() {
            late.push(unit);
        }
    }
    late
}
