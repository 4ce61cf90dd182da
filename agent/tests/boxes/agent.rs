//! `specd run` as a systemd service in the box, following a git repository: commits deploy,
//! uncommitted edits and bad commits do not, a branch never goes backwards, several units
//! reconcile concurrently, hand edits are healed, and a killed agent converges after restart.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::*;

impl Fleet {
    fn spec(&self, unit: &str, port: u16, steps: u32, load_ms: u32, extra: &str) -> String {
        spec_text(&self.e.standin, unit, port, steps, load_ms, extra)
    }

    /// Start the agent as a Type=notify unit in the box; returns when systemd says it is up.
    /// Its config file is /run/agent.yaml (absent: the defaults).
    fn start_agent(&self, repo: &str, extra_args: &str) {
        self.run_agent(repo, extra_args, "");
    }

    fn steps(&self, port: u16) -> Option<u64> {
        let (c, b) = http_get(port, "/get_server_info")?;
        (c == 200)
            .then(|| serde_json::from_str::<serde_json::Value>(&b).ok()?["speculative_num_steps"].as_u64())
            .flatten()
    }

    fn wait_steps(&self, port: u16, steps: u64, within: Duration) {
        wait_until(&format!("port {port} to serve steps={steps}"), within, || self.steps(port) == Some(steps))
            .unwrap_or_else(|err| panic!("{err}\nagent journal:\n{}", self.e.b.journal(AGENT).unwrap_or_default()));
    }

    /// Wait until `unit` has `n` applies recorded and none in progress.
    fn wait_applied(&self, unit: &str, n: usize) {
        let path = format!("/var/lib/specd/units/{unit}.json");
        wait_until(&format!("{n} applies of {unit}"), Duration::from_secs(60), || {
            self.e
                .b
                .read_to_string(&path)
                .ok()
                .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
                .is_some_and(|v| v["in_progress"].is_null() && v["history"].as_array().is_some_and(|h| h.len() >= n))
        })
        .unwrap_or_else(|err| panic!("{err}\nagent journal:\n{}", self.e.b.journal(AGENT).unwrap_or_default()));
    }

    /// `model-a.service` and `model-b.service` committed (5 steps each) and deployed by the agent:
    /// their ports.
    fn two_models(&self) -> (u16, u16) {
        let (a, b) = (self.e.port, free_port());
        self.commit(
            &[
                ("a.yaml", &self.spec("model-a.service", a, 5, 100, "")),
                ("b.yaml", &self.spec("model-b.service", b, 5, 100, "")),
            ],
            "two models",
        );
        self.start_agent(self.repo.to_str().unwrap(), "");
        self.wait_steps(a, 5, Duration::from_secs(30));
        self.wait_steps(b, 5, Duration::from_secs(30));
        self.wait_applied("model-b.service", 1);
        (a, b)
    }

    /// `model-b.service`'s spec removed from the repository: once the agent read it, the unit
    /// is an orphan, left running on `port`.
    fn retire_model_b(&self, port: u16) {
        std::fs::remove_file(self.repo.join("specs/b.yaml")).unwrap();
        let c = self.commit(&[], "retire model b");
        self.wait_source("model-b to be orphaned", |s| {
            s["accepted_commit"] == c.as_str()
                && s["orphans"].as_array().is_some_and(|o| o.iter().any(|u| u == "model-b.service"))
        });
        assert_eq!(self.steps(port), Some(5), "an orphan is left running");
    }

    fn source_state(&self) -> serde_json::Value {
        self.e
            .b
            .read_to_string("/var/lib/specd/source.json")
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or_default()
    }

    fn wait_source(&self, what: &str, f: impl Fn(&serde_json::Value) -> bool) {
        wait_until(what, Duration::from_secs(30), || f(&self.source_state())).unwrap_or_else(|err| {
            panic!("{err}\n{}\nagent journal:\n{}", self.source_state(), self.e.b.journal(AGENT).unwrap_or_default())
        });
    }
}

fn spec_text(standin: &str, unit: &str, port: u16, steps: u32, load_ms: u32, extra: &str) -> String {
    let service = format!(
        "  service: {{restart: always, timeout_stop_sec: 5, environment: {{SPECD_STANDIN_LOAD_MS: \"{load_ms}\", SPECD_STANDIN_DRAIN_POLL_MS: \"100\"}}}}\n{extra}"
    );
    sglang_spec(standin, unit, port, steps, &service)
}

