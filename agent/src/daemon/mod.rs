//! `specd run`: the agent. Follows a git source, keeps one worker per unit (units reconcile
//! concurrently; one unit never has two reconciles at once), and reconciles on change: a new
//! commit, an edit of a managed unit file or drop-in, SIGHUP or `specd reconcile`, and a periodic
//! resync. Errors back off per unit. Talks to systemd with sd-notify when run as a service.

pub mod listen;
pub mod metrics;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use specd_spec::short;
use tokio::sync::{Notify, mpsc, watch};

use crate::config::AgentConfig;
use crate::core::guard::{catch, lock};
use crate::host::{Host, RealHost};
use crate::reconcile::context::{self, Dirs};
use crate::reconcile::progress::{self, Sink};
use crate::source::follow::{Evaluation, Follower, evaluate, read_commit};

use crate::core::timing;
use crate::daemon::metrics::Metrics;
use crate::machine::store::{self, Outcome, Source, SourceState, Store};
use crate::machine::systemd::Systemd;
use crate::reconcile::{self, Action, Ctx, DesiredState, Shutdown};
use crate::source::git::GitSource;

/// The host the agent runs on: the reconciler's [`Host`], and where its metrics learn of deaths.
pub trait AgentHost: Host + metrics::Instances {}
impl<T: Host + metrics::Instances> AgentHost for T {}

/// Why something asked for a reconcile.
#[derive(Debug, Clone)]
pub enum Trigger {
    /// The source may have a new commit.
    Source,
    /// One unit (its file or drop-ins changed, or a person asked).
    Unit(String),
    /// Every unit (SIGHUP, `specd reconcile`, periodic resync).
    All,
}

pub struct RunOptions {
    pub config: AgentConfig,
    pub dirs: Dirs,
}

struct Worker {
    desired: watch::Sender<Arc<DesiredState>>,
    poke: Arc<Notify>,
    handle: tokio::task::JoinHandle<()>,
}

/// Run the agent until SIGTERM/SIGINT: open the source, listen to systemd, signals and the
/// endpoints, hand each unit of the head its worker, follow the triggers, then stop at safe
/// points.
pub async fn run(opts: RunOptions) -> Result<()> {
    // Raised before anything is opened; the endpoints' caps are sized under it.
    let nofile = listen::raise_nofile();
    let cfg = opts.config.clone();
    let src_cfg = cfg.source()?;
    let hostname = context::hostname(cfg.hostname.clone());
    let store = Store::new(&opts.dirs.state_dir);
    crate::machine::atomic::ensure_private_dir(&opts.dirs.state_dir)?;
    // State written world-readable by an older specd is made private; what saves killed before
    // their rename left is removed.
    store.secure();
    store.clean_stale_temps();
    let (stop_tx, shutdown) = Shutdown::new();
    let ctx = Arc::new(Ctx {
        holds: reconcile::Holds::Obeyed,
        ..context::host_ctx(&opts.dirs, progress::events(Sink::Log), shutdown)
    });
    let own_unit = own_main_unit(&ctx.host).await;
    StopTimeout::clear_leftover(&ctx.unit_dir, own_unit.as_deref());
    let metrics = Arc::new(Metrics::default());
    metrics.host_info(&hostname, &cfg.labels.0);
    let (trig_tx, trig_rx) = mpsc::unbounded_channel::<Trigger>();

    let cache = opts.dirs.state_dir.join("repo");
    let src = {
        let c = src_cfg.clone();
        tokio::task::spawn_blocking(move || GitSource::open(c, &cache)).await??
    };
    let src = Arc::new(Mutex::new(src));
    tracing::info!(repo = %src_cfg.repo, followed = %lock(&src).followed(), host = %hostname, "specd agent starting");

    // Watch the local repository's refs, and the unit directory.
    let watching = watcher(&lock(&src), &opts.dirs.unit_dir, trig_tx.clone())?;
    forward_unit_changes(trig_tx.clone(), ctx.host.systemd.clone(), ctx.shutdown.clone());
    forward_sighup(trig_tx.clone())?;
    let term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    let endpoints = Endpoints::serve(&cfg, nofile, &metrics, trig_tx.clone()).await?;
    if let Some(n) = crate::notify::install(&cfg.notify.webhooks, &hostname) {
        metrics.register_notices(&n.counters);
    }

    let mut units = Units {
        own_unit,
        src: src.clone(),
        cfg: cfg.clone(),
        hostname,
        state_dir: opts.dirs.state_dir.clone(),
        ctx,
        metrics,
        workers: BTreeMap::new(),
        last_head: None,
    };
    units.sync_source(Read::Always).await;
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]);
    tracing::info!(units = units.workers.len(), "ready");

    let mut schedule = Schedule::new(&cfg, lock(&src).is_remote());
    units.metrics.schedule(schedule.remote.then_some(schedule.interval), schedule.resync);
    spawn_watchdog();
    follow(&mut units, &mut schedule, trig_rx, term, int).await;
    // Nothing is triggered any more (the stop may write and remove a drop-in of its own unit).
    drop(watching);
    stop(units, stop_tx, endpoints).await;
    Ok(())
}

/// systemd's word that a unit started, stopped or failed: that unit is looked at (a unit at
/// rest is not looked at on a timer when the source is local). Listened to again when the
/// connection closes, until the agent stops.
fn forward_unit_changes(t: mpsc::UnboundedSender<Trigger>, systemd: Systemd, stop: Shutdown) {
    tokio::spawn(async move {
        loop {
            match systemd.state_changes().await {
                Ok(mut changes) => {
                    while let Some(unit) = changes.next().await {
                        let _ = t.send(Trigger::Unit(unit));
                    }
                    tracing::info!("the connection to systemd closed; listening again");
                }
                Err(e) => tracing::warn!("cannot listen to systemd's unit changes: {e:#}; trying again"),
            }
            // Again once systemd is back (after a daemon-reexec, say); not in a loop.
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                _ = stop.wait() => return,
            }
        }
    });
}

/// SIGHUP: the source read again and every unit looked at.
fn forward_sighup(t: mpsc::UnboundedSender<Trigger>) -> Result<()> {
    let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
    tokio::spawn(async move {
        while hup.recv().await.is_some() {
            tracing::info!("SIGHUP: reconciling every unit");
            let _ = t.send(Trigger::Source);
            let _ = t.send(Trigger::All);
        }
    });
    Ok(())
}

/// The agent's endpoints: metrics (TCP, read-only) and control actions (a Unix socket, root's
/// or a group's).
struct Endpoints {
    metrics: tokio::task::JoinHandle<()>,
    control: tokio::task::JoinHandle<()>,
    socket: PathBuf,
}

impl Endpoints {
    /// Serve both, each under a cap of connections that leaves descriptors (of `nofile`) for the
    /// agent's own work; a control action becomes a trigger.
    async fn serve(
        cfg: &AgentConfig,
        nofile: u64,
        metrics: &Arc<Metrics>,
        t: mpsc::UnboundedSender<Trigger>,
    ) -> Result<Endpoints> {
        let limits = listen::Limits { connections: listen::metrics_connections(nofile), ..listen::METRICS };
        tracing::info!(
            "open files: up to {nofile}; the metrics endpoint serves up to {} connections at once, the control socket {}, and {} are kept for the agent's own work",
            limits.connections,
            listen::CONTROL.connections,
            listen::RESERVED_FDS
        );
        let addr = cfg.listen.clone().unwrap_or_else(|| "127.0.0.1:9464".into());
        let server = listen::serve_metrics(&addr, metrics.clone(), limits).await?;
        let socket = cfg.control_socket();
        let control = listen::serve_control(&socket, cfg.control_group.as_deref(), move |unit| match unit {
            Some(u) => {
                let _ = t.send(Trigger::Unit(u));
            }
            None => {
                let _ = t.send(Trigger::Source);
                let _ = t.send(Trigger::All);
            }
        })?;
        Ok(Endpoints { metrics: server, control, socket })
    }

    /// Stop serving and remove the control socket.
    fn close(self) {
        self.metrics.abort();
        self.control.abort();
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// The watchdog's ping, every half of `WatchdogSec=` when the agent's unit sets it. Its own
/// task: a slow source read in the main loop must not starve it.
fn spawn_watchdog() {
    let mut wd_usec = 0u64;
    if sd_notify::watchdog_enabled(false, &mut wd_usec) {
        let every = Duration::from_micros(wd_usec / 2);
        tokio::spawn(async move {
            loop {
                let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Watchdog]);
                tokio::time::sleep(every).await;
            }
        });
    }
}

