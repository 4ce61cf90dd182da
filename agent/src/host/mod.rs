//! The host, as the reconciler sees it: one boundary for every effect an apply has or depends on,
//! in roles: the service manager ([`ServiceManager`]), the process table and cgroups
//! ([`Processes`]), unit files ([`UnitFiles`]), the server's HTTP endpoints ([`Server`]), the
//! journal ([`Journal`]), the GPUs ([`Devices`]), what the unit's load balancers are told and
//! their polls ([`LoadBalancers`]), a draining unit's port closed to new connections ([`Firewall`]). [`Host`] is their sum, with what ties them: the wall clock, the
//! pre-flight (which looks at files, processes and ports at once) and the hold gate (a clock and
//! a process). Code that drives a unit is generic over `H: Host`; what needs one role names it.
//!
//! [`RealHost`] is the machine (`real`); the reconciler's tests drive the same code on an
//! in-memory host that can fail at any call (`fake`).
//!
//! specd's own state files are read and saved through [`crate::machine::store::StateFiles`] (the disk,
//! or the fake host). Time is tokio's clock (tests pause it) for waits, and [`Host::now`] for the
//! wall clock (a hold's expiry).

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Result;
use serde_json::Value;
use specd_spec::{Engine, Spec};
use tokio::time::Instant;

use crate::core::hold::{Hold, HoldEffect};
use crate::core::serving::{PollLog, ServingState};
use crate::core::speculation::Speculation;
use crate::core::timing;
use crate::machine::cgroup::Lingering;
use crate::machine::probe::Health;
use crate::machine::systemd::UnitProps;
use crate::preflight;

#[cfg(test)]
pub mod fake;
mod real;

pub use real::{RealHost, reported_args};

/// The service manager: systemd, as specd drives one unit (its properties, its jobs, its
/// enablement, its changes). Every call may be asked again on a new connection
/// ([`reconnecting`]).
pub trait ServiceManager {
    /// The unit's properties, as systemd reports them now.
    fn show(&self, unit: &str) -> impl Future<Output = Result<UnitProps>> + Send;
    /// Start the unit and wait for the start job (an error: the job failed).
    fn start(&self, unit: &str) -> impl Future<Output = Result<()>> + Send;
    /// Ask for a stop; with `wait`, until the stop job finished, else only queued.
    fn stop(&self, unit: &str, wait: bool) -> impl Future<Output = Result<()>> + Send;
    fn daemon_reload(&self) -> impl Future<Output = Result<()>> + Send;
    /// systemd's word that the unit's state changed, from this call on: a wait for a state
    /// subscribes first, then looks, then looks again at each change. A watch that cannot be
    /// had (no signals from systemd) is a timer of 20 ms, not an error.
    fn watch(&self, unit: &str) -> impl Future<Output = Self::Watch> + Send;
    type Watch: Watch;
    /// `systemctl enable`: the unit starts at boot (its `[Install]` section's `WantedBy=`).
    fn enable(&self, unit: &str) -> impl Future<Output = Result<()>> + Send;
    /// `systemctl disable`: it no longer starts at boot.
    fn disable(&self, unit: &str) -> impl Future<Output = Result<()>> + Send;
}

/// The process table and cgroups: a unit's processes (alive, their command line, the cgroup
/// emptied), a hold's process (a sweep's), and this process itself.
pub trait Processes {
    /// The process exists and has not exited; pid 0 (not known) counts as alive.
    fn alive(&self, pid: u32) -> bool;
    /// A hold's process (a sweep's) still runs: its pid, started at its start time when known.
    fn holder_alive(&self, hold: &Hold) -> bool;
    /// Until a hold's process (a sweep's) has exited (a pidfd where the kernel has them, else a
    /// look every few seconds); never, for a hold without one.
    fn holder_exit(&self, hold: &Hold) -> impl Future<Output = ()> + Send;
    /// This process, as a hold names it: its pid and start time (a sweep's hold, a rollback's
    /// pending pin).
    fn me(&self) -> (u32, Option<u64>);
    /// The unit this process runs in, when it runs as a service (specd never manages it).
    fn own_unit(&self) -> Option<String>;
    /// A process's command line; `None` once it is gone.
    fn cmdline(&self, pid: u32) -> Option<Vec<String>>;
    /// A process is still in the cgroup.
    fn populated(&self, cgroup: &str) -> bool;
    /// Until the cgroup is empty, or `deadline` (then: what is still in it). `tick` about once a
    /// second while waiting.
    fn wait_empty(
        &self,
        cgroup: &str,
        deadline: Instant,
        tick: impl FnMut() + Send,
    ) -> impl Future<Output = Result<(), Vec<Lingering>>> + Send;
}

