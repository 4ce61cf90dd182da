//! `specd tune UNIT`: what the running instance's own counts say of its draft length. It reads
//! the engine's `/metrics` (its drafts and acceptance by position, its decode steps and their
//! time, the load it served since it started: `core::counts`), predicts the accept length and
//! decode speed of each length up to the running one (`core::tune`), calibrated on a sweep's
//! step times when one is given (`calibrate`) and compared with what that sweep measured, and
//! prints a table with the evidence and its uncertainty and the change of the spec file that
//! the data recommends (`change`). `--propose` writes that change as a signed commit on a
//! branch of its own for a person to merge (`propose`); the agent can run the same on a
//! schedule and export the prediction (`schedule`).
//!
//! Exit codes: 0 the running length is the best predicted; 1 another is recommended; 2 it cannot
//! tell (fewer drafts than the minimum, an engine that counts nothing by position) or could not
//! read what it needs.

mod calibrate;
mod change;
pub mod propose;
pub mod schedule;
mod show;

use std::path::PathBuf;

use anyhow::Result;
use serde::Serialize;
use specd_spec::{Engine, Spec};

use crate::core::counts::{Counts, observe};
use crate::core::record::{Source, UnitState};
use crate::core::tune::{self, Observed, Prediction, Verdict};
use crate::machine::probe::Probe;
use crate::machine::store::Store;
use crate::reconcile::context::{Dirs, hostname};
pub use calibrate::FromSweep;

/// What the command line asks.
pub struct Options {
    pub unit: String,
    pub json: bool,
    /// A sweep file of the unit: its objective, and its records' step times.
    pub sweep: Option<PathBuf>,
    /// The sweep's output directory (default its own, `specd-sweep-NAME`).
    pub out: Option<PathBuf>,
    /// The spec file the change is written against (default: the file the unit was applied
    /// from, when it was a file).
    pub file: Option<PathBuf>,
    pub min_drafts: u64,
    pub host: Option<String>,
    pub propose: Option<propose::Options>,
}

/// `specd tune --json`: one document on stdout; `ok` is true exactly when the exit code is 0.
#[derive(Debug, Default, Serialize)]
pub struct TuneJson {
    pub ok: bool,
    pub error: Option<String>,
    pub unit: String,
    pub engine: Option<Engine>,
    /// The unit that runs (its hash), and where its spec came from.
    pub unit_sha256: Option<String>,
    pub source: Option<String>,
    pub observed: Option<Observed>,
    pub prediction: Option<Prediction>,
    pub sweep: Option<FromSweep>,
    pub compared: Vec<tune::Compared>,
    pub spec_file: Option<String>,
    /// The change of the spec file that applies the recommended length (a unified diff).
    pub spec_change: Option<String>,
    pub spec_change_error: Option<String>,
    pub proposal: Option<propose::Proposed>,
}

/// What `tune` found for one unit.
#[derive(Clone, Debug)]
pub struct Evaluation {
    pub spec: Spec,
    pub sha256: String,
    pub source: Option<Source>,
    /// When the unit that runs was applied (Unix seconds).
    pub since: u64,
    pub observed: Observed,
    pub prediction: Prediction,
    pub compared: Vec<tune::Compared>,
}

/// The spec of the unit that runs, verified (the last good one), its hash, source and time.
pub fn running(st: &UnitState) -> Result<(Spec, String, Option<Source>, u64), String> {
    let good = st.last_good.as_ref().ok_or_else(|| {
        format!("specd has no verified unit of {}: tune reads a running instance that specd applied", st.unit)
    })?;
    let d =
        st.good_specs.iter().rev().chain(st.desired.iter()).find(|d| d.sha256 == good.sha256).ok_or_else(|| {
            format!("specd keeps no spec of the unit that runs ({})", specd_spec::short(&good.sha256))
        })?;
    if !d.spec.speculates() {
        return Err(format!("{} does not speculate: there is no draft length to tune", st.unit));
    }
    Ok((d.spec.clone(), good.sha256.clone(), d.source.clone(), good.time))
}

