//! What each engine's CLI looks like: defaults, the flags specd renders (with their aliases), flags
//! the engine no longer accepts, and the argv specd builds.
//!
//! Checked against SGLang 0.5.x `server_args`, vLLM 0.x `vllm serve --help` and llama.cpp's
//! `llama-server` (`common/arg.cpp`).

use crate::model::Engine;
use crate::resolve::{Server, Speculative};

pub(crate) fn default_command(engine: Engine) -> Vec<String> {
    let words: &[&str] = match engine {
        Engine::Sglang => &["python3", "-m", "sglang.launch_server"],
        Engine::Vllm => &["vllm", "serve"],
        Engine::LlamaCpp => &["llama-server"],
    };
    words.iter().map(|s| s.to_string()).collect()
}

pub(crate) fn default_port(engine: Engine) -> u16 {
    match engine {
        Engine::Sglang => 30000,
        Engine::Vllm => 8000,
        Engine::LlamaCpp => 8080,
    }
}

pub(crate) fn default_endpoint(engine: Engine) -> &'static str {
    match engine {
        // /health answers as soon as the HTTP server is up; /health_generate runs a real
        // one-token generation, so it proves the model is loaded and serving.
        Engine::Sglang => "/health_generate",
        Engine::Vllm | Engine::LlamaCpp => "/health",
    }
}

/// Flags that correspond to a spec field (with every alias the engine accepts for them). They
/// may not appear in `extra_args`: the spec field is the one place to set them.
pub(crate) fn owned_flags(engine: Engine) -> &'static [(&'static str, &'static str)] {
    match engine {
        Engine::Sglang => &[
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
        Engine::Vllm => &[
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
        Engine::LlamaCpp => &[
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
            ("--spec-draft-model", "speculative.draft_model"),
            ("--model-draft", "speculative.draft_model"),
            ("-md", "speculative.draft_model"),
            ("--spec-draft-n-max", "speculative.num_steps"),
            ("--spec-draft-n-min", "speculative.draft_min"),
            ("--spec-draft-p-min", "speculative.draft_p_min"),
            ("--draft-p-min", "speculative.draft_p_min"),
        ],
    }
}

/// A flag that Python's argparse (SGLang, vLLM) would expand to a flag specd owns: an
/// unambiguous prefix of it. `Some((owned flag, spec field))`.
pub(crate) fn abbreviates(engine: Engine, flag: &str) -> Option<(&'static str, &'static str)> {
    if engine == Engine::LlamaCpp || !flag.starts_with("--") || flag.len() < 3 {
        return None;
    }
    owned_flags(engine).iter().find(|(f, _)| f.starts_with("--") && f.starts_with(flag) && *f != flag).copied()
}

/// Flags the engine has removed: passing them fails startup.
pub(crate) fn removed_flags(engine: Engine) -> &'static [(&'static str, &'static str)] {
    match engine {
        Engine::LlamaCpp => &[
            ("--draft", "--spec-draft-n-max (speculative.num_steps)"),
            ("--draft-n", "--spec-draft-n-max (speculative.num_steps)"),
            ("--draft-max", "--spec-draft-n-max (speculative.num_steps)"),
            ("--draft-min", "--spec-draft-n-min (speculative.draft_min)"),
            ("--draft-n-min", "--spec-draft-n-min (speculative.draft_min)"),
        ],
        Engine::Sglang | Engine::Vllm => &[],
    }
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

/// The argv of `ExecStart=`.
pub(crate) fn build_argv(
    engine: Engine,
    command: &[String],
    model: &str,
    server: &Server,
    spec: Option<&Speculative>,
) -> Vec<String> {
    let mut a: Vec<String> = command.to_vec();
    let flag = |a: &mut Vec<String>, name: &str, value: Option<String>| {
        if let Some(v) = value {
            a.push(name.to_string());
            a.push(v);
        }
    };
    match engine {
        Engine::Sglang => {
            flag(&mut a, "--model-path", Some(model.to_string()));
            flag(&mut a, "--host", Some(server.host.clone()));
            flag(&mut a, "--port", Some(server.port.to_string()));
            flag(&mut a, "--tp-size", server.tp_size.map(|v| v.to_string()));
            flag(&mut a, "--mem-fraction-static", server.mem_fraction_static.map(float));
            flag(&mut a, "--max-running-requests", server.max_running_requests.map(|v| v.to_string()));
            flag(&mut a, "--context-length", server.context_length.map(|v| v.to_string()));
            flag(&mut a, "--served-model-name", server.served_model_name.clone());
            if let Some(s) = spec {
                flag(&mut a, "--speculative-algorithm", s.algorithm.clone());
                flag(&mut a, "--speculative-num-steps", s.num_steps.map(|v| v.to_string()));
                flag(&mut a, "--speculative-eagle-topk", s.eagle_topk.map(|v| v.to_string()));
                flag(&mut a, "--speculative-num-draft-tokens", s.num_draft_tokens.map(|v| v.to_string()));
                flag(&mut a, "--speculative-draft-model-path", s.draft_model.clone());
            }
        }
        Engine::Vllm => {
            a.push(model.to_string());
            flag(&mut a, "--host", Some(server.host.clone()));
            flag(&mut a, "--port", Some(server.port.to_string()));
            flag(&mut a, "--tensor-parallel-size", server.tp_size.map(|v| v.to_string()));
            flag(&mut a, "--gpu-memory-utilization", server.mem_fraction_static.map(float));
            flag(&mut a, "--max-num-seqs", server.max_running_requests.map(|v| v.to_string()));
            flag(&mut a, "--max-model-len", server.context_length.map(|v| v.to_string()));
            flag(&mut a, "--served-model-name", server.served_model_name.clone());
            if let Some(s) = spec {
                flag(&mut a, "--speculative-config", Some(vllm_speculative_config(s)));
            }
        }
        Engine::LlamaCpp => {
            flag(&mut a, "--model", Some(model.to_string()));
            flag(&mut a, "--host", Some(server.host.clone()));
            flag(&mut a, "--port", Some(server.port.to_string()));
            flag(&mut a, "--ctx-size", server.context_length.map(|v| v.to_string()));
            flag(&mut a, "--parallel", server.max_running_requests.map(|v| v.to_string()));
            flag(&mut a, "--n-gpu-layers", server.n_gpu_layers.map(|v| v.to_string()));
            flag(&mut a, "--alias", server.served_model_name.clone());
            if let Some(s) = spec {
                flag(&mut a, "--spec-draft-model", s.draft_model.clone());
                flag(&mut a, "--spec-draft-n-max", s.num_steps.map(|v| v.to_string()));
                flag(&mut a, "--spec-draft-n-min", s.draft_min.map(|v| v.to_string()));
                flag(&mut a, "--spec-draft-p-min", s.draft_p_min.map(float));
            }
        }
    }
    a.extend(server.extra_args.iter().cloned());
    a
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
    fn floats_round_trip() {
        assert_eq!(float(0.85), "0.85");
        assert_eq!(float(1.0), "1.0");
        assert_eq!(float(0.1 + 0.2), "0.30000000000000004");
    }
}
