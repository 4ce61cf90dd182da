use super::*;
use crate::core::record::{InProgress, Quarantined};
use crate::core::recovery::{self, Failure};

const SHA: &str = "aaaaaaaaaaaa0000000000000000000000000000000000000000000000000000";
const GOOD: &str = "bbbbbbbbbbbb0000000000000000000000000000000000000000000000000000";

fn subject() -> Subject<'static> {
    Subject {
        unit: "q.service",
        sha256: SHA,
        text: "[Service]\nExecStart=/bin/server\n",
        source: None,
        endpoint: "/health",
        base_url: "http://127.0.0.1:30000".into(),
    }
}

fn plan(sync: SyncStatus, steps: &[Step]) -> Plan {
    Plan {
        sync,
        reasons: vec!["the unit file differs".into()],
        steps: steps.to_vec(),
        toward: crate::core::plan::Toward::Desired,
    }
}

fn in_progress(sha: &str) -> InProgress {
    InProgress {
        sha256: sha.into(),
        pid: 1,
        phase: crate::core::record::Phase::At(Step::Start),
        started: 1,
        wrote: true,
    }
}

fn entry(outcome: Outcome, message: &str) -> HistoryEntry {
    HistoryEntry {
        time: 1,
        sha256: SHA.into(),
        source: None,
        outcome,
        message: message.into(),
        stop_verdict: None,
        duration_ms: 0,
        startup: None,
    }
}

/// What systemd says of a unit whose start failed.
fn down() -> Serving {
    Serving::of(Some((ActiveState::Failed, SubState::Failed)))
}

fn decision(spec_fault: bool, stopped: bool, good: bool) -> Decision {
    recovery::after(&Failure {
        step: Step::WaitReady,
        fault: if spec_fault { recovery::FaultKind::Spec } else { recovery::FaultKind::Host },
        wrote: true,
        stopped,
        verified_before: false,
        last_good: if good { recovery::LastGood::Other } else { recovery::LastGood::None },
        rollback: true,
    })
}

#[test]
fn an_apply_that_replaced_something_is_applied_and_one_that_only_started_is_started() {
    let s = subject();
    for (steps, want) in [
        (&[Step::WriteUnit, Step::Reload, Step::Start, Step::WaitReady][..], Outcome::Applied),
        (&[Step::Drain, Step::Stop, Step::WaitStopped, Step::Start, Step::WaitReady][..], Outcome::Applied),
        (&[Step::Start, Step::VerifyCmdline, Step::WaitReady][..], Outcome::Started),
    ] {
        let c = applied(&plan(SyncStatus::OutOfSync, steps), &s, 12_345, false);
        assert_eq!(c.outcome, Some(want), "{steps:?}");
        assert_eq!(c.verdict, "Applied: q.service runs unit aaaaaaaaaaaa (no source), verified and ready in 12.3s");
        assert_eq!(
            c.change,
            Change { finished: true, good: true, record: Some(want), serving: After::Ready, ..Change::default() }
        );
        assert_eq!(c.action, Action::AwaitChange);
        assert!(c.acted && !c.refused);
    }
}

#[test]
fn an_interrupted_apply_finished_by_the_next_run_is_applied_in_the_history_as_in_its_verdict() {
    let s = subject();
    // The next run only had to verify what the interrupted one started: still an apply.
    let c = applied(&plan(SyncStatus::OutOfSync, &[Step::VerifyCmdline, Step::WaitReady]), &s, 500, true);
    assert_eq!((c.outcome, c.change.record), (Some(Outcome::Applied), Some(Outcome::Applied)));
    assert!(c.verdict.starts_with("Applied: "), "{}", c.verdict);
    // Nothing left to do at all: the apply is over, recorded as applied, the unit good.
    let st = UnitState { in_progress: Some(in_progress(SHA)), ..UnitState::default() };
    let c = settled(&st, &plan(SyncStatus::InSync, &[]), &s, &Observed::default());
    assert_eq!((c.outcome, c.change.record), (Some(Outcome::Applied), Some(Outcome::Applied)));
    assert!(c.change.finished && c.change.good);
    assert_eq!(
        c.verdict,
        "Applied: q.service runs unit aaaaaaaaaaaa (no source) and is ready: the apply specd was interrupted in is finished"
    );
}

