//! What `specd fleet status` prints: the rollout's position, one line per wave (how many of its
//! hosts were given the target and how they stand), then hosts with their units. A fleet of
//! [`TABLE_UP_TO`] hosts or fewer lists every host's units; a larger one lists the hosts that
//! are not good, at most [`NOT_GOOD_SHOWN`] per wave, so that a thousand hosts read in a
//! screen; `--host NAME` lists the named hosts' units whatever the size. The JSON has the same
//! summary (`waves`) and every host (or those named).

use anyhow::{Result, bail};
use serde_json::json;
use specd_spec::fleet::{Record, RolloutState};
use specd_spec::short;

use crate::fleet::rollout::{self, Evidence, HostPosition, Standing};

/// The most hosts whose units are all listed without `--host`.
pub const TABLE_UP_TO: usize = 20;
/// The most hosts listed per wave that are not good, above [`TABLE_UP_TO`].
pub const NOT_GOOD_SHOWN: usize = 10;

/// What `specd fleet status` shows.
pub struct View<'a> {
    pub record: &'a Record,
    /// What the rollout waits for (or the promoter's next step), and until when.
    pub position: &'a (String, Option<u64>),
    pub hosts: &'a [HostPosition],
    pub evidence: &'a Evidence,
    /// The hosts `--host` names (none: no choice).
    pub only: &'a [String],
}

/// One wave, counted: its hosts, how many were given the target, and how many stand how.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct WaveCount {
    pub wave: String,
    pub hosts: usize,
    pub promoted: usize,
    pub good: usize,
    pub applying: usize,
    pub unavailable: usize,
    pub no_evidence: usize,
    pub failed: usize,
}

/// A host's wave as printed: `(none)` for a host no wave selects.
fn wave_name(h: &HostPosition) -> &str {
    h.wave.as_deref().unwrap_or("(none)")
}

impl View<'_> {
    /// The waves in their order (hosts in no wave last), counted.
    pub fn waves(&self) -> Vec<WaveCount> {
        let mut out: Vec<WaveCount> = Vec::new();
        for h in self.hosts {
            let name = wave_name(h);
            let i = match out.iter().position(|w| w.wave == name) {
                Some(i) => i,
                None => {
                    out.push(WaveCount { wave: name.to_string(), ..Default::default() });
                    out.len() - 1
                }
            };
            let w = &mut out[i];
            w.hosts += 1;
            w.promoted += usize::from(h.promoted);
            match h.standing {
                Standing::Good => w.good += 1,
                Standing::Applying(_) => w.applying += 1,
                Standing::Unavailable(_) => w.unavailable += 1,
                Standing::NoEvidence(_) => w.no_evidence += 1,
                Standing::Failed { .. } => w.failed += 1,
            }
        }
        out
    }

    /// The hosts `--host` names, in the fleet's order; an error names one the fleet lacks.
    fn named(&self) -> Result<Vec<&HostPosition>> {
        for n in self.only {
            if !self.hosts.iter().any(|h| h.host == *n) {
                bail!("no host {n} in the fleet: neither the fleet file nor the record nor Prometheus knows it");
            }
        }
        Ok(self.hosts.iter().filter(|h| self.only.is_empty() || self.only.contains(&h.host)).collect())
    }

    pub fn json(&self) -> Result<serde_json::Value> {
        let (record, ev) = (self.record, self.evidence);
        let hosts: Vec<_> = self.named()?.into_iter().map(|h| host_json(h, ev)).collect();
        Ok(json!({
            "rollout": {"target": record.target, "released": record.released, "state": record.state,
                        "started": record.started, "halt": record.halt, "waits": self.position.0,
                        "until": self.position.1},
            "evidence": ev.unavailable,
            "waves": self.waves(),
            "hosts": hosts,
        }))
    }

    pub fn text(&self) -> Result<String> {
        let mut s = self.head();
        s.push_str(&format!(
            "\n{:<12} {:>6} {:>9} {:>6} {:>9} {:>12} {:>12} {:>7}\n",
            "WAVE", "HOSTS", "PROMOTED", "GOOD", "APPLYING", "UNAVAILABLE", "NO-EVIDENCE", "FAILED"
        ));
        for w in self.waves() {
            s.push_str(&format!(
                "{:<12} {:>6} {:>9} {:>6} {:>9} {:>12} {:>12} {:>7}\n",
                w.wave, w.hosts, w.promoted, w.good, w.applying, w.unavailable, w.no_evidence, w.failed
            ));
        }
        if !self.only.is_empty() || self.hosts.len() <= TABLE_UP_TO {
            s.push_str(&host_table(&self.named()?, self.evidence));
        } else {
            s.push_str(&self.not_good());
        }
        if self.record.state == RolloutState::Halted {
            s.push_str(&format!("\n{}\n", rollout::halted_why(self.record)));
        }
        Ok(s)
    }

    /// The rollout's first lines: its target, state, release, position; the evidence missing.
    fn head(&self) -> String {
        let record = self.record;
        let state = match record.state {
            RolloutState::Progressing => "progressing",
            RolloutState::Complete => "complete",
            RolloutState::Halted => "HALTED",
        };
        let mut s = format!(
            "rollout of {} {state} (started {}), released {}\n  {}\n",
            short(&record.target),
            rollout::stamp(record.started),
            short(&record.released),
            self.position.0
        );
        if let Some(why) = &self.evidence.unavailable {
            s.push_str(&format!("  evidence: none ({why})\n"));
            s.push_str(
                "  hosts listed: those the fleet file names and those the record promoted; hosts a wave selects by labels or a pattern are known only to Prometheus\n",
            );
        }
        s
    }

    /// The hosts that are not good, at most [`NOT_GOOD_SHOWN`] per wave (the failed first), one
    /// line each.
    fn not_good(&self) -> String {
        let mut s = String::new();
        for w in self.waves() {
            let mut bad: Vec<&HostPosition> =
                self.hosts.iter().filter(|h| wave_name(h) == w.wave && h.standing != Standing::Good).collect();
            // The worst first: a failed gate, then no evidence, then the others.
            bad.sort_by_key(|h| match h.standing {
                Standing::Failed { .. } => 0,
                Standing::NoEvidence(_) => 1,
                _ => 2,
            });
            if bad.is_empty() {
                continue;
            }
            s.push_str(&format!("\nwave {}: {} of {} hosts not good\n", w.wave, bad.len(), w.hosts));
            for h in bad.iter().take(NOT_GOOD_SHOWN) {
                s.push_str(&format!("  {:<16} {:<12} {}\n", h.host, h.standing.word(), h.standing.detail()));
            }
            if bad.len() > NOT_GOOD_SHOWN {
                s.push_str(&format!("  … and {} more (`--json` lists every host)\n", bad.len() - NOT_GOOD_SHOWN));
            }
        }
        s.push_str("\n`specd fleet status --host NAME` lists a host's units.\n");
        s
    }
}

