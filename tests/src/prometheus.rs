//! [`Prometheus`]: a real Prometheus (Debian's `prometheus` package) run by a test as a plain
//! process on a loopback port, with its own config and storage in a directory of the test's;
//! stopped and started again on the same port and storage, killed when dropped.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::util::{free_port, http_get, wait_until};

/// A Prometheus process and what it needs to start again as it was.
pub struct Prometheus {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
    /// Flags besides the config, storage and address ones.
    flags: Vec<String>,
}

/// `s` percent-encoded for a URL's query (every byte but the unreserved ones).
pub fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

impl Prometheus {
    /// Writes `config` (a `prometheus.yml`) into `dir` (created when missing), starts Prometheus
    /// on a free loopback port with its storage in `dir/data`, and returns once it answers
    /// ready. A missing `prometheus` binary fails, naming the package: never a silent skip.
    pub fn start(dir: &Path, config: &str) -> Result<Prometheus> {
        Prometheus::start_with(dir, config, &[])
    }

    /// [`Prometheus::start`] with more `flags` (e.g. `--query.lookback-delta=30s`), kept for
    /// [`Prometheus::resume`].
    pub fn start_with(dir: &Path, config: &str, flags: &[&str]) -> Result<Prometheus> {
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
        std::fs::write(dir.join("prometheus.yml"), config)?;
        let flags = flags.iter().map(|f| f.to_string()).collect();
        let mut p = Prometheus { child: None, port: free_port(), dir: dir.to_path_buf(), flags };
        p.resume()?;
        Ok(p)
    }

    /// Stops Prometheus (SIGTERM, then SIGKILL after 10 s), keeping its port, config and
    /// storage for [`Prometheus::resume`]. Its API answers nothing until then.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else { return };
        // SAFETY: kill(2) on our own child, not yet reaped.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        let t0 = Instant::now();
        while matches!(child.try_wait(), Ok(None)) && t0.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
    }

    /// Starts Prometheus again (or the first time) on the same port, config and storage;
    /// returns once it answers ready.
    pub fn resume(&mut self) -> Result<()> {
        if self.child.is_some() {
            bail!("Prometheus is already running on port {}", self.port);
        }
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.join("prometheus.log"))?;
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", self.dir.join("prometheus.yml").display()))
            .arg(format!("--storage.tsdb.path={}", self.dir.join("data").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{}", self.port))
            .args(&self.flags)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context(
                "run prometheus: install Debian's prometheus package (scripts/install-deps); the real one is required",
            )?;
        self.child = Some(child);
        let port = self.port;
        wait_until("Prometheus to be ready", Duration::from_secs(60), || {
            http_get(port, "/-/ready").is_some_and(|(c, _)| c == 200)
        })
        .with_context(|| self.log())
    }

    /// Whether the process runs (between [`Prometheus::resume`] and [`Prometheus::stop`]).
    pub fn running(&self) -> bool {
        self.child.is_some()
    }

    /// The port of its HTTP API (the same across stops and starts).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The base URL of its HTTP API, `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Its directory: `prometheus.yml`, `data/`, `prometheus.log`.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// What it logged, over every start.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("prometheus.log")).unwrap_or_default()
    }

    /// `GET path` of the API: its `data`; panics (with the log) on no answer or an error.
    pub fn api(&self, path: &str) -> Value {
        let (code, body) = http_get(self.port, path).unwrap_or_else(|| panic!("no answer to {path}\n{}", self.log()));
        let v: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path}: {e}: {body}"));
        assert!(code == 200 && v["status"] == "success", "{path}: {code} {body}");
        v["data"].clone()
    }

    /// An instant query's series: (labels, value).
    pub fn query(&self, q: &str) -> Vec<(Value, f64)> {
        let d = self.api(&format!("/api/v1/query?query={}", percent_encode(q)));
        d["result"]
            .as_array()
            .unwrap_or_else(|| panic!("{q}: not a vector: {d}"))
            .iter()
            .map(|r| (r["metric"].clone(), r["value"][1].as_str().and_then(|v| v.parse().ok()).unwrap_or(f64::NAN)))
            .collect()
    }

    /// Polls `q` every 200 ms until its series satisfy `ok`, for up to `within`; returns them.
    /// Panics naming `what`, the last answer and the log.
    pub fn wait(
        &self,
        what: &str,
        q: &str,
        within: Duration,
        ok: impl Fn(&[(Value, f64)]) -> bool,
    ) -> Vec<(Value, f64)> {
        let t0 = Instant::now();
        loop {
            let r = self.query(q);
            if ok(&r) {
                return r;
            }
            assert!(t0.elapsed() < within, "{what}: after {within:?}, {q} gives {r:?}\n{}", self.log());
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Waits (up to 60 s) until `q` is one series whose value is `want`; returns its labels.
    pub fn wait_value(&self, q: &str, want: f64) -> Value {
        let r = self.wait(&format!("{q} == {want}"), q, Duration::from_secs(60), |r| {
            r.len() == 1 && (r[0].1 - want).abs() < 1e-9
        });
        r[0].0.clone()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
