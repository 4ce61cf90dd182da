//! `specd diagnose`: the verdicts on a unit's instances (every instance of the unit, or of every
//! unit specd has state for), as text or JSON.

use std::path::Path;

use anyhow::Result;

use crate::diagnose::{Diagnosis, Verdict, diagnose_unit, render_text};

/// How many instances the text output shows per unit.
const TEXT_INSTANCES: usize = 10;

/// `specd diagnose [UNIT] [--json]`: every instance of the unit (or of every unit specd has
/// state for), newest first. Exit 0 when every unit's newest instance was diagnosed, 2 when
/// specd could not tell for one (no unit, no journal, unknown verdict).
pub async fn run(unit: Option<&str>, json: bool, state_dir: &Path) -> Result<u8> {
    let units = match unit {
        Some(u) => vec![u.to_string()],
        None => crate::machine::store::Store::new(state_dir).units()?,
    };
    if units.is_empty() {
        eprintln!("specd diagnose: specd has no state for any unit in {}; name a unit", state_dir.display());
        return Ok(2);
    }
    let mut code = 0u8;
    let mut all: Vec<Diagnosis> = Vec::new();
    for u in &units {
        match diagnose_unit(u).await {
            Ok(ds) => {
                if ds.first().is_none_or(|d| d.verdict == Verdict::Unknown) {
                    code = 2;
                }
                if ds.is_empty() {
                    eprintln!("{u}: no instance in the journal and no result from systemd");
                }
                if !json {
                    for d in ds.iter().take(TEXT_INSTANCES) {
                        print!("{}", render_text(d));
                    }
                    if ds.len() > TEXT_INSTANCES {
                        println!("  ({} older instances not shown; --json has them all)", ds.len() - TEXT_INSTANCES);
                    }
                }
                all.extend(ds);
            }
            Err(e) => {
                eprintln!("{u}: {e:#}");
                code = 2;
            }
        }
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&all)?);
    }
    Ok(code)
}
