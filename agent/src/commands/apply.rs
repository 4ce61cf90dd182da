//! `specd apply -f FILE...` (and `specd validate --on-host`, the same pre-flight without the apply).

use super::*;
use crate::core::plan;
use crate::core::record;
use crate::core::record::Source;
use crate::core::sync::SyncStatus;
use crate::host::Host;
use crate::machine::store::SourceState;
use crate::reconcile::context::{self, Dirs};
use crate::reconcile::progress::{self, Sink};
use crate::reconcile::{self, DesiredState, Shutdown};
use crate::source::spec_files;
use anyhow::Result;
use serde::Serialize;
use specd_spec::short;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// `specd apply --json`: one document on stdout. `ok` is true exactly when the exit code is 0.
#[derive(Debug, Default, Serialize)]
pub struct ApplyJson {
    pub ok: bool,
    pub dry_run: bool,
    /// Why nothing was changed on this host (bad files, two files for one unit, a live sweep, a
    /// unit a reconcile would refuse), when so.
    pub error: Option<String>,
    /// The problems of the spec files, when one is bad (as `specd validate --json`).
    pub diagnostics: Vec<serde_json::Value>,
    /// Every unit, in the order of the files.
    pub units: Vec<AppliedUnit>,
}

/// One unit of `specd apply --json`.
#[derive(Debug, Serialize)]
pub struct AppliedUnit {
    pub unit: String,
    pub file: String,
    /// The desired unit's sha256.
    pub sha256: String,
    /// What the reconcile found before it acted: sync status, why, and the steps it planned.
    pub sync: Option<SyncStatus>,
    pub reasons: Vec<String>,
    pub steps: Vec<plan::Step>,
    /// The unit runs its spec (a dry run: would be made to).
    pub ok: bool,
    /// What the reconcile did.
    #[serde(flatten)]
    pub reconcile: ReconcileJson,
    /// specd itself failed for this unit.
    pub error: Option<String>,
    /// The agent that follows a repository on this host wants another unit here: what it will
    /// do at its next look (put its unit back), when no hold keeps its hands off.
    pub agent_reverts: Option<String>,
}

/// `specd apply -f FILE...`: every file is read and checked first (one bad file, two files for
/// one unit, or a unit a live sweep holds: nothing is changed on the host), then every unit is
/// reconciled at once, in this one process (their daemon-reloads are shared). Exit 0 when every
/// unit runs its spec, 1 otherwise, 2 when specd itself failed for one. With `json`, the verdicts
/// are one JSON document on stdout ([`ApplyJson`]); progress stays on stderr.
pub async fn apply(dirs: &Dirs, files: &[PathBuf], host: Option<String>, dry_run: bool, json: bool) -> Result<u8> {
    let machine = crate::host::RealHost::new(crate::machine::cgroup::Layout::host());
    let shutdown = || match dry_run {
        true => Shutdown::never(),
        false => interruptible("specd apply", "the apply"),
    };
    apply_on(machine, dirs, files, host, dry_run, json, shutdown).await
}

/// [`apply`] on `machine`; what stops it is made (`shutdown`) once every file is checked.
pub(super) async fn apply_on<H: Host>(
    machine: H,
    dirs: &Dirs,
    files: &[PathBuf],
    host: Option<String>,
    dry_run: bool,
    json: bool,
    shutdown: impl FnOnce() -> Shutdown,
) -> Result<u8> {
    let mut doc = ApplyJson { dry_run, ..Default::default() };
    let all = match read_specs(files, host, &mut doc.diagnostics)? {
        Ok(all) => all,
        Err(why) => return refuse(doc, json, why),
    };
    let ctx = Arc::new(context::ctx_on(machine, dirs, progress::events(Sink::Stderr), shutdown()));
    // A live sweep's hold refuses a hand apply (not the sweep's own).
    if !dry_run {
        for d in &all {
            let unit = &d.spec.unit;
            if let Some(why) = live_sweep(&ctx.host, &ctx.store.peek(unit)?).filter(|_| !sweeps_own(&ctx.store, unit)) {
                return refuse(doc, json, format!("refused: {unit}: {why}; nothing was changed on this host"));
            }
        }
    }
    let all: Vec<Arc<DesiredState>> = all.into_iter().map(Arc::new).collect();
    if !dry_run && all.len() > 1 {
        let refusals = would_refuse(&ctx, &all).await;
        if !refusals.is_empty() {
            for r in &refusals {
                eprintln!("specd: {r}");
            }
            eprintln!("specd: nothing was changed on this host");
            print_failed(doc, json, format!("{}; nothing was changed on this host", refusals.join("; ")))?;
            return Ok(1);
        }
    }
    let reverts = reverted_by_the_agent(&ctx, dirs, &all, dry_run)?;
    let done = each_at_once(&ctx, &all, dry_run).await;
    progress::flush_progress();
    crate::notify::flush(std::time::Duration::from_secs(30)).await;
    let mut code = 0;
    let many = done.len() > 1;
    for (((d, report), file), reverts) in all.iter().zip(done).zip(files).zip(reverts) {
        let said = Said { many, json, dry_run };
        let (u, c) = applied_unit(d, file, report, reverts, said)?;
        code = code.max(c);
        doc.units.push(u);
    }
    finish(doc, json, code)
}

