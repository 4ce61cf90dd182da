//! How specd sees the host's file system: the one systemd reads a unit's environment files and
//! credentials in, and starts the unit in (PID 1's mount namespace).
//!
//! specd may see another: the agent's own sandbox (`PrivateTmp=yes` in its unit) gives it a
//! `/tmp` and `/var/tmp` of its own, where a model the server would load from the host's `/tmp`
//! is not. A pre-flight that looked there would refuse a unit that starts. So specd looks at
//! the host's files through PID 1's root directory (`/proc/1/root`, which the agent may read
//! with `CAP_SYS_PTRACE`), resolving each path itself so that an absolute link leads within that
//! root and not back into specd's own view; where it cannot, what it does not find there is
//! said as not checked, never as missing.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::fs::Metadata;
use std::io::{Error, ErrorKind};
use std::path::{Component, Path, PathBuf};

/// How many links a path may go through before the kernel gives up (`MAXSYMLINKS`, ELOOP).
const MAX_LINKS: usize = 40;

/// How specd sees the host's file system.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Sight {
    /// specd's view is the host's (or specd cannot tell otherwise): paths are looked at as they
    /// are.
    Own,
    /// specd's view differs: the host's is looked at under this directory (`/proc/1/root`).
    Through(PathBuf),
    /// specd's view differs and it cannot look at the host's: under `dirs` (the whole file
    /// system when empty), what it finds is not what the unit finds. `why` says why not.
    Blind { dirs: Vec<PathBuf>, why: String },
}

impl Sight {
    /// This process's sight: its mount namespace against PID 1's, PID 1's root directory, and
    /// both mount tables.
    pub(super) fn of_this_process() -> Sight {
        let ns = |pid: &str| std::fs::read_link(format!("/proc/{pid}/ns/mnt")).ok();
        let mounts = |pid: &str| std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).ok();
        let root = Path::new("/proc/1/root");
        let open = std::fs::read_dir(root).map(drop).map_err(|e| format!("{}: {e}", root.display()));
        sight(Namespaces { ours: ns("self"), pid1: ns("1") }, root, open, mounts("self"), mounts("1"))
    }

    /// Where specd opens the host's `path` (its links followed as the host's view has them).
    pub(super) fn real(&self, path: &Path) -> std::io::Result<PathBuf> {
        match self {
            Sight::Through(root) => Ok(under(root, &resolve(root, path, true)?)),
            Sight::Own | Sight::Blind { .. } => Ok(path.to_path_buf()),
        }
    }

    pub(super) fn metadata(&self, path: &Path) -> std::io::Result<Metadata> {
        std::fs::metadata(self.real(path)?)
    }

    /// `path` with every link resolved, as the host names it.
    pub(super) fn canonical(&self, path: &Path) -> std::io::Result<PathBuf> {
        match self {
            Sight::Through(root) => resolve(root, path, true),
            Sight::Own | Sight::Blind { .. } => std::fs::canonicalize(path),
        }
    }

    /// Where the link `path` leads (its own target, not followed further).
    pub(super) fn read_link(&self, path: &Path) -> std::io::Result<PathBuf> {
        match self {
            Sight::Through(root) => std::fs::read_link(under(root, &resolve(root, path, false)?)),
            Sight::Own | Sight::Blind { .. } => std::fs::read_link(path),
        }
    }

    /// The directory under which specd cannot see `path` (or where its link leads) as the host
    /// does, and why: what it finds wrong there is not known to be wrong.
    pub(super) fn blind_at(&self, path: &Path) -> Option<String> {
        let Sight::Blind { dirs, why } = self else { return None };
        let leads = std::fs::read_link(path).ok().map(|to| path.parent().unwrap_or(Path::new("/")).join(to));
        let whole = dirs.is_empty().then(|| "the file system".to_string());
        let dir = whole.or_else(|| {
            dirs.iter()
                .find(|d| path.starts_with(d) || leads.as_deref().is_some_and(|l| l.starts_with(d)))
                .map(|d| d.display().to_string())
        })?;
        Some(format!(
            "specd's own view of {dir} differs from the unit's (specd runs in a mount namespace of its own: its unit's PrivateTmp=, ProtectHome= or the like), and it cannot look at the host's ({why})"
        ))
    }
}

/// `path` (absolute, as the host names it) under `root`.
fn under(root: &Path, path: &Path) -> PathBuf {
    root.join(path.strip_prefix("/").unwrap_or(path))
}

