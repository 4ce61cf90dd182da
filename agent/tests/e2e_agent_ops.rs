//! The agent as an operator runs it, in the box: systemd's watchdog restarts a hung agent, and
//! commit signatures gate what the running agent deploys.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;
use specd_e2e::BoxConfig;

const AGENT: &str = "specd-agent.service";

struct Fleet {
    e: Env,
    dir: tempfile::TempDir,
    repo: PathBuf,
    listen: u16,
}

impl Fleet {
    fn new() -> Fleet {
        let dir = tempfile::tempdir().unwrap();
        let repo = dir.path().join("config");
        std::fs::create_dir_all(repo.join("specs")).unwrap();
        git(&repo, &["init", "-q"]);
        let b =
            SystemdBox::boot_with(BoxConfig { binds: vec![dir.path().to_path_buf()], ..Default::default() }).unwrap();
        let e = Env {
            b,
            port: free_port(),
            specd: env!("CARGO_BIN_EXE_specd").into(),
            standin: bin_path("specd-standin").display().to_string(),
        };
        Fleet { e, dir, repo, listen: free_port() }
    }

    fn spec(&self, steps: u32) -> String {
        let service =
            "  service: {restart: always, timeout_stop_sec: 5, environment: {SPECD_STANDIN_LOAD_MS: \"200\"}}\n";
        sglang_spec(&self.e.standin, "qwen.service", self.e.port, steps, service)
    }

    fn commit(&self, steps: u32, sign: Option<&Path>) -> String {
        std::fs::write(self.repo.join("specs/qwen.yaml"), self.spec(steps)).unwrap();
        git(&self.repo, &["add", "-A"]);
        let key = sign.map(|k| format!("user.signingkey={}", k.display()));
        let mut args = vec![];
        if let Some(k) = &key {
            args.extend(["-c", "gpg.format=ssh", "-c", k.as_str()]);
        }
        args.extend(["commit", "-q", "-m", "steps"]);
        if sign.is_some() {
            args.push("-S");
        }
        git(&self.repo, &args);
        git(&self.repo, &["rev-parse", "HEAD"])
    }

    /// The agent as a Type=notify unit of the box, with `unit_extra` in its [Service] section and
    /// `config` as its agent config.
    fn start_agent(&self, config: &str, unit_extra: &str) {
        self.e.b.write_file("/run/agent.yaml", config).unwrap();
        let unit = format!(
            "[Service]\nType=notify\nExecStart={} run --config /run/agent.yaml --repo {} --path specs --hostname gpu-01 --interval 1 --listen 127.0.0.1:{}\nRestart=always\nRestartSec=1\nTimeoutStopSec=90\n{unit_extra}",
            self.e.specd,
            self.repo.display(),
            self.listen
        );
        self.e.b.write_file(&format!("/etc/systemd/system/{AGENT}"), unit).unwrap();
        self.e.b.systemctl_check(&["daemon-reload"]).unwrap();
        self.e.b.systemctl_check(&["start", AGENT]).unwrap();
    }

    fn journal(&self) -> String {
        self.e.b.journal(AGENT).unwrap_or_default()
    }

    fn wait_steps(&self, steps: u64) {
        wait_until(&format!("steps={steps} to be served"), Duration::from_secs(60), || {
            self.e.served_steps() == Some(steps)
        })
        .unwrap_or_else(|err| panic!("{err}\nagent journal:\n{}", self.journal()));
    }

    fn status(&self) -> String {
        text(&self.e.specd(&["status"]))
    }

    fn wait_status(&self, what: &str, f: impl Fn(&str) -> bool) -> String {
        wait_until(what, Duration::from_secs(30), || f(&self.status()))
            .unwrap_or_else(|err| panic!("{err}\nstatus:\n{}\nagent journal:\n{}", self.status(), self.journal()));
        self.status()
    }
}

