//! A unit whose spec is gone, when `prune` is on: stopped until its cgroup is empty, disabled,
//! its file and state set aside.

use super::*;
use crate::core::serving::ServingState;
use crate::core::timing::{self};
use crate::host::{Host, unit_path};
use crate::machine::cgroup::Lingering;
use crate::machine::lock::UnitLock;
use crate::machine::systemd::UnitProps;
use anyhow::Result;
use tokio::time::Instant;

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

/// A unit whose spec is gone, with `prune: true`: stop it, wait until its processes are gone,
/// keep its unit file and state in the state dir (private), and reload.
pub async fn prune<H: Host>(ctx: &Ctx<H>, unit: &str) {
    let _lock = match UnitLock::acquire(&ctx.store.locks_dir(), unit).await {
        Ok(l) => l,
        Err(e) => return tracing::error!(unit, "pruning: cannot take the unit's lock: {e:#}"),
    };
    tracing::warn!(
        unit,
        "pruning: its spec is gone; stopping and disabling it, and moving its unit file to the state dir"
    );
    // Its load balancers first: no new request goes to a server about to stop.
    let down = ServingState::Down { why: "its spec is gone (prune: true)".into(), since: ctx.host.now() };
    if let Err(e) = ctx.host.set_serving_state(unit, &down) {
        return tracing::error!(unit, "pruning: telling its load balancers it is down: {e:#}; not stopped");
    }
    let before = ctx.host.show(unit).await.unwrap_or_default();
    ctx.host.note(unit, "prune", &before.invocation_id, &format!("specd: stopping {unit}: its spec is gone (prune)"));
    if let Err(lingering) = stop_until_empty(ctx, unit, &before).await {
        tracing::error!(
            unit,
            "pruning: after the stop, {}",
            crate::machine::cgroup::still_in(&before.control_group, &lingering)
        );
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
    if let Err(e) = ctx.store.set_aside(unit, &keep.join(format!("{unit}.json.{now}"))) {
        tracing::error!(unit, "pruning: its state: {e:#}");
    }
}
