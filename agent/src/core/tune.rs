//! `specd tune`'s model, pure: what a running engine counted since it started (its drafts and
//! how far into each the target accepted, its decode steps and their time, the load it served)
//! in; the accept length and the decode speed each draft length would have given, with their
//! uncertainty, and the setting the data says is best, out.
//!
//! Acceptance by position. vLLM and llama-server count, per draft position `i` (0-based), the
//! drafts whose first `i + 1` tokens were all accepted (`a_i`, non-increasing in `i`) over `N`
//! drafts: so `p_a`, the share of drafts whose accepted prefix is exactly `a` (0..=k0), is
//! known. A draft of `k ≤ k0` tokens (the running `k0`) is the first `k` tokens of the same
//! draft (a draft model's greedy guesses, an n-gram's continuation); but drafts of `k` are not
//! made where the running ones were. A running draft that accepted `a` tokens covered `a + 1`
//! tokens of the output (the accepted ones and the target's own); drafts of `k` cover the same
//! stretch in `(a + 1) / (min(a, k) + 1)` steps, each accepting `min(a, k)`. Where drafts are
//! good, shorter ones take more steps, so they count more among the drafts than the running
//! ones did (cutting each running draft at `k` instead under-predicts: −10 % at k = 1 from 6 on
//! the real vLLM's n-gram):
//!
//! ```text
//! y_a = (a + 1) / (min(a, k) + 1)
//! accept length L(k) = 1 + Σ_a p_a·y_a·min(a, k) / Σ_a p_a·y_a     (at k0: 1 + accepted / drafts)
//! ```
//!
//! Nothing is known past position `k0 - 1`: a longer draft is not predicted. Each `a_i / N` is
//! a proportion of `N` drafts (a Wilson interval each); the accept length's interval is the
//! normal one of that ratio over `N` drafts (the delta method).
//!
//! Decode speed. Not every step drafts (an n-gram finds no match): `S` decode steps produced
//! `T` tokens, `N` of them drafted. At `k` the same tokens take `S − N + N·Σ_a p_a·y_a` steps. A
//! step takes `s(k) = t·(1 + ρ·k)` (the target's pass, plus `ρ` of it per draft
//! position: drafting and verifying one more token), `s(k0)` measured (the engine's own step
//! times: vLLM's inter-token latency is observed once per decode step); `ρ` is calibrated from
//! a sweep's step times at two draft lengths or more, else assumed ([`ASSUMED_DRAFT_COST`] per
//! drafting step) and said so. A request decodes at `tokens per step / s(k)`; the throughput at
//! the concurrency served is that times the requests in flight.

use serde::{Deserialize, Serialize};

/// Fewer drafts than this since the instance started, and `tune` cannot tell yet: it predicts
/// and proposes nothing (`--min-drafts` raises or lowers it).
pub const MIN_DRAFTS: u64 = 200;

/// Without a calibration: one draft position costs this fraction of a target pass, on the
/// steps that draft.
pub const ASSUMED_DRAFT_COST: f64 = 0.05;

/// A change is recommended only when it is predicted to gain at least this fraction of the
/// objective.
pub const MIN_GAIN: f64 = 0.02;

/// The normal quantile of the 95 % intervals.
const Z: f64 = 1.96;

/// Drafts, and how far into each the target accepted.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Acceptance {
    /// Drafts: verification steps that carried at least one draft token.
    pub drafts: u64,
    /// `per_pos[i]`: drafts whose first `i + 1` draft tokens were all accepted.
    pub per_pos: Vec<u64>,
}

/// A 95 % interval.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Interval {
    pub low: f64,
    pub high: f64,
}

/// The Wilson interval of `x` successes in `n` trials (`None` with no trial).
pub fn wilson(x: u64, n: u64) -> Option<Interval> {
    if n == 0 {
        return None;
    }
    let (n, p) = (n as f64, x.min(n) as f64 / n as f64);
    let z2 = Z * Z;
    let centre = (p + z2 / (2.0 * n)) / (1.0 + z2 / n);
    let half = Z * (p * (1.0 - p) / n + z2 / (4.0 * n * n)).sqrt() / (1.0 + z2 / n);
    Some(Interval { low: (centre - half).max(0.0), high: (centre + half).min(1.0) })
}

