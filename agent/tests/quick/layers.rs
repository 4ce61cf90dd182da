//! The layers of the `specd` crate, checked on its source: a module refers (`crate::x`, `use
//! crate::{x, y}`) only to modules of its own layer or of a lower one, and the references of
//! modules form no cycle. A module that is a directory (`x/mod.rs`, `x/*.rs`) is one module, `x`.
//!
//! Every module must have a layer in [`LAYERS`]; a new module is placed there on purpose.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// From the lowest layer to the highest. Below all of them: the `specd-spec` crate.
const LAYERS: &[(&str, &[&str])] = &[
    // Every decision and the records it decides on; no I/O (`core_names_no_io` reads it).
    ("core", &["core"]),
    // The machine's parts: systemd over D-Bus, cgroups, processes, the servers' HTTP, files,
    // locks, specd's state files, its log stream.
    ("machine", &["machine"]),
    // What the host can tell before a start (the pre-flight) and after an end (the diagnosis).
    ("looks", &["preflight", "diagnose"]),
    // The one boundary between the reconciler and the machine.
    ("host", &["host"]),
    // Observe, plan, act, conclude, record: drives the host.
    ("reconcile", &["reconcile"]),
    // Where desired states come from (git, files), the agent's config, webhook notices.
    ("source", &["source"]),
    ("config", &["config"]),
    ("notify", &["notify"]),
    // The answers to the units' load balancers (agent-check, HTTP checks).
    ("lb", &["lb"]),
    // The one-shot commands, then what runs on top of them: sweeps, `specd tune` (and its
    // proposals), the fleet's promoter, the agent.
    ("commands", &["commands"]),
    ("above", &["sweep", "tune", "fleet", "daemon"]),
    // Argument parsing.
    ("cli", &["cli"]),
];

/// References that break the layering today, each with what stands in the way. An entry that
/// is no longer needed fails the test too, so this list only shrinks.
const KNOWN: &[(&str, &str, &str)] = &[];

/// A reference of one module to another, where it is written.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Ref {
    from: String,
    to: String,
    file: String,
    line: usize,
}

/// The module a file under `src/` belongs to: `x.rs`, `x/mod.rs` and `x/**/*.rs` belong to `x`;
/// `lib.rs` and `main.rs` to none (the crate root).
fn module_of(rel: &str) -> Option<String> {
    let first = rel.split('/').next()?;
    if rel.contains('/') {
        return Some(first.to_string());
    }
    let stem = first.strip_suffix(".rs")?;
    (!matches!(stem, "lib" | "main")).then(|| stem.to_string())
}

/// The modules a file refers to by `crate::` paths, with line numbers. Comments are skipped
/// (a doc link is not a dependency); `use crate::{a, b::c}` refers to `a` and `b`, also when the
/// group spans several lines.
fn references(text: &str) -> Vec<(String, usize)> {
    let mut out = Vec::new();
    // Inside `crate::{ … }`: the depth of braces, and whether the next word names a module.
    let mut group: Option<(usize, bool)> = None;
    for (i, raw) in text.lines().enumerate() {
        let line = match raw.find("//") {
            Some(c) => &raw[..c],
            None => raw,
        };
        let mut rest = line;
        loop {
            if let Some((depth, expect)) = group.as_mut() {
                // Walk the group token by token.
                let t = rest.trim_start();
                let Some(c) = t.chars().next() else { break };
                match c {
                    '{' => {
                        *depth += 1;
                        *expect = true;
                        rest = &t[1..];
                    }
                    '}' => {
                        *depth -= 1;
                        *expect = false;
                        rest = &t[1..];
                        if *depth == 0 {
                            group = None;
                        }
                    }
                    ',' => {
                        // A comma at depth 1 starts the next top-level path.
                        *expect = *depth == 1;
                        rest = &t[1..];
                    }
                    _ => {
                        let word = t.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(t.len());
                        if *expect && *depth == 1 && word > 0 {
                            out.push((t[..word].to_string(), i + 1));
                        }
                        // A word, or one other character (`::`, `*`, `as`'s space…).
                        let end = if word > 0 { word } else { c.len_utf8() };
                        *expect = false;
                        rest = &t[end..];
                    }
                }
                continue;
            }
            let Some(at) = rest.find("crate::") else { break };
            // `$crate::` and `specd_crate::` are not this crate's paths.
            let before = rest[..at].chars().next_back();
            rest = &rest[at + "crate::".len()..];
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$') {
                continue;
            }
            if let Some(r) = rest.strip_prefix('{') {
                group = Some((1, true));
                rest = r;
                continue;
            }
            let end = rest.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(rest.len());
            if end > 0 {
                out.push((rest[..end].to_string(), i + 1));
            }
            rest = &rest[end..];
        }
    }
    out
}

