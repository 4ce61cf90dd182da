//! Located diagnostics: every problem names the file, line, column and field path, rustc-style with
//! a snippet of the offending line.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_saphyr::{Location, Spanned};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Warning,
    Error,
}

/// One located problem in a spec file.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Diagnostic {
    pub severity: Severity,
    pub file: String,
    /// 1-based; 0 when the position is unknown (e.g. a required field is missing from the file).
    pub line: u64,
    /// 1-based; 0 when unknown.
    pub column: u64,
    /// The field path, e.g. `spec.speculative.num_draft_tokens`; empty for syntax errors.
    pub path: String,
    pub message: String,
    /// The source line the position points into.
    #[serde(skip)]
    pub source_line: Option<String>,
}

impl Diagnostic {
    pub fn is_error(&self) -> bool {
        self.severity == Severity::Error
    }
}

/// The user's text inside a diagnostic (a key, a quoted value) with control characters
/// escaped, so that one diagnostic stays on its line (`"a\nb"` is shown as `a\nb`).
fn visible(s: &str) -> std::borrow::Cow<'_, str> {
    if !s.chars().any(char::is_control) {
        return std::borrow::Cow::Borrowed(s);
    }
    std::borrow::Cow::Owned(
        s.chars().map(|c| if c.is_control() { c.escape_default().to_string() } else { c.to_string() }).collect(),
    )
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file)?;
        if self.line > 0 {
            write!(f, ":{}:{}", self.line, self.column)?;
        }
        write!(f, ": ")?;
        if self.severity == Severity::Warning {
            write!(f, "warning: ")?;
        }
        if !self.path.is_empty() {
            // A path holds the user's keys; a long one is cut short.
            match self.path.char_indices().nth(120) {
                Some((cut, _)) => write!(f, "{}…: ", visible(&self.path[..cut]))?,
                None => write!(f, "{}: ", visible(&self.path))?,
            }
        }
        write!(f, "{}", visible(&self.message))?;
        if let Some(src) = &self.source_line {
            let num = self.line.to_string();
            let pad = " ".repeat(num.len());
            // A long line is shown as a window around the column.
            const WIDTH: usize = 120;
            let col = self.column.saturating_sub(1) as usize;
            let len = src.chars().count();
            let start = if len > WIDTH { col.saturating_sub(WIDTH / 2).min(len - WIDTH) } else { 0 };
            let mut shown: String = src.chars().skip(start).take(WIDTH).collect();
            let mut caret_pad: String = src
                .chars()
                .skip(start)
                .take(col.saturating_sub(start))
                .map(|c| if c == '\t' { '\t' } else { ' ' })
                .collect();
            if start > 0 {
                shown.insert(0, '…');
                caret_pad.insert(0, ' ');
            }
            if start + WIDTH < len {
                shown.push('…');
            }
            write!(f, "\n{pad} |\n{num} | {shown}\n{pad} | {caret_pad}^")?;
        }
        Ok(())
    }
}

/// All problems found in one or more files.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Diagnostics(pub Vec<Diagnostic>);

impl Diagnostics {
    pub fn has_errors(&self) -> bool {
        self.0.iter().any(Diagnostic::is_error)
    }
    pub fn errors(&self) -> impl Iterator<Item = &Diagnostic> {
        self.0.iter().filter(|d| d.is_error())
    }
    pub fn warnings(&self) -> impl Iterator<Item = &Diagnostic> {
        self.0.iter().filter(|d| !d.is_error())
    }
}

impl fmt::Display for Diagnostics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{d}")?;
        }
        Ok(())
    }
}

impl std::error::Error for Diagnostics {}

/// Where each field of a YAML document stands: path → (key position, value position).
#[derive(Clone, Debug, Default)]
pub(crate) struct SourceMap {
    pub(crate) file: String,
    lines: Vec<String>,
    entries: BTreeMap<String, (Pos, Pos)>,
    /// A key repeated in its map, by the position of the repetition: its field path.
    repeated: BTreeMap<Pos, String>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Pos {
    pub line: u64,
    pub column: u64,
}

impl From<Location> for Pos {
    fn from(l: Location) -> Self {
        Pos { line: l.line(), column: l.column() }
    }
}

impl SourceMap {
    /// Index a document. A document that does not parse as YAML gives an empty map (its syntax
    /// error is reported by the typed parse, with its own position).
    pub(crate) fn new(file: &str, text: &str) -> SourceMap {
        let mut map = SourceMap {
            file: file.to_string(),
            lines: text.lines().map(str::to_string).collect(),
            entries: BTreeMap::new(),
            repeated: BTreeMap::new(),
        };
        // Every key is seen here, repeated ones too: the first one is indexed (so that a duplicate
        // key, an error of the typed parse, still leaves the document indexed) and a repetition
        // is remembered by its position, to name its field.
        let options = serde_saphyr::options! {
            duplicate_keys: serde_saphyr::DuplicateKeyPolicy::PassThrough,
            non_finite_float_policy: serde_saphyr::NonFiniteFloatPolicy::PassThrough,
        };
        if let Ok(root) = serde_saphyr::from_str_with_options::<Spanned<Node>>(text, options) {
            map.walk("", &root.value);
        }
        map
    }

