//! A real HAProxy (Debian's `haproxy`, 2.6) run as a plain process of the test, in front of
//! inference servers on loopback.
//!
//! [`Haproxy::start`] writes a configuration generated from a [`Config`] into a temporary
//! directory, has `haproxy -c` check it (a refused one fails with HAProxy's own message), and
//! runs `haproxy -db` (foreground, never the system's service) with its runtime socket
//! (`stats socket`, admin level) in that directory. One frontend on a free port of 127.0.0.1
//! sends every request to one backend of the configured [`Server`]s:
//!
//! - each server is health-checked over HTTP (`option httpchk`, `GET` [`Config::check_path`],
//!   `http-check expect status 200`) on its own port or on [`Server::check_port`]; a
//!   `{server}` in the path becomes the server's name (`uri-lf` with `%[srv_name]`), for a
//!   per-server check URL such as specd's;
//! - with [`Server::agent_port`], HAProxy also asks an agent (`agent-check`, sending the server's
//!   name and a newline, every [`Config::agent_inter`]) and applies its words (`ready`,
//!   `drain`, `down`, `up`, `maint`, a weight); [`Agent`] is one the test drives by hand.
//!
//! [`Haproxy::servers`] reads `show stat` through the socket, so a test waits for a state
//! (`UP`, `DRAIN`, `DOWN`) with [`Haproxy::wait_server`] instead of sleeping. Dropping the
//! handle (also while a test panics) stops HAProxy and removes its directory.
//!
//! The systemd boxes ([`crate::SystemdBox`]) share the host's network namespace, so a server
//! a box runs on 127.0.0.1:PORT is a backend of this HAProxy like any other.

use anyhow::{Context, bail};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// One backend server: an inference server on 127.0.0.1.
#[derive(Clone, Debug)]
pub struct Server {
    /// HAProxy's name of it (`[A-Za-z0-9_.-]`), sent to the agent.
    pub name: String,
    /// The port requests go to.
    pub port: u16,
    /// Where the HTTP health check goes instead of `port` (HAProxy's `port`), e.g. specd's
    /// endpoint for this server.
    pub check_port: Option<u16>,
    /// An agent-check on this port (`agent-check agent-port P agent-send "<name>\n"`).
    pub agent_port: Option<u16>,
    /// What the agent-check sends instead of the server's name (e.g. the unit's name when
    /// several hosts run the same unit).
    pub agent_send: Option<String>,
}

impl Server {
    pub fn new(name: &str, port: u16) -> Server {
        Server { name: name.to_string(), port, check_port: None, agent_port: None, agent_send: None }
    }

    pub fn with_agent(mut self, port: u16) -> Server {
        self.agent_port = Some(port);
        self
    }

    /// An agent-check on `port` that sends `send` (and a newline).
    pub fn with_agent_sending(mut self, port: u16, send: &str) -> Server {
        self.agent_port = Some(port);
        self.agent_send = Some(send.to_string());
        self
    }

    pub fn with_check_port(mut self, port: u16) -> Server {
        self.check_port = Some(port);
        self
    }
}

/// What [`Haproxy::start`] runs.
#[derive(Clone, Debug)]
pub struct Config {
    pub servers: Vec<Server>,
    /// The HTTP health check's path (`/health`: SGLang, vLLM and llama-server all serve it);
    /// `{server}` in it is the server's name.
    pub check_path: String,
    /// Health check period (`inter`), and the checks in a row that turn a server down or up.
    pub check_inter: Duration,
    pub fall: u32,
    pub rise: u32,
    /// Agent check period (`agent-inter`).
    pub agent_inter: Duration,
    /// `balance` (`leastconn` suits long streams).
    pub balance: String,
    /// `retries` and `option redispatch`: a request whose connection to a server fails is
    /// tried again, the last time on another server.
    pub retries: u32,
    pub redispatch: bool,
    /// `timeout client` / `timeout server` (inactivity).
    pub timeout: Duration,
    /// Extra lines for the backend section, verbatim (e.g. `on-marked-down shutdown-sessions`
    /// in a `default-server`).
    pub backend_extra: Vec<String>,
}

impl Config {
    pub fn new(servers: Vec<Server>) -> Config {
        Config {
            servers,
            check_path: "/health".into(),
            check_inter: Duration::from_millis(500),
            fall: 2,
            rise: 1,
            agent_inter: Duration::from_millis(500),
            balance: "leastconn".into(),
            retries: 3,
            redispatch: true,
            timeout: Duration::from_secs(60),
            backend_extra: Vec::new(),
        }
    }

