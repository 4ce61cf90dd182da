//! The stand-in's HTTP server, load phase, faults and shutdown.

use super::args::{Flavour, Launch};
use super::logs;
use super::perf::Perf;
use super::py::prometheus_float;
use super::vllm;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Semaphore;

const LOADING: u8 = 0;
const WARMUP: u8 = 1;
const READY: u8 = 2;
const DRAINING: u8 = 3;

pub struct Shared {
    pub launch: Launch,
    phase: AtomicU8,
    running: AtomicUsize,
    queued: AtomicUsize,
    finished: AtomicU64,
    generated: AtomicU64,
    next_rid: AtomicU64,
    rids: Mutex<BTreeSet<String>>,
    slots: Arc<Semaphore>,
    /// The performance model: pacing and the accept length (`perf.rs`).
    perf: Perf,
    /// Verify steps done and tokens they produced, over all requests while speculating: the
    /// evidence the server reports (accept length = tokens / steps).
    verify_steps: AtomicU64,
    spec_tokens: AtomicU64,
    /// Accepted draft tokens by draft position, over all verify steps.
    accepted_per_pos: Mutex<Vec<u64>>,
    /// The server's steps so far, over all requests: the index each draws its burst by.
    steps_drawn: AtomicU64,
    /// Decode steps as the engines count them (`DecodeCounts`).
    decode: Mutex<DecodeCounts>,
    /// Prompt tokens of the requests taken.
    prompt_tokens: AtomicU64,
    /// The engine stopped on SIGTERM (vLLM, llama.cpp): no request makes progress any more.
    abort: tokio::sync::watch::Sender<bool>,
    /// The HTTP server stops: it closes its listener and its idle connections, and ends each
    /// busy one after its answer (uvicorn's and llama.cpp's shutdown).
    close_http: tokio::sync::watch::Sender<bool>,
    /// When the server started (Unix seconds): its counters' `_created`, its replies' `created`.
    started: f64,
}

type St = Arc<Shared>;

/// The decode steps of the requests and their time, as vLLM (`inter_token_latency_seconds`, one
/// observation a request's step; `iteration_tokens_total`, one an engine step) and llama-server
/// (`tokens_predicted_*`, `n_busy_slots_per_decode`) count them. The stand-in runs each request
/// on its own: a step with `b` requests running counts `1/b` of an engine step. (llama-server
/// adds a request's counts when it ends; the stand-in as they happen.)
#[derive(Debug, Default)]
struct DecodeCounts {
    /// Requests' steps, their seconds and tokens.
    steps: u64,
    seconds: f64,
    tokens: u64,
    /// Engine steps (vLLM: a prefill each, a batch's step once).
    engine_steps: f64,
    /// The requests running, summed over the requests' steps.
    running_sum: f64,
}

impl Shared {
    fn phase(&self) -> u8 {
        self.phase.load(Ordering::SeqCst)
    }

    fn spec_on(&self) -> bool {
        spec_on(&self.launch)
    }

    /// Verify steps, accepted draft tokens, and those by draft position, so far.
    fn spec_counts(&self) -> (u64, u64, Vec<u64>) {
        let steps = self.verify_steps.load(Ordering::SeqCst);
        let tokens = self.spec_tokens.load(Ordering::SeqCst);
        let per_pos = self.accepted_per_pos.lock().unwrap_or_else(|e| e.into_inner()).clone();
        (steps, tokens.saturating_sub(steps), per_pos)
    }

    /// A request's new verify step: its tokens (at most `left`), counted as the engine counts
    /// them: the request's and the server's verify steps, the accepted tokens by position, the
    /// step's time at the batch running now.
    fn new_step(&self, verify: &AtomicU64, left: u64) -> u64 {
        verify.fetch_add(1, Ordering::SeqCst);
        let perf = &self.perf;
        let n = perf.burst(self.steps_drawn.fetch_add(1, Ordering::SeqCst)).min(left);
        if perf.k > 0 {
            self.verify_steps.fetch_add(1, Ordering::SeqCst);
            self.spec_tokens.fetch_add(n, Ordering::SeqCst);
            let mut per_pos = self.accepted_per_pos.lock().unwrap_or_else(|e| e.into_inner());
            for c in per_pos.iter_mut().take(n as usize - 1) {
                *c += 1;
            }
        }
        let running = self.running.load(Ordering::SeqCst).max(1);
        let seconds =
            if perf.timed { perf.step_time(running).as_secs_f64() } else { perf.token_time().as_secs_f64() * n as f64 };
        let mut d = self.decode.lock().unwrap_or_else(|e| e.into_inner());
        d.steps += 1;
        d.seconds += seconds;
        d.tokens += n;
        d.engine_steps += 1.0 / running as f64;
        d.running_sum += running as f64;
        n
    }

    /// A request's prefill, an engine step of its own (vLLM).
    fn prefill_step(&self) {
        self.decode.lock().unwrap_or_else(|e| e.into_inner()).engine_steps += 1.0;
    }

