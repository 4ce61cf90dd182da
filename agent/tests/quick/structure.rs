//! The shape of the production code, checked on its source: no function of either crate
//! (`agent/src`, `spec/src`) is longer than [`MAX_LINES`], from its `fn` line to its closing brace.
//! A long function is split into pieces that each make one decision or do one stage.
//!
//! Test code is exempt: `#[cfg(test)]` items (a module inline, or a file declared `#[cfg(test)] mod x;`)
//! and files named `tests.rs`.

use std::collections::BTreeSet;
use std::path::Path;

/// The most lines a production function may have, its `fn` line and closing brace included.
const MAX_LINES: usize = 100;

/// Functions over [`MAX_LINES`] today (file, name), each with what stands in the way. An entry
/// that is no longer needed fails the test too, so this list only shrinks.
const KNOWN: &[(&str, &str, &str)] = &[];

/// A function found in a file: its name (with the `impl`, `trait`, `mod` and `fn` it is inside,
/// `Type::method`, `outer::inner`), the line of its `fn` and the line of its closing brace.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Function {
    name: String,
    first: usize,
    last: usize,
}

impl Function {
    fn lines(&self) -> usize {
        self.last - self.first + 1
    }
}

/// The text with comments, string and character literals blanked to spaces (newlines kept, so
/// lines still count), so that no brace or word inside them is read as code. Lifetimes (`'a`)
/// stay.
fn code_only(text: &str) -> String {
    let c: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    // Blank c[from..to] into `out`, keeping its newlines.
    let blank = |out: &mut String, from: usize, to: usize| {
        out.extend(c[from..to].iter().map(|&ch| if ch == '\n' { '\n' } else { ' ' }));
    };
    let ident = |ch: char| ch.is_alphanumeric() || ch == '_';
    let mut i = 0;
    while i < c.len() {
        let prev_ident = i > 0 && ident(c[i - 1]);
        let end = if c[i] == '/' && c.get(i + 1) == Some(&'/') {
            // A line comment, to the end of its line.
            (i..c.len()).find(|&j| c[j] == '\n').unwrap_or(c.len())
        } else if c[i] == '/' && c.get(i + 1) == Some(&'*') {
            // A block comment; they nest.
            let (mut j, mut depth) = (i + 2, 1);
            while j < c.len() && depth > 0 {
                if c[j] == '/' && c.get(j + 1) == Some(&'*') {
                    depth += 1;
                    j += 2;
                } else if c[j] == '*' && c.get(j + 1) == Some(&'/') {
                    depth -= 1;
                    j += 2;
                } else {
                    j += 1;
                }
            }
            j
        } else if let Some(end) = (!prev_ident).then(|| raw_string(&c, i)).flatten() {
            end
        } else if c[i] == '"' {
            // A string (also the rest of `b"…"` and `c"…"`), with its escapes.
            let mut j = i + 1;
            while j < c.len() && c[j] != '"' {
                j += if c[j] == '\\' { 2 } else { 1 };
            }
            j + 1
        } else if c[i] == '\'' && c.get(i + 1) == Some(&'\\') {
            // An escaped character: '\n', '\'', '\u{7f}'.
            let mut j = i + 2;
            while j < c.len() && c[j] != '\'' {
                j += 1;
            }
            j + 1
        } else if c[i] == '\'' && c.get(i + 2) == Some(&'\'') {
            // A plain character: 'x', '{', '"'. Otherwise a lifetime or a label.
            i + 3
        } else {
            out.push(c[i]);
            i += 1;
            continue;
        };
        let end = end.min(c.len());
        blank(&mut out, i, end);
        i = end;
    }
    out
}

/// Where the raw string starting at `c[i]` (`r"…"`, `r#"…"#`, `br#"…"#`) ends, if one does.
fn raw_string(c: &[char], i: usize) -> Option<usize> {
    let mut j = i;
    if c[j] == 'b' || c[j] == 'c' {
        j += 1;
    }
    if c.get(j) != Some(&'r') {
        return None;
    }
    j += 1;
    let hashes = c[j..].iter().take_while(|&&ch| ch == '#').count();
    j += hashes;
    if c.get(j) != Some(&'"') {
        return None;
    }
    j += 1;
    while j < c.len() {
        if c[j] == '"' && c[j + 1..].iter().take(hashes).filter(|&&ch| ch == '#').count() == hashes {
            return Some(j + 1 + hashes);
        }
        j += 1;
    }
    Some(c.len())
}

