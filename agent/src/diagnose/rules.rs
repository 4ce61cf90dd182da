//! The ordered rule table: facts → verdict, first match wins. Pure.
//!
//! The order is the precedence of endings that look alike: a live instance is judged live;
//! the kernel's or systemd's word on an OOM kill beats the signal it caused and any CUDA text;
//! a stop timeout beats an earlier CUDA OOM (the SIGKILL is systemd's); the watchdog and the
//! start limit are systemd's own reasons; a CUDA OOM beats the SIGKILL SGLang sends itself;
//! a clean stop (asked, or on its own) is clean unless it ran a stale unit or specd stopped it
//! after a failed start; anything else that ended is a crash.

use super::Verdict;
use super::facts::Facts;
use crate::core::unit_state::ServiceResult;

/// One rule: when it holds, the instance gets its verdict.
pub(super) struct Rule {
    pub name: &'static str,
    pub verdict: Verdict,
    pub holds: fn(&Facts) -> bool,
}

/// The rules, in order. The last one always holds.
pub(super) const RULES: &[Rule] = &[
    Rule { name: "live, CUDA OOM logged", verdict: Verdict::CudaOom, holds: |f| f.live && !f.cuda.is_empty() },
    Rule { name: "live, stale config", verdict: Verdict::StaleConfigStart, holds: |f| f.live && f.stale.is_some() },
    Rule { name: "live", verdict: Verdict::Running, holds: |f| f.live },
    Rule {
        name: "OOM kill",
        verdict: Verdict::OomKill,
        holds: |f| {
            f.result_is(ServiceResult::OomKill)
                || f.systemd_oom.is_some()
                || (f.kernel_killed.is_some() && (f.sigkill_exit() || f.exit.is_none()))
        },
    },
    Rule {
        name: "stop timeout",
        verdict: Verdict::StopTimeoutKill,
        holds: |f| {
            f.stop_timeout.is_some()
                || (f.result_is(ServiceResult::Timeout)
                    && (f.stop_job.is_some() || f.killed9())
                    && f.start_timeout.is_none())
        },
    },
    Rule {
        name: "watchdog",
        verdict: Verdict::Watchdog,
        holds: |f| f.result_is(ServiceResult::Watchdog) || f.watchdog.is_some(),
    },
    Rule {
        name: "start limit",
        verdict: Verdict::StartLimitHit,
        holds: |f| f.result_is(ServiceResult::StartLimitHit) || f.start_limit.is_some(),
    },
    Rule { name: "CUDA OOM", verdict: Verdict::CudaOom, holds: |f| !f.cuda.is_empty() },
    Rule {
        name: "stopped by specd after start errors",
        verdict: Verdict::FailedStart,
        holds: |f| f.stopped_on_request() && f.rolled_back && (f.fatal.is_some() || !f.errors.is_empty()),
    },
    Rule {
        name: "stopped on request, stale config",
        verdict: Verdict::StaleConfigStart,
        holds: |f| f.stopped_on_request() && f.stale.is_some(),
    },
    Rule { name: "stopped on request", verdict: Verdict::CleanStop, holds: |f| f.stopped_on_request() },
    Rule {
        name: "ended by itself, stale config",
        verdict: Verdict::StaleConfigStart,
        holds: |f| f.ended_cleanly_by_itself() && f.stale.is_some(),
    },
    Rule { name: "ended by itself", verdict: Verdict::CleanStop, holds: |f| f.ended_cleanly_by_itself() },
    Rule {
        name: "crash",
        verdict: Verdict::Crash,
        holds: |f| f.exit.is_some() || f.result.as_ref().is_some_and(|r| *r != ServiceResult::Success),
    },
    Rule { name: "nothing says", verdict: Verdict::Unknown, holds: |_| true },
];

/// The first rule that holds.
pub(super) fn decide(f: &Facts) -> &'static Rule {
    RULES.iter().find(|r| (r.holds)(f)).expect("the last rule always holds")
}

#[cfg(test)]
mod tests {
    use super::super::facts::{Exit, Facts, Requester, Stale};
    use super::super::{Line, Origin};
    use super::*;

    fn line(origin: Origin, m: &str) -> Line {
        Line { origin, message: m.into(), ..Line::default() }
    }

