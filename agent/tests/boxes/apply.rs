//! `specd apply`, `status` and `diff` against a real systemd and the stand-in server: the seed's
//! race does not happen, the new config provably runs, drift is healed or reported, a failing
//! config rolls back, a lingering process blocks the start, a killed apply converges, and two
//! applies never interleave.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::*;

const UNIT: &str = "sglang-qwen.service";

/// When the server answered, and the steps it reported (if it answered).
type Answer = (Instant, Option<u64>);

/// A spec whose server drains slowly (20 tokens/s) under a short stop timeout, like the seed.
fn seed_extra(load_ms: u32) -> String {
    format!(
        "  service:\n    restart: always\n    restart_sec: 1\n    timeout_stop_sec: 2\n    environment: {{SPECD_STANDIN_LOAD_MS: \"{load_ms}\", SPECD_STANDIN_TOKENS_PER_SEC: \"20\"}}\n  readiness: {{timeout_sec: 60}}\n"
    )
}

/// The seed's spec at steps=10, whose server exits 3 at start.
fn failing(e: &Env) -> String {
    e.spec(
        UNIT,
        10,
        &seed_extra(100).replace("SPECD_STANDIN_LOAD_MS", "SPECD_STANDIN_EXIT_CODE: \"3\", SPECD_STANDIN_LOAD_MS"),
    )
}

fn apply(e: &Env, name: &str, yaml: &str) -> (bool, String) {
    let p = e.put(name, yaml);
    let o = e.specd(&["apply", "-f", &p, "--host", "gpu-01"]);
    (o.status.success(), text(&o))
}

fn rendered_hash(e: &Env, name: &str) -> String {
    let o = e.specd(&["render", &format!("/run/specs/{name}"), "--host", "gpu-01", "--hash"]);
    String::from_utf8(o.stdout).unwrap().trim().to_string()
}

fn deployed_hash(e: &Env) -> String {
    let b = e.b.read_file(&format!("/etc/systemd/system/{UNIT}")).unwrap();
    specd_spec::sha256_hex(&b)
}

