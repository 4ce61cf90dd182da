//! The timing policy: every duration and limit the reconciler, the agent and the sweep wait, ask
//! or requeue by, in one place. docs/reference.md's timing table names each of them (a test checks
//! that it does, with its value). An adapter's own bound on its protocol (a D-Bus call, a
//! webhook's attempt) stays beside that protocol, and is in the table too.

use std::time::Duration;

use specd_spec::Spec;

/// A unit that is Progressing (an apply elsewhere, a unit still starting) is looked at again.
pub const PROGRESSING_AGAIN: Duration = Duration::from_secs(5);
/// A unit refused by the pre-flight is looked at again (the host may be fixed: a model copied,
/// a port freed, with no event specd sees).
pub const PREFLIGHT_AGAIN: Duration = Duration::from_secs(60);
/// A unit whose enablement could not be set (its server untouched) is tried again.
pub const ENABLEMENT_AGAIN: Duration = Duration::from_secs(60);
/// A failed apply that is not quarantined is not reconciled again before this.
pub const FAILED_AGAIN: Duration = Duration::from_secs(30);
/// A replica waiting for its group's siblings to serve again (`core::roll`) asks again after this.
pub const ROLL_WAIT: Duration = Duration::from_secs(1);
/// A replica whose group's roll stopped (a sibling's change failed) looks again after this.
pub const ROLL_HELD: Duration = Duration::from_secs(30);
/// A unit no spec desires, left running (`prune: false`): its serving state follows what it runs,
/// looked at again after this.
pub const ORPHAN_LOOK: Duration = Duration::from_secs(5);
/// `error_policy`: the first retry after an error…
pub const ERROR_FIRST: Duration = Duration::from_secs(2);
/// …doubling up to this.
pub const ERROR_MOST: Duration = Duration::from_secs(300);

/// A look at the server in `observe`: one request, at most this long.
pub const QUICK_LOOK: Duration = Duration::from_millis(1500);
/// The stop budget's margin over `TimeoutStopSec`: this, or a tenth of it when longer.
pub const STOP_MARGIN: Duration = Duration::from_secs(5);
/// A stop outside an apply: the cgroup empties within this after the stop job.
pub const EMPTY_AFTER_STOP: Duration = Duration::from_secs(10);
/// A restore drains nothing: what it stops has failed already.
pub const RESTORE_DRAIN: Duration = Duration::ZERO;
/// The drain reads the in-flight requests this often…
pub const DRAIN_POLL: Duration = Duration::from_millis(500);
/// …and the stop's progress line every second, each read at most this long.
pub const STOPPING_POLL: Duration = Duration::from_secs(1);
pub const STOPPING_ASK: Duration = Duration::from_millis(800);
/// Before the stop of a serving instance, the apply reads the load balancers' polls this often,
/// until each has seen `drain` (`serving::seen`).
pub const LB_LOOK: Duration = Duration::from_millis(100);
/// A load balancer polls no more when it has not for three of its intervals, at least…
pub const POLLER_GONE_LEAST: Duration = Duration::from_secs(10);
/// …and at most this long.
pub const POLLER_GONE_MOST: Duration = Duration::from_secs(120);
/// A one-shot command that answered the load balancers stays, at most this long, until each
/// still polling has read the state it leaves (`serving::unread`): HAProxy keeps an agent's last
/// word (a `drain`) while nothing answers.
pub const ONE_SHOT_LINGER: Duration = Duration::from_secs(10);
/// A one-shot command that began answering the load balancers itself (no agent runs) gives
/// them this long from then to poll before it concludes that none polls a unit it stops.
pub const FIRST_POLLS_WITHIN: Duration = Duration::from_secs(5);
/// The serving process writes a unit's poll log at once when a load balancer is new or is answered
/// another word; otherwise at most this often.
pub const POLL_LOG_EVERY: Duration = Duration::from_secs(1);
/// How long journald is waited for to tell how an instance ended.
pub const ENDING_WITHIN: Duration = Duration::from_secs(5);
/// How long `status` waits for the journal to say how a unit's last instance ended (when
/// specd's record does not say).
pub const LAST_ENDED_WITHIN: Duration = Duration::from_secs(10);
/// A question to the started server (its args, its speculation evidence) is asked this many
/// times, this far apart, while its process runs.
pub const ASK_ATTEMPTS: u32 = 3;
pub const ASK_PAUSE: Duration = Duration::from_secs(1);
/// A unit restarted (by `Restart=`, a dependency, a person) after specd stopped it is stopped
/// again at most this many times in one apply.
pub const RESTOPS: u32 = 3;

