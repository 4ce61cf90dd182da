//! The server's own view: readiness, reported args, in-flight requests. Plain HTTP to the server
//! on the same host; every call has a short timeout so nothing here can hang a reconcile.

use std::time::Duration;

use serde_json::Value;
use specd_spec::{Engine, Evidence, ExpectedArg, Spec};

use crate::core::speculation::{self, Speculation};

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Health {
    /// 200 from the readiness endpoint.
    Ready,
    /// Port closed, a reset or closed connection, 503 or another 5xx: the model is still loading
    /// (or the server is draining). The engines answer only 200 or 503 on their readiness
    /// endpoints (`tests/fixtures/engines/*/health*`).
    Loading(String),
    /// A 4xx (no such endpoint, an API key wanted...) or another answer that waiting will not
    /// change.
    Error(String),
}

#[derive(Clone)]
pub struct Probe {
    client: reqwest::Client,
    timeout: Duration,
}

impl Default for Probe {
    fn default() -> Self {
        Probe::new(Duration::from_secs(5))
    }
}

impl Probe {
    pub fn new(timeout: Duration) -> Probe {
        Probe { client: Probe::client(timeout), timeout }
    }

    fn client(timeout: Duration) -> reqwest::Client {
        reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(Duration::from_millis(500).min(timeout))
            .no_proxy()
            .pool_max_idle_per_host(1)
            // The engines are spoken to over plain HTTP: no CA bundle to read and parse at every
            // start (that was most of `specd status`'s time).
            .tls_built_in_root_certs(false)
            .build()
            .expect("an HTTP client")
    }

    pub async fn health(&self, url: &str) -> Health {
        match self.client.get(url).send().await {
            Ok(r) if r.status().is_success() => Health::Ready,
            // 408, 425, 429: a busy server or a proxy in front of one asks to come back later.
            Ok(r) if r.status().is_server_error() || matches!(r.status().as_u16(), 408 | 425 | 429) => {
                Health::Loading(format!("{url} answered {}", r.status()))
            }
            Ok(r) => Health::Error(format!("{url} answered {}", r.status())),
            Err(e) if e.is_connect() => Health::Loading(format!("{url}: port not open yet")),
            Err(e) if e.is_timeout() => Health::Loading(format!("{url}: timed out")),
            // A connection reset or closed mid-answer: a server that is starting (or failing to
            // start) does that. Whether it failed is for the process to tell, not the socket.
            Err(e) => Health::Loading(format!("{url}: {}", error_chain(&e))),
        }
    }

    pub async fn json(&self, url: &str) -> Result<Value, String> {
        let r = self.client.get(url).send().await.map_err(|e| format!("{url}: {e}"))?;
        if !r.status().is_success() {
            return Err(format!("{url} answered {}", r.status()));
        }
        r.json::<Value>().await.map_err(|e| format!("{url}: not JSON: {e}"))
    }

    async fn text(&self, url: &str) -> Result<String, String> {
        let r = self.client.get(url).send().await.map_err(|e| format!("{url}: {e}"))?;
        if !r.status().is_success() {
            return Err(format!("{url} answered {}", r.status()));
        }
        r.text().await.map_err(|e| format!("{url}: {e}"))
    }

    async fn post_json(&self, url: &str, body: &Value) -> Result<Value, String> {
        let r = self
            .client
            .post(url)
            .timeout(Duration::from_secs(120))
            .json(body)
            .send()
            .await
            .map_err(|e| format!("{url}: {e}"))?;
        if !r.status().is_success() {
            let status = r.status();
            let text = r.text().await.unwrap_or_default();
            return Err(format!("{url} answered {status}: {}", text.chars().take(300).collect::<String>()));
        }
        r.json::<Value>().await.map_err(|e| format!("{url}: not JSON: {e}"))
    }

