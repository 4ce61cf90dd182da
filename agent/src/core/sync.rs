//! A unit's sync status as specd says it (the agent's metrics, `specd status`, `specd apply`'s
//! JSON), and whether the unit runs its spec (the exit code of `apply` and `rollback`): pure,
//! one place each, from what `plan` found and what the reconcile did.

use serde::Serialize;

use crate::core::record::{HistoryEntry, LastEnded, Outcome};
use crate::core::unit_state::{ActiveState, SubState};

/// A unit's sync status.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum SyncStatus {
    InSync,
    OutOfSync,
    Drifted,
    Progressing,
    Failed,
    /// systemd has the unit masked (`LoadState=masked`): specd changes nothing and never unmasks.
    Masked,
}

impl SyncStatus {
    /// Every status, in the order the metrics list them.
    pub const ALL: [SyncStatus; 6] = [
        SyncStatus::InSync,
        SyncStatus::OutOfSync,
        SyncStatus::Drifted,
        SyncStatus::Progressing,
        SyncStatus::Failed,
        SyncStatus::Masked,
    ];
}

impl std::fmt::Display for SyncStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SyncStatus::InSync => "InSync",
            SyncStatus::OutOfSync => "OutOfSync",
            SyncStatus::Drifted => "Drifted",
            SyncStatus::Progressing => "Progressing",
            SyncStatus::Failed => "Failed",
            SyncStatus::Masked => "Masked",
        })
    }
}

/// What is known of a unit when its sync status is said.
#[derive(Clone, Copy, Debug)]
pub struct Seen {
    /// What the plan found when it looked (`plan::plan`).
    pub planned: SyncStatus,
    /// What the reconcile that looked did (`None`: nothing, or a look without a reconcile).
    pub outcome: Option<Outcome>,
    /// Another process applies the unit now (it holds the unit's lock).
    pub applying: bool,
    /// The unit's newest history entry, when it is about the desired unit: how its last try
    /// ended.
    pub last_try: Option<Outcome>,
}

/// The sync status after what was seen: what a reconcile did decides (its result, not the
/// status it started from); else an apply in progress; else a last try of the desired unit
/// that failed, was rolled back or refused (unless the plan finds an apply to finish); else
/// the plan's.
pub fn status(s: Seen) -> SyncStatus {
    match s.outcome {
        Some(Outcome::Applied | Outcome::Started) => return SyncStatus::InSync,
        // A refusal: the desired unit does not run (looked at again now and then).
        Some(Outcome::RolledBack | Outcome::Failed | Outcome::Refused) => return SyncStatus::Failed,
        Some(Outcome::Reported) => return SyncStatus::Drifted,
        Some(Outcome::Unquarantined | Outcome::HoldSet | Outcome::HoldCleared) | None => {}
    }
    if s.applying || s.planned == SyncStatus::Progressing {
        return SyncStatus::Progressing;
    }
    match s.last_try {
        Some(o) if failed_try(o) => SyncStatus::Failed,
        _ => s.planned,
    }
}

/// A try of a unit that did not leave it running: it failed, was rolled back or refused.
pub fn failed_try(o: Outcome) -> bool {
    matches!(o, Outcome::Failed | Outcome::RolledBack | Outcome::Refused)
}

/// The unit runs its spec after a reconcile: it applied or started it, or found it in sync and
/// did nothing.
pub fn runs_spec(outcome: Option<Outcome>, planned: SyncStatus) -> bool {
    match outcome {
        Some(o) => matches!(o, Outcome::Applied | Outcome::Started),
        None => planned == SyncStatus::InSync,
    }
}

/// Why a unit that is down is down, as `status` says it: the last try's message when that try
/// failed (`Failed`: its message says what it left running); a rollback's says the old unit
/// served again, so a unit down since is down for another reason, which systemd's state says.
pub fn down_reason(last: Option<&HistoryEntry>, active: ActiveState, sub: &SubState) -> String {
    match last {
        Some(h) if h.outcome == Outcome::Failed => h.message.clone(),
        _ => format!("the service is not running ({active}/{sub})"),
    }
}

