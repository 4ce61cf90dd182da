//! The reconciler on the in-memory host, with a fault at every call: every step × every fault
//! kind (a call fails, times out, the process dies, processes linger, specd is killed). After
//! each: the unit file is the old or the new one, the state says what happened, and the next
//! reconcile converges on a serving unit without touching a healthy one again.
//!
//! The real host's truth is in the end-to-end tests (a real systemd, real servers); this is the
//! part no machine can enumerate: what follows a fault at each exact point.

use std::sync::Arc;

use specd_spec::Spec;

use crate::core::conclude::{Action, Report, Serving};
use crate::core::record::Outcome;
use crate::core::serving::{CheckKind, ServingState, Word};
use crate::host::fake::{Crashed, FAULTS, FakeHost, Fault, LOAD};
use crate::machine::store::Store;
use crate::reconcile::{self, Ctx, DesiredState, Shutdown};

const UNIT: &str = "sglang-qwen.service";

/// A drop-in a person left in the unit's own `.d` directory.
const DROP_IN: &str = "[Service]\nEnvironment=DEBUG=1\n";

fn spec(steps: u32, enabled: bool) -> Spec {
    let yaml = format!(
        "apiVersion: specd/v1\nkind: InferenceService\nmetadata: {{name: qwen}}\nspec:\n  unit: {UNIT}\n  engine: sglang\n  command: [/opt/sglang/bin/python3, -m, sglang.launch_server]\n  model: /models/qwen\n  server: {{port: 30000}}\n  speculative: {{algorithm: EAGLE, draft_model: /models/draft, num_steps: {steps}, eagle_topk: 1, num_draft_tokens: {}}}\n  service: {{timeout_stop_sec: 10, drain_timeout_sec: 5, enabled: {enabled}}}\n  readiness: {{timeout_sec: 60}}\n",
        steps + 1
    );
    specd_spec::parse("qwen.yaml", &yaml).unwrap().resolve(None).unwrap()
}

struct World {
    host: FakeHost,
    dir: tempfile::TempDir,
    /// What the reconciles said, as `specd apply` prints it (for failure messages).
    log: Arc<std::sync::Mutex<Vec<String>>>,
}

impl World {
    fn new() -> World {
        // specd's state is real files (saved with fsync): in memory where the machine has a
        // tmpfs for it, so that the thousands of saves here cost nothing.
        let dir = tempfile::tempdir_in("/dev/shm").or_else(|_| tempfile::tempdir()).unwrap();
        let host = FakeHost::new(UNIT, &dir.path().join("units"));
        World { host, dir, log: Arc::default() }
    }

    fn ctx(&self) -> Ctx<FakeHost> {
        Ctx {
            host: self.host.clone(),
            unit_dir: self.dir.path().join("units"),
            // specd's state through the host: its reads and saves are calls the faults hit.
            store: Store::on(self.dir.path().join("state"), Arc::new(self.host.clone())),
            events: {
                let log = self.log.clone();
                Arc::new(move |_: &str, e: &reconcile::Event| log.lock().unwrap().push(format!("{e:?}")))
            },
            shutdown: Shutdown::never(),
            holds: reconcile::Holds::Obeyed,
            lb: Default::default(),
        }
    }

    fn said(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    fn store(&self) -> Store {
        Store::new(self.dir.path().join("state"))
    }

    /// Temporary files in specd's state directory (a save killed before its rename leaves one).
    fn state_temps(&self) -> Vec<String> {
        let dir = self.dir.path().join("state/units");
        let names = std::fs::read_dir(dir).into_iter().flatten().flatten();
        names.map(|e| e.file_name().to_string_lossy().into_owned()).filter(|n| n.ends_with(".specd-tmp")).collect()
    }

    /// One reconcile as its own task: `None` when specd was killed in it.
    async fn reconcile(&self, d: &DesiredState) -> Option<Result<Report, String>> {
        let ctx = self.ctx();
        let d = d.clone();
        let r =
            tokio::spawn(async move { reconcile::reconcile(&ctx, &d, false).await.map_err(|e| e.to_string()) }).await;
        match r {
            Ok(r) => Some(r),
            Err(e) if e.is_panic() && self.host.crashed() => None,
            Err(e) => std::panic::resume_unwind(e.into_panic()),
        }
    }
}

fn quiet_crashes() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if info.payload().downcast_ref::<Crashed>().is_none() {
                default(info);
            }
        }));
    });
}

fn desired(steps: u32) -> DesiredState {
    DesiredState::new(spec(steps, true), None)
}

/// What an apply of the matrix starts from, and what it changes besides the unit.
#[derive(Clone, Copy, Debug)]
struct Apply {
    /// The new unit's server fails to load.
    new_fails: bool,
    /// The old unit starts at boot (else an older specd never enabled it, or a person disabled it).
    enabled: bool,
    /// The new spec's `service.enabled`.
    new_enabled: bool,
    /// A drop-in in the unit's `.d` directory (the apply moves it aside).
    drop_in: bool,
    /// A load balancer polls the unit (HAProxy's agent-check, every 500 ms): the drain waits
    /// until it saw `drain`.
    balancer: bool,
    /// The new spec closes the port to new connections during the drain
    /// (`service.drain_refuse_new`), and clients keep feeding the serving instance.
    door: bool,
}

impl Apply {
    const PLAIN: Apply =
        Apply { new_fails: false, enabled: true, new_enabled: true, drop_in: false, balancer: false, door: false };
}

impl World {
    fn drop_in(&self) -> std::path::PathBuf {
        self.dir.path().join("units").join(format!("{UNIT}.d")).join("debug.conf")
    }
}

/// A world where `old` serves as `a` says, `new` to be applied.
async fn prepared(old: &DesiredState, new: &DesiredState, a: Apply) -> World {
    let w = serving(old, new, a.new_fails).await;
    w.host.set_enabled(a.enabled);
    if a.balancer {
        w.host.balancer(CheckKind::AgentCheck, "10.0.0.5", std::time::Duration::from_millis(500));
    }
    if a.door {
        w.host.fed();
    }
    if a.drop_in {
        crate::host::UnitFiles::write(&w.host, &w.drop_in(), DROP_IN.as_bytes()).unwrap();
    }
    w
}

/// A world where `old` was applied and serves.
async fn serving(old: &DesiredState, new: &DesiredState, new_fails: bool) -> World {
    let w = World::new();
    w.host.serves(&old.spec, false);
    w.host.serves(&new.spec, new_fails);
    let r = w.reconcile(old).await.unwrap().unwrap();
    assert_eq!(r.outcome, Some(Outcome::Applied), "{}", r.verdict);
    assert_eq!(w.host.serving().as_ref(), Some(&old.spec.argv));
    w
}

/// After a faulty reconcile: what it wrote and said is true of the host (of the host when it
/// concluded: a server that died at the reconcile's very last call, the save of its record,
/// died after it, as it could a moment later).
fn check_faulty_run(w: &World, old: &DesiredState, new: &DesiredState, r: &Option<Result<Report, String>>, case: &str) {
    assert_eq!(w.host.started_over_live(), 0, "{case}: a new instance was started over a live one\n{}", w.said());
    assert_eq!(w.host.started_behind_rule(), 0, "{case}: started while its port refused new connections");
    for t in w.host.writes() {
        assert!(
            t == old.unit.text || t == new.unit.text || t == DROP_IN,
            "{case}: wrote a unit that is neither old nor new:\n{t}"
        );
    }
    let file = w.host.unit_file();
    assert!(
        file.as_deref() == Some(old.unit.text.as_str()) || file.as_deref() == Some(new.unit.text.as_str()),
        "{case}: the unit file is neither old nor new"
    );
    assert_eq!(w.host.lb_violations(), Vec::<String>::new(), "{case}: its load balancers were misled\n{}", w.said());
    let Some(Ok(r)) = r else { return };
    // An apply that ended left no port closed to new connections.
    assert_eq!(w.host.refused(), None, "{case}: a port is left refusing new connections\n{}", w.said());
    assert_eq!(w.store().peek(UNIT).unwrap().refusing, None, "{case}: the state says a port is refused");
    let st = w.store().peek(UNIT).unwrap();
    // The save of its record, and the word to its load balancers after it: its last calls.
    let died_after = w.host.faulted_last_of(&["state_save", "serving_set"]);
    // Told ready only while a verified unit serves (unless it died at the very end).
    if matches!(w.host.lb_state(), Some(ServingState::Ready { .. })) && !died_after {
        let serving = w.host.serving();
        let verified = serving.as_ref() == Some(&old.spec.argv)
            || (serving.as_ref() == Some(&new.spec.argv) && st.verified_before(&new.unit.sha256));
        assert!(verified, "{case}: told ready, and it serves {serving:?}: {}\n{}", r.verdict, w.said());
    }
    match r.outcome {
        _ if died_after && w.host.serving().is_none() => {}
        Some(Outcome::Applied) => assert_eq!(w.host.serving().as_ref(), Some(&new.spec.argv), "{case}: {}", r.verdict),
        Some(Outcome::RolledBack) => {
            // Or it died right after, and the report says the service is down.
            if !matches!(r.serving, Some(Serving::Down { .. })) {
                assert_eq!(w.host.serving().as_ref(), Some(&old.spec.argv), "{case}: {}", r.verdict);
            }
            assert!(st.quarantined(&new.unit.sha256).is_some(), "{case}: rolled back without a quarantine");
        }
        Some(Outcome::Failed) if w.host.serving().is_none() && w.host.alive_count() == 0 => {
            assert!(
                matches!(r.serving, Some(Serving::Down { .. })),
                "{case}: the service is down and the report does not say so: {:?}: {}",
                r.serving,
                r.verdict
            )
        }
        _ => {}
    }
    // The record is what the reconcile said, or the verdict says it could not be saved (specd's
    // own state file could not be written: what was done on the host is done).
    if r.outcome.is_some() && !r.verdict.contains("(specd's state could not be saved: ") {
        let last = st.history.last().unwrap_or_else(|| panic!("{case}: no history"));
        assert_eq!(last.message, r.verdict, "{case}: the state does not say what the reconcile said");
    }
}

