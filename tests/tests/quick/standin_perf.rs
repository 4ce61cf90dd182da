//! The stand-in's performance model as a client sees it: the decode rate follows the speculative
//! settings, tokens arrive in bursts of accepted tokens, the first one waits for the prefill,
//! concurrency slows each request, the evidence counts what was delivered, and a draft larger
//! than the memory limit dies of CUDA OOM while loading.

use serde_json::Value;
use specd_e2e::{Reaped, bin_path, free_port, http, wait_for, wait_until};
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn spawn(args: &[&str], port: u16, env: &[(&str, &str)]) -> Reaped {
    let mut c = Command::new(bin_path("specd-standin"));
    c.args(args).args(["--port", &port.to_string()]).stdout(Stdio::null()).stderr(Stdio::piped());
    c.env("SPECD_STANDIN_LOAD_MS", "0").env("SPECD_STANDIN_WARMUP_MS", "0");
    for (k, v) in env {
        c.env(k, v);
    }
    Reaped(c.spawn().expect("spawn specd-standin"))
}

/// A stand-in that answers `/health` 200.
fn ready(args: &[&str], env: &[(&str, &str)]) -> (Reaped, u16) {
    let port = free_port();
    let p = spawn(args, port, env);
    wait_until("the stand-in to be ready", Duration::from_secs(20), || {
        http(port, "GET", "/health", None, Duration::from_secs(5)).is_some_and(|(c, _)| c == 200)
    })
    .unwrap();
    (p, port)
}

