//! The promoter's evidence, read from a real Prometheus that scrapes every host's agent
//! ([`crate::fleet::prometheus`] asks it): [`gather`] asks a fixed
//! handful of instant queries (one per metric, never one per host; 6 at a time) and folds the
//! answers into one [`Evidence`] for the whole fleet.
//!
//! A host is known by its agent's `specd_host_info{host, <its labels>}`; its other series are
//! joined to it by the `job` and `instance` labels Prometheus adds to everything it scrapes.
//! No evidence is never read as good evidence: a query that fails makes the whole evidence
//! `unavailable`, and a host whose agent is down, not scraped or stale is `down` (with what
//! was last known of it).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::Result;
use specd_spec::fleet::Record;

pub use crate::fleet::prometheus::{Prometheus, Sample};
use crate::fleet::rollout::{Evidence, HostEvidence, Served, UnitEvidence};

/// How far back a host that is down is remembered: its agent's series are read as they were
/// at its last scrape within this window (Prometheus marks a failed target's series stale at
/// once). A host down for longer is not in the evidence at all.
pub const REMEMBERED: Duration = Duration::from_secs(3600);

// --- the evidence ------------------------------------------------------------------------------

/// A scrape target: its `job` and `instance` labels.
type Target = (String, String);

fn target_of(s: &Sample) -> Target {
    let get = |k: &str| s.labels.get(k).cloned().unwrap_or_default();
    (get("job"), get("instance"))
}

fn label<'a>(s: &'a Sample, k: &str) -> Option<&'a str> {
    s.labels.get(k).map(String::as_str)
}

/// How the series of the targets that answered their last scrape are asked ([`fresh`]).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Freshness {
    /// Each series' own time against its target's last scrape: a Prometheus restarted less than
    /// its lookback delta ago may give a series that vanished while it was down (it marks stale
    /// no series that was gone before its first scrape, and gives it for 5 minutes more).
    Compared,
    /// The figure as it is: Prometheus has run for longer than its lookback delta, and marked
    /// stale every series that vanished since it started. A third of the work for Prometheus.
    AsIs,
}

/// How a pass at `now` asks: [`Freshness::AsIs`] once `now` is past `unmarked_until`
/// ([`Prometheus::unmarked_until`]), [`Freshness::Compared`] before or when it is unknown.
fn freshness(unmarked_until: Result<f64, String>, now: f64) -> Freshness {
    match unmarked_until {
        Ok(t) if now >= t => Freshness::AsIs,
        _ => Freshness::Compared,
    }
}

/// `metric` as scraped last: for a target that answered its last scrape, the series of that
/// scrape; for one that did not (its series went stale at once) or is no longer scraped, the
/// last ones within [`REMEMBERED`]. A target that answers never gets an old series back: not a
/// unit's accept rate it no longer reports, nor a revision it left while Prometheus was down.
fn last_known(metric: &str, how: Freshness) -> String {
    format!("({}) or ({})", fresh(metric, how), remembered(metric, None))
}

/// The first half of [`last_known`]: the series of the targets that answered their last scrape
/// (their samples carry its time, as `up` does).
fn fresh(metric: &str, how: Freshness) -> String {
    match how {
        Freshness::Compared => {
            format!("{metric} and timestamp({metric}) >= on(job, instance) group_left timestamp(up)")
        }
        Freshness::AsIs => metric.to_string(),
    }
}

/// The second half: the last series within [`REMEMBERED`] of the targets that did not answer
/// (of `silent`'s only, when given). It reads an hour of samples of each series it selects, so
/// it is asked only about the hosts that need it ([`not_answering`]); the two halves are of
/// other targets, so their answers add up.
fn remembered(metric: &str, silent: Option<&[Target]>) -> String {
    let hour = REMEMBERED.as_secs();
    let select = match silent {
        None => String::new(),
        Some(ts) => {
            let any = |values: BTreeSet<&str>| -> String {
                let alternatives: Vec<String> = values.into_iter().map(regex_quoted).collect();
                string_literal(&alternatives.join("|"))
            };
            let jobs = any(ts.iter().map(|(j, _)| j.as_str()).collect());
            let instances = any(ts.iter().map(|(_, i)| i.as_str()).collect());
            format!("{{job=~{jobs}, instance=~{instances}}}")
        }
    };
    format!("last_over_time({metric}{select}[{hour}s]) unless on(job, instance) up == 1")
}

/// The questions about the figures of the targets that do not answer (`silent`), in the order
/// of [`FIGURES`]: named in the question while they are few (it goes in a URL, which a proxy in
/// front of Prometheus may refuse past 8 KB), else of every target that does not answer.
fn remembered_questions(silent: &[Target], now: f64) -> Vec<(String, f64)> {
    let named = (silent.len() <= SILENT_NAMED_AT_MOST).then_some(silent);
    FIGURES.map(|(m, filter)| (filtered(remembered(m, named), filter), now)).to_vec()
}