/// After the faults are over: the next reconcile (the agent's requeue, or the operator's next
/// apply) leaves a server serving, the one the state says, and the one after does nothing.
async fn check_converges(w: &World, old: &DesiredState, new: &DesiredState, fault: Fault, new_fails: bool, case: &str) {
    w.host.heal();
    let mut r = w.reconcile(new).await.unwrap().unwrap_or_else(|e| panic!("{case}: the next reconcile failed: {e}"));
    // A server the reconcile left loading (a rollback killed after its start) has loaded by now.
    tokio::time::sleep(LOAD).await;
    // The agent looks again at a unit it left loading, when it said so.
    if r.action == Action::Requeue(crate::core::timing::PROGRESSING_AGAIN) {
        tokio::time::sleep(crate::core::timing::PROGRESSING_AGAIN).await;
        r = w.reconcile(new).await.unwrap().unwrap_or_else(|e| panic!("{case}: the requeued reconcile failed: {e}"));
    }
    let serving = w.host.serving();
    assert_eq!(w.host.started_over_live(), 0, "{case}: a new instance was started over a live one\n{}", w.said());
    let st = w.store().peek(UNIT).unwrap();
    let quarantined = st.quarantined(&new.unit.sha256).is_some();
    if serving.as_ref() == Some(&new.spec.argv) {
        assert_eq!(w.host.unit_file().as_deref(), Some(new.unit.text.as_str()), "{case}");
        assert!(!quarantined, "{case}: serves a quarantined unit");
    } else {
        assert_eq!(
            serving.as_ref(),
            Some(&old.spec.argv),
            "{case}: nothing serves after the next reconcile: {}\n{}",
            r.verdict,
            w.said()
        );
        assert_eq!(w.host.unit_file().as_deref(), Some(old.unit.text.as_str()), "{case}");
        assert!(quarantined, "{case}: the old unit serves but the new one is not quarantined: {}", r.verdict);
        // A good spec is condemned only by its server dying under it (specd cannot tell that
        // from a spec that does not start); never by a host call that failed or hung.
        assert!(
            new_fails || fault == Fault::ProcessDies,
            "{case}: a good spec was quarantined by a host fault: {}\n{}",
            st.quarantined(&new.unit.sha256).map_or("", |q| q.reason.as_str()),
            w.said()
        );
    }
    assert!(st.in_progress.is_none(), "{case}: an apply is still recorded in progress: {}", r.verdict);
    assert_eq!(w.host.refused(), None, "{case}: a port is left refusing new connections\n{}", w.said());
    assert_eq!(st.refusing, None, "{case}: the state says a port is refused");
    // It serves again: never left drain.
    assert_eq!(
        w.host.lb_state().map(|s| s.word()),
        Some(Word::Ready),
        "{case}: it serves, and its load balancers are told {:?}: {}\n{}",
        w.host.lb_state(),
        r.verdict,
        w.said()
    );
    assert_eq!(w.host.lb_violations(), Vec::<String>::new(), "{case}: its load balancers were misled\n{}", w.said());
    // What was done is in the history as what it was, however many runs it took: the new unit
    // applied, or rolled back from.
    let want = if serving.as_ref() == Some(&new.spec.argv) { Outcome::Applied } else { Outcome::RolledBack };
    assert!(
        st.history.iter().any(|h| h.sha256 == new.unit.sha256 && h.outcome == want),
        "{case}: no {want:?} of the new unit in the history: {:#?}\n{}",
        st.history.iter().map(|h| (h.outcome, h.message.as_str())).collect::<Vec<_>>(),
        w.said()
    );
    assert_eq!(w.state_temps(), Vec::<String>::new(), "{case}: a temporary file is left in specd's state");
    let before = w.host.stops_and_starts();
    let again = w.reconcile(new).await.unwrap().unwrap();
    assert_eq!(
        w.host.stops_and_starts(),
        before,
        "{case}: a serving unit was stopped or started again: {}",
        again.verdict
    );
    assert_eq!(again.action, Action::AwaitChange, "{case}: {}", again.verdict);
    // A unit that serves its desired spec starts at boot as it says (set again if a fault
    // stopped it), and no drop-in changes it.
    if serving.as_ref() == Some(&new.spec.argv) {
        assert_eq!(
            w.host.enabled(),
            new.spec.service.enabled,
            "{case}: the served unit's start at boot is not the spec's: {}\n{}",
            again.verdict,
            w.said()
        );
        assert!(!crate::host::UnitFiles::exists(&w.host, &w.drop_in()), "{case}: the drop-in is still there");
    }
}

/// systemd re-executing itself during a call is ridden out by the very apply it hit: asked again
/// on a new connection, the apply ends as it would have without it (the new unit verified, or a
/// failing one rolled back), and a good spec is never quarantined for it.
fn check_rides_out_a_reexec(
    w: &World,
    old: &DesiredState,
    new: &DesiredState,
    r: &Option<Result<Report, String>>,
    new_fails: bool,
    case: &str,
) {
    let r = match r {
        Some(Ok(r)) => r,
        other => panic!("{case}: the apply did not end: {other:?}\n{}", w.said()),
    };
    let (outcome, serving) = match new_fails {
        false => (Outcome::Applied, &new.spec.argv),
        true => (Outcome::RolledBack, &old.spec.argv),
    };
    assert_eq!(r.outcome, Some(outcome), "{case}: {}\n{}", r.verdict, w.said());
    assert_eq!(w.host.serving().as_ref(), Some(serving), "{case}: {}", r.verdict);
    let st = w.store().peek(UNIT).unwrap();
    assert_eq!(st.quarantined(&new.unit.sha256).is_some(), new_fails, "{case}: {}", r.verdict);
}

/// Calls an apply of `new` over `old` makes without faults, from `a`.
async fn calls_of_apply(old: &DesiredState, new: &DesiredState, a: Apply) -> Vec<&'static str> {
    let w = prepared(old, new, a).await;
    let n0 = w.host.calls();
    let r = w.reconcile(new).await.unwrap().unwrap();
    assert!(r.outcome.is_some(), "{}", r.verdict);
    w.host.call_names()[n0..].to_vec()
}

async fn matrix(a: Apply) {
    quiet_crashes();
    let old = desired(5);
    let mut new = DesiredState::new(spec(10, a.new_enabled), None);
    new.spec.service.drain_refuse_new = a.door;
    let calls = calls_of_apply(&old, &new, a).await;
    assert_eq!(calls.contains(&"nft_refuse") && calls.contains(&"nft_accept"), a.door, "{calls:?}");
    let ran = !a.new_fails;
    assert_eq!(calls.contains(&"enable"), ran && a.new_enabled && !a.enabled, "{calls:?}");
    assert_eq!(calls.contains(&"disable"), ran && !a.new_enabled && a.enabled, "{calls:?}");
    assert_eq!(calls.contains(&"move_aside"), a.drop_in, "{calls:?}");
    assert!(calls.len() > 20, "{calls:?}");
    let mut cases = 0;
    for (i, name) in calls.iter().enumerate() {
        for f in FAULTS {
            let case = format!("fault {f:?} at call {i} ({name}) of {a:?}");
            let w = prepared(&old, &new, a).await;
            w.host.plan(i, f);
            let r = w.reconcile(&new).await;
            check_faulty_run(&w, &old, &new, &r, &case);
            if f == Fault::Crash && *name == "state_save" {
                assert_eq!(w.state_temps().len(), 1, "{case}: killed in a save, its temporary file is left");
            }
            if f == Fault::Reexec {
                check_rides_out_a_reexec(&w, &old, &new, &r, a.new_fails, &case);
            }
            check_converges(&w, &old, &new, f, a.new_fails, &case).await;
            cases += 1;
        }
    }
    let state = calls.iter().filter(|c| c.starts_with("state_")).count();
    eprintln!("{} calls ({state} to specd's state) × {} fault kinds = {cases} cases", calls.len(), FAULTS.len());
    assert!(state >= 3, "specd's state is read and saved through the host: {calls:?}");
    assert_eq!(cases, calls.len() * FAULTS.len());
}

#[tokio::test(start_paused = true)]
async fn a_fault_at_any_call_of_an_apply_leaves_the_host_old_or_new_and_the_next_reconcile_converges() {
    matrix(Apply::PLAIN).await;
}

/// The same with a load balancer polling the unit: the drain waits until it saw `drain`, and
/// whatever the fault, it is never told ready while nothing serves, never while the old server
/// is stopped, and is told ready again once a unit serves.
#[tokio::test(start_paused = true)]
async fn a_fault_at_any_call_of_an_apply_behind_a_load_balancer_never_misleads_it_and_converges_ready() {
    matrix(Apply { balancer: true, ..Apply::PLAIN }).await;
}

/// The same for a failing apply behind a load balancer: rolled back, and ready again.
#[tokio::test(start_paused = true)]
async fn a_fault_at_any_call_of_a_failing_apply_behind_a_load_balancer_converges_ready() {
    matrix(Apply { balancer: true, new_fails: true, ..Apply::PLAIN }).await;
}

/// The same for a spec that closes its port to new connections during the drain, its clients
/// feeding it all along: whatever the fault, no rule is left refusing them once the apply ended
/// (or, killed, once the next reconcile ran), and no unit is left stopped half-way.
#[tokio::test(start_paused = true)]
async fn a_fault_at_any_call_of_an_apply_that_refuses_new_connections_leaves_no_rule_and_converges() {
    matrix(Apply { door: true, ..Apply::PLAIN }).await;
}

/// The same for a failing apply that refuses new connections during its drain: rolled back.
#[tokio::test(start_paused = true)]
async fn a_fault_at_any_call_of_a_failing_apply_that_refuses_new_connections_leaves_no_rule() {
    matrix(Apply { door: true, new_fails: true, ..Apply::PLAIN }).await;
}

#[tokio::test(start_paused = true)]
async fn a_fault_at_any_call_of_a_failing_apply_and_its_rollback_still_converges() {
    matrix(Apply { new_fails: true, ..Apply::PLAIN }).await;
}

/// The same over a unit that does not start at boot: the apply ends with `systemctl enable`.
#[tokio::test(start_paused = true)]
async fn a_fault_at_any_call_of_an_apply_that_enables_the_unit_still_converges_enabled() {
    matrix(Apply { enabled: false, ..Apply::PLAIN }).await;
}

