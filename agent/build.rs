//! The commit specd is built from, for `specd --version` and the `revision` label of
//! `specd_build_info`: two builds of one version are told apart by it. Read from git when the
//! source is a git checkout (`SPECD_REVISION`, 12 hex digits); `unknown` otherwise (a source
//! tarball). Cargo runs this again when the checkout's HEAD moves.

use std::path::Path;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    let s = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (out.status.success() && !s.is_empty()).then_some(s)
}

fn main() {
    let revision = git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".to_string());
    println!("cargo:rustc-env=SPECD_REVISION={revision}");
    // HEAD, the branch it names (loose or packed): a commit or a checkout changes one of them.
    let mut watched = vec![git(&["rev-parse", "--git-path", "HEAD"]), git(&["rev-parse", "--git-path", "packed-refs"])];
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watched.push(git(&["rev-parse", "--git-path", &branch]));
    }
    for p in watched.into_iter().flatten() {
        // A path that does not exist would make cargo run this script at every build.
        if Path::new(&p).exists() {
            println!("cargo:rerun-if-changed={p}");
        }
    }
    println!("cargo:rerun-if-changed=build.rs");
}
