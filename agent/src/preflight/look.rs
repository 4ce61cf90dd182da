//! The executor: each check looked at on this machine, as the unit's user and through the
//! unit's sandbox, with what it found.

use super::files::{
    cwd_path, look_credential, look_environment_file, look_gpus, look_group, look_model, look_user,
    look_working_directory,
};
use super::port::look_port;
use super::program::look_program;
use super::verify::verify;
use super::*;
use nix::unistd::{Gid, Group, Uid, User};
use sight::Sight;
use std::fs::Metadata;
use std::io::{ErrorKind, Read};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Where the executor looks besides the checks' own paths and `/proc`: how it sees the host's
/// files, the device directory (NVIDIA's nodes), the `systemd-analyze` command and how long it
/// may take, the state directory (where weights' digests are remembered).
pub(super) struct Machine {
    pub(super) sight: Sight,
    pub(super) dev: PathBuf,
    pub(super) analyze: Vec<String>,
    pub(super) verify_within: Duration,
    pub(super) state_dir: Option<PathBuf>,
}

impl Machine {
    /// This host, its files seen as `sight` says.
    pub(super) fn seeing(sight: Sight) -> Machine {
        Machine {
            sight,
            dev: PathBuf::from("/dev"),
            analyze: vec!["systemd-analyze".to_string()],
            verify_within: VERIFY_WITHIN,
            state_dir: None,
        }
    }
}

/// What one look found, before it is labelled with its check's kind.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Found {
    Problem(String),
    Note(String),
}

pub(super) async fn run_on(checks: &[Check], own_cgroup: &str, m: &Machine) -> Outcome {
    // Files and /proc can block (a model on a stalled network mount): off the runtime's thread,
    // while systemd-analyze runs.
    let looks = {
        let (checks, own, dev, s) = (checks.to_vec(), own_cgroup.to_string(), m.dev.clone(), m.sight.clone());
        let state = m.state_dir.clone();
        tokio::task::spawn_blocking(move || {
            checks.iter().map(|c| look(&s, c, &own, &dev, state.as_deref())).collect::<Vec<_>>()
        })
    };
    // Weights read whole take the time their size does.
    let reads = checks.iter().any(|c| matches!(c, Check::Model { verify: Verify::Sha256, .. }));
    let within = if reads { weights::DIGESTS_WITHIN } else { LOOK_WITHIN };
    let mut verified = Vec::new();
    for c in checks {
        if let Check::UnitFile { unit, text } = c {
            verified.push(verify(unit, text, m).await);
        }
    }
    let looked = match tokio::time::timeout(within, looks).await {
        Ok(Ok(l)) => l,
        Ok(Err(e)) => checks.iter().map(|_| vec![Found::Note(format!("not checked: the look failed: {e}"))]).collect(),
        Err(_) => {
            let why = format!("not checked: the file system did not answer within {} s", within.as_secs());
            checks.iter().map(|_| vec![Found::Note(why.clone())]).collect()
        }
    };
    let mut verified = verified.into_iter();
    let mut out = Outcome::default();
    for (c, found) in checks.iter().zip(looked) {
        let found = if matches!(c, Check::UnitFile { .. }) { verified.next().unwrap_or_default() } else { found };
        for f in found {
            match f {
                Found::Problem(message) => out.problems.push(Problem { check: c.kind(), message }),
                Found::Note(message) => out.notes.push(Note { check: c.kind(), message }),
            }
        }
    }
    out
}

/// One check, on the file system (as `s` sees the host's) and `/proc` (blocking).
pub(super) fn look(s: &Sight, c: &Check, own_cgroup: &str, dev: &Path, state_dir: Option<&Path>) -> Vec<Found> {
    match c {
        Check::Program { program, runs_as, sandbox } => look_program(s, program, runs_as, sandbox),
        Check::Model { role, value, form, cwd, runs_as, sandbox, verify } => {
            let found = look_model(s, *role, value, *form, cwd, runs_as, sandbox);
            // A model that is there and may be read: its weights, whole.
            let path = if value.starts_with('/') {
                Some(PathBuf::from(value))
            } else {
                cwd_path(cwd, runs_as).map(|d| d.join(value))
            };
            match path {
                Some(p) if found.is_empty() => weights::look(s, role.what(), &p, *verify, state_dir),
                _ => found,
            }
        }
        Check::EnvironmentFile { path, optional } => look_environment_file(s, path, *optional),
        Check::Credential { id, path } => look_credential(s, id, path),
        Check::User { name } => look_user(name),
        Check::Group { name } => look_group(name),
        Check::WorkingDirectory { dir, optional, runs_as, sandbox } => {
            look_working_directory(s, dir, *optional, runs_as, sandbox)
        }
        Check::Port { unit, host, port } => look_port(unit, host, *port, own_cgroup),
        Check::Gpus { indices } => look_gpus(indices, dev),
        Check::UnitFile { .. } => Vec::new(),
        Check::NotChecked { why, .. } => vec![Found::Note(format!("not checked: {why}"))],
    }
}

