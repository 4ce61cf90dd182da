//! Python values as vLLM logs them: `repr()` of `None`, `bool`, `int`, `float`, `str`, `list` and
//! `dict`, Python's `==` between them, and JSON read as `json.loads` reads it (an object keeps its
//! keys' order; a repeated key keeps its first place and its last value).

use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};
use std::fmt;

#[derive(Clone, Debug, PartialEq)]
pub enum Py {
    None,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(String),
    List(Vec<Py>),
    Dict(Vec<(String, Py)>),
}

impl Py {
    pub fn str(s: impl Into<String>) -> Py {
        Py::Str(s.into())
    }

    /// `json.loads(text)`.
    pub fn from_json(text: &str) -> Result<Py, String> {
        serde_json::from_str(text).map_err(|e| e.to_string())
    }

    /// The type's name as Python says it (`type(v).__name__`).
    pub fn type_name(&self) -> &'static str {
        match self {
            Py::None => "NoneType",
            Py::Bool(_) => "bool",
            Py::Int(_) => "int",
            Py::Float(_) => "float",
            Py::Str(_) => "str",
            Py::List(_) => "list",
            Py::Dict(_) => "dict",
        }
    }

    pub fn repr(&self) -> String {
        match self {
            Py::None => "None".into(),
            Py::Bool(true) => "True".into(),
            Py::Bool(false) => "False".into(),
            Py::Int(n) => n.to_string(),
            Py::Float(x) => float_repr(*x),
            Py::Str(s) => str_repr(s),
            Py::List(v) => format!("[{}]", v.iter().map(Py::repr).collect::<Vec<_>>().join(", ")),
            Py::Dict(kv) => {
                format!(
                    "{{{}}}",
                    kv.iter().map(|(k, v)| format!("{}: {}", str_repr(k), v.repr())).collect::<Vec<_>>().join(", ")
                )
            }
        }
    }

    /// Python's `==`: `1 == 1.0 == True`, a dict's order does not matter.
    pub fn py_eq(&self, o: &Py) -> bool {
        match (self.number(), o.number()) {
            (Some(a), Some(b)) => return a == b,
            (Some(_), None) | (None, Some(_)) => return false,
            _ => {}
        }
        match (self, o) {
            (Py::List(a), Py::List(b)) => a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.py_eq(y)),
            (Py::Dict(a), Py::Dict(b)) => {
                a.len() == b.len() && a.iter().all(|(k, v)| b.iter().any(|(k2, v2)| k == k2 && v.py_eq(v2)))
            }
            _ => self == o,
        }
    }

    fn number(&self) -> Option<f64> {
        match self {
            Py::Bool(b) => Some(f64::from(u8::from(*b))),
            Py::Int(n) => Some(*n as f64),
            Py::Float(x) => Some(*x),
            _ => None,
        }
    }

    pub fn get(&self, key: &str) -> Option<&Py> {
        match self {
            Py::Dict(kv) => kv.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Py::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn to_json(&self) -> Value {
        match self {
            Py::None => Value::Null,
            Py::Bool(b) => Value::Bool(*b),
            Py::Int(n) => i64::try_from(*n).map(Value::from).unwrap_or_else(|_| Value::from(*n as f64)),
            Py::Float(x) => serde_json::Number::from_f64(*x).map(Value::Number).unwrap_or(Value::Null),
            Py::Str(s) => Value::String(s.clone()),
            Py::List(v) => Value::Array(v.iter().map(Py::to_json).collect()),
            Py::Dict(kv) => Value::Object(kv.iter().map(|(k, v)| (k.clone(), v.to_json())).collect::<Map<_, _>>()),
        }
    }
}

/// `repr(float)`: the shortest digits that read back the same, in positional notation when the
/// decimal point falls within 16 digits of them (`1e-05`, `0.0001`, `1e+16`, `100.0`).
pub fn float_repr(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf" } else { "-inf" }.into();
    }
    if x == 0.0 {
        return if x.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    let sci = format!("{:e}", x.abs());
    let (mant, exp) = sci.split_once('e').expect("LowerExp has an exponent");
    let exp: i32 = exp.parse().expect("LowerExp's exponent is an integer");
    let digits: String = mant.chars().filter(|c| *c != '.').collect();
    let point = exp + 1;
    let body = if !(-4 < point && point <= 16) {
        let m = if digits.len() > 1 { format!("{}.{}", &digits[..1], &digits[1..]) } else { digits };
        format!("{m}e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs())
    } else if point <= 0 {
        format!("0.{}{digits}", "0".repeat(point.unsigned_abs() as usize))
    } else if point as usize >= digits.len() {
        format!("{digits}{}.0", "0".repeat(point as usize - digits.len()))
    } else {
        format!("{}.{}", &digits[..point as usize], &digits[point as usize..])
    };
    if x < 0.0 { format!("-{body}") } else { body }
}

/// A sample value as prometheus_client writes it (`floatToGoString`): `repr(float)`, but a
/// positive value with more than 6 digits before the point in exponent form (`1.0899456e+09`).
pub fn prometheus_float(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "+Inf" } else { "-Inf" }.into();
    }
    let s = float_repr(x);
    match s.find('.') {
        Some(dot) if x > 0.0 && dot > 6 => {
            let m = format!("{}.{}{}", &s[..1], &s[1..dot], &s[dot + 1..]);
            format!("{}e+{:02}", m.trim_end_matches(['0', '.']), dot - 1)
        }
        _ => s,
    }
}

