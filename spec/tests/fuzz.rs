//! Fuzzing the whole way a spec file goes: arbitrary YAML (the real keys and junk ones, maps and
//! lists nested anywhere, scalars of every kind: huge and negative numbers, floats, `.nan`,
//! quoted numbers, quotes, backslashes, control characters, unicode, long strings) through
//! parse, validation of the base spec and every host overlay, and rendering.
//!
//! - `no_input_panics_and_every_valid_spec_renders`: 2,000 cases by default (a few seconds). A
//!   longer run: `PROPTEST_CASES=200000 cargo test -p specd-spec --release --test fuzz`.
//! - `every_valid_render_passes_systemd_analyze_verify`: systemd itself loads every unit that
//!   validated (100 specs by default; `FUZZ_VERIFY_SPECS=N` for more).

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;

use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, TestRunner};

/// A YAML node, emitted as block-style text by [`emit`].
#[derive(Clone, Debug)]
enum Y {
    Map(Vec<(String, Y)>),
    Seq(Vec<Y>),
    /// The scalar exactly as written in the file (plain, or with its quotes).
    Scalar(String),
}

/// A string as a YAML scalar: plain when that reads back as the same string, else quoted.
fn yaml_str(s: &str) -> String {
    let plain = !s.is_empty()
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"/_-.@%".contains(&b))
        && !s.starts_with(['-', '%', '@', '.'])
        && s.parse::<f64>().is_err()
        && !["true", "false", "null", "yes", "no", "on", "off", "y", "n"].contains(&s.to_ascii_lowercase().as_str());
    if plain { s.to_string() } else { serde_json::to_string(s).unwrap() }
}

fn s(v: &str) -> Y {
    Y::Scalar(yaml_str(v))
}

fn emit(y: &Y, indent: usize, out: &mut String) {
    let pad = " ".repeat(indent);
    match y {
        Y::Map(items) => {
            for (k, v) in items {
                let _ = write!(out, "{pad}{}:", yaml_str(k));
                emit_value(v, indent, out);
            }
        }
        Y::Seq(items) => {
            for v in items {
                let _ = write!(out, "{pad}-");
                emit_value(v, indent, out);
            }
        }
        Y::Scalar(t) => {
            let _ = writeln!(out, "{pad}{t}");
        }
    }
}

fn emit_value(v: &Y, indent: usize, out: &mut String) {
    match v {
        Y::Scalar(t) => {
            let _ = writeln!(out, " {t}");
        }
        Y::Map(m) if m.is_empty() => out.push_str(" {}\n"),
        Y::Seq(q) if q.is_empty() => out.push_str(" []\n"),
        nested => {
            out.push('\n');
            emit(nested, indent + 2, out);
        }
    }
}

/// Any scalar, written every way YAML allows.
fn scalar() -> impl Strategy<Value = Y> {
    let numbers = prop_oneof![
        Just("0"),
        Just("1"),
        Just("2"),
        Just("16"),
        Just("30000"),
        Just("65535"),
        Just("65536"),
        Just("4294967294"),
        Just("4294967295"),
        Just("4294967296"),
        Just("18446744073709551615"),
        Just("99999999999999999999999"),
        Just("-1"),
        Just("-4294967296"),
        Just("0x1F90"),
        Just("0o17"),
        Just("1_0"),
        Just("0.5"),
        Just("0.85"),
        Just("1.0"),
        Just("1e3"),
        Just("-0.0"),
        Just("1e400"),
        Just(".nan"),
        Just(".inf"),
        Just("-.inf"),
        Just("\"0x1F90\""),
        Just("'8080'"),
        Just("\"1_0\""),
        Just("\"0.5\""),
    ];
    let words = prop_oneof![
        Just("true"),
        Just("false"),
        Just("yes"),
        Just("no"),
        Just("null"),
        Just("~"),
        Just("''"),
        Just("\"\""),
        Just("[]"),
        Just("{}"),
        Just("!!str 5"),
        Just("!!int \"5\""),
        Just("&a x"),
        Just("*a"),
        Just("'it''s'"),
    ];
    prop_oneof![
        16 => numbers.prop_map(|t| Y::Scalar(t.to_string())),
        8 => words.prop_map(|t| Y::Scalar(t.to_string())),
        16 => text().prop_map(|t| s(&t)),
        1 => (prop_oneof![Just('a'), Just('/'), Just('é'), Just('"')], prop_oneof![Just(256usize), Just(4097), Just(20_000)])
            .prop_map(|(c, n)| s(&c.to_string().repeat(n))),
    ]
}

