//! A fleet on one machine: six hosts (each a systemd box with its own host name, state, units
//! and agent under the shipped sandbox) follow one git remote, and a real Prometheus scrapes
//! them all; the promoter (`specd promote`, `specd fleet`) runs on the machine as a CI job
//! would. The harness is `crate::common::fleet`. The tests take turns: six boxes each are enough for
//! a small machine.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use specd_spec::fleet::{Record, RolloutState};

use crate::common::fleet::{
    FLEET_FILE, FleetSetup, Hosts, JOB, LLM, LLM_FILE, LlmSpec, RecordCommit, Timeline, canary_then_the_rest,
    fleet_file,
};
use crate::common::{http_get, wait_for};

/// One fleet at a time.
static TURN: Mutex<()> = Mutex::new(());

fn turn() -> std::sync::MutexGuard<'static, ()> {
    TURN.lock().unwrap_or_else(|e| e.into_inner())
}

/// How long one host may take to deploy a commit, from the push (a poll every second, a
/// stand-in that loads in 200 ms; six at once on a small machine).
const CONVERGE: Duration = Duration::from_secs(90);

/// The host with the smaller GPU.
const SMALL: &str = "gpu-06";

#[test]
fn six_hosts_follow_one_remote_each_on_its_own_port_and_prometheus_sees_them_all() {
    let _turn = turn();
    let t0 = Instant::now();
    let mut setup = FleetSetup::default();
    // gpu-06's GPU holds a draft of 6 tokens at most (steps 5), the others any.
    setup.host_mut(SMALL).max_draft_tokens = Some(6);
    let fleet = Hosts::boot(setup);
    let booted = t0.elapsed();
    let c1 = fleet.commit(&[(LLM_FILE, &fleet.llm(3).text())], "llm: steps 3");
    fleet.start_agents();
    fleet.wait_all_run(&c1, CONVERGE);
    let converged = t0.elapsed();
    eprintln!("six hosts: booted in {booted:?} (boxes {:?}), first commit on all at {converged:?}", fleet.boot_time);

    // A speculative-steps change: every host takes it, each on its own port, each server
    // reporting its own settings; no host ever ran a revision it was not given.
    // Without a fleet file every host takes it at once: the sampler sees each leave the first
    // commit before it serves the second, and hosts down together.
    let sampler = fleet.sample(Duration::from_millis(50));
    let c2 = fleet.commit(&[(LLM_FILE, &fleet.llm(5).text())], "llm: steps 5");
    let pushed = Instant::now();
    fleet.wait_all_run(&c2, CONVERGE);
    eprintln!("second commit on all {:?} after the push", pushed.elapsed());
    let seen = sampler.finish();
    for n in fleet.names() {
        let (left, on) = (seen.first_left(&n, &c1), seen.first_on(&n, &c2));
        assert!(left.is_some_and(|l| on.is_some_and(|o| l < o)), "{n}: left c1 {left:?}, on c2 {on:?}");
    }
    let (most, when) = seen.max_unavailable(&fleet.names().iter().map(String::as_str).collect::<Vec<_>>());
    assert!(most >= 2, "{most} hosts down at once at most: {when:?}");
    let mut ports = Vec::new();
    for h in fleet.hosts() {
        let name = h.name();
        let served = fleet.served(name).unwrap_or_else(|| panic!("{name}'s server does not answer"));
        assert_eq!(served["port"], h.server_port, "{name}: {served}");
        assert_eq!(served["speculative_num_steps"], 5, "{name}: {served}");
        assert_eq!(served["speculative_num_draft_tokens"], 6, "{name}: {served}");
        ports.push(h.server_port);
        let st = fleet.status(name);
        assert_eq!((&st["cmdline_matches"], &st["arg_mismatches"]), (&json!(true), &json!([])), "{name}: {st}");
        assert!(st["speculation"]["measured"]["accept_length"].as_f64().is_some(), "{name}: {st}");
        let tried: Vec<_> = fleet.history(name).into_iter().filter(|a| a.tried()).collect();
        let commits: Vec<_> = tried.iter().map(|a| a.commit.clone().unwrap_or_default()).collect();
        assert_eq!(commits, [c1.clone(), c2.clone()], "{name}: {tried:?}");
        assert!(tried.iter().all(|a| a.outcome == "applied"), "{name}: {tried:?}");
    }
    ports.sort();
    ports.dedup();
    assert_eq!(ports.len(), 6, "every host has its own port: {ports:?}");

    // Prometheus has every agent, each at the second commit.
    let prom = fleet.prometheus();
    let series = prom.wait(
        "six agents at the second commit",
        &format!("specd_source_info{{job=\"{JOB}\",revision=\"{c2}\"}}"),
        Duration::from_secs(30),
        |r| r.len() == 6,
    );
    let mut instances: Vec<String> =
        series.iter().map(|(l, _)| l["instance"].as_str().unwrap_or_default().to_string()).collect();
    instances.sort();
    let mut want: Vec<String> = fleet.names().iter().map(|n| fleet.instance(n)).collect();
    want.sort();
    assert_eq!(instances, want);
    assert!(series.iter().all(|(_, v)| *v == 1.0), "{series:?}");

    // A draft the smaller GPU cannot hold: every other host takes it; gpu-06's server dies of
    // CUDA OOM while loading, and it is back on the second commit.
    let c3 = fleet.commit(&[(LLM_FILE, &fleet.llm(7).text())], "llm: steps 7");
    let pushed = Instant::now();
    for n in fleet.names().iter().filter(|n| *n != SMALL) {
        fleet.wait_runs(n, &c3, CONVERGE);
    }
    let small = wait_for("gpu-06 to roll c3 back", CONVERGE, || {
        fleet.history(SMALL).into_iter().find(|a| a.commit.as_deref() == Some(c3.as_str()))
    })
    .unwrap();
    assert_eq!(small.outcome, "rolled-back", "{small:?}");
    fleet.wait_runs(SMALL, &c2, CONVERGE);
    assert_eq!(fleet.served(SMALL).unwrap()["speculative_num_steps"], 5);
    let d = fleet.specd(SMALL, &["diagnose", "llm.service", "--json"]);
    assert!(String::from_utf8_lossy(&d.stdout).contains("cuda-oom"), "{}", crate::common::text(&d));
    eprintln!("third commit on five hosts, rolled back on the sixth, {:?} after the push", pushed.elapsed());

    // An agent stopped: Prometheus finds its target down, the others up; started, up again.
    let up = |n: &str| format!("up{{job=\"{JOB}\",instance=\"{}\"}}", fleet.instance(n));
    fleet.stop_agent("gpu-01");
    prom.wait("gpu-01's agent down", &up("gpu-01"), Duration::from_secs(30), |r| r.len() == 1 && r[0].1 == 0.0);
    prom.wait("five agents up", &format!("sum(up{{job=\"{JOB}\"}})"), Duration::from_secs(5), |r| r[0].1 == 5.0);
    fleet.start_agent("gpu-01");
    prom.wait("gpu-01's agent up", &up("gpu-01"), Duration::from_secs(30), |r| r.len() == 1 && r[0].1 == 1.0);

    // Prometheus stopped: its API does not answer; started again on the same port and data:
    // it has what it scraped before and scrapes on.
    let before = format!("count(count_over_time(specd_source_info{{job=\"{JOB}\",revision=\"{c2}\"}}[1h]))");
    prom.wait("the second commit's series", &before, Duration::from_secs(5), |r| r.len() == 1 && r[0].1 == 6.0);
    let mut fleet = fleet;
    let port = fleet.prometheus().port();
    fleet.stop_prometheus();
    assert_eq!(http_get(port, "/-/ready"), None);
    fleet.start_prometheus();
    let prom = fleet.prometheus();
    prom.wait("the second commit's series kept", &before, Duration::from_secs(10), |r| r.len() == 1 && r[0].1 == 6.0);
    fleet.wait_scraped(Duration::from_secs(30));

    fleet.shutdown().unwrap();
    eprintln!("fleet: {:?} in all", t0.elapsed());
}

