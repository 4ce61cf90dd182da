//! The spec as users write it (YAML, one file per managed unit).
//!
//! Every field of [`SpecLayer`] is optional so that the same type serves as the base `spec` and as a
//! per-host overlay under `hosts`; [`crate::resolve`] merges them and fills in the defaults.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A spec file: one inference service, i.e. one systemd unit that specd owns.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(title = "specd InferenceService", transform = required_fields)]
pub struct Document {
    /// Always `specd/v1`.
    #[serde(rename = "apiVersion", default)]
    #[schemars(extend("const" = "specd/v1"))]
    pub api_version: String,
    /// Always `InferenceService`.
    #[serde(default)]
    #[schemars(extend("const" = "InferenceService"))]
    pub kind: String,
    #[serde(default)]
    pub metadata: Metadata,
    /// The desired state, for every host.
    #[serde(default)]
    pub spec: SpecLayer,
    /// Per-host overlays, keyed by hostname, deep-merged over `spec` on that host.
    /// Maps merge key by key; scalars and lists replace.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub hosts: BTreeMap<String, SpecLayer>,
}

/// The top-level fields default to empty when parsing, so that a missing one is reported by
/// validation with its path; the schema still marks them required, without a default.
fn required_fields(schema: &mut schemars::Schema) {
    required(schema, &["apiVersion", "kind", "metadata", "spec"]);
}

fn required_name(schema: &mut schemars::Schema) {
    required(schema, &["name"]);
}

fn required(schema: &mut schemars::Schema, names: &[&str]) {
    fn strip(schema: &mut serde_json::Value, required: &[&str]) {
        if let Some(obj) = schema.as_object_mut() {
            obj.insert("required".into(), serde_json::json!(required));
            if let Some(props) = obj.get_mut("properties").and_then(|p| p.as_object_mut()) {
                for name in required {
                    if let Some(p) = props.get_mut(*name).and_then(|p| p.as_object_mut()) {
                        p.remove("default");
                    }
                }
            }
        }
    }
    let mut top = serde_json::Value::Object(std::mem::take(schema.ensure_object()));
    strip(&mut top, names);
    if let serde_json::Value::Object(map) = top {
        *schema.ensure_object() = map;
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(transform = required_name)]
pub struct Metadata {
    /// A name for this service: lowercase letters, digits and `-`, at most 63 characters.
    #[serde(default)]
    #[schemars(extend("pattern" = "^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"))]
    pub name: String,
    /// Free-form labels, shown by `specd status`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}

/// The inference engine; selects the flag names and HTTP endpoints specd uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Engine {
    /// SGLang (`python3 -m sglang.launch_server`).
    Sglang,
    /// vLLM (`vllm serve`).
    Vllm,
    /// llama.cpp's `llama-server`.
    LlamaCpp,
}

impl Engine {
    pub fn as_str(self) -> &'static str {
        match self {
            Engine::Sglang => "sglang",
            Engine::Vllm => "vllm",
            Engine::LlamaCpp => "llama-cpp",
        }
    }
}

/// The desired state of one service. In `spec` the fields `unit`, `engine` and `model` are required;
/// in a host overlay every field is optional and `unit` may not be changed.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SpecLayer {
    /// The systemd unit specd owns, e.g. `sglang-qwen.service`. The host's own units are refused
    /// (`systemd-*`, `dbus*`, `specd`, `specd-*`, `user@*`, `getty@*`, `ssh*`, cron, polkit,
    /// NetworkManager…).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unit: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<Engine>,
    /// The argv prefix that starts the engine. Defaults: sglang `python3 -m sglang.launch_server`,
    /// vllm `vllm serve`, llama-cpp `llama-server`. The program is an absolute path (without
    /// quotes, backslashes or `$`, which systemd refuses there) or a bare name that systemd looks
    /// up in its fixed search path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<Vec<String>>,
    /// Absolute path of the model weights.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server: Option<ServerLayer>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speculative: Option<SpeculativeLayer>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights: Option<WeightsLayer>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<ServiceLayer>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub readiness: Option<ReadinessLayer>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<PolicyLayer>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<RolloutLayer>,
}

