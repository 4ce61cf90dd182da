//! Prometheus metrics of the agent, served as OpenMetrics text on its read-only endpoint
//! (`listen.rs`). Every name, type and label is in docs/reference.md's table of metrics; the alert
//! rules and the Grafana dashboard under `monitoring/` name only these (checked by
//! `every_name_in_the_rules_and_the_dashboard_is_served`).
//!
//! What a unit's series say comes from its state after each reconcile ([`UnitFigures::of`]), and
//! its deaths from the diagnosis of each instance that ended ([`Deaths`]). A series whose label
//! changes (the source's revision, a unit's deployed revision and hash) is replaced, never kept
//! beside the new one at 0.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;

use crate::core::hold::HoldKind;
use crate::core::record::{Source, UnitState};
use crate::core::serving::Word;
use crate::core::sync::SyncStatus;
use crate::diagnose::Verdict;

type Labels = Vec<(String, String)>;
type FloatGauge = Gauge<f64, AtomicU64>;

pub struct Metrics {
    registry: Mutex<Registry>,
    sync: Family<Labels, Gauge>,
    last_reconcile: Family<Labels, FloatGauge>,
    reconciles: Family<Labels, Counter>,
    failures: Family<Labels, Counter>,
    duration: Family<Labels, Histogram>,
    down: Family<Labels, Gauge>,
    hold: Family<Labels, Gauge>,
    source_reads: Counter,
    /// `specd_source_info{revision}`: one series, the accepted commit's.
    source_info: Family<Labels, Gauge>,
    source_revision: Mutex<Option<String>>,
    source_success: FloatGauge,
    poll_interval: FloatGauge,
    resync_interval: FloatGauge,
    /// `specd_unit_info{unit,revision,unit_hash}`: one series per unit, its labels of now.
    unit_info: Family<Labels, Gauge>,
    unit_info_now: Mutex<BTreeMap<String, Labels>>,
    args_verified: Family<Labels, Gauge>,
    accept_length: Family<Labels, FloatGauge>,
    accept_rate: Family<Labels, FloatGauge>,
    quarantined: Family<Labels, Gauge>,
    deaths: Family<Labels, Counter>,
    /// `specd_unit_last_death_timestamp_seconds{unit,verdict}`: one series per unit, its labels of now.
    last_death: Family<Labels, Gauge>,
    last_death_now: Mutex<BTreeMap<String, Labels>>,
    /// `specd_unit_serving{unit,state}`: what each unit's load balancers are told, read from
    /// `serving_files` at each scrape for the units reconciled.
    serving: Family<Labels, Gauge>,
    /// `specd_unit_awaiting_balancers{unit}`: told ready, not yet taken by its load balancers.
    awaiting: Family<Labels, Gauge>,
    serving_units: Mutex<std::collections::BTreeSet<String>>,
    serving_files: Mutex<Option<(crate::machine::serving::ServingFiles, crate::core::serving::Balancers)>>,
    /// `specd_unit_startup_seconds{unit,phase}`: the last start's phases, the labels of now.
    startup: Family<Labels, FloatGauge>,
    startup_now: Mutex<BTreeMap<String, Vec<Labels>>>,
    start_duration: Family<Labels, FloatGauge>,
}

const HOLDS: [HoldKind; 3] = [HoldKind::Suspend, HoldKind::Pin, HoldKind::Sweep];

/// The verdicts of an instance that died: every ending of the diagnosis but a clean stop (on
/// request, or an exit 0) and a stale-config start (a verdict only on a clean stop). The values
/// of `specd_unit_deaths_total`'s `verdict` label, each series there from a unit's first look.
pub const DEATH_VERDICTS: [Verdict; 7] = [
    Verdict::Crash,
    Verdict::FailedStart,
    Verdict::CudaOom,
    Verdict::OomKill,
    Verdict::StopTimeoutKill,
    Verdict::Watchdog,
    Verdict::StartLimitHit,
];

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new(env!("CARGO_PKG_VERSION"))
    }
}

const SERVING_HELP: &str = "1 for what the unit's load balancers are told now (ready, drain, down), 0 for the others";
const AWAITING_HELP: &str = "1 while the unit is told ready and a load balancer polling it has not taken it back yet (load_balancer.rise_sec since its first ready read), else 0";
const STARTUP_HELP: &str =
    "The phases of the last start of the unit that runs, as the engine's own lines tell them (seconds each)";