impl Acceptance {
    /// `q_i`: the share of drafts accepted through position `i`.
    pub fn rate(&self, i: usize) -> f64 {
        match self.per_pos.get(i) {
            Some(&a) if self.drafts > 0 => a as f64 / self.drafts as f64,
            _ => 0.0,
        }
    }

    /// `p_a`: the share of drafts whose accepted prefix is exactly `a` tokens, `a` from 0 to the
    /// positions counted (the last: every position accepted).
    fn prefix_shares(&self) -> Vec<f64> {
        let n = self.per_pos.len();
        let at_least = |a: usize| if a == 0 { 1.0 } else { self.rate(a - 1) };
        (0..=n).map(|a| (at_least(a) - if a == n { 0.0 } else { self.rate(a) }).max(0.0)).collect()
    }

    /// Over the output the counted drafts covered: drafts of `k` per draft counted, and the
    /// draft tokens they accept per draft counted (`Σ_a p_a·y_a`, `Σ_a p_a·y_a·min(a, k)`).
    fn at(&self, k: usize) -> (f64, f64) {
        self.prefix_shares().iter().enumerate().fold((0.0, 0.0), |(d, acc), (a, p)| {
            let m = a.min(k) as f64;
            let steps = p * (a as f64 + 1.0) / (m + 1.0);
            (d + steps, acc + steps * m)
        })
    }

    /// Drafts of `k` tokens per draft counted, over the same output.
    pub fn drafts_at(&self, k: usize) -> f64 {
        self.at(k).0
    }

    /// Accepted draft tokens per draft of `k` tokens.
    pub fn accepted(&self, k: usize) -> f64 {
        let (d, acc) = self.at(k);
        if d > 0.0 { acc / d } else { 0.0 }
    }

    /// The accept length at `k`: `1 + Σ_{i<k} q_i`.
    pub fn accept_length(&self, k: usize) -> f64 {
        1.0 + self.accepted(k)
    }

    /// The 95 % interval of [`accept_length`](Self::accept_length).
    pub fn accept_length_interval(&self, k: usize) -> Option<Interval> {
        if self.drafts == 0 {
            return None;
        }
        let (d, acc) = self.at(k);
        let r = acc / d;
        // The ratio's variance: that of `y·(min(a, k) − r)` per draft, over `N·d²`.
        let spread: f64 = self
            .prefix_shares()
            .iter()
            .enumerate()
            .map(|(a, p)| {
                let m = a.min(k) as f64;
                p * ((a as f64 + 1.0) / (m + 1.0) * (m - r)).powi(2)
            })
            .sum();
        let half = Z * (spread / (self.drafts as f64 * d * d)).sqrt();
        let top = k.min(self.per_pos.len()) as f64;
        Some(Interval { low: 1.0 + (r - half).max(0.0), high: 1.0 + (r + half).min(top) })
    }

    /// The Wilson interval of each position's rate.
    pub fn position_intervals(&self) -> Vec<Option<Interval>> {
        self.per_pos.iter().map(|&a| wilson(a, self.drafts)).collect()
    }

    /// The counts have the engines' prefix semantics: non-increasing, none above the drafts.
    pub fn consistent(&self) -> bool {
        self.per_pos.windows(2).all(|w| w[0] >= w[1]) && self.per_pos.first().is_none_or(|&a| a <= self.drafts)
    }
}

/// The decode steps of the requests (each request's steps counted once, so a step that decoded
/// a batch of `b` requests counts `b` times) and their time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Decode {
    pub steps: u64,
    /// Seconds the steps took, summed over the requests.
    pub seconds: f64,
    /// Tokens those steps produced (each request's first token, from its prefill, left out).
    pub tokens: u64,
}

impl Decode {
    pub fn step_s(&self) -> Option<f64> {
        (self.steps > 0 && self.seconds > 0.0).then(|| self.seconds / self.steps as f64)
    }

    pub fn tokens_per_step(&self) -> Option<f64> {
        (self.steps > 0).then(|| self.tokens as f64 / self.steps as f64)
    }
}

/// The load the instance served since it started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Load {
    /// Requests in flight per decode step, on average (the batch the steps ran at).
    pub concurrency: Option<f64>,
    /// Requests finished per second since the instance started.
    pub request_rate: Option<f64>,
    pub requests: Option<u64>,
    /// Seconds since the instance started.
    pub uptime_s: Option<f64>,
}

