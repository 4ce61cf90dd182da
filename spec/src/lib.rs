//! specd's spec: the YAML a user commits, parsed with located errors, validated against what each
//! engine really accepts, merged with host overlays, and rendered to a byte-for-byte deterministic
//! systemd unit. No I/O: callers pass file names and text in, and get values and diagnostics out.
//!
//! ```
//! let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/qwen35-122b-mtp.yaml")).unwrap();
//! let parsed = specd_spec::parse("qwen.yaml", &text).unwrap();
//! let spec = parsed.resolve(Some("gpu-01")).unwrap();
//! let unit = specd_spec::render(&spec);
//! assert_eq!(unit.unit, "sglang-qwen.service");
//! assert_eq!(unit.sha256.len(), 64);
//! ```

mod diag;
mod engine;
pub mod fleet;
pub mod model;
pub mod pyrepr;
mod render;
mod reserved;
mod resolve;
mod secrets;
pub mod startup;
pub mod sweep;
mod validate;

pub use diag::{Diagnostic, Diagnostics, Severity};
pub use engine::{
    Algorithm, ArgsReport, Counters, EngineFacts, Evidence, Need, Reported, SecretFlag, facts as engine_facts,
};
pub use model::{Document, DriftPolicy, Engine, Restart, Verify};
pub use render::{
    HEADER, RenderedUnit, command_line, exec_start, exec_start_value, parse_command_line, parse_environment, render,
    service_assignments, sha256_hex,
};
pub use reserved::reserved_unit;
pub use resolve::{
    ExpectedArg, Policy, Readiness, Rollout, Server, Service, Spec, Speculative, Weights, base_url_of_argv,
};
pub use validate::unit_name_problem;

use diag::{Pos, SourceMap};

/// UTC calendar time of unix seconds: (year, month, day, hour, minute, second). Pure arithmetic
/// (the civil-from-days algorithm), so that every timestamp specd and its tests print agrees.
///
/// ```
/// assert_eq!(specd_spec::utc(0), (1970, 1, 1, 0, 0, 0));
/// assert_eq!(specd_spec::utc(1_796_206_680), (2026, 12, 2, 10, 18, 0));
/// ```
pub fn utc(secs: u64) -> (i64, u32, u32, u32, u32, u32) {
    let days = (secs / 86_400) as i64;
    let rem = (secs % 86_400) as u32;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d, rem / 3600, rem % 3600 / 60, rem % 60)
}

/// A hash as people read it: its first 12 characters (a commit, a unit's sha256).
///
/// ```
/// assert_eq!(specd_spec::short("3f2a9c0e71b4d5a6"), "3f2a9c0e71b4");
/// assert_eq!(specd_spec::short("3f2a"), "3f2a");
/// ```
pub fn short(hash: &str) -> &str {
    hash.get(..12).unwrap_or(hash)
}

/// A shell-style name pattern: `*` any run of characters, `?` one character.
///
/// ```
/// assert!(specd_spec::glob_match("gpu-*", "gpu-07"));
/// assert!(!specd_spec::glob_match("gpu-?", "gpu-10"));
/// ```
pub fn glob_match(pattern: &str, name: &str) -> bool {
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    let (mut pi, mut ni, mut star, mut mark) = (0, 0, None, 0);
    while ni < n.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == n[ni]) {
            pi += 1;
            ni += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some(pi);
            mark = ni;
            pi += 1;
        } else if let Some(s) = star {
            pi = s + 1;
            mark += 1;
            ni = mark;
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|c| *c == '*')
}

/// The top-level `kind` of a YAML document (`InferenceService`, `Sweep`, `Fleet`), so that a
/// caller given a file of any kind knows which parser to use. Text that is not YAML has none.
pub fn kind_of(text: &str) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Kind {
        #[serde(default)]
        kind: Option<serde_json::Value>,
    }
    serde_saphyr::from_str::<Kind>(text).ok()?.kind?.as_str().map(str::to_string)
}

/// A spec file that parsed: its document and where each field stands in the text.
#[derive(Clone, Debug)]
pub struct ParsedSpec {
    pub document: Document,
    map: SourceMap,
}

/// Parse one spec file. `file` is only used in diagnostics. Unknown fields, duplicate keys, wrong
/// types and YAML syntax errors are reported with file, line, column and field path.
pub fn parse(file: &str, text: &str) -> Result<ParsedSpec, Diagnostics> {
    let (document, map) = parse_located::<Document>(file, text, "a spec")?;
    Ok(ParsedSpec { document, map })
}

