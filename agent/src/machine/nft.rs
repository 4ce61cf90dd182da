//! specd's own nftables table, driven by the `nft` command: a script given on its standard
//! input (`nft -f -`), which nftables applies as one transaction, all of it or nothing. What the
//! scripts say is `core::door`'s.

use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use tokio::io::AsyncWriteExt;

/// How long `nft` may take (it waits on the kernel's netlink); killed after.
pub const NFT_WITHIN: Duration = Duration::from_secs(5);

/// The error of a host without the `nft` command: no rule of specd's can be there to remove.
pub fn missing(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::NotFound))
}

/// `nft` did not run, or ran and refused the script (a syntax error, no permission: a sandbox
/// without CAP_NET_ADMIN): nothing of it was applied. Told from a run that timed out or broke
/// off, which may have been.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct NothingApplied(pub String);

/// Whether `e` says that nothing of the script was applied ([`NothingApplied`], or no `nft`).
pub fn nothing_applied(e: &anyhow::Error) -> bool {
    missing(e) || e.chain().any(|c| c.is::<NothingApplied>())
}

/// Give `script` to `nft -f -`; its own words when it fails.
pub async fn apply(script: &str) -> Result<()> {
    let run = async {
        let mut child = tokio::process::Command::new("nft")
            .args(["-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .context("running nft (the nftables package)")?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin.write_all(script.as_bytes()).await.context("writing nft's script")?;
        }
        let o = child.wait_with_output().await.context("waiting for nft")?;
        if !o.status.success() {
            let said = String::from_utf8_lossy(&o.stderr);
            let first = said.lines().find(|l| !l.trim().is_empty()).unwrap_or_default();
            return Err(NothingApplied(format!("nft failed ({}): {}", o.status, first.trim())).into());
        }
        Ok(())
    };
    match tokio::time::timeout(NFT_WITHIN, run).await {
        Ok(r) => r,
        Err(_) => bail!("nft did not answer within {} s", NFT_WITHIN.as_secs()),
    }
}

#[cfg(test)]
mod tests {
    use anyhow::Context;

    use super::missing;

    #[test]
    fn a_host_without_nft_is_told_from_an_nft_that_failed() {
        let spawn = std::process::Command::new("/nonexistent/nft").spawn().map(|_| ());
        let absent = spawn.context("running nft (the nftables package)").unwrap_err();
        assert!(missing(&absent), "{absent:#}");
        let failed = anyhow::anyhow!("nft failed (exit status: 1): Error: syntax error");
        assert!(!missing(&failed));
        let denied: anyhow::Error = std::io::Error::from(std::io::ErrorKind::PermissionDenied).into();
        assert!(!missing(&denied.context("running nft")));
    }

    /// A script nft refused (exit status 1: no permission, a syntax error) or no nft at all left
    /// nothing applied; one it did not finish in time may have been.
    #[tokio::test]
    async fn a_script_nft_refused_is_told_from_one_that_may_have_been_applied() {
        let refused = super::apply("this is not an nft script\n").await.unwrap_err();
        assert!(super::nothing_applied(&refused), "{refused:#}");
        // Without the nftables package, as `missing` (above).
        if !missing(&refused) {
            assert!(format!("{refused:#}").starts_with("nft failed (exit status: 1): "), "{refused:#}");
        }
        let spawn = std::process::Command::new("/nonexistent/nft").spawn().map(|_| ());
        assert!(super::nothing_applied(&spawn.context("running nft").unwrap_err()));
        let late = anyhow::anyhow!("nft did not answer within 5 s");
        assert!(!super::nothing_applied(&late));
    }
}
