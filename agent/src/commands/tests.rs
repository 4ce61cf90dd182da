//! The commands on the fake host and tokio's paused clock: what a person runs, and what they
//! would check after (the exit code, what status says, what serves).

use crate::core::hold;
use crate::core::record;
use crate::core::record::Source;
use crate::core::sync::SyncStatus;
use crate::host::{Host, ServiceManager};
use crate::machine::store::{self, SourceState, Store};
use crate::reconcile::context::{self, Dirs};
use crate::reconcile::{Ctx, Event, Shutdown};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use super::apply::{agent_reverts, apply_on};
use super::holds::parse_duration;
use super::rollback::{rollback_on, rollback_target};
use super::status::{CmdlineOf, ServiceHealth, UnitStatus, not_deployed, status_on};
use super::*;
use crate::core::unit_state::ActiveState;

#[test]
fn only_a_live_sweep_stops_a_hand_apply() {
    let hold = |kind, pid| hold::Hold { pid, ..hold::Hold::new(kind, "specd sweep qwen-mtp-steps", 0) };
    let st = |h| record::UnitState { unit: "a.service".into(), hold: Some(h), ..Default::default() };
    let host = this_host();
    let live_sweep = |st: &record::UnitState| live_sweep(&host, st);
    let why = live_sweep(&st(hold(hold::HoldKind::Sweep, Some(std::process::id())))).unwrap();
    assert!(why.contains("held by a sweep by specd sweep qwen-mtp-steps") && why.contains("stop the sweep"), "{why}");
    // The sweep's pid, now another process's (it started at another time): not live.
    let me = std::process::id();
    let started = crate::machine::process::pid_start(me).unwrap();
    let at = |start| hold::Hold { pid_start: Some(start), ..hold(hold::HoldKind::Sweep, Some(me)) };
    assert!(live_sweep(&st(at(started))).is_some());
    assert_eq!(live_sweep(&st(at(started + 1))), None);
    let mut gone = std::process::Command::new("true").spawn().unwrap();
    let pid = gone.id();
    gone.wait().unwrap();
    assert_eq!(live_sweep(&st(hold(hold::HoldKind::Sweep, Some(pid)))), None);
    // Past its end, even with its process alive (a sweep that hung): the agent's again.
    let expired = hold::Hold { until: Some(1), ..hold(hold::HoldKind::Sweep, Some(me)) };
    assert_eq!(live_sweep(&st(expired)), None);
    // One that names no process (an older specd's): in effect until it expires, as the agent
    // sees it.
    assert!(live_sweep(&st(hold(hold::HoldKind::Sweep, None))).is_some());
    assert_eq!(live_sweep(&st(hold::Hold { until: Some(1), ..hold(hold::HoldKind::Sweep, None) })), None);
    assert_eq!(live_sweep(&st(hold(hold::HoldKind::Suspend, None))), None);
    assert_eq!(live_sweep(&st(hold(hold::HoldKind::Pin, None))), None);
}

#[tokio::test]
async fn the_sweep_s_own_applies_are_its_own() {
    let d = tempfile::tempdir().unwrap();
    let store = Store::new(d.path());
    assert!(!sweeps_own(&store, "a.service"), "no hold");
    let hold = |pid| hold::Hold { pid: Some(pid), ..hold::Hold::new(hold::HoldKind::Sweep, "specd sweep s", 0) };
    store.set_hold("a.service", hold(std::process::id())).await.unwrap();
    assert!(sweeps_own(&store, "a.service"), "the holding process itself");
    store.set_hold("a.service", hold(nix::unistd::getppid().as_raw().unsigned_abs())).await.unwrap();
    assert!(sweeps_own(&store, "a.service"), "a child of the holding process");
    store.set_hold("a.service", hold(1)).await.unwrap();
    assert!(!sweeps_own(&store, "a.service"), "another process's sweep");
}

