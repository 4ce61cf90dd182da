//! The reconciler: observe → pure plan → act → record, one reconcile per unit at a time (a flock
//! per unit across processes). Shaped like kube-rs: [`reconcile`] returns the next [`Action`],
//! and [`error_policy`] turns an error into one.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use anyhow::Result;
use specd_spec::{RenderedUnit, Spec, base_url_of_argv, exec_start, short};

use crate::cgroup::Lingering;
use crate::conclude::{self, Cancelled, Conclusion, Recovered, Restored, Subject};
pub use crate::conclude::{Action, Report, Serving};
use crate::host::{Host, Watch, unit_path};
use crate::lock::UnitLock;
use crate::plan::{self, Desired, Observed, Plan, Step, Stopping, Toward};
use crate::probe::{self, Health};
use crate::recovery::{self, Death, FaultKind, LastGood, Recovery, Restore};
use crate::state::{self, GoodUnit, InProgress, Phase, Quarantined, Source, Store, UnitState};
use crate::systemd::{ActiveState, LoadState, ServiceResult, UnitProps};

use crate::timing::readiness_backoff;
use crate::timing::{self, SpecWaits};

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
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Holds {
    /// A hold in effect makes a reconcile observe and report only; checked under the unit's
    /// lock, so a hold set while this reconcile waited for the lock is seen.
    Obeyed,
    Overridden,
}

/// Set when specd is asked to stop (SIGTERM, SIGINT, SIGHUP). An apply never stops where it
/// would leave a unit down that was serving: it stops at once only while nothing has been
/// stopped yet; once it stopped the old instance, it goes on at least until the new one is
/// started (see [`Finish`]). Its in-progress record lets the next run finish what is left.
#[derive(Clone, Debug)]
pub struct Shutdown {
    rx: tokio::sync::watch::Receiver<bool>,
    finish: Finish,
    carried: Carried,
}

/// The applies that are stopping a unit's old instance: asked to stop, each goes on until its
/// new instance is started, which may be as late as the end of that stop's budget (the spec's
/// `TimeoutStopSec` and its margin) and the start after it. The agent's stop waits for them that
/// long ([`Shutdown::carried`]), whatever its own default wait.
#[derive(Clone, Debug, Default)]
struct Carried {
    applies: Arc<tokio::sync::watch::Sender<CarriedApplies>>,
    next: Arc<std::sync::atomic::AtomicU64>,
}

/// The [`Carried`] applies, each under the number its guard has.
pub type CarriedApplies = std::collections::BTreeMap<u64, CarriedApply>;

/// One apply past its old instance's stop: its unit, and when that stop's budget ends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CarriedApply {
    pub unit: String,
    pub stop_ends: Instant,
}

/// An apply's place among the [`Carried`] ones, given up when it is dropped (its run ended).
struct CarriedGuard {
    applies: Arc<tokio::sync::watch::Sender<CarriedApplies>>,
    id: u64,
}

impl Drop for CarriedGuard {
    fn drop(&mut self) {
        self.applies.send_modify(|m| {
            m.remove(&self.id);
        });
    }
}

/// How far an apply that was asked to stop goes before it stops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// The agent: until the new instance (or the last good one, in a rollback) is started, then
    /// at the next step or wait; the agent's next run verifies it (or rolls it back).
    Started,
    /// A one-shot command (`apply`, `rollback`): to the end, verified or rolled back, since no
    /// agent may come after it.
    Everything,
}

impl Shutdown {
    /// The agent's: see [`Finish::Started`].
    pub fn new() -> (tokio::sync::watch::Sender<bool>, Shutdown) {
        Shutdown::finishing(Finish::Started)
    }

    pub fn finishing(finish: Finish) -> (tokio::sync::watch::Sender<bool>, Shutdown) {
        let (tx, rx) = tokio::sync::watch::channel(false);
        (tx, Shutdown { rx, finish, carried: Carried::default() })
    }

    /// The applies stopping an old instance now (see [`Carried`]), and each change of them.
    pub fn carried(&self) -> tokio::sync::watch::Receiver<CarriedApplies> {
        self.carried.applies.subscribe()
    }

    /// `unit`'s apply is stopping its old instance, whose stop's budget ends at `stop_ends`;
    /// until the guard is dropped.
    fn carry(&self, unit: &str, stop_ends: Instant) -> CarriedGuard {
        let id = self.carried.next.fetch_add(1, Ordering::Relaxed);
        let apply = CarriedApply { unit: unit.to_string(), stop_ends };
        self.carried.applies.send_modify(|m| {
            m.insert(id, apply);
        });
        CarriedGuard { applies: self.carried.applies.clone(), id }
    }

    /// One that is never set.
    pub fn never() -> Shutdown {
        let (tx, s) = Shutdown::new();
        std::mem::forget(tx);
        s
    }

    pub fn is_set(&self) -> bool {
        *self.rx.borrow()
    }

    pub async fn wait(&self) {
        let mut r = self.rx.clone();
        let _ = r.wait_for(|v| *v).await;
    }

    /// Whether an apply that was asked to stop stops here: `changed`, it already stopped,
    /// wrote or started something; `started`, the instance it puts in place was started.
    pub fn stops_here(&self, changed: bool, started: bool) -> bool {
        self.is_set() && (!changed || (started && self.finish == Finish::Started))
    }

    /// Until [`Shutdown::stops_here`] would say yes (never, when it will not).
    async fn stopping(&self, changed: bool, started: bool) {
        if changed && (self.finish == Finish::Everything || !started) {
            return std::future::pending().await;
        }
        self.wait().await
    }
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

/// Why a step did not finish.
#[derive(Debug)]
struct StepFailure {
    step: Step,
    message: String,
    cause: Cause,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cause {
    /// It failed, by this fault.
    Fault(FaultKind),
    /// Not a failure: specd is stopping and this is a safe point (see [`Shutdown::stops_here`]).
    Cancelled(Cancelled),
    /// Not a failure: the pre-flight, looking while the drain ran, found that the unit cannot
    /// start here (the message is the verdict); nothing was changed.
    Refused,
}

impl StepFailure {
    fn host(step: Step, message: impl Into<String>) -> Self {
        StepFailure { step, message: message.into(), cause: Cause::Fault(FaultKind::Host) }
    }
    fn spec(step: Step, message: impl Into<String>) -> Self {
        StepFailure { step, message: message.into(), cause: Cause::Fault(FaultKind::Spec) }
    }
    fn cancelled(step: Step, at: Cancelled) -> Self {
        StepFailure { step, message: "the agent is stopping".into(), cause: Cause::Cancelled(at) }
    }
    fn cancelled_at(&self) -> Option<Cancelled> {
        match self.cause {
            Cause::Cancelled(at) => Some(at),
            Cause::Fault(_) | Cause::Refused => None,
        }
    }
    /// Whose fault it is (a cancelled or refused step is nobody's: the host's, for what follows).
    fn fault(&self) -> FaultKind {
        match self.cause {
            Cause::Fault(k) => k,
            Cause::Cancelled(_) | Cause::Refused => FaultKind::Host,
        }
    }
}

/// A background task that ends with the reconcile that started it (also when that reconcile is
/// dropped half-way: the agent stopping, a test's crash).
struct Background<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for Background<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// How the instance an apply stopped had ended: specd's own SIGKILL verdict at once, or the
/// diagnosis from the journal, which is read in the background while the new server loads.
#[derive(Default)]
struct StopRecord {
    /// How it ended, when that was not a clean stop.
    verdict: Option<String>,
    /// How it ended, clean or not.
    ended: Option<String>,
    pending: Option<Background<Option<crate::host::Ending>>>,
    /// The instance started after it (empty: none was).
    followed_by: String,
    /// There was no instance to stop (the unit's first start).
    first: bool,
}

impl StopRecord {
    async fn finish(&mut self) -> Option<String> {
        if let Some(mut p) = self.pending.take()
            && let Some(e) = (&mut p.0).await.ok().flatten()
        {
            if self.verdict.is_none() && !e.clean {
                self.verdict = Some(e.summary.clone());
            }
            self.ended = Some(e.summary);
        }
        self.verdict.clone()
    }