fn sglang(steps: u32) -> Vec<String> {
    let s = steps.to_string();
    let d = (steps + 1).to_string();
    ["sglang", "--model-path", "/m", "--enable-metrics", "--max-running-requests", "8"]
        .into_iter()
        .map(String::from)
        .chain(
            [
                "--speculative-algorithm",
                "NEXTN",
                "--speculative-num-steps",
                &s,
                "--speculative-eagle-topk",
                "1",
                "--speculative-num-draft-tokens",
                &d,
            ]
            .map(String::from),
        )
        .collect()
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// `POST path` with `body`; the `data:` payloads of the SSE reply, each with the time it arrived
/// after the request was sent.
fn stream(port: u16, path: &str, body: &str) -> Vec<(Duration, String)> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s.set_nodelay(true).unwrap();
    let req = format!(
        "POST {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let sent = Instant::now();
    s.write_all(req.as_bytes()).unwrap();
    let mut r = BufReader::new(s);
    let mut out = Vec::new();
    let mut line = String::new();
    loop {
        line.clear();
        if r.read_line(&mut line).unwrap() == 0 {
            break;
        }
        if let Some(d) = line.trim_end().strip_prefix("data: ") {
            out.push((sent.elapsed(), d.to_string()));
        }
    }
    out
}

fn generate(port: u16, prompt: &str, max: u64) -> Vec<(Duration, String)> {
    let body = serde_json::json!({"text": prompt, "sampling_params": {"max_new_tokens": max}, "stream": true});
    let chunks = stream(port, "/generate", &body.to_string());
    assert_eq!(chunks.last().map(|c| c.1.as_str()), Some("[DONE]"), "{chunks:?}");
    chunks[..chunks.len() - 1].to_vec()
}

/// The model, written out: tokens per verify step and the decode rate of one request.
fn accept_length(p: f64, k: u32) -> f64 {
    (0..=k).map(|i| p.powi(i as i32)).sum()
}

fn model_rate(base: f64, p: f64, cost: f64, k: u32) -> f64 {
    base * accept_length(p, k) / (1.0 + cost * f64::from(k))
}

/// Tokens per second of one streamed request: tokens over the time to the last one.
fn measured_rate(chunks: &[(Duration, String)]) -> f64 {
    chunks.len() as f64 / chunks.last().unwrap().0.as_secs_f64()
}

#[test]
fn the_rate_a_client_measures_follows_the_speculative_steps_as_the_model_says() {
    let env = [("SPECD_STANDIN_BASE_TOKENS_PER_SEC", "50")];
    let mut rates = Vec::new();
    for steps in [1, 4] {
        let (_p, port) = ready(&strs(&sglang(steps)), &env);
        let r = measured_rate(&generate(port, "hi", 120));
        let want = model_rate(50.0, 0.85, 0.07, steps);
        eprintln!("steps {steps}: measured {r:.1} tokens/s, the model says {want:.1}");
        assert!((r / want - 1.0).abs() < 0.12, "steps {steps}: measured {r:.1} tokens/s, the model says {want:.1}");
        rates.push(r);
    }
    let want = model_rate(50.0, 0.85, 0.07, 4) / model_rate(50.0, 0.85, 0.07, 1);
    let got = rates[1] / rates[0];
    assert!((got / want - 1.0).abs() < 0.12, "steps 4 over steps 1: {got:.2}, the model says {want:.2}");
}

#[test]
fn tokens_arrive_in_bursts_and_the_evidence_counts_the_delivered_tokens() {
    // One verify step: (1 + 0.07 * 4) / 40 = 32 ms; 3 or 4 tokens each (accept length 3.71).
    let (_p, port) = ready(&strs(&sglang(4)), &[("SPECD_STANDIN_BASE_TOKENS_PER_SEC", "40")]);
    let chunks = generate(port, "hi", 60);
    assert_eq!(chunks.len(), 60);
    let last: Value = serde_json::from_str(&chunks[59].1).unwrap();
    let verify_ct = last["meta_info"]["spec_verify_ct"].as_u64().unwrap();
    assert_eq!(last["meta_info"]["completion_tokens"], 60);
    let per_step = 60.0 / verify_ct as f64;
    assert!((per_step - accept_length(0.85, 4)).abs() < 0.35, "{per_step} tokens per verify step");
    assert_eq!(last["meta_info"]["spec_accept_length"].as_f64(), Some(per_step));
    // Arrivals more than half a step apart start a new burst: one burst per verify step (a late
    // read may merge two; none is split).
    let mut bursts = vec![1u64];
    for w in chunks.windows(2) {
        if w[1].0 - w[0].0 > Duration::from_millis(16) {
            bursts.push(1);
        } else {
            *bursts.last_mut().unwrap() += 1;
        }
    }
    assert!(bursts.len() as u64 <= verify_ct && bursts.len() as u64 >= verify_ct * 8 / 10, "{bursts:?} vs {verify_ct}");
    let mut sizes = bursts.clone();
    sizes.sort();
    assert!((3..=4).contains(&sizes[sizes.len() / 2]), "burst sizes {bursts:?}");
    // The server's own running average is the same evidence.
    let info: Value =
        serde_json::from_str(&http(port, "GET", "/get_server_info", None, Duration::from_secs(5)).unwrap().1).unwrap();
    assert_eq!(info["internal_states"][0]["avg_spec_accept_length"].as_f64(), Some(per_step));
    let metrics = http(port, "GET", "/metrics", None, Duration::from_secs(5)).unwrap().1;
    let gauge = metrics.lines().find(|l| l.starts_with("sglang:spec_accept_length{")).unwrap();
    let v: f64 = gauge.rsplit(' ').next().unwrap().parse().unwrap();
    assert!((v - per_step).abs() < 1e-9, "{gauge}");
}

#[test]
fn vllm_and_llama_cpp_counters_add_up_to_the_tokens_delivered() {
    let (_p, port) = ready(
        &["vllm", "serve", "/m", "--speculative-config", r#"{"method":"mtp","num_speculative_tokens":3}"#],
        &[("SPECD_STANDIN_TOKENS_PER_SEC", "2000")],
    );
    let body = r#"{"prompt":"hi","max_tokens":50}"#;
    assert_eq!(http(port, "POST", "/v1/completions", Some(body), Duration::from_secs(20)).unwrap().0, 200);
    let metrics = http(port, "GET", "/metrics", None, Duration::from_secs(5)).unwrap().1;
    let counter = |name: &str| -> f64 {
        let l = metrics.lines().find(|l| l.starts_with(&format!("{name}_total{{"))).unwrap_or_else(|| panic!("{name}"));
        l.rsplit(' ').next().unwrap().parse().unwrap()
    };
    let drafts = counter("vllm:spec_decode_num_drafts");
    let drafted = counter("vllm:spec_decode_num_draft_tokens");
    let accepted = counter("vllm:spec_decode_num_accepted_tokens");
    // vLLM's first token is the prefill's; each verify step then yields its accepted tokens
    // and one more.
    assert_eq!(1.0 + drafts + accepted, 50.0);
    assert_eq!(drafted, drafts * 3.0);
    let length = 1.0 + accepted / drafts;
    assert!((length - accept_length(0.85, 3)).abs() < 0.35, "accept length {length}");

    let (_p, port) = ready(
        &[
            "llama-cpp",
            "-m",
            "/m.gguf",
            "--spec-draft-model",
            "/d.gguf",
            "--spec-type",
            "draft-simple",
            "--spec-draft-n-max",
            "6",
        ],
        &[("SPECD_STANDIN_TOKENS_PER_SEC", "2000")],
    );
    let (c, b) =
        http(port, "POST", "/completion", Some(r#"{"prompt":"hi","n_predict":50}"#), Duration::from_secs(20)).unwrap();
    assert_eq!(c, 200, "{b}");
    let t: Value = serde_json::from_str::<Value>(&b).unwrap()["timings"].clone();
    let (drafted, accepted) = (t["draft_n"].as_u64().unwrap(), t["draft_n_accepted"].as_u64().unwrap());
    let steps = drafted / 6;
    assert_eq!(drafted % 6, 0, "{t}");
    assert_eq!(accepted + steps, 50, "{t}");
    assert!(accepted <= drafted);
    assert!(((50.0 / steps as f64) - accept_length(0.85, 6)).abs() < 0.5, "{t}");
}

#[test]
fn the_first_token_waits_for_the_prefill_of_the_prompt() {
    let env = [("SPECD_STANDIN_BASE_TOKENS_PER_SEC", "100"), ("SPECD_STANDIN_PREFILL_TOKENS_PER_SEC", "2000")];
    let (_p, port) = ready(&strs(&sglang(2)), &env);
    let long = vec!["word"; 1000].join(" ");
    let ttft_long = generate(port, &long, 4)[0].0;
    let ttft_short = generate(port, "hi", 4)[0].0;
    // 1000 prompt tokens at 2000 tokens/s: 500 ms before the first step.
    assert!(ttft_long >= Duration::from_millis(500), "{ttft_long:?}");
    assert!(ttft_long - ttft_short >= Duration::from_millis(450), "long {ttft_long:?}, short {ttft_short:?}");
}

#[test]
fn concurrent_requests_slow_each_other_by_the_batch_factor() {
    let env = [("SPECD_STANDIN_BASE_TOKENS_PER_SEC", "50"), ("SPECD_STANDIN_BATCH_SLOWDOWN", "0.5")];
    let (_p, port) = ready(&strs(&sglang(2)), &env);
    let alone = measured_rate(&generate(port, "hi", 40));
    let together: Vec<f64> = (0..4)
        .map(|_| std::thread::spawn(move || measured_rate(&generate(port, "hi", 40))))
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().unwrap())
        .collect();
    let mut sorted = together.clone();
    sorted.sort_by(f64::total_cmp);
    let median = (sorted[1] + sorted[2]) / 2.0;
    // Four in the batch: each step takes 1 + 0.5 * 3 = 2.5 times as long.
    let slowdown = alone / median;
    assert!((slowdown / 2.5 - 1.0).abs() < 0.2, "alone {alone:.1} tokens/s, together {together:?}: {slowdown:.2}");
}

#[test]
fn a_draft_above_the_memory_limit_dies_of_cuda_oom_while_loading() {
    let env = [("SPECD_STANDIN_MAX_DRAFT_TOKENS", "4")];
    // steps 4 with topk 1: 5 draft tokens, one more than fits.
    let port = free_port();
    let mut p = spawn(&strs(&sglang(4)), port, &env);
    let status = wait_for("the stand-in to die", Duration::from_secs(20), || p.0.try_wait().unwrap()).unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc::SIGKILL), "SGLang kills its own process tree");
    let mut err = String::new();
    std::io::Read::read_to_string(p.0.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert!(err.contains("Scheduler hit an exception: Traceback (most recent call last):"), "{err}");
    assert!(err.contains("torch.OutOfMemoryError: CUDA out of memory."), "{err}");
    // Steps 3 (4 draft tokens) fit, and serve.
    let (_p, port) = ready(&strs(&sglang(3)), &env);
    assert_eq!(generate(port, "hi", 3).len(), 3);
}

/// The samples of one metric in a `/metrics` body, `(labels, value)`.
fn samples(metrics: &str, name: &str) -> Vec<(String, f64)> {
    metrics
        .lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .map(|l| {
            let labels = l.split_once('{').map_or("", |(_, r)| r.split_once('}').unwrap().0).to_string();
            (labels, l.rsplit(' ').next().unwrap().parse().unwrap())
        })
        .collect()
}

fn one(metrics: &str, name: &str) -> f64 {
    samples(metrics, name).iter().map(|s| s.1).sum()
}

/// `n` requests of `max` tokens, one after the other, to whichever API the personality speaks.
fn load(port: u16, path: &str, n: usize, max: u64) {
    for _ in 0..n {
        let body = match path {
            "/generate" => format!(r#"{{"text":"hi","sampling_params":{{"max_new_tokens":{max}}}}}"#),
            _ => format!(r#"{{"prompt":"hi","max_tokens":{max},"n_predict":{max}}}"#),
        };
        let (c, b) = http(port, "POST", path, Some(&body), Duration::from_secs(30)).unwrap();
        assert_eq!(c, 200, "{b}");
    }
}

/// Each personality draws its acceptance by position from one curve, and shows what its engine
/// shows: vLLM and llama-server count drafts accepted through each position, SGLang only its
/// tokens per verify pass. The relation `specd tune` predicts by holds: the counts by position
/// at k = 5 give the accept length of a server at k = 2 and 3.
#[test]
fn acceptance_by_position_follows_the_curve_and_predicts_the_accept_length_of_shorter_drafts() {
    const CURVE: [f64; 5] = [0.9, 0.8, 0.7, 0.6, 0.5];
    // The timed model, fast: a step takes a third of a millisecond.
    let env = [("SPECD_STANDIN_ACCEPT_CURVE", "0.9,0.8,0.7,0.6,0.5"), ("SPECD_STANDIN_BASE_TOKENS_PER_SEC", "4000")];
    let through: Vec<f64> = CURVE
        .iter()
        .scan(1.0, |q, p| {
            Some({
                *q *= p;
                *q
            })
        })
        .collect();
    let expected = |k: usize| 1.0 + through[..k].iter().sum::<f64>();
    let vllm = |k: u32| -> Vec<String> {
        let c = format!(r#"{{"method":"ngram","num_speculative_tokens":{k},"prompt_lookup_max":3}}"#);
        ["vllm", "serve", "/m", "--speculative-config", &c].map(String::from).to_vec()
    };
    let llama = |k: u32| -> Vec<String> {
        let k = k.to_string();
        [
            "llama-cpp",
            "-m",
            "/m.gguf",
            "--spec-draft-model",
            "/d.gguf",
            "--spec-type",
            "draft-simple",
            "--metrics",
            "--spec-draft-n-max",
            &k,
        ]
        .map(String::from)
        .to_vec()
    };
    for (name, argv, path, drafts, per_pos) in [
        (
            "vllm",
            &vllm as &dyn Fn(u32) -> Vec<String>,
            "/v1/completions",
            "vllm:spec_decode_num_drafts_total",
            "vllm:spec_decode_num_accepted_tokens_per_pos_total",
        ),
        (
            "llama-cpp",
            &llama,
            "/completion",
            "llamacpp:spec_decode_num_drafts_total",
            "llamacpp:spec_decode_num_accepted_tokens_per_pos_total",
        ),
    ] {
        let (_p, port) = ready(&strs(&argv(5)), &env);
        load(port, path, 20, 100);
        let m = http(port, "GET", "/metrics", None, Duration::from_secs(5)).unwrap().1;
        let n = one(&m, drafts);
        let counts: Vec<f64> = samples(&m, per_pos).iter().map(|s| s.1).collect();
        assert_eq!(counts.len(), 5, "{name}: {m}");
        assert!(counts.windows(2).all(|w| w[0] >= w[1]), "{name}: {counts:?}");
        for (i, q) in through.iter().enumerate() {
            assert!((counts[i] / n - q).abs() < 0.02, "{name} position {i}: {} against {q}", counts[i] / n);
        }
        for k in [2usize, 3] {
            let predicted = 1.0 + counts[..k].iter().sum::<f64>() / n;
            let (_q, port) = ready(&strs(&argv(k as u32)), &env);
            load(port, path, 20, 100);
            let m = http(port, "GET", "/metrics", None, Duration::from_secs(5)).unwrap().1;
            let accepted = one(&m, per_pos.replace("_per_pos", "").as_str());
            let measured = 1.0 + accepted / one(&m, drafts);
            assert!(
                (predicted / measured - 1.0).abs() < 0.03,
                "{name} k={k}: predicted {predicted:.3}, measured {measured:.3}"
            );
            assert!(
                (measured - expected(k)).abs() < 0.05,
                "{name} k={k}: {measured:.3} against the curve's {:.3}",
                expected(k)
            );
        }
    }
    // SGLang: tokens per verify pass, in the replies and the counters, as the curve says.
    for steps in [2u32, 3, 5] {
        let argv: Vec<String> = sglang(steps);
        let (_p, port) = ready(&strs(&argv), &env);
        // Long requests: each one's last step, cut short by its end, weighs little.
        load(port, "/generate", 10, 800);
        let m = http(port, "GET", "/metrics", None, Duration::from_secs(5)).unwrap().1;
        let length = one(&m, "sglang:generation_tokens_total") / one(&m, "sglang:spec_verify_calls_total");
        let want = expected(steps as usize);
        assert!((length - want).abs() < 0.05, "sglang steps {steps}: {length:.3} against the curve's {want:.3}");
    }
}
