//! What the host runs for a unit, as `plan` takes it (`observe`), and the unit files it reads
//! (its mask, its drop-ins).

use super::*;
use crate::core::plan::{self, Desired, Observed};
use crate::core::record::UnitState;
use crate::core::timing::{self};
use crate::core::unit_state::{ActiveState, LoadState};
use crate::host::{Host, UnitFiles, unit_path};
use crate::machine::probe::{self, Health};
use crate::machine::systemd::UnitProps;
use anyhow::Result;
use std::path::{Path, PathBuf};

/// Observe a unit: the deployed file, systemd's view, the main process, and (cheaply) the server.
pub async fn observe<H: Host>(
    ctx: &Ctx<H>,
    d: &DesiredState,
    st: &UnitState,
    probe_server: bool,
) -> Result<(Observed, UnitProps)> {
    let path = unit_path(&ctx.unit_dir, &d.spec.unit);
    let deployed = ctx.host.read(&path)?;
    let props = ctx.host.show(&d.spec.unit).await?;
    let main_cmdline = if props.main_pid > 0 { ctx.host.cmdline(props.main_pid) } else { None };
    let mut ready = None;
    let mut arg_mismatches = Vec::new();
    if probe_server && props.active_state == ActiveState::Active {
        // A quick look: a hung server does not hold the reconcile.
        let quick = timing::QUICK_LOOK;
        let base = d.spec.base_url();
        let url = format!("{base}{}", d.spec.readiness.endpoint);
        let h = tokio::time::timeout(quick, ctx.host.health(&url)).await.unwrap_or(Health::Loading("timed out".into()));
        ready = Some(h == Health::Ready);
        if h == Health::Ready
            && d.spec.readiness.verify_args
            && let Ok(Some(Ok(info))) =
                tokio::time::timeout(quick, ctx.host.reported_args(&base, &d.spec, &props.invocation_id)).await
        {
            arg_mismatches =
                probe::compare_args(&d.spec.expected_server_args(), &info).iter().map(|m| m.to_string()).collect();
        }
    }
    let interrupted = st.in_progress.as_ref().is_some_and(|p| p.sha256 == d.unit.sha256 && p.may_have_changed());
    let o = Observed {
        deployed_sha256: deployed.as_deref().map(specd_spec::sha256_hex),
        drop_ins: own_drop_ins(&ctx.host, &props, &d.spec.unit),
        // Any mask is a person's decision, even one a unit file of higher priority shadows (a
        // runtime mask in /run of a unit whose file is in /etc) or one not loaded yet.
        load_state: if props.is_masked() || mask_link(&ctx.host, &ctx.unit_dir, &d.spec.unit).is_some() {
            LoadState::Masked
        } else {
            props.load_state
        },
        active_state: props.active_state,
        sub_state: props.sub_state.clone(),
        main_pid: props.main_pid,
        need_daemon_reload: props.need_daemon_reload,
        fragment_path: props.fragment_path.clone(),
        main_cmdline,
        arg_mismatches,
        ready,
        written_sha256: st.written_sha256.clone(),
        quarantined: st.quarantined(&d.unit.sha256).map(|q| q.reason.clone()),
        last_good_sha256: st.last_good.as_ref().filter(|_| d.spec.policy.rollback).map(|g| g.sha256.clone()),
        interrupted,
        enabled: plan::enabled_of(props.unit_file_state),
    };
    Ok((o, props))
}

/// A link of the unit to `/dev/null` (a mask) in the unit directory, `/etc/systemd/system` or
/// `/run/systemd/system` (`systemctl mask --runtime`).
pub fn mask_link(host: &impl UnitFiles, unit_dir: &Path, unit: &str) -> Option<PathBuf> {
    [unit_dir, Path::new("/etc/systemd/system"), Path::new("/run/systemd/system")]
        .iter()
        .map(|d| d.join(unit))
        .find(|p| host.is_mask(p))
}

/// Drop-ins of this unit's own `<unit>.d/` directories. Shared ones (`service.d/`, prefix
/// drop-ins like `sglang-.service.d/`) belong to the host's configuration of every service and are
/// neither drift nor specd's to remove.
pub fn own_drop_ins(host: &impl UnitFiles, props: &UnitProps, unit: &str) -> Vec<String> {
    let own = format!("{unit}.d");
    props
        .drop_in_paths
        .iter()
        .filter(|p| {
            let p = Path::new(p);
            host.exists(p) && p.parent().and_then(|d| d.file_name()).is_some_and(|n| n.to_string_lossy() == own)
        })
        .cloned()
        .collect()
}

pub fn desired_of(ctx_unit_dir: &Path, d: &DesiredState) -> Desired {
    Desired {
        sha256: d.unit.sha256.clone(),
        argv: d.spec.argv.clone(),
        fragment_path: unit_path(ctx_unit_dir, &d.spec.unit).display().to_string(),
        drift: d.spec.policy.drift,
        verify_args: d.spec.readiness.verify_args && d.spec.args_report() != specd_spec::ArgsReport::None,
        verify_speculation: d.spec.readiness.verify_speculation && d.spec.speculates(),
        enabled: d.spec.service.enabled,
    }
}
