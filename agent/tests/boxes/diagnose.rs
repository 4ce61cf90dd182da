//! Termination diagnosis end to end: each way a server can end is produced for real in a
//! private systemd (the box) with the stand-in server, then `specd diagnose` runs inside the box
//! and must name it.
//!
//! `record_fixtures` (ignored; run with `SPECD_RECORD_FIXTURES=1`) re-records the fixtures in
//! `tests/fixtures/diagnose/` that the classifier's unit tests read: what specd's own gatherer
//! (`diagnose::gather_raw`, run inside the box) reads for each case.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;
use specd::parts::diagnose::{self, Raw};
use specd_e2e::{SystemdBox, bin_path, free_port, wait_until};

fn boot() -> SystemdBox {
    SystemdBox::boot().unwrap_or_else(|e| panic!("cannot boot the systemd box: {e:#}"))
}

fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/diagnose")
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

/// Drops the journal fields diagnosis never reads (cursor, boot ID, monotonic time).
fn trim_journal(text: &str) -> String {
    text.lines()
        .filter_map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).ok()?;
            let o = v.as_object_mut()?;
            for k in ["__CURSOR", "__MONOTONIC_TIMESTAMP", "_BOOT_ID"] {
                o.remove(k);
            }
            Some(serde_json::to_string(&v).unwrap() + "\n")
        })
        .collect()
}

/// The kernel lines of this box only: the ring buffer is the host's, and other boxes (other
/// tests) may have had their own OOM kills in the same seconds.
fn this_box_only(b: &SystemdBox, all: Vec<diagnose::Line>) -> Vec<diagnose::Line> {
    let pids: Vec<String> = all
        .iter()
        .filter(|l| l.message.starts_with("oom-kill:") && l.message.contains(b.name()))
        .filter_map(|l| l.message.split(',').find_map(|kv| kv.strip_prefix("pid=")).map(str::to_string))
        .collect();
    all.into_iter()
        .filter(|l| {
            (l.message.starts_with("oom-kill:") && l.message.contains(b.name()))
                || pids.iter().any(|p| l.message.contains(&format!("Killed process {p} ")))
        })
        .collect()
}

/// What specd's gatherer (`diagnose::gather_raw`) reads about `unit`, run inside the box: this
/// test binary runs itself there (see `in_box_entry`).
fn gathered(b: &SystemdBox, unit: &str) -> Raw {
    let line = in_box(b, unit, "gather");
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"))
}

/// A capture for a fixture: the gatherer's reading, with this box's kernel lines only.
fn capture(b: &SystemdBox, unit: &str) -> Raw {
    let mut raw = gathered(b, unit);
    raw.kernel = this_box_only(b, std::mem::take(&mut raw.kernel));
    raw
}

