//! A load generator that counts every request: `clients` threads each send streaming
//! completions back to back (a new one as soon as the last ended, on a new connection) until
//! [`Traffic::stop`]; every request is recorded with when it was sent, when its first byte and
//! its end came, and how it ended.
//!
//! A request **succeeded** only if it completed whole: HTTP 200, the stream's final chunk (a
//! `finish_reason`, llama.cpp's `"stop": true`), `data: [DONE]` where the API sends it, and the
//! body ended as HTTP says it ends (the last chunk of a chunked body). Anything else is a
//! failure of one kind ([`Failure`]): the connection refused, reset, closed before a status
//! line; an HTTP status other than 200; an error chunk in the stream; a stream cut short; no
//! byte for [`Load::timeout`].
//!
//! [`Summary`] gives the counts, the longest time without a success (the gap: what a user of
//! the service sees as an outage) and the successes per second (the capacity left).
//!
//! ```no_run
//! use specd_e2e::traffic::{Api, Load, Traffic};
//! let t = Traffic::start(Load::new(8000, Api::OpenAiCompletions));
//! // ... roll the servers behind port 8000 ...
//! let s = t.stop();
//! assert_eq!(s.failed_total(), 0, "{s}");
//! ```

use serde_json::Value;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The completion API the clients call (all streamed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    /// SGLang's `POST /generate` (`sampling_params.max_new_tokens`): chunks with
    /// `meta_info.finish_reason`, then `[DONE]`.
    SglangGenerate,
    /// OpenAI's `POST /v1/completions` (vLLM, SGLang, llama-server): chunks with
    /// `choices[].finish_reason`, then `[DONE]`.
    OpenAiCompletions,
    /// llama-server's `POST /completion` (`n_predict`): the last chunk has `"stop": true`; no
    /// `[DONE]`.
    LlamaCompletion,
}

impl Api {
    fn path(self) -> &'static str {
        match self {
            Api::SglangGenerate => "/generate",
            Api::OpenAiCompletions => "/v1/completions",
            Api::LlamaCompletion => "/completion",
        }
    }

    fn body(self, prompt: &str, max_tokens: u32, model: Option<&str>, stream: bool) -> String {
        let mut v = match self {
            Api::SglangGenerate => serde_json::json!({
                "text": prompt, "sampling_params": {"max_new_tokens": max_tokens}, "stream": stream,
            }),
            Api::OpenAiCompletions => serde_json::json!({
                "prompt": prompt, "max_tokens": max_tokens, "stream": stream, "ignore_eos": true,
            }),
            Api::LlamaCompletion => serde_json::json!({"prompt": prompt, "n_predict": max_tokens, "stream": stream}),
        };
        if let Some(m) = model {
            v["model"] = Value::from(m);
        }
        v.to_string()
    }

    /// Whether `chunk` (a `data:` payload, or a whole answer) is the stream's final one.
    fn is_final(self, chunk: &Value) -> bool {
        match self {
            Api::SglangGenerate => !chunk["meta_info"]["finish_reason"].is_null(),
            Api::OpenAiCompletions => {
                chunk["choices"].as_array().is_some_and(|c| c.iter().any(|c| !c["finish_reason"].is_null()))
            }
            Api::LlamaCompletion => chunk["stop"] == Value::Bool(true),
        }
    }

    fn sends_done(self) -> bool {
        self != Api::LlamaCompletion
    }
}

/// What the clients send, and where.
#[derive(Clone, Debug)]
pub struct Load {
    /// `addr`:`port` (HAProxy's frontend, or a server).
    pub port: u16,
    /// 127.0.0.1 unless set (`::1`: the clients of a server listening on IPv6).
    pub addr: std::net::IpAddr,
    pub api: Api,
    /// Streamed (the default), or whole answers (`"stream": false`: complete when the answer
    /// is the final one).
    pub stream: bool,
    /// Client threads, each with one request at a time.
    pub clients: usize,
    /// Tokens asked of each request: keep generations short, so that requests come often.
    pub max_tokens: u32,
    pub prompt: String,
    /// The `model` field, if any.
    pub model: Option<String>,
    /// A request with no byte for this long has failed (`timeout`), and its connection is
    /// closed.
    pub timeout: Duration,
    /// The network namespace the clients connect from (a box's own, `SystemdBox::net_ns`);
    /// `None`: this process's.
    pub net_ns: Option<std::path::PathBuf>,
}

