//! Host-side cgroup bookkeeping for boxes: one cgroup per box in every
//! mounted hierarchy, created under the test process's own cgroup, so that
//! boxes running side by side never share a `system.slice`.

use anyhow::{Context, Result, bail};
use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// How the host mounts cgroups (the box copies it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupLayout {
    /// cgroup v1 controllers plus cgroup2 at `/sys/fs/cgroup/unified`
    /// (systemd's "hybrid" mode; Debian 12 hosts whose PID 1 is not systemd).
    Hybrid,
    /// Only cgroup2, mounted at `/sys/fs/cgroup`.
    Unified,
    /// Only cgroup v1 (no cgroup2 anywhere).
    Legacy,
}

impl CgroupLayout {
    /// Directory of a unit's cgroup where `cgroup.events` lives (cgroup2),
    /// for `ControlGroup=` value `cg` (e.g. `/system.slice/x.service`), as seen
    /// inside the box. `None` on a legacy host (no cgroup2).
    pub fn events_dir(self, cg: &str) -> Option<PathBuf> {
        match self {
            CgroupLayout::Hybrid => Some(PathBuf::from(format!("/sys/fs/cgroup/unified{cg}"))),
            CgroupLayout::Unified => Some(PathBuf::from(format!("/sys/fs/cgroup{cg}"))),
            CgroupLayout::Legacy => None,
        }
    }

    /// Directory of a unit's cgroup whose `cgroup.procs` lists its processes
    /// (systemd's tracking hierarchy), as seen inside the box.
    pub fn procs_dir(self, cg: &str) -> PathBuf {
        match self {
            CgroupLayout::Hybrid | CgroupLayout::Legacy => PathBuf::from(format!("/sys/fs/cgroup/systemd{cg}")),
            CgroupLayout::Unified => PathBuf::from(format!("/sys/fs/cgroup{cg}")),
        }
    }
}

/// One mounted cgroup hierarchy of the host.
#[derive(Debug, Clone)]
pub(crate) struct Hierarchy {
    /// Where it is mounted, e.g. `/sys/fs/cgroup/memory`.
    pub mount: PathBuf,
    /// cgroup2?
    pub v2: bool,
    /// The test process's cgroup in it, e.g. `/` or `/process_api/abc`.
    pub own: String,
}

impl Hierarchy {
    /// The host directory of cgroup `name` under our own cgroup.
    pub fn dir_of(&self, name: &str) -> PathBuf {
        let own = self.own.trim_start_matches('/');
        let mut p = self.mount.clone();
        if !own.is_empty() {
            p.push(own);
        }
        p.push(name);
        p
    }
}

fn mountinfo_cgroups() -> Result<Vec<(PathBuf, String, String)>> {
    // (mount point, fstype, super options)
    let mi = fs::read_to_string("/proc/self/mountinfo").context("read /proc/self/mountinfo")?;
    let mut out = Vec::new();
    for line in mi.lines() {
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let l: Vec<&str> = left.split(' ').collect();
        let r: Vec<&str> = right.split(' ').collect();
        if l.len() < 5 || r.len() < 3 {
            continue;
        }
        if r[0] == "cgroup" || r[0] == "cgroup2" {
            out.push((PathBuf::from(l[4]), r[0].to_string(), r[2].to_string()));
        }
    }
    Ok(out)
}

/// The host's layout.
pub fn host_layout() -> Result<CgroupLayout> {
    let mounts = mountinfo_cgroups()?;
    let v2_at = mounts.iter().find(|m| m.1 == "cgroup2").map(|m| m.0.clone());
    Ok(match v2_at {
        Some(p) if p == Path::new("/sys/fs/cgroup") => CgroupLayout::Unified,
        Some(p) if p == Path::new("/sys/fs/cgroup/unified") => CgroupLayout::Hybrid,
        Some(p) => {
            bail!("cgroup2 is mounted at {} — the box supports /sys/fs/cgroup or /sys/fs/cgroup/unified", p.display())
        }
        None => CgroupLayout::Legacy,
    })
}

/// Every hierarchy the test process belongs to, with its mount point.
pub(crate) fn host_hierarchies() -> Result<Vec<Hierarchy>> {
    let mounts = mountinfo_cgroups()?;
    let own = fs::read_to_string("/proc/self/cgroup").context("read /proc/self/cgroup")?;
    let mut out = Vec::new();
    for line in own.lines() {
        let mut parts = line.splitn(3, ':');
        let (_id, ctrls, path) = match (parts.next(), parts.next(), parts.next()) {
            (Some(a), Some(b), Some(c)) => (a, b, c),
            _ => continue,
        };
        let found = if ctrls.is_empty() {
            mounts.iter().find(|m| m.1 == "cgroup2")
        } else {
            mounts.iter().find(|m| {
                m.1 == "cgroup" && {
                    let opts: Vec<&str> = m.2.split(',').collect();
                    ctrls.split(',').all(|c| opts.contains(&c))
                }
            })
        };
        let Some((mount, fstype, _)) = found else {
            // A hierarchy that is not mounted (e.g. a v1 controller nobody
            // mounted) cannot be used by the box's systemd either.
            continue;
        };
        out.push(Hierarchy { mount: mount.clone(), v2: fstype == "cgroup2", own: path.to_string() });
    }
    if out.is_empty() {
        bail!("no mounted cgroup hierarchy found in /proc/self/mountinfo");
    }
    Ok(out)
}

