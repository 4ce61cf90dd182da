//! Webhook notifications from the running agent in the box, received by a plain HTTP listener of
//! this test: a rollback is delivered once with the fields an operator reads, a secret of the
//! spec or the webhook's token never appears in a body, and a dead receiver delays nothing and
//! gets its notices once it answers; an https webhook of a private CA, its bodies signed.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::mpsc;
use std::time::Duration;

use crate::common::*;

const SECRET: &str = "hf_notify_secret_5e1a";
const TOKEN: &str = "hook-token-7f3c";

/// One request the receiver got: its headers (lowercased names) and its JSON body.
#[derive(Debug)]
struct Delivery {
    headers: Vec<(String, String)>,
    raw: String,
    body: serde_json::Value,
}

/// A minimal HTTP/1.1 server that answers 200 to every POST and hands each to the test.
fn receiver(listener: TcpListener) -> mpsc::Receiver<Delivery> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let mut r = BufReader::new(conn.try_clone().unwrap());
            let mut headers = Vec::new();
            let mut line = String::new();
            if r.read_line(&mut line).unwrap_or(0) == 0 {
                continue;
            }
            loop {
                line.clear();
                if r.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                if let Some((k, v)) = line.trim_end().split_once(':') {
                    headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
                }
            }
            let len: usize =
                headers.iter().find(|(k, _)| k == "content-length").and_then(|(_, v)| v.parse().ok()).unwrap_or(0);
            let mut body = vec![0; len];
            if r.read_exact(&mut body).is_err() {
                continue;
            }
            let raw = String::from_utf8_lossy(&body).to_string();
            let body = serde_json::from_str(&raw).unwrap_or_default();
            // Handed to the test before the answer: whoever got the answer, the test has it.
            if tx.send(Delivery { headers, raw, body }).is_err() {
                return;
            }
            let _ = conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        }
    });
    rx
}

/// The fleet of these tests, with their own helpers.
struct NotifyFleet(Fleet);

impl std::ops::Deref for NotifyFleet {
    type Target = Fleet;
    fn deref(&self) -> &Fleet {
        &self.0
    }
}

impl NotifyFleet {
    fn spec(&self, steps: u32, env: &str) -> String {
        let service = format!(
            "  service: {{restart: always, timeout_stop_sec: 5, allow_literal_secrets: true, environment: {{HF_TOKEN: \"{SECRET}\", {env}SPECD_STANDIN_LOAD_MS: \"200\"}}}}\n"
        );
        sglang_spec(&self.e.standin, "qwen.service", self.e.port, steps, &service)
    }

    fn commit(&self, text: &str, msg: &str) -> String {
        std::fs::write(self.repo.join("specs/qwen.yaml"), text).unwrap();
        git(&self.repo, &["add", "-A"]);
        git(&self.repo, &["commit", "-q", "-m", msg]);
        git(&self.repo, &["rev-parse", "HEAD"])
    }

    fn start_agent(&self, config: &str) {
        self.e.b.write_file("/run/agent.yaml", config).unwrap();
        self.run_agent(&self.repo.display().to_string(), "", "");
    }

    fn next(&self, rx: &mpsc::Receiver<Delivery>, what: &str) -> Delivery {
        rx.recv_timeout(Duration::from_secs(60)).unwrap_or_else(|_| {
            panic!("no delivery of {what} within 60 s\nagent journal:\n{}", self.e.b.journal(AGENT).unwrap_or_default())
        })
    }

    fn metric(&self, name: &str) -> Option<u64> {
        let (_, body) = http_get(self.listen, "/metrics")?;
        body.lines().find_map(|l| l.strip_prefix(&format!("{name} "))).and_then(|v| v.trim().parse().ok())
    }
}