    /// What `status` shows as the last ending while the instance started after it runs.
    fn last_ended(&self) -> Option<state::LastEnded> {
        if self.followed_by.is_empty() || (self.ended.is_none() && !self.first) {
            return None;
        }
        Some(state::LastEnded { summary: self.ended.clone(), followed_by: self.followed_by.clone() })
    }
}

/// What to verify and probe for one unit text (the desired one, or a rollback target).
struct Target<'a> {
    sha256: &'a str,
    text: &'a str,
    argv: Vec<String>,
    base_url: String,
    /// Where the instance being replaced listens (for draining and the in-flight count).
    old_url: String,
    endpoint: String,
    readiness: Duration,
    stop_budget: Duration,
    timeout_stop: Duration,
    drain: Duration,
    mode: Mode<'a>,
    /// The instance being replaced may not serve (a rollback replaces a failed one; an
    /// interrupted apply may have stopped it): asked to stop, the run still starts the next one.
    not_serving: bool,
}

/// What a run of steps puts in place.
#[derive(Clone, Copy, Debug)]
enum Mode<'a> {
    /// The desired unit, by its spec (drained, verified against it).
    Apply(&'a Spec),
    /// The last good unit, for this reason (said in the unit's journal for `diagnose`).
    Restore(Restore),
}

impl<'a> Mode<'a> {
    /// The spec an apply verifies against; a restore has none (its unit was verified before).
    fn spec(self) -> Option<&'a Spec> {
        match self {
            Mode::Apply(spec) => Some(spec),
            Mode::Restore(_) => None,
        }
    }
}