/// Creates cgroup `name` in every hierarchy; returns the host paths of the
/// `cgroup.procs` files to move the box's PID 1 into.
pub(crate) fn create_box_cgroups(hs: &[Hierarchy], name: &str) -> Result<Vec<PathBuf>> {
    let mut procs = Vec::new();
    for h in hs {
        let d = h.dir_of(name);
        fs::create_dir(&d).with_context(|| format!("create cgroup {}", d.display()))?;
        if d.join("cpuset.cpus").exists() && !h.v2 {
            // A fresh v1 cpuset cgroup has no CPUs or memory nodes: nothing
            // can join it until they are copied from the parent.
            let parent = d.parent().expect("cgroup has a parent");
            for f in ["cpuset.cpus", "cpuset.mems"] {
                let v = fs::read_to_string(parent.join(f)).with_context(|| format!("read {f}"))?;
                fs::write(d.join(f), v.trim()).with_context(|| format!("write {}", d.join(f).display()))?;
            }
        }
        procs.push(d.join("cgroup.procs"));
    }
    Ok(procs)
}

/// Pids in a cgroup directory and all its descendants.
pub(crate) fn pids_in_tree(dir: &Path) -> Vec<u32> {
    let mut out = Vec::new();
    if let Ok(s) = fs::read_to_string(dir.join("cgroup.procs")) {
        out.extend(s.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
    }
    if let Ok(rd) = fs::read_dir(dir) {
        for e in rd.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                out.extend(pids_in_tree(&e.path()));
            }
        }
    }
    out
}

/// SIGKILLs every process in the box's cgroups (all hierarchies), using
/// `cgroup.kill` where the kernel has it.
pub(crate) fn kill_tree(hs: &[Hierarchy], name: &str) {
    for h in hs {
        let d = h.dir_of(name);
        if h.v2 && d.join("cgroup.kill").exists() {
            let _ = fs::write(d.join("cgroup.kill"), "1");
        }
        for pid in pids_in_tree(&d) {
            // SAFETY: plain kill(2) on a pid read from the box's cgroup.
            unsafe {
                libc::kill(pid as libc::pid_t, libc::SIGKILL);
            }
        }
    }
}

fn rmdir_tree(dir: &Path) -> std::io::Result<()> {
    if !dir.exists() {
        return Ok(());
    }
    for e in fs::read_dir(dir)? {
        let e = e?;
        if e.file_type()?.is_dir() {
            rmdir_tree(&e.path())?;
        }
    }
    match fs::remove_dir(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        r => r,
    }
}

/// Removes the box's cgroup trees in every hierarchy, bottom-up, retrying
/// while exiting processes still hold them (EBUSY), up to `timeout`.
pub(crate) fn remove_box_cgroups(hs: &[Hierarchy], name: &str, timeout: Duration) -> Result<()> {
    let mut last_err = String::new();
    let res = crate::util::wait_until(&format!("cgroups of {name} removable"), timeout, || {
        let mut ok = true;
        for h in hs {
            if let Err(e) = rmdir_tree(&h.dir_of(name)) {
                ok = false;
                last_err = format!("{}: {e}", h.dir_of(name).display());
            }
        }
        ok
    });
    res.with_context(|| format!("last error: {last_err}"))
}

/// Leftover box cgroup directories (host paths) named `name`.
pub(crate) fn leftover_dirs(hs: &[Hierarchy], name: &str) -> Vec<PathBuf> {
    hs.iter().map(|h| h.dir_of(name)).filter(|d| d.exists()).collect()
}

/// Boxes left behind by a test process that died without tearing them down
/// (SIGKILL, abort): names `<prefix><pid>-<n>` (`specd-box-`, `specd-deb-`) whose `<pid>` is
/// gone. Their processes are killed and their cgroups removed.
pub(crate) fn sweep_stale(hs: &[Hierarchy], prefix: &str) {
    let me = std::process::id();
    let mut stale = std::collections::BTreeSet::new();
    for h in hs {
        let parent = h.dir_of("x");
        let Some(parent) = parent.parent() else {
            continue;
        };
        let Ok(rd) = fs::read_dir(parent) else {
            continue;
        };
        for e in rd.flatten() {
            let n = e.file_name().to_string_lossy().to_string();
            let Some(rest) = n.strip_prefix(prefix) else {
                continue;
            };
            let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
                continue;
            };
            if pid != me && !Path::new(&format!("/proc/{pid}")).exists() {
                stale.insert(n);
            }
        }
    }
    for n in stale {
        kill_tree(hs, &n);
        let _ = remove_box_cgroups(hs, &n, Duration::from_secs(5));
    }
}
