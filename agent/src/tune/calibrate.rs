//! A sweep of the unit, as `tune` reads it: its objective (what "best" means, at which
//! concurrency), and its measured records of `speculative.num_steps` alone (a full sweep over
//! it, or `specd sweep --calibrate`'s two points): their step times calibrate the step cost, and
//! their accept lengths and decode speeds are what the predictions are compared with.

use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::Value;
use specd_spec::sweep::{self, Metric};

use crate::core::tune::Goal;
use crate::sweep::report::{PointOutcome, PointResult};

/// The field a calibration's records vary.
pub const FIELD: &str = "speculative.num_steps";

/// What one measured draft length gave, at the objective's concurrency.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Measured {
    pub k: u32,
    pub accept_length: Option<f64>,
    /// The median request's decode tokens per second.
    pub tok_s_per_request: Option<f64>,
    /// Output tokens per second of the level.
    pub throughput: f64,
    /// Seconds per decode step (the engine's counts over the level).
    pub step_s: Option<f64>,
}

/// A sweep file of the unit and its records.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FromSweep {
    pub file: String,
    pub results: String,
    pub maximize: Metric,
    pub concurrency: u32,
    pub measured: Vec<Measured>,
    /// What was left out, and why.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

impl FromSweep {
    pub fn goal(&self) -> Goal {
        match self.maximize {
            Metric::Throughput => Goal::Throughput,
            Metric::TokensPerSPerRequest => Goal::TokensPerSPerRequest,
            Metric::AcceptLength => Goal::AcceptLength,
        }
    }

    /// The step times measured, `(k, seconds per step)`, for the step cost's fit.
    pub fn step_times(&self) -> Vec<(u32, f64)> {
        self.measured.iter().filter_map(|m| m.step_s.map(|s| (m.k, s))).collect()
    }

    /// `(k, accept length, decode tok/s per request)` of each measured length.
    pub fn figures(&self) -> Vec<(u32, Option<f64>, Option<f64>)> {
        self.measured.iter().map(|m| (m.k, m.accept_length, m.tok_s_per_request)).collect()
    }
}

/// The sweep file `file` (of unit `unit`, for host `host`) and its records in `out` (default:
/// the sweep's own, `specd-sweep-NAME`). A sweep of another unit is an error; a sweep with no
/// records yet gives its objective alone.
pub fn read(file: &Path, out: Option<&Path>, unit: &str, host: &str) -> Result<FromSweep, String> {
    let name = file.display().to_string();
    let text = std::fs::read_to_string(file).map_err(|e| format!("{name}: {e}"))?;
    let mut parsed = sweep::parse_sweep(&text, &name).map_err(|d| d.to_string())?;
    parsed.sweep.spec.host.get_or_insert_with(|| host.to_string());
    let base_path = parsed.base_path(file);
    let base_name = base_path.display().to_string();
    let base_text = std::fs::read_to_string(&base_path).map_err(|e| format!("{base_name}: {e}"))?;
    let base = specd_spec::parse(&base_name, &base_text).map_err(|d| d.to_string())?;
    let spec = base.resolve(parsed.sweep.spec.host.as_deref()).map_err(|d| d.to_string())?;
    if spec.unit != unit {
        return Err(format!("{name}: its base spec {base_name} is unit {}, not {unit}", spec.unit));
    }
    let out = out
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from(format!("specd-sweep-{}", parsed.sweep.metadata.name)));
    let results = out.join("results.jsonl");
    let (records, _) = crate::sweep::read_results(&results).map_err(|e| format!("{e:#}"))?;
    let concurrency = parsed.objective_concurrency();
    let (measured, notes) = measured(&records, concurrency);
    Ok(FromSweep {
        file: name,
        results: results.display().to_string(),
        maximize: parsed.sweep.spec.objective.maximize,
        concurrency,
        measured,
        notes,
    })
}

/// The draft length a record measured, when `num_steps` is all it varies.
fn length(r: &PointResult) -> Option<u32> {
    match r.values.as_slice() {
        [(f, Value::Number(n))] if f == FIELD => n.as_u64().and_then(|k| u32::try_from(k).ok()),
        _ => None,
    }
}

/// Each measured length at `concurrency` (the newest record of each), and what was left out.
pub fn measured(records: &[PointResult], concurrency: u32) -> (Vec<Measured>, Vec<String>) {
    let mut out: Vec<Measured> = Vec::new();
    let mut notes = Vec::new();
    for r in records.iter().rev().filter(|r| r.outcome == PointOutcome::Measured) {
        let Some(k) = length(r) else {
            notes.push(format!("{}: left out (it varies more than {FIELD})", r.label));
            continue;
        };
        let Some(l) = r.level(concurrency).filter(|l| l.errors == 0 && l.requests > 0) else {
            notes.push(format!("{}: no clean level at concurrency {concurrency}", r.label));
            continue;
        };
        if out.iter().any(|m| m.k == k) {
            continue;
        }
        let step_s = l.decode.and_then(|d| d.step_s());
        out.push(Measured {
            k,
            accept_length: l.accept_length,
            tok_s_per_request: l.tok_s_median,
            throughput: l.throughput,
            step_s,
        });
    }
    out.sort_by_key(|m| m.k);
    (out, notes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::tune::Decode;
    use crate::sweep::loadgen::LevelResult;

    fn record(values: Vec<(String, Value)>, outcome: PointOutcome, levels: Vec<LevelResult>) -> PointResult {
        PointResult {
            index: 0,
            label: format!("{values:?}"),
            values,
            unit_sha256: "x".into(),
            outcome,
            verdict: None,
            summary: None,
            apply_s: None,
            max_running_requests: None,
            proof: None,
            levels,
            time: 0,
        }
    }

    fn level(c: u32, steps: u64, seconds: f64) -> LevelResult {
        LevelResult {
            concurrency: c,
            requests: 4,
            throughput: 100.0,
            tok_s_median: Some(50.0),
            accept_length: Some(2.5),
            decode: Some(Decode { steps, seconds, tokens: steps * 2 }),
            ..LevelResult::default()
        }
    }

    #[test]
    fn records_of_num_steps_alone_at_the_objectives_concurrency_calibrate() {
        let k = |n: u64| vec![(FIELD.to_string(), Value::from(n))];
        let records = vec![
            record(k(3), PointOutcome::Measured, vec![level(1, 100, 1.6), level(4, 100, 2.0)]),
            record(k(4), PointOutcome::Measured, vec![level(1, 100, 1.8)]),
            record(k(5), PointOutcome::ApplyFailed, vec![]),
            record(k(2), PointOutcome::Measured, vec![level(4, 10, 1.0)]),
            record(
                vec![(FIELD.into(), Value::from(2)), ("server.tp_size".into(), Value::from(2))],
                PointOutcome::Measured,
                vec![level(1, 1, 1.0)],
            ),
            // A newer record of a length wins.
            record(k(3), PointOutcome::Measured, vec![level(1, 100, 1.4)]),
        ];
        let (m, notes) = measured(&records, 1);
        let got: Vec<(u32, f64)> = m.iter().map(|m| (m.k, (m.step_s.unwrap() * 1e6).round() / 1e6)).collect();
        assert_eq!(got, [(3, 0.014), (4, 0.018)]);
        assert_eq!(notes.len(), 2, "{notes:?}");
        assert!(notes.iter().any(|n| n.contains("varies more than speculative.num_steps")));
        assert!(notes.iter().any(|n| n.contains("no clean level at concurrency 1")));
    }
}
