//! Carrying a plan out: the pre-flight and the drain that overlaps it, the steps, and what a
//! failure leads to (`recovery::after`: a restore of the last good unit, a retry, a stop).

use super::observe::own_drop_ins;
use super::prune::stop_quietly;
use super::steps::{Cause, StepFailure, run_steps};
use super::*;
pub use crate::core::conclude::Serving;
use crate::core::conclude::{self, Conclusion, Recovered, Restored};
use crate::core::plan::{self, Observed, Plan, Step, Toward};
use crate::core::record;
use crate::core::record::{GoodUnit, InProgress, Phase, Quarantined, UnitState};
use crate::core::recovery::{self, FaultKind, LastGood, Recovery, Restore};
use crate::core::timing::{self, SpecWaits};
use crate::host::{Host, unit_path};
use crate::machine::systemd::UnitProps;
use anyhow::Result;
use specd_spec::{Spec, base_url_of_argv, exec_start, short};
use std::time::Duration;
use tokio::time::Instant;

/// A background task that ends with the reconcile that started it (also when that reconcile is
/// dropped half-way: the agent stopping, a test's crash).
pub(super) struct Background<T>(pub(super) tokio::task::JoinHandle<T>);

impl<T> Drop for Background<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// How the instance an apply stopped had ended: specd's own SIGKILL verdict at once, or the
/// diagnosis from the journal, which is read in the background while the new server loads.
#[derive(Default)]
pub(super) struct StopRecord {
    /// How it ended, when that was not a clean stop.
    pub(super) verdict: Option<String>,
    /// How it ended, clean or not.
    pub(super) ended: Option<String>,
    pub(super) pending: Option<Background<Option<crate::host::Ending>>>,
    /// The instance started after it (empty: none was).
    pub(super) followed_by: String,
    /// There was no instance to stop (the unit's first start).
    pub(super) first: bool,
    /// The start the run made, timed (its history entry keeps it).
    pub(super) startup: Option<record::Startup>,
}

impl StopRecord {
    pub(super) async fn finish(&mut self) -> Option<String> {
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
    pub(super) fn last_ended(&self) -> Option<record::LastEnded> {
        if self.followed_by.is_empty() || (self.ended.is_none() && !self.first) {
            return None;
        }
        Some(record::LastEnded { summary: self.ended.clone(), followed_by: self.followed_by.clone() })
    }
}

/// What to verify and probe for one unit text (the desired one, or a rollback target).
pub(super) struct Target<'a> {
    pub(super) sha256: &'a str,
    pub(super) text: &'a str,
    pub(super) argv: Vec<String>,
    pub(super) base_url: String,
    /// Where the instance being replaced listens (for draining and the in-flight count).
    pub(super) old_url: String,
    pub(super) endpoint: String,
    pub(super) readiness: Duration,
    pub(super) stop_budget: Duration,
    pub(super) timeout_stop: Duration,
    pub(super) drain: Duration,
    /// Whose lines tell the phases of its start.
    pub(super) engine: specd_spec::Engine,
    /// The share of each GPU's memory its server claims (`None`: its engine does not say).
    pub(super) gpu_share: Option<f64>,
    pub(super) mode: Mode<'a>,
    /// The instance being replaced may not serve (a rollback replaces a failed one; an
    /// interrupted apply may have stopped it): asked to stop, the run still starts the next one.
    pub(super) not_serving: bool,
    /// Its spec is gone: the run drains it for a prune (what its load balancers are told).
    pub(super) pruning: bool,
}

/// What a run of steps puts in place.
#[derive(Clone, Copy, Debug)]
pub(super) enum Mode<'a> {
    /// The desired unit, by its spec (drained, verified against it).
    Apply(&'a Spec),
    /// The last good unit, for this reason (said in the unit's journal for `diagnose`).
    Restore(Restore),
}

impl<'a> Mode<'a> {
    /// The spec an apply verifies against; a restore has none (its unit was verified before).
    pub(super) fn spec(self) -> Option<&'a Spec> {
        match self {
            Mode::Apply(spec) => Some(spec),
            Mode::Restore(_) => None,
        }
    }
}

impl<'a> Target<'a> {
    /// The desired unit, replacing the instance at `old_url`; `resumed`: this apply finishes an
    /// interrupted one, which may have stopped the old instance already.
    pub(super) fn desired(d: &'a DesiredState, old_url: String, resumed: bool) -> Target<'a> {
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
            engine: d.spec.engine,
            gpu_share: gpu_share(&d.spec),
            mode: Mode::Apply(&d.spec),
            not_serving: resumed,
            pruning: false,
        }
    }
}

