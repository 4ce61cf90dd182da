//! A small client of Prometheus's HTTP API: instant queries ([`Prometheus::query`]) and the
//! active scrape targets ([`Prometheus::targets`]). Errors are sentences for the user, naming
//! the URL.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::config::CaFile;

/// One question to Prometheus (connecting included) is answered within this, or it fails as
/// unreachable, unless the promoter is given another bound (`--prometheus-timeout`). A few
/// seconds: the promoter asks about a dozen and waits for no one.
pub const ASK_WITHIN: Duration = Duration::from_secs(5);

/// A client of one Prometheus's HTTP API.
#[derive(Clone, Debug)]
pub struct Prometheus {
    url: String,
    client: reqwest::Client,
    /// A question's bound ([`ASK_WITHIN`] unless [`Prometheus::within`]).
    within: Duration,
}

/// One series of an instant query's answer: its labels (the metric name under `__name__` when
/// the expression kept it) and its value. A scalar answer is one sample without labels.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

impl Prometheus {
    /// A client of the Prometheus at `url` (`http://` or `https://`, its API under
    /// `/api/v1`), trusting the certificates of `ca_file` (PEM) besides the usual roots.
    pub fn new(url: &str, ca_file: Option<&Path>) -> Result<Prometheus> {
        let url = url.trim_end_matches('/').to_string();
        let parsed = reqwest::Url::parse(&url).with_context(|| format!("Prometheus URL `{url}`"))?;
        if !matches!(parsed.scheme(), "http" | "https") || parsed.host_str().is_none() {
            bail!("Prometheus URL `{url}`: must be http:// or https:// with a host");
        }
        // No idle connection is kept: a pass asks a dozen questions minutes apart, and one kept
        // from a Prometheus since restarted would fail as "connection closed" instead of saying
        // what is the matter now.
        let mut b = reqwest::Client::builder().connect_timeout(ASK_WITHIN).pool_max_idle_per_host(0);
        if let Some(path) = ca_file {
            for c in CaFile::read(path).map_err(anyhow::Error::msg)?.certs {
                b = b.add_root_certificate(c);
            }
        }
        let client = b.build().with_context(|| format!("an HTTP client for Prometheus at {url}"))?;
        Ok(Prometheus { url, client, within: ASK_WITHIN })
    }

    /// The same client, each question answered within `d` (connecting within [`ASK_WITHIN`]).
    pub fn within(mut self, d: Duration) -> Prometheus {
        self.within = d;
        self
    }

    /// The URL it was given (without a trailing `/`).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// An instant query (`GET /api/v1/query`) of `expr`, evaluated at `at` (unix seconds, to the
    /// millisecond; Prometheus's now when `None`). Errors are sentences for the user, naming the URL.
    pub async fn query(&self, expr: &str, at: Option<f64>) -> Result<Vec<Sample>, String> {
        let mut params = vec![("query", expr.to_string())];
        if let Some(t) = at {
            params.push(("time", format!("{t:.3}")));
        }
        let (code, body) = self.get("query", &params).await?;
        answer(&self.url, expr, code, &body)
    }

    /// The active scrape targets (`GET /api/v1/targets?state=active`): each one's scrape URL by
    /// its `job` and `instance` labels.
    pub async fn targets(&self) -> Result<BTreeMap<(String, String), String>, String> {
        let (code, body) = self.get("targets", &[("state", "active".to_string())]).await?;
        targets_of(&self.url, code, &body)
    }

    /// `GET /api/v1/<what>?<params>` within the bound: the status code and the body.
    async fn get(&self, what: &str, params: &[(&str, String)]) -> Result<(u16, String), String> {
        let url = &self.url;
        let resp = self
            .client
            .get(format!("{url}/api/v1/{what}"))
            .query(params)
            .timeout(self.within)
            .send()
            .await
            .map_err(|e| format!("Prometheus at {url}: unreachable ({})", why(&e, self.within)))?;
        let code = resp.status().as_u16();
        let body = resp
            .text()
            .await
            .map_err(|e| format!("Prometheus at {url}: its answer broke off ({})", why(&e, self.within)))?;
        Ok((code, body))
    }
}

/// The scrape URLs of an answer of `/api/v1/targets`, by `job` and `instance`.
fn targets_of(url: &str, code: u16, body: &str) -> Result<BTreeMap<(String, String), String>, String> {
    if !(200..300).contains(&code) {
        return Err(format!("Prometheus at {url} answered {code} when asked for its targets"));
    }
    let v: Value = serde_json::from_str(body).map_err(|_| format!("Prometheus at {url}: its targets are not JSON"))?;
    let active =
        v["data"]["activeTargets"].as_array().ok_or_else(|| format!("Prometheus at {url}: no active targets"))?;
    let mut out = BTreeMap::new();
    for t in active {
        let get = |k: &str| t["labels"][k].as_str().map(str::to_string);
        if let (Some(job), Some(instance), Some(scrape)) = (get("job"), get("instance"), t["scrapeUrl"].as_str()) {
            out.insert((job, instance), scrape.to_string());
        }
    }
    Ok(out)
}

