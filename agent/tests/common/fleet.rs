//! A fleet of GPU hosts on one machine, for the fleet's end-to-end tests: [`Hosts`].
//!
//! Each host is a systemd box of its own ([`HostBox`]): its host name (the box's and the agent's
//! `hostname:`), its own state (`/var/lib/specd`), unit directory and units, the agent under the
//! shipped unit's `[Service]` and sandbox with metrics on a port of its own, and the stand-in
//! SGLang server of [`LLM`] on a port of its own. Every agent follows one git remote, a bare
//! repository on the machine's file system bound into every box (a `file://` URL), polled every
//! second; the test commits to it through a working clone ([`Hosts::commit`]). One real
//! Prometheus scrapes every agent every second ([`Hosts::prometheus`]).
//!
//! A host's GPU is smaller when it has [`HostSetup::max_draft_tokens`]: its box's systemd gives
//! every unit `SPECD_STANDIN_MAX_DRAFT_TOKENS` (`DefaultEnvironment=` in the box's
//! `/run/systemd/system.conf.d/`), so the stand-in of a spec with a larger draft dies of CUDA
//! OOM while loading, on that host only. The spec does not say it and specd never reads it: the
//! machine does, as a host whose GPU has less memory.
//!
//! Dropping [`Hosts`] (also while a test panics) kills Prometheus and tears every box down;
//! [`Hosts::shutdown`] does the same and fails if a box left anything behind.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::Value;
use specd_e2e::{Prometheus, SystemdBox, bin_path, free_port, git, http, http_get, sglang_spec, wait_for};
use specd_spec::fleet::Record;

use super::{AGENT, start_agent_unit, text};

/// The one unit every host runs: the stand-in playing SGLang with speculation.
pub const LLM: &str = "llm.service";

/// The spec file of [`LLM`] in the repository (under `specs/`).
pub const LLM_FILE: &str = "llm.yaml";

/// The Prometheus job that scrapes the agents.
pub const JOB: &str = "specd";

/// The agent's config file in each box (the box's private `/run`).
const AGENT_CONFIG: &str = "/run/agent.yaml";

/// What a host is: its name, the labels its agent declares, and the size of its GPU.
#[derive(Clone, Debug)]
pub struct HostSetup {
    pub name: String,
    /// The labels the host's agent declares (`labels:` of its config), for waves that select
    /// hosts by label.
    pub labels: BTreeMap<String, String>,
    /// The largest draft (SGLang `num_draft_tokens`) this host's GPU holds; a spec asking more
    /// dies of CUDA OOM while loading. `None`: any draft fits.
    pub max_draft_tokens: Option<u32>,
}

impl HostSetup {
    /// Host `gpu-0N` (N from 1) of the default fleet: `gpu: h100`, and `ring: canary` for the
    /// first, `early` for the second and third, `main` for the others; any draft fits.
    pub fn gpu(n: usize) -> HostSetup {
        let ring = match n {
            1 => "canary",
            2 | 3 => "early",
            _ => "main",
        };
        HostSetup {
            name: format!("gpu-{n:02}"),
            labels: [("gpu", "h100"), ("ring", ring)]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            max_draft_tokens: None,
        }
    }
}

/// What [`Hosts::boot`] boots.
#[derive(Clone, Debug)]
pub struct FleetSetup {
    pub hosts: Vec<HostSetup>,
    /// How often the agents poll the remote (`interval:`) and look at everything (`resync:`).
    pub poll_s: u64,
}

impl FleetSetup {
    /// `n` hosts `gpu-01`.. as [`HostSetup::gpu`] makes them.
    pub fn of(n: usize) -> FleetSetup {
        FleetSetup { hosts: (1..=n).map(HostSetup::gpu).collect(), poll_s: 1 }
    }

    /// The host named `name`, to change it before booting.
    pub fn host_mut(&mut self, name: &str) -> &mut HostSetup {
        self.hosts.iter_mut().find(|h| h.name == name).unwrap_or_else(|| panic!("no host {name} in the setup"))
    }
}

impl Default for FleetSetup {
    /// Six hosts, `gpu-01`..`gpu-06`.
    fn default() -> Self {
        FleetSetup::of(6)
    }
}

/// One host: its box, its agent's metrics port and its server's port.
pub struct HostBox {
    pub setup: HostSetup,
    pub b: SystemdBox,
    /// The agent's metrics endpoint: `127.0.0.1:metrics_port`.
    pub metrics_port: u16,
    /// Where the host's [`LLM`] listens (its spec's host overlay says so).
    pub server_port: u16,
}