/// A token of code: a word (identifier or keyword) or one other character, with its line.
fn tokens(code: &str) -> Vec<(String, usize)> {
    let mut out = Vec::new();
    let mut line = 1;
    let mut chars = code.char_indices().peekable();
    while let Some((at, ch)) = chars.next() {
        if ch == '\n' {
            line += 1;
        } else if ch.is_alphanumeric() || ch == '_' {
            let mut end = at + ch.len_utf8();
            while let Some(&(j, next)) = chars.peek() {
                if !(next.is_alphanumeric() || next == '_') {
                    break;
                }
                end = j + next.len_utf8();
                chars.next();
            }
            out.push((code[at..end].to_string(), line));
        } else if !ch.is_whitespace() {
            out.push((ch.to_string(), line));
        }
    }
    out
}

/// What a `{` opens.
#[derive(Debug)]
enum Scope {
    /// A function's body: its name and the line of its `fn`.
    Fn(String, usize),
    /// An `impl`, `trait` or inline `mod`: the name its functions are qualified by.
    Named(String),
    /// Any other block: a closure's, a `match`, a `struct`'s fields.
    Block,
}

/// An item whose `{` is still to come.
enum Pending {
    Fn(String, usize),
    Named(String),
}

/// The functions of a file, each with where it starts and ends, but those in `#[cfg(test)]`
/// items; and the modules it declares `#[cfg(test)] mod x;` (test code in their own file).
fn functions(text: &str) -> (Vec<Function>, Vec<String>) {
    let toks = tokens(&code_only(text));
    let word = |k: usize| toks.get(k).map(|(t, _)| t.as_str()).unwrap_or("");
    let is_ident = |t: &str| t.chars().next().is_some_and(|ch| ch.is_alphabetic() || ch == '_');
    let mut found = Vec::new();
    let mut test_files = Vec::new();
    // Each open `{`: what it opened, and whether it is test code.
    let mut stack: Vec<(Scope, bool)> = Vec::new();
    let mut pending: Option<Pending> = None;
    // Parentheses, brackets and angle brackets open in a pending item's header.
    let mut depth = 0i32;
    // A `#[cfg(test)]` seen, for the next item.
    let mut cfg_test = false;
    let mut k = 0;
    while k < toks.len() {
        let (t, line) = (&toks[k].0, toks[k].1);
        let in_test = stack.last().is_some_and(|(_, test)| *test);
        match t.as_str() {
            "#" if word(k + 1) == "["
                && word(k + 2) == "cfg"
                && word(k + 3) == "("
                && word(k + 4) == "test"
                && word(k + 5) == ")" =>
            {
                cfg_test = true;
                k += 6;
                continue;
            }
            // `fn name`; `fn(…)` is a pointer type.
            "fn" if is_ident(word(k + 1)) && !matches!(pending, Some(Pending::Fn(..))) => {
                pending = Some(Pending::Fn(word(k + 1).to_string(), line));
                depth = 0;
                k += 2;
                continue;
            }
            // `impl` in a function's header is a type (`-> impl Trait`).
            "impl" | "trait" | "mod" if pending.is_none() => {
                let name = if t == "impl" { impl_name(&toks[k + 1..]) } else { word(k + 1).to_string() };
                if t == "mod" && word(k + 2) == ";" && cfg_test {
                    test_files.push(name.clone());
                }
                pending = Some(Pending::Named(name));
                depth = 0;
            }
            "(" | "[" | "<" if pending.is_some() => depth += 1,
            ")" | "]" if pending.is_some() => depth -= 1,
            // `->` is no angle bracket.
            ">" if pending.is_some() && !(k > 0 && toks[k - 1].0 == "-") => depth -= 1,
            ";" if depth <= 0 || pending.is_none() => {
                // An item without a body: a trait's `fn f();`, `mod x;`, `use …;`.
                pending = None;
                cfg_test = false;
            }
            "{" => {
                let scope = match pending.take() {
                    Some(Pending::Fn(name, first)) => Scope::Fn(name, first),
                    Some(Pending::Named(name)) => Scope::Named(name),
                    None => Scope::Block,
                };
                stack.push((scope, in_test || std::mem::take(&mut cfg_test)));
            }
            "}" => {
                cfg_test = false;
                if let Some((Scope::Fn(name, first), false)) = stack.pop() {
                    let outer: Vec<&str> = stack
                        .iter()
                        .filter_map(|(s, _)| match s {
                            Scope::Fn(n, _) | Scope::Named(n) => Some(n.as_str()),
                            Scope::Block => None,
                        })
                        .collect();
                    let name = outer.into_iter().chain([name.as_str()]).collect::<Vec<_>>().join("::");
                    found.push(Function { name, first, last: line });
                }
            }
            _ => {}
        }
        k += 1;
    }
    found.sort_by_key(|f| f.first);
    (found, test_files)
}

