//! A sweep's records (`results.jsonl`, appended and fsync'd per point), the best point under the
//! objective, and the reports written at its end.

use super::edit::edit_spec;
use super::*;
use crate::machine::atomic;
use crate::sweep::report::{Goal, PointResult};
use anyhow::{Context, Result};
use serde::Serialize;
use serde_json::Value;
use specd_spec::sweep::{Metric, Point};
use std::io::Write;
use std::path::Path;

#[derive(Debug, Serialize)]
pub struct Files {
    pub results: String,
    pub table: String,
    pub csv: String,
    /// Null when the plot could not be drawn.
    pub plot: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct Objective {
    /// What is maximized, as the sweep file names it (`throughput`, `tokens_per_s_per_request`,
    /// `accept_length`).
    pub maximize: Metric,
    pub concurrency: u32,
    /// Each constraint: the figure and its upper bound.
    pub limits: std::collections::BTreeMap<String, f64>,
}

#[derive(Debug, Serialize)]
pub struct Best {
    pub index: usize,
    pub label: String,
    pub values: Vec<(String, Value)>,
    pub unit_sha256: String,
}

/// The records of `results.jsonl`. A last line without its newline is a write that a kill cut
/// short: ignored (and cut off before the next append). Returns the records and the length of
/// the file's whole lines.
pub fn read_results(path: &Path) -> Result<(Vec<PointResult>, usize)> {
    let Some(bytes) = atomic::read_opt(path)? else {
        return Ok((vec![], 0));
    };
    let mut out = Vec::new();
    let mut whole = 0;
    for (i, line) in bytes.split_inclusive(|b| *b == b'\n').enumerate() {
        if !line.ends_with(b"\n") {
            break;
        }
        whole += line.len();
        let text = String::from_utf8_lossy(line);
        if text.trim().is_empty() {
            continue;
        }
        let r: PointResult = serde_json::from_str(&text).with_context(|| {
            format!("{}:{}: not a sweep result (the file is not specd's, or was edited)", path.display(), i + 1)
        })?;
        out.push(r);
    }
    Ok((out, whole))
}

/// Append one record and make it durable before the next point starts.
pub(super) fn append(path: &Path, r: &PointResult) -> Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    let mut line = serde_json::to_string(r)?;
    line.push('\n');
    f.write_all(line.as_bytes()).with_context(|| format!("writing {}", path.display()))?;
    f.sync_all().with_context(|| format!("fsync {}", path.display()))
}

pub(super) fn goal(m: Metric) -> Goal {
    match m {
        Metric::Throughput => Goal::Throughput,
        Metric::TokensPerSPerRequest => Goal::TokSPerRequest,
        Metric::AcceptLength => Goal::AcceptLength,
    }
}

/// The records of an earlier run of the sweep in `out`, to go on with. `None` (said why) when
/// there are some and `--resume` was not given: nothing may change then. A record cut short by
/// a kill is cut off the file before anything is appended after it.
pub(super) fn open_results(out: &Path, results_path: &Path, resume: bool) -> Result<Option<Vec<PointResult>>> {
    let (prior, whole) = read_results(results_path)?;
    if !resume && !prior.is_empty() {
        eprintln!(
            "specd: {} holds the results of {} point(s) already: --resume to go on with them, or --out another directory",
            results_path.display(),
            prior.len()
        );
        return Ok(None);
    }
    atomic::ensure_dir(out)?;
    let on_disk = atomic::read_opt(results_path)?.map_or(0, |b| b.len());
    if on_disk > whole {
        let bytes = atomic::read_opt(results_path)?.unwrap_or_default();
        atomic::atomic_write(results_path, &bytes[..whole], 0o644)?;
        eprintln!(
            "specd: dropped a result line cut short in {} (the point it was is measured again)",
            results_path.display()
        );
    }
    Ok(Some(prior))
}

