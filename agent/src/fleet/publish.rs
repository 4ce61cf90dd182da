//! The promoter's side of the promotion record: a commit whose tree holds only
//! `promotions.yaml`, signed by git's own signing when given a key (so that agents verifying
//! signatures accept it, as they do the followed branch's commits), and its push to the record
//! branch: a fast-forward, never forced. `specd tune --propose` makes its commits the same way
//! ([`commit_tree`]) and puts them on a branch of their own ([`push_replacing`]). One writer wins: when another promoter pushed first,
//! the push is [`Pushed::Rejected`] and the caller re-reads the record. The objects are made in
//! the [`GitSource`]'s repository (a remote's cache, or the local repository); a remote is
//! pushed to with the credentials its fetch uses. Blocking, like the source.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{Context, Result, anyhow, bail};
use git2::{ErrorCode, Oid};
use specd_spec::fleet::RECORD_FILE;
use specd_spec::short;

use crate::source::git::{GitSource, git_words};

/// The key a record commit is signed with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Signing {
    /// An SSH private key file (git's `gpg.format=ssh`); agents verify with an allowed-signers
    /// file.
    Ssh { key: PathBuf },
    /// An OpenPGP key (id, fingerprint or e-mail) of the promoter's keyring (`$GNUPGHOME`);
    /// agents verify with a keyring.
    Gpg { key: String },
}

/// How a push of the record ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Pushed {
    Done,
    /// The branch is no longer where the record's commit was made on: another promoter wrote
    /// first. git's words (or, for a local repository, where the branch is now).
    Rejected(String),
}

/// `Name <email>` as (name, email).
fn identity(author: &str) -> Result<(&str, &str)> {
    let bad = || anyhow!("the record's author {author:?} is not `Name <email>`");
    let (name, rest) = author.split_once('<').ok_or_else(bad)?;
    let email = rest.trim_end().strip_suffix('>').ok_or_else(bad)?;
    let name = name.trim();
    if name.is_empty() || email.is_empty() || email.contains(['<', '>']) || name.contains('>') {
        return Err(bad());
    }
    Ok((name, email))
}

/// A record commit: its tree holds only [`RECORD_FILE`] = `text`; its parent is the record
/// branch's head as read (`None`: the first record, a root commit). Signed with `signing` by
/// `git commit-tree -S`. The commit is made, not pushed: see [`push_record`].
pub fn commit_record(
    src: &GitSource,
    parent: Option<Oid>,
    text: &str,
    message: &str,
    author: &str,
    signing: Option<&Signing>,
) -> Result<Oid> {
    let repo = src.repository();
    if let Some(p) = parent {
        repo.find_commit(p)
            .with_context(|| format!("the record's parent {} is not in {}", short(&p.to_string()), src.cfg.repo))?;
    }
    let blob = repo.blob(text.as_bytes()).context("writing the record's blob")?;
    let mut tree = repo.treebuilder(None)?;
    tree.insert(RECORD_FILE, blob, 0o100644)?;
    let tree = tree.write().context("writing the record's tree")?;
    commit_tree(src, tree, parent, Made { what: "the record's commit", message, author }, signing)
}

/// What a commit is (for errors: `the record's commit`), its message and its author and
/// committer (`Name <email>`).
pub struct Made<'a> {
    pub what: &'a str,
    pub message: &'a str,
    pub author: &'a str,
}