/// The kernel names cgroups by their host path; the part above the box (the test runner's own
/// cgroup) says nothing about the case and is replaced by `/test.slice`.
fn host_cgroup_prefix_trimmed(m: &str) -> String {
    m.split(',')
        .map(|kv| match (kv.split_once('='), kv.find("/specd-box-")) {
            (Some((k, _)), Some(i)) => format!("{k}=/test.slice{}", &kv[i..]),
            _ => kv.to_string(),
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Saves a capture as fixture files `<name>.*` (see the folder's README).
fn save_fixture(name: &str, raw: &Raw, what: &str) {
    let d = fixtures_dir();
    std::fs::create_dir_all(&d).unwrap();
    let w = |ext: &str, text: &str| std::fs::write(d.join(format!("{name}.{ext}")), text).unwrap();
    w("journal.json", &trim_journal(&raw.journal));
    w("show", &raw.show);
    if !raw.context.is_empty() {
        w("context.json", &trim_journal(&raw.context));
    }
    if !raw.kernel.is_empty() {
        // Kernel lines as journalctl -k -o json gives them.
        let text: String = raw
            .kernel
            .iter()
            .map(|l| {
                serde_json::json!({
                    "__REALTIME_TIMESTAMP": l.time_us.to_string(),
                    "_TRANSPORT": "kernel",
                    "MESSAGE": host_cgroup_prefix_trimmed(&l.message),
                })
                .to_string()
                    + "\n"
            })
            .collect();
        w("kernel.json", &text);
    }
    for (i, f) in raw.unit_files.iter().enumerate() {
        w(&format!("unit{i}"), f);
    }
    let meta = serde_json::json!({
        "unit": raw.unit,
        "what": what,
        "unit_mtime_us": raw.unit_mtime_us,
        "main_cmdline": raw.main_cmdline,
        "oom_kill_count": raw.oom_kill_count,
    });
    w("meta.json", &(serde_json::to_string_pretty(&meta).unwrap() + "\n"));
}

fn install(b: &SystemdBox, unit: &str, text: &str) {
    b.write_file(&format!("/etc/systemd/system/{unit}"), text).unwrap();
}

fn script(b: &SystemdBox, name: &str, body: &str) -> String {
    let p = format!("/run/diag/{name}.sh");
    b.write_file(&p, format!("#!/bin/sh\n{body}")).unwrap();
    format!("/bin/sh {p}")
}

/// Writes specd's stop marker into the box's journal, with the fields specd's
/// `diagnose::journal_note` writes (sent from inside the box, so that journald records the
/// sender's uid, which `journalctl -u` needs).
fn specd_marker(b: &SystemdBox, unit: &str) {
    let entry = format!(
        "MESSAGE=specd: stopping {unit} to apply unit 3f2a9c1b7d4e\nPRIORITY=5\nSYSLOG_IDENTIFIER=specd\nOBJECT_SYSTEMD_UNIT={unit}\nSPECD_ACTION=stop\n"
    );
    let out = b.exec_stdin(&["logger", "--journald"], entry.as_bytes());
    assert!(out.status.success(), "{out:?}");
    wait_until("specd's marker in the journal", Duration::from_secs(10), || {
        b.journal(unit).unwrap().contains("specd: stopping")
    })
    .unwrap();
}

fn wait_prop(b: &SystemdBox, unit: &str, prop: &str, want: &str) {
    wait_until(&format!("{unit} {prop}={want}"), Duration::from_secs(60), || b.prop(unit, prop).unwrap() == want)
        .unwrap_or_else(|e| panic!("{e:#}\n{}", b.journal(unit).unwrap_or_default()));
}

const SGLANG_READY: &str = "echo '[2026-12-02 11:18:00] INFO:     Uvicorn running on http://127.0.0.1:30000 (Press CTRL+C to quit)'\necho '[2026-12-02 11:18:01] The server is fired up and ready to roll!'\n";

/// Records the fixtures of the classifier's unit tests: systemd's side is real (systemd 252 in
/// the box, this host's kernel), the engines' output is printed by small scripts in the
/// engines' real message formats.
#[test]
#[ignore = "re-records tests/fixtures/diagnose; run with SPECD_RECORD_FIXTURES=1"]
fn record_fixtures() {
    if std::env::var_os("SPECD_RECORD_FIXTURES").is_none() {
        return;
    }
    let b = boot();

    // 1. Stop timeout while draining, stop requested by specd (the seed's case, with a unit
    //    file changed on disk and restarted without a reload first).
    let drain = script(
        &b,
        "drain",
        &format!(
            "{SGLANG_READY}{}",
            r#"drain() {
  echo "[2026-12-02 11:20:00] SIGTERM received. signum=15 frame=None. Draining requests and shutting down..."
  while :; do
    echo "[2026-12-02 11:20:05] Gracefully exiting... Remaining number of requests 16. Remaining requests remaining_rids=['a1', 'b2']."
    sleep 0.5
  done
}
trap drain TERM
while :; do sleep 0.2; done
"#
        ),
    );
    install(
        &b,
        "seed.service",
        &format!(
            "[Service]\nExecStart={drain} sglang --model-path /m --port 30001 --speculative-num-steps 3\nTimeoutStopSec=2\n"
        ),
    );
    b.systemctl_check(&["daemon-reload"]).unwrap();
    b.systemctl_check(&["start", "seed.service"]).unwrap();
    install(
        &b,
        "seed.service",
        &format!(
            "[Service]\nExecStart={drain} sglang --model-path /m --port 30001 --speculative-num-steps 5\nTimeoutStopSec=2\n"
        ),
    );
    b.systemctl_check(&["restart", "seed.service"]).unwrap();
    wait_prop(&b, "seed.service", "ActiveState", "active");
    specd_marker(&b, "seed.service");
    let _ = b.systemctl(&["stop", "seed.service"]);
    wait_prop(&b, "seed.service", "Result", "timeout");
    save_fixture(
        "stop-timeout-stale",
        &capture(&b, "seed.service"),
        "recorded: systemd 252 in the box; SGLang's drain messages printed by a script",
    );

    // 2. SGLang drains and SIGKILLs its own process tree: a clean stop.
    let selfkill = script(
        &b,
        "selfkill",
        &format!(
            "{SGLANG_READY}{}",
            r#"drain() {
  echo "[2026-12-02 11:20:00] SIGTERM received. signum=15 frame=None. Draining requests and shutting down..."
  echo "[2026-12-02 11:20:05] Gracefully exiting... Remaining number of requests 0. Remaining requests remaining_rids=[]."
  kill -9 $$
}
trap drain TERM
while :; do sleep 0.2; done
"#
        ),
    );
    install(
        &b,
        "drained.service",
        &format!("[Service]\nExecStart={selfkill} sglang --model-path /m --port 30002\nTimeoutStopSec=30\n"),
    );
    b.systemctl_check(&["daemon-reload"]).unwrap();
    b.systemctl_check(&["start", "drained.service"]).unwrap();
    specd_marker(&b, "drained.service");
    b.systemctl_check(&["stop", "drained.service"]).unwrap();
    save_fixture(
        "clean-stop-sglang-selfkill",
        &capture(&b, "drained.service"),
        "recorded: systemd 252 in the box; SGLang's drain and self-SIGKILL done by a script",
    );

    // 3. CUDA OOM: SGLang's scheduler traceback, then SGLang SIGKILLs itself.
    let cuda = script(
        &b,
        "cuda",
        r#"echo '[2026-12-02 11:18:00] Load weight end. type=LlamaForCausalLM, dtype=torch.bfloat16, avail mem=12.31 GB, mem usage=62.97 GB.'
cat >&2 <<'EOF'
[2026-12-02 11:18:02] Scheduler hit an exception: Traceback (most recent call last):
  File "/usr/local/lib/python3.12/site-packages/sglang/srt/managers/scheduler.py", line 2893, in run_scheduler_process
    scheduler = Scheduler(server_args, port_args, gpu_id, tp_rank, moe_ep_rank, pp_rank, dp_rank)
  File "/usr/local/lib/python3.12/site-packages/torch/utils/_contextlib.py", line 120, in decorate_context
    return func(*args, **kwargs)
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB is free. Including non-PyTorch memory, this process has 78.12 GiB memory in use. Of the allocated memory 75.40 GiB is allocated by PyTorch, and 1.21 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)
EOF
echo '[2026-12-02 11:18:02] Received sigquit from a child process. It usually means the child failed.'
kill -9 $$
"#,
    );
    install(&b, "cuda.service", &format!("[Service]\nExecStart={cuda} sglang --model-path /m --port 30003\n"));
    b.systemctl_check(&["daemon-reload"]).unwrap();
    let _ = b.systemctl(&["start", "cuda.service"]);
    wait_prop(&b, "cuda.service", "ActiveState", "failed");
    save_fixture(
        "cuda-oom-sglang",
        &capture(&b, "cuda.service"),
        "recorded: systemd 252 in the box; SGLang's CUDA OOM traceback (torch format) and self-SIGKILL done by a script",
    );

    // 4. vLLM: no memory for the KV cache blocks, exit 1.
    let vllm = script(
        &b,
        "vllm",
        r#"cat >&2 <<'EOF'
(EngineCore_DP0 pid=2411) ERROR 12-02 11:18:40 [core.py:843] EngineCore failed to start.
(EngineCore_DP0 pid=2411) ERROR 12-02 11:18:40 [core.py:843] ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the engine (this flag also controls CPU memory reservation on the CPU backend, despite its name). See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
EOF
exit 1
"#,
    );
    install(&b, "vllm.service", &format!("[Service]\nExecStart={vllm} serve /m --port 30004\n"));
    b.systemctl_check(&["daemon-reload"]).unwrap();
    let _ = b.systemctl(&["start", "vllm.service"]);
    wait_prop(&b, "vllm.service", "ActiveState", "failed");
    save_fixture(
        "cuda-oom-vllm",
        &capture(&b, "vllm.service"),
        "recorded: systemd 252 in the box; vLLM's KV-cache error printed by a script",
    );

    // 5. Crash: a Python traceback, exit 3.
    let crash = script(
        &b,
        "crash",
        r#"cat >&2 <<'EOF'
Traceback (most recent call last):
  File "/usr/local/lib/python3.12/site-packages/sglang/launch_server.py", line 11, in <module>
    server_args = prepare_server_args(sys.argv[1:])
ValueError: Unknown speculative algorithm name: EAGLE4
EOF
exit 3
"#,
    );
    install(&b, "crash.service", &format!("[Service]\nExecStart={crash} sglang --model-path /m --port 30005\n"));
    b.systemctl_check(&["daemon-reload"]).unwrap();
    let _ = b.systemctl(&["start", "crash.service"]);
    wait_prop(&b, "crash.service", "ActiveState", "failed");
    save_fixture(
        "crash-exit3",
        &capture(&b, "crash.service"),
        "recorded: systemd 252 in the box; the traceback printed by a script",
    );

    // 6. Watchdog.
    install(&b, "wd.service", "[Service]\nExecStart=/bin/sleep 1000\nWatchdogSec=1\n");
    b.systemctl_check(&["daemon-reload"]).unwrap();
    b.systemctl_check(&["start", "wd.service"]).unwrap();
    wait_prop(&b, "wd.service", "Result", "watchdog");
    save_fixture("watchdog", &capture(&b, "wd.service"), "recorded: systemd 252 in the box");

    // 7. Start limit: a crash loop.
    let loop_ = script(
        &b,
        "loop",
        "echo 'RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. Current value: mem_fraction_static=0.95' >&2\nkill -9 $$\n",
    );
    install(
        &b,
        "loop.service",
        &format!(
            "[Unit]\nStartLimitBurst=3\nStartLimitIntervalSec=60\n[Service]\nExecStart={loop_} sglang --model-path /m --port 30006\nRestart=always\nRestartSec=100ms\n"
        ),
    );
    b.systemctl_check(&["daemon-reload"]).unwrap();
    let _ = b.systemctl(&["start", "loop.service"]);
    wait_until("loop.service to give up", Duration::from_secs(30), || {
        b.journal("loop.service").unwrap().contains("Start request repeated too quickly")
    })
    .unwrap();
    save_fixture(
        "start-limit-cuda",
        &capture(&b, "loop.service"),
        "recorded: systemd 252 in the box; SGLang's KV-cache message printed by a script",
    );

    // 8. Memory hog under a memory limit (v1 memory controller on this hybrid host).
    install(&b, "hog.service", "[Service]\nExecStart=/usr/bin/tail /dev/zero\nMemoryMax=64M\n");
    b.systemctl_check(&["daemon-reload"]).unwrap();
    b.systemctl_check(&["start", "hog.service"]).unwrap();
    wait_prop(&b, "hog.service", "ActiveState", "failed");
    let hog = capture(&b, "hog.service");
    assert!(!hog.kernel.is_empty(), "no kernel OOM line for the box");
    save_fixture(
        "oom-kill-hybrid",
        &hog,
        "recorded: systemd 252 in the box on a hybrid (v1 memory) host; kernel lines from the host's ring buffer",
    );

    // 9. Clean stops: requested by a dependency (BindsTo=), and by nobody the journal names.
    install(&b, "db.service", "[Service]\nExecStart=/bin/sleep 1000\n");
    install(&b, "app.service", "[Unit]\nBindsTo=db.service\nAfter=db.service\n[Service]\nExecStart=/bin/sleep 1000\n");
    b.systemctl_check(&["daemon-reload"]).unwrap();
    b.systemctl_check(&["start", "app.service"]).unwrap();
    b.systemctl_check(&["stop", "db.service"]).unwrap();
    wait_prop(&b, "app.service", "ActiveState", "inactive");
    save_fixture("clean-stop-dependency", &capture(&b, "app.service"), "recorded: systemd 252 in the box");
    save_fixture("clean-stop-unattributed", &capture(&b, "db.service"), "recorded: systemd 252 in the box");

    // 10. Stale config, running: restarted after an edit without daemon-reload.
    let idle = script(&b, "idle", "while :; do sleep 0.2; done\n");
    install(&b, "stale.service", &format!("[Service]\nExecStart={idle} sglang --speculative-num-steps 3\n"));
    b.systemctl_check(&["daemon-reload"]).unwrap();
    b.systemctl_check(&["start", "stale.service"]).unwrap();
    install(&b, "stale.service", &format!("[Service]\nExecStart={idle} sglang --speculative-num-steps 5\n"));
    b.systemctl_check(&["restart", "stale.service"]).unwrap();
    wait_prop(&b, "stale.service", "NeedDaemonReload", "yes");
    save_fixture("stale-config-running", &capture(&b, "stale.service"), "recorded: systemd 252 in the box");

    b.shutdown().unwrap();
}

// ---------------------------------------------------------------------------------------------
// Running `specd diagnose` inside the box

/// Where the box's systemd keeps nothing of specd but what a test writes.
const STATE_DIR: &str = "/var/lib/specd";

/// `specd diagnose [UNIT] [--json]` inside the box: exit code, stdout, stderr.
fn specd_diagnose(b: &SystemdBox, unit: Option<&str>, json: bool) -> (i32, String, String) {
    let mut argv = vec![env!("CARGO_BIN_EXE_specd"), "diagnose"];
    argv.extend(unit);
    if json {
        argv.push("--json");
    }
    let out = b.exec_env(&argv, &[("SPECD_STATE_DIR", STATE_DIR)]);
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code().unwrap_or(-1), text(&out.stdout), text(&out.stderr))
}