impl HostBox {
    pub fn name(&self) -> &str {
        &self.setup.name
    }

    /// The unit's state file, read from the machine through the box's root (no process started).
    fn state_path(&self) -> PathBuf {
        self.b.host_path(&format!("/var/lib/specd/units/{LLM}.json"))
    }
}

/// The fleet: its hosts, the git remote they follow and the Prometheus that scrapes them.
pub struct Hosts {
    hosts: Vec<HostBox>,
    prometheus: Prometheus,
    dir: tempfile::TempDir,
    work: PathBuf,
    remote: PathBuf,
    specd: String,
    standin: String,
    poll_s: u64,
    /// How long booting the boxes and starting Prometheus took.
    pub boot_time: Duration,
}

impl Hosts {
    /// Boots a box per host of `setup` (in parallel), each with its host name, GPU limit and
    /// agent config, an empty remote and Prometheus scraping every agent. The agents are not
    /// started: commit the first specs, then [`Hosts::start_agents`].
    pub fn boot(setup: FleetSetup) -> Hosts {
        let t0 = Instant::now();
        // Under /tmp, as in a clone in a temporary directory: every box binds it, and each agent
        // (its /tmp its own, PrivateTmp=yes) sees it through the harness's drop-in.
        let dir = tempfile::Builder::new().prefix("e2e-hosts.").tempdir_in("/tmp").unwrap();
        let remote = dir.path().join("remote.git");
        let work = dir.path().join("work");
        git(dir.path(), &["init", "-q", "--bare", "-b", "main", remote.to_str().unwrap()]);
        git(dir.path(), &["init", "-q", "-b", "main", work.to_str().unwrap()]);
        git(&work, &["remote", "add", "origin", remote.to_str().unwrap()]);
        std::fs::create_dir_all(work.join("specs")).unwrap();
        let bind = dir.path().to_path_buf();
        let mut ports = distinct_ports(2 * setup.hosts.len()).into_iter();
        let hosts: Vec<HostBox> = std::thread::scope(|s| {
            let boots: Vec<_> = setup
                .hosts
                .iter()
                .map(|h| {
                    let (h, bind) = (h.clone(), bind.clone());
                    let (metrics, server) = (ports.next().unwrap(), ports.next().unwrap());
                    s.spawn(move || boot_host(h, bind, metrics, server))
                })
                .collect();
            boots.into_iter().map(|t| t.join().expect("a host's boot panicked")).collect()
        });
        let targets: Vec<String> = hosts.iter().map(|h| format!("\"127.0.0.1:{}\"", h.metrics_port)).collect();
        let config = format!(
            "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\nscrape_configs:\n  - job_name: {JOB}\n    static_configs: [{{targets: [{}]}}]\n",
            targets.join(", ")
        );
        let prometheus = Prometheus::start(&dir.path().join("prometheus"), &config).unwrap_or_else(|e| panic!("{e:#}"));
        let mut fleet = Hosts {
            hosts,
            prometheus,
            dir,
            work,
            remote,
            specd: env!("CARGO_BIN_EXE_specd").to_string(),
            standin: bin_path("specd-standin").display().to_string(),
            poll_s: setup.poll_s,
            boot_time: Duration::ZERO,
        };
        for h in &fleet.hosts {
            h.b.write_file(AGENT_CONFIG, fleet.agent_config(h)).unwrap();
        }
        fleet.boot_time = t0.elapsed();
        fleet
    }

    /// The agent config of host `h`: the remote, `specs/`, its name, a poll every
    /// [`FleetSetup::poll_s`] (every second by default), its metrics port; its labels.
    fn agent_config(&self, h: &HostBox) -> String {
        let poll = self.poll_s;
        let mut c = format!(
            "repo: {}\npath: specs\nhostname: {}\ninterval: {poll}\nlisten: 127.0.0.1:{}\n",
            self.remote_url(),
            h.name(),
            h.metrics_port
        );
        if poll > 1 {
            c.push_str(&format!("resync: {poll}\n"));
        }
        let labels: Vec<String> = h.setup.labels.iter().map(|(k, v)| format!("{k}: {v:?}")).collect();
        c.push_str(&format!("labels: {{{}}}\n", labels.join(", ")));
        c
    }

