//! Each step of the apply sequence on the host (`Run`): drain, stop until the cgroup is empty,
//! write, reload, start, verify, wait for readiness, prove speculation.

use super::act::{Background, Gate, Mode, StopRecord, Target};
use super::observe::own_drop_ins;
use super::shutdown::CarriedGuard;
use super::waits::{StartClock, Waited, answered, wait_gpus_free, wait_ready, wait_stopped_state};
use super::*;
use crate::core::conclude::Cancelled;
use crate::core::plan::Step;
use crate::core::record;
use crate::core::record::{Phase, UnitState};
use crate::core::recovery::{self, Death, FaultKind, Restore};
use crate::core::timing::{self};
use crate::core::unit_state::{LoadState, ServiceResult};
use crate::host::{Host, unit_path};
use crate::machine::probe::{self};
use crate::machine::systemd::UnitProps;
use anyhow::Result;
use specd_spec::short;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;
use tokio::time::Instant;

/// Why a step did not finish.
#[derive(Debug)]
pub(super) struct StepFailure {
    pub(super) step: Step,
    pub(super) message: String,
    pub(super) cause: Cause,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Cause {
    /// It failed, by this fault.
    Fault(FaultKind),
    /// Not a failure: specd is stopping and this is a safe point (see [`Shutdown::stops_here`]).
    Cancelled(Cancelled),
    /// Not a failure: the pre-flight, looking while the drain ran, found that the unit cannot
    /// start here (the message is the verdict); nothing was changed.
    Refused,
}

impl StepFailure {
    pub(super) fn host(step: Step, message: impl Into<String>) -> Self {
        StepFailure { step, message: message.into(), cause: Cause::Fault(FaultKind::Host) }
    }
    pub(super) fn spec(step: Step, message: impl Into<String>) -> Self {
        StepFailure { step, message: message.into(), cause: Cause::Fault(FaultKind::Spec) }
    }
    pub(super) fn cancelled(step: Step, at: Cancelled) -> Self {
        StepFailure { step, message: "the agent is stopping".into(), cause: Cause::Cancelled(at) }
    }
    pub(super) fn cancelled_at(&self) -> Option<Cancelled> {
        match self.cause {
            Cause::Cancelled(at) => Some(at),
            Cause::Fault(_) | Cause::Refused => None,
        }
    }
    /// Whose fault it is (a cancelled or refused step is nobody's: the host's, for what follows).
    pub(super) fn fault(&self) -> FaultKind {
        match self.cause {
            Cause::Fault(k) => k,
            Cause::Cancelled(_) | Cause::Refused => FaultKind::Host,
        }
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
pub(super) async fn run_steps<H: Host>(
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
        start_called_us: 0,
        exec_us: 0,
        startup: None,
        changed: t.not_serving,
        // A run that starts nothing finishes an apply whose instance was started already.
        started: t.not_serving && !steps.contains(&Step::Start),
        carried: None,
        marked: false,
        door: crate::core::door::Door::Off,
    };
    let r = run.steps(st, steps, stop).await;
    // Whatever ended the run, its port is open again (see `door`).
    run.open_door(st).await;
    stop.followed_by = std::mem::take(&mut run.started_invocation);
    if let Some(s) = run.startup.take() {
        st.startup = Some(s.clone());
        stop.startup = Some(s);
    }
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
pub(super) struct Run<'a, H: Host> {
    pub(super) ctx: &'a Ctx<H>,
    pub(super) unit: &'a str,
    pub(super) t: &'a Target<'a>,
    /// systemd's view before the first step.
    pub(super) before: &'a UnitProps,
    /// The pre-flight, looking while the drain runs: no step that changes anything before it
    /// has passed.
    pub(super) gate: Option<Gate<'a>>,
    pub(super) path: PathBuf,
    pub(super) cg: String,
    /// Requests in flight on the instance being replaced (-1: not known).
    pub(super) in_flight: Arc<AtomicI64>,
    /// The main pid of the instance this run started.
    pub(super) started_pid: u32,
    /// systemd's view right after the start.
    pub(super) after_start: Option<UnitProps>,
    /// The started server answered ready (a later failure is a crash after readiness).
    pub(super) ready_pid: Option<u32>,
    /// The invocation ID of the instance this run started.
    pub(super) started_invocation: String,
    /// When this run started the unit, and systemd's exec of its main process (the host's
    /// monotonic µs; 0: not known).
    pub(super) start_called_us: u64,
    pub(super) exec_us: u64,
    /// The start this run made, timed once its wait for readiness ended.
    pub(super) startup: Option<crate::core::record::Startup>,
    /// This run (or the one it finishes) stopped, wrote or started something: asked to stop, it
    /// goes on until [`Run::started`].
    pub(super) changed: bool,
    /// The instance this run puts in place was started.
    pub(super) started: bool,
    /// From its old instance's stop on: the run's place among those the agent's stop waits for.
    pub(super) carried: Option<CarriedGuard>,
    /// This run told the unit's load balancers `drain`.
    pub(super) marked: bool,
    /// Whether it closed the port to new connections for the drain (`door`).
    pub(super) door: crate::core::door::Door,
}

impl<H: Host> Run<'_, H> {
    /// Asked to stop, whether this run stops here, and how its stop is told.
    pub(super) fn stops_here(&self, step: Step) -> Result<(), StepFailure> {
        if !self.ctx.shutdown.stops_here(self.changed, self.started) {
            return Ok(());
        }
        let at = if self.changed { Cancelled::Started } else { Cancelled::Unchanged };
        Err(StepFailure::cancelled(step, at))
    }