impl Load {
    /// 4 clients, 16 tokens a request, a 10 s timeout.
    pub fn new(port: u16, api: Api) -> Load {
        Load {
            port,
            addr: std::net::IpAddr::from([127, 0, 0, 1]),
            api,
            stream: true,
            clients: 4,
            max_tokens: 16,
            prompt: "the quick brown fox".into(),
            model: None,
            timeout: Duration::from_secs(10),
            net_ns: None,
        }
    }
}

/// Why a request failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Failure {
    /// The connection was refused.
    Refused,
    /// Connecting failed otherwise, or took longer than the timeout.
    Connect(String),
    /// The connection was closed before a status line came.
    NoReply,
    /// The connection was reset (or another I/O error) after it was made.
    Reset(String),
    /// An HTTP status other than 200, and the start of its body.
    Status(u16, String),
    /// The stream carried an error (`data: {"error": …}`).
    ErrorChunk(String),
    /// The stream ended without its end: no final chunk, no `[DONE]`, or a chunked body cut
    /// short. The last data line seen.
    Cut(String),
    /// No byte for [`Load::timeout`].
    Timeout,
}

impl Failure {
    /// A short name of the kind, for counting: `refused`, `connect`, `no-reply`, `reset`,
    /// `http-503`, `error-chunk`, `cut`, `timeout`.
    pub fn kind(&self) -> String {
        match self {
            Failure::Refused => "refused".into(),
            Failure::Connect(_) => "connect".into(),
            Failure::NoReply => "no-reply".into(),
            Failure::Reset(_) => "reset".into(),
            Failure::Status(c, _) => format!("http-{c}"),
            Failure::ErrorChunk(_) => "error-chunk".into(),
            Failure::Cut(_) => "cut".into(),
            Failure::Timeout => "timeout".into(),
        }
    }
}

/// One request: times from the start of the traffic.
#[derive(Clone, Debug)]
pub struct Record {
    pub client: usize,
    pub sent: Duration,
    /// The first byte of the answer (its status line), if any came.
    pub first_byte: Option<Duration>,
    pub end: Duration,
    /// `data:` lines received.
    pub chunks: u64,
    pub result: Result<(), Failure>,
}

impl Record {
    pub fn ok(&self) -> bool {
        self.result.is_ok()
    }
}

#[derive(Default)]
struct Live {
    sent: AtomicU64,
    succeeded: AtomicU64,
    failed: AtomicU64,
}

/// Traffic under way; [`Traffic::stop`] ends it and sums it up.
pub struct Traffic {
    stop: Arc<AtomicBool>,
    live: Arc<Live>,
    records: Arc<Mutex<Vec<Record>>>,
    threads: Vec<std::thread::JoinHandle<()>>,
    t0: Instant,
}

impl Traffic {
    /// Starts `load.clients` clients at once.
    pub fn start(load: Load) -> Traffic {
        let t0 = Instant::now();
        let stop = Arc::new(AtomicBool::new(false));
        let live = Arc::new(Live::default());
        let records = Arc::new(Mutex::new(Vec::new()));
        let threads = (0..load.clients)
            .map(|i| {
                let (load, stop, live, records) = (load.clone(), stop.clone(), live.clone(), records.clone());
                std::thread::spawn(move || {
                    if let Some(ns) = &load.net_ns {
                        enter_net_ns(ns);
                    }
                    while !stop.load(Ordering::SeqCst) {
                        live.sent.fetch_add(1, Ordering::SeqCst);
                        let r = request(&load, i, t0);
                        if r.ok() {
                            live.succeeded.fetch_add(1, Ordering::SeqCst);
                        } else {
                            live.failed.fetch_add(1, Ordering::SeqCst);
                        }
                        records.lock().unwrap().push(r);
                    }
                })
            })
            .collect();
        Traffic { stop, live, records, threads, t0 }
    }