    /// Starts every host's agent (in parallel), as [`Hosts::start_agent`] does.
    pub fn start_agents(&self) {
        std::thread::scope(|s| {
            for h in &self.hosts {
                s.spawn(|| self.start_agent(h.name()));
            }
        });
    }

    /// Starts host `name`'s agent: `specd run --config /run/agent.yaml` as the box's unit
    /// [`AGENT`], under the shipped unit's `[Service]` and sandbox; the first time, writes the
    /// unit (and reloads systemd, which takes the box's GPU limit).
    pub fn start_agent(&self, name: &str) {
        let h = self.host(name);
        if h.b.prop(AGENT, "LoadState").is_ok_and(|s| s == "loaded") {
            h.b.systemctl_check(&["start", AGENT]).unwrap();
        } else {
            start_agent_unit(&h.b, &format!("{} run --config {AGENT_CONFIG}", self.specd), "");
            if let Some(n) = h.setup.max_draft_tokens {
                let env = h.b.systemctl_check(&["show", "--property=Environment"]).unwrap();
                assert!(env.contains(&format!("SPECD_STANDIN_MAX_DRAFT_TOKENS={n}")), "{name}'s systemd: {env}");
            }
        }
    }

    /// Stops host `name`'s agent (`systemctl stop`: it stops at a safe point); its units go on.
    pub fn stop_agent(&self, name: &str) {
        self.host(name).b.systemctl_check(&["stop", AGENT]).unwrap();
    }

    pub fn hosts(&self) -> &[HostBox] {
        &self.hosts
    }

    pub fn names(&self) -> Vec<String> {
        self.hosts.iter().map(|h| h.name().to_string()).collect()
    }

    pub fn host(&self, name: &str) -> &HostBox {
        self.hosts.iter().find(|h| h.name() == name).unwrap_or_else(|| panic!("no host {name} in the fleet"))
    }

    /// The URL every agent follows (`file://` of the bare repository).
    pub fn remote_url(&self) -> String {
        format!("file://{}", self.remote.display())
    }

    /// The bare repository the agents follow (a promoter pushes here).
    pub fn remote(&self) -> &Path {
        &self.remote
    }

    /// The test's working clone of the remote (specs in `specs/`).
    pub fn work(&self) -> &Path {
        &self.work
    }

