//! The sweep on the fake host's paused clock, and the spec file's edit.

use super::edit::{set_value, yaml_scalar};
use super::hold::SweepHold;
use super::results::read_results;
use crate::core::hold::{Hold, HoldKind};
use crate::core::record::Outcome;
use crate::core::timing;
use crate::host::{Host, Processes};
use crate::machine::store::Store;
use crate::reconcile::context::Dirs;
use crate::reconcile::{self, DesiredState, Shutdown};
use crate::sweep::report::PointOutcome;
use std::path::Path;
use std::time::Duration;

use super::*;
use serde_json::json;

const SPEC: &str = "apiVersion: specd/v1
kind: InferenceService
metadata: {name: q}
spec:
  unit: q.service
  engine: sglang
  model: /models/q   # the weights
  server: {port: 30000, tp_size: 4}
  speculative:
    algorithm: EAGLE
    num_steps: 3 # tuned by hand
    eagle_topk: 1
";

#[test]
fn a_value_is_edited_in_place_and_the_rest_kept_byte_for_byte() {
    let out = set_value("q.yaml", SPEC, "spec.speculative.num_steps", &json!(5)).unwrap();
    assert_eq!(out, SPEC.replace("num_steps: 3 # tuned", "num_steps: 5 # tuned"));
    let out = set_value("q.yaml", SPEC, "spec.server.tp_size", &json!(8)).unwrap();
    assert_eq!(out, SPEC.replace("tp_size: 4}", "tp_size: 8}"));
    let out = set_value("q.yaml", SPEC, "spec.model", &json!("/models/q two")).unwrap();
    assert_eq!(out, SPEC.replace("model: /models/q   #", "model: \"/models/q two\"   #"));
}

#[test]
fn a_missing_field_is_added_to_its_section() {
    let out = set_value("q.yaml", SPEC, "spec.speculative.num_draft_tokens", &json!(6)).unwrap();
    assert_eq!(out, SPEC.replace("    algorithm: EAGLE\n", "    num_draft_tokens: 6\n    algorithm: EAGLE\n"));
    let out = set_value("q.yaml", SPEC, "spec.server.max_running_requests", &json!(16)).unwrap();
    assert_eq!(out, SPEC.replace("server: {port", "server: {max_running_requests: 16, port"));
    let err = set_value("q.yaml", SPEC, "spec.service.timeout_stop_sec", &json!(30)).unwrap_err();
    assert!(err.contains("add it by hand"), "{err}");
}

#[test]
fn scalars_are_written_as_yaml_reads_them() {
    assert_eq!(yaml_scalar(&json!(3)), "3");
    assert_eq!(yaml_scalar(&json!(0.85)), "0.85");
    assert_eq!(yaml_scalar(&json!(true)), "true");
    assert_eq!(yaml_scalar(&json!("EAGLE")), "EAGLE");
    assert_eq!(yaml_scalar(&json!("on")), "\"on\"");
    assert_eq!(yaml_scalar(&json!("12")), "\"12\"");
    assert_eq!(yaml_scalar(&json!("a b: c")), "\"a b: c\"");
}

#[test]
fn a_torn_last_line_is_ignored_and_a_bad_whole_line_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("results.jsonl");
    let r = crate::sweep::report::tests::campaign();
    let mut text = String::new();
    for x in &r[..2] {
        text.push_str(&serde_json::to_string(x).unwrap());
        text.push('\n');
    }
    let whole = text.len();
    text.push_str(&serde_json::to_string(&r[2]).unwrap()[..40]);
    std::fs::write(&p, &text).unwrap();
    let (got, n) = read_results(&p).unwrap();
    assert_eq!((got.len(), n), (2, whole));
    std::fs::write(&p, format!("{}\nnot json\n", serde_json::to_string(&r[0]).unwrap())).unwrap();
    let e = format!("{:#}", read_results(&p).unwrap_err());
    assert!(e.contains("results.jsonl:2: not a sweep result"), "{e}");
    assert_eq!(read_results(&dir.path().join("none.jsonl")).unwrap().0.len(), 0);
}

