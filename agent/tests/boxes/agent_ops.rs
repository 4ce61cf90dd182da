//! The agent as an operator runs it, in the box: systemd's watchdog restarts a hung agent,
//! commit signatures gate what the running agent deploys, and an https remote with a private
//! certificate and a token is followed.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::common::*;
use specd_e2e::ssh_key;

/// The fleet of these tests, with their own helpers.
struct OpsFleet(Fleet);

impl std::ops::Deref for OpsFleet {
    type Target = Fleet;
    fn deref(&self) -> &Fleet {
        &self.0
    }
}

impl OpsFleet {
    fn spec(&self, steps: u32) -> String {
        let service =
            "  service: {restart: always, timeout_stop_sec: 5, environment: {SPECD_STANDIN_LOAD_MS: \"200\"}}\n";
        sglang_spec(&self.e.standin, "qwen.service", self.e.port, steps, service)
    }

    fn commit(&self, steps: u32, sign: Option<&Path>) -> String {
        std::fs::write(self.repo.join("specs/qwen.yaml"), self.spec(steps)).unwrap();
        git(&self.repo, &["add", "-A"]);
        let key = sign.map(|k| format!("user.signingkey={}", k.display()));
        let mut args = vec![];
        if let Some(k) = &key {
            args.extend(["-c", "gpg.format=ssh", "-c", k.as_str()]);
        }
        args.extend(["commit", "-q", "-m", "steps"]);
        if sign.is_some() {
            args.push("-S");
        }
        git(&self.repo, &args);
        git(&self.repo, &["rev-parse", "HEAD"])
    }

    /// The agent as a Type=notify unit of the box, with `unit_extra` in its [Service] section and
    /// `config` as its agent config.
    fn start_agent(&self, config: &str, unit_extra: &str) {
        self.e.b.write_file("/run/agent.yaml", config).unwrap();
        // The local repository, unless the config names one.
        let repo = if config.contains("repo:") { String::new() } else { self.repo.display().to_string() };
        self.run_agent(&repo, "", unit_extra);
    }

    fn journal(&self) -> String {
        self.e.b.journal(AGENT).unwrap_or_default()
    }

    fn wait_steps(&self, steps: u64) {
        wait_until(&format!("steps={steps} to be served"), Duration::from_secs(60), || {
            self.e.served_steps() == Some(steps)
        })
        .unwrap_or_else(|err| panic!("{err}\nagent journal:\n{}", self.journal()));
    }

    fn status(&self) -> String {
        text(&self.e.specd(&["status"]))
    }

    fn wait_status(&self, what: &str, f: impl Fn(&str) -> bool) -> String {
        wait_until(what, Duration::from_secs(30), || f(&self.status()))
            .unwrap_or_else(|err| panic!("{err}\nstatus:\n{}\nagent journal:\n{}", self.status(), self.journal()));
        self.status()
    }
}

/// The agent's unit has `WatchdogSec=`; an agent that stops answering (SIGSTOP: hung, as a
/// deadlock would leave it) is killed by systemd and started again, and systemd says why.
#[test]
fn a_hung_agent_is_killed_by_the_watchdog_and_restarted() {
    let f = OpsFleet(Fleet::new());
    f.commit(5, None);
    f.start_agent("", "WatchdogSec=3\n");
    f.wait_steps(5);
    let pid = f.e.b.prop(AGENT, "MainPID").unwrap();
    assert_eq!(f.e.b.prop(AGENT, "WatchdogUSec").unwrap(), "3s");
    // Alive and pinging: systemd records each ping; pings spanning more than the limit, and still
    // the same process.
    let ping = |p: &str| f.e.b.prop(AGENT, p).ok().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    let first = ping("WatchdogTimestampMonotonic");
    assert!(first > 0, "the agent pings the watchdog");
    wait_until("pings over more than WatchdogSec", Duration::from_secs(30), || {
        ping("WatchdogTimestampMonotonic") > first + 3_000_000
    })
    .unwrap();
    assert_eq!(f.e.b.prop(AGENT, "MainPID").unwrap(), pid);
    let server = f.e.main_pid("qwen.service");
    f.e.b.sh_check(&format!("kill -STOP {pid}")).unwrap();
    wait_until("a new agent process", Duration::from_secs(60), || {
        f.e.b.prop(AGENT, "MainPID").is_ok_and(|p| p != pid && p != "0")
            && f.e.b.prop(AGENT, "ActiveState").is_ok_and(|s| s == "active")
    })
    .unwrap_or_else(|err| panic!("{err}\nagent journal:\n{}", f.journal()));
    let journal = f.journal();
    assert!(journal.contains("Watchdog timeout"), "{journal}");
    assert!(journal.contains("Failed with result 'watchdog'"), "{journal}");
    assert!(f.e.b.prop(AGENT, "NRestarts").unwrap().parse::<u32>().unwrap() >= 1);
    // The new agent finds the server in sync and leaves it running.
    wait_until("status to be green", Duration::from_secs(30), || f.e.specd(&["status"]).status.code() == Some(0))
        .unwrap_or_else(|err| panic!("{err}\n{}", f.status()));
    assert_eq!(f.e.main_pid("qwen.service"), server, "the server was not restarted");
    f.0.e.b.shutdown().unwrap();
}