#[test]
fn durations_are_numbers_with_units() {
    assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
    assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
    assert_eq!(parse_duration("2d"), Ok(Duration::from_secs(172_800)));
    for bad in ["", "10", "h", "5x", "0m", "-1h", "1.5h"] {
        assert!(parse_duration(bad).unwrap_err().contains("is not a duration"), "{bad}");
    }
}

fn good(sha: &str, time: u64) -> record::DesiredRecord {
    let text = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/llama-cpp-qwen-draft.yaml"));
    let spec = specd_spec::parse("t.yaml", text).and_then(|p| p.resolve(None)).unwrap();
    record::DesiredRecord { sha256: sha.into(), source: None, time, spec }
}

#[test]
fn a_rollback_goes_to_the_newest_good_unit_not_deployed_or_the_one_named() {
    let mut st = record::UnitState { unit: "t.service".into(), ..Default::default() };
    assert!(rollback_target(&st, None, None).unwrap_err().contains("no earlier good unit"));
    st.good_specs = vec![good("aaaa1111", 1), good("aaaa2222", 2), good("bbbb3333", 3)];
    assert_eq!(rollback_target(&st, Some("bbbb3333"), None).unwrap().sha256, "aaaa2222");
    // The deployed unit failed and was not kept: the newest good one is the target.
    assert_eq!(rollback_target(&st, Some("cccc4444"), None).unwrap().sha256, "bbbb3333");
    assert_eq!(rollback_target(&st, None, Some("AAAA1")).unwrap().sha256, "aaaa1111");
    assert!(rollback_target(&st, None, Some("aaaa")).unwrap_err().contains("more than one"));
    assert!(rollback_target(&st, None, Some("abc")).unwrap_err().contains("at least 4 hex digits"));
    assert!(rollback_target(&st, None, Some("dddd")).unwrap_err().contains("no good unit dddd"));
    st.history.push(record::HistoryEntry {
        time: 0,
        sha256: "dddd0000".into(),
        source: None,
        outcome: record::Outcome::Applied,
        message: String::new(),
        stop_verdict: None,
        duration_ms: 0,
        startup: None,
    });
    assert!(rollback_target(&st, None, Some("dddd")).unwrap_err().contains("keeps the specs of the last 8"));
}

#[test]
fn a_hand_apply_of_another_unit_than_the_agent_s_is_said_to_be_reverted() {
    let commit = Source::Commit { repo: "/srv/specs".into(), commit: "c".repeat(40), path: "q.yaml".into() };
    let agent = SourceState { repo: "/srv/specs".into(), ..SourceState::default() };
    let entry = |sha: &str, source: Option<Source>| record::HistoryEntry {
        time: 1,
        sha256: sha.into(),
        source,
        outcome: record::Outcome::Applied,
        message: String::new(),
        stop_verdict: None,
        duration_ms: 0,
        startup: None,
    };
    let st = record::UnitState {
        unit: UNIT.into(),
        history: vec![entry(&"a".repeat(64), Some(commit.clone()))],
        ..Default::default()
    };
    let (sha, why) = agent_reverts(&st, Some(&agent), &"b".repeat(64)).unwrap();
    assert_eq!(sha, "a".repeat(64));
    assert_eq!(
        why,
        "sglang-qwen.service: the agent that follows /srv/specs deploys unit aaaaaaaaaaaa from commit cccccccccccc (q.yaml) here and puts it back at its next look; commit this spec there to keep it, or `specd suspend sglang-qwen.service` first"
    );
    // The agent's own unit, no agent on this host, or one that never deployed this unit: nothing to say.
    assert!(agent_reverts(&st, Some(&agent), &"a".repeat(64)).is_none());
    assert!(agent_reverts(&st, None, &"b".repeat(64)).is_none());
    let by_hand = record::UnitState { history: vec![entry(&"a".repeat(64), None)], ..st.clone() };
    assert!(agent_reverts(&by_hand, Some(&agent), &"b".repeat(64)).is_none());
}

