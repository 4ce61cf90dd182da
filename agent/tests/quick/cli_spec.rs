//! The spec commands as a user runs them: validate, render, schema.

use std::path::{Path, PathBuf};
use std::process::Command;

use assert_cmd::prelude::*;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn specd() -> Command {
    let mut c = Command::cargo_bin("specd").unwrap();
    c.current_dir(root());
    c
}

#[test]
fn validate_accepts_the_examples() {
    let out = specd().args(["validate", "examples"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(stdout.contains("examples/qwen35-122b-mtp.yaml: ok"), "{stdout}");
}

#[test]
fn validate_reports_every_error_of_every_file_and_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.yaml");
    let b = dir.path().join("b.yaml");
    std::fs::write(
        &a,
        "apiVersion: specd/v1\nkind: InferenceService\nmetadata: {name: a}\nspec:\n  unit: a.service\n  engine: sglang\n  model: rel\n  server: {port: 0}\n",
    )
    .unwrap();
    std::fs::write(
        &b,
        "apiVersion: specd/v1\nkind: InferenceService\nmetadata: {name: b}\nspec:\n  unit: ../b.service\n",
    )
    .unwrap();
    let out = specd().arg("validate").arg(&a).arg(&b).arg("examples/vllm-llama-eagle3.yaml").output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8(out.stderr).unwrap();
    for want in [
        format!("{}:7:10: spec.model: must be an absolute path", a.display()),
        format!("{}:8:18: spec.server.port: must be in 1..=65535", a.display()),
        format!("{}:5:9: spec.unit: \"../b.service\" is not a valid service name", b.display()),
        format!("{}:4:1: spec.engine: is required", b.display()),
        "2 of 3 file(s) invalid".to_string(),
    ] {
        assert!(err.contains(&want), "missing {want:?} in:\n{err}");
    }
    assert!(String::from_utf8(out.stdout).unwrap().contains("vllm-llama-eagle3.yaml: ok"));
}

#[test]
fn validate_names_a_missing_file() {
    let out = specd().args(["validate", "nope.yaml"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("nope.yaml: cannot read"));
}

#[test]
fn render_prints_the_unit_and_its_hash() {
    let out = specd().args(["render", "examples/qwen35-122b-mtp.yaml", "--host", "gpu-02"]).output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.starts_with(specd_spec::HEADER));
    assert!(text.contains("--speculative-num-steps 5 "), "{text}");
    let hash =
        specd().args(["render", "examples/qwen35-122b-mtp.yaml", "--host", "gpu-02", "--hash"]).output().unwrap();
    assert_eq!(String::from_utf8(hash.stdout).unwrap().trim(), specd_spec::sha256_hex(text.as_bytes()));
}

#[test]
fn schema_command_prints_the_checked_in_schema() {
    let out = specd().arg("schema").output().unwrap();
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        std::fs::read_to_string(root().join("schemas/specd.schema.json")).unwrap()
    );
}

