//! Small helpers shared by the box, the stand-in tests and the end-to-end tests.

use std::net::TcpListener;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// A child process of a test, killed and reaped when this is dropped, pass or fail.
pub struct Reaped(pub std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Polls `cond` until it returns `true` or `timeout` passes.
///
/// This is for waiting on a real condition (a port open, a unit state, a
/// journal line), never a fixed sleep. The poll interval starts at 5 ms and
/// grows to 50 ms. On timeout the error names `desc`, so a failing test says
/// what it was waiting for.
pub fn wait_until(desc: &str, timeout: Duration, mut cond: impl FnMut() -> bool) -> anyhow::Result<()> {
    wait_for(desc, timeout, || cond().then_some(())).map(|_| ())
}

/// Like [`wait_until`], but the condition yields a value when it holds.
pub fn wait_for<T>(desc: &str, timeout: Duration, mut cond: impl FnMut() -> Option<T>) -> anyhow::Result<T> {
    let start = Instant::now();
    let mut pause = Duration::from_millis(5);
    loop {
        if let Some(v) = cond() {
            return Ok(v);
        }
        if start.elapsed() >= timeout {
            anyhow::bail!("timed out after {timeout:?} waiting for: {desc}");
        }
        std::thread::sleep(pause.min(timeout.saturating_sub(start.elapsed())));
        pause = (pause * 2).min(Duration::from_millis(50));
    }
}

/// A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0, read,
/// released).
pub fn free_port() -> u16 {
    // Below the kernel's ephemeral range: a port handed out here is never also the local port
    // of some connection (the load generators make thousands) or of another `bind(0)`, which
    // took a listener's port now and then while the suite ran. Each process walks the range from
    // a point of its own, and no port is handed out twice by one process.
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32768);
    let (lo, hi) = (10_000u32, ephemeral.min(65_536));
    if hi <= lo + 1000 {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
        return l.local_addr().expect("local_addr").port();
    }
    let span = hi - lo;
    let seed = std::process::id().wrapping_mul(2_654_435_761)
        ^ std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let _ = NEXT.compare_exchange(u32::MAX, seed % span, Ordering::SeqCst, Ordering::SeqCst);
    for _ in 0..span {
        let port = (lo + NEXT.fetch_add(1, Ordering::SeqCst) % span) as u16;
        // Free on every address (a server may listen on 0.0.0.0 or on loopback).
        if TcpListener::bind(("0.0.0.0", port)).is_ok() && TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in {lo}..{hi}")
}

/// The directory holding the workspace's built binaries (`…/target/debug`),
/// derived from the running executable: a test binary lives in
/// `…/target/debug/deps/`, a bench or demo binary in `…/target/debug/`.
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let mut dir = exe.parent().expect("exe has a parent").to_path_buf();
    if dir.file_name().is_some_and(|n| n == "deps" || n == "examples") {
        dir.pop();
    }
    dir
}

/// Path of a binary built by this workspace, e.g. `bin_path("specd")` or
/// `bin_path("specd-standin")`.
///
/// Panics with a hint when the binary has not been built: `cargo test -p
/// specd-e2e` builds only this crate's binaries, so the agent needs `cargo
/// test --workspace` (or `cargo build --workspace` first).
pub fn bin_path(name: &str) -> PathBuf {
    let p = target_dir().join(name);
    assert!(
        p.is_file(),
        "binary {name:?} not found at {}: build the workspace first (`cargo test --workspace`, or `cargo build --workspace` then run the tests)",
        p.display()
    );
    p
}

/// A plain HTTP/1.0 exchange with `127.0.0.1:port` (no keep-alive): the
/// status code and body, or `None` if the port is closed or the answer is
/// cut. Streams (SSE) are read until the server closes them.
pub fn http(port: u16, method: &str, path: &str, body: Option<&str>, timeout: Duration) -> Option<(u16, String)> {
    http_with_headers(port, method, path, body, timeout).map(|(code, _, body)| (code, body))
}

/// A reply: status code, headers (names in lower case), body.
pub type Reply = (u16, Vec<(String, String)>, String);

/// [`http`] with the reply's headers.
pub fn http_with_headers(port: u16, method: &str, path: &str, body: Option<&str>, timeout: Duration) -> Option<Reply> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(timeout)).ok()?;
    let body = body.unwrap_or("");
    let req = format!(
        "{method} {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).ok()?;
    let mut out = Vec::new();
    s.read_to_end(&mut out).ok()?;
    let text = String::from_utf8_lossy(&out).into_owned();
    let (head, body) = text.split_once("\r\n\r\n")?;
    let code = head.split_whitespace().nth(1)?.parse().ok()?;
    let headers = head
        .lines()
        .skip(1)
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Some((code, headers, body.to_string()))
}

/// `GET path` with a 5 s timeout.
pub fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    http(port, "GET", path, None, Duration::from_secs(5))
}