/// Before a start, the GPUs its `CUDA_VISIBLE_DEVICES` names are waited for to have the memory
/// free that it claims (the driver frees a stopped instance's a moment after its processes are
/// gone) for up to this long (`core::gpu`); memory still held then is not started over…
pub const GPU_MEMORY_WITHIN: Duration = Duration::from_secs(30);
/// …asked of `nvidia-smi` this often.
pub const GPU_MEMORY_EVERY: Duration = Duration::from_millis(500);

/// Readiness: asked first after this, then every…
pub const READY_FIRST: Duration = Duration::from_millis(5);
/// …this long.
pub const READY_EVERY: Duration = Duration::from_millis(10);
/// While it loads, systemd is asked this often whether the started process still runs.
pub const ALIVE_EVERY: Duration = Duration::from_millis(500);
/// A server gone while loading: systemd is given this long to settle the unit.
pub const EXIT_SETTLE: Duration = Duration::from_secs(2);
/// The readiness wait's line (with the last thing the server said) is refreshed this often.
pub const WAITING_NOTE: Duration = Duration::from_secs(2);
/// The last line a loading server wrote is first read after this (most load in less).
pub const SAID_FIRST: Duration = Duration::from_millis(1500);
/// Once a started server answered ready, the journal is read for the rest of the lines that time
/// its start (the ready line may reach it after the answer) for up to this long…
pub const STARTUP_LINES_WITHIN: Duration = Duration::from_secs(2);
/// …a read this often.
pub const STARTUP_LINES_AGAIN: Duration = Duration::from_millis(200);

// The agent, the host and the sweep.

/// How long the agent waits at its stop for the units' workers to reach a safe point: all of
/// them together, within the agent unit's `TimeoutStopSec=90` (examples/specd.service), with
/// time left to close the endpoints before systemd kills what remains. An apply stopping its
/// unit's old instance is waited for this long after the end of that stop's budget instead (it
/// goes on until its new instance is started), and systemd is asked for the time.
pub const STOP_WITHIN: Duration = Duration::from_secs(75);
/// How long the agent waits at its stop, after the workers, for webhook notices still queued
/// (a notice waiting on its backoff is tried again at once, then 1–2 s and 2–4 s later).
pub const NOTICES_WITHIN: Duration = Duration::from_secs(5);
/// What the agent's stop asks of systemd, after its workers and notices, to close its endpoints
/// and exit.
pub const EXIT_WITHIN: Duration = Duration::from_secs(10);
/// The least time between two forced re-reads of the source.
pub const FORCED_READ_EVERY: Duration = Duration::from_secs(1);
/// How long a look at a unit's deaths waits for the journal to show how the instance that just
/// ended ended (journald writes a server's output and systemd's lines from different sockets).
pub const DEATH_IN_JOURNAL_WITHIN: Duration = Duration::from_secs(5);
/// How long a call to systemd is asked again after its connection was lost, before the loss is
/// an error (a host fault): systemd re-executing itself (`daemon-reexec`, run by its package's
/// upgrade) closes every connection and serves a new one within a second or two on a busy host.
pub const RECONNECT_WITHIN: Duration = Duration::from_secs(30);
/// How often a hold's process is looked at where its exit cannot be watched (a kernel without
/// pidfds).
pub const HOLDER_RECHECK: Duration = Duration::from_secs(5);
/// How long a sweep's hold lasts without a refresh: a sweep that hangs (rather than dies, which
/// ends its hold at once) gives the unit back to the agent after this.
pub const SWEEP_HOLD_FOR: Duration = Duration::from_secs(2 * 3600);
/// How long the journal is waited for to show how a point's instance ended.
pub const POINT_VERDICT_WITHIN: Duration = Duration::from_secs(10);

/// How long specd waits for a stop: systemd's `TimeoutStopSec`, plus a margin for its SIGKILL and
/// the kernel's reaping ([`STOP_MARGIN`], or a tenth of the timeout when that is longer).
pub fn stop_budget(timeout_stop_sec: u32) -> Duration {
    let t = Duration::from_secs(timeout_stop_sec.into());
    t + (t / 10).max(STOP_MARGIN)
}

/// The error policy's wait after `attempt` failures in a row: [`ERROR_FIRST`], doubling, at most
/// [`ERROR_MOST`].
pub fn error_backoff(attempt: u32) -> Duration {
    (ERROR_FIRST * (1u32 << attempt.min(8))).min(ERROR_MOST)
}