/// Server arguments. Names follow SGLang's flags; specd renders each engine's own equivalent.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ServerLayer {
    /// Address to listen on (`--host`). Default `127.0.0.1`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// Port to listen on (`--port`), 1..=65535. Defaults: sglang 30000, vllm 8000, llama-cpp 8080.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "strict::u32")]
    pub port: Option<u32>,
    /// Tensor parallel size: sglang `--tp-size`, vllm `--tensor-parallel-size`.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "strict::u32")]
    pub tp_size: Option<u32>,
    /// Fraction of GPU memory for weights and KV cache: sglang `--mem-fraction-static`,
    /// vllm `--gpu-memory-utilization`. In (0, 1].
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "strict::f64")]
    pub mem_fraction_static: Option<f64>,
    /// Concurrent requests: sglang `--max-running-requests`, vllm `--max-num-seqs`,
    /// llama-cpp `--parallel`.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "strict::u32")]
    pub max_running_requests: Option<u32>,
    /// Context length in tokens: sglang `--context-length`, vllm `--max-model-len`,
    /// llama-cpp `--ctx-size`.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "strict::u32")]
    pub context_length: Option<u32>,
    /// Layers offloaded to the GPU (llama-cpp `--n-gpu-layers`).
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "strict::u32")]
    pub n_gpu_layers: Option<u32>,
    /// Model name served by the API (`--served-model-name`; llama-cpp `--alias`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub served_model_name: Option<String>,
    /// Further arguments appended verbatim. May not repeat a flag specd renders.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extra_args: Option<Vec<String>>,
}

/// Speculative decoding. Names follow SGLang's `--speculative-*` flags.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SpeculativeLayer {
    /// sglang `--speculative-algorithm` (EAGLE, EAGLE3, NEXTN, STANDALONE, NGRAM);
    /// vllm `speculative-config.method` (ngram, ngram_gpu, suffix, draft_model, eagle, eagle3, medusa,
    /// mlp_speculator, dflash, dspark, mtp and its model-named spellings such as qwen3_5_mtp).
    /// Not used by llama-cpp (a draft model selects draft decoding).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub algorithm: Option<String>,
    /// sglang `--speculative-num-steps`; vllm `num_speculative_tokens`;
    /// llama-cpp `--spec-draft-n-max`.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "strict::u32")]
    pub num_steps: Option<u32>,
    /// sglang `--speculative-eagle-topk`.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "strict::u32")]
    pub eagle_topk: Option<u32>,
    /// sglang `--speculative-num-draft-tokens`.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "strict::u32")]
    pub num_draft_tokens: Option<u32>,
    /// Absolute path of the draft model: sglang `--speculative-draft-model-path`,
    /// vllm `speculative-config.model`, llama-cpp `--spec-draft-model`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draft_model: Option<String>,
    /// llama-cpp `--spec-draft-n-min`.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "strict::u32")]
    pub draft_min: Option<u32>,
    /// llama-cpp `--spec-draft-p-min`, in [0, 1].
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "strict::f64")]
    pub draft_p_min: Option<f64>,
    /// vllm ngram `prompt_lookup_min`.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "strict::u32")]
    pub prompt_lookup_min: Option<u32>,
    /// vllm ngram `prompt_lookup_max`.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "strict::u32")]
    pub prompt_lookup_max: Option<u32>,
}

/// How the model's and the draft model's weight files are checked before anything is stopped.
/// Their headers and sizes are always checked, by format (safetensors and their index, GGUF, a
/// Hugging Face cache snapshot), without reading the weights themselves.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WeightsLayer {
    /// `sha256`: also read every file the engine will load whole and compare it with its digest
    /// where a Hugging Face cache names it (a blob's name is its sha256, or for a small file its
    /// git blob sha1); a file that differs refuses the apply before the stop. Digests are
    /// remembered by file (device, inode, size, modification time) in the state directory, so
    /// an unchanged file is read once. Default `none`: no weight data is read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verify: Option<Verify>,
}

/// What `weights.verify` reads of the weight files.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Verify {
    /// Headers and sizes only.
    #[default]
    None,
    /// The whole content, against the digest the Hugging Face cache names it by.
    Sha256,
}

/// systemd `Restart=`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Restart {
    No,
    OnSuccess,
    OnFailure,
    OnAbnormal,
    OnWatchdog,
    OnAbort,
    Always,
}

impl Restart {
    pub fn as_str(self) -> &'static str {
        match self {
            Restart::No => "no",
            Restart::OnSuccess => "on-success",
            Restart::OnFailure => "on-failure",
            Restart::OnAbnormal => "on-abnormal",
            Restart::OnWatchdog => "on-watchdog",
            Restart::OnAbort => "on-abort",
            Restart::Always => "always",
        }
    }
}