/// When the agent reads the source without being asked by an event: a remote's poll, the
/// periodic resync, a forced read put off to the end of its second.
struct Schedule {
    /// A remote is polled every `interval` (jittered); a local one is watched instead.
    remote: bool,
    interval: Duration,
    poll_at: tokio::time::Instant,
    /// A full look at every unit: every `resync`; by default only for a remote source (a local
    /// one's refs, the unit files and systemd's unit changes are all events).
    resync: Option<Duration>,
    resync_at: Option<tokio::time::Instant>,
    forced: ForcedReads,
}

impl Schedule {
    fn new(cfg: &AgentConfig, remote: bool) -> Schedule {
        let interval = Duration::from_secs(cfg.interval.unwrap_or(60).max(1));
        let resync = cfg.resync.or(if remote { Some(300) } else { None });
        let resync = resync.map(|s| Duration::from_secs(s.max(1)));
        Schedule {
            remote,
            interval,
            poll_at: tokio::time::Instant::now() + jitter(interval),
            resync,
            resync_at: resync.map(|r| tokio::time::Instant::now() + r),
            forced: ForcedReads::default(),
        }
    }
}

/// Forced source re-reads (SIGHUP, `specd reconcile`) at most once a second: a burst of
/// requests is one read now and one at the end of the second.
#[derive(Debug, Default)]
struct ForcedReads {
    last: Option<tokio::time::Instant>,
    /// The read put off, and when it is due.
    due: Option<tokio::time::Instant>,
}

impl ForcedReads {
    /// Whether a forced read asked at `now` happens now; if one happened less than a second ago,
    /// not: it is due at the end of that second instead.
    fn ask(&mut self, now: tokio::time::Instant) -> bool {
        if let Some(next) = self.last.map(|t| t + timing::FORCED_READ_EVERY).filter(|n| *n > now) {
            self.due = Some(next);
            false
        } else {
            self.last = Some(now);
            true
        }
    }
}

/// Follow the triggers and the schedule until SIGTERM or SIGINT.
async fn follow(
    units: &mut Units,
    s: &mut Schedule,
    mut trig_rx: mpsc::UnboundedReceiver<Trigger>,
    mut term: tokio::signal::unix::Signal,
    mut int: tokio::signal::unix::Signal,
) {
    loop {
        tokio::select! {
            Some(t) = trig_rx.recv() => {
                // At once, with what else is already queued: a ref moves in one rename (lock
                // files are not triggers), and a source read that finds the head where it was
                // does nothing, so nothing is gained by waiting for more.
                let mut ts = vec![t];
                while let Ok(t) = trig_rx.try_recv() {
                    ts.push(t);
                }
                on_triggers(units, &mut s.forced, ts).await;
            }
            _ = tokio::time::sleep_until(s.poll_at), if s.remote => {
                s.poll_at = tokio::time::Instant::now() + jitter(s.interval);
                units.sync_source(Read::IfHeadMoved).await;
            }
            _ = tokio::time::sleep_until(s.forced.due.unwrap_or_else(tokio::time::Instant::now)), if s.forced.due.is_some() => {
                s.forced.due = None;
                s.forced.last = Some(tokio::time::Instant::now());
                units.sync_source(Read::Always).await;
                units.poke_all();
            }
            _ = tokio::time::sleep_until(s.resync_at.unwrap_or_else(tokio::time::Instant::now)), if s.resync_at.is_some() => {
                s.resync_at = s.resync.map(|r| tokio::time::Instant::now() + r);
                units.sync_source(Read::Always).await;
                units.poke_all();
            }
            _ = term.recv() => break,
            _ = int.recv() => break,
        }
    }
}

/// A batch of triggers: the source read if one asks (an explicit request, SIGHUP or `specd
/// reconcile`, re-reads it even if the head did not move, at most once a second), then each
/// unit named poked.
async fn on_triggers(units: &mut Units, forced: &mut ForcedReads, ts: Vec<Trigger>) {
    let source = ts.iter().any(|t| matches!(t, Trigger::Source));
    let force = ts.iter().any(|t| matches!(t, Trigger::All)) && forced.ask(tokio::time::Instant::now());
    if source && (force || forced.due.is_none()) {
        units.sync_source(if force { Read::Always } else { Read::IfHeadMoved }).await;
    }
    for t in ts {
        match t {
            Trigger::Unit(u) => units.poke(&u),
            Trigger::All => units.poke_all(),
            Trigger::Source => {}
        }
    }
}

/// The agent's stop: applies in progress stop at their next safe point, every worker is joined
/// under the stop's deadline ([`stop_deadline`], asked of systemd as it moves: [`StopTimeout`]),
/// notices still queued get a last chance, the endpoints close.
async fn stop(units: Units, stop_tx: watch::Sender<bool>, endpoints: Endpoints) {
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Stopping]);
    tracing::info!("stopping: applies in progress stop at their next safe point");
    let _ = stop_tx.send(true);
    let mut timeout = StopTimeout::new(&units.ctx.unit_dir, units.own_unit.as_deref());
    let handles = units.workers.into_iter().map(|(u, w)| (u, w.handle)).collect();
    let late = join_at_stop(handles, &units.ctx.shutdown, |wait, carried| timeout.extend(wait, carried)).await;
    for u in late {
        tracing::warn!(unit = %u, "did not reach a safe point within the agent's stop; left as the agent exits");
    }
    // Notices still queued (a receiver that did not answer yet) get a last chance.
    crate::notify::flush(timing::NOTICES_WITHIN).await;
    endpoints.close();
    timeout.end();
    tracing::info!("stopped");
}

/// The service the agent runs as: the unit of its cgroup, if the agent is its main process (not
/// a `specd run` started by hand in a terminal, whose cgroup may be a user manager's unit).
async fn own_main_unit<H: AgentHost>(host: &H) -> Option<String> {
    let unit = host.own_unit()?;
    let props = host.show(&unit).await.ok()?;
    (props.main_pid == std::process::id()).then_some(unit)
}

/// What the agent's stop asks of systemd: that its unit's stop may take as long as its workers
/// need ([`stop_deadline`]), then its notices and its exit, whatever its `TimeoutStopSec=`.
///
/// Two ways, as systemd keeps one and not the other: `EXTEND_TIMEOUT_USEC=` (sd_notify(3),
/// systemd 236 and later) moves the running stop's timer, but a daemon-reload (the one the
/// stopping apply makes itself to load its new unit, or anyone's) sets that timer again from the
/// unit's configuration, at the time the stop began plus `TimeoutStopSec=` (systemd's
/// `service_coldplug_timeout`): once that has passed, systemd kills the agent at once. So while
/// an apply is carried past its old instance's stop, a drop-in of the agent's own unit
/// (`<unit dir>/<its unit>.d/zz-specd-stopping.conf`) also says the `TimeoutStopSec=` the stop
/// needs, which a reload loads; it is removed when the stop ends, and at the next start if the
/// agent was killed in its stop.
struct StopTimeout {
    /// The drop-in, when the agent runs as a unit.
    drop_in: Option<PathBuf>,
    began: tokio::time::Instant,
    wrote: bool,
}

impl StopTimeout {
    const DROP_IN: &str = "zz-specd-stopping.conf";

    fn new(unit_dir: &Path, own_unit: Option<&str>) -> StopTimeout {
        let drop_in = own_unit.map(|u| unit_dir.join(format!("{u}.d")).join(Self::DROP_IN));
        StopTimeout { drop_in, began: tokio::time::Instant::now(), wrote: false }
    }