/// The readiness poll: [`READY_FIRST`], then every [`READY_EVERY`], so a server that turns ready
/// is noticed within 10 ms (as soon as a hand-written 10 ms poller would), and one that loads for
/// minutes sees 100 cheap requests a second (a refused connection on loopback, or a 503).
pub fn readiness_backoff() -> backon::ExponentialBuilder {
    backon::ExponentialBuilder::default()
        .with_min_delay(READY_FIRST)
        .with_max_delay(READY_EVERY)
        .with_factor(2.0)
        .without_max_times()
}

/// `d` spread by `percent` either way, at the point `r` (any number, e.g. random) of that range.
pub fn spread(d: Duration, percent: u64, r: u64) -> Duration {
    let ms = d.as_millis() as u64;
    let width = ms * percent / 100;
    Duration::from_millis(ms - width + r % (2 * width + 1))
}

/// When an agent polls its remote the first time after its start's read: anywhere from half to
/// one and a half `interval`s, so that agents started together (a fleet rebooted, a package
/// upgraded everywhere) poll apart from their first round on, not all within a tenth of it.
pub fn first_poll(interval: Duration, r: u64) -> Duration {
    spread(interval, 50, r)
}

/// The polls after the first: `interval` ±10 %.
pub fn next_poll(interval: Duration, r: u64) -> Duration {
    spread(interval, 10, r)
}

/// The spec's own waits.
pub struct SpecWaits {
    pub readiness: Duration,
    pub timeout_stop: Duration,
    pub stop_budget: Duration,
    pub drain: Duration,
}

impl SpecWaits {
    pub fn of(spec: &Spec) -> SpecWaits {
        SpecWaits {
            readiness: Duration::from_secs(spec.readiness.timeout_sec.into()),
            timeout_stop: Duration::from_secs(spec.service.timeout_stop_sec.into()),
            stop_budget: stop_budget(spec.service.timeout_stop_sec),
            drain: Duration::from_secs(spec.service.drain_timeout_sec.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    /// A well-mixed 64-bit number of `i` (splitmix64's finalizer): what the clock's nanoseconds
    /// give a thousand hosts.
    fn mixed(i: u64) -> u64 {
        let mut z = i.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    #[test]
    fn a_spread_stays_within_its_percent_and_reaches_both_ends() {
        let s = Duration::from_secs(60);
        for r in [0, 1, 5_999, 6_000, 12_000, 12_001, u64::MAX].into_iter().chain((0..1000).map(mixed)) {
            let n = super::next_poll(s, r);
            assert!(n >= Duration::from_secs(54) && n <= Duration::from_secs(66), "{r}: {n:?}");
            let f = super::first_poll(s, r);
            assert!(f >= Duration::from_secs(30) && f <= Duration::from_secs(90), "{r}: {f:?}");
        }
        assert_eq!(super::next_poll(s, 0), Duration::from_secs(54));
        assert_eq!(super::next_poll(s, 12_000), Duration::from_secs(66));
        assert_eq!(super::spread(Duration::ZERO, 50, 7), Duration::ZERO);
    }

    #[test]
    fn a_thousand_agents_started_together_poll_their_remote_at_most_forty_in_a_second() {
        let interval = Duration::from_secs(60);
        let mut per_second = std::collections::BTreeMap::<u64, usize>::new();
        for host in 0..1000 {
            *per_second.entry(super::first_poll(interval, mixed(host)).as_secs()).or_default() += 1;
        }
        let most = per_second.values().max().copied().unwrap_or_default();
        // Evenly over the 60 s from 30 s to 90 s: 17 a second on average.
        assert!(most <= 40, "{most} polls in one second: {per_second:?}");
    }

    use super::*;

    #[test]
    fn the_error_backoff_doubles_from_2_s_to_5_min() {
        let secs: Vec<u64> = (0..10).map(|a| error_backoff(a).as_secs()).collect();
        assert_eq!(secs, [2, 4, 8, 16, 32, 64, 128, 256, 300, 300]);
        assert_eq!(error_backoff(u32::MAX), ERROR_MOST);
    }

    #[test]
    fn the_stop_budget_is_the_timeout_and_a_margin() {
        assert_eq!(stop_budget(0), Duration::from_secs(5));
        assert_eq!(stop_budget(30), Duration::from_secs(35));
        assert_eq!(stop_budget(90), Duration::from_secs(99));
    }
}
