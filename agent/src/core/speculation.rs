//! Proof that a server really speculates: the engine's own evidence from one short generation,
//! read into one figure a person compares across configs (accept rate, accept length). Pure: the
//! replies come in as values, the HTTP calls live in `probe.rs`. Field names come from the
//! engine facts table (`specd_spec::EngineFacts::evidence`).

use serde::{Deserialize, Serialize};
use serde_json::Value;
use specd_spec::{Evidence, Spec};

/// The prompt of the verification generation: a sequence that repeats, so the continuation
/// repeats it too: a draft model's guesses are accepted, and n-gram drafting (which looks up the
/// last tokens in the context) finds its matches. A prompt of prose gave llama.cpp's n-gram
/// types no draft at all.
pub const PROMPT: &str =
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3,";

/// Tokens generated for the proof: enough for several draft rounds, short enough to cost
/// well under a second on a loaded server.
pub const TOKENS: u32 = 32;

/// What the engine showed about speculative decoding.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Speculation {
    /// Draft tokens proposed during the generation.
    pub drafted: Option<u64>,
    /// Draft tokens the target model accepted.
    pub accepted: Option<u64>,
    /// Tokens produced per target verification pass (1 = no speculation).
    pub accept_length: Option<f64>,
    /// accepted / drafted.
    pub accept_rate: Option<f64>,
    /// The engine's own fields, as read, for a person (`timings.draft_n=24, …`).
    pub evidence: Vec<String>,
    /// The engine says speculation is off (llama.cpp: every slot reports `speculative: false`).
    #[serde(default)]
    pub off: bool,
}

impl Speculation {
    /// Drafting happened.
    pub fn drafts(&self) -> bool {
        !self.off && (self.drafted.is_some_and(|n| n > 0) || self.accept_length.is_some_and(|l| l > 1.0))
    }

    /// One line for `status` and apply output: "accept rate 83% (20/24 draft tokens), accept length 3.1".
    pub fn figure(&self) -> String {
        let mut parts = Vec::new();
        if let Some(r) = self.accept_rate {
            let counts = match (self.accepted, self.drafted) {
                (Some(a), Some(d)) => format!(" ({a}/{d} draft tokens)"),
                _ => String::new(),
            };
            parts.push(format!("accept rate {:.0}%{counts}", r * 100.0));
        }
        if let Some(l) = self.accept_length {
            parts.push(format!("accept length {l:.2}"));
        }
        if parts.is_empty() {
            parts.push("no drafting measured".into());
        }
        parts.join(", ")
    }
}

fn u(v: Option<&Value>) -> Option<u64> {
    v.and_then(|v| v.as_u64().or_else(|| v.as_f64().filter(|f| *f >= 0.0).map(|f| f as u64)))
}

fn ratio(a: Option<u64>, b: Option<u64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0 => Some(a as f64 / b as f64),
        _ => None,
    }
}

/// llama.cpp: `/slots` (may be disabled: `None`) and one `/completion` reply.
pub fn from_llama_cpp(evidence: &Evidence, slots: Option<&Value>, completion: &Value) -> Speculation {
    let Evidence::LlamaCpp { slot_flag, drafted, accepted, .. } = evidence else {
        return Speculation::default();
    };
    let mut s = Speculation::default();
    if let Some(list) = slots.and_then(Value::as_array) {
        let flags: Vec<bool> = list.iter().filter_map(|x| x.get(*slot_flag).and_then(Value::as_bool)).collect();
        if !flags.is_empty() {
            s.off = flags.iter().all(|f| !f);
            s.evidence.push(format!("/slots[].{slot_flag}={}", flags.iter().any(|f| *f)));
        }
    }
    let timings = completion.get("timings");
    // llama-server leaves both fields out when nothing was drafted.
    let d = u(timings.and_then(|t| t.get(*drafted))).or(Some(0));
    let a = u(timings.and_then(|t| t.get(*accepted))).or(Some(0));
    s.evidence.push(format!("timings.{drafted}={}", d.unwrap_or(0)));
    s.evidence.push(format!("timings.{accepted}={}", a.unwrap_or(0)));
    s.drafted = d;
    s.accepted = a;
    s.accept_rate = ratio(a, d);
    s
}

