//! The limits a value must keep to be a unit systemd loads and a server can start under: unit
//! and user names, credential names, `MemoryMax=`, lengths.

use crate::engine::{self};
use crate::model::Engine;
use crate::model::strict::shown;

/// Longest path systemd accepts (`PATH_MAX`, with the terminating NUL).
pub(super) const MAX_PATH: usize = 4095;

/// Longest file name (one path component, `NAME_MAX`).
pub(super) const MAX_COMPONENT: usize = 255;

/// Longest free text (an argument, an environment value, a description).
pub(super) const MAX_TEXT: usize = 4096;

/// Longest name (a served model name, an algorithm, a variable or credential name).
pub(super) const MAX_NAME: usize = 255;

/// Longest `ExecStart=` value: far below systemd's line limit (1 MiB) and the kernel's limits
/// on one argument (128 KiB).
pub(super) const MAX_COMMAND_LINE: usize = 65536;

/// Longest user or group name systemd accepts in strict mode (`UT_NAMESIZE - 1`).
pub(super) const MAX_USER: usize = 31;

/// Why `v` is not the name of a unit specd may own, or `None` when it is one: systemd's
/// `[A-Za-z0-9:_.@-]` with the `.service` suffix, at most 255 characters, never `..` nor a `/`.
/// Specs are held to it, and so is every unit named on the command line (`specd unquarantine
/// UNIT`...), before specd builds a state, lock or unit file path from it.
pub fn unit_name_problem(v: &str) -> Option<String> {
    let ok = v.strip_suffix(".service").is_some_and(|stem| {
        !stem.is_empty()
            && v.len() <= 255
            && stem.bytes().all(|b| b.is_ascii_alphanumeric() || b":_.@-".contains(&b))
            && !stem.starts_with('.')
            && !v.contains("..")
            && !stem.starts_with('@')
            && stem.matches('@').count() <= 1
            && !stem.ends_with('@')
    });
    (!ok).then(|| {
        format!(
            "{} is not a valid service name: use at most 255 of [A-Za-z0-9:_.@-] ending in `.service`, no `/` and no `..`",
            shown(v)
        )
    })
}

/// Why `v` is not a user or group systemd accepts in `User=`/`Group=` without complaint: a
/// numeric id as systemd's `parse_uid()` reads it (decimal, no sign, no leading zero, at most
/// 4294967294 and not 65535, the 16-bit "-1"), or a name as its `valid_user_group_name()` accepts
/// in strict mode (`[A-Za-z_][A-Za-z0-9_-]*`, at most 31 bytes; no dots: those conflict with
/// `chown`'s `user.group` syntax).
pub(super) fn user_problem(v: &str) -> Option<String> {
    if v.is_empty() {
        return Some("may not be empty".into());
    }
    if v.bytes().all(|b| b.is_ascii_digit()) {
        return match v.parse::<u64>() {
            _ if v.len() > 1 && v.starts_with('0') => {
                Some(format!("{}: a numeric id may not have a leading zero", shown(v)))
            }
            Ok(n) if n == 65535 || n >= 4294967295 => Some(format!(
                "{}: a numeric id must be in 0..=4294967294 and not 65535 (both are the \"invalid\" id)",
                shown(v)
            )),
            Ok(_) => None,
            Err(_) => Some(format!("{}: a numeric id must be in 0..=4294967294", shown(v))),
        };
    }
    if v.len() > MAX_USER {
        return Some(format!("is {} bytes long; a user or group name has at most {MAX_USER}", v.len()));
    }
    let first_ok = v.bytes().next().is_some_and(|b| b.is_ascii_alphabetic() || b == b'_');
    if !first_ok || !v.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') {
        return Some(format!(
            "{} is not a valid name: a letter or `_`, then letters, digits, `_` or `-` (systemd's strict rules: no dots)",
            shown(v)
        ));
    }
    None
}

