//! The `kind: Sweep` document: an operator's benchmarking campaign over spec fields, parsed with
//! located errors like a spec, and expanded into points (one resolved, validated, rendered spec
//! each). No I/O: the caller reads the sweep file and its base spec and passes their text in.
//!
//! ```
//! let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/");
//! let text = std::fs::read_to_string(format!("{root}sweep-qwen-mtp-steps.yaml")).unwrap();
//! let sweep = specd_spec::sweep::parse_sweep(&text, "sweep.yaml").unwrap();
//! let base_text = std::fs::read_to_string(format!("{root}{}", sweep.sweep.spec.base)).unwrap();
//! let base = specd_spec::parse(&sweep.sweep.spec.base, &base_text).unwrap();
//! let points = specd_spec::sweep::points(&sweep, &base).unwrap();
//! assert_eq!(points[0].label, "num_steps=1");
//! // SGLang resets the draft tokens to steps + 1 when topk is 1: derived, not left stale.
//! assert_eq!(points[0].spec.speculative.as_ref().unwrap().num_draft_tokens, Some(2));
//! ```

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use schemars::JsonSchema;
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::ser::{SerializeMap, Serializer};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::diag::{Diagnostic, Diagnostics, Severity, SourceMap};
use crate::model::strict::{self, shown};
use crate::model::{Engine, Merge, Metadata, SpecLayer};
use crate::render::{RenderedUnit, render};
use crate::resolve::Spec;
use crate::{ParsedSpec, clean_message};

/// The `apiVersion` of a sweep: the same as a spec's.
pub const API_VERSION: &str = "specd/v1";
/// The most points one sweep may have (each one is a restart of a real server).
pub const MAX_POINTS: usize = 1024;

/// A sweep file.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(title = "specd Sweep", transform = required_top)]
pub struct Sweep {
    /// Always `specd/v1`.
    #[serde(rename = "apiVersion", default)]
    #[schemars(extend("const" = "specd/v1"))]
    pub api_version: String,
    /// Always `Sweep`.
    #[serde(default)]
    #[schemars(extend("const" = "Sweep"))]
    pub kind: String,
    #[serde(default)]
    pub metadata: Metadata,
    #[serde(default)]
    pub spec: SweepSpec,
}

/// The campaign: which spec, which fields to vary, how to load each point, what is best.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(transform = required_spec)]
pub struct SweepSpec {
    /// The InferenceService spec file swept, relative to the sweep file (or absolute).
    #[serde(default)]
    pub base: String,
    /// The host whose overlay in the base spec applies. Left out: the caller's choice (`specd`
    /// uses the machine it runs on, as `specd apply` does); [`points`] merges the overlay named
    /// here, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// Spec fields by dotted path (`speculative.num_steps`), each with the list of values to
    /// try. The points are the cartesian product, the first field outermost, in the order
    /// written. Fields the engine derives from a swept one are derived the engine's way (SGLang
    /// with `eagle_topk: 1`: `num_draft_tokens` = `num_steps` + 1).
    #[serde(default)]
    pub matrix: Matrix,
    #[serde(default)]
    pub load: Load,
    #[serde(default)]
    pub objective: Objective,
    /// What runs once the sweep ends. Default `restore`.
    #[serde(default)]
    pub after: After,
}

/// The matrix, in the order written.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Matrix(pub Vec<Axis>);

/// One swept field and its values.
#[derive(Clone, Debug, PartialEq)]
pub struct Axis {
    /// Dotted path of a spec field, relative to `spec` (`speculative.num_steps`).
    pub field: String,
    pub values: Vec<Value>,
}

/// The load each point is measured under: every concurrency level in turn.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(transform = required_concurrency)]
pub struct Load {
    /// Concurrent requests, one measurement per level, in this order (e.g. `[1, 16]`).
    #[serde(default, deserialize_with = "levels")]
    pub concurrency: Vec<u32>,
    /// Measured requests per level. Exactly one of `requests` and `duration`.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "strict::u32")]
    pub requests: Option<u32>,
    /// Measuring time per level: whole seconds, minutes or hours (`60s`, `5m`, `1h`).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "duration",
        serialize_with = "duration_text"
    )]
    #[schemars(with = "Option<String>", extend("pattern" = "^[0-9]+(s|m|h)$"))]
    pub duration: Option<Duration>,
    /// Requests per level sent first and not measured. Default 0.
    #[serde(default, deserialize_with = "u32_value")]
    pub warmup: u32,
    /// New tokens asked for per request. Default 256.
    #[serde(default = "default_max_tokens", deserialize_with = "u32_value")]
    pub max_tokens: u32,
    /// `builtin` (a small prompt set written for specd) or the path of a JSONL file with one
    /// `{"prompt": "..."}` per line, relative to the sweep file. Default `builtin`.
    #[serde(default)]
    pub prompts: Prompts,
    /// The endpoint the load is sent to. Default `auto`.
    #[serde(default)]
    pub api: Api,
}

