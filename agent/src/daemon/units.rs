//! The units the agent manages, from each read of the source: which it may manage
//! (`manage_units`, specd's own never), a worker each, orphans and prunes.

use super::worker::worker;
use super::*;
use crate::config::AgentConfig;
use crate::core::guard::{catch, lock};
use crate::core::record::Source;
use crate::daemon::metrics::Metrics;
use crate::host::RealHost;
use crate::machine::store::{self, SourceState};
use crate::reconcile::{self, Ctx, DesiredState};
use crate::source::follow::{Evaluation, Follower, evaluate, read_commit};
use crate::source::git::GitSource;
use specd_spec::short;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::{Notify, watch};

/// Whether a source read hands the units their desired states again when the head has not
/// moved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Read {
    /// Only a new head (or one that may not deploy) changes anything: polls, ref changes.
    IfHeadMoved,
    /// Every read counts: the first, SIGHUP, `specd reconcile`, the periodic resync.
    Always,
}

/// The agent between two triggers: its source, the units' workers, the head it read last.
pub(super) struct Units {
    /// The unit the agent runs as ([`own_main_unit`]).
    pub(super) own_unit: Option<String>,
    pub(super) src: Arc<Mutex<GitSource>>,
    pub(super) cfg: AgentConfig,
    pub(super) hostname: String,
    pub(super) state_dir: PathBuf,
    pub(super) ctx: Arc<Ctx<RealHost>>,
    pub(super) metrics: Arc<Metrics>,
    pub(super) workers: BTreeMap<String, Worker>,
    /// Work on units the head no longer has that may still run: their workers finishing the
    /// reconcile they were in, and prunes. The agent's stop waits for them as for the workers.
    pub(super) leaving: Vec<(String, tokio::task::JoinHandle<()>)>,
    pub(super) last_head: Option<String>,
}

impl Units {
    /// Read the head of the source and hand each unit its desired state, if the head may deploy.
    pub(super) async fn sync_source(&mut self, read: Read) {
        let started = Instant::now();
        self.metrics.source_read();
        let prev = SourceState::load(&self.state_dir).unwrap_or_default();
        let eval = gate_units(self.evaluate(&prev).await, self.cfg.manage_units.as_deref());
        let st = self.source_state(&prev, &eval);
        if eval.head.is_some() {
            self.metrics.source_reached(st.time);
        }
        if let Some(accepted) = &prev.accepted_commit {
            self.metrics.source_revision(accepted);
        }
        if read == Read::IfHeadMoved && eval.seen() == self.last_head && eval.error.is_none() {
            return;
        }
        self.last_head = eval.seen();
        if let Some(e) = eval.error.as_deref().or(eval.waiting()) {
            match eval.error {
                Some(_) => tracing::error!(commit = eval.head.as_deref().unwrap_or("-"), "not deployed: {e}"),
                // A fleet's host before its promotion record: it keeps what it runs.
                None => tracing::info!(commit = eval.head.as_deref().unwrap_or("-"), "{e}"),
            }
            // Bad commit: the source's state says why (every unit's status shows it); change
            // nothing. A unit's own state is written only by its reconciles.
            let _ = st.save(&self.state_dir);
            // Starting with a head that may not deploy: keep the units on the accepted commit (finish
            // interrupted applies, start stopped units) rather than leaving them unreconciled.
            if self.workers.is_empty() {
                self.keep_accepted(&prev).await;
            }
            return;
        }
        self.deploy(eval, &prev, st, started);
    }

    /// The source's head as it stands, evaluated for this host off the async thread (git reads
    /// block); a panic of the read is an error of the read, and nothing changes.
    async fn evaluate(&self, prev: &SourceState) -> Evaluation {
        let src = self.src.clone();
        let accepted = prev.accepted_commit.clone();
        let allow_rewind = self.cfg.allow_rewind;
        let (host, labels, record) = (self.hostname.clone(), self.cfg.labels.0.clone(), prev.accepted_record.clone());
        let res = tokio::task::spawn_blocking(move || {
            let s = lock(&src);
            let who = Follower { host: &host, labels: &labels, record: record.as_deref() };
            catch(|| evaluate(&s, accepted.as_deref(), allow_rewind, who))
        })
        .await;
        let internal = |e: &dyn std::fmt::Display| Evaluation {
            head: None,
            error: Some(format!("the source: internal error while reading specs: {e}; nothing changed")),
            desired: vec![],
            fleet: None,
        };
        match res {
            Ok(Ok(e)) => e,
            Ok(Err(e)) => internal(&e),
            Err(e) => internal(&e),
        }
    }

