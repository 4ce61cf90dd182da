//! A real Prometheus (Debian's `prometheus` package, run here as a plain process with its own
//! config, storage and loopback port) scrapes `specd run` in the box, with the alert rules of
//! `monitoring/` loaded, and every figure the agent exports is read back through Prometheus's
//! HTTP API, compared with what `specd status --json`, git and the unit's history say. One box,
//! one agent and one Prometheus for every check; Prometheus scrapes and evaluates every second.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::common::*;
use specd_e2e::Prometheus;

const UNIT: &str = "qwen.service";
/// A second unit, the stand-in playing vLLM with n-gram drafting: vLLM's counters give both the
/// accept rate and the accept length (SGLang's reply gives only the length).
const SMOL: &str = "smol.service";
/// The scrape job: the rules' `up{job="specd"}` names it.
const JOB: &str = "specd";

/// Prometheus scraping the agent at 127.0.0.1:`target` every second, with the rules of
/// `rules` evaluated every second; returns once it answers ready.
fn prometheus(target: u16, rules: &Path, dir: &Path) -> Prometheus {
    let config = format!(
        "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\nrule_files: [{rules:?}]\nscrape_configs:\n  - job_name: {JOB}\n    static_configs: [{{targets: [\"127.0.0.1:{target}\"]}}]\n",
    );
    Prometheus::start(dir, &config).unwrap_or_else(|e| panic!("{e:#}"))
}

fn commit(repo: &Path, name: &str, text: &str, msg: &str) -> String {
    std::fs::write(repo.join("specs").join(name), text).unwrap();
    git(repo, &["add", "-A"]);
    git(repo, &["commit", "-q", "-m", msg]);
    git(repo, &["rev-parse", "HEAD"])
}

fn spec(f: &Fleet, steps: u32, env: &str) -> String {
    let service = format!(
        "  service: {{restart: always, timeout_stop_sec: 5, environment: {{{env}SPECD_STANDIN_LOAD_MS: \"200\", SPECD_STANDIN_DRAIN_POLL_MS: \"100\"}}}}\n"
    );
    sglang_spec(&f.e.standin, UNIT, f.e.port, steps, &service)
}

fn vllm_spec(f: &Fleet, port: u16) -> String {
    format!(
        "apiVersion: specd/v1\nkind: InferenceService\nmetadata: {{name: smol}}\nspec:\n  unit: {SMOL}\n  engine: vllm\n  command: [{}, vllm, serve]\n  model: /var/lib/models/SmolLM2-135M\n  server: {{host: 127.0.0.1, port: {port}}}\n  speculative: {{algorithm: ngram, num_steps: 3, prompt_lookup_max: 3, prompt_lookup_min: 1}}\n  service: {{restart: always, timeout_stop_sec: 5, environment: {{SPECD_STANDIN_LOAD_MS: \"200\"}}}}\n",
        f.e.standin
    )
}

/// Waits until `unit`'s history has `n` entries and no apply is in progress.
fn wait_history(f: &Fleet, unit: &str, n: usize) -> Value {
    let path = format!("/var/lib/specd/units/{unit}.json");
    wait_for(&format!("{n} entries in {unit}'s history"), Duration::from_secs(60), || {
        let st: Value = serde_json::from_str(&f.e.b.read_to_string(&path).ok()?).ok()?;
        (st["in_progress"].is_null() && st["history"].as_array().is_some_and(|h| h.len() >= n)).then_some(st)
    })
    .unwrap_or_else(|e| panic!("{e}\nagent journal:\n{}", f.e.b.journal(AGENT).unwrap_or_default()))
}

fn status_json(f: &Fleet, unit: &str) -> Value {
    let o = f.e.specd(&["status", "--json"]);
    let v: Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(&o)));
    let units = v["units"].as_array().or(v.as_array()).cloned().unwrap_or_default();
    units.into_iter().find(|u| u["unit"] == unit).unwrap_or_else(|| panic!("no {unit} in status: {v}"))
}

fn rules_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../monitoring/specd-rules.yaml").canonicalize().unwrap()
}

