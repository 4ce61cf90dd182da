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

pub mod loadgen;
pub mod report;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use specd_spec::sweep::{self, After, Amount, Metric, ParsedSweep, Point, Prompts};
use specd_spec::{ParsedSpec, Spec};

use crate::core::timing;
use crate::host::Host;
use crate::machine::atomic;
use crate::machine::store::{Hold, HoldKind, Outcome, Source, Store};
use crate::reconcile::context::{self, Dirs};
use crate::reconcile::{self, Ctx, DesiredState, Event, Events, Finish, Shutdown};
use crate::sweep::loadgen::Level;
use crate::sweep::report::{Goal, PointOutcome, PointResult};

/// The host a sweep runs on: the reconciler's [`Host`], and where its load goes.
pub trait SweepHost: Host + loadgen::Load {}
impl<T: Host + loadgen::Load> SweepHost for T {}

/// The unit as it was before the sweep: what `after: restore` applies again. Kept in the
/// output directory so that a resumed sweep restores the same thing.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Before {
    unit: String,
    /// The desired state specd had for the unit (`None`: specd never deployed it).
    spec: Option<Spec>,
    source: Option<Source>,
    sha256: Option<String>,
}

/// The sweep's hold on its unit: a running agent leaves the unit alone while this process lives
/// (and until the hold expires: a task pushes the expiry on every quarter of it, whatever the
/// sweep is doing, so a long point never outlives its hold).
struct SweepHold {
    unit: String,
    hold: Hold,
    refresher: tokio::task::JoinHandle<()>,
}

impl SweepHold {
    /// Hold the unit, unless someone else's hold is in effect (a suspend, a pin, a sweep that
    /// still runs: the one hold gate, [`Host::hold_in_effect`]).
    async fn take<H: SweepHost>(host: &H, store: &Store, unit: &str, name: &str) -> Result<SweepHold, String> {
        let st = store.peek(unit).map_err(|e| format!("{e:#}"))?;
        if let Some(h) = &st.hold
            && let crate::core::hold::HoldEffect::HandsOff(_) = host.hold_in_effect(Some(h))
        {
            return Err(format!("{}: a sweep does not take a unit someone holds", h.describe()));
        }
        let now = host.now();
        let (me, started) = host.me();
        let hold = Hold {
            until: Some(now + timing::SWEEP_HOLD_FOR.as_secs()),
            pid: Some(me),
            pid_start: started,
            ..Hold::new(HoldKind::Sweep, format!("specd sweep {name}"), now)
        };
        store.set_hold(unit, hold.clone()).await.map_err(|e| format!("{e:#}"))?;
        let refresher = {
            let (host, store, unit, mut hold) = (host.clone(), store.clone(), unit.to_string(), hold.clone());
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(timing::SWEEP_HOLD_FOR / 4).await;
                    // Only this sweep's hold (one set since by someone else stays as it is).
                    let pushed = Hold { until: Some(host.now() + timing::SWEEP_HOLD_FOR.as_secs()), ..hold.clone() };
                    match store.set_hold_if(&unit, pushed.clone(), |h| *h == hold).await {
                        Ok(true) => hold = pushed,
                        Ok(false) => return,
                        Err(e) => tracing::warn!("refreshing the hold on {unit}: {e:#}"),
                    }
                }
            })
        };
        Ok(SweepHold { unit: unit.into(), hold, refresher })
    }

    /// End the hold (only this sweep's: one set since by someone else stays).
    async fn release(self, store: &Store) {
        self.refresher.abort();
        let me = self.hold.pid;
        let why = "the sweep ended";
        if let Err(e) = store.clear_hold_if(&self.unit, why, |h| h.kind == HoldKind::Sweep && h.pid == me).await {
            tracing::warn!("clearing the hold on {}: {e:#}; it ends with this process", self.unit);
        }
    }
}