    /// One line of each kind the rules look for, and a command line that differs from the disk.
    struct Lines {
        oom: Line,
        cuda: Line,
        stop: Line,
        timeout: Line,
        wd: Line,
        limit: Line,
        err: Line,
        note: Line,
        cmd: Vec<String>,
        disk: Vec<String>,
    }

    impl Lines {
        fn new() -> Lines {
            Lines {
                oom: line(Origin::Kernel, "Out of memory: Killed process 77 (python3)"),
                cuda: line(Origin::Service, "torch.OutOfMemoryError: CUDA out of memory."),
                stop: line(Origin::Systemd, "Stopping x.service..."),
                timeout: line(Origin::Systemd, "x.service: State 'stop-sigterm' timed out. Killing."),
                wd: line(Origin::Systemd, "x.service: Watchdog timeout (limit 1s)!"),
                limit: line(Origin::Systemd, "x.service: Start request repeated too quickly."),
                err: line(Origin::Service, "E load_model: failed to load model"),
                note: line(Origin::Specd, "specd: stopping x.service (rollback)"),
                cmd: vec!["a".to_string()],
                disk: vec!["b".to_string()],
            }
        }
    }

    fn rule(name: &str) -> usize {
        RULES.iter().position(|r| r.name == name).unwrap_or_else(|| panic!("no rule {name:?}"))
    }

    /// `f` is decided by rule `name`, and the rule before it does not hold.
    #[track_caller]
    fn fires(name: &str, f: &Facts) {
        let i = rule(name);
        assert_eq!(decide(f).name, name, "{f:#?}");
        if i > 0 {
            assert!(!(RULES[i - 1].holds)(f), "{:?} holds too: {f:#?}", RULES[i - 1].name);
        }
    }

    /// Each rule with facts where it fires (none before it holds), and the same facts made to
    /// satisfy the rule before it too, which then wins.
    #[test]
    fn each_rule_fires_on_its_facts_and_yields_to_the_rule_before_it() {
        let Lines { oom, cuda, stop, timeout, wd, limit, err, note, cmd, disk } = Lines::new();
        let stale = || Some(Stale { unreloaded: None, differs: Some((&cmd, &disk)) });
        let ended = |exit| Facts { exit: Some(exit), ..Facts::default() };

        let live = Facts { live: true, ..Facts::default() };
        let cases: Vec<(&str, Facts)> = vec![
            ("live, CUDA OOM logged", Facts { cuda: vec![(&cuda, "x")], ..live.clone() }),
            ("live, stale config", Facts { stale: stale(), ..live.clone() }),
            ("live", live.clone()),
            ("OOM kill", Facts { kernel_killed: Some(&oom), ..ended(Exit::Killed(9)) }),
            ("OOM kill", Facts { result: Some(ServiceResult::OomKill), ..Facts::default() }),
            ("stop timeout", Facts { stop_timeout: Some(&timeout), ..ended(Exit::Killed(9)) }),
            ("stop timeout", Facts { result: Some(ServiceResult::Timeout), ..ended(Exit::Killed(9)) }),
            ("watchdog", Facts { watchdog: Some(&wd), ..ended(Exit::Killed(6)) }),
            ("start limit", Facts { start_limit: Some(&limit), ..ended(Exit::Exited(3)) }),
            ("CUDA OOM", Facts { cuda: vec![(&cuda, "x")], ..ended(Exit::Killed(9)) }),
            (
                "stopped by specd after start errors",
                Facts {
                    stop_job: Some(&stop),
                    requester: Some(Requester::Specd(&note)),
                    rolled_back: true,
                    errors: vec![&err],
                    ..ended(Exit::Exited(0))
                },
            ),
            (
                "stopped on request, stale config",
                Facts { stop_job: Some(&stop), stale: stale(), ..ended(Exit::Killed(15)) },
            ),
            ("stopped on request", Facts { stop_job: Some(&stop), ..ended(Exit::Killed(15)) }),
            ("ended by itself, stale config", Facts { stale: stale(), ..ended(Exit::Exited(0)) }),
            ("ended by itself", ended(Exit::Exited(0))),
            ("crash", ended(Exit::Exited(3))),
            ("nothing says", Facts::default()),
        ];
        for (name, f) in &cases {
            fires(name, f);
        }
        let covered: Vec<&str> = cases.iter().map(|(n, _)| *n).collect();
        for r in RULES {
            assert!(covered.contains(&r.name), "rule {:?} has no case", r.name);
        }
    }

