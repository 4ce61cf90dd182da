//! A bundle carried in: `specd bundle import FILE` puts what a `git bundle` holds into the local
//! mirror an air-gapped agent follows (`repo:` a path or `file://` URL), under the agent's own
//! rules, or changes nothing.
//!
//! 1. `git bundle verify`: the bundle is a bundle and its prerequisites are in the mirror.
//! 2. Its objects are fetched into the mirror with no ref written (`git fetch` checks the pack
//!    whole: a truncated bundle stops here). Objects no ref reaches are invisible to the agent.
//! 3. The followed ref and the promotion record's branch (the fleet file at the new head names
//!    it) are judged: neither may go back nor sideways from where the mirror has it, nor from
//!    what the agent deploys (an older bundle replayed would roll the site back), unless
//!    `--allow-rewind`; with signatures
//!    configured, every commit the ref's head has been on since the mirror's (its first-parent
//!    line; the tip alone into an empty mirror) verifies as the agent verifies what it deploys.
//! 4. Both refs move in one `git update-ref --stdin` transaction, each from the value judged: a
//!    kill before it leaves the mirror's refs as they were, and git's transaction moves them all
//!    or none.
//!
//! Blocking (git): a one-shot command's.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::{Context, Result, anyhow, bail};
use git2::{Oid, Repository};
use specd_spec::short;

use crate::source::git::{GitSource, SourceConfig, git_words, is_remote};

/// What an import did.
#[derive(Debug, PartialEq, Eq)]
pub struct Imported {
    pub mirror: PathBuf,
    /// Each ref that moved: name, where it was (`None`: new), where it is now, and how many
    /// commits were verified on the way.
    pub moved: Vec<Moved>,
}

#[derive(Debug, PartialEq, Eq)]
pub struct Moved {
    pub name: String,
    pub from: Option<Oid>,
    pub to: Oid,
    pub verified: usize,
}

/// What the agent following the mirror deploys now (its `source.json`): a bundle may not take
/// the mirror back from it either, even into a mirror made anew.
#[derive(Debug, Default)]
pub struct Deployed {
    pub commit: Option<Oid>,
    /// The promotion record's commit it took its revision from.
    pub record: Option<Oid>,
}

/// Why a bundle was refused (nothing changed): the command's answer is no.
#[derive(Debug)]
pub struct Refused(pub String);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Refused {}

fn refuse(why: String) -> anyhow::Error {
    anyhow::Error::new(Refused(format!("{why}; the bundle was refused and the mirror is unchanged")))
}

/// The mirror a source config follows: its `repo` when it is a path or a `file://` URL.
pub fn mirror_of(cfg: &SourceConfig) -> Result<PathBuf> {
    if let Some(p) = cfg.repo.strip_prefix("file://") {
        return Ok(PathBuf::from(p));
    }
    if is_remote(&cfg.repo) {
        bail!(
            "repo is {}, a remote: a bundle is imported into the local mirror an agent follows (repo: a path or file:// URL)",
            cfg.repo
        );
    }
    Ok(PathBuf::from(&cfg.repo))
}

/// Import `bundle` into the mirror `cfg` follows (created, bare, when it does not exist yet).
/// A [`Refused`] error when the bundle breaks a rule; another error when specd could not tell.
pub fn import(cfg: &SourceConfig, bundle: &Path, allow_rewind: bool, deployed: &Deployed) -> Result<Imported> {
    let mirror = mirror_of(cfg)?;
    std::fs::File::open(bundle).with_context(|| format!("reading {}", bundle.display()))?;
    let bundle = std::path::absolute(bundle)?;
    if mirror.exists() {
        return into(cfg, &mirror, &bundle, allow_rewind, deployed);
    }
    Repository::init_bare(&mirror).with_context(|| format!("creating the mirror {}", mirror.display()))?;
    let done = into(cfg, &mirror, &bundle, allow_rewind, deployed);
    if done.is_err() {
        // A mirror made for a bundle that was refused goes with it.
        let _ = std::fs::remove_dir_all(&mirror);
    }
    done
}