impl Default for Load {
    fn default() -> Self {
        Load {
            concurrency: Vec::new(),
            requests: None,
            duration: None,
            warmup: 0,
            max_tokens: default_max_tokens(),
            prompts: Prompts::Builtin,
            api: Api::Auto,
        }
    }
}

fn default_max_tokens() -> u32 {
    256
}

/// How much load one concurrency level gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Amount {
    Requests(u32),
    Duration(Duration),
}

impl Load {
    /// The measured amount per level. A parsed sweep has exactly one of the two.
    pub fn amount(&self) -> Amount {
        match (self.requests, self.duration) {
            (Some(n), _) => Amount::Requests(n),
            (None, Some(d)) => Amount::Duration(d),
            (None, None) => Amount::Requests(0),
        }
    }
}

/// The prompt set.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Prompts {
    #[default]
    Builtin,
    /// A JSONL file, `{"prompt": "..."}` per line, relative to the sweep file.
    File(String),
}

/// The API the load generator speaks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Api {
    /// SGLang's native `/generate` for SGLang, `/v1/completions` for the others.
    #[default]
    Auto,
    /// SGLang's native `/generate` (streaming).
    Generate,
    /// The OpenAI-compatible `/v1/completions` (streaming), served by all three engines.
    Completions,
}

impl Api {
    /// The API used against an engine: `auto` picks SGLang's native one for SGLang.
    pub fn for_engine(self, engine: Engine) -> Api {
        match (self, engine) {
            (Api::Auto, Engine::Sglang) => Api::Generate,
            (Api::Auto, _) => Api::Completions,
            (a, _) => a,
        }
    }
}

/// What "best" means.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Objective {
    /// Default `throughput`.
    #[serde(default)]
    pub maximize: Metric,
    /// The concurrency level the objective is read at; one of `load.concurrency`. Required when
    /// there are several levels.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "strict::u32")]
    pub at_concurrency: Option<u32>,
    /// Limits a point must meet at that level to be chosen.
    #[serde(default)]
    pub constraints: Constraints,
}

/// A measured quantity to maximize.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    /// Aggregate output tokens per second over all concurrent requests.
    #[default]
    Throughput,
    /// Median output tokens per second of one request.
    TokensPerSPerRequest,
    /// Accepted tokens per verify step, from the engine's own evidence.
    AcceptLength,
}

/// Upper limits on latencies, in milliseconds (more than 0).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Constraints {
    /// Median time to first token.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "strict::f64")]
    pub ttft_p50_ms: Option<f64>,
    /// 99th percentile time to first token.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "strict::f64")]
    pub ttft_p99_ms: Option<f64>,
    /// Median inter-token latency.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "strict::f64")]
    pub itl_p50_ms: Option<f64>,
    /// 99th percentile inter-token latency.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "strict::f64")]
    pub itl_p99_ms: Option<f64>,
}

impl Constraints {
    /// The limits set, by name.
    pub fn limits(&self) -> Vec<(&'static str, f64)> {
        [
            ("ttft_p50_ms", self.ttft_p50_ms),
            ("ttft_p99_ms", self.ttft_p99_ms),
            ("itl_p50_ms", self.itl_p50_ms),
            ("itl_p99_ms", self.itl_p99_ms),
        ]
        .into_iter()
        .filter_map(|(k, v)| v.map(|v| (k, v)))
        .collect()
    }
}

/// What the sweep leaves on the host.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum After {
    /// The unit as it was before the sweep.
    #[default]
    Restore,
    /// The winning point's unit.
    Best,
}

/// A sweep file that parsed and validated, and where each field stands in its text.
#[derive(Clone, Debug)]
pub struct ParsedSweep {
    pub sweep: Sweep,
    map: SourceMap,
}

impl ParsedSweep {
    /// The file name given to [`parse_sweep`].
    pub fn file(&self) -> &str {
        &self.map.file
    }

