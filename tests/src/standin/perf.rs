//! The stand-in's performance model: how fast a request decodes given the speculative settings
//! and the load, how long its first token takes, and the speculation evidence that goes with it.
//!
//! Speculative decoding drafts `k` tokens, then one forward pass of the target model verifies
//! them: the accepted prefix plus one token of the target's own come out together (a burst).
//! Position `i` of the draft (1-based) is accepted only if every position before it was, with
//! probability `p_i` (the `accept_curve`; `accept_rate` `p` at every position unless given), so
//! a draft is accepted through position `i` with probability `q_i = p_1·…·p_i`, and the
//! expected tokens per verify step are
//!
//! ```text
//! E(k) = 1 + q_1 + … + q_k          (the "accept length"; (1 - p^(k+1)) / (1 - p) for one p)
//! ```
//!
//! the relation `specd tune` predicts by: a shorter draft is the longer one cut, so the share
//! of drafts accepted through each position, counted at `k`, gives `E(k')` for every `k' ≤ k`.
//! Each step's accepted prefix is drawn from the curve by a low-discrepancy sequence over the
//! server's steps (the same counts run after run): the count through position `i` over `N`
//! steps is `N·q_i` within one or two.
//!
//! Drafting costs `c` (`draft_cost`) of a target forward pass per draft token, and each other
//! running request slows every step by `b` (`batch_slowdown`), so one request decodes at
//!
//! ```text
//! rate = base × E(k) / (1 + c·k) / (1 + b·(running - 1))          tokens per second
//! ```
//!
//! where `base` is the target model's own rate with speculation off (`base_tokens_per_sec`).
//! With the defaults (p = 0.85, c = 0.07) more steps first help, then plateau and hurt: at
//! base 85 tokens/s, steps 1..6, 8, 10 give 147, 192, 224, 246, 261, 271, 279, 278 tokens/s and
//! the accept length at 10 steps is 5.55 (the seed campaign: 123, 186, 234, 277, 282; 5.50).
//! The first token also waits for the prefill: prompt tokens / `prefill_tokens_per_sec`.

use serde_json::Value;
use std::time::Duration;

use super::args::{Flavour, Knobs, Launch};

/// The model of one server, from its args and the stand-in's knobs.
#[derive(Clone, Debug, PartialEq)]
pub struct Perf {
    /// Draft positions per verify step (0: no speculation).
    pub k: u32,
    /// The configured draft size the memory limit applies to: SGLang's
    /// `speculative_num_draft_tokens` (the verify batch), vLLM's `num_speculative_tokens`,
    /// llama.cpp's `--spec-draft-n-max`.
    pub draft_size: u32,
    /// Expected tokens per verify step, `E(k)` (or the `accept-length` knob, within 1..=k+1).
    pub accept_length: f64,
    /// `q_1..q_k`: the share of drafts accepted through each position.
    pub through: Vec<f64>,
    /// The `accept-length` knob is set: bursts spread it evenly instead of following the curve.
    even: bool,
    /// The timed model is on (`base-tokens-per-sec` given); otherwise each token takes
    /// 1 / `tokens-per-sec` as before.
    pub timed: bool,
    base: f64,
    draft_cost: f64,
    batch_slowdown: f64,
    prefill: f64,
    legacy_rate: f64,
}

/// `E(k)` for a per-position acceptance probability `p`.
pub fn expected_accept_length(p: f64, k: u32) -> f64 {
    if p >= 1.0 {
        return f64::from(k) + 1.0;
    }
    (1.0 - p.powi(k as i32 + 1)) / (1.0 - p)
}

/// `q_1..q_k` of a curve of conditional rates (the last one repeated), or of `p` everywhere.
pub fn through(curve: Option<&[f64]>, p: f64, k: u32) -> Vec<f64> {
    let mut q = 1.0;
    (0..k as usize)
        .map(|i| {
            q *= curve.map_or(p, |c| c.get(i).or(c.last()).copied().unwrap_or(p));
            q
        })
        .collect()
}

