//! Replicas of one group on the in-memory host (each its own unit, port and server; the serving
//! states shared, as in `/run/specd/serving`): a change to all of them, reconciled at once as the
//! agent's workers do, rolls at most `max_unavailable` at a time; a failing start of one rolls it
//! back and stops the roll, the others never stopped. With a spare (`max_surge`), the group
//! never serves with fewer than its replicas, and a failing start on the spare stops the roll
//! before any replica is touched.

use std::sync::Arc;
use std::time::Duration;

use specd_spec::Spec;

use crate::core::conclude::{Action, Report};
use crate::core::record::Outcome;
use crate::core::serving::Word;
use crate::host::fake::FakeHost;
use crate::machine::store::Store;
use crate::reconcile::{self, Ctx, DesiredState, Shutdown};

fn spec(unit: &str, port: u32, steps: u32, rollout: &str) -> Spec {
    let yaml = format!(
        "apiVersion: specd/v1\nkind: InferenceService\nmetadata: {{name: llm}}\nspec:\n  unit: {unit}\n  engine: sglang\n  command: [/opt/sglang/bin/python3, -m, sglang.launch_server]\n  model: /models/qwen\n  server: {{port: {port}}}\n  speculative: {{algorithm: EAGLE, draft_model: /models/draft, num_steps: {steps}, eagle_topk: 1, num_draft_tokens: {}}}\n  service: {{timeout_stop_sec: 10, drain_timeout_sec: 5}}\n  readiness: {{timeout_sec: 60}}\n{rollout}",
        steps + 1
    );
    specd_spec::parse("llm.yaml", &yaml).unwrap().resolve(None).unwrap()
}

struct Replicas {
    dir: tempfile::TempDir,
    hosts: Vec<FakeHost>,
    log: Arc<std::sync::Mutex<Vec<String>>>,
}

impl Replicas {
    /// `n` replicas (`llm-a.service`, `llm-b.service`...) serving `steps`, in group `llm`
    /// (`rollout` is the spec's `rollout:` line, empty for none).
    async fn serving(n: usize, rollout: &str) -> Replicas {
        let dir = tempfile::tempdir_in("/dev/shm").or_else(|_| tempfile::tempdir()).unwrap();
        let first = FakeHost::new(&unit(0), &dir.path().join("units"));
        let hosts: Vec<FakeHost> =
            (0..n).map(|i| if i == 0 { first.clone() } else { first.beside(&unit(i)) }).collect();
        let r = Replicas { dir, hosts, log: Arc::default() };
        for i in 0..n {
            let d = r.desired(i, 2, rollout);
            r.hosts[i].serves(&d.spec, false);
            let rep = reconcile::reconcile(&r.ctx(i), &d, false).await.unwrap();
            assert_eq!(rep.outcome, Some(Outcome::Applied), "{}", rep.verdict);
        }
        r
    }

    fn desired(&self, i: usize, steps: u32, rollout: &str) -> DesiredState {
        DesiredState::new(spec(&unit(i), 30000 + i as u32, steps, rollout), None)
    }

    fn ctx(&self, i: usize) -> Ctx<FakeHost> {
        Ctx {
            host: self.hosts[i].clone(),
            unit_dir: self.dir.path().join("units"),
            store: Store::new(self.dir.path().join("state")),
            events: {
                let log = self.log.clone();
                Arc::new(move |u: &str, e: &reconcile::Event| log.lock().unwrap().push(format!("{u}: {e:?}")))
            },
            shutdown: Shutdown::never(),
            holds: reconcile::Holds::Obeyed,
            lb: Default::default(),
        }
    }

    /// Replica `i` reconciled toward `d` as its worker does: a wait is a requeue after its time.
    fn worker(&self, i: usize, d: DesiredState) -> tokio::task::JoinHandle<Report> {
        let ctx = self.ctx(i);
        tokio::spawn(async move {
            loop {
                let r = reconcile::reconcile(&ctx, &d, false).await.unwrap();
                match r.action {
                    Action::Requeue(again) if r.roll_wait => tokio::time::sleep(again).await,
                    _ => return r,
                }
            }
        })
    }

    /// The most replicas told anything but ready at once, from `from` on the host's record.
    fn most_unavailable(&self, from: usize) -> usize {
        let told = self.hosts[0].serving_told();
        let mut now: std::collections::BTreeMap<String, Word> = Default::default();
        let mut most = 0;
        for (k, (_, u, s)) in told.iter().enumerate() {
            now.insert(u.clone(), s.word());
            if k >= from {
                most = most.max(now.values().filter(|w| **w != Word::Ready).count());
            }
        }
        most
    }