/// Run `git` in `dir` as a test author would (fixed identity, no signing, branch `main`); panics
/// with git's message on failure. Returns trimmed stdout.
pub fn git(dir: &std::path::Path, args: &[&str]) -> String {
    let out = std::process::Command::new("git")
        .args(["-c", "user.name=ops", "-c", "user.email=ops@example.com", "-c", "commit.gpgsign=false"])
        .args(["-c", "init.defaultBranch=main"])
        .args(args)
        .current_dir(dir)
        .output()
        .expect("git runs");
    assert!(out.status.success(), "git {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// The model folder every box has (a `config.json`, as a Hugging Face folder): what the stand-in's
/// specs name, so that specd's pre-flight finds it.
pub const STANDIN_MODEL: &str = "/var/lib/models/Qwen3.5-122B-A10B";

/// A specd spec of the seed's SGLang service (NEXTN, topk 1, draft tokens = steps + 1) run by
/// the stand-in at `standin` on `port`, with metrics on. `tail` is appended under `spec:` (lines
/// indented by two spaces), e.g. a `service:` section.
pub fn sglang_spec(standin: &str, unit: &str, port: u16, steps: u32, tail: &str) -> String {
    format!(
        "apiVersion: specd/v1
kind: InferenceService
metadata: {{name: {name}}}
spec:
  unit: {unit}
  engine: sglang
  command: [{standin}, sglang]
  model: {STANDIN_MODEL}
  server: {{host: 127.0.0.1, port: {port}, tp_size: 4, mem_fraction_static: 0.85, max_running_requests: 16, extra_args: [--enable-metrics]}}
  speculative: {{algorithm: NEXTN, num_steps: {steps}, eagle_topk: 1, num_draft_tokens: {draft}}}
{tail}",
        name = unit.trim_end_matches(".service"),
        draft = steps + 1,
    )
}

/// A specd spec of a vLLM stand-in on `port` with n-gram speculation of `steps` that a load
/// balancer stands in front of: 200 tokens a second, loaded in half a second, a drain budget of
/// 8 s and a stop timeout of 20 s.
pub fn vllm_lb_spec(standin: &str, unit: &str, port: u16, steps: u32) -> String {
    format!(
        "apiVersion: specd/v1
kind: InferenceService
metadata: {{name: {name}}}
spec:
  unit: {unit}
  engine: vllm
  command: [{standin}, vllm, serve]
  model: {STANDIN_MODEL}
  server: {{host: 127.0.0.1, port: {port}}}
  speculative: {{algorithm: ngram, num_steps: {steps}, prompt_lookup_max: 3, prompt_lookup_min: 1}}
  service:
    timeout_stop_sec: 20
    drain_timeout_sec: 8
    environment: {{SPECD_STANDIN_LOAD_MS: \"500\", SPECD_STANDIN_TOKENS_PER_SEC: \"200\"}}
",
        name = unit.trim_end_matches(".service"),
    )
}

/// A GnuPG home of a test's (`dir/gnupg`, mode 0700): `run` calls `gpg` on it without a pinentry,
/// keys without a passphrase.
pub struct Gpg {
    pub home: PathBuf,
}

impl Gpg {
    pub fn new(dir: &std::path::Path) -> Gpg {
        let home = dir.join("gnupg");
        std::fs::create_dir_all(&home).unwrap();
        std::fs::set_permissions(&home, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
        Gpg { home }
    }

    /// `gpg args`, checked to succeed; its stdout.
    pub fn run(&self, args: &[&str]) -> Vec<u8> {
        let out = std::process::Command::new("gpg")
            .arg("--homedir")
            .arg(&self.home)
            .args(["--batch", "--pinentry-mode", "loopback", "--passphrase", ""])
            .args(args)
            .output()
            .expect("gpg runs (the gnupg package)");
        assert!(out.status.success(), "gpg {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        out.stdout
    }
}

/// An ed25519 SSH key pair without a passphrase, `dir/name` and `dir/name.pub` (comment `name`);
/// the private key's path.
pub fn ssh_key(dir: &std::path::Path, name: &str) -> PathBuf {
    let k = dir.join(name);
    let out = std::process::Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-C", name, "-f"])
        .arg(&k)
        .output()
        .expect("ssh-keygen runs (the openssh-client package)");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    k
}

#[cfg(test)]
mod port_tests {
    /// Ports are handed out below the ephemeral range (never a connection's local port), each
    /// once, and free when handed out.
    #[test]
    fn free_ports_are_distinct_free_and_below_the_ephemeral_range() {
        let ephemeral: u16 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap();
        let ports: Vec<u16> = (0..200).map(|_| super::free_port()).collect();
        let mut unique = ports.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), ports.len(), "{ports:?}");
        assert!(ports.iter().all(|p| *p < ephemeral), "{ports:?}");
        let held = std::net::TcpListener::bind(("127.0.0.1", ports[0])).unwrap();
        drop(held);
    }
}
