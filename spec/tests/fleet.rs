//! The fleet file and the promotion record: located errors, wave selection, the revision each
//! host runs.

use std::collections::BTreeMap;

use serde_json::json;
use specd_spec::fleet::{self, Promoted, Record, RolloutState, WaveRecord};

fn root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

const FLEET: &str = "\
apiVersion: specd/v1
kind: Fleet
metadata:
  name: gpus
spec:
  waves:
    - name: canary
      hosts: [gpu-01]
      bake: 10m
    - name: h100
      labels: {gpu: h100}
      max_unavailable: 2
      bake: 30m
    - name: rest
      hosts: ['gpu-*']
      max_unavailable: 3
      bake: 1h
  gates:
    accept_length: {min: 1.5, of_previous: 0.8}
    startup_within: {max: 10m, of_previous: 1.5}
    speculation_pays: {of_previous: 0.95}
";

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

const A: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
const B: &str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";

#[test]
fn a_host_belongs_to_the_first_wave_that_selects_it() {
    let f = fleet::parse_fleet(FLEET, "fleet.yaml").unwrap();
    assert_eq!(f.wave_of("gpu-01", &labels(&[("gpu", "h100")])), Some(0), "named in the canary first");
    assert_eq!(f.wave_of("gpu-02", &labels(&[("gpu", "h100")])), Some(1));
    assert_eq!(f.wave_of("gpu-02", &labels(&[("gpu", "a100")])), Some(2));
    assert_eq!(f.wave_of("cpu-01", &labels(&[("gpu", "h100")])), Some(1), "labels alone select");
    assert_eq!(f.wave_of("cpu-01", &labels(&[])), None);
    assert_eq!(f.waves()[1].max_unavailable, 2);
    assert_eq!(f.waves()[0].max_unavailable, 1, "the default");
    assert_eq!(f.waves()[2].bake.as_secs(), 3600);
    assert_eq!(f.record_branch(), "specd-promotions");
    let g = f.gates();
    assert!(g.args_verified && g.speculation_proven && g.no_deaths);
    assert_eq!(g.converge_within.as_secs(), 1800);
    assert_eq!(g.accept_length.as_ref().unwrap().below(1.2, None).unwrap(), "1.200 < min 1.5");
    assert_eq!(
        g.accept_length.as_ref().unwrap().below(1.6, Some(2.5)).unwrap(),
        "1.600 < 0.8 × 2.500 (the previous revision's)"
    );
    assert_eq!(g.accept_length.as_ref().unwrap().below(2.1, Some(2.5)), None);
    let within = g.startup_within.as_ref().unwrap();
    assert_eq!(within.above(601.0, None).unwrap(), "601.0s > max 600s");
    assert_eq!(within.above(61.0, Some(30.0)).unwrap(), "61.0s > 1.5 × 30.0s (the previous revision's)");
    assert_eq!(within.above(44.0, Some(30.0)), None);
    assert_eq!(within.above(44.0, None), None, "no previous start: the absolute ceiling only");
    let pays = g.speculation_pays.as_ref().unwrap();
    assert_eq!(pays.min_drafts, 200, "the default");
    assert_eq!(pays.below((2.4, 200.0), (2.5, 205.0)), None);
    assert_eq!(
        pays.below((2.3, 200.0), (2.5, 205.0)).unwrap(),
        "accept length 2.300 < 0.95 × 2.500 (the previous revision's, at the load it served)"
    );
    assert_eq!(
        pays.below((2.5, 190.0), (2.5, 205.0)).unwrap(),
        "decode speed 190.0 tok/s per request < 0.95 × 205.0 (the previous revision's, at the load it served)"
    );
    assert!(fleet::is_fleet(FLEET));
    assert!(!fleet::is_fleet("kind: Sweep\n"));
}

