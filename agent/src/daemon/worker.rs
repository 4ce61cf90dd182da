//! One unit's worker: its reconciles one at a time, the error policy's requeue, holds, and the
//! figures the metrics take after each.

use super::triggers::jitter;
use super::*;
use crate::core::timing;
use crate::daemon::metrics::Metrics;
use crate::machine::store::{self, Outcome};
use crate::reconcile::{self, Action, Ctx, DesiredState};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{Notify, watch};

/// One unit's reconcile loop: reconcile, then wait for what is due (a change of the desired
/// state, a poke, the requeue, the end of a hold's process, the agent's stop).
pub(super) async fn worker<H: AgentHost>(
    unit: String,
    mut rx: watch::Receiver<Arc<DesiredState>>,
    poke: Arc<Notify>,
    ctx: Arc<Ctx<H>>,
    metrics: Arc<Metrics>,
) {
    // Failures in a row (errors, or applies that did not reach their unit): the error policy's
    // attempt; reset by any reconcile that did not fail.
    let mut failures = 0u32;
    // What the agent last said of a hold on this unit (to say it once).
    let mut last_held: Option<String> = None;
    // The unit's instances whose deaths were counted, and the one that ran at the last look.
    let mut looks = Looks::default();
    loop {
        if ctx.shutdown.is_set() {
            return;
        }
        let d = rx.borrow_and_update().clone();
        let t0 = Instant::now();
        // A hold (suspend, pin, sweep) in effect: observe and report only.
        let held = hands_off(&ctx, &unit, &d.unit.sha256, &metrics).await;
        let dry_run = held.is_some();
        if dry_run {
            // What the source wants now is recorded (status compares the host with it: a held
            // unit still shows its drift), and nothing is done about it.
            let rec = store::DesiredRecord {
                sha256: d.unit.sha256.clone(),
                source: d.source.clone(),
                time: ctx.host.now(),
                spec: d.spec.clone(),
            };
            if let Err(e) = ctx.store.set_desired(&unit, rec).await {
                tracing::warn!(unit = %unit, "recording its desired state: {e:#}");
            }
        }
        // In a task of its own: a panic in one reconcile is an error of this unit, reported and
        // retried with backoff; the worker, the other units and the main loop go on.
        let run = {
            let (ctx, d) = (ctx.clone(), d.clone());
            tokio::spawn(async move { reconcile::reconcile(&ctx, &d, dry_run).await })
        };
        let result = match run.await {
            Ok(r) => r,
            Err(e) => Err(reconcile::ReconcileError::Io(anyhow::anyhow!("internal error while reconciling: {e}"))),
        };
        // The sync status the metrics' look after the reconcile reports.
        let look;
        let wait = match (result, &held) {
            (Ok(r), Some((why, recheck, _))) => {
                failures = 0;
                let now = sync_after(&r);
                metrics.reconciled(&unit, now, "held", t0.elapsed().as_secs_f64(), false);
                look = now;
                // Said once per hold and sync status, not at every look.
                let said = format!("{why}: {}", r.verdict);
                if last_held.as_ref() != Some(&said) {
                    tracing::info!(unit = %unit, "hands off ({why}); observed: {}", r.verdict);
                    last_held = Some(said);
                }
                *recheck
            }
            (Ok(r), None) => {
                last_held = None;
                let failed = matches!(r.outcome, Some(Outcome::Failed | Outcome::RolledBack));
                let result = r.outcome.map_or("none".to_string(), |o| format!("{o:?}").to_lowercase());
                // The status after this reconcile, not the one it started from.
                let now = sync_after(&r);
                metrics.reconciled(&unit, now, &result, t0.elapsed().as_secs_f64(), failed);
                look = now;
                // What an operator must hear of (`journalctl -p warning`): the desired unit does
                // not run, whether the last good one was restored or nothing could be.
                match r.outcome {
                    Some(Outcome::RolledBack | Outcome::Failed | Outcome::Refused) => {
                        tracing::warn!(unit = %unit, "{}", r.verdict)
                    }
                    Some(_) => tracing::info!(unit = %unit, "{}", r.verdict),
                    None => {}
                }
                crate::notify::after_reconcile(&ctx, &d, &r, t0.elapsed()).await;
                match (r.outcome, r.action) {
                    // A failed apply asks to come back; the error policy says when, at the
                    // earliest what it asked.
                    (Some(Outcome::Failed), Action::Requeue(d)) => {
                        let Action::Requeue(backoff) = reconcile::error_policy(failures) else { unreachable!() };
                        failures = failures.saturating_add(1);
                        Some(jitter(backoff).max(d))
                    }
                    (_, Action::Requeue(d)) => {
                        failures = 0;
                        Some(d)
                    }
                    (_, Action::AwaitChange) => {
                        failures = 0;
                        None
                    }
                }
            }
            (Err(e), _) => {
                tracing::error!(unit = %unit, "reconcile failed: {e}");
                metrics.reconciled(
                    &unit,
                    crate::core::plan::SyncStatus::Failed,
                    "error",
                    t0.elapsed().as_secs_f64(),
                    true,
                );
                look = crate::core::plan::SyncStatus::Failed;
                let action = reconcile::error_policy(failures);
                failures = failures.saturating_add(1);
                match action {
                    Action::Requeue(d) => Some(jitter(d)),
                    Action::AwaitChange => None,
                }
            }
        };
        // The metrics' look (the journal read when another instance runs than at the last one)
        // never delays a new desired state nor the agent's stop: cut short by either, its deaths
        // are counted at the look after the next reconcile (a look cut short counted none).
        let changed = tokio::select! {
            biased;
            _ = looks.after(&ctx, &metrics, &d, look) => false,
            r = rx.changed() => {
                if r.is_err() {
                    return;
                }
                true
            }
            _ = ctx.shutdown.wait() => return,
        };
        if changed {
            continue;
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
            match held.as_ref().and_then(|(_, _, hold)| hold.as_ref()) {
                Some(hold) => ctx.host.holder_exit(hold).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            r = rx.changed() => if r.is_err() { return },
            _ = poke.notified() => {}
            _ = requeue => {}
            _ = sweep_ends => {}
            _ = ctx.shutdown.wait() => return,
        }
    }
}

/// The sync status after a reconcile, not the one it started from (`sync::status`: the worker
/// holds the unit's lock for its reconciles, and its metrics follow what they do, not the
/// history).
pub(super) fn sync_after(r: &reconcile::Report) -> crate::core::plan::SyncStatus {
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
        sync: crate::core::plan::SyncStatus,
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
    sync: crate::core::plan::SyncStatus,
) {
    let unit = &d.spec.unit;
    match ctx.store.peek(unit) {
        Ok(st) => {
            let checks_args = reconcile::desired_of(&ctx.unit_dir, d).verify_args;
            let in_sync = sync == crate::core::plan::SyncStatus::InSync;
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
