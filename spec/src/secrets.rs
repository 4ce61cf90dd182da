//! Literal secrets in a spec: names that say their value is a secret (`HF_TOKEN`, `--api-key`)
//! and values in the format of a well-known credential (`sk-…`, `hf_…`). Such a value would be
//! readable by every local user: the unit file is 0644, and a process's command line is
//! world-readable in `/proc`. Validation refuses them unless `service.allow_literal_secrets`.

use crate::engine::{self, EngineFacts, SecretFlag};
use crate::model::Engine;

/// Environment variables whose names look like secrets: a `_`-separated word that ends in
/// TOKEN, SECRET, PASSWORD or PASSWD (`HF_TOKEN`, `GITHUB_TOKEN`, `CLIENTSECRET`, `DB_PASSWORD`), or
/// a name ending in `_KEY` (`OPENAI_API_KEY`), in any case. Words that merely contain one are
/// not (`TOKENIZERS_PARALLELISM`, `MAX_TOKENS`), nor is a name that says where the secret is
/// (`HF_TOKEN_PATH`, `DB_PASSWORD_FILE`, `..._DIR`).
pub(crate) fn looks_secret(name: &str) -> bool {
    let n = name.to_ascii_uppercase();
    let locator = ["_PATH", "_FILE", "_DIR"].iter().any(|s| n.ends_with(s));
    let secret_word = n.split('_').any(|w| SECRET_WORDS.iter().any(|s| w.ends_with(s)));
    !locator && (secret_word || n.ends_with("_KEY"))
}

const SECRET_WORDS: [&str; 4] = ["TOKEN", "SECRET", "PASSWORD", "PASSWD"];

/// A flag whose name says that it takes a secret: its last word (`-` or `_` separated) ends in
/// TOKEN, SECRET, PASSWORD or PASSWD, or is KEY after another word (`--api-key`, `--hf-token`,
/// `--ssl-keyfile-password`). Not a flag that says where the secret is (`--api-key-file`,
/// `--ssl-keyfile`, `--hf-token-path`), nor one about tokens of text (`--max-num-batched-tokens`,
/// `--speculative-token-map`, `--tokenizer`).
fn names_secret(flag: &str) -> bool {
    let words: Vec<String> = flag.trim_start_matches('-').split(['-', '_']).map(str::to_ascii_uppercase).collect();
    match words.as_slice() {
        [.., last] if SECRET_WORDS.iter().any(|s| last.ends_with(s)) => true,
        [_, .., last] => last == "KEY",
        _ => false,
    }
}

/// One number or a list of them (`4`, `0.1,0.5`, `1e-3`).
fn numbers(v: &str) -> bool {
    v.split([',', ' ']).filter(|n| !n.is_empty()).all(|n| n.parse::<f64>().is_ok())
}

/// A well-known credential format: a prefix, then at least `min` characters of `chars`.
struct Format {
    prefix: &'static str,
    what: &'static str,
    min: usize,
    chars: fn(u8) -> bool,
    /// Random ones of this format mix upper and lower case (a model named `sk-llama-3-8b`
    /// does not).
    mixed_case: bool,
}

fn alnum(b: u8) -> bool {
    b.is_ascii_alphanumeric()
}

fn alnum_dash_underscore(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'-' || b == b'_'
}

fn alnum_underscore(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

fn alnum_dash(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'-'
}

fn upper_digit(b: u8) -> bool {
    b.is_ascii_uppercase() || b.is_ascii_digit()
}

const FORMATS: &[Format] = &[
    Format { prefix: "sk-", what: "an API key (`sk-…`)", min: 20, chars: alnum_dash_underscore, mixed_case: true },
    Format { prefix: "hf_", what: "a Hugging Face token (`hf_…`)", min: 30, chars: alnum, mixed_case: true },
    Format { prefix: "ghp_", what: "a GitHub token (`ghp_…`)", min: 30, chars: alnum, mixed_case: false },
    Format { prefix: "gho_", what: "a GitHub token (`gho_…`)", min: 30, chars: alnum, mixed_case: false },
    Format { prefix: "ghs_", what: "a GitHub token (`ghs_…`)", min: 30, chars: alnum, mixed_case: false },
    Format { prefix: "ghu_", what: "a GitHub token (`ghu_…`)", min: 30, chars: alnum, mixed_case: false },
    Format {
        prefix: "github_pat_",
        what: "a GitHub token (`github_pat_…`)",
        min: 40,
        chars: alnum_underscore,
        mixed_case: false,
    },
    Format {
        prefix: "glpat-",
        what: "a GitLab token (`glpat-…`)",
        min: 20,
        chars: alnum_dash_underscore,
        mixed_case: false,
    },
    Format { prefix: "xoxb-", what: "a Slack token (`xoxb-…`)", min: 20, chars: alnum_dash, mixed_case: false },
    Format { prefix: "xoxp-", what: "a Slack token (`xoxp-…`)", min: 20, chars: alnum_dash, mixed_case: false },
    Format { prefix: "AKIA", what: "an AWS access key id (`AKIA…`)", min: 16, chars: upper_digit, mixed_case: false },
];

/// What kind of credential `text` holds, if a run of it (at the start, or after a character that
/// is not a letter or digit: `--x=sk-…`, `{"token": "hf_…"}`) is in a well-known format.
pub(crate) fn credential_in(text: &str) -> Option<&'static str> {
    let b = text.as_bytes();
    (0..b.len()).filter(|&i| i == 0 || !b[i - 1].is_ascii_alphanumeric()).find_map(|i| {
        FORMATS.iter().find_map(|f| {
            let rest = b[i..].strip_prefix(f.prefix.as_bytes())?;
            let run = &rest[..rest.iter().position(|&c| !(f.chars)(c)).unwrap_or(rest.len())];
            let mixed = run.iter().any(u8::is_ascii_uppercase) && run.iter().any(u8::is_ascii_lowercase);
            (run.len() >= f.min && (mixed || !f.mixed_case)).then_some(f.what)
        })
    })
}

