//! What a unit's load balancers are told, and whether they heard it: the serving state (`ready`
//! only while the unit runs a verified spec and is ready, `drain` from the moment an apply decides
//! to stop it until it runs a verified spec again, `down` otherwise), its two readings (HAProxy's
//! agent-check reply, an HTTP check's status), the log of the load balancers' polls, and the
//! decision an apply waits on before it stops a serving instance: every load balancer that polls
//! the unit has seen `drain` (or, when none does, a settle time has passed), bounded by the drain
//! budget.
//!
//! HAProxy's agent-check (its 2.6 manual and source): one line, ended by `\n` (a reply without it
//! is ignored), of words: `ready` cancels a drain, `up` marks the server up when its health check
//! agrees, `drain` gives it no new connections, `down #why` marks it down with a reason. One
//! reply acts at once; an HTTP check needs its load balancer's `fall` failures in a row.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::core::plan::{Observed, runs_argv};
use crate::core::timing;

/// A unit's serving state, as load balancers read it. `since`: unix seconds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum ServingState {
    /// It runs a verified spec and is ready: send it requests.
    Ready { since: u64 },
    /// An apply is stopping it (or has not verified what follows): no new requests.
    Drain { why: String, since: u64 },
    /// It does not run a verified spec, or is not ready.
    Down { why: String, since: u64 },
}

/// The word of a state, and of an answer given.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Word {
    Ready,
    Drain,
    Down,
}

impl Word {
    pub const ALL: [Word; 3] = [Word::Ready, Word::Drain, Word::Down];

    pub fn as_str(self) -> &'static str {
        match self {
            Word::Ready => "ready",
            Word::Drain => "drain",
            Word::Down => "down",
        }
    }
}

impl std::fmt::Display for Word {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a load balancer is answered for a unit that has no serving state (specd has not
/// concluded on it since the host started, or it is none of specd's).
pub const NO_STATE: &str = "specd has no serving state for this unit (not concluded on since the host started)";

impl ServingState {
    pub fn word(&self) -> Word {
        match self {
            ServingState::Ready { .. } => Word::Ready,
            ServingState::Drain { .. } => Word::Drain,
            ServingState::Down { .. } => Word::Down,
        }
    }

    pub fn since(&self) -> u64 {
        match self {
            ServingState::Ready { since } | ServingState::Drain { since, .. } | ServingState::Down { since, .. } => {
                *since
            }
        }
    }

    /// Why it is not ready (`None` when it is).
    pub fn why(&self) -> Option<&str> {
        match self {
            ServingState::Ready { .. } => None,
            ServingState::Drain { why, .. } | ServingState::Down { why, .. } => Some(why),
        }
    }

    /// The same state as `self`, kept since when it began: a write of it again changes nothing.
    pub fn same(&self, other: &ServingState) -> bool {
        self.word() == other.word() && self.why() == other.why()
    }

    /// `ready (for 5 min)`, `drain (for 12 s): specd is applying unit 1a2b3c4d`, for `status`.
    pub fn describe(&self, now: u64) -> String {
        let ago = span(now.saturating_sub(self.since()));
        match self.why() {
            None => format!("{} (for {ago})", self.word()),
            Some(why) => format!("{} (for {ago}): {why}", self.word()),
        }
    }
}

/// A span of seconds in the largest unit it fills: `42 s`, `5 min`, `3 h`, `2 d`.
fn span(secs: u64) -> String {
    match secs {
        0..120 => format!("{secs} s"),
        120..7200 => format!("{} min", secs / 60),
        7200..172_800 => format!("{} h", secs / 3600),
        _ => format!("{} d", secs / 86_400),
    }
}

/// The agent-check reply for a unit in `state` (`None`: no state): one line, `\n` at its end.
pub fn agent_reply(state: Option<&ServingState>) -> String {
    match state {
        Some(ServingState::Ready { .. }) => "ready up\n".into(),
        Some(ServingState::Drain { .. }) => "drain\n".into(),
        Some(ServingState::Down { why, .. }) => format!("down #{}\n", one_line(why)),
        None => format!("down #{NO_STATE}\n"),
    }
}

/// The HTTP check's answer for a unit in `state`: 200 `ready`, else 503 with the word and why.
pub fn http_answer(state: Option<&ServingState>) -> (u16, String) {
    match state {
        Some(ServingState::Ready { .. }) => (200, "ready\n".into()),
        Some(s) => (503, format!("{}: {}\n", s.word(), one_line(s.why().unwrap_or_default()))),
        None => (503, format!("down: {NO_STATE}\n")),
    }
}

/// The word answered for `state`.
pub fn answered(state: Option<&ServingState>) -> Word {
    state.map_or(Word::Down, ServingState::word)
}

/// The load balancers still polling (each within three of its intervals) whose last answer was
/// not the unit's state now: what a one-shot command waits for before it stops answering them
/// (HAProxy keeps an agent's last word, e.g. `drain`, while nothing answers).
pub fn unread(log: &PollLog, state: Option<&ServingState>, now_ms: u64) -> Vec<String> {
    let word = answered(state);
    log.pollers
        .values()
        .filter(|p| now_ms.saturating_sub(p.last_ms) <= window(p) && p.answered != word)
        .map(|p| p.addr.clone())
        .collect()
}

/// A reason on one line of printable characters, at most 200 of them (an agent-check reply is
/// one line; HAProxy shows it on its stats page).
fn one_line(why: &str) -> String {
    why.chars().map(|c| if c.is_control() { ' ' } else { c }).take(200).collect()
}

/// How a load balancer asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CheckKind {
    /// HAProxy's agent-check: one reply acts.
    AgentCheck,
    /// An HTTP check (`GET /serving/<unit>`): its load balancer acts after `fall` failures.
    Http,
}

/// One load balancer, as its polls of one unit showed it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Poller {
    pub kind: CheckKind,
    /// Its address (an IP: a load balancer connects from a new port each time).
    pub addr: String,
    /// Its last poll (unix ms), and the time between its last two (0: polled once).
    pub last_ms: u64,
    pub gap_ms: u64,
    /// What it was last answered, and how many answers in a row were ready, or were not.
    pub answered: Word,
    pub streak: u32,
    /// The first poll of that streak (unix ms; 0 in a log written before it was kept).
    #[serde(default)]
    pub turned_ms: u64,
}