    /// Facts that two neighbouring rules both accept go to the earlier one.
    #[test]
    fn the_earlier_of_two_rules_that_hold_wins() {
        let Lines { oom, stop, timeout, wd, limit, err, note, cmd, disk, .. } = Lines::new();
        let cuda = line(Origin::Service, "RuntimeError: CUDA error: out of memory");
        let stale = || Some(Stale { unreloaded: Some((2, 1)), differs: Some((&cmd, &disk)) });
        let base = Facts { exit: Some(Exit::Killed(9)), ..Facts::default() };
        let both: Vec<(&str, Facts)> = vec![
            (
                "live, CUDA OOM logged",
                Facts { live: true, cuda: vec![(&cuda, "x")], stale: stale(), ..Facts::default() },
            ),
            ("live, stale config", Facts { live: true, stale: stale(), ..Facts::default() }),
            ("live", Facts { live: true, kernel_killed: Some(&oom), ..base.clone() }),
            ("OOM kill", Facts { kernel_killed: Some(&oom), stop_timeout: Some(&timeout), ..base.clone() }),
            ("stop timeout", Facts { stop_timeout: Some(&timeout), watchdog: Some(&wd), ..base.clone() }),
            ("watchdog", Facts { watchdog: Some(&wd), start_limit: Some(&limit), ..base.clone() }),
            ("start limit", Facts { start_limit: Some(&limit), cuda: vec![(&cuda, "x")], ..base.clone() }),
            (
                "CUDA OOM",
                Facts {
                    cuda: vec![(&cuda, "x")],
                    stop_job: Some(&stop),
                    requester: Some(Requester::Specd(&note)),
                    rolled_back: true,
                    errors: vec![&err],
                    ..base.clone()
                },
            ),
            (
                "stopped by specd after start errors",
                Facts { stop_job: Some(&stop), rolled_back: true, errors: vec![&err], stale: stale(), ..base.clone() },
            ),
            ("stopped on request, stale config", Facts { stop_job: Some(&stop), stale: stale(), ..base.clone() }),
            (
                "ended by itself, stale config",
                Facts { exit: Some(Exit::Exited(0)), stale: stale(), ..Facts::default() },
            ),
            ("ended by itself", Facts { exit: Some(Exit::Exited(0)), ..Facts::default() }),
            ("crash", Facts { exit: Some(Exit::Exited(3)), ..Facts::default() }),
        ];
        for (name, f) in &both {
            let i = rule(name);
            assert!((RULES[i + 1].holds)(f), "{:?} should hold too: {f:#?}", RULES[i + 1].name);
            assert_eq!(decide(f).name, *name, "{f:#?}");
        }
    }

    /// The distinctions the rules exist for.
    #[test]
    fn look_alike_endings_are_told_apart() {
        let stop = line(Origin::Systemd, "Stopping x.service...");
        let kill = line(Origin::Systemd, "x.service: Killing process 77 (python3) with signal SIGKILL.");
        let start = line(Origin::Systemd, "x.service: Starting timed out. Terminating.");
        // A SIGKILL after a stop that systemd did not send (SGLang, drained) is a clean stop...
        let f = Facts { stop_job: Some(&stop), exit: Some(Exit::Killed(9)), ..Facts::default() };
        assert_eq!(decide(&f).verdict, Verdict::CleanStop);
        // ...systemd's own SIGKILL during a stop is not.
        let f = Facts { sigkills: vec![&kill], ..f };
        assert_eq!(decide(&f).verdict, Verdict::Crash);
        // A start timeout is not a stop timeout.
        let f = Facts {
            result: Some(ServiceResult::Timeout),
            exit: Some(Exit::Killed(9)),
            start_timeout: Some(&start),
            ..Facts::default()
        };
        assert_eq!(decide(&f).verdict, Verdict::Crash);
        // Exit 137 with the kernel's kill line is an OOM kill; exit 1 with it is not.
        let oom = line(Origin::Kernel, "Memory cgroup out of memory: Killed process 77 (python3)");
        let f = Facts { kernel_killed: Some(&oom), exit: Some(Exit::Exited(137)), ..Facts::default() };
        assert_eq!(decide(&f).verdict, Verdict::OomKill);
        let f = Facts { exit: Some(Exit::Exited(1)), ..f };
        assert_eq!(decide(&f).verdict, Verdict::Crash);
    }
}
