//! The apply's waits on the host: until a stopped unit settles, until a started server is ready
//! (or shows that it will not be).

use super::act::{Background, Target};
use super::*;
use crate::core::plan::{self, Stopping};
use crate::core::record::{PhaseTime, Startup};
use crate::core::timing::readiness_backoff;
use crate::core::timing::{self};
use crate::core::unit_state::ActiveState;
use crate::host::{Host, Watch};
use crate::machine::probe::Health;
use crate::machine::systemd::UnitProps;
use anyhow::Result;
use specd_spec::Engine;
use std::sync::Arc;
use tokio::time::Instant;

/// A question to the server that a reset connection or a moment's overload may fail: asked up to
/// three times, a second apart, while the process specd started still runs (a server that died
/// is not asked again: its error stands, and the crash is named).
pub(super) async fn answered<T, F, Fut>(ask: F, runs: impl Fn() -> bool) -> Result<T, String>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let mut last = String::new();
    for attempt in 0..timing::ASK_ATTEMPTS {
        if attempt > 0 {
            if !runs() {
                break;
            }
            tokio::time::sleep(timing::ASK_PAUSE).await;
        }
        match ask().await {
            Ok(v) => return Ok(v),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// After the cgroup emptied: wait for systemd to settle the unit as stopped, and stop it again
/// if something restarted it meanwhile.
pub(super) async fn wait_stopped_state<H: Host>(
    ctx: &Ctx<H>,
    unit: &str,
    deadline: Instant,
) -> Result<UnitProps, String> {
    let mut restops = 0;
    // Subscribed before the first look: a change between the look and the wait is not lost.
    let mut changes = ctx.host.watch(unit).await;
    loop {
        let props = ctx.host.show(unit).await.map_err(|e| format!("{e:#}"))?;
        match plan::stopping(props.active_state, &props.sub_state, props.main_pid, restops) {
            Stopping::Stopped => {
                if !ctx.host.populated(&props.control_group) {
                    return Ok(props);
                }
                // Stopped, and a process entered the cgroup after it emptied (a stop-post
                // command...): until it is empty again, which is no change of the unit's state.
                if let Err(left) = ctx.host.wait_empty(&props.control_group, deadline, || {}).await {
                    let pids: Vec<String> = left.iter().map(|l| l.pid.to_string()).collect();
                    return Err(format!("{unit} is stopped but pids {} stay in its cgroup", pids.join(", ")));
                }
                continue;
            }
            Stopping::KeepsStarting => {
                return Err(format!(
                    "{unit} keeps being started again while specd stops it ({}/{})",
                    props.active_state, props.sub_state
                ));
            }
            Stopping::StopAgain => {
                restops += 1;
                (ctx.events)(
                    unit,
                    &Event::Warning(format!(
                        "{unit} was started again while stopping ({}); stopping it again",
                        props.sub_state
                    )),
                );
                ctx.host.stop(unit, true).await.map_err(|e| format!("{e:#}"))?;
                continue;
            }
            Stopping::Settling => {}
        }
        if Instant::now() >= deadline {
            return Err(format!("{unit} did not reach a stopped state ({}/{})", props.active_state, props.sub_state));
        }
        // Systemd's next change of the unit; a process leaving the cgroup may come after it.
        tokio::select! {
            _ = changes.changed() => {}
            _ = tokio::time::sleep_until(deadline) => {}
        }
    }
}

/// Before a start: until each GPU the unit's `CUDA_VISIBLE_DEVICES` names has the memory free
/// that the start claims (`core::gpu`), asked every [`timing::GPU_MEMORY_EVERY`] for up to
/// [`timing::GPU_MEMORY_WITHIN`]; `Err`: why the start is not made (memory still held then).
/// Nothing is waited for nor said on a host without NVIDIA devices or for a unit that names no
/// GPU; what cannot be checked is said, and the start goes on.
pub(super) async fn wait_gpus_free<H: Host>(ctx: &Ctx<H>, unit: &str, t: &Target<'_>) -> Result<(), String> {
    use crate::core::gpu::{Look, look};
    let emit = |e: Event| (ctx.events)(unit, &e);
    let Some(cvd) = cuda_visible_devices(t.text) else { return Ok(()) };
    let (started, within) = (Instant::now(), timing::GPU_MEMORY_WITHIN);
    let mut waited = false;
    loop {
        let Some(answer) = ctx.host.gpu_memory().await else { return Ok(()) };
        let last = started.elapsed() >= within;
        match look(answer.as_deref().map_err(String::as_str), &cvd, t.gpu_share, last, within.as_secs()) {
            Look::Free => {
                if waited {
                    let s = started.elapsed().as_secs_f64();
                    emit(Event::Progress(format!("GPU {cvd}: memory free after {s:.1}s")));
                }
                return Ok(());
            }
            Look::Warn(w) => {
                emit(Event::Warning(w));
                return Ok(());
            }
            Look::Refuse(why) => return Err(why),
            Look::Held(held) => {
                if !waited {
                    waited = true;
                    let s = within.as_secs();
                    emit(Event::Phase(format!("waiting for GPU {cvd} to free its memory (up to {s}s)")));
                }
                emit(Event::Waiting(format!("GPU memory held: {}", held.join("; "))));
            }
        }
        tokio::time::sleep(timing::GPU_MEMORY_EVERY).await;
    }
}

/// The value of `CUDA_VISIBLE_DEVICES` a unit text sets (its last `Environment=` of it).
fn cuda_visible_devices(text: &str) -> Option<String> {
    specd_spec::service_assignments(text)
        .into_iter()
        .filter(|(k, _)| k == "Environment")
        .filter_map(|(_, v)| specd_spec::parse_environment(&v))
        .filter(|(k, _)| k == "CUDA_VISIBLE_DEVICES")
        .map(|(_, v)| v)
        .next_back()
}

/// Why a wait for readiness ended without it: the server's fault (it exited, answered a 4xx, or
/// was not ready in time), or the host's (systemd could not be asked how the unit is).
pub(super) enum Waited {
    Spec(String),
    Host(String),
}

/// A start being timed: the instance, its engine (whose lines tell the phases), and when it was
/// started, on the host's monotonic clock (µs): specd's start of the unit, and systemd's exec of
/// its main process (0: not known).
#[derive(Clone, Debug)]
pub(super) struct StartClock {
    pub(super) invocation: String,
    pub(super) engine: Engine,
    pub(super) called_us: u64,
    pub(super) exec_us: u64,
}

/// Poll the readiness endpoint until 200, with a short capped backoff, while checking that the
/// process specd started is still the one running; the start, timed by phase (`clock`), however
/// the wait ended.
pub(super) async fn wait_ready<H: Host>(
    ctx: &Ctx<H>,
    unit: &str,
    t: &Target<'_>,
    pid: u32,
    clock: &StartClock,
) -> (Result<(), Waited>, Startup) {
    use backon::Retryable;
    let emit = |e: Event| (ctx.events)(unit, &e);
    emit(Event::Phase(format!("waiting for {}{} (up to {}s)", t.base_url, t.endpoint, t.readiness.as_secs())));
    let url = format!("{}{}", t.base_url, t.endpoint);
    let started = Instant::now();
    let deadline = started + t.readiness;
    let last_check = std::sync::Mutex::new(Instant::now());
    let last_note = std::sync::Mutex::new(Instant::now());
    let told = Arc::new(std::sync::Mutex::new(Told::default()));
    let reader = listen(&ctx.host, clock, &told);
    let attempt = || async {
        let why = match ctx.host.health(&url).await {
            Health::Ready => return Ok(()),
            // A 4xx: no such endpoint, or one that wants what specd does not send. Waiting
            // will not make it answer 200.
            Health::Error(e) => return Err(Wait::Fatal(e)),
            // A refused, reset or closed connection, a 503: not ready yet. Only the process
            // ending is fatal (a failing load closes connections while it exits).
            Health::Loading(why) => why,
        };
        let now = Instant::now();
        let exited = !ctx.host.alive(pid);
        let due = exited || { now.duration_since(*last_check.lock().unwrap()) >= timing::ALIVE_EVERY };
        if due {
            *last_check.lock().unwrap() = now;
            still_loading(ctx, unit, pid, exited).await?;
        }
        if now >= deadline {
            return Err(Wait::Fatal(format!("not ready after {}s ({why})", t.readiness.as_secs())));
        }
        let note_due = { now.duration_since(*last_note.lock().unwrap()) >= timing::WAITING_NOTE };
        if note_due {
            *last_note.lock().unwrap() = now;
            // With the phase the server's lines tell and what it said last.
            let note = crate::core::guard::lock(&told).note(clock, ctx.host.monotonic_us());
            emit(Event::Waiting(format!("loading: {note}")));
        }
        Err(Wait::Loading(why))
    };
    let backoff = readiness_backoff();
    let r = attempt.retry(backoff).sleep(tokio::time::sleep).when(|e| matches!(e, Wait::Loading(_))).await;
    let end_us = ctx.host.monotonic_us();
    drop(reader);
    let startup = timed(&ctx.host, clock, &told, t.sha256, end_us, r.is_ok()).await;
    let r = match r {
        Ok(()) => {
            emit(Event::Progress(startup.describe()));
            Ok(())
        }
        Err(Wait::Fatal(m)) | Err(Wait::Loading(m)) => Err(Waited::Spec(m)),
        Err(Wait::Host(m)) => Err(Waited::Host(m)),
    };
    (r, startup)
}

/// What the started instance has said so far, read off the poll's path: the lines that time its
/// start, its last line, the journal's cursor to read on from.
#[derive(Debug, Default)]
struct Told {
    marks: Vec<(u64, String)>,
    last: Option<String>,
    cursor: Option<String>,
    /// The journal answered a read.
    answered: bool,
}

impl Told {
    fn timeline(&self, clock: &StartClock) -> specd_spec::startup::Timeline {
        let log = &specd_spec::engine_facts(clock.engine).startup;
        specd_spec::startup::timeline(log, clock.start_us(), self.marks.iter().map(|(t, l)| (*t, l.as_str())))
    }

    /// The waiting line's words: how long since the start, in which phase for how long, and
    /// what the server said last (`weights (12s), 40s in (Loading safetensors …)`).
    fn note(&self, clock: &StartClock, now_us: u64) -> String {
        let t = self.timeline(clock);
        let total = now_us.saturating_sub(clock.called_us) / 1_000_000;
        let said = self.last.as_deref().map(|l| format!(" ({})", l.chars().take(160).collect::<String>()));
        let said = said.unwrap_or_default();
        if t.told() == 0 {
            return format!("{total}s{said}");
        }
        let c = t.current();
        format!("{} ({}s), {total}s in{said}", c.phase, now_us.saturating_sub(c.from_us) / 1_000_000)
    }
}

impl StartClock {
    /// When the start began, for its first phase: the exec, else specd's start of the unit.
    fn start_us(&self) -> u64 {
        if self.exec_us > 0 { self.exec_us } else { self.called_us }
    }
}

/// One read of what the instance said since the last: its lines added to `told`. Whether the
/// journal answered.
async fn read_on<H: Host>(host: &H, clock: &StartClock, told: &std::sync::Mutex<Told>) -> bool {
    let cursor = crate::core::guard::lock(told).cursor.clone();
    let Some(said) = host.said(&clock.invocation, cursor.as_deref()).await else { return false };
    let log = &specd_spec::engine_facts(clock.engine).startup;
    let mut t = crate::core::guard::lock(told);
    t.answered = true;
    for (at, line) in said.lines {
        if log.marks(&line) {
            t.marks.push((at, line.clone()));
        }
        t.last = Some(line);
    }
    if said.cursor.is_some() {
        t.cursor = said.cursor;
    }
    true
}

/// Reads what the instance says in the background, first after [`timing::SAID_FIRST`] (most
/// servers load in less), then once per waiting line, while the returned task is kept.
fn listen<H: Host>(host: &H, clock: &StartClock, told: &Arc<std::sync::Mutex<Told>>) -> Background<()> {
    let (host, told) = (host.clone(), told.clone());
    let clock = clock.clone();
    Background(tokio::spawn(async move {
        tokio::time::sleep(timing::SAID_FIRST).await;
        loop {
            read_on(&host, &clock, &told).await;
            tokio::time::sleep(timing::WAITING_NOTE).await;
        }
    }))
}

/// The start, timed, once the wait ended at `end_us` (`ready`: the server answered ready): the
/// lines read on until its ready line is in (journald may lag behind what the server wrote), at
/// most [`timing::STARTUP_LINES_WITHIN`], a read every [`timing::STARTUP_LINES_AGAIN`].
async fn timed<H: Host>(
    host: &H,
    clock: &StartClock,
    told: &std::sync::Mutex<Told>,
    sha256: &str,
    end_us: u64,
    ready: bool,
) -> Startup {
    let deadline = Instant::now() + timing::STARTUP_LINES_WITHIN;
    loop {
        let answered = read_on(host, clock, told).await;
        let lined_up = crate::core::guard::lock(told).timeline(clock).ready_us.is_some();
        if !ready || lined_up || !answered || Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(timing::STARTUP_LINES_AGAIN).await;
    }
    let t = crate::core::guard::lock(told).timeline(clock);
    let phases = match t.told() {
        0 => Vec::new(),
        _ => t.phases(Some(end_us)).into_iter().map(|(p, us)| PhaseTime { phase: p.into(), ms: us / 1000 }).collect(),
    };
    Startup {
        sha256: sha256.to_string(),
        time: host.now(),
        ready,
        ms: end_us.saturating_sub(clock.called_us) / 1000,
        phases,
    }
}

/// One look at a server that does not answer 200 yet.
#[derive(Debug)]
enum Wait {
    /// Not ready yet: asked again.
    Loading(String),
    /// It never will be.
    Fatal(String),
    /// systemd could not be asked (its connection lost past `host::RECONNECT_WITHIN`).
    Host(String),
}

/// The process specd started (`pid`) is still the unit's, and the unit still starting or
/// active; else the server exited while loading (`Fatal`, with systemd's result). A process
/// that `exited` is given a moment for systemd to settle the unit, so that its result can be
/// told (its next change, subscribed to before the look).
async fn still_loading<H: Host>(ctx: &Ctx<H>, unit: &str, pid: u32, exited: bool) -> Result<(), Wait> {
    let mut changes = match exited {
        true => Some(ctx.host.watch(unit).await),
        false => None,
    };
    let mut props = ctx.host.show(unit).await.map_err(|e| Wait::Host(format!("{e:#}")))?;
    let settle = Instant::now() + timing::EXIT_SETTLE;
    while let Some(c) = changes.as_mut().filter(|_| props.main_pid == pid) {
        tokio::select! {
            _ = c.changed() => {}
            _ = tokio::time::sleep_until(settle) => break,
        }
        props = ctx.host.show(unit).await.map_err(|e| Wait::Host(format!("{e:#}")))?;
    }
    if exited || props.main_pid != pid || !matches!(props.active_state, ActiveState::Active | ActiveState::Activating) {
        return Err(Wait::Fatal(format!(
            "the server exited while loading (Result={}, status {}, {} restarts)",
            props.result,
            props.exit_status(),
            props.n_restarts
        )));
    }
    Ok(())
}
