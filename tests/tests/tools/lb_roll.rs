//! What issue "no request lost to a change" asks of specd, done by hand without specd, to show
//! the harness sees the difference: two stand-in servers (plain processes) behind the real
//! HAProxy, whose agent-check a small agent of the test answers, and streaming completions
//! sent through HAProxy continuously (at least 20 a second), every one counted.
//!
//! Rolling both servers one at a time, each told to drain first (agent `drain`, HAProxy shows
//! it drained, the server's own count in flight reaches 0, then SIGTERM, start again, agent
//! `ready up`), loses no request and leaves no long gap. The same roll with SIGTERM straight
//! away loses the requests the server held (vLLM and llama-server do not finish them).

use specd_e2e::engine_process::{EngineProcess, Personality};
use specd_e2e::haproxy::{Agent, Config, Haproxy, Server, Status};
use specd_e2e::traffic::{Load, Summary, Traffic};
use specd_e2e::{free_port, wait_until};
use std::time::Duration;

const T: Duration = Duration::from_secs(15);

struct Fleet {
    p: Personality,
    servers: Vec<(String, u16, EngineProcess)>,
    agent: Agent,
    h: Haproxy,
    /// Each stop: the server, its exit status, whether it was killed.
    stops: Vec<(String, std::process::ExitStatus, bool)>,
}

fn start(p: Personality, port: u16) -> EngineProcess {
    // 16 tokens in 80 ms: four clients make about 50 requests a second.
    let env = [("SPECD_STANDIN_TOKENS_PER_SEC", "200"), ("SPECD_STANDIN_DRAIN_POLL_MS", "200")];
    let mut e = EngineProcess::standin(p, port, &[], &env).unwrap();
    e.wait_ready(T).unwrap();
    e
}

impl Fleet {
    fn new(p: Personality) -> Fleet {
        let agent = Agent::start().unwrap();
        let servers: Vec<(String, u16, EngineProcess)> = ["a", "b"]
            .iter()
            .map(|n| {
                let port = free_port();
                (n.to_string(), port, start(p, port))
            })
            .collect();
        let h = Haproxy::start(&Config::new(
            servers.iter().map(|(n, port, _)| Server::new(n, *port).with_agent(agent.port())).collect(),
        ))
        .unwrap();
        for (n, _, _) in &servers {
            h.wait_status(n, Status::Up, T).unwrap();
        }
        Fleet { p, servers, agent, h, stops: Vec::new() }
    }

    /// Stops server `i` and starts it again; with `drain`, tells HAProxy first and waits for
    /// the server to hold nothing.
    fn restart(&mut self, i: usize, drain: bool) {
        let (name, port) = (self.servers[i].0.clone(), self.servers[i].1);
        if drain {
            self.agent.set(&name, "drain");
            self.h.wait_status(&name, Status::Drain, T).unwrap();
            let e = &self.servers[i].2;
            wait_until(&format!("{name} to hold no request"), T, || {
                e.in_flight() == Some(0) && self.h.server(&name).is_ok_and(|s| s.current == 0)
            })
            .unwrap();
        }
        // As systemd stops it (TimeoutStopSec=5): without the drain, vLLM and llama-server
        // wait for the clients of the requests they gave up, and HAProxy keeps those
        // connections until its server timeout, so they are killed.
        let (status, killed) = self.servers[i].2.stop(Duration::from_secs(5));
        self.stops.push((name.clone(), status, killed));
        self.h.wait_status(&name, Status::Down, T).unwrap();
        self.servers[i].2 = start(self.p, port);
        if drain {
            // Up again for the health check, still drained for the agent.
            self.h.wait_status(&name, Status::Drain, T).unwrap();
            self.agent.set(&name, "ready up");
        }
        self.h.wait_status(&name, Status::Up, T).unwrap();
    }
}

/// Both servers rolled one at a time under the load; the traffic's sum, and the stops.
fn roll(p: Personality, drain: bool) -> (Summary, Vec<(String, std::process::ExitStatus, bool)>) {
    let mut f = Fleet::new(p);
    // A request the server holds fails after 3 s without a byte.
    let t = Traffic::start(Load { timeout: Duration::from_secs(3), ..Load::new(f.h.port(), p.api()) });
    t.wait_successes(50, T).unwrap();
    for i in 0..f.servers.len() {
        f.restart(i, drain);
        t.wait_successes(50, T).unwrap();
    }
    let s = t.stop();
    println!("{p:?}, {}: {s}; stops {:?}", if drain { "drained first" } else { "SIGTERM straight away" }, f.stops);
    (s, f.stops)
}

fn no_request_lost((s, stops): &(Summary, Vec<(String, std::process::ExitStatus, bool)>)) {
    assert_eq!(s.failed_total(), 0, "{s}");
    assert!(stops.iter().all(|(_, st, killed)| st.success() && !killed), "each server exited 0 by itself: {stops:?}");
    assert!(s.rate() >= 20.0, "the load the issue asks for: {s}");
    // Half the servers serve meanwhile: no outage a user would see.
    assert!(s.longest_gap < Duration::from_secs(1), "{s}");
}

#[test]
fn a_vllm_roll_that_drains_first_loses_no_request() {
    no_request_lost(&roll(Personality::Vllm, true));
}

#[test]
fn a_llama_server_roll_that_drains_first_loses_no_request() {
    no_request_lost(&roll(Personality::LlamaCpp, true));
}

#[test]
fn an_sglang_roll_that_drains_first_loses_no_request() {
    no_request_lost(&roll(Personality::Sglang, true));
}

/// vLLM (`--shutdown-timeout 0`) stops at once: the requests a server held when it got SIGTERM
/// never complete, and one that reaches it as it shuts down gets the 500 the real vLLM answers
/// then (`tests/fixtures/engines/vllm/real/sigterm-load.drain.json`).
#[test]
fn a_vllm_roll_without_the_drain_loses_the_requests_in_flight() {
    let (s, _) = roll(Personality::Vllm, false);
    assert!(s.failed_total() > 0, "{s}");
    // Their streams stopped: the clients gave up waiting; or the server was shutting down.
    let lost = |f: &specd_e2e::traffic::Failure| {
        f.kind() == "timeout"
            || matches!(f, specd_e2e::traffic::Failure::Status(500, body) if body.contains("cannot schedule new futures after shutdown"))
    };
    assert!(s.failures().all(|r| r.result.as_ref().is_err_and(lost)), "{s}");
    assert!(s.failures().any(|r| r.result.as_ref().is_err_and(|f| f.kind() == "timeout")), "{s}");
}

/// llama-server stops generating at once: the same loss.
#[test]
fn a_llama_server_roll_without_the_drain_loses_the_requests_in_flight() {
    let (s, _) = roll(Personality::LlamaCpp, false);
    assert!(s.failed_total() > 0, "{s}");
}
