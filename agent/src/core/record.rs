//! What specd records about each unit (the state store's model, no I/O): what was desired and
//! applied, from where, when and with what result; the last good unit (the rollback target); the
//! quarantine of spec hashes that failed; the history of applies. `state` stores it.

use serde::{Deserialize, Serialize};

use crate::core::hold::Hold;
use crate::core::plan::Step;

/// How many history entries are kept per unit.
pub const HISTORY_MAX: usize = 200;

/// `2026-12-02T11:18:00Z` for unix seconds.
pub fn format_time(secs: u64) -> String {
    let (y, m, d, h, mi, s) = specd_spec::utc(secs);
    format!("{y:04}-{m:02}-{d:02}T{h:02}:{mi:02}:{s:02}Z")
}

/// Where a desired state came from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Source {
    File { path: String },
    Commit { repo: String, commit: String, path: String },
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::File { path } => write!(f, "file {path}"),
            Source::Commit { commit, path, .. } => {
                write!(f, "commit {} ({path})", specd_spec::short(commit))
            }
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Outcome {
    /// The desired unit runs, verified and ready.
    Applied,
    /// A stopped service was started again with the same unit.
    Started,
    /// The new unit failed; the last good one was restored and serves again.
    RolledBack,
    /// The new unit failed and there was nothing to roll back to (or rollback is off).
    Failed,
    /// Drift found and only reported (policy `report`).
    Reported,
    /// A person cleared the quarantine of a unit hash (`specd unquarantine`).
    Unquarantined,
    /// A hold was put on the unit (`specd suspend`, `specd rollback`'s pin, a sweep).
    HoldSet,
    /// A hold ended (`specd resume`, it expired, its sweep ended, the source moved past a pin).
    HoldCleared,
    /// The new unit cannot start on this host (its pre-flight failed): nothing was stopped or
    /// changed, and the unit is not tried again until it, or the host, changes.
    Refused,
}

/// How many specs of past good units are kept per unit (the targets of `specd rollback`).
pub const GOOD_SPECS_MAX: usize = 8;

/// A unit that ran and passed verification: the rollback target.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GoodUnit {
    pub sha256: String,
    pub text: String,
    pub source: Option<Source>,
    pub time: u64,
    /// The readiness endpoint to probe when it is restored.
    #[serde(default)]
    pub endpoint: Option<String>,
    #[serde(default)]
    pub base_url: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Quarantined {
    pub sha256: String,
    pub reason: String,
    pub source: Option<Source>,
    pub time: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HistoryEntry {
    pub time: u64,
    pub sha256: String,
    pub source: Option<Source>,
    pub outcome: Outcome,
    pub message: String,
    /// How the instance that this apply stopped had ended, when specd could tell.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_verdict: Option<String>,
    pub duration_ms: u64,
    /// The start this apply made of its unit, timed by phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub startup: Option<Startup>,
}

/// A start of a unit's server, timed: from specd's start of the unit until the server answered
/// ready (or until the wait for it ended: it died, or was not ready in time), and the phases the
/// engine's own lines told (`specd_spec::startup`), which add up to about that.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Startup {
    /// The unit started (its hash).
    pub sha256: String,
    /// When the wait ended (unix seconds).
    pub time: u64,
    /// It answered ready.
    pub ready: bool,
    /// From the start of the unit to the first ready answer (or the end of the wait).
    pub ms: u64,
    /// Each phase the engine's lines told, in order, and how long it took; empty when they
    /// told none (another log format, a verbosity that hides them, a journal that did not
    /// answer). The last one of a start that was not ready is where it ended.
    pub phases: Vec<PhaseTime>,
}

/// One phase of a start.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PhaseTime {
    /// `process`, `weights`, `engine`, `warmup`, `api` (`specd_spec::startup::PHASES`).
    pub phase: String,
    pub ms: u64,
}

impl Startup {
    /// The phases as a person reads them: `process 13.7s, weights 0.3s, engine 6.1s, api 2.4s`.
    pub fn phases_text(&self) -> String {
        let p: Vec<String> = self.phases.iter().map(|p| format!("{} {:.1}s", p.phase, p.ms as f64 / 1e3)).collect();
        p.join(", ")
    }

    /// What `status` and `history` say of it.
    pub fn describe(&self) -> String {
        let how = if self.ready { "ready after" } else { "ended after" };
        let mut s = format!("{how} {:.1}s", self.ms as f64 / 1e3);
        if !self.phases.is_empty() {
            s.push_str(&format!(" ({})", self.phases_text()));
        }
        if let (false, Some(last)) = (self.ready, self.phases.last()) {
            s.push_str(&format!("; it ended in phase {}", last.phase));
        }
        s
    }
}

/// An apply that started and has not finished (yet, or ever: the process died).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InProgress {
    pub sha256: String,
    pub pid: u32,
    pub phase: Phase,
    pub started: u64,
    /// This apply wrote the desired unit file (its WriteUnit step finished).
    #[serde(default)]
    pub wrote: bool,
}

impl InProgress {
    /// Whether the apply may have changed the host: past its start and its drain (which stops
    /// nothing; the pre-flight looks meanwhile). One killed before is no apply to finish.
    pub fn may_have_changed(&self) -> bool {
        !matches!(self.phase, Phase::Starting | Phase::At(Step::Drain))
    }
}