/// A sweep takes a unit only when no one else's hold is in effect, by the agent's own gate:
/// a live sweep, a suspend, a pin, a hold that names no process (until it expires) keep
/// it out; an expired hold, or a sweep whose process is gone, does not.
#[tokio::test(start_paused = true)]
async fn a_sweep_takes_a_unit_only_when_no_other_hold_is_in_effect() {
    use crate::host::fake::{EPOCH, FakeHost};
    let dir = tempfile::tempdir().unwrap();
    let host = FakeHost::new("u.service", &dir.path().join("units"));
    let store = Store::new(dir.path().join("state"));
    let other = host.spawn_holder();
    let sweep = |pid, until| Hold { pid, until, ..Hold::new(HoldKind::Sweep, "specd sweep other", EPOCH) };
    let cases = [
        (sweep(Some(other), Some(EPOCH + 60)), false),
        (sweep(None, None), false),
        (sweep(None, Some(EPOCH + 60)), false),
        (Hold::new(HoldKind::Suspend, "root@h (specd suspend)", EPOCH), false),
        (Hold { desired_at_pin: Some("a".repeat(64)), ..Hold::new(HoldKind::Pin, "root@h", EPOCH) }, false),
        (sweep(Some(other), Some(EPOCH)), true),
        (sweep(None, Some(EPOCH)), true),
    ];
    for (hold, taken) in cases {
        store.set_hold("u.service", hold.clone()).await.unwrap();
        let got = SweepHold::take(&host, &store, "u.service", "mine").await;
        assert_eq!(got.is_ok(), taken, "{}", hold.describe());
        if let Ok(h) = got {
            assert_eq!(h.hold.pid, Some(host.me().0));
            h.release(&store).await;
        }
    }
    host.end_holder(other);
    store.set_hold("u.service", sweep(Some(other), Some(EPOCH + 60))).await.unwrap();
    let h = SweepHold::take(&host, &store, "u.service", "mine").await.expect("a dead sweep's hold is stale");
    h.release(&store).await;
    assert_eq!(store.peek("u.service").unwrap().hold, None);
}

// The sweep on the fake host and tokio's paused clock: applies, load, deaths and the hold,
// without a machine.

const UNIT: &str = "sglang-qwen.service";

const BASE: &str = "apiVersion: specd/v1
kind: InferenceService
metadata: {name: qwen}
spec:
  unit: sglang-qwen.service
  engine: sglang
  command: [/opt/sglang/bin/python3, -m, sglang.launch_server]
  model: /models/qwen
  server: {port: 30000}
  speculative: {algorithm: EAGLE, draft_model: /models/draft, num_steps: 3, eagle_topk: 1, num_draft_tokens: 4}
  service: {timeout_stop_sec: 10, drain_timeout_sec: 5}
";

const SWEEP: &str = "apiVersion: specd/v1
kind: Sweep
metadata: {name: qwen-steps}
spec:
  base: qwen.yaml
  matrix:
    speculative.num_steps: [2, 5]
  load: {concurrency: [1, 4], requests: 8, warmup: 0, max_tokens: 16, prompts: builtin}
  objective: {maximize: throughput, at_concurrency: 4}
  after: restore
";

/// A sweep's files in `dir`, the host (its unit deployed from the base spec), what the sweep
/// reads, and its options.
async fn swept(dir: &Path) -> (crate::host::fake::FakeHost, Dirs, Prepared, Options) {
    swept_from(dir, BASE).await
}

/// [`swept`] with the base spec `base`.
async fn swept_from(dir: &Path, base: &str) -> (crate::host::fake::FakeHost, Dirs, Prepared, Options) {
    std::fs::write(dir.join("qwen.yaml"), base).unwrap();
    std::fs::write(dir.join("sweep.yaml"), SWEEP).unwrap();
    let dirs = Dirs { state_dir: dir.join("state"), unit_dir: dir.join("units") };
    let o = Options {
        file: dir.join("sweep.yaml"),
        resume: false,
        write: false,
        out: Some(dir.join("out")),
        json: true,
        calibrate: false,
    };
    let p = prepare(&o).unwrap();
    let host = crate::host::fake::FakeHost::new(UNIT, &dirs.unit_dir);
    let base = specd_spec::parse("qwen.yaml", base).unwrap().resolve(None).unwrap();
    host.serves(&base, false);
    for pt in &p.points {
        host.serves(&pt.spec, false);
    }
    let ctx = ctx_on(&host, &dirs, Shutdown::never());
    let r = reconcile::reconcile(&ctx, &DesiredState::new(base, None), false).await.unwrap();
    assert_eq!(r.outcome, Some(Outcome::Applied), "{}", r.verdict);
    (host, dirs, p, o)
}