    fn in_flight(&self) -> usize {
        self.rids.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

/// Whether the server drafts.
fn spec_on(l: &Launch) -> bool {
    match l.flavour {
        Flavour::Sglang => !l.args["speculative_algorithm"].is_null(),
        Flavour::Vllm => !l.args["speculative_config"].is_null(),
        // llama-server drafts only with a --spec-type (default `none`): a draft model
        // alone is loaded and never used; draft-* types need the draft model.
        Flavour::LlamaCpp => {
            let a = &l.args;
            let draft = !a.get("spec_draft_model").is_none_or(Value::is_null);
            spec_types(a).iter().any(|t| t.starts_with("ngram-") || (t.starts_with("draft-") && draft))
        }
    }
}

/// llama.cpp's `--spec-type` list as the server reports it (`none` when not given).
fn spec_types(a: &serde_json::Map<String, Value>) -> Vec<String> {
    match a.get("spec_type").and_then(Value::as_str) {
        Some(t) if !t.is_empty() => t.split(',').map(|x| x.trim().to_string()).collect(),
        _ => vec!["none".to_string()],
    }
}

fn max_running(l: &Launch) -> usize {
    let v = match l.flavour {
        Flavour::Sglang => l.args["max_running_requests"].as_i64(),
        Flavour::Vllm => l.args["max_num_seqs"].as_i64(),
        Flavour::LlamaCpp => l.args["n_parallel"].as_i64().filter(|&n| n > 0).or(Some(4)),
    };
    v.filter(|&n| n > 0).map(|n| n as usize).unwrap_or(256)
}

/// Runs the server until shutdown; returns the process exit code.
pub async fn serve(launch: Launch) -> i32 {
    super::faults::arm(&launch.knobs);
    let perf = Perf::of(&launch, spec_on(&launch));
    let st: St = Arc::new(Shared {
        slots: Arc::new(Semaphore::new(max_running(&launch))),
        launch,
        phase: AtomicU8::new(LOADING),
        running: AtomicUsize::new(0),
        queued: AtomicUsize::new(0),
        finished: AtomicU64::new(0),
        generated: AtomicU64::new(0),
        next_rid: AtomicU64::new(1),
        rids: Mutex::new(BTreeSet::new()),
        accepted_per_pos: Mutex::new(vec![0; perf.k as usize]),
        steps_drawn: AtomicU64::new(0),
        decode: Mutex::new(DecodeCounts::default()),
        perf,
        verify_steps: AtomicU64::new(0),
        spec_tokens: AtomicU64::new(0),
        prompt_tokens: AtomicU64::new(0),
        abort: tokio::sync::watch::Sender::new(false),
        close_http: tokio::sync::watch::Sender::new(false),
        started: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0),
    });
    let l = &st.launch;
    let addr = format!("{}:{}", if l.host.contains(':') { format!("[{}]", l.host) } else { l.host.clone() }, l.port);
    let mut sigterm =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");

    let bind = |addr: String| async move {
        match tokio::net::TcpListener::bind(&addr).await {
            Ok(x) => Ok(x),
            Err(e) => Err(format!("[Errno 98] error while attempting to bind on address ('{addr}'): {e}")),
        }
    };

    // llama.cpp listens at once and answers 503 "Loading model".
    let listener = if l.flavour == Flavour::LlamaCpp {
        match bind(addr.clone()).await {
            Ok(x) => Some(x),
            Err(e) => {
                logs::line(
                    l.flavour,
                    "error",
                    &format!("couldn't bind HTTP server socket, hostname: {}, port: {}: {e}", l.host, l.port),
                );
                return 1;
            }
        }
    } else {
        None
    };
    let app = router(st.clone());
    let server_task = listener.map(|ls| spawn_http(ls, app.clone(), &st));

    // The load: port closed (SGLang, vLLM) for load_ms; faults fire here.
    logs::loading(&st.launch);
    // vLLM binds its port before it loads (a held port fails the start at once) but listens only
    // once it serves; its speculative config is checked after the bind.
    let mut vllm_socket = None;
    if let Some(v) = st.launch.vllm.as_deref() {
        match bind_unlistened(&addr) {
            Ok(s) => vllm_socket = Some(s),
            Err(e) => {
                eprintln!("{}", vllm::bind_failed(&e));
                return 1;
            }
        }
        match &v.spec {
            Err(f) => {
                eprintln!("{}", f.traceback);
                return 1;
            }
            Ok(spec) => {
                for w in spec.iter().flat_map(|s| &s.warnings) {
                    logs::vllm_log("APIServer", "warning", "speculative.py:1142", w);
                }
            }
        }
        logs::vllm_log("EngineCore", "info", "core.py:133", &vllm::engine_config(v));
    }
    // The load, phase by phase; it may die in one. A draft larger than the memory limit dies
    // as a real one would while it sizes its KV cache and captures CUDA graphs.
    let too_large = st.perf.out_of_memory(&st.launch.knobs);
    tokio::select! {
        loaded = super::startup::load(&st.launch, too_large) => if let Err(code) = loaded {
            return code;
        },
        _ = sigterm.recv() => {
            // Before the server is up the engine has no handler of its own
            // yet: the default action, death by SIGTERM.
            // SAFETY: restoring the default disposition and raising.
            unsafe {
                libc::signal(libc::SIGTERM, libc::SIG_DFL);
                libc::raise(libc::SIGTERM);
            }
            return 143;
        }
    }

    let _server_task = match (server_task, vllm_socket) {
        (Some(t), _) => t,
        (None, Some(sock)) => {
            // vLLM logs its routes and uvicorn's startup, then listens.
            st.phase.store(READY, Ordering::SeqCst);
            logs::ready(&st.launch, &addr);
            match listen(sock) {
                Ok(ls) => spawn_http(ls, app, &st),
                Err(e) => {
                    eprintln!("{}", vllm::bind_failed(&e));
                    return 1;
                }
            }
        }
        (None, None) => match bind(addr.clone()).await {
            Ok(ls) => spawn_http(ls, app, &st),
            Err(e) => {
                logs::line(st.launch.flavour, "error", &e);
                return 1;
            }
        },
    };
    if st.launch.flavour == Flavour::Vllm {
        tokio::spawn(vllm_stats(st.clone()));
    } else if st.launch.flavour == Flavour::Sglang {
        // Up but warming up: /health 503 until the warmup request is done.
        // SIGTERM meanwhile drains like any other time.
        st.phase.store(WARMUP, Ordering::SeqCst);
        logs::line(Flavour::Sglang, "info", &format!("Uvicorn running on http://{addr} (Press CTRL+C to quit)"));
        let (st2, addr2) = (st.clone(), addr.clone());
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(st2.launch.knobs.warmup_ms)).await;
            if st2.phase.compare_exchange(WARMUP, READY, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
                logs::ready(&st2.launch, &addr2);
            }
        });
    } else if st.launch.flavour == Flavour::LlamaCpp {
        st.phase.store(READY, Ordering::SeqCst);
        logs::ready(&st.launch, &addr);
    }

    sigterm.recv().await;
    st.phase.store(DRAINING, Ordering::SeqCst);
    match st.launch.flavour {
        Flavour::Sglang => {
            logs::line(
                Flavour::Sglang,
                "warning",
                "SIGTERM received. signum=15 frame=<frame at 0x7f0c2a3b1e40, file '/usr/lib/python3.12/selectors.py', line 468, code select>. Draining requests and shutting down...",
            );
            // SGLang's sigterm_watchdog wakes every 5 s: once to notice the
            // flag, then until no request is left. No timeout of its own.
            let poll = Duration::from_millis(st.launch.knobs.drain_poll_ms);
            tokio::time::sleep(poll).await;
            loop {
                let rids: Vec<String> = st.rids.lock().unwrap_or_else(|e| e.into_inner()).iter().cloned().collect();
                logs::line(
                    Flavour::Sglang,
                    "info",
                    &format!(
                        "Gracefully exiting... Remaining number of requests {}. Remaining requests remaining_rids={:?}.",
                        rids.len(),
                        rids
                    ),
                );
                if rids.is_empty() {
                    break;
                }
                tokio::time::sleep(poll).await;
            }
            0
        }
        Flavour::Vllm => {
            // vLLM 0.32 (vllm/real/sigterm-load.*): the API server stops its engine client
            // first, then uvicorn. `--shutdown-timeout 0` (the default) kills the engine at
            // once: the requests in flight, streamed or not, get nothing more and are never
            // finished, and the process waits for their clients to go. `--shutdown-timeout N`
            // lets them finish for up to N s; meanwhile /health still answers 200 and every new
            // request gets a 500 ("cannot schedule new futures after shutdown"), and so it does
            // during the engine's teardown after the drain.
            let timeout = st.launch.vllm.as_deref().map(vllm::Vllm::shutdown_timeout).unwrap_or(0);
            let api = |at: &str, msg: &str| logs::vllm_log("APIServer", "info", at, msg);
            let core = |at: &str, msg: &str| logs::vllm_log("EngineCore", "info", at, msg);
            api("launcher.py:254", "[shutdown] API server: shutdown triggered");
            let mode = if timeout == 0 { "abort" } else { "drain" };
            api(
                "launcher.py:270",
                &format!("[shutdown] API server: stopping engine client mode={mode} timeout={timeout}s"),
            );
            api("core_client.py:770", &format!("[shutdown] MPClient: start timeout={timeout}s"));
            api("core_client.py:772", "[shutdown] MPClient: stopping engine manager");
            api("utils.py:628", "[shutdown] Process manager: send sigterm to process EngineCore");
            let mut drained = false;
            if timeout > 0 {
                core("core.py:1454", "[shutdown] EngineCore: trigger received signal=SIGTERM");
                core("core.py:1635", &format!("[shutdown] EngineCore: start mode=drain timeout={timeout}s"));
                let n = st.in_flight();
                if n > 0 {
                    core(
                        "core.py:1655",
                        &format!("[shutdown] EngineCore: draining in-flight requests count={n} timeout={timeout}s"),
                    );
                }
                drained = tokio::time::timeout(Duration::from_secs(timeout), clients_gone(&st)).await.is_ok();
            }
            if drained {
                core("core.py:1666", "[shutdown] EngineCore: request processing complete; starting resource teardown");
                core("core.py:1499", "[shutdown] EngineCore: exiting busy loop");
                tokio::time::sleep(Duration::from_millis(st.launch.knobs.teardown_ms)).await;
            } else {
                st.abort.send_replace(true);
                let warn = |at: &str, msg: &str| logs::vllm_log("APIServer", "warning", at, msg);
                warn("utils.py:648", "[shutdown] Process manager: force killing remaining processes count=1");
                warn(
                    "utils.py:653",
                    &format!(
                        "[shutdown] Process manager: force killing remaining process EngineCore pid {}",
                        std::process::id() + 1
                    ),
                );
            }
            api("core_client.py:774", "[shutdown] MPClient: engine manager stopped");
            api("core_client.py:775", "[shutdown] MPClient: cleaning up background resources");
            api("core_client.py:777", "[shutdown] MPClient: complete");
            api("launcher.py:279", "[shutdown] API server: engine client stopped");
            api("launcher.py:282", "[shutdown] API server: signalling HTTP server shutdown");
            api("launcher.py:304", "[shutdown] API server: shutting down FastAPI HTTP server");
            st.close_http.send_replace(true);
            logs::uvicorn("Shutting down");
            if st.in_flight() > 0 {
                logs::uvicorn("Waiting for connections to close. (CTRL+C to force quit)");
                clients_gone(&st).await;
            }
            logs::uvicorn("Waiting for application shutdown.");
            logs::uvicorn("Application shutdown complete.");
            0
        }
        Flavour::LlamaCpp => {
            // llama-server (llama-cpp/sigterm/): its task loop stops at once, so the requests
            // in flight get no more tokens, and its HTTP server stops, so new connections are
            // refused; it exits when the HTTP threads of those requests are done, i.e. when
            // their clients have gone. A second SIGTERM ends it at once, exit 1.
            st.abort.send_replace(true);
            logs::line(Flavour::LlamaCpp, "info", "srv    operator(): operator(): cleaning up before exit...");
            st.close_http.send_replace(true);
            tokio::select! {
                _ = clients_gone(&st) => 0,
                _ = sigterm.recv() => {
                    eprintln!("Received second interrupt, terminating immediately.");
                    1
                }
            }
        }
    }
}

