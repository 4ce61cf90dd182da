//! Command lines of the three engines, parsed and validated as the engines
//! do, and the stand-in's own knobs.
//!
//! Sources (engine facts): SGLang 0.5.23 `arg_groups/fields/*.py` and
//! `arg_groups/speculative_hook.py`; llama.cpp `common/arg.cpp` and
//! `tools/server/README.md`. vLLM's command line is in `vllm.rs`.

use serde_json::{Map, Value, json};
use std::collections::BTreeMap;

/// Which engine the stand-in plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavour {
    Sglang,
    Vllm,
    LlamaCpp,
}

/// Fault injection and pacing, from `SPECD_STANDIN_*` env vars, overridden
/// by `--standin-*` flags.
#[derive(Debug, Clone, PartialEq)]
pub struct Knobs {
    /// Port closed (SGLang, vLLM) or `/health` 503 "Loading model"
    /// (llama.cpp) this long. `SPECD_STANDIN_LOAD_MS`, default 300.
    pub load_ms: u64,
    /// SGLang: port open but `/health` 503 (warmup) this long after load.
    /// `SPECD_STANDIN_WARMUP_MS`, default 200.
    pub warmup_ms: u64,
    /// Tokens per second per request. `SPECD_STANDIN_TOKENS_PER_SEC`, default 200.
    pub tokens_per_sec: f64,
    /// Exit with this code right after startup logging. `SPECD_STANDIN_EXIT_CODE`.
    pub exit_code: Option<i32>,
    /// Die during load with the engine's CUDA OOM traceback. `SPECD_STANDIN_CUDA_OOM=1`.
    pub cuda_oom: bool,
    /// Allocate memory during load until killed. `SPECD_STANDIN_MEMORY_HOG=1`.
    pub memory_hog: bool,
    /// Spawn a child that ignores SIGTERM. `SPECD_STANDIN_LINGER_CHILD=1`.
    pub linger_child: bool,
    /// Tokens per verify step (the accept length), instead of the performance model's E(k);
    /// kept within 1..=k+1. `SPECD_STANDIN_ACCEPT_LENGTH`.
    pub accept_length: Option<f64>,
    /// SGLang's shutdown watchdog polls every 5 s (also before it notices
    /// SIGTERM). `SPECD_STANDIN_DRAIN_POLL_MS`, default 5000 as in SGLang.
    pub drain_poll_ms: u64,
    /// vLLM's engine teardown after a drain (`--shutdown-timeout` N > 0), while its HTTP
    /// server still answers (new requests with a 500). `SPECD_STANDIN_TEARDOWN_MS`, default
    /// 2500 (2.4–2.6 s recorded on CPU).
    pub teardown_ms: u64,
    /// An instance started while this file exists removes it and dies of SIGKILL at the first
    /// request after `/health` answered 200: one crash right after readiness.
    /// `SPECD_STANDIN_CRASH_AFTER_READY=/path`.
    pub crash_after_ready: Option<String>,
    /// The performance model (`perf.rs`): the target model's decode rate of one request with
    /// speculation off. Given, requests are paced by the model (verify steps, bursts, prefill,
    /// batch); not given, each token takes 1 / `tokens_per_sec`.
    /// `SPECD_STANDIN_BASE_TOKENS_PER_SEC`.
    pub base_tokens_per_sec: Option<f64>,
    /// Probability that a draft position is accepted, given the ones before it were.
    /// `SPECD_STANDIN_ACCEPT_RATE`, default 0.85.
    pub accept_rate: f64,
    /// Acceptance by draft position, a curve: the probability that position `i` (1-based) is
    /// accepted given the ones before it were, one per position, the last one for every position
    /// after it (`0.9,0.8,0.6`). Unset: `accept_rate` at every position (a geometric curve).
    /// `SPECD_STANDIN_ACCEPT_CURVE`.
    pub accept_curve: Option<Vec<f64>>,
    /// Cost of one draft token, as a fraction of a target forward pass.
    /// `SPECD_STANDIN_DRAFT_COST`, default 0.07.
    pub draft_cost: f64,
    /// Each other running request slows every request's steps by this fraction.
    /// `SPECD_STANDIN_BATCH_SLOWDOWN`, default 0.05.
    pub batch_slowdown: f64,
    /// Prompt tokens per second of the prefill (timed model only).
    /// `SPECD_STANDIN_PREFILL_TOKENS_PER_SEC`, default 8000.
    pub prefill_tokens_per_sec: f64,
    /// The GPU memory holds at most this draft size: a server configured with more dies of
    /// CUDA OOM during load. `SPECD_STANDIN_MAX_DRAFT_TOKENS`.
    pub max_draft_tokens: Option<u32>,
}

impl Default for Knobs {
    fn default() -> Self {
        Knobs {
            load_ms: 300,
            warmup_ms: 200,
            tokens_per_sec: 200.0,
            exit_code: None,
            cuda_oom: false,
            memory_hog: false,
            linger_child: false,
            accept_length: None,
            drain_poll_ms: 5000,
            teardown_ms: 2500,
            crash_after_ready: None,
            base_tokens_per_sec: None,
            accept_rate: 0.85,
            accept_curve: None,
            draft_cost: 0.07,
            batch_slowdown: 0.05,
            prefill_tokens_per_sec: 8000.0,
            max_draft_tokens: None,
        }
    }
}

const KNOBS: &[&str] = &[
    "load-ms",
    "warmup-ms",
    "tokens-per-sec",
    "exit-code",
    "cuda-oom",
    "memory-hog",
    "linger-child",
    "accept-length",
    "drain-poll-ms",
    "teardown-ms",
    "crash-after-ready",
    "base-tokens-per-sec",
    "accept-rate",
    "accept-curve",
    "draft-cost",
    "batch-slowdown",
    "prefill-tokens-per-sec",
    "max-draft-tokens",
];

