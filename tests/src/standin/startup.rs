//! The load, phase by phase, as each engine tells it in its own lines (the real starts recorded
//! in `tests/fixtures/engines/{vllm,llama-cpp}/startup/`, SGLang's lines from its source in
//! `sglang/startup_lines.txt`; `quick::standin_fixtures` checks them): the lines specd times a
//! start by, in the real order, with `load_ms` spread over the phases in the shares below. A
//! start that dies while loading dies in the phase the real engine would: of a CUDA OOM or the
//! memory hog while its weights load, of a draft too large for its memory while the engine sizes
//! its KV cache and captures its graphs.

use super::args::{Flavour, Launch};
use super::logs::{line, llama, vllm_log};
use serde_json::Value;
use std::time::Duration;

/// Shares of `load_ms`: the weights, then the engine's set-up (vLLM, SGLang) or warm-up
/// (llama.cpp), then (vLLM) its API server.
const VLLM_SHARES: [u64; 3] = [20, 60, 20];
const SGLANG_SHARES: [u64; 2] = [50, 50];
const LLAMA_SHARES: [u64; 2] = [70, 30];

/// How a load ends: loaded, or dead with this exit code.
pub type Loaded = Result<(), i32>;

async fn pause(l: &Launch, share: u64) {
    tokio::time::sleep(Duration::from_millis(l.knobs.load_ms * share / 100)).await;
}

/// The weights are loaded: a CUDA OOM or the memory hog strike here.
fn weights_loaded(l: &Launch) -> Loaded {
    if l.knobs.cuda_oom {
        return Err(super::faults::cuda_oom(l));
    }
    if l.knobs.memory_hog {
        super::faults::memory_hog(l);
    }
    Ok(())
}

/// The engine sized its memory: a draft too large for it dies here (`too_large`).
fn engine_set_up(l: &Launch, too_large: bool) -> Loaded {
    if too_large { Err(super::faults::cuda_oom(l)) } else { Ok(()) }
}

/// Loads as the engine does, until it is about to serve (its ready lines are `logs::ready`'s).
pub async fn load(l: &Launch, too_large: bool) -> Loaded {
    match l.flavour {
        Flavour::Vllm => vllm(l, too_large).await,
        Flavour::Sglang => sglang(l, too_large).await,
        Flavour::LlamaCpp => llama_cpp(l, too_large).await,
    }
}

/// vLLM 0.32 on a CUDA host: the worker loads the model (its loader's line, then the GPU
/// runner's), the engine core sizes the KV cache and says how long its set-up took, the API
/// server comes up (`logs::ready`).
async fn vllm(l: &Launch, too_large: bool) -> Loaded {
    let model = l.vllm.as_ref().map(|v| v.model()).unwrap_or_default();
    vllm_log("Worker", "info", "gpu_model_runner.py:5040", &format!("Starting to load model {model}..."));
    let started = std::time::Instant::now();
    pause(l, VLLM_SHARES[0]).await;
    weights_loaded(l)?;
    let took = started.elapsed().as_secs_f64();
    vllm_log("Worker", "info", "default_loader.py:501", &format!("Loading weights took {took:.2} seconds"));
    vllm_log(
        "Worker",
        "info",
        "gpu_model_runner.py:5150",
        &format!("Model loading took 0.25 GiB memory and {took:.6} seconds"),
    );
    let engine = std::time::Instant::now();
    pause(l, VLLM_SHARES[1]).await;
    engine_set_up(l, too_large)?;
    vllm_log(
        "EngineCore",
        "info",
        "kv_cache_utils.py:2327",
        "GPU KV cache size: 46,592 tokens, Maximum concurrency for 2,048 tokens per request: 22.75x",
    );
    let took = engine.elapsed().as_secs_f64();
    vllm_log(
        "EngineCore",
        "info",
        "core.py:402",
        &format!("init engine (profile, create kv cache, warmup model) took {took:.2} s"),
    );
    pause(l, VLLM_SHARES[2]).await;
    Ok(())
}

