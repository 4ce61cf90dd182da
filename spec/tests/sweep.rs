//! The sweep document: bad documents get located errors, the expansion into points follows the
//! matrix order and the engine's rules, and the checked-in schema and example are current.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::json;
use specd_spec::sweep::{self, After, Amount, Api, Metric, Prompts};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

const GOOD: &str = "apiVersion: specd/v1
kind: Sweep
metadata:
  name: steps
spec:
  base: qwen.yaml
  matrix:
    speculative.num_steps: [1, 2, 4]
  load:
    concurrency: [1, 16]
    requests: 64
  objective:
    at_concurrency: 16
";

/// (case, text replaced in GOOD, its replacement, the first error exactly as printed: file:line:col:
/// path: message)
const BAD: &[(&str, &str, &str, &str)] = &[
    ("wrong apiVersion", "specd/v1", "specd/v2", "s.yaml:1:13: apiVersion: must be `specd/v1`, got \"specd/v2\""),
    (
        "a spec's kind",
        "kind: Sweep",
        "kind: InferenceService",
        "s.yaml:2:7: kind: must be `Sweep`, got \"InferenceService\"",
    ),
    (
        "bad name",
        "name: steps",
        "name: Steps",
        "s.yaml:4:9: metadata.name: must be 1-63 lowercase letters, digits or `-`, not starting or ending with `-`; got \"Steps\"",
    ),
    (
        "no base",
        "  base: qwen.yaml\n",
        "",
        "s.yaml:5:1: spec.base: is required: the InferenceService spec file to sweep, relative to this file",
    ),
    (
        "unknown field",
        "  base: qwen.yaml\n",
        "  base: qwen.yaml\n  bse: x\n",
        "s.yaml:7:3: spec.bse: unknown field `bse`, expected one of base, host, matrix, load, objective, after",
    ),
    (
        "duplicate key",
        "  base: qwen.yaml\n",
        "  base: qwen.yaml\n  base: x\n",
        "s.yaml:7:3: spec.base: duplicate key `base`: each field may appear once",
    ),
    (
        "empty matrix",
        "  matrix:\n    speculative.num_steps: [1, 2, 4]\n",
        "  matrix: {}\n",
        "s.yaml:7:11: spec.matrix: may not be empty: give at least one spec field and its values, e.g. `speculative.num_steps: [1, 2, 4]`",
    ),
    (
        "no matrix",
        "  matrix:\n    speculative.num_steps: [1, 2, 4]\n",
        "",
        "s.yaml:5:1: spec.matrix: may not be empty: give at least one spec field and its values, e.g. `speculative.num_steps: [1, 2, 4]`",
    ),
    (
        "matrix field not a list",
        "[1, 2, 4]",
        "4",
        "s.yaml:8:5: spec.matrix.speculative.num_steps: expected a list of values for `speculative.num_steps`, e.g. `speculative.num_steps: [1, 2, 4]`",
    ),
    (
        "matrix field with no values",
        "[1, 2, 4]",
        "[]",
        "s.yaml:8:28: spec.matrix.speculative.num_steps: needs at least one value",
    ),
    (
        "unknown matrix field",
        "speculative.num_steps",
        "speculative.nm_steps",
        "s.yaml:8:5: spec.matrix.speculative.nm_steps: is not a field of an InferenceService spec: unknown field `nm_steps`, expected one of `algorithm`, `num_steps`, `eagle_topk`, `num_draft_tokens`, `draft_model`, `draft_min`, `draft_p_min`, `prompt_lookup_min`, `prompt_lookup_max`",
    ),
    (
        "matrix field with spec. prefix",
        "speculative.num_steps",
        "spec.speculative.num_steps",
        "s.yaml:8:5: spec.matrix.spec.speculative.num_steps: is not a field of an InferenceService spec: unknown field `spec`, expected one of `unit`, `engine`, `command`, `model`, `server`, `speculative`, `weights`, `service`, `readiness`, `policy`, `rollout` (write the path without `spec.`)",
    ),
    (
        "matrix path through a value",
        "speculative.num_steps",
        "server.port.x",
        "s.yaml:8:5: spec.matrix.server.port.x: is not a field of an InferenceService spec: `server.port` is a value, not a section",
    ),
    (
        "matrix value of the wrong type",
        "[1, 2, 4]",
        "[1, two, 4]",
        "s.yaml:8:32: spec.matrix.speculative.num_steps[1]: does not fit `speculative.num_steps`: expected an integer, got a string: \"two\"",
    ),
    (
        "matrix float for an integer",
        "[1, 2, 4]",
        "[1, 2.5]",
        "s.yaml:8:32: spec.matrix.speculative.num_steps[1]: does not fit `speculative.num_steps`: expected an integer, got the floating-point number 2.5",
    ),
    (
        "matrix null value",
        "[1, 2, 4]",
        "[1, null]",
        "s.yaml:8:32: spec.matrix.speculative.num_steps[1]: a matrix value is a number, a string, a boolean or a list, got null (or a non-finite number)",
    ),
    (
        "matrix repeated value",
        "[1, 2, 4]",
        "[1, 2, 1]",
        "s.yaml:8:35: spec.matrix.speculative.num_steps[2]: repeats the value 1 of item 0",
    ),
    (
        "matrix over the unit",
        "speculative.num_steps: [1, 2, 4]",
        "unit: [a.service, b.service]",
        "s.yaml:8:5: spec.matrix.unit: the unit may not be swept: every point is the same unit as the base spec",
    ),
    (
        "matrix over the engine",
        "speculative.num_steps: [1, 2, 4]",
        "engine: [sglang, vllm]",
        "s.yaml:8:5: spec.matrix.engine: the engine may not be swept: points of different engines are different services",
    ),
    (
        "matrix too large",
        "speculative.num_steps: [1, 2, 4]",
        "server.port: [1,2,3,4,5,6,7,8,9,10,11]\n    server.tp_size: [1,2,3,4,5,6,7,8,9,10]\n    server.context_length: [1,2,3,4,5,6,7,8,9,10]",
        "s.yaml:8:5: spec.matrix: gives 1100 points; a sweep may have at most 1024 (each point restarts the server)",
    ),
    ("concurrency 0", "[1, 16]", "[0, 16]", "s.yaml:10:19: spec.load.concurrency[0]: must be at least 1"),
    ("concurrency repeated", "[1, 16]", "[1, 1]", "s.yaml:10:22: spec.load.concurrency[1]: repeats the level 1"),
    (
        "concurrency not a number",
        "[1, 16]",
        "[1, many]",
        "s.yaml:10:22: spec.load.concurrency[1]: expected an integer, got a string: \"many\"",
    ),
    (
        "no concurrency",
        "    concurrency: [1, 16]\n",
        "",
        "s.yaml:9:3: spec.load.concurrency: is required: the concurrency levels to measure, e.g. `[1, 16]`",
    ),
    (
        "requests and duration",
        "requests: 64",
        "requests: 64\n    duration: 60s",
        "s.yaml:12:15: spec.load.duration: may not be given with `requests`: measure each level by a number of requests or by a duration",
    ),
    (
        "neither requests nor duration",
        "    requests: 64\n",
        "",
        "s.yaml:9:3: spec.load.requests: is required (or `duration`): how much to measure at each level, e.g. `requests: 64` or `duration: 60s`",
    ),
    ("zero requests", "requests: 64", "requests: 0", "s.yaml:11:15: spec.load.requests: must be at least 1"),
    (
        "duration without a unit",
        "requests: 64",
        "duration: 60",
        "s.yaml:11:15: spec.load.duration: expected a duration in whole seconds, minutes or hours (`60s`, `5m`, `1h`), got the number 60 (add a unit: `60s`)",
    ),
    (
        "duration in days",
        "requests: 64",
        "duration: 2d",
        "s.yaml:11:15: spec.load.duration: expected a duration in whole seconds, minutes or hours (`60s`, `5m`, `1h`), got \"2d\"",
    ),
    ("zero duration", "requests: 64", "duration: 0s", "s.yaml:11:15: spec.load.duration: must be at least 1s"),
    (
        "zero max_tokens",
        "requests: 64",
        "requests: 64\n    max_tokens: 0",
        "s.yaml:12:17: spec.load.max_tokens: must be at least 1",
    ),
    (
        "unknown api",
        "requests: 64",
        "requests: 64\n    api: grpc",
        "s.yaml:12:10: spec.load.api: unknown variant `grpc`, expected one of auto, generate, completions",
    ),
    (
        "objective at a level not measured",
        "at_concurrency: 16",
        "at_concurrency: 8",
        "s.yaml:13:21: spec.objective.at_concurrency: is 8, which is not one of the load's concurrency levels [1, 16]",
    ),
    (
        "objective level missing",
        "  objective:\n    at_concurrency: 16\n",
        "",
        "s.yaml:5:1: spec.objective.at_concurrency: is required with several concurrency levels: one of [1, 16]",
    ),
    (
        "unknown metric",
        "at_concurrency: 16",
        "at_concurrency: 16\n    maximize: speed",
        "s.yaml:14:15: spec.objective.maximize: unknown variant `speed`, expected one of throughput, tokens_per_s_per_request, accept_length",
    ),
    (
        "negative constraint",
        "at_concurrency: 16",
        "at_concurrency: 16\n    constraints: {ttft_p99_ms: -5}",
        "s.yaml:14:32: spec.objective.constraints.ttft_p99_ms: must be a number of milliseconds above 0, got -5",
    ),
    (
        "unknown constraint",
        "at_concurrency: 16",
        "at_concurrency: 16\n    constraints: {ttft_p95_ms: 5}",
        "s.yaml:14:19: spec.objective.constraints.ttft_p95_ms: unknown field `ttft_p95_ms`, expected one of ttft_p50_ms, ttft_p99_ms, itl_p50_ms, itl_p99_ms",
    ),
    (
        "unknown after",
        "  objective:",
        "  after: worst\n  objective:",
        "s.yaml:12:10: spec.after: unknown variant `worst`, expected one of restore, best",
    ),
    (
        "bad host",
        "  base: qwen.yaml\n",
        "  base: qwen.yaml\n  host: \"gpu 1\"\n",
        "s.yaml:7:9: spec.host: \"gpu 1\" is not a hostname (at most 253 letters, digits, `-`, `_` or `.`)",
    ),
];