/// What went wrong with a request, in the words a user knows.
fn why(e: &reqwest::Error, within: Duration) -> String {
    if e.is_timeout() {
        return format!("no answer within {} s", within.as_secs_f64());
    }
    let mut inner: &dyn std::error::Error = e;
    while let Some(next) = inner.source() {
        if let Some(io) = next.downcast_ref::<std::io::Error>() {
            match io.kind() {
                std::io::ErrorKind::ConnectionRefused => return "connection refused".into(),
                std::io::ErrorKind::ConnectionReset => return "connection reset".into(),
                _ => {}
            }
        }
        inner = next;
    }
    inner.to_string()
}

/// The samples of an answer of `/api/v1/query` (HTTP status `code`, `body`), or why there are
/// none.
fn answer(url: &str, expr: &str, code: u16, body: &str) -> Result<Vec<Sample>, String> {
    let v: Option<Value> = serde_json::from_str(body).ok();
    if let Some(v) = v.as_ref().filter(|v| v["status"] == "error") {
        let kind = v["errorType"].as_str().unwrap_or("error");
        let error = v["error"].as_str().unwrap_or("(no message)");
        return Err(format!("Prometheus at {url} refused the query `{expr}`: {kind}: {error}"));
    }
    if !(200..300).contains(&code) {
        return Err(format!("Prometheus at {url} answered {code}"));
    }
    let bad = |what: &str| format!("Prometheus at {url} answered `{expr}` with {what}");
    let v = v.ok_or_else(|| bad("no JSON"))?;
    let data = &v["data"];
    let value = |pair: &Value| -> Result<f64, String> {
        let text = pair.get(1).and_then(Value::as_str).ok_or_else(|| bad("a sample without a value"))?;
        text.parse::<f64>().map_err(|_| bad(&format!("the value `{text}`, not a number")))
    };
    match data["resultType"].as_str() {
        Some("scalar") => Ok(vec![Sample { labels: BTreeMap::new(), value: value(&data["result"])? }]),
        Some("vector") => {
            let series = data["result"].as_array().ok_or_else(|| bad("a vector without a result"))?;
            series
                .iter()
                .map(|s| {
                    let labels = s["metric"]
                        .as_object()
                        .map(|m| {
                            m.iter().map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string())).collect()
                        })
                        .unwrap_or_default();
                    Ok(Sample { labels, value: value(&s["value"])? })
                })
                .collect()
        }
        other => Err(bad(&format!("a {} result, not an instant vector", other.unwrap_or("missing")))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const URL: &str = "http://prom:9090";

    fn sample(labels: &[(&str, &str)], value: f64) -> Sample {
        Sample { labels: labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(), value }
    }

    #[test]
    fn a_vector_and_a_scalar_are_samples_and_an_error_names_the_query_and_prometheus_words() {
        let vector = r#"{"status":"success","data":{"resultType":"vector","result":[
            {"metric":{"__name__":"up","job":"specd","instance":"h:9"},"value":[1700000000.5,"1"]},
            {"metric":{},"value":[1700000000.5,"NaN"]}]}}"#;
        let got = answer(URL, "up", 200, vector).unwrap();
        assert_eq!(got[0], sample(&[("__name__", "up"), ("job", "specd"), ("instance", "h:9")], 1.0));
        assert!(got[1].value.is_nan() && got[1].labels.is_empty());
        let scalar = r#"{"status":"success","data":{"resultType":"scalar","result":[1700000000,"2.5"]}}"#;
        assert_eq!(answer(URL, "2.5", 200, scalar).unwrap(), vec![sample(&[], 2.5)]);
        let refused = r#"{"status":"error","errorType":"bad_data","error":"parse error: unexpected end of input"}"#;
        assert_eq!(
            answer(URL, "rate(", 400, refused).unwrap_err(),
            "Prometheus at http://prom:9090 refused the query `rate(`: bad_data: parse error: unexpected end of input"
        );
        assert_eq!(
            answer(URL, "up", 503, "Service Unavailable").unwrap_err(),
            "Prometheus at http://prom:9090 answered 503"
        );
        let matrix = r#"{"status":"success","data":{"resultType":"matrix","result":[]}}"#;
        assert!(answer(URL, "up[1m]", 200, matrix).unwrap_err().contains("a matrix result, not an instant vector"));
    }

    #[test]
    fn the_targets_scrape_urls_are_read_by_job_and_instance() {
        let body = r#"{"status":"success","data":{"activeTargets":[
            {"labels":{"job":"specd","instance":"gpu-01"},"scrapeUrl":"http://10.0.0.1:9101/metrics","health":"up"},
            {"labels":{"job":"node","instance":"gpu-01:9100"},"scrapeUrl":"http://10.0.0.1:9100/metrics"},
            {"labels":{"job":"specd"},"scrapeUrl":"http://10.0.0.9:9101/metrics"}],"droppedTargets":[]}}"#;
        let got = targets_of(URL, 200, body).unwrap();
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!(got[&("specd".to_string(), "gpu-01".to_string())], "http://10.0.0.1:9101/metrics");
        assert!(targets_of(URL, 503, "").unwrap_err().contains("answered 503"));
        assert!(targets_of(URL, 200, "{}").unwrap_err().contains("no active targets"));
    }

    #[test]
    fn a_new_url_must_be_http_with_a_host() {
        assert!(Prometheus::new("ftp://x", None).unwrap_err().to_string().contains("http:// or https://"));
        assert!(Prometheus::new("not a url", None).is_err());
        assert_eq!(Prometheus::new("http://p:9090/", None).unwrap().url(), "http://p:9090");
    }
}
