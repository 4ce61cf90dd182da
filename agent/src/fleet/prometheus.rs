//! A small client of Prometheus's HTTP API: instant queries ([`Prometheus::query`]), the
//! active scrape targets ([`Prometheus::targets`]) and how long a restart leaves vanished
//! series visible ([`Prometheus::unmarked_until`]). Errors are sentences for the user, naming
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

    /// Until when (unix seconds) an instant query may give a series that vanished while this
    /// Prometheus was down: its start plus its lookback delta. Prometheus marks a series stale
    /// when a scrape no longer has it, its scrape fails or its target goes, so an instant query
    /// gives no vanished series; a restarted Prometheus cannot mark those that were gone before
    /// its first scrape, and an instant query gives a series for the lookback delta after its
    /// last sample, which is older than the start. This holds of a Prometheus that scrapes the
    /// agents itself: an error where it receives its samples by remote write (its start says
    /// nothing of the scrapers') or its API has no runtime information or flags (a server that
    /// only answers queries). A URL in front of several Prometheus servers (an HA pair behind a
    /// load balancer) cannot be told from one: give the promoter one of them.
    pub async fn unmarked_until(&self) -> Result<f64, String> {
        let (info, flags) = tokio::join!(self.get("status/runtimeinfo", &[]), self.get("status/flags", &[]));
        let data = |(code, body): (u16, String), what: &str| data_of(&self.url, what, code, &body);
        let (info, flags) = (data(info?, "runtime information")?, data(flags?, "flags")?);
        if receives_remote_writes(&flags) {
            return Err(format!("Prometheus at {}: receives its samples by remote write", self.url));
        }
        let started = info["startTime"].as_str().and_then(unix_of_rfc3339);
        let lookback = flags["query.lookback-delta"].as_str().and_then(seconds_of_duration);
        match (started, lookback) {
            (Some(s), Some(l)) => Ok(s + l),
            _ => Err(format!("Prometheus at {}: no start time or lookback delta", self.url)),
        }
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
    let data = data_of(url, "targets", code, body)?;
    let active = data["activeTargets"].as_array().ok_or_else(|| format!("Prometheus at {url}: no active targets"))?;
    let mut out = BTreeMap::new();
    for t in active {
        let get = |k: &str| t["labels"][k].as_str().map(str::to_string);
        if let (Some(job), Some(instance), Some(scrape)) = (get("job"), get("instance"), t["scrapeUrl"].as_str()) {
            out.insert((job, instance), scrape.to_string());
        }
    }
    Ok(out)
}

/// The `data` of an answer of the API (HTTP status `code`, `body`) when asked for `what`, or
/// why there is none.
fn data_of(url: &str, what: &str, code: u16, body: &str) -> Result<Value, String> {
    if !(200..300).contains(&code) {
        return Err(format!("Prometheus at {url} answered {code} when asked for its {what}"));
    }
    let mut v: Value =
        serde_json::from_str(body).map_err(|_| format!("Prometheus at {url}: its {what} are not JSON"))?;
    Ok(v["data"].take())
}

/// Whether Prometheus's flags (`/api/v1/status/flags`) take samples by remote write (the flag of
/// 2.33 on, or the feature flag before it).
fn receives_remote_writes(flags: &Value) -> bool {
    let flag = |k: &str| flags[k].as_str().unwrap_or_default().to_string();
    flag("web.enable-remote-write-receiver") == "true" || flag("enable-feature").contains("remote-write-receiver")
}