/// The most targets [`remembered`] names (about 60 bytes each in the URL); past them it asks of
/// every target that does not answer.
const SILENT_NAMED_AT_MOST: usize = 64;

/// `s` as a regular expression (RE2) that matches only it.
fn regex_quoted(s: &str) -> String {
    s.chars().fold(String::new(), |mut out, c| {
        if r"\.+*?()|[]{}^$".contains(c) {
            out.push('\\');
        }
        out.push(c);
        out
    })
}

/// `s` as a PromQL string literal.
fn string_literal(s: &str) -> String {
    let escaped: String = s
        .chars()
        .map(|c| match c {
            '\\' => "\\\\".to_string(),
            '"' => "\\\"".to_string(),
            c if c.is_control() => format!("\\u{:04x}", c as u32),
            c => c.to_string(),
        })
        .collect();
    format!("\"{escaped}\"")
}

/// The targets of the hosts Prometheus knows (`hosts`: the answer about `specd_host_info`)
/// that did not answer their last scrape or are no longer scraped (`up`: the answer about `up`).
fn not_answering(hosts: &[Sample], up: &[Sample]) -> Vec<Target> {
    let answering: BTreeSet<Target> = up.iter().filter(|s| s.value == 1.0).map(target_of).collect();
    let silent: BTreeSet<Target> = hosts.iter().map(target_of).filter(|t| !answering.contains(t)).collect();
    silent.into_iter().collect()
}

/// The deaths of each unit in the last `range` seconds, by verdict, exactly: the counter now
/// less the counter then. `increase` would extrapolate a death seen between two scrapes of a
/// short window to 1.5, and miss one before the window's first sample; it is asked only for a
/// counter that was reset in the window (its agent restarted) or born in it, rounded up, and
/// for one whose difference is 0 though it moved in the window (reset between the sample
/// before it and the window's first: counted, not read as 0). Only the counts above 0 are
/// answered (a unit has a counter per verdict, each 0 but where it died), and the subtraction
/// only of the counters above 0 now: at 1,000 hosts the question is of 7,000 counters, of which
/// a few moved.
pub fn deaths_since(range: u64) -> String {
    let m = "specd_unit_deaths_total";
    format!(
        "(({m} > 0) - {m} offset {range}s > 0 unless on(job, instance, unit, verdict) resets({m}[{range}s]) > 0) \
         or ceil(increase({m}[{range}s]) > 0)"
    )
}

/// The answers of the queries asked at `now`, by what they ask.
#[derive(Default)]
struct Now {
    hosts: Vec<Sample>,
    up: Vec<Sample>,
    up_at: Vec<Sample>,
    source: Vec<Sample>,
    unit_info: Vec<Sample>,
    args_verified: Vec<Sample>,
    quarantined: Vec<Sample>,
    accept_length: Vec<Sample>,
    accept_rate: Vec<Sample>,
    start: Vec<Sample>,
    hold: Vec<Sample>,
    last_death: Vec<Sample>,
    serving: Vec<Sample>,
    /// The units told ready and not yet taken by their load balancers.
    awaiting: Vec<Sample>,
    served: ServedSamples,
}

/// What the agent's `tune:` says a unit served, asked now and before a wave's first promotion.
const SERVED: [&str; 3] =
    ["specd_unit_served_accept_length", "specd_unit_served_tokens_per_second", "specd_unit_served_drafts"];

/// The answers about [`SERVED`].
#[derive(Default)]
struct ServedSamples {
    length: Vec<Sample>,
    tok_s: Vec<Sample>,
    drafts: Vec<Sample>,
}

impl ServedSamples {
    /// Its three answers, asked in the order of [`SERVED`].
    fn from(mut next: impl FnMut() -> Vec<Sample>) -> ServedSamples {
        ServedSamples { length: next(), tok_s: next(), drafts: next() }
    }

    /// Each unit's figures, where all three are known, by target and unit.
    fn by_unit(&self) -> BTreeMap<(Target, String), Served> {
        let mut out: BTreeMap<(Target, String), [Option<f64>; 3]> = BTreeMap::new();
        for (i, samples) in [&self.length, &self.tok_s, &self.drafts].into_iter().enumerate() {
            for s in samples.iter().filter(|s| s.value.is_finite()) {
                if let Some(u) = label(s, "unit") {
                    out.entry((target_of(s), u.to_string())).or_default()[i] = Some(s.value);
                }
            }
        }
        out.into_iter()
            .filter_map(|(k, v)| match v {
                [Some(accept_length), Some(tok_s), Some(drafts)] => Some((k, Served { accept_length, tok_s, drafts })),
                _ => None,
            })
            .collect()
    }
}

