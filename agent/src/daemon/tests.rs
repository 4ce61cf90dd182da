//! The agent's worker and stop on the fake host and tokio's paused clock.

use super::stop::{StopTimeout, join_at_stop, join_within};
use super::triggers::{ForcedReads, Schedule};
use super::worker::{record_figures, sync_after, worker};
use crate::config::AgentConfig;
use crate::core::conclude::Report;
use crate::core::record::{Outcome, Source};
use crate::core::timing;
use crate::daemon::metrics::Metrics;
use crate::machine::store::Store;
use crate::reconcile::{self, Ctx, DesiredState, Shutdown};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{Notify, watch};

#[tokio::test]
async fn workers_are_joined_under_one_deadline() {
    let stuck = || tokio::spawn(std::future::pending::<()>());
    // Once the one deadline has passed, no worker gets time of its own: every unfinished
    // one is named at once (a timeout per worker would wait for each in turn).
    let handles = vec![("a".to_string(), stuck()), ("b".to_string(), stuck()), ("c".to_string(), stuck())];
    assert_eq!(join_within(handles, std::future::ready(())).await, ["a", "b", "c"]);
    // A worker that finished while the join waited for another is not late. The deadline
    // passes when that worker ends (a task ends in the poll that sends).
    let (ended_tx, ended_rx) = tokio::sync::oneshot::channel::<()>();
    let ends = tokio::spawn(async move {
        let _ = ended_tx.send(());
    });
    let deadline = async move {
        let _ = ended_rx.await;
    };
    assert_eq!(join_within(vec![("d".to_string(), stuck()), ("e".to_string(), ends)], deadline).await, ["d"]);
    // Before the deadline, every worker is waited for.
    let handles = vec![("f".to_string(), tokio::spawn(async {})), ("g".to_string(), tokio::spawn(async {}))];
    assert!(join_within(handles, std::future::pending()).await.is_empty());
}

#[test]
fn a_burst_of_forced_reads_is_one_read_now_and_one_at_the_end_of_the_second() {
    let t0 = tokio::time::Instant::now();
    let mut f = ForcedReads::default();
    assert!(f.ask(t0));
    assert_eq!(f.due, None);
    // Within the second: put off to its end, however many ask.
    assert!(!f.ask(t0 + Duration::from_millis(100)));
    assert!(!f.ask(t0 + Duration::from_millis(900)));
    assert_eq!(f.due, Some(t0 + timing::FORCED_READ_EVERY));
    assert_eq!(f.last, Some(t0));
    // A second later, a read at once.
    let mut f = ForcedReads::default();
    assert!(f.ask(t0));
    assert!(f.ask(t0 + timing::FORCED_READ_EVERY));
    assert_eq!((f.last, f.due), (Some(t0 + timing::FORCED_READ_EVERY), None));
}

#[test]
fn a_poll_asked_for_is_due_now_or_a_second_after_the_last_never_later_than_it_was() {
    let cfg: AgentConfig = serde_saphyr::from_str("repo: https://example.test/x.git\ninterval: 60\n").unwrap();
    let mut s = Schedule::new(&cfg, true);
    let t0 = tokio::time::Instant::now();
    let due = s.poll_at;
    assert!(due > t0 + Duration::from_secs(29), "the first poll is 30 to 90 s away");
    // Never polled: now.
    s.poll_sooner(t0);
    assert_eq!(s.poll_at, t0);
    // Polled 300 ms ago: a second after that.
    s.polled = Some(t0);
    s.poll_at = t0 + Duration::from_secs(60);
    s.poll_sooner(t0 + Duration::from_millis(300));
    assert_eq!(s.poll_at, t0 + timing::FORCED_READ_EVERY);
    // Polled long ago: now. Due sooner anyway: left as it was.
    s.poll_at = t0 + Duration::from_secs(60);
    s.poll_sooner(t0 + Duration::from_secs(5));
    assert_eq!(s.poll_at, t0 + Duration::from_secs(5));
    s.polled = Some(t0 + Duration::from_millis(500));
    s.poll_at = t0 + Duration::from_millis(1200);
    s.poll_sooner(t0 + Duration::from_secs(1));
    assert_eq!(s.poll_at, t0 + Duration::from_millis(1200));
}