    /// The source's state after this read, before it deploys anything: what was accepted stays
    /// accepted.
    fn source_state(&self, prev: &SourceState, eval: &Evaluation) -> SourceState {
        SourceState {
            repo: self.cfg.repo.clone().unwrap_or_default(),
            followed: lock(&self.src).followed(),
            accepted_commit: prev.accepted_commit.clone(),
            head_commit: eval.head.clone(),
            error: eval.error.clone(),
            time: store::now(),
            orphans: prev.orphans.clone(),
            fleet: eval.fleet.clone(),
            accepted_record: prev.accepted_record.clone(),
        }
    }

    /// At a start on a head that may not deploy: a worker for each unit of the commit accepted
    /// before, which passes the same gate as a new head (manage_units may have been narrowed
    /// since it was accepted); its other units are kept running.
    async fn keep_accepted(&mut self, prev: &SourceState) {
        let Some(acc) = prev.accepted_commit.as_deref().and_then(|a| git2::Oid::from_str(a).ok()) else { return };
        let (src, host) = (self.src.clone(), self.hostname.clone());
        let fallback = tokio::task::spawn_blocking(move || read_commit(&lock(&src), acc, &host)).await;
        let fallback = fallback.map(|r| {
            r.map(|desired| {
                let (managed, refused) = manage_gate(desired, self.cfg.manage_units.as_deref());
                for (d, e) in refused {
                    tracing::warn!("the accepted commit's {}: {e}; left alone", d.spec.unit);
                }
                managed
            })
        });
        match fallback {
            Ok(Ok(desired)) => {
                tracing::info!(commit = %short(&acc.to_string()), "reconciling the units of the accepted commit");
                for d in desired {
                    ensure_worker(&mut self.workers, d, &self.ctx, &self.metrics);
                }
            }
            Ok(Err(e)) => tracing::error!("the accepted commit cannot be read either: {e}"),
            Err(e) => tracing::error!("reading the accepted commit panicked: {e}"),
        }
    }

    /// Deploy a read that may: accept its revision, hand each unit its desired state, and orphan
    /// or prune the units specd manages that it has no spec for; then save the source's state.
    fn deploy(&mut self, eval: Evaluation, prev: &SourceState, mut st: SourceState, started: Instant) {
        // The head, or with a fleet file the revision the promotion record assigns this host.
        let commit = eval.revision().unwrap_or_default().to_string();
        st.accepted_commit = Some(commit.clone());
        st.accepted_record = eval.fleet.as_ref().and_then(|f| f.record.clone());
        self.metrics.source_revision(&commit);
        let seen: Vec<String> = eval.desired.iter().map(|d| d.spec.unit.clone()).collect();
        let managed = self.ctx.store.units().unwrap_or_default();
        let orphans: Vec<String> = managed.into_iter().filter(|u| !seen.contains(u)).collect();
        st.orphans = if self.cfg.prune { vec![] } else { orphans.clone() };
        // Saved before any unit hears of it: a replica's gate counts no orphan as its sibling, and
        // the look at an orphan ends once a spec desires it again.
        let _ = st.save(&self.state_dir);
        self.let_go(&orphans, prev, &commit);
        for d in eval.desired {
            ensure_worker(&mut self.workers, d, &self.ctx, &self.metrics);
        }
        tracing::info!(commit = %short(&commit), units = seen.len(), ms = started.elapsed().as_millis() as u64, "source read");
    }

