//! `weights.verify`: each file the engine loads compared with the digest its Hugging Face cache
//! blob is named by, the digests remembered by file identity in `weight-digests.json`.

use super::*;

/// The state file that remembers digests, in the state directory.
pub(super) const DIGESTS_FILE: &str = "weight-digests.json";

/// How many digests are remembered (the most recent).
pub(super) const DIGESTS_KEPT: usize = 4096;

/// How a blob's name is its digest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub(super) enum Algorithm {
    /// An LFS file: the sha256 of its content.
    Sha256,
    /// A file git stores itself: git's blob sha1 (`git hash-object`).
    GitSha1,
}

impl Algorithm {
    /// The digest a Hugging Face cache blob named `name` has.
    pub(super) fn of_blob(name: &str) -> Option<Algorithm> {
        let hex = name.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        match name.len() {
            64 if hex => Some(Algorithm::Sha256),
            40 if hex => Some(Algorithm::GitSha1),
            _ => None,
        }
    }

    pub(super) fn name(self) -> &'static str {
        match self {
            Algorithm::Sha256 => "sha256",
            Algorithm::GitSha1 => "git blob sha1",
        }
    }

    /// The digest of the file `f`, read whole.
    pub(super) fn digest(self, f: &mut File, path: &Path) -> std::io::Result<String> {
        match self {
            Algorithm::Sha256 => {
                use sha2::Digest;
                let mut h = sha2::Sha256::new();
                let mut buf = vec![0u8; 1 << 20];
                loop {
                    match f.read(&mut buf) {
                        Ok(0) => break,
                        Ok(n) => h.update(&buf[..n]),
                        Err(e) if e.kind() == ErrorKind::Interrupted => {}
                        Err(e) => return Err(e),
                    }
                }
                Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
            }
            Algorithm::GitSha1 => {
                git2::Oid::hash_file(git2::ObjectType::Blob, path).map(|o| o.to_string()).map_err(std::io::Error::other)
            }
        }
    }
}

/// What specd remembers of the digests it computed (`weight-digests.json` in the state
/// directory), each by the file's identity: device, inode, size and modification time. A file
/// written since (a new download, a copy, an edit) has another identity and is read again; one
/// damaged without a write (a failing disk) is not, which only a read of it would find.
#[derive(Debug, Default, Serialize, Deserialize)]
pub(super) struct Digests {
    #[serde(default)]
    pub(super) files: Vec<Known>,
    /// Those this look read, not saved yet.
    #[serde(skip)]
    read: Vec<Known>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(super) struct Known {
    pub(super) dev: u64,
    pub(super) ino: u64,
    pub(super) size: u64,
    pub(super) mtime: i64,
    pub(super) mtime_nsec: i64,
    pub(super) algorithm: Algorithm,
    pub(super) digest: String,
    /// Where it was found: for a person reading the file.
    pub(super) path: String,
}

impl Known {
    pub(super) fn is(&self, meta: &std::fs::Metadata, algorithm: Algorithm) -> bool {
        (self.dev, self.ino, self.size, self.mtime, self.mtime_nsec, self.algorithm)
            == (meta.dev(), meta.ino(), meta.size(), meta.mtime(), meta.mtime_nsec(), algorithm)
    }
}

impl Digests {
    /// What `state_dir`'s file remembers (nothing, when it cannot be read).
    pub(super) fn load(state_dir: &Path) -> Digests {
        std::fs::read(state_dir.join(DIGESTS_FILE))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default()
    }

    /// The digests this look read added to `state_dir`'s file as it is now (another look may
    /// have saved its own since this one loaded it: both are kept), under the file's lock
    /// (`locks/weight-digests.json.lock`), the temporary files of a save killed before its
    /// rename removed first; written atomically. A state directory specd cannot write (a
    /// user's `validate --on-host`) leaves it unwritten.
    pub(super) fn save(&mut self, state_dir: &Path) {
        let Ok(_lock) = crate::machine::lock::UnitLock::acquire_blocking(&state_dir.join("locks"), DIGESTS_FILE) else {
            return;
        };
        crate::machine::atomic::clean_temps(state_dir, DIGESTS_FILE);
        let mut now = Digests::load(state_dir);
        for k in self.read.drain(..) {
            now.add(k);
        }
        if let Ok(bytes) = serde_json::to_vec_pretty(&now) {
            let _ = crate::machine::atomic::atomic_write(&state_dir.join(DIGESTS_FILE), &bytes, 0o600);
        }
    }