/// The type an `impl` header is for: the last name outside angle brackets before its `{` or
/// `where` (`impl<T> Trait for a::Type<T>` is `Type`).
fn impl_name(header: &[(String, usize)]) -> String {
    let mut depth = 0;
    let mut name = String::new();
    for (k, (t, _)) in header.iter().enumerate() {
        match t.as_str() {
            "{" | "where" | ";" => break,
            "<" => depth += 1,
            ">" if !(k > 0 && header[k - 1].0 == "-") => depth -= 1,
            "for" | "dyn" | "mut" => {}
            w if depth == 0 && w.chars().next().is_some_and(|ch| ch.is_alphabetic() || ch == '_') => {
                name = w.to_string()
            }
            _ => {}
        }
    }
    name
}

/// Check the files (`(path, text)`, paths from the repository root): every function over
/// `max` lines that is not in `known`, and every entry of `known` no longer needed.
fn check(files: &[(String, String)], max: usize, known: &[(&str, &str, &str)]) -> Vec<String> {
    let mut test_files = BTreeSet::new();
    let mut found = Vec::new();
    for (path, text) in files {
        let (fns, tests) = functions(text);
        // `mod x;` in `a/mod.rs`, `lib.rs` or `main.rs` is `a/x.rs`; in `a/b.rs`, `a/b/x.rs`.
        let dir = match path.rsplit_once('/') {
            Some((dir, "mod.rs" | "lib.rs" | "main.rs")) => dir.to_string(),
            _ => path.trim_end_matches(".rs").to_string(),
        };
        for m in tests {
            test_files.insert(format!("{dir}/{m}.rs"));
            test_files.insert(format!("{dir}/{m}/mod.rs"));
        }
        found.extend(fns.into_iter().map(|f| (path.as_str(), f)));
    }
    let long: Vec<(&str, Function)> = found
        .into_iter()
        .filter(|(path, f)| {
            !path.ends_with("/tests.rs") && *path != "tests.rs" && !test_files.contains(*path) && f.lines() > max
        })
        .collect();
    let mut errors = Vec::new();
    for (file, name, why) in known {
        if !long.iter().any(|(p, f)| p == file && f.name == *name) {
            errors.push(format!("{file}: {name} is no longer over {max} lines: remove it from KNOWN ({why})"));
        }
    }
    for (path, f) in &long {
        if !known.iter().any(|(file, name, _)| file == path && *name == f.name) {
            errors.push(format!(
                "{path}:{}: fn {} has {} lines, over {max}: split it into functions that each decide one thing",
                f.first,
                f.name,
                f.lines()
            ));
        }
    }
    errors
}

#[test]
fn no_production_function_is_over_100_lines() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut files = Vec::new();
    for src in ["agent/src", "spec/src"] {
        let crate_files = crate::source::rust_files(&root.join(src));
        assert!(crate_files.len() > 10, "read {} files from {src}", crate_files.len());
        files.extend(crate_files.into_iter().map(|(p, t)| (format!("{src}/{p}"), t)));
    }
    let errors = check(&files, MAX_LINES, KNOWN);
    assert!(errors.is_empty(), "functions too long:\n{}", errors.join("\n"));
}

/// The longest a production file may be: past it, a file holds more than one thing to decide.
const MAX_FILE_LINES: usize = 800;

