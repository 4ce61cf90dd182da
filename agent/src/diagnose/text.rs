//! A diagnosis as a person reads it: the verdict first, then the evidence.

use super::Diagnosis;

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
