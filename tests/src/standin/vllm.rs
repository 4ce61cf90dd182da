//! vLLM 0.32 as the stand-in plays it: `vllm serve`'s command line (the real parser's dests,
//! defaults and order), the `non-default args` and engine-config log lines specd reads from the
//! journal, `SpeculativeConfig`'s checks with pydantic's texts, and the tracebacks of a failed
//! start. The facts are the real vLLM's, recorded in `tests/fixtures/engines/vllm/real/` and
//! checked against the stand-in by `tests/tests/standin_fixtures.rs`.

use super::args::{Knobs, Launch, Refusal};
use super::py::{Py, str_repr};
use serde_json::{Map, Value, json};
use std::collections::BTreeMap;
use std::time::Duration;

/// `vllm --version` without the platform suffix, `/version`, the logo's.
pub const VERSION: &str = "0.32.0";

/// The value kind of a flag, as `vllm serve`'s parser converts it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Kind {
    /// `type=str`.
    Str,
    /// `optional_type(str)`: `""` and `"None"` are `None`.
    OptStr,
    /// `optional_type(str)` with `nargs='+'`: a list.
    OptStrList,
    Int,
    Float,
    /// `human_readable_int`: `2k` = 2000, `2K` = 2048.
    HumanInt,
    /// `human_readable_int_or_auto`: also `-1` and `auto` (-1).
    HumanIntOrAuto,
    /// `optional_type(json.loads)`.
    Json,
    /// `BooleanOptionalAction`: the first name sets `True`, the `--no-` one `False`.
    BoolOpt,
}

/// A flag's default (`vars(parser.parse_args([]))`).
#[derive(Clone, Copy, Debug)]
pub enum Default {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(&'static str),
}

impl Default {
    pub fn py(self) -> Py {
        match self {
            Default::None => Py::None,
            Default::Bool(b) => Py::Bool(b),
            Default::Int(n) => Py::Int(n.into()),
            Default::Float(x) => Py::Float(x),
            Default::Str(s) => Py::str(s),
        }
    }
}

/// One option of `vllm serve` the stand-in accepts.
pub struct Flag {
    pub names: &'static [&'static str],
    pub dest: &'static str,
    pub kind: Kind,
    pub default: Default,
    pub choices: &'static [&'static str],
}

const fn f(names: &'static [&'static str], dest: &'static str, kind: Kind, default: Default) -> Flag {
    Flag { names, dest, kind, default, choices: &[] }
}

const fn c(
    names: &'static [&'static str],
    dest: &'static str,
    default: &'static str,
    choices: &'static [&'static str],
) -> Flag {
    Flag { names, dest, kind: Kind::Str, default: Default::Str(default), choices }
}

/// The positional model: the first dest of the namespace.
pub const MODEL_TAG: &str = "model_tag";

/// The options the stand-in accepts, in the order of their dests in the parser's namespace (the
/// order of the `non-default args` line), after `model_tag`.
pub const FLAGS: &[Flag] = &[
    f(
        &["--enable-auto-tool-choice", "--no-enable-auto-tool-choice"],
        "enable_auto_tool_choice",
        Kind::BoolOpt,
        Default::Bool(false),
    ),
    f(&["--tool-call-parser"], "tool_call_parser", Kind::OptStr, Default::None),
    f(&["--host"], "host", Kind::OptStr, Default::None),
    f(&["--port"], "port", Kind::Int, Default::Int(8000)),
    c(
        &["--uvicorn-log-level"],
        "uvicorn_log_level",
        "info",
        &["critical", "debug", "error", "info", "trace", "warning"],
    ),
    f(
        &["--disable-uvicorn-access-log", "--no-disable-uvicorn-access-log"],
        "disable_uvicorn_access_log",
        Kind::BoolOpt,
        Default::Bool(false),
    ),
    f(&["--api-key"], "api_key", Kind::OptStrList, Default::None),
    f(&["--model"], "model", Kind::Str, Default::Str("Qwen/Qwen3-0.6B")),
    f(&["--trust-remote-code", "--no-trust-remote-code"], "trust_remote_code", Kind::BoolOpt, Default::Bool(false)),
    c(&["--dtype"], "dtype", "auto", &["auto", "bfloat16", "float", "float16", "float32", "half"]),
    f(&["--seed"], "seed", Kind::Int, Default::Int(0)),
    f(&["--max-model-len"], "max_model_len", Kind::HumanIntOrAuto, Default::None),
    f(&["--quantization", "-q"], "quantization", Kind::OptStr, Default::None),
    f(&["--enforce-eager", "--no-enforce-eager"], "enforce_eager", Kind::BoolOpt, Default::Bool(false)),
    f(&["--served-model-name"], "served_model_name", Kind::OptStrList, Default::None),
    c(&["--generation-config"], "generation_config", "auto", &[]),
    f(&["--download-dir"], "download_dir", Kind::OptStr, Default::None),
    c(&["--reasoning-parser"], "reasoning_parser", "", &[]),
    f(&["--pipeline-parallel-size", "-pp"], "pipeline_parallel_size", Kind::Int, Default::Int(1)),
    f(&["--tensor-parallel-size", "-tp"], "tensor_parallel_size", Kind::Int, Default::Int(1)),
    f(&["--data-parallel-size", "-dp"], "data_parallel_size", Kind::Int, Default::Int(1)),
    f(
        &["--gpu-memory-utilization", "--device-memory-utilization"],
        "gpu_memory_utilization",
        Kind::Float,
        Default::Float(0.92),
    ),
    c(
        &["--kv-cache-dtype"],
        "kv_cache_dtype",
        "auto",
        &[
            "auto",
            "bfloat16",
            "float16",
            "fp8",
            "fp8_ds_mla",
            "fp8_e4m3",
            "fp8_e5m2",
            "fp8_inc",
            "fp8_per_token_head",
            "int4_per_token_head",
            "int8_per_token_head",
            "nvfp4",
            "nvfp4_4over6",
            "nvfp4_ds_mla",
            "turboquant_3bit_nc",
            "turboquant_4bit_nc",
            "turboquant_k3v4_nc",
            "turboquant_k8v4",
            "ultraquant_4bit",
        ],
    ),
    f(
        &["--enable-prefix-caching", "--no-enable-prefix-caching"],
        "enable_prefix_caching",
        Kind::BoolOpt,
        Default::None,
    ),
    f(&["--max-num-batched-tokens"], "max_num_batched_tokens", Kind::HumanInt, Default::None),
    f(&["--max-num-seqs"], "max_num_seqs", Kind::Int, Default::None),
    f(&["--speculative-config", "-sc"], "speculative_config", Kind::Json, Default::None),
    f(&["--shutdown-timeout"], "shutdown_timeout", Kind::Int, Default::Int(0)),
];

