//! What a running engine counted since it started, read from its `/metrics` text (the text in,
//! the counts out), and what they say for `tune`: its drafts and acceptance by position, its
//! decode steps and their time, the load it served. The names are the engine facts table's
//! (`specd_spec::Counters`). Two reads subtract: a sweep's level is the difference of the counts
//! after and before it.

use std::collections::BTreeMap;

use specd_spec::{Counters, Engine, Spec};

use super::tune::{Acceptance, Decode, Load, Observed};

/// One sample of a Prometheus text exposition.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

/// The samples of an exposition (comments and lines that do not parse are skipped).
pub fn samples(text: &str) -> Vec<Sample> {
    text.lines().filter(|l| !l.starts_with('#')).filter_map(sample).collect()
}

fn sample(line: &str) -> Option<Sample> {
    let line = line.trim();
    let name_end = line.find(['{', ' '])?;
    let name = line[..name_end].to_string();
    let mut labels = Vec::new();
    let mut rest = &line[name_end..];
    if let Some(inner) = rest.strip_prefix('{') {
        let mut chars = inner.char_indices();
        let mut key = String::new();
        loop {
            let (i, c) = chars.next()?;
            match c {
                '}' => {
                    rest = &inner[i + 1..];
                    break;
                }
                ',' | ' ' => {}
                '=' => {
                    let (_, '"') = chars.next()? else { return None };
                    let mut value = String::new();
                    loop {
                        match chars.next()?.1 {
                            '\\' => value.push(match chars.next()?.1 {
                                'n' => '\n',
                                c => c,
                            }),
                            '"' => break,
                            c => value.push(c),
                        }
                    }
                    labels.push((std::mem::take(&mut key), value));
                }
                c => key.push(c),
            }
        }
    }
    let value = rest.split_whitespace().next()?.parse::<f64>().ok()?;
    Some(Sample { name, labels, value })
}

/// The counts one read gives (sums over the engine's label sets).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Counts {
    pub engine: Option<Engine>,
    /// The drafts counter exists (the engine speculates and exports it).
    pub has_drafts: bool,
    pub drafts: f64,
    pub accepted: f64,
    /// Per draft position (the `position` label).
    pub per_pos: BTreeMap<usize, f64>,
    /// vLLM: decode steps (request × step) and their seconds; llama-server: none (see
    /// [`Counts::tokens`]).
    pub steps: f64,
    pub seconds: f64,
    /// Tokens generated (llama-server, SGLang).
    pub tokens: f64,
    pub requests: f64,
    /// vLLM: engine steps, prefills included.
    pub engine_steps: f64,
    /// llama-server: busy slots per decode (a gauge, since its start).
    pub busy: Option<f64>,
    /// vLLM: when its process started (Unix seconds).
    pub started: Option<f64>,
}

fn named<'a>(s: &'a [Sample], name: &'a str) -> impl Iterator<Item = &'a Sample> {
    s.iter().filter(move |x| x.name == name)
}

fn sum(s: &[Sample], name: &str) -> f64 {
    named(s, name).map(|x| x.value).sum()
}

fn by_position(s: &[Sample], name: &str) -> BTreeMap<usize, f64> {
    let mut out = BTreeMap::new();
    for x in named(s, name) {
        if let Some(i) = x.labels.iter().find(|(k, _)| k == "position").and_then(|(_, v)| v.parse().ok()) {
            *out.entry(i).or_insert(0.0) += x.value;
        }
    }
    out
}

impl Counts {
    /// The counts of `engine` in its `/metrics` text.
    pub fn read(engine: Engine, text: &str) -> Counts {
        let s = samples(text);
        let mut c = Counts { engine: Some(engine), ..Counts::default() };
        match &specd_spec::engine_facts(engine).counters {
            Counters::Vllm { drafts, accepted, per_position, step_latency, requests, engine_steps, started } => {
                c.has_drafts = named(&s, drafts).next().is_some();
                (c.drafts, c.accepted, c.per_pos) = (sum(&s, drafts), sum(&s, accepted), by_position(&s, per_position));
                c.steps = sum(&s, &format!("{step_latency}_count"));
                c.seconds = sum(&s, &format!("{step_latency}_sum"));
                c.requests = sum(&s, requests);
                c.engine_steps = sum(&s, &format!("{engine_steps}_count"));
                c.started = named(&s, started).next().map(|x| x.value);
            }
            Counters::LlamaCpp { drafts, accepted, per_position, tokens, decode_seconds, busy_slots } => {
                c.has_drafts = named(&s, drafts).next().is_some();
                (c.drafts, c.accepted, c.per_pos) = (sum(&s, drafts), sum(&s, accepted), by_position(&s, per_position));
                (c.tokens, c.seconds) = (sum(&s, tokens), sum(&s, decode_seconds));
                c.busy = named(&s, busy_slots).next().map(|x| x.value).filter(|b| *b > 0.0);
            }
            Counters::Sglang { verify_calls, tokens } => {
                c.has_drafts = named(&s, verify_calls).next().is_some();
                (c.drafts, c.tokens) = (sum(&s, verify_calls), sum(&s, tokens));
            }
        }
        c
    }

