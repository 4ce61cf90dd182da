//! The stand-in stops on SIGTERM under continuous load as the real engines do: the same load
//! as `scripts/record-engine-failures vllm-sigterm llama-cpp-sigterm` put on the real vLLM 0.32
//! and llama-server (three clients streaming completions back to back, one asking for whole
//! ones), the same SIGTERM with requests in flight, and each request classified the same way
//! (`specd_e2e::traffic`). What the requests in flight got, what the requests sent after the
//! SIGTERM got (before and after the exit), what `/health` answered meanwhile, and the exit
//! status must be what the real engine's recording shows
//! (`tests/fixtures/engines/{vllm/real,llama-cpp/sigterm}/sigterm-load.*.json`).

use serde_json::Value;
use specd_e2e::engine_process::{EngineProcess, Personality};
use specd_e2e::free_port;
use specd_e2e::traffic::{Failure, Load, Record, Traffic};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

fn fixture(path: &str) -> Value {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/engines").join(path);
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))).unwrap()
}

/// What happened around one SIGTERM: request kinds (and one detail of each) by phase and
/// kind of request, `/health`'s answers in order (repeats merged), the exit.
struct Seen {
    requests: BTreeMap<String, BTreeMap<String, String>>,
    health: Vec<String>,
    exit_status: Option<i32>,
    /// Seconds from the SIGTERM to the exit, and to the end of the last request in flight.
    exit_after: f64,
    last_in_flight_end: f64,
    log_tail: String,
}

impl std::fmt::Debug for Seen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Seen")
            .field("requests", &self.requests)
            .field("health", &self.health)
            .field("exit_status", &self.exit_status)
            .field("exit_after", &self.exit_after)
            .field("last_in_flight_end", &self.last_in_flight_end)
            .finish()
    }
}

/// The phase of a request, as the recorder names them.
fn phase(r: &Record, t0: Instant, sigterm: Instant, exit: Instant) -> &'static str {
    let (sent, end) = (t0 + r.sent, t0 + r.end);
    if end < sigterm {
        "before"
    } else if sent < sigterm {
        "across"
    } else if sent < exit {
        "after"
    } else {
        "after-exit"
    }
}

fn detail(r: &Record) -> String {
    use specd_e2e::traffic::Failure::*;
    match &r.result {
        Err(Status(_, body)) => body.clone(),
        Err(ErrorChunk(c)) => format!("data: {c}"),
        _ => String::new(),
    }
}