    /// A directory of the test's, removed with the fleet (on the machine's file system, seen by
    /// every box at the same path).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Writes `files` (paths under `specs/`, their text) in the working clone, commits them with
    /// `message` and pushes to the remote; the new commit's hash.
    pub fn commit(&self, files: &[(&str, &str)], message: &str) -> String {
        for (name, text) in files {
            let p = self.work.join("specs").join(name);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        git(&self.work, &["add", "-A"]);
        git(&self.work, &["commit", "-q", "-m", message]);
        git(&self.work, &["push", "-q", "origin", "main"]);
        git(&self.work, &["rev-parse", "HEAD"])
    }

    /// The spec of [`LLM`] at `steps` speculative steps (draft tokens: steps + 1), each host's
    /// server on its own port (the spec's `hosts:` overlays), as a builder.
    pub fn llm(&self, steps: u32) -> LlmSpec {
        LlmSpec {
            standin: self.standin.clone(),
            steps,
            env: BTreeMap::new(),
            ports: self.hosts.iter().map(|h| (h.name().to_string(), h.server_port)).collect(),
            overlays: BTreeMap::new(),
        }
    }

    /// Runs the specd CLI in host `name`'s box.
    pub fn specd(&self, name: &str, args: &[&str]) -> Output {
        let mut argv = vec![self.specd.as_str()];
        argv.extend_from_slice(args);
        self.host(name).b.exec(&argv)
    }

    /// [`LLM`]'s entry of host `name`'s `specd status --json`.
    pub fn status(&self, name: &str) -> Value {
        let o = self.specd(name, &["status", "--json"]);
        let v: Value =
            serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{name}: status: {e}: {}", text(&o)));
        let units = v["units"].as_array().or(v.as_array()).cloned().unwrap_or_default();
        units.into_iter().find(|u| u["unit"] == LLM).unwrap_or_else(|| panic!("{name}: no {LLM} in status: {v}"))
    }

    /// What host `name`'s server says of itself (`/get_server_info`), if it answers.
    pub fn served(&self, name: &str) -> Option<Value> {
        let (code, body) = http_get(self.host(name).server_port, "/get_server_info")?;
        (code == 200).then(|| serde_json::from_str(&body).ok()).flatten()
    }

    /// The entries of [`LLM`]'s history on host `name`, oldest first (none before its first
    /// apply).
    pub fn history(&self, name: &str) -> Vec<Applied> {
        let h = self.host(name);
        let Ok(text) = std::fs::read_to_string(h.state_path()) else { return Vec::new() };
        let st: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{name}: {LLM}'s state: {e}: {text}"));
        st["history"].as_array().into_iter().flatten().map(Applied::of).collect()
    }

    /// Whether host `name` ever tried revision `commit`: a history entry of it that wrote or
    /// started its unit ([`Applied::tried`]).
    pub fn ever_applied(&self, name: &str, commit: &str) -> bool {
        self.history(name).iter().any(|a| a.commit.as_deref() == Some(commit) && a.tried())
    }

    /// What host `name` runs now (one look; see [`Seen`]).
    pub fn seen(&self, name: &str) -> Seen {
        Probe::of(self.host(name)).look()
    }

    /// Waits (at most `within`) until host `name` runs revision `commit`: seen on it
    /// ([`Seen::on`]), and its `specd status` says [`LLM`] is active and healthy, in sync with
    /// that commit's spec when it is the desired one, else applied from it (a host back on a
    /// good revision after a rollback). Returns that status; panics with the status and the
    /// agent's journal when it does not.
    pub fn wait_runs(&self, name: &str, commit: &str, within: Duration) -> Value {
        let mut last = Value::Null;
        let runs = wait_for(&format!("{name} to run {commit}"), within, || {
            // The state file first (no process): status only once the apply is over.
            if !self.seen(name).on(commit) {
                return None;
            }
            last = self.status(name);
            let desired = last["source"]["commit"] == commit;
            let settled = if desired { last["sync"] == "InSync" } else { last["applied_source"]["commit"] == commit };
            (settled && last["health"] == "Healthy" && last["active_state"] == "active").then(|| last.clone())
        });
        runs.unwrap_or_else(|e| {
            let journal = self.host(name).b.journal(AGENT).unwrap_or_default();
            panic!("{e}\nlast status: {last}\nseen: {:?}\n{name}'s agent journal:\n{journal}", self.seen(name))
        })
    }

    /// [`Hosts::wait_runs`] for every host (each with `within`).
    pub fn wait_all_run(&self, commit: &str, within: Duration) {
        for n in self.names() {
            self.wait_runs(&n, commit, within);
        }
    }

    /// Starts sampling every host every `every` in a thread of its own (see [`Sampler`]).
    pub fn sample(&self, every: Duration) -> Sampler {
        let probes: Vec<Probe> = self.hosts.iter().map(Probe::of).collect();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut out = Vec::new();
            // The last sample begins after `finish` was called: what the test saw last (every
            // host on the new commit) is in the timeline, whatever the sampler was doing then.
            loop {
                let last = stopped.load(Ordering::SeqCst);
                let at = Instant::now();
                let hosts = probes.iter().map(|p| (p.name.clone(), p.look())).collect();
                out.push(Sample { at, hosts });
                if last {
                    break out;
                }
                std::thread::sleep(every.saturating_sub(at.elapsed()));
            }
        });
        Sampler { stop, thread: Some(thread) }
    }

    /// The Prometheus that scrapes every agent (job [`JOB`], every second).
    pub fn prometheus(&self) -> &Prometheus {
        &self.prometheus
    }

    /// Its HTTP API's base URL, `http://127.0.0.1:PORT` (the same across stops and starts).
    pub fn prometheus_url(&self) -> String {
        self.prometheus.url()
    }

    /// Stops Prometheus (its port, config and data kept).
    pub fn stop_prometheus(&mut self) {
        self.prometheus.stop();
    }

    /// Starts Prometheus again on the same port and data; returns once it is ready.
    pub fn start_prometheus(&mut self) {
        self.prometheus.resume().unwrap_or_else(|e| panic!("{e:#}"));
    }

    /// Waits (at most `within`) until Prometheus scrapes every agent up (`up` of [`JOB`] 1 for
    /// each). Prometheus takes up its targets about 5 s after it starts (and after a restart):
    /// what an agent exports before that is never stored.
    pub fn wait_scraped(&self, within: Duration) {
        let n = self.hosts.len() as f64;
        let q = format!("sum(up{{job=\"{JOB}\"}}) and count(up{{job=\"{JOB}\"}}) == {n}");
        self.prometheus.wait("every agent scraped up", &q, within, |r| r.len() == 1 && r[0].1 == n);
    }

    /// The target (`instance` label) Prometheus scrapes host `name`'s agent at.
    pub fn instance(&self, name: &str) -> String {
        format!("127.0.0.1:{}", self.host(name).metrics_port)
    }

    /// Stops Prometheus and tears every box down (in parallel); fails naming what a box left
    /// behind.
    pub fn shutdown(mut self) -> anyhow::Result<()> {
        self.prometheus.stop();
        let errors: Vec<String> = std::thread::scope(|s| {
            let downs: Vec<_> = std::mem::take(&mut self.hosts)
                .into_iter()
                .map(|h| s.spawn(move || h.b.shutdown().map_err(|e| format!("{}: {e:#}", h.setup.name))))
                .collect();
            downs.into_iter().filter_map(|t| t.join().expect("a teardown panicked").err()).collect()
        });
        if errors.is_empty() { Ok(()) } else { anyhow::bail!("{}", errors.join("\n")) }
    }
}

