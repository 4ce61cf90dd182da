//! The stand-in against the real engines: every field it reports exists in the
//! real engine's reply (same name, type, nesting), every metric it exports is
//! one of the engine's (same type), every flag it accepts is a real flag, and
//! the defaults it fills in are the real defaults, and (vLLM) the log lines specd reads are the
//! real ones. The real side is `tests/fixtures/engines/<engine>/` (see `FACTS.md` there); vLLM's
//! is `vllm/real/`, recorded from a real vLLM.
//!
//! A test that passes against the stand-in must not fail against the real
//! engine because the stand-in invented a field, a metric or a flag.

use serde_json::{Value, json};
use specd_e2e::shape::{self, Metric, ServerArgs};
use specd_e2e::standin::args::{self, F, LLAMA_FLAGS, LLAMA_REMOVED, SGLANG_FLAGS};
use specd_e2e::standin::py::Py;
use specd_e2e::standin::vllm;
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

/// vLLM's side is real: `vllm/real/`, recorded from a real vLLM 0.32 (see its README).
fn real_vllm(file: &str) -> Value {
    read_json("vllm", &format!("real/{file}"))
}

fn real_vllm_text(file: &str) -> String {
    read_text("vllm", &format!("real/{file}"))
}

/// The shape of the real replies recorded in `files`, merged.
fn real_vllm_shape(files: &[&str]) -> Value {
    let mut shapes = files.iter().map(|f| shape::shape_of(&real_vllm(f)));
    let first = shapes.next().expect("a file");
    shapes.fold(first, |a, b| shape::merge_shapes(&a, &b))
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

/// `vllm:spec_decode_*` families of an exposition.
fn spec_decode_families(body: &str) -> BTreeSet<String> {
    shape::exposition_families(body)
        .unwrap_or_else(|e| panic!("{e}"))
        .into_keys()
        .filter(|k| k.starts_with("vllm:spec_decode_"))
        .collect()
}

#[test]
fn vllm_replies_have_the_real_shapes() {
    let health = real_vllm("health.json");
    let types = real_vllm("content-types.json");
    let models_shape = real_vllm_shape(&["v1_models.json", "v1_models.plain.json"]);
    let completion_shape = real_vllm_shape(&["v1_completions.json", "v1_completions.plain.json"]);
    let (real_chunks, done) = sse_chunks("the real stream", &real_vllm_text("v1_completions.stream.txt"));
    assert!(done && real_chunks.len() > 1, "the real stream's chunks and [DONE]");
    let chunk_shape = shape::shape_of(&real_chunks[0]);
    let last_chunk_shape = shape::shape_of(real_chunks.last().expect("chunks"));
    let mut f = Findings::default();
    for spec in [false, true] {
        let real_metrics_text = real_vllm_text(if spec { "metrics.ngram.txt" } else { "metrics.plain.txt" });
        let metrics = shape::exposition_families(&real_metrics_text).unwrap();
        let real_labels = shape::exposition_label_sets(&real_metrics_text).unwrap();
        let port = free_port();
        let mut argv = vec!["vllm", "serve", "/models/q", "--served-model-name", "q", "q2"];
        if spec {
            argv.extend(["--speculative-config", r#"{"method":"ngram","num_speculative_tokens":3}"#]);
        }
        let _p = start(&argv, port, "/health");
        let tag = if spec { "vllm (speculative)" } else { "vllm" };
        let get = |method: &str, path: &str, body: Option<&Value>| {
            let body = body.map(Value::to_string);
            specd_e2e::http_with_headers(port, method, path, body.as_deref(), Duration::from_secs(20))
                .unwrap_or_else(|| panic!("{method} {path}: no answer"))
        };
        let content_type = |f: &mut Findings, what: &str, headers: &[(String, String)]| {
            let real = types[what]["content-type"].as_str();
            if header(headers, "content-type") != real {
                f.0.push(format!(
                    "{tag} {what}: Content-Type {:?}, the real one {real:?}",
                    header(headers, "content-type")
                ));
            }
        };

        let (code, headers, body) = get("GET", "/health", None);
        if json!(code) != health["_status"] || json!(body) != health["_body"] {
            f.0.push(format!(
                "{tag} GET /health: {code} {body:?}, the real one {} {}",
                health["_status"], health["_body"]
            ));
        }
        content_type(&mut f, "GET /health", &headers);

        let (_, headers, body) = get("GET", "/version", None);
        assert_eq!(json_of("/version", &body), real_vllm("version.json"), "{tag}: the version is the real one's");
        content_type(&mut f, "GET /version", &headers);

        let (_, headers, body) = get("GET", "/v1/models", None);
        let models = json_of("/v1/models", &body);
        f.shape(&format!("{tag} GET /v1/models"), &models, &models_shape, None);
        let ids: Vec<&str> = models["data"].as_array().into_iter().flatten().filter_map(|m| m["id"].as_str()).collect();
        assert_eq!(ids, ["q", "q2"], "{tag}: one model per served name, as the real one answers");
        content_type(&mut f, "GET /v1/models", &headers);

        let v1 = json!({"model": "q", "prompt": "The capital of France is", "max_tokens": 8});
        let (_, headers, body) = get("POST", "/v1/completions", Some(&v1));
        f.shape(&format!("{tag} POST /v1/completions"), &json_of("/v1/completions", &body), &completion_shape, None);
        content_type(&mut f, "POST /v1/completions", &headers);
        let mut sv1 = v1.clone();
        sv1["stream"] = json!(true);
        let (_, headers, body) = get("POST", "/v1/completions", Some(&sv1));
        let (chunks, done) = sse_chunks("/v1/completions chunk", &body);
        assert!(done && !chunks.is_empty(), "{tag}: a stream of chunks ending in [DONE]");
        for (i, c) in chunks.iter().enumerate() {
            let s = if i == chunks.len() - 1 { &last_chunk_shape } else { &chunk_shape };
            f.shape(&format!("{tag} POST /v1/completions stream chunk {i}"), c, s, None);
        }
        content_type(&mut f, "POST /v1/completions (stream)", &headers);

        let (_, headers, body) = get("GET", "/metrics", None);
        f.add(&format!("{tag} GET /metrics"), shape::check_metrics(&body, &metrics));
        for (sample, sets) in shape::exposition_label_sets(&body).unwrap() {
            for set in sets.iter().filter(|s| !real_labels.get(&sample).is_some_and(|r| r.contains(*s))) {
                f.0.push(format!(
                    "{tag} GET /metrics: {sample} with labels {set:?}, the real one has {:?}",
                    real_labels.get(&sample)
                ));
            }
        }
        content_type(&mut f, "GET /metrics", &headers);
        // The spec_decode counters, the per-position one included, exactly when speculating.
        assert_eq!(spec_decode_families(&body), spec_decode_families(&real_metrics_text), "{tag}:\n{body}");
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

/// The real parser's `type` (`args.json`) of each kind of value the stand-in converts.
fn vllm_type(k: vllm::Kind) -> (Option<&'static str>, Value) {
    match k {
        vllm::Kind::Str => (Some("str"), Value::Null),
        vllm::Kind::OptStr => (Some("optional_type(str)"), Value::Null),
        vllm::Kind::OptStrList => (Some("optional_type(str)"), json!("+")),
        vllm::Kind::Int => (Some("int"), Value::Null),
        vllm::Kind::Float => (Some("float"), Value::Null),
        vllm::Kind::HumanInt => (Some("human_readable_int"), Value::Null),
        vllm::Kind::HumanIntOrAuto => (Some("human_readable_int_or_auto"), Value::Null),
        vllm::Kind::Json => (Some("optional_type(json.loads)"), Value::Null),
        vllm::Kind::BoolOpt => (None, json!(0)),
    }
}

/// Every option the stand-in's vLLM accepts is the real parser's, with the real dest, spellings,
/// value type, default and choices, and its dests come in the real namespace's order (the order
/// of the `non-default args` line).
#[test]
fn vllm_cli_is_the_real_cli() {
    let real = real_vllm("args.json");
    let real = real.as_array().expect("args.json is a list");
    let mut f = Findings::default();
    assert_eq!(real[0]["dest"], vllm::MODEL_TAG, "the positional model comes first");
    let mut last = 0;
    for flag in vllm::FLAGS {
        let Some((at, e)) = real.iter().enumerate().find(|(_, e)| e["dest"] == flag.dest) else {
            f.0.push(format!("vllm: dest {} is not the real parser's", flag.dest));
            continue;
        };
        if at <= last {
            f.0.push(format!("vllm: {} is at {at} in the real namespace, after {last}", flag.dest));
        }
        last = at;
        let flags: Vec<&str> = e["flags"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
        if flags != flag.names {
            f.0.push(format!("vllm {}: spellings {:?}, the real ones {flags:?}", flag.dest, flag.names));
        }
        let (ty, nargs) = vllm_type(flag.kind);
        let real_ty = e["type"].as_str();
        let action_ok = (flag.kind == vllm::Kind::BoolOpt) == (e["action"] == "BooleanOptionalAction");
        if real_ty != ty || e["nargs"] != nargs || !action_ok {
            f.0.push(format!(
                "vllm {}: converted as {:?}, the real type {real_ty:?} nargs {} action {}",
                flag.dest, flag.kind, e["nargs"], e["action"]
            ));
        }
        let default = Py::from_json(&e["default"].to_string()).unwrap();
        if e["default"].get("repr").is_some() || !flag.default.py().py_eq(&default) {
            f.0.push(format!("vllm {}: default {:?}, the real {}", flag.dest, flag.default, e["default_repr"]));
        }
        let choices: Vec<&str> = e["choices"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
        if choices != flag.choices {
            f.0.push(format!("vllm {}: choices {:?}, the real {choices:?}", flag.dest, flag.choices));
        }
    }
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

/// The message of the first line of `log` logged at `at` (`api_utils.py:286`), after its header;
/// the header checked to be vLLM's: `(PROCESS pid=N) LEVEL MM-DD HH:MM:SS [file.py:line] `.
fn logged(log: &str, at: &str) -> Option<String> {
    let mark = format!(" [{at}] ");
    let line = log.lines().find(|l| l.contains(&mark))?;
    let (head, msg) = line.split_once(&mark)?;
    let (who, rest) = head.split_once(") ")?;
    let (process, pid) = who.strip_prefix('(')?.split_once(" pid=")?;
    let mut w = rest.split(' ');
    let (level, date, time) = (w.next()?, w.next()?, w.next()?);
    let digits = |s: &str, seps: &[usize]| {
        s.char_indices().all(|(i, c)| if seps.contains(&i) { !c.is_ascii_digit() } else { c.is_ascii_digit() })
    };
    let well_formed = ["APIServer", "EngineCore"].contains(&process)
        && pid.parse::<u32>().is_ok()
        && ["INFO", "WARNING", "ERROR"].contains(&level)
        && date.len() == 5
        && digits(date, &[2])
        && time.len() == 8
        && digits(time, &[2, 5])
        && w.next().is_none();
    assert!(well_formed, "not vLLM's log header: {line:?}");
    Some(msg.to_string())
}

/// The top-level `key=value` fields of the engine-config line (a comma inside brackets or quotes
/// is the value's).
fn config_fields(msg: &str) -> Vec<(String, String)> {
    let body = msg.split_once(" with config: ").map(|x| x.1).unwrap_or(msg);
    let (mut depth, mut quote, mut start) = (0i32, None, 0);
    let mut parts = Vec::new();
    let b = body.as_bytes();
    for i in 0..b.len() {
        match (quote, b[i]) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), _) => {}
            (None, c @ (b'\'' | b'"')) => quote = Some(c),
            (None, b'(' | b'[' | b'{') => depth += 1,
            (None, b')' | b']' | b'}') => depth -= 1,
            (None, b',') if depth == 0 && b.get(i + 1) == Some(&b' ') => {
                parts.push(&body[start..i]);
                start = i + 2;
            }
            _ => {}
        }
    }
    parts.push(&body[start..]);
    parts.iter().map(|p| p.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())).unwrap_or_default()).collect()
}

/// A recorded argv for the stand-in: `vllm` for the real program, another port.
fn standin_argv(real: &Value, port: u16) -> Vec<String> {
    let mut argv: Vec<String> = real.as_array().unwrap().iter().map(|a| a.as_str().unwrap().to_string()).collect();
    argv[0] = "vllm".into();
    let i = argv.iter().position(|a| a == "--port").expect("--port") + 1;
    argv[i] = port.to_string();
    argv
}

/// The real `non-default args` message for the recorded `argv` had it used `port`: vLLM names the
/// port only when it is not 8000, right after the host.
fn with_port(real_msg: &str, argv: &Value, port: u16) -> String {
    let a: Vec<&str> = argv.as_array().unwrap().iter().filter_map(Value::as_str).collect();
    let recorded = a[a.iter().position(|x| *x == "--port").unwrap() + 1];
    let host = "'host': '127.0.0.1', ";
    assert!(real_msg.contains(host), "{real_msg}");
    if recorded == "8000" {
        real_msg.replacen(host, &format!("{host}'port': {port}, "), 1)
    } else {
        real_msg.replacen(&format!("'port': {recorded}"), &format!("'port': {port}"), 1)
    }
}

/// Runs the stand-in until it has logged `until` or exited; its stderr.
fn run_standin(argv: &[String], env: &[(&str, &str)], until: &str) -> (Reaped, std::path::PathBuf, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("stderr");
    let mut c = Command::new(bin_path("specd-standin"));
    c.args(argv).stdout(Stdio::null()).stderr(std::fs::File::create(&log).unwrap());
    c.env("SPECD_STANDIN_LOAD_MS", "50");
    for (k, v) in env {
        c.env(k, v);
    }
    let mut p = Reaped(c.spawn().expect("spawn specd-standin"));
    wait_for(&format!("the stand-in to log {until:?} or exit"), Duration::from_secs(20), || {
        let said = std::fs::read_to_string(&log).unwrap_or_default();
        (said.contains(until) || p.0.try_wait().unwrap().is_some()).then_some(())
    })
    .unwrap();
    (p, log, dir)
}

/// The stand-in started as vLLM with the command lines of the real starts (with and without a
/// speculative config; a non-default --max-model-len, --port and --host; a default-valued
/// --tensor-parallel-size) logs the real `non-default args` line (the same keys and values in the
/// same order; a default-valued flag absent) and the real engine-config line (the real fields, in
/// the real order and format, with the same values for what specd checks).
#[test]
fn vllm_logs_the_real_config_lines() {
    let platform = ["device_config", "disable_custom_all_reduce"]; // the stand-in plays a CUDA host
    for run in ["ngram", "plain"] {
        let real_log = real_vllm_text(&format!("start-{run}.log"));
        let real_argv = &real_vllm(&format!("{run}.json"))["argv"];
        let port = free_port();
        let argv = standin_argv(real_argv, port);
        let (_p, log, _dir) = run_standin(&argv, &[], "Application startup complete.");
        let said = std::fs::read_to_string(&log).unwrap();

        let real_args = logged(&real_log, "api_utils.py:286").expect("the real non-default args line");
        let mine =
            logged(&said, "api_utils.py:286").unwrap_or_else(|| panic!("{run}: no non-default args line:\n{said}"));
        assert_eq!(mine, with_port(&real_args, real_argv, port), "{run}: {argv:?}");
        assert!(!mine.contains("tensor_parallel_size"), "a default-valued flag is not named: {mine}");

        let real_config = config_fields(&logged(&real_log, "core.py:133").expect("the real engine-config line"));
        let mine = logged(&said, "core.py:133").unwrap_or_else(|| panic!("{run}: no engine-config line:\n{said}"));
        assert!(mine.starts_with("Initializing a V1 LLM engine (v0.32.0) with config: model='"), "{mine}");
        let mine = config_fields(&mine);
        let keys: Vec<&str> = mine.iter().map(|(k, _)| k.as_str()).collect();
        let real_keys: Vec<&str> = real_config.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, real_keys[..keys.len()], "{run}: the real fields in the real order");
        for key in
            ["model", "speculative_config", "max_seq_len", "tensor_parallel_size", "served_model_name", "enforce_eager"]
        {
            assert!(keys.contains(&key), "{run}: {key} is in the line");
        }
        for ((k, v), (_, real)) in mine.iter().zip(&real_config) {
            if !platform.contains(&k.as_str()) {
                assert_eq!(v, real, "{run}: {k}");
            }
        }
    }
    // Without a served name, a speculative config or a --max-model-len: what the model says.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), r#"{"max_position_embeddings": 8192}"#).unwrap();
    let m = dir.path().display().to_string();
    let argv: Vec<String> =
        ["vllm", "serve", &m, "--port", &free_port().to_string()].iter().map(|s| s.to_string()).collect();
    let (_p, log, _d) = run_standin(&argv, &[], "Application startup complete.");
    let said = std::fs::read_to_string(&log).unwrap();
    let config = config_fields(&logged(&said, "core.py:133").unwrap());
    let get = |k: &str| config.iter().find(|(x, _)| x == k).map(|(_, v)| v.clone()).unwrap();
    assert_eq!(
        (get("speculative_config"), get("max_seq_len"), get("served_model_name")),
        ("None".into(), "8192".into(), m)
    );
}

/// The start failures the stand-in simulates end as the real ones did: the exit status, the
/// `non-default args` line, and the refusal or traceback word for word. The stand-in loads no
/// model, so a draft folder that is missing or has no config.json is not among them.
#[test]
fn vllm_start_failures_are_the_real_ones() {
    let not_simulated = ["missing-draft", "draft-no-config"];
    let failures = real_vllm("failures.json");
    let mut checked = Vec::new();
    let address = |s: &str| match s.find("<function loads at 0x") {
        Some(i) => format!("{}<function loads at 0x…>{}", &s[..i], &s[i..].split_once('>').map(|x| x.1).unwrap_or("")),
        None => s.to_string(),
    };
    for (name, case) in failures.as_object().unwrap() {
        if not_simulated.contains(&name.as_str()) {
            continue;
        }
        let real_log = real_vllm_text(&format!("start-{name}.log"));
        let held = (name == "port-in-use").then(|| std::net::TcpListener::bind("127.0.0.1:0").unwrap());
        let port = held.as_ref().map(|l| l.local_addr().unwrap().port()).unwrap_or_else(free_port);
        let argv = standin_argv(&case["argv"], port);
        let (mut p, log, _d) = run_standin(&argv, &[], "\u{0}never");
        let status = p.0.wait().unwrap();
        let said = std::fs::read_to_string(&log).unwrap();
        assert_eq!(json!(status.code()), case["exit_status"], "{name}: the exit status\n{said}");
        if let Some(real) = logged(&real_log, "api_utils.py:286") {
            assert_eq!(logged(&said, "api_utils.py:286"), Some(with_port(&real, &case["argv"], port)), "{name}");
        }
        let tail = |log: &str| {
            let lines: Vec<&str> = log.lines().collect();
            let at =
                lines.iter().position(|l| l.starts_with("Traceback") || l.starts_with("usage:")).unwrap_or(lines.len());
            address(&lines[at..].join("\n"))
        };
        assert_eq!(tail(&said), tail(&real_log), "{name}: what the start ends with");
        assert!(!tail(&said).is_empty(), "{name}: a refusal or traceback");
        checked.push(name.clone());
    }
    assert!(checked.len() >= 10, "{checked:?}");
}

/// The real stats line's form: every number a `9`.
fn form(line: &str) -> String {
    let mut out = String::new();
    for c in line.chars() {
        if c.is_ascii_digit() {
            if !out.ends_with('9') {
                out.push('9');
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The stand-in's `SpecDecoding metrics:` lines are the real line's form and tell the truth: over
/// the lines, the accepted and drafted tokens are those of its spec_decode counters, and each
/// line's mean acceptance length is 1 + accepted / drafts. Its `Engine 000:` lines are the real
/// form (a CUDA host's, "GPU KV cache usage").
#[test]
fn vllm_stats_lines_are_the_real_ones_and_add_up() {
    let real_log = real_vllm_text("start-ngram.log");
    let real_spec = logged(&real_log, "metrics.py:120").expect("the real SpecDecoding line");
    let real_engine = logged(&real_log, "loggers.py:335").expect("the real stats line").replace("CPU KV", "GPU KV");
    let port = free_port();
    let argv: Vec<String> = [
        "vllm",
        "serve",
        "/m",
        "--port",
        &port.to_string(),
        "--speculative-config",
        r#"{"method":"ngram","num_speculative_tokens":4}"#,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let env = [("VLLM_LOG_STATS_INTERVAL", "0.2"), ("SPECD_STANDIN_TOKENS_PER_SEC", "400")];
    let (_p, log, _d) = run_standin(&argv, &env, "Application startup complete.");
    for _ in 0..2 {
        let (c, b) =
            http(port, "POST", "/v1/completions", Some(r#"{"prompt":"a b","max_tokens":40}"#), Duration::from_secs(20))
                .expect("an answer");
        assert_eq!(c, 200, "{b}");
    }
    let counter = |m: &str, name: &str| -> u64 {
        let l = m.lines().find(|l| l.starts_with(&format!("{name}{{"))).unwrap_or_else(|| panic!("{name}:\n{m}"));
        l.rsplit(' ').next().unwrap().parse::<f64>().unwrap() as u64
    };
    let metrics = http(port, "GET", "/metrics", None, Duration::from_secs(5)).unwrap().1;
    let (accepted, drafted) = (
        counter(&metrics, "vllm:spec_decode_num_accepted_tokens_total"),
        counter(&metrics, "vllm:spec_decode_num_draft_tokens_total"),
    );
    assert!(drafted > 0, "{metrics}");
    let number = |line: &str, after: &str| -> f64 {
        let rest = &line[line.find(after).unwrap_or_else(|| panic!("{after} in {line}")) + after.len()..];
        rest.split([' ', ',', '%']).next().unwrap().parse().unwrap()
    };
    let lines = wait_for("SpecDecoding lines adding up to the counters", Duration::from_secs(20), || {
        let said = std::fs::read_to_string(&log).unwrap();
        let lines: Vec<String> = said
            .lines()
            .filter(|l| l.contains(" [metrics.py:120] "))
            .map(|l| logged(l, "metrics.py:120").unwrap())
            .collect();
        let sum = |what: &str| lines.iter().map(|l| number(l, what) as u64).sum::<u64>();
        (sum("Accepted: ") == accepted && sum("Drafted: ") == drafted).then_some((lines, said))
    })
    .unwrap();
    let (spec_lines, said) = lines;
    for l in &spec_lines {
        assert_eq!(form(l), form(&real_spec), "{l}");
        let drafts = number(l, "Drafted: ") / 4.0;
        let mean = 1.0 + number(l, "Accepted: ") / drafts;
        assert!((number(l, "Mean acceptance length: ") - mean).abs() < 0.006, "{l}");
    }
    let engine = logged(&said, "loggers.py:335").expect("an Engine 000 line");
    assert_eq!(form(&engine), form(&real_engine), "{engine}");
}

/// A start recorded from a real engine (`<engine>/startup/startup-NAME.log`): its lines, each
/// without the seconds since the launch it arrived at.
fn real_start(engine: &str, name: &str) -> Vec<String> {
    read_text(engine, &format!("startup/startup-{name}.log"))
        .lines()
        .map(|l| l.trim_start().split_once(' ').map_or("", |x| x.1).to_string())
        .collect()
}

/// Whether `line` is what `format` writes: its literal parts in order, each field (an f-string's
/// `{expr}`, a `%s`/`%d`/`%.2f`) any text.
fn fits(format: &str, line: &str) -> bool {
    let mut literals = Vec::new();
    let (mut rest, mut depth, mut lit) = (format, 0, String::new());
    while let Some(c) = rest.chars().next() {
        rest = &rest[c.len_utf8()..];
        match c {
            '{' => depth += 1,
            '}' if depth > 0 => {
                depth -= 1;
                if depth == 0 {
                    literals.push(std::mem::take(&mut lit));
                }
            }
            '%' if depth == 0 => {
                let n = rest.find(['s', 'd', 'f']).map_or(0, |i| i + 1);
                rest = &rest[n..];
                literals.push(std::mem::take(&mut lit));
            }
            c if depth == 0 => lit.push(c),
            _ => {}
        }
    }
    literals.push(lit);
    let (first, last) = (&literals[0], &literals[literals.len() - 1]);
    if literals.len() == 1 {
        return line == first;
    }
    if !line.starts_with(first.as_str()) || !line.ends_with(last.as_str()) {
        return false;
    }
    let mut at = first.len();
    for l in &literals[1..literals.len() - 1] {
        match line[at..].find(l.as_str()) {
            Some(i) => at += i + l.len(),
            None => return false,
        }
    }
    at <= line.len() - last.len()
}

/// The phases a start's lines tell, in order (a line's index for its time).
fn phases_told(engine: specd_spec::Engine, lines: &[String]) -> Vec<&'static str> {
    let log = &specd_spec::engine_facts(engine).startup;
    let t = specd_spec::startup::timeline(log, 0, lines.iter().enumerate().map(|(i, l)| (i as u64, l.as_str())));
    assert!(t.ready_us.is_some(), "{engine:?}: no ready line in {lines:#?}");
    t.spans.iter().map(|s| s.phase).collect()
}

/// The message of a vLLM log line (after its header), or the line (uvicorn's, tqdm's).
fn vllm_message(line: &str) -> &str {
    match line.find("] ") {
        Some(i) if line.starts_with('(') => &line[i + 2..],
        _ => line,
    }
}

/// The stand-in started as vLLM with the real starts' command lines (eager and compiled) says
/// the lines specd times a start by as the real vLLM does (each in the real line's form, or, for
/// the lines only a GPU says, in the form its source writes), in the order that tells the same
/// phases.
#[test]
fn vllm_starts_in_the_real_phases_and_lines() {
    let source = read_text("vllm", "startup/source-lines.txt");
    let formats: Vec<String> = source
        .lines()
        .filter_map(|l| l.split_once(": ").map(|x| x.1.trim().trim_matches(['"', ',']).to_string()))
        .collect();
    let log = &specd_spec::engine_facts(specd_spec::Engine::Vllm).startup;
    for name in ["eager", "compile"] {
        let real = real_start("vllm", name);
        let port = free_port();
        let argv = standin_argv(&read_json("vllm", "startup/startup.json")[name]["argv"], port);
        let (_p, file, _d) = run_standin(&argv, &[], "Application startup complete.");
        let mine: Vec<String> = std::fs::read_to_string(&file).unwrap().lines().map(str::to_string).collect();
        let real_marks: Vec<&str> = real.iter().filter(|l| log.marks(l)).map(|l| vllm_message(l)).collect();
        for l in mine.iter().filter(|l| log.marks(l)) {
            let m = vllm_message(l);
            let as_real = real_marks.iter().any(|r| form(r) == form(m));
            let as_source = formats.iter().any(|f| fits(f, m));
            assert!(as_real || as_source, "{name}: the real vLLM says no such line: {m:?}\nreal: {real_marks:#?}");
        }
        assert_eq!(
            phases_told(specd_spec::Engine::Vllm, &mine),
            phases_told(specd_spec::Engine::Vllm, &real),
            "{name}"
        );
    }
}

/// The stand-in started as llama-server with the real starts' command lines (with and without a
/// draft) says every line of the real start, in its order and form (its elapsed time, level and
/// text; the port and the numbers aside).
#[test]
fn llama_server_starts_with_the_real_lines() {
    for name in ["default", "draft"] {
        let real = real_start("llama-cpp", name);
        let mut argv = standin_argv(&read_json("llama-cpp", "startup/startup.json")[name]["argv"], free_port());
        argv[0] = "llama-cpp".into();
        let (_p, file, _d) = run_standin(&argv, &[], "listening on");
        let mine: Vec<String> = std::fs::read_to_string(&file).unwrap().lines().map(str::to_string).collect();
        let forms = |ls: &[String]| ls.iter().map(|l| form(l)).collect::<Vec<_>>();
        assert_eq!(forms(&mine), forms(&real), "{name}");
        assert_eq!(phases_told(specd_spec::Engine::LlamaCpp, &mine), phases_told(specd_spec::Engine::LlamaCpp, &real));
    }
}

/// The stand-in started as SGLang says its start-up lines as SGLang 0.5.23's source writes them
/// (`sglang/startup_lines.txt`, uvicorn's from its source), telling its phases in order: a
/// speculating server's draft runner loads and captures after the target's.
#[test]
fn sglang_starts_with_the_lines_its_source_writes() {
    let formats: Vec<String> = read_text("sglang", "startup_lines.txt")
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split_once('\t').map(|x| x.1.to_string()))
        .chain(
            read_text("vllm", "startup/source-lines.txt")
                .lines()
                .filter(|l| l.starts_with("uvicorn/server.py") && l.contains("message = f\"Uvicorn running on"))
                .map(|l| l.split_once("f\"").unwrap().1.trim_end_matches('"').to_string()),
        )
        .collect();
    assert!(formats.iter().any(|f| f.starts_with("Uvicorn running on")), "{formats:?}");
    let cases: [(&[&str], &[&str]); 2] = [
        (&[], &["process", "weights", "engine", "api"]),
        (
            &[
                "--speculative-algorithm",
                "EAGLE",
                "--speculative-draft-model-path",
                "/d",
                "--speculative-num-steps",
                "3",
                "--speculative-eagle-topk",
                "1",
                "--speculative-num-draft-tokens",
                "4",
            ],
            &["process", "weights", "engine", "weights", "engine", "api"],
        ),
    ];
    for (extra, want) in cases {
        let port = free_port().to_string();
        let mut argv: Vec<String> =
            ["sglang", "--model-path", "/m", "--port", &port].iter().map(|s| s.to_string()).collect();
        argv.extend(extra.iter().map(|s| s.to_string()));
        let (_p, file, _d) = run_standin(&argv, &[("SPECD_STANDIN_WARMUP_MS", "20")], "fired up");
        // SGLang's lines after its time stamp: `[2026-12-05 04:00:47] Load weight begin…`.
        let mine: Vec<String> = std::fs::read_to_string(&file)
            .unwrap()
            .lines()
            .map(|l| l.split_once("] ").map_or(l, |x| x.1).to_string())
            .collect();
        let said: Vec<&String> = mine
            .iter()
            .filter(|l| formats.iter().any(|f| f.split(['{', '%']).next().is_some_and(|head| l.starts_with(head))))
            .collect();
        assert!(said.len() >= want.len(), "{said:#?}");
        for l in said {
            assert!(formats.iter().any(|f| fits(f, l)), "SGLang's source writes no such line: {l:?}");
        }
        assert_eq!(phases_told(specd_spec::Engine::Sglang, &mine), want, "{extra:?}");
    }
}

#[test]
fn a_line_fits_the_format_that_writes_it() {
    assert!(fits("Loading weights took %.2f seconds", "Loading weights took 0.15 seconds"));
    assert!(fits(
        "Load weight end. elapsed={t:.2f} s, type={type(m).__name__}, x",
        "Load weight end. elapsed=1.00 s, type=M, x"
    ));
    assert!(!fits("Load weight end. elapsed={t:.2f} s", "Load weight begin. elapsed=1.00 s"));
    assert!(fits("The server is fired up and ready to roll!", "The server is fired up and ready to roll!"));
    assert!(!fits("a {x} b {y} c", "a 1 c"));
}