/// The library run inside the box for the tests of this file, which run this test binary there
/// with `SPECD_DIAG_UNIT` and `SPECD_DIAG_CALL`: `last` prints `diagnose::last_verdict` (what
/// `specd status` shows), `gather` the `diagnose::gather_raw` reading, as one JSON line. Does
/// nothing unless run that way.
#[test]
#[ignore = "run inside the box by the tests of this file"]
fn in_box_entry() {
    let (Ok(unit), Ok(call)) = (std::env::var("SPECD_DIAG_UNIT"), std::env::var("SPECD_DIAG_CALL")) else { return };
    let json = match call.as_str() {
        "last" => serde_json::to_string(&rt().block_on(diagnose::last_verdict(&unit))),
        "gather" => {
            serde_json::to_string(&rt().block_on(diagnose::gather_raw(&unit, diagnose::MAX_INSTANCES)).unwrap())
        }
        other => panic!("SPECD_DIAG_CALL={other}"),
    };
    println!("{}", json.unwrap());
    std::io::stdout().flush().unwrap();
    std::process::exit(0);
}

/// `in_box_entry` for `unit` and `call` inside the box: the JSON line it printed.
fn in_box(b: &SystemdBox, unit: &str, call: &str) -> String {
    let exe = std::env::current_exe().unwrap();
    let out = b.exec_env(
        &[exe.to_str().unwrap(), "--ignored", "--exact", "diagnose::in_box_entry", "--nocapture", "--test-threads=1"],
        &[("SPECD_DIAG_UNIT", unit), ("SPECD_DIAG_CALL", call)],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    match stdout.lines().find_map(|l| l.strip_prefix("test diagnose::in_box_entry ... ")) {
        Some(line) => line.to_string(),
        None => panic!("{stdout}\n{}", String::from_utf8_lossy(&out.stderr)),
    }
}

/// `specd::diagnose::last_verdict(unit)` run inside the box (what `specd status` shows).
fn last_verdict(b: &SystemdBox, unit: &str) -> Value {
    let line = in_box(b, unit, "last");
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"))
}

/// The diagnoses of `unit`, newest first, from `specd diagnose UNIT --json` in the box.
fn diagnoses(b: &SystemdBox, unit: &str) -> Vec<Value> {
    let (code, out, err) = specd_diagnose(b, Some(unit), true);
    assert_eq!(code, 0, "specd diagnose {unit} --json: exit {code}\nstdout: {out}\nstderr: {err}");
    let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("not JSON ({e}): {out}\nstderr: {err}"));
    let all = v.as_array().expect("a JSON array").clone();
    assert!(all.iter().all(|d| d["unit"] == unit), "{out}");
    assert!(!all.is_empty(), "no diagnosis: {out}");
    all
}