impl Knobs {
    fn set(&mut self, name: &str, v: &str) -> Result<(), String> {
        let bad = || format!("specd-standin: bad value {v:?} for {name}");
        let flag = |v: &str| matches!(v, "1" | "true" | "yes" | "on" | "");
        match name {
            "load-ms" => self.load_ms = v.parse().map_err(|_| bad())?,
            "warmup-ms" => self.warmup_ms = v.parse().map_err(|_| bad())?,
            "tokens-per-sec" => {
                self.tokens_per_sec = v.parse().map_err(|_| bad())?;
                if self.tokens_per_sec <= 0.0 {
                    return Err(bad());
                }
            }
            "exit-code" => self.exit_code = Some(v.parse().map_err(|_| bad())?),
            "cuda-oom" => self.cuda_oom = flag(v),
            "memory-hog" => self.memory_hog = flag(v),
            "linger-child" => self.linger_child = flag(v),
            "accept-length" => self.accept_length = Some(v.parse().map_err(|_| bad())?),
            "drain-poll-ms" => self.drain_poll_ms = v.parse().map_err(|_| bad())?,
            "teardown-ms" => self.teardown_ms = v.parse().map_err(|_| bad())?,
            "crash-after-ready" => self.crash_after_ready = Some(v.to_string()),
            "base-tokens-per-sec" => {
                let x: f64 = v.parse().map_err(|_| bad())?;
                if !(x > 0.0 && x.is_finite()) {
                    return Err(bad());
                }
                self.base_tokens_per_sec = Some(x);
            }
            "accept-rate" => {
                self.accept_rate = v.parse().map_err(|_| bad())?;
                if !(0.0..=1.0).contains(&self.accept_rate) {
                    return Err(bad());
                }
            }
            "accept-curve" => {
                let c: Vec<f64> =
                    v.split(',').map(|x| x.trim().parse::<f64>()).collect::<Result<_, _>>().map_err(|_| bad())?;
                if c.is_empty() || c.iter().any(|p| !(0.0..=1.0).contains(p)) {
                    return Err(bad());
                }
                self.accept_curve = Some(c);
            }
            "draft-cost" | "batch-slowdown" => {
                let x: f64 = v.parse().map_err(|_| bad())?;
                if !(x >= 0.0 && x.is_finite()) {
                    return Err(bad());
                }
                if name == "draft-cost" { self.draft_cost = x } else { self.batch_slowdown = x }
            }
            "prefill-tokens-per-sec" => {
                self.prefill_tokens_per_sec = v.parse().map_err(|_| bad())?;
                if !(self.prefill_tokens_per_sec > 0.0 && self.prefill_tokens_per_sec.is_finite()) {
                    return Err(bad());
                }
            }
            "max-draft-tokens" => self.max_draft_tokens = Some(v.parse().map_err(|_| bad())?),
            _ => return Err(format!("specd-standin: unknown knob --standin-{name}")),
        }
        Ok(())
    }

    /// Knobs from `SPECD_STANDIN_*` variables of `env`.
    pub fn from_env(env: &BTreeMap<String, String>) -> Result<Knobs, String> {
        let mut k = Knobs::default();
        for name in KNOBS {
            let var = format!("SPECD_STANDIN_{}", name.replace('-', "_").to_uppercase());
            if let Some(v) = env.get(&var) {
                k.set(name, v)?;
            }
        }
        Ok(k)
    }
}

/// A successful parse: what the server reports and how it behaves.
#[derive(Debug, Clone)]
pub struct Launch {
    pub flavour: Flavour,
    /// The resolved server args as the engine reports them (SGLang's
    /// `/get_server_info` keys; vLLM/llama.cpp: their own names).
    pub args: Map<String, Value>,
    /// Warnings the engine logs about its own rewrites.
    pub warnings: Vec<String>,
    pub host: String,
    pub port: u16,
    pub knobs: Knobs,
    /// vLLM: its parsed command line (the namespace its logs print).
    pub vllm: Option<Box<super::vllm::Vllm>>,
}

/// A refused command line: what the engine prints and its exit code.
#[derive(Debug, Clone, PartialEq)]
pub struct Refusal {
    pub code: i32,
    pub stderr: String,
}

/// The value kind of an engine flag.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum K {
    Str,
    Int,
    Float,
    Bool,
}

/// One engine flag the stand-in accepts: its spellings, the key it sets in
/// [`Launch::args`], and its value kind.
pub struct F {
    pub names: &'static [&'static str],
    pub key: &'static str,
    pub k: K,
}

const fn f(names: &'static [&'static str], key: &'static str, k: K) -> F {
    F { names, key, k }
}

enum ParseErr {
    Unknown(String),
    MissingValue(String),
    BadValue(String, K, String),
    BoolWithValue(String),
}

/// The `--standin-*` knob at `argv[*i]` (`--standin-x=v`, `--standin-x v`, or a bare switch);
/// moves `i` past it.
pub(super) fn take_knob(argv: &[String], i: &mut usize, knobs: &mut Knobs) -> Result<(), String> {
    let a = &argv[*i];
    let rest = a.strip_prefix("--standin-").unwrap_or(a);
    *i += 1;
    let (name, v) = match rest.split_once('=') {
        Some((n, v)) => (n.to_string(), v.to_string()),
        None if matches!(rest, "cuda-oom" | "memory-hog" | "linger-child") => (rest.to_string(), "1".into()),
        None => {
            let v = argv.get(*i).cloned().ok_or_else(|| format!("specd-standin: {a} needs a value"))?;
            *i += 1;
            (rest.to_string(), v)
        }
    };
    knobs.set(&name, &v)
}