/// Each bad field is reported with file, line and field path.
#[test]
fn every_problem_is_located() {
    let cases: &[(&str, &str, &str)] = &[
        ("bake: 10m", "bake: 10", "fleet.yaml:9:13: spec.waves[0].bake: expected a duration"),
        (
            "bake: 10m",
            "bake: 9d",
            "fleet.yaml:9:13: spec.waves[0].bake: expected a duration in whole seconds, minutes or hours (`60s`, `5m`, `1h`), got \"9d\"",
        ),
        ("bake: 10m", "bake: 200h", "spec.waves[0].bake: \"200h\" is more than a week (the longest a fleet waits)"),
        (
            "max_unavailable: 2",
            "max_unavailable: 0",
            "fleet.yaml:12:24: spec.waves[1].max_unavailable: must be at least 1",
        ),
        ("name: h100", "name: canary", "fleet.yaml:10:13: spec.waves[1].name: `canary` is already the name of wave 0"),
        ("name: h100", "name: H100", "fleet.yaml:10:13: spec.waves[1].name: must be 1-63 lowercase"),
        ("      labels: {gpu: h100}\n", "", "fleet.yaml:10:7: spec.waves[1]: selects no host"),
        ("{gpu: h100}", "{gpu-model: h100}", "spec.waves[1].labels.gpu-model: `gpu-model` is not a label name"),
        ("of_previous: 0.8", "of_previous: 1.5", "spec.gates.accept_length.of_previous: must be a fraction"),
        ("{min: 1.5, of_previous: 0.8}", "{}", "spec.gates.accept_length: needs `min` or `of_previous`"),
        (
            "{max: 10m, of_previous: 1.5}",
            "{}",
            "fleet.yaml:20:21: spec.gates.startup_within: needs `max` or `of_previous`",
        ),
        (
            "of_previous: 1.5}",
            "of_previous: 0.9}",
            "spec.gates.startup_within.of_previous: must be a factor of at least 1",
        ),
        ("{max: 10m,", "{max: 0s,", "fleet.yaml:20:27: spec.gates.startup_within.max: must be at least 1s"),
        ("{max: 10m,", "{max: 10,", "spec.gates.startup_within.max: expected a duration"),
        (
            "{of_previous: 0.95}",
            "{of_previous: 0}",
            "fleet.yaml:21:37: spec.gates.speculation_pays.of_previous: must be a fraction above 0, at most 1; got 0",
        ),
        (
            "{of_previous: 0.95}",
            "{of_previous: 0.9, min_drafts: 0}",
            "spec.gates.speculation_pays.min_drafts: must be at least 1",
        ),
        (
            "{of_previous: 0.95}",
            "{min_drafts: 100}",
            "fleet.yaml:21:24: spec.gates.speculation_pays.min_drafts: missing field `of_previous`",
        ),
        ("kind: Fleet", "kind: Fleat", "fleet.yaml:2:7: kind: must be `Fleet`"),
        (
            "      bake: 1h\n",
            "      bake: 1h\n      wait: 1h\n",
            "fleet.yaml:18:7: spec.waves[2].wait: unknown field `wait`",
        ),
        ("  gates:", "  record_branch: 'a..b'\n  gates:", "spec.record_branch: is not a usable branch name"),
    ];
    for (from, to, want) in cases {
        assert!(FLEET.contains(from), "{from}");
        let text = FLEET.replacen(from, to, 1);
        let got = fleet::check(&text, "fleet.yaml").to_string();
        assert!(got.contains(want), "{from} -> {to}: want {want:?} in\n{got}");
    }
    let empty =
        fleet::check("apiVersion: specd/v1\nkind: Fleet\nmetadata: {name: x}\nspec: {}\n", "f.yaml").to_string();
    assert!(empty.contains("f.yaml:4:1: spec.waves: is required"), "{empty}");
}

