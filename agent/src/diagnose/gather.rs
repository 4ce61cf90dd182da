//! The gatherer: what diagnosis reads from a host, through [`JournalSource`] (on this host,
//! [`Journald`]: `systemctl show`, `journalctl`, the kernel ring buffer, `/proc`, the cgroup), into
//! a [`Raw`] that [`super::assemble`] splits into instances.

use std::future::Future;
use std::path::Path;

use anyhow::{Context, Result, bail};
use tokio::process::Command;

use super::assemble::{Raw, assemble};
use super::parse::{is_kernel_oom_line, parse_journal_json, parse_kmsg, parse_show};
use super::{Evidence, JOURNAL_FIELDS, Line, MAX_INSTANCES, REQUEST_WINDOW_US, SERVICE_TAIL, UnitView, show_props};

/// A journal query: entries matching `matches` (journalctl's syntax: `FIELD=value`, `+`
/// between alternatives), as JSON with [`JOURNAL_FIELDS`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct JournalQuery {
    pub matches: Vec<String>,
    /// The kernel's lines only (`-k`).
    pub kernel: bool,
    /// From this wall-clock second on (`--since=@S`).
    pub since_s: Option<u64>,
    /// Only the newest n entries (`-n`).
    pub last: Option<usize>,
}

impl JournalQuery {
    fn of(matches: &[&str]) -> JournalQuery {
        JournalQuery { matches: matches.iter().map(|m| m.to_string()).collect(), ..JournalQuery::default() }
    }

    /// `journalctl`'s arguments. `--all`: without it, `-o json` gives a field over 4096 bytes as
    /// `null`, and a server's fatal error can be one line that long (vLLM's for a model whose
    /// architecture it does not know lists every one it does: 10.7 KB).
    pub fn args(&self) -> Vec<String> {
        let mut args: Vec<String> = ["--no-pager", "--all", "-o", "json", &format!("--output-fields={JOURNAL_FIELDS}")]
            .map(String::from)
            .into();
        if self.kernel {
            args.push("-k".into());
        }
        args.extend(self.since_s.map(|s| format!("--since=@{s}")));
        args.extend(self.last.into_iter().flat_map(|n| ["-n".to_string(), n.to_string()]));
        args.extend(self.matches.iter().cloned());
        args
    }
}

/// Where the gatherer reads a unit's story.
pub trait JournalSource: Send + Sync {
    /// `systemctl show UNIT` with [`show_props`] (`Key=value` lines).
    fn show(&self, unit: &str) -> impl Future<Output = Result<String>> + Send;
    /// `journalctl -o json` output for a query.
    fn journal(&self, q: &JournalQuery) -> impl Future<Output = Result<String>> + Send;
    /// The kernel's OOM-killer lines since `since_us` (µs since the epoch).
    fn kernel_oom_lines(&self, since_us: u64) -> impl Future<Output = Vec<Line>> + Send;
    /// A unit file's text and its modification time (µs since the epoch).
    fn unit_file(&self, path: &str) -> Option<(String, Option<u64>)>;
    /// A process's command line, while it runs.
    fn cmdline(&self, pid: u32) -> Option<Vec<String>>;
    /// How many processes the kernel's OOM killer has killed in a live cgroup.
    fn oom_kill_count(&self, control_group: &str) -> Option<u64>;
}

/// This host's journald (through `journalctl`), systemd (`systemctl show`), kernel ring buffer, `/proc` and cgroups.
#[derive(Clone, Copy, Debug, Default)]
pub struct Journald;