#[test]
fn the_seed_after_ten_applies_each_serves_the_new_steps_and_reports_the_sigkill() {
    let e = Env::new();
    let (ok, out) = apply(&e, "s5.yaml", &e.spec(UNIT, 5, &seed_extra(300)));
    assert!(ok, "{out}");
    assert!(out.contains("Applied: sglang-qwen.service runs unit"), "{out}");
    assert_eq!(e.served_steps(), Some(5));

    // Watch what the server reports, all the time, from outside.
    let seen: Arc<Mutex<Vec<Answer>>> = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = {
        let (seen, stop, port) = (seen.clone(), stop.clone(), e.port);
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let steps = http_get(port, "/get_server_info")
                    .and_then(|(c, b)| (c == 200).then_some(b))
                    .and_then(|b| serde_json::from_str::<serde_json::Value>(&b).ok())
                    .and_then(|v| v["speculative_num_steps"].as_u64());
                seen.lock().unwrap().push((Instant::now(), steps));
                std::thread::sleep(Duration::from_millis(10));
            }
        })
    };

    let mut windows = Vec::new();
    for i in 0..10 {
        let target: u32 = if i % 2 == 0 { 10 } else { 5 };
        let reqs = e.in_flight(4, 400); // 20 s of streaming each: far longer than TimeoutStopSec=2
        let started = Instant::now();
        let (ok, out) = apply(&e, &format!("s{target}.yaml"), &e.spec(UNIT, target, &seed_extra(300)));
        let returned = Instant::now();
        assert!(ok, "apply {i}: {out}");
        assert!(
            out.contains("stopped by SIGKILL after TimeoutStopSec=2s while 4 requests were in flight — not an OOM"),
            "apply {i}: {out}"
        );
        assert_eq!(e.served_steps(), Some(u64::from(target)), "apply {i}: {out}");
        let pid = e.main_pid(UNIT);
        let cmdline = e.b.read_to_string(&format!("/proc/{pid}/cmdline")).unwrap();
        assert!(cmdline.contains(&format!("--speculative-num-steps\0{target}\0")), "{cmdline:?}");
        windows.push((started, returned, target));
        for r in reqs {
            r.join().unwrap();
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    watcher.join().unwrap();

    // After each apply returned, until the next one started, only the new config ever answered.
    let seen = seen.lock().unwrap();
    for (k, (_, from, target)) in windows.iter().enumerate() {
        let until = windows.get(k + 1).map(|w| w.0);
        let stale: Vec<_> = seen
            .iter()
            .filter(|(t, s)| t > from && until.is_none_or(|u| *t < u) && s.is_some_and(|s| s != u64::from(*target)))
            .collect();
        assert!(stale.is_empty(), "apply {k}: a stale instance answered after the apply returned: {stale:?}");
    }
    let answers = seen.iter().filter(|(_, s)| s.is_some()).count();
    assert!(answers > 50, "the watcher saw only {answers} answers");
    // The history records each apply and how the previous instance ended.
    let st = e.state(UNIT);
    let hist = st["history"].as_array().unwrap();
    assert_eq!(hist.len(), 11);
    assert!(
        hist[1..]
            .iter()
            .all(|h| h["outcome"] == "applied" && h["stop_verdict"].as_str().unwrap().contains("not an OOM"))
    );
    e.b.shutdown().unwrap();
}

/// `status` says how the last instance ended without reading the journal while the instance
/// specd started after it runs; after a restart specd did not make, or a stop, it reads the
/// journal again.
#[test]
fn status_tells_the_last_ending_from_state_until_an_instance_ends_behind_specd_s_back() {
    let e = Env::new();
    let (ok, out) = apply(&e, "s5.yaml", &e.spec(UNIT, 5, &seed_extra(100)));
    assert!(ok, "{out}");
    let (ok, out) = apply(&e, "s6.yaml", &e.spec(UNIT, 6, &seed_extra(100)));
    assert!(ok, "{out}");
    let last_ended = |o: &std::process::Output| {
        text(o).lines().find(|l| l.trim_start().starts_with("last ended:")).map(|l| l.trim().to_string())
    };
    let with_journal = e.specd(&["status"]);
    let ended = last_ended(&with_journal).unwrap_or_else(|| panic!("{}", text(&with_journal)));
    // What the journal's own diagnosis says of the instance the apply stopped.
    let d: serde_json::Value = serde_json::from_slice(&e.specd(&["diagnose", UNIT, "--json"]).stdout).unwrap();
    let stopped = d.as_array().unwrap().iter().find(|x| !x["ended"].is_null()).unwrap();
    // The same verdict (its figures may differ by the lines journald had when each read it).
    let verdict = stopped["summary"].as_str().unwrap().split(':').next().unwrap();
    assert!(ended.starts_with(&format!("last ended: {verdict}:")), "{ended} / {stopped}");
    // No journal at all (journalctl fails): the same line, from specd's state.
    e.b.check(&["mount", "--bind", "/bin/false", "/usr/bin/journalctl"]).unwrap();
    let without = e.specd(&["status"]);
    assert_eq!(last_ended(&without).as_deref(), Some(ended.as_str()), "{}", text(&without));
    // The server dies and systemd starts it again (Restart=always): the state's record is about
    // an instance that is gone, so status asks the journal, which cannot answer here.
    let pid = e.main_pid(UNIT);
    e.b.check(&["kill", "-9", &pid.to_string()]).unwrap();
    wait_until("systemd to start the server again", Duration::from_secs(30), || {
        let p = e.main_pid(UNIT);
        p != 0 && p != pid
    })
    .unwrap();
    let after = e.specd(&["status"]);
    assert_eq!(last_ended(&after), None, "{}", text(&after));
    e.b.check(&["umount", "/usr/bin/journalctl"]).unwrap();
    let after = e.specd(&["status"]);
    let ended = last_ended(&after).unwrap_or_else(|| panic!("{}", text(&after)));
    assert!(ended.contains("signal") || ended.contains("KILL") || ended.contains("crash"), "{ended}");
    // Stopped from outside right after an apply: the last instance is the one specd started,
    // stopped by systemctl, not the one the apply stopped (systemd keeps a stopped unit's
    // InvocationID, which is the one specd's record names).
    let (ok, out) = apply(&e, "s7.yaml", &e.spec(UNIT, 7, &seed_extra(100)));
    assert!(ok, "{out}");
    let applied = e.specd(&["status"]);
    let by_apply = last_ended(&applied).unwrap_or_else(|| panic!("{}", text(&applied)));
    e.b.check(&["systemctl", "stop", UNIT]).unwrap();
    let stopped = e.specd(&["status"]);
    let line = last_ended(&stopped).unwrap_or_else(|| panic!("{}", text(&stopped)));
    // (The stand-in drains past its TimeoutStopSec: a clean stop, or systemd's SIGKILL.)
    assert!(line != by_apply && !line.contains("by specd"), "{} / {by_apply}", text(&stopped));
    assert!(line.contains("clean stop: stopped on request") || line.contains("stop-timeout SIGKILL"), "{line}");
    e.b.shutdown().unwrap();
}

#[test]
fn an_in_sync_apply_restarts_nothing_and_status_is_green() {
    let e = Env::new();
    let yaml = e.spec(UNIT, 5, &seed_extra(100));
    let (ok, out) = apply(&e, "s.yaml", &yaml);
    assert!(ok, "{out}");
    let pid = e.main_pid(UNIT);
    let (ok, out) = apply(&e, "s.yaml", &yaml);
    assert!(ok, "{out}");
    assert!(out.contains("InSync: sglang-qwen.service runs unit"), "{out}");
    assert_eq!(e.main_pid(UNIT), pid, "an in-sync server was restarted");
    let o = e.specd(&["status"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(text(&o).contains("sglang-qwen.service: InSync Healthy"), "{}", text(&o));
    let o = e.specd(&["status", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["units"][0]["sync"], "InSync");
    assert_eq!(v["units"][0]["cmdline_matches"], true);
    let o = e.specd(&["diff", "-f", "/run/specs/s.yaml", "--host", "gpu-01"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    // A dry run of a change plans the full sequence and changes nothing.
    let p = e.put("s9.yaml", &e.spec(UNIT, 9, &seed_extra(100)));
    let o = e.specd(&["apply", "-f", &p, "--dry-run", "--host", "gpu-01"]);
    assert!(o.status.success());
    assert!(
        text(&o).contains(
            "plan: Drain → Stop → WaitStopped → WriteUnit → Reload → Start → VerifyCmdline → WaitReady → VerifyArgs"
        ),
        "{}",
        text(&o)
    );
    assert_eq!(e.main_pid(UNIT), pid);
    assert_eq!(e.served_steps(), Some(5));
    e.b.shutdown().unwrap();
}

#[test]
fn a_hand_edit_is_drift_healed_by_default_and_only_reported_under_report_policy() {
    let e = Env::new();
    let (ok, out) = apply(&e, "s.yaml", &e.spec(UNIT, 5, &seed_extra(100)));
    assert!(ok, "{out}");
    let path = format!("/etc/systemd/system/{UNIT}");
    let edit = |e: &Env| {
        let t = e.b.read_to_string(&path).unwrap().replace("RestartSec=1", "RestartSec=30");
        e.b.write_file(&path, t).unwrap();
    };
    edit(&e);
    let o = e.specd(&["status"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("sglang-qwen.service: Drifted"), "{}", text(&o));
    assert!(text(&o).contains("edited by hand"), "{}", text(&o));
    let o = e.specd(&["diff", "-f", "/run/specs/s.yaml", "--host", "gpu-01"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o).contains("-RestartSec=30\n+RestartSec=1\n"), "{}", text(&o));
    let (ok, out) = apply(&e, "s.yaml", &e.spec(UNIT, 5, &seed_extra(100)));
    assert!(ok, "{out}");
    assert!(out.contains("Drifted") && out.contains("Applied"), "{out}");
    assert_eq!(deployed_hash(&e), rendered_hash(&e, "s.yaml"));
    assert_eq!(e.specd(&["status"]).status.code(), Some(0));

    // Report policy: the edit stays, and apply says so.
    let report = e.spec(UNIT, 5, &(seed_extra(100) + "  policy: {drift: report}\n"));
    let (ok, out) = apply(&e, "r.yaml", &report);
    assert!(ok, "{out}");
    edit(&e);
    let (ok, out) = apply(&e, "r.yaml", &report);
    assert!(!ok, "a reported drift exits 1: {out}");
    assert!(out.contains("Drifted: the unit file was edited by hand"), "{out}");
    assert!(e.b.read_to_string(&path).unwrap().contains("RestartSec=30"));
    e.b.shutdown().unwrap();
}

#[test]
fn a_config_that_fails_to_start_rolls_back_and_is_not_retried() {
    let e = Env::new();
    let (ok, out) = apply(&e, "s5.yaml", &e.spec(UNIT, 5, &seed_extra(100)));
    assert!(ok, "{out}");
    let bad = failing(&e);
    let (ok, out) = apply(&e, "bad.yaml", &bad);
    assert!(!ok, "{out}");
    assert!(out.contains("RolledBack: sglang-qwen.service"), "{out}");
    assert!(out.contains("restored the last good unit"), "{out}");
    assert_eq!(e.served_steps(), Some(5), "the previous unit serves again");
    assert_eq!(deployed_hash(&e), rendered_hash(&e, "s5.yaml"));
    let o = e.specd(&["status"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o).contains("sglang-qwen.service: Failed"), "{}", text(&o));
    assert!(text(&o).contains("status 3") || text(&o).contains("exit"), "{}", text(&o));
    // The same bad spec again: nothing is restarted.
    let pid = e.main_pid(UNIT);
    let (ok, out) = apply(&e, "bad.yaml", &bad);
    assert!(!ok);
    assert!(out.contains("is not retried"), "{out}");
    assert_eq!(e.main_pid(UNIT), pid);
    // A new spec is tried.
    let (ok, out) = apply(&e, "s7.yaml", &e.spec(UNIT, 7, &seed_extra(100)));
    assert!(ok, "{out}");
    assert_eq!(e.served_steps(), Some(7));
    e.b.shutdown().unwrap();
}

#[test]
fn without_a_last_good_unit_a_failing_config_is_left_stopped() {
    let e = Env::new();
    let bad = failing(&e);
    let (ok, out) = apply(&e, "bad.yaml", &bad);
    assert!(!ok);
    assert!(out.contains("there is no last good unit to roll back to, so the service is left stopped"), "{out}");
    let s = e.b.prop(UNIT, "ActiveState").unwrap();
    assert!(s == "inactive" || s == "failed", "{s}");
    e.b.shutdown().unwrap();
}

#[test]
fn a_process_that_ignores_sigterm_blocks_the_start_and_is_named() {
    let e = Env::new();
    // A hand-written unit from before specd, whose KillMode lets a child outlive the stop.
    let old = format!(
        "[Service]\nType=exec\nKillMode=process\nEnvironment=SPECD_STANDIN_LINGER_CHILD=1\nExecStart={} sglang --model-path /models/old --port {}\n",
        e.standin, e.port
    );
    e.b.write_file(&format!("/etc/systemd/system/{UNIT}"), &old).unwrap();
    e.b.systemctl_check(&["daemon-reload"]).unwrap();
    e.b.systemctl_check(&["start", UNIT]).unwrap();
    wait_until("the old server to answer", Duration::from_secs(30), || e.server_info().is_some()).unwrap();
    let yaml = e.spec(UNIT, 5, "  service: {timeout_stop_sec: 1}\n  policy: {adopt: true}\n");
    let (ok, out) = apply(&e, "s.yaml", &yaml);
    assert!(!ok, "{out}");
    assert!(out.contains("still in the unit's cgroup"), "{out}");
    assert!(out.contains("not starting a new instance over them"), "{out}");
    assert!(out.contains("specd-standin"), "the lingering command line is named: {out}");
    assert_eq!(e.b.read_to_string(&format!("/etc/systemd/system/{UNIT}")).unwrap(), old, "the unit file is untouched");
    assert_eq!(e.b.prop(UNIT, "ActiveState").unwrap(), "inactive");
    e.b.shutdown().unwrap();
}

/// `specd apply -f PATH` in the background, its output piped.
fn spawn_apply(e: &Env, path: &str) -> std::process::Child {
    e.b.command(&[&e.specd, "apply", "-f", path, "--host", "gpu-01"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

/// Until the apply in progress records `phase` in its state file.
fn wait_for_phase(e: &Env, phase: &str) {
    let state_path = format!("/var/lib/specd/units/{UNIT}.json");
    wait_until(&format!("the apply to reach {phase}"), Duration::from_secs(60), || {
        e.b.read_to_string(&state_path)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .is_some_and(|v| v["in_progress"]["phase"] == phase)
    })
    .unwrap();
}

/// Kill `specd apply` with SIGKILL once its recorded phase is `phase`, then apply again. Waits
/// (the stop, readiness) are long enough to kill in on the real host; a crash between any two
/// quick calls (after the write, after the reload) is the reconciler's fault matrix on the fake
/// host, and the random kill campaign below.
fn kill_at(phase: &str, load_ms: u32) {
    let e = Env::new();
    let (ok, out) = apply(&e, "s5.yaml", &e.spec(UNIT, 5, &seed_extra(load_ms)));
    assert!(ok, "{out}");
    let old = deployed_hash(&e);
    let p = e.put("s10.yaml", &e.spec(UNIT, 10, &seed_extra(load_ms)));
    let new = rendered_hash(&e, "s10.yaml");
    let reqs = e.in_flight(2, 400);
    let mut child = spawn_apply(&e, &p);
    wait_for_phase(&e, phase);
    let k = e.b.exec(&["pkill", "-KILL", "-f", "specd apply"]);
    assert!(k.status.success(), "{}", text(&k));
    let _ = child.wait();
    let at_kill = deployed_hash(&e);
    assert!(at_kill == old || at_kill == new, "the unit file is neither old nor new after a kill at {phase}");
    let (ok, out) = apply(&e, "s10.yaml", &e.spec(UNIT, 10, &seed_extra(load_ms)));
    assert!(ok, "after a kill at {phase}: {out}");
    assert!(out.contains("interrupted") || out.contains("Applied") || out.contains("InSync"), "{out}");
    assert_eq!(e.served_steps(), Some(10), "{out}");
    assert_eq!(deployed_hash(&e), new);
    assert_eq!(e.specd(&["status"]).status.code(), Some(0));
    for r in reqs {
        r.join().unwrap();
    }
    e.b.shutdown().unwrap();
}

#[test]
fn killed_while_waiting_for_the_stop_then_applied_again_converges() {
    kill_at("WaitStopped", 100);
}

#[test]
fn killed_during_readiness_then_applied_again_converges() {
    kill_at("WaitReady", 3000);
}

/// An apply of a spec whose server fails (CUDA OOM after a 3 s load) is killed while it waits
/// for readiness: the old instance is stopped and the new unit written. The next apply finishes
/// it as the killed one would have: the new server fails, the last good unit is rolled back to
/// and serves, and the failed hash is quarantined (not retried with the service down).
#[test]
fn a_failing_spec_whose_apply_was_killed_is_rolled_back_by_the_next_apply() {
    let e = Env::new();
    let (ok, out) = apply(&e, "s5.yaml", &e.spec(UNIT, 5, &seed_extra(100)));
    assert!(ok, "{out}");
    let oom = e.spec(
        UNIT,
        10,
        &seed_extra(3000).replace("SPECD_STANDIN_LOAD_MS", "SPECD_STANDIN_CUDA_OOM: \"1\", SPECD_STANDIN_LOAD_MS"),
    );
    let p = e.put("oom.yaml", &oom);
    let mut child = spawn_apply(&e, &p);
    wait_for_phase(&e, "WaitReady");
    assert!(e.b.exec(&["pkill", "-KILL", "-f", "specd apply"]).status.success());
    let _ = child.wait();
    let (ok, out) = apply(&e, "oom.yaml", &oom);
    assert!(!ok, "{out}");
    assert!(out.contains("RolledBack"), "{out}");
    assert!(out.contains("is quarantined"), "{out}");
    assert_eq!(e.served_steps(), Some(5), "the last good unit serves again: {out}");
    let st = e.state(UNIT);
    assert!(st["in_progress"].is_null(), "{st}");
    assert_eq!(st["quarantine"].as_array().map(Vec::len), Some(1), "{st}");
    e.b.shutdown().unwrap();
}

#[test]
fn two_concurrent_applies_on_one_unit_are_serialized() {
    let e = Env::new();
    let (ok, out) = apply(&e, "s5.yaml", &e.spec(UNIT, 5, &seed_extra(1000)));
    assert!(ok, "{out}");
    // The first loads for 3 s: the second waits for it that long at least.
    let a = e.put("a.yaml", &e.spec(UNIT, 7, &seed_extra(3000)));
    let b = e.put("b.yaml", &e.spec(UNIT, 9, &seed_extra(1000)));
    let pa =
        e.b.command(&[&e.specd, "apply", "-f", &a, "--host", "gpu-01"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
    let state_path = format!("/var/lib/specd/units/{UNIT}.json");
    // The first holds the unit (an apply is in progress) before the second starts.
    wait_until("the first apply to start", Duration::from_secs(30), || {
        e.b.read_to_string(&state_path)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .is_some_and(|v| !v["in_progress"].is_null())
    })
    .unwrap();
    let mut pb =
        e.b.command(&[&e.specd, "apply", "-f", &b, "--host", "gpu-01"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
    // The second's stderr is a pipe (CI, `| tee`, ssh): each line with when it arrived.
    let err = pb.stderr.take().unwrap();
    let lines = std::thread::spawn(move || {
        use std::io::BufRead;
        std::io::BufReader::new(err)
            .lines()
            .map_while(Result::ok)
            .map(|l| (std::time::Instant::now(), l))
            .collect::<Vec<_>>()
    });
    let oa = pa.wait_with_output().unwrap();
    let a_done = std::time::Instant::now();
    let ob = pb.wait_with_output().unwrap();
    let lines = lines.join().unwrap();
    let all = lines.iter().map(|(_, l)| l.as_str()).collect::<Vec<_>>().join("\n");
    assert!(oa.status.success() && ob.status.success(), "{}\n---\n{all}", text(&oa));
    // Said while it waits, not held back until the wait is over.
    let waiting = lines.iter().find(|(_, l)| l.contains("waiting: another specd is reconciling sglang-qwen.service"));
    let (at, _) = waiting.unwrap_or_else(|| panic!("no waiting line in:\n{all}"));
    assert!(*at < a_done, "the waiting line reached the pipe only after the first apply ended:\n{all}");
    assert_eq!(e.served_steps(), Some(9), "the second apply ran after the first, whole");
    let hist = e.state(UNIT)["history"].as_array().unwrap().clone();
    let last: Vec<&str> = hist.iter().rev().take(2).map(|h| h["outcome"].as_str().unwrap()).collect();
    assert_eq!(last, ["applied", "applied"]);
    e.b.shutdown().unwrap();
}

#[test]
fn a_bad_spec_changes_nothing_on_the_host() {
    let e = Env::new();
    let (ok, out) = apply(&e, "s5.yaml", &e.spec(UNIT, 5, &seed_extra(100)));
    assert!(ok, "{out}");
    let pid = e.main_pid(UNIT);
    let before = deployed_hash(&e);
    let bad = e.spec(UNIT, 5, &seed_extra(100)).replace("num_draft_tokens: 6", "num_draft_tokens: 4");
    let (ok, out) = apply(&e, "bad.yaml", &bad);
    assert!(!ok);
    assert!(out.contains("/run/specs/bad.yaml:10:"), "{out}");
    assert!(out.contains("spec.speculative.num_draft_tokens"), "{out}");
    assert!(out.contains("nothing was changed on this host"), "{out}");
    assert_eq!(deployed_hash(&e), before);
    assert_eq!(e.main_pid(UNIT), pid);
    e.b.shutdown().unwrap();
}

#[test]
fn with_an_adequate_drain_budget_the_stop_needs_no_sigkill() {
    let e = Env::new();
    let extra = "  service:\n    restart: always\n    timeout_stop_sec: 2\n    drain_timeout_sec: 30\n    environment: {SPECD_STANDIN_LOAD_MS: \"100\", SPECD_STANDIN_TOKENS_PER_SEC: \"20\", SPECD_STANDIN_DRAIN_POLL_MS: \"100\"}\n";
    let (ok, out) = apply(&e, "s5.yaml", &e.spec(UNIT, 5, extra));
    assert!(ok, "{out}");
    // 4 requests of 200 tokens at 20 tokens/s: 10 s each, longer than TimeoutStopSec=2 but well
    // within the drain budget, and long enough that all 4 are still in flight when the apply
    // begins on a busy machine (at 3 s each, two had ended once).
    let done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let port = e.port;
    let reqs: Vec<_> = (0..4)
        .map(|_| {
            let done = done.clone();
            std::thread::spawn(move || {
                let body = r#"{"text":"hello","sampling_params":{"max_new_tokens":200},"stream":true}"#;
                let r = http(port, "POST", "/generate", Some(body), Duration::from_secs(60));
                if r.is_some_and(|(c, b)| c == 200 && b.contains("data: [DONE]")) {
                    done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            })
        })
        .collect();
    wait_until("the requests to be in flight", Duration::from_secs(20), || e.running_requests().unwrap_or(0) >= 4)
        .unwrap();
    let (ok, out) = apply(&e, "s10.yaml", &e.spec(UNIT, 10, extra));
    assert!(ok, "{out}");
    assert!(out.contains("draining: 4 requests in flight"), "{out}");
    assert!(!out.contains("stopped by SIGKILL"), "{out}");
    for r in reqs {
        r.join().unwrap();
    }
    assert_eq!(done.load(std::sync::atomic::Ordering::Relaxed), 4, "every request finished: {out}");
    assert_eq!(e.served_steps(), Some(10));
    let hist = e.state(UNIT)["history"].as_array().unwrap().clone();
    assert!(hist.last().unwrap()["stop_verdict"].is_null(), "{hist:?}");
    // The validator warns when the stop timeout is shorter than the drain budget.
    let o = e.specd(&["validate", "/run/specs/s10.yaml"]);
    assert!(o.status.success());
    assert!(
        text(&o).contains("warning: spec.service.timeout_stop_sec: is 2 s, shorter than the drain budget"),
        "{}",
        text(&o)
    );
    e.b.shutdown().unwrap();
}

#[test]
fn a_host_left_on_a_quarantined_unit_is_restored_to_the_last_good_one() {
    // What an interrupted rollback leaves: the failed unit on disk, the service stopped.
    let e = Env::new();
    let (ok, out) = apply(&e, "s5.yaml", &e.spec(UNIT, 5, &seed_extra(100)));
    assert!(ok, "{out}");
    let bad = failing(&e);
    let (_, out) = apply(&e, "bad.yaml", &bad);
    assert!(out.contains("RolledBack"), "{out}");
    let bad_unit = e.specd(&["render", "/run/specs/bad.yaml", "--host", "gpu-01"]).stdout;
    e.b.systemctl_check(&["stop", UNIT]).unwrap();
    e.b.write_file(&format!("/etc/systemd/system/{UNIT}"), &bad_unit).unwrap();
    e.b.systemctl_check(&["daemon-reload"]).unwrap();
    let (ok, out) = apply(&e, "bad.yaml", &bad);
    assert!(!ok, "the desired spec is still quarantined: {out}");
    assert!(
        out.contains("restoring it") && out.contains("RolledBack: sglang-qwen.service: restored the last good unit"),
        "{out}"
    );
    assert_eq!(e.served_steps(), Some(5));
    assert_eq!(deployed_hash(&e), rendered_hash(&e, "s5.yaml"));
    e.b.shutdown().unwrap();
}

/// A tiny tmpfs over a directory of the box, so that a test can fill it.
fn tiny_tmpfs(e: &Env, dir: &str, size: &str) {
    e.b.sh_check(&format!("mkdir -p {dir} && mount -t tmpfs -o size={size},mode=755 specd-test-tiny {dir}")).unwrap();
}

/// Fill the file system of `dir` (dd stops at ENOSPC).
fn fill(e: &Env, dir: &str) {
    e.b.sh(&format!("dd if=/dev/zero of={dir}/fill bs=4k 2>/dev/null; sync"));
    let o = e.b.sh(&format!("echo x > {dir}/probe-full"));
    assert!(!o.status.success(), "{dir} is not full");
}

#[test]
fn a_full_unit_dir_after_the_stop_starts_the_old_unit_again() {
    let e = Env::new();
    tiny_tmpfs(&e, "/etc/systemd/system", "64k");
    let (ok, out) = apply(&e, "s5.yaml", &e.spec(UNIT, 5, &seed_extra(100)));
    assert!(ok, "{out}");
    let old = deployed_hash(&e);
    fill(&e, "/etc/systemd/system");
    let (ok, out) = apply(&e, "s10.yaml", &e.spec(UNIT, 10, &seed_extra(100)));
    assert!(!ok, "{out}");
    assert!(out.contains("WriteUnit failed") && out.contains("No space left on device"), "{out}");
    assert!(out.contains("started the last good unit") && out.contains("again and it serves"), "{out}");
    assert!(!out.contains("DOWN"), "{out}");
    assert_eq!(e.served_steps(), Some(5), "the old unit serves again");
    assert_eq!(deployed_hash(&e), old);
    assert_eq!(e.b.prop(UNIT, "ActiveState").unwrap(), "active");
    // Space again: the new unit is applied.
    e.b.sh_check("rm /etc/systemd/system/fill").unwrap();
    let (ok, out) = apply(&e, "s10.yaml", &e.spec(UNIT, 10, &seed_extra(100)));
    assert!(ok, "{out}");
    assert_eq!(e.served_steps(), Some(10));
    e.b.shutdown().unwrap();
}

/// The state dir fills while a failing spec's server loads (its unit already written): the
/// rollback must still write the last good unit back and start it, though it cannot record that.
#[test]
fn a_full_state_dir_does_not_stop_a_rollback() {
    let e = Env::new();
    tiny_tmpfs(&e, "/var/lib/specd", "1m");
    let (ok, out) = apply(&e, "s5.yaml", &e.spec(UNIT, 5, &seed_extra(100)));
    assert!(ok, "{out}");
    let old = deployed_hash(&e);
    let oom = e.spec(
        UNIT,
        10,
        &seed_extra(3000).replace("SPECD_STANDIN_LOAD_MS", "SPECD_STANDIN_CUDA_OOM: \"1\", SPECD_STANDIN_LOAD_MS"),
    );
    let p = e.put("oom.yaml", &oom);
    let child = spawn_apply(&e, &p);
    wait_for_phase(&e, "WaitReady");
    fill(&e, "/var/lib/specd");
    let o = child.wait_with_output().unwrap();
    let out = text(&o);
    assert_eq!(o.status.code(), Some(1), "{out}");
    assert!(out.contains("could not record the write in specd's state"), "{out}");
    assert!(out.contains("RolledBack") && out.contains("it serves again"), "{out}");
    assert_eq!(e.served_steps(), Some(5), "the last good unit serves again: {out}");
    assert_eq!(deployed_hash(&e), old);
    e.b.shutdown().unwrap();
}

#[test]
fn a_full_state_dir_while_stopping_starts_the_old_unit_again() {
    let e = Env::new();
    tiny_tmpfs(&e, "/var/lib/specd", "1m");
    let (ok, out) = apply(&e, "s5.yaml", &e.spec(UNIT, 5, &seed_extra(100)));
    assert!(ok, "{out}");
    let old = deployed_hash(&e);
    let p = e.put("s10.yaml", &e.spec(UNIT, 10, &seed_extra(100)));
    // In-flight requests hold the stop for TimeoutStopSec=2: the state dir fills meanwhile.
    let reqs = e.in_flight(2, 400);
    let child = spawn_apply(&e, &p);
    wait_for_phase(&e, "WaitStopped");
    fill(&e, "/var/lib/specd");
    let o = child.wait_with_output().unwrap();
    let out = text(&o);
    assert_eq!(o.status.code(), Some(1), "{out}");
    assert!(out.contains("WriteUnit failed") && out.contains("No space left on device"), "{out}");
    assert!(out.contains("started the last good unit") && out.contains("again and it serves"), "{out}");
    assert!(out.contains("specd's state could not be saved"), "{out}");
    assert_eq!(e.served_steps(), Some(5), "the old unit serves again");
    assert_eq!(deployed_hash(&e), old);
    for r in reqs {
        r.join().unwrap();
    }
    e.b.sh_check("rm /var/lib/specd/fill").unwrap();
    let (ok, out) = apply(&e, "s10.yaml", &e.spec(UNIT, 10, &seed_extra(100)));
    assert!(ok, "{out}");
    assert_eq!(e.served_steps(), Some(10));
    e.b.shutdown().unwrap();
}

#[test]
fn without_anything_to_start_again_the_verdict_and_status_say_the_service_is_down() {
    let e = Env::new();
    // A unit that ran before specd, not ready when specd took over: nothing known good.
    let (ok, out) = apply(&e, "bad.yaml", &failing(&e));
    assert!(!ok, "{out}");
    assert!(out.contains("is DOWN (") && out.contains("left stopped"), "{out}");
    let o = e.specd(&["status"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o).contains("sglang-qwen.service: Failed Down"), "{}", text(&o));
    assert!(text(&o).contains("DOWN: "), "{}", text(&o));
    e.b.shutdown().unwrap();
}

/// The seed's spec at `steps` whose server crashes right after its first readiness answer while
/// `/run/crash-after-ready` exists.
fn crashing(e: &Env, steps: u32) -> String {
    e.spec(
        UNIT,
        steps,
        &seed_extra(100).replace(
            "SPECD_STANDIN_LOAD_MS",
            "SPECD_STANDIN_CRASH_AFTER_READY: \"/run/crash-after-ready\", SPECD_STANDIN_LOAD_MS",
        ),
    )
}

#[test]
fn a_crash_after_readiness_is_named_and_quarantines_only_a_unit_never_verified() {
    let e = Env::new();
    let (ok, out) = apply(&e, "x.yaml", &crashing(&e, 5));
    assert!(ok, "{out}");
    let (ok, out) = apply(&e, "y.yaml", &crashing(&e, 7));
    assert!(ok, "{out}");

    // A unit that passed verification before crashes once right after readiness: a crash, not a
    // failed start; retried, not quarantined.
    e.b.write_file("/run/crash-after-ready", "").unwrap();
    let (ok, out) = apply(&e, "x.yaml", &crashing(&e, 5));
    assert!(!ok, "{out}");
    assert!(out.contains("crashed after it was ready"), "{out}");
    assert!(!out.contains("exited while loading"), "{out}");
    assert!(out.contains("passed verification before") && out.contains("retried with backoff"), "{out}");
    assert_eq!(e.state(UNIT)["quarantine"], serde_json::json!([]));
    // systemd restarted it (Restart=always); the next apply finds it in sync.
    wait_until("the restarted server to be ready", Duration::from_secs(30), || {
        http_get(e.port, "/health_generate").is_some_and(|(c, _)| c == 200)
    })
    .unwrap();
    let (ok, out) = apply(&e, "x.yaml", &crashing(&e, 5));
    assert!(ok && out.contains("InSync"), "{out}");
    assert_eq!(e.specd(&["status"]).status.code(), Some(0), "the failure is over");

    // A unit never verified that crashes after readiness is quarantined, and rolled back.
    e.b.write_file("/run/crash-after-ready", "").unwrap();
    let (ok, out) = apply(&e, "z.yaml", &crashing(&e, 9));
    assert!(!ok, "{out}");
    assert!(out.contains("crashed after it was ready") && out.contains("RolledBack"), "{out}");
    assert_eq!(e.served_steps(), Some(5));
    let (ok, out) = apply(&e, "z.yaml", &crashing(&e, 9));
    assert!(!ok && out.contains("is not retried"), "{out}");

    // `specd unquarantine` clears it, in the history; the unit is tried again.
    let o = e.specd(&["unquarantine", UNIT]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("cleared"), "{}", text(&o));
    let h = text(&e.specd(&["history", UNIT]));
    assert!(h.contains("Unquarantined"), "{h}");
    let (ok, out) = apply(&e, "z.yaml", &crashing(&e, 9));
    assert!(ok, "{out}");
    assert_eq!(e.served_steps(), Some(9));
    e.b.shutdown().unwrap();
}

#[test]
fn a_corrupt_state_file_affects_only_its_unit_and_read_only_commands_work_on_a_read_only_state_dir() {
    let e = Env::new();
    let (ok, out) = apply(&e, "s5.yaml", &e.spec(UNIT, 5, &seed_extra(100)));
    assert!(ok, "{out}");
    let other = sglang_spec(&e.standin, "other.service", free_port(), 5, &seed_extra(100));
    let (ok, out) = apply(&e, "other.yaml", &other);
    assert!(ok, "{out}");
    let pid = e.main_pid(UNIT);
    e.b.write_file(&format!("/var/lib/specd/units/{UNIT}.json"), "{\"unit\": \"sglang-qwen.service\", \"hist").unwrap();

    let o = e.specd(&["status"]);
    let out = text(&o);
    assert_ne!(o.status.code(), Some(2), "{out}");
    assert!(out.contains("other.service: InSync Healthy"), "{out}");
    assert!(out.contains(&format!("/var/lib/specd/units/{UNIT}.json is corrupt")), "{out}");
    let o = e.specd(&["history"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("other.service"), "{}", text(&o));
    let files = e.b.sh_check("ls /var/lib/specd/units").unwrap();
    assert!(!files.contains(".corrupt-"), "a read-only command moved the file: {files}");

    // The next apply moves it aside, under the unit's lock, and observes the unit afresh from
    // the host: it runs its deployed unit; nothing restarts.
    let (ok, out) = apply(&e, "s5.yaml", &e.spec(UNIT, 5, &seed_extra(100)));
    assert!(ok && out.contains("InSync"), "{out}");
    assert!(out.contains("moved it aside"), "{out}");
    let aside = e.b.sh_check("ls /var/lib/specd/units").unwrap();
    assert!(aside.contains(&format!("{UNIT}.json.corrupt-")), "{aside}");
    assert_eq!(e.main_pid(UNIT), pid);
    assert_eq!(e.state(UNIT)["last_good"]["sha256"], deployed_hash(&e).as_str());

    // Read-only commands on a read-only state dir.
    e.b.sh_check("mount --bind /var/lib/specd /var/lib/specd && mount -o remount,bind,ro /var/lib/specd").unwrap();
    let o = e.specd(&["status"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let o = e.specd(&["history", UNIT]);
    assert!(o.status.success(), "{}", text(&o));
    e.b.shutdown().unwrap();
}

#[test]
fn state_is_private_and_an_open_state_dir_is_fixed() {
    let e = Env::new();
    // State left by an older specd: world-readable.
    e.b.sh_check("mkdir -p /var/lib/specd/units && chmod 755 /var/lib/specd /var/lib/specd/units && echo '{\"unit\": \"x.service\"}' > /var/lib/specd/units/x.service.json && chmod 644 /var/lib/specd/units/x.service.json").unwrap();
    // A literal secret, allowed explicitly: the state that keeps the spec must be private.
    let extra = seed_extra(100)
        .replace("SPECD_STANDIN_LOAD_MS", "HF_TOKEN: \"hf_secret\", SPECD_STANDIN_LOAD_MS")
        .replace("  service:\n", "  service:\n    allow_literal_secrets: true\n");
    let (ok, out) = apply(&e, "s5.yaml", &e.spec(UNIT, 5, &extra));
    assert!(ok, "{out}");
    let modes = e.b.sh_check(&format!(
        "stat -c '%a %n' /var/lib/specd /var/lib/specd/units /var/lib/specd/locks /var/lib/specd/units/{UNIT}.json /var/lib/specd/units/x.service.json /var/lib/specd/locks/{UNIT}.lock /etc/systemd/system/{UNIT}"
    ))
    .unwrap();
    let want = format!(
        "700 /var/lib/specd\n700 /var/lib/specd/units\n700 /var/lib/specd/locks\n600 /var/lib/specd/units/{UNIT}.json\n600 /var/lib/specd/units/x.service.json\n600 /var/lib/specd/locks/{UNIT}.lock\n644 /etc/systemd/system/{UNIT}\n"
    );
    assert_eq!(modes, want);
    // A drop-in specd moves aside is kept private too.
    e.b.write_file(&format!("/etc/systemd/system/{UNIT}.d/token.conf"), "[Service]\nEnvironment=HF_TOKEN=hf_other\n")
        .unwrap();
    e.b.systemctl_check(&["daemon-reload"]).unwrap();
    let (ok, out) = apply(&e, "s5.yaml", &e.spec(UNIT, 5, &extra));
    assert!(ok && out.contains("moved drop-in"), "{out}");
    let kept = e.b.sh_check("stat -c '%a' /var/lib/specd/removed-drop-ins/*/*").unwrap();
    assert_eq!(kept, "600\n");
    // Nobody but root reads the state.
    let o = e.b.exec(&[
        "setpriv",
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        "cat",
        &format!("/var/lib/specd/units/{UNIT}.json"),
    ]);
    assert!(!o.status.success(), "{}", text(&o));
    e.b.shutdown().unwrap();
}

#[test]
fn a_masked_unit_is_its_own_status_and_apply_changes_nothing() {
    let e = Env::new();
    let (ok, out) = apply(&e, "s5.yaml", &e.spec(UNIT, 5, &seed_extra(100)));
    assert!(ok, "{out}");
    let pid = e.main_pid(UNIT);
    let path = format!("/etc/systemd/system/{UNIT}");
    let before = e.b.read_to_string(&path).unwrap();

    // A runtime mask.
    e.b.systemctl_check(&["mask", "--runtime", UNIT]).unwrap();
    assert_eq!(e.b.sh_check(&format!("readlink /run/systemd/system/{UNIT}")).unwrap().trim(), "/dev/null");
    let o = e.specd(&["status"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("sglang-qwen.service: Masked"), "{}", text(&o));
    let (ok, out) = apply(&e, "s10.yaml", &e.spec(UNIT, 10, &seed_extra(100)));
    assert!(!ok, "{out}");
    assert!(out.contains("Masked: the unit is masked") && out.contains("does not unmask"), "{out}");
    assert!(!out.contains("stopping"), "{out}");
    assert_eq!(e.main_pid(UNIT), pid);
    assert_eq!(e.b.read_to_string(&path).unwrap(), before);
    e.b.systemctl_check(&["unmask", "--runtime", UNIT]).unwrap();

    // A mask in /etc (the unit file replaced by a link to /dev/null) is not a hand edit to heal.
    e.b.systemctl_check(&["stop", UNIT]).unwrap();
    e.b.sh_check(&format!("ln -sf /dev/null {path} && systemctl daemon-reload")).unwrap();
    let (ok, out) = apply(&e, "s5.yaml", &e.spec(UNIT, 5, &seed_extra(100)));
    assert!(!ok && out.contains("Masked"), "{out}");
    assert!(!out.contains("edited by hand"), "{out}");
    assert_eq!(e.b.sh_check(&format!("readlink {path}")).unwrap().trim(), "/dev/null");
    assert_eq!(e.b.prop(UNIT, "LoadState").unwrap(), "masked");
    e.b.shutdown().unwrap();
}

#[test]
fn a_unit_file_specd_did_not_write_is_replaced_only_when_adopted_and_reserved_units_never() {
    let e = Env::new();
    let path = format!("/etc/systemd/system/{UNIT}");
    let old =
        format!("[Service]\nType=exec\nExecStart={} sglang --model-path /models/old --port {}\n", e.standin, e.port);
    e.b.write_file(&path, &old).unwrap();
    e.b.systemctl_check(&["daemon-reload"]).unwrap();
    e.b.systemctl_check(&["start", UNIT]).unwrap();
    wait_until("the old server to answer", Duration::from_secs(30), || e.server_info().is_some()).unwrap();
    let pid = e.main_pid(UNIT);
    let (ok, out) = apply(&e, "s5.yaml", &e.spec(UNIT, 5, &seed_extra(100)));
    assert!(!ok, "{out}");
    assert!(out.contains("Refused: sglang-qwen.service") && out.contains("was not written by specd"), "{out}");
    assert!(!out.contains("stopping"), "{out}");
    assert_eq!(e.b.read_to_string(&path).unwrap(), old);
    assert_eq!(e.main_pid(UNIT), pid);
    let (ok, out) = apply(&e, "a5.yaml", &e.spec(UNIT, 5, &(seed_extra(100) + "  policy: {adopt: true}\n")));
    assert!(ok, "{out}");
    assert_eq!(e.served_steps(), Some(5));

    // A unit another package installed (here in the box's vendor unit dir): a file in the unit
    // dir would shadow it, so it is refused the same way, and keeps running.
    let vendor = "/run/specd-box/units/vendor-llm.service";
    let port = free_port();
    e.b.write_file(
        vendor,
        format!("[Service]\nType=exec\nExecStart={} sglang --model-path /models/v --port {port}\n", e.standin),
    )
    .unwrap();
    e.b.systemctl_check(&["daemon-reload"]).unwrap();
    e.b.systemctl_check(&["start", "vendor-llm.service"]).unwrap();
    let vpid = e.main_pid("vendor-llm.service");
    let (ok, out) = apply(&e, "v.yaml", &sglang_spec(&e.standin, "vendor-llm.service", port, 5, &seed_extra(100)));
    assert!(!ok, "{out}");
    assert!(out.contains(&format!("systemd loads it from {vendor}, a unit file specd did not write")), "{out}");
    assert!(!out.contains("stopping"), "{out}");
    assert!(e.b.read_file("/etc/systemd/system/vendor-llm.service").is_err(), "a shadowing copy was written");
    assert_eq!(e.main_pid("vendor-llm.service"), vpid);

    // Units specd never manages, even when a spec names them.
    for unit in ["systemd-journald.service", "dbus.service", "specd.service"] {
        let before = e.b.prop(unit, "ActiveState").unwrap();
        let yaml = sglang_spec(&e.standin, unit, free_port(), 5, &seed_extra(100));
        let (ok, out) = apply(&e, "reserved.yaml", &yaml);
        assert!(!ok, "{out}");
        assert!(out.contains(unit) && (out.contains("never manages") || out.contains("reserved")), "{out}");
        assert_eq!(e.b.prop(unit, "ActiveState").unwrap(), before, "{unit}");
        assert!(e.b.read_file(&format!("/etc/systemd/system/{unit}")).is_err(), "{unit} was written");
    }
    e.b.shutdown().unwrap();
}

/// A kill -9 campaign: `specd apply` is killed at random moments of an apply between two specs
/// (steps 5 and 10, in turn), and after every kill the host is checked as an operator would: the
/// unit file is whole (exactly the old or the new render), every state file parses, and the next
/// apply converges to the spec it was given. `SPECD_KILLS` kills (default 12; the README's campaign
/// ran more), seeded by `SPECD_KILL_SEED` (printed, so a failure can be replayed). The random delay
/// is the fault being injected, not a wait for a condition.
#[test]
fn killed_at_random_moments_every_next_apply_converges() {
    let kills: usize = std::env::var("SPECD_KILLS").ok().and_then(|v| v.parse().ok()).unwrap_or(12);
    let mut seed: u64 = std::env::var("SPECD_KILL_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 | 1
    });
    eprintln!("kill campaign: {kills} kills, SPECD_KILL_SEED={seed}");
    let mut next = move || {
        // xorshift64: reproducible from the printed seed.
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let e = Env::new();
    let specs =
        [("k5.yaml", 5u64, e.spec(UNIT, 5, &seed_extra(300))), ("k10.yaml", 10u64, e.spec(UNIT, 10, &seed_extra(300)))];
    for (name, _, yaml) in &specs {
        e.put(name, yaml);
    }
    let hashes: Vec<String> = specs.iter().map(|(n, ..)| rendered_hash(&e, n)).collect();
    // One uninterrupted apply each way measures how long an apply takes here.
    let t = Instant::now();
    let (ok, out) = apply(&e, specs[0].0, &specs[0].2);
    assert!(ok, "{out}");
    let (ok, out) = apply(&e, specs[1].0, &specs[1].2);
    assert!(ok, "{out}");
    let span_ms = (t.elapsed().as_millis() as u64 / 2).max(50);
    let mut phases: BTreeMap<String, usize> = BTreeMap::new();
    let mut failures = Vec::new();
    for i in 0..kills {
        let (name, steps, yaml) = &specs[i % 2];
        let before = deployed_hash(&e);
        let reqs = e.in_flight(2, 200);
        let mut child =
            e.b.command(&[&e.specd, "apply", "-f", &format!("/run/specs/{name}"), "--host", "gpu-01"])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap();
        std::thread::sleep(Duration::from_millis(next() % span_ms));
        let _ = e.b.exec(&["pkill", "-KILL", "-f", "specd apply"]);
        let _ = child.wait();
        let state = e.b.read_to_string(&format!("/var/lib/specd/units/{UNIT}.json")).unwrap_or_default();
        let phase = serde_json::from_str::<serde_json::Value>(&state)
            .map(|v| v["in_progress"]["phase"].as_str().unwrap_or("done or not begun").to_string())
            .unwrap_or_else(|err| format!("CORRUPT STATE: {err}"));
        *phases.entry(phase.clone()).or_default() += 1;
        let at_kill = deployed_hash(&e);
        let mut bad = Vec::new();
        if at_kill != before && !hashes.contains(&at_kill) {
            bad.push(format!("a unit file that is neither render ({at_kill})"));
        }
        if phase.starts_with("CORRUPT") {
            bad.push(phase.clone());
        }
        let (ok, out) = apply(&e, name, yaml);
        if !ok || e.served_steps() != Some(*steps) || deployed_hash(&e) != hashes[i % 2] {
            bad.push(format!("the next apply did not converge (ok={ok}, serves {:?}):\n{out}", e.served_steps()));
        }
        if e.specd(&["status"]).status.code() != Some(0) {
            bad.push("status is not 0 after the next apply".into());
        }
        // A kill between a temporary file and its rename: the next apply removed it.
        let listed = e.b.check(&["ls", "-A", "/var/lib/specd/units", "/etc/systemd/system"]).unwrap_or_default();
        if let Some(t) = listed.lines().find(|l| l.ends_with(".specd-tmp")) {
            bad.push(format!("a temporary file is left after the next apply: {t}"));
        }
        if !bad.is_empty() {
            failures.push(format!("kill {i} at {phase}: {}", bad.join("; ")));
        }
        for r in reqs {
            r.join().unwrap();
        }
    }
    eprintln!("kill campaign: {kills} kills, {} converged; interrupted phases: {phases:?}", kills - failures.len());
    assert!(failures.is_empty(), "{} of {kills} kills:\n{}", failures.len(), failures.join("\n"));
    e.b.shutdown().unwrap();
}

/// `specd apply -f a -f b -f c`: every file is checked first (a bad one, or two files for one
/// unit, change nothing on the host), then the units are applied at once, each proven to serve
/// its own spec; a later apply of two of them leaves the third alone.
#[test]
fn several_files_are_checked_first_then_applied_at_once() {
    let e = Env::new();
    let ports = [e.port, free_port(), free_port()];
    let units = ["m0.service", "m1.service", "m2.service"];
    let spec = |i: usize, steps: u32| {
        sglang_spec(
            &e.standin,
            units[i],
            ports[i],
            steps,
            "  service: {environment: {SPECD_STANDIN_LOAD_MS: \"300\"}}\n",
        )
    };
    let steps_on = |port: u16| {
        http_get(port, "/get_server_info")
            .and_then(|(_, b)| serde_json::from_str::<serde_json::Value>(&b).ok())
            .and_then(|v| v["speculative_num_steps"].as_u64())
    };
    let files: Vec<String> = (0..3).map(|i| e.put(&format!("m{i}-5.yaml"), &spec(i, 5))).collect();
    let nothing_deployed = || units.iter().all(|u| e.b.read_file(&format!("/etc/systemd/system/{u}")).is_err());

    let bad = e.put("bad.yaml", &spec(2, 5).replace("num_steps: 5", "num_steps: -1"));
    let o = e.specd(&["apply", "-f", &files[0], "-f", &files[1], "-f", &bad]);
    let out = text(&o);
    assert_eq!(o.status.code(), Some(1), "{out}");
    assert!(out.contains("/run/specs/bad.yaml:") && out.contains("nothing was changed on this host"), "{out}");
    assert!(nothing_deployed(), "a bad file among several changes nothing");

    let again = e.put("m0-again.yaml", &spec(0, 6));
    let o = e.specd(&["apply", "-f", &files[0], "-f", &files[1], "-f", &again]);
    let out = text(&o);
    assert_eq!(o.status.code(), Some(1), "{out}");
    assert!(
        out.contains("/run/specs/m0-5.yaml and /run/specs/m0-again.yaml both define m0.service; nothing was changed"),
        "{out}"
    );
    assert!(nothing_deployed());

    // A unit file specd did not write, among several: refused before any unit is changed.
    e.b.write_file("/etc/systemd/system/m2.service", "[Service]\nExecStart=/bin/sleep 1000\n").unwrap();
    let o = e.specd(&["apply", "-f", &files[0], "-f", &files[2]]);
    let out = text(&o);
    assert_eq!(o.status.code(), Some(1), "{out}");
    assert!(out.contains("specd: Refused: m2.service: ") && out.contains("nothing was changed on this host"), "{out}");
    assert!(e.b.read_file("/etc/systemd/system/m0.service").is_err(), "m0 was not deployed: {out}");
    e.b.sh_check("rm /etc/systemd/system/m2.service").unwrap();

    // A dry run of several says which unit each verdict is about.
    let o = e.specd(&["apply", "--dry-run", "-f", &files[0], "-f", &files[1]]);
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(
        out.lines().map(|l| l.split(':').next().unwrap()).collect::<Vec<_>>(),
        ["m0.service", "m1.service"],
        "{out}"
    );
    assert!(nothing_deployed());

    let o = e.specd(&["apply", "-f", &files[0], "-f", &files[1], "-f", &files[2]]);
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    for (u, p) in units.iter().zip(ports) {
        assert!(out.contains(&format!("Applied: {u} runs unit")), "{out}");
        assert_eq!(steps_on(p), Some(5), "{u}");
    }

    let m2 = e.main_pid("m2.service");
    let (f0, f1) = (e.put("m0-7.yaml", &spec(0, 7)), e.put("m1-8.yaml", &spec(1, 8)));
    let o = e.specd(&["apply", "-f", &f0, "-f", &f1]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!((steps_on(ports[0]), steps_on(ports[1])), (Some(7), Some(8)));
    assert_eq!(e.main_pid("m2.service"), m2, "the unit not named was not touched");
}

/// A server that loads for a while: `specd apply` into a pipe says what it waits for in a few
/// lines (not one every 2 s), with what the server itself said it was doing.
#[test]
fn a_loading_server_takes_a_few_lines_in_a_pipe_with_what_it_says() {
    let e = Env::new();
    let (ok, out) = apply(&e, "s5.yaml", &e.spec(UNIT, 5, &seed_extra(300)));
    assert!(ok, "{out}");
    let (ok, out) = apply(&e, "s6.yaml", &e.spec(UNIT, 6, &seed_extra(5000)));
    assert!(ok, "{out}");
    assert!(out.lines().count() <= 10, "{} lines:\n{out}", out.lines().count());
    // The waiting line names the phase the server's own lines tell, and what it said last.
    assert!(
        out.contains("loading: weights (") && out.contains("s in ([") && out.contains("Load weight begin"),
        "{out}"
    );
    e.b.shutdown().unwrap();
}

/// stdout of a `--json` command: exactly one JSON document (progress and notes are on stderr).
fn json_doc(o: &std::process::Output) -> serde_json::Value {
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|err| panic!("stdout is not one JSON document ({err}):\n{}", text(o)))
}

/// `--json` of `apply`, `diff` and `rollback` as a script reads them, against the exit codes of
/// the README's table: an apply, a diff with nothing and then something to say, a failing apply
/// rolled back, a hand rollback pinned, and a rollback refused.
#[test]
fn apply_diff_and_rollback_say_what_they_did_in_json_with_their_exit_codes() {
    let e = Env::new();
    let service = "  service: {restart: always, timeout_stop_sec: 2, environment: {SPECD_STANDIN_LOAD_MS: \"100\"}}\n";
    let five = e.put("five.yaml", &e.spec(UNIT, 5, service));
    let seven = e.put("seven.yaml", &e.spec(UNIT, 7, service));
    let hash = |f: &str| String::from_utf8(e.specd(&["render", "--hash", f]).stdout).unwrap().trim().to_string();
    let (h5, h7) = (hash(&five), hash(&seven));

    let o = e.specd(&["apply", "-f", &five, "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let j = json_doc(&o);
    assert_eq!(j["ok"], true, "{j:#}");
    assert_eq!(j["dry_run"], false);
    assert!(j["error"].is_null() && j["diagnostics"] == serde_json::json!([]), "{j:#}");
    let u = &j["units"][0];
    assert_eq!(j["units"].as_array().map(Vec::len), Some(1), "{j:#}");
    assert_eq!(
        (u["unit"].as_str(), u["file"].as_str(), u["sha256"].as_str()),
        (Some(UNIT), Some(five.as_str()), Some(h5.as_str()))
    );
    assert_eq!((u["outcome"].as_str(), u["ok"].as_bool()), (Some("applied"), Some(true)), "{u:#}");
    assert_eq!(u["sync"], "OutOfSync", "{u:#}");
    assert!(u["steps"].as_array().unwrap().iter().any(|s| s == "Start"), "{u:#}");
    assert!(u["verdict"].as_str().unwrap().starts_with("Applied"), "{u:#}");
    assert!(String::from_utf8_lossy(&o.stderr).contains("daemon-reload"), "progress on stderr:\n{}", text(&o));

    // Nothing differs: exit 0.
    let o = e.specd(&["diff", "-f", &five, "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let j = json_doc(&o);
    assert_eq!(
        (j["ok"].as_bool(), j["differs"].as_bool(), j["ready"].as_bool()),
        (Some(true), Some(false), Some(true)),
        "{j:#}"
    );
    assert_eq!(j["unit"], UNIT);
    assert_eq!(j["unit_file"]["differs"], false);
    assert_eq!(j["unit_file"]["deployed_sha256"], h5.as_str());
    assert!(j["unit_file"]["diff"].is_null());
    assert_eq!(
        (j["server_args"]["compared"].as_bool(), j["server_args"]["mismatches"].as_array().map(Vec::len)),
        (Some(true), Some(0)),
        "{j:#}"
    );

    // A spec of 7 steps against the server of 5: the unit file and the server's args differ, exit 1.
    let o = e.specd(&["diff", "-f", &seven, "--json"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let j = json_doc(&o);
    assert_eq!((j["ok"].as_bool(), j["differs"].as_bool()), (Some(false), Some(true)), "{j:#}");
    let f = &j["unit_file"];
    assert_eq!((f["deployed_sha256"].as_str(), f["desired_sha256"].as_str()), (Some(h5.as_str()), Some(h7.as_str())));
    let d = f["diff"].as_str().unwrap();
    assert!(
        d.contains("--speculative-num-steps 5") && d.contains("+ExecStart=") && d.contains("--speculative-num-steps 7"),
        "{d}"
    );
    let m = j["server_args"]["mismatches"].as_array().unwrap();
    assert!(
        m.iter().any(|x| x["key"].as_str().is_some_and(|k| k.ends_with("speculative_num_steps"))
            && x["expected"] == 7
            && x["actual"] == 5),
        "{j:#}"
    );

    let o = e.specd(&["apply", "-f", &seven, "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    // A start that fails: rolled back to 7, exit 1.
    let broken = e.put(
        "broken.yaml",
        &e.spec(
            UNIT,
            9,
            &service.replace("SPECD_STANDIN_LOAD_MS", "SPECD_STANDIN_EXIT_CODE: \"3\", SPECD_STANDIN_LOAD_MS"),
        ),
    );
    let o = e.specd(&["apply", "-f", &broken, "--json"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let j = json_doc(&o);
    let u = &j["units"][0];
    assert_eq!(
        (j["ok"].as_bool(), u["ok"].as_bool(), u["outcome"].as_str()),
        (Some(false), Some(false), Some("rolled-back")),
        "{j:#}"
    );
    assert!(u["verdict"].as_str().unwrap().starts_with("RolledBack"), "{u:#}");
    assert_eq!(e.served_steps(), Some(7));

    // A hand rollback: to the good unit before the deployed one (5), pinned; exit 0.
    let o = e.specd(&["rollback", UNIT, "--json", "--reason", "7 regresses"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let j = json_doc(&o);
    assert_eq!(
        (j["ok"].as_bool(), j["pinned"].as_bool(), j["outcome"].as_str()),
        (Some(true), Some(true), Some("applied")),
        "{j:#}"
    );
    assert_eq!(j["unit"], UNIT);
    assert_eq!(
        (j["to"]["sha256"].as_str(), j["to"]["recorded_sha256"].as_str()),
        (Some(h5.as_str()), Some(h5.as_str())),
        "{j:#}"
    );
    assert_eq!(j["to"]["source"]["kind"], "file", "{j:#}");
    assert_eq!((j["hold"]["kind"].as_str(), j["hold"]["reason"].as_str()), (Some("pin"), Some("7 regresses")), "{j:#}");
    assert!(String::from_utf8_lossy(&o.stderr).contains("rolling back to unit"), "the words on stderr:\n{}", text(&o));
    assert_eq!(e.served_steps(), Some(5));

    // A rollback to a unit never good here: refused, nothing changed, exit 1.
    let o = e.specd(&["rollback", UNIT, "--to", "0000ffff", "--json"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let j = json_doc(&o);
    assert_eq!(j["ok"], false);
    assert!(j["error"].as_str().unwrap().contains("no good unit 0000ffff is recorded"), "{j:#}");
    assert!(j["to"].is_null() && j["outcome"].is_null() && j["pinned"] == false, "{j:#}");
    assert_eq!(e.served_steps(), Some(5));
    e.b.shutdown().unwrap();
}

/// A safetensors file of two F32 tensors of 8 values, whole.
fn safetensors_shard(first: &str, second: &str) -> Vec<u8> {
    let header = format!(
        "{{\"{first}\":{{\"dtype\":\"F32\",\"shape\":[8],\"data_offsets\":[0,32]}},\"{second}\":{{\"dtype\":\"F32\",\"shape\":[8],\"data_offsets\":[32,64]}}}}"
    );
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend(header.as_bytes());
    out.extend([0x3fu8; 64]);
    out
}

/// Weights that are not whole, in a model folder or a Hugging Face cache snapshot, each refused
/// before the serving instance is touched, naming the file: a shard cut short, an index naming a
/// shard the folder lacks, a snapshot link to a blob that is gone, a download into the cache
/// that did not finish, and (with `weights.verify: sha256`) a blob whose content is not the one
/// its name is the digest of. The stand-in loads no weights: what refuses them is the look
/// before the stop, which needs no start.
#[test]
fn weights_that_are_not_whole_are_refused_before_the_serving_instance_is_touched() {
    let e = Env::new();
    let (ok, out) = apply(&e, "good.yaml", &e.spec(UNIT, 5, &seed_extra(100)));
    assert!(ok, "{out}");
    let serving = || (e.main_pid(UNIT), e.b.prop(UNIT, "InvocationID").unwrap());
    let before = serving();
    let put = |path: &str, bytes: &[u8]| e.b.write_file(path, bytes).unwrap();
    let sh = |script: &str| {
        let o = e.b.exec(&["sh", "-c", script]);
        assert!(o.status.success(), "{script}: {}", text(&o));
    };
    let config = b"{\"architectures\": [\"Qwen3NextForCausalLM\"]}\n";
    let (one, two) = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors");
    let (s1, s2) = (safetensors_shard("a", "b"), safetensors_shard("c", "d"));
    // A folder of two shards, the second cut short by 10 bytes.
    let cut = "/var/lib/models/cut";
    put(&format!("{cut}/config.json"), config);
    put(&format!("{cut}/{one}"), &s1);
    put(&format!("{cut}/{two}"), &s2[..s2.len() - 10]);
    // An index that names a second shard the folder lacks.
    let indexed = "/var/lib/models/indexed";
    put(&format!("{indexed}/config.json"), config);
    put(&format!("{indexed}/{one}"), &s1);
    let index =
        format!("{{\"weight_map\": {{\"a\": \"{one}\", \"b\": \"{one}\", \"c\": \"{two}\", \"d\": \"{two}\"}}}}");
    put(&format!("{indexed}/model.safetensors.index.json"), index.as_bytes());
    // Hugging Face cache snapshots, as huggingface_hub lays them out.
    let snapshot = |repo: &str, blob: &str, bytes: &[u8]| {
        let r = format!("/var/lib/hf/hub/models--org--{repo}");
        let snap = format!("{r}/snapshots/0123456789abcdef0123456789abcdef01234567");
        put(&format!("{r}/blobs/{}", specd_spec::sha256_hex(config)), config);
        put(&format!("{r}/blobs/{blob}"), bytes);
        sh(&format!(
            "mkdir -p {snap} && ln -s ../../blobs/{} {snap}/config.json && ln -s ../../blobs/{blob} {snap}/model.safetensors",
            specd_spec::sha256_hex(config)
        ));
        (r, snap)
    };
    let digest = specd_spec::sha256_hex(&s1);
    let (gone_repo, gone) = snapshot("gone", &digest, &s1);
    sh(&format!("rm {gone_repo}/blobs/{digest}"));
    let (partial_repo, partial) = snapshot("partial", &digest, &s1);
    let unfinished = format!("{}.0badc0de.incomplete", "9".repeat(64));
    put(&format!("{partial_repo}/blobs/{unfinished}"), b"half a download");
    // Whole by its header, but not the content its name is the digest of.
    let (_, damaged) = snapshot("damaged", &specd_spec::sha256_hex(&s2), &s1);

    let with_model = |m: &str, tail: &str| {
        e.spec(UNIT, 5, &format!("{}{tail}", seed_extra(100))).replace(specd_e2e::STANDIN_MODEL, m)
    };
    let cases = [
        ("a shard cut short", with_model(cut, ""), format!("{two} in the model {cut}: ")),
        (
            "an index naming a missing shard",
            with_model(indexed, ""),
            format!(
                "model.safetensors.index.json in the model {indexed} names the shard {two}, which the model {indexed} does not have"
            ),
        ),
        (
            "a link to a blob that is gone",
            with_model(&gone, ""),
            format!("model.safetensors in the model {gone} is a symbolic link to nothing"),
        ),
        (
            "an unfinished download",
            with_model(&partial, ""),
            format!("where the download of blobs/{unfinished} did not finish"),
        ),
        (
            "a blob not its digest",
            with_model(&damaged, "  weights: {verify: sha256}\n"),
            format!(
                "model.safetensors in the model {damaged}: its sha256 is {digest}, not {}",
                specd_spec::sha256_hex(&s2)
            ),
        ),
    ];
    for (i, (what, yaml, why)) in cases.iter().enumerate() {
        let (ok, out) = apply(&e, &format!("weights{i}.yaml"), yaml);
        assert!(!ok, "{what}: {out}");
        assert!(out.contains("Refused: sglang-qwen.service: unit") && out.contains(why.as_str()), "{what}: {out}");
        assert!(out.contains("nothing was stopped or changed"), "{what}: {out}");
        assert_eq!(serving(), before, "{what}: the serving instance was touched\n{out}");
    }
    // The cut shard is said the same by the look without an apply.
    let o = e.specd(&["validate", "--on-host", "/run/specs/weights0.yaml"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let said = format!(
        "{two} in the model {cut}: {} bytes, but its header says its tensors end at {} bytes",
        s2.len() - 10,
        s2.len()
    );
    assert!(text(&o).contains(&said), "{}", text(&o));
    // Whole weights pass (the digest now remembered in the state directory).
    let good = snapshot("good", &digest, &s1).1;
    let (ok, out) = apply(&e, "whole.yaml", &with_model(&good, "  weights: {verify: sha256}\n"));
    assert!(ok, "{out}");
    let remembered = e.b.read_to_string("/var/lib/specd/weight-digests.json").unwrap();
    assert!(remembered.contains(&digest), "{remembered}");
    e.b.shutdown().unwrap();
}
