//! `specd sweep -f SWEEP.yaml`: an operator's benchmarking campaign as one command. Each point
//! of the sweep (the base spec with one combination of the matrix values) is applied through
//! the reconciler's apply path, exactly as `specd apply` does (drain, stop, empty cgroup, atomic
//! write, reload, start, verify, speculation proof; a rollback when it fails), then loaded at each
//! concurrency level. A point that fails is data: its outcome and the diagnosis verdict are
//! recorded and the sweep goes on. After each point its record is appended to
//! `<out>/results.jsonl` and fsync'd; `--resume` skips the points whose rendered unit was
//! measured already. While it runs the unit carries a Sweep hold (this process's pid), so a
//! running agent leaves it alone; at the end, or on SIGINT/SIGTERM, the unit is restored (or the
//! winner applied) through the same apply path and the hold cleared.

mod edit;
mod hold;
pub mod loadgen;
mod point;
pub mod report;
mod restore;
mod results;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Result;
use serde::Serialize;
use specd_spec::ParsedSpec;
use specd_spec::sweep::{self, After, ParsedSweep, Point, Prompts};

use crate::host::Host;
use crate::reconcile::context::{self, Dirs};
use crate::reconcile::{Ctx, Event, Events, Finish, Shutdown};
use crate::sweep::report::PointResult;
pub use edit::edit_spec;
use hold::SweepHold;
use point::point;
use restore::{after_target, apply_after, before, restore};
pub use results::{Best, Files, Objective, read_results};
use results::{append, goal, limits_text, offer_best, open_results, this_sweeps_results, write_reports};

/// The host a sweep runs on: the reconciler's [`Host`], and where its load goes.
pub trait SweepHost: Host + loadgen::Load {}
impl<T: Host + loadgen::Load> SweepHost for T {}

/// What the command line asks.
pub struct Options {
    pub file: PathBuf,
    pub resume: bool,
    pub write: bool,
    pub out: Option<PathBuf>,
    /// The final summary as one JSON document on stdout ([`Summary`]) instead of the table and
    /// the diff.
    pub json: bool,
    /// Measure only the base spec's `speculative.num_steps` and the one below it, whatever the
    /// matrix: the step cost `specd tune` calibrates on.
    pub calibrate: bool,
}

/// `specd sweep --json`: the final summary, one document on stdout. `ok` is true exactly when the
/// exit code is 0.
#[derive(Debug, Default, Serialize)]
pub struct Summary {
    pub ok: bool,
    /// Why the sweep changed nothing (a bad file, results already there, a unit held), or
    /// stopped (specd's own state or results file failed).
    pub error: Option<String>,
    pub sweep: Option<String>,
    pub unit: Option<String>,
    /// The output directory, and the files in it.
    pub out: Option<String>,
    pub files: Option<Files>,
    /// Points in the sweep, and points with a record (measured or failed) in this run or before.
    pub points: usize,
    pub recorded: usize,
    /// A signal stopped it (the unit was then restored).
    pub interrupted: bool,
    pub objective: Option<Objective>,
    /// What the unit was left on: `restore` (as before the sweep), `best` (the best point),
    /// `last-point` (specd had not deployed it before); and whether that apply ended on a
    /// verified unit.
    pub after: Option<String>,
    pub after_ok: bool,
    /// The best point under the objective (null: none met it).
    pub best: Option<Best>,
    /// The change of the base spec file that applies the best point (a unified diff; null when
    /// the file has its values already, or it cannot be edited by itself: `spec_change_error`).
    pub spec_change: Option<String>,
    pub spec_change_error: Option<String>,
    /// `--write` put the change into the file.
    pub spec_written: bool,
    /// This sweep's records, as in results.jsonl, in the sweep's order.
    pub results: Vec<PointResult>,
}

/// Everything a sweep reads before it touches the host; an error here changes nothing.
struct Prepared {
    parsed: ParsedSweep,
    base_path: PathBuf,
    base_text: String,
    base: ParsedSpec,
    points: Vec<Point>,
    prompts: Arc<Vec<String>>,
    out: PathBuf,
}

