//! One reconciler per unit across processes: an exclusive `flock` on a file in the state dir, so
//! that `specd apply` and the agent never interleave on a unit. The kernel drops the lock when the
//! holder dies, so a killed apply never leaves a stale lock behind.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use anyhow::{Context, Result};
use nix::fcntl::{Flock, FlockArg};

use crate::machine::atomic;

pub struct UnitLock {
    _lock: Flock<File>,
}

fn open(dir: &Path, unit: &str) -> Result<File> {
    atomic::ensure_private_dir(dir)?;
    let p = dir.join(format!("{unit}.lock"));
    OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
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

    /// Whether another process holds the lock, without taking it or creating anything (so that
    /// read-only commands work on a read-only state dir).
    pub fn held(dir: &Path, unit: &str) -> bool {
        let Ok(f) = File::open(dir.join(format!("{unit}.lock"))) else { return false };
        match Flock::lock(f, FlockArg::LockSharedNonblock) {
            Ok(_) => false,
            Err((_, e)) => e == nix::errno::Errno::EWOULDBLOCK,
        }
    }

    /// Wait for the lock, blocking this thread: for a lock held a moment (a small file's save),
    /// from code that runs on a blocking thread already.
    pub fn acquire_blocking(dir: &Path, unit: &str) -> Result<UnitLock> {
        match Flock::lock(open(dir, unit)?, FlockArg::LockExclusive) {
            Ok(l) => Ok(UnitLock { _lock: l }),
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
