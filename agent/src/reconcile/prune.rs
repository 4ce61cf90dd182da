//! A unit whose spec is gone, when `prune` is on: drained as an apply drains it (its load
//! balancers told `drain` and seen to see it, its requests in flight, its group's gate), stopped
//! until its cgroup is empty, told `down`, disabled, its file and state set aside. One left
//! running (`prune: false`) is watched (`watch_orphan`): its load balancers are told what it runs.

use super::*;
use crate::core::plan::{Plan, Step};
use crate::core::record::UnitState;
use crate::core::serving::ServingState;
use crate::core::timing::{self};
use crate::host::{Host, unit_path};
use crate::machine::cgroup::Lingering;
use crate::machine::lock::UnitLock;
use crate::machine::systemd::UnitProps;
use anyhow::Result;
use tokio::time::Instant;

/// Why a pruned unit stops, as its load balancers and its plan are told.
pub(super) const GONE: &str = "its spec is gone (prune: true)";

/// Stop a unit whose instance failed, and say so in its journal (`diagnose` then names the
/// failed start, not a stop on request).
pub(super) async fn stop_quietly<H: Host>(ctx: &Ctx<H>, unit: &str, note: &str) {
    let before = ctx.host.show(unit).await.unwrap_or_default();
    ctx.host.note(unit, "rollback", &before.invocation_id, note);
    if let Err(lingering) = stop_until_empty(ctx, unit, &before).await {
        let still = crate::machine::cgroup::still_in(&before.control_group, &lingering);
        (ctx.events)(unit, &Event::Warning(format!("after the stop, {still}")));
    }
}

/// Stop a unit outside an apply and wait until its cgroup is empty (stopped means empty): the
/// stop job is over once `stop` returns (systemd's SIGKILL included), so what is left goes within
/// moments, or is returned.
pub(super) async fn stop_until_empty<H: Host>(
    ctx: &Ctx<H>,
    unit: &str,
    before: &UnitProps,
) -> Result<(), Vec<Lingering>> {
    let _ = ctx.host.stop(unit, true).await;
    if before.control_group.is_empty() {
        return Ok(());
    }
    ctx.host.wait_empty(&before.control_group, Instant::now() + timing::EMPTY_AFTER_STOP, || {}).await
}

/// A unit whose spec is gone, with `prune: true`: a rule a killed apply left refusing new
/// connections removed; a replica of a group waits for its group's gate; a serving instance
/// drained as an apply drains it (its load balancers told `drain` and waited for until they saw
/// it, then its requests in flight, within its `drain_timeout_sec`); then stopped until its
/// processes are gone, told `down`, disabled; its unit file and state kept in the state dir
/// (private), and systemd reloaded. Whatever stops it half-way leaves its state, and the next
/// source read prunes it again.
pub async fn prune<H: Host>(ctx: &Ctx<H>, unit: &str) {
    let _lock = match UnitLock::acquire(&ctx.store.locks_dir(), unit).await {
        Ok(l) => l,
        Err(e) => return tracing::error!(unit, "pruning: cannot take the unit's lock: {e:#}"),
    };
    let mut st = match ctx.store.load(unit) {
        Ok(st) => st,
        Err(e) => return tracing::error!(unit, "pruning: reading its state: {e:#}; not stopped"),
    };
    tracing::warn!(
        unit,
        "pruning: its spec is gone; draining, stopping and disabling it, and moving its unit file to the state dir"
    );
    door::leftover(ctx, unit, &mut st).await;
    let before = ctx.host.show(unit).await.unwrap_or_default();
    let stopped = match drain_and_stop(ctx, &mut st, unit, &before).await {
        Ok(stopped) => stopped,
        Err(e) => return tracing::error!(unit, "pruning: {e}; not stopped"),
    };
    if !stopped {
        let note = format!("specd: stopping {unit}: its spec is gone (prune)");
        ctx.host.note(unit, "prune", &before.invocation_id, &note);
        if let Err(lingering) = stop_until_empty(ctx, unit, &before).await {
            let still = crate::machine::cgroup::still_in(&before.control_group, &lingering);
            tracing::error!(unit, "pruning: after the stop, {still}");
        }
    }
    let down = ServingState::Down { why: GONE.into(), since: ctx.host.now() };
    if let Err(e) = ctx.host.set_serving_state(unit, &down) {
        // Its state stays: the next source read prunes it again, and tells them.
        return tracing::error!(unit, "pruning: telling its load balancers it is down: {e:#}");
    }
    // It no longer starts at boot: no `.wants` link is left pointing at a file moved away.
    if let Err(e) = ctx.host.disable(unit).await {
        tracing::warn!(unit, "pruning: disabling it: {e:#}");
    }
    let path = unit_path(&ctx.unit_dir, unit);
    let (keep, now) = (ctx.store.dir.join("pruned"), ctx.host.now());
    if ctx.host.exists(&path)
        && let Err(e) = ctx.host.move_aside(&path, &keep.join(format!("{unit}.{now}")))
    {
        // Its state stays: the next source read prunes it again.
        return tracing::error!(unit, "pruning: its unit file: {e:#}");
    }
    let _ = ctx.host.daemon_reload().await;
    // A rule still refusing new connections to its port is named by its state only: kept until
    // it is removed.
    door::leftover(ctx, unit, &mut st).await;
    if let Some(port) = st.refusing {
        return tracing::error!(
            unit,
            "pruning: the rule refusing new connections to port {port} is still there; its state is kept until it is removed"
        );
    }
    if let Err(e) = ctx.store.set_aside(unit, &keep.join(format!("{unit}.json.{now}"))) {
        tracing::error!(unit, "pruning: its state: {e:#}");
    }
}