/// The same for a spec that says `service.enabled: false`: the apply ends with `systemctl
/// disable`.
#[tokio::test(start_paused = true)]
async fn a_fault_at_any_call_of_an_apply_that_disables_the_unit_still_converges_disabled() {
    matrix(Apply { new_enabled: false, ..Apply::PLAIN }).await;
}

/// The same over a unit a drop-in changes: the apply moves it aside (RemoveDropIns) before it
/// writes; a fault anywhere still converges, with the drop-in gone once the new unit serves.
#[tokio::test(start_paused = true)]
async fn a_fault_at_any_call_of_an_apply_that_removes_a_drop_in_still_converges_without_it() {
    matrix(Apply { drop_in: true, ..Apply::PLAIN }).await;
}

/// A failing apply over a drop-in: rolled back, whatever the fault.
#[tokio::test(start_paused = true)]
async fn a_fault_at_any_call_of_a_failing_apply_that_removes_a_drop_in_still_converges() {
    matrix(Apply { new_fails: true, drop_in: true, ..Apply::PLAIN }).await;
}

/// A masked unit (a person's `systemctl mask`, in the unit directory or in /run): a fault at any
/// call of a reconcile stops, starts and writes nothing, and once the faults end it says Masked.
#[tokio::test(start_paused = true)]
async fn a_fault_at_any_call_of_a_look_at_a_masked_unit_touches_nothing() {
    quiet_crashes();
    let (old, new) = (desired(5), desired(10));
    let mut cases = 0;
    for mask in [std::path::PathBuf::new(), std::path::PathBuf::from("/run/systemd/system").join(UNIT)] {
        let masked = |w: &World| {
            let at = if mask.as_os_str().is_empty() { w.dir.path().join("units").join(UNIT) } else { mask.clone() };
            w.host.mask(&at);
        };
        let probe = serving(&old, &new, false).await;
        masked(&probe);
        let n0 = probe.host.calls();
        let r = probe.reconcile(&new).await.unwrap().unwrap();
        assert!(r.verdict.starts_with("Masked"), "{}", r.verdict);
        let n = probe.host.calls() - n0;
        for i in 0..n {
            for f in FAULTS {
                let case = format!("fault {f:?} at call {i} of a look at a unit masked at {mask:?}");
                let w = serving(&old, &new, false).await;
                masked(&w);
                let (before, writes) = (w.host.stops_and_starts(), w.host.writes().len());
                w.host.plan(i, f);
                let _ = w.reconcile(&new).await;
                w.host.heal();
                let r = w.reconcile(&new).await.unwrap().unwrap();
                assert!(r.verdict.starts_with("Masked"), "{case}: {}", r.verdict);
                assert_eq!(w.host.stops_and_starts(), before, "{case}: the server was touched\n{}", w.said());
                assert_eq!(w.host.writes().len(), writes, "{case}: a unit file was written");
                // The old server goes on serving, unless the fault itself killed it (a masked
                // unit is not started again).
                tokio::time::sleep(LOAD).await;
                let serves = (f != Fault::ProcessDies).then_some(&old.spec.argv);
                assert_eq!(w.host.serving().as_ref(), serves, "{case}");
                cases += 1;
            }
        }
    }
    eprintln!("a masked unit: {cases} cases");
}

/// A unit whose spec is gone, pruned (`prune: true`): a fault at any call of the prune never
/// starts anything nor writes a unit, and the next prune (the agent's next source read) leaves
/// it stopped, disabled and without its unit file.
#[tokio::test(start_paused = true)]
async fn a_fault_at_any_call_of_a_prune_still_leaves_the_unit_stopped_disabled_and_gone() {
    quiet_crashes();
    let (old, new) = (desired(5), desired(10));
    let prune = |w: &World| {
        let ctx = w.ctx();
        async move {
            let r = tokio::spawn(async move { reconcile::prune(&ctx, UNIT).await }).await;
            if let Err(e) = r
                && !e.is_panic()
            {
                panic!("{e}");
            }
        }
    };
    let probe = serving(&old, &new, false).await;
    let n0 = probe.host.calls();
    prune(&probe).await;
    let calls = probe.host.call_names()[n0..].to_vec();
    assert!(calls.contains(&"disable") && calls.contains(&"move_aside"), "{calls:?}");
    let mut cases = 0;
    for (i, name) in calls.iter().enumerate() {
        for f in FAULTS {
            let case = format!("fault {f:?} at call {i} ({name}) of a prune");
            let w = serving(&old, &new, false).await;
            let (starts, writes) = (w.host.stops_and_starts().1, w.host.writes().len());
            w.host.plan(i, f);
            prune(&w).await;
            assert_eq!(w.host.stops_and_starts().1, starts, "{case}: something was started");
            assert_eq!(w.host.writes().len(), writes, "{case}: a unit file was written");
            w.host.heal();
            prune(&w).await;
            tokio::time::sleep(LOAD).await;
            assert_eq!(w.host.serving(), None, "{case}: the pruned unit still serves");
            assert_eq!(w.host.alive_count(), 0, "{case}: a process of the pruned unit is alive");
            assert!(!w.host.enabled(), "{case}: the pruned unit still starts at boot");
            assert_eq!(w.host.unit_file(), None, "{case}: the pruned unit's file is still there");
            assert_eq!(w.host.lb_state().map(|s| s.word()), Some(Word::Down), "{case}: its load balancers");
            assert_eq!(w.host.lb_violations(), Vec::<String>::new(), "{case}: stopped while told ready");
            cases += 1;
        }
    }
    eprintln!("a prune: {} calls × {} fault kinds = {cases} cases", calls.len(), FAULTS.len());
}

/// A group's spare that serves its proved spec while its group is at rest: the reconcile that
/// drains and stops it (behind a load balancer), with a fault at every call, never starts or
/// writes anything, never leaves its balancer told ready while it stops, and the next one leaves
/// it stopped and told down; the one after touches nothing.
#[tokio::test(start_paused = true)]
async fn a_fault_at_any_call_of_a_spares_stop_at_rest_leaves_it_stopped_and_told_down() {
    quiet_crashes();
    let spare = {
        let mut s = spec(5, false);
        let yaml = "apiVersion: specd/v1\nkind: InferenceService\nmetadata: {name: qwen}\nspec:\n  unit: U\n  engine: sglang\n  model: /m\n  rollout: {group: llm, max_unavailable: 0, max_surge: 1, spare: true}\n";
        s.rollout = specd_spec::parse("s.yaml", &yaml.replace('U', UNIT)).unwrap().resolve(None).unwrap().rollout;
        s.policy.rollback = false;
        DesiredState::new(s, None)
    };
    // Applied (its own spec proved), serving, a balancer polling it: the next look rests it.
    let serving_spare = || async {
        let w = World::new();
        w.host.serves(&spare.spec, false);
        let r = w.reconcile(&spare).await.unwrap().unwrap();
        assert_eq!(r.outcome, Some(Outcome::Applied), "{}", r.verdict);
        assert!(r.roll_wait, "a serving spare looks again soon: {:?}", r.action);
        w.host.balancer(CheckKind::AgentCheck, "10.0.0.5", std::time::Duration::from_millis(500));
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        w
    };
    let probe = serving_spare().await;
    let n0 = probe.host.calls();
    let r = probe.reconcile(&spare).await.unwrap().unwrap();
    assert!(r.verdict.contains("stopped while the group is at rest"), "{}", r.verdict);
    let calls = probe.host.call_names()[n0..].to_vec();
    assert!(calls.contains(&"stop") && calls.contains(&"serving_set"), "{calls:?}");
    let mut cases = 0;
    for (i, name) in calls.iter().enumerate() {
        for f in FAULTS {
            let case = format!("fault {f:?} at call {i} ({name}) of a spare's stop at rest");
            let w = serving_spare().await;
            let (starts, writes) = (w.host.stops_and_starts().1, w.host.writes().len());
            w.host.plan(i, f);
            let _ = w.reconcile(&spare).await;
            assert_eq!(w.host.stops_and_starts().1, starts, "{case}: something was started\n{}", w.said());
            assert_eq!(w.host.writes().len(), writes, "{case}: a unit file was written");
            assert_eq!(w.host.lb_violations(), Vec::<String>::new(), "{case}: stopped while told ready");
            w.host.heal();
            let r = w.reconcile(&spare).await.unwrap().unwrap_or_else(|e| panic!("{case}: the next look failed: {e}"));
            tokio::time::sleep(LOAD).await;
            assert_eq!(w.host.serving(), None, "{case}: the spare still serves: {}\n{}", r.verdict, w.said());
            assert_eq!(w.host.alive_count(), 0, "{case}: a process of the spare is alive");
            assert_eq!(w.host.lb_state().map(|s| s.word()), Some(Word::Down), "{case}: {}", r.verdict);
            assert_eq!(w.host.lb_violations(), Vec::<String>::new(), "{case}: stopped while told ready");
            assert_eq!(w.state_temps(), Vec::<String>::new(), "{case}: a temporary file is left in specd's state");
            let before = w.host.stops_and_starts();
            let again = w.reconcile(&spare).await.unwrap().unwrap();
            assert_eq!(w.host.stops_and_starts(), before, "{case}: touched again: {}", again.verdict);
            assert!(again.verdict.contains("stopped while the group is at rest"), "{case}: {}", again.verdict);
            cases += 1;
        }
    }
    eprintln!("a spare's stop at rest: {} calls × {} fault kinds = {cases} cases", calls.len(), FAULTS.len());
}