/// The answers a rollout in progress needs, for the hosts they are about.
#[derive(Default)]
struct Since {
    promotions: Vec<Promotion>,
    /// Per converged wave: its hosts and `min_over_time(specd_unit_args_verified[…])`.
    converged: Vec<(BTreeSet<String>, Vec<Sample>)>,
}

/// The answers about the hosts promoted in one wave.
struct Promotion {
    /// Each host, with when it was promoted.
    hosts: BTreeMap<String, u64>,
    /// The first of those times.
    first: u64,
    /// The accept figures and the last start a second before `first`: the wave's good revision's.
    length: Vec<Sample>,
    rate: Vec<Sample>,
    start: Vec<Sample>,
    /// The deaths since `first`, by verdict.
    deaths: Vec<Sample>,
    /// What the instances served, a second before.
    served: ServedSamples,
}

/// Everything Prometheus says about the fleet at `now` (unix seconds with their fraction: a
/// scrape less than a second before counts), and at the moments the rollout of `record` needs
/// (each unbaked wave's promotions and convergence). A host whose newest `up` sample is older
/// than `stale_after` seconds is down. When a query fails, the evidence is `unavailable` with
/// its error (the first; nothing more is asked).
pub async fn gather(p: &Prometheus, record: Option<&Record>, now: f64, stale_after: u64) -> Evidence {
    match ask(p, record, now).await {
        Ok((answers, since)) => fold(&answers, &since, now as u64, stale_after),
        Err(why) => Evidence { unavailable: Some(why), ..Default::default() },
    }
}

/// An unbaked wave of the record: its promoted hosts (with when), the first of those times,
/// and when it converged.
#[derive(Debug, PartialEq)]
struct InProgress {
    hosts: BTreeMap<String, u64>,
    first: u64,
    converged: Option<(u64, BTreeSet<String>)>,
}

/// The unbaked waves of `record` that promoted a host or converged.
fn in_progress(record: Option<&Record>) -> Vec<InProgress> {
    let mut out = Vec::new();
    for w in record.map(|r| r.waves.as_slice()).unwrap_or_default() {
        if w.baked.is_some() {
            continue;
        }
        let hosts: BTreeMap<String, u64> = w.promoted.iter().map(|p| (p.host.clone(), p.at)).collect();
        let first = w.promoted.iter().map(|p| p.at).min().unwrap_or_default();
        let converged = w.converged.map(|c| (c, hosts.keys().cloned().collect()));
        if !hosts.is_empty() || converged.is_some() {
            out.push(InProgress { hosts, first, converged });
        }
    }
    out
}

/// The instant queries (expression, time) about the rollout in progress, per wave of
/// [`in_progress`]: with promoted hosts, the accept figures a second before its first promotion
/// and the deaths since it; converged, `args_verified` at every scrape since. As many whatever
/// the number of hosts and of their promotion times: at most four per wave.
fn since_questions(waves: &[InProgress], now: u64) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    for w in waves {
        if !w.hosts.is_empty() {
            let before = w.first.saturating_sub(1);
            out.push(("specd_unit_accept_length".to_string(), before));
            out.push(("specd_unit_accept_rate".to_string(), before));
            out.push(("specd_unit_start_duration_seconds".to_string(), before));
            out.push((deaths_since(now.saturating_sub(w.first).max(1)), now));
            out.extend(SERVED.map(|m| (m.to_string(), before)));
        }
        if let Some((c, _)) = &w.converged {
            let range = now.saturating_sub(*c).max(1);
            out.push((format!("min_over_time(specd_unit_args_verified[{range}s])"), now));
        }
    }
    out
}

/// The figures of a host asked at `now`, in the order [`Now`] keeps them after the hosts, `up`
/// and `timestamp(up)`; each with the filter that keeps the series [`fold`] reads (a hold and
/// a serving state say something only where they are 1: of a unit's three holds, one at most).
const FIGURES: [(&str, &str); 14] = [
    ("specd_source_info", ""),
    ("specd_unit_info", ""),
    ("specd_unit_args_verified", ""),
    ("specd_unit_quarantined", ""),
    ("specd_unit_accept_length", ""),
    ("specd_unit_accept_rate", ""),
    ("specd_unit_start_duration_seconds", ""),
    ("specd_unit_hold", " == 1"),
    ("specd_unit_last_death_timestamp_seconds", ""),
    ("specd_unit_serving", " == 1"),
    ("specd_unit_awaiting_balancers", " == 1"),
    (SERVED[0], ""),
    (SERVED[1], ""),
    (SERVED[2], ""),
];