    /// The health check's timings of the configuration the project ships (`inter`, `fall` and
    /// `rise` of the first `default-server` line of `examples/haproxy.cfg`), instead of the
    /// tests' quick ones: what an operator who starts from the example runs.
    pub fn with_shipped_checks(mut self) -> Config {
        let (inter, fall, rise) = shipped_checks();
        (self.check_inter, self.fall, self.rise) = (inter, fall, rise);
        self
    }

    /// haproxy.cfg for a frontend on `port`, the runtime socket at `socket`.
    pub fn render(&self, port: u16, socket: &Path) -> String {
        let ms = |d: Duration| format!("{}ms", d.as_millis());
        let mut s = format!(
            "global
    nbthread 1
    stats socket {socket} mode 600 level admin
    log stdout format raw local0 info

defaults
    mode http
    log global
    option httplog
    option dontlognull
    timeout connect 2s
    timeout client {timeout}
    timeout server {timeout}
    timeout check 1s
    retries {retries}
{redispatch}
frontend llm
    bind 127.0.0.1:{port}
    default_backend llm_servers

backend llm_servers
    balance {balance}
    option httpchk
",
            socket = socket.display(),
            timeout = ms(self.timeout),
            retries = self.retries,
            redispatch = if self.redispatch { "    option redispatch\n" } else { "" },
            balance = self.balance,
        );
        if self.check_path.contains("{server}") {
            s.push_str(&format!(
                "    http-check send meth GET uri-lf {}\n",
                self.check_path.replace("{server}", "%[srv_name]")
            ));
        } else {
            s.push_str(&format!("    http-check send meth GET uri {}\n", self.check_path));
        }
        s.push_str("    http-check expect status 200\n");
        s.push_str(&format!(
            "    default-server check inter {} fall {} rise {}\n",
            ms(self.check_inter),
            self.fall,
            self.rise
        ));
        for l in &self.backend_extra {
            s.push_str(&format!("    {l}\n"));
        }
        for sv in &self.servers {
            s.push_str(&format!("    server {} 127.0.0.1:{}", sv.name, sv.port));
            if let Some(p) = sv.check_port {
                s.push_str(&format!(" port {p}"));
            }
            if let Some(p) = sv.agent_port {
                s.push_str(&format!(
                    " agent-check agent-port {p} agent-send \"{}\\n\" agent-inter {}",
                    sv.agent_send.as_deref().unwrap_or(&sv.name),
                    ms(self.agent_inter)
                ));
            }
            s.push('\n');
        }
        s
    }
}

/// `inter`, `fall` and `rise` of the first `default-server` line of `examples/haproxy.cfg`.
pub fn shipped_checks() -> (Duration, u32, u32) {
    let cfg = include_str!("../../examples/haproxy.cfg");
    let line = cfg.lines().find(|l| l.trim_start().starts_with("default-server")).expect("a default-server line");
    let words: Vec<&str> = line.split_whitespace().collect();
    let after = |k: &str| words.iter().position(|w| *w == k).map(|i| words[i + 1]).expect(k);
    let inter = after("inter");
    let inter = match inter.strip_suffix("ms") {
        Some(ms) => Duration::from_millis(ms.parse().expect("inter")),
        None => Duration::from_secs(inter.trim_end_matches('s').parse().expect("inter")),
    };
    (inter, after("fall").parse().expect("fall"), after("rise").parse().expect("rise"))
}

/// The state HAProxy shows for a server (`show stat`'s `status`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Status {
    /// `UP`, or `UP 1/2` (up, a failed check counted).
    Up,
    /// `DRAIN`, `DRAIN (agent)`: up, but given no new requests.
    Drain,
    /// `DOWN`, `DOWN 1/2` (down, a good check counted), `DOWN (agent)`.
    Down,
    /// `MAINT` and its variants.
    Maint,
    /// Anything else (`NOLB`, `no check`), as shown.
    Other(String),
}

/// One server's line of `show stat`.
#[derive(Clone, Debug)]
pub struct ServerStat {
    pub name: String,
    /// The status column as shown (`UP`, `DRAIN (agent)`, `DOWN 1/2` …).
    pub status_text: String,
    pub status: Status,
    /// Sessions (requests) on the server now, and in all.
    pub current: u64,
    pub total: u64,
    /// The effective weight.
    pub weight: u64,
    /// Every column by its name, as shown.
    pub fields: BTreeMap<String, String>,
}