/// Serves `app` on `ls`, with each request's peer address (vLLM's access log), until
/// `close_http`.
fn spawn_http(ls: tokio::net::TcpListener, app: Router, st: &St) -> tokio::task::JoinHandle<std::io::Result<()>> {
    let mut close = st.close_http.subscribe();
    tokio::spawn(
        axum::serve(ls, app.into_make_service_with_connect_info::<SocketAddr>())
            .with_graceful_shutdown(async move {
                let _ = close.wait_for(|c| *c).await;
            })
            .into_future(),
    )
}

/// Waits until no request is in flight: their clients went away (the engine answers them no
/// more).
async fn clients_gone(st: &St) {
    while st.in_flight() > 0 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A TCP socket bound to `addr` (`SO_REUSEADDR`, as vLLM's) that does not listen yet.
fn bind_unlistened(addr: &str) -> std::io::Result<socket2::Socket> {
    use std::net::ToSocketAddrs;
    let a = addr
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::AddrNotAvailable, "no address"))?;
    let s = socket2::Socket::new(socket2::Domain::for_address(a), socket2::Type::STREAM, None)?;
    s.set_reuse_address(true)?;
    s.bind(&a.into())?;
    Ok(s)
}

fn listen(s: socket2::Socket) -> std::io::Result<tokio::net::TcpListener> {
    s.listen(2048)?;
    s.set_nonblocking(true)?;
    tokio::net::TcpListener::from_std(s.into())
}

/// vLLM's stats lines every `VLLM_LOG_STATS_INTERVAL`: the engine's throughput and load, and
/// the interval's speculative decoding. An idle engine's lines are debug-level (not shown).
async fn vllm_stats(st: St) {
    let Some(v) = st.launch.vllm.as_deref() else { return };
    let prefix_caching = !v.get("enable_prefix_caching").py_eq(&super::py::Py::Bool(false));
    let mut last = tokio::time::Instant::now();
    let (mut prompt0, mut gen0) = (0u64, 0u64);
    let mut spec0 = st.spec_counts();
    let mut busy_before = false;
    loop {
        tokio::time::sleep(v.log_stats_interval).await;
        let now = tokio::time::Instant::now();
        let secs = (now - last).as_secs_f64();
        last = now;
        let (prompt, generated) = (st.prompt_tokens.load(Ordering::SeqCst), st.generated.load(Ordering::SeqCst));
        let (pt, gt) = ((prompt - prompt0) as f64 / secs, (generated - gen0) as f64 / secs);
        (prompt0, gen0) = (prompt, generated);
        let spec = st.spec_counts();
        let busy = pt > 0.0 || gt > 0.0;
        let idle = !busy && !busy_before;
        busy_before = busy;
        let interval = vllm::SpecInterval {
            drafts: spec.0 - spec0.0,
            draft_tokens: (spec.0 - spec0.0) * u64::from(st.perf.k),
            accepted: spec.1 - spec0.1,
            per_pos: spec.2.iter().zip(spec0.2.iter().chain(std::iter::repeat(&0))).map(|(a, b)| a - b).collect(),
            seconds: secs,
        };
        spec0 = spec;
        if idle {
            continue;
        }
        let mut line = format!(
            "Engine 000: Avg prompt throughput: {pt:.1} tokens/s, Avg generation throughput: {gt:.1} tokens/s, Running: {} reqs, Waiting: {} reqs, GPU KV cache usage: 0.0%",
            st.running.load(Ordering::SeqCst),
            st.queued.load(Ordering::SeqCst)
        );
        if prefix_caching && prompt > 0 {
            line.push_str(", Prefix cache hit rate: 0.0%");
        }
        logs::vllm_log("APIServer", "info", "loggers.py:335", &line);
        if interval.drafts > 0 {
            logs::vllm_log("APIServer", "info", "metrics.py:120", &vllm::spec_decoding_line(&interval));
        }
    }
}

