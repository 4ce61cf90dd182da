//! The promotion record written as the promoter writes it, against real repositories made with
//! git: a remote (a bare repository by a file:// URL, fetched into a cache) and a local
//! repository (the same bare repository by its path). Each record is a commit holding only
//! `promotions.yaml`; pushes are fast-forwards, and of two promoters on the same record, one
//! wins and the other is told so; a signed record verifies as agents verify.

use std::path::{Path, PathBuf};
use std::process::Command;

use git2::Oid;
use specd::parts::fleet::{Pushed, Signing, commit_record, push_record};
use specd::parts::source::{GitSource, SourceConfig, Verify};
use specd_e2e::{git, ssh_key};

const BRANCH: &str = "specd-promotions";
const AUTHOR: &str = "specd promote <promoter@example.com>";

fn cfg(repo: &str) -> SourceConfig {
    SourceConfig::new(repo)
}

/// A bare repository with one commit on `main`, as the remote every host follows.
fn remote() -> (tempfile::TempDir, PathBuf) {
    let d = tempfile::tempdir().unwrap();
    let work = d.path().join("work");
    std::fs::create_dir_all(work.join("specs")).unwrap();
    git(&work, &["init", "-q"]);
    std::fs::write(work.join("specs/fleet.yaml"), "apiVersion: specd/v1\nkind: Fleet\n").unwrap();
    git(&work, &["add", "-A"]);
    git(&work, &["commit", "-q", "-m", "the fleet"]);
    let bare = d.path().join("config.git");
    git(d.path(), &["clone", "-q", "--bare", work.to_str().unwrap(), bare.to_str().unwrap()]);
    (d, bare)
}

/// A promoter's source: the remote through a cache of its own (`cache` names it), or the
/// repository itself by its path.
fn promoter(d: &Path, bare: &Path, remote: bool, cache: &str) -> GitSource {
    if remote {
        GitSource::open(cfg(&format!("file://{}", bare.display())), &d.join(cache)).unwrap()
    } else {
        GitSource::open(cfg(bare.to_str().unwrap()), Path::new("/none")).unwrap()
    }
}

/// Where the remote's record branch points, as git there says.
fn remote_head(bare: &Path) -> String {
    git(bare, &["rev-parse", &format!("refs/heads/{BRANCH}")])
}

fn parents(bare: &Path, c: Oid) -> Vec<String> {
    git(bare, &["rev-list", "--parents", "-n", "1", &c.to_string()]).split(' ').skip(1).map(str::to_string).collect()
}

/// The first record is a root commit, the next one is on top of it; the remote's branch
/// follows; each reads back as written, the tree holding only the record.
#[test]
fn records_are_committed_and_pushed_in_a_line() {
    for remote_repo in [true, false] {
        let (d, bare) = remote();
        let s = promoter(d.path(), &bare, remote_repo, "cache");
        assert_eq!(s.fetch_record(BRANCH).unwrap(), None);
        let first = commit_record(&s, None, "target: a\n", "promote a: canary", AUTHOR, None).unwrap();
        assert_eq!(push_record(&s, first, BRANCH).unwrap(), Pushed::Done);
        assert_eq!(remote_head(&bare), first.to_string());
        assert_eq!(parents(&bare, first), Vec::<String>::new(), "the first record is a root commit");
        assert_eq!(git(&bare, &["ls-tree", "--name-only", &first.to_string()]), "promotions.yaml");
        assert_eq!(
            git(&bare, &["log", "-1", "--format=%an <%ae>%n%B", &first.to_string()]),
            format!("{AUTHOR}\npromote a: canary")
        );

        let head = s.fetch_record(BRANCH).unwrap();
        assert_eq!(head, Some(first));
        let second = commit_record(&s, head, "target: b\n", "promote b", AUTHOR, None).unwrap();
        assert_eq!(push_record(&s, second, BRANCH).unwrap(), Pushed::Done);
        assert_eq!(remote_head(&bare), second.to_string());
        assert_eq!(parents(&bare, second), vec![first.to_string()]);
        let head = s.fetch_record(BRANCH).unwrap().unwrap();
        assert_eq!((head, s.read_record(head).unwrap()), (second, "target: b\n".to_string()), "remote: {remote_repo}");
        assert_eq!(git(&bare, &["rev-parse", "main"]), git(&bare, &["rev-list", "-1", "main"]), "main untouched");
    }
}