fn host_json(h: &HostPosition, ev: &Evidence) -> serde_json::Value {
    let e = ev.hosts.get(&h.host);
    let units: Vec<_> = e
        .map(|e| {
            e.units
                .iter()
                .map(|(u, x)| {
                    json!({"unit": u, "unit_hash": x.unit_hash, "args_verified": x.args_verified,
                           "quarantined": x.quarantined, "accept_length": x.accept_length,
                           "accept_rate": x.accept_rate, "deaths_since_promotion": x.deaths_since_promotion,
                           "last_death": x.last_death, "hold": x.hold, "serving": x.serving})
                })
                .collect()
        })
        .unwrap_or_default();
    json!({"host": h.host, "wave": h.wave, "given": h.given, "promoted": h.promoted,
           "deploys": e.and_then(|e| e.revision.clone()), "standing": h.standing.word(),
           "detail": h.standing.detail(), "units": units})
}

fn row(cells: [&str; 12]) -> String {
    let [host, wave, given, deploys, standing, unit, serving, verified, accept, deaths, last, hold] = cells;
    format!(
        "{host:<16} {wave:<10} {given:<14} {deploys:<14} {standing:<12} {unit:<22} {serving:<7} {verified:<9} {accept:<7} {deaths:<14} {last:<12} {hold}\n"
    )
}