/// A unit that is in sync and serving is never stopped or started because a call failed.
#[tokio::test(start_paused = true)]
async fn a_healthy_in_sync_server_is_never_restarted_by_a_fault() {
    quiet_crashes();
    let (old, new) = (desired(5), desired(10));
    let probe = serving(&old, &new, false).await;
    let r = probe.reconcile(&new).await.unwrap().unwrap();
    assert_eq!(r.outcome, Some(Outcome::Applied));
    let n0 = probe.host.calls();
    let r = probe.reconcile(&new).await.unwrap().unwrap();
    assert!(r.verdict.starts_with("InSync"), "{}", r.verdict);
    let n = probe.host.calls() - n0;
    for i in 0..n {
        for f in [Fault::Fails, Fault::TimesOut, Fault::ProcessLingers, Fault::Crash, Fault::Reexec] {
            let w = serving(&new, &old, false).await;
            w.host.plan(i, f);
            let before = w.host.stops_and_starts();
            let _ = w.reconcile(&new).await;
            assert_eq!(w.host.stops_and_starts(), before, "fault {f:?} at call {i}: the serving unit was touched");
            assert_eq!(w.host.serving().as_ref(), Some(&new.spec.argv));
        }
    }
}

/// A serving unit that only has to be enabled again (a person ran `systemctl disable`): a fault at
/// any call never stops or starts its server, the verdict says enabled only when it is, and the
/// next reconcile enables it.
#[tokio::test(start_paused = true)]
async fn a_fault_while_only_enabling_never_touches_the_server_and_the_next_reconcile_enables() {
    quiet_crashes();
    let (old, new) = (desired(5), desired(10));
    let probe = serving(&new, &old, false).await;
    probe.host.set_enabled(false);
    let n0 = probe.host.calls();
    let r = probe.reconcile(&new).await.unwrap().unwrap();
    assert!(r.verdict.contains("starts at boot now"), "{}", r.verdict);
    assert!(probe.host.enabled());
    let n = probe.host.calls() - n0;
    assert!(probe.host.call_names()[n0..].contains(&"enable"));
    for i in 0..n {
        for f in [Fault::Fails, Fault::TimesOut, Fault::ProcessLingers, Fault::Crash, Fault::Reexec] {
            let case = format!("fault {f:?} at call {i} of an enable");
            let w = serving(&new, &old, false).await;
            w.host.set_enabled(false);
            w.host.plan(i, f);
            let before = w.host.stops_and_starts();
            let r = w.reconcile(&new).await;
            assert_eq!(w.host.stops_and_starts(), before, "{case}: the server was touched\n{}", w.said());
            if let Some(Ok(r)) = &r
                && r.verdict.contains("starts at boot now")
            {
                assert!(w.host.enabled(), "{case}: {}", r.verdict);
            }
            w.host.heal();
            let r = w.reconcile(&new).await.unwrap().unwrap();
            assert!(w.host.enabled(), "{case}: not enabled after the next reconcile: {}\n{}", r.verdict, w.said());
            assert_eq!(w.host.serving().as_ref(), Some(&new.spec.argv), "{case}");
            assert_eq!(w.host.stops_and_starts(), before, "{case}: the server was touched\n{}", w.said());
        }
    }
}

/// A hold set while the agent's reconcile waited for the unit's lock (a rollback's pin, a
/// sweep's point) is seen under the lock: that reconcile observes and reports only. An
/// operator's command overrides it.
#[tokio::test(start_paused = true)]
async fn a_hold_set_while_a_reconcile_waits_for_the_lock_stops_the_agent_not_an_operator() {
    let (old, new) = (desired(3), desired(5));
    let w = serving(&old, &new, false).await;
    let hold = crate::core::hold::Hold::new(
        crate::core::hold::HoldKind::Suspend,
        "root (specd suspend)",
        crate::machine::store::now(),
    );
    w.store().set_hold(UNIT, hold).await.unwrap();
    let r = w.reconcile(&new).await.unwrap().unwrap();
    assert_eq!(r.outcome, None, "{}", r.verdict);
    assert!(r.verdict.contains("held: suspended by root (specd suspend)"), "{}", r.verdict);
    assert_eq!(w.host.serving().as_ref(), Some(&old.spec.argv), "the agent acted on a held unit");
    let ctx = Ctx { holds: reconcile::Holds::Overridden, ..w.ctx() };
    let r = reconcile::reconcile(&ctx, &new, false).await.unwrap();
    assert_eq!(r.outcome, Some(Outcome::Applied), "{}", r.verdict);
    assert_eq!(w.host.serving().as_ref(), Some(&new.spec.argv));
}

/// A unit that cannot start on this host (its pre-flight finds a missing program, model or port)
/// is refused before anything is stopped: the serving instance is not touched, nothing is
/// quarantined, and the refusal is recorded once, not at every look.
#[tokio::test(start_paused = true)]
async fn a_unit_that_cannot_start_here_is_refused_before_the_serving_one_is_stopped() {
    let (old, new) = (desired(5), desired(10));
    let w = serving(&old, &new, false).await;
    let missing = crate::preflight::Problem {
        check: crate::preflight::CheckKind::DraftModel,
        message: "the draft model /models/draft does not exist".into(),
    };
    w.host.lacks(&new.spec, missing);
    let before = w.host.stops_and_starts();
    let r = w.reconcile(&new).await.unwrap().unwrap();
    assert_eq!(r.outcome, Some(Outcome::Refused), "{}", r.verdict);
    assert!(r.refused);
    assert!(
        r.verdict
            .contains("cannot start on this host: the draft model /models/draft does not exist; nothing was stopped"),
        "{}",
        r.verdict
    );
    assert_eq!(r.action, Action::Requeue(crate::core::timing::PREFLIGHT_AGAIN));
    assert_eq!(w.host.stops_and_starts(), before, "the serving instance was touched\n{}", w.said());
    assert_eq!(w.host.serving().as_ref(), Some(&old.spec.argv));
    assert_eq!(w.host.unit_file().as_deref(), Some(old.unit.text.as_str()));
    let st = w.store().peek(UNIT).unwrap();
    assert!(st.quarantined(&new.unit.sha256).is_none());
    assert!(st.in_progress.is_none());
    assert_eq!(st.history.last().map(|h| (h.outcome, h.message.clone())), Some((Outcome::Refused, r.verdict.clone())));
    // Looked at again (a resync): the same refusal, not recorded again.
    let n = st.history.len();
    let again = w.reconcile(&new).await.unwrap().unwrap();
    assert_eq!((again.outcome, again.verdict.as_str()), (None, r.verdict.as_str()));
    assert_eq!(w.store().peek(UNIT).unwrap().history.len(), n);
    // A dry run says so too.
    let dry = reconcile::reconcile(&w.ctx(), &new, true).await.unwrap();
    assert!(dry.refused && dry.outcome.is_none(), "{}", dry.verdict);
}

/// The pre-flight looks while the drain waits for the requests in flight (the drain stops
/// nothing), and the stop waits for both: under a steady load, where the drain runs out its
/// budget (`drain_timeout_sec: 5`), the apply is not delayed by the look as well. A refusal found
/// meanwhile ends the drain, and nothing is stopped.
#[tokio::test(start_paused = true)]
async fn the_pre_flight_looks_while_the_drain_waits_and_the_stop_waits_for_both() {
    let (old, new) = (desired(5), desired(10));
    let w = serving(&old, &new, false).await;
    let (look, drain) = (std::time::Duration::from_secs(3), std::time::Duration::from_secs(5));
    w.host.preflight_lag(look);
    w.host.busy_for(std::time::Duration::from_secs(60));
    let t0 = tokio::time::Instant::now();
    let r = w.reconcile(&new).await.unwrap().unwrap();
    let took = t0.elapsed();
    assert_eq!(r.outcome, Some(Outcome::Applied), "{}", r.verdict);
    assert!(
        took >= drain && took < drain + look,
        "the apply took {took:?}: the look and the drain, one after the other\n{}",
        w.said()
    );
    // Refused meanwhile: the drain ends, nothing is stopped, the apply's record goes.
    w.host.lacks(
        &old.spec,
        crate::preflight::Problem {
            check: crate::preflight::CheckKind::Model,
            message: "the model /models/qwen does not exist".into(),
        },
    );
    w.host.busy_for(std::time::Duration::from_secs(60));
    let before = w.host.stops_and_starts();
    let t0 = tokio::time::Instant::now();
    let r = w.reconcile(&old).await.unwrap().unwrap();
    assert_eq!(r.outcome, Some(Outcome::Refused), "{}", r.verdict);
    assert_eq!(t0.elapsed(), look, "the refusal waited for the drain");
    assert_eq!(w.host.stops_and_starts(), before);
    assert_eq!(w.host.serving().as_ref(), Some(&new.spec.argv));
    assert!(w.store().peek(UNIT).unwrap().in_progress.is_none());
}

/// A pre-flight that outlasts the drain: a request that came while it looked finishes before the
/// stop (the drain is asked again, within its budget), and a stop asked for while it looks ends
/// the apply there, nothing stopped.
#[tokio::test(start_paused = true)]
async fn a_request_that_comes_while_the_pre_flight_looks_is_drained_before_the_stop() {
    let (old, new) = (desired(5), desired(10));
    let w = serving(&old, &new, false).await;
    w.host.preflight_lag(std::time::Duration::from_secs(3));
    // The drain finds nothing in flight at once; a request comes at 2 s and ends at 4 s.
    let host = w.host.clone();
    tokio::spawn(async move {
        tokio::time::sleep(std::time::Duration::from_secs(2)).await;
        host.busy_for(std::time::Duration::from_secs(2));
    });
    let r = w.reconcile(&new).await.unwrap().unwrap();
    assert_eq!(r.outcome, Some(Outcome::Applied), "{}", r.verdict);
    assert_eq!(w.host.stops_while_busy(), 0, "stopped with a request in flight\n{}", w.said());

    // Asked to stop while the look goes on after the drain: nothing is stopped, nothing recorded
    // as in progress.
    let w = serving(&old, &new, false).await;
    w.host.preflight_lag(std::time::Duration::from_secs(60));
    let (tx, shutdown) = Shutdown::new();
    let ctx = Ctx { shutdown, ..w.ctx() };
    tokio::spawn(async move {
        tokio::time::sleep(std::time::Duration::from_secs(5)).await;
        let _ = tx.send(true);
    });
    let before = w.host.stops_and_starts();
    let t0 = tokio::time::Instant::now();
    let r = reconcile::reconcile(&ctx, &new, false).await.unwrap();
    assert!(t0.elapsed() < std::time::Duration::from_secs(10), "waited for the look: {:?}", t0.elapsed());
    assert!(r.verdict.contains("nothing was changed"), "{}", r.verdict);
    assert_eq!(w.host.stops_and_starts(), before);
    assert!(w.store().peek(UNIT).unwrap().in_progress.is_none());
}

