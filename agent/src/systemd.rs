//! systemd, behind a small trait: `systemctl` verbs and `systemctl show -p` (machine-readable).

use std::collections::BTreeMap;
use std::future::Future;

use anyhow::{Context, Result, bail};

pub use crate::service::ActiveState;
use tokio::process::Command;

/// The properties specd reads.
pub const PROPS: &[&str] = &[
    "LoadState",
    "ActiveState",
    "SubState",
    "Result",
    "ExecMainCode",
    "ExecMainStatus",
    "ExecMainPID",
    "MainPID",
    "NRestarts",
    "ControlGroup",
    "NeedDaemonReload",
    "FragmentPath",
    "DropInPaths",
    "InvocationID",
    "ExecMainStartTimestampMonotonic",
    "ExecMainExitTimestampMonotonic",
    "TimeoutStopUSec",
    "UnitFileState",
];

/// A unit as `systemctl show` reports it.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct UnitProps {
    pub load_state: String,
    pub active_state: ActiveState,
    pub sub_state: String,
    pub result: String,
    pub exec_main_code: u32,
    pub exec_main_status: i32,
    pub main_pid: u32,
    pub n_restarts: u32,
    pub control_group: String,
    pub need_daemon_reload: bool,
    pub fragment_path: String,
    pub drop_in_paths: Vec<String>,
    pub invocation_id: String,
    pub exec_main_start_mono: u64,
    /// `masked`, `masked-runtime`, `enabled`... (a mask in /run may be shadowed by a unit file
    /// in /etc: `LoadState` is then `loaded`, but the mask is there).
    pub unit_file_state: String,
}

impl UnitProps {
    pub fn parse(text: &str) -> UnitProps {
        let m: BTreeMap<&str, &str> = text.lines().filter_map(|l| l.split_once('=')).collect();
        let s = |k: &str| m.get(k).copied().unwrap_or("").to_string();
        let n = |k: &str| m.get(k).and_then(|v| v.parse().ok()).unwrap_or(0);
        UnitProps {
            load_state: s("LoadState"),
            active_state: ActiveState::parse(&s("ActiveState")),
            sub_state: s("SubState"),
            result: s("Result"),
            exec_main_code: n("ExecMainCode") as u32,
            exec_main_status: m.get("ExecMainStatus").and_then(|v| v.parse().ok()).unwrap_or(0),
            main_pid: n("MainPID") as u32,
            n_restarts: n("NRestarts") as u32,
            control_group: s("ControlGroup"),
            need_daemon_reload: s("NeedDaemonReload") == "yes",
            fragment_path: s("FragmentPath"),
            drop_in_paths: s("DropInPaths").split_whitespace().map(str::to_string).collect(),
            invocation_id: s("InvocationID"),
            exec_main_start_mono: n("ExecMainStartTimestampMonotonic"),
            unit_file_state: s("UnitFileState"),
        }
    }

    /// Someone masked the unit (`systemctl mask`, with or without `--runtime`).
    pub fn is_masked(&self) -> bool {
        self.load_state == "masked" || self.unit_file_state.starts_with("masked")
    }

    /// A process of the unit may be alive (running, starting, stopping, or about to restart).
    pub fn is_running(&self) -> bool {
        self.active_state.may_run() || self.main_pid > 0
    }

    pub fn is_stopped(&self) -> bool {
        self.active_state.is_stopped() && self.main_pid == 0
    }

    /// Exit status as systemd prints it: `3`, or `9/KILL` for a signal.
    pub fn exit_status(&self) -> String {
        match self.exec_main_code {
            1 => format!("{}", self.exec_main_status),
            2 | 3 => {
                let sig = nix::sys::signal::Signal::try_from(self.exec_main_status)
                    .map(|s| s.as_str().trim_start_matches("SIG").to_string())
                    .unwrap_or_default();
                format!("{}/{sig}", self.exec_main_status)
            }
            _ => "-".into(),
        }
    }
}

pub trait Systemd: Send + Sync {
    fn show(&self, unit: &str) -> impl Future<Output = Result<UnitProps>> + Send;
    /// `systemctl VERB [UNIT]` for stop (no-block), start, daemon-reload, reset-failed, kill.
    fn run(&self, args: &[&str]) -> impl Future<Output = Result<()>> + Send;
}

/// The real thing: the `systemctl` binary.
#[derive(Clone, Debug, Default)]
pub struct Systemctl;

impl Systemd for Systemctl {
    async fn show(&self, unit: &str) -> Result<UnitProps> {
        let out = Command::new("systemctl")
            .arg("show")
            .arg(unit)
            .arg("-p")
            .arg(PROPS.join(","))
            .output()
            .await
            .context("running systemctl (is systemd installed?)")?;
        if !out.status.success() {
            bail!("systemctl show {unit}: {}", String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(UnitProps::parse(&String::from_utf8_lossy(&out.stdout)))
    }

    async fn run(&self, args: &[&str]) -> Result<()> {
        let out = Command::new("systemctl").args(args).output().await.context("running systemctl")?;
        if !out.status.success() {
            bail!("systemctl {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_show_output() {
        let p = UnitProps::parse(
            "LoadState=loaded\nActiveState=failed\nSubState=failed\nResult=timeout\nExecMainCode=2\nExecMainStatus=9\nMainPID=0\nNRestarts=3\nNeedDaemonReload=yes\nDropInPaths=/etc/systemd/system/x.service.d/a.conf /run/systemd/system/x.service.d/b.conf\n",
        );
        assert_eq!(p.result, "timeout");
        assert!(p.need_daemon_reload);
        assert_eq!(p.exit_status(), "9/KILL");
        assert_eq!(p.drop_in_paths.len(), 2);
        assert!(p.is_stopped());
    }
}
