//! Replicas on one host rolled at most `max_unavailable` at a time: before a reconcile stops a
//! serving replica of a group (`spec.rollout.group`), whether it may go now, from its siblings'
//! serving states (what their load balancers are told) and whether a sibling's start of its
//! current change failed and was rolled back (the roll stops: the others keep their running spec).
//!
//! With `max_surge`, the group's spares (units saying `rollout.spare`, each its own free port and
//! GPU set) are its spare capacity: [`spare`] says whether one serves (the group changes) or is
//! held stopped (at rest, or the roll stopped), and [`gate`] lets the first old replica go only
//! once `max_surge` spares serve their verified new spec; they count as serving replicas, so with
//! `max_unavailable: 0` the group never serves with fewer than its replicas.

use crate::core::record::{Outcome, UnitState};
use crate::core::serving::Word;

/// A member of the same group (a replica or a spare), as the gate sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sibling {
    pub unit: String,
    /// Its serving state's word (`None`: it has none).
    pub state: Option<Word>,
    /// Told ready, its load balancers have taken it (`serving::taken`): only then it serves.
    pub taken: bool,
    /// Its start of its current change failed and was rolled back (or failed): why.
    pub failed: Option<String>,
    /// It is one of the group's spares.
    pub spare: bool,
    /// Its desired unit is not the last one it ran verified ([`changing`]).
    pub changing: bool,
    /// Its spec's `(max_unavailable, max_surge)`.
    pub limits: Limits,
}

impl Sibling {
    /// It serves: told ready, and its load balancers took it.
    fn serves(&self) -> bool {
        self.state == Some(Word::Ready) && self.taken
    }
}

/// A group's limits, as one member's spec says them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Limits {
    pub max_unavailable: u32,
    pub max_surge: u32,
}

impl From<&specd_spec::Rollout> for Limits {
    fn from(r: &specd_spec::Rollout) -> Limits {
        Limits { max_unavailable: r.max_unavailable, max_surge: r.max_surge }
    }
}

/// May this replica go down now?
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Roll {
    Go,
    /// Not yet: too many siblings are not serving, its spares do not serve yet, or the group's
    /// specs disagree on its limits (said as `waiting: ...`).
    Wait(String),
    /// The roll stopped: a sibling's start of its change failed; this replica keeps running.
    Hold(String),
}

/// The gate for a member of `group` whose spec says `limits`, that serves now or not
/// (`serving`: stopping one that does not serve makes nothing less available), a replica or a
/// spare (`spare`: one does not wait for the spares), with `siblings` (the group's other
/// members, spares included).
pub fn gate(group: &str, limits: Limits, (serving, spare): (bool, bool), siblings: &[Sibling]) -> Roll {
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
    // A commit that changes the limits reaches the members' records one by one: a wait.
    if let Some(other) = siblings.iter().find(|s| s.limits != limits) {
        return Roll::Wait(format!(
            "waiting: group {group}'s specs disagree: {} says max_unavailable {}, max_surge {}; this one max_unavailable {}, max_surge {}; give every member of the group the same `rollout:` limits",
            other.unit, other.limits.max_unavailable, other.limits.max_surge, limits.max_unavailable, limits.max_surge
        ));
    }
    let (spares, replicas): (Vec<&Sibling>, Vec<&Sibling>) = siblings.iter().partition(|s| s.spare);
    let surge = limits.max_surge as usize;
    let up = |s: &Sibling| s.serves() && !s.changing;
    let spares_up = spares.iter().filter(|s| up(s)).count();
    if spares_up < surge && !spare {
        let known = if spares.len() < surge {
            format!("{} of its spares known (units saying `rollout: {{group: {group}, spare: true}}`)", spares.len())
        } else {
            let names: Vec<&str> = spares.iter().filter(|s| !up(s)).map(|s| s.unit.as_str()).collect();
            format!("{} not serving its new spec yet", names.join(", "))
        };
        return Roll::Wait(format!(
            "waiting: group {group}: max_surge {surge} spares must serve the new spec before a replica stops; {known}"
        ));
    }
    // 0 without a surge is refused by validation; taken as 1.
    let max = if surge == 0 { limits.max_unavailable.max(1) } else { limits.max_unavailable } as usize;
    within(max, surge, spares_up, &replicas, usize::from(!spare))
}

