//! `specd rollback UNIT [--to HASH]`: an earlier good unit applied through the normal apply, and
//! pinned there.

use super::control::control_post;
use super::*;
use crate::core::hold;
use crate::core::record;
use crate::core::record::Source;
use crate::host::Host;
use crate::reconcile::context::{self, Dirs};
use crate::reconcile::progress::{self, Sink};
use crate::reconcile::{Ctx, DesiredState};
use anyhow::Result;
use serde::Serialize;
use specd_spec::short;
use std::path::PathBuf;

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
    /// What the reconcile that applied it did.
    #[serde(flatten)]
    pub reconcile: ReconcileJson,
    /// The pin is in place: the agent leaves the unit there until the source has a new desired
    /// unit or `specd resume`.
    pub pinned: bool,
    pub hold: Option<hold::Hold>,
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
    let ctx = context::host_ctx(dirs, progress::events(Sink::Stderr), interruptible("specd rollback", "the rollback"));
    rollback_on(&ctx, unit, to, reason, socket, json).await
}

/// [`rollback`] on `ctx`'s host.
pub(super) async fn rollback_on<H: Host>(
    ctx: &Ctx<H>,
    unit: String,
    to: Option<String>,
    reason: Option<String>,
    socket: PathBuf,
    json: bool,
) -> Result<u8> {
    let mut doc = RollbackJson { unit: unit.clone(), ..Default::default() };
    let say = |line: &str| if json { eprintln!("{line}") } else { println!("{line}") };
    let Some(st) = known_unit(&ctx.store, &unit)? else {
        print_failed(doc, json, format!("{unit}: specd has no state for this unit; nothing was changed"))?;
        return Ok(1);
    };
    if let Some(why) = live_sweep(&ctx.host, &st) {
        return refuse(doc, json, format!("refused: {unit}: {why}; nothing was changed"));
    }
    let deployed = ctx.host.read(&crate::host::unit_path(&ctx.unit_dir, &unit))?.map(|b| specd_spec::sha256_hex(&b));
    let target = match rollback_target(&st, deployed.as_deref(), to.as_deref()) {
        Ok(t) => t.clone(),
        Err(e) => return refuse(doc, json, format!("{unit}: {e}; nothing was changed")),
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
    let hold = pin(&st, &d.unit.sha256, reason, ctx.host.now());
    // Pinned first, so that an agent that runs does not move it forward meanwhile; but only
    // while this process lives until the unit serves: killed half-way (or quit by a second
    // signal), its pin ends with it, and the agent puts the source's unit back.
    let (me, started) = ctx.host.me();
    let pending = hold::Hold { pid: Some(me), pid_start: started, ..hold.clone() };
    ctx.store.set_hold(&unit, pending.clone()).await?;
    say(&format!(
        "{unit}: rolling back to unit {} ({}, good at {})",
        short(&d.unit.sha256),
        d.source.as_ref().map_or("no source".into(), |s| s.to_string()),
        record::format_time(target.time)
    ));
    let t0 = std::time::Instant::now();
    // A replica waits for its group (`core::roll`) as an apply does.
    let report = super::in_turn(ctx, &d, false).await;
    progress::flush_progress();
    let report = match report {
        Ok(r) => r,
        Err(e) => {
            print_failed(doc, json, format!("{e:#}"))?;
            return Err(e.into());
        }
    };
    say(&report.verdict);
    crate::notify::after_reconcile(ctx, &d, &report, t0.elapsed()).await;
    crate::notify::flush(std::time::Duration::from_secs(30)).await;
    doc.reconcile = ReconcileJson::of(&report);
    let runs = crate::core::sync::runs_spec(report.outcome, report.plan.sync);
    let code = settle_pin(ctx, &unit, (hold, &pending), runs, say, &mut doc).await?;
    if control_post(&socket, Some(&unit)).await.is_ok() {
        say(&format!("asked the running agent to reconcile {unit}"));
    }
    finish(doc, json, code)
}

/// The pin a rollback to unit `sha256` leaves (for `reason`), made at `now`: it remembers the
/// desired unit the source had when pinned, so that a second rollback keeps the first's.
fn pin(st: &record::UnitState, sha256: &str, reason: Option<String>, now: u64) -> hold::Hold {
    let desired_at_pin = match &st.hold {
        Some(h) if h.kind == hold::HoldKind::Pin => h.desired_at_pin.clone(),
        _ => st.desired.as_ref().map(|r| r.sha256.clone()),
    };
    hold::Hold {
        reason,
        pinned_sha256: Some(sha256.to_string()),
        desired_at_pin,
        ..hold::Hold::new(hold::HoldKind::Pin, operator("specd rollback"), now)
    }
}

/// After the rollback's apply: when the unit `runs` its earlier good unit, the `pending` pin
/// (which ends with this process) becomes `hold`, which does not; else it is cleared. What
/// became of it is said (`say`). The exit code: 0 pinned, 1 not.
async fn settle_pin<H: Host>(
    ctx: &Ctx<H>,
    unit: &str,
    (hold, pending): (hold::Hold, &hold::Hold),
    runs: bool,
    say: impl Fn(&str),
    doc: &mut RollbackJson,
) -> Result<u8> {
    if runs {
        // It serves: the pin no longer ends with this process.
        ctx.store.set_hold_if(unit, hold.clone(), |h| h == pending).await?;
        say(&format!("{unit}: {}", hold.describe()));
        doc.pinned = true;
        doc.hold = Some(hold);
        Ok(0)
    } else {
        ctx.store.clear_hold_if(unit, "the rollback to it did not run", |h| h == pending).await?;
        say(&format!("{unit}: not pinned (the rollback did not run)"));
        Ok(1)
    }
}

/// The good unit `specd rollback` goes back to: the newest kept one that is not deployed, or
/// the one whose hash starts with `to`.
pub(super) fn rollback_target<'a>(
    st: &'a record::UnitState,
    deployed: Option<&str>,
    to: Option<&str>,
) -> Result<&'a record::DesiredRecord, String> {
    let kept = || {
        let v: Vec<String> = st
            .good_specs
            .iter()
            .rev()
            .map(|g| format!("{} ({})", short(&g.sha256), record::format_time(g.time)))
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
                    record::GOOD_SPECS_MAX,
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
