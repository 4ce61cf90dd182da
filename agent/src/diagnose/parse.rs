//! Reading the texts the gatherer collects: journal JSON, `systemctl show`, the kernel ring
//! buffer, unit files. Pure.

use std::collections::BTreeMap;

use super::{Line, Origin, UnitView};

/// The dependencies through which another unit's stop stops this one.
const STOP_DEP_PROPS: &[&str] = &["BindsTo", "PartOf", "Requires", "Requisite"];

/// `2026-12-02T11:48:22.110Z` for microseconds since the epoch.
pub fn format_us(us: u64) -> String {
    let s = crate::core::record::format_time(us / 1_000_000);
    format!("{}.{:03}Z", s.trim_end_matches('Z'), (us % 1_000_000) / 1000)
}

fn json_str(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        // journald gives non-UTF-8 (or control-character) fields as arrays of bytes.
        serde_json::Value::Array(a) => {
            let bytes: Vec<u8> = a.iter().filter_map(|b| b.as_u64()).map(|b| b as u8).collect();
            Some(String::from_utf8_lossy(&bytes).into_owned())
        }
        serde_json::Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

/// An instance's lines from `journalctl -o json --output-fields=MESSAGE`: each message with its
/// `__MONOTONIC_TIMESTAMP` (µs), and the last entry's `__CURSOR`.
pub fn said_lines(text: &str) -> (Vec<(u64, String)>, Option<String>) {
    let mut cursor = None;
    let mut out = Vec::new();
    for v in text.lines().filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()) {
        let f = |k: &str| v.get(k).and_then(json_str);
        cursor = f("__CURSOR").or(cursor);
        if let (Some(t), Some(m)) = (f("__MONOTONIC_TIMESTAMP").and_then(|t| t.parse().ok()), f("MESSAGE")) {
            out.push((t, m));
        }
    }
    (out, cursor)
}

/// Parses `journalctl -o json` output (one object a line; other lines are skipped).
pub fn parse_journal_json(text: &str) -> Vec<Line> {
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| {
            let f = |k: &str| v.get(k).and_then(json_str).filter(|s| !s.is_empty());
            let time_us = f("__REALTIME_TIMESTAMP")?.parse().ok()?;
            let pid: u32 = f("_PID").and_then(|p| p.parse().ok()).unwrap_or(0);
            let ident = f("SYSLOG_IDENTIFIER").or_else(|| f("_COMM")).unwrap_or_default();
            let transport = f("_TRANSPORT").unwrap_or_default();
            let origin = if transport == "kernel" {
                Origin::Kernel
            } else if pid == 1 && (ident == "systemd" || f("UNIT").is_some()) {
                Origin::Systemd
            } else if ident == "specd" {
                Origin::Specd
            } else if matches!(ident.as_str(), "sudo" | "polkitd" | "pkexec" | "run0" | "su") {
                Origin::Person
            } else if f("_SYSTEMD_INVOCATION_ID").is_some() || f("_SYSTEMD_UNIT").is_some() {
                Origin::Service
            } else {
                Origin::Other
            };
            let unit = match origin {
                Origin::Systemd => f("UNIT"),
                Origin::Service => f("_SYSTEMD_UNIT"),
                _ => f("OBJECT_SYSTEMD_UNIT").or_else(|| f("UNIT")),
            }
            .unwrap_or_default();
            let invocation = match origin {
                Origin::Systemd => f("INVOCATION_ID"),
                Origin::Service => f("_SYSTEMD_INVOCATION_ID"),
                _ => f("SPECD_INVOCATION_ID"),
            };
            Some(Line {
                time_us,
                origin,
                pid,
                ident,
                unit,
                invocation,
                job_type: f("JOB_TYPE"),
                action: if origin == Origin::Specd { f("SPECD_ACTION") } else { None },
                message: f("MESSAGE").unwrap_or_default(),
            })
        })
        .collect()
}

/// Parses the kernel ring buffer as `klogctl(SYSLOG_ACTION_READ_ALL)` (or `dmesg -r`) gives it:
/// `<4>[ 1073.557528] message`. `mono_to_real_us` is the wall clock at monotonic zero.
pub fn parse_kmsg(text: &str, mono_to_real_us: i64) -> Vec<Line> {
    text.lines()
        .filter_map(|l| {
            let l = l.trim_start();
            let l = match l.strip_prefix('<') {
                Some(r) => r.split_once('>')?.1,
                None => l,
            };
            let rest = l.trim_start().strip_prefix('[')?;
            let (ts, msg) = rest.split_once(']')?;
            let secs: f64 = ts.trim().parse().ok()?;
            let us = (secs * 1e6) as i64 + mono_to_real_us;
            Some(Line {
                time_us: us.max(0) as u64,
                origin: Origin::Kernel,
                ident: "kernel".into(),
                message: msg.trim().to_string(),
                ..Line::default()
            })
        })
        .collect()
}