fn newest(b: &SystemdBox, unit: &str) -> Value {
    diagnoses(b, unit).remove(0)
}

fn text(v: &Value) -> String {
    v.as_str().unwrap_or_default().to_string()
}

/// Whether a diagnosis cites `needle` in its evidence, with a timestamp.
fn cites(d: &Value, needle: &str) -> bool {
    d["evidence"].as_array().unwrap().iter().any(|e| {
        text(&e["text"]).contains(needle)
            && text(&e["time"]).starts_with(char::is_numeric)
            && text(&e["time"]).ends_with('Z')
    })
}

#[track_caller]
fn assert_verdict(d: &Value, verdict: &str) {
    assert_eq!(d["verdict"], verdict, "{}", serde_json::to_string_pretty(d).unwrap());
}

#[track_caller]
fn assert_summary(d: &Value, needle: &str) {
    assert!(
        text(&d["summary"]).contains(needle),
        "{needle:?} not in the summary: {}",
        serde_json::to_string_pretty(d).unwrap()
    );
}

// ---------------------------------------------------------------------------------------------
// The stand-in in the box

/// A unit running the stand-in as an SGLang server (or another flavour via `engine`).
/// `engine` is the stand-in's arguments before `--host`/`--port`, e.g. `sglang --model-path /m`.
fn standin_unit(engine: &str, port: u16, env: &[&str], service: &str) -> String {
    let standin = bin_path("specd-standin");
    let env: String = env.iter().map(|e| format!("Environment={e}\n")).collect();
    format!(
        "[Unit]\nDescription=stand-in {engine}\n[Service]\nExecStart={} {engine} --host 127.0.0.1 --port {port}\n{env}Environment=SPECD_STANDIN_LOAD_MS=50\nEnvironment=SPECD_STANDIN_WARMUP_MS=50\n{service}",
        standin.display()
    )
}

