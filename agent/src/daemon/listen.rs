//! The agent's HTTP endpoints: the read-only one on TCP (`listen`: `GET /metrics`, `GET
//! /healthz`, the load balancers' `GET /serving/<unit>`, on any address) and control actions on a
//! Unix socket (`POST /reconcile`).
//!
//! No client can starve the agent through them. Each endpoint serves at most
//! [`Limits::connections`] connections at once; one more is accepted and closed at once (never
//! left in the backlog: a client over the cap learns it at once, and a connection that comes
//! once a slot is free is served at once instead of waiting behind every connection queued
//! before it, which in a flood are the flood's). A request's header must arrive within
//! [`Limits::header_within`] of the connection's start or of the end of the previous answer
//! (so an idle keep-alive connection goes as soon as a half-sent header does), and a connection
//! lives at most [`Limits::connection_within`] (then it ends after the answer in progress, or
//! [`GRACE`] later whatever it does). An accept that fails for want of descriptors or memory is
//! tried again after a pause that grows to 1 s: the loop neither spins nor ends. The agent's
//! own work (unit locks, git, D-Bus, probes, inotify) never waits on any of this: the caps fit in
//! the limit of open files with [`RESERVED_FDS`] to spare ([`metrics_connections`]).

use std::collections::BTreeMap;
use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;

use crate::daemon::metrics::Metrics;

/// How an endpoint serves its connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Connections served at once; one more is accepted and closed at once.
    pub connections: usize,
    /// From the connection's start, or from the end of the previous answer, until a request's
    /// header is read (hyper's header read timeout): both the header time and the keep-alive
    /// idle time.
    pub header_within: Duration,
    /// A connection's whole life: then it is closed after the answer in progress, and dropped
    /// [`GRACE`] later whatever it does.
    pub connection_within: Duration,
}

/// The read-only endpoint (`listen`). Prometheus scrapes over one connection and a health check
/// uses one at a time: 256 leave room for many scrapers. A scrape's request comes at once, so
/// 5 s for its header is plenty, and a scraper reconnects when its idle connection was closed.
pub const METRICS: Limits =
    Limits { connections: 256, header_within: Duration::from_secs(5), connection_within: Duration::from_secs(30) };

/// The control socket (root's, or `control_group`'s): one request per `specd reconcile`.
pub const CONTROL: Limits =
    Limits { connections: 32, header_within: Duration::from_secs(5), connection_within: Duration::from_secs(30) };

/// How long a connection past its life may take to finish the answer in progress.
pub const GRACE: Duration = Duration::from_secs(1);

/// Descriptors kept for the agent's own work whatever its endpoints hold: a lock per unit being
/// reconciled, git's pack files and the pipes of the processes it runs (git, ssh-keygen, gpg,
/// journalctl), the D-Bus connection, probe and webhook connections, inotify, pidfds.
pub const RESERVED_FDS: u64 = 512;

/// The soft limit of open files the agent raises itself to, when the hard limit allows: the
/// caps and [`RESERVED_FDS`] fit in 1024 already; the rest is headroom. Not the hard limit itself
/// (systemd's default is 524288): a program the agent runs inherits the soft limit, and some
/// close every possible descriptor one by one before they exec.
pub const NOFILE_WANTED: u64 = 8192;

/// The largest request header (and what is read with it): a GET from Prometheus or a health
/// check is a few hundred bytes. hyper's read buffer never grows past it.
const READ_BUFFER: usize = 16 * 1024;

/// Raise the soft limit of open files to [`NOFILE_WANTED`], or the hard limit if lower; returns
/// the soft limit in effect.
pub fn raise_nofile() -> u64 {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else { return 1024 };
    let want = NOFILE_WANTED.min(hard);
    if soft >= want {
        return soft;
    }
    match setrlimit(Resource::RLIMIT_NOFILE, want, hard) {
        Ok(()) => want,
        Err(e) => {
            tracing::warn!("cannot raise the limit of open files from {soft} to {want}: {e}");
            soft
        }
    }
}

/// The metrics endpoint's cap under a limit of `nofile` open files: [`METRICS`]'s, or less when
/// the limit leaves less beside [`RESERVED_FDS`] and the control socket's cap (at least 16).
pub fn metrics_connections(nofile: u64) -> usize {
    let left = nofile.saturating_sub(RESERVED_FDS + CONTROL.connections as u64);
    usize::try_from(left).unwrap_or(usize::MAX).clamp(16, METRICS.connections)
}

