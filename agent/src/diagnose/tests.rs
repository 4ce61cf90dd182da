use std::path::Path;

use super::facts::{Exit, parse_exit_line};
use super::gather::{JournalQuery, gather_raw_from};
use super::journal::journal_note_to;
use super::parse::{effective_exec_start, kernel_kills, parse_journal_json, parse_kmsg, parse_show, parse_timespan_us};
use super::*;

fn dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/diagnose")
}

fn read_opt(name: &str) -> Option<String> {
    std::fs::read_to_string(dir().join(name)).ok()
}

/// A recorded (or written) case as the gatherer would have read it.
fn fixture(name: &str) -> Raw {
    let meta: serde_json::Value = serde_json::from_str(&read_opt(&format!("{name}.meta.json")).expect("meta")).unwrap();
    let unit_files = (0..).map_while(|i| read_opt(&format!("{name}.unit{i}"))).collect();
    Raw {
        unit: meta["unit"].as_str().unwrap().to_string(),
        show: read_opt(&format!("{name}.show")).expect("show"),
        journal: read_opt(&format!("{name}.journal.json")).expect("journal"),
        context: read_opt(&format!("{name}.context.json")).unwrap_or_default(),
        kernel: parse_journal_json(&read_opt(&format!("{name}.kernel.json")).unwrap_or_default()),
        unit_files,
        unit_mtime_us: meta["unit_mtime_us"].as_u64(),
        main_cmdline: meta["main_cmdline"]
            .as_array()
            .map(|a| a.iter().map(|w| w.as_str().unwrap().to_string()).collect()),
        oom_kill_count: meta["oom_kill_count"].as_u64(),
    }
}

/// Diagnoses of every instance, oldest first.
fn diagnose(raw: &Raw) -> Vec<Diagnosis> {
    assemble(raw).iter().map(classify).collect()
}

fn newest(raw: &Raw) -> Diagnosis {
    diagnose(raw).pop().expect("an instance")
}

fn has_evidence(d: &Diagnosis, text: &str) -> bool {
    d.evidence.iter().any(|e| e.text.contains(text))
}

#[track_caller]
fn assert_contains(hay: &str, needle: &str) {
    assert!(hay.contains(needle), "{needle:?} not in {hay:?}");
}

#[test]
fn stop_timeout_is_not_an_oom_and_names_specd() {
    let ds = diagnose(&fixture("stop-timeout-stale"));
    assert_eq!(ds.len(), 2, "{ds:#?}");
    let d = &ds[1];
    assert_eq!(d.verdict, Verdict::StopTimeoutKill, "{d:#?}");
    assert_contains(&d.summary, "stop-timeout SIGKILL: systemd killed the server 2 s after SIGTERM (TimeoutStopSec)");
    assert_contains(&d.summary, "(16 requests in flight)");
    assert_contains(&d.summary, "not an OOM");
    assert_contains(&d.summary, "requested by specd");
    assert!(has_evidence(d, "State 'stop-sigterm' timed out. Killing."), "{d:#?}");
    assert!(has_evidence(d, "specd: stopping seed.service"), "{d:#?}");
    assert!(has_evidence(d, "Result=timeout ExecMainCode=2 ExecMainStatus=9"), "{d:#?}");
    // The seed: this instance had been restarted after the unit file changed, unreloaded.
    assert_eq!(d.notes.len(), 1, "{d:#?}");
    assert_contains(&d.notes[0], "stale-config start");
    assert_contains(&d.notes[0], "NeedDaemonReload=yes");
    // The evidence is in time order and timestamped.
    let times: Vec<&str> = d.evidence.iter().map(|e| e.time.as_str()).collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "{times:?}");
    assert!(times.iter().all(|t| t.starts_with("2026-12-03T") && t.ends_with('Z')), "{times:?}");
    // The instance before: the same ending, from the journal alone (no systemctl for it),
    // stopped by the restart; it started before the unit file changed: not stale.
    let d0 = &ds[0];
    assert_eq!(d0.verdict, Verdict::StopTimeoutKill, "{d0:#?}");
    assert_contains(&d0.summary, "not an OOM");
    assert_contains(&d0.summary, "requested by a restart request");
    assert!(d0.notes.is_empty(), "{d0:#?}");
    assert!(!has_evidence(d0, "Result=timeout ExecMainCode"), "{d0:#?}");
}

#[test]
fn sglang_killing_itself_after_draining_is_a_clean_stop() {
    let d = newest(&fixture("clean-stop-sglang-selfkill"));
    assert_eq!(d.verdict, Verdict::CleanStop, "{d:#?}");
    assert_contains(&d.summary, "stopped on request by specd");
    assert_contains(&d.summary, "sent by the server itself");
    assert_contains(&d.summary, "not systemd, not the OOM killer");
    assert!(has_evidence(&d, "Main process exited, code=killed, status=9/KILL"), "{d:#?}");
}

