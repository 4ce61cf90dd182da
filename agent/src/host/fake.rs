//! An in-memory host for the reconciler's tests: one systemd service, its processes, its unit
//! files and its server, on tokio's (paused) clock. Any call can be made to fail: the fault plan
//! names the call by its number, and what happens there (see [`Fault`]).
//!
//! The model follows what the real host does where the reconciler depends on it: a stop sends
//! SIGTERM and the process exits a moment later (or lingers); a start runs the unit systemd has
//! loaded (the file at the last daemon-reload), whose server answers 503 while it loads and 200
//! after; a process that exits takes the unit to `failed`; a unit file replaced on disk makes
//! systemd report `NeedDaemonReload=yes`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Result, anyhow, bail};
use serde_json::Value;
use specd_spec::{Engine, Spec};
use tokio::time::Instant;

use super::{Devices, Firewall, Host, Journal, LoadBalancers, Processes, Server, ServiceManager, UnitFiles, Watch};
use crate::core::serving::{CheckKind, PollLog, ServingState, Word};
use crate::core::speculation::Speculation;
use crate::core::unit_state::{ActiveState, LoadState, UnitFileState};
use crate::machine::cgroup::Lingering;
use crate::machine::nft::NothingApplied;
use crate::machine::probe::Health;
use crate::machine::systemd::UnitProps;

/// What goes wrong at a planned call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The call fails at once (systemd refuses, a write hits a full disk, a connection is reset).
    Fails,
    /// The call hangs until its own timeout (systemctl's 25 s, an HTTP timeout), then fails.
    TimesOut,
    /// The unit's main process dies just before the call.
    ProcessDies,
    /// From this call on, processes told to stop stay in their cgroup (a process in D state).
    ProcessLingers,
    /// specd is killed at this call: the call never returns, and the test drops the reconcile.
    Crash,
    /// systemd re-executes itself (`daemon-reexec`) during this call, if it is one to systemd:
    /// the connection closes before the reply. A job or reload asked for was already taken
    /// (systemd keeps its jobs and its units' state across the re-execution); a property read
    /// answered nothing. Calls to anything but systemd go on.
    Reexec,
}

pub const FAULTS: [Fault; 6] =
    [Fault::Fails, Fault::TimesOut, Fault::ProcessDies, Fault::ProcessLingers, Fault::Crash, Fault::Reexec];

/// How long after SIGTERM a server exits.
const EXIT_AFTER_TERM: Duration = Duration::from_millis(300);
/// What a server that fails to load says last (its engine's own error).
pub const FAILED_LOAD: &str = "RuntimeError: the model could not be loaded";

/// How long a server loads before it answers 200.
pub const LOAD: Duration = Duration::from_millis(60);

#[derive(Clone, Debug)]
struct Proc {
    argv: Vec<String>,
    alive: bool,
    cgroup: String,
    ready_at: Instant,
    /// A server that fails to load exits then.
    dies_at: Option<Instant>,
    /// Told to stop: exits then (unless it lingers).
    exits_at: Option<Instant>,
    lingers: bool,
    /// When it was started, and the instance it is (the unit's invocation number).
    started: Instant,
    invocation: u32,
}

#[derive(Debug, Default)]
struct Unit {
    /// The unit file systemd has loaded (at the last daemon-reload).
    loaded: Option<String>,
    active: &'static str,
    sub: &'static str,
    result: &'static str,
    main_pid: u32,
    exit_code: u32,
    exit_status: i32,
    invocation: u32,
    /// `systemctl enable`d (it would start at boot).
    enabled: bool,
}

#[derive(Debug, Default)]
struct World {
    files: BTreeMap<PathBuf, Vec<u8>>,
    unit: Unit,
    procs: BTreeMap<u32, Proc>,
    next_pid: u32,
    /// Servers started with these argvs fail to load (a bad spec).
    bad: Vec<Vec<String>>,
    /// The spec each argv serves (its reported args and its speculation).
    specs: Vec<Spec>,
    lingering: bool,
    plan: Option<(usize, Fault)>,
    calls: Vec<&'static str>,
    crashed: bool,
    /// Every unit text ever written, in order.
    writes: Vec<String>,
    /// Stops and starts asked for.
    stops: usize,
    starts: usize,
    /// Starts of a new instance while a process of the unit was still alive in its cgroup.
    started_over_live: usize,
    /// How each instance ended (by invocation): its `Result=`.
    endings: BTreeMap<u32, &'static str>,
    /// What the pre-flight of a unit text finds (by its argv): the host lacks what it names.
    preflight: Vec<(Vec<String>, crate::preflight::Problem)>,
    /// Links to /dev/null (`systemctl mask`).
    masks: Vec<PathBuf>,
    /// The process specd runs as on this host ([`Host::me`]), once asked for.
    me: Option<u32>,
    /// Servers of these argvs die of the load a sweep puts on them.
    die_under_load: Vec<Vec<String>>,
    /// How long the journal takes to answer a look at a unit's instances (the metrics').
    journal_lag: Duration,
    /// How long a server takes to exit after SIGTERM ([`EXIT_AFTER_TERM`] unless set).
    exit_after_term: Option<Duration>,
    /// How long a pre-flight takes (`systemd-analyze verify` on a busy host).
    preflight_lag: Duration,
    /// Until then, the serving instance has a request in flight.
    busy_until: Option<Instant>,
    /// Stops asked for while the serving instance had a request in flight.
    stops_while_busy: u32,
    /// Clients keep sending the serving instance requests (one always in flight), unless its
    /// port refuses new connections.
    fed: bool,
    /// The port specd's nftables rule closes to new connections, if any (`Firewall`).
    refused: Option<u16>,
    /// `nft` is not there: every call to it fails.
    no_nft: bool,
    /// `nft` can close a port and no longer open it.
    cannot_open: bool,
    /// `nft` is there and refuses every script (a sandbox without CAP_NET_ADMIN).
    nft_denied: bool,
    /// Starts made while the unit's port refused new connections (nothing could reach them).
    started_behind_rule: usize,
    /// What `nvidia-smi` answers, in turn (the last one again and again); empty: no NVIDIA device.
    gpu_answers: std::collections::VecDeque<Result<String, String>>,
    /// What the unit's load balancers are told, and each word they were told since, when.
    lb_state: Option<ServingState>,
    lb_told: Vec<(Instant, Word)>,
    /// Load balancers that poll the unit.
    balancers: Vec<Balancer>,
    /// What specd told the load balancers that was not true, or a stop while they were told
    /// ready.
    lb_violations: Vec<String>,
    /// The main process was killed by a fault (not stopped by specd) since the last start.
    killed: bool,
    /// When each stop of a live server was asked for.
    stop_times: Vec<Instant>,
}

