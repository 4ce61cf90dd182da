//! `specd suspend` and `specd resume`: a hold that keeps the agent's hands off a unit.

use super::control::notify_agent;
use super::*;
use crate::core::hold;
use crate::machine::store::{self, Store};
use crate::reconcile::context::Dirs;
use anyhow::Result;
use std::path::PathBuf;
use std::time::Duration;

/// `90s`, `15m`, `2h`, `1d`, `1h30m`: a duration for `--for`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let bad = || format!("{text:?} is not a duration: write a number with s, m, h or d (90s, 15m, 2h, 1d, 1h30m)");
    let mut total = 0u64;
    let mut digits = String::new();
    let t = text.trim();
    if t.is_empty() {
        return Err(bad());
    }
    for c in t.chars() {
        if c.is_ascii_digit() {
            digits.push(c);
            continue;
        }
        let unit = match c {
            's' => 1,
            'm' => 60,
            'h' => 3600,
            'd' => 86_400,
            _ => return Err(bad()),
        };
        let n: u64 = digits.parse().map_err(|_| bad())?;
        total = n.checked_mul(unit).and_then(|x| total.checked_add(x)).ok_or_else(bad)?;
        digits.clear();
    }
    if !digits.is_empty() || total == 0 {
        return Err(bad());
    }
    Ok(Duration::from_secs(total))
}

/// `specd suspend UNIT [--for D] [--reason R]`: the agent keeps its hands off the unit (it
/// observes it and reports drift) until `specd resume` or the end of `--for`. A hand `specd
/// apply` still applies.
pub async fn suspend(
    dirs: &Dirs,
    unit: String,
    for_: Option<Duration>,
    reason: Option<String>,
    socket: PathBuf,
) -> Result<u8> {
    let store = Store::new(&dirs.state_dir);
    let Some(st) = known_unit(&store, &unit)? else { return Ok(1) };
    if let Some(why) = live_sweep(&this_host(), &st) {
        eprintln!("specd: refused: {unit}: {why}; nothing was changed");
        return Ok(1);
    }
    let since = store::now();
    let hold = hold::Hold {
        until: for_.map(|d| since + d.as_secs()),
        reason,
        ..hold::Hold::new(hold::HoldKind::Suspend, operator("specd suspend"), since)
    };
    if let Some(old) = st.hold.as_ref().filter(|h| h.kind == hold::HoldKind::Pin) {
        println!("{unit}: replaces the pin ({}); `specd resume` ends both", old.describe());
    }
    store.set_hold(&unit, hold.clone()).await?;
    println!("{unit}: {}", hold.describe());
    println!("the agent observes it and reports drift, and changes nothing; a hand `specd apply` still applies");
    notify_agent(&socket, &unit).await;
    Ok(0)
}

/// `specd resume UNIT`: end a suspend or a pin; the agent reconciles the unit again.
pub async fn resume(dirs: &Dirs, unit: String, socket: PathBuf) -> Result<u8> {
    let store = Store::new(&dirs.state_dir);
    let Some(st) = known_unit(&store, &unit)? else { return Ok(1) };
    // A sweep's hold that names no process (an older specd's) has no sweep to stop: resumed.
    let named = st.hold.as_ref().is_some_and(|h| h.pid.is_some());
    if let Some(why) = live_sweep(&this_host(), &st).filter(|_| named) {
        eprintln!("specd: refused: {unit}: {why}");
        return Ok(1);
    }
    match store.clear_hold(&unit, &format!("resumed by {}", operator("specd resume"))).await? {
        None => println!("{unit}: not held; nothing to resume"),
        Some(h) => {
            println!("{unit}: no longer {}", h.describe());
            notify_agent(&socket, &unit).await;
        }
    }
    Ok(0)
}