/// The endpoint on `listen` (any address): `GET /metrics` (OpenMetrics text), `GET /healthz`,
/// the units' HTTP checks (`GET /serving/<unit>`, answered by `answers`) and `POST /poll`, which
/// wakes `poll` (a promoter or a forge saying the remote moved: the agent polls it sooner, never
/// more often than once a second, and deploys only what it would have at its next poll).
/// Nothing here changes what runs: control actions are served on the socket, [`serve_control`].
pub async fn serve_metrics(
    listen: &str,
    metrics: Arc<Metrics>,
    answers: Arc<crate::lb::Answers>,
    poll: Arc<tokio::sync::Notify>,
    limits: Limits,
) -> Result<JoinHandle<()>> {
    let addr: std::net::SocketAddr = listen.parse().with_context(|| format!("listen address {listen:?}"))?;
    let listener = bind(addr).with_context(|| format!("binding {listen}"))?;
    let app = metrics_app(metrics, poll).merge(crate::lb::http::routes(answers));
    Ok(spawn("the metrics endpoint", listener, app, limits))
}

/// For a one-shot command where no agent runs: the units' HTTP checks alone on `listen` (the
/// agent's address, free then), under [`METRICS`]'s limits; `None` when the address is taken
/// (the agent answers) or is none.
pub fn serve_checks(listen: &str, answers: Arc<crate::lb::Answers>) -> Option<JoinHandle<()>> {
    let addr: std::net::SocketAddr = listen.parse().ok()?;
    let listener = match bind(addr).with_context(|| format!("binding {listen}")) {
        Ok(l) => l,
        Err(e) if crate::lb::in_use(&e) => return None,
        Err(e) => {
            tracing::warn!("{e:#}: the units' HTTP checks are not answered by this command");
            return None;
        }
    };
    Some(spawn("the load balancers' checks", listener, crate::lb::http::routes(answers), METRICS))
}

/// Connections the kernel may hold for the accept loop (it caps them at `net.core.somaxconn`,
/// 4096 by default): a burst is accepted and closed rather than refused by the kernel, whose
/// client would try again only a second later.
const BACKLOG: u32 = 4096;

/// A TCP listener on `addr` (SO_REUSEADDR, as `TcpListener::bind`) with [`BACKLOG`].
fn bind(addr: std::net::SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let socket = if addr.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(BACKLOG)
}

/// The endpoint's own routes (the checks' are the load balancers' module's).
fn metrics_app(metrics: Arc<Metrics>, poll: Arc<tokio::sync::Notify>) -> axum::Router {
    use axum::http::{StatusCode, header::CONTENT_TYPE};
    use axum::routing::{get, post};
    // A wake-up stored once however many ask: the agent's loop takes it when it is free. The
    // request's body (a forge's webhook payload) is not read.
    let wake = move || async move {
        poll.notify_one();
        (StatusCode::ACCEPTED, "the source is polled within a second\n")
    };
    axum::Router::new()
        .route("/metrics", get(move || async move { ([(CONTENT_TYPE, Metrics::CONTENT_TYPE)], metrics.render()) }))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/poll", post(wake))
}

