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

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result, anyhow, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::net::unix::OwnedWriteHalf;
use tokio::sync::{mpsc, oneshot};

/// A value of any D-Bus type.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Byte(u8),
    Bool(bool),
    I16(i16),
    U16(u16),
    I32(i32),
    U32(u32),
    I64(i64),
    U64(u64),
    Double(f64),
    Str(String),
    Path(String),
    Signature(String),
    /// An index into the message's file descriptors (specd asks for none).
    Fd(u32),
    /// The element's signature (needed when the array is empty) and the elements.
    Array(String, Vec<Value>),
    Struct(Vec<Value>),
    DictEntry(Box<Value>, Box<Value>),
    Variant(Box<Value>),
}

impl Value {
    /// The value's type signature.
    pub fn signature(&self) -> String {
        match self {
            Value::Byte(_) => "y".into(),
            Value::Bool(_) => "b".into(),
            Value::I16(_) => "n".into(),
            Value::U16(_) => "q".into(),
            Value::I32(_) => "i".into(),
            Value::U32(_) => "u".into(),
            Value::I64(_) => "x".into(),
            Value::U64(_) => "t".into(),
            Value::Double(_) => "d".into(),
            Value::Str(_) => "s".into(),
            Value::Path(_) => "o".into(),
            Value::Signature(_) => "g".into(),
            Value::Fd(_) => "h".into(),
            Value::Array(elem, _) => format!("a{elem}"),
            Value::Struct(fields) => format!("({})", fields.iter().map(Value::signature).collect::<String>()),
            Value::DictEntry(k, v) => format!("{{{}{}}}", k.signature(), v.signature()),
            Value::Variant(_) => "v".into(),
        }
    }

    /// A string array (`as`).
    pub fn strings(items: &[&str]) -> Value {
        Value::Array("s".into(), items.iter().map(|s| Value::Str(s.to_string())).collect())
    }

    /// The value inside a variant (itself when not a variant).
    pub fn unvariant(&self) -> &Value {
        match self {
            Value::Variant(v) => v.unvariant(),
            v => v,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self.unvariant() {
            Value::Str(s) | Value::Path(s) | Value::Signature(s) => Some(s),
            _ => None,
        }
    }
}

/// Alignment of a type by its first signature character.
fn alignment(code: u8) -> usize {
    match code {
        b'y' | b'g' | b'v' => 1,
        b'n' | b'q' => 2,
        b'b' | b'i' | b'u' | b's' | b'o' | b'a' | b'h' => 4,
        _ => 8, // x t d ( {
    }
}

/// The end (exclusive) of the single complete type starting at `sig[i]`.
fn type_end(sig: &[u8], i: usize) -> Result<usize> {
    match sig.get(i) {
        None => bail!("truncated signature {:?}", String::from_utf8_lossy(sig)),
        Some(b'a') => type_end(sig, i + 1),
        Some(&open @ (b'(' | b'{')) => {
            let close = if open == b'(' { b')' } else { b'}' };
            let mut j = i + 1;
            if sig.get(j) == Some(&close) {
                bail!("an empty struct in signature {:?}", String::from_utf8_lossy(sig));
            }
            while sig.get(j) != Some(&close) {
                if j >= sig.len() {
                    bail!("unclosed {:?} in signature {:?}", open as char, String::from_utf8_lossy(sig));
                }
                j = type_end(sig, j)?;
            }
            Ok(j + 1)
        }
        Some(c) if b"ybnqiuxtdsoghv".contains(c) => Ok(i + 1),
        Some(c) => bail!("unknown type code {:?} in signature {:?}", *c as char, String::from_utf8_lossy(sig)),
    }
}

/// The marshalled form of values, little-endian. Offsets count from the start of the buffer,
/// which must be 8-aligned in the message (the header and the body both are).
#[derive(Default)]
struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    fn pad(&mut self, align: usize) {
        while !self.buf.len().is_multiple_of(align) {
            self.buf.push(0);
        }
    }