/// Every unit of `hosts`, a row each, and why a host is not good under its rows.
fn host_table(hosts: &[&HostPosition], ev: &Evidence) -> String {
    let mut s = String::from("\n");
    s.push_str(&row([
        "HOST",
        "WAVE",
        "GIVEN",
        "DEPLOYS",
        "STANDING",
        "UNIT",
        "SERVING",
        "VERIFIED",
        "ACCEPT",
        "DIED SINCE",
        "LAST DEATH",
        "HOLD",
    ]));
    for h in hosts {
        let e = ev.hosts.get(&h.host);
        let given = format!("{}{}", short(&h.given), if h.promoted { "*" } else { "" });
        let deploys = e.and_then(|e| e.revision.as_deref()).map_or("-", short).to_string();
        let head = |(unit, serving): (&str, &str), v: &str, a: &str, d: &str, l: &str, hold: &str| {
            row([&h.host, wave_name(h), &given, &deploys, h.standing.word(), unit, serving, v, a, d, l, hold])
        };
        let units: Vec<_> = e.map(|e| e.units.iter().collect()).unwrap_or_default();
        if units.is_empty() {
            s.push_str(&head(("-", "-"), "-", "-", "-", "-", "-"));
        }
        for (u, x) in units {
            let verified = match x.args_verified {
                Some(true) => "yes",
                Some(false) => "NO",
                None => "-",
            };
            let accept = x.accept_length.map_or("-".to_string(), |a| format!("{a:.2}"));
            let deaths = if x.deaths_since_promotion.is_empty() {
                "-".to_string()
            } else {
                x.deaths_since_promotion.keys().cloned().collect::<Vec<_>>().join(",")
            };
            let last = x.last_death.as_deref().unwrap_or("-");
            let serving = x.serving.as_deref().unwrap_or("-");
            s.push_str(&head((u, serving), verified, &accept, &deaths, last, x.hold.as_deref().unwrap_or("-")));
        }
        let detail = h.standing.detail();
        if !detail.is_empty() {
            s.push_str(&format!("    {detail}\n"));
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` hosts in waves canary (1), early (9 %), rest; in rest, every tenth host applying and
    /// one failed.
    fn fleet(n: usize) -> Vec<HostPosition> {
        (0..n)
            .map(|i| {
                let wave = if i == 0 {
                    "canary"
                } else if i <= n * 9 / 100 {
                    "early"
                } else {
                    "rest"
                };
                let standing = match i {
                    _ if wave != "rest" => Standing::Good,
                    _ if i == n / 2 + 7 => {
                        Standing::Failed { gate: "applied", unit: "llm.service".into(), evidence: "q".into() }
                    }
                    _ if i % 10 == 0 => Standing::Applying("applying".into()),
                    _ => Standing::Good,
                };
                HostPosition {
                    host: format!("h{i:04}"),
                    wave: Some(wave.into()),
                    given: "a".repeat(40),
                    promoted: wave != "rest" || i % 2 == 0,
                    standing,
                }
            })
            .collect()
    }

    fn text(hosts: &[HostPosition], only: &[String]) -> Result<String> {
        let record = Record { target: "a".repeat(40), released: "b".repeat(40), ..Default::default() };
        let position = ("wave rest waits".to_string(), None);
        View { record: &record, position: &position, hosts, evidence: &Evidence::default(), only }.text()
    }

    #[test]
    fn a_thousand_hosts_read_in_a_screen_as_ten_do_and_a_host_is_shown_when_named() {
        let (small, large) = (fleet(10), fleet(1000));
        let small_text = text(&small, &[]).unwrap();
        // A small fleet: every host's row.
        assert!(small.iter().all(|h| small_text.contains(&h.host)), "{small_text}");
        let big = text(&large, &[]).unwrap();
        assert!(big.lines().count() <= 40, "{} lines:\n{big}", big.lines().count());
        let rest = big.lines().find(|l| l.starts_with("rest ")).unwrap_or_default();
        assert_eq!(rest.split_whitespace().collect::<Vec<_>>(), ["rest", "909", "454", "818", "90", "0", "0", "1"]);
        assert!(big.contains("h0507            failed"), "{big}");
        assert!(big.contains("… and 81 more"), "{big}");
        let one = text(&large, &["h0500".into()]).unwrap();
        let rows: Vec<&str> = one.lines().filter(|l| l.starts_with('h')).collect();
        assert_eq!(rows.len(), 1, "{one}");
        assert!(rows[0].starts_with("h0500"), "{one}");
        let e = text(&large, &["gpu-99".into()]).unwrap_err().to_string();
        assert!(e.starts_with("no host gpu-99 in the fleet"), "{e}");
    }

    #[test]
    fn the_waves_are_counted_in_their_order() {
        let record = Record::default();
        let hosts = fleet(1000);
        let v = View {
            record: &record,
            position: &(String::new(), None),
            hosts: &hosts,
            evidence: &Evidence::default(),
            only: &[],
        };
        let w = v.waves();
        assert_eq!(w.iter().map(|w| w.wave.as_str()).collect::<Vec<_>>(), ["canary", "early", "rest"]);
        let rest = &w[2];
        assert_eq!((rest.hosts, rest.promoted, rest.applying, rest.failed, rest.good), (909, 454, 90, 1, 818));
    }
}