/// The non-default args line hides these values (`_SENSITIVE_ARG_FIELDS`).
const SENSITIVE: &[&str] = &["api_key", "hf_token", "watermark_config"];

/// What the stand-in serves of a `vllm serve` command line.
#[derive(Clone, Debug)]
pub struct Vllm {
    /// The namespace after parsing and `serve`'s own `args.model = args.model_tag`: `model_tag`
    /// and every dest of [`FLAGS`], in order.
    pub ns: Vec<(&'static str, Py)>,
    /// The speculative config as the engine resolved it, or how `SpeculativeConfig` refused it.
    pub spec: Result<Option<Spec>, Failure>,
    /// `VLLM_LOG_STATS_INTERVAL`: seconds between stats lines (10).
    pub log_stats_interval: Duration,
}

/// A resolved `SpeculativeConfig`.
#[derive(Clone, Debug, PartialEq)]
pub struct Spec {
    pub method: String,
    /// The draft (`None` for the methods without one: its repr says so).
    pub model: Option<String>,
    pub num_speculative_tokens: u32,
    pub prompt_lookup: Option<(i128, i128)>,
    /// Lines logged while it was resolved (a deprecated method name).
    pub warnings: Vec<String>,
}

/// A start that fails after the non-default args line: the traceback's frames and its last lines.
#[derive(Clone, Debug, PartialEq)]
pub struct Failure {
    pub traceback: String,
}

impl Vllm {
    pub fn get(&self, dest: &str) -> &Py {
        self.ns.iter().find(|(d, _)| *d == dest).map(|(_, v)| v).unwrap_or(&Py::None)
    }

    /// The `model_tag` or `--model`.
    pub fn model(&self) -> String {
        self.get("model").as_str().unwrap_or_default().to_string()
    }

    /// The name the server answers to and labels its metrics with: the first served name, else
    /// the model (`get_served_model_name`).
    pub fn served_names(&self) -> Vec<String> {
        match self.get("served_model_name") {
            Py::List(v) if !v.is_empty() => v.iter().map(|x| x.as_str().unwrap_or("None").to_string()).collect(),
            _ => vec![self.model()],
        }
    }

    /// `(dest, value)` of the args that differ from the parser's defaults, in the namespace's order.
    pub fn non_default(&self) -> Vec<(&'static str, Py)> {
        self.ns
            .iter()
            .filter(|(d, v)| !default_of(d).py_eq(v))
            .map(|(d, v)| (*d, if SENSITIVE.contains(d) { Py::str("***") } else { v.clone() }))
            .collect()
    }

    /// The context length: `--max-model-len`, else the model's `max_position_embeddings` (from its
    /// folder's `config.json`, as vLLM reads it), else 32768 (a folder the stand-in cannot read).
    pub fn max_model_len(&self) -> i128 {
        match self.get("max_model_len") {
            Py::Int(n) if *n > 0 => *n,
            _ => std::fs::read_to_string(std::path::Path::new(&self.model()).join("config.json"))
                .ok()
                .and_then(|t| serde_json::from_str::<Value>(&t).ok())
                .and_then(|v| v["max_position_embeddings"].as_i64())
                .map(i128::from)
                .unwrap_or(32768),
        }
    }

    pub fn shutdown_timeout(&self) -> u64 {
        match self.get("shutdown_timeout") {
            Py::Int(n) if *n > 0 => u64::try_from(*n).unwrap_or(u64::MAX),
            _ => 0,
        }
    }
}

fn default_of(dest: &str) -> Py {
    FLAGS.iter().find(|f| f.dest == dest).map(|f| f.default.py()).unwrap_or(Py::None)
}

// ------------------------------------------------------------------------------ command line

const SERVE_USAGE: &str = "usage: vllm serve [model_tag] [options]";
const MAIN_USAGE: &str = "usage: vllm [-h] [-v]\n            {chat,complete,serve,launch,bench,collect-env,download-kernels,preload,run-batch,snapshot}\n            ...";

fn serve_error(msg: &str) -> Refusal {
    Refusal { code: 2, stderr: format!("{SERVE_USAGE}\nvllm serve: error: {msg}\n") }
}

/// argparse's `_negative_number_matcher`: such an argument is a value, not an option.
fn negative_number(a: &str) -> bool {
    let Some(rest) = a.strip_prefix('-') else { return false };
    match rest.split_once('.') {
        None => !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit()),
        Some((i, d)) => i.bytes().all(|b| b.is_ascii_digit()) && !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()),
    }
}

fn is_option(a: &str) -> bool {
    a.starts_with('-') && a != "-" && !negative_number(a)
}

/// `human_readable_int(_or_auto)`; the error is argparse's message after `argument X: `.
fn human_int(v: &str, auto: bool, type_name: &str) -> Result<i128, String> {
    let t = v.trim();
    if auto && (t == "-1" || t.eq_ignore_ascii_case("auto")) {
        return Ok(-1);
    }
    let invalid = || format!("invalid {type_name} value: {}", str_repr(v));
    if let Some(suffix) = t.chars().last().filter(|c| "kKmMgGtT".contains(*c)) {
        let number = &t[..t.len() - 1];
        let well_formed = match number.split_once('.') {
            None => !number.is_empty() && number.bytes().all(|b| b.is_ascii_digit()),
            Some((i, d)) => {
                !i.is_empty()
                    && i.bytes().all(|b| b.is_ascii_digit())
                    && !d.is_empty()
                    && d.bytes().all(|b| b.is_ascii_digit())
            }
        };
        if well_formed {
            let exp = "kmgt".find(suffix.to_ascii_lowercase()).expect("a suffix") as u32 + 1;
            if suffix.is_ascii_lowercase() {
                let x: f64 = number.parse().map_err(|_| invalid())?;
                return Ok((x * 1000f64.powi(exp as i32)) as i128);
            }
            return match number.parse::<i128>() {
                Ok(n) => Ok(n * 1024i128.pow(exp)),
                Err(_) => Err(format!(
                    "Decimals are not allowed with binary suffixes like {suffix}. Did you mean to use {number}{} instead?",
                    suffix.to_ascii_lowercase()
                )),
            };
        }
    }
    python_int(t).ok_or_else(invalid)
}

