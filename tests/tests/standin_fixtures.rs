//! The stand-in against the real engines: every field it reports exists in the
//! real engine's reply (same name, type, nesting), every metric it exports is
//! one of the engine's (same type), every flag it accepts is a real flag, and
//! the defaults it fills in are the real defaults. The real side is
//! `tests/fixtures/engines/<engine>/` (see `FACTS.md` there).
//!
//! A test that passes against the stand-in must not fail against the real
//! engine because the stand-in invented a field, a metric or a flag.

use serde_json::{Value, json};
use specd_e2e::shape::{self, Metric, ServerArgs};
use specd_e2e::standin::args::{self, F, LLAMA_FLAGS, LLAMA_REMOVED, SGLANG_FLAGS, VLLM_FLAGS};
use specd_e2e::{Reaped, bin_path, free_port, http, wait_for};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

fn fixtures(engine: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/engines").join(engine)
}

fn read_text(engine: &str, file: &str) -> String {
    let p = fixtures(engine).join(file);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("read the fixture {}: {e}", p.display()))
}

fn read_json(engine: &str, file: &str) -> Value {
    serde_json::from_str(&read_text(engine, file)).unwrap_or_else(|e| panic!("parse the fixture {engine}/{file}: {e}"))
}

/// Starts the stand-in with a short load and fast tokens; returns it once
/// `ready` answers 200.
fn start(argv: &[&str], port: u16, ready: &str) -> Reaped {
    let mut c = Command::new(bin_path("specd-standin"));
    c.args(argv).args(["--port", &port.to_string()]).stdout(Stdio::null()).stderr(Stdio::null());
    c.env("SPECD_STANDIN_LOAD_MS", "50")
        .env("SPECD_STANDIN_WARMUP_MS", "20")
        .env("SPECD_STANDIN_TOKENS_PER_SEC", "2000");
    let p = Reaped(c.spawn().expect("spawn specd-standin"));
    wait_for(&format!("{} {ready} 200", argv[0]), Duration::from_secs(20), || {
        http(port, "GET", ready, None, Duration::from_secs(5)).filter(|(c, _)| *c == 200)
    })
    .unwrap();
    p
}

/// One exchange that must answer `200`; the body.
fn call(port: u16, method: &str, path: &str, body: Option<&Value>) -> String {
    let body = body.map(Value::to_string);
    let (code, text) = http(port, method, path, body.as_deref(), Duration::from_secs(20))
        .unwrap_or_else(|| panic!("{method} {path}: no answer"));
    assert_eq!(code, 200, "{method} {path}: {text}");
    text
}

fn json_of(what: &str, text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{what} is not JSON ({e}): {text}"))
}

/// The JSON objects of an SSE body (`data: {...}` lines), and whether it
/// ended with `data: [DONE]`.
fn sse_chunks(what: &str, body: &str) -> (Vec<Value>, bool) {
    let mut chunks = Vec::new();
    let mut done = false;
    for data in body.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if data.trim() == "[DONE]" {
            done = true;
        } else {
            chunks.push(json_of(what, data));
        }
    }
    (chunks, done)
}

/// Collects disagreements under a heading; the test fails once, listing all.
#[derive(Default)]
struct Findings(Vec<String>);

impl Findings {
    fn add(&mut self, what: &str, errs: Vec<String>) {
        self.0.extend(errs.into_iter().map(|e| format!("{what}: {e}")));
    }

    fn shape(&mut self, what: &str, reply: &Value, shape: &Value, sa: Option<&ServerArgs>) {
        self.add(what, shape::check(reply, shape, sa));
    }

    /// An empty-bodied status endpoint (`{"status": "200|503", "body": "empty"}`).
    fn status_only(&mut self, what: &str, (code, body): (u16, String), shape: &Value) {
        let allowed: Vec<&str> = shape["status"].as_str().unwrap_or_default().split('|').collect();
        if !allowed.contains(&code.to_string().as_str()) {
            self.0.push(format!("{what}: status {code}, the real engine answers {allowed:?}"));
        }
        if shape["body"] == "empty" && !body.is_empty() {
            self.0.push(format!("{what}: body {body:?}, the real engine's is empty"));
        }
    }

    fn assert_none(self) {
        assert!(self.0.is_empty(), "the stand-in disagrees with the real engine:\n  {}", self.0.join("\n  "));
    }
}