/// [`import`] into a mirror that exists.
fn into(cfg: &SourceConfig, mirror: &Path, bundle: &Path, allow_rewind: bool, deployed: &Deployed) -> Result<Imported> {
    let (mirror, bundle) = (mirror.to_path_buf(), bundle.to_path_buf());
    let local = SourceConfig { repo: mirror.display().to_string(), ..cfg.clone() };
    let src = GitSource::open(local.clone(), Path::new("/nonexistent"))?;
    let heads = bundle_heads(&src, &bundle)?;
    let followed = match &cfg.tag {
        Some(t) => format!("refs/tags/{t}"),
        None => format!("refs/heads/{}", cfg.branch),
    };
    let has = || heads.keys().map(String::as_str).collect::<Vec<_>>().join(", ");
    let mirrored = src.repository().refname_to_id(&followed).ok();
    if !heads.contains_key(&followed) && mirrored.is_none() {
        return Err(refuse(format!(
            "{} holds no {followed}, and the mirror has none (it holds: {})",
            bundle.display(),
            has()
        )));
    }
    fetch_objects(&src, &bundle, &heads)?;
    // Opened again: the objects the fetch wrote are read by a repository that knows their pack.
    let src = GitSource::open(local, Path::new("/nonexistent"))?;
    let mut moves = vec![];
    // A bundle without the followed branch (a promotion step alone) is read at the mirror's head.
    let head = match heads.get(&followed) {
        Some(&h) => {
            moves.extend(judge(&src, &followed, h, allow_rewind, deployed.commit)?);
            h
        }
        None => mirrored.expect("checked above"),
    };
    let record = record_branch(&src, head)?.map(|b| format!("refs/heads/{b}"));
    match record.filter(|r| heads.contains_key(r)) {
        Some(r) => moves.extend(judge(&src, &r, heads[&r], allow_rewind, deployed.record)?),
        None if !heads.contains_key(&followed) => {
            let why = format!(
                "{} holds neither {followed} nor the promotion record's branch (it holds: {})",
                bundle.display(),
                has()
            );
            return Err(refuse(why));
        }
        None => {}
    }
    if !moves.is_empty() {
        update_refs(&src, &moves)?;
    }
    Ok(Imported { mirror, moved: moves })
}

/// The refs a bundle holds, once `git bundle verify` found it usable with this mirror.
fn bundle_heads(src: &GitSource, bundle: &Path) -> Result<BTreeMap<String, Oid>> {
    let git = |args: &[&str]| -> Result<std::process::Output> {
        let mut cmd = src.transfer()?;
        cmd.args(["bundle"]).args(args).arg(bundle);
        src.run_transfer(cmd, &format!("reading the bundle {}", bundle.display()))
    };
    // Not --quiet: git then says nothing of missing prerequisites.
    let out = git(&["verify"])?;
    if !out.status.success() {
        return Err(refuse(format!("{} is not a usable bundle: {}", bundle.display(), git_words(&out.stderr))));
    }
    let out = git(&["list-heads"])?;
    if !out.status.success() {
        return Err(refuse(format!("{} is not a usable bundle: {}", bundle.display(), git_words(&out.stderr))));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_once(' '))
        .filter_map(|(oid, name)| Some((name.to_string(), Oid::from_str(oid).ok()?)))
        .collect())
}

/// The bundle's objects into the mirror, no ref written: `git fetch` reads the whole pack
/// (`index-pack` checks every object), so a truncated or corrupt bundle fails here.
fn fetch_objects(src: &GitSource, bundle: &Path, heads: &BTreeMap<String, Oid>) -> Result<()> {
    let mut cmd = src.transfer()?;
    cmd.args(["fetch", "--quiet", "--no-tags", "--no-write-fetch-head", "--"]).arg(bundle).args(heads.keys());
    let out = src.run_transfer(cmd, &format!("reading the bundle {}", bundle.display()))?;
    if !out.status.success() {
        return Err(refuse(format!("{} is not whole: {}", bundle.display(), git_words(&out.stderr))));
    }
    Ok(())
}

/// The promotion record's branch the fleet file at `head` names (`None`: no fleet file).
fn record_branch(src: &GitSource, head: Oid) -> Result<Option<String>> {
    let head = src.repository().find_object(head, None)?.peel_to_commit()?.id();
    let Some(file) = src.fleet_file(head).map_err(|e| refuse(format!("{e:#}")))? else {
        return Ok(None);
    };
    let at = format!("{}@{}", file.path, short(&head.to_string()));
    let fleet = specd_spec::fleet::parse_fleet(&file.text, &at).map_err(|d| refuse(d.to_string()))?;
    Ok(Some(fleet.record_branch().to_string()))
}