#[test]
fn a_rollback_interrupted_while_the_last_good_unit_loads_is_recorded_when_the_next_run_finds_it_running() {
    let s = subject();
    let st = UnitState {
        in_progress: Some(in_progress(SHA)),
        quarantine: vec![Quarantined {
            sha256: SHA.into(),
            reason: "did not become ready".into(),
            source: None,
            time: 1,
        }],
        ..UnitState::default()
    };
    let quarantined = plan(SyncStatus::Failed, &[]);
    let good_runs = Observed {
        deployed_sha256: Some(GOOD.into()),
        last_good_sha256: Some(GOOD.into()),
        quarantined: Some("did not become ready".into()),
        active_state: ActiveState::Activating,
        main_pid: 42,
        ..Observed::default()
    };
    let c = settled(&st, &quarantined, &s, &good_runs);
    assert_eq!((c.outcome, c.change.record), (Some(Outcome::RolledBack), Some(Outcome::RolledBack)));
    assert!(c.change.finished);
    assert_eq!(
        c.verdict,
        "RolledBack: q.service: the last good unit bbbbbbbbbbbb runs again (the rollback specd was interrupted in is finished); spec aaaaaaaaaaaa stays quarantined"
    );
    // Still loading: its load balancers keep `drain`, and it is looked at again until it serves.
    assert_eq!((c.change.serving.clone(), c.action), (After::Keep, Action::Requeue(timing::PROGRESSING_AGAIN)));
    let ready = Observed { ready: Some(true), active_state: ActiveState::Active, ..good_runs.clone() };
    let c = settled(&st, &quarantined, &s, &ready);
    assert_eq!((c.change.serving, c.action), (After::Ready, Action::AwaitChange));
    // Recorded once: the run after has nothing in progress.
    let after = UnitState { in_progress: None, ..st.clone() };
    assert_eq!(settled(&after, &quarantined, &s, &good_runs).outcome, None);
    // Nothing runs: no rollback to record.
    let stopped = Observed { active_state: ActiveState::Inactive, main_pid: 0, ..good_runs };
    assert_eq!(settled(&st, &quarantined, &s, &stopped).outcome, None);
}

#[test]
fn applying_a_conclusion_changes_the_record_as_it_says() {
    let s = subject();
    let mut st = UnitState { in_progress: Some(in_progress(SHA)), ..UnitState::default() };
    let c = applied(&plan(SyncStatus::OutOfSync, &[Step::WriteUnit, Step::Start]), &s, 1000, false);
    c.apply(&mut st, &s, Some("stopped by SIGKILL".into()), 1000, 42);
    assert!(st.in_progress.is_none());
    let g = st.last_good.as_ref().unwrap();
    assert_eq!((g.sha256.as_str(), g.time, g.base_url.as_deref()), (SHA, 42, Some("http://127.0.0.1:30000")));
    let h = st.history.last().unwrap();
    assert_eq!(
        (h.outcome, h.message.as_str(), h.stop_verdict.as_deref()),
        (Outcome::Applied, c.verdict.as_str(), Some("stopped by SIGKILL"))
    );
    assert_eq!((h.time, h.duration_ms), (42, 1000));
    // Nothing recorded, nothing changed.
    let mut st2 = UnitState::default();
    interrupted(Step::Start, Cancelled::Started).apply(&mut st2, &s, None, 0, 42);
    assert_eq!(st2.history.len(), 0);
}

#[test]
fn an_interrupted_apply_stays_in_progress_once_it_changed_something() {
    let c = interrupted(Step::Stop, Cancelled::Unchanged);
    assert!(c.change.finished && c.outcome.is_none());
    assert_eq!(c.verdict, "Interrupted before Stop: specd is stopping; nothing was changed on the host");
    let c = interrupted(Step::WaitReady, Cancelled::Started);
    assert!(!c.change.finished && c.outcome.is_none() && c.change.record.is_none());
    assert!(c.verdict.contains("the next run finishes this apply"), "{}", c.verdict);
}

#[test]
fn a_refusal_is_recorded_once_and_looked_at_again_later() {
    let v = cannot_start("q.service", SHA, "/m: no such file or directory");
    assert_eq!(
        v,
        "Refused: q.service: unit aaaaaaaaaaaa cannot start on this host: /m: no such file or directory; nothing was stopped or changed"
    );
    let st = UnitState::default();
    let first = refused(&st, v.clone());
    assert_eq!((first.outcome, first.change.record), (Some(Outcome::Refused), Some(Outcome::Refused)));
    assert_eq!(first.action, Action::Requeue(timing::PREFLIGHT_AGAIN));
    assert!(first.refused && !first.acted);
    let st = UnitState { history: vec![entry(Outcome::Refused, &v)], ..UnitState::default() };
    let again = refused(&st, v.clone());
    assert_eq!((again.outcome, again.change.record), (None, None));
    assert!(again.refused);
    // Another reason is news.
    let other = refused(&st, format!("{v}!"));
    assert_eq!(other.outcome, Some(Outcome::Refused));
}