#[test]
fn a_refused_promotion_record_is_said_as_such_not_as_a_head_not_deployed() {
    let plain = SourceState { error: Some("commit abc: not signed".into()), ..SourceState::default() };
    assert_eq!(not_deployed(&plain, "commit abc: not signed"), "head not deployed: commit abc: not signed");
    let fleet = SourceState {
        fleet: Some(store::FleetPosition {
            record_branch: "specd-promotions".into(),
            record: Some("0123456789abcdef0123".into()),
            ..Default::default()
        }),
        ..plain
    };
    assert_eq!(
        not_deployed(&fleet, "the record's commit 0123: not signed"),
        "promotion not followed (0123456789ab of specd-promotions): the record's commit 0123: not signed"
    );
}

#[test]
fn health_is_the_readiness_answer_or_else_systemd_s_state() {
    assert_eq!(ServiceHealth::of(Some(true), ActiveState::Active), ServiceHealth::Healthy);
    assert_eq!(ServiceHealth::of(Some(false), ActiveState::Active), ServiceHealth::Loading);
    assert_eq!(ServiceHealth::of(None, ActiveState::Activating), ServiceHealth::Unknown);
    assert_eq!(ServiceHealth::of(None, ActiveState::Failed), ServiceHealth::Down);
    assert_eq!(ServiceHealth::of(None, ActiveState::Deactivating), ServiceHealth::Down);
    assert_eq!(serde_json::to_value(ServiceHealth::Healthy).unwrap(), "Healthy");
    assert_eq!(ServiceHealth::Down.to_string(), "Down");
}

// The commands on the fake host and tokio's paused clock: what a person runs, and what
// they would check after (the exit code, what status says, what serves), without a machine.

const UNIT: &str = "sglang-qwen.service";

fn spec_text(steps: u32) -> String {
    format!(
        "apiVersion: specd/v1\nkind: InferenceService\nmetadata: {{name: qwen}}\nspec:\n  unit: {UNIT}\n  engine: sglang\n  command: [/opt/sglang/bin/python3, -m, sglang.launch_server]\n  model: /models/qwen\n  server: {{port: 30000}}\n  speculative: {{algorithm: EAGLE, draft_model: /models/draft, num_steps: {steps}, eagle_topk: 1, num_draft_tokens: {}}}\n  service: {{timeout_stop_sec: 10, drain_timeout_sec: 5}}\n",
        steps + 1
    )
}

/// A host where a server of `steps` serves (or fails to load, for `fails`), and the spec
/// files `qwen-<steps>.yaml` in the test's directory.
struct OnFake {
    host: crate::host::fake::FakeHost,
    dirs: Dirs,
    dir: tempfile::TempDir,
}

impl OnFake {
    fn new() -> OnFake {
        let dir = tempfile::tempdir().unwrap();
        let dirs = Dirs { state_dir: dir.path().join("state"), unit_dir: dir.path().join("units") };
        let host = crate::host::fake::FakeHost::new(UNIT, &dirs.unit_dir);
        OnFake { host, dirs, dir }
    }

    /// The spec file of `steps`, whose servers load (or fail to).
    fn spec(&self, steps: u32, fails: bool) -> PathBuf {
        let path = self.dir.path().join(format!("qwen-{steps}.yaml"));
        std::fs::write(&path, spec_text(steps)).unwrap();
        let spec = specd_spec::parse("q.yaml", &spec_text(steps)).unwrap().resolve(None).unwrap();
        self.host.serves(&spec, fails);
        path
    }

    fn argv(&self, steps: u32) -> Vec<String> {
        specd_spec::parse("q.yaml", &spec_text(steps)).unwrap().resolve(None).unwrap().argv
    }

    fn ctx(&self) -> Ctx<crate::host::fake::FakeHost> {
        context::ctx_on(self.host.clone(), &self.dirs, Arc::new(|_: &str, _: &Event| {}), Shutdown::never())
    }

    async fn apply(&self, files: &[PathBuf]) -> u8 {
        apply_on(self.host.clone(), &self.dirs, files, None, false, false, Shutdown::never).await.unwrap()
    }