/// Splits engine flags from `--standin-*` knobs and parses the former with
/// `table`. `--flag=value` and `--flag value` are both accepted where
/// `eq_ok`. Repeated flags: the last wins.
fn parse_flags(
    argv: &[String],
    table: &[F],
    knobs: &mut Knobs,
    eq_ok: bool,
) -> Result<(Map<String, Value>, Vec<String>), ParseErr> {
    let mut out = Map::new();
    let mut pos = Vec::new();
    let mut i = 0;
    while i < argv.len() {
        let a = &argv[i];
        i += 1;
        if let Some(rest) = a.strip_prefix("--standin-") {
            let (name, v) = match rest.split_once('=') {
                Some((n, v)) => (n.to_string(), v.to_string()),
                None if matches!(rest, "cuda-oom" | "memory-hog" | "linger-child") => (rest.to_string(), "1".into()),
                None => {
                    let v = argv.get(i).cloned().ok_or_else(|| ParseErr::MissingValue(a.clone()))?;
                    i += 1;
                    (rest.to_string(), v)
                }
            };
            knobs.set(&name, &v).map_err(|_| ParseErr::BadValue(a.clone(), K::Str, v))?;
            continue;
        }
        if !a.starts_with('-') || a == "-" {
            pos.push(a.clone());
            continue;
        }
        let (name, inline) = match a.split_once('=') {
            Some((n, v)) if eq_ok && n.starts_with("--") => (n.to_string(), Some(v.to_string())),
            _ => (a.clone(), None),
        };
        let def =
            table.iter().find(|d| d.names.contains(&name.as_str())).ok_or_else(|| ParseErr::Unknown(a.clone()))?;
        let v = if def.k == K::Bool {
            if inline.is_some() {
                return Err(ParseErr::BoolWithValue(name));
            }
            Value::Bool(true)
        } else {
            let raw = match inline {
                Some(v) => v,
                None => {
                    let v = argv.get(i).ok_or_else(|| ParseErr::MissingValue(name.clone()))?;
                    // argparse takes a following "-x" as a flag unless it is a number
                    if v.starts_with('-') && v.parse::<f64>().is_err() {
                        return Err(ParseErr::MissingValue(name));
                    }
                    i += 1;
                    v.clone()
                }
            };
            match def.k {
                K::Int => {
                    Value::from(raw.parse::<i64>().map_err(|_| ParseErr::BadValue(name.clone(), K::Int, raw.clone()))?)
                }
                K::Float => {
                    let x = raw.parse::<f64>().map_err(|_| ParseErr::BadValue(name.clone(), K::Float, raw.clone()))?;
                    json!(x)
                }
                _ => Value::String(raw),
            }
        };
        out.insert(def.key.to_string(), v);
    }
    Ok((out, pos))
}

/// Parses `argv` (without the program name): `<flavour> <engine args…>`,
/// with `env` for the knobs.
pub fn parse(argv: &[String], env: &BTreeMap<String, String>) -> Result<Launch, Refusal> {
    let mut knobs = Knobs::from_env(env).map_err(|e| Refusal { code: 2, stderr: e })?;
    let Some(flavour) = argv.first() else {
        return Err(Refusal { code: 2, stderr: "usage: specd-standin sglang|vllm|llama-cpp <engine args>".into() });
    };
    let rest = &argv[1..];
    match flavour.as_str() {
        "sglang" => sglang(rest, &mut knobs),
        "vllm" => super::vllm::parse(rest, env, &mut knobs),
        "llama-cpp" | "llama-server" => llama_cpp(rest, &mut knobs),
        other => Err(Refusal {
            code: 2,
            stderr: format!("specd-standin: unknown flavour {other:?} (sglang, vllm, llama-cpp)"),
        }),
    }
    .map(|mut l| {
        l.knobs = knobs;
        l
    })
}

// ---------------------------------------------------------------- SGLang

pub const SGLANG_FLAGS: &[F] = &[
    f(&["--model-path", "--model"], "model_path", K::Str),
    f(&["--tokenizer-path"], "tokenizer_path", K::Str),
    f(&["--tokenizer-mode"], "tokenizer_mode", K::Str),
    f(&["--skip-tokenizer-init"], "skip_tokenizer_init", K::Bool),
    f(&["--load-format"], "load_format", K::Str),
    f(&["--trust-remote-code"], "trust_remote_code", K::Bool),
    f(&["--context-length"], "context_length", K::Int),
    f(&["--is-embedding"], "is_embedding", K::Bool),
    f(&["--revision"], "revision", K::Str),
    f(&["--dtype"], "dtype", K::Str),
    f(&["--kv-cache-dtype"], "kv_cache_dtype", K::Str),
    f(&["--quantization"], "quantization", K::Str),
    f(&["--served-model-name"], "served_model_name", K::Str),
    f(&["--chat-template"], "chat_template", K::Str),
    f(&["--host"], "host", K::Str),
    f(&["--port"], "port", K::Int),
    f(&["--api-key"], "api_key", K::Str),
    f(&["--mem-fraction-static"], "mem_fraction_static", K::Float),
    f(&["--max-running-requests"], "max_running_requests", K::Int),
    f(&["--max-queued-requests"], "max_queued_requests", K::Int),
    f(&["--max-total-tokens"], "max_total_tokens", K::Int),
    f(&["--chunked-prefill-size"], "chunked_prefill_size", K::Int),
    f(&["--max-prefill-tokens"], "max_prefill_tokens", K::Int),
    f(&["--schedule-policy"], "schedule_policy", K::Str),
    f(&["--schedule-conservativeness"], "schedule_conservativeness", K::Float),
    f(&["--page-size"], "page_size", K::Int),
    f(&["--tp-size", "--tensor-parallel-size"], "tp_size", K::Int),
    f(&["--pp-size", "--pipeline-parallel-size"], "pp_size", K::Int),
    f(&["--dp-size", "--data-parallel-size"], "dp_size", K::Int),
    f(&["--ep-size", "--expert-parallel-size"], "ep_size", K::Int),
    f(&["--stream-interval"], "stream_interval", K::Int),
    f(&["--random-seed"], "random_seed", K::Int),
    f(&["--log-level"], "log_level", K::Str),
    f(&["--log-requests"], "log_requests", K::Bool),
    f(&["--enable-metrics"], "enable_metrics", K::Bool),
    f(&["--attention-backend"], "attention_backend", K::Str),
    f(&["--sampling-backend"], "sampling_backend", K::Str),
    f(&["--disable-cuda-graph"], "disable_cuda_graph", K::Bool),
    f(&["--cuda-graph-max-bs-decode"], "cuda_graph_max_bs_decode", K::Int),
    f(&["--cuda-graph-max-bs-prefill"], "cuda_graph_max_bs_prefill", K::Int),
    f(&["--enable-torch-compile"], "enable_torch_compile", K::Bool),
    f(&["--enable-mixed-chunk"], "enable_mixed_chunk", K::Bool),
    f(&["--enable-dp-attention"], "enable_dp_attention", K::Bool),
    f(&["--disable-radix-cache"], "disable_radix_cache", K::Bool),
    f(&["--disable-overlap-schedule"], "disable_overlap_schedule", K::Bool),
    f(&["--watchdog-timeout"], "watchdog_timeout", K::Float),
    f(&["--download-dir"], "download_dir", K::Str),
    f(&["--base-gpu-id"], "base_gpu_id", K::Int),
    f(&["--nnodes"], "nnodes", K::Int),
    f(&["--node-rank"], "node_rank", K::Int),
    f(&["--dist-init-addr"], "dist_init_addr", K::Str),
    f(&["--reasoning-parser"], "reasoning_parser", K::Str),
    f(&["--tool-call-parser"], "tool_call_parser", K::Str),
    f(&["--skip-server-warmup"], "skip_server_warmup", K::Bool),
    f(&["--device"], "device", K::Str),
    f(&["--incremental-streaming-output"], "incremental_streaming_output", K::Bool),
    f(&["--speculative-algorithm"], "speculative_algorithm", K::Str),
    f(&["--speculative-draft-model-path", "--speculative-draft-model"], "speculative_draft_model_path", K::Str),
    f(&["--speculative-draft-model-revision"], "speculative_draft_model_revision", K::Str),
    f(&["--speculative-num-steps"], "speculative_num_steps", K::Int),
    f(&["--speculative-eagle-topk"], "speculative_eagle_topk", K::Int),
    f(&["--speculative-num-draft-tokens"], "speculative_num_draft_tokens", K::Int),
    f(&["--speculative-accept-threshold-single"], "speculative_accept_threshold_single", K::Float),
    f(&["--speculative-accept-threshold-acc"], "speculative_accept_threshold_acc", K::Float),
    f(&["--speculative-token-map"], "speculative_token_map", K::Str),
    f(&["--speculative-ngram-min-bfs-breadth"], "speculative_ngram_min_bfs_breadth", K::Int),
    f(&["--speculative-ngram-max-bfs-breadth"], "speculative_ngram_max_bfs_breadth", K::Int),
    f(&["--speculative-ngram-match-type"], "speculative_ngram_match_type", K::Str),
    f(&["--speculative-ngram-max-trie-depth"], "speculative_ngram_max_trie_depth", K::Int),
    f(&["--speculative-ngram-capacity"], "speculative_ngram_capacity", K::Int),
];