/// `int(text)` for the usual spellings (sign, digits, underscores between digits).
fn python_int(t: &str) -> Option<i128> {
    let t = t.trim();
    let (neg, digits) = match t.strip_prefix('-') {
        Some(d) => (true, d),
        None => (false, t.strip_prefix('+').unwrap_or(t)),
    };
    if digits.is_empty() || digits.starts_with('_') || digits.ends_with('_') || digits.contains("__") {
        return None;
    }
    let n: i128 = digits.replace('_', "").parse().ok()?;
    Some(if neg { -n } else { n })
}

fn python_float(t: &str) -> Option<f64> {
    let t = t.trim();
    match t.to_ascii_lowercase().trim_start_matches(['+', '-']) {
        "inf" | "infinity" | "nan" => {}
        s if s.contains("inf") || s.contains("nan") => return None,
        _ => {}
    }
    t.replace('_', "").parse().ok()
}

fn label(f: &Flag) -> String {
    f.names.join("/")
}

/// One value of `flag` from its text.
fn convert(flag: &Flag, raw: &str) -> Result<Py, String> {
    let v = match flag.kind {
        Kind::Str => Py::str(raw),
        Kind::OptStr | Kind::OptStrList => {
            if raw.is_empty() || raw == "None" {
                Py::None
            } else {
                Py::str(raw)
            }
        }
        Kind::Int => Py::Int(python_int(raw).ok_or_else(|| format!("invalid int value: {}", str_repr(raw)))?),
        Kind::Float => Py::Float(python_float(raw).ok_or_else(|| format!("invalid float value: {}", str_repr(raw)))?),
        Kind::HumanInt => Py::Int(human_int(raw, false, "human_readable_int")?),
        Kind::HumanIntOrAuto => Py::Int(human_int(raw, true, "human_readable_int_or_auto")?),
        Kind::Json => {
            if raw.is_empty() || raw == "None" {
                Py::None
            } else {
                Py::from_json(raw)
                    .map_err(|_| format!("Value {raw} cannot be converted to <function loads at 0x7f3a2c1d0e00>."))?
            }
        }
        Kind::BoolOpt => unreachable!("a switch has no value"),
    };
    if !flag.choices.is_empty() && !flag.choices.iter().any(|c| v.as_str() == Some(c)) {
        let choices: Vec<String> = flag.choices.iter().map(|c| str_repr(c)).collect();
        return Err(format!("invalid choice: {} (choose from {})", v.repr(), choices.join(", ")));
    }
    Ok(v)
}

/// FlexibleArgumentParser's rewrites: `--model M` moves to the front as the positional model,
/// `_` in an option's name (before `=`) becomes `-`.
fn flexible(argv: &[String]) -> Vec<String> {
    let mut args: Vec<String> = argv.to_vec();
    if let Some(i) = args.iter().position(|a| a == "--model" || (a.starts_with("--model=") && a.len() > 8)) {
        let (tag, end) = match args[i].strip_prefix("--model=") {
            Some(t) => (Some(t.to_string()), i + 1),
            None => (args.get(i + 1).cloned(), i + 2),
        };
        if let Some(tag) = tag {
            let mut moved = vec![tag];
            moved.extend(args[..i].iter().cloned());
            moved.extend(args[end.min(args.len())..].iter().cloned());
            args = moved;
        }
    }
    args.into_iter()
        .map(|a| match a.strip_prefix("--") {
            Some(rest) if !rest.starts_with("standin-") => {
                let (name, value) = match rest.split_once('=') {
                    Some((n, v)) => (n, Some(v)),
                    None => (rest, None),
                };
                let (key, dotted) = match name.split_once('.') {
                    Some((k, d)) => (k.replace('_', "-"), format!(".{d}")),
                    None => (name.replace('_', "-"), String::new()),
                };
                match value {
                    Some(v) => format!("--{key}{dotted}={v}"),
                    None => format!("--{key}{dotted}"),
                }
            }
            _ => a,
        })
        .collect()
}

/// Parses `vllm [serve] …` (without the program name) as `vllm serve` does.
pub fn parse(argv: &[String], env: &BTreeMap<String, String>, knobs: &mut Knobs) -> Result<Launch, Refusal> {
    let argv = match argv.first() {
        Some(s) if s == "serve" => &argv[1..],
        _ => argv,
    };
    let args = flexible(argv);
    let mut given: Vec<(&'static str, Py)> = Vec::new();
    let mut model_tag: Option<String> = None;
    let mut extras: Vec<String> = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let a = &args[i];
        if a.starts_with("--standin-") {
            super::args::take_knob(&args, &mut i, knobs).map_err(|e| Refusal { code: 2, stderr: format!("{e}\n") })?;
            continue;
        }
        i += 1;
        if !is_option(a) {
            if model_tag.is_none() {
                model_tag = Some(a.clone());
            } else {
                extras.push(a.clone());
            }
            continue;
        }
        let (name, inline) = match a.split_once('=') {
            Some((n, v)) => (n, Some(v.to_string())),
            None => (a.as_str(), None),
        };
        let Some(flag) = FLAGS.iter().find(|f| f.names.contains(&name)) else {
            extras.push(a.clone());
            continue;
        };
        let value = match flag.kind {
            Kind::BoolOpt => {
                if let Some(v) = inline {
                    return Err(serve_error(&format!(
                        "argument {}: ignored explicit argument {}",
                        label(flag),
                        str_repr(&v)
                    )));
                }
                Py::Bool(name == flag.names[0])
            }
            Kind::OptStrList => {
                let mut raws = Vec::new();
                if let Some(v) = inline {
                    raws.push(v);
                } else {
                    while i < args.len() && !is_option(&args[i]) {
                        raws.push(args[i].clone());
                        i += 1;
                    }
                }
                if raws.is_empty() {
                    return Err(serve_error(&format!("argument {}: expected at least one argument", label(flag))));
                }
                Py::List(raws.iter().map(|r| convert(flag, r)).collect::<Result<_, _>>().map_err(|e| serve_error(&e))?)
            }
            _ => {
                let raw = match inline {
                    Some(v) => v,
                    None => match args.get(i).filter(|v| !is_option(v)) {
                        Some(v) => {
                            i += 1;
                            v.clone()
                        }
                        None => return Err(serve_error(&format!("argument {}: expected one argument", label(flag)))),
                    },
                };
                convert(flag, &raw).map_err(|e| serve_error(&format!("argument {}: {e}", label(flag))))?
            }
        };
        match given.iter_mut().find(|(d, _)| *d == flag.dest) {
            Some(slot) => slot.1 = value,
            None => given.push((flag.dest, value)),
        }
    }
    if !extras.is_empty() {
        return Err(Refusal {
            code: 2,
            stderr: format!("{MAIN_USAGE}\nvllm: error: unrecognized arguments: {}\n", extras.join(" ")),
        });
    }
    let mut ns: Vec<(&'static str, Py)> = vec![(MODEL_TAG, model_tag.clone().map(Py::Str).unwrap_or(Py::None))];
    for flag in FLAGS {
        let v = given.iter().find(|(d, _)| *d == flag.dest).map(|(_, v)| v.clone()).unwrap_or(flag.default.py());
        ns.push((flag.dest, v));
    }
    // `vllm serve`: the positional model wins over --model.
    if let Some(tag) = model_tag
        && let Some(slot) = ns.iter_mut().find(|(d, _)| *d == "model")
    {
        slot.1 = Py::Str(tag);
    }
    let log_stats_interval = env
        .get("VLLM_LOG_STATS_INTERVAL")
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|x| *x > 0.0 && x.is_finite())
        .unwrap_or(10.0);
    let mut v = Vllm { ns, spec: Ok(None), log_stats_interval: Duration::from_secs_f64(log_stats_interval) };
    v.spec = match v.get("speculative_config").clone() {
        Py::None => Ok(None),
        raw => speculative(&raw, &v.model()).map(Some),
    };
    let host = v.get("host").as_str().unwrap_or("0.0.0.0").to_string();
    let port = match v.get("port") {
        Py::Int(p) => u16::try_from(*p).ok(),
        _ => None,
    }
    .ok_or_else(|| Refusal { code: 1, stderr: "OverflowError: bind(): port must be 0-65535.\n".into() })?;
    let args = launch_args(&v);
    Ok(Launch {
        flavour: super::args::Flavour::Vllm,
        args,
        warnings: Vec::new(),
        host,
        port,
        knobs: Knobs::default(),
        vllm: Some(Box::new(v)),
    })
}

