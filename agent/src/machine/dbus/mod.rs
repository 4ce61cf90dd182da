//! A small D-Bus client: exactly what specd needs to talk to systemd as `systemctl` does.
//!
//! - The connection: a Unix socket (systemd's private socket `/run/systemd/private` as root,
//!   peer-to-peer; else the system bus, then with `Hello`), SASL `EXTERNAL` with the uid, `BEGIN`.
//! - The wire format (D-Bus specification, "Message Protocol"): little-endian messages out;
//!   either endianness in; every type in, with its alignment (arrays, structs, dict entries,
//!   variants), because `GetAll` answers with every property of the object.
//! - One reader task per connection routes replies by serial and hands signals to whoever
//!   listens. A [`Bus`] is a cheap handle; it opens its connection on first use and opens a new
//!   one when the old one broke (or its runtime is gone).
//!
//! No crate: `zbus` types a message's sender as a unique name (`:1.42`), and systemd's messages
//! on its private socket carry `org.freedesktop.systemd1`, on which its reader fails.

mod wire;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result, anyhow, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::net::unix::OwnedWriteHalf;
use tokio::sync::{mpsc, oneshot};
pub use wire::{Kind, Message, Value};

/// An error reply: its name (`org.freedesktop.systemd1.NoSuchUnit`...) and message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{name}: {message}")]
pub struct BusError {
    pub name: String,
    pub message: String,
}

/// The connection broke, or could not be opened on a socket that exists: what systemd's
/// re-execution (`systemctl daemon-reexec`, which a systemd package upgrade runs) does to every
/// client for a moment. Nothing was answered: the same call may be asked again on a new
/// connection (see `host::reconnecting`). A missing socket, a refused authentication or an error
/// reply is not this.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Lost(pub String);

/// Whether `e` (or what caused it) is a [`Lost`] connection.
pub fn is_lost(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.downcast_ref::<Lost>().is_some())
}

type Pending = HashMap<u32, oneshot::Sender<Message>>;

/// One open connection: the write half and what the reader task routes to.
struct Conn {
    writer: tokio::sync::Mutex<OwnedWriteHalf>,
    serial: AtomicU32,
    pending: Arc<Mutex<Pending>>,
    listeners: Arc<Mutex<Vec<mpsc::UnboundedSender<Arc<Message>>>>>,
    alive: Arc<AtomicBool>,
    /// Whether this connection asked for systemd's signals (`Subscribe`, and a match on a bus).
    subscribed: tokio::sync::OnceCell<()>,
    /// The match rules added on a bus (each once per connection).
    rules: tokio::sync::Mutex<std::collections::HashSet<String>>,
}

/// Marks the connection dead when the reader task ends, also when its runtime drops it.
struct Alive(Arc<AtomicBool>, Arc<Mutex<Pending>>, Arc<Mutex<Vec<mpsc::UnboundedSender<Arc<Message>>>>>);

impl Drop for Alive {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
        // Waiters see their channel closed.
        self.1.lock().unwrap_or_else(|e| e.into_inner()).clear();
        self.2.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }
}

/// Where to connect.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Address {
    /// A peer-to-peer socket (systemd's private socket): no bus daemon, no `Hello`.
    Peer(PathBuf),
    /// A message bus (the system bus): `Hello` first, and a match rule for signals.
    Bus(PathBuf),
}

/// systemd's private socket, for root.
pub const SYSTEMD_PRIVATE: &str = "/run/systemd/private";
/// The system bus.
pub const SYSTEM_BUS: &str = "/run/dbus/system_bus_socket";

impl Address {
    /// As `systemctl` chooses: root talks to systemd directly, others through the system bus.
    pub fn systemd() -> Address {
        if nix::unistd::geteuid().is_root() && Path::new(SYSTEMD_PRIVATE).exists() {
            Address::Peer(SYSTEMD_PRIVATE.into())
        } else {
            let p = std::env::var("DBUS_SYSTEM_BUS_ADDRESS")
                .ok()
                .and_then(|a| a.strip_prefix("unix:path=").map(|p| p.split(',').next().unwrap_or(p).to_string()))
                .unwrap_or_else(|| SYSTEM_BUS.into());
            Address::Bus(p.into())
        }
    }
}

