//! The promoter's evidence read from a real Prometheus (Debian's `prometheus` package, run as a
//! plain process with its own config, storage and loopback port) scraping three hosts' agents
//! every second. The agents are tiny HTTP servers in this process serving metrics text that
//! the test changes as a rollout would: a new revision, a death, a scrape with the args not
//! verified, an agent stopped. No root, no box.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use specd::parts::fleet::{Evidence, HostEvidence, Prometheus, Sample, Served, UnitEvidence, deaths_since, gather};
use specd_e2e::{wait_for, wait_until};
use specd_spec::fleet::{Promoted, Record, RolloutState, WaveRecord};

const UNIT: &str = "qwen.service";
const REV1: &str = "1111111111111111111111111111111111111111";
const REV2: &str = "2222222222222222222222222222222222222222";
/// Long enough for Prometheus to start, scrape and answer on a busy machine.
const WITHIN: Duration = Duration::from_secs(60);
/// The test's Prometheus's lookback delta.
const LOOKBACK_FLAG: &str = "--query.lookback-delta=30s";

/// A host's agent as far as Prometheus sees it: an HTTP server answering every request with
/// `status` and `text`, until stopped (then its port refuses connections).
struct Agent {
    reply: Arc<Mutex<(u16, String)>>,
    port: u16,
    stopped: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Agent {
    fn serve(status: u16, text: String) -> Agent {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let reply = Arc::new(Mutex::new((status, text)));
        let stopped = Arc::new(AtomicBool::new(false));
        let (r, s) = (reply.clone(), stopped.clone());
        let thread = std::thread::spawn(move || {
            for conn in listener.incoming() {
                if s.load(Ordering::SeqCst) {
                    break;
                }
                if let Ok(c) = conn {
                    let (status, body) = r.lock().unwrap().clone();
                    answer(c, status, &body);
                }
            }
        });
        Agent { reply, port, stopped, thread: Some(thread) }
    }

    fn set(&self, text: String) {
        self.reply.lock().unwrap().1 = text;
    }

    /// Stops serving: the listener is closed when this returns.
    fn stop(&mut self) {
        self.stopped.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(("127.0.0.1", self.port)); // wakes the accept
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.stop();
    }
}

fn answer(mut c: TcpStream, status: u16, body: &str) {
    c.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut req = Vec::new();
    let mut buf = [0u8; 1024];
    while !req.windows(4).any(|w| w == b"\r\n\r\n") {
        match c.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => req.extend_from_slice(&buf[..n]),
        }
    }
    let head = format!(
        "HTTP/1.1 {status} X\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let _ = c.write_all(head.as_bytes()).and_then(|()| c.write_all(body.as_bytes()));
}

/// What one host's agent serves.
#[derive(Clone)]
struct Figures {
    host: &'static str,
    labels: &'static str,
    revision: &'static str,
    unit_hash: &'static str,
    verified: Option<u8>,
    quarantined: u8,
    length: f64,
    rate: Option<f64>,
    crashes: u32,
    /// The kind of hold on the unit, if any.
    hold: Option<&'static str>,
    /// What its load balancers are told.
    serving: &'static str,
    /// How long the last start of the unit took (`specd_unit_start_duration_seconds`).
    start: f64,
    /// What its instance served (with `tune:` in the agent's config): accept length, decode
    /// tok/s per request, drafts.
    served: Option<(f64, f64, u64)>,
}

impl Figures {
    fn text(&self) -> String {
        let Figures { host, labels, revision, unit_hash, quarantined, length, crashes, .. } = self;
        let mut t = format!(
            "# TYPE specd_host_info gauge\nspecd_host_info{{host=\"{host}\"{labels}}} 1\n\
             # TYPE specd_source_info gauge\nspecd_source_info{{revision=\"{revision}\"}} 1\n\
             # TYPE specd_unit_info gauge\nspecd_unit_info{{unit=\"{UNIT}\",revision=\"{revision}\",unit_hash=\"{unit_hash}\"}} 1\n\
             # TYPE specd_unit_quarantined gauge\nspecd_unit_quarantined{{unit=\"{UNIT}\"}} {quarantined}\n\
             # TYPE specd_unit_accept_length gauge\nspecd_unit_accept_length{{unit=\"{UNIT}\"}} {length}\n\
             # TYPE specd_unit_deaths_total counter\n\
             specd_unit_deaths_total{{unit=\"{UNIT}\",verdict=\"crash\"}} {crashes}\n\
             specd_unit_deaths_total{{unit=\"{UNIT}\",verdict=\"cuda-oom\"}} 0\n",
        );
        if let Some(v) = self.verified {
            t += &format!("# TYPE specd_unit_args_verified gauge\nspecd_unit_args_verified{{unit=\"{UNIT}\"}} {v}\n");
        }
        if let Some(r) = self.rate {
            t += &format!("# TYPE specd_unit_accept_rate gauge\nspecd_unit_accept_rate{{unit=\"{UNIT}\"}} {r}\n");
        }
        t += "# TYPE specd_unit_serving gauge\n";
        for state in ["ready", "drain", "down"] {
            let v = u8::from(self.serving == state);
            t += &format!("specd_unit_serving{{unit=\"{UNIT}\",state=\"{state}\"}} {v}\n");
        }
        t += &format!(
            "# TYPE specd_unit_start_duration_seconds gauge\nspecd_unit_start_duration_seconds{{unit=\"{UNIT}\"}} {}\n",
            self.start
        );
        t += "# TYPE specd_unit_hold gauge\n";
        for kind in ["suspend", "pin", "sweep"] {
            let v = u8::from(self.hold == Some(kind));
            t += &format!("specd_unit_hold{{unit=\"{UNIT}\",kind=\"{kind}\"}} {v}\n");
        }
        if let Some((length, tok_s, drafts)) = self.served {
            t += &format!(
                "# TYPE specd_unit_served_accept_length gauge\nspecd_unit_served_accept_length{{unit=\"{UNIT}\"}} {length}\n\
                 # TYPE specd_unit_served_tokens_per_second gauge\nspecd_unit_served_tokens_per_second{{unit=\"{UNIT}\"}} {tok_s}\n\
                 # TYPE specd_unit_served_drafts gauge\nspecd_unit_served_drafts{{unit=\"{UNIT}\"}} {drafts}\n"
            );
        }
        if self.crashes > 0 {
            t += &format!(
                "# TYPE specd_unit_last_death_timestamp_seconds gauge\nspecd_unit_last_death_timestamp_seconds{{unit=\"{UNIT}\",verdict=\"crash\"}} 1800000000\n"
            );
        }
        t
    }

