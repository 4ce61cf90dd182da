//! The rollout's decisions, one step at a time, on made-up evidence.

use super::*;
use specd_spec::fleet::{self, WaveRecord};

const FLEET: &str = "\
apiVersion: specd/v1
kind: Fleet
metadata: {name: gpus}
spec:
  waves:
    - {name: canary, hosts: [gpu-01], bake: 10m}
    - {name: rest, hosts: ['gpu-*'], max_unavailable: 2, bake: 30m}
  gates:
    accept_length: {min: 1.5, of_previous: 0.8}
    startup_within: {max: 10m, of_previous: 1.5}
";

const OLD: &str = "1111111111111111111111111111111111111111";
const NEW: &str = "2222222222222222222222222222222222222222";
const NEWER: &str = "3333333333333333333333333333333333333333";
const T0: u64 = 1_800_000_000;

fn fleet() -> ParsedFleet {
    fleet::parse_fleet(FLEET, "fleet.yaml").unwrap()
}

/// Every host runs `llm.service`, whose unit hash is the revision's first four characters.
fn expected(_host: &str, rev: &str) -> Result<Vec<ExpectedUnit>, String> {
    Ok(vec![ExpectedUnit { unit: "llm.service".into(), unit_hash: hash(rev), speculates: true }])
}

fn hash(rev: &str) -> String {
    format!("unit-{}", &rev[..4])
}

/// A host whose agent deploys `rev`, its unit verified with accept length `accept`.
fn on(rev: &str, accept: f64) -> HostEvidence {
    let unit = UnitEvidence {
        unit_hash: Some(hash(rev)),
        args_verified: Some(true),
        accept_length: Some(accept),
        previous_accept_length: Some(2.5),
        start_seconds: Some(40.0),
        previous_start_seconds: Some(40.0),
        ..Default::default()
    };
    HostEvidence { revision: Some(rev.into()), units: [("llm.service".to_string(), unit)].into(), ..Default::default() }
}

fn evidence(hosts: &[(&str, HostEvidence)]) -> Evidence {
    Evidence { hosts: hosts.iter().map(|(h, e)| (h.to_string(), e.clone())).collect(), ..Default::default() }
}

fn all_on(rev: &str) -> Evidence {
    evidence(&[("gpu-01", on(rev, 2.5)), ("gpu-02", on(rev, 2.5)), ("gpu-03", on(rev, 2.5)), ("gpu-04", on(rev, 2.5))])
}

/// A rollout of NEW over OLD, just started.
fn rollout() -> Record {
    Record {
        target: NEW.into(),
        released: OLD.into(),
        state: RolloutState::Progressing,
        started: T0,
        waves: vec![WaveRecord::at("canary", OLD), WaveRecord::at("rest", OLD)],
        halt: None,
    }
}

/// The rollout once its canary wave has baked the new revision (at `T0`).
fn canary_baked() -> Record {
    let mut r = rollout();
    r.waves[0].baked = Some(T0);
    r.waves[0].good = NEW.into();
    r
}

fn step(record: Option<&Record>, head: &str, ev: &Evidence, now: u64) -> Step {
    let f = fleet();
    decide(&Inputs { fleet: &f, record, head, evidence: ev, expected: &expected, now })
}

#[track_caller]
fn written(s: Step) -> (Record, String) {
    match s {
        Step::Write { record, message } => (*record, message),
        Step::Wait { why, .. } => panic!("expected a write, got a wait: {why}"),
    }
}

#[track_caller]
fn waits(s: Step) -> (String, Option<u64>) {
    match s {
        Step::Wait { why, until, .. } => (why, until),
        Step::Write { message, .. } => panic!("expected a wait, got a write: {message}"),
    }
}

fn promote(r: &mut Record, wave: usize, hosts: &[&str], at: u64) {
    r.waves[wave].promoted.extend(hosts.iter().map(|h| Promoted { host: h.to_string(), at }));
}

#[test]
fn the_first_pass_adopts_the_head_and_a_new_head_starts_a_rollout() {
    let (r, m) = written(step(None, OLD, &all_on(OLD), T0));
    assert_eq!((r.state, r.released.as_str(), r.target.as_str()), (RolloutState::Complete, OLD, OLD));
    assert!(r.waves.iter().all(|w| w.good == OLD), "{r:?}");
    assert_eq!(m, "fleet: adopt 111111111111 as released (the first promotion record)");
    let (why, _) = waits(step(Some(&r), OLD, &all_on(OLD), T0 + 1));
    assert_eq!(why, "111111111111 is released to every wave");
    let (r2, m) = written(step(Some(&r), NEW, &all_on(OLD), T0 + 2));
    assert_eq!((r2.state, r2.target.as_str(), r2.released.as_str()), (RolloutState::Progressing, NEW, OLD));
    assert_eq!(m, "fleet: roll out 222222222222");
}