/// Two promoters read the same record and both write the next one: the first push wins, the
/// second is told it lost (not an error), and the remote keeps the winner. Re-reading, the
/// loser writes on top of the winner and succeeds. Also for two first records at once.
#[test]
fn of_two_promoters_on_the_same_record_one_wins() {
    for remote_repo in [true, false] {
        let (d, bare) = remote();
        let a = promoter(d.path(), &bare, remote_repo, "cache-a");
        let b = promoter(d.path(), &bare, remote_repo, "cache-b");
        let a0 = commit_record(&a, None, "by: a\n", "first", AUTHOR, None).unwrap();
        let b0 = commit_record(&b, None, "by: b\n", "first", AUTHOR, None).unwrap();
        assert_eq!(push_record(&a, a0, BRANCH).unwrap(), Pushed::Done);
        let Pushed::Rejected(why) = push_record(&b, b0, BRANCH).unwrap() else { panic!("two first records") };
        assert!(why.starts_with("refs/heads/specd-promotions"), "{why}");
        assert_eq!(remote_head(&bare), a0.to_string());

        let base = b.fetch_record(BRANCH).unwrap();
        assert_eq!(base, Some(a0));
        assert_eq!(a.fetch_record(BRANCH).unwrap(), base);
        let a1 = commit_record(&a, base, "by: a, again\n", "next", AUTHOR, None).unwrap();
        let b1 = commit_record(&b, base, "by: b\n", "next", AUTHOR, None).unwrap();
        assert_eq!(push_record(&a, a1, BRANCH).unwrap(), Pushed::Done);
        match push_record(&b, b1, BRANCH).unwrap() {
            Pushed::Rejected(why) if remote_repo => assert!(why.contains("[rejected]"), "{why}"),
            Pushed::Rejected(why) => assert!(why.contains("moved"), "{why}"),
            Pushed::Done => panic!("the second writer on the same record won too"),
        }
        assert_eq!(remote_head(&bare), a1.to_string(), "the winner's record stands");

        let base = b.fetch_record(BRANCH).unwrap();
        assert_eq!(base, Some(a1));
        assert_eq!(b.read_record(a1).unwrap(), "by: a, again\n");
        let b2 = commit_record(&b, base, "by: b, after a\n", "next", AUTHOR, None).unwrap();
        assert_eq!(push_record(&b, b2, BRANCH).unwrap(), Pushed::Done);
        assert_eq!(parents(&bare, b2), vec![a1.to_string()]);
        if !remote_repo {
            // A local branch is moved only from the record's parent: deleted meanwhile, it
            // stays deleted.
            git(&bare, &["branch", "-q", "-D", BRANCH]);
            let b3 = commit_record(&b, Some(b2), "by: b, later\n", "next", AUTHOR, None).unwrap();
            let Pushed::Rejected(why) = push_record(&b, b3, BRANCH).unwrap() else { panic!("recreated") };
            assert!(why.contains("it is gone"), "{why}");
        }
    }
}

/// A push that fails for another reason than a lost race is an error naming the remote.
#[test]
fn a_push_that_cannot_reach_the_remote_is_an_error() {
    let (d, bare) = remote();
    let s = promoter(d.path(), &bare, true, "cache");
    let c = commit_record(&s, None, "x: 1\n", "first", AUTHOR, None).unwrap();
    std::fs::rename(&bare, d.path().join("moved.git")).unwrap();
    let e = format!("{:#}", push_record(&s, c, BRANCH).unwrap_err());
    let want = format!("pushing the record {} to branch {BRANCH} of file://{}: ", &c.to_string()[..12], bare.display());
    assert!(e.starts_with(&want), "{e}");
}