fn start(b: &SystemdBox, unit: &str, text: &str) {
    install(b, unit, text);
    b.systemctl_check(&["daemon-reload"]).unwrap();
    b.systemctl_check(&["start", unit]).unwrap();
}

/// An HTTP/1.1 request to the stand-in on 127.0.0.1 (the box shares the host's network).
fn http(port: u16, method: &str, path: &str, body: &str) -> Option<TcpStream> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).ok()?;
    Some(s)
}

fn get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut s = http(port, "GET", path, "")?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let code = out.split_whitespace().nth(1)?.parse().ok()?;
    Some((code, out))
}

fn wait_ready(b: &SystemdBox, unit: &str, port: u16) {
    wait_until(&format!("{unit} ready on port {port}"), Duration::from_secs(30), || {
        get(port, "/health").is_some_and(|(c, _)| c == 200)
    })
    .unwrap_or_else(|e| panic!("{e:#}\n{}", b.journal(unit).unwrap_or_default()));
}

// ---------------------------------------------------------------------------------------------
// The classes, produced for real

/// The seed's case: a stop while the server drains 16 requests outlives TimeoutStopSec; systemd
/// SIGKILLs it. That is a stop timeout, not an OOM.
#[test]
fn stop_timeout_while_draining_is_not_an_oom() {
    let b = boot();
    let port = free_port();
    let unit = "diag-drain.service";
    start(
        &b,
        unit,
        &standin_unit(
            "sglang --model-path /m --enable-metrics",
            port,
            &["SPECD_STANDIN_TOKENS_PER_SEC=1", "SPECD_STANDIN_DRAIN_POLL_MS=200"],
            "TimeoutStopSec=3\n",
        ),
    );
    wait_ready(&b, unit, port);
    let body = r#"{"text": "hello", "sampling_params": {"max_new_tokens": 100000}}"#;
    let _requests: Vec<TcpStream> =
        (0..16).map(|_| http(port, "POST", "/generate", body).expect("send /generate")).collect();
    wait_until("16 requests running", Duration::from_secs(30), || {
        get(port, "/metrics").is_some_and(|(_, m)| {
            m.lines().any(|l| {
                l.starts_with("sglang:num_running_reqs")
                    && l.split_whitespace().last().and_then(|v| v.parse::<f64>().ok()) == Some(16.0)
            })
        })
    })
    .unwrap();
    // Returns once systemd has given up on the drain and killed the server.
    let _ = b.systemctl(&["stop", unit]);
    assert_eq!(b.prop(unit, "Result").unwrap(), "timeout");

    let d = newest(&b, unit);
    assert_verdict(&d, "stop-timeout-kill");
    assert_ne!(d["verdict"], "oom-kill");
    assert_summary(&d, "systemd killed the server 3 s after SIGTERM");
    assert_summary(&d, "(16 requests in flight)");
    assert_summary(&d, "not an OOM");
    assert!(cites(&d, "State 'stop-sigterm' timed out. Killing."), "{d:#}");
    assert!(cites(&d, "Gracefully exiting... Remaining number of requests 16."), "{d:#}");
    assert!(cites(&d, "Main process exited, code=killed, status=9/KILL"), "{d:#}");
    assert!(d["ended"].is_string(), "{d:#}");
    b.shutdown().unwrap();
}