fn int(v: Option<&Value>) -> Option<u32> {
    v.and_then(Value::as_u64).and_then(|n| u32::try_from(n).ok())
}

impl Perf {
    /// The model of a server that speculates (`spec_on`) or not.
    pub fn of(l: &Launch, spec_on: bool) -> Perf {
        let a = &l.args;
        let (k, draft_size) = if !spec_on {
            (0, 0)
        } else {
            match l.flavour {
                Flavour::Sglang => {
                    let steps = int(a.get("speculative_num_steps")).unwrap_or(1);
                    (steps, int(a.get("speculative_num_draft_tokens")).unwrap_or(steps + 1))
                }
                Flavour::Vllm => {
                    let n = int(a.get("speculative_config").and_then(|c| c.get("num_speculative_tokens"))).unwrap_or(1);
                    (n, n)
                }
                Flavour::LlamaCpp => {
                    let n = int(a.get("spec_draft_n_max")).unwrap_or(3);
                    (n, n)
                }
            }
        };
        Perf::new(&l.knobs, k, draft_size)
    }

    pub fn new(kn: &Knobs, k: u32, draft_size: u32) -> Perf {
        let through = through(kn.accept_curve.as_deref(), kn.accept_rate, k);
        let e = 1.0 + through.iter().sum::<f64>();
        let accept_length = match kn.accept_length {
            Some(x) if k > 0 => x.clamp(1.0, f64::from(k) + 1.0),
            _ => e,
        };
        Perf {
            k,
            draft_size,
            accept_length,
            through,
            even: kn.accept_length.is_some(),
            timed: kn.base_tokens_per_sec.is_some(),
            base: kn.base_tokens_per_sec.unwrap_or(kn.tokens_per_sec),
            draft_cost: kn.draft_cost,
            batch_slowdown: kn.batch_slowdown,
            prefill: kn.prefill_tokens_per_sec,
            legacy_rate: kn.tokens_per_sec,
        }
    }

    /// The configured draft does not fit the memory limit (`max-draft-tokens`).
    pub fn out_of_memory(&self, kn: &Knobs) -> bool {
        kn.max_draft_tokens.is_some_and(|max| self.draft_size > max)
    }

    /// Tokens of the server's `j`-th verify step (0-based), before the request's end cuts it:
    /// 1 + the accepted prefix, drawn from the curve (`u_j`, the fractional part of `(j+1)·φ⁻¹`,
    /// falls below `q_i` for a prefix of positions); with the `accept-length` knob, that length
    /// spread evenly (`⌊E(j+1)⌋ - ⌊Ej⌋`). Either way a run of steps averages the accept length.
    pub fn burst(&self, j: u64) -> u64 {
        if self.k == 0 {
            return 1;
        }
        if self.even {
            let e = self.accept_length;
            let b = ((j + 1) as f64 * e).floor() - (j as f64 * e).floor();
            return (b as u64).clamp(1, u64::from(self.k) + 1);
        }
        let u = ((j + 1) as f64 * 0.618_033_988_749_894_9).fract();
        1 + self.through.iter().take_while(|q| u < **q).count() as u64
    }

    /// How long one verify step takes with `running` requests in the batch.
    pub fn step_time(&self, running: usize) -> Duration {
        let batch = 1.0 + self.batch_slowdown * (running.max(1) - 1) as f64;
        Duration::from_secs_f64((1.0 + self.draft_cost * f64::from(self.k)) / self.base * batch)
    }

    /// The legacy pacing: each token 1 / `tokens-per-sec`.
    pub fn token_time(&self) -> Duration {
        Duration::from_secs_f64(1.0 / self.legacy_rate)
    }

    /// The prefill of a prompt, before the first token.
    pub fn prefill_time(&self, prompt_tokens: u64) -> Duration {
        if !self.timed {
            return Duration::ZERO;
        }
        Duration::from_secs_f64(prompt_tokens as f64 / self.prefill)
    }

