//! The commands that touch a host: apply, status, diff.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use serde::Serialize;
use specd_spec::short;

use crate::context::{self, Dirs, Sink, hostname};
use crate::host::Host;
use crate::plan::{self, SyncStatus};
use crate::probe::{self, Health, Probe};
use crate::reconcile::{self, Ctx, DesiredState, Event, Shutdown};
use crate::specs;
use crate::state::{self, Source, SourceState, Store};
use crate::timing;

/// Load, resolve for this host and render a spec file; diagnostics on stderr when it is bad
/// (and returned, for `--json`).
fn desired(file: &Path, host: Option<String>) -> Result<Result<DesiredState, specd_spec::Diagnostics>> {
    let host = hostname(host);
    let parsed = match specs::load(file) {
        Ok(p) => p,
        Err(d) => {
            eprintln!("{d}");
            return Ok(Err(d));
        }
    };
    match parsed.resolve_with_warnings(Some(&host)) {
        Ok((spec, warnings)) => {
            for w in &warnings.0 {
                eprintln!("{w}");
            }
            let path = std::fs::canonicalize(file).unwrap_or_else(|_| file.to_path_buf());
            Ok(Ok(DesiredState::new(spec, Some(Source::File { path: path.display().to_string() }))))
        }
        Err(d) => {
            eprintln!("{d}");
            Ok(Err(d))
        }
    }
}

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
    /// `applied`, `started`, `rolled-back`, `failed`, `refused`; null when nothing was done (in
    /// sync, or a dry run).
    pub outcome: Option<state::Outcome>,
    /// The unit runs its spec (a dry run: would be made to).
    pub ok: bool,
    /// The reconcile's one line for a person.
    pub verdict: Option<String>,
    /// How the instance it stopped ended, when that was not a clean stop.
    pub previous_instance: Option<String>,
    /// specd itself failed for this unit.
    pub error: Option<String>,
    /// The agent that follows a repository on this host wants another unit here: what it will
    /// do at its next look (put its unit back), when no hold keeps its hands off.
    pub agent_reverts: Option<String>,
}

/// Print `doc` as the command's one JSON document on stdout.
fn print_json(doc: &impl Serialize) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(doc)?);
    Ok(())
}

/// `specd apply -f FILE...`: every file is read and checked first (one bad file, two files for
/// one unit, or a unit a live sweep holds: nothing is changed on the host), then every unit is
/// reconciled at once, in this one process (their daemon-reloads are shared). Exit 0 when every
/// unit runs its spec, 1 otherwise, 2 when specd itself failed for one. With `json`, the verdicts
/// are one JSON document on stdout ([`ApplyJson`]); progress stays on stderr.
pub async fn apply(dirs: &Dirs, files: &[PathBuf], host: Option<String>, dry_run: bool, json: bool) -> Result<u8> {
    let machine = crate::host::RealHost::new(crate::cgroup::Layout::host());
    let shutdown = || match dry_run {
        true => Shutdown::never(),
        false => interruptible("specd apply", "the apply"),
    };
    apply_on(machine, dirs, files, host, dry_run, json, shutdown).await
}

/// [`apply`] on `machine`; what stops it is made (`shutdown`) once every file is checked.
async fn apply_on<H: Host>(
    machine: H,
    dirs: &Dirs,
    files: &[PathBuf],
    host: Option<String>,
    dry_run: bool,
    json: bool,
    shutdown: impl FnOnce() -> Shutdown,
) -> Result<u8> {
    let mut doc = ApplyJson { dry_run, ..Default::default() };
    let refuse = |mut doc: ApplyJson, why: String| -> Result<u8> {
        eprintln!("specd: {why}");
        if json {
            doc.error = Some(why);
            print_json(&doc)?;
        }
        Ok(1)
    };
    let mut all: Vec<DesiredState> = Vec::new();
    let mut bad = Vec::new();
    for f in files {
        match desired(f, host.clone())? {
            Ok(d) => all.push(d),
            Err(d) => {
                doc.diagnostics.extend(specs::diagnostics_json(&d.0));
                bad.push(f.display().to_string());
            }
        }
    }
    if !bad.is_empty() {
        return refuse(doc, format!("{} not valid; nothing was changed on this host", bad.join(", ")));
    }
    for (i, d) in all.iter().enumerate() {
        if let Some(j) = all[..i].iter().position(|e| e.spec.unit == d.spec.unit) {
            let why = format!(
                "{} and {} both define {}; nothing was changed on this host",
                files[j].display(),
                files[i].display(),
                d.spec.unit
            );
            return refuse(doc, why);
        }
    }
    let ctx = Arc::new(context::ctx_on(machine, dirs, context::events(Sink::Stderr), shutdown()));
    // A live sweep's hold refuses a hand apply (not the sweep's own).
    if !dry_run {
        for d in &all {
            let unit = &d.spec.unit;
            if let Some(why) = live_sweep(&ctx.host, &ctx.store.peek(unit)?).filter(|_| !sweeps_own(&ctx.store, unit)) {
                return refuse(doc, format!("refused: {unit}: {why}; nothing was changed on this host"));
            }
        }
    }
    let all: Vec<Arc<DesiredState>> = all.into_iter().map(Arc::new).collect();
    // What a reconcile would refuse (a unit file specd did not write, a unit specd never
    // manages) is found for every unit before any is changed.
    if !dry_run && all.len() > 1 {
        let quiet = Arc::new(reconcile::Ctx { events: Arc::new(|_: &str, _: &reconcile::Event| {}), ..(*ctx).clone() });
        let mut refusals = Vec::new();
        for (d, r) in all.iter().zip(each_at_once(&quiet, &all, true).await) {
            match r {
                Ok(r) if r.refused => refusals.push(r.verdict),
                Ok(_) => {}
                Err(e) => refusals.push(format!("{}: {e:#}", d.spec.unit)),
            }
        }
        if !refusals.is_empty() {
            for r in &refusals {
                eprintln!("specd: {r}");
            }
            eprintln!("specd: nothing was changed on this host");
            if json {
                doc.error = Some(format!("{}; nothing was changed on this host", refusals.join("; ")));
                print_json(&doc)?;
            }
            return Ok(1);
        }
    }
    // A hand apply on a host whose agent follows a repository lasts until the agent's next look,
    // unless a hold keeps it away: said before a long load, and in the result.
    let follows = SourceState::load(&dirs.state_dir);
    let mut reverts = Vec::new();
    for d in &all {
        let st = ctx.store.peek(&d.spec.unit)?;
        let r = agent_reverts(&st, follows.as_ref(), &d.unit.sha256)
            .filter(|(sha, _)| matches!(ctx.host.hold_effect(st.hold.as_ref(), sha), crate::hold::HoldEffect::Acts))
            .map(|(_, why)| why);
        if let Some(why) = r.as_ref().filter(|_| !dry_run) {
            eprintln!("specd: warning: {why}");
        }
        reverts.push(r);
    }
    let done = each_at_once(&ctx, &all, dry_run).await;
    context::flush_progress();
    crate::notify::flush(std::time::Duration::from_secs(30)).await;
    let mut code = 0;
    let many = done.len() > 1;
    for (((d, report), file), reverts) in all.iter().zip(done).zip(files).zip(reverts) {
        let unit = &d.spec.unit;
        let mut u = AppliedUnit {
            unit: unit.clone(),
            file: file.display().to_string(),
            sha256: d.unit.sha256.clone(),
            sync: None,
            reasons: vec![],
            steps: vec![],
            outcome: None,
            ok: false,
            verdict: None,
            previous_instance: None,
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
                doc.units.push(u);
                code = 2;
                continue;
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
        let ok = crate::sync::runs_spec(report.outcome, report.plan.sync)
            || (dry_run && report.outcome.is_none() && would(report.plan.sync));
        if !ok {
            code = code.max(1);
        }
        u.sync = Some(report.plan.sync);
        u.reasons = report.plan.reasons.clone();
        u.steps = report.plan.steps.clone();
        u.outcome = report.outcome;
        u.ok = ok;
        u.verdict = Some(report.verdict.clone());
        u.previous_instance = report.stop_verdict.clone();
        // Said again with the result when the hand unit now runs: it will not for long.
        if crate::sync::runs_spec(report.outcome, report.plan.sync) && !dry_run {
            if let Some(why) = &reverts
                && !json
            {
                println!("note: {why}");
            }
            u.agent_reverts = reverts;
        }
        doc.units.push(u);
    }
    if json {
        doc.ok = code == 0;
        print_json(&doc)?;
    }
    Ok(code)
}

/// What the agent that follows a repository on this host (`follows`: its source state) will do
/// to a hand apply of unit `hand_sha`: the unit it deploys (its hash) and the words that say so;
/// `None` when no agent follows one, or it wants this very unit. The agent's unit is the newest
/// one it asked for or applied from a commit.
fn agent_reverts(st: &state::UnitState, follows: Option<&SourceState>, hand_sha: &str) -> Option<(String, String)> {
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
    let (files, _) = specs::expand(paths);
    let systemd = crate::systemd::Systemd::default();
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

/// Reconcile every unit at once (each in a task of its own: a panic is that unit's error, and
/// the others go on), and send each one's notice; the reports in the order of `all`.
async fn each_at_once<H: Host>(
    ctx: &Arc<reconcile::Ctx<H>>,
    all: &[Arc<DesiredState>],
    dry_run: bool,
) -> Vec<Result<reconcile::Report, reconcile::ReconcileError>> {
    let tasks: Vec<_> = all
        .iter()
        .map(|d| {
            let (ctx, d) = (ctx.clone(), d.clone());
            tokio::spawn(async move {
                let t0 = std::time::Instant::now();
                let report = reconcile::reconcile(&ctx, &d, dry_run).await;
                if let Ok(r) = &report {
                    crate::notify::after_reconcile(&ctx, &d, r, t0.elapsed()).await;
                }
                report
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap_or_else(|e| {
            Err(reconcile::ReconcileError::Io(anyhow::anyhow!("internal error while reconciling: {e}")))
        }));
    }
    out
}

#[derive(Debug, Serialize)]
pub struct UnitStatus {
    pub unit: String,
    pub sync: SyncStatus,
    pub health: ServiceHealth,
    pub reasons: Vec<String>,
    pub desired_sha256: Option<String>,
    pub deployed_sha256: Option<String>,
    /// Where the desired state comes from (a file, or a commit).
    pub source: Option<Source>,
    /// Where the last unit that was applied and verified came from.
    pub applied_source: Option<Source>,
    pub active_state: String,
    pub sub_state: String,
    pub main_pid: u32,
    /// The running process's argv equals the ExecStart of the unit `cmdline_of` names.
    pub cmdline_matches: Option<bool>,
    /// Which unit the running process is compared with: the desired one when it is deployed,
    /// else the deployed one (a refused, quarantined or held desired unit never ran here).
    pub cmdline_of: CmdlineOf,
    pub arg_mismatches: Vec<String>,
    pub last_result: Option<state::HistoryEntry>,
    pub error: Option<String>,
    /// How the last instance that ended, ended (`specd diagnose` has the evidence).
    pub last_ended: Option<String>,
    /// What the last speculation proof of the deployed unit measured.
    pub speculation: Option<state::SpeculationRecord>,
    /// Why the service is not running, when it is not.
    pub down: Option<String>,
    /// A hold that keeps the agent's hands off the unit (suspend, pin, sweep).
    pub hold: Option<state::Hold>,
}

/// The unit whose `ExecStart=` `status` compares the running process with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CmdlineOf {
    /// The desired unit, which is the one deployed.
    Desired,
    /// The unit file on disk, which is not the desired one.
    Deployed,
}

/// What `status` says of the server: its readiness endpoint's answer, or systemd's state when
/// it was not asked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum ServiceHealth {
    Healthy,
    Loading,
    Unknown,
    Down,
}

impl ServiceHealth {
    fn of(ready: Option<bool>, active: crate::service::ActiveState) -> ServiceHealth {
        match ready {
            Some(true) => ServiceHealth::Healthy,
            Some(false) => ServiceHealth::Loading,
            // Not asked: the service is up (loading, or not yet reachable), or it is down.
            None if active.is_up() => ServiceHealth::Unknown,
            None => ServiceHealth::Down,
        }
    }
}

impl std::fmt::Display for ServiceHealth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self, f)
    }
}