/// Every flag of `table` is one of the real engine's flags (`args.json`); the
/// defaults the stand-in fills in (`defaults`, by key) are the recorded
/// literal defaults: the field's default where the engine reports its config
/// fields (`field_defaults`, SGLang's `ServerArgs`), else the default of the
/// flag that sets that key.
fn check_cli(
    f: &mut Findings,
    engine: &str,
    table: &[F],
    defaults: &serde_json::Map<String, Value>,
    field_defaults: &BTreeMap<String, Value>,
) {
    let real = read_json(engine, "args.json");
    let real = real.as_array().expect("args.json is a list");
    let entry_of =
        |flag: &str| real.iter().find(|e| e["flags"].as_array().is_some_and(|fs| fs.iter().any(|x| x == flag)));
    for d in table {
        for n in d.names {
            match entry_of(n) {
                None => f.0.push(format!("{engine} flag {n} (for {}) is not a flag of the real engine", d.key)),
                Some(e) if e["removed"] == true => {
                    f.0.push(format!("{engine} flag {n} (for {}) has been removed from the real engine", d.key))
                }
                Some(_) => {}
            }
        }
    }
    for (key, mine) in defaults {
        let Some(d) = table.iter().find(|d| d.key == key) else {
            f.0.push(format!("{engine}: the stand-in fills in {key} = {mine}, set by none of its flags"));
            continue;
        };
        let Some(e) = d.names.iter().find_map(|n| entry_of(n)) else { continue };
        let real_default = field_defaults.get(key).unwrap_or(&e["default"]);
        if real_default.get("expr").is_some() {
            continue; // computed by the engine, not a literal
        }
        if engine == "llama-cpp" && real_default.is_null() {
            continue; // the --help text names no default
        }
        if !same_default(mine, real_default) {
            f.0.push(format!(
                "{engine} {key} ({}): the stand-in's default is {mine}, the real engine's {real_default}",
                d.names[0]
            ));
        }
    }
}

/// argparse defaults compare as JSON; llama.cpp's are the `--help` text
/// (`"8080"`, `"0.75"`, `"0, 0 = loaded from model"`), compared by the value before any
/// explanation.
fn same_default(mine: &Value, real: &Value) -> bool {
    match (mine, real) {
        (_, Value::String(s)) if !mine.is_string() => {
            let s = s.split(", ").next().unwrap_or(s);
            s.trim().parse::<f64>().ok().zip(mine.as_f64()).is_some_and(|(a, b)| a == b)
                || (mine.is_null() && s.is_empty())
        }
        _ => mine == real,
    }
}

/// The families of a `metrics.txt` table or of a recorded `/metrics` body.
fn real_metrics(engine: &str) -> BTreeMap<String, Metric> {
    let text = read_text(engine, "metrics.txt");
    if text.lines().any(|l| l.starts_with("# TYPE ")) {
        shape::exposition_families(&text).unwrap_or_else(|e| panic!("{engine}/metrics.txt: {e}"))
    } else {
        shape::metrics_table(&text)
    }
}

