//! Table-driven: each bad spec gets a clear error naming the file, line, field path and problem.

const BASE: &str = "apiVersion: specd/v1
kind: InferenceService
metadata:
  name: t
spec:
  unit: t.service
  engine: sglang
  model: /m
";

/// (case, yaml appended to BASE (or a whole document when it starts with `apiVersion`),
///  expected line, expected field path, expected message fragment)
const CASES: &[(&str, &str, u64, &str, &str)] = &[
    ("yaml syntax", "  server: [\n", 9, "", "expected"),
    ("wrong type", "  server:\n    port: abc\n", 10, "spec.server.port", "expected a whole number"),
    ("unknown field", "  server:\n    portt: 5\n", 10, "spec.server.portt", "unknown field `portt`"),
    ("duplicate key", "  model: /n\n", 9, "spec.model", "duplicate key `model`"),
    (
        "unknown engine",
        "  speculative: {}\nhosts:\n  h1:\n    engine: tgi\n",
        12,
        "hosts.h1.engine",
        "unknown variant `tgi`",
    ),
    ("wrong apiVersion", "#\n", 1, "apiVersion", "must be `specd/v1`"),
    ("bad name", "#\n", 4, "metadata.name", "lowercase letters"),
    ("unit path traversal", "#\n", 6, "spec.unit", "no `/` and no `..`"),
    ("unit with slash", "#\n", 6, "spec.unit", "not a valid service name"),
    ("unit not a service", "#\n", 6, "spec.unit", "ending in `.service`"),
    ("relative model", "#\n", 8, "spec.model", "must be an absolute path"),
    ("newline in model", "#\n", 8, "spec.model", "control character '\\n'"),
    ("NUL in model", "#\n", 8, "spec.model", "control character '\\0'"),
    ("port too large", "  server: {port: 70000}\n", 9, "spec.server.port", "1..=65535"),
    ("port zero", "  server: {port: 0}\n", 9, "spec.server.port", "1..=65535"),
    ("mem fraction > 1", "  server: {mem_fraction_static: 1.5}\n", 9, "spec.server.mem_fraction_static", "(0, 1]"),
    (
        "sglang topk 1 draft tokens",
        "  server: {max_running_requests: 16}\n  speculative:\n    algorithm: NEXTN\n    num_steps: 10\n    eagle_topk: 1\n    num_draft_tokens: 7\n",
        14,
        "spec.speculative.num_draft_tokens",
        "num_draft_tokens must be num_steps + 1 = 11 when eagle_topk is 1, got 7; SGLang would silently reset it",
    ),
    (
        "sglang topk without steps",
        "  speculative:\n    algorithm: NEXTN\n    eagle_topk: 1\n",
        11,
        "spec.speculative.eagle_topk",
        "SGLang asserts",
    ),
    (
        "sglang lowercase algorithm",
        "  speculative: {algorithm: nextn}\n",
        9,
        "spec.speculative.algorithm",
        "did you mean NEXTN?",
    ),
    (
        "sglang ngram with topk",
        "  speculative: {algorithm: NGRAM, eagle_topk: 4}\n",
        9,
        "spec.speculative.eagle_topk",
        "NGRAM: SGLang overwrites it",
    ),
    (
        "sglang ngram with steps",
        "  speculative: {algorithm: NGRAM, num_steps: 4}\n",
        9,
        "spec.speculative.num_steps",
        "derives it",
    ),
    (
        "sglang eagle without draft model",
        "  speculative: {algorithm: EAGLE3, num_steps: 3, eagle_topk: 1, num_draft_tokens: 4}\n",
        9,
        "spec.speculative.draft_model",
        "is required by EAGLE3",
    ),
    (
        "sglang steps without algorithm",
        "  speculative:\n    num_steps: 3\n",
        10,
        "spec.speculative.num_steps",
        "no effect without",
    ),
    (
        "vllm without num tokens",
        "  speculative: {algorithm: ngram}\n",
        9,
        "spec.speculative.num_steps",
        "num_speculative_tokens must be provided",
    ),
    (
        "vllm unknown method",
        "  speculative: {algorithm: medusa, num_steps: 2}\n",
        9,
        "spec.speculative.algorithm",
        "not a vLLM speculative method",
    ),
    (
        "vllm topk",
        "  speculative: {algorithm: mtp, num_steps: 2, eagle_topk: 2}\n",
        9,
        "spec.speculative.eagle_topk",
        "not a vLLM option",
    ),
    (
        "vllm lookup min > max",
        "  speculative: {algorithm: ngram, num_steps: 2, prompt_lookup_min: 5, prompt_lookup_max: 3}\n",
        9,
        "spec.speculative.prompt_lookup_min",
        "at most prompt_lookup_max (3)",
    ),
    (
        "llama removed --draft-max",
        "  server:\n    extra_args: [--draft-max, \"8\"]\n",
        10,
        "spec.server.extra_args[0]",
        "was removed from llama-cpp",
    ),
    (
        "llama steps without draft",
        "  speculative: {num_steps: 8}\n",
        9,
        "spec.speculative.draft_model",
        "--spec-draft-model",
    ),
    (
        "llama algorithm",
        "  speculative: {algorithm: EAGLE, draft_model: /d}\n",
        9,
        "spec.speculative.algorithm",
        "\"EAGLE\" is not a llama-server --spec-type; use one of draft-simple, draft-eagle3",
    ),
    (
        "llama spec-type none",
        "  speculative: {algorithm: none, draft_model: /d}\n",
        9,
        "spec.speculative.algorithm",
        "to turn speculation off, remove the speculative section",
    ),
    (
        "llama draft type without draft model",
        "  speculative: {algorithm: draft-eagle3}\n",
        9,
        "spec.speculative.draft_model",
        "is required by --spec-type draft-eagle3",
    ),
    (
        "llama ngram type with a draft model",
        "  speculative: {algorithm: ngram-mod, draft_model: /d}\n",
        9,
        "spec.speculative.draft_model",
        "is not used by --spec-type ngram-mod",
    ),
    (
        "llama --spec-type in extra_args",
        "  server:\n    extra_args: [--spec-type, draft-simple]\n",
        10,
        "spec.server.extra_args[0]",
        "speculative.algorithm",
    ),
    (
        "extra_args repeats tp",
        "  server:\n    extra_args: [--enable-metrics, --tp-size, \"2\"]\n",
        10,
        "spec.server.extra_args[1]",
        "from `spec.server.tp_size`",
    ),
    (
        "extra_args abbreviates an owned flag",
        "  server:\n    extra_args: [--mem-fraction, \"0.5\"]\n",
        10,
        "spec.server.extra_args[0]",
        "abbreviates `--mem-fraction-static`",
    ),
    (
        "extra_args --config",
        "  server:\n    extra_args: [--config, /etc/x.yaml]\n",
        10,
        "spec.server.extra_args[0]",
        "`--config` would let a file override",
    ),
    (
        "backslash ends the description",
        "  service: {description: 'x\\'}\n",
        9,
        "spec.service.description",
        "may not contain a backslash",
    ),
    (
        "extra_args repeats port with =",
        "  server:\n    extra_args: [--port=9]\n",
        10,
        "spec.server.extra_args[0]",
        "`--port` is rendered by specd",
    ),
    (
        "newline in extra_args",
        "  server:\n    extra_args: [\"--x\\nExecStartPre=/bin/rm -rf /\"]\n",
        10,
        "spec.server.extra_args[0]",
        "control character",
    ),
    (
        "newline in env value",
        "  service:\n    environment: {A: \"x\\n[Service]\"}\n",
        10,
        "spec.service.environment.A",
        "inject a line",
    ),
    (
        "NUL in env value",
        "  service:\n    environment: {A: \"x\\0\"}\n",
        10,
        "spec.service.environment.A",
        "control character",
    ),
    (
        "bad env key",
        "  service:\n    environment: {A-B: x}\n",
        10,
        "spec.service.environment.A-B",
        "not a valid environment variable name",
    ),
    (
        "relative working dir",
        "  service: {working_directory: opt}\n",
        9,
        "spec.service.working_directory",
        "absolute path",
    ),
    ("bad user", "  service: {user: \"a b\"}\n", 9, "spec.service.user", "not a valid user name"),
    ("bad memory_max", "  service: {memory_max: lots}\n", 9, "spec.service.memory_max", "not a memory size"),
    ("zero stop timeout", "  service: {timeout_stop_sec: 0}\n", 9, "spec.service.timeout_stop_sec", "at least 1"),
    ("endpoint without slash", "  readiness: {endpoint: health}\n", 9, "spec.readiness.endpoint", "starting with `/`"),
    (
        "overlay changes unit",
        "hosts:\n  gpu-02:\n    unit: other.service\n",
        11,
        "hosts.gpu-02.unit",
        "may not change the unit",
    ),
    (
        "overlay breaks a rule",
        "  server: {max_running_requests: 16}\n  speculative: {algorithm: NEXTN, num_steps: 10, eagle_topk: 1, num_draft_tokens: 11}\nhosts:\n  gpu-02:\n    speculative: {num_steps: 5}\n",
        13,
        "hosts.gpu-02.speculative.num_steps",
        "num_draft_tokens must be num_steps + 1 = 6 when eagle_topk is 1, got 11; SGLang would silently reset it to 6, which would later look like drift",
    ),
    (
        "relative command",
        "  command: [bin/python3, -m, x]\n",
        9,
        "spec.command[0]",
        "absolute path or a bare program name",
    ),
    (
        "command with option prefix",
        "  command: [\"-/bin/true\"]\n",
        9,
        "spec.command[0]",
        "absolute path or a bare program name",
    ),
    ("n_gpu_layers on sglang", "  server: {n_gpu_layers: 10}\n", 9, "spec.server.n_gpu_layers", "llama-cpp option"),
    ("tp_size on llama", "  server: {tp_size: 2}\n", 9, "spec.server.tp_size", "not an option of llama-cpp"),
    ("missing engine", "#\n", 5, "spec.engine", "is required"),
];