/// Control actions on a Unix socket: `POST /reconcile[?unit=U]` calls `reconcile(Some(U))` (or
/// `reconcile(None)`: every unit). The socket's directory is root's only (0700, socket 0600), or
/// also `group`'s (0750, socket 0660). Served under [`CONTROL`].
pub fn serve_control(
    path: &Path,
    group: Option<&str>,
    reconcile: impl Fn(Option<String>) + Clone + Send + Sync + 'static,
) -> Result<JoinHandle<()>> {
    use axum::extract::Query;
    use axum::routing::{get, post};
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).context("the control socket needs a directory")?;
    // specd sets the directory's owner group and mode, so it must be specd's own: never /run
    // or /tmp, whose modes other services depend on.
    {
        use std::os::unix::fs::MetadataExt;
        if let Ok(m) = std::fs::metadata(dir)
            && (m.mode() & 0o1002 != 0)
        {
            anyhow::bail!(
                "control_socket {}: its directory {} is shared (sticky or world-writable), and specd sets that directory's mode; put the socket in a directory of its own, such as /run/specd/control.sock",
                path.display(),
                dir.display()
            );
        }
    }
    if let Some(other) = std::fs::read_dir(dir)
        .ok()
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name())
        // specd's own: the socket, and what the units' load balancers are told
        // (`machine::serving::DIR`, in the default directory).
        .find(|n| Some(n.as_os_str()) != path.file_name() && n != "serving")
    {
        anyhow::bail!(
            "control_socket {}: its directory {} holds other files ({}), and specd sets that directory's mode; put the socket in a directory of its own, such as /run/specd/control.sock",
            path.display(),
            dir.display(),
            other.to_string_lossy()
        );
    }
    crate::machine::atomic::ensure_dir(dir)?;
    let gid = match group {
        Some(g) => Some(
            nix::unistd::Group::from_name(g)
                .with_context(|| format!("looking up group {g}"))?
                .with_context(|| format!("control_group: there is no group {g}"))?
                .gid,
        ),
        None => None,
    };
    let (dir_mode, sock_mode) = if gid.is_some() { (0o750, 0o660) } else { (0o700, 0o600) };
    nix::unistd::chown(dir, None, gid).with_context(|| format!("chown {}", dir.display()))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(dir_mode))
        .with_context(|| format!("chmod {}", dir.display()))?;
    // A socket left by an agent that died.
    if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
        let _ = std::fs::remove_file(path);
    }
    let std_listener =
        std::os::unix::net::UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(sock_mode))
        .with_context(|| format!("chmod {}", path.display()))?;
    nix::unistd::chown(path, None, gid).with_context(|| format!("chown {}", path.display()))?;
    std_listener.set_nonblocking(true)?;
    let listener = tokio::net::UnixListener::from_std(std_listener)?;
    let app = axum::Router::new().route("/healthz", get(|| async { "ok\n" })).route(
        "/reconcile",
        post(move |Query(q): Query<BTreeMap<String, String>>| async move {
            reconcile(q.get("unit").cloned());
            "queued\n"
        }),
    );
    Ok(spawn("the control socket", listener, app, CONTROL))
}

/// A listening socket: TCP or Unix (or, in the tests, one that fails).
pub trait Accept: Send + 'static {
    type Io: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    fn accept(&self) -> impl Future<Output = std::io::Result<Self::Io>> + Send;
    /// The peer of a connection, when it has an address (a load balancer's poll is recorded by
    /// it: axum's `ConnectInfo`).
    fn peer(_io: &Self::Io) -> Option<std::net::SocketAddr> {
        None
    }
}

impl Accept for tokio::net::TcpListener {
    type Io = tokio::net::TcpStream;
    async fn accept(&self) -> std::io::Result<Self::Io> {
        tokio::net::TcpListener::accept(self).await.map(|(s, _)| s)
    }
    fn peer(io: &Self::Io) -> Option<std::net::SocketAddr> {
        io.peer_addr().ok()
    }
}

impl Accept for tokio::net::UnixListener {
    type Io = tokio::net::UnixStream;
    async fn accept(&self) -> std::io::Result<Self::Io> {
        tokio::net::UnixListener::accept(self).await.map(|(s, _)| s)
    }
}

/// Serve `app` on `listener` under `limits` until the task is aborted; `name` names the
/// endpoint in the log.
pub fn spawn<L: Accept>(name: &'static str, listener: L, app: axum::Router, limits: Limits) -> JoinHandle<()> {
    tokio::spawn(accept_loop(name, listener, app, limits))
}

