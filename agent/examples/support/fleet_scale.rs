//! The fleet at scale, on one machine (`bench fleet-scale [N...]`).
//!
//! What is real: each host's figures are served by the agent's own exporter (one `Metrics` per
//! host, all behind one HTTP listener, a path per host), scraped by a real Prometheus (one target
//! per host, its `instance` the host's name); the promoter (`specd promote`) and `specd fleet
//! status` are the `specd` binary, run as a CI job runs them, against that Prometheus and a bare
//! git repository on disk (`file://`).
//!
//! As root, one host is a real agent: the canary's first, `specd run` in a systemd box following
//! the same remote and record branch, the stand-in its engine, scraped by the same Prometheus.
//!
//! What is simulated: the other agents. One thread reads the promotion record for all of them;
//! each host sees it at its own poll (the agent's schedule: the first poll half to one and a
//! half intervals after the start, then every interval ±10 %) and "applies" what it gives after
//! a fixed delay: its exporter then reports the revision, the unit's hash, args verified and an
//! accept length — or, for a host told to fail, the revision quarantined with the old unit
//! running (the agent's rollback). The git load of N polling agents is one agent's poll (an
//! `ls-remote`, and the fetches of what moved), timed against the same remote, times N.
//!
//! The clock: by default a fleet's times 15 times fast (a 15 s scrape 1 s, a 60 s poll 4 s, an
//! apply of 2.5 min 10 s, a bake of 7.5 min 30 s), so the ratios are an operator's.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail, ensure};
use specd::parts::daemon::{Metrics, SyncStatus, UnitFigures};
use specd_spec::fleet::{ParsedFleet, Record, RolloutState};

const LLM: &str = "llm.service";
const RECORD_BRANCH: &str = "refs/heads/specd-promotions";
const JOB: &str = "specd";
/// The watching promoter's `--interval` (30 s) on the bench's clock (a second for 15).
const IDLE: Duration = Duration::from_secs(2);

/// The simulation's knobs.
#[derive(Clone, Debug)]
pub struct Params {
    pub hosts: usize,
    /// How long a host takes to apply a revision it is given.
    pub apply: Duration,
    pub bake_s: u64,
    pub scrape_s: u64,
    /// How often an agent polls the remote (the record branch with it): each host's first poll
    /// anywhere from half to one and a half of it after the start, then every poll ±10 %, as
    /// the agent's own schedule. Zero: every host sees each record at once.
    pub poll: Duration,
    /// The fraction of hosts whose apply of the rollout's target fails (0: none).
    pub fail_rate: f64,
    /// The canary's first host a real agent (`specd run` in a systemd box; root only).
    pub real_agent: bool,
    /// The simulated agents answer `POST /poll` (the promoter's wake-up) as the agent does: a
    /// poll now, or a second after the last one. Off: they poll at their interval only.
    pub wake: bool,
    /// The promoter's bound on each question to Prometheus (`--prometheus-timeout`; its
    /// default when `None`).
    pub ask_within: Option<f64>,
}

/// The waves: a canary of 1 %, then 9 %, then the rest; `max_unavailable` 5 % of the fleet.
fn waves(n: usize) -> Vec<(&'static str, usize)> {
    let canary = n.div_ceil(100);
    let early = (n * 9 / 100).max(1);
    vec![("canary", canary), ("early", early), ("rest", n - canary - early)]
}

fn max_unavailable(n: usize) -> usize {
    (n * 5).div_ceil(100)
}

struct Host {
    name: String,
    ring: &'static str,
    /// A real agent's host: its own exporter, scraped where it listens; not simulated.
    real: Option<u16>,
    metrics: Metrics,
    run: Mutex<Run>,
}

#[derive(Default)]
struct Run {
    /// The revision its agent deploys now (applied or failed), and the unit that runs.
    rev: String,
    unit: (String, String),
    pending: Option<(String, Instant)>,
    /// The revision the record gave it at its last poll, and when it polls next.
    seen: Option<String>,
    next_poll: Option<Instant>,
    polled: Option<Instant>,
    /// A revision whose apply fails on this host.
    fails_on: Option<String>,
}

impl Host {
    /// What its agent's exporter says after deploying `rev` (the unit `hash`), or failing to.
    fn report(&self, run: &mut Run, rev: &str, hash: &str) {
        let failed = run.fails_on.as_deref() == Some(rev);
        if !failed {
            run.unit = (rev.to_string(), hash.to_string());
        }
        run.rev = rev.to_string();
        let m = &self.metrics;
        m.source_read();
        m.source_reached(now());
        m.source_revision(rev);
        m.reconciled(LLM, if failed { SyncStatus::Failed } else { SyncStatus::InSync }, "applied", 0.8, failed);
        m.down(LLM, false);
        m.hold(LLM, None);
        let figures = UnitFigures {
            deployed: Some(run.unit.clone()),
            args_verified: Some(true),
            accept_length: Some(2.4),
            accept_rate: Some(0.7),
            quarantined: failed,
            startup: None,
        };
        m.unit(LLM, &figures);
    }
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs()
}