/// Before the stop of a unit whose spec is gone: while it runs, a replica of a group waits for its
/// group's gate, then it is drained and stopped by the apply's own steps (drain, stop, empty
/// cgroup; the spec it was last asked to run giving the drain budget and where to ask for the
/// requests in flight; a port closed to new connections for the drain stays closed until it
/// stopped): `Ok(true)`. One that does not run, or whose spec specd has no record of, is told
/// `down` first: `Ok(false)`, stopped by the caller. An error: it is not to be stopped now (its
/// load balancers could not be told, its spec is back, the agent is stopping).
async fn drain_and_stop<H: Host>(
    ctx: &Ctx<H>,
    st: &mut UnitState,
    unit: &str,
    before: &UnitProps,
) -> Result<bool, String> {
    let record = st.desired.clone().filter(|_| before.is_running());
    let Some(record) = record else {
        let down = ServingState::Down { why: GONE.into(), since: ctx.host.now() };
        return ctx
            .host
            .set_serving_state(unit, &down)
            .map(|()| false)
            .map_err(|e| format!("telling its load balancers it is down: {e:#}"));
    };
    let d = DesiredState::new(record.spec, record.source);
    group_gate(ctx, &d, st).await?;
    let t = act::Target { pruning: true, ..act::Target::desired(&d, d.spec.base_url(), false) };
    let mut stop = act::StopRecord::default();
    steps::run_steps(ctx, st, unit, &[Step::Drain, Step::Stop, Step::WaitStopped], &t, before, &mut stop, None)
        .await
        .map(|()| true)
        .map_err(|f| format!("its drain and stop: {}", f.message))
}

/// A replica of a group (`spec.rollout`) is stopped only when its group's gate for a member that
/// leaves lets it (`roll::leaving`: no more of the group down than `max_unavailable`), asked
/// again while it waits; until its spec is back or the agent stops.
async fn group_gate<H: Host>(ctx: &Ctx<H>, d: &DesiredState, st: &UnitState) -> Result<(), String> {
    if d.spec.rollout.is_none() {
        return Ok(());
    }
    let plan = Plan {
        sync: crate::core::sync::SyncStatus::OutOfSync,
        reasons: vec![GONE.into()],
        steps: vec![Step::Drain, Step::Stop, Step::WaitStopped],
        toward: crate::core::plan::Toward::Desired,
    };
    loop {
        if !super::roll::orphaned(ctx, &d.spec.unit) {
            return Err("its spec is back".into());
        }
        let (o, _) = observe::observe(ctx, d, st, true).await.map_err(|e| format!("observing it: {e:#}"))?;
        let again = match super::roll::ask(ctx, d, st, &o, (&plan, true)).await {
            Ok(None) => return Ok(()),
            Ok(Some(report)) => match report.action {
                crate::core::conclude::Action::Requeue(again) => again,
                _ => timing::ROLL_WAIT,
            },
            Err(e) => return Err(format!("asking its group's gate: {e:#}")),
        };
        tokio::select! {
            () = tokio::time::sleep(again) => {}
            () = ctx.shutdown.wait() => return Err("the agent is stopping".into()),
        }
    }
}

/// A unit no spec desires, left running (`prune: false`): what its load balancers are told follows
/// what it runs, as a reconcile that changes nothing tells it (`ready` only while it runs, ready,
/// the verified unit it ran; `down` once it stops), looked at every `ORPHAN_LOOK` until a spec
/// desires it again (its worker tells them from then on) or the agent stops.
pub async fn watch_orphan<H: Host>(ctx: &Ctx<H>, unit: &str) {
    while !ctx.shutdown.is_set() && look_at_orphan(ctx, unit).await {
        tokio::select! {
            () = tokio::time::sleep(timing::ORPHAN_LOOK) => {}
            () = ctx.shutdown.wait() => return,
        }
    }
}

/// One look at a unit no spec desires, under its lock: its load balancers told what it runs.
/// False once a spec desires it again, or the agent stops.
pub(super) async fn look_at_orphan<H: Host>(ctx: &Ctx<H>, unit: &str) -> bool {
    let _lock = match lock_unit(ctx, unit).await {
        Ok(Some(l)) => l,
        Ok(None) => return false,
        Err(e) => {
            tracing::warn!(unit, "orphaned: cannot take the unit's lock: {e:#}");
            return true;
        }
    };
    if !super::roll::orphaned(ctx, unit) {
        return false;
    }
    let st = match ctx.store.peek(unit) {
        Ok(st) => st,
        Err(e) => {
            tracing::warn!(unit, "orphaned: reading its state: {e:#}");
            return true;
        }
    };
    // The spec it was last asked to run says where its server answers.
    let Some(record) = st.desired.clone() else {
        let down = ServingState::Down {
            why: "no spec desires it, and specd has no record of one".into(),
            since: ctx.host.now(),
        };
        if !ctx.host.serving_state(unit).is_some_and(|s| s.same(&down)) {
            let _ = ctx.host.set_serving_state(unit, &down);
        }
        return true;
    };
    let d = DesiredState::new(record.spec, record.source);
    match observe::observe(ctx, &d, &st, true).await {
        Ok((o, _)) => {
            if let Err(e) = balancers::tell(ctx, &d, &st, &o, &crate::core::serving::After::Observed) {
                tracing::warn!(unit, "orphaned: telling its load balancers: {e:#}");
            }
        }
        Err(e) => tracing::warn!(unit, "orphaned: observing it: {e:#}"),
    }
    true
}