fn router(st: St) -> Router {
    let r = Router::new().fallback(not_found);
    let r = match st.launch.flavour {
        Flavour::Sglang => r
            .route("/health", get(sglang_health))
            .route("/health_generate", get(sglang_health))
            .route("/ready", get(sglang_health))
            .route("/get_server_info", get(sglang_server_info))
            .route("/server_info", get(sglang_server_info))
            .route("/get_model_info", get(sglang_model_info))
            .route("/model_info", get(sglang_model_info))
            .route("/generate", post(sglang_generate).put(sglang_generate))
            .route("/metrics", get(metrics))
            .route("/v1/models", get(openai_models))
            .route("/v1/completions", post(openai_completions)),
        Flavour::Vllm => r
            .route("/health", get(vllm_health))
            .route("/v1/models", get(openai_models))
            .route("/version", get(|| async { axum::Json(json!({"version": vllm::VERSION})) }))
            .route("/metrics", get(metrics))
            .route("/v1/completions", post(openai_completions)),
        Flavour::LlamaCpp => r
            .route("/health", get(llama_health))
            .route("/v1/health", get(llama_health))
            .route("/props", get(llama_props))
            .route("/slots", get(llama_slots))
            .route("/metrics", get(metrics))
            .route("/v1/models", get(openai_models))
            .route("/models", get(openai_models))
            .route("/completion", post(llama_completion))
            .route("/v1/completions", post(openai_completions)),
    };
    let gate = axum::middleware::from_fn_with_state(st.clone(), crash_gate);
    let access = axum::middleware::from_fn_with_state(st.clone(), access_log);
    r.layer(gate).layer(access).with_state(st)
}

/// uvicorn's access log (vLLM), written when the response starts.
async fn access_log(State(st): State<St>, req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let on = st
        .launch
        .vllm
        .as_deref()
        .is_some_and(|v| !v.get("disable_uvicorn_access_log").py_eq(&super::py::Py::Bool(true)));
    let peer = req.extensions().get::<axum::extract::ConnectInfo<SocketAddr>>().map(|c| c.0);
    let version = match req.version() {
        axum::http::Version::HTTP_10 => "1.0",
        axum::http::Version::HTTP_2 => "2",
        _ => "1.1",
    };
    let path = req.uri().path_and_query().map(|p| p.as_str()).unwrap_or("/");
    let line = format!("\"{} {path} HTTP/{version}\"", req.method());
    let r = next.run(req).await;
    if on && let Some(peer) = peer {
        let s = r.status();
        logs::uvicorn(&format!("{peer} - {line} {} {}", s.as_u16(), s.canonical_reason().unwrap_or("")));
    }
    if let Some(AsgiException(e)) = r.extensions().get::<AsgiException>() {
        eprintln!("{e}");
    }
    r
}

/// The `crash-after-ready` fault: see [`super::faults::answered_ready`].
async fn crash_gate(State(st): State<St>, req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    super::faults::crash_if_answered_ready(&st.launch.knobs);
    let health = matches!(req.uri().path(), "/health" | "/health_generate" | "/ready" | "/v1/health");
    let r = next.run(req).await;
    if health && r.status() == StatusCode::OK {
        super::faults::answered_ready();
    }
    r
}

async fn not_found() -> Response {
    (StatusCode::NOT_FOUND, axum::Json(json!({"detail": "Not Found"}))).into_response()
}

async fn sglang_health(State(st): State<St>) -> Response {
    match st.phase() {
        READY => StatusCode::OK.into_response(),
        DRAINING => {
            logs::line(Flavour::Sglang, "info", "Health check request received during shutdown. Returning 503.");
            StatusCode::SERVICE_UNAVAILABLE.into_response()
        }
        _ => StatusCode::SERVICE_UNAVAILABLE.into_response(),
    }
}

/// The server's running average of tokens per verify step (the model's before any request).
fn accept_length(st: &Shared) -> f64 {
    let steps = st.verify_steps.load(Ordering::SeqCst);
    if steps == 0 {
        return st.perf.accept_length;
    }
    st.spec_tokens.load(Ordering::SeqCst) as f64 / steps as f64
}

async fn sglang_server_info(State(st): State<St>) -> Response {
    let mut m = st.launch.args.clone();
    let mut internal = json!({
        "last_gen_throughput": st.perf.tokens_per_sec(1),
        "memory_usage": {"weight": 61.2, "kvcache": 9.7, "token_capacity": 412000},
    });
    if st.spec_on() {
        internal["avg_spec_accept_length"] = json!(accept_length(&st));
    }
    m.insert("internal_states".into(), json!([internal]));
    m.insert("version".into(), json!("0.5.23"));
    m.insert("frontend".into(), json!("python"));
    axum::Json(Value::Object(m)).into_response()
}

async fn sglang_model_info(State(st): State<St>) -> Response {
    axum::Json(json!({
        "model_path": st.launch.args["model_path"],
        "tokenizer_path": st.launch.args["tokenizer_path"],
        "is_generation": true,
    }))
    .into_response()
}

async fn vllm_health(State(st): State<St>) -> Response {
    // vLLM's port is closed while loading; once up /health is 200.
    let _ = st;
    StatusCode::OK.into_response()
}

async fn llama_health(State(st): State<St>) -> Response {
    if st.phase() == LOADING {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}})),
        )
            .into_response();
    }
    axum::Json(json!({"status": "ok"})).into_response()
}

async fn llama_slots(State(st): State<St>) -> Response {
    if st.phase() == LOADING {
        return llama_health(State(st)).await;
    }
    let a = &st.launch.args;
    let slots = max_running(&st.launch);
    let n_ctx_total = a["n_ctx"].as_i64().filter(|&n| n > 0).unwrap_or(4096 * slots as i64);
    let list: Vec<Value> = (0..slots)
        .map(|id| {
            json!({
                "id": id,
                "n_ctx": n_ctx_total / slots as i64,
                "speculative": st.spec_on(),
                "is_processing": false,
            })
        })
        .collect();
    axum::Json(Value::Array(list)).into_response()
}

async fn llama_props(State(st): State<St>) -> Response {
    if st.phase() == LOADING {
        return llama_health(State(st)).await;
    }
    let a = &st.launch.args;
    let slots = max_running(&st.launch);
    let n_ctx_total = a["n_ctx"].as_i64().filter(|&n| n > 0).unwrap_or(4096 * slots as i64);
    // llama-server builds these settings from a fresh task_params with only the
    // sampling settings copied (get_res_props): the speculation settings are the
    // defaults, `speculative.types` is "none" whatever --spec-type says. The
    // slots (/slots) and the completions show speculation, /props does not.
    axum::Json(json!({
        "default_generation_settings": {
            "n_ctx": n_ctx_total / slots as i64,
            "params": {
                "n_predict": -1,
                "seed": a.get("seed").cloned().unwrap_or(json!(4294967295u32)),
                "temperature": 0.8,
                "top_k": 40,
                "top_p": 0.95,
                "speculative.types": "none",
            },
        },
        "total_slots": slots,
        "model_path": a["model_path"],
        "modalities": {"vision": false, "audio": false},
        "chat_template": "",
        "chat_template_caps": {},
        "build_info": "b6700-standin",
        "is_sleeping": false,
    }))
    .into_response()
}