/// The value of the one sample `name{labels}` in `text`, if there is one.
fn sample(text: &str, name: &str, labels: &str) -> Option<f64> {
    let key = format!("{name}{{{labels}}} ");
    text.lines().find_map(|l| l.strip_prefix(key.as_str())).and_then(|v| v.trim().parse().ok())
}

/// What the worker records after each reconcile (`sync_after`, `record_figures`), from the
/// real reconciler's outcomes on the fake host: an apply, a failed apply rolled back and
/// quarantined, the look after it, and a spec whose args are not checked.
#[tokio::test(start_paused = true)]
async fn each_unit_metric_follows_the_reconcile_outcomes() {
    use crate::host::fake::FakeHost;
    const UNIT: &str = "sglang-qwen.service";
    let dir = tempfile::tempdir().unwrap();
    let host = FakeHost::new(UNIT, &dir.path().join("units"));
    let ctx = Ctx {
        host: host.clone(),
        unit_dir: dir.path().join("units"),
        store: Store::new(dir.path().join("state")),
        events: Arc::new(|_: &str, _: &reconcile::Event| {}),
        shutdown: Shutdown::never(),
        holds: reconcile::Holds::Obeyed,
        lb: Default::default(),
    };
    let spec = |steps: u32, tail: &str| {
        let yaml = format!(
            "apiVersion: specd/v1\nkind: InferenceService\nmetadata: {{name: qwen}}\nspec:\n  unit: {UNIT}\n  engine: sglang\n  command: [/opt/sglang/bin/python3, -m, sglang.launch_server]\n  model: /models/qwen\n  server: {{port: 30000}}\n  speculative: {{algorithm: EAGLE, draft_model: /models/draft, num_steps: {steps}, eagle_topk: 1, num_draft_tokens: {}}}\n{tail}",
            steps + 1
        );
        specd_spec::parse("qwen.yaml", &yaml).unwrap().resolve(None).unwrap()
    };
    let from =
        |c: &str| Some(Source::Commit { repo: "/srv/config".into(), commit: c.into(), path: "specs/qwen.yaml".into() });
    let old = DesiredState::new(spec(3, ""), from("c1"));
    let new = DesiredState::new(spec(5, ""), from("c2"));
    host.serves(&old.spec, false);
    host.serves(&new.spec, true);
    let m = Metrics::default();
    let look = |d: &DesiredState, r: &Report| {
        let sync = sync_after(r);
        m.reconciled(UNIT, sync, "x", 0.1, false);
        record_figures(&ctx, &m, d, sync);
        m.render()
    };
    let u = format!("unit=\"{UNIT}\"");
    let info = |t: &str, rev: &str, hash: &str| {
        sample(t, "specd_unit_info", &format!("{u},revision=\"{rev}\",unit_hash=\"{hash}\""))
    };

    // Applied: its commit and hash, args proven, the proof's figures (the fake measures a
    // rate, no length), nothing quarantined.
    let r = reconcile::reconcile(&ctx, &old, false).await.unwrap();
    assert_eq!(r.outcome, Some(Outcome::Applied), "{}", r.verdict);
    let t = look(&old, &r);
    assert_eq!(info(&t, "c1", &old.unit.sha256), Some(1.0), "{t}");
    assert_eq!(sample(&t, "specd_unit_args_verified", &u), Some(1.0), "{t}");
    assert_eq!(sample(&t, "specd_unit_accept_rate", &u), Some(0.75), "{t}");
    assert_eq!(sample(&t, "specd_unit_accept_length", &u), None, "{t}");
    assert_eq!(sample(&t, "specd_unit_quarantined", &u), Some(0.0), "{t}");
    assert_eq!(sample(&t, "specd_unit_sync", &format!("{u},status=\"InSync\"")), Some(1.0), "{t}");

    // c2's unit fails to start: rolled back, quarantined; c1's unit runs, and is the one
    // info series; the desired unit is not the one proven.
    for _ in 0..2 {
        let r = reconcile::reconcile(&ctx, &new, false).await.unwrap();
        let t = look(&new, &r);
        assert_eq!(t.matches("specd_unit_info{").count(), 1, "{t}");
        assert_eq!(info(&t, "c1", &old.unit.sha256), Some(1.0), "{}\n{t}", r.verdict);
        assert_eq!(sample(&t, "specd_unit_args_verified", &u), Some(0.0), "{t}");
        assert_eq!(sample(&t, "specd_unit_quarantined", &u), Some(1.0), "{t}");
        assert_eq!(sample(&t, "specd_unit_accept_rate", &u), Some(0.75), "{t}");
        assert_eq!(sample(&t, "specd_unit_sync", &format!("{u},status=\"Failed\"")), Some(1.0), "{t}");
    }

    // A spec whose args are not checked (c3) applies: no args series, the new info only.
    let unchecked = DesiredState::new(spec(4, "  readiness: {verify_args: false}\n"), from("c3"));
    host.serves(&unchecked.spec, false);
    let r = reconcile::reconcile(&ctx, &unchecked, false).await.unwrap();
    assert_eq!(r.outcome, Some(Outcome::Applied), "{}", r.verdict);
    let t = look(&unchecked, &r);
    assert_eq!(t.matches("specd_unit_info{").count(), 1, "{t}");
    assert_eq!(info(&t, "c3", &unchecked.unit.sha256), Some(1.0), "{t}");
    assert_eq!(sample(&t, "specd_unit_args_verified", &u), None, "{t}");
    assert_eq!(sample(&t, "specd_unit_quarantined", &u), Some(0.0), "{t}");
}

