//! The real HAProxy the load-balancer tests put in front of the servers (`specd_e2e::haproxy`):
//! its configuration checked before it starts, the agent's words and the HTTP checks seen in
//! its state, traffic through it counted, and a server run by a systemd box as one of its
//! backends.

use specd_e2e::engine_process::{EngineProcess, Personality};
use specd_e2e::haproxy::{Agent, Config, Haproxy, Server, Status};
use specd_e2e::traffic::{Load, Traffic};
use specd_e2e::{SystemdBox, bin_path, free_port};
use std::io::{BufRead, BufReader, Write};
use std::time::Duration;

const T: Duration = Duration::from_secs(10);

fn standin(p: Personality, port: u16) -> EngineProcess {
    let mut e = EngineProcess::standin(p, port, &[], &[("SPECD_STANDIN_TOKENS_PER_SEC", "400")]).unwrap();
    e.wait_ready(T).unwrap();
    e
}

#[test]
fn a_configuration_haproxy_refuses_fails_the_start_with_its_message() {
    let mut cfg = Config::new(vec![Server::new("a", free_port())]);
    cfg.backend_extra.push("no-such-keyword 1".into());
    let e = Haproxy::start(&cfg).err().expect("haproxy -c refuses it");
    let msg = format!("{e:#}");
    assert!(msg.contains("haproxy -c refused the configuration"), "{msg}");
    assert!(msg.contains("no-such-keyword"), "HAProxy's own message names the keyword: {msg}");
    assert!(msg.contains("backend llm_servers"), "the configuration is shown: {msg}");
}

/// The agent's words reach HAProxy's state: `drain` (given no new requests), `down` with a
/// reason, `ready up`; the HTTP check marks a stopped server down and a started one up.
#[test]
fn the_agents_words_and_the_health_check_show_in_haproxys_state() {
    let (pa, pb) = (free_port(), free_port());
    let a = standin(Personality::Vllm, pa);
    let _b = standin(Personality::Vllm, pb);
    let agent = Agent::start().unwrap();
    let h = Haproxy::start(&Config::new(vec![
        Server::new("a", pa).with_agent(agent.port()),
        Server::new("b", pb).with_agent(agent.port()),
    ]))
    .unwrap();
    assert!(h.config().contains("agent-send \"a\\n\""), "{}", h.config());
    h.wait_status("a", Status::Up, T).unwrap();
    h.wait_status("b", Status::Up, T).unwrap();
    specd_e2e::wait_until("HAProxy asking the agent about a and b", T, || agent.asked("a") > 0 && agent.asked("b") > 0)
        .unwrap();

    agent.set("a", "drain");
    let s = h.wait_status("a", Status::Drain, T).unwrap();
    assert_eq!(s.status_text, "DRAIN (agent)");
    assert_eq!(h.server("b").unwrap().status, Status::Up);
    agent.set("a", "down #specd stopping");
    let s = h.wait_status("a", Status::Down, T).unwrap();
    assert!(s.fields["last_agt"].contains("specd stopping"), "{:?}", s.fields);
    agent.set("a", "ready up");
    h.wait_status("a", Status::Up, T).unwrap();

    // The health check alone: the server gone, then back.
    let mut a = a;
    a.sigterm();
    a.wait_exit(T).unwrap();
    h.wait_status("a", Status::Down, T).unwrap();
    let _a = standin(Personality::Vllm, pa);
    h.wait_status("a", Status::Up, T).unwrap();
    assert!(h.log().contains("llm_servers/a is DOWN"), "{}", h.log());
}

/// A check URL per server: `{server}` in the path is the server's name, on the port the
/// server's check goes to.
#[test]
fn the_http_check_can_ask_a_url_of_each_server_on_another_port() {
    // A check endpoint answering 200 for /lb/a only.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let check_port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for c in l.incoming().flatten() {
            let mut line = String::new();
            let _ = BufReader::new(&c).read_line(&mut line);
            let code = if line.starts_with("GET /lb/a ") { "200 OK" } else { "503 Service Unavailable" };
            let _ = (&c).write_all(format!("HTTP/1.0 {code}\r\nContent-Length: 0\r\n\r\n").as_bytes());
        }
    });
    let (pa, pb) = (free_port(), free_port());
    let (_a, _b) = (standin(Personality::Vllm, pa), standin(Personality::Vllm, pb));
    let mut cfg = Config::new(vec![
        Server::new("a", pa).with_check_port(check_port),
        Server::new("b", pb).with_check_port(check_port),
    ]);
    cfg.check_path = "/lb/{server}".into();
    let h = Haproxy::start(&cfg).unwrap();
    h.wait_status("a", Status::Up, T).unwrap();
    let b = h.wait_status("b", Status::Down, T).unwrap();
    assert_eq!(b.fields["check_code"], "503", "{:?}", b.fields);
}

/// Streaming completions through HAProxy to two servers: every request counted, all succeed,
/// both servers take their share, at least 20 a second.
#[test]
fn traffic_through_haproxy_is_counted_request_by_request() {
    let (pa, pb) = (free_port(), free_port());
    let (_a, _b) = (standin(Personality::Sglang, pa), standin(Personality::Sglang, pb));
    let h = Haproxy::start(&Config::new(vec![Server::new("a", pa), Server::new("b", pb)])).unwrap();
    h.wait_status("a", Status::Up, T).unwrap();
    h.wait_status("b", Status::Up, T).unwrap();
    let t = Traffic::start(Load::new(h.port(), Personality::Sglang.api()));
    t.wait_successes(100, Duration::from_secs(30)).unwrap();
    let s = t.stop();
    println!("{s}");
    assert_eq!(s.failed_total(), 0, "{s}");
    assert_eq!(s.sent, s.succeeded, "{s}");
    assert!(s.rate() >= 20.0, "{s}");
    let (a, b) = (h.server("a").unwrap().total, h.server("b").unwrap().total);
    assert_eq!(a + b, s.sent, "HAProxy counted {a} + {b}: {s}");
    assert!(a > 0 && b > 0, "{a} {b}");
}

/// A server a systemd box runs is reachable from HAProxy on the host (the box shares the
/// host's network), and traffic through it succeeds.
#[test]
fn a_server_in_a_systemd_box_is_a_backend() {
    let b = SystemdBox::boot().unwrap_or_else(|e| panic!("cannot boot the systemd box: {e:#}"));
    let port = free_port();
    b.write_file(
        "/etc/systemd/system/llm.service",
        format!(
            "[Service]\nExecStart={} vllm serve /m --port {port}\nEnvironment=SPECD_STANDIN_LOAD_MS=0\n",
            bin_path("specd-standin").display()
        ),
    )
    .unwrap();
    b.systemctl_check(&["daemon-reload"]).unwrap();
    b.systemctl_check(&["start", "llm.service"]).unwrap();
    let h = Haproxy::start(&Config::new(vec![Server::new("boxed", port)])).unwrap();
    h.wait_status("boxed", Status::Up, T).unwrap_or_else(|e| panic!("{e:#}\n{}", b.journal("llm.service").unwrap()));
    let t = Traffic::start(Load::new(h.port(), Personality::Vllm.api()));
    t.wait_successes(10, T).unwrap();
    let s = t.stop();
    assert_eq!(s.failed_total(), 0, "{s}");
    assert!(b.journal("llm.service").unwrap().contains("POST /v1/completions HTTP/1.1\" 200"));
    h.stop().unwrap();
    b.shutdown().unwrap();
}
