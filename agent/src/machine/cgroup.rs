//! A unit's cgroup: is anything still in it, and who. specd starts a new instance only when the
//! old one's cgroup is empty: that, not `systemctl stop` returning, is what "stopped" means.
//!
//! Layouts: cgroup v2 (`/sys/fs/cgroup/<CG>/cgroup.events`), hybrid (v1 controllers with cgroup2
//! at `/sys/fs/cgroup/unified/<CG>/cgroup.events` and processes in
//! `/sys/fs/cgroup/systemd/<CG>/cgroup.procs`) and pure v1 (only `cgroup.procs`, polled).
//! `populated 0` in `cgroup.events` is watched with inotify; a removed directory counts as empty.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Result;
use futures_core::Stream;
use inotify::{Inotify, WatchMask};
use tokio::time::Instant;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Layout {
    /// cgroup v2 only.
    Unified { root: PathBuf },
    /// v1 controllers, systemd's v1 tracking hierarchy, and cgroup2 beside them.
    Hybrid { unified: PathBuf, systemd: PathBuf },
    /// v1 only.
    Legacy { systemd: PathBuf },
}

impl Layout {
    /// The layout of `root` (normally `/sys/fs/cgroup`).
    pub fn detect(root: &Path) -> Layout {
        if root.join("cgroup.controllers").exists() {
            Layout::Unified { root: root.to_path_buf() }
        } else if root.join("unified/cgroup.procs").exists() {
            Layout::Hybrid { unified: root.join("unified"), systemd: root.join("systemd") }
        } else {
            Layout::Legacy { systemd: root.join("systemd") }
        }
    }

    pub fn host() -> Layout {
        Layout::detect(Path::new("/sys/fs/cgroup"))
    }

    fn join(base: &Path, cg: &str) -> PathBuf {
        base.join(cg.trim_start_matches('/'))
    }

    /// `cgroup.events` of the unit's cgroup, where the kernel has one.
    pub fn events_file(&self, cg: &str) -> Option<PathBuf> {
        match self {
            Layout::Unified { root } => Some(Self::join(root, cg).join("cgroup.events")),
            Layout::Hybrid { unified, .. } => Some(Self::join(unified, cg).join("cgroup.events")),
            Layout::Legacy { .. } => None,
        }
    }

    /// Where the kernel counts the cgroup's OOM kills (`oom_kill N`): cgroup v2 `memory.events`,
    /// then the v1 memory controller's `memory.oom_control` (mounted beside systemd's hierarchy).
    pub fn oom_kill_files(&self, cg: &str) -> Vec<PathBuf> {
        let v2 = self.events_file(cg).map(|p| p.with_file_name("memory.events"));
        let v1 = match self {
            Layout::Hybrid { systemd, .. } | Layout::Legacy { systemd } => {
                systemd.parent().map(|root| Self::join(&root.join("memory"), cg).join("memory.oom_control"))
            }
            Layout::Unified { .. } => None,
        };
        [v2, v1].into_iter().flatten().collect()
    }

    /// The directory whose `cgroup.procs` (recursively) lists the unit's processes.
    pub fn procs_dir(&self, cg: &str) -> PathBuf {
        match self {
            Layout::Unified { root } => Self::join(root, cg),
            Layout::Hybrid { systemd, .. } | Layout::Legacy { systemd } => Self::join(systemd, cg),
        }
    }

    /// Whether any process is in the cgroup (or a child cgroup).
    pub fn populated(&self, cg: &str) -> bool {
        if cg.is_empty() {
            return false;
        }
        if let Some(ev) = self.events_file(cg) {
            return match std::fs::read_to_string(&ev) {
                Ok(t) => t.lines().any(|l| l == "populated 1"),
                Err(_) => false,
            };
        }
        !self.pids(cg).is_empty()
    }