async fn unit_status<H: Host>(
    ctx: &Ctx<H>,
    st: &state::UnitState,
    override_desired: Option<&DesiredState>,
) -> Result<UnitStatus> {
    let desired = match (override_desired, &st.desired) {
        (Some(d), _) => Some(d.clone()),
        (None, Some(rec)) => Some(DesiredState::new(rec.spec.clone(), rec.source.clone())),
        (None, None) => None,
    };
    let Some(d) = desired else {
        let props = ctx.host.show(&st.unit).await?;
        return Ok(UnitStatus {
            unit: st.unit.clone(),
            sync: SyncStatus::OutOfSync,
            health: ServiceHealth::Unknown,
            reasons: vec!["no desired state recorded".into()],
            desired_sha256: None,
            deployed_sha256: None,
            source: None,
            applied_source: st.last_good.as_ref().and_then(|g| g.source.clone()),
            active_state: props.active_state.to_string(),
            sub_state: props.sub_state.to_string(),
            main_pid: props.main_pid,
            cmdline_matches: None,
            cmdline_of: CmdlineOf::Deployed,
            arg_mismatches: vec![],
            last_result: st.history.last().cloned(),
            error: None,
            last_ended: None,
            speculation: None,
            down: None,
            hold: st.hold.clone(),
        });
    };
    let (o, props) = reconcile::observe(ctx, &d, st, true).await?;
    let p = plan::plan(&o, &reconcile::desired_of(&ctx.unit_dir, &d));
    let mut reasons = p.reasons.clone();
    let applying = crate::lock::UnitLock::held(&ctx.store.locks_dir(), &st.unit);
    let last = st.history.last().filter(|h| h.sha256 == d.unit.sha256);
    let sync = crate::sync::status(crate::sync::Seen {
        planned: p.sync,
        outcome: None,
        applying,
        last_try: last.map(|h| h.outcome),
    });
    if applying {
        reasons.insert(
            0,
            format!("an apply is running ({})", st.in_progress.as_ref().map_or("?".into(), |p| p.phase.to_string())),
        );
    }
    // Failed by its last try: that try's message says why.
    if let Some(last) = last.filter(|h| crate::sync::failed_try(h.outcome) && sync == SyncStatus::Failed)
        && !reasons.iter().any(|r| r.contains(&last.message))
    {
        reasons.push(last.message.clone());
    }
    let health = ServiceHealth::of(o.ready, props.active_state);
    // The process runs the deployed unit: the desired one when it is deployed; otherwise (the
    // desired unit refused, quarantined, held or not applied yet) the file on disk.
    let deployed_is_desired = o.deployed_sha256.as_deref() == Some(d.unit.sha256.as_str());
    let (cmdline_of, argv) = if deployed_is_desired {
        (CmdlineOf::Desired, Some(d.spec.argv.clone()))
    } else {
        let text = ctx.host.read(&crate::host::unit_path(&ctx.unit_dir, &st.unit))?;
        (CmdlineOf::Deployed, text.and_then(|t| specd_spec::exec_start(&String::from_utf8_lossy(&t))))
    };
    let down = (health == ServiceHealth::Down)
        .then(|| crate::sync::down_reason(st.history.last(), props.active_state, &props.sub_state));
    Ok(UnitStatus {
        down,
        hold: st.hold.clone(),
        unit: st.unit.clone(),
        sync,
        health,
        reasons,
        desired_sha256: Some(d.unit.sha256.clone()),
        deployed_sha256: o.deployed_sha256.clone(),
        source: d.source.clone(),
        applied_source: st.last_good.as_ref().and_then(|g| g.source.clone()),
        active_state: props.active_state.to_string(),
        sub_state: props.sub_state.to_string(),
        main_pid: props.main_pid,
        cmdline_matches: o.main_cmdline.as_ref().zip(argv).map(|(c, argv)| crate::plan::runs_argv(c, &argv)),
        cmdline_of,
        arg_mismatches: o.arg_mismatches.clone(),
        last_result: st.history.last().cloned(),
        error: None,
        // Recorded when specd saw the last instance end, while the one after it still runs;
        // otherwise (a restart specd did not make, or no record yet) read from the journal.
        last_ended: match crate::sync::recorded_ending(
            st.last_ended.as_ref(),
            &props.invocation_id,
            props.active_state,
            props.main_pid,
        ) {
            Some(said) => said,
            None => ctx.host.ending(&st.unit, "", timing::LAST_ENDED_WITHIN).await.map(|e| e.summary),
        },
        // The proof of the running unit's speculation (a measurement of an older hash is not it).
        speculation: st
            .speculation
            .as_ref()
            .filter(|r| o.deployed_sha256.as_deref() == Some(r.sha256.as_str()))
            .cloned(),
    })
}