/// Text with what matters to YAML, systemd and the engines.
fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => "[a-zA-Z0-9 _./-]{0,12}",
        3 => "[a-z0-9 %$\"'\\\\;:{}=@,./_ü🦀-]{0,12}",
        1 => "[a-z]{0,3}[\n\r\t\u{0}\u{1b}\u{7f}\u{85}\u{2028}][a-z]{0,3}",
    ]
}

/// Any YAML node: scalars, lists and maps with real or junk keys, nested.
fn node() -> impl Strategy<Value = Y> {
    scalar().prop_recursive(3, 24, 5, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Y::Seq),
            prop::collection::vec((key(), inner), 0..4).prop_map(Y::Map),
        ]
    })
}

const REAL_KEYS: &[&str] = &[
    "apiVersion",
    "kind",
    "metadata",
    "spec",
    "hosts",
    "unit",
    "engine",
    "command",
    "model",
    "server",
    "speculative",
    "service",
    "readiness",
    "policy",
    "port",
    "tp_size",
    "num_steps",
    "environment",
    "environment_files",
    "credentials",
    "user",
    "memory_max",
];

fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => prop::sample::select(REAL_KEYS).prop_map(str::to_string),
        1 => prop_oneof![Just(""), Just("portt"), Just("x y"), Just("🦀"), Just("1"), Just("null"), Just("<<"), Just("-")]
            .prop_map(str::to_string),
        1 => "[A-Za-z_][A-Za-z0-9_]{0,8}",
    ]
}

/// A field: absent more often than not; when present mostly a plausible value, sometimes any
/// scalar or any node.
fn field(name: &'static str, good: BoxedStrategy<Y>) -> BoxedStrategy<Option<(String, Y)>> {
    prop::option::weighted(0.35, prop_oneof![38 => good, 1 => scalar(), 1 => node()])
        .prop_map(move |v| v.map(|v| (name.to_string(), v)))
        .boxed()
}

/// One of `ok` (strings) most of the time, one of `bad` sometimes.
fn pick(ok: &'static [&'static str], bad: &'static [&'static str]) -> BoxedStrategy<Y> {
    one_of(ok, bad).prop_map(s).boxed()
}

/// [`pick`] for values written as they are (numbers, booleans, quoted numbers).
fn num(ok: &'static [&'static str], bad: &'static [&'static str]) -> BoxedStrategy<Y> {
    one_of(ok, bad).prop_map(|v| Y::Scalar(v.to_string())).boxed()
}

fn one_of(ok: &'static [&'static str], bad: &'static [&'static str]) -> BoxedStrategy<&'static str> {
    if bad.is_empty() {
        return prop::sample::select(ok).boxed();
    }
    prop_oneof![12 => prop::sample::select(ok), 1 => prop::sample::select(bad)].boxed()
}

fn map(fields: Vec<BoxedStrategy<Option<(String, Y)>>>) -> BoxedStrategy<Y> {
    (fields, prop::option::weighted(0.03, (key(), node())))
        .prop_map(|(fs, junk)| Y::Map(fs.into_iter().flatten().chain(junk).collect()))
        .boxed()
}

fn list(item: BoxedStrategy<Y>, max: usize) -> BoxedStrategy<Y> {
    prop::collection::vec(item, 0..max).prop_map(Y::Seq).boxed()
}

fn string_map(keys: BoxedStrategy<String>, value: BoxedStrategy<Y>) -> BoxedStrategy<Y> {
    prop::collection::vec((keys, value), 0..3).prop_map(Y::Map).boxed()
}

fn path() -> BoxedStrategy<Y> {
    prop_oneof![
        6 => pick(&["/m", "/models/Qwen3.5-122B", "/srv/a b/c", "/opt/50%/x", "/opt/$HOME/x", "/a/./b", "/a//b", "/opt/ünï/x", "/opt/it's", "/opt/we\"ird"], &[
            "/opt/back\\slash",
            "/a/../b",
            "rel/path",
            "",
        ]),
        1 => "[a-zA-Z0-9 _.%$@:-]{1,12}".prop_map(|t| s(&format!("/{t}"))),
        1 => text().prop_map(|t| s(&format!("/{t}"))),
    ]
    .boxed()
}

