//! The stand-in run as a process, as systemd runs it.

use specd_e2e::{Reaped, bin_path, free_port, http, http_get, wait_for, wait_until};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

fn standin(args: &[&str], env: &[(&str, &str)]) -> Reaped {
    let mut c = Command::new(bin_path("specd-standin"));
    c.args(args).stdout(Stdio::null()).stderr(Stdio::piped());
    for (k, v) in env {
        c.env(k, v);
    }
    Reaped(c.spawn().unwrap())
}

fn wait_exit(p: &mut Reaped, timeout: Duration) -> ExitStatus {
    wait_for("the stand-in to exit", timeout, || p.0.try_wait().unwrap()).unwrap()
}

fn stderr_of(p: &mut Reaped) -> String {
    let mut s = String::new();
    use std::io::Read;
    p.0.stderr.take().unwrap().read_to_string(&mut s).unwrap();
    s
}

fn sigterm(p: &Reaped) {
    // SAFETY: kill(2) on our child.
    unsafe { libc::kill(p.0.id() as i32, libc::SIGTERM) };
}

#[test]
fn sglang_loads_warms_up_then_serves_its_args() {
    let port = free_port();
    let ps = port.to_string();
    let _p = standin(
        &[
            "sglang",
            "--model-path",
            "/models/q",
            "--port",
            &ps,
            "--tp-size",
            "4",
            "--speculative-algorithm",
            "NEXTN",
            "--speculative-num-steps",
            "5",
            "--speculative-eagle-topk",
            "1",
            "--speculative-num-draft-tokens",
            "6",
            "--standin-load-ms",
            "400",
            "--standin-warmup-ms",
            "300",
        ],
        &[("SPECD_STANDIN_ACCEPT_LENGTH", "3.4")],
    );
    let start = Instant::now();
    // Port closed while loading, then 503 while warming up, then 200.
    assert!(http_get(port, "/health").is_none(), "port open during load");
    let first = wait_for("the port to open", Duration::from_secs(10), || http_get(port, "/health")).unwrap();
    assert_eq!(first.0, 503, "first answer must be 503 (warmup)");
    assert!(start.elapsed() >= Duration::from_millis(400));
    wait_until("/health_generate 200", Duration::from_secs(10), || {
        http_get(port, "/health_generate").is_some_and(|(c, _)| c == 200)
    })
    .unwrap();
    let (code, body) = http_get(port, "/get_server_info").unwrap();
    assert_eq!(code, 200);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["speculative_algorithm"], "EAGLE");
    assert_eq!(v["speculative_num_steps"], 5);
    assert_eq!(v["speculative_eagle_topk"], 1);
    assert_eq!(v["speculative_num_draft_tokens"], 6);
    assert_eq!(v["tp_size"], 4);
    assert_eq!(v["port"], port);
    assert_eq!(v["internal_states"][0]["avg_spec_accept_length"], 3.4);
    let (_, body2) = http_get(port, "/server_info").unwrap();
    assert_eq!(serde_json::from_str::<serde_json::Value>(&body2).unwrap()["speculative_num_steps"], 5);
    // No --enable-metrics: SGLang serves no /metrics.
    assert_eq!(http_get(port, "/metrics").unwrap().0, 404);
}

