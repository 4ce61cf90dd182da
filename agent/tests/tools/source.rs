//! The git source against real repositories made with git: specs come from commits only, the
//! branch may not go backwards, signatures are checked, bad commits deploy nothing.

use std::path::{Path, PathBuf};
use std::process::Command;

use specd::parts::source::{GitSource, SourceConfig, Verify, evaluate};
use specd_e2e::{git, ssh_key};

use crate::SPEC;

fn spec(steps: u32) -> String {
    SPEC.replace("STEPS", &steps.to_string()).replace("DRAFT", &(steps + 1).to_string())
}

fn repo() -> (tempfile::TempDir, PathBuf) {
    let d = tempfile::tempdir().unwrap();
    let r = d.path().join("config");
    std::fs::create_dir_all(r.join("specs")).unwrap();
    git(&r, &["init", "-q"]);
    (d, r)
}

fn commit(r: &Path, steps: u32, msg: &str) -> String {
    std::fs::write(r.join("specs/qwen.yaml"), spec(steps)).unwrap();
    git(r, &["add", "-A"]);
    git(r, &["commit", "-q", "-m", msg]);
    git(r, &["rev-parse", "HEAD"])
}

fn cfg(repo: &str) -> SourceConfig {
    SourceConfig::new(repo)
}

fn steps_of(e: &specd::parts::source::Evaluation) -> Vec<u32> {
    e.desired.iter().map(|d| d.spec.speculative.as_ref().unwrap().num_steps.unwrap()).collect()
}

#[test]
fn specs_come_from_the_commit_not_the_working_tree() {
    let (_d, r) = repo();
    let c1 = commit(&r, 5, "steps 5");
    std::fs::write(r.join("specs/qwen.yaml"), spec(10)).unwrap(); // uncommitted
    let s = GitSource::open(cfg(r.to_str().unwrap()), Path::new("/nonexistent")).unwrap();
    let e = evaluate(&s, None, false, "gpu-01");
    assert_eq!(e.error, None);
    assert_eq!(e.head.as_deref(), Some(c1.as_str()));
    assert_eq!(steps_of(&e), vec![5]);
    let src = e.desired[0].source.clone().unwrap();
    assert_eq!(src.to_string(), format!("commit {} (specs/qwen.yaml)", &c1[..12]));
}

#[test]
fn a_bad_commit_deploys_nothing_and_names_file_and_line() {
    let (_d, r) = repo();
    commit(&r, 5, "good");
    std::fs::write(r.join("specs/qwen.yaml"), spec(5).replace("num_draft_tokens: 6", "num_draft_tokens: 9")).unwrap();
    std::fs::write(r.join("specs/other.yaml"), spec(3).replace("qwen", "other")).unwrap();
    git(&r, &["add", "-A"]);
    git(&r, &["commit", "-q", "-m", "bad"]);
    let head = git(&r, &["rev-parse", "HEAD"]);
    let s = GitSource::open(cfg(r.to_str().unwrap()), Path::new("/nonexistent")).unwrap();
    let e = evaluate(&s, None, false, "gpu-01");
    let err = e.error.expect("refused");
    assert!(e.desired.is_empty(), "a bad commit hands out nothing, not even its good specs");
    assert!(err.contains(&format!("specs/qwen.yaml@{}:9:", &head[..12])), "{err}");
    assert!(err.contains("spec.speculative.num_draft_tokens"), "{err}");
}

#[test]
fn a_sweep_kept_beside_the_specs_is_not_deployed() {
    let (_d, r) = repo();
    std::fs::write(
        r.join("specs/steps.yaml"),
        "apiVersion: specd/v1\nkind: Sweep\nmetadata: {name: steps}\nspec:\n  base: qwen.yaml\n  matrix: {speculative.num_steps: [1, 2]}\n  load: {concurrency: [1], requests: 4}\n",
    )
    .unwrap();
    commit(&r, 5, "a spec and a sweep over it");
    let s = GitSource::open(cfg(r.to_str().unwrap()), Path::new("/nonexistent")).unwrap();
    let e = evaluate(&s, None, false, "gpu-01");
    assert_eq!(e.error, None, "the sweep is not read as a broken spec");
    assert_eq!(steps_of(&e), vec![5], "only the spec deploys");
}

