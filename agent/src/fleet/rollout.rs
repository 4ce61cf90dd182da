//! The promoter's decisions, pure: given the fleet file, the promotion record, the followed
//! branch's head, the evidence (what Prometheus says each host runs and measured) and the
//! time, the one next step of a rollout — or why it waits. `specd promote` gathers the inputs,
//! calls [`decide`], writes the step as one commit; `specd fleet status` narrates [`positions`].
//!
//! With a fleet file (`fleet.yaml` beside the specs), a host deploys the revision the promotion
//! record gives it (`promotions.yaml` on the record branch), not the head. The record: `target`
//! (the head rolled out), `released` (the last revision every wave passed; hosts no wave selects
//! run it), `state`, and per wave its `good` revision, its `promoted` hosts (given the target),
//! `converged` (every host good: the bake starts) and `baked`; a `halt` with host, unit, gate
//! and evidence. A host belongs to the first wave that selects it. One step per pass:
//!
//! - no record: adopt the head as released; the waves changed: rewave; a new head: a new rollout
//!   (a wave that baked the previous target keeps it; an automatic halt is superseded, a
//!   person's is not);
//! - in the first wave not baked: a failed gate on a host halts the rollout. The failing host
//!   goes back to the wave's good revision at once, the wave's other promoted hosts after it as
//!   `max_unavailable` leaves room (hosts not good count as unavailable); later waves never see
//!   the target. Else as many healthy hosts are promoted as `max_unavailable` allows; all
//!   promoted and good: converged; `bake` later: baked; every wave baked: complete;
//! - a host of a converged wave that is not good, or one that joined it, clears `converged`: the
//!   bake starts again once all are good. A wave that selects no host Prometheus knows waits.
//!
//! Gates: `converge_within`, `applied` (the target quarantined), `spec` (the target does not
//! resolve for the host), `args_verified` (also at every scrape of the bake), `speculation_proven`,
//! `accept_length`/`accept_rate` floors (absolute, and a fraction of the previous revision's
//! figure on the same host and unit), `startup_within` (a ceiling on the start, absolute and a
//! multiple of the previous revision's start on the same host and unit), `no_deaths`. No evidence never advances and never halts a
//! wave. Time is whole seconds; a bake passes only once a whole second after `converged + bake`
//! began, never shorter than asked. Two promoters that take the same step in the same second
//! write byte-identical commits; a second apart, one push is rejected and that pass reads again.

use std::collections::BTreeMap;

use specd_spec::fleet::{Halt, ParsedFleet, Promoted, Record, RolloutState};
use specd_spec::short;

/// What Prometheus says about the fleet, now (and at the moments a rollout needs).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Evidence {
    /// Why there is no evidence at all (Prometheus unreachable, a query refused); then nothing
    /// advances.
    pub unavailable: Option<String>,
    /// Every host an agent reports (`specd_host_info`), by host name.
    pub hosts: BTreeMap<String, HostEvidence>,
    /// Scrape targets of the agents' jobs that are down and never said which host they are
    /// (no `specd_host_info` within the hour): `instance (job j)`. Any host could be one, so
    /// no wave advances while there is one.
    pub unidentified: Vec<String>,
}

/// One host's agent, as scraped.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HostEvidence {
    /// The labels its agent declares (`labels:` in its config).
    pub labels: BTreeMap<String, String>,
    /// Why the host gives no evidence, if it does not: its agent is down (`up` is 0), not
    /// scraped, or its last sample is stale. `None`: the agent answered its last scrape.
    pub down: Option<String>,
    /// The commit the agent deploys (`specd_source_info{revision}`).
    pub revision: Option<String>,
    /// Its agent's scrape target: `job` and `instance`.
    pub target: (String, String),
    /// Its units, by unit name.
    pub units: BTreeMap<String, UnitEvidence>,
}