/// SGLang 0.5.23: the model runner loads its weights, makes its memory pool and captures its
/// decode graph; a draft model's runner does the same after it; the scheduler says its sizes.
async fn sglang(l: &Launch, too_large: bool) -> Loaded {
    // A speculating server's draft (a draft model, or the model's own MTP layers) has its own
    // model runner; each captures its verify graph.
    let speculates = l.args["speculative_algorithm"].as_str().is_some_and(|a| a != "NGRAM");
    let drafts = speculates;
    let graph = if speculates { "verify" } else { "decode" };
    for role in if drafts { ["target", "draft"].as_slice() } else { ["target"].as_slice() } {
        line(l.flavour, "info", "Load weight begin. avail mem=78.50 GB");
        let started = std::time::Instant::now();
        pause(l, SGLANG_SHARES[0] / if drafts { 2 } else { 1 }).await;
        weights_loaded(l)?;
        let took = started.elapsed().as_secs_f64();
        line(
            l.flavour,
            "info",
            &format!(
                "Load weight end. elapsed={took:.2} s, type=LlamaForCausalLM, avail mem=62.31 GB, mem usage=16.19 GB."
            ),
        );
        line(l.flavour, "info", "Memory pool end. avail mem=12.04 GB");
        line(
            l.flavour,
            "info",
            &format!(
                "Capture {role} {graph} CUDA graph begin. backend=flashinfer, num_tokens_per_req=1, avail mem=12.04 GB"
            ),
        );
        let capture = std::time::Instant::now();
        pause(l, SGLANG_SHARES[1] / if drafts { 2 } else { 1 }).await;
        engine_set_up(l, too_large)?;
        line(
            l.flavour,
            "info",
            &format!(
                "Capture {role} {graph} CUDA graph end. bs=[1, 2, 4, 8], elapsed={:.2} s, mem usage=0.42 GB, avail mem=11.62 GB.",
                capture.elapsed().as_secs_f64()
            ),
        );
    }
    let n = |k: &str| l.args[k].as_i64().map_or("None".into(), |v| v.to_string());
    line(
        l.flavour,
        "info",
        &format!(
            "max_total_num_tokens=1048576, chunked_prefill_size=8192, max_prefill_tokens=16384, max_running_requests={}, context_len={}, available_gpu_mem=11.62 GB",
            n("max_running_requests"),
            n("context_length")
        ),
    );
    Ok(())
}

/// llama-server b11434 at its default verbosity: the model and its context, the context's
/// threads and the warm-up, a draft model after it, the slots.
async fn llama_cpp(l: &Launch, too_large: bool) -> Loaded {
    let a = &l.args;
    let s = |k: &str| a.get(k).and_then(Value::as_str).unwrap_or_default().to_string();
    let n = |k: &str, d: i64| a.get(k).and_then(Value::as_i64).filter(|n| *n > 0).unwrap_or(d);
    llama('I', &format!("srv    load_model: loading model '{}'", s("model_path")));
    pause(l, LLAMA_SHARES[0]).await;
    weights_loaded(l)?;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get() as i64);
    llama('I', &format!("cmn          init: llama threadpool init, n_threads = {}", n("n_threads", threads)));
    let draft = s("spec_draft_model");
    if draft.is_empty() {
        pause(l, LLAMA_SHARES[1]).await;
    } else {
        pause(l, LLAMA_SHARES[1] / 3).await;
        llama('I', &format!("common_speculative_init_result: loading draft model '{draft}'"));
        pause(l, LLAMA_SHARES[1] * 2 / 3).await;
    }
    engine_set_up(l, too_large)?;
    let slots = n("n_parallel", 4);
    llama(
        'I',
        &format!(
            "srv    load_model: initializing, n_slots = {slots}, n_ctx_slot = {}, kv_unified = 'false'",
            n("n_ctx", 4096) / slots
        ),
    );
    Ok(())
}
