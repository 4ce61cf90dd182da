//! What an operator does to a unit the agent runs, in the box: suspend it (a commit is not
//! applied to it while the other unit's is), resume it (applied), roll it back (the previous good
//! unit runs, and stays while the source does not move; a new commit moves it forward).

use std::time::Duration;

use crate::common::*;
use specd_e2e::BoxConfig;

/// The fleet of these tests, with their own helpers.
struct HoldFleet(Fleet);

impl std::ops::Deref for HoldFleet {
    type Target = Fleet;
    fn deref(&self) -> &Fleet {
        &self.0
    }
}

impl HoldFleet {
    fn spec(&self, unit: &str, port: u16, steps: u32) -> String {
        let service =
            "  service: {restart: always, timeout_stop_sec: 5, environment: {SPECD_STANDIN_LOAD_MS: \"200\"}}\n";
        sglang_spec(&self.e.standin, unit, port, steps, service)
    }

    fn start_agent(&self) {
        self.run_agent(&self.repo.display().to_string(), "", "");
    }

    fn steps(&self, port: u16) -> Option<u64> {
        let (c, b) = http_get(port, "/get_server_info")?;
        (c == 200)
            .then(|| serde_json::from_str::<serde_json::Value>(&b).ok()?["speculative_num_steps"].as_u64())
            .flatten()
    }

    fn fail(&self, err: anyhow::Error) -> ! {
        panic!("{err}\nagent journal:\n{}", self.e.b.journal(AGENT).unwrap_or_default())
    }

    fn wait_steps(&self, port: u16, steps: u64) {
        wait_until(&format!("port {port} to serve steps={steps}"), Duration::from_secs(60), || {
            self.steps(port) == Some(steps)
        })
        .unwrap_or_else(|e| self.fail(e));
    }

    fn metrics(&self) -> String {
        http_get(self.listen, "/metrics").map(|(_, b)| b).unwrap_or_default()
    }

    /// A metric's value (the line that starts with `series`), 0 when absent.
    fn metric(&self, series: &str) -> f64 {
        self.metrics()
            .lines()
            .find(|l| l.starts_with(series))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or(0.0)
    }

    /// How many times the agent looked at `unit` and left it alone.
    fn held_looks(&self, unit: &str) -> f64 {
        self.metric(&format!("specd_reconciles_total{{unit=\"{unit}\",result=\"held\"}}"))
    }

    /// Wait until the agent has looked at `unit` under its hold more often than `before`.
    fn wait_held_look(&self, unit: &str, before: f64) {
        wait_until(&format!("the agent to look at {unit} under its hold"), Duration::from_secs(30), || {
            self.held_looks(unit) > before
        })
        .unwrap_or_else(|e| self.fail(e));
    }

    fn specd(&self, args: &[&str]) -> (bool, String) {
        let o = self.e.specd(args);
        (o.status.success(), text(&o))
    }
}