/// A load balancer polling the unit every `every` from `from`, until `until` if it stops.
#[derive(Clone, Debug)]
struct Balancer {
    kind: CheckKind,
    addr: String,
    every: Duration,
    from: Instant,
    until: Option<Instant>,
}

/// What the fault plan says about this call.
enum Go {
    On,
    Fail(String),
    Hang,
    /// systemd re-executes: the connection is lost before the reply (after the call acted).
    LoseReply,
}

/// The calls that go to systemd (a re-execution breaks only those).
const SYSTEMD_CALLS: [&str; 7] = ["show", "start", "stop", "daemon_reload", "enable", "disable", "watch"];

/// A handle on the in-memory host (clones share it).
#[derive(Clone, Debug)]
pub struct FakeHost {
    unit: String,
    unit_dir: PathBuf,
    world: Arc<Mutex<World>>,
    /// Bumped when a call changes the unit's state (time-driven changes are computed).
    changes: Arc<tokio::sync::watch::Sender<u64>>,
    /// When the host was made, on tokio's clock: the wall clock is [`EPOCH`] then, and runs
    /// with tokio's (paused in the tests).
    born: Instant,
    /// The serving states of every unit of this host (replicas made [`FakeHost::beside`] each
    /// other share them), and each one told, in order.
    peers: Arc<Mutex<Vec<(Instant, String, ServingState)>>>,
}

/// The fake's wall clock when it is made (unix seconds).
pub const EPOCH: u64 = 1_800_000_000;

/// The fake's [`Watch`]: a call that changed the unit, or the next time-driven change (a
/// stopped process exits, a failing load dies, systemd gives up on a lingering stop).
pub struct FakeWatch {
    host: FakeHost,
    rx: tokio::sync::watch::Receiver<u64>,
    /// Its subscription failed: a 20 ms timer, as the real one.
    timer: bool,
}

impl Watch for FakeWatch {
    async fn changed(&mut self) {
        if self.timer {
            return tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let next = {
            let w = self.host.w();
            let main = w.unit.main_pid;
            w.procs
                .iter()
                .filter(|(_, p)| p.alive)
                .flat_map(|(pid, p)| {
                    let exits = p.exits_at.filter(|_| !p.lingers);
                    let gives_up = p
                        .exits_at
                        .filter(|_| p.lingers && *pid == main && w.unit.active == "deactivating")
                        .map(|t| t + Duration::from_secs(30));
                    [exits, p.dies_at, gives_up]
                })
                .flatten()
                .min()
        };
        tokio::select! {
            _ = self.rx.changed() => {}
            _ = async {
                match next {
                    Some(t) => tokio::time::sleep_until(t.max(Instant::now() + Duration::from_millis(1))).await,
                    None => std::future::pending().await,
                }
            } => {}
        }
    }
}

impl FakeHost {
    /// A sweep's load on the server at `base_url` (`sweep::loadgen::Load` on the fake): a call
    /// the fault plan may fail; a server that dies under load dies at once (its error), one that
    /// does not run refuses the connection.
    pub async fn serve_load(&self, base_url: &str) -> Result<(), String> {
        let fails = self.call("load", HTTP, |e| e).await.or_else(|| {
            let argv = self.ready_server(base_url)?;
            let mut w = self.w();
            if !w.die_under_load.contains(&argv) {
                return None;
            }
            let main = w.unit.main_pid;
            if let Some(p) = w.procs.get_mut(&main) {
                p.dies_at = Some(Instant::now());
            }
            Self::advance(&mut w);
            drop(w);
            self.changes.send_modify(|n| *n += 1);
            Some(format!("{base_url}: connection reset"))
        });
        let fails =
            fails.or_else(|| self.ready_server(base_url).is_none().then(|| format!("{base_url}: connection refused")));
        fails.map_or(Ok(()), Err)
    }

    /// A look at the journal for a unit's instances (the agent's metrics'): it takes the
    /// journal's lag; deaths are counted from the real journal (the end-to-end tests), none here.
    pub async fn journal_look(&self) {
        self.w().calls.push("instances");
        let lag = self.w().journal_lag;
        tokio::time::sleep(lag).await;
    }

    /// The monotonic clock (µs) at `t`: a boot's worth of time before the host was made.
    fn mono(&self, t: Instant) -> u64 {
        1_000_000_000 + t.saturating_duration_since(self.born).as_micros() as u64
    }

    /// What instance `n` has said so far, as its engine says it (the spec it serves): the line
    /// that begins each phase of its start (`specd_spec::startup`), spread over its load, then
    /// its ready line; a server that fails to load says its error instead, when it dies.
    fn lines_of(&self, n: u32) -> Vec<(u64, String)> {
        let w = self.w();
        let Some(p) = w.procs.values().find(|p| p.invocation == n) else { return Vec::new() };
        let Some(spec) = w.specs.iter().find(|s| s.argv == p.argv) else { return Vec::new() };
        let log = &specd_spec::engine_facts(spec.engine).startup;
        let k = log.phases.len() as u32 + 1;
        let mut out: Vec<(Instant, String)> =
            log.phases.iter().zip(1..).map(|(m, i)| (p.started + LOAD * i / k, m.markers[0].to_string())).collect();
        out.push((p.ready_at, log.ready.to_string()));
        if let Some(d) = p.dies_at {
            out.retain(|(t, _)| *t < d);
            out.push((d, FAILED_LOAD.to_string()));
        }
        let now = Instant::now();
        out.into_iter().filter(|(t, _)| *t <= now).map(|(t, l)| (self.mono(t), l)).collect()
    }