/// Something wrong with `path`, as found: a problem, or a note where specd cannot see `path` as
/// the host does (what it found is about its own view).
pub(super) fn problem(s: &Sight, path: &Path, message: String) -> Found {
    match s.blind_at(path) {
        Some(why) => Found::Note(format!("not checked from here: {why}; in specd's own view, {message}")),
        None => Found::Problem(message),
    }
}

/// Whether the unit's sandbox keeps its server from `path` as the host has it (as written, or
/// where its links lead): a problem where it hides the directory, a note where it shows other
/// files there. `said` names the path in the message.
pub(super) fn sandboxed(s: &Sight, sandbox: &Sandbox, said: &str, path: &Path) -> Option<Found> {
    if sandbox.is_empty() {
        return None;
    }
    let real = s.canonical(path).ok().filter(|r| r != path);
    let paths: Vec<&Path> = std::iter::once(path).chain(real.as_deref()).collect();
    fn at<'a>(paths: &[&'a Path], list: &'a [Shadow]) -> Option<(&'a Path, &'a Shadow)> {
        paths.iter().find_map(|p| list.iter().find(|x| p.starts_with(&x.dir)).map(|x| (*p, x)))
    }
    let leads = |p: &Path| if p == path { String::new() } else { format!(" (it leads to {})", p.display()) };
    if let Some((p, x)) = at(&paths, &sandbox.hidden) {
        return Some(Found::Problem(format!(
            "{said}{} is under {}, which the unit's {} hides from its server: the server would not find it there",
            leads(p),
            x.dir,
            x.setting
        )));
    }
    let (p, x) = at(&paths, &sandbox.elsewhere)?;
    Some(Found::Note(format!(
        "not checked: {said}{} is under {}, where the unit's {} shows its server other files than the host's",
        leads(p),
        x.dir,
        x.setting
    )))
}

/// The process's identity as the kernel's permission checks see it.
#[derive(Debug)]
pub(super) enum Who {
    /// Reads and enters everything; executes what has an execute bit.
    Root,
    Ids {
        name: String,
        uid: u32,
        gids: Vec<u32>,
    },
    /// A dynamic user owns nothing and is in no file's group: the "other" bits.
    Dynamic,
}

impl std::fmt::Display for Who {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Who::Root => f.write_str("root"),
            Who::Ids { name, .. } => write!(f, "user {name}"),
            Who::Dynamic => f.write_str("the unit's dynamic user"),
        }
    }
}

/// `None` when the user or group does not exist (their own checks say so) or cannot be looked
/// up: then nothing is said about permissions.
pub(super) fn who(runs_as: &RunAs) -> Option<Who> {
    let (user, group) = match runs_as {
        RunAs::Root => return Some(Who::Root),
        RunAs::Dynamic => return Some(Who::Dynamic),
        RunAs::User { user, group } => (user, group),
    };
    let u = lookup_user(user).ok()??;
    if u.uid.is_root() {
        return Some(Who::Root);
    }
    let gid = match group {
        Some(g) => lookup_group(g).ok()??.gid,
        None => u.gid,
    };
    // systemd gives a `User=` its supplementary groups (initgroups) besides the primary one.
    let name = std::ffi::CString::new(u.name.as_bytes()).ok()?;
    let mut gids: Vec<u32> =
        nix::unistd::getgrouplist(&name, gid).map(|g| g.into_iter().map(Gid::as_raw).collect()).unwrap_or_default();
    gids.push(gid.as_raw());
    Some(Who::Ids { name: user.clone(), uid: u.uid.as_raw(), gids })
}

/// A user by name, or by number as systemd reads an all-digits `User=` (which needs an entry).
pub(super) fn lookup_user(name: &str) -> nix::Result<Option<User>> {
    match name.parse::<u32>() {
        Ok(uid) => User::from_uid(Uid::from_raw(uid)),
        Err(_) => User::from_name(name),
    }
}