    /// What was counted between `before` and `self` (a counter that went down: the engine
    /// restarted, and `self` is all there is). Gauges are `self`'s.
    pub fn since(&self, before: &Counts) -> Counts {
        if self.drafts < before.drafts || self.steps < before.steps || self.tokens < before.tokens {
            return self.clone();
        }
        let mut per_pos = self.per_pos.clone();
        for (i, v) in &before.per_pos {
            *per_pos.entry(*i).or_insert(0.0) -= v;
        }
        Counts {
            engine: self.engine,
            has_drafts: self.has_drafts,
            drafts: self.drafts - before.drafts,
            accepted: self.accepted - before.accepted,
            per_pos,
            steps: self.steps - before.steps,
            seconds: self.seconds - before.seconds,
            tokens: self.tokens - before.tokens,
            requests: self.requests - before.requests,
            engine_steps: self.engine_steps - before.engine_steps,
            busy: self.busy,
            started: self.started,
        }
    }
}

fn whole(x: f64) -> u64 {
    x.max(0.0).round() as u64
}

impl Counts {
    /// The drafts and how far into each the target accepted.
    pub fn acceptance(&self) -> Acceptance {
        let n = self.per_pos.keys().max().map_or(0, |m| m + 1);
        let per_pos = (0..n).map(|i| whole(self.per_pos.get(&i).copied().unwrap_or(0.0))).collect();
        Acceptance { drafts: whole(self.drafts), per_pos }
    }

    /// The decode steps of the requests, their time and tokens: vLLM's, a step per inter-token
    /// latency observed, each giving 1 + its accepted tokens; llama-server's, which counts no
    /// requests, a step per token not accepted from a draft (each request's first token, from
    /// its prefill, counted as a step's). `None` when nothing was decoded (or SGLang: no step
    /// time read).
    pub fn decode(&self) -> Option<Decode> {
        let (steps, tokens) = match self.engine? {
            Engine::Vllm => (whole(self.steps), whole(self.steps) + whole(self.accepted)),
            Engine::LlamaCpp => (whole(self.tokens).saturating_sub(whole(self.accepted)), whole(self.tokens)),
            Engine::Sglang => return None,
        };
        (steps > 0 && self.seconds > 0.0).then_some(Decode { steps, seconds: self.seconds, tokens })
    }
}

/// The draft length a spec runs: its `num_steps`, else the engine's own default where it has
/// one (llama-server's draft types draft 3), else the positions the engine counts (llama-server's
/// n-gram types: their own length).
pub fn running_k(spec: &Spec, c: &Counts) -> u32 {
    let s = spec.speculative.as_ref();
    let ngram = s.and_then(|s| s.algorithm.as_deref()).is_some_and(|a| a.to_ascii_lowercase().starts_with("ngram"));
    let default = (spec.engine == Engine::LlamaCpp && !ngram).then_some(3);
    s.and_then(|s| s.num_steps).or(default).unwrap_or(c.per_pos.len() as u32)
}

/// What the counts say about the running instance of `spec` (`now`: Unix seconds). `Err`: why
/// they say nothing (the engine exports no drafts counter).
pub fn observe(spec: &Spec, c: &Counts, now: f64) -> Result<Observed, String> {
    let facts = specd_spec::engine_facts(spec.engine);
    if !c.has_drafts {
        let name = match &facts.counters {
            Counters::Vllm { drafts, .. } | Counters::LlamaCpp { drafts, .. } => *drafts,
            Counters::Sglang { verify_calls, .. } => *verify_calls,
        };
        return Err(format!(
            "the server's {} has no {name}: it counts no drafts (it does not speculate, or exports no such counter{})",
            facts.metrics_path,
            match spec.engine {
                Engine::Vllm => ": not under --disable-log-stats",
                Engine::LlamaCpp => "",
                Engine::Sglang => ": SGLang needs --enable-metrics",
            }
        ));
    }
    let mut o = Observed {
        running_k: running_k(spec, c),
        acceptance: Some(c.acceptance()),
        accept_length: (c.drafts > 0.0).then(|| 1.0 + c.accepted / c.drafts),
        decode: c.decode(),
        ..Observed::default()
    };
    match spec.engine {
        Engine::Vllm => vllm(&mut o, c, now),
        Engine::LlamaCpp => llama_cpp(&mut o, spec, c),
        Engine::Sglang => sglang(&mut o, c),
    }
    Ok(o)
}

