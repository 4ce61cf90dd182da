//! The `kind: Fleet` document and the promotion record: how a revision of the repository rolls
//! out across many hosts. Parsed with located errors like a spec; no I/O.
//!
//! A fleet file (`fleet.yaml` beside the specs) lists waves in order. Each wave selects hosts by
//! name, glob or the labels an agent declares, and says how many of them may be unavailable at
//! once and how long they must stay good (the bake) before the next wave starts. The gates say
//! what "good" means: the engine runs the spec with its args verified, speculation proven at an
//! accept length not below a floor, a start not slower than a ceiling, no death.
//!
//! The promotion record (`promotions.yaml` on the record branch) is what `specd promote` writes
//! and every agent reads: the revision each wave's hosts run. It is the only writer's.
//!
//! ```
//! let text = "apiVersion: specd/v1\nkind: Fleet\nmetadata: {name: gpus}\nspec:\n  waves:\n    - {name: canary, hosts: [gpu-01], bake: 10m}\n    - {name: rest, hosts: ['gpu-*'], max_unavailable: 2, bake: 30m}\n";
//! let fleet = specd_spec::fleet::parse_fleet(text, "fleet.yaml").unwrap();
//! let no_labels = Default::default();
//! assert_eq!(fleet.wave_of("gpu-01", &no_labels), Some(0));
//! assert_eq!(fleet.wave_of("gpu-07", &no_labels), Some(1));
//! assert_eq!(fleet.wave_of("cpu-01", &no_labels), None);
//! ```

use std::collections::BTreeMap;
use std::time::Duration;

use schemars::JsonSchema;
use serde::de::{self, Deserializer};
use serde::{Deserialize, Serialize, Serializer};
use serde_json::Value;

use crate::diag::{Diagnostic, Diagnostics, Severity, SourceMap};
use crate::model::Metadata;
use crate::model::strict::shown;

/// The fleet file's name, in the directory of the specs (or beside the one spec file).
pub const FILE_NAME: &str = "fleet.yaml";
/// The promotion record's file name on the record branch.
pub const RECORD_FILE: &str = "promotions.yaml";
/// The record branch when the fleet file names none.
pub const DEFAULT_RECORD_BRANCH: &str = "specd-promotions";
/// The most waves a fleet may have.
pub const MAX_WAVES: usize = 64;

/// A fleet file.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(title = "specd Fleet")]
pub struct Fleet {
    /// Always `specd/v1`.
    #[serde(rename = "apiVersion", default)]
    #[schemars(extend("const" = "specd/v1"))]
    pub api_version: String,
    /// Always `Fleet`.
    #[serde(default)]
    #[schemars(extend("const" = "Fleet"))]
    pub kind: String,
    #[serde(default)]
    pub metadata: Metadata,
    #[serde(default)]
    pub spec: FleetSpec,
}

/// The rollout: waves in order, the gates every host of a wave must pass.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FleetSpec {
    /// The branch holding the promotion record (default `specd-promotions`). Agents read it;
    /// only `specd promote` and `specd fleet halt|resume` write it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub record_branch: Option<String>,
    /// The waves, in the order a revision reaches them. A host belongs to the first wave that
    /// selects it; a host no wave selects takes a revision once every wave has passed.
    #[serde(default)]
    pub waves: Vec<Wave>,
    #[serde(default)]
    pub gates: Gates,
}

/// One wave of hosts.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Wave {
    /// A name for the wave: lowercase letters, digits and `-`.
    #[serde(default)]
    pub name: String,
    /// Host names or patterns (`*`, `?`): the agent's `hostname`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hosts: Vec<String>,
    /// Labels a host's agent declares (`labels:` in its config); a host must carry every one.
    /// With `hosts` too, a host must match both.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// How many hosts of the wave may be unavailable at once (updating, failing a gate, or
    /// unreachable); the promoter gives the new revision to at most this many at a time.
    /// Default 1.
    #[serde(default = "one", deserialize_with = "count")]
    #[schemars(range(min = 1))]
    pub max_unavailable: u32,
    /// How long every host of the wave must stay good on the new revision before the next wave
    /// starts (`30s`, `10m`, `2h`).
    #[serde(default, deserialize_with = "duration", serialize_with = "duration_text")]
    #[schemars(with = "String")]
    pub bake: Duration,
}

