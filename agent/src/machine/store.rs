//! specd's own state, per unit, in the state directory (default `/var/lib/specd`): what was
//! applied, from where, when and with what result; the last good unit (the rollback target); the
//! quarantine of spec hashes that failed; and the history of applies. Written atomically.

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use crate::core::hold::Hold;
use crate::machine::atomic;

use crate::core::record::{DesiredRecord, HistoryEntry, Outcome, UnitState};

pub fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// The wall clock in milliseconds since the epoch.
pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// The state of a unit specd knows nothing about yet.
fn fresh(unit: &str) -> UnitState {
    UnitState { unit: unit.to_string(), ..Default::default() }
}

/// Where the store reads and writes a unit's state file: the state directory on disk, or a host
/// that stands for the machine (the fault matrix's, which can fail or kill specd at any of them).
pub trait StateFiles: Send + Sync {
    /// The file's bytes, `None` when there is none.
    fn read_state(&self, path: &Path) -> Result<Option<Vec<u8>>>;
    /// Replace the file atomically (write a temporary file, fsync, rename), mode 0600. The
    /// caller holds the file's lock (a unit's: [`crate::machine::lock::UnitLock`]), so the temporary files
    /// of this file that an earlier write left (killed before its rename) are stale: removed.
    fn write_state(&self, path: &Path, bytes: &[u8]) -> Result<()>;
    /// Move the file to `dest` (a private directory made if need be).
    fn set_aside_state(&self, path: &Path, dest: &Path) -> Result<()>;
}

/// The state directory on disk.
pub struct Disk;

impl StateFiles for Disk {
    fn read_state(&self, path: &Path) -> Result<Option<Vec<u8>>> {
        atomic::read_opt(path)
    }

    fn write_state(&self, path: &Path, bytes: &[u8]) -> Result<()> {
        if let (Some(dir), Some(name)) = (path.parent(), path.file_name()) {
            atomic::clean_temps(dir, &name.to_string_lossy());
        }
        atomic::atomic_write(path, bytes, 0o600)
    }

    fn set_aside_state(&self, path: &Path, dest: &Path) -> Result<()> {
        use anyhow::Context;
        if let Some(dir) = dest.parent() {
            atomic::ensure_private_dir(dir)?;
        }
        std::fs::rename(path, dest).with_context(|| format!("moving {} to {}", path.display(), dest.display()))
    }
}

/// The state directory.
#[derive(Clone)]
pub struct Store {
    pub dir: PathBuf,
    files: std::sync::Arc<dyn StateFiles>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("dir", &self.dir).finish()
    }
}

impl Store {
    pub fn new(dir: impl Into<PathBuf>) -> Store {
        Store::on(dir, std::sync::Arc::new(Disk))
    }

    /// A store whose unit state files are read and written through `files`.
    pub fn on(dir: impl Into<PathBuf>, files: std::sync::Arc<dyn StateFiles>) -> Store {
        Store { dir: dir.into(), files }
    }

    fn units_dir(&self) -> PathBuf {
        self.dir.join("units")
    }

    pub fn locks_dir(&self) -> PathBuf {
        self.dir.join("locks")
    }

    fn path(&self, unit: &str) -> PathBuf {
        self.units_dir().join(format!("{unit}.json"))
    }

    /// A unit's state. A corrupt file affects only its unit: it is moved aside
    /// (`<unit>.json.corrupt-<time>`, left in place on a read-only state dir), a warning says so,
    /// and the unit starts afresh: the next reconcile observes it from the host (the deployed
    /// unit file's hash, the running process) like a unit specd adopts.
    pub fn load(&self, unit: &str) -> Result<UnitState> {
        let p = self.path(unit);
        Ok(match self.read(unit)? {
            Ok(st) => st,
            Err(e) => {
                let aside = p.with_file_name(format!("{unit}.json.corrupt-{}", now()));
                let what = match std::fs::rename(&p, &aside) {
                    Ok(()) => format!("moved it aside to {}", aside.display()),
                    Err(re) => format!("left it in place ({re})"),
                };
                eprintln!(
                    "specd: warning: {} is corrupt ({e}); {what}; {unit} is observed afresh from the host (its deployed unit file and running process); its history, quarantine and rollback target are in that file",
                    p.display()
                );
                fresh(unit)
            }
        })
    }

