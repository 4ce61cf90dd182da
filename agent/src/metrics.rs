//! Prometheus metrics of the agent, served as OpenMetrics text on its read-only endpoint
//! (`listen.rs`).

use std::sync::Mutex;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::plan::SyncStatus;

type Labels = Vec<(String, String)>;

pub struct Metrics {
    registry: Mutex<Registry>,
    sync: Family<Labels, Gauge>,
    last_reconcile: Family<Labels, Gauge<f64, AtomicU64>>,
    reconciles: Family<Labels, Counter>,
    failures: Family<Labels, Counter>,
    duration: Family<Labels, Histogram>,
    commit: Family<Labels, Gauge>,
    down: Family<Labels, Gauge>,
    hold: Family<Labels, Gauge>,
    source_reads: Counter,
    current_commit: Mutex<Option<String>>,
}

const SYNCS: [SyncStatus; 6] = [
    SyncStatus::InSync,
    SyncStatus::OutOfSync,
    SyncStatus::Drifted,
    SyncStatus::Progressing,
    SyncStatus::Failed,
    SyncStatus::Masked,
];

impl Default for Metrics {
    fn default() -> Self {
        let mut r = Registry::with_prefix("specd");
        let sync = Family::<Labels, Gauge>::default();
        let last_reconcile = Family::<Labels, Gauge<f64, AtomicU64>>::default();
        let reconciles = Family::<Labels, Counter>::default();
        let failures = Family::<Labels, Counter>::default();
        let duration =
            Family::<Labels, Histogram>::new_with_constructor(|| Histogram::new(exponential_buckets(0.01, 2.0, 18)));
        let commit = Family::<Labels, Gauge>::default();
        r.register("unit_sync", "1 for the unit's current sync status", sync.clone());
        r.register(
            "reconcile_last_timestamp_seconds",
            "Unix time of the unit's last reconcile",
            last_reconcile.clone(),
        );
        r.register("reconciles", "Reconciles by result", reconciles.clone());
        r.register("reconcile_failures", "Reconciles that failed or rolled back", failures.clone());
        r.register("reconcile_duration_seconds", "Duration of reconciles", duration.clone());
        r.register("source_commit", "1 for the commit the agent deploys", commit.clone());
        let source_reads = Counter::default();
        r.register("source_reads", "Reads of the source (fetch, gate, specs)", source_reads.clone());
        let down = Family::<Labels, Gauge>::default();
        r.register("unit_down", "1 when the unit's service is not running after its last reconcile", down.clone());
        let hold = Family::<Labels, Gauge>::default();
        r.register(
            "unit_hold",
            "1 for the kind of hold (suspend, pin, sweep) that keeps the agent's hands off the unit",
            hold.clone(),
        );
        Metrics {
            hold,
            registry: Mutex::new(r),
            sync,
            last_reconcile,
            reconciles,
            failures,
            duration,
            commit,
            down,
            source_reads,
            current_commit: Mutex::new(None),
        }
    }
}

impl Metrics {
    /// A counter kept by another part of the agent (the webhook notifier's), served with these.
    pub fn register_counter(&self, name: &str, help: &str, c: Counter) {
        crate::guard::lock(&self.registry).register(name, help, c);
    }
}

fn unit(u: &str) -> Labels {
    vec![("unit".into(), u.into())]
}

impl Metrics {
    pub fn reconciled(&self, u: &str, sync: SyncStatus, result: &str, secs: f64, failed: bool) {
        for s in SYNCS {
            let mut l = unit(u);
            l.push(("status".into(), s.to_string()));
            self.sync.get_or_create(&l).set(i64::from(s == sync));
        }
        self.last_reconcile.get_or_create(&unit(u)).set(crate::state::now() as f64);
        let mut l = unit(u);
        l.push(("result".into(), result.into()));
        self.reconciles.get_or_create(&l).inc();
        if failed {
            self.failures.get_or_create(&unit(u)).inc();
        }
        self.duration.get_or_create(&unit(u)).observe(secs);
    }

    pub fn source_read(&self) {
        self.source_reads.inc();
    }

    pub fn down(&self, u: &str, down: bool) {
        self.down.get_or_create(&unit(u)).set(i64::from(down));
    }

    /// The unit's hold: 1 for its kind, 0 for the others.
    pub fn hold(&self, u: &str, kind: Option<crate::state::HoldKind>) {
        use crate::state::HoldKind;
        for k in [HoldKind::Suspend, HoldKind::Pin, HoldKind::Sweep] {
            let mut l = unit(u);
            l.push(("kind".into(), format!("{k:?}").to_lowercase()));
            self.hold.get_or_create(&l).set(i64::from(kind == Some(k)));
        }
    }

    pub fn commit(&self, c: &str) {
        let mut cur = crate::guard::lock(&self.current_commit);
        if let Some(old) = cur.take() {
            self.commit.get_or_create(&vec![("commit".into(), old)]).set(0);
        }
        self.commit.get_or_create(&vec![("commit".into(), c.to_string())]).set(1);
        *cur = Some(c.to_string());
    }

    /// What [`Metrics::render`] writes: prometheus-client's text encoder writes the OpenMetrics
    /// text format (`# EOF` at its end, a counter's `_total` samples under a `# TYPE` line
    /// without the suffix), which Prometheus parses as such only when this content type says so.
    pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

    pub fn render(&self) -> String {
        let mut s = String::new();
        let _ = encode(&mut s, &crate::guard::lock(&self.registry));
        s
    }
}