/// One unit of one host, as scraped.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct UnitEvidence {
    /// The sha256 of the unit file that runs, verified (`specd_unit_info{unit_hash}`).
    pub unit_hash: Option<String>,
    /// `specd_unit_args_verified` now; `None` when the spec's args are not checked.
    pub args_verified: Option<bool>,
    /// `min_over_time(specd_unit_args_verified[since the wave converged])`: false when it was 0
    /// at any scrape of the bake.
    pub verified_throughout: Option<bool>,
    /// `specd_unit_quarantined`: the desired unit failed and is quarantined.
    pub quarantined: bool,
    pub accept_length: Option<f64>,
    pub accept_rate: Option<f64>,
    /// The figures just before the host was promoted (the previous revision's).
    pub previous_accept_length: Option<f64>,
    pub previous_accept_rate: Option<f64>,
    /// How long the last start of the unit that runs took, seconds
    /// (`specd_unit_start_duration_seconds`), and the same just before the host was promoted.
    pub start_seconds: Option<f64>,
    pub previous_start_seconds: Option<f64>,
    /// At the load the host serves (the agent's `tune:`): the accept length, the decode speed of
    /// one request and the drafts they rest on, since the instance started; and the first two
    /// just before the host was promoted (the previous revision's instance).
    pub served: Option<Served>,
    pub previous_served: Option<Served>,
    /// Deaths since the host was promoted, by verdict (`increase(specd_unit_deaths_total[…])`).
    pub deaths_since_promotion: BTreeMap<String, f64>,
    /// The verdict of the newest death the agent counted (`specd_unit_last_death_timestamp_seconds`).
    pub last_death: Option<String>,
    /// The kind of hold on the unit (`specd_unit_hold`): suspend, pin or sweep.
    pub hold: Option<String>,
    /// What its load balancers are told (`specd_unit_serving`): ready, drain or down.
    pub serving: Option<String>,
    /// `Some(false)`: not taken back by its load balancers yet (`specd_unit_awaiting_balancers`).
    pub taken: Option<bool>,
}

/// What a unit's instance served since it started (`specd_unit_served_*`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Served {
    pub accept_length: f64,
    pub tok_s: f64,
    pub drafts: f64,
}

/// What a host must run at a revision: each unit specd renders for it, and whether it
/// speculates (then speculation must be proven).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpectedUnit {
    pub unit: String,
    pub unit_hash: String,
    pub speculates: bool,
}

/// The units a host runs at a revision (`Err`: the specs of that revision do not resolve for
/// the host). The caller renders them from the revision's tree.
pub type Expected<'a> = &'a dyn Fn(&str, &str) -> Result<Vec<ExpectedUnit>, String>;

/// The inputs of one decision.
pub struct Inputs<'a> {
    pub fleet: &'a ParsedFleet,
    pub record: Option<&'a Record>,
    /// The followed branch's head (full hash).
    pub head: &'a str,
    pub evidence: &'a Evidence,
    pub expected: Expected<'a>,
    /// Unix seconds.
    pub now: u64,
}

/// The one next step of a rollout.
#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    /// Write this record, as one commit with this message (first line: the summary).
    Write { record: Box<Record>, message: String },
    /// Nothing to write now: why, and until when if a time is known (a bake's end); `soon`: a
    /// promoted host is applying the target, so the next scrape may let the wave go on.
    Wait { why: String, until: Option<u64>, soon: bool },
}

/// How one host of a wave stands, judged on the evidence.
#[derive(Clone, Debug, PartialEq)]
pub enum Standing {
    /// It runs what it was given and passes every gate.
    Good,
    /// It was given the target and is still applying it (since so many seconds).
    Applying(String),
    /// It runs neither what it was given nor failed: unavailable (not promoted, or waiting).
    Unavailable(String),
    /// No evidence: the agent is down, not scraped, stale, or Prometheus cannot be asked.
    NoEvidence(String),
    /// A gate failed: which, on which unit, what was seen.
    Failed { gate: &'static str, unit: String, evidence: String },
}

impl Standing {
    /// Whether the host counts against the wave's `max_unavailable`.
    pub fn unavailable(&self) -> bool {
        !matches!(self, Standing::Good)
    }

    fn why(&self) -> String {
        match self {
            Standing::Good => "good".into(),
            Standing::Applying(w) | Standing::Unavailable(w) | Standing::NoEvidence(w) => w.clone(),
            Standing::Failed { gate, unit, evidence } => format!("{unit}: gate {gate} failed: {evidence}"),
        }
    }
}

/// The hosts of wave `i`: those it names literally and those Prometheus knows, each if `i` is
/// the first wave that selects it. Sorted by name.
pub fn members(fleet: &ParsedFleet, evidence: &Evidence, i: usize) -> Vec<String> {
    let no_labels = BTreeMap::new();
    let labels = |h: &str| evidence.hosts.get(h).map_or(&no_labels, |e| &e.labels);
    let named = fleet.waves()[i].named_hosts().map(str::to_string);
    let mut out: Vec<String> =
        named.chain(evidence.hosts.keys().cloned()).filter(|h| fleet.wave_of(h, labels(h)) == Some(i)).collect();
    out.sort();
    out.dedup();
    out
}

/// The revision a host of a wave record runs: the target once promoted, the wave's good one before.
fn given<'r>(record: &'r Record, wave: &'r specd_spec::fleet::WaveRecord, host: &str) -> (&'r str, Option<u64>) {
    match wave.promoted.iter().find(|p| p.host == host) {
        Some(p) => (&record.target, Some(p.at)),
        None => (&wave.good, None),
    }
}