fn free_text() -> BoxedStrategy<Y> {
    text().prop_map(|t| s(&t)).boxed()
}

fn spec_layer(overlay: bool) -> BoxedStrategy<Y> {
    let server = map(vec![
        field("host", pick(&["127.0.0.1", "0.0.0.0", "::", "localhost"], &["a b", ""])),
        field("port", num(&["30000", "8000", "1", "65535"], &["0", "65536", "\"8080\"", "0x1F90"])),
        field("tp_size", num(&["1", "2", "4"], &["0", "\"1_0\""])),
        field("mem_fraction_static", num(&["0.85", "1", "0.5"], &["0", "1.5", ".nan", "\"0.5\""])),
        field("max_running_requests", num(&["16", "1", "4294967295"], &["0"])),
        field("context_length", num(&["32768", "4294967295"], &["0"])),
        field("n_gpu_layers", num(&["99", "0"], &[])),
        field("served_model_name", free_text()),
        field(
            "extra_args",
            list(
                prop_oneof![
                    pick(
                        &["--enable-metrics", "2", "-1", ";", "$X", "%n", "--x=a b"],
                        &[
                            "--tp-size",
                            "--port=9",
                            "--draft-max",
                            "--config",
                            "--api-key",
                            "sk-Ab3dEf6hIj9kLm2nOp5qRs8t"
                        ]
                    ),
                    free_text(),
                ]
                .boxed(),
                4,
            ),
        ),
    ]);
    let speculative = map(vec![
        field("algorithm", pick(&["NEXTN", "EAGLE", "NGRAM", "eagle3", "mtp", "ngram"], &["nextn", "x"])),
        field("num_steps", num(&["1", "3", "10", "4294967294"], &["0", "4294967295"])),
        field("eagle_topk", num(&["1", "4"], &["0"])),
        field("num_draft_tokens", num(&["2", "4", "11", "4294967295"], &["0"])),
        field("draft_model", path()),
        field("draft_min", num(&["1", "4"], &["100"])),
        field("draft_p_min", num(&["0.75", "0", "1"], &["2", "-0.5", ".nan"])),
        field("prompt_lookup_min", num(&["1", "5"], &[])),
        field("prompt_lookup_max", num(&["3", "5"], &[])),
    ]);
    let env_key = prop_oneof![
        6 => one_of(&["CUDA_VISIBLE_DEVICES", "X", "HF_HOME", "VLLM_LOGGING_LEVEL"], &["HF_TOKEN", "OPENAI_API_KEY", "my_password", "A-B", "1X", ""]).prop_map(str::to_string),
        1 => "[A-Za-z_][A-Za-z0-9_]{0,6}",
    ]
    .boxed();
    let service = map(vec![
        field("description", free_text()),
        field(
            "user",
            pick(
                &["sglang", "_x", "a-b", "0", "1000", "65534", "4294967294"],
                &["a.b", "0100", "65535", "4294967295", "a b", "-x", ""],
            ),
        ),
        field("group", pick(&["video", "render", "0"], &["99999999999"])),
        field("working_directory", path()),
        field(
            "environment",
            string_map(
                env_key,
                prop_oneof![pick(&["0", "0,1", "", "a b", "x\"y", "50%", "$HOME", "back\\slash"], &[]), free_text()]
                    .boxed(),
            ),
        ),
        field(
            "environment_files",
            list(prop_oneof![path(), pick(&["-/etc/specd/x.env"], &["-rel", "--/x"])].boxed(), 3),
        ),
        field(
            "credentials",
            string_map(
                one_of(&["hf_token", "api.key", "A-1"], &["a/b", "a:b", "..", "x y", ""])
                    .prop_map(str::to_string)
                    .boxed(),
                path(),
            ),
        ),
        field("allow_literal_secrets", num(&["true", "false"], &["yes", "\"true\""])),
        field("restart", pick(&["always", "no", "on-failure"], &["sometimes"])),
        field("restart_sec", num(&["5", "0", "4294967295"], &[])),
        field("timeout_start_sec", num(&["1800", "4294967295"], &["0"])),
        field("timeout_stop_sec", num(&["300", "1"], &["0"])),
        field("drain_timeout_sec", num(&["120", "0", "4294967295"], &[])),
        field(
            "memory_max",
            pick(
                &["200G", "infinity", "80%", "12.5%", "100%", "1.5G", "4294967296K", "15E"],
                &["0", "0%", "101%", "16E", "1GG", "-1", "1B", "1", "64M"],
            ),
        ),
    ]);
    let readiness = map(vec![
        field("timeout_sec", num(&["60"], &["0"])),
        field("endpoint", pick(&["/health", "/x%y"], &["health", "/a b"])),
        field("verify_args", num(&["true", "false"], &["\"false\""])),
    ]);
    let policy = map(vec![
        field("drift", pick(&["heal", "report"], &["ignore"])),
        field("rollback", num(&["true", "false"], &[])),
    ]);
    let command = list(
        prop_oneof![
            pick(
                &[
                    "/opt/sglang/bin/python3",
                    "python3",
                    "llama-server",
                    "/usr/bin/env",
                    "-m",
                    "sglang.launch_server",
                    "/opt/a b/py",
                    "/opt/50%/py",
                    "/opt/ünï/py"
                ],
                &["/opt/we\"ird/py", "/opt/$x/py", "rel/py", "/opt/bin/"],
            ),
            free_text(),
        ]
        .boxed(),
        4,
    );
    let unit = pick(
        &["t.service", "sglang-qwen.service", "vllm@a.service", "a:b_c.service"],
        &[
            "systemd-journald.service",
            "dbus.service",
            "specd.service",
            "sshd.service",
            "t.socket",
            "../x.service",
            "a/b.service",
        ],
    );
    let mut fields = vec![
        field("engine", pick(&["sglang", "vllm", "llama-cpp"], &["tgi"])),
        field("command", command),
        field("model", path()),
        field("server", server),
        field("speculative", prop_oneof![1 => speculative, 1 => eagle(), 2 => Just(Y::Map(vec![]))].boxed()),
        field("service", service),
        field("readiness", readiness),
        field("policy", policy),
    ];
    if overlay {
        fields.insert(0, prop::option::weighted(0.02, unit).prop_map(|v| v.map(|v| ("unit".into(), v))).boxed());
        fields[1] = prop::option::weighted(0.1, pick(&["sglang", "vllm", "llama-cpp"], &["tgi"]))
            .prop_map(|v| v.map(|v| ("engine".into(), v)))
            .boxed();
    } else {
        // The base spec has its unit, engine and model far more often than not.
        let always = |name: &'static str, v: BoxedStrategy<Y>| {
            prop_oneof![19 => v.prop_map(move |v| Some((name.to_string(), v))), 1 => Just(None)].boxed()
        };
        fields[0] = always("engine", pick(&["sglang", "vllm", "llama-cpp"], &["tgi"]));
        fields[2] = always("model", path());
        fields.insert(0, always("unit", unit));
    }
    map(fields)
}