/// Read and check the sweep, its base spec and its prompts. `Err` is the message for stderr.
fn prepare(o: &Options) -> Result<Prepared, String> {
    let name = o.file.display().to_string();
    let text = std::fs::read_to_string(&o.file).map_err(|e| format!("{name}: {e}"))?;
    let mut parsed = sweep::parse_sweep(&text, &name).map_err(|d| d.to_string())?;
    // No host named: this machine's overlay, as `specd apply`.
    if parsed.sweep.spec.host.is_none() {
        parsed.sweep.spec.host = Some(context::hostname(None));
    }
    let base_path = parsed.base_path(&o.file);
    let base_name = base_path.display().to_string();
    let base_text = std::fs::read_to_string(&base_path).map_err(|e| format!("{base_name}: {e}"))?;
    let base = specd_spec::parse(&base_name, &base_text).map_err(|d| d.to_string())?;
    if o.calibrate {
        parsed.sweep.spec.matrix = calibration(&parsed, &base, &base_name)?;
    }
    let points = sweep::points(&parsed, &base).map_err(|d| d.to_string())?;
    let prompts = match (&parsed.sweep.spec.load.prompts, parsed.prompts_path(&o.file)) {
        (Prompts::File(_), Some(p)) => {
            let pn = p.display().to_string();
            let t = std::fs::read_to_string(&p).map_err(|e| format!("{pn}: {e}"))?;
            loadgen::prompts_from_jsonl(&pn, &t)?
        }
        _ => loadgen::BUILTIN_PROMPTS.iter().map(|s| s.to_string()).collect(),
    };
    let out = o.out.clone().unwrap_or_else(|| PathBuf::from(format!("specd-sweep-{}", parsed.sweep.metadata.name)));
    Ok(Prepared { parsed, base_path, base_text, base, points, prompts: Arc::new(prompts), out })
}

/// `--calibrate`'s matrix: the base spec's draft length and the one below it, the base's own
/// last (so that the unit is left on it, and a sweep that restores it restarts nothing).
fn calibration(parsed: &ParsedSweep, base: &ParsedSpec, base_name: &str) -> Result<sweep::Matrix, String> {
    let spec = base.resolve(parsed.sweep.spec.host.as_deref()).map_err(|d| d.to_string())?;
    let k = spec.speculative.as_ref().and_then(|s| s.num_steps).ok_or_else(|| {
        format!("{base_name}: --calibrate measures speculative.num_steps and the one below it, and this spec sets none")
    })?;
    if k < 2 {
        return Err(format!(
            "{base_name}: --calibrate needs speculative.num_steps 2 or more (a length below it), not {k}"
        ));
    }
    let values = vec![serde_json::Value::from(k - 1), serde_json::Value::from(k)];
    Ok(sweep::Matrix(vec![sweep::Axis { field: "speculative.num_steps".into(), values }]))
}

/// The sweep's own event sink: the apply's phases and warnings, indented under the point.
fn events() -> Events {
    Arc::new(|_unit: &str, e: &Event| match e {
        Event::Phase(m) => eprintln!("      {m}"),
        Event::Warning(m) => eprintln!("      WARNING: {m}"),
        Event::Plan(_) | Event::Progress(_) | Event::Waiting(_) => {}
    })
}

/// `specd sweep`: read and check everything, hold the unit, apply and load each point, leave the
/// host on a verified unit, then write the reports and show the best point. The exit code: 0,
/// 1 (refused before anything changed, or the unit left on a failed apply), 130 (interrupted).
pub async fn run(dirs: &Dirs, o: Options) -> Result<u8> {
    let json = o.json;
    let mut doc = Summary::default();
    let host = crate::host::RealHost::new(crate::machine::cgroup::Layout::host());
    let result = campaign(&host, dirs, &o, &mut doc, interrupts).await;
    if json {
        match &result {
            Ok(code) => doc.ok = *code == 0,
            Err(e) => doc.error = Some(format!("{e:#}")),
        }
        println!("{}", serde_json::to_string_pretty(&doc)?);
    }
    result
}

/// The reconcile context of the sweep's applies on `host` (they override holds: the sweep's own
/// hold is on the unit).
fn ctx_on<H: SweepHost>(host: &H, dirs: &Dirs, shutdown: Shutdown) -> Ctx<H> {
    context::ctx_on(host.clone(), dirs, events(), shutdown)
}