#[test]
fn a_missing_path_is_an_error() {
    let (_d, r) = repo();
    commit(&r, 5, "x");
    let mut c = cfg(r.to_str().unwrap());
    c.path = "nope".into();
    let s = GitSource::open(c, Path::new("/nonexistent")).unwrap();
    let e = evaluate(&s, None, false, "h");
    assert!(e.error.unwrap().contains("nope does not exist in commit"));
}

#[test]
fn the_branch_may_not_go_backwards_unless_allowed() {
    let (_d, r) = repo();
    let c1 = commit(&r, 5, "one");
    let c2 = commit(&r, 10, "two");
    let s = GitSource::open(cfg(r.to_str().unwrap()), Path::new("/nonexistent")).unwrap();
    // Forward from c1 to c2: fine.
    assert_eq!(evaluate(&s, Some(&c1), false, "h").error, None);
    // Reset back to c1 after c2 was deployed: refused, then allowed with allow_rewind.
    git(&r, &["reset", "-q", "--hard", &c1]);
    let e = evaluate(&s, Some(&c2), false, "h");
    let err = e.error.unwrap();
    assert!(err.contains("refusing to go backwards"), "{err}");
    assert!(err.contains(&c2[..12]), "{err}");
    assert_eq!(steps_of(&evaluate(&s, Some(&c2), true, "h")), vec![5]);
    // Unrelated history (a force-pushed new root) is refused too.
    git(&r, &["checkout", "-q", "--orphan", "fresh"]);
    commit(&r, 7, "new root");
    git(&r, &["branch", "-q", "-M", "fresh", "main"]);
    assert!(evaluate(&s, Some(&c2), false, "h").error.unwrap().contains("refusing to go backwards"));
}

#[test]
fn host_overlays_apply_per_hostname() {
    let (_d, r) = repo();
    std::fs::write(
        r.join("specs/qwen.yaml"),
        spec(10) + "hosts:\n  gpu-02:\n    speculative: {num_steps: 5, num_draft_tokens: 6}\n",
    )
    .unwrap();
    git(&r, &["add", "-A"]);
    git(&r, &["commit", "-q", "-m", "overlay"]);
    let s = GitSource::open(cfg(r.to_str().unwrap()), Path::new("/nonexistent")).unwrap();
    assert_eq!(steps_of(&evaluate(&s, None, false, "gpu-01")), vec![10]);
    assert_eq!(steps_of(&evaluate(&s, None, false, "gpu-02")), vec![5]);
}

#[test]
fn a_remote_is_cloned_into_the_cache_and_fetched() {
    let (d, r) = repo();
    commit(&r, 5, "one");
    let bare = d.path().join("bare.git");
    git(d.path(), &["clone", "-q", "--bare", r.to_str().unwrap(), bare.to_str().unwrap()]);
    let url = format!("file://{}", bare.display());
    let cache = d.path().join("cache");
    let s = GitSource::open(cfg(&url), &cache).unwrap();
    assert!(s.is_remote());
    assert_eq!(steps_of(&evaluate(&s, None, false, "h")), vec![5]);
    let c2 = commit(&r, 10, "two");
    git(&r, &["push", "-q", bare.to_str().unwrap(), "main"]);
    let e = evaluate(&s, None, false, "h");
    assert_eq!(e.head.as_deref(), Some(c2.as_str()));
    assert_eq!(steps_of(&e), vec![10]);
}

/// When the cache's `FETCH_HEAD` was last written: every `git fetch` writes it, a look at the
/// remote's refs does not.
fn fetched_at(cache: &Path) -> std::time::SystemTime {
    std::fs::metadata(cache.join("FETCH_HEAD")).and_then(|m| m.modified()).unwrap()
}