/// Runs the futures concurrently on this task; their outputs in order.
async fn join_all<F: std::future::Future>(futures: impl IntoIterator<Item = F>) -> Vec<F::Output> {
    let mut futs: Vec<_> = futures.into_iter().map(|f| Some(Box::pin(f))).collect();
    let mut out: Vec<Option<F::Output>> = futs.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, o) in futs.iter_mut().zip(out.iter_mut()) {
            if let Some(fut) = f {
                match fut.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => {
                        *o = Some(v);
                        *f = None;
                    }
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending { std::task::Poll::Pending } else { std::task::Poll::Ready(()) }
    })
    .await;
    out.into_iter().map(|o| o.expect("every future finished")).collect()
}

/// `specd status [-f FILE]`: every unit specd has state for (or the file's), as the host runs it.
/// Exit 0 when all are in sync and healthy, and the source's head deployed with no orphan.
pub async fn status(dirs: &Dirs, json: bool, file: Option<&Path>, host: Option<String>) -> Result<u8> {
    let ctx = context::host_ctx(dirs, Arc::new(|_: &str, _: &Event| {}), Shutdown::never());
    status_on(&ctx, dirs, json, file, host).await.map(|(code, _)| code)
}

/// [`status`] on `ctx`'s host: the exit code and what it said of each unit.
async fn status_on<H: Host>(
    ctx: &Ctx<H>,
    dirs: &Dirs,
    json: bool,
    file: Option<&Path>,
    host: Option<String>,
) -> Result<(u8, Vec<UnitStatus>)> {
    let mut override_desired = None;
    let units = match file {
        Some(f) => {
            let Ok(d) = desired(f, host)? else {
                return Ok((2, vec![]));
            };
            let u = d.spec.unit.clone();
            override_desired = Some(d);
            vec![u]
        }
        None => ctx.store.units().context("reading the state directory")?,
    };
    // Every unit at once: each asks systemd and its server (one connection to systemd, shared),
    // so the wall time is the slowest unit's, not the sum.
    let states = units.iter().map(|u| ctx.store.peek(u)).collect::<Result<Vec<_>>>()?;
    let mut all = Vec::new();
    for s in join_all(states.iter().map(|st| unit_status(ctx, st, override_desired.as_ref()))).await {
        all.push(s?);
    }
    let source = SourceState::load(&dirs.state_dir);
    // A head that may not deploy concerns every unit the agent deploys from it (not a spec
    // given with --file, nor a unit applied by hand).
    if let Some(e) = source.as_ref().and_then(|s| s.error.as_ref())
        && override_desired.is_none()
    {
        for s in all.iter_mut().filter(|s| matches!(s.source, Some(Source::Commit { .. }))) {
            s.error = Some(e.clone());
        }
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&serde_json::json!({"source": source, "units": all}))?);
    } else if let Some(s) = &source {
        println!(
            "source {} ({}): deployed commit {}, head {}",
            s.repo,
            s.followed,
            hash(&s.accepted_commit),
            hash(&s.head_commit)
        );
        if let Some(f) = &s.fleet {
            println!("  fleet: {}", f.describe(s.head_commit.as_deref()));
        }
        if let Some(e) = &s.error {
            println!("  {}", not_deployed(s, e));
        }
        for o in &s.orphans {
            println!("  orphaned: {o} (its spec is gone; left running)");
        }
    }
    if json {
    } else if all.is_empty() {
        println!("no units managed yet (state dir {})", dirs.state_dir.display());
    } else {
        for s in &all {
            print_status(s);
        }
    }
    // A head that was not deployed, or an orphaned unit, is not "all in sync" either.
    let source_ok = source.as_ref().is_none_or(|s| s.error.is_none() && s.orphans.is_empty());
    let ok = source_ok && all.iter().all(|s| s.sync == SyncStatus::InSync && s.health == ServiceHealth::Healthy);
    Ok((if ok { 0 } else { 1 }, all))
}

/// Why the source's read deployed nothing new: with a fleet file at the head, the host deploys
/// what the promotion record assigns it (the head was never its to deploy), so the refusal is
/// the record's or the revision it assigns; without one, the head's.
fn not_deployed(s: &SourceState, error: &str) -> String {
    match &s.fleet {
        Some(f) => format!("promotion not followed ({} of {}): {error}", hash(&f.record), f.record_branch),
        None => format!("head not deployed: {error}"),
    }
}

/// A hash as people read it, `-` when there is none.
fn hash(h: &Option<String>) -> &str {
    h.as_deref().map_or("-", short)
}

fn print_status(s: &UnitStatus) {
    println!("{}: {} {} ({}/{}, pid {})", s.unit, s.sync, s.health, s.active_state, s.sub_state, s.main_pid);
    println!(
        "  desired unit {}  deployed {}  from {}",
        hash(&s.desired_sha256),
        hash(&s.deployed_sha256),
        s.source.as_ref().map_or("-".into(), |x| x.to_string())
    );
    if s.applied_source != s.source {
        println!("  applied from {}", s.applied_source.as_ref().map_or("-".into(), |x| x.to_string()));
    }
    match (s.cmdline_matches, s.cmdline_of) {
        (Some(true), CmdlineOf::Desired) => println!("  running process: the rendered ExecStart"),
        (Some(false), CmdlineOf::Desired) => println!("  running process: NOT the rendered ExecStart"),
        (Some(true), CmdlineOf::Deployed) => {
            println!("  running process: the deployed unit's ExecStart (the desired unit is not deployed)")
        }
        (Some(false), CmdlineOf::Deployed) => println!("  running process: NOT the deployed unit's ExecStart"),
        (None, _) => {}
    }
    for m in &s.arg_mismatches {
        println!("  server arg differs: {m}");
    }
    if let Some(d) = &s.down {
        println!("  DOWN: {d}");
    }
    if let Some(h) = &s.hold {
        let what = match h.kind {
            state::HoldKind::Suspend => "the agent observes and reports drift only; a hand `specd apply` still applies",
            state::HoldKind::Pin => {
                "the agent leaves this unit until the source has a new desired unit or `specd resume`"
            }
            state::HoldKind::Sweep => "the agent observes only; `specd apply` is refused while the sweep runs",
        };
        println!("  hold: {} ({what})", h.describe());
    }
    for r in &s.reasons {
        println!("  why: {r}");
    }
    if s.error.is_some() {
        // The error itself is on the source's line above, once.
        println!("  newest desired state unusable: the source's head is not deployed (see above)");
    }
    if let Some(r) = &s.speculation {
        println!(
            "  speculation: {} (measured {} after readiness: {})",
            r.measured.figure(),
            state::format_time(r.time),
            r.measured.evidence.join(", ")
        );
    }
    if let Some(v) = &s.last_ended {
        println!("  last ended: {v}");
    }
    if let Some(h) = &s.last_result {
        println!("  last: {} {}", state::format_time(h.time), h.message);
        if let Some(v) = &h.stop_verdict {
            println!("  last stop: {v}");
        }
    }
}