#[test]
fn commits_deploy_and_nothing_else_does() {
    let f = Fleet::new();
    let a = f.e.port;
    let c1 = f.commit(&[("qwen.yaml", &f.spec("qwen.service", a, 5, 200, ""))], "steps 5");
    f.start_agent(f.repo.to_str().unwrap(), "");
    f.wait_steps(a, 5, Duration::from_secs(30));
    f.wait_source("the first commit to be accepted", |s| s["accepted_commit"] == c1.as_str());

    // A commit: deployed within a bounded time, and status names the commit.
    let t0 = Instant::now();
    let c2 = f.commit(&[("qwen.yaml", &f.spec("qwen.service", a, 10, 200, ""))], "steps 10");
    f.wait_steps(a, 10, Duration::from_secs(30));
    let took = t0.elapsed();
    wait_until("status to be green", Duration::from_secs(10), || f.e.specd(&["status"]).status.code() == Some(0))
        .unwrap();
    let st = text(&f.e.specd(&["status"]));
    assert!(st.contains(&format!("deployed commit {}", &c2[..12])), "{st}");
    assert!(st.contains(&format!("commit {} (specs/qwen.yaml)", &c2[..12])), "{st}");
    assert!(st.contains("qwen.service: InSync Healthy"), "{st}");
    eprintln!("commit → served: {took:?}");
    // Metrics on the loopback port: sync status per unit, and the commit deployed.
    let (code, m) = http_get(f.listen, "/metrics").unwrap();
    assert_eq!(code, 200);
    assert!(m.contains("specd_unit_sync{unit=\"qwen.service\",status=\"InSync\"} 1"), "{m}");
    assert!(m.contains(&format!("specd_source_info{{revision=\"{c2}\"}} 1")), "{m}");
    assert!(m.contains("specd_reconcile_duration_seconds_count{unit=\"qwen.service\"}"), "{m}");
    // History lists both applies, with their commits.
    let h = text(&f.e.specd(&["history", "qwen.service"]));
    assert!(
        h.contains(&format!("commit {} (specs/qwen.yaml)", &c1[..12]))
            && h.contains(&format!("commit {} (specs/qwen.yaml)", &c2[..12])),
        "{h}"
    );

    // An uncommitted edit: nothing happens, even after an explicit reconcile.
    std::fs::write(f.repo.join("specs/qwen.yaml"), f.spec("qwen.service", a, 3, 200, "")).unwrap();
    let pid = f.e.main_pid("qwen.service");
    let before = f.source_state()["time"].as_u64().unwrap();
    let o = f.e.specd(&["reconcile"]);
    assert!(o.status.success(), "{}", text(&o));
    f.wait_source("the source to be read again", |s| s["time"].as_u64().unwrap_or(0) > before);
    assert_eq!(f.steps(a), Some(10));
    assert_eq!(f.e.main_pid("qwen.service"), pid);

    // A bad commit: host unchanged, status names file:line, the next good commit deploys.
    let bad = f.spec("qwen.service", a, 4, 200, "").replace("num_draft_tokens: 5", "num_draft_tokens: 9");
    let c3 = f.commit(&[("qwen.yaml", &bad)], "bad");
    f.wait_source("the bad commit to be refused", |s| s["head_commit"] == c3.as_str() && !s["error"].is_null());
    let st = text(&f.e.specd(&["status"]));
    assert!(st.contains(&format!("specs/qwen.yaml@{}:10:", &c3[..12])), "{st}");
    assert!(st.contains("spec.speculative.num_draft_tokens"), "{st}");
    assert_eq!(f.steps(a), Some(10));
    assert_eq!(f.e.main_pid("qwen.service"), pid);
    let c4 = f.commit(&[("qwen.yaml", &f.spec("qwen.service", a, 6, 200, ""))], "fixed");
    f.wait_steps(a, 6, Duration::from_secs(30));
    f.wait_source("the good commit to be accepted", |s| s["accepted_commit"] == c4.as_str() && s["error"].is_null());

    // Force-push to an older commit: refused, the host stays.
    git(&f.repo, &["reset", "-q", "--hard", &c2]);
    f.wait_source("the rewind to be refused", |s| {
        s["head_commit"] == c2.as_str() && s["error"].as_str().is_some_and(|e| e.contains("refusing to go backwards"))
    });
    assert_eq!(f.steps(a), Some(6));
    assert!(text(&f.e.specd(&["status"])).contains("refusing to go backwards"));
    f.e.b.shutdown().unwrap();
}

#[test]
fn two_specs_reconcile_concurrently() {
    let f = Fleet::new();
    let (a, b) = (f.e.port, free_port());
    f.start_agent(f.repo.to_str().unwrap(), "");
    // Each server takes 3 s to load; together they must not take twice that.
    f.commit(
        &[
            ("a.yaml", &f.spec("model-a.service", a, 5, 3000, "")),
            ("b.yaml", &f.spec("model-b.service", b, 5, 3000, "")),
        ],
        "two models",
    );
    f.wait_steps(a, 5, Duration::from_secs(60));
    f.wait_steps(b, 5, Duration::from_secs(60));
    let start = |u: &str| f.e.b.prop(u, "ExecMainStartTimestampMonotonic").unwrap().parse::<u64>().unwrap();
    let gap = start("model-a.service").abs_diff(start("model-b.service"));
    assert!(gap < 2_000_000, "the second model started {gap} µs after the first: loads did not overlap");
    f.e.b.shutdown().unwrap();
}

#[test]
fn a_hand_edit_is_healed_while_the_agent_runs() {
    let f = Fleet::new();
    let a = f.e.port;
    f.commit(&[("qwen.yaml", &f.spec("qwen.service", a, 5, 200, ""))], "steps 5");
    f.start_agent(f.repo.to_str().unwrap(), "");
    f.wait_steps(a, 5, Duration::from_secs(30));
    let path = "/etc/systemd/system/qwen.service";
    let good = f.e.b.read_to_string(path).unwrap();
    let edited = good.replace(
        "--speculative-num-steps 5 --speculative-eagle-topk 1 --speculative-num-draft-tokens 6",
        "--speculative-num-steps 2 --speculative-eagle-topk 1 --speculative-num-draft-tokens 3",
    );
    assert_ne!(edited, good);
    f.e.b.write_file(path, &edited).unwrap();
    wait_until("the edit to be healed", Duration::from_secs(30), || {
        f.e.b.read_to_string(path).is_ok_and(|t| t == good)
    })
    .unwrap();
    f.wait_steps(a, 5, Duration::from_secs(30));

    // A hand `specd apply` of another spec: it applies, and says that the agent puts its own
    // unit back at its next look (which it does).
    let other = f.e.put("steps2.yaml", &f.spec("qwen.service", a, 2, 200, ""));
    let out = f.e.specd(&["apply", "-f", &other]);
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{said}");
    assert!(
        said.contains("note: qwen.service: the agent that follows") && said.contains("puts it back at its next look"),
        "{said}"
    );
    f.wait_steps(a, 5, Duration::from_secs(30));
    f.e.b.shutdown().unwrap();
}

#[test]
fn a_server_stopped_by_hand_is_started_again_at_once_without_a_resync_timer() {
    // A local repository and no config: no periodic resync. systemd's signal that the unit
    // stopped is what makes the agent look.
    let f = Fleet::new();
    let a = f.e.port;
    f.commit(&[("qwen.yaml", &f.spec("qwen.service", a, 5, 200, ""))], "steps 5");
    f.start_agent(f.repo.to_str().unwrap(), "");
    f.wait_steps(a, 5, Duration::from_secs(30));
    f.wait_applied("qwen.service", 1);
    let before = f.e.main_pid("qwen.service");
    f.e.b.systemctl_check(&["stop", "qwen.service"]).unwrap();
    wait_until("the agent to start the unit again", Duration::from_secs(30), || {
        f.e.b.prop("qwen.service", "ActiveState").is_ok_and(|s| s == "active")
            && f.e.b.prop("qwen.service", "MainPID").is_ok_and(|p| p != "0" && p != before.to_string())
    })
    .unwrap_or_else(|err| panic!("{err}\nagent journal:\n{}", f.e.b.journal(AGENT).unwrap_or_default()));
    f.wait_steps(a, 5, Duration::from_secs(30));
    f.e.b.shutdown().unwrap();
}

