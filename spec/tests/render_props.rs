//! Properties of rendering: any spec that validates renders to a unit whose every line reads back
//! to exactly the intended value (no injection, whatever the strings hold), deterministically.

use std::collections::BTreeMap;

use proptest::prelude::*;
use specd_spec::model::{Document, Metadata, ServerLayer, ServiceLayer, SpecLayer};
use specd_spec::{Engine, Spec, parse_command_line, parse_environment};

/// Text with everything systemd treats specially: quotes, backslashes, `%`, `$`, `;`, braces,
/// white space, non-ASCII, and now and then a control character.
fn nasty() -> impl Strategy<Value = String> {
    prop_oneof![
        8 => "[a-zA-Z0-9 %$\"'\\\\;{}=@:,./_ü-]{0,16}",
        1 => "[a-z%$]{0,4}[\n\r\t\u{0}\u{7f}][a-z]{0,4}",
    ]
}

fn doc() -> impl Strategy<Value = Document> {
    (
        prop_oneof![Just(Engine::Sglang), Just(Engine::Vllm), Just(Engine::LlamaCpp)],
        nasty(),
        proptest::collection::vec(nasty(), 0..5),
        proptest::collection::btree_map("[A-Z_][A-Z0-9_]{0,6}", nasty(), 0..4),
        proptest::option::of(nasty()),
        proptest::option::of(nasty()),
        proptest::option::of(nasty()),
    )
        .prop_map(|(engine, model, extra, env, wd, desc, name)| Document {
            api_version: "specd/v1".into(),
            kind: "InferenceService".into(),
            metadata: Metadata { name: "p".into(), labels: BTreeMap::new() },
            spec: SpecLayer {
                unit: Some("p.service".into()),
                engine: Some(engine),
                model: Some(format!("/models/{model}")),
                server: Some(ServerLayer { extra_args: Some(extra), served_model_name: name, ..Default::default() }),
                service: Some(ServiceLayer {
                    environment: Some(env),
                    working_directory: wd.map(|w| format!("/srv/{w}")),
                    description: desc,
                    ..Default::default()
                }),
                ..Default::default()
            },
            hosts: BTreeMap::new(),
        })
}

/// A unit read back: ExecStart's argv, the environment, and every other key's values.
type ReadBack<'a> = (Vec<String>, BTreeMap<String, String>, BTreeMap<&'a str, Vec<String>>);

/// Read a rendered unit back the way systemd does for the keys specd writes.
fn read_back(text: &str) -> ReadBack<'_> {
    let mut argv = None;
    let mut env = BTreeMap::new();
    let mut keys: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for line in text.lines() {
        if line.is_empty() || line.starts_with('#') || line.starts_with('[') {
            continue;
        }
        let (k, v) = line.split_once('=').unwrap_or_else(|| panic!("not a key=value line: {line:?}"));
        match k {
            "ExecStart" => {
                assert!(argv.is_none(), "two ExecStart lines");
                argv = Some(parse_command_line(v).unwrap_or_else(|| panic!("ExecStart does not parse: {v:?}")));
            }
            "Environment" => {
                let (ek, ev) = parse_environment(v).unwrap_or_else(|| panic!("Environment does not parse: {v:?}"));
                assert!(env.insert(ek, ev).is_none(), "a variable set twice");
            }
            _ => keys.entry(k).or_default().push(v.replace("%%", "%")),
        }
    }
    (argv.expect("an ExecStart line"), env, keys)
}

fn check(spec: &Spec) {
    let unit = specd_spec::render(spec);
    let (argv, env, keys) = read_back(&unit.text);
    assert_eq!(argv, spec.argv);
    assert_eq!(env, spec.service.environment);
    for (k, vs) in &keys {
        assert_eq!(vs.len(), 1, "{k} appears {} times", vs.len());
        let allowed = [
            "Description",
            "Wants",
            "After",
            "Type",
            "WorkingDirectory",
            "User",
            "Group",
            "Restart",
            "RestartSec",
            "TimeoutStartSec",
            "TimeoutStopSec",
            "KillMode",
            "KillSignal",
            "MemoryMax",
            "WantedBy",
        ];
        assert!(allowed.contains(k), "unexpected key {k}");
    }
    assert_eq!(keys["Description"][0], spec.service.description);
    // systemd.special(7): network-online.target is pulled in and waited for, both.
    assert_eq!(
        (keys["Wants"].as_slice(), keys["After"].as_slice()),
        (&["network-online.target".to_string()][..], &["network-online.target".to_string()][..])
    );
    if let Some(w) = &spec.service.working_directory {
        assert_eq!(&keys["WorkingDirectory"][0], w);
    }
    // Deterministic: the same spec renders to the same bytes and hash.
    let again = specd_spec::render(spec);
    assert_eq!(again, unit);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn valid_specs_render_without_injection(doc in doc()) {
        let yaml = serde_saphyr::to_string(&doc).unwrap();
        let parsed = specd_spec::parse("p.yaml", &yaml).expect("serialized YAML parses");
        match parsed.resolve(None) {
            Ok(spec) => check(&spec),
            Err(diags) => {
                // Refused: then a refusal names a field, and the input had something to refuse.
                prop_assert!(diags.errors().all(|d| !d.path.is_empty() && d.line > 0), "{}", diags);
            }
        }
    }

    #[test]
    fn control_characters_are_always_refused(doc in doc(), c in "[\n\r\u{0}]") {
        let mut doc = doc;
        doc.spec.model = Some(format!("/m{c}ExecStartPre=/bin/false"));
        let yaml = serde_saphyr::to_string(&doc).unwrap();
        let parsed = specd_spec::parse("p.yaml", &yaml).unwrap();
        let err = parsed.resolve(None).unwrap_err();
        prop_assert!(err.errors().any(|d| d.path == "spec.model" && d.message.contains("control character")), "{}", err);
    }
}

#[test]
fn the_generator_produces_valid_specs_often() {
    // Guard against a property that passes vacuously because nothing validates.
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let mut ok = 0;
    for _ in 0..200 {
        let d = doc().new_tree(&mut runner).unwrap().current();
        let yaml = serde_saphyr::to_string(&d).unwrap();
        if specd_spec::parse("p.yaml", &yaml).unwrap().resolve(None).is_ok() {
            ok += 1;
        }
    }
    assert!(ok >= 20, "only {ok} of 200 generated specs validate");
}