    /// A unit's state for a read-only command (`status`, `history`): a corrupt file is reported
    /// and the unit shown afresh, but the file is left where it is: only a reconcile, under the
    /// unit's lock, moves it aside (a read-only command could otherwise move away the good file
    /// an apply just wrote).
    pub fn peek(&self, unit: &str) -> Result<UnitState> {
        Ok(self.read(unit)?.unwrap_or_else(|e| {
            eprintln!(
                "specd: warning: {} is corrupt ({e}); {unit} is shown as if specd had no state for it; the next apply (or the agent) moves the file aside and observes the unit afresh from the host",
                self.path(unit).display()
            );
            fresh(unit)
        }))
    }

    /// A unit's state file, parsed: fresh state when there is none, the parse error when it is
    /// corrupt.
    fn read(&self, unit: &str) -> Result<Result<UnitState, serde_json::Error>> {
        Ok(match self.files.read_state(&self.path(unit))? {
            None => Ok(fresh(unit)),
            Some(bytes) => serde_json::from_slice(&bytes),
        })
    }

    /// Save a unit's state, under the unit's lock (every caller holds it): 0600 in a 0700
    /// directory (it holds the spec, environment included, and the last good unit's text). A
    /// state dir that was open before is made private, with every file in it. A temporary file
    /// an earlier save of the unit left (killed before its rename) is removed.
    pub fn save(&self, st: &UnitState) -> Result<()> {
        let dir = self.units_dir();
        if atomic::ensure_private_dir(&self.dir)? | atomic::ensure_private_dir(&dir)? {
            self.secure();
        }
        let mut bytes = serde_json::to_vec_pretty(st)?;
        bytes.push(b'\n');
        self.files.write_state(&self.path(&st.unit), &bytes)
    }

    /// Move a unit's state file to `dest` (a pruned unit's, kept for a person to read).
    pub fn set_aside(&self, unit: &str, dest: &Path) -> Result<()> {
        self.files.set_aside_state(&self.path(unit), dest)
    }

    /// Make the state dir private: the directory and its subdirectories 0700, their files 0600
    /// (state from a version of specd that wrote them world-readable). Best effort.
    pub fn secure(&self) {
        fn walk(dir: &Path, depth: u32) {
            let _ = atomic::ensure_private_dir(dir);
            let Ok(rd) = std::fs::read_dir(dir) else { return };
            for e in rd.flatten() {
                let Ok(ft) = e.file_type() else { continue };
                if ft.is_dir() && depth < 2 && e.file_name() != "repo" {
                    walk(&e.path(), depth + 1);
                } else if ft.is_file() {
                    let _ = atomic::make_private(&e.path());
                }
            }
        }
        walk(&self.dir, 0);
    }

    /// Put a hold on a unit, under the unit's lock (it waits for a reconcile of the unit to
    /// finish), recorded in its history. Replaces a hold that was there.
    pub async fn set_hold(&self, unit: &str, hold: Hold) -> Result<()> {
        let _lock = crate::machine::lock::UnitLock::acquire(&self.locks_dir(), unit).await?;
        let mut st = self.load(unit)?;
        let message = format!("HoldSet: {unit}: {}", hold.describe());
        let sha = hold.pinned_sha256.clone().or_else(|| st.written_sha256.clone()).unwrap_or_default();
        st.record(HistoryEntry {
            time: now(),
            sha256: sha,
            source: None,
            outcome: Outcome::HoldSet,
            message,
            stop_verdict: None,
            duration_ms: 0,
            startup: None,
        });
        st.hold = Some(hold);
        self.save(&st)
    }

    /// Replace a unit's hold with `hold`, under its lock, if the hold it has is `which` (one set
    /// since by someone else stays); no history entry: the same hold goes on (a sweep's pushed
    /// on, a rollback's pin no longer tied to its process). Whether it was replaced.
    pub async fn set_hold_if(&self, unit: &str, hold: Hold, which: impl Fn(&Hold) -> bool) -> Result<bool> {
        let _lock = crate::machine::lock::UnitLock::acquire(&self.locks_dir(), unit).await?;
        let mut st = self.load(unit)?;
        if !st.hold.as_ref().is_some_and(which) {
            return Ok(false);
        }
        st.hold = Some(hold);
        self.save(&st)?;
        Ok(true)
    }