    /// The model's decode rate of one request, in tokens per second, with `running` requests.
    pub fn tokens_per_sec(&self, running: usize) -> f64 {
        if !self.timed {
            return self.legacy_rate;
        }
        self.accept_length / self.step_time(running).as_secs_f64()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn knobs(base: f64) -> Knobs {
        Knobs { base_tokens_per_sec: Some(base), ..Knobs::default() }
    }

    #[test]
    fn more_steps_help_then_plateau_then_hurt() {
        let k = knobs(85.0);
        let rate = |steps: u32| Perf::new(&k, steps, steps + 1).tokens_per_sec(1).round();
        let rates: Vec<f64> = [1, 2, 3, 4, 5, 6, 8, 10].into_iter().map(rate).collect();
        assert_eq!(rates, [147.0, 192.0, 224.0, 246.0, 261.0, 271.0, 279.0, 278.0]);
        assert!(rate(16) < rate(8), "long drafts cost more than they bring");
        assert!((Perf::new(&k, 10, 11).accept_length - 5.55).abs() < 0.01);
        assert!((Perf::new(&k, 0, 0).tokens_per_sec(1) - 85.0).abs() < 1e-3, "no speculation: the base rate");
    }

    #[test]
    fn bursts_average_the_accept_length_and_fit_the_draft() {
        let p = Perf::new(&knobs(100.0), 4, 5);
        let n = 1000;
        let total: u64 = (0..n).map(|j| p.burst(j)).sum();
        assert!((total as f64 / n as f64 - p.accept_length).abs() < 0.01);
        assert!((0..n).all(|j| (1..=5).contains(&p.burst(j))));
        let off = Perf::new(&knobs(100.0), 0, 0);
        assert_eq!(off.burst(7), 1);
    }

    /// The relation `specd tune` predicts by, on the model: the share of steps accepted through
    /// each position, counted at k = 6, gives the accept length a server at each k ≤ 6 has.
    #[test]
    fn acceptance_counted_at_k_gives_the_accept_length_of_every_shorter_draft() {
        for curve in [None, Some(vec![0.95, 0.8, 0.7, 0.5])] {
            let kn = Knobs { accept_curve: curve.clone(), ..knobs(100.0) };
            let n = 5000;
            let at6 = Perf::new(&kn, 6, 6);
            let mut per_pos = [0u64; 6];
            for j in 0..n {
                for c in per_pos.iter_mut().take(at6.burst(j) as usize - 1) {
                    *c += 1;
                }
            }
            assert!(per_pos.windows(2).all(|w| w[0] >= w[1]), "{per_pos:?}");
            for k in 1..=6 {
                let predicted = 1.0 + per_pos[..k].iter().map(|a| *a as f64 / n as f64).sum::<f64>();
                let p = Perf::new(&kn, k as u32, k as u32);
                let measured = (0..n).map(|j| p.burst(j)).sum::<u64>() as f64 / n as f64;
                assert!((predicted - measured).abs() < 0.005, "{curve:?} k={k}: {predicted} {measured}");
                assert!((measured - p.accept_length).abs() < 0.005, "{curve:?} k={k}");
            }
        }
    }

    #[test]
    fn concurrency_slows_each_request() {
        let k = Knobs { batch_slowdown: 0.5, ..knobs(100.0) };
        let p = Perf::new(&k, 2, 3);
        assert!((p.tokens_per_sec(1) / p.tokens_per_sec(5) - 3.0).abs() < 1e-9);
    }

    #[test]
    fn the_accept_length_knob_wins_within_what_the_draft_allows() {
        let k = Knobs { accept_length: Some(3.4), ..Knobs::default() };
        assert_eq!(Perf::new(&k, 5, 6).accept_length, 3.4);
        assert_eq!(Perf::new(&k, 1, 2).accept_length, 2.0);
    }
}
