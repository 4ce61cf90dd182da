//! A fleet's host follows the promotion record, against real repositories made with git: with a
//! fleet file beside the specs, a host deploys the revision the record assigns it (its wave's
//! good revision, or the target once promoted), not the head; it waits while there is no record;
//! a record that goes back, names a commit outside the branch or does not parse deploys nothing.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use specd::parts::source::{Evaluation, Follower, GitSource, SourceConfig, evaluate};
use specd_e2e::git;
use specd_spec::fleet::{Promoted, Record, RolloutState, WaveRecord};

use crate::SPEC;

const FLEET: &str = "apiVersion: specd/v1
kind: Fleet
metadata: {name: gpus}
spec:
  waves:
    - {name: canary, hosts: [gpu-01], bake: 10m}
    - {name: h100, labels: {gpu: h100}, max_unavailable: 2, bake: 30m}
";

const BRANCH: &str = "specd-promotions";

fn repo() -> (tempfile::TempDir, PathBuf) {
    let d = tempfile::tempdir().unwrap();
    let r = d.path().join("config");
    std::fs::create_dir_all(r.join("specs")).unwrap();
    git(&r, &["init", "-q"]);
    (d, r)
}

/// A commit of main whose spec runs `steps` draft steps (the fleet file beside it, if given).
fn commit(r: &Path, steps: u32, fleet: Option<&str>) -> String {
    let spec = SPEC.replace("STEPS", &steps.to_string()).replace("DRAFT", &(steps + 1).to_string());
    std::fs::write(r.join("specs/qwen.yaml"), spec).unwrap();
    match fleet {
        Some(f) => std::fs::write(r.join("specs/fleet.yaml"), f).unwrap(),
        None => {
            let _ = std::fs::remove_file(r.join("specs/fleet.yaml"));
        }
    }
    git(r, &["add", "-A"]);
    git(r, &["commit", "-q", "-m", &format!("steps {steps}")]);
    git(r, &["rev-parse", "HEAD"])
}