    /// The pids in the cgroup and its children.
    pub fn pids(&self, cg: &str) -> Vec<u32> {
        fn walk(dir: &Path, out: &mut Vec<u32>) {
            if let Ok(t) = std::fs::read_to_string(dir.join("cgroup.procs")) {
                out.extend(t.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
            }
            if let Ok(rd) = std::fs::read_dir(dir) {
                for e in rd.flatten() {
                    if e.file_type().is_ok_and(|t| t.is_dir()) {
                        walk(&e.path(), out);
                    }
                }
            }
        }
        let mut out = Vec::new();
        if !cg.is_empty() {
            walk(&self.procs_dir(cg), &mut out);
        }
        out.sort_unstable();
        out.dedup();
        out
    }
}

/// The process exists and has not exited (a zombie waiting to be reaped has exited). Pid 0 (not
/// known) counts as alive: the caller asks systemd then.
pub fn alive(pid: u32) -> bool {
    if pid == 0 {
        return true;
    }
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
    // "pid (comm) S ppid pgrp session tty tpgid flags ...": the fields follow the last ')' (comm
    // may hold parentheses). A process in its exit (PF_EXITING in flags: its memory, and with
    // it its command line, may be gone while it is not yet a zombie) has exited too.
    const PF_EXITING: u64 = 0x4;
    let fields: Vec<&str> =
        stat.rsplit_once(')').map(|(_, rest)| rest.split_whitespace().collect()).unwrap_or_default();
    let exiting = fields.get(6).and_then(|f| f.parse::<u64>().ok()).is_some_and(|f| f & PF_EXITING != 0);
    !exiting && !matches!(fields.first().copied(), Some("Z" | "X" | "x") | None)
}

/// A process's command line, NUL-separated words; `None` once it is gone.
pub fn cmdline(pid: u32) -> Option<Vec<String>> {
    let b = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    if b.is_empty() {
        return None;
    }
    let b = b.strip_suffix(&[0]).unwrap_or(&b);
    Some(b.split(|c| *c == 0).map(|w| String::from_utf8_lossy(w).into_owned()).collect())
}

/// A process still in the cgroup when the wait gave up.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Lingering {
    pub pid: u32,
    pub cmdline: String,
}

/// The processes left in cgroup `cg`, as specd says it everywhere: `2 processes still in the
/// unit's cgroup /system.slice/x.service: pid 7 (python3 -m ...), pid 9 (...)`.
pub fn still_in(cg: &str, lingering: &[Lingering]) -> String {
    let who: Vec<String> = lingering.iter().map(|l| format!("pid {} ({})", l.pid, l.cmdline)).collect();
    let n = lingering.len();
    let processes = if n == 1 { "process" } else { "processes" };
    format!("{n} {processes} still in the unit's cgroup {cg}: {}", who.join(", "))
}