    pub fn new(unit: &str, unit_dir: &Path) -> FakeHost {
        let w = World { next_pid: 100, ..Default::default() };
        let host = FakeHost {
            unit: unit.into(),
            unit_dir: unit_dir.into(),
            world: Arc::new(Mutex::new(w)),
            changes: Arc::new(tokio::sync::watch::channel(0).0),
            born: Instant::now(),
            peers: Arc::default(),
        };
        host.w().unit.active = "inactive";
        host.w().unit.sub = "dead";
        host
    }

    /// Another unit on the same host (a replica of a group): its own service, processes and
    /// server; the serving states, the unit directory and the clock shared.
    pub fn beside(&self, unit: &str) -> FakeHost {
        FakeHost { peers: self.peers.clone(), born: self.born, ..FakeHost::new(unit, &self.unit_dir) }
    }

    /// Every serving state told on this host (by any unit made [`FakeHost::beside`] it), in order.
    pub fn serving_told(&self) -> Vec<(Instant, String, ServingState)> {
        self.peers.lock().unwrap().clone()
    }

    fn w(&self) -> std::sync::MutexGuard<'_, World> {
        self.world.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn cgroup(&self) -> String {
        format!("/system.slice/{}", self.unit)
    }

    fn path(&self) -> PathBuf {
        super::unit_path(&self.unit_dir, &self.unit)
    }

    /// Servers of this spec serve; with `fails`, they fail to load.
    pub fn serves(&self, spec: &Spec, fails: bool) {
        let mut w = self.w();
        if fails {
            w.bad.push(spec.argv.clone());
        }
        w.specs.push(spec.clone());
    }

    /// A server of this spec dies (exits with an error) under a sweep's load.
    pub fn dies_under_load(&self, spec: &Spec) {
        self.w().die_under_load.push(spec.argv.clone());
    }

    /// The host lacks what `spec` names: its pre-flight finds `problem`.
    pub fn lacks(&self, spec: &Spec, problem: crate::preflight::Problem) {
        self.w().preflight.push((spec.argv.clone(), problem));
    }

    /// Fault `f` at call number `n` (0-based) from now on counted.
    pub fn plan(&self, n: usize, f: Fault) {
        let mut w = self.w();
        w.plan = Some((n + w.calls.len(), f));
    }

    /// No more faults: the plan is cleared and lingering processes finally exit.
    pub fn heal(&self) {
        let mut w = self.w();
        w.plan = None;
        w.lingering = false;
        w.cannot_open = false;
        let now = Instant::now();
        for p in w.procs.values_mut() {
            p.lingers = false;
            if let Some(t) = p.exits_at.as_mut() {
                *t = (*t).min(now);
            }
        }
        Self::advance(&mut w);
        drop(w);
        self.changes.send_modify(|n| *n += 1);
    }

    /// Servers take `d` to exit after SIGTERM (SGLang draining a long request).
    pub fn exits_after_term(&self, d: Duration) {
        self.w().exit_after_term = Some(d);
    }

    /// The journal takes `lag` to answer a look at a unit's instances (a busy journald).
    pub fn journal_lag(&self, lag: Duration) {
        self.w().journal_lag = lag;
    }

    /// A pre-flight takes `lag`.
    pub fn preflight_lag(&self, lag: Duration) {
        self.w().preflight_lag = lag;
    }

    /// The host has NVIDIA GPUs, and `nvidia-smi` answers these, one a look (the last one to
    /// every look after).
    pub fn gpus(&self, answers: &[Result<&str, &str>]) {
        self.w().gpu_answers = answers.iter().map(|a| a.map(str::to_string).map_err(str::to_string)).collect();
    }

    /// The serving instance has a request in flight for `d` from now.
    pub fn busy_for(&self, d: Duration) {
        self.w().busy_until = Some(Instant::now() + d);
    }

    /// Clients keep sending the serving instance requests: one is always in flight, unless its
    /// port refuses new connections.
    pub fn fed(&self) {
        self.w().fed = true;
    }

    /// The host has no `nft`: closing or opening a port fails.
    pub fn without_nft(&self) {
        self.w().no_nft = true;
    }

    /// `nft` refuses every script, to close a port as to open it: "Operation not permitted".
    pub fn nft_denied(&self) {
        self.w().nft_denied = true;
    }

    /// The serving instance is killed at rest (systemd does not start it again).
    pub fn dies(&self) {
        Self::kill_main(&mut self.w());
        self.changes.send_modify(|n| *n += 1);
    }

    /// The serving instance stops answering ready (hung, or loading again): 503 from now on.
    pub fn not_ready(&self) {
        let mut w = self.w();
        let main = w.unit.main_pid;
        if let Some(p) = w.procs.get_mut(&main) {
            p.ready_at = Instant::now() + Duration::from_secs(365 * 86_400);
        }
    }

    /// From now on (until [`FakeHost::heal`]), a rule once added cannot be removed.
    pub fn nft_cannot_open(&self) {
        self.w().cannot_open = true;
    }

    /// Starts made while the unit's port refused new connections.
    pub fn started_behind_rule(&self) -> usize {
        self.w().started_behind_rule
    }

    /// The port specd's nftables rule refuses new connections to, if one does.
    pub fn refused(&self) -> Option<u16> {
        self.w().refused
    }

    /// How many stops were asked for while the serving instance had a request in flight.
    pub fn stops_while_busy(&self) -> u32 {
        self.w().stops_while_busy
    }

    /// A load balancer at `addr` polls the unit every `every` from now on, by `kind`.
    pub fn balancer(&self, kind: CheckKind, addr: &str, every: Duration) {
        let b = Balancer { kind, addr: addr.into(), every, from: Instant::now(), until: None };
        self.w().balancers.push(b);
    }

    /// The load balancer at `addr` polls no more from now on.
    pub fn balancer_stops(&self, addr: &str) {
        let now = Instant::now();
        for b in self.w().balancers.iter_mut().filter(|b| b.addr == addr) {
            b.until = Some(now);
        }
    }

    /// When each stop of a live server was asked for.
    pub fn stop_times(&self) -> Vec<Instant> {
        self.w().stop_times.clone()
    }

    /// What the unit's load balancers are told now.
    pub fn lb_state(&self) -> Option<ServingState> {
        self.w().lb_state.clone()
    }

    /// Each word the load balancers were told, in order.
    pub fn lb_told(&self) -> Vec<Word> {
        self.w().lb_told.iter().map(|(_, w)| *w).collect()
    }

