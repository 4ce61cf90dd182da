//! The "before" picture: the seed incident, reproduced by hand in a real
//! systemd. An operator tuning SGLang's `speculative_num_steps` from 5 to 10
//! runs the naive sequence against a unit with `Restart=always` and a short
//! `TimeoutStopSec`, while the server drains requests longer than that:
//! `systemctl stop` (requests in flight) → copy the steps=10 unit → `systemctl
//! start`, with and without `daemon-reload`. specd's reconciler tests are the
//! "after" of this picture.

use specd_e2e::{SystemdBox, bin_path, free_port, http, http_get, wait_for, wait_until};
use std::time::{Duration, Instant};

const UNIT: &str = "llm.service";
const UNIT_PATH: &str = "/etc/systemd/system/llm.service";
const TIMEOUT_STOP_SEC: u64 = 2;

fn unit(port: u16, steps: u32) -> String {
    format!(
        "[Unit]\nDescription=SGLang (stand-in), speculative_num_steps={steps}\n\n[Service]\nExecStart={standin} sglang --model-path /models/Qwen3.5-122B-A10B --host 127.0.0.1 --port {port} --tp-size 4 --mem-fraction-static 0.85 --max-running-requests 16 --enable-metrics --speculative-algorithm NEXTN --speculative-num-steps {steps} --speculative-eagle-topk 1 --speculative-num-draft-tokens {draft}\nEnvironment=SPECD_STANDIN_LOAD_MS=300 SPECD_STANDIN_TOKENS_PER_SEC=20\nRestart=always\nRestartSec=1\nTimeoutStopSec={TIMEOUT_STOP_SEC}\n",
        standin = bin_path("specd-standin").display(),
        draft = steps + 1,
    )
}

fn served_steps(port: u16) -> Option<u64> {
    let (code, body) = http_get(port, "/get_server_info")?;
    if code != 200 {
        return None;
    }
    serde_json::from_str::<serde_json::Value>(&body).ok()?["speculative_num_steps"].as_u64()
}

fn running_reqs(port: u16) -> Option<f64> {
    let (_, m) = http_get(port, "/metrics")?;
    m.lines().find(|l| l.starts_with("sglang:num_running_reqs"))?.split_whitespace().last()?.parse().ok()
}

/// Boots a box running the steps=5 unit, ready, with 16 long generations
/// (200 tokens at 20 tokens/s: 10 s, far beyond TimeoutStopSec) in flight.
type Clients = Vec<std::thread::JoinHandle<Option<(u16, String)>>>;