    fn u32(&mut self, v: u32) {
        self.pad(4);
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    fn string(&mut self, s: &str) {
        self.u32(s.len() as u32);
        self.buf.extend_from_slice(s.as_bytes());
        self.buf.push(0);
    }

    fn signature(&mut self, s: &str) {
        self.buf.push(s.len() as u8);
        self.buf.extend_from_slice(s.as_bytes());
        self.buf.push(0);
    }

    fn value(&mut self, v: &Value) {
        match v {
            Value::Byte(b) => self.buf.push(*b),
            Value::Bool(b) => self.u32(*b as u32),
            Value::I16(n) => {
                self.pad(2);
                self.buf.extend_from_slice(&n.to_le_bytes())
            }
            Value::U16(n) => {
                self.pad(2);
                self.buf.extend_from_slice(&n.to_le_bytes())
            }
            Value::I32(n) => {
                self.pad(4);
                self.buf.extend_from_slice(&n.to_le_bytes())
            }
            Value::U32(n) | Value::Fd(n) => self.u32(*n),
            Value::I64(n) => {
                self.pad(8);
                self.buf.extend_from_slice(&n.to_le_bytes())
            }
            Value::U64(n) => {
                self.pad(8);
                self.buf.extend_from_slice(&n.to_le_bytes())
            }
            Value::Double(d) => {
                self.pad(8);
                self.buf.extend_from_slice(&d.to_le_bytes())
            }
            Value::Str(s) | Value::Path(s) => self.string(s),
            Value::Signature(s) => self.signature(s),
            Value::Array(elem, items) => {
                self.u32(0);
                let len_at = self.buf.len() - 4;
                // The padding to the first element is not part of the array's length.
                self.pad(alignment(elem.as_bytes().first().copied().unwrap_or(b'y')));
                let start = self.buf.len();
                for item in items {
                    self.value(item);
                }
                let len = (self.buf.len() - start) as u32;
                self.buf[len_at..len_at + 4].copy_from_slice(&len.to_le_bytes());
            }
            Value::Struct(fields) => {
                self.pad(8);
                for f in fields {
                    self.value(f);
                }
            }
            Value::DictEntry(k, v) => {
                self.pad(8);
                self.value(k);
                self.value(v);
            }
            Value::Variant(inner) => {
                self.signature(&inner.signature());
                self.value(inner);
            }
        }
    }
}

/// Reads marshalled values, either endianness.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    le: bool,
}

/// Arrays nest at most 32 deep, structs 32 deep (the specification's limits); variants too.
const MAX_DEPTH: usize = 64;

