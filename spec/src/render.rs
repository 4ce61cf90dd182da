//! Deterministic unit rendering, and systemd's command-line syntax both ways.
//!
//! The rendered text is a pure function of the resolved spec: no time, no commit SHA, no map
//! iteration order. Its sha256 is therefore the identity of the desired state, and a commit that
//! does not change the spec does not restart anything.

use std::fmt::Write;

use sha2::{Digest, Sha256};

use crate::resolve::Spec;

/// The first line of every unit specd writes; the agent recognizes its units by it.
pub const HEADER: &str = "# Managed by specd. Do not edit: specd replaces this file when it differs from the spec.";

/// A rendered unit file and its identity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RenderedUnit {
    pub unit: String,
    pub text: String,
    /// Lowercase hex sha256 of `text`.
    pub sha256: String,
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    let mut s = String::with_capacity(64);
    for b in digest {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// Render the unit for a resolved spec.
pub fn render(spec: &Spec) -> RenderedUnit {
    let mut u = String::new();
    let mut line = |s: &str| {
        u.push_str(s);
        u.push('\n');
    };
    line(HEADER);
    line(&format!("# specd: service={} engine={}", spec.name, spec.engine.as_str()));
    if let Some(h) = &spec.overlay {
        line(&format!("# specd: host overlay {h}"));
    }
    line("");
    line("[Unit]");
    line(&format!("Description={}", escape_specifiers(&spec.service.description)));
    // systemd.special(7): a unit that needs a configured network pulls network-online.target
    // in (Wants=) and orders itself after it (After=); After= alone waits for nothing.
    line("Wants=network-online.target");
    line("After=network-online.target");
    line("");
    line("[Service]");
    line("Type=exec");
    line(&format!("ExecStart={}", command_line(&spec.argv)));
    let svc = &spec.service;
    if let Some(w) = &svc.working_directory {
        line(&format!("WorkingDirectory={}", escape_specifiers(w)));
    }
    if let Some(v) = &svc.user {
        line(&format!("User={v}"));
    }
    if let Some(v) = &svc.group {
        line(&format!("Group={v}"));
    }
    for (k, v) in &svc.environment {
        line(&format!("Environment={}", quote(&escape_specifiers(&format!("{k}={v}")))));
    }
    // Written as-is (these keys do not unquote); validation refuses backslashes and white space
    // at the ends, so `%` is the only character to escape.
    for f in &svc.environment_files {
        line(&format!("EnvironmentFile={}", escape_specifiers(f)));
    }
    for (name, path) in &svc.credentials {
        line(&format!("LoadCredential={}:{}", escape_specifiers(name), escape_specifiers(path)));
    }
    line(&format!("Restart={}", svc.restart.as_str()));
    line(&format!("RestartSec={}", svc.restart_sec));
    line(&format!("TimeoutStartSec={}", svc.timeout_start_sec));
    line(&format!("TimeoutStopSec={}", svc.timeout_stop_sec));
    line("KillMode=control-group");
    line("KillSignal=SIGTERM");
    if let Some(m) = &svc.memory_max {
        line(&format!("MemoryMax={m}"));
    }
    line("");
    line("[Install]");
    line("WantedBy=multi-user.target");
    let sha256 = sha256_hex(u.as_bytes());
    RenderedUnit { unit: spec.unit.clone(), text: u, sha256 }
}

/// `%` starts a specifier everywhere in a unit file; `%%` is a literal `%`.
fn escape_specifiers(s: &str) -> String {
    s.replace('%', "%%")
}

/// Double-quote a word, escaping what is special inside systemd's quotes.
fn quote(s: &str) -> String {
    let mut q = String::with_capacity(s.len() + 2);
    q.push('"');
    for c in s.chars() {
        match c {
            '\\' => q.push_str("\\\\"),
            '"' => q.push_str("\\\""),
            c => q.push(c),
        }
    }
    q.push('"');
    q
}

/// One argv word as `ExecStart=` reads it back exactly (systemd.service(5), "Command lines"):
/// `%` → `%%` (specifiers), `$` → `$$` (variable expansion), quoted when it holds anything but
/// plain characters, and a lone `;` (the command separator) quoted too.
fn exec_word(w: &str) -> String {
    let escaped = escape_specifiers(w).replace('$', "$$");
    let plain =
        !w.is_empty() && w != ";" && w.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_./=:,+@%$".contains(&b));
    if plain { escaped } else { quote(&escaped) }
}

/// The value of `ExecStart=` for an argv.
pub fn command_line(argv: &[String]) -> String {
    argv.iter().map(|w| exec_word(w)).collect::<Vec<_>>().join(" ")
}

/// The argv of a unit text's `ExecStart=` (`None` when it is not one specd's parser takes).
pub fn exec_start(text: &str) -> Option<Vec<String>> {
    exec_start_value(&[text]).as_deref().and_then(parse_command_line)
}

/// The effective `ExecStart=` value of a unit file and its drop-ins (in systemd's order): the
/// last non-empty assignment in `[Service]` after the last empty one, continuation lines joined,
/// the `@-:+!` prefixes dropped.
pub fn exec_start_value(files: &[&str]) -> Option<String> {
    let mut exec: Option<String> = None;
    for text in files {
        for (k, v) in service_assignments(text) {
            if k == "ExecStart" {
                exec = if v.is_empty() { None } else { Some(v) };
            }
        }
    }
    Some(exec?.trim_start_matches(['@', '-', ':', '+', '!']).to_string())
}

/// The `[Service]` assignments of a unit text in order (keys and values trimmed), continuation
/// lines joined, comments skipped: what systemd reads of the section.
pub fn service_assignments(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut service = false;
    let mut pending = String::new();
    for raw in text.lines() {
        let l = raw.trim();
        if pending.is_empty() && (l.starts_with('#') || l.starts_with(';')) {
            continue;
        }
        if let Some(rest) = l.strip_suffix('\\') {
            pending.push_str(rest);
            pending.push(' ');
            continue;
        }
        let line = std::mem::take(&mut pending) + l;
        if line.starts_with('[') && line.ends_with(']') {
            service = line == "[Service]";
            continue;
        }
        if service && let Some((k, v)) = line.split_once('=') {
            out.push((k.trim().to_string(), v.trim().to_string()));
        }
    }
    out
}

/// Split an `ExecStart=` value into argv as systemd does for the subset of the syntax specd
/// writes and reads: quoting, C escapes, `%%` and `$$`. Returns `None` for anything else
/// (unknown specifiers or escapes, variable references, unterminated quotes, `;`).
pub fn parse_command_line(s: &str) -> Option<Vec<String>> {
    split_words(s, true)
}

/// systemd's word splitting with unquoting, C escapes and `%%`; `$$` only where variables expand.
fn split_words(s: &str, dollar: bool) -> Option<Vec<String>> {
    let mut argv = Vec::new();
    let mut chars = s.chars().peekable();
    loop {
        while chars.next_if(|c| *c == ' ' || *c == '\t').is_some() {}
        let Some(&first) = chars.peek() else { break };
        let mut word = String::new();
        let quoted = first == '"' || first == '\'';
        if quoted {
            chars.next();
        }
        let mut closed = !quoted;
        while let Some(c) = chars.next() {
            match c {
                c if quoted && c == first => {
                    closed = true;
                    break;
                }
                ' ' | '\t' if !quoted => break,
                '\\' => match chars.next()? {
                    '\\' => word.push('\\'),
                    '"' => word.push('"'),
                    '\'' => word.push('\''),
                    'n' => word.push('\n'),
                    't' => word.push('\t'),
                    's' => word.push(' '),
                    _ => return None,
                },
                '%' => match chars.next()? {
                    '%' => word.push('%'),
                    _ => return None,
                },
                '$' if dollar => match chars.next()? {
                    '$' => word.push('$'),
                    _ => return None,
                },
                c => word.push(c),
            }
        }
        if !closed {
            return None;
        }
        // A quoted word must be followed by white space or the end.
        if quoted && chars.peek().is_some_and(|c| *c != ' ' && *c != '\t') {
            return None;
        }
        if !quoted && word == ";" {
            return None;
        }
        argv.push(word);
    }
    Some(argv)
}

/// Parse one `Environment=` assignment as specd writes it (`"K=V"`), to `(K, V)`. Unlike in
/// command lines, `$` is not special here.
pub fn parse_environment(s: &str) -> Option<(String, String)> {
    let words = split_words(s, false)?;
    let [w] = words.as_slice() else { return None };
    let (k, v) = w.split_once('=')?;
    Some((k.to_string(), v.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_round_trip() {
        let argv: Vec<String> =
            ["/usr/bin/python3", "a b", "50%", "$HOME", "${X}", ";", "", "q\"uo'te", "back\\slash", "ünï"]
                .iter()
                .map(|s| s.to_string())
                .collect();
        let line = command_line(&argv);
        assert_eq!(line, r#"/usr/bin/python3 "a b" 50%% $$HOME "$${X}" ";" "" "q\"uo'te" "back\\slash" "ünï""#);
        assert_eq!(parse_command_line(&line).unwrap(), argv);
    }

    #[test]
    fn parser_refuses_what_it_does_not_model() {
        assert_eq!(parse_command_line("a %n"), None);
        assert_eq!(parse_command_line("a $X"), None);
        assert_eq!(parse_command_line("\"open"), None);
        assert_eq!(parse_command_line("a ; b"), None);
        assert_eq!(parse_command_line("\"a\"b"), None);
    }
}