fn seed() -> (SystemdBox, u16, Clients) {
    let b = SystemdBox::boot().unwrap_or_else(|e| panic!("cannot boot the systemd box: {e:#}"));
    let port = free_port();
    b.write_file(UNIT_PATH, unit(port, 5)).unwrap();
    b.systemctl_check(&["daemon-reload"]).unwrap();
    b.systemctl_check(&["start", UNIT]).unwrap();
    wait_until("steps=5 serving", Duration::from_secs(20), || served_steps(port) == Some(5)).unwrap();
    wait_until("ready (/health_generate 200)", Duration::from_secs(20), || {
        http_get(port, "/health_generate").is_some_and(|(c, _)| c == 200)
    })
    .unwrap();
    let clients = (0..16)
        .map(|_| {
            std::thread::spawn(move || {
                http(
                    port,
                    "POST",
                    "/generate",
                    Some(r#"{"text":"tune me","sampling_params":{"max_new_tokens":200},"stream":true}"#),
                    Duration::from_secs(60),
                )
            })
        })
        .collect();
    wait_until("16 requests in flight", Duration::from_secs(10), || running_reqs(port) == Some(16.0)).unwrap();
    (b, port, clients)
}

/// `systemctl stop` with 16 requests in flight: SGLang drains with no
/// timeout of its own, so systemd SIGKILLs it at TimeoutStopSec.
fn naive_stop(b: &SystemdBox, clients: Clients) {
    let t = Instant::now();
    let stop = b.systemctl(&["stop", UNIT]);
    let took = t.elapsed();
    assert!(
        took >= Duration::from_secs(TIMEOUT_STOP_SEC),
        "stop returned after {took:?}: the server did not drain?\n{}",
        b.journal(UNIT).unwrap_or_default()
    );
    // `systemctl stop` itself reports success: the operator sees nothing wrong.
    assert!(stop.status.success(), "{stop:?}");
    let p = b.show(UNIT, &["ActiveState", "Result", "ExecMainCode", "ExecMainStatus", "NRestarts"]).unwrap();
    assert_eq!(p["Result"], "timeout", "{p:?}");
    assert_eq!(p["ExecMainCode"], "2", "main process killed by a signal: {p:?}");
    assert_eq!(p["ExecMainStatus"], "9", "SIGKILL: {p:?}");
    assert_eq!(p["ActiveState"], "failed", "{p:?}");
    // An explicit stop: Restart=always did not bring it back by itself.
    assert_eq!(p["NRestarts"], "0", "{p:?}");
    let j = b.journal(UNIT).unwrap();
    assert!(j.contains("SIGTERM received."), "the server got SIGTERM first:\n{j}");
    assert!(j.contains("State 'stop-sigterm' timed out. Killing."), "{j}");
    assert!(j.contains("Main process exited, code=killed, status=9/KILL"), "{j}");
    assert!(j.contains("Failed with result 'timeout'."), "{j}");
    // The 16 requests in flight were cut off, none finished.
    let finished =
        clients.into_iter().filter_map(|h| h.join().unwrap()).filter(|(_, body)| body.contains("data: [DONE]")).count();
    assert_eq!(finished, 0, "requests finished although the server was SIGKILLed");
}

#[test]
fn seed_without_daemon_reload_serves_stale_steps_5() {
    let (b, port, clients) = seed();
    naive_stop(&b, clients);
    // Copy the steps=10 unit over the old one; no daemon-reload.
    b.write_file(UNIT_PATH, unit(port, 10)).unwrap();
    assert_eq!(b.prop(UNIT, "NeedDaemonReload").unwrap(), "yes");
    let start = b.systemctl(&["start", UNIT]);
    assert!(start.status.success(), "{start:?}");
    let warn = String::from_utf8_lossy(&start.stderr);
    assert!(warn.contains("changed on disk"), "systemctl warns, the operator may not read it: {warn}");
    let steps = wait_for("the server to answer", Duration::from_secs(20), || served_steps(port)).unwrap();
    // The stale definition ran: steps=5 served while steps=10 is on disk.
    assert_eq!(steps, 5, "served speculative_num_steps");
    assert!(b.read_to_string(UNIT_PATH).unwrap().contains("--speculative-num-steps 10"));
    let pid = b.prop(UNIT, "MainPID").unwrap();
    let cmdline = b.read_to_string(&format!("/proc/{pid}/cmdline")).unwrap().replace('\0', " ");
    assert!(cmdline.contains("--speculative-num-steps 5 "), "{cmdline}");
    assert_eq!(b.prop(UNIT, "NeedDaemonReload").unwrap(), "yes");
    b.shutdown().unwrap();
}

#[test]
fn seed_with_daemon_reload_serves_steps_10_after_a_sigkill() {
    let (b, port, clients) = seed();
    naive_stop(&b, clients);
    b.write_file(UNIT_PATH, unit(port, 10)).unwrap();
    b.systemctl_check(&["daemon-reload"]).unwrap();
    assert_eq!(b.prop(UNIT, "NeedDaemonReload").unwrap(), "no");
    b.systemctl_check(&["start", UNIT]).unwrap();
    let steps = wait_for("the server to answer", Duration::from_secs(20), || served_steps(port)).unwrap();
    assert_eq!(steps, 10);
    b.shutdown().unwrap();
}

/// The race with Restart=always: the server dies under the operator's
/// hands (here: its main process is killed, as an OOM or a crash would)
/// while the new file is being copied. systemd restarts it with what it has
/// loaded — the old unit — before the operator's daemon-reload lands.
#[test]
fn restart_always_brings_back_the_old_unit_before_the_new_file_is_loaded() {
    let b = SystemdBox::boot().unwrap_or_else(|e| panic!("cannot boot the systemd box: {e:#}"));
    let port = free_port();
    b.write_file(UNIT_PATH, unit(port, 5)).unwrap();
    b.systemctl_check(&["daemon-reload"]).unwrap();
    b.systemctl_check(&["start", UNIT]).unwrap();
    wait_until("steps=5 serving", Duration::from_secs(20), || served_steps(port) == Some(5)).unwrap();
    let first = b.prop(UNIT, "InvocationID").unwrap();
    b.systemctl_check(&["kill", "--signal=SIGKILL", UNIT]).unwrap();
    b.write_file(UNIT_PATH, unit(port, 10)).unwrap();
    wait_until("Restart=always to bring it back", Duration::from_secs(20), || {
        b.prop(UNIT, "InvocationID").is_ok_and(|i| !i.is_empty() && i != first)
    })
    .unwrap();
    let steps = wait_for("the server to answer", Duration::from_secs(20), || served_steps(port)).unwrap();
    assert_eq!(steps, 5, "the old unit came back");
    let p = b.show(UNIT, &["NRestarts", "NeedDaemonReload"]).unwrap();
    assert_eq!(p["NRestarts"], "1", "{p:?}");
    assert_eq!(p["NeedDaemonReload"], "yes", "{p:?}");
    b.shutdown().unwrap();
}
