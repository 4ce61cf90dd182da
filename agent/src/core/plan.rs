//! Deciding what to do: a pure function of what was observed and what is desired. No I/O here;
//! the reconciler observes, calls [`plan`], and carries the steps out.

use serde::Serialize;
use specd_spec::{DriftPolicy, short};

use crate::core::sync::SyncStatus;
use crate::core::unit_state::{ActiveState, LoadState, SubState, UnitFileState};

/// What specd saw on the host for one unit.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Observed {
    /// sha256 of the unit file in the unit directory, `None` when there is none.
    pub deployed_sha256: Option<String>,
    /// Drop-ins that change the unit (any `X.service.d/*.conf` systemd loads).
    pub drop_ins: Vec<String>,
    pub load_state: LoadState,
    pub active_state: ActiveState,
    pub sub_state: SubState,
    pub main_pid: u32,
    pub need_daemon_reload: bool,
    /// The file systemd loaded the unit from.
    pub fragment_path: String,
    /// The main process's argv, when there is one and it could be read.
    pub main_cmdline: Option<Vec<String>>,
    /// The server's reported args differ from the spec (only checked when it is ready).
    pub arg_mismatches: Vec<String>,
    /// The readiness endpoint answers 200.
    pub ready: Option<bool>,
    /// Hash of the unit specd last wrote.
    pub written_sha256: Option<String>,
    /// Why the desired hash is quarantined, if it is.
    pub quarantined: Option<String>,
    /// An earlier apply of the desired hash started and never finished (its process died).
    pub interrupted: bool,
    /// The last unit that ran and passed verification (the rollback target), if rollback is on.
    pub last_good_sha256: Option<String>,
    /// The unit starts at boot (`UnitFileState=enabled`: Some(true); `disabled` or only
    /// `enabled-runtime`: Some(false)); `None` when systemd does not say either (not loaded yet,
    /// static, linked, generated).
    pub enabled: Option<bool>,
}

/// What the spec wants.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Desired {
    pub sha256: String,
    pub argv: Vec<String>,
    pub fragment_path: String,
    pub drift: DriftPolicy,
    pub verify_args: bool,
    /// The spec asks for speculative decoding: after readiness, prove the server drafts.
    pub verify_speculation: bool,
    /// `service.enabled`: the unit starts at boot.
    pub enabled: bool,
}

/// One step of an apply, in the order they run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Step {
    /// Wait for in-flight requests to finish (bounded by `drain_timeout_sec`).
    Drain,
    /// `systemctl stop` (also cancels a pending auto-restart).
    Stop,
    /// Wait until the unit is inactive and its cgroup is empty; report what lingers.
    WaitStopped,
    /// Move drop-ins that change the unit out of the way (kept in the state dir).
    RemoveDropIns,
    /// Write the unit file atomically.
    WriteUnit,
    /// `systemctl daemon-reload`, then check `NeedDaemonReload=no` and `FragmentPath`.
    Reload,
    /// `systemctl start`.
    Start,
    /// The main process's argv is the rendered `ExecStart`.
    VerifyCmdline,
    /// Poll the readiness endpoint until 200.
    WaitReady,
    /// The server's reported args equal the spec.
    VerifyArgs,
    /// One short generation shows the server really drafts tokens (the engine's own evidence),
    /// when the spec asks for speculative decoding.
    VerifySpeculation,
    /// `systemctl enable`: the unit starts at boot. Right after readiness, once the server has
    /// shown that it starts (a unit that never starts is not made to start at boot), and before
    /// the checks that follow (which see a server that died meanwhile); alone when nothing else
    /// differs. It never touches the running server.
    Enable,
    /// `systemctl disable` (`service.enabled: false`). Where `Enable` would be.
    Disable,
}

impl Step {
    pub const ALL: [Step; 13] = [
        Step::Drain,
        Step::Stop,
        Step::WaitStopped,
        Step::RemoveDropIns,
        Step::WriteUnit,
        Step::Reload,
        Step::Start,
        Step::VerifyCmdline,
        Step::WaitReady,
        Step::VerifyArgs,
        Step::VerifySpeculation,
        Step::Enable,
        Step::Disable,
    ];
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Plan {
    pub sync: SyncStatus,
    /// Why, in words a person reads in `status` and `apply --dry-run`.
    pub reasons: Vec<String>,
    pub steps: Vec<Step>,
    /// The unit the steps put in place (said in JSON only when it is not the desired one).
    #[serde(skip_serializing_if = "Toward::is_desired")]
    pub toward: Toward,
}

/// The unit a plan's steps put in place.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Toward {
    /// The desired unit: an apply.
    Desired,
    /// The last good unit: the desired one is quarantined and the host does not run the last
    /// good one (a rollback that did not finish), so the steps restore it.
    LastGood,
}

impl Toward {
    pub fn is_desired(&self) -> bool {
        *self == Toward::Desired
    }
}