    /// When the load balancers were last told `word`.
    pub fn lb_told_at(&self, word: Word) -> Option<Instant> {
        self.w().lb_told.iter().rev().find(|(_, w)| *w == word).map(|(t, _)| *t)
    }

    /// What specd told the load balancers that was not true, or stopped while they were told
    /// ready (see [`LoadBalancers`]' implementation here).
    pub fn lb_violations(&self) -> Vec<String> {
        self.w().lb_violations.clone()
    }

    /// The fake's wall clock in ms at `t`.
    fn ms_at(&self, t: Instant) -> u64 {
        EPOCH * 1000 + t.saturating_duration_since(self.born).as_millis() as u64
    }

    /// A process outside the unit (a sweep's), alive until [`FakeHost::end_holder`].
    pub fn spawn_holder(&self) -> u32 {
        Self::holder(&mut self.w())
    }

    fn holder(w: &mut World) -> u32 {
        let pid = w.next_pid;
        w.next_pid += 1;
        let now = Instant::now();
        let p = Proc {
            argv: vec!["specd".into(), "sweep".into()],
            alive: true,
            cgroup: "/user.slice".into(),
            ready_at: now,
            dies_at: None,
            exits_at: None,
            lingers: false,
            started: now,
            invocation: 0,
        };
        w.procs.insert(pid, p);
        pid
    }

    /// A holder's process exits (a sweep that died).
    pub fn end_holder(&self, pid: u32) {
        if let Some(p) = self.w().procs.get_mut(&pid) {
            p.alive = false;
        }
        self.changes.send_modify(|n| *n += 1);
    }

    pub fn calls(&self) -> usize {
        self.w().calls.len()
    }

    /// The planned fault hit the last call of these names made so far, and none but of these
    /// names came after it (nothing after it could see it).
    pub fn faulted_last_of(&self, names: &[&str]) -> bool {
        let w = self.w();
        w.plan.is_some_and(|(at, _)| {
            at < w.calls.len()
                && names.contains(&w.calls[at])
                && w.calls[at + 1..].iter().all(|c| names.contains(c) && *c != w.calls[at])
        })
    }

    pub fn call_names(&self) -> Vec<&'static str> {
        self.w().calls.clone()
    }

    pub fn crashed(&self) -> bool {
        self.w().crashed
    }

    pub fn stops_and_starts(&self) -> (usize, usize) {
        let w = self.w();
        (w.stops, w.starts)
    }

    /// How many new instances were started while a process of the unit still ran.
    pub fn started_over_live(&self) -> usize {
        self.w().started_over_live
    }

    pub fn writes(&self) -> Vec<String> {
        self.w().writes.clone()
    }

    /// Whether the unit would start at boot.
    pub fn enabled(&self) -> bool {
        self.w().unit.enabled
    }

    /// As if a person ran `systemctl disable` (or an older specd never enabled it).
    pub fn set_enabled(&self, on: bool) {
        self.w().unit.enabled = on;
    }

    /// As if a person ran `systemctl mask` (a link at `path` to /dev/null).
    pub fn mask(&self, path: &Path) {
        self.w().masks.push(path.into());
    }

    pub fn unit_file(&self) -> Option<String> {
        self.w().files.get(&self.path()).map(|b| String::from_utf8_lossy(b).into_owned())
    }

    /// The argv of the process serving now, if one is up and ready.
    pub fn serving(&self) -> Option<Vec<String>> {
        let mut w = self.w();
        Self::advance(&mut w);
        let pid = w.unit.main_pid;
        let p = w.procs.get(&pid)?;
        (w.unit.active == "active" && p.alive && Instant::now() >= p.ready_at).then(|| p.argv.clone())
    }

    /// Processes alive in the unit's cgroup.
    pub fn alive_count(&self) -> usize {
        let mut w = self.w();
        Self::advance(&mut w);
        w.procs.values().filter(|p| p.alive).count()
    }

    /// Let time-driven things happen: a failing load ends, a stopped process exits.
    fn advance(w: &mut World) {
        let now = Instant::now();
        let main = w.unit.main_pid;
        let mut main_exit = None;
        for (pid, p) in w.procs.iter_mut() {
            if !p.alive {
                continue;
            }
            if let Some(t) = p.exits_at.filter(|t| *t <= now && !p.lingers) {
                let _ = t;
                p.alive = false;
                if *pid == main {
                    main_exit = Some(true);
                }
            } else if p.dies_at.is_some_and(|t| t <= now) {
                p.alive = false;
                if *pid == main {
                    main_exit = Some(false);
                }
            }
        }
        match main_exit {
            Some(true) => Self::ended(w, "success", 1, 0),
            Some(false) => Self::ended(w, "exit-code", 1, 1),
            None => {}
        }
        // A stop whose process lingers: systemd gives up on the unit (its SIGKILL did not help).
        if w.unit.active == "deactivating"
            && w.procs
                .get(&main)
                .is_some_and(|p| p.lingers && p.exits_at.is_some_and(|t| t + Duration::from_secs(30) <= now))
        {
            Self::ended(w, "timeout", 2, 9);
        }
    }

    fn ended(w: &mut World, result: &'static str, code: u32, status: i32) {
        let stopping = w.unit.active == "deactivating";
        w.unit.active = if result == "success" || (stopping && result != "timeout") { "inactive" } else { "failed" };
        w.unit.sub = if w.unit.active == "inactive" { "dead" } else { "failed" };
        w.unit.result = result;
        w.unit.main_pid = 0;
        w.unit.exit_code = code;
        w.unit.exit_status = status;
        let invocation = w.unit.invocation;
        w.endings.insert(invocation, result);
    }

    fn kill_main(w: &mut World) {
        let main = w.unit.main_pid;
        if let Some(p) = w.procs.get_mut(&main).filter(|p| p.alive) {
            p.alive = false;
            w.killed = true;
            Self::ended(w, "signal", 2, 9);
        }
    }

