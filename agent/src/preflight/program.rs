//! The program a unit runs, found as systemd finds it and run as the kernel runs it (a script's
//! `#!` interpreter, read as fs/binfmt_script.c reads it).

use super::look::{Found, Want, Who, access, first_bytes, missing, mode_owner, problem, sandboxed, who};
use super::*;
use sight::Sight;
use std::io::ErrorKind;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

pub(super) fn look_program(s: &Sight, program: &Program, runs_as: &RunAs, sandbox: &Sandbox) -> Vec<Found> {
    let path = match program {
        Program::Path(p) if !p.starts_with('/') => {
            return vec![Found::Problem(format!(
                "the program {p} is neither an absolute path nor a bare name: systemd refuses it"
            ))];
        }
        Program::Path(p) => PathBuf::from(p),
        Program::Search { name, dirs } => match search(s, name, dirs) {
            Some(p) => p,
            None => {
                let at = dirs.first().map(PathBuf::from).unwrap_or_default();
                return vec![problem(
                    s,
                    &at,
                    format!(
                        "the program {name} is not in systemd's search path ({}): give its absolute path",
                        dirs.join(":")
                    ),
                )];
            }
        },
    };
    let what = "the program";
    let p = path.display();
    if let Some(f) = sandboxed(s, sandbox, &format!("{what} {p}"), &path) {
        return vec![f];
    }
    let meta = match s.metadata(&path) {
        Ok(m) => m,
        Err(e) => return vec![missing(s, what, &path, &e)],
    };
    if meta.is_dir() {
        return vec![problem(s, &path, format!("{what} {p} is a directory"))];
    }
    if !meta.is_file() {
        return vec![problem(s, &path, format!("{what} {p} is not a regular file"))];
    }
    // systemd itself (root) needs an execute bit to take it.
    if meta.mode() & 0o111 == 0 {
        return vec![problem(s, &path, format!("{what} {p} is not executable ({})", mode_owner(&meta)))];
    }
    let who = who(runs_as);
    if let Some(f) = who.as_ref().and_then(|w| access(s, w, &path, Want::Execute, what)) {
        return vec![f];
    }
    interpreter(s, &path, who.as_ref(), sandbox)
}

/// The file systemd runs for a bare name: the first in `dirs` that is a regular file with an
/// execute bit (systemd looks as root, before it becomes the unit's user).
pub(super) fn search(s: &Sight, name: &str, dirs: &[String]) -> Option<PathBuf> {
    dirs.iter()
        .map(|d| Path::new(d).join(name))
        .find(|p| s.metadata(p).is_ok_and(|m| m.is_file() && m.mode() & 0o111 != 0))
}

/// How many bytes of a file the kernel reads to tell its format (`BINPRM_BUF_SIZE`, Linux 5.1
/// and later): a `#!` line must end within them.
pub(super) const SHEBANG_BYTES: usize = 256;

/// How many interpreters the kernel follows (Linux fs/exec.c, `exec_binprm`: a program and five
/// rewrites, `depth > 5` is ELOOP): the program and up to four scripts as interpreters; the
/// fifth interpreter must be a binary.
pub(super) const INTERPRETERS: usize = 5;

