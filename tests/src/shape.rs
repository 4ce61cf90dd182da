//! Compares a reply of the stand-in with the shape of the real engine's reply
//! (`tests/fixtures/engines/<engine>/*.shape.json`, or a shape derived from a
//! recorded real reply), and a Prometheus exposition with the engine's metric
//! list (`metrics.txt`).
//!
//! The rule: every field the stand-in reports exists in the real reply with
//! the same name, JSON type and nesting. The stand-in may report fewer fields,
//! never extra or differently typed ones.
//!
//! Shape vocabulary (see `tests/fixtures/engines/FACTS.md`): a leaf is a type
//! tag `int`, `float`, `str`, `bool`, `null`, `list`, `object` or `any`,
//! alternatives joined by `|`, optionally followed by a note in parentheses
//! (`"float (optional: speculative)"`). A list is `[<element shape>]`. In an
//! object, keys starting with `_` are notes, except `_nullable` (the object
//! may be `null`), `_items` (a nullable list: `{"_nullable": true, "_items":
//! [...]}`), `_oneof` (any of the alternatives) and `_server_args_fields`
//! (plus one key per SGLang `ServerArgs` field, typed by [`ServerArgs`]).

use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};

const TAGS: &[&str] = &["int", "float", "str", "bool", "null", "list", "object", "any"];

/// The JSON type tag of a value, as the shapes write it.
pub fn type_tag(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "bool",
        Value::Number(n) if n.is_i64() || n.is_u64() => "int",
        Value::Number(_) => "float",
        Value::String(_) => "str",
        Value::Array(_) => "list",
        Value::Object(_) => "object",
    }
}

/// The tags of a leaf such as `"int|str|null (type=stop)"`; an error for a
/// tag outside the vocabulary (so a misread shape fails loudly).
pub fn leaf_tags(leaf: &str) -> Result<BTreeSet<String>, String> {
    let head = leaf.split(" (").next().unwrap_or(leaf).trim();
    let tags: BTreeSet<String> = head.split('|').map(|t| t.trim().to_string()).collect();
    match tags.iter().find(|t| !TAGS.contains(&t.as_str())) {
        Some(bad) => Err(format!("unknown type tag {bad:?} in shape leaf {leaf:?}")),
        None => Ok(tags),
    }
}

fn leaf_matches(tags: &BTreeSet<String>, v: &Value) -> bool {
    tags.contains("any") || tags.contains(type_tag(v))
}

/// SGLang's `ServerArgs` fields (`server_args.fields.json`): the tags each
/// field's annotation allows.
#[derive(Debug, Default, Clone)]
pub struct ServerArgs {
    pub fields: BTreeMap<String, BTreeSet<String>>,
}

impl ServerArgs {
    /// From the parsed `server_args.fields.json` (`[{name, type, default}]`).
    pub fn from_fields(fields: &Value) -> ServerArgs {
        let mut out = BTreeMap::new();
        for f in fields.as_array().into_iter().flatten() {
            let Some(name) = f["name"].as_str() else { continue };
            let mut tags = python_tags(f["type"].as_str().unwrap_or("Any"));
            // A field annotated `float` whose default is written as an int
            // (`watchdog_timeout: float = 300`) holds that int.
            if tags.contains("float") && type_tag(&f["default"]) == "int" {
                tags.insert("int".into());
            }
            out.insert(name.to_string(), tags);
        }
        ServerArgs { fields: out }
    }
}

/// The JSON tags a Python annotation allows (`Optional[List[int]]` →
/// `list|null`); `any` for what it cannot tell.
pub fn python_tags(ann: &str) -> BTreeSet<String> {
    let ann = ann.trim();
    let mut out = BTreeSet::new();
    let (head, inner) = match ann.find('[') {
        Some(i) if ann.ends_with(']') => (&ann[..i], &ann[i + 1..ann.len() - 1]),
        _ => (ann, ""),
    };
    match head {
        "Optional" => {
            out.insert("null".into());
            out.extend(python_tags(inner));
        }
        "Union" => {
            for part in split_top(inner) {
                out.extend(python_tags(part));
            }
        }
        "Literal" => {
            for part in split_top(inner) {
                let p = part.trim();
                out.insert(
                    if p == "None" {
                        "null"
                    } else if p.starts_with('\'') || p.starts_with('"') {
                        "str"
                    } else if p == "True" || p == "False" {
                        "bool"
                    } else if p.parse::<i64>().is_ok() {
                        "int"
                    } else {
                        "any"
                    }
                    .into(),
                );
            }
        }
        "List" | "list" | "Tuple" | "tuple" | "set" | "Set" => {
            out.insert("list".into());
        }
        "Dict" | "dict" => {
            out.insert("object".into());
        }
        "str" => {
            out.insert("str".into());
        }
        "int" => {
            out.insert("int".into());
        }
        "float" => {
            out.insert("float".into());
        }
        "bool" => {
            out.insert("bool".into());
        }
        "None" => {
            out.insert("null".into());
        }
        _ => {
            out.insert("any".into());
        }
    }
    out
}

