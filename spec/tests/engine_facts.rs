//! The engine facts table against fixtures recorded from the real engines
//! (`tests/fixtures/engines/`, re-recorded by `scripts/record-fixtures`): every flag specd owns or
//! refuses, every algorithm, every reported arg, metric and speculation field exists in the real
//! engine under that name.

use std::path::{Path, PathBuf};

use serde_json::Value;
use specd_spec::{Counters, Engine, Evidence, engine_facts};

fn fixtures(engine: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/engines").join(engine)
}

fn read(engine: &str, file: &str) -> String {
    let p = fixtures(engine).join(file);
    std::fs::read_to_string(&p)
        .unwrap_or_else(|e| panic!("{}: {e} (re-record with scripts/record-fixtures)", p.display()))
}

fn json(engine: &str, file: &str) -> Value {
    serde_json::from_str(&read(engine, file)).unwrap()
}

fn dir(e: Engine) -> &'static str {
    e.as_str()
}

/// The engine's argument parser: vLLM's recorded from the real `vllm serve` (`real/args.json`),
/// the others' read from their sources or `--help`.
fn args_file(engine: Engine) -> &'static str {
    if engine == Engine::Vllm { "real/args.json" } else { "args.json" }
}

/// Every flag (with aliases) the engine's argument parser accepts.
fn flags(engine: Engine) -> Vec<String> {
    json(dir(engine), args_file(engine))
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|a| a["flags"].as_array().unwrap().iter().map(|f| f.as_str().unwrap().to_string()))
        .collect()
}

/// Exposition names of the metrics the engine exports (`metrics.txt`: name, type, labels,
/// exposition name, source; tab-separated; `#` comments).
/// llama.cpp's file and vLLM's (a speculating server's, `real/metrics.ngram.txt`) are real
/// `/metrics` bodies: their names are on the `# TYPE` lines.
fn metric_names(engine: Engine) -> Vec<String> {
    let file = if engine == Engine::Vllm { "real/metrics.ngram.txt" } else { "metrics.txt" };
    let text = read(dir(engine), file);
    if engine != Engine::Sglang {
        return text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split(' ').next().map(str::to_string))
            .collect();
    }
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| l.split('\t').nth(3).map(str::to_string))
        .collect()
}

/// A spec of this engine from the examples, to ask what it expects the server to report.
fn example(engine: Engine) -> specd_spec::Spec {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_none_or(|x| x != "yaml")
            || p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("sweep-"))
        {
            continue;
        }
        let parsed = specd_spec::parse("x.yaml", &std::fs::read_to_string(&p).unwrap()).unwrap();
        let spec = parsed.resolve(None).unwrap();
        if spec.engine == engine {
            return spec;
        }
    }
    panic!("no example for {engine:?}")
}

#[test]
fn every_owned_flag_and_alias_is_a_real_flag() {
    for e in [Engine::Sglang, Engine::Vllm, Engine::LlamaCpp] {
        let real = flags(e);
        for (flag, field) in engine_facts(e).owned_flags {
            assert!(real.iter().any(|f| f == flag), "{e:?}: {flag} (for {field}) is not a flag of the real engine");
        }
    }
}

#[test]
fn removed_flags_are_refused_by_the_real_llama_server() {
    let help = read("llama-cpp", "help.txt");
    for (flag, _) in engine_facts(Engine::LlamaCpp).removed_flags {
        let line = help
            .lines()
            .find(|l| l.split([' ', ',']).any(|w| w == *flag))
            .unwrap_or_else(|| panic!("{flag} is not in llama-server --help"));
        assert!(line.contains("removed") || help_entry(&help, flag).contains("removed"), "{flag}: {line}");
    }
}

/// The help text of one flag (its line and the indented lines after it).
fn help_entry(help: &str, flag: &str) -> String {
    let mut out = String::new();
    let mut on = false;
    for l in help.lines() {
        if l.split([' ', ',']).any(|w| w == flag) {
            on = true;
        } else if on && l.starts_with('-') {
            break;
        }
        if on {
            out.push_str(l);
            out.push('\n');
        }
    }
    out
}