    fn walk(&mut self, prefix: &str, node: &Node) {
        match node {
            Node::Map(items) => {
                for (k, v) in items {
                    let path = if prefix.is_empty() { k.value.clone() } else { format!("{prefix}.{k}", k = k.value) };
                    if self.entries.contains_key(&path) {
                        self.repeated.insert(k.referenced.into(), path);
                        continue;
                    }
                    self.entries.insert(path.clone(), (k.referenced.into(), v.referenced.into()));
                    self.walk(&path, &v.value);
                }
            }
            Node::Seq(items) => {
                for (i, v) in items.iter().enumerate() {
                    let path = format!("{prefix}[{i}]");
                    self.entries.insert(path.clone(), (v.referenced.into(), v.referenced.into()));
                    self.walk(&path, &v.value);
                }
            }
            Node::Scalar => {}
        }
    }

    /// Position of a field's value, if the field is in the file.
    pub(crate) fn value_pos(&self, path: &str) -> Option<Pos> {
        self.entries.get(path).map(|e| e.1)
    }

    /// Position of a field's key, if the field is in the file.
    pub(crate) fn key_pos(&self, path: &str) -> Option<Pos> {
        self.entries.get(path).map(|e| e.0)
    }

    pub(crate) fn has(&self, path: &str) -> bool {
        self.entries.contains_key(path)
    }

    /// The field a parser position falls in: the deepest one whose key or value stands exactly
    /// there, else the last one that starts before it.
    pub(crate) fn path_at(&self, pos: Pos) -> Option<String> {
        if let Some(p) = self.repeated.get(&pos) {
            return Some(p.clone());
        }
        if let Some((p, _)) =
            self.entries.iter().filter(|(_, (k, v))| *k == pos || *v == pos).max_by_key(|(p, _)| p.len())
        {
            return Some(p.clone());
        }
        self.entries.iter().filter(|(_, (k, _))| *k <= pos).max_by_key(|(_, (k, _))| *k).map(|(p, _)| p.clone())
    }

    pub(crate) fn diag(&self, severity: Severity, pos: Option<Pos>, path: &str, message: String) -> Diagnostic {
        let pos = pos.unwrap_or_default();
        Diagnostic {
            severity,
            file: self.file.clone(),
            line: pos.line,
            column: pos.column,
            path: path.to_string(),
            message,
            source_line: if pos.line > 0 { self.lines.get(pos.line as usize - 1).cloned() } else { None },
        }
    }

    /// A diagnostic at a field: at its value when present, else at the nearest enclosing field
    /// that is in the file (a missing field is reported where it should have been).
    pub(crate) fn at_field(&self, severity: Severity, path: &str, message: String) -> Diagnostic {
        let mut probe = path.to_string();
        let pos = loop {
            if let Some(p) = self.value_pos(&probe) {
                break Some(p);
            }
            match probe.rfind(['.', '[']) {
                Some(i) => probe.truncate(i),
                None => break None,
            }
        };
        // For an enclosing section, point at its key rather than its first child.
        let pos = if probe != path { self.key_pos(&probe).or(pos) } else { pos };
        // A top-level field that is missing belongs at the top of the file.
        let pos = pos.or(Some(Pos { line: 1, column: 1 }));
        self.diag(severity, pos, path, message)
    }
}

/// A YAML node with positions, for [`SourceMap`].
enum Node {
    Map(Vec<(Spanned<KeyText>, Spanned<Node>)>),
    Seq(Vec<Spanned<Node>>),
    Scalar,
}

struct KeyText(String);

impl std::ops::Deref for KeyText {
    type Target = String;
    fn deref(&self) -> &String {
        &self.0
    }
}

impl<'de> Deserialize<'de> for KeyText {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = KeyText;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a scalar key")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<KeyText, E> {
                Ok(KeyText(v.to_string()))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<KeyText, E> {
                Ok(KeyText(v.to_string()))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<KeyText, E> {
                Ok(KeyText(v.to_string()))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<KeyText, E> {
                Ok(KeyText(v.to_string()))
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<KeyText, E> {
                Ok(KeyText(v.to_string()))
            }
            fn visit_unit<E: de::Error>(self) -> Result<KeyText, E> {
                Ok(KeyText("null".into()))
            }
        }
        d.deserialize_any(V)
    }
}

impl std::fmt::Display for KeyText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for Node {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Node;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any YAML node")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Node, A::Error> {
                let mut items = Vec::new();
                while let Some(k) = m.next_key::<Spanned<KeyText>>()? {
                    let v = m.next_value::<Spanned<Node>>()?;
                    items.push((k, v));
                }
                Ok(Node::Map(items))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<Node, A::Error> {
                let mut items = Vec::new();
                while let Some(v) = s.next_element::<Spanned<Node>>()? {
                    items.push(v);
                }
                Ok(Node::Seq(items))
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<Node, E> {
                Ok(Node::Scalar)
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Node, E> {
                Ok(Node::Scalar)
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Node, E> {
                Ok(Node::Scalar)
            }
            fn visit_i128<E: de::Error>(self, _: i128) -> Result<Node, E> {
                Ok(Node::Scalar)
            }
            fn visit_u128<E: de::Error>(self, _: u128) -> Result<Node, E> {
                Ok(Node::Scalar)
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Node, E> {
                Ok(Node::Scalar)
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Node, E> {
                Ok(Node::Scalar)
            }
            fn visit_unit<E: de::Error>(self) -> Result<Node, E> {
                Ok(Node::Scalar)
            }
            fn visit_none<E: de::Error>(self) -> Result<Node, E> {
                Ok(Node::Scalar)
            }
            fn visit_bytes<E: de::Error>(self, _: &[u8]) -> Result<Node, E> {
                Ok(Node::Scalar)
            }
        }
        d.deserialize_any(V)
    }
}
