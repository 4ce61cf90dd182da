//! A replica of a group (`spec.rollout`) asks `core::roll::gate` before its reconcile stops its
//! serving instance: under the group's lock (`locks/group-<group>.lock`, across processes), it
//! saves its own record (so that its siblings count it), reads its siblings (the units whose
//! desired spec names the same group, from their records) and what their load balancers are told
//! (the serving states, through the host); allowed, it marks itself `drain` before the lock goes,
//! so two replicas never both pass. A wait or a hold is a report whose action is a requeue: no
//! reconcile sleeps on its unit's lock.
//!
//! A unit no spec desires (orphaned, `prune: false`) is no sibling: its record still names the
//! group, but what it serves is no longer the group's (its serving state follows what it runs:
//! `prune::watch_orphan`).
//!
//! A spare of the group (`rollout.spare`) asks `core::roll::spare` at each reconcile: serving, it
//! is applied as any unit (the whole apply path) and looks again every `ROLL_WAIT` until the
//! group is at rest; resting, it is drained and stopped by the apply's own steps (drain, stop,
//! empty cgroup), told `down`, and looks again every `ROLL_HELD` (a change whose replicas' records
//! came after its own look is seen then).

use super::*;
use crate::core::plan::Observed;
use crate::core::plan::{Plan, Step};
use crate::core::roll::{self, Roll, Sibling, Spare};
use crate::core::serving::{ServingState, Word};
use crate::core::sync::SyncStatus;
use crate::machine::systemd::UnitProps;

