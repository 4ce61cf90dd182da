//! The shipped agent unit's sandbox, as systemd rates it: `systemd-analyze security` of
//! packaging/specd.service stays at an exposure of 4.0 or less ("OK" on systemd's scale). The
//! end-to-end tests run the agent under the same settings (`crate::common::shipped_service`), so none of
//! them is bought by breaking the agent. Here too: what no other test does under the sandbox.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::common::*;

/// The most exposure the shipped unit may have (systemd's scale, 0.0 to 10.0).
const MOST: f64 = 4.0;

#[test]
fn the_shipped_unit_is_rated_at_most_4_by_systemd_analyze_security() {
    let unit = Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging/specd.service");
    // Offline: the file is rated as written, never loaded into this host's systemd.
    let out = Command::new("systemd-analyze")
        .args(["security", "--offline=yes", "--no-pager"])
        .arg(&unit)
        .output()
        .expect("systemd-analyze (package systemd) is installed");
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "systemd-analyze security: {text}");
    // "→ Overall exposure level for specd.service: 2.8 OK 🙂"
    let overall = text
        .lines()
        .find_map(|l| l.split_once("Overall exposure level for specd.service:"))
        .and_then(|(_, v)| v.split_whitespace().next()?.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no overall exposure in:\n{text}"));
    assert!((0.0..=10.0).contains(&overall), "{overall}");
    assert!(overall <= MOST, "exposure {overall} > {MOST}; what systemd counts against the unit:\n{text}");
    // The settings the score rests on are in the unit, not defaults of some systemd version.
    let text = std::fs::read_to_string(&unit).unwrap();
    for setting in [
        "ProtectSystem=strict",
        "CapabilityBoundingSet=CAP_DAC_READ_SEARCH CAP_SYS_PTRACE CAP_CHOWN CAP_NET_ADMIN",
        "SystemCallFilter=@system-service",
        "UMask=0077",
        "PrivateTmp=yes",
        "NoNewPrivileges=yes",
    ] {
        assert!(text.lines().any(|l| l == setting), "{setting} is not in the unit");
    }
}

/// `control_group` (agent.yaml) gives the control socket and its directory to a group: a chown,
/// which the sandbox allows (CAP_CHOWN kept, the @chown calls put back after @privileged).
#[test]
fn the_sandboxed_agent_gives_its_control_socket_to_control_group() {
    let f = Fleet::new();
    f.e.b.write_file("/run/agent.yaml", "control_group: nogroup\n").unwrap();
    f.run_agent(f.repo.to_str().unwrap(), "", "");
    let modes = || f.e.b.sh_check("stat -c '%a %U %G' /run/specd /run/specd/control.sock").unwrap_or_default();
    wait_until("the control socket", Duration::from_secs(30), || !modes().is_empty())
        .unwrap_or_else(|e| panic!("{e}\nagent journal:\n{}", f.e.b.journal(AGENT).unwrap_or_default()));
    assert_eq!(modes(), "750 root nogroup\n660 root nogroup\n");
    assert_eq!(f.e.b.prop(AGENT, "ActiveState").unwrap(), "active");
    let o = f.e.specd(&["reconcile"]);
    assert!(o.status.success(), "{}", text(&o));
    f.e.b.shutdown().unwrap();
}

/// The workspace cloned in a temporary directory: the agent's binary, the stand-in its spec runs
/// and the repository it follows all lie under /tmp, which the shipped unit's `PrivateTmp=yes`
/// replaces with a /tmp of the agent's own. The harness shows them to it at their paths, as for
/// every test wherever the clone is: it starts and deploys.
#[test]
fn the_sandboxed_agent_runs_and_deploys_from_a_clone_under_tmp() {
    let clone = tempfile::Builder::new().prefix("specd-clone.").tempdir_in("/tmp").unwrap();
    let d = clone.path();
    let (specd, standin) = (d.join("specd"), d.join("specd-standin"));
    std::fs::copy(env!("CARGO_BIN_EXE_specd"), &specd).unwrap();
    std::fs::copy(bin_path("specd-standin"), &standin).unwrap();
    let repo = d.join("config");
    std::fs::create_dir_all(repo.join("specs")).unwrap();
    git(&repo, &["init", "-q"]);
    let port = free_port();
    let service = "  service: {timeout_stop_sec: 5, environment: {SPECD_STANDIN_LOAD_MS: \"200\"}}\n";
    let spec = sglang_spec(standin.to_str().unwrap(), "qwen.service", port, 5, service);
    std::fs::write(repo.join("specs/qwen.yaml"), spec).unwrap();
    git(&repo, &["add", "-A"]);
    git(&repo, &["commit", "-q", "-m", "steps 5"]);

    let cfg = specd_e2e::BoxConfig { binds: vec![d.to_path_buf()], ..Default::default() };
    let b = SystemdBox::boot_with(cfg).expect("boot a private systemd (the end-to-end tests run as root)");
    let exec = format!(
        "{} run --repo {} --path specs --hostname gpu-01 --interval 1 --listen 127.0.0.1:{}",
        specd.display(),
        repo.display(),
        free_port()
    );
    start_agent_unit(&b, &exec, "");
    let steps = || {
        let (code, body) = http_get(port, "/get_server_info")?;
        (code == 200)
            .then(|| serde_json::from_str::<serde_json::Value>(&body).ok()?["speculative_num_steps"].as_u64())?
    };
    wait_until("the agent to deploy steps 5 from /tmp", Duration::from_secs(60), || steps() == Some(5))
        .unwrap_or_else(|e| panic!("{e}\nagent journal:\n{}", b.journal(AGENT).unwrap_or_default()));
    assert_eq!(b.prop(AGENT, "ActiveState").unwrap(), "active");
    b.shutdown().unwrap();
}