/// A production file's lines: all before its first `#[cfg(test)]`; files only the tests build
/// (`tests.rs`, the fake host, the fault matrix) are exempt.
fn production_lines(rel: &str, text: &str) -> Option<usize> {
    let test_only = ["tests.rs", "fake.rs", "faults.rs"].iter().any(|t| rel == *t || rel.ends_with(&format!("/{t}")));
    (!test_only).then(|| text.split("#[cfg(test)]").next().unwrap_or_default().lines().count())
}

#[test]
fn no_production_file_is_over_800_lines() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut long = Vec::new();
    for src in ["agent/src", "spec/src"] {
        for (rel, text) in crate::source::rust_files(&root.join(src)) {
            match production_lines(&rel, &text) {
                Some(n) if n > MAX_FILE_LINES => long.push(format!("{src}/{rel}: {n} lines")),
                _ => {}
            }
        }
    }
    assert!(
        long.is_empty(),
        "production files over {MAX_FILE_LINES} lines (split them along their seams):\n{}",
        long.join("\n")
    );
    // The rule itself: a long file counts, its tests do not.
    let body = "fn f() {}\n".repeat(MAX_FILE_LINES);
    assert_eq!(production_lines("a/b.rs", &format!("{body}#[cfg(test)]\nmod tests {{}}\n")), Some(MAX_FILE_LINES));
    assert_eq!(production_lines("a/tests.rs", &body), None);
}

// The checker itself, on small files made up here.

fn files(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter().map(|(p, t)| (p.to_string(), t.to_string())).collect()
}

/// A function `name` of `body` lines of statements (so `body + 2` lines in all).
fn long_fn(name: &str, body: usize) -> String {
    format!("fn {name}() {{\n{}}}\n", "    let _ = 1;\n".repeat(body))
}

#[test]
fn a_long_function_fails_naming_file_function_and_length() {
    let text = format!("use std::fmt;\n\n{}{}", long_fn("short", 3), long_fn("long", 4));
    let f = files(&[("spec/src/a.rs", &text)]);
    assert_eq!(
        check(&f, 5, &[]),
        ["spec/src/a.rs:8: fn long has 6 lines, over 5: split it into functions that each decide one thing"]
    );
    assert_eq!(check(&f, 6, &[]), Vec::<String>::new());
}

#[test]
fn test_modules_and_test_files_are_exempt() {
    let text =
        format!("{}\n#[cfg(test)]\nmod tests {{\n    use super::*;\n{}}}\n", long_fn("short", 1), long_fn("t", 9));
    assert_eq!(check(&files(&[("agent/src/a.rs", &text)]), 5, &[]), Vec::<String>::new());
    // The same module without `#[cfg(test)]` is production code.
    let prod = text.replace("#[cfg(test)]", "");
    assert_eq!(check(&files(&[("agent/src/a.rs", &prod)]), 5, &[]).len(), 1);
    // A file named tests.rs, and one declared `#[cfg(test)] mod x;`, are test code.
    let f = files(&[
        ("agent/src/d/tests.rs", &long_fn("t", 9)),
        ("agent/src/lib.rs", "mod d;\n#[cfg(test)]\nmod faults;\n"),
        ("agent/src/faults.rs", &long_fn("t", 9)),
        ("agent/src/h/mod.rs", "#[cfg(test)]\npub mod fake;\n"),
        ("agent/src/h/fake.rs", &long_fn("t", 9)),
        ("agent/src/h/real.rs", &long_fn("t", 9)),
    ]);
    assert_eq!(
        check(&f, 5, &[]),
        ["agent/src/h/real.rs:1: fn t has 11 lines, over 5: split it into functions that each decide one thing"]
    );
}

#[test]
fn impl_blocks_nested_functions_and_closures_are_read() {
    let text = "\
impl<'a, T: Fn() -> u8> Trait for path::Thing<'a, T> where T: Copy {
    fn method(&self) -> impl Iterator<Item = u8> {
        let f = |x: u8| {
            x + 1
        };
        fn inner(g: fn(u8) -> u8) -> u8 {
            g(1)
        }
        std::iter::once(f(inner(|x| x)))
    }
}
trait T {
    fn declared(&self) -> [u8; 2];
    fn provided(&self) {}
}
mod m {
    pub(crate) async fn f() {}
}
";
    let (fns, _) = functions(text);
    let got: Vec<(&str, usize, usize)> = fns.iter().map(|f| (f.name.as_str(), f.first, f.last)).collect();
    assert_eq!(
        got,
        [("Thing::method", 2, 10), ("Thing::method::inner", 6, 8), ("T::provided", 14, 14), ("m::f", 17, 17)]
    );
}