#[test]
fn algorithms_are_the_engines_own() {
    // vLLM: `vllm_methods_are_those_the_real_vllm_accepts`.
    // llama.cpp: the --spec-type values listed by the real --help.
    let help = help_entry(&read("llama-cpp", "help.txt"), "--spec-type");
    for a in engine_facts(Engine::LlamaCpp).algorithms {
        assert!(help.contains(a.name), "--spec-type {} is not in llama-server --help:\n{help}", a.name);
    }
    // SGLang: the names its SpeculativeAlgorithm accepts.
    let sglang = read("sglang", "speculative_algorithms.txt");
    let names: Vec<&str> =
        sglang.lines().filter(|l| !l.starts_with('#')).map(|l| l.split(" -> ").next().unwrap_or(l).trim()).collect();
    // SGLang's own rewrite of an alias is what the table says it reports.
    for l in sglang.lines().filter_map(|l| l.split_once(" -> ")) {
        let a = engine_facts(Engine::Sglang).algorithm(l.0.trim());
        assert!(a.is_none_or(|a| a.reported_as == l.1.trim()), "SGLang rewrites {} to {}", l.0, l.1);
    }
    for a in engine_facts(Engine::Sglang).algorithms {
        assert!(names.contains(&a.name), "SGLang algorithm {} is not in {names:?}", a.name);
        assert!(names.contains(&a.reported_as), "SGLang reports {} as {}, not a name it has", a.name, a.reported_as);
    }
}

#[test]
fn the_args_a_running_server_must_report_exist_in_its_report() {
    // SGLang: /get_server_info carries one key per ServerArgs field.
    let fields = json("sglang", "server_args.fields.json");
    let names: Vec<String> = fields
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["name"].as_str().or(f["key"].as_str()).unwrap().to_string())
        .collect();
    let spec = example(Engine::Sglang);
    for e in spec.expected_server_args() {
        let key = e.key.trim_start_matches('/');
        assert!(names.iter().any(|n| n == key), "SGLang reports no {key}");
    }
    // llama.cpp: the real /props.
    let props = json("llama-cpp", "props.json");
    let spec = example(Engine::LlamaCpp);
    for e in spec.expected_server_args() {
        assert!(props.pointer(e.key).is_some(), "llama-server's /props has no {}", e.key);
    }
}

#[test]
fn metric_names_and_speculation_evidence_exist_in_the_real_replies() {
    for e in [Engine::Sglang, Engine::Vllm, Engine::LlamaCpp] {
        let m = engine_facts(e).running_requests_metric;
        assert!(metric_names(e).iter().any(|n| n == m), "{e:?} exports no {m}");
    }
    match &engine_facts(Engine::Sglang).evidence {
        Evidence::Sglang { verify_ct, tokens, avg_accept_length, .. } => {
            let g = json("sglang", "generate.shape.json");
            assert!(g["meta_info"].get(*verify_ct).is_some(), "meta_info.{verify_ct}");
            assert!(g["meta_info"].get(*tokens).is_some(), "meta_info.{tokens}");
            let i = json("sglang", "get_server_info.shape.json");
            assert!(i["internal_states"][0].get(*avg_accept_length).is_some(), "internal_states[].{avg_accept_length}");
        }
        other => panic!("{other:?}"),
    }
    match &engine_facts(Engine::Vllm).evidence {
        Evidence::Vllm { drafts, draft_tokens, accepted, .. } => {
            let names = metric_names(Engine::Vllm);
            for n in [drafts, draft_tokens, accepted] {
                assert!(names.iter().any(|x| x == *n), "vLLM exports no {n}");
            }
        }
        other => panic!("{other:?}"),
    }
    match &engine_facts(Engine::LlamaCpp).evidence {
        Evidence::LlamaCpp { slot_flag, drafted, accepted, .. } => {
            let slots = json("llama-cpp", "slots.json");
            assert_eq!(slots[0][*slot_flag], Value::Bool(true), "a speculating server's slot says {slot_flag}: true");
            let off = json("llama-cpp", "slots.nospec.json");
            assert_eq!(off[0][*slot_flag], Value::Bool(false), "a draft without --spec-type: {slot_flag}: false");
            let c = json("llama-cpp", "completion.json");
            assert!(c["timings"].get(*drafted).is_some(), "timings.{drafted}");
            assert!(c["timings"].get(*accepted).is_some(), "timings.{accepted}");
            let c = json("llama-cpp", "completion.nospec.json");
            assert!(c["timings"].get(*drafted).is_none(), "no draft counts without drafting");
        }
        other => panic!("{other:?}"),
    }
}

