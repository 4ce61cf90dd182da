//! Crash-safe file writes: a crash at any instant leaves either the old or the new file, never a mix.

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

use anyhow::{Context, Result};

/// Write `bytes` to `path` atomically with `mode`: a temp file in the same directory, written,
/// fsynced, renamed over `path`, then the directory fsynced so the rename itself is durable.
/// Killed between the temp file and the rename, it leaves the temp file (see [`clean_temps`]).
pub fn atomic_write(path: &Path, bytes: &[u8], mode: u32) -> Result<()> {
    let tmp = write_temp(path, bytes, mode)?;
    tmp.persist(path).map_err(|e| e.error).with_context(|| format!("renaming into {}", path.display()))?;
    fsync_dir(parent(path))
}

/// The first half of [`atomic_write`]: `bytes` in a temp file next to `path`
/// (`.<name>.<6 random letters or digits>.specd-tmp`), written and fsynced, not renamed yet.
pub fn write_temp(path: &Path, bytes: &[u8], mode: u32) -> Result<tempfile::NamedTempFile> {
    let dir = parent(path);
    let name = path.file_name().context("a file name")?.to_string_lossy();
    let mut tmp = tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .rand_bytes(TEMP_RANDOM)
        .suffix(TEMP_SUFFIX)
        .tempfile_in(dir)
        .with_context(|| format!("creating a temporary file in {}", dir.display()))?;
    tmp.as_file().set_permissions(fs::Permissions::from_mode(mode))?;
    tmp.write_all(bytes).with_context(|| format!("writing {}", tmp.path().display()))?;
    tmp.as_file().sync_all().with_context(|| format!("fsync {}", tmp.path().display()))?;
    Ok(tmp)
}

const TEMP_SUFFIX: &str = ".specd-tmp";
const TEMP_RANDOM: usize = 6;

fn parent(path: &Path) -> &Path {
    path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."))
}

/// The name of the file a temp file of [`atomic_write`] was to become, if `file` is one.
pub fn temp_of(file: &str) -> Option<&str> {
    let (name, random) = file.strip_prefix('.')?.strip_suffix(TEMP_SUFFIX)?.rsplit_once('.')?;
    (random.len() == TEMP_RANDOM && random.bytes().all(|b| b.is_ascii_alphanumeric()) && !name.is_empty())
        .then_some(name)
}

pub fn fsync_dir(dir: &Path) -> Result<()> {
    let d = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY)
        .open(dir)
        .with_context(|| format!("opening {}", dir.display()))?;
    d.sync_all().with_context(|| format!("fsync {}", dir.display()))
}

/// Read a file, `None` if it does not exist.
pub fn read_opt(path: &Path) -> Result<Option<Vec<u8>>> {
    match fs::read(path) {
        Ok(b) => Ok(Some(b)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

/// Create a directory (and parents) if missing.
pub fn ensure_dir(path: &Path) -> Result<()> {
    fs::create_dir_all(path).with_context(|| format!("creating {}", path.display()))
}

/// Create a directory (and parents) if missing, readable by its owner only (0700), fixing the
/// mode of one that exists. Returns whether the mode had to be changed.
pub fn ensure_private_dir(path: &Path) -> Result<bool> {
    ensure_dir(path)?;
    let mode = fs::metadata(path).with_context(|| format!("reading {}", path.display()))?.permissions().mode();
    if mode & 0o777 == 0o700 {
        return Ok(false);
    }
    fs::set_permissions(path, fs::Permissions::from_mode(0o700))
        .with_context(|| format!("making {} private (0700)", path.display()))?;
    Ok(true)
}

/// Make a file readable by its owner only (0600).
pub fn make_private(path: &Path) -> Result<()> {
    fs::set_permissions(path, fs::Permissions::from_mode(0o600))
        .with_context(|| format!("making {} private (0600)", path.display()))
}

/// Leftover temp files of an interrupted [`atomic_write`] of `name` in `dir`, removed (those of
/// that file only: not those of `<name>.more`). Only where no write of that file can be under
/// way: the caller holds what serializes its writers.
pub fn clean_temps(dir: &Path, name: &str) {
    if let Ok(rd) = fs::read_dir(dir) {
        for e in rd.flatten() {
            if temp_of(&e.file_name().to_string_lossy()) == Some(name) {
                let _ = fs::remove_file(e.path());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_private_dir_is_created_0700_and_an_open_one_is_fixed() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("state");
        assert!(ensure_private_dir(&p).unwrap());
        assert_eq!(fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o700);
        assert!(!ensure_private_dir(&p).unwrap());
        fs::set_permissions(&p, fs::Permissions::from_mode(0o755)).unwrap();
        assert!(ensure_private_dir(&p).unwrap());
        assert_eq!(fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o700);
    }

    #[test]
    fn replaces_contents_and_mode_and_leaves_no_temp() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("x.service");
        atomic_write(&p, b"old", 0o600).unwrap();
        atomic_write(&p, b"new", 0o644).unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"new");
        assert_eq!(fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o644);
        let names: Vec<_> = fs::read_dir(d.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from("x.service")]);
    }

    #[test]
    fn a_file_s_leftover_temps_are_cleaned_and_no_other_file_s() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.service.json");
        // Killed before the rename: its temp file stays.
        let left = write_temp(&p, b"{}", 0o600).unwrap().into_temp_path().keep().unwrap();
        let name = left.file_name().unwrap().to_string_lossy().into_owned();
        assert_eq!(temp_of(&name), Some("a.service.json"), "{name}");
        // The temp of a file whose name starts with this one's, and files that are not temps.
        let other = write_temp(&d.path().join("a.service.json.b.service.json"), b"{}", 0o600).unwrap();
        let other = other.into_temp_path().keep().unwrap();
        for f in ["a.service.json", ".a.service.json.specd-tmp", ".a.service.json.ab.specd-tmp"] {
            fs::write(d.path().join(f), "").unwrap();
            assert_ne!(temp_of(f), Some("a.service.json"), "{f}");
        }
        clean_temps(d.path(), "a.service.json");
        assert!(!left.exists());
        assert!(other.exists());
        assert_eq!(fs::read_dir(d.path()).unwrap().count(), 4);
    }
}