#[test]
fn a_poll_that_finds_nothing_new_fetches_nothing_and_a_moved_ref_is_fetched() {
    let (d, r) = repo();
    commit(&r, 5, "one");
    git(&r, &["branch", "specd-promotions"]);
    let bare = d.path().join("bare.git");
    git(d.path(), &["clone", "-q", "--bare", r.to_str().unwrap(), bare.to_str().unwrap()]);
    let cache = d.path().join("cache");
    let s = GitSource::open(cfg(&format!("file://{}", bare.display())), &cache).unwrap();
    s.fetch().unwrap();
    let record = s.fetch_record("specd-promotions").unwrap();
    let first = fetched_at(&cache);
    // Nothing moved: one look at the remote's refs (an `ls-remote`), no fetch.
    s.fetch().unwrap();
    assert_eq!(s.fetch_record("specd-promotions").unwrap(), record);
    assert_eq!(fetched_at(&cache), first, "a poll that found nothing new fetched");
    // The branch moved: it is fetched; the record branch, which did not, is not.
    let c2 = commit(&r, 10, "two");
    git(&r, &["push", "-q", bare.to_str().unwrap(), "main"]);
    s.fetch().unwrap();
    assert_eq!(s.head().unwrap().to_string(), c2);
    let second = fetched_at(&cache);
    assert_ne!(second, first);
    assert_eq!(s.fetch_record("specd-promotions").unwrap(), record);
    assert_eq!(fetched_at(&cache), second);
    // The record branch gone from the remote: none, without a fetch.
    git(d.path(), &["--git-dir", bare.to_str().unwrap(), "branch", "-D", "specd-promotions"]);
    s.fetch().unwrap();
    assert_eq!(s.fetch_record("specd-promotions").unwrap(), None);
}

fn signed_commit(r: &Path, key: &Path, steps: u32) -> String {
    std::fs::write(r.join("specs/qwen.yaml"), spec(steps)).unwrap();
    git(r, &["add", "-A"]);
    git(
        r,
        &[
            "-c",
            "gpg.format=ssh",
            "-c",
            &format!("user.signingkey={}", key.display()),
            "commit",
            "-q",
            "-S",
            "-m",
            "signed",
        ],
    );
    git(r, &["rev-parse", "HEAD"])
}

#[test]
fn ssh_signatures_gate_deploys() {
    let (d, r) = repo();
    let good = ssh_key(d.path(), "good");
    let evil = ssh_key(d.path(), "evil");
    let allowed = d.path().join("allowed_signers");
    let pubkey = std::fs::read_to_string(good.with_extension("pub")).unwrap();
    std::fs::write(&allowed, format!("ops@example.com namespaces=\"git\" {pubkey}")).unwrap();
    let mut c = cfg(r.to_str().unwrap());
    c.verify = Some(Verify::Ssh { allowed_signers: allowed });
    commit(&r, 5, "unsigned");
    let s = GitSource::open(c, Path::new("/nonexistent")).unwrap();
    assert!(evaluate(&s, None, false, "h").error.unwrap().contains("is not signed"));
    signed_commit(&r, &evil, 6);
    assert!(evaluate(&s, None, false, "h").error.unwrap().contains("not in"));
    signed_commit(&r, &good, 7);
    let e = evaluate(&s, None, false, "h");
    assert_eq!(e.error, None);
    assert_eq!(steps_of(&e), vec![7]);
}

#[test]
fn gpg_signatures_gate_deploys() {
    let (d, r) = repo();
    let g = specd_e2e::Gpg::new(d.path());
    let home = g.home.clone();
    let gpg = |args: &[&str]| g.run(args);
    gpg(&["--quick-gen-key", "ops <ops@example.com>", "ed25519", "sign", "never"]);
    gpg(&["--quick-gen-key", "evil <evil@example.com>", "ed25519", "sign", "never"]);
    let keyring = d.path().join("trusted.gpg");
    std::fs::write(&keyring, gpg(&["--export", "ops@example.com"])).unwrap();
    let mut c = cfg(r.to_str().unwrap());
    c.verify = Some(Verify::Gpg { keyring });
    let sign = |who: &str, steps: u32| {
        std::fs::write(r.join("specs/qwen.yaml"), spec(steps)).unwrap();
        git(&r, &["add", "-A"]);
        let out = Command::new("git")
            .env("GNUPGHOME", &home)
            .args([
                "-c",
                "user.name=ops",
                "-c",
                "user.email=ops@example.com",
                "-c",
                &format!("user.signingkey={who}"),
                "commit",
                "-q",
                "-S",
                "-m",
                "gpg",
            ])
            .current_dir(&r)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    };
    sign("evil@example.com", 4);
    let s = GitSource::open(c, Path::new("/nonexistent")).unwrap();
    assert!(evaluate(&s, None, false, "h").error.unwrap().contains("does not verify"));
    sign("ops@example.com", 8);
    let e = evaluate(&s, None, false, "h");
    assert_eq!(e.error, None);
    assert_eq!(steps_of(&e), vec![8]);
}