#[test]
fn hosts_are_promoted_one_wave_at_a_time_within_max_unavailable_and_each_wave_bakes() {
    let r = rollout();
    // The canary first, alone.
    let (r, m) = written(step(Some(&r), NEW, &all_on(OLD), T0 + 1));
    assert_eq!(m, "fleet: promote 222222222222 to gpu-01 (wave canary, 1 of 1 hosts)");
    assert_eq!(r.waves[1].promoted, []);
    // Still applying: nothing to write.
    let (why, _) = waits(step(Some(&r), NEW, &all_on(OLD), T0 + 30));
    assert!(
        why.starts_with("wave canary waits for gpu-01 (applying 222222222222 for 29 s: its agent deploys 111111111111"),
        "{why}"
    );
    // It runs the target and passes: converged, then the bake.
    let mut ev = all_on(OLD);
    ev.hosts.insert("gpu-01".into(), on(NEW, 2.4));
    let (r, m) = written(step(Some(&r), NEW, &ev, T0 + 60));
    assert_eq!(r.waves[0].converged, Some(T0 + 60));
    assert_eq!(m, "fleet: wave canary runs 222222222222 on all 1 hosts; it bakes 600 s");
    let (why, until) = waits(step(Some(&r), NEW, &ev, T0 + 61));
    assert_eq!(until, Some(T0 + 661));
    assert!(why.starts_with("wave canary bakes until ") && why.ends_with("(600 s left)"), "{why}");
    assert!(matches!(step(Some(&r), NEW, &ev, T0 + 660), Step::Wait { .. }), "never shorter than the bake");
    let (r, m) = written(step(Some(&r), NEW, &ev, T0 + 661));
    assert_eq!((r.waves[0].baked, r.waves[0].good.as_str()), (Some(T0 + 661), NEW));
    assert_eq!(m, "fleet: wave canary baked 600 s on 222222222222; wave rest is next");
    // The rest: two at a time (max_unavailable 2).
    let (r, m) = written(step(Some(&r), NEW, &ev, T0 + 661));
    assert_eq!(m, "fleet: promote 222222222222 to gpu-02, gpu-03 (wave rest, 2 of 3 hosts)");
    let (why, _) = waits(step(Some(&r), NEW, &ev, T0 + 662));
    assert!(why.starts_with("wave rest: 2 of 3 hosts unavailable (max_unavailable 2): gpu-02 (applying"), "{why}");
    ev.hosts.insert("gpu-02".into(), on(NEW, 2.4));
    let (r, m) = written(step(Some(&r), NEW, &ev, T0 + 700));
    assert_eq!(m, "fleet: promote 222222222222 to gpu-04 (wave rest, 3 of 3 hosts)");
    let ev = all_on(NEW);
    let (r, _) = written(step(Some(&r), NEW, &ev, T0 + 760));
    assert_eq!(r.waves[1].converged, Some(T0 + 760));
    let (r, m) = written(step(Some(&r), NEW, &ev, T0 + 760 + 1801));
    assert_eq!(m, "fleet: wave rest baked 1800 s on 222222222222; the rollout completes");
    let (r, m) = written(step(Some(&r), NEW, &ev, T0 + 2562));
    assert_eq!((r.state, r.released.as_str()), (RolloutState::Complete, NEW));
    assert_eq!(m, "fleet: 222222222222 is released: every wave passed");
}

#[test]
fn a_host_down_counts_unavailable_and_is_not_promoted() {
    let r = canary_baked();
    let mut ev = all_on(OLD);
    ev.hosts.get_mut("gpu-03").unwrap().down = Some("its agent is down: the last scrape failed".into());
    let (r, m) = written(step(Some(&r), NEW, &ev, T0 + 1));
    assert_eq!(m, "fleet: promote 222222222222 to gpu-02 (wave rest, 1 of 3 hosts)", "room for one: gpu-03 is down");
    let (why, _) = waits(step(Some(&r), NEW, &ev, T0 + 2));
    assert!(why.contains("gpu-03 (no evidence: its agent is down: the last scrape failed)"), "{why}");
    // A host the fleet file names but Prometheus never saw is unavailable too.
    let mut ev = all_on(OLD);
    ev.hosts.remove("gpu-01");
    let (why, _) = waits(step(Some(&rollout()), NEW, &ev, T0 + 1));
    assert_eq!(
        why,
        "wave canary: 1 of 1 hosts unavailable (max_unavailable 1): gpu-01 (no evidence: Prometheus has no specd_host_info for it (not scraped?))"
    );
}

#[test]
fn a_failed_gate_halts_and_sends_the_waves_promoted_hosts_back() {
    let mut r = rollout();
    promote(&mut r, 0, &["gpu-01"], T0 + 1);
    // CUDA OOM at the canary: the agent rolled back and quarantined the target's unit.
    let mut ev = all_on(OLD);
    let canary = ev.hosts.get_mut("gpu-01").unwrap();
    canary.revision = Some(NEW.into());
    let u = canary.units.get_mut("llm.service").unwrap();
    u.quarantined = true;
    let (h, m) = written(step(Some(&r), NEW, &ev, T0 + 90));
    assert_eq!(h.state, RolloutState::Halted);
    assert_eq!(h.waves[0].promoted, [], "the canary goes back to its wave's good revision");
    let halt = h.halt.as_ref().unwrap();
    assert_eq!((halt.host.as_str(), halt.unit.as_str(), halt.gate.as_str()), ("gpu-01", "llm.service", "applied"));
    assert!(
        m.starts_with("fleet: halt 222222222222 at wave canary: gpu-01 llm.service failed gate applied\n\n"),
        "{m}"
    );
    assert!(m.ends_with("Back to 111111111111: gpu-01."), "{m}");
    let f = fleet();
    assert_eq!(h.revision_for(&f, "gpu-01", &Default::default()).unwrap().revision, OLD);
    let (why, _) = waits(step(Some(&h), NEW, &ev, T0 + 91));
    assert!(
        why.starts_with("halted at wave canary at ") && why.contains("gpu-01 llm.service failed gate applied"),
        "{why}"
    );
    // The fix, a new commit, starts a new rollout.
    let (n, m) = written(step(Some(&h), NEWER, &ev, T0 + 100));
    assert_eq!((n.state, n.target.as_str(), n.halt.is_none()), (RolloutState::Progressing, NEWER, true));
    assert_eq!(m, "fleet: roll out 333333333333; the rollout of 222222222222 was halted");
}