async fn accept_loop<L: Accept>(name: &'static str, listener: L, app: axum::Router, limits: Limits) {
    let slots = Arc::new(Semaphore::new(limits.connections));
    // Accepts failed in a row and the last pause; connections closed at the cap since the last
    // one served. Each is logged once when it begins and once when it ends, not per connection.
    let mut failing: Option<(u64, Duration)> = None;
    let mut refused = 0u64;
    loop {
        let io = match listener.accept().await {
            Ok(io) => io,
            Err(e) => {
                if let Some(pause) = accept_backoff(&e, failing.map(|(_, p)| p)) {
                    let n = failing.map_or(0, |(n, _)| n) + 1;
                    if n == 1 {
                        tracing::warn!(
                            "{name}: cannot accept a connection: {e}; trying again in a pause growing to 1 s"
                        );
                    }
                    failing = Some((n, pause));
                    tokio::time::sleep(pause).await;
                }
                continue;
            }
        };
        if let Some((n, _)) = failing.take() {
            tracing::info!("{name}: accepting connections again after {n} failed accepts");
        }
        match slots.clone().try_acquire_owned() {
            Ok(slot) => {
                if refused > 0 {
                    tracing::info!(
                        "{name}: below its cap of {} connections again; {refused} more were closed at once",
                        limits.connections
                    );
                    refused = 0;
                }
                let app = match L::peer(&io) {
                    Some(peer) => app.clone().layer(axum::Extension(axum::extract::ConnectInfo(peer))),
                    None => app.clone(),
                };
                tokio::spawn(connection(io, app, limits, slot));
            }
            Err(_) => {
                if refused == 0 {
                    tracing::warn!(
                        "{name}: {} connections open, its cap; more are closed at once until some end",
                        limits.connections
                    );
                }
                refused += 1;
                drop(io);
            }
        }
    }
}

/// After a failed accept: `None` to try again at once (that connection failed, not the
/// listener: aborted or reset before it was accepted), else how long to wait: 10 ms, doubling
/// from the `previous` pause to 1 s. Out of descriptors (EMFILE, ENFILE) or memory the
/// connection stays in the backlog, and trying again at once would spin.
fn accept_backoff(e: &std::io::Error, previous: Option<Duration>) -> Option<Duration> {
    use std::io::ErrorKind::*;
    if matches!(e.kind(), ConnectionAborted | ConnectionReset | ConnectionRefused | Interrupted) {
        return None;
    }
    Some(previous.map_or(Duration::from_millis(10), |p| (p * 2).min(Duration::from_secs(1))))
}