/// `expr` with a figure's `filter` (from [`FIGURES`]).
fn filtered(expr: String, filter: &str) -> String {
    if filter.is_empty() { expr } else { format!("({expr}){filter}") }
}

/// The questions asked at `now`, each of the whole fleet, in the order [`Now`] keeps them: the
/// hosts as last known, `up`, and each figure of the targets that answered their last scrape
/// (the rest, [`remembered`], only when a host did not). One question a figure: asked as they
/// are, they could share one, but [`Freshness::Compared`] needs each series' own `timestamp()`,
/// which drops the metric name; and apart, Prometheus answers them on several cores at once.
fn now_questions(now: f64, how: Freshness) -> Vec<(String, f64)> {
    let mut q = vec![(last_known("specd_host_info", how), now), ("up".into(), now), ("timestamp(up)".into(), now)];
    q.extend(FIGURES.map(|(m, filter)| (filtered(fresh(m, how), filter), now)));
    q
}

/// Questions in flight at once: a pass waits for the slowest of each few rather than for their
/// sum, and a Prometheus on few cores answers each within its bound rather than all of them late.
const ASKED_AT_ONCE: usize = 6;

/// The questions asked [`ASKED_AT_ONCE`] at a time; the answers in the questions' order, or the
/// first error in that order.
async fn ask_all(p: &Prometheus, questions: Vec<(String, f64)>) -> Result<Vec<Vec<Sample>>, String> {
    let answers = super::at_most(ASKED_AT_ONCE, questions, |(expr, t)| {
        let p = p.clone();
        async move { p.query(&expr, Some(t)).await }
    })
    .await;
    let lost = || Err(format!("asking Prometheus at {}: a question was not answered", p.url()));
    answers.into_iter().map(|a| a.unwrap_or_else(lost)).collect()
}

async fn ask(p: &Prometheus, record: Option<&Record>, now: f64) -> Result<(Now, Since), String> {
    let waves = in_progress(record);
    let how = freshness(p.unmarked_until().await, now);
    // The questions about the rollout first: the deaths' are the slowest (a counter per unit and
    // verdict), begun first they do not wait for a place behind the others.
    let mut questions: Vec<(String, f64)> =
        since_questions(&waves, now as u64).into_iter().map(|(e, t)| (e, t as f64)).collect();
    let about_since = questions.len();
    questions.extend(now_questions(now, how));
    let mut answered = ask_all(p, questions).await?;
    let mut about_now = answered.split_off(about_since);
    let silent = not_answering(&about_now[0], &about_now[1]);
    if !silent.is_empty() {
        let more = ask_all(p, remembered_questions(&silent, now)).await?;
        for (a, m) in about_now[3..].iter_mut().zip(more) {
            a.extend(m);
        }
    }
    let mut about_now = about_now.into_iter();
    let mut next = || about_now.next().unwrap_or_default();
    let answers = Now {
        hosts: next(),
        up: next(),
        up_at: next(),
        source: next(),
        unit_info: next(),
        args_verified: next(),
        quarantined: next(),
        accept_length: next(),
        accept_rate: next(),
        start: next(),
        hold: next(),
        last_death: next(),
        serving: next(),
        awaiting: next(),
        served: ServedSamples::from(&mut next),
    };
    let mut answered = answered.into_iter();
    let mut next = || answered.next().unwrap_or_default();
    let mut since = Since::default();
    for w in waves {
        if !w.hosts.is_empty() {
            let (length, rate, start, deaths) = (next(), next(), next(), next());
            let served = ServedSamples::from(&mut next);
            since.promotions.push(Promotion { hosts: w.hosts, first: w.first, length, rate, start, deaths, served });
        }
        if let Some((_, hosts)) = w.converged {
            since.converged.push((hosts, next()));
        }
    }
    Ok((answers, since))
}