/// A member leaving its group (its spec is gone, `prune: true`) stops once no more of the
/// others than `max_unavailable` (at least 1, itself counted) are unavailable: the group shrinks,
/// so no spare must serve first, and neither a sibling's failed change nor limits that disagree
/// keep it (nothing of its spec changes).
pub fn leaving(limits: Limits, siblings: &[Sibling]) -> Roll {
    let (spares, replicas): (Vec<&Sibling>, Vec<&Sibling>) = siblings.iter().partition(|s| s.spare);
    let spares_up = spares.iter().filter(|s| s.serves() && !s.changing).count();
    within(limits.max_unavailable.max(1) as usize, 0, spares_up, &replicas, 1)
}

/// Go when the replicas that serve, with the spares up, and at most `max` unavailable, make the
/// group (`replicas` and `me`, this member when it is one of them); else a wait naming those down.
fn within(max: usize, surge: usize, spares_up: usize, replicas: &[&Sibling], me: usize) -> Roll {
    let down: Vec<&&Sibling> = replicas.iter().filter(|s| !s.serves()).collect();
    // Serving besides this one, against the replicas that must (the group's size less `max`).
    let others = replicas.len() - down.len() + spares_up;
    let n = replicas.len() + me;
    if others + max >= n {
        return Roll::Go;
    }
    let names: Vec<String> = down
        .iter()
        .map(|s| match s.state {
            Some(Word::Ready) => format!("{} is ready, not yet taken by its load balancers", s.unit),
            Some(w) => format!("{} is {w}", s.unit),
            None => format!("{} has no serving state", s.unit),
        })
        .collect();
    let spares = match surge {
        0 => String::new(),
        _ => format!(", {spares_up} spare serving, max_surge {surge}"),
    };
    Roll::Wait(format!(
        "waiting: {} ({} of {} unavailable, max_unavailable {max}{spares})",
        names.join(", "),
        down.len(),
        n
    ))
}

/// What a spare of a group does now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Spare {
    /// Serve its desired spec (applied through the whole apply path): the group changes, or
    /// its own spec changed and is proved on it first. Said why.
    Serve(String),
    /// Held stopped (drained first when it runs): why.
    Rest(String),
}

/// The spare of `group`: serve while a replica (`siblings` that are not spares) has a change to
/// make, is told `drain`, or is told `ready` but not yet taken by its load balancers (the roll's
/// last replica back: [`Sibling::taken`]), or the spare's own new spec is not proved yet
/// (`own_change`); rest when the group is at rest, or its roll stopped (a member's change failed,
/// its own included: `own_failed`). A replica down outside a change does not start it: the
/// spare is the roll's capacity, not a failover.
pub fn spare(group: &str, own_change: bool, own_failed: Option<&str>, siblings: &[Sibling]) -> Spare {
    if let Some(why) = own_failed {
        return Spare::Rest(format!(
            "the spare of group {group}, stopped: its change failed ({why}); the group's replicas keep their running spec"
        ));
    }
    if let Some(s) = siblings.iter().find(|s| s.failed.is_some()) {
        return Spare::Rest(format!(
            "the spare of group {group}, stopped: the roll stopped at {}'s failed change",
            s.unit
        ));
    }
    let changing: Vec<&str> = siblings.iter().filter(|s| !s.spare && s.changing).map(|s| s.unit.as_str()).collect();
    if !changing.is_empty() {
        return Spare::Serve(format!("the spare of group {group}, serving while {} change", changing.join(", ")));
    }
    if own_change {
        return Spare::Serve(format!("the spare of group {group}, proving its new spec before the replicas change"));
    }
    let back = |s: &&Sibling| !s.spare && (s.state == Some(Word::Drain) || s.state == Some(Word::Ready) && !s.taken);
    let back: Vec<&str> = siblings.iter().filter(back).map(|s| s.unit.as_str()).collect();
    if !back.is_empty() {
        return Spare::Serve(format!(
            "the spare of group {group}, serving until its load balancers take {} again",
            back.join(", ")
        ));
    }
    Spare::Rest(format!("the spare of group {group}, stopped while the group is at rest"))
}