/// An apply killed while it drains and looks changed nothing: the next run is a fresh apply (not
/// the second half of one that may have stopped the old instance), so asked to stop in its own
/// drain it stops there.
#[tokio::test(start_paused = true)]
async fn an_apply_killed_in_its_drain_left_nothing_to_finish() {
    let (old, new) = (desired(5), desired(10));
    let w = serving(&old, &new, false).await;
    w.host.preflight_lag(std::time::Duration::from_secs(30));
    // Killed 2 s in: the run is dropped where it is (not spawned: a kill leaves no task behind).
    let ctx = w.ctx();
    assert!(
        tokio::time::timeout(std::time::Duration::from_secs(2), reconcile::reconcile(&ctx, &new, false)).await.is_err()
    );
    let left = w.store().peek(UNIT).unwrap().in_progress.expect("the apply's record, as a kill leaves it");
    assert!(!left.may_have_changed(), "{left:?}");
    w.host.preflight_lag(std::time::Duration::ZERO);
    w.host.busy_for(std::time::Duration::from_secs(60));
    let (tx, shutdown) = Shutdown::new();
    let ctx = Ctx { shutdown, ..w.ctx() };
    tokio::spawn(async move {
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        let _ = tx.send(true);
    });
    let before = w.host.stops_and_starts();
    let r = reconcile::reconcile(&ctx, &new, false).await.unwrap();
    assert!(r.verdict.contains("nothing was changed"), "{}", r.verdict);
    assert_eq!(w.host.stops_and_starts(), before);
}

/// With nothing serving, there is nothing to protect: the start is tried, and its failure is
/// rolled back and told as any other.
#[tokio::test(start_paused = true)]
async fn a_unit_that_does_not_run_is_started_whatever_its_pre_flight_says() {
    let (old, new) = (desired(5), desired(10));
    let w = serving(&old, &new, false).await;
    w.host.lacks(
        &new.spec,
        crate::preflight::Problem {
            check: crate::preflight::CheckKind::Port,
            message: "port 30000 is held by pid 7".into(),
        },
    );
    crate::host::ServiceManager::stop(&w.host, UNIT, true).await.unwrap();
    let r = w.reconcile(&new).await.unwrap().unwrap();
    assert_eq!(r.outcome, Some(Outcome::Applied), "{}", r.verdict);
}

/// A unit whose server fails to load is rolled back, and the verdict and the quarantine quote
/// what the server said last (read from the failed instance's journal).
#[tokio::test(start_paused = true)]
async fn a_failed_start_quotes_the_server_s_own_error_in_the_verdict_and_the_quarantine() {
    let (old, new) = (desired(5), desired(10));
    let w = serving(&old, &new, true).await;
    let r = w.reconcile(&new).await.unwrap().unwrap();
    assert_eq!(r.outcome, Some(Outcome::RolledBack), "{}", r.verdict);
    let said = format!("the server said: {}", crate::host::fake::FAILED_LOAD);
    assert!(r.verdict.ends_with(&said), "{}", r.verdict);
    let st = w.store().peek(UNIT).unwrap();
    assert!(st.quarantined(&new.unit.sha256).unwrap().reason.ends_with(&said));
}

/// A server killed (SIGKILL) at any moment of an apply of a unit that passed verification before
/// (while it loads: it may have answered ready to someone else a moment before) does not
/// quarantine that unit: one death is not a verdict on a unit known to work.
#[tokio::test(start_paused = true)]
async fn a_unit_verified_before_is_never_quarantined_by_its_server_being_killed() {
    quiet_crashes();
    let (old, new) = (desired(5), desired(10));
    // new verified once, then old again: new is the next apply.
    let probe = serving(&old, &new, false).await;
    assert_eq!(probe.reconcile(&new).await.unwrap().unwrap().outcome, Some(Outcome::Applied));
    assert_eq!(probe.reconcile(&old).await.unwrap().unwrap().outcome, Some(Outcome::Applied));
    let n0 = probe.host.calls();
    let r = probe.reconcile(&new).await.unwrap().unwrap();
    assert_eq!(r.outcome, Some(Outcome::Applied), "{}", r.verdict);
    let calls = probe.host.call_names()[n0..].to_vec();
    let start = calls.iter().position(|c| *c == "start").unwrap();
    for (i, name) in calls.iter().enumerate().skip(start + 1) {
        let w = serving(&old, &new, false).await;
        assert_eq!(w.reconcile(&new).await.unwrap().unwrap().outcome, Some(Outcome::Applied));
        assert_eq!(w.reconcile(&old).await.unwrap().unwrap().outcome, Some(Outcome::Applied));
        w.host.plan(i, Fault::ProcessDies);
        let r = w.reconcile(&new).await.unwrap().unwrap();
        let case = format!("the server killed at call {i} ({name})");
        let st = w.store().peek(UNIT).unwrap();
        assert!(st.quarantined(&new.unit.sha256).is_none(), "{case}: {}\n{}", r.verdict, w.said());
        // And it serves again: the next reconcile starts it (the fake has no Restart=).
        w.host.heal();
        let again = w.reconcile(&new).await.unwrap().unwrap();
        tokio::time::sleep(LOAD).await;
        assert_eq!(w.host.serving().as_ref(), Some(&new.spec.argv), "{case}: {}\n{}", again.verdict, w.said());
    }
}

/// Behind a load balancer (an agent-check every 500 ms), an apply tells it `drain` before the stop
/// and stops only once it polled and was answered so, says so, and tells it ready once the new
/// unit is verified.
#[tokio::test(start_paused = true)]
async fn an_apply_behind_a_load_balancer_stops_only_once_it_saw_drain_and_tells_it_ready_after() {
    let (old, new) = (desired(5), desired(10));
    let w = serving(&old, &new, false).await;
    assert_eq!(w.host.lb_told(), [Word::Ready], "the first apply's end");
    let every = std::time::Duration::from_millis(500);
    w.host.balancer(CheckKind::AgentCheck, "10.0.0.5", every);
    // Its polls are at 0, 500 ms, 1 s...: the mark comes between two.
    tokio::time::sleep(std::time::Duration::from_millis(120)).await;
    let r = w.reconcile(&new).await.unwrap().unwrap();
    assert_eq!(r.outcome, Some(Outcome::Applied), "{}", r.verdict);
    let (mark, stop) = (w.host.lb_told_at(Word::Drain).unwrap(), w.host.stop_times()[0]);
    // The next poll after the mark is at 500 ms; the apply looks every 100 ms.
    let waited = stop - mark;
    assert!(waited >= std::time::Duration::from_millis(380), "stopped {waited:?} after the mark\n{}", w.said());
    assert!(waited <= std::time::Duration::from_millis(500), "stopped {waited:?} after the mark\n{}", w.said());
    assert!(w.said().contains("Progress(\"1 load balancer (10.0.0.5) saw drain after 0.4 s\")"), "{}", w.said());
    assert_eq!(w.host.lb_told(), [Word::Ready, Word::Drain, Word::Ready]);
    assert_eq!(w.host.lb_violations(), Vec::<String>::new());
}

/// With no load balancer polling (the defaults: no settle time), the drain marks the unit and
/// waits for nobody; the apply says that nothing keeps traffic away during the stop.
#[tokio::test(start_paused = true)]
async fn with_no_load_balancer_an_apply_says_nothing_keeps_traffic_away_and_waits_for_nobody() {
    let (old, new) = (desired(5), desired(10));
    let w = serving(&old, &new, false).await;
    let r = w.reconcile(&new).await.unwrap().unwrap();
    assert_eq!(r.outcome, Some(Outcome::Applied), "{}", r.verdict);
    assert_eq!(w.host.stop_times()[0], w.host.lb_told_at(Word::Drain).unwrap(), "{}", w.said());
    assert!(
        w.said().contains("Progress(\"no load balancer polls this unit: nothing keeps traffic away during the stop\")"),
        "{}",
        w.said()
    );
    // A settle time (load_balancer.settle_sec) is waited when none polls.
    let ctx = Ctx {
        lb: crate::core::serving::Balancers { settle: std::time::Duration::from_secs(2), ..Default::default() },
        ..w.ctx()
    };
    let r = reconcile::reconcile(&ctx, &old, false).await.unwrap();
    assert_eq!(r.outcome, Some(Outcome::Applied), "{}", r.verdict);
    let (mark, stop) = (w.host.lb_told_at(Word::Drain).unwrap(), w.host.stop_times()[1]);
    assert_eq!(stop - mark, std::time::Duration::from_secs(2), "{}", w.said());
    assert!(w.said().contains("waited the settle time of 2 s"), "{}", w.said());
}

/// A load balancer that stops polling at the mark is waited for no longer than the drain budget
/// (`drain_timeout_sec: 5`, shorter than the 10 s after which it counts as gone), and the apply
/// warns that it did not see drain.
#[tokio::test(start_paused = true)]
async fn a_load_balancer_that_never_sees_drain_holds_the_stop_no_longer_than_the_drain_budget() {
    let (old, new) = (desired(5), desired(10));
    let w = serving(&old, &new, false).await;
    w.host.balancer(CheckKind::AgentCheck, "10.0.0.5", std::time::Duration::from_millis(500));
    tokio::time::sleep(std::time::Duration::from_millis(1200)).await;
    w.host.balancer_stops("10.0.0.5");
    let r = w.reconcile(&new).await.unwrap().unwrap();
    assert_eq!(r.outcome, Some(Outcome::Applied), "{}", r.verdict);
    let (mark, stop) = (w.host.lb_told_at(Word::Drain).unwrap(), w.host.stop_times()[0]);
    let waited = stop - mark;
    assert!(
        waited >= std::time::Duration::from_secs(5) && waited < std::time::Duration::from_millis(5200),
        "{waited:?}"
    );
    assert!(
        w.said().contains(
            "Warning(\"1 of 1 load balancer (10.0.0.5) did not see drain within 5.0 s (drain_timeout_sec 5 s)"
        ),
        "{}",
        w.said()
    );
}