/// Where a literal secret on the server's command line can be read.
const ON_ARGV: &str = "a literal one here is readable by every local user, in the unit file (0644) and in the server's command line (`ps`, /proc/PID/cmdline)";
const ALLOW: &str = "set service.allow_literal_secrets: true if it is not secret";

/// The message for a value of a well-known credential format on the command line.
pub(crate) fn credential_on_argv(what: &str) -> String {
    format!(
        "looks like {what}: {ON_ARGV}. Give it to the server in a root-only file (service.environment_files, service.credentials) instead; {ALLOW}"
    )
}

fn engine_name(e: Engine) -> &'static str {
    match e {
        Engine::Sglang => "SGLang",
        Engine::Vllm => "vLLM",
        Engine::LlamaCpp => "llama-server",
    }
}

/// What to do instead of giving `flag` a literal value.
fn instead(facts: &EngineFacts, known: Option<&SecretFlag>, unit: &str) -> String {
    let name = engine_name(facts.engine);
    match known {
        Some(SecretFlag { env: Some(var), file_flag, .. }) => {
            let mut s = format!(
                "{name} reads it from the environment variable {var}: leave the flag out and put `{var}=...` in a root-only file listed in service.environment_files"
            );
            if let Some(ff) = file_flag {
                s.push_str(&format!(
                    ", or pass the file as service.credentials (NAME: PATH) and give `{ff} /run/credentials/{unit}/NAME`"
                ));
            }
            s
        }
        Some(SecretFlag { env: None, .. }) => format!(
            "{name} takes it only on its command line: serve on 127.0.0.1 behind a proxy that checks the key instead"
        ),
        None => "Give it to the server in a root-only file it reads (service.environment_files, service.credentials) instead".into(),
    }
}

