//! No request lost to a change: a real HAProxy (Debian's 2.6, a plain process of the test) in
//! front of two units the agent runs in a box (the vLLM stand-in, which abandons its requests in
//! flight at SIGTERM, as vLLM does by default), streaming completions sent through it
//! continuously (at least 20 a second), every request counted (`specd_e2e::traffic`).
//!
//! Both units are changed one after the other by commits (their `num_steps`). With HAProxy asking
//! the agent (agent-check, or an HTTP check of `/serving/<unit>`), every apply tells it `drain`,
//! waits until it saw it and the server holds no request, and only then stops the server: no
//! request fails, no stop ends in SIGKILL. The same load against the same change with HAProxy
//! checking only the servers' own `/health` (today's path) loses the requests the stopped server
//! held; both are counted and printed. A unit nothing polls says so in its apply's output.

use std::time::Duration;

use serde_json::Value;
use specd_e2e::haproxy::{Config, Haproxy, Server, Status};
use specd_e2e::traffic::{Api, Load, Summary, Traffic};

use crate::common::*;

const UNITS: [&str; 2] = ["llm-a.service", "llm-b.service"];
const T: Duration = Duration::from_secs(120);

/// A vLLM stand-in on `port` with ngram speculation of `steps`, its drain budget 8 s.
fn spec(standin: &str, unit: &str, port: u16, steps: u32) -> String {
    specd_e2e::vllm_lb_spec(standin, unit, port, steps)
}

/// How HAProxy learns what a unit is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Asks {
    /// Its agent-check, answered by the agent (and the servers' own `/health`).
    AgentCheck,
    /// An HTTP check of the agent's `GET /serving/<unit>` alone.
    HttpCheck,
    /// Only the servers' own `/health`: today's path.
    Nothing,
}

/// A unit's spec on a port with `num_steps`.
type SpecOf = Box<dyn Fn(&str, u16, u32) -> String>;

/// The agent in a box running both units, and HAProxy in front of them.
struct Rig {
    f: Fleet,
    ports: [u16; 2],
    h: Haproxy,
    spec: SpecOf,
}

fn commit(f: &Fleet, unit: &str, text: &str, msg: &str) {
    std::fs::write(f.repo.join("specs").join(format!("{unit}.yaml")), text).unwrap();
    git(&f.repo, &["add", "-A"]);
    git(&f.repo, &["commit", "-q", "-m", msg]);
}

fn state(f: &Fleet, unit: &str) -> Value {
    let path = format!("/var/lib/specd/units/{unit}.json");
    f.e.b.read_to_string(&path).ok().and_then(|t| serde_json::from_str(&t).ok()).unwrap_or_default()
}

/// Until `unit` has `n` entries in its history, none in progress, and its load balancers are
/// told ready.
fn wait_applied(f: &Fleet, unit: &str, n: usize) -> Value {
    let told = format!("/run/specd/serving/{unit}.json");
    wait_for(&format!("{n} applies of {unit}, told ready"), T, || {
        let st = state(f, unit);
        let ready = f.e.b.read_to_string(&told).is_ok_and(|t| t.contains("\"state\":\"ready\""));
        (st["in_progress"].is_null() && st["history"].as_array().is_some_and(|h| h.len() >= n) && ready).then_some(st)
    })
    .unwrap_or_else(|e| panic!("{e}\nagent journal:\n{}", f.e.b.journal(AGENT).unwrap_or_default()))
}

impl Rig {
    /// The vLLM stand-in.
    fn new(asks: Asks) -> Rig {
        let f = Fleet::new();
        let standin = f.e.standin.clone();
        Rig::with(asks, f, Box::new(move |unit, port, steps| spec(&standin, unit, port, steps)))
    }

    fn with(asks: Asks, f: Fleet, spec: SpecOf) -> Rig {
        Rig::with_checks(asks, f, spec, |c| c)
    }

    /// As [`Rig::with`], HAProxy's configuration passed through `checks`.
    fn with_checks(asks: Asks, f: Fleet, spec: SpecOf, checks: impl FnOnce(Config) -> Config) -> Rig {
        let ports = [free_port(), free_port()];
        let agent_check = free_port();
        f.e.b
            .write_file(
                "/run/agent.yaml",
                format!("load_balancer: {{agent_check: 127.0.0.1:{agent_check}, http_fall: 2}}\n"),
            )
            .unwrap();
        for (unit, port) in UNITS.iter().zip(ports) {
            commit(&f, unit, &spec(unit, port, 3), "steps 3");
        }
        f.run_agent(&f.repo.display().to_string(), "", "");
        for unit in UNITS {
            wait_applied(&f, unit, 1);
        }
        let servers = UNITS
            .iter()
            .zip(ports)
            .map(|(unit, port)| {
                let s = Server::new(unit.trim_end_matches(".service"), port);
                match asks {
                    Asks::AgentCheck => s.with_agent(agent_check),
                    Asks::HttpCheck => s.with_check_port(f.listen),
                    Asks::Nothing => s,
                }
            })
            .collect();
        let mut cfg = checks(Config::new(servers));
        if asks == Asks::HttpCheck {
            cfg.check_path = "/serving/{server}".into();
        }
        let h = Haproxy::start(&cfg).unwrap_or_else(|e| panic!("{e:#}"));
        for unit in UNITS {
            h.wait_status(unit.trim_end_matches(".service"), Status::Up, T).unwrap();
        }
        Rig { f, ports, h, spec }
    }

    /// The stand-in's load through HAProxy.
    fn load(&self) -> Load {
        load_through(&self.h)
    }