fn one() -> u32 {
    1
}

/// What a host must show, on the new revision, for its wave to pass.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Gates {
    /// Every unit runs the unit specd renders for the host from the new revision, with the
    /// server's own reported args matching the spec. Default true.
    #[serde(default = "yes")]
    pub args_verified: bool,
    /// A unit whose spec speculates must have its speculation proven (an accept length
    /// measured by specd on the running server). Default true.
    #[serde(default = "yes")]
    pub speculation_proven: bool,
    /// Floors on the accept length a speculating unit reaches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accept_length: Option<Floor>,
    /// Floors on the accept rate (0..1) a speculating unit reaches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accept_rate: Option<Floor>,
    /// A ceiling on how long a unit's start takes on the new revision: from specd's start of
    /// the unit to its server's first ready answer, as the host's agent measured it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub startup_within: Option<Ceiling>,
    /// Speculation still pays: at the load the host serves, a speculating unit's accept length
    /// and decode speed per request (its engine's own counts since the instance started, which
    /// the agent exports with `tune:` in its config) are not below `of_previous` of what the
    /// previous revision's instance served on the same host. Off unless given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speculation_pays: Option<Pays>,
    /// No death of a server (crash, OOM, CUDA OOM…) from its promotion to the end of the bake.
    /// Default true.
    #[serde(default = "yes")]
    pub no_deaths: bool,
    /// How long a promoted host may take to run the new revision before it counts as failed
    /// (default `30m`): a model load can take minutes.
    #[serde(default = "converge_default", deserialize_with = "duration", serialize_with = "duration_text")]
    #[schemars(with = "String")]
    pub converge_within: Duration,
}

impl Default for Gates {
    fn default() -> Self {
        Gates {
            args_verified: true,
            speculation_proven: true,
            accept_length: None,
            accept_rate: None,
            startup_within: None,
            speculation_pays: None,
            no_deaths: true,
            converge_within: converge_default(),
        }
    }
}

fn yes() -> bool {
    true
}

fn converge_default() -> Duration {
    Duration::from_secs(30 * 60)
}

/// A floor: an absolute minimum, and/or a fraction of what the previous revision measured on
/// the same host and unit.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Floor {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min: Option<f64>,
    /// E.g. `0.8`: not below 80 % of the previous revision's figure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub of_previous: Option<f64>,
}

impl Floor {
    /// Why `now` is below this floor, if it is (`previous`: the previous revision's figure).
    pub fn below(&self, now: f64, previous: Option<f64>) -> Option<String> {
        if let Some(min) = self.min
            && now < min
        {
            return Some(format!("{now:.3} < min {min}"));
        }
        if let (Some(f), Some(p)) = (self.of_previous, previous)
            && now < f * p
        {
            return Some(format!("{now:.3} < {f} × {p:.3} (the previous revision's)"));
        }
        None
    }
}

/// The gate `speculation_pays`: the new revision's served figures against the previous one's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Pays {
    /// E.g. `0.95`: neither figure below 95 % of the previous revision's.
    pub of_previous: f64,
    /// The drafts the new instance's figures must rest on before they are judged (default
    /// 200): until then the host is not good yet (and fails after `converge_within`).
    #[serde(default = "pays_min_drafts")]
    pub min_drafts: u64,
}

fn pays_min_drafts() -> u64 {
    200
}