/// `git <args>` with `input` on stdin.
fn git_in(r: &Path, args: &[&str], input: &str) -> String {
    let mut c = Command::new("git")
        .args(["-c", "user.name=promoter", "-c", "user.email=promoter@example.com"])
        .args(args)
        .current_dir(r)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    c.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    let out = c.wait_with_output().unwrap();
    assert!(out.status.success(), "git {args:?}");
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// Commit `text` as promotions.yaml on the record branch, on `parent` (none: a new history), as
/// a promoter does, without touching the working tree; the branch is set to it.
fn record_commit(r: &Path, text: &str, parent: Option<&str>) -> String {
    let blob = git_in(r, &["hash-object", "-w", "--stdin"], text);
    let tree = git_in(r, &["mktree"], &format!("100644 blob {blob}\tpromotions.yaml\n"));
    let mut args = vec!["commit-tree", tree.as_str(), "-m", "promote"];
    if let Some(p) = parent {
        args.extend(["-p", p]);
    }
    let c = git_in(r, &args, "");
    git(r, &["update-ref", &format!("refs/heads/{BRANCH}"), &c]);
    c
}

fn record(target: &str, released: &str, canary: &str, h100: &str, promoted: &[&str]) -> Record {
    Record {
        target: target.into(),
        released: released.into(),
        state: RolloutState::Progressing,
        started: 1_700_000_000,
        waves: vec![
            WaveRecord {
                promoted: promoted.iter().map(|h| Promoted { host: h.to_string(), at: 1_700_000_100 }).collect(),
                ..WaveRecord::at("canary", canary)
            },
            WaveRecord::at("h100", h100),
        ],
        halt: None,
    }
}

fn source(r: &Path) -> GitSource {
    let cfg = SourceConfig::new(r.to_str().unwrap());
    GitSource::open(cfg, Path::new("/nonexistent")).unwrap()
}

fn steps_of(e: &Evaluation) -> Vec<u32> {
    e.desired.iter().map(|d| d.spec.speculative.as_ref().unwrap().num_steps.unwrap()).collect()
}

fn h100() -> BTreeMap<String, String> {
    [("gpu".to_string(), "h100".to_string())].into()
}

/// Three commits of main, the fleet file in each: steps 1, 2, 3 (the head).
fn fleet_repo() -> (tempfile::TempDir, PathBuf, [String; 3]) {
    let (d, r) = repo();
    let c = [commit(&r, 1, Some(FLEET)), commit(&r, 2, Some(FLEET)), commit(&r, 3, Some(FLEET))];
    (d, r, c)
}

#[test]
fn without_a_fleet_file_the_head_deploys_as_before() {
    let (_d, r) = repo();
    let c1 = commit(&r, 1, None);
    let s = source(&r);
    let e = evaluate(&s, None, false, "gpu-01");
    assert_eq!((e.error.as_deref(), steps_of(&e), e.fleet.as_ref()), (None, vec![1], None));
    assert_eq!(e.revision(), Some(c1.as_str()));
}

#[test]
fn with_a_fleet_file_and_no_record_the_host_waits_and_deploys_nothing() {
    let (_d, r, c) = fleet_repo();
    let s = source(&r);
    let e = evaluate(&s, Some(&c[0]), false, "gpu-01");
    assert_eq!(e.error, None);
    assert!(e.desired.is_empty());
    assert_eq!(
        e.waiting(),
        Some("waiting for a promotion: specd-promotions has no promotion record yet (run specd promote)")
    );
    let f = e.fleet.unwrap();
    assert_eq!((f.wave.as_deref(), f.assigned, f.record), (Some("canary"), None, None));
}

#[test]
fn a_host_deploys_the_revision_the_record_assigns_it_not_the_head() {
    let (_d, r, [c1, c2, c3]) = fleet_repo();
    // Rolling out c2 (older than the head c3): the canary promoted; the h100 wave still on c1.
    let rec = record_commit(&r, &record(&c2, &c1, &c1, &c1, &["gpu-01"]).render(), None);
    let s = source(&r);
    let e = evaluate(&s, None, false, "gpu-01");
    assert_eq!((e.error.as_deref(), steps_of(&e)), (None, vec![2]));
    assert_eq!(e.head.as_deref(), Some(c3.as_str()));
    assert_eq!(e.revision(), Some(c2.as_str()));
    let f = e.fleet.as_ref().unwrap();
    assert_eq!((f.wave.as_deref(), f.promoted, f.record.as_deref()), (Some("canary"), true, Some(rec.as_str())));
    // The units' source names the revision they come from.
    assert!(format!("{:?}", e.desired[0].source).contains(&c2));
    // Not promoted: its wave's good revision, selected by its labels.
    let labels = h100();
    let e = evaluate(&s, None, false, Follower { host: "gpu-07", labels: &labels, record: None });
    assert_eq!((e.error.as_deref(), steps_of(&e)), (None, vec![1]));
    let f = e.fleet.unwrap();
    assert_eq!((f.wave.as_deref(), f.promoted, f.assigned.as_deref()), (Some("h100"), false, Some(c1.as_str())));
    // In no wave: the released revision.
    let e = evaluate(&s, None, false, "cpu-01");
    assert_eq!((e.error.as_deref(), steps_of(&e), e.fleet.unwrap().wave), (None, vec![1], None));
}

#[test]
fn a_revert_in_the_record_deploys_the_older_revision_without_allow_rewind() {
    let (_d, r, [c1, _c2, c3]) = fleet_repo();
    let r1 = record_commit(&r, &record(&c3, &c1, &c1, &c1, &["gpu-01"]).render(), None);
    let s = source(&r);
    let e = evaluate(&s, Some(&c1), false, "gpu-01");
    assert_eq!((e.error.as_deref(), steps_of(&e)), (None, vec![3]));
    // Halted: the canary back on c1, in a record that descends from the one followed.
    let mut halted = record(&c3, &c1, &c1, &c1, &[]);
    halted.state = RolloutState::Halted;
    record_commit(&r, &halted.render(), Some(&r1));
    let who = Follower { host: "gpu-01", labels: &BTreeMap::new(), record: Some(&r1) };
    let e = evaluate(&s, Some(&c3), false, who);
    assert_eq!((e.error.as_deref(), steps_of(&e)), (None, vec![1]));
    assert_eq!(e.revision(), Some(c1.as_str()));
}

#[test]
fn a_record_naming_a_commit_outside_the_branch_s_history_is_refused() {
    let (_d, r, [c1, ..]) = fleet_repo();
    git(&r, &["checkout", "-q", "-b", "elsewhere"]);
    let stray = commit(&r, 9, Some(FLEET));
    git(&r, &["checkout", "-q", "main"]);
    record_commit(&r, &record(&stray, &c1, &c1, &c1, &["gpu-01"]).render(), None);
    let s = source(&r);
    let e = evaluate(&s, Some(&c1), false, "gpu-01");
    let err = e.error.unwrap();
    let want = format!("the record names {} which is not in the history of branch main", specd_spec::short(&stray));
    assert!(err.contains(&want), "{err}");
    assert!(e.desired.is_empty());
    // The others still get theirs.
    assert_eq!(steps_of(&evaluate(&s, Some(&c1), false, "cpu-01")), vec![1]);
}

#[test]
fn a_record_branch_that_went_back_is_refused_unless_rewinds_are_allowed() {
    let (_d, r, [c1, c2, _]) = fleet_repo();
    let r1 = record_commit(&r, &record(&c2, &c1, &c1, &c1, &["gpu-01"]).render(), None);
    // Force-pushed: a new history that does not contain r1.
    record_commit(&r, &record(&c1, &c1, &c1, &c1, &[]).render(), None);
    let s = source(&r);
    let who = Follower { host: "gpu-01", labels: &BTreeMap::new(), record: Some(&r1) };
    let e = evaluate(&s, Some(&c2), false, who);
    let err = e.error.unwrap();
    assert!(
        err.contains(&format!("does not contain the record {} this host followed", specd_spec::short(&r1))),
        "{err}"
    );
    assert!(err.contains("refusing to go backwards"), "{err}");
    assert!(e.desired.is_empty());
    let e = evaluate(&s, Some(&c2), true, who);
    assert_eq!((e.error.as_deref(), steps_of(&e)), (None, vec![1]));
}

#[test]
fn a_bad_record_or_fleet_file_deploys_nothing_and_names_file_line_and_field() {
    let (_d, r, [c1, ..]) = fleet_repo();
    let bad = record(&c1, &c1, &c1, &c1, &[]).render().replace(&format!("target: {c1}"), "target: abc123");
    let rc = record_commit(&r, &bad, None);
    let s = source(&r);
    let e = evaluate(&s, Some(&c1), false, "gpu-01");
    let err = e.error.unwrap();
    assert!(err.contains(&format!("promotions.yaml@{} ({BRANCH}):2:", specd_spec::short(&rc))), "{err}");
    assert!(err.contains("target") && err.contains("must be a full commit hash"), "{err}");
    assert!(e.desired.is_empty());
    // A fleet file that does not validate: the head is not deployed, the error located.
    let head = commit(&r, 4, Some(&FLEET.replace("bake: 10m", "bake: soon")));
    let e = evaluate(&s, Some(&c1), false, "gpu-01");
    let err = e.error.unwrap();
    assert!(err.contains(&format!("specs/fleet.yaml@{}:6", specd_spec::short(&head))) && err.contains("bake"), "{err}");
    assert!(e.desired.is_empty());
}

#[test]
fn a_head_that_went_back_is_refused_with_a_fleet_file_as_without() {
    let (_d, r, [c1, c2, c3]) = fleet_repo();
    record_commit(&r, &record(&c1, &c1, &c1, &c1, &[]).render(), None);
    // The host took c3 (say, before the fleet file's rollout began); main is reset to c2.
    git(&r, &["reset", "-q", "--hard", &c2]);
    let s = source(&r);
    let e = evaluate(&s, Some(&c3), false, "gpu-01");
    let err = e.error.unwrap();
    assert!(err.contains(&format!("does not contain the deployed commit {}", specd_spec::short(&c3))), "{err}");
    assert!(e.desired.is_empty());
    let e = evaluate(&s, Some(&c3), true, "gpu-01");
    assert_eq!((e.error.as_deref(), steps_of(&e)), (None, vec![1]), "allow_rewind: the record's c1");
}