/// Literal secrets in one list of argv words (`command`, `server.extra_args`): `(index, why)`.
/// A flag that takes a secret (the engine's own, or one whose name says so) followed by a value
/// (`--api-key KEY`, `--api-key=KEY`; reported at the flag), an environment assignment whose name
/// looks secret (`env HF_TOKEN=...`), and any word holding a well-known credential format.
/// `unit` names the unit in the advice (`/run/credentials/UNIT/NAME`).
pub(crate) fn in_argv(engine: Engine, unit: &str, words: &[String]) -> Vec<(usize, String)> {
    let facts = engine::facts(engine);
    let mut out = Vec::new();
    let mut value_of_flag = false;
    for (i, w) in words.iter().enumerate() {
        // The value of a flag refused just before: one error for the pair.
        if std::mem::take(&mut value_of_flag) {
            continue;
        }
        if let Some(flag) = engine::flag_name(w) {
            let known = facts.secret_flag(flag);
            if known.is_some() || names_secret(flag) {
                let (value, next) = match w.split_once('=') {
                    Some((_, v)) => (Some(v), false),
                    None => (words.get(i + 1).map(String::as_str).filter(|v| engine::flag_name(v).is_none()), true),
                };
                // A name alone can mislead: SGLang's `--bucket-time-to-first-token 0.1,0.5` and
                // `--kt-max-deferred-experts-per-token 4` take numbers, which no key is. The
                // engine's own secret flags are refused whatever their value.
                if value.is_some_and(|v| !v.is_empty() && (known.is_some() || !numbers(v))) {
                    out.push((
                        i,
                        format!("`{flag}` takes a secret: {ON_ARGV}. {}; {ALLOW}", instead(facts, known, unit)),
                    ));
                    value_of_flag = next;
                    continue;
                }
            }
        }
        let assigned = w.split_once('=').filter(|(n, v)| {
            !v.is_empty()
                && n.bytes().next().is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
                && n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
                && looks_secret(n)
        });
        if let Some((name, _)) = assigned {
            out.push((
                i,
                format!(
                    "sets {name}, which looks like a secret, on the command line: {ON_ARGV}. Put `{name}=...` in a root-only file listed in service.environment_files instead; {ALLOW}"
                ),
            ));
        } else if let Some(what) = credential_in(w) {
            out.push((i, credential_on_argv(what)));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_named_for_a_secret_and_not_for_where_it_is() {
        for f in ["--api-key", "--admin-api-key", "--hf-token", "--ssl-keyfile-password", "--db_password", "--x-secret"]
        {
            assert!(names_secret(f), "{f}");
        }
        for f in [
            "--key",
            "--api-key-file",
            "--ssl-keyfile",
            "--ssl-key-file",
            "--hf-token-path",
            "--max-num-batched-tokens",
            "--speculative-token-map",
            "--speculative-num-draft-tokens",
            "--tokenizer",
            "--keyboard",
        ] {
            assert!(!names_secret(f), "{f}");
        }
    }

    #[test]
    fn credential_formats_are_found_where_they_start_a_run() {
        let key = "sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8t";
        let hf = "hf_AbCdEfGhIjKlMnOpQrStUvWxYzAbCdEfGh";
        for (text, want) in [
            (key.to_string(), "an API key (`sk-…`)"),
            (format!("--api-key={key}"), "an API key (`sk-…`)"),
            (format!("{{\"hf_token\": \"{hf}\"}}"), "a Hugging Face token (`hf_…`)"),
            ("ghp_0123456789abcdefghijklmnopqrstuvwxyz".into(), "a GitHub token (`ghp_…`)"),
            ("AKIAIOSFODNN7EXAMPLE".into(), "an AWS access key id (`AKIA…`)"),
        ] {
            assert_eq!(credential_in(&text), Some(want), "{text}");
        }
        for text in [
            "sk-llama-3-8b-instruct-finetuned",
            "/models/hf_cache/Qwen3-8B",
            "mask-AbCdEfGhIjKlMnOpQrStUvWxYz",
            "sk-Ab3",
            "--hf_token_path=/x",
            "Disk-AbCdEfGhIjKlMnOpQrStUvWxYz0",
        ] {
            assert_eq!(credential_in(text), None, "{text}");
        }
    }

    #[test]
    fn a_secret_flag_is_reported_once_at_the_flag_with_the_engine_s_way_instead() {
        let w = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let found = in_argv(Engine::Vllm, "v.service", &w(&["--api-key", "sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8t", "--x"]));
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].0, 0);
        assert!(found[0].1.contains("vLLM reads it from the environment variable VLLM_API_KEY"), "{}", found[0].1);
        let found = in_argv(Engine::LlamaCpp, "l.service", &w(&["-hft", "abc"]));
        assert!(found[0].1.contains("`-hft` takes a secret") && found[0].1.contains("HF_TOKEN"), "{found:?}");
        let found = in_argv(Engine::LlamaCpp, "l.service", &w(&["--api-key=abc"]));
        assert!(found[0].1.contains("`--api-key-file /run/credentials/l.service/NAME`"), "{found:?}");
        let found = in_argv(Engine::Sglang, "s.service", &w(&["--ssl-keyfile-password", "x"]));
        assert!(found[0].1.contains("SGLang takes it only on its command line"), "{found:?}");
        // Without a value, or with a path to a file, nothing is secret on the command line.
        for words in [&["--api-key"][..], &["--api-key", "--port", "1"], &["--api-key-file", "/run/k"], &["--api-key="]]
        {
            assert!(in_argv(Engine::LlamaCpp, "l.service", &w(words)).is_empty(), "{words:?}");
        }
        // Numbers are no secret, unless the flag is one the engine takes a secret by.
        for words in [&["--bucket-time-to-first-token", "0.1,0.5,1"][..], &["--kt-max-deferred-experts-per-token=4"]] {
            assert!(in_argv(Engine::Sglang, "s.service", &w(words)).is_empty(), "{words:?}");
        }
        assert_eq!(in_argv(Engine::Sglang, "s.service", &w(&["--api-key", "123456"])).len(), 1);
        let found = in_argv(Engine::Vllm, "v.service", &w(&["/usr/bin/env", "HF_TOKEN=x", "vllm"]));
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].1.starts_with("sets HF_TOKEN, which looks like a secret"), "{found:?}");
    }
}