impl<'a> Target<'a> {
    /// The desired unit, replacing the instance at `old_url`; `resumed`: this apply finishes an
    /// interrupted one, which may have stopped the old instance already.
    fn desired(d: &'a DesiredState, old_url: String, resumed: bool) -> Target<'a> {
        let waits = SpecWaits::of(&d.spec);
        Target {
            sha256: &d.unit.sha256,
            text: &d.unit.text,
            argv: d.spec.argv.clone(),
            base_url: d.spec.base_url(),
            old_url,
            endpoint: d.spec.readiness.endpoint.clone(),
            readiness: waits.readiness,
            stop_budget: waits.stop_budget,
            timeout_stop: waits.timeout_stop,
            drain: waits.drain,
            mode: Mode::Apply(&d.spec),
            not_serving: resumed,
        }
    }
}

/// Observe a unit: the deployed file, systemd's view, the main process, and (cheaply) the server.
pub async fn observe<H: Host>(
    ctx: &Ctx<H>,
    d: &DesiredState,
    st: &UnitState,
    probe_server: bool,
) -> Result<(Observed, UnitProps)> {
    let path = unit_path(&ctx.unit_dir, &d.spec.unit);
    let deployed = ctx.host.read(&path)?;
    let props = ctx.host.show(&d.spec.unit).await?;
    let main_cmdline = if props.main_pid > 0 { ctx.host.cmdline(props.main_pid) } else { None };
    let mut ready = None;
    let mut arg_mismatches = Vec::new();
    if probe_server && props.active_state == ActiveState::Active {
        // A quick look: a hung server does not hold the reconcile.
        let quick = timing::QUICK_LOOK;
        let base = d.spec.base_url();
        let url = format!("{base}{}", d.spec.readiness.endpoint);
        let h = tokio::time::timeout(quick, ctx.host.health(&url)).await.unwrap_or(Health::Loading("timed out".into()));
        ready = Some(h == Health::Ready);
        if h == Health::Ready
            && d.spec.readiness.verify_args
            && let Ok(Some(Ok(info))) =
                tokio::time::timeout(quick, ctx.host.reported_args(&base, &d.spec, &props.invocation_id)).await
        {
            arg_mismatches =
                probe::compare_args(&d.spec.expected_server_args(), &info).iter().map(|m| m.to_string()).collect();
        }
    }
    let interrupted = st.in_progress.as_ref().is_some_and(|p| p.sha256 == d.unit.sha256);
    let o = Observed {
        deployed_sha256: deployed.as_deref().map(specd_spec::sha256_hex),
        drop_ins: own_drop_ins(&ctx.host, &props, &d.spec.unit),
        // Any mask is a person's decision, even one a unit file of higher priority shadows (a
        // runtime mask in /run of a unit whose file is in /etc) or one not loaded yet.
        load_state: if props.is_masked() || mask_link(&ctx.host, &ctx.unit_dir, &d.spec.unit).is_some() {
            LoadState::Masked
        } else {
            props.load_state
        },
        active_state: props.active_state,
        sub_state: props.sub_state.clone(),
        main_pid: props.main_pid,
        need_daemon_reload: props.need_daemon_reload,
        fragment_path: props.fragment_path.clone(),
        main_cmdline,
        arg_mismatches,
        ready,
        written_sha256: st.written_sha256.clone(),
        quarantined: st.quarantined(&d.unit.sha256).map(|q| q.reason.clone()),
        last_good_sha256: st.last_good.as_ref().filter(|_| d.spec.policy.rollback).map(|g| g.sha256.clone()),
        interrupted,
        enabled: plan::enabled_of(props.unit_file_state),
    };
    Ok((o, props))
}

/// A link of the unit to `/dev/null` (a mask) in the unit directory, `/etc/systemd/system` or
/// `/run/systemd/system` (`systemctl mask --runtime`).
pub fn mask_link(host: &impl Host, unit_dir: &Path, unit: &str) -> Option<PathBuf> {
    [unit_dir, Path::new("/etc/systemd/system"), Path::new("/run/systemd/system")]
        .iter()
        .map(|d| d.join(unit))
        .find(|p| host.is_mask(p))
}

/// Drop-ins of this unit's own `<unit>.d/` directories. Shared ones (`service.d/`, prefix
/// drop-ins like `sglang-.service.d/`) belong to the host's configuration of every service and are
/// neither drift nor specd's to remove.
pub fn own_drop_ins(host: &impl Host, props: &UnitProps, unit: &str) -> Vec<String> {
    let own = format!("{unit}.d");
    props
        .drop_in_paths
        .iter()
        .filter(|p| {
            let p = Path::new(p);
            host.exists(p) && p.parent().and_then(|d| d.file_name()).is_some_and(|n| n.to_string_lossy() == own)
        })
        .cloned()
        .collect()
}

pub fn desired_of(ctx_unit_dir: &Path, d: &DesiredState) -> Desired {
    Desired {
        sha256: d.unit.sha256.clone(),
        argv: d.spec.argv.clone(),
        fragment_path: unit_path(ctx_unit_dir, &d.spec.unit).display().to_string(),
        drift: d.spec.policy.drift,
        verify_args: d.spec.readiness.verify_args && d.spec.args_report() != specd_spec::ArgsReport::None,
        verify_speculation: d.spec.readiness.verify_speculation && d.spec.speculates(),
        enabled: d.spec.service.enabled,
    }
}

/// One reconcile of one unit. With `dry_run`, observes and plans only.
pub async fn reconcile<H: Host>(ctx: &Ctx<H>, d: &DesiredState, dry_run: bool) -> Result<Report, ReconcileError> {
    let unit = d.spec.unit.clone();
    let emit = |e: Event| (ctx.events)(&unit, &e);
    // Whatever validation let through: never specd's own unit, systemd's or D-Bus's.
    if let Some(why) = crate::owner::reserved(&unit, ctx.host.own_unit().as_deref()) {
        return Err(ReconcileError::Io(anyhow::anyhow!("refused: specd never manages {unit}: {why}; nothing changed")));
    }
    let Some(_lock) = lock_unit(ctx, &unit).await? else {
        return Ok(conclude::lock_interrupted(&unit));
    };
    let mut st = ctx.store.load(&unit)?;
    let held = held(ctx, &st, d);
    let (o, props) = observe(ctx, d, &st, true).await?;
    let plan = plan::plan(&o, &desired_of(&ctx.unit_dir, d));
    emit(Event::Plan(plan.clone()));
    if let Some(whose) = foreign(ctx, d, &st, &plan, &props)? {
        return Ok(conclude::foreign(plan, &unit, &whose));
    }
    // Before anything is stopped: whether the desired unit can start on this host at all. The
    // look runs alongside the drain (which stops nothing), and the stop waits for it; a dry run
    // says it, and a look again at a unit it refused (recorded only when it finds something
    // new) is all there is to do: those look first, and write nothing before.
    let look = held.is_none() && preflight_needed(&plan, &props, dry_run);
    let again = st.history.last().is_some_and(|h| h.sha256 == d.unit.sha256 && h.outcome == state::Outcome::Refused);
    let refusal = match look && (dry_run || again) {
        true => preflight_refusal(ctx, d, &plan, &props).await,
        false => None,
    };
    if dry_run || held.is_some() {
        return Ok(conclude::observed_only(plan, held, refusal));
    }
    ctx.host.clean_temps(&ctx.unit_dir, &unit);
    st.desired = Some(state::DesiredRecord {
        sha256: d.unit.sha256.clone(),
        source: d.source.clone(),
        time: ctx.host.now(),
        spec: d.spec.clone(),
    });
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
    Ok(c.report(plan, stop_verdict))
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
            crate::hold::HoldEffect::HandsOff(why) => Some(why),
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
    Ok(crate::owner::foreign(&path, ctx.host.read(&path)?.as_deref(), props.load_state, fragment))
}

/// The pre-flight's look, to be waited for before the first step that changes anything: the
/// verdict refusing the unit, or `None`.
type Gate<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = Option<String>> + Send + 'a>>;

/// The plan's steps, carried out (none that changes anything before `gate` lets it), and what
/// they returned, concluded: with the stopped instance's ending and how long it took.
async fn act<H: Host>(
    ctx: &Ctx<H>,
    st: &mut UnitState,
    d: &DesiredState,
    (o, props): (&Observed, &UnitProps),
    plan: &Plan,
    gate: Option<Gate<'_>>,
) -> Result<(Conclusion, Option<String>, u64), ReconcileError> {
    let unit = &d.spec.unit;
    // The running unit is the rollback target if nothing better is known: it was serving.
    let deployed_text = ctx.host.read(&unit_path(&ctx.unit_dir, unit))?;
    // The instance being stopped listens where the deployed unit says (the spec may move it).
    let old_url = deployed_text
        .as_deref()
        .and_then(|t| exec_start(&String::from_utf8_lossy(t)))
        .and_then(|argv| base_url_of_argv(&argv))
        .unwrap_or_else(|| d.spec.base_url());
    if let Some(g) = deployed_text.as_deref().and_then(|text| running_as_good(o, st, d, text, ctx.host.now())) {
        st.last_good = Some(g);
    }

    // An apply of this same unit that was interrupted (killed, the agent stopped): it may have
    // stopped the old instance and written the new unit already, so this run is its second half.
    let resumed = st.in_progress.as_ref().filter(|p| p.sha256 == d.unit.sha256);
    let resumed_wrote = resumed.is_some_and(|p| p.wrote);
    let resumed = resumed.is_some();
    st.in_progress = Some(InProgress {
        sha256: d.unit.sha256.clone(),
        pid: std::process::id(),
        phase: Phase::Starting,
        started: ctx.host.now(),
        wrote: resumed_wrote,
    });
    if let Err(e) = ctx.store.save(st) {
        // Finishing a rollback puts a server back: that matters more than recording it.
        if plan.toward != Toward::LastGood {
            return Err(e.into());
        }
        (ctx.events)(
            unit,
            &Event::Warning(format!("could not record the rollback in specd's state ({e:#}); rolling back anyway")),
        );
    }

    let started = Instant::now();
    if plan.toward == Toward::LastGood {
        let Some(g) = st.last_good.clone() else {
            return Err(ReconcileError::Io(anyhow::anyhow!("{unit}: a restore was planned without a last good unit")));
        };
        // A rollback that did not finish (the agent stopped or died in it): finish it.
        let mut sv = None;
        let r = restore(ctx, st, d, &g, Restore::Rollback, &plan.steps, &mut sv).await;
        let serving = serving_now(ctx, unit).await;
        let c = conclude::rollback_finished(&subject(d), &g.sha256, &restored_of(r), serving);
        return Ok((c, sv, started.elapsed().as_millis() as u64));
    }

    let target = Target::desired(d, old_url, resumed);
    let mut stop = StopRecord::default();
    let result = run_steps(ctx, st, unit, &plan.steps, &target, props, &mut stop, gate).await;
    let mut stop_verdict = stop.finish().await;
    if let Some(l) = stop.last_ended() {
        st.last_ended = Some(l);
    }
    let ms = started.elapsed().as_millis() as u64;
    let c = match result {
        Ok(()) if conclude::enablement_only(plan) => {
            let now = ctx.host.show(unit).await.ok().and_then(|p| plan::enabled_of(p.unit_file_state));
            conclude::enablement(plan, unit, d.spec.service.enabled, now)
        }
        Ok(()) => conclude::applied(plan, &subject(d), ms, resumed),
        Err(StepFailure { step, cause: Cause::Cancelled(at), .. }) => {
            let c = conclude::interrupted(step, at);
            (ctx.events)(unit, &Event::Warning(c.verdict.clone()));
            c
        }
        Err(StepFailure { cause: Cause::Refused, message, .. }) => {
            (ctx.events)(unit, &Event::Warning(message.clone()));
            conclude::refused_at_the_drain(st, message)
        }
        Err(f) => {
            let failed_instance = stop.followed_by.clone();
            let c = failed(ctx, st, d, f, plan, (resumed, resumed_wrote), &mut stop_verdict, &failed_instance).await;
            return Ok((c, stop_verdict, started.elapsed().as_millis() as u64));
        }
    };
    Ok((c, stop_verdict, ms))
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

/// Whether the plan asks the pre-flight: it would stop a serving instance to start the desired
/// unit. A unit that does not run has nothing to protect: its start is tried, and its failure
/// rolled back and quarantined as any other (`dry_run` says the problems either way). A restore
/// starts the last good unit, which ran here before; the desired unit's pre-flight is not about it.
fn preflight_needed(plan: &Plan, props: &UnitProps, dry_run: bool) -> bool {
    let serving = plan.steps.contains(&Step::Stop) && props.is_running();
    plan.toward != Toward::LastGood && plan.steps.contains(&Step::Start) && (serving || dry_run)
}

/// The verdict refusing a plan that would stop a serving instance to start a unit that cannot
/// start on this host (`preflight`: a missing program, model or draft, a port another process
/// holds...), or `None`.
async fn preflight_refusal<H: Host>(ctx: &Ctx<H>, d: &DesiredState, plan: &Plan, props: &UnitProps) -> Option<String> {
    let unit = &d.spec.unit;
    // The unit's drop-ins apply to the new unit too, but those the apply removes.
    let removed =
        if plan.steps.contains(&Step::RemoveDropIns) { own_drop_ins(&ctx.host, props, unit) } else { Vec::new() };
    let drop_ins: Vec<String> = props.drop_in_paths.iter().filter(|p| !removed.contains(p)).cloned().collect();
    let o = ctx.host.preflight(&d.spec, &d.unit.text, &drop_ins, &props.control_group, &ctx.store.dir).await;
    for n in &o.notes {
        (ctx.events)(unit, &Event::Progress(format!("pre-flight: {}", n.message)));
    }
    if o.passed() {
        return None;
    }
    Some(conclude::cannot_start(unit, &d.unit.sha256, &crate::preflight::summary(&o.problems)))
}

/// The unit that runs is the rollback target when nothing better is known: it was serving,
/// ready, from the deployed file systemd has loaded, and it is not the desired one.
fn running_as_good(o: &Observed, st: &UnitState, d: &DesiredState, deployed: &[u8], now: u64) -> Option<GoodUnit> {
    let text = String::from_utf8_lossy(deployed).into_owned();
    let serving = o.ready == Some(true)
        && !o.need_daemon_reload
        && o.main_cmdline
            .as_ref()
            .is_some_and(|c| exec_start(&text).is_some_and(|argv| crate::plan::runs_argv(c, &argv)));
    let other = o.deployed_sha256.as_deref() != Some(d.unit.sha256.as_str());
    let known = st.last_good.as_ref().is_some_and(|g| Some(&g.sha256) == o.deployed_sha256.as_ref());
    (serving && other && !known).then(|| GoodUnit {
        sha256: specd_spec::sha256_hex(text.as_bytes()),
        text,
        source: None,
        time: now,
        endpoint: Some(d.spec.readiness.endpoint.clone()),
        base_url: None,
    })
}

/// A step of the apply failed: decide what follows (`recovery::after`), quarantine, carry out
/// the recovery, gather what the failed server said, and conclude.
#[allow(clippy::too_many_arguments)]
async fn failed<H: Host>(
    ctx: &Ctx<H>,
    st: &mut UnitState,
    d: &DesiredState,
    f: StepFailure,
    plan: &Plan,
    (resumed, resumed_wrote): (bool, bool),
    stop_verdict: &mut Option<String>,
    failed_instance: &str,
) -> Conclusion {
    let unit = &d.spec.unit;
    let what = format!("{:?} failed: {}", f.step, f.message);
    (ctx.events)(unit, &Event::Warning(what.clone()));
    // Quarantine only a unit this apply wrote (or the interrupted apply it finishes): a
    // unit that ran before and failed to start again (a GPU not ready after a reboot) is
    // retried with backoff, not condemned.
    let wrote = (plan.steps.contains(&Step::WriteUnit) || resumed_wrote)
        && st.written_sha256.as_deref() == Some(d.unit.sha256.as_str());
    let failure = recovery::Failure {
        step: f.step,
        fault: f.fault(),
        wrote,
        stopped: plan.steps.contains(&Step::Stop) || resumed,
        verified_before: st.verified_before(&d.unit.sha256),
        last_good: LastGood::of(st.last_good.as_ref().map(|g| g.sha256.as_str()), &d.unit.sha256),
        rollback: d.spec.policy.rollback,
    };
    let decision = recovery::after(&failure);
    if decision.quarantine {
        // Recorded before the rollback (saved as it goes): a rollback cut short is finished by
        // the next reconcile, which plans it from the quarantine.
        st.quarantine.retain(|q| q.sha256 != d.unit.sha256);
        st.quarantine.push(Quarantined {
            sha256: d.unit.sha256.clone(),
            reason: f.message.clone(),
            source: d.source.clone(),
            time: ctx.host.now(),
        });
    }
    let recovered = recover(ctx, st, d, &f, &failure, &decision, stop_verdict).await;
    // The server's own last word (a missing draft folder, a value the engine refuses): read from
    // the failed instance's journal.
    let said = if f.fault().of_spec() && !failed_instance.is_empty() {
        ctx.host.ending(unit, failed_instance, timing::ENDING_WITHIN).await.and_then(|e| e.engine_error)
    } else {
        None
    };
    let serving = serving_now(ctx, unit).await;
    let s = subject(d);
    conclude::failed(&s, conclude::recovered(&s, &what, &recovered), said, serving, &decision)
}

/// Whether the unit's service runs after a failed apply or a rollback, as systemd says now.
async fn serving_now<H: Host>(ctx: &Ctx<H>, unit: &str) -> Serving {
    Serving::of(ctx.host.show(unit).await.ok().map(|p| (p.active_state, p.sub_state)))
}

/// After a failed step: roll back to the last good unit, start it again after a host fault, or
/// leave the service as it is; see [`recovery::decide`].
async fn recover<H: Host>(
    ctx: &Ctx<H>,
    st: &mut UnitState,
    d: &DesiredState,
    f: &StepFailure,
    failure: &recovery::Failure,
    decision: &recovery::Decision,
    stop_verdict: &mut Option<String>,
) -> Recovered {
    let unit = &d.spec.unit;
    match decision.recovery.clone() {
        Recovery::Retry => {
            Recovered::Retried { known_good: f.fault() == FaultKind::Crashed && failure.verified_before }
        }
        Recovery::LeaveStopped(why) => {
            if decision.quarantine {
                let note = format!("specd: stopping {unit}: unit {} failed; {why}", short(&d.unit.sha256));
                stop_quietly(ctx, unit, &note).await;
            }
            Recovered::LeftStopped { why, quarantined: decision.quarantine }
        }
        Recovery::Restore(why) => {
            // A rollback goes to another unit; after a host fault the last good one may be this.
            let Some(g) = st.last_good.clone().filter(|g| why == Restore::HostFault || g.sha256 != d.unit.sha256)
            else {
                return Recovered::NoGoodUnit;
            };
            let on_disk =
                ctx.host.read(&unit_path(&ctx.unit_dir, unit)).ok().flatten().map(|b| specd_spec::sha256_hex(&b));
            let steps = plan::restore_steps(on_disk.as_deref(), &g.sha256);
            let r = restore(ctx, st, d, &g, why, &steps, stop_verdict).await;
            if why == Restore::Rollback
                && let Err(rf) = &r
                && rf.cancelled_at().is_none()
            {
                let note = format!("specd: stopping {unit}: the rollback to {} failed too", short(&g.sha256));
                stop_quietly(ctx, unit, &note).await;
            }
            Recovered::Restored { why, good: g.sha256.clone(), end: restored_of(r) }
        }
    }
}

/// How putting a last good unit back ended, from what its steps returned.
fn restored_of(r: Result<(), StepFailure>) -> Restored {
    match r {
        Ok(()) => Restored::Serving,
        Err(f) if f.cancelled_at().is_some() => Restored::Cancelled(f.step),
        Err(f) => Restored::Failed(f.step, f.message),
    }
}

/// Put the last good unit back by `steps` (from `plan::restore_steps`) and prove it serves: the
/// same race-free sequence.
async fn restore<H: Host>(
    ctx: &Ctx<H>,
    st: &mut UnitState,
    d: &DesiredState,
    g: &GoodUnit,
    why: Restore,
    steps: &[Step],
    stop_verdict: &mut Option<String>,
) -> Result<(), StepFailure> {
    let unit = &d.spec.unit;
    (ctx.events)(unit, &Event::Phase(format!("rolling back to the last good unit {}", short(&g.sha256))));
    let argv = exec_start(&g.text).unwrap_or_default();
    let base_url = g.base_url.clone().unwrap_or_else(|| base_url_of_argv(&argv).unwrap_or_else(|| d.spec.base_url()));
    let waits = SpecWaits::of(&d.spec);
    let t = Target {
        sha256: &g.sha256,
        text: &g.text,
        argv,
        // What is being stopped now is the failed new unit, at the spec's address.
        old_url: d.spec.base_url(),
        base_url,
        endpoint: g.endpoint.clone().unwrap_or_else(|| d.spec.readiness.endpoint.clone()),
        readiness: waits.readiness,
        stop_budget: waits.stop_budget,
        timeout_stop: waits.timeout_stop,
        drain: timing::RESTORE_DRAIN,
        mode: Mode::Restore(why),
        // What it stops has failed already: asked to stop, it still puts the good unit back.
        not_serving: true,
    };
    let props = ctx.host.show(unit).await.unwrap_or_default();
    let mut sv = StopRecord::default();
    let r = run_steps(ctx, st, unit, steps, &t, &props, &mut sv, None).await;
    let v = sv.finish().await;
    if stop_verdict.is_none() {
        *stop_verdict = v;
    }
    if let Some(l) = sv.last_ended() {
        st.last_ended = Some(l);
    }
    r
}

/// Stop a unit whose instance failed, and say so in its journal (`diagnose` then names the
/// failed start, not a stop on request).
async fn stop_quietly<H: Host>(ctx: &Ctx<H>, unit: &str, note: &str) {
    let before = ctx.host.show(unit).await.unwrap_or_default();
    ctx.host.note(unit, "rollback", &before.invocation_id, note);
    if let Err(lingering) = stop_until_empty(ctx, unit, &before).await {
        let still = crate::cgroup::still_in(&before.control_group, &lingering);
        (ctx.events)(unit, &Event::Warning(format!("after the stop, {still}")));
    }
}

/// Stop a unit outside an apply and wait until its cgroup is empty (stopped means empty): the
/// stop job is over once `stop` returns (systemd's SIGKILL included), so what is left goes within
/// moments, or is returned.
async fn stop_until_empty<H: Host>(ctx: &Ctx<H>, unit: &str, before: &UnitProps) -> Result<(), Vec<Lingering>> {
    let _ = ctx.host.stop(unit, true).await;
    if before.control_group.is_empty() {
        return Ok(());
    }
    ctx.host.wait_empty(&before.control_group, Instant::now() + timing::EMPTY_AFTER_STOP, || {}).await
}

/// A unit whose spec is gone, with `prune: true`: stop it, wait until its processes are gone,
/// keep its unit file and state in the state dir (private), and reload.
pub async fn prune<H: Host>(ctx: &Ctx<H>, unit: &str) {
    let _lock = match UnitLock::acquire(&ctx.store.locks_dir(), unit).await {
        Ok(l) => l,
        Err(e) => return tracing::error!(unit, "pruning: cannot take the unit's lock: {e:#}"),
    };
    tracing::warn!(
        unit,
        "pruning: its spec is gone; stopping and disabling it, and moving its unit file to the state dir"
    );
    let before = ctx.host.show(unit).await.unwrap_or_default();
    ctx.host.note(unit, "prune", &before.invocation_id, &format!("specd: stopping {unit}: its spec is gone (prune)"));
    if let Err(lingering) = stop_until_empty(ctx, unit, &before).await {
        tracing::error!(
            unit,
            "pruning: after the stop, {}",
            crate::cgroup::still_in(&before.control_group, &lingering)
        );
    }
    // It no longer starts at boot: no `.wants` link is left pointing at a file moved away.
    if let Err(e) = ctx.host.disable(unit).await {
        tracing::warn!(unit, "pruning: disabling it: {e:#}");
    }
    let path = unit_path(&ctx.unit_dir, unit);
    let (keep, now) = (ctx.store.dir.join("pruned"), ctx.host.now());
    if ctx.host.exists(&path)
        && let Err(e) = ctx.host.move_aside(&path, &keep.join(format!("{unit}.{now}")))
    {
        // Its state stays: the next source read prunes it again.
        return tracing::error!(unit, "pruning: its unit file: {e:#}");
    }
    let _ = ctx.host.daemon_reload().await;
    if let Err(e) = ctx.store.set_aside(unit, &keep.join(format!("{unit}.json.{now}"))) {
        tracing::error!(unit, "pruning: its state: {e:#}");
    }
}

/// A stop that ended in SIGKILL, in plain words.
pub fn sigkill_verdict(props: &UnitProps, timeout_stop: Duration, in_flight: Option<i64>) -> Option<String> {
    if props.result == ServiceResult::Timeout {
        let reqs = match in_flight {
            Some(n) if n >= 0 => format!(" while {n} requests were in flight"),
            _ => String::new(),
        };
        return Some(format!(
            "stopped by SIGKILL after TimeoutStopSec={}s{reqs} — not an OOM: the server was still draining when systemd's stop timeout ran out",
            timeout_stop.as_secs()
        ));
    }
    None
}

#[allow(clippy::too_many_arguments)]
async fn run_steps<H: Host>(
    ctx: &Ctx<H>,
    st: &mut UnitState,
    unit: &str,
    steps: &[Step],
    t: &Target<'_>,
    before: &UnitProps,
    stop: &mut StopRecord,
    gate: Option<Gate<'_>>,
) -> Result<(), StepFailure> {
    let mut run = Run {
        ctx,
        unit,
        t,
        before,
        gate,
        path: unit_path(&ctx.unit_dir, unit),
        cg: before.control_group.clone(),
        in_flight: Arc::new(AtomicI64::new(-1)),
        started_pid: 0,
        after_start: None,
        ready_pid: None,
        started_invocation: String::new(),
        changed: t.not_serving,
        // A run that starts nothing finishes an apply whose instance was started already.
        started: t.not_serving && !steps.contains(&Step::Start),
        carried: None,
    };
    let r = run.steps(st, steps, stop).await;
    stop.followed_by = std::mem::take(&mut run.started_invocation);
    let Err(f) = r else { return Ok(()) };
    let refused = matches!(f.cause, Cause::Refused);
    if refused || f.cancelled_at().is_some() || !recovery::may_be_a_death(f.step, f.fault(), run.ready_pid.is_some()) {
        return Err(f);
    }
    // The server had answered ready, or failed to start or load: gone since, or killed from
    // outside? (A systemd that cannot be asked is no evidence either way: the process table is.)
    let props = ctx.host.show(unit).await.unwrap_or_default();
    let found = recovery::Found {
        ready: run.ready_pid.map(|pid| (pid, ctx.host.alive(pid))),
        main_pid: props.main_pid,
        result: &props.result,
        exec_main_code: props.exec_main_code,
        exec_main_status: props.exec_main_status,
    };
    let Some(death) = recovery::death(f.step, f.fault(), &found) else { return Err(f) };
    let said_own_error = match death {
        Death::AfterReady => false,
        Death::FromOutside => ctx
            .host
            .ending(unit, &stop.followed_by, timing::ENDING_WITHIN)
            .await
            .is_some_and(|e| e.engine_error.is_some()),
    };
    if !recovery::excuses(death, said_own_error) {
        return Err(f);
    }
    let message = match death {
        Death::AfterReady => format!(
            "the server crashed after it was ready (pid {} is gone; Result={}, status {}, {} restarts): {}",
            run.ready_pid.unwrap_or_default(),
            props.result,
            props.exit_status(),
            props.n_restarts,
            f.message
        ),
        Death::FromOutside => format!(
            "{}: killed by signal {} from outside (a person, a script, an OOM killer), not by its own error",
            f.message,
            props.exit_status()
        ),
    };
    Err(StepFailure { message, cause: Cause::Fault(FaultKind::Crashed), ..f })
}

/// One apply's (or restore's) steps on one unit: what the steps share while they run.
struct Run<'a, H: Host> {
    ctx: &'a Ctx<H>,
    unit: &'a str,
    t: &'a Target<'a>,
    /// systemd's view before the first step.
    before: &'a UnitProps,
    /// The pre-flight, looking while the drain runs: no step that changes anything before it
    /// has passed.
    gate: Option<Gate<'a>>,
    path: PathBuf,
    cg: String,
    /// Requests in flight on the instance being replaced (-1: not known).
    in_flight: Arc<AtomicI64>,
    /// The main pid of the instance this run started.
    started_pid: u32,
    /// systemd's view right after the start.
    after_start: Option<UnitProps>,
    /// The started server answered ready (a later failure is a crash after readiness).
    ready_pid: Option<u32>,
    /// The invocation ID of the instance this run started.
    started_invocation: String,
    /// This run (or the one it finishes) stopped, wrote or started something: asked to stop, it
    /// goes on until [`Run::started`].
    changed: bool,
    /// The instance this run puts in place was started.
    started: bool,
    /// From its old instance's stop on: the run's place among those the agent's stop waits for.
    carried: Option<CarriedGuard>,
}

impl<H: Host> Run<'_, H> {
    /// Asked to stop, whether this run stops here, and how its stop is told.
    fn stops_here(&self, step: Step) -> Result<(), StepFailure> {
        if !self.ctx.shutdown.stops_here(self.changed, self.started) {
            return Ok(());
        }
        let at = if self.changed { Cancelled::Started } else { Cancelled::Unchanged };
        Err(StepFailure::cancelled(step, at))
    }

