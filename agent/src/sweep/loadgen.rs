//! The load generator of `specd sweep`: streaming requests at a concurrency level against a
//! running server, timed per token, with the engine's own evidence of speculation around them.
//!
//! Two APIs: SGLang's native `POST /generate` (`"stream": true`: `data: {json}` lines whose
//! `text` is the output so far and whose `meta_info` counts `completion_tokens` and, when it
//! speculates, `spec_verify_ct`; then `data: [DONE]`), and the OpenAI-compatible
//! `POST /v1/completions` that SGLang, vLLM and llama-server all serve (`"stream": true`, and
//! `stream_options: {include_usage: true}` so the last chunk carries the server's own
//! `usage.completion_tokens`; llama-server's last chunk also has `timings.draft_n` /
//! `timings.draft_n_accepted`). Token counts are the server's where it gives them, else one per
//! chunk that carried text.
//!
//! Accept length / rate per level come from the same evidence the apply's speculation proof
//! reads (`speculation.rs`): SGLang's verify passes and tokens summed over the level's requests,
//! llama.cpp's draft counts summed over them, vLLM's `spec_decode` counters read from `/metrics`
//! before and after the level.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use specd_spec::{Engine, Evidence};

use crate::core::counts::Counts;
use crate::core::speculation::{self, Speculation};

/// Which HTTP API the load speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Api {
    /// SGLang's native `/generate`.
    Generate,
    /// The OpenAI-compatible `/v1/completions` (all three engines).
    Completions,
}

/// A dozen prompts written for this project: prose, code, lists, a table, a repetition; short
/// enough for a small context, varied enough that drafting meets easy and hard text.
pub const BUILTIN_PROMPTS: &[&str] = &[
    "Explain in plain words why a server that is still loading its model should answer 503 rather than refuse connections.",
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "List the planets of the solar system in order from the sun, one per line, with one fact about each.",
    "Count from one to forty in words, separated by commas: one, two, three,",
    "Translate into French: The train leaves at seven in the morning and arrives before noon.",
    "Write a short story of four sentences about a lighthouse keeper who finds a letter in a bottle.",
    "Give a step-by-step recipe for a simple tomato soup for four people.",
    "Write a Rust function that reverses the words of a sentence, and a unit test for it.",
    "Summarize the rules of chess for a ten-year-old in one paragraph.",
    "Make a Markdown table of five fruits with columns: name, colour, season.",
    "Describe what happens, step by step, when you type a web address into a browser and press enter.",
    "Continue the sequence and explain the rule: 2, 4, 8, 16, 32, 64,",
];

/// Prompts from a JSONL file: one JSON object a line with a `prompt` (or `text`) string; blank
/// lines are skipped. An error names the file and the line.
pub fn prompts_from_jsonl(file: &str, text: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(line).map_err(|e| format!("{file}:{}: not a JSON object: {e}", i + 1))?;
        match v.get("prompt").or_else(|| v.get("text")).and_then(Value::as_str) {
            Some(p) => out.push(p.to_string()),
            None => return Err(format!("{file}:{}: no \"prompt\" string in this line", i + 1)),
        }
    }
    if out.is_empty() {
        return Err(format!("{file}: no prompts (one JSON object a line, with a \"prompt\" string)"));
    }
    Ok(out)
}

/// One level of load: where, what, how much.
#[derive(Clone, Debug)]
pub struct Level {
    pub base_url: String,
    pub engine: Engine,
    pub api: Api,
    /// The `model` of OpenAI requests (the served model name).
    pub model: Option<String>,
    pub concurrency: u32,
    /// Measured requests (when `duration` is unset).
    pub requests: u32,
    /// Measure for this long instead of a number of requests (requests started before the end
    /// are awaited and counted).
    pub duration: Option<Duration>,
    /// Requests sent first and not measured (at the same concurrency).
    pub warmup: u32,
    pub max_tokens: u32,
    pub prompts: Arc<Vec<String>>,
    /// The deadline of one request.
    pub timeout: Duration,
}

