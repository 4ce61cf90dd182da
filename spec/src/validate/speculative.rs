//! Each engine's rules for speculative decoding, as its own source enforces them (SGLang's
//! EAGLE/NEXTN/NGRAM, vLLM's `--speculative-config`, llama.cpp's draft and n-gram types).

use super::limits::MAX_NAME;
use super::*;
use crate::engine::{self, EngineFacts, Need};
use crate::model::strict::shown;
use crate::model::{Engine, SpecLayer, SpeculativeLayer};
use crate::resolve::Speculative;

/// The speculative section: the checks every engine shares, then the engine's own rules. `None`
/// when any of them failed.
pub(super) fn speculative(c: &mut Ctx, engine: Engine, l: &SpecLayer) -> Option<Speculative> {
    let mut s = l.speculative.clone()?;
    let facts = engine::facts(engine);
    let n0 = c.out.iter().filter(|d| d.is_error()).count();
    for (f, v) in [
        ("num_steps", s.num_steps),
        ("eagle_topk", s.eagle_topk),
        ("num_draft_tokens", s.num_draft_tokens),
        ("prompt_lookup_min", s.prompt_lookup_min),
        ("prompt_lookup_max", s.prompt_lookup_max),
    ] {
        if v == Some(0) {
            c.err(&format!("speculative.{f}"), "must be at least 1");
        }
    }
    if let Some(d) = &s.draft_model {
        c.abs_path("speculative.draft_model", d);
    }
    if let Some(a) = &s.algorithm {
        c.text_max("speculative.algorithm", a, MAX_NAME);
    }
    match engine {
        Engine::Sglang => sglang_speculative(c, facts, &s),
        Engine::Vllm => vllm_speculative(c, facts, &s),
        Engine::LlamaCpp => s.algorithm = llama_speculative(c, facts, &s).map(str::to_string),
    }
    let failed = c.out.iter().filter(|d| d.is_error()).count() > n0;
    (!failed).then_some(Speculative {
        algorithm: s.algorithm,
        num_steps: s.num_steps,
        eagle_topk: s.eagle_topk,
        num_draft_tokens: s.num_draft_tokens,
        draft_model: s.draft_model,
        draft_min: s.draft_min,
        draft_p_min: s.draft_p_min,
        prompt_lookup_min: s.prompt_lookup_min,
        prompt_lookup_max: s.prompt_lookup_max,
    })
}

/// An error at `speculative.<field>` when the field is set.
pub(super) fn reject(c: &mut Ctx, field: &str, set: bool, why: &str) {
    if set {
        c.err(&format!("speculative.{field}"), why.to_string());
    }
}

/// SGLang's rules: no other engine's fields; an algorithm it knows is required; then NGRAM's
/// rules or the EAGLE family's.
pub(super) fn sglang_speculative(c: &mut Ctx, facts: &EngineFacts, s: &SpeculativeLayer) {
    let names = facts.algorithm_names();
    let only = "is not a SGLang option";
    reject(c, "draft_min", s.draft_min.is_some(), &format!("{only} (llama-cpp --spec-draft-n-min)"));
    reject(c, "draft_p_min", s.draft_p_min.is_some(), &format!("{only} (llama-cpp --spec-draft-p-min)"));
    reject(c, "prompt_lookup_min", s.prompt_lookup_min.is_some(), &format!("{only} (vllm ngram)"));
    reject(c, "prompt_lookup_max", s.prompt_lookup_max.is_some(), &format!("{only} (vllm ngram)"));
    match s.algorithm.as_deref() {
        None => c.err(
            "speculative.algorithm",
            format!(
                "is required: SGLang speculates only with --speculative-algorithm ({}); without speculation, leave the speculative section out",
                names.join(", ")
            ),
        ),
        Some(a) if facts.algorithm(a).is_none() => {
            let hint = names
                .iter()
                .find(|x| x.eq_ignore_ascii_case(a))
                .map(|x| format!(" (did you mean {x}?)"))
                .unwrap_or_default();
            c.err(
                "speculative.algorithm",
                format!("{} is not a SGLang speculative algorithm; use one of {}{hint}", shown(a), names.join(", ")),
            );
        }
        Some("NGRAM") => {
            reject(
                c,
                "eagle_topk",
                s.eagle_topk.is_some(),
                "is ignored by NGRAM: SGLang overwrites it with --speculative-ngram-max-bfs-breadth (set that in extra_args)",
            );
            reject(c, "num_steps", s.num_steps.is_some(), "is not used by NGRAM: SGLang derives it from num_draft_tokens");
            reject(c, "draft_model", s.draft_model.is_some(), "NGRAM has no draft model: it drafts from n-gram matches");
        }
        Some(a) => sglang_eagle(c, facts, s, a),
    }
}

