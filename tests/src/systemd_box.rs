//! [`SystemdBox`]: a private systemd as PID 1 of fresh pid, mount, cgroup,
//! uts and ipc namespaces. See the crate docs for what it sees and hides.

use crate::cgroups::{self, CgroupLayout, Hierarchy};
use crate::util::{wait_for, wait_until};
use anyhow::{Context, Result, bail};
use std::collections::BTreeMap;
use std::fs;
use std::io::{Read, Seek, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock, mpsc};
use std::time::{Duration, Instant};

/// The systemd binary the box runs as its PID 1.
pub const SYSTEMD: &str = "/lib/systemd/systemd";

/// Directories that are a fresh, empty tmpfs inside the box (besides `/run`).
pub const PRIVATE_DIRS: &[&str] =
    &["/etc/systemd/system", "/var/lib", "/var/log", "/var/cache", "/var/tmp", "/tmp", "/dev/shm"];

/// The directories a service with `PrivateTmp=yes` gets of its own: what the box binds under
/// them (a clone of the workspace in a temporary directory, its target directory, a test's
/// repository) is hidden from such a service at its path. See [`SystemdBox::hidden_by_private_tmp`].
pub const PRIVATE_TMP_DIRS: &[&str] = &["/tmp", "/var/tmp"];

/// Where the box keeps its private unit directory (the standard targets).
pub const BOX_UNIT_DIR: &str = "/run/specd-box/units";

/// The unit search path of the box's systemd. Nothing of the host's unit
/// directories is on it: with them, a service's default dependencies would
/// start `systemd-tmpfiles-setup.service`, which cleans the host's `/tmp`.
pub const BOX_UNIT_PATH: &str = "/etc/systemd/system.control:/run/systemd/system.control:/run/systemd/transient:/etc/systemd/system:/run/systemd/system:/run/specd-box/units";

/// Runs as PID 1 of the new pid namespace, with the host's cgroup view.
const INNER1: &str = r#"
set -eu
nl='
'
IFS=$nl
for f in $SPECD_BOX_CG_PROCS; do echo 1 > "$f"; done
if [ -n "$SPECD_BOX_NET" ]; then ip link set lo up; fi
if [ ! -s /etc/machine-id ]; then
  echo "specd box: /etc/machine-id is missing or empty; systemd would write one on the host, refusing to boot" >&2
  exit 1
fi
mount -t tmpfs -o mode=755 specd-box-run /run
mkdir -p /run/specd-box/binds /run/specd-box/empty
i=0
for p in $SPECD_BOX_BINDS; do i=$((i+1)); mkdir /run/specd-box/binds/$i; mount --rbind "$p" /run/specd-box/binds/$i; done
if [ -n "$SPECD_BOX_PERSIST" ]; then
  mkdir -p /run/specd-box/persist/units /run/specd-box/persist/state
  mount --bind "$SPECD_BOX_PERSIST/etc-systemd-system" /run/specd-box/persist/units
  mount --bind "$SPECD_BOX_PERSIST/var-lib-specd" /run/specd-box/persist/state
fi
for d in $SPECD_BOX_PRIVATE_DIRS; do
  if [ -d "$d" ]; then mount -t tmpfs -o mode=755 specd-box-tmpfs "$d"; fi
done
chmod 1777 /tmp /var/tmp /dev/shm
mkdir -p /var/lib/specd /var/lib/systemd
# The model folder the stand-in's specs name (STANDIN_MODEL), there as a GPU host has its model:
# specd's pre-flight looks for it before it stops a serving instance.
mkdir -p /var/lib/models/Qwen3.5-122B-A10B
echo '{"architectures": ["Qwen3NextForCausalLM"]}' > /var/lib/models/Qwen3.5-122B-A10B/config.json
i=0
for p in $SPECD_BOX_BINDS; do i=$((i+1)); mkdir -p "$p"; mount --move /run/specd-box/binds/$i "$p"; done
if [ -n "$SPECD_BOX_PERSIST" ]; then
  mount --move /run/specd-box/persist/units /etc/systemd/system
  mount --move /run/specd-box/persist/state /var/lib/specd
fi
for d in /dev/console /dev/kmsg; do
  if [ -e "$d" ]; then mount --bind /dev/null "$d"; fi
done
tr -d - < /proc/sys/kernel/random/uuid > /run/specd-box/machine-id
mount --bind /run/specd-box/machine-id /etc/machine-id
exec unshare --cgroup /bin/sh -c "$SPECD_BOX_INNER2"
"#;

/// Runs in the new cgroup namespace: remounts the cgroup hierarchies so the
/// box's systemd sees its own cgroup as the root, writes the private unit
/// directory, and becomes systemd.
const INNER2: &str = r#"
set -eu
grep -E '^[^ ]+ /sys/fs/cgroup(/[^ ]*)? cgroup2? ' /proc/mounts > /run/specd-box/cg-mounts || true
: > /run/specd-box/cg-links
for l in /sys/fs/cgroup/*; do
  if [ -L "$l" ]; then echo "${l##*/} $(readlink "$l")" >> /run/specd-box/cg-links; fi