/// A commit of `tree` on `parent` (`None`: a root commit) in the source's repository, signed
/// with `signing` by git's own `git commit-tree -S` (unsigned means unsigned, whatever the
/// user's git configuration says). Made, not pushed.
pub fn commit_tree(
    src: &GitSource,
    tree: Oid,
    parent: Option<Oid>,
    made: Made,
    signing: Option<&Signing>,
) -> Result<Oid> {
    let Made { what, message, author } = made;
    let (name, email) = identity(author)?;
    let repo = src.repository();
    let mut cmd = Command::new("git");
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("GIT_") {
            cmd.env_remove(k);
        }
    }
    cmd.arg("--git-dir").arg(repo.path());
    match signing {
        None => {}
        Some(Signing::Ssh { key }) => {
            let key = std::path::absolute(key).with_context(|| format!("the signing key {}", key.display()))?;
            cmd.args(["-c", "gpg.format=ssh", "-c"]).arg(format!("user.signingKey={}", key.display()));
        }
        Some(Signing::Gpg { key }) => {
            cmd.args(["-c", "gpg.format=openpgp", "-c"]).arg(format!("user.signingKey={key}"));
        }
    }
    cmd.args(["commit-tree", &tree.to_string()]);
    if let Some(p) = parent {
        cmd.args(["-p", &p.to_string()]);
    }
    cmd.arg(if signing.is_some() { "-S" } else { "--no-gpg-sign" });
    let mut child = cmd
        .args(["-F", "-"])
        .env("GIT_AUTHOR_NAME", name)
        .env("GIT_AUTHOR_EMAIL", email)
        .env("GIT_COMMITTER_NAME", name)
        .env("GIT_COMMITTER_EMAIL", email)
        .env("GIT_TERMINAL_PROMPT", "0")
        .env("LC_ALL", "C")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("running git commit-tree (is git installed?)")?;
    let mut stdin = child.stdin.take().expect("piped");
    let written = stdin.write_all(message.as_bytes());
    drop(stdin);
    let out = child.wait_with_output().context("running git commit-tree")?;
    if !out.status.success() {
        let signed = match signing {
            Some(Signing::Ssh { key }) => format!(" signed with the SSH key {}", key.display()),
            Some(Signing::Gpg { key }) => format!(" signed with the OpenPGP key {key}"),
            None => String::new(),
        };
        bail!("making {what}{signed}: {}", git_words(&out.stderr));
    }
    written.context("giving git commit-tree the message")?;
    let oid = String::from_utf8_lossy(&out.stdout);
    Oid::from_str(oid.trim()).with_context(|| format!("git commit-tree printed {:?}, not a commit", oid.trim()))
}

/// Push the record's commit to `refs/heads/<branch>`: a fast-forward push to the remote, never
/// forced; in a local repository, the branch is moved only if it still points at the commit's
/// parent (created only if it does not exist, for a root commit): a compare-and-swap. When the
/// branch moved meanwhile (another promoter won), [`Pushed::Rejected`]; other failures (the
/// remote unreachable, refused credentials, a hook that declined) are errors.
pub fn push_record(src: &GitSource, oid: Oid, branch: &str) -> Result<Pushed> {
    let name = format!("refs/heads/{branch}");
    if !git2::Reference::is_valid_name(&name) {
        bail!("the record branch {branch:?} is not a usable branch name");
    }
    let repo = src.repository();
    let commit = repo
        .find_commit(oid)
        .with_context(|| format!("the record's commit {} is not in {}", short(&oid.to_string()), src.cfg.repo))?;
    if !src.is_remote() {
        let parent = if commit.parent_count() == 0 { None } else { Some(commit.parent_id(0)?) };
        return swap(repo, &name, oid, parent);
    }
    let what = format!("pushing the record {} to branch {branch} of {}", short(&oid.to_string()), src.cfg.repo);
    let mut cmd = src.transfer()?;
    cmd.args(["push", "--porcelain", "--", &src.url(), &format!("{oid}:{name}")]);
    let out = src.run_transfer(cmd, &what)?;
    let porcelain = String::from_utf8_lossy(&out.stdout);
    // `!` is a refused ref; `[rejected]` is git's own refusal of a push that is not a
    // fast-forward (`non-fast-forward`, `fetch first`), while a `[remote rejected]` is the
    // server's (a hook, a protected branch): an error.
    if let Some((flag, summary)) = pushed_ref(&porcelain, &name) {
        if flag == "!" && summary.starts_with("[rejected]") {
            return Ok(Pushed::Rejected(format!("{name}: {summary}")));
        }
        // Two pushes at the same moment: the remote took the other's update between its
        // answer to ours and our ref update (`[remote rejected] (failed to update ref)`). A
        // lost race, if the branch has moved from the commit this one was made on; else an error.
        if flag == "!" && summary.starts_with("[remote rejected]") {
            let parent = if commit.parent_count() == 0 { None } else { Some(commit.parent_id(0)?) };
            if let Ok(now) = src.fetch_record(branch)
                && now != parent
            {
                let at = now.map_or("gone".to_string(), |c| format!("at {}", short(&c.to_string())));
                return Ok(Pushed::Rejected(format!("{name}: {summary}: another writer moved it ({at})")));
            }
        }
        if flag != "!" && out.status.success() {
            return Ok(Pushed::Done);
        }
        bail!("{what}: {summary}; {}", git_words(&out.stderr));
    }
    bail!("{what}: {}", git_words(&out.stderr))
}

