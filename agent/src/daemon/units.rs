//! The units the agent manages, from each read of the source: which it may manage
//! (`manage_units`, specd's own never), a worker each, orphans and prunes.

use super::worker::worker;
use super::*;
use crate::config::AgentConfig;
use crate::core::guard::{catch, lock};
use crate::daemon::metrics::Metrics;
use crate::host::RealHost;
use crate::machine::store::{self, Source, SourceState};
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
    pub(super) last_head: Option<String>,
}

impl Units {
    /// Read the head of the source and hand each unit its desired state, if the head may deploy.
    pub(super) async fn sync_source(&mut self, read: Read) {
        let Units { src, cfg, hostname, state_dir, ctx, metrics, workers, last_head, .. } = self;
        let store = &ctx.store;
        let started = Instant::now();
        metrics.source_read();
        let prev = SourceState::load(state_dir).unwrap_or_default();
        let s2 = src.clone();
        let accepted = prev.accepted_commit.clone();
        let allow_rewind = cfg.allow_rewind;
        let (host, labels, record) = (hostname.to_string(), cfg.labels.0.clone(), prev.accepted_record.clone());
        let res = tokio::task::spawn_blocking(move || {
            let s = lock(&s2);
            let who = Follower { host: &host, labels: &labels, record: record.as_deref() };
            catch(|| evaluate(&s, accepted.as_deref(), allow_rewind, who))
        })
        .await;
        let eval = match res {
            Ok(Ok(e)) => e,
            Ok(Err(e)) => Evaluation {
                head: None,
                error: Some(format!("the source: internal error while reading specs: {e}; nothing changed")),
                desired: vec![],
                fleet: None,
            },
            Err(e) => Evaluation {
                head: None,
                error: Some(format!("the source: internal error while reading specs: {e}; nothing changed")),
                desired: vec![],
                fleet: None,
            },
        };
        let eval = gate_units(eval, cfg.manage_units.as_deref());
        let mut st = SourceState {
            repo: cfg.repo.clone().unwrap_or_default(),
            followed: lock(src).followed(),
            accepted_commit: prev.accepted_commit.clone(),
            head_commit: eval.head.clone(),
            error: eval.error.clone(),
            time: store::now(),
            orphans: prev.orphans.clone(),
            fleet: eval.fleet.clone(),
            accepted_record: prev.accepted_record.clone(),
        };
        if eval.head.is_some() {
            metrics.source_reached(st.time);
        }
        if let Some(accepted) = &prev.accepted_commit {
            metrics.source_revision(accepted);
        }
        if read == Read::IfHeadMoved && eval.seen() == *last_head && eval.error.is_none() {
            return;
        }
        *last_head = eval.seen();
        if let Some(e) = eval.error.as_deref().or(eval.waiting()) {
            match eval.error {
                Some(_) => tracing::error!(commit = eval.head.as_deref().unwrap_or("-"), "not deployed: {e}"),
                // A fleet's host before its promotion record: it keeps what it runs.
                None => tracing::info!(commit = eval.head.as_deref().unwrap_or("-"), "{e}"),
            }
            // Bad commit: the source's state says why (every unit's status shows it); change
            // nothing. A unit's own state is written only by its reconciles.
            let _ = st.save(state_dir);
            // Starting with a head that may not deploy: keep the units on the accepted commit (finish
            // interrupted applies, start stopped units) rather than leaving them unreconciled.
            if workers.is_empty()
                && let Some(acc) = prev.accepted_commit.as_deref().and_then(|a| git2::Oid::from_str(a).ok())
            {
                let (s2, host) = (src.clone(), hostname.to_string());
                let fallback = tokio::task::spawn_blocking(move || read_commit(&lock(&s2), acc, &host)).await;
                // The accepted commit passes the same gate as a new head (manage_units may have
                // been narrowed since it was accepted); its other units are kept running.
                let fallback = fallback.map(|r| {
                    r.map(|desired| {
                        let (managed, refused) = manage_gate(desired, cfg.manage_units.as_deref());
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
                            ensure_worker(workers, d, ctx, metrics);
                        }
                    }
                    Ok(Err(e)) => tracing::error!("the accepted commit cannot be read either: {e}"),
                    Err(e) => tracing::error!("reading the accepted commit panicked: {e}"),
                }
            }
            return;
        }
        // The head, or with a fleet file the revision the promotion record assigns this host.
        let commit = eval.revision().unwrap_or_default().to_string();
        st.accepted_commit = Some(commit.clone());
        st.accepted_record = eval.fleet.as_ref().and_then(|f| f.record.clone());
        metrics.source_revision(&commit);
        let mut seen = Vec::new();
        for d in eval.desired {
            seen.push(d.spec.unit.clone());
            ensure_worker(workers, d, ctx, metrics);
        }

        // Units specd manages that this commit has no spec for: orphaned (left running) or pruned.
        let managed = store.units().unwrap_or_default();
        let orphans: Vec<String> = managed.into_iter().filter(|u| !seen.contains(u)).collect();
        for u in &orphans {
            if let Some(w) = workers.remove(u) {
                // Its worker ends after the reconcile it may be in (it sees its sender gone).
                drop(w.desired);
                metrics.forget(u);
            }
            if cfg.prune {
                // In the background, under the unit's lock: a stop may take TimeoutStopSec.
                let (ctx, u) = (ctx.clone(), u.clone());
                tokio::spawn(async move { reconcile::prune(&ctx, &u).await });
            } else if !prev.orphans.contains(u) {
                tracing::warn!(unit = %u, "orphaned: its spec is gone from {}; left running (set prune: true to remove it)", short(&commit));
            }
        }
        st.orphans = if cfg.prune { vec![] } else { orphans };
        let _ = st.save(state_dir);
        tracing::info!(commit = %short(&commit), units = seen.len(), ms = started.elapsed().as_millis() as u64, "source read");
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
    let own = crate::core::owner::own_unit();
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