    /// Record the desired state of a unit the agent leaves alone (a hold), under its lock, so
    /// that `status` compares the host with what the source wants now. Nothing else changes.
    pub async fn set_desired(&self, unit: &str, desired: DesiredRecord) -> Result<()> {
        let _lock = crate::machine::lock::UnitLock::acquire(&self.locks_dir(), unit).await?;
        let mut st = self.load(unit)?;
        if st.desired.as_ref().is_some_and(|d| d.sha256 == desired.sha256 && d.source == desired.source) {
            return Ok(());
        }
        st.desired = Some(desired);
        self.save(&st)
    }

    /// End a unit's hold, under its lock, recorded in its history (`why`: resumed, expired…).
    /// The hold that was there, if any.
    pub async fn clear_hold(&self, unit: &str, why: &str) -> Result<Option<Hold>> {
        self.clear_hold_if(unit, why, |_| true).await
    }

    /// End a unit's hold if it is still one `which` accepts (the one a decision was made on,
    /// not one set since).
    pub async fn clear_hold_if(&self, unit: &str, why: &str, which: impl Fn(&Hold) -> bool) -> Result<Option<Hold>> {
        let _lock = crate::machine::lock::UnitLock::acquire(&self.locks_dir(), unit).await?;
        let mut st = self.load(unit)?;
        let Some(h) = st.hold.take_if(|h| which(h)) else { return Ok(None) };
        let sha = h.pinned_sha256.clone().or_else(|| st.written_sha256.clone()).unwrap_or_default();
        st.record(HistoryEntry {
            time: now(),
            sha256: sha,
            source: None,
            outcome: Outcome::HoldCleared,
            message: format!("HoldCleared: {unit}: no longer {}: {why}", h.describe()),
            stop_verdict: None,
            duration_ms: 0,
            startup: None,
        });
        self.save(&st)?;
        Ok(Some(h))
    }

    /// The temporary files that saves killed before their rename left in the state dir,
    /// removed: a unit's when its lock is free (no save of it can be under way; one held is
    /// cleaned by its holder's next save), `source.json`'s when its lock is free. At the agent's
    /// start.
    pub fn clean_stale_temps(&self) {
        let dir = self.units_dir();
        let Ok(rd) = std::fs::read_dir(&dir) else { return };
        let mut files: Vec<String> = rd
            .flatten()
            .filter_map(|e| atomic::temp_of(&e.file_name().to_string_lossy()).map(str::to_string))
            .collect();
        files.dedup();
        for file in files {
            let Some(unit) = file.strip_suffix(".json") else { continue };
            if let Ok(Some(_lock)) = crate::machine::lock::UnitLock::try_acquire(&self.locks_dir(), unit) {
                atomic::clean_temps(&dir, &file);
            }
        }
        SourceState::clean_stale_temps(&self.dir);
    }

    /// Units specd has state for, sorted.
    pub fn units(&self) -> Result<Vec<String>> {
        let dir = self.units_dir();
        let rd = match std::fs::read_dir(&dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
            Err(e) => return Err(e).with_context(|| format!("reading {}", dir.display())),
        };
        let mut v: Vec<String> = rd
            .flatten()
            .filter_map(|e| e.file_name().to_str().and_then(|n| n.strip_suffix(".json")).map(str::to_string))
            .collect();
        v.sort();
        Ok(v)
    }
}

/// What the agent knows about its source, persisted for `status` (`<state dir>/source.json`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SourceState {
    pub repo: String,
    pub followed: String,
    /// The newest commit whose specs were handed to the units (never goes backwards unless
    /// `allow_rewind`).
    pub accepted_commit: Option<String>,
    /// The head seen last, and why it was not accepted, if it was not.
    pub head_commit: Option<String>,
    pub error: Option<String>,
    pub time: u64,
    /// Units that specd manages but the accepted commit has no spec for.
    #[serde(default)]
    pub orphans: Vec<String>,
    /// With a fleet file at the head: where this host stands in the rollout (its wave, the
    /// revision the promotion record assigns it, or why it waits).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fleet: Option<FleetPosition>,
    /// The commit of the record branch whose assigned revision was accepted: a record that does
    /// not descend from it is refused (unless `allow_rewind`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accepted_record: Option<String>,
}