#[test]
fn each_gate_halts_with_its_figures() {
    let mut r = rollout();
    promote(&mut r, 0, &["gpu-01"], T0 + 1);
    type Case = (&'static str, Box<dyn Fn(&mut HostEvidence)>, &'static str);
    let cases: Vec<Case> = vec![
        (
            "accept_length",
            Box::new(|e| e.units.get_mut("llm.service").unwrap().accept_length = Some(1.2)),
            "1.200 < min 1.5",
        ),
        (
            "accept_length",
            Box::new(|e| e.units.get_mut("llm.service").unwrap().accept_length = Some(1.9)),
            "1.900 < 0.8 × 2.500 (the previous revision's)",
        ),
        (
            "startup_within",
            Box::new(|e| e.units.get_mut("llm.service").unwrap().start_seconds = Some(80.0)),
            "80.0s > 1.5 × 40.0s (the previous revision's)",
        ),
        (
            "startup_within",
            Box::new(|e| {
                let u = e.units.get_mut("llm.service").unwrap();
                (u.start_seconds, u.previous_start_seconds) = (Some(700.0), None);
            }),
            "700.0s > max 600s",
        ),
        (
            "no_deaths",
            Box::new(|e| {
                e.units.get_mut("llm.service").unwrap().deaths_since_promotion = [("cuda-oom".to_string(), 1.0)].into()
            }),
            "died since its promotion: cuda-oom ×1",
        ),
        (
            "args_verified",
            Box::new(|e| e.units.get_mut("llm.service").unwrap().verified_throughout = Some(false)),
            "its args were not verified at every scrape of the bake",
        ),
    ];
    for (gate, change, evidence) in cases {
        let mut ev = all_on(OLD);
        let mut canary = on(NEW, 2.4);
        change(&mut canary);
        ev.hosts.insert("gpu-01".into(), canary);
        let (h, _) = written(step(Some(&r), NEW, &ev, T0 + 60));
        let halt = h.halt.unwrap();
        assert_eq!((halt.gate.as_str(), halt.evidence.as_str()), (gate, evidence));
    }
}

/// The start ceiling judges a host's start of the target only: a start half again as long as
/// the previous revision's passes, one over it halts; a host still on the previous revision (its
/// gauge is that revision's start), or without a previous figure under the absolute ceiling, is
/// not held by it.
#[test]
fn the_start_ceiling_judges_the_start_of_the_target_against_the_previous_revision_s() {
    let mut r = rollout();
    promote(&mut r, 0, &["gpu-01"], T0 + 1);
    let with_start = |rev: &str, now: f64, previous: Option<f64>| {
        let mut h = on(rev, 2.4);
        let u = h.units.get_mut("llm.service").unwrap();
        (u.start_seconds, u.previous_start_seconds) = (Some(now), previous);
        let mut ev = all_on(OLD);
        ev.hosts.insert("gpu-01".into(), h);
        ev
    };
    let (c, m) = written(step(Some(&r), NEW, &with_start(NEW, 60.0, Some(40.0)), T0 + 60));
    assert!(c.halt.is_none() && m.contains("wave canary runs 222222222222"), "{m}");
    let (h, _) = written(step(Some(&r), NEW, &with_start(NEW, 60.5, Some(40.0)), T0 + 60));
    assert_eq!(h.halt.map(|x| x.gate), Some("startup_within".to_string()));
    let (why, _) = waits(step(Some(&r), NEW, &with_start(OLD, 900.0, Some(40.0)), T0 + 60));
    assert!(why.contains("applying 222222222222"), "not judged before it runs the target: {why}");
    let (c, _) = written(step(Some(&r), NEW, &with_start(NEW, 500.0, None), T0 + 60));
    assert!(c.halt.is_none(), "{:?}", c.halt);
}

#[test]
fn a_host_that_never_runs_the_target_fails_the_convergence_gate_and_speculation_must_be_proven() {
    let mut r = rollout();
    promote(&mut r, 0, &["gpu-01"], T0);
    let (why, _) = waits(step(Some(&r), NEW, &all_on(OLD), T0 + 1800));
    assert!(why.contains("applying 222222222222 for 1800 s"), "{why}");
    let (h, _) = written(step(Some(&r), NEW, &all_on(OLD), T0 + 1801));
    let halt = h.halt.unwrap();
    assert_eq!(halt.gate, "converge");
    assert!(
        halt.evidence.starts_with("given 222222222222 1801 s ago, within 1800 s: its agent deploys 111111111111"),
        "{}",
        halt.evidence
    );
    // Runs the target, no accept length yet: not good until proven.
    let mut ev = all_on(OLD);
    let mut canary = on(NEW, 2.4);
    canary.units.get_mut("llm.service").unwrap().accept_length = None;
    ev.hosts.insert("gpu-01".into(), canary);
    let (why, _) = waits(step(Some(&r), NEW, &ev, T0 + 60));
    assert!(why.contains("llm.service: no accept length measured yet (speculation not proven)"), "{why}");
    let (h, _) = written(step(Some(&r), NEW, &ev, T0 + 1801));
    assert_eq!(h.halt.unwrap().gate, "speculation_proven");
}