    /// The base spec's path, given where the sweep file is.
    pub fn base_path(&self, sweep_file: &Path) -> PathBuf {
        relative_to(sweep_file, &self.sweep.spec.base)
    }

    /// The prompt file's path (if the load uses one), given where the sweep file is.
    pub fn prompts_path(&self, sweep_file: &Path) -> Option<PathBuf> {
        match &self.sweep.spec.load.prompts {
            Prompts::Builtin => None,
            Prompts::File(f) => Some(relative_to(sweep_file, f)),
        }
    }

    /// The concurrency level the objective is read at.
    pub fn objective_concurrency(&self) -> u32 {
        let l = &self.sweep.spec.load.concurrency;
        self.sweep.spec.objective.at_concurrency.or_else(|| l.iter().copied().max()).unwrap_or(1)
    }

    /// A diagnostic at one value of the matrix (`axis`, `value` are indexes), for callers that
    /// find a problem with a point later (e.g. a point whose field the running engine rejects).
    pub fn at_value(&self, axis: usize, value: usize, message: String) -> Diagnostic {
        let field = self.sweep.spec.matrix.0.get(axis).map(|a| a.field.as_str()).unwrap_or_default();
        self.map.at_field(Severity::Error, &format!("spec.matrix.{field}[{value}]"), message)
    }
}

fn relative_to(sweep_file: &Path, p: &str) -> PathBuf {
    let p = Path::new(p);
    if p.is_absolute() { p.to_path_buf() } else { sweep_file.parent().unwrap_or(Path::new("")).join(p) }
}

/// Parse and validate one sweep file. `file` is only used in diagnostics. Unknown fields,
/// duplicate keys, wrong types, an empty matrix, a matrix path that is not a spec field, a value of
/// the wrong type for its field, a bad load or objective: each is reported with file, line,
/// column and field path. The base spec is checked by [`points`].
pub fn parse_sweep(text: &str, file: &str) -> Result<ParsedSweep, Diagnostics> {
    let (sweep, map) = crate::parse_located::<Sweep>(file, text, "a sweep")?;
    let out = validate(&sweep, &map);
    if out.is_empty() { Ok(ParsedSweep { sweep, map }) } else { Err(Diagnostics(out)) }
}

/// The JSON Schema of a sweep file, pretty-printed with a trailing newline.
pub fn json_schema() -> String {
    let schema = schemars::schema_for!(Sweep);
    let mut s = serde_json::to_string_pretty(&schema).expect("a schema serializes");
    s.push('\n');
    s
}

pub(crate) fn is_name(v: &str) -> bool {
    !v.is_empty()
        && v.len() <= 63
        && v.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !v.starts_with('-')
        && !v.ends_with('-')
}

/// Every problem of a sweep document, in the order of the file.
fn validate(s: &Sweep, map: &SourceMap) -> Vec<Diagnostic> {
    let mut out = Vec::new();
    header_problems(s, map, &mut out);
    base_problems(&s.spec, map, &mut out);
    matrix_problems(&s.spec.matrix, map, &mut out);
    load_problems(&s.spec.load, map, &mut out);
    objective_problems(&s.spec.objective, &s.spec.load.concurrency, map, &mut out);
    out.sort_by_key(|d| (d.line, d.column));
    out
}

/// `apiVersion`, `kind` and `metadata.name`: present and what a sweep's must be.
fn header_problems(s: &Sweep, map: &SourceMap, out: &mut Vec<Diagnostic>) {
    let mut err = |path: &str, msg: String| out.push(map.at_field(Severity::Error, path, msg));
    if s.api_version.is_empty() {
        err("apiVersion", format!("is required: `apiVersion: {API_VERSION}`"));
    } else if s.api_version != API_VERSION {
        err("apiVersion", format!("must be `{API_VERSION}`, got {}", shown(&s.api_version)));
    }
    if s.kind.is_empty() {
        err("kind", "is required: `kind: Sweep`".into());
    } else if s.kind != "Sweep" {
        err("kind", format!("must be `Sweep`, got {}", shown(&s.kind)));
    }
    if s.metadata.name.is_empty() {
        err("metadata.name", "is required: a name for this sweep, e.g. `qwen-mtp-steps`".into());
    } else if !is_name(&s.metadata.name) {
        err(
            "metadata.name",
            format!(
                "must be 1-63 lowercase letters, digits or `-`, not starting or ending with `-`; got {}",
                shown(&s.metadata.name)
            ),
        );
    }
}