    /// `k` remembered in place of what was known of its file, the oldest forgotten past
    /// [`DIGESTS_KEPT`].
    fn add(&mut self, k: Known) {
        self.files.retain(|o| (o.dev, o.ino) != (k.dev, k.ino) || o.algorithm != k.algorithm);
        self.files.push(k);
        let over = self.files.len().saturating_sub(DIGESTS_KEPT);
        self.files.drain(..over);
    }

    /// The digest of the host's file `path`, remembered or read.
    pub(super) fn of(&mut self, s: &Sight, path: &Path, algorithm: Algorithm) -> std::io::Result<(String, bool)> {
        let real = s.real(path)?;
        let mut f = File::open(&real)?;
        let meta = f.metadata()?;
        if let Some(k) = self.files.iter().find(|k| k.is(&meta, algorithm)) {
            return Ok((k.digest.clone(), false));
        }
        let digest = algorithm.digest(&mut f, &real)?;
        // The identity after the read: a file written meanwhile is not remembered as read.
        if f.metadata().is_ok_and(|after| after.mtime() == meta.mtime() && after.mtime_nsec() == meta.mtime_nsec()) {
            let k = Known {
                dev: meta.dev(),
                ino: meta.ino(),
                size: meta.size(),
                mtime: meta.mtime(),
                mtime_nsec: meta.mtime_nsec(),
                algorithm,
                digest: digest.clone(),
                path: path.display().to_string(),
            };
            self.add(k.clone());
            self.read.push(k);
        }
        Ok((digest, true))
    }
}

/// Every file in `loads` compared with the digest its Hugging Face cache blob is named by; the
/// digests remembered in `state_dir`. A file outside a cache has no digest to compare with: a
/// note says so.
pub(super) fn verified(
    s: &Sight,
    what: &str,
    path: &Path,
    loads: &[Loaded],
    cache: Option<&Path>,
    state_dir: Option<&Path>,
) -> Vec<Found> {
    let mut out = Vec::new();
    let mut digests = state_dir.map(Digests::load).unwrap_or_default();
    let mut changed = false;
    let mut unnamed = Vec::new();
    for l in loads {
        let blob = s.canonical(&l.path).ok();
        let named = blob.as_deref().and_then(|b| {
            let in_blobs = cache.is_some_and(|c| b.parent() == Some(&c.join("blobs")));
            let name = b.file_name()?.to_str()?;
            Some((Algorithm::of_blob(name).filter(|_| in_blobs)?, name.to_string()))
        });
        let Some((algorithm, want)) = named else {
            unnamed.push(l.path.file_name().map_or(l.said.clone(), |n| n.to_string_lossy().into_owned()));
            continue;
        };
        match digests.of(s, &l.path, algorithm) {
            Ok((got, read)) => {
                changed |= read;
                // A large file's digest is kept at once: an apply stopped meanwhile does not
                // read it again.
                if read
                    && algorithm == Algorithm::Sha256
                    && let Some(d) = state_dir
                {
                    digests.save(d);
                    changed = false;
                }
                if got != want {
                    out.push(problem(
                        s,
                        &l.path,
                        format!(
                            "{}: its {} is {got}, not {want}, which its blob in the Hugging Face cache is named by: it is not what was downloaded (damaged on the disk, or written over); remove the blob and download it again",
                            l.said,
                            algorithm.name()
                        ),
                    ));
                }
            }
            Err(e) => out.push(Found::Note(format!("not verified: {}: {e}", l.said))),
        }
    }
    if changed && let Some(d) = state_dir {
        digests.save(d);
    }
    if let Some(first) = unnamed.first() {
        let p = path.display();
        let more = if unnamed.len() > 1 { format!(" and {} more", unnamed.len() - 1) } else { String::new() };
        out.push(Found::Note(match cache {
            None => format!(
                "not verified: {what} {p} is not in a Hugging Face cache, which names files by their digests: there is nothing to compare them with"
            ),
            Some(c) => format!(
                "not verified: {first}{more} of {what} {p}: not a blob of the Hugging Face cache {}, which names files by their digests: there is nothing to compare with",
                c.display()
            ),
        }));
    }
    out
}