/// The flag and summary `git push --porcelain` gives the ref `name` (its lines
/// `<flag>\t<from>:<to>\t<summary>`), if it names it.
fn pushed_ref<'a>(porcelain: &'a str, name: &str) -> Option<(&'a str, &'a str)> {
    let line = porcelain.lines().find(|l| l.split('\t').nth(1).is_some_and(|r| r.ends_with(&format!(":{name}"))))?;
    let mut f = line.split('\t');
    Some((f.next().unwrap_or_default(), f.nth(1).unwrap_or_default()))
}

/// Put `oid` on `refs/heads/<branch>` if the branch is still where it was read (`expected`;
/// `None`: absent), whichever way that moves it: a push with a lease (`--force-with-lease`) to a
/// remote, a compare-and-swap in a local repository. For a branch of specd's own that a newer
/// commit replaces (a proposal); another writer that moved it first gets [`Pushed::Rejected`].
pub fn push_replacing(src: &GitSource, oid: Oid, branch: &str, expected: Option<Oid>) -> Result<Pushed> {
    let name = format!("refs/heads/{branch}");
    if !git2::Reference::is_valid_name(&name) {
        bail!("the branch {branch:?} is not a usable branch name");
    }
    if !src.is_remote() {
        return swap(src.repository(), &name, oid, expected);
    }
    let what = format!("pushing {} to branch {branch} of {}", short(&oid.to_string()), src.cfg.repo);
    let lease = format!("--force-with-lease={name}:{}", expected.map(|e| e.to_string()).unwrap_or_default());
    let mut cmd = src.transfer()?;
    cmd.args(["push", "--porcelain", &lease, "--", &src.url(), &format!("{oid}:{name}")]);
    let out = src.run_transfer(cmd, &what)?;
    let porcelain = String::from_utf8_lossy(&out.stdout);
    if let Some((flag, summary)) = pushed_ref(&porcelain, &name) {
        if flag == "!" && summary.starts_with("[rejected]") {
            return Ok(Pushed::Rejected(format!("{name}: {summary}")));
        }
        if flag != "!" && out.status.success() {
            return Ok(Pushed::Done);
        }
        bail!("{what}: {summary}; {}", git_words(&out.stderr));
    }
    bail!("{what}: {}", git_words(&out.stderr))
}

/// Move `name` to `oid` only if it points at `parent` (or, with no parent, does not exist).
fn swap(repo: &git2::Repository, name: &str, oid: Oid, parent: Option<Oid>) -> Result<Pushed> {
    let log = "specd";
    let done = match parent {
        None => repo.reference(name, oid, false, log),
        Some(p) => repo.reference_matching(name, oid, true, p, log),
    };
    match done {
        Ok(_) => Ok(Pushed::Done),
        Err(e) if matches!(e.code(), ErrorCode::Exists | ErrorCode::Modified | ErrorCode::NotFound) => {
            let now = match repo.refname_to_id(name) {
                Ok(at) => format!("at {}", short(&at.to_string())),
                Err(_) => "gone".to_string(),
            };
            let was = parent.map_or("absent".to_string(), |p| format!("at {}", short(&p.to_string())));
            Ok(Pushed::Rejected(format!("{name} moved: it is {now}, and the record was made on it {was}")))
        }
        Err(e) => Err(e).with_context(|| format!("moving {name} in {}", repo.path().display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_author_is_a_name_and_an_email() {
        assert_eq!(identity("specd promote <ops@example.com>").unwrap(), ("specd promote", "ops@example.com"));
        for bad in ["ops", "<ops@example.com>", "ops <>", "ops <a>b>", "ops ops@example.com>"] {
            let e = identity(bad).unwrap_err().to_string();
            assert!(e.contains("is not `Name <email>`"), "{bad}: {e}");
        }
    }
}
