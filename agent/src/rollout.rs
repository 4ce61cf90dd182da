//! The promoter's decisions, pure: given the fleet file, the promotion record, the followed
//! branch's head, the evidence (what Prometheus says each host runs and measured) and the
//! time, the one next step of a rollout — or why it waits. `specd promote` gathers the inputs,
//! calls [`decide`], writes the step as one commit; `specd fleet status` narrates [`positions`].

use std::collections::BTreeMap;

use specd_spec::fleet::{ParsedFleet, Record};

/// What Prometheus says about the fleet, now (and at the moments a rollout needs).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Evidence {
    /// Why there is no evidence at all (Prometheus unreachable, a query refused); then nothing
    /// advances.
    pub unavailable: Option<String>,
    /// Every host an agent reports (`specd_host_info`), by host name.
    pub hosts: BTreeMap<String, HostEvidence>,
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
    /// Deaths since the host was promoted, by verdict (`increase(specd_unit_deaths_total[…])`).
    pub deaths_since_promotion: BTreeMap<String, f64>,
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
