//! The HAProxy configuration the README puts in front of specd's units (`examples/haproxy.cfg`):
//! Debian's HAProxy takes it, and it asks specd what specd answers — the agent-check on the port
//! the example agent config serves it on, each server naming a unit, the HTTP check at
//! `/serving/<unit>` on the agent's `listen`.

use std::path::Path;

fn root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

#[test]
fn the_example_haproxy_config_is_valid_and_asks_what_the_agent_answers() {
    let cfg = root().join("examples/haproxy.cfg");
    let out = std::process::Command::new("haproxy")
        .arg("-c")
        .arg("-f")
        .arg(&cfg)
        .output()
        .expect("run haproxy -c (Debian's haproxy package)");
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "haproxy -c refused examples/haproxy.cfg:\n{said}");
    assert!(said.contains("Configuration file is valid"), "{said}");
    assert!(!said.contains("[WARNING]"), "haproxy -c warns:\n{said}");

    let text = std::fs::read_to_string(&cfg).unwrap();
    let agent = std::fs::read_to_string(root().join("examples/agent/agent.yaml")).unwrap();
    let port = agent
        .lines()
        .find_map(|l| l.trim_start_matches(['#', ' ']).strip_prefix("agent_check: 0.0.0.0:"))
        .and_then(|rest| rest.split_whitespace().next())
        .expect("examples/agent/agent.yaml shows load_balancer.agent_check");
    assert!(text.contains(&format!("agent-check agent-port {port} ")), "the agent-check goes to port {port}");
    let listen = agent.lines().find_map(|l| l.strip_prefix("listen: 127.0.0.1:")).unwrap();
    let listen_port = listen.split_whitespace().next().unwrap();
    assert!(text.contains(&format!("check port {listen_port} ")), "the HTTP check goes to the agent's listen");
    // Every server names a unit, each one a unit name specd accepts, with its newline.
    let sent: Vec<&str> = text.lines().filter_map(|l| l.split("agent-send \"").nth(1)).collect();
    assert_eq!(sent.len(), 2, "{text}");
    for s in sent {
        let unit = s.strip_suffix("\\n\"").unwrap_or_else(|| panic!("agent-send without its newline: {s}"));
        assert_eq!(specd_spec::unit_name_problem(unit), None, "{unit}");
        assert!(text.contains(&format!("uri /serving/{unit}")), "the HTTP check asks for {unit}");
    }
}