/// SGLang's argparse defaults of the flags in [`SGLANG_FLAGS`], before resolution.
pub fn sglang_defaults() -> Map<String, Value> {
    let v: Value = serde_json::from_str(
        r#"{
        "model_path": null, "tokenizer_path": null, "tokenizer_mode": "auto", "skip_tokenizer_init": false,
        "load_format": "auto", "trust_remote_code": false, "context_length": null, "is_embedding": false,
        "revision": null, "dtype": "auto", "kv_cache_dtype": "auto", "quantization": null,
        "served_model_name": null, "chat_template": null, "host": "127.0.0.1", "port": 30000, "api_key": null,
        "mem_fraction_static": null, "max_running_requests": null, "max_queued_requests": null,
        "max_total_tokens": null, "chunked_prefill_size": null, "max_prefill_tokens": 16384,
        "schedule_policy": "fcfs", "schedule_conservativeness": 1.0, "page_size": null, "tp_size": 1,
        "pp_size": 1, "dp_size": 1, "ep_size": 1, "stream_interval": 1, "random_seed": null,
        "log_level": "info", "log_requests": false, "enable_metrics": false, "attention_backend": null,
        "sampling_backend": null, "disable_cuda_graph": false, "cuda_graph_max_bs_decode": null,
        "cuda_graph_max_bs_prefill": null,
        "enable_torch_compile": false, "enable_mixed_chunk": false, "enable_dp_attention": false,
        "disable_radix_cache": false, "disable_overlap_schedule": false, "watchdog_timeout": 300,
        "download_dir": null, "base_gpu_id": 0, "nnodes": 1, "node_rank": 0, "dist_init_addr": null,
        "reasoning_parser": null, "tool_call_parser": null, "skip_server_warmup": false, "device": null,
        "incremental_streaming_output": false,
        "speculative_algorithm": null, "speculative_draft_model_path": null,
        "speculative_draft_model_revision": null, "speculative_num_steps": null,
        "speculative_eagle_topk": null, "speculative_num_draft_tokens": null,
        "speculative_accept_threshold_single": 1.0, "speculative_accept_threshold_acc": 1.0,
        "speculative_token_map": null, "speculative_ngram_min_bfs_breadth": 1,
        "speculative_ngram_max_bfs_breadth": 10, "speculative_ngram_match_type": "BFS",
        "speculative_ngram_max_trie_depth": 18, "speculative_ngram_capacity": 10000000
    }"#,
    )
    .expect("valid defaults");
    match v {
        Value::Object(m) => m,
        _ => unreachable!(),
    }
}

const SGLANG_USAGE: &str = "usage: launch_server.py [-h] --model-path MODEL_PATH [--tokenizer-path TOKENIZER_PATH] [--host HOST] [--port PORT] [--tp-size TP_SIZE] [--mem-fraction-static MEM_FRACTION_STATIC] [--max-running-requests MAX_RUNNING_REQUESTS] [--context-length CONTEXT_LENGTH] [--speculative-algorithm SPECULATIVE_ALGORITHM] [--speculative-draft-model-path SPECULATIVE_DRAFT_MODEL_PATH] [--speculative-num-steps SPECULATIVE_NUM_STEPS] [--speculative-eagle-topk SPECULATIVE_EAGLE_TOPK] [--speculative-num-draft-tokens SPECULATIVE_NUM_DRAFT_TOKENS] ...";

fn argparse_error(usage: &str, prog: &str, msg: &str) -> Refusal {
    Refusal { code: 2, stderr: format!("{usage}\n{prog}: error: {msg}\n") }
}

fn argparse_msg(e: ParseErr, table: &[F]) -> String {
    let label = |name: &str| {
        table.iter().find(|d| d.names.contains(&name)).map(|d| d.names.join("/")).unwrap_or_else(|| name.to_string())
    };
    match e {
        ParseErr::Unknown(a) => format!("unrecognized arguments: {a}"),
        ParseErr::MissingValue(n) => format!("argument {}: expected one argument", label(&n)),
        ParseErr::BadValue(n, k, v) => {
            let t = if k == K::Int {
                "int"
            } else if k == K::Float {
                "float"
            } else {
                "str"
            };
            format!("argument {}: invalid {t} value: '{v}'", label(&n))
        }
        ParseErr::BoolWithValue(n) => format!("argument {}: ignored explicit argument", label(&n)),
    }
}