/// Each engine's CUDA OOM death: SGLang SIGKILLs its own process tree (Result=signal, 9/KILL),
/// vLLM and llama.cpp exit 1. All are CUDA OOM, not a crash or a kernel OOM kill.
#[test]
fn cuda_oom_is_cuda_oom_whatever_the_exit() {
    let b = boot();
    let cases = [
        (
            "diag-cuda-sglang.service",
            "sglang --model-path /m",
            "PyTorch CUDA out of memory",
            "signal 9/KILL",
            "torch.OutOfMemoryError: CUDA out of memory.",
        ),
        (
            "diag-cuda-vllm.service",
            "vllm serve /m",
            "PyTorch CUDA out of memory",
            "exit status 1",
            "torch.OutOfMemoryError: CUDA out of memory.",
        ),
        (
            "diag-cuda-llama.service",
            "llama-cpp -m /m.gguf",
            "llama.cpp: cudaMalloc failed",
            "exit status 1",
            "cudaMalloc failed: out of memory",
        ),
    ];
    for (unit, engine, ..) in cases {
        start(&b, unit, &standin_unit(engine, free_port(), &["SPECD_STANDIN_CUDA_OOM=1"], ""));
    }
    for (unit, _, what, status, line) in cases {
        wait_prop(&b, unit, "ActiveState", "failed");
        let d = newest(&b, unit);
        assert_verdict(&d, "cuda-oom");
        assert_summary(&d, what);
        assert_summary(&d, status);
        assert!(cites(&d, line), "{d:#}");
    }
    assert_eq!(b.prop("diag-cuda-sglang.service", "Result").unwrap(), "signal");
    assert_summary(&newest(&b, "diag-cuda-sglang.service"), "sent by the server itself");
    b.shutdown().unwrap();
}