/// `speculation_pays`: the canary's served figures on the new revision against those its
/// previous revision served, judged once they rest on `min_drafts`.
#[test]
fn speculation_pays_judges_the_served_figures_against_the_previous_revisions() {
    let text = FLEET.replace("  gates:\n", "  gates:\n    speculation_pays: {of_previous: 0.95, min_drafts: 200}\n");
    let f = fleet::parse_fleet(&text, "fleet.yaml").unwrap();
    let mut r = rollout();
    promote(&mut r, 0, &["gpu-01"], T0);
    let served = |accept_length, tok_s, drafts| Some(Served { accept_length, tok_s, drafts });
    let at = |now: Option<Served>, before: Option<Served>, t: u64| {
        let mut ev = all_on(OLD);
        let mut canary = on(NEW, 2.4);
        let u = canary.units.get_mut("llm.service").unwrap();
        (u.served, u.previous_served) = (now, before);
        ev.hosts.insert("gpu-01".into(), canary);
        decide(&Inputs { fleet: &f, record: Some(&r), head: NEW, evidence: &ev, expected: &expected, now: t })
    };
    let before = served(2.5, 205.0, 1000.0);
    // (now, the halt's evidence)
    let table = [
        (
            served(2.3, 210.0, 500.0),
            "accept length 2.300 < 0.95 × 2.500 (the previous revision's, at the load it served); over 500 drafts",
        ),
        (
            served(2.5, 190.0, 500.0),
            "decode speed 190.0 tok/s per request < 0.95 × 205.0 (the previous revision's, at the load it served); over 500 drafts",
        ),
    ];
    for (now, evidence) in table {
        let (h, _) = written(at(now, before, T0 + 60));
        let halt = h.halt.unwrap();
        assert_eq!(
            (halt.host.as_str(), halt.gate.as_str(), halt.evidence.as_str()),
            ("gpu-01", "speculation_pays", evidence)
        );
    }
    // Within 5 %: it still pays, the wave converges.
    let (h, m) = written(at(served(2.45, 200.0, 500.0), before, T0 + 60));
    assert!(h.halt.is_none() && h.waves[0].converged == Some(T0 + 60), "{m}");
    // Too few drafts to judge: not good yet, and failed once it should have converged.
    let (why, _) = waits(at(served(1.5, 100.0, 50.0), before, T0 + 60));
    assert!(why.contains("llm.service: 50 drafts served on it yet; speculation_pays judges at 200"), "{why}");
    let (why, _) = waits(at(None, before, T0 + 60));
    assert!(why.contains("0 drafts served on it yet"), "{why}");
    let (h, _) = written(at(served(1.5, 100.0, 50.0), before, T0 + 1801));
    assert_eq!(h.halt.unwrap().gate, "speculation_pays");
    // Nothing served before (the previous revision did not speculate, or its agent exported no
    // served figures): nothing to compare, the gate does not hold the wave.
    let (h, _) = written(at(served(1.5, 100.0, 50.0), None, T0 + 60));
    assert!(h.halt.is_none() && h.waves[0].converged == Some(T0 + 60));
    // Without the gate, the same figures pass.
    let (h, _) = written(step(
        Some(&r),
        NEW,
        &{
            let mut ev = all_on(OLD);
            let mut canary = on(NEW, 2.4);
            let u = canary.units.get_mut("llm.service").unwrap();
            (u.served, u.previous_served) = (served(2.3, 100.0, 500.0), before);
            ev.hosts.insert("gpu-01".into(), canary);
            ev
        },
        T0 + 60,
    ));
    assert!(h.halt.is_none());
}

#[test]
fn no_evidence_advances_nothing() {
    let mut r = rollout();
    promote(&mut r, 0, &["gpu-01"], T0);
    let ev = Evidence {
        unavailable: Some("Prometheus at http://127.0.0.1:9090: unreachable (connection refused)".into()),
        ..Default::default()
    };
    let (why, _) = waits(step(Some(&r), NEW, &ev, T0 + 5000));
    assert_eq!(
        why,
        "no evidence, nothing advances: Prometheus at http://127.0.0.1:9090: unreachable (connection refused)"
    );
    // Far past the convergence time: still no halt without evidence.
    assert!(matches!(step(Some(&r), NEW, &ev, T0 + 90_000), Step::Wait { .. }));
    // Every host good, but a target of the agents' job is down and never said its name: it
    // could be a host of any wave.
    let mut ev = all_on(NEW);
    ev.unidentified = vec!["10.0.0.9:9100 (job specd)".into()];
    let (why, _) = waits(step(Some(&r), NEW, &ev, T0 + 5000));
    assert!(why.ends_with("never said which host they are (any wave's): 10.0.0.9:9100 (job specd)"), "{why}");
}

#[test]
fn a_person_halts_everything_until_resumed() {
    let r = rollout();
    let (h, m) = written(halted_by(&r, "ops@gpu", "investigating latency", T0).unwrap());
    assert_eq!(m, "fleet: halted by ops@gpu: investigating latency");
    let (why, _) = waits(step(Some(&h), NEW, &all_on(OLD), T0 + 1));
    assert!(
        why.starts_with("halted by ops@gpu at ")
            && why.ends_with("investigating latency (`specd fleet resume` continues)"),
        "{why}"
    );
    let (why, _) = waits(step(Some(&h), NEWER, &all_on(OLD), T0 + 2));
    assert_eq!(why, "halted by ops@gpu (a new revision waits too): `specd fleet resume` continues");
    assert!(halted_by(&h, "x", "y", T0).is_err());
    let (res, m) = written(resumed(&h, "ops@gpu").unwrap());
    assert_eq!((res.state, res.halt.is_none()), (RolloutState::Progressing, true));
    assert_eq!(m, "fleet: resumed by ops@gpu: 222222222222 rolls on");
    assert!(resumed(&res, "x").unwrap_err().contains("is not halted"));
}