/// `spec.base` is a file path and `spec.host`, when given, a hostname.
fn base_problems(sp: &SweepSpec, map: &SourceMap, out: &mut Vec<Diagnostic>) {
    let mut err = |path: &str, msg: String| out.push(map.at_field(Severity::Error, path, msg));
    if sp.base.is_empty() {
        err("spec.base", "is required: the InferenceService spec file to sweep, relative to this file".into());
    } else if sp.base.chars().any(char::is_control) || sp.base.len() > 4095 {
        err("spec.base", format!("{} is not a file path", shown(&sp.base)));
    }
    if let Some(h) = &sp.host {
        let valid = !h.is_empty()
            && h.len() <= 253
            && h.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'_');
        if !valid {
            err("spec.host", format!("{} is not a hostname (at most 253 letters, digits, `-`, `_` or `.`)", shown(h)));
        }
    }
}

/// `spec.matrix`: at least one axis, each valid ([`axis_problems`]), and not more than
/// [`MAX_POINTS`] points in all.
fn matrix_problems(matrix: &Matrix, map: &SourceMap, out: &mut Vec<Diagnostic>) {
    if matrix.0.is_empty() {
        out.push(map.at_field(
            Severity::Error,
            "spec.matrix",
            "may not be empty: give at least one spec field and its values, e.g. `speculative.num_steps: [1, 2, 4]`"
                .into(),
        ));
    }
    let mut total: usize = 1;
    for axis in &matrix.0 {
        total = total.saturating_mul(axis.values.len().max(1));
        axis_problems(axis, map, out);
    }
    if total > MAX_POINTS {
        out.push(map.at_field(
            Severity::Error,
            "spec.matrix",
            format!("gives {total} points; a sweep may have at most {MAX_POINTS} (each point restarts the server)"),
        ));
    }
}

/// One axis of the matrix: its key names a spec field that may be swept (an error at the key,
/// once), and its values are there, each a scalar or a list, none repeated, each one the field
/// takes (an error at the value).
fn axis_problems(axis: &Axis, map: &SourceMap, out: &mut Vec<Diagnostic>) {
    let key = format!("spec.matrix.{}", axis.field);
    let at_key = |out: &mut Vec<Diagnostic>, msg: String| {
        out.push(map.diag(Severity::Error, map.key_pos(&key).or(map.value_pos("spec.matrix")), &key, msg))
    };
    if let Some(why) = field_problem(&axis.field) {
        at_key(out, why);
        return;
    }
    if axis.values.is_empty() {
        out.push(map.at_field(Severity::Error, &key, "needs at least one value".into()));
        return;
    }
    let mut path_ok = true;
    for (i, v) in axis.values.iter().enumerate() {
        let at = format!("{key}[{i}]");
        if v.is_null() || v.is_object() {
            let what = if v.is_null() { "null (or a non-finite number)" } else { "a map" };
            out.push(map.at_field(
                Severity::Error,
                &at,
                format!("a matrix value is a number, a string, a boolean or a list, got {what}"),
            ));
            continue;
        }
        if let Some(j) = axis.values[..i].iter().position(|w| w == v) {
            out.push(map.at_field(Severity::Error, &at, format!("repeats the value {} of item {j}", show_value(v))));
            continue;
        }
        match set_field(&SpecLayer::default(), &axis.field, v) {
            Ok(_) => {}
            Err(SetError::NoSuchField(m)) => {
                if path_ok {
                    at_key(out, m);
                }
                path_ok = false;
            }
            Err(SetError::Value(m)) => out.push(map.at_field(Severity::Error, &at, m)),
        }
    }
}