/// One YAML document of `file` as a `T`, with the map of where its fields stand: the size limit
/// (`what` names the kind of file in its message), duplicate keys refused, and a syntax or type
/// error located at its line, column and field path. Specs and sweeps are read this way.
fn parse_located<T: serde::de::DeserializeOwned>(
    file: &str,
    text: &str,
    what: &str,
) -> Result<(T, SourceMap), Diagnostics> {
    if text.len() > MAX_FILE_BYTES {
        let map = SourceMap::new(file, "");
        let msg = format!("the file is {} bytes; {what} may be at most {MAX_FILE_BYTES} bytes (1 MiB)", text.len());
        return Err(Diagnostics(vec![map.diag(Severity::Error, Some(Pos { line: 1, column: 1 }), "", msg)]));
    }
    let map = SourceMap::new(file, text);
    // Numbers are numbers only when YAML 1.2 says so: `1_0` and `yes` are strings (which the
    // number and boolean fields then refuse), never 10 and true.
    let options = serde_saphyr::options! {
        duplicate_keys: serde_saphyr::DuplicateKeyPolicy::Error,
        with_snippet: false,
        underscored_numbers_as_strings: true,
        strict_booleans: true,
        // `.nan` and `.inf` reach the fields, whose range checks name them.
        non_finite_float_policy: serde_saphyr::NonFiniteFloatPolicy::PassThrough,
    };
    match serde_saphyr::from_str_with_options::<T>(text, options) {
        Ok(value) => Ok((value, map)),
        Err(e) => {
            let pos: Option<Pos> = e.location().map(Pos::from).filter(|p| p.line > 0);
            let path = pos.and_then(|p| map.path_at(p)).unwrap_or_default();
            let message = clean_message(&e.to_string());
            Err(Diagnostics(vec![map.diag(Severity::Error, pos, &path, message)]))
        }
    }
}

/// The largest spec file specd reads. Real specs are a few hundred bytes.
pub const MAX_FILE_BYTES: usize = 1 << 20;

/// The parser's message without its own position (the diagnostic carries the position).
fn clean_message(msg: &str) -> String {
    let mut m = msg.lines().next().unwrap_or(msg).trim();
    m = m.strip_prefix("error: ").unwrap_or(m);
    // "line 9 column 3: message"
    if let Some(rest) = m.strip_prefix("line ")
        && let Some((_, after)) = rest.split_once(": ")
        && rest.split_once(": ").is_some_and(|(pos, _)| pos.contains("column"))
    {
        m = after;
    }
    if let Some(i) = m.rfind(" at line ") {
        m = &m[..i];
    }
    let m = shorten_quoted(m.trim_end_matches([',', ' ']));
    let m = m.as_str();
    // "duplicate mapping key: model, set DuplicateKeyPolicy in Options if acceptable"
    if let Some(rest) = m.strip_prefix("duplicate mapping key: ") {
        let key = rest.split(", set ").next().unwrap_or(rest);
        return shorten_quoted(&format!("duplicate key `{key}`: each field may appear once"));
    }
    if let Some(ty) = m.strip_prefix("invalid ")
        && ["u8", "u16", "u32", "u64", "i32", "i64"].contains(&ty)
    {
        return format!("expected a whole number ({ty}), got something else");
    }
    m.to_string()
}

/// The parser quotes the user's text between backticks (`unknown field `...``); a long one is cut
/// short, so that a message stays a line.
fn shorten_quoted(m: &str) -> String {
    const MAX: usize = 40;
    let mut out = String::with_capacity(m.len().min(512));
    for (i, part) in m.split('`').enumerate() {
        if i > 0 {
            out.push('`');
        }
        match part.char_indices().nth(MAX) {
            Some((cut, _)) if i % 2 == 1 => {
                out.push_str(&part[..cut]);
                out.push_str(&format!("… ({} bytes)", part.len()));
            }
            _ => out.push_str(part),
        }
    }
    out
}

impl ParsedSpec {
    /// The spec for one host: its overlay (if the file has one for `hostname`) merged over `spec`,
    /// defaults filled in, validated. `Ok` carries the spec and any warnings.
    pub fn resolve_with_warnings(&self, hostname: Option<&str>) -> Result<(Spec, Diagnostics), Diagnostics> {
        validate::resolve(&self.document, &self.map, hostname).map(|(s, w)| (s, Diagnostics(w))).map_err(Diagnostics)
    }

    /// [`ParsedSpec::resolve_with_warnings`] without the warnings.
    pub fn resolve(&self, hostname: Option<&str>) -> Result<Spec, Diagnostics> {
        self.resolve_with_warnings(hostname).map(|(s, _)| s)
    }

    /// Every problem of the file: the base spec and each host overlay, errors and warnings.
    pub fn check(&self) -> Diagnostics {
        Diagnostics(validate::validate_all(&self.document, &self.map))
    }

    /// The file name given to [`parse`].
    pub fn file(&self) -> &str {
        &self.map.file
    }

    /// Where a field's key and value start in the file (1-based line and column each), when the
    /// field is written there: `spec.speculative.num_steps`. For editing one value in place.
    pub fn position(&self, path: &str) -> Option<((u64, u64), (u64, u64))> {
        let (k, v) = (self.map.key_pos(path)?, self.map.value_pos(path)?);
        Some(((k.line, k.column), (v.line, v.column)))
    }
}

/// Parse, check every overlay, and report all problems of one file (errors and warnings).
pub fn check(file: &str, text: &str) -> Diagnostics {
    match parse(file, text) {
        Ok(p) => p.check(),
        Err(d) => d,
    }
}

/// The JSON Schema of a spec file, pretty-printed with a trailing newline.
pub fn json_schema() -> String {
    let schema = schemars::schema_for!(Document);
    let mut s = serde_json::to_string_pretty(&schema).expect("a schema serializes");
    s.push('\n');
    s
}
