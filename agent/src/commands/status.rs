//! `specd status`: each unit as the host runs it, against what specd recorded.

use super::*;
use crate::core::hold;
use crate::core::plan;
use crate::core::record;
use crate::core::record::Source;
use crate::core::serving::{Poller, ServingState};
use crate::core::sync::SyncStatus;
use crate::core::timing;
use crate::host::Host;
use crate::machine::store::SourceState;
use crate::reconcile::context::{self, Dirs};
use crate::reconcile::{self, Ctx, DesiredState, Event, Shutdown};
use anyhow::{Context, Result};
use serde::Serialize;
use std::path::Path;
use std::sync::Arc;

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
    pub last_result: Option<record::HistoryEntry>,
    pub error: Option<String>,
    /// How the last instance that ended, ended (`specd diagnose` has the evidence).
    pub last_ended: Option<String>,
    /// What the last speculation proof of the deployed unit measured.
    pub speculation: Option<record::SpeculationRecord>,
    /// The last start specd made of the unit, timed by phase (`unit_hash`: which unit it started).
    pub startup: Option<record::Startup>,
    /// Why the service is not running, when it is not.
    pub down: Option<String>,
    /// A hold that keeps the agent's hands off the unit (suspend, pin, sweep).
    pub hold: Option<hold::Hold>,
    /// What its load balancers are told (ready, drain, down: why, since when); `None`: nothing
    /// yet (they are answered down).
    pub serving: Option<ServingState>,
    /// The load balancers that polled it lately: address, how (`agent-check`, `http`), when
    /// (unix ms) and what they were answered.
    pub polled_by: Vec<Poller>,
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
    pub(super) fn of(ready: Option<bool>, active: crate::core::unit_state::ActiveState) -> ServiceHealth {
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

/// What `status` says of one unit: the host as it runs it against the desired state specd
/// recorded (or `override_desired`, a spec given with `--file`).
pub(super) async fn unit_status<H: Host>(
    ctx: &Ctx<H>,
    st: &record::UnitState,
    override_desired: Option<&DesiredState>,
) -> Result<UnitStatus> {
    let desired = match (override_desired, &st.desired) {
        (Some(d), _) => Some(d.clone()),
        (None, Some(rec)) => Some(DesiredState::new(rec.spec.clone(), rec.source.clone())),
        (None, None) => None,
    };
    let Some(d) = desired else { return no_desired_state(ctx, st).await };
    let (o, props) = reconcile::observe(ctx, &d, st, true).await?;
    let p = plan::plan(&o, &reconcile::desired_of(&ctx.unit_dir, &d));
    let p = reconcile::group_plan(ctx, &d, st, &o, p)?;
    // An apply runs when the unit's lock is held and it recorded its phase: a look that finds
    // the unit in sync holds the lock too, and is no apply.
    let applying = crate::machine::lock::UnitLock::held(&ctx.store.locks_dir(), &st.unit) && st.in_progress.is_some();
    let (sync, reasons) = sync_and_reasons(st, &d, p, applying);
    let health = ServiceHealth::of(o.ready, props.active_state);
    let (cmdline_of, argv) = compared_argv(ctx, st, &d, o.deployed_sha256.as_deref())?;
    let down = (health == ServiceHealth::Down)
        .then(|| crate::core::sync::down_reason(st.history.last(), props.active_state, &props.sub_state));
    let (serving, polled_by) = load_balancers(ctx, &st.unit);
    Ok(UnitStatus {
        down,
        hold: st.hold.clone(),
        serving,
        polled_by,
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
        cmdline_matches: o.main_cmdline.as_ref().zip(argv).map(|(c, argv)| crate::core::plan::runs_argv(c, &argv)),
        cmdline_of,
        arg_mismatches: o.arg_mismatches.clone(),
        last_result: st.history.last().cloned(),
        error: None,
        last_ended: last_ended(ctx, st, &props).await,
        // The proof of the running unit's speculation (a measurement of an older hash is not it).
        speculation: st
            .speculation
            .as_ref()
            .filter(|r| o.deployed_sha256.as_deref() == Some(r.sha256.as_str()))
            .cloned(),
        startup: st.startup.clone(),
    })
}

/// A unit specd has state for but no desired state recorded: out of sync, and what systemd
/// says of it.
async fn no_desired_state<H: Host>(ctx: &Ctx<H>, st: &record::UnitState) -> Result<UnitStatus> {
    let props = ctx.host.show(&st.unit).await?;
    Ok(UnitStatus {
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
        startup: st.startup.clone(),
        down: None,
        hold: st.hold.clone(),
        serving: ctx.host.serving_state(&st.unit),
        polled_by: Vec::new(),
    })
}

/// What the unit's load balancers are told, and those that polled it within the last
/// [`POLLED_WITHIN`].
fn load_balancers<H: Host>(ctx: &Ctx<H>, unit: &str) -> (Option<ServingState>, Vec<Poller>) {
    let since = ctx.host.now_ms().saturating_sub(POLLED_WITHIN.as_millis() as u64);
    let log = ctx.host.lb_polls(unit);
    (ctx.host.serving_state(unit), log.pollers.into_values().filter(|p| p.last_ms >= since).collect())
}

/// `status` names the load balancers that polled a unit this recently.
const POLLED_WITHIN: std::time::Duration = std::time::Duration::from_secs(300);

/// The unit's sync status and why, from the plan `p` for the desired state `d`, an apply that
/// is `applying` now (its phase said first), and its last try of `d` (a failed one's message
/// said last).
fn sync_and_reasons(
    st: &record::UnitState,
    d: &DesiredState,
    p: plan::Plan,
    applying: bool,
) -> (SyncStatus, Vec<String>) {
    let mut reasons = p.reasons;
    let last = st.history.last().filter(|h| h.sha256 == d.unit.sha256);
    let sync = crate::core::sync::status(crate::core::sync::Seen {
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
    if let Some(last) = last.filter(|h| crate::core::sync::failed_try(h.outcome) && sync == SyncStatus::Failed)
        && !reasons.iter().any(|r| r.contains(&last.message))
    {
        reasons.push(last.message.clone());
    }
    (sync, reasons)
}

/// The argv the running process is compared with: the desired unit's when it is deployed
/// (`deployed_sha256`); otherwise (the desired unit refused, quarantined, held or not applied
/// yet) the `ExecStart=` of the file on disk.
fn compared_argv<H: Host>(
    ctx: &Ctx<H>,
    st: &record::UnitState,
    d: &DesiredState,
    deployed_sha256: Option<&str>,
) -> Result<(CmdlineOf, Option<Vec<String>>)> {
    if deployed_sha256 == Some(d.unit.sha256.as_str()) {
        return Ok((CmdlineOf::Desired, Some(d.spec.argv.clone())));
    }
    let text = ctx.host.read(&crate::host::unit_path(&ctx.unit_dir, &st.unit))?;
    Ok((CmdlineOf::Deployed, text.and_then(|t| specd_spec::exec_start(&String::from_utf8_lossy(&t)))))
}

/// How the unit's last instance that ended, ended: recorded when specd saw it end, while the
/// one after it still runs; otherwise (a restart specd did not make, or no record yet) read
/// from the journal.
async fn last_ended<H: Host>(
    ctx: &Ctx<H>,
    st: &record::UnitState,
    props: &crate::machine::systemd::UnitProps,
) -> Option<String> {
    match crate::core::sync::recorded_ending(
        st.last_ended.as_ref(),
        &props.invocation_id,
        props.active_state,
        props.main_pid,
    ) {
        Some(said) => said,
        None => ctx.host.ending(&st.unit, "", timing::LAST_ENDED_WITHIN).await.map(|e| e.summary),
    }
}

/// `specd status [-f FILE]`: every unit specd has state for (or the file's), as the host runs it.
/// Exit 0 when all are in sync and healthy, and the source's head deployed with no orphan.
pub async fn status(dirs: &Dirs, json: bool, file: Option<&Path>, host: Option<String>) -> Result<u8> {
    let ctx = context::host_ctx(dirs, Arc::new(|_: &str, _: &Event| {}), Shutdown::never());
    status_on(&ctx, dirs, json, file, host).await.map(|(code, _)| code)
}

/// [`status`] on `ctx`'s host: the exit code and what it said of each unit.
pub(super) async fn status_on<H: Host>(
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
pub(super) fn not_deployed(s: &SourceState, error: &str) -> String {
    match &s.fleet {
        Some(f) => format!("promotion not followed ({} of {}): {error}", hash(&f.record), f.record_branch),
        None => format!("head not deployed: {error}"),
    }
}

/// `  load balancers: told ready (for 5 min); polled by 10.0.0.5 (agent-check, 1 s ago)`.
fn print_load_balancers(s: &UnitStatus) {
    let now = crate::machine::store::now_ms();
    let told = match &s.serving {
        Some(state) => format!("told {}", state.describe(now / 1000)),
        None => format!("told down: {}", crate::core::serving::NO_STATE),
    };
    let polled = if s.polled_by.is_empty() {
        "no load balancer polled it in the last 5 min".to_string()
    } else {
        let each: Vec<String> = s
            .polled_by
            .iter()
            .map(|p| {
                let kind = match p.kind {
                    crate::core::serving::CheckKind::AgentCheck => "agent-check",
                    crate::core::serving::CheckKind::Http => "HTTP check",
                };
                format!("{} ({kind}, {:.0} s ago)", p.addr, now.saturating_sub(p.last_ms) as f64 / 1000.0)
            })
            .collect();
        format!("polled by {}", each.join(", "))
    };
    println!("  load balancers: {told}; {polled}");
}

pub(super) fn print_status(s: &UnitStatus) {
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
    print_load_balancers(s);
    if let Some(h) = &s.hold {
        let what = match h.kind {
            hold::HoldKind::Suspend => "the agent observes and reports drift only; a hand `specd apply` still applies",
            hold::HoldKind::Pin => {
                "the agent leaves this unit until the source has a new desired unit or `specd resume`"
            }
            hold::HoldKind::Sweep => "the agent observes only; `specd apply` is refused while the sweep runs",
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
            record::format_time(r.time),
            r.measured.evidence.join(", ")
        );
    }
    if let Some(r) = &s.startup {
        println!(
            "  last start: unit {} {} ({})",
            specd_spec::short(&r.sha256),
            r.describe(),
            record::format_time(r.time)
        );
    }
    if let Some(v) = &s.last_ended {
        println!("  last ended: {v}");
    }
    if let Some(h) = &s.last_result {
        println!("  last: {} {}", record::format_time(h.time), h.message);
        if let Some(v) = &h.stop_verdict {
            println!("  last stop: {v}");
        }
    }
}