/// The counters `specd tune` reads are the engines' own: each name on a `# TYPE` line of a real
/// `/metrics` (SGLang: in its catalogue of metrics).
#[test]
fn the_counters_tune_reads_are_the_engines_own() {
    for e in [Engine::Sglang, Engine::Vllm, Engine::LlamaCpp] {
        let names: Vec<&str> = match &engine_facts(e).counters {
            Counters::Vllm { drafts, accepted, per_position, step_latency, requests, engine_steps, started } => {
                vec![drafts, accepted, per_position, step_latency, requests, engine_steps, started]
            }
            Counters::LlamaCpp { drafts, accepted, per_position, tokens, decode_seconds, busy_slots } => {
                vec![drafts, accepted, per_position, tokens, decode_seconds, busy_slots]
            }
            Counters::Sglang { verify_calls, tokens } => vec![verify_calls, tokens],
        };
        let known = metric_names(e);
        for n in names {
            assert!(known.iter().any(|k| k == n), "{e:?} exports no {n}");
        }
    }
}

#[test]
fn a_spec_that_sets_every_reported_field_expects_every_one() {
    let full = |engine: &str, rest: &str| {
        let text = format!(
            "apiVersion: specd/v1\nkind: InferenceService\nmetadata: {{name: t}}\nspec:\n  unit: t.service\n  engine: {engine}\n  model: /m\n{rest}"
        );
        specd_spec::parse("t.yaml", &text).unwrap().resolve(None).unwrap()
    };
    let sglang = full(
        "sglang",
        "  server: {port: 30001, tp_size: 2, mem_fraction_static: 0.8, max_running_requests: 8, context_length: 4096}\n  speculative: {algorithm: EAGLE, num_steps: 3, eagle_topk: 1, num_draft_tokens: 4, draft_model: /d}\n",
    );
    let llama = full("llama-cpp", "  server: {max_running_requests: 2}\n");
    for spec in [sglang, llama] {
        let want: Vec<&str> = engine_facts(spec.engine).reported.iter().map(|r| r.pointer).collect();
        let got: Vec<&str> = spec.expected_server_args().iter().map(|a| a.key).collect();
        assert_eq!(got, want, "{:?}: a reported field the spec sets is not expected", spec.engine);
    }
}

/// The table's secret flags are the engine's own flags taking a value, with the environment
/// variable the engine names for them (llama.cpp's `--help`), and every flag of the recording
/// whose name says that it takes a secret as text is in the table, so that the advice given for
/// it is the engine's own.
#[test]
fn secret_flags_are_the_engines_own_and_none_is_missing() {
    for e in [Engine::Sglang, Engine::Vllm, Engine::LlamaCpp] {
        let facts = engine_facts(e);
        let args = json(dir(e), args_file(e));
        let entries = args.as_array().unwrap();
        let spellings = |a: &Value| {
            a["flags"].as_array().unwrap().iter().map(|f| f.as_str().unwrap().to_string()).collect::<Vec<_>>()
        };
        for sf in facts.secret_flags {
            for f in sf.flags {
                let entry = entries
                    .iter()
                    .find(|a| spellings(a).iter().any(|x| x == f))
                    .unwrap_or_else(|| panic!("{e:?}: {f} is not a flag of the recorded engine"));
                assert!(!entry["type"].is_null(), "{e:?}: {f} takes no value");
                if e == Engine::LlamaCpp {
                    assert_eq!(entry["env"].as_str(), sf.env, "{e:?}: {f}: the engine names another variable");
                }
            }
            if let Some(ff) = sf.file_flag {
                assert!(flags(e).iter().any(|f| f == ff), "{e:?}: {ff} is not a flag");
            }
        }
        for entry in entries {
            let ty = entry["type"].as_str().unwrap_or("");
            // Switches, and flags that take numbers (`--bucket-time-to-first-token`).
            if entry["type"].is_null() || ty.contains("int") || ty.contains("float") || ["N", "F"].contains(&ty) {
                continue;
            }
            for f in spellings(entry) {
                let words: Vec<String> =
                    f.trim_start_matches('-').split(['-', '_']).map(str::to_ascii_uppercase).collect();
                let last = words.last().unwrap();
                let named = ["TOKEN", "SECRET", "PASSWORD", "PASSWD"].iter().any(|w| last.ends_with(w))
                    || (last == "KEY" && words.len() > 1);
                assert!(!named || facts.secret_flag(&f).is_some(), "{e:?}: {f} takes a secret and is not in the table");
            }
        }
    }
}

