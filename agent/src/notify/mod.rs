//! Webhook notifications: after a reconcile that did something, a JSON notice (unit, host,
//! commit, outcome, verdict, events, duration, and a plain `text` line that Slack-style receivers
//! show) is POSTed to every webhook of the agent config that asked for one of its events.
//!
//! Never in the way of a reconcile: [`Notifier::send`] only queues. Each webhook has its own
//! bounded queue and its own task (a dead receiver delays no other), retried with backoff; a full
//! queue drops its oldest notice and counts it (`specd_notifications_dropped`). A notice carries
//! no secret: it is built from the report and the unit's name, never from the spec's environment;
//! a webhook's token goes in the `Authorization` header, read from its file at each delivery.
//!
//! A webhook with `secret_file` gets each body signed as code forges sign theirs: the header
//! `X-Specd-Signature-256: sha256=<hex>`, the HMAC-SHA256 of the exact bytes of the body under
//! the secret (the file's content, surrounding whitespace removed); a receiver computes the same
//! over the body it read and compares in constant time. With `ca_file`, its certificates are
//! trusted for that webhook's server besides the public CAs.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
use prometheus_client::metrics::counter::Counter;
use serde::Serialize;

use crate::config::{NotifyEvent, Webhook};
use crate::core::conclude::Report;
use crate::core::guard::lock;
use crate::core::record::{Outcome, Source};
use crate::reconcile::{Ctx, DesiredState};

/// Notices kept per webhook while it cannot be reached; the oldest goes first.
pub const QUEUE: usize = 64;
/// One delivery attempt.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);
/// The header of a body's signature.
pub const SIGNATURE_HEADER: &str = "X-Specd-Signature-256";

/// `sha256=<hex>`: the HMAC-SHA256 of `body` under `secret`, as [`SIGNATURE_HEADER`] carries it.
pub fn signature(secret: &[u8], body: &[u8]) -> String {
    use hmac::{KeyInit, Mac};
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(secret).expect("HMAC takes a key of any length");
    mac.update(body);
    let tag = mac.finalize().into_bytes();
    let hex: String = tag.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256={hex}")
}

/// What one reconcile did, as a webhook receives it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Notice {
    pub unit: String,
    pub host: String,
    /// The commit of the desired state, when it came from the repository.
    pub commit: Option<String>,
    /// Where the desired state came from (`commit abc1234 (specs/qwen.yaml)`, `file ...`).
    pub source: Option<String>,
    /// `applied`, `started`, `rolledback`, `failed`.
    pub outcome: String,
    /// The reconcile's one line for a person.
    pub verdict: String,
    /// What a webhook's `events` are matched against.
    pub events: Vec<NotifyEvent>,
    pub sha256: String,
    pub durations: Durations,
    /// Unix time, seconds.
    pub time: u64,
    /// One line for chat receivers (Slack, Mattermost...).
    pub text: String,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Durations {
    /// The whole reconcile, observe to record.
    pub reconcile_seconds: f64,
}