/// A handle on a connection: cheap to clone; the connection opens on first use and again after
/// it broke.
#[derive(Clone)]
pub struct Bus {
    addr: Address,
    conn: Arc<tokio::sync::Mutex<Option<Arc<Conn>>>>,
}

/// The same address (connections aside).
impl PartialEq for Bus {
    fn eq(&self, other: &Bus) -> bool {
        self.addr == other.addr
    }
}

impl std::fmt::Debug for Bus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bus").field("addr", &self.addr).finish()
    }
}

/// Signals as they arrive, from when [`Bus::signals`] was called.
pub struct Signals(mpsc::UnboundedReceiver<Arc<Message>>);

impl Signals {
    /// The next signal; `None` once the connection is gone.
    pub async fn next(&mut self) -> Option<Arc<Message>> {
        self.0.recv().await
    }
}

impl Bus {
    pub fn new(addr: Address) -> Bus {
        Bus { addr, conn: Arc::default() }
    }

    async fn conn(&self) -> Result<Arc<Conn>> {
        let mut slot = self.conn.lock().await;
        if let Some(c) = slot.as_ref()
            && c.alive.load(Ordering::SeqCst)
        {
            return Ok(c.clone());
        }
        let c = match tokio::time::timeout(SETUP_TIMEOUT, open(&self.addr)).await {
            Ok(c) => c?,
            Err(_) => {
                return Err(
                    Lost(format!("D-Bus: no answer within {} s while connecting", SETUP_TIMEOUT.as_secs())).into()
                );
            }
        };
        *slot = Some(c.clone());
        Ok(c)
    }

    /// Calls a method and waits for its reply; an error reply is a [`BusError`].
    pub async fn call(&self, m: Message) -> Result<Message> {
        let c = self.conn().await?;
        call_on(&c, m).await
    }

    /// From now on, every signal that arrives on the connection (on systemd's private socket,
    /// systemd sends all of its signals; on a bus, those matching `rule`, added once per rule).
    /// The connection's first listener also sends `subscribe` (e.g. systemd's `Subscribe`), once
    /// per connection. Gives up after [`SETUP_TIMEOUT`] without an answer.
    pub async fn signals(&self, rule: &str, subscribe: Option<Message>) -> Result<Signals> {
        match tokio::time::timeout(SETUP_TIMEOUT, self.listen(rule, subscribe)).await {
            Ok(r) => r,
            Err(_) => bail!("D-Bus: no answer within {} s while subscribing to signals", SETUP_TIMEOUT.as_secs()),
        }
    }

    async fn listen(&self, rule: &str, subscribe: Option<Message>) -> Result<Signals> {
        let c = self.conn().await?;
        if matches!(self.addr, Address::Bus(_)) {
            let mut rules = c.rules.lock().await;
            if !rules.contains(rule) {
                let add = Message::call(
                    "org.freedesktop.DBus",
                    "/org/freedesktop/DBus",
                    "org.freedesktop.DBus",
                    "AddMatch",
                    vec![Value::Str(rule.into())],
                );
                call_on(&c, add).await?;
                rules.insert(rule.to_string());
            }
        }
        let (tx, rx) = mpsc::unbounded_channel();
        c.listeners.lock().unwrap_or_else(|e| e.into_inner()).push(tx);
        c.subscribed
            .get_or_try_init(|| async {
                if let Some(s) = subscribe {
                    call_on(&c, s).await?;
                }
                anyhow::Ok(())
            })
            .await?;
        Ok(Signals(rx))
    }
}

/// How long opening a connection (connect, authenticate, `Hello`) or subscribing to signals may
/// take before specd gives up (and tries again at its next need).
pub const SETUP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(25);