done
if [ "$(stat -f -c %T /sys/fs/cgroup)" = cgroup2fs ]; then
  mount -t cgroup2 cgroup2 /sys/fs/cgroup
else
  mount -t tmpfs -o mode=755 specd-box-cgroup /sys/fs/cgroup
  while read -r src dir typ opts rest; do
    mkdir -p "$dir"
    mount -t "$typ" -o "$(echo "$opts" | sed 's/,nsdelegate//')" "$src" "$dir"
  done < /run/specd-box/cg-mounts
  while read -r name target; do ln -s "$target" "/sys/fs/cgroup/$name"; done < /run/specd-box/cg-links
fi
U=/run/specd-box/units
mkdir -p $U /run/systemd/journald.conf.d /run/systemd/system
printf '[Journal]\nStorage=volatile\nReadKMsg=no\nForwardToConsole=no\nForwardToWall=no\n' > /run/systemd/journald.conf.d/specd-box.conf
for t in sysinit basic sockets timers paths slices local-fs local-fs-pre remote-fs remote-fs-pre swap \
         shutdown final poweroff halt reboot kexec exit umount emergency rescue multi-user graphical \
         network network-pre network-online nss-lookup nss-user-lookup time-set time-sync getty \
         cryptsetup integritysetup veritysetup sound; do
  printf '[Unit]\nDescription=%s (specd box, empty)\nDefaultDependencies=no\n' "$t" > "$U/$t.target"
done
printf '[Unit]\nDescription=System Slice\nDefaultDependencies=no\nBefore=slices.target\n' > $U/system.slice
printf '[Unit]\nDescription=specd box\nDefaultDependencies=no\nWants=systemd-journald.service systemd-journald.socket systemd-journald-dev-log.socket multi-user.target\nAfter=systemd-journald.service\n' > $U/box.target
ln -s box.target $U/default.target
for u in systemd-journald.service systemd-journald.socket systemd-journald-dev-log.socket; do
  ln -s "/lib/systemd/system/$u" "$U/$u"
done
for u in systemd-tmpfiles-setup.service systemd-tmpfiles-clean.service systemd-tmpfiles-clean.timer \
         systemd-tmpfiles-setup-dev.service systemd-journald-audit.socket syslog.socket \
         systemd-journal-flush.service systemd-random-seed.service systemd-remount-fs.service; do
  ln -s /dev/null "$U/$u"
done
exec env -i container=specd-box NOTIFY_SOCKET="$SPECD_BOX_NOTIFY" PATH=/usr/sbin:/usr/bin:/sbin:/bin \
  SYSTEMD_UNIT_PATH="$SPECD_BOX_UNIT_PATH" \
  SYSTEMD_GENERATOR_PATH=/run/specd-box/empty SYSTEMD_ENVIRONMENT_GENERATOR_PATH=/run/specd-box/empty \
  "$SPECD_BOX_SYSTEMD" --system --unit=box.target --show-status=no --log-target=journal
"#;

/// Options for [`SystemdBox::boot_with`].
#[derive(Debug, Clone)]
pub struct BoxConfig {
    /// Host directories made visible inside the box at the same path even
    /// when they lie under one of [`PRIVATE_DIRS`] (e.g. a `tempfile` git
    /// repository under `/tmp`). Directories only.
    pub binds: Vec<PathBuf>,
    /// How long boot may take before [`SystemdBox::boot_with`] gives up.
    pub boot_timeout: Duration,
    /// A host directory that keeps the box's `/etc/systemd/system` (in `etc-systemd-system/`)
    /// and `/var/lib/specd` (in `var-lib-specd/`) from one boot to the next: boot a box, shut it
    /// down, boot another with the same directory, and it finds the units (and their
    /// enablement links) and specd's state the first left. Created when missing. `None`: both
    /// are fresh.
    pub persist: Option<PathBuf>,
    /// A network namespace of the box's own (its loopback up, nothing else): what its processes
    /// do to the network (an nftables rule, a port bound) stays in the box. Reach it with
    /// [`SystemdBox::net_ns`]. `false`: the host's network, as the host's processes see it.
    pub private_network: bool,
}

impl Default for BoxConfig {
    fn default() -> Self {
        BoxConfig { binds: Vec::new(), boot_timeout: Duration::from_secs(30), persist: None, private_network: false }
    }
}