impl Notice {
    /// The notice of a reconcile, or `None` when it did nothing worth telling (nothing done, a
    /// drift only reported, an unquarantine). `up`: whether the service runs after it.
    pub fn of(
        host: &str,
        d: &DesiredState,
        r: &Report,
        quarantined: bool,
        up: bool,
        took: Duration,
        time: u64,
    ) -> Option<Notice> {
        let outcome = r.outcome?;
        let mut events = match outcome {
            Outcome::Applied | Outcome::Started => vec![NotifyEvent::Applied],
            Outcome::RolledBack => vec![NotifyEvent::Rollback],
            Outcome::Failed | Outcome::Refused => vec![NotifyEvent::Failed],
            Outcome::Reported | Outcome::Unquarantined | Outcome::HoldSet | Outcome::HoldCleared => return None,
        };
        if quarantined && matches!(outcome, Outcome::RolledBack | Outcome::Failed) {
            events.push(NotifyEvent::Quarantine);
        }
        if !up {
            events.push(NotifyEvent::Down);
        }
        let commit = match &d.source {
            Some(Source::Commit { commit, .. }) => Some(commit.clone()),
            _ => None,
        };
        let unit = d.spec.unit.clone();
        let what = match outcome {
            Outcome::Applied => "applied",
            Outcome::Started => "started again",
            Outcome::RolledBack => "ROLLED BACK",
            Outcome::Refused => "REFUSED (nothing was stopped)",
            _ => "FAILED",
        };
        let from = commit.as_deref().map(|c| format!(" at {}", specd_spec::short(c))).unwrap_or_default();
        let down = if up { "" } else { " [DOWN]" };
        let text = format!("specd on {host}: {unit} {what}{from}{down}: {}", r.verdict);
        Some(Notice {
            unit,
            host: host.to_string(),
            commit,
            source: d.source.as_ref().map(ToString::to_string),
            outcome: format!("{outcome:?}").to_lowercase(),
            verdict: r.verdict.clone(),
            events,
            sha256: d.unit.sha256.clone(),
            durations: Durations { reconcile_seconds: (took.as_secs_f64() * 1000.0).round() / 1000.0 },
            time,
            text,
        })
    }
}

/// The counters of deliveries, registered in the agent's metrics.
#[derive(Clone, Default)]
pub struct Counters {
    pub delivered: Counter,
    /// Gave up after the retries (or refused by the receiver: a 4xx other than 408/429).
    pub failed: Counter,
    /// Dropped from a full queue, unsent.
    pub dropped: Counter,
}

/// Hands notices to the webhooks' tasks. Cheap to clone.
#[derive(Clone)]
pub struct Notifier {
    targets: Arc<Vec<Arc<Target>>>,
    pub counters: Counters,
}

struct Target {
    hook: Webhook,
    /// Its own when the webhook has a `ca_file`, else the one shared.
    client: reqwest::Client,
    queue: std::sync::Mutex<VecDeque<Notice>>,
    /// Notices queued or being delivered.
    pending: tokio::sync::watch::Sender<usize>,
    wake: tokio::sync::Notify,
    /// A flush ends the backoff sleep of a notice waiting to be tried again.
    hurry: tokio::sync::Notify,
}

impl Notifier {
    /// One task per webhook (on the current tokio runtime). `None` without webhooks.
    pub fn start(hooks: &[Webhook]) -> Option<Notifier> {
        if hooks.is_empty() {
            return None;
        }
        let counters = Counters::default();
        let builder = || {
            reqwest::Client::builder().timeout(ATTEMPT_TIMEOUT).user_agent(concat!("specd/", env!("CARGO_PKG_VERSION")))
        };
        let shared =
            builder().build().map_err(|e| tracing::error!("no notifications: cannot make an HTTP client: {e}")).ok()?;
        let targets: Vec<Arc<Target>> = hooks
            .iter()
            .filter_map(|h| {
                let client = match &h.ca_file {
                    None => shared.clone(),
                    // Checked when the config was read: this builds.
                    Some(ca) => match ca.certs.iter().fold(builder(), |b, c| b.add_root_certificate(c.clone())).build()
                    {
                        Ok(c) => c,
                        Err(e) => {
                            tracing::error!(webhook = %h.url, "no notifications to it: its ca_file: {e}");
                            return None;
                        }
                    },
                };
                Some(Arc::new(Target {
                    hook: h.clone(),
                    client,
                    queue: std::sync::Mutex::new(VecDeque::new()),
                    pending: tokio::sync::watch::channel(0).0,
                    wake: tokio::sync::Notify::new(),
                    hurry: tokio::sync::Notify::new(),
                }))
            })
            .collect();
        for t in &targets {
            tokio::spawn(deliver_loop(t.clone(), counters.clone()));
        }
        Some(Notifier { targets: Arc::new(targets), counters })
    }

