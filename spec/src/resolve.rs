//! The resolved spec: base + host overlay merged, defaults filled in, validated.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::model::{DriftPolicy, Engine, Restart, Verify};

/// A validated spec for one host: everything needed to render the unit and to check the server.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Spec {
    /// `metadata.name`.
    pub name: String,
    /// The hostname whose overlay was merged, if the file has one for it.
    pub overlay: Option<String>,
    pub unit: String,
    pub engine: Engine,
    /// The full argv of `ExecStart=`.
    pub argv: Vec<String>,
    pub model: String,
    pub server: Server,
    pub speculative: Option<Speculative>,
    /// How the weights are checked before a stop (`weights.verify`).
    #[serde(default, skip_serializing_if = "Weights::is_default")]
    pub weights: Weights,
    pub service: Service,
    pub readiness: Readiness,
    pub policy: Policy,
    /// The replicas' group this unit rolls with (`rollout:`), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<Rollout>,
}

/// `rollout:` resolved: the group, and how many of its replicas may be not serving at once.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rollout {
    pub group: String,
    pub max_unavailable: u32,
    /// Spares started beside the replicas before the first is stopped (`max_surge`, default 0).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub max_surge: u32,
    /// This unit is one of the group's spares (`spare: true`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub spare: bool,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Weights {
    pub verify: Verify,
}

impl Weights {
    fn is_default(&self) -> bool {
        *self == Weights::default()
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Server {
    pub host: String,
    pub port: u16,
    pub tp_size: Option<u32>,
    pub mem_fraction_static: Option<f64>,
    pub max_running_requests: Option<u32>,
    pub context_length: Option<u32>,
    pub n_gpu_layers: Option<u32>,
    pub served_model_name: Option<String>,
    pub extra_args: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Speculative {
    pub algorithm: Option<String>,
    pub num_steps: Option<u32>,
    pub eagle_topk: Option<u32>,
    pub num_draft_tokens: Option<u32>,
    pub draft_model: Option<String>,
    pub draft_min: Option<u32>,
    pub draft_p_min: Option<f64>,
    pub prompt_lookup_min: Option<u32>,
    pub prompt_lookup_max: Option<u32>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Service {
    pub description: String,
    pub user: Option<String>,
    pub group: Option<String>,
    pub working_directory: Option<String>,
    pub environment: BTreeMap<String, String>,
    /// `EnvironmentFile=` paths, in the spec's order (a leading `-`: optional).
    #[serde(default)]
    pub environment_files: Vec<String>,
    /// `LoadCredential=` name → absolute path.
    #[serde(default)]
    pub credentials: BTreeMap<String, String>,
    pub restart: Restart,
    pub restart_sec: u32,
    pub timeout_start_sec: u32,
    pub timeout_stop_sec: u32,
    pub drain_timeout_sec: u32,
    /// New connections to the server's port refused during the drain (nftables).
    #[serde(default)]
    pub drain_refuse_new: bool,
    pub memory_max: Option<String>,
    /// Enabled at boot (`systemctl enable`). Not part of the unit file.
    #[serde(default = "enabled_by_default")]
    pub enabled: bool,
}

fn enabled_by_default() -> bool {
    true
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Readiness {
    pub timeout_sec: u32,
    pub endpoint: String,
    pub verify_args: bool,
    pub verify_speculation: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Policy {
    pub drift: DriftPolicy,
    pub rollback: bool,
    /// specd may replace a unit file it did not write.
    #[serde(default)]
    pub adopt: bool,
}

/// One server argument as the engine reports it once running, for `verify_args`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ExpectedArg {
    /// JSON pointer into the engine's report (`/get_server_info` for SGLang, `/props` for
    /// llama.cpp, vLLM's `non-default args` line), e.g. `/model_path`.
    pub key: &'static str,
    /// The value the engine must report; `null` means "must be unset".
    pub value: serde_json::Value,
    /// What the report means when it has no such key: `null`, or the engine's default where
    /// the report lists only the args that differ from their defaults (vLLM).
    pub absent: serde_json::Value,
}

/// The base URL specd reaches a server at from the same host, given what it listens on (a
/// wildcard address is reached on loopback).
pub fn base_url(host: &str, port: &str) -> String {
    let host = match host {
        "0.0.0.0" | "" => "127.0.0.1".to_string(),
        "::" => "[::1]".to_string(),
        h if h.contains(':') => format!("[{h}]"),
        h => h.to_string(),
    };
    format!("http://{host}:{port}")
}

/// The base URL of a server from its argv (`--port`, and `--host` when given; `--flag value` or
/// `--flag=value`): where an instance of a unit already deployed listens.
pub fn base_url_of_argv(argv: &[String]) -> Option<String> {
    let val = |flag: &str| {
        argv.iter().enumerate().find_map(|(i, w)| {
            if w == flag { argv.get(i + 1).cloned() } else { w.strip_prefix(&format!("{flag}=")).map(str::to_string) }
        })
    };
    Some(base_url(&val("--host").unwrap_or_default(), &val("--port")?))
}

impl Spec {
    /// The server's base URL as specd reaches it from the same host.
    pub fn base_url(&self) -> String {
        base_url(&self.server.host, &self.server.port.to_string())
    }

    /// Where the engine reports the args it runs with.
    pub fn args_report(&self) -> crate::engine::ArgsReport {
        crate::engine::facts(self.engine).args_report
    }

    /// Whether the spec asks the engine to speculate.
    pub fn speculates(&self) -> bool {
        self.speculative.as_ref().is_some_and(|s| s.algorithm.is_some())
    }

    /// The args the running engine must report, after the engine's own documented rewrites
    /// (SGLang reports `NEXTN` as `EAGLE`: `EngineFacts::algorithms`). Only what the spec pins
    /// is listed.
    pub fn expected_server_args(&self) -> Vec<ExpectedArg> {
        use serde_json::{Value, json};
        let facts = crate::engine::facts(self.engine);
        facts
            .reported
            .iter()
            .filter_map(|r| {
                let v = crate::engine::field_value(r.field, &self.model, &self.server, self.speculative.as_ref());
                // The engine reports an algorithm by its own name for it.
                let v = match (r.field, v) {
                    ("speculative.algorithm", Some(Value::String(a))) => {
                        Some(json!(facts.algorithm(&a).map_or(a.as_str(), |x| x.reported_as)))
                    }
                    (_, v) => v,
                };
                let default = r.default.map(|l| serde_json::from_str::<Value>(l).unwrap_or(Value::Null));
                let absent = match facts.args_report {
                    crate::engine::ArgsReport::LogLine(_) => default.clone().unwrap_or(Value::Null),
                    _ => Value::Null,
                };
                Some(ExpectedArg { key: r.pointer, value: v.or(default)?, absent })
            })
            .collect()
    }
}