impl Metrics {
    /// The agent's metrics; `version` is `specd_build_info`'s. Each is registered as its field
    /// is made, in the order written here (a struct expression's order), which is the order
    /// they are served in.
    pub fn new(version: &str) -> Self {
        let mut r = registry(version);
        let mut m = Metrics {
            registry: Mutex::default(),
            sync: served(&mut r, "unit_sync", "1 for the unit's current sync status, 0 for the others"),
            last_reconcile: served(
                &mut r,
                "reconcile_last_timestamp_seconds",
                "Unix time of the unit's last reconcile (a held unit's look included)",
            ),
            reconciles: served(&mut r, "reconciles", "Reconciles by result"),
            failures: served(&mut r, "reconcile_failures", "Reconciles that failed or rolled back"),
            duration: served_with(&mut r, "reconcile_duration_seconds", "Duration of reconciles", || {
                Family::<Labels, Histogram>::new_with_constructor(|| Histogram::new(exponential_buckets(0.01, 2.0, 18)))
            }),
            source_reads: served(&mut r, "source_reads", "Reads of the source (fetch, gate, specs)"),
            source_info: served(
                &mut r,
                "source_info",
                "The commit the agent deploys (the source's accepted commit) as the revision label, value 1",
            ),
            source_revision: Mutex::new(None),
            source_success: served(
                &mut r,
                "source_last_success_timestamp_seconds",
                "Unix time of the last read of the source that reached its head (a remote: fetched); 0 before the first",
            ),
            poll_interval: served(
                &mut r,
                "source_poll_interval_seconds",
                "How often the source is fetched (a remote); 0 when it is watched instead (a local repository)",
            ),
            resync_interval: served(
                &mut r,
                "resync_interval_seconds",
                "How often every unit is looked at whatever happens; 0 when only changes make the agent look",
            ),
            down: served(&mut r, "unit_down", "1 when the unit's service is not running after its last reconcile"),
            hold: served(
                &mut r,
                "unit_hold",
                "1 for the kind of hold (suspend, pin, sweep) that keeps the agent's hands off the unit",
            ),
            unit_info: served(
                &mut r,
                "unit_info",
                "The unit that runs, verified: the commit it came from (revision) and its unit file's sha256 (unit_hash), value 1",
            ),
            unit_info_now: Mutex::new(BTreeMap::new()),
            args_verified: served(
                &mut r,
                "unit_args_verified",
                "1 when the unit runs its desired unit and the server's own report of its args matched the spec; only for specs whose args are checked",
            ),
            accept_length: served(
                &mut r,
                "unit_accept_length",
                "Tokens per target verification pass in the last speculation proof of the unit that runs",
            ),
            accept_rate: served(
                &mut r,
                "unit_accept_rate",
                "Accepted / drafted tokens in the last speculation proof of the unit that runs (0 to 1)",
            ),
            quarantined: served(
                &mut r,
                "unit_quarantined",
                "1 when the unit's desired unit hash is quarantined (it failed; not tried again until it changes or is unquarantined)",
            ),
            deaths: served(
                &mut r,
                "unit_deaths",
                "Instances of the unit that died (every ending but a clean stop), by the diagnosis verdict",
            ),
            last_death: served(
                &mut r,
                "unit_last_death_timestamp_seconds",
                "When the agent counted the newest death of the unit's instances (Unix seconds), by its verdict; one series per unit",
            ),
            last_death_now: Mutex::new(BTreeMap::new()),
            serving: served(&mut r, "unit_serving", SERVING_HELP),
            awaiting: served(&mut r, "unit_awaiting_balancers", AWAITING_HELP),
            serving_units: Mutex::default(),
            serving_files: Mutex::default(),
            // Gauges of the last start, not histograms: a start is rare (an apply, a rollback),
            // and what is asked of it is its own figure against the same unit's start before
            // (the fleet's `startup_within`, the alert on a slower start), which Prometheus has
            // as the gauge's value before it changed; a histogram would mix the starts of two
            // revisions in its rates and blur a figure within its bucket.
            startup: served(&mut r, "unit_startup_seconds", STARTUP_HELP),
            startup_now: Mutex::new(BTreeMap::new()),
            start_duration: served(
                &mut r,
                "unit_start_duration_seconds",
                "How long the last start of the unit that runs took: from specd's start of the unit to the server's first ready answer",
            ),
        };
        m.registry = Mutex::new(r);
        m
    }

    /// `specd_host_info{host, <label>...}`: the host the agent runs on, by its hostname and the
    /// labels of its config (what a fleet file's waves select hosts by); set once, at the start.
    pub fn host_info(&self, host: &str, labels: &BTreeMap<String, String>) {
        let mut l = vec![("host".to_string(), host.to_string())];
        l.extend(labels.iter().map(|(k, v)| (k.clone(), v.clone())));
        crate::core::guard::lock(&self.registry).register(
            "host",
            "The host the agent runs on: its hostname (host) and the labels its config declares (value 1)",
            Info::new(l),
        );
    }

    /// A counter kept by another part of the agent (the webhook notifier's), served with these.
    /// The webhook notices' counters (`notify`), exported when webhooks are configured.
    pub fn register_notices(&self, c: &crate::notify::Counters) {
        let mut r = crate::core::guard::lock(&self.registry);
        r.register("notifications_delivered", "Webhook notices delivered", c.delivered.clone());
        r.register(
            "notifications_failed",
            "Webhook notices given up after retries or refused by the receiver",
            c.failed.clone(),
        );
        r.register("notifications_dropped", "Webhook notices dropped unsent from a full queue", c.dropped.clone());
    }
}

impl Metrics {
    /// The agent's tune metrics (`tune::schedule`), served with these when `tune:` is configured.
    pub fn register_tune(&self, t: &crate::tune::schedule::TuneMetrics) {
        let mut r = crate::core::guard::lock(&self.registry);
        let unit = |r: &mut Registry, name: &str, help: &str, f: &Family<Labels, FloatGauge>| {
            r.register(name, help, f.clone());
        };
        unit(
            &mut r,
            "unit_served_accept_length",
            "Accept length of the unit's instance since it started, by the engine's own counts (1 + accepted / drafts)",
            &t.served_accept_length,
        );
        unit(
            &mut r,
            "unit_served_tokens_per_second",
            "Decode tokens per second of one request of the unit's instance since it started, at the load it served (the engine's counts)",
            &t.served_tok_s,
        );
        unit(
            &mut r,
            "unit_served_concurrency",
            "Requests in flight per decode step of the unit's instance since it started",
            &t.served_concurrency,
        );
        unit(
            &mut r,
            "unit_served_drafts",
            "Drafts the engine of the unit's instance counted since it started",
            &t.served_drafts,
        );
        r.register("tune_num_steps", "The unit's speculative.num_steps: the one that runs (kind=running) and the one the data recommends (kind=recommended)", t.num_steps.clone());
        unit(
            &mut r,
            "tune_predicted_tokens_per_second",
            "Decode tokens per second of one request predicted at each num_steps",
            &t.predicted_tok_s,
        );
        unit(
            &mut r,
            "tune_predicted_accept_length",
            "Accept length predicted at each num_steps",
            &t.predicted_accept_length,
        );
        unit(
            &mut r,
            "tune_last_timestamp_seconds",
            "Unix time of the unit's last evaluation by the agent's tune",
            &t.last,
        );
    }
}

/// specd's registry: every name under `specd_`, and first `specd_build_info` (`version`, the
/// commit it was built from, the CPU architecture).
fn registry(version: &str) -> Registry {
    let mut r = Registry::with_prefix("specd");
    let build = Info::new(vec![
        ("version".to_string(), version.to_string()),
        ("revision".to_string(), env!("SPECD_REVISION").to_string()),
        ("arch".to_string(), std::env::consts::ARCH.to_string()),
    ]);
    r.register(
        "build",
        "The running specd: its version, the commit it was built from and its CPU architecture (value 1)",
        build,
    );
    r
}

/// A new metric, registered under `name` with its `help`: the registry serves it, and the
/// agent keeps a handle on it to update.
fn served<M: prometheus_client::registry::Metric + Clone + Default>(r: &mut Registry, name: &str, help: &str) -> M {
    served_with(r, name, help, M::default)
}

/// [`served`], the metric made by `make`.
fn served_with<M: prometheus_client::registry::Metric + Clone>(
    r: &mut Registry,
    name: &str,
    help: &str,
    make: impl FnOnce() -> M,
) -> M {
    let m = make();
    r.register(name, help, m.clone());
    m
}

fn unit(u: &str) -> Labels {
    vec![("unit".into(), u.into())]
}

fn with(u: &str, k: &str, v: &str) -> Labels {
    let mut l = unit(u);
    l.push((k.into(), v.into()));
    l
}

