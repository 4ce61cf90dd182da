//! Validation: refuse, before anything touches a host, what the engine would reject or silently
//! rewrite, and anything that could inject a line into the unit file.

use std::collections::BTreeMap;

use crate::diag::{Diagnostic, Severity, SourceMap};
use crate::engine::{self, EngineFacts, Need};
use crate::model::strict::shown;
use crate::model::{Document, DriftPolicy, Engine, Merge, Restart, SpecLayer, SpeculativeLayer};
use crate::render::command_line;
use crate::resolve::{Policy, Readiness, Server, Service, Spec, Speculative, Weights};
use crate::secrets::{self, looks_secret};
use crate::units::reserved_unit;

/// Longest path systemd accepts (`PATH_MAX`, with the terminating NUL).
const MAX_PATH: usize = 4095;
/// Longest file name (one path component, `NAME_MAX`).
const MAX_COMPONENT: usize = 255;
/// Longest free text (an argument, an environment value, a description).
const MAX_TEXT: usize = 4096;
/// Longest name (a served model name, an algorithm, a variable or credential name).
const MAX_NAME: usize = 255;
/// Longest `ExecStart=` value: far below systemd's line limit (1 MiB) and the kernel's limits
/// on one argument (128 KiB).
const MAX_COMMAND_LINE: usize = 65536;
/// Longest user or group name systemd accepts in strict mode (`UT_NAMESIZE - 1`).
const MAX_USER: usize = 31;

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
        if !self.out.contains(&d) {
            self.out.push(d);
        }
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
        self.text_max(p, v, MAX_TEXT)
    }

    /// [`Ctx::text`] with a length limit, in bytes.
    fn text_max(&mut self, p: &str, v: &str, max: usize) -> bool {
        if v.len() > max {
            self.err(p, format!("is {} bytes long; the limit is {max} bytes", v.len()));
            return false;
        }
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

    fn abs_path(&mut self, p: &str, v: &str) -> bool {
        if !self.text_max(p, v, MAX_PATH) {
            return false;
        }
        if !v.starts_with('/') {
            self.err(p, format!("must be an absolute path, got {}", shown(v)));
        } else if v.split('/').any(|c| c == "..") {
            self.err(p, format!("may not contain `..`, got {}", shown(v)));
        } else if let Some(c) = v.split('/').find(|c| c.len() > MAX_COMPONENT) {
            self.err(
                p,
                format!("has a path component of {} bytes; the limit is {MAX_COMPONENT} bytes (NAME_MAX)", c.len()),
            );
        } else {
            return true;
        }
        false
    }

    /// A path written as-is into a key that does not unquote (`WorkingDirectory=`,
    /// `EnvironmentFile=`, `LoadCredential=`): a backslash would escape (or, at the end, join the
    /// next line), so none is allowed.
    fn raw_path(&mut self, p: &str, v: &str) -> bool {
        if !self.abs_path(p, v) {
            return false;
        }
        if v.contains('\\') {
            self.err(p, "may not contain a backslash (systemd would read it as an escape or join the next unit line)");
            return false;
        }
        true
    }
}

fn overlay_suffix(host: &str) -> String {
    format!(" (with the overlay for host {host})")
}