    /// The evidence these figures give (nothing of a rollout), served on `port`.
    fn evidence(&self, port: u16) -> HostEvidence {
        let labels = self
            .labels
            .split(',')
            .filter(|kv| !kv.is_empty())
            .map(|kv| {
                let (k, v) = kv.split_once('=').unwrap();
                (k.to_string(), v.trim_matches('"').to_string())
            })
            .collect();
        let unit = UnitEvidence {
            unit_hash: Some(self.unit_hash.into()),
            args_verified: self.verified.map(|v| v == 1),
            quarantined: self.quarantined == 1,
            accept_length: Some(self.length),
            accept_rate: self.rate,
            last_death: (self.crashes > 0).then(|| "crash".to_string()),
            hold: self.hold.map(String::from),
            serving: Some(self.serving.to_string()),
            start_seconds: Some(self.start),
            served: self.served.map(|(accept_length, tok_s, drafts)| Served {
                accept_length,
                tok_s,
                drafts: drafts as f64,
            }),
            ..Default::default()
        };
        HostEvidence {
            labels,
            down: None,
            revision: Some(self.revision.into()),
            target: ("specd".into(), format!("127.0.0.1:{port}")),
            units: BTreeMap::from([(UNIT.to_string(), unit)]),
        }
    }
}

/// The config of a Prometheus scraping `targets` every second.
fn scraping(targets: &[u16]) -> String {
    let targets: Vec<String> = targets.iter().map(|p| format!("\"127.0.0.1:{p}\"")).collect();
    format!(
        "global: {{scrape_interval: 1s, scrape_timeout: 1s}}\nscrape_configs:\n  - job_name: specd\n    static_configs: [{{targets: [{}]}}]\n",
        targets.join(", ")
    )
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

/// A rollout of REV2 whose wave `canary` promoted a and b at `at` (converged at `converged`),
/// and whose wave `rest` (c, promoted at the same time) has baked.
fn record(at: u64, converged: Option<u64>) -> Record {
    let promoted = |hosts: &[&str]| hosts.iter().map(|h| Promoted { host: h.to_string(), at }).collect();
    Record {
        target: REV2.into(),
        released: REV1.into(),
        state: RolloutState::Progressing,
        started: at,
        waves: vec![
            WaveRecord {
                name: "canary".into(),
                good: REV1.into(),
                promoted: promoted(&["a", "b"]),
                converged,
                baked: None,
            },
            WaveRecord {
                name: "rest".into(),
                good: REV1.into(),
                promoted: promoted(&["c"]),
                converged: Some(at),
                baked: Some(at),
            },
        ],
        halt: None,
    }
}

#[test]
fn the_evidence_is_what_prometheus_scraped_from_each_host_through_a_rollout() {
    let rt = runtime();
    let a1 = Figures {
        host: "a",
        labels: ",gpu=\"h100\",ring=\"canary\"",
        revision: REV1,
        unit_hash: "h1",
        verified: Some(1),
        quarantined: 0,
        length: 3.5,
        rate: Some(0.7),
        crashes: 0,
        hold: None,
        serving: "ready",
        start: 41.5,
        served: Some((2.8, 61.5, 900)),
    };
    // b's unit is suspended by hand, and drained for its load balancers.
    let b1 = Figures { host: "b", labels: ",gpu=\"a100\"", hold: Some("suspend"), serving: "drain", ..a1.clone() };
    // c's spec has no args checked, its engine reports no accept rate, its new unit failed, its
    // agent has no `tune:` (no served figures).
    let c1 = Figures {
        host: "c",
        labels: "",
        verified: None,
        quarantined: 1,
        length: 2.9,
        rate: None,
        served: None,
        ..a1.clone()
    };
    let (a, b, mut c) = (Agent::serve(200, a1.text()), Agent::serve(200, b1.text()), Agent::serve(200, c1.text()));
    let dir = tempfile::tempdir().unwrap();
    // A fourth target where no agent ever answered: a host, but which one is unknown.
    let nobody = specd_e2e::free_port();
    // A lookback delta of 30 s (5 minutes unless told): the evidence asked in the first 30 s
    // after a start compares each series' time with its target's last scrape, later it takes
    // the figures as they are.
    let started = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs_f64();
    let config = scraping(&[a.port, b.port, c.port, nobody]);
    let mut prom =
        specd_e2e::Prometheus::start_with(dir.path(), &config, &[LOOKBACK_FLAG]).unwrap_or_else(|e| panic!("{e:#}"));
    let url = prom.url();
    let p = Prometheus::new(&url, None).unwrap();
    let ask =
        |record: Option<&Record>, now: u64, stale_after: u64| rt.block_on(gather(&p, record, now as f64, stale_after));

    // Every host, its labels and figures, once each was scraped.
    let (t0, ev) = wait_for("three hosts scraped with every figure", WITHIN, || {
        let now = unix_now();
        let ev = ask(None, now, 60);
        let complete = ev.hosts.len() == 3
            && ev.hosts.values().all(|h| h.down.is_none() && h.revision.is_some())
            && !ev.unidentified.is_empty();
        complete.then_some((now, ev))
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", prom.log()));
    let before = BTreeMap::from([
        ("a".into(), a1.evidence(a.port)),
        ("b".into(), b1.evidence(b.port)),
        ("c".into(), c1.evidence(c.port)),
    ]);
    let unidentified = vec![format!("127.0.0.1:{nobody} (job specd)")];
    assert_eq!(ev, Evidence { hosts: before.clone(), unidentified, unavailable: None });
    assert_eq!(ev.hosts["a"].labels["ring"], "canary");

    // Prometheus says until when a restart could leave a vanished series visible: from then on,
    // the figures are asked as they are.
    let until = rt.block_on(p.unmarked_until()).unwrap();
    assert!(until > started + 29.9 && until < started + 30.0 + WITHIN.as_secs_f64(), "{until} {started}");
    wait_until("Prometheus older than its lookback delta", WITHIN, || unix_now() as f64 > until).unwrap();

    // a and b take REV2 (a lower accept length) a second after that; the figures of a second
    // before are REV1's.
    wait_until("a second after the first evidence", WITHIN, || unix_now() > t0 + 1).unwrap();
    let at = unix_now();
    let a2 = Figures {
        revision: REV2,
        unit_hash: "h2",
        length: 2.0,
        rate: Some(0.5),
        start: 83.25,
        served: Some((2.1, 48.0, 40)),
        ..a1.clone()
    };
    // b's new engine reports no accept rate: its old one does not come back; its new instance
    // has served nothing yet.
    let b2 = Figures { labels: b1.labels, host: "b", rate: None, served: None, ..a2.clone() };
    a.set(a2.text());
    b.set(b2.text());
    let rec = record(at, None);
    let ev = wait_for("a and b on REV2", WITHIN, || {
        let ev = ask(Some(&rec), unix_now(), 60);
        ["a", "b"].iter().all(|h| ev.hosts[*h].revision.as_deref() == Some(REV2)).then_some(ev)
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", prom.log()));
    let promoted = |f: &Figures, port: u16| {
        let mut h = f.evidence(port);
        let u = h.units.get_mut(UNIT).unwrap();
        (u.previous_accept_length, u.previous_accept_rate) = (Some(3.5), Some(0.7));
        u.previous_start_seconds = Some(41.5);
        u.previous_served = Some(Served { accept_length: 2.8, tok_s: 61.5, drafts: 900.0 });
        h
    };
    assert_eq!(ev.hosts["a"], promoted(&a2, a.port));
    assert_eq!(ev.hosts["b"], promoted(&b2, b.port));
    // c's wave baked: nothing of the rollout is asked about it.
    assert_eq!(ev.hosts["c"], c1.evidence(c.port));

    // a's server dies once: a death since the promotion, by its verdict.
    a.set(Figures { crashes: 1, ..a2.clone() }.text());
    let ev = wait_for("a's crash counted", WITHIN, || {
        let ev = ask(Some(&rec), unix_now(), 60);
        (!ev.hosts["a"].units[UNIT].deaths_since_promotion.is_empty()).then_some(ev)
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", prom.log()));
    assert_eq!(ev.hosts["a"].units[UNIT].deaths_since_promotion, BTreeMap::from([("crash".to_string(), 1.0)]));
    assert_eq!(ev.hosts["a"].units[UNIT].last_death.as_deref(), Some("crash"));
    assert!(ev.hosts["b"].units[UNIT].deaths_since_promotion.is_empty());

    // The wave converges; b's args are found not verified at one scrape, then verified again.
    let converged = unix_now();
    let rec = record(at, Some(converged));
    let throughout = |h: &str| {
        wait_for("a sample since the convergence", WITHIN, || {
            ask(Some(&rec), unix_now(), 60).hosts[h].units[UNIT].verified_throughout
        })
        .unwrap()
    };
    assert_eq!((throughout("a"), throughout("b")), (true, true));
    for (v, seen) in [(0, false), (1, true)] {
        b.set(Figures { verified: Some(v), ..b2.clone() }.text());
        wait_until("b's args_verified scraped", WITHIN, || {
            ask(Some(&rec), unix_now(), 60).hosts["b"].units[UNIT].args_verified == Some(seen)
        })
        .unwrap_or_else(|e| panic!("{e}\n{}", prom.log()));
    }
    let ev = ask(Some(&rec), unix_now(), 60);
    assert_eq!(ev.hosts["b"].units[UNIT].verified_throughout, Some(false));
    assert_eq!(ev.hosts["a"].units[UNIT].verified_throughout, Some(true));

    // c's agent stops: c is down, with what was last scraped of it.
    c.stop();
    let ev = wait_for("c down", WITHIN, || {
        let ev = ask(Some(&rec), unix_now(), 60);
        ev.hosts["c"].down.is_some().then_some(ev)
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", prom.log()));
    let c_down = HostEvidence { down: Some("its agent is down: the last scrape failed".into()), ..c1.evidence(c.port) };
    assert_eq!(ev.hosts["c"], c_down);
    assert_eq!(ev.hosts["a"].down, None);

    // Asked as if 20 s later (within the lookback delta), the samples of a and b are stale.
    let ev = ask(Some(&rec), unix_now() + 20, 10);
    for h in ["a", "b"] {
        let why = ev.hosts[h].down.as_deref().unwrap_or_default();
        assert!(
            why.starts_with("its last scrape is stale: 2") && why.ends_with("s old (more than 10 s)"),
            "{h}: {why}"
        );
    }

    // The API itself: a scalar, a query Prometheus refuses.
    let two = rt.block_on(p.query("1 + 1", None)).unwrap();
    assert_eq!(two, vec![Sample { labels: BTreeMap::new(), value: 2.0 }]);
    let refused = rt.block_on(p.query("rate(", None)).unwrap_err();
    assert!(refused.starts_with(&format!("Prometheus at {url} refused the query `rate(`: bad_data: ")), "{refused}");

    // a goes back to REV1 while Prometheus is down. Restarted, Prometheus marks no series stale
    // that vanished before its first scrape: once a is scraped again, its revision is the one
    // it reports, not the one it left.
    prom.stop();
    a.set(Figures { revision: REV1, unit_hash: "h1", ..a2.clone() }.text());
    // To the millisecond, as Prometheus stamps samples: a scrape of the second Prometheus was
    // stopped in came before it.
    let restarted = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs_f64();
    prom.resume().unwrap_or_else(|e| panic!("{e:#}"));
    let a_up = format!("timestamp(up{{instance=\"127.0.0.1:{}\"}})", a.port);
    let scraped = prom
        .wait("a scraped since the restart", &a_up, WITHIN, |r| r.first().is_some_and(|(_, t)| *t > restarted))[0]
        .1;
    // Asked at a whole second that has seen that scrape, within the lookback delta of the
    // restart: the series a left before it would still be given as they are.
    wait_until("a second past that scrape", WITHIN, || unix_now() as f64 > scraped).unwrap();
    let now = unix_now();
    assert!((now as f64) < rt.block_on(p.unmarked_until()).unwrap(), "asked within 30 s of the restart");
    let ev = ask(Some(&rec), now, 60);
    assert_eq!(ev.hosts["a"].revision.as_deref(), Some(REV1), "{:#?}", ev.hosts["a"]);
    assert_eq!(ev.hosts["a"].units[UNIT].unit_hash.as_deref(), Some("h1"), "{:#?}", ev.hosts["a"]);

    // Prometheus stopped: no evidence at all, saying where it was looked for.
    prom.stop();
    let ev = ask(Some(&rec), unix_now(), 60);
    let why = format!("Prometheus at {url}: unreachable (connection refused)");
    assert_eq!(ev, Evidence { unavailable: Some(why), ..Default::default() });
}

/// The deaths question as Prometheus's own engine answers it (`promtool test rules`, Debian's
/// `prometheus` package), on counters scraped every 20 s, asked at 160 s about the last 50 s
/// (the sample before the window is the one at 100 s).
#[test]
fn the_deaths_since_a_promotion_are_counted_by_prometheus_once_each_and_only_those() {
    let m = "specd_unit_deaths_total";
    let series = [
        ("a", "0x5 1x3", "one death in the window: 1, not the 1.25 `increase` would say"),
        ("b", "0x8", "none"),
        ("c", "0 1x7", "one before the window: none"),
        ("d", "2x6 0 0", "its agent restarted in the window, no death since: none"),
        ("e", "3x5 1 2 3", "its agent restarted just before the window, deaths since: counted"),
        ("f", "_x5 0 1 1", "a counter born in the window that moved: counted"),
    ];
    let mut input = String::new();
    for (host, values, _) in &series {
        let labels = format!("{{job=\"specd\",instance=\"{host}\",unit=\"u\",verdict=\"crash\"}}");
        input.push_str(&format!("      - series: '{m}{labels}'\n        values: '{values}'\n"));
    }
    let expected = [("a", 1), ("e", 3), ("f", 1)].map(|(host, v)| {
        format!("          - labels: '{{job=\"specd\",instance=\"{host}\",unit=\"u\",verdict=\"crash\"}}'\n            value: {v}\n")
    });
    let test = format!(
        "evaluation_interval: 20s\ntests:\n  - interval: 20s\n    input_series:\n{input}    promql_expr_test:\n      \
         - expr: '{}'\n        eval_time: 160s\n        exp_samples:\n{}",
        deaths_since(50),
        expected.concat()
    );
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("deaths.yml");
    std::fs::write(&file, &test).unwrap();
    let out = std::process::Command::new("promtool")
        .args(["test", "rules"])
        .arg(&file)
        .output()
        .expect("run promtool: install Debian's prometheus package (scripts/install-deps)");
    let why: Vec<String> = series.iter().map(|(h, v, what)| format!("{h} ({v}): {what}")).collect();
    assert!(
        out.status.success(),
        "{}{}\n{test}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        why.join("\n")
    );
}

#[test]
fn a_server_that_is_no_prometheus_is_named_with_its_answer() {
    let rt = runtime();
    let s = Agent::serve(503, "Service Unavailable".into());
    let url = format!("http://127.0.0.1:{}", s.port);
    let p = Prometheus::new(&url, None).unwrap();
    let ev = rt.block_on(gather(&p, None, unix_now() as f64, 60));
    assert_eq!(ev.unavailable, Some(format!("Prometheus at {url} answered 503")));
    let plain = Agent::serve(200, "hello".into());
    let url = format!("http://127.0.0.1:{}", plain.port);
    let err = rt.block_on(Prometheus::new(&url, None).unwrap().query("up", None)).unwrap_err();
    assert_eq!(err, format!("Prometheus at {url} answered `up` with no JSON"));
}