/// A daemon-reload during the agent's stop sets its stop's timer again from its unit's
/// `TimeoutStopSec=`: while an apply is carried past its old instance's stop, a drop-in says
/// the time the whole stop needs, counted from its beginning; gone when the stop ends, or at
/// the next start after a stop that was killed.
#[tokio::test(start_paused = true)]
async fn the_stop_s_time_is_in_a_drop_in_of_the_agent_s_unit_while_an_apply_is_carried() {
    let dir = tempfile::tempdir().unwrap();
    let drop_in = dir.path().join("specd.service.d/zz-specd-stopping.conf");
    let mut t = StopTimeout::new(dir.path(), Some("specd.service"));
    t.extend(timing::STOP_WITHIN, &[]);
    assert!(!drop_in.exists(), "nothing carried: the unit's own timeout is enough");
    tokio::time::sleep(Duration::from_secs(10)).await;
    t.extend(Duration::from_secs(400), &["sglang-qwen.service".to_string()]);
    let text = std::fs::read_to_string(&drop_in).unwrap();
    // 10 s since the stop began, 400 s for the workers, 5 s for notices, 10 s to exit.
    assert!(text.contains("\n[Service]\nTimeoutStopSec=426\n"), "{text}");
    assert!(text.contains("sglang-qwen.service"), "{text}");
    t.end();
    assert!(!drop_in.exists() && !dir.path().join("specd.service.d").exists());
    // Not a unit (run by hand): nothing written.
    let mut t = StopTimeout::new(dir.path(), None);
    t.extend(Duration::from_secs(400), &["sglang-qwen.service".to_string()]);
    t.end();
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    // Left by a stop that was killed: removed at the next start.
    std::fs::create_dir_all(drop_in.parent().unwrap()).unwrap();
    std::fs::write(dir.path().join("specd.service.d/override.conf"), "[Service]\n").unwrap();
    std::fs::write(&drop_in, text).unwrap();
    StopTimeout::clear_leftover(dir.path(), Some("specd.service"));
    assert!(!drop_in.exists());
    assert!(dir.path().join("specd.service.d/override.conf").exists(), "a person's drop-in stays");
}

#[test]
fn the_stop_fits_in_the_agent_unit_s_stop_timeout() {
    let unit = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/specd.service"));
    let secs: u64 = unit
        .lines()
        .find_map(|l| l.strip_prefix("TimeoutStopSec="))
        .expect("the agent unit sets TimeoutStopSec")
        .trim()
        .parse()
        .unwrap();
    assert!(
        timing::STOP_WITHIN + timing::NOTICES_WITHIN + timing::EXIT_WITHIN <= Duration::from_secs(secs),
        "{:?} and {:?} in {secs} s",
        timing::STOP_WITHIN,
        timing::NOTICES_WITHIN
    );
}