async fn openai_models(State(st): State<St>) -> Response {
    let a = &st.launch.args;
    if let Some(v) = st.launch.vllm.as_deref() {
        // One entry per served name, as vLLM 0.32 answers.
        let created = st.started as u64;
        let data: Vec<Value> = v
            .served_names()
            .iter()
            .enumerate()
            .map(|(i, name)| {
                json!({
                    "id": name, "object": "model", "created": created, "owned_by": "vllm", "root": v.model(),
                    "parent": null, "max_model_len": v.max_model_len() as i64,
                    "permission": [{
                        "id": format!("modelperm-{}", hex16(i as u64)), "object": "model_permission",
                        "created": created, "allow_create_engine": false, "allow_sampling": true,
                        "allow_logprobs": true, "allow_search_indices": false, "allow_view": true,
                        "allow_fine_tuning": false, "organization": "*", "group": null, "is_blocking": false,
                    }],
                })
            })
            .collect();
        return axum::Json(json!({"object": "list", "data": data})).into_response();
    }
    let (id, root) = match st.launch.flavour {
        Flavour::Sglang => (a["served_model_name"].clone(), a["model_path"].clone()),
        Flavour::Vllm => unreachable!("vLLM answered above"),
        Flavour::LlamaCpp => {
            (a.get("alias").cloned().unwrap_or_else(|| a["model_path"].clone()), a["model_path"].clone())
        }
    };
    let owned = if st.launch.flavour == Flavour::Sglang { "sglang" } else { "llamacpp" };
    axum::Json(json!({
        "object": "list",
        "data": [{"id": id, "object": "model", "created": 0, "owned_by": owned, "root": root}],
    }))
    .into_response()
}