/// One request, as measured.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Request {
    /// Time to the first token.
    pub ttft: Option<Duration>,
    /// Gaps between tokens (a chunk of k tokens after a gap g counts as k gaps of g/k).
    pub itl: Vec<Duration>,
    pub output_tokens: u64,
    pub duration: Duration,
    pub error: Option<String>,
    /// The engine's evidence in the last chunk: SGLang (tokens, verify passes), llama.cpp
    /// (drafted, accepted).
    pub verify: Option<(u64, u64)>,
    pub drafts: Option<(u64, u64)>,
}

impl Request {
    /// Decode speed of this request: tokens after the first per second after the first.
    pub fn tok_s(&self) -> Option<f64> {
        let ttft = self.ttft?;
        let decode = self.duration.checked_sub(ttft)?.as_secs_f64();
        (self.output_tokens > 1 && decode > 0.0).then(|| (self.output_tokens - 1) as f64 / decode)
    }
}

/// What one level measured (one line of a point's results).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LevelResult {
    pub concurrency: u32,
    /// Requests that finished.
    pub requests: u32,
    pub errors: u32,
    /// The first error, as said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_error: Option<String>,
    pub output_tokens: u64,
    pub wall_s: f64,
    /// Output tokens of all requests / the level's wall time.
    pub throughput: f64,
    /// Per-request decode speed (tok/s): median and 10th percentile.
    pub tok_s_median: Option<f64>,
    pub tok_s_p10: Option<f64>,
    pub ttft_ms_p50: Option<f64>,
    pub ttft_ms_p99: Option<f64>,
    pub itl_ms_p50: Option<f64>,
    pub itl_ms_p99: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accept_length: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accept_rate: Option<f64>,
    /// The engine's fields the accept figures come from.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub evidence: Vec<String>,
    /// The engine's own counts over the level (its `/metrics` after less before; vLLM, and
    /// llama-server with `--metrics`): drafts and acceptance by position, decode steps and time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acceptance: Option<crate::core::tune::Acceptance>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode: Option<crate::core::tune::Decode>,
}

/// The engine's counts over a level, into its record: the acceptance by position and the
/// decode steps; llama-server's accept length (its replies give only the rate).
pub fn with_counts(l: &mut LevelResult, c: &Counts) {
    if c.has_drafts && c.drafts > 0.0 {
        l.acceptance = Some(c.acceptance());
        if l.accept_length.is_none() {
            l.accept_length = Some(1.0 + c.accepted / c.drafts);
        }
    }
    l.decode = c.decode();
}

/// The value at quantile `q` (0..=1) of sorted values, nearest rank.
pub fn quantile(sorted: &[f64], q: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(f64::total_cmp);
    v
}

