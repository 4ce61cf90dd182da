//! A replica of a group (`spec.rollout`) asks `core::roll::gate` before its reconcile stops its
//! serving instance: under the group's lock (`locks/group-<group>.lock`, across processes), it
//! saves its own record (so that its siblings count it), reads its siblings (the units whose
//! desired spec names the same group, from their records) and what their load balancers are told
//! (the serving states, through the host); allowed, it marks itself `drain` before the lock goes,
//! so two replicas never both pass. A wait or a hold is a report whose action is a requeue: no
//! reconcile sleeps on its unit's lock.

use super::*;
use crate::core::plan::Observed;
use crate::core::roll::{self, Roll, Sibling};
use crate::core::serving::{ServingState, Word};

/// Whether this reconcile may go on with `plan` (`None`), or the report that says why not yet.
pub(super) async fn ask<H: Host>(
    ctx: &Ctx<H>,
    d: &DesiredState,
    st: &UnitState,
    o: &Observed,
    plan: &Plan,
) -> Result<Option<Report>> {
    let Some(rollout) = &d.spec.rollout else { return Ok(None) };
    if !plan.steps.contains(&Step::Stop) {
        return Ok(None);
    }
    let unit = &d.spec.unit;
    let lock_name = format!("group-{}", rollout.group);
    let _group = UnitLock::acquire(&ctx.store.locks_dir(), &lock_name).await?;
    let mine = ctx.host.serving_state(unit);
    let serving = mine.as_ref().map_or(o.ready == Some(true), |s| s.word() == Word::Ready);
    // Counted by its siblings from now on (also while it waits): its record names the group.
    ctx.store.save(st)?;
    let siblings = siblings(ctx, unit, &rollout.group)?;
    let (why, wait) = match roll::gate(&rollout.group, rollout.max_unavailable, serving, &siblings) {
        Roll::Go => {
            // Before the group's lock goes: its siblings see it drain.
            if serving {
                let why = format!(
                    "specd is stopping it to apply unit {} (group {})",
                    specd_spec::short(&d.unit.sha256),
                    rollout.group
                );
                ctx.host.set_serving_state(unit, &ServingState::Drain { why, since: ctx.host.now() })?;
            }
            return Ok(None);
        }
        Roll::Wait(why) => (why, true),
        Roll::Hold(why) => (why, false),
    };
    // A wait is said now and then; a stopped roll is a warning (a person fixes the spec).
    let event = if wait { Event::Waiting(why.clone()) } else { Event::Warning(why.clone()) };
    (ctx.events)(unit, &event);
    if mine.is_none() {
        // What it serves, told, so that a sibling waiting on it is not kept waiting by nothing.
        let _ = balancers::tell(ctx, d, st, o, &crate::core::serving::After::Observed);
    }
    let again = if wait { timing::ROLL_WAIT } else { timing::ROLL_HELD };
    Ok(Some(conclude::rolling(plan.clone(), why, wait, again)))
}

/// The group's other replicas on this host: every unit whose record desires a spec of `group`.
fn siblings<H: Host>(ctx: &Ctx<H>, unit: &str, group: &str) -> Result<Vec<Sibling>> {
    let mut out = Vec::new();
    for other in ctx.store.units()? {
        if other == unit {
            continue;
        }
        let st = ctx.store.peek(&other)?;
        let in_group = st.desired.as_ref().and_then(|d| d.spec.rollout.as_ref()).is_some_and(|r| r.group == group);
        if in_group {
            let state = ctx.host.serving_state(&other).map(|s| s.word());
            out.push(Sibling { failed: roll::failed_change(&st), unit: other, state });
        }
    }
    Ok(out)
}
