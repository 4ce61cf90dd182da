//! Whether a hold on a unit keeps the agent's hands off it now: pure, decided from the hold, the
//! time, whether the sweep's process lives and the source's desired unit hash.
//!
//! A unit's state carries at most one hold: `specd suspend UNIT [--for D] [--reason R]`
//! (Suspend), `specd rollback UNIT [--to HASH]` (Pin) or a running `specd sweep` (Sweep, with its
//! process's pid and start time: a later process that got the same pid is not the sweep). It is
//! set and cleared only under the unit's lock, and both are history entries. Everyone who asks —
//! the agent's worker and its reconcile, a hand apply, `rollback`, `suspend`, `resume`, a sweep —
//! asks [`effective`], through the host's gate (`Host::hold_effect`, `Host::hold_in_effect`);
//! no other code reads a hold's `until` or process.
//!
//! - A Suspend or a live Sweep keeps the agent's hands off: it records the source's desired state
//!   and observes (`status` and the metrics show the drift), nothing more.
//! - A Pin keeps it off while the source's desired unit is the one it had when pinned, and ends
//!   once the source has a new one. A rollback's pin names the rollback's process until that
//!   unit serves, so a rollback killed half-way leaves no pin over a unit that is down.
//! - A hold past its `until`, or whose process is gone, has ended: cleared, and the agent acts. A
//!   hold that names no process (a suspend, a pin) is in effect until its `until`, `specd resume`
//!   or (a pin) the source's new unit. A sweep's hold lasts 2 h and is pushed on every 30 min;
//!   the sweep's exit wakes the unit's worker through a pidfd.
//! - A hand `specd apply` is not stopped by a Suspend or a Pin, and is refused while a live sweep
//!   holds the unit. The agent asks again under the unit's lock, so a hold set while its
//!   reconcile waited for the lock makes it observe only.

use serde::{Deserialize, Serialize};

use crate::core::record::format_time;

/// What kind of hold keeps the agent's hands off a unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum HoldKind {
    /// `specd suspend`: hands off until resumed (or `until`).
    Suspend,
    /// `specd rollback`: the unit stays at `pinned_sha256` until the source's desired unit is a
    /// new one (differs from `desired_at_pin`) or the operator resumes it.
    Pin,
    /// A sweep (a process that tries specs on the unit): hands off while that process lives.
    Sweep,
}

impl std::fmt::Display for HoldKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            HoldKind::Suspend => "suspended",
            HoldKind::Pin => "pinned",
            HoldKind::Sweep => "held by a sweep",
        })
    }
}

/// A hold on a unit: the agent leaves it alone (observes and reports only) while the hold is in
/// effect (see `hold::effective`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hold {
    pub kind: HoldKind,
    /// Who put it: `root@host (specd suspend)`, `specd sweep qwen-mtp-steps`.
    pub by: String,
    /// Unix seconds.
    pub since: u64,
    /// When it expires (None: until resumed).
    #[serde(default)]
    pub until: Option<u64>,
    #[serde(default)]
    pub reason: Option<String>,
    /// Sweep: the sweep's process; once it is gone the hold ends.
    #[serde(default)]
    pub pid: Option<u32>,
    /// Sweep: when that process started (clock ticks after boot, `/proc/PID/stat`): a later
    /// process that got the same pid is not the sweep. Absent (an older specd's hold): the pid
    /// alone decides.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid_start: Option<u64>,
    /// Pin: the unit hash pinned.
    #[serde(default)]
    pub pinned_sha256: Option<String>,
    /// Pin: the desired unit hash the source had when the pin was set.
    #[serde(default)]
    pub desired_at_pin: Option<String>,
}

impl Hold {
    /// A hold of `kind` put by `by` at `since`, with nothing else said (no end, reason, process
    /// or pin): the fields a kind uses are set on top of it.
    pub fn new(kind: HoldKind, by: impl Into<String>, since: u64) -> Hold {
        Hold {
            kind,
            by: by.into(),
            since,
            until: None,
            reason: None,
            pid: None,
            pid_start: None,
            pinned_sha256: None,
            desired_at_pin: None,
        }
    }

