//! The answers to a unit's load balancers, read-only and without credentials: HAProxy's
//! agent-check on a TCP port of its own (`load_balancer.agent_check` in the agent config:
//! [`agent_check`]), and `GET /serving/<unit>` for HTTP checks (HAProxy's `httpchk`, nginx,
//! Envoy, Traefik, cloud load balancers: [`http`]), served on the agent's `listen` beside its
//! metrics. Each answer is the unit's serving state as the reconciler left it in specd's runtime
//! directory (`machine::serving`), and each poll is recorded in the unit's poll log: what an
//! apply waits on before it stops a serving instance (`core::serving::seen`).
//!
//! The agent (`specd run`) serves them; a one-shot `specd apply`, `rollback` or `sweep` serves
//! them for its own duration where no agent does (their ports free: [`serve_one_shot`]). Both
//! are bounded as the agent's other endpoints are (a cap of connections, a time for the request,
//! a small request), and nothing in them waits on a reconcile.

pub mod agent_check;
pub mod http;

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::config::LoadBalancerConfig;
use crate::core::guard::lock;
use crate::core::serving::{CheckKind, PollLog, ServingState, answered};
use crate::core::timing;
use crate::machine::serving::ServingFiles;

/// What answers a unit's load balancers: its state read, its poll log kept.
pub struct Answers {
    files: ServingFiles,
    /// Each unit's poll log as this process keeps it, and when it was last written.
    logs: Mutex<BTreeMap<String, (PollLog, Instant)>>,
}

impl Answers {
    pub fn new(files: ServingFiles) -> Arc<Answers> {
        Arc::new(Answers { files, logs: Mutex::default() })
    }

    /// A poll of `unit` by the load balancer at `peer`: its serving state now (`None`: it has
    /// none), the poll recorded (written at once when an apply may be waiting for it).
    pub fn answer(&self, kind: CheckKind, unit: &str, peer: IpAddr) -> Option<ServingState> {
        let state = self.files.read(unit);
        let now_ms = crate::machine::store::now_ms();
        let mut logs = lock(&self.logs);
        let (log, written) = logs.entry(unit.to_string()).or_insert_with(|| {
            let since = Instant::now().checked_sub(timing::POLL_LOG_EVERY).unwrap_or_else(Instant::now);
            (self.files.polls(unit), since)
        });
        let urgent = log.record(kind, &peer.to_canonical().to_string(), now_ms, answered(state.as_ref()));
        if urgent || written.elapsed() >= timing::POLL_LOG_EVERY {
            if let Err(e) = self.files.write_polls(unit, log) {
                tracing::warn!(unit, "recording a load balancer's poll: {e:#}");
            }
            *written = Instant::now();
        }
        state
    }

    /// The load balancers, by unit, that have not read the state this process leaves
    /// (`serving::unread`), as `addr (unit)`.
    pub fn unread(&self) -> Vec<String> {
        let now_ms = crate::machine::store::now_ms();
        let logs = lock(&self.logs);
        logs.iter()
            .flat_map(|(unit, (log, _))| {
                let state = self.files.read(unit);
                crate::core::serving::unread(log, state.as_ref(), now_ms)
                    .into_iter()
                    .map(move |a| format!("{a} ({unit})"))
            })
            .collect()
    }
}

/// The unit a load balancer names (HAProxy's server name, or the URL's last part): a unit name,
/// `.service` added when it has no suffix; `None` for a name no unit may have.
pub fn unit_of(name: &str) -> Option<String> {
    let unit = if name.contains('.') { name.to_string() } else { format!("{name}.service") };
    specd_spec::unit_name_problem(&unit).is_none().then_some(unit)
}

/// What a one-shot command serves while it runs: stopped when dropped.
#[derive(Default)]
pub struct Endpoints {
    served: Vec<tokio::task::JoinHandle<()>>,
    answers: Option<Arc<Answers>>,
    /// When it began answering the agent-check (unix ms): its load balancers had nothing to poll
    /// before.
    since_ms: Option<u64>,
}

impl Endpoints {
    /// One more, stopped with the others, answering with `answers`.
    pub fn push(&mut self, h: tokio::task::JoinHandle<()>, answers: &Arc<Answers>) {
        self.served.push(h);
        self.answers = Some(answers.clone());
    }

    /// How this command's reconciles wait for the load balancers (`cfg`'s): where it answers
    /// them itself, they have polled nothing before (`Balancers::answering_since_ms`).
    pub fn balancers(&self, cfg: &LoadBalancerConfig) -> crate::core::serving::Balancers {
        crate::core::serving::Balancers { answering_since_ms: self.since_ms, ..cfg.balancers() }
    }

    /// At the command's end: stays until every load balancer still polling has read the state
    /// the command leaves (at most [`timing::ONE_SHOT_LINGER`]), then stops answering. One that
    /// has not is named: HAProxy keeps the last word it read (a `drain`) until something answers.
    pub async fn finish(self) {
        let Some(answers) = self.answers.as_ref().filter(|_| !self.served.is_empty()) else { return };
        let t0 = Instant::now();
        loop {
            let unread = answers.unread();
            if unread.is_empty() {
                return;
            }
            if t0.elapsed() >= timing::ONE_SHOT_LINGER {
                return tracing::warn!(
                    "{} did not read what this command leaves within {} s: it keeps the last word it read until the agent or another command answers it",
                    unread.join(", "),
                    timing::ONE_SHOT_LINGER.as_secs()
                );
            }
            tokio::time::sleep(timing::LB_LOOK).await;
        }
    }
}

impl Drop for Endpoints {
    fn drop(&mut self) {
        for h in &self.served {
            h.abort();
        }
    }
}

/// For a one-shot `specd apply`, `rollback` or `sweep`: the agent-check of `cfg` answered with
/// `answers` where its port is free (no agent runs: then an apply gives its load balancers
/// [`timing::FIRST_POLLS_WITHIN`] to poll before it concludes none does); where it is not, the
/// agent answers, and nothing is said. (Its HTTP checks: `daemon::listen::serve_checks`.)
pub fn serve_one_shot(cfg: &LoadBalancerConfig, answers: &Arc<Answers>) -> Endpoints {
    let mut out = Endpoints::default();
    if let Some(addr) = cfg.agent_check {
        match agent_check::serve(addr, answers.clone()) {
            Ok(h) => {
                out.push(h, answers);
                out.since_ms = Some(crate::machine::store::now_ms());
            }
            Err(e) if in_use(&e) => {}
            Err(e) => tracing::warn!("load_balancer.agent_check {addr}: {e:#}; not answered by this command"),
        }
    }
    out
}

/// The address is another process's (the agent's).
pub fn in_use(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.downcast_ref::<std::io::Error>().is_some_and(|e| e.kind() == std::io::ErrorKind::AddrInUse))
}
