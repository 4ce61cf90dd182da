//! How a reconcile ends, decided in one pure place: from the plan, what the steps returned and
//! what the reconcile observed, its outcome, the verdict a person reads, the next [`Action`] and
//! the change to the unit's record ([`Change`]). The reconciler gathers the facts, asks here, then
//! applies the change and saves the record once; nothing in this module touches the host.

use std::time::Duration;

use specd_spec::short;

use crate::core::plan::{Observed, Plan, Step};
use crate::core::record::{GoodUnit, HistoryEntry, Outcome, Source, UnitState};
use crate::core::recovery::{Decision, Restore};
use crate::core::serving::After;
use crate::core::sync::SyncStatus;
use crate::core::timing;
use crate::core::unit_state::{ActiveState, SubState};

/// What happens next for a unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Reconcile again after this long.
    Requeue(Duration),
    /// Nothing to do until something changes.
    AwaitChange,
}

/// What one reconcile did.
#[derive(Clone, Debug)]
pub struct Report {
    pub plan: Plan,
    /// `None` when nothing was done.
    pub outcome: Option<Outcome>,
    /// One line for a person.
    pub verdict: String,
    /// How the stopped instance ended, when it was not a clean stop.
    pub stop_verdict: Option<String>,
    pub action: Action,
    /// The reconcile refused to act on the unit (a unit file specd did not write, a unit that
    /// cannot start on this host); a dry run says so too.
    pub refused: bool,
    /// After an apply that failed or rolled back (or the end of an interrupted rollback):
    /// whether the service runs. `None` after any other reconcile.
    pub serving: Option<Serving>,
    /// The replica waits for its group's siblings to serve again (`core::roll`): nothing was
    /// done; a one-shot apply asks again after the action's time.
    pub roll_wait: bool,
}

/// Whether the service runs once an apply that failed or rolled back concluded, as systemd said
/// then: [`Outcome::Failed`] and [`Outcome::RolledBack`] cover both a unit that serves (the last
/// good one put back, or the old one never stopped) and one that is down, which this tells
/// apart (the verdict says `<unit> is DOWN (<state>/<sub>)` for [`Serving::Down`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Serving {
    /// It runs or comes up (active, activating, reloading).
    Up,
    /// It is down: systemd's ActiveState and SubState.
    Down { active: ActiveState, sub: SubState },
    /// systemd could not be asked.
    Unknown,
}

impl Serving {
    /// From what systemd said (`None`: it could not be asked).
    pub fn of(state: Option<(ActiveState, SubState)>) -> Serving {
        match state {
            None => Serving::Unknown,
            Some((active, _)) if active.is_up() => Serving::Up,
            Some((active, sub)) => Serving::Down { active, sub },
        }
    }

    /// The words a verdict ends with when the service is down.
    fn note(&self, unit: &str) -> Option<String> {
        match self {
            Serving::Down { active, sub } => Some(format!("{unit} is DOWN ({active}/{sub})")),
            Serving::Up | Serving::Unknown => None,
        }
    }
}

/// How a verdict that refuses to act on a unit begins.
pub const REFUSED: &str = "Refused:";

/// Where an apply asked to stop stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cancelled {
    /// Before it changed anything on the host.
    Unchanged,
    /// After it started the instance it puts in place (which loads on).
    Started,
}

/// How putting the last good unit back ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Restored {
    /// It serves again.
    Serving,
    /// It stopped at a safe point before this step: specd is stopping.
    Cancelled(Step),
    /// This step failed, with this message.
    Failed(Step, String),
}

/// The desired unit a reconcile concludes on.
#[derive(Clone, Debug)]
pub struct Subject<'a> {
    pub unit: &'a str,
    pub sha256: &'a str,
    pub text: &'a str,
    pub source: Option<&'a Source>,
    /// Its readiness endpoint and where its server listens (kept with a good unit, for a later
    /// rollback to it).
    pub endpoint: &'a str,
    pub base_url: String,
}