    /// Requests sent, succeeded and failed so far (those in flight are sent only).
    pub fn counts(&self) -> (u64, u64, u64) {
        (
            self.live.sent.load(Ordering::SeqCst),
            self.live.succeeded.load(Ordering::SeqCst),
            self.live.failed.load(Ordering::SeqCst),
        )
    }

    /// Waits until `n` more requests have succeeded than now (at most `timeout`): traffic
    /// flows. Fails naming the failures seen meanwhile.
    pub fn wait_successes(&self, n: u64, timeout: Duration) -> anyhow::Result<()> {
        let (_, ok0, failed0) = self.counts();
        crate::wait_until(&format!("{n} more successful requests"), timeout, || self.counts().1 >= ok0 + n).map_err(
            |e| {
                let recs = self.records.lock().unwrap();
                let fails: Vec<String> = recs
                    .iter()
                    .filter_map(|r| r.result.as_ref().err())
                    .skip(failed0 as usize)
                    .take(5)
                    .map(|f| format!("{f:?}"))
                    .collect();
                e.context(format!("failures meanwhile: {fails:?}"))
            },
        )
    }

    /// Time since the traffic started (the records' clock).
    pub fn now(&self) -> Duration {
        self.t0.elapsed()
    }

    /// When the traffic started: the records' times are from then.
    pub fn started(&self) -> Instant {
        self.t0
    }

    /// Stops sending; the requests in flight end (or time out) and are counted; sums up.
    pub fn stop(mut self) -> Summary {
        let until = self.t0.elapsed();
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        let mut records = std::mem::take(&mut *self.records.lock().unwrap());
        records.sort_by_key(|r| r.sent);
        Summary::of(records, until)
    }
}

impl Drop for Traffic {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The sum of the traffic.
#[derive(Clone, Debug)]
pub struct Summary {
    pub sent: u64,
    pub succeeded: u64,
    /// Failures by [`Failure::kind`].
    pub failed: BTreeMap<String, u64>,
    /// The longest time without a request succeeding (between two successes' ends, or from
    /// the start to the first, or from the last to the stop), and when it began.
    pub longest_gap: Duration,
    pub gap_from: Duration,
    /// Successes ended in each second of the traffic (the last, partial second left out when
    /// it is not the only one).
    pub per_second: Vec<u64>,
    /// From the start to [`Traffic::stop`].
    pub duration: Duration,
    pub records: Vec<Record>,
}

impl Summary {
    fn of(records: Vec<Record>, until: Duration) -> Summary {
        let mut failed = BTreeMap::new();
        let mut ends: Vec<Duration> = Vec::new();
        for r in &records {
            match &r.result {
                Ok(()) => ends.push(r.end),
                Err(f) => *failed.entry(f.kind()).or_insert(0) += 1,
            }
        }
        ends.sort();
        let mut longest_gap = Duration::ZERO;
        let mut gap_from = Duration::ZERO;
        let mut prev = Duration::ZERO;
        for &e in ends.iter().chain(std::iter::once(&until.max(ends.last().copied().unwrap_or_default()))) {
            if e.saturating_sub(prev) > longest_gap {
                longest_gap = e - prev;
                gap_from = prev;
            }
            prev = e;
        }
        let secs = (until.as_secs() as usize).max(1);
        let mut per_second = vec![0; secs];
        for e in &ends {
            if let Some(n) = per_second.get_mut(e.as_secs() as usize) {
                *n += 1;
            }
        }
        Summary {
            sent: records.len() as u64,
            succeeded: ends.len() as u64,
            failed,
            longest_gap,
            gap_from,
            per_second,
            duration: until,
            records,
        }
    }