/// `spec.load`: concurrency levels (1 to 4096, none repeated), requests or a duration (one of
/// them, not zero), max_tokens, and the prompts' file path.
fn load_problems(l: &Load, map: &SourceMap, out: &mut Vec<Diagnostic>) {
    let mut err = |path: &str, msg: String| out.push(map.at_field(Severity::Error, path, msg));
    if l.concurrency.is_empty() {
        err("spec.load.concurrency", "is required: the concurrency levels to measure, e.g. `[1, 16]`".into());
    }
    for (i, c) in l.concurrency.iter().enumerate() {
        let p = format!("spec.load.concurrency[{i}]");
        if *c == 0 {
            err(&p, "must be at least 1".into());
        } else if *c > 4096 {
            err(&p, format!("is {c}; at most 4096 concurrent requests"));
        } else if l.concurrency[..i].contains(c) {
            err(&p, format!("repeats the level {c}"));
        }
    }
    match (l.requests, l.duration) {
        (Some(_), Some(_)) => err(
            "spec.load.duration",
            "may not be given with `requests`: measure each level by a number of requests or by a duration".into(),
        ),
        (None, None) => err(
            "spec.load.requests",
            "is required (or `duration`): how much to measure at each level, e.g. `requests: 64` or `duration: 60s`"
                .into(),
        ),
        (Some(0), _) => err("spec.load.requests", "must be at least 1".into()),
        (_, Some(d)) if d.is_zero() => err("spec.load.duration", "must be at least 1s".into()),
        _ => {}
    }
    if l.max_tokens == 0 {
        err("spec.load.max_tokens", "must be at least 1".into());
    }
    if let Prompts::File(f) = &l.prompts
        && (f.is_empty() || f.chars().any(char::is_control) || f.len() > 4095)
    {
        err("spec.load.prompts", format!("{} is neither `builtin` nor a file path", shown(f)));
    }
}

/// `spec.objective`: the concurrency it is judged at is one of the load's (required when there
/// are several), and each latency limit is a number of milliseconds above 0.
fn objective_problems(o: &Objective, levels: &[u32], map: &SourceMap, out: &mut Vec<Diagnostic>) {
    let mut err = |path: &str, msg: String| out.push(map.at_field(Severity::Error, path, msg));
    match o.at_concurrency {
        Some(c) if !levels.is_empty() && !levels.contains(&c) => err(
            "spec.objective.at_concurrency",
            format!("is {c}, which is not one of the load's concurrency levels {levels:?}"),
        ),
        None if levels.len() > 1 => err(
            "spec.objective.at_concurrency",
            format!("is required with several concurrency levels: one of {levels:?}"),
        ),
        _ => {}
    }
    for (k, v) in o.constraints.limits() {
        if !(v.is_finite() && v > 0.0) {
            err(
                &format!("spec.objective.constraints.{k}"),
                format!("must be a number of milliseconds above 0, got {v}"),
            );
        }
    }
}

/// Why a matrix key can never name a spec field, if it cannot.
fn field_problem(field: &str) -> Option<String> {
    if field.is_empty() || field.split('.').any(str::is_empty) {
        return Some(format!("{} is not a dotted field path such as `speculative.num_steps`", shown(field)));
    }
    if field == "unit" {
        return Some("the unit may not be swept: every point is the same unit as the base spec".into());
    }
    if field == "engine" {
        return Some("the engine may not be swept: points of different engines are different services".into());
    }
    None
}

enum SetError {
    /// The path is not a field of a spec.
    NoSuchField(String),
    /// The field exists; the value does not fit it.
    Value(String),
}

/// `layer` with the field at `path` (dotted, relative to `spec`) set to `v`.
fn set_field(layer: &SpecLayer, path: &str, v: &Value) -> Result<SpecLayer, SetError> {
    set_raw(layer, path, v).map_err(|m| {
        if m.starts_with("unknown field") {
            let hint = if path.starts_with("spec.") { " (write the path without `spec.`)" } else { "" };
            return SetError::NoSuchField(format!("is not a field of an InferenceService spec: {m}{hint}"));
        }
        // A path that goes on past a value (`server.port.x`): the value got a map.
        let parts: Vec<&str> = path.split('.').collect();
        let empty = Value::Object(Default::default());
        if let Some(p) = (1..parts.len())
            .map(|n| parts[..n].join("."))
            .find(|p| set_raw(&SpecLayer::default(), p, &empty).is_err_and(|e| e.contains("map")))
        {
            return SetError::NoSuchField(format!(
                "is not a field of an InferenceService spec: `{p}` is a value, not a section"
            ));
        }
        SetError::Value(format!("does not fit `{path}`: {m}"))
    })
}

/// [`set_field`] with the deserializer's message as the error.
fn set_raw(layer: &SpecLayer, path: &str, v: &Value) -> Result<SpecLayer, String> {
    let mut json = serde_json::to_value(layer).expect("a spec layer serializes");
    let parts: Vec<&str> = path.split('.').collect();
    let mut cur = &mut json;
    for (i, part) in parts.iter().enumerate() {
        let Value::Object(obj) = cur else {
            return Err("expected a value, got a map".into());
        };
        if i + 1 == parts.len() {
            obj.insert(part.to_string(), v.clone());
            break;
        }
        cur = obj.entry(part.to_string()).or_insert_with(|| Value::Object(Default::default()));
    }
    serde_json::from_value::<SpecLayer>(json).map_err(|e| clean_message(&e.to_string()))
}