async fn call_on(c: &Conn, m: Message) -> Result<Message> {
    let serial = c.serial.fetch_add(1, Ordering::SeqCst);
    let (tx, rx) = oneshot::channel();
    c.pending.lock().unwrap_or_else(|e| e.into_inner()).insert(serial, tx);
    let what = format!("{}.{}", m.interface.as_deref().unwrap_or(""), m.member.as_deref().unwrap_or(""));
    // The reader may have ended (and cleared the pending calls) just before the insert: this
    // call's reply would never come.
    if !c.alive.load(Ordering::SeqCst) {
        c.pending.lock().unwrap_or_else(|e| e.into_inner()).remove(&serial);
        return Err(Lost(format!("D-Bus call {what}: the connection closed")).into());
    }
    let bytes = m.encode(serial);
    if let Err(e) = c.writer.lock().await.write_all(&bytes).await {
        c.pending.lock().unwrap_or_else(|e| e.into_inner()).remove(&serial);
        c.alive.store(false, Ordering::SeqCst);
        return Err(anyhow::Error::new(Lost(format!("D-Bus call {what}: writing: {e}"))));
    }
    let reply = rx.await.map_err(|_| Lost(format!("D-Bus call {what}: the connection closed before the reply")))?;
    if reply.kind == Some(Kind::Error) {
        let message = reply.body.first().and_then(Value::as_str).unwrap_or("").to_string();
        return Err(BusError { name: reply.error_name.clone().unwrap_or_default(), message })
            .with_context(|| format!("D-Bus call {what}"));
    }
    Ok(reply)
}

/// Connects, authenticates, starts the reader task (and says `Hello` to a bus).
async fn open(addr: &Address) -> Result<Arc<Conn>> {
    let (Address::Peer(path) | Address::Bus(path)) = addr;
    // A socket that exists but refuses or hangs up is a server restarting (systemd re-executing
    // itself keeps its socket): lost for a moment. A missing one is no server at all.
    let lost = |what: String, e: std::io::Error| match e.kind() {
        std::io::ErrorKind::NotFound | std::io::ErrorKind::PermissionDenied => anyhow!("{what}: {e}"),
        _ => anyhow::Error::new(Lost(format!("{what}: {e}"))),
    };
    let mut s =
        UnixStream::connect(path).await.map_err(|e| lost(format!("connecting to D-Bus at {}", path.display()), e))?;
    let uid = nix::unistd::geteuid().as_raw().to_string();
    let hex: String = uid.bytes().map(|b| format!("{b:02x}")).collect();
    // As sd-bus does: the whole exchange at once, then the server's answer. Read byte by byte:
    // after its `OK` line the server may send messages (systemd, signals), which are the
    // reader task's.
    s.write_all(format!("\0AUTH EXTERNAL {hex}\r\nBEGIN\r\n").as_bytes())
        .await
        .map_err(|e| lost("D-Bus authentication".into(), e))?;
    let mut line = Vec::new();
    while !line.ends_with(b"\r\n") {
        let b = s.read_u8().await.map_err(|e| lost(format!("D-Bus authentication at {}", path.display()), e))?;
        line.push(b);
        if line.len() > 4096 {
            bail!("D-Bus authentication: an overlong line");
        }
    }
    let text = String::from_utf8_lossy(&line);
    if !text.starts_with("OK ") {
        bail!("D-Bus authentication at {} refused: {}", path.display(), text.trim());
    }
    let (mut rd, wr) = s.into_split();
    let conn = Arc::new(Conn {
        writer: tokio::sync::Mutex::new(wr),
        serial: AtomicU32::new(1),
        pending: Arc::default(),
        listeners: Arc::default(),
        alive: Arc::new(AtomicBool::new(true)),
        subscribed: tokio::sync::OnceCell::new(),
        rules: Default::default(),
    });
    let guard = Alive(conn.alive.clone(), conn.pending.clone(), conn.listeners.clone());
    tokio::spawn(async move {
        let guard = guard;
        loop {
            let mut head = [0u8; 16];
            if rd.read_exact(&mut head).await.is_err() {
                break;
            }
            let Ok(len) = Message::length(&head) else { break };
            let mut buf = vec![0u8; len];
            buf[..16].copy_from_slice(&head);
            if rd.read_exact(&mut buf[16..]).await.is_err() {
                break;
            }
            // A message we cannot read breaks the stream's framing no more than a known one:
            // skip it (its length was in its header).
            let m = match Message::decode(&buf) {
                Ok(m) => m,
                Err(e) => {
                    tracing::debug!("D-Bus: skipped a message specd cannot read: {e:#}");
                    continue;
                }
            };
            match m.kind {
                Some(Kind::Return | Kind::Error) => {
                    let waiter =
                        m.reply_serial.and_then(|r| guard.1.lock().unwrap_or_else(|e| e.into_inner()).remove(&r));
                    if let Some(w) = waiter {
                        let _ = w.send(m);
                    }
                }
                Some(Kind::Signal) => {
                    let m = Arc::new(m);
                    guard.2.lock().unwrap_or_else(|e| e.into_inner()).retain(|l| l.send(m.clone()).is_ok());
                }
                // Nobody calls specd's methods.
                _ => {}
            }
        }
    });
    if matches!(addr, Address::Bus(_)) {
        let hello =
            Message::call("org.freedesktop.DBus", "/org/freedesktop/DBus", "org.freedesktop.DBus", "Hello", vec![]);
        call_on(&conn, hello).await?;
    }
    Ok(conn)
}