/// What is needed to check, after a box is gone, that it left nothing behind.
/// Get it with [`SystemdBox::trace`]; check with [`BoxTrace::leaks`].
#[derive(Debug, Clone)]
pub struct BoxTrace {
    /// The box's name (`specd-box-<test pid>-<n>`), also its cgroup name.
    pub name: String,
    /// Host pid of the box's PID 1.
    pub init_pid: u32,
    /// Inode of the box's pid namespace.
    pub pid_ns: u64,
    /// Inode of the box's mount namespace.
    pub mnt_ns: u64,
    hierarchies: Vec<Hierarchy>,
    host_mounts: String,
    /// Open handles on the box's pid and mount namespaces. Namespace inode
    /// numbers are reused once a namespace is freed (e.g. by another box
    /// booting meanwhile); holding them keeps `pid_ns`/`mnt_ns` meaning this
    /// box for as long as this trace lives.
    _ns_handles: Option<std::sync::Arc<(fs::File, fs::File)>>,
}

fn ns_inode(pid: u32, ns: &str) -> Option<u64> {
    let l = fs::read_link(format!("/proc/{pid}/ns/{ns}")).ok()?;
    let s = l.to_string_lossy();
    s.split_once('[')?.1.trim_end_matches(']').parse().ok()
}

/// Until systemd, booted as a container's PID 1 by `child`, sends `READY=1` on `notify` (its
/// initial transaction is done), at most `timeout`; `child` (`who`) exiting first is an error.
pub(crate) fn wait_ready_notification(
    notify: &UnixDatagram,
    timeout: Duration,
    child: &mut Child,
    who: &str,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            bail!("systemd sent no READY=1 within {timeout:?}");
        }
        notify.set_read_timeout(Some(left.min(Duration::from_millis(200))))?;
        match notify.recv(&mut buf) {
            Ok(n) if String::from_utf8_lossy(&buf[..n]).lines().any(|l| l == "READY=1") => return Ok(()),
            Ok(_) => {}
            // A signal handled by another thread of the process (a test's own) interrupts the
            // wait: it is no answer, and no failure.
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                // Waiting on the socket; meanwhile notice an early death.
                if let Some(st) = child.try_wait()? {
                    bail!("{who} exited during boot ({st})");
                }
            }
            Err(e) => return Err(e).context("receive from the notify socket"),
        }
    }
}

pub(crate) fn all_pids() -> Vec<u32> {
    fs::read_dir("/proc")
        .map(|rd| rd.flatten().filter_map(|e| e.file_name().to_str()?.parse().ok()).collect())
        .unwrap_or_default()
}

pub(crate) fn ppid_of(pid: u32) -> Option<u32> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &stat[stat.rfind(')')? + 2..];
    after.split(' ').nth(1)?.parse().ok()
}

/// `comm`, state and parent of a process, for leak reports.
fn comm_of(pid: u32) -> String {
    let comm = fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let state = stat.rfind(')').and_then(|i| stat.get(i + 2..i + 3)).unwrap_or("?");
    let wchan = fs::read_to_string(format!("/proc/{pid}/wchan")).unwrap_or_default();
    format!("{} state {state} wchan {wchan} ppid {}", comm.trim(), ppid_of(pid).unwrap_or(0))
}

impl BoxTrace {
    /// Everything the box left behind: processes still in its pid or mount
    /// namespace, its cgroup directories in any hierarchy, mounts that
    /// appeared in the host's mount table. Empty when clean.
    pub fn leaks(&self) -> Vec<String> {
        let mut out = Vec::new();
        for pid in all_pids() {
            if ns_inode(pid, "pid") == Some(self.pid_ns) {
                out.push(format!("process {pid} ({}) still in the box's pid namespace", comm_of(pid)));
            } else if ns_inode(pid, "mnt") == Some(self.mnt_ns) {
                out.push(format!("process {pid} ({}) still in the box's mount namespace", comm_of(pid)));
            }
        }
        for d in cgroups::leftover_dirs(&self.hierarchies, &self.name) {
            out.push(format!("cgroup {} still exists", d.display()));
        }
        let now = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let before: std::collections::HashSet<&str> = self.host_mounts.lines().collect();
        for l in now.lines().filter(|l| !before.contains(l)) {
            out.push(format!("host mount appeared: {l}"));
        }
        out
    }
}

/// How a box was torn down.
#[derive(Debug, Clone)]
pub struct Teardown {
    /// `systemctl --force poweroff` ended PID 1 in time (else it was killed).
    pub clean_poweroff: bool,
    /// From the start of teardown until everything was gone.
    pub elapsed: Duration,
}

/// A private systemd 252 running as PID 1 of its own pid, mount, cgroup, uts
/// and ipc namespaces, sharing the host's network namespace and file system
/// (except the private directories listed in the crate docs).
///
/// Dropping it tears it down (see [`SystemdBox::shutdown`]); a test should
/// call `shutdown()` itself to assert that teardown left nothing behind.
pub struct SystemdBox {
    trace: BoxTrace,
    /// The host directories bound into the box at their path (the config's and the target
    /// directory when the box would hide it).
    binds: Vec<PathBuf>,
    layout: CgroupLayout,
    unshare: Option<Child>,
    console: fs::File,
    boot_time: Duration,
    private_network: bool,
}