/// Check the crate's files (`(path under src/, text)`): every violation, each naming where.
fn check(files: &[(String, String)], layers: &[(&str, &[&str])], known: &[(&str, &str, &str)]) -> Vec<String> {
    let layer_of = |m: &str| layers.iter().position(|(_, ms)| ms.contains(&m));
    let modules: BTreeSet<String> = files.iter().filter_map(|(p, _)| module_of(p)).collect();
    let mut errors = Vec::new();
    for m in &modules {
        if layer_of(m).is_none() {
            errors.push(format!("module {m} has no layer: add it to LAYERS in agent/tests/layers.rs"));
        }
    }
    let mut refs = Vec::new();
    for (path, text) in files {
        let Some(from) = module_of(path) else { continue };
        for (to, line) in references(text) {
            // `crate::x` where x is not a module is an item of the crate root.
            if to != from && modules.contains(&to) {
                refs.push(Ref { from: from.clone(), to, file: format!("agent/src/{path}"), line });
            }
        }
    }
    let is_known = |r: &Ref| known.iter().any(|(f, t, _)| *f == r.from && *t == r.to);
    for (f, t, why) in known {
        if !refs.iter().any(|r| r.from == *f && r.to == *t) {
            errors.push(format!("{f} no longer refers to {t}: remove it from KNOWN ({why})"));
        }
    }
    for r in &refs {
        let (Some(lf), Some(lt)) = (layer_of(&r.from), layer_of(&r.to)) else { continue };
        if lt > lf && !is_known(r) {
            errors.push(format!(
                "{}:{}: {} ({}) refers to {} ({}), a higher layer",
                r.file, r.line, r.from, layers[lf].0, r.to, layers[lt].0
            ));
        }
    }
    // Cycles: the first reference of each edge stands for it.
    let mut edges: BTreeMap<&str, BTreeMap<&str, &Ref>> = BTreeMap::new();
    for r in refs.iter().filter(|r| !is_known(r)) {
        edges.entry(&r.from).or_default().entry(&r.to).or_insert(r);
    }
    let mut reported = BTreeSet::new();
    for start in edges.keys() {
        if let Some(cycle) = cycle_from(start, &edges) {
            let mut key: Vec<&str> = cycle.iter().map(|r| r.from.as_str()).collect();
            key.sort();
            if reported.insert(key) {
                let path: Vec<String> =
                    cycle.iter().map(|r| format!("{} -> {} ({}:{})", r.from, r.to, r.file, r.line)).collect();
                errors.push(format!("cycle: {}", path.join(", ")));
            }
        }
    }
    errors
}

/// A path of references from `start` back to `start`, if there is one.
fn cycle_from<'a>(start: &'a str, edges: &BTreeMap<&'a str, BTreeMap<&'a str, &'a Ref>>) -> Option<Vec<&'a Ref>> {
    fn walk<'a>(
        at: &'a str,
        start: &'a str,
        edges: &BTreeMap<&'a str, BTreeMap<&'a str, &'a Ref>>,
        seen: &mut BTreeSet<&'a str>,
        path: &mut Vec<&'a Ref>,
    ) -> bool {
        for (to, r) in edges.get(at).into_iter().flatten() {
            path.push(r);
            if *to == start {
                return true;
            }
            if seen.insert(to) && walk(to, start, edges, seen, path) {
                return true;
            }
            path.pop();
        }
        false
    }
    let mut path = Vec::new();
    walk(start, start, edges, &mut BTreeSet::new(), &mut path).then_some(path)
}

