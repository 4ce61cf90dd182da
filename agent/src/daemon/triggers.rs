//! What makes the agent look: systemd's signal that a unit changed, SIGHUP, the poll of a
//! remote, the resync, forced reads (`specd reconcile`); the watchdog's ping.

use super::*;
use crate::config::AgentConfig;
use crate::core::timing;
use crate::machine::systemd::Systemd;
use crate::reconcile::Shutdown;
use crate::source::git::GitSource;
use anyhow::{Context, Result};
use std::path::Path;
use std::time::Duration;
use tokio::sync::mpsc;

/// systemd's word that a unit started, stopped or failed: that unit is looked at (a unit at
/// rest is not looked at on a timer when the source is local). Listened to again when the
/// connection closes, until the agent stops.
pub(super) fn forward_unit_changes(t: mpsc::UnboundedSender<Trigger>, systemd: Systemd, stop: Shutdown) {
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
pub(super) fn forward_sighup(t: mpsc::UnboundedSender<Trigger>) -> Result<()> {
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

/// The watchdog's ping, every half of `WatchdogSec=` when the agent's unit sets it. Its own
/// task: a slow source read in the main loop must not starve it.
pub(super) fn spawn_watchdog() {
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
pub(super) struct Schedule {
    /// A remote is polled every `interval` (jittered: the first poll anywhere from half to one
    /// and a half of it, [`timing::first_poll`]); a local one is watched instead.
    pub(super) remote: bool,
    pub(super) interval: Duration,
    pub(super) poll_at: tokio::time::Instant,
    /// When the remote was last polled.
    pub(super) polled: Option<tokio::time::Instant>,
    /// A full look at every unit: every `resync`; by default only for a remote source (a local
    /// one's refs, the unit files and systemd's unit changes are all events).
    pub(super) resync: Option<Duration>,
    pub(super) resync_at: Option<tokio::time::Instant>,
    pub(super) forced: ForcedReads,
}

impl Schedule {
    pub(super) fn new(cfg: &AgentConfig, remote: bool) -> Schedule {
        let interval = Duration::from_secs(cfg.interval.unwrap_or(60).max(1));
        let resync = cfg.resync.or(if remote { Some(300) } else { None });
        let resync = resync.map(|s| Duration::from_secs(s.max(1)));
        Schedule {
            remote,
            interval,
            poll_at: tokio::time::Instant::now() + timing::first_poll(interval, random()),
            polled: None,
            resync,
            resync_at: resync.map(|r| tokio::time::Instant::now() + r),
            forced: ForcedReads::default(),
        }
    }
}

impl Schedule {
    /// `POST /poll` at `now`: the remote's next poll now, or a second after the last one if that
    /// was less than a second ago (as a forced read); never later than it was due anyway.
    pub(super) fn poll_sooner(&mut self, now: tokio::time::Instant) {
        let earliest = self.polled.map_or(now, |p| (p + timing::FORCED_READ_EVERY).max(now));
        self.poll_at = self.poll_at.min(earliest);
    }
}

/// Forced source re-reads (SIGHUP, `specd reconcile`) at most once a second: a burst of
/// requests is one read now and one at the end of the second.
#[derive(Debug, Default)]
pub(super) struct ForcedReads {
    pub(super) last: Option<tokio::time::Instant>,
    /// The read put off, and when it is due.
    pub(super) due: Option<tokio::time::Instant>,
}

impl ForcedReads {
    /// Whether a forced read asked at `now` happens now; if one happened less than a second ago,
    /// not: it is due at the end of that second instead.
    pub(super) fn ask(&mut self, now: tokio::time::Instant) -> bool {
        if let Some(next) = self.last.map(|t| t + timing::FORCED_READ_EVERY).filter(|n| *n > now) {
            self.due = Some(next);
            false
        } else {
            self.last = Some(now);
            true
        }
    }
}

/// `d` ±10 % ([`timing::next_poll`]), at a point the clock's nanoseconds pick.
pub(super) fn jitter(d: Duration) -> Duration {
    timing::next_poll(d, random())
}

/// A number that differs from one call and one host to the next: the clock's nanoseconds.
pub(super) fn random() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|t| t.subsec_nanos() as u64).unwrap_or(0)
}

/// One inotify watch (one thread) for both: the local repository's refs (a moved ref is a
/// [`Trigger::Source`]) and the unit directory (a changed unit file or drop-in is that unit's
/// [`Trigger::Unit`]). Lock files and specd's own temporary files are not changes: a ref moves
/// when git renames `main.lock` to `main`, and that rename is the one event read.
pub(super) fn watcher(
    src: &GitSource,
    unit_dir: &Path,
    tx: mpsc::UnboundedSender<Trigger>,
) -> Result<notify::RecommendedWatcher> {
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