/// The recorder's load on the stand-in as `p`, SIGTERM once every client has a request in
/// flight, the clients going on until the stand-in has exited.
fn sigterm_under_load(p: Personality, extra: &[&str], env: &[(&str, &str)]) -> Seen {
    let port = free_port();
    let mut env = env.to_vec();
    // 24 tokens in about half a second, as the real engines on this machine.
    env.push(("SPECD_STANDIN_TOKENS_PER_SEC", "50"));
    let mut e = EngineProcess::standin(p, port, extra, &env).unwrap();
    e.wait_ready(Duration::from_secs(10)).unwrap();
    // A client gives up on a request after 2 s without a byte (the recorder: 10 s).
    let base = Load { clients: 3, max_tokens: 24, timeout: Duration::from_secs(2), ..Load::new(port, p.api()) };
    let streams = Traffic::start(base.clone());
    let whole = Traffic::start(Load { clients: 1, max_tokens: 48, stream: false, ..base });
    streams.wait_successes(8, Duration::from_secs(20)).unwrap();
    specd_e2e::wait_until("every client with a request in flight", Duration::from_secs(10), || {
        e.in_flight() == Some(4)
    })
    .unwrap();
    let sigterm = Instant::now();
    e.sigterm();
    // /health from the moment the engine acted on the signal (its first line about it).
    let acted = match p {
        Personality::Vllm => "[shutdown] API server: shutdown triggered",
        Personality::LlamaCpp => "cleaning up before exit...",
        Personality::Sglang => "SIGTERM received.",
    };
    specd_e2e::wait_until("the stand-in to act on SIGTERM", Duration::from_secs(10), || e.log().contains(acted))
        .unwrap();
    let mut health: Vec<String> = Vec::new();
    let status = loop {
        let h = match specd_e2e::http(port, "GET", "/health", None, Duration::from_secs(1)) {
            Some((c, _)) => c.to_string(),
            None if std::net::TcpStream::connect(("127.0.0.1", port)).is_err() => "refused".into(),
            None => "no-reply".into(),
        };
        if health.last() != Some(&h) {
            health.push(h);
        }
        if let Some(st) = e.exited() {
            break st;
        }
        assert!(sigterm.elapsed() < Duration::from_secs(30), "no exit 30 s after SIGTERM:\n{}", e.log());
        std::thread::sleep(Duration::from_millis(50)); // the probes' pace, as the recorder's
    };
    let exit = Instant::now();
    if health.last().map(String::as_str) != Some("refused") {
        health.push("refused".into());
    }
    // The clients meet the stopped server for a while.
    let (t_s, t_w) = (streams.started(), whole.started());
    let after_exit = |t: &Traffic| {
        let n = t.counts().0;
        specd_e2e::wait_until("requests sent after the exit", Duration::from_secs(10), || t.counts().0 >= n + 3)
    };
    after_exit(&streams).unwrap();
    after_exit(&whole).unwrap();
    let (s, w) = (streams.stop(), whole.stop());
    let mut requests: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    let mut last_in_flight_end = 0.0f64;
    for (sum, t0, what) in [(&s, t_s, "stream"), (&w, t_w, "whole")] {
        for r in &sum.records {
            let ph = phase(r, t0, sigterm, exit);
            if ph == "across" {
                last_in_flight_end = last_in_flight_end.max(((t0 + r.end) - sigterm).as_secs_f64());
            }
            let kind = match &r.result {
                Ok(()) => "complete".to_string(),
                Err(f) => f.kind(),
            };
            requests.entry(format!("{ph} {what}")).or_default().entry(kind).or_insert_with(|| detail(r));
        }
    }
    let log = e.log();
    Seen {
        requests,
        health,
        exit_status: status.code(),
        exit_after: (exit - sigterm).as_secs_f64(),
        last_in_flight_end,
        log_tail: log.lines().rev().take(30).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n"),
    }
}

/// What the recording says, in the same terms.
fn recorded(path: &str) -> Seen {
    let f = fixture(path);
    let requests = f["requests"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, kinds)| {
            let kinds = kinds
                .as_object()
                .unwrap()
                .iter()
                .map(|(kind, e)| (kind.clone(), e["detail"].as_str().unwrap_or("").to_string()));
            (k.clone(), kinds.collect())
        })
        .collect();
    let mut health: Vec<String> = Vec::new();
    for (i, run) in f["health"].as_array().unwrap().iter().enumerate() {
        let h = run[2].as_str().unwrap().to_string();
        // The first probe raced the signal (answered before the engine acted on it).
        if i == 0 && run[1].as_f64().unwrap() < 0.2 {
            continue;
        }
        if health.last() != Some(&h) {
            health.push(h);
        }
    }
    let last_in_flight_end = f["requests"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| k.starts_with("across "))
        .flat_map(|(_, kinds)| kinds.as_object().unwrap().values().map(|e| e["ended_s"][1].as_f64().unwrap()))
        .fold(0.0, f64::max);
    Seen {
        requests,
        health,
        exit_status: f["exit_status"].as_i64().map(|c| c as i32),
        exit_after: f["exit_after_sigterm_s"].as_f64().unwrap(),
        last_in_flight_end,
        log_tail: String::new(),
    }
}