fn ms(d: &Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The level's figures from its requests (pure).
pub fn summarize(concurrency: u32, wall: Duration, reqs: &[Request], spec: Option<Speculation>) -> LevelResult {
    let ok: Vec<&Request> = reqs.iter().filter(|r| r.error.is_none()).collect();
    let output_tokens: u64 = ok.iter().map(|r| r.output_tokens).sum();
    let wall_s = wall.as_secs_f64();
    let tok_s = sorted(ok.iter().filter_map(|r| r.tok_s()).collect());
    let ttft = sorted(ok.iter().filter_map(|r| r.ttft.as_ref().map(ms)).collect());
    let itl = sorted(ok.iter().flat_map(|r| r.itl.iter().map(ms)).collect());
    let spec = spec.filter(|s| s.accept_length.is_some() || s.accept_rate.is_some());
    LevelResult {
        concurrency,
        requests: ok.len() as u32,
        errors: (reqs.len() - ok.len()) as u32,
        first_error: reqs.iter().find_map(|r| r.error.clone()),
        output_tokens,
        wall_s,
        throughput: if wall_s > 0.0 { output_tokens as f64 / wall_s } else { 0.0 },
        tok_s_median: quantile(&tok_s, 0.5),
        tok_s_p10: quantile(&tok_s, 0.1),
        ttft_ms_p50: quantile(&ttft, 0.5),
        ttft_ms_p99: quantile(&ttft, 0.99),
        itl_ms_p50: quantile(&itl, 0.5),
        itl_ms_p99: quantile(&itl, 0.99),
        accept_length: spec.as_ref().and_then(|s| s.accept_length),
        accept_rate: spec.as_ref().and_then(|s| s.accept_rate),
        evidence: spec.map(|s| s.evidence).unwrap_or_default(),
        acceptance: None,
        decode: None,
    }
}

/// The engine's evidence of speculation over a level's requests (pure): `None` when the
/// engine showed none (a server that does not speculate, or an API that does not carry it).
pub fn level_speculation(engine: Engine, reqs: &[Request], metrics: Option<(&str, &str)>) -> Option<Speculation> {
    let ev = &specd_spec::engine_facts(engine).evidence;
    let ok = reqs.iter().filter(|r| r.error.is_none());
    match ev {
        Evidence::Sglang { verify_ct, tokens, .. } => {
            let (t, v) = ok.filter_map(|r| r.verify).fold((0, 0), |(a, b), (t, v)| (a + t, b + v));
            (v > 0).then(|| speculation::from_sglang(ev, &json!({"meta_info": {*verify_ct: v, *tokens: t}}), None))
        }
        Evidence::LlamaCpp { drafted, accepted, .. } => {
            let (d, a) = ok.filter_map(|r| r.drafts).fold((0, 0), |(x, y), (d, a)| (x + d, y + a));
            (d > 0).then(|| speculation::from_llama_cpp(ev, None, &json!({"timings": {*drafted: d, *accepted: a}})))
        }
        Evidence::Vllm { .. } => {
            let (before, after) = metrics?;
            Some(speculation::from_vllm(ev, before, after)).filter(Speculation::drafts)
        }
    }
}

/// A connection to the server under load (loopback).
const CONNECT_WITHIN: Duration = Duration::from_secs(2);
/// A read of the server's metrics (its speculation counters) before and after a level.
const METRICS_WITHIN: Duration = Duration::from_secs(5);

/// The client of a load: no proxy, a new connection per request. llama-server closes a
/// streamed answer's connection when it is done, and a kept-alive one it closed fails the next
/// request sent on it ("connection closed before message completed"); a loopback connect costs
/// far less than the TTFT it would join.
fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .connect_timeout(CONNECT_WITHIN)
        .pool_max_idle_per_host(0)
        .tls_built_in_root_certs(false)
        .build()
        .expect("an HTTP client")
}

/// Where a sweep's load goes: the server on this machine ([`run`]), or the tests' fake host.
pub trait Load {
    /// One level of load on the server, measured.
    fn load(&self, level: &Level) -> impl std::future::Future<Output = LevelResult> + Send;
}

impl Load for crate::host::RealHost {
    async fn load(&self, level: &Level) -> LevelResult {
        run(level).await
    }
}

/// The fake host's server answers each request `max_tokens` tokens in 100 ms; one that dies under
/// load (or is not there) fails every request of the level.
#[cfg(test)]
impl Load for crate::host::fake::FakeHost {
    async fn load(&self, level: &Level) -> LevelResult {
        let mut r = LevelResult { concurrency: level.concurrency, ..Default::default() };
        let n = level.requests.max(1);
        if let Err(e) = self.serve_load(&level.base_url).await {
            r.errors = n;
            r.first_error = Some(e);
            return r;
        }
        let wall = Duration::from_millis(100) * n.div_ceil(level.concurrency.max(1));
        tokio::time::sleep(wall).await;
        r.requests = n;
        r.output_tokens = u64::from(n) * u64::from(level.max_tokens);
        r.wall_s = wall.as_secs_f64();
        r.throughput = r.output_tokens as f64 / r.wall_s;
        r.tok_s_median = Some(f64::from(level.max_tokens) / 0.1);
        r.tok_s_p10 = r.tok_s_median;
        r
    }
}