#[test]
fn bad_sweeps_get_located_errors() {
    assert!(sweep::parse_sweep(GOOD, "s.yaml").is_ok(), "{:?}", sweep::parse_sweep(GOOD, "s.yaml").err());
    let mut failures = Vec::new();
    for (case, old, new, want) in BAD {
        assert!(GOOD.contains(old), "{case}: {old:?} is not in GOOD");
        let text = GOOD.replacen(old, new, 1);
        let got = match sweep::parse_sweep(&text, "s.yaml") {
            Ok(_) => "accepted".to_string(),
            Err(d) => {
                d.0.first().map(|d| d.to_string().lines().next().unwrap_or_default().to_string()).unwrap_or_default()
            }
        };
        if got != *want {
            failures.push(format!("{case}:\n   got: {got}\n  want: {want}"));
        }
        // The same through `check` (what `specd validate` prints).
        assert!(sweep::check(&text, "s.yaml").has_errors(), "{case}");
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn every_problem_of_a_sweep_is_reported_at_once() {
    let text = GOOD
        .replace("[1, 2, 4]", "[1, x]")
        .replace("[1, 16]", "[0, 16]")
        .replace("at_concurrency: 16", "at_concurrency: 8");
    let d = sweep::parse_sweep(&text, "s.yaml").unwrap_err();
    let paths: Vec<&str> = d.0.iter().map(|d| d.path.as_str()).collect();
    assert_eq!(
        paths,
        ["spec.matrix.speculative.num_steps[1]", "spec.load.concurrency[0]", "spec.objective.at_concurrency"],
        "{d}"
    );
}

#[test]
fn a_parsed_sweep_has_its_defaults_and_accessors() {
    let s = sweep::parse_sweep(GOOD, "dir/s.yaml").unwrap();
    let l = &s.sweep.spec.load;
    assert_eq!(l.amount(), Amount::Requests(64));
    assert_eq!((l.warmup, l.max_tokens, &l.prompts, l.api), (0, 256, &Prompts::Builtin, Api::Auto));
    assert_eq!(s.sweep.spec.objective.maximize, Metric::Throughput);
    assert_eq!(s.sweep.spec.after, After::Restore);
    assert_eq!(s.objective_concurrency(), 16);
    assert_eq!(s.base_path(Path::new("dir/s.yaml")), Path::new("dir/qwen.yaml"));
    assert_eq!(s.prompts_path(Path::new("dir/s.yaml")), None);
    assert_eq!(Api::Auto.for_engine(specd_spec::Engine::Sglang), Api::Generate);
    assert_eq!(Api::Auto.for_engine(specd_spec::Engine::LlamaCpp), Api::Completions);
    assert_eq!(Api::Completions.for_engine(specd_spec::Engine::Sglang), Api::Completions);

    let text = GOOD
        .replace("requests: 64", "duration: 2m\n    prompts: prompts.jsonl\n    api: completions")
        .replace("[1, 16]", "[4]")
        .replace("  objective:\n    at_concurrency: 16\n", "  after: best\n");
    let s = sweep::parse_sweep(&text, "/srv/s.yaml").unwrap();
    assert_eq!(s.sweep.spec.load.amount(), Amount::Duration(Duration::from_secs(120)));
    assert_eq!(s.sweep.spec.after, After::Best);
    assert_eq!(s.objective_concurrency(), 4, "the only level");
    assert_eq!(s.prompts_path(Path::new("/srv/s.yaml")), Some(PathBuf::from("/srv/prompts.jsonl")));
    assert_eq!(s.sweep.spec.load.api, Api::Completions);
}

#[test]
fn a_sweep_is_told_from_a_spec_by_its_kind() {
    assert!(sweep::is_sweep(GOOD));
    let spec = std::fs::read_to_string(root().join("examples/qwen35-122b-mtp.yaml")).unwrap();
    assert!(!sweep::is_sweep(&spec));
    assert!(!sweep::is_sweep("a: [unclosed"));
    assert!(!sweep::is_sweep(""));
}

// --- expansion ---------------------------------------------------------------------------------

const BASE: &str = "apiVersion: specd/v1
kind: InferenceService
metadata: {name: qwen}
spec:
  unit: sglang-qwen.service
  engine: sglang
  model: /models/qwen
  server: {max_running_requests: 16}
  speculative: {algorithm: NEXTN, num_steps: 3, eagle_topk: 1, num_draft_tokens: 4}
hosts:
  gpu-02:
    speculative: {num_steps: 5, num_draft_tokens: 6}
";

fn sweep_of(matrix: &str) -> String {
    GOOD.replace("    speculative.num_steps: [1, 2, 4]\n", matrix)
}

fn points(sweep_text: &str, base: &str) -> Result<Vec<sweep::Point>, specd_spec::Diagnostics> {
    let s = sweep::parse_sweep(sweep_text, "s.yaml").unwrap();
    let b = specd_spec::parse("qwen.yaml", base).unwrap();
    sweep::points(&s, &b)
}

fn draft_tokens(p: &sweep::Point) -> Option<u32> {
    p.spec.speculative.as_ref().unwrap().num_draft_tokens
}

#[test]
fn points_are_the_cartesian_product_in_the_order_written() {
    let text = sweep_of("    speculative.num_steps: [2, 1]\n    server.max_running_requests: [8, 16, 32]\n");
    let ps = points(&text, BASE).unwrap();
    let labels: Vec<&str> = ps.iter().map(|p| p.label.as_str()).collect();
    assert_eq!(
        labels,
        [
            "num_steps=2,max_running_requests=8",
            "num_steps=2,max_running_requests=16",
            "num_steps=2,max_running_requests=32",
            "num_steps=1,max_running_requests=8",
            "num_steps=1,max_running_requests=16",
            "num_steps=1,max_running_requests=32",
        ]
    );
    assert_eq!(ps.iter().map(|p| p.index).collect::<Vec<_>>(), [0, 1, 2, 3, 4, 5]);
    assert_eq!(
        ps[4].values,
        [("speculative.num_steps".to_string(), json!(1)), ("server.max_running_requests".to_string(), json!(16))]
    );
    for p in &ps {
        assert_eq!(p.unit.unit, "sglang-qwen.service");
        assert_eq!(p.unit, specd_spec::render(&p.spec), "the point's unit is its spec's render");
    }
    let mut hashes: Vec<&str> = ps.iter().map(|p| p.unit.sha256.as_str()).collect();
    hashes.sort();
    hashes.dedup();
    assert_eq!(hashes.len(), 6, "every point is a different unit");
    assert!(ps[3].unit.text.contains("--max-running-requests 8 "), "{}", ps[3].unit.text);
}

#[test]
fn sglang_draft_tokens_follow_the_steps_when_topk_is_1() {
    let ps = points(&sweep_of("    speculative.num_steps: [1, 3, 10]\n"), BASE).unwrap();
    assert_eq!(ps.iter().map(draft_tokens).collect::<Vec<_>>(), [Some(2), Some(4), Some(11)]);
    assert_eq!(ps[0].derived, [("speculative.num_draft_tokens".to_string(), json!(2))]);
    assert!(ps[1].derived.is_empty(), "the base already has 4 for 3 steps");
    assert!(
        ps[2]
            .unit
            .text
            .contains("--speculative-num-steps 10 --speculative-eagle-topk 1 --speculative-num-draft-tokens 11"),
        "{}",
        ps[2].unit.text
    );
    // Each point's spec is what the engine will report: the proof of the args holds.
    let want = ps[0].spec.expected_server_args();
    assert!(want.iter().any(|a| a.key == "/speculative_num_draft_tokens" && a.value == json!(2)), "{want:?}");
}

#[test]
fn with_a_wider_tree_the_draft_tokens_are_the_users() {
    let base = BASE.replace("eagle_topk: 1, num_draft_tokens: 4", "eagle_topk: 4, num_draft_tokens: 16");
    let ps = points(&sweep_of("    speculative.num_steps: [2, 6]\n"), &base).unwrap();
    assert_eq!(ps.iter().map(draft_tokens).collect::<Vec<_>>(), [Some(16), Some(16)]);
    assert!(ps.iter().all(|p| p.derived.is_empty()));
    // Sweeping the topk down to 1 derives them for that point only.
    let ps = points(&sweep_of("    speculative.eagle_topk: [4, 1]\n"), &base).unwrap();
    assert_eq!(ps.iter().map(draft_tokens).collect::<Vec<_>>(), [Some(16), Some(4)]);
}

#[test]
fn an_invalid_point_is_located_at_the_matrix_value_that_made_it() {
    // Draft tokens swept by hand with topk 1: SGLang would reset all but 4.
    let text = sweep_of("    speculative.num_draft_tokens: [4, 7]\n");
    let d = points(&text, BASE).unwrap_err();
    assert_eq!(
        d.to_string().lines().next().unwrap(),
        "s.yaml:8:39: spec.matrix.speculative.num_draft_tokens[1]: point num_draft_tokens=7: speculative.num_draft_tokens: num_draft_tokens must be num_steps + 1 = 4 when eagle_topk is 1, got 7; SGLang would silently reset it to 4, which would later look like drift",
        "{d}"
    );
    assert_eq!(d.0.len(), 1, "{d}");
    // A value only the spec's rules refuse (steps 0), on the second axis: located there.
    let text = sweep_of("    server.max_running_requests: [8]\n    speculative.num_steps: [2, 0]\n");
    let d = points(&text, BASE).unwrap_err();
    assert_eq!(
        d.to_string().lines().next().unwrap(),
        "s.yaml:9:32: spec.matrix.speculative.num_steps[1]: point max_running_requests=8,num_steps=0: speculative.num_steps: must be at least 1",
        "{d}"
    );
    // A rule between a swept field and one the base sets (llama.cpp: draft min <= draft max).
    let llama = "apiVersion: specd/v1\nkind: InferenceService\nmetadata: {name: l}\nspec:\n  unit: l.service\n  engine: llama-cpp\n  model: /m.gguf\n  speculative: {draft_model: /d.gguf, num_steps: 16, draft_min: 6}\n";
    let d = points(&sweep_of("    speculative.num_steps: [8, 4]\n"), llama).unwrap_err();
    assert_eq!(
        d.to_string().lines().next().unwrap(),
        "s.yaml:8:32: spec.matrix.speculative.num_steps[1]: point num_steps=4: speculative.draft_min: must be at most num_steps (4), got 6",
        "{d}"
    );
}

#[test]
fn points_that_render_the_same_unit_are_refused() {
    let d = points(&sweep_of("    readiness.timeout_sec: [60, 120]\n"), BASE).unwrap_err();
    assert!(
        d.to_string().starts_with("s.yaml:8:33: spec.matrix.readiness.timeout_sec[1]: point timeout_sec=120: renders the same unit as point timeout_sec=60"),
        "{d}"
    );
}

#[test]
fn a_bad_base_spec_is_reported_in_the_base_file() {
    let base = BASE.replace("model: /models/qwen", "model: models/qwen");
    let d = points(&sweep_of("    speculative.num_steps: [1]\n"), &base).unwrap_err();
    assert!(d.to_string().starts_with("qwen.yaml:7:10: spec.model: must be an absolute path"), "{d}");
}

#[test]
fn the_host_overlay_applies_and_the_matrix_wins_over_it() {
    let text =
        GOOD.replace("  base: qwen.yaml\n", "  base: qwen.yaml\n  host: gpu-02\n").replace("[1, 2, 4]", "[2, 7]");
    let ps = points(&text, BASE).unwrap();
    assert_eq!(ps.len(), 2);
    for p in &ps {
        assert_eq!(p.spec.overlay.as_deref(), Some("gpu-02"));
        assert!(p.unit.text.contains("# specd: host overlay gpu-02\n"));
    }
    let steps: Vec<_> = ps.iter().map(|p| p.spec.speculative.as_ref().unwrap().num_steps).collect();
    assert_eq!(steps, [Some(2), Some(7)], "the matrix, not the overlay's 5");
    assert_eq!(ps.iter().map(draft_tokens).collect::<Vec<_>>(), [Some(3), Some(8)]);
    // A host without an overlay gets the base spec, as `specd apply --host` would.
    let text = GOOD.replace("  base: qwen.yaml\n", "  base: qwen.yaml\n  host: gpu-09\n");
    let ps = points(&text, BASE).unwrap();
    assert_eq!(ps[0].spec.overlay, None);
}

#[test]
fn other_engines_sweep_their_own_fields_without_derivation() {
    let vllm = "apiVersion: specd/v1\nkind: InferenceService\nmetadata: {name: v}\nspec:\n  unit: v.service\n  engine: vllm\n  model: /m\n  speculative: {algorithm: ngram, num_steps: 3, prompt_lookup_max: 4}\n";
    let ps = points(&sweep_of("    speculative.num_steps: [1, 5]\n"), vllm).unwrap();
    assert!(ps[1].unit.text.contains(r#"\"num_speculative_tokens\":5"#), "{}", ps[1].unit.text);
    assert!(ps.iter().all(|p| p.derived.is_empty()));
    let llama = "apiVersion: specd/v1\nkind: InferenceService\nmetadata: {name: l}\nspec:\n  unit: l.service\n  engine: llama-cpp\n  model: /m.gguf\n  speculative: {draft_model: /d.gguf, num_steps: 16}\n";
    let ps = points(&sweep_of("    speculative.num_steps: [4, 8, 16]\n"), llama).unwrap();
    assert!(ps[0].unit.text.contains("--spec-draft-n-max 4"), "{}", ps[0].unit.text);
}

// --- the example and the schema ----------------------------------------------------------------

#[test]
fn the_example_sweep_expands_to_the_seed_campaign() {
    let path = root().join("examples/sweep-qwen-mtp-steps.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let s = sweep::parse_sweep(&text, &path.display().to_string()).unwrap();
    let base_path = s.base_path(&path);
    let base =
        specd_spec::parse(&base_path.display().to_string(), &std::fs::read_to_string(&base_path).unwrap()).unwrap();
    let ps = sweep::points(&s, &base).unwrap();
    let steps = [1, 2, 3, 4, 5, 6, 8, 10];
    assert_eq!(ps.len(), steps.len());
    for (p, n) in ps.iter().zip(steps) {
        assert_eq!(p.label, format!("num_steps={n}"));
        assert_eq!(p.unit.unit, "sglang-qwen.service");
        assert_eq!(draft_tokens(p), Some(n + 1));
    }
    // The last point is the base spec itself: its unit is the one `specd apply` deploys.
    let deployed = specd_spec::render(&base.resolve(Some("gpu-01")).unwrap());
    assert_eq!(ps[7].unit, deployed);
    assert_eq!(s.objective_concurrency(), 16);
    assert_eq!(s.sweep.spec.objective.constraints.limits(), [("ttft_p99_ms", 2000.0)]);
}

#[test]
fn checked_in_sweep_schema_is_current() {
    let path = root().join("schemas/sweep.schema.json");
    let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        on_disk == sweep::json_schema(),
        "schemas/sweep.schema.json is stale: regenerate it with `cargo run -p specd -- schema --kind sweep > schemas/sweep.schema.json`"
    );
    let schema: serde_json::Value = serde_json::from_str(&on_disk).unwrap();
    assert_eq!(schema["properties"]["kind"]["const"], "Sweep");
    assert_eq!(schema["required"], json!(["apiVersion", "kind", "metadata", "spec"]));
    assert_eq!(schema["$defs"]["SweepSpec"]["required"], json!(["base", "matrix", "load"]));
}

// --- no input panics ---------------------------------------------------------------------------

use proptest::prelude::*;

/// Paths a matrix may name, real and not.
const FIELDS: &[&str] = &[
    "speculative.num_steps",
    "speculative.eagle_topk",
    "speculative.num_draft_tokens",
    "speculative.algorithm",
    "speculative",
    "server.port",
    "server.port.x",
    "server.extra_args",
    "server.mem_fraction_static",
    "service.environment.A",
    "service.environment",
    "readiness.timeout_sec",
    "unit",
    "model",
    "hosts.x",
    "spec.model",
    "a..b",
    "",
];

/// Scalars of every kind, as written in YAML.
const VALUES: &[&str] = &[
    "0",
    "1",
    "4",
    "-1",
    "4294967296",
    "1e400",
    ".nan",
    "2.5",
    "\"4\"",
    "abc",
    "null",
    "~",
    "true",
    "[]",
    "[1, 2]",
    "{}",
    "{a: 1}",
    "\"a\\nb\"",
    "NEXTN",
    "60s",
    "0s",
    "9999999h",
    "builtin",
];

fn junk_sweep() -> impl Strategy<Value = String> {
    let v = || proptest::sample::select(VALUES).prop_map(str::to_string);
    let axis = (proptest::sample::select(FIELDS), proptest::collection::vec(v(), 0..4))
        .prop_map(|(f, vs)| format!("    \"{f}\": [{}]\n", vs.join(", ")));
    (proptest::collection::vec(axis, 0..3), v(), v(), v(), v(), v(), v()).prop_map(
        |(axes, c, r, d, w, at, host)| {
            format!(
                "apiVersion: specd/v1\nkind: Sweep\nmetadata: {{name: s}}\nspec:\n  base: b.yaml\n  host: {host}\n  matrix:\n{}  load:\n    concurrency: [{c}]\n    requests: {r}\n    duration: {d}\n    warmup: {w}\n  objective: {{at_concurrency: {at}}}\n",
                axes.concat()
            )
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]
    #[test]
    fn no_sweep_input_panics_and_every_error_is_located(text in junk_sweep()) {
        match sweep::parse_sweep(&text, "s.yaml") {
            Err(d) => prop_assert!(d.0.iter().all(|d| d.line > 0), "{d}"),
            Ok(s) => {
                let b = specd_spec::parse("qwen.yaml", BASE).unwrap();
                if let Err(d) = sweep::points(&s, &b) {
                    prop_assert!(d.0.iter().all(|d| d.line > 0 && d.file == "s.yaml"), "{d}");
                }
            }
        }
    }

    #[test]
    fn no_text_panics(text in ".{0,200}") {
        let _ = sweep::parse_sweep(&text, "s.yaml");
        let _ = sweep::is_sweep(&text);
    }
}