impl Subject<'_> {
    fn good(&self, now: u64) -> GoodUnit {
        GoodUnit {
            sha256: self.sha256.to_string(),
            text: self.text.to_string(),
            source: self.source.cloned(),
            time: now,
            endpoint: Some(self.endpoint.to_string()),
            base_url: Some(self.base_url.clone()),
        }
    }
}

/// What a reconcile changes in the unit's record.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Change {
    /// The apply is over: its in-progress record goes.
    pub finished: bool,
    /// The desired unit is the last good one now.
    pub good: bool,
    /// The desired unit is recorded as written by specd, if nothing is recorded.
    pub written: bool,
    /// A history entry with the verdict and this outcome.
    pub record: Option<Outcome>,
    /// Said by the failed server: added to the desired hash's quarantine reason.
    pub quarantine_said: Option<String>,
    /// The serving state the unit's load balancers are told now (`serving::After`).
    pub serving: After,
    /// The start this reconcile made of the desired unit, timed: kept with its history entry.
    pub startup: Option<crate::core::record::Startup>,
}

/// The end of a reconcile.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Conclusion {
    pub outcome: Option<Outcome>,
    pub verdict: String,
    pub action: Action,
    pub change: Change,
    pub refused: bool,
    /// See [`Report::serving`].
    pub serving: Option<Serving>,
    /// Something was done on the host: a record that cannot be saved is then said in the verdict
    /// (what was done is done), not an error to retry from.
    pub acted: bool,
}

impl Conclusion {
    fn said(verdict: String) -> Conclusion {
        Conclusion {
            outcome: None,
            verdict,
            action: Action::AwaitChange,
            change: Change::default(),
            refused: false,
            serving: None,
            acted: true,
        }
    }

    /// The change to the unit's record, applied (`now`: the wall clock, unix seconds).
    pub fn apply(&self, st: &mut UnitState, s: &Subject, stop_verdict: Option<String>, ms: u64, now: u64) {
        let c = &self.change;
        if c.finished {
            st.in_progress = None;
        }
        if c.good {
            st.last_good = Some(s.good(now));
        }
        if c.written {
            st.written_sha256.get_or_insert_with(|| s.sha256.to_string());
        }
        if let Some(said) = &c.quarantine_said
            && let Some(q) = st.quarantine.iter_mut().find(|q| q.sha256 == s.sha256)
        {
            q.reason.push_str(&format!("; the server said: {said}"));
        }
        if let Some(outcome) = c.record {
            st.record(HistoryEntry {
                time: now,
                sha256: s.sha256.to_string(),
                source: s.source.cloned(),
                outcome,
                message: self.verdict.clone(),
                stop_verdict,
                duration_ms: ms,
                startup: c.startup.clone(),
            });
        }
    }

    /// The record could not be saved: said in the verdict when the host was acted on.
    pub fn unsaved(&mut self, e: &anyhow::Error) {
        self.verdict.push_str(&format!(" (specd's state could not be saved: {e:#})"));
    }

    pub fn report(self, plan: Plan, stop_verdict: Option<String>) -> Report {
        Report {
            plan,
            outcome: self.outcome,
            verdict: self.verdict,
            stop_verdict,
            action: self.action,
            refused: self.refused,
            serving: self.serving,
            roll_wait: false,
        }
    }
}

/// Asked to stop while another specd held the unit's lock: nothing was done.
pub fn lock_interrupted(unit: &str) -> Report {
    let plan = Plan {
        sync: SyncStatus::Progressing,
        reasons: vec![format!("another specd is reconciling {unit}")],
        steps: vec![],
        toward: crate::core::plan::Toward::Desired,
    };
    Conclusion::said("Interrupted before it began: specd is stopping; nothing was changed on the host".into())
        .report(plan, None)
}

/// A replica of a group not stopped now (`core::roll`): it waits for its siblings (`wait`), or
/// the group's roll stopped; nothing was done, asked again after `again`.
pub fn rolling(plan: Plan, why: String, wait: bool, again: std::time::Duration) -> Report {
    let mut r = Conclusion { action: Action::Requeue(again), acted: false, ..Conclusion::said(why) }.report(plan, None);
    r.roll_wait = wait;
    r
}