/// How a host of the record's wave `wave` stands.
pub fn judge(inputs: &Inputs, record: &Record, wave: &specd_spec::fleet::WaveRecord, host: &str) -> Standing {
    let (rev, promoted_at) = given(record, wave, host);
    if let Some(why) = &inputs.evidence.unavailable {
        return Standing::NoEvidence(format!("no evidence: {why}"));
    }
    let Some(e) = inputs.evidence.hosts.get(host) else {
        return Standing::NoEvidence("no evidence: Prometheus has no specd_host_info for it (not scraped?)".into());
    };
    if let Some(why) = &e.down {
        return Standing::NoEvidence(format!("no evidence: {why}"));
    }
    let expected = match (inputs.expected)(host, rev) {
        Ok(units) => units,
        Err(why) if promoted_at.is_some() => {
            return Standing::Failed { gate: "spec", unit: String::new(), evidence: why };
        }
        Err(why) => return Standing::Unavailable(format!("its specs at {} do not resolve: {why}", short(rev))),
    };
    let Some(at) = promoted_at else {
        return match runs(e, rev, &expected, inputs.fleet.gates().args_verified) {
            Ok(()) => Standing::Good,
            Err(why) => Standing::Unavailable(why),
        };
    };
    let gates = inputs.fleet.gates();
    if let Some(f) = failed_on_target(e, record, &expected, gates) {
        return f;
    }
    let since = inputs.now.saturating_sub(at);
    if let Err(why) = runs(e, rev, &expected, gates.args_verified) {
        if since > gates.converge_within.as_secs() {
            let evidence =
                format!("given {} {since} s ago, within {} s: {why}", short(rev), gates.converge_within.as_secs());
            return Standing::Failed { gate: "converge", unit: String::new(), evidence };
        }
        return Standing::Applying(format!("applying {} for {since} s: {why}", short(rev)));
    }
    match speculation(e, &expected, gates) {
        Ok(()) => Standing::Good,
        Err((gate, unit, evidence)) if since > gates.converge_within.as_secs() => {
            Standing::Failed { gate, unit, evidence }
        }
        Err((_, unit, why)) => Standing::Applying(format!("{unit}: {why}")),
    }
}

/// Whether the host runs `rev`: its agent deploys it and every unit runs the unit rendered for
/// it, verified where the spec's args are checked and the fleet's `args_verified` gate is on.
fn runs(e: &HostEvidence, rev: &str, expected: &[ExpectedUnit], args_verified: bool) -> Result<(), String> {
    if e.revision.as_deref() != Some(rev) {
        let deployed = e.revision.as_deref().map_or("nothing yet".to_string(), |r| short(r).to_string());
        return Err(format!("its agent deploys {deployed}, not {}", short(rev)));
    }
    for x in expected {
        let u = e.units.get(&x.unit);
        match u.and_then(|u| u.unit_hash.as_deref()) {
            Some(h) if h == x.unit_hash => {}
            Some(h) => return Err(format!("{} runs unit {}, not {}", x.unit, short(h), short(&x.unit_hash))),
            None => return Err(format!("{} runs no verified unit", x.unit)),
        }
        if args_verified && u.and_then(|u| u.args_verified) == Some(false) {
            return Err(format!("{}: its args are not verified", x.unit));
        }
        if u.and_then(|u| u.taken) == Some(false) {
            return Err(format!("{}: its load balancers have not taken it back yet", x.unit));
        }
    }
    Ok(())
}