/// The namespace as JSON for the server's handlers, `speculative_config` resolved.
fn launch_args(v: &Vllm) -> Map<String, Value> {
    let mut a: Map<String, Value> = v.ns.iter().map(|(d, x)| (d.to_string(), x.to_json())).collect();
    a.insert(
        "speculative_config".into(),
        match &v.spec {
            Ok(Some(s)) => json!({
                "method": s.method,
                "model": s.model,
                "num_speculative_tokens": s.num_speculative_tokens,
                "prompt_lookup_min": s.prompt_lookup.map(|p| p.0 as i64),
                "prompt_lookup_max": s.prompt_lookup.map(|p| p.1 as i64),
            }),
            _ => Value::Null,
        },
    );
    a
}

// ------------------------------------------------------------------------- SpeculativeConfig

/// `SpeculativeMethod`'s literal values, in the order pydantic lists them.
pub const METHODS: &[&str] = &[
    "ngram",
    "medusa",
    "mlp_speculator",
    "draft_model",
    "suffix",
    "custom_class",
    "eagle",
    "eagle3",
    "extract_hidden_states",
    "deepseek_mtp",
    "dots3_note_mtp",
    "mimo_mtp",
    "mimo_v2_mtp",
    "glm4_moe_mtp",
    "glm4_moe_lite_mtp",
    "glm_ocr_mtp",
    "ernie_mtp",
    "nemotron_h_mtp",
    "exaone_moe_mtp",
    "exaone4_5_mtp",
    "qwen3_next_mtp",
    "qwen4_exp_mtp",
    "qwen3_5_mtp",
    "longcat_flash_mtp",
    "bailing_hybrid_v3_mtp",
    "minimax_m3_mtp",
    "bailing_hybrid_mtp",
    "mtp",
    "kimi_k3_mtp",
    "pangu_ultra_moe_mtp",
    "step3p5_mtp",
    "hy_v3_mtp",
    "hy_v4_mtp",
    "gemma4_mtp",
    "inkling_mtp",
    "glm5_next_mtp",
    "dflash",
    "ngram_gpu",
    "dspark",
];

/// `SpeculativeConfig`'s init fields, in declaration order (pydantic reports errors in it).
const SPEC_FIELDS: &[&str] = &[
    "enforce_eager",
    "num_speculative_tokens",
    "model",
    "method",
    "draft_tensor_parallel_size",
    "tensor_parallel_size",
    "quantization",
    "moe_backend",
    "attention_backend",
    "kv_cache_dtype",
    "max_model_len",
    "revision",
    "code_revision",
    "index_share_for_mtp_iteration",
    "disable_padded_drafter_batch",
    "disable_eagle_block_drop",
    "use_local_argmax_reduction",
    "use_heterogeneous_vocab",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "parallel_drafting",
    "target_model_config",
    "target_parallel_config",
    "num_speculative_tokens_per_batch_size",
    "draft_model_config",
    "draft_parallel_config",
    "suffix_decoding_max_tree_depth",
    "suffix_decoding_max_cached_requests",
    "suffix_decoding_max_spec_factor",
    "suffix_decoding_min_token_prob",
    "draft_load_config",
    "rejection_sample_method",
    "synthetic_acceptance_rates",
    "synthetic_acceptance_length",
    "enable_adaptive_verification",
    "draft_sample_method",
    "dspark_draft_topk",
];

/// Methods whose repr names no draft model.
const NO_DRAFT: &[&str] = &["ngram", "suffix", "extract_hidden_states", "custom_class"];

/// One pydantic error: location, message, type, input.
struct PydErr {
    loc: String,
    msg: String,
    kind: &'static str,
    input: String,
    input_type: String,
}

/// pydantic shows an input's repr cut to its first 25 and last 24 characters when it is longer
/// than 50.
fn pyd_repr(r: &str) -> String {
    let chars: Vec<char> = r.chars().collect();
    if chars.len() <= 50 {
        return r.to_string();
    }
    format!("{}...{}", chars[..25].iter().collect::<String>(), chars[chars.len() - 24..].iter().collect::<String>())
}

impl PydErr {
    fn field(loc: &str, msg: impl Into<String>, kind: &'static str, input: &Py) -> PydErr {
        PydErr {
            loc: loc.to_string(),
            msg: msg.into(),
            kind,
            input: pyd_repr(&input.repr()),
            input_type: input.type_name().to_string(),
        }
    }

