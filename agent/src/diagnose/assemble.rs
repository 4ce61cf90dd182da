//! What the gatherer read, as text ([`Raw`]), split into instances: one [`Evidence`] each. Pure.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::facts::mentions;
use super::parse::{KernelKill, effective_exec_start, kernel_kills, parse_journal_json, parse_show};
use super::{ConfigCheck, Evidence, Line, Origin, REQUEST_WINDOW_US, SERVICE_TAIL, UnitView};

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
    let context = parse_journal_json(&raw.context);
    let kills = kernel_kills(&raw.kernel);
    let config = ConfigCheck {
        need_daemon_reload: view.props.need_daemon_reload,
        unit_mtime_us: raw.unit_mtime_us,
        disk_exec_start: {
            let files: Vec<&str> = raw.unit_files.iter().map(String::as_str).collect();
            effective_exec_start(&files)
        },
        loaded_exec_start: view.loaded_exec_start.clone(),
        main_cmdline: None,
    };
    let instances = instances(parse_journal_json(&raw.journal), &view.props.invocation_id);
    let n = instances.len();
    instances
        .into_iter()
        .enumerate()
        .map(|(i, Instance { id, lines, next_start })| {
            let newest = i + 1 == n;
            let props = (newest && (view.props.invocation_id == id || view.props.invocation_id.is_empty()))
                .then(|| view.clone());
            let start = lines.first().map_or(0, |l| l.time_us);
            let last = lines.last().map_or(start, |l| l.time_us);
            // Its time: from its first line to a few seconds after its last (or on, if it runs),
            // never into the next instance's.
            let span = (
                start,
                if newest && props.as_ref().is_some_and(|v| v.is_live()) {
                    u64::MAX
                } else {
                    last.saturating_add(5_000_000).min(next_start.unwrap_or(u64::MAX))
                },
            );
            let pids: BTreeSet<u32> = lines.iter().filter(|l| l.origin == Origin::Service).map(|l| l.pid).collect();
            let live = props.is_some();
            Evidence {
                kernel: kills
                    .iter()
                    .filter(|k| k.time_us >= span.0.saturating_sub(1_000_000) && k.time_us <= span.1)
                    .filter(|k| kill_names(k, &unit, &pids))
                    .flat_map(|k| k.lines.clone())
                    .collect(),
                requests: requests(&context, &view, &unit, span),
                unit: unit.clone(),
                invocation: Some(id),
                props,
                lines,
                oom_kill_count: if live { raw.oom_kill_count } else { None },
                config: ConfigCheck {
                    main_cmdline: if live { raw.main_cmdline.clone() } else { None },
                    ..config.clone()
                },
            }
        })
        .collect()
}

/// One instance's lines (in time order, the server's own output cut to its last
/// [`SERVICE_TAIL`]), and when the next instance's first tagged line was written.
struct Instance {
    id: String,
    lines: Vec<Line>,
    next_start: Option<u64>,
}

/// The journal split into instances by invocation ID, in order of first appearance (only
/// `current`, systemd's current one, when no line has an ID).
fn instances(mut lines: Vec<Line>, current: &str) -> Vec<Instance> {
    lines.sort_by_key(|l| l.time_us);
    lines.dedup();
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
    if order.is_empty() && !current.is_empty() {
        order.push(current.to_string());
    }
    let starts: Vec<u64> =
        order.iter().map(|id| by_id.get(id).and_then(|v| v.first()).map_or(0, |l| l.time_us)).collect();
    // Lines without an invocation ID (specd's markers, systemd's load warnings) belong to the
    // instance that was current when they were written.
    if !order.is_empty() {
        for l in loose {
            let i = starts.iter().rposition(|s| *s <= l.time_us).unwrap_or(0);
            by_id.entry(order[i].clone()).or_default().push(l);
        }
    }
    order
        .into_iter()
        .enumerate()
        .map(|(i, id)| {
            let mut lines = by_id.remove(&id).unwrap_or_default();
            lines.sort_by_key(|l| l.time_us);
            keep_service_tail(&mut lines);
            Instance { id, lines, next_start: starts.get(i + 1).copied() }
        })
        .collect()
}

/// Drops all but the last [`SERVICE_TAIL`] lines of the server's own output.
fn keep_service_tail(lines: &mut Vec<Line>) {
    let svc = lines.iter().filter(|l| l.origin == Origin::Service).count();
    let mut skip = svc.saturating_sub(SERVICE_TAIL);
    lines.retain(|l| {
        if l.origin == Origin::Service && skip > 0 {
            skip -= 1;
            false
        } else {
            true
        }
    });
}

/// Whether a kernel OOM kill is about this unit: its cgroup names the unit, or (no cgroup in
/// the lines) the process killed was one of the instance's.
fn kill_names(k: &KernelKill, unit: &str, pids: &BTreeSet<u32>) -> bool {
    match (&k.memcg, k.pid) {
        (Some(cg), _) => cg.split('/').any(|c| c == unit),
        (None, Some(pid)) => pids.contains(&pid),
        (None, None) => false,
    }
}

/// The lines that may say who stopped the instance whose time is `span` (µs): specd's notes
/// and a person's commands about the unit, stop jobs of the units whose stop stops it.
fn requests(context: &[Line], view: &UnitView, unit: &str, span: (u64, u64)) -> Vec<Line> {
    let stop_deps: BTreeSet<&str> = view.stop_deps.iter().map(|(_, u)| u.as_str()).collect();
    context
        .iter()
        .filter(|l| l.time_us + REQUEST_WINDOW_US >= span.0 && l.time_us <= span.1)
        .filter(|l| match l.origin {
            Origin::Systemd => stop_deps.contains(l.unit.as_str()),
            Origin::Specd => l.unit == unit || (l.unit.is_empty() && mentions(&l.message, unit)),
            Origin::Person => mentions(&l.message, unit),
            _ => false,
        })
        .cloned()
        .collect()
}