/// 16 hex digits, different for each `n` and process (vLLM's ids).
fn hex16(n: u64) -> String {
    format!("{:016x}", (u64::from(std::process::id()) << 32 ^ n).wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

/// vLLM's `/metrics`: prometheus_client's exposition as vLLM 0.32 serves it (counters named
/// `…_total` on their TYPE lines, each with a `…_created` gauge); the spec_decode counters only
/// with a speculative config.
fn vllm_metrics(st: &Shared, v: &vllm::Vllm) -> String {
    let labels = format!("engine=\"0\",model_name=\"{}\"", v.served_names()[0]);
    let created = prometheus_float(st.started);
    let mut out = String::new();
    let mut counter = |name: &str, help: &str, samples: &[(String, f64)]| {
        out.push_str(&format!("# HELP {name}_total {help}\n# TYPE {name}_total counter\n"));
        for (l, x) in samples {
            out.push_str(&format!("{name}_total{{{l}}} {}\n", prometheus_float(*x)));
        }
        out.push_str(&format!("# HELP {name}_created {help}\n# TYPE {name}_created gauge\n"));
        for (l, _) in samples {
            out.push_str(&format!("{name}_created{{{l}}} {created}\n"));
        }
    };
    if st.spec_on() {
        let (drafts, accepted, per_pos) = st.spec_counts();
        let one = |x: u64| [(labels.clone(), x as f64)];
        counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", &one(drafts));
        counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", &one(drafts * u64::from(st.perf.k)));
        counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", &one(accepted));
        let per: Vec<(String, f64)> =
            per_pos.iter().enumerate().map(|(i, n)| (format!("{labels},position=\"{i}\""), *n as f64)).collect();
        counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.", &per);
    }
    let mut gauge = |name: &str, help: &str, x: f64| {
        out.push_str(&format!(
            "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{labels}}} {}\n",
            prometheus_float(x)
        ));
    };
    gauge(
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        st.running.load(Ordering::SeqCst) as f64,
    );
    gauge(
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        st.queued.load(Ordering::SeqCst) as f64,
    );
    gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", 0.0);
    let mut counter = |name: &str, help: &str, x: u64| {
        out.push_str(&format!(
            "# HELP {name}_total {help}\n# TYPE {name}_total counter\n{name}_total{{{labels}}} {}\n# HELP {name}_created {help}\n# TYPE {name}_created gauge\n{name}_created{{{labels}}} {created}\n",
            prometheus_float(x as f64)
        ));
    };
    counter("vllm:prompt_tokens", "Number of prefill tokens processed.", st.prompt_tokens.load(Ordering::SeqCst));
    counter("vllm:generation_tokens", "Number of generation tokens processed.", st.generated.load(Ordering::SeqCst));
    vllm_steps(&mut out, st, &labels);
    out
}

/// vLLM's counts of decode steps (`vllm/v1/metrics/loggers.py`): the inter-token latency
/// (observed once a request's decode step), the tokens of each engine step, the requests
/// finished, the process's start.
fn vllm_steps(out: &mut String, st: &Shared, labels: &str) {
    let d = st.decode.lock().unwrap_or_else(|e| e.into_inner());
    let mut histogram = |name: &str, help: &str, count: f64, sum: f64| {
        out.push_str(&format!(
            "# HELP {name} {help}\n# TYPE {name} histogram\n{name}_bucket{{engine=\"0\",le=\"+Inf\",model_name={model}}} {c}\n{name}_count{{{labels}}} {c}\n{name}_sum{{{labels}}} {}\n",
            prometheus_float(sum),
            model = labels.split_once("model_name=").map_or("\"\"", |(_, m)| m),
            c = prometheus_float(count),
        ));
    };
    histogram(
        "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        d.steps as f64,
        d.seconds,
    );
    let prefills = st.next_rid.load(Ordering::SeqCst).saturating_sub(1) as f64;
    histogram(
        "vllm:iteration_tokens_total",
        "Histogram of number of tokens per engine_step.",
        d.engine_steps.round(),
        (d.tokens as f64) + prefills,
    );
    let finished = st.finished.load(Ordering::SeqCst) as f64;
    out.push_str(&format!(
        "# HELP vllm:request_success_total Count of successfully processed requests.\n# TYPE vllm:request_success_total counter\nvllm:request_success_total{{{}}} {}\n",
        labels.replacen(",model_name", ",finished_reason=\"length\",model_name", 1),
        prometheus_float(finished)
    ));
    out.push_str(&format!(
        "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.\n# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds {}\n",
        prometheus_float(st.started)
    ));
}

/// llama-server's counts (`--metrics`; `tools/server/server-task.cpp`): tokens generated and the
/// slots' time generating them, busy slots per decode, drafts and their acceptance by position.
fn llama_counts(st: &Shared) -> String {
    let d = st.decode.lock().unwrap_or_else(|e| e.into_inner());
    let mut out = String::new();
    let mut one = |name: &str, kind: &str, help: &str, v: f64| {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {}\n", num(v)));
    };
    one("llamacpp:tokens_predicted_total", "counter", "Number of generation tokens processed", d.tokens as f64);
    one("llamacpp:tokens_predicted_seconds_total", "counter", "Total time spent generating tokens", d.seconds);
    one(
        "llamacpp:n_busy_slots_per_decode",
        "gauge",
        "Average number of busy slots per llama_decode() call",
        if d.steps == 0 { 0.0 } else { d.running_sum / d.steps as f64 },
    );
    if st.spec_on() {
        let (drafts, accepted, per_pos) = st.spec_counts();
        one(
            "llamacpp:spec_decode_num_draft_tokens_total",
            "counter",
            "Speculative: Total draft tokens generated",
            (drafts * u64::from(st.perf.k)) as f64,
        );
        one(
            "llamacpp:spec_decode_num_accepted_tokens_total",
            "counter",
            "Speculative: Total draft tokens accepted by the target model",
            accepted as f64,
        );
        one(
            "llamacpp:spec_decode_num_drafts_total",
            "counter",
            "Speculative: Total speculative decoding verification steps",
            drafts as f64,
        );
        let name = "llamacpp:spec_decode_num_accepted_tokens_per_pos_total";
        out.push_str(&format!("# HELP {name} Accepted tokens per draft position\n# TYPE {name} counter\n"));
        for (i, n) in per_pos.iter().enumerate() {
            out.push_str(&format!("{name}{{position=\"{i}\"}} {n}\n"));
        }
    }
    out
}

/// A number as llama-server prints it (`%g`-like: no `.0` on a whole number).
fn num(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 { format!("{}", v as i64) } else { format!("{v}") }
}

async fn metrics(State(st): State<St>) -> Response {
    let a = &st.launch.args;
    let running = st.running.load(Ordering::SeqCst);
    let queued = st.queued.load(Ordering::SeqCst);
    let mut out = String::new();
    let mut gauge = |name: &str, help: &str, labels: &str, v: f64| {
        let labels = if labels.is_empty() { String::new() } else { format!("{{{labels}}}") };
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} gauge\n{name}{labels} {v:?}\n"));
    };
    match st.launch.flavour {
        Flavour::Sglang => {
            // SGLang mounts /metrics only with --enable-metrics.
            if a["enable_metrics"] != json!(true) {
                return not_found().await;
            }
            let labels = format!("model_name=\"{}\"", a["served_model_name"].as_str().unwrap_or_default());
            gauge("sglang:num_running_reqs", "The number of running requests.", &labels, running as f64);
            gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.", &labels, queued as f64);
            gauge(
                "sglang:gen_throughput",
                "The generation throughput (token/s).",
                &labels,
                if running > 0 { st.perf.tokens_per_sec(running) * running as f64 } else { 0.0 },
            );
            gauge("sglang:token_usage", "The token usage.", &labels, 0.0);
            gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", &labels, 0.0);
            let (len, rate) = if st.spec_on() {
                let l = accept_length(&st);
                (l, ((l - 1.0) / f64::from(st.perf.k.max(1))).clamp(0.0, 1.0))
            } else {
                (0.0, 0.0)
            };
            gauge("sglang:spec_accept_length", "The average acceptance length of speculative decoding.", &labels, len);
            gauge("sglang:spec_accept_rate", "The average acceptance rate of speculative decoding.", &labels, rate);
            // Counters since the start: verify passes and the tokens generated.
            let generated = st.generated.load(Ordering::SeqCst) as f64;
            let verify = st.verify_steps.load(Ordering::SeqCst) as f64;
            out.push_str(&format!(
                "# HELP sglang:generation_tokens_total Number of generation tokens processed.\n# TYPE sglang:generation_tokens_total counter\nsglang:generation_tokens_total{{{labels},is_streaming=\"true\"}} {generated:?}\n"
            ));
            if st.spec_on() {
                out.push_str(&format!(
                    "# HELP sglang:spec_verify_calls_total The number of speculative verify calls.\n# TYPE sglang:spec_verify_calls_total counter\nsglang:spec_verify_calls_total{{{labels}}} {verify:?}\n"
                ));
            }
        }
        Flavour::Vllm => {
            let v = st.launch.vllm.as_deref().expect("vLLM's command line");
            return ([(header::CONTENT_TYPE, "text/plain; version=1.0.0; charset=utf-8")], vllm_metrics(&st, v))
                .into_response();
        }
        Flavour::LlamaCpp => {
            if a.get("endpoint_metrics") != Some(&json!(true)) {
                return (
                    StatusCode::NOT_IMPLEMENTED,
                    axum::Json(json!({"error": {"code": 501, "message": "This server does not support metrics endpoint. Start it with `--metrics`", "type": "not_supported_error"}})),
                )
                    .into_response();
            }
            gauge("llamacpp:requests_processing", "Number of requests processing.", "", running as f64);
            gauge("llamacpp:requests_deferred", "Number of requests deferred.", "", queued as f64);
            out.push_str(&llama_counts(&st));
        }
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], out).into_response()
}

const WORDS: &[&str] = &[" the", " model", " speaks", " slowly", " and", " every", " token", " counts", "."];

/// One request in flight: counted while alive (running or queued), removed
/// from the server's request set when dropped (finished or cancelled).
struct Req {
    st: St,
    /// The server's number of it (llama.cpp's task id).
    n: u64,
    rid: String,
    permit: Option<tokio::sync::OwnedSemaphorePermit>,
    /// This request's verify steps so far (its `spec_verify_ct`).
    verify: Arc<AtomicU64>,
}

impl Req {
    /// Waits for a running slot (`max_running_requests`), queued meanwhile.
    async fn start(st: &St) -> Req {
        let n = st.next_rid.fetch_add(1, Ordering::SeqCst);
        let rid = format!("{:016x}{:016x}", std::process::id(), n.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        st.rids.lock().unwrap_or_else(|e| e.into_inner()).insert(rid.clone());
        st.queued.fetch_add(1, Ordering::SeqCst);
        let permit = st.slots.clone().acquire_owned().await.expect("the slot semaphore is never closed");
        st.queued.fetch_sub(1, Ordering::SeqCst);
        st.running.fetch_add(1, Ordering::SeqCst);
        Req { st: st.clone(), n, rid, permit: Some(permit), verify: Arc::new(AtomicU64::new(0)) }
    }
}

impl Drop for Req {
    fn drop(&mut self) {
        if self.permit.take().is_some() {
            self.st.running.fetch_sub(1, Ordering::SeqCst);
        }
        self.st.finished.fetch_add(1, Ordering::SeqCst);
        if self.st.launch.flavour == Flavour::LlamaCpp && *self.st.abort.borrow() {
            // Its client went away after the stop (`llama-cpp/sigterm/sigterm-load.default.log`).
            logs::line(Flavour::LlamaCpp, "warning", &format!("srv          stop: cancel task, id_task = {}", self.n));
        }
        self.st.rids.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.rid);
    }
}