/// What the kernel makes of a file's first bytes (Linux fs/binfmt_script.c).
#[derive(Debug, PartialEq)]
pub(super) enum Shebang {
    /// No `#!`: another format (ELF), not checked further.
    NotAScript,
    /// `#!`, but no interpreter the kernel takes (ENOEXEC): why.
    Unusable(&'static str),
    /// The interpreter's path, byte for byte as the kernel opens it.
    Interpreter(Vec<u8>),
}

/// The interpreter of a file that starts with `head`, read as the kernel reads it: the first
/// line within the first [`SHEBANG_BYTES`] bytes; only spaces and tabs separate (a carriage
/// return is part of the name); trailing spaces and tabs trimmed; the name ends at the first
/// space, tab or NUL. A line longer than the buffer is taken only when the name ends within it.
pub(super) fn shebang(head: &[u8]) -> Shebang {
    let mut buf = [0u8; SHEBANG_BYTES];
    let n = head.len().min(SHEBANG_BYTES);
    buf[..n].copy_from_slice(&head[..n]);
    if !buf.starts_with(b"#!") {
        return Shebang::NotAScript;
    }
    let blank = |c: u8| c == b' ' || c == b'\t';
    let last = SHEBANG_BYTES - 1;
    let mut end = match buf.iter().position(|&b| b == b'\n') {
        Some(i) => i,
        None => {
            let Some(first) = (2..=last).find(|&i| !blank(buf[i])) else {
                return Shebang::Unusable("its first line holds no interpreter");
            };
            if !(first..=last).any(|i| blank(buf[i]) || buf[i] == 0) {
                return Shebang::Unusable(
                    "its first line is longer than the kernel reads, which would cut the interpreter's name",
                );
            }
            last
        }
    };
    while blank(buf[end - 1]) {
        end -= 1;
    }
    let Some(name) = (2..end).find(|&i| !blank(buf[i])) else {
        return Shebang::Unusable("its first line holds no interpreter");
    };
    let name_end = (name..end).find(|&i| blank(buf[i]) || buf[i] == 0).unwrap_or(end);
    // A NUL first (a file of just `#!`): the kernel opens "" and fails.
    if name_end == name {
        return Shebang::Unusable("its first line holds no interpreter");
    }
    Shebang::Interpreter(buf[name..name_end].to_vec())
}

/// An interpreter's name for a message: as written when it is plain text, else quoted with its
/// control characters escaped.
pub(super) fn interpreter_name(name: &[u8]) -> String {
    let text = String::from_utf8_lossy(name);
    if text.chars().any(|c| c.is_control() || c == char::REPLACEMENT_CHARACTER) {
        format!("{text:?}")
    } else {
        text.into_owned()
    }
}

/// A script runs through its `#!` interpreter, which may be a script too, as far as the kernel
/// follows ([`INTERPRETERS`]): each must exist and be executable, and each script readable (its
/// interpreter reads it), by the process's user. An entry point of a moved virtualenv (`vllm`)
/// fails here with the engine's "No such file or directory" at its start; a script saved with
/// Windows line endings with `203/EXEC`.
pub(super) fn interpreter(s: &Sight, program: &Path, who: Option<&Who>, sandbox: &Sandbox) -> Vec<Found> {
    let mut out = Vec::new();
    let mut said = format!("the program {}", program.display());
    let mut file = program.to_path_buf();
    for depth in 0..=INTERPRETERS {
        let name = match shebang(&first_bytes(s, &file, SHEBANG_BYTES)) {
            Shebang::NotAScript => break,
            Shebang::Unusable(why) => {
                out.push(problem(s, &file, format!("{said} cannot be run: it starts with #!, but {why}")));
                break;
            }
            Shebang::Interpreter(name) => name,
        };
        if depth == INTERPRETERS {
            let m = format!("{said} is a script too: the kernel follows at most {INTERPRETERS} interpreters (ELOOP)");
            out.push(problem(s, &file, m));
            break;
        }
        out.extend(who.and_then(|w| access(s, w, &file, Want::Read, "the script")));
        let shown = interpreter_name(&name);
        said = format!("{said} is a script whose interpreter {shown}");
        let interp = PathBuf::from(std::ffi::OsStr::from_bytes(&name));
        if !interp.is_absolute() {
            out.push(Found::Note(format!(
                "not checked: {said} is a relative path, which the kernel opens from the working directory"
            )));
            break;
        }
        if let Some(f) = sandboxed(s, sandbox, &said, &interp) {
            out.push(f);
            break;
        }
        let cr = if name.ends_with(b"\r") {
            ": its first line ends in a carriage return (Windows line endings), which the kernel reads as part of the interpreter's name"
        } else {
            ""
        };
        match s.metadata(&interp) {
            Err(e) if e.kind() == ErrorKind::NotFound => {
                out.push(problem(s, &interp, format!("{said} does not exist{cr}")));
                break;
            }
            Err(e) => {
                out.push(Found::Note(format!("not checked: {said}: {e}")));
                break;
            }
            Ok(m) if !m.is_file() || m.mode() & 0o111 == 0 => {
                out.push(problem(s, &interp, format!("{said} is not executable ({})", mode_owner(&m))));
                break;
            }
            Ok(_) => {
                if let Some(f) = who.and_then(|w| access(s, w, &interp, Want::Execute, "the interpreter")) {
                    out.push(f);
                    break;
                }
            }
        }
        file = interp;
    }
    out
}