/// Splits `a, b[c, d], e` at the top-level commas.
fn split_top(s: &str) -> Vec<&str> {
    let (mut depth, mut start, mut out) = (0i32, 0, Vec::new());
    for (i, c) in s.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out
}

/// Checks `actual` against `shape`; returns one line per disagreement
/// (`path: what`), empty when the reply could be the real engine's.
pub fn check(actual: &Value, shape: &Value, server_args: Option<&ServerArgs>) -> Vec<String> {
    let mut errs = Vec::new();
    walk(actual, shape, server_args, "$", &mut errs);
    errs
}

fn walk(v: &Value, shape: &Value, sa: Option<&ServerArgs>, path: &str, errs: &mut Vec<String>) {
    match shape {
        Value::String(leaf) => match leaf_tags(leaf) {
            Ok(tags) if leaf_matches(&tags, v) => {}
            Ok(_) => errs.push(format!("{path}: the stand-in reports {} ({v}), the real engine {leaf:?}", type_tag(v))),
            Err(e) => errs.push(format!("{path}: {e}")),
        },
        Value::Array(elems) => {
            let Some(elem) = elems.first() else {
                errs.push(format!("{path}: empty list shape"));
                return;
            };
            match v {
                Value::Array(items) => {
                    for (i, x) in items.iter().enumerate() {
                        walk(x, elem, sa, &format!("{path}[{i}]"), errs);
                    }
                }
                _ => errs.push(format!("{path}: the stand-in reports {} ({v}), the real engine a list", type_tag(v))),
            }
        }
        Value::Object(m) => {
            let nullable = m.get("_nullable") == Some(&Value::Bool(true));
            if v.is_null() && nullable {
                return;
            }
            if let Some(alts) = m.get("_oneof").and_then(Value::as_array) {
                let mut best: Option<Vec<String>> = None;
                for alt in alts {
                    let mut e = Vec::new();
                    walk(v, alt, sa, path, &mut e);
                    if e.is_empty() {
                        return;
                    }
                    if best.as_ref().is_none_or(|b| e.len() < b.len()) {
                        best = Some(e);
                    }
                }
                errs.extend(best.unwrap_or_else(|| vec![format!("{path}: empty _oneof")]));
                return;
            }
            if let Some(items) = m.get("_items") {
                walk(v, items, sa, path, errs);
                return;
            }
            let Value::Object(obj) = v else {
                errs.push(format!("{path}: the stand-in reports {} ({v}), the real engine an object", type_tag(v)));
                return;
            };
            let args_tags = m.get("_server_args_fields").and_then(Value::as_str);
            for (k, x) in obj {
                let p = format!("{path}.{k}");
                if !k.starts_with('_')
                    && let Some(s) = m.get(k)
                {
                    walk(x, s, sa, &p, errs);
                } else if let Some(generic) = args_tags {
                    match sa.and_then(|sa| sa.fields.get(k)) {
                        Some(tags) if leaf_matches(tags, x) => {}
                        Some(tags) => errs.push(format!(
                            "{p}: the stand-in reports {} ({x}), the real ServerArgs field is {tags:?}",
                            type_tag(x)
                        )),
                        None if sa.is_none() => walk(x, &Value::String(generic.into()), sa, &p, errs),
                        None => errs.push(format!("{p}: not a field of the real reply (nor a ServerArgs field)")),
                    }
                } else {
                    errs.push(format!("{p}: not a field of the real reply"));
                }
            }
        }
        _ => errs.push(format!("{path}: unreadable shape {shape}")),
    }
}

/// The shape of a real reply (what the fixture recorder writes as
/// `*.shape.json`): each leaf replaced by its type tag, a list's elements
/// merged into one shape, an empty list `"list"`. Keys starting with `_` (the
/// recorder's notes, e.g. `_status`) are left out.
pub fn shape_of(v: &Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.iter().filter(|(k, _)| !k.starts_with('_')).map(|(k, x)| (k.clone(), shape_of(x))).collect(),
        ),
        Value::Array(items) if items.is_empty() => Value::String("list".into()),
        Value::Array(items) => {
            let mut merged = shape_of(&items[0]);
            for x in &items[1..] {
                merged = merge_shapes(&merged, &shape_of(x));
            }
            Value::Array(vec![merged])
        }
        _ => Value::String(type_tag(v).into()),
    }
}