/// What the engine of the running instance counted since it started.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Observed {
    /// The draft length it runs (`speculative.num_steps`, or the engine's default).
    pub running_k: u32,
    pub acceptance: Option<Acceptance>,
    /// Why its acceptance by position does not tell another draft length's (the engine does not
    /// count by position, or counts positions that are not `num_steps`'s).
    pub by_position_unusable: Option<String>,
    /// The engine's own mean accept length at the running length, when it gives one.
    pub accept_length: Option<f64>,
    pub decode: Option<Decode>,
    pub load: Load,
    /// What the reading of the engine's counts assumed, in words.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

/// What a step costs: the target's pass `t` and, per draft position, `ρ·t`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepCost {
    pub target_s: f64,
    pub per_draft_s: f64,
    /// Where `ρ` came from.
    pub source: CostSource,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum CostSource {
    /// Fitted to step times measured at these draft lengths: `(k, seconds per step)`.
    Calibrated { points: Vec<(u32, f64)> },
    /// No calibration: [`ASSUMED_DRAFT_COST`] per position on the share of steps that draft.
    Assumed { per_position: f64 },
}

impl StepCost {
    /// The cost that gives `s0` at `k0` with a draft position costing `ratio` of a target pass.
    pub fn scaled(s0: f64, k0: u32, ratio: f64, source: CostSource) -> StepCost {
        let target_s = s0 / (1.0 + ratio * f64::from(k0));
        StepCost { target_s, per_draft_s: ratio * target_s, source }
    }

    pub fn at(&self, k: u32) -> f64 {
        self.target_s + self.per_draft_s * f64::from(k)
    }

    pub fn ratio(&self) -> f64 {
        self.per_draft_s / self.target_s
    }
}

/// The ratio `ρ` of a draft position's cost to a target pass, fitted (least squares) to step
/// times at two draft lengths or more. `None` when the points do not tell (one length, a
/// target pass that would cost nothing or less, or a draft position that would cost less than
/// nothing: a longer draft stepping faster is noise).
pub fn fit_ratio(points: &[(u32, f64)]) -> Option<f64> {
    let n = points.len() as f64;
    let mx = points.iter().map(|p| f64::from(p.0)).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (f64::from(p.0) - mx).powi(2)).sum();
    if points.len() < 2 || sxx == 0.0 {
        return None;
    }
    let slope = points.iter().map(|p| (f64::from(p.0) - mx) * (p.1 - my)).sum::<f64>() / sxx;
    let target = my - slope * mx;
    (target > 0.0 && slope >= 0.0).then(|| slope / target)
}

/// What the recommendation maximizes (a sweep file's objective; per request by default).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Goal {
    /// Output tokens per second over the requests in flight.
    Throughput,
    /// Decode tokens per second of one request.
    #[default]
    TokensPerSPerRequest,
    AcceptLength,
}

/// One draft length, predicted (or why not).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Row {
    pub k: u32,
    /// The length the instance runs (its figures are the measured ones).
    pub running: bool,
    pub accept_length: Option<f64>,
    pub accept_length_interval: Option<Interval>,
    pub tokens_per_step: Option<f64>,
    pub step_ms: Option<f64>,
    pub tok_s_per_request: Option<f64>,
    pub tok_s_per_request_interval: Option<Interval>,
    /// At the concurrency served.
    pub throughput: Option<f64>,
    /// Why this length is not predicted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_predicted: Option<String>,
}

impl Row {
    pub fn value(&self, goal: Goal) -> Option<f64> {
        match goal {
            Goal::Throughput => self.throughput.or(self.tok_s_per_request),
            Goal::TokensPerSPerRequest => self.tok_s_per_request,
            Goal::AcceptLength => self.accept_length,
        }
    }
}

/// The answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Verdict {
    /// Not enough evidence yet, or none that tells the settings apart: why.
    CannotTell { why: String },
    /// The running length is the best predicted (or none beats it by [`MIN_GAIN`]).
    Keep { k: u32 },
    /// Another length is predicted to do better by `gain` (a fraction).
    Change { from: u32, to: u32, gain: f64 },
}