/// The polls of one unit: its load balancers by [`PollLog::key`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PollLog {
    pub pollers: BTreeMap<String, Poller>,
}

/// At most this many load balancers are remembered per unit (the oldest goes).
pub const POLLERS_KEPT: usize = 64;

impl PollLog {
    pub fn key(kind: CheckKind, addr: &str) -> String {
        match kind {
            CheckKind::AgentCheck => format!("agent-check {addr}"),
            CheckKind::Http => format!("http {addr}"),
        }
    }

    /// A poll from `addr` at `now_ms`, answered `word`. Whether the log should be written at once
    /// (a new load balancer, or one answered other than ready: what an apply waits for, during a
    /// drain only); otherwise its writer may wait ([`timing::POLL_LOG_EVERY`]).
    pub fn record(&mut self, kind: CheckKind, addr: &str, now_ms: u64, word: Word) -> bool {
        let key = PollLog::key(kind, addr);
        let urgent = match self.pollers.get_mut(&key) {
            Some(p) => {
                let turned = (p.answered == Word::Ready) != (word == Word::Ready);
                p.gap_ms = now_ms.saturating_sub(p.last_ms);
                p.last_ms = now_ms;
                p.streak = if turned { 1 } else { p.streak.saturating_add(1) };
                // A clock set back would leave the streak begun in the future: begun now.
                if turned || p.turned_ms > now_ms {
                    p.turned_ms = now_ms;
                }
                p.answered = word;
                turned || word != Word::Ready
            }
            None => {
                let (addr, streak, turned_ms) = (addr.to_string(), 1, now_ms);
                let p = Poller { kind, addr, last_ms: now_ms, gap_ms: 0, answered: word, streak, turned_ms };
                self.pollers.insert(key, p);
                true
            }
        };
        while self.pollers.len() > POLLERS_KEPT {
            let oldest = self.pollers.iter().min_by_key(|(_, p)| p.last_ms).map(|(k, _)| k.clone());
            oldest.map(|k| self.pollers.remove(&k));
        }
        urgent
    }
}

/// How long after its last poll a load balancer counts as polling no more: three of its intervals,
/// within [`timing::POLLER_GONE_LEAST`] and [`timing::POLLER_GONE_MOST`].
fn window(p: &Poller) -> u64 {
    let least = timing::POLLER_GONE_LEAST.as_millis() as u64;
    let most = timing::POLLER_GONE_MOST.as_millis() as u64;
    p.gap_ms.saturating_mul(3).clamp(least, most)
}

/// How long a load balancer that polls is given to see `drain` whatever the drain budget (of 0,
/// the default, too): its `need` polls and one more, at its interval; one seen polling once,
/// its [`window`].
fn sees_within(p: &Poller, need: u32) -> u64 {
    match p.gap_ms {
        0 => window(p),
        gap => gap.saturating_mul(u64::from(need) + 1).min(window(p).saturating_mul(u64::from(need))),
    }
}