/// A record signed with the promoter's SSH key verifies as an agent verifies the followed
/// branch (its allowed signers); an unsigned record, or one signed by another key, does not.
#[test]
fn a_record_signed_with_ssh_verifies_as_agents_verify() {
    let (d, bare) = remote();
    let key = ssh_key(d.path(), "promoter");
    let other = ssh_key(d.path(), "other");
    let allowed = d.path().join("allowed_signers");
    let pubkey = std::fs::read_to_string(key.with_extension("pub")).unwrap();
    std::fs::write(&allowed, format!("promoter@example.com namespaces=\"git\" {pubkey}")).unwrap();
    let s = promoter(d.path(), &bare, true, "cache");
    let signed = commit_record(&s, None, "x: 1\n", "signed", AUTHOR, Some(&Signing::Ssh { key: key.clone() })).unwrap();
    assert_eq!(push_record(&s, signed, BRANCH).unwrap(), Pushed::Done);

    let url = format!("file://{}", bare.display());
    let agent = GitSource::open(
        SourceConfig { verify: Some(Verify::Ssh { allowed_signers: allowed }), ..cfg(&url) },
        &d.path().join("agent"),
    )
    .unwrap();
    let head = agent.fetch_record(BRANCH).unwrap().unwrap();
    assert_eq!(head, signed);
    assert_eq!(agent.verify(head).unwrap().as_deref(), Some("promoter@example.com"));

    let unsigned = commit_record(&s, Some(signed), "x: 2\n", "unsigned", AUTHOR, None).unwrap();
    let by_other =
        commit_record(&s, Some(signed), "x: 3\n", "other", AUTHOR, Some(&Signing::Ssh { key: other })).unwrap();
    // Each pushed where the agent reads it (a branch of its own: they are not in a line).
    let agent_sees = |c: Oid, branch: &str| {
        assert_eq!(push_record(&s, c, branch).unwrap(), Pushed::Done);
        assert_eq!(agent.fetch_record(branch).unwrap(), Some(c));
        format!("{:#}", agent.verify(c).unwrap_err())
    };
    let e = agent_sees(unsigned, "unsigned");
    assert!(e.contains("is not signed"), "{e}");
    let e = agent_sees(by_other, "by-other");
    assert!(e.contains("is signed by a key that is not in"), "{e}");
}

/// A signing key git cannot use is an error naming the key, and nothing is committed.
#[test]
fn a_signing_key_that_does_not_sign_is_named() {
    let (d, bare) = remote();
    let s = promoter(d.path(), &bare, true, "cache");
    let missing = d.path().join("no-such-key");
    let e = format!(
        "{:#}",
        commit_record(&s, None, "x: 1\n", "m", AUTHOR, Some(&Signing::Ssh { key: missing.clone() })).unwrap_err()
    );
    assert!(
        e.starts_with(&format!("making the record's commit signed with the SSH key {}: ", missing.display())),
        "{e}"
    );
}