/// A plan the pre-flight refuses while the drain waits (the unit cannot start here) stops
/// nothing, and its load balancers are told ready again: the old unit serves on.
#[tokio::test(start_paused = true)]
async fn a_refusal_during_the_drain_tells_the_load_balancers_ready_again() {
    let (old, new) = (desired(5), desired(10));
    let w = serving(&old, &new, false).await;
    w.host.balancer(CheckKind::AgentCheck, "10.0.0.5", std::time::Duration::from_millis(500));
    w.host.lacks(
        &new.spec,
        crate::preflight::Problem {
            check: crate::preflight::CheckKind::Model,
            message: "the model /models/qwen does not exist".into(),
        },
    );
    w.host.preflight_lag(std::time::Duration::from_millis(300));
    let r = w.reconcile(&new).await.unwrap().unwrap();
    assert_eq!(r.outcome, Some(Outcome::Refused), "{}", r.verdict);
    assert_eq!(w.host.stop_times(), []);
    assert_eq!(w.host.lb_told(), [Word::Ready, Word::Drain, Word::Ready], "{}", w.said());
    assert_eq!(w.host.serving().as_ref(), Some(&old.spec.argv));
}

/// An apply whose load balancers cannot be told drain (specd's runtime directory unwritable)
/// refuses to stop the serving instance: nothing changes, and it is looked at again.
#[tokio::test(start_paused = true)]
async fn an_apply_that_cannot_tell_its_load_balancers_drain_stops_nothing() {
    let (old, new) = (desired(5), desired(10));
    let w = serving(&old, &new, false).await;
    let probe = serving(&old, &new, false).await;
    let n0 = probe.host.calls();
    probe.reconcile(&new).await.unwrap().unwrap();
    let at = probe.host.call_names()[n0..].iter().position(|c| *c == "serving_set").unwrap();
    w.host.plan(at, Fault::Fails);
    let r = w.reconcile(&new).await.unwrap().unwrap();
    assert_eq!(r.outcome, Some(Outcome::Refused), "{}", r.verdict);
    assert!(
        r.verdict.contains(
            "its load balancers could not be told drain (serving_set: injected failure); nothing was stopped"
        ),
        "{}",
        r.verdict
    );
    assert_eq!(w.host.stop_times(), []);
    assert_eq!(w.host.serving().as_ref(), Some(&old.spec.argv));
    assert_eq!(r.action, Action::Requeue(crate::core::timing::PREFLIGHT_AGAIN));
}

/// An apply times the start it made by the phases its server's own lines tell (the fake says
/// the engine's markers over its load): they add up to the start as specd measured it, less at
/// most one readiness poll; the unit's record and the apply's history entry keep them, and the
/// apply's progress says them. A start that dies while loading is recorded where it ended.
#[tokio::test(start_paused = true)]
async fn an_apply_times_its_start_by_the_phases_its_server_tells() {
    let (old, new) = (desired(3), desired(4));
    let w = serving(&old, &new, false).await;
    let r = w.reconcile(&new).await.unwrap().unwrap();
    assert_eq!(r.outcome, Some(Outcome::Applied), "{}", r.verdict);
    let st = w.store().peek(UNIT).unwrap();
    let s = st.startup.clone().expect("the start is recorded");
    assert!(s.ready && s.sha256 == new.unit.sha256, "{s:?}");
    let names: Vec<&str> = s.phases.iter().map(|p| p.phase.as_str()).collect();
    assert_eq!(names, ["process", "weights", "engine", "api"], "SGLang's phases, a draft's added to them");
    let sum: u64 = s.phases.iter().map(|p| p.ms).sum();
    assert_eq!(sum, LOAD.as_millis() as u64, "from the exec to the ready line: {s:?}");
    assert!(s.ms >= sum && s.ms - sum <= crate::core::timing::READY_EVERY.as_millis() as u64, "{s:?}");
    assert_eq!(st.history.last().and_then(|h| h.startup.as_ref()), Some(&s));
    assert!(w.said().contains(&format!("Progress(\"{}\")", s.describe())), "{}", w.said());

    let bad = desired(5);
    w.host.serves(&bad.spec, true);
    let r = w.reconcile(&bad).await.unwrap().unwrap();
    assert_eq!(r.outcome, Some(Outcome::RolledBack), "{}", r.verdict);
    let st = w.store().peek(UNIT).unwrap();
    let h = st.history.iter().rfind(|h| h.sha256 == bad.unit.sha256).unwrap();
    let died = h.startup.clone().expect("the failed start is recorded");
    assert!(!died.ready, "{died:?}");
    // It died halfway through its load: after the engine's second phase began.
    assert_eq!(died.phases.last().map(|p| p.phase.as_str()), Some("engine"), "{died:?}");
    assert!(died.describe().ends_with("it ended in phase engine"), "{}", died.describe());
    // The unit's record has the last start: the rollback's, ready.
    assert!(st.startup.as_ref().is_some_and(|s| s.ready && s.sha256 == new.unit.sha256), "{:?}", st.startup);
}

/// `desired(steps)` on GPUs 0 and 1, its server claiming `share` of each (SGLang's
/// `mem_fraction_static`; `None`: the engine's own choice, which specd does not know).
fn on_gpus(steps: u32, share: Option<f64>) -> DesiredState {
    let mut s = spec(steps, true);
    s.service.environment.insert("CUDA_VISIBLE_DEVICES".into(), "0,1".into());
    s.server.mem_fraction_static = share;
    DesiredState::new(s, None)
}

const HELD: &str = include_str!("../../tests/fixtures/nvidia-smi/held.csv");
const FREED: &str = include_str!("../../tests/fixtures/nvidia-smi/freed.csv");

/// After the old instance is gone, the start waits for the GPUs its `CUDA_VISIBLE_DEVICES` names
/// to free the memory it claims (as nvidia-smi reports it), and says so; memory still held at
/// the bound is the host's fault: the start is not made, the verdict says why, nothing is
/// quarantined. An engine that does not say what it claims is started anyway, with a warning.
#[tokio::test(start_paused = true)]
async fn a_start_waits_for_its_gpus_memory_and_is_not_made_over_memory_still_held() {
    let (old, new) = (on_gpus(5, Some(0.85)), on_gpus(10, Some(0.85)));
    let w = serving(&old, &new, false).await;
    // The driver frees the stopped instance's memory a second after its processes are gone.
    w.host.gpus(&[Ok(HELD), Ok(HELD), Ok(HELD), Ok(FREED)]);
    let r = w.reconcile(&new).await.unwrap().unwrap();
    assert_eq!(r.outcome, Some(Outcome::Applied), "{}", r.verdict);
    let said = w.said();
    assert!(said.contains("Phase(\"waiting for GPU 0,1 to free its memory (up to 30s)\")"), "{said}");
    assert!(
        said.contains(
            "GPU 0 (GPU-2762b558-7fac-024b-2b6f-209a2e06b94c): 21246 of 23034 MiB in use (the start claims 0.85 of it)"
        ),
        "{said}"
    );
    assert!(said.contains("Progress(\"GPU 0,1: memory free after 1.5s\")"), "{said}");

    // Held for good (another process holds GPU 1): the new unit is not started.
    w.host.gpus(&[Ok(HELD)]);
    let before = w.host.stops_and_starts();
    let t0 = tokio::time::Instant::now();
    let r = w.reconcile(&old).await.unwrap().unwrap();
    assert!(
        r.verdict.contains("did not free their memory within 30s: GPU 0 (GPU-2762b558-7fac-024b-2b6f-209a2e06b94c): 21246 of 23034 MiB in use (the start claims 0.85 of it); GPU 1"),
        "{}\n{}",
        r.verdict,
        w.said()
    );
    assert!(t0.elapsed() >= crate::core::timing::GPU_MEMORY_WITHIN, "{:?}", t0.elapsed());
    assert_eq!(w.host.serving(), None, "started over memory still held\n{}", w.said());
    assert_eq!(w.host.started_over_live(), 0);
    let after = w.host.stops_and_starts();
    assert_eq!(after.1, before.1, "no start\n{}", w.said());
    assert_eq!(r.outcome, Some(Outcome::Failed), "{}", r.verdict);
    assert!(r.verdict.ends_with("is DOWN (inactive/dead)"), "{}", r.verdict);
    let st = w.store().peek(UNIT).unwrap();
    assert!(st.quarantined(&old.unit.sha256).is_none() && st.quarantined(&new.unit.sha256).is_none());

    // Freed: the next reconcile starts it.
    w.host.gpus(&[Ok(FREED)]);
    let r = w.reconcile(&old).await.unwrap().unwrap();
    assert_eq!(r.outcome, Some(Outcome::Applied), "{}\n{}", r.verdict, w.said());
    assert_eq!(w.host.serving().as_ref(), Some(&old.spec.argv));

    // An engine that does not say what it claims, on GPUs still in use: started, and warned.
    let (a, b) = (on_gpus(3, None), on_gpus(4, None));
    let w = serving(&a, &b, false).await;
    w.host.gpus(&[Ok(HELD)]);
    let r = w.reconcile(&b).await.unwrap().unwrap();
    assert_eq!(r.outcome, Some(Outcome::Applied), "{}", r.verdict);
    assert!(w.said().contains("still in use after 30s: GPU 0"), "{}", w.said());
}

