//! Asked to stop: where an apply may stop (`Shutdown`, `Finish`) and the applies it must carry
//! past their old instance's stop (`Carried`).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use tokio::time::Instant;

/// Set when specd is asked to stop (SIGTERM, SIGINT, SIGHUP). An apply never stops where it
/// would leave a unit down that was serving: it stops at once only while nothing has been
/// stopped yet; once it stopped the old instance, it goes on at least until the new one is
/// started (see [`Finish`]). Its in-progress record lets the next run finish what is left.
#[derive(Clone, Debug)]
pub struct Shutdown {
    pub(super) rx: tokio::sync::watch::Receiver<bool>,
    pub(super) finish: Finish,
    pub(super) carried: Carried,
}

/// The applies that are stopping a unit's old instance: asked to stop, each goes on until its
/// new instance is started, which may be as late as the end of that stop's budget (the spec's
/// `TimeoutStopSec` and its margin) and the start after it. The agent's stop waits for them that
/// long ([`Shutdown::carried`]), whatever its own default wait.
#[derive(Clone, Debug, Default)]
pub(super) struct Carried {
    pub(super) applies: Arc<tokio::sync::watch::Sender<CarriedApplies>>,
    pub(super) next: Arc<std::sync::atomic::AtomicU64>,
}

/// The [`Carried`] applies, each under the number its guard has.
pub type CarriedApplies = std::collections::BTreeMap<u64, CarriedApply>;

/// One apply past its old instance's stop: its unit, and when that stop's budget ends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CarriedApply {
    pub unit: String,
    pub stop_ends: Instant,
}

/// An apply's place among the [`Carried`] ones, given up when it is dropped (its run ended).
pub(super) struct CarriedGuard {
    pub(super) applies: Arc<tokio::sync::watch::Sender<CarriedApplies>>,
    pub(super) id: u64,
}

impl Drop for CarriedGuard {
    fn drop(&mut self) {
        self.applies.send_modify(|m| {
            m.remove(&self.id);
        });
    }
}

/// How far an apply that was asked to stop goes before it stops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// The agent: until the new instance (or the last good one, in a rollback) is started, then
    /// at the next step or wait; the agent's next run verifies it (or rolls it back).
    Started,
    /// A one-shot command (`apply`, `rollback`): to the end, verified or rolled back, since no
    /// agent may come after it.
    Everything,
}

impl Shutdown {
    /// The agent's: see [`Finish::Started`].
    pub fn new() -> (tokio::sync::watch::Sender<bool>, Shutdown) {
        Shutdown::finishing(Finish::Started)
    }

    pub fn finishing(finish: Finish) -> (tokio::sync::watch::Sender<bool>, Shutdown) {
        let (tx, rx) = tokio::sync::watch::channel(false);
        (tx, Shutdown { rx, finish, carried: Carried::default() })
    }

    /// The applies stopping an old instance now (see [`Carried`]), and each change of them.
    pub fn carried(&self) -> tokio::sync::watch::Receiver<CarriedApplies> {
        self.carried.applies.subscribe()
    }

    /// `unit`'s apply is stopping its old instance, whose stop's budget ends at `stop_ends`;
    /// until the guard is dropped.
    pub(super) fn carry(&self, unit: &str, stop_ends: Instant) -> CarriedGuard {
        let id = self.carried.next.fetch_add(1, Ordering::Relaxed);
        let apply = CarriedApply { unit: unit.to_string(), stop_ends };
        self.carried.applies.send_modify(|m| {
            m.insert(id, apply);
        });
        CarriedGuard { applies: self.carried.applies.clone(), id }
    }

    /// One that is never set.
    pub fn never() -> Shutdown {
        let (tx, s) = Shutdown::new();
        std::mem::forget(tx);
        s
    }

    pub fn is_set(&self) -> bool {
        *self.rx.borrow()
    }

    pub async fn wait(&self) {
        let mut r = self.rx.clone();
        let _ = r.wait_for(|v| *v).await;
    }

    /// Whether an apply that was asked to stop stops here: `changed`, it already stopped,
    /// wrote or started something; `started`, the instance it puts in place was started.
    pub fn stops_here(&self, changed: bool, started: bool) -> bool {
        self.is_set() && (!changed || (started && self.finish == Finish::Started))
    }

    /// Until [`Shutdown::stops_here`] would say yes (never, when it will not).
    pub(super) async fn stopping(&self, changed: bool, started: bool) {
        if changed && (self.finish == Finish::Everything || !started) {
            return std::future::pending().await;
        }
        self.wait().await
    }
}