#[test]
fn suspend_resume_and_rollback_with_a_pin() {
    let f = HoldFleet(Fleet::new());
    let (a, b) = (f.e.port, free_port());
    f.commit(&[("a.yaml", &f.spec("model-a.service", a, 5)), ("b.yaml", &f.spec("model-b.service", b, 5))], "5");
    f.start_agent();
    f.wait_steps(a, 5);
    f.wait_steps(b, 5);

    // Unknown units are refused (a typo suspends nothing).
    let (ok, out) = f.specd(&["suspend", "model-x.service"]);
    assert!(!ok && out.contains("specd has no state for this unit"), "{out}");

    // Suspend: a commit reaches the other unit, not this one; the drift is reported.
    let before = f.held_looks("model-a.service");
    let (ok, out) = f.specd(&["suspend", "model-a.service", "--for", "1h", "--reason", "incident 7"]);
    assert!(ok, "{out}");
    assert!(out.contains("model-a.service: suspended by root@") && out.contains(": incident 7"), "{out}");
    f.wait_held_look("model-a.service", before);
    let pid_a = f.e.main_pid("model-a.service");
    let before = f.held_looks("model-a.service");
    f.commit(&[("a.yaml", &f.spec("model-a.service", a, 6)), ("b.yaml", &f.spec("model-b.service", b, 6))], "6");
    f.wait_steps(b, 6);
    f.wait_held_look("model-a.service", before);
    assert_eq!(f.steps(a), Some(5));
    assert_eq!(f.e.main_pid("model-a.service"), pid_a);
    let m = f.metrics();
    assert!(m.contains("specd_unit_hold{unit=\"model-a.service\",kind=\"suspend\"} 1"), "{m}");
    assert!(m.contains("specd_unit_sync{unit=\"model-a.service\",status=\"OutOfSync\"} 1"), "{m}");
    assert!(m.contains("specd_unit_hold{unit=\"model-b.service\",kind=\"suspend\"} 0"), "{m}");
    let (_, st) = f.specd(&["status"]);
    let a_status = st.split("model-b.service:").next().unwrap();
    assert!(a_status.contains("model-a.service: OutOfSync Healthy"), "{st}");
    assert!(a_status.contains("why: the spec changed: deployed unit"), "{st}");
    assert!(a_status.contains("hold: suspended by root@") && a_status.contains(" until "), "{st}");
    assert!(a_status.contains("a hand `specd apply` still applies"), "{st}");
    let (_, h) = f.specd(&["history", "model-a.service"]);
    assert!(h.contains("HoldSet") && h.contains("incident 7"), "{h}");

    // Resume: the commit is applied.
    let (ok, out) = f.specd(&["resume", "model-a.service"]);
    assert!(ok && out.contains("no longer suspended"), "{out}");
    f.wait_steps(a, 6);
    let (_, h) = f.specd(&["history", "model-a.service"]);
    assert!(h.contains("HoldCleared") && h.contains("resumed by root@"), "{h}");
    let (ok, out) = f.specd(&["resume", "model-a.service"]);
    assert!(ok && out.contains("not held"), "{out}");

    // Rollback: the previous good unit (steps 5) runs, pinned.
    let (ok, out) = f.specd(&["rollback", "model-a.service", "--reason", "6 steps regress"]);
    assert!(ok, "{out}");
    assert!(out.contains("rolling back to unit") && out.contains("pinned by root@"), "{out}");
    assert_eq!(f.steps(a), Some(5), "{out}");
    let pid_a = f.e.main_pid("model-a.service");
    let (_, st) = f.specd(&["status"]);
    assert!(st.contains("hold: pinned by root@"), "{st}");

    // It stays while the source does not change: a forced reconcile of everything, and a commit
    // that changes only the other unit.
    let before = f.held_looks("model-a.service");
    let (ok, out) = f.specd(&["reconcile"]);
    assert!(ok, "{out}");
    f.wait_held_look("model-a.service", before);
    let before = f.held_looks("model-a.service");
    f.commit(&[("b.yaml", &f.spec("model-b.service", b, 7))], "b 7");
    f.wait_steps(b, 7);
    f.wait_held_look("model-a.service", before);
    assert_eq!(f.steps(a), Some(5));
    assert_eq!(f.e.main_pid("model-a.service"), pid_a);
    assert!(f.metrics().contains("specd_unit_hold{unit=\"model-a.service\",kind=\"pin\"} 1"));

    // A new desired unit for it moves it forward, and the pin is gone.
    f.commit(&[("a.yaml", &f.spec("model-a.service", a, 8))], "a 8");
    f.wait_steps(a, 8);
    let (_, h) = f.specd(&["history", "model-a.service"]);
    assert!(h.contains("HoldCleared") && h.contains("the source's desired unit is"), "{h}");
    wait_until("status to be green", Duration::from_secs(20), || f.e.specd(&["status"]).status.success())
        .unwrap_or_else(|e| f.fail(e));
    let (_, st) = f.specd(&["status"]);
    assert!(!st.contains("hold:"), "{st}");

    // A suspend for a while: the commit waits, then the agent applies it by itself.
    let (ok, out) = f.specd(&["suspend", "model-a.service", "--for", "3s"]);
    assert!(ok, "{out}");
    let before = f.held_looks("model-a.service");
    f.commit(&[("a.yaml", &f.spec("model-a.service", a, 9))], "a 9");
    f.wait_held_look("model-a.service", before);
    assert_eq!(f.steps(a), Some(8));
    f.wait_steps(a, 9);
    let (_, h) = f.specd(&["history", "model-a.service"]);
    assert!(h.contains("HoldCleared") && h.contains(": it expired at "), "{h}");

    // A rollback to a unit specd never ran is refused, and changes nothing.
    let (ok, out) = f.specd(&["rollback", "model-a.service", "--to", "0000ffff"]);
    assert!(!ok && out.contains("no good unit 0000ffff is recorded"), "{out}");
    assert_eq!(f.steps(a), Some(9));
    f.0.e.b.shutdown().unwrap();
}