    fn text(&self) -> String {
        let head = if self.loc.is_empty() { String::new() } else { format!("{}\n", self.loc) };
        format!(
            "{head}  {} [type={}, input_value={}, input_type={}]\n    For further information visit https://errors.pydantic.dev/2.14/v/{}",
            self.msg, self.kind, self.input, self.input_type, self.kind
        )
    }
}

/// pydantic's lax `int`: ints, bools, integral floats, numeric strings.
fn lax_int(loc: &str, v: &Py, optional: bool) -> Result<Option<i128>, PydErr> {
    match v {
        Py::None if optional => Ok(None),
        Py::Int(n) => Ok(Some(*n)),
        Py::Bool(b) => Ok(Some(i128::from(*b))),
        Py::Float(x) if x.fract() == 0.0 && x.is_finite() => Ok(Some(*x as i128)),
        Py::Float(_) => Err(PydErr::field(
            loc,
            "Input should be a valid integer, got a number with a fractional part",
            "int_from_float",
            v,
        )),
        Py::Str(s) => python_int(s).map(Some).ok_or_else(|| {
            PydErr::field(
                loc,
                "Input should be a valid integer, unable to parse string as an integer",
                "int_parsing",
                v,
            )
        }),
        _ => Err(PydErr::field(loc, "Input should be a valid integer", "int_type", v)),
    }
}

/// `SpeculativeConfig(**speculative_config)` in `create_speculative_config`, with the target model.
pub fn speculative(raw: &Py, target_model: &str) -> Result<Spec, Failure> {
    let Py::Dict(kv) = raw else {
        return Err(Failure {
            traceback: format!(
                "{TB_HEAD}{TB_ENGINE_CONFIG}{TB_SPEC_ITEMS}AttributeError: '{}' object has no attribute 'items'",
                raw.type_name()
            ),
        });
    };
    let kv: Vec<(String, Py)> = kv.iter().map(|(k, v)| (k.replace('-', "_"), v.clone())).collect();
    let get = |k: &str| kv.iter().find(|(k2, _)| k2 == k).map(|(_, v)| v);

    // Field validation, in declaration order; unexpected keywords last.
    let mut errs = Vec::new();
    let mut num: Option<i128> = None;
    let mut ints: BTreeMap<&str, Option<i128>> = BTreeMap::new();
    for &field in SPEC_FIELDS {
        let Some(v) = get(field) else { continue };
        match field {
            "num_speculative_tokens" => match lax_int(field, v, false) {
                Ok(Some(n)) if n <= 0 => {
                    errs.push(PydErr::field(field, "Input should be greater than 0", "greater_than", v))
                }
                Ok(n) => num = n,
                Err(e) => errs.push(e),
            },
            "draft_tensor_parallel_size"
            | "tensor_parallel_size"
            | "max_model_len"
            | "prompt_lookup_max"
            | "prompt_lookup_min"
            | "dspark_draft_topk" => match lax_int(field, v, true) {
                Ok(Some(n)) if n < 1 && field != "tensor_parallel_size" => errs.push(PydErr::field(
                    field,
                    "Input should be greater than or equal to 1",
                    "greater_than_equal",
                    v,
                )),
                Ok(n) => {
                    ints.insert(field, n);
                }
                Err(e) => errs.push(e),
            },
            "model" | "revision" | "code_revision" if !matches!(v, Py::None | Py::Str(_)) => {
                errs.push(PydErr::field(field, "Input should be a valid string", "string_type", v));
            }
            "method" if !matches!(v, Py::None) && !METHODS.iter().any(|m| v.as_str() == Some(m)) => {
                let mut listed: Vec<String> = METHODS.iter().map(|m| str_repr(m)).collect();
                let last = listed.pop().unwrap_or_default();
                errs.push(PydErr::field(
                    field,
                    format!("Input should be {} or {last}", listed.join(", ")),
                    "literal_error",
                    v,
                ));
            }
            _ => {}
        }
    }
    for (k, v) in &kv {
        if !SPEC_FIELDS.contains(&k.as_str()) {
            errs.push(PydErr::field(k, "Unexpected keyword argument", "unexpected_keyword_argument", v));
        }
    }
    if !errs.is_empty() {
        return Err(validation_failure(&errs));
    }

    // __post_init__ and the after-validator; a ValueError there is pydantic's "Value error".
    let value_error = |msg: String| {
        let mut head = String::from("ArgsKwargs((), {");
        for (k, v) in &kv {
            head.push_str(&format!("{}: {}, ", str_repr(k), v.repr()));
        }
        head.push_str("'target_model_config': ModelConfig(");
        let input = format!("{}...very_timeout_sec=120))}})", head.chars().take(25).collect::<String>());
        validation_failure(&[PydErr {
            loc: String::new(),
            msg: format!("Value error, {msg}"),
            kind: "value_error",
            input,
            input_type: "ArgsKwargs".into(),
        }])
    };
    let mut model = get("model").and_then(Py::as_str).map(str::to_string);
    let mut warnings = Vec::new();
    let mut method = match get("method").and_then(Py::as_str) {
        Some(m) => m.to_string(),
        None if model.as_deref().is_some_and(custom_proposer_path) => "custom_class".into(),
        None if matches!(model.as_deref(), Some("ngram" | "[ngram]")) => "ngram".into(),
        None => "draft_model".into(),
    };
    if method.ends_with("_mtp") {
        warnings.push(format!("method `{method}` is deprecated and replaced with mtp."));
        method = "mtp".into();
    }
    if model.is_none() && num.is_some() {
        match method.as_str() {
            "mtp" | "dspark" => model = Some(target_model.to_string()),
            "ngram" | "ngram_gpu" | "suffix" | "extract_hidden_states" => model = Some(method.clone()),
            "custom_class" => {
                return Err(value_error(
                    "method='custom_class' requires 'model' to contain the custom proposer module path (e.g., 'my_module.MyProposer')."
                        .into(),
                ));
            }
            _ => return Err(value_error("num_speculative_tokens was provided but without speculative model.".into())),
        }
    }
    let mut prompt_lookup = None;
    if matches!(method.as_str(), "ngram" | "ngram_gpu") {
        let (lo, hi) = match (
            ints.get("prompt_lookup_min").copied().flatten(),
            ints.get("prompt_lookup_max").copied().flatten(),
        ) {
            (None, None) => (5, 5),
            (Some(a), None) => (a, a),
            (None, Some(b)) => (b, b),
            (Some(a), Some(b)) => (a, b),
        };
        if lo > hi {
            return Err(value_error(format!("prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")));
        }
        prompt_lookup = Some((lo, hi));
    } else if !NO_DRAFT.contains(&method.as_str()) && model.is_some() && num.is_none() {
        // The draft's config would be read here; the stand-in's drafts have no n_predict.
        return Err(value_error(
            "A speculative model was provided, but `num_speculative_tokens` was not provided".into(),
        ));
    }
    if ints.get("tensor_parallel_size").copied().flatten().is_some() {
        return Err(value_error(
            "'tensor_parallel_size' is not a valid argument in the speculative_config. Please pass 'draft_tensor_parallel_size' instead."
                .into(),
        ));
    }
    let Some(num) = num else {
        return Err(value_error(
            "num_speculative_tokens must be provided with speculative model unless the draft model config contains an n_predict parameter."
                .into(),
        ));
    };
    Ok(Spec {
        model: if NO_DRAFT.contains(&method.as_str()) { None } else { model },
        method,
        num_speculative_tokens: u32::try_from(num).unwrap_or(u32::MAX),
        prompt_lookup,
        warnings,
    })
}