impl Reader<'_> {
    fn align(&mut self, a: usize) -> Result<()> {
        let p = self.pos.next_multiple_of(a);
        if p > self.buf.len() {
            bail!("message truncated (padding at {})", self.pos);
        }
        self.pos = p;
        Ok(())
    }

    fn take<const N: usize>(&mut self) -> Result<[u8; N]> {
        self.align(N)?;
        let b = self.buf.get(self.pos..self.pos + N).ok_or_else(|| anyhow!("message truncated at {}", self.pos))?;
        self.pos += N;
        Ok(b.try_into().expect("N bytes"))
    }

    fn u32(&mut self) -> Result<u32> {
        let b = self.take::<4>()?;
        Ok(if self.le { u32::from_le_bytes(b) } else { u32::from_be_bytes(b) })
    }

    fn bytes(&mut self, n: usize) -> Result<&[u8]> {
        let b = self.buf.get(self.pos..self.pos + n).ok_or_else(|| anyhow!("message truncated at {}", self.pos))?;
        self.pos += n;
        Ok(b)
    }

    /// A string's bytes and its terminating NUL.
    fn text(&mut self, n: usize) -> Result<String> {
        let b = self.bytes(n + 1)?;
        if b[n] != 0 {
            bail!("string not terminated by NUL");
        }
        String::from_utf8(b[..n].to_vec()).context("string not UTF-8")
    }

    fn signature(&mut self) -> Result<String> {
        let n = self.bytes(1)?[0] as usize;
        self.text(n)
    }

    /// One value of the single complete type `sig`.
    fn value(&mut self, sig: &[u8], depth: usize) -> Result<Value> {
        if depth > MAX_DEPTH {
            bail!("values nested too deep");
        }
        let le = self.le;
        macro_rules! num {
            ($t:ty, $n:literal) => {{
                let b = self.take::<$n>()?;
                if le { <$t>::from_le_bytes(b) } else { <$t>::from_be_bytes(b) }
            }};
        }
        Ok(match sig[0] {
            b'y' => Value::Byte(self.bytes(1)?[0]),
            b'b' => match self.u32()? {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                n => bail!("boolean {n} is neither 0 nor 1"),
            },
            b'n' => Value::I16(num!(i16, 2)),
            b'q' => Value::U16(num!(u16, 2)),
            b'i' => Value::I32(num!(i32, 4)),
            b'u' => Value::U32(self.u32()?),
            b'h' => Value::Fd(self.u32()?),
            b'x' => Value::I64(num!(i64, 8)),
            b't' => Value::U64(num!(u64, 8)),
            b'd' => Value::Double(num!(f64, 8)),
            b's' | b'o' => {
                let n = self.u32()? as usize;
                let s = self.text(n)?;
                if sig[0] == b's' { Value::Str(s) } else { Value::Path(s) }
            }
            b'g' => Value::Signature(self.signature()?),
            b'v' => {
                let inner = self.signature()?;
                let s = inner.as_bytes();
                if s.is_empty() || type_end(s, 0)? != s.len() {
                    bail!("variant signature {inner:?} is not one complete type");
                }
                Value::Variant(Box::new(self.value(s, depth + 1)?))
            }
            b'a' => {
                let elem = &sig[1..];
                let n = self.u32()? as usize;
                self.align(alignment(elem[0]))?;
                let end = self.pos + n;
                if end > self.buf.len() {
                    bail!("array of {n} bytes runs past the message");
                }
                let mut items = Vec::new();
                while self.pos < end {
                    items.push(self.value(elem, depth + 1)?);
                }
                if self.pos != end {
                    bail!("array elements overrun the array's length");
                }
                Value::Array(String::from_utf8_lossy(elem).into_owned(), items)
            }
            b'(' => {
                self.align(8)?;
                let mut fields = Vec::new();
                let mut i = 1;
                while sig[i] != b')' {
                    let j = type_end(sig, i)?;
                    fields.push(self.value(&sig[i..j], depth + 1)?);
                    i = j;
                }
                Value::Struct(fields)
            }
            b'{' => {
                self.align(8)?;
                let k_end = type_end(sig, 1)?;
                let k = self.value(&sig[1..k_end], depth + 1)?;
                let v_end = type_end(sig, k_end)?;
                let v = self.value(&sig[k_end..v_end], depth + 1)?;
                Value::DictEntry(Box::new(k), Box::new(v))
            }
            c => bail!("unknown type code {:?}", c as char),
        })
    }

    /// The values of a signature of several complete types.
    fn values(&mut self, sig: &str) -> Result<Vec<Value>> {
        let s = sig.as_bytes();
        let mut out = Vec::new();
        let mut i = 0;
        while i < s.len() {
            let j = type_end(s, i)?;
            out.push(self.value(&s[i..j], 0)?);
            i = j;
        }
        Ok(out)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Call = 1,
    Return = 2,
    Error = 3,
    Signal = 4,
}

/// A message, its header fields decoded.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Message {
    pub kind: Option<Kind>,
    pub serial: u32,
    pub flags: u8,
    pub path: Option<String>,
    pub interface: Option<String>,
    pub member: Option<String>,
    pub error_name: Option<String>,
    pub reply_serial: Option<u32>,
    pub destination: Option<String>,
    pub sender: Option<String>,
    pub body: Vec<Value>,
}

/// The most a message may be (the specification's 128 MiB).
const MAX_MESSAGE: usize = 128 << 20;

impl Message {
    pub fn call(dest: &str, path: &str, interface: &str, member: &str, body: Vec<Value>) -> Message {
        Message {
            kind: Some(Kind::Call),
            path: Some(path.into()),
            interface: Some(interface.into()),
            member: Some(member.into()),
            destination: Some(dest.into()),
            body,
            ..Default::default()
        }
    }