    /// One short generation, and the engine's own evidence of drafting around it.
    pub async fn speculation(&self, base_url: &str, spec: &Spec) -> Result<Speculation, String> {
        use serde_json::json;
        let (prompt, n) = (speculation::PROMPT, speculation::TOKENS);
        let facts = specd_spec::engine_facts(spec.engine);
        match &facts.evidence {
            ev @ Evidence::LlamaCpp { slots, generate, .. } => {
                let body = json!({"prompt": prompt, "n_predict": n, "temperature": 0.0, "cache_prompt": false});
                let completion = self.post_json(&format!("{base_url}{generate}"), &body).await?;
                // /slots can be turned off (--no-slots): the completion's timings still tell.
                let slots = self.json(&format!("{base_url}{slots}")).await.ok();
                Ok(speculation::from_llama_cpp(ev, slots.as_ref(), &completion))
            }
            ev @ Evidence::Sglang { generate, server_info, .. } => {
                let body = json!({"text": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0.0}});
                let reply = self.post_json(&format!("{base_url}{generate}"), &body).await?;
                let info = self.json(&format!("{base_url}{server_info}")).await.ok();
                Ok(speculation::from_sglang(ev, &reply, info.as_ref()))
            }
            ev @ Evidence::Vllm { generate, .. } => {
                let metrics = format!("{base_url}{}", facts.metrics_path);
                let before = self.text(&metrics).await?;
                let model = spec.server.served_model_name.clone().unwrap_or_else(|| spec.model.clone());
                let body = json!({"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0.0});
                self.post_json(&format!("{base_url}{generate}"), &body).await?;
                // The counters are updated from the engine core's stats, which may reach the
                // API server just after the reply: give them a moment before concluding.
                let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(2);
                loop {
                    let s = speculation::from_vllm(ev, &before, &self.text(&metrics).await?);
                    if s.drafts() || tokio::time::Instant::now() >= deadline {
                        return Ok(s);
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            }
        }
    }

    /// The engine's Prometheus metrics, as text; an answer other than 2xx says what the server
    /// said (llama-server without `--metrics`: 501 and why).
    pub async fn metrics(&self, base_url: &str, engine: Engine) -> Result<String, String> {
        let url = format!("{base_url}{}", specd_spec::engine_facts(engine).metrics_path);
        let r = self.client.get(&url).send().await.map_err(|e| format!("{url}: {}", error_chain(&e)))?;
        let status = r.status();
        let body = r.text().await.map_err(|e| format!("{url}: {}", error_chain(&e)))?;
        if !status.is_success() {
            return Err(format!("{url} answered {status}: {}", body.trim().chars().take(200).collect::<String>()));
        }
        Ok(body)
    }

    /// Requests in flight, from the engine's Prometheus metrics, when it exposes them. Asked
    /// over a connection that carries specd's mark (`core::door::PROBE_MARK`): a port closed to
    /// new connections for a drain still lets specd read them, over IPv4 and IPv6 alike.
    pub async fn running_requests(&self, base_url: &str, engine: Engine) -> Option<u64> {
        let facts = specd_spec::engine_facts(engine);
        let get = marked_get(base_url, facts.metrics_path);
        let (status, body) = tokio::time::timeout(self.timeout, get).await.ok()?.ok()?;
        if !(200..300).contains(&status) {
            return None;
        }
        speculation::metric_sum(&body, facts.running_requests_metric)
    }
}

/// `GET path` of the server at `base_url` (`http://host:port`), its status and body, over a
/// connection marked `PROBE_MARK` (SO_MARK needs CAP_NET_ADMIN, as nftables does: without it,
/// the connection goes unmarked, and no rule of specd's can be there to refuse it).
async fn marked_get(base_url: &str, path: &str) -> anyhow::Result<(u16, String)> {
    use anyhow::Context;
    use hyper::body::Body;
    let authority = base_url.split_once("://").map_or(base_url, |(_, r)| r).split('/').next().unwrap_or_default();
    let addrs: Vec<std::net::SocketAddr> = tokio::net::lookup_host(authority).await?.collect();
    let mut last = anyhow::anyhow!("{authority}: no address");
    for addr in addrs {
        let socket = if addr.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
        let _ = nix::sys::socket::setsockopt(&socket, nix::sys::socket::sockopt::Mark, &crate::core::door::PROBE_MARK);
        // Each address within half a second (as the other requests' connect timeout): one that
        // drops the connection does not keep the next from being tried.
        let stream = match tokio::time::timeout(Duration::from_millis(500), socket.connect(addr)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                last = anyhow::Error::new(e).context(format!("connecting to {addr}"));
                continue;
            }
            Err(_) => {
                last = anyhow::anyhow!("connecting to {addr}: no answer within 500 ms");
                continue;
            }
        };
        let (mut tx, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
        let driver = tokio::spawn(conn);
        let req = hyper::Request::get(path).header(hyper::header::HOST, authority).body(String::new())?;
        let read = async {
            let resp = tx.send_request(req).await?;
            let status = resp.status().as_u16();
            let mut body = resp.into_body();
            let mut bytes = Vec::new();
            while let Some(frame) = std::future::poll_fn(|cx| std::pin::Pin::new(&mut body).poll_frame(cx)).await {
                if let Ok(data) = frame?.into_data() {
                    bytes.extend_from_slice(&data);
                }
            }
            anyhow::Ok((status, String::from_utf8_lossy(&bytes).into_owned()))
        };
        let r = read.await.with_context(|| format!("GET {base_url}{path}"));
        driver.abort();
        return r;
    }
    Err(last)
}

/// An error with its causes ("error sending request: connection closed before message completed").
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let m = c.to_string();
        if !s.contains(&m) {
            s.push_str(": ");
            s.push_str(&m);
        }
        cur = c.source();
    }
    s
}

/// One arg that the server reports differently from the spec.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ArgMismatch {
    pub key: String,
    pub expected: Value,
    pub actual: Value,
}

