//! `specd sweep` end to end: its load generator against the stand-in process (as each engine)
//! and against the real llama-server; the command in the systemd box (points applied through
//! the apply path, a point that dies recorded with its verdict, kill -9 and --resume, a running
//! agent that keeps its hands off the swept unit); a real llama-server sweep over the draft size.

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use specd::parts::sweep::{Api as LoadApi, BUILTIN_PROMPTS, Level as LoadLevel, LevelResult, run as run_load};
use specd_spec::Engine;

fn standin(args: &[&str], env: &[(&str, &str)]) -> Reaped {
    let mut c = Command::new(bin_path("specd-standin"));
    c.args(args).stdout(Stdio::null()).stderr(Stdio::null());
    for (k, v) in env {
        c.env(k, v);
    }
    Reaped(c.spawn().unwrap())
}

fn ready(port: u16, path: &str, within: Duration) {
    wait_until("the server to answer ready", within, || http_get(port, path).is_some_and(|(c, _)| c == 200)).unwrap();
}

fn level(port: u16, engine: Engine, api: LoadApi, concurrency: u32, requests: u32, max_tokens: u32) -> LoadLevel {
    LoadLevel {
        base_url: format!("http://127.0.0.1:{port}"),
        engine,
        api,
        model: None,
        concurrency,
        requests,
        duration: None,
        warmup: 1,
        max_tokens,
        prompts: Arc::new(BUILTIN_PROMPTS.iter().map(|p| p.to_string()).collect()),
        timeout: Duration::from_secs(60),
    }
}

fn run(l: &LoadLevel) -> LevelResult {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(run_load(l))
}

/// The stand-in generates at a known rate per request (100 tok/s here): the load generator must
/// find that rate per request, about `concurrency` times it in aggregate, and SGLang's accept
/// length from its own counts.
#[test]
fn the_load_generator_measures_the_standin_as_sglang_over_both_apis() {
    let port = free_port();
    let ps = port.to_string();
    let _p = standin(
        &[
            "sglang",
            "--model-path",
            "/m",
            "--port",
            &ps,
            "--speculative-algorithm",
            "EAGLE",
            "--speculative-num-steps",
            "3",
            "--speculative-eagle-topk",
            "1",
            "--speculative-num-draft-tokens",
            "4",
        ],
        &[
            ("SPECD_STANDIN_LOAD_MS", "0"),
            ("SPECD_STANDIN_WARMUP_MS", "0"),
            ("SPECD_STANDIN_TOKENS_PER_SEC", "100"),
            ("SPECD_STANDIN_ACCEPT_LENGTH", "2.5"),
        ],
    );
    ready(port, "/health_generate", Duration::from_secs(10));
    let r = run(&level(port, Engine::Sglang, LoadApi::Generate, 4, 8, 16));
    assert_eq!((r.requests, r.errors), (8, 0), "{r:?}");
    assert_eq!(r.output_tokens, 8 * 16, "the server's own completion_tokens: {r:?}");
    let median = r.tok_s_median.unwrap();
    assert!((60.0..=110.0).contains(&median), "per request ~100 tok/s: {r:?}");
    assert!(r.tok_s_p10.unwrap() <= median);
    assert!(r.throughput > 2.0 * median && r.throughput <= 4.4 * median, "4 at once: {r:?}");
    assert!(r.ttft_ms_p50.unwrap() <= r.ttft_ms_p99.unwrap());
    assert!((7.0..=30.0).contains(&r.itl_ms_p50.unwrap()), "a token every 10 ms: {r:?}");
    // SGLang's accept length: completion tokens / verify passes, over the level.
    let al = r.accept_length.unwrap();
    assert!((2.2..=2.7).contains(&al), "{r:?}");
    assert!(r.evidence[0].contains("spec_verify_ct"), "{r:?}");

    let r = run(&level(port, Engine::Sglang, LoadApi::Completions, 2, 4, 8));
    assert_eq!((r.requests, r.errors, r.output_tokens), (4, 0, 32), "{r:?}");
}