#[test]
fn sglang_replies_have_the_real_shapes() {
    let sa = ServerArgs::from_fields(&read_json("sglang", "server_args.fields.json"));
    let info_shape = read_json("sglang", "get_server_info.shape.json");
    let gen_shape = read_json("sglang", "generate.shape.json");
    // A streamed chunk is the same out_dict; until the request finishes its
    // meta_info.finish_reason is `recv_obj.finished_reasons[i]`, i.e. None.
    let mut chunk_shape = gen_shape.clone();
    chunk_shape["meta_info"]["finish_reason"]["_nullable"] = json!(true);
    let v1_shape = read_json("sglang", "v1_completions.shape.json");
    let health = read_json("sglang", "health.shape.json");
    let metrics = real_metrics("sglang");
    let mut f = Findings::default();
    for spec in [false, true] {
        let port = free_port();
        let mut argv = vec!["sglang", "--model-path", "/models/q", "--enable-metrics"];
        if spec {
            argv.extend([
                "--speculative-algorithm",
                "NEXTN",
                "--speculative-num-steps",
                "3",
                "--speculative-eagle-topk",
                "1",
                "--speculative-num-draft-tokens",
                "4",
            ]);
        }
        let _p = start(&argv, port, "/health_generate");
        let tag = if spec { "sglang (speculative)" } else { "sglang" };
        for path in ["/health", "/health_generate", "/ready"] {
            let got = http(port, "GET", path, None, Duration::from_secs(5)).expect("an answer");
            f.status_only(&format!("{tag} GET {path}"), got, &health[format!("GET {path}")]);
        }

        let req = json!({"text": "The capital of France is", "sampling_params": {"max_new_tokens": 12}});
        let g = json_of("/generate", &call(port, "POST", "/generate", Some(&req)));
        f.shape(&format!("{tag} POST /generate"), &g, &gen_shape, None);
        assert_eq!(
            g["meta_info"].get("spec_verify_ct").is_some(),
            spec,
            "{tag}: meta_info.spec_verify_ct is present exactly when speculating: {g}"
        );
        let mut sreq = req.clone();
        sreq["stream"] = json!(true);
        let (chunks, done) = sse_chunks("/generate chunk", &call(port, "POST", "/generate", Some(&sreq)));
        assert!(done && !chunks.is_empty(), "{tag}: a stream of chunks ending in [DONE]");
        let last = chunks.len() - 1;
        for (i, c) in chunks.iter().enumerate() {
            let s = if i == last { &gen_shape } else { &chunk_shape };
            f.shape(&format!("{tag} POST /generate stream chunk {i}"), c, s, None);
        }

        for path in ["/get_server_info", "/server_info"] {
            let info = json_of(path, &call(port, "GET", path, None));
            f.shape(&format!("{tag} GET {path}"), &info, &info_shape, Some(&sa));
        }

        let v1 = json!({"model": "/models/q", "prompt": "The capital of France is", "max_tokens": 8});
        let c = json_of("/v1/completions", &call(port, "POST", "/v1/completions", Some(&v1)));
        f.shape(&format!("{tag} POST /v1/completions"), &c, &v1_shape, None);

        let body = call(port, "GET", "/metrics", None);
        f.add(&format!("{tag} GET /metrics"), shape::check_metrics(&body, &metrics));
    }
    f.assert_none();
}