/// SGLang's EAGLE family, whose fields depend on each other (num_draft_tokens = num_steps + 1
/// when eagle_topk is 1), at the edges of their ranges.
fn eagle() -> BoxedStrategy<Y> {
    (
        prop::sample::select(&["NEXTN", "EAGLE", "EAGLE3", "STANDALONE"][..]),
        prop::sample::select(&[1u64, 3, 10, 4294967294, 4294967295][..]),
        prop::sample::select(&["1", "4"][..]),
        prop::option::of(prop::sample::select(&["/d", "/models/draft"][..])),
        any::<bool>(),
    )
        .prop_map(|(algorithm, steps, topk, draft, coherent)| {
            let tokens = if coherent { steps + 1 } else { steps.saturating_sub(1).max(1) };
            let mut m = vec![
                ("algorithm".to_string(), s(algorithm)),
                ("num_steps".to_string(), Y::Scalar(steps.to_string())),
                ("eagle_topk".to_string(), Y::Scalar(topk.to_string())),
                ("num_draft_tokens".to_string(), Y::Scalar(tokens.to_string())),
            ];
            if let Some(d) = draft {
                m.push(("draft_model".to_string(), s(d)));
            }
            Y::Map(m)
        })
        .boxed()
}

/// A whole spec file, as text.
fn document() -> impl Strategy<Value = String> {
    let top = map(vec![
        prop_oneof![39 => Just(Some(("apiVersion".to_string(), s("specd/v1")))), 1 => field("apiVersion", pick(&["specd/v2"], &[]))]
            .boxed(),
        prop_oneof![39 => Just(Some(("kind".to_string(), s("InferenceService")))), 1 => Just(None)].boxed(),
        prop_oneof![
            39 => one_of(&["t", "qwen35-122b-mtp", "a"], &["Bad_Name", ""]).prop_map(|n| Some(("metadata".to_string(), Y::Map(vec![("name".into(), s(n))])))),
            1 => field("metadata", node().boxed()),
        ]
        .boxed(),
        spec_layer(false).prop_map(|l| Some(("spec".to_string(), l))).boxed(),
        field(
            "hosts",
            prop::collection::vec((one_of(&["gpu-01", "gpu-02", "a.b"], &["x y", ""]).prop_map(str::to_string), spec_layer(true)), 0..3)
                .prop_map(Y::Map)
                .boxed(),
        ),
    ]);
    top.prop_map(|y| {
        let mut out = String::new();
        emit(&y, 0, &mut out);
        out
    })
}