/// vLLM's evidence is its `spec_decode` counters: read before and after the level (the warm-up
/// outside them), their difference is the level's accept length.
#[test]
fn the_load_generator_reads_vllm_counters_around_a_level() {
    let port = free_port();
    let ps = port.to_string();
    let _p = standin(
        &[
            "vllm",
            "serve",
            "/m",
            "--port",
            &ps,
            "--speculative-config",
            r#"{"method":"mtp","num_speculative_tokens":3}"#,
        ],
        &[("SPECD_STANDIN_LOAD_MS", "0"), ("SPECD_STANDIN_TOKENS_PER_SEC", "2000")],
    );
    ready(port, "/health", Duration::from_secs(10));
    let r = run(&level(port, Engine::Vllm, LoadApi::Completions, 2, 4, 32));
    assert_eq!((r.requests, r.errors, r.output_tokens), (4, 0, 128), "{r:?}");
    let al = r.accept_length.unwrap_or_else(|| panic!("{r:?}"));
    assert!(al > 1.5 && al <= 4.0, "{r:?}");
    let rate = r.accept_rate.unwrap();
    assert!((1.0 + 3.0 * rate - al).abs() < 1e-9, "three draft tokens a step: {r:?}");
    assert!(r.evidence.iter().any(|e| e.starts_with("vllm:spec_decode_num_drafts_total +")), "{r:?}");
}

/// A server that dies under load: the requests in flight fail with a cause, and the level says
/// so (the sweep records it; the diagnosis tells why it died).
#[test]
fn requests_to_a_server_that_dies_are_errors_with_a_cause() {
    let port = free_port();
    let ps = port.to_string();
    let mut p = standin(
        &["vllm", "serve", "/m", "--port", &ps],
        &[("SPECD_STANDIN_LOAD_MS", "0"), ("SPECD_STANDIN_TOKENS_PER_SEC", "20")],
    );
    ready(port, "/health", Duration::from_secs(10));
    let l = level(port, Engine::Vllm, LoadApi::Completions, 2, 2, 200);
    let load = std::thread::spawn(move || run(&l));
    wait_until("requests in flight", Duration::from_secs(10), || {
        http_get(port, "/metrics").is_some_and(|(_, m)| {
            m.lines().any(|x| x.starts_with("vllm:num_requests_running") && !x.ends_with(" 0.0") && !x.ends_with(" 0"))
        })
    })
    .unwrap();
    p.0.kill().unwrap();
    let r = load.join().unwrap();
    assert_eq!(r.errors, 2, "{r:?}");
    let e = r.first_error.unwrap();
    assert!(e.contains("stream") || e.contains("connect"), "{e}");
}

/// A level of a duration against a server that is gone ends after a run of failures, not at the
/// end of its duration (each request fails at once: it would spin and pile up records).
#[test]
fn a_level_of_a_duration_against_a_server_that_is_gone_ends_soon() {
    let mut l = level(free_port(), Engine::Sglang, LoadApi::Generate, 2, 0, 16);
    l.duration = Some(Duration::from_secs(600));
    let t0 = std::time::Instant::now();
    let r = run(&l);
    assert!(t0.elapsed() < Duration::from_secs(60), "the level ran {:?}", t0.elapsed());
    assert!((32..=34).contains(&r.errors), "{r:?}");
}