/// A gate the promoted host failed, whatever its convergence: a unit quarantined, a death, args
/// unverified during the bake, a start slower than its ceiling, an accept figure below its floor.
fn failed_on_target(
    e: &HostEvidence,
    record: &Record,
    expected: &[ExpectedUnit],
    gates: &specd_spec::fleet::Gates,
) -> Option<Standing> {
    let on_target = e.revision.as_deref() == Some(record.target.as_str());
    for x in expected {
        let Some(u) = e.units.get(&x.unit) else { continue };
        let fail = |gate, evidence| Some(Standing::Failed { gate, unit: x.unit.clone(), evidence });
        if gates.no_deaths && !u.deaths_since_promotion.is_empty() {
            let deaths: Vec<String> =
                u.deaths_since_promotion.iter().map(|(v, n)| format!("{v} ×{}", n.round())).collect();
            return fail("no_deaths", format!("died since its promotion: {}", deaths.join(", ")));
        }
        if on_target && u.quarantined {
            return fail(
                "applied",
                format!("{} failed to apply and is quarantined; the agent rolled it back", short(&record.target)),
            );
        }
        if gates.args_verified && u.verified_throughout == Some(false) {
            return fail("args_verified", "its args were not verified at every scrape of the bake".into());
        }
        let runs_it = u.unit_hash.as_deref() == Some(x.unit_hash.as_str());
        if let (true, Some(ceiling), Some(now)) = (runs_it && on_target, &gates.startup_within, u.start_seconds)
            && let Some(why) = ceiling.above(now, u.previous_start_seconds)
        {
            return fail("startup_within", why);
        }
        if !(x.speculates && runs_it && on_target) {
            continue;
        }
        let floors = [
            ("accept_length", &gates.accept_length, u.accept_length, u.previous_accept_length),
            ("accept_rate", &gates.accept_rate, u.accept_rate, u.previous_accept_rate),
        ];
        for (gate, floor, now, previous) in floors {
            if let (Some(floor), Some(now)) = (floor, now)
                && let Some(why) = floor.below(now, previous)
            {
                return fail(gate, why);
            }
        }
        if let (Some(pays), Some(now), Some(before)) = (&gates.speculation_pays, u.served, u.previous_served)
            && now.drafts >= pays.min_drafts as f64
            && let Some(why) = pays.below((now.accept_length, now.tok_s), (before.accept_length, before.tok_s))
        {
            return fail("speculation_pays", format!("{why}; over {} drafts", now.drafts));
        }
    }
    None
}

/// Whether every speculating unit has its speculation proven (an accept length measured) and,
/// where the previous revision's served figures are known, its own resting on enough drafts
/// for `speculation_pays` to judge: else the gate that waits, the unit and why.
fn speculation(
    e: &HostEvidence,
    expected: &[ExpectedUnit],
    gates: &specd_spec::fleet::Gates,
) -> Result<(), (&'static str, String, String)> {
    for x in expected.iter().filter(|x| x.speculates) {
        let u = e.units.get(&x.unit);
        if gates.speculation_proven && u.and_then(|u| u.accept_length).is_none() {
            let why = "no accept length measured yet (speculation not proven)";
            return Err(("speculation_proven", x.unit.clone(), why.into()));
        }
        if let (Some(pays), Some(u)) = (&gates.speculation_pays, u)
            && u.previous_served.is_some()
        {
            let drafts = u.served.map_or(0.0, |s| s.drafts);
            if drafts < pays.min_drafts as f64 {
                let why = format!("{drafts} drafts served on it yet; speculation_pays judges at {}", pays.min_drafts);
                return Err(("speculation_pays", x.unit.clone(), why));
            }
        }
    }
    Ok(())
}

/// The one next step of the rollout, or why it waits.
pub fn decide(inputs: &Inputs) -> Step {
    let head = inputs.head;
    let Some(record) = inputs.record else {
        let record = Record::adopt(inputs.fleet, head, inputs.now);
        let message = format!("fleet: adopt {} as released (the first promotion record)", short(head));
        return Step::Write { record: Box::new(record), message };
    };
    let names: Vec<&str> = inputs.fleet.waves().iter().map(|w| w.name.as_str()).collect();
    if record.waves.iter().map(|w| w.name.as_str()).ne(names.iter().copied()) {
        return Step::Write {
            record: Box::new(rewaved(record, &names)),
            message: format!("fleet: the waves are now {}", names.join(", ")),
        };
    }
    if record.target != head {
        if record.state == RolloutState::Halted && record.halt.as_ref().is_some_and(|h| h.gate == MANUAL) {
            let by = record.halt.as_ref().map_or("?", |h| h.by.as_str());
            return wait(format!("halted by {by} (a new revision waits too): `specd fleet resume` continues"));
        }
        // The halted rollout's hosts still on its target go back first, within their wave's
        // budget: a new rollout would send them all back at once.
        if let Some(step) = sending_back(inputs, record) {
            return step;
        }
        return Step::Write {
            record: Box::new(started(record, head, inputs.now)),
            message: started_message(record, head),
        };
    }
    match record.state {
        RolloutState::Halted => return sending_back(inputs, record).unwrap_or_else(|| wait(halted_why(record))),
        RolloutState::Complete => return wait(format!("{} is released to every wave", short(&record.target))),
        RolloutState::Progressing => {}
    }
    let Some(i) = record.waves.iter().position(|w| w.baked.is_none()) else {
        let mut r = record.clone();
        r.state = RolloutState::Complete;
        r.released = r.target.clone();
        let message = format!("fleet: {} is released: every wave passed", short(&r.target));
        return Step::Write { record: Box::new(r), message };
    };
    if let Some(why) = &inputs.evidence.unavailable {
        return wait(format!("no evidence, nothing advances: {why}"));
    }
    if !inputs.evidence.unidentified.is_empty() {
        return wait(format!(
            "no evidence, nothing advances: scrape targets of the agents are down and never said which host they are (any wave's): {}",
            inputs.evidence.unidentified.join(", ")
        ));
    }
    wave_step(inputs, record, i)
}