/// Remotes are fetched by the `git` command, which never waits for a person: an ssh remote that
/// cannot be reached, and a token file that is missing, are errors that name the remote or file.
#[test]
fn a_remote_that_cannot_be_fetched_is_an_error_naming_it() {
    let d = tempfile::tempdir().unwrap();
    let key = ssh_key(d.path(), "deploy");
    let url = "ssh://git@127.0.0.1:1/config.git";
    let s = GitSource::open(SourceConfig { ssh_key_file: Some(key), ..cfg(url) }, &d.path().join("cache")).unwrap();
    let e = format!("{:#}", s.fetch().unwrap_err());
    assert!(e.starts_with(&format!("fetching branch main from {url}: ")), "{e}");
    assert!(e.contains("Connection refused"), "{e}");

    let missing = d.path().join("token");
    let s = GitSource::open(
        SourceConfig { token_file: Some(missing.clone()), ..cfg("https://127.0.0.1:1/config.git") },
        &d.path().join("cache2"),
    )
    .unwrap();
    let e = format!("{:#}", s.fetch().unwrap_err());
    assert!(e.starts_with(&format!("reading the token file {}", missing.display())), "{e}");
}

/// git keeps a symbolic link as a blob holding its target; read as a spec it was refused as YAML
/// ("expected mapping start"). It is refused as what it is, with the file and the target named,
/// in a directory of specs and as the configured path itself.
#[test]
fn a_spec_that_is_a_symbolic_link_is_refused_naming_it_and_its_target() {
    let (_d, r) = repo();
    commit(&r, 5, "good");
    std::fs::create_dir_all(r.join("elsewhere")).unwrap();
    std::fs::write(r.join("elsewhere/other.yaml"), spec(3).replace("qwen", "other")).unwrap();
    std::os::unix::fs::symlink("../../../outside/x.yaml", r.join("specs/out.yaml")).unwrap();
    git(&r, &["add", "-A"]);
    git(&r, &["commit", "-q", "-m", "a link out of the repository"]);
    let head = git(&r, &["rev-parse", "HEAD"]);
    let want = |p: &str, to: &str| {
        format!("{p}@{}: is a symbolic link (to {to}); specd reads only regular files from the repository", &head[..12])
    };
    let s = GitSource::open(cfg(r.to_str().unwrap()), Path::new("/nonexistent")).unwrap();
    let e = evaluate(&s, None, false, "gpu-01");
    let err = e.error.expect("refused");
    assert!(e.desired.is_empty(), "the commit deploys nothing");
    assert!(err.contains(&want("specs/out.yaml", "../../../outside/x.yaml")), "{err}");
    assert!(!err.contains("mapping"), "{err}");

    // A link inside the repository is refused too, and so is a configured path that is one.
    std::fs::remove_file(r.join("specs/out.yaml")).unwrap();
    std::os::unix::fs::symlink("../elsewhere/other.yaml", r.join("specs/in.yaml")).unwrap();
    git(&r, &["add", "-A"]);
    git(&r, &["commit", "-q", "-m", "a link inside it"]);
    let head = git(&r, &["rev-parse", "HEAD"]);
    let want = |p: &str, to: &str| format!("{p}@{}: is a symbolic link (to {to});", &head[..12]);
    let e = evaluate(&s, None, false, "gpu-01");
    assert!(
        e.error.as_deref().unwrap_or_default().contains(&want("specs/in.yaml", "../elsewhere/other.yaml")),
        "{:?}",
        e.error
    );
    let mut c = cfg(r.to_str().unwrap());
    c.path = "specs/in.yaml".into();
    let s = GitSource::open(c, Path::new("/nonexistent")).unwrap();
    let e = evaluate(&s, None, false, "gpu-01");
    assert!(
        e.error.as_deref().unwrap_or_default().contains(&want("specs/in.yaml", "../elsewhere/other.yaml")),
        "{:?}",
        e.error
    );
    assert!(e.desired.is_empty());
}