impl Metrics {
    /// Where the units' serving states and their load balancers' polls are read at each scrape,
    /// and what counts as taken (`load_balancer`'s settings).
    pub fn serving_from(&self, files: crate::machine::serving::ServingFiles, b: crate::core::serving::Balancers) {
        *crate::core::guard::lock(&self.serving_files) = Some((files, b));
    }

    /// Whether the unit is told ready and its load balancers have not taken it yet
    /// (`serving::taken`).
    pub fn awaiting(&self, u: &str, awaiting: bool) {
        self.awaiting.get_or_create(&unit(u)).set(i64::from(awaiting));
    }

    /// What the unit's load balancers are told: 1 for `word`, 0 for the others.
    pub fn serving(&self, u: &str, word: Word) {
        for w in Word::ALL {
            self.serving.get_or_create(&with(u, "state", w.as_str())).set(i64::from(w == word));
        }
    }

    pub fn reconciled(&self, u: &str, sync: SyncStatus, result: &str, secs: f64, failed: bool) {
        crate::core::guard::lock(&self.serving_units).insert(u.to_string());
        for s in SyncStatus::ALL {
            self.sync.get_or_create(&with(u, "status", &s.to_string())).set(i64::from(s == sync));
        }
        self.last_reconcile.get_or_create(&unit(u)).set(crate::machine::store::now() as f64);
        self.reconciles.get_or_create(&with(u, "result", result)).inc();
        if failed {
            self.failures.get_or_create(&unit(u)).inc();
        }
        self.duration.get_or_create(&unit(u)).observe(secs);
    }

    pub fn source_read(&self) {
        self.source_reads.inc();
    }

    /// A read of the source reached its head (`time`: Unix seconds).
    pub fn source_reached(&self, time: u64) {
        self.source_success.set(time as f64);
    }

    /// How the agent looks: the source's poll interval and the resync's (`None`: never).
    pub fn schedule(&self, poll: Option<std::time::Duration>, resync: Option<std::time::Duration>) {
        self.poll_interval.set(poll.map_or(0.0, |d| d.as_secs_f64()));
        self.resync_interval.set(resync.map_or(0.0, |d| d.as_secs_f64()));
    }

    pub fn down(&self, u: &str, down: bool) {
        self.down.get_or_create(&unit(u)).set(i64::from(down));
    }

    /// The unit's hold: 1 for its kind, 0 for the others.
    pub fn hold(&self, u: &str, kind: Option<HoldKind>) {
        for k in HOLDS {
            self.hold.get_or_create(&with(u, "kind", &hold_label(k))).set(i64::from(kind == Some(k)));
        }
    }

    /// The commit the agent deploys: the one series of `specd_source_info` (the previous
    /// revision's series is removed).
    pub fn source_revision(&self, revision: &str) {
        let mut cur = crate::core::guard::lock(&self.source_revision);
        if cur.as_deref() == Some(revision) {
            return;
        }
        if let Some(old) = cur.take() {
            self.source_info.remove(&vec![("revision".into(), old)]);
        }
        self.source_info.get_or_create(&vec![("revision".into(), revision.to_string())]).set(1);
        *cur = Some(revision.to_string());
    }

    /// A unit's figures after a reconcile: each series set, or removed when it has no value now.
    pub fn unit(&self, u: &str, f: &UnitFigures) {
        {
            let mut now = crate::core::guard::lock(&self.unit_info_now);
            let labels = f.deployed.as_ref().map(|(rev, hash)| {
                let mut l = with(u, "revision", rev);
                l.push(("unit_hash".into(), hash.clone()));
                l
            });
            if let Some(old) = now.get(u)
                && Some(old) != labels.as_ref()
            {
                self.unit_info.remove(old);
                now.remove(u);
            }
            if let Some(l) = labels {
                self.unit_info.get_or_create(&l).set(1);
                now.insert(u.to_string(), l);
            }
        }
        match f.args_verified {
            Some(v) => {
                self.args_verified.get_or_create(&unit(u)).set(i64::from(v));
            }
            None => {
                self.args_verified.remove(&unit(u));
            }
        }
        for (family, value) in [(&self.accept_length, f.accept_length), (&self.accept_rate, f.accept_rate)] {
            match value {
                Some(v) => {
                    family.get_or_create(&unit(u)).set(v);
                }
                None => {
                    family.remove(&unit(u));
                }
            }
        }
        self.quarantined.get_or_create(&unit(u)).set(i64::from(f.quarantined));
        self.started(u, f.startup.as_ref());
        for v in DEATH_VERDICTS {
            let _ = self.deaths.get_or_create(&with(u, "verdict", v.as_str()));
        }
    }

    /// The last start's figures: a series per phase it told (those of an earlier start that it
    /// did not tell removed), and its whole duration; none without a start of the unit that runs.
    fn started(&self, u: &str, s: Option<&crate::core::record::Startup>) {
        let phases: Vec<(Labels, f64)> = s
            .map(|s| s.phases.iter().map(|p| (with(u, "phase", &p.phase), p.ms as f64 / 1e3)).collect())
            .unwrap_or_default();
        let mut now = crate::core::guard::lock(&self.startup_now);
        for old in now.remove(u).unwrap_or_default() {
            if !phases.iter().any(|(l, _)| *l == old) {
                self.startup.remove(&old);
            }
        }
        for (l, v) in &phases {
            self.startup.get_or_create(l).set(*v);
        }
        now.insert(u.to_string(), phases.into_iter().map(|(l, _)| l).collect());
        match s {
            Some(s) => {
                self.start_duration.get_or_create(&unit(u)).set(s.ms as f64 / 1e3);
            }
            None => {
                self.start_duration.remove(&unit(u));
            }
        }
    }

    /// Instances of `u` that died, by their verdicts.
    /// `verdicts` oldest first: the last is the newest death.
    pub fn died(&self, u: &str, verdicts: &[Verdict]) {
        for v in verdicts {
            self.deaths.get_or_create(&with(u, "verdict", v.as_str())).inc();
        }
        if let Some(v) = verdicts.last() {
            let l = with(u, "verdict", v.as_str());
            if let Some(old) = crate::core::guard::lock(&self.last_death_now).insert(u.to_string(), l.clone())
                && old != l
            {
                self.last_death.remove(&old);
            }
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
            self.last_death.get_or_create(&l).set(now as i64);
        }
    }