/// Run one level: warm-up, then the measured requests, with the evidence around them (the
/// engine's `/metrics` before and after, where it serves them: vLLM always, llama-server with
/// `--metrics`; SGLang's replies carry its evidence).
pub async fn run(level: &Level) -> LevelResult {
    let client = client();
    if level.warmup > 0 {
        let warm = Level { requests: level.warmup, duration: None, ..level.clone() };
        drive(&client, &warm).await;
    }
    let metrics_url = format!("{}{}", level.base_url, specd_spec::engine_facts(level.engine).metrics_path);
    let vllm = matches!(specd_spec::engine_facts(level.engine).evidence, Evidence::Vllm { .. });
    let counted = level.engine != Engine::Sglang;
    let before = if counted { text(&client, &metrics_url).await } else { None };
    let start = Instant::now();
    let reqs = drive(&client, level).await;
    let wall = start.elapsed();
    let after = match (&before, vllm) {
        (Some(_), true) => after_metrics(&client, &metrics_url, before.as_deref(), level.engine).await,
        // llama-server adds a request's counts when it ends: they are all in once the level is.
        (Some(_), false) => text(&client, &metrics_url).await,
        (None, _) => None,
    };
    let metrics = before.as_deref().zip(after.as_deref());
    let spec = level_speculation(level.engine, &reqs, metrics.filter(|_| vllm));
    let mut l = summarize(level.concurrency, wall, &reqs, spec);
    if let Some((b, a)) = metrics {
        with_counts(&mut l, &Counts::read(level.engine, a).since(&Counts::read(level.engine, b)));
    }
    l
}

async fn text(client: &reqwest::Client, url: &str) -> Option<String> {
    let r = client.get(url).timeout(METRICS_WITHIN).send().await.ok()?;
    if !r.status().is_success() {
        return None;
    }
    r.text().await.ok()
}

/// vLLM updates its counters from the engine core's stats, which may reach the API server just
/// after the last reply: read them until they move, for up to two seconds.
async fn after_metrics(client: &reqwest::Client, url: &str, before: Option<&str>, engine: Engine) -> Option<String> {
    let before = before?;
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let now = text(client, url).await?;
        let moved = level_speculation(engine, &[], Some((before, &now))).is_some();
        if moved || Instant::now() >= deadline {
            return Some(now);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Failed requests in a row (across the workers) after which a level ends: a server that is
/// gone fails each request at once, and a level of a duration would spin.
const FAILURES_IN_A_ROW: u32 = 32;

/// `concurrency` workers take the next request until the count (or the duration) is reached, or
/// [`FAILURES_IN_A_ROW`] requests failed one after the other.
async fn drive(client: &reqwest::Client, level: &Level) -> Vec<Request> {
    let next = Arc::new(AtomicU32::new(0));
    let failing = Arc::new(AtomicU32::new(0));
    let end = level.duration.map(|d| Instant::now() + d);
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..level.concurrency.max(1) {
        let (client, level, next, failing) = (client.clone(), level.clone(), next.clone(), failing.clone());
        tasks.spawn(async move {
            let mut done = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                let more = match end {
                    Some(end) => Instant::now() < end,
                    None => i < level.requests,
                };
                if !more || failing.load(Ordering::SeqCst) >= FAILURES_IN_A_ROW {
                    return done;
                }
                let prompt = &level.prompts[i as usize % level.prompts.len().max(1)];
                let r = one(&client, &level, prompt).await;
                if r.error.is_some() {
                    failing.fetch_add(1, Ordering::SeqCst);
                } else {
                    failing.store(0, Ordering::SeqCst);
                }
                done.push(r);
            }
        });
    }
    let mut all = Vec::new();
    while let Some(r) = tasks.join_next().await {
        all.extend(r.unwrap_or_default());
    }
    all
}

fn body(level: &Level, prompt: &str) -> (String, Value) {
    match level.api {
        Api::Generate => (
            format!("{}/generate", level.base_url),
            json!({"text": prompt, "stream": true,
                   "sampling_params": {"max_new_tokens": level.max_tokens, "temperature": 0.0, "ignore_eos": true}}),
        ),
        Api::Completions => {
            let mut b = json!({"prompt": prompt, "max_tokens": level.max_tokens, "temperature": 0.0, "stream": true,
                               "stream_options": {"include_usage": true}, "ignore_eos": true});
            if let Some(m) = &level.model {
                b["model"] = json!(m);
            }
            (format!("{}/v1/completions", level.base_url), b)
        }
    }
}

/// One streamed request, timed.
async fn one(client: &reqwest::Client, level: &Level, prompt: &str) -> Request {
    let start = Instant::now();
    let mut r = Request::default();
    let outcome = tokio::time::timeout(level.timeout, stream(client, level, prompt, start, &mut r)).await;
    r.duration = start.elapsed();
    r.error = match outcome {
        Ok(Ok(())) if r.output_tokens == 0 => Some("the server answered no tokens".into()),
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(e),
        Err(_) => Some(format!("no complete answer within {} s", level.timeout.as_secs())),
    };
    r
}

/// What the stream said so far.
#[derive(Default)]
struct Parse {
    /// Tokens counted from the chunks (the server's cumulative count where it gives one).
    tokens: u64,
    /// The server's own final count (`usage.completion_tokens`).
    usage: Option<u64>,
    last_token_at: Option<Instant>,
    done: bool,
}

async fn stream(
    client: &reqwest::Client,
    level: &Level,
    prompt: &str,
    start: Instant,
    r: &mut Request,
) -> Result<(), String> {
    let (url, body) = body(level, prompt);
    let mut resp = client
        .post(&url)
        .json(&body)
        .send()
        .await
        .map_err(|e| format!("{url}: {}", crate::machine::probe::error_chain(&e)))?;
    if !resp.status().is_success() {
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        return Err(format!("{url} answered {status}: {}", text.chars().take(200).collect::<String>()));
    }
    let mut buf: Vec<u8> = Vec::new();
    let mut p = Parse::default();
    // The tokens of all the events that one read brings arrived together (a burst of accepted
    // draft tokens, whether the server sends it as one event or several).
    while let Some(bytes) = resp
        .chunk()
        .await
        .map_err(|e| format!("{url}: the stream broke: {}", crate::machine::probe::error_chain(&e)))?
    {
        let now = Instant::now();
        buf.extend_from_slice(&bytes);
        let mut new = 0;
        while let Some(nl) = buf.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = buf.drain(..=nl).collect();
            new += event(level.api, String::from_utf8_lossy(&line).trim(), &mut p, r)?;
        }
        arrived(new, now, start, &mut p, r);
    }
    if !buf.is_empty() {
        let new = event(level.api, String::from_utf8_lossy(&buf).trim(), &mut p, r)?;
        arrived(new, Instant::now(), start, &mut p, r);
    }
    if !p.done {
        return Err(format!("{url}: the stream ended before [DONE] (after {} tokens)", p.tokens));
    }
    r.output_tokens = p.usage.unwrap_or(p.tokens);
    Ok(())
}