    async fn steps(&mut self, st: &mut UnitState, steps: &[Step], stop: &mut StopRecord) -> Result<(), StepFailure> {
        for &step in steps {
            self.stops_here(step)?;
            if matches!(step, Step::Stop | Step::RemoveDropIns | Step::WriteUnit | Step::Start) {
                self.pass_gate(step).await?;
                self.changed = true;
            }
            if let Some(p) = st.in_progress.as_mut() {
                p.phase = Phase::At(step);
                let _ = self.ctx.store.save(st);
            }
            match step {
                Step::Drain => self.drain_and_look().await?,
                Step::Stop => self.stop().await?,
                Step::WaitStopped => self.wait_stopped(stop).await?,
                Step::RemoveDropIns => self.remove_drop_ins().await?,
                Step::WriteUnit => self.write_unit(st).await?,
                Step::Reload => self.reload().await?,
                Step::Start => {
                    self.start().await?;
                    self.started = true;
                }
                Step::VerifyCmdline => self.verify_cmdline().await?,
                Step::WaitReady => self.wait_ready().await?,
                Step::VerifySpeculation => self.verify_speculation(st).await?,
                Step::VerifyArgs => self.verify_args().await?,
                Step::Enable => self.boot(true).await,
                Step::Disable => self.boot(false).await,
            }
        }
        Ok(())
    }