/// Validate one document as a whole: the base spec and every host overlay. Diagnostics are
/// deduplicated (an error in the base spec is reported once, not once per host).
pub(crate) fn validate_all(doc: &Document, map: &SourceMap) -> Vec<Diagnostic> {
    // Each diagnostic with its message before any overlay suffix, and the hosts whose overlay
    // it was seen through (empty: seen in the base spec, or at an overlay's own field).
    let mut all: Vec<(Diagnostic, String, Vec<String>)> = Vec::new();
    let mut push = |ds: Vec<Diagnostic>, host: Option<&str>| {
        for d in ds {
            let (bare, via) = match host.and_then(|h| d.message.strip_suffix(&overlay_suffix(h)).map(|m| (m, h))) {
                Some((m, h)) => (m.to_string(), Some(h)),
                None => (d.message.clone(), None),
            };
            // The same problem seen again (through another overlay, or in the base spec): once.
            let same = all.iter_mut().find(|(a, b, _)| {
                (a.line, a.column, &a.path, a.severity) == (d.line, d.column, &d.path, d.severity) && *b == bare
            });
            match (same, via) {
                (Some((_, _, hosts)), Some(h)) if !hosts.is_empty() => hosts.push(h.to_string()),
                (Some(_), _) => {}
                (None, via) => all.push((d, bare, via.map(|h| vec![h.to_string()]).unwrap_or_default())),
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
    let mut all: Vec<Diagnostic> = all
        .into_iter()
        .map(|(mut d, bare, hosts)| {
            d.message = match hosts.as_slice() {
                [] => bare,
                [h] => format!("{bare}{}", overlay_suffix(h)),
                hs => format!("{bare} (with the overlays for hosts {})", hs.join(", ")),
            };
            d
        })
        .collect();
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
    match spec {
        Some(spec) if !c.out.iter().any(Diagnostic::is_error) => Ok((spec, c.out)),
        Some(_) => Err(c.out),
        None => {
            // Every path that yields no spec reports why; should one not, say so rather than
            // accept an incomplete spec.
            if !c.out.iter().any(Diagnostic::is_error) {
                c.err("unit", "could not be resolved (an incomplete spec); please report this as a bug of specd");
            }
            Err(c.out)
        }
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
                format!("label key {} must be letters, digits, `-`, `_`, `.` or `/`", shown(k)),
            );
        } else if k.len() > MAX_NAME {
            top(
                c,
                &format!("metadata.labels.{k}"),
                format!("label key is {} bytes long; the limit is {MAX_NAME} bytes", k.len()),
            );
        }
        if v.chars().any(char::is_control) {
            top(c, &format!("metadata.labels.{k}"), "contains a control character".into());
        } else if v.len() > MAX_TEXT {
            top(
                c,
                &format!("metadata.labels.{k}"),
                format!("is {} bytes long; the limit is {MAX_TEXT} bytes", v.len()),
            );
        }
    }
    for (h, layer) in &doc.hosts {
        let valid = !h.is_empty()
            && h.len() <= 253
            && h.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'_');
        if !valid {
            top(
                c,
                &format!("hosts.{h}"),
                format!("{} is not a hostname (at most 253 letters, digits, `-`, `_` or `.`)", shown(h)),
            );
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

/// Why `v` is not the name of a unit specd may own, or `None` when it is one: systemd's
/// `[A-Za-z0-9:_.@-]` with the `.service` suffix, at most 255 characters, never `..` nor a `/`.
/// Specs are held to it, and so is every unit named on the command line (`specd unquarantine
/// UNIT`...), before specd builds a state, lock or unit file path from it.
pub fn unit_name_problem(v: &str) -> Option<String> {
    let ok = v.strip_suffix(".service").is_some_and(|stem| {
        !stem.is_empty()
            && v.len() <= 255
            && stem.bytes().all(|b| b.is_ascii_alphanumeric() || b":_.@-".contains(&b))
            && !stem.starts_with('.')
            && !v.contains("..")
            && !stem.starts_with('@')
            && stem.matches('@').count() <= 1
            && !stem.ends_with('@')
    });
    (!ok).then(|| {
        format!(
            "{} is not a valid service name: use at most 255 of [A-Za-z0-9:_.@-] ending in `.service`, no `/` and no `..`",
            shown(v)
        )
    })
}

/// Why `v` is not a user or group systemd accepts in `User=`/`Group=` without complaint: a
/// numeric id as systemd's `parse_uid()` reads it (decimal, no sign, no leading zero, at most
/// 4294967294 and not 65535, the 16-bit "-1"), or a name as its `valid_user_group_name()` accepts
/// in strict mode (`[A-Za-z_][A-Za-z0-9_-]*`, at most 31 bytes; no dots: those conflict with
/// `chown`'s `user.group` syntax).
fn user_problem(v: &str) -> Option<String> {
    if v.is_empty() {
        return Some("may not be empty".into());
    }
    if v.bytes().all(|b| b.is_ascii_digit()) {
        return match v.parse::<u64>() {
            _ if v.len() > 1 && v.starts_with('0') => {
                Some(format!("{}: a numeric id may not have a leading zero", shown(v)))
            }
            Ok(n) if n == 65535 || n >= 4294967295 => Some(format!(
                "{}: a numeric id must be in 0..=4294967294 and not 65535 (both are the \"invalid\" id)",
                shown(v)
            )),
            Ok(_) => None,
            Err(_) => Some(format!("{}: a numeric id must be in 0..=4294967294", shown(v))),
        };
    }
    if v.len() > MAX_USER {
        return Some(format!("is {} bytes long; a user or group name has at most {MAX_USER}", v.len()));
    }
    let first_ok = v.bytes().next().is_some_and(|b| b.is_ascii_alphabetic() || b == b'_');
    if !first_ok || !v.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') {
        return Some(format!(
            "{} is not a valid name: a letter or `_`, then letters, digits, `_` or `-` (systemd's strict rules: no dots)",
            shown(v)
        ));
    }
    None
}

/// systemd's `MemoryMax=`: `infinity`, a percentage of physical memory in (0, 100] with at most
/// two decimals, or bytes (decimals allowed) with an optional K, M, G, T, P or E (base 1024) or B
/// suffix, more than 0 and less than 2^64 - 1. Bytes must also reach the engine's floor
/// (`EngineFacts::min_memory_max`): systemd takes `MemoryMax=1`, and kills the server while it
/// loads. A percentage is of the host's memory, which the spec does not know: systemd judges it.
fn memory_max_problem(m: &str, engine: Engine) -> Option<String> {
    if m == "infinity" {
        return None;
    }
    // `int[.frac]` as (int, frac) digit strings.
    let decimal = |t: &str| -> Option<(u128, String)> {
        let (int, frac) = match t.split_once('.') {
            Some((i, f)) if !f.is_empty() => (i, f),
            Some(_) => return None,
            None => (t, ""),
        };
        let digits = |d: &str| d.bytes().all(|b| b.is_ascii_digit());
        if int.is_empty() || int.len() > 20 || frac.len() > 18 || !digits(int) || !digits(frac) {
            return None;
        }
        Some((int.parse().ok()?, frac.to_string()))
    };
    if let Some(pct) = m.strip_suffix('%') {
        return match decimal(pct) {
            Some((int, frac)) if frac.len() <= 2 => {
                let permyriad = int.checked_mul(100).and_then(|v| v.checked_add(format!("{frac:0<2}").parse().ok()?));
                match permyriad {
                    Some(0) => Some(format!("{} is zero: systemd refuses a zero memory limit", shown(m))),
                    Some(v) if v <= 10000 => None,
                    _ => Some(format!("{} is more than 100%", shown(m))),
                }
            }
            _ => Some(format!("{} is not a percentage (e.g. `80%` or `12.5%`, at most two decimals)", shown(m))),
        };
    }
    let (number, factor): (&str, u128) = match m.as_bytes().last() {
        Some(b'K') => (&m[..m.len() - 1], 1 << 10),
        Some(b'M') => (&m[..m.len() - 1], 1 << 20),
        Some(b'G') => (&m[..m.len() - 1], 1 << 30),
        Some(b'T') => (&m[..m.len() - 1], 1 << 40),
        Some(b'P') => (&m[..m.len() - 1], 1 << 50),
        Some(b'E') => (&m[..m.len() - 1], 1 << 60),
        Some(b'B') => (&m[..m.len() - 1], 1),
        _ => (m, 1),
    };
    let Some((int, frac)) = decimal(number) else {
        return Some(format!(
            "{} is not a memory size (bytes with an optional K, M, G, T, P or E suffix, a percentage, or `infinity`)",
            shown(m)
        ));
    };
    // Exact in u128: int < 10^20, factor <= 2^60, frac < 10^18.
    let frac_bytes =
        if frac.is_empty() { 0 } else { frac.parse::<u128>().unwrap_or(0) * factor / 10u128.pow(frac.len() as u32) };
    match int.checked_mul(factor).and_then(|b| b.checked_add(frac_bytes)) {
        Some(0) => Some(format!("{} is zero: systemd refuses a zero memory limit", shown(m))),
        Some(b) if b < u128::from(engine::facts(engine).min_memory_max) => {
            let floor = engine::facts(engine).min_memory_max;
            Some(format!(
                "{} is {}: no {} server starts in less than {} (its runtime alone needs that much memory, before any weights), and systemd would kill it while it loads, at every restart; give at least `{}`, a percentage of the host's memory, or `infinity`",
                shown(m),
                bytes(b),
                engine.as_str(),
                bytes(u128::from(floor)),
                systemd_size(floor)
            ))
        }
        Some(b) if b < u128::from(u64::MAX) => None,
        _ => Some(format!("{} is too large (systemd's limit is 16E)", shown(m))),
    }
}

/// A size as people read it: `1 byte`, `640 bytes`, `1.5 KiB`, `64 MiB`.
fn bytes(b: u128) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if b < 1024 {
        return format!("{b} byte{}", if b == 1 { "" } else { "s" });
    }
    let (mut v, mut unit) = (b as f64 / 1024.0, 0);
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    let v = format!("{v:.1}");
    format!("{} {}", v.strip_suffix(".0").unwrap_or(&v), UNITS[unit])
}

/// Bytes in systemd's syntax, with the largest suffix that divides them: `64M`, `1G`.
fn systemd_size(b: u64) -> String {
    for (suffix, shift) in [("E", 60), ("P", 50), ("T", 40), ("G", 30), ("M", 20), ("K", 10)] {
        if b != 0 && b.is_multiple_of(1 << shift) {
            return format!("{}{suffix}", b >> shift);
        }
    }
    b.to_string()
}

/// systemd's credential names are file names; specd accepts a portable subset.
fn credential_name_ok(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= MAX_NAME
        && n != "."
        && n != ".."
        && n.bytes().all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b))
}