/// With `verify_ssh_allowed_signers`, the running agent deploys only commits signed by an
/// allowed key; an unsigned or wrongly signed head is refused, and `status` names the commit.
#[test]
fn the_running_agent_deploys_only_commits_signed_by_an_allowed_key() {
    let f = OpsFleet(Fleet::new());
    let good = ssh_key(f.dir.path(), "good");
    let evil = ssh_key(f.dir.path(), "evil");
    let allowed = f.dir.path().join("allowed_signers");
    let pubkey = std::fs::read_to_string(good.with_extension("pub")).unwrap();
    std::fs::write(&allowed, format!("ops@example.com namespaces=\"git\" {pubkey}")).unwrap();
    let config = format!("verify_ssh_allowed_signers: {}\n", allowed.display());

    let c1 = f.commit(5, None);
    f.start_agent(&config, "");
    let st = f.wait_status("the unsigned head to be refused", |s| s.contains("head not deployed"));
    assert!(st.contains(&format!("commit {} is not signed", &c1[..12])), "{st}");
    assert!(f.e.b.read_to_string("/etc/systemd/system/qwen.service").is_err(), "nothing deployed");

    let c2 = f.commit(6, Some(&evil));
    let st = f.wait_status("the wrongly signed head to be refused", |s| s.contains(&c2[..12]));
    assert!(st.contains(&format!("commit {} is signed by a key that is not in", &c2[..12])), "{st}");
    assert!(f.e.b.read_to_string("/etc/systemd/system/qwen.service").is_err(), "nothing deployed");

    let c3 = f.commit(7, Some(&good));
    f.wait_steps(7);
    let st = f.wait_status("the signed head to be deployed", |s| !s.contains("head not deployed"));
    assert!(st.contains(&format!("deployed commit {}", &c3[..12])), "{st}");
    assert!(f.journal().contains("signature verified"), "{}", f.journal());
    f.0.e.b.shutdown().unwrap();
}

/// git's smart HTTP over TLS: `git http-backend` behind Python's http.server, which asks for
/// Basic credentials and accepts the token as the password.
const GIT_HTTPS_SERVER: &str = r#"
import base64, http.server, os, ssl, subprocess, sys
root, port_file, cert, key, token = sys.argv[1:6]

class Git(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        self.git()

    def do_POST(self):
        self.git()

    def body(self):
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while True:
                n = int(self.rfile.readline().strip().split(b";")[0], 16)
                if n == 0:
                    self.rfile.readline()
                    return out
                out += self.rfile.read(n)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def git(self):
        body = self.body()
        auth = self.headers.get("Authorization", "")
        user, password = "", None
        if auth.startswith("Basic "):
            user, _, password = base64.b64decode(auth[6:]).decode().partition(":")
        if password != token:
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="git"')
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        path, _, query = self.path.partition("?")
        env = dict(os.environ, GIT_PROJECT_ROOT=root, GIT_HTTP_EXPORT_ALL="1", PATH_INFO=path,
                   QUERY_STRING=query, REQUEST_METHOD=self.command, REMOTE_USER=user,
                   CONTENT_TYPE=self.headers.get("Content-Type", ""), CONTENT_LENGTH=str(len(body)),
                   GIT_PROTOCOL=self.headers.get("Git-Protocol", ""))
        out = subprocess.run(["git", "http-backend"], input=body, env=env, capture_output=True).stdout
        sep = b"\r\n\r\n" if b"\r\n\r\n" in out else b"\n\n"
        head, _, rest = out.partition(sep)
        status, headers = 200, []
        for line in head.decode().splitlines():
            k, _, v = line.partition(":")
            if k.lower() == "status":
                status = int(v.split()[0])
            elif k:
                headers.append((k, v.strip()))
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(rest)))
        self.end_headers()
        self.wfile.write(rest)

    def log_message(self, *args):
        pass