/// Exit 3 is a crash; the text output leads with the verdict; no unit means every unit specd
/// has state for; a unit that does not exist cannot be diagnosed (exit 2).
#[test]
fn exit_3_is_a_crash() {
    let b = boot();
    let unit = "diag-crash.service";
    start(&b, unit, &standin_unit("sglang --model-path /m", free_port(), &["SPECD_STANDIN_EXIT_CODE=3"], ""));
    wait_prop(&b, unit, "ActiveState", "failed");
    let d = newest(&b, unit);
    assert_verdict(&d, "crash");
    assert_summary(&d, "exit status 3");
    assert_summary(&d, "exiting with code 3");
    assert!(cites(&d, "Main process exited, code=exited, status=3/NOTIMPLEMENTED"), "{d:#}");
    assert_eq!(last_verdict(&b, unit), d, "status shows the same verdict");
    // What the gatherer reads (as the fixtures are recorded), diagnosed here, is what
    // `specd diagnose` printed.
    let raw = gathered(&b, unit);
    let here: Vec<Value> =
        diagnose::assemble(&raw).iter().rev().map(|e| serde_json::to_value(diagnose::classify(e)).unwrap()).collect();
    assert_eq!(here, diagnoses(&b, unit));

    let (code, out, err) = specd_diagnose(&b, Some(unit), false);
    assert_eq!(code, 0, "{out}{err}");
    let mut lines = out.lines();
    let head = lines.next().unwrap_or_default();
    assert!(head.starts_with("diag-crash.service ") && head.ends_with(": crash"), "{out}");
    assert!(lines.next().unwrap_or_default().contains("crash: the server died on its own: exit status 3"), "{out}");
    assert!(out.lines().any(|l| l.trim_start().starts_with("20") && l.contains("status=3/NOTIMPLEMENTED")), "{out}");

    // No unit: the units specd has state for; none yet.
    let (code, out, err) = specd_diagnose(&b, None, true);
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains("no state for any unit"), "{err}");
    b.write_file(&format!("{STATE_DIR}/units/{unit}.json"), format!("{{\"unit\": \"{unit}\"}}\n")).unwrap();
    let (code, out, err) = specd_diagnose(&b, None, true);
    assert_eq!(code, 0, "{out}{err}");
    let all: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(all[0]["unit"], unit, "{out}");
    assert_eq!(all[0]["verdict"], "crash", "{out}");

    let (code, _, err) = specd_diagnose(&b, Some("diag-nope.service"), true);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("no such unit"), "{err}");
    b.shutdown().unwrap();
}

/// A restart after the unit file changed on disk, without daemon-reload, runs systemd's old copy
/// of the unit (the seed's steps=5 instance). After a reload and restart it runs the file.
#[test]
fn start_with_a_changed_unit_file_and_no_reload_is_a_stale_config_start() {
    let b = boot();
    let port = free_port();
    let unit = "diag-stale.service";
    start(&b, unit, &standin_unit("sglang --model-path /m --mem-fraction-static 0.80", port, &[], ""));
    wait_ready(&b, unit, port);
    install(&b, unit, &standin_unit("sglang --model-path /m --mem-fraction-static 0.85", port, &[], ""));
    b.systemctl_check(&["restart", unit]).unwrap();
    wait_prop(&b, unit, "NeedDaemonReload", "yes");
    wait_ready(&b, unit, port);

    let ds = diagnoses(&b, unit);
    let d = &ds[0];
    assert_verdict(d, "stale-config-start");
    assert_summary(d, "NeedDaemonReload=yes");
    assert_summary(d, "--mem-fraction-static 0.80 --host 127.0.0.1");
    assert_summary(d, "differs from the unit on disk");
    assert_summary(d, "--mem-fraction-static 0.85 --host 127.0.0.1");
    assert!(d["ended"].is_null(), "it still runs: {d:#}");
    // The instance the restart replaced started from the file as it was then; it is the last
    // one that ended.
    assert_verdict(&ds[1], "clean-stop");
    assert_eq!(last_verdict(&b, unit), ds[1]);

    b.systemctl_check(&["daemon-reload"]).unwrap();
    b.systemctl_check(&["restart", unit]).unwrap();
    wait_ready(&b, unit, port);
    let d = newest(&b, unit);
    assert_verdict(&d, "running");
    assert!(d["notes"].as_array().unwrap().is_empty(), "{d:#}");
    b.shutdown().unwrap();
}

