//! The box boots a real systemd, runs units, and goes away without a trace.

use specd_e2e::{CgroupLayout, SystemdBox};

fn boot() -> SystemdBox {
    SystemdBox::boot().unwrap_or_else(|e| panic!("cannot boot the systemd box: {e:#}"))
}

#[test]
fn boots_running_systemd_252_and_tears_down_clean() {
    let b = boot();
    let state = b.systemctl(&["is-system-running"]);
    assert_eq!(String::from_utf8_lossy(&state.stdout).trim(), "running");
    // PID 1 inside is systemd, not the host's init.
    assert_eq!(b.read_to_string("/proc/1/comm").unwrap().trim(), "systemd");
    let version = b.check(&["systemctl", "--version"]).unwrap();
    assert!(version.starts_with("systemd 252"), "{version}");
    // A private unit path: the host's units are not visible.
    let units = b.systemctl_check(&["list-unit-files", "--no-pager", "--no-legend"]).unwrap();
    assert!(!units.contains("systemd-tmpfiles-setup.service\tstatic"), "{units}");
    assert!(!units.contains("ssh.service"), "{units}");
    let trace = b.trace();
    let td = b.shutdown().expect("clean teardown");
    assert!(td.clean_poweroff, "poweroff did not end PID 1 in time");
    assert!(trace.leaks().is_empty(), "{:?}", trace.leaks());
}

#[test]
fn unit_cgroup_and_main_pid_are_visible_inside() {
    let b = boot();
    b.write_file("/etc/systemd/system/t1.service", "[Service]\nExecStart=/bin/sleep 1000\n").unwrap();
    b.systemctl_check(&["daemon-reload"]).unwrap();
    b.systemctl_check(&["start", "t1.service"]).unwrap();
    let p = b.show("t1.service", &["ControlGroup", "MainPID", "ActiveState"]).unwrap();
    assert_eq!(p["ActiveState"], "active");
    assert_eq!(p["ControlGroup"], "/system.slice/t1.service");
    assert_eq!(b.cgroup_layout(), CgroupLayout::Hybrid);
    let cg = &p["ControlGroup"];
    let ev =
        b.read_to_string(&format!("{}/cgroup.events", b.cgroup_layout().events_dir(cg).unwrap().display())).unwrap();
    assert!(ev.contains("populated 1"), "{ev}");
    let procs = b.read_to_string(&format!("{}/cgroup.procs", b.cgroup_layout().procs_dir(cg).display())).unwrap();
    assert_eq!(procs.trim(), p["MainPID"]);
    let cmdline = b.read_file(&format!("/proc/{}/cmdline", p["MainPID"])).unwrap();
    assert_eq!(cmdline, b"/bin/sleep\x001000\x00");
    b.systemctl_check(&["stop", "t1.service"]).unwrap();
    let gone = b.sh("test -e /sys/fs/cgroup/unified/system.slice/t1.service");
    assert!(!gone.status.success(), "cgroup dir still there after stop");
    b.shutdown().expect("clean teardown");
}