/// Every file read into its desired state, or why none may be applied: a bad file (its
/// problems into `diagnostics`), or two files for one unit.
fn read_specs(
    files: &[PathBuf],
    host: Option<String>,
    diagnostics: &mut Vec<serde_json::Value>,
) -> Result<Result<Vec<DesiredState>, String>> {
    let mut all: Vec<DesiredState> = Vec::new();
    let mut bad = Vec::new();
    for f in files {
        match desired(f, host.clone())? {
            Ok(d) => all.push(d),
            Err(d) => {
                diagnostics.extend(spec_files::diagnostics_json(&d.0));
                bad.push(f.display().to_string());
            }
        }
    }
    if !bad.is_empty() {
        return Ok(Err(format!("{} not valid; nothing was changed on this host", bad.join(", "))));
    }
    for (i, d) in all.iter().enumerate() {
        if let Some(j) = all[..i].iter().position(|e| e.spec.unit == d.spec.unit) {
            return Ok(Err(format!(
                "{} and {} both define {}; nothing was changed on this host",
                files[j].display(),
                files[i].display(),
                d.spec.unit
            )));
        }
    }
    let members: Vec<(String, &specd_spec::Rollout)> =
        all.iter().zip(files).filter_map(|(d, f)| Some((f.display().to_string(), d.spec.rollout.as_ref()?))).collect();
    if let Some(why) = crate::core::roll::disagreeing(&members) {
        return Ok(Err(format!("{why}; nothing was changed on this host")));
    }
    Ok(Ok(all))
}

/// What a reconcile would refuse (a unit file specd did not write, a unit specd never manages),
/// found for every unit before any is changed: a dry run of each, quiet.
async fn would_refuse<H: Host>(ctx: &Arc<reconcile::Ctx<H>>, all: &[Arc<DesiredState>]) -> Vec<String> {
    let quiet = Arc::new(reconcile::Ctx { events: Arc::new(|_: &str, _: &reconcile::Event| {}), ..(**ctx).clone() });
    let mut refusals = Vec::new();
    for (d, r) in all.iter().zip(each_at_once(&quiet, all, true).await) {
        match r {
            Ok(r) if r.refused => refusals.push(r.verdict),
            Ok(_) => {}
            Err(e) => refusals.push(format!("{}: {e:#}", d.spec.unit)),
        }
    }
    refusals
}

/// A hand apply on a host whose agent follows a repository lasts until the agent's next look,
/// unless a hold keeps it away: for each unit, what the agent will do (said on stderr before a
/// long load, unless a dry run).
fn reverted_by_the_agent<H: Host>(
    ctx: &reconcile::Ctx<H>,
    dirs: &Dirs,
    all: &[Arc<DesiredState>],
    dry_run: bool,
) -> Result<Vec<Option<String>>> {
    let follows = SourceState::load(&dirs.state_dir);
    let mut reverts = Vec::new();
    for d in all {
        let st = ctx.store.peek(&d.spec.unit)?;
        let r = agent_reverts(&st, follows.as_ref(), &d.unit.sha256)
            .filter(|(sha, _)| {
                matches!(ctx.host.hold_effect(st.hold.as_ref(), sha), crate::core::hold::HoldEffect::Acts)
            })
            .map(|(_, why)| why);
        if let Some(why) = r.as_ref().filter(|_| !dry_run) {
            eprintln!("specd: warning: {why}");
        }
        reverts.push(r);
    }
    Ok(reverts)
}

/// How an apply speaks of each unit: one of several (each line names its unit), as one JSON
/// document (nothing but it on stdout), a dry run.
#[derive(Clone, Copy)]
struct Said {
    many: bool,
    json: bool,
    dry_run: bool,
}