    pub fn failed_total(&self) -> u64 {
        self.failed.values().sum()
    }

    /// Successes per second over the whole traffic.
    pub fn rate(&self) -> f64 {
        self.succeeded as f64 / self.duration.as_secs_f64().max(1e-9)
    }

    /// The failed requests.
    pub fn failures(&self) -> impl Iterator<Item = &Record> {
        self.records.iter().filter(|r| !r.ok())
    }
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} sent, {} succeeded, {} failed {:?} in {:.1} s ({:.1}/s); longest gap {:.2} s from {:.2} s; per second {:?}",
            self.sent,
            self.succeeded,
            self.failed_total(),
            self.failed,
            self.duration.as_secs_f64(),
            self.rate(),
            self.longest_gap.as_secs_f64(),
            self.gap_from.as_secs_f64(),
            self.per_second,
        )?;
        for r in self.failures().take(5) {
            write!(
                f,
                "\n  client {} sent {:.2} s, ended {:.2} s after {} chunks: {:?}",
                r.client,
                r.sent.as_secs_f64(),
                r.end.as_secs_f64(),
                r.chunks,
                r.result
            )?;
        }
        Ok(())
    }
}

/// One request of `load`, recorded.
fn request(load: &Load, client: usize, t0: Instant) -> Record {
    let sent = t0.elapsed();
    let mut first_byte = None;
    let mut chunks = 0;
    let result = exchange(load, &mut || first_byte = first_byte.or(Some(t0.elapsed())), &mut chunks);
    Record { client, sent, first_byte, end: t0.elapsed(), chunks, result }
}

/// This thread (only) into the network namespace at `ns` (setns(2) moves the calling thread).
fn enter_net_ns(ns: &std::path::Path) {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(ns).unwrap_or_else(|e| panic!("open {}: {e}", ns.display()));
    // SAFETY: a valid descriptor of a namespace file, for the calling thread.
    let r = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(r, 0, "setns {}: {}", ns.display(), std::io::Error::last_os_error());
}

fn io_failure(e: std::io::Error) -> Failure {
    use std::io::ErrorKind::*;
    match e.kind() {
        WouldBlock | TimedOut => Failure::Timeout,
        UnexpectedEof => Failure::Cut(String::new()),
        _ => Failure::Reset(e.to_string()),
    }
}

