//! What the gatherer read, as text ([`Raw`]), split into instances: one [`Evidence`] each. Pure.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::facts::mentions;
use super::parse::{effective_exec_start, kernel_kills, parse_journal_json, parse_show};
use super::{ConfigCheck, Evidence, Line, Origin, REQUEST_WINDOW_US, SERVICE_TAIL};

/// What the gatherer ([`super::gather_raw`]) reads, as text, so that tests can feed recorded
/// output (and the fixtures are recorded from it).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Raw {
    pub unit: String,
    /// `systemctl show UNIT` (at least [`super::show_props`]).
    pub show: String,
    /// `journalctl -o json` lines about the unit: systemd's, the service's, specd's markers.
    /// Any mix and order (the whole `journalctl -u UNIT -o json` will do).
    pub journal: String,
    /// `journalctl -o json` lines that may say who asked for a stop (sudo, polkit, specd, and
    /// systemd's stop jobs of the units this one depends on).
    pub context: String,
    /// Kernel lines (from `journalctl -k -o json` or the ring buffer).
    pub kernel: Vec<Line>,
    /// The unit file and drop-ins on disk (text), in systemd's order, and their newest mtime.
    pub unit_files: Vec<String>,
    pub unit_mtime_us: Option<u64>,
    /// `/proc/<MainPID>/cmdline` now.
    pub main_cmdline: Option<Vec<String>>,
    /// The live cgroup's OOM-kill count.
    pub oom_kill_count: Option<u64>,
}

/// Splits the journal into instances and attaches everything to each. Oldest first.
pub fn assemble(raw: &Raw) -> Vec<Evidence> {
    let view = parse_show(&raw.show);
    let unit = if raw.unit.is_empty() { view.id.clone() } else { raw.unit.clone() };
    let mut lines = parse_journal_json(&raw.journal);
    lines.sort_by_key(|l| l.time_us);
    lines.dedup();
    // Instances in order of first appearance.
    let mut order: Vec<String> = Vec::new();
    let mut by_id: BTreeMap<String, Vec<Line>> = BTreeMap::new();
    let mut loose: Vec<Line> = Vec::new();
    for l in lines {
        match l.invocation.clone() {
            Some(id) => {
                if !by_id.contains_key(&id) {
                    order.push(id.clone());
                }
                by_id.entry(id).or_default().push(l);
            }
            None => loose.push(l),
        }
    }
    if order.is_empty() && !view.props.invocation_id.is_empty() {
        order.push(view.props.invocation_id.clone());
    }
    let starts: Vec<u64> =
        order.iter().map(|id| by_id.get(id).and_then(|v| v.first()).map_or(0, |l| l.time_us)).collect();
    // Lines without an invocation ID (specd's markers, systemd's load warnings) belong to the
    // instance that was current when they were written.
    for l in loose {
        if order.is_empty() {
            break;
        }
        let i = starts.iter().rposition(|s| *s <= l.time_us).unwrap_or(0);
        by_id.entry(order[i].clone()).or_default().push(l);
    }
    let context = parse_journal_json(&raw.context);
    let kills = kernel_kills(&raw.kernel);
    let config_base = ConfigCheck {
        need_daemon_reload: view.props.need_daemon_reload,
        unit_mtime_us: raw.unit_mtime_us,
        disk_exec_start: {
            let files: Vec<&str> = raw.unit_files.iter().map(String::as_str).collect();
            effective_exec_start(&files)
        },
        loaded_exec_start: view.loaded_exec_start.clone(),
        main_cmdline: None,
    };
    let n = order.len();
    order
        .iter()
        .enumerate()
        .map(|(i, id)| {
            let mut ls = by_id.remove(id).unwrap_or_default();
            ls.sort_by_key(|l| l.time_us);
            // Only the last SERVICE_TAIL lines of the server's own output.
            let svc = ls.iter().filter(|l| l.origin == Origin::Service).count();
            if svc > SERVICE_TAIL {
                let mut skip = svc - SERVICE_TAIL;
                ls.retain(|l| {
                    if l.origin == Origin::Service && skip > 0 {
                        skip -= 1;
                        false
                    } else {
                        true
                    }
                });
            }
            let newest = i + 1 == n;
            let props = (newest && (view.props.invocation_id == *id || view.props.invocation_id.is_empty()))
                .then(|| view.clone());
            let start = ls.first().map_or(0, |l| l.time_us);
            let end = match starts.get(i + 1) {
                Some(next) => *next,
                None => u64::MAX,
            };
            let last = ls.last().map_or(start, |l| l.time_us);
            let pids: BTreeSet<u32> = ls.iter().filter(|l| l.origin == Origin::Service).map(|l| l.pid).collect();
            let lo = start.saturating_sub(1_000_000);
            let hi = if newest && props.as_ref().is_some_and(|v| v.is_live()) {
                u64::MAX
            } else {
                last.saturating_add(5_000_000).min(end)
            };
            let kernel = kills
                .iter()
                .filter(|k| k.time_us >= lo && k.time_us <= hi)
                .filter(|k| match (&k.memcg, k.pid) {
                    (Some(cg), _) => cg.split('/').any(|c| c == unit),
                    (None, Some(pid)) => pids.contains(&pid),
                    (None, None) => false,
                })
                .flat_map(|k| k.lines.clone())
                .collect();
            let stop_deps: BTreeSet<&str> = view.stop_deps.iter().map(|(_, u)| u.as_str()).collect();
            let requests = context
                .iter()
                .filter(|l| l.time_us + REQUEST_WINDOW_US >= start && l.time_us <= hi)
                .filter(|l| match l.origin {
                    Origin::Systemd => stop_deps.contains(l.unit.as_str()),
                    Origin::Specd => l.unit == unit || (l.unit.is_empty() && mentions(&l.message, &unit)),
                    Origin::Person => mentions(&l.message, &unit),
                    _ => false,
                })
                .cloned()
                .collect();
            let mut config = config_base.clone();
            if props.is_some() {
                config.main_cmdline = raw.main_cmdline.clone();
            }
            Evidence {
                unit: unit.clone(),
                invocation: Some(id.clone()),
                props: props.clone(),
                lines: ls,
                kernel,
                requests,
                oom_kill_count: if props.is_some() { raw.oom_kill_count } else { None },
                config,
            }
        })
        .collect()
}