/// Every row and the verdict.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    pub goal: Goal,
    pub rows: Vec<Row>,
    pub cost: Option<StepCost>,
    pub drafts: u64,
    pub min_drafts: u64,
    pub verdict: Verdict,
}

/// The prediction for draft lengths 1 to the running one (and one more, said not predicted),
/// the step cost's ratio calibrated (`ratio`) or assumed.
pub fn predict(o: &Observed, ratio: Option<(f64, Vec<(u32, f64)>)>, goal: Goal, min_drafts: u64) -> Prediction {
    let k0 = o.running_k;
    let drafts = o.acceptance.as_ref().map_or(0, |a| a.drafts);
    let cost = cost(o, ratio);
    let rows: Vec<Row> = (1..=k0 + 1).map(|k| row(o, cost.as_ref(), k)).collect();
    let verdict = verdict(o, &rows, goal, drafts, min_drafts);
    Prediction { goal, rows, cost, drafts, min_drafts, verdict }
}

/// The step cost: the measured step at the running length, split by the calibrated ratio, or
/// by the assumed one (on the share of steps that draft).
fn cost(o: &Observed, ratio: Option<(f64, Vec<(u32, f64)>)>) -> Option<StepCost> {
    let d = o.decode?;
    let s0 = d.step_s()?;
    Some(match ratio {
        Some((r, points)) => StepCost::scaled(s0, o.running_k, r, CostSource::Calibrated { points }),
        None => {
            let drafting = o.acceptance.as_ref().map_or(1.0, |a| (a.drafts as f64 / d.steps as f64).min(1.0));
            let per_position = ASSUMED_DRAFT_COST * drafting;
            StepCost::scaled(s0, o.running_k, per_position, CostSource::Assumed { per_position })
        }
    })
}

/// One draft length's figures: the running one's as measured, a shorter one's from the
/// acceptance by position, a longer one's not at all.
fn row(o: &Observed, cost: Option<&StepCost>, k: u32) -> Row {
    let k0 = o.running_k;
    let mut r = Row { k, running: k == k0, ..Row::default() };
    if k > k0 {
        r.not_predicted = Some(format!(
            "nothing is known past the running {k0} draft positions: a longer draft is measured (a sweep), not predicted"
        ));
        return r;
    }
    let by_position = o.acceptance.as_ref().filter(|_| o.by_position_unusable.is_none());
    let kk = k as usize;
    if k == k0 {
        r.accept_length = o.accept_length.or(by_position.map(|a| a.accept_length(kk)));
    } else if let Some(a) = by_position {
        r.accept_length = Some(a.accept_length(kk));
    } else {
        r.not_predicted = Some(o.by_position_unusable.clone().unwrap_or_else(|| {
            "the engine reports no acceptance by draft position: only the running length is known".into()
        }));
        return r;
    }
    r.accept_length_interval = by_position.and_then(|a| a.accept_length_interval(kk));
    fill_speed(&mut r, o, cost, by_position);
    r
}

/// Tokens per step, step time, decode speed and throughput at `r.k`.
fn fill_speed(r: &mut Row, o: &Observed, cost: Option<&StepCost>, a: Option<&Acceptance>) {
    let (Some(d), Some(cost)) = (o.decode, cost) else { return };
    let Some(per_step0) = d.tokens_per_step() else { return };
    // The same tokens in the steps of drafts of `k` and those that drafted nothing.
    let k = r.k as usize;
    let (drafts, steps) = match a {
        Some(a) => {
            let drafts = a.drafts as f64 * a.drafts_at(k);
            (drafts, (d.steps as f64 - a.drafts as f64).max(0.0) + drafts)
        }
        None => (0.0, d.steps as f64),
    };
    let per_step = if a.is_some() && steps > 0.0 && !r.running { d.tokens as f64 / steps } else { per_step0 };
    let step = cost.at(r.k);
    r.tokens_per_step = Some(per_step);
    r.step_ms = Some(step * 1000.0);
    r.tok_s_per_request = Some(per_step / step);
    if let (Some(_), Some(i)) = (a, r.accept_length_interval) {
        // The accept length's interval, on the steps that draft.
        let drafting = drafts / steps;
        let l = r.accept_length.unwrap_or(1.0);
        let at = |x: f64| (per_step + drafting * (x - l)) / step;
        r.tok_s_per_request_interval = Some(Interval { low: at(i.low), high: at(i.high) });
    }
    r.throughput = o.load.concurrency.map(|c| c * per_step / step);
}