fn gen_params(body: &Value, key_max: &[&str], default_max: u64) -> (String, u64, bool) {
    let prompt = match &body["text"] {
        Value::String(s) => s.clone(),
        _ => match &body["prompt"] {
            Value::String(s) => s.clone(),
            _ => String::new(),
        },
    };
    let mut max = default_max;
    for k in key_max {
        if let Some(n) = body.pointer(k).and_then(Value::as_u64) {
            max = n;
        }
    }
    (prompt, max, body["stream"].as_bool().unwrap_or(false))
}

fn sse(chunks: impl futures_util::Stream<Item = String> + Send + 'static) -> Response {
    sse_as("text/event-stream", chunks)
}

fn sse_as(content_type: &'static str, chunks: impl futures_util::Stream<Item = String> + Send + 'static) -> Response {
    use futures_util::StreamExt;
    let body = Body::from_stream(chunks.map(|s| Ok::<Bytes, std::convert::Infallible>(Bytes::from(s))));
    ([(header::CONTENT_TYPE, content_type), (header::CACHE_CONTROL, "no-cache")], body).into_response()
}

type Chunk = dyn Fn(&Req, u64, &str, &str, bool) -> Option<String> + Send + Sync;

/// Where one request's generation stands.
struct Gen {
    req: Req,
    /// Tokens produced.
    i: u64,
    text: String,
    ended: bool,
    /// Tokens left in the current verify step's burst.
    left: u64,
    /// When the timed model's next step ends (the first one after the prefill).
    next_at: Option<tokio::time::Instant>,
}

/// Generates `max` tokens, calling `chunk` for each (request, index, cumulative text, token
/// text, last?) and yielding its output, then `done` if any. Tokens come in verify steps
/// ([`Perf::burst`] tokens each, counted as the request's and the server's evidence). With the
/// timed model each step takes [`Perf::step_time`] at the current batch size, after a prefill
/// of `prompt_tokens`, and a step's tokens are sent together; otherwise each token takes
/// 1 / `tokens_per_sec`. The request stays in flight until the stream has been consumed (or
/// dropped by a client that went away).
fn token_stream(
    req: Req,
    max: u64,
    prompt_tokens: u64,
    chunk: Box<Chunk>,
    done: Option<String>,
) -> impl futures_util::Stream<Item = String> + Send + 'static {
    let g = Gen { req, i: 0, text: String::new(), ended: false, left: 0, next_at: None };
    futures_util::stream::unfold(g, move |mut g| {
        let mut wait_until = None;
        let mut wait_for = None;
        let step = if g.ended {
            None
        } else if g.i >= max {
            g.ended = true;
            done.clone()
        } else {
            let st = g.req.st.clone();
            let perf = &st.perf;
            if g.left == 0 {
                if g.i == 0 && st.launch.flavour == Flavour::Vllm {
                    // vLLM's first token comes from the prefill: no draft, no verify step.
                    st.prefill_step();
                    g.left = 1;
                } else {
                    g.left = st.new_step(&g.req.verify, max - g.i);
                }
                if perf.timed {
                    let now = tokio::time::Instant::now();
                    let start = *g.next_at.get_or_insert_with(|| now + perf.prefill_time(prompt_tokens));
                    let at = start + perf.step_time(st.running.load(Ordering::SeqCst));
                    g.next_at = Some(at);
                    wait_until = Some(at);
                }
            }
            if !perf.timed {
                wait_for = Some(perf.token_time());
            }
            g.left -= 1;
            let w = WORDS[(g.i as usize) % WORDS.len()];
            g.text.push_str(w);
            g.i += 1;
            Some(chunk(&g.req, g.i, &g.text, w, g.i == max).unwrap_or_default())
        };
        let mut abort = g.req.st.abort.subscribe();
        async move {
            step.as_ref()?;
            let pace = async {
                if let Some(at) = wait_until {
                    tokio::time::sleep_until(at).await;
                }
                if let Some(d) = wait_for {
                    tokio::time::sleep(d).await;
                }
            };
            tokio::select! {
                biased;
                _ = async { abort.wait_for(|a| *a).await.is_ok() } => {
                    // The engine stopped: this request never goes on (until its client goes).
                    std::future::pending::<()>().await;
                }
                _ = pace => {}
            }
            if !g.ended {
                g.req.st.generated.fetch_add(1, Ordering::SeqCst);
            }
            step.map(|c| (c, g))
        }
    })
}

fn sglang_meta(req: &Req, prompt_tokens: usize, n: u64, last: bool, max: u64) -> Value {
    let mut meta = json!({
        "id": req.rid,
        "finish_reason": if last { json!({"type": "length", "length": max}) } else { Value::Null },
        "prompt_tokens": prompt_tokens,
        "completion_tokens": n,
        "cached_tokens": 0,
    });
    if req.st.spec_on() {
        spec_meta(&mut meta, n, req.verify.load(Ordering::SeqCst));
    }
    meta
}

/// SGLang's evidence of one request: its verify steps, and its tokens per step.
fn spec_meta(meta: &mut Value, tokens: u64, verify_ct: u64) {
    meta["spec_verify_ct"] = json!(verify_ct);
    meta["spec_accept_length"] = json!(if verify_ct == 0 { 0.0 } else { tokens as f64 / verify_ct as f64 });
}

async fn sglang_generate(State(st): State<St>, body: Bytes) -> Response {
    let body: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            return (StatusCode::BAD_REQUEST, axum::Json(json!({"error": {"message": e.to_string(), "code": 400}})))
                .into_response();
        }
    };
    let (prompt, max, stream) = gen_params(&body, &["/sampling_params/max_new_tokens"], 128);
    let prompt_tokens = prompt.split_whitespace().count().max(1);
    let req = Req::start(&st).await;
    if stream {
        let s = token_stream(
            req,
            max,
            prompt_tokens as u64,
            Box::new(move |r, n, text, _w, last| {
                let c = json!({"text": text, "meta_info": sglang_meta(r, prompt_tokens, n, last, max)});
                Some(format!("data: {c}\n\n"))
            }),
            Some("data: [DONE]\n\n".to_string()),
        );
        return sse(s);
    }
    let rid = req.rid.clone();
    let spec = st.spec_on();
    let verify = req.verify.clone();
    let s = token_stream(
        req,
        max,
        prompt_tokens as u64,
        Box::new(|_, _, text, _, last| last.then(|| text.to_string())),
        None,
    );
    use futures_util::StreamExt;
    let text: String = s.collect::<Vec<_>>().await.concat();
    let mut meta = json!({
        "id": rid, "finish_reason": {"type": "length", "length": max},
        "prompt_tokens": prompt_tokens, "completion_tokens": max, "cached_tokens": 0,
    });
    if spec {
        spec_meta(&mut meta, max, verify.load(Ordering::SeqCst));
    }
    axum::Json(json!({"text": text, "meta_info": meta})).into_response()
}