impl Drop for Hosts {
    /// Kills Prometheus and tears the boxes down (in parallel; each box's own drop reports
    /// what it left).
    fn drop(&mut self) {
        self.prometheus.stop();
        std::thread::scope(|s| {
            for h in std::mem::take(&mut self.hosts) {
                s.spawn(move || drop(h));
            }
        });
    }
}

/// The fleet file of the tests (`specs/fleet.yaml`): three waves of the default fleet, each
/// baking `bake` seconds — the canary `gpu-01`, the `early` ring (`gpu-02`, `gpu-03`, one at a
/// time), then every other `gpu-*` (two at a time) — and an accept length gate: not below 3/4 of
/// what the previous revision measured on the same host.
pub fn fleet_file(bake: u64) -> String {
    format!(
        "apiVersion: specd/v1\nkind: Fleet\nmetadata:\n  name: gpus\nspec:\n  waves:\n    - name: canary\n      hosts: [gpu-01]\n      bake: {bake}s\n    - name: early\n      labels: {{ring: early}}\n      bake: {bake}s\n    - name: main\n      hosts: ['gpu-*']\n      max_unavailable: 2\n      bake: {bake}s\n  gates:\n    accept_length: {{of_previous: 0.75}}\n"
    )
}

/// A fleet file of two waves, each baking `bake` seconds: the canary `gpu-01`, then every other
/// `gpu-*`, two at a time; the accept length gate of [`fleet_file`].
pub fn canary_then_the_rest(bake: u64) -> String {
    format!(
        "apiVersion: specd/v1\nkind: Fleet\nmetadata:\n  name: gpus\nspec:\n  waves:\n    - name: canary\n      hosts: [gpu-01]\n      bake: {bake}s\n    - name: rest\n      hosts: ['gpu-*']\n      max_unavailable: 2\n      bake: {bake}s\n  gates:\n    accept_length: {{of_previous: 0.75}}\n"
    )
}

/// The fleet file's name under `specs/`.
pub const FLEET_FILE: &str = "fleet.yaml";

/// A promotion record commit: its hash, message and record, as `git log` of the record branch
/// gives them.
#[derive(Clone, Debug)]
pub struct RecordCommit {
    pub commit: String,
    pub message: String,
    pub record: Record,
}

/// `specd promote --watch` run by the test, killed when dropped.
pub struct Promoter {
    child: Option<Child>,
    out: PathBuf,
}

impl Promoter {
    /// Kills it with SIGKILL, wherever it is (a promoter that dies mid-way).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// What it printed (one JSON line per pass).
    pub fn output(&self) -> String {
        std::fs::read_to_string(&self.out).unwrap_or_default()
    }
}

impl Drop for Promoter {
    fn drop(&mut self) {
        self.kill();
    }
}

impl Hosts {
    /// The promoter's command, run on the machine (not in a box), as a CI job would: the
    /// remote, `specs/`, the fleet's Prometheus, its own cache in `state`, JSON output.
    fn promoter_command(&self, state: &str, args: &[&str]) -> Command {
        let mut c = Command::new(&self.specd);
        c.arg("--state-dir")
            .arg(self.dir().join(state))
            .args(args)
            .args(["--config", "/nonexistent/agent.yaml", "--repo", &self.remote_url(), "--path", "specs"])
            .args(["--prometheus", &self.prometheus_url(), "--author", "Fleet CI <ci@fleet.test>"])
            .env("SPECD_LOG", "info");
        c
    }