impl ServerStat {
    fn of(fields: BTreeMap<String, String>) -> ServerStat {
        let n = |k: &str| fields.get(k).and_then(|v| v.parse().ok()).unwrap_or(0);
        let text = fields.get("status").cloned().unwrap_or_default();
        let status = if text.starts_with("UP") {
            Status::Up
        } else if text.starts_with("DRAIN") {
            Status::Drain
        } else if text.starts_with("DOWN") {
            Status::Down
        } else if text.starts_with("MAINT") {
            Status::Maint
        } else {
            Status::Other(text.clone())
        };
        ServerStat {
            name: fields.get("svname").cloned().unwrap_or_default(),
            status_text: text,
            status,
            current: n("scur"),
            total: n("stot"),
            weight: n("weight"),
            fields,
        }
    }
}

/// A running HAProxy; stopped when dropped.
pub struct Haproxy {
    child: Option<Child>,
    port: u16,
    socket: PathBuf,
    log: PathBuf,
    config: String,
    // Last: removed after the process is gone.
    _dir: tempfile::TempDir,
}

/// The `haproxy` binary: `$SPECD_HAPROXY` or `haproxy` on the PATH.
fn haproxy_bin() -> String {
    std::env::var("SPECD_HAPROXY").unwrap_or_else(|_| "haproxy".into())
}

impl Haproxy {
    /// Checks and starts HAProxy with `cfg`; returns once its frontend accepts connections
    /// and its runtime socket answers. Fails with `haproxy -c`'s message on a refused
    /// configuration.
    pub fn start(cfg: &Config) -> anyhow::Result<Haproxy> {
        let dir = tempfile::Builder::new().prefix("specd-haproxy-").tempdir().context("a directory for haproxy")?;
        let socket = dir.path().join("admin.sock");
        let port = crate::free_port();
        let config = cfg.render(port, &socket);
        let path = dir.path().join("haproxy.cfg");
        std::fs::write(&path, &config).context("write haproxy.cfg")?;
        let out = Command::new(haproxy_bin())
            .arg("-c")
            .arg("-f")
            .arg(&path)
            .output()
            .with_context(|| format!("run {} -c (Debian's haproxy package)", haproxy_bin()))?;
        if !out.status.success() {
            bail!(
                "haproxy -c refused the configuration ({}):\n{}{}\n--- haproxy.cfg ---\n{config}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let log = dir.path().join("haproxy.log");
        let logf = std::fs::File::create(&log).context("create haproxy.log")?;
        let child = Command::new(haproxy_bin())
            .arg("-db")
            .arg("-f")
            .arg(&path)
            .stdin(Stdio::null())
            .stdout(logf.try_clone()?)
            .stderr(logf)
            .spawn()
            .context("start haproxy")?;
        let mut h = Haproxy { child: Some(child), port, socket, log, config, _dir: dir };
        let up = crate::wait_until("haproxy's frontend and runtime socket", Duration::from_secs(10), || {
            if h.child.as_mut().is_some_and(|c| c.try_wait().ok().flatten().is_some()) {
                return true;
            }
            TcpStream::connect(("127.0.0.1", port)).is_ok() && h.command("show info").is_ok()
        });
        if let Some(st) = h.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
            bail!("haproxy exited ({st}) at its start:\n{}", h.log());
        }
        up.with_context(|| h.log())?;
        Ok(h)
    }

    /// The frontend's port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The configuration it runs.
    pub fn config(&self) -> &str {
        &self.config
    }

    /// What HAProxy logged so far (its start-up messages, one line per request, server state
    /// changes).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// One command on the runtime socket; its answer.
    pub fn command(&self, cmd: &str) -> anyhow::Result<String> {
        let mut s = UnixStream::connect(&self.socket).with_context(|| format!("connect {}", self.socket.display()))?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        s.write_all(format!("{cmd}\n").as_bytes())?;
        let mut out = String::new();
        s.read_to_string(&mut out).with_context(|| format!("read the answer to {cmd:?}"))?;
        Ok(out)
    }

    /// Every server of the backend, from `show stat`.
    pub fn servers(&self) -> anyhow::Result<Vec<ServerStat>> {
        let out = self.command("show stat")?;
        let mut lines = out.lines();
        let header = lines.next().and_then(|h| h.strip_prefix("# ")).with_context(|| format!("show stat: {out}"))?;
        let names: Vec<&str> = header.split(',').collect();
        Ok(lines
            .filter(|l| l.starts_with("llm_servers,") && !l.starts_with("llm_servers,BACKEND,"))
            .map(|l| {
                let fields = names.iter().zip(l.split(',')).map(|(k, v)| (k.to_string(), v.to_string())).collect();
                ServerStat::of(fields)
            })
            .collect())
    }

    /// The server called `name`.
    pub fn server(&self, name: &str) -> anyhow::Result<ServerStat> {
        self.servers()?.into_iter().find(|s| s.name == name).with_context(|| format!("no server {name} in haproxy"))
    }

    /// Waits until server `name` satisfies `cond` (`desc` says what, for the error), at most
    /// `timeout`; its line then.
    pub fn wait_server(
        &self,
        name: &str,
        desc: &str,
        timeout: Duration,
        cond: impl Fn(&ServerStat) -> bool,
    ) -> anyhow::Result<ServerStat> {
        let last = Mutex::new(None);
        crate::wait_for(&format!("haproxy's server {name}: {desc}"), timeout, || {
            let s = self.server(name).ok()?;
            let ok = cond(&s);
            *last.lock().unwrap() = Some(s.clone());
            ok.then_some(s)
        })
        .with_context(|| {
            let l = last.lock().unwrap();
            match &*l {
                Some(s) => format!(
                    "last seen: status {:?}, check {:?} {:?}, agent {:?} {:?}",
                    s.status_text,
                    s.fields.get("check_status").map(String::as_str).unwrap_or(""),
                    s.fields.get("last_chk").map(String::as_str).unwrap_or(""),
                    s.fields.get("agent_status").map(String::as_str).unwrap_or(""),
                    s.fields.get("last_agt").map(String::as_str).unwrap_or(""),
                ),
                None => "never read".into(),
            }
        })
    }

    /// Waits until server `name` shows `status`.
    pub fn wait_status(&self, name: &str, status: Status, timeout: Duration) -> anyhow::Result<ServerStat> {
        let desc = format!("status {status:?}");
        self.wait_server(name, &desc, timeout, |s| s.status == status)
    }

    /// Stops HAProxy (SIGTERM: at once, connections closed) and waits for it; its exit status.
    pub fn stop(mut self) -> anyhow::Result<std::process::ExitStatus> {
        self.terminate().context("stop haproxy")
    }

    fn terminate(&mut self) -> anyhow::Result<std::process::ExitStatus> {
        let mut child = self.child.take().context("already stopped")?;
        // SAFETY: kill(2) on our own child, not yet reaped.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        match crate::wait_for("haproxy to exit", Duration::from_secs(5), || child.try_wait().ok().flatten()) {
            Ok(st) => Ok(st),
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                Err(e)
            }
        }
    }
}

