//! The reconciler: observe → pure plan → act → record, one reconcile per unit at a time (a flock
//! per unit across processes). Shaped like kube-rs: [`reconcile`] returns the next [`Action`],
//! and [`error_policy`] turns an error into one.
//!
//! The apply sequence (`steps`): `Drain → Stop → WaitStopped → [RemoveDropIns] → WriteUnit →
//! Reload → Start → VerifyCmdline → WaitReady → [Enable | Disable] → VerifyArgs →
//! VerifySpeculation`. Before anything is stopped, a plan that would stop a serving instance asks
//! the host whether the desired unit can start at all (the pre-flight, looking while the drain
//! runs; the first step that changes anything waits for it): a problem refuses the plan and
//! nothing is stopped. Stopped means the unit's cgroup is empty; the unit file is written to a
//! temp file, fsynced and renamed; the reload is checked (`NeedDaemonReload=no`, the fragment);
//! the start is proved (the main process's argv, the server's own reported args, a short
//! generation that drafts). A failure after the write is `recovery::after`'s to decide: the spec
//! failed → roll back to the last good unit by the same sequence without the drain and the
//! checks that belong to the new spec (`restore`), and quarantine the hash; the host failed →
//! start the last good unit again; processes linger → start nothing over them. An apply is
//! recorded before it acts (`in_progress`), so a kill anywhere leaves what the next run
//! finishes. Asked to stop (`shutdown`), an apply stops at once only while it has changed
//! nothing; once the old instance is stopped it goes on until the new one (or the last good
//! one) is started.

mod act;
mod balancers;
pub mod context;
mod door;
#[cfg(test)]
mod faults;
mod observe;
pub mod progress;
mod prune;
#[cfg(test)]
mod replicas;
mod roll;
mod shutdown;
mod steps;
mod waits;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Result;
use specd_spec::{RenderedUnit, Spec};

use crate::core::conclude::{self, Subject};
use crate::core::conclude::{Action, Report};
use crate::core::plan::{self, Plan, Step, Toward};
use crate::core::record;
use crate::core::record::{Source, UnitState};
use crate::core::serving::Balancers;
use crate::host::{Host, unit_path};
use crate::machine::lock::UnitLock;
use crate::machine::store::Store;
use crate::machine::systemd::UnitProps;

use crate::core::timing::{self};
use act::{Gate, act, preflight_needed, preflight_refusal};
pub use observe::{desired_of, observe};
pub use prune::{prune, watch_orphan};
pub use roll::group_plan;
pub use shutdown::{CarriedApply, Finish, Shutdown};

/// Something a person watching an apply wants to see.
#[derive(Clone, Debug)]
pub enum Event {
    Plan(Plan),
    Phase(String),
    Progress(String),
    /// Still waiting (draining, stopping, loading): said again and again while it lasts; a
    /// terminal shows the last one in place, a log one now and then (`context::events`).
    Waiting(String),
    Warning(String),
}

pub type Events = Arc<dyn Fn(&str, &Event) + Send + Sync>;

/// Everything the reconciler acts through. A clone shares the host's connections.
#[derive(Clone)]
pub struct Ctx<H: Host> {
    pub host: H,
    pub unit_dir: PathBuf,
    pub store: Store,
    pub events: Events,
    pub shutdown: Shutdown,
    /// Whether a unit's hold stops this context's reconciles from acting (the agent's), or not
    /// (an operator's command, a sweep: they decided to act on the unit).
    pub holds: Holds,
    /// How the unit's load balancers are waited for before a serving instance is stopped (the
    /// agent config's `load_balancer:`).
    pub lb: Balancers,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Holds {
    /// A hold in effect makes a reconcile observe and report only; checked under the unit's
    /// lock, so a hold set while this reconcile waited for the lock is seen.
    Obeyed,
    Overridden,
}

/// A desired state: a resolved spec, its rendered unit, and where it came from.
#[derive(Clone, Debug)]
pub struct DesiredState {
    pub spec: Spec,
    pub unit: RenderedUnit,
    pub source: Option<Source>,
}

impl DesiredState {
    pub fn new(spec: Spec, source: Option<Source>) -> DesiredState {
        let unit = specd_spec::render(&spec);
        DesiredState { spec, unit, source }
    }