/// Wait until the cgroup is empty or `deadline`. `tick` is called about once a second while
/// waiting (progress). On timeout, returns the processes still there.
pub async fn wait_empty(
    layout: &Layout,
    cg: &str,
    deadline: Instant,
    mut tick: impl FnMut(),
) -> Result<(), Vec<Lingering>> {
    let mut watcher = layout.events_file(cg).and_then(|ev| {
        let ino = Inotify::init().ok()?;
        ino.watches().add(&ev, WatchMask::MODIFY | WatchMask::DELETE_SELF).ok()?;
        ino.into_event_stream([0u8; 1024]).ok()
    });
    let mut next_tick = Instant::now() + Duration::from_secs(1);
    loop {
        // Checked after the watch is in place, so no change between the two is missed.
        if !layout.populated(cg) {
            return Ok(());
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(layout
                .pids(cg)
                .into_iter()
                .map(|pid| Lingering { pid, cmdline: cmdline(pid).map(|c| c.join(" ")).unwrap_or_default() })
                .collect());
        }
        if now >= next_tick {
            tick();
            next_tick = now + Duration::from_secs(1);
        }
        // Without inotify (cgroup v1), poll; with it, wake on the event, and re-check at least
        // each second anyway.
        let wake =
            if watcher.is_some() { next_tick.min(deadline) } else { (now + Duration::from_millis(50)).min(deadline) };
        match watcher.as_mut() {
            Some(stream) => {
                let next = std::future::poll_fn(|cx| std::pin::Pin::new(&mut *stream).poll_next(cx));
                tokio::select! {
                    ev = next => {
                        if !matches!(ev, Some(Ok(_))) {
                            watcher = None;
                        }
                    }
                    _ = tokio::time::sleep_until(wake) => {}
                }
            }
            None => tokio::time::sleep_until(wake).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oom_kills_are_counted_where_each_layout_keeps_them() {
        let cg = "/system.slice/x.service";
        let unified = Layout::Unified { root: "/cg".into() };
        assert_eq!(unified.oom_kill_files(cg), [PathBuf::from("/cg/system.slice/x.service/memory.events")]);
        let hybrid = Layout::Hybrid { unified: "/cg/unified".into(), systemd: "/cg/systemd".into() };
        assert_eq!(
            hybrid.oom_kill_files(cg),
            [
                PathBuf::from("/cg/unified/system.slice/x.service/memory.events"),
                PathBuf::from("/cg/memory/system.slice/x.service/memory.oom_control")
            ]
        );
        let legacy = Layout::Legacy { systemd: "/cg/systemd".into() };
        assert_eq!(legacy.oom_kill_files(cg), [PathBuf::from("/cg/memory/system.slice/x.service/memory.oom_control")]);
    }

    #[test]
    fn a_zombie_is_not_alive() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        // `true` exits at once; until it is reaped it is a zombie.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while alive(pid) {
            assert!(std::time::Instant::now() < deadline, "pid {pid} never exited");
            std::thread::yield_now();
        }
        assert!(std::fs::metadata(format!("/proc/{pid}")).is_ok(), "a zombie keeps its /proc entry");
        child.wait().unwrap();
        assert!(!alive(pid));
        assert!(alive(std::process::id()));
        assert!(alive(0));
    }

    #[test]
    fn layouts_place_files() {
        let h = Layout::Hybrid { unified: "/sys/fs/cgroup/unified".into(), systemd: "/sys/fs/cgroup/systemd".into() };
        assert_eq!(
            h.events_file("/system.slice/x.service").unwrap(),
            Path::new("/sys/fs/cgroup/unified/system.slice/x.service/cgroup.events")
        );
        assert_eq!(h.procs_dir("/system.slice/x.service"), Path::new("/sys/fs/cgroup/systemd/system.slice/x.service"));
        let u = Layout::Unified { root: "/sys/fs/cgroup".into() };
        assert_eq!(u.events_file("/a.service").unwrap(), Path::new("/sys/fs/cgroup/a.service/cgroup.events"));
        let l = Layout::Legacy { systemd: "/sys/fs/cgroup/systemd".into() };
        assert_eq!(l.events_file("/a.service"), None);
    }

    #[test]
    fn a_missing_cgroup_is_empty() {
        let d = tempfile::tempdir().unwrap();
        let u = Layout::Unified { root: d.path().into() };
        assert!(!u.populated("/gone.service"));
        std::fs::create_dir_all(d.path().join("x.service")).unwrap();
        std::fs::write(d.path().join("x.service/cgroup.events"), "populated 1\nfrozen 0\n").unwrap();
        assert!(u.populated("/x.service"));
    }

    #[tokio::test]
    async fn wait_wakes_when_populated_drops_to_zero() {
        // A stand-in cgroup.events file: inotify sees its modification like the kernel's.
        let d = tempfile::tempdir().unwrap();
        let u = Layout::Unified { root: d.path().into() };
        std::fs::create_dir_all(d.path().join("x.service")).unwrap();
        let ev = d.path().join("x.service/cgroup.events");
        std::fs::write(&ev, "populated 1\n").unwrap();
        let ev2 = ev.clone();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            rx.await.ok();
            std::fs::write(&ev2, "populated 0\n").unwrap();
        });
        let wait = wait_empty(&u, "/x.service", Instant::now() + Duration::from_secs(30), || {});
        tx.send(()).unwrap();
        wait.await.unwrap();
    }

    #[tokio::test]
    async fn wait_reports_who_lingers() {
        let d = tempfile::tempdir().unwrap();
        let u = Layout::Unified { root: d.path().into() };
        std::fs::create_dir_all(d.path().join("x.service")).unwrap();
        std::fs::write(d.path().join("x.service/cgroup.events"), "populated 1\n").unwrap();
        let me = std::process::id();
        std::fs::write(d.path().join("x.service/cgroup.procs"), format!("{me}\n")).unwrap();
        let err = wait_empty(&u, "/x.service", Instant::now(), || {}).await.unwrap_err();
        assert_eq!(err.len(), 1);
        assert_eq!(err[0].pid, me);
        assert!(!err[0].cmdline.is_empty());
        let said = still_in("/x.service", &err);
        assert_eq!(said, format!("1 process still in the unit's cgroup /x.service: pid {me} ({})", err[0].cmdline));
        let two = [Lingering { pid: 7, cmdline: "a".into() }, Lingering { pid: 9, cmdline: "b c".into() }];
        assert_eq!(
            still_in("/y.service", &two),
            "2 processes still in the unit's cgroup /y.service: pid 7 (a), pid 9 (b c)"
        );
    }
}