/// What must hold for any input; `Some(units)` when the file is valid: every host's render.
fn check_file(text: &str) -> Option<Vec<specd_spec::RenderedUnit>> {
    let diags = specd_spec::check("f.yaml", text);
    let mut seen = Vec::new();
    for d in &diags.0 {
        assert_eq!(d.file, "f.yaml");
        assert!(d.line >= 1 && d.column >= 1, "an unlocated diagnostic: {d}");
        assert!(!d.message.is_empty(), "an empty message: {d}");
        assert!(
            d.message.len() < 2048,
            "a message of {} bytes: {}",
            d.message.len(),
            d.message.chars().take(200).collect::<String>()
        );
        let shown = d.to_string();
        assert!(shown.lines().count() <= 4 && shown.len() < 4096, "a diagnostic shown in {} bytes", shown.len());
        let id = (d.line, d.column, &d.path, &d.message);
        assert!(!seen.contains(&id), "listed twice: {d}\n--- all:\n{diags}");
        seen.push(id);
    }
    let parsed = match specd_spec::parse("f.yaml", text) {
        Ok(p) => p,
        Err(e) => {
            assert!(e.has_errors() && diags.has_errors());
            return None;
        }
    };
    let mut hosts: Vec<Option<String>> = vec![None];
    hosts.extend(parsed.document.hosts.keys().cloned().map(Some));
    let mut units = Vec::new();
    for h in &hosts {
        match parsed.resolve(h.as_deref()) {
            Ok(spec) => {
                let unit = specd_spec::render(&spec);
                assert!(unit.text.starts_with(specd_spec::HEADER));
                let exec = unit.text.lines().find_map(|l| l.strip_prefix("ExecStart=")).expect("an ExecStart line");
                assert_eq!(specd_spec::parse_command_line(exec).as_deref(), Some(spec.argv.as_slice()));
                assert_eq!(specd_spec::render(&spec), unit, "rendering is deterministic");
                units.push(unit);
            }
            Err(e) => {
                assert!(e.has_errors());
                assert!(diags.has_errors(), "resolving for {h:?} fails but the file checks clean:\n{e}");
                return None;
            }
        }
    }
    // A file that resolves for every host has nothing to report as an error.
    assert!(!diags.has_errors(), "every host resolves, but check reports:\n{diags}");
    Some(units)
}