    /// One line for people: `suspended by root@h (specd suspend) since … until …: reason`.
    pub fn describe(&self) -> String {
        let mut s = format!("{} by {} since {}", self.kind, self.by, format_time(self.since));
        match self.until {
            Some(u) => s.push_str(&format!(" until {}", format_time(u))),
            None if self.kind == HoldKind::Sweep => {}
            None if self.kind == HoldKind::Pin => s.push_str(" until the source has a new unit or `specd resume`"),
            None => s.push_str(" until `specd resume`"),
        }
        if let Some(p) = &self.pinned_sha256 {
            s.push_str(&format!(", at unit {}", specd_spec::short(p)));
        }
        match (self.pid, self.kind) {
            (Some(pid), HoldKind::Sweep) => s.push_str(&format!(", sweep pid {pid}")),
            (Some(pid), _) => s.push_str(&format!(", while its process {pid} runs")),
            (None, _) => {}
        }
        if let Some(r) = &self.reason {
            s.push_str(&format!(": {r}"));
        }
        s
    }
}

/// What a hold means for the agent's next reconcile of its unit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HoldEffect {
    /// The hold does not stop the agent (nothing to clear).
    Acts,
    /// Observe and report only; why, for the log and status.
    HandsOff(String),
    /// The hold has ended: clear it (recorded with why), then reconcile as usual.
    Expired(String),
}