    /// A unit the agent no longer manages (its spec is gone): its gauges go; its counters and
    /// the histogram stay, as counters do.
    pub fn forget(&self, u: &str) {
        if let Some(l) = crate::core::guard::lock(&self.unit_info_now).remove(u) {
            self.unit_info.remove(&l);
        }
        if let Some(l) = crate::core::guard::lock(&self.last_death_now).remove(u) {
            self.last_death.remove(&l);
        }
        self.started(u, None);
        for s in SyncStatus::ALL {
            self.sync.remove(&with(u, "status", &s.to_string()));
        }
        for k in HOLDS {
            self.hold.remove(&with(u, "kind", &hold_label(k)));
        }
        for g in [&self.down, &self.args_verified, &self.quarantined] {
            g.remove(&unit(u));
        }
        for g in [&self.accept_length, &self.accept_rate, &self.last_reconcile] {
            g.remove(&unit(u));
        }
        crate::core::guard::lock(&self.serving_units).remove(u);
        for w in Word::ALL {
            self.serving.remove(&with(u, "state", w.as_str()));
        }
        self.awaiting.remove(&unit(u));
    }

    /// What [`Metrics::render`] writes: prometheus-client's text encoder writes the OpenMetrics
    /// text format (`# EOF` at its end, a counter's `_total` samples under a `# TYPE` line
    /// without the suffix), which Prometheus parses as such only when this content type says so.
    pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

    pub fn render(&self) -> String {
        // What the load balancers are told changes within reconciles (a drain): read now.
        if let Some((files, b)) = crate::core::guard::lock(&self.serving_files).clone() {
            let units = crate::core::guard::lock(&self.serving_units).clone();
            let now_ms = crate::machine::store::now_ms();
            for u in units {
                let word = crate::core::serving::answered(files.read(&u).as_ref());
                self.serving(&u, word);
                self.awaiting(&u, word == Word::Ready && !crate::core::serving::taken(&files.polls(&u), now_ms, b));
            }
        }
        let mut s = String::new();
        let _ = encode(&mut s, &crate::core::guard::lock(&self.registry));
        s
    }
}

fn hold_label(k: HoldKind) -> String {
    format!("{k:?}").to_lowercase()
}

/// What a unit's series say after a reconcile.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct UnitFigures {
    /// The unit that runs, verified (the last good one): the commit it came from (empty when it
    /// came from a file) and its hash.
    pub deployed: Option<(String, String)>,
    /// `None`: the spec's args are not checked (`readiness.verify_args: false`, or an engine
    /// that reports none): no series.
    pub args_verified: Option<bool>,
    pub accept_length: Option<f64>,
    pub accept_rate: Option<f64>,
    pub quarantined: bool,
    /// The last start of the unit that runs, once it was ready.
    pub startup: Option<crate::core::record::Startup>,
}

impl UnitFigures {
    /// From the unit's state after a reconcile of `desired_sha`: `checks_args` says whether the
    /// spec's args are checked, `in_sync` whether the unit runs its desired unit now.
    ///
    /// The args are verified when the desired unit runs and an apply or start of it passed
    /// (every start of a spec whose args are checked is followed by that check, and a look at
    /// a running server that finds its args changed makes it Drifted, not in sync). The
    /// speculation figures are the last proof's, when it measured the unit that runs; the start
    /// figures the last start's, when it started the unit that runs and it was ready.
    pub fn of(st: &UnitState, desired_sha: &str, checks_args: bool, in_sync: bool) -> UnitFigures {
        let running = st.last_good.as_ref();
        let deployed = running.map(|g| {
            let revision = match &g.source {
                Some(Source::Commit { commit, .. }) => commit.clone(),
                _ => String::new(),
            };
            (revision, g.sha256.clone())
        });
        let verified = in_sync
            && running.is_some_and(|g| g.sha256 == desired_sha)
            && st.verified_before(desired_sha)
            && st.quarantined(desired_sha).is_none();
        let proof = st.speculation.as_ref().filter(|p| running.is_some_and(|g| g.sha256 == p.sha256));
        UnitFigures {
            deployed,
            args_verified: checks_args.then_some(verified),
            accept_length: proof.and_then(|p| p.measured.accept_length),
            accept_rate: proof.and_then(|p| p.measured.accept_rate),
            quarantined: st.quarantined(desired_sha).is_some(),
            startup: st.startup.clone().filter(|s| s.ready && running.is_some_and(|g| g.sha256 == s.sha256)),
        }
    }
}

/// One instance of a unit as its diagnosis says: its invocation ID, and its verdict once the
/// journal shows it ended (`None`: it runs, or its end is not in the journal yet).
pub type Instance = (String, Option<Verdict>);

/// The instances of one unit already looked at, so that each death is counted once. The first
/// look counts nothing: what ended before the agent looked is not its to count (a counter
/// starts at the agent's start).
#[derive(Debug, Default)]
pub struct Deaths {
    /// Invocation IDs whose ending was taken; `None` before the first look.
    seen: Option<BTreeSet<String>>,
}

impl Deaths {
    /// The verdicts of the instances (the newest of the unit, oldest first) that died since the
    /// last look. What is remembered is bounded by what is given: an instance older than those
    /// is never given again.
    pub fn take(&mut self, instances: &[Instance]) -> Vec<Verdict> {
        let ended: BTreeSet<String> = instances.iter().filter(|(_, v)| v.is_some()).map(|(id, _)| id.clone()).collect();
        let Some(seen) = self.seen.replace(ended) else { return Vec::new() };
        instances
            .iter()
            .filter(|(id, _)| !seen.contains(id))
            .filter_map(|(_, v)| *v)
            .filter(|v| DEATH_VERDICTS.contains(v))
            .collect()
    }

    /// Whether the unit was looked at before.
    pub fn started(&self) -> bool {
        self.seen.is_some()
    }
}

/// How many of a unit's newest instances a look at its deaths reads: a crash loop faster than
/// the agent's looks loses the deaths past these.
pub const DEATHS_WINDOW: usize = 16;

/// Where the metrics learn a unit's newest instances and how each ended: the journal on this
/// machine ([`instances`]), or the tests' fake host.
pub trait Instances {
    /// The unit's newest instances and how each ended (for the deaths the metrics count),
    /// waiting up to `within` for the journal to show the end of any but `current`.
    fn instances(
        &self,
        unit: &str,
        current: &str,
        within: std::time::Duration,
    ) -> impl std::future::Future<Output = Vec<Instance>> + Send;
}

impl Instances for crate::host::RealHost {
    async fn instances(&self, unit: &str, current: &str, within: std::time::Duration) -> Vec<Instance> {
        instances(unit, current, within).await
    }
}