/// `specd promote` and `specd fleet halt` sign their records with an OpenPGP key of the
/// promoter's keyring (`GNUPGHOME`, as git's own signing uses it); an agent that verifies
/// against a keyring accepts both.
#[test]
fn the_promoter_signs_with_openpgp_and_agents_verify_it() {
    let d = tempfile::tempdir().unwrap();
    let g = specd_e2e::Gpg::new(d.path());
    let home = g.home.clone();
    let gpg = |args: &[&str]| g.run(args);
    gpg(&["--quick-gen-key", "promoter <promoter@example.com>", "ed25519", "sign", "never"]);
    let keyring = d.path().join("trusted.gpg");
    std::fs::write(&keyring, gpg(&["--export", "promoter@example.com"])).unwrap();
    let fingerprint = String::from_utf8(gpg(&["--with-colons", "--fingerprint", "promoter@example.com"]))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("fpr:").map(|f| f.trim_matches(':').to_string()))
        .unwrap();

    let work = d.path().join("config");
    std::fs::create_dir_all(work.join("specs")).unwrap();
    git(&work, &["init", "-q", "-b", "main"]);
    let fleet = "apiVersion: specd/v1\nkind: Fleet\nmetadata: {name: gpus}\nspec:\n  waves:\n    - {name: canary, hosts: [gpu-01], bake: 10m}\n";
    std::fs::write(work.join("specs/fleet.yaml"), fleet).unwrap();
    git(&work, &["add", "-A"]);
    git(&work, &["commit", "-q", "-m", "the fleet"]);
    let specd = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_specd"))
            .env("GNUPGHOME", &home)
            .arg("--state-dir")
            .arg(d.path().join("state"))
            .args(args)
            .args(["--config", "/nonexistent/agent.yaml", "--repo", work.to_str().unwrap(), "--path", "specs"])
            .args(["--prometheus", "http://127.0.0.1:1", "--sign-gpg-key", "promoter@example.com", "--author", AUTHOR])
            .output()
            .unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "specd {args:?}: {text}");
        text
    };
    // The first record needs no evidence: the head is adopted as released.
    let adopted = specd(&["promote"]);
    assert!(adopted.contains("adopt"), "{adopted}");
    specd(&["fleet", "halt", "--reason", "a maintenance window", "--by", "ops"]);

    let agent = GitSource::open(
        SourceConfig { verify: Some(Verify::Gpg { keyring }), ..cfg(work.to_str().unwrap()) },
        Path::new("/none"),
    )
    .unwrap();
    let head = agent.fetch_record(BRANCH).unwrap().unwrap();
    let first = Oid::from_str(&git(&work, &["rev-parse", &format!("{BRANCH}~1")])).unwrap();
    for c in [head, first] {
        assert_eq!(agent.verify(c).unwrap().as_deref(), Some(fingerprint.as_str()), "{c}");
    }
    assert!(git(&work, &["log", "-1", "--format=%B", BRANCH]).contains("halted by ops: a maintenance window"));
}

/// Two promoters pushing at the same moment: the remote takes the other's update between its
/// answer to this push and this push's own ref update (an `update` hook that moves the branch
/// first plays the other promoter). The loser is told it lost the race, not an error.
#[test]
fn a_push_that_loses_the_race_inside_the_remote_is_rejected_not_an_error() {
    let (d, bare) = remote();
    let a = promoter(d.path(), &bare, true, "a");
    let first = commit_record(&a, None, "x: 1\n", "first", AUTHOR, None).unwrap();
    assert_eq!(push_record(&a, first, BRANCH).unwrap(), Pushed::Done);
    // The other promoter's next record, already in the remote (on a branch of its own).
    let theirs = commit_record(&a, Some(first), "x: 2\n", "theirs", AUTHOR, None).unwrap();
    assert_eq!(push_record(&a, theirs, "theirs").unwrap(), Pushed::Done);
    let b = promoter(d.path(), &bare, true, "b");
    assert_eq!(b.fetch_record(BRANCH).unwrap(), Some(first));
    let hook = bare.join("hooks/update");
    std::fs::write(
        &hook,
        format!("#!/bin/sh\n[ \"$1\" = refs/heads/{BRANCH} ] && git update-ref refs/heads/{BRANCH} {theirs}\nexit 0\n"),
    )
    .unwrap();
    std::fs::set_permissions(&hook, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let mine = commit_record(&b, Some(first), "x: 3\n", "mine", AUTHOR, None).unwrap();
    match push_record(&b, mine, BRANCH).unwrap() {
        Pushed::Rejected(why) => {
            assert!(why.contains("[remote rejected]"), "{why}");
            assert!(
                why.ends_with(&format!("another writer moved it (at {})", specd_spec::short(&theirs.to_string()))),
                "{why}"
            );
        }
        Pushed::Done => panic!("a push whose ref update lost is not done"),
    }
    assert_eq!(remote_head(&bare), theirs.to_string());
}