impl Pays {
    /// Why speculation no longer pays, if it does not: `now` and `previous` are each
    /// `(accept length, decode tokens per second of one request)`.
    pub fn below(&self, now: (f64, f64), previous: (f64, f64)) -> Option<String> {
        let f = self.of_previous;
        if now.0 < f * previous.0 {
            return Some(format!(
                "accept length {:.3} < {f} × {:.3} (the previous revision's, at the load it served)",
                now.0, previous.0
            ));
        }
        if now.1 < f * previous.1 {
            return Some(format!(
                "decode speed {:.1} tok/s per request < {f} × {:.1} (the previous revision's, at the load it served)",
                now.1, previous.1
            ));
        }
        None
    }
}

/// A ceiling: an absolute most, and/or a multiple of what the previous revision measured on the
/// same host and unit.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Ceiling {
    /// E.g. `10m`: no start longer than that.
    #[serde(
        default,
        deserialize_with = "opt_duration",
        serialize_with = "opt_duration_text",
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(with = "Option<String>")]
    pub max: Option<Duration>,
    /// E.g. `1.5`: no start longer than 1.5 × the previous revision's (at least 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub of_previous: Option<f64>,
}

impl Ceiling {
    /// Why `now` (seconds) is above this ceiling, if it is (`previous`: the previous revision's
    /// figure).
    pub fn above(&self, now: f64, previous: Option<f64>) -> Option<String> {
        if let Some(max) = self.max
            && now > max.as_secs_f64()
        {
            return Some(format!("{now:.1}s > max {}s", max.as_secs()));
        }
        if let (Some(f), Some(p)) = (self.of_previous, previous)
            && now > f * p
        {
            return Some(format!("{now:.1}s > {f} × {p:.1}s (the previous revision's)"));
        }
        None
    }
}

/// A fleet file that parsed and validated.
#[derive(Clone, Debug)]
pub struct ParsedFleet {
    pub fleet: Fleet,
    map: SourceMap,
}

impl ParsedFleet {
    pub fn file(&self) -> &str {
        &self.map.file
    }

    pub fn waves(&self) -> &[Wave] {
        &self.fleet.spec.waves
    }

    pub fn gates(&self) -> &Gates {
        &self.fleet.spec.gates
    }

    pub fn record_branch(&self) -> &str {
        self.fleet.spec.record_branch.as_deref().unwrap_or(DEFAULT_RECORD_BRANCH)
    }

    /// The index of the first wave that selects a host of this name and these labels.
    pub fn wave_of(&self, host: &str, labels: &BTreeMap<String, String>) -> Option<usize> {
        self.waves().iter().position(|w| w.selects(host, labels))
    }
}

impl Wave {
    /// Whether this wave selects the host (by itself, before earlier waves take theirs).
    pub fn selects(&self, host: &str, labels: &BTreeMap<String, String>) -> bool {
        let by_name = self.hosts.is_empty() || self.hosts.iter().any(|p| crate::glob_match(p, host));
        let by_labels = self.labels.iter().all(|(k, v)| labels.get(k) == Some(v));
        by_name && by_labels
    }

    /// The hosts this wave names literally (no pattern): they are members even when unseen.
    pub fn named_hosts(&self) -> impl Iterator<Item = &str> {
        self.hosts.iter().filter(|h| !h.contains(['*', '?'])).map(String::as_str)
    }
}

/// Whether a YAML text is a fleet document (its top-level `kind` is `Fleet`).
pub fn is_fleet(text: &str) -> bool {
    crate::kind_of(text).as_deref() == Some("Fleet")
}

/// Parse and validate a fleet file. Every problem is reported with file, line, column and
/// field path.
pub fn parse_fleet(text: &str, file: &str) -> Result<ParsedFleet, Diagnostics> {
    let (fleet, map) = crate::parse_located::<Fleet>(file, text, "a fleet file")?;
    let out = validate(&fleet, &map);
    if out.is_empty() { Ok(ParsedFleet { fleet, map }) } else { Err(Diagnostics(out)) }
}