#[test]
fn a_new_revision_supersedes_a_rollout_in_progress() {
    let mut r = rollout();
    r.waves[0].baked = Some(T0 + 10);
    r.waves[0].good = NEW.into();
    promote(&mut r, 1, &["gpu-02"], T0 + 20);
    let (n, m) = written(step(Some(&r), NEWER, &all_on(NEW), T0 + 30));
    assert_eq!(m, "fleet: roll out 333333333333; it supersedes the rollout of 222222222222 in progress");
    assert_eq!(n.waves[0].good, NEW, "the canary baked the previous target: that is its good revision");
    assert_eq!(
        (n.waves[1].good.as_str(), n.waves[1].promoted.len()),
        (OLD, 0),
        "gpu-02 goes back until its wave passes"
    );
}

#[test]
fn a_changed_fleet_file_rewaves_the_record() {
    let mut r = rollout();
    r.waves.pop();
    r.waves.push(WaveRecord::at("gone", OLD));
    let (n, m) = written(step(Some(&r), NEW, &all_on(OLD), T0));
    assert_eq!(m, "fleet: the waves are now canary, rest");
    assert_eq!(n.waves.iter().map(|w| w.name.as_str()).collect::<Vec<_>>(), ["canary", "rest"]);
    assert_eq!(n.waves[1].good, OLD, "a new wave starts on the released revision");
}

#[test]
fn a_bake_starts_again_when_a_host_of_the_wave_is_not_good_or_one_joins() {
    let mut r = canary_baked();
    promote(&mut r, 1, &["gpu-02", "gpu-03", "gpu-04"], T0 + 1);
    r.waves[1].converged = Some(T0 + 60);
    // gpu-03 rebooted during the bake: the bake starts again once all are good.
    let mut ev = all_on(NEW);
    ev.hosts.get_mut("gpu-03").unwrap().down = Some("its agent is down: the last scrape failed".into());
    let (again, m) = written(step(Some(&r), NEW, &ev, T0 + 600));
    assert_eq!(again.waves[1].converged, None);
    assert_eq!(
        m,
        "fleet: wave rest bakes again once every host is good: gpu-03 (no evidence: its agent is down: the last scrape failed)"
    );
    let (why, _) = waits(step(Some(&again), NEW, &ev, T0 + 601));
    assert!(why.starts_with("wave rest waits for gpu-03"), "{why}");
    let (back, _) = written(step(Some(&again), NEW, &all_on(NEW), T0 + 1700));
    assert_eq!(back.waves[1].converged, Some(T0 + 1700), "a whole bake from now, not from T0 + 60");
    // A host that joins the wave's pattern during the bake: the bake starts again, and it is
    // promoted.
    let mut ev = all_on(NEW);
    ev.hosts.insert("gpu-05".into(), on(OLD, 2.5));
    let (joined, m) = written(step(Some(&r), NEW, &ev, T0 + 600));
    assert_eq!(
        (joined.waves[1].converged, m.as_str()),
        (None, "fleet: wave rest bakes again once every host is good: gpu-05 joined it")
    );
    let (_, m) = written(step(Some(&joined), NEW, &ev, T0 + 601));
    assert_eq!(m, "fleet: promote 222222222222 to gpu-05 (wave rest, 4 of 4 hosts)");
}

#[test]
fn a_wave_that_selects_no_known_host_waits_instead_of_passing() {
    let r = canary_baked();
    // Prometheus knows only the canary: the `gpu-*` wave's hosts are unseen, not absent.
    let ev = evidence(&[("gpu-01", on(NEW, 2.5))]);
    let (why, _) = waits(step(Some(&r), NEW, &ev, T0 + 1));
    assert!(why.starts_with("wave rest selects no host Prometheus knows"), "{why}");
}

#[test]
fn with_the_args_verified_gate_off_unverified_args_do_not_hold_a_host() {
    let f =
        fleet::parse_fleet(&FLEET.replace("  gates:\n", "  gates:\n    args_verified: false\n"), "fleet.yaml").unwrap();
    let mut r = rollout();
    promote(&mut r, 0, &["gpu-01"], T0 + 1);
    let mut ev = all_on(OLD);
    let mut canary = on(NEW, 2.5);
    canary.units.get_mut("llm.service").unwrap().args_verified = Some(false);
    ev.hosts.insert("gpu-01".into(), canary);
    let decide_at = |f: &ParsedFleet, now| {
        decide(&Inputs { fleet: f, record: Some(&r), head: NEW, evidence: &ev, expected: &expected, now })
    };
    let (c, _) = written(decide_at(&f, T0 + 60));
    assert_eq!(c.waves[0].converged, Some(T0 + 60), "the gate is off: the canary runs the target");
    // With the gate on (the default), it is still applying: its args are not verified.
    let (why, _) = waits(decide_at(&fleet(), T0 + 60));
    assert!(why.contains("its args are not verified"), "{why}");
}

