//! A draining unit's port closed to new connections (`service.drain_refuse_new`, `core::door`):
//! closed before the drain (recorded first in the unit's state, `refusing`), opened once the old
//! instance stopped, and opened again at the end of the run whatever ended it; one left by an
//! apply that was killed is opened by the unit's next reconcile (`leftover`). A port that cannot
//! be closed is said, and the apply drains as without it: nothing of a good change is refused
//! for it, and nothing is left half-done (a failed close is undone).

use super::steps::{Run, StepFailure};
use super::*;
use crate::core::door::{self, Door};
use crate::core::record::UnitState;
use crate::host::Host;

impl<H: Host> Run<'_, H> {
    /// Before the drain or the stop of a serving instance whose spec asks for it: its port
    /// closed to new connections (once per run).
    pub(super) async fn close_door(&mut self, st: &mut UnitState) {
        let (ctx, unit, t) = (self.ctx, self.unit, self.t);
        let wanted = t.mode.spec().is_some_and(|s| s.service.drain_refuse_new) && self.before.is_running();
        if !wanted || self.door != Door::Off {
            return;
        }
        let emit = |e: Event| (ctx.events)(unit, &e);
        let Some(port) = door::port_of(&t.old_url) else {
            self.door = Door::Failed { port: None, why: format!("no port in {}", t.old_url) };
            return;
        };
        // Recorded first: a kill from here on leaves what the next reconcile removes.
        let left = st.refusing.replace(port);
        if let Err(e) = ctx.store.save(st) {
            st.refusing = left;
            self.door = Door::Failed { port: Some(port), why: format!("specd's state could not be saved: {e:#}") };
            return;
        }
        match ctx.host.refuse_new(unit, port).await {
            Ok(()) => {
                self.door = Door::Closed { port };
                emit(Event::Progress(format!(
                    "new connections to port {port} refused (nftables table {}) until the old instance has stopped",
                    door::TABLE
                )));
            }
            Err(e) => {
                self.door = Door::Failed { port: Some(port), why: format!("{e:#}") };
                emit(Event::Warning(format!(
                    "could not refuse new connections to port {port} ({e:#}); draining as without service.drain_refuse_new"
                )));
                // One transaction, all or nothing: refused, nothing of it is there (but a rule
                // a killed apply left, which the reconcile's start could not remove); one that
                // timed out may have been applied, and is removed.
                if crate::machine::nft::nothing_applied(&e) && left.is_none() {
                    st.refusing = None;
                    let _ = ctx.store.save(st);
                } else {
                    self.open_door(st).await;
                }
            }
        }
    }

    /// Its port open again (once the old instance stopped, and at the end of the run): nothing
    /// when it was not closed; asked twice, then a failure is said, and the next call (or
    /// reconcile) tries again.
    pub(super) async fn open_door(&mut self, st: &mut UnitState) {
        let Some(port) = st.refusing else { return };
        let (ctx, unit) = (self.ctx, self.unit);
        let mut r = ctx.host.accept_new(unit).await;
        if r.is_err() {
            r = ctx.host.accept_new(unit).await;
        }
        match r {
            Ok(()) => {
                st.refusing = None;
                if matches!(self.door, Door::Closed { .. }) {
                    (ctx.events)(unit, &Event::Progress(format!("new connections to port {port} accepted again")));
                }
            }
            Err(e) => (ctx.events)(
                unit,
                &Event::Warning(format!(
                    "could not remove the rule refusing new connections to port {port} ({e:#}); trying again"
                )),
            ),
        }
    }

    /// Once the old instance stopped: its port open, or the run stops there (a server started
    /// behind a closed port could not be reached, and its readiness would fail a good spec).
    pub(super) async fn open_before_start(&mut self, st: &mut UnitState) -> Result<(), StepFailure> {
        self.open_door(st).await;
        match st.refusing {
            None => Ok(()),
            Some(port) => Err(StepFailure::host(
                crate::core::plan::Step::WaitStopped,
                format!(
                    "new connections to port {port} are still refused by specd's nftables rule: not starting a server nothing could reach"
                ),
            )),
        }
    }
}

/// At a reconcile's start, under the unit's lock (no apply of it drains): a rule an apply that
/// was killed left refusing new connections to the unit's port, removed.
pub(super) async fn leftover<H: Host>(ctx: &Ctx<H>, unit: &str, st: &mut UnitState) {
    let Some(port) = st.refusing else { return };
    let emit = |e: Event| (ctx.events)(unit, &e);
    match ctx.host.accept_new(unit).await {
        Ok(()) => {
            st.refusing = None;
            let _ = ctx.store.save(st);
            emit(Event::Progress(format!(
                "removed the rule an interrupted apply left refusing new connections to port {port}"
            )));
        }
        Err(e) => emit(Event::Warning(format!(
            "could not remove the rule an interrupted apply left refusing new connections to port {port} ({e:#}); trying again at the next reconcile"
        ))),
    }
}
