//! The running agent's control socket: `specd reconcile`, and the poke the other commands give
//! the agent after they changed a unit's state.

use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// `specd reconcile`: ask the running agent over its control socket.
pub async fn ask_reconcile(socket: PathBuf, unit: Option<String>) -> Result<u8> {
    control_post(&socket, unit.as_deref()).await?;
    println!("reconcile of {} queued", unit.as_deref().unwrap_or("every unit"));
    Ok(0)
}

/// How long `specd reconcile`, `unquarantine`, `suspend`, `resume` and `rollback` wait for the
/// agent's answer on its control socket (`reconcile` fails without one; the others go on without it).
pub(super) const CONTROL_ANSWER_WITHIN: Duration = Duration::from_secs(5);

/// `POST /reconcile[?unit=U]` on the agent's control socket (HTTP/1.1, one request).
pub(super) async fn control_post(socket: &Path, unit: Option<&str>) -> Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::UnixStream::connect(socket)
        .await
        .with_context(|| format!("is the agent running, and may you use its control socket? {}", socket.display()))?;
    let query = unit.map_or(String::new(), |u| {
        let enc: String = u
            .bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'@' => (b as char).to_string(),
                _ => format!("%{b:02X}"),
            })
            .collect();
        format!("?unit={enc}")
    });
    let req =
        format!("POST /reconcile{query} HTTP/1.1\r\nHost: specd\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
    let io = async {
        s.write_all(req.as_bytes()).await?;
        let mut resp = Vec::new();
        s.read_to_end(&mut resp).await?;
        Ok::<_, std::io::Error>(resp)
    };
    let resp = tokio::time::timeout(CONTROL_ANSWER_WITHIN, io)
        .await
        .with_context(|| format!("the agent did not answer within {} s", CONTROL_ANSWER_WITHIN.as_secs()))?
        .with_context(|| format!("talking to {}", socket.display()))?;
    let head = String::from_utf8_lossy(&resp);
    let status = head.split_whitespace().nth(1).unwrap_or("");
    if status != "200" {
        anyhow::bail!("the agent answered {:?}", head.lines().next().unwrap_or(""));
    }
    Ok(())
}

/// Ask a running agent to look at a unit again (none may run).
pub(super) async fn notify_agent(socket: &Path, unit: &str) {
    if control_post(socket, Some(unit)).await.is_ok() {
        println!("asked the running agent to reconcile {unit}");
    }
}
