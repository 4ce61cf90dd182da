//! Shared by the end-to-end tests: a box with specd and the stand-in, specs, and plain HTTP.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Output;
use std::time::Duration;

pub use specd_e2e::{SystemdBox, bin_path, free_port, wait_until};

pub struct Env {
    pub b: SystemdBox,
    pub port: u16,
    pub specd: String,
    pub standin: String,
}

impl Env {
    pub fn new() -> Env {
        let b = SystemdBox::boot().expect("boot a private systemd (the end-to-end tests run as root)");
        Env {
            b,
            port: free_port(),
            specd: env!("CARGO_BIN_EXE_specd").to_string(),
            standin: bin_path("specd-standin").display().to_string(),
        }
    }

    /// An SGLang spec run by the stand-in. `extra` is appended under `spec:` (indented two).
    pub fn spec(&self, unit: &str, steps: u32, extra: &str) -> String {
        format!(
            "apiVersion: specd/v1
kind: InferenceService
metadata: {{name: {name}}}
spec:
  unit: {unit}
  engine: sglang
  command: [{standin}, sglang]
  model: /models/Qwen3.5-122B-A10B
  server: {{host: 127.0.0.1, port: {port}, tp_size: 4, mem_fraction_static: 0.85, max_running_requests: 16, extra_args: [--enable-metrics]}}
  speculative: {{algorithm: NEXTN, num_steps: {steps}, eagle_topk: 1, num_draft_tokens: {draft}}}
{extra}",
            name = unit.trim_end_matches(".service"),
            standin = self.standin,
            port = self.port,
            draft = steps + 1,
        )
    }

    /// Write a file into the box's private /run and return its path there.
    pub fn put(&self, name: &str, text: &str) -> String {
        let p = format!("/run/specs/{name}");
        self.b.write_file(&p, text).unwrap();
        p
    }

    /// Run specd inside the box.
    pub fn specd(&self, args: &[&str]) -> Output {
        let mut argv = vec![self.specd.as_str()];
        argv.extend_from_slice(args);
        self.b.exec(&argv)
    }

    pub fn server_info(&self) -> Option<serde_json::Value> {
        let (code, body) = http(self.port, "GET", "/get_server_info", None)?;
        (code == 200).then(|| serde_json::from_str(&body).ok()).flatten()
    }

    pub fn served_steps(&self) -> Option<u64> {
        self.server_info()?.get("speculative_num_steps")?.as_u64()
    }

    pub fn running_requests(&self) -> Option<u64> {
        let (_, body) = http(self.port, "GET", "/metrics", None)?;
        body.lines()
            .find(|l| l.starts_with("sglang:num_running_reqs"))
            .and_then(|l| l.split_whitespace().last()?.parse::<f64>().ok())
            .map(|v| v as u64)
    }

    /// Start `n` streaming generations of `tokens` tokens each; wait until the server counts them.
    pub fn in_flight(&self, n: usize, tokens: u32) -> Vec<std::thread::JoinHandle<()>> {
        let hs = (0..n)
            .map(|_| {
                let port = self.port;
                std::thread::spawn(move || {
                    let body = format!(
                        "{{\"text\":\"hello\",\"sampling_params\":{{\"max_new_tokens\":{tokens}}},\"stream\":true}}"
                    );
                    let _ = http_timeout(port, "POST", "/generate", Some(&body), Duration::from_secs(600));
                })
            })
            .collect();
        wait_until("the requests to be in flight", Duration::from_secs(20), || {
            self.running_requests().unwrap_or(0) >= n as u64
        })
        .unwrap();
        hs
    }

    pub fn main_pid(&self, unit: &str) -> u32 {
        self.b.prop(unit, "MainPID").unwrap().parse().unwrap()
    }

    pub fn state(&self, unit: &str) -> serde_json::Value {
        serde_json::from_str(&self.b.read_to_string(&format!("/var/lib/specd/units/{unit}.json")).unwrap()).unwrap()
    }
}

pub fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// A plain HTTP/1.0 exchange with 127.0.0.1:port (no keep-alive, no chunking).
pub fn http(port: u16, method: &str, path: &str, body: Option<&str>) -> Option<(u16, String)> {
    http_timeout(port, method, path, body, Duration::from_secs(5))
}

pub fn http_timeout(
    port: u16,
    method: &str,
    path: &str,
    body: Option<&str>,
    timeout: Duration,
) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(timeout)).ok()?;
    let body = body.unwrap_or("");
    let req = format!(
        "{method} {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).ok()?;
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).into_owned();
    let (head, body) = text.split_once("\r\n\r\n")?;
    let code = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((code, body.to_string()))
}