    /// The workers may take `wait` more (`carried`: the units whose apply is stopping an old
    /// instance).
    fn extend(&mut self, wait: Duration, carried: &[String]) {
        let rest = wait + timing::NOTICES_WITHIN + timing::EXIT_WITHIN;
        let usec = format!("EXTEND_TIMEOUT_USEC={}", rest.as_micros());
        let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Custom(&usec)]);
        let Some(path) = self.drop_in.as_ref().filter(|_| !carried.is_empty()) else { return };
        // Whole seconds from the stop's beginning, rounded up.
        let secs = (self.began.elapsed() + rest).as_secs() + 1;
        let text = format!(
            "# Written by specd while it stops: an apply of {} goes on until its new instance is\n# started (removed when specd has stopped).\n[Service]\nTimeoutStopSec={secs}\n",
            carried.join(", ")
        );
        let written = path
            .parent()
            .map_or(Ok(()), crate::machine::atomic::ensure_dir)
            .and_then(|()| crate::machine::atomic::atomic_write(path, text.as_bytes(), 0o644));
        match written {
            Ok(()) => self.wrote = true,
            Err(e) => tracing::warn!(
                "stopping: could not write {} ({e:#}): a daemon-reload after the agent unit's TimeoutStopSec= would end the agent's stop",
                path.display()
            ),
        }
    }

    /// The stop is over: the drop-in removed.
    fn end(self) {
        if let Some(p) = self.drop_in.filter(|_| self.wrote) {
            Self::remove(&p);
        }
    }

    /// A drop-in left by an agent killed in its stop, removed at the agent's start.
    fn clear_leftover(unit_dir: &Path, own_unit: Option<&str>) {
        if let Some(p) = StopTimeout::new(unit_dir, own_unit).drop_in.filter(|p| p.exists()) {
            Self::remove(&p);
        }
    }

    fn remove(p: &Path) {
        match std::fs::remove_file(p) {
            Ok(()) => {
                // Its directory too, if specd made it for the drop-in alone.
                if let Some(d) = p.parent() {
                    let _ = std::fs::remove_dir(d);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!("could not remove {}: {e}", p.display()),
        }
    }
}

/// When the agent's stop stops waiting for its workers: [`timing::STOP_WITHIN`] after the stop
/// began (`t0`) or, for an apply that is stopping its unit's old instance, after the end of that
/// stop's budget: such an apply goes on until its new instance is started (an apply never leaves
/// down a unit that was serving), however long the spec lets the old one take to stop.
fn stop_deadline<'a>(
    t0: tokio::time::Instant,
    carried: impl IntoIterator<Item = &'a reconcile::CarriedApply>,
) -> tokio::time::Instant {
    carried.into_iter().map(|c| c.stop_ends).fold(t0, Ord::max) + timing::STOP_WITHIN
}

/// Join the workers under [`stop_deadline`], followed as applies begin and end their old
/// instance's stop; `extend` is told how long the agent may still wait, and for which units'
/// applies, each time that moves later. The units whose worker had not ended by then.
async fn join_at_stop(
    handles: Vec<(String, tokio::task::JoinHandle<()>)>,
    shutdown: &Shutdown,
    mut extend: impl FnMut(Duration, &[String]),
) -> Vec<String> {
    let t0 = tokio::time::Instant::now();
    let mut carried = shutdown.carried();
    let deadline = async move {
        let mut told: Option<tokio::time::Instant> = None;
        loop {
            let (at, stopping) = {
                let c = carried.borrow_and_update();
                (stop_deadline(t0, c.values()), c.values().map(|c| c.unit.clone()).collect::<Vec<_>>())
            };
            if told.is_none_or(|t| at > t) {
                let wait = at.saturating_duration_since(tokio::time::Instant::now());
                if !stopping.is_empty() {
                    tracing::info!(
                        "stopping: waiting up to {} s for the apply of {} to start its new instance after its old one's stop",
                        wait.as_secs(),
                        stopping.join(", ")
                    );
                }
                extend(wait, &stopping);
                told = Some(at);
            }
            tokio::select! {
                _ = tokio::time::sleep_until(at) => return,
                r = carried.changed() => if r.is_err() {
                    return tokio::time::sleep_until(at).await;
                },
            }
        }
    };
    join_within(handles, deadline).await
}

/// Wait for every task until one shared `deadline`; the units whose task had not finished by
/// then (they are left running, and end with the process).
async fn join_within(
    handles: Vec<(String, tokio::task::JoinHandle<()>)>,
    deadline: impl std::future::Future<Output = ()>,
) -> Vec<String> {
    tokio::pin!(deadline);
    let mut passed = false;
    let mut late = Vec::new();
    for (unit, mut h) in handles {
        if !passed {
            tokio::select! {
                biased;
                _ = &mut h => continue,
                _ = &mut deadline => passed = true,
            }
        }
        if !h.is_finished() {
            late.push(unit);
        }
    }
    late
}

fn jitter(d: Duration) -> Duration {
    let ms = d.as_millis() as u64;
    let spread = ms / 10;
    let r = (std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|t| t.subsec_nanos() as u64)
        .unwrap_or(0))
        % (2 * spread + 1);
    Duration::from_millis(ms - spread + r)
}

/// Whether a source read hands the units their desired states again when the head has not
/// moved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Read {
    /// Only a new head (or one that may not deploy) changes anything: polls, ref changes.
    IfHeadMoved,
    /// Every read counts: the first, SIGHUP, `specd reconcile`, the periodic resync.
    Always,
}

/// The agent between two triggers: its source, the units' workers, the head it read last.
struct Units {
    /// The unit the agent runs as ([`own_main_unit`]).
    own_unit: Option<String>,
    src: Arc<Mutex<GitSource>>,
    cfg: AgentConfig,
    hostname: String,
    state_dir: PathBuf,
    ctx: Arc<Ctx<RealHost>>,
    metrics: Arc<Metrics>,
    workers: BTreeMap<String, Worker>,
    last_head: Option<String>,
}

impl Units {
    /// Read the head of the source and hand each unit its desired state, if the head may deploy.
    async fn sync_source(&mut self, read: Read) {
        let Units { src, cfg, hostname, state_dir, ctx, metrics, workers, last_head, .. } = self;
        let store = &ctx.store;
        let started = Instant::now();
        metrics.source_read();
        let prev = SourceState::load(state_dir).unwrap_or_default();
        let s2 = src.clone();
        let accepted = prev.accepted_commit.clone();
        let allow_rewind = cfg.allow_rewind;
        let (host, labels, record) = (hostname.to_string(), cfg.labels.0.clone(), prev.accepted_record.clone());
        let res = tokio::task::spawn_blocking(move || {
            let s = lock(&s2);
            let who = Follower { host: &host, labels: &labels, record: record.as_deref() };
            catch(|| evaluate(&s, accepted.as_deref(), allow_rewind, who))
        })
        .await;
        let eval = match res {
            Ok(Ok(e)) => e,
            Ok(Err(e)) => Evaluation {
                head: None,
                error: Some(format!("the source: internal error while reading specs: {e}; nothing changed")),
                desired: vec![],
                fleet: None,
            },
            Err(e) => Evaluation {
                head: None,
                error: Some(format!("the source: internal error while reading specs: {e}; nothing changed")),
                desired: vec![],
                fleet: None,
            },
        };
        let eval = gate_units(eval, cfg.manage_units.as_deref());
        let mut st = SourceState {
            repo: cfg.repo.clone().unwrap_or_default(),
            followed: lock(src).followed(),
            accepted_commit: prev.accepted_commit.clone(),
            head_commit: eval.head.clone(),
            error: eval.error.clone(),
            time: store::now(),
            orphans: prev.orphans.clone(),
            fleet: eval.fleet.clone(),
            accepted_record: prev.accepted_record.clone(),
        };
        if eval.head.is_some() {
            metrics.source_reached(st.time);
        }
        if let Some(accepted) = &prev.accepted_commit {
            metrics.source_revision(accepted);
        }
        if read == Read::IfHeadMoved && eval.seen() == *last_head && eval.error.is_none() {
            return;
        }
        *last_head = eval.seen();
        if let Some(e) = eval.error.as_deref().or(eval.waiting()) {
            match eval.error {
                Some(_) => tracing::error!(commit = eval.head.as_deref().unwrap_or("-"), "not deployed: {e}"),
                // A fleet's host before its promotion record: it keeps what it runs.
                None => tracing::info!(commit = eval.head.as_deref().unwrap_or("-"), "{e}"),
            }
            // Bad commit: the source's state says why (every unit's status shows it); change
            // nothing. A unit's own state is written only by its reconciles.
            let _ = st.save(state_dir);
            // Starting with a head that may not deploy: keep the units on the accepted commit (finish
            // interrupted applies, start stopped units) rather than leaving them unreconciled.
            if workers.is_empty()
                && let Some(acc) = prev.accepted_commit.as_deref().and_then(|a| git2::Oid::from_str(a).ok())
            {
                let (s2, host) = (src.clone(), hostname.to_string());
                let fallback = tokio::task::spawn_blocking(move || read_commit(&lock(&s2), acc, &host)).await;
                // The accepted commit passes the same gate as a new head (manage_units may have
                // been narrowed since it was accepted); its other units are kept running.
                let fallback = fallback.map(|r| {
                    r.map(|desired| {
                        let (managed, refused) = manage_gate(desired, cfg.manage_units.as_deref());
                        for (d, e) in refused {
                            tracing::warn!("the accepted commit's {}: {e}; left alone", d.spec.unit);
                        }
                        managed
                    })
                });
                match fallback {
                    Ok(Ok(desired)) => {
                        tracing::info!(commit = %short(&acc.to_string()), "reconciling the units of the accepted commit");
                        for d in desired {
                            ensure_worker(workers, d, ctx, metrics);
                        }
                    }
                    Ok(Err(e)) => tracing::error!("the accepted commit cannot be read either: {e}"),
                    Err(e) => tracing::error!("reading the accepted commit panicked: {e}"),
                }
            }
            return;
        }
        // The head, or with a fleet file the revision the promotion record assigns this host.
        let commit = eval.revision().unwrap_or_default().to_string();
        st.accepted_commit = Some(commit.clone());
        st.accepted_record = eval.fleet.as_ref().and_then(|f| f.record.clone());
        metrics.source_revision(&commit);
        let mut seen = Vec::new();
        for d in eval.desired {
            seen.push(d.spec.unit.clone());
            ensure_worker(workers, d, ctx, metrics);
        }

        // Units specd manages that this commit has no spec for: orphaned (left running) or pruned.
        let managed = store.units().unwrap_or_default();
        let orphans: Vec<String> = managed.into_iter().filter(|u| !seen.contains(u)).collect();
        for u in &orphans {
            if let Some(w) = workers.remove(u) {
                // Its worker ends after the reconcile it may be in (it sees its sender gone).
                drop(w.desired);
                metrics.forget(u);
            }
            if cfg.prune {
                // In the background, under the unit's lock: a stop may take TimeoutStopSec.
                let (ctx, u) = (ctx.clone(), u.clone());
                tokio::spawn(async move { reconcile::prune(&ctx, &u).await });
            } else if !prev.orphans.contains(u) {
                tracing::warn!(unit = %u, "orphaned: its spec is gone from {}; left running (set prune: true to remove it)", short(&commit));
            }
        }
        st.orphans = if cfg.prune { vec![] } else { orphans };
        let _ = st.save(state_dir);
        tracing::info!(commit = %short(&commit), units = seen.len(), ms = started.elapsed().as_millis() as u64, "source read");
    }

