//! HAProxy's agent-check: HAProxy connects, sends the server's name and a newline (its
//! `agent-send "<unit>\n"`: it sends nothing unless told to), and reads one line of words; specd
//! answers the unit's serving state (`serving::agent_reply`: `ready up`, `drain`, `down #why`)
//! and closes the connection, as HAProxy expects.
//!
//! Bounded: at most [`CONNECTIONS`] at once (one more is closed at once), the name read within
//! [`NAME_WITHIN`] and at most [`NAME_MOST`] bytes, the reply written within [`REPLY_WITHIN`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

use super::{Answers, unit_of};
use crate::core::serving::{CheckKind, agent_reply};

/// Connections answered at once: a load balancer asks one at a time per server.
pub const CONNECTIONS: usize = 64;
/// The server's name comes with the connection (`agent-send`): waited for this long.
pub const NAME_WITHIN: Duration = Duration::from_millis(500);
/// The reply is written within this.
pub const REPLY_WITHIN: Duration = Duration::from_secs(1);
/// The longest name read.
pub const NAME_MOST: usize = 256;

/// The reply to a load balancer that named no unit (no `agent-send`, or no newline in time).
pub const NO_NAME: &str = "down #specd: no unit named: set agent-send \"<unit>\\n\" on the server\n";

/// Answer agent-checks on `addr` until the task is aborted.
pub fn serve(addr: SocketAddr, answers: Arc<Answers>) -> anyhow::Result<JoinHandle<()>> {
    let l = std::net::TcpListener::bind(addr).with_context(|| format!("binding {addr}"))?;
    l.set_nonblocking(true)?;
    let l = tokio::net::TcpListener::from_std(l)?;
    tracing::info!("answering HAProxy's agent-check on {addr}");
    Ok(tokio::spawn(accept_loop(l, answers)))
}

async fn accept_loop(l: tokio::net::TcpListener, answers: Arc<Answers>) {
    let slots = Arc::new(Semaphore::new(CONNECTIONS));
    let mut pause = Duration::from_millis(10);
    loop {
        let (conn, peer) = match l.accept().await {
            Ok(c) => c,
            Err(e) => {
                // Out of descriptors: not a spin.
                tracing::debug!("agent-check: cannot accept a connection: {e}");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(1));
                continue;
            }
        };
        pause = Duration::from_millis(10);
        let Ok(slot) = slots.clone().try_acquire_owned() else { continue };
        let answers = answers.clone();
        tokio::spawn(async move {
            let _ = tokio::time::timeout(NAME_WITHIN + REPLY_WITHIN, check(conn, peer, &answers)).await;
            drop(slot);
        });
    }
}

/// One check: the name, the reply, the close.
async fn check(mut conn: tokio::net::TcpStream, peer: SocketAddr, answers: &Answers) {
    let reply = match tokio::time::timeout(NAME_WITHIN, name(&mut conn)).await {
        Ok(Some(name)) => match unit_of(&name) {
            Some(unit) => agent_reply(answers.answer(CheckKind::AgentCheck, &unit, peer.ip()).as_ref()),
            None => format!("down #specd: {:?} names no unit\n", name.chars().take(64).collect::<String>()),
        },
        _ => NO_NAME.to_string(),
    };
    let _ = conn.write_all(reply.as_bytes()).await;
    let _ = conn.shutdown().await;
}

/// The first line sent (without its end), once a newline came; `None` when the peer closed
/// first or sent more than [`NAME_MOST`] bytes without one.
async fn name(conn: &mut tokio::net::TcpStream) -> Option<String> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 128];
    loop {
        let n = conn.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = buf.iter().position(|b| *b == b'\n' || *b == b'\r') {
            return Some(String::from_utf8_lossy(&buf[..end]).trim().to_string());
        }
        if buf.len() > NAME_MOST {
            return None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::serving::ServingState;
    use crate::machine::serving::ServingFiles;

    async fn ask(port: u16, send: &[u8]) -> String {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        s.write_all(send).await.unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn each_unit_named_gets_its_state_as_one_line_and_the_poll_is_recorded() {
        let d = tempfile::tempdir().unwrap();
        let files = ServingFiles::new(d.path());
        files.write("a.service", &ServingState::Ready { since: 1 }).unwrap();
        files.write("b.service", &ServingState::Drain { why: "specd is stopping it".into(), since: 1 }).unwrap();
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        drop(l);
        let h = serve(SocketAddr::from(([127, 0, 0, 1], port)), Answers::new(files.clone())).unwrap();
        assert_eq!(ask(port, b"a.service\n").await, "ready up\n");
        assert_eq!(ask(port, b"b\n").await, "drain\n", "a name without suffix is a .service");
        assert!(ask(port, b"c.service\r\n").await.starts_with("down #specd has no serving state"));
        assert_eq!(ask(port, b"../etc/passwd\n").await, "down #specd: \"../etc/passwd\" names no unit\n");
        // Nothing sent (no agent-send): said so, after a moment.
        let t0 = std::time::Instant::now();
        assert_eq!(ask(port, b"").await, NO_NAME);
        assert!(t0.elapsed() >= NAME_WITHIN, "{:?}", t0.elapsed());
        let log = files.polls("b.service");
        let p = &log.pollers["agent-check 127.0.0.1"];
        assert_eq!((p.answered, p.streak), (crate::core::serving::Word::Drain, 1));
        assert!(files.polls("a.service").pollers.contains_key("agent-check 127.0.0.1"));
        h.abort();
    }
}