/// One unit's result, said (without `--json`) and as its JSON, with its exit code: 0 when it runs
/// its spec (a dry run: would be made to), 1 otherwise, 2 when specd itself failed for it (an
/// error of a lone unit without `--json` is the command's error). `reverts`: what the agent
/// will do to it.
fn applied_unit(
    d: &DesiredState,
    file: &Path,
    report: Result<Report, reconcile::ReconcileError>,
    reverts: Option<String>,
    said: Said,
) -> Result<(AppliedUnit, u8)> {
    let Said { many, json, dry_run } = said;
    let unit = &d.spec.unit;
    let mut u = AppliedUnit {
        unit: unit.clone(),
        file: file.display().to_string(),
        sha256: d.unit.sha256.clone(),
        sync: None,
        reasons: vec![],
        steps: vec![],
        ok: false,
        reconcile: ReconcileJson::default(),
        error: None,
        agent_reverts: None,
    };
    let report = match report {
        Ok(r) => r,
        Err(e) if many || json => {
            if !json {
                eprintln!("specd: error: {unit}: {e:#}");
            }
            u.error = Some(format!("{e:#}"));
            return Ok((u, 2));
        }
        Err(e) => return Err(e.into()),
    };
    if !json {
        if let Some(v) = &report.stop_verdict {
            println!("note: {unit}: the previous instance was {v}");
        }
        match many && !report.verdict.contains(unit.as_str()) {
            true => println!("{unit}: {}", report.verdict),
            false => println!("{}", report.verdict),
        }
    }
    // 0: the unit runs the spec (or, dry run, would be made to); 1: anything else.
    let would = |sync| matches!(sync, SyncStatus::OutOfSync | SyncStatus::Drifted) && !report.refused;
    let runs = crate::core::sync::runs_spec(report.outcome, report.plan.sync);
    let ok = runs || (dry_run && report.outcome.is_none() && would(report.plan.sync));
    u.sync = Some(report.plan.sync);
    u.reasons = report.plan.reasons.clone();
    u.steps = report.plan.steps.clone();
    u.ok = ok;
    u.reconcile = ReconcileJson::of(&report);
    // Said again with the result when the hand unit now runs: it will not for long.
    if runs && !dry_run {
        if let Some(why) = &reverts
            && !json
        {
            println!("note: {why}");
        }
        u.agent_reverts = reverts;
    }
    Ok((u, if ok { 0 } else { 1 }))
}

/// What the agent that follows a repository on this host (`follows`: its source state) will do
/// to a hand apply of unit `hand_sha`: the unit it deploys (its hash) and the words that say so;
/// `None` when no agent follows one, or it wants this very unit. The agent's unit is the newest
/// one it asked for or applied from a commit.
pub(super) fn agent_reverts(
    st: &record::UnitState,
    follows: Option<&SourceState>,
    hand_sha: &str,
) -> Option<(String, String)> {
    let repo = &follows?.repo;
    let from_commit = |s: &Option<Source>| matches!(s, Some(Source::Commit { .. }));
    let (sha, source) = match &st.desired {
        Some(d) if from_commit(&d.source) => (d.sha256.clone(), d.source.clone()),
        _ => st.history.iter().rev().find(|h| from_commit(&h.source)).map(|h| (h.sha256.clone(), h.source.clone()))?,
    };
    if sha == hand_sha {
        return None;
    }
    let from = source.map_or(String::new(), |s| format!(" from {s}"));
    let why = format!(
        "{}: the agent that follows {repo} deploys unit {}{from} here and puts it back at its next look; commit this spec there to keep it, or `specd suspend {}` first",
        st.unit,
        short(&sha),
        st.unit
    );
    Some((sha, why))
}

/// `specd validate --on-host`: whether each spec's unit could start on this host, as an apply
/// looks before it stops anything (`preflight`). Exit 0 when every one could, 1 otherwise.
pub async fn preflight(paths: &[PathBuf], host: Option<String>, state_dir: &Path) -> Result<u8> {
    let (files, _) = spec_files::expand(paths);
    let systemd = crate::machine::systemd::Systemd::default();
    let mut code = 0;
    for f in &files {
        // A sweep is no unit (its points are applied one by one, each looked at then).
        if std::fs::read_to_string(f).is_ok_and(|t| specd_spec::sweep::is_sweep(&t)) {
            continue;
        }
        let Ok(d) = desired(f, host.clone())? else { continue };
        // The unit's own running instance may hold its port. Its drop-ins apply to the new unit
        // too, but its own (`<unit>.d/`), which an apply removes.
        let props = systemd.show(&d.spec.unit).await.unwrap_or_default();
        let own = format!("/{}.d/", d.spec.unit);
        let drop_ins: Vec<String> = props.drop_in_paths.into_iter().filter(|p| !p.contains(&own)).collect();
        let (checks, o) =
            crate::preflight::on_this_host(&d.spec, &d.unit.text, &drop_ins, &props.control_group, state_dir).await;
        for n in &o.notes {
            println!("{}: note: {}", f.display(), n.message);
        }
        for p in &o.problems {
            println!("{}: {}: {}", f.display(), d.spec.unit, p.message);
        }
        if o.passed() {
            println!("{}: {} could start on this host ({} checks)", f.display(), d.spec.unit, checks.len());
        } else {
            code = 1;
        }
    }
    Ok(code)
}
