//! Termination diagnosis end to end: each way a server can end is produced for real in a
//! private systemd (the box), then diagnosed.
//!
//! `record_fixtures` (ignored; run with `SPECD_RECORD_FIXTURES=1`) re-records the fixtures in
//! `tests/fixtures/diagnose/` that the classifier's unit tests read.

use std::path::{Path, PathBuf};
use std::time::Duration;

use specd::diagnose::{self, JOURNAL_FIELDS, Raw, SHOW_PROPS};
use specd_e2e::{SystemdBox, wait_until};

fn boot() -> SystemdBox {
    SystemdBox::boot().unwrap_or_else(|e| panic!("cannot boot the systemd box: {e:#}"))
}

fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/diagnose")
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

fn now_us() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_micros() as u64
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

fn journal_json(b: &SystemdBox, matches: &[&str]) -> String {
    let fields = format!("--output-fields={JOURNAL_FIELDS}");
    let mut argv = vec!["journalctl", "--no-pager", "-o", "json", &fields];
    argv.extend_from_slice(matches);
    let out = b.exec(&argv);
    trim_journal(&String::from_utf8_lossy(&out.stdout))
}

/// The host kernel's OOM-killer lines about this box since `since_us` (the box's journald does
/// not read the kernel log; the host's ring buffer has them, naming the box's cgroup).
fn kernel_lines(b: &SystemdBox, since_us: u64) -> Vec<diagnose::Line> {
    let all = rt().block_on(diagnose::kernel_oom_lines(since_us));
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

/// What specd's gatherer reads, read from the box from outside (same commands, same parsing).
fn capture(b: &SystemdBox, unit: &str, since_us: u64) -> Raw {
    let show = b.systemctl_check(&["show", unit, "-p", &SHOW_PROPS.join(",")]).unwrap();
    let view = diagnose::parse_show(&show);
    let mut ctx: Vec<String> =
        vec!["SYSLOG_IDENTIFIER=specd".into(), "SYSLOG_IDENTIFIER=sudo".into(), "SYSLOG_IDENTIFIER=polkitd".into()];
    for (_, dep) in &view.stop_deps {
        ctx.extend(["+".into(), "_PID=1".into(), format!("UNIT={dep}")]);
    }
    let ctx: Vec<&str> = ctx.iter().map(String::as_str).collect();
    let mut files = Vec::new();
    let mut mtime = None;
    for p in std::iter::once(&view.fragment_path).chain(view.drop_in_paths.iter()) {
        if let Ok(t) = b.read_to_string(p) {
            files.push(t);
            let m = std::fs::metadata(b.host_path(p))
                .and_then(|m| m.modified())
                .ok()
                .and_then(|m| m.duration_since(std::time::UNIX_EPOCH).ok())
                .map(|d| d.as_micros() as u64);
            mtime = mtime.max(m);
        }
    }
    let main_cmdline =
        (view.main_pid > 0).then(|| b.read_file(&format!("/proc/{}/cmdline", view.main_pid)).ok()).flatten().map(|c| {
            c.strip_suffix(&[0])
                .unwrap_or(&c)
                .split(|x| *x == 0)
                .map(|w| String::from_utf8_lossy(w).into_owned())
                .collect()
        });
    Raw {
        unit: unit.into(),
        show,
        journal: journal_json(b, &["-u", unit]),
        context: journal_json(b, &ctx),
        kernel: kernel_lines(b, since_us),
        unit_files: files,
        unit_mtime_us: mtime,
        main_cmdline,
        oom_kill_count: None,
    }
}

/// Saves a capture as fixture files `<name>.*` (see the folder's README).
fn save_fixture(name: &str, raw: &Raw, what: &str) {
    let d = fixtures_dir();
    std::fs::create_dir_all(&d).unwrap();
    let w = |ext: &str, text: &str| std::fs::write(d.join(format!("{name}.{ext}")), text).unwrap();
    w("journal.json", &raw.journal);
    w("show", &raw.show);
    if !raw.context.is_empty() {
        w("context.json", &raw.context);
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
                    "MESSAGE": l.message,
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
    let since = now_us();
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
        &capture(&b, "seed.service", since),
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
        &capture(&b, "drained.service", since),
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
        &capture(&b, "cuda.service", since),
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
        &capture(&b, "vllm.service", since),
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
        &capture(&b, "crash.service", since),
        "recorded: systemd 252 in the box; the traceback printed by a script",
    );

    // 6. Watchdog.
    install(&b, "wd.service", "[Service]\nExecStart=/bin/sleep 1000\nWatchdogSec=1\n");
    b.systemctl_check(&["daemon-reload"]).unwrap();
    b.systemctl_check(&["start", "wd.service"]).unwrap();
    wait_prop(&b, "wd.service", "Result", "watchdog");
    save_fixture("watchdog", &capture(&b, "wd.service", since), "recorded: systemd 252 in the box");

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
        &capture(&b, "loop.service", since),
        "recorded: systemd 252 in the box; SGLang's KV-cache message printed by a script",
    );

    // 8. Memory hog under a memory limit (v1 memory controller on this hybrid host).
    install(&b, "hog.service", "[Service]\nExecStart=/usr/bin/tail /dev/zero\nMemoryMax=64M\n");
    b.systemctl_check(&["daemon-reload"]).unwrap();
    b.systemctl_check(&["start", "hog.service"]).unwrap();
    wait_prop(&b, "hog.service", "ActiveState", "failed");
    let hog = capture(&b, "hog.service", since);
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
    save_fixture("clean-stop-dependency", &capture(&b, "app.service", since), "recorded: systemd 252 in the box");
    save_fixture("clean-stop-unattributed", &capture(&b, "db.service", since), "recorded: systemd 252 in the box");

    // 10. Stale config, running: restarted after an edit without daemon-reload.
    let idle = script(&b, "idle", "while :; do sleep 0.2; done\n");
    install(&b, "stale.service", &format!("[Service]\nExecStart={idle} sglang --speculative-num-steps 3\n"));
    b.systemctl_check(&["daemon-reload"]).unwrap();
    b.systemctl_check(&["start", "stale.service"]).unwrap();
    install(&b, "stale.service", &format!("[Service]\nExecStart={idle} sglang --speculative-num-steps 5\n"));
    b.systemctl_check(&["restart", "stale.service"]).unwrap();
    wait_prop(&b, "stale.service", "NeedDaemonReload", "yes");
    save_fixture("stale-config-running", &capture(&b, "stale.service", since), "recorded: systemd 252 in the box");

    b.shutdown().unwrap();
}