/// Whether a process's command line is the rendered argv. A script with a `#!` line (vLLM's
/// `vllm` console script) runs as `[interpreter, (its argument), script, args...]`; that counts
/// when the script is argv[0] (or, for a bare name, a file of that name) and the rest is equal.
pub fn runs_argv(cmdline: &[String], argv: &[String]) -> bool {
    if cmdline == argv {
        return true;
    }
    let Some((prog, args)) = argv.split_first() else { return false };
    for skip in [1, 2] {
        if cmdline.len() != argv.len() + skip {
            continue;
        }
        let script = &cmdline[skip];
        let same_prog = script == prog || (!prog.contains('/') && script.rsplit('/').next() == Some(prog.as_str()));
        if same_prog && cmdline[skip + 1..] == *args {
            return true;
        }
    }
    false
}

/// Decide. Never restarts a healthy server that runs the desired unit.
pub fn plan(o: &Observed, d: &Desired) -> Plan {
    if let Some(p) = masked_or_quarantined(o, d) {
        return p;
    }
    let g = Gaps::of(o, d);
    let (mut reasons, drift) = differences(o, d, &g);
    // An apply that died part-way is finished, whatever the drift policy: the differences are
    // its own half-done steps.
    if o.interrupted {
        reasons.push("an earlier apply of this spec was interrupted; finishing it".to_string());
        reasons.extend(drift);
        return Plan { sync: SyncStatus::Progressing, reasons, steps: finish(o, d, &g), toward: Toward::Desired };
    }
    if g.file_differs && g.new_spec {
        reasons.extend(drift);
        return Plan {
            sync: SyncStatus::OutOfSync,
            reasons,
            steps: full(o, d, g.running, true),
            toward: Toward::Desired,
        };
    }
    if !drift.is_empty() {
        let steps = match d.drift {
            DriftPolicy::Heal => full(o, d, g.running, g.file_differs),
            DriftPolicy::Report => vec![],
        };
        return Plan { sync: SyncStatus::Drifted, reasons: drift, steps, toward: Toward::Desired };
    }

    // The host has the desired unit, loaded. What is its service doing?
    with_boot_step(by_state(o, d), o, d)
}

/// How the host stands against the desired unit, derived once from what was observed.
struct Gaps {
    /// The unit file on disk is not the desired unit.
    file_differs: bool,
    /// The desired unit is not the one specd last wrote: a new desired state (a deploy), not
    /// the host moving away from it (drift).
    new_spec: bool,
    /// The service runs, or has a process.
    running: bool,
    /// systemd loads the unit from another file than specd writes.
    loaded_elsewhere: bool,
    /// The running process's command line is not the desired argv.
    stale_cmdline: bool,
}

impl Gaps {
    fn of(o: &Observed, d: &Desired) -> Gaps {
        let running = o.active_state.may_run() || o.main_pid > 0;
        Gaps {
            file_differs: o.deployed_sha256.as_deref() != Some(d.sha256.as_str()),
            new_spec: o.written_sha256.as_deref() != Some(d.sha256.as_str()),
            running,
            loaded_elsewhere: o.load_state == LoadState::Loaded
                && !o.fragment_path.is_empty()
                && o.fragment_path != d.fragment_path,
            stale_cmdline: running && o.main_cmdline.as_ref().is_some_and(|c| !runs_argv(c, &d.argv)),
        }
    }
}

/// What differs, said: the reasons of a deploy (a new desired state), and the drift (the host
/// moved away from the desired state).
fn differences(o: &Observed, d: &Desired, g: &Gaps) -> (Vec<String>, Vec<String>) {
    let mut reasons = Vec::new();
    let mut drift = Vec::new();
    if g.file_differs {
        match (&o.deployed_sha256, g.new_spec) {
            (None, true) => reasons.push("the unit file does not exist yet".to_string()),
            (Some(h), true) => {
                reasons.push(format!("the spec changed: deployed unit {} → desired {}", short(h), short(&d.sha256)))
            }
            (None, false) => drift.push("the unit file specd wrote was deleted".to_string()),
            (Some(h), false) => drift.push(format!(
                "the unit file was edited by hand (deployed {} ≠ desired {})",
                short(h),
                short(&d.sha256)
            )),
        }
    }
    if !o.drop_ins.is_empty() {
        drift.push(format!("drop-ins change the unit: {}", o.drop_ins.join(", ")));
    }
    if o.need_daemon_reload && !g.file_differs {
        drift.push("systemd runs an older load of the unit file (NeedDaemonReload=yes)".to_string());
    }
    if g.loaded_elsewhere {
        drift.push(format!("systemd loads the unit from {} instead of {}", o.fragment_path, d.fragment_path));
    }
    if g.stale_cmdline && !g.file_differs {
        drift.push("the running process was not started from the deployed unit (its command line differs)".to_string());
    }
    if !o.arg_mismatches.is_empty() && d.verify_args && !g.file_differs {
        drift.push(format!("the server reports args that differ from the spec: {}", o.arg_mismatches.join("; ")));
    }
    (reasons, drift)
}

/// Every step of an apply: drain (when `running`), stop, wait for the empty cgroup, remove the
/// drop-ins (when there are), write the unit (when `write`), reload, start, verify, wait for
/// readiness, enable or disable it, and the checks after readiness.
fn full(o: &Observed, d: &Desired, running: bool, write: bool) -> Vec<Step> {
    let mut s = Vec::new();
    if running {
        s.push(Step::Drain);
    }
    s.extend([Step::Stop, Step::WaitStopped]);
    if !o.drop_ins.is_empty() {
        s.push(Step::RemoveDropIns);
    }
    if write {
        s.push(Step::WriteUnit);
    }
    s.extend([Step::Reload, Step::Start, Step::VerifyCmdline, Step::WaitReady]);
    s.extend(boot_step(o, d, true));
    s.extend(verify_after_ready(d));
    s
}