/// The results of this sweep's points, in its order (a record of an older run of the sweep
/// file whose point is gone is left out).
pub(super) fn this_sweeps_results(p: &Prepared, results_path: &Path) -> Result<Vec<PointResult>> {
    let (all, _) = read_results(results_path)?;
    Ok(p.points
        .iter()
        .filter_map(|pt| {
            let mut r = all.iter().rev().find(|r| r.unit_sha256 == pt.unit.sha256)?.clone();
            r.index = pt.index;
            Some(r)
        })
        .collect())
}

/// The reports in the output directory (table.md, results.csv, plot.svg), and the table on
/// stdout when `print`. Whether the plot was drawn.
pub(super) fn write_reports(
    p: &Prepared,
    results: &[PointResult],
    winner: Option<&PointResult>,
    at: u32,
    limits: &[(&str, f64)],
    print: bool,
) -> Result<bool> {
    let sw = &p.parsed.sweep;
    let title = format!(
        "{}: {}",
        sw.metadata.name,
        sw.spec.matrix.0.iter().map(|a| a.field.as_str()).collect::<Vec<_>>().join(" × ")
    );
    let win = winner.map(|w| w.index);
    let table = report::table(results, win, at, limits);
    atomic::atomic_write(&p.out.join("table.md"), table.as_bytes(), 0o644)?;
    atomic::atomic_write(&p.out.join("results.csv"), report::csv(results).as_bytes(), 0o644)?;
    let plotted = match report::svg(results, &title, win) {
        Ok(svg) => {
            atomic::atomic_write(&p.out.join("plot.svg"), svg.as_bytes(), 0o644)?;
            true
        }
        Err(e) => {
            eprintln!("specd: {e}");
            false
        }
    };
    if print {
        println!("{table}");
        println!("table.md, results.csv, plot.svg in {}", p.out.display());
    }
    Ok(plotted)
}

/// The best point as a diff of the base spec file; with `--write`, the file edited in place
/// (its mode and owner kept). What it did goes into `doc`; with `json`, nothing on stdout.
pub(super) fn offer_best(p: &Prepared, wp: &Point, write: bool, doc: &mut Summary, json: bool) -> Result<()> {
    let say = |line: &str| {
        if !json {
            println!("{line}");
        }
    };
    match edit_spec(&p.base, &p.base_text, wp, p.parsed.sweep.spec.host.as_deref()) {
        Ok(new) if new == p.base_text => say(&format!("{} already has the best point's values", p.base_path.display())),
        Ok(new) => {
            let name = p.base_path.display().to_string();
            let change =
                similar::TextDiff::from_lines(&p.base_text, &new).unified_diff().header(&name, &name).to_string();
            if !json {
                print!("{change}");
            }
            doc.spec_change = Some(change);
            if write {
                use std::os::unix::fs::{MetadataExt, PermissionsExt};
                let was = std::fs::metadata(&p.base_path).ok();
                let mode = was.as_ref().map_or(0o644, |m| m.permissions().mode() & 0o7777);
                atomic::atomic_write(&p.base_path, new.as_bytes(), mode)?;
                // Still the operator's file when specd ran as root (sudo): its owner as before.
                if let Some(m) = was {
                    std::os::unix::fs::chown(&p.base_path, Some(m.uid()), Some(m.gid()))
                        .with_context(|| format!("giving {name} back to its owner"))?;
                }
                doc.spec_written = true;
                say(&format!("wrote {name}: commit it to keep the best point"));
            } else {
                say(&format!("(--write puts this change into {name})"));
            }
        }
        Err(e) => {
            say(&format!("the best point cannot be written into {} by itself: {e}", p.base_path.display()));
            doc.spec_change_error = Some(e);
        }
    }
    Ok(())
}

pub(super) fn limits_text(limits: &[(&str, f64)]) -> String {
    limits.iter().map(|(k, v)| format!(", {k} ≤ {v}")).collect()
}
