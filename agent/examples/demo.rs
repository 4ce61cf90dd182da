//! The demo: a private systemd, the stand-in server, a spec applied, a config change applied
//! (with requests in flight), status and history. Run with `scripts/demo` (as root).

use std::time::{Duration, Instant};

use specd_e2e::{SystemdBox, bin_path, free_port, http, http_get, wait_until};

fn say(s: &str) {
    println!("\n\x1b[1m== {s}\x1b[0m");
}

fn get(port: u16, path: &str) -> Option<String> {
    http_get(port, path).map(|(_, body)| body)
}

fn main() -> anyhow::Result<()> {
    let specd = bin_path("specd").display().to_string();
    let standin = bin_path("specd-standin").display().to_string();
    let t0 = Instant::now();
    let b = SystemdBox::boot()?;
    say(&format!("a private systemd is running as PID 1 of new namespaces (booted in {:?})", t0.elapsed()));
    let port = free_port();
    let spec = |steps: u32| {
        format!(
            "apiVersion: specd/v1
kind: InferenceService
metadata: {{name: qwen35-122b-mtp}}
spec:
  unit: sglang-qwen.service
  engine: sglang
  command: [{standin}, sglang]   # the stand-in speaks SGLang's flags and HTTP API
  model: {model}
  server: {{host: 127.0.0.1, port: {port}, tp_size: 4, mem_fraction_static: 0.85, max_running_requests: 16, context_length: 32768, extra_args: [--enable-metrics]}}
  speculative: {{algorithm: NEXTN, num_steps: {steps}, eagle_topk: 1, num_draft_tokens: {}}}
  service:
    restart: always
    timeout_stop_sec: 3
    drain_timeout_sec: 2
    environment: {{SPECD_STANDIN_LOAD_MS: \"1500\", SPECD_STANDIN_TOKENS_PER_SEC: \"50\"}}
",
            steps + 1,
            model = specd_e2e::STANDIN_MODEL,
        )
    };
    let run = |args: &[&str]| -> anyhow::Result<i32> {
        println!("$ specd {}", args.join(" "));
        let mut argv = vec![specd.as_str()];
        argv.extend_from_slice(args);
        Ok(b.command(&argv).status()?.code().unwrap_or(-1))
    };
    b.write_file("/run/specs/qwen.yaml", spec(5))?;
    say("the seed's config, steps=5: validate, then apply");
    run(&["validate", "/run/specs/qwen.yaml"])?;
    run(&["apply", "-f", "/run/specs/qwen.yaml"])?;
    println!("server reports speculative_num_steps = {}", steps(port));

    say("4 long requests in flight (each streams for ~8 s)");
    for _ in 0..4 {
        std::thread::spawn(move || {
            let body = r#"{"text":"hello","sampling_params":{"max_new_tokens":400},"stream":true}"#;
            let _ = http(port, "POST", "/generate", Some(body), Duration::from_secs(60));
        });
    }
    wait_until("requests in flight", Duration::from_secs(10), || {
        // The gauge may also count the readiness probe's one-token generation.
        get(port, "/metrics").is_some_and(|m| {
            m.lines().any(|l| {
                l.starts_with("sglang:num_running_reqs")
                    && l.split_whitespace().last().and_then(|v| v.parse::<f64>().ok()).is_some_and(|n| n >= 4.0)
            })
        })
    })?;

    say("commit steps=10: the diff, then the apply (drain, stop, empty cgroup, write, reload, start, verify)");
    b.write_file("/run/specs/qwen.yaml", spec(10))?;
    run(&["diff", "-f", "/run/specs/qwen.yaml"])?;
    run(&["apply", "-f", "/run/specs/qwen.yaml"])?;
    println!("server reports speculative_num_steps = {}", steps(port));

    say("status and history");
    run(&["status"])?;
    run(&["history"])?;
    say("diagnose: how did the previous instance end?");
    run(&["diagnose", "sglang-qwen.service"])?;

    let t1 = Instant::now();
    b.shutdown()?;
    say(&format!("the private systemd is gone (torn down in {:?}); nothing on this host was touched", t1.elapsed()));
    Ok(())
}

fn steps(port: u16) -> String {
    get(port, "/get_server_info")
        .and_then(|b| serde_json::from_str::<serde_json::Value>(&b).ok())
        .map_or("?".into(), |v| v["speculative_num_steps"].to_string())
}
