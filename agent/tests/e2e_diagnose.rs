//! scratch recorder (to be replaced)

use specd_e2e::{SystemdBox, wait_until};
use std::time::Duration;

const FIELDS: &str = "MESSAGE,_PID,_COMM,SYSLOG_IDENTIFIER,_SYSTEMD_INVOCATION_ID,INVOCATION_ID,UNIT,_SYSTEMD_UNIT,OBJECT_SYSTEMD_UNIT,MESSAGE_ID,JOB_TYPE,JOB_RESULT,EXIT_CODE,EXIT_STATUS,PRIORITY,_TRANSPORT,_UID,SPECD_ACTION";

fn dump(b: &SystemdBox, unit: &str, dir: &str) {
    let j = b.exec(&[
        "journalctl",
        "--no-pager",
        "-o",
        "json",
        &format!("--output-fields={FIELDS}"),
        "-u",
        unit,
    ]);
    std::fs::write(format!("{dir}/{unit}.journal.json"), &j.stdout).unwrap();
    let s = b.exec(&["systemctl", "show", unit]);
    std::fs::write(format!("{dir}/{unit}.show"), &s.stdout).unwrap();
    let all = b.exec(&[
        "journalctl",
        "--no-pager",
        "-o",
        "json",
        &format!("--output-fields={FIELDS}"),
    ]);
    std::fs::write(format!("{dir}/all.journal.json"), &all.stdout).unwrap();
}

#[test]
#[ignore]
fn scratch() {
    let dir = std::env::var("REC").unwrap();
    let b = SystemdBox::boot().unwrap();
    let w = |n: &str, t: &str| {
        b.write_file(&format!("/etc/systemd/system/{n}"), t)
            .unwrap()
    };
    w(
        "slow.service",
        "[Service]\nExecStart=/bin/sh -c 'echo started; trap \"echo draining 16 requests\" TERM; while :; do sleep 0.1; done'\nTimeoutStopSec=2\n",
    );
    w(
        "crash.service",
        "[Service]\nExecStart=/bin/sh -c 'echo Traceback >&2; echo RuntimeError: boom >&2; exit 3'\n",
    );
    w("clean.service", "[Service]\nExecStart=/bin/sleep 1000\n");
    w(
        "wd.service",
        "[Service]\nExecStart=/bin/sleep 1000\nWatchdogSec=1\n",
    );
    w(
        "limit.service",
        "[Service]\nExecStart=/bin/sh -c 'echo dying; exit 1'\nRestart=always\nRestartSec=100ms\n[Unit]\nStartLimitBurst=3\nStartLimitIntervalSec=60\n",
    );
    w(
        "hog.service",
        "[Service]\nExecStart=/bin/sh -c 'echo hogging; tail /dev/zero'\nMemoryLimit=40M\n",
    );
    w(
        "hog2.service",
        "[Service]\nExecStart=/bin/sh -c 'echo hogging; tail /dev/zero'\nMemoryMax=40M\n",
    );
    w("stale.service", "[Service]\nExecStart=/bin/sleep 1000\n");
    w(
        "bound.service",
        "[Unit]\nBindsTo=clean.service\nAfter=clean.service\n[Service]\nExecStart=/bin/sleep 1000\n",
    );
    b.systemctl_check(&["daemon-reload"]).unwrap();
    // stale: change on disk after reload, then start
    w("stale.service", "[Service]\nExecStart=/bin/sleep 2000\n");
    let o = b.systemctl(&["start", "stale.service"]);
    eprintln!(
        "stale start: {:?} {}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
    b.systemctl_check(&[
        "start",
        "slow.service",
        "clean.service",
        "wd.service",
        "bound.service",
    ])
    .unwrap();
    let _ = b.systemctl(&[
        "start",
        "crash.service",
        "limit.service",
        "hog.service",
        "hog2.service",
    ]);
    b.sh("printf 'MESSAGE=specd: stopping clean.service for apply\\nOBJECT_SYSTEMD_UNIT=clean.service\\nSYSLOG_IDENTIFIER=specd\\nSPECD_ACTION=stop\\n' | logger --journald");
    let _ = b.systemctl(&["stop", "slow.service", "clean.service"]);
    wait_until("hog", Duration::from_secs(30), || {
        b.prop("hog.service", "ActiveState").unwrap() == "failed"
    })
    .unwrap();
    eprintln!("{:?}", b.sh("cat /sys/fs/cgroup/memory/system.slice/hog2.service/memory.oom_control; ls /sys/fs/cgroup/memory/system.slice/"));
    wait_until("wd", Duration::from_secs(30), || {
        b.prop("wd.service", "ActiveState").unwrap() == "failed"
    })
    .unwrap();
    let r = wait_until("limit", Duration::from_secs(10), || {
        b.prop("limit.service", "Result").unwrap() == "start-limit-hit"
    });
    eprintln!(
        "limit: {r:?} {:?}",
        b.show(
            "limit.service",
            &["Result", "ActiveState", "SubState", "NRestarts"]
        )
    );
    b.systemctl_check(&["daemon-reload"]).unwrap();
    for u in [
        "slow.service",
        "crash.service",
        "clean.service",
        "wd.service",
        "limit.service",
        "hog.service",
        "hog2.service",
        "stale.service",
        "bound.service",
    ] {
        dump(&b, u, &dir);
    }
    b.shutdown().unwrap();
}
