//! The one-shot commands a person runs on a host, one file each (`specd apply`, `status`, `diff`,
//! `history`, `rollback`, `suspend` and `resume`, `unquarantine`, `reconcile`, `diagnose`, `bundle import`), and
//! what they share: reading a spec file into a desired state, reconciling several units at once,
//! a hold's or a sweep's owner, the running agent's control socket.

pub mod apply;
pub mod bundle;
pub mod control;
pub mod diagnose;
pub mod diff;
pub mod history;
pub mod holds;
pub mod quarantine;
pub mod rollback;
pub mod status;

use std::path::Path;
use std::sync::Arc;

use anyhow::Result;
use serde::Serialize;
use specd_spec::short;

use crate::core::conclude::Report;
use crate::core::hold;
use crate::core::record;
use crate::core::record::Source;
use crate::host::Host;
use crate::machine::store::Store;
use crate::reconcile::context::{self, hostname};
use crate::reconcile::{self, DesiredState, Shutdown};
use crate::source::spec_files;

/// Load, resolve for this host and render a spec file; diagnostics on stderr when it is bad
/// (and returned, for `--json`).
fn desired(file: &Path, host: Option<String>) -> Result<Result<DesiredState, specd_spec::Diagnostics>> {
    let host = hostname(host);
    let parsed = match spec_files::load(file) {
        Ok(p) => p,
        Err(d) => {
            eprintln!("{d}");
            return Ok(Err(d));
        }
    };
    match parsed.resolve_with_warnings(Some(&host)) {
        Ok((spec, warnings)) => {
            for w in &warnings.0 {
                eprintln!("{w}");
            }
            let path = std::fs::canonicalize(file).unwrap_or_else(|_| file.to_path_buf());
            Ok(Ok(DesiredState::new(spec, Some(Source::File { path: path.display().to_string() }))))
        }
        Err(d) => {
            eprintln!("{d}");
            Ok(Err(d))
        }
    }
}

/// Print `doc` as the command's one JSON document on stdout.
fn print_json(doc: &impl Serialize) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(doc)?);
    Ok(())
}

/// A command's one `--json` document (`apply`, `diff`, `rollback`): its `ok` is true exactly when
/// the exit code is 0, and its `error` says why nothing was done, or specd's own failure.
trait JsonDoc: Serialize {
    fn set_ok(&mut self, ok: bool);
    fn set_error(&mut self, error: String);
}

macro_rules! json_doc {
    ($($doc:ty),*) => {$(
        impl JsonDoc for $doc {
            fn set_ok(&mut self, ok: bool) {
                self.ok = ok;
            }
            fn set_error(&mut self, error: String) {
                self.error = Some(error);
            }
        }
    )*};
}
json_doc!(apply::ApplyJson, diff::DiffJson, rollback::RollbackJson);

/// With `--json`, the document with its `error`, which the exit code that follows is not 0 for.
fn print_failed(mut doc: impl JsonDoc, json: bool, error: String) -> Result<()> {
    if json {
        doc.set_error(error);
        print_json(&doc)?;
    }
    Ok(())
}

/// Nothing was done, and `why`: said on stderr, and with `--json` as the document's `error`.
/// Exit 1.
fn refuse(doc: impl JsonDoc, json: bool, why: String) -> Result<u8> {
    eprintln!("specd: {why}");
    print_failed(doc, json, why)?;
    Ok(1)
}

/// The command ends with exit `code`: with `--json`, its document first, `ok` when it is 0.
fn finish(mut doc: impl JsonDoc, json: bool, code: u8) -> Result<u8> {
    if json {
        doc.set_ok(code == 0);
        print_json(&doc)?;
    }
    Ok(code)
}

/// What a reconcile did to a unit, as `apply --json` (each unit) and `rollback --json` say it.
#[derive(Debug, Default, Serialize)]
pub struct ReconcileJson {
    /// `applied`, `started`, `rolled-back`, `failed`, `refused`; null when nothing was done (in
    /// sync, already running it, or a dry run).
    pub outcome: Option<record::Outcome>,
    /// The reconcile's one line for a person.
    pub verdict: Option<String>,
    /// How the instance it stopped ended, when that was not a clean stop.
    pub previous_instance: Option<String>,
}

impl ReconcileJson {
    fn of(r: &Report) -> ReconcileJson {
        ReconcileJson {
            outcome: r.outcome,
            verdict: Some(r.verdict.clone()),
            previous_instance: r.stop_verdict.clone(),
        }
    }
}

