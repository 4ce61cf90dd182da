//! The Sweep hold on the swept unit: taken when no other hold is in effect, pushed on while the
//! sweep runs, ended with it.

use super::*;
use crate::core::hold::{Hold, HoldKind};
use crate::core::timing;
use crate::machine::store::Store;
use anyhow::Result;

/// The sweep's hold on its unit: a running agent leaves the unit alone while this process lives
/// (and until the hold expires: a task pushes the expiry on every quarter of it, whatever the
/// sweep is doing, so a long point never outlives its hold).
pub(super) struct SweepHold {
    pub(super) unit: String,
    pub(super) hold: Hold,
    pub(super) refresher: tokio::task::JoinHandle<()>,
}

impl SweepHold {
    /// Hold the unit, unless someone else's hold is in effect (a suspend, a pin, a sweep that
    /// still runs: the one hold gate, [`Host::hold_in_effect`]).
    pub(super) async fn take<H: SweepHost>(
        host: &H,
        store: &Store,
        unit: &str,
        name: &str,
    ) -> Result<SweepHold, String> {
        let st = store.peek(unit).map_err(|e| format!("{e:#}"))?;
        if let Some(h) = &st.hold
            && let crate::core::hold::HoldEffect::HandsOff(_) = host.hold_in_effect(Some(h))
        {
            return Err(format!("{}: a sweep does not take a unit someone holds", h.describe()));
        }
        let now = host.now();
        let (me, started) = host.me();
        let hold = Hold {
            until: Some(now + timing::SWEEP_HOLD_FOR.as_secs()),
            pid: Some(me),
            pid_start: started,
            ..Hold::new(HoldKind::Sweep, format!("specd sweep {name}"), now)
        };
        store.set_hold(unit, hold.clone()).await.map_err(|e| format!("{e:#}"))?;
        let refresher = {
            let (host, store, unit, mut hold) = (host.clone(), store.clone(), unit.to_string(), hold.clone());
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(timing::SWEEP_HOLD_FOR / 4).await;
                    // Only this sweep's hold (one set since by someone else stays as it is).
                    let pushed = Hold { until: Some(host.now() + timing::SWEEP_HOLD_FOR.as_secs()), ..hold.clone() };
                    match store.set_hold_if(&unit, pushed.clone(), |h| *h == hold).await {
                        Ok(true) => hold = pushed,
                        Ok(false) => return,
                        Err(e) => tracing::warn!("refreshing the hold on {unit}: {e:#}"),
                    }
                }
            })
        };
        Ok(SweepHold { unit: unit.into(), hold, refresher })
    }

    /// End the hold (only this sweep's: one set since by someone else stays).
    pub(super) async fn release(self, store: &Store) {
        self.refresher.abort();
        let me = self.hold.pid;
        let why = "the sweep ended";
        if let Err(e) = store.clear_hold_if(&self.unit, why, |h| h.kind == HoldKind::Sweep && h.pid == me).await {
            tracing::warn!("clearing the hold on {}: {e:#}; it ends with this process", self.unit);
        }
    }
}
