//! Validation: refuse, before anything touches a host, what the engine would reject or silently
//! rewrite, and anything that could inject a line into the unit file.

use std::collections::BTreeMap;

use crate::diag::{Diagnostic, Severity, SourceMap};
use crate::engine;
use crate::model::{Document, DriftPolicy, Engine, Merge, Restart, SpecLayer};
use crate::resolve::{Policy, Readiness, Server, Service, Spec, Speculative};

/// Collects diagnostics for one resolution (base spec, or base + one host overlay).
struct Ctx<'a> {
    map: &'a SourceMap,
    host: Option<&'a str>,
    out: Vec<Diagnostic>,
}

impl Ctx<'_> {
    /// `p` is relative to the spec (`server.port`); the diagnostic points at the overlay's value
    /// when the overlay sets it, else at the base spec's.
    fn path(&self, p: &str) -> String {
        if let Some(h) = self.host {
            let over = format!("hosts.{h}.{p}");
            if self.map.has(&over) {
                return over;
            }
        }
        format!("spec.{p}")
    }

    fn push(&mut self, severity: Severity, p: &str, msg: String) {
        let path = self.path(p);
        let msg = match self.host {
            Some(h) if !path.starts_with("hosts.") => format!("{msg}{}", overlay_suffix(h)),
            _ => msg,
        };
        let d = self.map.at_field(severity, &path, msg);
        self.out.push(d);
    }

    fn err(&mut self, p: &str, msg: impl Into<String>) {
        self.push(Severity::Error, p, msg.into());
    }

    fn warn(&mut self, p: &str, msg: impl Into<String>) {
        self.push(Severity::Warning, p, msg.into());
    }

    /// An error about a rule between fields: at the first of them that the host overlay sets
    /// (the overlay made the combination), else at the first.
    fn err_rule(&mut self, fields: &[&str], msg: impl Into<String>) {
        let at = self
            .host
            .and_then(|h| fields.iter().find(|f| self.map.has(&format!("hosts.{h}.{f}"))))
            .unwrap_or(&fields[0])
            .to_string();
        self.err(&at, msg);
    }

    /// Any text that ends up in the unit file: no control characters (a newline would start a
    /// new unit line), no leading or trailing white space (systemd strips it).
    fn text(&mut self, p: &str, v: &str) -> bool {
        if let Some(c) = v.chars().find(|c| c.is_control()) {
            self.err(p, format!("contains the control character {c:?}; it could inject a line into the unit file"));
            return false;
        }
        if v != v.trim() {
            self.err(p, "has leading or trailing white space, which systemd would strip");
            return false;
        }
        true
    }

    fn abs_path(&mut self, p: &str, v: &str) {
        if !self.text(p, v) {
            return;
        }
        if !v.starts_with('/') {
            self.err(p, format!("must be an absolute path, got {v:?}"));
        } else if v.split('/').any(|c| c == "..") {
            self.err(p, format!("may not contain `..`, got {v:?}"));
        }
    }
}

fn overlay_suffix(host: &str) -> String {
    format!(" (with the overlay for host {host})")
}

/// Validate one document as a whole: the base spec and every host overlay. Diagnostics are
/// deduplicated (an error in the base spec is reported once, not once per host).
pub(crate) fn validate_all(doc: &Document, map: &SourceMap) -> Vec<Diagnostic> {
    let mut all: Vec<Diagnostic> = Vec::new();
    let mut push = |ds: Vec<Diagnostic>, host: Option<&str>| {
        for d in ds {
            // The same problem of the base spec, seen again through an overlay: report it once.
            let seen = all.iter().any(|a| {
                (a.line, a.column, &a.path, a.severity) == (d.line, d.column, &d.path, d.severity)
                    && host.is_some_and(|h| d.message == format!("{}{}", a.message, overlay_suffix(h)))
            });
            if !seen && !all.contains(&d) {
                all.push(d);
            }
        }
    };
    let outcome = |r: Result<(Spec, Vec<Diagnostic>), Vec<Diagnostic>>| match r {
        Ok((_, w)) => w,
        Err(e) => e,
    };
    push(outcome(resolve(doc, map, None)), None);
    for host in doc.hosts.keys() {
        push(outcome(resolve(doc, map, Some(host))), Some(host));
    }
    all.sort_by_key(|d| (d.line, d.column));
    all
}