/// Two boots over the same unit directory and state: the server specd applied comes back by
/// itself at the second boot (specd enabled it), and `specd apply` verifies it without
/// restarting it. `service.enabled: false` then disables it, and restarts nothing either.
#[test]
fn a_server_comes_back_at_boot_and_is_verified_without_a_restart() {
    let persist = tempfile::tempdir().unwrap();
    let boot = || {
        let cfg = BoxConfig { persist: Some(persist.path().to_path_buf()), ..Default::default() };
        Env {
            b: SystemdBox::boot_with(cfg).unwrap(),
            port: 0,
            specd: env!("CARGO_BIN_EXE_specd").into(),
            standin: bin_path("specd-standin").display().to_string(),
        }
    };
    let port = free_port();
    const UNIT: &str = "boot-a.service";
    let mut e = boot();
    e.port = port;
    let spec = e.spec(UNIT, 5, "");
    let o = e.specd(&["apply", "-f", &e.put("a.yaml", &spec)]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(e.b.prop(UNIT, "UnitFileState").unwrap(), "enabled");
    let st = text(&e.specd(&["status"]));
    assert!(st.contains(&format!("{UNIT}: InSync Healthy")) && !st.contains("start at boot"), "{st}");
    let first_pid = e.main_pid(UNIT);
    e.b.shutdown().unwrap();

    // The second boot: nobody runs specd; systemd starts the server.
    let mut e = boot();
    e.port = port;
    wait_until("the server to be ready after the boot", Duration::from_secs(60), || {
        http_get(port, "/health_generate").is_some_and(|(c, _)| c == 200) && e.served_steps() == Some(5)
    })
    .unwrap_or_else(|err| panic!("{err}\n{}", e.b.journal(UNIT).unwrap_or_default()));
    let (pid, invocation) = (e.main_pid(UNIT), e.b.prop(UNIT, "InvocationID").unwrap());
    assert!(pid > 0 && !invocation.is_empty());
    // specd finds its state and the unit it wrote: in sync, nothing restarted.
    let o = e.specd(&["apply", "-f", &e.put("a.yaml", &spec)]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains(&format!("InSync: {UNIT} runs unit")), "{}", text(&o));
    assert_eq!((e.main_pid(UNIT), e.b.prop(UNIT, "InvocationID").unwrap()), (pid, invocation.clone()));
    let h = text(&e.specd(&["history", UNIT]));
    assert_eq!(h.matches("Applied: ").count(), 1, "one apply, at the first boot: {h}");
    eprintln!("pid {first_pid} at the first boot, {pid} at the second");

    // Told not to start at boot: disabled, the server left as it runs.
    let off = e.spec(UNIT, 5, "  service: {enabled: false}\n");
    let o = e.specd(&["apply", "-f", &e.put("a.yaml", &off)]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("no longer starts at boot"), "{}", text(&o));
    assert_eq!(e.b.prop(UNIT, "UnitFileState").unwrap(), "disabled");
    assert_eq!((e.main_pid(UNIT), e.b.prop(UNIT, "InvocationID").unwrap()), (pid, invocation));
    // And enabled again by the spec that says so; a hand `systemctl disable` shows in status.
    let o = e.specd(&["apply", "-f", &e.put("a.yaml", &spec)]);
    assert!(o.status.success() && text(&o).contains("starts at boot now"), "{}", text(&o));
    e.b.systemctl_check(&["disable", UNIT]).unwrap();
    let st = text(&e.specd(&["status"]));
    assert!(st.contains("the unit is not enabled: it would not start at boot"), "{st}");
    e.b.shutdown().unwrap();
}