    /// Queue `n` for every webhook that asked for one of its events; never waits.
    pub fn send(&self, n: &Notice) {
        for t in self.targets.iter().filter(|t| n.events.iter().any(|e| t.hook.events.contains(e))) {
            let mut q = lock(&t.queue);
            if q.len() >= QUEUE {
                q.pop_front();
                self.counters.dropped.inc();
                t.pending.send_modify(|p| *p = p.saturating_sub(1));
                tracing::warn!(webhook = %t.hook.url, "notification queue full: the oldest notice was dropped");
            }
            q.push_back(n.clone());
            t.pending.send_modify(|p| *p += 1);
            drop(q);
            t.wake.notify_one();
        }
    }

    /// Wait until every queued notice was delivered or given up, at most `within` (a one-shot
    /// command waits for its notice before it exits, the agent at its stop). A notice waiting to
    /// be tried again is tried at once, then on its backoff. True when nothing is left.
    pub async fn flush(&self, within: Duration) -> bool {
        for t in self.targets.iter() {
            t.hurry.notify_one();
        }
        let all = async {
            for t in self.targets.iter() {
                let mut rx = t.pending.subscribe();
                let _ = rx.wait_for(|p| *p == 0).await;
            }
        };
        tokio::time::timeout(within, all).await.is_ok()
    }
}

/// The process's notifier and the hostname its notices name, set once by [`install`].
static NOTIFIER: std::sync::OnceLock<(Notifier, String)> = std::sync::OnceLock::new();

/// Start delivering to the config's webhooks (nothing without any), for the rest of the process.
/// Returns the notifier (also kept for [`after_reconcile`]; its `counters` are the agent's to
/// export); a second call returns the first one's.
pub fn install(hooks: &[Webhook], host: &str) -> Option<Notifier> {
    if let Some((n, _)) = NOTIFIER.get() {
        return Some(n.clone());
    }
    let n = Notifier::start(hooks)?;
    let shown: Vec<String> = hooks.iter().map(|h| h.url.to_string()).collect();
    tracing::info!(webhooks = %shown.join(", "), "notifications on");
    let _ = NOTIFIER.set((n, host.to_string()));
    NOTIFIER.get().map(|(n, _)| n.clone())
}

/// Wait for the installed notifier's queue to empty, at most `within` (see [`Notifier::flush`]);
/// warns when notices are left.
pub async fn flush(within: Duration) {
    if let Some((n, _)) = NOTIFIER.get()
        && !n.flush(within).await
    {
        tracing::warn!("a webhook notice was not delivered within {within:?}; given up");
    }
}

/// After a reconcile of `d` that reported `r`: queue its notice, if it has one and webhooks
/// were [`install`]ed. Never waits for a delivery.
pub async fn after_reconcile<H: crate::host::Host>(ctx: &Ctx<H>, d: &DesiredState, r: &Report, took: Duration) {
    let Some((n, host)) = NOTIFIER.get() else { return };
    if r.outcome.is_none() {
        return;
    }
    let quarantined = ctx.store.peek(&d.spec.unit).is_ok_and(|st| st.quarantined(&d.unit.sha256).is_some());
    // After a failure, what the reconcile found as it concluded (its verdict says the same);
    // else systemd, now.
    let up = match &r.serving {
        Some(crate::core::conclude::Serving::Up) => true,
        Some(crate::core::conclude::Serving::Down { .. }) => false,
        Some(crate::core::conclude::Serving::Unknown) | None => {
            ctx.host.show(&d.spec.unit).await.is_ok_and(|p| p.active_state.is_up())
        }
    };
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    if let Some(notice) = Notice::of(host, d, r, quarantined, up, took, now) {
        n.send(&notice);
    }
}

enum Failure {
    /// Worth another try: no answer, a timeout, 408, 429, 5xx.
    Again(String),
    /// The receiver refused it (another 4xx): trying again will not help.
    Refused(String),
}