fn doc_for(case: &str, extra: &str) -> String {
    let mut base = BASE.to_string();
    match case {
        "wrong apiVersion" => base = base.replace("specd/v1", "specd/v2"),
        "bad name" => base = base.replace("name: t", "name: Bad_Name"),
        "unit path traversal" => base = base.replace("unit: t.service", "unit: ../x.service"),
        "unit with slash" => base = base.replace("unit: t.service", "unit: a/b.service"),
        "unit not a service" => base = base.replace("unit: t.service", "unit: t.socket"),
        "relative model" => base = base.replace("model: /m", "model: models/m"),
        "newline in model" => base = base.replace("model: /m", "model: \"/m\\nExecStartPre=/bin/rm -rf /\""),
        "NUL in model" => base = base.replace("model: /m", "model: \"/m\\0\""),
        "missing engine" => base = base.replace("  engine: sglang\n", ""),
        c if c.starts_with("vllm") => base = base.replace("engine: sglang", "engine: vllm"),
        c if c.starts_with("llama") || c.ends_with("on llama") => {
            base = base.replace("engine: sglang", "engine: llama-cpp")
        }
        _ => {}
    }
    if extra != "#\n" {
        base.push_str(extra);
    }
    base
}

#[test]
fn each_bad_spec_gets_a_located_error() {
    assert!(CASES.len() >= 30);
    let mut failures = Vec::new();
    for (case, extra, line, path, fragment) in CASES {
        let text = doc_for(case, extra);
        let diags = specd_spec::check("specs/t.yaml", &text);
        let hit = diags
            .errors()
            .find(|d| d.line == *line && d.path == *path && d.message.contains(fragment) && d.file == "specs/t.yaml");
        match hit {
            Some(d) => {
                // The rendered form leads with file:line:col: path:
                let shown = d.to_string();
                let want = if path.is_empty() {
                    format!("specs/t.yaml:{line}:{}: ", d.column)
                } else {
                    format!("specs/t.yaml:{line}:{}: {path}: ", d.column)
                };
                if !shown.starts_with(&want) || d.column == 0 {
                    failures.push(format!("{case}: rendered as {shown:?}"));
                }
            }
            None => failures.push(format!(
                "{case}: wanted line {line} path {path:?} containing {fragment:?}, got:\n{diags}\n--- spec:\n{text}"
            )),
        }
    }
    assert!(failures.is_empty(), "{} case(s) failed:\n{}", failures.len(), failures.join("\n\n"));
}

