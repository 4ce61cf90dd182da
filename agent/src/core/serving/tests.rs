use super::*;
use crate::core::unit_state::ActiveState;

const MARK: u64 = 1_800_000_000_000;

fn drain() -> ServingState {
    ServingState::Drain { why: "specd is applying unit 1a2b3c4d".into(), since: 1 }
}

#[test]
fn every_agent_check_reply_is_one_line_ended_by_a_newline() {
    let down = ServingState::Down { why: "Failed: q.service:\nStart failed\r\n".into(), since: 1 };
    let cases = [
        (Some(ServingState::Ready { since: 1 }), "ready up\n"),
        (Some(drain()), "drain\n"),
        (Some(down), "down #Failed: q.service: Start failed  \n"),
        (None, "down #specd has no serving state for this unit (not concluded on since the host started)\n"),
    ];
    for (state, want) in cases {
        let r = agent_reply(state.as_ref());
        assert_eq!(r, want);
        assert_eq!(r.matches('\n').count(), 1, "{r:?}");
        assert!(!r.contains('\r'), "{r:?}");
    }
    let long = ServingState::Down { why: "x".repeat(500), since: 1 };
    assert_eq!(agent_reply(Some(&long)).len(), "down #".len() + 200 + 1);
}

#[test]
fn the_http_check_is_200_only_when_ready_and_says_why_otherwise() {
    assert_eq!(http_answer(Some(&ServingState::Ready { since: 1 })), (200, "ready\n".into()));
    assert_eq!(http_answer(Some(&drain())), (503, "drain: specd is applying unit 1a2b3c4d\n".into()));
    let (code, body) = http_answer(None);
    assert_eq!(code, 503);
    assert!(body.starts_with("down: specd has no serving state"), "{body}");
    assert_eq!(answered(None), Word::Down);
    assert_eq!(answered(Some(&drain())), Word::Drain);
}