const FLEET: &str = "apiVersion: specd/v1\nkind: Fleet\nmetadata: {name: gpus}\nspec:\n  waves:\n    - {name: canary, hosts: [gpu-01], bake: 10m}\n    - {name: rest, hosts: ['gpu-*']}\n";

/// The fleet file is `fleet.yaml` in the directory of the specs, whichever way `path` names
/// them: a directory, the repository's root, or one spec file.
#[test]
fn the_fleet_file_is_found_beside_the_specs() {
    let (_d, r) = repo();
    let c1 = commit(&r, 5, "no fleet yet");
    let at = |path: &str, oid: &str| {
        let s = GitSource::open(SourceConfig { path: path.into(), ..cfg(r.to_str().unwrap()) }, Path::new("/none"))
            .unwrap();
        s.fleet_file(git2::Oid::from_str(oid).unwrap()).unwrap().map(|f| (f.path, f.text))
    };
    assert_eq!(at("specs", &c1), None, "no fleet file: none");
    std::fs::write(r.join("specs/fleet.yaml"), FLEET).unwrap();
    let c2 = commit(&r, 5, "a fleet beside the specs");
    assert_eq!(at("specs", &c2), Some(("specs/fleet.yaml".into(), FLEET.into())));
    assert_eq!(at("specs/", &c2), Some(("specs/fleet.yaml".into(), FLEET.into())));
    assert_eq!(at("specs/qwen.yaml", &c2), Some(("specs/fleet.yaml".into(), FLEET.into())));
    assert_eq!(at(".", &c2), None, "the root's own fleet file, and there is none at the root");
    // At the root, beside specs kept there.
    git(&r, &["mv", "specs/fleet.yaml", "fleet.yaml"]);
    git(&r, &["mv", "specs/qwen.yaml", "qwen.yaml"]);
    git(&r, &["commit", "-q", "-m", "specs at the root"]);
    let c3 = git(&r, &["rev-parse", "HEAD"]);
    for path in ["", ".", "qwen.yaml"] {
        assert_eq!(at(path, &c3), Some(("fleet.yaml".into(), FLEET.into())), "path {path:?}");
    }
    let s = GitSource::open(SourceConfig { path: "".into(), ..cfg(r.to_str().unwrap()) }, Path::new("/none")).unwrap();
    let specs = s.read_specs(git2::Oid::from_str(&c3).unwrap()).unwrap();
    let paths: Vec<_> = specs.iter().map(|f| f.path.as_str()).collect();
    assert_eq!(paths, ["qwen.yaml"], "the fleet file is not a unit");
}

/// A fleet file is refused as a spec would be (a symbolic link, not UTF-8), and a `fleet.yaml`
/// that is not a fleet document is an error naming it, not a fleet-less repository.
#[test]
fn a_fleet_file_that_is_a_link_or_no_fleet_is_refused_naming_it() {
    let (_d, r) = repo();
    std::fs::write(r.join("fleet-real.yaml"), FLEET).unwrap();
    std::os::unix::fs::symlink("../fleet-real.yaml", r.join("specs/fleet.yaml")).unwrap();
    let c1 = commit(&r, 5, "a linked fleet file");
    let s = GitSource::open(cfg(r.to_str().unwrap()), Path::new("/none")).unwrap();
    let err = |c: &str| format!("{:#}", s.fleet_file(git2::Oid::from_str(c).unwrap()).unwrap_err());
    let e = err(&c1);
    assert!(
        e.starts_with(&format!("specs/fleet.yaml@{}: is a symbolic link (to ../fleet-real.yaml)", &c1[..12])),
        "{e}"
    );
    std::fs::remove_file(r.join("specs/fleet.yaml")).unwrap();
    std::fs::write(r.join("specs/fleet.yaml"), spec(3).replace("qwen", "other")).unwrap();
    let c2 = commit(&r, 5, "a spec named fleet.yaml");
    let e = err(&c2);
    assert!(e.starts_with(&format!("specs/fleet.yaml@{}: ", &c2[..12])), "{e}");
    assert!(e.contains("its kind is InferenceService, not Fleet"), "{e}");
    std::fs::write(r.join("specs/fleet.yaml"), b"kind: Fleet\nname: \xff\n").unwrap();
    let c3 = commit(&r, 5, "not UTF-8");
    assert_eq!(err(&c3), "specs/fleet.yaml is not UTF-8 text");
}

