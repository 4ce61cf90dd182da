//! Disturbed mid-flight, against a real systemd and the stand-in: systemd re-executing itself
//! (what its package's upgrade does) during an apply quarantines nothing and the apply goes
//! through; `specd apply` and `specd rollback` asked to stop (Ctrl-C, SIGTERM, a dropped ssh
//! session) at each phase leave the unit serving, old or new.

use std::time::Duration;

use crate::common::*;

const UNIT: &str = "sglang-qwen.service";

/// The stand-in loading for `load_ms`, streaming at 20 tokens/s; requests in flight are drained
/// for up to 1 s, then stopped within 1 s (SIGKILL after).
fn extra(load_ms: u32) -> String {
    format!(
        "  service:\n    restart: always\n    restart_sec: 1\n    timeout_stop_sec: 1\n    drain_timeout_sec: 1\n    environment: {{SPECD_STANDIN_LOAD_MS: \"{load_ms}\", SPECD_STANDIN_TOKENS_PER_SEC: \"20\"}}\n  readiness: {{timeout_sec: 60}}\n"
    )
}

fn apply(e: &Env, name: &str, steps: u32, load_ms: u32) -> String {
    let p = e.put(name, &e.spec(UNIT, steps, &extra(load_ms)));
    let o = e.specd(&["apply", "-f", &p, "--host", "gpu-01"]);
    assert!(o.status.success(), "{}", text(&o));
    p
}

