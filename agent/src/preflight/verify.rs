//! `systemd-analyze verify` of the unit text, and what its words mean for a start.

use super::look::{Found, Machine};
use super::*;
use sight::Sight;
use std::io::ErrorKind;
use std::path::Path;

/// `systemd-analyze verify` of the unit text, written under the unit's own name in a private
/// directory (the directory of a file given to `verify` comes first in its unit path).
pub(super) async fn verify(unit: &str, text: &str, m: &Machine) -> Vec<Found> {
    let not = |why: String| vec![Found::Note(format!("not checked: {why}"))];
    let Some((prog, pre)) = m.analyze.split_first() else { return Vec::new() };
    let dir = match tempfile::Builder::new().prefix("specd-preflight.").tempdir() {
        Ok(d) => d,
        Err(e) => return not(format!("{prog} verify: no temporary directory: {e}")),
    };
    let file = dir.path().join(unit);
    if let Err(e) = std::fs::write(&file, text) {
        return not(format!("{prog} verify: writing {}: {e}", file.display()));
    }
    let mut cmd = tokio::process::Command::new(prog);
    // `--recursive-errors=no`: the exit status is this unit's alone, not the host's other units'.
    cmd.args(pre)
        .args(["verify", "--recursive-errors=no", "--man=no"])
        .arg(&file)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    let child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) if e.kind() == ErrorKind::NotFound => return not(format!("{prog} is not installed")),
        Err(e) => return not(format!("running {prog}: {e}")),
    };
    // On the timeout the child is dropped, which kills it.
    let out = match tokio::time::timeout(m.verify_within, child.wait_with_output()).await {
        Ok(Ok(o)) => o,
        Ok(Err(e)) => return not(format!("{prog} verify: {e}")),
        Err(_) => return not(format!("{prog} verify did not finish within {} s", m.verify_within.as_secs_f64())),
    };
    let output = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    judge(unit, &file.to_string_lossy(), out.status.success(), &output, m.sight == Sight::Own)
}

/// `systemd-analyze verify`'s verdict on one unit, from its exit status and its lines about the
/// unit (starting with the file's path or the unit's name; the private directory left out).
/// With `--recursive-errors=no`, systemd 252 fails a unit for an unknown key, a value it cannot
/// parse or a program that is not executable, not for a warning ("Special user nobody
/// configured, this is not safe!"): a warning is a note. It runs in specd's view of the file
/// system: where that is not the host's (`host_view` false), what it says of the programs is
/// a note (the program's own check looks at it as the unit will).
pub(super) fn judge(unit: &str, file: &str, success: bool, output: &str, host_view: bool) -> Vec<Found> {
    let dir = Path::new(file).parent().map(|d| format!("{}/", d.display())).unwrap_or_default();
    let ours: Vec<&str> = output
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with(&format!("{file}:")) || l.starts_with(&format!("{unit}:")))
        .map(|l| l.strip_prefix(dir.as_str()).unwrap_or(l))
        .collect();
    let program = |l: &&str| l.starts_with(&format!("{unit}: Command ")) && l.contains(" is not executable");
    let (elsewhere, ours): (Vec<&str>, Vec<&str>) = ours.into_iter().partition(|l| !host_view && program(l));
    let mut out: Vec<Found> = elsewhere
        .iter()
        .map(|l| {
            Found::Note(format!(
                "not checked: systemd-analyze verify, run in specd's own view of the file system, which is not the host's: {l}"
            ))
        })
        .collect();
    let said = format!("systemd-analyze verify: {}", ours.join("; "));
    out.extend(match (success, ours.is_empty()) {
        (true, true) => None,
        (true, false) => Some(Found::Note(said)),
        (false, false) => Some(Found::Problem(said)),
        (false, true) if !elsewhere.is_empty() => None,
        // Not about this unit (an option this systemd does not know): nothing is known.
        (false, true) => {
            let first = output.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or("no output");
            Some(Found::Note(format!("not checked: systemd-analyze verify failed without naming {unit}: {first}")))
        }
    });
    out
}