impl std::fmt::Debug for SystemdBox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SystemdBox")
            .field("name", &self.trace.name)
            .field("pid", &self.trace.init_pid)
            .field("layout", &self.layout)
            .finish()
    }
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// Spawns commands from one long-lived thread. The box's `unshare` process
/// gets PR_SET_PDEATHSIG=SIGKILL, which fires when the *thread* that forked it
/// ends; spawning from this thread ties the box's life to the test process
/// (which may boot a box in one thread and drop it in another) rather than to
/// a test thread.
pub(crate) fn spawn_from_keeper(cmd: Command) -> std::io::Result<Child> {
    type Req = (Command, mpsc::Sender<std::io::Result<Child>>);
    static KEEPER: OnceLock<Mutex<mpsc::Sender<Req>>> = OnceLock::new();
    let tx = KEEPER
        .get_or_init(|| {
            let (tx, rx) = mpsc::channel::<Req>();
            std::thread::Builder::new()
                .name("specd-box-keeper".into())
                .spawn(move || {
                    for (mut cmd, reply) in rx {
                        let _ = reply.send(cmd.spawn());
                    }
                })
                .expect("spawn box keeper thread");
            Mutex::new(tx)
        })
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let (rtx, rrx) = mpsc::channel();
    tx.send((cmd, rtx)).map_err(|_| std::io::Error::other("box keeper thread is gone"))?;
    rrx.recv().map_err(|_| std::io::Error::other("box keeper thread is gone"))?
}

fn which(prog: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).map(|d| d.join(prog)).find(|p| p.is_file()))
        .unwrap_or(None)
}

/// Why this machine cannot boot a box, if it cannot.
pub fn preflight() -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!(
            "the systemd box needs root (it creates namespaces, cgroups and mounts); run the end-to-end tests as root"
        );
    }
    for p in ["unshare", "nsenter"] {
        if which(p).is_none() {
            bail!("the systemd box needs `{p}` (util-linux) on PATH");
        }
    }
    if !Path::new(SYSTEMD).is_file() {
        bail!("the systemd box needs systemd at {SYSTEMD}");
    }
    if !Path::new("/etc/systemd/system").is_dir() {
        bail!("the systemd box needs /etc/systemd/system to exist (it mounts a tmpfs over it)");
    }
    Ok(())
}

/// A process is stopped (state `T`: by a signal).
fn stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(')').map(|(_, rest)| rest.trim_start().starts_with('T')))
        .unwrap_or(false)
}

pub(crate) fn pidfd_wait(child: &mut Child, timeout: Duration) -> bool {
    // Event-driven wait for a child's exit, bounded by `timeout`.
    // SAFETY: pidfd_open on our own child's pid; fd closed below.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, child.id() as libc::pid_t, 0) } as i32;
    if fd < 0 {
        return wait_until("child exit", timeout, || matches!(child.try_wait(), Ok(Some(_)))).is_ok();
    }
    let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    let deadline = Instant::now() + timeout;
    let mut exited = false;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        // SAFETY: one valid pollfd.
        let r = unsafe { libc::poll(&mut pfd, 1, left.as_millis().min(i32::MAX as u128) as i32) };
        if r > 0 {
            exited = true;
            break;
        }
        if r == 0 || left.is_zero() {
            break;
        }
    }
    // SAFETY: closing the fd we opened.
    unsafe { libc::close(fd) };
    exited && child.wait().is_ok()
}

impl SystemdBox {
    /// Boots a box with default options. Fails with a message saying why
    /// when the machine cannot (not root, no `unshare`/`nsenter`, no systemd),
    /// or when systemd does not reach `running` in time.
    pub fn boot() -> Result<SystemdBox> {
        Self::boot_with(BoxConfig::default())
    }