    pub(super) async fn steps(
        &mut self,
        st: &mut UnitState,
        steps: &[Step],
        stop: &mut StopRecord,
    ) -> Result<(), StepFailure> {
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
                Step::Drain => {
                    self.close_door(st).await;
                    self.drain_and_look().await?
                }
                Step::Stop => {
                    self.close_door(st).await;
                    self.stop().await?
                }
                Step::WaitStopped => {
                    self.wait_stopped(stop).await?;
                    self.open_before_start(st).await?;
                }
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
    pub(super) async fn boot(&mut self, enable: bool) {
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
    pub(super) async fn pass_gate(&mut self, step: Step) -> Result<(), StepFailure> {
        let Some(gate) = self.gate.take() else { return Ok(()) };
        match gate.await {
            Some(verdict) => Err(StepFailure { step, message: verdict, cause: Cause::Refused }),
            None => Ok(()),
        }
    }

    /// The drain, and the pre-flight's look alongside it: both done, or the first to fail (a
    /// refusal ends the drain: nothing is stopped). Asked to stop while the look goes on after
    /// the drain, the run stops there (nothing is stopped yet). A look that outlasts the drain
    /// is followed by the drain again, for what is left of its budget: requests that came while
    /// it looked finish before the stop.
    pub(super) async fn drain_and_look(&mut self) -> Result<(), StepFailure> {
        let Some(gate) = self.gate.take() else { return self.drain().await };
        let deadline = Instant::now() + self.t.drain;
        let shutdown = self.ctx.shutdown.clone();
        let look = async {
            let t0 = Instant::now();
            tokio::select! {
                verdict = gate => match verdict {
                    Some(verdict) => Err(StepFailure { step: Step::Drain, message: verdict, cause: Cause::Refused }),
                    None => Ok(t0.elapsed()),
                },
                () = shutdown.wait() => Err(StepFailure::cancelled(Step::Drain, Cancelled::Unchanged)),
            }
        };
        let drained = async {
            self.drain_until(deadline).await?;
            Ok::<_, StepFailure>(Instant::now())
        };
        // A refusal (or a request to stop) ends the drain at once; the drain's end waits for the look.
        let (drained_at, _) = tokio::try_join!(drained, look)?;
        if Instant::now().duration_since(drained_at) > timing::DRAIN_POLL {
            self.drain_until(deadline).await?;
        }
        Ok(())
    }

    /// The drain: the load balancers told `drain` and waited for until they saw it (see
    /// `balancers`), then the requests in flight, all within the drain budget.
    pub(super) async fn drain(&mut self) -> Result<(), StepFailure> {
        let deadline = Instant::now() + self.t.drain;
        self.drain_until(deadline).await
    }

    /// Until the server has no request in flight, or `deadline` (then it says how many are left
    /// and goes on); asked at least once. The first time, its load balancers are told `drain` and
    /// waited for first.
    async fn drain_until(&mut self, deadline: Instant) -> Result<(), StepFailure> {
        let (ctx, unit, t, step) = (self.ctx, self.unit, self.t, Step::Drain);
        let emit = |e: Event| (ctx.events)(unit, &e);
        let Some(spec) = t.mode.spec() else { return Ok(()) };
        if !self.marked {
            if !t.drain.is_zero() {
                emit(Event::Phase(format!(
                    "draining (up to {}s): the load balancers told drain, then the requests in flight",
                    t.drain.as_secs()
                )));
            }
            let mark = self.mark_drain().map_err(|e| StepFailure {
                step,
                message: crate::core::conclude::not_told(unit, &format!("{e:#}")),
                cause: Cause::Refused,
            })?;
            self.wait_for_balancers(mark).await?;
        }
        if t.drain.is_zero() {
            return Ok(());
        }
        let left = deadline.saturating_duration_since(Instant::now());
        emit(Event::Phase(format!("draining in-flight requests (up to {}s)", left.as_secs_f64().round())));
        loop {
            self.stops_here(step)?;
            match ctx.host.running_requests(&t.old_url, spec.engine).await {
                Some(0) => {
                    if matches!(self.door, crate::core::door::Door::Closed { .. }) {
                        emit(Event::Progress("drained: no request in flight".into()));
                    }
                    break;
                }
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

    pub(super) async fn stop(&mut self) -> Result<(), StepFailure> {
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
        // Its load balancers told first, if the drain did not (an instance that does not serve).
        if !self.marked
            && let Err(e) = self.mark_drain()
        {
            emit(Event::Warning(format!("could not tell {unit}'s load balancers drain ({e:#}); stopping it anyway")));
        }
        // Say in the unit's journal who stops it and why (`specd diagnose` reads it).
        let (action, note) = match t.mode {
            _ if t.pruning => ("prune", format!("specd: stopping {unit}: its spec is gone (prune)")),
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

    pub(super) async fn wait_stopped(&mut self, stop: &mut StopRecord) -> Result<(), StepFailure> {
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
            let still = crate::machine::cgroup::still_in(cg, &lingering);
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

    pub(super) async fn remove_drop_ins(&mut self) -> Result<(), StepFailure> {
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

    pub(super) async fn write_unit(&mut self, st: &mut UnitState) -> Result<(), StepFailure> {
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

    pub(super) async fn reload(&mut self) -> Result<(), StepFailure> {
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

    pub(super) async fn start(&mut self) -> Result<(), StepFailure> {
        let (ctx, unit, step) = (self.ctx, self.unit, Step::Start);
        let emit = |e: Event| (ctx.events)(unit, &e);
        // Not over GPU memory still held: that start would fail, and be taken for the spec's.
        wait_gpus_free(ctx, unit, self.t).await.map_err(|m| StepFailure::host(step, m))?;
        // A server that died is not left told ready while it starts again (a stop told drain).
        if ctx.host.serving_state(unit).is_some_and(|s| s.word() == crate::core::serving::Word::Ready) {
            let down = crate::core::serving::ServingState::Down {
                why: format!("specd is starting it (unit {})", short(self.t.sha256)),
                since: ctx.host.now(),
            };
            ctx.host.set_serving_state(unit, &down).map_err(|e| StepFailure::host(step, format!("{e:#}")))?;
        }
        emit(Event::Phase(format!("starting {unit}")));
        self.start_called_us = ctx.host.monotonic_us();
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
        self.exec_us = props.exec_main_start_mono;
        self.after_start = Some(props);
        Ok(())
    }

    pub(super) async fn verify_cmdline(&mut self) -> Result<(), StepFailure> {
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
            self.exec_us = props.exec_main_start_mono;
        }
        match ctx.host.cmdline(pid) {
            Some(c) if crate::core::plan::runs_argv(&c, &t.argv) => {
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

    pub(super) async fn wait_ready(&mut self) -> Result<(), StepFailure> {
        let (ctx, unit, t, step) = (self.ctx, self.unit, self.t, Step::WaitReady);
        // A run that finishes an apply whose instance was started already times it from the exec.
        let clock = StartClock {
            invocation: self.started_invocation.clone(),
            engine: t.engine,
            called_us: if self.start_called_us > 0 { self.start_called_us } else { self.exec_us },
            exec_us: self.exec_us,
        };
        let (r, startup) = tokio::select! {
            r = wait_ready(ctx, unit, t, self.started_pid, &clock) => r,
            _ = ctx.shutdown.stopping(self.changed, self.started) => return Err(self.stops_here(step).unwrap_err()),
        };
        self.startup = Some(startup);
        r.map_err(|w| match w {
            Waited::Spec(m) => StepFailure::spec(step, m),
            Waited::Host(m) => StepFailure::host(step, m),
        })?;
        self.ready_pid = Some(self.started_pid);
        Ok(())
    }

    pub(super) async fn verify_speculation(&mut self, st: &mut UnitState) -> Result<(), StepFailure> {
        let (ctx, unit, t, step) = (self.ctx, self.unit, self.t, Step::VerifySpeculation);
        let emit = |e: Event| (ctx.events)(unit, &e);
        let Some(spec) = t.mode.spec() else { return Ok(()) };
        emit(Event::Phase(format!(
            "proving that the server speculates ({}-token generation)",
            crate::core::speculation::TOKENS
        )));
        let pid = self.started_pid;
        let measured = answered(|| ctx.host.speculation(&t.base_url, spec), || ctx.host.alive(pid))
            .await
            .map_err(|e| StepFailure::spec(step, format!("could not read the speculation evidence: {e}")))?;
        if let Some(why) = crate::core::speculation::missing(spec, &measured) {
            return Err(StepFailure::spec(step, why));
        }
        emit(Event::Progress(format!("the server speculates: {}", measured.figure())));
        st.speculation =
            Some(record::SpeculationRecord { sha256: t.sha256.to_string(), time: ctx.host.now(), measured });
        Ok(())
    }

    pub(super) async fn verify_args(&mut self) -> Result<(), StepFailure> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::unit_state::ServiceResult;

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