/// The methods vLLM 0.32 itself lists when it refuses an unknown one (a real start's pydantic
/// error): the table has each of its methods but two that do not draft from a model specd can
/// check (`custom_class` names a Python class, `extract_hidden_states` does not draft), and none
/// other.
#[test]
fn vllm_methods_are_those_the_real_vllm_accepts() {
    let log = read("vllm", "real/start-unknown-method.log");
    let line = log.lines().find(|l| l.trim_start().starts_with("Input should be '")).expect("the pydantic error");
    let list = line.trim_start().trim_start_matches("Input should be ").split(" [type=").next().unwrap();
    let accepted: Vec<&str> = list
        .split(", ")
        .flat_map(|x| x.split(" or "))
        .map(|x| x.trim_matches('\''))
        .filter(|x| !x.is_empty())
        .collect();
    assert!(accepted.len() > 30, "{accepted:?}");
    let table = engine_facts(Engine::Vllm).algorithm_names();
    for a in &table {
        assert!(accepted.contains(a), "vLLM 0.32 refuses method {a}");
    }
    let left: Vec<&&str> = accepted.iter().filter(|a| !table.contains(a)).collect();
    assert_eq!(left, [&"custom_class", &"extract_hidden_states"]);
}

/// What specd expects a vLLM to log of its args (`non-default args: {…}`), against the line a
/// real vLLM logged for the same command line: all match, a default-valued arg (port 8000)
/// absent from the line included; a spec that differs in one field differs there only.
#[test]
fn vllm_logs_the_args_specd_expects() {
    let log = read("vllm", "real/start-ngram.log");
    let marker = match engine_facts(Engine::Vllm).args_report {
        specd_spec::ArgsReport::LogLine(m) => m,
        other => panic!("{other:?}"),
    };
    let said = log.lines().find_map(|l| l.split_once(marker)).expect("the args line").1;
    let report = specd_spec::pyrepr::parse(said).unwrap();
    assert!(report.get("port").is_none(), "the default port is not logged: {report}");
    let spec = |steps: u32| {
        let text = format!(
            "apiVersion: specd/v1\nkind: InferenceService\nmetadata: {{name: t}}\nspec:\n  unit: t.service\n  engine: vllm\n  model: /srv/models/smollm2-135m-hf-0.1.2\n  server: {{host: 127.0.0.1, port: 8000, context_length: 2048}}\n  speculative: {{algorithm: ngram, num_steps: {steps}, prompt_lookup_max: 3, prompt_lookup_min: 1}}\n"
        );
        specd_spec::parse("t.yaml", &text).unwrap().resolve(None).unwrap()
    };
    let differ = |s: &specd_spec::Spec| -> Vec<&str> {
        s.expected_server_args()
            .iter()
            .filter(|e| report.pointer(e.key).unwrap_or(&e.absent) != &e.value)
            .map(|e| e.key)
            .collect()
    };
    let same = spec(4);
    assert_eq!(same.expected_server_args().len(), engine_facts(Engine::Vllm).reported.len());
    assert_eq!(differ(&same), Vec::<&str>::new());
    assert_eq!(differ(&spec(3)), ["/speculative_config/num_speculative_tokens"]);
    // Every args line of the real failing starts reads too.
    for f in ["start-missing-draft.log", "start-draft-no-config.log", "start-bad-num-speculative-tokens.log"] {
        let log = read("vllm", &format!("real/{f}"));
        let said = log.lines().find_map(|l| l.split_once(marker)).expect("the args line").1;
        let r = specd_spec::pyrepr::parse(said).unwrap();
        assert!(r.pointer("/speculative_config/method").is_some(), "{f}: {r}");
    }
}