#[tokio::test(start_paused = true)]
async fn a_point_whose_server_dies_under_load_is_recorded_with_its_verdict_and_the_sweep_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let (host, dirs, p, o) = swept(dir.path()).await;
    let base_argv = host.serving().unwrap();
    host.dies_under_load(&p.points[0].spec);
    let mut doc = Summary::default();
    let code = campaign(&host, &dirs, &o, &mut doc, |_| Shutdown::never()).await.unwrap();
    assert_eq!(code, 0, "{doc:?}");
    let [died, measured] = doc.results.as_slice() else { panic!("{:?}", doc.results) };
    // The first point died at its first level: recorded with the diagnosis's verdict, and
    // not loaded further.
    assert_eq!(died.outcome, PointOutcome::DiedUnderLoad);
    assert_eq!(died.verdict.as_deref(), Some("crash"));
    assert_eq!(died.levels.len(), 1);
    assert_eq!(died.levels[0].errors, 8);
    // The sweep went on to the next point, measured at each level.
    assert_eq!(measured.outcome, PointOutcome::Measured);
    assert_eq!(measured.levels.iter().map(|l| l.concurrency).collect::<Vec<_>>(), [1, 4]);
    assert_eq!(doc.best.as_ref().map(|b| b.label.as_str()), Some(measured.label.as_str()));
    // Both records are on disk; the unit is restored, and the sweep's hold is gone.
    assert_eq!(read_results(&dir.path().join("out/results.jsonl")).unwrap().0.len(), 2);
    assert_eq!(doc.after.as_deref(), Some("restore"));
    assert!(doc.after_ok);
    assert_eq!(host.serving(), Some(base_argv));
    assert_eq!(Store::new(&dirs.state_dir).peek(UNIT).unwrap().hold, None);
}

/// A sweep of a replica (`spec.rollout.group`) takes it out only when its group allows, as an
/// apply does: while a sibling drains, the point waits for it (it is not an apply that failed),
/// then every point is measured and the unit restored.
#[tokio::test(start_paused = true)]
async fn a_sweep_of_a_replica_waits_for_its_group_and_measures_every_point() {
    use crate::core::serving::{ServingState, Word};
    use crate::host::LoadBalancers;
    let dir = tempfile::tempdir().unwrap();
    let grouped = format!("{BASE}  rollout: {{group: llm}}\n");
    let (host, dirs, _, o) = swept_from(dir.path(), &grouped).await;
    // A sibling of the group, serving, then told drain (its own change under way).
    let sibling = host.beside("sglang-other.service");
    let other = grouped.replace(UNIT, "sglang-other.service").replace("port: 30000", "port: 30001");
    let other = specd_spec::parse("other.yaml", &other).unwrap().resolve(None).unwrap();
    sibling.serves(&other, false);
    let sctx = ctx_on(&sibling, &dirs, Shutdown::never());
    let r = reconcile::reconcile(&sctx, &DesiredState::new(other, None), false).await.unwrap();
    assert_eq!(r.outcome, Some(Outcome::Applied), "{}", r.verdict);
    let drain = ServingState::Drain { why: "its own change".into(), since: host.now() };
    sibling.set_serving_state("sglang-other.service", &drain).unwrap();
    let ready = {
        let sibling = sibling.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(30)).await;
            let since = sibling.now();
            sibling.set_serving_state("sglang-other.service", &ServingState::Ready { since }).unwrap();
        })
    };
    let mut doc = Summary::default();
    let code = campaign(&host, &dirs, &o, &mut doc, |_| Shutdown::never()).await.unwrap();
    ready.await.unwrap();
    assert_eq!(code, 0, "{doc:?}");
    let outcomes: Vec<_> = doc.results.iter().map(|r| (r.label.clone(), r.outcome, r.summary.clone())).collect();
    assert!(doc.results.iter().all(|r| r.outcome == PointOutcome::Measured), "{outcomes:?}");
    assert_eq!(doc.results.len(), 2, "{outcomes:?}");
    // The replica was told drain only once its sibling served again.
    let told = host.serving_told();
    let other_drain =
        told.iter().position(|(_, u, s)| u == "sglang-other.service" && s.word() == Word::Drain).expect("drain told");
    let sibling_ready = other_drain
        + told[other_drain..]
            .iter()
            .position(|(_, u, s)| u == "sglang-other.service" && s.word() == Word::Ready)
            .expect("the sibling served again");
    let first_drain =
        told.iter().position(|(_, u, s)| u == UNIT && s.word() == Word::Drain).expect("the replica drained");
    assert!(first_drain > sibling_ready, "{told:?}");
    assert!(doc.after_ok);
}

