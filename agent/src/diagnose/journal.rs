//! specd's own notes in the journal: "stopped by specd", read back by diagnosis.

use std::path::Path;

/// journald's native socket.
pub const JOURNAL_SOCKET: &str = "/run/systemd/journal/socket";

/// Writes a journal entry about `unit` from specd (`SYSLOG_IDENTIFIER=specd`,
/// `OBJECT_SYSTEMD_UNIT=unit`, so that `journalctl -u unit` shows it): call it right before
/// specd stops or restarts a unit, so that diagnosis can say "stopped by specd".
pub fn journal_note(unit: &str, action: &str, invocation: Option<&str>, message: &str) -> std::io::Result<()> {
    journal_note_to(Path::new(JOURNAL_SOCKET), unit, action, invocation, message)
}

/// [`journal_note`] to a given socket (tests). `invocation`: the instance the note is about.
pub fn journal_note_to(
    socket: &Path,
    unit: &str,
    action: &str,
    invocation: Option<&str>,
    message: &str,
) -> std::io::Result<()> {
    let clean = |s: &str| s.replace(['\n', '\r'], " ");
    let mut datagram = format!(
        "MESSAGE={}\nPRIORITY=5\nSYSLOG_IDENTIFIER=specd\nOBJECT_SYSTEMD_UNIT={}\nSPECD_ACTION={}\n",
        clean(message),
        clean(unit),
        clean(action)
    );
    if let Some(i) = invocation.filter(|i| !i.is_empty()) {
        datagram.push_str(&format!("SPECD_INVOCATION_ID={}\n", clean(i)));
    }
    let sock = std::os::unix::net::UnixDatagram::unbound()?;
    sock.send_to(datagram.as_bytes(), socket)?;
    Ok(())
}