pub(super) fn lookup_group(name: &str) -> nix::Result<Option<Group>> {
    match name.parse::<u32>() {
        Ok(gid) => Group::from_gid(Gid::from_raw(gid)),
        Err(_) => Group::from_name(name),
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Want {
    Read,
    Execute,
    /// Search a directory (its execute bit): to reach anything below it, or to `chdir` into it.
    Enter,
}

/// The kernel's mode-bit check (ACLs aside: see [`denied`]).
pub(super) fn allowed(who: &Who, meta: &Metadata, want: Want) -> bool {
    let mode = meta.mode();
    let bit = if want == Want::Read { 4 } else { 1 };
    match who {
        Who::Root => want != Want::Execute || meta.is_dir() || mode & 0o111 != 0,
        Who::Ids { uid, gids, .. } => {
            // The owner's bits alone apply to the owner, the group's to its members.
            let class = if meta.uid() == *uid {
                mode >> 6
            } else if gids.contains(&meta.gid()) {
                mode >> 3
            } else {
                mode
            };
            class & bit != 0
        }
        Who::Dynamic => mode & bit != 0,
    }
}

/// Whether `who` may reach `path` (enter each directory above it) and then `want` it; a refusal
/// names the place and its mode and owner.
pub(super) fn access(s: &Sight, who: &Who, path: &Path, want: Want, what: &str) -> Option<Found> {
    for dir in ancestors(s, path) {
        let Ok(meta) = s.metadata(&dir) else { continue };
        if !allowed(who, &meta, Want::Enter) {
            let m = mode_owner(&meta);
            return Some(denied(
                s,
                &dir,
                format!("{who} cannot enter {} ({m}), which holds {what} {}", dir.display(), path.display()),
            ));
        }
    }
    let meta = s.metadata(path).ok()?;
    if allowed(who, &meta, want) {
        return None;
    }
    let verb = match want {
        Want::Read => "read",
        Want::Execute => "execute",
        Want::Enter => "enter",
    };
    Some(denied(s, path, format!("{who} cannot {verb} {what} {} ({})", path.display(), mode_owner(&meta))))
}

/// A refusal by the mode bits is a problem, unless an ACL may grant what they do not: then the
/// pre-flight cannot tell, and says so.
pub(super) fn denied(s: &Sight, path: &Path, message: String) -> Found {
    if has_acl(s, path) {
        Found::Note(format!("not checked: {message}, but it has an ACL, which may allow it"))
    } else {
        problem(s, path, message)
    }
}

pub(super) fn has_acl(s: &Sight, path: &Path) -> bool {
    let Ok(real) = s.real(path) else { return false };
    let Ok(p) = std::ffi::CString::new(real.as_os_str().as_bytes()) else { return false };
    // SAFETY: two NUL-terminated strings; a null buffer of size 0 asks only for the value's size.
    unsafe { libc::getxattr(p.as_ptr(), c"system.posix_acl_access".as_ptr(), std::ptr::null_mut(), 0) >= 0 }
}

/// The directories a lookup of `path` passes through, outermost first: those above it as
/// written, then those above where its links lead.
pub(super) fn ancestors(s: &Sight, path: &Path) -> Vec<PathBuf> {
    let real = s.canonical(path).ok();
    let mut out: Vec<PathBuf> = Vec::new();
    for p in std::iter::once(path).chain(real.as_deref()) {
        let mut above: Vec<&Path> = p.ancestors().skip(1).filter(|a| !a.as_os_str().is_empty()).collect();
        above.reverse();
        for a in above {
            if !out.iter().any(|o| o == a) {
                out.push(a.to_path_buf());
            }
        }
    }
    out
}

/// `mode 0700, owner root:root`.
pub(super) fn mode_owner(meta: &Metadata) -> String {
    let user = User::from_uid(Uid::from_raw(meta.uid())).ok().flatten().map_or(meta.uid().to_string(), |u| u.name);
    let group = Group::from_gid(Gid::from_raw(meta.gid())).ok().flatten().map_or(meta.gid().to_string(), |g| g.name);
    format!("mode {:04o}, owner {user}:{group}", meta.mode() & 0o7777)
}

/// Why `path` could not be looked at: absent (or a link to nothing) is a problem; anything else
/// (specd itself not allowed to look) a note.
pub(super) fn missing(s: &Sight, what: &str, path: &Path, e: &std::io::Error) -> Found {
    let p = path.display();
    match e.kind() {
        ErrorKind::NotFound => match s.read_link(path) {
            Ok(to) => {
                problem(s, path, format!("{what} {p} is a symbolic link to {}, which does not exist", to.display()))
            }
            Err(_) => problem(s, path, format!("{what} {p} does not exist")),
        },
        ErrorKind::NotADirectory => {
            problem(s, path, format!("{what} {p} does not exist: a part of its path is not a directory"))
        }
        _ => Found::Note(format!("not checked: {what} {p}: {e}")),
    }
}

pub(super) fn first_bytes(s: &Sight, path: &Path, n: usize) -> Vec<u8> {
    let mut buf = Vec::with_capacity(n);
    let _ = s.real(path).and_then(std::fs::File::open).and_then(|f| f.take(n as u64).read_to_end(&mut buf));
    buf
}