    /// Boots a box with options.
    pub fn boot_with(cfg: BoxConfig) -> Result<SystemdBox> {
        preflight()?;
        let persist = match &cfg.persist {
            Some(p) => {
                if !p.is_absolute() {
                    bail!("box persist directory {} must be absolute", p.display());
                }
                for sub in ["etc-systemd-system", "var-lib-specd"] {
                    fs::create_dir_all(p.join(sub)).with_context(|| format!("create {}", p.join(sub).display()))?;
                }
                p.display().to_string()
            }
            None => String::new(),
        };
        let start = Instant::now();
        let layout = cgroups::host_layout()?;
        let hierarchies = cgroups::host_hierarchies()?;
        cgroups::sweep_stale(&hierarchies, "specd-box-");
        let name = format!("specd-box-{}-{}", std::process::id(), COUNTER.fetch_add(1, Ordering::SeqCst));
        let host_mounts = fs::read_to_string("/proc/self/mountinfo")?;
        let procs = match cgroups::create_box_cgroups(&hierarchies, &name) {
            Ok(p) => p,
            Err(e) => {
                let _ = cgroups::remove_box_cgroups(&hierarchies, &name, Duration::from_secs(2));
                return Err(e);
            }
        };

        let mut binds = cfg.binds.clone();
        // The workspace's binaries must be runnable inside the box.
        let target = crate::util::target_dir();
        if PRIVATE_DIRS.iter().any(|d| target.starts_with(d)) || target.starts_with("/run") {
            binds.push(target);
        }
        for b in &binds {
            if !b.is_absolute() || !b.is_dir() {
                bail!("box bind {} must be an existing absolute directory", b.display());
            }
            if b.starts_with("/run") {
                bail!("box bind {} under /run is not supported", b.display());
            }
        }

        let notify_name = format!("{name}-notify");
        // An abstract socket belongs to its network namespace: a box with its own reaches a
        // socket file instead (in the target directory, which the box sees).
        let notify_file = cfg.private_network.then(|| crate::util::target_dir().join(format!("{notify_name}.sock")));
        let (notify, notify_addr) = match &notify_file {
            Some(path) => {
                let _ = fs::remove_file(path);
                (UnixDatagram::bind(path).context("bind the box's notify socket")?, path.display().to_string())
            }
            None => (
                UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(notify_name.as_bytes())?)
                    .context("bind the box's notify socket")?,
                format!("@{notify_name}"),
            ),
        };
        let console = tempfile::tempfile().context("create the box console file")?;