async fn deliver_loop(t: Arc<Target>, counters: Counters) {
    loop {
        let next = lock(&t.queue).pop_front();
        let Some(notice) = next else {
            t.wake.notified().await;
            continue;
        };
        let attempt = || deliver(&t.client, &t.hook, &notice);
        let backoff = ExponentialBuilder::default()
            .with_min_delay(Duration::from_secs(1))
            .with_max_delay(Duration::from_secs(60))
            .with_max_times(6)
            .with_jitter();
        let hurried = t.clone();
        let sleep = move |d: Duration| {
            let t = hurried.clone();
            async move {
                tokio::select! {
                    _ = tokio::time::sleep(d) => {}
                    _ = t.hurry.notified() => {}
                }
            }
        };
        let result = attempt
            .retry(backoff)
            .sleep(sleep)
            .when(|e| matches!(e, Failure::Again(_)))
            .notify(|e, after| {
                if let Failure::Again(why) = e {
                    tracing::info!(webhook = %t.hook.url, unit = %notice.unit, "notification not delivered ({why}); again in {after:?}");
                }
            })
            .await;
        match result {
            Ok(()) => {
                counters.delivered.inc();
            }
            Err(Failure::Again(why) | Failure::Refused(why)) => {
                counters.failed.inc();
                tracing::warn!(webhook = %t.hook.url, unit = %notice.unit, "notification given up: {why}");
            }
        }
        t.pending.send_modify(|p| *p = p.saturating_sub(1));
    }
}

async fn deliver(client: &reqwest::Client, hook: &Webhook, n: &Notice) -> Result<(), Failure> {
    // The bytes signed are the bytes sent.
    let body = serde_json::to_vec(n).map_err(|e| Failure::Refused(format!("the notice as JSON: {e}")))?;
    let mut req = client.post(hook.url.0.clone()).header(reqwest::header::CONTENT_TYPE, "application/json");
    if let Some(f) = &hook.secret_file {
        let secret = f.secret().map_err(Failure::Again)?;
        req = req.header(SIGNATURE_HEADER, signature(&secret, &body));
    }
    if let Some(f) = &hook.token_file {
        let token = tokio::fs::read_to_string(f)
            .await
            .map_err(|e| Failure::Again(format!("reading the token file {}: {e}", f.display())))?;
        req = req.bearer_auth(token.trim());
    }
    // The error's text may hold the URL, whose path may be a secret: only its kind is told.
    let resp = req.body(body).send().await.map_err(|e| {
        if untrusted(&e) {
            // Not a passing fault: trying again will not make it trusted.
            return Failure::Refused(format!(
                "the server's certificate is not trusted ({}): is its CA in the webhook's ca_file?",
                untrusted_why(&e)
            ));
        }
        Failure::Again(if e.is_timeout() {
            "timed out".into()
        } else if e.is_connect() {
            "cannot connect".into()
        } else {
            "request failed".into()
        })
    })?;
    let code = resp.status();
    match code.as_u16() {
        200..=299 => Ok(()),
        408 | 429 | 500..=599 => Err(Failure::Again(format!("answered {code}"))),
        _ => Err(Failure::Refused(format!("answered {code}"))),
    }
}

/// The TLS layer's refusal of the server's certificate, somewhere in `e`'s causes (rustls says
/// `invalid peer certificate: <why>`).
fn untrusted(e: &reqwest::Error) -> bool {
    causes(e).any(|c| c.to_string().starts_with("invalid peer certificate"))
}

/// Why the certificate was refused (`UnknownIssuer`, `Expired`...): rustls's words, no URL.
fn untrusted_why(e: &reqwest::Error) -> String {
    causes(e)
        .map(|c| c.to_string())
        .find_map(|t| t.strip_prefix("invalid peer certificate: ").map(str::to_string))
        .unwrap_or_default()
}

