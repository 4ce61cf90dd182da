//! Running commands and reading state inside the box, as the specd agent does.

use specd_e2e::{SystemdBox, wait_until};
use std::time::Duration;

fn boot() -> SystemdBox {
    SystemdBox::boot().unwrap_or_else(|e| panic!("cannot boot the systemd box: {e:#}"))
}

#[test]
fn exec_env_stdin_and_files() {
    let b = boot();
    let out = b.exec_env(&["sh", "-c", "echo $SPECD_X; pwd"], &[("SPECD_X", "hello")]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hello\n/\n");
    let out = b.exec_stdin(&["cat"], b"piped in");
    assert_eq!(out.stdout, b"piped in");
    let out = b.sh("exit 3");
    assert_eq!(out.status.code(), Some(3));
    assert!(b.sh_check("exit 3").is_err());
    b.write_file("/var/lib/specd/state/x.json", "{}").unwrap();
    assert_eq!(b.read_to_string("/var/lib/specd/state/x.json").unwrap(), "{}");
    assert!(b.read_file("/var/lib/specd/nope").is_err());
    // The box's pid namespace: exec'd commands see systemd as PID 1.
    assert_eq!(b.check(&["cat", "/proc/1/comm"]).unwrap().trim(), "systemd");
    b.shutdown().unwrap();
}

#[test]
fn journal_shows_unit_output_and_systemd_stop_timeout() {
    let b = boot();
    b.write_file(
        "/etc/systemd/system/stubborn.service",
        "[Service]\nExecStart=/bin/sh -c 'echo started stubborn; trap \"echo got TERM, ignoring\" TERM; while :; do sleep 0.1; done'\nTimeoutStopSec=1\n",
    )
    .unwrap();
    b.systemctl_check(&["daemon-reload"]).unwrap();
    b.systemctl_check(&["start", "stubborn.service"]).unwrap();
    wait_until("unit output in the journal", Duration::from_secs(10), || {
        b.journal("stubborn.service").unwrap().contains("started stubborn")
    })
    .unwrap();
    // Blocks until systemd gave up waiting and killed it.
    let _ = b.systemctl(&["stop", "stubborn.service"]);
    let p = b.show("stubborn.service", &["Result", "ActiveState"]).unwrap();
    assert_eq!(p["Result"], "timeout", "{p:?}");
    assert_eq!(p["ActiveState"], "failed", "{p:?}");
    wait_until("systemd's kill message in the journal", Duration::from_secs(10), || {
        b.journal("stubborn.service").unwrap().contains("State 'stop-sigterm' timed out. Killing.")
    })
    .unwrap();
    let j = b.journal("stubborn.service").unwrap();
    assert!(j.contains("got TERM, ignoring"), "{j}");
    assert!(j.contains("Failed with result 'timeout'"), "{j}");
    b.shutdown().unwrap();
}

#[test]
fn unit_memory_limit_is_enforced_in_the_box() {
    let b = boot();
    // MemoryMax= on this hybrid host maps to the v1 memory controller.
    b.write_file(
        "/etc/systemd/system/hog.service",
        "[Service]\nExecStart=/bin/sh -c 'x=$(head -c 200000000 /dev/zero | tr \"\\\\0\" a); echo survived'\nMemoryMax=32M\n",
    )
    .unwrap();
    b.systemctl_check(&["daemon-reload"]).unwrap();
    let _ = b.systemctl(&["start", "hog.service"]);
    wait_until("hog.service to fail", Duration::from_secs(30), || {
        b.prop("hog.service", "ActiveState").unwrap() == "failed"
    })
    .unwrap();
    let p = b.show("hog.service", &["Result", "ExecMainCode", "ExecMainStatus"]).unwrap();
    // The kernel's OOM killer SIGKILLed it. systemd reports Result=oom-kill
    // only where it can read cgroup2 memory.events; on a hybrid host (v1
    // memory controller) it is Result=signal with status 9.
    let expected = match b.cgroup_layout() {
        specd_e2e::CgroupLayout::Unified => "oom-kill",
        _ => "signal",
    };
    assert_eq!(p["Result"], expected, "{p:?}");
    assert_eq!((p["ExecMainCode"].as_str(), p["ExecMainStatus"].as_str()), ("2", "9"), "{p:?}");
    let j = b.journal("hog.service").unwrap();
    assert!(!j.contains("survived"), "{j}");
    assert!(j.contains("status=9/KILL"), "{j}");
    b.shutdown().unwrap();
}