#[tokio::test(start_paused = true)]
async fn a_sweep_s_hold_is_pushed_on_while_it_runs_and_expires_once_it_no_longer_is() {
    let dir = tempfile::tempdir().unwrap();
    let (host, dirs, _, _) = swept(dir.path()).await;
    let store = Store::new(&dirs.state_dir);
    let t0 = tokio::time::Instant::now();
    let h = SweepHold::take(&host, &store, UNIT, "qwen-steps").await.unwrap();
    // Three hours into a long point: the hold was pushed on, and keeps the agent out.
    tokio::time::sleep_until(t0 + Duration::from_secs(3 * 3600)).await;
    let held = store.peek(UNIT).unwrap().hold.unwrap();
    assert!(held.until.unwrap() > host.now() + 3600, "{}", held.describe());
    assert!(matches!(host.hold_effect(Some(&held), "d"), crate::core::hold::HoldEffect::HandsOff(_)));
    // A sweep that no longer pushes it (hung): the hold expires 2 h after its last push, and
    // the agent takes the unit back although the sweep's process lives.
    h.refresher.abort();
    tokio::time::sleep(timing::SWEEP_HOLD_FOR).await;
    let held = store.peek(UNIT).unwrap().hold.unwrap();
    assert!(
        matches!(host.hold_effect(Some(&held), "d"), crate::core::hold::HoldEffect::Expired(w) if w.contains("expired at")),
        "{}",
        held.describe()
    );
    assert!(host.alive(host.me().0));
}

#[test]
fn a_calibration_measures_the_running_length_and_the_one_below_it_whatever_the_matrix() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("qwen.yaml"), BASE).unwrap();
    std::fs::write(dir.path().join("sweep.yaml"), SWEEP).unwrap();
    let o = |calibrate| Options {
        file: dir.path().join("sweep.yaml"),
        resume: false,
        write: false,
        out: None,
        json: true,
        calibrate,
    };
    let labels = |p: Prepared| p.points.iter().map(|pt| pt.label.clone()).collect::<Vec<_>>();
    assert_eq!(labels(prepare(&o(false)).unwrap()), ["num_steps=2", "num_steps=5"]);
    // The base runs 3: 2, then 3 (the unit as it was, last); SGLang's draft tokens derived.
    let p = prepare(&o(true)).unwrap();
    assert_eq!(
        p.points[1].spec,
        specd_spec::parse("qwen.yaml", BASE).unwrap().resolve(Some(&context::hostname(None))).unwrap()
    );
    assert_eq!(labels(p), ["num_steps=2", "num_steps=3"]);
    std::fs::write(
        dir.path().join("qwen.yaml"),
        BASE.replace("num_steps: 3", "num_steps: 1").replace("num_draft_tokens: 4", "num_draft_tokens: 2"),
    )
    .unwrap();
    let why = prepare(&o(true)).err().unwrap();
    assert!(why.contains("--calibrate needs speculative.num_steps 2 or more"), "{why}");
}