/// Unit files and drop-ins in the unit directory: read, replaced at once, masked, moved aside.
pub trait UnitFiles {
    fn read(&self, path: &Path) -> Result<Option<Vec<u8>>>;
    /// Replace the file at once: a reader sees the old or the new bytes, never a mix.
    fn write(&self, path: &Path, bytes: &[u8]) -> Result<()>;
    fn exists(&self, path: &Path) -> bool;
    /// The file is a link to `/dev/null` (a mask).
    fn is_mask(&self, path: &Path) -> bool;
    /// Temporary files an interrupted write left next to `name` in `dir`.
    fn clean_temps(&self, dir: &Path, name: &str);
    /// Move a file into `dest` (a private copy), then remove it.
    fn move_aside(&self, path: &Path, dest: &Path) -> Result<()>;
}

/// The inference server's HTTP endpoints: readiness, its own report of its args, its load, the
/// proof that it drafts.
pub trait Server {
    fn health(&self, url: &str) -> impl Future<Output = Health> + Send;
    /// The server's own report of the args it runs with (`None`: the engine has none): its
    /// endpoint's answer, or the line of the instance's log that lists them (`invocation`).
    fn reported_args(
        &self,
        base_url: &str,
        spec: &Spec,
        invocation: &str,
    ) -> impl Future<Output = Option<Result<Value, String>>> + Send;
    /// Requests in flight (`None`: not told).
    fn running_requests(&self, base_url: &str, engine: Engine) -> impl Future<Output = Option<u64>> + Send;
    /// One short generation and the engine's evidence of drafting.
    fn speculation(&self, base_url: &str, spec: &Spec) -> impl Future<Output = Result<Speculation, String>> + Send;
}

/// The journal: what specd says of a unit, and what it tells of an instance (how it ended, what
/// it said last).
pub trait Journal {
    /// Say in the unit's journal who acts on it and why (`specd diagnose` reads it).
    fn note(&self, unit: &str, action: &str, invocation: &str, message: &str);
    /// How an instance ended, once the journal shows it (up to `within`); `None` when the
    /// journal does not tell.
    fn ending(&self, unit: &str, invocation: &str, within: Duration) -> impl Future<Output = Option<Ending>> + Send;
    /// What an instance wrote after `cursor` (from its first line when `None`), each line with
    /// the monotonic time (µs, [`Host::monotonic_us`]'s clock) the journal took it; `None` when
    /// the journal did not answer. A loading server's lines: what it is doing, and the phases
    /// of its start.
    fn said(&self, invocation: &str, cursor: Option<&str>) -> impl Future<Output = Option<Said>> + Send;
}

/// What an instance wrote since a cursor, and the cursor to read on from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Said {
    pub lines: Vec<(u64, String)>,
    pub cursor: Option<String>,
}

/// The machine's devices: the GPUs' memory.
pub trait Devices {
    /// What `nvidia-smi` says of the GPUs' memory (the lines of `machine::gpu::QUERY`, read by
    /// `core::gpu`); `None` on a host without NVIDIA devices, `Err` when it could not be asked.
    fn gpu_memory(&self) -> impl Future<Output = Option<Result<String, String>>> + Send;
}

/// What a unit's load balancers are told (its serving state) and what specd saw of them (the log
/// of their polls), kept where every specd process on the host reads them: the reconciler marks
/// a unit `drain` before it stops it and says what it left at the end; whichever process answers
/// the load balancers records their polls.
pub trait LoadBalancers {
    /// The unit's serving state now (`None`: it has none).
    fn serving_state(&self, unit: &str) -> Option<ServingState>;
    /// Replace it: a load balancer's next poll is answered by it.
    fn set_serving_state(&self, unit: &str, state: &ServingState) -> Result<()>;
    /// The load balancers' polls of the unit.
    fn lb_polls(&self, unit: &str) -> PollLog;
    /// The wall clock in milliseconds (the polls' times).
    fn now_ms(&self) -> u64;
}

/// specd's own nftables table: a draining unit's port closed to new connections
/// (`service.drain_refuse_new`; the scripts are `core::door`'s). Each call may be made again.
pub trait Firewall {
    /// Refuse new TCP connections to `port` (a reset) until [`Firewall::accept_new`];
    /// established ones go on.
    fn refuse_new(&self, unit: &str, port: u16) -> impl Future<Output = Result<()>> + Send;
    /// Remove the unit's rule (nothing to do when there is none).
    fn accept_new(&self, unit: &str) -> impl Future<Output = Result<()>> + Send;
}

