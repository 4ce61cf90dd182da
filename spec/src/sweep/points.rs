//! A sweep's points: the cartesian product of its matrix in the order written, each the base
//! spec with its values set and its dependent fields derived the engine's way.

use super::*;
use crate::diag::{Diagnostic, Diagnostics};
use crate::model::{Engine, Merge, SpecLayer};
use crate::render::{RenderedUnit, render};
use crate::resolve::Spec;
use crate::{ParsedSpec, clean_message};
use serde_json::Value;

pub(super) enum SetError {
    /// The path is not a field of a spec.
    NoSuchField(String),
    /// The field exists; the value does not fit it.
    Value(String),
}

/// `layer` with the field at `path` (dotted, relative to `spec`) set to `v`.
pub(super) fn set_field(layer: &SpecLayer, path: &str, v: &Value) -> Result<SpecLayer, SetError> {
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
pub(super) fn set_raw(layer: &SpecLayer, path: &str, v: &Value) -> Result<SpecLayer, String> {
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
pub(super) fn show_value(v: &Value) -> String {
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
pub(super) fn axis_labels(axes: &[Axis]) -> Vec<String> {
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
pub(super) fn blame(axes: &[Axis], derived: &[(String, Value)], field: &str) -> usize {
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
pub(super) const DERIVED_FROM: &[&str] = &["speculative.num_steps", "speculative.eagle_topk"];

/// A point's document and the fields derived for it.
pub(super) type PointDoc = (crate::model::Document, Vec<(String, Value)>);

/// The document of one point, and the fields derived for it. `Err((axis, message))`.
pub(super) fn point(
    base: &ParsedSpec,
    host: Option<&str>,
    values: &[(String, Value)],
) -> Result<PointDoc, (usize, String)> {
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