#[test]
fn a_rollback_is_delivered_once_without_secrets_and_a_dead_receiver_delays_nothing() {
    let f = NotifyFleet(Fleet::new());
    let live = TcpListener::bind("127.0.0.1:0").unwrap();
    let live_port = live.local_addr().unwrap().port();
    let rx = receiver(live);
    // Nothing listens here until the end of the test.
    let dead_port = free_port();
    f.e.b.write_file("/run/hook-token", format!("{TOKEN}\n")).unwrap();
    f.start_agent(&format!(
        "notify:\n  webhooks:\n    - url: http://127.0.0.1:{live_port}/hooks/specd\n      events: [applied, rollback]\n      token_file: /run/hook-token\n    - url: http://127.0.0.1:{dead_port}/hook\n"
    ));

    // The first commit applies: one `applied` notice.
    let c1 = f.commit(&f.spec(5, ""), "steps 5");
    let d = f.next(&rx, "the first apply");
    assert_eq!(d.body["outcome"], "applied", "{}", d.raw);
    assert_eq!(d.body["commit"], c1.as_str(), "{}", d.raw);

    // A commit whose server exits at start: rolled back to the first, quarantined.
    let c2 = f.commit(&f.spec(7, "SPECD_STANDIN_EXIT_CODE: \"3\", "), "fails at start");
    let d = f.next(&rx, "the rollback");
    let b = &d.body;
    assert_eq!(b["unit"], "qwen.service", "{}", d.raw);
    assert_eq!(b["host"], "gpu-01", "{}", d.raw);
    assert_eq!(b["commit"], c2.as_str(), "{}", d.raw);
    assert_eq!(b["outcome"], "rolledback", "{}", d.raw);
    assert_eq!(b["events"], serde_json::json!(["rollback", "quarantine"]), "{}", d.raw);
    assert!(b["verdict"].as_str().unwrap().contains("RolledBack"), "{}", d.raw);
    assert!(b["durations"]["reconcile_seconds"].as_f64().unwrap() > 0.0, "{}", d.raw);
    let text = b["text"].as_str().unwrap();
    assert!(text.starts_with(&format!("specd on gpu-01: qwen.service ROLLED BACK at {}", &c2[..7])), "{text}");
    let auth = d.headers.iter().find(|(k, _)| k == "authorization").map(|(_, v)| v.as_str());
    assert_eq!(auth, Some(format!("Bearer {TOKEN}").as_str()), "the token file's token, as a header");
    assert_eq!(f.e.state("qwen.service")["quarantine"].as_array().map(Vec::len), Some(1));
    // The first unit serves again.
    wait_until("steps 5 to serve again", Duration::from_secs(30), || f.e.served_steps() == Some(5)).unwrap();

    // A working commit: its `applied` notice is the next delivery, so the rollback was delivered
    // exactly once (a webhook's notices arrive in order).
    let c3 = f.commit(&f.spec(9, ""), "steps 9");
    let d3 = f.next(&rx, "the apply after the rollback");
    assert_eq!(
        (d3.body["outcome"].as_str(), d3.body["commit"].as_str()),
        (Some("applied"), Some(c3.as_str())),
        "{}",
        d3.raw
    );
    assert!(!d.raw.contains(SECRET) && !d3.raw.contains(SECRET), "a secret of the spec is in a notice");
    assert!(!d.raw.contains(TOKEN) && !d3.raw.contains(TOKEN), "the token is in a notice");
    // Counted once the agent has read the answer.
    wait_until("3 deliveries to be counted", Duration::from_secs(10), || {
        f.metric("specd_notifications_delivered_total") == Some(3)
    })
    .unwrap();

    // The dead receiver held up none of that; once it answers, its retried notices arrive (all
    // three: applied, rollback, applied, in order).
    assert_eq!(f.metric("specd_notifications_failed_total"), Some(0));
    let dead = receiver(TcpListener::bind(("127.0.0.1", dead_port)).unwrap());
    let got: Vec<(String, String)> = (0..3)
        .map(|_| {
            let d = f.next(&dead, "a retried notice");
            assert!(d.headers.iter().all(|(k, _)| k != "authorization"), "no token configured, none sent");
            assert!(!d.raw.contains(SECRET));
            (d.body["outcome"].as_str().unwrap().into(), d.body["commit"].as_str().unwrap().into())
        })
        .collect();
    assert_eq!(got, [("applied".into(), c1), ("rolledback".into(), c2), ("applied".into(), c3)]);
    wait_until("the deliveries to be counted", Duration::from_secs(10), || {
        f.metric("specd_notifications_delivered_total") == Some(6)
    })
    .unwrap();
    assert_eq!(f.metric("specd_notifications_dropped_total"), Some(0));
    f.0.e.b.shutdown().unwrap();
}

