//! A unit no load balancer polls, fed by clients all along (the SGLang stand-in, which keeps
//! taking new requests while it drains after SIGTERM, as SGLang does): with `service.drain_refuse_new`, a one-shot
//! apply closes its port to new connections (specd's nftables table, in the box's own network
//! namespace, never the host's), the requests in flight finish, and the stop ends without
//! SIGKILL; without it, the drain runs out its budget and systemd kills the server. An apply
//! killed in its drain leaves the rule; the unit's next apply removes it.

use std::time::Duration;

use serde_json::Value;
use specd_e2e::traffic::{Api, Load, Traffic};

use crate::common::*;

const UNIT: &str = "llm-a.service";
const T: Duration = Duration::from_secs(120);

/// The SGLang stand-in on `port` (200 tokens a second; at SIGTERM it drains without a time
/// limit and still takes new requests, as SGLang does): drain budget 8 s, TimeoutStopSec 15 s,
/// its port closed to new connections during the drain when `refuse`.
fn spec(e: &Env, port: u16, steps: u32, refuse: bool) -> String {
    let tail = format!(
        "  service:\n    timeout_stop_sec: 15\n    drain_timeout_sec: 8\n    drain_refuse_new: {refuse}\n    environment: {{SPECD_STANDIN_LOAD_MS: \"500\", SPECD_STANDIN_TOKENS_PER_SEC: \"200\", SPECD_STANDIN_DRAIN_POLL_MS: \"200\"}}\n"
    );
    specd_e2e::sglang_spec(&e.standin, UNIT, port, steps, &tail)
}

fn apply(e: &Env, file: &str, yaml: &str) -> String {
    let path = e.put(file, yaml);
    let o = e.specd(&["apply", "-f", &path]);
    assert!(o.status.success(), "{}", text(&o));
    text(&o)
}

/// The last entry of the unit's history.
fn last_apply(e: &Env) -> Value {
    let st: Value =
        serde_json::from_str(&e.b.read_to_string(&format!("/var/lib/specd/units/{UNIT}.json")).unwrap()).unwrap();
    st["history"].as_array().unwrap().last().unwrap().clone()
}