/// A unit file specd did not write (`whose`), that the spec does not adopt: left alone.
pub fn foreign(plan: Plan, unit: &str, whose: &str) -> Report {
    let verdict = format!(
        "{REFUSED} {unit}: {whose}; specd takes over a unit it did not write only when the spec adopts it (policy: {{adopt: true}}); nothing changed"
    );
    Conclusion { refused: true, ..Conclusion::said(verdict) }.report(plan, None)
}

/// The verdict refusing a plan that would stop a serving instance to start unit `sha256`, which
/// cannot start on this host (`problems`: pre-flight's summary).
pub fn cannot_start(unit: &str, sha256: &str, problems: &str) -> String {
    format!(
        "{REFUSED} {unit}: unit {} cannot start on this host: {problems}; nothing was stopped or changed",
        short(sha256)
    )
}

/// The verdict refusing a plan that would stop a serving instance whose load balancers could not
/// be told `drain` (`why`): stopping it would cut the requests they keep sending.
pub fn not_told(unit: &str, why: &str) -> String {
    format!("{REFUSED} {unit}: its load balancers could not be told drain ({why}); nothing was stopped or changed")
}

/// A dry run, or the agent's look at a unit a hold keeps its hands off: what would be done (or
/// refused), nothing done.
pub fn observed_only(plan: Plan, held: Option<String>, refusal: Option<String>) -> Report {
    let refused = refusal.is_some();
    let verdict = match (refusal, held) {
        (Some(refused), _) => refused,
        (None, held) => {
            let would = match plan.steps.len() {
                0 => format!("{}: nothing to do", plan.sync),
                n => format!("{}: would run {n} steps", plan.sync),
            };
            match held {
                Some(why) => format!("{would} (held: {why})"),
                None => would,
            }
        }
    };
    Conclusion { refused, ..Conclusion::said(verdict) }.report(plan, None)
}

/// A plan refused before anything was done (`verdict`): recorded once (a later look that finds
/// the same refusal again says nothing new), looked at again every [`timing::PREFLIGHT_AGAIN`]:
/// the host may be fixed (a model copied, a port freed) with no event specd sees.
pub fn refused(st: &UnitState, verdict: String) -> Conclusion {
    let repeated = st.history.last().is_some_and(|h| h.outcome == Outcome::Refused && h.message == verdict);
    let outcome = (!repeated).then_some(Outcome::Refused);
    Conclusion {
        outcome,
        action: Action::Requeue(timing::PREFLIGHT_AGAIN),
        // Nothing was stopped or changed: as it was.
        change: Change { record: outcome, serving: After::Observed, ..Change::default() },
        refused: true,
        acted: false,
        ..Conclusion::said(verdict)
    }
}

/// A plan refused by the pre-flight that ran alongside the drain, after the apply's record was
/// written (`verdict`): as [`refused`], and that record goes (nothing was stopped or changed).
pub fn refused_at_the_drain(st: &UnitState, verdict: String) -> Conclusion {
    let c = refused(st, verdict);
    Conclusion { change: Change { finished: true, ..c.change.clone() }, ..c }
}