/// The phase the apply in progress records in its state file.
fn phase(e: &Env) -> Option<String> {
    let t = e.b.read_to_string(&format!("/var/lib/specd/units/{UNIT}.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&t).ok()?;
    v["in_progress"]["phase"].as_str().map(str::to_string)
}

/// `specd ARGS...` in the background, its output in a file of the box (read with `log`).
fn spawn(e: &Env, args: &str, log: &str) -> std::process::Child {
    let script = format!("exec {} {args} >{log} 2>&1", e.specd);
    e.b.command(&["/bin/sh", "-c", &script]).spawn().unwrap()
}

/// Until `child` exits: its exit code (none: killed by a signal).
fn exit_code(child: &mut std::process::Child, what: &str) -> Option<i32> {
    let mut code = None;
    wait_until(&format!("{what} to exit"), Duration::from_secs(90), || match child.try_wait().unwrap() {
        Some(s) => {
            code = Some(s.code());
            true
        }
        None => false,
    })
    .unwrap();
    code.flatten()
}

fn quarantined(e: &Env) -> Vec<serde_json::Value> {
    e.state(UNIT)["quarantine"].as_array().cloned().unwrap_or_default()
}

/// How many re-executions the campaign makes (`SPECD_REEXECS`, default 20).
fn reexecs() -> usize {
    std::env::var("SPECD_REEXECS").ok().and_then(|v| v.parse().ok()).unwrap_or(20)
}

#[test]
fn daemon_reexecs_during_stop_reload_and_readiness_quarantine_nothing_and_every_apply_lands() {
    let e = Env::new();
    // Both specs verified once before the campaign.
    let s5 = apply(&e, "s5.yaml", 5, 1000);
    let s6 = apply(&e, "s6.yaml", 6, 1000);
    let (mut done, mut i) = (0, 0);
    let mut hit = std::collections::BTreeMap::<String, usize>::new();
    while done < reexecs() {
        let (file, steps) = if i % 2 == 0 { (&s5, 5) } else { (&s6, 6) };
        // One re-execution while the old instance stops, one while the new one loads, or
        // re-executions back to back from the apply's start until it waits for readiness (the
        // stop job, the write, the reload and the start take milliseconds each).
        let at = ["WaitStopped", "WaitReady", "start"][i % 3];
        // Requests in flight make the old instance's stop last (drained 1 s, stopped within 1 s).
        let reqs = if at == "WaitStopped" { e.in_flight(2, 400) } else { Vec::new() };
        let log = format!("/run/specs/apply-{i}.log");
        let mut child = spawn(&e, &format!("apply -f {file} --host gpu-01"), &log);
        let running = |c: &mut std::process::Child| c.try_wait().unwrap().is_none();
        if at == "start" {
            let until = done + 6;
            while done < until && running(&mut child) && phase(&e).as_deref() != Some("WaitReady") {
                *hit.entry(phase(&e).unwrap_or_else(|| "(no phase yet)".into())).or_default() += 1;
                e.b.systemctl_check(&["daemon-reexec"]).unwrap();
                done += 1;
            }
        } else {
            wait_until(&format!("apply {i} to reach {at}"), Duration::from_secs(60), || {
                phase(&e).as_deref() == Some(at) || !running(&mut child)
            })
            .unwrap();
            *hit.entry(phase(&e).unwrap_or_else(|| "(the apply had ended)".into())).or_default() += 1;
            e.b.systemctl_check(&["daemon-reexec"]).unwrap();
            done += 1;
        }
        let code = exit_code(&mut child, &format!("apply {i}"));
        let said = e.b.read_to_string(&log).unwrap_or_default();
        assert_eq!(code, Some(0), "apply {i} (re-executed at {at}):\n{said}");
        assert!(said.contains("Applied: sglang-qwen.service runs unit"), "apply {i}:\n{said}");
        assert_eq!(e.served_steps(), Some(steps), "apply {i}:\n{said}");
        assert!(quarantined(&e).is_empty(), "apply {i} quarantined a good spec: {:?}\n{said}", quarantined(&e));
        for r in reqs {
            r.join().unwrap();
        }
        i += 1;
    }
    eprintln!("{done} daemon-reexecs over {i} applies landed during: {hit:?}");
    assert!(hit.contains_key("WaitStopped") && hit.contains_key("WaitReady"), "{hit:?}");
    assert_eq!(e.specd(&["status"]).status.code(), Some(0));
    e.b.shutdown().unwrap();
}

/// The phases an apply is interrupted at: draining (nothing stopped yet), the old instance
/// stopping, the new one loading.
const PHASES: [&str; 3] = ["Drain", "WaitStopped", "WaitReady"];
const SIGNALS: [&str; 3] = ["INT", "TERM", "HUP"];

/// `specd apply` (or `specd rollback`) of steps 6 over steps 5, asked to stop by `signal` once
/// it is at `at`: it exits on its own, and the unit serves, old or new, within 30 s.
fn interrupted(e: &Env, command: &str, at: &str, signal: &str, i: usize) {
    let case = format!("{command} interrupted by SIG{signal} at {at}");
    // Steps 5 serves; steps 6 is the other good unit (the rollback goes back to it).
    let s6 = e.put("s6.yaml", &e.spec(UNIT, 6, &extra(1000)));
    let reqs = e.in_flight(2, 400);
    let args = match command {
        "apply" => format!("apply -f {s6} --host gpu-01"),
        _ => format!("rollback {UNIT}"),
    };
    let log = format!("/run/specs/{command}-{i}.log");
    let mut child = spawn(e, &args, &log);
    wait_until(&format!("{case}: the phase"), Duration::from_secs(60), || {
        phase(e).as_deref() == Some(at) || child.try_wait().unwrap().is_some()
    })
    .unwrap();
    assert_eq!(phase(e).as_deref(), Some(at), "{case}: {}", e.b.read_to_string(&log).unwrap_or_default());
    let k = e.b.exec(&["pkill", &format!("-{signal}"), "-f", &format!("specd {command}")]);
    assert!(k.status.success(), "{case}: {}", text(&k));
    let code = exit_code(&mut child, &case);
    let said = e.b.read_to_string(&log).unwrap_or_default();
    assert!(code.is_some(), "{case}: killed by its signal instead of stopping safely:\n{said}");
    wait_until(&format!("{case}: the unit to serve"), Duration::from_secs(30), || {
        matches!(e.served_steps(), Some(5 | 6))
    })
    .unwrap_or_else(|err| panic!("{case}: {err}\n{said}"));
    // Before the stop it ends at once, nothing changed; after it, it finishes first.
    let (want_code, want_steps) = if at == "Drain" { (1, 5) } else { (0, 6) };
    assert_eq!((code, e.served_steps()), (Some(want_code), Some(want_steps)), "{case}:\n{said}");
    if at == "Drain" && signal != "HUP" {
        assert!(said.contains("nothing was changed on the host"), "{case}:\n{said}");
    }
    assert!(quarantined(e).is_empty(), "{case}: {:?}\n{said}", quarantined(e));
    // A pin stays only on a rollback that finished, and no longer ends with its process.
    let hold = e.state(UNIT)["hold"].clone();
    match (command, e.served_steps()) {
        ("rollback", Some(6)) => assert!(hold["kind"] == "pin" && hold["pid"].is_null(), "{case}: {hold}\n{said}"),
        _ => assert!(hold.is_null(), "{case}: {hold}\n{said}"),
    }
    for r in reqs {
        r.join().unwrap();
    }
}

#[test]
fn an_interrupted_apply_or_rollback_leaves_the_unit_serving() {
    let e = Env::new();
    apply(&e, "s6.yaml", 6, 1000);
    let s5 = apply(&e, "s5.yaml", 5, 1000);
    let mut i = 0;
    for command in ["apply", "rollback"] {
        for at in PHASES {
            for signal in SIGNALS {
                // Back to steps 5 serving, steps 6 the other good unit.
                let o = e.specd(&["resume", UNIT]);
                assert!(o.status.success(), "{}", text(&o));
                let o = e.specd(&["apply", "-f", &s5, "--host", "gpu-01"]);
                assert!(o.status.success(), "{}", text(&o));
                interrupted(&e, command, at, signal, i);
                i += 1;
            }
        }
    }
    e.b.shutdown().unwrap();
}

/// `specd rollback` killed (SIGKILL, or a second Ctrl-C) while it stops the unit, with the agent
/// running: its pin ended with its process, so the agent puts the repository's unit back at once
/// instead of leaving the unit down, pinned, until someone runs `specd resume`.
#[test]
fn a_rollback_killed_half_way_leaves_no_pin_and_the_agent_brings_the_unit_back() {
    let f = Fleet::new();
    let unit = "qwen.service";
    let spec = |steps| {
        let service = "  service: {restart: always, timeout_stop_sec: 2, drain_timeout_sec: 2, environment: {SPECD_STANDIN_LOAD_MS: \"500\", SPECD_STANDIN_TOKENS_PER_SEC: \"20\"}}\n";
        sglang_spec(&f.e.standin, unit, f.e.port, steps, service)
    };
    let commit = |steps| {
        std::fs::write(f.repo.join("specs/qwen.yaml"), spec(steps)).unwrap();
        git(&f.repo, &["add", "-A"]);
        git(&f.repo, &["commit", "-q", "-m", &format!("steps {steps}")]);
    };
    commit(5);
    f.run_agent(f.repo.to_str().unwrap(), "", "");
    wait_until("steps 5", Duration::from_secs(60), || f.e.served_steps() == Some(5)).unwrap();
    commit(6);
    wait_until("steps 6", Duration::from_secs(60), || f.e.served_steps() == Some(6)).unwrap();
    let reqs = f.e.in_flight(2, 400);
    let log = "/run/rollback.log";
    let mut child = spawn(&f.e, &format!("rollback {unit}"), log);
    let state = format!("/var/lib/specd/units/{unit}.json");
    let phase = || {
        let v: serde_json::Value = serde_json::from_str(&f.e.b.read_to_string(&state).ok()?).ok()?;
        v["in_progress"]["phase"].as_str().map(str::to_string)
    };
    wait_until("the rollback to stop the unit", Duration::from_secs(60), || {
        phase().as_deref() == Some("WaitStopped") || child.try_wait().unwrap().is_some()
    })
    .unwrap();
    assert_eq!(phase().as_deref(), Some("WaitStopped"), "{}", f.e.b.read_to_string(log).unwrap_or_default());
    assert!(f.e.b.exec(&["pkill", "-KILL", "-f", "specd rollback"]).status.success());
    let _ = child.wait();
    // The agent takes the unit back: the repository's steps 6 serve, and no pin is left.
    wait_until("the agent to serve steps 6 again", Duration::from_secs(30), || {
        f.e.served_steps() == Some(6) && f.e.state(unit)["hold"].is_null()
    })
    .unwrap_or_else(|err| {
        panic!("{err}\nstate: {}\nagent journal:\n{}", f.e.state(unit), f.e.b.journal(AGENT).unwrap_or_default())
    });
    for r in reqs {
        r.join().unwrap();
    }
    f.e.b.shutdown().unwrap();
}