/// The evidence the answers give.
fn fold(a: &Now, since: &Since, now: u64, stale_after: u64) -> Evidence {
    let (hosts, by_target) = hosts_of(&a.hosts);
    let mut ev = Evidence { hosts, ..Default::default() };
    let up: BTreeMap<Target, f64> = a.up.iter().map(|s| (target_of(s), s.value)).collect();
    // The jobs that scrape agents: a target of theirs that is down and said no host name.
    let jobs: BTreeSet<&str> = by_target.keys().map(|(job, _)| job.as_str()).collect();
    for ((job, instance), v) in &up {
        if *v != 1.0 && jobs.contains(job.as_str()) && !by_target.contains_key(&(job.clone(), instance.clone())) {
            ev.unidentified.push(format!("{instance} (job {job})"));
        }
    }
    let up_at: BTreeMap<Target, f64> = a.up_at.iter().map(|s| (target_of(s), s.value)).collect();
    for (target, name) in &by_target {
        let h = ev.hosts.get_mut(name).expect("every target's host is in the evidence");
        if h.down.is_none() {
            h.down = down(up.get(target).copied(), up_at.get(target).copied(), now, stale_after, target);
        }
    }
    for s in &a.source {
        if let (Some(h), Some(r)) = (host_mut(&mut ev, &by_target, s), label(s, "revision")) {
            h.revision = Some(r.to_string());
        }
    }
    for s in &a.unit_info {
        if let (Some(hash), Some(u)) = (label(s, "unit_hash"), unit_mut(&mut ev, &by_target, s)) {
            u.unit_hash = Some(hash.to_string());
        }
    }
    for s in &a.args_verified {
        if let Some(u) = unit_mut(&mut ev, &by_target, s) {
            u.args_verified = Some(s.value == 1.0);
        }
    }
    for s in &a.quarantined {
        if let Some(u) = unit_mut(&mut ev, &by_target, s) {
            u.quarantined = s.value == 1.0;
        }
    }
    for s in a.accept_length.iter().filter(|s| s.value.is_finite()) {
        if let Some(u) = unit_mut(&mut ev, &by_target, s) {
            u.accept_length = Some(s.value);
        }
    }
    for s in a.accept_rate.iter().filter(|s| s.value.is_finite()) {
        if let Some(u) = unit_mut(&mut ev, &by_target, s) {
            u.accept_rate = Some(s.value);
        }
    }
    for s in a.start.iter().filter(|s| s.value.is_finite()) {
        if let Some(u) = unit_mut(&mut ev, &by_target, s) {
            u.start_seconds = Some(s.value);
        }
    }
    for s in a.hold.iter().filter(|s| s.value == 1.0) {
        if let (Some(kind), Some(u)) = (label(s, "kind"), unit_mut(&mut ev, &by_target, s)) {
            u.hold = Some(kind.to_string());
        }
    }
    for s in a.serving.iter().filter(|s| s.value == 1.0) {
        if let (Some(state), Some(u)) = (label(s, "state"), unit_mut(&mut ev, &by_target, s)) {
            u.serving = Some(state.to_string());
        }
    }
    for s in a.awaiting.iter().filter(|s| s.value == 1.0) {
        if let Some(u) = unit_mut(&mut ev, &by_target, s) {
            u.taken = Some(false);
        }
    }
    for s in &a.last_death {
        if let (Some(v), Some(u)) = (label(s, "verdict"), unit_mut(&mut ev, &by_target, s)) {
            u.last_death = Some(v.to_string());
        }
    }
    for ((target, unit), served) in a.served.by_unit() {
        if let Some(h) = by_target.get(&target).and_then(|n| ev.hosts.get_mut(n)) {
            h.units.entry(unit).or_default().served = Some(served);
        }
    }
    fold_since(&mut ev, &by_target, since, &a.last_death);
    ev
}

/// The host a sample is about.
fn host_mut<'a>(
    ev: &'a mut Evidence,
    by_target: &BTreeMap<Target, String>,
    s: &Sample,
) -> Option<&'a mut HostEvidence> {
    by_target.get(&target_of(s)).and_then(|n| ev.hosts.get_mut(n))
}

/// The unit a sample is about (`unit` label), added to its host's.
fn unit_mut<'a>(
    ev: &'a mut Evidence,
    by_target: &BTreeMap<Target, String>,
    s: &Sample,
) -> Option<&'a mut UnitEvidence> {
    let name = label(s, "unit")?;
    Some(host_mut(ev, by_target, s)?.units.entry(name.to_string()).or_default())
}

/// The hosts of `specd_host_info`'s series, and which host each target is. A host name that
/// two targets report is down: neither can be told from the other.
fn hosts_of(info: &[Sample]) -> (BTreeMap<String, HostEvidence>, BTreeMap<Target, String>) {
    let mut hosts: BTreeMap<String, HostEvidence> = BTreeMap::new();
    let mut targets: BTreeMap<String, Vec<Target>> = BTreeMap::new();
    for s in info {
        let Some(name) = label(s, "host").filter(|n| !n.is_empty()) else { continue };
        let labels = s
            .labels
            .iter()
            .filter(|(k, _)| !matches!(k.as_str(), "__name__" | "host" | "job" | "instance"))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let ts = targets.entry(name.to_string()).or_default();
        let t = target_of(s);
        if !ts.contains(&t) {
            ts.push(t.clone());
        }
        hosts.entry(name.to_string()).or_insert_with(|| HostEvidence { labels, target: t, ..Default::default() });
    }
    let mut by_target = BTreeMap::new();
    for (name, ts) in targets {
        if ts.len() > 1 {
            let shown: Vec<String> = ts.iter().map(|(j, i)| format!("{i} (job {j})")).collect();
            let why = format!("two scrape targets report this host name: {}", shown.join(", "));
            hosts.get_mut(&name).expect("a host of its targets").down = Some(why);
        }
        by_target.insert(ts[0].clone(), name);
    }
    (hosts, by_target)
}