/// How the unit's last instance ended, from specd's record: the recorded verdict while the
/// instance started after it is still the unit's current one and runs (a main process). `None`:
/// the record does not say (no record, another instance since, or that instance ended too:
/// systemd keeps a stopped unit's InvocationID, and a dead one's until `Restart=` starts the
/// next), and the journal must be read.
pub fn recorded_ending(
    rec: Option<&LastEnded>,
    invocation_id: &str,
    active: ActiveState,
    main_pid: u32,
) -> Option<Option<String>> {
    rec.filter(|l| !invocation_id.is_empty() && l.followed_by == invocation_id && active.may_run() && main_pid > 0)
        .map(|l| l.summary.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL_OUTCOMES: [Outcome; 9] = [
        Outcome::Applied,
        Outcome::Started,
        Outcome::RolledBack,
        Outcome::Failed,
        Outcome::Reported,
        Outcome::Unquarantined,
        Outcome::HoldSet,
        Outcome::HoldCleared,
        Outcome::Refused,
    ];

    #[test]
    fn what_a_reconcile_did_decides_the_status_after_it() {
        for planned in SyncStatus::ALL {
            for applying in [false, true] {
                for last_try in [None, Some(Outcome::Failed), Some(Outcome::Applied)] {
                    let at = |outcome| status(Seen { planned, outcome: Some(outcome), applying, last_try });
                    assert_eq!(at(Outcome::Applied), SyncStatus::InSync);
                    assert_eq!(at(Outcome::Started), SyncStatus::InSync);
                    assert_eq!(at(Outcome::RolledBack), SyncStatus::Failed);
                    assert_eq!(at(Outcome::Failed), SyncStatus::Failed);
                    assert_eq!(at(Outcome::Refused), SyncStatus::Failed);
                    assert_eq!(at(Outcome::Reported), SyncStatus::Drifted);
                }
            }
        }
    }

    #[test]
    fn without_a_result_an_apply_in_progress_then_a_failed_last_try_then_the_plan() {
        for planned in SyncStatus::ALL {
            for outcome in [None, Some(Outcome::HoldCleared), Some(Outcome::Unquarantined), Some(Outcome::HoldSet)] {
                let seen = Seen { planned, outcome, applying: false, last_try: None };
                assert_eq!(status(seen), planned, "{seen:?}");
                assert_eq!(status(Seen { applying: true, ..seen }), SyncStatus::Progressing, "{seen:?}");
                for failed in [Outcome::Failed, Outcome::RolledBack, Outcome::Refused] {
                    let want = if planned == SyncStatus::Progressing { planned } else { SyncStatus::Failed };
                    assert_eq!(status(Seen { last_try: Some(failed), ..seen }), want, "{seen:?}");
                }
                for fine in [Outcome::Applied, Outcome::Started, Outcome::Reported, Outcome::HoldCleared] {
                    assert_eq!(status(Seen { last_try: Some(fine), ..seen }), planned, "{seen:?}");
                }
            }
        }
    }

    #[test]
    fn a_unit_runs_its_spec_when_applied_started_or_found_in_sync() {
        for planned in SyncStatus::ALL {
            assert_eq!(runs_spec(None, planned), planned == SyncStatus::InSync, "{planned:?}");
            for o in ALL_OUTCOMES {
                let want = matches!(o, Outcome::Applied | Outcome::Started);
                assert_eq!(runs_spec(Some(o), planned), want, "{o:?} {planned:?}");
            }
        }
    }

    #[test]
    fn a_down_unit_is_down_for_its_failed_try_else_for_what_systemd_says() {
        let sub = SubState::parse("dead");
        let try_of = |outcome| HistoryEntry {
            time: 1,
            sha256: "a".into(),
            source: None,
            outcome,
            message: "the try's message".into(),
            stop_verdict: None,
            duration_ms: 0,
            startup: None,
        };
        let plain = "the service is not running (inactive/dead)";
        assert_eq!(down_reason(None, ActiveState::Inactive, &sub), plain);
        for o in ALL_OUTCOMES {
            let want = if o == Outcome::Failed { "the try's message" } else { plain };
            assert_eq!(down_reason(Some(&try_of(o)), ActiveState::Inactive, &sub), want, "{o:?}");
        }
    }

    #[test]
    fn the_recorded_ending_holds_only_while_the_instance_after_it_is_current_and_may_run() {
        let rec = LastEnded { summary: Some("crash: exit status 1".into()), followed_by: "b".into() };
        let said = Some(Some("crash: exit status 1".to_string()));
        assert_eq!(recorded_ending(Some(&rec), "b", ActiveState::Active, 7), said);
        assert_eq!(recorded_ending(Some(&rec), "b", ActiveState::Deactivating, 7), said);
        // The instance that followed stopped too (systemd keeps its InvocationID): the journal.
        assert_eq!(recorded_ending(Some(&rec), "b", ActiveState::Inactive, 0), None);
        assert_eq!(recorded_ending(Some(&rec), "b", ActiveState::Failed, 0), None);
        // It died and waits for `Restart=` (activating, auto-restart: no main process yet).
        assert_eq!(recorded_ending(Some(&rec), "b", ActiveState::Activating, 0), None);
        // Another instance since, none at all, no record.
        assert_eq!(recorded_ending(Some(&rec), "c", ActiveState::Active, 7), None);
        assert_eq!(recorded_ending(Some(&rec), "", ActiveState::Active, 7), None);
        assert_eq!(recorded_ending(None, "b", ActiveState::Active, 7), None);
        // The unit's first instance: nothing ended before it.
        let first = LastEnded { summary: None, followed_by: "b".into() };
        assert_eq!(recorded_ending(Some(&first), "b", ActiveState::Active, 7), Some(None));
    }
}