#[test]
fn braces_in_strings_chars_and_comments_are_not_code() {
    let text = r####"fn f<'a>(x: &'a str) -> char {
    let _ = "}{ \" }";
    let _ = r#"}"# ;
    let _ = br##"}"#}"##;
    let _ = b'}';
    let _ = '\'';
    // }
    /* } /* nested } */ } */
    let _ = format!("{x}}}");
    'outer: loop { break 'outer; }
    '{'
}
fn g() {}
"####;
    let (fns, _) = functions(text);
    let got: Vec<(&str, usize, usize)> = fns.iter().map(|f| (f.name.as_str(), f.first, f.last)).collect();
    assert_eq!(got, [("f", 1, 12), ("g", 13, 13)]);
}

#[test]
fn a_known_long_function_passes_and_a_stale_entry_fails() {
    let f = files(&[("agent/src/p.rs", &long_fn("plan", 9))]);
    assert_eq!(check(&f, 5, &[("agent/src/p.rs", "plan", "why")]), Vec::<String>::new());
    let f = files(&[("agent/src/p.rs", &long_fn("plan", 1))]);
    assert_eq!(
        check(&f, 5, &[("agent/src/p.rs", "plan", "why")]),
        ["agent/src/p.rs: plan is no longer over 5 lines: remove it from KNOWN (why)"]
    );
}

/// How a reconcile ends is concluded in `conclude.rs` and its waits are `timing.rs`'s: the
/// reconciler's production code builds no `Report` and writes no duration of its own.
#[test]
fn the_reconciler_concludes_nothing_and_times_nothing_itself() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    // The driver: everything of reconcile/ but its tests, its context and how its events read.
    let driver = crate::source::rust_files(&root.join("src/reconcile"))
        .into_iter()
        .filter(|(rel, _)| !["faults.rs", "replicas.rs", "context.rs", "progress.rs"].contains(&rel.as_str()));
    let (mut words, mut found) = (0, Vec::new());
    for (rel, text) in driver {
        let code = code_only(&text);
        let code = code.split("#[cfg(test)]").next().unwrap();
        words += code.split(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':' || c == '{')).count();
        for (i, line) in code.lines().enumerate() {
            let squeezed: String = line.split_whitespace().collect::<Vec<_>>().join(" ");
            for bad in ["Report {", "Duration::from_", "Duration::ZERO", "Duration::MAX", "Duration::new"] {
                if squeezed.contains(bad) {
                    found.push(format!("src/reconcile/{rel}:{}: {bad}", i + 1));
                }
            }
        }
    }
    assert!(words > 1000, "read the reconciler ({words} words)");
    assert!(found.is_empty(), "decide these in core/conclude.rs or core/timing.rs:\n{}", found.join("\n"));
}

/// The ways a value of `timing.rs` may be written in docs/reference.md's table.
fn spellings(value: &str) -> Vec<String> {
    let number = |s: &str| s.trim().replace('_', "").parse::<u64>().ok();
    if value == "Duration::ZERO" {
        return vec!["0 s".into(), "nothing".into()];
    }
    let number = |s: &str| s.split('*').map(number).try_fold(1u64, |p, n| n.map(|n| p * n));
    if let Some(n) = value.strip_prefix("Duration::from_secs(").and_then(|v| number(v.trim_end_matches(')'))) {
        let mut out = vec![format!("{n} s")];
        if n % 60 == 0 {
            out.push(format!("{} min", n / 60));
        }
        if n % 3600 == 0 {
            out.push(format!("{} h", n / 3600));
        }
        return out;
    }
    if let Some(n) = value.strip_prefix("Duration::from_millis(").and_then(|v| number(v.trim_end_matches(')'))) {
        let mut out = vec![format!("{n} ms")];
        if n >= 1000 {
            out.push(format!("{} s", n as f64 / 1000.0));
        }
        return out;
    }
    let n = number(value).unwrap_or_else(|| panic!("a value the timing table check cannot read: {value}"));
    vec![format!("{n} times"), format!("{n} re-"), format!("up to {n}"), format!("most {n}")]
}