/// `path` resolved within `root` as the kernel would resolve it with `root` as `/`: each link
/// read and followed (an absolute one from `root`), `..` never above `root`; the last
/// component's link followed only with `follow`. The host's name for it, without `root`.
pub(super) fn resolve(root: &Path, path: &Path, follow: bool) -> std::io::Result<PathBuf> {
    let mut done = PathBuf::from("/");
    let mut todo: Vec<OsString> = parts(path);
    todo.reverse();
    let mut links = 0;
    while let Some(part) = todo.pop() {
        match part.to_str() {
            Some("/") => done = PathBuf::from("/"),
            Some("..") => {
                done.pop();
            }
            _ => {
                let next = done.join(&part);
                let meta = std::fs::symlink_metadata(under(root, &next))?;
                if meta.file_type().is_symlink() && (follow || !todo.is_empty()) {
                    links += 1;
                    if links > MAX_LINKS {
                        return Err(Error::from_raw_os_error(libc::ELOOP));
                    }
                    let to = std::fs::read_link(under(root, &next))?;
                    todo.extend(parts(&to).into_iter().rev());
                } else if !todo.is_empty() && !meta.is_dir() {
                    return Err(Error::from(ErrorKind::NotADirectory));
                } else {
                    done = next;
                }
            }
        }
    }
    Ok(done)
}

/// A path's parts as the walk takes them: `/` (start again from the root), `..`, names; `.`
/// dropped.
fn parts(path: &Path) -> Vec<OsString> {
    path.components()
        .filter_map(|c| match c {
            Component::RootDir | Component::Prefix(_) => Some(OsString::from("/")),
            Component::ParentDir => Some(OsString::from("..")),
            Component::CurDir => None,
            Component::Normal(n) => Some(n.to_os_string()),
        })
        .collect()
}

/// Mount namespaces as `/proc/PID/ns/mnt` names them (`mnt:[4026531841]`); `None` where the
/// link could not be read.
pub(super) struct Namespaces {
    pub ours: Option<PathBuf>,
    pub pid1: Option<PathBuf>,
}

/// The sight, from what this process can read: the same namespace as PID 1's is its own view;
/// another, with PID 1's `root` readable (`open`), that root; else blind where the two mount
/// tables differ (everywhere when PID 1's cannot be read; nowhere, as before, when specd cannot
/// tell at all).
pub(super) fn sight(
    ns: Namespaces,
    root: &Path,
    open: Result<(), String>,
    ours: Option<String>,
    pid1: Option<String>,
) -> Sight {
    if ns.ours.is_some() && ns.ours == ns.pid1 {
        return Sight::Own;
    }
    let why = match open {
        Ok(()) => return Sight::Through(root.to_path_buf()),
        Err(why) => why,
    };
    match (ours, pid1) {
        (Some(a), Some(b)) => match differing_mounts(&a, &b) {
            dirs if dirs.is_empty() => Sight::Own,
            dirs => Sight::Blind { dirs, why },
        },
        _ if ns.ours.is_some() && ns.pid1.is_some() => Sight::Blind { dirs: Vec::new(), why },
        _ => Sight::Own,
    }
}

/// The mount points where two mount tables (`/proc/PID/mountinfo`) show different things: for
/// each mount point its top mount's device and root within it, compared; one present in a single
/// table differs too. A read-only bind of the same directory (`ProtectSystem=`) is the same view.
pub(super) fn differing_mounts(ours: &str, theirs: &str) -> Vec<PathBuf> {
    let (a, b) = (mount_table(ours), mount_table(theirs));
    let points: BTreeSet<&PathBuf> = a.keys().chain(b.keys()).collect();
    points.into_iter().filter(|p| a.get(*p) != b.get(*p)).cloned().collect()
}

/// Each mount point's top mount: (device, root within it). Fields: `id parent major:minor root
/// mount-point options … - type source super-options`, with `\040`-style escapes.
fn mount_table(text: &str) -> BTreeMap<PathBuf, (String, String)> {
    let mut out = BTreeMap::new();
    for l in text.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        if let (Some(dev), Some(root), Some(point)) = (f.get(2), f.get(3), f.get(4)) {
            out.insert(PathBuf::from(unescape(point)), (dev.to_string(), unescape(root)));
        }
    }
    out
}

