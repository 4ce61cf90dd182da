//! Crash-safe file writes: a crash at any instant leaves either the old or the new file, never a mix.

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

use anyhow::{Context, Result};

/// Write `bytes` to `path` atomically with `mode`: a temp file in the same directory, written,
/// fsynced, renamed over `path`, then the directory fsynced so the rename itself is durable.
pub fn atomic_write(path: &Path, bytes: &[u8], mode: u32) -> Result<()> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().context("a file name")?.to_string_lossy();
    let mut tmp = tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .suffix(".specd-tmp")
        .tempfile_in(dir)
        .with_context(|| format!("creating a temporary file in {}", dir.display()))?;
    tmp.as_file().set_permissions(fs::Permissions::from_mode(mode))?;
    tmp.write_all(bytes).with_context(|| format!("writing {}", tmp.path().display()))?;
    tmp.as_file().sync_all().with_context(|| format!("fsync {}", tmp.path().display()))?;
    tmp.persist(path).map_err(|e| e.error).with_context(|| format!("renaming into {}", path.display()))?;
    fsync_dir(dir)
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

/// Leftover temp files of an interrupted [`atomic_write`] in `dir` (for `name`), removed.
pub fn clean_temps(dir: &Path, name: &str) {
    if let Ok(rd) = fs::read_dir(dir) {
        for e in rd.flatten() {
            let f = e.file_name().to_string_lossy().to_string();
            if f.starts_with(&format!(".{name}.")) && f.ends_with(".specd-tmp") {
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
}