/// The sweep itself (see [`run`]) on `host`, stopped by what `interrupts` makes of the sweep's
/// `after`; what the summary says is filled in `doc` as it goes.
async fn campaign<H: SweepHost>(
    host: &H,
    dirs: &Dirs,
    o: &Options,
    doc: &mut Summary,
    interrupts: impl FnOnce(After) -> Shutdown,
) -> Result<u8> {
    let refuse = |doc: &mut Summary, why: String| -> Result<u8> {
        eprintln!("{why}");
        eprintln!("specd: nothing was changed on this host");
        doc.error = Some(format!("{why}; nothing was changed on this host"));
        Ok(1)
    };
    let p = match prepare(o) {
        Ok(p) => p,
        Err(e) => return refuse(doc, e),
    };
    let sw = &p.parsed.sweep;
    let unit = p.points[0].spec.unit.clone();
    let results_path = p.out.join("results.jsonl");
    doc.sweep = Some(sw.metadata.name.clone());
    doc.unit = Some(unit.clone());
    doc.out = Some(p.out.display().to_string());
    doc.points = p.points.len();
    let Some(prior) = open_results(&p.out, &results_path, o.resume)? else {
        doc.error = Some(format!(
            "{} holds results already (--resume to go on with them); nothing was changed on this host",
            results_path.display()
        ));
        eprintln!("specd: nothing was changed on this host");
        return Ok(1);
    };
    let shutdown = interrupts(sw.spec.after);
    let ctx = ctx_on(host, dirs, shutdown.clone());
    let hold = match SweepHold::take(&ctx.host, &ctx.store, &unit, &sw.metadata.name).await {
        Ok(h) => h,
        Err(why) => {
            eprintln!("specd: {unit}: {why}");
            eprintln!("specd: nothing was changed on this host");
            doc.error = Some(format!("{unit}: {why}; nothing was changed on this host"));
            return Ok(1);
        }
    };
    let before = match before(&ctx, &p.out, &unit, o.resume, &p.points) {
        Ok(b) => b,
        Err(e) => {
            hold.release(&ctx.store).await;
            return Err(e);
        }
    };

    let ran = run_points(&ctx, &p, &prior, &results_path, &shutdown).await;

    // Leave the host on a verified unit: the one before the sweep, or the winner.
    let final_ctx = ctx_on(host, dirs, Shutdown::never());
    if let Some(e) = ran.aborted {
        restore(&final_ctx, &unit, &before).await;
        hold.release(&final_ctx.store).await;
        return Err(e);
    }
    let results = this_sweeps_results(&p, &results_path)?;
    let judged = Judged::of(&p, &results);
    let after_ok = leave(&final_ctx, &p, &unit, &before, &judged, ran.interrupted, doc).await?;
    hold.release(&final_ctx.store).await;
    let code = match (ran.interrupted, after_ok) {
        (_, false) => 1,
        (true, true) => 130,
        (false, true) => 0,
    };
    summarize(&p, o, &results, &judged, &results_path, doc)?;
    Ok(code)
}

/// The sweep's records judged under its objective: the concurrency it is read at, its limits,
/// and the best point (`None`: none met it).
struct Judged<'a> {
    at: u32,
    limits: Vec<(&'static str, f64)>,
    winner: Option<&'a PointResult>,
}

impl<'a> Judged<'a> {
    fn of(p: &Prepared, results: &'a [PointResult]) -> Judged<'a> {
        let objective = &p.parsed.sweep.spec.objective;
        let at = p.parsed.objective_concurrency();
        let limits = objective.constraints.limits();
        let winner = report::best(results, goal(objective.maximize), at, &limits);
        Judged { at, limits, winner }
    }
}

/// What a sweep leaves its unit on, by the name the summary gives it: `last-point` when there is
/// nothing to apply after the points (`has_target` false: specd had not deployed the unit
/// before), `best` when the sweep asks for its winner, has one and ran to its end, else
/// `restore`.
fn after_name(has_target: bool, after: After, has_winner: bool, interrupted: bool) -> &'static str {
    match (has_target, after, has_winner) {
        (false, _, _) => "last-point",
        (true, After::Best, true) if !interrupted => "best",
        (true, _, _) => "restore",
    }
}

/// Leave the host on a verified unit after the points: the one before the sweep, or the
/// winner, applied through the same apply path. Whether that apply verified its unit.
async fn leave<H: SweepHost>(
    ctx: &Ctx<H>,
    p: &Prepared,
    unit: &str,
    before: &restore::Before,
    judged: &Judged<'_>,
    interrupted: bool,
    doc: &mut Summary,
) -> Result<bool> {
    let target = after_target(p, unit, before, judged.winner, interrupted);
    doc.interrupted = interrupted;
    let name = after_name(target.is_some(), p.parsed.sweep.spec.after, judged.winner.is_some(), interrupted);
    doc.after = Some(name.to_string());
    doc.after_ok = apply_after(ctx, target, unit).await?;
    Ok(doc.after_ok)
}