/// The stand-in did what the engine did: every phase's kinds of outcome are among the
/// engine's (a race may give the engine two kinds where the stand-in has one), with the same
/// details (error bodies); the same `/health` answers in the same order; the same exit status;
/// and it exits before or after its last request in flight ended as the engine did.
fn same(standin: &Seen, real: &Seen) {
    let ctx = format!("\nstand-in: {standin:#?}\nstand-in's log:\n{}\nreal engine: {real:#?}", standin.log_tail);
    for (phase, kinds) in &standin.requests {
        if phase.starts_with("before") {
            assert_eq!(kinds.keys().collect::<Vec<_>>(), ["complete"], "{phase}{ctx}");
            continue;
        }
        let real_kinds = real.requests.get(phase).unwrap_or_else(|| panic!("the engine had no {phase} requests{ctx}"));
        for (kind, detail) in kinds {
            // A connection accepted just before the listener closed is closed unanswered
            // (uvicorn's and hyper's shutdown alike close a connection with no request read
            // yet): the same moment as a refused connection, met more often by the load's
            // clients, which do not pause after a failure as the recorder's do.
            if kind == "no-reply" && real_kinds.contains_key("refused") {
                continue;
            }
            let real_detail =
                real_kinds.get(kind).unwrap_or_else(|| panic!("{phase}: {kind} never happened to the engine{ctx}"));
            // What the engine said: an error's body, an error chunk (a cut stream's last
            // tokens are the model's own).
            if kind.starts_with("http-") || kind == "error-chunk" {
                assert_eq!(detail, real_detail, "{phase} {kind}{ctx}");
            }
        }
    }
    for phase in real.requests.keys().filter(|p| p.starts_with("across") || p.starts_with("after-exit")) {
        assert!(standin.requests.contains_key(phase), "no {phase} request to compare{ctx}");
    }
    assert_eq!(standin.health, real.health, "/health{ctx}");
    assert_eq!(standin.exit_status, real.exit_status, "exit status{ctx}");
    let waited = |s: &Seen| s.exit_after >= s.last_in_flight_end;
    assert_eq!(waited(standin), waited(real), "exit after the last request in flight ended{ctx}");
}

/// vLLM 0.32 by default (`--shutdown-timeout 0`): the engine is killed at once; the requests in
/// flight, streamed or whole, get nothing more (their clients time out), new connections are
/// refused at once, and the process exits 0 when those clients have gone.
#[test]
fn vllm_sigterm_abandons_what_is_in_flight_as_vllm_does() {
    let seen = sigterm_under_load(Personality::Vllm, &[], &[]);
    same(&seen, &recorded("vllm/real/sigterm-load.abort.json"));
}

/// vLLM 0.32 with `--shutdown-timeout 30`: the requests in flight complete; meanwhile and
/// during the engine's teardown `/health` still answers 200 and every new request gets HTTP
/// 500 "cannot schedule new futures after shutdown"; then connections are refused and it
/// exits 0.
#[test]
fn vllm_shutdown_timeout_drains_and_refuses_new_requests_as_vllm_does() {
    let seen =
        sigterm_under_load(Personality::Vllm, &["--shutdown-timeout", "30"], &[("SPECD_STANDIN_TEARDOWN_MS", "500")]);
    same(&seen, &recorded("vllm/real/sigterm-load.drain.json"));
}

/// llama-server: generation stops at once (streams get no more tokens, whole requests no
/// answer), the listener closes at once (new connections refused), and the process stays
/// until the clients of the requests in flight have gone, then exits 0.
#[test]
fn llama_server_sigterm_stops_generating_and_waits_for_its_clients_as_llama_server_does() {
    let seen = sigterm_under_load(Personality::LlamaCpp, &[], &[]);
    same(&seen, &recorded("llama-cpp/sigterm/sigterm-load.default.json"));
}

/// llama-server's second SIGTERM ends it at once ("Received second interrupt, terminating
/// immediately.", exit 1), cutting the stream it had left waiting.
#[test]
fn a_second_sigterm_ends_llama_server_at_once() {
    let port = free_port();
    let mut e =
        EngineProcess::standin(Personality::LlamaCpp, port, &[], &[("SPECD_STANDIN_TOKENS_PER_SEC", "50")]).unwrap();
    e.wait_ready(Duration::from_secs(10)).unwrap();
    let t = Traffic::start(Load { clients: 1, max_tokens: 1000, ..Load::new(port, Personality::LlamaCpp.api()) });
    specd_e2e::wait_until("the stream running", Duration::from_secs(10), || e.in_flight() == Some(1)).unwrap();
    e.sigterm();
    specd_e2e::wait_until("the first SIGTERM acted on", Duration::from_secs(10), || {
        e.log().contains("cleaning up before exit...")
    })
    .unwrap();
    assert!(e.exited().is_none(), "it waits for its client");
    e.sigterm();
    let st = e.wait_exit(Duration::from_secs(10)).unwrap();
    assert_eq!(st.code(), Some(1));
    assert!(e.log().contains("Received second interrupt, terminating immediately."), "{}", e.log());
    let s = t.stop();
    assert!(matches!(s.records[0].result, Err(Failure::Cut(_))), "{s}");
}