/// The rows of a table of docs/reference.md, the one under `heading`.
pub fn reference_table(heading: &str) -> Vec<String> {
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/reference.md")).unwrap();
    let section =
        text.split(&format!("## {heading}\n")).nth(1).unwrap_or_else(|| panic!("no {heading} in docs/reference.md"));
    let section = section.split("\n## ").next().unwrap();
    section.lines().filter(|l| l.starts_with('|')).map(str::to_string).collect()
}

/// The rows of docs/reference.md's timing table.
fn timing_table() -> Vec<String> {
    reference_table("Timing policies")
}

/// The name a constant of `rel` (a path under `src/`) goes by in the tables: its file's name, or
/// its folder's for a `mod.rs` (`control::CONTROL_ANSWER_WITHIN`, `dbus::SETUP_TIMEOUT`).
fn module_of(rel: &str) -> String {
    let mut parts: Vec<&str> = rel.trim_end_matches(".rs").split('/').collect();
    if parts.last() == Some(&"mod") {
        parts.pop();
    }
    parts.last().unwrap().to_string()
}

/// The row that names `named` (`` `module::NAME` ``) says `value` (a constant's Rust
/// expression), or why not.
fn said_in(table: &[String], named: &str, value: &str) -> Result<(), String> {
    let Some(row) = table.iter().find(|r| r.contains(named)) else {
        return Err(format!("{named} ({value}) is in no row of the timing table"));
    };
    let want = spellings(value);
    match want.iter().any(|w| row.contains(w.as_str())) {
        true => Ok(()),
        false => Err(format!("{named}'s row does not say its value ({}): {row}", want.join(" or "))),
    }
}

/// Every duration constant of the production sources outside `timing.rs` (an adapter's bound on
/// its own protocol) is named in the timing table as `module::NAME`, with its value.
#[test]
fn the_timing_table_names_every_other_duration_constant_with_its_value() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let table = timing_table();
    let (mut consts, mut errors) = (0, Vec::new());
    let files = crate::source::rust_files(&root.join("src"));
    for (rel, text) in files {
        let module = module_of(&rel);
        if ["timing", "faults"].contains(&module.as_str()) || rel.ends_with("tests.rs") || rel.ends_with("fake.rs") {
            continue;
        }
        // Production code only: a file's tests come last.
        let text = text.split("#[cfg(test)]").next().unwrap();
        for line in text.lines() {
            let line = line.trim_start().trim_start_matches("pub ");
            let Some(rest) = line.strip_prefix("const ") else { continue };
            let rest = rest.replacen(": std::time::Duration = ", ": Duration = ", 1);
            let Some((name, value)) = rest.split_once(": Duration = ") else { continue };
            consts += 1;
            let value = value.trim_end_matches(';').replace("std::time::", "");
            if let Err(e) = said_in(&table, &format!("`{module}::{name}`"), &value) {
                errors.push(format!("{rel}: {e}"));
            }
        }
    }
    assert!(consts >= 8, "read {consts} duration constants outside timing.rs");
    assert!(errors.is_empty(), "docs/reference.md's timing table:\n{}", errors.join("\n"));
}

#[test]
fn the_timing_table_names_every_constant_of_timing_rs_with_its_value() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let timing = std::fs::read_to_string(root.join("src/core/timing.rs")).unwrap();
    let table = timing_table();
    let (mut consts, mut errors) = (0, Vec::new());
    for line in timing.lines() {
        let Some(rest) = line.strip_prefix("pub const ") else { continue };
        let (name, value) = rest.split_once(':').unwrap();
        let value = value.split_once('=').unwrap().1.trim().trim_end_matches(';');
        consts += 1;
        errors.extend(said_in(&table, &format!("`timing::{name}`"), value).err());
    }
    assert!(consts >= 20, "read {consts} constants of timing.rs");
    assert!(errors.is_empty(), "docs/reference.md's timing table:\n{}", errors.join("\n"));
}