/// The box's nftables ruleset, and the host's.
fn ruleset(e: &Env) -> String {
    let o = e.b.exec(&["nft", "list", "ruleset"]);
    assert!(o.status.success(), "{}", text(&o));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn host_has_no_specd_table() {
    let o = std::process::Command::new("nft").args(["list", "tables"]).output().unwrap();
    let tables = String::from_utf8_lossy(&o.stdout);
    assert!(!tables.contains("specd"), "the host's own ruleset has specd's table: {tables}");
}

/// Clients inside the box's network: 16 at a time, 50 tokens each (about 0.3 s a request).
fn load(e: &Env, port: u16, max_tokens: u32) -> Load {
    Load {
        clients: 16,
        max_tokens,
        timeout: Duration::from_secs(3),
        net_ns: Some(e.b.net_ns()),
        ..Load::new(port, Api::OpenAiCompletions)
    }
}

#[test]
fn a_unit_fed_by_clients_with_no_load_balancer_drains_without_sigkill_only_when_its_port_refuses_new_connections() {
    let e = Env::with_private_network();
    let port = free_port();
    apply(&e, "a3.yaml", &spec(&e, port, 3, true));
    let t = Traffic::start(load(&e, port, 50));
    t.wait_successes(40, T).unwrap();

    let out = apply(&e, "a4.yaml", &spec(&e, port, 4, true));
    for line in [
        format!(
            "new connections to port {port} refused (nftables table inet specd) until the old instance has stopped"
        ),
        format!("no load balancer polls this unit; new connections to port {port} are refused until it has stopped"),
        "drained: no request in flight".to_string(),
        format!("new connections to port {port} accepted again"),
    ] {
        assert!(out.contains(&line), "{line}\n{out}");
    }
    assert!(!out.contains("after the drain budget"), "{out}");
    println!("with drain_refuse_new:\n{out}");
    let a = last_apply(&e);
    assert_eq!(a["outcome"], "applied", "{a}");
    assert!(a["stop_verdict"].is_null(), "stopped by SIGKILL: {a}\n{out}");
    assert!(!ruleset(&e).contains("drain_"), "{}", ruleset(&e));
    t.wait_successes(40, T).unwrap();

    // Without it: the clients keep the server busy through the drain and its stop.
    let out = apply(&e, "a5.yaml", &spec(&e, port, 5, false));
    assert!(out.contains("no load balancer polls this unit: nothing keeps traffic away during the stop"), "{out}");
    assert!(out.contains("requests still in flight after the drain budget; stopping anyway"), "{out}");
    let a = last_apply(&e);
    assert!(a["stop_verdict"].as_str().is_some_and(|v| v.contains("stopped by SIGKILL after TimeoutStopSec")), "{a}");
    println!("without it:\n{out}");
    let s = t.stop();
    println!("fed without a load balancer: {s}");
    host_has_no_specd_table();
    e.b.shutdown().unwrap();
}

/// A server listening on every address of both families (`host: "::"`), which specd reaches at
/// `[::1]`: its clients over IPv6 from the host itself (`::1`, where `localhost` leads first)
/// are refused during the drain as those over IPv4 are, while specd still reads its requests in
/// flight, and the stop ends without SIGKILL.
#[test]
fn a_server_on_both_families_refuses_new_connections_over_ipv6_from_the_host_itself_too() {
    let e = Env::with_private_network();
    let port = free_port();
    let dual = |steps| spec(&e, port, steps, true).replace("host: 127.0.0.1", "host: '::'");
    apply(&e, "a3.yaml", &dual(3));
    let over_v6 = Traffic::start(Load { addr: std::net::Ipv6Addr::LOCALHOST.into(), ..load(&e, port, 50) });
    let over_v4 = Traffic::start(Load { clients: 4, ..load(&e, port, 50) });
    over_v6.wait_successes(40, T).unwrap();
    over_v4.wait_successes(10, T).unwrap();

    let out = apply(&e, "a4.yaml", &dual(4));
    for line in [
        format!("no load balancer polls this unit; new connections to port {port} are refused until it has stopped"),
        "drained: no request in flight".to_string(),
        format!("new connections to port {port} accepted again"),
    ] {
        assert!(out.contains(&line), "{line}\n{out}");
    }
    assert!(!out.contains("after the drain budget"), "{out}");
    let a = last_apply(&e);
    assert_eq!(a["outcome"], "applied", "{a}");
    assert!(a["stop_verdict"].is_null(), "stopped by SIGKILL: {a}\n{out}");
    assert!(!ruleset(&e).contains("drain_"), "{}", ruleset(&e));
    over_v6.wait_successes(40, T).unwrap();
    println!("clients over IPv6: {}\nover IPv4: {}", over_v6.stop(), over_v4.stop());
    host_has_no_specd_table();
    e.b.shutdown().unwrap();
}

/// The agent, under the shipped unit's sandbox, closes the port as a one-shot apply does (nft
/// and specd's own read of the requests in flight need CAP_NET_ADMIN, which the unit keeps).
#[test]
fn the_agent_in_its_shipped_sandbox_refuses_new_connections_while_it_drains() {
    let f = Fleet::with_private_network();
    let e = &f.e;
    let port = free_port();
    f.commit(&[("llm.yaml", &spec(e, port, 3, true))], "steps 3");
    f.run_agent(f.repo.to_str().unwrap(), "", "");
    let applied = |n: usize| {
        let path = format!("/var/lib/specd/units/{UNIT}.json");
        wait_for(&format!("{n} applies of {UNIT}"), T, || {
            let st: Value = serde_json::from_str(&e.b.read_to_string(&path).ok()?).ok()?;
            (st["in_progress"].is_null() && st["history"].as_array()?.len() >= n).then_some(())
        })
        .unwrap_or_else(|err| panic!("{err}\nagent journal:\n{}", e.b.journal(AGENT).unwrap_or_default()));
    };
    applied(1);
    let t = Traffic::start(load(e, port, 50));
    t.wait_successes(40, T).unwrap();

    f.commit(&[("llm.yaml", &spec(e, port, 4, true))], "steps 4");
    applied(2);
    let journal = e.b.journal(AGENT).unwrap_or_default();
    let a = last_apply(e);
    assert_eq!(a["outcome"], "applied", "{a}\n{journal}");
    assert!(a["stop_verdict"].is_null(), "stopped by SIGKILL: {a}\n{journal}");
    for line in [
        format!(
            "new connections to port {port} refused (nftables table inet specd) until the old instance has stopped"
        ),
        "drained: no request in flight".to_string(),
        format!("new connections to port {port} accepted again"),
    ] {
        assert!(journal.contains(&line), "{line}\n{journal}");
    }
    assert!(!journal.contains("could not refuse"), "{journal}");
    assert!(!ruleset(e).contains("drain_"), "{}", ruleset(e));
    t.wait_successes(40, T).unwrap();
    println!("the agent's drain, fed without a load balancer: {}", t.stop());
    host_has_no_specd_table();
    f.e.b.shutdown().unwrap();
}

/// `specd apply` SIGKILLed while it drains: the rule stays; the next apply of the unit, even
/// one that changes nothing, removes it first.
#[test]
fn a_rule_left_by_an_apply_killed_in_its_drain_is_removed_by_the_next_apply() {
    let e = Env::with_private_network();
    let port = free_port();
    let old = spec(&e, port, 3, true);
    apply(&e, "a3.yaml", &old);
    // Long requests: the drain lasts its budget (8 s), time enough to kill the apply in it.
    let t = Traffic::start(Load { clients: 4, ..load(&e, port, 4000) });
    let path = e.put("a4.yaml", &spec(&e, port, 4, true));
    let mut child = e.b.command(&[&e.specd, "apply", "-f", &path]).spawn().unwrap();
    let chain = wait_for("the apply's rule", T, || ruleset(&e).contains("drain_llm_2da.service").then_some(()));
    chain.unwrap_or_else(|err| panic!("{err}\n{}", ruleset(&e)));
    let o = e.b.exec(&["pkill", "-KILL", "-f", &format!("specd apply -f {path}")]);
    assert!(o.status.success(), "{}", text(&o));
    let _ = child.wait();
    assert!(ruleset(&e).contains(&format!("tcp dport {port} ct state new")), "{}", ruleset(&e));
    t.stop();

    // The unit's old spec again: nothing to change, and the rule removed.
    let out = apply(&e, "a3.yaml", &old);
    assert!(
        out.contains(&format!("removed the rule an interrupted apply left refusing new connections to port {port}")),
        "{out}"
    );
    assert!(!ruleset(&e).contains("drain_"), "{}", ruleset(&e));
    host_has_no_specd_table();
    e.b.shutdown().unwrap();
}