/// Whether the evidence tells, and what it says.
fn verdict(o: &Observed, rows: &[Row], goal: Goal, drafts: u64, min_drafts: u64) -> Verdict {
    let k0 = o.running_k;
    if drafts < min_drafts {
        return Verdict::CannotTell {
            why: format!(
                "only {drafts} drafts since the instance started; tune needs at least {min_drafts} to tell (serve more load, or lower --min-drafts)"
            ),
        };
    }
    if let Some(a) = &o.acceptance
        && !a.consistent()
    {
        return Verdict::CannotTell {
            why: format!(
                "the engine's counts by position {:?} over {} drafts are not a prefix count (non-increasing)",
                a.per_pos, a.drafts
            ),
        };
    }
    let Some(running) = rows.iter().find(|r| r.running).and_then(|r| r.value(goal)) else {
        return Verdict::CannotTell { why: format!("the engine gives no {} at the running length", goal_words(goal)) };
    };
    let others: Vec<(u32, f64)> =
        rows.iter().filter(|r| !r.running).filter_map(|r| r.value(goal).map(|v| (r.k, v))).collect();
    if others.is_empty() {
        let why = rows.iter().find_map(|r| r.not_predicted.clone()).unwrap_or_default();
        return Verdict::CannotTell { why: format!("no other draft length can be predicted: {why}") };
    }
    let best = others.iter().copied().fold((k0, running), |b, (k, v)| if v > b.1 { (k, v) } else { b });
    let gain = best.1 / running - 1.0;
    if best.0 != k0 && gain >= MIN_GAIN {
        Verdict::Change { from: k0, to: best.0, gain }
    } else {
        Verdict::Keep { k: k0 }
    }
}

pub fn goal_words(goal: Goal) -> &'static str {
    match goal {
        Goal::Throughput => "throughput",
        Goal::TokensPerSPerRequest => "decode speed per request",
        Goal::AcceptLength => "accept length",
    }
}

/// A prediction against a measurement of the same draft length.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Compared {
    pub k: u32,
    pub predicted_accept_length: Option<f64>,
    pub measured_accept_length: Option<f64>,
    pub predicted_tok_s: Option<f64>,
    pub measured_tok_s: Option<f64>,
    /// (predicted − measured) / measured.
    pub accept_length_error: Option<f64>,
    pub tok_s_error: Option<f64>,
}