/// `_is_custom_proposer_path`: a dotted import path such as `pkg.MyProposer`.
fn custom_proposer_path(m: &str) -> bool {
    let ident = |p: &str| {
        p.chars().next().is_some_and(|c| c.is_alphabetic() || c == '_')
            && p.chars().all(|c| c.is_alphanumeric() || c == '_')
    };
    !m.starts_with("http://") && !m.starts_with("https://") && !m.starts_with("file://") && !m.contains('/') && {
        let parts: Vec<&str> = m.split('.').collect();
        parts.len() >= 2 && parts.iter().all(|p| ident(p))
    }
}

fn validation_failure(errs: &[PydErr]) -> Failure {
    let n = errs.len();
    let body: Vec<String> = errs.iter().map(PydErr::text).collect();
    Failure {
        traceback: format!(
            "{TB_HEAD}{TB_ENGINE_CONFIG}{TB_SPEC_INIT}pydantic_core._pydantic_core.ValidationError: {n} validation error{} for SpeculativeConfig\n{}",
            if n == 1 { "" } else { "s" },
            body.join("\n")
        ),
    }
}

/// The traceback of a failed bind (vLLM binds before it loads the model): a held port is
/// `OSError: [Errno 98] Address already in use`.
pub fn bind_failed(e: &std::io::Error) -> String {
    let text = e.to_string();
    let text = text.split(" (os error").next().unwrap_or(&text);
    format!("{TB_HEAD}{TB_BIND}OSError: [Errno {}] {text}", e.raw_os_error().unwrap_or(0))
}

// The tracebacks' frames, as the real vLLM prints them (installed in /opt/vllm).
pub const TB_HEAD: &str = r#"Traceback (most recent call last):
  File "/opt/vllm/bin/vllm", line 8, in <module>
    sys.exit(main())
             ^^^^^^
  File "/opt/vllm/lib/python3.11/site-packages/vllm/entrypoints/cli/main.py", line 120, in main
    args.dispatch_function(args)
  File "/opt/vllm/lib/python3.11/site-packages/vllm/entrypoints/cli/serve.py", line 156, in cmd
    uvloop.run(run_server(args))
  File "/opt/vllm/lib/python3.11/site-packages/uvloop/__init__.py", line 92, in run
    return runner.run(wrapper())
           ^^^^^^^^^^^^^^^^^^^^^
  File "/usr/lib/python3.11/asyncio/runners.py", line 118, in run
    return self._loop.run_until_complete(task)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "uvloop/loop.pyx", line 1515, in uvloop.loop.Loop.run_until_complete
  File "/opt/vllm/lib/python3.11/site-packages/uvloop/__init__.py", line 48, in wrapper
    return await main
           ^^^^^^^^^^
"#;

const TB_BIND: &str = r#"  File "/opt/vllm/lib/python3.11/site-packages/vllm/entrypoints/launchers/api_server/entry.py", line 176, in run_server
    listen_address, sock = setup_server(args, reuse_port=False)
                           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/opt/vllm/lib/python3.11/site-packages/vllm/tracing/otel.py", line 175, in sync_wrapper
    return func(*args, **kwargs)
           ^^^^^^^^^^^^^^^^^^^^^
  File "/opt/vllm/lib/python3.11/site-packages/vllm/entrypoints/launchers/launcher.py", line 398, in setup_server
    sock = create_server_socket(sock_addr, reuse_port=reuse_port)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/opt/vllm/lib/python3.11/site-packages/vllm/entrypoints/launchers/launcher.py", line 348, in create_server_socket
    sock.bind(addr)
"#;