#[test]
fn settling_records_a_drift_once_a_recovery_and_a_unit_found_good() {
    let s = subject();
    let drift = plan(SyncStatus::Drifted, &[]);
    let st = UnitState::default();
    let c = settled(&st, &drift, &s, &Observed::default());
    assert_eq!((c.outcome, c.change.record), (Some(Outcome::Reported), Some(Outcome::Reported)));
    assert_eq!(c.verdict, "Drifted: the unit file differs");
    let st = UnitState { history: vec![entry(Outcome::Reported, &c.verdict)], ..UnitState::default() };
    let again = settled(&st, &drift, &s, &Observed::default());
    assert_eq!((again.outcome, again.change.record), (Some(Outcome::Reported), None));

    // In sync after a failure of this unit: Started, recorded; found good, recorded as written.
    let st = UnitState { history: vec![entry(Outcome::Failed, "Failed")], ..UnitState::default() };
    let c = settled(&st, &plan(SyncStatus::InSync, &[]), &s, &Observed::default());
    assert_eq!(c.verdict, "InSync: q.service runs unit aaaaaaaaaaaa and is ready");
    assert_eq!(
        c.change,
        Change {
            good: true,
            written: true,
            record: Some(Outcome::Started),
            serving: After::Ready,
            ..Change::default()
        }
    );
    assert!(!c.acted);

    // Progressing: looked at again soon; an interrupted apply of this unit with nothing left is over,
    // not under a mask.
    let st = UnitState { in_progress: Some(in_progress(SHA)), ..UnitState::default() };
    let c = settled(&st, &plan(SyncStatus::Progressing, &[]), &s, &Observed::default());
    assert_eq!(c.action, Action::Requeue(timing::PROGRESSING_AGAIN));
    assert!(c.change.finished && c.outcome.is_none());
    assert!(!settled(&st, &plan(SyncStatus::Masked, &[]), &s, &Observed::default()).change.finished);
    let other = UnitState { in_progress: Some(in_progress(GOOD)), ..UnitState::default() };
    assert!(!settled(&other, &plan(SyncStatus::InSync, &[]), &s, &Observed::default()).change.finished);
}

#[test]
fn an_enablement_not_taken_yet_is_looked_at_again_and_one_taken_is_applied() {
    let p = plan(SyncStatus::OutOfSync, &[Step::Enable]);
    assert!(enablement_only(&p) && !enablement_only(&plan(SyncStatus::OutOfSync, &[Step::Enable, Step::Start])));
    for now in [None, Some(false)] {
        let c = enablement(&p, "q.service", true, now);
        assert_eq!(c.action, Action::Requeue(timing::ENABLEMENT_AGAIN));
        assert!(c.outcome.is_none() && c.change.finished && c.change.record.is_none());
        assert_eq!(c.verdict, "OutOfSync: the unit file differs; not changed yet");
    }
    let c = enablement(&p, "q.service", true, Some(true));
    assert_eq!((c.outcome, c.change.record), (Some(Outcome::Applied), Some(Outcome::Applied)));
    assert_eq!(c.verdict, "Applied: q.service starts at boot now (enabled); its server was left as it runs");
    let c = enablement(&plan(SyncStatus::OutOfSync, &[Step::Disable]), "q.service", false, Some(false));
    assert_eq!(c.verdict, "Applied: q.service no longer starts at boot (disabled); its server was left as it runs");
}

#[test]
fn nothing_done_is_said_and_refusals_are_marked() {
    let p = plan(SyncStatus::OutOfSync, &[Step::WriteUnit, Step::Start]);
    let r = observed_only(p.clone(), None, None);
    assert_eq!((r.verdict.as_str(), r.refused, r.outcome), ("OutOfSync: would run 2 steps", false, None));
    let r = observed_only(p.clone(), Some("suspended by alice".into()), None);
    assert_eq!(r.verdict, "OutOfSync: would run 2 steps (held: suspended by alice)");
    let r = observed_only(plan(SyncStatus::InSync, &[]), None, None);
    assert_eq!(r.verdict, "InSync: nothing to do");
    let r = observed_only(p.clone(), None, Some("Refused: q.service: cannot start".into()));
    assert!(r.refused && r.verdict.starts_with(REFUSED));
    let r = foreign(p, "q.service", "/etc/systemd/system/q.service was not written by specd");
    assert!(r.refused && r.outcome.is_none() && r.action == Action::AwaitChange);
    assert!(r.verdict.starts_with("Refused: q.service: /etc/systemd/system/q.service was not written by specd;"));
    let r = lock_interrupted("q.service");
    assert_eq!(r.plan.reasons, ["another specd is reconciling q.service"]);
    assert!(!r.refused && r.outcome.is_none());
}