fn record() -> Record {
    Record {
        target: B.into(),
        released: A.into(),
        state: RolloutState::Progressing,
        started: 100,
        waves: vec![
            WaveRecord {
                name: "canary".into(),
                good: A.into(),
                promoted: vec![Promoted { host: "gpu-01".into(), at: 110 }],
                converged: Some(200),
                baked: None,
            },
            WaveRecord::at("h100", A),
            WaveRecord::at("rest", A),
        ],
        halt: None,
    }
}

#[test]
fn a_host_runs_the_target_once_promoted_and_its_waves_good_revision_before() {
    let f = fleet::parse_fleet(FLEET, "fleet.yaml").unwrap();
    let r = record();
    let a = r.revision_for(&f, "gpu-01", &labels(&[])).unwrap();
    assert_eq!((a.revision.as_str(), a.wave.as_deref(), a.promoted), (B, Some("canary"), true));
    let a = r.revision_for(&f, "gpu-05", &labels(&[])).unwrap();
    assert_eq!((a.revision.as_str(), a.wave.as_deref(), a.promoted), (A, Some("rest"), false));
    let a = r.revision_for(&f, "cpu-01", &labels(&[])).unwrap();
    assert_eq!((a.revision.as_str(), a.wave, a.promoted), (A, None, false), "in no wave: the released revision");
    let mut short = r.clone();
    short.waves.pop();
    let e = short.revision_for(&f, "gpu-05", &labels(&[])).unwrap_err();
    assert!(e.contains("no wave `rest` yet"), "{e}");
}

#[test]
fn the_record_reads_back_what_it_wrote_and_refuses_a_short_revision() {
    let r = record();
    let text = r.render();
    assert!(text.starts_with("# specd promotion record"), "{text}");
    assert_eq!(Record::parse(&text, "promotions.yaml").unwrap(), r);
    assert_eq!(r.render(), text, "deterministic");
    let bad = text.replacen(B, "bbbb", 1);
    let e = Record::parse(&bad, "promotions.yaml").unwrap_err().to_string();
    assert!(e.contains("promotions.yaml:2:") && e.contains("target: must be a full commit hash"), "{e}");
    let adopted = Record::adopt(&fleet::parse_fleet(FLEET, "f").unwrap(), A, 5);
    assert_eq!(adopted.state, RolloutState::Complete);
    assert!(adopted.waves.iter().all(|w| w.good == A && w.promoted.is_empty()));
}

#[test]
fn checked_in_fleet_schema_is_current() {
    let path = root().join("schemas/fleet.schema.json");
    let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        on_disk == fleet::json_schema(),
        "schemas/fleet.schema.json is stale: regenerate it with `cargo run -p specd -- schema --kind fleet > schemas/fleet.schema.json`"
    );
    let schema: serde_json::Value = serde_json::from_str(&on_disk).unwrap();
    assert_eq!(schema["properties"]["kind"]["const"], "Fleet");
    assert_eq!(schema["$defs"]["Wave"]["properties"]["bake"]["type"], json!("string"));
}

#[test]
fn the_example_fleet_file_parses_and_selects_its_hosts() {
    // The README sends readers to examples/fleet.yaml: it must be a fleet file that works.
    let p = root().join("examples/fleet.yaml");
    let text = std::fs::read_to_string(&p).unwrap();
    assert!(fleet::is_fleet(&text));
    let f = fleet::parse_fleet(&text, "examples/fleet.yaml").unwrap_or_else(|d| panic!("{d}"));
    let names: Vec<&str> = f.waves().iter().map(|w| w.name.as_str()).collect();
    assert_eq!(names, ["canary", "h100", "rest"]);
    assert_eq!(f.wave_of("gpu-01", &labels(&[("gpu", "h100")])), Some(0));
    assert_eq!(f.wave_of("node-7", &labels(&[("gpu", "h100")])), Some(1));
    assert_eq!(f.wave_of("gpu-09", &labels(&[])), Some(2));
    assert_eq!(f.wave_of("node-7", &labels(&[])), None);
}