#[test]
fn a_remote_over_file_url_and_git_daemon_deploys() {
    let f = Fleet::new();
    let a = f.e.port;
    f.commit(&[("qwen.yaml", &f.spec("qwen.service", a, 5, 200, ""))], "steps 5");
    let served = f.dir.path().join("served");
    std::fs::create_dir_all(&served).unwrap();
    let bare = served.join("config.git");
    git(f.dir.path(), &["clone", "-q", "--bare", f.repo.to_str().unwrap(), bare.to_str().unwrap()]);
    let dport = free_port();
    let exec_path = git(f.dir.path(), &["--exec-path"]);
    let _daemon = Reaped(
        Command::new(Path::new(&exec_path).join("git-daemon"))
            .args([
                "--reuseaddr",
                "--export-all",
                "--listen=127.0.0.1",
                &format!("--port={dport}"),
                &format!("--base-path={}", served.display()),
            ])
            .arg(&served)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_until("git daemon to listen", Duration::from_secs(10), || {
        std::net::TcpStream::connect(("127.0.0.1", dport)).is_ok()
    })
    .unwrap();
    f.start_agent(&format!("git://127.0.0.1:{dport}/config.git"), "");
    f.wait_steps(a, 5, Duration::from_secs(30));
    f.commit(&[("qwen.yaml", &f.spec("qwen.service", a, 10, 200, ""))], "steps 10");
    git(&f.repo, &["push", "-q", bare.to_str().unwrap(), "main"]);
    f.wait_steps(a, 10, Duration::from_secs(30));

    // The same over file://, switching the agent's source.
    f.e.b.systemctl_check(&["stop", AGENT]).unwrap();
    f.start_agent(&format!("file://{}", bare.display()), "");
    f.commit(&[("qwen.yaml", &f.spec("qwen.service", a, 7, 200, ""))], "steps 7");
    git(&f.repo, &["push", "-q", bare.to_str().unwrap(), "main"]);
    f.wait_steps(a, 7, Duration::from_secs(30));
    f.e.b.shutdown().unwrap();
}

/// The agent runs sandboxed as shipped: `PrivateTmp=yes` gives it a /tmp and /var/tmp of its
/// own. Its pre-flight judges the files as the managed unit finds them: a model under the
/// host's /tmp and an environment file under its /var/tmp refuse nothing; a drop-in that gives
/// the unit a /tmp of its own makes the same model one its server would not find, and that is
/// refused before the serving instance is touched.
#[test]
fn the_pre_flight_sees_files_as_the_unit_finds_them_not_as_the_sandboxed_agent() {
    let f = Fleet::new();
    let (a, unit) = (f.e.port, "qwen-tmp.service");
    // In the box's own /tmp and /var/tmp: the host's, for the unit; not the agent's.
    f.e.b.write_file("/tmp/models/qwen/config.json", "{\"architectures\": [\"Qwen3NextForCausalLM\"]}\n").unwrap();
    f.e.b.write_file("/var/tmp/qwen.env", "QWEN_FROM_ENV_FILE=1\n").unwrap();
    let spec = |steps: u32| {
        f.spec(unit, a, steps, 200, "")
            .replace(specd_e2e::STANDIN_MODEL, "/tmp/models/qwen")
            .replace("timeout_stop_sec: 5,", "timeout_stop_sec: 5, environment_files: [/var/tmp/qwen.env],")
    };
    f.commit(&[("qwen.yaml", &spec(5))], "steps 5");
    f.start_agent(f.repo.to_str().unwrap(), "");
    f.wait_steps(a, 5, Duration::from_secs(30));
    f.wait_applied(unit, 1);
    // A change replaces the serving instance: the pre-flight runs first, and lets it through.
    f.commit(&[("qwen.yaml", &spec(6))], "steps 6");
    f.wait_steps(a, 6, Duration::from_secs(30));
    let serving = f.e.main_pid(unit);
    let environ = f.e.b.read_file(&format!("/proc/{serving}/environ")).unwrap();
    assert!(String::from_utf8_lossy(&environ).contains("QWEN_FROM_ENV_FILE=1"), "systemd read the environment file");
    let journal = f.e.b.journal(AGENT).unwrap();
    assert!(!journal.contains("Refused"), "{journal}");

    // A drop-in of the host's gives units named qwen-* a /tmp of their own.
    let drop_in = "/etc/systemd/system/qwen-.service.d/tmp.conf";
    f.e.b.write_file(drop_in, "[Service]\nPrivateTmp=yes\n").unwrap();
    f.e.b.systemctl_check(&["daemon-reload"]).unwrap();
    f.commit(&[("qwen.yaml", &spec(7))], "steps 7");
    let why = format!(
        "the model /tmp/models/qwen is under /tmp, which the unit's PrivateTmp=yes (in {drop_in}) hides from its server"
    );
    wait_until("the apply to be refused", Duration::from_secs(30), || text(&f.e.specd(&["status"])).contains(&why))
        .unwrap_or_else(|e| {
            panic!(
                "{e}\n{}\nagent journal:\n{}",
                text(&f.e.specd(&["status"])),
                f.e.b.journal(AGENT).unwrap_or_default()
            )
        });
    let status = text(&f.e.specd(&["status"]));
    assert!(status.contains("nothing was stopped or changed"), "{status}");
    assert!(!status.contains("environment file"), "systemd reads it before the sandbox: {status}");
    assert_eq!(f.e.main_pid(unit), serving, "the serving instance was touched");
    assert_eq!(f.steps(a), Some(6));
    f.e.b.shutdown().unwrap();
}

/// The agent deploys steps=5, then a commit of steps=10 with a slow load; returns the port once
/// that apply is waiting for readiness.
fn slow_apply_waiting(f: &Fleet) -> u16 {
    let a = f.e.port;
    f.commit(&[("qwen.yaml", &f.spec("qwen.service", a, 5, 200, ""))], "steps 5");
    f.start_agent(f.repo.to_str().unwrap(), "");
    f.wait_steps(a, 5, Duration::from_secs(30));
    f.wait_applied("qwen.service", 1);
    f.commit(&[("qwen.yaml", &f.spec("qwen.service", a, 10, 5000, ""))], "steps 10, slow load");
    let state = "/var/lib/specd/units/qwen.service.json";
    wait_until("the apply to wait for readiness", Duration::from_secs(30), || {
        f.e.b
            .read_to_string(state)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .is_some_and(|v| v["in_progress"]["phase"] == "WaitReady")
    })
    .unwrap();
    a
}

#[test]
fn a_killed_agent_converges_after_restart() {
    let f = Fleet::new();
    let a = slow_apply_waiting(&f);
    let pid = f.e.main_pid(AGENT);
    f.e.b.check(&["kill", "-KILL", &pid.to_string()]).unwrap();
    // systemd restarts the agent (Restart=always); it finishes the apply.
    f.wait_steps(a, 10, Duration::from_secs(60));
    wait_until("status to be green", Duration::from_secs(30), || f.e.specd(&["status"]).status.code() == Some(0))
        .unwrap();
    assert_ne!(f.e.main_pid(AGENT), pid);
    f.wait_applied("qwen.service", 2);
    assert_eq!(last_outcome(&f, "qwen.service"), ("applied".to_string(), "Applied".to_string()));
    f.e.b.shutdown().unwrap();
}

#[test]
fn sigterm_stops_the_agent_at_a_safe_point_and_the_next_start_finishes() {
    let f = Fleet::new();
    let a = slow_apply_waiting(&f);
    f.e.b.systemctl_check(&["stop", AGENT]).unwrap();
    let journal = f.e.b.journal(AGENT).unwrap();
    assert!(journal.contains("stopped at a safe point before WaitReady"), "{journal}");
    assert_eq!(f.e.b.prop(AGENT, "Result").unwrap(), "success", "{journal}");
    f.e.b.systemctl_check(&["start", AGENT]).unwrap();
    f.wait_steps(a, 10, Duration::from_secs(60));
    // The apply the next run finished is an apply in the history, as its verdict says.
    f.wait_applied("qwen.service", 2);
    assert_eq!(last_outcome(&f, "qwen.service"), ("applied".to_string(), "Applied".to_string()));
    f.e.b.shutdown().unwrap();
}

/// The outcome of the unit's last history entry, and its verdict's first word.
fn last_outcome(f: &Fleet, unit: &str) -> (String, String) {
    let t = f.e.b.read_to_string(&format!("/var/lib/specd/units/{unit}.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&t).unwrap();
    let last = &v["history"].as_array().unwrap().last().unwrap().clone();
    let word = last["message"].as_str().unwrap().split(':').next().unwrap().to_string();
    (last["outcome"].as_str().unwrap().to_string(), word)
}

/// A server that drains a long request on SIGTERM (SGLang does): the agent asked to stop
/// (`systemctl stop`) while an apply stops the old instance, for longer than the agent unit's own
/// `TimeoutStopSec=` (lowered to 5 s here, as a person may in a drop-in), asks systemd for the
/// time the spec gives that stop, waits for it, starts the new instance and exits cleanly: the
/// unit ends serving the new spec, never down.
#[test]
fn asked_to_stop_during_a_stop_longer_than_its_own_timeout_the_agent_starts_the_new_instance() {
    let f = Fleet::new();
    let a = f.e.port;
    // 300 tokens at 20 tokens/s: the old instance drains 15 s on SIGTERM; the spec allows 60 s.
    let spec = |steps: u32| {
        f.spec("qwen.service", a, steps, 200, "")
            .replace("timeout_stop_sec: 5", "timeout_stop_sec: 60, drain_timeout_sec: 0")
            .replace(
                "SPECD_STANDIN_DRAIN_POLL_MS: \"100\"",
                "SPECD_STANDIN_DRAIN_POLL_MS: \"100\", SPECD_STANDIN_TOKENS_PER_SEC: \"20\"",
            )
    };
    assert!(spec(5).contains("TOKENS_PER_SEC") && spec(5).contains("drain_timeout_sec: 0"), "{}", spec(5));
    f.commit(&[("qwen.yaml", &spec(5))], "steps 5");
    f.run_agent(f.repo.to_str().unwrap(), "", "TimeoutStopSec=5\n");
    f.wait_steps(a, 5, Duration::from_secs(30));
    f.wait_applied("qwen.service", 1);
    let _request = f.e.in_flight(1, 300);
    f.commit(&[("qwen.yaml", &spec(10))], "steps 10");
    let state = "/var/lib/specd/units/qwen.service.json";
    wait_until("the apply to wait for the old instance's stop", Duration::from_secs(30), || {
        f.e.b
            .read_to_string(state)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .is_some_and(|v| v["in_progress"]["phase"] == "WaitStopped")
    })
    .unwrap();
    let t0 = Instant::now();
    let _ = f.e.b.systemctl(&["stop", AGENT]);
    let took = t0.elapsed();
    let journal = f.e.b.journal(AGENT).unwrap_or_default();
    f.wait_steps(a, 10, Duration::from_secs(30));
    assert_eq!(f.e.b.prop(AGENT, "Result").unwrap(), "success", "after {took:?}:\n{journal}");
    assert!(took > Duration::from_secs(5), "the old instance's stop did not outlast the agent's timeout: {took:?}");
    assert!(journal.contains("waiting up to"), "{journal}");
    // What the agent asked of systemd for its stop is gone with it (the harness's own drop-in
    // for a clone under /tmp stays).
    let stopping = format!("/etc/systemd/system/{AGENT}.d/zz-specd-stopping.conf");
    assert!(f.e.b.read_to_string(&stopping).is_err(), "{stopping} is left");
    f.e.b.shutdown().unwrap();
}

/// Under journald a rollback is a warning: `journalctl -p warning` of the agent's unit shows it
/// (and not the agent's info lines, which are at info); no line carries its priority prefix as
/// text. With its stderr in a file (systemd's `JOURNAL_STREAM` still set, for its stdout), the
/// agent writes plain lines with their time: no priority, no escape code.
#[test]
fn a_rollback_is_in_the_journal_at_warning_priority_and_a_file_gets_plain_lines() {
    let f = Fleet::new();
    let a = f.e.port;
    f.commit(&[("qwen.yaml", &f.spec("qwen.service", a, 5, 200, ""))], "works");
    f.start_agent(f.repo.to_str().unwrap(), "");
    f.wait_applied("qwen.service", 1);
    let failing = f
        .spec("qwen.service", a, 7, 200, "")
        .replace("SPECD_STANDIN_LOAD_MS", "SPECD_STANDIN_EXIT_CODE: \"3\", SPECD_STANDIN_LOAD_MS");
    f.commit(&[("qwen.yaml", &failing)], "fails at start");
    f.wait_applied("qwen.service", 2);
    assert_eq!(f.e.state("qwen.service")["history"][1]["outcome"], "rolled-back");
    let journal = |priority: &str| {
        f.e.b.check(&["journalctl", "--no-pager", "-o", "cat", "-p", priority, "-u", AGENT]).unwrap_or_default()
    };
    // journald writes what it read off the stream a moment later.
    let warnings = wait_for("the rollback at priority warning", Duration::from_secs(10), || {
        let w = journal("warning");
        w.lines().any(|l| l.contains("RolledBack: qwen.service")).then_some(w)
    })
    .unwrap_or_else(|e| panic!("{e}\nthe whole journal:\n{}", f.e.b.journal(AGENT).unwrap_or_default()));
    assert!(warnings.lines().all(|l| l.contains("WARN") || l.contains("ERROR")), "{warnings}");
    let info = journal("info..info");
    assert!(info.contains("specd agent starting"), "{info}");
    assert!(!info.contains("RolledBack"), "{info}");
    let all = f.e.b.journal(AGENT).unwrap();
    assert!(!all.lines().any(|l| l.starts_with('<')), "a priority prefix left as text:\n{all}");

    f.e.b.systemctl_check(&["stop", AGENT]).unwrap();
    f.run_agent(f.repo.to_str().unwrap(), "", "StandardError=file:/run/agent.err\n");
    let err = wait_for("the agent's ready line in its file", Duration::from_secs(30), || {
        let t = f.e.b.read_to_string("/run/agent.err").ok()?;
        t.contains(" INFO ready").then_some(t)
    })
    .unwrap();
    assert!(!err.contains('\u{1b}'), "escape codes in a file:\n{err:?}");
    for l in err.lines() {
        // `2025-01-02T03:04:05.678901Z  INFO ...`: its time first.
        assert!(l.get(..2).is_some_and(|y| y == "20") && l.get(10..11) == Some("T"), "{l:?}");
    }
    f.e.b.shutdown().unwrap();
}

#[test]
fn a_removed_spec_leaves_its_unit_running_as_orphaned_unless_prune_is_on() {
    let f = Fleet::new();
    let (a, b) = f.two_models();
    f.retire_model_b(b);
    let o = f.e.specd(&["status"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o).contains("orphaned: model-b.service (its spec is gone; left running)"), "{}", text(&o));

    assert!(f.e.b.read_file("/etc/systemd/system/multi-user.target.wants/model-b.service").is_ok(), "enabled");
    // With prune on, the orphan is stopped, disabled, and its unit file moved into the state dir.
    f.e.b.systemctl_check(&["stop", AGENT]).unwrap();
    f.e.b.write_file("/run/agent.yaml", "prune: true\n").unwrap();
    f.e.b.systemctl_check(&["start", AGENT]).unwrap();
    wait_until("model-b to be pruned", Duration::from_secs(30), || {
        f.e.b.read_file("/etc/systemd/system/model-b.service").is_err()
            && f.e.b.prop("model-b.service", "ActiveState").is_ok_and(|s| s == "inactive")
    })
    .unwrap();
    let kept = f.e.b.check(&["ls", "/var/lib/specd/pruned"]).unwrap();
    assert!(kept.contains("model-b.service."), "{kept}");
    let wants = f.e.b.check(&["ls", "/etc/systemd/system/multi-user.target.wants"]).unwrap_or_default();
    assert!(!wants.contains("model-b.service"), "no link left to a pruned unit: {wants}");
    assert_eq!(f.steps(a), Some(5));
    f.e.b.shutdown().unwrap();
}

#[test]
fn a_hostile_commit_is_reported_and_the_agent_keeps_serving_and_heals() {
    let f = Fleet::new();
    let (a, b) = (f.e.port, free_port());
    f.commit(
        &[("a.yaml", &f.spec("model-a.service", a, 5, 200, "")), ("b.yaml", &f.spec("model-b.service", b, 5, 200, ""))],
        "two models",
    );
    f.start_agent(f.repo.to_str().unwrap(), "");
    f.wait_steps(a, 5, Duration::from_secs(60));
    f.wait_steps(b, 5, Duration::from_secs(60));
    let agent_pid = f.e.b.prop(AGENT, "MainPID").unwrap();
    let pid_a = f.e.main_pid("model-a.service");

    // Numbers at the edge of every integer type and nesting far deeper than any spec: whatever the
    // validator makes of them (an error, or a bug that panics), the agent reports the commit and
    // goes on.
    let huge = f
        .spec("model-b.service", b, 5, 200, "")
        .replace("num_steps: 5", "num_steps: 4294967295")
        .replace("num_draft_tokens: 6", "num_draft_tokens: 18446744073709551615");
    let deep = format!(
        "{}  extra: {}{}\n",
        f.spec("model-c.service", free_port(), 5, 200, ""),
        "[".repeat(5000),
        "]".repeat(5000)
    );
    let bad = f.commit(&[("b.yaml", &huge), ("c.yaml", &deep)], "hostile");
    f.wait_source("the hostile commit to be refused", |s| s["head_commit"] == bad.as_str() && !s["error"].is_null());
    let err = f.source_state()["error"].as_str().unwrap_or_default().to_string();
    assert!(err.contains(&format!("specs/b.yaml@{}", &bad[..12])), "{err}");
    let st = text(&f.e.specd(&["status"]));
    assert!(st.contains("head not deployed") && st.contains("specs/b.yaml@"), "{st}");
    assert_eq!(f.e.b.prop(AGENT, "MainPID").unwrap(), agent_pid, "the agent restarted");
    assert_eq!(f.e.b.prop(AGENT, "NRestarts").unwrap(), "0");
    assert_eq!(f.steps(a), Some(5));
    assert_eq!(f.steps(b), Some(5));
    assert_eq!(f.e.main_pid("model-a.service"), pid_a);

    // Asked again (the source re-read), still up; then a fix commit deploys.
    let o = f.e.specd(&["reconcile"]);
    assert!(o.status.success(), "{}", text(&o));
    std::fs::remove_file(f.repo.join("specs/c.yaml")).unwrap();
    let fixed = f.commit(&[("b.yaml", &f.spec("model-b.service", b, 7, 200, ""))], "fixed");
    f.wait_steps(b, 7, Duration::from_secs(60));
    f.wait_source("the fix to be accepted", |s| s["accepted_commit"] == fixed.as_str() && s["error"].is_null());
    assert_eq!(f.e.b.prop(AGENT, "MainPID").unwrap(), agent_pid, "the agent restarted");
    assert_eq!(f.e.main_pid("model-a.service"), pid_a);
    f.e.b.shutdown().unwrap();
}

fn source_reads(f: &Fleet) -> u64 {
    let (_, body) = http_get(f.listen, "/metrics").unwrap_or_default();
    body.lines()
        .find_map(|l| l.strip_prefix("specd_source_reads_total "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or(0.0) as u64
}

#[test]
fn control_actions_take_the_root_only_socket_and_forced_rereads_are_rate_limited() {
    use std::io::{Read, Write};
    let f = Fleet::new();
    let a = f.e.port;
    f.commit(&[("qwen.yaml", &f.spec("qwen.service", a, 5, 200, ""))], "steps 5");
    f.start_agent(f.repo.to_str().unwrap(), "");
    f.wait_steps(a, 5, Duration::from_secs(30));

    // TCP serves reading only.
    let (code, _) = http(f.listen, "POST", "/reconcile", None, Duration::from_secs(5)).unwrap();
    assert!(code == 404 || code == 405, "POST /reconcile over TCP answered {code}");
    let (code, body) = http_get(f.listen, "/metrics").unwrap();
    assert_eq!(code, 200);
    assert!(body.contains("specd_source_reads_total"), "{body}");
    assert_eq!(http_get(f.listen, "/healthz").unwrap().0, 200);

    // The control socket is root's only.
    let modes = f.e.b.sh_check("stat -c '%a %U' /run/specd /run/specd/control.sock").unwrap();
    assert_eq!(modes, "700 root\n600 root\n");
    let o = f.e.b.exec(&["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "ls", "/run/specd"]);
    assert!(!o.status.success(), "nobody lists the control socket's directory: {}", text(&o));
    let o = f.e.specd(&["reconcile"]);
    assert!(o.status.success(), "{}", text(&o));

    // A burst of 3,000 requests is a handful of source reads.
    let sock = f.e.b.host_path("/run/specd/control.sock");
    let before = source_reads(&f);
    let t0 = Instant::now();
    for i in 0..3000 {
        let mut s = std::os::unix::net::UnixStream::connect(&sock).unwrap();
        s.write_all(b"POST /reconcile HTTP/1.1\r\nHost: specd\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut resp = String::new();
        s.read_to_string(&mut resp).unwrap();
        assert!(resp.starts_with("HTTP/1.1 200"), "request {i}: {resp}");
    }
    let took = t0.elapsed();
    let burst = source_reads(&f) - before;
    // At most one read a second (the burst may come within a second of the `specd reconcile`
    // above, and then all of it is deferred: no read yet is right).
    assert!(burst <= took.as_secs() + 2, "{burst} source reads in {took:?} for 3,000 requests");
    // The last requests are honoured: one more read follows the burst.
    wait_until("the deferred read", Duration::from_secs(5), || source_reads(&f) > before + burst).unwrap();
    assert_eq!(f.steps(a), Some(5));
    f.e.b.shutdown().unwrap();
}

#[test]
fn the_agent_manages_only_units_matching_its_pattern_and_never_systemd_s() {
    let f = Fleet::new();
    let a = f.e.port;
    f.e.b.write_file("/run/agent.yaml", "manage_units: \"llm-*\"\n").unwrap();
    let c1 = f.commit(&[("a.yaml", &f.spec("llm-a.service", a, 5, 200, ""))], "llm-a");
    f.start_agent(f.repo.to_str().unwrap(), "");
    f.wait_steps(a, 5, Duration::from_secs(30));
    f.wait_source("the first commit to be accepted", |s| s["accepted_commit"] == c1.as_str());

    let other = f.commit(&[("b.yaml", &f.spec("other.service", free_port(), 5, 200, ""))], "other");
    f.wait_source("the commit to be refused", |s| s["head_commit"] == other.as_str() && !s["error"].is_null());
    let err = f.source_state()["error"].as_str().unwrap_or_default().to_string();
    assert!(err.contains(&format!("specs/b.yaml@{}", &other[..12])) && err.contains("manage_units pattern"), "{err}");
    assert!(f.e.b.read_file("/etc/systemd/system/other.service").is_err());

    let journald = f.e.b.prop("systemd-journald.service", "ActiveState").unwrap();
    std::fs::remove_file(f.repo.join("specs/b.yaml")).unwrap();
    f.e.b.write_file("/run/agent.yaml", "").unwrap();
    f.e.b.systemctl_check(&["restart", AGENT]).unwrap();
    let j = f.commit(&[("j.yaml", &f.spec("systemd-journald.service", free_port(), 5, 200, ""))], "journald");
    f.wait_source("the commit to be refused", |s| s["head_commit"] == j.as_str() && !s["error"].is_null());
    let err = f.source_state()["error"].as_str().unwrap_or_default().to_string();
    assert!(err.contains("systemd-journald.service"), "{err}");
    assert_eq!(f.e.b.prop("systemd-journald.service", "ActiveState").unwrap(), journald);
    assert_eq!(f.steps(a), Some(5));
    f.e.b.shutdown().unwrap();
}

fn unit_down(f: &Fleet, unit: &str) -> Option<u64> {
    let (_, body) = http_get(f.listen, "/metrics")?;
    let key = format!("specd_unit_down{{unit=\"{unit}\"}} ");
    body.lines().find_map(|l| l.strip_prefix(key.as_str())).and_then(|v| v.trim().parse().ok())
}

#[test]
fn a_unit_left_down_is_in_the_metrics_and_unquarantine_works_while_the_agent_runs() {
    let f = Fleet::new();
    let a = f.e.port;
    let failing = f
        .spec("qwen.service", a, 5, 200, "")
        .replace("SPECD_STANDIN_LOAD_MS", "SPECD_STANDIN_EXIT_CODE: \"3\", SPECD_STANDIN_LOAD_MS");
    f.commit(&[("qwen.yaml", &failing)], "fails at start");
    f.start_agent(f.repo.to_str().unwrap(), "");
    f.wait_applied("qwen.service", 1);
    let st = f.e.state("qwen.service");
    assert_eq!(st["quarantine"].as_array().map(Vec::len), Some(1), "{st}");
    wait_until("specd_unit_down to be 1", Duration::from_secs(10), || unit_down(&f, "qwen.service") == Some(1))
        .unwrap();
    let o = f.e.specd(&["status"]);
    assert!(text(&o).contains("DOWN: Failed: qwen.service"), "{}", text(&o));

    // Cleared while the agent runs: it tries the unit again at once (and it fails again).
    let o = f.e.specd(&["unquarantine", "qwen.service"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("asked the running agent to reconcile qwen.service"), "{}", text(&o));
    f.wait_applied("qwen.service", 3);
    let hist = f.e.state("qwen.service")["history"].as_array().unwrap().clone();
    let outcomes: Vec<&str> = hist.iter().map(|h| h["outcome"].as_str().unwrap()).collect();
    assert_eq!(outcomes, ["failed", "unquarantined", "failed"]);

    // A working spec: up, and the metric says so.
    f.commit(&[("qwen.yaml", &f.spec("qwen.service", a, 5, 200, ""))], "works");
    f.wait_steps(a, 5, Duration::from_secs(30));
    wait_until("specd_unit_down to be 0", Duration::from_secs(10), || unit_down(&f, "qwen.service") == Some(0))
        .unwrap();
    f.e.b.shutdown().unwrap();
}

/// Connections that hold the agent's metrics port open without finishing a request: idle ones
/// that never send a byte, and slow ones that send a request's header a byte at a time and never
/// end it. Dropped (or on a panic): the slow writer stops and every socket is closed.
struct Flood {
    idle: Vec<std::net::TcpStream>,
    slow_opened: usize,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    writer: Option<std::thread::JoinHandle<()>>,
}

impl Flood {
    /// Opens `idle` + `slow` connections to 127.0.0.1:`port` (one slow one among every
    /// (idle + slow) / slow), all of them within `within`: a connect that fails (the backlog was
    /// full and the kernel dropped it) is tried again.
    fn open(port: u16, idle: usize, slow: usize, within: Duration) -> Flood {
        use std::io::Write;
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        let every = (idle + slow) / slow.max(1);
        let t0 = Instant::now();
        let (mut idles, mut slows) = (Vec::new(), Vec::new());
        let connect = || loop {
            let left = within.saturating_sub(t0.elapsed());
            if left.is_zero() {
                return None;
            }
            if let Ok(s) = std::net::TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(3))) {
                return Some(s);
            }
        };
        for i in 0..idle + slow {
            let Some(s) = connect() else { break };
            if i % every == every - 1 && slows.len() < slow {
                s.set_nonblocking(true).unwrap();
                let _ = (&s).write(b"G");
                slows.push(s);
            } else if idles.len() < idle {
                idles.push(s);
            }
        }
        let slow_opened = slows.len();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        // One byte of a header that never ends, to each slow connection every half second (the
        // pace of the attack, not a wait for anything); at most 5 minutes.
        let writer = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let header = b"ET /healthz HTTP/1.1\r\nHost: specd\r\nX-Slow: ";
                let mut sent = 1;
                let t0 = Instant::now();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) && t0.elapsed() < Duration::from_secs(300) {
                    let byte = header.get(sent - 1).copied().unwrap_or(b'a');
                    // A connection the agent closed fails its write and is let go.
                    slows.retain(|mut s| match s.write(&[byte]) {
                        Ok(_) => true,
                        Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
                    });
                    sent += 1;
                    std::thread::sleep(Duration::from_millis(500));
                }
            })
        };
        Flood { idle: idles, slow_opened, stop, writer: Some(writer) }
    }
}

impl Drop for Flood {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
        self.idle.clear();
    }
}

/// The agent's resident memory (VmRSS, KiB) and open descriptors.
fn agent_rss_and_fds(f: &Fleet) -> (u64, usize) {
    let pid = f.e.main_pid(AGENT);
    let status = f.e.b.read_to_string(&format!("/proc/{pid}/status")).unwrap();
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap();
    let fds = f.e.b.sh_check(&format!("ls /proc/{pid}/fd | wc -l")).unwrap().trim().parse().unwrap();
    (rss, fds)
}

/// Raise this process's limit of open files to hold `n` descriptors (root may raise the hard
/// limit too).
fn allow_open_files(n: u64) {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    if soft < n {
        setrlimit(Resource::RLIMIT_NOFILE, n.max(soft), n.max(hard)).unwrap();
    }
}

#[test]
fn a_flood_of_idle_and_slow_connections_to_the_metrics_port_starves_nothing() {
    const IDLE: usize = 3000;
    const SLOW: usize = 500;
    allow_open_files((IDLE + SLOW) as u64 + 1024);
    let f = Fleet::new();
    let a = f.e.port;
    f.commit(&[("qwen.yaml", &f.spec("qwen.service", a, 5, 200, ""))], "steps 5");
    // The limit of open files the campaign met (systemd's default soft limit), here also the hard
    // one: the agent cannot raise it, and its budget has to hold within it.
    f.run_agent(f.repo.to_str().unwrap(), "", "LimitNOFILE=1024\n");
    f.wait_steps(a, 5, Duration::from_secs(30));
    f.wait_applied("qwen.service", 1);
    let agent = f.e.main_pid(AGENT);
    let journal = || f.e.b.journal(AGENT).unwrap_or_default();

    let t0 = Instant::now();
    let flood = Flood::open(f.listen, IDLE, SLOW, Duration::from_secs(60));
    let opened = t0.elapsed();
    let (rss0, fds0) = agent_rss_and_fds(&f);

    // While they are held: a unit stopped by hand is started again...
    let before = f.e.main_pid("qwen.service");
    f.e.b.systemctl_check(&["stop", "qwen.service"]).unwrap();
    wait_until("the agent to start the unit again", Duration::from_secs(30), || {
        f.e.b.prop("qwen.service", "ActiveState").is_ok_and(|s| s == "active")
            && f.e.b.prop("qwen.service", "MainPID").is_ok_and(|p| p != "0" && p != before.to_string())
    })
    .unwrap_or_else(|err| panic!("{err}\nagent journal:\n{}", journal()));
    let restarted = t0.elapsed();
    let (rss1, fds1) = agent_rss_and_fds(&f);
    // ...a new commit is deployed...
    f.commit(&[("qwen.yaml", &f.spec("qwen.service", a, 10, 200, ""))], "steps 10");
    f.wait_steps(a, 10, Duration::from_secs(30));
    let deployed = t0.elapsed();
    // ...and /healthz answers (at the latest once the header time closed the connections that
    // fill the cap: a connection over it is closed at once).
    wait_until("/healthz to answer", Duration::from_secs(15), || {
        http_get(f.listen, "/healthz").is_some_and(|(c, b)| c == 200 && b == "ok\n")
    })
    .unwrap_or_else(|err| panic!("{err}\nagent journal:\n{}", journal()));
    let healthy = t0.elapsed();
    let (rss2, fds2) = agent_rss_and_fds(&f);
    eprintln!(
        "{} idle and {} slow connections opened in {opened:?}; unit restarted at {restarted:?}, commit deployed at {deployed:?}, /healthz at {healthy:?}; agent RSS {rss0}/{rss1}/{rss2} KiB, open descriptors {fds0}/{fds1}/{fds2}",
        flood.idle.len(),
        flood.slow_opened
    );
    for rss in [rss0, rss1, rss2] {
        assert!(rss < 64 * 1024, "the agent's RSS is {rss} KiB");
    }
    // The endpoint's cap and the control socket's leave half of the 1024 to the agent's own work.
    for fds in [fds0, fds1, fds2] {
        assert!(fds < 512, "the agent has {fds} descriptors open");
    }
    assert_eq!(f.e.main_pid(AGENT), agent, "the agent was restarted\n{}", journal());
    assert_eq!((flood.idle.len(), flood.slow_opened), (IDLE, SLOW), "the connections were not all opened");
    drop(flood);
    assert_eq!(http_get(f.listen, "/healthz").map(|(c, _)| c), Some(200));
    f.e.b.shutdown().unwrap();
}

/// An air-gapped site: the agent follows a local bare mirror that only bundles carried in
/// change. `specd bundle import` of a new bundle deploys at once (the mirror's refs are
/// watched: no poll); the older bundle carried in again is refused and the unit stays.
#[test]
fn a_bundle_carried_in_deploys_through_the_local_mirror_at_once() {
    let f = Fleet::new();
    let a = f.e.port;
    f.commit(&[("qwen.yaml", &f.spec("qwen.service", a, 5, 200, ""))], "steps 5");
    let mirror = f.dir.path().join("site/specd.git");
    let config = f.dir.path().join("import.yaml");
    std::fs::write(&config, format!("repo: {}\nbranch: main\npath: specs\n", mirror.display())).unwrap();
    let bundle = |name: &str| {
        let p = f.dir.path().join(name);
        git(&f.repo, &["bundle", "create", "-q", p.to_str().unwrap(), "main"]);
        p
    };
    let import = |b: &Path| f.e.specd(&["bundle", "import", b.to_str().unwrap(), "--config", config.to_str().unwrap()]);
    let old = bundle("one.bundle");
    let o = import(&old);
    assert!(o.status.success(), "{}", text(&o));
    f.start_agent(mirror.to_str().unwrap(), "");
    f.wait_steps(a, 5, Duration::from_secs(30));

    let c2 = f.commit(&[("qwen.yaml", &f.spec("qwen.service", a, 10, 200, ""))], "steps 10");
    let t0 = Instant::now();
    let o = import(&bundle("two.bundle"));
    assert!(o.status.success() && text(&o).contains("at once"), "{}", text(&o));
    f.wait_steps(a, 10, Duration::from_secs(30));
    eprintln!("import → served: {:?}", t0.elapsed());
    f.wait_source("the bundle's commit to be accepted", |s| s["accepted_commit"] == c2.as_str());

    let pid = f.e.main_pid("qwen.service");
    let o = import(&old);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("refusing to go backwards"), "{}", text(&o));
    let o = f.e.specd(&["reconcile"]);
    assert!(o.status.success(), "{}", text(&o));
    let st = text(&f.e.specd(&["status"]));
    assert!(st.contains(&format!("deployed commit {}", &c2[..12])), "{st}");
    assert_eq!((f.steps(a), f.e.main_pid("qwen.service")), (Some(10), pid));
    f.e.b.shutdown().unwrap();
}

/// A unit whose spec left the repository, left running (`prune: false`): its load balancers are
/// told ready while it serves its verified unit, and `down` once a person stops it (its serving
/// state follows what it runs; it used to stay `ready`, `GET /serving/<unit>` answering 200).
#[test]
fn an_orphan_stopped_by_hand_is_told_down_to_its_load_balancers() {
    let f = Fleet::new();
    let (a, b) = f.two_models();
    let told = "/run/specd/serving/model-b.service.json";
    let word = |w: &str| f.e.b.read_to_string(told).is_ok_and(|t| t.contains(&format!("\"state\":\"{w}\"")));
    wait_until("model-b to be told ready", Duration::from_secs(30), || word("ready")).unwrap();
    f.retire_model_b(b);
    assert!(word("ready"), "{:?}", f.e.b.read_to_string(told));
    f.e.b.systemctl_check(&["stop", "model-b.service"]).unwrap();
    wait_until("the stopped orphan to be told down", Duration::from_secs(30), || word("down")).unwrap_or_else(|e| {
        panic!("{e}: {:?}\nagent journal:\n{}", f.e.b.read_to_string(told), f.e.b.journal(AGENT).unwrap_or_default())
    });
    assert!(f.e.b.read_to_string(told).unwrap().contains("its service is not running"));
    assert_eq!(f.steps(a), Some(5));
    f.e.b.shutdown().unwrap();
}
