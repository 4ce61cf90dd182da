//! A real Debian system for the package's end-to-end test: a root file system made by
//! `mmdebstrap` from Debian's archive ([`debian_root`], cached), booted with its own systemd by
//! `systemd-nspawn --boot` ([`DebianMachine`]) on a throwaway overlay, so the cached root is
//! never changed.
//!
//! Nothing of the host is touched: the overlay and nspawn's own state (`/run/systemd/nspawn`)
//! live in a private mount namespace, the machine has its own network namespace (loopback only:
//! nothing is downloaded while it runs), nspawn registers with no machine manager and creates no
//! unit on the host (`--register=no --keep-unit`); its cgroups are
//! `<the test's cgroup>/specd-deb-<pid>-<n>` in every hierarchy, removed at shutdown, which checks
//! that no process, cgroup or host mount is left.

use crate::cgroups::{self, Hierarchy};
use crate::systemd_box::{all_pids, pidfd_wait, ppid_of, spawn_from_keeper, wait_ready_notification};
use crate::util::wait_for;
use anyhow::{Context, Result, bail};
use std::fs;
use std::io::{Read, Seek};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Where made roots are kept: `$SPECD_TEST_ROOTS`, or this.
pub const ROOTS_DEFAULT: &str = "/var/cache/specd-test-roots";

/// The Debian archive roots are made from: `$SPECD_DEBIAN_MIRROR`, or this.
pub const MIRROR_DEFAULT: &str = "http://deb.debian.org/debian";

/// The directory of made roots.
pub fn roots_dir() -> PathBuf {
    std::env::var_os("SPECD_TEST_ROOTS").map(PathBuf::from).unwrap_or_else(|| ROOTS_DEFAULT.into())
}