/// Reconcile every unit at once (each in a task of its own: a panic is that unit's error, and
/// the others go on; a replica waiting for its group's siblings asks again until it may go), and
/// send each one's notice; the reports in the order of `all`.
async fn each_at_once<H: Host>(
    ctx: &Arc<reconcile::Ctx<H>>,
    all: &[Arc<DesiredState>],
    dry_run: bool,
) -> Vec<Result<Report, reconcile::ReconcileError>> {
    let tasks: Vec<_> = all
        .iter()
        .map(|d| {
            let (ctx, d) = (ctx.clone(), d.clone());
            tokio::spawn(async move {
                let t0 = std::time::Instant::now();
                let report = in_turn(&ctx, &d, dry_run).await;
                if let Ok(r) = &report {
                    crate::notify::after_reconcile(&ctx, &d, r, t0.elapsed()).await;
                }
                report
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap_or_else(|e| {
            Err(reconcile::ReconcileError::Io(anyhow::anyhow!("internal error while reconciling: {e}")))
        }));
    }
    out
}

/// One reconcile of `d`; a replica waiting for its group's siblings (`core::roll`) asks again
/// until it may go (or the command is stopped), as the agent's worker requeues it.
pub(crate) async fn in_turn<H: Host>(
    ctx: &reconcile::Ctx<H>,
    d: &DesiredState,
    dry_run: bool,
) -> Result<Report, reconcile::ReconcileError> {
    let mut report = reconcile::reconcile(ctx, d, dry_run).await;
    while let Ok(r) = &report
        && r.roll_wait
        && let crate::core::conclude::Action::Requeue(again) = r.action
    {
        tokio::select! {
            () = tokio::time::sleep(again) => {}
            () = ctx.shutdown.wait() => break,
        }
        report = reconcile::reconcile(ctx, d, dry_run).await;
    }
    report
}

/// Runs the futures concurrently on this task; their outputs in order.
async fn join_all<F: std::future::Future>(futures: impl IntoIterator<Item = F>) -> Vec<F::Output> {
    let mut futs: Vec<_> = futures.into_iter().map(|f| Some(Box::pin(f))).collect();
    let mut out: Vec<Option<F::Output>> = futs.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, o) in futs.iter_mut().zip(out.iter_mut()) {
            if let Some(fut) = f {
                match fut.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => {
                        *o = Some(v);
                        *f = None;
                    }
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending { std::task::Poll::Pending } else { std::task::Poll::Ready(()) }
    })
    .await;
    out.into_iter().map(|o| o.expect("every future finished")).collect()
}

/// A hash as people read it, `-` when there is none.
fn hash(h: &Option<String>) -> &str {
    h.as_deref().map_or("-", short)
}

/// Why a hand apply (or a new hold) must wait: a sweep's hold on the unit is in effect (the one
/// hold gate, [`Host::hold_in_effect`]: its process runs and it has not expired; one that names
/// no process until it expires).
fn live_sweep<H: Host>(host: &H, st: &record::UnitState) -> Option<String> {
    let h = st.hold.as_ref().filter(|h| h.kind == hold::HoldKind::Sweep)?;
    matches!(host.hold_in_effect(Some(h)), crate::core::hold::HoldEffect::HandsOff(_))
        .then(|| format!("{} (stop the sweep first)", h.describe()))
}

/// The machine, for a command that only reads it.
fn this_host() -> crate::host::RealHost {
    crate::host::RealHost::new(crate::machine::cgroup::Layout::host())
}

/// This apply is the sweep's own: run by the process that holds the unit, or by its child.
fn sweeps_own(store: &Store, unit: &str) -> bool {
    let me = [std::process::id(), nix::unistd::getppid().as_raw().unsigned_abs()];
    store.peek(unit).ok().and_then(|st| st.hold).and_then(|h| h.pid).is_some_and(|p| me.contains(&p))
}

/// Who runs a command that puts a hold: `alice@host (specd suspend)` (under sudo, the user who
/// ran sudo).
fn operator(command: &str) -> String {
    let user = std::env::var("SUDO_USER").ok().filter(|u| !u.is_empty()).unwrap_or_else(|| {
        let uid = nix::unistd::getuid();
        nix::unistd::User::from_uid(uid).ok().flatten().map_or_else(|| format!("uid {uid}"), |u| u.name)
    });
    format!("{user}@{} ({command})", hostname(None))
}

/// The unit must be one specd has state for (a typo suspends nothing).
fn known_unit(store: &Store, unit: &str) -> Result<Option<record::UnitState>> {
    let units = store.units()?;
    if !units.iter().any(|u| u == unit) {
        eprintln!(
            "specd: {unit}: specd has no state for this unit (it knows: {}); nothing was changed",
            if units.is_empty() { "none".to_string() } else { units.join(", ") }
        );
        return Ok(None);
    }
    Ok(Some(store.peek(unit)?))
}

/// The shutdown of a one-shot command that applies (`specd apply`, `specd rollback`): see
/// [`context::interruptible`]; what is in progress is finished ([`reconcile::Finish::Everything`]).
fn interruptible(command: &str, what: &str) -> Shutdown {
    context::interruptible(
        reconcile::Finish::Everything,
        format!(
            "{command}: interrupted: {what} goes on until no unit is left down (one not stopped yet is left as it runs); again to quit at once"
        ),
        format!(
            "{command}: interrupted again: quitting now; the unit is left as it is: a running agent finishes {what}, else run `{command}` again"
        ),
    )
}

#[cfg(test)]
mod tests;
