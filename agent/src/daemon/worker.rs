//! One unit's worker: its reconciles one at a time, the error policy's requeue, holds, and the
//! figures the metrics take after each.

use super::triggers::jitter;
use super::*;
use crate::core::conclude::{Action, Report};
use crate::core::record::Outcome;
use crate::core::sync::SyncStatus;
use crate::core::timing;
use crate::daemon::metrics::Metrics;
use crate::reconcile::{self, Ctx, DesiredState};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{Notify, watch};

/// One unit's reconcile loop: reconcile, then wait for what is due (a change of the desired
/// state, a poke, the requeue, the end of a hold's process, the agent's stop).
pub(super) async fn worker<H: AgentHost>(
    unit: String,
    rx: watch::Receiver<Arc<DesiredState>>,
    poke: Arc<Notify>,
    ctx: Arc<Ctx<H>>,
    metrics: Arc<Metrics>,
) {
    let mut w = UnitWorker { unit, rx, poke, ctx, metrics, failures: 0, last_held: None, looks: Looks::default() };
    loop {
        if w.ctx.shutdown.is_set() {
            return;
        }
        let d = w.rx.borrow_and_update().clone();
        let t0 = Instant::now();
        // A hold (suspend, pin, sweep) in effect: observe and report only.
        let held = hands_off(&w.ctx, &w.unit, &d.unit.sha256, &w.metrics).await;
        if held.is_some() {
            w.record_desired(&d).await;
        }
        let result = reconcile_apart(&w.ctx, &d, held.is_some()).await;
        let (wait, look) = match (result, &held) {
            (Ok(r), Some((why, recheck, _))) => (*recheck, w.observed(&r, why, t0)),
            (Ok(r), None) => w.acted(&d, &r, t0).await,
            (Err(e), _) => w.failed(&e, t0),
        };
        let hold = held.and_then(|(_, _, hold)| hold);
        if w.until_due(&d, look, wait, hold.as_ref()).await == Next::Stop {
            return;
        }
    }
}

/// What a worker keeps across its reconciles.
struct UnitWorker<H: AgentHost> {
    unit: String,
    rx: watch::Receiver<Arc<DesiredState>>,
    poke: Arc<Notify>,
    ctx: Arc<Ctx<H>>,
    metrics: Arc<Metrics>,
    /// Failures in a row (errors, or applies that did not reach their unit): the error policy's
    /// attempt; reset by any reconcile that did not fail.
    failures: u32,
    /// What the agent last said of a hold on this unit (to say it once).
    last_held: Option<String>,
    /// The unit's instances whose deaths were counted, and the one that ran at the last look.
    looks: Looks,
}

/// After a worker's wait: reconcile again, or end (the agent stops, the unit is let go).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Next {
    Reconcile,
    Stop,
}

/// One reconcile in a task of its own: a panic in it is an error of this unit, reported and
/// retried with backoff; the worker, the other units and the main loop go on.
async fn reconcile_apart<H: AgentHost>(
    ctx: &Arc<Ctx<H>>,
    d: &Arc<DesiredState>,
    dry_run: bool,
) -> Result<Report, reconcile::ReconcileError> {
    let run = {
        let (ctx, d) = (ctx.clone(), d.clone());
        tokio::spawn(async move { reconcile::reconcile(&ctx, &d, dry_run).await })
    };
    match run.await {
        Ok(r) => r,
        Err(e) => Err(reconcile::ReconcileError::Io(anyhow::anyhow!("internal error while reconciling: {e}"))),
    }
}

impl<H: AgentHost> UnitWorker<H> {
    /// Under a hold: what the source wants now is recorded (status compares the host with it: a
    /// held unit still shows its drift), and nothing is done about it.
    async fn record_desired(&self, d: &DesiredState) {
        let rec = d.record(self.ctx.host.now());
        if let Err(e) = self.ctx.store.set_desired(&self.unit, rec).await {
            tracing::warn!(unit = %self.unit, "recording its desired state: {e:#}");
        }
    }

    /// After a reconcile that only observed, the unit being held (`why`): its figures, said once
    /// per hold and sync status, not at every look. The sync status it left.
    fn observed(&mut self, r: &Report, why: &str, t0: Instant) -> SyncStatus {
        self.failures = 0;
        let now = sync_after(r);
        self.metrics.reconciled(&self.unit, now, "held", t0.elapsed().as_secs_f64(), false);
        let said = format!("{why}: {}", r.verdict);
        if self.last_held.as_ref() != Some(&said) {
            tracing::info!(unit = %self.unit, "hands off ({why}); observed: {}", r.verdict);
            self.last_held = Some(said);
        }
        now
    }