    /// Enable or disable it (what `systemctl enable`/`disable` do). Its failure fails nothing:
    /// the server runs, verified; the next reconcile plans it again (status says the unit would
    /// not start at boot meanwhile).
    async fn boot(&mut self, enable: bool) {
        let (ctx, unit) = (self.ctx, self.unit);
        let verb = if enable { "enabling" } else { "disabling" };
        (ctx.events)(unit, &Event::Phase(format!("{verb} {unit} (at boot)")));
        let r = if enable { ctx.host.enable(unit).await } else { ctx.host.disable(unit).await };
        if let Err(e) = r {
            (ctx.events)(
                unit,
                &Event::Warning(format!("{verb} {unit} failed ({e:#}); the next reconcile tries again")),
            );
        }
    }

    /// The pre-flight's verdict, waited for: a refusal stops the run at `step`.
    async fn pass_gate(&mut self, step: Step) -> Result<(), StepFailure> {
        let Some(gate) = self.gate.take() else { return Ok(()) };
        match gate.await {
            Some(verdict) => Err(StepFailure { step, message: verdict, cause: Cause::Refused }),
            None => Ok(()),
        }
    }

    /// The drain, and the pre-flight's look alongside it: both done, or the first to fail (a
    /// refusal ends the drain: nothing is stopped).
    async fn drain_and_look(&mut self) -> Result<(), StepFailure> {
        let Some(gate) = self.gate.take() else { return self.drain().await };
        let look = async {
            match gate.await {
                Some(verdict) => Err(StepFailure { step: Step::Drain, message: verdict, cause: Cause::Refused }),
                None => Ok(()),
            }
        };
        tokio::try_join!(self.drain(), look).map(drop)
    }