    /// Count the call and apply the fault plan to it.
    fn enter(&self, name: &'static str) -> Go {
        let mut w = self.w();
        Self::advance(&mut w);
        let n = w.calls.len();
        w.calls.push(name);
        match w.plan {
            Some((at, f)) if at == n => match f {
                Fault::Fails => Go::Fail(format!("{name}: injected failure")),
                Fault::TimesOut => Go::Hang,
                Fault::ProcessDies => {
                    Self::kill_main(&mut w);
                    self.changes.send_modify(|n| *n += 1);
                    Go::On
                }
                Fault::ProcessLingers => {
                    w.lingering = true;
                    for p in w.procs.values_mut() {
                        p.lingers = true;
                    }
                    Go::On
                }
                Fault::Reexec if SYSTEMD_CALLS.contains(&name) => Go::LoseReply,
                Fault::Reexec => Go::On,
                Fault::Crash => {
                    w.crashed = true;
                    drop(w);
                    // Unwinds out of the reconcile as a SIGKILL would end it: nothing after
                    // this point runs, and the unit's lock is released.
                    std::panic::panic_any(Crashed);
                }
            },
            _ => Go::On,
        }
    }

    /// The fault planned for the next call, if any.
    fn planned(&self) -> Option<Fault> {
        let w = self.w();
        w.plan.filter(|(at, _)| *at == w.calls.len()).map(|(_, f)| f)
    }

    /// Run an async call under the fault plan: a hang is a timeout (`timeout`), or forever
    /// after a crash.
    async fn call<T>(&self, name: &'static str, timeout: Duration, failed: impl FnOnce(String) -> T) -> Option<T> {
        match self.enter(name) {
            Go::On => None,
            Go::Fail(e) => Some(failed(e)),
            Go::LoseReply => Some(failed(format!("{name}: {}", lost(name)))),
            Go::Hang => {
                tokio::time::sleep(timeout).await;
                Some(failed(format!("{name}: timed out after {}s", timeout.as_secs())))
            }
        }
    }

    /// A call to systemd under the fault plan: `Ok(true)` when the call is to act and then lose
    /// its reply (systemd re-executing).
    async fn systemd_call(&self, name: &'static str) -> Result<bool> {
        match self.enter(name) {
            Go::On => Ok(false),
            Go::LoseReply => Ok(true),
            Go::Fail(e) => Err(anyhow!(e)),
            Go::Hang => {
                tokio::time::sleep(SYSTEMCTL).await;
                bail!("{name}: timed out after {}s", SYSTEMCTL.as_secs())
            }
        }
    }

    /// A sync call under the fault plan (a hang is a failure: nothing sync here waits).
    fn sync_call(&self, name: &'static str) -> Result<()> {
        match self.enter(name) {
            Go::On | Go::LoseReply => Ok(()),
            Go::Fail(e) => Err(anyhow!(e)),
            Go::Hang => Err(anyhow!("{name}: timed out")),
        }
    }

    fn spec_of(&self, argv: &[String]) -> Option<Spec> {
        self.w().specs.iter().find(|s| s.argv == argv).cloned()
    }

    fn ready_server(&self, url: &str) -> Option<Vec<String>> {
        let argv = self.serving()?;
        let spec = self.spec_of(&argv)?;
        url.starts_with(&spec.base_url()).then_some(argv)
    }
}

/// The payload of the panic that stands for specd being killed.
#[derive(Debug)]
pub struct Crashed;

const SYSTEMCTL: Duration = Duration::from_secs(25);
const HTTP: Duration = Duration::from_secs(5);
const NFT: Duration = crate::machine::nft::NFT_WITHIN;

/// The error of a call whose connection systemd's re-execution closed.
fn lost(name: &str) -> crate::machine::dbus::Lost {
    crate::machine::dbus::Lost(format!("D-Bus call {name}: the connection closed before the reply"))
}

/// A call that acted and then lost its reply, or one that did not act at all: the error.
fn reply(lose: bool, name: &str) -> Result<()> {
    if lose { Err(lost(name).into()) } else { Ok(()) }
}

impl FakeHost {
    async fn show_once(&self, unit: &str) -> Result<UnitProps> {
        if self.systemd_call("show").await? {
            return Err(lost("show").into());
        }
        assert_eq!(unit, self.unit);
        let on_disk = self.unit_file();
        let w = self.w();
        let u = &w.unit;
        // Drop-ins are the files of the unit's own `.d` directory.
        let drop_ins = self.path().with_extension("service.d");
        let drop_in_paths = w.files.keys().filter(|p| p.parent() == Some(drop_ins.as_path()));
        Ok(UnitProps {
            load_state: if u.loaded.is_some() { LoadState::Loaded } else { LoadState::NotFound },
            active_state: ActiveState::parse(u.active),
            sub_state: u.sub.into(),
            result: u.result.into(),
            exec_main_code: u.exit_code,
            exec_main_status: u.exit_status,
            main_pid: u.main_pid,
            n_restarts: 0,
            control_group: if u.invocation > 0 { self.cgroup() } else { String::new() },
            need_daemon_reload: on_disk != u.loaded,
            fragment_path: if u.loaded.is_some() { self.path().display().to_string() } else { String::new() },
            drop_in_paths: drop_in_paths.map(|p| p.display().to_string()).collect(),
            invocation_id: if u.invocation > 0 { format!("{:032x}", u.invocation) } else { String::new() },
            exec_main_start_mono: w.procs.get(&u.main_pid).map_or(0, |p| self.mono(p.started)),
            unit_file_state: match (u.loaded.is_some(), u.enabled) {
                (false, _) => UnitFileState::Unknown,
                (true, true) => UnitFileState::Enabled,
                (true, false) => UnitFileState::Disabled,
            },
        })
    }

    async fn start_once(&self, unit: &str) -> Result<()> {
        let lose = self.systemd_call("start").await?;
        let mut w = self.w();
        w.starts += 1;
        if matches!(w.unit.active, "active" | "activating") {
            return reply(lose, "start");
        }
        let Some(text) = w.unit.loaded.clone() else { bail!("Unit {unit} not found.") };
        let cg = self.cgroup();
        if w.procs.values().any(|p| p.alive && p.cgroup == cg) {
            w.started_over_live += 1;
        }
        if w.refused.is_some() {
            w.started_behind_rule += 1;
        }
        let argv = specd_spec::exec_start(&text).unwrap_or_default();
        let now = Instant::now();
        let fails = w.bad.contains(&argv);
        let pid = w.next_pid;
        w.next_pid += 1;
        let lingers = w.lingering;
        let invocation = w.unit.invocation + 1;
        w.procs.insert(
            pid,
            Proc {
                argv,
                alive: true,
                cgroup: self.cgroup(),
                ready_at: now + LOAD,
                dies_at: fails.then(|| now + LOAD / 2),
                exits_at: None,
                lingers,
                started: now,
                invocation,
            },
        );
        w.unit.invocation += 1;
        w.killed = false;
        w.unit.main_pid = pid;
        w.unit.active = "active";
        w.unit.sub = "running";
        w.unit.result = "success";
        w.unit.exit_code = 0;
        w.unit.exit_status = 0;
        drop(w);
        self.changes.send_modify(|n| *n += 1);
        reply(lose, "start")
    }

