//! `specd tune --propose`'s commits against real repositories made with git: a remote (a bare
//! repository by a file:// URL, fetched into a cache) and a local repository (by its path). A
//! proposal is one commit on `specd-proposals/<unit>` whose parent is the followed branch's head
//! and whose tree is that head's with the unit's spec file edited; the followed branch never
//! moves; the same proposal is not made twice, a newer one replaces an older one; a signed one
//! verifies as agents verify.

use std::path::{Path, PathBuf};

use specd::parts::source::{GitSource, SourceConfig, Verify};
use specd::parts::tune::{BRANCH_PREFIX, ProposeOptions, propose};
use specd_e2e::{git, ssh_key};

const UNIT: &str = "smol.service";
const HOST: &str = "gpu-01";

fn spec(k: u32) -> String {
    format!(
        "apiVersion: specd/v1
kind: InferenceService
metadata: {{name: smol}}
spec:
  unit: {UNIT}
  engine: vllm
  model: /models/smol
  # the draft length, tuned by specd tune
  speculative: {{algorithm: ngram, num_steps: {k}, prompt_lookup_max: 3}}
"
    )
}

/// A bare repository whose `main` holds the unit's spec at `k` and another unit's spec.
fn remote(k: u32) -> (tempfile::TempDir, PathBuf, PathBuf) {
    let d = tempfile::tempdir().unwrap();
    let work = d.path().join("work");
    std::fs::create_dir_all(work.join("specs")).unwrap();
    git(&work, &["init", "-q", "-b", "main"]);
    std::fs::write(work.join("specs/smol.yaml"), spec(k)).unwrap();
    std::fs::write(work.join("specs/other.yaml"), spec(2).replace(UNIT, "other.service")).unwrap();
    git(&work, &["add", "-A"]);
    git(&work, &["commit", "-q", "-m", "smol"]);
    let bare = d.path().join("config.git");
    git(d.path(), &["clone", "-q", "--bare", work.to_str().unwrap(), bare.to_str().unwrap()]);
    (d, bare, work)
}

fn options(d: &Path, repo: &str, key: Option<PathBuf>) -> ProposeOptions {
    ProposeOptions {
        source: SourceConfig { branch: "main".into(), path: "specs".into(), ..SourceConfig::new(repo) },
        cache: d.join("propose"),
        host: HOST.into(),
        signing: key.map(|key| specd::parts::fleet::Signing::Ssh { key }),
        author: format!("specd tune <specd@{HOST}>"),
    }
}

#[test]
fn a_proposal_is_a_commit_on_its_own_branch_on_the_followed_head_and_main_never_moves() {
    for remote_repo in [true, false] {
        let (d, bare, work) = remote(6);
        let repo = if remote_repo { format!("file://{}", bare.display()) } else { bare.display().to_string() };
        let main = git(&bare, &["rev-parse", "refs/heads/main"]);
        let o = options(d.path(), &repo, None);
        let p = propose(&o, UNIT, 3, "tune: smol.service: speculative.num_steps 6 → 3\n\nthe evidence\n").unwrap();
        let branch = format!("{BRANCH_PREFIX}{UNIT}");
        assert_eq!(p.branch, branch);
        assert!(!p.already);
        assert_eq!(git(&bare, &["rev-parse", "refs/heads/main"]), main, "the followed branch moved");
        assert_eq!(git(&bare, &["rev-parse", &format!("refs/heads/{branch}")]), p.commit);
        assert_eq!(git(&bare, &["rev-parse", &format!("{}^", p.commit)]), main);
        // The tree: main's, with the one value changed where it stands.
        let changed = git(&bare, &["diff", "--name-only", &main, &p.commit]);
        assert_eq!(changed, "specs/smol.yaml");
        let file = git(&bare, &["show", &format!("{}:specs/smol.yaml", p.commit)]);
        assert_eq!(format!("{file}\n"), spec(3));
        assert!(p.change.contains("-  speculative: {algorithm: ngram, num_steps: 6"), "{}", p.change);
        assert_eq!(
            git(&bare, &["log", "-1", "--format=%B", &p.commit]),
            "tune: smol.service: speculative.num_steps 6 → 3\n\nthe evidence"
        );
        // Again: the same proposal is there already, nothing is written.
        let again = propose(&o, UNIT, 3, "another message").unwrap();
        assert!(again.already && again.commit == p.commit, "{again:?}");
        // Another length: it replaces the proposal not merged, still on main's head.
        let newer = propose(&o, UNIT, 4, "tune: 6 → 4").unwrap();
        assert_ne!(newer.commit, p.commit);
        assert_eq!(git(&bare, &["rev-parse", &format!("refs/heads/{branch}")]), newer.commit);
        assert_eq!(git(&bare, &["rev-parse", &format!("{}^", newer.commit)]), main);
        // main moves on (the proposal merged by hand, with a change of its own): the next one is
        // made on the new head.
        git(&work, &["pull", "-q", bare.to_str().unwrap(), &branch]);
        std::fs::write(work.join("README"), "x").unwrap();
        git(&work, &["add", "-A"]);
        git(&work, &["commit", "-q", "-m", "merged"]);
        git(&work, &["push", "-q", bare.to_str().unwrap(), "HEAD:main"]);
        let next = propose(&o, UNIT, 2, "tune: 4 → 2").unwrap();
        assert_eq!(
            git(&bare, &["rev-parse", &format!("{}^", next.commit)]),
            git(&bare, &["rev-parse", "refs/heads/main"])
        );
        let e = format!("{:#}", propose(&o, UNIT, 4, "m").unwrap_err());
        assert!(e.contains("has num_steps 4 already: nothing to propose"), "{e}");
        let e = format!("{:#}", propose(&o, "nope.service", 4, "m").unwrap_err());
        assert!(e.contains("no spec of nope.service"), "{e}");
    }
}

/// A proposal signed with an SSH key verifies as the agents verify the followed branch.
#[test]
fn a_signed_proposal_verifies_as_agents_verify() {
    let (d, bare, _) = remote(6);
    let key = ssh_key(d.path(), "tuner");
    let allowed = d.path().join("allowed_signers");
    let pubkey = std::fs::read_to_string(key.with_extension("pub")).unwrap();
    std::fs::write(&allowed, format!("tuner@example.com namespaces=\"git\" {pubkey}")).unwrap();
    let url = format!("file://{}", bare.display());
    let p = propose(&options(d.path(), &url, Some(key)), UNIT, 3, "tune: 6 → 3").unwrap();
    let branch = format!("{BRANCH_PREFIX}{UNIT}");
    let reader = GitSource::open(
        SourceConfig { verify: Some(Verify::Ssh { allowed_signers: allowed }), branch, ..SourceConfig::new(&url) },
        &d.path().join("reader"),
    )
    .unwrap();
    reader.fetch().unwrap();
    let head = reader.head().unwrap();
    assert_eq!(head.to_string(), p.commit);
    assert_eq!(reader.verify(head).unwrap().as_deref(), Some("tuner@example.com"));
}
