//! A bundle carried to an air-gapped site, against real repositories, real bundles (`git bundle
//! create`) and the `specd` binary: `specd bundle import` moves the local mirror the agent
//! follows only to signed commits that descend from what it has, whole or not at all, and the
//! agent reading the mirror deploys what the bundle carried.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use specd::parts::source::{Evaluation, GitSource, SourceConfig, Verify, evaluate};
use specd_e2e::{git, ssh_key};
use specd_spec::fleet::{Promoted, Record, RolloutState, WaveRecord};

use crate::SPEC;

const FLEET: &str = "apiVersion: specd/v1
kind: Fleet
metadata: {name: gpus}
spec:
  waves:
    - {name: canary, hosts: [gpu-01], bake: 10m}
";

/// The connected side's repository, the site's mirror (made from it by `git clone --mirror`
/// while the site was connected, or by the first import) and the agent's signing setup.
struct Site {
    d: tempfile::TempDir,
    /// The config repository on the connected side.
    r: PathBuf,
    mirror: PathBuf,
    config: PathBuf,
    good: PathBuf,
    evil: PathBuf,
    /// Each commit has the fleet file beside its spec: the agent deploys what the record gives.
    fleet: bool,
}

impl Site {
    fn new(fleet: bool) -> Site {
        let d = tempfile::tempdir().unwrap();
        let r = d.path().join("config");
        std::fs::create_dir_all(r.join("specs")).unwrap();
        git(&r, &["init", "-q"]);
        let good = ssh_key(d.path(), "good");
        let evil = ssh_key(d.path(), "evil");
        let allowed = d.path().join("allowed_signers");
        let pubkey = std::fs::read_to_string(good.with_extension("pub")).unwrap();
        std::fs::write(&allowed, format!("ops@example.com namespaces=\"git\" {pubkey}")).unwrap();
        let mirror = d.path().join("site/specd.git");
        let config = d.path().join("agent.yaml");
        std::fs::write(
            &config,
            format!(
                "repo: {}\nbranch: main\npath: specs\nverify_ssh_allowed_signers: {}\n",
                mirror.display(),
                allowed.display()
            ),
        )
        .unwrap();
        Site { d, r, mirror, config, good, evil, fleet }
    }

    /// A commit of main running `steps` draft steps, signed with `key` (or not).
    fn commit(&self, steps: u32, key: Option<&Path>) -> String {
        let spec = SPEC.replace("STEPS", &steps.to_string()).replace("DRAFT", &(steps + 1).to_string());
        std::fs::write(self.r.join("specs/qwen.yaml"), spec).unwrap();
        if self.fleet {
            std::fs::write(self.r.join("specs/fleet.yaml"), FLEET).unwrap();
        }
        git(&self.r, &["add", "-A"]);
        let sign = key.map(|k| format!("user.signingkey={}", k.display()));
        let mut args = vec!["-c", "gpg.format=ssh"];
        if let Some(s) = &sign {
            args.extend(["-c", s, "commit", "-q", "-S"]);
        } else {
            args.extend(["commit", "-q"]);
        }
        let message = format!("steps {steps}");
        args.extend(["-m", &message]);
        git(&self.r, &args);
        git(&self.r, &["rev-parse", "HEAD"])
    }