/// The agent's unit has `WatchdogSec=`; an agent that stops answering (SIGSTOP: hung, as a
/// deadlock would leave it) is killed by systemd and started again, and systemd says why.
#[test]
fn a_hung_agent_is_killed_by_the_watchdog_and_restarted() {
    let f = Fleet::new();
    f.commit(5, None);
    f.start_agent("", "WatchdogSec=3\n");
    f.wait_steps(5);
    let pid = f.e.b.prop(AGENT, "MainPID").unwrap();
    assert_eq!(f.e.b.prop(AGENT, "WatchdogUSec").unwrap(), "3s");
    // Alive and pinging: systemd records each ping; pings spanning more than the limit, and still
    // the same process.
    let ping = |p: &str| f.e.b.prop(AGENT, p).ok().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    let first = ping("WatchdogTimestampMonotonic");
    assert!(first > 0, "the agent pings the watchdog");
    wait_until("pings over more than WatchdogSec", Duration::from_secs(30), || {
        ping("WatchdogTimestampMonotonic") > first + 3_000_000
    })
    .unwrap();
    assert_eq!(f.e.b.prop(AGENT, "MainPID").unwrap(), pid);
    let server = f.e.main_pid("qwen.service");
    f.e.b.sh_check(&format!("kill -STOP {pid}")).unwrap();
    wait_until("a new agent process", Duration::from_secs(60), || {
        f.e.b.prop(AGENT, "MainPID").is_ok_and(|p| p != pid && p != "0")
            && f.e.b.prop(AGENT, "ActiveState").is_ok_and(|s| s == "active")
    })
    .unwrap_or_else(|err| panic!("{err}\nagent journal:\n{}", f.journal()));
    let journal = f.journal();
    assert!(journal.contains("Watchdog timeout"), "{journal}");
    assert!(journal.contains("Failed with result 'watchdog'"), "{journal}");
    assert!(f.e.b.prop(AGENT, "NRestarts").unwrap().parse::<u32>().unwrap() >= 1);
    // The new agent finds the server in sync and leaves it running.
    wait_until("status to be green", Duration::from_secs(30), || f.e.specd(&["status"]).status.code() == Some(0))
        .unwrap_or_else(|err| panic!("{err}\n{}", f.status()));
    assert_eq!(f.e.main_pid("qwen.service"), server, "the server was not restarted");
    f.e.b.shutdown().unwrap();
}

fn ssh_key(dir: &Path, name: &str) -> PathBuf {
    let k = dir.join(name);
    let out =
        Command::new("ssh-keygen").args(["-q", "-t", "ed25519", "-N", "", "-C", name, "-f"]).arg(&k).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    k
}

/// With `verify_ssh_allowed_signers`, the running agent deploys only commits signed by an
/// allowed key; an unsigned or wrongly signed head is refused, and `status` names the commit.
#[test]
fn the_running_agent_deploys_only_commits_signed_by_an_allowed_key() {
    let f = Fleet::new();
    let good = ssh_key(f.dir.path(), "good");
    let evil = ssh_key(f.dir.path(), "evil");
    let allowed = f.dir.path().join("allowed_signers");
    let pubkey = std::fs::read_to_string(good.with_extension("pub")).unwrap();
    std::fs::write(&allowed, format!("ops@example.com namespaces=\"git\" {pubkey}")).unwrap();
    let config = format!("verify_ssh_allowed_signers: {}\n", allowed.display());

    let c1 = f.commit(5, None);
    f.start_agent(&config, "");
    let st = f.wait_status("the unsigned head to be refused", |s| s.contains("head not deployed"));
    assert!(st.contains(&format!("commit {} is not signed", &c1[..12])), "{st}");
    assert!(f.e.b.read_to_string("/etc/systemd/system/qwen.service").is_err(), "nothing deployed");

    let c2 = f.commit(6, Some(&evil));
    let st = f.wait_status("the wrongly signed head to be refused", |s| s.contains(&c2[..12]));
    assert!(st.contains(&format!("commit {} is signed by a key that is not in", &c2[..12])), "{st}");
    assert!(f.e.b.read_to_string("/etc/systemd/system/qwen.service").is_err(), "nothing deployed");

    let c3 = f.commit(7, Some(&good));
    f.wait_steps(7);
    let st = f.wait_status("the signed head to be deployed", |s| !s.contains("head not deployed"));
    assert!(st.contains(&format!("deployed commit {}", &c3[..12])), "{st}");
    assert!(f.journal().contains("signature verified"), "{}", f.journal());
    f.e.b.shutdown().unwrap();
}