#[test]
fn sglang_generate_streams_and_sigterm_drains_without_timeout() {
    let port = free_port();
    let ps = port.to_string();
    let mut p = standin(
        &["sglang", "--model-path", "/m", "--port", &ps, "--enable-metrics", "--max-running-requests", "2"],
        &[
            ("SPECD_STANDIN_LOAD_MS", "0"),
            ("SPECD_STANDIN_WARMUP_MS", "0"),
            ("SPECD_STANDIN_TOKENS_PER_SEC", "20"),
            ("SPECD_STANDIN_DRAIN_POLL_MS", "200"),
        ],
    );
    wait_until("ready", Duration::from_secs(10), || http_get(port, "/health").is_some_and(|(c, _)| c == 200)).unwrap();
    // Non-stream
    let (c, b) = http(
        port,
        "POST",
        "/generate",
        Some(r#"{"text":"hi","sampling_params":{"max_new_tokens":3}}"#),
        Duration::from_secs(10),
    )
    .unwrap();
    assert_eq!(c, 200);
    let v: serde_json::Value = serde_json::from_str(&b).unwrap();
    assert_eq!(v["meta_info"]["completion_tokens"], 3);
    // 3 streaming requests of 30 tokens at 20 tok/s (1.5 s each); 2 slots.
    let hs: Vec<_> = (0..3)
        .map(|_| {
            std::thread::spawn(move || {
                http(
                    port,
                    "POST",
                    "/generate",
                    Some(r#"{"text":"hi","sampling_params":{"max_new_tokens":30},"stream":true}"#),
                    Duration::from_secs(30),
                )
            })
        })
        .collect();
    let metric = |name: &str| -> Option<f64> {
        let (_, m) = http_get(port, "/metrics")?;
        m.lines().find(|l| l.starts_with(name))?.split_whitespace().last()?.parse().ok()
    };
    wait_until("2 running + 1 queued", Duration::from_secs(10), || {
        metric("sglang:num_running_reqs") == Some(2.0) && metric("sglang:num_queue_reqs") == Some(1.0)
    })
    .unwrap();
    let t = Instant::now();
    sigterm(&p);
    wait_until("/health 503 while draining", Duration::from_secs(5), || {
        http_get(port, "/health").is_some_and(|(c, _)| c == 503)
    })
    .unwrap();
    let st = wait_exit(&mut p, Duration::from_secs(30));
    assert!(st.success(), "{st}");
    // The queued request ran after the first two: ~3 s of work, all served.
    assert!(t.elapsed() >= Duration::from_millis(1500), "exited before draining: {:?}", t.elapsed());
    for h in hs {
        let (c, body) = h.join().unwrap().expect("a full answer");
        assert_eq!(c, 200);
        assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
        let last = body.lines().rfind(|l| l.starts_with("data: {")).unwrap();
        let v: serde_json::Value = serde_json::from_str(&last[6..]).unwrap();
        assert_eq!(v["meta_info"]["completion_tokens"], 30);
        assert_eq!(v["meta_info"]["finish_reason"]["type"], "length");
    }
    let log = stderr_of(&mut p);
    assert!(log.contains("SIGTERM received. signum=15"), "{log}");
    assert!(log.contains("Gracefully exiting... Remaining number of requests"), "{log}");
}

#[test]
fn bad_command_lines_fail_like_the_engines() {
    let mut p = standin(&["sglang", "--model-path", "/m", "--speculative-num-stepz", "3"], &[]);
    assert_eq!(wait_exit(&mut p, Duration::from_secs(5)).code(), Some(2));
    assert!(stderr_of(&mut p).contains("error: unrecognized arguments: --speculative-num-stepz"));
    let mut p = standin(
        &["sglang", "--model-path", "/m", "--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "2"],
        &[],
    );
    assert_eq!(wait_exit(&mut p, Duration::from_secs(5)).code(), Some(1));
    assert!(stderr_of(&mut p).trim_end().ends_with("AssertionError"));
    let mut p = standin(&["llama-cpp", "-m", "/m.gguf", "--draft-max", "8"], &[]);
    assert_eq!(wait_exit(&mut p, Duration::from_secs(5)).code(), Some(1));
    assert!(stderr_of(&mut p).contains("the argument has been removed. use --spec-draft-n-max"));
    let mut p =
        standin(&["vllm", "serve", "/m", "--speculative-config", "{\"method\":\"eagle\",\"model\":\"/d\"}"], &[]);
    assert_eq!(wait_exit(&mut p, Duration::from_secs(5)).code(), Some(1));
    assert!(
        stderr_of(&mut p).contains("A speculative model was provided, but `num_speculative_tokens` was not provided")
    );
}

#[test]
fn fault_knobs() {
    let mut p = standin(
        &["sglang", "--model-path", "/m", "--port", &free_port().to_string()],
        &[("SPECD_STANDIN_EXIT_CODE", "3")],
    );
    assert_eq!(wait_exit(&mut p, Duration::from_secs(5)).code(), Some(3));
    // CUDA OOM during load: SGLang logs the torch error and SIGKILLs itself.
    let mut p = standin(
        &[
            "sglang",
            "--model-path",
            "/m",
            "--port",
            &free_port().to_string(),
            "--standin-cuda-oom",
            "--standin-load-ms",
            "50",
        ],
        &[],
    );
    let st = wait_exit(&mut p, Duration::from_secs(5));
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(st.signal(), Some(libc::SIGKILL), "{st}");
    let log = stderr_of(&mut p);
    assert!(log.contains("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate"), "{log}");
    let mut p = standin(
        &["vllm", "/m", "--port", &free_port().to_string()],
        &[("SPECD_STANDIN_CUDA_OOM", "1"), ("SPECD_STANDIN_LOAD_MS", "0")],
    );
    assert_eq!(wait_exit(&mut p, Duration::from_secs(5)).code(), Some(1));
    assert!(stderr_of(&mut p).contains("Engine core initialization failed"));
}

#[test]
fn lingering_child_ignores_sigterm() {
    let port = free_port();
    let mut p = standin(
        &["sglang", "--model-path", "/m", "--port", &port.to_string()],
        &[("SPECD_STANDIN_LINGER_CHILD", "1"), ("SPECD_STANDIN_LOAD_MS", "0"), ("SPECD_STANDIN_DRAIN_POLL_MS", "50")],
    );
    let child = wait_for("the lingering child", Duration::from_secs(5), || {
        std::fs::read_dir("/proc").unwrap().flatten().find_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let ppid: u32 = stat[stat.rfind(')')? + 2..].split(' ').nth(1)?.parse().ok()?;
            // A child that already ended (a zombie) has no command line: not the lingering one.
            let alive = !std::fs::read_to_string(format!("/proc/{pid}/cmdline")).ok()?.is_empty();
            (ppid == p.0.id() && alive).then_some(pid)
        })
    })
    .unwrap();
    let cmdline = std::fs::read_to_string(format!("/proc/{child}/cmdline")).unwrap();
    assert!(cmdline.contains("specd-standin"), "{cmdline}");
    wait_until("ready", Duration::from_secs(10), || http_get(port, "/health").is_some_and(|(c, _)| c == 200)).unwrap();
    // SAFETY: kill(2) on the child we found.
    unsafe { libc::kill(child as i32, libc::SIGTERM) };
    sigterm(&p);
    assert!(wait_exit(&mut p, Duration::from_secs(10)).success());
    // The child is still there after SIGTERM (it was reparented).
    assert!(std::path::Path::new(&format!("/proc/{child}")).exists());
    let state = std::fs::read_to_string(format!("/proc/{child}/stat")).unwrap();
    assert!(!state.contains(") Z "), "{state}");
    // SAFETY: clean up the child we spawned.
    unsafe { libc::kill(child as i32, libc::SIGKILL) };
}

#[test]
fn llama_cpp_503_loading_then_props() {
    let port = free_port();
    let _p = standin(
        &[
            "llama-cpp",
            "-m",
            "/m.gguf",
            "--port",
            &port.to_string(),
            "-np",
            "3",
            "--spec-draft-model",
            "/d.gguf",
            "--spec-draft-n-max",
            "6",
        ],
        &[("SPECD_STANDIN_LOAD_MS", "500")],
    );
    let (c, b) = wait_for("the port", Duration::from_secs(5), || http_get(port, "/health")).unwrap();
    assert_eq!(c, 503);
    assert!(b.contains("Loading model"), "{b}");
    wait_until("ready", Duration::from_secs(10), || {
        http_get(port, "/health").is_some_and(|(c, b)| c == 200 && b.contains("\"ok\""))
    })
    .unwrap();
    let (_, props) = http_get(port, "/props").unwrap();
    let v: serde_json::Value = serde_json::from_str(&props).unwrap();
    assert_eq!(v["total_slots"], 3);
    assert_eq!(v["model_path"], "/m.gguf");
    // A draft model without --spec-type is loaded and never used: no slot
    // speculates. /props shows no speculation either way.
    assert_eq!(v["default_generation_settings"]["params"]["speculative.types"], "none");
    let (_, slots) = http_get(port, "/slots").unwrap();
    let slots: serde_json::Value = serde_json::from_str(&slots).unwrap();
    assert_eq!(slots.as_array().map(Vec::len), Some(3), "{slots}");
    assert!(slots.as_array().unwrap().iter().all(|s| s["speculative"] == false), "{slots}");
    assert_eq!(http_get(port, "/metrics").unwrap().0, 501);
}

#[test]
fn vllm_port_closed_while_loading_then_models() {
    let port = free_port();
    let _p = standin(
        &["vllm", "serve", "/models/q", "--port", &port.to_string(), "--served-model-name", "q"],
        &[("SPECD_STANDIN_LOAD_MS", "300")],
    );
    let (c, _) = wait_for("the port", Duration::from_secs(5), || http_get(port, "/health")).unwrap();
    assert_eq!(c, 200);
    let (_, m) = http_get(port, "/v1/models").unwrap();
    assert!(m.contains("\"id\":\"q\""), "{m}");
    let (_, metrics) = http_get(port, "/metrics").unwrap();
    assert!(metrics.contains("vllm:num_requests_running"), "{metrics}");
}

/// A real vLLM 0.32 on SIGTERM stops its engine at once (`--shutdown-timeout` 0): a request in
/// flight never gets an answer, and the process waits for its connection to close
/// (`vllm/real/stop-plain.log`).
#[test]
fn vllm_sigterm_abandons_requests_in_flight_and_waits_for_their_clients() {
    use std::io::{Read, Write};
    let port = free_port();
    let mut p = standin(
        &["vllm", "serve", "/m", "--port", &port.to_string()],
        &[("SPECD_STANDIN_LOAD_MS", "0"), ("SPECD_STANDIN_TOKENS_PER_SEC", "50")],
    );
    wait_until("ready", Duration::from_secs(10), || http_get(port, "/health").is_some_and(|(c, _)| c == 200)).unwrap();
    let mut client = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let body = r#"{"prompt":"a","max_tokens":1000}"#;
    let req = format!("POST /v1/completions HTTP/1.0\r\nContent-Length: {}\r\n\r\n{body}", body.len());
    client.write_all(req.as_bytes()).unwrap();
    wait_until("the request running", Duration::from_secs(10), || {
        http_get(port, "/metrics")
            .is_some_and(|(_, m)| m.lines().any(|l| l.starts_with("vllm:num_requests_running{") && l.ends_with(" 1.0")))
    })
    .unwrap();
    sigterm(&p);
    // No answer comes, and the server is still there while the client waits.
    client.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut got = Vec::new();
    let e = client.read_to_end(&mut got).expect_err("the read times out");
    assert!(matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut), "{e}");
    assert!(got.is_empty(), "{}", String::from_utf8_lossy(&got));
    assert!(p.0.try_wait().unwrap().is_none(), "the server waits for the open connection");
    drop(client);
    assert_eq!(wait_exit(&mut p, Duration::from_secs(10)).code(), Some(0));
    let log = stderr_of(&mut p);
    assert!(log.contains("stopping engine client mode=abort timeout=0s"), "{log}");
    assert!(log.contains("INFO:     Waiting for connections to close. (CTRL+C to force quit)"), "{log}");
}