/// Nothing to do on the host: what the unit is (in sync, drifted and only reported,
/// progressing), what is recorded, and when to look again.
pub fn settled(st: &UnitState, plan: &Plan, s: &Subject, o: &Observed) -> Conclusion {
    // An interrupted apply or rollback with nothing left to do (the last good unit runs). Under a
    // mask it stays recorded: once unmasked, the next reconcile finishes it.
    let finished = plan.sync != SyncStatus::Masked && st.in_progress.as_ref().is_some_and(|p| p.sha256 == s.sha256);
    // In sync and nothing recorded as good yet (state lost, or adopted): it is good now.
    let good = plan.sync == SyncStatus::InSync && st.last_good.as_ref().is_none_or(|g| g.sha256 != s.sha256);
    // The run that was interrupted changed the host (else it would not be in progress): what it
    // did ends here and is recorded as what it was, an apply or a rollback.
    let rolled_back = finished
        && plan.sync == SyncStatus::Failed
        && o.quarantined.is_some()
        && o.last_good_sha256.is_some()
        && o.deployed_sha256 == o.last_good_sha256
        && (o.active_state.is_up() || o.main_pid > 0);
    let verdict = match plan.sync {
        SyncStatus::InSync if finished => format!(
            "Applied: {} runs unit {} ({}) and is ready: the apply specd was interrupted in is finished",
            s.unit,
            short(s.sha256),
            s.source.map_or("no source".to_string(), |s| s.to_string()),
        ),
        SyncStatus::InSync => format!("InSync: {} runs unit {} and is ready", s.unit, short(s.sha256)),
        _ if rolled_back => format!(
            "RolledBack: {}: the last good unit {} runs again (the rollback specd was interrupted in is finished); spec {} stays quarantined",
            s.unit,
            short(o.last_good_sha256.as_deref().unwrap_or_default()),
            short(s.sha256)
        ),
        sync => format!("{sync}: {}", plan.reasons.join("; ")),
    };
    // In sync again after a failure of this unit (systemd restarted it after a crash): the
    // history says it runs, so that status no longer reports the failure.
    let recovered = plan.sync == SyncStatus::InSync
        && st.history.last().is_some_and(|h| h.sha256 == s.sha256 && h.outcome == Outcome::Failed);
    let outcome = match plan.sync {
        SyncStatus::Drifted => Some(Outcome::Reported),
        SyncStatus::InSync if finished => Some(Outcome::Applied),
        SyncStatus::InSync if recovered => Some(Outcome::Started),
        _ if rolled_back => Some(Outcome::RolledBack),
        _ => None,
    };
    // A drift that is only reported is recorded once, not at every resync.
    let repeated = st.history.last().is_some_and(|h| h.outcome == Outcome::Reported && h.message == verdict);
    // The last good unit a rollback started may still load: looked at again until it serves.
    let loading = rolled_back && o.ready != Some(true);
    let action = match plan.sync {
        SyncStatus::Progressing => Action::Requeue(timing::PROGRESSING_AGAIN),
        _ if loading => Action::Requeue(timing::PROGRESSING_AGAIN),
        _ => Action::AwaitChange,
    };
    // Ready when it runs its desired unit (in sync) or the last good one it was rolled back to,
    // ready; one still starting keeps what it was told (`drain` after a stop); else as observed.
    let serving = match plan.sync {
        SyncStatus::InSync => After::Ready,
        _ if loading => After::Keep,
        _ if rolled_back => After::Ready,
        SyncStatus::Progressing => After::Keep,
        _ => After::Observed,
    };
    Conclusion {
        outcome,
        verdict,
        action,
        change: Change {
            finished,
            good,
            written: good,
            record: outcome.filter(|_| !repeated),
            serving,
            ..Change::default()
        },
        refused: false,
        serving: None,
        acted: false,
    }
}

/// The steps of a plan that only sets whether the unit starts at boot ran: `now`, whether
/// systemd says it does now (`None`: it could not say). Not set yet (the warning said why): the
/// next look tries again after [`timing::ENABLEMENT_AGAIN`].
pub fn enablement(plan: &Plan, unit: &str, want: bool, now: Option<bool>) -> Conclusion {
    if now != Some(want) {
        let verdict = format!("{}: {}; not changed yet", plan.sync, plan.reasons.join("; "));
        return Conclusion {
            action: Action::Requeue(timing::ENABLEMENT_AGAIN),
            change: Change { finished: true, serving: After::Observed, ..Change::default() },
            ..Conclusion::said(verdict)
        };
    }
    let verdict = if want {
        format!("Applied: {unit} starts at boot now (enabled); its server was left as it runs")
    } else {
        format!("Applied: {unit} no longer starts at boot (disabled); its server was left as it runs")
    };
    Conclusion {
        outcome: Some(Outcome::Applied),
        change: Change {
            finished: true,
            record: Some(Outcome::Applied),
            serving: After::Observed,
            ..Change::default()
        },
        ..Conclusion::said(verdict)
    }
}

/// Whether a plan only sets whether the unit starts at boot (its server untouched).
pub fn enablement_only(plan: &Plan) -> bool {
    plan.steps.iter().all(|s| matches!(s, Step::Enable | Step::Disable))
}