/// systemd itself accepts every example's unit (with the engine binary replaced by one that
/// exists here, since `verify` checks that the program is executable).
#[test]
fn rendered_units_pass_systemd_analyze_verify() {
    if Command::new("systemd-analyze").arg("--version").output().is_err() {
        panic!("systemd-analyze is not installed: apt-get install systemd");
    }
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(root().join("examples")).unwrap() {
        let p = entry.unwrap().path();
        if p.extension().is_none_or(|x| x != "yaml") {
            continue;
        }
        // A sweep document (`kind: Sweep`) and the fleet file render no unit themselves.
        if p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("sweep-") || n == "fleet.yaml") {
            continue;
        }
        let mut parsed = specd_spec::parse("x.yaml", &std::fs::read_to_string(&p).unwrap()).unwrap();
        parsed.document.spec.command = Some(vec!["/bin/true".into()]);
        let spec = parsed.resolve(None).unwrap();
        let unit = specd_spec::render(&spec);
        let path = dir.path().join(&spec.unit);
        std::fs::write(&path, &unit.text).unwrap();
        let out = Command::new("systemd-analyze").arg("verify").arg(&path).output().unwrap();
        assert!(
            out.status.success() && out.stderr.is_empty(),
            "{}: {}{}",
            p.display(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn schema_kind_sweep_prints_the_checked_in_sweep_schema() {
    let out = specd().args(["schema", "--kind", "sweep"]).output().unwrap();
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        std::fs::read_to_string(root().join("schemas/sweep.schema.json")).unwrap()
    );
}

/// `specd validate` tells a sweep from a spec by its kind, and checks the sweep's base spec and
/// every point of it.
#[test]
fn validate_checks_a_sweep_and_every_point_of_it() {
    let out = specd().args(["validate", "examples/sweep-qwen-mtp-steps.yaml"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(root().join("examples/qwen35-122b-mtp.yaml"), dir.path().join("qwen35-122b-mtp.yaml")).unwrap();
    let text = std::fs::read_to_string(root().join("examples/sweep-qwen-mtp-steps.yaml"))
        .unwrap()
        .replace("speculative.num_steps: [1, 2, 3, 4, 5, 6, 8, 10]", "speculative.num_draft_tokens: [11, 12]");
    let sweep = dir.path().join("sweep.yaml");
    std::fs::write(&sweep, text).unwrap();
    let out = specd().arg("validate").arg(&sweep).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!(
            "{}:14:40: spec.matrix.speculative.num_draft_tokens[1]: point num_draft_tokens=12: speculative.num_draft_tokens: num_draft_tokens must be num_steps + 1 = 11",
            sweep.display()
        )),
        "{stderr}"
    );
}

/// Every file and directory under `dir`, relative to it.
fn tree(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        out.push(p.strip_prefix(dir).unwrap().to_path_buf());
        if p.is_dir() {
            out.extend(tree(&p).into_iter().map(|q| p.strip_prefix(dir).unwrap().join(q)));
        }
    }
    out
}

/// A UNIT argument is held to the rules of a spec's unit name before any path is built from it:
/// `../` cannot reach out of the state directory, and a bad name is a usage error (exit 2, as
/// clap's own) that reads, creates and asks nothing.
#[test]
fn a_unit_argument_that_is_not_a_service_name_is_a_usage_error_and_creates_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("a/b/state");
    let units = dir.path().join("a/b/units");
    let socket = dir.path().join("control.sock");
    let socket = socket.to_str().unwrap();
    for unit in ["../../escape.service", "../../../../escape.service", "a/b.service", "x.socket", "..service", ""] {
        for args in [
            vec!["unquarantine", unit, "--socket", socket],
            vec!["suspend", unit, "--socket", socket],
            vec!["resume", unit, "--socket", socket],
            vec!["rollback", unit, "--socket", socket],
            vec!["reconcile", unit, "--socket", socket],
            vec!["history", unit],
            vec!["diagnose", unit],
        ] {
            let out =
                specd().args(&args).env("SPECD_STATE_DIR", &state).env("SPECD_UNIT_DIR", &units).output().unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
            assert!(err.contains(&format!("{unit:?} is not a valid service name")), "{args:?}: {err}");
            assert!(out.stdout.is_empty(), "{args:?}: {}", String::from_utf8_lossy(&out.stdout));
        }
    }
    assert_eq!(tree(dir.path()), Vec::<PathBuf>::new());
}