    /// What a unit's record keeps of it: desired since `now`.
    pub fn record(&self, now: u64) -> record::DesiredRecord {
        record::DesiredRecord {
            sha256: self.unit.sha256.clone(),
            source: self.source.clone(),
            time: now,
            spec: self.spec.clone(),
        }
    }
}

/// kube-rs' error policy: what follows a reconcile that failed (an error, or an apply that did
/// not reach its unit), by the number of failures in a row before it (`timing::error_backoff`).
/// The worker jitters it, and a failed apply's own requeue is the earliest.
pub fn error_policy(attempt: u32) -> Action {
    Action::Requeue(timing::error_backoff(attempt))
}

#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error("{0:#}")]
    Io(#[from] anyhow::Error),
}

/// One reconcile of one unit. With `dry_run`, observes and plans only.
pub async fn reconcile<H: Host>(ctx: &Ctx<H>, d: &DesiredState, dry_run: bool) -> Result<Report, ReconcileError> {
    let unit = d.spec.unit.clone();
    let emit = |e: Event| (ctx.events)(&unit, &e);
    // Whatever validation let through: never specd's own unit, systemd's or D-Bus's.
    if let Some(why) = crate::core::owner::reserved(&unit, ctx.host.own_unit().as_deref()) {
        return Err(ReconcileError::Io(anyhow::anyhow!("refused: specd never manages {unit}: {why}; nothing changed")));
    }
    let Some(_lock) = lock_unit(ctx, &unit).await? else {
        return Ok(conclude::lock_interrupted(&unit));
    };
    let mut st = ctx.store.load(&unit)?;
    if !dry_run {
        door::leftover(ctx, &unit, &mut st).await;
    }
    let held = held(ctx, &st, d);
    let (o, props) = observe(ctx, d, &st, true).await?;
    let plan = plan::plan(&o, &desired_of(&ctx.unit_dir, d));
    emit(Event::Plan(plan.clone()));
    if let Some(whose) = foreign(ctx, d, &st, &plan, &props)? {
        return Ok(conclude::foreign(plan, &unit, &whose));
    }
    // A group's spare: held stopped while its group is at rest, else applied as any unit.
    let spare = roll::role(ctx, d, &st, &o)?;
    if let Some(crate::core::roll::Spare::Rest(why)) = spare.clone().filter(|_| held.is_none()) {
        return Ok(roll::rest(ctx, d, &mut st, (&o, &props), why, dry_run).await?);
    }
    // Before anything is stopped: whether the desired unit can start on this host at all. The
    // look runs alongside the drain (which stops nothing), and the stop waits for it; a dry run
    // says it, and a look again at a unit it refused (recorded only when it finds something
    // new) is all there is to do: those look first, and write nothing before.
    let look = held.is_none() && preflight_needed(&plan, &props, dry_run);
    let again = st.history.last().is_some_and(|h| h.sha256 == d.unit.sha256 && h.outcome == record::Outcome::Refused);
    let refusal = match look && (dry_run || again) {
        true => preflight_refusal(ctx, d, &plan, &props).await,
        false => None,
    };
    if dry_run || held.is_some() {
        if !dry_run {
            // Held, as it runs: what its load balancers are told follows what it runs.
            let _ = balancers::tell(ctx, d, &st, &o, &crate::core::serving::After::Observed);
        }
        return Ok(conclude::observed_only(plan, held, refusal));
    }
    ctx.host.clean_temps(&ctx.unit_dir, &unit);
    st.desired = Some(d.record(ctx.host.now()));
    if refusal.is_none()
        && let Some(report) = roll::ask(ctx, d, &st, &o, (&plan, false)).await?
    {
        return Ok(report);
    }
    let s = subject(d);
    let (mut c, stop_verdict, ms) = if plan.steps.is_empty() {
        (conclude::settled(&st, &plan, &s, &o), None, 0)
    } else if let Some(verdict) = refusal {
        emit(Event::Warning(verdict.clone()));
        (conclude::refused(&st, verdict), None, 0)
    } else {
        let gate = (look && !again).then(|| Box::pin(preflight_refusal(ctx, d, &plan, &props)) as Gate);
        act(ctx, &mut st, d, (&o, &props), &plan, gate).await?
    };
    // The record, changed as concluded and saved once (an apply also wrote ahead as it went).
    c.apply(&mut st, &s, stop_verdict.clone(), ms, ctx.host.now());
    if let Err(e) = ctx.store.save(&st) {
        if !c.acted {
            return Err(e.into());
        }
        // What was done on the host is done; say it, and that it is not recorded.
        c.unsaved(&e);
    }
    let told = balancers::tell(ctx, d, &st, &o, &c.change.serving);
    let mut report = c.report(plan, stop_verdict);
    if spare.is_some() {
        roll::keep_serving(&mut report);
    }
    if let Err(e) = told {
        // Left as it was (`drain` after a stop): told again at the next look, soon.
        emit(Event::Warning(format!("could not tell {unit}'s load balancers what it serves ({e:#}); trying again")));
        if report.action == Action::AwaitChange {
            report.action = Action::Requeue(timing::FAILED_AGAIN);
        }
    }
    Ok(report)
}

/// The desired state as the ending is concluded on.
fn subject(d: &DesiredState) -> Subject<'_> {
    Subject {
        unit: &d.spec.unit,
        sha256: &d.unit.sha256,
        text: &d.unit.text,
        source: d.source.as_ref(),
        endpoint: &d.spec.readiness.endpoint,
        base_url: d.spec.base_url(),
    }
}