impl Run {
    /// A wake-up at `now`: the next poll now, or a second after the last (as the agent's).
    fn wake(&mut self, now: Instant) {
        let earliest = self.polled.map_or(now, |p| (p + Duration::from_secs(1)).max(now));
        self.next_poll = Some(self.next_poll.map_or(earliest, |n| n.min(earliest)));
    }
}

/// Serves every host's exporter on one port: `/h/<i>/metrics`, and with `wake` its wake-up,
/// `POST /h/<i>/poll`.
fn serve(hosts: Arc<Vec<Host>>, wake: bool) -> Result<u16> {
    use axum::response::IntoResponse;
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    listener.set_nonblocking(true)?;
    let port = listener.local_addr()?.port();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(async move {
            let l = tokio::net::TcpListener::from_std(listener).unwrap();
            let woken = hosts.clone();
            let page = move |axum::extract::Path(i): axum::extract::Path<usize>| {
                let hosts = hosts.clone();
                async move {
                    match hosts.get(i) {
                        Some(h) => ([(axum::http::header::CONTENT_TYPE, Metrics::CONTENT_TYPE)], h.metrics.render())
                            .into_response(),
                        None => axum::http::StatusCode::NOT_FOUND.into_response(),
                    }
                }
            };
            let poll = move |axum::extract::Path(i): axum::extract::Path<usize>| {
                let hosts = woken.clone();
                async move {
                    match hosts.get(i) {
                        Some(h) => {
                            h.run.lock().unwrap().wake(Instant::now());
                            axum::http::StatusCode::ACCEPTED
                        }
                        None => axum::http::StatusCode::NOT_FOUND,
                    }
                }
            };
            let mut app = axum::Router::new().route("/h/{i}/metrics", axum::routing::get(page));
            if wake {
                app = app.route("/h/{i}/poll", axum::routing::post(poll));
            }
            axum::serve(l, app).await.unwrap();
        });
    });
    Ok(port)
}

fn prometheus_config(hosts: &[Host], port: u16, scrape_s: u64) -> String {
    let mut c = format!(
        "global: {{scrape_interval: {scrape_s}s, scrape_timeout: {scrape_s}s}}\nscrape_configs:\n  - job_name: {JOB}\n    static_configs:\n"
    );
    for (i, h) in hosts.iter().enumerate() {
        let (port, path) = match h.real {
            Some(p) => (p, "/metrics".to_string()),
            None => (port, format!("/h/{i}/metrics")),
        };
        c.push_str(&format!(
            "      - {{targets: ['127.0.0.1:{port}'], labels: {{__metrics_path__: {path}, instance: {}}}}}\n",
            h.name
        ));
    }
    c
}

fn git(dir: &Path, args: &[&str]) -> Result<String> {
    let o = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(["-c", "user.name=Fleet", "-c", "user.email=fleet@fleet.test", "-c", "commit.gpgSign=false"])
        .args(args)
        .output()?;
    ensure!(o.status.success(), "git {args:?}: {}", String::from_utf8_lossy(&o.stderr));
    Ok(String::from_utf8(o.stdout)?.trim().to_string())
}

/// The engine: the stand-in (the real agent starts it), on one port for every host.
fn llm_spec(engine: &(String, u16), steps: u32) -> String {
    specd_e2e::sglang_spec(&engine.0, LLM, engine.1, steps, "")
}

/// Whether a systemd box can boot here (root); if not, says why the bench runs without a real agent.
fn can_box() -> bool {
    match specd_e2e::systemd_box::preflight() {
        Ok(()) => true,
        Err(e) => {
            println!("(no real agent among the simulated hosts: {e:#})");
            false
        }
    }
}

/// The real agent's box: `specd run` as a unit, its config in `/run/agent.yaml`.
fn real_agent(dir: &Path, remote: &Path, host: &Host, poll: Duration) -> Result<specd_e2e::SystemdBox> {
    let b = specd_e2e::SystemdBox::boot_with(specd_e2e::BoxConfig {
        binds: vec![dir.to_path_buf()],
        ..Default::default()
    })?;
    let listen = host.real.context("a real host")?;
    let config = format!(
        "repo: file://{}\npath: specs\nhostname: {}\ninterval: {}\nlisten: 127.0.0.1:{listen}\nlabels: {{ring: {}}}\n",
        remote.display(),
        host.name,
        poll.as_secs().max(1),
        host.ring
    );
    b.write_file("/run/agent.yaml", config)?;
    let unit = format!("[Service]\nType=notify\nExecStart={} run --config /run/agent.yaml\n", crate::specd_bin());
    b.write_file("/etc/systemd/system/specd-agent.service", unit)?;
    b.systemctl_check(&["daemon-reload"])?;
    b.systemctl_check(&["start", "specd-agent.service"])?;
    Ok(b)
}

fn fleet_file(n: usize, bake_s: u64) -> String {
    let mut f = String::from("apiVersion: specd/v1\nkind: Fleet\nmetadata: {name: sim}\nspec:\n  waves:\n");
    for (ring, _) in waves(n) {
        f.push_str(&format!(
            "    - {{name: {ring}, labels: {{ring: {ring}}}, max_unavailable: {}, bake: {bake_s}s}}\n",
            max_unavailable(n)
        ));
    }
    f
}