/// systemd's `MemoryMax=`: `infinity`, a percentage of physical memory in (0, 100] with at most
/// two decimals, or bytes (decimals allowed) with an optional K, M, G, T, P or E (base 1024) or B
/// suffix, more than 0 and less than 2^64 - 1. Bytes must also reach the engine's floor
/// (`EngineFacts::min_memory_max`): systemd takes `MemoryMax=1`, and kills the server while it
/// loads. A percentage is of the host's memory, which the spec does not know: systemd judges it.
pub(super) fn memory_max_problem(m: &str, engine: Engine) -> Option<String> {
    if m == "infinity" {
        return None;
    }
    // `int[.frac]` as (int, frac) digit strings.
    let decimal = |t: &str| -> Option<(u128, String)> {
        let (int, frac) = match t.split_once('.') {
            Some((i, f)) if !f.is_empty() => (i, f),
            Some(_) => return None,
            None => (t, ""),
        };
        let digits = |d: &str| d.bytes().all(|b| b.is_ascii_digit());
        if int.is_empty() || int.len() > 20 || frac.len() > 18 || !digits(int) || !digits(frac) {
            return None;
        }
        Some((int.parse().ok()?, frac.to_string()))
    };
    if let Some(pct) = m.strip_suffix('%') {
        return match decimal(pct) {
            Some((int, frac)) if frac.len() <= 2 => {
                let permyriad = int.checked_mul(100).and_then(|v| v.checked_add(format!("{frac:0<2}").parse().ok()?));
                match permyriad {
                    Some(0) => Some(format!("{} is zero: systemd refuses a zero memory limit", shown(m))),
                    Some(v) if v <= 10000 => None,
                    _ => Some(format!("{} is more than 100%", shown(m))),
                }
            }
            _ => Some(format!("{} is not a percentage (e.g. `80%` or `12.5%`, at most two decimals)", shown(m))),
        };
    }
    let (number, factor): (&str, u128) = match m.as_bytes().last() {
        Some(b'K') => (&m[..m.len() - 1], 1 << 10),
        Some(b'M') => (&m[..m.len() - 1], 1 << 20),
        Some(b'G') => (&m[..m.len() - 1], 1 << 30),
        Some(b'T') => (&m[..m.len() - 1], 1 << 40),
        Some(b'P') => (&m[..m.len() - 1], 1 << 50),
        Some(b'E') => (&m[..m.len() - 1], 1 << 60),
        Some(b'B') => (&m[..m.len() - 1], 1),
        _ => (m, 1),
    };
    let Some((int, frac)) = decimal(number) else {
        return Some(format!(
            "{} is not a memory size (bytes with an optional K, M, G, T, P or E suffix, a percentage, or `infinity`)",
            shown(m)
        ));
    };
    // Exact in u128: int < 10^20, factor <= 2^60, frac < 10^18.
    let frac_bytes =
        if frac.is_empty() { 0 } else { frac.parse::<u128>().unwrap_or(0) * factor / 10u128.pow(frac.len() as u32) };
    match int.checked_mul(factor).and_then(|b| b.checked_add(frac_bytes)) {
        Some(0) => Some(format!("{} is zero: systemd refuses a zero memory limit", shown(m))),
        Some(b) if b < u128::from(engine::facts(engine).min_memory_max) => {
            let floor = engine::facts(engine).min_memory_max;
            Some(format!(
                "{} is {}: no {} server starts in less than {} (its runtime alone needs that much memory, before any weights), and systemd would kill it while it loads, at every restart; give at least `{}`, a percentage of the host's memory, or `infinity`",
                shown(m),
                bytes(b),
                engine.as_str(),
                bytes(u128::from(floor)),
                systemd_size(floor)
            ))
        }
        Some(b) if b < u128::from(u64::MAX) => None,
        _ => Some(format!("{} is too large (systemd's limit is 16E)", shown(m))),
    }
}

/// A size as people read it: `1 byte`, `640 bytes`, `1.5 KiB`, `64 MiB`.
pub(super) fn bytes(b: u128) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if b < 1024 {
        return format!("{b} byte{}", if b == 1 { "" } else { "s" });
    }
    let (mut v, mut unit) = (b as f64 / 1024.0, 0);
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    let v = format!("{v:.1}");
    format!("{} {}", v.strip_suffix(".0").unwrap_or(&v), UNITS[unit])
}

/// Bytes in systemd's syntax, with the largest suffix that divides them: `64M`, `1G`.
pub(super) fn systemd_size(b: u64) -> String {
    for (suffix, shift) in [("E", 60), ("P", 50), ("T", 40), ("G", 30), ("M", 20), ("K", 10)] {
        if b != 0 && b.is_multiple_of(1 << shift) {
            return format!("{}{suffix}", b >> shift);
        }
    }
    b.to_string()
}

/// systemd's credential names are file names; specd accepts a portable subset.
pub(super) fn credential_name_ok(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= MAX_NAME
        && n != "."
        && n != ".."
        && n.bytes().all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b))
}