/// A value as a label shows it: strings without quotes.
fn show_value(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        v => v.to_string(),
    }
}

/// One point of a sweep: the base spec with one combination of the matrix values.
#[derive(Clone, Debug, PartialEq)]
pub struct Point {
    /// 0-based, in the sweep's order.
    pub index: usize,
    /// Stable and readable: `num_steps=4`, or `num_steps=4,eagle_topk=1` (the last part of each
    /// path; the whole path when two fields end alike).
    pub label: String,
    /// The matrix values of this point: (field path, value), in the matrix's order.
    pub values: Vec<(String, Value)>,
    /// Fields set from the engine's rules rather than the matrix: (field path, value).
    pub derived: Vec<(String, Value)>,
    /// The resolved, validated spec.
    pub spec: Spec,
    /// Its rendered unit (name, text, sha256): the point's identity for resuming.
    pub unit: RenderedUnit,
}

/// Every point of a sweep, in order: the base spec (with the sweep's host overlay) with each
/// combination of matrix values set, dependent fields derived by the engine's rules, validated
/// like any spec and rendered. A point that is not a valid spec is an error located at the
/// matrix value that made it; problems of the base spec itself are reported in the base file.
pub fn points(sweep: &ParsedSweep, base: &ParsedSpec) -> Result<Vec<Point>, Diagnostics> {
    let sp = &sweep.sweep.spec;
    let host = sp.host.as_deref();
    let baseline = base.resolve(host)?;
    let axes = &sp.matrix.0;
    let labels = axis_labels(axes);
    let mut out: Vec<Point> = Vec::new();
    let mut errors = Vec::new();
    let mut idx = vec![0usize; axes.len()];
    let total: usize = axes.iter().map(|a| a.values.len()).product();
    for index in 0..total {
        // Odometer: the last field changes fastest.
        if index > 0 {
            for k in (0..axes.len()).rev() {
                idx[k] += 1;
                if idx[k] < axes[k].values.len() {
                    break;
                }
                idx[k] = 0;
            }
        }
        let values: Vec<(String, Value)> =
            axes.iter().zip(&idx).map(|(a, &i)| (a.field.clone(), a.values[i].clone())).collect();
        let label = values
            .iter()
            .zip(&labels)
            .map(|((_, v), l)| format!("{l}={}", show_value(v)))
            .collect::<Vec<_>>()
            .join(",");
        let at = |axis: usize, message: String| sweep.at_value(axis, idx[axis], format!("point {label}: {message}"));
        match point(base, host, &values) {
            Err((axis, m)) => errors.push(at(axis, m)),
            Ok((doc, derived)) => match crate::validate::resolve(&doc, &base.map, host) {
                Err(ds) => {
                    for d in ds.into_iter().filter(Diagnostic::is_error) {
                        let field = d
                            .path
                            .strip_prefix("spec.")
                            .or_else(|| host.and_then(|h| d.path.strip_prefix(&format!("hosts.{h}."))))
                            .unwrap_or(&d.path);
                        let axis = blame(axes, &derived, field);
                        let e = at(axis, format!("{field}: {}", d.message));
                        if !errors.contains(&e) {
                            errors.push(e);
                        }
                    }
                }
                Ok((spec, _)) => {
                    let unit = render(&spec);
                    if spec.unit != baseline.unit {
                        errors.push(at(0, format!("is unit {}, not the base spec's {}", spec.unit, baseline.unit)));
                    } else if let Some(same) = out.iter().find(|p| p.unit.sha256 == unit.sha256) {
                        errors.push(at(
                            axes.len() - 1,
                            format!(
                                "renders the same unit as point {}: a swept field must change the unit (readiness and policy fields do not)",
                                same.label
                            ),
                        ));
                    } else {
                        out.push(Point { index, label, values, derived, spec, unit });
                    }
                }
            },
        }
    }
    if errors.is_empty() { Ok(out) } else { Err(Diagnostics(errors)) }
}

/// The short names of the axes in labels: the last part of each path, unless two end alike.
fn axis_labels(axes: &[Axis]) -> Vec<String> {
    let last = |f: &str| f.rsplit('.').next().unwrap_or(f).to_string();
    axes.iter()
        .map(|a| {
            let short = last(&a.field);
            if axes.iter().filter(|b| last(&b.field) == short).count() > 1 { a.field.clone() } else { short }
        })
        .collect()
}

