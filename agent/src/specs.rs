//! Reading spec files from disk (the spec crate itself does no I/O).

use std::path::{Path, PathBuf};

use specd_spec::{Diagnostic, Diagnostics, ParsedSpec, Severity};

/// Expand arguments: a directory stands for the `*.yaml` / `*.yml` files directly in it, sorted.
pub fn expand(paths: &[PathBuf]) -> Result<Vec<PathBuf>, Diagnostics> {
    let mut out = Vec::new();
    let mut errs = Vec::new();
    for p in paths {
        if p.is_dir() {
            match std::fs::read_dir(p) {
                Ok(rd) => {
                    let mut files: Vec<PathBuf> = rd
                        .filter_map(|e| e.ok().map(|e| e.path()))
                        .filter(|f| f.is_file() && f.extension().is_some_and(|x| x == "yaml" || x == "yml"))
                        .collect();
                    files.sort();
                    out.extend(files);
                }
                Err(e) => errs.push(io_diag(p, &e)),
            }
        } else {
            out.push(p.clone());
        }
    }
    if errs.is_empty() { Ok(out) } else { Err(Diagnostics(errs)) }
}

pub fn io_diag(p: &Path, e: &std::io::Error) -> Diagnostic {
    Diagnostic {
        severity: Severity::Error,
        file: p.display().to_string(),
        line: 0,
        column: 0,
        path: String::new(),
        message: format!("cannot read: {e}"),
        source_line: None,
    }
}

/// Read and parse one spec file.
pub fn load(p: &Path) -> Result<ParsedSpec, Diagnostics> {
    let text = std::fs::read_to_string(p).map_err(|e| Diagnostics(vec![io_diag(p, &e)]))?;
    specd_spec::parse(&p.display().to_string(), &text)
}