const TB_ENGINE_CONFIG: &str = r#"  File "/opt/vllm/lib/python3.11/site-packages/vllm/entrypoints/launchers/api_server/entry.py", line 177, in run_server
    await run_server_worker(listen_address, sock, args, **uvicorn_kwargs)
  File "/opt/vllm/lib/python3.11/site-packages/vllm/entrypoints/launchers/api_server/entry.py", line 195, in run_server_worker
    async with build_async_engine_client(
  File "/usr/lib/python3.11/contextlib.py", line 204, in __aenter__
    return await anext(self.gen)
           ^^^^^^^^^^^^^^^^^^^^^
  File "/opt/vllm/lib/python3.11/site-packages/vllm/entrypoints/launchers/api_server/entry.py", line 61, in build_async_engine_client
    async with build_async_engine_client_from_engine_args(
  File "/usr/lib/python3.11/contextlib.py", line 204, in __aenter__
    return await anext(self.gen)
           ^^^^^^^^^^^^^^^^^^^^^
  File "/opt/vllm/lib/python3.11/site-packages/vllm/entrypoints/launchers/api_server/entry.py", line 83, in build_async_engine_client_from_engine_args
    vllm_config = engine_args.create_engine_config(usage_context=usage_context)
                  ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/opt/vllm/lib/python3.11/site-packages/vllm/engine/arg_utils.py", line 2594, in create_engine_config
    speculative_config = self.create_speculative_config(
                         ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
"#;

const TB_SPEC_ITEMS: &str = r#"  File "/opt/vllm/lib/python3.11/site-packages/vllm/engine/arg_utils.py", line 2087, in create_speculative_config
    k.replace("-", "_"): v for k, v in self.speculative_config.items()
                                       ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
"#;

const TB_SPEC_INIT: &str = r#"  File "/opt/vllm/lib/python3.11/site-packages/vllm/engine/arg_utils.py", line 2099, in create_speculative_config
    return SpeculativeConfig(**self.speculative_config)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/opt/vllm/lib/python3.11/site-packages/pydantic/_internal/_dataclasses.py", line 121, in __init__
    s.__pydantic_validator__.validate_python(ArgsKwargs(args, kwargs), self_instance=s)
"#;

// -------------------------------------------------------------------------------- log lines

/// `log_version_and_model`'s message (the monochrome logo: the journal is no terminal).
pub fn logo(model: &str) -> String {
    format!(
        "\n       █     █     █▄   ▄█\n ▄▄ ▄█ █     █     █ ▀▄▀ █  version {VERSION}\n  █▄█▀ █     █     █     █  model   {model}\n   ▀▀  ▀▀▀▀▀ ▀▀▀▀▀ ▀     ▀\n"
    )
}

/// `non-default args: {…}`: the dict repr of [`Vllm::non_default`].
pub fn non_default_args(v: &Vllm) -> String {
    let items: Vec<String> = v.non_default().iter().map(|(k, x)| format!("{}: {}", str_repr(k), x.repr())).collect();
    format!("non-default args: {{{}}}", items.join(", "))
}

/// `SpeculativeConfig.__repr__`.
pub fn spec_repr(s: &Spec) -> String {
    format!(
        "SpeculativeConfig(method={}, model={}, num_spec_tokens={})",
        str_repr(&s.method),
        s.model.as_deref().map(str_repr).unwrap_or_else(|| "None".into()),
        s.num_speculative_tokens
    )
}

/// The engine core's `Initializing a V1 LLM engine (v…) with config: …` (`VllmConfig.__str__`), on
/// a CUDA host. Its fields in the real order up to `pooler_config`; `compilation_config` and
/// `kernel_config`, the last two, depend on the GPU and are left out.
pub fn engine_config(v: &Vllm) -> String {
    let model = v.model();
    let b = |dest: &str| if v.get(dest).py_eq(&Py::Bool(true)) { "True" } else { "False" };
    let int = |dest: &str| v.get(dest).repr();
    let plain = |dest: &str| match v.get(dest) {
        Py::Str(s) => s.clone(),
        other => other.repr(),
    };
    let dtype = match v.get("dtype").as_str().unwrap_or("auto") {
        "float16" | "half" => "torch.float16",
        "float" | "float32" => "torch.float32",
        _ => "torch.bfloat16",
    };
    let spec = match &v.spec {
        Ok(Some(s)) => spec_repr(s),
        _ => "None".into(),
    };
    let prefix_caching = if v.get("enable_prefix_caching").py_eq(&Py::Bool(false)) { "False" } else { "True" };
    let fields = [
        format!("model={}", str_repr(&model)),
        format!("speculative_config={spec}"),
        format!("tokenizer={}", str_repr(&model)),
        "skip_tokenizer_init=False".into(),
        "tokenizer_mode=auto".into(),
        "revision=None".into(),
        "tokenizer_revision=None".into(),
        format!("trust_remote_code={}", b("trust_remote_code")),
        format!("dtype={dtype}"),
        format!("max_seq_len={}", v.max_model_len()),
        format!("download_dir={}", v.get("download_dir").repr()),
        "load_format=auto".into(),
        format!("tensor_parallel_size={}", int("tensor_parallel_size")),
        format!("pipeline_parallel_size={}", int("pipeline_parallel_size")),
        format!("data_parallel_size={}", int("data_parallel_size")),
        "decode_context_parallel_size=1".into(),
        "dcp_comm_backend=ag_rs".into(),
        "disable_custom_all_reduce=False".into(),
        format!("quantization={}", plain("quantization")),
        "quantization_config=None".into(),
        format!("enforce_eager={}", b("enforce_eager")),
        "aux_output_config=AuxOutputConfig(enable_return_routed_experts=False, max_bytes=None)".into(),
        format!("kv_cache_dtype={}", plain("kv_cache_dtype")),
        "device_config=cuda".into(),
        format!(
            "structured_outputs_config=StructuredOutputsConfig(backend='auto', disable_any_whitespace=False, disable_additional_properties=False, reasoning_parser={}, reasoning_parser_plugin='', enable_in_reasoning=False)",
            v.get("reasoning_parser").repr()
        ),
        "observability_config=ObservabilityConfig(show_hidden_metrics_for_version=None, otlp_traces_endpoint=None, collect_detailed_traces=None, per_request_spec_decode_metrics='none', kv_cache_metrics=False, kv_cache_metrics_sample=0.01, custom_histogram_buckets=None, cudagraph_metrics=False, enable_layerwise_nvtx_tracing=False, enable_mfu_metrics=False, enable_mm_processor_stats=False, enable_logging_iteration_details=False, jit_monitor_mode='warn', jit_monitor_verbose=False)".into(),
        format!("seed={}", int("seed")),
        format!("served_model_name={}", v.served_names()[0]),
        format!("enable_prefix_caching={prefix_caching}"),
        "enable_chunked_prefill=True".into(),
        "pooler_config=None".into(),
    ];
    format!("Initializing a V1 LLM engine (v{VERSION}) with config: {}", fields.join(", "))
}

/// One interval's spec-decode counts, for the `SpecDecoding metrics:` line.
pub struct SpecInterval {
    pub drafts: u64,
    pub draft_tokens: u64,
    pub accepted: u64,
    pub per_pos: Vec<u64>,
    pub seconds: f64,
}

/// `SpecDecodingLogging.log`'s line.
pub fn spec_decoding_line(i: &SpecInterval) -> String {
    let per_s = |n: u64| if i.seconds > 0.0 { n as f64 / i.seconds } else { 0.0 };
    let rates: Vec<String> = i.per_pos.iter().map(|n| format!("{:.3}", *n as f64 / i.drafts as f64)).collect();
    let rate = if i.draft_tokens > 0 {
        format!("{:.1}", i.accepted as f64 / i.draft_tokens as f64 * 100.0)
    } else {
        "nan".into()
    };
    format!(
        "SpecDecoding metrics: Mean acceptance length: {:.2}, Accepted throughput: {:.2} tokens/s, Drafted throughput: {:.2} tokens/s, Accepted: {} tokens, Drafted: {} tokens, Per-position acceptance rate: {}, Avg Draft acceptance rate: {rate}%",
        1.0 + i.accepted as f64 / i.drafts as f64,
        per_s(i.accepted),
        per_s(i.draft_tokens),
        i.accepted,
        i.draft_tokens,
        rates.join(", "),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> Result<Launch, Refusal> {
        let argv: Vec<String> = s.split_whitespace().map(String::from).collect();
        parse(&argv, &BTreeMap::new(), &mut Knobs::default())
    }

    fn v(s: &str) -> Vllm {
        *p(s).unwrap().vllm.unwrap()
    }

    #[test]
    fn flexible_rewrites() {
        let a = flexible(&["-tp".into(), "2".into(), "--model".into(), "/m".into(), "--max_model_len=4".into()]);
        assert_eq!(a, ["/m", "-tp", "2", "--max-model-len=4"]);
    }

    #[test]
    fn values_are_converted_as_vllm_does() {
        let x = v("serve /m --max-model-len 2K --max-num-batched-tokens 1.5k --served-model-name a None b");
        assert_eq!(x.get("max_model_len"), &Py::Int(2048));
        assert_eq!(x.get("max_num_batched_tokens"), &Py::Int(1500));
        assert_eq!(x.get("served_model_name"), &Py::List(vec![Py::str("a"), Py::None, Py::str("b")]));
        assert_eq!(v("/m --max-model-len auto").get("max_model_len"), &Py::Int(-1));
        assert_eq!(v("/m --no-enable-prefix-caching").get("enable_prefix_caching"), &Py::Bool(false));
        let e = p("/m --max-model-len 2.5K").unwrap_err();
        assert!(e.stderr.contains("argument --max-model-len: Decimals are not allowed with binary suffixes like K. Did you mean to use 2.5k instead?"), "{}", e.stderr);
        let e = p("/m --dtype fp4").unwrap_err();
        assert!(
            e.stderr.contains("argument --dtype: invalid choice: 'fp4' (choose from 'auto', 'bfloat16',"),
            "{}",
            e.stderr
        );
        let e = p("/m --enforce-eager=1").unwrap_err();
        assert!(e.stderr.contains("argument --enforce-eager/--no-enforce-eager: ignored explicit argument '1'"));
        let e = p("/m --served-model-name --port 1").unwrap_err();
        assert!(e.stderr.contains("argument --served-model-name: expected at least one argument"));
    }

    #[test]
    fn the_model_flag_is_the_positional_model() {
        let x = v("serve --port 8001 --model /m");
        assert_eq!(x.get(MODEL_TAG), &Py::str("/m"));
        assert_eq!(non_default_args(&x), "non-default args: {'model_tag': '/m', 'port': 8001, 'model': '/m'}");
        let e = p("serve /a --model /b").unwrap_err();
        assert!(e.stderr.ends_with("vllm: error: unrecognized arguments: /a\n"), "{}", e.stderr);
    }

    #[test]
    fn non_default_args_are_the_changed_ones_with_secrets_hidden() {
        let x = v("serve /m --port 8000 --tensor-parallel-size 1 --gpu-memory-utilization 0.92 --seed 0 --api-key k1");
        assert_eq!(non_default_args(&x), "non-default args: {'model_tag': '/m', 'api_key': '***', 'model': '/m'}");
        let x = v("serve /it's --enforce-eager --no-trust-remote-code");
        assert_eq!(
            non_default_args(&x),
            r#"non-default args: {'model_tag': "/it's", 'model': "/it's", 'enforce_eager': True}"#
        );
    }

    #[test]
    fn speculative_configs_are_resolved_or_refused_as_vllm_does() {
        let ok = |j: &str| speculative(&Py::from_json(j).unwrap(), "/m");
        let s = ok(r#"{"method":"ngram","num-speculative-tokens":"4"}"#).unwrap();
        assert_eq!((s.num_speculative_tokens, s.prompt_lookup, s.model.clone()), (4, Some((5, 5)), None));
        assert_eq!(spec_repr(&s), "SpeculativeConfig(method='ngram', model=None, num_spec_tokens=4)");
        let s = ok(r#"{"method":"deepseek_mtp","num_speculative_tokens":1}"#).unwrap();
        assert_eq!((s.method.as_str(), s.model.as_deref()), ("mtp", Some("/m")));
        assert_eq!(s.warnings, ["method `deepseek_mtp` is deprecated and replaced with mtp."]);
        let s = ok(r#"{"model":"ngram","num_speculative_tokens":2}"#).unwrap();
        assert_eq!(s.method, "ngram");
        let tail = |j: &str| {
            ok(j)
                .unwrap_err()
                .traceback
                .lines()
                .skip_while(|l| !l.starts_with("pydantic_core"))
                .collect::<Vec<_>>()
                .join("\n")
        };
        assert_eq!(
            tail(r#"{"method":"eagle","num_speculative_tokens":2}"#),
            "pydantic_core._pydantic_core.ValidationError: 1 validation error for SpeculativeConfig\n  Value error, num_speculative_tokens was provided but without speculative model. [type=value_error, input_value=ArgsKwargs((), {'method':...very_timeout_sec=120))}), input_type=ArgsKwargs]\n    For further information visit https://errors.pydantic.dev/2.14/v/value_error"
        );
        let t = tail(r#"{"method":"foo","num_speculative_tokens":-1,"bogus":1,"prompt_lookup_min":0,"model":3}"#);
        let locs: Vec<&str> = t.lines().filter(|l| !l.starts_with(' ')).collect();
        assert_eq!(
            locs,
            [
                "pydantic_core._pydantic_core.ValidationError: 5 validation errors for SpeculativeConfig",
                "num_speculative_tokens",
                "model",
                "method",
                "prompt_lookup_min",
                "bogus"
            ]
        );
        assert!(
            tail(r#"{"method":"ngram","num_speculative_tokens":4.5}"#)
                .contains("[type=int_from_float, input_value=4.5, input_type=float]")
        );
        assert!(
            tail(r#"{"method":"ngram","num_speculative_tokens":null}"#)
                .contains("Input should be a valid integer [type=int_type, input_value=None, input_type=NoneType]")
        );
        let e = ok("[4]").unwrap_err();
        assert!(e.traceback.ends_with("AttributeError: 'list' object has no attribute 'items'"), "{}", e.traceback);
    }

    #[test]
    fn spec_decoding_line_is_vllms() {
        let i = SpecInterval { drafts: 3, draft_tokens: 12, accepted: 12, per_pos: vec![3, 3, 3, 3], seconds: 11.9 };
        assert_eq!(
            spec_decoding_line(&i),
            "SpecDecoding metrics: Mean acceptance length: 5.00, Accepted throughput: 1.01 tokens/s, Drafted throughput: 1.01 tokens/s, Accepted: 12 tokens, Drafted: 12 tokens, Per-position acceptance rate: 1.000, 1.000, 1.000, 1.000, Avg Draft acceptance rate: 100.0%"
        );
    }
}
