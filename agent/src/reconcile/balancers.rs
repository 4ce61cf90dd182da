//! What a unit's load balancers are told through a reconcile: `drain` before its serving instance
//! is stopped, then the wait until each that polls it saw the mark (`serving::seen`: their polls,
//! or the settle time when none polls), within the drain budget; and at the end, what the
//! reconcile concluded (`serving::After`: ready only for a verified unit that serves).

use super::steps::{Run, StepFailure};
use super::*;
use crate::core::plan::{Observed, Step};
use crate::core::serving::{self, After, Seen, ServingState};
use crate::core::timing;
use crate::host::Host;
use specd_spec::{exec_start, short};

impl<H: Host> Run<'_, H> {
    /// Tell the unit's load balancers `drain` (once per run); the mark's time (unix ms).
    pub(super) fn mark_drain(&mut self) -> anyhow::Result<u64> {
        let (ctx, t) = (self.ctx, self.t);
        let why = match t.mode {
            _ if t.pruning => format!("specd is stopping it: {}", super::prune::GONE),
            super::act::Mode::Apply(_) => format!("specd is stopping it to apply unit {}", short(t.sha256)),
            super::act::Mode::Restore(crate::core::recovery::Restore::Rollback) => {
                format!("specd is rolling back to the last good unit {}", short(t.sha256))
            }
            super::act::Mode::Restore(crate::core::recovery::Restore::HostFault) => {
                format!("specd is starting the last good unit {} again", short(t.sha256))
            }
        };
        let at = ctx.host.now_ms();
        ctx.host.set_serving_state(self.unit, &ServingState::Drain { why, since: at / 1000 })?;
        self.marked = true;
        Ok(at)
    }

    /// After the mark at `mark_ms`: until every load balancer that polls the unit has seen it,
    /// or none does and the settle time passed, within the drain budget; then says what kept new
    /// requests away from the instance, or that nothing did.
    pub(super) async fn wait_for_balancers(&mut self, mark_ms: u64) -> Result<(), StepFailure> {
        let (ctx, unit, t) = (self.ctx, self.unit, self.t);
        let emit = |e: Event| (ctx.events)(unit, &e);
        let told = loop {
            self.stops_here(Step::Drain)?;
            match serving::seen(&ctx.host.lb_polls(unit), mark_ms, ctx.host.now_ms(), ctx.lb, t.drain) {
                Seen::Done(told) => break told,
                Seen::Waiting { pending } if pending.is_empty() => {
                    emit(Event::Waiting(match ctx.lb.answering_since_ms {
                        Some(_) => format!(
                            "no load balancer has polled this unit yet: this command only began answering their checks (no agent runs); waiting up to {} s for their first polls",
                            timing::FIRST_POLLS_WITHIN.as_secs()
                        ),
                        None => "no load balancer polls this unit; waiting the settle time".into(),
                    }))
                }
                Seen::Waiting { pending } => {
                    emit(Event::Waiting(format!("waiting for {} to see drain", pending.join(", "))))
                }
            }
            tokio::time::sleep(timing::LB_LOOK).await;
        };
        match crate::core::door::kept_away(&told, &self.door) {
            (false, line) => emit(Event::Progress(line)),
            (true, line) => emit(Event::Warning(line)),
        }
        Ok(())
    }
}

/// At the end of a reconcile of `d` (or a held look), tell the unit's load balancers what it
/// concluded (`after`, resolved on what the reconcile observed, `o`); nothing when it keeps what
/// they were told, or that is the same already.
pub(super) fn tell<H: Host>(
    ctx: &Ctx<H>,
    d: &DesiredState,
    st: &UnitState,
    o: &Observed,
    after: &After,
) -> anyhow::Result<()> {
    let unit = &d.spec.unit;
    let argv = verified_argv(d, st, o);
    let told = ctx.host.serving_state(unit);
    let Some(state) = serving::resolve(after, told.as_ref(), o, argv.as_deref(), ctx.host.now()) else {
        return Ok(());
    };
    if told.is_some_and(|s| s.same(&state)) {
        return Ok(());
    }
    ctx.host.set_serving_state(unit, &state)
}

/// The command line of the deployed unit, when that unit passed verification: the desired one
/// verified before, or the last good one.
fn verified_argv(d: &DesiredState, st: &UnitState, o: &Observed) -> Option<Vec<String>> {
    let deployed = o.deployed_sha256.as_deref()?;
    if deployed == d.unit.sha256 && st.verified_before(&d.unit.sha256) {
        return Some(d.spec.argv.clone());
    }
    st.last_good.as_ref().filter(|g| g.sha256 == deployed).and_then(|g| exec_start(&g.text))
}