/// A Debian `suite` root (variant minbase: essential packages and apt) with `packages` installed,
/// made by `mmdebstrap` once and kept in [`roots_dir`] under `<suite>-minbase-<packages…>`: made
/// in a temporary directory beside it and renamed into place, so a root that is there is whole.
/// Returns its path and whether it was made now (not found made).
pub fn debian_root(suite: &str, packages: &[&str]) -> Result<(PathBuf, bool)> {
    let mut sorted: Vec<&str> = packages.to_vec();
    sorted.sort_unstable();
    let dir = roots_dir();
    let root = dir.join(format!("{suite}-minbase-{}", sorted.join("-")));
    if root.join("etc/os-release").exists() {
        return Ok((root, false));
    }
    fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    let tmp = dir.join(format!(".making-{suite}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&tmp);
    let mirror = std::env::var("SPECD_DEBIAN_MIRROR").unwrap_or_else(|_| MIRROR_DEFAULT.into());
    // In a mount namespace of its own: the mounts it makes in the root while it installs (/dev,
    // /proc, /sys) never show on the host, where a systemd box's teardown, running at the same
    // time in another test, would find them.
    let out = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "mmdebstrap", "--variant=minbase", "--mode=root", "--quiet"])
        .arg(format!("--include={}", sorted.join(",")))
        .arg(suite)
        .arg(&tmp)
        .arg(&mirror)
        .stdin(Stdio::null())
        .output()
        .context("run mmdebstrap (package mmdebstrap: scripts/install-deps)")?;
    if !out.status.success() {
        let _ = fs::remove_dir_all(&tmp);
        bail!(
            "mmdebstrap {suite} from {mirror} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    if let Err(e) = fs::rename(&tmp, &root) {
        // Another test process made it meanwhile: theirs is as good.
        let _ = fs::remove_dir_all(&tmp);
        if !root.join("etc/os-release").exists() {
            return Err(e).with_context(|| format!("rename {} to {}", tmp.display(), root.display()));
        }
    }
    Ok((root, true))
}

/// Runs as the one process of nspawn's private mount namespace, in the machine's cgroups: the
/// overlay over the cached root, a fresh /run (nspawn keeps its state there), then nspawn.
const START: &str = r#"
set -eu
nl='
'
IFS=$nl
for f in $SPECD_DEB_CG_PROCS; do echo $$ > "$f"; done
mkdir -p "$SPECD_DEB_SCRATCH/upper" "$SPECD_DEB_SCRATCH/work" "$SPECD_DEB_SCRATCH/merged"
mount -t overlay specd-deb -o "lowerdir=$SPECD_DEB_ROOT,upperdir=$SPECD_DEB_SCRATCH/upper,workdir=$SPECD_DEB_SCRATCH/work" "$SPECD_DEB_SCRATCH/merged"
mount -t tmpfs -o mode=755 specd-deb-run /run
exec systemd-nspawn --quiet --boot --register=no --keep-unit --private-network --notify-ready=yes \
  --resolv-conf=off --timezone=off --link-journal=no --console=pipe \
  --machine="$SPECD_DEB_NAME" --directory="$SPECD_DEB_SCRATCH/merged"
"#;

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A Debian root booted by `systemd-nspawn --boot`, its systemd as PID 1 of its own namespaces.
/// Dropping it powers it off (see [`DebianMachine::shutdown`]).
pub struct DebianMachine {
    name: String,
    hierarchies: Vec<Hierarchy>,
    nspawn: Option<Child>,
    init: u32,
    console: fs::File,
    host_mounts: String,
    boot_time: Duration,
    _scratch: tempfile::TempDir,
}

impl DebianMachine {
    /// Boots `root` (a [`debian_root`]) on an overlay whose changes go when it stops; returns once
    /// its systemd said it finished booting (READY=1, relayed by nspawn), or fails within
    /// `timeout` with the console's output.
    pub fn boot(root: &Path, timeout: Duration) -> Result<DebianMachine> {
        for (prog, pkg) in
            [("systemd-nspawn", "systemd-container"), ("nsenter", "util-linux"), ("unshare", "util-linux")]
        {
            if !["/usr/bin", "/bin", "/usr/sbin", "/sbin"].iter().any(|d| Path::new(d).join(prog).exists()) {
                bail!("{prog} is missing (package {pkg}: scripts/install-deps)");
            }
        }
        let start = Instant::now();
        let hierarchies = cgroups::host_hierarchies()?;
        cgroups::sweep_stale(&hierarchies, "specd-deb-");
        sweep_stale_scratch(&roots_dir());
        let name = format!("specd-deb-{}-{}", std::process::id(), COUNTER.fetch_add(1, Ordering::SeqCst));
        let host_mounts = fs::read_to_string("/proc/self/mountinfo")?;
        // Beside the cached root: the overlay's upper directory must be on a file system that
        // takes its extended attributes.
        let scratch =
            tempfile::Builder::new().prefix(&format!(".running-{}-", std::process::id())).tempdir_in(roots_dir())?;
        let procs = match cgroups::create_box_cgroups(&hierarchies, &name) {
            Ok(p) => p,
            Err(e) => {
                let _ = cgroups::remove_box_cgroups(&hierarchies, &name, Duration::from_secs(2));
                return Err(e);
            }
        };
        let notify_name = format!("{name}-notify");
        let notify = UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(notify_name.as_bytes())?)
            .context("bind the notify socket")?;
        let console = tempfile::tempfile().context("create the console file")?;
        let mut cmd = Command::new("unshare");
        cmd.args(["--mount", "--propagation", "private", "/bin/sh", "-c", START])
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .env("SPECD_DEB_CG_PROCS", procs.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join("\n"))
            .env("SPECD_DEB_SCRATCH", scratch.path())
            .env("SPECD_DEB_ROOT", root)
            .env("SPECD_DEB_NAME", &name)
            .env("NOTIFY_SOCKET", format!("@{notify_name}"))
            .stdin(Stdio::null())
            .stdout(console.try_clone()?)
            .stderr(console.try_clone()?);
        // SAFETY: only async-signal-safe calls (prctl) after fork. nspawn, and with it the
        // machine, dies with the test process.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = match spawn_from_keeper(cmd) {
            Ok(c) => c,
            Err(e) => {
                let _ = cgroups::remove_box_cgroups(&hierarchies, &name, Duration::from_secs(2));
                return Err(e).context("spawn unshare");
            }
        };
        let mut m = DebianMachine {
            name,
            hierarchies,
            nspawn: Some(child),
            init: 0,
            console,
            host_mounts,
            boot_time: Duration::ZERO,
            _scratch: scratch,
        };
        match m.wait_booted(&notify, timeout) {
            Ok(()) => {
                m.boot_time = start.elapsed();
                Ok(m)
            }
            Err(e) => {
                let console = m.console_output();
                let td = m.teardown();
                Err(e.context(format!(
                    "the Debian machine did not boot.\n--- console ---\n{console}\n--- teardown: {td:?}"
                )))
            }
        }
    }

    fn wait_booted(&mut self, notify: &UnixDatagram, timeout: Duration) -> Result<()> {
        let nspawn = self.nspawn.as_ref().expect("nspawn").id();
        wait_ready_notification(notify, timeout, self.nspawn.as_mut().expect("nspawn"), "systemd-nspawn")?;
        // The machine's PID 1: nspawn's child in another pid namespace.
        let own = fs::read_link("/proc/self/ns/pid")?;
        self.init = wait_for("the machine's PID 1", Duration::from_secs(5), || {
            all_pids().into_iter().find(|&p| {
                ppid_of(p) == Some(nspawn) && fs::read_link(format!("/proc/{p}/ns/pid")).is_ok_and(|ns| ns != own)
            })
        })?;
        Ok(())
    }

    /// How long boot took, from [`DebianMachine::boot`] until the machine's systemd was ready.
    pub fn boot_time(&self) -> Duration {
        self.boot_time
    }

    /// What nspawn and the machine's console printed.
    pub fn console_output(&self) -> String {
        let mut s = String::new();
        if let Ok(mut f) = self.console.try_clone() {
            let _ = f.rewind();
            let _ = f.read_to_string(&mut s);
        }
        s
    }

    /// The host path of a path inside the machine (`/proc/<its PID 1>/root/…`), to copy files in
    /// and read them; absolute symbolic links inside resolve against the host there.
    pub fn host_path(&self, path_in_machine: &str) -> PathBuf {
        PathBuf::from(format!("/proc/{}/root{}", self.init, path_in_machine))
    }

    /// A command run inside the machine (all its namespaces, its root and cwd `/`: its PID 1's): as root, a plain
    /// environment (PATH, LANG=C.UTF-8, DEBIAN_FRONTEND=noninteractive).
    pub fn command(&self, argv: &[&str]) -> Command {
        let mut c = Command::new("nsenter");
        c.args(["--target", &self.init.to_string(), "--all", "--root", "--wd", "--"]).args(argv);
        c.env_clear()
            .env("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
            .env("LANG", "C.UTF-8")
            .env("DEBIAN_FRONTEND", "noninteractive")
            .stdin(Stdio::null());
        c
    }

    /// Runs `argv` inside the machine; its output, whatever its exit status.
    pub fn exec(&self, argv: &[&str]) -> Output {
        self.command(argv).output().unwrap_or_else(|e| panic!("nsenter for {argv:?}: {e}"))
    }

    /// Runs a shell script inside the machine; its stdout, or an error with everything it said.
    pub fn sh(&self, script: &str) -> Result<String> {
        let out = self.exec(&["/bin/sh", "-ec", script]);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        if !out.status.success() {
            bail!("in the machine: {script}\nexit {}: {text}{}", out.status, String::from_utf8_lossy(&out.stderr));
        }
        Ok(text)
    }

    /// Powers the machine off (nspawn turns SIGTERM into the machine's poweroff), waits up to 60 s
    /// for nspawn to end (then kills everything in its cgroups), removes its cgroups and the
    /// overlay, and fails if anything was left: a process, a cgroup, a mount on the host.
    pub fn shutdown(mut self) -> Result<Duration> {
        self.teardown()
    }

    fn teardown(&mut self) -> Result<Duration> {
        let start = Instant::now();
        let Some(mut nspawn) = self.nspawn.take() else { return Ok(Duration::ZERO) };
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(nspawn.id() as libc::pid_t, libc::SIGTERM) };
        let clean = pidfd_wait(&mut nspawn, Duration::from_secs(60));
        if !clean {
            cgroups::kill_tree(&self.hierarchies, &self.name);
            let _ = nspawn.kill();
            let _ = nspawn.wait();
        }
        cgroups::remove_box_cgroups(&self.hierarchies, &self.name, Duration::from_secs(10))?;
        let mut leaks: Vec<String> = cgroups::leftover_dirs(&self.hierarchies, &self.name)
            .iter()
            .map(|d| format!("cgroup {}", d.display()))
            .collect();
        let before: std::collections::HashSet<&str> = self.host_mounts.lines().collect();
        let now = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        leaks.extend(now.lines().filter(|l| !before.contains(l)).map(|l| format!("host mount {l}")));
        if !clean {
            bail!("the machine did not power off within 60 s (killed); left: {leaks:?}\n{}", self.console_output());
        }
        if !leaks.is_empty() {
            bail!("the machine left {leaks:?}");
        }
        Ok(start.elapsed())
    }
}

impl Drop for DebianMachine {
    fn drop(&mut self) {
        if let Err(e) = self.teardown() {
            eprintln!("tearing down {}: {e:#}", self.name);
        }
    }
}

/// Overlays (`.running-<pid>-…`) and half-made roots (`.making-<suite>-<pid>`) of test processes
/// that died (killed) before cleaning up: their mounts went with their mount namespace.
fn sweep_stale_scratch(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let pid = if let Some(rest) = name.strip_prefix(".running-") {
            rest.split('-').next()
        } else if name.starts_with(".making-") {
            name.rsplit('-').next()
        } else {
            None
        };
        let Some(pid) = pid.and_then(|p| p.parse::<u32>().ok()) else { continue };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = fs::remove_dir_all(e.path());
        }
    }
}