// The worker on the fake host and tokio's paused clock: its waits are virtual time, so what
// it does at each moment is exact (no machine, no root).

const W_UNIT: &str = "sglang-qwen.service";

fn w_spec(steps: u32) -> specd_spec::Spec {
    w_spec_stopping_within(steps, 10)
}

/// The worker's spec whose server may take `timeout_stop_sec` to stop.
fn w_spec_stopping_within(steps: u32, timeout_stop_sec: u32) -> specd_spec::Spec {
    let yaml = format!(
        "apiVersion: specd/v1\nkind: InferenceService\nmetadata: {{name: qwen}}\nspec:\n  unit: {W_UNIT}\n  engine: sglang\n  command: [/opt/sglang/bin/python3, -m, sglang.launch_server]\n  model: /models/qwen\n  server: {{port: 30000}}\n  speculative: {{algorithm: EAGLE, draft_model: /models/draft, num_steps: {steps}, eagle_topk: 1, num_draft_tokens: {}}}\n  service: {{timeout_stop_sec: {timeout_stop_sec}, drain_timeout_sec: 5}}\n",
        steps + 1
    );
    specd_spec::parse("qwen.yaml", &yaml).unwrap().resolve(None).unwrap()
}

/// A worker for one unit on a fake host; the sender stops the agent.
struct Running {
    host: crate::host::fake::FakeHost,
    ctx: Arc<Ctx<crate::host::fake::FakeHost>>,
    metrics: Arc<Metrics>,
    desired: watch::Sender<Arc<DesiredState>>,
    stop: watch::Sender<bool>,
    handle: tokio::task::JoinHandle<()>,
    _dir: tempfile::TempDir,
}

/// `hold`: the hold the unit has when the worker starts (made on the host: a sweep's
/// process).
async fn run_worker(
    d: DesiredState,
    hold: impl FnOnce(&crate::host::fake::FakeHost) -> Option<crate::core::hold::Hold>,
) -> Running {
    let dir = tempfile::tempdir().unwrap();
    let unit = d.spec.unit.clone();
    let host = crate::host::fake::FakeHost::new(&unit, &dir.path().join("units"));
    host.serves(&d.spec, false);
    let (stop, shutdown) = Shutdown::new();
    let ctx = Arc::new(Ctx {
        host: host.clone(),
        unit_dir: dir.path().join("units"),
        store: Store::new(dir.path().join("state")),
        events: Arc::new(|_: &str, _: &reconcile::Event| {}),
        shutdown,
        holds: reconcile::Holds::Obeyed,
        lb: Default::default(),
    });
    if let Some(h) = hold(&host) {
        ctx.store.set_hold(&unit, h).await.unwrap();
    }
    let metrics = Arc::new(Metrics::new("test"));
    let (desired, rx) = watch::channel(Arc::new(d));
    let handle = tokio::spawn(worker(unit, rx, Arc::new(Notify::new()), ctx.clone(), metrics.clone()));
    Running { host, ctx, metrics, desired, stop, handle, _dir: dir }
}

impl Running {
    fn reconciles(&self, result: &str) -> f64 {
        let unit = self.desired.borrow().spec.unit.clone();
        sample(&self.metrics.render(), "specd_reconciles_total", &format!("unit=\"{unit}\",result=\"{result}\""))
            .unwrap_or(0.0)
    }
}

/// Virtual time from the start of the test.
async fn at(t0: tokio::time::Instant, secs: f64) {
    tokio::time::sleep_until(t0 + Duration::from_secs_f64(secs)).await;
}