/// What the command line asks.
pub struct Options {
    pub file: PathBuf,
    pub resume: bool,
    pub write: bool,
    pub out: Option<PathBuf>,
    /// The final summary as one JSON document on stdout ([`Summary`]) instead of the table and
    /// the diff.
    pub json: bool,
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
fn append(path: &Path, r: &PointResult) -> Result<()> {
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

/// The sweep's own event sink: the apply's phases and warnings, indented under the point.
fn events() -> Events {
    Arc::new(|_unit: &str, e: &Event| match e {
        Event::Phase(m) => eprintln!("      {m}"),
        Event::Warning(m) => eprintln!("      WARNING: {m}"),
        Event::Plan(_) | Event::Progress(_) | Event::Waiting(_) => {}
    })
}

fn goal(m: Metric) -> Goal {
    match m {
        Metric::Throughput => Goal::Throughput,
        Metric::TokensPerSPerRequest => Goal::TokSPerRequest,
        Metric::AcceptLength => Goal::AcceptLength,
    }
}

fn f1(v: Option<f64>) -> String {
    v.map_or("–".into(), |v| format!("{v:.1}"))
}

/// One progress line per level.
fn level_line(l: &loadgen::LevelResult) -> String {
    let mut s = format!(
        "    concurrency {}: {:.1} tok/s total, {} tok/s per request (p10 {}), TTFT p50/p99 {}/{} ms, ITL p50/p99 {}/{} ms",
        l.concurrency,
        l.throughput,
        f1(l.tok_s_median),
        f1(l.tok_s_p10),
        f1(l.ttft_ms_p50),
        f1(l.ttft_ms_p99),
        f1(l.itl_ms_p50),
        f1(l.itl_ms_p99)
    );
    if let Some(a) = l.accept_length {
        s.push_str(&format!(", accept length {a:.2}"));
    }
    if let Some(r) = l.accept_rate {
        s.push_str(&format!(", accept rate {:.0}%", r * 100.0));
    }
    if l.errors > 0 {
        s.push_str(&format!(
            ", {} of {} requests failed: {}",
            l.errors,
            l.errors + l.requests,
            l.first_error.as_deref().unwrap_or("")
        ));
    }
    s
}

/// `max_running_requests` as the server reports it (the engine facts' `Reported` row).
async fn reported_max_running<H: SweepHost>(host: &H, spec: &Spec, invocation: &str) -> Option<Value> {
    let facts = specd_spec::engine_facts(spec.engine);
    let row = facts.reported.iter().find(|r| r.field == "server.max_running_requests")?;
    let info = host.reported_args(&spec.base_url(), spec, invocation).await?.ok()?;
    info.pointer(row.pointer).cloned().filter(|v| !v.is_null())
}

/// The verdict on how an instance ended (`None`: the unit's newest that ended), for the record:
/// (verdict, summary).
async fn verdict_of<H: SweepHost>(host: &H, unit: &str, invocation: Option<&str>) -> (Option<String>, Option<String>) {
    match host.ending(unit, invocation.unwrap_or(""), timing::POINT_VERDICT_WITHIN).await {
        Some(e) => (Some(e.verdict), Some(e.summary)),
        None => (None, None),
    }
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
    let at = p.parsed.objective_concurrency();
    let limits = sw.spec.objective.constraints.limits();
    let winner = report::best(&results, goal(sw.spec.objective.maximize), at, &limits);
    let target = after_target(&p, &unit, &before, winner, ran.interrupted);
    doc.interrupted = ran.interrupted;
    doc.after = Some(
        match (&target, sw.spec.after, winner) {
            (None, _, _) => "last-point",
            (Some(_), After::Best, Some(_)) if !ran.interrupted => "best",
            (Some(_), _, _) => "restore",
        }
        .to_string(),
    );
    let mut code = if ran.interrupted { 130 } else { 0 };
    doc.after_ok = apply_after(&final_ctx, target, &unit).await?;
    if !doc.after_ok {
        code = 1;
    }
    hold.release(&final_ctx.store).await;

    // What a person reads (with --json: what a program reads).
    let plotted = write_reports(&p, &results, winner, at, &limits, !o.json)?;
    let goal_name = goal(sw.spec.objective.maximize).name();
    doc.recorded = results.len();
    doc.files = Some(Files {
        results: results_path.display().to_string(),
        table: p.out.join("table.md").display().to_string(),
        csv: p.out.join("results.csv").display().to_string(),
        plot: plotted.then(|| p.out.join("plot.svg").display().to_string()),
    });
    doc.objective = Some(Objective {
        maximize: sw.spec.objective.maximize,
        concurrency: at,
        limits: limits.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
    });
    doc.results = results.clone();
    let Some(w) = winner else {
        if !o.json {
            println!("no point met the objective ({goal_name} at concurrency {at}{})", limits_text(&limits));
        }
        return Ok(code);
    };
    let wp = p.points.iter().find(|pt| pt.index == w.index).expect("the winner is a point");
    doc.best = Some(Best {
        index: wp.index,
        label: wp.label.clone(),
        values: wp.values.clone(),
        unit_sha256: wp.unit.sha256.clone(),
    });
    if !o.json {
        println!("best: {} ({goal_name} at concurrency {at}{})", wp.label, limits_text(&limits));
    }
    offer_best(&p, wp, o.write, doc, o.json)?;
    Ok(code)
}

/// The records of an earlier run of the sweep in `out`, to go on with. `None` (said why) when
/// there are some and `--resume` was not given: nothing may change then. A record cut short by
/// a kill is cut off the file before anything is appended after it.
fn open_results(out: &Path, results_path: &Path, resume: bool) -> Result<Option<Vec<PointResult>>> {
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

/// The results of this sweep's points, in its order (a record of an older run of the sweep
/// file whose point is gone is left out).
fn this_sweeps_results(p: &Prepared, results_path: &Path) -> Result<Vec<PointResult>> {
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

/// What the host is left on: the best point with `after: best` when there is one and the sweep
/// was not interrupted; else the unit as it was before, if specd had deployed it.
fn after_target(
    p: &Prepared,
    unit: &str,
    before: &Before,
    winner: Option<&PointResult>,
    interrupted: bool,
) -> Option<DesiredState> {
    match (p.parsed.sweep.spec.after, winner) {
        (After::Best, Some(w)) if !interrupted => p.points.iter().find(|pt| pt.index == w.index).map(|pt| {
            eprintln!("after: applying the best point, {}", pt.label);
            DesiredState::new(pt.spec.clone(), Some(Source::File { path: p.base_path.display().to_string() }))
        }),
        _ => before.spec.clone().map(|spec| {
            eprintln!("after: restoring {unit} as it was before the sweep");
            DesiredState::new(spec, before.source.clone())
        }),
    }
}

/// Apply what the host is left on. False when that apply did not end on a verified unit.
async fn apply_after<H: SweepHost>(ctx: &Ctx<H>, target: Option<DesiredState>, unit: &str) -> Result<bool> {
    match target {
        Some(d) => {
            let r = reconcile::reconcile(ctx, &d, false).await?;
            eprintln!("after: {}", r.verdict);
            Ok(matches!(r.outcome, Some(Outcome::Applied | Outcome::Started) | None))
        }
        None => {
            eprintln!(
                "after: specd had not deployed {unit} before the sweep: it is left on the last point applied (`specd apply` another spec, or stop it)"
            );
            Ok(true)
        }
    }
}

/// The reports in the output directory (table.md, results.csv, plot.svg), and the table on
/// stdout when `print`. Whether the plot was drawn.
fn write_reports(
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
fn offer_best(p: &Prepared, wp: &Point, write: bool, doc: &mut Summary, json: bool) -> Result<()> {
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

/// After a sweep that stopped on an error: the unit as it was, if specd had deployed it.
async fn restore<H: SweepHost>(ctx: &Ctx<H>, unit: &str, before: &Before) {
    let Some(spec) = before.spec.clone() else { return };
    eprintln!("after: restoring {unit} as it was before the sweep");
    match reconcile::reconcile(ctx, &DesiredState::new(spec, before.source.clone()), false).await {
        Ok(r) => eprintln!("after: {}", r.verdict),
        Err(e) => eprintln!("after: restoring {unit}: {e:#}"),
    }
}

fn limits_text(limits: &[(&str, f64)]) -> String {
    limits.iter().map(|(k, v)| format!(", {k} ≤ {v}")).collect()
}

/// What the sweep restores: recorded at its first run, read again on resume.
/// The one recorded by an earlier run of this sweep is what is restored when this run goes on
/// with it (`--resume`), or when the unit is still on one of the sweep's points (that run was
/// killed before it restored); otherwise the unit as it is now. Private (0600): the spec may hold
/// literal environment values.
fn before<H: SweepHost>(ctx: &Ctx<H>, out: &Path, unit: &str, resume: bool, points: &[Point]) -> Result<Before> {
    let path = out.join("before.json");
    let st = ctx.store.peek(unit)?;
    let on_a_point = st.desired.as_ref().is_some_and(|d| points.iter().any(|p| p.unit.sha256 == d.sha256));
    if let Some(b) = atomic::read_opt(&path)?
        && (resume || on_a_point)
    {
        let b: Before = serde_json::from_slice(&b).with_context(|| format!("reading {}", path.display()))?;
        if b.unit == unit {
            return Ok(b);
        }
    }
    let b = match st.desired {
        Some(d) => Before { unit: unit.into(), spec: Some(d.spec), source: d.source, sha256: Some(d.sha256) },
        None => Before { unit: unit.into(), spec: None, source: None, sha256: None },
    };
    atomic::atomic_write(&path, serde_json::to_string_pretty(&b)?.as_bytes(), 0o600)?;
    Ok(b)
}

/// Apply one point and load it. `None`: interrupted (nothing recorded; the point is measured
/// again on resume).
async fn point<H: SweepHost>(
    ctx: &Ctx<H>,
    p: &Prepared,
    pt: &Point,
    shutdown: &Shutdown,
) -> Result<Option<PointResult>> {
    let (i, n) = (pt.index + 1, p.points.len());
    let unit = &pt.spec.unit;
    eprintln!("[{i}/{n}] {}: applying unit {}", pt.label, specd_spec::short(&pt.unit.sha256));
    let mut r = PointResult {
        index: pt.index,
        label: pt.label.clone(),
        values: pt.values.clone(),
        unit_sha256: pt.unit.sha256.clone(),
        outcome: PointOutcome::Measured,
        verdict: None,
        summary: None,
        apply_s: None,
        max_running_requests: None,
        proof: None,
        levels: vec![],
        time: 0,
    };
    let d = DesiredState::new(pt.spec.clone(), Some(Source::File { path: p.base_path.display().to_string() }));
    let t0 = Instant::now();
    let report = reconcile::reconcile(ctx, &d, false).await;
    if shutdown.is_set() {
        return Ok(None);
    }
    let report = match report {
        Ok(rep) => rep,
        Err(e) => {
            r.outcome = PointOutcome::ApplyFailed;
            r.summary = Some(format!("{e:#}"));
            r.time = ctx.host.now();
            return Ok(Some(r));
        }
    };
    let ok = matches!(report.outcome, Some(Outcome::Applied | Outcome::Started))
        || (report.outcome.is_none() && report.plan.steps.is_empty());
    if !ok {
        // The failed instance is the newest that ended (the rollback's runs).
        let (v, s) = verdict_of(&ctx.host, unit, None).await;
        eprintln!("[{i}/{n}] {}: {}", pt.label, report.verdict);
        r.outcome = PointOutcome::ApplyFailed;
        r.verdict = v;
        r.summary = s.or(Some(report.verdict));
        r.time = ctx.host.now();
        return Ok(Some(r));
    }
    r.apply_s = Some(t0.elapsed().as_secs_f64());
    let props = ctx.host.show(unit).await?;
    r.max_running_requests = reported_max_running(&ctx.host, &pt.spec, &props.invocation_id).await;
    r.proof = ctx.store.peek(unit)?.speculation.filter(|s| s.sha256 == pt.unit.sha256).map(|s| s.measured.figure());
    eprintln!(
        "[{i}/{n}] {}: verified and ready in {:.1} s{}",
        pt.label,
        r.apply_s.unwrap_or(0.0),
        r.proof.as_deref().map_or(String::new(), |f| format!(" ({f})"))
    );
    let load = &p.parsed.sweep.spec.load;
    let api = match load.api.for_engine(pt.spec.engine) {
        sweep::Api::Generate => loadgen::Api::Generate,
        _ => loadgen::Api::Completions,
    };
    for &c in &load.concurrency {
        let (requests, duration) = match load.amount() {
            Amount::Requests(n) => (n, None),
            Amount::Duration(d) => (0, Some(d)),
        };
        let level = Level {
            base_url: pt.spec.base_url(),
            engine: pt.spec.engine,
            api,
            model: Some(pt.spec.server.served_model_name.clone().unwrap_or_else(|| pt.spec.model.clone())),
            concurrency: c,
            requests,
            duration,
            warmup: load.warmup,
            max_tokens: load.max_tokens,
            prompts: p.prompts.clone(),
            timeout: Duration::from_secs(300),
        };
        let l = tokio::select! {
            l = ctx.host.load(&level) => l,
            _ = shutdown.wait() => return Ok(None),
        };
        eprintln!("{}", level_line(&l));
        r.levels.push(l);
        // Did the server die under the load? The instance verified is no longer the unit's
        // (also when systemd restarted it and the requests went on against the new one).
        let now = ctx.host.show(unit).await?;
        if now.invocation_id != props.invocation_id || !now.active_state.is_up() || now.main_pid != props.main_pid {
            let (v, s) = verdict_of(&ctx.host, unit, Some(&props.invocation_id)).await;
            r.outcome = PointOutcome::DiedUnderLoad;
            r.verdict = v.or(Some("unknown".into()));
            r.summary = s;
            break;
        }
    }
    r.time = ctx.host.now();
    Ok(Some(r))
}

/// The base spec file with the point's values written in place of the base's: each value
/// edited where it stands (the rest of the file byte for byte), a field the file leaves out added
/// under its section. The result must render the point's unit, or it is refused.
pub fn edit_spec(base: &ParsedSpec, text: &str, pt: &Point, host: Option<&str>) -> Result<String, String> {
    // The point's unit, or why not.
    let renders = |t: &str| -> Result<(), String> {
        let parsed = specd_spec::parse(base.file(), t).map_err(|d| d.to_string())?;
        let spec = parsed.resolve(host).map_err(|d| d.to_string())?;
        if specd_spec::render(&spec).sha256 == pt.unit.sha256 {
            Ok(())
        } else {
            Err("the edited file would not render the point's unit (does a host overlay set the swept field?)".into())
        }
    };
    // The matrix values, and the fields the engine's rules derive from them where the file
    // writes them (SGLang's draft tokens = steps + 1)...
    let mut out = text.to_string();
    let written = |f: &str| base.position(&format!("spec.{f}")).is_some();
    for (field, value) in pt.values.iter().chain(pt.derived.iter().filter(|(f, _)| written(f))) {
        out = set_value(base.file(), &out, &format!("spec.{field}"), value)?;
    }
    if renders(&out).is_ok() {
        return Ok(out);
    }
    // ...then the derived fields the file leaves out, if the point's unit needs them.
    for (field, value) in pt.derived.iter().filter(|(f, _)| !written(f)) {
        out = set_value(base.file(), &out, &format!("spec.{field}"), value)?;
    }
    renders(&out).map(|()| out)
}

/// A value as YAML writes it: numbers and booleans as they are, a string plain when it reads
/// back as the same string, else double-quoted (JSON's quoting is YAML's).
fn yaml_scalar(v: &Value) -> String {
    match v {
        Value::String(s) => {
            let plain = !s.is_empty()
                && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c))
                && !s.starts_with(['-', '.'])
                && s.parse::<f64>().is_err()
                && !matches!(
                    s.to_ascii_lowercase().as_str(),
                    "true" | "false" | "null" | "yes" | "no" | "on" | "off" | "~"
                );
            if plain { s.clone() } else { Value::String(s.clone()).to_string() }
        }
        v => v.to_string(),
    }
}

/// Byte offset of a 1-based (line, column) in `text`.
fn offset(text: &str, line: u64, column: u64) -> Option<usize> {
    let start: usize = text.split_inclusive('\n').take(line.saturating_sub(1) as usize).map(str::len).sum();
    let l = text[start..].split('\n').next()?;
    let col = l.char_indices().nth(column.saturating_sub(1) as usize).map_or(l.len(), |(b, _)| b);
    Some(start + col)
}

/// Where the scalar that starts at `at` ends (quoted, or plain up to a comment, a flow
/// separator or the end of the line).
fn scalar_end(text: &str, at: usize) -> usize {
    let rest = &text[at..];
    let line = rest.split('\n').next().unwrap_or("");
    let bytes = line.as_bytes();
    match bytes.first() {
        Some(b'"') => {
            let mut i = 1;
            while i < bytes.len() {
                match bytes[i] {
                    b'\\' => i += 2,
                    b'"' => return at + i + 1,
                    _ => i += 1,
                }
            }
            at + line.len()
        }
        Some(b'\'') => {
            let mut i = 1;
            while i < bytes.len() {
                if bytes[i] == b'\'' {
                    if bytes.get(i + 1) == Some(&b'\'') {
                        i += 2;
                        continue;
                    }
                    return at + i + 1;
                }
                i += 1;
            }
            at + line.len()
        }
        _ => {
            let mut end = line.len();
            for (i, c) in line.char_indices() {
                if matches!(c, ',' | '}' | ']') || (c == '#' && i > 0 && line[..i].ends_with([' ', '\t'])) {
                    end = i;
                    break;
                }
            }
            at + line[..end].trim_end().len()
        }
    }
}

/// Set one scalar field of a YAML spec file, in place. A field the file leaves out is added to
/// its section (a block section: a line under it, indented like its first field; a flow
/// section: the first entry).
fn set_value(file: &str, text: &str, path: &str, value: &Value) -> Result<String, String> {
    let parsed = specd_spec::parse(file, text).map_err(|d| d.to_string())?;
    let new = yaml_scalar(value);
    if let Some((_, (vl, vc))) = parsed.position(path) {
        let at = offset(text, vl, vc).ok_or_else(|| format!("{path}: position out of the file"))?;
        if text[at..].starts_with(['{', '[', '|', '>']) {
            return Err(format!("{path} is not a single value in {file}"));
        }
        let end = scalar_end(text, at);
        return Ok(format!("{}{new}{}", &text[..at], &text[end..]));
    }
    let (parent, key) = path.rsplit_once('.').ok_or_else(|| format!("{path}: not a field"))?;
    let Some(((kl, _), (vl, vc))) = parsed.position(parent) else {
        return Err(format!("{file} has no `{parent}` section to add `{key}: {new}` to: add it by hand"));
    };
    let at = offset(text, vl, vc).ok_or_else(|| format!("{parent}: position out of the file"))?;
    if text[at..].starts_with('{') {
        let inner = text[at + 1..].trim_start();
        let sep = if inner.starts_with('}') { "" } else { ", " };
        return Ok(format!("{}{{{key}: {new}{sep}{}", &text[..at], &text[at + 1..]));
    }
    if vl > kl {
        // A block section: its first field's column is its indentation.
        let line_start = at - (vc as usize - 1).min(at);
        let indent = &text[line_start..at];
        if indent.chars().all(|c| c == ' ') {
            return Ok(format!("{}{indent}{key}: {new}\n{}", &text[..line_start], &text[line_start..]));
        }
    }
    Err(format!("cannot add `{key}: {new}` under `{parent}` in {file}: add it by hand"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const SPEC: &str = "apiVersion: specd/v1
kind: InferenceService
metadata: {name: q}
spec:
  unit: q.service
  engine: sglang
  model: /models/q   # the weights
  server: {port: 30000, tp_size: 4}
  speculative:
    algorithm: EAGLE
    num_steps: 3 # tuned by hand
    eagle_topk: 1
";

    #[test]
    fn a_value_is_edited_in_place_and_the_rest_kept_byte_for_byte() {
        let out = set_value("q.yaml", SPEC, "spec.speculative.num_steps", &json!(5)).unwrap();
        assert_eq!(out, SPEC.replace("num_steps: 3 # tuned", "num_steps: 5 # tuned"));
        let out = set_value("q.yaml", SPEC, "spec.server.tp_size", &json!(8)).unwrap();
        assert_eq!(out, SPEC.replace("tp_size: 4}", "tp_size: 8}"));
        let out = set_value("q.yaml", SPEC, "spec.model", &json!("/models/q two")).unwrap();
        assert_eq!(out, SPEC.replace("model: /models/q   #", "model: \"/models/q two\"   #"));
    }

    #[test]
    fn a_missing_field_is_added_to_its_section() {
        let out = set_value("q.yaml", SPEC, "spec.speculative.num_draft_tokens", &json!(6)).unwrap();
        assert_eq!(out, SPEC.replace("    algorithm: EAGLE\n", "    num_draft_tokens: 6\n    algorithm: EAGLE\n"));
        let out = set_value("q.yaml", SPEC, "spec.server.max_running_requests", &json!(16)).unwrap();
        assert_eq!(out, SPEC.replace("server: {port", "server: {max_running_requests: 16, port"));
        let err = set_value("q.yaml", SPEC, "spec.service.timeout_stop_sec", &json!(30)).unwrap_err();
        assert!(err.contains("add it by hand"), "{err}");
    }

    #[test]
    fn scalars_are_written_as_yaml_reads_them() {
        assert_eq!(yaml_scalar(&json!(3)), "3");
        assert_eq!(yaml_scalar(&json!(0.85)), "0.85");
        assert_eq!(yaml_scalar(&json!(true)), "true");
        assert_eq!(yaml_scalar(&json!("EAGLE")), "EAGLE");
        assert_eq!(yaml_scalar(&json!("on")), "\"on\"");
        assert_eq!(yaml_scalar(&json!("12")), "\"12\"");
        assert_eq!(yaml_scalar(&json!("a b: c")), "\"a b: c\"");
    }

    #[test]
    fn a_torn_last_line_is_ignored_and_a_bad_whole_line_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("results.jsonl");
        let r = crate::sweep::report::tests::campaign();
        let mut text = String::new();
        for x in &r[..2] {
            text.push_str(&serde_json::to_string(x).unwrap());
            text.push('\n');
        }
        let whole = text.len();
        text.push_str(&serde_json::to_string(&r[2]).unwrap()[..40]);
        std::fs::write(&p, &text).unwrap();
        let (got, n) = read_results(&p).unwrap();
        assert_eq!((got.len(), n), (2, whole));
        std::fs::write(&p, format!("{}\nnot json\n", serde_json::to_string(&r[0]).unwrap())).unwrap();
        let e = format!("{:#}", read_results(&p).unwrap_err());
        assert!(e.contains("results.jsonl:2: not a sweep result"), "{e}");
        assert_eq!(read_results(&dir.path().join("none.jsonl")).unwrap().0.len(), 0);
    }

    /// A sweep takes a unit only when no one else's hold is in effect, by the agent's own gate:
    /// a live sweep, a suspend, a pin, a hold that names no process (until it expires) keep
    /// it out; an expired hold, or a sweep whose process is gone, does not.
    #[tokio::test(start_paused = true)]
    async fn a_sweep_takes_a_unit_only_when_no_other_hold_is_in_effect() {
        use crate::host::fake::{EPOCH, FakeHost};
        let dir = tempfile::tempdir().unwrap();
        let host = FakeHost::new("u.service", &dir.path().join("units"));
        let store = Store::new(dir.path().join("state"));
        let other = host.spawn_holder();
        let sweep = |pid, until| Hold { pid, until, ..Hold::new(HoldKind::Sweep, "specd sweep other", EPOCH) };
        let cases = [
            (sweep(Some(other), Some(EPOCH + 60)), false),
            (sweep(None, None), false),
            (sweep(None, Some(EPOCH + 60)), false),
            (Hold::new(HoldKind::Suspend, "root@h (specd suspend)", EPOCH), false),
            (Hold { desired_at_pin: Some("a".repeat(64)), ..Hold::new(HoldKind::Pin, "root@h", EPOCH) }, false),
            (sweep(Some(other), Some(EPOCH)), true),
            (sweep(None, Some(EPOCH)), true),
        ];
        for (hold, taken) in cases {
            store.set_hold("u.service", hold.clone()).await.unwrap();
            let got = SweepHold::take(&host, &store, "u.service", "mine").await;
            assert_eq!(got.is_ok(), taken, "{}", hold.describe());
            if let Ok(h) = got {
                assert_eq!(h.hold.pid, Some(host.me().0));
                h.release(&store).await;
            }
        }
        host.end_holder(other);
        store.set_hold("u.service", sweep(Some(other), Some(EPOCH + 60))).await.unwrap();
        let h = SweepHold::take(&host, &store, "u.service", "mine").await.expect("a dead sweep's hold is stale");
        h.release(&store).await;
        assert_eq!(store.peek("u.service").unwrap().hold, None);
    }

    // The sweep on the fake host and tokio's paused clock: applies, load, deaths and the hold,
    // without a machine.

    const UNIT: &str = "sglang-qwen.service";

    const BASE: &str = "apiVersion: specd/v1
kind: InferenceService
metadata: {name: qwen}
spec:
  unit: sglang-qwen.service
  engine: sglang
  command: [/opt/sglang/bin/python3, -m, sglang.launch_server]
  model: /models/qwen
  server: {port: 30000}
  speculative: {algorithm: EAGLE, draft_model: /models/draft, num_steps: 3, eagle_topk: 1, num_draft_tokens: 4}
  service: {timeout_stop_sec: 10, drain_timeout_sec: 5}
";

    const SWEEP: &str = "apiVersion: specd/v1
kind: Sweep
metadata: {name: qwen-steps}
spec:
  base: qwen.yaml
  matrix:
    speculative.num_steps: [2, 5]
  load: {concurrency: [1, 4], requests: 8, warmup: 0, max_tokens: 16, prompts: builtin}
  objective: {maximize: throughput, at_concurrency: 4}
  after: restore
";

    /// A sweep's files in `dir`, the host (its unit deployed from the base spec), what the sweep
    /// reads, and its options.
    async fn swept(dir: &Path) -> (crate::host::fake::FakeHost, Dirs, Prepared, Options) {
        std::fs::write(dir.join("qwen.yaml"), BASE).unwrap();
        std::fs::write(dir.join("sweep.yaml"), SWEEP).unwrap();
        let dirs = Dirs { state_dir: dir.join("state"), unit_dir: dir.join("units") };
        let o = Options {
            file: dir.join("sweep.yaml"),
            resume: false,
            write: false,
            out: Some(dir.join("out")),
            json: true,
        };
        let p = prepare(&o).unwrap();
        let host = crate::host::fake::FakeHost::new(UNIT, &dirs.unit_dir);
        let base = specd_spec::parse("qwen.yaml", BASE).unwrap().resolve(None).unwrap();
        host.serves(&base, false);
        for pt in &p.points {
            host.serves(&pt.spec, false);
        }
        let ctx = ctx_on(&host, &dirs, Shutdown::never());
        let r = reconcile::reconcile(&ctx, &DesiredState::new(base, None), false).await.unwrap();
        assert_eq!(r.outcome, Some(Outcome::Applied), "{}", r.verdict);
        (host, dirs, p, o)
    }

    #[tokio::test(start_paused = true)]
    async fn a_point_whose_server_dies_under_load_is_recorded_with_its_verdict_and_the_sweep_goes_on() {
        let dir = tempfile::tempdir().unwrap();
        let (host, dirs, p, o) = swept(dir.path()).await;
        let base_argv = host.serving().unwrap();
        host.dies_under_load(&p.points[0].spec);
        let mut doc = Summary::default();
        let code = campaign(&host, &dirs, &o, &mut doc, |_| Shutdown::never()).await.unwrap();
        assert_eq!(code, 0, "{doc:?}");
        let [died, measured] = doc.results.as_slice() else { panic!("{:?}", doc.results) };
        // The first point died at its first level: recorded with the diagnosis's verdict, and
        // not loaded further.
        assert_eq!(died.outcome, PointOutcome::DiedUnderLoad);
        assert_eq!(died.verdict.as_deref(), Some("crash"));
        assert_eq!(died.levels.len(), 1);
        assert_eq!(died.levels[0].errors, 8);
        // The sweep went on to the next point, measured at each level.
        assert_eq!(measured.outcome, PointOutcome::Measured);
        assert_eq!(measured.levels.iter().map(|l| l.concurrency).collect::<Vec<_>>(), [1, 4]);
        assert_eq!(doc.best.as_ref().map(|b| b.label.as_str()), Some(measured.label.as_str()));
        // Both records are on disk; the unit is restored, and the sweep's hold is gone.
        assert_eq!(read_results(&dir.path().join("out/results.jsonl")).unwrap().0.len(), 2);
        assert_eq!(doc.after.as_deref(), Some("restore"));
        assert!(doc.after_ok);
        assert_eq!(host.serving(), Some(base_argv));
        assert_eq!(Store::new(&dirs.state_dir).peek(UNIT).unwrap().hold, None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_sweep_s_hold_is_pushed_on_while_it_runs_and_expires_once_it_no_longer_is() {
        let dir = tempfile::tempdir().unwrap();
        let (host, dirs, _, _) = swept(dir.path()).await;
        let store = Store::new(&dirs.state_dir);
        let t0 = tokio::time::Instant::now();
        let h = SweepHold::take(&host, &store, UNIT, "qwen-steps").await.unwrap();
        // Three hours into a long point: the hold was pushed on, and keeps the agent out.
        tokio::time::sleep_until(t0 + Duration::from_secs(3 * 3600)).await;
        let held = store.peek(UNIT).unwrap().hold.unwrap();
        assert!(held.until.unwrap() > host.now() + 3600, "{}", held.describe());
        assert!(matches!(host.hold_effect(Some(&held), "d"), crate::core::hold::HoldEffect::HandsOff(_)));
        // A sweep that no longer pushes it (hung): the hold expires 2 h after its last push, and
        // the agent takes the unit back although the sweep's process lives.
        h.refresher.abort();
        tokio::time::sleep(timing::SWEEP_HOLD_FOR).await;
        let held = store.peek(UNIT).unwrap().hold.unwrap();
        assert!(
            matches!(host.hold_effect(Some(&held), "d"), crate::core::hold::HoldEffect::Expired(w) if w.contains("expired at")),
            "{}",
            held.describe()
        );
        assert!(host.alive(host.me().0));
    }
}