#[test]
fn modules_refer_only_to_their_own_or_lower_layers_and_never_in_a_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let files = crate::source::rust_files(&src);
    assert!(files.len() > 10, "read {} files from {}", files.len(), src.display());
    let errors = check(&files, LAYERS, KNOWN);
    assert!(errors.is_empty(), "the layers are broken:\n{}", errors.join("\n"));
}

// The checker itself, on small crates made up here.

fn files(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter().map(|(p, t)| (p.to_string(), t.to_string())).collect()
}

const TOY: &[(&str, &[&str])] = &[("low", &["a", "b"]), ("high", &["c", "d"])];

#[test]
fn an_upward_reference_fails_naming_file_and_line() {
    let f = files(&[("a.rs", "use std::fmt;\n\nuse crate::c::Thing;\n"), ("c.rs", "use crate::b;\n"), ("b.rs", "")]);
    assert_eq!(check(&f, TOY, &[]), ["agent/src/a.rs:3: a (low) refers to c (high), a higher layer"]);
    // Downward and same-layer references are fine.
    let f =
        files(&[("c.rs", "use crate::{a, d};\n"), ("d.rs", "fn f() { crate::b::g() }\n"), ("a.rs", ""), ("b.rs", "")]);
    assert_eq!(check(&f, TOY, &[]), Vec::<String>::new());
}

#[test]
fn a_cycle_fails_even_within_a_layer() {
    let f = files(&[("a.rs", "use crate::b;\n"), ("b.rs", "\nfn f() { let _ = crate::a::X; }\n")]);
    let e = check(&f, TOY, &[]);
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(e[0].starts_with("cycle: "), "{e:?}");
    assert!(e[0].contains("a -> b (agent/src/a.rs:1)") && e[0].contains("b -> a (agent/src/b.rs:2)"), "{e:?}");
}

#[test]
fn grouped_and_multi_line_imports_are_read() {
    let text = "use crate::{\n    b::{X, Y},\n    c::Z,\n    self as me,\n};\nuse crate::{d};\n";
    let got: Vec<(String, usize)> = references(text);
    let names: Vec<&str> = got.iter().map(|(m, _)| m.as_str()).collect();
    assert_eq!(names, ["b", "c", "self", "d"]);
    assert_eq!(got[1].1, 3);
    // Nested groups name items, not modules; comments and other crates' paths are not read.
    assert_eq!(references("use crate::a::{b, c};"), [("a".to_string(), 1)]);
    assert!(references("// see crate::c\n/// [`crate::c`]\nuse specd_crate::c;\n$crate::c").is_empty());
}

#[test]
fn a_directory_is_one_module() {
    assert_eq!(module_of("c/mod.rs").as_deref(), Some("c"));
    assert_eq!(module_of("c/inner/x.rs").as_deref(), Some("c"));
    assert_eq!(module_of("lib.rs"), None);
    let f = files(&[("a/mod.rs", "mod x;\n"), ("a/x.rs", "use crate::a::y;\nuse crate::d;\n"), ("d.rs", "")]);
    assert_eq!(check(&f, TOY, &[]), ["agent/src/a/x.rs:2: a (low) refers to d (high), a higher layer"]);
}

#[test]
fn a_module_without_a_layer_and_a_stale_exception_fail() {
    let f = files(&[("a.rs", ""), ("z.rs", "use crate::a;\n")]);
    assert_eq!(check(&f, TOY, &[]), ["module z has no layer: add it to LAYERS in agent/tests/layers.rs"]);
    let f = files(&[("a.rs", "use crate::c;\n"), ("c.rs", "")]);
    assert_eq!(check(&f, TOY, &[("a", "c", "why")]), Vec::<String>::new());
    let f = files(&[("a.rs", ""), ("c.rs", "")]);
    assert_eq!(check(&f, TOY, &[("a", "c", "why")]), ["a no longer refers to c: remove it from KNOWN (why)"]);
}
