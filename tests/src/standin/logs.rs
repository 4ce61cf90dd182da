//! Log lines in each engine's own format (they end up in the journal, where
//! specd's diagnosis reads them).

use super::args::{Flavour, Launch};
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
        Flavour::Vllm => eprintln!(
            "(APIServer pid={}) {} {mo:02}-{d:02} {h:02}:{mi:02}:{s:02} [api_server.py:1915] {msg}",
            std::process::id(),
            level.to_uppercase()
        ),
        Flavour::LlamaCpp => eprintln!("{msg}"),
    }
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
            line(l.flavour, "info", "Load weight begin. avail mem=78.50 GB");
        }
        Flavour::Vllm => {
            line(l.flavour, "info", "vLLM API server version 0.34.0");
            let args: Vec<String> =
                l.args.iter().filter(|(_, v)| !v.is_null()).map(|(k, v)| format!("'{k}': {}", py(v))).collect();
            line(l.flavour, "info", &format!("non-default args: {{{}}}", args.join(", ")));
        }
        Flavour::LlamaCpp => {
            line(l.flavour, "info", "build: 6700 (standin) with cc (Debian 12.2.0-14) 12.2.0 for x86_64-linux-gnu");
            line(
                l.flavour,
                "info",
                &format!("main: HTTP server is listening, hostname: {}, port: {}, http threads: 3", l.host, l.port),
            );
            line(l.flavour, "info", "main: loading model");
            line(
                l.flavour,
                "info",
                &format!("srv    load_model: loading model '{}'", l.args["model_path"].as_str().unwrap_or_default()),
            );
        }
    }
}

/// What the engine prints when it is ready to serve.
pub fn ready(l: &Launch, addr: &str) {
    match l.flavour {
        Flavour::Sglang => line(l.flavour, "info", "The server is fired up and ready to roll!"),
        Flavour::Vllm => {
            line(l.flavour, "info", &format!("Starting vLLM API server 0 on http://{addr}"));
            line(l.flavour, "info", "Application startup complete.");
        }
        Flavour::LlamaCpp => {
            line(l.flavour, "info", "main: model loaded");
            line(l.flavour, "info", &format!("main: server is listening on http://{addr} - starting the main loop"));
            line(l.flavour, "info", "srv  update_slots: all slots are idle");
        }
    }
}