/// A Python exception as `python -m sglang.launch_server` prints it (exit 1).
fn python_traceback(frames: &[(&str, u32, &str, &str)], exc: &str) -> Refusal {
    let mut s = String::from("Traceback (most recent call last):\n");
    s.push_str("  File \"<frozen runpy>\", line 198, in _run_module_as_main\n  File \"<frozen runpy>\", line 88, in _run_code\n");
    for (file, line, func, code) in frames {
        s.push_str(&format!("  File \"{file}\", line {line}, in {func}\n    {code}\n"));
    }
    s.push_str(exc);
    s.push('\n');
    Refusal { code: 1, stderr: s }
}

const SGL: &str = "/usr/local/lib/python3.12/dist-packages/sglang";

fn sglang_value_error(msg: &str) -> Refusal {
    python_traceback(
        &[
            (&format!("{SGL}/launch_server.py"), 32, "<module>", "server_args = prepare_server_args(sys.argv[1:])"),
            (
                &format!("{SGL}/srt/server_args.py"),
                4702,
                "prepare_server_args",
                "return ServerArgs.from_cli_args(raw_args)",
            ),
            (&format!("{SGL}/srt/server_args.py"), 702, "__post_init__", "self._handle_speculative_decoding()"),
            (&format!("{SGL}/srt/arg_groups/speculative_hook.py"), 1178, "_handle_eagle_family", "raise ValueError("),
        ],
        &format!("ValueError: {msg}"),
    )
}

/// `architectures[0]` of `<model>/config.json`, when the model directory
/// exists (the stand-in runs without weights; then it is unknown).
fn model_arch(model: &str) -> Option<String> {
    let text = std::fs::read_to_string(std::path::Path::new(model).join("config.json")).ok()?;
    let v: Value = serde_json::from_str(&text).ok()?;
    v.get("architectures")?.get(0)?.as_str().map(str::to_string)
}

fn sglang(argv: &[String], knobs: &mut Knobs) -> Result<Launch, Refusal> {
    let (given, pos) = parse_flags(argv, SGLANG_FLAGS, knobs, true)
        .map_err(|e| argparse_error(SGLANG_USAGE, "launch_server.py", &argparse_msg(e, SGLANG_FLAGS)))?;
    if !pos.is_empty() {
        return Err(argparse_error(
            SGLANG_USAGE,
            "launch_server.py",
            &format!("unrecognized arguments: {}", pos.join(" ")),
        ));
    }
    if !given.contains_key("model_path") {
        return Err(argparse_error(
            SGLANG_USAGE,
            "launch_server.py",
            "the following arguments are required: --model-path/--model",
        ));
    }
    let mut a = sglang_defaults();
    for (k, v) in given {
        a.insert(k, v);
    }
    let mut warnings = Vec::new();
    let model = a["model_path"].as_str().unwrap_or_default().to_string();
    for k in ["tokenizer_path", "served_model_name"] {
        if a[k].is_null() {
            a.insert(k.into(), json!(model));
        }
    }
    if a["device"].is_null() {
        // Resolved from the platform (CUDA on the machines specd targets).
        a.insert("device".into(), json!("cuda"));
    }
    if a["page_size"].is_null() {
        a.insert("page_size".into(), json!(1));
    }
    if a["random_seed"].is_null() {
        a.insert("random_seed".into(), json!(std::process::id() as i64 % 1_000_000_000));
    }
    if a["chunked_prefill_size"].is_null() {
        a.insert("chunked_prefill_size".into(), json!(8192));
    }
    let tp = a["tp_size"].as_i64().unwrap_or(1);
    if a["mem_fraction_static"].is_null() {
        // SGLang picks it from the GPU and the parallelism; a fixed table here.
        let m = match tp {
            t if t >= 16 => 0.79,
            t if t >= 8 => 0.81,
            t if t >= 4 => 0.85,
            t if t >= 2 => 0.87,
            _ => 0.88,
        };
        a.insert("mem_fraction_static".into(), json!(m));
    }

    if let Some(alg) = a["speculative_algorithm"].as_str().map(str::to_string) {
        let up = alg.to_uppercase();
        // The names SGLang's SpeculativeAlgorithm.from_string accepts, and its aliases, as
        // recorded from its source.
        const RECORDED: &str = include_str!("../../fixtures/engines/sglang/speculative_algorithms.txt");
        let known = RECORDED.lines().filter(|l| !l.starts_with('#')).find_map(|l| match l.split_once(" -> ") {
            Some((alias, to)) => (alias.trim() == up).then(|| to.trim().to_string()),
            None => (l.trim() == up).then(|| up.clone()),
        });
        let Some(up) = known else {
            return Err(sglang_value_error(&format!("Unknown speculative algorithm name: {alg}")));
        };
        a.insert("speculative_algorithm".into(), json!(up));
        let int = |a: &Map<String, Value>, k: &str| a[k].as_i64();
        match up.as_str() {
            "EAGLE" | "EAGLE3" | "STANDALONE" => {
                if a["max_running_requests"].is_null() {
                    a.insert("max_running_requests".into(), json!(48));
                    warnings.push("Max running requests is reset to 48 for speculative decoding. You can override this by explicitly setting --max-running-requests.".into());
                }
                if a["enable_mixed_chunk"] == json!(true) {
                    a.insert("enable_mixed_chunk".into(), json!(false));
                    warnings.push(format!(
                        "Mixed chunked prefill is disabled: {up} speculative decoding does not support it."
                    ));
                }
                if int(&a, "speculative_num_steps").is_none() {
                    if !a["speculative_eagle_topk"].is_null() || !a["speculative_num_draft_tokens"].is_null() {
                        return Err(python_traceback(
                            &[
                                (
                                    &format!("{SGL}/launch_server.py"),
                                    32,
                                    "<module>",
                                    "server_args = prepare_server_args(sys.argv[1:])",
                                ),
                                (
                                    &format!("{SGL}/srt/arg_groups/speculative_hook.py"),
                                    1160,
                                    "_handle_eagle_family",
                                    "assert (",
                                ),
                            ],
                            "AssertionError",
                        ));
                    }
                    let arch = model_arch(&model).unwrap_or_default();
                    let (s, t, d) = if up == "STANDALONE" {
                        (3, 1, 4)
                    } else if matches!(arch.as_str(), "LlamaForCausalLM" | "Grok1ForCausalLM" | "Grok1VForCausalLM") {
                        (5, 4, 8)
                    } else {
                        (3, 1, 4)
                    };
                    a.insert("speculative_num_steps".into(), json!(s));
                    a.insert("speculative_eagle_topk".into(), json!(t));
                    a.insert("speculative_num_draft_tokens".into(), json!(d));
                }
                let topk = int(&a, "speculative_eagle_topk");
                if a["attention_backend"] == json!("trtllm_mha") && topk.unwrap_or(0) > 1 {
                    return Err(sglang_value_error(
                        "trtllm_mha backend only supports topk = 1 for speculative decoding.",
                    ));
                }
                let steps = int(&a, "speculative_num_steps");
                if topk == Some(1) && int(&a, "speculative_num_draft_tokens") != steps.map(|s| s + 1) {
                    warnings.push("speculative_num_draft_tokens is adjusted to speculative_num_steps + 1 when speculative_eagle_topk == 1".into());
                    a.insert("speculative_num_draft_tokens".into(), json!(steps.map(|s| s + 1)));
                }
            }
            "NGRAM" => {
                if a["max_running_requests"].is_null() {
                    a.insert("max_running_requests".into(), json!(48));
                    warnings.push("Max running requests is reset to 48 for speculative decoding. You can override this by explicitly setting --max-running-requests.".into());
                }
                a.insert("enable_mixed_chunk".into(), json!(false));
                warnings
                    .push("The mixed chunked prefill are disabled because of using ngram speculative decoding.".into());
                let topk = a["speculative_ngram_max_bfs_breadth"].clone();
                a.insert("speculative_eagle_topk".into(), topk.clone());
                if a["speculative_num_draft_tokens"].is_null() {
                    a.insert("speculative_num_draft_tokens".into(), json!(12));
                    warnings.push("speculative_num_draft_tokens is set to 12 by default for ngram speculative decoding. You can override this by explicitly setting --speculative-num-draft-tokens.".into());
                }
                if a["speculative_num_steps"].is_null() {
                    let d = a["speculative_num_draft_tokens"].as_i64().unwrap_or(12);
                    let t = topk.as_i64().unwrap_or(1).max(1);
                    a.insert("speculative_num_steps".into(), json!(d / t));
                }
            }
            _ => {}
        }
    }
    let host = a["host"].as_str().unwrap_or("127.0.0.1").to_string();
    let port = port_of(&a["port"])?;
    Ok(Launch { flavour: Flavour::Sglang, args: a, warnings, host, port, knobs: Knobs::default(), vllm: None })
}

