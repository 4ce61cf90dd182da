//! Before and after a sweep: the unit as it was (`before.json`), put back or moved to the best
//! point through the apply path.

use super::*;
use crate::core::record::{Outcome, Source};
use crate::machine::atomic;
use crate::reconcile::{Ctx, DesiredState};
use crate::sweep::report::PointResult;
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use specd_spec::Spec;
use specd_spec::sweep::{After, Point};
use std::path::Path;

/// The unit as it was before the sweep: what `after: restore` applies again. Kept in the
/// output directory so that a resumed sweep restores the same thing.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct Before {
    pub(super) unit: String,
    /// The desired state specd had for the unit (`None`: specd never deployed it).
    pub(super) spec: Option<Spec>,
    pub(super) source: Option<Source>,
    pub(super) sha256: Option<String>,
}

/// What the host is left on: the best point with `after: best` when there is one and the sweep
/// was not interrupted; else the unit as it was before, if specd had deployed it.
pub(super) fn after_target(
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
pub(super) async fn apply_after<H: SweepHost>(ctx: &Ctx<H>, target: Option<DesiredState>, unit: &str) -> Result<bool> {
    match target {
        Some(d) => {
            let r = crate::commands::in_turn(ctx, &d, false).await?;
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

/// After a sweep that stopped on an error: the unit as it was, if specd had deployed it.
pub(super) async fn restore<H: SweepHost>(ctx: &Ctx<H>, unit: &str, before: &Before) {
    let Some(spec) = before.spec.clone() else { return };
    eprintln!("after: restoring {unit} as it was before the sweep");
    match crate::commands::in_turn(ctx, &DesiredState::new(spec, before.source.clone()), false).await {
        Ok(r) => eprintln!("after: {}", r.verdict),
        Err(e) => eprintln!("after: restoring {unit}: {e:#}"),
    }
}

/// What the sweep restores: recorded at its first run, read again on resume.
/// The one recorded by an earlier run of this sweep is what is restored when this run goes on
/// with it (`--resume`), or when the unit is still on one of the sweep's points (that run was
/// killed before it restored); otherwise the unit as it is now. Private (0600): the spec may hold
/// literal environment values.
pub(super) fn before<H: SweepHost>(
    ctx: &Ctx<H>,
    out: &Path,
    unit: &str,
    resume: bool,
    points: &[Point],
) -> Result<Before> {
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
