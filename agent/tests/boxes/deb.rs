//! The .deb on a real Debian system: a Debian 12 root made by mmdebstrap from Debian's archive
//! (cached outside the work tree, `specd_e2e::debian_root`), booted with its own systemd by
//! systemd-nspawn on a throwaway overlay. In it, as an operator would: `apt-get install` the
//! package `scripts/package-deb` built, point /etc/specd/agent.yaml at a local repository with a
//! spec, `systemctl enable --now specd.service`, see the unit applied and serving, and a second
//! commit replace it after a pre-flight that checked everything; then
//! `apt-get remove` and `apt-get purge`, and find what README.Debian says is left. Nothing is
//! installed on the host.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use specd_e2e::{DebianMachine, bin_path, debian_root, sglang_spec, wait_for, wait_until};

/// Debian 12: the systemd (252) of the tests' box and of this suite's CI.
const SUITE: &str = "bookworm";
/// What the root has besides minbase: systemd to boot, and the package's Recommends (the machine
/// has no network: nothing is downloaded while the test runs).
const PACKAGES: &[&str] = &["systemd", "git", "openssh-client", "gnupg"];
const UNIT: &str = "qwen.service";
const PORT: u16 = 30000;

fn text(o: &std::process::Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

struct Machine(DebianMachine);

impl Machine {
    fn sh(&self, script: &str) -> String {
        self.0.sh(script).unwrap_or_else(|e| panic!("{e:#}"))
    }

    /// `systemctl` in the machine, its answer trimmed (any exit status).
    fn systemctl(&self, args: &[&str]) -> String {
        let mut argv = vec!["systemctl"];
        argv.extend_from_slice(args);
        String::from_utf8_lossy(&self.0.exec(&argv).stdout).trim().to_string()
    }

    fn exists(&self, path: &str) -> bool {
        // Not through /proc/PID/root: an absolute link would resolve on the host.
        self.0.exec(&["test", "-e", path]).status.success()
    }

    fn is_link(&self, path: &str) -> bool {
        self.0.exec(&["test", "-L", path]).status.success()
    }

    fn write(&self, path: &str, contents: &str) {
        self.sh(&format!("mkdir -p {}", Path::new(path).parent().unwrap().display()));
        std::fs::write(self.0.host_path(path), contents).unwrap();
    }

    fn agent_journal(&self) -> String {
        text(&self.0.exec(&["journalctl", "--no-pager", "-u", "specd.service", "-n", "60"]))
    }
}

fn package(out: &Path) -> PathBuf {
    let _ = std::fs::remove_dir_all(out);
    let o = Command::new(Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/package-deb"))
        .args(["--binary", env!("CARGO_BIN_EXE_specd"), "--out"])
        .arg(out)
        .output()
        .unwrap();
    assert!(o.status.success(), "package-deb: {}", text(&o));
    PathBuf::from(String::from_utf8_lossy(&o.stdout).trim())
}

#[test]
fn the_deb_installs_applies_a_spec_under_systemd_and_purges_as_its_docs_say() {
    let t = Instant::now();
    let (root, made) = debian_root(SUITE, PACKAGES).unwrap();
    let root_time = t.elapsed();
    let t = Instant::now();
    let deb = package(&Path::new(env!("CARGO_TARGET_TMPDIR")).join("e2e-deb"));
    let package_time = t.elapsed();
    let m = Machine(DebianMachine::boot(&root, Duration::from_secs(60)).unwrap());
    let boot_time = m.0.boot_time();
    let t = Instant::now();

    // Install, as an operator does: apt resolves its dependencies from what the machine has (it
    // has no network to download anything).
    std::fs::copy(&deb, m.0.host_path("/root/specd.deb")).unwrap();
    m.sh("apt-get install --yes /root/specd.deb");
    assert_eq!(m.sh("dpkg-query -W -f '${Status} ${Version}' specd"), "install ok installed 0.1.0");
    // The package puts the unit under /usr/lib (Debian 12's merged /usr shows it as /lib too,
    // where systemd 252 looks first).
    assert!(m.sh("dpkg -L specd").lines().any(|l| l == "/usr/lib/systemd/system/specd.service"));
    let fragment = m.systemctl(&["show", "-P", "FragmentPath", "specd.service"]);
    assert_eq!(m.sh(&format!("readlink -f {fragment}")).trim(), "/usr/lib/systemd/system/specd.service");
    // Installed, not enabled or started: it needs `repo:` first.
    assert_eq!(m.systemctl(&["is-enabled", "specd.service"]), "disabled");
    assert_eq!(m.systemctl(&["is-active", "specd.service"]), "inactive");
    assert!(m.exists("/etc/specd/agent.yaml") && m.exists("/usr/share/doc/specd/README.Debian"));
    assert!(m.sh("man -w specd-run 2>/dev/null || ls /usr/share/man/man1/specd-run.1.gz").contains("specd-run.1.gz"));

    // A local repository with one spec, run by the stand-in (copied in: the machine's own C
    // library runs it), and its model folder, where the pre-flight looks.
    let standin = "/usr/local/bin/specd-standin";
    std::fs::copy(bin_path("specd-standin"), m.0.host_path(standin)).unwrap();
    m.write(&format!("{}/config.json", specd_e2e::STANDIN_MODEL), "{\"architectures\": [\"Qwen3NextForCausalLM\"]}\n");
    let tail = "  service: {environment: {SPECD_STANDIN_LOAD_MS: \"200\"}}\n";
    m.write("/srv/config/specs/qwen.yaml", &sglang_spec(standin, UNIT, PORT, 3, tail));
    m.sh("cd /srv/config && git init -q -b main && git add -A \
          && git -c user.name=ops -c user.email=ops@example.com commit -q -m qwen");
    m.write("/etc/specd/agent.yaml", "repo: /srv/config\npath: specs\n");
    m.sh("systemctl enable --now specd.service");
    // The agent runs sandboxed as shipped.
    assert_eq!(m.systemctl(&["show", "-P", "ProtectSystem", "specd.service"]), "strict");
    wait_until("the agent to apply qwen.service and find it in sync", Duration::from_secs(90), || {
        m.systemctl(&["is-active", UNIT]) == "active" && m.0.exec(&["specd", "status"]).status.success()
    })
    .unwrap_or_else(|e| {
        panic!("{e}\nstatus: {}\nagent:\n{}", text(&m.0.exec(&["specd", "status"])), m.agent_journal())
    });
    let first = m.systemctl(&["show", "-P", "MainPID", UNIT]);
    // A new commit replaces the serving instance: the pre-flight runs first, sandboxed, and
    // checks everything it knows how to (`systemd-analyze verify` of the unit, the port's holder
    // through /proc/PID/fd, the model folder), with nothing left "not checked".
    m.write("/srv/config/specs/qwen.yaml", &sglang_spec(standin, UNIT, PORT, 4, tail));
    m.sh("cd /srv/config && git -c user.name=ops -c user.email=ops@example.com commit -q -am 'steps 4'");
    let unit_file = wait_for("the agent to deploy steps 4", Duration::from_secs(90), || {
        let f = m.sh(&format!("cat /etc/systemd/system/{UNIT}"));
        let served = f.contains("--speculative-num-steps 4")
            && m.systemctl(&["is-active", UNIT]) == "active"
            && m.systemctl(&["show", "-P", "MainPID", UNIT]) != first
            && m.0.exec(&["specd", "status"]).status.success();
        served.then_some(f)
    })
    .unwrap_or_else(|e| panic!("{e}\nagent:\n{}", m.agent_journal()));
    let applied_time = t.elapsed();
    let journal = m.agent_journal();
    let unchecked: Vec<&str> = journal.lines().filter(|l| l.contains("not checked")).collect();
    assert!(unchecked.is_empty(), "{unchecked:#?}");
    assert_eq!(m.systemctl(&["is-enabled", UNIT]), "enabled");
    let server = m.systemctl(&["show", "-P", "MainPID", UNIT]);
    assert!(m.is_link("/etc/systemd/system/multi-user.target.wants/specd.service"));
    assert!(m.exists(&format!("/var/lib/specd/units/{UNIT}.json")));
    // A file of the operator's own beside the config (as agent.yaml's token_file suggests).
    m.write("/etc/specd/git-token", "not-a-real-token\n");

    let served = |when: &str| {
        assert_eq!(m.systemctl(&["is-active", UNIT]), "active", "{when}: the managed unit runs");
        assert_eq!(m.systemctl(&["show", "-P", "MainPID", UNIT]), server, "{when}: the same server, never restarted");
        assert_eq!(m.systemctl(&["is-enabled", UNIT]), "enabled", "{when}: it still starts at boot");
        assert_eq!(m.sh(&format!("cat /etc/systemd/system/{UNIT}")), unit_file, "{when}: its unit file stays");
    };

    // Remove: the agent stopped and gone; its config, state and enablement link kept.
    let t = Instant::now();
    m.sh("apt-get remove --yes specd");
    assert_eq!(m.sh("dpkg-query -W -f '${Status}' specd"), "deinstall ok config-files");
    assert_eq!(m.systemctl(&["is-active", "specd.service"]), "inactive");
    assert!(!m.exists("/usr/bin/specd") && !m.exists("/usr/lib/systemd/system/specd.service"));
    assert!(m.exists("/etc/specd/agent.yaml") && m.exists(&format!("/var/lib/specd/units/{UNIT}.json")));
    assert!(m.is_link("/etc/systemd/system/multi-user.target.wants/specd.service"));
    served("after remove");

    // Purge: the enablement link, the conffile and the state go; the operator's file stays with
    // its directory; the managed unit is untouched and serving.
    m.sh("apt-get purge --yes specd");
    let purge_time = t.elapsed();
    assert_eq!(m.0.exec(&["dpkg-query", "-W", "specd"]).status.code(), Some(1), "dpkg knows no specd");
    assert!(!m.is_link("/etc/systemd/system/multi-user.target.wants/specd.service"));
    assert!(!m.exists("/var/lib/specd"), "the state directory is removed");
    assert!(!m.exists("/etc/specd/agent.yaml"));
    assert_eq!(m.sh("ls -A /etc/specd"), "git-token\n", "only the operator's own file is left");
    assert!(!m.exists("/usr/share/doc/specd"));
    assert_eq!(m.sh("find /etc/systemd/system -name 'specd*'"), "", "nothing of the agent's unit is left");
    served("after purge");

    let teardown = m.0.shutdown().unwrap();
    eprintln!(
        "Debian root {} in {root_time:.1?}; package built in {package_time:.1?}; boot {:.1?}; \
         install to two commits applied {applied_time:.1?}; remove and purge {purge_time:.1?}; poweroff {teardown:.1?}",
        if made { "made" } else { "cached" },
        boot_time,
    );
}
