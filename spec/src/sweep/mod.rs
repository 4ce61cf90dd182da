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

mod check;
mod points;

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
use crate::model::{Engine, Metadata};
use check::{required_concurrency, required_spec, required_top, validate};
pub use points::{Point, points};

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