#[test]
fn prometheus_scrapes_the_agent_and_reads_back_every_figure_it_proves() {
    let t0 = Instant::now();
    let f = Fleet::new();
    std::fs::write(f.repo.join("specs/smol.yaml"), vllm_spec(&f, free_port())).unwrap();
    let c1 = commit(&f.repo, "qwen.yaml", &spec(&f, 5, ""), "steps 5, and smol");
    f.run_agent(f.repo.to_str().unwrap(), "", "");
    let prom_dir = tempfile::tempdir().unwrap();
    let prom = prometheus(f.listen, &rules_path(), prom_dir.path());
    wait_history(&f, UNIT, 1);
    wait_history(&f, SMOL, 1);
    let sel = format!("{{job=\"{JOB}\",unit=\"{UNIT}\"}}");
    eprintln!("booted, applied, Prometheus up: {:?}", t0.elapsed());

    // The scrape works and is read as OpenMetrics: the target is up without an error, and
    // the metadata has the info and counter types only that format carries.
    prom.wait_value(&format!("up{{job=\"{JOB}\"}}"), 1.0);
    let targets = prom.api("/api/v1/targets");
    let t = &targets["activeTargets"][0];
    assert_eq!((t["health"].as_str(), t["lastError"].as_str()), (Some("up"), Some("")), "{targets}");
    let meta = prom.api("/api/v1/metadata");
    assert_eq!(meta["specd_build"][0]["type"], "info", "{meta}");
    assert_eq!(meta["specd_unit_deaths"][0]["type"], "counter", "{meta}");
    assert_eq!(meta["specd_reconcile_duration_seconds"][0]["type"], "histogram", "{meta}");

    let version = env!("CARGO_PKG_VERSION");
    let rev = env!("SPECD_REVISION");
    prom.wait_value(&format!("specd_build_info{{job=\"{JOB}\",version=\"{version}\",revision=\"{rev}\"}}"), 1.0);
    prom.wait_value(&format!("specd_source_info{{job=\"{JOB}\",revision=\"{c1}\"}}"), 1.0);

    // A new commit: deployed; the source's one series and the unit's name it, the old gone.
    let c2 = commit(&f.repo, "qwen.yaml", &spec(&f, 6, ""), "steps 6");
    wait_history(&f, UNIT, 2);
    let head = git(&f.repo, &["rev-parse", "HEAD"]);
    assert_eq!(head, c2);
    let l =
        prom.wait(&format!("the source's revision to be {c2}"), "specd_source_info", Duration::from_secs(30), |r| {
            r.len() == 1 && r[0].0["revision"] == c2.as_str()
        });
    assert_eq!(l[0].1, 1.0);
    let st = status_json(&f, UNIT);
    let hash = st["deployed_sha256"].as_str().unwrap().to_string();
    let info =
        prom.wait("the unit's info to name c2", &format!("specd_unit_info{sel}"), Duration::from_secs(30), |r| {
            r.len() == 1 && r[0].0["revision"] == c2.as_str()
        });
    assert_eq!(info[0].0["unit_hash"], hash.as_str(), "{st}");
    assert_eq!(st["applied_source"]["commit"], c2.as_str(), "{st}");

    // The proof's figures, as status shows them; args proven; in sync, up, not held or
    // quarantined; reconciles timed; the source read just now; a local repository is watched.
    let measured = &st["speculation"]["measured"];
    let length = measured["accept_length"].as_f64().unwrap_or_else(|| panic!("no accept length in {st}"));
    prom.wait_value(&format!("specd_unit_accept_length{sel}"), length);
    // SGLang reports the accept length only: a rate it did not measure has no series.
    assert!(measured["accept_rate"].is_null(), "{st}");
    assert_eq!(prom.query(&format!("specd_unit_accept_rate{sel}")), [], "{st}");
    // vLLM's counters give both; its args are proven from its own log line.
    let smol = status_json(&f, SMOL);
    let m = &smol["speculation"]["measured"];
    let smol_sel = format!("{{job=\"{JOB}\",unit=\"{SMOL}\"}}");
    prom.wait_value(
        &format!("specd_unit_accept_rate{smol_sel}"),
        m["accept_rate"].as_f64().unwrap_or_else(|| panic!("no rate: {smol}")),
    );
    prom.wait_value(&format!("specd_unit_accept_length{smol_sel}"), m["accept_length"].as_f64().expect("a length"));
    prom.wait_value(&format!("specd_unit_args_verified{smol_sel}"), 1.0);
    let info = prom.wait_value(&format!("specd_unit_info{smol_sel}"), 1.0);
    assert_eq!(info["revision"], c1.as_str(), "{info}");
    assert_eq!(info["unit_hash"], smol["deployed_sha256"], "{smol}");
    prom.wait_value(&format!("specd_unit_args_verified{sel}"), 1.0);
    prom.wait_value(&format!("specd_unit_quarantined{sel}"), 0.0);
    prom.wait_value(&format!("specd_unit_down{sel}"), 0.0);
    prom.wait_value(&format!("specd_unit_sync{{job=\"{JOB}\",unit=\"{UNIT}\",status=\"InSync\"}}"), 1.0);
    prom.wait_value(&format!("sum(specd_unit_hold{sel})"), 0.0);
    prom.wait_value(&format!("sum(specd_unit_deaths_total{sel})"), 0.0);
    prom.wait(
        "reconciles to be timed",
        &format!("specd_reconcile_duration_seconds_count{sel}"),
        Duration::from_secs(5),
        |r| r.len() == 1 && r[0].1 >= 2.0,
    );
    prom.wait(
        "the source to be read lately",
        "time() - specd_source_last_success_timestamp_seconds",
        Duration::from_secs(5),
        |r| r.len() == 1 && (0.0..120.0).contains(&r[0].1),
    );
    prom.wait_value("specd_source_poll_interval_seconds", 0.0);
    prom.wait_value("specd_resync_interval_seconds", 0.0);
    eprintln!("figures of an applied commit read back: {:?}", t0.elapsed());

    // The server killed: systemd starts it again (restart: always), and the death is counted
    // once, by the verdict `specd diagnose` gives it.
    let o = f.e.b.systemctl(&["kill", "-s", "KILL", UNIT]);
    assert!(o.status.success(), "{}", text(&o));
    prom.wait_value(&format!("specd_unit_deaths_total{{job=\"{JOB}\",unit=\"{UNIT}\",verdict=\"crash\"}}"), 1.0);
    let d = f.e.specd(&["diagnose", UNIT, "--json"]);
    let ds: Value = serde_json::from_slice(&d.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(&d)));
    let last_ended = ds.as_array().unwrap().iter().find(|d| d["verdict"] != "running").cloned().unwrap_or_default();
    assert_eq!(last_ended["verdict"], "crash", "{ds}");
    prom.wait_value(&format!("sum(specd_unit_deaths_total{sel})"), 1.0);
    eprintln!("a death counted: {:?}", t0.elapsed());

    // A commit whose server dies of CUDA OOM while loading: rolled back and quarantined. The
    // source deploys c3, the unit runs c2's unit, not proven to be c3's; the death's verdict is
    // the engine's OOM; the quarantine alert of the rules is pending on the real series.
    let c3 = commit(&f.repo, "qwen.yaml", &spec(&f, 7, "SPECD_STANDIN_CUDA_OOM: \"1\", "), "steps 7 (OOM)");
    let st = wait_history(&f, UNIT, 3);
    assert_eq!(st["history"].as_array().unwrap().last().unwrap()["outcome"], "rolled-back", "{st}");
    prom.wait_value(&format!("specd_unit_quarantined{sel}"), 1.0);
    prom.wait_value(&format!("specd_unit_args_verified{sel}"), 0.0);
    prom.wait("the source's revision to be c3", "specd_source_info", Duration::from_secs(30), |r| {
        r.len() == 1 && r[0].0["revision"] == c3.as_str()
    });
    let info = prom.query(&format!("specd_unit_info{sel}"));
    assert!(
        info.len() == 1 && info[0].0["revision"] == c2.as_str() && info[0].0["unit_hash"] == hash.as_str(),
        "{info:?}"
    );
    prom.wait(
        "a CUDA OOM death",
        &format!("specd_unit_deaths_total{{job=\"{JOB}\",unit=\"{UNIT}\",verdict=\"cuda-oom\"}}"),
        Duration::from_secs(30),
        |r| r.len() == 1 && r[0].1 >= 1.0,
    );
    prom.wait("the quarantine alert", "ALERTS{alertname=\"SpecdUnitQuarantined\"}", Duration::from_secs(30), |r| {
        r.len() == 1 && r[0].0["alertstate"] == "pending" && r[0].0["unit"] == UNIT
    });
    eprintln!("a failed commit read back: {:?}", t0.elapsed());

    // Suspended: the hold's kind.
    let o = f.e.specd(&["suspend", UNIT, "--reason", "maintenance"]);
    assert!(o.status.success(), "{}", text(&o));
    prom.wait_value(&format!("specd_unit_hold{{job=\"{JOB}\",unit=\"{UNIT}\",kind=\"suspend\"}}"), 1.0);

    // Every rule evaluates without error on the real series, and every metric the rules and
    // the dashboard read is one Prometheus has from the agent (or its own `up`).
    let rules = prom.api("/api/v1/rules");
    for g in rules["groups"].as_array().unwrap() {
        for r in g["rules"].as_array().unwrap() {
            assert_eq!(r["health"], "ok", "{r}");
        }
    }
    let names: Vec<String> = serde_json::from_value(prom.api("/api/v1/label/__name__/values")).unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for (place, expr) in specd_e2e::promql::monitoring_queries(&root).unwrap() {
        for n in specd_e2e::promql::metric_names(&expr) {
            assert!(names.contains(&n), "{place}: {expr}: Prometheus has no {n} from the agent: {names:?}");
        }
    }
    drop(prom);
    f.e.b.shutdown().unwrap();
    eprintln!("prometheus: {:?} in all", t0.elapsed());
}