/// SGLang's EAGLE family (EAGLE, EAGLE3, NEXTN, STANDALONE): num_steps, eagle_topk and
/// num_draft_tokens all set or all unset, draft tokens = steps + 1 when topk is 1, and the draft
/// model when the algorithm needs one.
pub(super) fn sglang_eagle(c: &mut Ctx, facts: &EngineFacts, s: &SpeculativeLayer, a: &str) {
    match s.num_steps {
        None => {
            let why = "requires speculative.num_steps: SGLang asserts that eagle_topk and num_draft_tokens are unset when num_steps is";
            reject(c, "eagle_topk", s.eagle_topk.is_some(), why);
            reject(c, "num_draft_tokens", s.num_draft_tokens.is_some(), why);
        }
        Some(steps) => {
            if s.eagle_topk.is_none() {
                c.err("speculative.eagle_topk", "is required with num_steps; otherwise SGLang chooses it itself");
            }
            if s.num_draft_tokens.is_none() {
                c.err("speculative.num_draft_tokens", "is required with num_steps; otherwise SGLang chooses it itself");
            }
            // u64: num_steps + 1 does not fit in u32 when num_steps is u32::MAX.
            let want = u64::from(steps) + 1;
            if s.eagle_topk == Some(1)
                && let Some(n) = s.num_draft_tokens
                && u64::from(n) != want
            {
                c.err_rule(
                    &["speculative.num_draft_tokens", "speculative.num_steps", "speculative.eagle_topk"],
                    format!(
                        "num_draft_tokens must be num_steps + 1 = {want} when eagle_topk is 1, got {n}; SGLang would silently reset it to {want}, which would later look like drift"
                    ),
                );
            }
        }
    }
    if facts.algorithm(a).is_some_and(|x| x.draft_model == Need::Required) && s.draft_model.is_none() {
        c.err("speculative.draft_model", format!("is required by {a}: the path of the draft model"));
    }
}

/// vLLM's rules: no other engine's fields; a method it knows, with num_steps; a draft model
/// exactly when the method takes one; prompt lookup bounds for ngram only, in order.
pub(super) fn vllm_speculative(c: &mut Ctx, facts: &EngineFacts, s: &SpeculativeLayer) {
    let names = facts.algorithm_names();
    let only = "is not a vLLM option";
    reject(c, "eagle_topk", s.eagle_topk.is_some(), &format!("{only} (SGLang only)"));
    reject(c, "num_draft_tokens", s.num_draft_tokens.is_some(), &format!("{only} (SGLang only)"));
    reject(c, "draft_min", s.draft_min.is_some(), &format!("{only} (llama-cpp only)"));
    reject(c, "draft_p_min", s.draft_p_min.is_some(), &format!("{only} (llama-cpp only)"));
    let m = match s.algorithm.as_deref() {
        None => {
            c.err(
                "speculative.algorithm",
                format!("is required: vLLM's speculative-config method, one of {}", names.join(", ")),
            );
            return;
        }
        Some(m) if facts.algorithm(m).is_none() => {
            c.err(
                "speculative.algorithm",
                format!("{} is not a vLLM speculative method; use one of {}", shown(m), names.join(", ")),
            );
            return;
        }
        Some(m) => m,
    };
    if s.num_steps.is_none() {
        c.err("speculative.num_steps", "is required: vLLM fails with `num_speculative_tokens must be provided`");
    }
    match facts.algorithm(m).map(|x| x.draft_model) {
        Some(Need::Required) if s.draft_model.is_none() => {
            c.err("speculative.draft_model", format!("is required by method {m}"));
        }
        Some(Need::Forbidden) if s.draft_model.is_some() => {
            c.err("speculative.draft_model", format!("method {m} has no draft model"));
        }
        _ => {}
    }
    let lookup = s.prompt_lookup_min.is_some() || s.prompt_lookup_max.is_some();
    if m != "ngram" && lookup {
        let f = if s.prompt_lookup_min.is_some() { "prompt_lookup_min" } else { "prompt_lookup_max" };
        c.err(&format!("speculative.{f}"), "is only used by method ngram");
    }
    if let (Some(lo), Some(hi)) = (s.prompt_lookup_min, s.prompt_lookup_max)
        && lo > hi
    {
        c.err("speculative.prompt_lookup_min", format!("must be at most prompt_lookup_max ({hi}), got {lo}"));
    }
}