/// How long each wave bakes in these tests, in seconds.
const BAKE: u64 = 3;

/// How long a rollout of the three waves may take: three bakes, six applies (one or two at a
/// time), Prometheus's scrapes and the agents' polls, on a busy machine.
const ROLLOUT: Duration = Duration::from_secs(240);

/// The waves of [`fleet_file`]: name, hosts, max_unavailable.
const WAVES: [(&str, &[&str], usize); 3] =
    [("canary", &["gpu-01"], 1), ("early", &["gpu-02", "gpu-03"], 1), ("main", &["gpu-04", "gpu-05", "gpu-06"], 2)];

/// Boots the six hosts, commits the first specs with the fleet file and starts the agents:
/// before any promotion record every host waits and runs nothing; the promoter's first pass
/// adopts the head as released and every host runs it. Returns the fleet and that commit.
fn fleet_on_first_revision(setup: FleetSetup) -> (Hosts, String) {
    fleet_with(setup, &fleet_file(BAKE))
}

/// [`fleet_on_first_revision`] with the fleet file `fleet_text`.
fn fleet_with(setup: FleetSetup, fleet_text: &str) -> (Hosts, String) {
    fleet_with_llm(setup, fleet_text, |f| f.llm(3))
}

/// [`fleet_with`], the first revision's spec made by `llm`.
fn fleet_with_llm(setup: FleetSetup, fleet_text: &str, llm: impl Fn(&Hosts) -> LlmSpec) -> (Hosts, String) {
    let fleet = Hosts::boot(setup);
    let c1 = fleet.commit(&[(LLM_FILE, &llm(&fleet).text()), (FLEET_FILE, fleet_text)], "llm: steps 3; a fleet");
    fleet.start_agents();
    wait_for("gpu-03 to say it waits for a promotion", CONVERGE, || {
        let o = fleet.specd("gpu-03", &["status"]);
        String::from_utf8_lossy(&o.stdout).contains("waiting for a promotion").then_some(())
    })
    .unwrap();
    assert!(fleet.history("gpu-03").is_empty(), "nothing applied before the record");
    // Prometheus has every agent, a second ago (the promoter asks at a whole second): the first
    // record's step wakes them all.
    let n = fleet.names().len();
    let q = format!("count(specd_host_info{{job=\"{JOB}\"}} offset 1s)");
    fleet.prometheus().wait("every agent's host", &q, CONVERGE, |r| r.first().is_some_and(|(_, v)| *v == n as f64));
    let first = fleet.promote();
    assert!(first["message"].as_str().unwrap_or_default().contains("adopt"), "{first}");
    assert_eq!(first["woken"], json!({"asked": n, "answered": n, "unreached": []}), "{first}");
    fleet.wait_all_run(&c1, CONVERGE);
    (fleet, c1)
}