/// The `[Service]` section of the rendered unit.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ServiceLayer {
    /// `Description=`. Default `specd: NAME (ENGINE)`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// `User=`: a name by systemd's strict rules (a letter or `_`, then letters, digits, `_` or
    /// `-`, at most 31 bytes; no dots) or a numeric id in 0..=4294967294 other than 65535.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// `Group=`: the same rules as `user`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// `WorkingDirectory=`, an absolute path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub working_directory: Option<String>,
    /// `Environment=`, one line per variable. Maps merge key by key in host overlays.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub environment: Option<BTreeMap<String, String>>,
    /// `EnvironmentFile=`, one line per file, in this order: absolute paths of files of
    /// `NAME=value` lines, read by systemd when the service starts. A leading `-` makes the file
    /// optional, as in systemd. The place for secrets (`HF_TOKEN`, API keys): their values stay
    /// out of the unit file and specd's state. A list replaces the base spec's in host overlays.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub environment_files: Option<Vec<String>>,
    /// `LoadCredential=NAME:PATH`, one line per credential: systemd copies the file at the
    /// absolute PATH to `$CREDENTIALS_DIRECTORY/NAME` (`/run/credentials/UNIT/NAME`), readable only
    /// by the service. NAME: letters, digits, `_`, `-` and `.`, at most 255 bytes. Maps merge key
    /// by key in host overlays.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials: Option<BTreeMap<String, String>>,
    /// Allow literal secrets in the spec. Default false: a secret in the unit file (0644) or on
    /// the server's command line (`ps`, `/proc/PID/cmdline`) is readable by every local user, so
    /// validation refuses (1) literal values in `environment` for variables whose names look like
    /// secrets: a `_`-separated word ending in `TOKEN`, `SECRET`, `PASSWORD` or `PASSWD`
    /// (`HF_TOKEN`), or a name ending in `_KEY` (`OPENAI_API_KEY`), in any case (names ending in
    /// `_PATH`, `_FILE` or `_DIR` locate a secret and are not refused; nor are
    /// `TOKENIZERS_PARALLELISM` or `MAX_TOKENS`); (2) in `command` and `server.extra_args`, a
    /// value after a flag that takes a secret: the engine's own (`--api-key`, vLLM's
    /// `--hf-token`, llama-server's `-hft`...) or one whose last word says so (`--x-token`,
    /// `--x-password`, `--x-key` followed by anything but numbers; not `--api-key-file`), and
    /// `NAME=value` with such a NAME; (3) on the command line and in `environment`, a value in a
    /// well-known credential format (`sk-…`, `hf_…`, `ghp_…`, `github_pat_…`, `glpat-…`,
    /// `xoxb-…`, `AKIA…`). Put secrets in `environment_files` or `credentials` instead (vLLM
    /// reads its API key from `VLLM_API_KEY`, llama-server from `LLAMA_API_KEY` or
    /// `--api-key-file`).
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "strict::bool")]
    pub allow_literal_secrets: Option<bool>,
    /// `Restart=`. Default `on-failure`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart: Option<Restart>,
    /// `RestartSec=` in seconds. Default 5.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "strict::u32")]
    pub restart_sec: Option<u32>,
    /// `TimeoutStartSec=` in seconds. Default 1800 (large models load for minutes).
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "strict::u32")]
    pub timeout_start_sec: Option<u32>,
    /// `TimeoutStopSec=` in seconds: how long systemd waits after SIGTERM before SIGKILL. Default 300.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "strict::u32")]
    pub timeout_stop_sec: Option<u32>,
    /// How long specd waits for in-flight requests to drain before it stops the unit. Default 0
    /// (stop at once; the engine then drains under `timeout_stop_sec`).
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "strict::u32")]
    pub drain_timeout_sec: Option<u32>,
    /// During the drain (from the moment an apply decides to stop the serving instance until
    /// it has stopped), refuse new TCP connections to the server's port (a reset: clients fail
    /// fast and retry elsewhere) while established ones finish: a rule in specd's own nftables
    /// table (`inet specd`), removed once the instance stopped (after a crash, by the next
    /// reconcile of the unit). For a unit no load balancer polls, whose clients would otherwise
    /// keep it busy until the stop's SIGKILL. Needs `nft`; without it the apply says so and
    /// drains as without this. Default false. A request on a kept-alive connection still comes in.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "strict::bool")]
    pub drain_refuse_new: Option<bool>,
    /// `MemoryMax=`: bytes with an optional K, M, G, T, P or E suffix (base 1024, e.g. `200G`),
    /// a percentage of physical memory in (0, 100] (e.g. `80%`), or `infinity`. Bytes at least
    /// what the engine needs to start at all: 1G for sglang and vllm, 64M for llama-cpp.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_max: Option<String>,
    /// Start the server at boot (`systemctl enable`: the unit is wanted by
    /// `multi-user.target`), so that it serves again after a reboot before the agent runs.
    /// Default true; false disables it (specd never enables it, and disables it if it was).
    /// Changing it changes no unit file and restarts nothing.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "strict::bool")]
    pub enabled: Option<bool>,
}

