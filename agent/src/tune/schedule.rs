//! The agent's tune (opt-in: `tune:` in agent.yaml): every `interval` seconds it evaluates each
//! speculating unit it has applied, as `specd tune` does, and exports what the data says beside
//! what runs (`specd_tune_num_steps{kind="running"|"recommended"}`, the predicted decode speed
//! and accept length of each length), with the figures the instance served since it started
//! (`specd_unit_served_*`: what the fleet's "speculation still pays" gate compares); with
//! `propose: true` it writes each recommended change as a proposal (`propose`).

use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

use super::{Evaluation, propose};
use crate::config::TuneConfig;
use crate::core::guard::lock;
use crate::core::tune::Verdict;
use crate::machine::probe::Probe;
use crate::machine::store::Store;

type Labels = Vec<(String, String)>;
type FloatGauge = Gauge<f64, AtomicU64>;

/// What the agent exports of one unit's evaluation.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Figures {
    /// Since the instance started, at the load it served: its accept length, the decode
    /// speed of a request, the requests in flight per step, the drafts counted.
    pub served_accept_length: Option<f64>,
    pub served_tok_s: Option<f64>,
    pub served_concurrency: Option<f64>,
    pub drafts: u64,
    pub running: u32,
    /// `None`: it cannot tell yet.
    pub recommended: Option<u32>,
    /// `(num_steps, decode tok/s per request, accept length)` of each length predicted.
    pub predicted: Vec<(u32, Option<f64>, Option<f64>)>,
}

impl Figures {
    pub fn of(e: &Evaluation) -> Figures {
        let o = &e.observed;
        let p = &e.prediction;
        Figures {
            served_accept_length: o.accept_length,
            served_tok_s: o.decode.and_then(|d| Some(d.tokens_per_step()? / d.step_s()?)),
            served_concurrency: o.load.concurrency,
            drafts: p.drafts,
            running: o.running_k,
            recommended: match p.verdict {
                Verdict::Keep { k } | Verdict::Change { to: k, .. } => Some(k),
                Verdict::CannotTell { .. } => None,
            },
            predicted: p
                .rows
                .iter()
                .filter(|r| r.not_predicted.is_none())
                .map(|r| (r.k, r.tok_s_per_request, r.accept_length))
                .collect(),
        }
    }
}

/// The agent's tune metrics (registered with the others when `tune:` is configured).
#[derive(Clone, Default)]
pub struct TuneMetrics {
    pub served_accept_length: Family<Labels, FloatGauge>,
    pub served_tok_s: Family<Labels, FloatGauge>,
    pub served_concurrency: Family<Labels, FloatGauge>,
    pub served_drafts: Family<Labels, FloatGauge>,
    pub num_steps: Family<Labels, Gauge>,
    pub predicted_tok_s: Family<Labels, FloatGauge>,
    pub predicted_accept_length: Family<Labels, FloatGauge>,
    pub last: Family<Labels, FloatGauge>,
    /// The labels each unit's series have now (to remove them when they change).
    now: Arc<Mutex<BTreeMap<String, Vec<Labels>>>>,
}

fn unit_labels(unit: &str) -> Labels {
    vec![("unit".into(), unit.into())]
}

impl TuneMetrics {
    /// One unit's figures, replacing its series of before; `at`: Unix seconds.
    pub fn set(&self, unit: &str, f: &Figures, at: u64) {
        self.clear(unit);
        let u = unit_labels(unit);
        let put = |fam: &Family<Labels, FloatGauge>, l: Labels, v: Option<f64>| {
            if let Some(v) = v.filter(|v| v.is_finite()) {
                fam.get_or_create(&l).set(v);
            }
        };
        put(&self.served_accept_length, u.clone(), f.served_accept_length);
        put(&self.served_tok_s, u.clone(), f.served_tok_s);
        put(&self.served_concurrency, u.clone(), f.served_concurrency);
        put(&self.served_drafts, u.clone(), Some(f.drafts as f64));
        put(&self.last, u.clone(), Some(at as f64));
        let mut labels = vec![u.clone()];
        for (kind, k) in [("running", Some(f.running)), ("recommended", f.recommended)] {
            let Some(k) = k else { continue };
            let l = [u.clone(), vec![("kind".into(), kind.into())]].concat();
            self.num_steps.get_or_create(&l).set(i64::from(k));
            labels.push(l);
        }
        for (k, tok_s, length) in &f.predicted {
            let l = [u.clone(), vec![("num_steps".into(), k.to_string())]].concat();
            put(&self.predicted_tok_s, l.clone(), *tok_s);
            put(&self.predicted_accept_length, l.clone(), *length);
            labels.push(l);
        }
        lock(&self.now).insert(unit.to_string(), labels);
    }