/// Resolve for a host: merge its overlay (if any), fill defaults, validate. Ok carries warnings.
pub(crate) fn resolve(
    doc: &Document,
    map: &SourceMap,
    hostname: Option<&str>,
) -> Result<(Spec, Vec<Diagnostic>), Vec<Diagnostic>> {
    let overlay = hostname.and_then(|h| doc.hosts.get_key_value(h)).map(|(k, v)| (k.as_str(), v));
    let mut c = Ctx { map, host: overlay.map(|(h, _)| h), out: Vec::new() };
    document(&mut c, doc);
    let mut layer = doc.spec.clone();
    if let Some((_, o)) = overlay {
        layer.merge(o);
    }
    let spec = build(&mut c, doc, &layer, overlay.map(|(h, _)| h.to_string()));
    if c.out.iter().any(Diagnostic::is_error) {
        Err(c.out)
    } else {
        Ok((spec.expect("a spec without errors is complete"), c.out))
    }
}

fn is_name(v: &str, max: usize) -> bool {
    !v.is_empty()
        && v.len() <= max
        && v.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !v.starts_with('-')
        && !v.ends_with('-')
}

fn document(c: &mut Ctx, doc: &Document) {
    let top = |c: &mut Ctx, path: &str, msg: String| {
        let d = c.map.at_field(Severity::Error, path, msg);
        c.out.push(d);
    };
    if doc.api_version.is_empty() {
        top(c, "apiVersion", "is required: `apiVersion: specd/v1`".into());
    } else if doc.api_version != "specd/v1" {
        top(c, "apiVersion", format!("must be `specd/v1`, got {:?}", doc.api_version));
    }
    if doc.kind.is_empty() {
        top(c, "kind", "is required: `kind: InferenceService`".into());
    } else if doc.kind != "InferenceService" {
        top(c, "kind", format!("must be `InferenceService`, got {:?}", doc.kind));
    }
    if doc.metadata.name.is_empty() {
        top(c, "metadata.name", "is required: a name for this service, e.g. `qwen35-122b-mtp`".into());
    } else if !is_name(&doc.metadata.name, 63) {
        top(
            c,
            "metadata.name",
            format!(
                "must be 1-63 lowercase letters, digits or `-`, not starting or ending with `-`; got {:?}",
                doc.metadata.name
            ),
        );
    }
    for (k, v) in &doc.metadata.labels {
        if k.is_empty() || !k.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_./".contains(&b)) {
            top(
                c,
                &format!("metadata.labels.{k}"),
                format!("label key {k:?} must be letters, digits, `-`, `_`, `.` or `/`"),
            );
        }
        if v.chars().any(char::is_control) {
            top(c, &format!("metadata.labels.{k}"), "contains a control character".into());
        }
    }
    for (h, layer) in &doc.hosts {
        let valid = !h.is_empty()
            && h.len() <= 253
            && h.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'_');
        if !valid {
            top(c, &format!("hosts.{h}"), format!("{h:?} is not a hostname"));
        }
        if layer.unit.is_some() {
            top(
                c,
                &format!("hosts.{h}.unit"),
                "a host overlay may not change the unit: the unit name is the service's identity on every host".into(),
            );
        }
    }
}

fn unit_name_ok(v: &str) -> bool {
    // systemd: [A-Za-z0-9:_.@\-]+ with a type suffix, at most 255 characters. specd owns services.
    let Some(stem) = v.strip_suffix(".service") else {
        return false;
    };
    !stem.is_empty()
        && v.len() <= 255
        && stem.bytes().all(|b| b.is_ascii_alphanumeric() || b":_.@-".contains(&b))
        && !stem.starts_with('.')
        && !v.contains("..")
        && !stem.starts_with('@')
        && stem.matches('@').count() <= 1
        && !stem.ends_with('@')
}