/// The unit hash specd renders for `text` (the same on every host: no overlay).
fn unit_hash(text: &str) -> Result<String> {
    let parsed = specd_spec::parse("llm.yaml", text).map_err(|d| anyhow::anyhow!("{d}"))?;
    let spec = parsed.resolve(Some("h0000")).map_err(|d| anyhow::anyhow!("{d}"))?;
    Ok(specd_spec::render(&spec).sha256)
}

/// One pass of the promoter: wrote a step or waited, its time, the queries it asked.
#[derive(Clone, Debug)]
pub struct Pass {
    pub wrote: bool,
    /// A wait that says a host is on its way, and a wait's end if known (unix seconds).
    pub soon: bool,
    pub until: Option<u64>,
    pub secs: f64,
    pub queries: u64,
    pub said: String,
    /// The agents a step woke: answered, asked.
    pub woken: (u64, u64),
}

/// One `fleet status`: time, exit code, output bytes (text and JSON).
#[derive(Clone, Debug, Default)]
pub struct StatusLook {
    pub secs: f64,
    pub code: i32,
    pub text_bytes: usize,
    pub json_bytes: usize,
    pub text: String,
}

pub struct Sim {
    pub p: Params,
    /// The real agent's box, if it runs (gone before the directory it binds).
    real: Option<specd_e2e::SystemdBox>,
    dir: tempfile::TempDir,
    hosts: Arc<Vec<Host>>,
    prom: specd_e2e::Prometheus,
    remote: PathBuf,
    work: PathBuf,
    hashes: Arc<Mutex<BTreeMap<String, String>>>,
    engine: (String, u16),
    stop: Arc<AtomicBool>,
    agents: Option<std::thread::JoinHandle<Result<()>>>,
    pub passes: Vec<Pass>,
    /// Prometheus's CPU seconds when the simulation started.
    prom_cpu0: f64,
    t0: Instant,
}

impl Sim {
    /// The hosts on the first revision, scraped; the repository with its fleet file; the
    /// simulated agents following the record.
    pub fn start(p: Params) -> Result<Sim> {
        let dir = tempfile::tempdir()?;
        let real = p.real_agent && can_box();
        let mut hosts = Vec::new();
        for (ring, count) in waves(p.hosts) {
            for _ in 0..count {
                let name = format!("h{:04}", hosts.len());
                let metrics = Metrics::new(env!("CARGO_PKG_VERSION"));
                metrics.host_info(&name, &BTreeMap::from([("ring".to_string(), ring.to_string())]));
                metrics.schedule(Some(Duration::from_secs(60)), Some(Duration::from_secs(600)));
                let real = (real && hosts.is_empty()).then(specd_e2e::free_port);
                hosts.push(Host { name, ring, real, metrics, run: Mutex::default() });
            }
        }
        let (remote, work) = (dir.path().join("remote.git"), dir.path().join("work"));
        std::fs::create_dir_all(work.join("specs"))?;
        git(dir.path(), &["init", "-q", "--bare", "-b", "main", remote.to_str().unwrap()])?;
        git(&work, &["init", "-q", "-b", "main"])?;
        std::fs::write(work.join("specs/fleet.yaml"), fleet_file(p.hosts, p.bake_s))?;
        let standin =
            if real { specd_e2e::bin_path("specd-standin").display().to_string() } else { "/opt/sglang".into() };
        let engine = (standin, specd_e2e::free_port());
        let text = llm_spec(&engine, 3);
        std::fs::write(work.join("specs/llm.yaml"), &text)?;
        git(&work, &["add", "-A"])?;
        git(&work, &["commit", "-q", "-m", "llm: steps 3"])?;
        git(&work, &["push", "-q", remote.to_str().unwrap(), "main"])?;
        let c1 = git(&work, &["rev-parse", "HEAD"])?;
        let h1 = unit_hash(&text)?;
        for h in hosts.iter().filter(|h| h.real.is_none()) {
            let mut run = h.run.lock().unwrap();
            h.report(&mut run, &c1, &h1);
        }
        let real = match hosts.first().filter(|h| h.real.is_some()) {
            Some(h) => Some(real_agent(dir.path(), &remote, h, p.poll)?),
            None => None,
        };
        let hosts = Arc::new(hosts);
        let port = serve(hosts.clone(), p.wake)?;
        // Prometheus's lookback delta on the bench's clock: 5 minutes at a 15 s scrape.
        let lookback = format!("--query.lookback-delta={}s", 20 * p.scrape_s);
        let config = prometheus_config(&hosts, port, p.scrape_s);
        let prom = specd_e2e::Prometheus::start_with(&dir.path().join("prometheus"), &config, &[&lookback])?;
        let mut sim = Sim {
            p,
            real,
            dir,
            hosts,
            prom,
            remote,
            work,
            hashes: Arc::new(Mutex::new(BTreeMap::from([(c1, h1)]))),
            engine,
            stop: Arc::new(AtomicBool::new(false)),
            agents: None,
            passes: Vec::new(),
            prom_cpu0: 0.0,
            t0: Instant::now(),
        };
        sim.wait_scraped()?;
        sim.wait_lookback()?;
        sim.prom_cpu0 = sim.prom_figure("process_cpu_seconds_total");
        sim.t0 = Instant::now();
        sim.agents = Some(sim.spawn_agents()?);
        Ok(sim)
    }

