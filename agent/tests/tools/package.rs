//! The package and the command-line conventions: `scripts/package-deb` builds a .deb with
//! debhelper (from the binary cargo built for these tests, to keep CI fast) that holds what an
//! operator expects and that lintian passes without an error or a warning; its unit passes
//! `systemd-analyze verify` (extracted, never installed on this host), and the completions, man
//! pages and `validate --json` are what they say. Installed and booted: agent/tests/boxes/deb.rs.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn specd() -> Command {
    Command::new(env!("CARGO_BIN_EXE_specd"))
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The .deb `scripts/package-deb` builds from this test's specd binary, once for the tests of this
/// file, in cargo's scratch directory for tests (a fresh one each run).
fn deb() -> &'static Path {
    static DEB: OnceLock<PathBuf> = OnceLock::new();
    DEB.get_or_init(|| {
        let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("package");
        let _ = std::fs::remove_dir_all(&out);
        let printed = run(Command::new(root().join("scripts/package-deb"))
            .args(["--binary", env!("CARGO_BIN_EXE_specd"), "--out"])
            .arg(&out));
        let deb = PathBuf::from(printed.trim());
        assert!(deb.is_file(), "the script names the .deb it wrote: {printed}");
        deb
    })
}

#[test]
fn the_deb_holds_the_binary_a_verified_system_unit_a_conffile_completions_man_pages_and_its_debian_docs() {
    let dir = tempfile::tempdir().unwrap();
    let deb = deb();
    let name = deb.file_name().unwrap().to_string_lossy().to_string();
    assert!(name.starts_with("specd_0.") && name.ends_with(".deb"), "{name}");

    let listing = run(Command::new("dpkg-deb").arg("-c").arg(deb));
    for path in [
        "./usr/bin/specd",
        "./usr/lib/systemd/system/specd.service",
        "./usr/share/doc/specd/copyright",
        "./usr/share/doc/specd/changelog.gz",
        "./usr/share/doc/specd/README.Debian",
        "./usr/share/doc/specd/examples/agent.yaml",
        "./etc/specd/agent.yaml",
        "./usr/share/bash-completion/completions/specd",
        "./usr/share/zsh/vendor-completions/_specd",
        "./usr/share/fish/vendor_completions.d/specd.fish",
        "./usr/share/man/man1/specd.1.gz",
        "./usr/share/man/man1/specd-apply.1.gz",
        "./usr/share/man/man1/specd-run.1.gz",
    ] {
        assert!(listing.lines().any(|l| l.ends_with(path)), "{path} is not in the package:\n{listing}");
    }
    let binary = listing.lines().find(|l| l.ends_with("./usr/bin/specd")).unwrap();
    assert!(binary.starts_with("-rwxr-xr-x root/root"), "{binary}");

    // Only the unit's own directory: Debian 13 ships units under /usr/lib.
    assert!(!listing.contains(" ./lib/"), "{listing}");
    let field = |f: &str| run(Command::new("dpkg-deb").args(["-f"]).arg(deb).arg(f)).trim().to_string();
    assert_eq!(field("Package"), "specd");
    // debian/changelog's version, which is the workspace's (scripts/package-deb refuses others).
    let version = std::fs::read_to_string(root().join("Cargo.toml"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("version = \""))
        .map(|v| v.trim_end_matches('"').to_string())
        .unwrap();
    assert_eq!(field("Version"), version);
    let maintainer = field("Maintainer");
    assert!(!maintainer.contains("localhost") && maintainer.contains("@specd.dev>"), "{maintainer}");
    // Versioned by dpkg-shlibdeps from the symbols the binary uses; no TLS library is linked
    // (remotes are fetched by the `git` command).
    let depends = field("Depends");
    let deps: Vec<&str> = depends.split(", ").collect();
    assert!(deps.iter().any(|d| d.starts_with("libc6 (>= 2.")), "{depends}");
    assert!(deps.contains(&"systemd") && !depends.contains("libssl"), "{depends}");
    // git for remotes, openssh-client for ssh remotes and signatures, gnupg for OpenPGP ones.
    assert_eq!(field("Recommends"), "git, openssh-client, gnupg");
    // nft for service.drain_refuse_new (opt-in).
    assert_eq!(field("Suggests"), "nftables");
    let x = dir.path().join("x");
    run(Command::new("dpkg-deb").arg("-e").arg(deb).arg(dir.path().join("control")));
    let conffiles = std::fs::read_to_string(dir.path().join("control/conffiles")).unwrap();
    assert_eq!(conffiles.trim(), "/etc/specd/agent.yaml", "the agent config survives upgrades");
    // The maintainer scripts are debhelper's (deb-systemd-helper, deb-systemd-invoke): installed
    // not enabled, stopped on remove, restarted on upgrade, its links removed on purge; and on
    // purge, the state directory removed.
    let script = |name: &str| std::fs::read_to_string(dir.path().join("control").join(name)).unwrap();
    let postinst = script("postinst");
    // dh_installsystemd --no-enable: enabled again on upgrade only if it was (`debian-installed`).
    assert!(postinst.contains("deb-systemd-helper debian-installed 'specd.service'"), "{postinst}");
    assert!(postinst.contains("deb-systemd-invoke $_dh_action 'specd.service'"), "{postinst}");
    assert!(script("prerm").contains("deb-systemd-invoke stop 'specd.service'"), "{}", script("prerm"));
    let postrm = script("postrm");
    assert!(
        postrm.contains("deb-systemd-helper purge 'specd.service'") && postrm.contains("rm -rf /var/lib/specd"),
        "{postrm}"
    );
    run(Command::new("dpkg-deb").arg("-x").arg(deb).arg(&x));

    // The packaged binary is this one, runnable.
    let v = run(Command::new(x.join("usr/bin/specd")).arg("--version"));
    assert!(v.starts_with("specd "), "{v}");
    // The default config parses (every line a comment until the operator sets `repo`).
    let cfg = std::fs::read_to_string(x.join("etc/specd/agent.yaml")).unwrap();
    assert!(cfg.contains("# repo:") && cfg.contains("notify:"), "{cfg}");

    // The system unit: the example's, run from /usr/bin, with the watchdog and a state directory.
    let unit = std::fs::read_to_string(x.join("usr/lib/systemd/system/specd.service")).unwrap();
    for line in [
        "ExecStart=/usr/bin/specd run --config /etc/specd/agent.yaml",
        "Type=notify",
        "WatchdogSec=60",
        "StateDirectory=specd",
    ] {
        assert!(unit.lines().any(|l| l == line), "{line} is not in the unit:\n{unit}");
    }
    let settings = |t: &str| -> Vec<String> {
        t.lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .map(|l| l.replace("/usr/local/bin/", "/usr/bin/"))
            .collect()
    };
    let example = std::fs::read_to_string(root().join("examples/specd.service")).unwrap();
    assert_eq!(settings(&unit), settings(&example), "packaging/specd.service follows examples/specd.service");

    // systemd accepts it, with the program's path pointing into the extracted tree (verify checks
    // that it is executable). Loaded by systemd-analyze only; nothing is installed on this host.
    let units = dir.path().join("units");
    std::fs::create_dir(&units).unwrap();
    let bin = x.join("usr/bin/specd");
    std::fs::write(units.join("specd.service"), unit.replace("/usr/bin/specd", &bin.display().to_string())).unwrap();
    // Its Documentation= (man:specd-run(1)) is looked up among the package's man pages.
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(units.join("specd.service"))
        .env("MANPATH", x.join("usr/share/man"))
        .output()
        .unwrap();
    assert!(
        out.status.success() && out.stderr.is_empty(),
        "systemd-analyze verify: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    // Completions name the commands; a man page per command.
    let bash = std::fs::read_to_string(x.join("usr/share/bash-completion/completions/specd")).unwrap();
    assert!(bash.contains("complete -F _specd") && bash.contains("unquarantine"), "bash completion");
    let fish = std::fs::read_to_string(x.join("usr/share/fish/vendor_completions.d/specd.fish")).unwrap();
    assert!(fish.contains("complete -c specd") && fish.contains("diagnose"), "fish completion");
    let man = run(Command::new("sh")
        .arg("-c")
        .arg(format!("gzip -dc {}", x.join("usr/share/man/man1/specd-apply.1.gz").display())));
    assert!(man.starts_with(".ie") || man.contains(".TH specd-apply 1"), "{man}");
}

/// lintian, Debian's package checker, finds no error and no warning in the .deb (no override
/// either: debian/ holds no lintian-overrides file).
#[test]
fn lintian_finds_no_error_and_no_warning_in_the_deb() {
    assert!(!root().join("debian/specd.lintian-overrides").exists(), "no tag is overridden");
    let out = Command::new("lintian")
        .args(["--allow-root", "--fail-on", "error,warning", "--display-level", ">=warning"])
        .arg(deb())
        .output()
        .expect("lintian is installed (scripts/install-deps)");
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "lintian {}: {text}", deb().display());
    let tags: Vec<&str> = text.lines().filter(|l| l.starts_with("E: ") || l.starts_with("W: ")).collect();
    assert!(tags.is_empty(), "{tags:?}");
}

#[test]
fn completions_exist_for_bash_zsh_and_fish_and_other_shells_are_refused() {
    for (shell, marker) in [("bash", "_specd()"), ("zsh", "#compdef specd"), ("fish", "complete -c specd")] {
        let out = run(specd().args(["completions", shell]));
        assert!(out.contains(marker), "{shell}: {out}");
        assert!(out.contains("validate") && out.contains("history"), "{shell} completes the commands");
    }
    let out = specd().args(["completions", "tcsh"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("invalid value 'tcsh'"));
}

#[test]
fn man_writes_one_page_per_command_from_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    run(specd().args(["man", "--out"]).arg(dir.path().join("man1")));
    let help = run(specd().arg("--help"));
    let mut pages: Vec<String> = std::fs::read_dir(dir.path().join("man1"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into())
        .collect();
    pages.sort();
    assert!(pages.contains(&"specd.1".to_string()), "{pages:?}");
    // Every command `--help` lists has its page, and no other page is written.
    let commands: Vec<&str> = help
        .split("Commands:")
        .nth(1)
        .unwrap()
        .split("Options:")
        .next()
        .unwrap()
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .collect();
    assert!(commands.len() >= 10, "{help}");
    let mut expected: Vec<String> = commands.iter().map(|c| format!("specd-{c}.1")).collect();
    expected.push("specd.1".into());
    expected.sort();
    assert_eq!(pages, expected);
    let apply = std::fs::read_to_string(dir.path().join("man1/specd-apply.1")).unwrap();
    assert!(apply.contains(".TH specd-apply 1") && apply.contains("dry\\-run"), "{apply}");
}

#[test]
fn validate_json_is_an_array_of_located_diagnostics() {
    let dir = tempfile::tempdir().unwrap();
    let good = root().join("examples/qwen35-122b-mtp.yaml");
    let out = specd().args(["validate", "--json"]).arg(&good).output().unwrap();
    assert!(out.status.success());
    assert_eq!(serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap(), serde_json::json!([]));

    let bad = dir.path().join("bad.yaml");
    let text = std::fs::read_to_string(&good).unwrap().replace("kind: InferenceService", "kind: InferenceServce");
    std::fs::write(&bad, text).unwrap();
    let out = specd().args(["validate", "--json"]).arg(&good).arg(&bad).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let v: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v.len(), 1, "{v:?}");
    let d = &v[0];
    assert_eq!(d["file"], bad.display().to_string());
    assert_eq!(d["field"], "kind");
    assert_eq!(d["severity"], "error");
    assert!(d["line"].as_u64().unwrap() >= 1 && d["column"].as_u64().unwrap() >= 1, "{d}");
    assert!(d["message"].as_str().unwrap().contains("InferenceServce"), "{d}");
}