    /// After a reconcile that acted: its figures, its verdict in the log and to the webhooks, and
    /// when to come back (`None`: at the next change). The sync status it left.
    async fn acted(&mut self, d: &DesiredState, r: &Report, t0: Instant) -> (Option<Duration>, SyncStatus) {
        self.last_held = None;
        let failed = matches!(r.outcome, Some(Outcome::Failed | Outcome::RolledBack));
        let result = r.outcome.map_or("none".to_string(), |o| format!("{o:?}").to_lowercase());
        // The status after this reconcile, not the one it started from.
        let now = sync_after(r);
        self.metrics.reconciled(&self.unit, now, &result, t0.elapsed().as_secs_f64(), failed);
        // What an operator must hear of (`journalctl -p warning`): the desired unit does not
        // run, whether the last good one was restored or nothing could be.
        match r.outcome {
            Some(Outcome::RolledBack | Outcome::Failed | Outcome::Refused) => {
                tracing::warn!(unit = %self.unit, "{}", r.verdict)
            }
            Some(_) => tracing::info!(unit = %self.unit, "{}", r.verdict),
            None => {}
        }
        crate::notify::after_reconcile(&self.ctx, d, r, t0.elapsed()).await;
        (self.requeue(r.outcome, r.action), now)
    }

    /// When a reconcile that ended with `outcome` and asked for `action` comes back. A failed
    /// apply asks to come back; the error policy says when, at the earliest what it asked.
    fn requeue(&mut self, outcome: Option<Outcome>, action: Action) -> Option<Duration> {
        match (outcome, action) {
            (Some(Outcome::Failed), Action::Requeue(d)) => {
                let Action::Requeue(backoff) = reconcile::error_policy(self.failures) else { unreachable!() };
                self.failures = self.failures.saturating_add(1);
                Some(jitter(backoff).max(d))
            }
            (_, Action::Requeue(d)) => {
                self.failures = 0;
                Some(d)
            }
            (_, Action::AwaitChange) => {
                self.failures = 0;
                None
            }
        }
    }

    /// After a reconcile that failed (an error, not an outcome): reported, and retried as the
    /// error policy says.
    fn failed(&mut self, e: &reconcile::ReconcileError, t0: Instant) -> (Option<Duration>, SyncStatus) {
        tracing::error!(unit = %self.unit, "reconcile failed: {e}");
        self.metrics.reconciled(&self.unit, SyncStatus::Failed, "error", t0.elapsed().as_secs_f64(), true);
        let action = reconcile::error_policy(self.failures);
        self.failures = self.failures.saturating_add(1);
        let wait = match action {
            Action::Requeue(d) => Some(jitter(d)),
            Action::AwaitChange => None,
        };
        (wait, SyncStatus::Failed)
    }