    /// One pass of `specd promote --json`; its output (checked to succeed).
    pub fn promote(&self) -> Value {
        let o = self.promoter_command("promoter", &["promote", "--json"]).output().unwrap();
        assert!(o.status.success(), "specd promote: {}", text(&o));
        serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("specd promote: {e}: {}", text(&o)))
    }

    /// `specd promote --watch --interval 1 --json` in the background, with its own cache
    /// (`name`), until the returned [`Promoter`] is killed or dropped.
    pub fn promote_watch(&self, name: &str) -> Promoter {
        let out = self.dir().join(format!("{name}.out"));
        let err = self.dir().join(format!("{name}.err"));
        let child = self
            .promoter_command(name, &["promote", "--watch", "--interval", "1", "--json"])
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(std::fs::File::create(err).unwrap())
            .spawn()
            .unwrap();
        Promoter { child: Some(child), out }
    }

    /// `specd fleet <args>` (`status --json`, `halt --reason …`), run as the promoter is.
    pub fn fleet_cmd(&self, args: &[&str]) -> Output {
        let mut a = vec!["fleet"];
        a.extend_from_slice(args);
        self.promoter_command("fleet-cli", &a).output().unwrap()
    }

    /// `specd fleet status --json`: its exit code and its JSON.
    pub fn fleet_status(&self) -> (i32, Value) {
        let o = self.fleet_cmd(&["status", "--json"]);
        let v = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("fleet status: {e}: {}", text(&o)));
        (o.status.code().unwrap_or(-1), v)
    }

    /// The promotion record branch's commits, oldest first (none before the first).
    pub fn record_log(&self) -> Vec<RecordCommit> {
        let branch = "refs/heads/specd-promotions";
        let git_dir = self.remote.to_str().unwrap().to_string();
        let has =
            Command::new("git").args(["--git-dir", &git_dir, "rev-parse", "--verify", "-q", branch]).output().unwrap();
        if !has.status.success() {
            return Vec::new();
        }
        let list = git(self.dir(), &["--git-dir", &git_dir, "rev-list", "--reverse", branch]);
        list.lines()
            .map(|c| {
                let message = git(self.dir(), &["--git-dir", &git_dir, "log", "-1", "--format=%B", c]);
                let text = git(self.dir(), &["--git-dir", &git_dir, "show", &format!("{c}:promotions.yaml")]);
                let record = Record::parse(&text, "promotions.yaml").unwrap_or_else(|d| panic!("{c}: {d}\n{text}"));
                RecordCommit { commit: c.to_string(), message: message.trim().to_string(), record }
            })
            .collect()
    }

    /// The last `n` lines of every host's agent journal, for a failing test's message.
    pub fn journals(&self, n: usize) -> String {
        let mut out = String::new();
        for h in &self.hosts {
            let j = h.b.journal(AGENT).unwrap_or_default();
            let lines: Vec<&str> = j.lines().collect();
            out.push_str(&format!(
                "--- {}'s agent:\n{}\n",
                h.name(),
                lines[lines.len().saturating_sub(n)..].join("\n")
            ));
        }
        out
    }

    /// The promotion record at the branch's head.
    pub fn record(&self) -> Option<Record> {
        self.record_log().pop().map(|c| c.record)
    }

    /// Runs `specd promote` passes until `done` holds of the record (at most `within`); the record.
    pub fn promote_until(&self, what: &str, within: Duration, done: impl Fn(&Record) -> bool) -> Record {
        wait_for(what, within, || {
            self.promote();
            self.record().filter(|r| done(r))
        })
        .unwrap_or_else(|e| {
            panic!(
                "{e}\nrecord log: {:#?}\nstatus: {}\n{}",
                self.record_log(),
                self.fleet_status().1,
                self.journals(40)
            )
        })
    }

    /// Waits (at most `within`) until the record holds `done`, written by promoters of the test's.
    pub fn wait_record(&self, what: &str, within: Duration, done: impl Fn(&Record) -> bool) -> Record {
        wait_for(what, within, || self.record().filter(|r| done(r))).unwrap_or_else(|e| {
            panic!(
                "{e}\nrecord log: {:#?}\nstatus: {}\n{}",
                self.record_log(),
                self.fleet_status().1,
                self.journals(40)
            )
        })
    }
}