    fn said(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }
}

fn unit(i: usize) -> String {
    format!("llm-{}.service", (b'a' + i as u8) as char)
}

/// A change to every replica at once; the most not serving at once, and every report.
async fn change_all(n: usize, rollout: &str) -> (Replicas, usize) {
    let r = Replicas::serving(n, rollout).await;
    let from = r.hosts[0].serving_told().len();
    for i in 0..n {
        r.hosts[i].serves(&r.desired(i, 3, rollout).spec, false);
    }
    let workers: Vec<_> = (0..n).map(|i| r.worker(i, r.desired(i, 3, rollout))).collect();
    for (i, w) in workers.into_iter().enumerate() {
        let rep = w.await.unwrap();
        assert_eq!(rep.outcome, Some(Outcome::Applied), "{}: {}\n{}", unit(i), rep.verdict, r.said());
        assert_eq!(r.hosts[i].serving(), Some(r.desired(i, 3, rollout).spec.argv), "{}", unit(i));
    }
    let most = r.most_unavailable(from);
    (r, most)
}

#[tokio::test(start_paused = true)]
async fn replicas_of_a_group_are_changed_at_most_max_unavailable_at_a_time() {
    for (n, max) in [(2, 1), (3, 1), (3, 2)] {
        let rollout = format!("  rollout: {{group: llm, max_unavailable: {max}}}\n");
        let (r, most) = change_all(n, &rollout).await;
        assert_eq!(most, max, "{n} replicas, max_unavailable {max}: {most} not serving at once\n{}", r.said());
        assert!(r.said().contains("waiting: llm-"), "no replica waited\n{}", r.said());
    }
    // Without a group, every replica goes at once (what the gate prevents).
    let (r, most) = change_all(3, "").await;
    assert_eq!(most, 3, "{}", r.said());
}

