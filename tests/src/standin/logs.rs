//! Log lines in each engine's own format (they end up in the journal, where
//! specd's diagnosis reads them).

use super::args::{Flavour, Launch};
use super::vllm;
use serde_json::Value;
use std::time::{SystemTime, UNIX_EPOCH};

/// UTC (year, month, day, hour, minute, second) of now.
fn now_parts() -> (i64, u32, u32, u32, u32, u32) {
    specd_spec::utc(SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0))
}

/// One log line on stderr in the engine's format.
pub fn line(f: Flavour, level: &str, msg: &str) {
    let (y, mo, d, h, mi, s) = now_parts();
    match f {
        // SGLang: "[%(asctime)s] %(message)s" (no level)
        Flavour::Sglang => eprintln!("[{y:04}-{mo:02}-{d:02} {h:02}:{mi:02}:{s:02}] {msg}"),
        // The stand-in's own load-time lines (the memory hog): the worker loads the weights.
        Flavour::Vllm => vllm_log("Worker", level, "default_loader.py:501", msg),
        Flavour::LlamaCpp => eprintln!("{msg}"),
    }
}

/// One vLLM log record as its `NewLineFormatter` writes it: every line of `msg` after
/// `(PROCESS pid=N) LEVEL MM-DD HH:MM:SS [file.py:line] `.
pub fn vllm_record(process: &str, level: &str, at: &str, msg: &str) -> String {
    let (_, mo, d, h, mi, s) = now_parts();
    let head = format!(
        "({process} pid={}) {} {mo:02}-{d:02} {h:02}:{mi:02}:{s:02} [{at}] ",
        std::process::id(),
        level.to_uppercase()
    );
    msg.split('\n').map(|l| format!("{head}{l}\n")).collect()
}

/// When the process started: llama.cpp stamps each line with the time since.
static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();

/// Marks the process's start (the first call; `run` makes it at once).
pub fn started() -> std::time::Instant {
    *START.get_or_init(std::time::Instant::now)
}

/// One llama.cpp log line at its default format (common/log.cpp): the time since the start as
/// `minutes.seconds.ms.us`, the level letter (`I`, `W`, `E`), the message.
pub fn llama(level: char, msg: &str) {
    let us = started().elapsed().as_micros();
    let (m, s, ms, u) = (us / 60_000_000, us / 1_000_000 % 60, us / 1000 % 1000, us % 1000);
    eprintln!("{m}.{s:02}.{ms:03}.{u:03} {level} {msg}");
}

/// [`vllm_record`] on stderr.
pub fn vllm_log(process: &str, level: &str, at: &str, msg: &str) {
    eprint!("{}", vllm_record(process, level, at, msg));
}

/// A line of uvicorn's own logger (vLLM's HTTP server).
pub fn uvicorn(msg: &str) {
    eprintln!("INFO:     {msg}");
}

fn py(v: &Value) -> String {
    match v {
        Value::Null => "None".into(),
        Value::Bool(true) => "True".into(),
        Value::Bool(false) => "False".into(),
        Value::String(s) => format!("'{s}'"),
        other => other.to_string(),
    }
}

/// What the engine prints before and while loading the model.
pub fn loading(l: &Launch) {
    match l.flavour {
        Flavour::Sglang => {
            let args: Vec<String> = l.args.iter().map(|(k, v)| format!("{k}={}", py(v))).collect();
            for w in &l.warnings {
                line(l.flavour, "warning", w);
            }
            line(l.flavour, "info", &format!("server_args=ServerArgs({})", args.join(", ")));
        }
        Flavour::Vllm => {
            let Some(v) = &l.vllm else { return };
            vllm_log("APIServer", "info", "api_utils.py:347", &vllm::logo(&v.model()));
            vllm_log("APIServer", "info", "api_utils.py:286", &vllm::non_default_args(v));
        }
        // b11434 at its default verbosity (llama-cpp/startup/); its model is loaded by
        // `startup::load`.
        Flavour::LlamaCpp => {
            llama('I', "srv  llama_server: initializing ...");
            llama('I', "cmn  common_param: common_params_print_info: verbosity = 3 (adjust with the `-lv N` CLI arg)");
            if l.args.get("api_key").is_none_or(Value::is_null) {
                llama(
                    'W',
                    "srv  llama_server: security: no API key is set and CORS allows all origins (see https://github.com/ggml-org/llama.cpp/pull/25655)",
                );
            }
        }
    }
}

/// What the engine prints when it is ready to serve.
pub fn ready(l: &Launch, addr: &str) {
    match l.flavour {
        Flavour::Sglang => line(l.flavour, "info", "The server is fired up and ready to roll!"),
        Flavour::Vllm => {
            vllm_log("APIServer", "info", "entry.py:136", "Supported tasks: ['generate']");
            vllm_log("APIServer", "info", "entry.py:140", &format!("Starting vLLM server on http://{addr}"));
            vllm_log("APIServer", "info", "launcher.py:186", "Available routes are:");
            // The routes the stand-in serves, in the real list's order.
            for (path, methods) in [
                ("/version", "GET"),
                ("/health", "GET"),
                ("/metrics", "GET"),
                ("/v1/models", "GET"),
                ("/v1/completions", "POST"),
            ] {
                vllm_log("APIServer", "info", "launcher.py:195", &format!("Route: {path}, Methods: {methods}"));
            }
            uvicorn(&format!("Started server process [{}]", std::process::id()));
            uvicorn("Waiting for application startup.");
            uvicorn("Application startup complete.");
        }
        Flavour::LlamaCpp => {
            llama('I', "srv  llama_server: model loaded");
            llama('I', &format!("srv  llama_server: listening on http://{addr}"));
        }
    }
}