async fn openai_completions(State(st): State<St>, body: Bytes) -> Response {
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let (prompt, max, stream) = gen_params(&body, &["/max_tokens"], 16);
    let prompt_tokens = prompt.split_whitespace().count().max(1) as u64;
    if let Some(v) = st.launch.vllm.as_deref() {
        return vllm_completions(&st, v, &body, max, stream, prompt_tokens).await;
    }
    let a = &st.launch.args;
    let served = match st.launch.flavour {
        Flavour::Sglang => a["served_model_name"].clone(),
        Flavour::Vllm => unreachable!("vLLM answered above"),
        Flavour::LlamaCpp => a.get("alias").cloned().unwrap_or_else(|| a["model_path"].clone()),
    };
    let model = if body["model"].is_string() { body["model"].clone() } else { served };
    let req = Req::start(&st).await;
    let id = format!("cmpl-{}", req.rid);
    if stream {
        let s = token_stream(
            req,
            max,
            prompt_tokens,
            Box::new(move |_, _, _, w, last| {
                let c = json!({"id": id, "object": "text_completion", "model": model,
                    "choices": [{"index": 0, "text": w, "finish_reason": if last { json!("length") } else { Value::Null }}]});
                Some(format!("data: {c}\n\n"))
            }),
            Some("data: [DONE]\n\n".to_string()),
        );
        return sse(s);
    }
    let s = token_stream(req, max, prompt_tokens, Box::new(|_, _, text, _, last| last.then(|| text.to_string())), None);
    use futures_util::StreamExt;
    let text: String = s.collect::<Vec<_>>().await.concat();
    axum::Json(json!({"id": id, "object": "text_completion", "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": max, "total_tokens": prompt_tokens + max}}))
    .into_response()
}

/// An exception uvicorn logs after the access line of the request that raised it.
#[derive(Clone)]
struct AsgiException(&'static str);

/// A request vLLM receives after SIGTERM: its tokenizer's thread pool is shut down
/// (`vllm/real/sigterm-load.drain.*`).
fn vllm_rejected_in_shutdown() -> Response {
    let body = r#"{"error":{"message":"cannot schedule new futures after shutdown","type":"InternalServerError","param":null,"code":500}}"#;
    let mut r = (StatusCode::INTERNAL_SERVER_ERROR, [(header::CONTENT_TYPE, "application/json")], body).into_response();
    r.extensions_mut().insert(AsgiException(
        "ERROR:    Exception in ASGI application
Traceback (most recent call last):
  File \"/opt/vllm/lib/python3.11/site-packages/uvicorn/protocols/http/httptools_impl.py\", line 420, in run_asgi
    result = await app(  # type: ignore[func-returns-value]
             ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File \"/opt/vllm/lib/python3.11/site-packages/vllm/utils/async_utils.py\", line 41, in _async_wrapper
    return loop.run_in_executor(executor=executor, func=p_func)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File \"uvloop/loop.pyx\", line 2758, in uvloop.loop.Loop.run_in_executor
  File \"/opt/vllm/lib/python3.11/site-packages/vllm/renderers/base.py\", line 94, in submit
    return self._inner.submit(fn, *args, **kwargs)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File \"/usr/lib/python3.11/concurrent/futures/thread.py\", line 167, in submit
    raise RuntimeError('cannot schedule new futures after shutdown')
RuntimeError: cannot schedule new futures after shutdown",
    ));
    r
}

/// vLLM 0.32's `/v1/completions`: its reply's fields, its stream's chunks (the last with the
/// system fingerprint), `text/event-stream; charset=utf-8`.
async fn vllm_completions(
    st: &St,
    v: &vllm::Vllm,
    body: &Value,
    max: u64,
    stream: bool,
    prompt_tokens: u64,
) -> Response {
    if st.phase() == DRAINING {
        return vllm_rejected_in_shutdown();
    }
    let model = body["model"].as_str().map(str::to_string).unwrap_or_else(|| v.served_names()[0].clone());
    st.prompt_tokens.fetch_add(prompt_tokens, Ordering::SeqCst);
    let req = Req::start(st).await;
    let id = format!("cmpl-{}", &req.rid[req.rid.len() - 16..]);
    let created = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let fingerprint = format!("vllm-{}-{}", vllm::VERSION, &hex16(0)[..8]);
    if stream {
        let s = token_stream(
            req,
            max,
            prompt_tokens,
            Box::new(move |_, _, _, w, last| {
                let mut c = json!({"id": id, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": 0, "text": w, "logprobs": null,
                        "finish_reason": if last { json!("length") } else { Value::Null },
                        "stop_reason": null, "prompt_token_ids": null, "token_ids": null}]});
                if last {
                    c["system_fingerprint"] = json!(fingerprint);
                }
                Some(format!("data: {c}\n\n"))
            }),
            Some("data: [DONE]\n\n".to_string()),
        );
        return sse_as("text/event-stream; charset=utf-8", s);
    }
    let s = token_stream(req, max, prompt_tokens, Box::new(|_, _, text, _, last| last.then(|| text.to_string())), None);
    use futures_util::StreamExt;
    let text: String = s.collect::<Vec<_>>().await.concat();
    axum::Json(json!({
        "id": id, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": "length", "stop_reason": null,
            "token_ids": null, "prompt_logprobs": null, "prompt_token_ids": null, "routed_experts": null}],
        "service_tier": null, "system_fingerprint": fingerprint,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + max, "completion_tokens": max,
            "prompt_tokens_details": null, "completion_tokens_details": null},
        "kv_transfer_params": null, "ec_transfer_params": null, "metrics": null,
    }))
    .into_response()
}

async fn llama_completion(State(st): State<St>, body: Bytes) -> Response {
    if st.phase() == LOADING {
        return llama_health(State(st)).await;
    }
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let (prompt, max, stream) = gen_params(&body, &["/n_predict"], 16);
    let prompt_tokens = prompt.split_whitespace().count().max(1) as u64;
    let req = Req::start(&st).await;
    if stream {
        let s = token_stream(
            req,
            max,
            prompt_tokens,
            Box::new(|_, _, _, w, last| Some(format!("data: {}\n\n", json!({"content": w, "stop": last})))),
            None,
        );
        return sse(s);
    }
    let spec = st.spec_on();
    let verify = req.verify.clone();
    let s = token_stream(req, max, prompt_tokens, Box::new(|_, _, text, _, last| last.then(|| text.to_string())), None);
    use futures_util::StreamExt;
    let text: String = s.collect::<Vec<_>>().await.concat();
    let mut timings = json!({"predicted_n": max, "prompt_n": 1});
    // llama-server adds the draft counts only when something was drafted: each verify step
    // drafted up to n-max tokens and kept all but the target's own one of its burst.
    if spec && max > 0 {
        let steps = verify.load(Ordering::SeqCst);
        timings["draft_n"] = json!(steps * u64::from(st.perf.k));
        timings["draft_n_accepted"] = json!(max - steps);
    }
    axum::Json(json!({"content": text, "stop": true, "tokens_predicted": max, "timings": timings})).into_response()
}