#[cfg(test)]
mod tests {
    use super::wire::{Reader, Writer, type_end};
    use super::*;

    /// A method call as the specification lays it out, byte by byte.
    #[test]
    fn method_call_bytes() {
        let m = Message::call(
            "org.freedesktop.systemd1",
            "/org/freedesktop/systemd1",
            "org.freedesktop.systemd1.Manager",
            "StartUnit",
            vec![Value::Str("a.service".into()), Value::Str("replace".into())],
        );
        let b = m.encode(7);
        // Fixed part: 'l', METHOD_CALL, no flags, version 1, body length, serial.
        let body_len = (4 + 9 + 1) + 2 + (4 + 7 + 1); // "a.service", pad to 4, "replace"
        assert_eq!(&b[..4], &[b'l', 1, 0, 1]);
        assert_eq!(&b[4..8], &(body_len as u32).to_le_bytes());
        assert_eq!(&b[8..12], &7u32.to_le_bytes());
        // Header fields: the array's length, then 8-aligned structs (code, variant).
        let fields_len = u32::from_le_bytes(b[12..16].try_into().unwrap()) as usize;
        // PATH: code 1, signature "o", the path (25 bytes).
        assert_eq!(&b[16..20], &[1, 1, b'o', 0]);
        assert_eq!(&b[20..24], &25u32.to_le_bytes());
        assert_eq!(&b[24..49], b"/org/freedesktop/systemd1");
        assert_eq!(b[49], 0);
        // Padding to the next struct at 56; INTERFACE: code 2, signature "s".
        assert_eq!(&b[50..56], &[0; 6]);
        assert_eq!(&b[56..60], &[2, 1, b's', 0]);
        // The body starts 8-aligned after the fields; the signature field says "ss".
        let body_at = (16 + fields_len).next_multiple_of(8);
        assert_eq!(b.len(), body_at + body_len);
        assert_eq!(&b[body_at..body_at + 4], &9u32.to_le_bytes());
        assert_eq!(&b[body_at + 4..body_at + 14], b"a.service\0");
        assert_eq!(&b[body_at + 14..body_at + 16], &[0, 0]);
        assert_eq!(&b[body_at + 16..body_at + 20], &7u32.to_le_bytes());
        let sig_field = [8, 1, b'g', 0, 2, b's', b's', 0];
        assert!(b[16..body_at].windows(8).any(|w| w == sig_field), "{:?}", &b[16..body_at]);
        // And back.
        let d = Message::decode(&b).unwrap();
        assert_eq!(d.serial, 7);
        assert_eq!(d.member.as_deref(), Some("StartUnit"));
        assert_eq!(d.destination.as_deref(), Some("org.freedesktop.systemd1"));
        assert_eq!(d.body, m.body);
    }