/// Whether this reconcile may go on with `plan` (`None`), or the report that says why not yet;
/// `leaving`: the unit's spec is gone, and the plan stops it for good (`roll::leaving`).
pub(super) async fn ask<H: Host>(
    ctx: &Ctx<H>,
    d: &DesiredState,
    st: &UnitState,
    o: &Observed,
    (plan, leaving): (&Plan, bool),
) -> Result<Option<Report>> {
    let Some(rollout) = &d.spec.rollout else { return Ok(None) };
    if !plan.steps.contains(&Step::Stop) {
        return Ok(None);
    }
    let unit = &d.spec.unit;
    let lock_name = format!("group-{}", rollout.group);
    let _group = UnitLock::acquire(&ctx.store.locks_dir(), &lock_name).await?;
    let mine = ctx.host.serving_state(unit);
    let serving = serves(mine.as_ref(), o);
    // Counted by its siblings from now on (also while it waits): its record names the group.
    ctx.store.save(st)?;
    let siblings = siblings(ctx, unit, &rollout.group)?;
    let roll = if leaving {
        roll::leaving(rollout.into(), &siblings)
    } else {
        roll::gate(&rollout.group, rollout.into(), (serving, rollout.spare), &siblings)
    };
    let (why, wait) = match roll {
        Roll::Go => {
            // Before the group's lock goes: its siblings see it drain.
            if serving {
                let why = match leaving {
                    true => format!("specd is stopping it: {} (group {})", super::prune::GONE, rollout.group),
                    false => format!(
                        "specd is stopping it to apply unit {} (group {})",
                        specd_spec::short(&d.unit.sha256),
                        rollout.group
                    ),
                };
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

/// Whether a member serves now: what its load balancers are told, else (told nothing yet) whether
/// it answers ready.
fn serves(told: Option<&ServingState>, o: &Observed) -> bool {
    told.map_or(o.ready == Some(true), |s| s.word() == Word::Ready)
}

/// The group's other members on this host: every unit whose record desires a spec of `group`,
/// but those no spec desires any more ([`orphaned`]): what they serve is not the group's.
fn siblings<H: Host>(ctx: &Ctx<H>, unit: &str, group: &str) -> Result<Vec<Sibling>> {
    let (mut out, now_ms) = (Vec::new(), ctx.host.now_ms());
    let orphans = orphans(ctx);
    for other in ctx.store.units()? {
        if other == unit || orphans.contains(&other) {
            continue;
        }
        let st = ctx.store.peek(&other)?;
        let Some(r) = st.desired.as_ref().and_then(|d| d.spec.rollout.as_ref()).filter(|r| r.group == group) else {
            continue;
        };
        out.push(Sibling {
            state: ctx.host.serving_state(&other).map(|s| s.word()),
            taken: crate::core::serving::taken(&ctx.host.lb_polls(&other), now_ms, ctx.lb),
            failed: roll::failed_change(&st),
            spare: r.spare,
            changing: roll::changing(&st),
            limits: r.into(),
            unit: other,
        });
    }
    Ok(out)
}

/// The units specd manages that no spec desires: those the agent's last read of its source left
/// running (`prune: false`; the source's state, `source.json`, lists them).
fn orphans<H: Host>(ctx: &Ctx<H>) -> Vec<String> {
    crate::machine::store::SourceState::load(&ctx.store.dir).map(|s| s.orphans).unwrap_or_default()
}

/// Whether no spec desires `unit` (see [`orphans`]).
pub(super) fn orphaned<H: Host>(ctx: &Ctx<H>, unit: &str) -> bool {
    orphans(ctx).iter().any(|o| o == unit)
}

/// What a spare of a group does now (`None`: the unit is no spare), from its siblings' records
/// and its own: `o.quarantined` is its own change failed.
pub(super) fn role<H: Host>(ctx: &Ctx<H>, d: &DesiredState, st: &UnitState, o: &Observed) -> Result<Option<Spare>> {
    let Some(r) = d.spec.rollout.as_ref().filter(|r| r.spare) else { return Ok(None) };
    let siblings = siblings(ctx, &d.spec.unit, &r.group)?;
    let own_change = st.last_good.as_ref().is_none_or(|g| g.sha256 != d.unit.sha256);
    let failed = o.quarantined.as_deref();
    Ok(Some(roll::spare(&r.group, own_change, failed, &siblings)))
}

/// The plan of a spare at rest: drain and stop it while it runs, else nothing (held stopped).
fn rest_plan(o: &Observed, why: String) -> Plan {
    let running = o.active_state.may_run() || o.main_pid > 0;
    Plan {
        sync: if running { SyncStatus::OutOfSync } else { SyncStatus::InSync },
        reasons: vec![why],
        steps: if running { vec![Step::Drain, Step::Stop, Step::WaitStopped] } else { vec![] },
        toward: crate::core::plan::Toward::Desired,
    }
}

/// A spare at rest (`why`): drained and stopped through the apply's own steps while it runs, told
/// `down`; looked at again after `ROLL_HELD`. A dry run says so only.
pub(super) async fn rest<H: Host>(
    ctx: &Ctx<H>,
    d: &DesiredState,
    st: &mut UnitState,
    (o, props): (&Observed, &UnitProps),
    why: String,
    dry_run: bool,
) -> Result<Report> {
    let plan = rest_plan(o, why.clone());
    (ctx.events)(&d.spec.unit, &Event::Plan(plan.clone()));
    if dry_run {
        return Ok(conclude::observed_only(plan, None, None));
    }
    let unit = &d.spec.unit;
    // Counted by its siblings as the group's spare: its record names the group.
    st.desired = Some(d.record(ctx.host.now()));
    ctx.store.save(st)?;
    if !plan.steps.is_empty() {
        (ctx.events)(unit, &Event::Phase(format!("stopping {unit}: {why}")));
        let t = act::Target::desired(d, d.spec.base_url(), false);
        let mut stop = act::StopRecord::default();
        if let Err(f) = steps::run_steps(ctx, st, unit, &plan.steps, &t, props, &mut stop, None).await {
            let verdict = format!("{why}; its stop failed at {:?}: {}", f.step, f.message);
            (ctx.events)(unit, &Event::Warning(verdict.clone()));
            return Ok(conclude::rolling(plan, verdict, false, timing::ROLL_WAIT));
        }
    }
    let down = ServingState::Down { why: why.clone(), since: ctx.host.now() };
    if !ctx.host.serving_state(unit).is_some_and(|s| s.same(&down)) {
        ctx.host.set_serving_state(unit, &down)?;
    }
    Ok(conclude::rolling(plan, why, false, timing::ROLL_HELD))
}

/// A spare that serves (its apply done, `report`) looks again soon: it is stopped once the
/// group is at rest. A one-shot apply waits for that too. A failed apply keeps its own action.
pub(super) fn keep_serving(report: &mut Report) {
    if matches!(report.outcome, None | Some(record::Outcome::Applied | record::Outcome::Started)) {
        report.action = crate::core::conclude::Action::Requeue(timing::ROLL_WAIT);
        report.roll_wait = true;
    }
}

/// The plan `status` shows for a member of a group: a spare's (at rest: held stopped), or a
/// replica's with why it waits for its group, or why its group's roll stopped.
pub fn group_plan<H: Host>(ctx: &Ctx<H>, d: &DesiredState, st: &UnitState, o: &Observed, plan: Plan) -> Result<Plan> {
    let Some(rollout) = &d.spec.rollout else { return Ok(plan) };
    match role(ctx, d, st, o)? {
        Some(Spare::Rest(why)) => return Ok(rest_plan(o, why)),
        Some(Spare::Serve(why)) => {
            let mut plan = plan;
            plan.reasons.push(why);
            return Ok(plan);
        }
        None => {}
    }
    if !plan.steps.contains(&Step::Stop) {
        return Ok(plan);
    }
    let serving = serves(ctx.host.serving_state(&d.spec.unit).as_ref(), o);
    let siblings = siblings(ctx, &d.spec.unit, &rollout.group)?;
    let mut plan = plan;
    match roll::gate(&rollout.group, rollout.into(), (serving, false), &siblings) {
        Roll::Go => {}
        Roll::Wait(why) => plan.reasons.push(format!("{why} (group {})", rollout.group)),
        Roll::Hold(why) => plan.reasons.push(why),
    }
    Ok(plan)
}