    /// A commit of the record branch (signed with the good key) giving gpu-01 `target`.
    fn record(&self, target: &str) -> String {
        let rec = Record {
            target: target.into(),
            released: target.into(),
            state: RolloutState::Progressing,
            started: 1_700_000_000,
            waves: vec![WaveRecord {
                promoted: vec![Promoted { host: "gpu-01".into(), at: 1_700_000_100 }],
                ..WaveRecord::at("canary", target)
            }],
            halt: None,
        };
        std::fs::write(self.d.path().join("promotions.yaml"), rec.render()).unwrap();
        let blob = git(&self.r, &["hash-object", "-w", self.d.path().join("promotions.yaml").to_str().unwrap()]);
        std::fs::write(self.d.path().join("tree"), format!("100644 blob {blob}\tpromotions.yaml\n")).unwrap();
        let out = Command::new("git")
            .args(["mktree"])
            .current_dir(&self.r)
            .stdin(std::fs::File::open(self.d.path().join("tree")).unwrap())
            .output()
            .unwrap();
        let tree = String::from_utf8(out.stdout).unwrap().trim().to_string();
        let parent = git(&self.r, &["for-each-ref", "--format=%(objectname)", "refs/heads/specd-promotions"]);
        let key = format!("user.signingkey={}", self.good.display());
        let mut args = vec!["-c", "gpg.format=ssh", "-c", &key, "commit-tree", "-S", &tree, "-m", "promote"];
        if !parent.is_empty() {
            args.extend(["-p", &parent]);
        }
        let c = git(&self.r, &args);
        git(&self.r, &["update-ref", "refs/heads/specd-promotions", &c]);
        c
    }

    /// `git bundle create` of these refs of the connected side's repository.
    fn bundle(&self, name: &str, refs: &[&str]) -> PathBuf {
        let f = self.d.path().join(name);
        let mut args = vec!["bundle", "create", "-q", f.to_str().unwrap()];
        args.extend(refs);
        git(&self.r, &args);
        f
    }

    fn import(&self, bundle: &Path, extra: &[&str]) -> Output {
        Command::new(env!("CARGO_BIN_EXE_specd"))
            .args(["bundle", "import"])
            .arg(bundle)
            .arg("--config")
            .arg(&self.config)
            .args(extra)
            .output()
            .unwrap()
    }

    /// Every ref of the mirror and where it points.
    fn refs(&self) -> String {
        git(&self.mirror, &["for-each-ref"])
    }

    /// What the agent following the mirror (as its config says) deploys on gpu-01.
    fn agent_reads(&self) -> Evaluation {
        let mut cfg = SourceConfig::new(self.mirror.to_str().unwrap());
        cfg.verify = Some(Verify::Ssh { allowed_signers: self.d.path().join("allowed_signers") });
        let s = GitSource::open(cfg, Path::new("/nonexistent")).unwrap();
        evaluate(&s, None, false, "gpu-01")
    }
}

fn steps_of(e: &Evaluation) -> Vec<u32> {
    e.desired.iter().map(|d| d.spec.speculative.as_ref().unwrap().num_steps.unwrap()).collect()
}