impl std::fmt::Display for ArgMismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let key = self.key.rsplit('/').next().unwrap_or(&self.key);
        write!(f, "{key}: spec {} / server {}", self.expected, self.actual)
    }
}

fn same(a: &Value, b: &Value) -> bool {
    match (a.as_f64(), b.as_f64()) {
        (Some(x), Some(y)) => (x - y).abs() <= 1e-9 * x.abs().max(1.0),
        _ => a == b,
    }
}

/// Compare the expected args with the server's report.
pub fn compare_args(expected: &[ExpectedArg], info: &Value) -> Vec<ArgMismatch> {
    expected
        .iter()
        .filter_map(|e| {
            let actual = info.pointer(e.key).cloned().unwrap_or_else(|| e.absent.clone());
            (!same(&e.value, &actual)).then(|| ArgMismatch {
                key: e.key.to_string(),
                expected: e.value.clone(),
                actual,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A server that answers each connection with the next canned reply (`None`: it closes the
    /// connection without answering, as a server failing to load does).
    /// A server that answers `replies` in turn, one per connection, then closes its port (the
    /// task's end).
    async fn canned(replies: Vec<Option<&'static str>>) -> (String, tokio::task::JoinHandle<()>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/health", l.local_addr().unwrap());
        let server = tokio::spawn(async move {
            for r in replies {
                let (mut c, _) = l.accept().await.unwrap();
                let mut buf = [0u8; 1024];
                let _ = c.read(&mut buf).await;
                if let Some(status) = r {
                    let _ = c
                        .write_all(
                            format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n").as_bytes(),
                        )
                        .await;
                }
            }
        });
        (url, server)
    }

    #[tokio::test]
    async fn readiness_answers_loading_ready_or_never() {
        let replies = vec![
            Some("200 OK"),
            Some("503 Service Unavailable"),
            Some("500 Internal Server Error"),
            None,
            Some("429 Too Many Requests"),
            Some("404 Not Found"),
            Some("401 Unauthorized"),
        ];
        let (url, server) = canned(replies).await;
        let p = Probe::default();
        assert_eq!(p.health(&url).await, Health::Ready);
        assert!(matches!(p.health(&url).await, Health::Loading(w) if w.ends_with("answered 503 Service Unavailable")));
        assert!(matches!(p.health(&url).await, Health::Loading(_)), "a 5xx: not ready yet");
        assert!(matches!(p.health(&url).await, Health::Loading(_)), "a connection closed unanswered: not ready yet");
        let h = p.health(&url).await;
        assert!(matches!(h, Health::Loading(_)), "429: come back later: {h:?}");
        assert!(matches!(p.health(&url).await, Health::Error(w) if w.ends_with("answered 404 Not Found")));
        assert!(matches!(p.health(&url).await, Health::Error(w) if w.ends_with("answered 401 Unauthorized")));
        // Nothing listens any more: the port is closed.
        server.await.unwrap();
        assert!(matches!(p.health(&url).await, Health::Loading(w) if w.ends_with("port not open yet")));
    }

    /// The requests in flight are read over IPv4 and IPv6, from a whole or a chunked body, on a
    /// host name too; a server that does not answer or answers 503 gives none, within the
    /// probe's timeout.
    #[tokio::test]
    async fn requests_in_flight_are_read_whole_or_chunked_over_either_family() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        async fn serving(at: &str, reply: &'static str) -> String {
            let l = tokio::net::TcpListener::bind(at).await.unwrap();
            let base = format!("http://{}", l.local_addr().unwrap());
            tokio::spawn(async move {
                while let Ok((mut c, _)) = l.accept().await {
                    let mut buf = [0u8; 1024];
                    let _ = c.read(&mut buf).await;
                    if !reply.is_empty() {
                        let _ = c.write_all(reply.as_bytes()).await;
                    } else {
                        std::future::pending::<()>().await;
                    }
                }
            });
            base
        }
        let whole = "HTTP/1.1 200 OK\r\ncontent-length: 42\r\n\r\nsglang:num_running_reqs{model_name=\"a\"} 3\n";
        let chunked = "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n18\r\nsglang:num_running_reqs \r\n2\r\n5\n\r\n0\r\n\r\n";
        let p = Probe::new(Duration::from_secs(2));
        let v4 = serving("127.0.0.1:0", whole).await;
        assert_eq!(p.running_requests(&v4, Engine::Sglang).await, Some(3));
        let named = v4.replace("127.0.0.1", "localhost");
        assert_eq!(p.running_requests(&named, Engine::Sglang).await, Some(3));
        let v6 = serving("[::1]:0", chunked).await;
        assert_eq!(p.running_requests(&v6, Engine::Sglang).await, Some(5));
        let unavailable = serving("127.0.0.1:0", "HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n").await;
        assert_eq!(p.running_requests(&unavailable, Engine::Sglang).await, None);
        let silent = serving("127.0.0.1:0", "").await;
        let t0 = std::time::Instant::now();
        assert_eq!(Probe::new(Duration::from_millis(300)).running_requests(&silent, Engine::Sglang).await, None);
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    }

    #[test]
    fn sums_metric_samples() {
        let t = "# HELP sglang:num_running_reqs x\n# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{model_name=\"a\"} 3.0\nsglang:num_running_reqs{model_name=\"b\"} 2\nsglang:num_running_reqs_total 9\n";
        assert_eq!(speculation::metric_sum(t, "sglang:num_running_reqs"), Some(5));
        assert_eq!(speculation::metric_sum("x 1\n", "sglang:num_running_reqs"), None);
        assert_eq!(speculation::metric_sum("vllm:num_requests_running 4\n", "vllm:num_requests_running"), Some(4));
    }

    #[test]
    fn compares_args_with_float_tolerance_and_nulls() {
        let exp = vec![
            ExpectedArg { key: "/mem_fraction_static", value: json!(0.85), absent: Value::Null },
            ExpectedArg { key: "/speculative_num_steps", value: json!(10), absent: Value::Null },
            ExpectedArg { key: "/speculative_algorithm", value: Value::Null, absent: Value::Null },
        ];
        let info = json!({"mem_fraction_static": 0.8500000000000001, "speculative_num_steps": 5});
        let m = compare_args(&exp, &info);
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].key, "/speculative_num_steps");
        assert_eq!(m[0].to_string(), "speculative_num_steps: spec 10 / server 5");
    }
}