/// Which wave's hosts each "promote" commit of the record's log names, in order.
fn promotions(log: &[RecordCommit]) -> Vec<Vec<String>> {
    log.iter()
        .filter_map(|c| {
            let first = c.message.lines().next().unwrap_or_default();
            let rest = first.strip_prefix("fleet: promote ")?;
            let hosts = rest.split_once(" to ")?.1.split(" (wave").next()?;
            Some(hosts.split(", ").map(String::from).collect())
        })
        .collect()
}

/// The commits of the log from the one that started the rollout of `target` on.
fn rollout_of<'a>(log: &'a [RecordCommit], target: &str) -> &'a [RecordCommit] {
    let start = log
        .iter()
        .position(|c| c.message.starts_with(&format!("fleet: roll out {}", specd_spec::short(target))))
        .unwrap_or_else(|| panic!("no rollout of {target} in {log:#?}"));
    &log[start..]
}

/// Every step of a rollout is one commit: it starts once, every host is promoted once, every
/// wave converges and bakes once, it is released once.
fn one_commit_per_step(steps: &[RecordCommit]) {
    let starts = |p: &str| steps.iter().filter(|c| c.message.starts_with(p)).count();
    assert_eq!(starts("fleet: roll out"), 1, "{steps:#?}");
    let mut promoted: Vec<String> = promotions(steps).into_iter().flatten().collect();
    promoted.sort();
    assert_eq!(promoted, ["gpu-01", "gpu-02", "gpu-03", "gpu-04", "gpu-05", "gpu-06"], "{steps:#?}");
    for (wave, _, _) in WAVES {
        assert_eq!(starts(&format!("fleet: wave {wave} runs")), 1, "{wave}: {steps:#?}");
        assert_eq!(starts(&format!("fleet: wave {wave} baked")), 1, "{wave}: {steps:#?}");
    }
    assert_eq!(steps.iter().filter(|c| c.message.contains("is released: every wave passed")).count(), 1);
    for w in steps.windows(2) {
        assert_ne!(w[0].record, w[1].record, "a commit that changes nothing: {:#?}", w[1]);
    }
}

/// What the sampler saw of a rollout from `from` to `to`: within each wave never more hosts
/// down or applying at once than its `max_unavailable`; no host of a wave left `from` before
/// every host of the wave before it had served `to` for the bake.
fn waves_respected(seen: &Timeline, from: &str, to: &str) {
    let mut prev_on: Option<Instant> = None;
    for (wave, hosts, max) in WAVES {
        let (most, when) = seen.max_unavailable(hosts);
        assert!(most <= max, "wave {wave}: {most} hosts unavailable at once (max {max}): {when:#?}");
        let left = hosts
            .iter()
            .map(|h| seen.first_left(h, from).unwrap_or_else(|| panic!("{h} never seen leaving {from}")))
            .min()
            .unwrap();
        if let Some(on) = prev_on {
            let gap = left.saturating_duration_since(on);
            assert!(
                left > on && gap >= Duration::from_secs(BAKE),
                "wave {wave} started {gap:?} after the wave before it all served {to} (bake {BAKE} s)"
            );
        }
        let on = hosts.iter().map(|h| seen.first_on(h, to).unwrap_or_else(|| panic!("{h} never seen on {to}"))).max();
        prev_on = on;
    }
}

fn host_row<'a>(status: &'a Value, host: &str) -> &'a Value {
    status["hosts"]
        .as_array()
        .and_then(|a| a.iter().find(|h| h["host"] == host))
        .unwrap_or_else(|| panic!("no {host} in {status:#}"))
}