        let mut cmd = Command::new("unshare");
        if cfg.private_network {
            cmd.arg("--net");
        }
        cmd.args([
            "--pid",
            "--fork",
            "--kill-child",
            "--mount",
            "--uts",
            "--ipc",
            "--propagation",
            "private",
            "--mount-proc",
            "/bin/sh",
            "-c",
            INNER1,
        ])
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("SPECD_BOX_CG_PROCS", join_paths(&procs))
        .env("SPECD_BOX_BINDS", join_paths(&binds))
        .env("SPECD_BOX_PERSIST", persist)
        .env("SPECD_BOX_NET", if cfg.private_network { "1" } else { "" })
        .env("SPECD_BOX_PRIVATE_DIRS", PRIVATE_DIRS.join("\n"))
        .env("SPECD_BOX_INNER2", INNER2)
        .env("SPECD_BOX_NOTIFY", notify_addr)
        .env("SPECD_BOX_UNIT_PATH", BOX_UNIT_PATH)
        .env("SPECD_BOX_SYSTEMD", SYSTEMD)
        .stdin(Stdio::null())
        .stdout(console.try_clone()?)
        .stderr(console.try_clone()?);
        let me = std::process::id() as libc::pid_t;
        // SAFETY: only async-signal-safe calls (prctl, getppid) after fork.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::getppid() != me {
                    return Err(std::io::Error::other("parent died during spawn"));
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
        let mut sb = SystemdBox {
            trace: BoxTrace { name, init_pid: 0, pid_ns: 0, mnt_ns: 0, hierarchies, host_mounts, _ns_handles: None },
            binds,
            layout,
            unshare: Some(child),
            console,
            boot_time: Duration::ZERO,
            private_network: cfg.private_network,
        };
        let booted = sb.wait_booted(&notify, cfg.boot_timeout);
        if let Some(path) = &notify_file {
            let _ = fs::remove_file(path);
        }
        match booted {
            Ok(()) => {
                sb.boot_time = start.elapsed();
                Ok(sb)
            }
            Err(e) => {
                let console = sb.console_output();
                let journal = if sb.trace.init_pid != 0 {
                    String::from_utf8_lossy(&sb.exec(&["journalctl", "--no-pager", "-n", "50"]).stdout).to_string()
                } else {
                    String::new()
                };
                let td = sb.teardown();
                Err(e.context(format!(
                    "the systemd box did not boot.\n--- box console ---\n{console}\n--- journal ---\n{journal}\n--- teardown: {td:?}"
                )))
            }
        }
    }

    fn wait_booted(&mut self, notify: &UnixDatagram, timeout: Duration) -> Result<()> {
        let unshare_pid = self.unshare.as_ref().expect("unshare child").id();
        // systemd, as a container's PID 1, sends READY=1 to $NOTIFY_SOCKET
        // when its initial transaction (box.target) is done.
        wait_ready_notification(notify, timeout, self.unshare.as_mut().expect("unshare child"), "the box's PID 1")?;
        let init = wait_for("the box's PID 1 in /proc", Duration::from_secs(5), || {
            all_pids().into_iter().find(|&p| ppid_of(p) == Some(unshare_pid))
        })?;
        self.trace.init_pid = init;
        self.trace.pid_ns = ns_inode(init, "pid").context("read the box's pid namespace")?;
        let handles = (
            fs::File::open(format!("/proc/{init}/ns/pid")).context("open the box's pid namespace")?,
            fs::File::open(format!("/proc/{init}/ns/mnt")).context("open the box's mount namespace")?,
        );
        self.trace._ns_handles = Some(std::sync::Arc::new(handles));
        self.trace.mnt_ns = ns_inode(init, "mnt").context("read the box's mount namespace")?;
        if self.trace.pid_ns == ns_inode(std::process::id(), "pid").unwrap_or(0) {
            bail!("the box's PID 1 is in the host's pid namespace");
        }
        let state = self.systemctl(&["is-system-running"]);
        let state = String::from_utf8_lossy(&state.stdout).trim().to_string();
        if state != "running" {
            let failed = self.systemctl(&["--failed", "--no-pager"]);
            bail!("the box's systemd says {state:?}, not \"running\":\n{}", String::from_utf8_lossy(&failed.stdout));
        }
        Ok(())
    }

    /// What the box's `unshare`, shell and systemd printed before systemd
    /// took over its own logging (useful when boot fails).
    pub fn console_output(&self) -> String {
        let mut f = match self.console.try_clone() {
            Ok(f) => f,
            Err(_) => return String::new(),
        };
        let mut s = String::new();
        let _ = f.rewind();
        let _ = f.read_to_string(&mut s);
        s
    }

    /// The host directories the box shows at their path ([`BoxConfig::binds`], and the target
    /// directory when it lies under a private directory).
    pub fn binds(&self) -> &[PathBuf] {
        &self.binds
    }

    /// The binds a service of the box with `PrivateTmp=yes` (the shipped agent unit) does not
    /// see at their path: those under [`PRIVATE_TMP_DIRS`], hidden by the service's own /tmp.
    /// A clone of the workspace in a temporary directory puts the binaries and every test's
    /// files there; the service sees them once its unit binds them back
    /// (`BindReadOnlyPaths=`, at the same path).
    pub fn hidden_by_private_tmp(&self) -> Vec<PathBuf> {
        self.binds.iter().filter(|b| PRIVATE_TMP_DIRS.iter().any(|d| b.starts_with(d))).cloned().collect()
    }

    /// Host pid of the box's PID 1 (systemd).
    pub fn pid(&self) -> u32 {
        self.trace.init_pid
    }

    /// The box's name, `specd-box-<test pid>-<n>`; its cgroup on the host is
    /// `<the test process's cgroup>/<name>` in every hierarchy.
    pub fn name(&self) -> &str {
        &self.trace.name
    }

    /// How long boot took (from `boot()` until systemd said `running`).
    pub fn boot_time(&self) -> Duration {
        self.boot_time
    }

    /// The cgroup layout seen inside the box (that of the host).
    pub fn cgroup_layout(&self) -> CgroupLayout {
        self.layout
    }

    /// A copy of what is needed to check for leaks after the box is gone.
    pub fn trace(&self) -> BoxTrace {
        self.trace.clone()
    }

    /// The host path under which the box's file system is reachable
    /// (`/proc/<pid>/root/<path>`). Absolute symlinks inside the box resolve
    /// against the host root there, so prefer [`SystemdBox::read_file`].
    pub fn host_path(&self, path_in_box: &str) -> PathBuf {
        PathBuf::from(format!("/proc/{}/root{}", self.trace.init_pid, path_in_box))
    }

    /// The box's network namespace (`/proc/<its PID 1>/ns/net`): its own with
    /// [`BoxConfig::private_network`], else the host's.
    pub fn net_ns(&self) -> PathBuf {
        PathBuf::from(format!("/proc/{}/ns/net", self.trace.init_pid))
    }

    /// A `Command` that runs `argv` inside the box: `nsenter -t PID -m -p -C
    /// -u -i -- argv`. It runs as root with cwd `/`, inherits the caller's
    /// environment (less `NOTIFY_SOCKET`), is in the box's pid namespace
    /// (killed when the box goes down) but stays in the caller's cgroup.
    /// Use it to spawn long-running processes or set env/stdin/cwd freely.
    pub fn command(&self, argv: &[&str]) -> Command {
        assert!(!argv.is_empty(), "empty argv");
        let mut c = Command::new("nsenter");
        c.args(["-t", &self.trace.init_pid.to_string(), "-m", "-p", "-C", "-u", "-i"]);
        if self.private_network {
            c.arg("-n");
        }
        c.arg("--");
        c.args(argv);
        c.env_remove("NOTIFY_SOCKET");
        c.stdin(Stdio::null());
        c
    }

    /// Runs `argv` inside the box and collects its output (any exit status).
    pub fn exec(&self, argv: &[&str]) -> Output {
        self.exec_env(argv, &[])
    }

    /// [`SystemdBox::exec`] with extra environment variables.
    pub fn exec_env(&self, argv: &[&str], env: &[(&str, &str)]) -> Output {
        let mut c = self.command(argv);
        c.envs(env.iter().copied());
        c.output().unwrap_or_else(|e| panic!("run nsenter for {argv:?}: {e}"))
    }

    /// [`SystemdBox::exec`] with `stdin` fed to the command.
    pub fn exec_stdin(&self, argv: &[&str], stdin: &[u8]) -> Output {
        let mut c = self.command(argv);
        c.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = c.spawn().unwrap_or_else(|e| panic!("run nsenter for {argv:?}: {e}"));
        let mut sin = child.stdin.take().expect("stdin");
        let data = stdin.to_vec();
        let writer = std::thread::spawn(move || {
            let _ = sin.write_all(&data);
        });
        let out = child.wait_with_output().unwrap_or_else(|e| panic!("wait for {argv:?}: {e}"));
        let _ = writer.join();
        out
    }

    /// Runs `argv` inside the box; Ok(stdout) when it exits 0, else an error
    /// carrying the status, stdout and stderr.
    pub fn check(&self, argv: &[&str]) -> Result<String> {
        checked(argv, self.exec(argv))
    }

    /// Runs a `/bin/sh -c` script inside the box.
    pub fn sh(&self, script: &str) -> Output {
        self.exec(&["/bin/sh", "-c", script])
    }

    /// [`SystemdBox::sh`], Ok(stdout) only when it exits 0.
    pub fn sh_check(&self, script: &str) -> Result<String> {
        checked(&["/bin/sh", "-c", script], self.sh(script))
    }

    /// `systemctl ARGS` inside the box.
    pub fn systemctl(&self, args: &[&str]) -> Output {
        let mut argv = vec!["systemctl"];
        argv.extend_from_slice(args);
        self.exec(&argv)
    }

    /// `systemctl ARGS`, Ok(stdout) only when it exits 0.
    pub fn systemctl_check(&self, args: &[&str]) -> Result<String> {
        let mut argv = vec!["systemctl"];
        argv.extend_from_slice(args);
        self.check(&argv)
    }

    /// `systemctl show UNIT -p P1,P2…` as a map (empty values included).
    pub fn show(&self, unit: &str, props: &[&str]) -> Result<BTreeMap<String, String>> {
        let p = format!("--property={}", props.join(","));
        let out = self.systemctl_check(&["show", unit, &p])?;
        Ok(out.lines().filter_map(|l| l.split_once('=')).map(|(k, v)| (k.to_string(), v.to_string())).collect())
    }

    /// One property of `systemctl show`.
    pub fn prop(&self, unit: &str, prop: &str) -> Result<String> {
        self.show(unit, &[prop])?.remove(prop).with_context(|| format!("systemctl show {unit} has no property {prop}"))
    }

    /// The journal of `unit` (`journalctl -u UNIT -o cat`): the unit's own
    /// output and systemd's messages about it, one message per line.
    pub fn journal(&self, unit: &str) -> Result<String> {
        self.check(&["journalctl", "--no-pager", "-o", "cat", "-u", unit])
    }

    /// Writes a file inside the box (creating parent directories).
    pub fn write_file(&self, path_in_box: &str, contents: impl AsRef<[u8]>) -> Result<()> {
        let out = self.exec_stdin(
            &["/bin/sh", "-c", "mkdir -p \"$(dirname \"$1\")\" && cat > \"$1\"", "sh", path_in_box],
            contents.as_ref(),
        );
        checked(&["write", path_in_box], out).map(|_| ())
    }

    /// Reads a file inside the box.
    pub fn read_file(&self, path_in_box: &str) -> Result<Vec<u8>> {
        let out = self.exec(&["cat", "--", path_in_box]);
        if !out.status.success() {
            bail!("read {path_in_box} in the box: {}", String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(out.stdout)
    }

    /// Reads a text file inside the box.
    pub fn read_to_string(&self, path_in_box: &str) -> Result<String> {
        Ok(String::from_utf8(self.read_file(path_in_box)?)?)
    }

    /// SIGKILLs processes of the box that its systemd would not handle:
    /// those started with [`SystemdBox::exec`] / [`SystemdBox::command`]
    /// (inside they show PPid 0, and systemd-shutdown leaves PPid-0
    /// processes alone) and their `nsenter` parents outside (in the box's
    /// mount namespace only; systemd-shutdown's `kill(-1, SIGSTOP)` stops
    /// their child, and nsenter then stops itself and can no longer reap it).
    /// With `everything`, every process of the box but its PID 1.
    fn kill_strays(&self, everything: bool, unshare: u32) {
        let (pns, mns) = (Some(self.trace.pid_ns), Some(self.trace.mnt_ns));
        for pid in all_pids() {
            // unshare is in the box's mount namespace too; killing it would
            // kill the box's PID 1 (--kill-child) behind systemd's back.
            if pid == self.trace.init_pid || pid == unshare {
                continue;
            }
            let in_pid_ns = ns_inode(pid, "pid") == pns;
            let in_mnt_ns = ns_inode(pid, "mnt") == mns;
            let stray = if in_pid_ns {
                everything || ppid_of(pid).is_some_and(|pp| ns_inode(pp, "pid") != pns)
            } else {
                in_mnt_ns
            };
            if stray {
                // SAFETY: kill(2) on a process of the box.
                unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            }
        }
    }

    /// Stops the box and checks it left nothing behind: `systemctl --force
    /// poweroff`, wait for PID 1 to exit (SIGKILL to it, and so to the whole
    /// pid namespace, if it has not within 10 s), remove the box's cgroups in
    /// every hierarchy. Errors if anything of the box remains
    /// ([`BoxTrace::leaks`]).
    pub fn shutdown(mut self) -> Result<Teardown> {
        self.teardown()
    }

    fn teardown(&mut self) -> Result<Teardown> {
        let start = Instant::now();
        let Some(mut child) = self.unshare.take() else {
            bail!("box already torn down");
        };
        let mut clean = false;
        if self.trace.init_pid != 0 && matches!(child.try_wait(), Ok(None)) {
            // Processes started with `exec` and still running have their
            // parent (nsenter) outside the box, so inside they show PPid 0;
            // systemd-shutdown leaves such processes alone and then waits for
            // them. Kill them first.
            self.kill_strays(false, child.id());
            // PID 1 may be gone already; then nsenter fails, which is fine.
            let poweroff =
                self.command(&["systemctl", "--force", "poweroff"]).stdout(Stdio::null()).stderr(Stdio::null()).spawn();
            if let Ok(mut p) = poweroff {
                // This systemctl is a stray too: systemd-shutdown's `kill(-1, SIGSTOP)` may
                // stop it before it returns, and its nsenter with it, which then never reaps
                // it once killed: the box's pid namespace would wait for that zombie forever.
                let _ = wait_until("systemctl poweroff to return", Duration::from_secs(10), || {
                    matches!(p.try_wait(), Ok(Some(_))) || stopped(p.id())
                });
                if !matches!(p.try_wait(), Ok(Some(_))) {
                    let _ = p.kill();
                    let _ = p.wait();
                }
            }
            clean = pidfd_wait(&mut child, Duration::from_secs(10));
        }
        if !clean {
            if self.trace.init_pid != 0 {
                // SAFETY: kill(2); the pid is the box's init, still our
                // unshare's child (not yet reaped: unshare is alive). Killing
                // a pid namespace's init kills every process in it.
                unsafe { libc::kill(self.trace.init_pid as libc::pid_t, libc::SIGKILL) };
            }
            // unshare exits once its child, the box's init, is reaped, which
            // the kernel does only after every process of the box is gone.
            // A stopped nsenter outside would keep a zombie in the box and
            // so the namespace alive: keep killing strays while waiting.
            let gone = wait_until("the box's pid namespace to end", Duration::from_secs(10), || {
                self.kill_strays(true, child.id());
                matches!(child.try_wait(), Ok(Some(_)))
            });
            if gone.is_err() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        cgroups::kill_tree(&self.trace.hierarchies, &self.trace.name);
        let rm = cgroups::remove_box_cgroups(&self.trace.hierarchies, &self.trace.name, Duration::from_secs(10));
        // Exiting processes leave /proc asynchronously: wait for a clean
        // state, then report what is left.
        let _ = wait_until("the box to leave nothing behind", Duration::from_secs(5), || self.trace.leaks().is_empty());
        let leaks = self.trace.leaks();
        if !leaks.is_empty() {
            bail!("box {} left things behind:\n  {}", self.trace.name, leaks.join("\n  "));
        }
        rm?;
        Ok(Teardown { clean_poweroff: clean, elapsed: start.elapsed() })
    }
}

impl Drop for SystemdBox {
    fn drop(&mut self) {
        if self.unshare.is_some()
            && let Err(e) = self.teardown()
        {
            eprintln!("tearing down {}: {e:#}", self.trace.name);
        }
    }
}

fn join_paths(ps: &[PathBuf]) -> String {
    ps.iter().map(|p| p.to_string_lossy().into_owned()).collect::<Vec<_>>().join("\n")
}

fn checked(argv: &[&str], out: Output) -> Result<String> {
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        bail!(
            "{argv:?} in the box failed ({}):\nstdout: {}\nstderr: {}",
            out.status,
            String::from_utf8_lossy(&out.stdout).trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        )
    }
}