/// A host that runs the target, verified, whose load balancers have not taken it back yet
/// (HAProxy's `rise` after the engine it found down): still applying, so the next host of the
/// wave is not stopped while this one takes no traffic; converged once it is taken.
#[test]
fn a_host_its_load_balancers_have_not_taken_back_is_not_yet_converged() {
    let mut r = rollout();
    promote(&mut r, 0, &["gpu-01"], T0 + 1);
    let mut ev = all_on(OLD);
    let mut canary = on(NEW, 2.5);
    canary.units.get_mut("llm.service").unwrap().taken = Some(false);
    ev.hosts.insert("gpu-01".into(), canary);
    let decide_at = |ev: &Evidence, now| {
        decide(&Inputs { fleet: &fleet(), record: Some(&r), head: NEW, evidence: ev, expected: &expected, now })
    };
    let (why, _) = waits(decide_at(&ev, T0 + 30));
    assert!(why.contains("llm.service: its load balancers have not taken it back yet"), "{why}");
    ev.hosts.get_mut("gpu-01").unwrap().units.get_mut("llm.service").unwrap().taken = None;
    let (c, _) = written(decide_at(&ev, T0 + 35));
    assert_eq!(c.waves[0].converged, Some(T0 + 35));
}

#[test]
fn a_resume_after_the_last_bake_releases_the_target() {
    let mut r = rollout();
    for w in &mut r.waves {
        w.baked = Some(T0 + 10);
        w.good = NEW.into();
    }
    let Step::Write { record: halted, .. } = halted_by(&r, "ops", "a maintenance window", T0 + 11).unwrap() else {
        panic!("a halt writes")
    };
    let (resumed, _) = written(resumed(&halted, "ops").unwrap());
    assert_eq!((resumed.state, resumed.released.as_str()), (RolloutState::Complete, NEW));
}

/// The rollout once its canary baked, with every host of the rest wave (gpu-02 to gpu-05,
/// `max_unavailable: 2`) promoted at `T0 + 1`.
fn rest_promoted() -> Record {
    let mut r = canary_baked();
    promote(&mut r, 1, &["gpu-02", "gpu-03", "gpu-04", "gpu-05"], T0 + 1);
    r
}

/// Every host on NEW, gpu-05's server dead of CUDA OOM since its promotion.
fn gpu05_died() -> Evidence {
    let mut ev = all_on(NEW);
    let mut dead = on(NEW, 2.5);
    dead.units.get_mut("llm.service").unwrap().deaths_since_promotion = [("cuda-oom".to_string(), 1.0)].into();
    ev.hosts.insert("gpu-05".into(), dead);
    ev
}

fn promoted_hosts(r: &Record, wave: usize) -> Vec<&str> {
    r.waves[wave].promoted.iter().map(|p| p.host.as_str()).collect()
}

/// A host that took `to` and still runs the unit of `from` (its apply in progress).
fn applying(from: &str, to: &str) -> HostEvidence {
    let mut e = on(from, 2.5);
    e.revision = Some(to.into());
    e
}

#[test]
fn a_halt_sends_the_failing_host_back_first_and_the_others_as_max_unavailable_allows() {
    let f = fleet();
    let (h, m) = written(step(Some(&rest_promoted()), NEW, &gpu05_died(), T0 + 100));
    assert_eq!(h.state, RolloutState::Halted);
    let halt = h.halt.clone().unwrap();
    assert_eq!((halt.wave.as_str(), halt.host.as_str(), halt.gate.as_str()), ("rest", "gpu-05", "no_deaths"));
    assert_eq!(promoted_hosts(&h, 1), ["gpu-02", "gpu-03", "gpu-04"], "only the failing host goes back now");
    assert!(m.ends_with("Back to 111111111111: gpu-05; then gpu-02, gpu-03, gpu-04, within max_unavailable 2."), "{m}");
    let given = |r: &Record, host| r.revision_for(&f, host, &Default::default()).unwrap().revision;
    // The rest wave's good revision is still OLD: the canary's is NEW.
    assert_eq!((given(&h, "gpu-05"), given(&h, "gpu-02")), (OLD.to_string(), NEW.to_string()));

    // gpu-05's agent has not taken OLD yet: it is unavailable, one more host may go.
    let mut ev = gpu05_died();
    let (b1, m) = written(step(Some(&h), NEW, &ev, T0 + 101));
    assert_eq!(promoted_hosts(&b1, 1), ["gpu-03", "gpu-04"]);
    assert_eq!(
        m,
        "fleet: send gpu-02 back to 111111111111 (wave rest, halted: gpu-05 failed gate no_deaths); gpu-03, gpu-04 still on 222222222222"
    );
    assert_eq!(b1.halt, h.halt, "the halt stays named");
    // Two on their way back: nobody else goes.
    ev.hosts.insert("gpu-02".into(), applying(NEW, OLD));
    let (why, _) = waits(step(Some(&b1), NEW, &ev, T0 + 102));
    assert!(why.starts_with("halted at wave rest at "), "{why}");
    assert!(
        why.ends_with(
            " gpu-05 llm.service failed gate no_deaths: died since its promotion: cuda-oom ×1; gpu-03, gpu-04 go back to 111111111111 as max_unavailable 2 allows: 2 of 4 hosts of wave rest unavailable: gpu-02 (llm.service runs unit unit-2222, not unit-1111); gpu-05 (its agent deploys 222222222222, not 111111111111)"
        ),
        "{why}"
    );
    // gpu-05 is back: one more.
    ev.hosts.insert("gpu-05".into(), on(OLD, 2.5));
    let (b2, m) = written(step(Some(&b1), NEW, &ev, T0 + 103));
    assert_eq!(promoted_hosts(&b2, 1), ["gpu-04"]);
    assert!(m.starts_with("fleet: send gpu-03 back to 111111111111"), "{m}");
    // gpu-02 back, gpu-03 applying: the last one.
    ev.hosts.insert("gpu-02".into(), on(OLD, 2.5));
    ev.hosts.insert("gpu-03".into(), applying(NEW, OLD));
    let (b3, m) = written(step(Some(&b2), NEW, &ev, T0 + 104));
    assert_eq!(promoted_hosts(&b3, 1), Vec::<&str>::new());
    assert!(m.ends_with("; every host of wave rest is given it again"), "{m}");
    assert_eq!(b3.halt, h.halt);
    let (why, _) = waits(step(Some(&b3), NEW, &ev, T0 + 105));
    assert_eq!(why, halted_why(&h));
}

