//! An inference server run as a plain process of the test (no box): the stand-in in one of its
//! personalities, started on a port of 127.0.0.1, its readiness, its own count of requests in
//! flight (from its `/metrics`), SIGTERM, its exit. Killed when dropped.

use crate::traffic::Api;
use crate::{bin_path, http_get};
use anyhow::Context;
use std::process::{Command, ExitStatus, Stdio};
use std::time::Duration;

/// Which engine the stand-in plays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Personality {
    Sglang,
    Vllm,
    LlamaCpp,
}

impl Personality {
    /// The streaming completion API the load uses against it (the engine's own).
    pub fn api(self) -> Api {
        match self {
            Personality::Sglang => Api::SglangGenerate,
            Personality::Vllm => Api::OpenAiCompletions,
            Personality::LlamaCpp => Api::LlamaCompletion,
        }
    }

    /// The stand-in's command line for this engine on `port`, metrics on.
    fn argv(self, port: u16) -> Vec<String> {
        let p = port.to_string();
        let v: &[&str] = match self {
            Personality::Sglang => &["sglang", "--model-path", "/m", "--port", &p, "--enable-metrics"],
            Personality::Vllm => &["vllm", "serve", "/m", "--port", &p],
            Personality::LlamaCpp => &["llama-cpp", "-m", "/m", "--port", &p, "--metrics"],
        };
        v.iter().map(|s| s.to_string()).collect()
    }

    /// The gauges whose sum is the number of requests the server holds (running and queued).
    fn in_flight_gauges(self) -> &'static [&'static str] {
        match self {
            Personality::Sglang => &["sglang:num_running_reqs", "sglang:num_queue_reqs"],
            Personality::Vllm => &["vllm:num_requests_running", "vllm:num_requests_waiting"],
            Personality::LlamaCpp => &["llamacpp:requests_processing", "llamacpp:requests_deferred"],
        }
    }
}

/// A running server.
pub struct EngineProcess {
    child: std::process::Child,
    pub port: u16,
    pub personality: Personality,
    log: tempfile::NamedTempFile,
}

impl EngineProcess {
    /// The stand-in as `personality` on `port`, with `extra` arguments and `env` (its knobs,
    /// e.g. `SPECD_STANDIN_TOKENS_PER_SEC`); loads at once (`SPECD_STANDIN_LOAD_MS` 0, SGLang's
    /// warm-up 0) unless `env` says otherwise. Does not wait for readiness.
    pub fn standin(
        personality: Personality,
        port: u16,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> anyhow::Result<EngineProcess> {
        let log = tempfile::NamedTempFile::new().context("a log file for the stand-in")?;
        let mut c = Command::new(bin_path("specd-standin"));
        c.args(personality.argv(port)).args(extra);
        c.env("SPECD_STANDIN_LOAD_MS", "0").env("SPECD_STANDIN_WARMUP_MS", "0");
        for (k, v) in env {
            c.env(k, v);
        }
        c.stdin(Stdio::null()).stdout(log.reopen()?).stderr(log.reopen()?);
        let child = c.spawn().context("start specd-standin")?;
        Ok(EngineProcess { child, port, personality, log })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// What it printed so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log.path()).unwrap_or_default()
    }

    /// Waits until `/health` answers 200.
    pub fn wait_ready(&mut self, timeout: Duration) -> anyhow::Result<()> {
        let port = self.port;
        crate::wait_until(&format!("{:?} on port {port} to be ready", self.personality), timeout, || {
            http_get(port, "/health").is_some_and(|(c, _)| c == 200)
        })
        .with_context(|| self.log())
    }

    /// Requests the server holds (running and queued), from its `/metrics`; `None` when it
    /// does not answer.
    pub fn in_flight(&self) -> Option<u64> {
        let (code, m) = http_get(self.port, "/metrics")?;
        if code != 200 {
            return None;
        }
        let mut n = 0.0;
        for g in self.personality.in_flight_gauges() {
            let line = m.lines().find(|l| l.starts_with(g) && l[g.len()..].starts_with([' ', '{']))?;
            n += line.split_whitespace().last()?.parse::<f64>().ok()?;
        }
        Some(n as u64)
    }

    pub fn sigterm(&self) {
        // SAFETY: kill(2) on our own child, not yet reaped.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
    }

    /// Whether it has exited (its status then).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Stops it as systemd stops a unit: SIGTERM, then SIGKILL if it has not exited within
    /// `timeout` (`TimeoutStopSec=`). Its exit status, and whether it had to be killed.
    pub fn stop(&mut self, timeout: Duration) -> (ExitStatus, bool) {
        self.sigterm();
        if let Ok(st) = self.wait_exit(timeout) {
            return (st, false);
        }
        let _ = self.child.kill();
        (self.child.wait().expect("wait for the killed server"), true)
    }

    /// Waits for it to exit, at most `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> anyhow::Result<ExitStatus> {
        let child = &mut self.child;
        crate::wait_for("the server to exit", timeout, || child.try_wait().ok().flatten())
    }
}

impl Drop for EngineProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
