//! The promoter's word to the agents a step moved: `POST /poll` on each one's endpoint (its
//! scrape URL with `/metrics` → `/poll`, from Prometheus's targets), so that it polls its remote
//! now rather than at the end of its interval. Only a wake-up: the agent reads the record itself
//! and verifies it as at any poll. Best effort: an agent that is not reached polls at its
//! interval as always, and nothing the promoter decides waits on it.

use std::collections::BTreeMap;
use std::time::Duration;

use specd_spec::fleet::{ParsedFleet, Record};

use crate::fleet::prometheus::Prometheus;
use crate::fleet::rollout::HostEvidence;

/// A scrape target: its `job` and `instance` labels.
pub type Target = (String, String);

/// One agent's wake-up is answered within this, or it counts as not reached.
pub const WAKE_WITHIN: Duration = Duration::from_secs(2);

/// Wake-ups in flight at once.
const AT_ONCE: usize = 64;

/// The hosts reached and not: a step's wake-ups.
#[derive(Debug, Default, PartialEq)]
pub struct Woken {
    /// The hosts the step moved that answer their scrapes (a host that does not is not asked).
    pub asked: usize,
    pub answered: usize,
    /// The first few not reached, with why (`h0003: connection refused`).
    pub unreached: Vec<String>,
}

/// The hosts (of `hosts`, that answer their scrapes) whose revision the record `new` gives
/// differs from the one `old` gave; every one for the first record (before it, each waits for
/// one). Each with its scrape target.
pub fn moved(
    fleet: &ParsedFleet,
    old: Option<&Record>,
    new: &Record,
    hosts: &BTreeMap<String, HostEvidence>,
) -> Vec<(String, Target)> {
    let given = |r: &Record, h: &str, e: &HostEvidence| r.revision_for(fleet, h, &e.labels).ok().map(|a| a.revision);
    hosts
        .iter()
        .filter(|(_, e)| e.down.is_none())
        .filter(|(h, e)| {
            let before = old.and_then(|r| given(r, h, e));
            before.is_none() || before != given(new, h, e)
        })
        .map(|(h, e)| (h.clone(), e.target.clone()))
        .collect()
}

/// The agent's wake-up URL from its scrape URL: the last path segment `poll` instead of
/// `metrics`; `None` for a scrape URL that does not end in `/metrics`.
fn poll_url(scrape: &str) -> Option<String> {
    let (path, query) = scrape.split_once('?').map_or((scrape, None), |(p, q)| (p, Some(q)));
    let base = path.strip_suffix("/metrics")?;
    Some(format!("{base}/poll{}", query.map(|q| format!("?{q}")).unwrap_or_default()))
}

/// Wakes the agents of `hosts` (names and scrape targets), found by Prometheus's targets. An
/// error: Prometheus did not say.
pub async fn wake(p: &Prometheus, hosts: &[(String, Target)]) -> Result<Woken, String> {
    if hosts.is_empty() {
        return Ok(Woken::default());
    }
    let targets = p.targets().await?;
    let mut urls = Vec::new();
    let mut unreached = Vec::new();
    for (h, t) in hosts {
        match targets.get(t).map(|u| poll_url(u).ok_or(u)) {
            Some(Ok(url)) => urls.push((h.clone(), url)),
            Some(Err(u)) => unreached.push(format!("{h}: its scrape URL {u} does not end in /metrics")),
            None => unreached.push(format!("{h}: not among Prometheus's active targets")),
        }
    }
    let client = reqwest::Client::builder()
        .timeout(WAKE_WITHIN)
        .connect_timeout(WAKE_WITHIN)
        .build()
        .map_err(|e| format!("an HTTP client: {e}"))?;
    let asked = hosts.len();
    let mut answered = 0;
    let outcomes = super::at_most(AT_ONCE, urls, |(h, url)| {
        let c = client.clone();
        async move {
            let r = c.post(&url).send().await.map_err(|e| e.to_string());
            let ok = r.and_then(|r| r.status().is_success().then_some(()).ok_or(format!("{url}: {}", r.status())));
            (h, ok)
        }
    })
    .await;
    for o in outcomes {
        match o {
            Some((_, Ok(()))) => answered += 1,
            Some((h, Err(why))) => unreached.push(format!("{h}: {why}")),
            None => unreached.push("a wake-up: its task failed".into()),
        }
    }
    unreached.sort();
    unreached.truncate(5);
    Ok(Woken { asked, answered, unreached })
}

#[cfg(test)]
mod tests {
    use super::*;
    use specd_spec::fleet::{Promoted, RolloutState};

    #[test]
    fn the_poll_url_is_the_scrape_url_s_with_poll_for_metrics() {
        assert_eq!(poll_url("http://10.0.0.1:9101/metrics").unwrap(), "http://10.0.0.1:9101/poll");
        assert_eq!(poll_url("https://a:1/h/7/metrics?x=1").unwrap(), "https://a:1/h/7/poll?x=1");
        assert_eq!(poll_url("http://a:1/federate"), None);
    }

    #[test]
    fn a_step_moves_the_hosts_it_promotes_or_sends_back_and_no_other() {
        let fleet = specd_spec::fleet::parse_fleet(
            "apiVersion: specd/v1\nkind: Fleet\nmetadata: {name: f}\nspec:\n  waves:\n    - {name: canary, hosts: [a, b]}\n    - {name: rest, hosts: ['*']}\n",
            "fleet.yaml",
        )
        .unwrap();
        let host = |down: bool| HostEvidence { down: down.then(|| "its agent is down".into()), ..Default::default() };
        let hosts: BTreeMap<String, HostEvidence> =
            [("a", host(false)), ("b", host(false)), ("c", host(false)), ("d", host(true))]
                .map(|(h, e)| (h.to_string(), e))
                .into();
        let r0 = Record::adopt(&fleet, "r1", 0);
        // The first record: every host waited for one (not d: down).
        let moved = |old: Option<&Record>, new: &Record| -> Vec<String> {
            moved(&fleet, old, new, &hosts).into_iter().map(|(h, _)| h).collect()
        };
        assert_eq!(moved(None, &r0), ["a", "b", "c"]);
        let r1 = rollout_to(&r0, "r2", &["a"]);
        assert_eq!(moved(Some(&r0), &r1), ["a"]);
        let r2 = rollout_to(&r0, "r2", &["a", "b"]);
        assert_eq!(moved(Some(&r1), &r2), ["b"]);
        // Sent back: a and b again.
        assert_eq!(moved(Some(&r2), &r0), ["a", "b"]);
        // Released: c moves (its wave's good revision); d is down and not asked.
        assert_eq!(moved(Some(&r2), &Record::adopt(&fleet, "r2", 0)), ["c"]);
    }

    /// `base` with a rollout to `target` that promoted `hosts` in the canary.
    fn rollout_to(base: &Record, target: &str, hosts: &[&str]) -> Record {
        let mut r = base.clone();
        r.target = target.into();
        r.state = RolloutState::Progressing;
        r.waves[0].promoted = hosts.iter().map(|h| Promoted { host: h.to_string(), at: 100 }).collect();
        r
    }
}
