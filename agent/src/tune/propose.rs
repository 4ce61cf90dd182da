//! `specd tune --propose`: the recommended change as a commit for a person to merge, the GitOps
//! way. Its tree is the followed branch's head with the unit's spec file edited (the length set
//! where it stands, the rest byte for byte); its parent is that head; its message carries the
//! evidence; it is signed like the promoter's records (`fleet::publish::commit_tree`). It goes
//! on a branch of its own, [`BRANCH_PREFIX`]`<unit>`, never the followed branch: a newer
//! proposal replaces one not merged yet (a push with a lease: only if the branch is where it was
//! read), and the same proposal again is not made twice.

use std::path::PathBuf;

use anyhow::{Context, Result, anyhow, bail};
use git2::Oid;
use serde::Serialize;
use specd_spec::short;

use crate::fleet::publish::{self, Made, Pushed, Signing};
use crate::source::git::{GitSource, SourceConfig};

/// The proposals' branches: `specd-proposals/<unit>`.
pub const BRANCH_PREFIX: &str = "specd-proposals/";

/// Where and how proposals are written.
#[derive(Clone, Debug)]
pub struct Options {
    /// The repository the agent follows: its followed branch is the proposal's parent.
    pub source: SourceConfig,
    /// A clone of it that `tune` keeps for itself.
    pub cache: PathBuf,
    /// The host whose overlay of the spec applies.
    pub host: String,
    pub signing: Option<Signing>,
    /// The commit's author and committer, `Name <email>`.
    pub author: String,
}

/// A proposal, as written (or found already there).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Proposed {
    pub branch: String,
    pub commit: String,
    /// The head of the followed branch it was made on.
    pub parent: String,
    /// The spec file it changes, in the repository.
    pub file: String,
    /// The same proposal was on the branch already: nothing was written.
    pub already: bool,
    pub change: String,
}

impl Proposed {
    pub fn said(&self) -> String {
        let what = if self.already { "already proposed" } else { "proposed" };
        format!(
            "{what}: commit {} on branch {} (on {}), changing {}: merge it to apply",
            short(&self.commit),
            self.branch,
            short(&self.parent),
            self.file
        )
    }
}

/// [`propose`] off the async runtime (git is blocking).
pub async fn propose_blocking(o: Options, unit: &str, k: u32, message: String) -> Result<Proposed> {
    let unit = unit.to_string();
    tokio::task::spawn_blocking(move || propose(&o, &unit, k, &message)).await?
}

/// The spec file of `unit` at `head` (as the host resolves it): its path and text.
fn spec_file(src: &GitSource, head: Oid, unit: &str, host: &str) -> Result<(String, String)> {
    for f in src.read_specs(head)? {
        let Ok(parsed) = specd_spec::parse(&f.path, &f.text) else { continue };
        if parsed.resolve(Some(host)).is_ok_and(|s| s.unit == unit) {
            return Ok((f.path, f.text));
        }
    }
    bail!("no spec of {unit} at {} of {} ({})", short(&head.to_string()), src.cfg.repo, src.followed())
}

/// Write the proposal that sets `unit`'s `speculative.num_steps` to `k`, with `message`.
pub fn propose(o: &Options, unit: &str, k: u32, message: &str) -> Result<Proposed> {
    let src = GitSource::open(o.source.clone(), &o.cache)?;
    src.fetch()?;
    let head = src.head()?;
    let (path, text) = spec_file(&src, head, unit, &o.host)?;
    let new = super::change::changed(&path, &text, Some(&o.host), k).map_err(|e| anyhow!("{path}: {e}"))?;
    if new == text {
        bail!("{path} at {} has num_steps {k} already: nothing to propose", short(&head.to_string()));
    }
    let change = super::change::diff(&path, &text, &new);
    let tree = edited_tree(&src, head, &path, &new)?;
    let branch = format!("{BRANCH_PREFIX}{unit}");
    let was = src.fetch_record(&branch)?;
    let proposed = |commit: Oid, already| Proposed {
        branch: branch.clone(),
        commit: commit.to_string(),
        parent: head.to_string(),
        file: path.clone(),
        already,
        change: change.clone(),
    };
    if let Some(w) = was {
        let c = src.repository().find_commit(w)?;
        if c.tree_id() == tree && c.parent_ids().eq([head]) {
            return Ok(proposed(w, true));
        }
    }
    let made = Made { what: "the proposal's commit", message, author: &o.author };
    let commit = publish::commit_tree(&src, tree, Some(head), made, o.signing.as_ref())?;
    match publish::push_replacing(&src, commit, &branch, was)? {
        Pushed::Done => Ok(proposed(commit, false)),
        Pushed::Rejected(why) => {
            bail!("another writer moved {branch} while this proposal was made ({why}); run it again")
        }
    }
}

/// The tree of `head` with the file at `path` holding `text` (its mode kept).
fn edited_tree(src: &GitSource, head: Oid, path: &str, text: &str) -> Result<Oid> {
    let repo = src.repository();
    let tree = repo.find_commit(head)?.tree()?;
    let mode = tree.get_path(std::path::Path::new(path)).map(|e| e.filemode()).unwrap_or(0o100644);
    let blob = repo.blob(text.as_bytes()).context("writing the proposal's spec file")?;
    let mut update = git2::build::TreeUpdateBuilder::new();
    update.upsert(path, blob, if mode == 0o100755 { git2::FileMode::BlobExecutable } else { git2::FileMode::Blob });
    update.create_updated(repo, &tree).with_context(|| format!("writing the proposal's tree ({path} changed)"))
}

/// The signing key of the flags (or the agent config): one of the two, or none.
pub fn signing(ssh: Option<PathBuf>, gpg: Option<String>) -> Result<Option<Signing>> {
    match (ssh, gpg) {
        (Some(_), Some(_)) => bail!("give one of the SSH and the OpenPGP signing keys, not both"),
        (Some(key), None) => Ok(Some(Signing::Ssh { key })),
        (None, Some(key)) => Ok(Some(Signing::Gpg { key })),
        (None, None) => Ok(None),
    }
}

/// The default author of a host's proposals.
pub fn author(host: &str) -> String {
    format!("specd tune <specd@{host}>")
}