/// The share of each GPU's memory a server of `spec` claims: the spec's
/// `server.mem_fraction_static`, else its engine's default where the engine facts pin one
/// (vLLM's `--gpu-memory-utilization` 0.92); `None` when neither says.
pub(super) fn gpu_share(spec: &Spec) -> Option<f64> {
    let pinned = || {
        let r = specd_spec::engine_facts(spec.engine).reported.iter().find(|r| r.field == "server.mem_fraction_static");
        r.and_then(|r| r.default).and_then(|d| d.parse::<f64>().ok())
    };
    spec.server.mem_fraction_static.or_else(pinned)
}

/// The pre-flight's look, to be waited for before the first step that changes anything: the
/// verdict refusing the unit, or `None`.
pub(super) type Gate<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = Option<String>> + Send + 'a>>;

/// The plan's steps, carried out (none that changes anything before `gate` lets it), and what
/// they returned, concluded: with the stopped instance's ending and how long it took.
pub(super) async fn act<H: Host>(
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
    let resumed = st.in_progress.as_ref().filter(|p| p.sha256 == d.unit.sha256 && p.may_have_changed());
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
    let startup = stop.startup.take();
    let mut c = match result {
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
            let mut c =
                failed(ctx, st, d, f, plan, (resumed, resumed_wrote), &mut stop_verdict, &failed_instance).await;
            c.change.startup = startup;
            return Ok((c, stop_verdict, started.elapsed().as_millis() as u64));
        }
    };
    c.change.startup = startup;
    Ok((c, stop_verdict, ms))
}

/// Whether the plan asks the pre-flight: it would stop a serving instance to start the desired
/// unit. A unit that does not run has nothing to protect: its start is tried, and its failure
/// rolled back and quarantined as any other (`dry_run` says the problems either way). A restore
/// starts the last good unit, which ran here before; the desired unit's pre-flight is not about it.
pub(super) fn preflight_needed(plan: &Plan, props: &UnitProps, dry_run: bool) -> bool {
    let serving = plan.steps.contains(&Step::Stop) && props.is_running();
    plan.toward != Toward::LastGood && plan.steps.contains(&Step::Start) && (serving || dry_run)
}

/// The verdict refusing a plan that would stop a serving instance to start a unit that cannot
/// start on this host (`preflight`: a missing program, model or draft, a port another process
/// holds...), or `None`.
pub(super) async fn preflight_refusal<H: Host>(
    ctx: &Ctx<H>,
    d: &DesiredState,
    plan: &Plan,
    props: &UnitProps,
) -> Option<String> {
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
pub(super) fn running_as_good(
    o: &Observed,
    st: &UnitState,
    d: &DesiredState,
    deployed: &[u8],
    now: u64,
) -> Option<GoodUnit> {
    let text = String::from_utf8_lossy(deployed).into_owned();
    let serving = o.ready == Some(true)
        && !o.need_daemon_reload
        && o.main_cmdline
            .as_ref()
            .is_some_and(|c| exec_start(&text).is_some_and(|argv| crate::core::plan::runs_argv(c, &argv)));
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
pub(super) async fn failed<H: Host>(
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
    let mut c = conclude::failed(&s, conclude::recovered(&s, &what, &recovered), said, serving, &decision);
    c.change.serving = conclude::after_recovery(&recovered, c.serving.as_ref(), &c.verdict);
    c
}

/// Whether the unit's service runs after a failed apply or a rollback, as systemd says now.
pub(super) async fn serving_now<H: Host>(ctx: &Ctx<H>, unit: &str) -> Serving {
    Serving::of(ctx.host.show(unit).await.ok().map(|p| (p.active_state, p.sub_state)))
}

/// After a failed step: roll back to the last good unit, start it again after a host fault, or
/// leave the service as it is; see [`recovery::decide`].
pub(super) async fn recover<H: Host>(
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
pub(super) fn restored_of(r: Result<(), StepFailure>) -> Restored {
    match r {
        Ok(()) => Restored::Serving,
        Err(f) if f.cancelled_at().is_some() => Restored::Cancelled(f.step),
        Err(f) => Restored::Failed(f.step, f.message),
    }
}

/// Put the last good unit back by `steps` (from `plan::restore_steps`) and prove it serves: the
/// same race-free sequence.
pub(super) async fn restore<H: Host>(
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
        // The last good unit is the desired spec's engine's, as a rule: its lines are read so.
        engine: d.spec.engine,
        gpu_share: gpu_share(&d.spec),
        mode: Mode::Restore(why),
        // What it stops has failed already: asked to stop, it still puts the good unit back.
        not_serving: true,
        pruning: false,
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
}