/// Unix seconds of an RFC 3339 time as Go writes it (`2026-12-05T14:17:35.8178Z`, or with an
/// offset such as `+01:00`).
fn unix_of_rfc3339(s: &str) -> Option<f64> {
    let (date, rest) = s.split_once('T')?;
    let num = |t: &str| t.parse::<i64>().ok();
    let mut d = date.splitn(3, '-');
    let (y, m, day) = (num(d.next()?)?, num(d.next()?)?, num(d.next()?)?);
    let (time, offset) = match rest.strip_suffix(['Z', 'z']) {
        Some(t) => (t, 0),
        None => {
            let (t, zone) = rest.split_at(rest.rfind(['+', '-'])?);
            let (hh, mm) = zone[1..].split_once(':')?;
            let sign = if zone.starts_with('-') { -1 } else { 1 };
            (t, sign * (num(hh)? * 3600 + num(mm)? * 60))
        }
    };
    let mut t = time.splitn(3, ':');
    let (hh, mi, ss) = (num(t.next()?)?, num(t.next()?)?, t.next()?.parse::<f64>().ok()?);
    if !(1..=12).contains(&m) || !(1..=31).contains(&day) {
        return None;
    }
    // Days from the civil date (the inverse of `specd_spec::utc`'s algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let (era, yoe) = (y.div_euclid(400), y.rem_euclid(400));
    let doy = (153 * ((m + 9) % 12) + 2) / 5 + day - 1;
    let days = era * 146_097 + yoe * 365 + yoe / 4 - yoe / 100 + doy - 719_468;
    Some((days * 86_400 + hh * 3600 + mi * 60 - offset) as f64 + ss)
}

/// Seconds of a duration as Prometheus writes its flags (`5m`, `1h30m`, `90s`, `1d`, `500ms`).
fn seconds_of_duration(s: &str) -> Option<f64> {
    let mut total = 0.0;
    let mut rest = s;
    while !rest.is_empty() {
        let n = rest.find(|c: char| !(c.is_ascii_digit() || c == '.'))?;
        let value: f64 = rest[..n].parse().ok()?;
        rest = &rest[n..];
        let u = rest.find(|c: char| c.is_ascii_digit()).unwrap_or(rest.len());
        let unit = match &rest[..u] {
            "y" => 365.0 * 86_400.0,
            "w" => 7.0 * 86_400.0,
            "d" => 86_400.0,
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 1e-3,
            "us" | "µs" => 1e-6,
            "ns" => 1e-9,
            _ => return None,
        };
        total += value * unit;
        rest = &rest[u..];
    }
    (!s.is_empty()).then_some(total)
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
    fn prometheus_s_start_time_and_lookback_delta_are_read_as_it_writes_them() {
        let t = unix_of_rfc3339("2026-12-02T10:18:00Z").unwrap();
        assert_eq!(t, 1_796_206_680.0);
        assert_eq!(specd_spec::utc(t as u64), (2026, 12, 2, 10, 18, 0));
        assert_eq!(unix_of_rfc3339("2026-12-02T11:18:00.25+01:00").unwrap(), 1_796_206_680.25);
        assert_eq!(unix_of_rfc3339("2026-12-02T05:48:00-04:30").unwrap(), 1_796_206_680.0);
        assert_eq!(unix_of_rfc3339("2024-02-29T00:00:00Z").unwrap(), 1_709_164_800.0);
        assert_eq!(unix_of_rfc3339("1970-01-01T00:00:00Z").unwrap(), 0.0);
        for bad in ["", "2026-12-02", "2026-13-02T00:00:00Z", "2026-12-02T10:18Z", "yesterday"] {
            assert_eq!(unix_of_rfc3339(bad), None, "{bad}");
        }
        assert_eq!(seconds_of_duration("5m"), Some(300.0));
        assert_eq!(seconds_of_duration("1h30m15s"), Some(5415.0));
        assert_eq!(seconds_of_duration("1d"), Some(86_400.0));
        assert_eq!(seconds_of_duration("500ms"), Some(0.5));
        for bad in ["", "5", "m", "5 minutes", "-5m"] {
            assert_eq!(seconds_of_duration(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_prometheus_that_receives_remote_writes_is_told_from_one_that_scrapes() {
        let flags = |v: Value| receives_remote_writes(&v);
        assert!(flags(serde_json::json!({"web.enable-remote-write-receiver": "true"})));
        assert!(flags(serde_json::json!({"enable-feature": "exemplar-storage,remote-write-receiver"})));
        assert!(!flags(serde_json::json!({"web.enable-remote-write-receiver": "false", "enable-feature": ""})));
        assert!(!flags(serde_json::json!({})));
    }

    #[test]
    fn a_new_url_must_be_http_with_a_host() {
        assert!(Prometheus::new("ftp://x", None).unwrap_err().to_string().contains("http:// or https://"));
        assert!(Prometheus::new("not a url", None).is_err());
        assert_eq!(Prometheus::new("http://p:9090/", None).unwrap().url(), "http://p:9090");
    }
}