/// The `gate` of a halt made by a person.
pub const MANUAL: &str = "manual";

fn wait(why: String) -> Step {
    Step::Wait { why, until: None, soon: false }
}

/// A wait for the wave's hosts that are not good; `soon` when one of them is on its way: it
/// applies what it was given, or runs another revision than the one it was given (going back).
fn waits_for(why: String, waiting: &[&(String, Standing)]) -> Step {
    let soon = waiting.iter().any(|(_, s)| matches!(s, Standing::Applying(_) | Standing::Unavailable(_)));
    Step::Wait { why, until: None, soon }
}

/// The step of the wave in progress (`i`).
fn wave_step(inputs: &Inputs, record: &Record, i: usize) -> Step {
    let spec = &inputs.fleet.waves()[i];
    let w = &record.waves[i];
    let hosts = members(inputs.fleet, inputs.evidence, i);
    if hosts.is_empty() {
        // Its hosts may exist unseen (their scrape job gone, or not scraped within the hour):
        // passing it would give them the target all at once, unbaked.
        return wait(format!(
            "wave {} selects no host Prometheus knows (are its agents scraped?); a wave meant to be empty is removed from the fleet file",
            w.name
        ));
    }
    let standings: Vec<(String, Standing)> = hosts.iter().map(|h| (h.clone(), judge(inputs, record, w, h))).collect();
    if let Some((host, Standing::Failed { gate, unit, evidence })) =
        standings.iter().find(|(_, s)| matches!(s, Standing::Failed { .. }))
    {
        return halt(inputs, record, i, host, unit, gate, evidence);
    }
    let promoted = |h: &str| w.promoted.iter().any(|p| p.host == h);
    let waiting: Vec<&(String, Standing)> = standings.iter().filter(|(_, s)| s.unavailable()).collect();
    let listed =
        |v: &[&(String, Standing)]| v.iter().map(|(h, s)| format!("{h} ({})", s.why())).collect::<Vec<_>>().join("; ");
    let candidates: Vec<&String> =
        standings.iter().filter(|(h, s)| !promoted(h) && *s == Standing::Good).map(|(h, _)| h).collect();
    let unpromoted: Vec<&String> = hosts.iter().filter(|h| !promoted(h)).collect();
    if w.converged.is_some() && (!unpromoted.is_empty() || !waiting.is_empty()) {
        // Every host must stay good for the whole bake: one that is not, or one that joined the
        // wave since, starts it again once all are good.
        let why = if waiting.is_empty() {
            format!("{} joined it", unpromoted.iter().map(|h| h.as_str()).collect::<Vec<_>>().join(", "))
        } else {
            listed(&waiting)
        };
        let mut r = record.clone();
        r.waves[i].converged = None;
        let message = format!("fleet: wave {} bakes again once every host is good: {why}", w.name);
        return Step::Write { record: Box::new(r), message };
    }
    if !unpromoted.is_empty() {
        let room = (spec.max_unavailable as usize).saturating_sub(waiting.len());
        if room == 0 || candidates.is_empty() {
            let (n, most) = (waiting.len(), spec.max_unavailable);
            let why = format!("wave {}: {n} of {} hosts unavailable (max_unavailable {most}): ", w.name, hosts.len());
            return waits_for(why + &listed(&waiting), &waiting);
        }
        let chosen: Vec<String> = candidates.into_iter().take(room).cloned().collect();
        let mut r = record.clone();
        r.waves[i].promoted.extend(chosen.iter().map(|h| Promoted { host: h.clone(), at: inputs.now }));
        let done = r.waves[i].promoted.len();
        let message = format!(
            "fleet: promote {} to {} (wave {}, {done} of {} hosts)",
            short(&record.target),
            chosen.join(", "),
            w.name,
            hosts.len()
        );
        return Step::Write { record: Box::new(r), message };
    }
    if !waiting.is_empty() {
        return waits_for(format!("wave {} waits for {}", w.name, listed(&waiting)), &waiting);
    }
    let Some(converged) = w.converged else {
        let mut r = record.clone();
        r.waves[i].converged = Some(inputs.now);
        let message = format!(
            "fleet: wave {} runs {} on all {} hosts; it bakes {} s",
            w.name,
            short(&record.target),
            hosts.len(),
            spec.bake.as_secs()
        );
        return Step::Write { record: Box::new(r), message };
    };
    // Times are whole seconds: every host was good at some moment of the second `converged`,
    // so the bake passes only once a whole second after `converged + bake` has begun — never
    // shorter than asked, at most a second longer.
    let until = converged + spec.bake.as_secs() + 1;
    if inputs.now < until {
        let why = format!("wave {} bakes until {} ({} s left)", w.name, stamp(until), until - inputs.now);
        return Step::Wait { why, until: Some(until), soon: false };
    }
    let mut r = record.clone();
    let wr = &mut r.waves[i];
    wr.baked = Some(inputs.now);
    wr.good = record.target.clone();
    wr.promoted.clear();
    let next = inputs
        .fleet
        .waves()
        .get(i + 1)
        .map_or("the rollout completes".to_string(), |n| format!("wave {} is next", n.name));
    let message =
        format!("fleet: wave {} baked {} s on {}; {next}", w.name, spec.bake.as_secs(), short(&record.target));
    Step::Write { record: Box::new(r), message }
}