/// Every problem of a fleet file.
pub fn check(text: &str, file: &str) -> Diagnostics {
    parse_fleet(text, file).err().unwrap_or_default()
}

/// The JSON Schema of a fleet file, pretty-printed with a trailing newline.
pub fn json_schema() -> String {
    let mut s = serde_json::to_string_pretty(&schemars::schema_for!(Fleet)).expect("a schema serializes");
    s.push('\n');
    s
}

fn validate(f: &Fleet, map: &SourceMap) -> Vec<Diagnostic> {
    let mut out = Vec::new();
    let mut err = |path: &str, msg: String| out.push(map.at_field(Severity::Error, path, msg));
    if f.api_version != crate::sweep::API_VERSION {
        err("apiVersion", format!("must be `{}`, got {}", crate::sweep::API_VERSION, shown(&f.api_version)));
    }
    if f.kind != "Fleet" {
        err("kind", format!("must be `Fleet`, got {}", shown(&f.kind)));
    }
    if let Some(b) = &f.spec.record_branch
        && !is_branch_name(b)
    {
        err("spec.record_branch", format!("is not a usable branch name: {}", shown(b)));
    }
    let waves = &f.spec.waves;
    if waves.is_empty() {
        err("spec.waves", "is required: at least one wave, e.g. `- {name: canary, hosts: [gpu-01], bake: 10m}`".into());
    } else if waves.len() > MAX_WAVES {
        err("spec.waves", format!("has {} waves; at most {MAX_WAVES}", waves.len()));
    }
    let mut seen = BTreeMap::new();
    for (i, w) in waves.iter().enumerate() {
        let at = |field: &str| format!("spec.waves[{i}].{field}");
        if !crate::sweep::is_name(&w.name) {
            err(&at("name"), format!("must be 1-63 lowercase letters, digits or `-`; got {}", shown(&w.name)));
        } else if let Some(first) = seen.insert(w.name.clone(), i) {
            err(&at("name"), format!("`{}` is already the name of wave {first}", w.name));
        }
        if w.hosts.is_empty() && w.labels.is_empty() {
            err(&format!("spec.waves[{i}]"), "selects no host: give `hosts` (names or patterns) or `labels`".into());
        }
        for (j, h) in w.hosts.iter().enumerate() {
            if h.is_empty() || h.chars().any(|c| c.is_whitespace() || c == '/') {
                err(&format!("spec.waves[{i}].hosts[{j}]"), format!("is not a host name or pattern: {}", shown(h)));
            }
        }
        for (k, v) in &w.labels {
            if !is_label_name(k) {
                err(&at(&format!("labels.{k}")), format!("`{k}` is not a label name ([a-zA-Z_][a-zA-Z0-9_]*)"));
            } else if v.is_empty() {
                err(&at(&format!("labels.{k}")), "is empty: give the value a host must carry".into());
            }
        }
    }
    let g = &f.spec.gates;
    for (name, floor) in [("accept_length", &g.accept_length), ("accept_rate", &g.accept_rate)] {
        let Some(floor) = floor else { continue };
        if floor.min.is_none() && floor.of_previous.is_none() {
            err(&format!("spec.gates.{name}"), "needs `min` or `of_previous` (or both)".into());
        }
        if let Some(m) = floor.min
            && (!m.is_finite() || m < 0.0 || (name == "accept_rate" && m > 1.0))
        {
            let range = if name == "accept_rate" { "0 to 1" } else { "0 or more" };
            err(&format!("spec.gates.{name}.min"), format!("must be {range}, got {m}"));
        }
        if let Some(p) = floor.of_previous
            && (!p.is_finite() || p <= 0.0 || p > 1.0)
        {
            err(&format!("spec.gates.{name}.of_previous"), format!("must be a fraction above 0, at most 1; got {p}"));
        }
    }
    if let Some(c) = &g.startup_within {
        if c.max.is_none() && c.of_previous.is_none() {
            err("spec.gates.startup_within", "needs `max` or `of_previous` (or both)".into());
        }
        if c.max.is_some_and(|m| m.is_zero()) {
            err("spec.gates.startup_within.max", "must be at least 1s".into());
        }
        if let Some(p) = c.of_previous
            && (!p.is_finite() || p < 1.0)
        {
            err(
                "spec.gates.startup_within.of_previous",
                format!(
                    "must be a factor of at least 1 (1.5: half again as long as the previous revision's start); got {p}"
                ),
            );
        }
    }
    if let Some(p) = &g.speculation_pays {
        if !p.of_previous.is_finite() || p.of_previous <= 0.0 || p.of_previous > 1.0 {
            let got = p.of_previous;
            err("spec.gates.speculation_pays.of_previous", format!("must be a fraction above 0, at most 1; got {got}"));
        }
        if p.min_drafts == 0 {
            err("spec.gates.speculation_pays.min_drafts", "must be at least 1".into());
        }
    }
    if g.converge_within.is_zero() {
        err("spec.gates.converge_within", "must be at least 1s".into());
    }
    out.sort_by_key(|d| (d.line, d.column));
    out
}

