//! The real host: the machine, as [`super::Host`] names its parts. systemd over its D-Bus, `/proc`
//! and the cgroup tree, the file system, HTTP to the server, journald.

use std::path::Path;
use std::time::Duration;

use anyhow::Result;
use serde_json::Value;
use specd_spec::{Engine, Spec};
use tokio::time::Instant;

use super::{
    Devices, Ending, Firewall, Host, Journal, LoadBalancers, Processes, Server, ServiceManager, UnitFiles, Watch,
    reconnecting,
};
use crate::core::hold::Hold;
use crate::core::serving::{PollLog, ServingState};
use crate::core::speculation::Speculation;
use crate::core::timing;
use crate::machine::atomic;
use crate::machine::cgroup::{self, Layout, Lingering};
use crate::machine::probe::{Health, Probe};
use crate::machine::process::{exited, pid_start, same_process};
use crate::machine::serving::ServingFiles;
use crate::machine::systemd::{Systemd, UnitProps};
use crate::preflight;

/// The machine: systemd over D-Bus, `/proc` and the cgroup tree, the file system, HTTP to the
/// server, journald, specd's runtime directory (what load balancers are told).
#[derive(Clone)]
pub struct RealHost {
    pub systemd: Systemd,
    pub layout: Layout,
    pub probe: Probe,
    pub serving: ServingFiles,
}

impl RealHost {
    pub fn new(layout: Layout) -> RealHost {
        RealHost { systemd: Systemd::default(), layout, probe: Probe::default(), serving: ServingFiles::host() }
    }
}

impl LoadBalancers for RealHost {
    fn serving_state(&self, unit: &str) -> Option<ServingState> {
        self.serving.read(unit)
    }

    fn set_serving_state(&self, unit: &str, state: &ServingState) -> Result<()> {
        self.serving.write(unit, state)
    }

    fn lb_polls(&self, unit: &str) -> PollLog {
        self.serving.polls(unit)
    }

    fn now_ms(&self) -> u64 {
        crate::machine::store::now_ms()
    }
}

/// A unit's changes, out of all of systemd's `PropertiesChanged` signals.
pub struct UnitWatch {
    unit: String,
    changes: Option<crate::machine::systemd::UnitChanges>,
}