    /// A GetAll reply (`a{sv}`) written out by hand: dict entries are 8-aligned, a variant's
    /// value is aligned for its own type after its signature.
    #[test]
    fn dict_of_variants_from_bytes() {
        let mut body = Vec::new();
        body.extend_from_slice(&0u32.to_le_bytes()); // array length, patched below
        body.extend_from_slice(&[0; 4]); // pad to 8 for the first dict entry
        let start = body.len();
        // {"MainPID", <u 42>}
        body.extend_from_slice(&7u32.to_le_bytes());
        body.extend_from_slice(b"MainPID\0");
        body.extend_from_slice(&[1, b'u', 0]); // variant signature "u" at offset 20
        body.push(0); // pad to 4
        body.extend_from_slice(&42u32.to_le_bytes());
        // {"T", <t 5>}: pad to 8 (we are at 28 -> 32)
        body.extend_from_slice(&[0; 4]);
        body.extend_from_slice(&1u32.to_le_bytes());
        body.extend_from_slice(b"T\0");
        body.extend_from_slice(&[1, b't', 0]); // at 38..41, then pad to 48
        body.extend_from_slice(&[0; 7]);
        body.extend_from_slice(&5u64.to_le_bytes());
        // {"Id", <ay [1,2]>}: at 56
        body.extend_from_slice(&2u32.to_le_bytes());
        body.extend_from_slice(b"Id\0");
        body.extend_from_slice(&[2, b'a', b'y', 0]); // 63..67, pad to 68
        body.push(0);
        body.extend_from_slice(&2u32.to_le_bytes());
        body.extend_from_slice(&[1, 2]);
        let len = (body.len() - start) as u32;
        body[..4].copy_from_slice(&len.to_le_bytes());

        let mut head = vec![b'l', 2, 1, 1];
        head.extend_from_slice(&(body.len() as u32).to_le_bytes());
        head.extend_from_slice(&9u32.to_le_bytes());
        // Fields: REPLY_SERIAL <u 3>, SIGNATURE <g "a{sv}">.
        let mut fields = vec![5, 1, b'u', 0];
        fields.extend_from_slice(&3u32.to_le_bytes());
        fields.extend_from_slice(&[8, 1, b'g', 0, 5]);
        fields.extend_from_slice(b"a{sv}\0");
        head.extend_from_slice(&(fields.len() as u32).to_le_bytes());
        head.extend_from_slice(&fields);
        while head.len() % 8 != 0 {
            head.push(0);
        }
        head.extend_from_slice(&body);

        let m = Message::decode(&head).unwrap();
        assert_eq!(m.kind, Some(Kind::Return));
        assert_eq!(m.reply_serial, Some(3));
        let entry =
            |k: &str, v: Value| Value::DictEntry(Box::new(Value::Str(k.into())), Box::new(Value::Variant(Box::new(v))));
        assert_eq!(
            m.body,
            vec![Value::Array(
                "{sv}".into(),
                vec![
                    entry("MainPID", Value::U32(42)),
                    entry("T", Value::U64(5)),
                    entry("Id", Value::Array("y".into(), vec![Value::Byte(1), Value::Byte(2)])),
                ]
            )]
        );
        // Written back, the same bytes.
        let mut w = Writer::default();
        w.value(&m.body[0]);
        assert_eq!(w.buf, body);
    }

    #[test]
    fn empty_array_is_padded_to_its_element() {
        // `a(yv)` empty: length 0, then padding to 8 that is not counted.
        let mut w = Writer::default();
        w.value(&Value::Byte(1));
        w.value(&Value::Array("(yv)".into(), vec![]));
        assert_eq!(w.buf, vec![1, 0, 0, 0, 0, 0, 0, 0]);
        let mut r = Reader { buf: &w.buf, pos: 0, le: true };
        assert_eq!(r.values("ya(yv)").unwrap(), vec![Value::Byte(1), Value::Array("(yv)".into(), vec![])]);
    }

    #[test]
    fn big_endian_and_structs() {
        // (is) big-endian: i32 -2, "hi".
        let buf = [0xff, 0xff, 0xff, 0xfe, 0, 0, 0, 2, b'h', b'i', 0];
        let mut r = Reader { buf: &buf, pos: 0, le: false };
        assert_eq!(r.values("(is)").unwrap(), vec![Value::Struct(vec![Value::I32(-2), Value::Str("hi".into())])]);
    }

