//! `--write`: the best point's values set in the spec file, the rest of it byte for byte.

use anyhow::Result;
use serde_json::Value;
use specd_spec::ParsedSpec;
use specd_spec::sweep::Point;

/// The base spec file with the point's values written in place of the base's: each value
/// edited where it stands (the rest of the file byte for byte), a field the file leaves out added
/// under its section. The result must render the point's unit, or it is refused.
pub fn edit_spec(base: &ParsedSpec, text: &str, pt: &Point, host: Option<&str>) -> Result<String, String> {
    // The point's unit, or why not.
    let renders = |t: &str| -> Result<(), String> {
        let parsed = specd_spec::parse(base.file(), t).map_err(|d| d.to_string())?;
        let spec = parsed.resolve(host).map_err(|d| d.to_string())?;
        if specd_spec::render(&spec).sha256 == pt.unit.sha256 {
            Ok(())
        } else {
            Err("the edited file would not render the point's unit (does a host overlay set the swept field?)".into())
        }
    };
    // The matrix values, and the fields the engine's rules derive from them where the file
    // writes them (SGLang's draft tokens = steps + 1)...
    let mut out = text.to_string();
    let written = |f: &str| base.position(&format!("spec.{f}")).is_some();
    for (field, value) in pt.values.iter().chain(pt.derived.iter().filter(|(f, _)| written(f))) {
        out = set_value(base.file(), &out, &format!("spec.{field}"), value)?;
    }
    if renders(&out).is_ok() {
        return Ok(out);
    }
    // ...then the derived fields the file leaves out, if the point's unit needs them.
    for (field, value) in pt.derived.iter().filter(|(f, _)| !written(f)) {
        out = set_value(base.file(), &out, &format!("spec.{field}"), value)?;
    }
    renders(&out).map(|()| out)
}

/// A value as YAML writes it: numbers and booleans as they are, a string plain when it reads
/// back as the same string, else double-quoted (JSON's quoting is YAML's).
pub(super) fn yaml_scalar(v: &Value) -> String {
    match v {
        Value::String(s) => {
            let plain = !s.is_empty()
                && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c))
                && !s.starts_with(['-', '.'])
                && s.parse::<f64>().is_err()
                && !matches!(
                    s.to_ascii_lowercase().as_str(),
                    "true" | "false" | "null" | "yes" | "no" | "on" | "off" | "~"
                );
            if plain { s.clone() } else { Value::String(s.clone()).to_string() }
        }
        v => v.to_string(),
    }
}

/// Byte offset of a 1-based (line, column) in `text`.
pub(super) fn offset(text: &str, line: u64, column: u64) -> Option<usize> {
    let start: usize = text.split_inclusive('\n').take(line.saturating_sub(1) as usize).map(str::len).sum();
    let l = text[start..].split('\n').next()?;
    let col = l.char_indices().nth(column.saturating_sub(1) as usize).map_or(l.len(), |(b, _)| b);
    Some(start + col)
}

/// Where the scalar that starts at `at` ends (quoted, or plain up to a comment, a flow
/// separator or the end of the line).
pub(super) fn scalar_end(text: &str, at: usize) -> usize {
    let rest = &text[at..];
    let line = rest.split('\n').next().unwrap_or("");
    let bytes = line.as_bytes();
    match bytes.first() {
        Some(b'"') => {
            let mut i = 1;
            while i < bytes.len() {
                match bytes[i] {
                    b'\\' => i += 2,
                    b'"' => return at + i + 1,
                    _ => i += 1,
                }
            }
            at + line.len()
        }
        Some(b'\'') => {
            let mut i = 1;
            while i < bytes.len() {
                if bytes[i] == b'\'' {
                    if bytes.get(i + 1) == Some(&b'\'') {
                        i += 2;
                        continue;
                    }
                    return at + i + 1;
                }
                i += 1;
            }
            at + line.len()
        }
        _ => {
            let mut end = line.len();
            for (i, c) in line.char_indices() {
                if matches!(c, ',' | '}' | ']') || (c == '#' && i > 0 && line[..i].ends_with([' ', '\t'])) {
                    end = i;
                    break;
                }
            }
            at + line[..end].trim_end().len()
        }
    }
}

/// Set one scalar field of a YAML spec file, in place. A field the file leaves out is added to
/// its section (a block section: a line under it, indented like its first field; a flow
/// section: the first entry).
pub(super) fn set_value(file: &str, text: &str, path: &str, value: &Value) -> Result<String, String> {
    let parsed = specd_spec::parse(file, text).map_err(|d| d.to_string())?;
    let new = yaml_scalar(value);
    if let Some((_, (vl, vc))) = parsed.position(path) {
        let at = offset(text, vl, vc).ok_or_else(|| format!("{path}: position out of the file"))?;
        if text[at..].starts_with(['{', '[', '|', '>']) {
            return Err(format!("{path} is not a single value in {file}"));
        }
        let end = scalar_end(text, at);
        return Ok(format!("{}{new}{}", &text[..at], &text[end..]));
    }
    let (parent, key) = path.rsplit_once('.').ok_or_else(|| format!("{path}: not a field"))?;
    let Some(((kl, _), (vl, vc))) = parsed.position(parent) else {
        return Err(format!("{file} has no `{parent}` section to add `{key}: {new}` to: add it by hand"));
    };
    let at = offset(text, vl, vc).ok_or_else(|| format!("{parent}: position out of the file"))?;
    if text[at..].starts_with('{') {
        let inner = text[at + 1..].trim_start();
        let sep = if inner.starts_with('}') { "" } else { ", " };
        return Ok(format!("{}{{{key}: {new}{sep}{}", &text[..at], &text[at + 1..]));
    }
    if vl > kl {
        // A block section: its first field's column is its indentation.
        let line_start = at - (vc as usize - 1).min(at);
        let indent = &text[line_start..at];
        if indent.chars().all(|c| c == ' ') {
            return Ok(format!("{}{indent}{key}: {new}\n{}", &text[..line_start], &text[line_start..]));
        }
    }
    Err(format!("cannot add `{key}: {new}` under `{parent}` in {file}: add it by hand"))
}