/// A label name as Prometheus allows it (the agent exports its labels as metric labels).
pub fn is_label_name(k: &str) -> bool {
    let mut c = k.chars();
    c.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && c.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !k.starts_with("__")
}

/// A branch name git accepts, conservatively.
fn is_branch_name(b: &str) -> bool {
    !b.is_empty()
        && b.len() <= 200
        && !b.starts_with(['-', '/'])
        && !b.ends_with(['/', '.'])
        && !b.contains("..")
        && !b.contains("//")
        && !b.ends_with(".lock")
        && b.chars().all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c))
}

fn count<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    match crate::model::strict::u32(d)? {
        Some(0) => Err(de::Error::custom("must be at least 1")),
        Some(n) => Ok(n),
        None => Err(de::Error::custom("expected a whole number, got null")),
    }
}

fn duration<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let v = Value::deserialize(d)?;
    crate::sweep::duration_of(&v, "(the longest a fleet waits)")?
        .ok_or_else(|| de::Error::custom("expected a duration, got null"))
}

fn duration_text<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format!("{}s", d.as_secs()))
}

fn opt_duration<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    let v = Value::deserialize(d)?;
    crate::sweep::duration_of(&v, "(the longest a start may take)")
}

fn opt_duration_text<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => duration_text(d, s),
        None => s.serialize_none(),
    }
}

// --- the promotion record ----------------------------------------------------------------------

/// Where a rollout stands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RolloutState {
    /// Waves are taking the target, one after another.
    Progressing,
    /// Every wave passed: the target is released.
    #[default]
    Complete,
    /// A gate failed (or a person halted it): nothing advances until a new revision or a resume.
    Halted,
}

/// The promotion record: the one file `specd promote` writes and agents read.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Record {
    /// The revision being rolled out (a commit of the followed branch, full hash).
    pub target: String,
    /// The last revision every wave passed with; hosts no wave selects run it.
    pub released: String,
    pub state: RolloutState,
    /// When this rollout started (unix seconds).
    pub started: u64,
    /// One entry per wave of the fleet file, in its order.
    pub waves: Vec<WaveRecord>,
    /// Why the rollout is halted, when it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub halt: Option<Halt>,
}

/// Where one wave stands in the rollout.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WaveRecord {
    pub name: String,
    /// The last revision this wave passed its gates with: its hosts not promoted run it.
    pub good: String,
    /// The hosts given the target, with when (unix seconds), in the order they were given it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub promoted: Vec<Promoted>,
    /// When every host of the wave ran the target and passed the gates (the bake starts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub converged: Option<u64>,
    /// When the wave passed its bake with the target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baked: Option<u64>,
}

/// A host given the target.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Promoted {
    pub host: String,
    pub at: u64,
}