fn port_of(v: &Value) -> Result<u16, Refusal> {
    v.as_i64()
        .and_then(|p| u16::try_from(p).ok())
        .filter(|&p| p != 0)
        .ok_or_else(|| Refusal { code: 1, stderr: format!("OverflowError: bind(): port must be 0-65535 (got {v})\n") })
}

// ---------------------------------------------------------------- vLLM: see vllm.rs

// ---------------------------------------------------------------- llama.cpp

pub const LLAMA_FLAGS: &[F] = &[
    f(&["-m", "--model"], "model_path", K::Str),
    f(&["--host"], "host", K::Str),
    f(&["--port"], "port", K::Int),
    f(&["-c", "--ctx-size"], "n_ctx", K::Int),
    f(&["-np", "--parallel"], "n_parallel", K::Int),
    f(&["-ngl", "--gpu-layers", "--n-gpu-layers"], "n_gpu_layers", K::Str),
    f(&["-t", "--threads"], "n_threads", K::Int),
    f(&["-b", "--batch-size"], "n_batch", K::Int),
    f(&["-ub", "--ubatch-size"], "n_ubatch", K::Int),
    f(&["--metrics"], "endpoint_metrics", K::Bool),
    f(&["-a", "--alias"], "alias", K::Str),
    f(&["-fa", "--flash-attn"], "flash_attn", K::Str),
    f(&["--jinja"], "use_jinja", K::Bool),
    f(&["--no-webui"], "no_webui", K::Bool),
    f(&["--api-key"], "api_key", K::Str),
    f(&["-ctk", "--cache-type-k"], "cache_type_k", K::Str),
    f(&["-ctv", "--cache-type-v"], "cache_type_v", K::Str),
    f(&["-lm", "--load-mode"], "load_mode", K::Str),
    f(&["-v", "--verbose"], "verbose", K::Bool),
    f(&["--log-disable"], "log_disable", K::Bool),
    f(&["--chat-template"], "chat_template", K::Str),
    f(&["-n", "--predict", "--n-predict"], "n_predict", K::Int),
    f(&["--seed", "-s"], "seed", K::Int),
    f(&["--cont-batching", "-cb"], "cont_batching", K::Bool),
    f(&["--spec-draft-model", "-md", "--model-draft"], "spec_draft_model", K::Str),
    f(&["--spec-draft-n-max"], "spec_draft_n_max", K::Int),
    f(&["--spec-draft-n-min"], "spec_draft_n_min", K::Int),
    f(&["--spec-draft-p-min", "--draft-p-min"], "spec_draft_p_min", K::Float),
    f(&["--spec-draft-p-split", "--draft-p-split"], "spec_draft_p_split", K::Float),
    f(&["--spec-draft-ngl", "-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft"], "spec_draft_ngl", K::Str),
    f(&["--spec-type"], "spec_type", K::Str),
];

/// Flags llama.cpp has removed: it fails startup naming the replacement.
pub const LLAMA_REMOVED: &[(&[&str], &str)] = &[
    (&["--draft", "--draft-n", "--draft-max"], "use --spec-draft-n-max or --spec-ngram-mod-n-max"),
    (&["--draft-min", "--draft-n-min"], "use --spec-draft-n-min or --spec-ngram-mod-n-min"),
    (
        &["--spec-ngram-size-n", "--spec-ngram-size-m", "--spec-ngram-min-hits"],
        "use the respective --spec-ngram-*-... flags",
    ),
];