/// `n` free ports, no two the same.
fn distinct_ports(n: usize) -> Vec<u16> {
    let mut out: Vec<u16> = Vec::new();
    while out.len() < n {
        let p = free_port();
        if !out.contains(&p) {
            out.push(p);
        }
    }
    out
}

/// Boots host `h`'s box (seeing `bind`): its host name, its GPU limit, its ports.
fn boot_host(h: HostSetup, bind: PathBuf, metrics_port: u16, server_port: u16) -> HostBox {
    let cfg = specd_e2e::BoxConfig { binds: vec![bind], ..Default::default() };
    let b = SystemdBox::boot_with(cfg).unwrap_or_else(|e| panic!("boot {}'s box (as root): {e:#}", h.name));
    b.check(&["hostname", &h.name]).unwrap();
    if let Some(n) = h.max_draft_tokens {
        // Read by systemd at its next reload (the agent's unit is written and loaded with one).
        let conf = format!("[Manager]\nDefaultEnvironment=SPECD_STANDIN_MAX_DRAFT_TOKENS={n}\n");
        b.write_file("/run/systemd/system.conf.d/gpu.conf", conf).unwrap();
    }
    HostBox { setup: h, b, metrics_port, server_port }
}

/// The spec of [`LLM`]: the stand-in as SGLang with NEXTN speculation, each host's server on
/// its port through the spec's `hosts:` overlays (one file for the fleet).
#[derive(Clone, Debug)]
pub struct LlmSpec {
    standin: String,
    steps: u32,
    env: BTreeMap<String, String>,
    ports: Vec<(String, u16)>,
    overlays: BTreeMap<String, Vec<String>>,
}

impl LlmSpec {
    /// An environment variable of the server on every host (e.g. a stand-in knob).
    pub fn env(mut self, k: &str, v: &str) -> LlmSpec {
        self.env.insert(k.into(), v.into());
        self
    }

    /// An environment variable of the server on host `host` only (its overlay's
    /// `service.environment`, merged over the others).
    pub fn env_on(self, host: &str, k: &str, v: &str) -> LlmSpec {
        self.on(host, &format!("service: {{environment: {{{k}: {v:?}}}}}"))
    }

    /// A line of host `host`'s overlay (YAML, a key of `SpecLayer`: e.g.
    /// `speculative: {num_steps: 5, num_draft_tokens: 6}`); not `server:` (the port's).
    pub fn on(mut self, host: &str, line: &str) -> LlmSpec {
        self.overlays.entry(host.into()).or_default().push(line.into());
        self
    }

    /// The spec file's text.
    pub fn text(&self) -> String {
        let mut env: BTreeMap<&str, &str> =
            [("SPECD_STANDIN_LOAD_MS", "200"), ("SPECD_STANDIN_DRAIN_POLL_MS", "100")].into_iter().collect();
        env.extend(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        let env: Vec<String> = env.iter().map(|(k, v)| format!("{k}: {v:?}")).collect();
        let service = format!("  service: {{timeout_stop_sec: 5, environment: {{{}}}}}\n", env.join(", "));
        let first = self.ports.first().map_or(0, |(_, p)| *p);
        let mut out = sglang_spec(&self.standin, LLM, first, self.steps, &service);
        out.push_str("hosts:\n");
        for (host, port) in &self.ports {
            out.push_str(&format!("  {host}:\n    server: {{port: {port}}}\n"));
            for l in self.overlays.get(host).into_iter().flatten() {
                out.push_str(&format!("    {l}\n"));
            }
        }
        out
    }
}

/// An entry of a unit's history, as the state file records it.
#[derive(Clone, Debug, PartialEq)]
pub struct Applied {
    /// The revision it came from (`None`: a spec file, not a commit).
    pub commit: Option<String>,
    /// `applied`, `started`, `rolled-back`, `failed`, `refused`, `hold-set`, ...
    pub outcome: String,
    /// The rendered unit's hash.
    pub sha256: String,
    /// Unix seconds.
    pub time: u64,
}

impl Applied {
    fn of(v: &Value) -> Applied {
        Applied {
            commit: v["source"]["commit"].as_str().map(String::from),
            outcome: v["outcome"].as_str().unwrap_or_default().to_string(),
            sha256: v["sha256"].as_str().unwrap_or_default().to_string(),
            time: v["time"].as_u64().unwrap_or_default(),
        }
    }