#[test]
fn while_hosts_go_back_a_promoted_host_that_is_not_good_goes_at_once_and_nothing_goes_without_evidence() {
    let (h, _) = written(step(Some(&rest_promoted()), NEW, &gpu05_died(), T0 + 100));
    // gpu-04's agent is down and gpu-05 has not taken OLD: two unavailable, no room; gpu-04 is
    // unavailable anyway, so it goes back, and no other.
    let mut ev = gpu05_died();
    ev.hosts.get_mut("gpu-04").unwrap().down = Some("its agent is down: the last scrape failed".into());
    let (b, m) = written(step(Some(&h), NEW, &ev, T0 + 101));
    assert_eq!(promoted_hosts(&b, 1), ["gpu-02", "gpu-03"], "{m}");
    // gpu-05 back, but a target of the agents' job is down and never said its host name: it may
    // be one of the wave's, so it counts.
    let mut ev = all_on(NEW);
    ev.hosts.insert("gpu-05".into(), on(OLD, 2.5));
    ev.hosts.insert("gpu-04".into(), applying(NEW, OLD));
    ev.unidentified = vec!["10.0.0.9:9100 (job specd)".into()];
    let (why, _) = waits(step(Some(&b), NEW, &ev, T0 + 102));
    assert!(why.ends_with("2 of 5 hosts of wave rest unavailable: gpu-04 (llm.service runs unit unit-2222, not unit-1111); 10.0.0.9:9100 (job specd) (down, never said which host it is)"), "{why}");
    ev.unidentified.clear();
    let (c, _) = written(step(Some(&b), NEW, &ev, T0 + 102));
    assert_eq!(promoted_hosts(&c, 1), ["gpu-03"]);
    let no_evidence = Evidence { unavailable: Some("Prometheus: connection refused".into()), ..Default::default() };
    let (why, _) = waits(step(Some(&b), NEW, &no_evidence, T0 + 102));
    assert!(
        why.ends_with("go back to 111111111111 once there is evidence: no evidence: Prometheus: connection refused"),
        "{why}"
    );
}

#[test]
fn a_new_revision_during_a_halts_sending_back_waits_until_every_host_is_back() {
    let (h, _) = written(step(Some(&rest_promoted()), NEW, &gpu05_died(), T0 + 100));
    let mut ev = gpu05_died();
    let (b, _) = written(step(Some(&h), NEW, &ev, T0 + 101));
    // gpu-05 and gpu-02 on their way back: the fix waits (starting its rollout would send
    // gpu-03 and gpu-04 back too, four at once).
    ev.hosts.insert("gpu-02".into(), applying(NEW, OLD));
    let (why, _) = waits(step(Some(&b), NEWER, &ev, T0 + 102));
    assert!(why.ends_with("the rollout of 333333333333 starts once they are back"), "{why}");
    ev.hosts.insert("gpu-05".into(), on(OLD, 2.5));
    ev.hosts.insert("gpu-02".into(), on(OLD, 2.5));
    let (b, m) = written(step(Some(&b), NEWER, &ev, T0 + 103));
    assert_eq!((b.target.as_str(), promoted_hosts(&b, 1)), (NEW, vec![]), "{m}");
    assert!(m.starts_with("fleet: send gpu-03, gpu-04 back to 111111111111"), "{m}");
    let (n, m) = written(step(Some(&b), NEWER, &ev, T0 + 104));
    assert_eq!((n.target.as_str(), n.state), (NEWER, RolloutState::Progressing));
    assert_eq!(m, "fleet: roll out 333333333333; the rollout of 222222222222 was halted");
}

/// A host's agent in the simulation below: the revision it runs, and the one it applies with
/// the promoter's passes left until it runs it.
#[derive(Debug)]
struct Agent {
    runs: String,
    applying: Option<(String, u32)>,
}