#[test]
fn every_recovery_reads_as_what_happened_to_the_service() {
    let s = subject();
    let what = "WaitReady failed: exit status 1";
    let restored = |why, end| recovered(&s, what, &Recovered::Restored { why, good: GOOD.into(), end });
    let cases: Vec<((Outcome, String), Outcome, &str)> = vec![
        (
            recovered(&s, what, &Recovered::Retried { known_good: false }),
            Outcome::Failed,
            "Failed: q.service: WaitReady failed: exit status 1",
        ),
        (
            recovered(&s, what, &Recovered::Retried { known_good: true }),
            Outcome::Failed,
            "passed verification before, so one crash does not quarantine it",
        ),
        (
            recovered(&s, what, &Recovered::LeftStopped { why: "no good unit to go back to", quarantined: true }),
            Outcome::Failed,
            "; no good unit to go back to, so the service is left stopped; spec aaaaaaaaaaaa is quarantined",
        ),
        (recovered(&s, what, &Recovered::NoGoodUnit), Outcome::Failed, "Failed: q.service: WaitReady failed"),
        (
            restored(Restore::Rollback, Restored::Serving),
            Outcome::RolledBack,
            "RolledBack: q.service: WaitReady failed: exit status 1; restored the last good unit bbbbbbbbbbbb and it serves again; spec aaaaaaaaaaaa is quarantined",
        ),
        (
            restored(Restore::HostFault, Restored::Serving),
            Outcome::Failed,
            "started the last good unit bbbbbbbbbbbb again and it serves",
        ),
        (restored(Restore::Rollback, Restored::Cancelled(Step::Start)), Outcome::Failed, "the next run finishes it"),
        (restored(Restore::HostFault, Restored::Cancelled(Step::Start)), Outcome::Failed, "stopped at a safe point"),
        (
            restored(Restore::Rollback, Restored::Failed(Step::Start, "exit 1".into())),
            Outcome::Failed,
            "the rollback to bbbbbbbbbbbb failed too (Start: exit 1); the service is stopped",
        ),
        (
            restored(Restore::HostFault, Restored::Failed(Step::Start, "exit 1".into())),
            Outcome::Failed,
            "again failed too (Start: exit 1)",
        ),
    ];
    for ((outcome, verdict), want, says) in cases {
        assert_eq!(outcome, want, "{verdict}");
        assert!(verdict.contains(says), "{verdict}\n  does not say: {says}");
    }
    // Only a rollback that ended serving is RolledBack; "left stopped" says nothing of a quarantine
    // that did not happen.
    let (_, v) = recovered(&s, what, &Recovered::LeftStopped { why: "rollback: false", quarantined: false });
    assert!(!v.contains("quarantined"), "{v}");
}