/// A mountinfo field with its octal escapes (`\040` for a space) undone.
fn unescape(field: &str) -> String {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b.get(i + 1..i + 4).filter(|o| b[i] == b'\\' && o.iter().all(|c| (b'0'..=b'7').contains(c)));
        match octal {
            Some(o) => {
                out.push(o.iter().fold(0u8, |n, c| n.wrapping_mul(8).wrapping_add(c - b'0')));
                i += 4;
            }
            None => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(v: &str) -> PathBuf {
        PathBuf::from(v)
    }

    const HOST: &str = "22 27 0:21 / /proc rw,relatime - proc proc rw\n27 1 254:1 / / rw,relatime - ext4 /dev/vda1 rw\n30 27 0:26 / /tmp rw - tmpfs tmpfs rw\n31 27 254:2 / /home rw - ext4 /dev/vda2 rw\n";

    #[test]
    fn the_host_s_view_is_looked_at_where_specd_s_differs() {
        let ns = |a: Option<&str>, b: Option<&str>| Namespaces { ours: a.map(p), pid1: b.map(p) };
        let root = p("/proc/1/root");
        let denied = || Err(s("/proc/1/root: Permission denied (os error 13)"));
        let (same, other) = (Some("mnt:[1]"), Some("mnt:[2]"));
        // The agent's sandbox: /tmp and /var/tmp of its own, /home read-only (the same files).
        let agent = format!(
            "{HOST}40 27 0:26 /systemd-private-x-specd.service-y/tmp /tmp rw - tmpfs tmpfs rw\n41 27 254:1 /var/tmp/systemd-private-x-specd.service-y/tmp /var/tmp rw - ext4 /dev/vda1 rw\n42 27 254:2 / /home ro - ext4 /dev/vda2 rw\n"
        );
        let mounts = |a: &str| (Some(a.to_string()), Some(HOST.to_string()));
        assert_eq!(sight(ns(same, same), &root, denied(), None, None), Sight::Own);
        assert_eq!(sight(ns(same, other), &root, Ok(()), None, None), Sight::Through(root.clone()));
        let (a, b) = mounts(&agent);
        assert_eq!(
            sight(ns(same, other), &root, denied(), a, b),
            Sight::Blind {
                dirs: vec![p("/tmp"), p("/var/tmp")],
                why: s("/proc/1/root: Permission denied (os error 13)")
            }
        );
        // Not root: PID 1's namespace is not shown, its mount table is.
        let (a, b) = mounts(HOST);
        assert_eq!(sight(ns(same, None), &root, denied(), a, b), Sight::Own);
        let (a, _) = mounts(&agent);
        assert_eq!(
            sight(ns(same, other), &root, denied(), a, None),
            Sight::Blind { dirs: vec![], why: denied().unwrap_err() }
        );
        assert_eq!(sight(ns(same, None), &root, denied(), None, None), Sight::Own, "nothing to tell by: as before");
    }

    fn s(v: &str) -> String {
        v.to_string()
    }

    #[test]
    fn mount_tables_are_compared_mount_point_by_mount_point() {
        assert_eq!(differing_mounts(HOST, HOST), Vec::<PathBuf>::new());
        let space = format!("{HOST}50 27 0:30 / /srv/my\\040models rw - tmpfs tmpfs rw\n");
        assert_eq!(differing_mounts(&space, HOST), [p("/srv/my models")]);
        // Mounted over: the top mount counts.
        let over = format!("{HOST}51 30 0:31 / /tmp rw - tmpfs tmpfs rw\n");
        assert_eq!(differing_mounts(HOST, &over), [p("/tmp")]);
        assert_eq!(unescape("a\\134b\\011c"), "a\\b\tc");
    }

    #[test]
    fn a_path_is_resolved_within_the_root_it_is_looked_at_under() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path();
        let mk = |v: &str| std::fs::create_dir_all(under(root, Path::new(v))).unwrap();
        let link = |to: &str, at: &str| std::os::unix::fs::symlink(to, under(root, Path::new(at))).unwrap();
        mk("/srv/models");
        mk("/opt");
        std::fs::write(under(root, Path::new("/srv/models/m.gguf")), "GGUF").unwrap();
        // Absolute links lead within the root, `..` stops at it.
        link("/srv/models", "/models");
        link("../../../srv", "/opt/up");
        link("m.gguf", "/srv/models/current");
        link("/nowhere", "/srv/models/gone");
        link("/opt/loop", "/opt/loop");
        let got = |v: &str, follow| resolve(root, Path::new(v), follow);
        assert_eq!(got("/models/current", true).unwrap(), p("/srv/models/m.gguf"));
        assert_eq!(got("/models/current", false).unwrap(), p("/srv/models/current"));
        assert_eq!(got("/opt/up/models/./m.gguf", true).unwrap(), p("/srv/models/m.gguf"));
        assert_eq!(got("/models/gone", false).unwrap(), p("/srv/models/gone"));
        assert_eq!(got("/models/gone", true).unwrap_err().kind(), ErrorKind::NotFound);
        assert_eq!(got("/models/m.gguf/x", true).unwrap_err().kind(), ErrorKind::NotADirectory);
        assert_eq!(got("/opt/loop", true).unwrap_err().raw_os_error(), Some(libc::ELOOP));
        let through = Sight::Through(root.to_path_buf());
        assert_eq!(through.real(Path::new("/models/current")).unwrap(), under(root, Path::new("/srv/models/m.gguf")));
        assert_eq!(through.read_link(Path::new("/models/gone")).unwrap(), p("/nowhere"));
        assert!(through.metadata(Path::new("/models/current")).unwrap().is_file());
    }
}