/// Read the running instance of `unit` and predict: the evaluation, or why there is none.
pub async fn evaluate(
    store: &Store,
    probe: &Probe,
    unit: &str,
    sweep: Option<&FromSweep>,
    min_drafts: u64,
) -> Result<Evaluation, String> {
    let st = store.peek(unit).map_err(|e| format!("{e:#}"))?;
    let (spec, sha256, source, since) = running(&st)?;
    let text = probe.metrics(&spec.base_url(), spec.engine).await?;
    let now = crate::machine::store::now() as f64;
    let observed = observe(&spec, &Counts::read(spec.engine, &text), now)?;
    let ratio = sweep.and_then(|s| {
        let points = s.step_times();
        tune::fit_ratio(&points).map(|r| (r, points))
    });
    let goal = sweep.map_or(tune::Goal::default(), FromSweep::goal);
    let prediction = tune::predict(&observed, ratio, goal, min_drafts);
    let compared = sweep.map(|s| tune::compare(&prediction.rows, &s.figures())).unwrap_or_default();
    Ok(Evaluation { spec, sha256, source, since, observed, prediction, compared })
}

/// The exit code of a verdict.
fn code(v: &Verdict) -> u8 {
    match v {
        Verdict::Keep { .. } => 0,
        Verdict::Change { .. } => 1,
        Verdict::CannotTell { .. } => 2,
    }
}

/// `specd tune`: the table, the verdict and the change; with `--propose`, the commit.
pub async fn run(dirs: &Dirs, o: Options) -> Result<u8> {
    let mut doc = TuneJson { unit: o.unit.clone(), ..TuneJson::default() };
    let code = match tune_unit(dirs, &o, &mut doc).await {
        Ok(code) => code,
        Err(why) => {
            eprintln!("specd: {}: {why}", o.unit);
            doc.error = Some(why);
            2
        }
    };
    if o.json {
        doc.ok = code == 0;
        println!("{}", serde_json::to_string_pretty(&doc)?);
    }
    Ok(code)
}

async fn tune_unit(dirs: &Dirs, o: &Options, doc: &mut TuneJson) -> Result<u8, String> {
    let host = hostname(o.host.clone());
    let sweep = match &o.sweep {
        Some(f) => Some(calibrate::read(f, o.out.as_deref(), &o.unit, &host)?),
        None => None,
    };
    let store = Store::new(&dirs.state_dir);
    let e = evaluate(&store, &Probe::default(), &o.unit, sweep.as_ref(), o.min_drafts).await?;
    doc.engine = Some(e.spec.engine);
    doc.unit_sha256 = Some(e.sha256.clone());
    doc.source = e.source.as_ref().map(ToString::to_string);
    if !o.json {
        print!("{}", show::report(&o.unit, &e, sweep.as_ref()));
    }
    let code = code(&e.prediction.verdict);
    if let Verdict::Change { to, .. } = e.prediction.verdict {
        offer(o, &e, &host, to, doc);
        if let Some(p) = &o.propose {
            let message = show::message(&o.unit, &host, &e, sweep.as_ref());
            let proposed =
                propose::propose_blocking(p.clone(), &o.unit, to, message).await.map_err(|e| format!("{e:#}"))?;
            if !o.json {
                println!("{}", proposed.said());
            }
            doc.proposal = Some(proposed);
        }
    } else if o.propose.is_some() && !o.json {
        println!("nothing proposed");
    }
    doc.sweep = sweep;
    doc.compared = e.compared.clone();
    doc.observed = Some(e.observed);
    doc.prediction = Some(e.prediction);
    Ok(code)
}

/// The change as a diff of the spec file it was applied from (or `--file`).
fn offer(o: &Options, e: &Evaluation, host: &str, k: u32, doc: &mut TuneJson) {
    let file = o.file.clone().or_else(|| match &e.source {
        Some(Source::File { path }) => Some(PathBuf::from(path)),
        _ => None,
    });
    let Some(file) = file else {
        let why = match &e.source {
            Some(Source::Commit { path, commit, .. }) => format!(
                "the unit was applied from {path} at commit {}: --propose writes the change there (or --file a copy)",
                specd_spec::short(commit)
            ),
            _ => "specd does not know the spec file the unit came from: give it with --file".into(),
        };
        if !o.json {
            println!("{why}");
        }
        doc.spec_change_error = Some(why);
        return;
    };
    let name = file.display().to_string();
    doc.spec_file = Some(name.clone());
    let result = std::fs::read_to_string(&file)
        .map_err(|err| format!("{name}: {err}"))
        .and_then(|text| change::changed(&name, &text, Some(host), k).map(|new| change::diff(&name, &text, &new)));
    match result {
        Ok(d) => {
            if !o.json {
                print!("{d}");
            }
            doc.spec_change = Some(d);
        }
        Err(why) => {
            if !o.json {
                println!("the change cannot be written into {name} by itself: {why}");
            }
            doc.spec_change_error = Some(why);
        }
    }
}