/// The steps ran: the unit runs its verified spec. `Applied` when this apply replaced something
/// (wrote the unit or stopped an instance, or it finishes an interrupted apply that did:
/// `resumed`), `Started` when it only started it.
pub fn applied(plan: &Plan, s: &Subject, ms: u64, resumed: bool) -> Conclusion {
    let verdict = format!(
        "Applied: {} runs unit {} ({}), verified and ready in {:.1}s",
        s.unit,
        short(s.sha256),
        s.source.map_or("no source".to_string(), |s| s.to_string()),
        ms as f64 / 1000.0
    );
    let outcome = if resumed || plan.steps.contains(&Step::WriteUnit) || plan.steps.contains(&Step::Stop) {
        Outcome::Applied
    } else {
        Outcome::Started
    };
    Conclusion {
        outcome: Some(outcome),
        change: Change {
            finished: true,
            good: true,
            record: Some(outcome),
            serving: After::Ready,
            ..Change::default()
        },
        ..Conclusion::said(verdict)
    }
}

/// The apply stopped where specd was asked to stop, before `step`.
pub fn interrupted(step: Step, at: Cancelled) -> Conclusion {
    let verdict = match at {
        Cancelled::Unchanged => {
            format!("Interrupted before {step:?}: specd is stopping; nothing was changed on the host")
        }
        Cancelled::Started => format!(
            "Interrupted: stopped at a safe point before {step:?} finished, because specd is stopping; the instance it started loads on, and the next run finishes this apply"
        ),
    };
    // Unchanged: as it was. Started: `drain` stays until the next run verifies what it started.
    let serving = if at == Cancelled::Unchanged { After::Observed } else { After::Keep };
    Conclusion {
        change: Change { finished: at == Cancelled::Unchanged, serving, ..Change::default() },
        ..Conclusion::said(verdict)
    }
}

/// A rollback that did not finish (specd stopped or died in it) was finished: `r`, how putting
/// the last good unit `good` back ended; `serving`, whether the service runs now.
pub fn rollback_finished(s: &Subject, good: &str, r: &Restored, serving: Serving) -> Conclusion {
    let (outcome, mut verdict) = match r {
        Restored::Serving => (
            Outcome::RolledBack,
            format!(
                "RolledBack: {}: restored the last good unit {}; spec {} stays quarantined",
                s.unit,
                short(good),
                short(s.sha256)
            ),
        ),
        Restored::Cancelled(step) => (
            Outcome::Failed,
            format!(
                "Failed: {}: restoring the last good unit {}: {step:?} failed: the agent is stopping",
                s.unit,
                short(good)
            ),
        ),
        Restored::Failed(step, message) => (
            Outcome::Failed,
            format!("Failed: {}: restoring the last good unit {}: {step:?} failed: {message}", s.unit, short(good)),
        ),
    };
    if let Some(down) = serving.note(s.unit) {
        verdict.push_str(&format!("; {down}"));
    }
    let after = match (r, &serving) {
        (Restored::Serving, Serving::Up) => After::Ready,
        (Restored::Cancelled(_), _) => After::Keep,
        _ => After::Down(verdict.clone()),
    };
    Conclusion {
        outcome: Some(outcome),
        change: Change { finished: true, record: Some(outcome), serving: after, ..Change::default() },
        serving: Some(serving),
        ..Conclusion::said(verdict)
    }
}

/// What the recovery after a failed step did, for its verdict.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Recovered {
    /// Left as it is, tried again with backoff; `known_good`: the unit crashed after it was
    /// ready and passed verification before.
    Retried { known_good: bool },
    /// Left stopped, for this reason; `quarantined`: the desired hash is.
    LeftStopped { why: &'static str, quarantined: bool },
    /// A rollback or restart was due and no last good unit could be put back.
    NoGoodUnit,
    /// The last good unit `good` was put back (why), and how that ended.
    Restored { why: Restore, good: String, end: Restored },
}

