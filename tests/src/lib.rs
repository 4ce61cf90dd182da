//! # specd-e2e: a real systemd to test against
//!
//! [`SystemdBox`] boots a private systemd 252 as PID 1 of new pid, mount,
//! cgroup, uts and ipc namespaces (the network namespace is the host's), runs
//! commands inside it with `nsenter`, and tears it down without leaving a
//! process, mount or cgroup behind. The `specd-standin` binary of this crate
//! is a stand-in inference server (SGLang, vLLM, llama.cpp flavours) for the
//! units the box runs.
//!
//! ```no_run
//! use specd_e2e::{SystemdBox, bin_path};
//! let b = SystemdBox::boot()?;
//! b.write_file("/etc/systemd/system/llm.service", "[Service]\nExecStart=/bin/sleep 1000\n")?;
//! b.systemctl_check(&["daemon-reload"])?;
//! b.systemctl_check(&["start", "llm.service"])?;
//! let props = b.show("llm.service", &["ActiveState", "MainPID", "ControlGroup"])?;
//! assert_eq!(props["ActiveState"], "active");
//! let report = b.shutdown()?; // errors if anything was left behind
//! # let _ = (report, bin_path("specd-standin"));
//! # Ok::<(), anyhow::Error>(())
//! ```
//!
//! For load balancing, [`haproxy::Haproxy`] runs a real HAProxy in front of servers on
//! loopback (a server a box runs among them), [`haproxy::Agent`] answers its agent-check as
//! the test says, [`traffic::Traffic`] sends streaming completions through it and counts every
//! request, and [`engine_process::EngineProcess`] runs the stand-in as a plain process.
//!
//! ## What the box sees
//!
//! - **Its own unit path only** ([`systemd_box::BOX_UNIT_PATH`]):
//!   `/etc/systemd/system` (a fresh tmpfs: write units here),
//!   `/run/systemd/system`, the control and transient directories, and
//!   `/run/specd-box/units` holding empty standard targets (`sysinit`, `basic`,
//!   `multi-user`, `network-online`, `shutdown`, … all `DefaultDependencies=no`),
//!   `system.slice`, `box.target` (the boot target) and the journald units
//!   linked from `/lib/systemd/system`. The host's unit directories are never
//!   visible: with them a service's default dependencies pull in
//!   `systemd-tmpfiles-setup.service`, which cleans the host's `/tmp`
//!   (tmpfiles units are also masked, to be sure). Generators do not run.
//! - **Private (fresh tmpfs) directories**: `/run`, and
//!   [`systemd_box::PRIVATE_DIRS`]: `/etc/systemd/system`, `/var/lib` (with an
//!   empty `/var/lib/specd`, specd's state dir), `/var/log`, `/var/cache`,
//!   `/var/tmp`, `/tmp`, `/dev/shm`. `/etc/machine-id` is a fresh id. Host
//!   directories under them can be shown inside with [`BoxConfig::binds`]
//!   (the workspace's target directory is bound automatically if needed).
//!   Everything else (`/usr`, the workspace, `/etc`, the cargo target dir) is the
//!   host's, readable and writable. A service of the box with `PrivateTmp=yes`
//!   gets a /tmp of its own and so does not see the binds under /tmp and
//!   /var/tmp ([`SystemdBox::hidden_by_private_tmp`]: a clone of the workspace
//!   in a temporary directory, a test's repository); its unit binds them back.
//! - **The host's network**: a server in the box listening on 127.0.0.1:PORT
//!   is reachable from the test at 127.0.0.1:PORT. Pick ports with
//!   [`free_port`].
//! - journald runs with `Storage=volatile` (the journal is in the box's
//!   `/run/log/journal`); `journalctl` in the box works
//!   ([`SystemdBox::journal`]).
//! - systemd runs with `container=specd-box` in its environment, so it behaves
//!   as a container's init (no kernel-module loading, no loop/DM/swap detach at
//!   poweroff) and logs to the journal. `/dev/console` and `/dev/kmsg` are
//!   `/dev/null` inside, so nothing of the box reaches the host's console or
//!   kernel log.
//!
//! ## Cgroup paths seen from inside the box
//!
//! A command run with [`SystemdBox::exec`] (as the specd agent will be) is in
//! the box's mount, pid and cgroup namespaces. The box's cgroup hierarchies are
//! re-mounted inside it, rooted at the box's own cgroup, so the paths are those
//! a real host shows. For a unit with `ControlGroup=/system.slice/X.service`
//! (`systemctl show -P ControlGroup X.service`), on this hybrid host
//! ([`CgroupLayout::Hybrid`]: cgroup v1 controllers plus cgroup2 at
//! `/sys/fs/cgroup/unified`):
//!
//! | what | path inside the box |
//! |---|---|
//! | `cgroup.events` (`populated 0\|1`, cgroup2) | `/sys/fs/cgroup/unified/system.slice/X.service/cgroup.events` |
//! | `cgroup.procs` (systemd's tracking hierarchy) | `/sys/fs/cgroup/systemd/system.slice/X.service/cgroup.procs` |
//! | `cgroup.procs` (cgroup2, same pids) | `/sys/fs/cgroup/unified/system.slice/X.service/cgroup.procs` |
//! | memory controller (v1) | `/sys/fs/cgroup/memory/system.slice/X.service/` |
//!
//! On a cgroup2-only host ([`CgroupLayout::Unified`]) both files are in
//! `/sys/fs/cgroup/system.slice/X.service/`. [`CgroupLayout::events_dir`] and
//! [`CgroupLayout::procs_dir`] compute them. The directories disappear when the
//! unit has stopped. Pids in `cgroup.procs` and `MainPID` are pids of the
//! box's pid namespace, and `/proc` inside the box is the box's: `/proc/<MainPID>/cmdline`,
//! `/proc/<MainPID>/environ` and `/proc/<MainPID>/status` of a unit's main
//! process are readable from an exec'd command (it runs as root). Note a
//! command run by `exec` is not itself in a box cgroup: its `/proc/self/cgroup`
//! reads `0::/..`.
//!
//! On the host the box's cgroup is `<the test's cgroup>/specd-box-<pid>-<n>` in
//! every hierarchy, so boxes running side by side never share a
//! `system.slice`.
//!
//! ## Never leaks
//!
//! [`SystemdBox::shutdown`] (and `Drop`, also while a test panics) powers the
//! box off, kills its pid namespace if PID 1 does not exit in 10 s, removes
//! its cgroups, and checks ([`BoxTrace::leaks`]) that no process is left in
//! its pid or mount namespace, no cgroup directory remains and no mount
//! appeared on the host. Processes started with [`SystemdBox::exec`] / [`SystemdBox::command`]
//! that are still running at teardown are SIGKILLed first (systemd's
//! shutdown leaves such PPid-0 processes alone). The box's `unshare` is killed when the test process
//! dies (PR_SET_PDEATHSIG), which kills the box; cgroups left by such a death
//! are removed by the next boot.
//!
//! ## Requirements
//!
//! Root, util-linux `unshare`/`nsenter`, systemd at `/lib/systemd/systemd`
//! (252 on Debian 12). [`SystemdBox::boot`] fails with a message naming what
//! is missing ([`systemd_box::preflight`]).

pub mod cgroups;
pub mod debian_root;
pub mod engine_process;
pub mod haproxy;
pub mod prometheus;
pub mod promql;
pub mod shape;
pub mod standin;
pub mod systemd_box;
pub mod traffic;
pub mod util;

pub use cgroups::CgroupLayout;
pub use debian_root::{DebianMachine, debian_root};
pub use prometheus::Prometheus;
pub use systemd_box::{BoxConfig, BoxTrace, SystemdBox, Teardown};
pub use util::{
    Gpg, Reaped, STANDIN_MODEL, bin_path, free_port, git, http, http_get, http_with_headers, sglang_spec, ssh_key,
    target_dir, vllm_lb_spec, wait_for, wait_until,
};