/// `specd diff --json`: one document on stdout. `ok` is true exactly when the exit code is 0
/// (nothing differs).
#[derive(Debug, Default, Serialize)]
pub struct DiffJson {
    pub ok: bool,
    /// Why nothing was compared (the spec file is not valid).
    pub error: Option<String>,
    pub diagnostics: Vec<serde_json::Value>,
    pub unit: Option<String>,
    pub file: String,
    /// The unit file and the server's args together: anything differs.
    pub differs: bool,
    pub unit_file: Option<UnitFileDiff>,
    pub server_args: Option<ServerArgsDiff>,
    /// The server answered its readiness endpoint.
    pub ready: bool,
}

#[derive(Debug, Serialize)]
pub struct UnitFileDiff {
    pub path: String,
    pub differs: bool,
    /// Null when there is no unit file.
    pub deployed_sha256: Option<String>,
    pub desired_sha256: String,
    /// The unified diff, deployed against desired; null when they are equal.
    pub diff: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct ServerArgsDiff {
    /// The server's args were read and compared with the spec.
    pub compared: bool,
    /// Each arg that differs: `key` (a JSON pointer into the server's report), `expected` (the
    /// spec's value), `actual` (the server's).
    pub mismatches: Vec<probe::ArgMismatch>,
    /// Why they were not compared.
    pub error: Option<String>,
}

/// `specd diff -f FILE`: the deployed unit file against the desired one, and the server's args
/// against the spec. Exit 0 when nothing differs, 1 when something does, 2 when the spec file is
/// not valid (nothing compared).
pub async fn diff(dirs: &Dirs, file: &Path, host: Option<String>, json: bool) -> Result<u8> {
    let mut doc = DiffJson { file: file.display().to_string(), ..Default::default() };
    let d = match desired(file, host)? {
        Ok(d) => d,
        Err(diags) => {
            if json {
                doc.error = Some(format!("{} is not a valid spec; nothing was compared", file.display()));
                doc.diagnostics = specs::diagnostics_json(&diags.0);
                print_json(&doc)?;
            }
            return Ok(2);
        }
    };
    doc.unit = Some(d.spec.unit.clone());
    let path = crate::host::unit_path(&dirs.unit_dir, &d.spec.unit);
    let on_disk = crate::fsx::read_opt(&path)?;
    let deployed_sha256 = on_disk.as_deref().map(specd_spec::sha256_hex);
    let deployed = on_disk.map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default();
    let mut differs = false;
    let mut unified = None;
    if deployed != d.unit.text {
        differs = true;
        let diff = similar::TextDiff::from_lines(&deployed, &d.unit.text);
        let text = diff
            .unified_diff()
            .context_radius(3)
            .header(&path.display().to_string(), &format!("desired ({})", file.display()))
            .to_string();
        if !json {
            print!("{text}");
        }
        unified = Some(text);
    }
    doc.unit_file = Some(UnitFileDiff {
        path: path.display().to_string(),
        differs,
        deployed_sha256,
        desired_sha256: d.unit.sha256.clone(),
        diff: unified,
    });
    let base = d.spec.base_url();
    let quick = Probe::new(Duration::from_millis(1500));
    // The running instance, for an engine that logs its args (none: the log is not read).
    let invocation = match d.spec.args_report() {
        specd_spec::ArgsReport::LogLine(_) => {
            crate::systemd::Systemd::default().show(&d.spec.unit).await.map(|p| p.invocation_id).unwrap_or_default()
        }
        _ => String::new(),
    };
    let mut args = ServerArgsDiff { compared: false, mismatches: vec![], error: None };
    match crate::host::reported_args(&quick, &base, &d.spec, &invocation).await {
        Some(Ok(info)) => {
            let m = probe::compare_args(&d.spec.expected_server_args(), &info);
            for x in &m {
                if !json {
                    println!("server arg {x}");
                }
            }
            differs |= !m.is_empty();
            args.compared = true;
            args.mismatches = m;
        }
        Some(Err(e)) => {
            if !json {
                println!("(server args not compared: {e})");
            }
            args.error = Some(e.to_string());
        }
        None => args.error = Some("this engine does not report its args".into()),
    }
    doc.server_args = Some(args);
    doc.ready = quick.health(&format!("{base}{}", d.spec.readiness.endpoint)).await == Health::Ready;
    if !doc.ready && !json {
        println!("(the server at {base} is not ready)");
    }
    doc.differs = differs;
    if json {
        doc.ok = !differs;
        print_json(&doc)?;
    }
    Ok(u8::from(differs))
}

/// `specd reconcile`: ask the running agent over its control socket.
pub async fn ask_reconcile(socket: PathBuf, unit: Option<String>) -> Result<u8> {
    control_post(&socket, unit.as_deref()).await?;
    println!("reconcile of {} queued", unit.as_deref().unwrap_or("every unit"));
    Ok(0)
}

/// How long `specd reconcile`, `unquarantine`, `suspend`, `resume` and `rollback` wait for the
/// agent's answer on its control socket (`reconcile` fails without one; the others go on without it).
const CONTROL_ANSWER_WITHIN: Duration = Duration::from_secs(5);

/// `POST /reconcile[?unit=U]` on the agent's control socket (HTTP/1.1, one request).
async fn control_post(socket: &Path, unit: Option<&str>) -> Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::UnixStream::connect(socket)
        .await
        .with_context(|| format!("is the agent running, and may you use its control socket? {}", socket.display()))?;
    let query = unit.map_or(String::new(), |u| {
        let enc: String = u
            .bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'@' => (b as char).to_string(),
                _ => format!("%{b:02X}"),
            })
            .collect();
        format!("?unit={enc}")
    });
    let req =
        format!("POST /reconcile{query} HTTP/1.1\r\nHost: specd\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
    let io = async {
        s.write_all(req.as_bytes()).await?;
        let mut resp = Vec::new();
        s.read_to_end(&mut resp).await?;
        Ok::<_, std::io::Error>(resp)
    };
    let resp = tokio::time::timeout(CONTROL_ANSWER_WITHIN, io)
        .await
        .with_context(|| format!("the agent did not answer within {} s", CONTROL_ANSWER_WITHIN.as_secs()))?
        .with_context(|| format!("talking to {}", socket.display()))?;
    let head = String::from_utf8_lossy(&resp);
    let status = head.split_whitespace().nth(1).unwrap_or("");
    if status != "200" {
        anyhow::bail!("the agent answered {:?}", head.lines().next().unwrap_or(""));
    }
    Ok(())
}

/// `specd unquarantine UNIT`: clear the quarantine of every hash of a unit, recorded in its
/// history, under the unit's lock (so it works while the agent runs); then ask the agent, if one
/// runs, to reconcile the unit.
pub async fn unquarantine(dirs: &Dirs, unit: String, socket: PathBuf) -> Result<u8> {
    let unit = unit.as_str();
    let store = Store::new(&dirs.state_dir);
    let locks = store.locks_dir();
    let lock = match crate::lock::UnitLock::try_acquire(&locks, unit)? {
        Some(l) => l,
        None => {
            eprintln!("waiting: another specd is reconciling {unit}");
            crate::lock::UnitLock::acquire(&locks, unit).await?
        }
    };
    let mut st = store.load(unit)?;
    if st.quarantine.is_empty() {
        println!("{unit}: nothing is quarantined");
        return Ok(0);
    }
    for q in std::mem::take(&mut st.quarantine) {
        let message = format!(
            "Unquarantined: {unit}: cleared the quarantine of unit {} (it had failed: {}); it is tried again",
            short(&q.sha256),
            q.reason
        );
        println!("{message}");
        st.record(state::HistoryEntry {
            time: state::now(),
            sha256: q.sha256,
            source: q.source,
            outcome: state::Outcome::Unquarantined,
            message,
            stop_verdict: None,
            duration_ms: 0,
        });
    }
    store.save(&st)?;
    drop(lock);
    // A running agent tries it now (none may run: then the next apply or agent start does).
    if control_post(&socket, Some(unit)).await.is_ok() {
        println!("asked the running agent to reconcile {unit}");
    }
    Ok(0)
}