#[tokio::test(start_paused = true)]
async fn an_error_is_reconciled_again_by_the_error_policy_and_a_unit_in_sync_rests() {
    // A reconcile that fails at once (a unit specd never manages): retried 2 s, 4 s, 8 s
    // later (±10 % each: the third by 12.6 s at the soonest, 15.4 s at the latest), and never
    // more often.
    let mut spec = w_spec(3);
    spec.unit = "dbus.service".into();
    let t0 = tokio::time::Instant::now();
    let r = run_worker(DesiredState::new(spec, None), |_| None).await;
    for (secs, want) in [(0.1, 1.0), (1.7, 1.0), (2.3, 2.0), (5.3, 2.0), (6.7, 3.0), (12.4, 3.0), (15.5, 4.0)] {
        at(t0, secs).await;
        assert_eq!(r.reconciles("error"), want, "reconciles by {secs} s");
    }
    // A unit in sync: applied once, then no timer at all (an hour passes, nothing runs).
    let t0 = tokio::time::Instant::now();
    let r = run_worker(DesiredState::new(w_spec(3), None), |_| None).await;
    at(t0, 1.0).await;
    assert_eq!(r.reconciles("applied"), 1.0);
    assert_eq!(r.host.serving(), Some(w_spec(3).argv));
    let calls = r.host.calls();
    at(t0, 3600.0).await;
    assert_eq!(r.host.calls(), calls, "a unit at rest was looked at: {:?}", &r.host.call_names()[calls..]);
    // A new desired state wakes it at once.
    r.host.serves(&w_spec(5), false);
    r.desired.send(Arc::new(DesiredState::new(w_spec(5), None))).unwrap();
    at(t0, 3601.0).await;
    assert_eq!(r.host.serving(), Some(w_spec(5).argv));
    assert_eq!(r.reconciles("applied"), 2.0);
}

#[tokio::test(start_paused = true)]
async fn a_new_desired_state_is_applied_at_once_while_the_metrics_look_waits_for_the_journal() {
    // journald takes 20 s to answer the metrics' look after each reconcile.
    let t0 = tokio::time::Instant::now();
    let r = run_worker(DesiredState::new(w_spec(3), None), |h| {
        h.journal_lag(Duration::from_secs(20));
        None
    })
    .await;
    at(t0, 1.0).await;
    assert_eq!(r.reconciles("applied"), 1.0);
    assert_eq!(r.host.call_names().last(), Some(&"instances"), "the look is not waiting on the journal");
    r.host.serves(&w_spec(5), false);
    r.desired.send(Arc::new(DesiredState::new(w_spec(5), None))).unwrap();
    at(t0, 2.0).await;
    assert_eq!(r.host.serving(), Some(w_spec(5).argv), "the new unit waited for the look");
    assert_eq!(r.reconciles("applied"), 2.0);
    // The look cut short is taken after the reconcile that followed.
    let looks = r.host.call_names().iter().filter(|c| **c == "instances").count();
    assert_eq!(looks, 2);
}

#[tokio::test(start_paused = true)]
async fn a_suspend_keeps_the_worker_s_hands_off_until_it_expires_then_it_applies() {
    use crate::core::hold::{Hold, HoldKind};
    let t0 = tokio::time::Instant::now();
    let epoch = crate::host::fake::EPOCH;
    let r = run_worker(DesiredState::new(w_spec(3), None), |_| {
        let mut h = Hold::new(HoldKind::Suspend, "root@host (specd suspend)", epoch);
        h.until = Some(epoch + 30);
        Some(h)
    })
    .await;
    at(t0, 29.0).await;
    assert_eq!(r.host.stops_and_starts(), (0, 0), "acted under a suspend");
    assert_eq!(r.reconciles("held"), 1.0, "looked once, then waited for the hold's end");
    at(t0, 32.0).await;
    assert_eq!(r.host.serving(), Some(w_spec(3).argv), "not applied once the suspend expired");
    let st = r.ctx.store.peek(W_UNIT).unwrap();
    assert!(st.hold.is_none());
    assert!(st.history.iter().any(|h| h.outcome == Outcome::HoldCleared && h.message.contains("expired")));
}

#[tokio::test(start_paused = true)]
async fn a_sweep_that_dies_wakes_the_worker_at_once_and_it_acts_again() {
    use crate::core::hold::{Hold, HoldKind};
    let t0 = tokio::time::Instant::now();
    let epoch = crate::host::fake::EPOCH;
    let mut sweep = 0;
    let r = run_worker(DesiredState::new(w_spec(3), None), |host| {
        sweep = host.spawn_holder();
        let mut h = Hold::new(HoldKind::Sweep, "specd sweep qwen-steps", epoch);
        h.until = Some(epoch + 7200);
        h.pid = Some(sweep);
        Some(h)
    })
    .await;
    at(t0, 600.0).await;
    assert_eq!(r.host.stops_and_starts(), (0, 0), "acted under a sweep");
    r.host.end_holder(sweep);
    // No timer: its exit is what wakes the worker.
    at(t0, 601.0).await;
    assert_eq!(r.host.serving(), Some(w_spec(3).argv), "the worker did not act after the sweep died");
    let st = r.ctx.store.peek(W_UNIT).unwrap();
    assert!(st.history.iter().any(|h| h.outcome == Outcome::HoldCleared && h.message.contains("is gone")));
}

