//! The `specd` command line.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::specs;

#[derive(Parser, Debug)]
#[command(
    name = "specd",
    version,
    about = "GitOps agent for GPU inference hosts: specs in git, systemd units that provably run them"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Check spec files (or directories of them): exit 0 when all are valid, 1 otherwise.
    /// Every problem of every file is reported, with file, line, column and field.
    Validate {
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
    /// Print the unit file a spec renders to.
    Render {
        file: PathBuf,
        /// Merge this host's overlay (default: the base spec, no overlay).
        #[arg(long)]
        host: Option<String>,
        /// Print the sha256 of the unit instead of the unit.
        #[arg(long)]
        hash: bool,
    },
    /// Print the JSON Schema of spec files.
    Schema,
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Validate { files } => validate(&files),
        Command::Render { file, host, hash } => render(&file, host.as_deref(), hash),
        Command::Schema => {
            print!("{}", specd_spec::json_schema());
            ExitCode::SUCCESS
        }
    }
}

fn validate(paths: &[PathBuf]) -> ExitCode {
    let files = match specs::expand(paths) {
        Ok(f) => f,
        Err(d) => {
            eprintln!("{d}");
            return ExitCode::from(1);
        }
    };
    let mut bad = 0;
    for f in &files {
        let diags = match std::fs::read_to_string(f) {
            Ok(text) => specd_spec::check(&f.display().to_string(), &text),
            Err(e) => specd_spec::Diagnostics(vec![specs::io_diag(f, &e)]),
        };
        for d in &diags.0 {
            eprintln!("{d}");
        }
        if diags.has_errors() {
            bad += 1;
        } else {
            println!("{}: ok", f.display());
        }
    }
    if bad > 0 {
        eprintln!("{bad} of {} file(s) invalid", files.len());
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

fn render(file: &PathBuf, host: Option<&str>, hash: bool) -> ExitCode {
    let spec = match specs::load(file).and_then(|p| p.resolve(host)) {
        Ok(s) => s,
        Err(d) => {
            eprintln!("{d}");
            return ExitCode::from(1);
        }
    };
    let unit = specd_spec::render(&spec);
    if hash {
        println!("{}", unit.sha256);
    } else {
        print!("{}", unit.text);
    }
    ExitCode::SUCCESS
}
