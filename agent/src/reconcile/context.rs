//! A reconcile's context on this host, as the one-shot commands and the agent (`specd run`)
//! both build it: the same directories, the same hostname, and how a one-shot command that
//! stops units is stopped itself (its signals).

use std::path::PathBuf;

use crate::core::serving::Balancers;
use crate::host::RealHost;
use crate::machine::cgroup::Layout;
use crate::machine::store::Store;
use crate::reconcile::{Ctx, Events, Finish, Shutdown};

/// Where specd keeps its state and writes unit files.
#[derive(Clone, Debug)]
pub struct Dirs {
    pub state_dir: PathBuf,
    pub unit_dir: PathBuf,
}

/// The hostname whose overlays apply: `over`, else this machine's.
pub fn hostname(over: Option<String>) -> String {
    over.unwrap_or_else(|| nix::unistd::gethostname().map(|h| h.to_string_lossy().into_owned()).unwrap_or_default())
}

/// The reconcile context on this host: the machine (with its cgroup layout), the unit and state
/// directories.
pub fn host_ctx(dirs: &Dirs, events: Events, shutdown: Shutdown) -> Ctx<RealHost> {
    ctx_on(RealHost::new(Layout::host()), dirs, events, shutdown)
}

/// How this process waits for load balancers (the agent config's `load_balancer:`), set once at
/// its start by the command that reads that config; the defaults otherwise.
static BALANCERS: std::sync::OnceLock<Balancers> = std::sync::OnceLock::new();

/// Set how this process's reconciles wait for load balancers (once: a later call changes nothing).
pub fn set_balancers(b: Balancers) {
    let _ = BALANCERS.set(b);
}

/// The reconcile context of a command on `host` (the machine, or the tests' fake), in `dirs`:
/// an operator's command overrides holds.
pub fn ctx_on<H: crate::host::Host>(host: H, dirs: &Dirs, events: Events, shutdown: Shutdown) -> Ctx<H> {
    Ctx {
        host,
        unit_dir: dirs.unit_dir.clone(),
        store: Store::new(&dirs.state_dir),
        events,
        shutdown,
        holds: crate::reconcile::Holds::Overridden,
        lb: BALANCERS.get().copied().unwrap_or_default(),
    }
}

/// What a one-shot command that stops units (`apply`, `rollback`, `sweep`) does when it is asked
/// to stop, by SIGINT (Ctrl-C), SIGTERM or SIGHUP (its terminal or ssh session gone): the first
/// one sets the returned [`Shutdown`], so that what is in progress stops where it leaves no unit
/// down that was serving (`finish`: how far it goes), and says `first`; a second one quits at
/// once (exit 130), saying `second`, and leaves the unit as a running agent finds and heals it
/// (the apply's in-progress record). After a SIGHUP, stdout and stderr go to `/dev/null`: what
/// is printed after it would fail on a terminal that is gone.
pub fn interruptible(finish: Finish, first: String, second: String) -> Shutdown {
    use tokio::signal::unix::{SignalKind, signal};
    let (tx, shutdown) = Shutdown::finishing(finish);
    let (Ok(mut int), Ok(mut term), Ok(mut hup)) =
        (signal(SignalKind::interrupt()), signal(SignalKind::terminate()), signal(SignalKind::hangup()))
    else {
        // No signal handling (no runtime's signal driver): the default actions stay.
        std::mem::forget(tx);
        return shutdown;
    };
    tokio::spawn(async move {
        for n in 0.. {
            let hangup = tokio::select! {
                _ = int.recv() => false,
                _ = term.recv() => false,
                _ = hup.recv() => true,
            };
            if hangup {
                away_from_the_terminal();
            }
            if n > 0 {
                say(&second);
                std::process::exit(130);
            }
            say(&first);
            let _ = tx.send(true);
        }
    });
    shutdown
}

/// stdout and stderr to `/dev/null` (the terminal is gone).
fn away_from_the_terminal() {
    if let Ok(null) = std::fs::OpenOptions::new().write(true).open("/dev/null") {
        let _ = nix::unistd::dup2_stdout(&null);
        let _ = nix::unistd::dup2_stderr(&null);
    }
}

/// A line on stderr that cannot fail the command: a terminal gone or a pipe closed (`specd
/// apply 2>&1 | tee log`, whose `tee` a Ctrl-C ends first) must not end an apply half-way.
pub fn say(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}