    async fn stop_once(&self, unit: &str, wait: bool) -> Result<()> {
        let lose = self.systemd_call("stop").await?;
        assert_eq!(unit, self.unit);
        let exit = {
            let mut w = self.w();
            let main = w.unit.main_pid;
            let alive = w.procs.get(&main).is_some_and(|p| p.alive);
            if alive {
                w.stop_times.push(Instant::now());
            }
            if alive && matches!(w.lb_state, Some(ServingState::Ready { .. })) {
                let told = w.lb_state.clone();
                w.lb_violations.push(format!("pid {main} was stopped while its load balancers were told {told:?}"));
            }
            w.stops += 1;
            if w.busy_until.is_some_and(|t| Instant::now() < t) || (w.fed && w.refused.is_none()) {
                w.stops_while_busy += 1;
            }
            let main = w.unit.main_pid;
            let exits = Instant::now() + w.exit_after_term.unwrap_or(EXIT_AFTER_TERM);
            match w.procs.get_mut(&main).filter(|p| p.alive) {
                Some(p) => {
                    p.exits_at.get_or_insert(exits);
                    w.unit.active = "deactivating";
                    w.unit.sub = "stop-sigterm";
                    Some(exits)
                }
                None => {
                    if w.unit.active == "failed" {
                        w.unit.active = "inactive";
                        w.unit.sub = "dead";
                    }
                    None
                }
            }
        };
        self.changes.send_modify(|n| *n += 1);
        if lose {
            return Err(lost("stop").into());
        }
        if wait && let Some(t) = exit {
            tokio::time::sleep_until(t).await;
            Self::advance(&mut self.w());
        }
        Ok(())
    }

    async fn daemon_reload_once(&self) -> Result<()> {
        let lose = self.systemd_call("daemon_reload").await?;
        let text = self.unit_file();
        self.w().unit.loaded = text;
        reply(lose, "daemon_reload")
    }

    async fn enable_once(&self, unit: &str) -> Result<()> {
        let lose = self.systemd_call("enable").await?;
        assert_eq!(unit, self.unit);
        let mut w = self.w();
        if w.unit.loaded.is_none() {
            bail!("Unit file {unit} does not exist.");
        }
        w.unit.enabled = true;
        reply(lose, "enable")
    }

    async fn disable_once(&self, unit: &str) -> Result<()> {
        let lose = self.systemd_call("disable").await?;
        assert_eq!(unit, self.unit);
        self.w().unit.enabled = false;
        reply(lose, "disable")
    }
}

/// systemd's calls go through [`super::reconnecting`], as the real host's do.
impl ServiceManager for FakeHost {
    async fn show(&self, unit: &str) -> Result<UnitProps> {
        super::reconnecting("show", || self.show_once(unit)).await
    }

    async fn start(&self, unit: &str) -> Result<()> {
        super::reconnecting("start", || self.start_once(unit)).await
    }

    async fn stop(&self, unit: &str, wait: bool) -> Result<()> {
        super::reconnecting("stop", || self.stop_once(unit, wait)).await
    }

    async fn daemon_reload(&self) -> Result<()> {
        super::reconnecting("daemon_reload", || self.daemon_reload_once()).await
    }

    async fn enable(&self, unit: &str) -> Result<()> {
        super::reconnecting("enable", || self.enable_once(unit)).await
    }

    async fn disable(&self, unit: &str) -> Result<()> {
        super::reconnecting("disable", || self.disable_once(unit)).await
    }

    type Watch = FakeWatch;

    async fn watch(&self, unit: &str) -> FakeWatch {
        // A failed or hung subscription: the real watch falls back to a timer; so does this one.
        let timer = self.call("watch", SYSTEMCTL, |_| ()).await.is_some();
        assert_eq!(unit, self.unit);
        FakeWatch { host: self.clone(), rx: self.changes.subscribe(), timer }
    }
}

impl Processes for FakeHost {
    fn alive(&self, pid: u32) -> bool {
        let _ = self.enter("alive");
        pid == 0 || self.w().procs.get(&pid).is_some_and(|p| p.alive)
    }

    fn holder_alive(&self, hold: &crate::core::hold::Hold) -> bool {
        // The fake's pids are never reused.
        hold.pid.is_some_and(|p| self.alive(p))
    }

    async fn holder_exit(&self, hold: &crate::core::hold::Hold) {
        let Some(pid) = hold.pid else { return std::future::pending().await };
        let mut rx = self.changes.subscribe();
        while self.w().procs.get(&pid).is_some_and(|p| p.alive) {
            let _ = rx.changed().await;
        }
    }

    fn own_unit(&self) -> Option<String> {
        Some("specd.service".into())
    }

    fn me(&self) -> (u32, Option<u64>) {
        let mut w = self.w();
        let me = match w.me {
            Some(me) => me,
            None => Self::holder(&mut w),
        };
        w.me = Some(me);
        (me, None)
    }

    fn cmdline(&self, pid: u32) -> Option<Vec<String>> {
        if !matches!(self.enter("cmdline"), Go::On) {
            return None;
        }
        self.w().procs.get(&pid).filter(|p| p.alive).map(|p| p.argv.clone())
    }

    fn populated(&self, cg: &str) -> bool {
        let _ = self.enter("populated");
        self.w().procs.values().any(|p| p.alive && p.cgroup == cg)
    }

