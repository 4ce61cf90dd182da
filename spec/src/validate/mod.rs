//! Validation: refuse, before anything touches a host, what the engine would reject or silently
//! rewrite, and anything that could inject a line into the unit file.

mod limits;
mod speculative;

use std::collections::BTreeMap;

use crate::diag::{Diagnostic, Severity, SourceMap};
use crate::engine::{self};
use crate::model::strict::shown;
use crate::model::{Document, DriftPolicy, Engine, Merge, Restart, SpecLayer};
use crate::render::command_line;
use crate::reserved::reserved_unit;
use crate::resolve::{Policy, Readiness, Rollout, Server, Service, Spec, Weights};
use crate::secrets::{self, looks_secret};
pub use limits::unit_name_problem;
use limits::{
    MAX_COMMAND_LINE, MAX_COMPONENT, MAX_NAME, MAX_PATH, MAX_TEXT, credential_name_ok, memory_max_problem, user_problem,
};
use speculative::speculative;

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

fn build(c: &mut Ctx, doc: &Document, l: &SpecLayer, overlay: Option<String>) -> Option<Spec> {
    let unit = unit(c, l);
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
    let command = match &l.command {
        Some(cmd) => {
            command(c, cmd);
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
    let rollout = rollout(c, l);

    if engine == Engine::Sglang
        && speculative.is_some()
        && server.as_ref().is_some_and(|s| s.max_running_requests.is_none())
    {
        c.warn(
            "server.max_running_requests",
            "is unset while speculative decoding is on: SGLang then picks a small value itself (48 in 0.5.x); set it to pin the capacity",
        );
    }

    let (unit, model, server, mut service, readiness) = (unit?, model?, server?, service?, readiness?);
    // A spare is held stopped at rest: it does not start at boot unless its spec says so.
    let said_enabled = l.service.as_ref().and_then(|s| s.enabled).is_some();
    if rollout.as_ref().is_some_and(|r| r.spare) && !said_enabled {
        service.enabled = false;
    }
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
            // A spare's good state at rest is stopped: its failed start is left stopped.
            rollback: policy.rollback.unwrap_or(!rollout.as_ref().is_some_and(|r| r.spare)),
            adopt: policy.adopt.unwrap_or(false),
        },
        rollout,
    })
}

/// `spec.rollout`: a group named like a unit's name part, `max_unavailable` at least 1 (default 1)
/// or 0 with a `max_surge` of at least 1 (a spare started first keeps the capacity).
fn rollout(c: &mut Ctx, l: &SpecLayer) -> Option<Rollout> {
    let r = l.rollout.as_ref()?;
    let max_surge = r.max_surge.unwrap_or(0);
    let max_unavailable = r.max_unavailable.unwrap_or(1);
    if max_unavailable == 0 && max_surge == 0 {
        c.err(
            "rollout.max_unavailable",
            "must be at least 1, or 0 with `max_surge` at least 1 (a spare started first): with both 0, no replica of the group could ever be changed",
        );
    }
    if max_surge > MAX_SURGE {
        c.err("rollout.max_surge", format!("must be at most {MAX_SURGE} (spares of one group on one host)"));
    }
    let Some(group) = &r.group else {
        c.err("rollout.group", "is required with `rollout:`: the name the group's replicas share, e.g. `llm`");
        return None;
    };
    if !is_name(group, 63) {
        c.err(
            "rollout.group",
            format!("must be 1-63 lowercase letters, digits or `-`, not starting or ending with `-`; got {group:?}"),
        );
        return None;
    }
    let valid = (max_unavailable > 0 || max_surge > 0) && max_surge <= MAX_SURGE;
    let spare = r.spare.unwrap_or(false);
    valid.then(|| Rollout { group: group.clone(), max_unavailable, max_surge, spare })
}

/// The most spares a group may start beside its replicas (`rollout.max_surge`).
const MAX_SURGE: u32 = 8;