    async fn status(&self, file: Option<&Path>) -> (u8, UnitStatus) {
        let (code, mut all) = status_on(&self.ctx(), &self.dirs, false, file, None).await.unwrap();
        assert_eq!(all.len(), 1);
        (code, all.remove(0))
    }
}

#[tokio::test(start_paused = true)]
async fn status_says_each_state_of_a_unit_and_exits_0_only_in_sync_and_healthy() {
    let f = OnFake::new();
    let (good, bad) = (f.spec(3, false), f.spec(5, true));
    assert_eq!(f.apply(std::slice::from_ref(&good)).await, 0);
    let (code, s) = f.status(None).await;
    assert_eq!(
        (code, s.sync, s.health, s.cmdline_matches, s.cmdline_of),
        (0, SyncStatus::InSync, ServiceHealth::Healthy, Some(true), CmdlineOf::Desired)
    );
    // The last start, timed by phase, in the status and its JSON.
    let start = s.startup.clone().expect("the last start");
    assert!(start.ready, "{start:?}");
    let json = serde_json::to_value(&s).unwrap();
    let phases: Vec<&str> =
        json["startup"]["phases"].as_array().unwrap().iter().map(|p| p["phase"].as_str().unwrap()).collect();
    assert_eq!(phases, ["process", "weights", "engine", "api"], "{json}");
    assert_eq!(json["startup"]["ms"], serde_json::json!(start.ms));
    // What its load balancers are told, and who polls it.
    assert_eq!(s.serving.as_ref().map(|s| s.word()), Some(crate::core::serving::Word::Ready), "{s:?}");
    assert!(s.polled_by.is_empty(), "{s:?}");
    f.host.balancer(crate::core::serving::CheckKind::AgentCheck, "10.0.0.5", std::time::Duration::from_secs(2));
    let (_, s) = f.status(None).await;
    assert_eq!(s.polled_by.iter().map(|p| p.addr.as_str()).collect::<Vec<_>>(), ["10.0.0.5"], "{s:?}");

    // A spec that fails to load: rolled back, the old unit serves; its last try says why.
    assert_eq!(f.apply(std::slice::from_ref(&bad)).await, 1);
    assert_eq!(f.host.serving(), Some(f.argv(3)));
    let (code, s) = f.status(Some(&bad)).await;
    assert_eq!((code, s.sync, s.health), (1, SyncStatus::Failed, ServiceHealth::Healthy), "{s:?}");
    // The process that serves is exactly the deployed (last good) unit's, and said so.
    assert_eq!((s.cmdline_matches, s.cmdline_of), (Some(true), CmdlineOf::Deployed), "{s:?}");
    let last = s.last_result.as_ref().unwrap();
    assert!(s.reasons.contains(&last.message), "{:?}", s.reasons);
    // Its failed start, in its history entry, ended in a phase; the last start is the rollback's.
    assert!(last.startup.as_ref().is_some_and(|s| !s.ready && !s.phases.is_empty()), "{last:?}");
    assert!(s.startup.as_ref().is_some_and(|r| r.ready && Some(&r.sha256) == s.deployed_sha256.as_ref()), "{s:?}");
    // The instance before the one that serves died loading: said while its successor runs.
    assert!(s.last_ended.as_deref().is_some_and(|e| e.starts_with("crash")), "{s:?}");

    // The unit's lock held by a look that finds it in sync (the agent's worker woken by systemd's
    // signal): no apply runs, and none is said to.
    assert_eq!(f.apply(std::slice::from_ref(&good)).await, 0);
    let lock = crate::machine::lock::UnitLock::try_acquire(&f.ctx().store.locks_dir(), UNIT).unwrap().unwrap();
    let (code, s) = f.status(Some(&good)).await;
    assert_eq!((code, s.sync), (0, SyncStatus::InSync), "{s:?}");
    assert!(!s.reasons.iter().any(|r| r.contains("apply is running")), "{:?}", s.reasons);
    // An apply in progress (another process holds the lock and recorded its phase): Progressing,
    // said first.
    let store = &f.ctx().store;
    let mut st = store.load(UNIT).unwrap();
    st.in_progress = Some(record::InProgress {
        sha256: "f".repeat(64),
        pid: 1,
        phase: record::Phase::Starting,
        started: 1,
        wrote: false,
    });
    store.save(&st).unwrap();
    let (code, s) = f.status(Some(&good)).await;
    assert_eq!((code, s.sync), (1, SyncStatus::Progressing));
    assert!(s.reasons[0].starts_with("an apply is running (starting"), "{:?}", s.reasons);
    drop(lock);
    st.in_progress = None;
    store.save(&st).unwrap();

    // The service stopped behind specd's back: down, and why.
    f.host.stop(UNIT, true).await.unwrap();
    let (code, s) = f.status(Some(&good)).await;
    assert_eq!((code, s.health), (1, ServiceHealth::Down), "{s:?}");
    assert!(s.down.is_some(), "{s:?}");
    // Its last instance is the one that served, stopped on request: not the crash before it
    // (systemd keeps a stopped unit's InvocationID).
    assert_eq!(s.last_ended.as_deref(), Some("clean stop: stopped on request"), "{s:?}");
}