/// One line of the event stream: the new tokens it brings.
fn event(api: Api, line: &str, p: &mut Parse, r: &mut Request) -> Result<u64, String> {
    let Some(data) = line.strip_prefix("data:").map(str::trim) else {
        return Ok(0);
    };
    if data == "[DONE]" {
        p.done = true;
        return Ok(0);
    }
    let v: Value = serde_json::from_str(data).map_err(|e| format!("a stream line that is not JSON ({e}): {data}"))?;
    if let Some(err) = v.get("error").filter(|e| !e.is_null()) {
        let msg = err.get("message").and_then(Value::as_str).map_or_else(|| err.to_string(), str::to_string);
        return Err(format!("the server reported an error mid-stream: {msg}"));
    }
    let new = match api {
        Api::Generate => {
            let meta = v.get("meta_info");
            let ct = meta.and_then(|m| m.get("completion_tokens")).and_then(Value::as_u64);
            if let (Some(t), Some(vc)) = (ct, meta.and_then(|m| m.get("spec_verify_ct")).and_then(Value::as_u64)) {
                r.verify = Some((t, vc));
            }
            match ct {
                Some(ct) => ct.saturating_sub(p.tokens),
                None => u64::from(v.get("text").and_then(Value::as_str).is_some_and(|t| !t.is_empty())),
            }
        }
        Api::Completions => {
            if let Some(u) = v.pointer("/usage/completion_tokens").and_then(Value::as_u64) {
                p.usage = Some(u);
            }
            if let Some(d) = v.pointer("/timings/draft_n").and_then(Value::as_u64) {
                let a = v.pointer("/timings/draft_n_accepted").and_then(Value::as_u64).unwrap_or(0);
                r.drafts = Some((d, a));
            } else if v.pointer("/timings/predicted_n").is_some() {
                // llama-server leaves the draft counts out when nothing was drafted.
                r.drafts = Some((0, 0));
            }
            let text = v.pointer("/choices/0/text").and_then(Value::as_str);
            u64::from(text.is_some_and(|t| !t.is_empty()))
        }
    };
    p.tokens += new;
    Ok(new)
}