/// The halt of a failed gate: the failing host goes back to its wave's good revision now; the
/// wave's other promoted hosts stay on the target and go back in the next steps, as many at a
/// time as the wave's `max_unavailable` leaves room for ([`sending_back`]).
fn halt(inputs: &Inputs, record: &Record, i: usize, host: &str, unit: &str, gate: &str, evidence: &str) -> Step {
    let mut r = record.clone();
    r.state = RolloutState::Halted;
    let w = &mut r.waves[i];
    let back: Vec<String> = w.promoted.iter().filter(|p| p.host == host).map(|p| p.host.clone()).collect();
    w.promoted.retain(|p| p.host != host);
    let later: Vec<&str> = w.promoted.iter().map(|p| p.host.as_str()).collect();
    w.converged = None;
    r.halt = Some(Halt {
        at: inputs.now,
        by: "promoter".into(),
        wave: w.name.clone(),
        host: host.into(),
        unit: unit.into(),
        gate: gate.into(),
        evidence: evidence.into(),
    });
    let on = if unit.is_empty() { host.to_string() } else { format!("{host} {unit}") };
    let then = if later.is_empty() {
        String::new()
    } else {
        format!("; then {}, within max_unavailable {}", later.join(", "), inputs.fleet.waves()[i].max_unavailable)
    };
    let message = format!(
        "fleet: halt {} at wave {}: {on} failed gate {gate}\n\n{evidence}\n\nBack to {}: {}{then}.",
        short(&record.target),
        w.name,
        short(&w.good),
        if back.is_empty() { "no host had taken it".to_string() } else { back.join(", ") }
    );
    Step::Write { record: Box::new(r), message }
}

