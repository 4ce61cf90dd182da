//! Where every specd process on the host reads and writes what a unit's load balancers are told
//! (its serving state: `<unit>.json`) and what specd saw of them (the log of their polls:
//! `<unit>.polls.json`): in specd's runtime directory, `/run/specd/serving`, which the host's
//! start empties (a state from before a reboot would be a lie), each file replaced atomically.
//! The reconciler (an apply, the agent's) writes the state; whichever process answers the load
//! balancers (the agent, or a one-shot command while no agent does) reads it and writes the
//! polls.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::core::serving::{PollLog, ServingState};
use crate::machine::atomic;

/// The directory on a host.
pub const DIR: &str = "/run/specd/serving";

const POLLS: &str = ".polls.json";

/// The files of one directory.
#[derive(Clone, Debug)]
pub struct ServingFiles {
    pub dir: PathBuf,
}

impl ServingFiles {
    pub fn new(dir: impl Into<PathBuf>) -> ServingFiles {
        ServingFiles { dir: dir.into() }
    }

    /// The host's: [`DIR`].
    pub fn host() -> ServingFiles {
        ServingFiles::new(DIR)
    }

    fn state_path(&self, unit: &str) -> PathBuf {
        self.dir.join(format!("{unit}.json"))
    }

    fn polls_path(&self, unit: &str) -> PathBuf {
        self.dir.join(format!("{unit}{POLLS}"))
    }

    /// The unit's state; `None` when it has none (or its file cannot be read as one).
    pub fn read(&self, unit: &str) -> Option<ServingState> {
        let bytes = atomic::read_opt(&self.state_path(unit)).ok()??;
        serde_json::from_slice(&bytes).ok()
    }

    /// Replace the unit's state.
    pub fn write(&self, unit: &str, state: &ServingState) -> Result<()> {
        let path = self.state_path(unit);
        write(&path, &serde_json::to_vec(state)?)
    }

    /// The unit's poll log (empty when there is none, or it cannot be read).
    pub fn polls(&self, unit: &str) -> PollLog {
        let bytes = atomic::read_opt(&self.polls_path(unit)).ok().flatten();
        bytes.and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default()
    }

    /// Replace the unit's poll log.
    pub fn write_polls(&self, unit: &str, log: &PollLog) -> Result<()> {
        write(&self.polls_path(unit), &serde_json::to_vec(log)?)
    }
}

/// An atomic write of a file of the directory, made (root's only) if it is missing.
fn write(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().context("a directory")?;
    if !dir.is_dir() {
        atomic::ensure_private_dir(dir)?;
    }
    atomic::atomic_write(path, bytes, 0o600)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::serving::{CheckKind, Word};

    #[test]
    fn a_unit_s_state_and_polls_are_read_back_and_a_missing_or_torn_one_is_none() {
        let d = tempfile::tempdir().unwrap();
        let f = ServingFiles::new(d.path().join("serving"));
        assert_eq!(f.read("q.service"), None);
        assert_eq!(f.polls("q.service"), PollLog::default());
        let s = ServingState::Drain { why: "specd is applying unit 1a2b3c4d".into(), since: 7 };
        f.write("q.service", &s).unwrap();
        assert_eq!(f.read("q.service"), Some(s));
        let mut log = PollLog::default();
        log.record(CheckKind::AgentCheck, "127.0.0.1", 5, Word::Drain);
        f.write_polls("q.service", &log).unwrap();
        assert_eq!(f.polls("q.service"), log);
        f.write("r.service", &ServingState::Ready { since: 1 }).unwrap();
        assert_eq!(f.read("r.service"), Some(ServingState::Ready { since: 1 }));
        std::fs::write(d.path().join("serving/r.service.json"), "{\"state\":").unwrap();
        assert_eq!(f.read("r.service"), None);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(d.path().join("serving")).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
    }
}
