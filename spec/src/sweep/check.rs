//! A sweep document's problems, each located at its field.

use super::points::{SetError, set_field, show_value};
use super::*;
use crate::diag::{Diagnostic, Severity, SourceMap};
use crate::model::SpecLayer;
use crate::model::strict::shown;

/// Every problem of a sweep document, in the order of the file.
pub(super) fn validate(s: &Sweep, map: &SourceMap) -> Vec<Diagnostic> {
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
pub(super) fn header_problems(s: &Sweep, map: &SourceMap, out: &mut Vec<Diagnostic>) {
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
pub(super) fn base_problems(sp: &SweepSpec, map: &SourceMap, out: &mut Vec<Diagnostic>) {
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
pub(super) fn matrix_problems(matrix: &Matrix, map: &SourceMap, out: &mut Vec<Diagnostic>) {
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
pub(super) fn axis_problems(axis: &Axis, map: &SourceMap, out: &mut Vec<Diagnostic>) {
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
pub(super) fn load_problems(l: &Load, map: &SourceMap, out: &mut Vec<Diagnostic>) {
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
pub(super) fn objective_problems(o: &Objective, levels: &[u32], map: &SourceMap, out: &mut Vec<Diagnostic>) {
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
pub(super) fn field_problem(field: &str) -> Option<String> {
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

pub(super) fn required_top(schema: &mut schemars::Schema) {
    required(schema, &["apiVersion", "kind", "metadata", "spec"]);
}

pub(super) fn required_spec(schema: &mut schemars::Schema) {
    required(schema, &["base", "matrix", "load"]);
}

pub(super) fn required_concurrency(schema: &mut schemars::Schema) {
    required(schema, &["concurrency"]);
}

pub(super) fn required(schema: &mut schemars::Schema, names: &[&str]) {
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