/// A directory of specs is read as the agent reads the repository: a link in it (out of it, into
/// it, or dangling) is refused as a link, with its target, and the other files are still checked.
/// A file named on the command line is read wherever it points.
#[test]
fn validate_refuses_a_link_in_a_directory_of_specs_naming_it_and_its_target() {
    let dir = tempfile::tempdir().unwrap();
    let specs = dir.path().join("specs");
    std::fs::create_dir(&specs).unwrap();
    std::fs::copy(root().join("examples/qwen35-122b-mtp.yaml"), specs.join("qwen.yaml")).unwrap();
    let outside = root().join("examples/vllm-llama-eagle3.yaml");
    std::os::unix::fs::symlink(&outside, specs.join("out.yaml")).unwrap();
    std::os::unix::fs::symlink("../nowhere/x.yaml", specs.join("dangling.yml")).unwrap();
    let out = specd().arg("validate").arg(&specs).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8(out.stderr).unwrap();
    for want in [
        format!(
            "{}: is a symbolic link (to {}); specd reads only regular files from the repository: put the spec itself here, not a link to it",
            specs.join("out.yaml").display(),
            outside.display()
        ),
        format!("{}: is a symbolic link (to ../nowhere/x.yaml);", specs.join("dangling.yml").display()),
        "2 of 3 file(s) invalid".to_string(),
    ] {
        assert!(err.contains(&want), "missing {want:?} in:\n{err}");
    }
    assert!(String::from_utf8(out.stdout).unwrap().contains("qwen.yaml: ok"));
    let out = specd().arg("validate").arg(specs.join("out.yaml")).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// `validate --on-host` looks at this host as an apply does before it stops anything: a spec
/// whose program or draft model is not here is named with its reason (exit 1); one whose every
/// path is here passes.
#[test]
fn validate_on_host_says_what_this_host_lacks() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    std::fs::create_dir(&model).unwrap();
    std::fs::write(model.join("config.json"), "{}").unwrap();
    let spec = |command: &str, draft: &str| {
        format!(
            "apiVersion: specd/v1\nkind: InferenceService\nmetadata: {{name: a}}\nspec:\n  unit: a.service\n  engine: vllm\n  command: [{command}, serve]\n  model: {}\n  server: {{host: 127.0.0.1, port: 1}}\n  speculative: {{algorithm: draft_model, draft_model: {draft}, num_steps: 3}}\n",
            model.display()
        )
    };
    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, spec("/opt/nowhere/vllm", "/opt/nowhere/draft")).unwrap();
    let out = specd().args(["validate", "--on-host"]).arg(&bad).output().unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(said.contains("the program /opt/nowhere/vllm does not exist"), "{said}");
    assert!(said.contains("the draft model /opt/nowhere/draft does not exist"), "{said}");
    let good = dir.path().join("good.yaml");
    std::fs::write(&good, spec("/bin/true", &model.display().to_string())).unwrap();
    let out = specd().args(["validate", "--on-host"]).arg(&good).output().unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{said}{}", String::from_utf8_lossy(&out.stderr));
    assert!(said.contains("a.service could start on this host"), "{said}");
}