/// The whole boundary: its roles, and what ties them. Cheap to clone (a handle): background
/// reads during an apply hold their own.
pub trait Host:
    ServiceManager
    + Processes
    + UnitFiles
    + Server
    + Journal
    + Devices
    + LoadBalancers
    + Firewall
    + Clone
    + Send
    + Sync
    + 'static
{
    /// The wall clock, unix seconds (a hold's expiry is a time of day).
    fn now(&self) -> u64;
    /// The monotonic clock, µs: systemd's `ExecMainStartTimestampMonotonic` and the journal's
    /// lines are on it (a start's phases).
    fn monotonic_us(&self) -> u64;
    /// The one hold gate, for the agent (its worker and its reconcile): the effect of a unit's
    /// `hold` now for a source whose desired unit is `desired_sha` ([`crate::core::hold::effective`]:
    /// a hold that names no process is in effect until it expires).
    fn hold_effect(&self, hold: Option<&Hold>, desired_sha: &str) -> HoldEffect {
        hold_effect(self, hold, Some(desired_sha))
    }
    /// The same gate for a one-shot command (a hand apply, rollback, suspend, resume, a sweep),
    /// which does not follow the source: a pin holds until it expires or is resumed.
    fn hold_in_effect(&self, hold: Option<&Hold>) -> HoldEffect {
        hold_effect(self, hold, None)
    }
    /// Whether a unit text can start on this host, by looking at it without starting it (its
    /// program, model paths, files, user, port...: `preflight`), with the drop-ins that will
    /// apply to it (`drop_ins`, paths); `cgroup` is the unit's own (a port its running instance
    /// holds is not in the way); weights' digests are remembered in `state_dir`.
    fn preflight(
        &self,
        spec: &Spec,
        unit_text: &str,
        drop_ins: &[String],
        cgroup: &str,
        state_dir: &Path,
    ) -> impl Future<Output = preflight::Outcome> + Send;
}

/// See [`ServiceManager::watch`].
pub trait Watch: Send {
    /// Until the unit's state changed since the watch began or since the last call. If the
    /// connection to systemd is lost, every 20 ms.
    fn changed(&mut self) -> impl Future<Output = ()> + Send;
}

/// A call to systemd, asked again on a new connection while the old one was [lost]
/// (`crate::machine::dbus::Lost`), 20 ms doubling to 1 s apart, for up to [`timing::RECONNECT_WITHIN`]. Every call
/// specd asks again is one that may be repeated: a property read; `Reload` (reloading twice
/// loads the same files); `StartUnit`/`StopUnit` in mode `replace` (systemd keeps its jobs
/// across a re-execution, and asking again for a job that is queued returns that job, and for
/// one already done returns one that ends at once); enabling or disabling (the same links).
/// Both hosts go through it, so the reconciler's fault matrix exercises this very loop.
///
/// [lost]: crate::machine::dbus::is_lost
pub async fn reconnecting<T, F: Future<Output = Result<T>>>(what: &str, call: impl Fn() -> F) -> Result<T> {
    let deadline = Instant::now() + timing::RECONNECT_WITHIN;
    let mut pause = Duration::from_millis(20);
    loop {
        match call().await {
            Err(e) if crate::machine::dbus::is_lost(&e) && Instant::now() < deadline => {
                tracing::info!("{what}: the connection to systemd was lost ({e:#}); asking again");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(1));
            }
            r => return r,
        }
    }
}

/// [`Host::hold_effect`] and [`Host::hold_in_effect`]: the pure decision, with the hold's
/// process looked at on `host` (when it names one).
fn hold_effect<H: Host>(host: &H, hold: Option<&Hold>, desired_sha: Option<&str>) -> HoldEffect {
    let alive = hold.is_some_and(|h| h.pid.is_some() && host.holder_alive(h));
    crate::core::hold::effective(hold, host.now(), alive, desired_sha)
}

/// How an instance ended, as its diagnosis says it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ending {
    /// A clean stop (on request, or by itself with success).
    pub clean: bool,
    /// The diagnosis's verdict, by its name (`crash`, `cuda-oom`, `clean-stop`...).
    pub verdict: String,
    pub summary: String,
    /// The server's own fatal error, as it said it (a failed start, a crash).
    pub engine_error: Option<String>,
}

/// Where a unit's file lives in a unit directory.
pub fn unit_path(unit_dir: &Path, unit: &str) -> PathBuf {
    unit_dir.join(unit)
}
