//! `specd run`: the agent. Follows a git source, keeps one worker per unit (units reconcile
//! concurrently; one unit never has two reconciles at once), and reconciles on change: a new
//! commit, an edit of a managed unit file or drop-in, SIGHUP or `specd reconcile`, and a periodic
//! resync. Errors back off per unit. Talks to systemd with sd-notify when run as a service.

pub mod listen;
pub mod metrics;
mod stop;
mod triggers;
mod units;
mod worker;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result};
use tokio::sync::{Notify, mpsc, watch};

use crate::config::AgentConfig;
use crate::core::guard::lock;
use crate::host::Host;
use crate::reconcile::context::{self, Dirs};
use crate::reconcile::progress::{self, Sink};

use crate::daemon::metrics::Metrics;
use crate::machine::store::Store;
use crate::reconcile::{self, Ctx, DesiredState, Shutdown};
use crate::source::git::GitSource;
use stop::{StopTimeout, own_main_unit, stop};
use triggers::{ForcedReads, Schedule, forward_sighup, forward_unit_changes, jitter, spawn_watchdog, watcher};
use units::{Read, Units};

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
    context::set_balancers(cfg.load_balancer.balancers());
    let ctx = Arc::new(Ctx {
        holds: reconcile::Holds::Obeyed,
        ..context::host_ctx(&opts.dirs, progress::events(Sink::Log), shutdown)
    });
    let own_unit = own_main_unit(&ctx.host).await;
    StopTimeout::clear_leftover(&ctx.unit_dir, own_unit.as_deref());
    let metrics = Arc::new(Metrics::default());
    metrics.host_info(&hostname, &cfg.labels.0);
    metrics.serving_from(crate::machine::serving::ServingFiles::host(), cfg.load_balancer.balancers());
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
    let poll_now = Arc::new(tokio::sync::Notify::new());
    let endpoints = Endpoints::serve(&cfg, nofile, &metrics, trig_tx.clone(), poll_now.clone()).await?;
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
        leaving: Vec::new(),
        last_head: None,
    };
    units.sync_source(Read::Always).await;
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]);
    tracing::info!(units = units.workers.len(), "ready");

    let mut schedule = Schedule::new(&cfg, lock(&src).is_remote());
    units.metrics.schedule(schedule.remote.then_some(schedule.interval), schedule.resync);
    spawn_watchdog();
    let tuning = tune(&cfg, &src_cfg, &units.hostname, &opts.dirs, &units.metrics)?;
    follow(&mut units, &mut schedule, trig_rx, &poll_now, term, int).await;
    if let Some(t) = tuning {
        t.abort();
    }
    // Nothing is triggered any more (the stop may write and remove a drop-in of its own unit).
    drop(watching);
    stop(units, stop_tx, endpoints).await;
    Ok(())
}

/// The agent's tune (`tune:` in its config, opt-in), started: its metrics registered, its loop
/// spawned (with the proposals' repository and key when it proposes).
fn tune(
    cfg: &AgentConfig,
    src: &crate::source::git::SourceConfig,
    hostname: &str,
    dirs: &Dirs,
    metrics: &Metrics,
) -> Result<Option<tokio::task::JoinHandle<()>>> {
    let Some(t) = cfg.tune.clone() else { return Ok(None) };
    let tm = crate::tune::schedule::TuneMetrics::default();
    metrics.register_tune(&tm);
    let proposals = if t.propose {
        let signing = crate::tune::propose::signing(t.sign_ssh_key.clone(), t.sign_gpg_key.clone())?;
        Some(crate::tune::propose::Options {
            source: src.clone(),
            cache: dirs.state_dir.join("propose"),
            host: hostname.to_string(),
            signing,
            author: t.author.clone().unwrap_or_else(|| crate::tune::propose::author(hostname)),
        })
    } else {
        None
    };
    tracing::info!(interval = t.interval, propose = t.propose, "tune: every speculating unit evaluated on a schedule");
    let store = Store::new(&dirs.state_dir);
    Ok(Some(tokio::spawn(crate::tune::schedule::run(t, store, proposals, tm))))
}

/// The agent's endpoints: metrics and the units' HTTP checks (TCP, read-only), HAProxy's
/// agent-check (TCP, read-only, when configured) and control actions (a Unix socket, root's or a
/// group's).
struct Endpoints {
    metrics: tokio::task::JoinHandle<()>,
    agent_check: Option<tokio::task::JoinHandle<()>>,
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
        poll: Arc<tokio::sync::Notify>,
    ) -> Result<Endpoints> {
        let limits = listen::Limits { connections: listen::metrics_connections(nofile), ..listen::METRICS };
        tracing::info!(
            "open files: up to {nofile}; the metrics endpoint serves up to {} connections at once, the control socket {}, and {} are kept for the agent's own work",
            limits.connections,
            listen::CONTROL.connections,
            listen::RESERVED_FDS
        );
        let addr = cfg.listen();
        let answers = crate::lb::Answers::new(crate::machine::serving::ServingFiles::host());
        let agent_check = match cfg.load_balancer.agent_check {
            Some(a) => Some(
                crate::lb::agent_check::serve(a, answers.clone())
                    .with_context(|| format!("load_balancer.agent_check {a}"))?,
            ),
            None => None,
        };
        let server = listen::serve_metrics(&addr, metrics.clone(), answers, poll, limits).await?;
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
        Ok(Endpoints { metrics: server, agent_check, control, socket })
    }

    /// Stop serving and remove the control socket.
    fn close(self) {
        self.metrics.abort();
        if let Some(a) = &self.agent_check {
            a.abort();
        }
        self.control.abort();
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// Follow the triggers and the schedule until SIGTERM or SIGINT.
async fn follow(
    units: &mut Units,
    s: &mut Schedule,
    mut trig_rx: mpsc::UnboundedReceiver<Trigger>,
    poll_now: &tokio::sync::Notify,
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
                let now = tokio::time::Instant::now();
                s.poll_at = now + jitter(s.interval);
                s.polled = Some(now);
                units.sync_source(Read::IfHeadMoved).await;
            }
            _ = poll_now.notified() => s.poll_sooner(tokio::time::Instant::now()),
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

#[cfg(test)]
mod tests;