    async fn drain(&mut self) -> Result<(), StepFailure> {
        let (ctx, unit, t, step) = (self.ctx, self.unit, self.t, Step::Drain);
        let emit = |e: Event| (ctx.events)(unit, &e);
        let Some(spec) = t.mode.spec() else { return Ok(()) };
        if t.drain.is_zero() {
            return Ok(());
        }
        emit(Event::Phase(format!("draining in-flight requests (up to {}s)", t.drain.as_secs())));
        let deadline = Instant::now() + t.drain;
        loop {
            self.stops_here(step)?;
            match ctx.host.running_requests(&t.old_url, spec.engine).await {
                Some(0) => break,
                Some(n) => {
                    self.in_flight.store(n as i64, Ordering::Relaxed);
                    if Instant::now() >= deadline {
                        emit(Event::Warning(format!(
                            "{n} requests still in flight after the drain budget; stopping anyway"
                        )));
                        break;
                    }
                    emit(Event::Waiting(format!("draining: {n} requests in flight")));
                }
                None => {
                    emit(Event::Progress("the server does not report in-flight requests; not waiting".into()));
                    break;
                }
            }
            tokio::time::sleep(timing::DRAIN_POLL).await;
        }
        Ok(())
    }

    async fn stop(&mut self) -> Result<(), StepFailure> {
        let (ctx, unit, t, before, step) = (self.ctx, self.unit, self.t, self.before, Step::Stop);
        let emit = |e: Event| (ctx.events)(unit, &e);
        emit(Event::Phase(format!("stopping {unit}")));
        if let Some(spec) = t.mode.spec()
            && let Ok(Some(n)) =
                tokio::time::timeout(timing::DRAIN_POLL, ctx.host.running_requests(&t.old_url, spec.engine)).await
        {
            self.in_flight.store(n as i64, Ordering::Relaxed);
        }
        // What systemd said a moment ago (observe) is enough to know what to stop.
        let props = before;
        if props.load_state == LoadState::NotFound && !props.is_running() {
            // No unit yet: nothing to stop.
            return Ok(());
        }
        // Say in the unit's journal who stops it and why (`specd diagnose` reads it).
        let (action, note) = match t.mode {
            Mode::Apply(_) => ("stop", format!("specd: stopping {unit} to apply unit {}", short(t.sha256))),
            Mode::Restore(Restore::Rollback) => (
                "rollback",
                format!(
                    "specd: stopping {unit} to roll back to the last good unit {}: the new unit failed",
                    short(t.sha256)
                ),
            ),
            Mode::Restore(Restore::HostFault) => (
                "restore",
                format!(
                    "specd: stopping {unit} to start the last good unit {} again: the apply failed on the host",
                    short(t.sha256)
                ),
            ),
        };
        ctx.host.note(unit, action, &before.invocation_id, &note);
        // Not waiting for the job: specd watches the stop itself (cgroup, progress).
        ctx.host.stop(unit, false).await.map_err(|e| StepFailure::host(step, format!("{e:#}")))?;
        Ok(())
    }

    async fn wait_stopped(&mut self, stop: &mut StopRecord) -> Result<(), StepFailure> {
        let (ctx, unit, t, step, cg) = (self.ctx, self.unit, self.t, Step::WaitStopped, &self.cg);
        let emit = |e: Event| (ctx.events)(unit, &e);
        let deadline = Instant::now() + t.stop_budget;
        let started = Instant::now();
        // Asked to stop from here on, this run goes on until its new instance is started: the
        // agent's stop waits for it as long (see `Carried`).
        self.carried = Some(ctx.shutdown.carry(unit, deadline));
        // While stopping, keep reading the in-flight count for the progress line.
        let poller = t.mode.spec().map(|spec| {
            let (host, url, engine, counter) =
                (ctx.host.clone(), t.old_url.clone(), spec.engine, self.in_flight.clone());
            Background(tokio::spawn(async move {
                loop {
                    let ask = host.running_requests(&url, engine);
                    if let Ok(Some(n)) = tokio::time::timeout(timing::STOPPING_ASK, ask).await {
                        counter.store(n as i64, Ordering::Relaxed);
                    }
                    tokio::time::sleep(timing::STOPPING_POLL).await;
                }
            }))
        });
        let counter = self.in_flight.clone();
        // Not given up when specd is asked to stop: the instance is stopping, and what follows
        // is the start of the next one (see `Shutdown::stops_here`).
        let waited = ctx
            .host
            .wait_empty(cg, deadline, || {
                let n = counter.load(Ordering::Relaxed);
                let reqs = if n >= 0 { format!(", {n} requests in flight") } else { String::new() };
                emit(Event::Waiting(format!("stopping: {}s{reqs}", started.elapsed().as_secs())));
            })
            .await;
        drop(poller);
        if let Err(lingering) = waited {
            let still = crate::cgroup::still_in(cg, &lingering);
            return Err(StepFailure::host(
                step,
                format!("after {}s, {still}; not starting a new instance over them", t.stop_budget.as_secs()),
            ));
        }
        // The cgroup is empty; systemd settles the unit state right after. Then make
        // sure nothing (Restart=, a dependency, a person) started it again.
        let props = wait_stopped_state(ctx, unit, deadline).await.map_err(|m| StepFailure::host(step, m))?;
        if let Some(v) = sigkill_verdict(&props, t.timeout_stop, Some(self.in_flight.load(Ordering::Relaxed))) {
            emit(Event::Warning(v.clone()));
            stop.verdict = Some(v);
        }
        // How it ended, as `diagnose` tells it (a crash before, an OOM kill...), read from the
        // journal in the background, off the apply's path.
        // A unit that failed and was then stopped may be unloaded by systemd at once (nothing
        // references it), and loaded again with no invocation: the one before the stop is it.
        let invocation = if props.invocation_id.is_empty() {
            self.before.invocation_id.clone()
        } else {
            props.invocation_id.clone()
        };
        stop.first = invocation.is_empty();
        let (host, u) = (ctx.host.clone(), unit.to_string());
        stop.pending =
            Some(Background(tokio::spawn(async move { host.ending(&u, &invocation, timing::ENDING_WITHIN).await })));
        emit(Event::Progress(format!("stopped after {:.1}s; cgroup empty", started.elapsed().as_secs_f64())));
        Ok(())
    }

    async fn remove_drop_ins(&mut self) -> Result<(), StepFailure> {
        let (ctx, unit, step) = (self.ctx, self.unit, Step::RemoveDropIns);
        let emit = |e: Event| (ctx.events)(unit, &e);
        let props = ctx.host.show(unit).await.map_err(|e| StepFailure::host(step, format!("{e:#}")))?;
        let keep = ctx.store.dir.join("removed-drop-ins").join(ctx.host.now().to_string());
        for p in own_drop_ins(&ctx.host, &props, unit).iter() {
            let dest = keep.join(p.trim_start_matches('/').replace('/', "__"));
            ctx.host.move_aside(Path::new(p), &dest).map_err(|e| StepFailure::host(step, format!("{e:#}")))?;
            emit(Event::Progress(format!("moved drop-in {p} to {}", dest.display())));
        }
        Ok(())
    }