#[test]
fn a_state_is_the_same_whatever_its_time_and_reads_with_its_age() {
    let a = ServingState::Drain { why: "w".into(), since: 1 };
    assert!(a.same(&ServingState::Drain { why: "w".into(), since: 9 }));
    assert!(!a.same(&ServingState::Drain { why: "v".into(), since: 1 }));
    assert!(!a.same(&ServingState::Down { why: "w".into(), since: 1 }));
    assert_eq!(a.describe(43), "drain (for 42 s): w");
    assert_eq!(ServingState::Ready { since: 0 }.describe(600), "ready (for 10 min)");
    assert_eq!(ServingState::Ready { since: 0 }.describe(3 * 86_400), "ready (for 3 d)");
    let text = serde_json::to_string(&a).unwrap();
    assert_eq!(text, r#"{"state":"drain","why":"w","since":1}"#);
    assert_eq!(serde_json::from_str::<ServingState>(&text).unwrap(), a);
}

#[test]
fn a_poll_is_written_at_once_when_its_balancer_is_new_or_its_word_turns() {
    let mut log = PollLog::default();
    let mut at = MARK;
    let mut poll = |word, dt: u64| {
        at += dt;
        log.record(CheckKind::AgentCheck, "10.0.0.5", at, word)
    };
    assert!(poll(Word::Ready, 0), "a new load balancer");
    assert!(!poll(Word::Ready, 500), "the same answer again");
    assert!(poll(Word::Drain, 500), "drain, where it was ready");
    assert!(poll(Word::Down, 500), "every answer but ready: what an apply waits for");
    assert!(poll(Word::Ready, 500), "ready again");
    assert!(!poll(Word::Ready, 500));
    let p = &log.pollers["agent-check 10.0.0.5"];
    assert_eq!((p.last_ms, p.gap_ms, p.answered, p.streak), (MARK + 2500, 500, Word::Ready, 2));
    // Bounded: the oldest goes.
    for i in 0..(POLLERS_KEPT as u64 + 5) {
        log.record(CheckKind::Http, &format!("10.1.0.{i}"), MARK + 10_000 + i, Word::Ready);
    }
    assert_eq!(log.pollers.len(), POLLERS_KEPT);
    assert!(!log.pollers.contains_key("agent-check 10.0.0.5"));
}

/// A clock set back while a load balancer reads `ready`: its run of ready answers counts from
/// the first poll after it, not from a time still to come (which would hold the unit untaken
/// for as long as the clock went back).
#[test]
fn a_clock_set_back_does_not_hold_a_unit_untaken() {
    let b = Balancers::default();
    let rise = b.rise.as_millis() as u64;
    let mut log = PollLog::default();
    log.record(CheckKind::AgentCheck, "10.0.0.5", MARK + 3_600_000, Word::Ready);
    log.record(CheckKind::AgentCheck, "10.0.0.5", MARK, Word::Ready);
    assert!(!taken(&log, MARK + 500, b));
    log.record(CheckKind::AgentCheck, "10.0.0.5", MARK + rise, Word::Ready);
    assert!(taken(&log, MARK + rise, b), "{:?}", log.pollers);
}

/// A poll log where `addr` polled every `every_ms` from `first` to `last` (ms from the mark),
/// answered ready before the mark and `after` from it on.
fn polled(log: &mut PollLog, kind: CheckKind, addr: &str, every_ms: u64, first: i64, last: i64, after: Word) {
    let mut t = first;
    while t <= last {
        let word = if t < 0 { Word::Ready } else { after };
        log.record(kind, addr, (MARK as i64 + t) as u64, word);
        t += every_ms as i64;
    }
}

fn done(s: Seen) -> Told {
    match s {
        Seen::Done(t) => t,
        Seen::Waiting { pending } => panic!("still waiting for {pending:?}"),
    }
}

const BUDGET: Duration = Duration::from_secs(30);

#[test]
fn with_no_load_balancer_the_stop_waits_only_for_the_settle_time_and_says_so() {
    let log = PollLog::default();
    let t = done(seen(&log, MARK, MARK, Balancers::default(), BUDGET));
    assert!(!t.kept_away());
    assert_eq!(t.words(), "no load balancer polls this unit: nothing keeps traffic away during the stop");
    let b = Balancers { settle: Duration::from_secs(2), ..Balancers::default() };
    assert_eq!(seen(&log, MARK, MARK + 1999, b, BUDGET), Seen::Waiting { pending: vec![] });
    let t = done(seen(&log, MARK, MARK + 2000, b, BUDGET));
    assert_eq!(
        t.words(),
        "no load balancer polls this unit; waited the settle time of 2 s (load_balancer.settle_sec) for those specd cannot see"
    );
    // Its own setting: waited whatever the drain budget (of 0, the default, too).
    assert_eq!(seen(&log, MARK, MARK + 1999, b, Duration::ZERO), Seen::Waiting { pending: vec![] });
    assert_eq!(done(seen(&log, MARK, MARK + 2000, b, Duration::ZERO)).settled, Duration::from_secs(2));
    // One that polled long ago (more than three of its intervals, and 10 s) is not waited for.
    let mut old = PollLog::default();
    polled(&mut old, CheckKind::AgentCheck, "10.0.0.5", 2000, -60_000, -20_000, Word::Drain);
    assert_eq!(done(seen(&old, MARK, MARK, Balancers::default(), BUDGET)).saw, Vec::<String>::new());
}

#[test]
fn an_agent_check_balancer_has_seen_drain_once_it_was_answered_drain_after_the_mark() {
    let mut log = PollLog::default();
    polled(&mut log, CheckKind::AgentCheck, "127.0.0.1", 500, -5000, -100, Word::Drain);
    let b = Balancers::default();
    assert_eq!(seen(&log, MARK, MARK + 300, b, BUDGET), Seen::Waiting { pending: vec!["127.0.0.1".into()] });
    log.record(CheckKind::AgentCheck, "127.0.0.1", MARK + 400, Word::Drain);
    let t = done(seen(&log, MARK, MARK + 600, b, BUDGET));
    assert!(t.kept_away());
    assert_eq!(t.words(), "1 load balancer (127.0.0.1) saw drain after 0.6 s");
    // A second one, which polls every 2 s: waited for too.
    polled(&mut log, CheckKind::AgentCheck, "10.0.0.9", 2000, -6000, -1000, Word::Drain);
    assert_eq!(seen(&log, MARK, MARK + 600, b, BUDGET), Seen::Waiting { pending: vec!["10.0.0.9".into()] });
    log.record(CheckKind::AgentCheck, "10.0.0.9", MARK + 1000, Word::Drain);
    assert_eq!(
        done(seen(&log, MARK, MARK + 1100, b, BUDGET)).words(),
        "2 load balancers (10.0.0.9, 127.0.0.1) saw drain after 1.1 s"
    );
}

#[test]
fn an_http_checking_balancer_has_seen_drain_after_its_fall_in_a_row() {
    let mut log = PollLog::default();
    polled(&mut log, CheckKind::Http, "10.0.0.7", 1000, -4000, 1000, Word::Drain);
    let b = Balancers { http_fall: 3, ..Balancers::default() };
    assert!(matches!(seen(&log, MARK, MARK + 1500, b, BUDGET), Seen::Waiting { .. }));
    log.record(CheckKind::Http, "10.0.0.7", MARK + 2000, Word::Drain);
    let t = done(seen(&log, MARK, MARK + 2000, b, BUDGET));
    assert_eq!(t.words(), "1 load balancer (10.0.0.7 (HTTP check)) saw drain after 2.0 s");
    // With `fall 1`, the first answer.
    let mut log = PollLog::default();
    polled(&mut log, CheckKind::Http, "10.0.0.7", 1000, -4000, 0, Word::Down);
    assert!(done(seen(&log, MARK, MARK, Balancers { http_fall: 1, ..b }, BUDGET)).kept_away());
}

#[test]
fn a_balancer_that_stops_polling_or_the_budget_ends_the_wait_and_is_named() {
    let b = Balancers::default();
    // It polled every second until just before the mark, then never again: gone after 10 s.
    let mut log = PollLog::default();
    polled(&mut log, CheckKind::AgentCheck, "10.0.0.5", 1000, -5000, -10, Word::Drain);
    polled(&mut log, CheckKind::AgentCheck, "10.0.0.6", 1000, -5000, 0, Word::Drain);
    assert!(matches!(seen(&log, MARK, MARK + 9000, b, BUDGET), Seen::Waiting { .. }));
    let t = done(seen(&log, MARK, MARK + 10_001, b, BUDGET));
    assert_eq!((t.saw.clone(), t.missed.clone()), (vec!["10.0.0.6".to_string()], vec!["10.0.0.5".to_string()]));
    assert!(!t.kept_away());
    assert_eq!(
        t.words(),
        "1 of 2 load balancers (10.0.0.5) did not see drain within 10.0 s (drain_timeout_sec 30 s); 10.0.0.6 did: they may still send new requests during the stop"
    );
    // The budget: what is pending then is missed.
    let mut log = PollLog::default();
    polled(&mut log, CheckKind::AgentCheck, "10.0.0.5", 1000, -5000, 2000, Word::Ready);
    assert!(matches!(seen(&log, MARK, MARK + 2500, b, Duration::from_secs(3)), Seen::Waiting { .. }));
    let t = done(seen(&log, MARK, MARK + 3000, b, Duration::from_secs(3)));
    assert_eq!(t.missed, ["10.0.0.5"]);
}

/// `drain_timeout_sec` 0 (the default) with a load balancer polling: the stop still waits until
/// it saw drain, and one that stops polling is given its polls' time (two of its intervals).
#[test]
fn with_no_drain_budget_the_stop_still_waits_for_each_load_balancer_that_polls() {
    let b = Balancers::default();
    let mut log = PollLog::default();
    polled(&mut log, CheckKind::AgentCheck, "10.0.0.5", 500, -5000, -100, Word::Drain);
    assert_eq!(seen(&log, MARK, MARK + 100, b, Duration::ZERO), Seen::Waiting { pending: vec!["10.0.0.5".into()] });
    log.record(CheckKind::AgentCheck, "10.0.0.5", MARK + 400, Word::Drain);
    let t = done(seen(&log, MARK, MARK + 450, b, Duration::ZERO));
    assert!(t.kept_away(), "{}", t.words());
    // One that answers (or is answered) otherwise, or stopped polling: missed after 2 × 500 ms.
    let mut log = PollLog::default();
    polled(&mut log, CheckKind::AgentCheck, "10.0.0.5", 500, -5000, 0, Word::Ready);
    assert!(matches!(seen(&log, MARK, MARK + 999, b, Duration::ZERO), Seen::Waiting { .. }));
    let t = done(seen(&log, MARK, MARK + 1000, b, Duration::ZERO));
    assert_eq!(
        t.words(),
        "1 of 1 load balancer (10.0.0.5) did not see drain within 1.0 s (drain_timeout_sec 0 s): they may still send new requests during the stop"
    );
    // An HTTP check with `fall 3` every second: three polls and one more.
    let mut log = PollLog::default();
    polled(&mut log, CheckKind::Http, "10.0.0.7", 1000, -5000, 0, Word::Ready);
    assert!(matches!(seen(&log, MARK, MARK + 3999, b, Duration::ZERO), Seen::Waiting { .. }));
}

/// A one-shot command that only began answering the agent-check (no agent runs) has seen no poll
/// yet: it gives the load balancers their first polls' time before it says none polls.
#[test]
fn a_command_that_only_began_answering_waits_for_the_first_polls_before_it_says_none_polls() {
    let since = MARK - 200;
    let b = Balancers { answering_since_ms: Some(since), ..Balancers::default() };
    let mut log = PollLog::default();
    assert_eq!(seen(&log, MARK, MARK + 100, b, Duration::ZERO), Seen::Waiting { pending: vec![] });
    // HAProxy's first poll, answered drain: it saw it.
    log.record(CheckKind::AgentCheck, "127.0.0.1", MARK + 300, Word::Drain);
    assert!(done(seen(&log, MARK, MARK + 300, b, Duration::ZERO)).kept_away());
    // None polls within the bound: said so, and that this command answered only so long.
    let log = PollLog::default();
    let first = timing::FIRST_POLLS_WITHIN.as_millis() as u64;
    assert_eq!(seen(&log, MARK, since + first - 1, b, Duration::ZERO), Seen::Waiting { pending: vec![] });
    let t = done(seen(&log, MARK, since + first, b, Duration::ZERO));
    assert_eq!(
        t.words(),
        "no load balancer polled this unit in the 5.0 s this command has answered their checks (no agent runs): nothing keeps traffic away during the stop"
    );
}

fn running(ready: bool) -> Observed {
    Observed {
        active_state: ActiveState::Active,
        main_pid: 7,
        main_cmdline: Some(vec!["/opt/srv".into(), "--port".into(), "8000".into()]),
        ready: Some(ready),
        ..Default::default()
    }
}

#[test]
fn observed_ready_only_when_its_ready_server_runs_a_verified_unit() {
    let argv: Vec<String> = vec!["/opt/srv".into(), "--port".into(), "8000".into()];
    let other: Vec<String> = vec!["/opt/srv".into(), "--port".into(), "9000".into()];
    assert_eq!(observed(&running(true), Some(&argv), 5), ServingState::Ready { since: 5 });
    let down = |o: &Observed, v: Option<&[String]>| observed(o, v, 5).why().map(str::to_string);
    assert_eq!(down(&running(true), None).as_deref(), Some("it runs a unit specd has not verified"));
    assert_eq!(
        down(&running(true), Some(&other)).as_deref(),
        Some("its process does not run the verified unit's command line")
    );
    assert_eq!(down(&running(false), Some(&argv)).as_deref(), Some("its server is not ready"));
    // A unit file written since systemd loaded it changes nothing of what the process runs.
    let reload = Observed { need_daemon_reload: true, ..running(true) };
    assert_eq!(observed(&reload, Some(&argv), 5), ServingState::Ready { since: 5 });
    let stopped = Observed { active_state: ActiveState::Inactive, main_pid: 0, ..running(false) };
    assert_eq!(down(&stopped, Some(&argv)).as_deref(), Some("its service is not running"));
    // What a reconcile's conclusion says, resolved.
    let ready = ServingState::Ready { since: 1 };
    assert_eq!(resolve(&After::Keep, Some(&drain()), &running(false), Some(&argv), 5), None);
    // Kept, a `ready` would outlive what it said: as observed.
    for told in [Some(&ready), None] {
        let down = ServingState::Down { why: "its server is not ready".into(), since: 5 };
        assert_eq!(resolve(&After::Keep, told, &running(false), Some(&argv), 5), Some(down));
    }
    assert_eq!(resolve(&After::Ready, None, &stopped, None, 5), Some(ServingState::Ready { since: 5 }));
    assert_eq!(
        resolve(&After::Down("x".into()), Some(&ready), &running(true), Some(&argv), 5),
        Some(ServingState::Down { why: "x".into(), since: 5 })
    );
    assert_eq!(
        resolve(&After::Observed, Some(&drain()), &running(true), Some(&argv), 5),
        Some(ServingState::Ready { since: 5 })
    );
}

/// What a one-shot command waits for at its end: each load balancer still polling that was last
/// answered another word than the unit's state now.
#[test]
fn a_one_shot_command_waits_for_each_load_balancer_still_polling_to_read_what_it_leaves() {
    let ready = ServingState::Ready { since: 1 };
    let mut log = PollLog::default();
    // HAProxy every 500 ms, last told drain; a second one gone (its last poll 30 s ago).
    for i in 0..4 {
        log.record(CheckKind::AgentCheck, "10.0.0.5", MARK + i * 500, Word::Drain);
    }
    log.record(CheckKind::AgentCheck, "10.0.0.9", MARK - 30_000, Word::Drain);
    let now = MARK + 2_000;
    assert_eq!(unread(&log, Some(&ready), now), ["10.0.0.5"]);
    // The state it leaves is what it last told: nothing to wait for.
    assert_eq!(unread(&log, Some(&drain()), now), Vec::<String>::new());
    // Its next poll reads ready.
    log.record(CheckKind::AgentCheck, "10.0.0.5", now, Word::Ready);
    assert_eq!(unread(&log, Some(&ready), now + 100), Vec::<String>::new());
    // No state is answered down: one told ready must read it.
    assert_eq!(unread(&log, None, now + 100), ["10.0.0.5"]);
    // One that stopped polling for three of its intervals (at least 10 s) is not waited for.
    assert_eq!(unread(&log, None, now + 10_001), Vec::<String>::new());
}

#[test]
fn a_unit_told_ready_is_taken_once_each_balancer_still_polling_was_answered_ready() {
    let b = Balancers { http_fall: 2, rise: Duration::ZERO, ..Balancers::default() };
    // None polls: taken at once (nothing specd can wait for).
    assert!(taken(&PollLog::default(), MARK, b));
    // An agent-check answered down until the mark (told ready then), polling every 500 ms.
    let down = |log: &mut PollLog, kind, addr: &str, every: u64, from: u64, to: u64| {
        for t in (MARK - from..=MARK - to).step_by(every as usize) {
            log.record(kind, addr, t, Word::Down);
        }
    };
    let mut log = PollLog::default();
    down(&mut log, CheckKind::AgentCheck, "127.0.0.1", 500, 5000, 100);
    assert!(!taken(&log, MARK + 300, b), "not polled since it was told ready");
    log.record(CheckKind::AgentCheck, "127.0.0.1", MARK + 400, Word::Ready);
    assert!(taken(&log, MARK + 400, b));
    // An HTTP check needs as many ready answers in a row as its fall (taken as its rise).
    down(&mut log, CheckKind::Http, "10.0.0.7", 1000, 4000, 1000);
    log.record(CheckKind::Http, "10.0.0.7", MARK, Word::Ready);
    assert!(!taken(&log, MARK + 500, b));
    log.record(CheckKind::Http, "10.0.0.7", MARK + 1000, Word::Ready);
    assert!(taken(&log, MARK + 1000, b));
    // One that stopped polling long ago is not waited for.
    let mut old = PollLog::default();
    down(&mut old, CheckKind::AgentCheck, "10.0.0.5", 2000, 60_000, 20_000);
    assert!(taken(&old, MARK, b));
}

/// HAProxy with a health check besides its agent-check takes a server its check found down (its
/// engine stopped) back only after `rise` passing checks, whatever the agent answers: a unit told
/// ready counts as taken only `rise` after its load balancer first read `ready`.
#[test]
fn a_restarted_unit_is_taken_only_its_rise_after_its_balancer_first_read_ready() {
    let b = Balancers { rise: Duration::from_secs(5), ..Balancers::default() };
    let mut log = PollLog::default();
    for i in 0..10 {
        log.record(CheckKind::AgentCheck, "127.0.0.1", MARK - 5000 + i * 500, Word::Drain);
    }
    for i in 0..10 {
        log.record(CheckKind::AgentCheck, "127.0.0.1", MARK + i * 500, Word::Ready);
    }
    assert!(!taken(&log, MARK + 4500, b), "taken {} ms after the first ready read", 4500);
    log.record(CheckKind::AgentCheck, "127.0.0.1", MARK + 5000, Word::Ready);
    assert!(taken(&log, MARK + 5000, b));
    // The default is HAProxy's default checks' (and the example's) `inter 2s rise 2`, and a second.
    assert_eq!(Balancers::default().rise, Duration::from_secs(5));
}