#[test]
fn all_errors_of_a_file_are_reported_not_just_the_first() {
    let text = BASE.replace("model: /m", "model: m") + "  server: {port: 0}\n  service: {user: \"x y\"}\n";
    let diags = specd_spec::check("t.yaml", &text);
    let paths: Vec<&str> = diags.errors().map(|d| d.path.as_str()).collect();
    assert_eq!(paths, ["spec.model", "spec.server.port", "spec.service.user"], "{diags}");
}

#[test]
fn snippet_points_at_the_value() {
    let text = BASE.to_string() + "  server:\n    port: 70000\n";
    let d = specd_spec::check("t.yaml", &text);
    let shown = d.to_string();
    assert_eq!(
        shown,
        "t.yaml:10:11: spec.server.port: must be in 1..=65535, got 70000\n   |\n10 |     port: 70000\n   |           ^"
    );
}

#[test]
fn drain_budget_longer_than_stop_timeout_warns_but_validates() {
    let text = BASE.to_string() + "  service: {timeout_stop_sec: 10, drain_timeout_sec: 60}\n";
    let diags = specd_spec::check("t.yaml", &text);
    assert!(!diags.has_errors(), "{diags}");
    let w: Vec<_> = diags.warnings().collect();
    assert_eq!(w.len(), 1, "{diags}");
    assert_eq!(w[0].path, "spec.service.timeout_stop_sec");
    assert!(w[0].message.contains("SIGKILL"), "{}", w[0]);
    assert!(w[0].to_string().starts_with("t.yaml:9:31: warning: spec.service.timeout_stop_sec: "), "{}", w[0]);
}

#[test]
fn an_error_in_the_base_is_reported_once_not_per_host() {
    let text = BASE.replace("model: /m", "model: m") + "hosts:\n  a: {}\n  b: {}\n";
    let diags = specd_spec::check("t.yaml", &text);
    assert_eq!(diags.errors().count(), 1, "{diags}");
}