impl Watch for UnitWatch {
    async fn changed(&mut self) {
        if let Some(c) = self.changes.as_mut() {
            while let Some(u) = c.next().await {
                if u == self.unit {
                    return;
                }
            }
            self.changes = None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

impl ServiceManager for RealHost {
    async fn show(&self, unit: &str) -> Result<UnitProps> {
        reconnecting("reading a unit's properties", || self.systemd.show(unit)).await
    }

    async fn start(&self, unit: &str) -> Result<()> {
        reconnecting("starting a unit", || self.systemd.start(unit)).await
    }

    async fn stop(&self, unit: &str, wait: bool) -> Result<()> {
        reconnecting("stopping a unit", || self.systemd.stop(unit, wait)).await
    }

    async fn daemon_reload(&self) -> Result<()> {
        reconnecting("daemon-reload", || self.systemd.daemon_reload()).await
    }

    type Watch = UnitWatch;

    async fn watch(&self, unit: &str) -> UnitWatch {
        let changes = match self.systemd.state_changes().await {
            Ok(c) => Some(c),
            Err(e) => {
                tracing::warn!(unit, "no signals from systemd ({e:#}): its state is looked at every 20 ms");
                None
            }
        };
        UnitWatch { unit: unit.to_string(), changes }
    }

    async fn enable(&self, unit: &str) -> Result<()> {
        reconnecting("enabling a unit", || self.systemd.enable(unit)).await
    }

    async fn disable(&self, unit: &str) -> Result<()> {
        reconnecting("disabling a unit", || self.systemd.disable(unit)).await
    }
}

impl Processes for RealHost {
    fn alive(&self, pid: u32) -> bool {
        cgroup::alive(pid)
    }

    fn cmdline(&self, pid: u32) -> Option<Vec<String>> {
        cgroup::cmdline(pid)
    }

    /// The same pid, started at the same time.
    fn holder_alive(&self, hold: &Hold) -> bool {
        hold.pid.is_some_and(|p| same_process(p, hold.pid_start))
    }

    async fn holder_exit(&self, hold: &Hold) {
        let Some(pid) = hold.pid else { return std::future::pending().await };
        match exited(pid, hold.pid_start) {
            Some(exit) => exit.await,
            None => tokio::time::sleep(timing::HOLDER_RECHECK).await,
        }
    }

    fn me(&self) -> (u32, Option<u64>) {
        let me = std::process::id();
        (me, pid_start(me))
    }

    fn own_unit(&self) -> Option<String> {
        crate::machine::process::own_unit()
    }

    fn populated(&self, cg: &str) -> bool {
        self.layout.populated(cg)
    }

    async fn wait_empty(&self, cg: &str, deadline: Instant, tick: impl FnMut() + Send) -> Result<(), Vec<Lingering>> {
        cgroup::wait_empty(&self.layout, cg, deadline, tick).await
    }
}

impl UnitFiles for RealHost {
    fn read(&self, path: &Path) -> Result<Option<Vec<u8>>> {
        atomic::read_opt(path)
    }

    fn write(&self, path: &Path, bytes: &[u8]) -> Result<()> {
        atomic::atomic_write(path, bytes, 0o644)
    }

    fn exists(&self, path: &Path) -> bool {
        path.exists()
    }

    fn is_mask(&self, path: &Path) -> bool {
        std::fs::read_link(path).is_ok_and(|t| t == Path::new("/dev/null"))
    }

    fn clean_temps(&self, dir: &Path, name: &str) {
        atomic::clean_temps(dir, name)
    }

    fn move_aside(&self, path: &Path, dest: &Path) -> Result<()> {
        use anyhow::Context;
        if let Some(dir) = dest.parent() {
            atomic::ensure_private_dir(dir)?;
        }
        // The copy is the owner's only (a drop-in may set secrets).
        std::fs::copy(path, dest)
            .and_then(|_| std::fs::set_permissions(dest, std::os::unix::fs::PermissionsExt::from_mode(0o600)))
            .and_then(|_| std::fs::remove_file(path))
            .with_context(|| format!("moving {} aside", path.display()))
    }
}

impl Server for RealHost {
    async fn health(&self, url: &str) -> Health {
        self.probe.health(url).await
    }

    async fn reported_args(&self, base_url: &str, spec: &Spec, invocation: &str) -> Option<Result<Value, String>> {
        reported_args(&self.probe, base_url, spec, invocation).await
    }

    async fn running_requests(&self, base_url: &str, engine: Engine) -> Option<u64> {
        self.probe.running_requests(base_url, engine).await
    }

    async fn speculation(&self, base_url: &str, spec: &Spec) -> Result<Speculation, String> {
        self.probe.speculation(base_url, spec).await
    }
}

impl Journal for RealHost {
    fn note(&self, unit: &str, action: &str, invocation: &str, message: &str) {
        let _ = crate::diagnose::journal_note(unit, action, Some(invocation), message);
    }

    async fn said(&self, invocation: &str, cursor: Option<&str>) -> Option<super::Said> {
        let (lines, cursor) = crate::diagnose::said(invocation, cursor).await?;
        Some(super::Said { lines, cursor })
    }

    async fn ending(&self, unit: &str, invocation: &str, within: Duration) -> Option<Ending> {
        let d = if invocation.is_empty() {
            tokio::time::timeout(within, crate::diagnose::last_verdict(unit)).await.ok().flatten()
        } else {
            crate::diagnose::instance_verdict(unit, invocation, within).await
        };
        d.map(|d| Ending {
            clean: d.verdict == crate::diagnose::Verdict::CleanStop,
            verdict: d.verdict.as_str().to_string(),
            summary: d.summary,
            engine_error: d.engine_error,
        })
    }
}

impl Devices for RealHost {
    async fn gpu_memory(&self) -> Option<Result<String, String>> {
        crate::machine::gpu::memory(Path::new("/dev")).await
    }
}

impl Firewall for RealHost {
    async fn refuse_new(&self, unit: &str, port: u16) -> Result<()> {
        crate::machine::nft::apply(&crate::core::door::close_script(unit, port)).await
    }

    /// Without `nft`, there is no rule of specd's to remove.
    async fn accept_new(&self, unit: &str) -> Result<()> {
        match crate::machine::nft::apply(&crate::core::door::open_script(unit)).await {
            Err(e) if crate::machine::nft::missing(&e) => Ok(()),
            r => r,
        }
    }
}

impl Host for RealHost {
    fn now(&self) -> u64 {
        crate::machine::store::now()
    }

    fn monotonic_us(&self) -> u64 {
        crate::machine::process::monotonic_us()
    }

    async fn preflight(
        &self,
        spec: &Spec,
        unit_text: &str,
        drop_ins: &[String],
        cgroup: &str,
        state_dir: &Path,
    ) -> preflight::Outcome {
        preflight::on_this_host(spec, unit_text, drop_ins, cgroup, state_dir).await.1
    }
}

/// The server's own report of the args it runs with (`None`: the engine has none): the JSON its
/// endpoint answers, or the Python dict its instance logged at start (`invocation`).
pub async fn reported_args(
    probe: &Probe,
    base_url: &str,
    spec: &Spec,
    invocation: &str,
) -> Option<Result<Value, String>> {
    use specd_spec::ArgsReport;
    Some(match spec.args_report() {
        ArgsReport::None => return None,
        ArgsReport::Endpoint(path) => probe.json(&format!("{base_url}{path}")).await,
        ArgsReport::LogLine(marker) => crate::diagnose::first_said(invocation, marker).await.and_then(|said| {
            specd_spec::pyrepr::parse(&said).map_err(|e| format!("the logged args ({marker}…) do not read: {e}"))
        }),
    })
}