    fn poke(&self, unit: &str) {
        if let Some(w) = self.workers.get(unit) {
            w.poke.notify_one();
        }
    }

    fn poke_all(&self) {
        self.workers.values().for_each(|w| w.poke.notify_one());
    }
}

/// The manage_units gate (see [`crate::core::owner`]): the desired units this agent may manage, and
/// those it may not with why.
fn manage_gate(desired: Vec<DesiredState>, pattern: Option<&str>) -> (Vec<DesiredState>, Vec<(DesiredState, String)>) {
    let own = crate::core::owner::own_unit();
    let (mut managed, mut refused) = (Vec::new(), Vec::new());
    for d in desired {
        match crate::core::owner::may_manage(&d.spec.unit, own.as_deref(), pattern) {
            Ok(()) => managed.push(d),
            Err(e) => refused.push((d, e)),
        }
    }
    (managed, refused)
}

/// A commit with a unit this agent may not manage is not deployed.
fn gate_units(mut eval: Evaluation, pattern: Option<&str>) -> Evaluation {
    let commit = eval.revision().map(short).unwrap_or("-").to_string();
    let (managed, refused) = manage_gate(std::mem::take(&mut eval.desired), pattern);
    if refused.is_empty() {
        eval.desired = managed;
        return eval;
    }
    let why: Vec<String> = refused
        .iter()
        .map(|(d, e)| {
            let file = match &d.source {
                Some(Source::Commit { path, .. }) => format!("{path}@{commit}"),
                _ => commit.clone(),
            };
            format!("{file}: spec.unit: {e}")
        })
        .collect();
    eval.error = Some(format!("commit {commit} is not deployed; nothing changed:\n{}", why.join("\n")));
    eval
}

/// Hand a unit its desired state: to its worker, started if it has none.
fn ensure_worker(
    workers: &mut BTreeMap<String, Worker>,
    d: DesiredState,
    ctx: &Arc<Ctx<RealHost>>,
    metrics: &Arc<Metrics>,
) {
    let unit = d.spec.unit.clone();
    let d = Arc::new(d);
    match workers.get(&unit) {
        Some(w) => {
            let changed = w.desired.borrow().unit.sha256 != d.unit.sha256 || w.desired.borrow().source != d.source;
            if changed {
                let _ = w.desired.send(d);
            }
        }
        None => {
            let (tx, rx) = watch::channel(d);
            let poke = Arc::new(Notify::new());
            let handle = tokio::spawn(worker(unit.clone(), rx, poke.clone(), ctx.clone(), metrics.clone()));
            workers.insert(unit, Worker { desired: tx, poke, handle });
        }
    }
}