/// A memory hog under a memory limit. On this hybrid host (v1 memory controller) systemd sees
/// only a SIGKILL (Result=signal); the kernel's OOM-killer line naming the unit's cgroup, read
/// from the kernel ring buffer, makes it an OOM kill. On a cgroup v2 host systemd itself says
/// Result=oom-kill.
#[test]
fn memory_hog_under_a_memory_limit_is_an_oom_kill() {
    let b = boot();
    let unit = "diag-hog.service";
    start(
        &b,
        unit,
        &standin_unit("sglang --model-path /m", free_port(), &["SPECD_STANDIN_MEMORY_HOG=1"], "MemoryMax=64M\n"),
    );
    wait_prop(&b, unit, "ActiveState", "failed");
    let p = b.show(unit, &["Result", "ExecMainCode", "ExecMainStatus"]).unwrap();
    let expected = match b.cgroup_layout() {
        specd_e2e::CgroupLayout::Unified => "oom-kill",
        _ => "signal",
    };
    assert_eq!(p["Result"], expected, "{p:?}");
    assert_eq!((p["ExecMainCode"].as_str(), p["ExecMainStatus"].as_str()), ("2", "9"), "{p:?}");

    let d = newest(&b, unit);
    assert_verdict(&d, "oom-kill");
    assert_summary(&d, "the memory cgroup limit was reached");
    assert!(cites(&d, "Memory cgroup out of memory: Killed process"), "{d:#}");
    assert!(cites(&d, "/system.slice/diag-hog.service"), "{d:#}");
    b.shutdown().unwrap();
}

/// A clean stop (and who asked, when the journal does not say), a watchdog kill, and a crash
/// loop that hits the start limit.
#[test]
fn clean_stop_watchdog_and_start_limit() {
    let b = boot();
    let port = free_port();
    start(
        &b,
        "diag-clean.service",
        &standin_unit("sglang --model-path /m", port, &["SPECD_STANDIN_DRAIN_POLL_MS=50"], ""),
    );
    start(&b, "diag-wd.service", &standin_unit("sglang --model-path /m", free_port(), &[], "WatchdogSec=1\n"));
    install(
        &b,
        "diag-loop.service",
        &standin_unit(
            "sglang --model-path /m",
            free_port(),
            &["SPECD_STANDIN_EXIT_CODE=3"],
            "Restart=always\nRestartSec=100ms\nStartLimitBurst=3\nStartLimitIntervalSec=60\n",
        ),
    );
    b.systemctl_check(&["daemon-reload"]).unwrap();
    let _ = b.systemctl(&["start", "diag-loop.service"]);
    wait_ready(&b, "diag-clean.service", port);
    b.systemctl_check(&["stop", "diag-clean.service"]).unwrap();

    let d = newest(&b, "diag-clean.service");
    assert_verdict(&d, "clean-stop");
    assert_summary(&d, "stopped on request by a stop request the journal does not attribute");
    assert!(cites(&d, "Stopping diag-clean.service"), "{d:#}");

    wait_prop(&b, "diag-wd.service", "Result", "watchdog");
    let d = newest(&b, "diag-wd.service");
    assert_verdict(&d, "watchdog");
    assert_summary(&d, "WatchdogSec=1 s");
    assert!(cites(&d, "Watchdog timeout (limit 1s)!"), "{d:#}");

    wait_until("the start limit", Duration::from_secs(30), || {
        b.journal("diag-loop.service").unwrap().contains("Start request repeated too quickly")
    })
    .unwrap();
    let ds = diagnoses(&b, "diag-loop.service");
    assert_eq!(ds.len(), 3, "{ds:#?}");
    assert_verdict(&ds[0], "start-limit-hit");
    assert_summary(&ds[0], "after 3 restarts");
    assert_summary(&ds[0], "exit status 3");
    for d in &ds[1..] {
        assert_verdict(d, "crash");
    }
    b.shutdown().unwrap();
}
