//! D-Bus's wire format: values by their signature, and whole messages (header and body), read
//! and written with the alignment rules of the specification.

use anyhow::{Context, Result, anyhow, bail};

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
pub(super) fn alignment(code: u8) -> usize {
    match code {
        b'y' | b'g' | b'v' => 1,
        b'n' | b'q' => 2,
        b'b' | b'i' | b'u' | b's' | b'o' | b'a' | b'h' => 4,
        _ => 8, // x t d ( {
    }
}

/// The end (exclusive) of the single complete type starting at `sig[i]`.
pub(super) fn type_end(sig: &[u8], i: usize) -> Result<usize> {
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
pub(super) struct Writer {
    pub(super) buf: Vec<u8>,
}

impl Writer {
    pub(super) fn pad(&mut self, align: usize) {
        while !self.buf.len().is_multiple_of(align) {
            self.buf.push(0);
        }
    }

    /// A fixed-size value, little-endian, aligned to its own size (as every D-Bus fixed type is).
    fn fixed(&mut self, bytes: &[u8]) {
        self.pad(bytes.len());
        self.buf.extend_from_slice(bytes);
    }

    pub(super) fn u32(&mut self, v: u32) {
        self.fixed(&v.to_le_bytes());
    }

    pub(super) fn string(&mut self, s: &str) {
        self.u32(s.len() as u32);
        self.buf.extend_from_slice(s.as_bytes());
        self.buf.push(0);
    }

    pub(super) fn signature(&mut self, s: &str) {
        self.buf.push(s.len() as u8);
        self.buf.extend_from_slice(s.as_bytes());
        self.buf.push(0);
    }

    pub(super) fn value(&mut self, v: &Value) {
        match v {
            Value::Byte(b) => self.buf.push(*b),
            Value::Bool(b) => self.u32(*b as u32),
            Value::I16(n) => self.fixed(&n.to_le_bytes()),
            Value::U16(n) => self.fixed(&n.to_le_bytes()),
            Value::I32(n) => self.fixed(&n.to_le_bytes()),
            Value::U32(n) | Value::Fd(n) => self.u32(*n),
            Value::I64(n) => self.fixed(&n.to_le_bytes()),
            Value::U64(n) => self.fixed(&n.to_le_bytes()),
            Value::Double(d) => self.fixed(&d.to_le_bytes()),
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
pub(super) struct Reader<'a> {
    pub(super) buf: &'a [u8],
    pub(super) pos: usize,
    pub(super) le: bool,
}

/// Arrays nest at most 32 deep, structs 32 deep (the specification's limits); variants too.
pub(super) const MAX_DEPTH: usize = 64;

impl Reader<'_> {
    pub(super) fn align(&mut self, a: usize) -> Result<()> {
        let p = self.pos.next_multiple_of(a);
        if p > self.buf.len() {
            bail!("message truncated (padding at {})", self.pos);
        }
        self.pos = p;
        Ok(())
    }

    pub(super) fn take<const N: usize>(&mut self) -> Result<[u8; N]> {
        self.align(N)?;
        let b = self.buf.get(self.pos..self.pos + N).ok_or_else(|| anyhow!("message truncated at {}", self.pos))?;
        self.pos += N;
        Ok(b.try_into().expect("N bytes"))
    }

    pub(super) fn u32(&mut self) -> Result<u32> {
        let b = self.take::<4>()?;
        Ok(if self.le { u32::from_le_bytes(b) } else { u32::from_be_bytes(b) })
    }

    pub(super) fn bytes(&mut self, n: usize) -> Result<&[u8]> {
        let b = self.buf.get(self.pos..self.pos + n).ok_or_else(|| anyhow!("message truncated at {}", self.pos))?;
        self.pos += n;
        Ok(b)
    }

    /// A string's bytes and its terminating NUL.
    pub(super) fn text(&mut self, n: usize) -> Result<String> {
        let b = self.bytes(n + 1)?;
        if b[n] != 0 {
            bail!("string not terminated by NUL");
        }
        String::from_utf8(b[..n].to_vec()).context("string not UTF-8")
    }

    pub(super) fn signature(&mut self) -> Result<String> {
        let n = self.bytes(1)?[0] as usize;
        self.text(n)
    }

    /// One value of the single complete type `sig`.
    pub(super) fn value(&mut self, sig: &[u8], depth: usize) -> Result<Value> {
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
    pub(super) fn values(&mut self, sig: &str) -> Result<Vec<Value>> {
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
pub(super) const MAX_MESSAGE: usize = 128 << 20;

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
