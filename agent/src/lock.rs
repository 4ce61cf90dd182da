//! One reconciler per unit across processes: an exclusive `flock` on a file in the state dir, so
//! that `specd apply` and the agent never interleave on a unit. The kernel drops the lock when the
//! holder dies, so a killed apply never leaves a stale lock behind.

use std::fs::{File, OpenOptions};
use std::path::Path;

use anyhow::{Context, Result};
use nix::fcntl::{Flock, FlockArg};

use crate::fsx;

pub struct UnitLock {
    _lock: Flock<File>,
}

fn open(dir: &Path, unit: &str) -> Result<File> {
    fsx::ensure_dir(dir)?;
    let p = dir.join(format!("{unit}.lock"));
    OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&p)
        .with_context(|| format!("opening {}", p.display()))
}

impl UnitLock {
    /// Take the lock without waiting; `None` when another process holds it.
    pub fn try_acquire(dir: &Path, unit: &str) -> Result<Option<UnitLock>> {
        match Flock::lock(open(dir, unit)?, FlockArg::LockExclusiveNonblock) {
            Ok(l) => Ok(Some(UnitLock { _lock: l })),
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => Ok(None),
            Err((_, e)) => Err(e).context("flock"),
        }
    }

    /// Wait for the lock (on a blocking thread).
    pub async fn acquire(dir: &Path, unit: &str) -> Result<UnitLock> {
        let f = open(dir, unit)?;
        tokio::task::spawn_blocking(move || match Flock::lock(f, FlockArg::LockExclusive) {
            Ok(l) => Ok(UnitLock { _lock: l }),
            Err((_, e)) => Err(e).context("flock"),
        })
        .await?
    }
}