/// The union of two shapes: an object has the keys of both, differing leaves
/// join their tags.
pub fn merge_shapes(a: &Value, b: &Value) -> Value {
    if a == b {
        return a.clone();
    }
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let mut out = x.clone();
            for (k, w) in y {
                let merged = match x.get(k) {
                    Some(v) => merge_shapes(v, w),
                    None => w.clone(),
                };
                out.insert(k.clone(), merged);
            }
            Value::Object(out)
        }
        (Value::Array(x), Value::Array(y)) if !x.is_empty() && !y.is_empty() => {
            Value::Array(vec![merge_shapes(&x[0], &y[0])])
        }
        _ => {
            let tag = |s: &Value| match s {
                Value::String(t) => t.split(" (").next().unwrap_or(t).to_string(),
                Value::Object(_) => "object".into(),
                _ => "list".into(),
            };
            let mut tags: Vec<String> = Vec::new();
            for t in tag(a).split('|').chain(tag(b).split('|')) {
                if !tags.iter().any(|x| x == t) {
                    tags.push(t.to_string());
                }
            }
            Value::String(tags.join("|"))
        }
    }
}

/// One metric family of the real engine.
#[derive(Debug, Clone, PartialEq)]
pub struct Metric {
    /// `counter`, `gauge`, `histogram`, `summary`.
    pub kind: String,
    /// The sample names it is exposed as (`x_total`, `x_bucket`, ...).
    pub exposed: BTreeSet<String>,
}

/// `metrics.txt` of SGLang/vLLM: `name, type, labels, exposed as, defined at`
/// (tab-separated, `#` comments).
pub fn metrics_table(text: &str) -> BTreeMap<String, Metric> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let cols: Vec<&str> = line.split('\t').collect();
        if cols.len() < 4 {
            continue;
        }
        out.insert(
            cols[0].to_string(),
            Metric { kind: cols[1].to_string(), exposed: cols[3].split_whitespace().map(String::from).collect() },
        );
    }
    out
}

/// The families of a Prometheus exposition (`# TYPE` lines and the sample
/// names under each), e.g. a recorded real `/metrics` body.
pub fn exposition_families(body: &str) -> Result<BTreeMap<String, Metric>, String> {
    let mut out: BTreeMap<String, Metric> = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in body.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut it = rest.split_whitespace();
            let (Some(name), Some(kind)) = (it.next(), it.next()) else {
                return Err(format!("unreadable TYPE line {line:?}"));
            };
            out.insert(name.to_string(), Metric { kind: kind.to_string(), exposed: BTreeSet::new() });
            current = Some(name.to_string());
        } else if line.starts_with('#') || line.trim().is_empty() {
            continue;
        } else {
            let sample = line.split(['{', ' ']).next().unwrap_or_default().to_string();
            let Some(fam) = current.as_ref().filter(|f| sample.starts_with(f.as_str())) else {
                return Err(format!("sample {sample:?} without a TYPE line for its family"));
            };
            out.get_mut(fam).expect("family inserted").exposed.insert(sample);
        }
    }
    Ok(out)
}

/// The label names of each sample of an exposition (`name{a="x",b="y"} 1.0` gives `name` ->
/// `[a, b]`), every set a sample name is seen with.
pub fn exposition_label_sets(body: &str) -> Result<BTreeMap<String, BTreeSet<Vec<String>>>, String> {
    let mut out: BTreeMap<String, BTreeSet<Vec<String>>> = BTreeMap::new();
    for line in body.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()) {
        let (name, rest) = match line.find(['{', ' ']) {
            Some(i) => (&line[..i], &line[i..]),
            None => return Err(format!("unreadable sample {line:?}")),
        };
        let mut names = Vec::new();
        if let Some(mut r) = rest.strip_prefix('{') {
            while !r.starts_with('}') {
                let (k, v) = r.split_once("=\"").ok_or_else(|| format!("unreadable labels in {line:?}"))?;
                names.push(k.trim_start_matches(',').to_string());
                // The value ends at the first quote not escaped by a backslash.
                let mut end = None;
                let mut escaped = false;
                for (i, c) in v.char_indices() {
                    match c {
                        '\\' if !escaped => escaped = true,
                        '"' if !escaped => {
                            end = Some(i);
                            break;
                        }
                        _ => escaped = false,
                    }
                }
                let end = end.ok_or_else(|| format!("unterminated label value in {line:?}"))?;
                r = v[end + 1..].trim_start_matches(',');
            }
        }
        out.entry(name.to_string()).or_default().insert(names);
    }
    Ok(out)
}