/// Members of a group given together (each `(file, rollout)`) whose limits disagree: the first
/// such pair, said (a one-shot apply refuses them all; the agent's gate holds such a roll).
pub fn disagreeing(members: &[(String, &specd_spec::Rollout)]) -> Option<String> {
    for (i, (file, r)) in members.iter().enumerate() {
        let (a, b) = (Limits::from(*r), |o: &specd_spec::Rollout| Limits::from(o));
        if let Some((other, o)) = members[..i].iter().find(|(_, o)| o.group == r.group && b(o) != a) {
            let o = b(o);
            return Some(format!(
                "{other} and {file}: spec.rollout: the members of group {} disagree (max_unavailable {}, max_surge {} against max_unavailable {}, max_surge {}): give every member of a group the same `max_unavailable` and `max_surge`",
                r.group, o.max_unavailable, o.max_surge, a.max_unavailable, a.max_surge
            ));
        }
    }
    None
}

/// Whether a member has a change to make: its desired unit is not the last it ran verified.
pub fn changing(st: &UnitState) -> bool {
    st.desired.as_ref().is_some_and(|d| st.last_good.as_ref().is_none_or(|g| g.sha256 != d.sha256))
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
        Sibling {
            unit: unit.into(),
            state,
            failed: failed.map(str::to_string),
            taken: true,
            spare: false,
            changing: false,
            limits: Limits::default(),
        }
    }

    /// The gate without spares: every member says `max_unavailable: max`.
    fn gate(group: &str, max: u32, serving: bool, siblings: &[Sibling]) -> Roll {
        let limits = Limits { max_unavailable: max, max_surge: 0 };
        let siblings: Vec<Sibling> = siblings.iter().map(|s| Sibling { limits, ..s.clone() }).collect();
        super::gate(group, limits, (serving, false), &siblings)
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

    /// A member of a group whose specs say `max_unavailable: 0, max_surge: 1`.
    fn member(unit: &str, state: Option<Word>, spare: bool, changing: bool) -> Sibling {
        Sibling { spare, changing, limits: SURGE, ..sib(unit, state, None) }
    }

    const SURGE: Limits = Limits { max_unavailable: 0, max_surge: 1 };

    #[test]
    fn with_a_surge_a_replica_goes_only_once_its_spare_serves_the_new_spec_and_capacity_stays() {
        use Word::*;
        let spare = |state, changing| member("llm-s", state, true, changing);
        let replica = |unit, state| member(unit, state, false, true);
        // (siblings of a serving replica llm-a, what the gate says)
        let cases: Vec<(Vec<Sibling>, Roll)> = vec![
            // The spare held stopped (at rest, or not started yet): the replicas wait for it.
            (
                vec![replica("llm-b", Some(Ready)), spare(Some(Down), false)],
                Roll::Wait("waiting: group llm: max_surge 1 spares must serve the new spec before a replica stops; llm-s not serving its new spec yet".into()),
            ),
            // Ready, but its own change not proved yet (the old spec still serving).
            (
                vec![replica("llm-b", Some(Ready)), spare(Some(Ready), true)],
                Roll::Wait("waiting: group llm: max_surge 1 spares must serve the new spec before a replica stops; llm-s not serving its new spec yet".into()),
            ),
            // No spare known.
            (
                vec![replica("llm-b", Some(Ready))],
                Roll::Wait("waiting: group llm: max_surge 1 spares must serve the new spec before a replica stops; 0 of its spares known (units saying `rollout: {group: llm, spare: true}`)".into()),
            ),
            // Told ready, but HAProxy has not read it yet: not counted.
            (
                vec![replica("llm-b", Some(Ready)), Sibling { taken: false, ..spare(Some(Ready), false) }],
                Roll::Wait("waiting: group llm: max_surge 1 spares must serve the new spec before a replica stops; llm-s not serving its new spec yet".into()),
            ),
            (
                vec![Sibling { taken: false, ..replica("llm-b", Some(Ready)) }, spare(Some(Ready), false)],
                Roll::Wait("waiting: llm-b is ready, not yet taken by its load balancers (1 of 2 unavailable, max_unavailable 0, 1 spare serving, max_surge 1)".into()),
            ),
            // It serves the new spec: the first replica goes (2 of 2 capacity kept: llm-b, llm-s).
            (vec![replica("llm-b", Some(Ready)), spare(Some(Ready), false)], Roll::Go),
            // Another replica is down: with max_unavailable 0, this one waits.
            (
                vec![replica("llm-b", Some(Drain)), spare(Some(Ready), false)],
                Roll::Wait("waiting: llm-b is drain (1 of 2 unavailable, max_unavailable 0, 1 spare serving, max_surge 1)".into()),
            ),
            // The spare's change failed: the roll stops before any replica is touched.
            (
                vec![replica("llm-b", Some(Ready)), Sibling { failed: Some("CUDA out of memory".into()), ..spare(Some(Down), true) }],
                Roll::Hold("held: the roll of group llm stopped: llm-s's change failed and was rolled back (CUDA out of memory); this replica keeps its running spec until that replica's spec changes".into()),
            ),
            // A member's spec says other limits.
            (
                vec![replica("llm-b", Some(Ready)), Sibling { limits: Limits { max_unavailable: 1, max_surge: 0 }, ..spare(Some(Ready), false) }],
                Roll::Wait("waiting: group llm's specs disagree: llm-s says max_unavailable 1, max_surge 0; this one max_unavailable 0, max_surge 1; give every member of the group the same `rollout:` limits".into()),
            ),
        ];
        for (siblings, want) in cases {
            assert_eq!(super::gate("llm", SURGE, (true, false), &siblings), want, "{siblings:?}");
        }
        // Not serving (it is down anyway): it goes, spare or not.
        assert_eq!(super::gate("llm", SURGE, (false, false), &[member("llm-s", Some(Down), true, false)]), Roll::Go);
        // A spare serving a spec older than the group's (a newer change came mid-roll) does not
        // wait for spares, but keeps the replicas' capacity: it goes while they all serve.
        let replicas = [member("llm-a", Some(Ready), false, true), member("llm-b", Some(Ready), false, true)];
        assert_eq!(super::gate("llm", SURGE, (true, true), &replicas), Roll::Go);
        let one_down = [member("llm-a", Some(Drain), false, true), member("llm-b", Some(Ready), false, true)];
        assert!(matches!(super::gate("llm", SURGE, (true, true), &one_down), Roll::Wait(_)));
    }

    #[test]
    fn a_spare_serves_while_a_replica_changes_and_rests_otherwise() {
        use Word::*;
        let replica = |unit, changing| member(unit, Some(Ready), false, changing);
        let failed = |unit| Sibling { failed: Some("the server exited during load".into()), ..replica(unit, true) };
        // (own change, own failure, the group's other members, what the spare does)
        let cases: Vec<(bool, Option<&str>, Vec<Sibling>, Spare)> = vec![
            // At rest: every replica runs its desired spec, the spare's own proved.
            (false, None, vec![replica("llm-a", false), replica("llm-b", false)], Spare::Rest("the spare of group llm, stopped while the group is at rest".into())),
            // A change: started first (its own spec changed too), kept while a replica changes.
            (true, None, vec![replica("llm-a", true), replica("llm-b", true)], Spare::Serve("the spare of group llm, serving while llm-a, llm-b change".into())),
            (false, None, vec![replica("llm-a", false), replica("llm-b", true)], Spare::Serve("the spare of group llm, serving while llm-b change".into())),
            // Its own spec changed before the replicas' records say so: proved first.
            (true, None, vec![replica("llm-a", false)], Spare::Serve("the spare of group llm, proving its new spec before the replicas change".into())),
            // Its own start failed: held stopped, the replicas never see the spec.
            (true, Some("CUDA out of memory"), vec![replica("llm-a", true)], Spare::Rest("the spare of group llm, stopped: its change failed (CUDA out of memory); the group's replicas keep their running spec".into())),
            // A replica's failed: the roll stopped, the spare goes back to rest.
            (false, None, vec![failed("llm-a"), replica("llm-b", true)], Spare::Rest("the spare of group llm, stopped: the roll stopped at llm-a's failed change".into())),
            // Agent restarted mid-roll with the spare running: the same answer from the records.
            (false, None, vec![replica("llm-a", false), replica("llm-b", true)], Spare::Serve("the spare of group llm, serving while llm-b change".into())),
            // Another spare changing does not keep this one.
            (false, None, vec![member("llm-t", Some(Ready), true, true)], Spare::Rest("the spare of group llm, stopped while the group is at rest".into())),
            // The roll's last replica back, told ready, not yet taken by its load balancers (their
            // health check's rise): the spare serves on until it is.
            (false, None, vec![replica("llm-a", false), Sibling { taken: false, ..replica("llm-b", false) }], Spare::Serve("the spare of group llm, serving until its load balancers take llm-b again".into())),
            (false, None, vec![replica("llm-a", false), member("llm-b", Some(Drain), false, false)], Spare::Serve("the spare of group llm, serving until its load balancers take llm-b again".into())),
            // A replica down outside a change (not the roll's): the spare rests.
            (false, None, vec![replica("llm-a", false), member("llm-b", Some(Down), false, false)], Spare::Rest("the spare of group llm, stopped while the group is at rest".into())),
        ];
        for (own, failed, siblings, want) in cases {
            assert_eq!(spare("llm", own, failed, &siblings), want, "{own} {failed:?} {siblings:?}");
        }
    }

    /// A member leaving its group (its spec gone, pruned) waits only while another replica is
    /// unavailable: a resting spare, a failed change of a sibling or limits that disagree keep
    /// it no longer (a group with a surge used to keep it for good: no spare serves a prune).
    #[test]
    fn a_member_that_leaves_its_group_waits_only_while_another_replica_is_out() {
        use Word::*;
        let resting = member("llm-s", Some(Down), true, false);
        let replica = |state| member("llm-b", state, false, false);
        let cases: Vec<(Vec<Sibling>, Roll)> = vec![
            (vec![replica(Some(Ready)), resting.clone()], Roll::Go),
            (vec![replica(Some(Ready))], Roll::Go),
            (
                vec![replica(Some(Drain)), resting.clone()],
                Roll::Wait("waiting: llm-b is drain (1 of 2 unavailable, max_unavailable 1)".into()),
            ),
            (
                vec![Sibling { taken: false, ..replica(Some(Ready)) }],
                Roll::Wait(
                    "waiting: llm-b is ready, not yet taken by its load balancers (1 of 2 unavailable, max_unavailable 1)"
                        .into(),
                ),
            ),
            (vec![replica(Some(Ready)), Sibling { failed: Some("CUDA out of memory".into()), ..resting.clone() }], Roll::Go),
            (
                vec![Sibling { limits: Limits { max_unavailable: 2, max_surge: 0 }, ..replica(Some(Ready))}],
                Roll::Go,
            ),
            // A spare that serves (the group mid-change) counts as serving.
            (vec![replica(Some(Drain)), member("llm-s", Some(Ready), true, false)], Roll::Go),
        ];
        for (siblings, want) in cases {
            assert_eq!(super::leaving(SURGE, &siblings), want, "{siblings:?}");
        }
    }

    #[test]
    fn members_given_together_must_agree_on_their_groups_limits() {
        let r = |group: &str, max_unavailable, max_surge, spare| specd_spec::Rollout {
            group: group.into(),
            max_unavailable,
            max_surge,
            spare,
        };
        let (a, s, other) = (r("llm", 0, 1, false), r("llm", 0, 1, true), r("chat", 1, 0, false));
        fn given<'a>(rs: &[&'a specd_spec::Rollout]) -> Vec<(String, &'a specd_spec::Rollout)> {
            rs.iter().enumerate().map(|(i, r)| (format!("{i}.yaml"), *r)).collect()
        }
        // A spare and a replica agreeing, another group beside: fine.
        assert_eq!(disagreeing(&given(&[&a, &s, &other])), None);
        let bad = r("llm", 1, 0, true);
        assert_eq!(
            disagreeing(&given(&[&a, &other, &bad])).as_deref(),
            Some(
                "0.yaml and 2.yaml: spec.rollout: the members of group llm disagree (max_unavailable 0, max_surge 1 against max_unavailable 1, max_surge 0): give every member of a group the same `max_unavailable` and `max_surge`"
            )
        );
    }
}