async fn output(cmd: &str, args: &[String]) -> Result<String> {
    let out =
        Command::new(cmd).args(args).kill_on_drop(true).output().await.with_context(|| format!("running {cmd}"))?;
    if !out.status.success() {
        bail!("{cmd} {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

impl JournalSource for Journald {
    async fn show(&self, unit: &str) -> Result<String> {
        output("systemctl", &["show".into(), unit.into(), "-p".into(), show_props()]).await
    }

    async fn journal(&self, q: &JournalQuery) -> Result<String> {
        output("journalctl", &q.args()).await
    }

    /// From the journal (`journalctl -k`), else (journald not reading the kernel log, as in
    /// containers) from the ring buffer.
    async fn kernel_oom_lines(&self, since_us: u64) -> Vec<Line> {
        let q = JournalQuery { kernel: true, since_s: Some(since_us / 1_000_000), ..JournalQuery::default() };
        let from_journal = self.journal(&q).await.map(|t| parse_journal_json(&t)).unwrap_or_default();
        let mut oom: Vec<Line> = from_journal.into_iter().filter(|l| is_kernel_oom_line(&l.message)).collect();
        if oom.is_empty()
            && let Some(text) = tokio::task::spawn_blocking(read_ring_buffer).await.ok().flatten()
        {
            oom = parse_kmsg(&text, mono_to_real_us())
                .into_iter()
                .filter(|l| l.time_us + 2_000_000 >= since_us && is_kernel_oom_line(&l.message))
                .collect();
        }
        oom
    }

    fn unit_file(&self, path: &str) -> Option<(String, Option<u64>)> {
        let text = std::fs::read_to_string(path).ok()?;
        Some((text, mtime_us(Path::new(path))))
    }

    fn cmdline(&self, pid: u32) -> Option<Vec<String>> {
        crate::machine::cgroup::cmdline(pid)
    }

    fn oom_kill_count(&self, control_group: &str) -> Option<u64> {
        oom_kill_count(control_group)
    }
}

fn mtime_us(p: &Path) -> Option<u64> {
    let m = std::fs::metadata(p).ok()?.modified().ok()?;
    m.duration_since(std::time::UNIX_EPOCH).ok().map(|d| d.as_micros() as u64)
}

/// The wall clock at monotonic zero, in µs (to place kernel ring-buffer timestamps).
fn mono_to_real_us() -> i64 {
    let now = |c| {
        let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: clock_gettime writes one timespec into `t`.
        let r = unsafe { libc::clock_gettime(c, &mut t) };
        (r == 0).then(|| t.tv_sec * 1_000_000 + t.tv_nsec / 1000)
    };
    match (now(libc::CLOCK_REALTIME), now(libc::CLOCK_MONOTONIC)) {
        (Some(r), Some(m)) => r - m,
        _ => 0,
    }
}

/// The kernel ring buffer (`syslog(2)`, `SYSLOG_ACTION_READ_ALL`): needs CAP_SYSLOG.
fn read_ring_buffer() -> Option<String> {
    // SAFETY: klogctl with SYSLOG_ACTION_SIZE_BUFFER (10) takes no buffer.
    let size = unsafe { libc::klogctl(10, std::ptr::null_mut(), 0) };
    if size <= 0 {
        return None;
    }
    let mut buf = vec![0u8; size as usize];
    // SAFETY: READ_ALL (3) writes at most `size` bytes into `buf`, which has that length.
    let n = unsafe { libc::klogctl(3, buf.as_mut_ptr().cast(), size) };
    if n <= 0 {
        return None;
    }
    buf.truncate(n as usize);
    Some(String::from_utf8_lossy(&buf).into_owned())
}

/// The live cgroup's OOM-kill count: cgroup v2 `memory.events` (unified or hybrid layout),
/// else v1 `memory.oom_control`.
pub fn oom_kill_count(control_group: &str) -> Option<u64> {
    use crate::machine::cgroup::Layout;
    if control_group.is_empty() {
        return None;
    }
    Layout::host().oom_kill_files(control_group).into_iter().find_map(|p| {
        let t = std::fs::read_to_string(p).ok()?;
        t.lines().find_map(|l| l.strip_prefix("oom_kill ")).and_then(|v| v.trim().parse().ok())
    })
}

/// The instances systemd's lines name, in order, and the current one.
fn instance_ids<'a>(sys: &'a [Line], view: &'a UnitView) -> Vec<&'a str> {
    let mut ids: Vec<&str> = Vec::new();
    let current = Some(view.props.invocation_id.as_str()).filter(|i| !i.is_empty());
    for id in sys.iter().filter_map(|l| l.invocation.as_deref()).chain(current) {
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
    ids
}

/// Lines that may say who asked for a stop: specd's, sudo's, polkit's, and systemd's about the
/// units whose stop stops this one.
fn context_query(view: &UnitView, since_us: u64) -> JournalQuery {
    let mut q = JournalQuery::of(&["SYSLOG_IDENTIFIER=specd", "SYSLOG_IDENTIFIER=sudo", "SYSLOG_IDENTIFIER=polkitd"]);
    for (_, dep) in &view.stop_deps {
        q.matches.extend(["+".to_string(), "_PID=1".to_string(), format!("UNIT={dep}")]);
    }
    q.since_s = Some(since_us.saturating_sub(REQUEST_WINDOW_US) / 1_000_000);
    q
}

/// Reads everything about `unit` from `src` (see [`Raw`]): the output of its newest
/// `max_instances` instances (older ones have only systemd's lines). Fails when the unit does
/// not exist or systemd's lines about it cannot be read.
pub async fn gather_raw_from<S: JournalSource>(src: &S, unit: &str, max_instances: usize) -> Result<Raw> {
    let show = src.show(unit).await?;
    let view = parse_show(&show);
    if view.props.load_state == crate::core::unit_state::LoadState::NotFound && view.props.invocation_id.is_empty() {
        bail!("{unit}: no such unit");
    }
    // systemd's lines about the unit and specd's markers (small), then each instance's own
    // output (its last lines only: a server logs a lot).
    let sys_q =
        JournalQuery::of(&["_PID=1", &format!("UNIT={unit}"), "+", "_UID=0", &format!("OBJECT_SYSTEMD_UNIT={unit}")]);
    let sys = src.journal(&sys_q).await?;
    let sys_lines = parse_journal_json(&sys);
    let ids = instance_ids(&sys_lines, &view);
    let ids = &ids[ids.len().saturating_sub(max_instances)..];
    // The unit's latest output, also the lines journald could not tag with an invocation ID (a
    // process that dies right after writing is gone before journald looks up its cgroup).
    let mut journal = Entries::default();
    journal.add(&sys);
    let tail = JournalQuery { last: Some(SERVICE_TAIL * 4), ..JournalQuery::of(&[&format!("_SYSTEMD_UNIT={unit}")]) };
    journal.add(&src.journal(&tail).await.unwrap_or_default());
    for id in ids {
        let q =
            JournalQuery { last: Some(SERVICE_TAIL), ..JournalQuery::of(&[&format!("_SYSTEMD_INVOCATION_ID={id}")]) };
        journal.add(&src.journal(&q).await.unwrap_or_default());
    }
    let journal = journal.text;
    let since_us = sys_lines
        .iter()
        .filter(|l| l.invocation.as_deref().is_some_and(|i| ids.contains(&i)))
        .map(|l| l.time_us)
        .min()
        .unwrap_or(0);
    let context = src.journal(&context_query(&view, since_us)).await.unwrap_or_default();
    let kernel = src.kernel_oom_lines(since_us.saturating_sub(1_000_000)).await;
    let mut unit_files = Vec::new();
    let mut unit_mtime_us = None;
    let paths = std::iter::once(&view.props.fragment_path).chain(view.props.drop_in_paths.iter());
    for (text, mtime) in paths.filter(|p| !p.is_empty()).filter_map(|p| src.unit_file(p)) {
        unit_files.push(text);
        unit_mtime_us = unit_mtime_us.max(mtime);
    }
    Ok(Raw {
        unit: unit.to_string(),
        oom_kill_count: src.oom_kill_count(&view.props.control_group),
        main_cmdline: (view.props.main_pid > 0).then(|| src.cmdline(view.props.main_pid)).flatten(),
        show,
        journal,
        context,
        kernel,
        unit_files,
        unit_mtime_us,
    })
}

/// The outputs of overlapping journal queries as one, each entry once: by its `__CURSOR`, which
/// `journalctl -o json` always prints (an entry without one is kept). Time and text cannot tell
/// the copies apart: journald stamps every line of one write with one time (a traceback), and a
/// server repeats lines (a traceback's `^^^^` markers); sorted by time, a second query's copies
/// would follow the first's, and the server's last exception would be read twice over.
#[derive(Default)]
struct Entries {
    text: String,
    seen: std::collections::HashSet<String>,
}

impl Entries {
    fn add(&mut self, out: &str) {
        for entry in out.lines() {
            if cursor(entry).is_some_and(|c| !self.seen.insert(c.to_string())) {
                continue;
            }
            self.text.push_str(entry);
            self.text.push('\n');
        }
    }
}

/// The `__CURSOR` of one `journalctl -o json` line (a cursor holds no quote or backslash).
fn cursor(entry: &str) -> Option<&str> {
    const KEY: &str = "\"__CURSOR\":\"";
    let at = entry.find(KEY)? + KEY.len();
    entry[at..].find('"').map(|end| &entry[at..at + end])
}

/// [`gather_raw_from`] this host.
pub async fn gather_raw(unit: &str, max_instances: usize) -> Result<Raw> {
    gather_raw_from(&Journald, unit, max_instances).await
}

/// The evidence for each instance of `unit` (oldest first), or for one instance
/// (`invocation`, a prefix of its ID will do).
pub async fn gather(unit: &str, invocation: Option<&str>) -> Result<Vec<Evidence>> {
    gather_newest(unit, invocation, if invocation.is_some() { usize::MAX } else { MAX_INSTANCES }).await
}

/// [`gather`] for the newest `n` instances only.
pub async fn gather_newest(unit: &str, invocation: Option<&str>, n: usize) -> Result<Vec<Evidence>> {
    let raw = gather_raw(unit, n).await?;
    let mut all = assemble(&raw);
    all.drain(..all.len().saturating_sub(n));
    if let Some(id) = invocation {
        all.retain(|e| e.is_invocation(id));
        if all.is_empty() {
            bail!("{unit}: no instance with invocation ID {id} in the journal");
        }
    }
    Ok(all)
}