/// Each measured length `(k, accept length, decode tok/s per request)` beside its prediction.
pub fn compare(rows: &[Row], measured: &[(u32, Option<f64>, Option<f64>)]) -> Vec<Compared> {
    let err = |p: Option<f64>, m: Option<f64>| match (p, m) {
        (Some(p), Some(m)) if m != 0.0 => Some(p / m - 1.0),
        _ => None,
    };
    measured
        .iter()
        .map(|&(k, ml, mt)| {
            let r = rows.iter().find(|r| r.k == k);
            let (pl, pt) = (r.and_then(|r| r.accept_length), r.and_then(|r| r.tok_s_per_request));
            Compared {
                k,
                predicted_accept_length: pl,
                measured_accept_length: ml,
                predicted_tok_s: pt,
                measured_tok_s: mt,
                accept_length_error: err(pl, ml),
                tok_s_error: err(pt, mt),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acc(drafts: u64, per_pos: &[u64]) -> Acceptance {
        Acceptance { drafts, per_pos: per_pos.to_vec() }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn the_accept_length_at_k_sums_the_first_k_positions() {
        // (drafts, per position, k, accept length)
        let table: &[(u64, &[u64], usize, f64)] = &[
            (100, &[80, 60, 40, 20], 4, 3.0),
            // A fifth of the drafts accepted each prefix 0..=4. Those that accepted all 4
            // covered 5 tokens each: drafts of 3 cover them in 5/4 steps of 3 accepted, so
            // 1.95 accepted over 1.05 drafts per draft counted.
            (100, &[80, 60, 40, 20], 3, 1.0 + 1.95 / 1.05),
            // Drafts of 1: 1.4 accepted over 1.6 drafts.
            (100, &[80, 60, 40, 20], 1, 1.875),
            (100, &[80, 60, 40, 20], 0, 1.0),
            // Past the positions counted: nothing more is known.
            (100, &[80, 60], 4, 2.4),
            // vLLM's recorded sample: 3 drafts of 4, every token accepted.
            (3, &[3, 3, 3, 3], 4, 5.0),
            (0, &[], 3, 1.0),
        ];
        for &(n, per_pos, k, want) in table {
            assert!(close(acc(n, per_pos).accept_length(k), want), "{per_pos:?} at {k}");
        }
    }

    #[test]
    fn intervals_narrow_with_more_drafts_and_hold_the_estimate() {
        let few = acc(50, &[40, 30, 20]);
        let many = acc(5000, &[4000, 3000, 2000]);
        for k in 1..=3 {
            let (f, m) = (few.accept_length_interval(k).unwrap(), many.accept_length_interval(k).unwrap());
            let l = many.accept_length(k);
            assert!(f.low < m.low && m.high < f.high, "k={k}: {f:?} {m:?}");
            assert!(m.low < l && l < m.high && close(few.accept_length(k), l));
        }
        // Every draft accepted: no spread.
        let all = acc(10, &[10, 10]).accept_length_interval(2).unwrap();
        assert!(close(all.low, 3.0) && close(all.high, 3.0));
        // Wilson: known values (x = 8 of 10: 0.490 to 0.943), none without trials.
        let w = wilson(8, 10).unwrap();
        assert!((w.low - 0.4902).abs() < 1e-3 && (w.high - 0.9433).abs() < 1e-3, "{w:?}");
        assert_eq!(wilson(0, 0), None);
        assert_eq!(wilson(0, 20).unwrap().low, 0.0);
    }

    #[test]
    fn the_step_cost_ratio_is_fitted_to_two_lengths_or_more() {
        // (points, ratio)
        type Case = (&'static [(u32, f64)], Option<f64>);
        let table: &[Case] = &[
            // t = 0.01, 0.002 a position: ρ = 0.2.
            (&[(4, 0.018), (3, 0.016)], Some(0.2)),
            (&[(1, 0.012), (2, 0.014), (3, 0.016), (4, 0.018)], Some(0.2)),
            (&[(4, 0.018)], None),
            (&[(4, 0.018), (4, 0.019)], None),
            // A fit that gives the target pass no cost tells nothing.
            (&[(1, 0.01), (2, 0.03)], None),
            // Nor one where a longer draft steps faster: noise (the real vLLM on two busy
            // cores, 40.29 ms at 5 and 33.41 ms at 6).
            (&[(5, 0.04029), (6, 0.03341)], None),
        ];
        for (points, want) in table {
            match (fit_ratio(points), want) {
                (Some(r), Some(w)) => assert!((r - w).abs() < 1e-9, "{points:?}: {r}"),
                (got, want) => assert_eq!(got, *want, "{points:?}"),
            }
        }
        let c = StepCost::scaled(0.018, 4, 0.2, CostSource::Assumed { per_position: 0.2 });
        assert!(close(c.target_s, 0.01) && close(c.at(2), 0.014) && close(c.ratio(), 0.2));
    }

    /// A running instance at k = 4 whose every step drafted: 1000 drafts, 4000 steps' worth.
    fn observed(per_pos: &[u64], steps: u64, step_s: f64) -> Observed {
        let a = acc(1000, per_pos);
        let tokens = steps + per_pos.iter().sum::<u64>();
        Observed {
            running_k: 4,
            accept_length: Some(a.accept_length(4)),
            acceptance: Some(a),
            by_position_unusable: None,
            decode: Some(Decode { steps, seconds: steps as f64 * step_s, tokens }),
            load: Load { concurrency: Some(2.0), ..Load::default() },
            notes: vec![],
        }
    }

    #[test]
    fn each_length_up_to_the_running_one_is_predicted_and_a_longer_one_is_not() {
        let o = observed(&[900, 700, 400, 100], 1000, 0.014);
        let p = predict(&o, Some((0.1, vec![])), Goal::TokensPerSPerRequest, MIN_DRAFTS);
        assert_eq!(p.rows.len(), 5);
        // Every step drafts, so a step gives the accept length. Prefixes 0..=4 in shares
        // .1, .2, .3, .3, .1: at k = 2, drafts that accepted 3 take 4/3 steps of 2, those that
        // accepted 4 take 5/3 (1.9333 accepted over 1.16667 drafts per draft counted).
        // (k, accept length, tokens per step, step ms)
        let l1 = 1.0 + 1.5 / 1.6;
        let l2 = 1.0 + (0.2 + 0.6 + 0.8 + 1.0 / 3.0) / (0.6 + 0.4 + 1.0 / 6.0);
        let l3 = 1.0 + (0.2 + 0.6 + 0.9 + 0.375) / 1.025;
        let want = [(1, l1, l1, 11.0), (2, l2, l2, 12.0), (3, l3, l3, 13.0), (4, 3.1, 3.1, 14.0)];
        for (r, (k, l, t, ms)) in p.rows.iter().zip(want) {
            assert_eq!(r.k, k);
            assert!((r.accept_length.unwrap() - l).abs() < 1e-9, "{r:?} {l}");
            assert!((r.tokens_per_step.unwrap() - t).abs() < 1e-9, "{r:?} {t}");
            assert!((r.step_ms.unwrap() - ms).abs() < 1e-9, "{r:?}");
            assert!(close(r.tok_s_per_request.unwrap(), t / ms * 1000.0), "{r:?}");
            assert!(close(r.throughput.unwrap(), 2.0 * r.tok_s_per_request.unwrap()));
            let i = r.tok_s_per_request_interval.unwrap();
            assert!(i.low <= r.tok_s_per_request.unwrap() && r.tok_s_per_request.unwrap() <= i.high);
        }
        assert!(p.rows[3].running && !p.rows[2].running);
        assert!(p.rows[4].not_predicted.as_deref().unwrap().contains("past the running 4 draft positions"));
        // 3.02 tokens in 13 ms beat 3.1 in 14 ms (232.6 against 221.4 tok/s).
        let Verdict::Change { from: 4, to: 3, gain } = p.verdict else { panic!("{:?}", p.verdict) };
        assert!((gain - (l3 / 13.0) / (3.1 / 14.0) + 1.0).abs() < 1e-9);
        // By accept length, the longest draft is best.
        assert_eq!(predict(&o, Some((0.1, vec![])), Goal::AcceptLength, MIN_DRAFTS).verdict, Verdict::Keep { k: 4 });
    }

    #[test]
    fn steps_that_draft_nothing_dilute_what_a_shorter_draft_loses() {
        // An n-gram that matched on a quarter of 4000 steps.
        let o = observed(&[800, 600, 400, 200], 4000, 0.01);
        let p = predict(&o, Some((0.0, vec![])), Goal::TokensPerSPerRequest, MIN_DRAFTS);
        // 6000 tokens in 4000 steps at k = 4; at k = 2 the 1000 drafts' stretches take 1200
        // steps (those that accepted 3 or 4 take 4/3 and 5/3), the 3000 others stay.
        assert!(close(p.rows[3].tokens_per_step.unwrap(), 1.5));
        assert!(close(p.rows[1].tokens_per_step.unwrap(), 6000.0 / 4200.0));
        // Without a calibration, a position costs 5 % of a target pass on the quarter that drafts.
        let p = predict(&o, None, Goal::TokensPerSPerRequest, MIN_DRAFTS);
        let c = p.cost.unwrap();
        assert_eq!(c.source, CostSource::Assumed { per_position: 0.0125 });
        assert!(close(c.at(4), 0.01));
    }

    #[test]
    fn too_few_drafts_or_nothing_to_compare_cannot_tell() {
        let mut o = observed(&[90, 70, 40, 10], 100, 0.014);
        o.acceptance.as_mut().unwrap().drafts = 100;
        let p = predict(&o, None, Goal::TokensPerSPerRequest, MIN_DRAFTS);
        let Verdict::CannotTell { why } = &p.verdict else { panic!("{:?}", p.verdict) };
        assert!(why.contains("only 100 drafts") && why.contains("at least 200"), "{why}");
        assert!(!matches!(predict(&o, None, Goal::TokensPerSPerRequest, 100).verdict, Verdict::CannotTell { .. }));
        // Counts by position that are not a prefix count.
        let bad = observed(&[500, 700, 400, 100], 1000, 0.014);
        let Verdict::CannotTell { why } = predict(&bad, None, Goal::AcceptLength, MIN_DRAFTS).verdict else { panic!() };
        assert!(why.contains("not a prefix count"), "{why}");
        // SGLang: a mean accept length, nothing by position.
        let sglang = Observed {
            running_k: 3,
            accept_length: Some(2.7),
            acceptance: Some(acc(500, &[])),
            by_position_unusable: Some("SGLang reports its mean accept length only".into()),
            decode: Some(Decode { steps: 500, seconds: 5.0, tokens: 1350 }),
            load: Load::default(),
            notes: vec![],
        };
        let p = predict(&sglang, None, Goal::TokensPerSPerRequest, MIN_DRAFTS);
        assert_eq!(p.rows[2].accept_length, Some(2.7));
        assert!(close(p.rows[2].tok_s_per_request.unwrap(), 270.0));
        assert_eq!(p.rows[0].not_predicted.as_deref(), Some("SGLang reports its mean accept length only"));
        let Verdict::CannotTell { why } = p.verdict else { panic!() };
        assert!(why.contains("no other draft length can be predicted: SGLang"), "{why}");
        // No step time: nothing about speed; accept length still tells.
        let mut no_time = observed(&[900, 700, 400, 100], 1000, 0.014);
        no_time.decode = None;
        let p = predict(&no_time, None, Goal::TokensPerSPerRequest, MIN_DRAFTS);
        assert!(matches!(&p.verdict, Verdict::CannotTell { why } if why.contains("no decode speed")));
        assert_eq!(predict(&no_time, None, Goal::AcceptLength, MIN_DRAFTS).verdict, Verdict::Keep { k: 4 });
    }

    /// The real vLLM 0.32 (CPU, SmolLM2-135M, n-gram, k = 6) after 26 requests of the
    /// built-in prompts, greedy: its counts (from the shares `specd tune` printed, to three
    /// places), and the accept length a sweep of each length then measured under the same load. Cutting each draft at `k` predicted 1.37 and 1.61
    /// at k = 1 and 2 (−10.2 %, −11.0 %).
    #[test]
    fn the_real_vllm_n_gram_counts_predict_what_a_sweep_measured() {
        let a = acc(1042, &[386, 246, 188, 162, 145, 135]);
        let measured = [1.53, 1.80, 1.96, 2.03, 2.10, 2.13];
        for (k, m) in (1..=6).zip(measured) {
            let l = a.accept_length(k);
            assert!((l / m - 1.0).abs() < 0.04, "k = {k}: predicted {l:.3}, measured {m}");
            let i = a.accept_length_interval(k).unwrap();
            assert!(i.low < l && l < i.high && i.high - i.low < 0.3, "k = {k}: {i:?}");
        }
    }

    #[test]
    fn a_change_must_gain_enough() {
        // k = 3 and 4 within 1 %: keep.
        let o = observed(&[900, 700, 400, 300], 1000, 0.014);
        let p = predict(&o, Some((0.1, vec![])), Goal::TokensPerSPerRequest, MIN_DRAFTS);
        let (t3, t4) = (p.rows[2].tok_s_per_request.unwrap(), p.rows[3].tok_s_per_request.unwrap());
        assert!(t3 > t4 && t3 / t4 - 1.0 < MIN_GAIN, "{t3} {t4}");
        assert_eq!(p.verdict, Verdict::Keep { k: 4 });
    }

    #[test]
    fn predictions_are_compared_with_what_a_sweep_measured() {
        let o = observed(&[900, 700, 400, 100], 1000, 0.014);
        let p = predict(&o, Some((0.1, vec![])), Goal::TokensPerSPerRequest, MIN_DRAFTS);
        let c = compare(&p.rows, &[(2, Some(2.5), Some(200.0)), (6, Some(4.0), None)]);
        let l2 = p.rows[1].accept_length.unwrap();
        assert!((c[0].accept_length_error.unwrap() - (l2 / 2.5 - 1.0)).abs() < 1e-9);
        assert!((c[0].tok_s_error.unwrap() - (l2 / 0.012 / 200.0 - 1.0)).abs() < 1e-9);
        assert_eq!((c[1].predicted_accept_length, c[1].accept_length_error), (None, None));
    }
}