/// The real llama-server with the same GGUF as its draft: the accept rate is llama-server's own
/// `timings.draft_n_accepted / draft_n` over the level's requests.
#[test]
fn the_load_generator_reads_real_llama_server_accept_rates() {
    let l = real_llama();
    let port = free_port();
    let ps = port.to_string();
    let _p = Reaped(
        Command::new(&l.server)
            .args(["-m", &l.gguf, "-md", &l.gguf, "--spec-type", "draft-simple", "--spec-draft-n-max", "4"])
            .args(["--host", "127.0.0.1", "--port", &ps, "-c", "1024", "--threads", "1", "-np", "1"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    ready(port, "/health", Duration::from_secs(120));
    let mut lv = level(port, Engine::LlamaCpp, LoadApi::Completions, 1, 2, 16);
    lv.prompts = Arc::new(vec![BUILTIN_PROMPTS[3].to_string()]);
    let r = run(&lv);
    assert_eq!((r.requests, r.errors), (2, 0), "{r:?}");
    assert_eq!(r.output_tokens, 32, "usage.completion_tokens: {r:?}");
    let rate = r.accept_rate.unwrap_or_else(|| panic!("no accept rate: {r:?}"));
    assert!(rate > 0.0 && rate <= 1.0, "{r:?}");
    assert!(r.evidence.iter().any(|e| e.starts_with("timings.draft_n=")), "{r:?}");
    assert!(r.tok_s_median.unwrap() > 0.0);
}

const UNIT: &str = "qwen.service";

/// The stand-in SGLang spec, quick to load and drain.
fn base_spec(e: &Env, steps: u32) -> String {
    base_spec_with(&e.standin, e.port, steps, "SPECD_STANDIN_TOKENS_PER_SEC: \"400\"")
}

/// The same with more of the stand-in's knobs (`NAME: "value"` entries of `environment`).
fn base_spec_with(standin: &str, port: u16, steps: u32, env: &str) -> String {
    let service = format!(
        "  service: {{timeout_stop_sec: 5, environment: {{SPECD_STANDIN_LOAD_MS: \"100\", SPECD_STANDIN_WARMUP_MS: \"0\", SPECD_STANDIN_DRAIN_POLL_MS: \"100\", {env}}}}}\n"
    );
    sglang_spec(standin, UNIT, port, steps, &service)
}

fn sweep_doc(steps: &str, after: &str) -> String {
    sweep_doc_with("base.yaml", steps, "[1, 4]", 4, after)
}

fn sweep_doc_with(base: &str, steps: &str, concurrency: &str, requests: u32, after: &str) -> String {
    format!(
        "apiVersion: specd/v1
kind: Sweep
metadata: {{name: steps}}
spec:
  base: {base}
  matrix:
    speculative.num_steps: [{steps}]
  load: {{concurrency: {concurrency}, requests: {requests}, warmup: 1, max_tokens: 16}}
  objective: {{maximize: throughput, at_concurrency: 4}}
  after: {after}
"
    )
}

fn results(e: &Env, out: &str) -> Vec<specd::parts::sweep::PointResult> {
    let text = e.b.read_to_string(&format!("{out}/results.jsonl")).unwrap_or_default();
    text.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|err| panic!("{err}: {l}"))).collect()
}

/// How many times each unit hash was applied (history entries `applied`).
fn applies(e: &Env) -> std::collections::BTreeMap<String, usize> {
    let mut m = std::collections::BTreeMap::new();
    for h in e.state(UNIT)["history"].as_array().unwrap() {
        if h["outcome"] == "applied" {
            *m.entry(h["sha256"].as_str().unwrap().to_string()).or_default() += 1;
        }
    }
    m
}

#[test]
fn a_sweep_measures_each_point_restores_the_unit_and_writes_its_reports() {
    let e = Env::new();
    let base = e.put("base.yaml", &base_spec(&e, 3));
    let o = e.specd(&["apply", "-f", &base]);
    assert!(o.status.success(), "{}", text(&o));
    let sweep = e.put("sweep.yaml", &sweep_doc("1, 2, 4", "restore"));
    let out = "/run/specs/out";
    let o = e.specd(&["sweep", "-f", &sweep, "--out", out]);
    let said = text(&o);
    assert!(o.status.success(), "{said}");
    let r = results(&e, out);
    assert_eq!(
        r.iter().map(|r| r.label.as_str()).collect::<Vec<_>>(),
        ["num_steps=1", "num_steps=2", "num_steps=4"],
        "{said}"
    );
    for p in &r {
        assert_eq!(p.outcome, specd::parts::sweep::PointOutcome::Measured, "{p:?}\n{said}");
        assert_eq!(p.levels.iter().map(|l| l.concurrency).collect::<Vec<_>>(), [1, 4]);
        assert!(p.levels.iter().all(|l| l.errors == 0 && l.requests == 4 && l.output_tokens == 64), "{p:?}");
        assert!(p.levels[0].accept_length.is_some(), "the engine's evidence: {p:?}");
        assert_eq!(p.max_running_requests, Some(serde_json::json!(16)));
    }
    // Every point went through the apply path once; the unit is back on steps 3, the hold gone.
    let a = applies(&e);
    assert!(r.iter().all(|p| a.get(&p.unit_sha256) == Some(&1)), "{a:?}");
    assert_eq!(e.served_steps(), Some(3));
    assert!(e.state(UNIT)["hold"].is_null(), "{}", e.state(UNIT));
    assert!(said.contains("[2/3] num_steps=2: verified and ready"), "{said}");
    assert!(said.contains("concurrency 4:"), "{said}");
    // The reports; the winner's change printed as a diff of the base spec.
    let table = e.b.read_to_string(&format!("{out}/table.md")).unwrap();
    assert!(table.starts_with("| point |") && table.contains("★"), "{table}");
    assert!(said.contains(&table), "the table is printed: {said}");
    let csv = e.b.read_to_string(&format!("{out}/results.csv")).unwrap();
    assert_eq!(csv.lines().count(), 1 + 3 * 2, "{csv}");
    let svg = e.b.read_to_string(&format!("{out}/plot.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("concurrency 4"), "{svg}");
    assert!(
        said.contains("--- /run/specs/base.yaml") && said.contains("-  speculative: {algorithm: NEXTN, num_steps: 3"),
        "{said}"
    );
    assert_eq!(
        e.b.read_to_string("/run/specs/base.yaml").unwrap(),
        base_spec(&e, 3),
        "no --write: the file is as it was"
    );

    // --write puts the winner into the base spec, the rest of the file byte for byte; a second
    // run over the same output directory needs --resume, and measures nothing again.
    let o = e.specd(&["sweep", "-f", &sweep, "--out", out]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("--resume"), "{}", text(&o));
    // The operator's file (run with sudo, specd is root): it stays theirs.
    e.b.check(&["chown", "65534:65534", "/run/specs/base.yaml"]).unwrap();
    // With --json, the final summary is one JSON document on stdout; the progress on stderr.
    let o = e.specd(&["sweep", "-f", &sweep, "--out", out, "--resume", "--write", "--json"]);
    let said = text(&o);
    assert!(o.status.success(), "{said}");
    assert!(String::from_utf8_lossy(&o.stderr).contains("[1/3] num_steps=1: measured before"), "{said}");
    assert_eq!(results(&e, out).len(), 3);
    let best = r.iter().max_by(|a, b| a.levels[1].throughput.total_cmp(&b.levels[1].throughput)).unwrap();
    let steps = best.values[0].1.as_u64().unwrap() as u32;
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|err| panic!("{err}: {said}"));
    assert_eq!(
        (j["ok"].as_bool(), j["interrupted"].as_bool(), j["error"].is_null()),
        (Some(true), Some(false), true),
        "{j:#}"
    );
    assert_eq!((j["sweep"].as_str(), j["unit"].as_str(), j["out"].as_str()), (Some("steps"), Some(UNIT), Some(out)));
    assert_eq!((j["points"].as_u64(), j["recorded"].as_u64()), (Some(3), Some(3)));
    assert_eq!((j["after"].as_str(), j["after_ok"].as_bool()), (Some("restore"), Some(true)), "{j:#}");
    assert_eq!(j["objective"], serde_json::json!({"maximize": "throughput", "concurrency": 4, "limits": {}}));
    assert_eq!(j["best"]["label"], format!("num_steps={steps}"));
    assert_eq!(j["best"]["unit_sha256"], best.unit_sha256.as_str());
    assert_eq!(j["best"]["values"], serde_json::json!([["speculative.num_steps", steps]]));
    assert_eq!(j["files"]["table"], format!("{out}/table.md"));
    assert_eq!(j["files"]["plot"], format!("{out}/plot.svg"));
    assert_eq!(j["spec_written"], true);
    let change = j["spec_change"].as_str().unwrap();
    assert!(change.contains(&format!("+  speculative: {{algorithm: NEXTN, num_steps: {steps},")), "{change}");
    let recs: Vec<specd::parts::sweep::PointResult> = serde_json::from_value(j["results"].clone()).unwrap();
    assert_eq!(
        recs.iter().map(|r| r.unit_sha256.as_str()).collect::<Vec<_>>(),
        r.iter().map(|r| r.unit_sha256.as_str()).collect::<Vec<_>>()
    );
    let written = e.b.read_to_string("/run/specs/base.yaml").unwrap();
    assert_eq!(
        written,
        base_spec(&e, 3).replace(
            "num_steps: 3, eagle_topk: 1, num_draft_tokens: 4",
            &format!("num_steps: {steps}, eagle_topk: 1, num_draft_tokens: {}", steps + 1)
        ),
        "{said}"
    );
    assert_eq!(
        e.b.sh_check("stat -c %u:%g /run/specs/base.yaml").unwrap().trim(),
        "65534:65534",
        "--write took the file"
    );
    let o = e.specd(&["render", "--hash", &base]);
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), best.unit_sha256);
    e.b.shutdown().unwrap();
}