    /// The message on the wire, little-endian, with `serial`.
    pub fn encode(&self, serial: u32) -> Vec<u8> {
        let mut body = Writer::default();
        for v in &self.body {
            body.value(v);
        }
        let sig: String = self.body.iter().map(Value::signature).collect();
        let mut fields = Vec::new();
        let mut field =
            |code: u8, v: Value| fields.push(Value::Struct(vec![Value::Byte(code), Value::Variant(Box::new(v))]));
        let s = |o: &Option<String>| o.clone();
        if let Some(p) = s(&self.path) {
            field(1, Value::Path(p));
        }
        if let Some(i) = s(&self.interface) {
            field(2, Value::Str(i));
        }
        if let Some(m) = s(&self.member) {
            field(3, Value::Str(m));
        }
        if let Some(e) = s(&self.error_name) {
            field(4, Value::Str(e));
        }
        if let Some(r) = self.reply_serial {
            field(5, Value::U32(r));
        }
        if let Some(d) = s(&self.destination) {
            field(6, Value::Str(d));
        }
        if let Some(x) = s(&self.sender) {
            field(7, Value::Str(x));
        }
        if !sig.is_empty() {
            field(8, Value::Signature(sig));
        }
        let mut w = Writer::default();
        w.buf.extend_from_slice(&[b'l', self.kind.map_or(0, |k| k as u8), self.flags, 1]);
        w.u32(body.buf.len() as u32);
        w.u32(serial);
        w.value(&Value::Array("(yv)".into(), fields));
        w.pad(8);
        w.buf.extend_from_slice(&body.buf);
        w.buf
    }

    /// The whole message's length, from its first 16 bytes.
    pub fn length(head: &[u8; 16]) -> Result<usize> {
        let le = match head[0] {
            b'l' => true,
            b'B' => false,
            e => bail!("bad endianness byte {e:#x}"),
        };
        let n = |b: &[u8]| {
            let b: [u8; 4] = b.try_into().expect("4 bytes");
            (if le { u32::from_le_bytes(b) } else { u32::from_be_bytes(b) }) as usize
        };
        let (body, fields) = (n(&head[4..8]), n(&head[12..16]));
        let len = (16 + fields).next_multiple_of(8) + body;
        if len > MAX_MESSAGE {
            bail!("message of {len} bytes is larger than D-Bus allows");
        }
        Ok(len)
    }

    pub fn decode(buf: &[u8]) -> Result<Message> {
        if buf.len() < 16 {
            bail!("message shorter than its header");
        }
        let le = match buf[0] {
            b'l' => true,
            b'B' => false,
            e => bail!("bad endianness byte {e:#x}"),
        };
        if buf[3] != 1 {
            bail!("protocol version {} (not 1)", buf[3]);
        }
        let mut r = Reader { buf, pos: 4, le };
        let body_len = r.u32()? as usize;
        let serial = r.u32()?;
        let mut m = Message {
            kind: match buf[1] {
                1 => Some(Kind::Call),
                2 => Some(Kind::Return),
                3 => Some(Kind::Error),
                4 => Some(Kind::Signal),
                _ => None,
            },
            flags: buf[2],
            serial,
            ..Default::default()
        };
        let Value::Array(_, fields) = r.value(b"a(yv)", 0)? else { unreachable!("a(yv) is an array") };
        let mut sig = String::new();
        for f in fields {
            let Value::Struct(f) = f else { continue };
            let (Some(Value::Byte(code)), Some(v)) = (f.first(), f.get(1)) else { continue };
            let v = v.unvariant();
            let text = v.as_str().map(str::to_string);
            match code {
                1 => m.path = text,
                2 => m.interface = text,
                3 => m.member = text,
                4 => m.error_name = text,
                5 => m.reply_serial = if let Value::U32(n) = v { Some(*n) } else { None },
                6 => m.destination = text,
                7 => m.sender = text,
                8 => sig = text.unwrap_or_default(),
                _ => {}
            }
        }
        r.align(8)?;
        let start = r.pos;
        if buf.len() != start + body_len {
            bail!("message body is {} bytes, its header says {body_len}", buf.len() - start);
        }
        // The body's alignment counts from its own start (which is 8-aligned in the message).
        let mut b = Reader { buf: &buf[start..], pos: 0, le };
        m.body = b.values(&sig)?;
        if b.pos != body_len {
            bail!("message body has {} bytes beyond its signature {sig:?}", body_len - b.pos);
        }
        Ok(m)
    }
}

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