#[tokio::test(start_paused = true)]
async fn a_failing_start_of_one_replica_rolls_it_back_and_the_others_are_never_stopped() {
    let rollout = "  rollout: {group: llm}\n";
    let r = Replicas::serving(3, rollout).await;
    let old: Vec<_> = (0..3).map(|i| r.hosts[i].serving().unwrap()).collect();
    let stops: Vec<_> = (0..3).map(|i| r.hosts[i].stops_and_starts()).collect();
    let new: Vec<_> = (0..3).map(|i| r.desired(i, 3, rollout)).collect();
    r.hosts[0].serves(&new[0].spec, true);
    for (host, d) in r.hosts.iter().zip(&new).skip(1) {
        host.serves(&d.spec, false);
    }
    // The first replica goes first: the others are reconciled once it is told drain.
    let first = r.worker(0, new[0].clone());
    let bound = tokio::time::Instant::now() + Duration::from_secs(60);
    while r.hosts[0].lb_state().is_none_or(|s| s.word() == Word::Ready) {
        assert!(tokio::time::Instant::now() < bound, "llm-a was never told drain\n{}", r.said());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let others: Vec<_> = (1..3).map(|i| r.worker(i, new[i].clone())).collect();
    let a = first.await.unwrap();
    assert_eq!(a.outcome, Some(Outcome::RolledBack), "{}\n{}", a.verdict, r.said());
    assert_eq!(r.hosts[0].serving().as_ref(), Some(&old[0]));
    for (k, w) in others.into_iter().enumerate() {
        let i = k + 1;
        let rep = w.await.unwrap();
        assert_eq!(rep.outcome, None, "{}: {}", unit(i), rep.verdict);
        assert!(rep.verdict.contains("group llm stopped: llm-a.service's change failed"), "{}", rep.verdict);
        assert_eq!(r.hosts[i].serving().as_ref(), Some(&old[i]), "{} changed", unit(i));
        assert_eq!(r.hosts[i].stops_and_starts(), stops[i], "{} was stopped or started\n{}", unit(i), r.said());
        assert_eq!(r.hosts[i].lb_state().map(|s| s.word()), Some(Word::Ready), "{}", unit(i));
    }
}

/// The group's rollout with a spare: `max_unavailable: 0, max_surge: 1`; the spare's line.
const SURGE: &str = "  rollout: {group: llm, max_unavailable: 0, max_surge: 1}\n";
const SPARE: &str = "  rollout: {group: llm, max_unavailable: 0, max_surge: 1, spare: true}\n";

impl Replicas {
    /// Two replicas (`llm-a`, `llm-b`) serving `steps` 2 and their spare `llm-c`, its own spec
    /// proved once and held stopped, as the group is at rest.
    async fn with_spare() -> Replicas {
        let r = Replicas::serving(2, SURGE).await;
        let hosts = {
            let mut h = r.hosts.clone();
            h.push(r.hosts[0].beside(&unit(2)));
            h
        };
        let r = Replicas { hosts, ..r };
        r.hosts[2].serves(&r.desired(2, 2, SPARE).spec, false);
        let rep = r.worker(2, r.desired(2, 2, SPARE)).await.unwrap();
        assert!(rep.verdict.contains("stopped while the group is at rest"), "{}\n{}", rep.verdict, r.said());
        assert_eq!(r.hosts[2].serving(), None, "the spare runs at rest");
        r
    }

    /// The group's desired state at `steps`: the replicas', then the spare's.
    fn group(&self, steps: u32) -> Vec<DesiredState> {
        (0..3).map(|i| self.desired(i, steps, if i == 2 { SPARE } else { SURGE })).collect()
    }

    /// The fewest units told `ready` at once, from `from` on the host's record.
    fn fewest_ready(&self, from: usize) -> usize {
        let told = self.hosts[0].serving_told();
        let mut now: std::collections::BTreeMap<String, Word> = Default::default();
        let mut fewest = usize::MAX;
        for (k, (_, u, s)) in told.iter().enumerate() {
            now.insert(u.clone(), s.word());
            if k >= from {
                fewest = fewest.min(now.values().filter(|w| **w == Word::Ready).count());
            }
        }
        fewest
    }
}

#[tokio::test(start_paused = true)]
async fn with_a_spare_the_group_never_serves_with_fewer_than_its_replicas_and_the_spare_rests_after() {
    let r = Replicas::with_spare().await;
    let from = r.hosts[0].serving_told().len();
    let new = r.group(3);
    for (host, d) in r.hosts.iter().zip(&new) {
        host.serves(&d.spec, false);
    }
    let workers: Vec<_> = (0..3).map(|i| r.worker(i, new[i].clone())).collect();
    let reports: Vec<Report> = futures_all(workers).await;
    for i in 0..2 {
        assert_eq!(reports[i].outcome, Some(Outcome::Applied), "{}: {}\n{}", unit(i), reports[i].verdict, r.said());
        assert_eq!(r.hosts[i].serving(), Some(new[i].spec.argv.clone()), "{}", unit(i));
    }
    assert!(reports[2].verdict.contains("stopped while the group is at rest"), "{}\n{}", reports[2].verdict, r.said());
    assert_eq!(r.hosts[2].serving(), None, "the spare still runs\n{}", r.said());
    assert_eq!(r.hosts[2].lb_state().map(|s| s.word()), Some(Word::Down));
    let fewest = r.fewest_ready(from);
    assert_eq!(fewest, 2, "{fewest} ready at once during the change\n{:?}", r.hosts[0].serving_told());
    // The spare served the new spec before the first replica was told drain.
    let told = r.hosts[0].serving_told()[from..].to_vec();
    let at = |u: &str, w: Word| told.iter().position(|(_, x, s)| x == u && s.word() == w);
    let spare_ready = at(&unit(2), Word::Ready).expect("the spare never served");
    let first_drain = [at(&unit(0), Word::Drain), at(&unit(1), Word::Drain)].into_iter().flatten().min().unwrap();
    assert!(spare_ready < first_drain, "{told:?}");
    assert!(r.said().contains(".service: Waiting(\"waiting: group llm: max_surge 1"), "{}", r.said());
}

#[tokio::test(start_paused = true)]
async fn a_failing_start_on_the_spare_stops_the_roll_before_any_replica_is_touched() {
    let r = Replicas::with_spare().await;
    let old: Vec<_> = (0..2).map(|i| r.hosts[i].serving().unwrap()).collect();
    let stops: Vec<_> = (0..2).map(|i| r.hosts[i].stops_and_starts()).collect();
    let new = r.group(3);
    for (i, (host, d)) in r.hosts.iter().zip(&new).enumerate() {
        host.serves(&d.spec, i == 2);
    }
    let workers: Vec<_> = (0..3).map(|i| r.worker(i, new[i].clone())).collect();
    let reports: Vec<Report> = futures_all(workers).await;
    assert_eq!(reports[2].outcome, Some(Outcome::Failed), "{}\n{}", reports[2].verdict, r.said());
    assert_eq!(r.hosts[2].serving(), None, "the failed spare runs");
    for i in 0..2 {
        assert_eq!(reports[i].outcome, None, "{}: {}", unit(i), reports[i].verdict);
        assert!(
            reports[i].verdict.contains("group llm stopped: llm-c.service's change failed"),
            "{}",
            reports[i].verdict
        );
        assert_eq!(r.hosts[i].serving().as_ref(), Some(&old[i]), "{} changed", unit(i));
        assert_eq!(r.hosts[i].stops_and_starts(), stops[i], "{} was stopped or started\n{}", unit(i), r.said());
        assert_eq!(r.hosts[i].lb_state().map(|s| s.word()), Some(Word::Ready), "{}", unit(i));
    }
}

/// Every worker's report, in order.
async fn futures_all(workers: Vec<tokio::task::JoinHandle<Report>>) -> Vec<Report> {
    let mut out = Vec::new();
    for w in workers {
        out.push(w.await.unwrap());
    }
    out
}

/// What `specd status` shows of the group's members (`reconcile::group_plan` over the plan): the
/// spare at rest is in sync, held stopped, and says so; a replica with a change to make says it
/// waits for the spare.
#[tokio::test(start_paused = true)]
async fn status_says_the_spare_rests_and_why_a_replica_waits_for_it() {
    let r = Replicas::with_spare().await;
    let look = |i: usize, d: DesiredState| {
        let ctx = r.ctx(i);
        async move {
            let st = ctx.store.peek(&unit(i)).unwrap();
            let (o, _) = reconcile::observe(&ctx, &d, &st, true).await.unwrap();
            let p = crate::core::plan::plan(&o, &reconcile::desired_of(&ctx.unit_dir, &d));
            reconcile::group_plan(&ctx, &d, &st, &o, p).unwrap()
        }
    };
    let spare = look(2, r.desired(2, 2, SPARE)).await;
    assert_eq!((spare.sync, spare.steps.len()), (crate::core::sync::SyncStatus::InSync, 0), "{spare:?}");
    assert_eq!(spare.reasons, ["the spare of group llm, stopped while the group is at rest"]);
    let replica = look(0, r.desired(0, 3, SURGE)).await;
    let waits = "waiting: group llm: max_surge 1 spares must serve the new spec before a replica stops; llm-c.service not serving its new spec yet";
    assert!(replica.reasons.iter().any(|w| w.starts_with(waits)), "{:?}", replica.reasons);
}

/// A replica whose spec is gone, pruned (`prune: true`) while its sibling drains for a change:
/// it waits for its group's gate, as an apply's stop does, and is told drain only once its
/// sibling serves again; never are both out of their load balancers at once.
#[tokio::test(start_paused = true)]
async fn a_replica_pruned_while_its_sibling_drains_waits_until_the_sibling_serves_again() {
    let rollout = "  rollout: {group: llm}\n";
    let r = Replicas::serving(2, rollout).await;
    let from = r.hosts[0].serving_told().len();
    let new_b = r.desired(1, 3, rollout);
    r.hosts[1].serves(&new_b.spec, false);
    r.hosts[1].busy_for(Duration::from_secs(2));
    let b = r.worker(1, new_b.clone());
    let bound = tokio::time::Instant::now() + Duration::from_secs(60);
    while r.hosts[1].lb_state().is_none_or(|s| s.word() == Word::Ready) {
        assert!(tokio::time::Instant::now() < bound, "llm-b was never told drain\n{}", r.said());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The agent's read of its source found no spec for llm-a, and said so before pruning it.
    r.orphaned(Some(0));
    let ctx = r.ctx(0);
    let prune = tokio::spawn(async move { reconcile::prune(&ctx, &unit(0)).await });
    let rep = b.await.unwrap();
    assert_eq!(rep.outcome, Some(Outcome::Applied), "{}\n{}", rep.verdict, r.said());
    prune.await.unwrap();
    let told = r.hosts[0].serving_told()[from..].to_vec();
    assert_eq!(r.most_unavailable(from), 1, "both out of their load balancers at once: {told:?}\n{}", r.said());
    let at = |u: &str, w: Word| told.iter().position(|(_, x, s)| x == u && s.word() == w);
    let (b_ready, a_drain) = (at(&unit(1), Word::Ready), at(&unit(0), Word::Drain));
    assert!(a_drain > b_ready && b_ready.is_some(), "{told:?}");
    assert!(r.said().contains("llm-a.service: Waiting(\"waiting: llm-b.service is drain"), "{}", r.said());
    assert_eq!(r.hosts[0].serving(), None, "the pruned replica runs");
    assert_eq!(r.hosts[0].lb_state().map(|s| s.word()), Some(Word::Down));
    assert_eq!(r.hosts[1].serving(), Some(new_b.spec.argv));
}

/// A prune waiting for its group's gate gives up once the unit's spec is back (the source's
/// next read desires it again): it is not stopped, and its load balancers keep it.
#[tokio::test(start_paused = true)]
async fn a_prune_waiting_for_its_group_stops_nothing_once_the_spec_is_back() {
    let rollout = "  rollout: {group: llm}\n";
    let r = Replicas::serving(2, rollout).await;
    let new_b = r.desired(1, 3, rollout);
    r.hosts[1].serves(&new_b.spec, false);
    r.hosts[1].busy_for(Duration::from_secs(5));
    let b = r.worker(1, new_b.clone());
    r.told(1, Word::Drain).await;
    r.orphaned(Some(0));
    let ctx = r.ctx(0);
    let prune = tokio::spawn(async move { reconcile::prune(&ctx, &unit(0)).await });
    let bound = tokio::time::Instant::now() + Duration::from_secs(60);
    while !r.said().contains("llm-a.service: Waiting(\"waiting: llm-b.service is drain") {
        assert!(tokio::time::Instant::now() < bound, "the prune never waited\n{}", r.said());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    r.orphaned(None);
    prune.await.unwrap();
    assert_eq!(b.await.unwrap().outcome, Some(Outcome::Applied), "{}", r.said());
    assert!(r.hosts[0].serving().is_some(), "llm-a was stopped although its spec is back\n{}", r.said());
    assert_eq!(r.hosts[0].lb_state().map(|s| s.word()), Some(Word::Ready), "{}", r.said());
}

impl Replicas {
    /// The agent's last read of its source found no spec for replica `i` (`prune: false`): the
    /// source's state lists it as orphaned; none with `i` = `None`.
    fn orphaned(&self, i: Option<usize>) {
        let st =
            crate::machine::store::SourceState { orphans: i.map(unit).into_iter().collect(), ..Default::default() };
        st.save(&self.dir.path().join("state")).unwrap();
    }

    /// Until replica `i`'s load balancers are told `word` (within a minute).
    async fn told(&self, i: usize, word: Word) {
        let bound = tokio::time::Instant::now() + Duration::from_secs(60);
        while self.hosts[i].lb_state().map(|s| s.word()) != Some(word) {
            let answer = crate::core::serving::http_answer(self.hosts[i].lb_state().as_ref());
            assert!(
                tokio::time::Instant::now() < bound,
                "{} never told {word}: GET /serving/{} answers {answer:?}\n{}",
                unit(i),
                unit(i),
                self.said()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// A replica whose spec left the repo, left running (`prune: false`): what its load balancers
/// are told follows what it runs (ready while it runs its verified unit; down, its HTTP check
/// 503, once a person stopped it), and it is no sibling of its group: a change of the group's
/// other replica does not wait for it. Once a spec desires it again, the look at it ends.
#[tokio::test(start_paused = true)]
async fn an_orphaned_replica_stopped_by_hand_is_told_down_and_holds_no_roll_of_its_group() {
    let rollout = "  rollout: {group: llm}\n";
    let r = Replicas::serving(2, rollout).await;
    r.orphaned(Some(0));
    let ctx = r.ctx(0);
    let watch = tokio::spawn(async move { reconcile::watch_orphan(&ctx, &unit(0)).await });
    tokio::time::sleep(crate::core::timing::ORPHAN_LOOK * 2).await;
    assert_eq!(r.hosts[0].lb_state().map(|s| s.word()), Some(Word::Ready), "it runs its verified unit");
    crate::host::ServiceManager::stop(&r.hosts[0], &unit(0), true).await.unwrap();
    r.told(0, Word::Down).await;
    let (code, body) = crate::core::serving::http_answer(r.hosts[0].lb_state().as_ref());
    assert_eq!((code, body.as_str()), (503, "down: its service is not running\n"));
    // The group's other replica changes without waiting for the stopped orphan.
    let new_b = r.desired(1, 3, rollout);
    r.hosts[1].serves(&new_b.spec, false);
    let b = tokio::time::timeout(Duration::from_secs(60), r.worker(1, new_b.clone())).await;
    let b = b.unwrap_or_else(|_| panic!("llm-b's change waits for its orphaned sibling\n{}", r.said())).unwrap();
    assert_eq!(b.outcome, Some(Outcome::Applied), "{}\n{}", b.verdict, r.said());
    assert_eq!(r.hosts[1].serving(), Some(new_b.spec.argv));
    // Desired again: its worker tells its load balancers from then on.
    r.orphaned(None);
    let ended = tokio::time::timeout(crate::core::timing::ORPHAN_LOOK * 2, watch).await;
    assert!(ended.is_ok(), "the look at llm-a goes on once a spec desires it");
}