pub async fn history(dirs: &Dirs, unit: Option<String>, json: bool) -> Result<u8> {
    let store = Store::new(&dirs.state_dir);
    let units = match unit {
        Some(u) => vec![u],
        None => store.units()?,
    };
    let mut all = Vec::new();
    for u in &units {
        let st = store.peek(u)?;
        for h in &st.history {
            all.push((u.clone(), h.clone()));
        }
    }
    all.sort_by_key(|(_, h)| h.time);
    if json {
        let v: Vec<serde_json::Value> = all
            .iter()
            .map(|(u, h)| {
                let mut v = serde_json::to_value(h).unwrap_or_default();
                v["unit"] = serde_json::json!(u);
                v
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(0);
    }
    for (u, h) in &all {
        let src = h.source.as_ref().map_or("-".into(), |s| s.to_string());
        println!(
            "{}  {u}  {:<11} unit {}  {src}",
            state::format_time(h.time),
            format!("{:?}", h.outcome),
            short(&h.sha256)
        );
        println!("    {}", h.message);
        if let Some(v) = &h.stop_verdict {
            println!("    previous instance: {v}");
        }
    }
    if all.is_empty() {
        println!("no applies recorded");
    }
    Ok(0)
}

/// `specd diagnose`: see [`crate::diagnose`].
pub async fn diagnose(unit: Option<String>, json: bool, dirs: &Dirs) -> Result<u8> {
    crate::explain::run(unit.as_deref(), json, &dirs.state_dir).await
}

/// Why a hand apply (or a new hold) must wait: a sweep's hold on the unit is in effect (the one
/// hold gate, [`Host::hold_in_effect`]: its process runs and it has not expired; one that names
/// no process until it expires).
fn live_sweep<H: Host>(host: &H, st: &state::UnitState) -> Option<String> {
    let h = st.hold.as_ref().filter(|h| h.kind == state::HoldKind::Sweep)?;
    matches!(host.hold_in_effect(Some(h)), crate::hold::HoldEffect::HandsOff(_))
        .then(|| format!("{} (stop the sweep first)", h.describe()))
}

/// The machine, for a command that only reads it.
fn this_host() -> crate::host::RealHost {
    crate::host::RealHost::new(crate::cgroup::Layout::host())
}

/// This apply is the sweep's own: run by the process that holds the unit, or by its child.
fn sweeps_own(store: &Store, unit: &str) -> bool {
    let me = [std::process::id(), nix::unistd::getppid().as_raw().unsigned_abs()];
    store.peek(unit).ok().and_then(|st| st.hold).and_then(|h| h.pid).is_some_and(|p| me.contains(&p))
}

/// Who runs a command that puts a hold: `alice@host (specd suspend)` (under sudo, the user who
/// ran sudo).
fn operator(command: &str) -> String {
    let user = std::env::var("SUDO_USER").ok().filter(|u| !u.is_empty()).unwrap_or_else(|| {
        let uid = nix::unistd::getuid();
        nix::unistd::User::from_uid(uid).ok().flatten().map_or_else(|| format!("uid {uid}"), |u| u.name)
    });
    format!("{user}@{} ({command})", hostname(None))
}

/// `90s`, `15m`, `2h`, `1d`, `1h30m`: a duration for `--for`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let bad = || format!("{text:?} is not a duration: write a number with s, m, h or d (90s, 15m, 2h, 1d, 1h30m)");
    let mut total = 0u64;
    let mut digits = String::new();
    let t = text.trim();
    if t.is_empty() {
        return Err(bad());
    }
    for c in t.chars() {
        if c.is_ascii_digit() {
            digits.push(c);
            continue;
        }
        let unit = match c {
            's' => 1,
            'm' => 60,
            'h' => 3600,
            'd' => 86_400,
            _ => return Err(bad()),
        };
        let n: u64 = digits.parse().map_err(|_| bad())?;
        total = n.checked_mul(unit).and_then(|x| total.checked_add(x)).ok_or_else(bad)?;
        digits.clear();
    }
    if !digits.is_empty() || total == 0 {
        return Err(bad());
    }
    Ok(Duration::from_secs(total))
}

/// The unit must be one specd has state for (a typo suspends nothing).
fn known_unit(store: &Store, unit: &str) -> Result<Option<state::UnitState>> {
    let units = store.units()?;
    if !units.iter().any(|u| u == unit) {
        eprintln!(
            "specd: {unit}: specd has no state for this unit (it knows: {}); nothing was changed",
            if units.is_empty() { "none".to_string() } else { units.join(", ") }
        );
        return Ok(None);
    }
    Ok(Some(store.peek(unit)?))
}

/// `specd suspend UNIT [--for D] [--reason R]`: the agent keeps its hands off the unit (it
/// observes it and reports drift) until `specd resume` or the end of `--for`. A hand `specd
/// apply` still applies.
pub async fn suspend(
    dirs: &Dirs,
    unit: String,
    for_: Option<Duration>,
    reason: Option<String>,
    socket: PathBuf,
) -> Result<u8> {
    let store = Store::new(&dirs.state_dir);
    let Some(st) = known_unit(&store, &unit)? else { return Ok(1) };
    if let Some(why) = live_sweep(&this_host(), &st) {
        eprintln!("specd: refused: {unit}: {why}; nothing was changed");
        return Ok(1);
    }
    let since = state::now();
    let hold = state::Hold {
        until: for_.map(|d| since + d.as_secs()),
        reason,
        ..state::Hold::new(state::HoldKind::Suspend, operator("specd suspend"), since)
    };
    if let Some(old) = st.hold.as_ref().filter(|h| h.kind == state::HoldKind::Pin) {
        println!("{unit}: replaces the pin ({}); `specd resume` ends both", old.describe());
    }
    store.set_hold(&unit, hold.clone()).await?;
    println!("{unit}: {}", hold.describe());
    println!("the agent observes it and reports drift, and changes nothing; a hand `specd apply` still applies");
    notify_agent(&socket, &unit).await;
    Ok(0)
}

/// `specd resume UNIT`: end a suspend or a pin; the agent reconciles the unit again.
pub async fn resume(dirs: &Dirs, unit: String, socket: PathBuf) -> Result<u8> {
    let store = Store::new(&dirs.state_dir);
    let Some(st) = known_unit(&store, &unit)? else { return Ok(1) };
    // A sweep's hold that names no process (an older specd's) has no sweep to stop: resumed.
    let named = st.hold.as_ref().is_some_and(|h| h.pid.is_some());
    if let Some(why) = live_sweep(&this_host(), &st).filter(|_| named) {
        eprintln!("specd: refused: {unit}: {why}");
        return Ok(1);
    }
    match store.clear_hold(&unit, &format!("resumed by {}", operator("specd resume"))).await? {
        None => println!("{unit}: not held; nothing to resume"),
        Some(h) => {
            println!("{unit}: no longer {}", h.describe());
            notify_agent(&socket, &unit).await;
        }
    }
    Ok(0)
}

/// Ask a running agent to look at a unit again (none may run).
async fn notify_agent(socket: &Path, unit: &str) {
    if control_post(socket, Some(unit)).await.is_ok() {
        println!("asked the running agent to reconcile {unit}");
    }
}

/// `specd rollback --json`: one document on stdout. `ok` is true exactly when the exit code is
/// 0 (the unit runs the earlier good unit, pinned).
#[derive(Debug, Default, Serialize)]
pub struct RollbackJson {
    pub ok: bool,
    pub unit: String,
    /// Why nothing was changed (an unknown unit, a live sweep, no such good unit), or specd's
    /// own failure.
    pub error: Option<String>,
    /// The good unit rolled back to.
    pub to: Option<RollbackTo>,
    /// `applied`, `started`, `rolled-back`, `failed`, `refused`; null when nothing was done
    /// (it already ran).
    pub outcome: Option<state::Outcome>,
    pub verdict: Option<String>,
    /// How the instance it stopped ended, when that was not a clean stop.
    pub previous_instance: Option<String>,
    /// The pin is in place: the agent leaves the unit there until the source has a new desired
    /// unit or `specd resume`.
    pub pinned: bool,
    pub hold: Option<state::Hold>,
}

#[derive(Debug, Serialize)]
pub struct RollbackTo {
    /// The unit this specd renders from the kept spec (what runs now).
    pub sha256: String,
    /// The unit's hash when it ran and was good (differs when specd renders it otherwise now).
    pub recorded_sha256: String,
    pub source: Option<Source>,
    /// Unix seconds when it was good.
    pub good_at: u64,
}

/// `specd rollback UNIT [--to HASH]`: apply an earlier good unit of its history again (the one
/// before the deployed unit, or the one whose hash starts with HASH) through the normal apply,
/// and pin it there: the agent leaves it until the source has a new desired unit or `specd
/// resume`. With `json`, one JSON document on stdout ([`RollbackJson`]) and the rest on stderr.
pub async fn rollback(
    dirs: &Dirs,
    unit: String,
    to: Option<String>,
    reason: Option<String>,
    socket: PathBuf,
    json: bool,
) -> Result<u8> {
    let ctx = context::host_ctx(dirs, context::events(Sink::Stderr), interruptible("specd rollback", "the rollback"));
    rollback_on(&ctx, unit, to, reason, socket, json).await
}

/// [`rollback`] on `ctx`'s host.
async fn rollback_on<H: Host>(
    ctx: &Ctx<H>,
    unit: String,
    to: Option<String>,
    reason: Option<String>,
    socket: PathBuf,
    json: bool,
) -> Result<u8> {
    let mut doc = RollbackJson { unit: unit.clone(), ..Default::default() };
    let say = |line: &str| if json { eprintln!("{line}") } else { println!("{line}") };
    let refuse = |mut doc: RollbackJson, why: String| -> Result<u8> {
        eprintln!("specd: {why}");
        if json {
            doc.error = Some(why);
            print_json(&doc)?;
        }
        Ok(1)
    };
    let Some(st) = known_unit(&ctx.store, &unit)? else {
        if json {
            doc.error = Some(format!("{unit}: specd has no state for this unit; nothing was changed"));
            print_json(&doc)?;
        }
        return Ok(1);
    };
    if let Some(why) = live_sweep(&ctx.host, &st) {
        return refuse(doc, format!("refused: {unit}: {why}; nothing was changed"));
    }
    let deployed = ctx.host.read(&crate::host::unit_path(&ctx.unit_dir, &unit))?.map(|b| specd_spec::sha256_hex(&b));
    let target = match rollback_target(&st, deployed.as_deref(), to.as_deref()) {
        Ok(t) => t.clone(),
        Err(e) => return refuse(doc, format!("{unit}: {e}; nothing was changed")),
    };
    let d = DesiredState::new(target.spec.clone(), target.source.clone());
    doc.to = Some(RollbackTo {
        sha256: d.unit.sha256.clone(),
        recorded_sha256: target.sha256.clone(),
        source: target.source.clone(),
        good_at: target.time,
    });
    if d.unit.sha256 != target.sha256 {
        say(&format!(
            "note: this specd renders that spec as unit {} (it was {} when it ran)",
            short(&d.unit.sha256),
            short(&target.sha256)
        ));
    }
    // The desired unit the source had when pinned: a second rollback keeps the first's.
    let desired_at_pin = match &st.hold {
        Some(h) if h.kind == state::HoldKind::Pin => h.desired_at_pin.clone(),
        _ => st.desired.as_ref().map(|r| r.sha256.clone()),
    };
    let hold = state::Hold {
        reason,
        pinned_sha256: Some(d.unit.sha256.clone()),
        desired_at_pin,
        ..state::Hold::new(state::HoldKind::Pin, operator("specd rollback"), ctx.host.now())
    };
    // Pinned first, so that an agent that runs does not move it forward meanwhile; but only
    // while this process lives until the unit serves: killed half-way (or quit by a second
    // signal), its pin ends with it, and the agent puts the source's unit back.
    let (me, started) = ctx.host.me();
    let pending = state::Hold { pid: Some(me), pid_start: started, ..hold.clone() };
    ctx.store.set_hold(&unit, pending.clone()).await?;
    say(&format!(
        "{unit}: rolling back to unit {} ({}, good at {})",
        short(&d.unit.sha256),
        d.source.as_ref().map_or("no source".into(), |s| s.to_string()),
        state::format_time(target.time)
    ));
    let t0 = std::time::Instant::now();
    let report = reconcile::reconcile(ctx, &d, false).await;
    context::flush_progress();
    let report = match report {
        Ok(r) => r,
        Err(e) if json => {
            doc.error = Some(format!("{e:#}"));
            print_json(&doc)?;
            return Err(e.into());
        }
        Err(e) => return Err(e.into()),
    };
    say(&report.verdict);
    crate::notify::after_reconcile(ctx, &d, &report, t0.elapsed()).await;
    crate::notify::flush(std::time::Duration::from_secs(30)).await;
    doc.outcome = report.outcome;
    doc.verdict = Some(report.verdict.clone());
    doc.previous_instance = report.stop_verdict.clone();
    let runs = crate::sync::runs_spec(report.outcome, report.plan.sync);
    let code = if runs {
        // It serves: the pin no longer ends with this process.
        ctx.store.set_hold_if(&unit, hold.clone(), |h| *h == pending).await?;
        say(&format!("{unit}: {}", hold.describe()));
        doc.pinned = true;
        doc.hold = Some(hold);
        0
    } else {
        ctx.store.clear_hold_if(&unit, "the rollback to it did not run", |h| *h == pending).await?;
        say(&format!("{unit}: not pinned (the rollback did not run)"));
        1
    };
    if control_post(&socket, Some(&unit)).await.is_ok() {
        say(&format!("asked the running agent to reconcile {unit}"));
    }
    if json {
        doc.ok = code == 0;
        print_json(&doc)?;
    }
    Ok(code)
}

/// The shutdown of a one-shot command that applies (`specd apply`, `specd rollback`): see
/// [`context::interruptible`]; what is in progress is finished ([`reconcile::Finish::Everything`]).
fn interruptible(command: &str, what: &str) -> Shutdown {
    context::interruptible(
        reconcile::Finish::Everything,
        format!(
            "{command}: interrupted: {what} goes on until no unit is left down (one not stopped yet is left as it runs); again to quit at once"
        ),
        format!(
            "{command}: interrupted again: quitting now; the unit is left as it is: a running agent finishes {what}, else run `{command}` again"
        ),
    )
}

/// The good unit `specd rollback` goes back to: the newest kept one that is not deployed, or
/// the one whose hash starts with `to`.
fn rollback_target<'a>(
    st: &'a state::UnitState,
    deployed: Option<&str>,
    to: Option<&str>,
) -> Result<&'a state::DesiredRecord, String> {
    let kept = || {
        let v: Vec<String> = st
            .good_specs
            .iter()
            .rev()
            .map(|g| format!("{} ({})", short(&g.sha256), state::format_time(g.time)))
            .collect();
        if v.is_empty() { "none".to_string() } else { v.join(", ") }
    };
    match to {
        Some(prefix) => {
            let p = prefix.trim().to_ascii_lowercase();
            if p.len() < 4 || !p.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(format!("--to {prefix:?}: give at least 4 hex digits of a unit hash (`specd history`)"));
            }
            let found: Vec<_> = st.good_specs.iter().filter(|g| g.sha256.starts_with(&p)).collect();
            match found.as_slice() {
                [one] => Ok(one),
                [] if st.history.iter().any(|h| h.sha256.starts_with(&p)) => Err(format!(
                    "unit {p} is in the history, but specd keeps the specs of the last {} good units only, and it is not one of them (kept: {})",
                    state::GOOD_SPECS_MAX,
                    kept()
                )),
                [] => Err(format!("no good unit {p} is recorded (kept: {})", kept())),
                _ => Err(format!("--to {p} names more than one unit: give more digits (kept: {})", kept())),
            }
        }
        None => st
            .good_specs
            .iter()
            .rev()
            .find(|g| Some(g.sha256.as_str()) != deployed)
            .ok_or_else(|| format!("no earlier good unit is recorded to roll back to (kept: {})", kept())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::ActiveState;

    #[test]
    fn only_a_live_sweep_stops_a_hand_apply() {
        let hold = |kind, pid| state::Hold { pid, ..state::Hold::new(kind, "specd sweep qwen-mtp-steps", 0) };
        let st = |h| state::UnitState { unit: "a.service".into(), hold: Some(h), ..Default::default() };
        let host = this_host();
        let live_sweep = |st: &state::UnitState| live_sweep(&host, st);
        let why = live_sweep(&st(hold(state::HoldKind::Sweep, Some(std::process::id())))).unwrap();
        assert!(
            why.contains("held by a sweep by specd sweep qwen-mtp-steps") && why.contains("stop the sweep"),
            "{why}"
        );
        // The sweep's pid, now another process's (it started at another time): not live.
        let me = std::process::id();
        let started = crate::host::pid_start(me).unwrap();
        let at = |start| state::Hold { pid_start: Some(start), ..hold(state::HoldKind::Sweep, Some(me)) };
        assert!(live_sweep(&st(at(started))).is_some());
        assert_eq!(live_sweep(&st(at(started + 1))), None);
        let mut gone = std::process::Command::new("true").spawn().unwrap();
        let pid = gone.id();
        gone.wait().unwrap();
        assert_eq!(live_sweep(&st(hold(state::HoldKind::Sweep, Some(pid)))), None);
        // Past its end, even with its process alive (a sweep that hung): the agent's again.
        let expired = state::Hold { until: Some(1), ..hold(state::HoldKind::Sweep, Some(me)) };
        assert_eq!(live_sweep(&st(expired)), None);
        // One that names no process (an older specd's): in effect until it expires, as the agent
        // sees it.
        assert!(live_sweep(&st(hold(state::HoldKind::Sweep, None))).is_some());
        assert_eq!(live_sweep(&st(state::Hold { until: Some(1), ..hold(state::HoldKind::Sweep, None) })), None);
        assert_eq!(live_sweep(&st(hold(state::HoldKind::Suspend, None))), None);
        assert_eq!(live_sweep(&st(hold(state::HoldKind::Pin, None))), None);
    }

    #[tokio::test]
    async fn the_sweep_s_own_applies_are_its_own() {
        let d = tempfile::tempdir().unwrap();
        let store = Store::new(d.path());
        assert!(!sweeps_own(&store, "a.service"), "no hold");
        let hold = |pid| state::Hold { pid: Some(pid), ..state::Hold::new(state::HoldKind::Sweep, "specd sweep s", 0) };
        store.set_hold("a.service", hold(std::process::id())).await.unwrap();
        assert!(sweeps_own(&store, "a.service"), "the holding process itself");
        store.set_hold("a.service", hold(nix::unistd::getppid().as_raw().unsigned_abs())).await.unwrap();
        assert!(sweeps_own(&store, "a.service"), "a child of the holding process");
        store.set_hold("a.service", hold(1)).await.unwrap();
        assert!(!sweeps_own(&store, "a.service"), "another process's sweep");
    }

    #[test]
    fn durations_are_numbers_with_units() {
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("2d"), Ok(Duration::from_secs(172_800)));
        for bad in ["", "10", "h", "5x", "0m", "-1h", "1.5h"] {
            assert!(parse_duration(bad).unwrap_err().contains("is not a duration"), "{bad}");
        }
    }

    fn good(sha: &str, time: u64) -> state::DesiredRecord {
        let text = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/llama-cpp-qwen-draft.yaml"));
        let spec = specd_spec::parse("t.yaml", text).and_then(|p| p.resolve(None)).unwrap();
        state::DesiredRecord { sha256: sha.into(), source: None, time, spec }
    }

    #[test]
    fn a_rollback_goes_to_the_newest_good_unit_not_deployed_or_the_one_named() {
        let mut st = state::UnitState { unit: "t.service".into(), ..Default::default() };
        assert!(rollback_target(&st, None, None).unwrap_err().contains("no earlier good unit"));
        st.good_specs = vec![good("aaaa1111", 1), good("aaaa2222", 2), good("bbbb3333", 3)];
        assert_eq!(rollback_target(&st, Some("bbbb3333"), None).unwrap().sha256, "aaaa2222");
        // The deployed unit failed and was not kept: the newest good one is the target.
        assert_eq!(rollback_target(&st, Some("cccc4444"), None).unwrap().sha256, "bbbb3333");
        assert_eq!(rollback_target(&st, None, Some("AAAA1")).unwrap().sha256, "aaaa1111");
        assert!(rollback_target(&st, None, Some("aaaa")).unwrap_err().contains("more than one"));
        assert!(rollback_target(&st, None, Some("abc")).unwrap_err().contains("at least 4 hex digits"));
        assert!(rollback_target(&st, None, Some("dddd")).unwrap_err().contains("no good unit dddd"));
        st.history.push(state::HistoryEntry {
            time: 0,
            sha256: "dddd0000".into(),
            source: None,
            outcome: state::Outcome::Applied,
            message: String::new(),
            stop_verdict: None,
            duration_ms: 0,
        });
        assert!(rollback_target(&st, None, Some("dddd")).unwrap_err().contains("keeps the specs of the last 8"));
    }

    #[test]
    fn a_hand_apply_of_another_unit_than_the_agent_s_is_said_to_be_reverted() {
        let commit = Source::Commit { repo: "/srv/specs".into(), commit: "c".repeat(40), path: "q.yaml".into() };
        let agent = SourceState { repo: "/srv/specs".into(), ..SourceState::default() };
        let entry = |sha: &str, source: Option<Source>| state::HistoryEntry {
            time: 1,
            sha256: sha.into(),
            source,
            outcome: state::Outcome::Applied,
            message: String::new(),
            stop_verdict: None,
            duration_ms: 0,
        };
        let st = state::UnitState {
            unit: UNIT.into(),
            history: vec![entry(&"a".repeat(64), Some(commit.clone()))],
            ..Default::default()
        };
        let (sha, why) = agent_reverts(&st, Some(&agent), &"b".repeat(64)).unwrap();
        assert_eq!(sha, "a".repeat(64));
        assert_eq!(
            why,
            "sglang-qwen.service: the agent that follows /srv/specs deploys unit aaaaaaaaaaaa from commit cccccccccccc (q.yaml) here and puts it back at its next look; commit this spec there to keep it, or `specd suspend sglang-qwen.service` first"
        );
        // The agent's own unit, no agent on this host, or one that never deployed this unit: nothing to say.
        assert!(agent_reverts(&st, Some(&agent), &"a".repeat(64)).is_none());
        assert!(agent_reverts(&st, None, &"b".repeat(64)).is_none());
        let by_hand = state::UnitState { history: vec![entry(&"a".repeat(64), None)], ..st.clone() };
        assert!(agent_reverts(&by_hand, Some(&agent), &"b".repeat(64)).is_none());
    }

    #[test]
    fn a_refused_promotion_record_is_said_as_such_not_as_a_head_not_deployed() {
        let plain = SourceState { error: Some("commit abc: not signed".into()), ..SourceState::default() };
        assert_eq!(not_deployed(&plain, "commit abc: not signed"), "head not deployed: commit abc: not signed");
        let fleet = SourceState {
            fleet: Some(state::FleetPosition {
                record_branch: "specd-promotions".into(),
                record: Some("0123456789abcdef0123".into()),
                ..Default::default()
            }),
            ..plain
        };
        assert_eq!(
            not_deployed(&fleet, "the record's commit 0123: not signed"),
            "promotion not followed (0123456789ab of specd-promotions): the record's commit 0123: not signed"
        );
    }

    #[test]
    fn health_is_the_readiness_answer_or_else_systemd_s_state() {
        assert_eq!(ServiceHealth::of(Some(true), ActiveState::Active), ServiceHealth::Healthy);
        assert_eq!(ServiceHealth::of(Some(false), ActiveState::Active), ServiceHealth::Loading);
        assert_eq!(ServiceHealth::of(None, ActiveState::Activating), ServiceHealth::Unknown);
        assert_eq!(ServiceHealth::of(None, ActiveState::Failed), ServiceHealth::Down);
        assert_eq!(ServiceHealth::of(None, ActiveState::Deactivating), ServiceHealth::Down);
        assert_eq!(serde_json::to_value(ServiceHealth::Healthy).unwrap(), "Healthy");
        assert_eq!(ServiceHealth::Down.to_string(), "Down");
    }

    // The commands on the fake host and tokio's paused clock: what a person runs, and what
    // they would check after (the exit code, what status says, what serves), without a machine.

    const UNIT: &str = "sglang-qwen.service";

    fn spec_text(steps: u32) -> String {
        format!(
            "apiVersion: specd/v1\nkind: InferenceService\nmetadata: {{name: qwen}}\nspec:\n  unit: {UNIT}\n  engine: sglang\n  command: [/opt/sglang/bin/python3, -m, sglang.launch_server]\n  model: /models/qwen\n  server: {{port: 30000}}\n  speculative: {{algorithm: EAGLE, draft_model: /models/draft, num_steps: {steps}, eagle_topk: 1, num_draft_tokens: {}}}\n  service: {{timeout_stop_sec: 10, drain_timeout_sec: 5}}\n",
            steps + 1
        )
    }

    /// A host where a server of `steps` serves (or fails to load, for `fails`), and the spec
    /// files `qwen-<steps>.yaml` in the test's directory.
    struct OnFake {
        host: crate::host::fake::FakeHost,
        dirs: Dirs,
        dir: tempfile::TempDir,
    }

    impl OnFake {
        fn new() -> OnFake {
            let dir = tempfile::tempdir().unwrap();
            let dirs = Dirs { state_dir: dir.path().join("state"), unit_dir: dir.path().join("units") };
            let host = crate::host::fake::FakeHost::new(UNIT, &dirs.unit_dir);
            OnFake { host, dirs, dir }
        }

        /// The spec file of `steps`, whose servers load (or fail to).
        fn spec(&self, steps: u32, fails: bool) -> PathBuf {
            let path = self.dir.path().join(format!("qwen-{steps}.yaml"));
            std::fs::write(&path, spec_text(steps)).unwrap();
            let spec = specd_spec::parse("q.yaml", &spec_text(steps)).unwrap().resolve(None).unwrap();
            self.host.serves(&spec, fails);
            path
        }

        fn argv(&self, steps: u32) -> Vec<String> {
            specd_spec::parse("q.yaml", &spec_text(steps)).unwrap().resolve(None).unwrap().argv
        }

        fn ctx(&self) -> Ctx<crate::host::fake::FakeHost> {
            context::ctx_on(self.host.clone(), &self.dirs, Arc::new(|_: &str, _: &Event| {}), Shutdown::never())
        }

        async fn apply(&self, files: &[PathBuf]) -> u8 {
            apply_on(self.host.clone(), &self.dirs, files, None, false, false, Shutdown::never).await.unwrap()
        }

        async fn status(&self, file: Option<&Path>) -> (u8, UnitStatus) {
            let (code, mut all) = status_on(&self.ctx(), &self.dirs, false, file, None).await.unwrap();
            assert_eq!(all.len(), 1);
            (code, all.remove(0))
        }
    }

    #[tokio::test(start_paused = true)]
    async fn status_says_each_state_of_a_unit_and_exits_0_only_in_sync_and_healthy() {
        let f = OnFake::new();
        let (good, bad) = (f.spec(3, false), f.spec(5, true));
        assert_eq!(f.apply(std::slice::from_ref(&good)).await, 0);
        let (code, s) = f.status(None).await;
        assert_eq!(
            (code, s.sync, s.health, s.cmdline_matches, s.cmdline_of),
            (0, SyncStatus::InSync, ServiceHealth::Healthy, Some(true), CmdlineOf::Desired)
        );

        // A spec that fails to load: rolled back, the old unit serves; its last try says why.
        assert_eq!(f.apply(std::slice::from_ref(&bad)).await, 1);
        assert_eq!(f.host.serving(), Some(f.argv(3)));
        let (code, s) = f.status(Some(&bad)).await;
        assert_eq!((code, s.sync, s.health), (1, SyncStatus::Failed, ServiceHealth::Healthy), "{s:?}");
        // The process that serves is exactly the deployed (last good) unit's, and said so.
        assert_eq!((s.cmdline_matches, s.cmdline_of), (Some(true), CmdlineOf::Deployed), "{s:?}");
        let last = s.last_result.as_ref().unwrap();
        assert!(s.reasons.contains(&last.message), "{:?}", s.reasons);
        // The instance before the one that serves died loading: said while its successor runs.
        assert!(s.last_ended.as_deref().is_some_and(|e| e.starts_with("crash")), "{s:?}");

        // An apply in progress (another process holds the unit's lock): Progressing, said first.
        let lock = crate::lock::UnitLock::try_acquire(&f.ctx().store.locks_dir(), UNIT).unwrap().unwrap();
        let (code, s) = f.status(Some(&good)).await;
        assert_eq!((code, s.sync), (1, SyncStatus::Progressing));
        assert!(s.reasons[0].starts_with("an apply is running"), "{:?}", s.reasons);
        drop(lock);

        // The service stopped behind specd's back: down, and why.
        f.host.stop(UNIT, true).await.unwrap();
        let (code, s) = f.status(Some(&good)).await;
        assert_eq!((code, s.health), (1, ServiceHealth::Down), "{s:?}");
        assert!(s.down.is_some(), "{s:?}");
        // Its last instance is the one that served, stopped on request: not the crash before it
        // (systemd keeps a stopped unit's InvocationID).
        assert_eq!(s.last_ended.as_deref(), Some("clean stop: stopped on request"), "{s:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn an_apply_of_two_files_where_the_second_is_not_valid_changes_nothing() {
        let f = OnFake::new();
        let good = f.spec(3, false);
        let broken = f.dir.path().join("broken.yaml");
        std::fs::write(&broken, spec_text(4).replace("engine: sglang", "engine: sglangx")).unwrap();
        assert_eq!(f.apply(&[good.clone(), broken]).await, 1);
        // Two files for one unit: refused as well.
        let other = f.spec(4, false);
        assert_eq!(f.apply(&[good, other]).await, 1);
        assert_eq!(f.host.stops_and_starts(), (0, 0));
        assert!(f.host.writes().is_empty());
        assert!(f.ctx().store.units().unwrap().is_empty(), "a state was recorded");
    }

    #[tokio::test(start_paused = true)]
    async fn a_rollback_goes_back_to_an_earlier_good_unit_and_pins_it() {
        let f = OnFake::new();
        let (v1, v2) = (f.spec(3, false), f.spec(5, false));
        assert_eq!(f.apply(&[v1]).await, 0);
        assert_eq!(f.apply(&[v2]).await, 0);
        let ctx = f.ctx();
        let no_agent = f.dir.path().join("no-agent.sock");
        let good = ctx.store.peek(UNIT).unwrap().good_specs;
        let (v1_sha, v2_sha) = (good[0].sha256.clone(), good[1].sha256.clone());

        // No --to: the newest good unit that is not deployed (v1), pinned there.
        assert_eq!(rollback_on(&ctx, UNIT.into(), None, None, no_agent.clone(), false).await.unwrap(), 0);
        assert_eq!(f.host.serving(), Some(f.argv(3)));
        let pin = ctx.store.peek(UNIT).unwrap().hold.unwrap();
        assert_eq!(
            (pin.kind, pin.pinned_sha256.as_deref(), pin.pid),
            (state::HoldKind::Pin, Some(v1_sha.as_str()), None)
        );
        // The pin keeps the agent out while the source still wants v2, and is no command's
        // business.
        assert!(matches!(f.host.hold_effect(Some(&pin), &v2_sha), crate::hold::HoldEffect::HandsOff(_)));

        // --to a hash prefix: that one (v2 again), pinned at it.
        let code = rollback_on(&ctx, UNIT.into(), Some(v2_sha[..8].into()), None, no_agent.clone(), false);
        assert_eq!(code.await.unwrap(), 0);
        assert_eq!(f.host.serving(), Some(f.argv(5)));
        assert_eq!(ctx.store.peek(UNIT).unwrap().hold.unwrap().pinned_sha256, Some(v2_sha));
        // A hash no good unit has: refused, nothing changed.
        let starts = f.host.stops_and_starts();
        assert_eq!(rollback_on(&ctx, UNIT.into(), Some("ffff".into()), None, no_agent, false).await.unwrap(), 1);
        assert_eq!(f.host.stops_and_starts(), starts);
    }
}