/// stdout of a `--json` command: exactly one JSON document.
fn json_doc(out: &std::process::Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|err| {
        panic!(
            "stdout is not one JSON document ({err}):\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// The `--json` documents of bad input, which change nothing and touch no host: each says why,
/// with `ok` false, and the exit code is the table's (1 refused, 2 cannot tell).
#[test]
fn json_of_bad_input_says_why_and_exits_as_the_table_says() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, "apiVersion: specd/v1\nkind: InferenceService\nmetadata: {name: a}\nspec:\n  unit: a.service\n  engine: sglang\n  model: rel\n").unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir(&state).unwrap();
    let units = dir.path().join("units");
    let common = |c: &mut Command| {
        c.arg("--state-dir").arg(&state).arg("--unit-dir").arg(&units);
    };

    // apply: refused, exit 1, the spec's diagnostics as `validate --json` gives them.
    let mut c = specd();
    c.args(["apply", "--json", "--config", "/nonexistent/agent.yaml", "-f"]).arg(&bad);
    common(&mut c);
    let out = c.output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let j = json_doc(&out);
    assert_eq!((j["ok"].as_bool(), j["dry_run"].as_bool()), (Some(false), Some(false)), "{j:#}");
    assert!(j["error"].as_str().unwrap().contains("nothing was changed on this host"), "{j:#}");
    assert_eq!(j["units"], serde_json::json!([]));
    let d = &j["diagnostics"][0];
    assert_eq!((d["line"].as_u64(), d["field"].as_str()), (Some(7), Some("spec.model")), "{j:#}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("spec.model: must be an absolute path"));

    // diff: cannot tell, exit 2.
    let mut c = specd();
    c.args(["diff", "--json", "-f"]).arg(&bad);
    common(&mut c);
    let out = c.output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let j = json_doc(&out);
    assert_eq!(j["ok"], false);
    assert!(j["error"].as_str().unwrap().contains("not a valid spec"), "{j:#}");
    assert!(j["unit_file"].is_null() && j["diagnostics"][0]["field"] == "spec.model", "{j:#}");

    // rollback of a unit specd has no state for: refused, exit 1.
    let mut c = specd();
    c.args(["rollback", "a.service", "--json", "--config", "/nonexistent/agent.yaml", "--socket"])
        .arg(dir.path().join("no.sock"));
    common(&mut c);
    let out = c.output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let j = json_doc(&out);
    assert_eq!(
        (j["ok"].as_bool(), j["unit"].as_str(), j["pinned"].as_bool()),
        (Some(false), Some("a.service"), Some(false))
    );
    assert!(j["error"].as_str().unwrap().contains("no state for this unit"), "{j:#}");

    // sweep: a base spec that is not valid, exit 1, nothing written.
    let sweep = dir.path().join("sweep.yaml");
    std::fs::write(
        &sweep,
        "apiVersion: specd/v1\nkind: Sweep\nmetadata: {name: s}\nspec:\n  base: bad.yaml\n  matrix:\n    speculative.num_steps: [1, 2]\n  load: {concurrency: [1], requests: 2}\n  objective: {maximize: throughput}\n",
    )
    .unwrap();
    let out_dir = dir.path().join("out");
    let mut c = specd();
    c.args(["sweep", "--json", "-f"]).arg(&sweep).arg("--out").arg(&out_dir);
    common(&mut c);
    let out = c.output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let j = json_doc(&out);
    assert_eq!(j["ok"], false);
    assert!(j["error"].as_str().unwrap().contains("nothing was changed on this host"), "{j:#}");
    assert!(j["best"].is_null() && j["results"] == serde_json::json!([]), "{j:#}");
    assert!(!out_dir.exists());

    // A usage error: exit 2, before anything.
    let out = specd().args(["rollback", "../a.service", "--json"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(out.stdout.is_empty());
}

/// `specd --help` carries the exit codes table of the README.
#[test]
fn the_long_help_gives_the_exit_codes() {
    let out = specd().arg("--help").output().unwrap();
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    for code in ["0", "1", "2", "130"] {
        assert!(help.lines().any(|l| l.starts_with(&format!("  {code} "))), "{code} in:\n{help}");
        assert!(readme.contains(&format!("| `{code}` |")), "README's exit codes table has no row {code}");
    }
}

#[test]
fn the_version_names_the_commit_it_was_built_from() {
    // Two builds of one version are told apart by the commit: what an operator compares when
    // a fleet runs "specd 0.1.0" everywhere.
    let head = Command::new("git").args(["rev-parse", "--short=12", "HEAD"]).current_dir(root()).output().unwrap();
    let rev = if head.status.success() {
        String::from_utf8(head.stdout).unwrap().trim().to_string()
    } else {
        "unknown".into()
    };
    let out = specd().arg("--version").output().unwrap();
    assert!(out.status.success());
    let v = String::from_utf8(out.stdout).unwrap();
    assert_eq!(v.trim(), format!("specd {} (rev {rev})", env!("CARGO_PKG_VERSION")), "{v}");
}