    /// Wait for what is due after a reconcile of `d` that left the unit `look`: the metrics'
    /// look, then a change of the desired state, a poke, the requeue (`wait`), the exit of the
    /// process of a `hold` (a sweep's), or the agent's stop.
    async fn until_due(
        &mut self,
        d: &DesiredState,
        look: SyncStatus,
        wait: Option<Duration>,
        hold: Option<&crate::core::hold::Hold>,
    ) -> Next {
        // The metrics' look (the journal read when another instance runs than at the last one)
        // never delays a new desired state nor the agent's stop: cut short by either, its deaths
        // are counted at the look after the next reconcile (a look cut short counted none).
        let ctx = &self.ctx;
        tokio::select! {
            biased;
            _ = self.looks.after(ctx, &self.metrics, d, look) => {}
            r = self.rx.changed() => {
                return if r.is_err() { Next::Stop } else { Next::Reconcile };
            }
            _ = ctx.shutdown.wait() => return Next::Stop,
        }
        // No timer at all when nothing is due: a unit at rest wakes only on a change.
        let requeue = async {
            match wait {
                Some(d) => tokio::time::sleep(d).await,
                None => std::future::pending().await,
            }
        };
        // A sweep that holds the unit: its process's exit.
        let sweep_ends = async {
            match hold {
                Some(hold) => ctx.host.holder_exit(hold).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            r = self.rx.changed() => if r.is_err() { return Next::Stop },
            _ = self.poke.notified() => {}
            _ = requeue => {}
            _ = sweep_ends => {}
            _ = ctx.shutdown.wait() => return Next::Stop,
        }
        Next::Reconcile
    }
}

/// The sync status after a reconcile, not the one it started from (`sync::status`: the worker
/// holds the unit's lock for its reconciles, and its metrics follow what they do, not the
/// history).
pub(super) fn sync_after(r: &Report) -> SyncStatus {
    crate::core::sync::status(crate::core::sync::Seen {
        planned: r.plan.sync,
        outcome: r.outcome,
        applying: false,
        last_try: None,
    })
}

/// What a worker keeps between its looks for the metrics: the deaths counted, and the instance
/// that ran at the last look.
#[derive(Default)]
pub(super) struct Looks {
    pub(super) deaths: crate::daemon::metrics::Deaths,
    pub(super) ran: Option<String>,
}

impl Looks {
    /// After a reconcile of `d` that left the unit `sync`: whether it runs, its figures from its
    /// state ([`crate::daemon::metrics::UnitFigures::of`]), and the deaths of its instances since the
    /// last look (the journal is read only when the instance that runs changed).
    pub(super) async fn after<H: AgentHost>(
        &mut self,
        ctx: &Ctx<H>,
        metrics: &Metrics,
        d: &DesiredState,
        sync: SyncStatus,
    ) {
        let unit = &d.spec.unit;
        record_figures(ctx, metrics, d, sync);
        let Ok(p) = ctx.host.show(unit).await else { return };
        metrics.down(unit, !p.active_state.is_up());
        let current = if p.active_state.may_run() { p.invocation_id.clone() } else { String::new() };
        if self.deaths.started() && self.ran.as_deref() == Some(current.as_str()) {
            return;
        }
        // An end the journal has not shown within the wait is counted at the next change (its
        // instance is not taken as seen until it shows its end).
        let found = ctx.host.instances(unit, &current, timing::DEATH_IN_JOURNAL_WITHIN).await;
        let died = self.deaths.take(&found);
        if !died.is_empty() {
            tracing::debug!(unit = %unit, ?died, "deaths counted");
        }
        metrics.died(unit, &died);
        self.ran = Some(current);
    }
}

/// A unit's figures (deployed revision and hash, args verified, the speculation proof,
/// quarantine) from its state after a reconcile that left it `sync`.
pub(super) fn record_figures<H: crate::host::Host>(
    ctx: &Ctx<H>,
    metrics: &Metrics,
    d: &DesiredState,
    sync: SyncStatus,
) {
    let unit = &d.spec.unit;
    match ctx.store.peek(unit) {
        Ok(st) => {
            let checks_args = reconcile::desired_of(&ctx.unit_dir, d).verify_args;
            let in_sync = sync == SyncStatus::InSync;
            metrics.unit(unit, &crate::daemon::metrics::UnitFigures::of(&st, &d.unit.sha256, checks_args, in_sync));
        }
        Err(e) => tracing::warn!(unit = %unit, "reading its state for the metrics: {e:#}"),
    }
}

/// A hold that keeps the agent's hands off: why, when to look again (`None`: at the next change
/// or request), and the hold whose process's exit ends it (a sweep's).
pub(super) type HandsOff = (String, Option<Duration>, Option<crate::core::hold::Hold>);

/// Whether a hold keeps the agent's hands off `unit` now (see [`HandsOff`]). A hold that ended
/// (expired, its sweep gone, the source moved past a pin) is cleared here, recorded in the unit's
/// history, and the agent acts again.
pub(super) async fn hands_off<H: AgentHost>(
    ctx: &Ctx<H>,
    unit: &str,
    desired_sha: &str,
    metrics: &Metrics,
) -> Option<HandsOff> {
    let store = &ctx.store;
    let hold = match store.peek(unit) {
        Ok(st) => st.hold,
        Err(e) => {
            tracing::warn!(unit = %unit, "reading its state for a hold: {e:#}");
            None
        }
    };
    metrics.hold(unit, hold.as_ref().map(|h| h.kind));
    let now = ctx.host.now();
    match ctx.host.hold_effect(hold.as_ref(), desired_sha) {
        crate::core::hold::HoldEffect::Acts => None,
        crate::core::hold::HoldEffect::HandsOff(why) => {
            let h = hold?;
            let until = h.until.map(|u| Duration::from_secs(u.saturating_sub(now).max(1)));
            // A sweep's process may end without a word: its exit wakes the worker (a pidfd, or
            // a look every few seconds where there is none).
            let exits = h.pid.is_some().then(|| h.clone());
            Some((why, until, exits))
        }
        crate::core::hold::HoldEffect::Expired(why) => {
            let h = hold?;
            match store.clear_hold_if(unit, &why, |x| *x == h).await {
                Ok(Some(_)) => tracing::info!(unit = %unit, "hold ended ({why}): the agent acts on it again"),
                Ok(None) => {}
                Err(e) => tracing::error!(unit = %unit, "clearing its hold that ended ({why}): {e:#}"),
            }
            // A hold set again meanwhile is the next look's.
            metrics.hold(unit, None);
            None
        }
    }
}