    /// Both units changed one after the other (`num_steps` 3 → 4) under streaming `load` through
    /// HAProxy; the traffic's sum and each apply's last history entry.
    fn roll(&self, asks: Asks, load: Load) -> (Summary, Vec<Value>) {
        let t = Traffic::start(load);
        t.wait_successes(40, T).unwrap();
        let mut applied = Vec::new();
        for (unit, port) in UNITS.iter().zip(self.ports) {
            commit(&self.f, unit, &(self.spec)(unit, port, 4), "steps 4");
            let st = wait_applied(&self.f, unit, 2);
            applied.push(st["history"].as_array().unwrap().last().unwrap().clone());
            t.wait_successes(40, T).unwrap();
        }
        let s = t.stop();
        println!("{asks:?}: {s}");
        (s, applied)
    }

    fn agent_said(&self) -> String {
        self.f.e.b.journal(AGENT).unwrap_or_default()
    }
}

fn applied_each(applied: &[Value], said: &str) {
    for a in applied {
        assert_eq!(a["outcome"], "applied", "{a}\n{said}");
        // Stopped by its SIGTERM, not by systemd's SIGKILL after TimeoutStopSec.
        assert!(a["stop_verdict"].is_null(), "{a}");
    }
}

/// HAProxy asking the agent by agent-check: both changes lose no request and end no stop in
/// SIGKILL; each apply said that HAProxy saw drain. The same change with HAProxy checking only
/// the servers (today's path) loses requests: counted and printed.
#[test]
fn a_change_behind_haproxy_asking_the_agent_loses_no_request_and_today_s_path_does() {
    let r = Rig::new(Asks::AgentCheck);
    let (s, applied) = r.roll(Asks::AgentCheck, r.load());
    let said = r.agent_said();
    applied_each(&applied, &said);
    assert!(said.matches("1 load balancer (127.0.0.1) saw drain after").count() >= 2, "{said}");
    assert_eq!(s.failed_total(), 0, "{s}");
    assert!(s.rate() >= 20.0, "the load the issue asks for: {s}");
    // The other server serves meanwhile: no outage a user would see.
    assert!(s.longest_gap < Duration::from_secs(1), "{s}");
    drop(r);

    let today = Rig::new(Asks::Nothing);
    let (t, applied) = today.roll(Asks::Nothing, today.load());
    let said = today.agent_said();
    // The server keeps taking requests while it drains (its /health stays 200, as vLLM's does):
    // its stop runs into TimeoutStopSec and systemd kills it with requests in flight, which
    // specd's history says.
    for a in &applied {
        assert_eq!(a["outcome"], "applied", "{a}\n{said}");
    }
    let killed: Vec<&str> = applied.iter().filter_map(|a| a["stop_verdict"].as_str()).collect();
    assert!(killed.iter().any(|v| v.contains("stopped by SIGKILL after TimeoutStopSec")), "{applied:?}");
    assert!(
        said.matches("no load balancer polls this unit: nothing keeps traffic away during the stop").count() >= 2,
        "{said}"
    );
    println!(
        "agent-check: {} sent, {} failed, longest gap {:.2} s; today's path: {} sent, {} failed {:?}, longest gap {:.2} s; {killed:?}",
        s.sent,
        s.failed_total(),
        s.longest_gap.as_secs_f64(),
        t.sent,
        t.failed_total(),
        t.failed,
        t.longest_gap.as_secs_f64()
    );
    assert!(t.failed_total() > 0, "today's path lost nothing: {t}");
}

/// HAProxy's HTTP check of the agent's `GET /serving/<unit>` (what nginx, Envoy, Traefik and cloud
/// load balancers do): the apply waits for its two failed checks in a row (`http_fall: 2`), and
/// no request is lost either.
#[test]
fn a_change_behind_an_http_check_of_the_agent_loses_no_request() {
    let r = Rig::new(Asks::HttpCheck);
    let (s, applied) = r.roll(Asks::HttpCheck, r.load());
    let said = r.agent_said();
    applied_each(&applied, &said);
    assert!(said.matches("1 load balancer (127.0.0.1 (HTTP check)) saw drain after").count() >= 2, "{said}");
    assert_eq!(s.failed_total(), 0, "{s}");
    assert!(s.rate() >= 20.0, "{s}");
    let (code, body) = http_get(r.f.listen, "/serving/llm-a.service").unwrap();
    assert_eq!((code, body.as_str()), (200, "ready\n"));
}