#[test]
fn a_revision_rolls_through_three_waves_baking_each_within_max_unavailable() {
    let _turn = turn();
    let (fleet, c1) = fleet_on_first_revision(FleetSetup::default());
    let sampler = fleet.sample(Duration::from_millis(50));
    let c2 = fleet.commit(&[(LLM_FILE, &fleet.llm(5).text())], "llm: steps 5");
    let pushed = Instant::now();
    let promoter = fleet.promote_watch("promoter");

    // A host of the last wave says what it waits for while the first waves take the revision.
    wait_for("gpu-05 to say the head waits for its promotion", ROLLOUT, || {
        let o = fleet.specd("gpu-05", &["status"]);
        let out = String::from_utf8_lossy(&o.stdout).to_string();
        out.contains(&format!("the head {} waits for this host's promotion", specd_spec::short(&c2))).then_some(out)
    })
    .unwrap();
    let done = fleet
        .wait_record("the rollout to complete", ROLLOUT, |r| r.state == RolloutState::Complete && r.released == c2);
    fleet.wait_all_run(&c2, CONVERGE);
    let took = pushed.elapsed();
    let seen = sampler.finish();
    drop(promoter);
    eprintln!("three waves of 3 s bakes: every host on the new revision {took:?} after the push");

    waves_respected(&seen, &c1, &c2);
    let log = fleet.record_log();
    one_commit_per_step(rollout_of(&log, &c2));
    assert!(done.waves.iter().all(|w| w.good == c2 && w.promoted.is_empty()), "{done:#?}");
    for n in fleet.names() {
        let history = fleet.history(&n);
        let tried: Vec<_> = history.iter().filter(|a| a.tried()).map(|a| a.commit.clone().unwrap()).collect();
        assert_eq!(tried, [c1.clone(), c2.clone()], "{n}: {history:#?}\n{}", fleet.journals(60));
    }
    let (code, st) = fleet.fleet_status();
    assert_eq!((code, &st["rollout"]["state"]), (0, &json!("complete")), "{st:#}");
    for n in fleet.names() {
        let row = host_row(&st, &n);
        assert_eq!((&row["standing"], &row["deploys"]), (&json!("good"), &json!(c2)), "{n}: {row}");
        assert_eq!(row["units"][0]["args_verified"], true, "{n}: {row}");
        assert!(row["units"][0]["accept_length"].as_f64().is_some(), "{n}: {row}");
    }
    fleet.shutdown().unwrap();
}