/// How specd decides that a started server is ready.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReadinessLayer {
    /// Give up (and roll back) after this many seconds. Default: `service.timeout_start_sec`.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "strict::u32")]
    pub timeout_sec: Option<u32>,
    /// HTTP path polled until it answers 200. Defaults: sglang `/health_generate`,
    /// vllm `/health`, llama-cpp `/health`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// Compare the server's own reported args with the spec once it is ready. Default true.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "strict::bool")]
    pub verify_args: Option<bool>,
    /// With a `speculative` section: once ready, send one short generation and fail the apply
    /// (rolling back) unless the engine's own evidence shows drafting (llama.cpp `/slots` and
    /// completion timings, SGLang `meta_info.spec_verify_ct`, vLLM `spec_decode` counters).
    /// Default true; turn it off only for a server whose generation endpoint specd cannot call
    /// (an API key).
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "strict::bool")]
    pub verify_speculation: Option<bool>,
}

/// What specd does when the host differs from the spec.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum DriftPolicy {
    /// Re-apply the spec.
    Heal,
    /// Only report the drift.
    Report,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PolicyLayer {
    /// Default `heal`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drift: Option<DriftPolicy>,
    /// Restore the last good unit when a new one fails. Default true.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "strict::bool")]
    pub rollback: Option<bool>,
    /// Let specd replace a unit file it did not write (one without specd's header). Default false.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "strict::bool")]
    pub adopt: Option<bool>,
}

/// Replicas on one host: units (each its own spec, port and GPUs) that name the same `group` are
/// changed at most `max_unavailable` at a time, the next only once the previous serves again;
/// with `max_surge`, only once the group's spares serve the new spec beside them.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RolloutLayer {
    /// The replicas' group on this host: 1-63 lowercase letters, digits or `-`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// How many of the group's replicas may be not serving at once during a change. Default 1,
    /// at least 1.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "strict::u32")]
    pub max_unavailable: Option<u32>,
    /// How many of the group's spares (units saying `spare: true`) start with the new spec
    /// beside the old replicas before the first of those is stopped. Default 0; with 1 or more,
    /// `max_unavailable` may be 0 (the group's serving capacity never falls during a change).
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "strict::u32")]
    pub max_surge: Option<u32>,
    /// This unit is the group's spare capacity (its own free port and GPU set): held stopped
    /// while the group is at rest; started first with the group's new spec during a change and
    /// stopped again once every replica serves it. Default false. A spare's `policy.rollback`
    /// and `service.enabled` default to false: a failed start leaves it stopped, and it does not
    /// start at boot.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "strict::bool")]
    pub spare: Option<bool>,
}

/// Overlay merge: `over` wins field by field; nested sections and maps merge recursively.
pub(crate) trait Merge {
    fn merge(&mut self, over: &Self);
}

fn merge_opt<T: Clone>(base: &mut Option<T>, over: &Option<T>) {
    if over.is_some() {
        base.clone_from(over);
    }
}

fn merge_section<T: Merge + Clone + Default>(base: &mut Option<T>, over: &Option<T>) {
    if let Some(o) = over {
        base.get_or_insert_with(T::default).merge(o);
    }
}

macro_rules! impl_merge {
    ($ty:ty { $($field:ident),* } sections { $($section:ident),* }) => {
        impl Merge for $ty {
            fn merge(&mut self, over: &Self) {
                $( merge_opt(&mut self.$field, &over.$field); )*
                $( merge_section(&mut self.$section, &over.$section); )*
            }
        }
    };
}

impl_merge!(SpecLayer { unit, engine, command, model } sections { server, speculative, weights, service, readiness, policy, rollout });
impl_merge!(RolloutLayer { group, max_unavailable, max_surge, spare } sections {});
impl_merge!(ServerLayer { host, port, tp_size, mem_fraction_static, max_running_requests, context_length, n_gpu_layers, served_model_name, extra_args } sections {});
impl_merge!(SpeculativeLayer { algorithm, num_steps, eagle_topk, num_draft_tokens, draft_model, draft_min, draft_p_min, prompt_lookup_min, prompt_lookup_max } sections {});
impl_merge!(ServiceLayer { description, user, group, working_directory, environment_files, allow_literal_secrets, restart, restart_sec, timeout_start_sec, timeout_stop_sec, drain_timeout_sec, drain_refuse_new, memory_max, enabled } sections { environment, credentials });
impl_merge!(WeightsLayer { verify } sections {});
impl_merge!(ReadinessLayer { timeout_sec, endpoint, verify_args, verify_speculation } sections {});
impl_merge!(PolicyLayer { drift, rollback, adopt } sections {});