#[tokio::test(start_paused = true)]
async fn an_apply_of_two_files_where_the_second_is_not_valid_changes_nothing() {
    let f = OnFake::new();
    let good = f.spec(3, false);
    let broken = f.dir.path().join("broken.yaml");
    std::fs::write(&broken, spec_text(4).replace("engine: sglang", "engine: sglangx")).unwrap();
    assert_eq!(f.apply(&[good.clone(), broken]).await, 1);
    // Two files for one unit: refused as well.
    let other = f.spec(4, false);
    assert_eq!(f.apply(&[good, other]).await, 1);
    assert_eq!(f.host.stops_and_starts(), (0, 0));
    assert!(f.host.writes().is_empty());
    assert!(f.ctx().store.units().unwrap().is_empty(), "a state was recorded");
}

#[tokio::test(start_paused = true)]
async fn a_rollback_goes_back_to_an_earlier_good_unit_and_pins_it() {
    let f = OnFake::new();
    let (v1, v2) = (f.spec(3, false), f.spec(5, false));
    assert_eq!(f.apply(&[v1]).await, 0);
    assert_eq!(f.apply(&[v2]).await, 0);
    let ctx = f.ctx();
    let no_agent = f.dir.path().join("no-agent.sock");
    let good = ctx.store.peek(UNIT).unwrap().good_specs;
    let (v1_sha, v2_sha) = (good[0].sha256.clone(), good[1].sha256.clone());

    // No --to: the newest good unit that is not deployed (v1), pinned there.
    assert_eq!(rollback_on(&ctx, UNIT.into(), None, None, no_agent.clone(), false).await.unwrap(), 0);
    assert_eq!(f.host.serving(), Some(f.argv(3)));
    let pin = ctx.store.peek(UNIT).unwrap().hold.unwrap();
    assert_eq!((pin.kind, pin.pinned_sha256.as_deref(), pin.pid), (hold::HoldKind::Pin, Some(v1_sha.as_str()), None));
    // The pin keeps the agent out while the source still wants v2, and is no command's
    // business.
    assert!(matches!(f.host.hold_effect(Some(&pin), &v2_sha), crate::core::hold::HoldEffect::HandsOff(_)));

    // --to a hash prefix: that one (v2 again), pinned at it.
    let code = rollback_on(&ctx, UNIT.into(), Some(v2_sha[..8].into()), None, no_agent.clone(), false);
    assert_eq!(code.await.unwrap(), 0);
    assert_eq!(f.host.serving(), Some(f.argv(5)));
    assert_eq!(ctx.store.peek(UNIT).unwrap().hold.unwrap().pinned_sha256, Some(v2_sha));
    // A hash no good unit has: refused, nothing changed.
    let starts = f.host.stops_and_starts();
    assert_eq!(rollback_on(&ctx, UNIT.into(), Some("ffff".into()), None, no_agent, false).await.unwrap(), 1);
    assert_eq!(f.host.stops_and_starts(), starts);
}

