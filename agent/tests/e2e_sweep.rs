//! `specd sweep` end to end: its load generator against the stand-in process (as each engine)
//! and against the real llama-server.

mod common;

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use specd::{BUILTIN_PROMPTS, LevelResult, LoadApi, LoadLevel, run_load};
use specd_spec::Engine;

/// A server process of this test, killed at the end.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn standin(args: &[&str], env: &[(&str, &str)]) -> Proc {
    let mut c = Command::new(bin_path("specd-standin"));
    c.args(args).stdout(Stdio::null()).stderr(Stdio::null());
    for (k, v) in env {
        c.env(k, v);
    }
    Proc(c.spawn().unwrap())
}

fn ready(port: u16, path: &str, within: Duration) {
    wait_until("the server to answer ready", within, || http_get(port, path).is_some_and(|(c, _)| c == 200)).unwrap();
}

fn level(port: u16, engine: Engine, api: LoadApi, concurrency: u32, requests: u32, max_tokens: u32) -> LoadLevel {
    LoadLevel {
        base_url: format!("http://127.0.0.1:{port}"),
        engine,
        api,
        model: None,
        concurrency,
        requests,
        duration: None,
        warmup: 1,
        max_tokens,
        prompts: Arc::new(BUILTIN_PROMPTS.iter().map(|p| p.to_string()).collect()),
        timeout: Duration::from_secs(60),
    }
}

fn run(l: &LoadLevel) -> LevelResult {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(run_load(l))
}

/// The stand-in generates at a known rate per request (100 tok/s here): the load generator must
/// find that rate per request, about `concurrency` times it in aggregate, and SGLang's accept
/// length from its own counts.
#[test]
fn the_load_generator_measures_the_standin_as_sglang_over_both_apis() {
    let port = free_port();
    let ps = port.to_string();
    let _p = standin(
        &[
            "sglang",
            "--model-path",
            "/m",
            "--port",
            &ps,
            "--speculative-algorithm",
            "EAGLE",
            "--speculative-num-steps",
            "3",
            "--speculative-eagle-topk",
            "1",
            "--speculative-num-draft-tokens",
            "4",
        ],
        &[
            ("SPECD_STANDIN_LOAD_MS", "0"),
            ("SPECD_STANDIN_WARMUP_MS", "0"),
            ("SPECD_STANDIN_TOKENS_PER_SEC", "100"),
            ("SPECD_STANDIN_ACCEPT_LENGTH", "2.5"),
        ],
    );
    ready(port, "/health_generate", Duration::from_secs(10));
    let r = run(&level(port, Engine::Sglang, LoadApi::Generate, 4, 8, 16));
    assert_eq!((r.requests, r.errors), (8, 0), "{r:?}");
    assert_eq!(r.output_tokens, 8 * 16, "the server's own completion_tokens: {r:?}");
    let median = r.tok_s_median.unwrap();
    assert!((60.0..=110.0).contains(&median), "per request ~100 tok/s: {r:?}");
    assert!(r.tok_s_p10.unwrap() <= median);
    assert!(r.throughput > 2.0 * median && r.throughput <= 4.4 * median, "4 at once: {r:?}");
    assert!(r.ttft_ms_p50.unwrap() <= r.ttft_ms_p99.unwrap());
    assert!((7.0..=30.0).contains(&r.itl_ms_p50.unwrap()), "a token every 10 ms: {r:?}");
    // SGLang's accept length: completion tokens / verify passes, over the level.
    let al = r.accept_length.unwrap();
    assert!((2.2..=2.7).contains(&al), "{r:?}");
    assert!(r.evidence[0].contains("spec_verify_ct"), "{r:?}");

    let r = run(&level(port, Engine::Sglang, LoadApi::Completions, 2, 4, 8));
    assert_eq!((r.requests, r.errors, r.output_tokens), (4, 0, 32), "{r:?}");
}

/// A server that dies under load: the requests in flight fail with a cause, and the level says
/// so (the sweep records it; the diagnosis tells why it died).
#[test]
fn requests_to_a_server_that_dies_are_errors_with_a_cause() {
    let port = free_port();
    let ps = port.to_string();
    let mut p = standin(
        &["vllm", "serve", "/m", "--port", &ps],
        &[("SPECD_STANDIN_LOAD_MS", "0"), ("SPECD_STANDIN_TOKENS_PER_SEC", "20")],
    );
    ready(port, "/health", Duration::from_secs(10));
    let l = level(port, Engine::Vllm, LoadApi::Completions, 2, 2, 200);
    let load = std::thread::spawn(move || run(&l));
    wait_until("requests in flight", Duration::from_secs(10), || {
        http_get(port, "/metrics").is_some_and(|(_, m)| {
            m.lines().any(|x| x.starts_with("vllm:num_requests_running") && !x.ends_with(" 0.0") && !x.ends_with(" 0"))
        })
    })
    .unwrap();
    p.0.kill().unwrap();
    let r = load.join().unwrap();
    assert_eq!(r.errors, 2, "{r:?}");
    let e = r.first_error.unwrap();
    assert!(e.contains("stream") || e.contains("connect"), "{e}");
}

/// The real llama-server with the same GGUF as its draft: the accept rate is llama-server's own
/// `timings.draft_n_accepted / draft_n` over the level's requests.
#[test]
fn the_load_generator_reads_real_llama_server_accept_rates() {
    let l = real_llama();
    let port = free_port();
    let ps = port.to_string();
    let _p = Proc(
        Command::new(&l.server)
            .args(["-m", &l.gguf, "-md", &l.gguf, "--spec-type", "draft-simple", "--spec-draft-n-max", "4"])
            .args(["--host", "127.0.0.1", "--port", &ps, "-c", "1024", "--threads", "1", "-np", "1"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    ready(port, "/health", Duration::from_secs(120));
    let mut lv = level(port, Engine::LlamaCpp, LoadApi::Completions, 1, 2, 16);
    lv.prompts = Arc::new(vec![BUILTIN_PROMPTS[3].to_string()]);
    let r = run(&lv);
    assert_eq!((r.requests, r.errors), (2, 0), "{r:?}");
    assert_eq!(r.output_tokens, 32, "usage.completion_tokens: {r:?}");
    let rate = r.accept_rate.unwrap_or_else(|| panic!("no accept rate: {r:?}"));
    assert!(rate > 0.0 && rate <= 1.0, "{r:?}");
    assert!(r.evidence.iter().any(|e| e.starts_with("timings.draft_n=")), "{r:?}");
    assert!(r.tok_s_median.unwrap() > 0.0);
}