/// `specd apply` tells the webhooks of the agent config too, and its notice is delivered before
/// the command exits (a one-shot command has no later to retry in).
#[test]
fn specd_apply_delivers_its_notice_before_it_exits() {
    let e = Env::new();
    let live = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = live.local_addr().unwrap().port();
    let rx = receiver(live);
    e.b.write_file("/run/agent.yaml", format!("notify:\n  webhooks:\n    - url: http://127.0.0.1:{port}/\n")).unwrap();
    let service = "  service: {restart: always, timeout_stop_sec: 2, environment: {SPECD_STANDIN_LOAD_MS: \"100\"}}\n";
    let good = e.put("good.yaml", &e.spec("qwen.service", 5, service));
    let o = e.specd(&["apply", "-f", &good, "--config", "/run/agent.yaml"]);
    assert!(o.status.success(), "{}", text(&o));
    let d = rx.try_recv().expect("delivered before apply exited");
    assert_eq!(d.body["outcome"], "applied", "{}", d.raw);
    assert_eq!(d.body["unit"], "qwen.service");
    assert_eq!(d.body["commit"], serde_json::Value::Null, "a file, not a commit");
    assert_eq!(d.body["source"], format!("file {good}"), "{}", d.raw);

    let bad = e.put(
        "bad.yaml",
        &e.spec(
            "qwen.service",
            7,
            &service.replace("SPECD_STANDIN_LOAD_MS", "SPECD_STANDIN_EXIT_CODE: \"3\", SPECD_STANDIN_LOAD_MS"),
        ),
    );
    let o = e.specd(&["apply", "-f", &bad, "--config", "/run/agent.yaml"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let d = rx.try_recv().expect("delivered before apply exited");
    assert_eq!(d.body["outcome"], "rolledback", "{}", d.raw);
    assert_eq!(d.body["events"], serde_json::json!(["rollback", "quarantine"]), "{}", d.raw);
    // A dry run changes nothing and tells nobody.
    let o = e.specd(&["apply", "-f", &good, "--config", "/run/agent.yaml", "--dry-run"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(rx.try_recv().is_err());
    e.b.shutdown().unwrap();
}

/// A notice still queued when the agent is stopped (its receiver did not answer yet) is retried
/// during the stop, not lost with the process.
#[test]
fn a_notice_queued_when_the_agent_stops_is_delivered_during_the_stop() {
    let f = NotifyFleet(Fleet::new());
    // Nothing listens here until the agent is stopping.
    let port = free_port();
    f.start_agent(&format!("notify:\n  webhooks:\n    - url: http://127.0.0.1:{port}/hook\n"));
    let c1 = f.commit(&f.spec(5, ""), "steps 5");
    // Applied and verified (its notice is queued as the reconcile ends), the first delivery
    // refused.
    wait_until("the apply", Duration::from_secs(60), || {
        // No state file before the agent's first reconcile of the unit.
        let Ok(text) = f.e.b.read_to_string("/var/lib/specd/units/qwen.service.json") else { return false };
        let st: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
        st["in_progress"].is_null() && st["last_good"]["sha256"].is_string()
    })
    .unwrap();
    f.e.b.systemctl_check(&["stop", "--no-block", AGENT]).unwrap();
    let rx = receiver(TcpListener::bind(("127.0.0.1", port)).unwrap());
    let d = f.next(&rx, "the notice queued at the stop");
    assert_eq!(
        (d.body["outcome"].as_str(), d.body["commit"].as_str()),
        (Some("applied"), Some(c1.as_str())),
        "{}",
        d.raw
    );
    wait_until("the agent to stop", Duration::from_secs(30), || {
        f.e.b.prop(AGENT, "ActiveState").is_ok_and(|s| s == "inactive")
    })
    .unwrap();
    f.0.e.b.shutdown().unwrap();
}

/// An https receiver with a certificate of the test's own CA, that checks each body's
/// `X-Specd-Signature-256` with its secret (Python's hmac, not specd's code): 200 when it
/// matches, 401 otherwise. Each request is printed as a JSON line on stdout before the answer.
const SIGNED_RECEIVER: &str = r#"
import hashlib, hmac, http.server, json, os, ssl, sys
cert, key, secret_file, port_file = sys.argv[1:5]
secret = open(secret_file, "rb").read().strip()

class Hook(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        got = self.headers.get("X-Specd-Signature-256", "")
        want = "sha256=" + hmac.new(secret, body, hashlib.sha256).hexdigest()
        valid = hmac.compare_digest(got, want)
        print(json.dumps({"path": self.path, "signature": got, "valid": valid,
                          "content_type": self.headers.get("Content-Type"), "body": body.decode()}), flush=True)
        self.send_response(200 if valid else 401)
        self.send_header("Content-Length", "0")
        self.send_header("Connection", "close")
        self.end_headers()

    def log_message(self, *args):
        pass

server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hook)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(cert, key)
server.socket = ctx.wrap_socket(server.socket, server_side=True)
with open(port_file + ".tmp", "w") as f:
    f.write(str(server.server_address[1]))
os.rename(port_file + ".tmp", port_file)
server.serve_forever()
"#;

/// A CA of the test's own (as an operator's internal one) and a server certificate it signed for
/// 127.0.0.1: `ca.pem`, `server.pem`, `server.key` in `d`.
fn test_ca(d: &std::path::Path) {
    let openssl = |args: &[&str]| {
        let out = std::process::Command::new("openssl").args(args).current_dir(d).output().unwrap();
        assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"];
    openssl(
        &[
            &["req", "-x509"],
            &ec[..],
            &["-days", "2", "-subj", "/CN=specd test CA", "-keyout", "ca.key", "-out", "ca.pem"],
            &["-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
        ]
        .concat(),
    );
    openssl(&[&["req"], &ec[..], &["-subj", "/CN=127.0.0.1", "-keyout", "server.key", "-out", "server.csr"]].concat());
    std::fs::write(
        d.join("server.ext"),
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    openssl(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        "server.ext",
        "-out",
        "server.pem",
    ]);
}

/// A webhook with `ca_file` (the test's CA) and `secret_file`: delivered over TLS to a server
/// only that CA vouches for, its body signed so that the receiver's own HMAC check accepts it. A
/// webhook signing with another secret is refused by the receiver (401), and one without the
/// CA does not trust the server: both are given up at once, and `specd apply` says so on its
/// stderr as warnings.
#[test]
fn an_https_webhook_with_a_private_ca_is_signed_and_a_wrong_signature_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    test_ca(d);
    std::fs::write(d.join("secret"), "shared-hook-secret-81c2\n").unwrap();
    std::fs::write(d.join("receiver.py"), SIGNED_RECEIVER).unwrap();
    let port_file = d.join("port");
    let mut child = std::process::Command::new("python3")
        .arg(d.join("receiver.py"))
        .args([d.join("server.pem"), d.join("server.key"), d.join("secret"), port_file.clone()])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let _receiver = Reaped(child);
    let (tx, rx) = mpsc::channel::<serde_json::Value>();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(serde_json::from_str(&line).unwrap()).is_err() {
                return;
            }
        }
    });
    wait_until("the https receiver to listen", Duration::from_secs(10), || port_file.exists()).unwrap();
    let port = std::fs::read_to_string(&port_file).unwrap();

    let e = Env::new();
    e.b.write_file("/run/hook/ca.pem", std::fs::read(d.join("ca.pem")).unwrap()).unwrap();
    e.b.write_file("/run/hook/secret", "shared-hook-secret-81c2\n").unwrap();
    e.b.write_file("/run/hook/wrong", "not-the-secret\n").unwrap();
    let url = format!("https://127.0.0.1:{port}");
    e.b.write_file(
        "/run/agent.yaml",
        format!(
            "notify:\n  webhooks:\n    - url: {url}/signed\n      ca_file: /run/hook/ca.pem\n      secret_file: /run/hook/secret\n    - url: {url}/forged\n      ca_file: /run/hook/ca.pem\n      secret_file: /run/hook/wrong\n    - url: {url}/untrusted\n      secret_file: /run/hook/secret\n"
        ),
    )
    .unwrap();
    let service = "  service: {restart: always, timeout_stop_sec: 2, environment: {SPECD_STANDIN_LOAD_MS: \"100\"}}\n";
    let spec = e.put("good.yaml", &e.spec("qwen.service", 5, service));
    let o = e.specd(&["apply", "-f", &spec, "--config", "/run/agent.yaml"]);
    assert!(o.status.success(), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);

    // Both requests that reached the receiver were printed before they were answered, so before
    // the apply exited.
    let mut got: Vec<serde_json::Value> = rx.try_iter().collect();
    got.sort_by_key(|r| r["path"].as_str().unwrap_or("").to_string());
    assert_eq!(got.len(), 2, "{got:#?}\n{err}");
    let (forged, signed) = (&got[0], &got[1]);
    assert_eq!(signed["path"], "/signed");
    assert_eq!(signed["valid"], true, "{signed}");
    assert_eq!(signed["content_type"], "application/json");
    let body: serde_json::Value = serde_json::from_str(signed["body"].as_str().unwrap()).unwrap();
    assert_eq!((body["unit"].as_str(), body["outcome"].as_str()), (Some("qwen.service"), Some("applied")), "{body}");
    let sig = signed["signature"].as_str().unwrap();
    assert!(sig.len() == 71 && sig.starts_with("sha256=") && sig[7..].bytes().all(|b| b.is_ascii_hexdigit()), "{sig}");
    assert_eq!(forged["path"], "/forged");
    assert_eq!(forged["valid"], false, "{forged}");
    assert_eq!(forged["body"], signed["body"], "the same notice, signed with another secret");

    // The one-shot command's warnings, on its stderr.
    let host = format!("webhook=https://127.0.0.1:{port}");
    assert!(
        err.lines().any(|l| l.starts_with("specd: warning: notification given up: answered 401 Unauthorized")
            && l.contains(&host)
            && l.contains("unit=qwen.service")),
        "{err}"
    );
    assert!(
        err.lines()
            .any(|l| l.starts_with("specd: warning: notification given up: the server's certificate is not trusted")
                && l.contains("ca_file")),
        "{err}"
    );
    assert!(!err.contains("not delivered within"), "{err}");
    e.b.shutdown().unwrap();
}