/// Why a target gives no evidence, from its `up` and the time of its newest sample.
fn down(up: Option<f64>, sampled: Option<f64>, now: u64, stale_after: u64, target: &Target) -> Option<String> {
    let (job, instance) = target;
    let Some(up) = up else {
        return Some(format!("not scraped: Prometheus has no `up` of its target {instance} (job {job}) now"));
    };
    if up != 1.0 {
        return Some("its agent is down: the last scrape failed".into());
    }
    let age = sampled.map_or(f64::INFINITY, |t| now as f64 - t);
    (age > stale_after as f64).then(|| format!("its last scrape is stale: {age:.0} s old (more than {stale_after} s)"))
}

/// The figures of a rollout in progress, on the hosts they are about (only units the host
/// reports now). The deaths were counted since the wave's first promotion: a host promoted
/// later has died since its own only when its newest death was counted at or after it
/// (`last_death`: `specd_unit_last_death_timestamp_seconds`).
fn fold_since(ev: &mut Evidence, by_target: &BTreeMap<Target, String>, since: &Since, last_death: &[Sample]) {
    let mut died_at: BTreeMap<(String, String), f64> = BTreeMap::new();
    for s in last_death {
        if let (Some(name), Some(unit)) = (by_target.get(&target_of(s)), label(s, "unit")) {
            died_at.insert((name.clone(), unit.to_string()), s.value);
        }
    }
    for Promotion { hosts, first, length, rate, start, deaths, served } in &since.promotions {
        let promoted = |h: &str| hosts.contains_key(h);
        for ((target, unit), s) in served.by_unit() {
            let host = by_target.get(&target).filter(|n| hosts.contains_key(*n));
            if let Some(u) = host.and_then(|n| ev.hosts.get_mut(n)).and_then(|h| h.units.get_mut(&unit)) {
                u.previous_served = Some(s);
            }
        }
        on_units(ev, by_target, promoted, start, |_, u, s| {
            u.previous_start_seconds = s.value.is_finite().then_some(s.value)
        });
        on_units(ev, by_target, promoted, length, |_, u, s| {
            u.previous_accept_length = s.value.is_finite().then_some(s.value)
        });
        on_units(ev, by_target, promoted, rate, |_, u, s| {
            u.previous_accept_rate = s.value.is_finite().then_some(s.value)
        });
        on_units(ev, by_target, promoted, deaths, |h, u, s| {
            let at = hosts.get(h).copied().unwrap_or_default();
            let unit = label(s, "unit").unwrap_or_default();
            let since_its_own =
                at <= *first || died_at.get(&(h.to_string(), unit.to_string())).is_some_and(|t| *t >= at as f64);
            if let Some(v) = label(s, "verdict").filter(|_| s.value > 0.5 && since_its_own) {
                u.deaths_since_promotion.insert(v.to_string(), s.value);
            }
        });
    }
    for (hosts, min) in &since.converged {
        on_units(ev, by_target, |h| hosts.contains(h), min, |_, u, s| u.verified_throughout = Some(s.value == 1.0));
    }
}