fn build(c: &mut Ctx, doc: &Document, l: &SpecLayer, overlay: Option<String>) -> Option<Spec> {
    // unit
    let unit = match &l.unit {
        None => {
            c.err("unit", "is required: the systemd unit specd owns, e.g. `sglang-qwen.service`");
            None
        }
        Some(u) if unit_name_problem(u).is_some() => {
            c.err("unit", unit_name_problem(u).unwrap_or_default());
            None
        }
        Some(u) if reserved_unit(u).is_some() => {
            let why = reserved_unit(u).unwrap_or_default();
            c.err("unit", format!("{} is reserved for {why}; a spec may not manage the host's own units", shown(u)));
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
                        format!(
                            "{} must be an absolute path or a bare program name that systemd looks up",
                            shown(prog)
                        ),
                    );
                } else if prog.len() > MAX_COMPONENT && bare {
                    c.err(
                        "command[0]",
                        format!("is {} bytes long; the limit for a program name is {MAX_COMPONENT} bytes", prog.len()),
                    );
                } else if prog.starts_with('/') && c.abs_path("command[0]", prog) {
                    // systemd refuses these in the executable's path ("Executable name contains
                    // special characters"), and does not unescape `$$` there.
                    if let Some(ch) = prog.chars().find(|ch| matches!(ch, '"' | '\'' | '\\' | '$')) {
                        c.err(
                            "command[0]",
                            format!("the program's path may not contain {ch:?}: systemd refuses quotes and backslashes there and does not expand `$`"),
                        );
                    } else if prog.ends_with('/') {
                        c.err("command[0]", "the program's path ends in `/`: it names a directory");
                    }
                }
            }
            cmd.clone()
        }
        None => engine::default_command(engine),
    };

    let server = server(c, engine, l);
    let speculative = speculative(c, engine, l);
    let service = service(c, doc, engine, l);
    if !l.service.as_ref().and_then(|s| s.allow_literal_secrets).unwrap_or(false) {
        argv_secrets(c, engine, l);
    }
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
    let line = command_line(&argv).len();
    if line > MAX_COMMAND_LINE {
        let at =
            if l.server.as_ref().is_some_and(|s| s.extra_args.is_some()) { "server.extra_args" } else { "command" };
        c.err(at, format!("the command line would be {line} bytes; the limit is {MAX_COMMAND_LINE} bytes"));
        return None;
    }
    Some(Spec {
        name: doc.metadata.name.clone(),
        overlay,
        unit,
        engine,
        argv,
        model,
        server,
        speculative,
        weights: Weights { verify: l.weights.as_ref().and_then(|w| w.verify).unwrap_or_default() },
        service,
        readiness,
        policy: Policy {
            drift: policy.drift.unwrap_or(DriftPolicy::Heal),
            rollback: policy.rollback.unwrap_or(true),
            adopt: policy.adopt.unwrap_or(false),
        },
    })
}

