//! A fleet on one machine: six hosts (each a systemd box with its own host name, state, units
//! and agent under the shipped sandbox) follow one git remote, and a real Prometheus scrapes
//! them all. The harness is `common::fleet`.

mod common;

use std::time::{Duration, Instant};

use serde_json::json;

use common::fleet::{FleetSetup, Hosts, JOB, LLM_FILE};
use common::{http_get, wait_for};

/// How long one host may take to deploy a commit, from the push (a poll every second, a
/// stand-in that loads in 200 ms; six at once on a small machine).
const CONVERGE: Duration = Duration::from_secs(90);

/// The host with the smaller GPU.
const SMALL: &str = "gpu-06";

#[test]
fn six_hosts_follow_one_remote_each_on_its_own_port_and_prometheus_sees_them_all() {
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
    assert!(String::from_utf8_lossy(&d.stdout).contains("cuda-oom"), "{}", common::text(&d));
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
    eprintln!("e2e_fleet: {:?} in all", t0.elapsed());
}