/// The steps that finish an interrupted apply. A server it already started from the desired
/// unit is not restarted: it is verified and waited for.
fn finish(o: &Observed, d: &Desired, g: &Gaps) -> Vec<Step> {
    let resumable = !g.file_differs
        && !o.need_daemon_reload
        && !g.loaded_elsewhere
        && o.drop_ins.is_empty()
        && g.running
        && o.main_cmdline.as_ref().is_some_and(|c| runs_argv(c, &d.argv));
    if !resumable {
        return full(o, d, g.running, g.file_differs);
    }
    let mut steps = vec![Step::VerifyCmdline, Step::WaitReady];
    steps.extend(boot_step(o, d, false));
    steps.extend(verify_after_ready(d));
    steps
}

/// A mask (a person's decision, or a runtime one: neither drift to heal nor a unit to start;
/// specd says so and touches nothing), or a quarantined desired unit (never retried; the last
/// good unit restored when the host does not run it).
fn masked_or_quarantined(o: &Observed, d: &Desired) -> Option<Plan> {
    if o.load_state == LoadState::Masked {
        return Some(Plan {
            sync: SyncStatus::Masked,
            reasons: vec![
                "the unit is masked; specd changes nothing and does not unmask it (`systemctl unmask` it to let specd manage it)"
                    .into(),
            ],
            steps: vec![],
            toward: Toward::Desired,
        });
    }
    let why = o.quarantined.as_ref()?;
    let running_good =
        o.deployed_sha256 == o.last_good_sha256 && (o.active_state == ActiveState::Active || o.main_pid > 0);
    let healable = d.drift == DriftPolicy::Heal || !running_good && o.main_pid == 0;
    // A rollback that was interrupted (specd killed in it) after it started the last good
    // unit is left to finish loading: that unit ran, verified, before.
    if let Some(g) = o.last_good_sha256.as_ref().filter(|g| **g != d.sha256)
        && !running_good
        && healable
    {
        return Some(Plan {
            sync: SyncStatus::Failed,
            reasons: vec![
                format!("unit {} failed before and is not retried: {why}", short(&d.sha256)),
                format!("the host does not run the last good unit {}; restoring it", short(g)),
            ],
            steps: restore_steps(o.deployed_sha256.as_deref(), g),
            toward: Toward::LastGood,
        });
    }
    Some(Plan {
        sync: SyncStatus::Failed,
        reasons: vec![format!(
            "unit {} failed before and is not retried: {why}; commit a new spec to try again",
            short(&d.sha256)
        )],
        steps: vec![],
        toward: Toward::Desired,
    })
}

/// A host that has the desired unit, loaded, planned by its service's state (`p`): whether it
/// starts at boot as the spec says (under the report policy, only said; a full apply sets it).
/// A server still coming up is looked at again first.
fn with_boot_step(p: Plan, o: &Observed, d: &Desired) -> Plan {
    match (boot_step(o, d, false), p.sync) {
        (Some(b), SyncStatus::InSync | SyncStatus::OutOfSync) => {
            let mut p = p;
            p.reasons.push(match b {
                Step::Enable => "the unit is not enabled: it would not start at boot (service.enabled is true)".into(),
                _ => "the unit is enabled (it starts at boot), but the spec says service.enabled: false".into(),
            });
            if p.sync == SyncStatus::InSync {
                p.sync = SyncStatus::Drifted;
            }
            if d.drift == DriftPolicy::Heal {
                // After readiness when the server is started, else alone.
                let at = p.steps.iter().position(|s| *s == Step::WaitReady).map_or(0, |i| i + 1);
                p.steps.insert(at, b);
            }
            p
        }
        _ => p,
    }
}

/// The plan for a host that has the desired unit, loaded: by what its service is doing.
fn by_state(o: &Observed, d: &Desired) -> Plan {
    match o.active_state {
        ActiveState::Active | ActiveState::Reloading | ActiveState::Refreshing => match o.ready {
            Some(false) => Plan {
                sync: SyncStatus::Progressing,
                reasons: vec!["the server is up but not ready yet".into()],
                steps: vec![],
                toward: Toward::Desired,
            },
            _ => Plan { sync: SyncStatus::InSync, reasons: vec![], steps: vec![], toward: Toward::Desired },
        },
        ActiveState::Activating | ActiveState::Deactivating => Plan {
            sync: SyncStatus::Progressing,
            reasons: vec![format!("systemd is {} the unit ({})", o.active_state, o.sub_state)],
            steps: vec![],
            toward: Toward::Desired,
        },
        _ => {
            let mut steps = vec![Step::Start, Step::VerifyCmdline, Step::WaitReady];
            steps.extend(verify_after_ready(d));
            Plan {
                sync: SyncStatus::OutOfSync,
                reasons: vec![format!("the service is not running ({}/{})", o.active_state, o.sub_state)],
                steps,
                toward: Toward::Desired,
            }
        }
    }
}