    async fn wait_empty(
        &self,
        cg: &str,
        deadline: Instant,
        mut tick: impl FnMut() + Send,
    ) -> Result<(), Vec<Lingering>> {
        if self.call("wait_empty", Duration::ZERO, |_| ()).await.is_some() {
            // A failed inotify watch: the real wait falls back to polling; so does this one.
        }
        loop {
            let (busy, next) = {
                let mut w = self.w();
                Self::advance(&mut w);
                let alive: Vec<(u32, &Proc)> =
                    w.procs.iter().filter(|(_, p)| p.alive && p.cgroup == cg).map(|(k, p)| (*k, p)).collect();
                let next = alive.iter().filter_map(|(_, p)| p.exits_at.or(p.dies_at)).filter(|_| !w.lingering).min();
                let busy: Vec<Lingering> =
                    alive.iter().map(|(pid, p)| Lingering { pid: *pid, cmdline: p.argv.join(" ") }).collect();
                (busy, next)
            };
            if busy.is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(busy);
            }
            tick();
            let wake = next.unwrap_or(deadline).min(deadline).min(Instant::now() + Duration::from_secs(1));
            tokio::time::sleep_until(wake.max(Instant::now() + Duration::from_millis(1))).await;
        }
    }
}

impl UnitFiles for FakeHost {
    fn read(&self, path: &Path) -> Result<Option<Vec<u8>>> {
        self.sync_call("read")?;
        Ok(self.w().files.get(path).cloned())
    }

    fn write(&self, path: &Path, bytes: &[u8]) -> Result<()> {
        self.sync_call("write")?;
        let mut w = self.w();
        w.writes.push(String::from_utf8_lossy(bytes).into_owned());
        w.files.insert(path.into(), bytes.to_vec());
        Ok(())
    }

    fn exists(&self, path: &Path) -> bool {
        let _ = self.enter("exists");
        self.w().files.contains_key(path)
    }

    fn is_mask(&self, path: &Path) -> bool {
        let _ = self.enter("is_mask");
        self.w().masks.iter().any(|m| m == path)
    }

    fn clean_temps(&self, _dir: &Path, _name: &str) {
        let _ = self.enter("clean_temps");
    }

    fn move_aside(&self, path: &Path, _dest: &Path) -> Result<()> {
        self.sync_call("move_aside")?;
        self.w().files.remove(path);
        Ok(())
    }
}

impl Server for FakeHost {
    async fn health(&self, url: &str) -> Health {
        if let Some(h) = self.call("health", HTTP, |e| Health::Loading(format!("{url}: {e}"))).await {
            return h;
        }
        match self.ready_server(url) {
            Some(_) => Health::Ready,
            None => {
                let w = self.w();
                let up = w.procs.get(&w.unit.main_pid).is_some_and(|p| p.alive);
                Health::Loading(if up { format!("{url} answered 503") } else { format!("{url}: port not open yet") })
            }
        }
    }

    async fn reported_args(&self, base_url: &str, spec: &Spec, _invocation: &str) -> Option<Result<Value, String>> {
        if spec.args_report() == specd_spec::ArgsReport::None {
            return None;
        }
        if let Some(e) = self.call("reported_args", HTTP, |e| e).await {
            return Some(Err(e));
        }
        let Some(argv) = self.ready_server(base_url) else {
            return Some(Err(format!("{base_url}: connection refused")));
        };
        let serving = self.spec_of(&argv)?;
        let mut info = serde_json::json!({});
        for a in serving.expected_server_args() {
            set_pointer(&mut info, a.key, a.value.clone());
        }
        Some(Ok(info))
    }

    async fn running_requests(&self, base_url: &str, _engine: Engine) -> Option<u64> {
        self.call("running_requests", HTTP, |_| ()).await.map_or(Some(()), |_| None)?;
        let busy = {
            let w = self.w();
            w.busy_until.is_some_and(|t| Instant::now() < t) || (w.fed && w.refused.is_none())
        };
        self.ready_server(base_url).map(|_| u64::from(busy))
    }

    async fn speculation(&self, base_url: &str, _spec: &Spec) -> Result<Speculation, String> {
        if let Some(e) = self.call("speculation", HTTP, |e| e).await {
            return Err(e);
        }
        let argv = self.ready_server(base_url).ok_or_else(|| format!("{base_url}: connection refused"))?;
        let serving = self.spec_of(&argv).ok_or("no spec")?;
        Ok(if serving.speculates() {
            Speculation {
                drafted: Some(24),
                accepted: Some(18),
                accept_length: None,
                accept_rate: Some(0.75),
                evidence: vec!["drafted=24".into()],
                off: false,
            }
        } else {
            Speculation::default()
        })
    }
}

impl Journal for FakeHost {
    fn note(&self, _unit: &str, _action: &str, _invocation: &str, _message: &str) {
        let _ = self.enter("note");
    }

    async fn said(&self, invocation: &str, cursor: Option<&str>) -> Option<super::Said> {
        self.call("said", Duration::from_secs(1), |_| ()).await.map_or(Some(()), |_| None)?;
        let n = u32::from_str_radix(invocation, 16).ok()?;
        let lines = self.lines_of(n);
        let from = cursor.and_then(|c| c.parse::<usize>().ok()).unwrap_or(0).min(lines.len());
        Some(super::Said { lines: lines[from..].to_vec(), cursor: Some(lines.len().to_string()) })
    }

    async fn ending(&self, _unit: &str, invocation: &str, _within: Duration) -> Option<super::Ending> {
        self.call("ending", Duration::from_secs(5), |_| ()).await.map_or(Some(()), |_| None)?;
        let w = self.w();
        let n = u32::from_str_radix(invocation, 16).ok();
        let result = n.and_then(|n| w.endings.get(&n).copied()).unwrap_or(w.unit.result);
        Some(if result == "exit-code" {
            super::Ending {
                clean: false,
                verdict: "crash".into(),
                summary: "crash: the server died on its own: exit status 1".into(),
                engine_error: Some(FAILED_LOAD.into()),
            }
        } else {
            super::Ending {
                clean: true,
                verdict: "clean-stop".into(),
                summary: "clean stop: stopped on request".into(),
                engine_error: None,
            }
        })
    }
}

impl Devices for FakeHost {
    async fn gpu_memory(&self) -> Option<Result<String, String>> {
        if self.w().gpu_answers.is_empty() {
            return None;
        }
        if let Some(e) = self.call("gpu_memory", crate::machine::gpu::NVIDIA_SMI_WITHIN, |e| e).await {
            return Some(Err(e));
        }
        let mut w = self.w();
        if w.gpu_answers.len() > 1 { w.gpu_answers.pop_front() } else { w.gpu_answers.front().cloned() }
    }
}

