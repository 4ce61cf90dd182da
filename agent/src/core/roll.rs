//! Replicas on one host rolled at most `max_unavailable` at a time: before a reconcile stops a
//! serving replica of a group (`spec.rollout.group`), whether it may go now, from its siblings'
//! serving states (what their load balancers are told) and whether a sibling's start of its
//! current change failed and was rolled back (the roll stops: the others keep their running spec).

use crate::core::record::{Outcome, UnitState};
use crate::core::serving::Word;

/// A replica of the same group, as the gate sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sibling {
    pub unit: String,
    /// Its serving state's word (`None`: it has none).
    pub state: Option<Word>,
    /// Its start of its current change failed and was rolled back (or failed): why.
    pub failed: Option<String>,
}

/// May this replica go down now?
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Roll {
    Go,
    /// Not yet: too many siblings are not serving (said as `waiting: ...`).
    Wait(String),
    /// The roll stopped: a sibling's start of its change failed; this replica keeps running.
    Hold(String),
}

/// The gate for a replica of `group` that serves now or not (`serving`: stopping one that does
/// not serve makes nothing less available), with `siblings` (the group's other replicas).
pub fn gate(group: &str, max_unavailable: u32, serving: bool, siblings: &[Sibling]) -> Roll {
    if let Some(s) = siblings.iter().find(|s| s.failed.is_some()) {
        return Roll::Hold(format!(
            "held: the roll of group {group} stopped: {}'s change failed and was rolled back ({}); this replica keeps its running spec until that replica's spec changes",
            s.unit,
            s.failed.as_deref().unwrap_or_default()
        ));
    }
    if !serving {
        return Roll::Go;
    }
    let down: Vec<&Sibling> = siblings.iter().filter(|s| s.state != Some(Word::Ready)).collect();
    let max = max_unavailable.max(1) as usize;
    if down.len() < max {
        return Roll::Go;
    }
    let names: Vec<String> = down
        .iter()
        .map(|s| match s.state {
            Some(w) => format!("{} is {w}", s.unit),
            None => format!("{} has no serving state", s.unit),
        })
        .collect();
    Roll::Wait(format!(
        "waiting: {} ({} of {} unavailable, max_unavailable {max})",
        names.join(", "),
        down.len(),
        siblings.len() + 1
    ))
}

/// Why a replica's current change failed and was rolled back (or failed), from its record: its
/// last apply was of the unit it still desires, and did not reach it.
pub fn failed_change(st: &UnitState) -> Option<String> {
    let desired = st.desired.as_ref()?;
    let last = st.history.iter().rev().find(|h| !matches!(h.outcome, Outcome::HoldSet | Outcome::HoldCleared))?;
    let failed = matches!(last.outcome, Outcome::RolledBack | Outcome::Failed);
    (failed && last.sha256 == desired.sha256).then(|| last.message.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sib(unit: &str, state: Option<Word>, failed: Option<&str>) -> Sibling {
        Sibling { unit: unit.into(), state, failed: failed.map(str::to_string) }
    }

    #[test]
    fn a_replica_goes_only_while_fewer_than_max_unavailable_siblings_do_not_serve() {
        use Word::*;
        let ready = |u| sib(u, Some(Ready), None);
        // (max_unavailable, serving, siblings, what the gate says)
        let cases: Vec<(u32, bool, Vec<Sibling>, Roll)> = vec![
            (1, true, vec![], Roll::Go),
            (1, true, vec![ready("llm-b")], Roll::Go),
            (
                1,
                true,
                vec![sib("llm-b", Some(Drain), None)],
                Roll::Wait("waiting: llm-b is drain (1 of 2 unavailable, max_unavailable 1)".into()),
            ),
            (
                1,
                true,
                vec![ready("llm-b"), sib("llm-c", Some(Down), None)],
                Roll::Wait("waiting: llm-c is down (1 of 3 unavailable, max_unavailable 1)".into()),
            ),
            (2, true, vec![ready("llm-b"), sib("llm-c", Some(Down), None)], Roll::Go),
            (
                2,
                true,
                vec![sib("llm-b", Some(Drain), None), sib("llm-c", None, None)],
                Roll::Wait(
                    "waiting: llm-b is drain, llm-c has no serving state (2 of 3 unavailable, max_unavailable 2)"
                        .into(),
                ),
            ),
            // Not serving itself: its stop makes nothing less available.
            (1, false, vec![sib("llm-b", Some(Drain), None)], Roll::Go),
            // 0 is refused by validation; taken as 1.
            (
                0,
                true,
                vec![sib("llm-b", Some(Down), None)],
                Roll::Wait("waiting: llm-b is down (1 of 2 unavailable, max_unavailable 1)".into()),
            ),
        ];
        for (max, serving, siblings, want) in cases {
            assert_eq!(gate("llm", max, serving, &siblings), want, "max {max}, serving {serving}, {siblings:?}");
        }
    }

    #[test]
    fn a_change_failed_is_the_last_apply_of_the_unit_still_desired_not_reached() {
        use crate::core::record::{DesiredRecord, HistoryEntry, UnitState};
        let yaml = "apiVersion: specd/v1\nkind: InferenceService\nmetadata: {name: q}\nspec: {unit: q.service, engine: sglang, model: /m}\n";
        let spec = specd_spec::parse("q.yaml", yaml).unwrap().resolve(None).unwrap();
        let entry = |sha: &str, outcome| HistoryEntry {
            time: 1,
            sha256: sha.into(),
            source: None,
            outcome,
            message: format!("{outcome:?} {sha}"),
            stop_verdict: None,
            duration_ms: 0,
            startup: None,
        };
        let st = |desired: &str, history: Vec<HistoryEntry>| UnitState {
            desired: Some(DesiredRecord { sha256: desired.into(), source: None, time: 1, spec: spec.clone() }),
            history,
            ..UnitState::default()
        };
        use Outcome::*;
        let cases: Vec<(UnitState, Option<&str>)> = vec![
            (st("new", vec![entry("old", Applied), entry("new", RolledBack)]), Some("RolledBack new")),
            (st("new", vec![entry("new", Failed)]), Some("Failed new")),
            // A hold set after it does not hide it.
            (st("new", vec![entry("new", RolledBack), entry("new", HoldSet)]), Some("RolledBack new")),
            // Its spec changed since: a new change, not failed (yet).
            (st("newer", vec![entry("new", RolledBack)]), None),
            (st("new", vec![entry("new", RolledBack), entry("new", Applied)]), None),
            (st("new", vec![entry("new", Refused)]), None),
            (st("new", vec![]), None),
            (UnitState::default(), None),
        ];
        for (st, want) in cases {
            assert_eq!(failed_change(&st).as_deref(), want, "{:?}", st.history);
        }
    }

    #[test]
    fn a_siblings_failed_change_holds_the_roll_whatever_serves() {
        for serving in [true, false] {
            let siblings = [sib("llm-a", Some(Word::Ready), Some("the server exited during load"))];
            match gate("llm", 2, serving, &siblings) {
                Roll::Hold(why) => {
                    assert!(why.contains("group llm stopped: llm-a's change failed"), "{why}");
                    assert!(why.contains("the server exited during load"), "{why}");
                }
                other => panic!("{other:?}"),
            }
        }
    }
}