/// nvidia-smi failing, hanging or not answering at all is said, and the start goes on: what
/// cannot be checked does not keep a unit down.
#[tokio::test(start_paused = true)]
async fn a_gpu_look_that_fails_or_hangs_is_said_and_the_start_goes_on() {
    let (old, new) = (on_gpus(5, Some(0.85)), on_gpus(10, Some(0.85)));
    for fault in [Fault::Fails, Fault::TimesOut] {
        let w = serving(&old, &new, false).await;
        w.host.gpus(&[Ok(FREED)]);
        let calls = calls_with_gpus(&w, &new).await;
        let i = calls.iter().position(|c| *c == "gpu_memory").expect("the start looks at the GPUs");
        let w = serving(&old, &new, false).await;
        w.host.gpus(&[Ok(FREED)]);
        w.host.plan(i, fault);
        let r = w.reconcile(&new).await.unwrap().unwrap();
        assert_eq!(r.outcome, Some(Outcome::Applied), "{fault:?}: {}", r.verdict);
        let said = w.said();
        assert!(
            said.contains("Warning(\"the GPUs' memory is not checked before the start: gpu_memory"),
            "{fault:?}: {said}"
        );
    }
    // The driver not loaded: nvidia-smi's own words.
    let w = serving(&old, &new, false).await;
    w.host.gpus(&[Err(include_str!("../../tests/fixtures/nvidia-smi/no-driver.txt").trim())]);
    let r = w.reconcile(&new).await.unwrap().unwrap();
    assert_eq!(r.outcome, Some(Outcome::Applied), "{}", r.verdict);
    assert!(w.said().contains("not checked before the start: NVIDIA-SMI has failed"), "{}", w.said());
}

/// The calls of one apply of `new` (the world is used up).
async fn calls_with_gpus(w: &World, new: &DesiredState) -> Vec<&'static str> {
    let n0 = w.host.calls();
    assert_eq!(w.reconcile(new).await.unwrap().unwrap().outcome, Some(Outcome::Applied));
    w.host.call_names()[n0..].to_vec()
}

/// The spec of `steps` with `service.drain_refuse_new` set as `on`.
fn refusing(steps: u32, on: bool) -> DesiredState {
    let mut d = desired(steps);
    d.spec.service.drain_refuse_new = on;
    d
}

/// A unit no load balancer polls, its clients feeding it all along: without
/// `drain_refuse_new` the drain runs out its budget and the server is stopped with a request in
/// flight; with it, new connections are refused from the drain on, the requests in flight
/// finish, the stop comes at once, and the output says what kept traffic away; the rule is gone
/// once the old instance stopped.
#[tokio::test(start_paused = true)]
async fn a_unit_fed_by_clients_drains_at_once_only_when_its_port_refuses_new_connections() {
    for on in [false, true] {
        let (old, new) = (refusing(5, on), refusing(10, on));
        let w = serving(&old, &new, false).await;
        w.host.fed();
        let t0 = tokio::time::Instant::now();
        let r = w.reconcile(&new).await.unwrap().unwrap();
        assert_eq!(r.outcome, Some(Outcome::Applied), "{}", r.verdict);
        let (said, stops) = (w.said(), w.host.stops_while_busy());
        if on {
            assert_eq!(stops, 0, "stopped with a request in flight\n{said}");
            assert!(t0.elapsed() < std::time::Duration::from_secs(5), "{:?}\n{said}", t0.elapsed());
            for line in [
                "Progress(\"new connections to port 30000 refused (nftables table inet specd) until the old instance has stopped\")",
                "Progress(\"no load balancer polls this unit; new connections to port 30000 are refused until it has stopped (nftables table inet specd)\")",
                "Progress(\"drained: no request in flight\")",
                "Progress(\"new connections to port 30000 accepted again\")",
            ] {
                assert!(said.contains(line), "{line}\n{said}");
            }
        } else {
            assert_eq!(stops, 1, "{said}");
            assert!(said.contains("1 requests still in flight after the drain budget; stopping anyway"), "{said}");
            assert!(said.contains("nothing keeps traffic away during the stop"), "{said}");
            assert!(!said.contains("port 30000"), "{said}");
        }
        assert_eq!(w.host.refused(), None, "{said}");
        assert_eq!(w.store().peek(UNIT).unwrap().refusing, None);
    }
}

/// Without `nft` (or when it fails), the apply says so and drains as without the option: the
/// change is applied, and no rule nor record of one is left.
#[tokio::test(start_paused = true)]
async fn without_nft_the_apply_says_so_and_drains_as_without_the_option() {
    let (old, new) = (refusing(5, true), refusing(10, true));
    let w = serving(&old, &new, false).await;
    w.host.fed();
    w.host.without_nft();
    let r = w.reconcile(&new).await.unwrap().unwrap();
    assert_eq!(r.outcome, Some(Outcome::Applied), "{}", r.verdict);
    let said = w.said();
    assert!(
        said.contains("Warning(\"could not refuse new connections to port 30000 (running nft (the nftables package): No such file or directory (os error 2)); draining as without service.drain_refuse_new\")"),
        "{said}"
    );
    assert!(
        said.contains("nothing keeps traffic away during the stop; new connections to port 30000 could not be refused"),
        "{said}"
    );
    assert_eq!(w.host.stops_while_busy(), 1, "{said}");
    assert_eq!(w.host.serving().as_ref(), Some(&new.spec.argv));
    assert_eq!(w.store().peek(UNIT).unwrap().refusing, None, "{said}");
}

/// `nft` there but refusing every script (the agent's sandbox without CAP_NET_ADMIN): the close
/// applied nothing, so there is no rule to remove before the start; the apply says so, drains
/// as without the option and applies the change (it used to leave the unit stopped, "still
/// refused by specd's nftables rule").
#[tokio::test(start_paused = true)]
async fn an_nft_that_refuses_the_rule_leaves_nothing_to_remove_and_the_change_is_applied() {
    let (old, new) = (refusing(5, true), refusing(10, true));
    let w = serving(&old, &new, false).await;
    w.host.nft_denied();
    let r = w.reconcile(&new).await.unwrap().unwrap();
    let said = w.said();
    assert_eq!(r.outcome, Some(Outcome::Applied), "{}\n{said}", r.verdict);
    assert!(said.contains("could not refuse new connections to port 30000 (nft failed (exit status: 1): netlink: Error: cache initialization failed: Operation not permitted); draining as without service.drain_refuse_new"), "{said}");
    assert!(!said.contains("could not remove"), "{said}");
    assert_eq!(w.host.serving().as_ref(), Some(&new.spec.argv));
    assert_eq!(w.store().peek(UNIT).unwrap().refusing, None, "{said}");
}

/// A rule a killed apply left, then `nft` refusing everything: the next apply can neither remove
/// it nor add its own, and must not forget it (the port stays refused with no record of why):
/// the state still names the port, and nothing is started behind it.
#[tokio::test(start_paused = true)]
async fn a_rule_left_before_nft_refuses_everything_is_not_forgotten() {
    let (_, w) = killed_in_its_drain().await;
    w.host.heal();
    w.host.nft_denied();
    let new = refusing(10, true);
    let _ = w.reconcile(&new).await;
    assert_eq!(w.host.refused(), Some(30000), "{}", w.said());
    assert_eq!(w.store().peek(UNIT).unwrap().refusing, Some(30000), "the rule is forgotten\n{}", w.said());
    assert_eq!(w.host.started_behind_rule(), 0, "{}", w.said());
}

/// A server that stops answering ready at rest (hung, or loading again after systemd restarted
/// it) is no longer told ready at the unit's next look: its load balancers are told down, and
/// ready again once it serves.
#[tokio::test(start_paused = true)]
async fn a_server_no_longer_ready_at_rest_is_told_down_at_the_next_look() {
    let (old, new) = (desired(5), desired(10));
    let w = serving(&old, &new, false).await;
    assert_eq!(w.host.lb_state().map(|s| s.word()), Some(Word::Ready));
    w.host.not_ready();
    let r = w.reconcile(&old).await.unwrap().unwrap();
    let told = w.host.lb_state();
    assert_eq!(told.as_ref().map(|s| s.word()), Some(Word::Down), "{}\n{told:?}", r.verdict);
    assert_eq!(told.as_ref().and_then(|s| s.why()), Some("its server is not ready"));
}

/// A server that died at rest is started again by the next reconcile; its load balancers are
/// told down before the start (not left ready while it loads), and ready once it serves.
#[tokio::test(start_paused = true)]
async fn a_server_that_died_is_told_down_before_it_is_started_again() {
    let (old, new) = (desired(5), desired(10));
    let w = serving(&old, &new, false).await;
    w.host.dies();
    let r = w.reconcile(&old).await.unwrap().unwrap();
    assert_eq!(w.host.serving().as_ref(), Some(&old.spec.argv), "{}", r.verdict);
    assert_eq!(w.host.lb_told(), [Word::Ready, Word::Down, Word::Ready], "{}", w.said());
    assert!(w.host.lb_violations().is_empty(), "{:?}", w.host.lb_violations());
}

/// A unit serving `refusing(5, true)`, fed by clients, whose apply of `refusing(10, true)` was
/// killed just after it closed the port: the rule is left. The old spec and the world.
async fn killed_in_its_drain() -> (DesiredState, World) {
    quiet_crashes();
    let (old, new) = (refusing(5, true), refusing(10, true));
    let w = serving(&old, &new, false).await;
    w.host.fed();
    let calls = {
        let probe = serving(&old, &new, false).await;
        probe.host.fed();
        let m0 = probe.host.calls();
        assert!(probe.reconcile(&new).await.unwrap().is_ok());
        probe.host.call_names()[m0..].to_vec()
    };
    let at = calls.iter().position(|c| *c == "nft_refuse").expect("the apply closes the port") + 1;
    w.host.plan(at, Fault::Crash);
    assert!(w.reconcile(&new).await.is_none(), "killed\n{}", w.said());
    assert_eq!(w.host.refused(), Some(30000), "{}", w.said());
    (old, w)
}

/// specd killed in the drain, its port closed: the rule stays (nothing runs to remove it), and
/// the unit's next reconcile removes it first, as the agent's first look at each unit does.
#[tokio::test(start_paused = true)]
async fn a_rule_left_by_an_apply_killed_in_its_drain_is_removed_by_the_next_reconcile() {
    let (old, w) = killed_in_its_drain().await;
    assert_eq!(w.store().peek(UNIT).unwrap().refusing, Some(30000));
    w.host.heal();
    // The unit's next look, even one that has nothing to change.
    let r = w.reconcile(&old).await.unwrap().unwrap();
    assert_eq!(w.host.refused(), None, "{}\n{}", r.verdict, w.said());
    assert!(
        w.said().contains("removed the rule an interrupted apply left refusing new connections to port 30000"),
        "{}",
        w.said()
    );
    assert_eq!(w.store().peek(UNIT).unwrap().refusing, None);
}