/// A one-shot `specd apply` of a unit nothing polls says that nothing keeps traffic away during
/// its stop; `specd status` shows what its load balancers are told.
#[test]
fn an_apply_of_a_unit_nothing_polls_says_nothing_keeps_traffic_away() {
    let e = Env::new();
    let port = free_port();
    let file = e.put("a.yaml", &spec(&e.standin, UNITS[0], port, 3));
    let o = e.specd(&["apply", "--config", "/run/agent.yaml", "-f", &file]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(!text(&o).contains("nothing keeps traffic away"), "nothing was stopped: {}", text(&o));
    let file = e.put("a.yaml", &spec(&e.standin, UNITS[0], port, 4));
    let o = e.specd(&["apply", "--config", "/run/agent.yaml", "-f", &file]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("no load balancer polls this unit: nothing keeps traffic away during the stop"),
        "{}",
        text(&o)
    );
    let o = e.specd(&["status"]);
    assert!(text(&o).contains("load balancers: told ready (for "), "{}", text(&o));
    assert!(text(&o).contains("no load balancer polled it in the last 5 min"), "{}", text(&o));
    e.b.shutdown().unwrap();
}

/// The real llama-server (two instances of the small GGUF, each its own draft model, one slot
/// each) behind HAProxy asking the agent by agent-check: a change of both units' draft length
/// (3 → 4) loses no request and ends no stop in SIGKILL. llama-server stops generating at its
/// SIGTERM: only the drain before it keeps the requests it holds.
#[test]
fn a_change_of_the_real_llama_server_behind_haproxy_asking_the_agent_loses_no_request() {
    let l = real_llama();
    let f = Fleet::with_engine_cache(&l.cache);
    let r = Rig::with(
        Asks::AgentCheck,
        f,
        Box::new(move |unit, port, steps| {
            let drafting = format!("  speculative: {{draft_model: {}, num_steps: {steps}}}\n", l.gguf);
            let tail = "  service: {timeout_start_sec: 120, timeout_stop_sec: 30, drain_timeout_sec: 20}\n";
            l.spec(unit, port, &drafting, "")
                .replace(
                    "metadata: {name: smol}",
                    &format!("metadata: {{name: {}}}", unit.trim_end_matches(".service")),
                )
                .replace("  service: {timeout_start_sec: 120, timeout_stop_sec: 30}\n", tail)
        }),
    );
    // Short completions: the engine runs on one thread of a small machine.
    let load = Load {
        clients: 6,
        max_tokens: 8,
        timeout: Duration::from_secs(20),
        ..Load::new(r.h.port(), Api::OpenAiCompletions)
    };
    let (s, applied) = r.roll(Asks::AgentCheck, load);
    let said = r.agent_said();
    applied_each(&applied, &said);
    assert!(said.matches("1 load balancer (127.0.0.1) saw drain after").count() >= 2, "{said}");
    println!(
        "real llama-server, agent-check: {} sent, {} failed, longest gap {:.2} s",
        s.sent,
        s.failed_total(),
        s.longest_gap.as_secs_f64()
    );
    assert_eq!(s.failed_total(), 0, "{s}");
}

/// Three hosts (boxes, each its agent answering HAProxy's agent-check for its `llm.service`)
/// behind one HAProxy with the example's check timings, a change rolled through a fleet's waves
/// one host at a time by the promoter: no request lost, no stop ending in SIGKILL, each host's
/// apply waited for HAProxy to see drain, and the promoter moved the next host only once
/// HAProxy took the previous one back (`specd_unit_awaiting_balancers`): two servers UP throughout.
#[test]
fn three_hosts_behind_one_haproxy_lose_no_request_through_a_fleet_rollout() {
    use crate::common::fleet::{FLEET_FILE, FleetSetup, Hosts, LLM, LLM_FILE};
    use specd_spec::fleet::RolloutState;
    let fleet = Hosts::boot(FleetSetup::of(3));
    let agent_checks: Vec<u16> = fleet.hosts().iter().map(|_| free_port()).collect();
    for (h, port) in fleet.hosts().iter().zip(&agent_checks) {
        let cfg = h.b.read_to_string("/run/agent.yaml").unwrap();
        h.b.write_file("/run/agent.yaml", format!("{cfg}load_balancer: {{agent_check: 127.0.0.1:{port}}}\n")).unwrap();
    }
    // Engines loading 8 s: HAProxy's shipped checks (`inter 2s fall 3 rise 2`) find a restarted
    // one DOWN, and send to it again only after two passing checks.
    let llm = |steps: u32| {
        let mut s = fleet.llm(steps).env("SPECD_STANDIN_LOAD_MS", "8000");
        for n in fleet.names() {
            s = s.on(&n, "service: {timeout_stop_sec: 20, drain_timeout_sec: 8}");
        }
        s.text()
    };
    let waves = "apiVersion: specd/v1\nkind: Fleet\nmetadata: {name: gpus}\nspec:\n  waves:\n    - {name: canary, hosts: [gpu-01], bake: 2s}\n    - {name: rest, hosts: ['gpu-*'], max_unavailable: 1, bake: 2s}\n";
    let c1 = fleet.commit(&[(LLM_FILE, &llm(3)), (FLEET_FILE, waves)], "llm: steps 3; a fleet");
    fleet.start_agents();
    wait_for("gpu-03 to wait for a promotion", T, || {
        let o = fleet.specd("gpu-03", &["status"]);
        String::from_utf8_lossy(&o.stdout).contains("waiting for a promotion").then_some(())
    })
    .unwrap();
    fleet.promote();
    fleet.wait_all_run(&c1, T);

    let servers = fleet
        .hosts()
        .iter()
        .zip(&agent_checks)
        .map(|(h, port)| Server::new(h.name(), h.server_port).with_agent_sending(*port, LLM))
        .collect();
    let h = Haproxy::start(&Config::new(servers).with_shipped_checks()).unwrap_or_else(|e| panic!("{e:#}"));
    for n in fleet.names() {
        h.wait_status(&n, Status::Up, T).unwrap();
    }
    let t = Traffic::start(load_through(&h));
    t.wait_successes(40, T).unwrap();
    let c2 = fleet.commit(&[(LLM_FILE, &llm(5))], "llm: steps 5");
    // The promoter moves the next host only once HAProxy took the previous one back: two of the
    // three always serve.
    let (fewest, most, promoter) = up_during(&h, || {
        let promoter = fleet.promote_watch("promoter");
        fleet.wait_record("the rollout to complete", Duration::from_secs(300), |r| {
            r.state == RolloutState::Complete && r.released == c2
        });
        fleet.wait_all_run(&c2, T);
        for n in fleet.names() {
            h.wait_status(&n, Status::Up, T).unwrap();
        }
        promoter
    });
    t.wait_successes(40, T).unwrap();
    let s = t.stop();
    drop(promoter);
    println!(
        "three hosts, fleet rollout, agent-check, shipped check timings: {s}; HAProxy held {fewest} to {most} servers UP"
    );
    assert!(fewest >= 2, "HAProxy held {fewest} servers UP during the rollout");
    for hb in fleet.hosts() {
        let said = hb.b.journal(AGENT).unwrap_or_default();
        let st: Value =
            serde_json::from_str(&hb.b.read_to_string(&format!("/var/lib/specd/units/{LLM}.json")).unwrap()).unwrap();
        let last = st["history"].as_array().unwrap().last().unwrap().clone();
        assert_eq!(
            (&last["outcome"], &last["source"]["commit"]),
            (&Value::from("applied"), &Value::from(c2.clone())),
            "{}: {last}",
            hb.name()
        );
        assert!(last["stop_verdict"].is_null(), "{}: {last}", hb.name());
        assert!(said.contains("1 load balancer (127.0.0.1) saw drain after"), "{}: {said}", hb.name());
    }
    assert_eq!(s.failed_total(), 0, "{s}");
    assert!(s.rate() >= 20.0, "{s}");
}

/// No agent runs: each `specd apply` answers HAProxy's agent-check itself while it runs. Both
/// units changed one after the other by one-shot applies under load: each apply stays until
/// HAProxy has read that its unit is ready again (HAProxy keeps an agent's last word when
/// nothing answers), so the second drain never leaves HAProxy with no server, and no request
/// fails.
#[test]
fn one_shot_applies_behind_haproxy_leave_it_sending_to_each_unit_again() {
    let (e, ports, agent_check) = one_shot_box();
    let apply = |i: usize, steps: u32| {
        let file = e.put(&format!("{i}-{steps}.yaml"), &spec(&e.standin, UNITS[i], ports[i], steps));
        let o = e.specd(&["apply", "--config", "/run/agent.yaml", "-f", &file]);
        assert!(o.status.success(), "{}", text(&o));
        text(&o)
    };
    for i in 0..2 {
        apply(i, 3);
    }
    let h = haproxy_asking(ports, agent_check);
    let load = load_through(&h);
    let t = Traffic::start(load);
    t.wait_successes(40, T).unwrap();
    for (i, unit) in UNITS.iter().enumerate() {
        let out = apply(i, 4);
        assert!(out.contains("1 load balancer (127.0.0.1) saw drain after"), "{out}");
        // What HAProxy shows once the apply has ended: the unit taking requests again.
        let name = unit.trim_end_matches(".service");
        let st = h.server(name).unwrap();
        assert_eq!(st.status, Status::Up, "{name} after its apply: {st:?}\n{out}");
    }
    t.wait_successes(40, T).unwrap();
    let s = t.stop();
    println!("one-shot applies, agent-check: {s}");
    assert_eq!(s.failed_total(), 0, "{s}");
    e.b.shutdown().unwrap();
}

/// The two units as replicas of one group (`rollout: {group: llm}`, `max_unavailable` 1 by
/// default), on the vLLM stand-in; `extra` added to the service's environment.
fn replica(standin: &str, unit: &str, port: u16, steps: u32, extra: &str) -> String {
    let text = spec(standin, unit, port, steps) + "  rollout: {group: llm}\n";
    text.replace("SPECD_STANDIN_TOKENS_PER_SEC: \"200\"", &format!("SPECD_STANDIN_TOKENS_PER_SEC: \"200\"{extra}"))
}

/// Both replicas changed by ONE commit (`num_steps` 3 → 4, then `extra` in the environment),
/// under the load; the traffic's sum.
fn one_commit(r: &Rig, load: Load, steps: u32, extra: &str, wait: impl Fn(&Fleet)) -> Summary {
    let t = Traffic::start(load);
    t.wait_successes(40, T).unwrap();
    let standin = r.f.e.standin.clone();
    for (unit, port) in UNITS.iter().zip(r.ports) {
        std::fs::write(
            r.f.repo.join("specs").join(format!("{unit}.yaml")),
            replica(&standin, unit, port, steps, extra),
        )
        .unwrap();
    }
    git(&r.f.repo, &["add", "-A"]);
    git(&r.f.repo, &["commit", "-q", "-m", "both replicas"]);
    wait(&r.f);
    t.wait_successes(40, T).unwrap();
    let s = t.stop();
    println!("one commit, both replicas (num_steps {steps}{extra}): {s}");
    s
}

/// Two replicas of a group behind HAProxy asking the agent, changed by one commit: the agent rolls
/// them one at a time (the second waits until the first serves again), no request fails, no stop
/// ends in SIGKILL. Then a change of both that dies of CUDA OOM: the first replica to take it is
/// rolled back, and the roll stops there: the other is never stopped (its MainPID stays).
#[test]
fn replicas_changed_by_one_commit_roll_one_at_a_time_and_a_failing_change_stops_the_roll() {
    let f = Fleet::new();
    let standin = f.e.standin.clone();
    let r = Rig::with(Asks::AgentCheck, f, Box::new(move |unit, port, steps| replica(&standin, unit, port, steps, "")));
    let s = one_commit(&r, r.load(), 4, "", |f| {
        for unit in UNITS {
            wait_applied(f, unit, 2);
        }
    });
    let said = r.agent_said();
    let applied: Vec<Value> =
        UNITS.iter().map(|u| state(&r.f, u)["history"].as_array().unwrap().last().unwrap().clone()).collect();
    applied_each(&applied, &said);
    assert_eq!(s.failed_total(), 0, "{s}");
    assert!(s.rate() >= 20.0, "{s}");
    assert!(s.longest_gap < Duration::from_secs(1), "{s}");
    // The replica that waits asks again every second, its same plan logged once.
    let plans = said.lines().filter(|l| l.contains("reconciling") && l.contains("the spec changed")).count();
    assert_eq!(plans, 2, "{said}");

    let pids: Vec<u32> = UNITS.iter().map(|u| r.f.e.main_pid(u)).collect();
    let oom = ", SPECD_STANDIN_CUDA_OOM: \"1\"";
    let s = one_commit(&r, r.load(), 5, oom, |f| {
        wait_for("a replica rolled back and the other held", T, || {
            let st: Vec<Value> = UNITS.iter().map(|u| state(f, u)).collect();
            let rolled = st.iter().position(|s| {
                s["history"].as_array().and_then(|h| h.last()).is_some_and(|e| e["outcome"] == "rolled-back")
            })?;
            let held = r.agent_said().contains("held: the roll of group llm stopped");
            (held && st[rolled]["in_progress"].is_null()).then_some(())
        })
        .unwrap_or_else(|e| panic!("{e}\n{}", r.agent_said()));
    });
    let said = r.agent_said();
    let rolled = UNITS
        .iter()
        .position(|u| state(&r.f, u)["history"].as_array().unwrap().last().unwrap()["outcome"] == "rolled-back")
        .unwrap();
    let other = 1 - rolled;
    assert_eq!(r.f.e.main_pid(UNITS[other]), pids[other], "{} was stopped\n{said}", UNITS[other]);
    assert_eq!(state(&r.f, UNITS[other])["history"].as_array().unwrap().len(), 2, "{said}");
    assert_eq!(s.failed_total(), 0, "{s}");
    println!("CUDA OOM change: {} rolled back, {} never stopped; {s}", UNITS[rolled], UNITS[other]);
}

/// Two replicas behind HAProxy with the health check timings of `examples/haproxy.cfg` (`inter 2s
/// fall 3 rise 2`: a server its check found down is sent requests again only after two passing
/// checks, whatever the agent answers), each loading its model for 8 s (longer than `fall ×
/// inter`, as a real engine does: HAProxy marks it down while it loads), changed by one commit
/// under streaming load: the second replica is drained only once HAProxy sends to the first
/// again, so no request fails (none finds every server down or draining).
#[test]
fn replicas_behind_the_shipped_haproxy_check_timings_lose_no_request() {
    let f = Fleet::new();
    let standin = f.e.standin.clone();
    let spec = Box::new(move |unit: &str, port, steps| {
        let text = replica(&standin, unit, port, steps, "");
        text.replace("SPECD_STANDIN_LOAD_MS: \"500\"", "SPECD_STANDIN_LOAD_MS: \"8000\"")
    });
    let r = Rig::with_checks(Asks::AgentCheck, f, spec, Config::with_shipped_checks);
    assert!(r.h.config().contains("inter 2000ms fall 3 rise 2"), "{}", r.h.config());
    let t = Traffic::start(r.load());
    t.wait_successes(40, T).unwrap();
    for (unit, port) in UNITS.iter().zip(r.ports) {
        std::fs::write(r.f.repo.join("specs").join(format!("{unit}.yaml")), (r.spec)(unit, port, 4)).unwrap();
    }
    git(&r.f.repo, &["add", "-A"]);
    git(&r.f.repo, &["commit", "-q", "-m", "both replicas, 4 steps"]);
    for unit in UNITS {
        wait_applied(&r.f, unit, 2);
    }
    t.wait_successes(40, T).unwrap();
    let s = t.stop();
    let said = r.agent_said();
    println!("two replicas, shipped check timings, one commit: {s}");
    assert_eq!(s.failed_total(), 0, "{s}\n{said}");
    assert!(s.rate() >= 20.0, "{s}");
    for u in UNITS {
        assert!(runs_steps(&r.f, u, 4), "{u} not on the commit's spec\n{said}");
    }
}

/// Two replicas rolled by one commit while the agent is restarted in the middle of the roll (the
/// first replica's apply past its drain), then one replica rolled back by hand (`specd rollback`)
/// with the agent running: no request fails either time, and both replicas end on the spec each
/// was given.
#[test]
fn replicas_roll_through_an_agent_restart_and_a_rollback_by_hand_loses_no_request() {
    let f = Fleet::new();
    let standin = f.e.standin.clone();
    let r = Rig::with(Asks::AgentCheck, f, Box::new(move |unit, port, steps| replica(&standin, unit, port, steps, "")));
    let restarted = std::cell::Cell::new(false);
    let s = one_commit(&r, r.load(), 4, "", |f| {
        wait_for("a replica's apply past its drain", T, || {
            let phase = |u: &str| state(f, u)["in_progress"]["phase"].as_str().map(str::to_string);
            let past = |u: &str| phase(u).is_some_and(|p| !matches!(p.as_str(), "starting" | "Drain"));
            UNITS.iter().any(|u| past(u)).then_some(())
        })
        .unwrap_or_else(|e| panic!("{e}\n{}", f.e.b.journal(AGENT).unwrap_or_default()));
        f.e.b.systemctl_check(&["restart", AGENT]).unwrap();
        restarted.set(true);
        for unit in UNITS {
            wait_applied(f, unit, 2);
        }
    });
    assert!(restarted.get());
    let said = r.agent_said();
    assert_eq!(s.failed_total(), 0, "agent restarted mid-roll: {s}\n{said}");
    for u in UNITS {
        assert!(runs_steps(&r.f, u, 4), "{u} not on the commit's spec\n{said}");
        let stop = state(&r.f, u)["history"].as_array().unwrap().last().unwrap()["stop_verdict"].clone();
        assert!(!stop.to_string().contains("SIGKILL"), "{u}: {stop}");
    }

    // A rollback by hand of one replica, under load, the agent answering its load balancer.
    let t = Traffic::start(r.load());
    t.wait_successes(40, T).unwrap();
    let o = r.f.e.specd(&["rollback", UNITS[0], "--reason", "back to 3 steps"]);
    assert!(o.status.success(), "{}", text(&o));
    t.wait_successes(40, T).unwrap();
    let s = t.stop();
    println!("specd rollback of one replica under load: {s}");
    assert_eq!(s.failed_total(), 0, "rollback: {s}\n{}", text(&o));
    assert!(runs_steps(&r.f, UNITS[0], 3), "{}", text(&o));
    assert!(runs_steps(&r.f, UNITS[1], 4), "{}", text(&o));
}

/// Whether `unit`'s running server drafts `steps` tokens (its command line, as the kernel has it).
fn runs_steps(f: &Fleet, unit: &str, steps: u32) -> bool {
    let pid = f.e.main_pid(unit);
    let o = f.e.b.exec(&["cat", &format!("/proc/{pid}/cmdline")]);
    String::from_utf8_lossy(&o.stdout).contains(&format!("\"num_speculative_tokens\":{steps}"))
}

/// No agent: ONE `specd apply -f a -f b` of both replicas of a group behind HAProxy: the apply
/// reconciles both at once, and the second waits (said) until the first serves again; no request
/// fails.
#[test]
fn one_shot_apply_of_both_replicas_rolls_them_one_at_a_time() {
    let (e, ports, agent_check) = one_shot_box();
    let apply = |steps: u32| {
        let files: Vec<String> = (0..2)
            .map(|i| e.put(&format!("{i}-{steps}.yaml"), &replica(&e.standin, UNITS[i], ports[i], steps, "")))
            .collect();
        let o = e.specd(&["apply", "--config", "/run/agent.yaml", "-f", &files[0], "-f", &files[1]]);
        assert!(o.status.success(), "{}", text(&o));
        text(&o)
    };
    apply(3);
    let h = haproxy_asking(ports, agent_check);
    let load = load_through(&h);
    let t = Traffic::start(load);
    t.wait_successes(40, T).unwrap();
    let out = apply(4);
    t.wait_successes(40, T).unwrap();
    let s = t.stop();
    println!("one-shot apply of both replicas, agent-check: {s}");
    assert_eq!(s.failed_total(), 0, "{s}\n{out}");
    assert!(out.contains("(1 of 2 unavailable, max_unavailable 1)"), "no replica waited:\n{out}");
    e.b.shutdown().unwrap();
}

/// HAProxy in front of both units on `ports`, asking the agent-check on `agent_check`; each up.
fn haproxy_asking(ports: [u16; 2], agent_check: u16) -> Haproxy {
    let servers = UNITS
        .iter()
        .zip(ports)
        .map(|(u, p)| Server::new(u.trim_end_matches(".service"), p).with_agent(agent_check))
        .collect();
    let h = Haproxy::start(&Config::new(servers)).unwrap_or_else(|e| panic!("{e:#}"));
    for u in UNITS {
        h.wait_status(u.trim_end_matches(".service"), Status::Up, T).unwrap();
    }
    h
}

/// 16 clients of 50-token streams through `h` (a quarter of a second of decoding each at 200
/// tokens a second, about half a second a request with the rest): about 30 requests a second,
/// each server holding several at any time.
fn load_through(h: &Haproxy) -> Load {
    Load { clients: 16, max_tokens: 50, timeout: Duration::from_secs(3), ..Load::new(h.port(), Api::OpenAiCompletions) }
}

/// A box for one-shot commands behind HAProxy: two server ports, and `/run/agent.yaml` answering
/// HAProxy's agent-check on the third. Between commands nothing answers HAProxy, so an apply
/// cannot know it before it polls: the apply that bound the port itself waits for its first
/// polls (no settle time configured).
fn one_shot_box() -> (Env, [u16; 2], u16) {
    let e = Env::new();
    let ports = [free_port(), free_port()];
    let agent_check = free_port();
    e.b.write_file("/run/agent.yaml", format!("load_balancer: {{agent_check: 127.0.0.1:{agent_check}}}\n")).unwrap();
    (e, ports, agent_check)
}

/// The two replicas and their spare (`max_surge`): each its own unit and port.
const SURGE_UNITS: [&str; 3] = ["llm-a.service", "llm-b.service", "llm-s.service"];

/// A member of the group with a spare (`max_unavailable: 0, max_surge: 1`; `llm-s` the spare),
/// on the vLLM stand-in; `extra` added to the service's environment.
fn surge_member(standin: &str, unit: &str, port: u16, steps: u32, extra: &str) -> String {
    let spare = if unit == SURGE_UNITS[2] { ", spare: true" } else { "" };
    let text = spec(standin, unit, port, steps)
        + &format!("  rollout: {{group: llm, max_unavailable: 0, max_surge: 1{spare}}}\n");
    text.replace("SPECD_STANDIN_TOKENS_PER_SEC: \"200\"", &format!("SPECD_STANDIN_TOKENS_PER_SEC: \"200\"{extra}"))
}

/// The agent running two replicas and their spare, HAProxy in front of all three asking the
/// agent: the replicas up, the spare held stopped (`DOWN` in HAProxy).
struct SurgeRig {
    f: Fleet,
    ports: [u16; 3],
    h: Haproxy,
    /// Each member's engine loads for this long (ms).
    load_ms: u32,
}

impl SurgeRig {
    fn new() -> SurgeRig {
        SurgeRig::with(500, |c| c)
    }

    /// Engines loading for `load_ms`, HAProxy's configuration passed through `checks`.
    fn with(load_ms: u32, checks: impl FnOnce(Config) -> Config) -> SurgeRig {
        let f = Fleet::new();
        let ports = [free_port(), free_port(), free_port()];
        let agent_check = free_port();
        f.e.b
            .write_file("/run/agent.yaml", format!("load_balancer: {{agent_check: 127.0.0.1:{agent_check}}}\n"))
            .unwrap();
        surge_commit(&f, ports, (3, load_ms), "", "the group at 3 steps");
        f.run_agent(&f.repo.display().to_string(), "", "");
        for unit in &SURGE_UNITS[..2] {
            wait_applied(&f, unit, 1);
        }
        wait_spare_rests(&f, 1);
        let servers =
            SURGE_UNITS.iter().zip(ports).map(|(u, p)| Server::new(&name(u), p).with_agent(agent_check)).collect();
        let h = Haproxy::start(&checks(Config::new(servers))).unwrap_or_else(|e| panic!("{e:#}"));
        for u in &SURGE_UNITS[..2] {
            h.wait_status(&name(u), Status::Up, T).unwrap();
        }
        h.wait_status(&name(SURGE_UNITS[2]), Status::Down, T).unwrap();
        SurgeRig { f, ports, h, load_ms }
    }

    fn commit(&self, steps: u32, extra: &str, msg: &str) {
        surge_commit(&self.f, self.ports, (steps, self.load_ms), extra, msg);
    }

    fn said(&self) -> String {
        self.f.e.b.journal(AGENT).unwrap_or_default()
    }
}

/// The three specs changed by ONE commit.
fn surge_commit(f: &Fleet, ports: [u16; 3], (steps, load_ms): (u32, u32), extra: &str, msg: &str) {
    for (unit, port) in SURGE_UNITS.iter().zip(ports) {
        let text = surge_member(&f.e.standin, unit, port, steps, extra)
            .replace("SPECD_STANDIN_LOAD_MS: \"500\"", &format!("SPECD_STANDIN_LOAD_MS: \"{load_ms}\""));
        std::fs::write(f.repo.join("specs").join(format!("{unit}.yaml")), text).unwrap();
    }
    git(&f.repo, &["add", "-A"]);
    git(&f.repo, &["commit", "-q", "-m", msg]);
}

/// Until the spare has `n` entries in its history, none in progress, and is told down at rest.
fn wait_spare_rests(f: &Fleet, n: usize) -> Value {
    let unit = SURGE_UNITS[2];
    let told = format!("/run/specd/serving/{unit}.json");
    wait_for(&format!("{unit} applied {n} times, then at rest"), T, || {
        let st = state(f, unit);
        let rests = f.e.b.read_to_string(&told).is_ok_and(|t| t.contains("stopped while the group is at rest"));
        (st["in_progress"].is_null() && st["history"].as_array().is_some_and(|h| h.len() >= n) && rests).then_some(st)
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", f.e.b.journal(AGENT).unwrap_or_default()))
}

fn name(unit: &str) -> String {
    unit.trim_end_matches(".service").to_string()
}

/// HAProxy's own `show stat`, polled every 50 ms while `during` runs: the fewest and the most of
/// the group's servers it held `UP` at once.
fn up_during<T>(h: &Haproxy, during: impl FnOnce() -> T) -> (usize, usize, T) {
    let done = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        let poll = s.spawn(|| {
            let (mut fewest, mut most) = (usize::MAX, 0);
            while !done.load(std::sync::atomic::Ordering::SeqCst) {
                let up = h.servers().unwrap().iter().filter(|s| s.status == Status::Up).count();
                (fewest, most) = (fewest.min(up), most.max(up));
                std::thread::sleep(Duration::from_millis(50));
            }
            (fewest, most)
        });
        let out = during();
        done.store(true, std::sync::atomic::Ordering::SeqCst);
        let (fewest, most) = poll.join().unwrap();
        (fewest, most, out)
    })
}

/// Two replicas and a spare behind HAProxy asking the agent (`max_unavailable: 0, max_surge: 1`),
/// all three changed by one commit under load: the spare starts first with the new spec, each
/// replica stops only once HAProxy takes the spare, HAProxy's own `show stat` never shows fewer
/// than 2 servers UP during the change, no request fails, no stop ends in SIGKILL, and the spare
/// is held stopped again after. Then a change whose start fails on the spare: it is left stopped,
/// the roll stops there and neither replica is ever stopped; no request fails.
#[test]
fn with_a_spare_a_change_never_leaves_haproxy_fewer_servers_than_the_replicas() {
    let r = SurgeRig::new();
    let t = Traffic::start(load_through(&r.h));
    t.wait_successes(40, T).unwrap();
    let spare_before = r.h.server(&name(SURGE_UNITS[2])).unwrap().total;
    let (fewest, most, spare) = up_during(&r.h, || {
        r.commit(4, "", "the group at 4 steps");
        for unit in &SURGE_UNITS[..2] {
            wait_applied(&r.f, unit, 2);
        }
        wait_spare_rests(&r.f, 2)
    });
    t.wait_successes(40, T).unwrap();
    let s = t.stop();
    let said = r.said();
    println!("two replicas and a spare, one commit, agent-check: {s}; HAProxy held {fewest} to {most} servers UP");
    let applied: Vec<Value> = SURGE_UNITS[..2]
        .iter()
        .map(|u| state(&r.f, u)["history"].as_array().unwrap().last().unwrap().clone())
        .collect();
    applied_each(&applied, &said);
    applied_each(&[spare["history"].as_array().unwrap().last().unwrap().clone()], &said);
    assert!(!said.contains("SIGKILL"), "{said}");
    assert_eq!(s.failed_total(), 0, "{s}");
    assert!(s.rate() >= 20.0, "{s}");
    assert!(fewest >= 2, "HAProxy held {fewest} servers UP during the change\n{said}");
    assert_eq!(most, 3, "the spare was never UP in HAProxy\n{said}");
    let spare_now = r.h.server(&name(SURGE_UNITS[2])).unwrap();
    assert!(spare_now.total > spare_before, "the spare took no request: {spare_now:?}");
    assert_eq!(spare_now.status, Status::Down, "{spare_now:?}");
    assert!(said.contains("waiting: group llm: max_surge 1"), "no replica waited for the spare\n{said}");
    for u in &SURGE_UNITS[..2] {
        assert!(runs_steps(&r.f, u, 4), "{u} not on the commit's spec\n{said}");
    }

    // A change that dies of CUDA OOM on its start: the spare takes it first, and alone.
    let pids: Vec<u32> = SURGE_UNITS[..2].iter().map(|u| r.f.e.main_pid(u)).collect();
    let t = Traffic::start(load_through(&r.h));
    t.wait_successes(40, T).unwrap();
    r.commit(5, ", SPECD_STANDIN_CUDA_OOM: \"1\"", "the group at 5 steps, out of memory");
    wait_for("the spare's change failed and the roll held", T, || {
        let st = state(&r.f, SURGE_UNITS[2]);
        let failed = st["history"].as_array().and_then(|h| h.last()).is_some_and(|e| e["outcome"] == "failed");
        let held = r.said().contains("held: the roll of group llm stopped: llm-s.service's change failed");
        (failed && held && st["in_progress"].is_null()).then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", r.said()));
    t.wait_successes(40, T).unwrap();
    let s = t.stop();
    let said = r.said();
    println!("a change failing on the spare: {s}");
    assert_eq!(s.failed_total(), 0, "{s}");
    for (u, pid) in SURGE_UNITS[..2].iter().zip(&pids) {
        assert_eq!(r.f.e.main_pid(u), *pid, "{u} was stopped\n{said}");
        assert_eq!(state(&r.f, u)["history"].as_array().unwrap().len(), 2, "{u}\n{said}");
        assert!(runs_steps(&r.f, u, 4), "{u} left its running spec\n{said}");
        assert_eq!(r.h.server(&name(u)).unwrap().status, Status::Up, "{u}");
    }
    assert_eq!(r.f.e.main_pid(SURGE_UNITS[2]), 0, "the failed spare runs\n{said}");
}

/// Two replicas and a spare (`max_unavailable: 0, max_surge: 1`) behind HAProxy with the check
/// timings of `examples/haproxy.cfg` (`inter 2s fall 3 rise 2`), each engine loading for 8 s
/// (HAProxy marks a stopped one DOWN, and takes it back only after two passing checks): one
/// commit under load. No replica stops before HAProxy sends to the spare, the spare stops only
/// once HAProxy sends to the last replica again: HAProxy's `show stat` never holds fewer than 2
/// servers UP, and no request fails.
#[test]
fn with_a_spare_and_the_shipped_check_timings_haproxy_always_holds_two_servers_up() {
    let r = SurgeRig::with(8000, Config::with_shipped_checks);
    let t = Traffic::start(load_through(&r.h));
    t.wait_successes(40, T).unwrap();
    let (fewest, most, _) = up_during(&r.h, || {
        r.commit(4, "", "the group at 4 steps");
        for unit in &SURGE_UNITS[..2] {
            wait_applied(&r.f, unit, 2);
        }
        let spare = wait_spare_rests(&r.f, 2);
        // Until HAProxy has the spare DOWN again: its drain and stop are watched too.
        r.h.wait_status(&name(SURGE_UNITS[2]), Status::Down, T).unwrap();
        spare
    });
    t.wait_successes(40, T).unwrap();
    let s = t.stop();
    let said = r.said();
    println!(
        "two replicas and a spare, shipped check timings, one commit: {s}; HAProxy held {fewest} to {most} servers UP"
    );
    assert_eq!(s.failed_total(), 0, "{s}\n{said}");
    assert!(s.rate() >= 20.0, "{s}");
    assert!(fewest >= 2, "HAProxy held {fewest} servers UP during the change\n{said}");
    for u in &SURGE_UNITS[..2] {
        assert!(runs_steps(&r.f, u, 4), "{u} not on the commit's spec\n{said}");
    }
}

/// A unit whose spec is removed with `prune: true`, behind HAProxy asking the agent, under
/// streaming load: its prune tells HAProxy `drain`, waits until it saw it and the server holds
/// no request, and only then stops it: no request fails (it used to be told `down` and stopped at
/// once, abandoning the requests it held).
#[test]
fn a_unit_pruned_behind_haproxy_asking_the_agent_loses_no_request() {
    let r = Rig::new(Asks::AgentCheck);
    let cfg = r.f.e.b.read_to_string("/run/agent.yaml").unwrap();
    r.f.e.b.systemctl_check(&["stop", AGENT]).unwrap();
    r.f.e.b.write_file("/run/agent.yaml", format!("{cfg}prune: true\n")).unwrap();
    r.f.e.b.systemctl_check(&["start", AGENT]).unwrap();
    for unit in UNITS {
        r.h.wait_status(&name(unit), Status::Up, T).unwrap();
    }
    let t = Traffic::start(r.load());
    t.wait_successes(40, T).unwrap();
    std::fs::remove_file(r.f.repo.join("specs").join(format!("{}.yaml", UNITS[1]))).unwrap();
    git(&r.f.repo, &["add", "-A"]);
    git(&r.f.repo, &["commit", "-q", "-m", "retire llm-b"]);
    wait_for("llm-b to be pruned", T, || {
        let gone = r.f.e.b.read_file(&format!("/etc/systemd/system/{}", UNITS[1])).is_err();
        let stopped = r.f.e.b.prop(UNITS[1], "ActiveState").is_ok_and(|s| s == "inactive" || s == "failed");
        (gone && stopped).then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", r.agent_said()));
    t.wait_successes(40, T).unwrap();
    let s = t.stop();
    println!("a unit pruned behind HAProxy asking the agent: {s}");
    let said = r.agent_said();
    assert_eq!(s.failed_total(), 0, "{s}\n{said}");
    assert!(said.contains("1 load balancer (127.0.0.1) saw drain after"), "{said}");
    // Stopped by its SIGTERM with nothing in flight: it ended clean.
    assert_eq!(r.f.e.b.prop(UNITS[1], "Result").unwrap(), "success", "{said}");
}