/// Parses `systemctl show` output (`Key=value` lines).
pub fn parse_show(text: &str) -> UnitView {
    let m: BTreeMap<&str, &str> = text.lines().filter_map(|l| l.split_once('=')).collect();
    let s = |k: &str| m.get(k).copied().unwrap_or("").to_string();
    let words = |k: &str| -> Vec<String> { s(k).split_whitespace().map(str::to_string).collect() };
    let loaded_exec_start = m.get("ExecStart").and_then(|v| {
        let a = v.split_once("argv[]=")?.1;
        let end = a.find(" ; ").unwrap_or(a.len());
        Some(a[..end].trim().to_string())
    });
    let stop_deps = STOP_DEP_PROPS.iter().flat_map(|p| words(p).into_iter().map(|u| (p.to_string(), u))).collect();
    UnitView {
        id: s("Id"),
        props: crate::machine::systemd::UnitProps::parse(text),
        slice: s("Slice"),
        loaded_exec_start,
        timeout_stop_us: m.get("TimeoutStopUSec").and_then(|v| parse_timespan_us(v)),
        watchdog_us: m.get("WatchdogUSec").and_then(|v| parse_timespan_us(v)).filter(|us| *us > 0),
        stop_deps,
    }
}

/// A systemd time span (`5min 30s`, `300ms`, `1h`, `90`, `infinity`) in microseconds.
pub fn parse_timespan_us(s: &str) -> Option<u64> {
    let s = s.trim();
    if s.is_empty() || s == "infinity" {
        return None;
    }
    let mut total = 0f64;
    for tok in s.split_whitespace() {
        let split = tok.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(tok.len());
        let (num, unit) = tok.split_at(split);
        let v: f64 = num.parse().ok()?;
        let mult = match unit {
            "" | "s" | "sec" => 1e6,
            "us" | "usec" => 1.0,
            "ms" | "msec" => 1e3,
            "m" | "min" => 60e6,
            "h" | "hr" => 3600e6,
            "d" => 86_400e6,
            _ => return None,
        };
        total += v * mult;
    }
    Some(total as u64)
}

/// The effective `ExecStart=` of a unit file and its drop-ins as argv; a value specd's parser
/// does not take is split at white space (a person's unit, shown as evidence).
pub fn effective_exec_start(files: &[&str]) -> Option<Vec<String>> {
    let v = specd_spec::exec_start_value(files)?;
    Some(specd_spec::parse_command_line(&v).unwrap_or_else(|| v.split_whitespace().map(str::to_string).collect()))
}

/// Kernel OOM-killer lines, grouped per kill: the `oom-kill:` summary line (cgroup, pid) and
/// the `Killed process` line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct KernelKill {
    pub time_us: u64,
    pub pid: Option<u32>,
    pub memcg: Option<String>,
    pub lines: Vec<Line>,
}

pub(super) fn kernel_kills(kernel: &[Line]) -> Vec<KernelKill> {
    let mut out: Vec<KernelKill> = Vec::new();
    let mut pending: Option<KernelKill> = None;
    for l in kernel {
        let m = &l.message;
        if let Some(rest) = m.strip_prefix("oom-kill:") {
            let kv: BTreeMap<&str, &str> = rest.split(',').filter_map(|p| p.split_once('=')).collect();
            if let Some(p) = pending.take() {
                out.push(p);
            }
            pending = Some(KernelKill {
                time_us: l.time_us,
                pid: kv.get("pid").and_then(|p| p.parse().ok()),
                memcg: kv.get("task_memcg").map(|s| s.to_string()),
                lines: vec![l.clone()],
            });
        } else if let Some(i) = m.find("Killed process ") {
            let pid: Option<u32> = m[i + 15..].split_whitespace().next().and_then(|p| p.parse().ok());
            match pending.take() {
                Some(mut p) if p.pid.is_none() || p.pid == pid => {
                    p.pid = pid;
                    p.lines.push(l.clone());
                    out.push(p);
                }
                other => {
                    out.extend(other);
                    out.push(KernelKill { time_us: l.time_us, pid, memcg: None, lines: vec![l.clone()] });
                }
            }
        }
    }
    out.extend(pending);
    out
}

/// Whether a kernel log line is one of the OOM killer's.
pub fn is_kernel_oom_line(m: &str) -> bool {
    m.starts_with("oom-kill:")
        || m.contains("Killed process ")
        || m.contains("invoked oom-killer")
        || m.starts_with("Memory cgroup out of memory")
        || m.starts_with("Out of memory")
}
