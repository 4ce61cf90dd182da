//! `specd diff -f FILE`: what an apply of a spec would change, the unit file and the server's args.

use super::*;
use crate::machine::probe::{self, Health, Probe};
use crate::reconcile::context::Dirs;
use crate::source::spec_files;
use anyhow::Result;
use serde::Serialize;
use std::path::Path;
use std::time::Duration;

/// `specd diff --json`: one document on stdout. `ok` is true exactly when the exit code is 0
/// (nothing differs).
#[derive(Debug, Default, Serialize)]
pub struct DiffJson {
    pub ok: bool,
    /// Why nothing was compared (the spec file is not valid).
    pub error: Option<String>,
    pub diagnostics: Vec<serde_json::Value>,
    pub unit: Option<String>,
    pub file: String,
    /// The unit file and the server's args together: anything differs.
    pub differs: bool,
    pub unit_file: Option<UnitFileDiff>,
    pub server_args: Option<ServerArgsDiff>,
    /// The server answered its readiness endpoint.
    pub ready: bool,
}

#[derive(Debug, Serialize)]
pub struct UnitFileDiff {
    pub path: String,
    pub differs: bool,
    /// Null when there is no unit file.
    pub deployed_sha256: Option<String>,
    pub desired_sha256: String,
    /// The unified diff, deployed against desired; null when they are equal.
    pub diff: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct ServerArgsDiff {
    /// The server's args were read and compared with the spec.
    pub compared: bool,
    /// Each arg that differs: `key` (a JSON pointer into the server's report), `expected` (the
    /// spec's value), `actual` (the server's).
    pub mismatches: Vec<probe::ArgMismatch>,
    /// Why they were not compared.
    pub error: Option<String>,
}

/// `specd diff -f FILE`: the deployed unit file against the desired one, and the server's args
/// against the spec. Exit 0 when nothing differs, 1 when something does, 2 when the spec file is
/// not valid (nothing compared).
pub async fn diff(dirs: &Dirs, file: &Path, host: Option<String>, json: bool) -> Result<u8> {
    let mut doc = DiffJson { file: file.display().to_string(), ..Default::default() };
    let d = match desired(file, host)? {
        Ok(d) => d,
        Err(diags) => {
            doc.diagnostics = spec_files::diagnostics_json(&diags.0);
            print_failed(doc, json, format!("{} is not a valid spec; nothing was compared", file.display()))?;
            return Ok(2);
        }
    };
    doc.unit = Some(d.spec.unit.clone());
    let path = crate::host::unit_path(&dirs.unit_dir, &d.spec.unit);
    let on_disk = crate::machine::atomic::read_opt(&path)?;
    let deployed_sha256 = on_disk.as_deref().map(specd_spec::sha256_hex);
    let deployed = on_disk.map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default();
    let mut differs = false;
    let mut unified = None;
    if deployed != d.unit.text {
        differs = true;
        let diff = similar::TextDiff::from_lines(&deployed, &d.unit.text);
        let text = diff
            .unified_diff()
            .context_radius(3)
            .header(&path.display().to_string(), &format!("desired ({})", file.display()))
            .to_string();
        if !json {
            print!("{text}");
        }
        unified = Some(text);
    }
    doc.unit_file = Some(UnitFileDiff {
        path: path.display().to_string(),
        differs,
        deployed_sha256,
        desired_sha256: d.unit.sha256.clone(),
        diff: unified,
    });
    let base = d.spec.base_url();
    let quick = Probe::new(Duration::from_millis(1500));
    // The running instance, for an engine that logs its args (none: the log is not read).
    let invocation = match d.spec.args_report() {
        specd_spec::ArgsReport::LogLine(_) => crate::machine::systemd::Systemd::default()
            .show(&d.spec.unit)
            .await
            .map(|p| p.invocation_id)
            .unwrap_or_default(),
        _ => String::new(),
    };
    let mut args = ServerArgsDiff { compared: false, mismatches: vec![], error: None };
    match crate::host::reported_args(&quick, &base, &d.spec, &invocation).await {
        Some(Ok(info)) => {
            let m = probe::compare_args(&d.spec.expected_server_args(), &info);
            for x in &m {
                if !json {
                    println!("server arg {x}");
                }
            }
            differs |= !m.is_empty();
            args.compared = true;
            args.mismatches = m;
        }
        Some(Err(e)) => {
            if !json {
                println!("(server args not compared: {e})");
            }
            args.error = Some(e.to_string());
        }
        None => args.error = Some("this engine does not report its args".into()),
    }
    doc.server_args = Some(args);
    doc.ready = quick.health(&format!("{base}{}", d.spec.readiness.endpoint)).await == Health::Ready;
    if !doc.ready && !json {
        println!("(the server at {base} is not ready)");
    }
    doc.differs = differs;
    finish(doc, json, u8::from(differs))
}
