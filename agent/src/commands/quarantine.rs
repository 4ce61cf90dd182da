//! `specd unquarantine UNIT`: a quarantined unit hash may be tried again.

use super::control::notify_agent;
use crate::core::record;
use crate::machine::store::{self, Store};
use crate::reconcile::context::Dirs;
use anyhow::Result;
use specd_spec::short;
use std::path::PathBuf;

/// `specd unquarantine UNIT`: clear the quarantine of every hash of a unit, recorded in its
/// history, under the unit's lock (so it works while the agent runs); then ask the agent, if one
/// runs, to reconcile the unit.
pub async fn unquarantine(dirs: &Dirs, unit: String, socket: PathBuf) -> Result<u8> {
    let unit = unit.as_str();
    let store = Store::new(&dirs.state_dir);
    let locks = store.locks_dir();
    let lock = match crate::machine::lock::UnitLock::try_acquire(&locks, unit)? {
        Some(l) => l,
        None => {
            eprintln!("waiting: another specd is reconciling {unit}");
            crate::machine::lock::UnitLock::acquire(&locks, unit).await?
        }
    };
    let mut st = store.load(unit)?;
    if st.quarantine.is_empty() {
        println!("{unit}: nothing is quarantined");
        return Ok(0);
    }
    for q in std::mem::take(&mut st.quarantine) {
        let message = format!(
            "Unquarantined: {unit}: cleared the quarantine of unit {} (it had failed: {}); it is tried again",
            short(&q.sha256),
            q.reason
        );
        println!("{message}");
        st.record(record::HistoryEntry {
            time: store::now(),
            sha256: q.sha256,
            source: q.source,
            outcome: record::Outcome::Unquarantined,
            message,
            stop_verdict: None,
            duration_ms: 0,
            startup: None,
        });
    }
    store.save(&st)?;
    drop(lock);
    // A running agent tries it now (none may run: then the next apply or agent start does).
    notify_agent(&socket, unit).await;
    Ok(0)
}