/// The axis a point's problem with `field` is blamed on: the axis that sets it, else the axis a
/// derived field came from, else the first.
fn blame(axes: &[Axis], derived: &[(String, Value)], field: &str) -> usize {
    let sets = |f: &str| axes.iter().position(|a| f == a.field || f.starts_with(&format!("{}.", a.field)));
    if let Some(i) = sets(field) {
        return i;
    }
    if derived.iter().any(|(f, _)| f == field)
        && let Some(i) = DERIVED_FROM.iter().find_map(|f| sets(f))
    {
        return i;
    }
    0
}

/// The fields a derived field depends on (SGLang's `num_draft_tokens` rule).
const DERIVED_FROM: &[&str] = &["speculative.num_steps", "speculative.eagle_topk"];

/// A point's document and the fields derived for it.
type PointDoc = (crate::model::Document, Vec<(String, Value)>);

/// The document of one point, and the fields derived for it. `Err((axis, message))`.
fn point(base: &ParsedSpec, host: Option<&str>, values: &[(String, Value)]) -> Result<PointDoc, (usize, String)> {
    let mut doc = base.document.clone();
    // The matrix is set where the host's overlay would win over it: in the overlay, if any.
    let in_overlay = host.is_some_and(|h| doc.hosts.contains_key(h));
    let target: &mut SpecLayer = match host {
        Some(h) if in_overlay => doc.hosts.get_mut(h).expect("checked"),
        _ => &mut doc.spec,
    };
    for (axis, (field, v)) in values.iter().enumerate() {
        *target = set_field(target, field, v).map_err(|e| match e {
            SetError::NoSuchField(m) | SetError::Value(m) => (axis, m),
        })?;
    }
    let mut merged = base.document.spec.clone();
    if in_overlay {
        merged.merge(target);
    } else {
        merged = target.clone();
    }
    let mut derived = Vec::new();
    let swept = |f: &str| values.iter().any(|(p, _)| p == f || f.starts_with(&format!("{p}.")));
    // SGLang (`server_args.py`): with `speculative_eagle_topk == 1` it resets
    // `speculative_num_draft_tokens` to `speculative_num_steps + 1` (with a warning). A sweep over
    // the steps therefore moves the draft tokens with them, as the engine would, unless the
    // matrix sets them itself (then validation says when they disagree).
    if merged.engine == Some(Engine::Sglang)
        && !swept("speculative.num_draft_tokens")
        && let Some(s) = &merged.speculative
        && s.algorithm.as_deref().is_some_and(|a| a != "NGRAM")
        && s.eagle_topk == Some(1)
        && let Some(steps) = s.num_steps
        && let Some(want) = steps.checked_add(1)
        && s.num_draft_tokens != Some(want)
    {
        let v = Value::from(want);
        *target = set_field(target, "speculative.num_draft_tokens", &v).map_err(|e| match e {
            SetError::NoSuchField(m) | SetError::Value(m) => (0, m),
        })?;
        derived.push(("speculative.num_draft_tokens".to_string(), v));
    }
    Ok((doc, derived))
}

// --- (de)serialization helpers -------------------------------------------------------------

impl Serialize for Matrix {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for a in &self.0 {
            m.serialize_entry(&a.field, &a.values)?;
        }
        m.end()
    }
}

impl<'de> Deserialize<'de> for Matrix {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Matrix;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a map of spec field paths to lists of values")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Matrix, A::Error> {
                let mut axes = Vec::new();
                while let Some(field) = m.next_key::<String>()? {
                    let v: Value = m.next_value()?;
                    let Value::Array(values) = v else {
                        return Err(de::Error::custom(format!(
                            "expected a list of values for `{field}`, e.g. `{field}: [1, 2, 4]`"
                        )));
                    };
                    axes.push(Axis { field, values });
                }
                Ok(Matrix(axes))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Matrix, E> {
                Ok(Matrix::default())
            }
        }
        d.deserialize_map(V)
    }
}