/// Whether a unit starts at boot, from systemd's `UnitFileState`: `enabled` yes; `disabled` or
/// `enabled-runtime` (until the next boot only) no; anything else (static, linked, generated,
/// not loaded) is not specd's to change.
pub fn enabled_of(unit_file_state: UnitFileState) -> Option<bool> {
    match unit_file_state {
        UnitFileState::Enabled => Some(true),
        UnitFileState::Disabled | UnitFileState::EnabledRuntime => Some(false),
        _ => None,
    }
}

/// The step that makes the unit start at boot as the spec says, if it does not. `writes`: the
/// sequence writes and loads the unit (a unit systemd did not know is not enabled yet).
fn boot_step(o: &Observed, d: &Desired, writes: bool) -> Option<Step> {
    match (d.enabled, o.enabled) {
        (true, Some(false)) => Some(Step::Enable),
        (true, None) if writes => Some(Step::Enable),
        (false, Some(true)) => Some(Step::Disable),
        _ => None,
    }
}

/// The checks that follow readiness: the server's own args, then proof that it speculates.
fn verify_after_ready(d: &Desired) -> Vec<Step> {
    let mut s = Vec::new();
    if d.verify_args {
        s.push(Step::VerifyArgs);
    }
    if d.verify_speculation {
        s.push(Step::VerifySpeculation);
    }
    s
}

/// What a look at a unit specd is stopping finds (its cgroup emptied once), and what follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stopping {
    /// Stopped (inactive or failed, no main process): done once its cgroup is empty.
    Stopped,
    /// Started again behind specd's back (a `Restart=` timer, a dependency, a person): it is
    /// stopped again.
    StopAgain,
    /// Started again after [`crate::core::timing::RESTOPS`] stops again in this apply: given up.
    KeepsStarting,
    /// Still settling: systemd's next change is waited for (until the stop budget runs out).
    Settling,
}

/// `restops`: how many times this apply stopped the unit again already.
pub fn stopping(active: ActiveState, sub: &SubState, main_pid: u32, restops: u32) -> Stopping {
    if active.is_stopped() && main_pid == 0 {
        return Stopping::Stopped;
    }
    // Up again, and not the stop's own SIGTERM phase of an instance that is still active.
    if matches!(active, ActiveState::Active | ActiveState::Activating) && *sub != SubState::StopSigterm {
        return if restops >= crate::core::timing::RESTOPS { Stopping::KeepsStarting } else { Stopping::StopAgain };
    }
    Stopping::Settling
}