#[test]
fn vllm_replies_have_the_real_shapes() {
    let v1_shape = read_json("vllm", "v1_completions.shape.json");
    let health = read_json("vllm", "health.shape.json");
    let metrics = real_metrics("vllm");
    let mut f = Findings::default();
    for spec in [false, true] {
        let port = free_port();
        let mut argv = vec!["vllm", "serve", "/models/q"];
        if spec {
            argv.extend(["--speculative-config", r#"{"method":"ngram","num_speculative_tokens":3}"#]);
        }
        let _p = start(&argv, port, "/health");
        let tag = if spec { "vllm (speculative)" } else { "vllm" };
        let got = http(port, "GET", "/health", None, Duration::from_secs(5)).expect("an answer");
        f.status_only(&format!("{tag} GET /health"), got, &health["GET /health"]);

        let v1 = json!({"model": "/models/q", "prompt": "The capital of France is", "max_tokens": 8});
        let c = json_of("/v1/completions", &call(port, "POST", "/v1/completions", Some(&v1)));
        f.shape(&format!("{tag} POST /v1/completions"), &c, &v1_shape, None);

        let body = call(port, "GET", "/metrics", None);
        f.add(&format!("{tag} GET /metrics"), shape::check_metrics(&body, &metrics));
        assert_eq!(
            body.contains("vllm:spec_decode_num_drafts_total"),
            spec,
            "{tag}: the spec_decode counters exist exactly when speculating:\n{body}"
        );
    }
    f.assert_none();
}

#[test]
fn sglang_cli_is_the_real_cli() {
    let mut f = Findings::default();
    // /get_server_info reports the ServerArgs fields: an unset flag shows the
    // field's default (a deprecated switch's argparse default is None).
    let fields = read_json("sglang", "server_args.fields.json");
    let field_defaults: BTreeMap<String, Value> = fields
        .as_array()
        .expect("server_args.fields.json is a list")
        .iter()
        .filter_map(|x| Some((x["name"].as_str()?.to_string(), x["default"].clone())))
        .collect();
    check_cli(&mut f, "sglang", SGLANG_FLAGS, &args::sglang_defaults(), &field_defaults);
    f.assert_none();
}

#[test]
fn vllm_cli_is_the_real_cli() {
    let mut f = Findings::default();
    // What the stand-in fills in for a bare `vllm serve MODEL`, but the
    // positional model.
    let l = args::parse(&["vllm".into(), "serve".into(), "/m".into()], &BTreeMap::new()).expect("a valid command line");
    let mut defaults = l.args.clone();
    defaults.remove("model");
    check_cli(&mut f, "vllm", VLLM_FLAGS, &defaults, &BTreeMap::new());
    f.assert_none();
}

/// llama.cpp's fixtures are real replies (`props.json`, ...) recorded from a
/// real `llama-server`: their shapes are derived from the JSON.
#[test]
fn llama_cpp_replies_and_cli_are_the_real_ones() {
    let dir = fixtures("llama-cpp");
    let needed = [
        "args.json",
        "health.json",
        "props.json",
        "slots.json",
        "completion.json",
        "v1_completions.json",
        "metrics.txt",
    ];
    let missing: Vec<&str> = needed.iter().copied().filter(|n| !dir.join(n).is_file()).collect();
    assert!(
        missing.is_empty(),
        "the real llama-server's recorded replies are missing from {}: {missing:?} (record them with scripts/record_llama_server.py)",
        dir.display()
    );
    let real = |name: &str| read_json("llama-cpp", name);
    // The run without --spec-type, where recorded; else the speculative one.
    let real_nospec = |name: &str| {
        let n = name.replace(".json", ".nospec.json");
        if dir.join(&n).is_file() { real(&n) } else { real(name) }
    };
    let metrics = real_metrics("llama-cpp");
    let mut f = Findings::default();

    let l = args::parse(&["llama-cpp".into(), "-m".into(), "/m.gguf".into()], &BTreeMap::new()).expect("valid");
    let mut defaults = l.args.clone();
    defaults.remove("model_path");
    check_cli(&mut f, "llama-cpp", LLAMA_FLAGS, &defaults, &BTreeMap::new());
    let cli = real("args.json");
    for (names, _) in LLAMA_REMOVED {
        for n in *names {
            let e = cli
                .as_array()
                .into_iter()
                .flatten()
                .find(|e| e["flags"].as_array().is_some_and(|fs| fs.iter().any(|x| x == n)));
            if e.is_none_or(|e| e["removed"] != true) {
                f.0.push(format!("llama-cpp flag {n}: the stand-in refuses it as removed, the real engine does not"));
            }
        }
    }

    for spec in [false, true] {
        let port = free_port();
        let mut argv =
            vec!["llama-cpp", "-m", "/m.gguf", "--spec-draft-model", "/d.gguf", "-np", "2", "-c", "2048", "--metrics"];
        if spec {
            argv.extend(["--spec-type", "draft-simple", "--spec-draft-n-max", "4"]);
        }
        let _p = start(&argv, port, "/health");
        let tag = if spec { "llama-cpp (speculative)" } else { "llama-cpp" };
        let pick = |name: &str| if spec { real(name) } else { real_nospec(name) };
        let h = json_of("/health", &call(port, "GET", "/health", None));
        f.shape(&format!("{tag} GET /health"), &h, &shape::shape_of(&real("health.json")), None);
        for path in ["/props", "/slots"] {
            let got = json_of(path, &call(port, "GET", path, None));
            let want = shape::shape_of(&pick(&format!("{}.json", &path[1..])));
            f.shape(&format!("{tag} GET {path}"), &got, &want, None);
        }
        let req = json!({"prompt": "The capital of France is", "n_predict": 12, "temperature": 0});
        let c = json_of("/completion", &call(port, "POST", "/completion", Some(&req)));
        f.shape(&format!("{tag} POST /completion"), &c, &shape::shape_of(&pick("completion.json")), None);
        assert_eq!(
            c["timings"].get("draft_n").is_some(),
            spec,
            "{tag}: timings.draft_n is present exactly when drafting: {c}"
        );
        let v1 = json!({"model": "m", "prompt": "The capital of France is", "max_tokens": 8});
        let c = json_of("/v1/completions", &call(port, "POST", "/v1/completions", Some(&v1)));
        f.shape(&format!("{tag} POST /v1/completions"), &c, &shape::shape_of(&real("v1_completions.json")), None);
        let body = call(port, "GET", "/metrics", None);
        f.add(&format!("{tag} GET /metrics"), shape::check_metrics(&body, &metrics));
    }
    let mut seen = BTreeSet::new();
    f.0.retain(|e| seen.insert(e.clone()));
    f.assert_none();
}
