//! The box is isolated from the host and never leaks, even when a test
//! panics or the test process is killed.

use specd_e2e::{BoxTrace, SystemdBox, wait_until};
use std::time::Duration;

fn boot() -> SystemdBox {
    SystemdBox::boot().unwrap_or_else(|e| panic!("cannot boot the systemd box: {e:#}"))
}

const UNIT_WITH_DEFAULT_DEPS: &str = "[Unit]\nDescription=default dependencies on\n\n[Service]\nExecStart=/bin/sleep 1000\n\n[Install]\nWantedBy=multi-user.target\n";

#[test]
fn canary_in_host_tmp_survives_a_box_life() {
    let canary = tempfile::Builder::new().prefix("specd-canary-").tempfile_in("/tmp").unwrap();
    std::fs::write(canary.path(), "still here").unwrap();
    let b = boot();
    // A service with default dependencies, enabled and started: on a box
    // that could see the host's units this pulls in systemd-tmpfiles-setup.
    b.write_file("/etc/systemd/system/dd.service", UNIT_WITH_DEFAULT_DEPS).unwrap();
    b.systemctl_check(&["daemon-reload"]).unwrap();
    b.systemctl_check(&["enable", "--now", "dd.service"]).unwrap();
    let tmpfiles = b.show("systemd-tmpfiles-setup.service", &["LoadState", "ActiveState"]).unwrap();
    assert_ne!(tmpfiles["ActiveState"], "active", "{tmpfiles:?}");
    // The box's /tmp is its own: a file written there never reaches the host.
    b.write_file("/tmp/written-in-box", "x").unwrap();
    assert!(!std::path::Path::new("/tmp/written-in-box").exists());
    assert!(b.read_file(canary.path().to_str().unwrap()).is_err(), "host /tmp visible in the box");
    b.systemctl_check(&["stop", "dd.service"]).unwrap();
    b.shutdown().unwrap();
    assert_eq!(std::fs::read_to_string(canary.path()).unwrap(), "still here");
}

#[test]
fn binds_show_a_host_directory_inside() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("spec.yaml"), "engine: sglang\n").unwrap();
    let b = SystemdBox::boot_with(specd_e2e::BoxConfig { binds: vec![dir.path().to_path_buf()], ..Default::default() })
        .unwrap();
    let p = dir.path().join("spec.yaml");
    assert_eq!(b.read_to_string(p.to_str().unwrap()).unwrap(), "engine: sglang\n");
    b.write_file(dir.path().join("from-box").to_str().unwrap(), "hi").unwrap();
    assert_eq!(std::fs::read_to_string(dir.path().join("from-box")).unwrap(), "hi");
    b.shutdown().unwrap();
    // The bind lived in the box's mount namespace only.
    assert!(dir.path().join("spec.yaml").exists());
}

#[test]
fn no_leak_when_the_test_panics() {
    let (tx, rx) = std::sync::mpsc::channel::<BoxTrace>();
    let h = std::thread::spawn(move || {
        let b = boot();
        b.write_file(
            "/etc/systemd/system/busy.service",
            "[Service]\nExecStart=/bin/sh -c 'trap \"\" TERM; sleep 1000 & wait'\n",
        )
        .unwrap();
        b.systemctl_check(&["daemon-reload"]).unwrap();
        b.systemctl_check(&["start", "busy.service"]).unwrap();
        // A process started by exec, still running when the test dies.
        // Deliberately never waited for: the box must cope with it.
        #[allow(clippy::zombie_processes)]
        let _orphan = b.command(&["sleep", "1000"]).spawn().unwrap();
        tx.send(b.trace()).unwrap();
        panic!("the test fails while the box runs");
    });
    assert!(h.join().is_err(), "the thread should have panicked");
    let trace = rx.recv().unwrap();
    assert!(trace.init_pid != 0);
    assert!(trace.leaks().is_empty(), "leaks after a panicking test: {:#?}", trace.leaks());
    assert!(
        !std::path::Path::new(&format!("/proc/{}", trace.init_pid)).exists()
            || std::fs::read_to_string(format!("/proc/{}/comm", trace.init_pid)).unwrap_or_default().trim()
                != "systemd"
    );
}