#[test]
fn bad_sweep_input_is_located_and_changes_nothing() {
    let e = Env::new();
    e.put("base.yaml", &base_spec(&e, 3));
    let sweep = e.put("sweep.yaml", &sweep_doc("1, 2", "restore").replace("max_tokens: 16", "max_tokens: sixteen"));
    let o = e.specd(&["sweep", "-f", &sweep, "--out", "/run/specs/out"]);
    let said = text(&o);
    assert_eq!(o.status.code(), Some(1), "{said}");
    assert!(said.contains("/run/specs/sweep.yaml:8:") && said.contains("nothing was changed"), "{said}");
    assert!(e.b.read_file("/run/specs/out/results.jsonl").is_err());
    assert!(e.b.read_file(&format!("/var/lib/specd/units/{UNIT}.json")).is_err(), "no state written");
    e.b.shutdown().unwrap();
}

/// The campaign of the issue on the stand-in's performance model: steps 1..6 at concurrency 1
/// and 4, where the GPU holds at most 6 draft tokens: steps 6 (7 draft tokens) dies of CUDA OOM
/// while loading. It is recorded with its verdict, the unit rolled back, and the sweep goes on.
#[test]
fn a_point_that_dies_of_cuda_oom_is_recorded_with_its_verdict_and_the_sweep_goes_on() {
    let e = Env::new();
    let env = "SPECD_STANDIN_BASE_TOKENS_PER_SEC: \"120\", SPECD_STANDIN_MAX_DRAFT_TOKENS: \"6\"";
    let base = e.put("base.yaml", &base_spec_with(&e.standin, e.port, 3, env));
    let o = e.specd(&["apply", "-f", &base]);
    assert!(o.status.success(), "{}", text(&o));
    let sweep =
        e.put("sweep.yaml", &sweep_doc("1, 2, 3, 6, 4, 5", "restore").replace("name: steps", "name: qwen-mtp-steps"));
    let out = "/run/specs/out";
    let o = e.specd(&["sweep", "-f", &sweep, "--out", out]);
    let said = text(&o);
    assert!(o.status.success(), "{said}");
    let r = results(&e, out);
    assert_eq!(r.len(), 6, "{said}");
    let oom = &r[3];
    assert_eq!(
        (oom.label.as_str(), oom.outcome),
        ("num_steps=6", specd::parts::sweep::PointOutcome::ApplyFailed),
        "{said}"
    );
    assert_eq!(oom.verdict.as_deref(), Some("cuda-oom"), "{oom:?}\n{said}");
    assert!(oom.summary.as_deref().unwrap_or("").contains("CUDA"), "{oom:?}");
    for p in r.iter().filter(|p| p.label != "num_steps=6") {
        assert_eq!(p.outcome, specd::parts::sweep::PointOutcome::Measured, "{p:?}\n{said}");
        assert!(p.levels.iter().all(|l| l.errors == 0 && l.accept_length.is_some()), "{p:?}");
    }
    // The points after the dead one were measured on their own units; the unit is back.
    assert_eq!(e.served_steps(), Some(3));
    assert!(said.contains("[4/6] num_steps=6: apply failed: cuda-oom"), "{said}");
    let table = e.b.read_to_string(&format!("{out}/table.md")).unwrap();
    assert!(table.contains("| num_steps=6 | – |") && table.contains("apply failed: cuda-oom"), "{table}");
    let svg = e.b.read_to_string(&format!("{out}/plot.svg")).unwrap();
    assert!(svg.contains("cuda-oom"), "the failed point is marked on the plot");
    e.b.shutdown().unwrap();
}

