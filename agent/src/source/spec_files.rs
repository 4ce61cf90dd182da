//! Reading spec files from disk (the spec crate itself does no I/O).

use std::path::{Path, PathBuf};

use specd_spec::{Diagnostic, Diagnostics, ParsedSpec, Severity};

/// Expand arguments: a directory stands for the `*.yaml` / `*.yml` files directly in it, sorted.
/// A directory is read as the agent reads the repository: an entry that is a symbolic link is
/// refused (its diagnostic is in the second list, beside an unreadable directory's), not
/// followed out of it. A file named itself is read wherever it points.
pub fn expand(paths: &[PathBuf]) -> (Vec<PathBuf>, Vec<Diagnostic>) {
    let mut out = Vec::new();
    let mut errs = Vec::new();
    for p in paths {
        if p.is_dir() {
            match std::fs::read_dir(p) {
                Ok(rd) => {
                    let mut files = Vec::new();
                    for e in rd.flatten() {
                        let f = e.path();
                        if !f.extension().is_some_and(|x| x == "yaml" || x == "yml") {
                            continue;
                        }
                        match e.file_type() {
                            Ok(t) if t.is_symlink() => errs.push(link_diag(&f)),
                            Ok(t) if t.is_file() => files.push(f),
                            _ => {}
                        }
                    }
                    files.sort();
                    out.extend(files);
                }
                Err(e) => errs.push(io_diag(p, &e)),
            }
        } else {
            out.push(p.clone());
        }
    }
    errs.sort_by(|a, b| a.file.cmp(&b.file));
    (out, errs)
}

pub fn io_diag(p: &Path, e: &std::io::Error) -> Diagnostic {
    file_diag(p, format!("cannot read: {e}"))
}

fn file_diag(p: &Path, message: String) -> Diagnostic {
    Diagnostic {
        severity: Severity::Error,
        file: p.display().to_string(),
        line: 0,
        column: 0,
        path: String::new(),
        message,
        source_line: None,
    }
}

fn link_diag(p: &Path) -> Diagnostic {
    let target = std::fs::read_link(p).map(|t| t.display().to_string()).unwrap_or_else(|e| format!("unreadable: {e}"));
    file_diag(p, link_refusal(&target))
}

/// Why a spec file that is a symbolic link is refused (in a directory of specs, or in a commit,
/// where git keeps the link as a blob holding its target).
pub fn link_refusal(target: &str) -> String {
    format!(
        "is a symbolic link (to {target}); specd reads only regular files from the repository: put the spec itself here, not a link to it"
    )
}

/// Read and parse one spec file.
pub fn load(p: &Path) -> Result<ParsedSpec, Diagnostics> {
    let text = std::fs::read_to_string(p).map_err(|e| Diagnostics(vec![io_diag(p, &e)]))?;
    specd_spec::parse(&p.display().to_string(), &text)
}

/// Diagnostics as `specd validate --json` and the other commands' `--json` give them: one object
/// each (file, line, column, field, severity, message).
pub fn diagnostics_json(diags: &[Diagnostic]) -> Vec<serde_json::Value> {
    diags
        .iter()
        .map(|d| {
            serde_json::json!({
                "file": d.file,
                "line": d.line,
                "column": d.column,
                "field": d.path,
                "severity": d.severity,
                "message": d.message,
            })
        })
        .collect()
}