/// `spec.unit`: given, a name a unit may have, and none of the host's own units.
fn unit(c: &mut Ctx, l: &SpecLayer) -> Option<String> {
    match &l.unit {
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
    }
}

/// `spec.command`, when given: not empty, each word text a unit line may hold, and a program
/// systemd runs (an absolute path it accepts, or a bare name it looks up).
fn command(c: &mut Ctx, cmd: &[String]) {
    if cmd.is_empty() {
        c.err("command", "may not be empty; leave it out for the engine's default");
    }
    for (i, w) in cmd.iter().enumerate() {
        c.text(&format!("command[{i}]"), w);
    }
    let Some(prog) = cmd.first() else { return };
    let bare = !prog.is_empty()
        && prog.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && prog.bytes().all(|b| b.is_ascii_alphanumeric() || b"._+-".contains(&b));
    if !(prog.starts_with('/') || bare) {
        c.err(
            "command[0]",
            format!("{} must be an absolute path or a bare program name that systemd looks up", shown(prog)),
        );
    } else if prog.len() > MAX_COMPONENT && bare {
        c.err(
            "command[0]",
            format!("is {} bytes long; the limit for a program name is {MAX_COMPONENT} bytes", prog.len()),
        );
    } else if prog.starts_with('/') && c.abs_path("command[0]", prog) {
        // systemd refuses these in the executable's path ("Executable name contains special
        // characters"), and does not unescape `$$` there.
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
    let host = s.host.clone().unwrap_or_else(|| "127.0.0.1".into());
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
    ok &= engine_options(c, engine, &s);
    if let Some(n) = &s.served_model_name {
        ok &= c.text_max("server.served_model_name", n, MAX_NAME);
        if n.is_empty() {
            c.err("server.served_model_name", "may not be empty");
            ok = false;
        }
    }
    let extra = s.extra_args.unwrap_or_default();
    ok &= extra_args(c, engine, &extra);
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

/// The server options of another engine than `engine` are not set. Whether none is.
fn engine_options(c: &mut Ctx, engine: Engine, s: &crate::model::ServerLayer) -> bool {
    let not_for = |c: &mut Ctx, p: &str, set: bool, why: &str| {
        if set {
            c.err(p, format!("is not an option of {}: {why}", engine.as_str()));
        }
        !set
    };
    let mut ok = true;
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
    ok
}

/// `server.extra_args`: text a unit line may hold, and none of the flags specd renders itself
/// (nor an abbreviation of one), `--config`, or a flag the engine removed. Whether all pass.
fn extra_args(c: &mut Ctx, engine: Engine, extra: &[String]) -> bool {
    let owned = engine::owned_flags(engine);
    let removed = engine::removed_flags(engine);
    let mut ok = true;
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
    ok
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
    environment(c, &env, s.allow_literal_secrets.unwrap_or(false));
    let environment_files = s.environment_files.clone().unwrap_or_default();
    for (i, f) in environment_files.iter().enumerate() {
        // A leading `-`: systemd ignores the file when it does not exist.
        c.raw_path(&format!("service.environment_files[{i}]"), f.strip_prefix('-').unwrap_or(f));
    }
    let credentials = s.credentials.clone().unwrap_or_default();
    credentials_of(c, &credentials);
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
        drain_refuse_new: s.drain_refuse_new.unwrap_or(false),
        memory_max: s.memory_max,
        enabled: s.enabled.unwrap_or(true),
    })
}

/// `service.environment`: names systemd takes, values that add no line to the unit, and no
/// literal secret unless the spec allows them.
fn environment(c: &mut Ctx, env: &BTreeMap<String, String>, literal_secrets_allowed: bool) {
    for (k, v) in env {
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
}

/// `service.credentials`: names that become file names, sources in systemd's normal form.
fn credentials_of(c: &mut Ctx, credentials: &BTreeMap<String, String>) {
    for (name, path) in credentials {
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