fn causes<'a>(e: &'a (dyn std::error::Error + 'static)) -> impl Iterator<Item = &'a (dyn std::error::Error + 'static)> {
    std::iter::successors(Some(e), |c| c.source())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::conclude::Action;

    fn desired() -> DesiredState {
        let yaml = "apiVersion: specd/v1\nkind: InferenceService\nmetadata: {name: q}\nspec:\n  unit: q.service\n  engine: sglang\n  model: /m\n  service:\n    allow_literal_secrets: true\n    environment: {HF_TOKEN: hf_very_secret}\n";
        let spec = specd_spec::parse("q.yaml", yaml).unwrap().resolve(None).unwrap();
        let src = Source::Commit { repo: "/r".into(), commit: "0123456789abcdef".into(), path: "specs/q.yaml".into() };
        DesiredState::new(spec, Some(src))
    }

    fn report(outcome: Option<Outcome>) -> Report {
        Report {
            plan: crate::core::plan::Plan {
                sync: crate::core::sync::SyncStatus::Failed,
                reasons: vec![],
                steps: vec![],
                toward: crate::core::plan::Toward::Desired,
            },
            outcome,
            verdict: "RolledBack: q.service: restored the last good unit".into(),
            stop_verdict: None,
            action: Action::AwaitChange,
            refused: false,
            serving: None,
            roll_wait: false,
        }
    }

    #[test]
    fn a_rollback_s_notice_names_unit_host_commit_and_events_and_no_secret() {
        let d = desired();
        let n =
            Notice::of("gpu-01", &d, &report(Some(Outcome::RolledBack)), true, true, Duration::from_millis(1234), 7)
                .unwrap();
        assert_eq!(n.events, [NotifyEvent::Rollback, NotifyEvent::Quarantine]);
        assert_eq!(n.outcome, "rolledback");
        assert_eq!(n.commit.as_deref(), Some("0123456789abcdef"));
        assert_eq!(n.durations.reconcile_seconds, 1.234);
        assert!(n.text.starts_with("specd on gpu-01: q.service ROLLED BACK at 0123456"), "{}", n.text);
        let body = serde_json::to_string(&n).unwrap();
        assert!(!body.contains("hf_very_secret"), "{body}");
        let down = Notice::of("h", &d, &report(Some(Outcome::Failed)), false, false, Duration::ZERO, 0).unwrap();
        assert_eq!(down.events, [NotifyEvent::Failed, NotifyEvent::Down]);
        assert!(down.text.contains("[DOWN]"));
    }

    /// A webhook that cannot be reached: its queue keeps the newest [`QUEUE`] notices and
    /// counts the ones it dropped; `send` never waits.
    #[tokio::test]
    async fn a_full_queue_drops_its_oldest_and_counts_it() {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let hook: Webhook =
            serde_saphyr::from_str(&format!("url: http://127.0.0.1:{port}/\nevents: [rollback]\n")).unwrap();
        let n = Notifier::start(&[hook]).unwrap();
        let d = desired();
        let mut notice =
            Notice::of("h", &d, &report(Some(Outcome::RolledBack)), false, true, Duration::ZERO, 0).unwrap();
        // On this single-threaded runtime the delivery task runs only when this test yields.
        for i in 0..QUEUE as u64 + 3 {
            notice.time = i;
            n.send(&notice);
        }
        assert_eq!(n.counters.dropped.get(), 3);
        let q = lock(&n.targets[0].queue);
        assert_eq!(q.len(), QUEUE);
        assert_eq!(q.front().map(|n| n.time), Some(3), "the oldest went first");
        assert_eq!(*n.targets[0].pending.borrow(), QUEUE);
        drop(q);
        // An event the webhook did not ask for is not queued.
        let applied = Notice::of("h", &d, &report(Some(Outcome::Applied)), false, true, Duration::ZERO, 0).unwrap();
        n.send(&applied);
        assert_eq!(lock(&n.targets[0].queue).len(), QUEUE);
    }

    /// RFC 4231's test cases 1 and 2 for HMAC-SHA-256, in the header's form.
    #[test]
    fn the_signature_is_hmac_sha256_in_hex() {
        assert_eq!(
            signature(b"Jefe", b"what do ya want for nothing?"),
            "sha256=5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        assert_eq!(
            signature(&[0x0b; 20], b"Hi There"),
            "sha256=b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"
        );
    }

    #[test]
    fn nothing_done_is_not_notified() {
        let d = desired();
        for o in [None, Some(Outcome::Reported), Some(Outcome::Unquarantined)] {
            assert_eq!(Notice::of("h", &d, &report(o), false, true, Duration::ZERO, 0), None);
        }
    }
}