    /// Remove a unit's series (it no longer speculates, or is gone).
    pub fn clear(&self, unit: &str) {
        for l in lock(&self.now).remove(unit).unwrap_or_default() {
            for fam in [
                &self.served_accept_length,
                &self.served_tok_s,
                &self.served_concurrency,
                &self.served_drafts,
                &self.predicted_tok_s,
                &self.predicted_accept_length,
                &self.last,
            ] {
                fam.remove(&l);
            }
            self.num_steps.remove(&l);
        }
    }
}

/// The agent's tune loop: every `cfg.interval` seconds, each speculating unit of the state
/// directory evaluated, its figures exported, and (with `propose`) a recommended change
/// proposed. Runs until the task is dropped.
pub async fn run(cfg: TuneConfig, store: Store, proposals: Option<propose::Options>, metrics: TuneMetrics) {
    let every = Duration::from_secs(cfg.interval.max(1));
    let probe = Probe::default();
    loop {
        tokio::time::sleep(every).await;
        let units = match store.units() {
            Ok(u) => u,
            Err(e) => {
                tracing::warn!("tune: listing the units: {e:#}");
                continue;
            }
        };
        for unit in units {
            once(&cfg, &store, &probe, proposals.as_ref(), &metrics, &unit).await;
        }
    }
}

/// One unit's evaluation, exported and (when asked and recommended) proposed.
async fn once(
    cfg: &TuneConfig,
    store: &Store,
    probe: &Probe,
    proposals: Option<&propose::Options>,
    metrics: &TuneMetrics,
    unit: &str,
) {
    let min = cfg.min_drafts.unwrap_or(crate::core::tune::MIN_DRAFTS);
    let e = match super::evaluate(store, probe, unit, None, min).await {
        Ok(e) => e,
        Err(why) => {
            tracing::debug!(%unit, "tune: {why}");
            metrics.clear(unit);
            return;
        }
    };
    metrics.set(unit, &Figures::of(&e), crate::machine::store::now());
    tracing::info!(%unit, "tune: {}", super::show::verdict(&e.prediction));
    let (Some(p), Verdict::Change { to, .. }) = (proposals, &e.prediction.verdict) else { return };
    let message = super::show::message(unit, &p.host, &e, None);
    match propose::propose_blocking(p.clone(), unit, *to, message).await {
        Ok(done) => tracing::info!(%unit, "tune: {}", done.said()),
        Err(err) => tracing::warn!(%unit, "tune: proposing: {err:#}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_units_series_are_replaced_and_cleared() {
        let m = TuneMetrics::default();
        let f = Figures {
            served_accept_length: Some(3.1),
            served_tok_s: Some(220.0),
            served_concurrency: Some(2.0),
            drafts: 1000,
            running: 4,
            recommended: Some(3),
            predicted: vec![(3, Some(230.0), Some(3.0)), (4, Some(220.0), Some(3.1))],
        };
        m.set("q.service", &f, 7);
        assert_eq!(
            m.num_steps
                .get_or_create(&[unit_labels("q.service"), vec![("kind".into(), "recommended".into())]].concat())
                .get(),
            3
        );
        let four = [unit_labels("q.service"), vec![("num_steps".into(), "4".into())]].concat();
        assert_eq!(m.predicted_tok_s.get_or_create(&four).get(), 220.0);
        // Cannot tell any more: the recommendation is gone, the running length stays.
        m.set("q.service", &Figures { recommended: None, predicted: vec![], ..f.clone() }, 8);
        assert_eq!(lock(&m.now)["q.service"].len(), 2);
        assert!(!m.num_steps.remove(&[unit_labels("q.service"), vec![("kind".into(), "recommended".into())]].concat()));
        m.clear("q.service");
        assert!(!m.served_tok_s.remove(&unit_labels("q.service")));
    }
}