#[test]
fn cuda_oom_with_sigkill_is_cuda_oom_not_a_crash() {
    let d = newest(&fixture("cuda-oom-sglang"));
    assert_eq!(d.verdict, Verdict::CudaOom, "{d:#?}");
    assert_contains(&d.summary, "PyTorch CUDA out of memory");
    assert_contains(&d.summary, "signal 9/KILL");
    assert_contains(&d.summary, "not by systemd or the kernel");
    assert!(has_evidence(&d, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"), "{d:#?}");
    let d = newest(&fixture("cuda-oom-vllm"));
    assert_eq!(d.verdict, Verdict::CudaOom, "{d:#?}");
    assert_contains(&d.summary, "vLLM");
    assert_contains(&d.summary, "exit status 1");
}

#[test]
fn exit_3_is_a_crash_with_the_server_s_own_exception() {
    let d = newest(&fixture("crash-exit3"));
    assert_eq!(d.verdict, Verdict::Crash, "{d:#?}");
    assert_contains(
        &d.summary,
        "exit status 3, the server's own error: \"ValueError: Unknown speculative algorithm name: EAGLE4\"",
    );
    assert_eq!(d.engine_error.as_deref(), Some("ValueError: Unknown speculative algorithm name: EAGLE4"));
    // The exception is cited, not the traceback's header or frames.
    assert!(has_evidence(&d, "sh[221]: ValueError: Unknown speculative algorithm name: EAGLE4"), "{d:#?}");
    assert!(!has_evidence(&d, "Traceback (most recent call last):"), "{d:#?}");
    assert!(!has_evidence(&d, "prepare_server_args"), "{d:#?}");
    assert!(has_evidence(&d, "Failed with result 'exit-code'."), "{d:#?}");
}

#[test]
fn watchdog() {
    let d = newest(&fixture("watchdog"));
    assert_eq!(d.verdict, Verdict::Watchdog, "{d:#?}");
    assert_contains(&d.summary, "WatchdogSec=1 s");
    assert_contains(&d.summary, "signal 6/ABRT");
    assert!(has_evidence(&d, "Watchdog timeout (limit 1s)!"), "{d:#?}");
}

#[test]
fn start_limit_names_the_cause_of_the_last_failure() {
    let ds = diagnose(&fixture("start-limit-cuda"));
    assert_eq!(ds.len(), 3, "{ds:#?}");
    let d = ds.last().unwrap();
    assert_eq!(d.verdict, Verdict::StartLimitHit, "{d:#?}");
    assert_contains(&d.summary, "after 3 restarts");
    assert_contains(&d.summary, "CUDA OOM (SGLang: not enough memory for the KV cache)");
    assert!(has_evidence(d, "Start request repeated too quickly."), "{d:#?}");
    // The earlier instances each died of the same CUDA OOM (their output had no invocation
    // ID: the process was gone before journald looked; it is placed by time).
    for d in &ds[..2] {
        assert_eq!(d.verdict, Verdict::CudaOom, "{d:#?}");
    }
}

#[test]
fn memory_hog_on_hybrid_host_is_an_oom_kill_from_the_kernel_line() {
    let raw = fixture("oom-kill-hybrid");
    let d = newest(&raw);
    assert_eq!(d.verdict, Verdict::OomKill, "{d:#?}");
    assert_contains(&d.summary, "the kernel's OOM killer killed process ");
    assert_contains(&d.summary, " (tail): the memory cgroup limit was reached");
    assert_contains(&d.summary, "memory cgroup limit");
    // systemd on a v1 memory controller cannot tell: Result=signal.
    assert_contains(&d.summary, "signal 9/KILL, Result=signal");
    assert!(has_evidence(&d, "Memory cgroup out of memory: Killed process "), "{d:#?}");
    assert!(has_evidence(&d, "/specd-box-"), "the kernel's line names the unit's cgroup: {d:#?}");
    // Without the kernel's line, a SIGKILL nobody asked for is a crash, with the hint.
    let mut blind = raw.clone();
    blind.kernel.clear();
    let d = newest(&blind);
    assert_eq!(d.verdict, Verdict::Crash, "{d:#?}");
    assert_contains(&d.summary, "SIGKILL outside any stop job");
    assert_contains(&d.summary, "no kernel OOM line names this unit");
}

#[test]
fn oom_kill_reported_by_systemd_on_cgroup_v2() {
    let raw = fixture("oom-kill-v2");
    let d = newest(&raw);
    assert_eq!(d.verdict, Verdict::OomKill, "{d:#?}");
    assert_contains(&d.summary, "(Result=oom-kill)");
    assert!(has_evidence(&d, "A process of this unit has been killed by the OOM killer."), "{d:#?}");
    assert!(has_evidence(&d, "oom-kill:constraint=CONSTRAINT_MEMCG"), "{d:#?}");
    // systemd's word alone is enough.
    let mut blind = raw.clone();
    blind.kernel.clear();
    assert_eq!(newest(&blind).verdict, Verdict::OomKill);
}

#[test]
fn kernel_lines_of_other_units_do_not_count() {
    // These captures hold the hog's kernel lines too (same box, same time span).
    for name in ["clean-stop-dependency", "clean-stop-unattributed", "stale-config-running"] {
        let raw = fixture(name);
        assert!(!raw.kernel.is_empty(), "{name}: the fixture should carry the hog's lines");
        for ev in assemble(&raw) {
            assert!(ev.kernel.is_empty(), "{name}: {:?}", ev.kernel);
        }
    }
}

#[test]
fn who_stopped_it() {
    let d = newest(&fixture("clean-stop-dependency"));
    assert_eq!(d.verdict, Verdict::CleanStop, "{d:#?}");
    assert_contains(&d.summary, "a dependency: db.service was being stopped (BindsTo=db.service)");
    assert!(has_evidence(&d, "Stopping db.service..."), "{d:#?}");

    let mut raw = fixture("clean-stop-unattributed");
    let d = newest(&raw);
    assert_eq!(d.verdict, Verdict::CleanStop, "{d:#?}");
    assert_contains(&d.summary, "a stop request the journal does not attribute");
    assert_contains(&d.summary, "and ended within a second of SIGTERM");

    // sudo's lines (written by hand), placed just before systemd's stop job.
    let stop = parse_journal_json(&raw.journal).into_iter().find(|l| l.message.starts_with("Stopping ")).unwrap();
    for (i, l) in read_opt("clean-stop-sudo.context.json").unwrap().lines().enumerate() {
        let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
        v["__REALTIME_TIMESTAMP"] = (stop.time_us - 40_000 + i as u64 * 1000).to_string().into();
        raw.context.push_str(&format!("{v}\n"));
    }
    let d = newest(&raw);
    assert_eq!(d.verdict, Verdict::CleanStop, "{d:#?}");
    assert_contains(&d.summary, "stopped on request by a person (alice, via sudo)");
    assert!(has_evidence(&d, "COMMAND=/usr/bin/systemctl stop db"), "{d:#?}");
}

#[test]
fn stale_config_start_of_a_running_instance() {
    let ds = diagnose(&fixture("stale-config-running"));
    assert_eq!(ds.len(), 2, "{ds:#?}");
    let d = &ds[1];
    assert_eq!(d.verdict, Verdict::StaleConfigStart, "{d:#?}");
    assert_contains(&d.summary, "NeedDaemonReload=yes");
    assert_contains(&d.summary, "differs from the unit on disk");
    assert_contains(&d.summary, "--speculative-num-steps 3");
    assert_contains(&d.summary, "--speculative-num-steps 5");
    assert!(d.ended.is_none());
    // The instance the restart stopped had started before the edit.
    assert_eq!(ds[0].verdict, Verdict::CleanStop, "{:#?}", ds[0]);
    assert_contains(&ds[0].summary, "restart");
}

#[test]
fn running_and_healthy() {
    let mut raw = fixture("stale-config-running");
    raw.show = raw.show.replace("NeedDaemonReload=yes", "NeedDaemonReload=no");
    raw.main_cmdline = None;
    let d = newest(&raw);
    assert_eq!(d.verdict, Verdict::Running, "{d:#?}");
    assert!(d.notes.is_empty(), "{d:#?}");
}

fn sys(t: u64, m: &str) -> Line {
    Line {
        time_us: t * 1_000_000,
        origin: Origin::Systemd,
        pid: 1,
        ident: "systemd".into(),
        unit: "x.service".into(),
        invocation: Some("i1".into()),
        job_type: m.starts_with("Stopping ").then(|| "stop".into()),
        action: None,
        message: m.into(),
    }
}

fn svc(t: u64, m: &str) -> Line {
    Line {
        time_us: t * 1_000_000,
        origin: Origin::Service,
        pid: 77,
        ident: "python3".into(),
        unit: "x.service".into(),
        invocation: Some("i1".into()),
        job_type: None,
        action: None,
        message: m.into(),
    }
}

fn ev(lines: Vec<Line>) -> Evidence {
    Evidence { unit: "x.service".into(), invocation: Some("i1".into()), lines, ..Default::default() }
}

fn note(t_ms: u64, action: &str, invocation: &str) -> Line {
    Line {
        time_us: t_ms * 1000,
        origin: Origin::Specd,
        pid: 9,
        ident: "specd".into(),
        unit: "x.service".into(),
        invocation: Some(invocation.into()),
        action: Some(action.into()),
        message: format!("specd: stopping x.service ({action})"),
        ..Default::default()
    }
}

#[test]
fn a_failed_start_that_specd_stopped_quotes_the_server_s_own_error() {
    let lines = |n: Line| {
        vec![
            sys(0, "Started x.service."),
            svc(1, "E gguf_init_from_file: failed to open GGUF file '/models/missing.gguf'"),
            svc(2, "E srv    load_model: failed to load draft model, '/models/missing.gguf'"),
            n,
            sys(10, "Stopping x.service..."),
            sys(10, "x.service: Deactivated successfully."),
        ]
    };
    let d = classify(&ev(lines(note(9_900, "rollback", "i1"))));
    assert_eq!(d.verdict, Verdict::FailedStart, "{d:#?}");
    let quoted = "gguf_init_from_file: failed to open GGUF file '/models/missing.gguf' … srv load_model: failed to load draft model, '/models/missing.gguf'";
    assert_eq!(
        d.summary,
        format!("failed start: the server did not start (the server's own error: \"{quoted}\"); specd then stopped it")
    );
    assert_eq!(d.engine_error.as_deref(), Some(quoted));
    // A plain stop to apply a new unit is a clean stop, whatever the server logged before.
    assert_eq!(classify(&ev(lines(note(9_900, "stop", "i1")))).verdict, Verdict::CleanStop);
    // A rollback note about another instance does not make this one a failed start.
    assert_eq!(classify(&ev(lines(note(9_900, "rollback", "i0")))).verdict, Verdict::CleanStop);
}

#[test]
fn specd_s_note_about_the_instance_before_is_not_who_stopped_this_one() {
    // specd stopped i0 to apply a new unit, then a person stopped i1, within the request window.
    let lines = |n: Line| {
        vec![
            n,
            sys(2, "Started x.service."),
            sys(4, "Stopping x.service..."),
            sys(4, "x.service: Deactivated successfully."),
        ]
    };
    let d = classify(&ev(lines(note(0, "stop", "i0"))));
    assert_eq!(d.verdict, Verdict::CleanStop, "{d:#?}");
    assert!(!d.summary.contains("by specd"), "{}", d.summary);
    // A note about this instance, before its stop: specd stopped it.
    let mut l = lines(note(0, "stop", "i0"));
    l.insert(2, note(3_900, "stop", "i1"));
    assert_contains(&classify(&ev(l)).summary, "stopped on request by specd");
    // A note written after this instance started that names the one before (the server crashed
    // and was restarted between specd's look and its stop): specd stopped it too.
    let mut l = lines(note(0, "stop", "i0"));
    l.insert(2, note(3_900, "stop", "i0"));
    assert_contains(&classify(&ev(l)).summary, "stopped on request by specd");
    // specd's own log lines are not requests.
    let mut log = note(3_900, "stop", "i1");
    log.action = None;
    let mut l = lines(note(0, "stop", "i0"));
    l.insert(2, log);
    assert!(!classify(&ev(l)).summary.contains("by specd"));
}

#[test]
fn precedence_stop_timeout_over_an_earlier_cuda_oom() {
    let d = classify(&ev(vec![
        sys(0, "Started x.service."),
        svc(5, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB."),
        sys(10, "Stopping x.service..."),
        sys(310, "x.service: State 'stop-sigterm' timed out. Killing."),
        sys(310, "x.service: Killing process 77 (python3) with signal SIGKILL."),
        sys(310, "x.service: Main process exited, code=killed, status=9/KILL"),
        sys(310, "x.service: Failed with result 'timeout'."),
    ]));
    assert_eq!(d.verdict, Verdict::StopTimeoutKill, "{d:#?}");
    assert_contains(&d.summary, "300 s after SIGTERM");
    assert_contains(&d.notes[0], "CUDA OOM");
}

#[test]
fn precedence_properties_only_when_the_journal_is_gone() {
    let mut e = ev(vec![]);
    e.props = Some(parse_show(
        "Id=x.service\nActiveState=failed\nSubState=failed\nResult=timeout\nExecMainCode=2\nExecMainStatus=9\nInvocationID=i1\nTimeoutStopUSec=5min\n",
    ));
    let d = classify(&e);
    assert_eq!(d.verdict, Verdict::StopTimeoutKill, "{d:#?}");
    assert_contains(&d.summary, "300 s after SIGTERM (TimeoutStopSec) while it had not exited after SIGTERM");
    assert!(has_evidence(&d, "Result=timeout ExecMainCode=2 ExecMainStatus=9"), "{d:#?}");

    e.props =
        Some(parse_show("ActiveState=failed\nResult=oom-kill\nExecMainCode=2\nExecMainStatus=9\nInvocationID=i1\n"));
    assert_eq!(classify(&e).verdict, Verdict::OomKill);
    e.props =
        Some(parse_show("ActiveState=failed\nResult=signal\nExecMainCode=2\nExecMainStatus=9\nInvocationID=i1\n"));
    assert_eq!(classify(&e).verdict, Verdict::Crash);
    e.props =
        Some(parse_show("ActiveState=failed\nResult=exit-code\nExecMainCode=1\nExecMainStatus=3\nInvocationID=i1\n"));
    assert_eq!(classify(&e).verdict, Verdict::Crash);
    e.props = Some(parse_show(
        "ActiveState=failed\nResult=start-limit-hit\nExecMainCode=1\nExecMainStatus=1\nInvocationID=i1\n",
    ));
    assert_eq!(classify(&e).verdict, Verdict::StartLimitHit);
    e.props =
        Some(parse_show("ActiveState=inactive\nResult=success\nExecMainCode=1\nExecMainStatus=0\nInvocationID=i1\n"));
    let d = classify(&e);
    assert_eq!(d.verdict, Verdict::CleanStop);
    assert_contains(&d.summary, "whether it was asked to stop is unknown");
    e.props =
        Some(parse_show("ActiveState=failed\nResult=watchdog\nExecMainCode=2\nExecMainStatus=6\nInvocationID=i1\n"));
    assert_eq!(classify(&e).verdict, Verdict::Watchdog);
    e.props = Some(parse_show("ActiveState=inactive\nInvocationID=i1\n"));
    assert_eq!(classify(&e).verdict, Verdict::Unknown);
}

#[test]
fn precedence_kernel_oom_over_cuda_text_and_signal() {
    let mut e = ev(vec![
        sys(0, "Started x.service."),
        svc(4, "RuntimeError: CUDA error: out of memory"),
        sys(5, "x.service: Main process exited, code=killed, status=9/KILL"),
        sys(5, "x.service: Failed with result 'signal'."),
    ]);
    assert_eq!(classify(&e).verdict, Verdict::CudaOom);
    e.kernel = vec![Line {
        time_us: 4_900_000,
        origin: Origin::Kernel,
        message: "Out of memory: Killed process 77 (python3) total-vm:1kB".into(),
        ..Default::default()
    }];
    let d = classify(&e);
    assert_eq!(d.verdict, Verdict::OomKill, "{d:#?}");
    assert_contains(&d.summary, "the machine ran out of memory");
    assert_contains(&d.notes[0], "CUDA OOM");
}

#[test]
fn precedence_a_stop_that_ends_in_a_non_zero_exit_is_a_crash_while_stopping() {
    let d = classify(&ev(vec![
        sys(0, "Started x.service."),
        sys(10, "Stopping x.service..."),
        svc(10, "Exception in thread shutdown: boom"),
        sys(11, "x.service: Main process exited, code=exited, status=1/FAILURE"),
        sys(11, "x.service: Failed with result 'exit-code'."),
    ]));
    assert_eq!(d.verdict, Verdict::Crash, "{d:#?}");
    assert_contains(&d.summary, "failed while stopping");
}

#[test]
fn exit_0_on_its_own_and_sigterm_from_kill() {
    let d = classify(&ev(vec![sys(0, "Started x.service."), sys(3, "x.service: Deactivated successfully.")]));
    assert_eq!(d.verdict, Verdict::CleanStop, "{d:#?}");
    assert_contains(&d.summary, "exited by itself with status 0");
    let d = classify(&ev(vec![
        sys(0, "Started x.service."),
        sys(3, "x.service: Main process exited, code=killed, status=15/TERM"),
        sys(3, "x.service: Deactivated successfully."),
    ]));
    assert_eq!(d.verdict, Verdict::CleanStop, "{d:#?}");
    assert_contains(&d.summary, "signal 15/TERM without a stop job");
}

#[test]
fn start_timeout_is_not_a_stop_timeout() {
    let d = classify(&ev(vec![
        sys(0, "Starting x.service..."),
        sys(90, "x.service: start operation timed out. Terminating."),
        sys(90, "x.service: Starting timed out. Terminating."),
        sys(91, "x.service: Main process exited, code=killed, status=15/TERM"),
        sys(91, "x.service: Failed with result 'timeout'."),
    ]));
    assert_eq!(d.verdict, Verdict::Crash, "{d:#?}");
    assert_contains(&d.summary, "did not finish starting");
}

#[test]
fn verdicts_serialize_kebab_case() {
    let all = [
        (Verdict::StopTimeoutKill, "stop-timeout-kill"),
        (Verdict::OomKill, "oom-kill"),
        (Verdict::CudaOom, "cuda-oom"),
        (Verdict::Crash, "crash"),
        (Verdict::Watchdog, "watchdog"),
        (Verdict::StartLimitHit, "start-limit-hit"),
        (Verdict::CleanStop, "clean-stop"),
        (Verdict::FailedStart, "failed-start"),
        (Verdict::StaleConfigStart, "stale-config-start"),
        (Verdict::Running, "running"),
        (Verdict::Unknown, "unknown"),
    ];
    for (v, s) in all {
        assert_eq!(serde_json::to_value(v).unwrap(), serde_json::json!(s));
        assert_eq!(v.as_str(), s);
    }
}

#[test]
fn text_output_puts_the_verdict_first_then_timestamped_evidence() {
    let d = newest(&fixture("crash-exit3"));
    let t = render_text(&d);
    let mut lines = t.lines();
    let head = lines.next().unwrap();
    assert!(head.starts_with("crash.service ") && head.ends_with(": crash"), "{t}");
    assert_contains(lines.next().unwrap(), "crash: the server died on its own: exit status 3");
    assert!(lines.any(|l| l.trim_start().starts_with("2026-12-03T") && l.contains("status=3/NOTIMPLEMENTED")), "{t}");
}

/// vLLM's error for a draft model whose architecture it does not know is one line of 10.7 KB
/// (every architecture it knows): quoted cut at 500 characters, shown cut at 1000, kept whole in
/// the evidence (`--json`).
#[test]
fn a_line_kilobytes_long_is_quoted_and_shown_cut_and_kept_whole() {
    let known: Vec<String> = (0..400).map(|i| format!("'Arch{i}ForCausalLM'")).collect();
    let long = format!(
        "  Value error, Model architectures ['NoSuchForCausalLM'] are not supported for now. Supported architectures: dict_keys([{}])",
        known.join(", ")
    );
    let d = classify(&ev(vec![
        sys(0, "Started x.service."),
        svc(1, "Traceback (most recent call last):"),
        svc(1, "  File \"/opt/vllm/bin/vllm\", line 8, in <module>"),
        svc(1, "pydantic_core._pydantic_core.ValidationError: 1 validation error for SpeculativeConfig"),
        svc(1, &long),
        svc(1, "    For further information visit https://errors.pydantic.dev/2.14/v/value_error"),
        sys(2, "x.service: Main process exited, code=exited, status=1/FAILURE"),
        sys(2, "x.service: Failed with result 'exit-code'."),
    ]));
    let quote = d.engine_error.clone().unwrap_or_default();
    assert!(
        quote.starts_with("pydantic_core._pydantic_core.ValidationError: 1 validation error for SpeculativeConfig Value error, Model architectures ['NoSuchForCausalLM'] are not supported"),
        "{quote}"
    );
    assert_eq!(quote.chars().count(), 500, "{quote}");
    assert!(d.evidence.iter().any(|e| e.text.contains(long.trim())), "{d:#?}");
    let t = render_text(&d);
    let cut = t.lines().find(|l| l.contains("python3[77]:   Value error")).unwrap_or_default();
    assert!(cut.ends_with('…') && cut.chars().count() < 1100, "{t}");
    assert!(t.contains("Value error, Model architectures ['NoSuchForCausalLM']"), "{t}");
}

#[test]
fn parses_the_pieces() {
    assert_eq!(parse_timespan_us("5min"), Some(300_000_000));
    assert_eq!(parse_timespan_us("1min 30s"), Some(90_000_000));
    assert_eq!(parse_timespan_us("300ms"), Some(300_000));
    assert_eq!(parse_timespan_us("infinity"), None);
    assert_eq!(parse_exit_line("x: Main process exited, code=dumped, status=11/SEGV"), Some(Exit::Dumped(11)));
    assert_eq!(parse_exit_line("x: Main process exited, code=exited, status=137/n/a"), Some(Exit::Exited(137)));
    assert_eq!(format_us(1_796_210_280_123_456), "2026-12-02T11:18:00.123Z");
    // Drop-ins override ExecStart=, an empty assignment resets it; continuations join.
    let unit =
        "[Unit]\nDescription=x\n[Service]\nExecStart=/usr/bin/python3 -m sglang.launch_server \\\n  --port 30000\n";
    assert_eq!(
        effective_exec_start(&[unit]).unwrap(),
        ["/usr/bin/python3", "-m", "sglang.launch_server", "--port", "30000"]
    );
    let drop_in = "[Service]\nExecStart=\nExecStart=-/bin/sleep \"1 2\"\n";
    assert_eq!(effective_exec_start(&[unit, drop_in]).unwrap(), ["/bin/sleep", "1 2"]);
    assert_eq!(effective_exec_start(&["[Service]\nExecStart=\n"]), None);
    // The ring buffer, placed on the wall clock.
    let k = parse_kmsg(
        "<6>[ 1073.557474] oom-kill:constraint=CONSTRAINT_MEMCG,task_memcg=/a/x.service,task=sh,pid=9,uid=0\n<3>[ 1073.557528] Memory cgroup out of memory: Killed process 9 (sh) total-vm:1kB\n",
        1_000_000,
    );
    assert_eq!(k.len(), 2);
    assert_eq!(k[0].time_us, 1_074_557_474);
    let kills = kernel_kills(&k);
    assert_eq!(kills.len(), 1);
    assert_eq!(kills[0].pid, Some(9));
    assert_eq!(kills[0].memcg.as_deref(), Some("/a/x.service"));
    assert_eq!(kills[0].lines.len(), 2);
    // journald's byte-array form of a message.
    let l = parse_journal_json(
        "{\"__REALTIME_TIMESTAMP\":\"5\",\"_PID\":\"7\",\"_SYSTEMD_UNIT\":\"x.service\",\"MESSAGE\":[104,105,27]}\n",
    );
    assert_eq!(l[0].message, "hi\u{1b}");
    assert_eq!(l[0].origin, Origin::Service);
}

#[test]
fn journal_note_writes_a_native_entry_about_the_unit() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("socket");
    let sock = std::os::unix::net::UnixDatagram::bind(&p).unwrap();
    journal_note_to(&p, "llm.service", "stop", Some("i1"), "specd: stopping llm.service\nfor apply").unwrap();
    let mut buf = [0u8; 4096];
    let n = sock.recv(&mut buf).unwrap();
    let text = std::str::from_utf8(&buf[..n]).unwrap();
    assert_eq!(
        text,
        "MESSAGE=specd: stopping llm.service for apply\nPRIORITY=5\nSYSLOG_IDENTIFIER=specd\nOBJECT_SYSTEMD_UNIT=llm.service\nSPECD_ACTION=stop\nSPECD_INVOCATION_ID=i1\n"
    );
}

/// Every recorded case, diagnosed in full (every instance, newest first, as `specd diagnose`
/// prints it), is exactly its `<name>.diagnosis.txt`: the verdicts, the wording, the notes and
/// the cited lines. After re-recording a case, review the text and replace the file with it.
#[test]
fn every_fixture_reads_exactly_as_its_recorded_diagnosis() {
    let mut names: Vec<String> = std::fs::read_dir(dir())
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok()?.strip_suffix(".meta.json").map(str::to_string))
        .collect();
    names.sort();
    assert!(names.len() >= 12, "{names:?}");
    for name in names {
        let text: String = diagnose(&fixture(&name)).iter().rev().map(render_text).collect();
        let want = read_opt(&format!("{name}.diagnosis.txt")).unwrap_or_default();
        assert!(text == want, "{name}: the diagnosis is now:\n{text}\nwas:\n{want}");
    }
}

/// A host that answers from a recorded case and records what it was asked.
struct Recorded {
    raw: Raw,
    asked: std::sync::Mutex<Vec<JournalQuery>>,
    journal_fails: bool,
}

impl JournalSource for Recorded {
    async fn show(&self, _unit: &str) -> anyhow::Result<String> {
        Ok(self.raw.show.clone())
    }

    async fn journal(&self, q: &JournalQuery) -> anyhow::Result<String> {
        self.asked.lock().unwrap().push(q.clone());
        if self.journal_fails {
            anyhow::bail!("journal rotated");
        }
        let context = q.matches.iter().any(|m| m.starts_with("SYSLOG_IDENTIFIER="));
        Ok(if context { self.raw.context.clone() } else { self.raw.journal.clone() })
    }

    async fn kernel_oom_lines(&self, since_us: u64) -> Vec<Line> {
        self.raw.kernel.iter().filter(|l| l.time_us >= since_us).cloned().collect()
    }

    fn unit_file(&self, path: &str) -> Option<(String, Option<u64>)> {
        let i: usize = path.strip_prefix("/etc/systemd/system/unit")?.parse().ok()?;
        Some((self.raw.unit_files.get(i)?.clone(), self.raw.unit_mtime_us))
    }

    fn cmdline(&self, _pid: u32) -> Option<Vec<String>> {
        self.raw.main_cmdline.clone()
    }

    fn oom_kill_count(&self, _control_group: &str) -> Option<u64> {
        Some(2)
    }
}

fn recorded(name: &str) -> Recorded {
    let mut raw = fixture(name);
    raw.show = raw
        .show
        .lines()
        .map(|l| if l.starts_with("FragmentPath=") { "FragmentPath=/etc/systemd/system/unit0" } else { l })
        .map(|l| format!("{l}\n"))
        .collect();
    Recorded { raw, asked: Default::default(), journal_fails: false }
}

#[test]
fn the_gatherer_asks_for_systemd_s_lines_each_instance_s_output_and_who_stopped_it() {
    let src = recorded("clean-stop-dependency");
    let raw = tokio_test_block_on(gather_raw_from(&src, "app.service", MAX_INSTANCES)).unwrap();
    let asked = src.asked.lock().unwrap().clone();
    let args: Vec<String> = asked.iter().map(|q| q.args().join(" ")).collect();
    assert!(args[0].ends_with("_PID=1 UNIT=app.service + _UID=0 OBJECT_SYSTEMD_UNIT=app.service"), "{args:#?}");
    assert!(args[1].ends_with("-n 1600 _SYSTEMD_UNIT=app.service"), "{args:#?}");
    assert!(args.iter().any(|a| a.contains("-n 400 _SYSTEMD_INVOCATION_ID=")), "{args:#?}");
    let context = args.last().unwrap();
    assert!(context.contains("--since=@"), "{context}");
    assert!(context.contains("SYSLOG_IDENTIFIER=polkitd + _PID=1 UNIT=db.service +"), "{context}");
    assert!(args.iter().all(|a| a.contains(&format!("--output-fields={JOURNAL_FIELDS}"))), "{args:#?}");
    // Long lines in full: `-o json` alone gives a field over 4096 bytes as null.
    assert!(args.iter().all(|a| a.contains(" --all ")), "{args:#?}");
    // What it read, assembled, is the recorded case's diagnosis, with the unit file it read.
    assert_eq!(raw.unit_files, src.raw.unit_files);
    assert_eq!(raw.oom_kill_count, Some(2));
    let d = newest(&raw);
    assert_eq!(d.verdict, Verdict::CleanStop, "{d:#?}");
    assert_contains(&d.summary, "a dependency: db.service was being stopped (BindsTo=db.service)");
}

/// The gatherer's queries overlap (the unit's output, each instance's output), and journald
/// stamps every line of one write with one time: each entry is read once, by its cursor, in its
/// place, and lines the server really repeated are kept.
#[test]
fn overlapping_queries_give_each_journal_entry_once_even_lines_of_one_time() {
    let mut src = recorded("crash-exit3");
    let id = "e28616baf4ed434c8055000fd3a0fd4c";
    let systemd: Vec<&str> = src.raw.journal.lines().filter(|l| l.contains("\"_PID\":\"1\"")).collect();
    let said = [
        (1, "Traceback (most recent call last):"),
        (1, "  File \"/opt/x.py\", line 1, in <module>"),
        (1, "    return await anext(self.gen)"),
        (1, "  File \"/opt/y.py\", line 2, in __aenter__"),
        (1, "    return await anext(self.gen)"),
        (2, "ValueError: Unknown speculative algorithm name: EAGLE4"),
        (2, "  (use one of EAGLE, EAGLE3, NEXTN)"),
    ];
    let mut journal: Vec<String> = systemd
        .iter()
        .enumerate()
        .map(|(i, l)| l.replacen('{', &format!("{{\"__CURSOR\":\"s=1;i={i}\","), 1))
        .collect();
    for (i, (t, m)) in said.iter().enumerate() {
        journal.push(
            serde_json::json!({
                "__CURSOR": format!("s=1;i={}", 100 + i),
                "__REALTIME_TIMESTAMP": (1796282086665562u64 + t).to_string(),
                "MESSAGE": m, "SYSLOG_IDENTIFIER": "sh", "_PID": "221", "_TRANSPORT": "stdout",
                "_SYSTEMD_UNIT": "crash.service", "_SYSTEMD_INVOCATION_ID": id,
            })
            .to_string(),
        );
    }
    // Every query answers the whole journal: three copies of each entry.
    src.raw.journal = journal.join("\n") + "\n";
    let raw = tokio_test_block_on(gather_raw_from(&src, "crash.service", MAX_INSTANCES)).unwrap();
    let ev = assemble(&raw).pop().unwrap();
    let out: Vec<&str> = ev.lines.iter().filter(|l| l.origin == Origin::Service).map(|l| l.message.as_str()).collect();
    assert_eq!(out, said.iter().map(|(_, m)| *m).collect::<Vec<_>>());
    let d = classify(&ev);
    assert_eq!(
        d.engine_error.as_deref(),
        Some("ValueError: Unknown speculative algorithm name: EAGLE4 (use one of EAGLE, EAGLE3, NEXTN)"),
        "{d:#?}"
    );
}

#[test]
fn a_gather_fails_when_systemd_s_lines_cannot_be_read_or_the_unit_does_not_exist() {
    let mut src = recorded("crash-exit3");
    src.journal_fails = true;
    let e = tokio_test_block_on(gather_raw_from(&src, "crash.service", 4)).unwrap_err();
    assert_contains(&format!("{e:#}"), "journal rotated");
    src.raw.show = "LoadState=not-found\nActiveState=inactive\n".into();
    let e = tokio_test_block_on(gather_raw_from(&src, "nope.service", 4)).unwrap_err();
    assert_contains(&format!("{e:#}"), "nope.service: no such unit");
}

fn tokio_test_block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(f)
}

/// A recorded engine log (`tests/fixtures/engines/<path>`) as the journal holds it: one line of
/// the server's per line of output (journald splits on `\n` only: vLLM's `\r` stays), without
/// the recorder's `# ` header lines.
fn engine_output(path: &str) -> Vec<Line> {
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/engines").join(path);
    let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    text.split('\n').filter(|m| !m.is_empty() && !m.starts_with("# ")).map(|m| svc(1, m)).collect()
}

/// A recorded output as an instance that exited 1 on its own.
fn crashed_with(path: &str) -> Diagnosis {
    let mut lines = vec![sys(0, "Started x.service.")];
    lines.extend(engine_output(path));
    lines.push(sys(2, "x.service: Main process exited, code=exited, status=1/FAILURE"));
    lines.push(sys(2, "x.service: Failed with result 'exit-code'."));
    classify(&ev(lines))
}

/// A recorded output as a new instance that never became ready, stopped by specd to roll back.
fn failed_start_with(path: &str) -> Diagnosis {
    let mut lines = vec![sys(0, "Started x.service.")];
    lines.extend(engine_output(path));
    lines.extend([
        note(9_900, "rollback", "i1"),
        sys(10, "Stopping x.service..."),
        sys(10, "x.service: Main process exited, code=killed, status=15/TERM"),
        sys(10, "x.service: Deactivated successfully."),
    ]);
    classify(&ev(lines))
}

/// What specd quotes for a recorded failure, as a crash and as a failed start specd rolled
/// back: the same words, in both summaries and in `engine_error`.
#[track_caller]
fn quotes_real(path: &str, want: &str) {
    let d = crashed_with(path);
    assert_eq!(d.verdict, Verdict::Crash, "{d:#?}");
    assert_eq!(d.engine_error.as_deref(), Some(want), "{path}");
    assert_eq!(
        d.summary,
        format!("crash: the server died on its own: exit status 1, the server's own error: \"{want}\"")
    );
    let d = failed_start_with(path);
    assert_eq!(d.verdict, Verdict::FailedStart, "{d:#?}");
    assert_eq!(d.engine_error.as_deref(), Some(want), "{path}");
    assert_eq!(
        d.summary,
        format!("failed start: the server did not start (the server's own error: \"{want}\"); specd then stopped it")
    );
}

/// The pydantic error vLLM 0.32 dies of when its draft model's directory is not there (or has
/// no `config.json`), whole: the path, what it looked for.
fn invalid_repository(path: &str) -> String {
    format!(
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for SpeculativeConfig Value error, Invalid repository ID or local directory specified: '{path}'. Please verify the following requirements: 1. Provide a valid Hugging Face repository ID. 2. Specify a local directory that contains a recognized configuration file. - For Hugging Face models: ensure the presence of a 'config.json'. - For Mistral models: ensure the presence of a 'params.json'."
    )
}

#[test]
fn real_vllm_missing_draft_quotes_its_validation_error_not_its_ulimit_warning_or_pydantic_s_link() {
    let path = "vllm/real/start-missing-draft.log";
    quotes_real(path, &invalid_repository("/srv/models/missing-draft"));
    let d = crashed_with(path);
    // Cited: the exception and its message lines; not the frames, pydantic's tail, the ERROR
    // lines of the hub lookup it retried before, or the warning.
    let cited: Vec<&str> = d.evidence.iter().filter(|e| e.source == Origin::Service).map(|e| e.text.as_str()).collect();
    assert_eq!(cited.len(), 7, "{cited:#?}");
    assert!(
        cited[0].ends_with("pydantic_core._pydantic_core.ValidationError: 1 validation error for SpeculativeConfig")
    );
    assert!(cited[6].ends_with("   - For Mistral models: ensure the presence of a 'params.json'."), "{cited:#?}");
    for text in [&d.summary, d.engine_error.as_ref().unwrap()] {
        for not in ["ulimit", "For further information", "errors.pydantic.dev", "input_value", "Traceback", "File \""] {
            assert!(!text.contains(not), "{not:?} in {text}");
        }
    }
}

#[test]
fn real_vllm_draft_without_config_quotes_its_validation_error() {
    quotes_real("vllm/real/start-draft-no-config.log", &invalid_repository("/srv/models/draft-no-config"));
}

#[test]
fn real_vllm_bad_num_speculative_tokens_quotes_the_field_and_the_rule() {
    quotes_real(
        "vllm/real/start-bad-num-speculative-tokens.log",
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for SpeculativeConfig num_speculative_tokens Input should be greater than 0",
    );
}

#[test]
fn real_vllm_unknown_method_quotes_the_methods_it_takes_cut_at_500_characters() {
    let path = "vllm/real/start-unknown-method.log";
    let d = crashed_with(path);
    let e = d.engine_error.clone().unwrap();
    assert!(
        e.starts_with(
            "pydantic_core._pydantic_core.ValidationError: 1 validation error for SpeculativeConfig method Input should be 'ngram', 'medusa', 'mlp_speculator', 'draft_model', 'suffix', 'custom_class', 'eagle', 'eagle3', "
        ),
        "{e}"
    );
    assert_eq!(e.chars().count(), 500, "{e}");
    assert!(e.ends_with('…'), "{e}");
    quotes_real(path, &e);
}

/// vLLM warns at every start that it "failed" to raise its ulimit: that line is never an error,
/// in any recorded output, whatever the ending.
#[test]
fn real_vllm_ulimit_warning_is_never_chosen() {
    for name in [
        "start-missing-draft",
        "start-draft-no-config",
        "start-bad-num-speculative-tokens",
        "start-unknown-method",
        "start-ngram",
        "stop-ngram",
        "stop-ngram.engine-dead",
    ] {
        let path = format!("vllm/real/{name}.log");
        let warnings: Vec<Line> = engine_output(&path).into_iter().filter(|l| l.message.contains("WARNING")).collect();
        assert!(warnings.iter().all(|l| !super::facts::looks_like_error(&l.message)), "{path}");
        for d in [crashed_with(&path), failed_start_with(&path)] {
            assert!(!d.summary.contains("ulimit"), "{path}: {}", d.summary);
            assert!(!has_evidence(&d, "ulimit"), "{path}: {d:#?}");
            assert!(d.engine_error.as_ref().is_none_or(|e| !e.contains("ulimit")), "{path}");
        }
    }
    // The ngram server that started fine said nothing fatal: the old fallback (its last
    // lines) stays, and a stop of it is a clean stop with no engine error.
    let d = crashed_with("vllm/real/start-ngram.log");
    assert_eq!(d.engine_error, None, "{d:#?}");
    assert_contains(&d.summary, "exit status 1, last output: ");
    let d = failed_start_with("vllm/real/start-ngram.log");
    assert_eq!((d.verdict, d.engine_error), (Verdict::CleanStop, None));
}

/// A clean stop of vLLM that logs an EngineDeadError traceback on the way out (a race in about
/// half of its stops) is a clean stop: no engine error, whatever it printed.
#[test]
fn real_vllm_engine_dead_traceback_on_a_clean_stop_is_no_engine_error() {
    let mut lines = vec![sys(0, "Started x.service."), sys(1, "Stopping x.service...")];
    lines.extend(engine_output("vllm/real/stop-ngram.engine-dead.log"));
    lines.push(sys(2, "x.service: Deactivated successfully."));
    let d = classify(&ev(lines));
    assert_eq!((d.verdict, d.engine_error.as_deref()), (Verdict::CleanStop, None), "{d:#?}");
}

/// The failure under the path llama-server was given: the loader's first error names it, the
/// last says the server exits.
fn llama_load_error(first: &str) -> String {
    format!("{first} … srv llama_server: exiting due to model loading error")
}

#[test]
fn real_llama_server_missing_model_quotes_the_gguf_it_could_not_open() {
    quotes_real(
        "llama-cpp/failures/start-missing-model.log",
        &llama_load_error(
            "gguf_init_from_file: failed to open GGUF file '/srv/models/missing.gguf' (No such file or directory)",
        ),
    );
}

#[test]
fn real_llama_server_not_a_gguf_quotes_the_magic_it_read() {
    quotes_real(
        "llama-cpp/failures/start-not-a-gguf.log",
        // The loader's error names no file: llama-server's own line says which model it was.
        &llama_load_error(
            "gguf_init_from_reader: invalid magic characters: 'This', expected 'GGUF' … srv load_model: failed to load model, '/srv/models/not-a-model.gguf'",
        ),
    );
}

/// Its warning that it "failed to measure the memory of the extra model" (the draft) is never
/// quoted or cited.
#[test]
fn real_llama_server_missing_draft_quotes_the_draft_s_gguf_not_its_warning() {
    for path in ["llama-cpp/failures/start-missing-draft.log", "llama-cpp/start-bad-draft.stderr.txt"] {
        let gguf = if path.contains("failures") { "/srv/models/missing-draft.gguf" } else { "/nonexistent.gguf" };
        quotes_real(
            path,
            &llama_load_error(&format!(
                "gguf_init_from_file: failed to open GGUF file '{gguf}' (No such file or directory)"
            )),
        );
        for d in [crashed_with(path), failed_start_with(path)] {
            assert!(!has_evidence(&d, "failed to measure"), "{d:#?}");
            assert!(!d.summary.contains("failed to measure"), "{}", d.summary);
        }
    }
}

/// A GGUF cut short: the loader names a tensor, not the file; llama-server's own line says
/// whether it was the model or the draft, and which file.
#[test]
fn real_llama_server_truncated_gguf_says_whether_the_model_or_the_draft_and_which_file() {
    let bounds = "llama_model_load: error loading model: tensor 'blk.15.attn_output.weight' data is not within the file bounds, model is corrupted or incomplete";
    quotes_real(
        "llama-cpp/failures/start-truncated-model.log",
        &llama_load_error(&format!("{bounds} … srv load_model: failed to load model, '/srv/models/truncated.gguf'")),
    );
    quotes_real(
        "llama-cpp/failures/start-truncated-draft.log",
        &llama_load_error(&format!(
            "{bounds} … srv load_model: failed to load draft model, '/srv/models/truncated.gguf'"
        )),
    );
}

/// A value its argument parser refuses: one plain line, before the usage it prints.
#[test]
fn real_llama_server_bad_values_quote_the_argument_parser() {
    quotes_real(
        "llama-cpp/failures/start-bad-spec-type.log",
        "error while handling argument \"--spec-type\": unknown speculative type: foo",
    );
    quotes_real(
        "llama-cpp/failures/start-bad-draft-n-max.log",
        "error while handling argument \"--spec-draft-n-max\": invalid value",
    );
}

/// What an instance said, as `journalctl -o json --output-fields=MESSAGE` gives it: each message
/// (bytes too) with its monotonic time, and the last cursor to read on from.
#[test]
fn an_instance_s_lines_are_read_with_their_monotonic_times_and_the_cursor() {
    let text = concat!(
        r#"{"__CURSOR":"s=a;i=1","__REALTIME_TIMESTAMP":"1796206680000000","__MONOTONIC_TIMESTAMP":"5000100","_BOOT_ID":"b","MESSAGE":"Load weight begin."}"#,
        "\n",
        r#"{"__CURSOR":"s=a;i=2","__MONOTONIC_TIMESTAMP":"5000200","MESSAGE":[76,111,97,100,233]}"#,
        "\n",
        r#"{"__CURSOR":"s=a;i=3","__MONOTONIC_TIMESTAMP":"5000300"}"#,
        "\nnot json\n"
    );
    let (lines, cursor) = super::parse::said_lines(text);
    assert_eq!(lines, [(5_000_100, "Load weight begin.".to_string()), (5_000_200, "Load\u{fffd}".to_string())]);
    assert_eq!(cursor.as_deref(), Some("s=a;i=3"));
    assert_eq!(super::parse::said_lines(""), (vec![], None));
}

/// A start that died says in which phase of its start it ended (the engine told by whose lines
/// tell the most): the real vLLM's lines up to its weights, then its loader's traceback; a start
/// that said it serves and crashed later says nothing of the kind.
#[test]
fn a_start_that_died_says_in_which_phase() {
    let real = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/engines/vllm/startup/startup-eager.log"),
    )
    .unwrap();
    let mut lines = vec![sys(0, "Started x.service.")];
    for (i, l) in real.lines().map(|l| l.trim_start().split_once(' ').unwrap().1).enumerate() {
        if l.contains("Loading weights took") {
            break;
        }
        lines.push(Line { time_us: 1_000_000 + i as u64 * 100_000, ..svc(0, l) });
    }
    let loading = lines.last().unwrap().time_us;
    let mut died = lines.clone();
    died.push(Line { time_us: loading + 2_000_000, ..svc(0, "safetensors_rust.SafetensorError: Error while deserializing header: incomplete metadata, file not fully covered") });
    died.push(Line {
        time_us: loading + 3_000_000,
        ..sys(0, "x.service: Main process exited, code=exited, status=1/FAILURE")
    });
    died.push(Line { time_us: loading + 3_000_000, ..sys(0, "x.service: Failed with result 'exit-code'.") });
    let d = classify(&ev(died));
    let from = lines.iter().find(|l| l.message.contains("Starting to load model")).unwrap().time_us;
    let into = (loading + 3_000_000 - from) as f64 / 1e6;
    let after = (loading + 3_000_000) as f64 / 1e6;
    let want = format!("it ended while starting, in phase weights ({into:.1}s into it, {after:.1}s after its start)");
    assert!(d.notes.contains(&want), "{want}\n{d:#?}");
    let rendered = render_text(&d);
    assert_contains(&rendered, "in phase weights");
    // Ready, then crashed: no phase.
    let mut served = lines;
    served.push(Line { time_us: loading + 1_000_000, ..svc(0, "INFO:     Application startup complete.") });
    served.push(Line {
        time_us: loading + 9_000_000,
        ..sys(0, "x.service: Main process exited, code=killed, status=11/SEGV")
    });
    let d = classify(&ev(served));
    assert!(!d.notes.iter().any(|n| n.contains("while starting")), "{d:#?}");
}