#[test]
fn a_revision_that_dies_of_cuda_oom_on_the_canary_halts_there_and_reaches_no_other_host() {
    let _turn = turn();
    let mut setup = FleetSetup::default();
    // The canary's GPU holds a draft of 6 tokens at most: steps 7 (8 tokens) does not fit.
    setup.host_mut("gpu-01").max_draft_tokens = Some(6);
    let (fleet, c1) = fleet_on_first_revision(setup);
    let c2 = fleet.commit(&[(LLM_FILE, &fleet.llm(7).text())], "llm: steps 7");
    let halted = fleet.promote_until("the rollout to halt", ROLLOUT, |r| r.state == RolloutState::Halted);

    let h = halted.halt.clone().unwrap();
    assert_eq!(
        (h.wave.as_str(), h.host.as_str(), h.unit.as_str(), h.by.as_str()),
        ("canary", "gpu-01", LLM, "promoter")
    );
    assert!(
        (h.gate == "no_deaths" && h.evidence.contains("cuda-oom")) || h.gate == "applied",
        "the gate and its evidence: {h:#?}"
    );
    assert_eq!(halted.target, c2);
    assert!(halted.waves.iter().all(|w| w.good == c1 && w.promoted.is_empty()), "{halted:#?}");
    // The canary is back on the first revision; no other host ever tried the second.
    fleet.wait_runs("gpu-01", &c1, CONVERGE);
    assert!(fleet.ever_applied("gpu-01", &c2));
    for n in fleet.names().iter().filter(|n| *n != "gpu-01") {
        assert!(!fleet.ever_applied(n, &c2), "{n} tried {c2}: {:?}", fleet.history(n));
        assert!(fleet.seen(n).on(&c1), "{n}: {:?}", fleet.seen(n));
    }
    // The halt is the last word until a new revision: another pass waits, and says why.
    let before = fleet.record_log().len();
    let pass = fleet.promote();
    assert!(pass["waits"].as_str().unwrap_or_default().contains("gpu-01"), "{pass}");
    assert_eq!(fleet.record_log().len(), before);
    let (code, st) = fleet.fleet_status();
    assert_eq!(
        (code, &st["rollout"]["state"], &st["rollout"]["halt"]["host"]),
        (1, &json!("halted"), &json!("gpu-01"))
    );
    // The canary's row names its last death.
    wait_for("the canary's last death in the fleet's status", CONVERGE, || {
        (host_row(&fleet.fleet_status().1, "gpu-01")["units"][0]["last_death"] == "cuda-oom").then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}: {:#}", fleet.fleet_status().1));
    let text = fleet.fleet_cmd(&["status"]);
    let out = String::from_utf8_lossy(&text.stdout);
    assert!(out.contains("HALTED") && out.contains("gpu-01"), "{out}");

    // A fixed revision starts a new rollout.
    let c3 = fleet.commit(&[(LLM_FILE, &fleet.llm(5).text())], "llm: steps 5");
    let pass = fleet.promote();
    let message = pass["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(&format!("roll out {}", specd_spec::short(&c3))) && message.contains("was halted"),
        "{pass}"
    );
    fleet.shutdown().unwrap();
}

#[test]
fn a_halt_in_a_wave_of_five_sends_the_failing_host_back_first_and_the_others_within_max_unavailable() {
    let _turn = turn();
    let mut setup = FleetSetup::default();
    // The last host of the wave has the smaller GPU: steps 7 (8 tokens) does not fit on it.
    setup.host_mut(SMALL).max_draft_tokens = Some(6);
    let (fleet, c1) = fleet_with(setup, &canary_then_the_rest(BAKE));
    let rest = ["gpu-02", "gpu-03", "gpu-04", "gpu-05", SMALL];
    let sampler = fleet.sample(Duration::from_millis(50));
    let c2 = fleet.commit(&[(LLM_FILE, &fleet.llm(7).text())], "llm: steps 7");
    let promoter = fleet.promote_watch("promoter");
    let back = fleet.wait_record("every host of the wave sent back", ROLLOUT, |r| {
        r.state == RolloutState::Halted && r.wave("rest").is_some_and(|w| w.promoted.is_empty())
    });
    for n in rest {
        fleet.wait_runs(n, &c1, CONVERGE);
    }
    let seen = sampler.finish();
    drop(promoter);

    // What the hosts did: never more than two of the wave unavailable at once, the halt's
    // sending back included.
    let log = fleet.record_log();
    let (most, when) = seen.max_unavailable(&rest);
    assert!(most <= 2, "wave rest: {most} hosts unavailable at once (max 2): {when:#?}\nrecord log: {log:#?}");
    let h = back.halt.clone().unwrap();
    assert_eq!((h.wave.as_str(), h.host.as_str(), h.unit.as_str()), ("rest", SMALL, LLM), "{h:#?}");
    assert!((h.gate == "no_deaths" && h.evidence.contains("cuda-oom")) || h.gate == "applied", "{h:#?}");
    // The failing host went back first, alone; the others, promoted before it (by name, two at
    // a time), stayed on the target and went back in later steps, the halt named throughout.
    let from = log.iter().position(|c| c.message.starts_with("fleet: halt ")).expect("a halt in the record's log");
    let halted = &log[from].record;
    let on_target: Vec<&str> = halted.wave("rest").unwrap().promoted.iter().map(|p| p.host.as_str()).collect();
    assert_eq!(on_target, ["gpu-02", "gpu-03", "gpu-04", "gpu-05"], "{:#?}", log[from]);
    let sent: Vec<&RecordCommit> = log[from + 1..].iter().filter(|c| c.message.starts_with("fleet: send ")).collect();
    assert!(sent.len() >= 2, "two at a time at most, over several steps: {:#?}", &log[from..]);
    assert!(log[from..].iter().all(|c| c.record.halt.as_ref() == Some(&h)), "{:#?}", &log[from..]);
    // Every one tried the target (and runs the first revision again: waited for above).
    for n in rest {
        assert!(fleet.ever_applied(n, &c2), "{n} never tried {c2}: {:?}", fleet.history(n));
    }
    assert_eq!(back.wave("canary").unwrap().good, c2, "the canary baked it and keeps it");
    let (code, st) = fleet.fleet_status();
    assert_eq!((code, &st["rollout"]["halt"]["host"]), (1, &json!(SMALL)), "{st:#}");
    fleet.shutdown().unwrap();
}

#[test]
fn a_revision_that_halves_the_accept_length_on_one_host_is_halted_by_the_accept_gate() {
    let _turn = turn();
    let (fleet, c1) = fleet_on_first_revision(FleetSetup::default());
    let before = fleet.status("gpu-02")["speculation"]["measured"]["accept_length"].as_f64().unwrap();
    // gpu-02's server accepts far fewer drafted tokens with the new revision.
    let halved = format!("{:.2}", before / 2.0);
    let c2 = fleet.commit(
        &[(LLM_FILE, &fleet.llm(5).env_on("gpu-02", "SPECD_STANDIN_ACCEPT_LENGTH", &halved).text())],
        "llm: steps 5",
    );
    let halted = fleet.promote_until("the rollout to halt", ROLLOUT, |r| r.state == RolloutState::Halted);

    let h = halted.halt.clone().unwrap();
    assert_eq!(
        (h.wave.as_str(), h.host.as_str(), h.unit.as_str(), h.gate.as_str()),
        ("early", "gpu-02", LLM, "accept_length"),
        "{h:#?}"
    );
    assert!(h.evidence.contains("the previous revision's"), "{h:#?}");
    // The canary baked it and keeps it; gpu-02 is back; the last wave never saw it.
    assert_eq!(halted.wave("canary").unwrap().good, c2);
    assert_eq!(halted.wave("early").unwrap().good, c1);
    fleet.wait_runs("gpu-02", &c1, CONVERGE);
    assert!(fleet.seen("gpu-01").on(&c2));
    for (_, hosts, _) in &WAVES[2..] {
        for n in *hosts {
            assert!(!fleet.ever_applied(n, &c2), "{n} tried {c2}");
        }
    }
    let (code, st) = fleet.fleet_status();
    assert_eq!((code, &st["rollout"]["halt"]["gate"]), (1, &json!("accept_length")), "{st:#}");
    fleet.shutdown().unwrap();
}

/// The starts (from `history --json`) of host `name` of revision `commit`: each start's whole
/// time and its phases, in ms.
fn starts_of(fleet: &Hosts, name: &str, commit: &str) -> Vec<(u64, BTreeMap<String, u64>)> {
    let out = fleet.specd(name, &["history", "--json"]);
    let all: Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", crate::common::text(&out)));
    all.as_array()
        .unwrap()
        .iter()
        .filter(|h| h["source"]["commit"] == commit && h["startup"].is_object())
        .map(|h| {
            let s = &h["startup"];
            let phases = s["phases"].as_array().unwrap().iter();
            (
                s["ms"].as_u64().unwrap(),
                phases.map(|p| (p["phase"].as_str().unwrap().to_string(), p["ms"].as_u64().unwrap())).collect(),
            )
        })
        .collect()
}

#[test]
fn a_revision_that_doubles_the_start_up_on_one_host_is_halted_by_the_startup_gate() {
    let _turn = turn();
    // Every server loads for 2 s (a start long enough that a busy machine's noise is a small part
    // of it); the gate holds a host's start to 1.5 × its start of the revision before.
    let gated = format!("{}    startup_within: {{of_previous: 1.5}}\n", fleet_file(BAKE));
    let slow = |f: &Hosts, steps| f.llm(steps).env("SPECD_STANDIN_LOAD_MS", "2000");
    let (fleet, c1) = fleet_with_llm(FleetSetup::default(), &gated, |f| slow(f, 3));
    // With the new revision gpu-02's server takes twice as long to load and to warm up.
    let doubled = "service: {environment: {SPECD_STANDIN_LOAD_MS: \"4000\", SPECD_STANDIN_WARMUP_MS: \"400\"}}";
    let c2 = fleet.commit(&[(LLM_FILE, &slow(&fleet, 5).on("gpu-02", doubled).text())], "llm: steps 5");
    let halted = fleet.promote_until("the rollout to halt", ROLLOUT, |r| r.state == RolloutState::Halted);

    let h = halted.halt.clone().unwrap();
    assert_eq!(
        (h.wave.as_str(), h.host.as_str(), h.unit.as_str(), h.gate.as_str()),
        ("early", "gpu-02", LLM, "startup_within"),
        "{h:#?}"
    );
    assert!(h.evidence.contains("× ") && h.evidence.contains("(the previous revision's)"), "{h:#?}");
    // The canary baked it and keeps it; gpu-02 is back; the last wave never saw it.
    assert_eq!(halted.wave("canary").unwrap().good, c2);
    assert_eq!(halted.wave("early").unwrap().good, c1);
    fleet.wait_runs("gpu-02", &c1, CONVERGE);
    for (_, hosts, _) in &WAVES[2..] {
        for n in *hosts {
            assert!(!fleet.ever_applied(n, &c2), "{n} tried {c2}");
        }
    }
    // What gpu-02's agent timed, by its server's own lines: the new start's weights and engine
    // phases twice the old ones', and each start's phases adding up to within 10 % of it.
    let (old, new) = (starts_of(&fleet, "gpu-02", &c1), starts_of(&fleet, "gpu-02", &c2));
    let (old, new) = (&old[0], &new[0]);
    eprintln!("gpu-02's start of c1: {old:?}; of c2: {new:?}");
    for (ms, phases) in [old, new] {
        let names: Vec<&str> = phases.keys().map(String::as_str).collect();
        assert_eq!(names, ["api", "engine", "process", "weights"], "{phases:?}");
        let sum: u64 = phases.values().sum();
        assert!(sum.abs_diff(*ms) * 10 <= *ms, "phases {phases:?} add up to {sum} ms of {ms} ms");
    }
    for p in ["weights", "engine"] {
        let ratio = new.1[p] as f64 / old.1[p] as f64;
        assert!((1.8..2.5).contains(&ratio), "{p}: {} ms then {} ms", old.1[p], new.1[p]);
    }
    let (code, st) = fleet.fleet_status();
    assert_eq!((code, &st["rollout"]["halt"]["gate"]), (1, &json!("startup_within")), "{st:#}");
    fleet.shutdown().unwrap();
}

#[test]
fn without_prometheus_nothing_advances_and_status_says_why_then_it_goes_on() {
    let _turn = turn();
    let (mut fleet, _c1) = fleet_on_first_revision(FleetSetup::default());
    let c2 = fleet.commit(&[(LLM_FILE, &fleet.llm(5).text())], "llm: steps 5");
    // Mid-rollout: the canary runs the new revision and its wave bakes.
    fleet.promote_until("the canary's wave to converge", ROLLOUT, |r| {
        r.wave("canary").is_some_and(|w| w.converged.is_some())
    });
    fleet.stop_prometheus();
    let url = fleet.prometheus_url();
    let before = fleet.record_log();
    for _ in 0..3 {
        let pass = fleet.promote();
        let why = pass["waits"].as_str().unwrap_or_default();
        assert!(why.contains("no evidence, nothing advances") && why.contains(&url), "{pass}");
    }
    let after = fleet.record_log();
    assert_eq!(after.last().unwrap().commit, before.last().unwrap().commit, "nothing written without evidence");
    let (code, st) = fleet.fleet_status();
    // Not halted, but it cannot tell: the hosts only Prometheus knows are not listed.
    assert_eq!(code, 2, "{st:#}");
    assert!(st["evidence"].as_str().is_some_and(|e| e.contains(&url)), "{st:#}");
    let listed: Vec<&str> = st["hosts"].as_array().unwrap().iter().filter_map(|h| h["host"].as_str()).collect();
    assert!(listed.contains(&"gpu-01"), "the promoted canary is listed: {st:#}");
    assert!(st["rollout"]["waits"].as_str().is_some_and(|w| w.contains("no evidence")), "{st:#}");
    // The hosts serve on, each on what it was given.
    assert!(fleet.seen("gpu-01").on(&c2) && fleet.seen("gpu-02").serving);

    fleet.start_prometheus();
    fleet.wait_scraped(Duration::from_secs(60));
    let done = fleet.promote_until("the rollout to complete", ROLLOUT, |r| r.state == RolloutState::Complete);
    assert_eq!(done.released, c2);
    fleet.wait_all_run(&c2, CONVERGE);
    fleet.shutdown().unwrap();
}

#[test]
fn two_promoters_at_once_write_one_commit_per_step_and_a_killed_one_is_taken_over() {
    let _turn = turn();
    let (fleet, c1) = fleet_on_first_revision(FleetSetup::default());
    let sampler = fleet.sample(Duration::from_millis(50));
    let c2 = fleet.commit(&[(LLM_FILE, &fleet.llm(5).text())], "llm: steps 5");
    let mut a = fleet.promote_watch("promoter-a");
    let mut b = fleet.promote_watch("promoter-b");
    // Both killed mid-way, in the middle of the second wave.
    fleet.wait_record("gpu-02 promoted", ROLLOUT, |r| r.wave("early").is_some_and(|w| !w.promoted.is_empty()));
    a.kill();
    b.kill();
    let mut c = fleet.promote_watch("promoter-c");
    fleet.wait_record("the rollout to complete", ROLLOUT, |r| r.state == RolloutState::Complete && r.released == c2);
    fleet.wait_all_run(&c2, CONVERGE);
    let seen = sampler.finish();
    c.kill();

    let log = fleet.record_log();
    let steps = rollout_of(&log, &c2);
    one_commit_per_step(steps);
    waves_respected(&seen, &c1, &c2);
    // Every commit a promoter said it wrote is in the record's history, and every commit of the
    // rollout was written by one of them: no write lost, none forced over another.
    let wrote = |out: String| -> Vec<String> {
        out.lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter_map(|v| v["wrote"].as_str().map(String::from))
            .collect()
    };
    // Two promoters that take the same step in the same second write the same commit (the
    // same parent, record, message, author and time): git keeps it once.
    let mut by: BTreeMap<String, &str> = BTreeMap::new();
    for (name, p) in [("a", &a), ("b", &b), ("c", &c)] {
        for commit in wrote(p.output()) {
            by.entry(commit).or_insert(name);
        }
    }
    let in_log: Vec<&str> = steps.iter().map(|s| s.commit.as_str()).collect();
    let mut said: Vec<&str> = by.keys().map(String::as_str).collect();
    said.sort();
    let mut logged = in_log.clone();
    logged.sort();
    assert_eq!(said, logged, "the promoters' writes against the record's history");
    assert!(by.values().any(|n| *n == "c"), "the new promoter went on: {by:?}");
    eprintln!(
        "steps written: a {}, b {}, c {}",
        by.values().filter(|n| **n == "a").count(),
        by.values().filter(|n| **n == "b").count(),
        by.values().filter(|n| **n == "c").count()
    );
    fleet.shutdown().unwrap();
}

#[test]
fn an_agent_down_holds_its_wave_counted_unavailable_until_it_is_back() {
    let _turn = turn();
    let (fleet, _c1) = fleet_on_first_revision(FleetSetup::default());
    fleet.prometheus().wait("gpu-05's agent scraped", "specd_host_info{host=\"gpu-05\"}", CONVERGE, |r| r.len() == 1);
    fleet.stop_agent("gpu-05");
    // Prometheus knows the host: its agent ran, was scraped and then went down.
    let inst = fleet.instance("gpu-05");
    fleet.prometheus().wait("gpu-05's agent down", &format!("up{{instance=\"{inst}\"}}"), CONVERGE, |r| {
        r.first().is_some_and(|(_, v)| *v == 0.0)
    });
    let c2 = fleet.commit(&[(LLM_FILE, &fleet.llm(5).text())], "llm: steps 5");
    let promotes_rest = |r: &Record| {
        r.wave("main").is_some_and(|w| ["gpu-04", "gpu-06"].iter().all(|h| w.promoted.iter().any(|p| p.host == *h)))
    };
    fleet.promote_until("gpu-04 and gpu-06 promoted", ROLLOUT, promotes_rest);
    // The wave waits for gpu-05, whose agent is down, counted against max_unavailable.
    let mut last = Value::Null;
    let waits = wait_for("the wave to wait for gpu-05 alone", ROLLOUT, || {
        last = fleet.promote();
        let why = last["waits"].as_str().unwrap_or_default().to_string();
        why.starts_with("wave main: 1 of 3 hosts unavailable (max_unavailable 2): gpu-05 (no evidence").then_some(why)
    })
    .unwrap_or_else(|e| panic!("{e}\nlast pass: {last}\nrecord log: {:#?}", fleet.record_log()));
    assert!(waits.contains("its agent is down"), "{waits}");
    let log = fleet.record_log();
    let main: Vec<Vec<String>> = promotions(rollout_of(&log, &c2))
        .into_iter()
        .filter(|p| p.iter().any(|h| ["gpu-04", "gpu-06"].contains(&h.as_str())))
        .collect();
    assert_eq!(
        main,
        [vec!["gpu-04".to_string()], vec!["gpu-06".to_string()]],
        "one at a time while gpu-05 counts unavailable"
    );
    assert!(fleet.record().unwrap().wave("main").unwrap().converged.is_none());
    let (code, st) = fleet.fleet_status();
    assert_eq!(code, 0);
    let row = host_row(&st, "gpu-05");
    assert_eq!(row["standing"], "no-evidence", "{row}");
    assert!(row["detail"].as_str().unwrap_or_default().contains("its agent is down"), "{row}");
    assert!(st["rollout"]["waits"].as_str().unwrap_or_default().contains("gpu-05"), "{st:#}");
    assert!(!fleet.ever_applied("gpu-05", &c2));

    fleet.start_agent("gpu-05");
    let done = fleet.promote_until("the rollout to complete", ROLLOUT, |r| r.state == RolloutState::Complete);
    assert_eq!(done.released, c2);
    fleet.wait_all_run(&c2, CONVERGE);
    fleet.shutdown().unwrap();
}

/// Agents that poll their remote once an hour (and look at everything as rarely): the
/// promoter's steps wake the hosts they move through each agent's `POST /poll` (found from
/// Prometheus's targets), and those hosts, and only those, deploy what the record gives them
/// within seconds rather than at their next poll.
#[test]
fn agents_that_poll_hourly_take_a_promotion_within_seconds_as_the_promoter_wakes_them() {
    let _turn = turn();
    let mut setup = FleetSetup::of(3);
    setup.poll_s = 3600;
    let text = "apiVersion: specd/v1\nkind: Fleet\nmetadata: {name: hourly}\nspec:\n  waves:\n    - {name: canary, hosts: [gpu-01], bake: 1h}\n    - {name: rest, hosts: [gpu-02, gpu-03], bake: 1h}\n";
    // The first record woke every host (each waited for one): all run the first commit.
    let (fleet, c1) = fleet_with(setup, text);
    let c2 = fleet.commit(&[(LLM_FILE, &fleet.llm(5).text())], "llm: steps 5");
    // Passes until one promotes gpu-01 (once Prometheus shows every host good on the first
    // commit); a step before it moves no host and wakes none.
    let step = wait_for("gpu-01's promotion", CONVERGE, || {
        let p = fleet.promote();
        let said = p["message"].as_str().unwrap_or_default().to_string();
        if said.contains("promote") {
            assert!(said.contains("to gpu-01 (wave canary"), "{p}");
            return Some(p);
        }
        assert_eq!(p["woken"], Value::Null, "{p}");
        None
    })
    .unwrap();
    assert_eq!(step["woken"], json!({"asked": 1, "answered": 1, "unreached": []}), "{step}");
    let woken = Instant::now();
    fleet.wait_runs("gpu-01", &c2, CONVERGE);
    eprintln!("gpu-01 polls hourly: ran the promoted commit {:?} after the promoter woke it", woken.elapsed());
    // Not woken, the others have not read the record since: they run the first commit and
    // know nothing of the second.
    for n in ["gpu-02", "gpu-03"] {
        let st = fleet.status(n);
        assert_eq!((&st["source"]["commit"], &st["sync"]), (&json!(c1), &json!("InSync")), "{n}: {st}");
        assert!(!st.to_string().contains(&c2), "{n} read the second commit without being woken: {st}");
    }
    fleet.shutdown().unwrap();
}