/// Where an apply in progress is: starting, or at a step (written as `starting` or the step's
/// name, as `status` shows it; a name this version does not know reads as `starting`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "String", into = "String")]
pub enum Phase {
    Starting,
    At(Step),
}

impl From<String> for Phase {
    fn from(s: String) -> Phase {
        Step::ALL.into_iter().find(|step| format!("{step:?}") == s).map_or(Phase::Starting, Phase::At)
    }
}

impl From<Phase> for String {
    fn from(p: Phase) -> String {
        p.to_string()
    }
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Phase::Starting => f.write_str("starting"),
            Phase::At(step) => write!(f, "{step:?}"),
        }
    }
}

/// Everything specd remembers about one unit.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct UnitState {
    pub unit: String,
    /// The last desired state specd was asked to reconcile (spec, rendered hash, source).
    #[serde(default)]
    pub desired: Option<DesiredRecord>,
    /// Hash of the unit specd last wrote (whatever the outcome).
    #[serde(default)]
    pub written_sha256: Option<String>,
    #[serde(default)]
    pub last_good: Option<GoodUnit>,
    #[serde(default)]
    pub quarantine: Vec<Quarantined>,
    #[serde(default)]
    pub in_progress: Option<InProgress>,
    #[serde(default)]
    pub history: Vec<HistoryEntry>,
    /// What the last verification of a speculative unit measured (its hash, when, the figure).
    #[serde(default)]
    pub speculation: Option<SpeculationRecord>,
    /// How the last instance that ended ended, recorded when specd saw it end (an apply's stop).
    #[serde(default)]
    pub last_ended: Option<LastEnded>,
    /// A hold that keeps the agent's hands off the unit (suspend, pin, sweep).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold: Option<Hold>,
    /// The port whose new connections specd's nftables rule refuses for this unit's drain
    /// (`service.drain_refuse_new`): recorded before the rule is added, cleared once it is
    /// removed; one left by an apply that was killed is removed by the unit's next reconcile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refusing: Option<u16>,
    /// The specs of the last good units (applied or started, verified and ready), oldest first,
    /// at most [`GOOD_SPECS_MAX`]: what `specd rollback` re-applies.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub good_specs: Vec<DesiredRecord>,
    /// The last start specd made of the unit (an apply's or a rollback's), timed by phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub startup: Option<Startup>,
}

/// The verdict on the last instance that ended, and the instance that followed it: true while
/// that instance is still the unit's current one (`status` then needs no journal).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LastEnded {
    /// `None`: no instance ended before it (the unit's first).
    pub summary: Option<String>,
    /// The invocation ID of the instance started after it.
    pub followed_by: String,
}

/// The speculation proof of one unit hash, as measured right after it became ready.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SpeculationRecord {
    pub sha256: String,
    pub time: u64,
    pub measured: crate::core::speculation::Speculation,
}

/// The desired state as last seen, kept so that `status` can compare without the spec file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DesiredRecord {
    pub sha256: String,
    pub source: Option<Source>,
    pub time: u64,
    pub spec: specd_spec::Spec,
}

impl UnitState {
    pub fn quarantined(&self, sha: &str) -> Option<&Quarantined> {
        self.quarantine.iter().find(|q| q.sha256 == sha)
    }

    /// The unit `sha` ran, verified and ready, before (an apply or start of it succeeded, or it is
    /// the last good unit).
    pub fn verified_before(&self, sha: &str) -> bool {
        self.last_good.as_ref().is_some_and(|g| g.sha256 == sha)
            || self.history.iter().any(|h| h.sha256 == sha && matches!(h.outcome, Outcome::Applied | Outcome::Started))
    }

    pub fn record(&mut self, e: HistoryEntry) {
        // A unit that ran, verified and ready: its spec is kept as a rollback target.
        if matches!(e.outcome, Outcome::Applied | Outcome::Started)
            && let Some(d) = self.desired.as_ref().filter(|d| d.sha256 == e.sha256)
        {
            let mut d = d.clone();
            d.time = e.time;
            self.good_specs.retain(|g| g.sha256 != d.sha256);
            self.good_specs.push(d);
            if self.good_specs.len() > GOOD_SPECS_MAX {
                let extra = self.good_specs.len() - GOOD_SPECS_MAX;
                self.good_specs.drain(..extra);
            }
        }
        self.history.push(e);
        if self.history.len() > HISTORY_MAX {
            let extra = self.history.len() - HISTORY_MAX;
            self.history.drain(..extra);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_apply_s_phase_is_written_as_status_shows_it_and_read_back() {
        for step in Step::ALL {
            let p = Phase::At(step);
            let json = serde_json::to_string(&p).unwrap();
            assert_eq!(json, format!("\"{step:?}\""));
            assert_eq!(serde_json::from_str::<Phase>(&json).unwrap(), p);
        }
        assert_eq!(serde_json::to_string(&Phase::Starting).unwrap(), "\"starting\"");
        assert_eq!(serde_json::from_str::<Phase>("\"starting\"").unwrap(), Phase::Starting);
        // A phase of another version: an apply was under way; where is not known.
        assert_eq!(serde_json::from_str::<Phase>("\"Defragment\"").unwrap(), Phase::Starting);
        // Every step is in Step::ALL (a new one must be added there to be read back).
        let names: std::collections::BTreeSet<String> = Step::ALL.iter().map(|s| format!("{s:?}")).collect();
        assert_eq!(names.len(), Step::ALL.len());
    }
}