/// The step of a rollout halted by a failed gate whose wave still has hosts on the target:
/// they go back to the wave's good revision, as many at a time as its `max_unavailable` leaves
/// room for. A host of the wave that is not good counts as unavailable — one down, one applying
/// either revision, one still on its way back; a promoted host that is not good goes back at
/// once, as it is unavailable already. The halt stays as it was written. `None`: the rollout is
/// not halted by a gate, or no host of the halted wave is left on the target.
fn sending_back(inputs: &Inputs, record: &Record) -> Option<Step> {
    let h = record.halt.as_ref().filter(|h| record.state == RolloutState::Halted && h.gate != MANUAL)?;
    let i = record.waves.iter().position(|w| w.name == h.wave && !w.promoted.is_empty())?;
    let spec = inputs.fleet.waves().iter().find(|w| w.name == h.wave)?;
    let w = &record.waves[i];
    let halted = failed_gate(h);
    let on_target: Vec<&str> = w.promoted.iter().map(|p| p.host.as_str()).collect();
    let newer = if record.target == inputs.head {
        String::new()
    } else {
        format!("; the rollout of {} starts once they are back", short(inputs.head))
    };
    if let Some(why) = &inputs.evidence.unavailable {
        return Some(wait(format!(
            "{halted}; {} go back to {} once there is evidence{newer}: no evidence: {why}",
            on_target.join(", "),
            short(&w.good)
        )));
    }
    // The wave's hosts, and any host on the target that no longer is one (counted all the same).
    let mut hosts = members(inputs.fleet, inputs.evidence, i);
    let gone: Vec<String> =
        on_target.iter().filter(|h| !hosts.iter().any(|m| m == *h)).map(|h| h.to_string()).collect();
    hosts.extend(gone);
    let standings: Vec<(String, Standing)> = hosts.iter().map(|h| (h.clone(), judge(inputs, record, w, h))).collect();
    let good = |host: &str| standings.iter().any(|(h, s)| h == host && *s == Standing::Good);
    let unavailable: Vec<&(String, Standing)> = standings.iter().filter(|(_, s)| s.unavailable()).collect();
    // A down target of the agents' job that never said its host name may be one of the wave's.
    let unknown = &inputs.evidence.unidentified;
    let room = (spec.max_unavailable as usize).saturating_sub(unavailable.len() + unknown.len());
    let mut back: Vec<&str> = on_target.iter().copied().filter(|h| !good(h)).collect();
    back.extend(on_target.iter().copied().filter(|h| good(h)).take(room));
    if back.is_empty() {
        let mut listed: Vec<String> = unavailable.iter().map(|(h, s)| format!("{h} ({})", s.why())).collect();
        listed.extend(unknown.iter().map(|t| format!("{t} (down, never said which host it is)")));
        let why = format!(
            "{halted}; {} go back to {} as max_unavailable {} allows: {} of {} hosts of wave {} unavailable: {}{newer}",
            on_target.join(", "),
            short(&w.good),
            spec.max_unavailable,
            listed.len(),
            standings.len() + unknown.len(),
            w.name,
            listed.join("; ")
        );
        return Some(waits_for(why, &unavailable));
    }
    let mut r = record.clone();
    r.waves[i].promoted.retain(|p| !back.contains(&p.host.as_str()));
    let left: Vec<&str> = r.waves[i].promoted.iter().map(|p| p.host.as_str()).collect();
    let rest = if left.is_empty() {
        format!("every host of wave {} is given it again", w.name)
    } else {
        format!("{} still on {}", left.join(", "), short(&record.target))
    };
    let message = format!(
        "fleet: send {} back to {} (wave {}, halted: {} failed gate {}); {rest}",
        back.join(", "),
        short(&w.good),
        w.name,
        h.host,
        h.gate
    );
    Some(Step::Write { record: Box::new(r), message })
}

/// A new rollout of `head`: every wave starts again from its good revision (a wave that baked
/// the previous target keeps it as good; a host that took it without its wave baking goes back).
fn started(record: &Record, head: &str, now: u64) -> Record {
    let mut r = record.clone();
    r.target = head.into();
    r.state = RolloutState::Progressing;
    r.started = now;
    r.halt = None;
    for w in &mut r.waves {
        w.promoted.clear();
        w.converged = None;
        w.baked = None;
    }
    r
}

fn started_message(record: &Record, head: &str) -> String {
    let before = match record.state {
        RolloutState::Progressing => format!("; it supersedes the rollout of {} in progress", short(&record.target)),
        RolloutState::Halted => format!("; the rollout of {} was halted", short(&record.target)),
        RolloutState::Complete => String::new(),
    };
    format!("fleet: roll out {}{before}", short(head))
}

/// The record with the fleet file's waves, in its order: a wave it knew keeps its place in the
/// rollout, a new one starts on the released revision.
fn rewaved(record: &Record, names: &[&str]) -> Record {
    let mut r = record.clone();
    r.waves = names
        .iter()
        .map(|n| record.wave(n).cloned().unwrap_or_else(|| specd_spec::fleet::WaveRecord::at(n, &record.released)))
        .collect();
    r
}

/// Why a halted rollout waits.
pub fn halted_why(record: &Record) -> String {
    let Some(h) = &record.halt else { return "halted".into() };
    if h.gate == MANUAL {
        return format!("halted by {} at {}: {} (`specd fleet resume` continues)", h.by, stamp(h.at), h.evidence);
    }
    format!("{} (a new revision starts a new rollout; `specd fleet resume` retries this one)", failed_gate(h))
}

/// Where and why a failed gate halted the rollout.
fn failed_gate(h: &Halt) -> String {
    let on = if h.unit.is_empty() { h.host.clone() } else { format!("{} {}", h.host, h.unit) };
    format!("halted at wave {} at {}: {on} failed gate {}: {}", h.wave, stamp(h.at), h.gate, h.evidence)
}

