//! `specd bundle import FILE`: a `git bundle` carried to an air-gapped site, put into the local
//! mirror the agent follows under the agent's own rules (`source/bundle.rs` says which), or
//! refused with nothing changed.

use std::path::{Path, PathBuf};

use anyhow::Result;
use specd_spec::short;

use crate::config::AgentConfig;
use crate::machine::store::SourceState;
use crate::source::bundle::{self, Deployed, Refused};

#[derive(clap::Subcommand, Debug)]
pub enum BundleCommand {
    /// Put a bundle's followed branch (and the promotion record's branch) into the mirror the
    /// agent follows (`repo:` of the agent config, a path or file:// URL): the bundle verified
    /// whole, every new commit of the branch's line signed as the agent requires, never
    /// backwards; refs moved at once, or nothing changes. Exit 1 when the bundle is refused.
    Import {
        /// A file made by `git bundle create` (e.g. `git bundle create site.bundle main
        /// specd-promotions` in a clone of the config repository).
        file: PathBuf,
        /// The agent config: its `repo` (the mirror), `branch` or `tag`, `path` and signature
        /// settings.
        #[arg(long, default_value = crate::config::DEFAULT_PATH)]
        config: PathBuf,
        /// Accept a bundle whose branch does not descend from the mirror's (history rewritten
        /// on purpose); the agent still needs its own `allow_rewind` to deploy it.
        #[arg(long)]
        allow_rewind: bool,
    },
}

/// Run a `specd bundle` command; 0 imported (or nothing new), 1 refused.
pub fn run(command: BundleCommand, state_dir: &Path) -> Result<u8> {
    let BundleCommand::Import { file, config, allow_rewind } = command;
    let cfg = AgentConfig::load(&config)?;
    let source = cfg.source()?;
    let deployed = deployed(&source, cfg.state_dir.as_deref().unwrap_or(state_dir));
    match bundle::import(&source, &file, allow_rewind, &deployed) {
        Ok(done) if done.moved.is_empty() => {
            println!("{}: the mirror {} has it already; nothing changed", file.display(), done.mirror.display());
            Ok(0)
        }
        Ok(done) => {
            for m in &done.moved {
                let from = m.from.map_or("(new)".to_string(), |o| short(&o.to_string()).to_string());
                let signed =
                    if m.verified > 0 { format!(", {} commit(s) verified", m.verified) } else { String::new() };
                println!("{}: {from} -> {}{signed}", m.name, short(&m.to.to_string()));
            }
            let when = if source.repo.starts_with("file://") {
                "at its next poll"
            } else {
                "at once (it watches the mirror's refs)"
            };
            println!(
                "imported {} into {}; the agent following it reads it {when}",
                file.display(),
                done.mirror.display()
            );
            Ok(0)
        }
        Err(e) if e.downcast_ref::<Refused>().is_some() => {
            eprintln!("specd: refused: {e:#}");
            Ok(1)
        }
        Err(e) => Err(e),
    }
}

/// What the agent of this state directory deploys from this repository (nothing when its
/// `source.json` is of another repository or ref, or there is none).
fn deployed(source: &crate::source::git::SourceConfig, state_dir: &Path) -> Deployed {
    let oid = |o: &Option<String>| o.as_deref().and_then(|o| git2::Oid::from_str(o).ok());
    match SourceState::load(state_dir) {
        Some(s) if s.repo == source.repo && s.followed == followed(source) => {
            Deployed { commit: oid(&s.accepted_commit), record: oid(&s.accepted_record) }
        }
        _ => Deployed::default(),
    }
}

/// `branch main` / `tag v1`, as `source.json` names what it follows.
fn followed(source: &crate::source::git::SourceConfig) -> String {
    match &source.tag {
        Some(t) => format!("tag {t}"),
        None => format!("branch {}", source.branch),
    }
}