/// One unit's reconcile loop: reconcile, then wait for what is due (a change of the desired
/// state, a poke, the requeue, the end of a hold's process, the agent's stop).
async fn worker<H: AgentHost>(
    unit: String,
    mut rx: watch::Receiver<Arc<DesiredState>>,
    poke: Arc<Notify>,
    ctx: Arc<Ctx<H>>,
    metrics: Arc<Metrics>,
) {
    // Failures in a row (errors, or applies that did not reach their unit): the error policy's
    // attempt; reset by any reconcile that did not fail.
    let mut failures = 0u32;
    // What the agent last said of a hold on this unit (to say it once).
    let mut last_held: Option<String> = None;
    // The unit's instances whose deaths were counted, and the one that ran at the last look.
    let mut looks = Looks::default();
    loop {
        if ctx.shutdown.is_set() {
            return;
        }
        let d = rx.borrow_and_update().clone();
        let t0 = Instant::now();
        // A hold (suspend, pin, sweep) in effect: observe and report only.
        let held = hands_off(&ctx, &unit, &d.unit.sha256, &metrics).await;
        let dry_run = held.is_some();
        if dry_run {
            // What the source wants now is recorded (status compares the host with it: a held
            // unit still shows its drift), and nothing is done about it.
            let rec = store::DesiredRecord {
                sha256: d.unit.sha256.clone(),
                source: d.source.clone(),
                time: ctx.host.now(),
                spec: d.spec.clone(),
            };
            if let Err(e) = ctx.store.set_desired(&unit, rec).await {
                tracing::warn!(unit = %unit, "recording its desired state: {e:#}");
            }
        }
        // In a task of its own: a panic in one reconcile is an error of this unit, reported and
        // retried with backoff; the worker, the other units and the main loop go on.
        let run = {
            let (ctx, d) = (ctx.clone(), d.clone());
            tokio::spawn(async move { reconcile::reconcile(&ctx, &d, dry_run).await })
        };
        let result = match run.await {
            Ok(r) => r,
            Err(e) => Err(reconcile::ReconcileError::Io(anyhow::anyhow!("internal error while reconciling: {e}"))),
        };
        // The sync status the metrics' look after the reconcile reports.
        let look;
        let wait = match (result, &held) {
            (Ok(r), Some((why, recheck, _))) => {
                failures = 0;
                let now = sync_after(&r);
                metrics.reconciled(&unit, now, "held", t0.elapsed().as_secs_f64(), false);
                look = now;
                // Said once per hold and sync status, not at every look.
                let said = format!("{why}: {}", r.verdict);
                if last_held.as_ref() != Some(&said) {
                    tracing::info!(unit = %unit, "hands off ({why}); observed: {}", r.verdict);
                    last_held = Some(said);
                }
                *recheck
            }
            (Ok(r), None) => {
                last_held = None;
                let failed = matches!(r.outcome, Some(Outcome::Failed | Outcome::RolledBack));
                let result = r.outcome.map_or("none".to_string(), |o| format!("{o:?}").to_lowercase());
                // The status after this reconcile, not the one it started from.
                let now = sync_after(&r);
                metrics.reconciled(&unit, now, &result, t0.elapsed().as_secs_f64(), failed);
                look = now;
                // What an operator must hear of (`journalctl -p warning`): the desired unit does
                // not run, whether the last good one was restored or nothing could be.
                match r.outcome {
                    Some(Outcome::RolledBack | Outcome::Failed | Outcome::Refused) => {
                        tracing::warn!(unit = %unit, "{}", r.verdict)
                    }
                    Some(_) => tracing::info!(unit = %unit, "{}", r.verdict),
                    None => {}
                }
                crate::notify::after_reconcile(&ctx, &d, &r, t0.elapsed()).await;
                match (r.outcome, r.action) {
                    // A failed apply asks to come back; the error policy says when, at the
                    // earliest what it asked.
                    (Some(Outcome::Failed), Action::Requeue(d)) => {
                        let Action::Requeue(backoff) = reconcile::error_policy(failures) else { unreachable!() };
                        failures = failures.saturating_add(1);
                        Some(jitter(backoff).max(d))
                    }
                    (_, Action::Requeue(d)) => {
                        failures = 0;
                        Some(d)
                    }
                    (_, Action::AwaitChange) => {
                        failures = 0;
                        None
                    }
                }
            }
            (Err(e), _) => {
                tracing::error!(unit = %unit, "reconcile failed: {e}");
                metrics.reconciled(
                    &unit,
                    crate::core::plan::SyncStatus::Failed,
                    "error",
                    t0.elapsed().as_secs_f64(),
                    true,
                );
                look = crate::core::plan::SyncStatus::Failed;
                let action = reconcile::error_policy(failures);
                failures = failures.saturating_add(1);
                match action {
                    Action::Requeue(d) => Some(jitter(d)),
                    Action::AwaitChange => None,
                }
            }
        };
        // The metrics' look (the journal read when another instance runs than at the last one)
        // never delays a new desired state nor the agent's stop: cut short by either, its deaths
        // are counted at the look after the next reconcile (a look cut short counted none).
        let changed = tokio::select! {
            biased;
            _ = looks.after(&ctx, &metrics, &d, look) => false,
            r = rx.changed() => {
                if r.is_err() {
                    return;
                }
                true
            }
            _ = ctx.shutdown.wait() => return,
        };
        if changed {
            continue;
        }
        // No timer at all when nothing is due: a unit at rest wakes only on a change.
        let requeue = async {
            match wait {
                Some(d) => tokio::time::sleep(d).await,
                None => std::future::pending().await,
            }
        };
        // A sweep that holds the unit: its process's exit.
        let sweep_ends = async {
            match held.as_ref().and_then(|(_, _, hold)| hold.as_ref()) {
                Some(hold) => ctx.host.holder_exit(hold).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            r = rx.changed() => if r.is_err() { return },
            _ = poke.notified() => {}
            _ = requeue => {}
            _ = sweep_ends => {}
            _ = ctx.shutdown.wait() => return,
        }
    }
}

/// The sync status after a reconcile, not the one it started from (`sync::status`: the worker
/// holds the unit's lock for its reconciles, and its metrics follow what they do, not the
/// history).
fn sync_after(r: &reconcile::Report) -> crate::core::plan::SyncStatus {
    crate::core::sync::status(crate::core::sync::Seen {
        planned: r.plan.sync,
        outcome: r.outcome,
        applying: false,
        last_try: None,
    })
}

/// What a worker keeps between its looks for the metrics: the deaths counted, and the instance
/// that ran at the last look.
#[derive(Default)]
struct Looks {
    deaths: crate::daemon::metrics::Deaths,
    ran: Option<String>,
}

impl Looks {
    /// After a reconcile of `d` that left the unit `sync`: whether it runs, its figures from its
    /// state ([`crate::daemon::metrics::UnitFigures::of`]), and the deaths of its instances since the
    /// last look (the journal is read only when the instance that runs changed).
    async fn after<H: AgentHost>(
        &mut self,
        ctx: &Ctx<H>,
        metrics: &Metrics,
        d: &DesiredState,
        sync: crate::core::plan::SyncStatus,
    ) {
        let unit = &d.spec.unit;
        record_figures(ctx, metrics, d, sync);
        let Ok(p) = ctx.host.show(unit).await else { return };
        metrics.down(unit, !p.active_state.is_up());
        let current = if p.active_state.may_run() { p.invocation_id.clone() } else { String::new() };
        if self.deaths.started() && self.ran.as_deref() == Some(current.as_str()) {
            return;
        }
        // An end the journal has not shown within the wait is counted at the next change (its
        // instance is not taken as seen until it shows its end).
        let found = ctx.host.instances(unit, &current, timing::DEATH_IN_JOURNAL_WITHIN).await;
        let died = self.deaths.take(&found);
        if !died.is_empty() {
            tracing::debug!(unit = %unit, ?died, "deaths counted");
        }
        metrics.died(unit, &died);
        self.ran = Some(current);
    }
}

/// A unit's figures (deployed revision and hash, args verified, the speculation proof,
/// quarantine) from its state after a reconcile that left it `sync`.
fn record_figures<H: crate::host::Host>(
    ctx: &Ctx<H>,
    metrics: &Metrics,
    d: &DesiredState,
    sync: crate::core::plan::SyncStatus,
) {
    let unit = &d.spec.unit;
    match ctx.store.peek(unit) {
        Ok(st) => {
            let checks_args = reconcile::desired_of(&ctx.unit_dir, d).verify_args;
            let in_sync = sync == crate::core::plan::SyncStatus::InSync;
            metrics.unit(unit, &crate::daemon::metrics::UnitFigures::of(&st, &d.unit.sha256, checks_args, in_sync));
        }
        Err(e) => tracing::warn!(unit = %unit, "reading its state for the metrics: {e:#}"),
    }
}

/// A hold that keeps the agent's hands off: why, when to look again (`None`: at the next change
/// or request), and the hold whose process's exit ends it (a sweep's).
type HandsOff = (String, Option<Duration>, Option<crate::core::hold::Hold>);

/// Whether a hold keeps the agent's hands off `unit` now (see [`HandsOff`]). A hold that ended
/// (expired, its sweep gone, the source moved past a pin) is cleared here, recorded in the unit's
/// history, and the agent acts again.
async fn hands_off<H: AgentHost>(ctx: &Ctx<H>, unit: &str, desired_sha: &str, metrics: &Metrics) -> Option<HandsOff> {
    let store = &ctx.store;
    let hold = match store.peek(unit) {
        Ok(st) => st.hold,
        Err(e) => {
            tracing::warn!(unit = %unit, "reading its state for a hold: {e:#}");
            None
        }
    };
    metrics.hold(unit, hold.as_ref().map(|h| h.kind));
    let now = ctx.host.now();
    match ctx.host.hold_effect(hold.as_ref(), desired_sha) {
        crate::core::hold::HoldEffect::Acts => None,
        crate::core::hold::HoldEffect::HandsOff(why) => {
            let h = hold?;
            let until = h.until.map(|u| Duration::from_secs(u.saturating_sub(now).max(1)));
            // A sweep's process may end without a word: its exit wakes the worker (a pidfd, or
            // a look every few seconds where there is none).
            let exits = h.pid.is_some().then(|| h.clone());
            Some((why, until, exits))
        }
        crate::core::hold::HoldEffect::Expired(why) => {
            let h = hold?;
            match store.clear_hold_if(unit, &why, |x| *x == h).await {
                Ok(Some(_)) => tracing::info!(unit = %unit, "hold ended ({why}): the agent acts on it again"),
                Ok(None) => {}
                Err(e) => tracing::error!(unit = %unit, "clearing its hold that ended ({why}): {e:#}"),
            }
            // A hold set again meanwhile is the next look's.
            metrics.hold(unit, None);
            None
        }
    }
}

/// One inotify watch (one thread) for both: the local repository's refs (a moved ref is a
/// [`Trigger::Source`]) and the unit directory (a changed unit file or drop-in is that unit's
/// [`Trigger::Unit`]). Lock files and specd's own temporary files are not changes: a ref moves
/// when git renames `main.lock` to `main`, and that rename is the one event read.
fn watcher(src: &GitSource, unit_dir: &Path, tx: mpsc::UnboundedSender<Trigger>) -> Result<notify::RecommendedWatcher> {
    use notify::{RecursiveMode, Watcher};
    let refs = src.watch_paths();
    let units = unit_dir.to_path_buf();
    let mut w = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
        // Events were lost (the kernel's queue overflowed, or the watch failed): look at
        // everything, as a SIGHUP does.
        let lost = |tx: &mpsc::UnboundedSender<Trigger>| {
            let _ = tx.send(Trigger::Source);
            let _ = tx.send(Trigger::All);
        };
        let Ok(ev) = res else { return lost(&tx) };
        if ev.need_rescan() {
            return lost(&tx);
        }
        if matches!(ev.kind, notify::EventKind::Access(_)) {
            return;
        }
        for p in &ev.paths {
            let name = p.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
            if name.ends_with(".lock") || name.ends_with(".specd-tmp") {
                continue;
            }
            if p.starts_with(&units) {
                let parent =
                    p.parent().and_then(|x| x.file_name()).map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
                if name.ends_with(".service") {
                    let _ = tx.send(Trigger::Unit(name));
                } else if let Some(u) = parent.strip_suffix(".d").filter(|u| u.ends_with(".service")) {
                    let _ = tx.send(Trigger::Unit(u.to_string()));
                } else if let Some(u) = name.strip_suffix(".d").filter(|u| u.ends_with(".service")) {
                    let _ = tx.send(Trigger::Unit(u.to_string()));
                }
            } else {
                let s = p.to_string_lossy();
                if s.contains("/refs/") || name == "packed-refs" || name == "HEAD" {
                    let _ = tx.send(Trigger::Source);
                }
            }
        }
    })?;
    for p in &refs {
        if p.is_dir() {
            let mode = if p.ends_with("refs") { RecursiveMode::Recursive } else { RecursiveMode::NonRecursive };
            w.watch(p, mode).with_context(|| format!("watching {}", p.display()))?;
        }
    }
    if unit_dir.is_dir() {
        w.watch(unit_dir, RecursiveMode::Recursive).with_context(|| format!("watching {}", unit_dir.display()))?;
    }
    Ok(w)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn workers_are_joined_under_one_deadline() {
        let stuck = || tokio::spawn(std::future::pending::<()>());
        // Once the one deadline has passed, no worker gets time of its own: every unfinished
        // one is named at once (a timeout per worker would wait for each in turn).
        let handles = vec![("a".to_string(), stuck()), ("b".to_string(), stuck()), ("c".to_string(), stuck())];
        assert_eq!(join_within(handles, std::future::ready(())).await, ["a", "b", "c"]);
        // A worker that finished while the join waited for another is not late. The deadline
        // passes when that worker ends (a task ends in the poll that sends).
        let (ended_tx, ended_rx) = tokio::sync::oneshot::channel::<()>();
        let ends = tokio::spawn(async move {
            let _ = ended_tx.send(());
        });
        let deadline = async move {
            let _ = ended_rx.await;
        };
        assert_eq!(join_within(vec![("d".to_string(), stuck()), ("e".to_string(), ends)], deadline).await, ["d"]);
        // Before the deadline, every worker is waited for.
        let handles = vec![("f".to_string(), tokio::spawn(async {})), ("g".to_string(), tokio::spawn(async {}))];
        assert!(join_within(handles, std::future::pending()).await.is_empty());
    }

    #[test]
    fn a_burst_of_forced_reads_is_one_read_now_and_one_at_the_end_of_the_second() {
        let t0 = tokio::time::Instant::now();
        let mut f = ForcedReads::default();
        assert!(f.ask(t0));
        assert_eq!(f.due, None);
        // Within the second: put off to its end, however many ask.
        assert!(!f.ask(t0 + Duration::from_millis(100)));
        assert!(!f.ask(t0 + Duration::from_millis(900)));
        assert_eq!(f.due, Some(t0 + timing::FORCED_READ_EVERY));
        assert_eq!(f.last, Some(t0));
        // A second later, a read at once.
        let mut f = ForcedReads::default();
        assert!(f.ask(t0));
        assert!(f.ask(t0 + timing::FORCED_READ_EVERY));
        assert_eq!((f.last, f.due), (Some(t0 + timing::FORCED_READ_EVERY), None));
    }

    /// The value of the one sample `name{labels}` in `text`, if there is one.
    fn sample(text: &str, name: &str, labels: &str) -> Option<f64> {
        let key = format!("{name}{{{labels}}} ");
        text.lines().find_map(|l| l.strip_prefix(key.as_str())).and_then(|v| v.trim().parse().ok())
    }

    /// What the worker records after each reconcile (`sync_after`, `record_figures`), from the
    /// real reconciler's outcomes on the fake host: an apply, a failed apply rolled back and
    /// quarantined, the look after it, and a spec whose args are not checked.
    #[tokio::test(start_paused = true)]
    async fn each_unit_metric_follows_the_reconcile_outcomes() {
        use crate::host::fake::FakeHost;
        const UNIT: &str = "sglang-qwen.service";
        let dir = tempfile::tempdir().unwrap();
        let host = FakeHost::new(UNIT, &dir.path().join("units"));
        let ctx = Ctx {
            host: host.clone(),
            unit_dir: dir.path().join("units"),
            store: Store::new(dir.path().join("state")),
            events: Arc::new(|_: &str, _: &reconcile::Event| {}),
            shutdown: Shutdown::never(),
            holds: reconcile::Holds::Obeyed,
        };
        let spec = |steps: u32, tail: &str| {
            let yaml = format!(
                "apiVersion: specd/v1\nkind: InferenceService\nmetadata: {{name: qwen}}\nspec:\n  unit: {UNIT}\n  engine: sglang\n  command: [/opt/sglang/bin/python3, -m, sglang.launch_server]\n  model: /models/qwen\n  server: {{port: 30000}}\n  speculative: {{algorithm: EAGLE, draft_model: /models/draft, num_steps: {steps}, eagle_topk: 1, num_draft_tokens: {}}}\n{tail}",
                steps + 1
            );
            specd_spec::parse("qwen.yaml", &yaml).unwrap().resolve(None).unwrap()
        };
        let from = |c: &str| {
            Some(Source::Commit { repo: "/srv/config".into(), commit: c.into(), path: "specs/qwen.yaml".into() })
        };
        let old = DesiredState::new(spec(3, ""), from("c1"));
        let new = DesiredState::new(spec(5, ""), from("c2"));
        host.serves(&old.spec, false);
        host.serves(&new.spec, true);
        let m = Metrics::default();
        let look = |d: &DesiredState, r: &reconcile::Report| {
            let sync = sync_after(r);
            m.reconciled(UNIT, sync, "x", 0.1, false);
            record_figures(&ctx, &m, d, sync);
            m.render()
        };
        let u = format!("unit=\"{UNIT}\"");
        let info = |t: &str, rev: &str, hash: &str| {
            sample(t, "specd_unit_info", &format!("{u},revision=\"{rev}\",unit_hash=\"{hash}\""))
        };

        // Applied: its commit and hash, args proven, the proof's figures (the fake measures a
        // rate, no length), nothing quarantined.
        let r = reconcile::reconcile(&ctx, &old, false).await.unwrap();
        assert_eq!(r.outcome, Some(Outcome::Applied), "{}", r.verdict);
        let t = look(&old, &r);
        assert_eq!(info(&t, "c1", &old.unit.sha256), Some(1.0), "{t}");
        assert_eq!(sample(&t, "specd_unit_args_verified", &u), Some(1.0), "{t}");
        assert_eq!(sample(&t, "specd_unit_accept_rate", &u), Some(0.75), "{t}");
        assert_eq!(sample(&t, "specd_unit_accept_length", &u), None, "{t}");
        assert_eq!(sample(&t, "specd_unit_quarantined", &u), Some(0.0), "{t}");
        assert_eq!(sample(&t, "specd_unit_sync", &format!("{u},status=\"InSync\"")), Some(1.0), "{t}");

        // c2's unit fails to start: rolled back, quarantined; c1's unit runs, and is the one
        // info series; the desired unit is not the one proven.
        for _ in 0..2 {
            let r = reconcile::reconcile(&ctx, &new, false).await.unwrap();
            let t = look(&new, &r);
            assert_eq!(t.matches("specd_unit_info{").count(), 1, "{t}");
            assert_eq!(info(&t, "c1", &old.unit.sha256), Some(1.0), "{}\n{t}", r.verdict);
            assert_eq!(sample(&t, "specd_unit_args_verified", &u), Some(0.0), "{t}");
            assert_eq!(sample(&t, "specd_unit_quarantined", &u), Some(1.0), "{t}");
            assert_eq!(sample(&t, "specd_unit_accept_rate", &u), Some(0.75), "{t}");
            assert_eq!(sample(&t, "specd_unit_sync", &format!("{u},status=\"Failed\"")), Some(1.0), "{t}");
        }

        // A spec whose args are not checked (c3) applies: no args series, the new info only.
        let unchecked = DesiredState::new(spec(4, "  readiness: {verify_args: false}\n"), from("c3"));
        host.serves(&unchecked.spec, false);
        let r = reconcile::reconcile(&ctx, &unchecked, false).await.unwrap();
        assert_eq!(r.outcome, Some(Outcome::Applied), "{}", r.verdict);
        let t = look(&unchecked, &r);
        assert_eq!(t.matches("specd_unit_info{").count(), 1, "{t}");
        assert_eq!(info(&t, "c3", &unchecked.unit.sha256), Some(1.0), "{t}");
        assert_eq!(sample(&t, "specd_unit_args_verified", &u), None, "{t}");
        assert_eq!(sample(&t, "specd_unit_quarantined", &u), Some(0.0), "{t}");
    }

    /// A daemon-reload during the agent's stop sets its stop's timer again from its unit's
    /// `TimeoutStopSec=`: while an apply is carried past its old instance's stop, a drop-in says
    /// the time the whole stop needs, counted from its beginning; gone when the stop ends, or at
    /// the next start after a stop that was killed.
    #[tokio::test(start_paused = true)]
    async fn the_stop_s_time_is_in_a_drop_in_of_the_agent_s_unit_while_an_apply_is_carried() {
        let dir = tempfile::tempdir().unwrap();
        let drop_in = dir.path().join("specd.service.d/zz-specd-stopping.conf");
        let mut t = StopTimeout::new(dir.path(), Some("specd.service"));
        t.extend(timing::STOP_WITHIN, &[]);
        assert!(!drop_in.exists(), "nothing carried: the unit's own timeout is enough");
        tokio::time::sleep(Duration::from_secs(10)).await;
        t.extend(Duration::from_secs(400), &["sglang-qwen.service".to_string()]);
        let text = std::fs::read_to_string(&drop_in).unwrap();
        // 10 s since the stop began, 400 s for the workers, 5 s for notices, 10 s to exit.
        assert!(text.contains("\n[Service]\nTimeoutStopSec=426\n"), "{text}");
        assert!(text.contains("sglang-qwen.service"), "{text}");
        t.end();
        assert!(!drop_in.exists() && !dir.path().join("specd.service.d").exists());
        // Not a unit (run by hand): nothing written.
        let mut t = StopTimeout::new(dir.path(), None);
        t.extend(Duration::from_secs(400), &["sglang-qwen.service".to_string()]);
        t.end();
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        // Left by a stop that was killed: removed at the next start.
        std::fs::create_dir_all(drop_in.parent().unwrap()).unwrap();
        std::fs::write(dir.path().join("specd.service.d/override.conf"), "[Service]\n").unwrap();
        std::fs::write(&drop_in, text).unwrap();
        StopTimeout::clear_leftover(dir.path(), Some("specd.service"));
        assert!(!drop_in.exists());
        assert!(dir.path().join("specd.service.d/override.conf").exists(), "a person's drop-in stays");
    }

    #[test]
    fn the_stop_fits_in_the_agent_unit_s_stop_timeout() {
        let unit = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/specd.service"));
        let secs: u64 = unit
            .lines()
            .find_map(|l| l.strip_prefix("TimeoutStopSec="))
            .expect("the agent unit sets TimeoutStopSec")
            .trim()
            .parse()
            .unwrap();
        assert!(
            timing::STOP_WITHIN + timing::NOTICES_WITHIN + timing::EXIT_WITHIN <= Duration::from_secs(secs),
            "{:?} and {:?} in {secs} s",
            timing::STOP_WITHIN,
            timing::NOTICES_WITHIN
        );
    }

    // The worker on the fake host and tokio's paused clock: its waits are virtual time, so what
    // it does at each moment is exact (no machine, no root).

    const W_UNIT: &str = "sglang-qwen.service";

    fn w_spec(steps: u32) -> specd_spec::Spec {
        w_spec_stopping_within(steps, 10)
    }

    /// The worker's spec whose server may take `timeout_stop_sec` to stop.
    fn w_spec_stopping_within(steps: u32, timeout_stop_sec: u32) -> specd_spec::Spec {
        let yaml = format!(
            "apiVersion: specd/v1\nkind: InferenceService\nmetadata: {{name: qwen}}\nspec:\n  unit: {W_UNIT}\n  engine: sglang\n  command: [/opt/sglang/bin/python3, -m, sglang.launch_server]\n  model: /models/qwen\n  server: {{port: 30000}}\n  speculative: {{algorithm: EAGLE, draft_model: /models/draft, num_steps: {steps}, eagle_topk: 1, num_draft_tokens: {}}}\n  service: {{timeout_stop_sec: {timeout_stop_sec}, drain_timeout_sec: 5}}\n",
            steps + 1
        );
        specd_spec::parse("qwen.yaml", &yaml).unwrap().resolve(None).unwrap()
    }

    /// A worker for one unit on a fake host; the sender stops the agent.
    struct Running {
        host: crate::host::fake::FakeHost,
        ctx: Arc<Ctx<crate::host::fake::FakeHost>>,
        metrics: Arc<Metrics>,
        desired: watch::Sender<Arc<DesiredState>>,
        stop: watch::Sender<bool>,
        handle: tokio::task::JoinHandle<()>,
        _dir: tempfile::TempDir,
    }

    /// `hold`: the hold the unit has when the worker starts (made on the host: a sweep's
    /// process).
    async fn run_worker(
        d: DesiredState,
        hold: impl FnOnce(&crate::host::fake::FakeHost) -> Option<crate::core::hold::Hold>,
    ) -> Running {
        let dir = tempfile::tempdir().unwrap();
        let unit = d.spec.unit.clone();
        let host = crate::host::fake::FakeHost::new(&unit, &dir.path().join("units"));
        host.serves(&d.spec, false);
        let (stop, shutdown) = Shutdown::new();
        let ctx = Arc::new(Ctx {
            host: host.clone(),
            unit_dir: dir.path().join("units"),
            store: Store::new(dir.path().join("state")),
            events: Arc::new(|_: &str, _: &reconcile::Event| {}),
            shutdown,
            holds: reconcile::Holds::Obeyed,
        });
        if let Some(h) = hold(&host) {
            ctx.store.set_hold(&unit, h).await.unwrap();
        }
        let metrics = Arc::new(Metrics::new("test"));
        let (desired, rx) = watch::channel(Arc::new(d));
        let handle = tokio::spawn(worker(unit, rx, Arc::new(Notify::new()), ctx.clone(), metrics.clone()));
        Running { host, ctx, metrics, desired, stop, handle, _dir: dir }
    }

    impl Running {
        fn reconciles(&self, result: &str) -> f64 {
            let unit = self.desired.borrow().spec.unit.clone();
            sample(&self.metrics.render(), "specd_reconciles_total", &format!("unit=\"{unit}\",result=\"{result}\""))
                .unwrap_or(0.0)
        }
    }

    /// Virtual time from the start of the test.
    async fn at(t0: tokio::time::Instant, secs: f64) {
        tokio::time::sleep_until(t0 + Duration::from_secs_f64(secs)).await;
    }

    #[tokio::test(start_paused = true)]
    async fn an_error_is_reconciled_again_by_the_error_policy_and_a_unit_in_sync_rests() {
        // A reconcile that fails at once (a unit specd never manages): retried 2 s, 4 s, 8 s
        // later (±10 %), and never more often.
        let mut spec = w_spec(3);
        spec.unit = "dbus.service".into();
        let t0 = tokio::time::Instant::now();
        let r = run_worker(DesiredState::new(spec, None), |_| None).await;
        for (secs, want) in [(0.1, 1.0), (1.7, 1.0), (2.3, 2.0), (5.3, 2.0), (6.7, 3.0), (12.4, 3.0), (15.0, 4.0)] {
            at(t0, secs).await;
            assert_eq!(r.reconciles("error"), want, "reconciles by {secs} s");
        }
        // A unit in sync: applied once, then no timer at all (an hour passes, nothing runs).
        let t0 = tokio::time::Instant::now();
        let r = run_worker(DesiredState::new(w_spec(3), None), |_| None).await;
        at(t0, 1.0).await;
        assert_eq!(r.reconciles("applied"), 1.0);
        assert_eq!(r.host.serving(), Some(w_spec(3).argv));
        let calls = r.host.calls();
        at(t0, 3600.0).await;
        assert_eq!(r.host.calls(), calls, "a unit at rest was looked at: {:?}", &r.host.call_names()[calls..]);
        // A new desired state wakes it at once.
        r.host.serves(&w_spec(5), false);
        r.desired.send(Arc::new(DesiredState::new(w_spec(5), None))).unwrap();
        at(t0, 3601.0).await;
        assert_eq!(r.host.serving(), Some(w_spec(5).argv));
        assert_eq!(r.reconciles("applied"), 2.0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_new_desired_state_is_applied_at_once_while_the_metrics_look_waits_for_the_journal() {
        // journald takes 20 s to answer the metrics' look after each reconcile.
        let t0 = tokio::time::Instant::now();
        let r = run_worker(DesiredState::new(w_spec(3), None), |h| {
            h.journal_lag(Duration::from_secs(20));
            None
        })
        .await;
        at(t0, 1.0).await;
        assert_eq!(r.reconciles("applied"), 1.0);
        assert_eq!(r.host.call_names().last(), Some(&"instances"), "the look is not waiting on the journal");
        r.host.serves(&w_spec(5), false);
        r.desired.send(Arc::new(DesiredState::new(w_spec(5), None))).unwrap();
        at(t0, 2.0).await;
        assert_eq!(r.host.serving(), Some(w_spec(5).argv), "the new unit waited for the look");
        assert_eq!(r.reconciles("applied"), 2.0);
        // The look cut short is taken after the reconcile that followed.
        let looks = r.host.call_names().iter().filter(|c| **c == "instances").count();
        assert_eq!(looks, 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_suspend_keeps_the_worker_s_hands_off_until_it_expires_then_it_applies() {
        use crate::core::hold::{Hold, HoldKind};
        let t0 = tokio::time::Instant::now();
        let epoch = crate::host::fake::EPOCH;
        let r = run_worker(DesiredState::new(w_spec(3), None), |_| {
            let mut h = Hold::new(HoldKind::Suspend, "root@host (specd suspend)", epoch);
            h.until = Some(epoch + 30);
            Some(h)
        })
        .await;
        at(t0, 29.0).await;
        assert_eq!(r.host.stops_and_starts(), (0, 0), "acted under a suspend");
        assert_eq!(r.reconciles("held"), 1.0, "looked once, then waited for the hold's end");
        at(t0, 32.0).await;
        assert_eq!(r.host.serving(), Some(w_spec(3).argv), "not applied once the suspend expired");
        let st = r.ctx.store.peek(W_UNIT).unwrap();
        assert!(st.hold.is_none());
        assert!(st.history.iter().any(|h| h.outcome == Outcome::HoldCleared && h.message.contains("expired")));
    }

    #[tokio::test(start_paused = true)]
    async fn a_sweep_that_dies_wakes_the_worker_at_once_and_it_acts_again() {
        use crate::core::hold::{Hold, HoldKind};
        let t0 = tokio::time::Instant::now();
        let epoch = crate::host::fake::EPOCH;
        let mut sweep = 0;
        let r = run_worker(DesiredState::new(w_spec(3), None), |host| {
            sweep = host.spawn_holder();
            let mut h = Hold::new(HoldKind::Sweep, "specd sweep qwen-steps", epoch);
            h.until = Some(epoch + 7200);
            h.pid = Some(sweep);
            Some(h)
        })
        .await;
        at(t0, 600.0).await;
        assert_eq!(r.host.stops_and_starts(), (0, 0), "acted under a sweep");
        r.host.end_holder(sweep);
        // No timer: its exit is what wakes the worker.
        at(t0, 601.0).await;
        assert_eq!(r.host.serving(), Some(w_spec(3).argv), "the worker did not act after the sweep died");
        let st = r.ctx.store.peek(W_UNIT).unwrap();
        assert!(st.history.iter().any(|h| h.outcome == Outcome::HoldCleared && h.message.contains("is gone")));
    }

    #[tokio::test(start_paused = true)]
    async fn asked_to_stop_during_an_apply_the_worker_ends_and_leaves_a_server_that_serves() {
        let t0 = tokio::time::Instant::now();
        let r = run_worker(DesiredState::new(w_spec(3), None), |_| None).await;
        at(t0, 1.0).await;
        assert_eq!(r.host.serving(), Some(w_spec(3).argv));
        // A new spec; specd is asked to stop while the new server loads.
        r.host.serves(&w_spec(5), false);
        r.desired.send(Arc::new(DesiredState::new(w_spec(5), None))).unwrap();
        let (_, starts) = r.host.stops_and_starts();
        while r.host.stops_and_starts().1 == starts {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        r.stop.send(true).unwrap();
        tokio::time::timeout(Duration::from_secs(60), r.handle).await.expect("the worker did not end").unwrap();
        // The instance it started loads on: a server serves (the new one), never none.
        at(t0, 10.0).await;
        assert_eq!(r.host.serving(), Some(w_spec(5).argv));
        let st = r.ctx.store.peek(W_UNIT).unwrap();
        assert!(st.in_progress.is_some(), "the next run finishes the apply it recorded");
    }

    /// The README's SGLang server: `timeout_stop_sec: 300`, and a stop that drains a long request
    /// for 200 s, longer than the agent's own wait at its stop (`STOP_WITHIN`). Asked to stop
    /// during that stop, the agent waits for the apply to start the new instance, asks systemd
    /// for the time, and exits with the unit starting: never down.
    #[tokio::test(start_paused = true)]
    async fn asked_to_stop_during_an_old_instance_s_long_stop_the_agent_waits_for_the_new_start() {
        let (old, new) = (w_spec_stopping_within(3, 300), w_spec_stopping_within(5, 300));
        let drains = Duration::from_secs(200);
        assert!(drains > timing::STOP_WITHIN);
        let t0 = tokio::time::Instant::now();
        let r = run_worker(DesiredState::new(old.clone(), None), |h| {
            h.exits_after_term(drains);
            None
        })
        .await;
        at(t0, 1.0).await;
        assert_eq!(r.host.serving(), Some(old.argv.clone()));
        r.host.serves(&new, false);
        r.desired.send(Arc::new(DesiredState::new(new.clone(), None))).unwrap();
        let (stops, _) = r.host.stops_and_starts();
        while r.host.stops_and_starts().0 == stops {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        // SIGTERM a second into the old instance's stop.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let stopped_at = tokio::time::Instant::now();
        r.stop.send(true).unwrap();
        let mut asked = Vec::new();
        let late = join_at_stop(vec![(W_UNIT.to_string(), r.handle)], &r.ctx.shutdown, |d, _| asked.push(d)).await;
        let waited = stopped_at.elapsed();
        // The agent exits now: a worker still in its apply would end with it, the old instance
        // stopped and no new one started.
        assert!(late.is_empty(), "left in their apply as the agent exits after {waited:?}: {late:?}");
        at(t0, 400.0).await;
        assert_eq!(r.host.serving(), Some(new.argv.clone()));
        // It waited for the old instance's stop (not more than the stop's budget and the wait
        // after it), and asked systemd for as long before its own unit's timeout ran out.
        assert!(waited >= drains - Duration::from_secs(2), "{waited:?}");
        let most = timing::stop_budget(300) + timing::STOP_WITHIN;
        assert!(waited < most, "{waited:?}");
        let longest = asked.iter().max().copied().unwrap_or_default();
        assert!(longest > drains && longest <= most, "{asked:?}");
        let st = r.ctx.store.peek(W_UNIT).unwrap();
        assert!(st.in_progress.is_some(), "the next run verifies the instance it started");
    }
}