/// What the apply's wait knows of the load balancers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Balancers {
    /// With no load balancer seen polling, how long to wait anyway (for those specd cannot see:
    /// `load_balancer.settle_sec`).
    pub settle: Duration,
    /// The failed HTTP checks in a row an HTTP-checking load balancer needs to take a server out
    /// (HAProxy's `fall`: `load_balancer.http_fall`).
    pub http_fall: u32,
    /// From its first read of `ready`, how long a load balancer may still take to send to the
    /// server again (`load_balancer.rise_sec`): a server its own health check found down (its
    /// engine stopped) is taken back only after `rise` passing checks, whatever an agent answers;
    /// they pass from before specd says `ready`, so `rise × inter` from that read bounds it.
    pub rise: Duration,
    /// When this process began answering the load balancers itself (unix ms): a one-shot command
    /// that bound the agent-check port, where no agent answers. Until
    /// [`timing::FIRST_POLLS_WITHIN`] after, no poll seen does not mean none polls.
    pub answering_since_ms: Option<u64>,
}

/// `load_balancer.rise_sec` unset: HAProxy's default `inter 2s rise 2` (the example's), and a
/// second for the checks' own time.
pub const RISE_DEFAULT: Duration = Duration::from_secs(5);

impl Default for Balancers {
    fn default() -> Self {
        Balancers { settle: Duration::ZERO, http_fall: 3, rise: RISE_DEFAULT, answering_since_ms: None }
    }
}

/// Whether the load balancers have seen `drain`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Seen {
    /// Not yet: ask again in a moment.
    Waiting { pending: Vec<String> },
    /// Done waiting: what they saw.
    Done(Told),
}

/// What kept (or did not keep) new requests away from an instance being stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Told {
    /// The load balancers that saw `drain`, and those that did not (within the budget, or they
    /// stopped polling).
    pub saw: Vec<String>,
    pub missed: Vec<String>,
    /// From the mark to the end of the wait.
    pub after: Duration,
    /// No load balancer polled; the settle time was waited (zero: not waited).
    pub settled: Duration,
    /// This command answered the load balancers itself (no agent runs), for this long when it
    /// concluded (`None`: the agent answers them).
    pub listened: Option<Duration>,
    /// The drain budget (`drain_timeout_sec`).
    pub budget: Duration,
}

impl Told {
    /// Every load balancer that polls the unit saw `drain`, and one does.
    pub fn kept_away(&self) -> bool {
        !self.saw.is_empty() && self.missed.is_empty()
    }

    /// The line the apply prints.
    pub fn words(&self) -> String {
        let list = |v: &[String]| v.join(", ");
        let n = self.saw.len() + self.missed.len();
        let lbs = |n: usize| if n == 1 { "1 load balancer".to_string() } else { format!("{n} load balancers") };
        if let (0, Some(l)) = (n, self.listened) {
            return format!(
                "no load balancer polled this unit in the {:.1} s this command has answered their checks (no agent runs){}: nothing keeps traffic away during the stop",
                l.as_secs_f64(),
                if self.settled.is_zero() {
                    String::new()
                } else {
                    format!(", settle time {} s waited", self.settled.as_secs_f64())
                }
            );
        }
        if n == 0 && self.settled.is_zero() {
            return "no load balancer polls this unit: nothing keeps traffic away during the stop".into();
        }
        if n == 0 {
            return format!(
                "no load balancer polls this unit; waited the settle time of {} s (load_balancer.settle_sec) for those specd cannot see",
                self.settled.as_secs_f64()
            );
        }
        if self.missed.is_empty() {
            return format!("{} ({}) saw drain after {:.1} s", lbs(n), list(&self.saw), self.after.as_secs_f64());
        }
        let within =
            format!("within {:.1} s (drain_timeout_sec {} s)", self.after.as_secs_f64(), self.budget.as_secs());
        let saw = if self.saw.is_empty() { String::new() } else { format!("; {} did", list(&self.saw)) };
        format!(
            "{} of {} ({}) did not see drain {within}{saw}: they may still send new requests during the stop",
            self.missed.len(),
            lbs(n),
            list(&self.missed)
        )
    }
}