/// llama-server's rules: no other engine's fields; the `--spec-type` specd renders
/// ([`llama_spec_type`]); the fields that type uses; draft bounds in range. Returns that type.
pub(super) fn llama_speculative(c: &mut Ctx, facts: &EngineFacts, s: &SpeculativeLayer) -> Option<&'static str> {
    let only = "is not a llama-cpp option";
    reject(c, "eagle_topk", s.eagle_topk.is_some(), &format!("{only} (SGLang only)"));
    reject(c, "num_draft_tokens", s.num_draft_tokens.is_some(), &format!("{only} (SGLang only)"));
    reject(c, "prompt_lookup_min", s.prompt_lookup_min.is_some(), &format!("{only} (vllm ngram)"));
    reject(c, "prompt_lookup_max", s.prompt_lookup_max.is_some(), &format!("{only} (vllm ngram)"));
    let algorithm = llama_spec_type(c, facts, s);
    if let Some(a) = algorithm.and_then(|a| facts.algorithm(a)) {
        match a.draft_model {
            Need::Required if s.draft_model.is_none() => c.err(
                "speculative.draft_model",
                format!("is required by --spec-type {}: llama-server drafts with --spec-draft-model", a.name),
            ),
            Need::Forbidden => {
                let why = format!(
                    "is not used by --spec-type {}: n-gram types draft from the context (tune them with --spec-ngram-* in extra_args)",
                    a.name
                );
                reject(c, "draft_model", s.draft_model.is_some(), &why);
                reject(c, "num_steps", s.num_steps.is_some(), &why);
                reject(c, "draft_min", s.draft_min.is_some(), &why);
                reject(c, "draft_p_min", s.draft_p_min.is_some(), &why);
            }
            _ => {}
        }
    }
    if let (Some(lo), Some(hi)) = (s.draft_min, s.num_steps)
        && lo > hi
    {
        c.err("speculative.draft_min", format!("must be at most num_steps ({hi}), got {lo}"));
    }
    if let Some(p) = s.draft_p_min
        && !(0.0..=1.0).contains(&p)
    {
        c.err("speculative.draft_p_min", format!("must be in [0, 1], got {p}"));
    }
    algorithm
}

/// The `--spec-type` specd renders for llama-server: the one named, or draft-simple for a draft
/// model alone (llama-server's default, `none`, would load the draft model and never use it);
/// `None` with an error when there is neither or the name is not a type.
pub(super) fn llama_spec_type(c: &mut Ctx, facts: &EngineFacts, s: &SpeculativeLayer) -> Option<&'static str> {
    match s.algorithm.as_deref() {
        None if s.draft_model.is_some() => facts.default_algorithm_with_draft,
        None => {
            c.err(
                "speculative.draft_model",
                "is required: llama-server drafts with --spec-draft-model (and specd renders --spec-type draft-simple); without a draft model, set speculative.algorithm to an n-gram --spec-type",
            );
            None
        }
        Some(a) => match facts.algorithm(a) {
            Some(x) => Some(x.name),
            None => {
                let hint = if a == "none" {
                    " (to turn speculation off, remove the speculative section)".to_string()
                } else {
                    String::new()
                };
                c.err(
                    "speculative.algorithm",
                    format!(
                        "{} is not a llama-server --spec-type; use one of {}{hint}",
                        shown(a),
                        facts.algorithm_names().join(", ")
                    ),
                );
                None
            }
        },
    }
}