/// Why a hold keeps this reconcile's hands off the unit, if one does (the agent obeys holds; an
/// operator's command or a sweep overrides them). Read under the unit's lock, so a hold set while
/// this reconcile waited for the lock is seen.
fn held<H: Host>(ctx: &Ctx<H>, st: &UnitState, d: &DesiredState) -> Option<String> {
    match ctx.holds {
        Holds::Obeyed => match ctx.host.hold_effect(st.hold.as_ref(), &d.unit.sha256) {
            crate::core::hold::HoldEffect::HandsOff(why) => Some(why),
            _ => None,
        },
        Holds::Overridden => None,
    }
}

/// Whose the unit file is, when the plan would replace a file specd did not write (no header,
/// never recorded as written) and the spec does not adopt it: someone else's is left alone.
fn foreign<H: Host>(
    ctx: &Ctx<H>,
    d: &DesiredState,
    st: &UnitState,
    plan: &Plan,
    props: &UnitProps,
) -> Result<Option<String>> {
    // A restore writes the last good unit back where specd wrote units before.
    let restore = plan.toward == Toward::LastGood;
    if restore || !plan.steps.contains(&Step::WriteUnit) || d.spec.policy.adopt || st.written_sha256.is_some() {
        return Ok(None);
    }
    let path = unit_path(&ctx.unit_dir, &d.spec.unit);
    // A file systemd loaded and that is gone since is nobody's.
    let fragment = if ctx.host.exists(Path::new(&props.fragment_path)) { props.fragment_path.as_str() } else { "" };
    Ok(crate::core::owner::foreign(&path, ctx.host.read(&path)?.as_deref(), props.load_state, fragment))
}

/// The unit's lock (one reconcile per unit across processes), waited for while another holds
/// it; `None` when asked to stop meanwhile.
async fn lock_unit<H: Host>(ctx: &Ctx<H>, unit: &str) -> Result<Option<UnitLock>> {
    let locks = ctx.store.locks_dir();
    if let Some(l) = UnitLock::try_acquire(&locks, unit)? {
        return Ok(Some(l));
    }
    // A wait of unknown length: said at once, also in a pipe (a phase would wait there for
    // the next line, which comes only once the other specd is done).
    (ctx.events)(unit, &Event::Waiting(format!("waiting: another specd is reconciling {unit}")));
    tokio::select! {
        l = UnitLock::acquire(&locks, unit) => Ok(Some(l?)),
        _ = ctx.shutdown.wait() => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn the_error_policy_doubles_from_two_seconds_to_five_minutes() {
        let secs: Vec<u64> = (0..10)
            .map(|a| match error_policy(a) {
                Action::Requeue(d) => d.as_secs(),
                Action::AwaitChange => 0,
            })
            .collect();
        assert_eq!(secs, [2, 4, 8, 16, 32, 64, 128, 256, 300, 300]);
        assert_eq!(error_policy(u32::MAX), Action::Requeue(Duration::from_secs(300)));
    }
}