/// The effect of a unit's `hold` (if it has one) at unix time `now`: the one hold decision (the
/// agent's worker, its reconcile, a hand apply, rollback, suspend, resume and a sweep all ask it,
/// through `Host::hold_effect` or `Host::hold_in_effect`).
///
/// - `pid_alive`: the hold's process (a sweep's, a rollback's pending pin) still runs; ignored
///   when the hold names none. A hold that names no process is no process's: nothing ends it
///   but its `until`, `specd resume` or (a pin) the source's new unit.
/// - `desired_sha`: the source's desired unit now, for the one who follows it (the agent); a
///   pin ends once it differs from the one the source had when pinned. `None`: the one asking
///   does not follow the source (a one-shot command): a pin holds.
pub fn effective(hold: Option<&Hold>, now: u64, pid_alive: bool, desired_sha: Option<&str>) -> HoldEffect {
    let Some(hold) = hold else { return HoldEffect::Acts };
    if let Some(until) = hold.until
        && now >= until
    {
        return HoldEffect::Expired(format!("it expired at {}", format_time(until)));
    }
    if let Some(pid) = hold.pid
        && !pid_alive
    {
        return HoldEffect::Expired(format!("its process {pid} is gone"));
    }
    match hold.kind {
        HoldKind::Suspend => HoldEffect::HandsOff(format!("suspended by {}", hold.by)),
        HoldKind::Sweep => HoldEffect::HandsOff(format!("a sweep holds it ({})", hold.by)),
        HoldKind::Pin => match (&hold.desired_at_pin, desired_sha) {
            // The source has a unit that did not exist when the pin was set: move forward.
            (Some(at), Some(desired_sha)) if at != desired_sha => HoldEffect::Expired(format!(
                "the source's desired unit is {} now (it was {} when pinned)",
                specd_spec::short(desired_sha),
                specd_spec::short(at)
            )),
            _ => HoldEffect::HandsOff(format!(
                "pinned at unit {} by {} until the source has a new unit",
                hold.pinned_sha256.as_deref().map_or("-", specd_spec::short),
                hold.by
            )),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hold(kind: HoldKind) -> Hold {
        Hold::new(kind, "root@h (specd suspend)", 100)
    }

    #[test]
    fn no_hold_no_effect() {
        assert_eq!(effective(None, 0, false, Some("d")), HoldEffect::Acts);
    }

    #[test]
    fn a_suspend_keeps_hands_off_until_it_expires() {
        let mut h = hold(HoldKind::Suspend);
        assert!(
            matches!(effective(Some(&h), 1_000_000, false, Some("d")), HoldEffect::HandsOff(w) if w.contains("suspended by root@h"))
        );
        h.until = Some(200);
        assert!(matches!(effective(Some(&h), 199, false, Some("d")), HoldEffect::HandsOff(_)));
        assert!(
            matches!(effective(Some(&h), 200, false, Some("d")), HoldEffect::Expired(w) if w.contains("expired at 1970-01-01T00:03:20Z"))
        );
    }

    #[test]
    fn a_sweep_hold_ends_with_its_process() {
        let mut h = hold(HoldKind::Sweep);
        h.pid = Some(42);
        assert!(
            matches!(effective(Some(&h), 150, true, Some("d")), HoldEffect::HandsOff(w) if w.contains("a sweep holds it"))
        );
        assert!(
            matches!(effective(Some(&h), 150, false, Some("d")), HoldEffect::Expired(w) if w.contains("process 42 is gone"))
        );
    }

    #[test]
    fn a_pin_holds_until_the_source_has_a_new_unit() {
        let mut h = hold(HoldKind::Pin);
        h.pinned_sha256 = Some("aaaaaaaaaaaaaaaa".into());
        h.desired_at_pin = Some("bbbbbbbbbbbbbbbb".into());
        // The source still wants the unit that was rolled back from: stay.
        assert!(
            matches!(effective(Some(&h), 150, false, Some("bbbbbbbbbbbbbbbb")), HoldEffect::HandsOff(w) if w.contains("pinned at unit aaaaaaaaaaaa"))
        );
        // A new commit with a new unit: move forward (even to the pinned unit itself).
        assert!(
            matches!(effective(Some(&h), 150, false, Some("cccccccccccccccc")), HoldEffect::Expired(w) if w.contains("cccccccccccc now"))
        );
        // A pin with a deadline expires like any hold.
        h.until = Some(150);
        assert!(matches!(effective(Some(&h), 150, false, Some("bbbbbbbbbbbbbbbb")), HoldEffect::Expired(_)));
    }

    /// The whole table: every kind, with and without a process (alive or gone), before and
    /// after its `until`, for the agent (which knows the source's desired unit) and for a
    /// command (which does not).
    #[test]
    fn the_effect_of_every_kind_of_hold_in_every_case() {
        use HoldEffect::{Acts, Expired, HandsOff};
        let short = |e: HoldEffect| match e {
            Acts => "acts",
            HandsOff(_) => "hands off",
            Expired(_) => "expired",
        };
        let (pinned_from, newer) = ("bbbbbbbbbbbbbbbb", "cccccccccccccccc");
        for kind in [HoldKind::Suspend, HoldKind::Pin, HoldKind::Sweep] {
            for pid in [None, Some(42)] {
                for alive in [true, false] {
                    for (now, until) in [(150, None), (150, Some(200)), (200, Some(200))] {
                        for desired in [None, Some(pinned_from), Some(newer)] {
                            let h = Hold {
                                pid,
                                until,
                                desired_at_pin: (kind == HoldKind::Pin).then(|| pinned_from.to_string()),
                                ..hold(kind)
                            };
                            let ended = until.is_some_and(|u| now >= u) || (pid.is_some() && !alive);
                            let moved_on = kind == HoldKind::Pin && desired == Some(newer);
                            let want = if ended || moved_on {
                                "expired"
                            } else {
                                // A hold that names no process: in effect until it expires,
                                // whatever the liveness said (it is nobody's to lose).
                                "hands off"
                            };
                            let got = short(effective(Some(&h), now, alive, desired));
                            assert_eq!(
                                got, want,
                                "{kind:?} pid {pid:?} alive {alive} at {now} until {until:?} for {desired:?}"
                            );
                        }
                    }
                }
            }
        }
        assert_eq!(short(effective(None, 150, false, None)), "acts");
    }
}