/// kill -9 of the sweep in the middle: the points recorded stay recorded; --resume measures only
/// the others (no new apply of a finished point), restores the unit and ends the hold.
#[test]
fn a_sweep_killed_mid_way_resumes_without_measuring_finished_points_again() {
    let e = Env::new();
    let base = e.put("base.yaml", &base_spec_with(&e.standin, e.port, 3, "SPECD_STANDIN_TOKENS_PER_SEC: \"100\""));
    let o = e.specd(&["apply", "-f", &base]);
    assert!(o.status.success(), "{}", text(&o));
    let sweep = e.put("sweep.yaml", &sweep_doc_with("base.yaml", "1, 2, 4, 5", "[1, 4]", 6, "restore"));
    let out = "/run/specs/out";
    let log = "/run/specs/sweep.log";
    let script = format!("exec {} sweep -f {sweep} --out {out} >{log} 2>&1", e.specd);
    let mut child = e.b.command(&["/bin/sh", "-c", &script]).spawn().unwrap();
    let recorded = wait_until("two points recorded", Duration::from_secs(60), || {
        results(&e, out).len() >= 2 || child.try_wait().unwrap().is_some()
    });
    let sweep_log = || e.b.read_to_string(log).unwrap_or_default();
    assert!(recorded.is_ok() && child.try_wait().unwrap().is_none(), "{recorded:?}\n{}", sweep_log());
    // The sweep's pid (in the box) is its hold's.
    let pid = e.state(UNIT)["hold"]["pid"].as_u64().expect("the sweep holds the unit");
    assert!(e.b.sh(&format!("kill -9 {pid}")).status.success());
    let _ = child.wait();
    let done = results(&e, out);
    assert!(done.len() < 4, "killed before the end: {done:?}");
    let applied_before = applies(&e);

    let o = e.specd(&["sweep", "-f", &sweep, "--out", out, "--resume"]);
    let said = text(&o);
    assert!(o.status.success(), "{said}");
    let all = results(&e, out);
    assert_eq!(all.len(), 4, "{said}");
    assert_eq!(&all[..done.len()], &done[..], "the records before the kill are kept as they were");
    let labels: std::collections::BTreeSet<_> = all.iter().map(|r| r.label.clone()).collect();
    assert_eq!(labels.len(), 4, "each point once: {all:?}");
    let applied_after = applies(&e);
    for p in &done {
        assert_eq!(
            applied_after.get(&p.unit_sha256),
            applied_before.get(&p.unit_sha256),
            "{} applied again\n{said}",
            p.label
        );
        assert!(said.contains(&format!("{}: measured before", p.label)), "{said}");
    }
    assert_eq!(e.served_steps(), Some(3));
    assert!(e.state(UNIT)["hold"].is_null());
    assert!(e.specd(&["status"]).status.success(), "{}", text(&e.specd(&["status"])));
    e.b.shutdown().unwrap();
}