/// SGLang: one `/generate` reply, and `/get_server_info` when it could be read.
pub fn from_sglang(evidence: &Evidence, generate: &Value, server_info: Option<&Value>) -> Speculation {
    let Evidence::Sglang { verify_ct, tokens, avg_accept_length, .. } = evidence else {
        return Speculation::default();
    };
    let mut s = Speculation::default();
    let meta = generate.get("meta_info");
    let verify = u(meta.and_then(|m| m.get(*verify_ct)));
    let produced = u(meta.and_then(|m| m.get(*tokens)));
    s.evidence.push(format!(
        "meta_info.{verify_ct}={}, meta_info.{tokens}={}",
        verify.map_or("absent".into(), |v| v.to_string()),
        produced.map_or("absent".into(), |v| v.to_string())
    ));
    s.accept_length = ratio(produced, verify);
    if let Some(avg) = server_info
        .and_then(|i| i.get("internal_states"))
        .and_then(Value::as_array)
        .and_then(|a| a.iter().find_map(|x| x.get(*avg_accept_length).and_then(Value::as_f64)))
    {
        s.evidence.push(format!("internal_states[].{avg_accept_length}={avg:.2}"));
    }
    s
}

/// vLLM: its `/metrics` text before and after one generation.
pub fn from_vllm(evidence: &Evidence, before: &str, after: &str) -> Speculation {
    let Evidence::Vllm { drafts, draft_tokens, accepted, .. } = evidence else {
        return Speculation::default();
    };
    let delta = |name: &str| {
        let a = metric_sum(after, name)?;
        Some(a.saturating_sub(metric_sum(before, name).unwrap_or(0)))
    };
    let (n_drafts, n_tokens, n_accepted) = (delta(drafts), delta(draft_tokens), delta(accepted));
    let show = |v: Option<u64>| v.map_or("absent".to_string(), |v| format!("+{v}"));
    Speculation {
        drafted: n_tokens,
        accepted: n_accepted,
        accept_length: ratio(n_accepted, n_drafts).map(|r| 1.0 + r),
        accept_rate: ratio(n_accepted, n_tokens),
        evidence: vec![
            format!("{drafts} {}", show(n_drafts)),
            format!("{draft_tokens} {}", show(n_tokens)),
            format!("{accepted} {}", show(n_accepted)),
        ],
        off: false,
    }
}

/// Why a server that should speculate shows no drafting, in words: `None` when it drafts.
pub fn missing(spec: &Spec, s: &Speculation) -> Option<String> {
    if s.drafts() {
        return None;
    }
    let facts = specd_spec::engine_facts(spec.engine);
    let hint = match (facts.default_algorithm_with_draft, &facts.evidence) {
        (Some(a), _) => format!(
            "; llama-server only drafts with a --spec-type (specd renders it from speculative.algorithm, {a} with a draft model)"
        ),
        // vLLM registers its spec_decode counters only when it speculates, and exports none
        // of its counters under --disable-log-stats.
        (None, Evidence::Vllm { drafts, .. }) if s.drafted.is_none() => format!(
            "; vLLM has no {drafts} counter: it exports the spec_decode counters only when it speculates and logs stats (not under --disable-log-stats), so nothing proves that it speculates"
        ),
        _ => String::new(),
    };
    Some(format!(
        "the spec asks for speculative decoding, but the server drafted nothing in a {TOKENS}-token generation ({}){hint}",
        s.evidence.join(", ")
    ))
}