impl Drop for Haproxy {
    fn drop(&mut self) {
        if self.child.is_some() {
            let _ = self.terminate();
        }
    }
}

/// An agent-check server the test drives by hand: answers every connection with the current
/// reply for the server name HAProxy sends ([`Agent::set`]), then closes it, as HAProxy
/// expects. A server without a reply of its own gets `ready up`. Stops when dropped.
pub struct Agent {
    port: u16,
    replies: Arc<Mutex<BTreeMap<String, String>>>,
    asked: Arc<Mutex<BTreeMap<String, usize>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Agent {
    /// An agent on a free port of 127.0.0.1.
    pub fn start() -> anyhow::Result<Agent> {
        let l = TcpListener::bind("127.0.0.1:0").context("bind the agent")?;
        let port = l.local_addr()?.port();
        let replies: Arc<Mutex<BTreeMap<String, String>>> = Arc::default();
        let asked: Arc<Mutex<BTreeMap<String, usize>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (r, a, s) = (replies.clone(), asked.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            for conn in l.incoming() {
                if s.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                let _ = conn.set_read_timeout(Some(Duration::from_secs(1)));
                let mut line = String::new();
                let _ = BufReader::new(&conn).read_line(&mut line);
                let name = line.trim().to_string();
                let reply = r.lock().unwrap().get(&name).cloned().unwrap_or_else(|| "ready up".into());
                *a.lock().unwrap().entry(name).or_default() += 1;
                let _ = (&conn).write_all(format!("{reply}\n").as_bytes());
            }
        });
        Ok(Agent { port, replies, asked, stop, thread: Some(thread) })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// From now on, answer `reply` (words such as `drain`, `ready up`, `down #why`) for
    /// server `name`.
    pub fn set(&self, name: &str, reply: &str) {
        self.replies.lock().unwrap().insert(name.to_string(), reply.to_string());
    }

    /// How many times HAProxy asked about `name`.
    pub fn asked(&self, name: &str) -> usize {
        self.asked.lock().unwrap().get(name).copied().unwrap_or(0)
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