/// With `specd run` following a repository, the agent keeps its hands off the unit a sweep holds
/// (no apply of its own while the sweep runs, though each point is drift to it), and manages it
/// again once the sweep has restored it and let go: a new commit deploys.
#[test]
fn a_running_agent_leaves_the_swept_unit_alone_and_manages_it_again_after() {
    let f = Fleet::new();
    let (e, repo) = (&f.e, &f.repo);
    let spec_file = repo.join("specs/qwen.yaml");
    let commit = |steps: u32| {
        std::fs::write(&spec_file, base_spec(e, steps)).unwrap();
        git(repo, &["add", "-A"]);
        git(repo, &["commit", "-q", "-m", &format!("steps {steps}")]);
    };
    commit(3);
    f.run_agent(&repo.display().to_string(), "", "");
    let journal = || e.b.journal(AGENT).unwrap_or_default();
    wait_until("the agent to deploy steps 3", Duration::from_secs(60), || e.served_steps() == Some(3))
        .unwrap_or_else(|err| panic!("{err}\n{}", journal()));
    wait_until("the agent's apply to be recorded", Duration::from_secs(30), || {
        e.state(UNIT)["in_progress"].is_null() && !e.state(UNIT)["history"].as_array().unwrap().is_empty()
    })
    .unwrap();
    let history_before = e.state(UNIT)["history"].as_array().unwrap().len();

    // The sweep's base is the spec file of the repository's working tree.
    let sweep =
        e.put("sweep.yaml", &sweep_doc_with(&spec_file.display().to_string(), "1, 2, 4", "[1, 4]", 6, "restore"));
    let o = e.specd(&["sweep", "-f", &sweep, "--out", "/run/specs/out"]);
    let said = text(&o);
    assert!(o.status.success(), "{said}\n{}", journal());
    let r = results(e, "/run/specs/out");
    assert!(r.iter().all(|p| p.outcome == specd::parts::sweep::PointOutcome::Measured), "{r:?}");
    // Between the sweep's hold and its release, every apply is the sweep's: one per point, then
    // the restore of the agent's unit. None of the agent's own.
    let st = e.state(UNIT);
    let h = &st["history"].as_array().unwrap()[history_before..];
    let kinds: Vec<&str> = h.iter().map(|x| x["outcome"].as_str().unwrap()).collect();
    let first = kinds.iter().position(|k| *k == "hold-set").unwrap_or_else(|| panic!("{kinds:?}"));
    let last = kinds.iter().rposition(|k| *k == "hold-cleared").unwrap_or_else(|| panic!("{kinds:?}"));
    let applied: Vec<&str> =
        h[first..last].iter().filter(|x| x["outcome"] == "applied").map(|x| x["sha256"].as_str().unwrap()).collect();
    let mut expected: Vec<&str> = r.iter().map(|p| p.unit_sha256.as_str()).collect();
    expected.push(st["desired"]["sha256"].as_str().unwrap());
    assert_eq!(applied, expected, "{h:#?}");
    assert!(h[first..last].iter().all(|x| x["outcome"] != "rolled-back" && x["outcome"] != "failed"), "{h:#?}");
    assert!(journal().contains("a sweep holds it"), "the agent saw the hold: {}", journal());
    assert_eq!(e.served_steps(), Some(3));

    // The agent manages the unit again.
    commit(2);
    wait_until("the agent to deploy steps 2", Duration::from_secs(60), || e.served_steps() == Some(2))
        .unwrap_or_else(|err| panic!("{err}\n{}", journal()));
    f.e.b.shutdown().unwrap();
}