/// A whole start recorded from a real engine (`startup/startup-NAME.log`): each line with the
/// µs since the launch it arrived at.
fn timed_start(engine: &str, name: &str) -> Vec<(u64, String)> {
    read(engine, &format!("startup/startup-{name}.log"))
        .lines()
        .map(|l| {
            let (t, line) = l.trim_start().split_once(' ').unwrap_or_else(|| panic!("not `seconds line`: {l:?}"));
            ((t.parse::<f64>().unwrap() * 1e6).round() as u64, line.to_string())
        })
        .collect()
}

/// The starts of the real vLLM (eager and compiled) and llama-server (with and without a draft),
/// read by the table: every phase told in order, the ready line found just before the first
/// /health 200, and the phases adding up to within 10 % of the start as measured from the
/// launch to that 200 (the time before the process's first line is the `process` phase's).
#[test]
fn the_real_engines_starts_read_as_their_phases() {
    use specd_spec::startup::timeline;
    let cases = [
        (Engine::Vllm, "eager", ["process", "weights", "engine", "api"]),
        (Engine::Vllm, "compile", ["process", "weights", "engine", "api"]),
        (Engine::LlamaCpp, "default", ["process", "weights", "warmup", "api"]),
        (Engine::LlamaCpp, "draft", ["process", "weights", "warmup", "api"]),
    ];
    for (engine, name, want) in cases {
        let lines = timed_start(dir(engine), name);
        let measured = json(dir(engine), "startup/startup.json")[name]["ready_seconds"].as_f64().unwrap();
        let t = timeline(&engine_facts(engine).startup, 0, lines.iter().map(|(t, l)| (*t, l.as_str())));
        let phases = t.phases(None);
        let names: Vec<&str> = phases.iter().map(|p| p.0).collect();
        assert_eq!(names, want, "{engine:?} {name}");
        let ready = t.ready_us.unwrap_or_else(|| panic!("{engine:?} {name}: no ready line")) as f64 / 1e6;
        assert!(
            ready <= measured && measured - ready < 0.1,
            "{engine:?} {name}: ready line at {ready} s, 200 at {measured} s"
        );
        let sum = phases.iter().map(|p| p.1).sum::<u64>() as f64 / 1e6;
        assert!(
            (sum - measured).abs() <= 0.1 * measured,
            "{engine:?} {name}: phases {phases:?} add up to {sum} s of {measured} s"
        );
        assert!(phases.iter().all(|p| p.1 > 0), "{engine:?} {name}: a phase told took no time: {phases:?}");
    }
    // The draft's weights come after the model's warm-up: its span is the weights phase's too.
    let draft = timed_start("llama-cpp", "draft");
    let t = timeline(&engine_facts(Engine::LlamaCpp).startup, 0, draft.iter().map(|(t, l)| (*t, l.as_str())));
    let spans: Vec<&str> = t.spans.iter().map(|s| s.phase).collect();
    assert_eq!(spans, ["process", "weights", "warmup", "weights", "api"]);
}

/// Every text the table reads a start by is one the engine says: in a recorded start, or where
/// its source logs it (vLLM's GPU-only lines; SGLang's, which runs only on a GPU; uvicorn's).
#[test]
fn the_startup_markers_are_the_engines_own_lines() {
    let said = |engine: Engine| -> String {
        let mut text = String::new();
        match engine {
            Engine::Vllm => {
                for f in ["startup/startup-eager.log", "startup/startup-compile.log", "startup/source-lines.txt"] {
                    text += &read("vllm", f);
                }
            }
            Engine::LlamaCpp => {
                for f in ["startup/startup-default.log", "startup/startup-draft.log"] {
                    text += &read("llama-cpp", f);
                }
            }
            Engine::Sglang => {
                text += &read("sglang", "startup_lines.txt");
                // uvicorn's own line, as the uvicorn in vLLM's install writes it.
                text += &read("vllm", "startup/source-lines.txt");
            }
        }
        text
    };
    for e in [Engine::Sglang, Engine::Vllm, Engine::LlamaCpp] {
        let text = said(e);
        let log = &engine_facts(e).startup;
        let markers = log.phases.iter().flat_map(|p| p.markers.iter()).chain([&log.ready]);
        for m in markers {
            assert!(text.contains(m), "{e:?}: no line of the real engine says {m:?}");
        }
        for p in log.phases {
            assert!(
                specd_spec::startup::PHASES.iter().any(|(n, _)| *n == p.phase),
                "{e:?}: {} is not a phase",
                p.phase
            );
        }
    }
}