/// With `--shutdown-timeout N` vLLM drains: a request in flight finishes, then the server exits.
#[test]
fn vllm_shutdown_timeout_lets_requests_finish() {
    let port = free_port();
    let mut p = standin(
        &["vllm", "serve", "/m", "--port", &port.to_string(), "--shutdown-timeout", "30"],
        &[("SPECD_STANDIN_LOAD_MS", "0"), ("SPECD_STANDIN_TOKENS_PER_SEC", "50")],
    );
    wait_until("ready", Duration::from_secs(10), || http_get(port, "/health").is_some_and(|(c, _)| c == 200)).unwrap();
    let client = std::thread::spawn(move || {
        http(port, "POST", "/v1/completions", Some(r#"{"prompt":"a","max_tokens":50}"#), Duration::from_secs(30))
    });
    wait_until("the request running", Duration::from_secs(10), || {
        http_get(port, "/metrics")
            .is_some_and(|(_, m)| m.lines().any(|l| l.starts_with("vllm:num_requests_running{") && l.ends_with(" 1.0")))
    })
    .unwrap();
    sigterm(&p);
    let (code, body) = client.join().unwrap().expect("an answer");
    assert_eq!(code, 200, "{body}");
    assert_eq!(wait_exit(&mut p, Duration::from_secs(10)).code(), Some(0));
    assert!(stderr_of(&mut p).contains("stopping engine client mode=drain timeout=30s"));
}