    /// Until Prometheus has scraped every host once.
    fn wait_scraped(&self) -> Result<()> {
        let n = self.hosts.len() as f64;
        let q = format!("count(specd_host_info{{job=\"{JOB}\"}})");
        specd_e2e::wait_until("every host scraped", Duration::from_secs(120), || {
            self.prom.query(&q).first().is_some_and(|(_, v)| *v == n)
        })
    }

    /// Until Prometheus has run for longer than its lookback delta, as a fleet's has: the
    /// promoter then asks each figure as it is (compared with its target's last scrape in the
    /// lookback delta after a start).
    fn wait_lookback(&self) -> Result<()> {
        let p = specd::parts::fleet::Prometheus::new(&self.prom.url(), None)?;
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let until = rt.block_on(p.unmarked_until()).map_err(anyhow::Error::msg)?;
        let now = || SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or_default();
        let within = Duration::from_secs_f64((until - now()).max(0.0) + 60.0);
        specd_e2e::wait_until("Prometheus older than its lookback delta", within, || now() > until)
    }

    fn spawn_agents(&self) -> Result<std::thread::JoinHandle<Result<()>>> {
        let text = std::fs::read_to_string(self.work.join("specs/fleet.yaml"))?;
        let fleet = specd_spec::fleet::parse_fleet(&text, "fleet.yaml").map_err(|d| anyhow::anyhow!("{d}"))?;
        let (hosts, hashes, stop, remote, p) =
            (self.hosts.clone(), self.hashes.clone(), self.stop.clone(), self.remote.clone(), self.p.clone());
        Ok(std::thread::spawn(move || agents(&hosts, &fleet, &hashes, &stop, &remote, &p)))
    }

    pub fn hosts(&self) -> usize {
        self.hosts.len()
    }

    /// A new revision of the spec (`steps`) pushed; its commit. `fail` hosts (by index) fail it.
    pub fn push(&self, steps: u32, fail: &[usize]) -> Result<String> {
        let text = llm_spec(&self.engine, steps);
        std::fs::write(self.work.join("specs/llm.yaml"), &text)?;
        git(&self.work, &["commit", "-q", "-am", &format!("llm: steps {steps}")])?;
        let c = git(&self.work, &["rev-parse", "HEAD"])?;
        self.hashes.lock().unwrap().insert(c.clone(), unit_hash(&text)?);
        let rate = self.p.fail_rate;
        for (i, h) in self.hosts.iter().enumerate() {
            // A fixed spread of failures: every host whose index falls on the rate's stride.
            let by_rate = rate > 0.0 && ((i as f64 * rate).floor() != ((i + 1) as f64 * rate).floor());
            h.run.lock().unwrap().fails_on = (fail.contains(&i) || by_rate).then(|| c.clone());
        }
        git(&self.work, &["push", "-q", self.remote.to_str().unwrap(), "main"])?;
        Ok(c)
    }

    fn specd(&self, state: &str, args: &[&str]) -> Command {
        let mut c = Command::new(crate::specd_bin());
        c.arg("--state-dir")
            .arg(self.dir.path().join(state))
            .args(args)
            .args(["--config", "/nonexistent/agent.yaml", "--repo", &format!("file://{}", self.remote.display())])
            .args(["--path", "specs", "--prometheus", &self.prom.url(), "--author", "Fleet CI <ci@fleet.test>"]);
        if let Some(s) = self.p.ask_within {
            c.args(["--prometheus-timeout", &s.to_string()]);
        }
        c
    }

    /// Prometheus's own `/metrics` (a loaded Prometheus may take seconds to answer).
    fn prom_metrics(&self) -> String {
        specd_e2e::http(self.prom.port(), "GET", "/metrics", None, Duration::from_secs(60))
            .map(|(_, body)| body)
            .unwrap_or_else(|| panic!("Prometheus's /metrics: no answer within 60 s\n{}", self.prom.log()))
    }