/// Whether the mirror's `name` may move to `new`, as the agent judges a head it deploys: `None`
/// when it is there already.
fn judge(src: &GitSource, name: &str, new: Oid, allow_rewind: bool, deployed: Option<Oid>) -> Result<Option<Moved>> {
    let repo = src.repository();
    let old = match repo.find_reference(name) {
        Ok(r) => Some(r.target().ok_or_else(|| anyhow!("{name} of the mirror is a symbolic ref"))?),
        Err(e) if e.code() == git2::ErrorCode::NotFound => None,
        Err(e) => return Err(e).with_context(|| format!("reading {name} of the mirror")),
    };
    if old == Some(new) {
        return Ok(None);
    }
    let commit = |o: Oid| -> Result<Oid> { Ok(repo.find_object(o, None)?.peel_to_commit()?.id()) };
    let (new_c, old_c) = (commit(new)?, old.map(commit).transpose()?);
    let (n, ns) = (short(name.trim_start_matches("refs/heads/")), short(&new_c.to_string()).to_string());
    if let Some(o) = old_c
        && !allow_rewind
        && !src.descends_from(new_c, o)?
    {
        let os = short(&o.to_string()).to_string();
        let how = if src.descends_from(o, new_c)? { "an older bundle replayed?" } else { "history rewritten?" };
        return Err(refuse(format!(
            "the bundle's {n} is {ns}, which does not contain the mirror's {os} ({how}); refusing to go backwards or sideways (--allow-rewind to allow)"
        )));
    }
    if let Some(d) = deployed
        && !allow_rewind
        && !(src.has_commit(d) && src.descends_from(new_c, d)?)
    {
        let ds = short(&d.to_string()).to_string();
        return Err(refuse(format!(
            "the bundle's {n} is {ns}, which does not contain {ds}, what the agent deploys (an older bundle replayed?); refusing to go backwards (--allow-rewind to allow)"
        )));
    }
    let mut verified = 0;
    if src.cfg.verify.is_some() {
        for c in first_parent_line(repo, new_c, old_c)? {
            src.verify(c).map_err(|e| {
                let rule = rule(src);
                refuse(format!("the bundle's {n} (at {ns}): {e:#} (the rule: {rule})"))
            })?;
            verified += 1;
        }
    }
    Ok(Some(Moved { name: name.to_string(), from: old, to: new, verified }))
}

/// The signature rule of the source, for an error.
fn rule(src: &GitSource) -> String {
    match &src.cfg.verify {
        Some(crate::source::git::Verify::Ssh { allowed_signers }) => {
            format!("every commit deployed signed by a key of {}", allowed_signers.display())
        }
        Some(crate::source::git::Verify::Gpg { keyring }) => {
            format!("every commit deployed signed by a key of {}", keyring.display())
        }
        None => "none".into(),
    }
}

/// The commits `new`'s first-parent line has that `old` does not reach (`new` alone without
/// `old`): each a head the branch had, which a fleet's record may assign.
fn first_parent_line(repo: &Repository, new: Oid, old: Option<Oid>) -> Result<Vec<Oid>> {
    let Some(old) = old else {
        return Ok(vec![new]);
    };
    let mut walk = repo.revwalk()?;
    walk.simplify_first_parent()?;
    walk.push(new)?;
    walk.hide(old)?;
    walk.collect::<std::result::Result<Vec<_>, _>>().context("walking the bundle's new commits")
}

/// Move every ref of `moves` in one transaction, each only from the value it was judged at.
fn update_refs(src: &GitSource, moves: &[Moved]) -> Result<()> {
    let zero = "0".repeat(40);
    let mut script = String::from("start\n");
    for m in moves {
        script.push_str(&format!("update {} {} {}\n", m.name, m.to, m.from.map_or(zero.clone(), |o| o.to_string())));
    }
    script.push_str("prepare\ncommit\n");
    let mut cmd = src.transfer()?;
    cmd.args(["update-ref", "--stdin"]).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().context("running git update-ref")?;
    child.stdin.take().expect("piped").write_all(script.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!("moving the mirror's refs (nothing moved): {}", git_words(&out.stderr));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bundle_goes_into_a_local_mirror_only() {
        let mirror = |repo: &str| mirror_of(&SourceConfig::new(repo)).map_err(|e| e.to_string());
        assert_eq!(mirror("/srv/specd.git"), Ok(PathBuf::from("/srv/specd.git")));
        assert_eq!(mirror("file:///srv/specd.git"), Ok(PathBuf::from("/srv/specd.git")));
        for remote in ["https://git.example.com/infra/gpus.git", "git@git.example.com:infra/gpus.git"] {
            let e = mirror(remote).unwrap_err();
            assert!(e.starts_with(&format!("repo is {remote}, a remote:")), "{e}");
        }
    }
}