/// Checks a stand-in's `/metrics` body against the real engine's metrics:
/// each family it declares exists with the same type, each sample name is one
/// the real family exposes.
pub fn check_metrics(body: &str, real: &BTreeMap<String, Metric>) -> Vec<String> {
    let fams = match exposition_families(body) {
        Ok(f) => f,
        Err(e) => return vec![e],
    };
    let mut errs = Vec::new();
    for (name, m) in &fams {
        match real.get(name) {
            None => errs.push(format!("metric {name} ({}) does not exist in the real engine", m.kind)),
            Some(r) if r.kind != m.kind => {
                errs.push(format!("metric {name}: the stand-in says {}, the real engine {}", m.kind, r.kind))
            }
            Some(r) => {
                for s in m.exposed.difference(&r.exposed) {
                    errs.push(format!(
                        "metric {name}: sample {s} is not exposed by the real engine (it has {:?})",
                        r.exposed
                    ));
                }
            }
        }
    }
    errs
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn leaves_nesting_and_extras() {
        let shape = json!({"a": "int", "b": {"c": "float (optional: x)", "_note": "n"}, "l": ["str|null"]});
        assert!(check(&json!({"a": 1, "b": {"c": 1.5}, "l": ["x", null]}), &shape, None).is_empty());
        assert!(check(&json!({"a": 1}), &shape, None).is_empty(), "fewer fields are fine");
        let e = check(&json!({"a": 1.0, "b": {"c": 1}, "z": 0, "l": [3]}), &shape, None);
        assert_eq!(e.len(), 4, "{e:?}");
        assert!(check(&json!({"b": null}), &shape, None).len() == 1);
        assert!(leaf_tags("200|503").is_err());
    }

    #[test]
    fn nullable_items_oneof() {
        let shape =
            json!({"x": {"_nullable": true, "_items": ["int"]}, "y": {"_oneof": [{"a": "int"}, [{"a": "int"}]]}});
        assert!(check(&json!({"x": null, "y": [{"a": 1}]}), &shape, None).is_empty());
        assert!(check(&json!({"x": [1], "y": {"a": 1}}), &shape, None).is_empty());
        assert_eq!(check(&json!({"x": ["s"], "y": {"a": "s"}}), &shape, None).len(), 2);
    }

    #[test]
    fn server_args_fields_are_typed() {
        let sa = ServerArgs::from_fields(&json!([
            {"name": "tp_size", "type": "int", "default": 1},
            {"name": "max_running_requests", "type": "Optional[int]", "default": null},
            {"name": "watchdog_timeout", "type": "float", "default": 300},
        ]));
        let shape = json!({"_server_args_fields": "str|int", "version": "str"});
        assert!(
            check(&json!({"tp_size": 2, "max_running_requests": null, "watchdog_timeout": 300}), &shape, Some(&sa))
                .is_empty()
        );
        assert_eq!(check(&json!({"tp_size": "2", "bogus": 1}), &shape, Some(&sa)).len(), 2);
    }

    #[test]
    fn shape_of_real_json() {
        let v = json!({"_status": 200, "a": [{"x": 1}, {"x": null, "y": "s"}], "e": [], "f": 0.5});
        assert_eq!(shape_of(&v), json!({"a": [{"x": "int|null", "y": "str"}], "e": "list", "f": "float"}));
    }

    #[test]
    fn metrics() {
        let real = metrics_table(
            "# c\nvllm:spec_decode_num_drafts\tcounter\tx\tvllm:spec_decode_num_drafts_total\tf\nvllm:g\tgauge\tx\tvllm:g\tf\n",
        );
        let ok = "# TYPE vllm:spec_decode_num_drafts counter\nvllm:spec_decode_num_drafts_total{a=\"b\"} 1.0\n# TYPE vllm:g gauge\nvllm:g 0\n";
        let sets = exposition_label_sets("x{a=\"1,\\\"2\",b=\"\"} 1\nx 2\ny{c=\"3\"} 1.0\n").unwrap();
        assert_eq!(sets["x"], [vec!["a".to_string(), "b".to_string()], vec![]].into_iter().collect());
        assert_eq!(sets["y"], [vec!["c".to_string()]].into_iter().collect());
        assert!(check_metrics(ok, &real).is_empty());
        let bad = "# TYPE vllm:g counter\nvllm:g_total 1\n# TYPE vllm:h gauge\nvllm:h 1\n";
        assert_eq!(check_metrics(bad, &real).len(), 2);
        assert_eq!(check_metrics("vllm:g 1\n", &real).len(), 1);
    }
}