#[cfg(test)]
impl Instances for crate::host::fake::FakeHost {
    async fn instances(&self, _unit: &str, _current: &str, _within: std::time::Duration) -> Vec<Instance> {
        self.journal_look().await;
        Vec::new()
    }
}

/// The newest instances of `unit` by the diagnosis of its journal, oldest first; waits up to
/// `within` for the newest instance other than `current` (the one systemd runs now) to show its
/// end.
pub async fn instances(unit: &str, current: &str, within: std::time::Duration) -> Vec<Instance> {
    let t0 = tokio::time::Instant::now();
    let mut pause = std::time::Duration::from_millis(25);
    loop {
        let found: Vec<Instance> = match crate::diagnose::gather_newest(unit, None, DEATHS_WINDOW).await {
            Ok(ev) => ev
                .iter()
                .map(crate::diagnose::classify)
                .map(|d| {
                    let ended = d.verdict.is_ending() && d.ended.is_some();
                    (d.invocation.unwrap_or_default(), ended.then_some(d.verdict))
                })
                .filter(|(id, _)| !id.is_empty())
                .collect(),
            Err(e) => {
                tracing::debug!(unit, "reading the journal for deaths: {e:#}");
                Vec::new()
            }
        };
        // The instance before the current one (or the newest, when none runs) is the one that
        // just ended: its end may lag in the journal. Older ones were written long since.
        let newest_ended = found.iter().rev().find(|(id, _)| id != current);
        let settled = newest_ended.is_none_or(|(_, v)| v.is_some());
        if settled || t0.elapsed() >= within {
            return found;
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(std::time::Duration::from_millis(400));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::record::{GoodUnit, Quarantined, SpeculationRecord};

    /// The value of the one sample named `name` with exactly `labels` (`None`: no such sample).
    pub(crate) fn sample(text: &str, name: &str, labels: &str) -> Option<f64> {
        let key = if labels.is_empty() { format!("{name} ") } else { format!("{name}{{{labels}}} ") };
        let mut found = text.lines().filter_map(|l| l.strip_prefix(key.as_str()));
        let v = found.next()?.trim().parse().ok();
        assert!(found.next().is_none(), "two samples {key}in\n{text}");
        v
    }

    /// Every sample of `name`, as its label text.
    fn series(text: &str, name: &str) -> Vec<String> {
        text.lines()
            .filter_map(|l| l.strip_prefix(name)?.strip_prefix('{')?.split_once("} ").map(|(l, _)| l.to_string()))
            .collect()
    }

    fn good(sha: &str, commit: &str) -> GoodUnit {
        GoodUnit {
            sha256: sha.into(),
            text: String::new(),
            source: Some(Source::Commit {
                repo: "/srv/config".into(),
                commit: commit.into(),
                path: "specs/q.yaml".into(),
            }),
            time: 1,
            endpoint: None,
            base_url: None,
        }
    }

    fn applied(sha: &str) -> crate::core::record::HistoryEntry {
        crate::core::record::HistoryEntry {
            time: 1,
            sha256: sha.into(),
            source: None,
            outcome: crate::core::record::Outcome::Applied,
            message: String::new(),
            stop_verdict: None,
            duration_ms: 1,
            startup: None,
        }
    }

    fn proof(sha: &str, length: f64, rate: f64) -> SpeculationRecord {
        SpeculationRecord {
            sha256: sha.into(),
            time: 1,
            measured: crate::core::speculation::Speculation {
                accept_length: Some(length),
                accept_rate: Some(rate),
                ..Default::default()
            },
        }
    }

    #[test]
    fn build_info_is_one_series_with_the_version() {
        let t = Metrics::new("1.2.3").render();
        assert!(t.contains("# TYPE specd_build info\n"), "{t}");
        let arch = std::env::consts::ARCH;
        let rev = env!("SPECD_REVISION");
        assert_eq!(
            sample(&t, "specd_build_info", &format!("version=\"1.2.3\",revision=\"{rev}\",arch=\"{arch}\"")),
            Some(1.0),
            "{t}"
        );
        assert_eq!(series(&t, "specd_build_info").len(), 1);
    }

    #[test]
    fn host_info_is_one_series_with_the_hostname_and_the_config_s_labels() {
        let m = Metrics::default();
        let labels = [("zone", "eu-1"), ("gpu", "h100")].map(|(k, v)| (k.to_string(), v.to_string())).into();
        m.host_info("gpu-07", &labels);
        let t = m.render();
        assert!(t.contains("# TYPE specd_host info\n"), "{t}");
        assert_eq!(sample(&t, "specd_host_info", "host=\"gpu-07\",gpu=\"h100\",zone=\"eu-1\""), Some(1.0), "{t}");
        assert_eq!(series(&t, "specd_host_info").len(), 1);
        let bare = Metrics::default();
        bare.host_info("cpu-01", &BTreeMap::new());
        assert_eq!(series(&bare.render(), "specd_host_info"), ["host=\"cpu-01\""]);
    }

    #[test]
    fn the_source_revision_is_one_series_the_old_one_removed() {
        let m = Metrics::default();
        assert!(series(&m.render(), "specd_source_info").is_empty());
        m.source_revision("aaa");
        m.source_revision("bbb");
        m.source_revision("bbb");
        let t = m.render();
        assert_eq!(series(&t, "specd_source_info"), ["revision=\"bbb\""], "{t}");
        assert_eq!(sample(&t, "specd_source_info", "revision=\"bbb\""), Some(1.0));
        assert_eq!(sample(&t, "specd_source_last_success_timestamp_seconds", ""), Some(0.0));
        m.source_reached(1_700_000_000);
        m.schedule(Some(std::time::Duration::from_secs(60)), None);
        let t = m.render();
        assert_eq!(sample(&t, "specd_source_last_success_timestamp_seconds", ""), Some(1.7e9));
        assert_eq!(sample(&t, "specd_source_poll_interval_seconds", ""), Some(60.0));
        assert_eq!(sample(&t, "specd_resync_interval_seconds", ""), Some(0.0));
    }

    #[test]
    fn a_unit_s_figures_come_from_its_state_and_replace_their_old_series() {
        let mut st = UnitState { unit: "q.service".into(), ..Default::default() };
        // Never deployed: no info, nothing verified, no proof.
        let f = UnitFigures::of(&st, "h1", true, false);
        assert_eq!(f, UnitFigures { args_verified: Some(false), ..Default::default() });
        // Applied and in sync: its commit and hash, args verified, the proof's figures.
        st.last_good = Some(good("h1", "c1"));
        st.record(applied("h1"));
        st.speculation = Some(proof("h1", 3.25, 0.75));
        let f = UnitFigures::of(&st, "h1", true, true);
        assert_eq!(
            f,
            UnitFigures {
                deployed: Some(("c1".into(), "h1".into())),
                args_verified: Some(true),
                accept_length: Some(3.25),
                accept_rate: Some(0.75),
                quarantined: false,
                startup: None,
            }
        );
        // A spec whose args are not checked has no such series.
        assert_eq!(UnitFigures::of(&st, "h1", false, true).args_verified, None);
        // Drifted (its args changed under it): not verified.
        assert_eq!(UnitFigures::of(&st, "h1", true, false).args_verified, Some(false));
        let m = Metrics::default();
        m.unit("q.service", &f);
        // A new desired unit h2 failed and was quarantined: h1 still runs.
        st.quarantine.push(Quarantined { sha256: "h2".into(), reason: "x".into(), source: None, time: 2 });
        let f2 = UnitFigures::of(&st, "h2", true, false);
        assert_eq!(f2.deployed, Some(("c1".into(), "h1".into())));
        assert_eq!((f2.args_verified, f2.quarantined, f2.accept_length), (Some(false), true, Some(3.25)));
        m.unit("q.service", &f2);
        let t = m.render();
        assert_eq!(sample(&t, "specd_unit_quarantined", "unit=\"q.service\""), Some(1.0), "{t}");
        assert_eq!(sample(&t, "specd_unit_args_verified", "unit=\"q.service\""), Some(0.0), "{t}");
        // Then h3 from c3 applies: one info series, the new one; its proof measured no length.
        st.last_good = Some(good("h3", "c3"));
        st.record(applied("h3"));
        st.speculation = Some(SpeculationRecord {
            measured: crate::core::speculation::Speculation { accept_rate: Some(0.5), ..Default::default() },
            ..proof("h3", 0.0, 0.0)
        });
        m.unit("q.service", &UnitFigures::of(&st, "h3", true, true));
        m.unit("r.service", &UnitFigures::of(&UnitState::default(), "h9", false, false));
        let t = m.render();
        assert_eq!(series(&t, "specd_unit_info"), ["unit=\"q.service\",revision=\"c3\",unit_hash=\"h3\""], "{t}");
        assert_eq!(sample(&t, "specd_unit_accept_length", "unit=\"q.service\""), None, "{t}");
        assert_eq!(sample(&t, "specd_unit_accept_rate", "unit=\"q.service\""), Some(0.5), "{t}");
        assert_eq!(sample(&t, "specd_unit_args_verified", "unit=\"q.service\""), Some(1.0), "{t}");
        assert_eq!(sample(&t, "specd_unit_quarantined", "unit=\"q.service\""), Some(0.0), "{t}");
        assert_eq!(sample(&t, "specd_unit_args_verified", "unit=\"r.service\""), None, "{t}");
        // Every death verdict is a series from the first look, at 0.
        for v in DEATH_VERDICTS {
            let l = format!("unit=\"r.service\",verdict=\"{}\"", v.as_str());
            assert_eq!(sample(&t, "specd_unit_deaths_total", &l), Some(0.0), "{t}");
        }
        // A unit whose spec is gone: its gauges go.
        m.forget("q.service");
        let t = m.render();
        assert!(!t.contains("unit=\"q.service\",revision"), "{t}");
        assert_eq!(sample(&t, "specd_unit_quarantined", "unit=\"q.service\""), None, "{t}");
    }

    fn start(sha: &str, ready: bool, phases: &[(&str, u64)]) -> crate::core::record::Startup {
        crate::core::record::Startup {
            sha256: sha.into(),
            time: 1,
            ready,
            ms: phases.iter().map(|p| p.1).sum::<u64>() + 40,
            phases: phases
                .iter()
                .map(|(p, ms)| crate::core::record::PhaseTime { phase: p.to_string(), ms: *ms })
                .collect(),
        }
    }

    /// `specd_unit_startup_seconds{unit,phase}` is the last start of the unit that runs, a series
    /// per phase it told (a phase an earlier start told and this one did not is gone), with
    /// `specd_unit_start_duration_seconds` its whole start; a start of another unit (a failed
    /// apply's) or one that was not ready is not it.
    #[test]
    fn the_last_start_s_phases_are_a_gauge_each_of_the_unit_that_runs() {
        let mut st = UnitState { unit: "q.service".into(), last_good: Some(good("h1", "c1")), ..Default::default() };
        st.startup =
            Some(start("h1", true, &[("process", 13_700), ("weights", 300), ("engine", 6_200), ("api", 2_500)]));
        let m = Metrics::default();
        m.unit("q.service", &UnitFigures::of(&st, "h1", true, true));
        let t = m.render();
        assert!(
            t.contains(
                "# TYPE specd_unit_startup_seconds gauge
"
            ),
            "{t}"
        );
        let phase =
            |t: &str, p: &str| sample(t, "specd_unit_startup_seconds", &format!("unit=\"q.service\",phase=\"{p}\""));
        assert_eq!(phase(&t, "weights"), Some(0.3), "{t}");
        assert_eq!(phase(&t, "engine"), Some(6.2), "{t}");
        assert_eq!(sample(&t, "specd_unit_start_duration_seconds", "unit=\"q.service\""), Some(22.74), "{t}");
        // A llama.cpp start after it: its own phases only.
        st.startup = Some(start("h1", true, &[("process", 10), ("weights", 150), ("warmup", 40), ("api", 1)]));
        m.unit("q.service", &UnitFigures::of(&st, "h1", true, true));
        let t = m.render();
        assert_eq!(series(&t, "specd_unit_startup_seconds").len(), 4, "{t}");
        assert_eq!((phase(&t, "engine"), phase(&t, "warmup")), (None, Some(0.04)), "{t}");
        // A start of h2 that died: not the start of the unit that runs (h1).
        st.startup = Some(start("h2", false, &[("process", 10), ("weights", 150)]));
        m.unit("q.service", &UnitFigures::of(&st, "h2", true, false));
        let t = m.render();
        assert!(series(&t, "specd_unit_startup_seconds").is_empty(), "{t}");
        assert_eq!(sample(&t, "specd_unit_start_duration_seconds", "unit=\"q.service\""), None, "{t}");
    }

    #[test]
    fn each_death_is_counted_once_and_none_from_before_the_first_look() {
        let id = |s: &str| s.to_string();
        let mut d = Deaths::default();
        // What ended before the agent looked is not counted.
        assert_eq!(d.take(&[(id("a"), Some(Verdict::Crash)), (id("b"), None)]), []);
        assert!(d.started());
        // b was killed; c, started by systemd, crashed at once; d runs.
        let now = [
            (id("a"), Some(Verdict::Crash)),
            (id("b"), Some(Verdict::OomKill)),
            (id("c"), Some(Verdict::Crash)),
            (id("d"), None),
        ];
        assert_eq!(d.take(&now), [Verdict::OomKill, Verdict::Crash]);
        assert_eq!(d.take(&now), []);
        // Clean stops (an apply's) are no deaths; d failed its start when rolled back.
        let later = [
            (id("c"), Some(Verdict::Crash)),
            (id("d"), Some(Verdict::FailedStart)),
            (id("e"), Some(Verdict::CleanStop)),
            (id("f"), Some(Verdict::StaleConfigStart)),
            (id("g"), None),
        ];
        assert_eq!(d.take(&later), [Verdict::FailedStart]);
        let m = Metrics::default();
        m.unit("q.service", &UnitFigures::default());
        m.died("q.service", &[Verdict::Crash, Verdict::Crash, Verdict::CudaOom]);
        let t = m.render();
        assert_eq!(sample(&t, "specd_unit_deaths_total", "unit=\"q.service\",verdict=\"crash\""), Some(2.0), "{t}");
        assert_eq!(sample(&t, "specd_unit_deaths_total", "unit=\"q.service\",verdict=\"cuda-oom\""), Some(1.0));
        assert_eq!(sample(&t, "specd_unit_deaths_total", "unit=\"q.service\",verdict=\"oom-kill\""), Some(0.0));
        // The newest death, one series per unit.
        assert_eq!(
            series(&t, "specd_unit_last_death_timestamp_seconds")
                .into_iter()
                .filter(|l| l.starts_with("unit=\"q.service\""))
                .collect::<Vec<_>>(),
            ["unit=\"q.service\",verdict=\"cuda-oom\""],
            "{t}"
        );
        m.died("q.service", &[Verdict::Crash]);
        let t = m.render();
        assert_eq!(
            series(&t, "specd_unit_last_death_timestamp_seconds"),
            ["unit=\"q.service\",verdict=\"crash\""],
            "{t}"
        );
        m.forget("q.service");
        assert!(series(&m.render(), "specd_unit_last_death_timestamp_seconds").is_empty());
    }

    #[test]
    fn sync_and_hold_are_one_series_per_state_one_of_them_1() {
        let m = Metrics::default();
        m.reconciled("q.service", SyncStatus::Drifted, "reported", 0.5, false);
        m.hold("q.service", Some(HoldKind::Pin));
        let t = m.render();
        for s in SyncStatus::ALL {
            let want = f64::from(u8::from(s == SyncStatus::Drifted));
            assert_eq!(sample(&t, "specd_unit_sync", &format!("unit=\"q.service\",status=\"{s}\"")), Some(want));
        }
        assert_eq!(sample(&t, "specd_unit_hold", "unit=\"q.service\",kind=\"pin\""), Some(1.0));
        assert_eq!(sample(&t, "specd_unit_hold", "unit=\"q.service\",kind=\"suspend\""), Some(0.0));
        assert_eq!(sample(&t, "specd_reconcile_duration_seconds_count", "unit=\"q.service\""), Some(1.0));
        assert_eq!(sample(&t, "specd_reconciles_total", "unit=\"q.service\",result=\"reported\""), Some(1.0));
    }

    /// What a unit's load balancers are told is read at each scrape (a drain shows while its
    /// apply runs, not only after it), for the units the agent reconciled; no state reads as
    /// down; a unit let go loses its series.
    #[test]
    fn the_serving_state_is_read_at_each_scrape_one_series_of_three_at_1() {
        use crate::core::serving::ServingState;
        let d = tempfile::tempdir().unwrap();
        let files = crate::machine::serving::ServingFiles::new(d.path());
        let m = Metrics::default();
        m.serving_from(files.clone(), crate::core::serving::Balancers::default());
        assert!(series(&m.render(), "specd_unit_serving").is_empty());
        m.reconciled("q.service", SyncStatus::InSync, "applied", 0.1, false);
        let at =
            |t: &str, state: &str| sample(t, "specd_unit_serving", &format!("unit=\"q.service\",state=\"{state}\""));
        let t = m.render();
        assert_eq!((at(&t, "ready"), at(&t, "drain"), at(&t, "down")), (Some(0.0), Some(0.0), Some(1.0)));
        files.write("q.service", &ServingState::Drain { why: "specd is stopping it".into(), since: 1 }).unwrap();
        let t = m.render();
        assert_eq!((at(&t, "ready"), at(&t, "drain"), at(&t, "down")), (Some(0.0), Some(1.0), Some(0.0)));
        files.write("q.service", &ServingState::Ready { since: 2 }).unwrap();
        assert_eq!(at(&m.render(), "ready"), Some(1.0));
        m.forget("q.service");
        assert!(series(&m.render(), "specd_unit_serving").is_empty());
    }

    /// Awaiting its load balancers: told ready while, when load balancers poll it, one has not
    /// read `ready` for `load_balancer.rise_sec` (5 s by default) yet: what the fleet's promoter
    /// waits for before it counts the host as back. A unit told drain or down (a resting spare)
    /// awaits nothing.
    #[test]
    fn a_unit_awaits_its_load_balancers_while_told_ready_and_read_for_less_than_their_rise() {
        use crate::core::serving::{CheckKind, PollLog, ServingState};
        let d = tempfile::tempdir().unwrap();
        let files = crate::machine::serving::ServingFiles::new(d.path());
        let m = Metrics::default();
        m.serving_from(files.clone(), crate::core::serving::Balancers::default());
        m.reconciled("q.service", SyncStatus::InSync, "applied", 0.1, false);
        let awaiting = |m: &Metrics| sample(&m.render(), "specd_unit_awaiting_balancers", "unit=\"q.service\"");
        assert_eq!(awaiting(&m), Some(0.0), "no state: down");
        files.write("q.service", &ServingState::Ready { since: 2 }).unwrap();
        assert_eq!(awaiting(&m), Some(0.0), "ready, and no load balancer polls");
        let now = crate::machine::store::now_ms();
        let mut log = PollLog::default();
        log.record(CheckKind::AgentCheck, "10.0.0.5", now - 1_000, Word::Ready);
        files.write_polls("q.service", &log).unwrap();
        assert_eq!(awaiting(&m), Some(1.0), "read ready 1 s ago: HAProxy may not send to it yet");
        let mut log = PollLog::default();
        log.record(CheckKind::AgentCheck, "10.0.0.5", now - 6_000, Word::Ready);
        log.record(CheckKind::AgentCheck, "10.0.0.5", now - 1_000, Word::Ready);
        files.write_polls("q.service", &log).unwrap();
        assert_eq!(awaiting(&m), Some(0.0), "read ready for 6 s");
        let mut log = PollLog::default();
        log.record(CheckKind::AgentCheck, "10.0.0.5", now - 1_000, Word::Down);
        files.write_polls("q.service", &log).unwrap();
        files.write("q.service", &ServingState::Down { why: "the spare rests".into(), since: 3 }).unwrap();
        assert_eq!(awaiting(&m), Some(0.0), "told down: a resting spare awaits nothing");
        m.forget("q.service");
        assert!(series(&m.render(), "specd_unit_awaiting_balancers").is_empty());
    }

    /// An agent's metrics, each with a value (the notices' counters registered too).
    fn filled() -> Metrics {
        let m = Metrics::default();
        m.reconciled("q.service", SyncStatus::InSync, "applied", 0.5, true);
        m.source_read();
        m.source_revision("c1");
        m.host_info("h", &BTreeMap::new());
        m.down("q.service", false);
        m.hold("q.service", None);
        m.serving("q.service", Word::Drain);
        m.awaiting("q.service", false);
        let f = UnitFigures {
            deployed: Some(("c1".into(), "h1".into())),
            args_verified: Some(true),
            accept_length: Some(3.0),
            accept_rate: Some(0.7),
            quarantined: false,
            startup: Some(start("h1", true, &[("process", 1_000), ("weights", 2_000)])),
        };
        m.unit("q.service", &f);
        m.died("q.service", &[Verdict::Crash]);
        m.register_notices(&crate::notify::Counters::default());
        m
    }

    /// Every sample name an agent serves once each of its metrics has a value.
    pub(crate) fn served_names() -> BTreeSet<String> {
        filled()
            .render()
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| l.split([' ', '{']).next())
            .map(str::to_string)
            .collect()
    }

    #[test]
    fn every_name_in_the_rules_and_the_dashboard_is_served() {
        let served = served_names();
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let queries = specd_e2e::promql::monitoring_queries(&root).unwrap();
        assert!(queries.len() >= 10, "{queries:?}");
        for (place, expr) in &queries {
            let names = specd_e2e::promql::metric_names(expr);
            assert!(!names.is_empty(), "{place}: {expr} names no metric");
            for n in names {
                // `up` is Prometheus's own: whether the scrape of the agent worked.
                assert!(served.contains(&n) || n == "up", "{place}: {expr}: specd serves no {n}; it serves {served:?}");
            }
        }
    }

    /// The reference's table of metrics (docs/reference.md): each row's name, type and labels.
    fn reference_metrics() -> BTreeMap<String, (String, BTreeSet<String>)> {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let text = std::fs::read_to_string(root.join("docs/reference.md")).unwrap();
        let section = text.split("## Metrics\n").nth(1).unwrap().split("\n## ").next().unwrap();
        let mut rows = BTreeMap::new();
        for row in section.lines().filter(|l| l.starts_with("| `")) {
            let cells: Vec<&str> = row.split('|').map(str::trim).collect();
            let name = cells[1].trim_matches('`').to_string();
            // Labels named in backticks, but those in parentheses: what the agent config adds.
            let fixed = cells[3].split('(').next().unwrap_or_default();
            let labels: BTreeSet<String> = fixed.split('`').skip(1).step_by(2).map(str::to_string).collect();
            rows.insert(name, (cells[2].to_string(), labels));
        }
        rows
    }

    /// Every series the agent serves (every family registered, each with a sample) is a row of the
    /// reference with its type and its labels, and every row is served: the table an operator
    /// reads is the registry.
    #[test]
    fn every_metric_served_is_in_the_reference_with_its_type_and_labels() {
        let m = filled();
        let t = crate::tune::schedule::TuneMetrics::default();
        m.register_tune(&t);
        let figures = crate::tune::schedule::Figures {
            served_accept_length: Some(3.1),
            served_tok_s: Some(220.0),
            served_concurrency: Some(1.5),
            drafts: 900,
            running: 4,
            recommended: Some(3),
            predicted: vec![(3, Some(230.0), Some(3.0))],
        };
        t.set("q.service", &figures, 1);
        let text = m.render();
        // The families and their types, then each sample's name (a histogram's by its family)
        // and labels.
        let mut types = BTreeMap::new();
        for l in text.lines().filter_map(|l| l.strip_prefix("# TYPE ")) {
            let (family, kind) = l.split_once(' ').unwrap();
            types.insert(family.to_string(), kind.to_string());
        }
        let mut served: BTreeMap<String, (String, BTreeSet<String>)> = BTreeMap::new();
        for l in text.lines().filter(|l| !l.starts_with('#') && !l.is_empty()) {
            let name = l.split(['{', ' ']).next().unwrap();
            let family = types
                .keys()
                .filter(|f| name.starts_with(f.as_str()))
                .max_by_key(|f| f.len())
                .unwrap_or_else(|| panic!("{name} has no family"));
            if name.ends_with("_created") {
                continue;
            }
            let kind = types[family].clone();
            let shown = if kind == "histogram" { family.clone() } else { name.to_string() };
            let labels = l.split_once('{').map(|(_, rest)| rest.split_once('}').unwrap().0).unwrap_or_default();
            let names = labels.split(',').filter_map(|kv| kv.split_once('=')).map(|(k, _)| k.to_string());
            let entry = served.entry(shown).or_insert_with(|| (kind, BTreeSet::new()));
            entry.1.extend(names.filter(|k| k != "le"));
        }
        let table = reference_metrics();
        let mut errors = Vec::new();
        for (name, (kind, labels)) in &served {
            match table.get(name) {
                None => errors.push(format!("{name} ({kind}) is served but is no row")),
                Some((k, l)) => {
                    if k != kind {
                        errors.push(format!("{name} is a {kind}, its row says {k}"));
                    }
                    if l != labels {
                        errors.push(format!("{name} has the labels {labels:?}, its row says {l:?}"));
                    }
                }
            }
        }
        for name in table.keys().filter(|n| !served.contains_key(*n)) {
            errors.push(format!("{name} is a row but is not served"));
        }
        assert!(served.len() >= 20, "{text}");
        assert!(errors.is_empty(), "docs/reference.md's metrics:\n{}", errors.join("\n"));
    }
}