/// The hosts of the rest wave as agents: each takes what the record gives it, applying for
/// `APPLY` passes of the promoter (unavailable meanwhile). gpu-05's server dies on NEW.
#[test]
fn through_a_halt_and_its_sending_back_no_more_than_max_unavailable_hosts_of_the_wave_apply_at_once() {
    const APPLY: u32 = 3;
    let f = fleet();
    let rest = ["gpu-02", "gpu-03", "gpu-04", "gpu-05"];
    let mut hosts: BTreeMap<&str, Agent> =
        rest.iter().map(|h| (*h, Agent { runs: NEW.to_string(), applying: None })).collect();
    let mut record = rest_promoted();
    let mut most = 0;
    let mut halt = None;
    for pass in 0..40u64 {
        let mut ev = all_on(NEW);
        for (h, a) in &hosts {
            let e = match &a.applying {
                Some((to, _)) => applying(&a.runs, to),
                None if *h == "gpu-05" && a.runs == NEW => gpu05_died().hosts["gpu-05"].clone(),
                None => on(&a.runs, 2.5),
            };
            ev.hosts.insert(h.to_string(), e);
        }
        if let Step::Write { record: r, .. } = step(Some(&record), NEW, &ev, T0 + 100 + pass) {
            record = *r;
        }
        if record.halt.is_some() {
            assert_eq!(*halt.get_or_insert(record.halt.clone()), record.halt, "the halt stays named");
        }
        for (h, a) in hosts.iter_mut() {
            let given = record.revision_for(&f, h, &Default::default()).unwrap().revision;
            match &mut a.applying {
                Some((to, 1)) => {
                    a.runs = std::mem::take(to);
                    a.applying = None;
                }
                Some((_, left)) => *left -= 1,
                None if a.runs != given => a.applying = Some((given, APPLY)),
                None => {}
            }
        }
        let now = hosts.values().filter(|a| a.applying.is_some()).count();
        assert!(now <= 2, "pass {pass}: {now} hosts of the wave applying at once: {hosts:?}\n{record:#?}");
        most = most.max(now);
    }
    assert_eq!(record.state, RolloutState::Halted);
    assert!(hosts.values().all(|a| a.runs == OLD && a.applying.is_none()), "every host back: {hosts:?}");
    assert_eq!(most, 2, "two at a time: the budget is used");
}

#[test]
fn without_evidence_the_positions_still_list_the_hosts_the_record_promoted() {
    // The rest wave selects by a pattern: only Prometheus knows its hosts, but the record names
    // those it promoted.
    let mut r = canary_baked();
    promote(&mut r, 1, &["gpu-02", "gpu-03"], T0 + 5);
    let f = fleet();
    let none =
        Evidence { unavailable: Some("Prometheus at http://p:9090 did not answer".into()), ..Default::default() };
    let inputs = Inputs { fleet: &f, record: Some(&r), head: NEW, evidence: &none, expected: &expected, now: T0 + 9 };
    let listed: Vec<(String, Option<String>, bool)> =
        positions(&inputs, &r).into_iter().map(|p| (p.host, p.wave, p.promoted)).collect();
    assert_eq!(
        listed,
        [
            ("gpu-01".to_string(), Some("canary".to_string()), false),
            ("gpu-02".to_string(), Some("rest".to_string()), true),
            ("gpu-03".to_string(), Some("rest".to_string()), true),
        ]
    );
}

/// A wait is `soon` (a watching promoter looks again within a second, not at its interval)
/// exactly when a host of the wave is on its way: applying the target, or going back.
#[test]
fn a_wait_for_a_host_applying_the_target_is_soon_and_one_for_a_host_down_or_a_bake_is_not() {
    let down = |ev: &mut Evidence, h: &str| ev.hosts.get_mut(h).unwrap().down = Some("the last scrape failed".into());
    let mut canary = rollout();
    promote(&mut canary, 0, &["gpu-01"], T0 + 1);
    let mut rest = canary_baked();
    promote(&mut rest, 1, &["gpu-02"], T0 + 1);
    let mut one_down = all_on(OLD);
    down(&mut one_down, "gpu-03");
    let mut two_down = all_on(OLD);
    down(&mut two_down, "gpu-03");
    down(&mut two_down, "gpu-04");
    let mut unproven = one_down.clone();
    unproven.hosts.insert("gpu-02".into(), on(NEW, 2.5));
    unproven.hosts.get_mut("gpu-02").unwrap().units.get_mut("llm.service").unwrap().accept_length = None;
    let mut baking = canary.clone();
    baking.waves[0].converged = Some(T0 + 60);
    let mut on_new = all_on(OLD);
    on_new.hosts.insert("gpu-01".into(), on(NEW, 2.4));
    // Halted: gpu-05 and gpu-02 sent back, gpu-02 still on its way; then every host back.
    let (halted, _) = written(step(Some(&rest_promoted()), NEW, &gpu05_died(), T0 + 100));
    let (going_back, _) = written(step(Some(&halted), NEW, &gpu05_died(), T0 + 101));
    let mut on_the_way = gpu05_died();
    on_the_way.hosts.insert("gpu-02".into(), applying(NEW, OLD));
    let mut all_back = halted.clone();
    all_back.waves[1].promoted.clear();
    let cases: [(&str, &Record, &Evidence, bool); 7] = [
        ("the canary's host applying", &canary, &all_on(OLD), true),
        ("halted: two hosts on their way back", &going_back, &on_the_way, true),
        ("halted: every host back", &all_back, &all_on(OLD), false),
        ("no room: one host applying, one down", &rest, &one_down, true),
        ("no room: two hosts down, none promoted", &canary_baked(), &two_down, false),
        ("no room: one host's speculation not proven yet, one down", &rest, &unproven, true),
        ("a bake", &baking, &on_new, false),
    ];
    for (case, record, ev, soon) in cases {
        match step(Some(record), NEW, ev, T0 + 70) {
            Step::Wait { soon: s, why, .. } => assert_eq!(s, soon, "{case}: {why}"),
            Step::Write { message, .. } => panic!("{case}: a write: {message}"),
        }
    }
}