/// Why a rollout stopped.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Halt {
    /// Unix seconds.
    pub at: u64,
    /// `promoter` (a gate failed) or the person's name (`specd fleet halt`).
    pub by: String,
    pub wave: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub host: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub unit: String,
    /// The gate that failed (`converge`, `args_verified`, `speculation_proven`,
    /// `accept_length`, `accept_rate`, `startup_within`, `speculation_pays`, `no_deaths`, `applied`), or
    /// `manual`.
    pub gate: String,
    /// What was seen: the figures, the verdict.
    pub evidence: String,
}

impl Record {
    /// The record that adopts `revision` as the fleet's released one, every wave on it.
    pub fn adopt(fleet: &ParsedFleet, revision: &str, now: u64) -> Record {
        Record {
            target: revision.into(),
            released: revision.into(),
            state: RolloutState::Complete,
            started: now,
            waves: fleet.waves().iter().map(|w| WaveRecord::at(&w.name, revision)).collect(),
            halt: None,
        }
    }

    pub fn wave(&self, name: &str) -> Option<&WaveRecord> {
        self.waves.iter().find(|w| w.name == name)
    }

    /// The revision a host runs: its wave's target if the host was promoted, its wave's good
    /// revision otherwise; a host in no wave runs the released revision. `Err` says why the
    /// record cannot tell (a wave it does not know yet).
    pub fn revision_for(
        &self,
        fleet: &ParsedFleet,
        host: &str,
        labels: &BTreeMap<String, String>,
    ) -> Result<Assigned, String> {
        let Some(i) = fleet.wave_of(host, labels) else {
            return Ok(Assigned { revision: self.released.clone(), wave: None, promoted: false });
        };
        let name = &fleet.waves()[i].name;
        let w = self.wave(name).ok_or_else(|| {
            format!("the promotion record has no wave `{name}` yet (the fleet file changed; the promoter's next pass adds it)")
        })?;
        let promoted = w.promoted.iter().any(|p| p.host == host);
        let revision = if promoted { self.target.clone() } else { w.good.clone() };
        Ok(Assigned { revision, wave: Some(name.clone()), promoted })
    }

    /// Parse the record (`file` names it in errors).
    pub fn parse(text: &str, file: &str) -> Result<Record, Diagnostics> {
        let (r, map) = crate::parse_located::<Record>(file, text, "a promotion record")?;
        let mut out = Vec::new();
        for (path, rev) in [("target", &r.target), ("released", &r.released)] {
            if !is_commit(rev) {
                out.push(map.at_field(
                    Severity::Error,
                    path,
                    format!("must be a full commit hash, got {}", shown(rev)),
                ));
            }
        }
        for (i, w) in r.waves.iter().enumerate() {
            if !is_commit(&w.good) {
                let msg = format!("must be a full commit hash, got {}", shown(&w.good));
                out.push(map.at_field(Severity::Error, &format!("waves[{i}].good"), msg));
            }
        }
        if out.is_empty() { Ok(r) } else { Err(Diagnostics(out)) }
    }

    /// The record as YAML, deterministic (the same record, the same bytes).
    pub fn render(&self) -> String {
        let mut s =
            String::from("# specd promotion record: written by `specd promote` and `specd fleet`, read by agents.\n");
        s.push_str(&serde_saphyr::to_string(self).expect("a record serializes"));
        s
    }
}

/// The revision a host runs, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Assigned {
    pub revision: String,
    /// The host's wave; `None`: no wave selects it.
    pub wave: Option<String>,
    /// Whether the host was given the rollout's target ahead of its wave's good revision.
    pub promoted: bool,
}

impl WaveRecord {
    pub fn at(name: &str, revision: &str) -> WaveRecord {
        WaveRecord { name: name.into(), good: revision.into(), ..Default::default() }
    }
}

fn is_commit(s: &str) -> bool {
    (s.len() == 40 || s.len() == 64) && s.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
}