#[tokio::test(start_paused = true)]
async fn asked_to_stop_during_an_apply_the_worker_ends_and_leaves_a_server_that_serves() {
    let t0 = tokio::time::Instant::now();
    let r = run_worker(DesiredState::new(w_spec(3), None), |_| None).await;
    at(t0, 1.0).await;
    assert_eq!(r.host.serving(), Some(w_spec(3).argv));
    // A new spec; specd is asked to stop while the new server loads.
    r.host.serves(&w_spec(5), false);
    r.desired.send(Arc::new(DesiredState::new(w_spec(5), None))).unwrap();
    let (_, starts) = r.host.stops_and_starts();
    while r.host.stops_and_starts().1 == starts {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    r.stop.send(true).unwrap();
    tokio::time::timeout(Duration::from_secs(60), r.handle).await.expect("the worker did not end").unwrap();
    // The instance it started loads on: a server serves (the new one), never none.
    at(t0, 10.0).await;
    assert_eq!(r.host.serving(), Some(w_spec(5).argv));
    let st = r.ctx.store.peek(W_UNIT).unwrap();
    assert!(st.in_progress.is_some(), "the next run finishes the apply it recorded");
}

/// The README's SGLang server: `timeout_stop_sec: 300`, and a stop that drains a long request
/// for 200 s, longer than the agent's own wait at its stop (`STOP_WITHIN`). Asked to stop
/// during that stop, the agent waits for the apply to start the new instance, asks systemd
/// for the time, and exits with the unit starting: never down.
#[tokio::test(start_paused = true)]
async fn asked_to_stop_during_an_old_instance_s_long_stop_the_agent_waits_for_the_new_start() {
    let (old, new) = (w_spec_stopping_within(3, 300), w_spec_stopping_within(5, 300));
    let drains = Duration::from_secs(200);
    assert!(drains > timing::STOP_WITHIN);
    let t0 = tokio::time::Instant::now();
    let r = run_worker(DesiredState::new(old.clone(), None), |h| {
        h.exits_after_term(drains);
        None
    })
    .await;
    at(t0, 1.0).await;
    assert_eq!(r.host.serving(), Some(old.argv.clone()));
    r.host.serves(&new, false);
    r.desired.send(Arc::new(DesiredState::new(new.clone(), None))).unwrap();
    let (stops, _) = r.host.stops_and_starts();
    while r.host.stops_and_starts().0 == stops {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // SIGTERM a second into the old instance's stop.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let stopped_at = tokio::time::Instant::now();
    r.stop.send(true).unwrap();
    let mut asked = Vec::new();
    let late = join_at_stop(vec![(W_UNIT.to_string(), r.handle)], &r.ctx.shutdown, |d, _| asked.push(d)).await;
    let waited = stopped_at.elapsed();
    // The agent exits now: a worker still in its apply would end with it, the old instance
    // stopped and no new one started.
    assert!(late.is_empty(), "left in their apply as the agent exits after {waited:?}: {late:?}");
    at(t0, 400.0).await;
    assert_eq!(r.host.serving(), Some(new.argv.clone()));
    // It waited for the old instance's stop (not more than the stop's budget and the wait
    // after it), and asked systemd for as long before its own unit's timeout ran out.
    assert!(waited >= drains - Duration::from_secs(2), "{waited:?}");
    let most = timing::stop_budget(300) + timing::STOP_WITHIN;
    assert!(waited < most, "{waited:?}");
    let longest = asked.iter().max().copied().unwrap_or_default();
    assert!(longest > drains && longest <= most, "{asked:?}");
    let st = r.ctx.store.peek(W_UNIT).unwrap();
    assert!(st.in_progress.is_some(), "the next run verifies the instance it started");
}