/// One connection, holding its `slot` until it ends.
async fn connection<I>(io: I, app: axum::Router, limits: Limits, slot: OwnedSemaphorePermit)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    use hyper_util::rt::{TokioIo, TokioTimer};
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(limits.header_within).max_buf_size(READ_BUFFER);
    let conn = http.serve_connection(TokioIo::new(io), hyper_util::service::TowerToHyperService::new(app));
    let mut conn = std::pin::pin!(conn);
    tokio::select! {
        _ = conn.as_mut() => {}
        _ = tokio::time::sleep(limits.connection_within) => {
            conn.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(GRACE, conn).await;
        }
    }
    drop(slot);
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::get;
    use std::time::Instant;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    fn limits(connections: usize, header_ms: u64, life_ms: u64) -> Limits {
        Limits {
            connections,
            header_within: Duration::from_millis(header_ms),
            connection_within: Duration::from_millis(life_ms),
        }
    }

    /// `/healthz`, and `/big`: an answer far larger than the sockets' buffers.
    fn app() -> axum::Router {
        axum::Router::new()
            .route("/healthz", get(|| async { "ok\n" }))
            .route("/big", get(|| async { vec![b'x'; 64 << 20] }))
    }

    async fn start(app: axum::Router, limits: Limits) -> (u16, JoinHandle<()>) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        (port, spawn("the test endpoint", l, app, limits))
    }

    async fn connect(port: u16) -> TcpStream {
        TcpStream::connect(("127.0.0.1", port)).await.unwrap()
    }

    /// `GET path` over a new connection (HTTP/1.0: closed after the answer): the whole answer, or
    /// `None` when the connection was closed without one.
    async fn get_once(port: u16, path: &str) -> Option<String> {
        let mut s = TcpStream::connect(("127.0.0.1", port)).await.ok()?;
        s.write_all(format!("GET {path} HTTP/1.0\r\n\r\n").as_bytes()).await.ok()?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.ok()?;
        (!out.is_empty()).then(|| String::from_utf8_lossy(&out).into_owned())
    }

    /// `GET path` until it is answered (a connection over the cap is closed at once), asking every
    /// 10 ms for at most 10 s: the answer and how long that took.
    async fn answered(port: u16, path: &str) -> (String, Duration) {
        let t0 = Instant::now();
        loop {
            if let Some(a) = get_once(port, path).await {
                return (a, t0.elapsed());
            }
            assert!(t0.elapsed() < Duration::from_secs(10), "{path} was not answered within 10 s");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Read until the peer closes the connection (or resets it), for at most 10 s; how long that
    /// took.
    async fn closed(s: &mut TcpStream) -> Duration {
        let t0 = Instant::now();
        let mut buf = [0u8; 4096];
        let read = async {
            while let Ok(n) = s.read(&mut buf).await
                && n > 0
            {}
        };
        tokio::time::timeout(Duration::from_secs(10), read).await.expect("the connection was not closed within 10 s");
        t0.elapsed()
    }

    fn between(d: Duration, lo_ms: u64, hi_ms: u64) -> bool {
        d >= Duration::from_millis(lo_ms) && d <= Duration::from_millis(hi_ms)
    }

    #[tokio::test]
    async fn metrics_are_served_as_openmetrics_text() {
        let m = Arc::new(Metrics::default());
        m.source_read();
        let (port, h) = start(metrics_app(m, Default::default()), METRICS).await;
        let a = get_once(port, "/metrics").await.unwrap();
        let (head, body) = a.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.0 200"), "{head}");
        let ct = head.lines().find_map(|l| l.strip_prefix("content-type: ")).unwrap();
        assert_eq!(ct, "application/openmetrics-text; version=1.0.0; charset=utf-8");
        assert!(body.contains("specd_source_reads_total 1") && body.ends_with("# EOF\n"), "{body}");
        assert!(get_once(port, "/healthz").await.unwrap().ends_with("\r\n\r\nok\n"));
        h.abort();
    }

    #[tokio::test]
    async fn a_post_of_poll_wakes_the_poller_once_however_many_ask_and_a_get_does_not() {
        let poll = Arc::new(tokio::sync::Notify::new());
        let (port, h) = start(metrics_app(Arc::new(Metrics::default()), poll.clone()), METRICS).await;
        let ask = |method: &'static str| async move {
            let mut s = connect(port).await;
            let body = "{\"ref\": \"refs/heads/main\"}";
            let req = format!("{method} /poll HTTP/1.0\r\ncontent-length: {}\r\n\r\n{body}", body.len());
            s.write_all(req.as_bytes()).await.unwrap();
            let mut out = String::new();
            s.read_to_string(&mut out).await.unwrap();
            out
        };
        let woken = || async { tokio::time::timeout(Duration::from_millis(200), poll.notified()).await.is_ok() };
        assert!(ask("GET").await.starts_with("HTTP/1.0 405"));
        assert!(!woken().await, "a GET woke the poller");
        for _ in 0..3 {
            let a = ask("POST").await;
            assert!(a.starts_with("HTTP/1.0 202") && a.ends_with("polled within a second\n"), "{a}");
        }
        assert!(woken().await, "three POSTs did not wake the poller");
        assert!(!woken().await, "three POSTs woke the poller more than once");
        h.abort();
    }

    #[tokio::test]
    async fn one_connection_over_the_cap_is_closed_at_once_and_healthz_is_served_once_others_end() {
        // Header time and life far longer than the test: only the cap is at work.
        let (port, h) = start(app(), limits(2, 60_000, 60_000)).await;
        // Accepted in the order they connected: these two take the cap.
        let held = vec![connect(port).await, connect(port).await];
        let t0 = Instant::now();
        assert_eq!(get_once(port, "/healthz").await, None, "a third connection is closed without an answer");
        assert!(t0.elapsed() < Duration::from_secs(2), "and at once: {:?}", t0.elapsed());
        drop(held);
        let (a, took) = answered(port, "/healthz").await;
        assert!(a.ends_with("ok\n") && took < Duration::from_secs(2), "{a} after {took:?}");
        // Nothing was kept of the refused connection or the two that ended: the cap is free.
        let again = vec![connect(port).await, connect(port).await];
        assert_eq!(get_once(port, "/healthz").await, None);
        drop(again);
        h.abort();
    }

    #[tokio::test]
    async fn idle_connections_that_fill_the_cap_are_closed_after_the_header_time() {
        let (port, h) = start(app(), limits(1, 500, 60_000)).await;
        // Never sends a byte, never closes: it holds the one slot until the header time ends.
        let mut idle = connect(port).await;
        let (a, took) = answered(port, "/healthz").await;
        assert!(a.ends_with("ok\n"), "{a}");
        assert!(between(took, 400, 3000), "/healthz was served {took:?} after the cap filled");
        assert!(closed(&mut idle).await < Duration::from_secs(1), "the idle connection was closed");
        h.abort();
    }

    #[tokio::test]
    async fn a_half_sent_header_a_slow_one_and_an_idle_keep_alive_connection_end_after_the_header_time() {
        let (port, h) = start(app(), limits(8, 500, 60_000)).await;

        // Half a header, then nothing.
        let mut s = connect(port).await;
        s.write_all(b"GET /healthz HTTP/1.1\r\nHo").await.unwrap();
        let took = closed(&mut s).await;
        assert!(between(took, 400, 3000), "half a header: closed after {took:?}");

        // A header sent a byte every 50 ms: the time is for the whole header, not between bytes.
        let mut s = connect(port).await;
        let t0 = Instant::now();
        let header =
            b"GET /healthz HTTP/1.1\r\nHost: specd\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
        let mut buf = [0u8; 64];
        for b in header.iter().cycle() {
            tokio::select! {
                r = s.read(&mut buf) => {
                    if !matches!(r, Ok(n) if n > 0) {
                        break;
                    }
                }
                _ = tokio::time::sleep(Duration::from_millis(50)) => {
                    if s.write_all(&[*b]).await.is_err() {
                        break;
                    }
                }
            }
            assert!(t0.elapsed() < Duration::from_secs(5), "a slow header still open after 5 s");
        }
        assert!(between(t0.elapsed(), 400, 3000), "a slow header: closed after {:?}", t0.elapsed());

        // One request answered over a keep-alive connection, then nothing more.
        let mut s = connect(port).await;
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: specd\r\n\r\n").await.unwrap();
        let mut got = Vec::new();
        while !got.ends_with(b"ok\n") {
            let mut buf = [0u8; 1024];
            let n = s.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed before the answer: {}", String::from_utf8_lossy(&got));
            got.extend_from_slice(&buf[..n]);
        }
        assert!(got.starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&got));
        let took = closed(&mut s).await;
        assert!(between(took, 400, 3000), "idle after an answer: closed after {took:?}");
        h.abort();
    }

    #[tokio::test]
    async fn a_connection_ends_after_its_life_busy_or_stuck() {
        // Busy: a request every 100 ms over one keep-alive connection, each within the header
        // time; the connection ends at its life, after an answer.
        let (port, h) = start(app(), limits(1, 500, 1500)).await;
        let mut s = connect(port).await;
        let t0 = Instant::now();
        let mut answers = 0;
        'life: loop {
            if s.write_all(b"GET /healthz HTTP/1.1\r\nHost: specd\r\n\r\n").await.is_err() {
                break;
            }
            let mut got = Vec::new();
            while !got.ends_with(b"ok\n") {
                let mut buf = [0u8; 1024];
                match s.read(&mut buf).await {
                    Ok(n) if n > 0 => got.extend_from_slice(&buf[..n]),
                    _ => break 'life,
                }
            }
            answers += 1;
            assert!(t0.elapsed() < Duration::from_secs(5), "a busy connection still open after 5 s");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(answers >= 5, "{answers} answers");
        assert!(between(t0.elapsed(), 1400, 1500 + 1000 + 2000), "busy: closed after {:?}", t0.elapsed());
        drop(s);
        h.abort();

        // Stuck: an answer the client never reads keeps the write waiting; the connection is
        // dropped GRACE after its life, and its slot (the only one) serves /healthz again.
        let (port, h) = start(app(), limits(1, 500, 1000)).await;
        let mut stuck = connect(port).await;
        stuck.write_all(b"GET /big HTTP/1.1\r\nHost: specd\r\n\r\n").await.unwrap();
        let (a, took) = answered(port, "/healthz").await;
        assert!(a.ends_with("ok\n"), "{a}");
        assert!(between(took, 1000 + 1000 - 200, 1000 + 1000 + 3000), "/healthz after {took:?}");
        drop(stuck);
        h.abort();
    }

    /// A listener whose first `fail` accepts fail with `errno`; then it yields `then` once, then
    /// waits forever. Records when it was asked.
    struct Failing {
        errno: i32,
        fail: usize,
        asked: Arc<std::sync::Mutex<Vec<tokio::time::Instant>>>,
        then: std::sync::Mutex<Option<tokio::io::DuplexStream>>,
    }

    impl Accept for Failing {
        type Io = tokio::io::DuplexStream;
        async fn accept(&self) -> std::io::Result<Self::Io> {
            let n = {
                let mut asked = self.asked.lock().unwrap();
                asked.push(tokio::time::Instant::now());
                asked.len()
            };
            if n <= self.fail {
                return Err(std::io::Error::from_raw_os_error(self.errno));
            }
            let io = self.then.lock().unwrap().take();
            match io {
                Some(io) => Ok(io),
                None => std::future::pending().await,
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn out_of_descriptors_the_accept_loop_backs_off_and_goes_on() {
        let (mut client, server) = tokio::io::duplex(4096);
        let asked = Arc::new(std::sync::Mutex::new(Vec::new()));
        let l =
            Failing { errno: libc::EMFILE, fail: 12, asked: asked.clone(), then: std::sync::Mutex::new(Some(server)) };
        let h = spawn("the test endpoint", l, app(), METRICS);
        client.write_all(b"GET /healthz HTTP/1.0\r\n\r\n").await.unwrap();
        let mut a = String::new();
        client.read_to_string(&mut a).await.unwrap();
        assert!(a.starts_with("HTTP/1.0 200") && a.ends_with("ok\n"), "{a}");
        let asked = asked.lock().unwrap().clone();
        let gaps: Vec<u64> = asked.windows(2).map(|w| (w[1] - w[0]).as_millis() as u64).collect();
        // 12 failures: 10 ms doubling to 1 s between them, then the connection at once.
        assert_eq!(gaps[..12], [10, 20, 40, 80, 160, 320, 640, 1000, 1000, 1000, 1000, 1000]);
        h.abort();

        // A connection that failed before it was accepted is not the listener's: at once.
        let aborted = std::io::Error::from(std::io::ErrorKind::ConnectionAborted);
        assert_eq!(accept_backoff(&aborted, Some(Duration::from_secs(1))), None);
        let nfile = std::io::Error::from_raw_os_error(libc::ENFILE);
        assert_eq!(accept_backoff(&nfile, None), Some(Duration::from_millis(10)));
    }

    #[test]
    fn the_caps_fit_in_the_limit_of_open_files_beside_the_agent_s_reserve() {
        // Where the limit cannot be raised (1024, systemd's default soft limit), the caps fit.
        assert!(METRICS.connections as u64 + CONTROL.connections as u64 + RESERVED_FDS <= 1024);
        assert_eq!(metrics_connections(1024), METRICS.connections);
        assert_eq!(metrics_connections(NOFILE_WANTED), METRICS.connections);
        assert_eq!(metrics_connections(700), 700 - 512 - 32);
        assert_eq!(metrics_connections(100), 16);
        // The shipped unit's limit holds what the agent raises itself to.
        for unit in [
            include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/specd.service")),
            include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../packaging/specd.service")),
        ] {
            let n: u64 = unit
                .lines()
                .find_map(|l| l.strip_prefix("LimitNOFILE="))
                .expect("the agent unit sets LimitNOFILE")
                .trim()
                .parse()
                .unwrap();
            assert_eq!(n, NOFILE_WANTED);
        }
        // Raised to what is wanted, or to the hard limit (never lowered).
        use nix::sys::resource::{Resource, getrlimit};
        let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
        let soft = raise_nofile();
        assert_eq!(getrlimit(Resource::RLIMIT_NOFILE).unwrap().0, soft);
        assert!(soft >= NOFILE_WANTED.min(hard), "{soft} (hard {hard})");
    }

    #[tokio::test]
    async fn the_control_socket_needs_a_directory_of_its_own() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("other"), "x").unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
        let before = mode(d.path());
        let e = serve_control(&d.path().join("control.sock"), None, |_| {}).unwrap_err();
        assert!(format!("{e:#}").contains("holds other files (other)"), "{e:#}");
        // The load balancers' states beside the socket (`/run/specd/serving`) are specd's own.
        let beside = d.path().join("run");
        std::fs::create_dir_all(beside.join("serving")).unwrap();
        serve_control(&beside.join("control.sock"), None, |_| {}).unwrap().abort();
        let e = serve_control(Path::new("/tmp/specd-control.sock"), None, |_| {}).unwrap_err();
        assert!(format!("{e:#}").contains("is shared (sticky or world-writable)"), "{e:#}");
        let own = d.path().join("specd");
        let h = serve_control(&own.join("control.sock"), None, |_| {}).unwrap();
        assert_eq!(mode(&own), 0o700);
        assert_eq!(mode(d.path()), before, "the directory that holds other files is untouched");
        h.abort();
    }
}