/// Literal secrets in what lands on the server's command line: a flag that takes one, followed
/// by a value, and any value in a well-known credential format (`secrets`).
fn argv_secrets(c: &mut Ctx, engine: Engine, l: &SpecLayer) {
    let unit = l.unit.as_deref().filter(|u| unit_name_problem(u).is_none()).unwrap_or("UNIT");
    let server = l.server.clone().unwrap_or_default();
    for (field, words) in [("command", &l.command), ("server.extra_args", &server.extra_args)] {
        for (i, why) in secrets::in_argv(engine, unit, words.as_deref().unwrap_or_default()) {
            c.err(&format!("{field}[{i}]"), why);
        }
    }
    let spec = l.speculative.clone().unwrap_or_default();
    for (field, v) in [
        ("model", &l.model),
        ("server.host", &server.host),
        ("server.served_model_name", &server.served_model_name),
        ("speculative.algorithm", &spec.algorithm),
        ("speculative.draft_model", &spec.draft_model),
    ] {
        if let Some(what) = v.as_deref().and_then(secrets::credential_in) {
            c.err(field, secrets::credential_on_argv(what));
        }
    }
}

fn server(c: &mut Ctx, engine: Engine, l: &SpecLayer) -> Option<Server> {
    let s = l.server.clone().unwrap_or_default();
    let mut ok = true;
    let host = s.host.unwrap_or_else(|| "127.0.0.1".into());
    if host.is_empty() || host.len() > 253 || !host.bytes().all(|b| b.is_ascii_alphanumeric() || b".:-_".contains(&b)) {
        c.err("server.host", format!("{} is not an address or hostname", shown(&host)));
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
        ok &= c.text_max("server.served_model_name", n, MAX_NAME);
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

/// The speculative section: the checks every engine shares, then the engine's own rules. `None`
/// when any of them failed.
fn speculative(c: &mut Ctx, engine: Engine, l: &SpecLayer) -> Option<Speculative> {
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
fn reject(c: &mut Ctx, field: &str, set: bool, why: &str) {
    if set {
        c.err(&format!("speculative.{field}"), why.to_string());
    }
}

/// SGLang's rules: no other engine's fields; an algorithm it knows is required; then NGRAM's
/// rules or the EAGLE family's.
fn sglang_speculative(c: &mut Ctx, facts: &EngineFacts, s: &SpeculativeLayer) {
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
fn sglang_eagle(c: &mut Ctx, facts: &EngineFacts, s: &SpeculativeLayer, a: &str) {
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
fn vllm_speculative(c: &mut Ctx, facts: &EngineFacts, s: &SpeculativeLayer) {
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
fn llama_speculative(c: &mut Ctx, facts: &EngineFacts, s: &SpeculativeLayer) -> Option<&'static str> {
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
fn llama_spec_type(c: &mut Ctx, facts: &EngineFacts, s: &SpeculativeLayer) -> Option<&'static str> {
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
            && let Some(why) = user_problem(v)
        {
            c.err(&format!("service.{f}"), format!("is not a valid {f}: {why}"));
        }
    }
    if let Some(w) = &s.working_directory {
        c.raw_path("service.working_directory", w);
    }
    let env = s.environment.clone().unwrap_or_default();
    let literal_secrets_allowed = s.allow_literal_secrets.unwrap_or(false);
    for (k, v) in &env {
        let p = format!("service.environment.{k}");
        let key_ok = k.bytes().next().is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
            && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if !key_ok {
            c.err(&p, format!("{} is not a valid environment variable name ([A-Za-z_][A-Za-z0-9_]*)", shown(k)));
        } else if k.len() > MAX_NAME {
            c.err(&p, format!("the variable name is {} bytes long; the limit is {MAX_NAME} bytes", k.len()));
        }
        if v.len() > MAX_TEXT {
            c.err(&p, format!("is {} bytes long; the limit is {MAX_TEXT} bytes", v.len()));
        } else if let Some(ch) = v.chars().find(|c| c.is_control()) {
            c.err(&p, format!("contains the control character {ch:?}; it could inject a line into the unit file"));
        } else if key_ok && looks_secret(k) && !v.is_empty() && !literal_secrets_allowed {
            c.err(
                &p,
                format!(
                    "{k} looks like a secret: a literal value here is readable by every local user in the unit file and specd's state. Put `{k}=...` in a root-only file listed in service.environment_files, or pass the file as service.credentials (`$CREDENTIALS_DIRECTORY/NAME`); set service.allow_literal_secrets: true if it is not secret"
                ),
            );
        } else if key_ok
            && !literal_secrets_allowed
            && let Some(what) = secrets::credential_in(v)
        {
            c.err(
                &p,
                format!(
                    "the value looks like {what}: a literal one here is readable by every local user in the unit file and specd's state. Put `{k}=...` in a root-only file listed in service.environment_files, or pass the file as service.credentials (`$CREDENTIALS_DIRECTORY/NAME`); set service.allow_literal_secrets: true if it is not secret"
                ),
            );
        }
    }
    let environment_files = s.environment_files.clone().unwrap_or_default();
    for (i, f) in environment_files.iter().enumerate() {
        // A leading `-`: systemd ignores the file when it does not exist.
        c.raw_path(&format!("service.environment_files[{i}]"), f.strip_prefix('-').unwrap_or(f));
    }
    let credentials = s.credentials.clone().unwrap_or_default();
    for (name, path) in &credentials {
        let p = format!("service.credentials.{name}");
        if !credential_name_ok(name) {
            c.err(
                &p,
                format!(
                    "{} is not a credential name: 1-{MAX_NAME} letters, digits, `_`, `-` or `.` (it becomes a file name in $CREDENTIALS_DIRECTORY)",
                    shown(name)
                ),
            );
        }
        // systemd takes the source only in normal form (`path_is_normalized()`).
        if c.raw_path(&p, path) && (path.contains("//") || path.contains("/./") || path.ends_with("/.")) {
            c.err(&p, format!("{} is not in normal form: systemd refuses `//` and `.` components here", shown(path)));
        }
    }
    if let Some(m) = &s.memory_max
        && let Some(why) = memory_max_problem(m, engine)
    {
        c.err("service.memory_max", why);
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
        environment_files,
        credentials,
        restart: s.restart.unwrap_or(Restart::OnFailure),
        restart_sec: s.restart_sec.unwrap_or(5),
        timeout_start_sec,
        timeout_stop_sec,
        drain_timeout_sec: drain,
        memory_max: s.memory_max,
        enabled: s.enabled.unwrap_or(true),
    })
}

fn readiness(c: &mut Ctx, engine: Engine, l: &SpecLayer, service: Option<&Service>) -> Option<Readiness> {
    let r = l.readiness.clone().unwrap_or_default();
    let endpoint = r.endpoint.unwrap_or_else(|| engine::default_endpoint(engine).to_string());
    let mut ok = true;
    if !endpoint.starts_with('/') || endpoint.bytes().any(|b| b <= b' ' || b == 0x7f) || endpoint.len() > MAX_TEXT {
        c.err(
            "readiness.endpoint",
            format!(
                "must be an HTTP path starting with `/`, without spaces or control characters, at most {MAX_TEXT} bytes; got {}",
                shown(&endpoint)
            ),
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
        verify_speculation: r.verify_speculation.unwrap_or(true),
    })
}