/// What a person reads (with --json: what a program reads): the reports written, the summary's
/// files, objective and records, and the best point with the spec change that applies it.
fn summarize(
    p: &Prepared,
    o: &Options,
    results: &[PointResult],
    judged: &Judged<'_>,
    results_path: &Path,
    doc: &mut Summary,
) -> Result<()> {
    let Judged { at, limits, winner } = judged;
    let objective = &p.parsed.sweep.spec.objective;
    let plotted = write_reports(p, results, *winner, *at, limits, !o.json)?;
    let goal_name = goal(objective.maximize).name();
    doc.recorded = results.len();
    doc.files = Some(Files {
        results: results_path.display().to_string(),
        table: p.out.join("table.md").display().to_string(),
        csv: p.out.join("results.csv").display().to_string(),
        plot: plotted.then(|| p.out.join("plot.svg").display().to_string()),
    });
    doc.objective = Some(Objective {
        maximize: objective.maximize,
        concurrency: *at,
        limits: limits.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
    });
    doc.results = results.to_vec();
    let Some(w) = winner else {
        if !o.json {
            println!("no point met the objective ({goal_name} at concurrency {at}{})", limits_text(limits));
        }
        return Ok(());
    };
    let wp = p.points.iter().find(|pt| pt.index == w.index).expect("the winner is a point");
    doc.best = Some(Best {
        index: wp.index,
        label: wp.label.clone(),
        values: wp.values.clone(),
        unit_sha256: wp.unit.sha256.clone(),
    });
    if !o.json {
        println!("best: {} ({goal_name} at concurrency {at}{})", wp.label, limits_text(limits));
    }
    offer_best(p, wp, o.write, doc, o.json)
}

/// The sweep's answer to SIGINT/SIGTERM: the point in progress stops at its next safe point, then
/// the `after` step runs. A second signal quits at once: the hold ends with this process, and
/// the next apply (the agent's, or a hand one) finishes whatever was in progress.
fn interrupts(after: After) -> Shutdown {
    let after_word = match after {
        After::Restore => "restore the unit as it was",
        After::Best => "apply the best point",
    };
    context::interruptible(
        Finish::Started,
        format!(
            "specd sweep: interrupted: the point in progress stops at its next safe point; then {after_word} (again to quit at once)"
        ),
        "specd sweep: interrupted again: quitting now; the unit is left as it is (a running agent takes it back; else `specd apply` it)".into(),
    )
}

/// How the points' loop ended.
struct Ran {
    /// A signal stopped it: the point in progress is not recorded.
    interrupted: bool,
    /// specd's own state or the results file failed: the sweep stops with this error.
    aborted: Option<anyhow::Error>,
}

/// Apply and load each point in order, appending its record; a point recorded by an earlier run
/// (`prior`, by its unit's hash) is skipped.
async fn run_points<H: SweepHost>(
    ctx: &Ctx<H>,
    p: &Prepared,
    prior: &[PointResult],
    results_path: &Path,
    shutdown: &Shutdown,
) -> Ran {
    let sw = &p.parsed.sweep;
    let n = p.points.len();
    let levels = &sw.spec.load.concurrency;
    eprintln!(
        "specd sweep {}: {n} point(s) of {}, load at concurrency {levels:?}; results in {}",
        sw.metadata.name,
        p.points[0].spec.unit,
        p.out.display()
    );
    for pt in &p.points {
        let i = pt.index + 1;
        if let Some(r) = prior.iter().rev().find(|r| r.unit_sha256 == pt.unit.sha256) {
            eprintln!(
                "[{i}/{n}] {}: {} before (unit {}), skipped",
                pt.label,
                r.outcome.as_str(),
                specd_spec::short(&r.unit_sha256)
            );
            continue;
        }
        if shutdown.is_set() {
            return Ran { interrupted: true, aborted: None };
        }
        let done = match point(ctx, p, pt, shutdown).await {
            Ok(Some(r)) => append(results_path, &r).map(|()| Some(r)),
            other => other,
        };
        match done {
            Ok(Some(r)) => {
                let verdict = r.verdict.as_deref().map_or(String::new(), |v| format!(": {v}"));
                eprintln!("[{i}/{n}] {}: {}{verdict}", pt.label, r.outcome.as_str());
            }
            Ok(None) => return Ran { interrupted: true, aborted: None },
            // specd's own state or the results file failed: stop here, but leave the host on a
            // verified unit and let go of it first.
            Err(e) => {
                eprintln!("[{i}/{n}] {}: the sweep stops: {e:#}", pt.label);
                return Ran { interrupted: false, aborted: Some(e) };
            }
        }
    }
    Ran { interrupted: false, aborted: None }
}

#[cfg(test)]
mod tests;