/// vLLM: the load, and whether its positions are the spec's.
fn vllm(o: &mut Observed, c: &Counts, now: f64) {
    let steps = whole(c.steps);
    let requests = whole(c.requests);
    let uptime = c.started.map(|s| now - s).filter(|u| *u > 0.0);
    // Each engine step decodes a batch of the requests in flight; about one per request is its
    // prefill.
    let decode_steps = c.engine_steps - c.requests;
    o.load = Load {
        concurrency: (decode_steps >= 1.0 && steps > 0).then(|| (c.steps / decode_steps).max(1.0)),
        request_rate: uptime.map(|u| c.requests / u),
        requests: Some(requests),
        uptime_s: uptime,
    };
    o.notes.push(
        "the batch a step ran at: requests' decode steps over the engine's steps less one prefill a request".into(),
    );
    if o.acceptance.as_ref().is_some_and(|a| a.per_pos.len() != o.running_k as usize) {
        let n = o.acceptance.as_ref().map_or(0, |a| a.per_pos.len());
        o.by_position_unusable = Some(format!(
            "vLLM counts {n} draft positions, not the spec's num_steps {}: the counts are not this spec's",
            o.running_k
        ));
    }
}

/// llama-server: the load, and whether its positions say anything of `num_steps`.
fn llama_cpp(o: &mut Observed, spec: &Spec, c: &Counts) {
    if o.decode.is_some() {
        o.notes.push(
            "llama-server counts no requests: each request's first token (from its prefill) is counted as a decode step's".into(),
        );
    }
    o.load.concurrency = c.busy;
    let algorithm = spec.speculative.as_ref().and_then(|s| s.algorithm.as_deref()).unwrap_or_default();
    let positions = o.acceptance.as_ref().map_or(0, |a| a.per_pos.len());
    if algorithm.starts_with("ngram") {
        o.by_position_unusable = Some(format!(
            "llama-server's n-gram types draft up to their own length ({positions} positions counted), not speculative.num_steps: another num_steps is not predicted"
        ));
    } else if positions != o.running_k as usize {
        o.by_position_unusable =
            Some(format!("llama-server counts {positions} draft positions, not the spec's num_steps {}", o.running_k));
    }
}

