//! Shared by the end-to-end tests: a box with specd and the stand-in, specs, and plain HTTP.
#![allow(dead_code, unused_imports)]

use std::process::Output;
use std::time::Duration;

pub use specd_e2e::{SystemdBox, bin_path, free_port, git, http, http_get, sglang_spec, wait_until};

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

    /// The seed's SGLang spec run by the stand-in on this env's port. `extra` is appended
    /// under `spec:` (indented two).
    pub fn spec(&self, unit: &str, steps: u32, extra: &str) -> String {
        sglang_spec(&self.standin, unit, self.port, steps, extra)
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
        let (code, body) = http_get(self.port, "/get_server_info")?;
        (code == 200).then(|| serde_json::from_str(&body).ok()).flatten()
    }

    pub fn served_steps(&self) -> Option<u64> {
        self.server_info()?.get("speculative_num_steps")?.as_u64()
    }

    pub fn running_requests(&self) -> Option<u64> {
        let (_, body) = http_get(self.port, "/metrics")?;
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
                    let _ = http(port, "POST", "/generate", Some(&body), Duration::from_secs(600));
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
