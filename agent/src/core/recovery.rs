//! What to do when a step of an apply failed: a pure decision, so that every case (a spec that
//! does not start, a server that crashed after it was ready, a full disk after the stop) is
//! tested without a machine. The reconciler carries it out.

use crate::core::plan::Step;
use crate::core::unit_state::{ActiveState, ServiceResult};

/// Whose fault a failed step is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultKind {
    /// The host's (systemd, the unit directory, specd's own state): nothing says the spec is bad.
    Host,
    /// The spec's: its server did not start, verify, or answer ready.
    Spec,
    /// The spec's server died after it had answered ready (a first 200 from its readiness
    /// endpoint), or was killed from outside while it loaded, saying nothing of its own: a crash,
    /// which does not condemn a unit that passed verification before.
    Crashed,
}

impl FaultKind {
    /// The spec is at fault (its server failed), not the host.
    pub fn of_spec(self) -> bool {
        self != FaultKind::Host
    }
}

/// Which last good unit there is, against the desired one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LastGood {
    None,
    /// The desired unit itself is the last good one.
    Desired,
    /// Another unit: a rollback target.
    Other,
}

impl LastGood {
    pub fn of(last_good: Option<&str>, desired: &str) -> LastGood {
        match last_good {
            None => LastGood::None,
            Some(g) if g == desired => LastGood::Desired,
            Some(_) => LastGood::Other,
        }
    }
}

/// What is known about a failed apply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Failure {
    /// The step that failed.
    pub step: Step,
    pub fault: FaultKind,
    /// This apply wrote the desired unit.
    pub wrote: bool,
    /// This apply stopped the instance that ran before (its plan stops, and the failure came
    /// after the stop was asked for).
    pub stopped: bool,
    /// The desired unit ran, verified and ready, before (in the history or as the last good).
    pub verified_before: bool,
    pub last_good: LastGood,
    /// The spec's `policy.rollback`.
    pub rollback: bool,
}

/// The decision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Recovery {
    /// Put the last good unit back, by the same sequence, and prove it serves: a rollback (the
    /// spec failed), or after a host fault (written only when the unit file on disk is not
    /// already it).
    Restore(Restore),
    /// Leave the service as it is and reconcile again with backoff (nothing was stopped, or the
    /// desired unit is known good and crashed once).
    Retry,
    /// Nothing safe can be started; the service stays stopped, for this reason.
    LeaveStopped(&'static str),
}

/// Why the last good unit is put back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Restore {
    /// The new unit failed (a rollback): the instance stopped is the failed one (journal action
    /// `rollback`).
    Rollback,
    /// The host failed after the stop: nothing of the new unit ran (journal action `restore`).
    HostFault,
}

/// Everything decided after a failed step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    pub recovery: Recovery,
    /// The desired hash is quarantined.
    pub quarantine: bool,
    /// The apply is over (its `in_progress` record goes). A host fault after the stop leaves it
    /// in progress, so that the next reconcile finishes it whatever the drift policy.
    pub finished: bool,
    /// Reconcile again after a while (the agent backs off from there); otherwise only a change
    /// brings this unit back (a quarantined hash is never retried).
    pub requeue: bool,
}

/// What follows a failed step: the whole decision, pure.
pub fn after(f: &Failure) -> Decision {
    let quarantine = quarantine(f);
    Decision { recovery: decide(f), quarantine, finished: f.fault.of_spec() || !f.stopped, requeue: !quarantine }
}

/// A start request that returned an error, by what systemd says of the unit after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailedStart {
    /// The unit is up or coming up: the request failed (a timeout), not the start.
    Runs,
    /// systemd started a new instance of the unit and it failed: the spec's fault.
    Unit,
    /// No new instance: the request never reached the unit (the host's fault).
    Host,
}

/// `new_instance`: the unit's invocation ID is not the one before the start.
pub fn failed_start(active: ActiveState, new_instance: bool) -> FailedStart {
    if active.is_up() {
        FailedStart::Runs
    } else if new_instance {
        FailedStart::Unit
    } else {
        FailedStart::Host
    }
}