/// The serving state after a failed step's recovery `r` (`serving`: whether the service runs;
/// `verdict`: the failure's): ready when the last good unit was put back and serves; `drain`
/// kept while a restore stopped at a safe point (the next run finishes it); down otherwise.
pub fn after_recovery(r: &Recovered, serving: Option<&Serving>, verdict: &str) -> After {
    match (r, serving) {
        (Recovered::Restored { end: Restored::Serving, .. }, Some(Serving::Up)) => After::Ready,
        (Recovered::Restored { end: Restored::Cancelled(_), .. }, _) => After::Keep,
        _ => After::Down(verdict.to_string()),
    }
}

/// The outcome and verdict of a failed step (`what`: the step and its message) and its recovery.
pub fn recovered(s: &Subject, what: &str, r: &Recovered) -> (Outcome, String) {
    let unit = s.unit;
    let failed = short(s.sha256);
    let (why, good, end) = match r {
        Recovered::Retried { known_good } => {
            let why = if *known_good {
                format!(
                    "; unit {failed} passed verification before, so one crash does not quarantine it: it is retried with backoff"
                )
            } else {
                String::new()
            };
            return (Outcome::Failed, format!("Failed: {unit}: {what}{why}"));
        }
        Recovered::LeftStopped { why, quarantined } => {
            let q = if *quarantined { format!("; spec {failed} is quarantined") } else { String::new() };
            return (Outcome::Failed, format!("Failed: {unit}: {what}; {why}, so the service is left stopped{q}"));
        }
        Recovered::NoGoodUnit => return (Outcome::Failed, format!("Failed: {unit}: {what}")),
        Recovered::Restored { why, good, end } => (why, short(good), end),
    };
    let what = format!("{unit}: {what}");
    match (why, end) {
        (Restore::Rollback, Restored::Serving) => (
            Outcome::RolledBack,
            format!(
                "RolledBack: {what}; restored the last good unit {good} and it serves again; spec {failed} is quarantined"
            ),
        ),
        (Restore::HostFault, Restored::Serving) => (
            Outcome::Failed,
            format!(
                "Failed: {what}; started the last good unit {good} again and it serves; unit {failed} is tried again later"
            ),
        ),
        (Restore::Rollback, Restored::Cancelled(_)) => (
            Outcome::Failed,
            format!(
                "Failed: {what}; the rollback to {good} stopped at a safe point because the agent is stopping; the next run finishes it"
            ),
        ),
        (Restore::HostFault, Restored::Cancelled(_)) => (
            Outcome::Failed,
            format!(
                "Failed: {what}; starting the last good unit {good} again stopped at a safe point because the agent is stopping"
            ),
        ),
        (Restore::Rollback, Restored::Failed(step, message)) => (
            Outcome::Failed,
            format!("Failed: {what}; the rollback to {good} failed too ({step:?}: {message}); the service is stopped"),
        ),
        (Restore::HostFault, Restored::Failed(step, message)) => (
            Outcome::Failed,
            format!("Failed: {what}; starting the last good unit {good} again failed too ({step:?}: {message})"),
        ),
    }
}

/// A failed apply's end: the recovery's outcome and verdict (`recovered`), the failed server's
/// own last word (`said`, quoted in the verdict and the quarantine), whether the service runs
/// now (`serving`: the verdict says when it is down), and what `decision` says follows.
pub fn failed(
    s: &Subject,
    recovered: (Outcome, String),
    said: Option<String>,
    serving: Serving,
    decision: &Decision,
) -> Conclusion {
    let (outcome, mut verdict) = recovered;
    if let Some(said) = &said {
        verdict.push_str(&format!("; the server said: {said}"));
    }
    if let Some(down) = serving.note(s.unit) {
        verdict.push_str(&format!("; {down}"));
    }
    let action = if decision.requeue { Action::Requeue(timing::FAILED_AGAIN) } else { Action::AwaitChange };
    Conclusion {
        outcome: Some(outcome),
        action,
        change: Change {
            finished: decision.finished,
            record: Some(outcome),
            quarantine_said: said.filter(|_| decision.quarantine),
            ..Change::default()
        },
        serving: Some(serving),
        ..Conclusion::said(verdict)
    }
}

#[cfg(test)]
mod tests;
