//! One point of a sweep: applied through the reconciler, loaded at each concurrency, recorded
//! (a failed point with its diagnosis).

use super::*;
use crate::core::record::{Outcome, Source};
use crate::core::timing;
use crate::host::{Journal, Server};
use crate::reconcile::{Ctx, DesiredState, Shutdown};
use crate::sweep::loadgen::Level;
use crate::sweep::report::{PointOutcome, PointResult};
use anyhow::Result;
use serde_json::Value;
use specd_spec::Spec;
use specd_spec::sweep::{self, Amount, Point};
use std::time::{Duration, Instant};

pub(super) fn f1(v: Option<f64>) -> String {
    v.map_or("–".into(), |v| format!("{v:.1}"))
}

/// One progress line per level.
pub(super) fn level_line(l: &loadgen::LevelResult) -> String {
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
pub(super) async fn reported_max_running<H: Server>(host: &H, spec: &Spec, invocation: &str) -> Option<Value> {
    let facts = specd_spec::engine_facts(spec.engine);
    let row = facts.reported.iter().find(|r| r.field == "server.max_running_requests")?;
    let info = host.reported_args(&spec.base_url(), spec, invocation).await?.ok()?;
    info.pointer(row.pointer).cloned().filter(|v| !v.is_null())
}

/// The verdict on how an instance ended (`None`: the unit's newest that ended), for the record:
/// (verdict, summary).
pub(super) async fn verdict_of<H: Journal>(
    host: &H,
    unit: &str,
    invocation: Option<&str>,
) -> (Option<String>, Option<String>) {
    match host.ending(unit, invocation.unwrap_or(""), timing::POINT_VERDICT_WITHIN).await {
        Some(e) => (Some(e.verdict), Some(e.summary)),
        None => (None, None),
    }
}

/// Apply one point and load it. `None`: interrupted (nothing recorded; the point is measured
/// again on resume).
pub(super) async fn point<H: SweepHost>(
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
    let t0 = Instant::now();
    match apply_point(ctx, p, pt, shutdown, &mut r).await {
        Applied::Interrupted => return Ok(None),
        Applied::Failed => {
            r.time = ctx.host.now();
            return Ok(Some(r));
        }
        Applied::Verified => {}
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
    if load_point(ctx, p, pt, &props, shutdown, &mut r).await? == Loaded::Interrupted {
        return Ok(None);
    }
    r.time = ctx.host.now();
    Ok(Some(r))
}

/// How a point's apply ended.
enum Applied {
    /// A signal came during it: nothing is recorded.
    Interrupted,
    /// It did not leave the point's unit running and verified: `r` says why.
    Failed,
    /// The point's unit runs, verified.
    Verified,
}

/// The point's apply, through the reconciler as `specd apply` does; a failed one's outcome and
/// diagnosis go into `r`.
async fn apply_point<H: SweepHost>(
    ctx: &Ctx<H>,
    p: &Prepared,
    pt: &Point,
    shutdown: &Shutdown,
    r: &mut PointResult,
) -> Applied {
    let d = DesiredState::new(pt.spec.clone(), Some(Source::File { path: p.base_path.display().to_string() }));
    let report = crate::commands::in_turn(ctx, &d, false).await;
    if shutdown.is_set() {
        return Applied::Interrupted;
    }
    let report = match report {
        Ok(rep) => rep,
        Err(e) => {
            r.outcome = PointOutcome::ApplyFailed;
            r.summary = Some(format!("{e:#}"));
            return Applied::Failed;
        }
    };
    let ok = matches!(report.outcome, Some(Outcome::Applied | Outcome::Started))
        || (report.outcome.is_none() && report.plan.steps.is_empty());
    if !ok {
        // The failed instance is the newest that ended (the rollback's runs).
        let (v, s) = verdict_of(&ctx.host, &pt.spec.unit, None).await;
        eprintln!("[{}/{}] {}: {}", pt.index + 1, p.points.len(), pt.label, report.verdict);
        r.outcome = PointOutcome::ApplyFailed;
        r.verdict = v;
        r.summary = s.or(Some(report.verdict));
        return Applied::Failed;
    }
    Applied::Verified
}

/// How a point's load ended.
#[derive(Debug, PartialEq, Eq)]
enum Loaded {
    /// A signal came during it: nothing is recorded.
    Interrupted,
    /// Every level ran, or the server died under one (`r` says so).
    Done,
}

/// The load of one concurrency level on the point's server, as the sweep's `load` says.
fn level(p: &Prepared, pt: &Point, concurrency: u32) -> Level {
    let load = &p.parsed.sweep.spec.load;
    let api = match load.api.for_engine(pt.spec.engine) {
        sweep::Api::Generate => loadgen::Api::Generate,
        _ => loadgen::Api::Completions,
    };
    let (requests, duration) = match load.amount() {
        Amount::Requests(n) => (n, None),
        Amount::Duration(d) => (0, Some(d)),
    };
    Level {
        base_url: pt.spec.base_url(),
        engine: pt.spec.engine,
        api,
        model: Some(pt.spec.server.served_model_name.clone().unwrap_or_else(|| pt.spec.model.clone())),
        concurrency,
        requests,
        duration,
        warmup: load.warmup,
        max_tokens: load.max_tokens,
        prompts: p.prompts.clone(),
        timeout: Duration::from_secs(300),
    }
}

/// Load the verified instance `props` at each concurrency level, its results into `r`, until
/// the server dies under the load (then `r` says how it ended).
async fn load_point<H: SweepHost>(
    ctx: &Ctx<H>,
    p: &Prepared,
    pt: &Point,
    props: &crate::machine::systemd::UnitProps,
    shutdown: &Shutdown,
    r: &mut PointResult,
) -> Result<Loaded> {
    let unit = &pt.spec.unit;
    for &c in &p.parsed.sweep.spec.load.concurrency {
        let level = level(p, pt, c);
        let l = tokio::select! {
            l = ctx.host.load(&level) => l,
            _ = shutdown.wait() => return Ok(Loaded::Interrupted),
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
    Ok(Loaded::Done)
}