/// Where a host stands in a fleet rollout, as its last read of the source found it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FleetPosition {
    /// The fleet file read, `path@commit` of the head.
    pub file: String,
    /// The branch of the promotion record.
    pub record_branch: String,
    /// The commit of the record branch read (none while the branch does not exist).
    pub record: Option<String>,
    /// This host's wave; none when no wave selects it (it runs the released revision).
    pub wave: Option<String>,
    /// The revision the record assigns this host (what it deploys instead of the head).
    pub assigned: Option<String>,
    /// Whether the host was given the rollout's target ahead of its wave's good revision.
    pub promoted: bool,
    /// Why the host keeps what it runs, when it waits on a promotion.
    pub waiting: Option<String>,
}

impl FleetPosition {
    /// One line for `specd status`: the wave, the assigned revision, or why it waits; with the
    /// followed branch's `head`, whether the head waits for this host's promotion.
    pub fn describe(&self, head: Option<&str>) -> String {
        let wave = self.wave.as_deref().map_or("no wave (the released revision)".into(), |w| format!("wave {w}"));
        let record = self.record.as_deref().map_or_else(
            || format!("no record on {}", self.record_branch),
            |r| format!("record {} of {}", specd_spec::short(r), self.record_branch),
        );
        match (&self.waiting, &self.assigned) {
            (Some(why), _) => format!("{wave}; {why}"),
            (None, Some(a)) => {
                let how = if self.promoted { "promoted to" } else { "assigned" };
                let waits = match head {
                    Some(h) if h != a => {
                        format!("; the head {} waits for this host's promotion", specd_spec::short(h))
                    }
                    _ => String::new(),
                };
                format!("{wave}; {how} {} ({record}; fleet file {}){waits}", specd_spec::short(a), self.file)
            }
            (None, None) => format!("{wave}; {record}"),
        }
    }
}

/// The name of `source.json`'s lock among the units' (no unit is named so).
const SOURCE_LOCK: &str = "source.json";

impl SourceState {
    fn path(state_dir: &Path) -> PathBuf {
        state_dir.join("source.json")
    }

    pub fn load(state_dir: &Path) -> Option<SourceState> {
        let b = std::fs::read(Self::path(state_dir)).ok()?;
        serde_json::from_slice(&b).ok()
    }

    /// Save it (the agent's source reads, one at a time), under its lock when that is free: then
    /// a temporary file an earlier save left (killed before its rename) is removed first.
    pub fn save(&self, state_dir: &Path) -> Result<()> {
        atomic::ensure_private_dir(state_dir)?;
        let mut b = serde_json::to_vec_pretty(self)?;
        b.push(b'\n');
        let _lock = Self::clean_stale_temps(state_dir);
        atomic::atomic_write(&Self::path(state_dir), &b, 0o600)
    }

    /// Its temporary files removed, if its lock is free (no save can be under way); the lock.
    fn clean_stale_temps(state_dir: &Path) -> Option<crate::machine::lock::UnitLock> {
        let lock = crate::machine::lock::UnitLock::try_acquire(&state_dir.join("locks"), SOURCE_LOCK).ok()??;
        atomic::clean_temps(state_dir, "source.json");
        Some(lock)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::hold::HoldKind;
    use crate::core::record::{GOOD_SPECS_MAX, HISTORY_MAX, Quarantined, format_time};

    #[test]
    fn times_format_as_utc() {
        assert_eq!(format_time(0), "1970-01-01T00:00:00Z");
        assert_eq!(format_time(1_796_210_280), "2026-12-02T11:18:00Z");
        assert_eq!(format_time(951_782_400), "2000-02-29T00:00:00Z");
    }

    #[test]
    fn history_is_bounded_and_state_round_trips() {
        let d = tempfile::tempdir().unwrap();
        let store = Store::new(d.path());
        let mut st = store.load("a.service").unwrap();
        for i in 0..(HISTORY_MAX as u64 + 5) {
            st.record(HistoryEntry {
                time: i,
                sha256: "x".into(),
                source: None,
                outcome: Outcome::Applied,
                message: String::new(),
                stop_verdict: None,
                duration_ms: 0,
                startup: None,
            });
        }
        assert_eq!(st.history.len(), HISTORY_MAX);
        assert_eq!(st.history[0].time, 5);
        store.save(&st).unwrap();
        assert_eq!(store.load("a.service").unwrap(), st);
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(d.path()), 0o700);
        assert_eq!(mode(&d.path().join("units/a.service.json")), 0o600);
        assert_eq!(store.units().unwrap(), vec!["a.service".to_string()]);
    }