    /// Units specd manages that the deployed commit has no spec for (`orphans`): their workers
    /// end, and each is pruned (`prune: true`) or orphaned (left running, what its load balancers
    /// are told following what it runs: `reconcile::watch_orphan`, one a unit).
    fn let_go(&mut self, orphans: &[String], prev: &SourceState, commit: &str) {
        self.leaving.retain(|(_, h)| !h.is_finished());
        for u in orphans {
            // A look at it already under way (an orphan since an earlier read), or its prune.
            let watched = self.leaving.iter().any(|(l, _)| l == u);
            let worker = self.workers.remove(u).map(|w| {
                // Its worker ends after the reconcile it may be in (it sees its sender gone).
                drop(w.desired);
                self.metrics.forget(u);
                w.handle
            });
            let (ctx, unit) = (self.ctx.clone(), u.clone());
            if self.cfg.prune {
                self.leaving.extend(worker.map(|h| (u.clone(), h)));
                // In the background, under the unit's lock: a stop may take TimeoutStopSec.
                let h = tokio::spawn(async move {
                    reconcile::prune(&ctx, &unit).await;
                });
                self.leaving.push((u.clone(), h));
                continue;
            }
            if !prev.orphans.contains(u) {
                tracing::warn!(unit = %u, "orphaned: its spec is gone from {}; left running (set prune: true to remove it)", short(commit));
            }
            if watched {
                self.leaving.extend(worker.map(|h| (u.clone(), h)));
                continue;
            }
            // After the reconcile its worker may be in.
            let h = tokio::spawn(async move {
                if let Some(w) = worker {
                    let _ = w.await;
                }
                reconcile::watch_orphan(&ctx, &unit).await;
            });
            self.leaving.push((u.clone(), h));
        }
    }

    pub(super) fn poke(&self, unit: &str) {
        if let Some(w) = self.workers.get(unit) {
            w.poke.notify_one();
        }
    }

    pub(super) fn poke_all(&self) {
        self.workers.values().for_each(|w| w.poke.notify_one());
    }
}

/// The manage_units gate (see [`crate::core::owner`]): the desired units this agent may manage, and
/// those it may not with why.
pub(super) fn manage_gate(
    desired: Vec<DesiredState>,
    pattern: Option<&str>,
) -> (Vec<DesiredState>, Vec<(DesiredState, String)>) {
    let own = crate::machine::process::own_unit();
    let (mut managed, mut refused) = (Vec::new(), Vec::new());
    for d in desired {
        match crate::core::owner::may_manage(&d.spec.unit, own.as_deref(), pattern) {
            Ok(()) => managed.push(d),
            Err(e) => refused.push((d, e)),
        }
    }
    (managed, refused)
}

/// A commit with a unit this agent may not manage is not deployed.
pub(super) fn gate_units(mut eval: Evaluation, pattern: Option<&str>) -> Evaluation {
    let commit = eval.revision().map(short).unwrap_or("-").to_string();
    let (managed, refused) = manage_gate(std::mem::take(&mut eval.desired), pattern);
    if refused.is_empty() {
        eval.desired = managed;
        return eval;
    }
    let why: Vec<String> = refused
        .iter()
        .map(|(d, e)| {
            let file = match &d.source {
                Some(Source::Commit { path, .. }) => format!("{path}@{commit}"),
                _ => commit.clone(),
            };
            format!("{file}: spec.unit: {e}")
        })
        .collect();
    eval.error = Some(format!("commit {commit} is not deployed; nothing changed:\n{}", why.join("\n")));
    eval
}

/// Hand a unit its desired state: to its worker, started if it has none.
pub(super) fn ensure_worker(
    workers: &mut BTreeMap<String, Worker>,
    d: DesiredState,
    ctx: &Arc<Ctx<RealHost>>,
    metrics: &Arc<Metrics>,
) {
    let unit = d.spec.unit.clone();
    let d = Arc::new(d);
    match workers.get(&unit) {
        Some(w) => {
            let changed = w.desired.borrow().unit.sha256 != d.unit.sha256 || w.desired.borrow().source != d.source;
            if changed {
                let _ = w.desired.send(d);
            }
        }
        None => {
            let (tx, rx) = watch::channel(d);
            let poke = Arc::new(Notify::new());
            let handle = tokio::spawn(worker(unit.clone(), rx, poke.clone(), ctx.clone(), metrics.clone()));
            workers.insert(unit, Worker { desired: tx, poke, handle });
        }
    }
}