/// A sweep killed (-9) while it holds the unit: the running agent is woken by the sweep's
/// exit (no timer looks for it), ends the hold and puts the repository's spec back.
#[test]
fn a_running_agent_takes_the_unit_back_when_its_sweep_is_killed() {
    let f = Fleet::new();
    let (e, repo) = (&f.e, &f.repo);
    let spec_file = repo.join("specs/qwen.yaml");
    std::fs::write(&spec_file, base_spec_with(&e.standin, e.port, 3, "SPECD_STANDIN_TOKENS_PER_SEC: \"100\"")).unwrap();
    git(repo, &["add", "-A"]);
    git(repo, &["commit", "-q", "-m", "steps 3"]);
    f.run_agent(&repo.display().to_string(), "", "");
    let journal = || e.b.journal(AGENT).unwrap_or_default();
    wait_until("the agent to deploy steps 3", Duration::from_secs(60), || e.served_steps() == Some(3))
        .unwrap_or_else(|err| panic!("{err}\n{}", journal()));

    // 40 requests of 16 tokens at 100 tokens/s: the first level measures for about 6 s.
    let sweep = e.put("sweep.yaml", &sweep_doc_with(&spec_file.display().to_string(), "1, 2", "[1, 4]", 40, "restore"));
    let out = "/run/specs/out";
    let script = format!("exec {} sweep -f {sweep} --out {out} >/run/specs/sweep.log 2>&1", e.specd);
    let mut child = e.b.command(&["/bin/sh", "-c", &script]).spawn().unwrap();
    // Killed while it measures its first point: the point's apply is over (no change of the
    // unit's state comes after it to wake the agent).
    wait_until("the first point to be measured", Duration::from_secs(60), || {
        e.served_steps() == Some(1) && e.state(UNIT)["in_progress"].is_null() && results(e, out).is_empty()
    })
    .unwrap();
    let pid = e.state(UNIT)["hold"]["pid"].as_u64().expect("the sweep holds the unit");
    assert!(e.b.sh(&format!("kill -9 {pid}")).status.success());
    let _ = child.wait();
    wait_until("the agent to put steps 3 back", Duration::from_secs(30), || {
        e.served_steps() == Some(3) && e.state(UNIT)["hold"].is_null()
    })
    .unwrap_or_else(|err| panic!("{err}\n{}", journal()));
    assert!(journal().contains(&format!("hold ended (its process {pid} is gone)")), "{}", journal());
    f.e.b.shutdown().unwrap();
}

/// The real llama-server (the GGUF as its own draft model) swept over `speculative.num_steps`
/// (`--spec-draft-n-max`): each point reports llama-server's own accept rate.
#[test]
fn a_real_llama_server_sweep_over_the_draft_size_reports_real_accept_rates() {
    let l = real_llama();
    let e = Env::with_real_llama(&l);
    let base = l.spec(UNIT, e.port, &format!("  speculative: {{draft_model: {}, num_steps: 4}}\n", l.gguf), "");
    e.put("base.yaml", &base);
    let sweep = e.put(
        "sweep.yaml",
        "apiVersion: specd/v1
kind: Sweep
metadata: {name: smol-draft}
spec:
  base: base.yaml
  matrix:
    speculative.num_steps: [2, 6]
  load: {concurrency: [1], requests: 2, warmup: 1, max_tokens: 24}
  after: best
",
    );
    let o = e.specd(&["sweep", "-f", &sweep, "--out", "/run/specs/out"]);
    let said = text(&o);
    assert!(o.status.success(), "{said}");
    let r = results(&e, "/run/specs/out");
    assert_eq!(r.len(), 2, "{said}");
    for p in &r {
        assert_eq!(p.outcome, specd::parts::sweep::PointOutcome::Measured, "{p:?}\n{said}");
        let lv = &p.levels[0];
        assert_eq!((lv.requests, lv.errors, lv.output_tokens), (2, 0, 48), "{p:?}");
        let rate = lv.accept_rate.unwrap_or_else(|| panic!("no accept rate: {p:?}"));
        assert!(rate > 0.0 && rate <= 1.0, "{p:?}");
        assert!(lv.evidence.iter().any(|x| x.starts_with("timings.draft_n=")), "{p:?}");
        assert!(p.proof.as_deref().is_some_and(|f| f.contains("accept rate")), "the apply's proof: {p:?}");
        assert_eq!(p.max_running_requests, Some(serde_json::json!(1)), "llama-server's /props total_slots");
    }
    // after: best leaves the winner running.
    let best = r.iter().max_by(|a, b| a.levels[0].throughput.total_cmp(&b.levels[0].throughput)).unwrap();
    assert_eq!(e.state(UNIT)["last_good"]["sha256"].as_str(), Some(best.unit_sha256.as_str()), "{said}");
    assert!(said.contains("after: applying the best point"), "{said}");
    e.b.shutdown().unwrap();
}