/// A person halts the rollout: nothing advances, new revisions included, until a resume.
/// Hosts stay where they are.
pub fn halted_by(record: &Record, person: &str, reason: &str, now: u64) -> Result<Step, String> {
    if record.state == RolloutState::Halted {
        return Err(halted_why(record));
    }
    let mut r = record.clone();
    r.state = RolloutState::Halted;
    let wave = r.waves.iter().find(|w| w.baked.is_none()).map(|w| w.name.clone()).unwrap_or_default();
    r.halt = Some(Halt {
        at: now,
        by: person.into(),
        wave,
        host: String::new(),
        unit: String::new(),
        gate: MANUAL.into(),
        evidence: reason.into(),
    });
    Ok(Step::Write { record: Box::new(r), message: format!("fleet: halted by {person}: {reason}") })
}

/// A person resumes a halted rollout: the wave that halted promotes again from the start (its
/// hosts not sent back yet keep the target).
pub fn resumed(record: &Record, person: &str) -> Result<Step, String> {
    if record.state != RolloutState::Halted {
        return Err(format!("the rollout of {} is not halted", short(&record.target)));
    }
    let mut r = record.clone();
    let all_baked = r.waves.iter().all(|w| w.baked.is_some());
    r.state = if all_baked { RolloutState::Complete } else { RolloutState::Progressing };
    if all_baked {
        // Halted between the last bake and the release: released now, as the release would.
        r.released = r.target.clone();
    }
    r.halt = None;
    Ok(Step::Write {
        record: Box::new(r),
        message: format!("fleet: resumed by {person}: {} rolls on", short(&record.target)),
    })
}

/// UTC time of unix seconds, as the records and messages print it.
pub fn stamp(secs: u64) -> String {
    let (y, mo, d, h, mi, s) = specd_spec::utc(secs);
    format!("{y:04}-{mo:02}-{d:02} {h:02}:{mi:02}:{s:02} UTC")
}

/// One host of the fleet, as `specd fleet status` shows it.
#[derive(Clone, Debug, PartialEq)]
pub struct HostPosition {
    pub host: String,
    /// Its wave; `None`: no wave selects it (it runs the released revision).
    pub wave: Option<String>,
    /// The revision the record gives it, and whether that is the rollout's target.
    pub given: String,
    pub promoted: bool,
    pub standing: Standing,
}

/// Every host the fleet file names or Prometheus knows, with what the record gives it and how it
/// stands, wave by wave (hosts in no wave last).
pub fn positions(inputs: &Inputs, record: &Record) -> Vec<HostPosition> {
    let mut out = Vec::new();
    for (i, w) in record.waves.iter().enumerate().take(inputs.fleet.waves().len()) {
        // The wave's hosts as the evidence knows them, and those the record promoted in it
        // (known without Prometheus: a host selected by labels is in no evidence while it is down).
        let mut hosts = members(inputs.fleet, inputs.evidence, i);
        hosts.extend(
            w.promoted
                .iter()
                .map(|p| p.host.clone())
                .filter(|h| inputs.evidence.hosts.get(h).is_none_or(|e| inputs.fleet.wave_of(h, &e.labels) == Some(i))),
        );
        hosts.sort();
        hosts.dedup();
        for host in hosts {
            let (given, at) = given(record, w, &host);
            let standing = judge(inputs, record, w, &host);
            out.push(HostPosition {
                wave: Some(w.name.clone()),
                given: given.into(),
                promoted: at.is_some(),
                standing,
                host,
            });
        }
    }
    let released = specd_spec::fleet::WaveRecord::at("", &record.released);
    for (host, e) in &inputs.evidence.hosts {
        if inputs.fleet.wave_of(host, &e.labels).is_none() {
            let standing = judge(inputs, record, &released, host);
            out.push(HostPosition {
                host: host.clone(),
                wave: None,
                given: record.released.clone(),
                promoted: false,
                standing,
            });
        }
    }
    out
}

impl Standing {
    /// One word for a table.
    pub fn word(&self) -> &'static str {
        match self {
            Standing::Good => "good",
            Standing::Applying(_) => "applying",
            Standing::Unavailable(_) => "unavailable",
            Standing::NoEvidence(_) => "no-evidence",
            Standing::Failed { .. } => "failed",
        }
    }

    /// The words behind it (empty when good).
    pub fn detail(&self) -> String {
        if *self == Standing::Good { String::new() } else { self.why() }
    }
}

#[cfg(test)]
mod tests;