fn cases(var: &str, default: u32) -> u32 {
    std::env::var(var).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[test]
fn no_input_panics_and_every_valid_spec_renders() {
    let config = Config { cases: cases("PROPTEST_CASES", 2000), failure_persistence: None, ..Config::default() };
    let mut runner = TestRunner::new(config);
    let valid = std::cell::Cell::new(0u32);
    runner
        .run(&document(), |text| {
            if check_file(&text).is_some() {
                valid.set(valid.get() + 1);
            }
            Ok(())
        })
        .unwrap();
    // Not vacuous: a good share of the generated files are valid and rendered.
    let n = cases("PROPTEST_CASES", 2000);
    assert!(valid.get() * 20 >= n, "only {} of {n} generated specs were valid", valid.get());
    eprintln!("{n} generated spec files, {} valid and rendered for every host", valid.get());
}

#[test]
fn junk_text_never_panics() {
    // Not even YAML: random bytes of the characters YAML cares about.
    let config = Config { cases: cases("PROPTEST_CASES", 2000) / 3, failure_persistence: None, ..Config::default() };
    let mut runner = TestRunner::new(config);
    runner
        .run(&"[a-z0-9:{}\\[\\],&*!|>'\"%@`#\\- \n\t.\\\\]{0,80}", |text| {
            let _ = check_file(&text);
            Ok(())
        })
        .unwrap();
}

/// systemd checks the program it would run; make the spec's program exist (in a temporary
/// directory, under its own name, whatever characters that has) so that verify checks the rest.
fn with_real_program(text: &str, bin: &Path) -> Option<specd_spec::ParsedSpec> {
    let mut parsed = specd_spec::parse("f.yaml", text).ok()?;
    let layer = &mut parsed.document.spec;
    let cmd = layer.command.get_or_insert_with(|| vec!["true".into()]);
    if let Some(prog) = cmd.first_mut()
        && prog.starts_with('/')
    {
        let name = prog.rsplit('/').next().unwrap_or_default().to_string();
        *prog = format!("{}/{}", bin.display(), if name.is_empty() { "x" } else { &name });
    } else if let Some(prog) = cmd.first_mut() {
        // A bare name is looked up in systemd's search path: use one that is there.
        *prog = "true".into();
    }
    for layer in parsed.document.hosts.values_mut() {
        layer.command = None;
    }
    Some(parsed)
}

#[test]
fn every_valid_render_passes_systemd_analyze_verify() {
    if Command::new("systemd-analyze").arg("--version").output().is_err() {
        panic!("systemd-analyze is not installed: apt-get install systemd");
    }
    let want = cases("FUZZ_VERIFY_SPECS", 100) as usize;
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    let mut runner = TestRunner::deterministic();
    let mut units: Vec<(String, std::path::PathBuf, String)> = Vec::new();
    let mut tried = 0;
    while units.len() < want && tried < want * 100 {
        tried += 1;
        let text = document().new_tree(&mut runner).unwrap().current();
        let Some(parsed) = with_real_program(&text, &bin) else { continue };
        if parsed.check().has_errors() {
            continue;
        }
        let spec = parsed.resolve(None).expect("a file that checks clean resolves");
        if let Some(prog) = spec.argv.first().filter(|p| p.starts_with('/')) {
            std::fs::copy("/bin/true", prog).unwrap_or_else(|e| panic!("{prog}: {e}"));
        }
        let unit = specd_spec::render(&spec);
        // The file's name is the unit's name; one per spec.
        let path = dir.path().join(format!("fuzz{}.service", units.len()));
        std::fs::write(&path, &unit.text).unwrap();
        units.push((text, path, unit.text));
    }
    assert!(units.len() >= want, "only {} valid specs in {tried} tries", units.len());
    eprintln!("{} valid specs of {tried} generated, verified by systemd-analyze", units.len());
    let verify = |paths: &[&Path]| {
        let out = Command::new("systemd-analyze").arg("verify").args(paths).output().unwrap();
        (out.status.success() && out.stderr.is_empty(), String::from_utf8_lossy(&out.stderr).to_string())
    };
    let all: Vec<&Path> = units.iter().map(|(_, p, _)| p.as_path()).collect();
    if verify(&all).0 {
        return;
    }
    // Name the specs systemd complains about.
    let mut failures = Vec::new();
    for (text, path, unit) in &units {
        let (ok, err) = verify(&[path.as_path()]);
        if !ok {
            failures.push(format!("systemd says:\n{err}--- unit:\n{unit}--- spec:\n{text}"));
        }
    }
    panic!(
        "{} of {} valid specs render units systemd refuses:\n{}",
        failures.len(),
        units.len(),
        failures.join("\n\n")
    );
}