/// Sum of a metric's samples over all label sets.
pub fn metric_sum(text: &str, name: &str) -> Option<u64> {
    let mut found = false;
    let mut sum = 0.0;
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        if !(rest.starts_with('{') || rest.starts_with(' ')) {
            continue;
        }
        let value = rest.rsplit_once('}').map_or(rest, |(_, v)| v).split_whitespace().next();
        if let Some(v) = value.and_then(|v| v.parse::<f64>().ok()) {
            sum += v;
            found = true;
        }
    }
    found.then_some(sum.round() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use specd_spec::{Engine, engine_facts};

    #[test]
    fn llama_cpp_drafting_and_a_loaded_but_unused_draft() {
        let ev = &engine_facts(Engine::LlamaCpp).evidence;
        let on = from_llama_cpp(
            ev,
            Some(&json!([{"id": 0, "speculative": true}])),
            &json!({"timings": {"predicted_n": 32, "draft_n": 24, "draft_n_accepted": 20}}),
        );
        assert!(on.drafts());
        assert_eq!(on.figure(), "accept rate 83% (20/24 draft tokens)");
        let off = from_llama_cpp(
            ev,
            Some(&json!([{"id": 0, "speculative": false}, {"id": 1, "speculative": false}])),
            &json!({"timings": {"predicted_n": 32}}),
        );
        assert!(!off.drafts());
        assert_eq!(off.evidence, ["/slots[].speculative=false", "timings.draft_n=0", "timings.draft_n_accepted=0"]);
    }

    #[test]
    fn sglang_accept_length_is_tokens_per_verify_pass() {
        let ev = &engine_facts(Engine::Sglang).evidence;
        let s = from_sglang(
            ev,
            &json!({"text": "x", "meta_info": {"completion_tokens": 32, "spec_verify_ct": 8}}),
            Some(&json!({"internal_states": [{"avg_spec_accept_length": 3.9}]})),
        );
        assert_eq!(s.accept_length, Some(4.0));
        assert!(s.drafts());
        let none = from_sglang(ev, &json!({"meta_info": {"completion_tokens": 32}}), None);
        assert!(!none.drafts());
    }

    #[test]
    fn vllm_counters_are_read_as_deltas() {
        let ev = &engine_facts(Engine::Vllm).evidence;
        let before = "vllm:spec_decode_num_drafts_total{model_name=\"m\"} 10\nvllm:spec_decode_num_draft_tokens_total{model_name=\"m\"} 30\nvllm:spec_decode_num_accepted_tokens_total{model_name=\"m\"} 20\n";
        let after = "vllm:spec_decode_num_drafts_total{model_name=\"m\"} 18\nvllm:spec_decode_num_draft_tokens_total{model_name=\"m\"} 54\nvllm:spec_decode_num_accepted_tokens_total{model_name=\"m\"} 38\n";
        let s = from_vllm(ev, before, after);
        assert_eq!((s.drafted, s.accepted), (Some(24), Some(18)));
        assert_eq!(s.accept_length, Some(1.0 + 18.0 / 8.0));
        assert!(s.drafts());
        assert!(!from_vllm(ev, before, before).drafts());
        // Configured, and the counters absent: the apply fails, saying why.
        let spec = specd_spec::parse(
            "t.yaml",
            "apiVersion: specd/v1\nkind: InferenceService\nmetadata: {name: t}\nspec:\n  unit: t.service\n  engine: vllm\n  model: /m\n  speculative: {algorithm: ngram, num_steps: 4}\n",
        )
        .unwrap()
        .resolve(None)
        .unwrap();
        let absent = from_vllm(ev, "vllm:num_requests_running 0\n", "vllm:num_requests_running 0\n");
        let why = missing(&spec, &absent).expect("no drafting");
        assert!(why.contains("vllm:spec_decode_num_drafts_total absent"), "{why}");
        assert!(why.contains("--disable-log-stats"), "{why}");
        assert!(missing(&spec, &from_vllm(ev, before, after)).is_none());
    }
}