/// SIGTERM (or Ctrl-C) mid-sweep: the point in progress is dropped, the unit restored through the
/// apply path, the hold cleared, and the sweep says so (exit 130).
#[test]
fn a_sweep_stopped_by_sigterm_restores_the_unit_and_lets_go() {
    let e = Env::new();
    let base = e.put("base.yaml", &base_spec_with(&e.standin, e.port, 3, "SPECD_STANDIN_TOKENS_PER_SEC: \"100\""));
    let o = e.specd(&["apply", "-f", &base]);
    assert!(o.status.success(), "{}", text(&o));
    let sweep = e.put("sweep.yaml", &sweep_doc_with("base.yaml", "1, 2, 4, 5", "[1, 4]", 6, "restore"));
    let (out, log) = ("/run/specs/out", "/run/specs/sweep.log");
    let script = format!("exec {} sweep -f {sweep} --out {out} >{log} 2>&1", e.specd);
    let mut child = e.b.command(&["/bin/sh", "-c", &script]).spawn().unwrap();
    let sweep_log = || e.b.read_to_string(log).unwrap_or_default();
    let recorded = wait_until("a point recorded", Duration::from_secs(60), || {
        !results(&e, out).is_empty() || child.try_wait().unwrap().is_some()
    });
    assert!(recorded.is_ok() && child.try_wait().unwrap().is_none(), "{recorded:?}\n{}", sweep_log());
    let pid = e.state(UNIT)["hold"]["pid"].as_u64().expect("the sweep holds the unit");
    assert!(e.b.sh(&format!("kill -TERM {pid}")).status.success());
    let status = wait_for_exit(&mut child, Duration::from_secs(60));
    let said = sweep_log();
    assert_eq!(status.code(), Some(130), "{said}");
    assert!(said.contains("interrupted") && said.contains("after: restoring qwen.service"), "{said}");
    assert!(results(&e, out).len() < 4, "{said}");
    assert_eq!(e.served_steps(), Some(3));
    assert!(e.state(UNIT)["hold"].is_null());
    assert!(e.specd(&["status"]).status.success(), "{}", text(&e.specd(&["status"])));
    e.b.shutdown().unwrap();
}

fn wait_for_exit(c: &mut std::process::Child, within: Duration) -> std::process::ExitStatus {
    specd_e2e::wait_for("the sweep to exit", within, || c.try_wait().unwrap()).unwrap()
}

/// A server that dies while it is measured (here: SIGKILLed from outside, as the OOM killer would)
/// is a point that "died under load", with the diagnosis of its instance; the next point runs.
#[test]
fn a_server_that_dies_under_load_is_recorded_with_its_diagnosis_and_the_sweep_goes_on() {
    let e = Env::new();
    let base = e.put("base.yaml", &base_spec_with(&e.standin, e.port, 3, "SPECD_STANDIN_TOKENS_PER_SEC: \"50\""));
    let o = e.specd(&["apply", "-f", &base]);
    assert!(o.status.success(), "{}", text(&o));
    let sweep = e.put("sweep.yaml", &sweep_doc_with("base.yaml", "1, 2", "[1, 4]", 8, "restore"));
    let (out, log) = ("/run/specs/out", "/run/specs/sweep.log");
    let script = format!("exec {} sweep -f {sweep} --out {out} >{log} 2>&1", e.specd);
    let mut child = e.b.command(&["/bin/sh", "-c", &script]).spawn().unwrap();
    let sweep_log = || e.b.read_to_string(log).unwrap_or_default();
    // The first point under load: verified (the sweep says so), its requests in flight.
    wait_until("the first point under load", Duration::from_secs(60), || {
        sweep_log().contains("[1/2] num_steps=1: verified and ready") && e.running_requests().unwrap_or(0) > 0
    })
    .unwrap_or_else(|err| panic!("{err}\n{}", sweep_log()));
    let pid = e.main_pid(UNIT);
    assert!(e.b.sh(&format!("kill -9 {pid}")).status.success());
    let status = wait_for_exit(&mut child, Duration::from_secs(120));
    let said = sweep_log();
    assert!(status.success(), "{said}");
    let r = results(&e, out);
    assert_eq!(r.len(), 2, "{said}");
    assert_eq!(r[0].outcome, specd::parts::sweep::PointOutcome::DiedUnderLoad, "{:?}\n{said}", r[0]);
    let verdict = r[0].verdict.as_deref().unwrap_or("");
    assert!(!verdict.is_empty() && verdict != "unknown", "{:?}\n{said}", r[0]);
    assert_eq!(r[1].outcome, specd::parts::sweep::PointOutcome::Measured, "{said}");
    assert!(said.contains(&format!("[1/2] num_steps=1: died under load: {verdict}")), "{said}");
    assert_eq!(e.served_steps(), Some(3));
    e.b.shutdown().unwrap();
}