/// `repr(str)`: single quotes unless the text has one and no double quote; backslash escapes for
/// the quote, `\`, `\n`, `\r`, `\t` and what Python does not print.
pub fn str_repr(s: &str) -> String {
    let q = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(q);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == q => {
                out.push('\\');
                out.push(c);
            }
            c if !printable(c) => {
                let n = c as u32;
                if n < 0x100 {
                    out.push_str(&format!("\\x{n:02x}"));
                } else if n < 0x10000 {
                    out.push_str(&format!("\\u{n:04x}"));
                } else {
                    out.push_str(&format!("\\U{n:08x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push(q);
    out
}

/// `str.isprintable()` for one character: false for control, format, separator (but the ASCII
/// space), surrogate and private-use characters. Unassigned code points are taken as printable.
fn printable(c: char) -> bool {
    let n = c as u32;
    !(n < 0x20
        || (0x7f..=0xa0).contains(&n)
        || n == 0xad
        || matches!(n, 0x600..=0x605 | 0x61c | 0x6dd | 0x70f | 0x1680 | 0x180e)
        || matches!(n, 0x2000..=0x200f | 0x2028..=0x202f | 0x205f..=0x2064 | 0x2066..=0x206f | 0x3000)
        || matches!(n, 0xe000..=0xf8ff | 0xfeff | 0xfff9..=0xfffb)
        || n >= 0xf0000)
}

struct PyVisitor;

impl<'de> Visitor<'de> for PyVisitor {
    type Value = Py;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Py, E> {
        Ok(Py::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Py, E> {
        Ok(Py::Int(v.into()))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Py, E> {
        Ok(Py::Int(v.into()))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Py, E> {
        Ok(Py::Float(v))
    }
    fn visit_str<E>(self, v: &str) -> Result<Py, E> {
        Ok(Py::str(v))
    }
    fn visit_string<E>(self, v: String) -> Result<Py, E> {
        Ok(Py::Str(v))
    }
    fn visit_unit<E>(self) -> Result<Py, E> {
        Ok(Py::None)
    }
    fn visit_none<E>(self) -> Result<Py, E> {
        Ok(Py::None)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Py, A::Error> {
        let mut v = Vec::new();
        while let Some(x) = seq.next_element()? {
            v.push(x);
        }
        Ok(Py::List(v))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Py, A::Error> {
        let mut kv: Vec<(String, Py)> = Vec::new();
        while let Some((k, v)) = map.next_entry::<String, Py>()? {
            match kv.iter_mut().find(|(k2, _)| *k2 == k) {
                Some(slot) => slot.1 = v,
                None => kv.push((k, v)),
            }
        }
        Ok(Py::Dict(kv))
    }
}

impl<'de> Deserialize<'de> for Py {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Py, D::Error> {
        d.deserialize_any(PyVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reprs_are_pythons() {
        // Each right-hand side is what python3 printed for the left.
        let s = |x: &str| Py::str(x).repr();
        assert_eq!(s("it's"), r#""it's""#);
        assert_eq!(s(r#"say "hi""#), r#"'say "hi"'"#);
        assert_eq!(s(r#"both ' and ""#), r#"'both \' and "'"#);
        assert_eq!(s("tab\there"), r"'tab\there'");
        assert_eq!(s(r"back\slash"), r"'back\\slash'");
        assert_eq!(s("nb\u{a0}sp"), r"'nb\xa0sp'");
        assert_eq!(s("é"), "'é'");
        assert_eq!(s("\u{2028}"), r"'\u2028'");
        let f = |x: f64| Py::Float(x).repr();
        assert_eq!(f(1e-5), "1e-05");
        assert_eq!(f(1e16), "1e+16");
        assert_eq!(f(1e15), "1000000000000000.0");
        assert_eq!(f(0.0001), "0.0001");
        assert_eq!(f(0.92), "0.92");
        assert_eq!(f(1e22), "1e+22");
        assert_eq!(f(-0.0), "-0.0");
        assert_eq!(f(100000.0), "100000.0");
        assert_eq!(f(123456789012345678.0), "1.2345678901234568e+17");
        assert_eq!(f(0.1 + 0.2), "0.30000000000000004");
        assert_eq!(prometheus_float(1089945600.0), "1.0899456e+09");
        assert_eq!(prometheus_float(1796334584.6599345), "1.7963345846599345e+09");
        assert_eq!(prometheus_float(20000.0), "20000.0");
        let d = Py::from_json(r#"{"a": [1, 2.0, null, true], "b": {"c": "d"}}"#).unwrap();
        assert_eq!(d.repr(), "{'a': [1, 2.0, None, True], 'b': {'c': 'd'}}");
    }

    #[test]
    fn json_keeps_the_order_and_equality_is_pythons() {
        let d = Py::from_json(r#"{"z": 1, "a": 2, "z": 3}"#).unwrap();
        assert_eq!(d.repr(), "{'z': 3, 'a': 2}");
        assert!(Py::Int(1).py_eq(&Py::Float(1.0)) && Py::Int(1).py_eq(&Py::Bool(true)));
        assert!(!Py::Int(0).py_eq(&Py::None) && !Py::str("1").py_eq(&Py::Int(1)));
        let a = Py::from_json(r#"{"x": 1, "y": 2}"#).unwrap();
        assert!(a.py_eq(&Py::from_json(r#"{"y": 2, "x": 1.0}"#).unwrap()));
    }
}