fn ok(out: &Output) -> String {
    assert!(out.status.success(), "{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// Refused with exit 1; its words on stderr.
fn refused(out: &Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(1), "{err}{}", String::from_utf8_lossy(&out.stdout));
    assert!(err.contains("the bundle was refused and the mirror is unchanged"), "{err}");
    err
}

/// The first bundle makes the mirror; the next one moves it, the followed branch and the record
/// branch together, and the agent reading the mirror deploys the revision the record gives it.
#[test]
fn a_signed_bundle_moves_the_mirror_and_the_agent_deploys_what_it_carried() {
    let site = Site::new(true);
    let c1 = site.commit(1, Some(&site.good));
    site.record(&c1);
    let out = ok(&site.import(&site.bundle("one.bundle", &["main", "specd-promotions"]), &[]));
    assert!(out.contains("refs/heads/main: (new) ->"), "{out}");
    assert_eq!((site.agent_reads().error, steps_of(&site.agent_reads())), (None, vec![1]));

    let c2 = site.commit(2, Some(&site.good));
    let c3 = site.commit(3, Some(&site.good));
    let rec = site.record(&c2);
    let out = ok(&site.import(&site.bundle("two.bundle", &["main", "specd-promotions"]), &[]));
    assert!(out.contains(&format!("refs/heads/main: {} -> {}, 2 commit(s) verified", &c1[..12], &c3[..12])), "{out}");
    assert!(out.contains("refs/heads/specd-promotions:"), "{out}");
    let e = site.agent_reads();
    assert_eq!(e.error, None);
    assert_eq!((e.head.as_deref(), e.revision(), steps_of(&e)), (Some(c3.as_str()), Some(c2.as_str()), vec![2]));
    assert_eq!(e.fleet.unwrap().record.as_deref(), Some(rec.as_str()));
    // A promotion step alone: a bundle of the record branch, read at the mirror's head.
    let rec = site.record(&c3);
    let out = ok(&site.import(&site.bundle("step.bundle", &["specd-promotions"]), &[]));
    assert!(out.contains("refs/heads/specd-promotions:") && !out.contains("refs/heads/main:"), "{out}");
    let e = site.agent_reads();
    assert_eq!((e.error.as_deref(), e.revision(), steps_of(&e)), (None, Some(c3.as_str()), vec![3]));
    assert_eq!(e.fleet.unwrap().record.as_deref(), Some(rec.as_str()));
    // The same bundle again: nothing new, nothing changed.
    let before = site.refs();
    assert!(ok(&site.import(&site.d.path().join("step.bundle"), &[])).contains("has it already"));
    assert_eq!(site.refs(), before);
}

/// One unsigned or wrongly signed commit on the branch's line refuses the whole bundle, even
/// under a signed head, naming the commit and the rule.
#[test]
fn an_unsigned_or_wrongly_signed_commit_refuses_the_whole_bundle() {
    let site = Site::new(false);
    site.commit(1, Some(&site.good));
    ok(&site.import(&site.bundle("one.bundle", &["main"]), &[]));
    let before = site.refs();
    let unsigned = site.commit(2, None);
    let c3 = site.commit(3, Some(&site.good));
    let err = refused(&site.import(&site.bundle("two.bundle", &["main"]), &[]));
    assert!(
        err.contains(&format!("the bundle's main (at {}): commit {} is not signed", &c3[..12], &unsigned[..12])),
        "{err}"
    );
    assert!(err.contains("the rule: every commit deployed signed by a key of"), "{err}");
    assert_eq!(site.refs(), before, "nothing moved");
    assert_eq!(steps_of(&site.agent_reads()), vec![1]);

    let site = Site::new(false);
    site.commit(1, Some(&site.good));
    ok(&site.import(&site.bundle("one.bundle", &["main"]), &[]));
    let before = site.refs();
    let evil = site.commit(2, Some(&site.evil));
    let err = refused(&site.import(&site.bundle("two.bundle", &["main"]), &[]));
    assert!(err.contains(&format!("commit {} is signed by a key that is not in", &evil[..12])), "{err}");
    assert_eq!(site.refs(), before);

    // A side branch's commit merged by a signed merge is no head the branch had: the agent would
    // deploy it only if a record named it, and then checks it itself.
    git(&site.r, &["reset", "-q", "--hard", "HEAD~1"]);
    git(&site.r, &["checkout", "-q", "-b", "side"]);
    std::fs::write(site.r.join("README"), "notes\n").unwrap();
    git(&site.r, &["add", "-A"]);
    git(&site.r, &["commit", "-q", "-m", "unsigned side"]);
    git(&site.r, &["checkout", "-q", "main"]);
    let key = format!("user.signingkey={}", site.good.display());
    git(&site.r, &["-c", "gpg.format=ssh", "-c", &key, "merge", "-q", "-S", "--no-ff", "-m", "merge", "side"]);
    let out = ok(&site.import(&site.bundle("merged.bundle", &["main"]), &[]));
    assert!(out.contains("1 commit(s) verified"), "{out}");
}

/// An older bundle carried in again would roll the site back: refused. So is a branch whose
/// history was rewritten, unless `--allow-rewind`.
#[test]
fn an_older_bundle_replayed_or_a_rewritten_branch_is_refused() {
    let site = Site::new(false);
    site.commit(1, Some(&site.good));
    let old = site.bundle("old.bundle", &["main"]);
    let c2 = site.commit(2, Some(&site.good));
    ok(&site.import(&site.bundle("new.bundle", &["main"]), &[]));
    let before = site.refs();
    let err = refused(&site.import(&old, &[]));
    assert!(err.contains(&format!("does not contain the mirror's {} (an older bundle replayed?)", &c2[..12])), "{err}");
    assert_eq!(site.refs(), before);
    assert_eq!(steps_of(&site.agent_reads()), vec![2]);

    // Rewritten: a new commit on the first one, beside the second.
    git(&site.r, &["reset", "-q", "--hard", "HEAD~1"]);
    let side = site.commit(5, Some(&site.good));
    let sideways = site.bundle("side.bundle", &["main"]);
    let err = refused(&site.import(&sideways, &[]));
    assert!(err.contains("(history rewritten?)"), "{err}");
    assert_eq!(site.refs(), before);
    ok(&site.import(&sideways, &["--allow-rewind"]));
    assert_eq!(site.agent_reads().head.as_deref(), Some(side.as_str()));
}

/// A bundle cut short (a copy that did not finish), one with a damaged byte, or no bundle at
/// all: refused, the mirror as it was; the whole bundle imports afterwards.
#[test]
fn a_truncated_or_corrupt_bundle_is_refused_and_the_mirror_stays_whole() {
    let site = Site::new(false);
    site.commit(1, Some(&site.good));
    ok(&site.import(&site.bundle("one.bundle", &["main"]), &[]));
    let before = site.refs();
    // A spec large enough that the pack is most of the bundle.
    let noise: String = (0..40_000).map(|i| format!("# {:x}\n", i * 2_654_435_761u64 % 1_000_003)).collect();
    std::fs::write(site.r.join("specs/notes.txt"), noise).unwrap();
    let c2 = site.commit(2, Some(&site.good));
    let whole = site.bundle("two.bundle", &["main"]);
    let bytes = std::fs::read(&whole).unwrap();

    let cut = site.d.path().join("cut.bundle");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let err = refused(&site.import(&cut, &[]));
    assert!(err.contains("is not whole"), "{err}");
    assert_eq!(site.refs(), before);

    let damaged = site.d.path().join("damaged.bundle");
    let mut b = bytes.clone();
    let at = b.len() - 100;
    b[at] ^= 0xff;
    std::fs::write(&damaged, &b).unwrap();
    let err = refused(&site.import(&damaged, &[]));
    assert!(err.contains("is not whole"), "{err}");
    assert_eq!(site.refs(), before);

    let junk = site.d.path().join("junk.bundle");
    std::fs::write(&junk, "not a bundle\n").unwrap();
    let err = refused(&site.import(&junk, &[]));
    assert!(err.contains("is not a usable bundle"), "{err}");
    assert_eq!(site.refs(), before);
    assert_eq!(steps_of(&site.agent_reads()), vec![1]);

    ok(&site.import(&whole, &[]));
    assert_eq!(site.agent_reads().head.as_deref(), Some(c2.as_str()));
    git(&site.mirror, &["fsck", "--no-dangling"]);
}

/// Whether a direct child of `pid` runs `name` now (its `/proc/<pid>/stat`).
fn has_child(pid: u32, name: &str) -> bool {
    let Ok(dir) = std::fs::read_dir("/proc") else { return false };
    dir.flatten().any(|e| {
        let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
        // `pid (comm) state ppid ...`: comm may hold spaces, so split at its last parenthesis.
        let Some((head, tail)) = stat.rsplit_once(')') else { return false };
        let comm = head.split_once('(').map(|(_, c)| c).unwrap_or_default();
        let ppid = tail.split_whitespace().nth(1).and_then(|p| p.parse::<u32>().ok());
        comm == name && ppid == Some(pid)
    })
}

/// An import killed while it verifies the bundle's commits (their objects fetched into the
/// mirror, no ref moved yet): the mirror's refs are as they were, no ref is left locked, the
/// agent reads the old head, and the same bundle imports afterwards.
#[test]
fn an_import_killed_half_way_leaves_the_mirror_as_it_was() {
    let site = Site::new(false);
    let c1 = site.commit(1, Some(&site.good));
    ok(&site.import(&site.bundle("one.bundle", &["main"]), &[]));
    let before = site.refs();
    let mut last = String::new();
    for steps in 2..=40 {
        last = site.commit(steps, Some(&site.good));
    }
    let many = site.bundle("many.bundle", &["main"]);
    let mut import = Command::new(env!("CARGO_BIN_EXE_specd"))
        .args(["bundle", "import"])
        .arg(&many)
        .arg("--config")
        .arg(&site.config)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // The moment: specd runs ssh-keygen on one of the 39 new commits.
    let t0 = std::time::Instant::now();
    while !has_child(import.id(), "ssh-keygen") {
        assert!(import.try_wait().unwrap().is_none(), "the import ended before its verification was seen");
        assert!(t0.elapsed() < std::time::Duration::from_secs(60), "no verification seen within 60 s");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    import.kill().unwrap();
    import.wait().unwrap();
    assert_eq!(site.refs(), before, "no ref moved");
    let locked: Vec<_> =
        walk(&site.mirror.join("refs")).into_iter().filter(|p| p.extension().is_some_and(|e| e == "lock")).collect();
    assert!(locked.is_empty(), "{locked:?}");
    let e = site.agent_reads();
    assert_eq!((e.error, e.head.as_deref()), (None, Some(c1.as_str())));
    ok(&site.import(&many, &[]));
    assert_eq!(site.agent_reads().head.as_deref(), Some(last.as_str()));
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = vec![];
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// A mirror made anew (a disk replaced) has nothing to compare with: the agent's own record of
/// what it deploys (`source.json`) still refuses an older bundle.
#[test]
fn an_older_bundle_into_a_new_mirror_is_refused_by_what_the_agent_deploys() {
    let site = Site::new(false);
    site.commit(1, Some(&site.good));
    let old = site.bundle("old.bundle", &["main"]);
    let c2 = site.commit(2, Some(&site.good));
    ok(&site.import(&site.bundle("new.bundle", &["main"]), &[]));
    let state = site.d.path().join("state");
    std::fs::create_dir_all(&state).unwrap();
    let source = format!(
        r#"{{"repo": "{}", "followed": "branch main", "accepted_commit": "{c2}", "time": 0}}"#,
        site.mirror.display()
    );
    std::fs::write(state.join("source.json"), source).unwrap();
    std::fs::remove_dir_all(&site.mirror).unwrap();
    let err = refused(&site.import(&old, &["--state-dir", state.to_str().unwrap()]));
    assert!(err.contains(&format!("does not contain {}, what the agent deploys", &c2[..12])), "{err}");
    assert!(!site.mirror.exists(), "the mirror made for the refused bundle is gone");
    ok(&site.import(&site.d.path().join("new.bundle"), &["--state-dir", state.to_str().unwrap()]));
    assert_eq!(site.agent_reads().head.as_deref(), Some(c2.as_str()));
}

/// A bundle that leaves out what the site has (`^<commit>`) imports into a mirror that has it,
/// and is refused, naming what is missing, by one that does not.
#[test]
fn an_incremental_bundle_needs_the_commits_it_leaves_out() {
    let site = Site::new(false);
    let c1 = site.commit(1, Some(&site.good));
    ok(&site.import(&site.bundle("one.bundle", &["main"]), &[]));
    let c2 = site.commit(2, Some(&site.good));
    let inc = site.bundle("inc.bundle", &["main", &format!("^{c1}")]);
    let kept = site.d.path().join("kept.git");
    std::fs::rename(&site.mirror, &kept).unwrap();
    let err = refused(&site.import(&inc, &[]));
    assert!(err.contains("is not a usable bundle") && err.contains("prerequisite") && err.contains(&c1), "{err}");
    assert!(!site.mirror.exists());
    std::fs::rename(&kept, &site.mirror).unwrap();
    assert!(ok(&site.import(&inc, &[])).contains("1 commit(s) verified"));
    assert_eq!(site.agent_reads().head.as_deref(), Some(c2.as_str()));
}