/// A death of the server specd started that takes a failed step off the spec's account: no
/// verdict on a unit that passed verification before ([`FaultKind::Crashed`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Death {
    /// It had answered ready, and its process is gone (or systemd runs another one now): it
    /// crashed after readiness.
    AfterReady,
    /// SIGKILL or SIGTERM from outside (a person, a script, an OOM killer systemd did not see)
    /// while it started or loaded: it may have answered ready to someone else a moment before
    /// specd asked. Not when the server said a fatal error of its own (see [`excuses`]).
    FromOutside,
}

/// What is found of the server once a step after its start failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Found<'a> {
    /// The pid that answered ready, and whether it still runs (`None`: it never answered).
    pub ready: Option<(u32, bool)>,
    /// systemd's `MainPID`, `Result`, `ExecMainCode` and `ExecMainStatus` now.
    pub main_pid: u32,
    pub result: &'a ServiceResult,
    pub exec_main_code: u32,
    pub exec_main_status: i32,
}

/// Whether a failed step is looked at again for a [`Death`] (systemd and the process table
/// asked): the server had answered ready (`ready`), or the spec's server failed to start or load
/// (a kill from outside looks like that). A cancelled step is never.
pub fn may_be_a_death(step: Step, fault: FaultKind, ready: bool) -> bool {
    ready || (fault.of_spec() && matches!(step, Step::VerifyCmdline | Step::WaitReady))
}

/// The death that may take a failed step off the spec's account, from what was found.
pub fn death(step: Step, fault: FaultKind, found: &Found) -> Option<Death> {
    match found.ready {
        Some((pid, alive)) => {
            let replaced = found.main_pid != 0 && found.main_pid != pid;
            (!alive || replaced).then_some(Death::AfterReady)
        }
        None => (may_be_a_death(step, fault, false) && killed_from_outside(found)).then_some(Death::FromOutside),
    }
}

/// Whether `death` takes the failure off the spec's account: a crash after readiness always; a
/// kill from outside unless the server said a fatal error of its own first (SGLang kills its
/// own process tree with SIGKILL when a child fails to load).
pub fn excuses(death: Death, said_own_error: bool) -> bool {
    match death {
        Death::AfterReady => true,
        Death::FromOutside => !said_own_error,
    }
}

/// The server's end was a SIGKILL or SIGTERM (`Result=signal`, killed: code 2) that did not
/// come from its own error: the engines exit with a status when they fail.
fn killed_from_outside(f: &Found) -> bool {
    *f.result == ServiceResult::Signal && f.exec_main_code == 2 && matches!(f.exec_main_status, 9 | 15)
}

/// Steps after which the instance that ran before is gone.
fn after_stop(step: Step) -> bool {
    !matches!(step, Step::Drain | Step::Stop)
}

/// Whether the desired hash is quarantined (never retried until a new hash or `unquarantine`).
/// Only a unit this run wrote and whose server failed is; a unit that passed verification before
/// is not condemned by one crash after readiness.
pub fn quarantine(f: &Failure) -> bool {
    f.fault.of_spec() && f.wrote && !(f.fault == FaultKind::Crashed && f.verified_before)
}