    async fn write_unit(&mut self, st: &mut UnitState) -> Result<(), StepFailure> {
        let (ctx, unit, t, step, path) = (self.ctx, self.unit, self.t, Step::WriteUnit, &self.path);
        let emit = |e: Event| (ctx.events)(unit, &e);
        emit(Event::Phase(format!("writing {} (unit {})", path.display(), short(t.sha256))));
        // Record the intent first: after a crash, the next apply knows the file may be its own.
        let before_write = st.written_sha256.replace(t.sha256.to_string());
        // This apply's own write (read by the next apply if this one is interrupted:
        // a write that did not happen leaves a WriteUnit in that apply's plan anyway).
        let before_wrote = st.in_progress.as_ref().map(|p| p.wrote);
        if matches!(t.mode, Mode::Apply(_))
            && let Some(p) = st.in_progress.as_mut()
        {
            p.wrote = true;
        }
        if let Err(e) = ctx.store.save(st) {
            if matches!(t.mode, Mode::Apply(_)) {
                return Err(StepFailure::host(step, format!("{e:#}")));
            }
            // Putting the last good unit back matters more than recording it: the
            // unit file carries specd's header, so the next apply still knows it.
            emit(Event::Warning(format!("could not record the write in specd's state ({e:#}); writing anyway")));
        }
        if let Err(e) = ctx.host.write(path, t.text.as_bytes()) {
            // Nothing was written: the file on disk is still the one recorded before.
            st.written_sha256 = before_write;
            if let (Some(p), Some(w)) = (st.in_progress.as_mut(), before_wrote) {
                p.wrote = w;
            }
            let _ = ctx.store.save(st);
            return Err(StepFailure::host(step, format!("{e:#}")));
        }
        Ok(())
    }

    async fn reload(&mut self) -> Result<(), StepFailure> {
        let (ctx, unit, step, path) = (self.ctx, self.unit, Step::Reload, &self.path);
        let emit = |e: Event| (ctx.events)(unit, &e);
        emit(Event::Phase("daemon-reload".into()));
        ctx.host.daemon_reload().await.map_err(|e| StepFailure::host(step, format!("{e:#}")))?;
        let props = ctx.host.show(unit).await.map_err(|e| StepFailure::host(step, format!("{e:#}")))?;
        if props.need_daemon_reload {
            return Err(StepFailure::host(step, "systemd still reports NeedDaemonReload=yes after daemon-reload"));
        }
        if props.fragment_path != path.display().to_string() {
            return Err(StepFailure::host(
                step,
                format!("systemd loads {unit} from {:?}, not from {}", props.fragment_path, path.display()),
            ));
        }
        Ok(())
    }

    async fn start(&mut self) -> Result<(), StepFailure> {
        let (ctx, unit, step) = (self.ctx, self.unit, Step::Start);
        let emit = |e: Event| (ctx.events)(unit, &e);
        emit(Event::Phase(format!("starting {unit}")));
        let r = ctx.host.start(unit).await;
        let props = ctx.host.show(unit).await.map_err(|e| StepFailure::host(step, format!("{e:#}")))?;
        if let Err(e) = r {
            let why = format!("{e:#} (Result={}, status {})", props.result, props.exit_status());
            let new_instance = props.invocation_id != self.before.invocation_id;
            match recovery::failed_start(props.active_state, new_instance) {
                // The request failed, not the unit: it runs; the next steps check it.
                recovery::FailedStart::Runs => {}
                recovery::FailedStart::Unit => return Err(StepFailure::spec(step, why)),
                recovery::FailedStart::Host => return Err(StepFailure::host(step, why)),
            }
        }
        self.started_pid = props.main_pid;
        self.started_invocation = props.invocation_id.clone();
        self.after_start = Some(props);
        Ok(())
    }

    async fn verify_cmdline(&mut self) -> Result<(), StepFailure> {
        let (ctx, unit, t, step) = (self.ctx, self.unit, self.t, Step::VerifyCmdline);
        let emit = |e: Event| (ctx.events)(unit, &e);
        let props = match self.after_start.take() {
            Some(p) => p,
            None => ctx.host.show(unit).await.map_err(|e| StepFailure::host(step, format!("{e:#}")))?,
        };
        let pid = props.main_pid;
        if pid == 0 {
            return Err(StepFailure::spec(
                step,
                format!(
                    "the server exited right after start (Result={}, status {})",
                    props.result,
                    props.exit_status()
                ),
            ));
        }
        if self.started_pid == 0 {
            self.started_pid = pid;
            self.started_invocation = props.invocation_id.clone();
        }
        match ctx.host.cmdline(pid) {
            Some(c) if crate::plan::runs_argv(&c, &t.argv) => {
                emit(Event::Progress(format!("pid {pid} runs the rendered ExecStart")))
            }
            Some(c) => {
                return Err(StepFailure::spec(
                    step,
                    format!("pid {pid} runs {:?}, not the rendered ExecStart {:?}", c.join(" "), t.argv.join(" ")),
                ));
            }
            // Gone: the server exited. Alive: /proc could not be read (a host fault).
            None if !ctx.host.alive(pid) => {
                return Err(StepFailure::spec(step, format!("pid {pid} exited before its command line could be read")));
            }
            None => return Err(StepFailure::host(step, format!("could not read the command line of pid {pid}"))),
        }
        Ok(())
    }

    async fn wait_ready(&mut self) -> Result<(), StepFailure> {
        let (ctx, unit, t, step) = (self.ctx, self.unit, self.t, Step::WaitReady);
        tokio::select! {
            r = wait_ready(ctx, unit, t, self.started_pid, &self.started_invocation) => r.map_err(|w| match w {
                Waited::Spec(m) => StepFailure::spec(step, m),
                Waited::Host(m) => StepFailure::host(step, m),
            })?,
            _ = ctx.shutdown.stopping(self.changed, self.started) => return Err(self.stops_here(step).unwrap_err()),
        }
        self.ready_pid = Some(self.started_pid);
        Ok(())
    }

    async fn verify_speculation(&mut self, st: &mut UnitState) -> Result<(), StepFailure> {
        let (ctx, unit, t, step) = (self.ctx, self.unit, self.t, Step::VerifySpeculation);
        let emit = |e: Event| (ctx.events)(unit, &e);
        let Some(spec) = t.mode.spec() else { return Ok(()) };
        emit(Event::Phase(format!(
            "proving that the server speculates ({}-token generation)",
            crate::speculation::TOKENS
        )));
        let pid = self.started_pid;
        let measured = answered(|| ctx.host.speculation(&t.base_url, spec), || ctx.host.alive(pid))
            .await
            .map_err(|e| StepFailure::spec(step, format!("could not read the speculation evidence: {e}")))?;
        if let Some(why) = crate::speculation::missing(spec, &measured) {
            return Err(StepFailure::spec(step, why));
        }
        emit(Event::Progress(format!("the server speculates: {}", measured.figure())));
        st.speculation =
            Some(state::SpeculationRecord { sha256: t.sha256.to_string(), time: ctx.host.now(), measured });
        Ok(())
    }

    async fn verify_args(&mut self) -> Result<(), StepFailure> {
        let (ctx, unit, t, step) = (self.ctx, self.unit, self.t, Step::VerifyArgs);
        let emit = |e: Event| (ctx.events)(unit, &e);
        let Some(spec) = t.mode.spec() else { return Ok(()) };
        let pid = self.started_pid;
        let invocation = self.started_invocation.clone();
        let info = answered(
            || async { ctx.host.reported_args(&t.base_url, spec, &invocation).await.transpose() },
            || ctx.host.alive(pid),
        )
        .await;
        match info.transpose() {
            None => {}
            Some(Err(e)) => {
                return Err(StepFailure::spec(step, format!("could not read the server's args: {e}")));
            }
            Some(Ok(info)) => {
                let m = probe::compare_args(&spec.expected_server_args(), &info);
                if !m.is_empty() {
                    let list: Vec<String> = m.iter().map(|x| x.to_string()).collect();
                    return Err(StepFailure::spec(
                        step,
                        format!("the server reports args that differ from the spec: {}", list.join("; ")),
                    ));
                }
                emit(Event::Progress(format!(
                    "the server reports the spec's args ({} checked)",
                    spec.expected_server_args().len()
                )));
            }
        }
        Ok(())
    }
}