impl JsonSchema for Matrix {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Matrix".into()
    }
    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "description": "Spec fields by dotted path (`speculative.num_steps`), each with the list of values to try; the points are the cartesian product in the order written.",
            "type": "object",
            "minProperties": 1,
            "propertyNames": { "pattern": "^[A-Za-z0-9_]+(\\.[A-Za-z0-9_-]+)*$" },
            "additionalProperties": {
                "type": "array",
                "minItems": 1,
                "items": { "type": ["integer", "number", "string", "boolean", "array"] }
            }
        })
    }
}

impl Serialize for Prompts {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Prompts::Builtin => s.serialize_str("builtin"),
            Prompts::File(f) => s.serialize_str(f),
        }
    }
}

impl<'de> Deserialize<'de> for Prompts {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Prompts;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("`builtin` or the path of a JSONL file")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Prompts, E> {
                Ok(if v == "builtin" { Prompts::Builtin } else { Prompts::File(v.to_string()) })
            }
        }
        d.deserialize_str(V)
    }
}

impl JsonSchema for Prompts {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Prompts".into()
    }
    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "description": "`builtin` (a small prompt set written for specd) or the path of a JSONL file with one {\"prompt\": \"...\"} per line, relative to the sweep file.",
            "type": "string",
            "minLength": 1
        })
    }
}

/// A list of concurrency levels, each an integer.
fn levels<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u32>, D::Error> {
    struct Level(u32);
    impl<'de> Deserialize<'de> for Level {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            strict::u32(d)?.map(Level).ok_or_else(|| de::Error::custom("expected an integer, got null"))
        }
    }
    Ok(Vec::<Level>::deserialize(d)?.into_iter().map(|l| l.0).collect())
}

fn u32_value<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    strict::u32(d)?.ok_or_else(|| de::Error::custom("expected an integer, got null"))
}

/// `60s`, `5m`, `1h`.
fn duration<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    duration_of(&Value::deserialize(d)?, "per level")
}

/// A duration as the files write it (`60s`, `5m`, `1h`), at most a week; `null` is `None`.
/// `what` ends the message of a duration over a week (`… is more than a week per level`).
pub(crate) fn duration_of<E: de::Error>(v: &Value, what: &str) -> Result<Option<Duration>, E> {
    let bad = |what: String| {
        E::custom(format!("expected a duration in whole seconds, minutes or hours (`60s`, `5m`, `1h`), got {what}"))
    };
    let s = match v {
        Value::Null => return Ok(None),
        Value::String(s) => s,
        Value::Number(n) => return Err(bad(format!("the number {n} (add a unit: `{n}s`)"))),
        v => return Err(bad(v.to_string())),
    };
    let (num, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let factor = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        _ => return Err(bad(shown(s))),
    };
    let n: u64 = num.parse().map_err(|_| bad(shown(s)))?;
    n.checked_mul(factor)
        .filter(|&secs| secs <= 7 * 86_400)
        .map(|secs| Some(Duration::from_secs(secs)))
        .ok_or_else(|| E::custom(format!("{} is more than a week {what}", shown(s))))
}

fn duration_text<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_str(&format!("{}s", d.as_secs())),
        None => s.serialize_none(),
    }
}

// --- schema: the top-level fields are required (they default to empty when parsing, so that a
// missing one is reported with its path) -------------------------------------------------------

fn required_top(schema: &mut schemars::Schema) {
    required(schema, &["apiVersion", "kind", "metadata", "spec"]);
}

fn required_spec(schema: &mut schemars::Schema) {
    required(schema, &["base", "matrix", "load"]);
}

fn required_concurrency(schema: &mut schemars::Schema) {
    required(schema, &["concurrency"]);
}

fn required(schema: &mut schemars::Schema, names: &[&str]) {
    let obj = schema.ensure_object();
    obj.insert("required".into(), serde_json::json!(names));
    if let Some(props) = obj.get_mut("properties").and_then(|p| p.as_object_mut()) {
        for name in names {
            if let Some(p) = props.get_mut(*name).and_then(|p| p.as_object_mut()) {
                p.remove("default");
            }
        }
    }
}

/// Whether a YAML text is a sweep document (its top-level `kind` is `Sweep`), so that a caller
/// given a file of either kind knows which parser to use. Text that is not YAML is not a sweep.
pub fn is_sweep(text: &str) -> bool {
    crate::kind_of(text).as_deref() == Some("Sweep")
}

/// Every problem of one sweep file on its own (the base spec is not read: see [`points`]).
pub fn check(text: &str, file: &str) -> Diagnostics {
    match parse_sweep(text, file) {
        Ok(_) => Diagnostics::default(),
        Err(d) => d,
    }
}