/// The production code of `dir` (a folder under the agent's `src/`): each file with its tests
/// cut off (`#[cfg(test)]` onwards, and the files of tests and of the fake host left out),
/// comments and string contents blanked.
fn production_code(dir: &str) -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src").join(dir);
    crate::source::rust_files(&root)
        .into_iter()
        .filter(|(rel, _)| !(rel.ends_with("tests.rs") || rel.ends_with("fake.rs") || rel.ends_with("faults.rs")))
        .map(|(rel, text)| {
            let code = code_only(&text);
            let code = code.split("#[cfg(test)]").next().unwrap_or_default().to_string();
            (format!("{dir}/{rel}"), code)
        })
        .collect()
}

/// The core decides; it does not touch the machine: no file, process, socket, runtime, HTTP or
/// git in its production code.
#[test]
fn the_core_does_no_io() {
    let files = production_code("core");
    assert!(files.len() >= 10, "read {} files of core/", files.len());
    let mut found = Vec::new();
    for (rel, code) in &files {
        for (i, line) in code.lines().enumerate() {
            for io in [
                "tokio",
                "std::fs",
                "nix::",
                "reqwest",
                "git2",
                "std::process",
                "std::net",
                "std::os",
                "libc::",
                ".exists()",
                ".is_file()",
                ".is_dir()",
                ".metadata()",
                ".canonicalize()",
                "SystemTime::now",
                "Instant::now",
            ] {
                if line.contains(io) {
                    found.push(format!("src/{rel}:{}: {io}", i + 1));
                }
            }
        }
    }
    assert!(found.is_empty(), "core/ must not know the machine:\n{}", found.join("\n"));
}

/// Variables named in a reference row: every `` `NAME` `` of capitals (`SPECD_STANDIN_*` as
/// its prefix).
fn variables(rows: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    for row in rows {
        let first = row.split('|').nth(1).unwrap_or_default();
        for part in first.split('`').skip(1).step_by(2) {
            if part.chars().all(|c| c.is_ascii_uppercase() || c == '_' || c == '*') && part.len() > 2 {
                out.push(part.trim_end_matches('*').to_string());
            }
        }
    }
    out
}