pub fn decide(f: &Failure) -> Recovery {
    if !f.stopped || !after_stop(f.step) {
        return Recovery::Retry;
    }
    if f.step == Step::WaitStopped {
        // Processes of the old instance linger (or systemd would not settle): nothing new is
        // started over them.
        return Recovery::LeaveStopped("the old instance did not stop cleanly, so nothing is started over it");
    }
    if quarantine(f) {
        return match (f.rollback, f.last_good == LastGood::Other) {
            (true, true) => Recovery::Restore(Restore::Rollback),
            (true, false) => Recovery::LeaveStopped("there is no last good unit to roll back to"),
            (false, _) => Recovery::LeaveStopped("rollback is off"),
        };
    }
    if f.fault.of_spec() {
        // The desired unit ran before (it is not quarantined): systemd's Restart= and the next
        // reconcile retry it, with backoff.
        return Recovery::Retry;
    }
    // The host failed between the stop and the new instance: fail safe, the old one serves again.
    if f.last_good != LastGood::None {
        Recovery::Restore(Restore::HostFault)
    } else {
        Recovery::LeaveStopped("there is no last good unit to start again")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(step: Step) -> Failure {
        Failure {
            step,
            fault: FaultKind::Host,
            wrote: true,
            stopped: true,
            verified_before: false,
            last_good: LastGood::Other,
            rollback: true,
        }
    }

    #[test]
    fn a_spec_that_fails_is_quarantined_and_rolled_back() {
        let x = Failure { fault: FaultKind::Spec, ..f(Step::WaitReady) };
        assert!(quarantine(&x));
        assert_eq!(decide(&x), Recovery::Restore(Restore::Rollback));
        assert_eq!(
            decide(&Failure { last_good: LastGood::Desired, ..x }),
            Recovery::LeaveStopped("there is no last good unit to roll back to")
        );
        assert_eq!(decide(&Failure { rollback: false, ..x }), Recovery::LeaveStopped("rollback is off"));
    }

    #[test]
    fn a_known_good_unit_that_crashes_after_readiness_is_retried_not_quarantined() {
        let x = Failure { fault: FaultKind::Crashed, verified_before: true, ..f(Step::VerifyArgs) };
        assert!(!quarantine(&x));
        assert_eq!(decide(&x), Recovery::Retry);
        // Never verified: one crash after readiness is its failure.
        let new = Failure { verified_before: false, ..x };
        assert!(quarantine(&new));
        assert_eq!(decide(&new), Recovery::Restore(Restore::Rollback));
        // Verified before but failing before readiness: quarantined as any failing unit.
        assert!(quarantine(&Failure { fault: FaultKind::Spec, ..x }));
    }

    #[test]
    fn a_host_fault_after_the_stop_starts_the_last_good_unit_again() {
        for step in [Step::RemoveDropIns, Step::WriteUnit, Step::Reload, Step::Start] {
            let x = f(step);
            assert!(!quarantine(&x));
            assert_eq!(decide(&x), Recovery::Restore(Restore::HostFault), "{step:?}");
            // Whatever the rollback policy, and even when the last good unit is the desired one.
            assert_eq!(
                decide(&Failure { rollback: false, last_good: LastGood::Desired, ..x }),
                Recovery::Restore(Restore::HostFault)
            );
            assert_eq!(
                decide(&Failure { last_good: LastGood::None, ..x }),
                Recovery::LeaveStopped("there is no last good unit to start again")
            );
        }
    }

    #[test]
    fn a_quarantined_hash_waits_for_a_change_and_a_host_fault_leaves_the_apply_to_finish() {
        let spec = after(&Failure { fault: FaultKind::Spec, ..f(Step::WaitReady) });
        assert_eq!((spec.quarantine, spec.finished, spec.requeue), (true, true, false));
        let host = after(&f(Step::WriteUnit));
        assert_eq!(
            (host.recovery, host.quarantine, host.finished, host.requeue),
            (Recovery::Restore(Restore::HostFault), false, false, true)
        );
        // Nothing was stopped: nothing to finish, and it is tried again.
        let before_stop = after(&Failure { stopped: false, ..f(Step::Stop) });
        assert_eq!((before_stop.finished, before_stop.requeue), (true, true));
    }

    #[test]
    fn a_failed_start_request_is_the_unit_s_fault_only_when_systemd_started_it() {
        assert_eq!(failed_start(ActiveState::Failed, true), FailedStart::Unit);
        assert_eq!(failed_start(ActiveState::Inactive, true), FailedStart::Unit);
        assert_eq!(failed_start(ActiveState::Activating, true), FailedStart::Runs);
        assert_eq!(failed_start(ActiveState::Active, false), FailedStart::Runs);
        // A unit that failed before (its Result is still the old one) and was not started again.
        assert_eq!(failed_start(ActiveState::Failed, false), FailedStart::Host);
        assert_eq!(failed_start(ActiveState::Unknown, false), FailedStart::Host);
    }

    #[test]
    fn nothing_is_started_over_a_lingering_instance_and_nothing_stopped_is_left_alone() {
        assert!(matches!(decide(&f(Step::WaitStopped)), Recovery::LeaveStopped(_)));
        assert_eq!(decide(&f(Step::Stop)), Recovery::Retry);
        assert_eq!(decide(&f(Step::Drain)), Recovery::Retry);
        // A plan that only starts a stopped service stops nothing.
        assert_eq!(decide(&Failure { stopped: false, ..f(Step::Start) }), Recovery::Retry);
        let spec = Failure { stopped: false, fault: FaultKind::Spec, wrote: false, ..f(Step::WaitReady) };
        assert_eq!(decide(&spec), Recovery::Retry);
    }

    #[test]
    fn the_last_good_unit_is_told_apart_from_the_desired_one() {
        assert_eq!(LastGood::of(None, "a"), LastGood::None);
        assert_eq!(LastGood::of(Some("a"), "a"), LastGood::Desired);
        assert_eq!(LastGood::of(Some("b"), "a"), LastGood::Other);
        assert!(FaultKind::Spec.of_spec() && FaultKind::Crashed.of_spec() && !FaultKind::Host.of_spec());
    }

    fn found(ready: Option<(u32, bool)>, main_pid: u32, result: &ServiceResult, signal: i32) -> Found<'_> {
        Found { ready, main_pid, result, exec_main_code: if signal > 0 { 2 } else { 1 }, exec_main_status: signal }
    }

    #[test]
    fn a_server_gone_or_replaced_after_it_answered_ready_crashed_after_readiness() {
        let (signal, exit) = (ServiceResult::Signal, ServiceResult::ExitCode);
        for step in [Step::VerifyArgs, Step::VerifySpeculation, Step::Enable] {
            for fault in [FaultKind::Spec, FaultKind::Host] {
                // Gone, whatever its end; or systemd restarted it (another main pid).
                assert_eq!(death(step, fault, &found(Some((7, false)), 0, &exit, 0)), Some(Death::AfterReady));
                assert_eq!(death(step, fault, &found(Some((7, true)), 8, &signal, 9)), Some(Death::AfterReady));
                // It still runs: the step's failure stands (a wrong arg is the spec's).
                assert_eq!(death(step, fault, &found(Some((7, true)), 7, &exit, 0)), None);
                assert_eq!(death(step, fault, &found(Some((7, true)), 0, &exit, 0)), None);
            }
        }
        assert!(may_be_a_death(Step::VerifyArgs, FaultKind::Host, true));
        assert!(excuses(Death::AfterReady, true) && excuses(Death::AfterReady, false));
    }

    #[test]
    fn a_server_killed_from_outside_while_it_loads_is_no_verdict_unless_it_said_its_own_error() {
        let signal = ServiceResult::Signal;
        for step in [Step::VerifyCmdline, Step::WaitReady] {
            for sig in [9, 15] {
                assert_eq!(death(step, FaultKind::Spec, &found(None, 0, &signal, sig)), Some(Death::FromOutside));
            }
            // Its own exit, a signal it raised itself (SIGABRT, SIGSEGV), or systemd's timeout.
            assert_eq!(death(step, FaultKind::Spec, &found(None, 0, &ServiceResult::ExitCode, 0)), None);
            assert_eq!(death(step, FaultKind::Spec, &found(None, 0, &ServiceResult::CoreDump, 6)), None);
            assert_eq!(death(step, FaultKind::Spec, &found(None, 0, &signal, 11)), None);
            assert_eq!(death(step, FaultKind::Spec, &found(None, 0, &ServiceResult::Timeout, 9)), None);
            // The host's failure is never the server's death.
            assert!(!may_be_a_death(step, FaultKind::Host, false));
            assert_eq!(death(step, FaultKind::Host, &found(None, 0, &signal, 9)), None);
        }
        // Before the start, or a check after readiness the server never reached: not looked at.
        for step in [Step::Start, Step::Reload, Step::VerifyArgs] {
            assert!(!may_be_a_death(step, FaultKind::Spec, false));
            assert_eq!(death(step, FaultKind::Spec, &found(None, 0, &signal, 9)), None);
        }
        // SGLang SIGKILLs its own tree when a child fails: its words say so, and the kill stands.
        assert!(excuses(Death::FromOutside, false));
        assert!(!excuses(Death::FromOutside, true));
    }
}