/// A question to the server that a reset connection or a moment's overload may fail: asked up to
/// three times, a second apart, while the process specd started still runs (a server that died
/// is not asked again: its error stands, and the crash is named).
async fn answered<T, F, Fut>(ask: F, runs: impl Fn() -> bool) -> Result<T, String>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let mut last = String::new();
    for attempt in 0..timing::ASK_ATTEMPTS {
        if attempt > 0 {
            if !runs() {
                break;
            }
            tokio::time::sleep(timing::ASK_PAUSE).await;
        }
        match ask().await {
            Ok(v) => return Ok(v),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// After the cgroup emptied: wait for systemd to settle the unit as stopped, and stop it again
/// if something restarted it meanwhile.
async fn wait_stopped_state<H: Host>(ctx: &Ctx<H>, unit: &str, deadline: Instant) -> Result<UnitProps, String> {
    let mut restops = 0;
    // Subscribed before the first look: a change between the look and the wait is not lost.
    let mut changes = ctx.host.watch(unit).await;
    loop {
        let props = ctx.host.show(unit).await.map_err(|e| format!("{e:#}"))?;
        match plan::stopping(props.active_state, &props.sub_state, props.main_pid, restops) {
            Stopping::Stopped => {
                if !ctx.host.populated(&props.control_group) {
                    return Ok(props);
                }
                // Stopped, and a process entered the cgroup after it emptied (a stop-post
                // command...): until it is empty again, which is no change of the unit's state.
                if let Err(left) = ctx.host.wait_empty(&props.control_group, deadline, || {}).await {
                    let pids: Vec<String> = left.iter().map(|l| l.pid.to_string()).collect();
                    return Err(format!("{unit} is stopped but pids {} stay in its cgroup", pids.join(", ")));
                }
                continue;
            }
            Stopping::KeepsStarting => {
                return Err(format!(
                    "{unit} keeps being started again while specd stops it ({}/{})",
                    props.active_state, props.sub_state
                ));
            }
            Stopping::StopAgain => {
                restops += 1;
                (ctx.events)(
                    unit,
                    &Event::Warning(format!(
                        "{unit} was started again while stopping ({}); stopping it again",
                        props.sub_state
                    )),
                );
                ctx.host.stop(unit, true).await.map_err(|e| format!("{e:#}"))?;
                continue;
            }
            Stopping::Settling => {}
        }
        if Instant::now() >= deadline {
            return Err(format!("{unit} did not reach a stopped state ({}/{})", props.active_state, props.sub_state));
        }
        // Systemd's next change of the unit; a process leaving the cgroup may come after it.
        tokio::select! {
            _ = changes.changed() => {}
            _ = tokio::time::sleep_until(deadline) => {}
        }
    }
}

/// Why a wait for readiness ended without it: the server's fault (it exited, answered a 4xx, or
/// was not ready in time), or the host's (systemd could not be asked how the unit is).
enum Waited {
    Spec(String),
    Host(String),
}

/// Poll the readiness endpoint until 200, with a short capped backoff, while checking that the
/// process specd started is still the one running.
async fn wait_ready<H: Host>(
    ctx: &Ctx<H>,
    unit: &str,
    t: &Target<'_>,
    pid: u32,
    invocation: &str,
) -> Result<(), Waited> {
    use backon::Retryable;
    let emit = |e: Event| (ctx.events)(unit, &e);
    emit(Event::Phase(format!("waiting for {}{} (up to {}s)", t.base_url, t.endpoint, t.readiness.as_secs())));
    let url = format!("{}{}", t.base_url, t.endpoint);
    let started = Instant::now();
    let deadline = started + t.readiness;
    let last_check = std::sync::Mutex::new(Instant::now());
    let last_note = std::sync::Mutex::new(Instant::now());
    // What the server last wrote, read off the poll's path (a journal read may take a moment),
    // once per waiting line.
    let said = Arc::new(std::sync::Mutex::new(String::new()));
    let _reader = {
        let (host, invocation, said) = (ctx.host.clone(), invocation.to_string(), said.clone());
        Background(tokio::spawn(async move {
            tokio::time::sleep(timing::SAID_FIRST).await;
            loop {
                if let Some(l) = host.last_said(&invocation).await {
                    *crate::guard::lock(&said) = format!(" ({l})");
                }
                tokio::time::sleep(timing::WAITING_NOTE).await;
            }
        }))
    };
    #[derive(Debug)]
    enum Wait {
        Loading(String),
        Fatal(String),
        /// systemd could not be asked (its connection lost past `host::RECONNECT_WITHIN`).
        Host(String),
    }
    let attempt = || async {
        let why = match ctx.host.health(&url).await {
            Health::Ready => return Ok(()),
            // A 4xx: no such endpoint, or one that wants what specd does not send. Waiting
            // will not make it answer 200.
            Health::Error(e) => return Err(Wait::Fatal(e)),
            // A refused, reset or closed connection, a 503: not ready yet. Only the process
            // ending is fatal (a failing load closes connections while it exits).
            Health::Loading(why) => why,
        };
        let now = Instant::now();
        let exited = !ctx.host.alive(pid);
        let due = exited || { now.duration_since(*last_check.lock().unwrap()) >= timing::ALIVE_EVERY };
        if due {
            *last_check.lock().unwrap() = now;
            // The process is gone: let systemd settle the unit so its result can be told (its
            // next change, subscribed to before the look).
            let mut changes = match exited {
                true => Some(ctx.host.watch(unit).await),
                false => None,
            };
            let mut props = ctx.host.show(unit).await.map_err(|e| Wait::Host(format!("{e:#}")))?;
            let settle = Instant::now() + timing::EXIT_SETTLE;
            while let Some(c) = changes.as_mut().filter(|_| props.main_pid == pid) {
                tokio::select! {
                    _ = c.changed() => {}
                    _ = tokio::time::sleep_until(settle) => break,
                }
                props = ctx.host.show(unit).await.map_err(|e| Wait::Host(format!("{e:#}")))?;
            }
            if exited
                || props.main_pid != pid
                || !matches!(props.active_state, ActiveState::Active | ActiveState::Activating)
            {
                return Err(Wait::Fatal(format!(
                    "the server exited while loading (Result={}, status {}, {} restarts)",
                    props.result,
                    props.exit_status(),
                    props.n_restarts
                )));
            }
        }
        if now >= deadline {
            return Err(Wait::Fatal(format!("not ready after {}s ({why})", t.readiness.as_secs())));
        }
        let note_due = { now.duration_since(*last_note.lock().unwrap()) >= timing::WAITING_NOTE };
        if note_due {
            *last_note.lock().unwrap() = now;
            // With what the server says it is doing, when it says anything.
            let said = crate::guard::lock(&said).clone();
            emit(Event::Waiting(format!("loading: {}s{said}", started.elapsed().as_secs())));
        }
        Err(Wait::Loading(why))
    };
    let backoff = readiness_backoff();
    match attempt.retry(backoff).sleep(tokio::time::sleep).when(|e| matches!(e, Wait::Loading(_))).await {
        Ok(()) => {
            emit(Event::Progress(format!("ready after {:.1}s", started.elapsed().as_secs_f64())));
            Ok(())
        }
        Err(Wait::Fatal(m)) | Err(Wait::Loading(m)) => Err(Waited::Spec(m)),
        Err(Wait::Host(m)) => Err(Waited::Host(m)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_replaced_instance_is_found_where_its_unit_says() {
        let text = "[Service]\nExecStart=/opt/py -m sglang.launch_server --model-path /m --host 0.0.0.0 --port 30001\n";
        let argv = exec_start(text).unwrap();
        assert_eq!(base_url_of_argv(&argv).as_deref(), Some("http://127.0.0.1:30001"));
        let argv: Vec<String> = ["x", "--host=10.0.0.2", "--port=8000"].iter().map(|s| s.to_string()).collect();
        assert_eq!(base_url_of_argv(&argv).as_deref(), Some("http://10.0.0.2:8000"));
        assert_eq!(base_url_of_argv(&["x".to_string()]), None);
        // An IPv6 wildcard is reached on loopback, as the spec's own base URL is.
        let argv: Vec<String> = ["x", "--host", "::", "--port", "8000"].iter().map(|s| s.to_string()).collect();
        assert_eq!(base_url_of_argv(&argv).as_deref(), Some("http://[::1]:8000"));
    }

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

    #[test]
    fn a_stop_timeout_is_named_a_sigkill_and_not_an_oom() {
        let p =
            UnitProps { result: ServiceResult::Timeout, exec_main_code: 2, exec_main_status: 9, ..Default::default() };
        let v = sigkill_verdict(&p, Duration::from_secs(300), Some(16)).unwrap();
        assert_eq!(
            v,
            "stopped by SIGKILL after TimeoutStopSec=300s while 16 requests were in flight — not an OOM: the server was still draining when systemd's stop timeout ran out"
        );
        let clean = UnitProps { result: ServiceResult::Success, exec_main_code: 1, ..Default::default() };
        assert_eq!(sigkill_verdict(&clean, Duration::from_secs(300), Some(0)), None);
    }
}