/// `new` tokens arrived at `now`: the first is the TTFT; k tokens after a gap g count as k gaps
/// of g/k (the per-token latency a reader sees).
fn arrived(new: u64, now: Instant, start: Instant, p: &mut Parse, r: &mut Request) {
    if new > 0 {
        match p.last_token_at {
            None => r.ttft = Some(now - start),
            Some(last) => {
                let gap = (now - last) / new as u32;
                r.itl.extend(std::iter::repeat_n(gap, new as usize));
            }
        }
        if p.last_token_at.is_none() && new > 1 {
            // The first chunk brought several tokens: the first is the TTFT, the others came
            // with it.
            r.itl.extend(std::iter::repeat_n(Duration::ZERO, new as usize - 1));
        }
        p.last_token_at = Some(now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(ttft_ms: u64, itl_ms: &[u64], tokens: u64, dur_ms: u64) -> Request {
        Request {
            ttft: Some(Duration::from_millis(ttft_ms)),
            itl: itl_ms.iter().map(|m| Duration::from_millis(*m)).collect(),
            output_tokens: tokens,
            duration: Duration::from_millis(dur_ms),
            ..Request::default()
        }
    }

    #[test]
    fn quantiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.5), Some(50.0));
        assert_eq!(quantile(&v, 0.99), Some(99.0));
        assert_eq!(quantile(&v, 0.1), Some(10.0));
        assert_eq!(quantile(&[7.0], 0.99), Some(7.0));
        assert_eq!(quantile(&[], 0.5), None);
    }

    #[test]
    fn a_level_counts_tokens_over_wall_time_and_keeps_errors_apart() {
        let mut failed = Request { error: Some("boom".into()), ..Request::default() };
        failed.output_tokens = 99;
        let reqs = [req(100, &[10, 10, 30], 4, 150), req(200, &[20, 20, 20], 4, 260), failed];
        let l = summarize(2, Duration::from_millis(500), &reqs, None);
        assert_eq!((l.requests, l.errors, l.first_error.as_deref()), (2, 1, Some("boom")));
        assert_eq!(l.output_tokens, 8);
        assert!((l.throughput - 16.0).abs() < 1e-9);
        // 3 tokens after the first in 50 ms and in 60 ms.
        assert!((l.tok_s_median.unwrap() - 50.0).abs() < 1e-9, "{l:?}");
        assert!((l.tok_s_p10.unwrap() - 50.0).abs() < 1e-9);
        assert_eq!((l.ttft_ms_p50, l.ttft_ms_p99), (Some(100.0), Some(200.0)));
        assert_eq!((l.itl_ms_p50, l.itl_ms_p99), (Some(20.0), Some(30.0)));
    }

    #[test]
    fn speculation_per_level_sums_the_engines_counts() {
        let mut a = req(1, &[], 32, 10);
        a.verify = Some((32, 8));
        let mut b = req(1, &[], 16, 10);
        b.verify = Some((16, 8));
        let s = level_speculation(Engine::Sglang, &[a, b], None).unwrap();
        assert_eq!(s.accept_length, Some(3.0));
        let mut c = req(1, &[], 12, 10);
        c.drafts = Some((8, 6));
        let s = level_speculation(Engine::LlamaCpp, &[c], None).unwrap();
        assert_eq!(s.accept_rate, Some(0.75));
        assert!(level_speculation(Engine::LlamaCpp, &[req(1, &[], 12, 10)], None).is_none());
    }

    #[test]
    fn stream_events_time_tokens_and_read_the_servers_counts() {
        let t0 = Instant::now();
        let (mut p, mut r) = (Parse::default(), Request::default());
        let at = |ms| t0 + Duration::from_millis(ms);
        let g = |ct: u64, vc: u64| {
            format!(r#"data: {{"text":"x","meta_info":{{"completion_tokens":{ct},"spec_verify_ct":{vc}}}}}"#)
        };
        let mut read = |lines: &[&str], ms| {
            let new: u64 = lines.iter().map(|l| event(Api::Generate, l, &mut p, &mut r).unwrap()).sum();
            arrived(new, at(ms), t0, &mut p, &mut r);
        };
        read(&[&g(1, 1)], 50);
        read(&[&g(4, 2), ""], 80);
        // Two events in one read: their tokens arrived together.
        read(&[&g(5, 3), &g(6, 3)], 100);
        read(&["data: [DONE]"], 101);
        assert!(p.done);
        assert_eq!(p.tokens, 6);
        assert_eq!(r.ttft, Some(Duration::from_millis(50)));
        let ms = |m| Duration::from_millis(m);
        assert_eq!(r.itl, vec![ms(10), ms(10), ms(10), ms(10), ms(10)]);
        assert_eq!(r.verify, Some((6, 3)));

        let (mut p, mut r) = (Parse::default(), Request::default());
        let c = |t: &str| format!(r#"data: {{"choices":[{{"text":"{t}","index":0}}]}}"#);
        assert_eq!(event(Api::Completions, &c("a"), &mut p, &mut r), Ok(1));
        assert_eq!(event(Api::Completions, &c(""), &mut p, &mut r), Ok(0));
        let last = r#"data: {"choices":[{"text":"","finish_reason":"length"}],"usage":{"completion_tokens":3},"timings":{"predicted_n":3,"draft_n":4,"draft_n_accepted":3}}"#;
        event(Api::Completions, last, &mut p, &mut r).unwrap();
        assert_eq!((p.tokens, p.usage, r.drafts), (1, Some(3), Some((4, 3))));
        let err = event(Api::Completions, r#"data: {"error":{"message":"out of memory"}}"#, &mut p, &mut r);
        assert_eq!(err.unwrap_err(), "the server reported an error mid-stream: out of memory");
    }

    #[test]
    fn a_levels_counts_give_its_acceptance_steps_and_llama_servers_accept_length() {
        let counts = |drafts: u64, accepted: u64, tokens: u64| {
            format!(
                "llamacpp:spec_decode_num_drafts_total {drafts}\nllamacpp:spec_decode_num_accepted_tokens_total {accepted}\nllamacpp:tokens_predicted_total {tokens}\nllamacpp:tokens_predicted_seconds_total {}\nllamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position=\"0\"}} {drafts}\nllamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position=\"1\"}} {}\n",
                tokens as f64 / 100.0,
                accepted - drafts,
            )
        };
        let (before, after) = (counts(10, 15, 40), counts(30, 45, 120));
        let mut l = LevelResult::default();
        with_counts(&mut l, &Counts::read(Engine::LlamaCpp, &after).since(&Counts::read(Engine::LlamaCpp, &before)));
        assert_eq!(l.acceptance, Some(crate::core::tune::Acceptance { drafts: 20, per_pos: vec![20, 10] }));
        assert_eq!(l.accept_length, Some(2.5));
        // 80 tokens, 30 of them accepted: 50 steps in 0.8 s.
        let d = l.decode.unwrap();
        assert_eq!((d.steps, d.tokens), (50, 80));
        assert!((d.seconds - 0.8).abs() < 1e-9);
    }

    #[test]
    fn jsonl_prompts_name_the_line_of_a_bad_one() {
        assert_eq!(prompts_from_jsonl("p.jsonl", "{\"prompt\":\"a\"}\n\n{\"text\":\"b\"}\n").unwrap(), ["a", "b"]);
        assert_eq!(
            prompts_from_jsonl("p.jsonl", "{\"prompt\":\"a\"}\n{\"q\":1}\n").unwrap_err(),
            "p.jsonl:2: no \"prompt\" string in this line"
        );
        assert!(
            prompts_from_jsonl("p.jsonl", "{\"prompt\":\"a\"}\nnope\n")
                .unwrap_err()
                .starts_with("p.jsonl:2: not a JSON object")
        );
        assert!(prompts_from_jsonl("p.jsonl", "\n").is_err());
    }
}