fn user_ok(v: &str) -> bool {
    // Names as systemd's valid_user_group_name() accepts them in strict mode, or a numeric id.
    (v.bytes().all(|b| b.is_ascii_digit()) && !v.is_empty() && v.len() <= 10)
        || (!v.is_empty()
            && v.len() <= 31
            && v.bytes().next().is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
            && v.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.'))
}

fn build(c: &mut Ctx, doc: &Document, l: &SpecLayer, overlay: Option<String>) -> Option<Spec> {
    // unit
    let unit = match &l.unit {
        None => {
            c.err("unit", "is required: the systemd unit specd owns, e.g. `sglang-qwen.service`");
            None
        }
        Some(u) if !unit_name_ok(u) => {
            c.err(
                "unit",
                format!(
                    "{u:?} is not a valid service name: use [A-Za-z0-9:_.@-] ending in `.service`, no `/` and no `..`"
                ),
            );
            None
        }
        Some(u) => Some(u.clone()),
    };
    let engine = l.engine;
    if engine.is_none() {
        c.err("engine", "is required: one of sglang, vllm, llama-cpp");
    }
    let model = match &l.model {
        None => {
            c.err("model", "is required: the absolute path of the model weights");
            None
        }
        Some(m) => {
            c.abs_path("model", m);
            Some(m.clone())
        }
    };
    let engine = engine?;

    // command
    let command = match &l.command {
        Some(cmd) => {
            if cmd.is_empty() {
                c.err("command", "may not be empty; leave it out for the engine's default");
            }
            for (i, w) in cmd.iter().enumerate() {
                c.text(&format!("command[{i}]"), w);
            }
            if let Some(prog) = cmd.first() {
                let bare = !prog.is_empty()
                    && prog.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
                    && prog.bytes().all(|b| b.is_ascii_alphanumeric() || b"._+-".contains(&b));
                if !(prog.starts_with('/') || bare) {
                    c.err(
                        "command[0]",
                        format!("{prog:?} must be an absolute path or a bare program name that systemd looks up"),
                    );
                } else if prog.starts_with('/') {
                    c.abs_path("command[0]", prog);
                }
            }
            cmd.clone()
        }
        None => engine::default_command(engine),
    };

    let server = server(c, engine, l);
    let speculative = speculative(c, engine, l);
    let service = service(c, doc, engine, l);
    let readiness = readiness(c, engine, l, service.as_ref());
    let policy = l.policy.clone().unwrap_or_default();

    if engine == Engine::Sglang
        && speculative.is_some()
        && server.as_ref().is_some_and(|s| s.max_running_requests.is_none())
    {
        c.warn(
            "server.max_running_requests",
            "is unset while speculative decoding is on: SGLang then picks a small value itself (48 in 0.5.x); set it to pin the capacity",
        );
    }

    let (unit, model, server, service, readiness) = (unit?, model?, server?, service?, readiness?);
    let argv = engine::build_argv(engine, &command, &model, &server, speculative.as_ref());
    Some(Spec {
        name: doc.metadata.name.clone(),
        overlay,
        unit,
        engine,
        argv,
        model,
        server,
        speculative,
        service,
        readiness,
        policy: Policy {
            drift: policy.drift.unwrap_or(DriftPolicy::Heal),
            rollback: policy.rollback.unwrap_or(true),
            adopt: policy.adopt.unwrap_or(false),
        },
    })
}

fn server(c: &mut Ctx, engine: Engine, l: &SpecLayer) -> Option<Server> {
    let s = l.server.clone().unwrap_or_default();
    let mut ok = true;
    let host = s.host.unwrap_or_else(|| "127.0.0.1".into());
    if host.is_empty() || !host.bytes().all(|b| b.is_ascii_alphanumeric() || b".:-_".contains(&b)) {
        c.err("server.host", format!("{host:?} is not an address or hostname"));
        ok = false;
    }
    let port = match s.port {
        None => engine::default_port(engine),
        Some(p) if (1..=65535).contains(&p) => p as u16,
        Some(p) => {
            c.err("server.port", format!("must be in 1..=65535, got {p}"));
            ok = false;
            0
        }
    };
    let nonzero = |c: &mut Ctx, p: &str, v: Option<u32>| {
        if v == Some(0) {
            c.err(p, "must be at least 1");
            false
        } else {
            true
        }
    };
    ok &= nonzero(c, "server.tp_size", s.tp_size);
    ok &= nonzero(c, "server.max_running_requests", s.max_running_requests);
    ok &= nonzero(c, "server.context_length", s.context_length);
    if let Some(f) = s.mem_fraction_static
        && !(f > 0.0 && f <= 1.0)
    {
        c.err("server.mem_fraction_static", format!("must be in (0, 1], got {f}"));
        ok = false;
    }
    let not_for = |c: &mut Ctx, p: &str, set: bool, why: &str| {
        if set {
            c.err(p, format!("is not an option of {}: {why}", engine.as_str()));
        }
        !set
    };
    match engine {
        Engine::LlamaCpp => {
            ok &= not_for(
                c,
                "server.tp_size",
                s.tp_size.is_some(),
                "llama-server splits layers with --split-mode/--tensor-split (use extra_args)",
            );
            ok &= not_for(
                c,
                "server.mem_fraction_static",
                s.mem_fraction_static.is_some(),
                "llama-server sizes memory from --ctx-size and --n-gpu-layers",
            );
        }
        Engine::Sglang | Engine::Vllm => {
            ok &= not_for(c, "server.n_gpu_layers", s.n_gpu_layers.is_some(), "it is a llama-cpp option");
        }
    }
    if let Some(n) = &s.served_model_name {
        ok &= c.text("server.served_model_name", n);
        if n.is_empty() {
            c.err("server.served_model_name", "may not be empty");
            ok = false;
        }
    }
    let extra = s.extra_args.unwrap_or_default();
    let owned = engine::owned_flags(engine);
    let removed = engine::removed_flags(engine);
    for (i, w) in extra.iter().enumerate() {
        let p = format!("server.extra_args[{i}]");
        if !c.text(&p, w) {
            ok = false;
            continue;
        }
        let Some(flag) = engine::flag_name(w) else {
            continue;
        };
        if let Some((_, field)) = owned.iter().find(|(f, _)| *f == flag) {
            c.err(&p, format!("`{flag}` is rendered by specd from `spec.{field}`; set it there instead"));
            ok = false;
        } else if let Some((full, field)) = engine::abbreviates(engine, flag) {
            // Python's argparse takes an unambiguous prefix for the whole flag.
            c.err(
                &p,
                format!("`{flag}` abbreviates `{full}`, which specd renders from `spec.{field}`; set it there instead"),
            );
            ok = false;
        }
        if engine != Engine::LlamaCpp && flag == "--config" {
            c.err(&p, "`--config` would let a file override the args specd renders and verifies; put them in the spec");
            ok = false;
        }
        if let Some((_, instead)) = removed.iter().find(|(f, _)| *f == flag) {
            c.err(&p, format!("`{flag}` was removed from {}; startup would fail. Use {instead}", engine.as_str()));
            ok = false;
        }
    }
    ok.then_some(Server {
        host,
        port,
        tp_size: s.tp_size,
        mem_fraction_static: s.mem_fraction_static,
        max_running_requests: s.max_running_requests,
        context_length: s.context_length,
        n_gpu_layers: s.n_gpu_layers,
        served_model_name: s.served_model_name,
        extra_args: extra,
    })
}

const SGLANG_ALGORITHMS: &[&str] = &["EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM"];
const VLLM_METHODS: &[&str] = &["eagle", "eagle3", "mtp", "ngram", "draft_model", "suffix"];

fn speculative(c: &mut Ctx, engine: Engine, l: &SpecLayer) -> Option<Speculative> {
    let s = l.speculative.clone()?;
    let n0 = c.out.iter().filter(|d| d.is_error()).count();
    let reject = |c: &mut Ctx, field: &str, set: bool, why: &str| {
        if set {
            c.err(&format!("speculative.{field}"), why.to_string());
        }
    };
    for (f, v) in [("num_steps", s.num_steps), ("eagle_topk", s.eagle_topk), ("num_draft_tokens", s.num_draft_tokens)] {
        if v == Some(0) {
            c.err(&format!("speculative.{f}"), "must be at least 1");
        }
    }
    if let Some(d) = &s.draft_model {
        c.abs_path("speculative.draft_model", d);
    }
    if let Some(a) = &s.algorithm {
        c.text("speculative.algorithm", a);
    }
    match engine {
        Engine::Sglang => {
            let only = "is not a SGLang option";
            reject(c, "draft_min", s.draft_min.is_some(), &format!("{only} (llama-cpp --spec-draft-n-min)"));
            reject(c, "draft_p_min", s.draft_p_min.is_some(), &format!("{only} (llama-cpp --spec-draft-p-min)"));
            reject(c, "prompt_lookup_min", s.prompt_lookup_min.is_some(), &format!("{only} (vllm ngram)"));
            reject(c, "prompt_lookup_max", s.prompt_lookup_max.is_some(), &format!("{only} (vllm ngram)"));
            match s.algorithm.as_deref() {
                None => {
                    let why = "has no effect without speculative.algorithm";
                    reject(c, "num_steps", s.num_steps.is_some(), why);
                    reject(c, "eagle_topk", s.eagle_topk.is_some(), why);
                    reject(c, "num_draft_tokens", s.num_draft_tokens.is_some(), why);
                    reject(c, "draft_model", s.draft_model.is_some(), why);
                }
                Some(a) if !SGLANG_ALGORITHMS.contains(&a) => {
                    let hint = SGLANG_ALGORITHMS
                        .iter()
                        .find(|x| x.eq_ignore_ascii_case(a))
                        .map(|x| format!(" (did you mean {x}?)"))
                        .unwrap_or_default();
                    c.err(
                        "speculative.algorithm",
                        format!(
                            "{a:?} is not a SGLang speculative algorithm; use one of {}{hint}",
                            SGLANG_ALGORITHMS.join(", ")
                        ),
                    );
                }
                Some("NGRAM") => {
                    reject(
                        c,
                        "eagle_topk",
                        s.eagle_topk.is_some(),
                        "is ignored by NGRAM: SGLang overwrites it with --speculative-ngram-max-bfs-breadth (set that in extra_args)",
                    );
                    reject(
                        c,
                        "num_steps",
                        s.num_steps.is_some(),
                        "is not used by NGRAM: SGLang derives it from num_draft_tokens",
                    );
                    reject(
                        c,
                        "draft_model",
                        s.draft_model.is_some(),
                        "NGRAM has no draft model: it drafts from n-gram matches",
                    );
                }
                Some(a) => {
                    // EAGLE family: EAGLE, EAGLE3, NEXTN, STANDALONE.
                    match s.num_steps {
                        None => {
                            let why = "requires speculative.num_steps: SGLang asserts that eagle_topk and num_draft_tokens are unset when num_steps is";
                            reject(c, "eagle_topk", s.eagle_topk.is_some(), why);
                            reject(c, "num_draft_tokens", s.num_draft_tokens.is_some(), why);
                        }
                        Some(steps) => {
                            if s.eagle_topk.is_none() {
                                c.err(
                                    "speculative.eagle_topk",
                                    "is required with num_steps; otherwise SGLang chooses it itself",
                                );
                            }
                            if s.num_draft_tokens.is_none() {
                                c.err(
                                    "speculative.num_draft_tokens",
                                    "is required with num_steps; otherwise SGLang chooses it itself",
                                );
                            }
                            if s.eagle_topk == Some(1)
                                && let Some(n) = s.num_draft_tokens
                                && n != steps + 1
                            {
                                c.err_rule(
                                    &["speculative.num_draft_tokens", "speculative.num_steps", "speculative.eagle_topk"],
                                    format!(
                                        "num_draft_tokens must be num_steps + 1 = {} when eagle_topk is 1, got {n}; SGLang would silently reset it to {}, which would later look like drift",
                                        steps + 1,
                                        steps + 1
                                    ),
                                );
                            }
                        }
                    }
                    if a != "NEXTN" && s.draft_model.is_none() {
                        c.err("speculative.draft_model", format!("is required by {a}: the path of the draft model"));
                    }
                }
            }
        }
        Engine::Vllm => {
            let only = "is not a vLLM option";
            reject(c, "eagle_topk", s.eagle_topk.is_some(), &format!("{only} (SGLang only)"));
            reject(c, "num_draft_tokens", s.num_draft_tokens.is_some(), &format!("{only} (SGLang only)"));
            reject(c, "draft_min", s.draft_min.is_some(), &format!("{only} (llama-cpp only)"));
            reject(c, "draft_p_min", s.draft_p_min.is_some(), &format!("{only} (llama-cpp only)"));
            match s.algorithm.as_deref() {
                None => c.err(
                    "speculative.algorithm",
                    format!("is required: vLLM's speculative-config method, one of {}", VLLM_METHODS.join(", ")),
                ),
                Some(m) if !VLLM_METHODS.contains(&m) => {
                    c.err(
                        "speculative.algorithm",
                        format!("{m:?} is not a vLLM speculative method; use one of {}", VLLM_METHODS.join(", ")),
                    );
                }
                Some(m) => {
                    if s.num_steps.is_none() {
                        c.err(
                            "speculative.num_steps",
                            "is required: vLLM fails with `num_speculative_tokens must be provided`",
                        );
                    }
                    match m {
                        "eagle" | "eagle3" | "draft_model" if s.draft_model.is_none() => {
                            c.err("speculative.draft_model", format!("is required by method {m}"));
                        }
                        "ngram" | "suffix" if s.draft_model.is_some() => {
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
                        c.err(
                            "speculative.prompt_lookup_min",
                            format!("must be at most prompt_lookup_max ({hi}), got {lo}"),
                        );
                    }
                }
            }
        }
        Engine::LlamaCpp => {
            let only = "is not a llama-cpp option";
            reject(
                c,
                "algorithm",
                s.algorithm.is_some(),
                "is not used by llama-cpp: a draft model (speculative.draft_model) turns on draft decoding",
            );
            reject(c, "eagle_topk", s.eagle_topk.is_some(), &format!("{only} (SGLang only)"));
            reject(c, "num_draft_tokens", s.num_draft_tokens.is_some(), &format!("{only} (SGLang only)"));
            reject(c, "prompt_lookup_min", s.prompt_lookup_min.is_some(), &format!("{only} (vllm ngram)"));
            reject(c, "prompt_lookup_max", s.prompt_lookup_max.is_some(), &format!("{only} (vllm ngram)"));
            if s.draft_model.is_none() {
                c.err("speculative.draft_model", "is required: llama-server drafts with --spec-draft-model");
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
        }
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

fn service(c: &mut Ctx, doc: &Document, engine: Engine, l: &SpecLayer) -> Option<Service> {
    let s = l.service.clone().unwrap_or_default();
    let n0 = c.out.iter().filter(|d| d.is_error()).count();
    // Written as-is (these keys do not unquote): a backslash could continue the line into the
    // next key, so none is allowed.
    if let Some(d) = &s.description
        && c.text("service.description", d)
        && d.contains('\\')
    {
        c.err("service.description", "may not contain a backslash (a trailing one would join the next unit line)");
    }
    for (f, v) in [("user", &s.user), ("group", &s.group)] {
        if let Some(v) = v
            && !user_ok(v)
        {
            c.err(&format!("service.{f}"), format!("{v:?} is not a valid {f} name"));
        }
    }
    if let Some(w) = &s.working_directory {
        c.abs_path("service.working_directory", w);
        if w.contains('\\') {
            c.err(
                "service.working_directory",
                "may not contain a backslash (a trailing one would join the next unit line)",
            );
        }
    }
    let env = s.environment.clone().unwrap_or_default();
    for (k, v) in &env {
        let p = format!("service.environment.{k}");
        let key_ok = k.bytes().next().is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
            && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if !key_ok {
            c.err(&p, format!("{k:?} is not a valid environment variable name ([A-Za-z_][A-Za-z0-9_]*)"));
        }
        if let Some(ch) = v.chars().find(|c| c.is_control()) {
            c.err(&p, format!("contains the control character {ch:?}; it could inject a line into the unit file"));
        }
    }
    if let Some(m) = &s.memory_max {
        let digits = m.trim_end_matches(['K', 'M', 'G', 'T', '%']);
        let ok = m == "infinity"
            || (!digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) && m.len() - digits.len() <= 1);
        if !ok {
            c.err("service.memory_max", format!("{m:?} is not a memory size (bytes with an optional K, M, G or T suffix, a percentage, or `infinity`)"));
        }
    }
    let timeout_stop_sec = s.timeout_stop_sec.unwrap_or(300);
    let timeout_start_sec = s.timeout_start_sec.unwrap_or(1800);
    for (f, v) in [("timeout_stop_sec", s.timeout_stop_sec), ("timeout_start_sec", s.timeout_start_sec)] {
        if v == Some(0) {
            c.err(&format!("service.{f}"), "must be at least 1 (0 would disable the timeout)");
        }
    }
    let drain = s.drain_timeout_sec.unwrap_or(0);
    if drain > timeout_stop_sec {
        c.warn(
            "service.timeout_stop_sec",
            format!(
                "is {timeout_stop_sec} s, shorter than the drain budget (drain_timeout_sec = {drain} s): a stop may SIGKILL the server while requests are still in flight"
            ),
        );
    }
    let failed = c.out.iter().filter(|d| d.is_error()).count() > n0;
    (!failed).then(|| Service {
        description: s.description.unwrap_or_else(|| format!("specd: {} ({})", doc.metadata.name, engine.as_str())),
        user: s.user,
        group: s.group,
        working_directory: s.working_directory,
        environment: env.into_iter().collect::<BTreeMap<_, _>>(),
        restart: s.restart.unwrap_or(Restart::OnFailure),
        restart_sec: s.restart_sec.unwrap_or(5),
        timeout_start_sec,
        timeout_stop_sec,
        drain_timeout_sec: drain,
        memory_max: s.memory_max,
    })
}

fn readiness(c: &mut Ctx, engine: Engine, l: &SpecLayer, service: Option<&Service>) -> Option<Readiness> {
    let r = l.readiness.clone().unwrap_or_default();
    let endpoint = r.endpoint.unwrap_or_else(|| engine::default_endpoint(engine).to_string());
    let mut ok = true;
    if !endpoint.starts_with('/') || endpoint.bytes().any(|b| b <= b' ' || b == 0x7f) {
        c.err(
            "readiness.endpoint",
            format!("must be an HTTP path starting with `/`, without spaces or control characters; got {endpoint:?}"),
        );
        ok = false;
    }
    if r.timeout_sec == Some(0) {
        c.err("readiness.timeout_sec", "must be at least 1");
        ok = false;
    }
    let service = service?;
    ok.then(|| Readiness {
        timeout_sec: r.timeout_sec.unwrap_or(service.timeout_start_sec),
        endpoint,
        verify_args: r.verify_args.unwrap_or(true),
    })
}
