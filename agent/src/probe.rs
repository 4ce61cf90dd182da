//! The server's own view: readiness, reported args, in-flight requests. Plain HTTP to the server
//! on the same host; every call has a short timeout so nothing here can hang a reconcile.

use std::time::Duration;

use serde_json::Value;
use specd_spec::{Engine, ExpectedArg, Spec};

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Health {
    /// 200 from the readiness endpoint.
    Ready,
    /// Port closed, or 503: the model is still loading (or the server is draining).
    Loading(String),
    /// Any other answer.
    Error(String),
}

#[derive(Clone)]
pub struct Probe {
    client: reqwest::Client,
}

impl Default for Probe {
    fn default() -> Self {
        Probe::new(Duration::from_secs(5))
    }
}

impl Probe {
    pub fn new(timeout: Duration) -> Probe {
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(Duration::from_millis(500).min(timeout))
            .no_proxy()
            .pool_max_idle_per_host(1)
            .build()
            .expect("an HTTP client");
        Probe { client }
    }

    pub async fn health(&self, url: &str) -> Health {
        match self.client.get(url).send().await {
            Ok(r) if r.status().is_success() => Health::Ready,
            Ok(r) if r.status().as_u16() == 503 => Health::Loading(format!("{url} answered 503")),
            Ok(r) => Health::Error(format!("{url} answered {}", r.status())),
            Err(e) if e.is_connect() => Health::Loading(format!("{url}: port not open yet")),
            Err(e) if e.is_timeout() => Health::Loading(format!("{url}: timed out")),
            Err(e) => Health::Error(format!("{url}: {e}")),
        }
    }

    pub async fn json(&self, url: &str) -> Result<Value, String> {
        let r = self.client.get(url).send().await.map_err(|e| format!("{url}: {e}"))?;
        if !r.status().is_success() {
            return Err(format!("{url} answered {}", r.status()));
        }
        r.json::<Value>().await.map_err(|e| format!("{url}: not JSON: {e}"))
    }

    /// The server's own report of its args, if the engine has one.
    pub async fn server_info(&self, base_url: &str, spec: &Spec) -> Option<Result<Value, String>> {
        let path = spec.server_info_path()?;
        Some(self.json(&format!("{base_url}{path}")).await)
    }

    /// Requests in flight, from the engine's Prometheus metrics, when it exposes them.
    pub async fn running_requests(&self, base_url: &str, engine: Engine) -> Option<u64> {
        let name = match engine {
            Engine::Sglang => "sglang:num_running_reqs",
            Engine::Vllm => "vllm:num_requests_running",
            Engine::LlamaCpp => "llamacpp:requests_processing",
        };
        let r = self.client.get(format!("{base_url}/metrics")).send().await.ok()?;
        if !r.status().is_success() {
            return None;
        }
        metric_sum(&r.text().await.ok()?, name)
    }
}

/// Sum of a metric's samples over all label sets.
pub fn metric_sum(text: &str, name: &str) -> Option<u64> {
    let mut found = false;
    let mut sum = 0.0;
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        if !(rest.starts_with('{') || rest.starts_with(' ')) {
            continue;
        }
        let value = rest.rsplit_once('}').map_or(rest, |(_, v)| v).split_whitespace().next();
        if let Some(v) = value.and_then(|v| v.parse::<f64>().ok()) {
            sum += v;
            found = true;
        }
    }
    found.then_some(sum.round() as u64)
}

/// One arg that the server reports differently from the spec.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ArgMismatch {
    pub key: String,
    pub expected: Value,
    pub actual: Value,
}

impl std::fmt::Display for ArgMismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: spec {} / server {}", self.key, self.expected, self.actual)
    }
}

fn same(a: &Value, b: &Value) -> bool {
    match (a.as_f64(), b.as_f64()) {
        (Some(x), Some(y)) => (x - y).abs() <= 1e-9 * x.abs().max(1.0),
        _ => a == b,
    }
}

/// Compare the expected args with the server's report.
pub fn compare_args(expected: &[ExpectedArg], info: &Value) -> Vec<ArgMismatch> {
    expected
        .iter()
        .filter_map(|e| {
            let actual = info.get(e.key).cloned().unwrap_or(Value::Null);
            (!same(&e.value, &actual)).then(|| ArgMismatch {
                key: e.key.to_string(),
                expected: e.value.clone(),
                actual,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn sums_metric_samples() {
        let t = "# HELP sglang:num_running_reqs x\n# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{model_name=\"a\"} 3.0\nsglang:num_running_reqs{model_name=\"b\"} 2\nsglang:num_running_reqs_total 9\n";
        assert_eq!(metric_sum(t, "sglang:num_running_reqs"), Some(5));
        assert_eq!(metric_sum("x 1\n", "sglang:num_running_reqs"), None);
        assert_eq!(metric_sum("vllm:num_requests_running 4\n", "vllm:num_requests_running"), Some(4));
    }

    #[test]
    fn compares_args_with_float_tolerance_and_nulls() {
        let exp = vec![
            ExpectedArg { key: "mem_fraction_static", value: json!(0.85) },
            ExpectedArg { key: "speculative_num_steps", value: json!(10) },
            ExpectedArg { key: "speculative_algorithm", value: Value::Null },
        ];
        let info = json!({"mem_fraction_static": 0.8500000000000001, "speculative_num_steps": 5});
        let m = compare_args(&exp, &info);
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].key, "speculative_num_steps");
        assert_eq!(m[0].to_string(), "speculative_num_steps: spec 10 / server 5");
    }
}
