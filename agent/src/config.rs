//! The agent's configuration: `/etc/specd/agent.yaml`; command-line flags override it.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use serde::Deserialize;

use crate::source::{SourceConfig, Verify};

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    /// A local path or URL of the config repository.
    pub repo: Option<String>,
    /// Branch to follow (default `main`).
    pub branch: Option<String>,
    /// Follow a tag instead of a branch.
    pub tag: Option<String>,
    /// A spec file or a directory of specs in the repository (default: the repository root).
    pub path: Option<String>,
    /// Seconds between polls of a remote repository (jittered). Default 60.
    pub interval: Option<u64>,
    /// Seconds between full resyncs of every unit. Default 300.
    pub resync: Option<u64>,
    pub state_dir: Option<PathBuf>,
    pub unit_dir: Option<PathBuf>,
    /// Hostname for host overlays (default: this machine's).
    pub hostname: Option<String>,
    /// A file holding an HTTPS token.
    pub token_file: Option<PathBuf>,
    /// An SSH private key for ssh:// remotes.
    pub ssh_key_file: Option<PathBuf>,
    /// Only deploy commits signed by a key listed in this allowed-signers file.
    pub verify_ssh_allowed_signers: Option<PathBuf>,
    /// Only deploy commits signed by a key in this OpenPGP keyring.
    pub verify_gpg_keyring: Option<PathBuf>,
    /// Deploy a head that does not descend from the deployed commit (force push). Default false.
    #[serde(default)]
    pub allow_rewind: bool,
    /// Stop and remove units whose spec was removed from the repository. Default false: they are
    /// left running and reported as orphaned.
    #[serde(default)]
    pub prune: bool,
    /// Address of the read-only metrics endpoint (`GET /metrics`, `GET /healthz`); any address,
    /// so that Prometheus on another host can scrape it. Default `127.0.0.1:9464`.
    pub listen: Option<String>,
    /// The Unix socket of control actions (`specd reconcile`, `specd unquarantine`). Default
    /// `/run/specd/control.sock`, root's only (directory 0700, socket 0600).
    pub control_socket: Option<PathBuf>,
    /// A group whose members may use the control socket too (directory 0750, socket 0660).
    pub control_group: Option<String>,
    /// Only units whose names match this pattern (`*`, `?`) are managed; a commit with any other
    /// is not deployed. Default: any name (specd's own, systemd's and D-Bus's units never are).
    pub manage_units: Option<String>,
}

/// Where the agent listens for control actions unless configured otherwise.
pub const CONTROL_SOCKET: &str = "/run/specd/control.sock";

impl AgentConfig {
    pub fn load(path: &Path) -> Result<AgentConfig> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(AgentConfig::default()),
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        };
        serde_saphyr::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
    }

    /// The control socket: `control_socket`, else [`CONTROL_SOCKET`].
    pub fn control_socket(&self) -> PathBuf {
        self.control_socket.clone().unwrap_or_else(|| PathBuf::from(CONTROL_SOCKET))
    }

    pub fn source(&self) -> Result<SourceConfig> {
        let Some(repo) = self.repo.clone() else {
            bail!("no repository configured: set `repo` in the agent config or pass --repo")
        };
        let verify = match (&self.verify_ssh_allowed_signers, &self.verify_gpg_keyring) {
            (Some(_), Some(_)) => bail!("configure one of verify_ssh_allowed_signers and verify_gpg_keyring, not both"),
            (Some(f), None) => Some(Verify::Ssh { allowed_signers: f.clone() }),
            (None, Some(k)) => Some(Verify::Gpg { keyring: k.clone() }),
            (None, None) => None,
        };
        Ok(SourceConfig {
            repo,
            branch: self.branch.clone().unwrap_or_else(|| "main".into()),
            tag: self.tag.clone(),
            path: self.path.clone().unwrap_or_default(),
            token_file: self.token_file.clone(),
            ssh_key_file: self.ssh_key_file.clone(),
            verify,
        })
    }
}

/// The control socket of the agent that `config` configures, for the commands that talk to it:
/// `flag`, else the config's `control_socket`, else the default. A config that cannot be read is
/// a warning, not an error: the default socket is tried.
pub fn control_socket(flag: Option<PathBuf>, config: &Path) -> PathBuf {
    if let Some(s) = flag {
        return s;
    }
    match AgentConfig::load(config) {
        Ok(cfg) => cfg.control_socket(),
        Err(e) => {
            eprintln!("specd: warning: {e:#}; using {CONTROL_SOCKET}");
            PathBuf::from(CONTROL_SOCKET)
        }
    }
}