/// The unit's load balancers: the state in memory (each set a call the fault plan may fail), the
/// polls of the [`FakeHost::balancer`]s computed from when each word was told. A state set to
/// ready while nothing serves (checked before the call's fault: a server killed at that very call
/// died after specd looked) is a violation, as is a stop of a live server while it is ready.
impl LoadBalancers for FakeHost {
    fn serving_state(&self, unit: &str) -> Option<ServingState> {
        if unit != self.unit {
            let peers = self.peers.lock().unwrap();
            return peers.iter().rev().find(|(_, u, _)| u == unit).map(|(_, _, s)| s.clone());
        }
        self.w().lb_state.clone()
    }

    fn set_serving_state(&self, unit: &str, state: &ServingState) -> Result<()> {
        assert_eq!(unit, self.unit);
        // A server killed after specd looked at it is not specd's to know of (the load
        // balancer's own check is): the next reconcile sees it.
        if state.word() == Word::Ready && self.serving().is_none() && !self.w().killed {
            let what = format!("told ready while nothing serves: {state:?}");
            self.w().lb_violations.push(what);
        }
        self.sync_call("serving_set")?;
        let mut w = self.w();
        w.lb_state = Some(state.clone());
        w.lb_told.push((Instant::now(), state.word()));
        self.peers.lock().unwrap().push((Instant::now(), unit.to_string(), state.clone()));
        Ok(())
    }

    fn lb_polls(&self, _unit: &str) -> PollLog {
        if self.sync_call("lb_polls").is_err() {
            return PollLog::default();
        }
        let now = Instant::now();
        let w = self.w();
        let word_at = |t: Instant| w.lb_told.iter().rev().find(|(at, _)| *at <= t).map_or(Word::Down, |(_, w)| *w);
        let mut log = PollLog::default();
        for b in &w.balancers {
            let end = b.until.map_or(now, |u| u.min(now));
            let Some(span) = end.checked_duration_since(b.from) else { continue };
            let last = span.as_millis() / b.every.as_millis().max(1);
            for k in last.saturating_sub(64)..=last {
                let t = b.from + b.every * k as u32;
                log.record(b.kind, &b.addr, self.ms_at(t), word_at(t));
            }
        }
        log
    }

    fn now_ms(&self) -> u64 {
        self.ms_at(Instant::now())
    }
}

/// What `nft` says in a sandbox without CAP_NET_ADMIN.
const DENIED: &str =
    "nft failed (exit status: 1): netlink: Error: cache initialization failed: Operation not permitted";

/// specd's nftables rule, in memory: one port refused at most (the one unit's).
impl Firewall for FakeHost {
    async fn refuse_new(&self, unit: &str, port: u16) -> Result<()> {
        assert_eq!(unit, self.unit);
        if let Some(e) = self.call("nft_refuse", NFT, |e| e).await {
            bail!(e);
        }
        if self.w().no_nft {
            bail!("running nft (the nftables package): No such file or directory (os error 2)");
        }
        if self.w().nft_denied {
            return Err(NothingApplied(DENIED.into()).into());
        }
        self.w().refused = Some(port);
        Ok(())
    }

    async fn accept_new(&self, unit: &str) -> Result<()> {
        assert_eq!(unit, self.unit);
        if let Some(e) = self.call("nft_accept", NFT, |e| e).await {
            bail!(e);
        }
        if self.w().cannot_open {
            bail!("nft failed (exit status: 1): Error: Could not process rule: Device or resource busy");
        }
        if self.w().nft_denied {
            return Err(NothingApplied(DENIED.into()).into());
        }
        // As the real one: without `nft`, no rule of specd's is there to remove.
        self.w().refused = None;
        Ok(())
    }
}

impl Host for FakeHost {
    fn now(&self) -> u64 {
        EPOCH + self.born.elapsed().as_secs()
    }

    fn monotonic_us(&self) -> u64 {
        self.mono(Instant::now())
    }

    async fn preflight(
        &self,
        _spec: &Spec,
        unit_text: &str,
        _drop_ins: &[String],
        _cgroup: &str,
        _state_dir: &Path,
    ) -> crate::preflight::Outcome {
        let lag = self.w().preflight_lag;
        tokio::time::sleep(lag).await;
        let argv = specd_spec::exec_start(unit_text).unwrap_or_default();
        let problems = self.w().preflight.iter().filter(|(a, _)| *a == argv).map(|(_, p)| p.clone()).collect();
        crate::preflight::Outcome { problems, notes: Vec::new() }
    }
}

fn set_pointer(v: &mut Value, pointer: &str, value: Value) {
    let mut cur = v;
    let parts: Vec<&str> = pointer.trim_start_matches('/').split('/').collect();
    for (i, p) in parts.iter().enumerate() {
        let obj = cur.as_object_mut().expect("an object");
        if i + 1 == parts.len() {
            obj.insert(p.to_string(), value);
            return;
        }
        cur = obj.entry(p.to_string()).or_insert_with(|| serde_json::json!({}));
    }
}

/// specd's own state files on the fake host: real files (the store's atomic write), each read
/// and save a call under the fault plan like any other, so a save can fail, hang or be where
/// specd is killed.
impl crate::machine::store::StateFiles for FakeHost {
    fn read_state(&self, path: &Path) -> Result<Option<Vec<u8>>> {
        self.sync_call("state_read")?;
        crate::machine::store::Disk.read_state(path)
    }

    fn write_state(&self, path: &Path, bytes: &[u8]) -> Result<()> {
        // Killed in this save: after its temporary file was written, before the rename.
        if self.planned() == Some(Fault::Crash) {
            let tmp = crate::machine::atomic::write_temp(path, bytes, 0o600)?;
            tmp.into_temp_path().keep()?;
        }
        self.sync_call("state_save")?;
        crate::machine::store::Disk.write_state(path, bytes)
    }

    fn set_aside_state(&self, path: &Path, dest: &Path) -> Result<()> {
        self.sync_call("state_set_aside")?;
        crate::machine::store::Disk.set_aside_state(path, dest)
    }
}