#[test]
fn two_boxes_side_by_side_do_not_share_units_or_cgroups() {
    let a = boot();
    let b = boot();
    for x in [&a, &b] {
        x.write_file("/etc/systemd/system/same.service", "[Service]\nExecStart=/bin/sleep 1000\n").unwrap();
        x.systemctl_check(&["daemon-reload"]).unwrap();
    }
    a.systemctl_check(&["start", "same.service"]).unwrap();
    assert_eq!(a.prop("same.service", "ActiveState").unwrap(), "active");
    assert_eq!(b.prop("same.service", "ActiveState").unwrap(), "inactive");
    b.systemctl_check(&["start", "same.service"]).unwrap();
    let pa = a.prop("same.service", "MainPID").unwrap();
    let procs_b = b.read_to_string("/sys/fs/cgroup/systemd/system.slice/same.service/cgroup.procs").unwrap();
    assert_eq!(procs_b.lines().count(), 1, "{procs_b}");
    // Stopping in one box leaves the other alone.
    b.systemctl_check(&["stop", "same.service"]).unwrap();
    assert_eq!(a.prop("same.service", "ActiveState").unwrap(), "active");
    assert_eq!(a.prop("same.service", "MainPID").unwrap(), pa);
    assert_ne!(a.name(), b.name());
    b.shutdown().unwrap();
    assert_eq!(a.prop("same.service", "ActiveState").unwrap(), "active");
    a.shutdown().unwrap();
}

/// Run as a child process by `killed_test_process_takes_its_box_along`: boots
/// a box, prints its trace, and waits to be SIGKILLed.
#[test]
fn child_boots_and_waits_to_be_killed() {
    if std::env::var_os("SPECD_E2E_KILL_CHILD").is_none() {
        return; // only meaningful as the child of the test below
    }
    let b = boot();
    b.write_file("/etc/systemd/system/s.service", "[Service]\nExecStart=/bin/sleep 1000\n").unwrap();
    b.systemctl_check(&["daemon-reload"]).unwrap();
    b.systemctl_check(&["start", "s.service"]).unwrap();
    println!("BOX {} {} {} {}", b.name(), b.pid(), b.trace().pid_ns, b.trace().mnt_ns);
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap(); // blocks until killed
}

#[test]
fn killed_test_process_takes_its_box_along() {
    use std::io::BufRead;
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "isolation::child_boots_and_waits_to_be_killed", "--nocapture", "--test-threads=1"])
        .env("SPECD_E2E_KILL_CHILD", "1")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut found = None;
    for l in out.lines() {
        let l = l.unwrap();
        // libtest prints "test <name> ... " before the test's own output.
        if let Some(i) = l.find("BOX ") {
            found = Some(l[i + 4..].to_string());
            break;
        }
    }
    let found = found.expect("the child printed its box");
    let parts: Vec<&str> = found.split(' ').collect();
    let (name, init_pid, pid_ns): (&str, u32, u64) = (parts[0], parts[1].parse().unwrap(), parts[2].parse().unwrap());
    assert!(std::path::Path::new(&format!("/proc/{init_pid}")).exists());
    child.kill().unwrap(); // SIGKILL: no Drop, no unwinding
    child.wait().unwrap();
    let in_ns = || {
        std::fs::read_dir("/proc").unwrap().flatten().any(|e| {
            std::fs::read_link(e.path().join("ns/pid")).is_ok_and(|l| l.to_string_lossy() == format!("pid:[{pid_ns}]"))
        })
    };
    wait_until("every process of the killed test's box to die", Duration::from_secs(10), || !in_ns()).unwrap();
    // Its cgroups are left; the next boot removes them.
    let b = boot();
    let leftover: Vec<_> = walk_cgroup_dirs().into_iter().filter(|p| p.ends_with(name)).collect();
    assert!(leftover.is_empty(), "stale box cgroups not swept: {leftover:?}");
    b.shutdown().unwrap();
}

fn walk_cgroup_dirs() -> Vec<std::path::PathBuf> {
    fn walk(d: &std::path::Path, depth: usize, out: &mut Vec<std::path::PathBuf>) {
        if depth > 4 {
            return;
        }
        if let Ok(rd) = std::fs::read_dir(d) {
            for e in rd.flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    out.push(e.path());
                    walk(&e.path(), depth + 1, out);
                }
            }
        }
    }
    let mut out = Vec::new();
    walk(std::path::Path::new("/sys/fs/cgroup"), 0, &mut out);
    out
}