fn exchange(load: &Load, first: &mut dyn FnMut(), chunks: &mut u64) -> Result<(), Failure> {
    let addr = std::net::SocketAddr::new(load.addr, load.port);
    let s = TcpStream::connect_timeout(&addr, load.timeout).map_err(|e| match e.kind() {
        std::io::ErrorKind::ConnectionRefused => Failure::Refused,
        _ => Failure::Connect(e.to_string()),
    })?;
    s.set_read_timeout(Some(load.timeout)).map_err(|e| Failure::Connect(e.to_string()))?;
    let _ = s.set_nodelay(true);
    let body = load.api.body(&load.prompt, load.max_tokens, load.model.as_deref(), load.stream);
    let req = format!(
        "POST {} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
        load.api.path(),
        body.len()
    );
    (&s).write_all(req.as_bytes()).map_err(io_failure)?;
    let mut rd = BufReader::new(&s);
    let mut line = String::new();
    match rd.read_line(&mut line) {
        Ok(0) => return Err(Failure::NoReply),
        Ok(_) => first(),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Err(Failure::NoReply),
        Err(e) => return Err(io_failure(e)),
    }
    let status: u16 = line.split_whitespace().nth(1).and_then(|c| c.parse().ok()).ok_or(Failure::NoReply)?;
    let mut chunked = false;
    let mut length = None;
    loop {
        line.clear();
        if rd.read_line(&mut line).map_err(io_failure)? == 0 {
            return Err(Failure::Cut("the headers".into()));
        }
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
            if k == "transfer-encoding" && v.eq_ignore_ascii_case("chunked") {
                chunked = true;
            } else if k == "content-length" {
                length = v.parse::<usize>().ok();
            }
        }
    }
    let mut sse = Sse::new(load.api);
    let whole = if chunked {
        read_chunked(&mut rd, &mut |b| sse.feed(b, chunks))
    } else if let Some(n) = length {
        let mut buf = vec![0; n];
        rd.read_exact(&mut buf).map(|_| sse.feed(&buf, chunks)).map_err(io_failure)
    } else {
        let mut buf = Vec::new();
        rd.read_to_end(&mut buf).map(|_| sse.feed(&buf, chunks)).map_err(io_failure)
    };
    if status != 200 {
        let text = String::from_utf8_lossy(&sse.body).chars().take(300).collect();
        return Err(Failure::Status(status, text));
    }
    if !load.stream {
        whole?;
        return match serde_json::from_slice::<Value>(&sse.body) {
            Ok(v) if load.api.is_final(&v) => Ok(()),
            _ => Err(Failure::Cut(String::from_utf8_lossy(&sse.body).chars().take(300).collect())),
        };
    }
    if let Some(e) = sse.error.take() {
        return Err(Failure::ErrorChunk(e));
    }
    whole.map_err(|f| match f {
        Failure::Cut(_) => Failure::Cut(sse.last.clone()),
        f => f,
    })?;
    if sse.final_seen && (sse.done || !load.api.sends_done()) { Ok(()) } else { Err(Failure::Cut(sse.last.clone())) }
}

/// A chunked body: each chunk's bytes to `out`; `Ok` once the last (empty) chunk came.
fn read_chunked(rd: &mut impl BufRead, out: &mut dyn FnMut(&[u8])) -> Result<(), Failure> {
    let mut line = String::new();
    loop {
        line.clear();
        if rd.read_line(&mut line).map_err(io_failure)? == 0 {
            return Err(Failure::Cut(String::new()));
        }
        let size = usize::from_str_radix(line.trim().split(';').next().unwrap_or(""), 16)
            .map_err(|_| Failure::Cut(format!("a bad chunk size {line:?}")))?;
        let mut buf = vec![0; size + 2];
        rd.read_exact(&mut buf).map_err(io_failure)?;
        if size == 0 {
            return Ok(());
        }
        out(&buf[..size]);
    }
}

/// Server-sent events read as they come.
struct Sse {
    api: Api,
    body: Vec<u8>,
    /// Bytes of an unfinished line.
    pending: Vec<u8>,
    last: String,
    final_seen: bool,
    done: bool,
    error: Option<String>,
}

impl Sse {
    fn new(api: Api) -> Sse {
        Sse {
            api,
            body: Vec::new(),
            pending: Vec::new(),
            last: String::new(),
            final_seen: false,
            done: false,
            error: None,
        }
    }

    fn feed(&mut self, bytes: &[u8], chunks: &mut u64) {
        if self.body.len() < 1 << 20 {
            self.body.extend_from_slice(&bytes[..bytes.len().min((1 << 20) - self.body.len())]);
        }
        self.pending.extend_from_slice(bytes);
        while let Some(i) = self.pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.pending.drain(..=i).collect();
            let line = String::from_utf8_lossy(&line).trim_end().to_string();
            let Some(data) = line.strip_prefix("data:").map(str::trim_start) else { continue };
            *chunks += 1;
            if data == "[DONE]" {
                self.done = true;
                continue;
            }
            self.last = data.to_string();
            match serde_json::from_str::<Value>(data) {
                Ok(v) if v.get("error").is_some() || v["object"] == "error" => {
                    self.error.get_or_insert_with(|| data.to_string());
                }
                Ok(v) => self.final_seen |= self.api.is_final(&v),
                Err(_) => {}
            }
        }
    }
}