    /// The entry wrote or started the revision's unit on the host: applied, started, rolled
    /// back or failed (not a pre-flight's refusal, which changes nothing, nor a hold's record).
    pub fn tried(&self) -> bool {
        matches!(self.outcome.as_str(), "applied" | "started" | "rolled-back" | "failed")
    }
}

/// One look at a host's [`LLM`], from the machine: no process started in the box.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Seen {
    /// The server answers `/health` with 200 on the host's port.
    pub serving: bool,
    /// An apply is in progress (the state file's `in_progress`).
    pub applying: bool,
    /// The revision whose unit runs, verified: the desired commit when the last good unit is
    /// the desired one, else the last good unit's commit; `None` while applying or before the
    /// first good apply.
    pub revision: Option<String>,
}

impl Seen {
    /// Not serving, or in the middle of an apply.
    pub fn unavailable(&self) -> bool {
        !self.serving || self.applying
    }

    /// Serving `commit`'s unit, no apply in progress.
    pub fn on(&self, commit: &str) -> bool {
        self.serving && !self.applying && self.revision.as_deref() == Some(commit)
    }
}

/// What the sampler needs of a host, without its box.
struct Probe {
    name: String,
    state: PathBuf,
    port: u16,
}

impl Probe {
    fn of(h: &HostBox) -> Probe {
        Probe { name: h.name().to_string(), state: h.state_path(), port: h.server_port }
    }

    fn look(&self) -> Seen {
        let serving = http(self.port, "GET", "/health", None, Duration::from_secs(1)).is_some_and(|(c, _)| c == 200);
        let st: Value =
            std::fs::read_to_string(&self.state).ok().and_then(|t| serde_json::from_str(&t).ok()).unwrap_or_default();
        let applying = !st["in_progress"].is_null();
        let good = &st["last_good"];
        let revision = if applying || good.is_null() {
            None
        } else if st["desired"]["sha256"] == good["sha256"] {
            st["desired"]["source"]["commit"].as_str().map(String::from)
        } else {
            good["source"]["commit"].as_str().map(String::from)
        };
        Seen { serving, applying, revision }
    }
}

/// Every host, every so often.
#[derive(Clone, Debug)]
pub struct Sample {
    pub at: Instant,
    pub hosts: BTreeMap<String, Seen>,
}

/// A thread sampling every host ([`Hosts::sample`]); [`Sampler::finish`] stops it and returns
/// what it saw. Dropped, it stops.
pub struct Sampler {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Vec<Sample>>>,
}

impl Sampler {
    pub fn finish(mut self) -> Timeline {
        self.stop.store(true, Ordering::SeqCst);
        let samples = self.thread.take().expect("the sampler's thread").join().expect("the sampler panicked");
        Timeline { samples }
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What a [`Sampler`] saw, oldest first.
#[derive(Clone, Debug)]
pub struct Timeline {
    pub samples: Vec<Sample>,
}

impl Timeline {
    /// The most hosts among `among` unavailable ([`Seen::unavailable`]) in one sample, and the
    /// first sample with that many.
    pub fn max_unavailable(&self, among: &[&str]) -> (usize, Option<&Sample>) {
        self.max_by(|host, s| among.contains(&host) && s.unavailable())
    }

    /// The most hosts for which `counts` holds in one sample, and the first sample with that many.
    pub fn max_by(&self, counts: impl Fn(&str, &Seen) -> bool) -> (usize, Option<&Sample>) {
        let mut best = (0, None);
        for s in &self.samples {
            let n = s.hosts.iter().filter(|(h, seen)| counts(h, seen)).count();
            if n > best.0 {
                best = (n, Some(s));
            }
        }
        best
    }

    /// When host `host` was first seen serving `commit` ([`Seen::on`]).
    pub fn first_on(&self, host: &str, commit: &str) -> Option<Instant> {
        self.samples.iter().find(|s| s.hosts.get(host).is_some_and(|x| x.on(commit))).map(|s| s.at)
    }

    /// When host `host` was first seen leaving `commit`: applying, or on another revision
    /// (the start of its change).
    pub fn first_left(&self, host: &str, commit: &str) -> Option<Instant> {
        self.samples
            .iter()
            .find(|s| {
                s.hosts.get(host).is_some_and(|x| x.applying || x.revision.as_deref().is_some_and(|r| r != commit))
            })
            .map(|s| s.at)
    }
}