/// The decision the apply waits on after marking the unit `drain` at `mark_ms`: from the poll
/// log at `now_ms`, have the load balancers seen it? Those that polled recently before the mark
/// (within [`window`] of it), or since, must each have been answered not-ready since — once for an
/// agent-check, `http_fall` times in a row for an HTTP check — or have stopped polling; each
/// within `budget` from the mark, but never less than it needs to poll that often and once more
/// (`sees_within`: a drain budget of 0, the default, still waits for those that poll). With none: the settle time
/// passes first, and a command that only began answering them ([`Balancers::answering_since_ms`])
/// gives them [`timing::FIRST_POLLS_WITHIN`] to poll first.
pub fn seen(log: &PollLog, mark_ms: u64, now_ms: u64, b: Balancers, budget: Duration) -> Seen {
    let elapsed = now_ms.saturating_sub(mark_ms);
    let budget_ms = budget.as_millis() as u64;
    let (mut saw, mut missed, mut pending) = (Vec::new(), Vec::new(), Vec::new());
    for p in log.pollers.values() {
        let w = window(p);
        if p.last_ms + w < mark_ms {
            continue;
        }
        let need = match p.kind {
            CheckKind::AgentCheck => 1,
            CheckKind::Http => b.http_fall.max(1),
        };
        let name = match p.kind {
            CheckKind::AgentCheck => p.addr.clone(),
            CheckKind::Http => format!("{} (HTTP check)", p.addr),
        };
        if p.answered != Word::Ready && p.streak >= need {
            saw.push(name);
        } else if now_ms.saturating_sub(p.last_ms.max(mark_ms)) > w || elapsed >= budget_ms.max(sees_within(p, need)) {
            missed.push(name);
        } else {
            pending.push(name);
        }
    }
    let listened = b.answering_since_ms.map(|t| now_ms.saturating_sub(t));
    let told = |saw, missed, settled| Told {
        saw,
        missed,
        after: Duration::from_millis(elapsed),
        settled,
        listened: listened.map(Duration::from_millis),
        budget,
    };
    if !pending.is_empty() {
        return Seen::Waiting { pending };
    }
    if saw.is_empty() && missed.is_empty() {
        let first = timing::FIRST_POLLS_WITHIN.as_millis() as u64;
        if elapsed < b.settle.as_millis() as u64 || listened.is_some_and(|l| l < first) {
            return Seen::Waiting { pending: Vec::new() };
        }
        return Seen::Done(told(saw, missed, b.settle));
    }
    saw.dedup();
    missed.dedup();
    Seen::Done(told(saw, missed, Duration::ZERO))
}

/// Whether the load balancers that poll a unit told `ready` have taken it (a replica of a group
/// counts as serving for its siblings only then): each that polls it still (within [`window`]
/// of `now_ms`) was answered ready last, once for an agent-check, `http_fall` times in a row for
/// an HTTP check (taken as its `rise`), the first of them at least `rise` ago (its own health
/// check's `rise`: [`Balancers::rise`]); with none polling, at once.
pub fn taken(log: &PollLog, now_ms: u64, b: Balancers) -> bool {
    let rise = b.rise.as_millis() as u64;
    log.pollers.values().filter(|p| p.last_ms + window(p) >= now_ms).all(|p| {
        let need = match p.kind {
            CheckKind::AgentCheck => 1,
            CheckKind::Http => b.http_fall.max(1),
        };
        p.answered == Word::Ready && p.streak >= need && now_ms.saturating_sub(p.turned_ms) >= rise
    })
}

/// The serving state a reconcile leaves, as it concluded.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum After {
    /// It runs a verified spec and is ready.
    Ready,
    /// Not: why.
    Down(String),
    /// Nothing changed on the host: as the reconcile observed it ([`observed`]).
    Observed,
    /// As it is when it is `drain` (an apply interrupted after its start stays `drain` until the
    /// next run verifies); else as observed.
    #[default]
    Keep,
}

/// The serving state of a unit as observed (`now`: unix seconds): ready only when its server is
/// ready and its process runs `verified_argv` (the ExecStart of a unit that passed
/// verification, when the deployed unit is one), whatever was written since systemd loaded it.
pub fn observed(o: &Observed, verified_argv: Option<&[String]>, now: u64) -> ServingState {
    let runs = |argv: &[String]| o.main_cmdline.as_ref().is_some_and(|c| runs_argv(c, argv));
    let why = if !o.active_state.is_up() || o.main_pid == 0 {
        "its service is not running".to_string()
    } else if o.ready != Some(true) {
        "its server is not ready".to_string()
    } else {
        match verified_argv {
            Some(argv) if runs(argv) => return ServingState::Ready { since: now },
            Some(_) => "its process does not run the verified unit's command line".to_string(),
            None => "it runs a unit specd has not verified".to_string(),
        }
    };
    ServingState::Down { why, since: now }
}

/// The state `after` says, for a unit observed as `o` (see [`observed`]) and `told` what it was
/// told last; `None`: left as it is. Kept is only a `drain` (an apply or a restore that stopped
/// the old instance and has not verified the new one): anything else kept would outlive what
/// it said, a `ready` a crash, a hang or a restart by systemd since.
pub fn resolve(
    after: &After,
    told: Option<&ServingState>,
    o: &Observed,
    verified_argv: Option<&[String]>,
    now: u64,
) -> Option<ServingState> {
    match after {
        After::Ready => Some(ServingState::Ready { since: now }),
        After::Down(why) => Some(ServingState::Down { why: why.clone(), since: now }),
        After::Keep if told.is_some_and(|t| t.word() == Word::Drain) => None,
        After::Observed | After::Keep => Some(observed(o, verified_argv, now)),
    }
}

#[cfg(test)]
mod tests;
