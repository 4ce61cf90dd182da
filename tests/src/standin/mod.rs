//! `specd-standin`: behaves like SGLang, vLLM or llama.cpp as far as specd
//! can see (flags, rewrites, HTTP endpoints, logs, shutdown), without a GPU.
//!
//! ```text
//! specd-standin sglang --model-path M [--host H] [--port P] [--tp-size N] ...
//! specd-standin vllm [serve] MODEL [--port P] [--speculative-config JSON] ...   (vLLM 0.32)
//! specd-standin llama-cpp -m M [--port P] [-c N] [-np N] [-ngl N] [--spec-draft-model D] ...
//! ```
//!
//! The load (`startup.rs`) says the lines each engine says while it starts, in the real order,
//! `LOAD_MS` spread over its phases (weights, engine set-up or warm-up, API server).
//!
//! Knobs: `SPECD_STANDIN_*` env vars or `--standin-*` flags (flags win):
//! `LOAD_MS`/`--standin-load-ms` (300), `WARMUP_MS` (200, SGLang),
//! `TOKENS_PER_SEC` (200 per request), `EXIT_CODE`, `CUDA_OOM=1`,
//! `MEMORY_HOG=1`, `LINGER_CHILD=1`, `ACCEPT_LENGTH`, `DRAIN_POLL_MS` (5000,
//! SGLang's shutdown watchdog period), `TEARDOWN_MS` (2500, vLLM's engine teardown after a
//! `--shutdown-timeout` drain), `CRASH_AFTER_READY=/path` (an instance
//! started while the file exists removes it and dies of SIGKILL at the first
//! request after its first readiness 200).
//!
//! Performance model (`perf.rs`): `BASE_TOKENS_PER_SEC` (off by default: then each token takes
//! 1 / `TOKENS_PER_SEC` as before) paces requests in verify steps: one request decodes at
//! base × E(k) / (1 + `DRAFT_COST`·k) / (1 + `BATCH_SLOWDOWN`·(running − 1)) tokens/s, with
//! E(k) = 1 + q_1 + … + q_k the accept length of a k-token draft, q_i the share of drafts
//! accepted through position i: the product of the `ACCEPT_CURVE` (conditional rates per
//! position, `0.9,0.8,0.6`) or `ACCEPT_RATE` p at every position (0.85, 0.07, 0.05 by default);
//! a step's tokens are sent together (a burst), and the first waits for the prefill (prompt
//! words / `PREFILL_TOKENS_PER_SEC`, 8000). The evidence (SGLang `spec_verify_ct`, accept
//! lengths and its verify and token counters, vLLM `spec_decode` counters by position and its
//! inter-token latency, llama.cpp `timings.draft_n`/`draft_n_accepted` and, with `--metrics`,
//! its counters by position and decode time) counts the steps and tokens really delivered.
//! `MAX_DRAFT_TOKENS=N`: a configured draft larger than N (SGLang `num_draft_tokens`, vLLM
//! `num_speculative_tokens`, llama.cpp `--spec-draft-n-max`) dies of CUDA OOM while loading.
//!
//! Endpoints: SGLang `/health`, `/health_generate`, `/get_server_info`,
//! `/server_info`, `/get_model_info`, `/generate`, `/metrics` (only with
//! `--enable-metrics`), `/v1/models`, `/v1/completions`; vLLM `/health`, `/v1/models`,
//! `/metrics`, `/v1/completions`, `/version` (and its stats lines every `VLLM_LOG_STATS_INTERVAL`
//! seconds, 10); llama.cpp `/health`, `/props`,
//! `/slots`, `/metrics` (only with `--metrics`), `/v1/models`, `/completion`,
//! `/v1/completions`. What they report is checked against replies recorded
//! from the real engines (`tests/tests/standin_fixtures.rs`).
//!
//! SIGTERM, as each engine (`tests/tests/standin_sigterm.rs` checks it against the real
//! engines stopped under load): SGLang drains without a time limit (health 503, new requests
//! still taken, exit once none is left, polled every `DRAIN_POLL_MS`); vLLM 0.32 with
//! `--shutdown-timeout 0` (its default) stops its engine at once (requests in flight get
//! nothing more, connections are refused, exit when their clients have gone), with N > 0
//! drains up to N s (health 200, new requests HTTP 500) then tears down; llama-server stops
//! generating and listening at once and exits when the clients of its requests have gone.

pub mod args;
pub mod faults;
pub mod logs;
pub mod perf;
pub mod py;
pub mod server;
pub mod startup;
pub mod vllm;

use std::collections::BTreeMap;

/// Runs the stand-in with `argv` (without the program name); returns the
/// exit code.
pub fn run(argv: Vec<String>) -> i32 {
    logs::started();
    if argv.first().map(String::as_str) == Some("__linger") {
        faults::linger();
    }
    let env: BTreeMap<String, String> = std::env::vars().collect();
    let launch = match args::parse(&argv, &env) {
        Ok(l) => l,
        Err(r) => {
            eprint!("{}", r.stderr);
            if !r.stderr.ends_with('\n') {
                eprintln!();
            }
            return r.code;
        }
    };
    if let Some(code) = launch.knobs.exit_code {
        logs::loading(&launch);
        eprintln!("specd-standin: exiting with code {code} as asked (SPECD_STANDIN_EXIT_CODE)");
        return code;
    }
    let _child = if launch.knobs.linger_child {
        let exe = std::env::current_exe().expect("current_exe");
        match std::process::Command::new(exe).arg("__linger").spawn() {
            Ok(c) => Some(c),
            Err(e) => {
                eprintln!("specd-standin: spawn the lingering child: {e}");
                return 1;
            }
        }
    } else {
        None
    };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("tokio runtime");
    let code = rt.block_on(server::serve(launch));
    // Exit at once: in-flight work is done or deliberately abandoned.
    std::process::exit(code)
}