#[test]
fn a_failed_apply_quotes_the_server_says_when_down_and_follows_the_decision() {
    let s = subject();
    // The spec's fault, rolled back: quarantined (with the server's words), over, not requeued.
    let d = decision(true, true, true);
    assert!(d.quarantine);
    let base = recovered(
        &s,
        "WaitReady failed: exit 1",
        &Recovered::Restored { why: Restore::Rollback, good: GOOD.into(), end: Restored::Serving },
    );
    let c = failed(&s, base, Some("ValueError: no config.json".into()), Serving::Up, &d);
    assert_eq!(c.outcome, Some(Outcome::RolledBack));
    assert!(c.verdict.ends_with("; the server said: ValueError: no config.json"), "{}", c.verdict);
    assert_eq!(c.change.quarantine_said.as_deref(), Some("ValueError: no config.json"));
    assert!(c.change.finished && c.action == Action::AwaitChange);
    let mut st = UnitState {
        quarantine: vec![Quarantined { sha256: SHA.into(), reason: "exit 1".into(), source: None, time: 1 }],
        in_progress: Some(in_progress(SHA)),
        ..UnitState::default()
    };
    c.apply(&mut st, &s, None, 5, 9);
    assert_eq!(st.quarantine[0].reason, "exit 1; the server said: ValueError: no config.json");
    assert!(st.in_progress.is_none());
    assert_eq!(st.history.last().unwrap().outcome, Outcome::RolledBack);

    // The host's fault after the stop: not quarantined, still in progress, looked at again.
    let d = decision(false, true, true);
    assert!(!d.quarantine && !d.finished && d.requeue);
    let c = failed(&s, (Outcome::Failed, "Failed: q.service: Start failed".into()), None, down(), &d);
    assert_eq!(c.action, Action::Requeue(timing::FAILED_AGAIN));
    assert!(!c.change.finished && c.change.quarantine_said.is_none());
    assert!(c.verdict.ends_with("; q.service is DOWN (failed/failed)"), "{}", c.verdict);
    // Words of the server with no quarantine are in the verdict only.
    let c = failed(&s, (Outcome::Failed, "Failed".into()), Some("boom".into()), Serving::Unknown, &d);
    assert!(c.change.quarantine_said.is_none() && c.verdict.contains("boom"));
}

#[test]
fn a_finished_rollback_says_whether_the_good_unit_serves() {
    let s = subject();
    let c = rollback_finished(&s, GOOD, &Restored::Serving, Serving::Up);
    assert_eq!(c.outcome, Some(Outcome::RolledBack));
    assert_eq!(
        c.verdict,
        "RolledBack: q.service: restored the last good unit bbbbbbbbbbbb; spec aaaaaaaaaaaa stays quarantined"
    );
    assert!(c.change.finished);
    let c = rollback_finished(&s, GOOD, &Restored::Failed(Step::Start, "exit 1".into()), down());
    assert_eq!(c.outcome, Some(Outcome::Failed));
    assert_eq!(
        c.verdict,
        "Failed: q.service: restoring the last good unit bbbbbbbbbbbb: Start failed: exit 1; q.service is DOWN (failed/failed)"
    );
    let c = rollback_finished(&s, GOOD, &Restored::Cancelled(Step::WaitReady), Serving::Unknown);
    assert!(c.verdict.ends_with("WaitReady failed: the agent is stopping"), "{}", c.verdict);
}

#[test]
fn a_failure_says_whether_the_old_unit_serves_or_the_service_is_down_and_only_down_is_in_the_verdict() {
    let s = subject();
    let host_fault = recovered(
        &s,
        "WriteUnit failed: disk full",
        &Recovered::Restored { why: Restore::HostFault, good: GOOD.into(), end: Restored::Serving },
    );
    // The host failed after the stop, and the last good unit serves again.
    let c = failed(&s, host_fault, None, Serving::Up, &decision(false, true, true));
    assert_eq!((c.outcome, c.serving.clone()), (Some(Outcome::Failed), Some(Serving::Up)));
    assert_eq!(
        c.verdict,
        "Failed: q.service: WriteUnit failed: disk full; started the last good unit bbbbbbbbbbbb again and it serves; unit aaaaaaaaaaaa is tried again later"
    );
    // Nothing to roll back to: down, and said so.
    let none = recovered(&s, "WaitReady failed: exit 1", &Recovered::NoGoodUnit);
    let c = failed(&s, none, None, down(), &decision(true, true, false));
    assert_eq!(c.outcome, Some(Outcome::Failed));
    assert_eq!(c.serving, Some(Serving::Down { active: ActiveState::Failed, sub: SubState::Failed }));
    assert_eq!(c.verdict, "Failed: q.service: WaitReady failed: exit 1; q.service is DOWN (failed/failed)");
    // Rolled back and serving; rolled back and its server died right after.
    let back = || {
        recovered(
            &s,
            "WaitReady failed: exit 1",
            &Recovered::Restored { why: Restore::Rollback, good: GOOD.into(), end: Restored::Serving },
        )
    };
    let c = failed(&s, back(), None, Serving::Up, &decision(true, true, true));
    assert_eq!((c.outcome, c.serving.clone()), (Some(Outcome::RolledBack), Some(Serving::Up)));
    assert!(!c.verdict.contains("DOWN"), "{}", c.verdict);
    let c = failed(&s, back(), None, down(), &decision(true, true, true));
    assert_eq!(c.outcome, Some(Outcome::RolledBack));
    assert!(matches!(c.serving, Some(Serving::Down { .. })));
    assert!(c.verdict.ends_with("is quarantined; q.service is DOWN (failed/failed)"), "{}", c.verdict);
    // systemd could not be asked: neither up nor down is claimed.
    let c = failed(&s, back(), None, Serving::Unknown, &decision(true, true, true));
    assert!(c.serving == Some(Serving::Unknown) && !c.verdict.contains("DOWN"), "{}", c.verdict);
    // The report carries it; a reconcile that did not fail asks nothing.
    assert_eq!(c.report(plan(SyncStatus::OutOfSync, &[Step::Start]), None).serving, Some(Serving::Unknown));
    let r =
        applied(&plan(SyncStatus::OutOfSync, &[Step::Start]), &s, 1, false).report(plan(SyncStatus::InSync, &[]), None);
    assert_eq!(r.serving, None);
}