/// A rollback of a replica (`spec.rollout.group`) waits for its group as an apply does: while a
/// sibling drains it does not go, and it is not given up; once the sibling serves, it goes.
#[tokio::test(start_paused = true)]
async fn a_rollback_of_a_replica_waits_for_its_group_then_goes() {
    use crate::core::serving::{ServingState, Word};
    use crate::host::LoadBalancers;
    let f = OnFake::new();
    let grouped = |steps| format!("{}  rollout: {{group: llm}}\n", spec_text(steps));
    let file = |steps: u32| {
        let path = f.dir.path().join(format!("g-{steps}.yaml"));
        std::fs::write(&path, grouped(steps)).unwrap();
        f.host.serves(&specd_spec::parse("q.yaml", &grouped(steps)).unwrap().resolve(None).unwrap(), false);
        path
    };
    let (v1, v2) = (file(3), file(5));
    assert_eq!(f.apply(&[v1]).await, 0);
    assert_eq!(f.apply(&[v2]).await, 0);
    // A sibling of the group serves, then drains for a change of its own.
    let sibling = f.host.beside("other.service");
    let text = grouped(3).replace(UNIT, "other.service").replace("port: 30000", "port: 30001");
    let other = specd_spec::parse("o.yaml", &text).unwrap().resolve(None).unwrap();
    sibling.serves(&other, false);
    let sctx = context::ctx_on(sibling.clone(), &f.dirs, Arc::new(|_: &str, _: &Event| {}), Shutdown::never());
    let r = reconcile::reconcile(&sctx, &DesiredState::new(other, None), false).await.unwrap();
    assert_eq!(r.outcome, Some(record::Outcome::Applied), "{}", r.verdict);
    sibling
        .set_serving_state("other.service", &ServingState::Drain { why: "its change".into(), since: f.host.now() })
        .unwrap();
    let ready = {
        let sibling = sibling.clone();
        tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_secs(30)).await;
            let since = sibling.now();
            sibling.set_serving_state("other.service", &ServingState::Ready { since }).unwrap();
        })
    };
    let no_agent = f.dir.path().join("no-agent.sock");
    assert_eq!(rollback_on(&f.ctx(), UNIT.into(), None, None, no_agent, false).await.unwrap(), 0);
    ready.await.unwrap();
    assert_eq!(f.host.serving(), Some(f.argv(3)));
    let told = f.host.serving_told();
    let back = told.iter().rposition(|(_, u, s)| u == "other.service" && s.word() == Word::Ready).unwrap();
    let mine = told.iter().rposition(|(_, u, s)| u == UNIT && s.word() == Word::Drain).unwrap();
    assert!(mine > back, "the replica drained while its sibling did: {told:?}");
}

/// `specd apply` of members of one group whose `rollout:` limits disagree (a spare that says
/// `max_surge: 1` beside a replica that says none): refused, naming both files and the field,
/// and nothing on the host is touched.
#[tokio::test(start_paused = true)]
async fn an_apply_of_a_groups_members_that_disagree_on_its_limits_changes_nothing() {
    let f = OnFake::new();
    let member = |name: &str, port: u32, rollout: &str| {
        let text =
            spec_text(3).replace(UNIT, &format!("{name}.service")).replace("port: 30000", &format!("port: {port}"))
                + &format!("  rollout: {rollout}\n");
        let path = f.dir.path().join(format!("{name}.yaml"));
        std::fs::write(&path, text).unwrap();
        path
    };
    let a = member("llm-a", 30001, "{group: llm}");
    let s = member("llm-s", 30002, "{group: llm, max_unavailable: 0, max_surge: 1, spare: true}");
    let calls = f.host.calls();
    assert_ne!(f.apply(&[a, s]).await, 0);
    assert_eq!(f.host.calls(), calls, "the host was touched: {:?}", &f.host.call_names()[calls..]);
    assert_eq!(f.host.writes(), Vec::<String>::new());
}