fn llama_cpp(argv: &[String], knobs: &mut Knobs) -> Result<Launch, Refusal> {
    for a in argv {
        let name = a.split('=').next().unwrap_or(a);
        if let Some((_, hint)) = LLAMA_REMOVED.iter().find(|(ns, _)| ns.contains(&name)) {
            return Err(Refusal {
                code: 1,
                stderr: format!(
                    "error while handling argument \"{a}\": the argument has been removed. {hint}\n\nusage:\n{a} N\n\nto show complete usage, run with -h\n"
                ),
            });
        }
    }
    // llama.cpp reads `--flag value` only (`--port=1` is an invalid
    // argument), and turns `_` into `-` in `--` flags.
    let argv: Vec<String> =
        argv.iter().map(|a| if a.starts_with("--") { a.replace('_', "-") } else { a.clone() }).collect();
    let (given, pos) = parse_flags(&argv, LLAMA_FLAGS, knobs, false).map_err(|e| {
        let msg = match e {
            ParseErr::Unknown(a) => format!("error: invalid argument: {a}"),
            ParseErr::MissingValue(n) => format!("error while handling argument \"{n}\": expected value for argument"),
            ParseErr::BadValue(n, _, v) => {
                format!("error while handling argument \"{n}\": stoi\n\nusage:\n{n} {v}\n\nto show complete usage, run with -h")
            }
            ParseErr::BoolWithValue(n) => format!("error: invalid argument: {n}"),
        };
        Refusal { code: 1, stderr: format!("{msg}\n") }
    })?;
    if let Some(p) = pos.first() {
        return Err(Refusal { code: 1, stderr: format!("error: invalid argument: {p}\n") });
    }
    if let Some(v) = given.get("n_gpu_layers").and_then(Value::as_str)
        && !(v == "auto" || v == "all" || v.parse::<i64>().is_ok())
    {
        return Err(Refusal {
            code: 1,
            stderr: format!("error while handling argument \"-ngl\": invalid value: {v}\n"),
        });
    }
    const SPEC_TYPES: &[&str] = &[
        "none",
        "draft-simple",
        "draft-eagle3",
        "draft-mtp",
        "draft-dflash",
        "draft-dspark",
        "ngram-simple",
        "ngram-map-k",
        "ngram-map-k4v",
        "ngram-mod",
        "ngram-cache",
    ];
    if let Some(v) = given.get("spec_type").and_then(Value::as_str)
        && let Some(bad) = v.split(',').find(|t| !SPEC_TYPES.contains(&t.trim()))
    {
        return Err(Refusal {
            code: 1,
            stderr: format!("error while handling argument \"--spec-type\": unknown speculative type: {bad}\n"),
        });
    }
    let mut a = Map::new();
    a.insert("model_path".into(), json!(""));
    a.insert("host".into(), json!("127.0.0.1"));
    a.insert("port".into(), json!(8080));
    a.insert("n_ctx".into(), json!(0));
    a.insert("n_parallel".into(), json!(-1));
    a.insert("spec_draft_n_max".into(), json!(3));
    a.insert("spec_draft_n_min".into(), json!(0));
    a.insert("spec_draft_p_min".into(), json!(0.0));
    for (k, v) in given {
        a.insert(k, v);
    }
    if a["model_path"] == json!("") {
        return Err(Refusal { code: 1, stderr: "error: --model is required (or --hf-repo / --model-url)\n".into() });
    }
    let host = a["host"].as_str().unwrap_or("127.0.0.1").to_string();
    let port = port_of(&a["port"])?;
    Ok(Launch {
        flavour: Flavour::LlamaCpp,
        args: a,
        warnings: Vec::new(),
        host,
        port,
        knobs: Knobs::default(),
        vllm: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> Result<Launch, Refusal> {
        parse(&s.split_whitespace().map(String::from).collect::<Vec<_>>(), &BTreeMap::new())
    }

    #[test]
    fn sglang_reports_every_arg_with_defaults() {
        let l = p("sglang --model-path /m --port 31000 --tp-size 4 --mem-fraction-static 0.85").unwrap();
        assert_eq!(l.port, 31000);
        assert_eq!(l.args["tp_size"], json!(4));
        assert_eq!(l.args["mem_fraction_static"], json!(0.85));
        assert_eq!(l.args["speculative_algorithm"], Value::Null);
        assert_eq!(l.args["speculative_num_steps"], Value::Null);
        assert_eq!(l.args["served_model_name"], json!("/m"));
        assert_eq!(l.args["max_running_requests"], Value::Null);
        assert_eq!(l.args["host"], json!("127.0.0.1"));
        let l = p("sglang --model /m").unwrap();
        assert_eq!(l.port, 30000);
        assert_eq!(l.args["tp_size"], json!(1));
    }

    #[test]
    fn sglang_accepts_equals_form_and_last_wins() {
        let l = p("sglang --model-path=/m --port=1234 --port 1235 --trust-remote-code").unwrap();
        assert_eq!(l.port, 1235);
        assert_eq!(l.args["trust_remote_code"], json!(true));
    }

    #[test]
    fn sglang_rejects_like_argparse() {
        let e = p("sglang --model-path /m --no-such-flag").unwrap_err();
        assert_eq!(e.code, 2);
        assert!(e.stderr.contains("launch_server.py: error: unrecognized arguments: --no-such-flag"), "{}", e.stderr);
        let e = p("sglang --port 1").unwrap_err();
        assert!(e.stderr.contains("the following arguments are required: --model-path/--model"));
        let e = p("sglang --model-path /m --port abc").unwrap_err();
        assert!(e.stderr.contains("argument --port: invalid int value: 'abc'"), "{}", e.stderr);
        let e = p("sglang --model-path /m --speculative-num-steps").unwrap_err();
        assert!(e.stderr.contains("argument --speculative-num-steps: expected one argument"), "{}", e.stderr);
        let e = p("sglang --model-path /m stray").unwrap_err();
        assert!(e.stderr.contains("unrecognized arguments: stray"));
        let e = p("sglang --model-path /m --trust-remote-code=1").unwrap_err();
        assert!(e.stderr.contains("ignored explicit argument"));
    }

    #[test]
    fn sglang_nextn_is_reported_as_eagle() {
        let l = p("sglang --model-path /m --speculative-algorithm NEXTN --speculative-num-steps 5 --speculative-eagle-topk 1 --speculative-num-draft-tokens 6").unwrap();
        assert_eq!(l.args["speculative_algorithm"], json!("EAGLE"));
        assert_eq!(l.args["speculative_num_steps"], json!(5));
        assert_eq!(l.args["speculative_num_draft_tokens"], json!(6));
        // max_running_requests unset: reset to 48 with SGLang's warning
        assert_eq!(l.args["max_running_requests"], json!(48));
        assert!(l.warnings.iter().any(|w| w.starts_with("Max running requests is reset to 48")));
        let l = p("sglang --model-path /m --speculative-algorithm nextn --speculative-num-steps 2 --speculative-eagle-topk 1 --speculative-num-draft-tokens 3 --max-running-requests 16").unwrap();
        assert_eq!(l.args["speculative_algorithm"], json!("EAGLE"));
        assert_eq!(l.args["max_running_requests"], json!(16));
    }

    #[test]
    fn sglang_topk_1_forces_draft_tokens_to_steps_plus_one() {
        let l = p("sglang --model-path /m --speculative-algorithm EAGLE --speculative-num-steps 10 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4").unwrap();
        assert_eq!(l.args["speculative_num_draft_tokens"], json!(11));
        assert!(l.warnings.iter().any(|w| w.contains("adjusted to speculative_num_steps + 1")));
        // topk > 1: left alone
        let l = p("sglang --model-path /m --speculative-algorithm EAGLE --speculative-num-steps 5 --speculative-eagle-topk 4 --speculative-num-draft-tokens 8").unwrap();
        assert_eq!(l.args["speculative_num_draft_tokens"], json!(8));
    }

    #[test]
    fn sglang_auto_chooses_params_or_asserts() {
        let l = p("sglang --model-path /m --speculative-algorithm EAGLE").unwrap();
        assert_eq!(
            (
                &l.args["speculative_num_steps"],
                &l.args["speculative_eagle_topk"],
                &l.args["speculative_num_draft_tokens"]
            ),
            (&json!(3), &json!(1), &json!(4))
        );
        let e = p("sglang --model-path /m --speculative-algorithm EAGLE --speculative-eagle-topk 2").unwrap_err();
        assert_eq!(e.code, 1);
        assert!(e.stderr.trim_end().ends_with("AssertionError"), "{}", e.stderr);
    }

    #[test]
    fn sglang_llama_arch_auto_params() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), r#"{"architectures":["LlamaForCausalLM"]}"#).unwrap();
        let l = p(&format!("sglang --model-path {} --speculative-algorithm EAGLE", dir.path().display())).unwrap();
        assert_eq!(l.args["speculative_num_steps"], json!(5));
        assert_eq!(l.args["speculative_eagle_topk"], json!(4));
        assert_eq!(l.args["speculative_num_draft_tokens"], json!(8));
    }

    #[test]
    fn sglang_unknown_algorithm_and_trtllm_topk() {
        let e = p("sglang --model-path /m --speculative-algorithm MEDUSA").unwrap_err();
        assert_eq!(e.code, 1);
        assert!(e.stderr.contains("ValueError: Unknown speculative algorithm name: MEDUSA"), "{}", e.stderr);
        let e = p("sglang --model-path /m --attention-backend trtllm_mha --speculative-algorithm EAGLE --speculative-num-steps 3 --speculative-eagle-topk 2 --speculative-num-draft-tokens 4").unwrap_err();
        assert!(e.stderr.contains("trtllm_mha backend only supports topk = 1"));
    }

    #[test]
    fn sglang_ngram_rewrites() {
        let l = p("sglang --model-path /m --speculative-algorithm NGRAM --speculative-eagle-topk 3").unwrap();
        assert_eq!(l.args["speculative_eagle_topk"], json!(10), "topk is overwritten by max_bfs_breadth");
        assert_eq!(l.args["speculative_num_draft_tokens"], json!(12));
        assert_eq!(l.args["speculative_num_steps"], json!(1));
        assert_eq!(l.args["max_running_requests"], json!(48));
    }

    #[test]
    fn knobs_from_env_and_flags() {
        let mut env = BTreeMap::new();
        env.insert("SPECD_STANDIN_LOAD_MS".to_string(), "1500".to_string());
        env.insert("SPECD_STANDIN_CUDA_OOM".to_string(), "1".to_string());
        env.insert("SPECD_STANDIN_TOKENS_PER_SEC".to_string(), "50".to_string());
        let argv: Vec<String> =
            "sglang --model-path /m --standin-load-ms 20 --standin-exit-code=3 --standin-linger-child"
                .split_whitespace()
                .map(String::from)
                .collect();
        let l = parse(&argv, &env).unwrap();
        assert_eq!(l.knobs.load_ms, 20, "a flag wins over the env var");
        assert!(l.knobs.cuda_oom);
        assert!(l.knobs.linger_child);
        assert_eq!(l.knobs.exit_code, Some(3));
        assert_eq!(l.knobs.tokens_per_sec, 50.0);
        assert_eq!(Knobs::default().tokens_per_sec, 200.0);
    }

    #[test]
    fn llama_cpp_current_and_removed_flags() {
        let l = p("llama-cpp -m /m.gguf --host 127.0.0.1 --port 9000 -c 8192 -np 4 -ngl 99 --spec-draft-model /d.gguf --spec-draft-n-max 8 --spec-draft-n-min 1 --spec-draft-p-min 0.6").unwrap();
        assert_eq!(l.port, 9000);
        assert_eq!(l.args["n_parallel"], json!(4));
        assert_eq!(l.args["spec_draft_n_max"], json!(8));
        assert_eq!(l.args["spec_draft_p_min"], json!(0.6));
        // old aliases that still work
        assert!(p("llama-cpp -m /m --port 9000 -md /d --draft-p-min 0.5 -ngl all").is_ok());
        let e = p("llama-cpp -m /m --port 9000 --draft-max 8").unwrap_err();
        assert_eq!(e.code, 1);
        assert!(e.stderr.contains("error while handling argument \"--draft-max\": the argument has been removed. use --spec-draft-n-max or --spec-ngram-mod-n-max"), "{}", e.stderr);
        let e = p("llama-cpp -m /m --bogus").unwrap_err();
        assert_eq!(e.stderr.trim(), "error: invalid argument: --bogus");
        let e = p("llama-cpp -m /m -ngl lots").unwrap_err();
        assert_eq!(e.code, 1);
    }
}