#[test]
fn up_is_active_activating_or_reloading_and_anything_else_is_down() {
    for a in [ActiveState::Active, ActiveState::Activating, ActiveState::Reloading, ActiveState::Refreshing] {
        assert_eq!(Serving::of(Some((a, SubState::Running))), Serving::Up);
    }
    for a in [ActiveState::Inactive, ActiveState::Failed, ActiveState::Deactivating, ActiveState::Maintenance] {
        assert_eq!(Serving::of(Some((a, SubState::Dead))), Serving::Down { active: a, sub: SubState::Dead });
    }
    assert_eq!(Serving::of(None), Serving::Unknown);
}

/// What the unit's load balancers are told at the end of each kind of reconcile: ready only when
/// it runs a verified unit (applied, in sync, rolled back and serving), `drain` kept while an apply
/// or a restore stopped after its start (the next run finishes it), as observed when nothing was
/// changed, down otherwise.
#[test]
fn every_conclusion_tells_the_load_balancers_ready_only_for_a_verified_unit() {
    let s = subject();
    let st = UnitState::default();
    let o = Observed::default();
    let steps = [Step::Drain, Step::Stop, Step::WaitStopped, Step::WriteUnit, Step::Start, Step::WaitReady];
    let cases: Vec<(&str, Conclusion, After)> = vec![
        ("applied", applied(&plan(SyncStatus::OutOfSync, &steps), &s, 1, false), After::Ready),
        ("in sync", settled(&st, &plan(SyncStatus::InSync, &[]), &s, &o), After::Ready),
        ("progressing", settled(&st, &plan(SyncStatus::Progressing, &[]), &s, &o), After::Keep),
        ("drifted", settled(&st, &plan(SyncStatus::Drifted, &[]), &s, &o), After::Observed),
        ("refused", refused(&st, "Refused: x".into()), After::Observed),
        ("refused at the drain", refused_at_the_drain(&st, "Refused: x".into()), After::Observed),
        ("interrupted unchanged", interrupted(Step::Drain, Cancelled::Unchanged), After::Observed),
        ("interrupted after its start", interrupted(Step::WaitReady, Cancelled::Started), After::Keep),
        (
            "enabled",
            enablement(&plan(SyncStatus::OutOfSync, &[Step::Enable]), "q.service", true, Some(true)),
            After::Observed,
        ),
        ("rolled back", rollback_finished(&s, GOOD, &Restored::Serving, Serving::Up), After::Ready),
        ("rollback stopped", rollback_finished(&s, GOOD, &Restored::Cancelled(Step::Start), Serving::Up), After::Keep),
    ];
    for (what, c, want) in cases {
        assert_eq!(c.change.serving, want, "{what}: {}", c.verdict);
    }
    let failed = rollback_finished(&s, GOOD, &Restored::Failed(Step::Start, "exit 1".into()), down());
    assert_eq!(failed.change.serving, After::Down(failed.verdict.clone()));
    let restored = |end| Recovered::Restored { why: Restore::Rollback, good: GOOD.into(), end };
    assert_eq!(after_recovery(&restored(Restored::Serving), Some(&Serving::Up), "v"), After::Ready);
    assert_eq!(after_recovery(&restored(Restored::Serving), Some(&down()), "v"), After::Down("v".into()));
    assert_eq!(after_recovery(&restored(Restored::Cancelled(Step::Start)), None, "v"), After::Keep);
    for r in [
        Recovered::Retried { known_good: true },
        Recovered::NoGoodUnit,
        restored(Restored::Failed(Step::Start, "x".into())),
    ] {
        assert_eq!(after_recovery(&r, Some(&Serving::Up), "v"), After::Down("v".into()), "{r:?}");
    }
}
