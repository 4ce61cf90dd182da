//! The metric names a PromQL query reads, and every query of specd's monitoring files (the alert
//! rules and the Grafana dashboard under `monitoring/`): a test checks each name against what
//! the agent serves.

use std::collections::BTreeSet;
use std::path::Path;

use anyhow::{Context, Result, bail};
use serde_json::Value;

/// The alert rules, relative to the repository's root.
pub const RULES: &str = "monitoring/specd-rules.yaml";
/// `promtool test rules`' tests of them.
pub const RULES_TESTS: &str = "monitoring/specd-rules.test.yaml";
/// The Grafana dashboard.
pub const DASHBOARD: &str = "monitoring/specd-dashboard.json";

/// Words of PromQL that are not metric names where a name could stand: operators, modifiers,
/// and the aggregations (`sum by (x) (…)` puts a word between the name and its parenthesis).
const KEYWORDS: &[&str] = &[
    "and",
    "or",
    "unless",
    "offset",
    "bool",
    "inf",
    "nan",
    "atan2",
    "start",
    "end",
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
];
/// Modifiers followed by a list of label names in parentheses.
const LABEL_LISTS: &[&str] = &["by", "without", "on", "ignoring", "group_left", "group_right"];

/// The metric names `expr` selects: every identifier that is not a function, a keyword, a label
/// (in a matcher or a `by`/`on`… list), a string, a number or duration, or a Grafana variable.
pub fn metric_names(expr: &str) -> BTreeSet<String> {
    // Strings, label matchers, ranges and Grafana's variables are blanked out.
    let mut plain = String::new();
    let mut chars = expr.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' | '\'' | '`' => {
                let mut escaped = false;
                for d in chars.by_ref() {
                    if escaped {
                        escaped = false;
                    } else if d == '\\' && c != '`' {
                        escaped = true;
                    } else if d == c {
                        break;
                    }
                }
                plain.push(' ');
            }
            '{' | '[' => {
                let close = if c == '{' { '}' } else { ']' };
                let mut depth = 1;
                for d in chars.by_ref() {
                    if d == c {
                        depth += 1;
                    } else if d == close {
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                }
                plain.push(' ');
            }
            '$' => {
                while chars.peek().is_some_and(|d| d.is_alphanumeric() || *d == '_') {
                    chars.next();
                }
                plain.push(' ');
            }
            '#' => {
                // A comment, to the end of the line.
                for d in chars.by_ref() {
                    if d == '\n' {
                        break;
                    }
                }
            }
            c => plain.push(c),
        }
    }
    // Tokens: identifiers, numbers (with a duration's unit), and single characters.
    let mut tokens: Vec<String> = Vec::new();
    let mut chars = plain.chars().peekable();
    while let Some(&c) = chars.peek() {
        if c.is_whitespace() {
            chars.next();
        } else if c.is_ascii_alphanumeric() || c == '_' || c == ':' || c == '.' {
            let mut t = String::new();
            while let Some(&d) = chars.peek() {
                if d.is_ascii_alphanumeric() || d == '_' || d == ':' || d == '.' {
                    t.push(d);
                    chars.next();
                } else {
                    break;
                }
            }
            tokens.push(t);
        } else {
            tokens.push(c.to_string());
            chars.next();
        }
    }
    let mut names = BTreeSet::new();
    let mut i = 0;
    while i < tokens.len() {
        let t = &tokens[i];
        let next = tokens.get(i + 1).map(String::as_str);
        let is_ident = t.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_' || c == ':');
        if is_ident && LABEL_LISTS.contains(&t.as_str()) {
            // Skip to the list's closing parenthesis (`group_left` may have none).
            if next == Some("(") {
                while i < tokens.len() && tokens[i] != ")" {
                    i += 1;
                }
            }
        } else if is_ident && next != Some("(") && !KEYWORDS.contains(&t.to_ascii_lowercase().as_str()) {
            names.insert(t.clone());
        }
        i += 1;
    }
    names
}

/// Every query of the monitoring files under `root` (the repository): where it is and its text.
/// A dashboard variable's `label_values(metric, label)` is its metric.
pub fn monitoring_queries(root: &Path) -> Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    let rules_path = root.join(RULES);
    let text = std::fs::read_to_string(&rules_path).with_context(|| format!("reading {}", rules_path.display()))?;
    let rules: Value = serde_saphyr::from_str(&text).with_context(|| format!("{}", rules_path.display()))?;
    for g in rules["groups"].as_array().context("the rules have no groups")? {
        for r in g["rules"].as_array().context("a group has no rules")? {
            let name = r["alert"].as_str().or(r["record"].as_str()).unwrap_or("?");
            let expr = r["expr"].as_str().with_context(|| format!("{RULES}: {name} has no expr"))?;
            out.push((format!("{RULES}: {name}"), expr.to_string()));
        }
    }
    let dash_path = root.join(DASHBOARD);
    let text = std::fs::read_to_string(&dash_path).with_context(|| format!("reading {}", dash_path.display()))?;
    let dash: Value = serde_json::from_str(&text).with_context(|| format!("{}", dash_path.display()))?;
    let panels = dash["panels"].as_array().context("the dashboard has no panels")?;
    for p in panels {
        let title = p["title"].as_str().unwrap_or("?");
        for t in p["targets"].as_array().into_iter().flatten() {
            if let Some(e) = t["expr"].as_str() {
                out.push((format!("{DASHBOARD}: panel {title:?}"), e.to_string()));
            }
        }
    }
    for v in dash["templating"]["list"].as_array().into_iter().flatten() {
        let q = match &v["query"] {
            Value::String(s) => s.clone(),
            Value::Object(o) => o.get("query").and_then(Value::as_str).unwrap_or_default().to_string(),
            _ => String::new(),
        };
        if v["type"] != "query" {
            continue;
        }
        let name = v["name"].as_str().unwrap_or("?");
        let expr = match q.trim().strip_prefix("label_values(").and_then(|r| r.strip_suffix(')')) {
            Some(args) => match args.rsplit_once(',') {
                Some((metric, _label)) => metric.trim().to_string(),
                None => bail!("{DASHBOARD}: variable {name}: label_values({args}) names no metric"),
            },
            None => q.clone(),
        };
        out.push((format!("{DASHBOARD}: variable {name}"), expr));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(e: &str) -> Vec<String> {
        metric_names(e).into_iter().collect()
    }

    #[test]
    fn names_are_the_selected_metrics_only() {
        assert_eq!(names("up{job=\"specd\"} == 0"), ["up"]);
        assert_eq!(
            names("histogram_quantile(0.99, sum by (le, instance) (rate(a_bucket{unit=~\"x.*\"}[$__rate_interval])))"),
            ["a_bucket"]
        );
        assert_eq!(names("a < 0.8 * avg_over_time(a[7d] offset 1d)"), ["a"]);
        assert_eq!(
            names("time() - b > 10 * on(instance) group_left c and on (instance, job) c > 0 * group_right(x) y"),
            ["b", "c", "y"]
        );
        assert_eq!(names("max without(status) (d{status=\"Drifted\", unit=~\"$unit\"}) == bool 1"), ["d"]);
        assert_eq!(names("sum(increase(e_total[1h])) by (verdict) or vector(0)"), ["e_total"]);
        assert_eq!(names("label_replace(f, \"x\", \"$1\", \"y\", \"(.*)\")"), ["f"]);
        assert_eq!(names("g:recorded + 1e3"), ["g:recorded"]);
    }
}