    #[test]
    fn malformed_input_is_an_error_not_a_panic() {
        for (sig, buf) in [
            ("s", &[5, 0, 0, 0, b'a', b'b'][..]),       // truncated
            ("s", &[1, 0, 0, 0, b'a', b'b'][..]),       // no NUL
            ("b", &[2, 0, 0, 0][..]),                   // boolean 2
            ("ai", &[8, 0, 0, 0, 1, 0, 0, 0][..]),      // array past the end
            ("v", &[2, b'i', b'i', 0, 1, 0, 0, 0][..]), // variant of two types
            ("(i", &[1, 0, 0, 0][..]),                  // unclosed struct
            ("z", &[0][..]),                            // unknown code
        ] {
            let mut r = Reader { buf, pos: 0, le: true };
            assert!(r.values(sig).is_err(), "{sig} {buf:?}");
        }
        let mut head = [0u8; 16];
        head[0] = b'l';
        head[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(Message::length(&head).is_err());
    }

    #[test]
    fn signatures() {
        assert_eq!(Value::strings(&["a"]).signature(), "as");
        let e = Value::DictEntry(Box::new(Value::Str("k".into())), Box::new(Value::Variant(Box::new(Value::U32(1)))));
        assert_eq!(Value::Array("{sv}".into(), vec![e]).signature(), "a{sv}");
        assert_eq!(type_end(b"a{sa(ii)}u", 0).unwrap(), 9);
    }

    /// A peer that authenticates, answers one call and hangs up: the next call opens a new
    /// connection; an error reply comes back as its name and message.
    #[tokio::test]
    async fn reconnects_after_the_peer_hung_up() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sock");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        let server = tokio::spawn(async move {
            for answer in ["pong", "error"] {
                let (mut s, _) = listener.accept().await.unwrap();
                let mut auth = Vec::new();
                while !auth.ends_with(b"BEGIN\r\n") {
                    auth.push(s.read_u8().await.unwrap());
                }
                let uid = nix::unistd::geteuid().as_raw().to_string();
                let hex: String = uid.bytes().map(|b| format!("{b:02x}")).collect();
                assert_eq!(auth, format!("\0AUTH EXTERNAL {hex}\r\nBEGIN\r\n").into_bytes());
                s.write_all(b"OK 0123456789abcdef0123456789abcdef\r\n").await.unwrap();
                let mut head = [0u8; 16];
                s.read_exact(&mut head).await.unwrap();
                let mut buf = vec![0u8; Message::length(&head).unwrap()];
                buf[..16].copy_from_slice(&head);
                s.read_exact(&mut buf[16..]).await.unwrap();
                let call = Message::decode(&buf).unwrap();
                let mut reply = Message { reply_serial: Some(call.serial), ..Default::default() };
                if answer == "pong" {
                    reply.kind = Some(Kind::Return);
                    reply.body = vec![Value::Str("pong".into())];
                } else {
                    reply.kind = Some(Kind::Error);
                    reply.error_name = Some("org.freedesktop.DBus.Error.Failed".into());
                    reply.body = vec![Value::Str("no".into())];
                }
                s.write_all(&reply.encode(1)).await.unwrap();
                // Hang up.
            }
        });
        let bus = Bus::new(Address::Peer(path));
        let ping = || Message::call("x.y", "/x", "x.Y", "Ping", vec![]);
        let r = bus.call(ping()).await.unwrap();
        assert_eq!(r.body, vec![Value::Str("pong".into())]);
        // The reader task sees the hang-up; the next call opens a new connection.
        // (A call racing the hang-up fails once, as the connection it went out on closed.)
        let mut e = bus.call(ping()).await.unwrap_err();
        if e.downcast_ref::<BusError>().is_none() {
            let text = format!("{e:#}");
            assert!(text.contains("connection closed") || text.contains("writing"), "{text}");
            e = bus.call(ping()).await.unwrap_err();
        }
        assert_eq!(
            e.downcast_ref::<BusError>(),
            Some(&BusError { name: "org.freedesktop.DBus.Error.Failed".into(), message: "no".into() })
        );
        server.await.unwrap();
    }
}