    /// A figure of Prometheus's own `/metrics` (summed over its series).
    fn prom_figure(&self, name: &str) -> f64 {
        let body = self.prom_metrics();
        body.lines()
            .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// The instant queries Prometheus answered so far.
    fn queries(&self) -> u64 {
        let body = self.prom_metrics();
        body.lines()
            .filter(|l| l.starts_with("prometheus_http_requests_total{") && l.contains("handler=\"/api/v1/query\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64
    }

    /// One pass of `specd promote --json`.
    pub fn promote(&mut self) -> Result<Pass> {
        let q0 = self.queries();
        let t = Instant::now();
        let o = self.specd("promoter", &["promote", "--json"]).output()?;
        let secs = t.elapsed().as_secs_f64();
        ensure!(o.status.success(), "specd promote: {}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).context("specd promote's JSON")?;
        let wrote = v.get("wrote").is_some();
        let said = v.get("message").or(v.get("waits")).and_then(|m| m.as_str()).unwrap_or_default().to_string();
        let (soon, until) = (v["soon"].as_bool() == Some(true), v["until"].as_u64());
        let woken = (v["woken"]["answered"].as_u64().unwrap_or(0), v["woken"]["asked"].as_u64().unwrap_or(0));
        let pass = Pass { wrote, soon, until, secs, queries: self.queries() - q0, said, woken };
        self.passes.push(pass.clone());
        Ok(pass)
    }

    /// Passes of the promoter until the record satisfies `done`, within `within`, as
    /// `specd promote --watch` makes them: at once after a write, a second after the last one
    /// started while a host is on its way (`soon`), at a bake's end, else after `IDLE`.
    /// (One process a pass: a watching promoter would keep its clone's state between them.)
    pub fn promote_until(&mut self, what: &str, within: Duration, done: impl Fn(&Record) -> bool) -> Result<Record> {
        let t = Instant::now();
        loop {
            let p = self.promote()?;
            if let Some(r) = self.record()?
                && done(&r)
            {
                return Ok(r);
            }
            if t.elapsed() > within {
                bail!("{what}: not within {within:?}; the promoter said: {}", p.said);
            }
            let started = Duration::from_secs_f64(p.secs);
            let pause = match p.until {
                _ if p.wrote => Duration::ZERO,
                Some(t) => Duration::from_secs(t.saturating_sub(now())).min(IDLE),
                None if p.soon => specd::parts::fleet::SOON.saturating_sub(started),
                None => IDLE,
            };
            std::thread::sleep(pause);
        }
    }

    /// The record on the remote, as an agent reads it.
    pub fn record(&self) -> Result<Option<Record>> {
        Ok(read_record(&git2::Repository::open_bare(&self.remote)?)?.map(|(_, r)| r))
    }

    /// The record branch's commits, oldest first: each one's record text.
    pub fn record_texts(&self) -> Result<Vec<String>> {
        let list = git(&self.remote, &["rev-list", "--reverse", RECORD_BRANCH])?;
        list.lines().map(|c| git(&self.remote, &["show", &format!("{c}:promotions.yaml")])).collect()
    }

    /// `specd fleet status` (text and `--json`) with `extra` arguments.
    pub fn status(&self, extra: &[&str]) -> Result<StatusLook> {
        let mut args = vec!["fleet", "status"];
        args.extend_from_slice(extra);
        let t = Instant::now();
        let o = self.specd("fleet-cli", &args).output()?;
        let secs = t.elapsed().as_secs_f64();
        let code = o.status.code().unwrap_or(-1);
        ensure!(code == 0 || code == 1, "specd fleet status: {}", String::from_utf8_lossy(&o.stderr));
        args.push("--json");
        let j = self.specd("fleet-cli", &args).output()?;
        let text = String::from_utf8_lossy(&o.stdout).to_string();
        Ok(StatusLook { secs, code, text_bytes: o.stdout.len(), json_bytes: j.stdout.len(), text })
    }

    /// The hosts of `ring`, by index.
    pub fn ring(&self, ring: &str) -> Vec<usize> {
        (0..self.hosts.len()).filter(|i| self.hosts[*i].ring == ring).collect()
    }

    pub fn name(&self, i: usize) -> &str {
        &self.hosts[i].name
    }

    /// The revision host `i`'s agent deploys now.
    pub fn runs(&self, i: usize) -> String {
        self.hosts[i].run.lock().unwrap().rev.clone()
    }

    /// The unit hash of the real agent's host as Prometheus has it, once it is `rev`'s (within
    /// `within`); `None` without a real agent.
    fn real_runs(&self, rev: &str, within: Duration) -> Result<Option<String>> {
        let Some(h) = self.hosts.iter().find(|h| h.real.is_some()) else { return Ok(None) };
        let want = self.hashes.lock().unwrap().get(rev).cloned().context("a revision the bench pushed")?;
        let q = format!("specd_unit_info{{instance=\"{}\", unit=\"{LLM}\"}}", h.name);
        let runs = || self.prom.query(&q).first().and_then(|(m, _)| m["unit_hash"].as_str().map(str::to_string));
        let what = format!("the real agent {} runs the unit of {}", h.name, specd_spec::short(rev));
        specd_e2e::wait_until(&what, within, || runs().as_deref() == Some(want.as_str()))
            .with_context(|| format!("it runs {:?}; its journal:\n{}", runs(), self.real_journal()))?;
        Ok(Some(want))
    }

    fn real_journal(&self) -> String {
        self.real.as_ref().and_then(|b| b.journal("specd-agent.service").ok()).unwrap_or_default()
    }

    /// Series per host, scrape time per host (s), samples per scrape.
    pub fn scrape_figures(&self) -> (f64, f64, f64) {
        let one = |q: &str| self.prom.query(q).first().map_or(f64::NAN, |(_, v)| *v);
        let n = self.hosts.len() as f64;
        let series = one(&format!("count({{job=\"{JOB}\"}})")) / n;
        let secs = one(&format!("avg(scrape_duration_seconds{{job=\"{JOB}\"}})"));
        let samples = one(&format!("avg(scrape_samples_scraped{{job=\"{JOB}\"}})"));
        (series, secs, samples)
    }

    /// Prometheus's resident memory (MB) and its CPU use since the start (cores).
    pub fn prometheus_cost(&self) -> (f64, f64) {
        let rss = self.prom_figure("process_resident_memory_bytes") / 1e6;
        let cpu = (self.prom_figure("process_cpu_seconds_total") - self.prom_cpu0) / self.t0.elapsed().as_secs_f64();
        (rss, cpu)
    }

    /// One agent's poll against the remote, timed (ms, median of `runs`): the two fetches (the
    /// followed branch and the record branch) it makes when both moved, and the one
    /// `git ls-remote` of both it makes first (all it makes when nothing moved).
    pub fn poll_cost(&self, runs: usize) -> Result<(f64, f64)> {
        let clone = self.dir.path().join("agent-clone");
        let url = format!("file://{}", self.remote.display());
        git(self.dir.path(), &["init", "-q", "--bare", clone.to_str().unwrap()])?;
        let fetch = |r: &str| git(&clone, &["fetch", "-q", "--no-tags", &url, &format!("+refs/heads/{r}:refs/x/{r}")]);
        let (mut fetches, mut ls) = (Vec::new(), Vec::new());
        for _ in 0..runs {
            let t = Instant::now();
            fetch("main")?;
            fetch("specd-promotions")?;
            fetches.push(t.elapsed().as_secs_f64() * 1000.0);
            let t = Instant::now();
            git(&clone, &["ls-remote", &url, "refs/heads/main", RECORD_BRANCH])?;
            ls.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        Ok((crate::median(&mut fetches), crate::median(&mut ls)))
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(a) = self.agents.take()
            && let Err(e) = a.join().unwrap()
        {
            eprintln!("the simulated agents stopped: {e:#}");
        }
    }
}

fn read_record(repo: &git2::Repository) -> Result<Option<(git2::Oid, Record)>> {
    let Ok(r) = repo.find_reference(RECORD_BRANCH) else { return Ok(None) };
    let c = r.peel_to_commit()?;
    let blob = c.tree()?.get_path(Path::new("promotions.yaml"))?.to_object(repo)?;
    let text = std::str::from_utf8(blob.as_blob().context("promotions.yaml is a file")?.content())?;
    let rec = Record::parse(text, "promotions.yaml").map_err(|d| anyhow::anyhow!("{d}"))?;
    Ok(Some((c.id(), rec)))
}

/// A fraction in [0, 1) drawn from `seed` (splitmix64): the agents' jitter, the same each run.
fn draw(seed: &mut u64) -> f64 {
    *seed = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *seed;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
}

/// The simulated agents: every 50 ms, the record (when it moved), each host's poll that is due
/// (what the record gives it) and its due applies.
fn agents(
    hosts: &[Host],
    fleet: &ParsedFleet,
    hashes: &Mutex<BTreeMap<String, String>>,
    stop: &AtomicBool,
    remote: &Path,
    p: &Params,
) -> Result<()> {
    let repo = git2::Repository::open_bare(remote)?;
    let mut record: Option<(git2::Oid, Record)> = None;
    let (start, mut seed) = (Instant::now(), 7u64);
    while !stop.load(Ordering::Relaxed) {
        // Read (and parsed) only when it moved.
        let head = repo.find_reference(RECORD_BRANCH).ok().and_then(|r| r.target());
        if head.is_some() && record.as_ref().map(|(o, _)| *o) != head {
            record = read_record(&repo)?;
        }
        let now = Instant::now();
        for h in hosts.iter().filter(|h| h.real.is_none()) {
            let Some((_, r)) = &record else { break };
            let mut run = h.run.lock().unwrap();
            let next = *run.next_poll.get_or_insert_with(|| start + p.poll.mul_f64(0.5 + draw(&mut seed)));
            if run.seen.is_none() || next <= now {
                let labels = BTreeMap::from([("ring".to_string(), h.ring.to_string())]);
                run.seen = Some(r.revision_for(fleet, &h.name, &labels).map_err(anyhow::Error::msg)?.revision);
                if next <= now {
                    run.next_poll = Some(now + p.poll.mul_f64(0.9 + 0.2 * draw(&mut seed)));
                    run.polled = Some(now);
                }
            }
            let want = run.seen.clone().unwrap_or_default();
            let apply = p.apply;
            if run.rev != want && run.pending.as_ref().is_none_or(|(p, _)| *p != want) {
                run.pending = Some((want, now + apply));
            } else if run.rev == want {
                run.pending = None;
            }
            if let Some((rev, at)) = run.pending.clone()
                && at <= now
            {
                let hash = hashes.lock().unwrap().get(&rev).cloned().context("a revision the bench pushed")?;
                h.report(&mut run, &rev, &hash);
                run.pending = None;
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// What one simulated rollout measured.
pub struct Measured {
    pub hosts: usize,
    pub release_s: f64,
    pub floor_s: f64,
    pub floor_budget_s: f64,
    pub rounds: usize,
    pub steps: Vec<Pass>,
    pub waits: Vec<Pass>,
    pub commits: usize,
    pub record_max: usize,
    pub record_end: usize,
    pub status: StatusLook,
    pub status_host: StatusLook,
    pub scrape: (f64, f64, f64),
    pub prom: (f64, f64),
    pub poll_ms: (f64, f64),
    /// The real agent's unit hash before and after the rollout.
    pub real: Option<(String, String)>,
}

/// The floor of a rollout: every wave's bake and one apply; and with `max_unavailable` hosts
/// applying at a time, each wave's bake and its rounds of applies.
/// Also the rounds.
fn floors(p: &Params) -> (f64, f64, usize) {
    let waves = waves(p.hosts);
    let apply = p.apply.as_secs_f64();
    let bakes = (p.bake_s * waves.len() as u64) as f64;
    let rounds: usize = waves.iter().map(|(_, n)| n.div_ceil(max_unavailable(p.hosts))).sum();
    (bakes + apply * waves.len() as f64, bakes + apply * rounds as f64, rounds)
}

impl Sim {
    /// The adoption of the first revision, then one rollout of a new one to its release.
    pub fn rollout(&mut self) -> Result<Measured> {
        let first = self.promote_until("the first record", Duration::from_secs(60), |_| true)?;
        let real_before = self.real_runs(&first.released, Duration::from_secs(120))?;
        let first_pass = self.passes.len();
        let c2 = self.push(5, &[])?;
        let t = Instant::now();
        let within = Duration::from_secs(600);
        let last = self.ring("rest").len();
        let rest = move |r: &Record| r.wave("rest").is_some_and(|w| w.promoted.len() * 2 >= last);
        let half = self.promote_until("half of the last wave promoted", within, |r| r.target == c2 && rest(r))?;
        ensure!(half.state == RolloutState::Progressing, "{half:?}");
        let status = self.status(&[])?;
        let status_host = self.status(&["--host", self.name(self.ring("rest")[0])]).unwrap_or_default();
        let released = |r: &Record| r.released == c2 && r.state == RolloutState::Complete;
        self.promote_until("the release", within, released)?;
        let release_s = t.elapsed().as_secs_f64();
        // The canary waited for the real agent: it runs the target's unit, applied for real.
        let real = real_before.zip(self.real_runs(&c2, Duration::ZERO)?);
        let texts = self.record_texts()?;
        let passes = self.passes[first_pass..].to_vec();
        let (floor_s, floor_budget_s, rounds) = floors(&self.p);
        Ok(Measured {
            hosts: self.hosts(),
            release_s,
            floor_s,
            floor_budget_s,
            rounds,
            steps: passes.iter().filter(|p| p.wrote).cloned().collect(),
            waits: passes.iter().filter(|p| !p.wrote).cloned().collect(),
            commits: texts.len() - 1,
            record_max: texts.iter().map(String::len).max().unwrap_or(0),
            record_end: texts.last().map_or(0, String::len),
            status,
            status_host,
            scrape: self.scrape_figures(),
            prom: self.prometheus_cost(),
            poll_ms: self.poll_cost(10)?,
            real,
        })
    }

    /// A revision that one host of the last wave fails: the rollout halts naming it and the
    /// gate, and the wave's hosts go back within `max_unavailable`. The halt's time from the
    /// push, and the time to every host back.
    pub fn halt(&mut self) -> Result<Halted> {
        let rest = self.ring("rest");
        let bad = rest[2];
        let good = self.record()?.context("a record")?.released;
        let c3 = self.push(7, &[bad])?;
        let t = Instant::now();
        let within = Duration::from_secs(600);
        let halted = self.promote_until("the halt", within, |r| r.target == c3 && r.state == RolloutState::Halted)?;
        let halt_s = t.elapsed().as_secs_f64();
        let h = halted.halt.clone().context("a halt")?;
        ensure!(h.host == self.name(bad) && h.gate == "applied" && h.wave == "rest", "the halt: {h:?}");
        let before = self.record_texts()?.len();
        self.promote_until("every host sent back", within, |r| r.wave("rest").is_some_and(|w| w.promoted.is_empty()))?;
        // Each send-back step sends at most max_unavailable hosts back.
        let texts = self.record_texts()?;
        let most = max_unavailable(self.hosts());
        for pair in texts[before - 1..].windows(2) {
            let count = |t: &str| Record::parse(t, "r").map(|r| r.wave("rest").map_or(0, |w| w.promoted.len()));
            let (a, b) = (count(&pair[0]).unwrap_or(0), count(&pair[1]).unwrap_or(0));
            ensure!(a.saturating_sub(b) <= most, "a step sent {} hosts back, over max_unavailable {most}", a - b);
        }
        specd_e2e::wait_until("every host back on the released revision", within, || {
            rest.iter().all(|i| self.runs(*i) == good)
        })?;
        let back_s = t.elapsed().as_secs_f64();
        let status = self.status(&[])?;
        ensure!(status.code == 1, "fleet status of a halted rollout exits 1");
        let named = status.text.lines().find(|l| l.contains("failed gate")).unwrap_or_default().to_string();
        ensure!(named.contains(self.name(bad)), "fleet status names the host: {}", status.text);
        Ok((halt_s, back_s, named))
    }
}

/// `bench fleet-scale [N...]`: the table, one row per host count.
pub fn bench(counts: &[usize], p: &Params) -> Result<()> {
    println!(
        "\n## Fleet at scale: N simulated hosts, 3 waves (1 %, 9 %, the rest), max_unavailable 5 % of the fleet, bakes of {} s, apply {} ms, scraped every {} s, agents poll every {} ms{}\n",
        p.bake_s,
        p.apply.as_millis(),
        p.scrape_s,
        p.poll.as_millis(),
        if p.wake { ", woken by the promoter's steps" } else { " (not woken: --no-wake)" }
    );
    let mut rows = Vec::new();
    for &n in counts {
        let mut sim = Sim::start(Params { hosts: n, ..p.clone() })?;
        let m = sim.rollout()?;
        let halt = sim.halt()?;
        rows.push((m, halt));
    }
    print_table(&rows);
    Ok(())
}

/// The halt: push to halt (s), every host back (s), what `fleet status` says of it.
type Halted = (f64, f64, String);
/// One figure of a row.
type Figure<'a> = &'a dyn Fn(&Measured, &Halted) -> String;

fn print_table(rows: &[(Measured, Halted)]) {
    let col = |f: Figure| -> String { rows.iter().map(|(m, h)| f(m, h)).collect::<Vec<_>>().join(" | ") };
    let hdr = col(&|m, _| format!("{} hosts", m.hosts));
    println!("| figure | {hdr} |");
    println!("|---|{}", "---|".repeat(rows.len()));
    let line = |what: &str, f: Figure| {
        println!("| {what} | {} |", col(f));
    };
    line("commit to release (s)", &|m, _| format!("{:.1}", m.release_s));
    line("floor: bakes + 1 apply per wave (s)", &|m, _| format!("{:.1} ({:.2}×)", m.floor_s, m.release_s / m.floor_s));
    line("floor with max_unavailable's rounds (s)", &|m, _| {
        format!("{:.1} ({:.2}×)", m.floor_budget_s, m.release_s / m.floor_budget_s)
    });
    line("beyond that floor, per round (s)", &|m, _| {
        format!("{:.2} ({} rounds)", (m.release_s - m.floor_budget_s) / m.rounds as f64, m.rounds)
    });
    line("record commits (steps written)", &|m, _| format!("{}", m.commits));
    line("promote step: median / max (s)", &|m, _| {
        let mut s: Vec<f64> = m.steps.iter().map(|p| p.secs).collect();
        format!("{:.2} / {:.2}", crate::median(&mut s), crate::pct(&mut s, 1.0))
    });
    line("promote pass that waits: median (s)", &|m, _| {
        let mut s: Vec<f64> = m.waits.iter().map(|p| p.secs).collect();
        if s.is_empty() { "-".into() } else { format!("{:.2}", crate::median(&mut s)) }
    });
    line("Prometheus queries per pass: min / max", &|m, _| {
        let q: Vec<u64> = m.steps.iter().chain(&m.waits).map(|p| p.queries).collect();
        format!("{} / {}", q.iter().min().unwrap_or(&0), q.iter().max().unwrap_or(&0))
    });
    line("agents woken by the steps: answered / asked", &|m, _| {
        let (a, b) = m.steps.iter().fold((0, 0), |(a, b), p| (a + p.woken.0, b + p.woken.1));
        format!("{a} / {b}")
    });
    line("record size: largest / released (KB)", &|m, _| {
        format!("{:.1} / {:.1}", m.record_max as f64 / 1024.0, m.record_end as f64 / 1024.0)
    });
    line("fleet status mid-rollout: time (s)", &|m, _| format!("{:.2}", m.status.secs));
    line("fleet status: text / JSON (KB)", &|m, _| {
        format!("{:.1} / {:.1}", m.status.text_bytes as f64 / 1024.0, m.status.json_bytes as f64 / 1024.0)
    });
    line("fleet status --host: time (s), text (KB)", &|m, _| {
        format!("{:.2}, {:.1}", m.status_host.secs, m.status_host.text_bytes as f64 / 1024.0)
    });
    line("series per host; samples per scrape", &|m, _| format!("{:.0}; {:.0}", m.scrape.0, m.scrape.2));
    line("scrape time per host (ms)", &|m, _| format!("{:.2}", m.scrape.1 * 1000.0));
    line("Prometheus: RSS (MB), CPU (cores)", &|m, _| format!("{:.0}, {:.2}", m.prom.0, m.prom.1));
    line("one agent's poll: nothing new (ls-remote) / both refs moved (+ 2 fetches) (ms)", &|m, _| {
        format!("{:.1} / {:.1}", m.poll_ms.1, m.poll_ms.1 + m.poll_ms.0)
    });
    line("git requests/min on the remote, polls every 60 s, nothing new", &|m, _| format!("{}", m.hosts));
    line("halt: push to halt / every host back (s)", &|_, h| format!("{:.1} / {:.1}", h.0, h.1));
    for (m, h) in rows {
        println!("\n{} hosts, the halt as fleet status says it: {}", m.hosts, h.2.trim());
        match &m.real {
            Some((a, b)) => println!(
                "{} hosts: the real agent h0000 (canary) ran unit {}, runs {} after the rollout",
                m.hosts,
                specd_spec::short(a),
                specd_spec::short(b)
            ),
            None => println!("{} hosts: no real agent (not root, or --no-real-agent)", m.hosts),
        }
    }
}