/// Every environment variable specd's production code reads is in the reference's table; every
/// variable the table names is read somewhere in the project (its code, its tests, its scripts,
/// its package), or by a library specd relies on for it (said in the row).
#[test]
fn the_environment_table_names_every_variable_read_and_only_those() {
    let rows = reference_table("Environment variables");
    let named = variables(&rows);
    assert!(named.len() >= 20, "read {} variables from the table", named.len());
    let mut errors = Vec::new();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for (rel, text) in crate::source::rust_files(&root.join("src")) {
        if rel.ends_with("tests.rs") || rel.ends_with("fake.rs") {
            continue;
        }
        let text = text.split("#[cfg(test)]").next().unwrap_or_default();
        for (i, line) in text.lines().enumerate() {
            // Reads: std's, clap's `env =`, tracing's filter; not `Command::env`, which sets one
            // for a child.
            for key in ["var(\"", "var_os(\"", "from_env(\"", "env = \""] {
                for part in line.split(key).skip(1) {
                    let name: String = part.chars().take_while(|c| c.is_ascii_uppercase() || *c == '_').collect();
                    if !name.is_empty() && !named.contains(&name) {
                        errors.push(format!("src/{rel}:{}: {name} is read but not in the table", i + 1));
                    }
                }
            }
        }
    }
    // Read by a library specd relies on, not by its own code: systemd's protocol (sd-notify) and
    // reqwest's proxies.
    let by_libraries = ["NOTIFY_SOCKET", "WATCHDOG_USEC", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY"];
    let mut everything = String::new();
    for dir in ["agent/src", "agent/tests", "agent/examples", "spec", "tests/src", "tests/tests", "debian"] {
        for (_, text) in crate::source::rust_files(&root.join("..").join(dir)) {
            everything.push_str(&text);
        }
    }
    for f in std::fs::read_dir(root.join("../scripts")).unwrap() {
        everything.push_str(&std::fs::read_to_string(f.unwrap().path()).unwrap_or_default());
    }
    everything.push_str(&std::fs::read_to_string(root.join("../debian/rules")).unwrap_or_default());
    for v in &named {
        if !by_libraries.contains(&v.as_str()) && !everything.contains(v.as_str()) {
            errors.push(format!("{v} is in the table but nothing reads it"));
        }
    }
    assert!(errors.is_empty(), "docs/reference.md's environment table:\n{}", errors.join("\n"));
}

/// Every file or directory specd makes in its state directory is a row of the reference's table,
/// and every row is one the code makes.
#[test]
fn the_state_files_table_names_every_file_of_the_state_directory() {
    let rows = reference_table("State files");
    let first = |row: &String| {
        let path = row.split('`').nth(1).unwrap_or_default().to_string();
        path.split('/').next().unwrap_or_default().split(".json").next().unwrap_or_default().to_string()
    };
    let listed: Vec<String> = rows.iter().map(first).filter(|p| !p.is_empty() && p != "path" && p != "-").collect();
    assert!(listed.len() >= 8, "read {} rows", listed.len());
    let mut errors = Vec::new();
    let mut made = Vec::new();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    for (rel, text) in crate::source::rust_files(&root) {
        let text = text.split("#[cfg(test)]").next().unwrap_or_default();
        for key in ["state_dir.join(\"", "store.dir.join(\"", "self.dir.join(\"", "state_dir().join(\""] {
            for part in text.split(key).skip(1) {
                let name = part.split('"').next().unwrap_or_default();
                let stem = name.split('/').next().unwrap_or_default().split(".json").next().unwrap_or_default();
                made.push(stem.to_string());
                if !listed.iter().any(|l| l == stem) {
                    errors.push(format!("src/{rel}: `{name}` is made in the state directory but is in no row"));
                }
            }
        }
    }
    for l in &listed {
        let in_code =
            made.contains(l) || crate::source::rust_files(&root).iter().any(|(_, t)| t.contains(&format!("\"{l}")));
        if !in_code {
            errors.push(format!("`{l}` is a row but the code makes no such file"));
        }
    }
    assert!(errors.is_empty(), "docs/reference.md's state files table:\n{}", errors.join("\n"));
}

/// ARCHITECTURE.md is a codemap a newcomer reads in a sitting: at most 250 lines, naming every
/// folder and every file that stands alone in a crate's `src/`, and every test it cites exists.
#[test]
fn the_codemap_is_short_names_every_part_and_cites_tests_that_exist() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let arch = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    let mut errors = Vec::new();
    let lines = arch.lines().count();
    if lines > 250 {
        errors.push(format!("ARCHITECTURE.md has {lines} lines (at most 250: reference tables go to docs/)"));
    }
    // A part is named in backticks: `stem`, `stem.rs`, `stem/` or a path ending so.
    let spans: Vec<&str> = arch.split('`').skip(1).step_by(2).collect();
    let names = |stem: &str| {
        let forms = [stem.to_string(), format!("{stem}.rs"), format!("{stem}/")];
        spans.iter().any(|s| {
            s.split([',', ' ', '(', ')']).any(|w| {
                let last = w.trim_end_matches('/').rsplit('/').next().unwrap_or(w);
                forms.iter().any(|f| w == f || last == f || format!("{last}/") == *f)
            })
        })
    };
    for src in ["agent/src", "spec/src"] {
        for e in std::fs::read_dir(root.join(src)).unwrap() {
            let name = e.unwrap().file_name().to_string_lossy().into_owned();
            let stem = name.trim_end_matches(".rs");
            if ["main", "lib", "mod"].contains(&stem) || name.starts_with('.') {
                continue;
            }
            if !names(stem) {
                errors.push(format!("ARCHITECTURE.md does not name {src}/{name} (in backticks)"));
            }
        }
    }
    // Every test function the codemap cites (a `snake_case` name of five words or more).
    let mut tests = String::new();
    for dir in ["agent", "spec", "tests"] {
        for (_, text) in crate::source::rust_files(&root.join(dir)) {
            tests.push_str(&text);
        }
    }
    for cited in arch.split('`').skip(1).step_by(2) {
        let name = cited.rsplit("::").next().unwrap_or(cited);
        let looks_like_test = name.split('_').count() >= 5 && name.chars().all(|c| c.is_ascii_lowercase() || c == '_');
        if looks_like_test && !tests.contains(&format!("fn {name}(")) {
            errors.push(format!("ARCHITECTURE.md cites `{cited}`, which is no test"));
        }
    }
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}