/// Commit `text` as the record on `branch` of the author's repository (a root commit the first
/// time) and push it to `bare`; returns the commit.
fn push_record_by_hand(r: &Path, bare: &Path, text: &str) -> String {
    let blob = {
        std::fs::write(r.join("record.tmp"), text).unwrap();
        git(r, &["hash-object", "-w", "record.tmp"])
    };
    let tree = {
        let out = Command::new("git")
            .args(["mktree"])
            .current_dir(r)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .and_then(|mut c| {
                use std::io::Write;
                c.stdin.take().unwrap().write_all(format!("100644 blob {blob}\tpromotions.yaml\n").as_bytes())?;
                c.wait_with_output()
            })
            .unwrap();
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    };
    let parent = Command::new("git").args(["rev-parse", "--verify", "-q", "specd-promotions"]).current_dir(r).output();
    let parent = String::from_utf8(parent.unwrap().stdout).unwrap().trim().to_string();
    let mut args = vec!["commit-tree", &tree, "-m", "record"];
    if !parent.is_empty() {
        args.extend(["-p", &parent]);
    }
    let c = git(r, &args);
    git(r, &["update-ref", "refs/heads/specd-promotions", &c]);
    git(r, &["push", "-q", bare.to_str().unwrap(), "specd-promotions"]);
    c
}

/// The record branch of a remote is fetched beside the followed one: absent, it is `None`;
/// each push is seen at the next fetch; deleted, it is `None` again. A local repository's
/// branch is read as it is.
#[test]
fn the_record_branch_is_fetched_and_may_be_missing() {
    let (d, r) = repo();
    commit(&r, 5, "one");
    let bare = d.path().join("bare.git");
    git(d.path(), &["clone", "-q", "--bare", r.to_str().unwrap(), bare.to_str().unwrap()]);
    let s = GitSource::open(cfg(&format!("file://{}", bare.display())), &d.path().join("cache")).unwrap();
    let local = GitSource::open(cfg(bare.to_str().unwrap()), Path::new("/none")).unwrap();
    assert_eq!(s.fetch_record("specd-promotions").unwrap(), None);
    assert_eq!(local.fetch_record("specd-promotions").unwrap(), None);

    let first = push_record_by_hand(&r, &bare, "target: a\n");
    let head = s.fetch_record("specd-promotions").unwrap().expect("the record");
    assert_eq!(head.to_string(), first);
    assert_eq!(s.read_record(head).unwrap(), "target: a\n");
    assert_eq!(local.fetch_record("specd-promotions").unwrap().map(|o| o.to_string()), Some(first.clone()));

    let second = push_record_by_hand(&r, &bare, "target: b\n");
    let head2 = s.fetch_record("specd-promotions").unwrap().unwrap();
    assert_eq!(head2.to_string(), second);
    assert_eq!(s.read_record(head2).unwrap(), "target: b\n");
    assert!(s.descends_from(head2, head).unwrap() && !s.descends_from(head, head2).unwrap());
    s.fetch().unwrap();
    assert_eq!(s.head().unwrap().to_string(), git(&r, &["rev-parse", "main"]), "the followed branch is its own");

    git(&bare, &["branch", "-q", "-D", "specd-promotions"]);
    // A poll: the look at the remote's refs (the followed branch's fetch), then the record's.
    s.fetch().unwrap();
    assert_eq!(s.fetch_record("specd-promotions").unwrap(), None, "a deleted record is none");
    let e = format!("{:#}", s.fetch_record("bad:name").unwrap_err());
    assert!(e.contains("\"bad:name\" is not a usable branch name"), "{e}");
    // A commit without the file is named.
    let e = format!("{:#}", s.read_record(git2::Oid::from_str(&git(&r, &["rev-parse", "main"])).unwrap()).unwrap_err());
    assert!(e.starts_with("promotions.yaml does not exist in commit "), "{e}");
}
