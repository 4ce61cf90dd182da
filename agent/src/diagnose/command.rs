//! `specd diagnose`: the verdicts on a unit's instances, as text or JSON.

use std::path::Path;

use anyhow::Result;

use super::{Diagnosis, Verdict, diagnose_unit};

/// A diagnosis as text: the verdict first, then the evidence with timestamps.
pub fn render_text(d: &Diagnosis) -> String {
    let mut out = format!(
        "{} {} [{}]: {}\n  {}\n",
        d.unit,
        d.invocation.as_deref().map(specd_spec::short).unwrap_or("-"),
        match (&d.started, &d.ended) {
            (Some(s), Some(e)) => format!("{s} .. {e}"),
            (Some(s), None) => format!("{s} .. now"),
            _ => "-".into(),
        },
        d.verdict,
        d.summary
    );
    for n in &d.notes {
        out.push_str(&format!("  note: {n}\n"));
    }
    for e in &d.evidence {
        let src = serde_json::to_value(e.source).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default();
        out.push_str(&format!("    {} {:<9} {}\n", e.time, src, shown(&e.text)));
    }
    out
}

/// The most characters of an evidence line in the text output. A journal line can be kilobytes
/// (vLLM's error for an architecture it does not know lists every one it knows: 10.7 KB);
/// `--json` has it whole.
const EVIDENCE_CHARS: usize = 1000;

/// An evidence line as the text output shows it: at most [`EVIDENCE_CHARS`] characters, an
/// ellipsis where it was cut.
fn shown(text: &str) -> std::borrow::Cow<'_, str> {
    match text.char_indices().nth(EVIDENCE_CHARS) {
        None => text.into(),
        Some(_) => {
            let mut cut: String = text.chars().take(EVIDENCE_CHARS - 1).collect();
            cut.push('…');
            cut.into()
        }
    }
}

/// How many instances the text output shows per unit.
const TEXT_INSTANCES: usize = 10;

/// `specd diagnose [UNIT] [--json]`: every instance of the unit (or of every unit specd has
/// state for), newest first. Exit 0 when every unit's newest instance was diagnosed, 2 when
/// specd could not tell for one (no unit, no journal, unknown verdict).
pub async fn run(unit: Option<&str>, json: bool, state_dir: &Path) -> Result<u8> {
    let units = match unit {
        Some(u) => vec![u.to_string()],
        None => crate::state::Store::new(state_dir).units()?,
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