/// A rule that cannot be removed once the old instance stopped: nothing is started behind it
/// (nothing could reach the server, and its failed readiness would condemn a good spec); the
/// apply fails on the host, quarantines nothing, and once `nft` works again the next reconcile
/// removes the rule and applies the change.
#[tokio::test(start_paused = true)]
async fn a_rule_that_cannot_be_removed_after_the_stop_starts_nothing_behind_it_and_condemns_no_spec() {
    let (old, new) = (refusing(5, true), refusing(10, true));
    let w = serving(&old, &new, false).await;
    w.host.fed();
    w.host.nft_cannot_open();
    let r = w.reconcile(&new).await.unwrap().unwrap();
    assert_ne!(r.outcome, Some(Outcome::Applied), "{}\n{}", r.verdict, w.said());
    assert_eq!(w.host.started_behind_rule(), 0, "{}", w.said());
    assert!(
        w.said().contains("are still refused by specd's nftables rule: not starting a server nothing could reach"),
        "{}",
        w.said()
    );
    let st = w.store().peek(UNIT).unwrap();
    assert!(st.quarantined(&new.unit.sha256).is_none(), "{}", r.verdict);
    assert_eq!(st.refusing, Some(30000));
    w.host.heal();
    let r = w.reconcile(&new).await.unwrap().unwrap();
    assert_eq!(r.outcome, Some(Outcome::Applied), "{}\n{}", r.verdict, w.said());
    assert_eq!(w.host.refused(), None);
    assert_eq!(w.host.started_behind_rule(), 0);
}

// --- A unit whose spec is gone, pruned (`prune: true`): drained as an apply drains it. ---

/// The unit pruned as the agent prunes it, in its own task.
async fn pruned(w: &World) {
    let ctx = w.ctx();
    tokio::spawn(async move { reconcile::prune(&ctx, UNIT).await }).await.unwrap();
}

/// Pruned behind a load balancer (an agent-check every 500 ms): its server is told `drain`, and
/// stopped only once the balancer polled and was answered so; told `down` after, and never
/// stopped while told ready.
#[tokio::test(start_paused = true)]
async fn a_pruned_unit_behind_a_load_balancer_is_stopped_only_once_it_saw_drain() {
    let (old, new) = (desired(5), desired(10));
    let w = serving(&old, &new, false).await;
    w.host.balancer(CheckKind::AgentCheck, "10.0.0.5", std::time::Duration::from_millis(500));
    // Its polls are at 0, 500 ms, 1 s...: the mark comes between two.
    tokio::time::sleep(std::time::Duration::from_millis(120)).await;
    pruned(&w).await;
    assert_eq!(w.host.lb_told(), [Word::Ready, Word::Drain, Word::Down], "{}", w.said());
    let drain = w
        .host
        .serving_told()
        .into_iter()
        .find_map(|(_, _, s)| s.why().filter(|_| s.word() == Word::Drain).map(str::to_string));
    assert_eq!(drain.as_deref(), Some("specd is stopping it: its spec is gone (prune: true)"));
    let (mark, stop) = (w.host.lb_told_at(Word::Drain).unwrap(), w.host.stop_times()[0]);
    let waited = stop - mark;
    assert!(waited >= std::time::Duration::from_millis(380), "stopped {waited:?} after the mark\n{}", w.said());
    assert!(waited <= std::time::Duration::from_millis(500), "stopped {waited:?} after the mark\n{}", w.said());
    assert!(w.said().contains("Progress(\"1 load balancer (10.0.0.5) saw drain after 0.4 s\")"), "{}", w.said());
    assert_eq!(w.host.lb_violations(), Vec::<String>::new());
    assert_eq!((w.host.alive_count(), w.host.unit_file()), (0, None), "{}", w.said());
}

/// Pruned with a request in flight: stopped once it finished; one that never finishes holds the
/// stop no longer than the drain budget (`drain_timeout_sec: 5`), and that is said.
#[tokio::test(start_paused = true)]
async fn a_pruned_unit_is_stopped_once_its_requests_in_flight_finish_or_its_drain_budget_ran_out() {
    for (busy, stopped_after, busy_stops) in [(2, 2, 0), (60, 5, 1)] {
        let (old, new) = (desired(5), desired(10));
        let w = serving(&old, &new, false).await;
        let t0 = tokio::time::Instant::now();
        w.host.busy_for(std::time::Duration::from_secs(busy));
        pruned(&w).await;
        let case = format!("a request in flight for {busy} s");
        assert_eq!(w.host.stops_while_busy(), busy_stops, "{case}: stopped with a request in flight\n{}", w.said());
        let after = w.host.stop_times()[0] - t0;
        let bound = std::time::Duration::from_secs(stopped_after);
        assert!(
            after >= bound && after <= bound + std::time::Duration::from_secs(1),
            "{case}: stopped after {after:?}"
        );
        if busy_stops > 0 {
            assert!(
                w.said().contains("1 requests still in flight after the drain budget; stopping anyway"),
                "{}",
                w.said()
            );
        }
        assert_eq!(w.host.alive_count(), 0, "{case}");
        assert_eq!(w.host.lb_state().map(|s| s.word()), Some(Word::Down), "{case}");
    }
}

/// A rule an apply killed in its drain left refusing new connections to the unit's port is
/// removed by the prune, before the unit's state (which names it) is set aside.
#[tokio::test(start_paused = true)]
async fn a_prune_removes_the_rule_an_apply_killed_in_its_drain_left() {
    let (_, w) = killed_in_its_drain().await;
    w.host.heal();
    pruned(&w).await;
    assert_eq!(w.host.refused(), None, "the rule is left\n{}", w.said());
    assert!(
        w.said().contains("removed the rule an interrupted apply left refusing new connections to port 30000"),
        "{}",
        w.said()
    );
    assert_eq!((w.host.alive_count(), w.host.unit_file()), (0, None), "{}", w.said());
}

/// A unit whose spec is gone, left running (`prune: false`), then stopped by a person: a look
/// at it (`watch_orphan`'s) with a fault at any call never tells its load balancers ready, and
/// once the faults end the next look tells them down.
#[tokio::test(start_paused = true)]
async fn a_fault_at_any_call_of_a_look_at_an_orphan_stopped_by_hand_never_tells_it_ready() {
    quiet_crashes();
    let (old, new) = (desired(5), desired(10));
    let probe = serving(&old, &new, false).await;
    orphaned(&probe).await;
    let n0 = probe.host.calls();
    look_at_orphan(&probe).await;
    let calls = probe.host.call_names()[n0..].to_vec();
    assert!(calls.contains(&"serving_set"), "{calls:?}");
    assert_eq!(probe.host.lb_state().map(|s| s.word()), Some(Word::Down), "{}", probe.said());
    let mut cases = 0;
    for (i, name) in calls.iter().enumerate() {
        for f in FAULTS {
            let case = format!("fault {f:?} at call {i} ({name}) of a look at an orphan");
            let w = serving(&old, &new, false).await;
            let before = orphaned(&w).await;
            w.host.plan(i, f);
            look_at_orphan(&w).await;
            w.host.heal();
            look_at_orphan(&w).await;
            assert_eq!(w.host.lb_violations()[before..], [] as [String; 0], "{case}");
            assert_eq!(w.host.lb_state().map(|s| s.word()), Some(Word::Down), "{case}\n{}", w.said());
            assert_eq!(w.host.stops_and_starts().1, 1, "{case}: started");
            cases += 1;
        }
    }
    eprintln!("a look at an orphan: {} calls × {} fault kinds = {cases} cases", calls.len(), FAULTS.len());
}

/// One look at the orphan (`watch_orphan`'s), in a task of its own: a fault that kills specd
/// ends it (a panic); any other end of the task is the test's failure.
async fn look_at_orphan(w: &World) {
    let ctx = w.ctx();
    let r = tokio::spawn(async move { super::prune::look_at_orphan(&ctx, UNIT).await }).await;
    if let Err(e) = r
        && !e.is_panic()
    {
        panic!("{e}");
    }
}

/// The unit left running with no spec (the source's state lists it), then stopped by a person;
/// the load balancers' violations so far (that stop's own).
async fn orphaned(w: &World) -> usize {
    orphaned_running(w);
    crate::host::ServiceManager::stop(&w.host, UNIT, true).await.unwrap();
    tokio::time::sleep(LOAD).await;
    w.host.lb_violations().len()
}

/// The unit left running with no spec: the source's state lists it as orphaned.
fn orphaned_running(w: &World) {
    let st = crate::machine::store::SourceState { orphans: vec![UNIT.into()], ..Default::default() };
    st.save(&w.dir.path().join("state")).unwrap();
}

/// An orphan still running its verified unit: a look with a fault at any call tells its load
/// balancers nothing untrue and stops or starts nothing, and once the faults end the next look
/// keeps it ready.
#[tokio::test(start_paused = true)]
async fn a_fault_at_any_call_of_a_look_at_a_running_orphan_keeps_it_ready_and_running() {
    quiet_crashes();
    let (old, new) = (desired(5), desired(10));
    let probe = serving(&old, &new, false).await;
    orphaned_running(&probe);
    let n0 = probe.host.calls();
    look_at_orphan(&probe).await;
    let calls = probe.host.call_names()[n0..].to_vec();
    assert_eq!(probe.host.lb_state().map(|s| s.word()), Some(Word::Ready), "{}", probe.said());
    for (i, name) in calls.iter().enumerate() {
        for f in FAULTS {
            let case = format!("fault {f:?} at call {i} ({name}) of a look at a running orphan");
            let w = serving(&old, &new, false).await;
            orphaned_running(&w);
            let moves = w.host.stops_and_starts();
            w.host.plan(i, f);
            look_at_orphan(&w).await;
            let died = w.host.serving().is_none();
            w.host.heal();
            look_at_orphan(&w).await;
            assert_eq!(w.host.lb_violations(), [] as [String; 0], "{case}");
            if !died {
                assert_eq!(w.host.stops_and_starts(), moves, "{case}: stopped or started");
                assert_eq!(w.host.lb_state().map(|s| s.word()), Some(Word::Ready), "{case}\n{}", w.said());
            }
        }
    }
}