    #[test]
    fn a_corrupt_state_file_is_moved_aside_and_its_unit_starts_afresh() {
        let d = tempfile::tempdir().unwrap();
        let store = Store::new(d.path());
        let mut ok = store.load("b.service").unwrap();
        ok.quarantine.push(Quarantined { sha256: "q".into(), reason: "r".into(), source: None, time: 1 });
        store.save(&ok).unwrap();
        std::fs::write(d.path().join("units/a.service.json"), "{\"unit\": \"a.service\", \"history\": [").unwrap();
        let a = store.load("a.service").unwrap();
        assert_eq!(a, UnitState { unit: "a.service".into(), ..Default::default() });
        assert_eq!(store.load("b.service").unwrap(), ok);
        assert_eq!(store.units().unwrap(), vec!["b.service".to_string()]);
        let aside: Vec<String> = std::fs::read_dir(d.path().join("units"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("a.service.json.corrupt-"))
            .collect();
        assert_eq!(aside.len(), 1, "{aside:?}");
    }

    /// Saves killed between their temporary file and its rename: at the agent's start, every
    /// such file whose writer's lock is free is removed, never one whose writer holds its lock
    /// (it may be about to rename it); that one goes at its holder's next save.
    #[test]
    fn temps_of_killed_saves_are_removed_but_never_one_a_live_writer_may_rename() {
        let d = tempfile::tempdir().unwrap();
        let store = Store::new(d.path());
        store.save(&fresh("a.service")).unwrap();
        store.save(&fresh("b.service")).unwrap();
        let units = d.path().join("units");
        let killed = |p: &Path| atomic::write_temp(p, b"{}", 0o600).unwrap().into_temp_path().keep().unwrap();
        let a = killed(&units.join("a.service.json"));
        let b = killed(&units.join("b.service.json"));
        // A unit's first save, killed: no state file yet.
        let c = killed(&units.join("c.service.json"));
        let source = killed(&d.path().join("source.json"));
        let b_lock = crate::machine::lock::UnitLock::try_acquire(&store.locks_dir(), "b.service").unwrap().unwrap();
        store.clean_stale_temps();
        assert!(!a.exists() && !c.exists() && !source.exists());
        assert!(b.exists(), "the temp of a save that may be under way was removed");
        store.save(&fresh("b.service")).unwrap();
        assert!(!b.exists());
        drop(b_lock);
        // source.json's own saves clean after a killed one.
        let source = killed(&d.path().join("source.json"));
        SourceState::default().save(d.path()).unwrap();
        assert!(!source.exists());
        assert_eq!(store.units().unwrap(), ["a.service", "b.service"]);
        let left: Vec<_> = std::fs::read_dir(&units).unwrap().flatten().map(|e| e.file_name()).collect();
        assert_eq!(left.len(), 2, "{left:?}");
    }

    #[test]
    fn a_read_only_look_at_a_corrupt_file_leaves_it_in_place() {
        let d = tempfile::tempdir().unwrap();
        let store = Store::new(d.path());
        std::fs::create_dir_all(d.path().join("units")).unwrap();
        let p = d.path().join("units/a.service.json");
        std::fs::write(&p, "{\"unit\": \"a.service\", \"history\": [").unwrap();
        assert_eq!(store.peek("a.service").unwrap(), UnitState { unit: "a.service".into(), ..Default::default() });
        assert!(p.exists());
        assert_eq!(store.units().unwrap(), vec!["a.service".to_string()], "still listed");
    }

    fn desired(sha: &str) -> DesiredRecord {
        let text = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/llama-cpp-qwen-draft.yaml"));
        let spec = specd_spec::parse("t.yaml", text).and_then(|p| p.resolve(None)).unwrap();
        DesiredRecord { sha256: sha.into(), source: None, time: 0, spec }
    }

    fn entry(sha: &str, outcome: Outcome, time: u64) -> HistoryEntry {
        HistoryEntry {
            time,
            sha256: sha.into(),
            source: None,
            outcome,
            message: String::new(),
            stop_verdict: None,
            duration_ms: 0,
            startup: None,
        }
    }

    #[test]
    fn the_specs_of_good_units_are_kept_bounded_for_rollback() {
        let mut st = fresh("a.service");
        // A failed apply keeps nothing; an applied one keeps its spec.
        st.desired = Some(desired("bad"));
        st.record(entry("bad", Outcome::Failed, 1));
        assert!(st.good_specs.is_empty());
        for i in 0..(GOOD_SPECS_MAX as u64 + 3) {
            st.desired = Some(desired(&format!("s{i}")));
            st.record(entry(&format!("s{i}"), Outcome::Applied, 10 + i));
        }
        assert_eq!(st.good_specs.len(), GOOD_SPECS_MAX);
        assert_eq!(st.good_specs[0].sha256, "s3");
        // Applied again: moves to the newest place, with its new time, once.
        st.desired = Some(desired("s5"));
        st.record(entry("s5", Outcome::Started, 99));
        assert_eq!(st.good_specs.len(), GOOD_SPECS_MAX);
        let last = st.good_specs.last().unwrap();
        assert_eq!((last.sha256.as_str(), last.time), ("s5", 99));
        assert_eq!(st.good_specs.iter().filter(|g| g.sha256 == "s5").count(), 1);
        // An entry for another hash than the desired one keeps nothing.
        st.record(entry("other", Outcome::Applied, 100));
        assert!(st.good_specs.iter().all(|g| g.sha256 != "other"));
    }

    #[tokio::test]
    async fn a_hold_is_saved_and_cleared_under_the_lock_and_recorded() {
        let d = tempfile::tempdir().unwrap();
        let store = Store::new(d.path());
        let hold = Hold {
            until: Some(3601),
            reason: Some("incident 42".into()),
            ..Hold::new(HoldKind::Suspend, "root@h (specd suspend)", 1)
        };
        store.set_hold("a.service", hold.clone()).await.unwrap();
        let st = store.load("a.service").unwrap();
        assert_eq!(st.hold.as_ref(), Some(&hold));
        let h = st.history.last().unwrap();
        assert_eq!(h.outcome, Outcome::HoldSet);
        assert_eq!(
            h.message,
            "HoldSet: a.service: suspended by root@h (specd suspend) since 1970-01-01T00:00:01Z until 1970-01-01T01:00:01Z: incident 42"
        );
        // Not cleared when it is not the hold asked for (one set since).
        assert_eq!(store.clear_hold_if("a.service", "x", |h| h.kind == HoldKind::Pin).await.unwrap(), None);
        assert_eq!(store.clear_hold("a.service", "resumed").await.unwrap(), Some(hold));
        let st = store.load("a.service").unwrap();
        assert_eq!(st.hold, None);
        assert_eq!(st.history.last().unwrap().outcome, Outcome::HoldCleared);
        assert!(st.history.last().unwrap().message.ends_with(": resumed"), "{}", st.history.last().unwrap().message);
        assert_eq!(store.clear_hold("a.service", "again").await.unwrap(), None);
        assert_eq!(store.load("a.service").unwrap().history.len(), 2);
    }

    #[tokio::test]
    async fn a_hold_waits_for_a_reconcile_that_holds_the_lock() {
        let d = tempfile::tempdir().unwrap();
        let store = Store::new(d.path());
        let lock = crate::machine::lock::UnitLock::try_acquire(&store.locks_dir(), "a.service").unwrap().unwrap();
        let hold = Hold::new(HoldKind::Suspend, "x", 1);
        let (s2, h2) = (store.clone(), hold.clone());
        let set = tokio::spawn(async move { s2.set_hold("a.service", h2).await });
        // While the lock is held (a reconcile saves its state at its end), nothing is written.
        tokio::task::yield_now().await;
        assert!(!set.is_finished());
        assert_eq!(store.peek("a.service").unwrap().hold, None);
        drop(lock);
        set.await.unwrap().unwrap();
        assert_eq!(store.peek("a.service").unwrap().hold, Some(hold));
    }
}