/// The steps that put the last good unit (hash `good`) back (a rollback, or a start after a
/// host fault): the same race-free sequence as an apply, without the drain (what it stops has
/// failed) and with the write only when the file on disk (hash `on_disk`) is not that unit
/// already: the write of the new one may be what failed, and would fail the same way again on
/// a full or read-only unit directory.
pub fn restore_steps(on_disk: Option<&str>, good: &str) -> Vec<Step> {
    let write = on_disk != Some(good);
    [Step::Stop, Step::WaitStopped, Step::WriteUnit, Step::Reload, Step::Start, Step::VerifyCmdline, Step::WaitReady]
        .into_iter()
        .filter(|s| write || *s != Step::WriteUnit)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use Step::*;

    fn desired() -> Desired {
        Desired {
            sha256: "d".repeat(64),
            argv: vec!["/bin/srv".into(), "--steps".into(), "10".into()],
            fragment_path: "/etc/systemd/system/x.service".into(),
            drift: DriftPolicy::Heal,
            verify_args: true,
            verify_speculation: false,
            enabled: true,
        }
    }

    /// A host that runs the desired unit, healthy.
    fn in_sync() -> Observed {
        let d = desired();
        Observed {
            deployed_sha256: Some(d.sha256.clone()),
            drop_ins: vec![],
            load_state: LoadState::Loaded,
            active_state: "active".into(),
            sub_state: SubState::Running,
            main_pid: 42,
            need_daemon_reload: false,
            fragment_path: d.fragment_path.clone(),
            main_cmdline: Some(d.argv.clone()),
            arg_mismatches: vec![],
            ready: Some(true),
            written_sha256: Some(d.sha256.clone()),
            quarantined: None,
            interrupted: false,
            last_good_sha256: None,
            enabled: Some(true),
        }
    }

    const FULL: &[Step] = &[Drain, Stop, WaitStopped, WriteUnit, Reload, Start, VerifyCmdline, WaitReady, VerifyArgs];

    #[test]
    fn a_masked_unit_is_masked_whatever_else_is_true() {
        let d = desired();
        for o in [
            in_sync(),
            Observed { deployed_sha256: Some("e".repeat(64)), ..in_sync() },
            Observed { interrupted: true, active_state: "inactive".into(), main_pid: 0, ..in_sync() },
            Observed { quarantined: Some("failed".into()), last_good_sha256: Some("g".into()), ..in_sync() },
        ] {
            let o =
                Observed { load_state: LoadState::Masked, fragment_path: "/run/systemd/system/x.service".into(), ..o };
            let p = plan(&o, &d);
            assert_eq!((p.sync, p.steps.len()), (SyncStatus::Masked, 0), "{o:?}");
            assert!(p.reasons[0].contains("does not unmask"), "{p:?}");
        }
    }

    #[test]
    fn interpreter_scripts_run_their_argv() {
        let v = |x: &[&str]| x.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let argv = v(&["/opt/vllm/bin/vllm", "serve", "/m"]);
        assert!(runs_argv(&v(&["/opt/vllm/bin/vllm", "serve", "/m"]), &argv));
        assert!(runs_argv(&v(&["/opt/vllm/bin/python3", "/opt/vllm/bin/vllm", "serve", "/m"]), &argv));
        assert!(runs_argv(&v(&["/usr/bin/env", "python3", "/opt/vllm/bin/vllm", "serve", "/m"]), &argv));
        assert!(runs_argv(
            &v(&["/usr/bin/python3", "/usr/local/bin/vllm", "serve", "/m"]),
            &v(&["vllm", "serve", "/m"])
        ));
        assert!(!runs_argv(&v(&["/opt/vllm/bin/python3", "/opt/vllm/bin/vllm", "serve", "/other"]), &argv));
        assert!(!runs_argv(&v(&["/opt/vllm/bin/python3", "/opt/other", "serve", "/m"]), &argv));
        assert!(!runs_argv(&v(&["/opt/vllm/bin/vllm", "serve"]), &argv));
    }

    #[test]
    fn in_sync_does_nothing() {
        let p = plan(&in_sync(), &desired());
        assert_eq!(p.sync, SyncStatus::InSync);
        assert!(p.steps.is_empty());
    }

    #[test]
    fn a_healthy_in_sync_server_is_never_restarted_whatever_else_is_true() {
        // Every combination of the fields that do not make it out of sync.
        for ready in [None, Some(true)] {
            for cmdline in [None, Some(desired().argv)] {
                for drift in [DriftPolicy::Heal, DriftPolicy::Report] {
                    for (verify, speculation) in [(true, true), (true, false), (false, true), (false, false)] {
                        let mut o = in_sync();
                        o.ready = ready;
                        o.main_cmdline = cmdline.clone();
                        let d = Desired { drift, verify_args: verify, verify_speculation: speculation, ..desired() };
                        let p = plan(&o, &d);
                        assert_eq!((p.sync, p.steps.len()), (SyncStatus::InSync, 0), "{o:?} {d:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn a_new_spec_runs_the_full_sequence() {
        let mut o = in_sync();
        o.deployed_sha256 = Some("a".repeat(64));
        o.written_sha256 = Some("a".repeat(64));
        let p = plan(&o, &desired());
        assert_eq!(p.sync, SyncStatus::OutOfSync);
        assert_eq!(p.steps, FULL);
        assert!(p.reasons[0].starts_with("the spec changed: deployed unit aaaaaaaaaaaa → desired dddddddddddd"));
    }

    #[test]
    fn a_new_spec_over_a_stopped_unit_skips_the_drain() {
        let mut o = in_sync();
        o.deployed_sha256 = None;
        o.written_sha256 = None;
        o.active_state = "inactive".into();
        o.main_pid = 0;
        o.main_cmdline = None;
        let p = plan(&o, &desired());
        assert_eq!(p.steps, &FULL[1..]);
        assert_eq!(p.reasons, vec!["the unit file does not exist yet"]);
    }

    #[test]
    fn a_speculative_spec_is_proven_to_draft_after_its_args_are_checked() {
        let mut o = in_sync();
        o.deployed_sha256 = Some("a".repeat(64));
        o.written_sha256 = Some("a".repeat(64));
        let d = Desired { verify_speculation: true, ..desired() };
        let p = plan(&o, &d);
        assert_eq!(&p.steps[..FULL.len()], FULL);
        assert_eq!(p.steps.last(), Some(&VerifySpeculation));
        // Also when only the service has to be started again, or an interrupted apply resumed.
        o = in_sync();
        o.active_state = "failed".into();
        assert_eq!(plan(&o, &d).steps, &[Start, VerifyCmdline, WaitReady, VerifyArgs, VerifySpeculation]);
        o = in_sync();
        o.interrupted = true;
        assert_eq!(plan(&o, &d).steps, &[VerifyCmdline, WaitReady, VerifyArgs, VerifySpeculation]);
    }

    #[test]
    fn without_verify_args_the_last_step_is_readiness() {
        let mut o = in_sync();
        o.deployed_sha256 = None;
        let d = Desired { verify_args: false, ..desired() };
        assert_eq!(plan(&o, &d).steps.last(), Some(&WaitReady));
    }

    #[test]
    fn a_spec_change_applies_even_under_report_policy() {
        let mut o = in_sync();
        o.deployed_sha256 = Some("a".repeat(64));
        o.written_sha256 = Some("a".repeat(64));
        let d = Desired { drift: DriftPolicy::Report, ..desired() };
        assert_eq!(plan(&o, &d).steps, FULL);
    }

    #[test]
    fn first_adoption_of_a_hand_written_unit_is_a_deploy() {
        let mut o = in_sync();
        o.deployed_sha256 = Some("a".repeat(64));
        o.written_sha256 = None;
        let p = plan(&o, &desired());
        assert_eq!((p.sync, p.steps.as_slice()), (SyncStatus::OutOfSync, FULL));
    }

    #[test]
    fn hand_edits_are_drift_healed_or_reported() {
        let mut o = in_sync();
        o.deployed_sha256 = Some("e".repeat(64));
        o.need_daemon_reload = true;
        let p = plan(&o, &desired());
        assert_eq!(p.sync, SyncStatus::Drifted);
        assert_eq!(p.steps, FULL);
        assert!(p.reasons[0].contains("edited by hand"), "{:?}", p.reasons);
        let r = plan(&o, &Desired { drift: DriftPolicy::Report, ..desired() });
        assert_eq!((r.sync, r.steps.len()), (SyncStatus::Drifted, 0));
    }

    #[test]
    fn a_deleted_unit_file_is_drift() {
        let mut o = in_sync();
        o.deployed_sha256 = None;
        let p = plan(&o, &desired());
        assert_eq!(p.sync, SyncStatus::Drifted);
        assert!(p.steps.contains(&WriteUnit));
    }

    #[test]
    fn reload_drift_restarts_without_rewriting() {
        let mut o = in_sync();
        o.need_daemon_reload = true;
        let p = plan(&o, &desired());
        assert_eq!(p.sync, SyncStatus::Drifted);
        assert!(!p.steps.contains(&WriteUnit));
        assert!(p.steps.contains(&Reload) && p.steps.contains(&Stop));
    }

    #[test]
    fn drop_ins_are_drift_and_removed_when_healing() {
        let mut o = in_sync();
        o.drop_ins = vec!["/etc/systemd/system/x.service.d/override.conf".into()];
        let p = plan(&o, &desired());
        assert_eq!(p.sync, SyncStatus::Drifted);
        assert!(p.steps.contains(&RemoveDropIns));
        assert!(!p.steps.contains(&WriteUnit));
    }

    #[test]
    fn a_stale_instance_is_drift() {
        // The seed's picture: the file is right, but the process runs the old argv.
        let mut o = in_sync();
        o.main_cmdline = Some(vec!["/bin/srv".into(), "--steps".into(), "5".into()]);
        let p = plan(&o, &desired());
        assert_eq!(p.sync, SyncStatus::Drifted);
        assert_eq!(p.steps, &[Drain, Stop, WaitStopped, Reload, Start, VerifyCmdline, WaitReady, VerifyArgs]);
    }

    #[test]
    fn live_arg_mismatch_is_drift_only_when_verified() {
        let mut o = in_sync();
        o.arg_mismatches = vec!["speculative_num_steps: spec 10 / server 5".into()];
        assert_eq!(plan(&o, &desired()).sync, SyncStatus::Drifted);
        assert_eq!(plan(&o, &Desired { verify_args: false, ..desired() }).sync, SyncStatus::InSync);
    }

    #[test]
    fn loaded_from_another_path_is_drift() {
        let mut o = in_sync();
        o.fragment_path = "/run/systemd/system/x.service".into();
        let p = plan(&o, &desired());
        assert_eq!(p.sync, SyncStatus::Drifted);
        assert!(p.reasons[0].contains("/run/systemd/system/x.service"));
    }

    #[test]
    fn a_stopped_or_failed_service_is_started_only() {
        for state in ["inactive", "failed"] {
            let mut o = in_sync();
            o.active_state = state.into();
            o.main_pid = 0;
            o.main_cmdline = None;
            o.ready = None;
            let p = plan(&o, &desired());
            assert_eq!(p.sync, SyncStatus::OutOfSync);
            assert_eq!(p.steps, &[Start, VerifyCmdline, WaitReady, VerifyArgs]);
        }
    }

    #[test]
    fn loading_and_restarting_are_progressing() {
        let mut o = in_sync();
        o.ready = Some(false);
        assert_eq!(plan(&o, &desired()).sync, SyncStatus::Progressing);
        let mut o = in_sync();
        o.active_state = "activating".into();
        o.sub_state = SubState::AutoRestart;
        o.main_pid = 0;
        o.main_cmdline = None;
        let p = plan(&o, &desired());
        assert_eq!((p.sync, p.steps.len()), (SyncStatus::Progressing, 0));
    }

    #[test]
    fn a_quarantined_hash_is_never_retried() {
        for deployed in [None, Some("a".repeat(64)), Some(desired().sha256)] {
            let mut o = in_sync();
            o.deployed_sha256 = deployed;
            o.active_state = "failed".into();
            o.quarantined = Some("readiness timed out".into());
            let p = plan(&o, &desired());
            assert_eq!((p.sync, p.steps.len()), (SyncStatus::Failed, 0));
            assert!(p.reasons[0].contains("readiness timed out"));
        }
    }

    #[test]
    fn an_interrupted_apply_is_finished_even_under_report_policy() {
        // Killed after writing, before the reload.
        let mut o = in_sync();
        o.interrupted = true;
        o.need_daemon_reload = true;
        o.active_state = "inactive".into();
        o.main_pid = 0;
        o.main_cmdline = None;
        let p = plan(&o, &Desired { drift: DriftPolicy::Report, ..desired() });
        assert_eq!(p.sync, SyncStatus::Progressing);
        assert_eq!(p.steps, &[Stop, WaitStopped, Reload, Start, VerifyCmdline, WaitReady, VerifyArgs]);
        // Killed while the file was still the old one.
        let mut o = in_sync();
        o.interrupted = true;
        o.deployed_sha256 = Some("a".repeat(64));
        assert_eq!(plan(&o, &desired()).steps, FULL);
    }

    #[test]
    fn an_interrupted_apply_whose_server_is_already_starting_is_resumed_not_restarted() {
        let mut o = in_sync();
        o.interrupted = true;
        o.ready = Some(false);
        let p = plan(&o, &desired());
        assert_eq!(p.steps, &[VerifyCmdline, WaitReady, VerifyArgs]);
    }

    #[test]
    fn a_quarantined_spec_whose_rollback_did_not_finish_is_rolled_back() {
        // The rollback stopped before writing the good unit back: the bad one is on disk, stopped.
        let mut o = in_sync();
        o.quarantined = Some("exit 3".into());
        o.last_good_sha256 = Some("a".repeat(64));
        o.active_state = "inactive".into();
        o.main_pid = 0;
        let p = plan(&o, &desired());
        // The last good unit put back by the same sequence, its file written.
        assert_eq!(
            (p.sync, p.toward, p.steps.clone()),
            (SyncStatus::Failed, Toward::LastGood, restore_steps(o.deployed_sha256.as_deref(), &"a".repeat(64)))
        );
        assert_eq!(p.steps, &[Stop, WaitStopped, WriteUnit, Reload, Start, VerifyCmdline, WaitReady]);
        // Once the good unit runs again, nothing more.
        let mut o = o.clone();
        o.deployed_sha256 = Some("a".repeat(64));
        o.active_state = "active".into();
        o.main_pid = 7;
        assert!(plan(&o, &desired()).steps.is_empty());
        // A person's unit running under report policy is left alone.
        let mut o = o.clone();
        o.deployed_sha256 = Some("e".repeat(64));
        assert!(plan(&o, &Desired { drift: DriftPolicy::Report, ..desired() }).steps.is_empty());
    }

    #[test]
    fn a_rollback_killed_after_starting_the_good_unit_does_not_restart_it() {
        // Killed between the rollback's start and its readiness: the last good unit loads (a
        // large model takes minutes); restarting it would only add to the downtime.
        let mut o = in_sync();
        o.quarantined = Some("exit 1".into());
        o.last_good_sha256 = Some("a".repeat(64));
        o.deployed_sha256 = Some("a".repeat(64));
        o.interrupted = true;
        o.ready = Some(false);
        assert!(plan(&o, &desired()).steps.is_empty());
        o.ready = Some(true);
        assert!(plan(&o, &desired()).steps.is_empty());
        // Killed before it started: finished, its file (on disk already) not written again.
        o.active_state = "inactive".into();
        o.main_pid = 0;
        let p = plan(&o, &desired());
        assert_eq!(
            (p.toward, p.steps.as_slice()),
            (Toward::LastGood, &[Stop, WaitStopped, Reload, Start, VerifyCmdline, WaitReady][..])
        );
    }

    #[test]
    fn whether_it_starts_at_boot_is_set_after_readiness_and_never_restarts_the_server() {
        let not_enabled = Observed { enabled: Some(false), ..in_sync() };
        let p = plan(&not_enabled, &desired());
        assert_eq!((p.sync, p.steps.as_slice()), (SyncStatus::Drifted, &[Enable][..]));
        assert!(p.reasons[0].contains("would not start at boot"), "{p:?}");
        let off = Desired { enabled: false, ..desired() };
        let p = plan(&in_sync(), &off);
        assert_eq!((p.sync, p.steps.as_slice()), (SyncStatus::Drifted, &[Disable][..]));
        assert!(p.reasons[0].contains("service.enabled: false"), "{p:?}");
        assert!(plan(&Observed { enabled: Some(false), ..in_sync() }, &off).steps.is_empty());
        // Reported only, under the report policy.
        let p = plan(&not_enabled, &Desired { drift: DriftPolicy::Report, ..desired() });
        assert_eq!((p.sync, p.steps.len()), (SyncStatus::Drifted, 0));
        // A first deploy enables the unit once its server is ready.
        let new = Observed {
            deployed_sha256: None,
            written_sha256: None,
            load_state: LoadState::NotFound,
            active_state: "inactive".into(),
            main_pid: 0,
            main_cmdline: None,
            enabled: None,
            ..in_sync()
        };
        assert_eq!(
            plan(&new, &desired()).steps,
            &[Stop, WaitStopped, WriteUnit, Reload, Start, VerifyCmdline, WaitReady, Enable, VerifyArgs]
        );
        assert_eq!(plan(&new, &off).steps, &FULL[1..]);
        // A stopped service is started, and enabled once ready.
        let stopped = Observed {
            active_state: "failed".into(),
            main_pid: 0,
            main_cmdline: None,
            ready: None,
            ..not_enabled.clone()
        };
        assert_eq!(plan(&stopped, &desired()).steps, &[Start, VerifyCmdline, WaitReady, Enable, VerifyArgs]);
        // A server still loading is looked at again once it is ready; static or generated units
        // are not specd's to enable.
        assert!(plan(&Observed { ready: Some(false), ..not_enabled.clone() }, &desired()).steps.is_empty());
        assert_eq!(plan(&Observed { enabled: None, ..in_sync() }, &desired()).sync, SyncStatus::InSync);
        assert_eq!(enabled_of(UnitFileState::Enabled), Some(true));
        assert_eq!(enabled_of(UnitFileState::EnabledRuntime), Some(false));
        assert_eq!(enabled_of(UnitFileState::Static), None);
    }

    #[test]
    fn every_plan_that_writes_stops_first_and_verifies_after() {
        // Exhaustive over the observable booleans: the invariant of the race-free sequence.
        let bools = [false, true];
        for file in bools {
            for written in bools {
                for reload in bools {
                    for dropin in bools {
                        for active in ["active", "inactive", "failed", "activating"] {
                            for stale in bools {
                                for policy in [DriftPolicy::Heal, DriftPolicy::Report] {
                                    let mut o = in_sync();
                                    if file {
                                        o.deployed_sha256 = Some("a".repeat(64));
                                    }
                                    if !written {
                                        o.written_sha256 = Some("b".repeat(64));
                                    }
                                    o.need_daemon_reload = reload;
                                    if dropin {
                                        o.drop_ins = vec!["/x.conf".into()];
                                    }
                                    o.active_state = active.into();
                                    if active != "active" {
                                        o.main_pid = 0;
                                        o.main_cmdline = None;
                                    }
                                    if stale && o.main_pid > 0 {
                                        o.main_cmdline = Some(vec!["/old".into()]);
                                    }
                                    for (interrupted, boot, want_boot) in bools
                                        .into_iter()
                                        .flat_map(|i| [None, Some(false), Some(true)].map(|b| (i, b)))
                                        .flat_map(|(i, b)| bools.map(|w| (i, b, w)))
                                    {
                                        let d = Desired { drift: policy, enabled: want_boot, ..desired() };
                                        o.interrupted = interrupted;
                                        o.enabled = boot;
                                        let p = plan(&o, &d);
                                        let pos = |s: Step| p.steps.iter().position(|x| *x == s);
                                        // Starting at boot is set once the server answered
                                        // ready (or alone), and only as the spec says.
                                        for (b, wanted) in [(Enable, true), (Disable, false)] {
                                            if let Some(i) = pos(b) {
                                                assert_eq!(pos(WaitReady).map_or(0, |r| r + 1), i, "{p:?}");
                                                assert_eq!(p.steps.iter().filter(|s| **s == b).count(), 1, "{p:?}");
                                                assert_eq!(want_boot, wanted, "{o:?} {d:?} {p:?}");
                                                assert!(boot != Some(wanted), "{o:?} {d:?} {p:?}");
                                            }
                                        }
                                        if let Some(w) = pos(WriteUnit) {
                                            assert!(pos(WaitStopped).is_some_and(|x| x < w), "{p:?}");
                                            assert!(pos(Reload).is_some_and(|x| x > w), "{p:?}");
                                        }
                                        if let Some(s) = pos(Start) {
                                            assert!(
                                                pos(VerifyCmdline) == Some(s + 1) && pos(WaitReady).is_some(),
                                                "{p:?}"
                                            );
                                            if pos(Stop).is_some() {
                                                assert!(pos(Reload).is_some_and(|r| r < s), "{p:?}");
                                            }
                                        }
                                        if p.sync == SyncStatus::InSync {
                                            assert!(p.steps.is_empty());
                                        }
                                        if policy == DriftPolicy::Report && p.sync == SyncStatus::Drifted {
                                            assert!(p.steps.is_empty());
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_restore_stops_until_empty_before_it_writes_and_proves_what_it_started() {
        let (good, new) = ("a".repeat(64), "b".repeat(64));
        let written = [Stop, WaitStopped, WriteUnit, Reload, Start, VerifyCmdline, WaitReady];
        assert_eq!(restore_steps(Some(&new), &good), written);
        assert_eq!(restore_steps(None, &good), written);
        // The good unit's file is on disk already (the new one's write failed): not written again.
        assert_eq!(restore_steps(Some(&good), &good), [Stop, WaitStopped, Reload, Start, VerifyCmdline, WaitReady]);
    }

    #[test]
    fn a_unit_started_again_while_specd_stops_it_is_stopped_again_at_most_three_times() {
        use ActiveState::*;
        // Stopped means inactive or failed with no main process.
        assert_eq!(stopping(Inactive, &SubState::Dead, 0, 0), Stopping::Stopped);
        assert_eq!(stopping(Failed, &SubState::Failed, 0, 3), Stopping::Stopped);
        assert_eq!(stopping(Failed, &SubState::Failed, 42, 0), Stopping::Settling);
        // Up again (Restart=, a dependency, a person): stopped again, three times, then given up.
        for (active, sub) in
            [(Active, SubState::Running), (Activating, SubState::Start), (Activating, SubState::AutoRestart)]
        {
            let again: Vec<Stopping> = (0..5).map(|n| stopping(active, &sub, 7, n)).collect();
            assert_eq!(again[..3], [Stopping::StopAgain; 3], "{active}/{sub}");
            assert_eq!(again[3..], [Stopping::KeepsStarting; 2], "{active}/{sub}");
            assert_eq!(crate::core::timing::RESTOPS, 3);
        }
        // Still in the stop's own SIGTERM phase, or deactivating: waited for, never stopped again.
        assert_eq!(stopping(Active, &SubState::StopSigterm, 7, 0), Stopping::Settling);
        assert_eq!(stopping(Deactivating, &SubState::StopSigkill, 7, 5), Stopping::Settling);
        assert_eq!(stopping(Unknown, &SubState::default(), 0, 0), Stopping::Settling);
    }
}