/// SGLang: verify passes and tokens; its accept length is tokens per pass.
fn sglang(o: &mut Observed, c: &Counts) {
    o.accept_length = (c.drafts > 0.0).then(|| c.tokens / c.drafts);
    o.by_position_unusable = Some(
        "SGLang counts verify passes and tokens, nothing by draft position: another num_steps is not predicted".into(),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM_NGRAM: &str = include_str!("../../../tests/fixtures/engines/vllm/real/metrics.ngram.txt");
    const VLLM_PLAIN: &str = include_str!("../../../tests/fixtures/engines/vllm/real/metrics.plain.txt");
    const LLAMA: &str = include_str!("../../../tests/fixtures/engines/llama-cpp/metrics.txt");

    fn spec(engine: &str, speculative: &str) -> Spec {
        let text = format!(
            "apiVersion: specd/v1\nkind: InferenceService\nmetadata: {{name: t}}\nspec:\n  unit: t.service\n  engine: {engine}\n  model: /m\n  speculative: {speculative}\n"
        );
        specd_spec::parse("t.yaml", &text).unwrap().resolve(None).unwrap()
    }

    #[test]
    fn samples_keep_their_labels_and_skip_what_does_not_parse() {
        let s = samples(
            "# HELP x y\nx_total{a=\"1\",position=\"3\"} 2.5\nx_total 4\nbad line\ny{q=\"a\\\"b\"} 1e3\nz{} NaN\n",
        );
        assert_eq!(s.len(), 4);
        assert_eq!(s[0].labels, vec![("a".into(), "1".into()), ("position".into(), "3".into())]);
        assert_eq!((s[1].name.as_str(), s[1].value), ("x_total", 4.0));
        assert_eq!((s[2].labels[0].1.as_str(), s[2].value), ("a\"b", 1000.0));
        assert!(s[3].value.is_nan());
    }

    #[test]
    fn the_real_vllm_counts_give_its_acceptance_steps_and_load() {
        let c = Counts::read(Engine::Vllm, VLLM_NGRAM);
        let spec = spec("vllm", "{algorithm: ngram, num_steps: 4}");
        let o = observe(&spec, &c, 1.79633453877e9 + 100.0).unwrap();
        // One 16-token request: 3 drafts of 4, all accepted; 3 decode steps of 5 tokens.
        assert_eq!(o.acceptance, Some(Acceptance { drafts: 3, per_pos: vec![3, 3, 3, 3] }));
        assert_eq!(o.accept_length, Some(5.0));
        let d = o.decode.unwrap();
        assert_eq!((d.steps, d.tokens), (3, 15));
        assert!((d.seconds - 0.6724412929997925).abs() < 1e-12);
        assert_eq!(o.load.requests, Some(1));
        assert!((o.load.request_rate.unwrap() - 0.01).abs() < 1e-9);
        // 4 engine steps, one the prefill: 3 steps of one request.
        assert_eq!(o.load.concurrency, Some(1.0));
        assert_eq!(o.by_position_unusable, None);
    }

    #[test]
    fn the_real_llama_server_counts_give_its_acceptance_and_steps() {
        let mut text = LLAMA.to_string();
        // The recorded run generated too fast for its seconds (0): a second, as a run would.
        text = text.replace("llamacpp:tokens_predicted_seconds_total 0", "llamacpp:tokens_predicted_seconds_total 1.2");
        let c = Counts::read(Engine::LlamaCpp, &text);
        let spec = spec("llama-cpp", "{draft_model: /d.gguf, num_steps: 4}");
        let o = observe(&spec, &c, 0.0).unwrap();
        assert_eq!(o.acceptance, Some(Acceptance { drafts: 10, per_pos: vec![10, 10, 8, 8] }));
        assert_eq!(o.accept_length, Some(4.6));
        // 48 tokens, 36 of them accepted drafts: 12 steps.
        assert_eq!(o.decode, Some(Decode { steps: 12, seconds: 1.2, tokens: 48 }));
        assert_eq!(o.load.concurrency, Some(1.0));
        assert!(o.notes[0].contains("counts no requests"));
        // An n-gram type drafts its own length.
        let ngram = observe(&spec_ngram(), &c, 0.0).unwrap();
        assert!(ngram.by_position_unusable.unwrap().contains("n-gram types draft up to their own length"));
    }

    fn spec_ngram() -> Spec {
        spec("llama-cpp", "{algorithm: ngram-simple}")
    }

    #[test]
    fn sglang_gives_tokens_per_verify_pass_and_nothing_by_position() {
        let text = "sglang:spec_verify_calls_total{model_name=\"m\"} 100\nsglang:generation_tokens_total{model_name=\"m\",is_streaming=\"true\"} 250\nsglang:generation_tokens_total{model_name=\"m\",is_streaming=\"false\"} 90\n";
        let o = observe(
            &spec("sglang", "{algorithm: EAGLE, draft_model: /d, num_steps: 3, eagle_topk: 1, num_draft_tokens: 4}"),
            &Counts::read(Engine::Sglang, text),
            0.0,
        )
        .unwrap();
        assert_eq!(o.accept_length, Some(3.4));
        assert!(o.by_position_unusable.unwrap().contains("nothing by draft position"));
    }

    #[test]
    fn no_drafts_counter_says_why_and_two_reads_subtract() {
        let spec = spec("vllm", "{algorithm: ngram, num_steps: 4}");
        let plain = Counts::read(Engine::Vllm, VLLM_PLAIN);
        let why = observe(&spec, &plain, 0.0).unwrap_err();
        assert!(
            why.contains("has no vllm:spec_decode_num_drafts_total") && why.contains("--disable-log-stats"),
            "{why}"
        );
        let after = Counts::read(Engine::Vllm, VLLM_NGRAM);
        let mut before = after.clone();
        before.drafts -= 2.0;
        before.accepted -= 8.0;
        before.steps -= 2.0;
        before.per_pos.values_mut().for_each(|v| *v -= 2.0);
        let d = after.since(&before);
        assert_eq!((d.drafts, d.accepted, d.steps), (2.0, 8.0, 2.0));
        assert_eq!(d.per_pos.values().copied().collect::<Vec<_>>(), vec![2.0; 4]);
        // A restart between the reads: the counts after are all there is.
        assert_eq!(before.since(&after), before);
    }
}