/// `set` on the unit each sample is about (with its host's name), when its host is one `of`.
fn on_units(
    ev: &mut Evidence,
    by_target: &BTreeMap<Target, String>,
    of: impl Fn(&str) -> bool,
    samples: &[Sample],
    mut set: impl FnMut(&str, &mut UnitEvidence, &Sample),
) {
    for s in samples {
        let Some(name) = by_target.get(&target_of(s)).filter(|n| of(n)) else { continue };
        let Some(unit) = label(s, "unit") else { continue };
        if let Some(u) = ev.hosts.get_mut(name).and_then(|h| h.units.get_mut(unit)) {
            set(name, u, s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(labels: &[(&str, &str)], value: f64) -> Sample {
        Sample { labels: labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(), value }
    }

    #[test]
    fn a_target_is_down_when_its_scrape_failed_it_has_no_up_or_its_sample_is_stale() {
        let t = ("specd".to_string(), "h:9".to_string());
        assert_eq!(down(Some(1.0), Some(995.5), 1000, 5, &t), None);
        assert_eq!(down(Some(0.0), Some(999.0), 1000, 5, &t).unwrap(), "its agent is down: the last scrape failed");
        assert!(down(None, None, 1000, 5, &t).unwrap().starts_with("not scraped"));
        assert_eq!(
            down(Some(1.0), Some(880.0), 1000, 60, &t).unwrap(),
            "its last scrape is stale: 120 s old (more than 60 s)"
        );
    }

    #[test]
    fn one_host_name_reported_by_two_targets_is_down_naming_both() {
        let a = sample(&[("host", "gpu1"), ("job", "specd"), ("instance", "a:9"), ("gpu", "h100")], 1.0);
        let b = sample(&[("host", "gpu1"), ("job", "specd"), ("instance", "b:9"), ("gpu", "h100")], 1.0);
        let (hosts, _) = hosts_of(&[a, b]);
        assert_eq!(hosts["gpu1"].labels, BTreeMap::from([("gpu".to_string(), "h100".to_string())]));
        let why = hosts["gpu1"].down.as_deref().unwrap();
        assert!(why.contains("a:9 (job specd)") && why.contains("b:9 (job specd)"), "{why}");
    }

    /// A wave of `n` hosts promoted one per second from 1000 (and converged at `converged`),
    /// after a baked canary.
    fn rolling(n: usize, converged: Option<u64>) -> Record {
        use specd_spec::fleet::{Promoted, WaveRecord};
        let rev = "a".repeat(40);
        let promoted = (0..n).map(|i| Promoted { host: format!("h{i:04}"), at: 1000 + i as u64 }).collect();
        let canary = WaveRecord { baked: Some(900), ..WaveRecord::at("canary", &rev) };
        let rest = WaveRecord { promoted, converged, ..WaveRecord::at("rest", &rev) };
        Record { target: rev.clone(), released: rev, waves: vec![canary, rest], ..Default::default() }
    }

    #[test]
    fn the_questions_about_a_rollout_are_as_many_for_ten_hosts_as_for_a_thousand() {
        let questions = |n, converged| since_questions(&in_progress(Some(&rolling(n, converged))), 5000);
        for converged in [None, Some(4000)] {
            let (ten, thousand) = (questions(10, converged), questions(1000, converged));
            assert_eq!(ten.len(), thousand.len(), "{ten:?}\n{thousand:?}");
            assert_eq!(ten.len(), 7 + usize::from(converged.is_some()), "{ten:?}");
        }
        // The figures before the wave's first promotion, the deaths since it.
        let q = questions(1000, None);
        assert_eq!(q[0], ("specd_unit_accept_length".to_string(), 999));
        assert_eq!(q[2], ("specd_unit_start_duration_seconds".to_string(), 999));
        assert_eq!(q[3], (deaths_since(4000), 5000));
        assert!(in_progress(Some(&rolling(0, None))).is_empty());
    }

    #[test]
    fn a_host_promoted_after_its_wave_s_first_counts_only_the_deaths_since_its_own_promotion() {
        let with = |h: &str, more: &[(&str, &str)]| -> Vec<(String, String)> {
            let mut l = vec![("job", "specd"), ("instance", h), ("unit", "llm.service")];
            l.extend_from_slice(more);
            l.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
        };
        let s =
            |h: &str, more: &[(&str, &str)], value: f64| Sample { labels: with(h, more).into_iter().collect(), value };
        let info = |h: &str| Sample {
            labels: [("job", "specd"), ("instance", h), ("host", h)]
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .into(),
            value: 1.0,
        };
        // a promoted first (1000), b and c later (1010); each died once since 1000: a and c
        // after their promotions (counted at 1005 and 1020), b before its own (at 1005).
        let deaths: Vec<Sample> = ["a", "b", "c"].iter().map(|h| s(h, &[("verdict", "crash")], 1.0)).collect();
        let last_death = vec![
            s("a", &[("verdict", "crash")], 1005.0),
            s("b", &[("verdict", "crash")], 1005.0),
            s("c", &[("verdict", "crash")], 1020.0),
        ];
        let hosts = BTreeMap::from([("a".to_string(), 1000), ("b".to_string(), 1010), ("c".to_string(), 1010)]);
        let promotion = Promotion {
            hosts,
            first: 1000,
            length: vec![],
            rate: vec![],
            start: vec![],
            deaths,
            served: ServedSamples::default(),
        };
        let since = Since { promotions: vec![promotion], converged: vec![] };
        let now = Now {
            hosts: ["a", "b", "c"].map(info).to_vec(),
            unit_info: ["a", "b", "c"].iter().map(|h| s(h, &[("unit_hash", "x")], 1.0)).collect(),
            last_death,
            ..Default::default()
        };
        let ev = fold(&now, &since, 1030, 60);
        let died = |h: &str| ev.hosts[h].units["llm.service"].deaths_since_promotion.clone();
        assert_eq!(died("a"), BTreeMap::from([("crash".to_string(), 1.0)]));
        assert_eq!(died("b"), BTreeMap::new());
        assert_eq!(died("c"), BTreeMap::from([("crash".to_string(), 1.0)]));
    }

    /// `specd_unit_awaiting_balancers == 1` names the units told ready whose load balancers have
    /// not taken them back; a unit it does not name (taken, told drain or down, or an agent too
    /// old to say) is not held for it.
    #[test]
    fn a_unit_its_load_balancers_have_not_taken_back_is_told_apart() {
        let labels = |h: &str, more: &[(&str, &str)]| {
            let mut l = vec![("job", "specd"), ("instance", h)];
            l.extend_from_slice(more);
            l.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
        };
        let s = |h: &str, more: &[(&str, &str)], value: f64| Sample { labels: labels(h, more), value };
        let now = Now {
            hosts: ["a", "b"].map(|h| s(h, &[("host", h)], 1.0)).to_vec(),
            unit_info: ["a", "b"].map(|h| s(h, &[("unit", "llm.service"), ("unit_hash", "x")], 1.0)).to_vec(),
            awaiting: vec![s("a", &[("unit", "llm.service")], 1.0)],
            ..Default::default()
        };
        let ev = fold(&now, &Since::default(), 1030, 60);
        assert_eq!(ev.hosts["a"].units["llm.service"].taken, Some(false));
        assert_eq!(ev.hosts["b"].units["llm.service"].taken, None);
        assert!(now_questions(1.0, Freshness::AsIs).iter().any(|(q, _)| q == "(specd_unit_awaiting_balancers) == 1"));
    }

    #[test]
    fn while_every_host_answers_its_scrapes_a_pass_reads_no_hour_of_samples_but_the_hosts() {
        let hour = |q: &[(String, f64)]| q.iter().filter(|(e, _)| e.contains("[3600s]")).count();
        for how in [Freshness::Compared, Freshness::AsIs] {
            let q = now_questions(5000.0, how);
            assert_eq!((q.len(), hour(&q)), (17, 1), "{q:?}");
            assert_eq!(q[0].0, last_known("specd_host_info", how));
            let compared = q.iter().filter(|(e, _)| e.contains("timestamp(specd_")).count();
            assert_eq!(compared, if how == Freshness::Compared { 15 } else { 0 }, "{q:?}");
        }
        assert_eq!(now_questions(1.0, Freshness::AsIs)[10].0, "(specd_unit_hold) == 1");
        let target = |i: &str, v| sample(&[("job", "specd"), ("instance", i)], v);
        let t = |i: &str| ("specd".to_string(), i.to_string());
        let hosts = [target("a:9", 1.0), target("b:9", 1.0), target("c:9", 1.0)];
        let all_up = [target("a:9", 1.0), target("b:9", 1.0), target("c:9", 1.0)];
        assert_eq!(not_answering(&hosts, &all_up), vec![]);
        assert_eq!(not_answering(&hosts, &[target("a:9", 1.0), target("b:9", 0.0)]), vec![t("b:9"), t("c:9")]);
    }

    #[test]
    fn a_pass_asks_each_figure_as_it_is_once_prometheus_has_marked_stale_what_vanished() {
        assert_eq!(freshness(Ok(1000.0), 1000.5), Freshness::AsIs);
        assert_eq!(freshness(Ok(1000.0), 999.5), Freshness::Compared, "restarted less than its lookback ago");
        assert_eq!(freshness(Err("no flags".into()), 1e10), Freshness::Compared, "unknown: compared");
    }

    #[test]
    fn the_hour_of_samples_is_read_only_of_the_targets_that_do_not_answer() {
        let silent = [("specd".to_string(), "10.0.0.1:9101".to_string()), ("gpu\\s".to_string(), "b\"x".to_string())];
        assert_eq!(
            remembered("specd_unit_info", Some(&silent)),
            r#"last_over_time(specd_unit_info{job=~"gpu\\\\s|specd", instance=~"10\\.0\\.0\\.1:9101|b\"x"}[3600s]) unless on(job, instance) up == 1"#
        );
        assert_eq!(regex_quoted("a.b|c*"), r"a\.b\|c\*");
        assert_eq!(string_literal("a\nb\tc"), r#""a\u000ab\u0009c""#);
        let targets = |n: usize| (0..n).map(|i| ("specd".to_string(), format!("h{i}"))).collect::<Vec<_>>();
        let few = remembered_questions(&targets(SILENT_NAMED_AT_MOST), 1.0);
        assert!(few.iter().all(|(q, _)| q.contains("instance=~")) && few.len() == FIGURES.len());
        let many = remembered_questions(&targets(SILENT_NAMED_AT_MOST + 1), 1.0);
        assert!(many.iter().all(|(q, _)| !q.contains("instance=~") && q.len() < 200), "{many:?}");
    }
}