server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Git)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(cert, key)
server.socket = ctx.wrap_socket(server.socket, server_side=True)
with open(port_file + ".tmp", "w") as f:
    f.write(str(server.server_address[1]))
os.rename(port_file + ".tmp", port_file)
server.serve_forever()
"#;

/// An https:// remote with a self-signed certificate and a token: refused until the agent config
/// trusts the certificate (`ca_file`, as an operator would for a private CA), then deployed, and
/// a pushed commit follows.
#[test]
fn an_https_remote_with_a_private_certificate_and_a_token_deploys() {
    let f = OpsFleet(Fleet::new());
    let d = f.dir.path();
    let run = |cmd: &mut Command| {
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{cmd:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    run(Command::new("openssl")
        .args(["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1"])
        .args(["-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout"])
        .arg(d.join("key.pem"))
        .arg("-out")
        .arg(d.join("ca.pem")));
    std::fs::write(d.join("token"), "s3cr3t-git-token\n").unwrap();
    std::fs::write(d.join("server.py"), GIT_HTTPS_SERVER).unwrap();
    // The served repository: bare, pushed to from the working one.
    let served = d.join("served");
    std::fs::create_dir(&served).unwrap();
    run(Command::new("git").args(["init", "-q", "--bare", "-b", "main"]).arg(served.join("config.git")));
    git(&f.repo, &["checkout", "-q", "-b", "main"]);
    git(&f.repo, &["remote", "add", "origin", served.join("config.git").to_str().unwrap()]);
    let c1 = f.commit(5, None);
    git(&f.repo, &["push", "-q", "origin", "main"]);

    let port_file = d.join("port");
    let _server = Reaped(
        Command::new("python3")
            .arg(d.join("server.py"))
            .args([&served, &port_file, &d.join("ca.pem"), &d.join("key.pem")])
            .arg("s3cr3t-git-token")
            .spawn()
            .unwrap(),
    );
    wait_until("the https server to listen", Duration::from_secs(10), || port_file.exists()).unwrap();
    let port = std::fs::read_to_string(&port_file).unwrap();
    let url = format!("https://127.0.0.1:{port}/config.git");

    // Not trusted yet: nothing deploys and status says why.
    let config = format!("repo: {url}\ntoken_file: {}\n", d.join("token").display());
    f.start_agent(&config, "");
    let st = f.wait_status("the untrusted certificate to be reported", |s| s.contains("head not deployed"));
    assert!(st.to_lowercase().contains("certificate"), "{st}");
    assert!(f.e.b.read_to_string("/etc/systemd/system/qwen.service").is_err(), "nothing deployed");

    // Trusted through the agent config: deployed, fetched with the token.
    f.e.b.systemctl_check(&["stop", AGENT]).unwrap();
    f.start_agent(&format!("{config}ca_file: {}\n", d.join("ca.pem").display()), "");
    f.wait_steps(5);
    let st = f.wait_status("the head to be deployed", |s| s.contains(&format!("deployed commit {}", &c1[..12])));
    assert!(!st.contains("head not deployed"), "{st}");

    // A pushed commit is fetched at the next poll.
    let c2 = f.commit(7, None);
    git(&f.repo, &["push", "-q", "origin", "main"]);
    f.wait_steps(7);
    f.wait_status("the pushed commit to be deployed", |s| s.contains(&format!("deployed commit {}", &c2[..12])));
    f.0.e.b.shutdown().unwrap();
}