impl Merge for BTreeMap<String, String> {
    fn merge(&mut self, over: &Self) {
        for (k, v) in over {
            self.insert(k.clone(), v.clone());
        }
    }
}

/// Numbers and booleans exactly as YAML writes them: a quoted string is never read as a number
/// (`port: "0x1F90"` is an error, not port 8080), and every integer is range-checked with an
/// error that says the range instead of wrapping or saturating.
pub(crate) mod strict {
    use std::fmt;

    use serde::de::{self, Deserializer, Visitor};

    /// A user's string in a message: quoted, and cut short when long.
    pub(crate) fn shown(v: &str) -> String {
        const MAX: usize = 40;
        match v.char_indices().nth(MAX) {
            None => format!("{v:?}"),
            Some((i, _)) => format!("{:?}… ({} bytes)", &v[..i], v.len()),
        }
    }

    fn got<E: de::Error>(expected: &str, what: String) -> E {
        E::custom(format!("expected {expected}, got {what}"))
    }

    pub(crate) fn u32<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
        struct V;
        const RANGE: &str = "an integer in 0..=4294967295";
        impl<'de> Visitor<'de> for V {
            type Value = Option<u32>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(RANGE)
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                u32::try_from(v).map(Some).map_err(|_| got(RANGE, v.to_string()))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                u32::try_from(v).map(Some).map_err(|_| got(RANGE, v.to_string()))
            }
            fn visit_u128<E: de::Error>(self, v: u128) -> Result<Self::Value, E> {
                u32::try_from(v).map(Some).map_err(|_| got(RANGE, v.to_string()))
            }
            fn visit_i128<E: de::Error>(self, v: i128) -> Result<Self::Value, E> {
                u32::try_from(v).map(Some).map_err(|_| got(RANGE, v.to_string()))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
                if v.is_finite() && v.fract() == 0.0 && !(0.0..=f64::from(u32::MAX)).contains(&v) {
                    Err(got(RANGE, format!("{v}, which is out of range")))
                } else {
                    Err(got("an integer", format!("the floating-point number {v}")))
                }
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Err(got("an integer", format!("a string: {}", shown(v))))
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
                Err(got("an integer", format!("a boolean ({v})")))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(None)
            }
            fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(None)
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, _: A) -> Result<Self::Value, A::Error> {
                Err(got("an integer", "a list".into()))
            }
            fn visit_map<A: de::MapAccess<'de>>(self, _: A) -> Result<Self::Value, A::Error> {
                Err(got("an integer", "a map".into()))
            }
        }
        d.deserialize_any(V)
    }

    pub(crate) fn f64<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Option<f64>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a number")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                Ok(Some(v as f64))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                Ok(Some(v as f64))
            }
            fn visit_u128<E: de::Error>(self, v: u128) -> Result<Self::Value, E> {
                Ok(Some(v as f64))
            }
            fn visit_i128<E: de::Error>(self, v: i128) -> Result<Self::Value, E> {
                Ok(Some(v as f64))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
                Ok(Some(v))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Err(got("a number", format!("a string: {}", shown(v))))
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
                Err(got("a number", format!("a boolean ({v})")))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(None)
            }
            fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(None)
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, _: A) -> Result<Self::Value, A::Error> {
                Err(got("a number", "a list".into()))
            }
            fn visit_map<A: de::MapAccess<'de>>(self, _: A) -> Result<Self::Value, A::Error> {
                Err(got("a number", "a map".into()))
            }
        }
        d.deserialize_any(V)
    }

    pub(crate) fn bool<'de, D: Deserializer<'de>>(d: D) -> Result<Option<bool>, D::Error> {
        struct V;
        const WANT: &str = "true or false";
        impl<'de> Visitor<'de> for V {
            type Value = Option<bool>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(WANT)
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
                Ok(Some(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                Err(got(WANT, format!("the number {v}")))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                Err(got(WANT, format!("the number {v}")))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
                Err(got(WANT, format!("the number {v}")))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Err(got(WANT, format!("a string: {}", shown(v))))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(None)
            }
            fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(None)
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, _: A) -> Result<Self::Value, A::Error> {
                Err(got(WANT, "a list".into()))
            }
            fn visit_map<A: de::MapAccess<'de>>(self, _: A) -> Result<Self::Value, A::Error> {
                Err(got(WANT, "a map".into()))
            }
        }
        d.deserialize_any(V)
    }
}
