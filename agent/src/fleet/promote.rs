//! `specd promote` and `specd fleet status|halt|resume`: the promoter. Stateless: each pass
//! reads the followed branch's head, its fleet file, the promotion record and the evidence
//! Prometheus has, asks [`rollout::decide`] for the one next step and writes it as one
//! fast-forward commit of the record branch (signed when given a key). A push that is rejected
//! means another promoter moved the record first: the pass reads everything again.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use git2::Oid;
use serde_json::json;
use specd_spec::fleet::{ParsedFleet, Record, RolloutState};
use specd_spec::short;

use crate::fleet::evidence::{self, Prometheus};
use crate::fleet::publish::{self, Pushed, Signing};
use crate::fleet::rollout::{self, Evidence, ExpectedUnit, Inputs, Step};
use crate::fleet::status::View;
use crate::fleet::wake;
use crate::source::git::{GitSource, SourceConfig};

/// How many times a pass reads again after losing a race to another promoter.
const RACES: usize = 5;

/// With `--watch`, while a promoted host applies the target: the next pass starts this long
/// after the last one started (sooner than the interval: a host that turns good frees room for
/// the next at the scrape that shows it).
pub const SOON: Duration = Duration::from_secs(1);

/// What every promoter command needs.
#[derive(Clone, Debug)]
pub struct Options {
    pub source: SourceConfig,
    /// The promoter's clone of the repository.
    pub cache: PathBuf,
    /// Prometheus's base URL (`http://prometheus:9090`).
    pub prometheus: String,
    pub prometheus_ca: Option<PathBuf>,
    /// Each question to Prometheus answered within this.
    pub ask_within: Duration,
    /// A sample older than this many seconds is no evidence.
    pub stale_after: u64,
    pub signing: Option<Signing>,
    /// The commits' author and committer, `Name <email>`.
    pub author: String,
    pub json: bool,
}

/// What a pass read from git.
struct Look {
    head: Oid,
    fleet: ParsedFleet,
    branch: String,
    record: Option<(Oid, Record)>,
}

/// Fetch and read the head, its fleet file and the record. `Ok(None)`: the head has no fleet file.
fn look(opts: &Options) -> Result<Option<(GitSource, Look)>> {
    let src = GitSource::open(opts.source.clone(), &opts.cache)?;
    src.fetch()?;
    let head = src.head()?;
    let Some(file) = src.fleet_file(head)? else { return Ok(None) };
    let fleet = specd_spec::fleet::parse_fleet(&file.text, &format!("{}@{}", file.path, short(&head.to_string())))
        .map_err(|d| anyhow!("the fleet file at {} is not valid:\n{d}", short(&head.to_string())))?;
    let branch = fleet.record_branch().to_string();
    let record = match src.fetch_record(&branch)? {
        None => None,
        Some(oid) => {
            let text = src.read_record(oid)?;
            let file = format!("{}@{} ({branch})", specd_spec::fleet::RECORD_FILE, short(&oid.to_string()));
            let r = Record::parse(&text, &file).map_err(|d| anyhow!("the promotion record is not valid:\n{d}"))?;
            Some((oid, r))
        }
    };
    Ok(Some((src, Look { head, fleet, branch, record })))
}

fn blocking_look(opts: &Options) -> impl std::future::Future<Output = Result<Option<(GitSource, Look)>>> {
    let opts = opts.clone();
    async move { tokio::task::spawn_blocking(move || look(&opts)).await? }
}

/// The units a host runs at a revision, rendered from that revision's specs: each revision's
/// files read and parsed once, and rendered once for every host without an overlay of its own
/// (they all resolve alike); a host with an overlay is rendered for itself.
struct Renderer<'a> {
    src: &'a GitSource,
    revisions: std::cell::RefCell<BTreeMap<String, Result<std::rc::Rc<Revision>, String>>>,
}

/// A revision's specs, parsed, and the units of a host without an overlay.
struct Revision {
    specs: Vec<specd_spec::ParsedSpec>,
    common: Result<Vec<ExpectedUnit>, String>,
}

/// The units of `specs` for `host` (`None`: a host without an overlay).
fn render_all(specs: &[specd_spec::ParsedSpec], host: Option<&str>) -> Result<Vec<ExpectedUnit>, String> {
    let mut out = Vec::new();
    for parsed in specs {
        let spec = parsed.resolve(host).map_err(|d| d.to_string())?;
        let unit = specd_spec::render(&spec);
        out.push(ExpectedUnit {
            unit: unit.unit.clone(),
            unit_hash: unit.sha256.clone(),
            speculates: spec.speculates(),
        });
    }
    Ok(out)
}

impl Revision {
    /// The units of `host`: its own rendering when a spec has an overlay for it, else the common.
    fn units(&self, host: &str) -> Result<Vec<ExpectedUnit>, String> {
        if self.specs.iter().any(|s| s.document.hosts.contains_key(host)) {
            render_all(&self.specs, Some(host))
        } else {
            self.common.clone()
        }
    }
}

impl Renderer<'_> {
    fn revision(&self, rev: &str) -> Result<std::rc::Rc<Revision>, String> {
        let mut cache = self.revisions.borrow_mut();
        let r = cache.entry(rev.to_string()).or_insert_with(|| {
            let oid = Oid::from_str(rev).map_err(|e| e.to_string())?;
            let files = self.src.read_specs(oid).map_err(|e| format!("{e:#}"))?;
            let specs = files
                .iter()
                .map(|f| specd_spec::parse(&f.path, &f.text).map_err(|d| d.to_string()))
                .collect::<Result<Vec<_>, String>>()?;
            let common = render_all(&specs, None);
            Ok(std::rc::Rc::new(Revision { specs, common }))
        });
        r.clone()
    }

    fn units(&self, host: &str, rev: &str) -> Result<Vec<ExpectedUnit>, String> {
        self.revision(rev)?.units(host)
    }
}

fn now_precisely() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

fn now() -> u64 {
    now_precisely() as u64
}

/// The outcome of one pass.
enum Passed {
    /// `moved`: the hosts the step gives another revision (to be woken).
    Wrote {
        commit: Oid,
        message: String,
        moved: Vec<(String, wake::Target)>,
    },
    Waits {
        why: String,
        until: Option<u64>,
        soon: bool,
    },
    NoFleet,
}

fn prometheus(opts: &Options) -> Result<Prometheus> {
    Ok(Prometheus::new(&opts.prometheus, opts.prometheus_ca.as_deref())?.within(opts.ask_within))
}

async fn evidence(opts: &Options, record: Option<&Record>) -> Evidence {
    match prometheus(opts) {
        // At this instant, not at its whole second: a scrape less than a second old counts.
        Ok(p) => evidence::gather(&p, record, now_precisely(), opts.stale_after).await,
        Err(e) => Evidence { unavailable: Some(format!("{e:#}")), ..Default::default() },
    }
}

/// Write `step` on top of `parent`; `Ok(None)`: another promoter moved the branch first.
fn write(
    src: &GitSource,
    opts: &Options,
    branch: &str,
    parent: Option<Oid>,
    record: &Record,
    message: &str,
) -> Result<Option<Oid>> {
    let commit = publish::commit_record(src, parent, &record.render(), message, &opts.author, opts.signing.as_ref())?;
    match publish::push_record(src, commit, branch)? {
        Pushed::Done => Ok(Some(commit)),
        Pushed::Rejected(why) => {
            tracing::info!(%why, "another writer moved the promotion record first; reading it again");
            Ok(None)
        }
    }
}

/// One pass of the promoter: read, decide, write at most one step.
async fn pass(opts: &Options) -> Result<Passed> {
    for _ in 0..RACES {
        let Some((src, l)) = blocking_look(opts).await? else { return Ok(Passed::NoFleet) };
        let ev = evidence(opts, l.record.as_ref().map(|r| &r.1)).await;
        let opts2 = opts.clone();
        let wrote = tokio::task::spawn_blocking(move || -> Result<Result<Passed, ()>> {
            let r = Renderer { src: &src, revisions: Default::default() };
            let expected = |h: &str, rev: &str| r.units(h, rev);
            let head = l.head.to_string();
            let inputs = Inputs {
                fleet: &l.fleet,
                record: l.record.as_ref().map(|r| &r.1),
                head: &head,
                evidence: &ev,
                expected: &expected,
                now: now(),
            };
            match rollout::decide(&inputs) {
                Step::Wait { why, until, soon } => Ok(Ok(Passed::Waits { why, until, soon })),
                Step::Write { record, message } => {
                    let old = l.record.as_ref().map(|r| &r.1);
                    let moved = wake::moved(&l.fleet, old, &record, &ev.hosts);
                    match write(&src, &opts2, &l.branch, l.record.as_ref().map(|r| r.0), &record, &message)? {
                        Some(commit) => Ok(Ok(Passed::Wrote { commit, message, moved })),
                        None => Ok(Err(())),
                    }
                }
            }
        })
        .await??;
        if let Ok(p) = wrote {
            return Ok(p);
        }
    }
    bail!("the promotion record moved under this promoter {RACES} times in a row; try again")
}

/// `specd promote`: one pass, or with `watch` a pass every `watch` (sooner when a bake ends).
pub async fn promote(opts: &Options, watch: Option<Duration>) -> Result<u8> {
    loop {
        let started = tokio::time::Instant::now();
        let passed = pass(opts).await;
        let mut soon = false;
        let until = match &passed {
            Ok(Passed::Wrote { commit, message, moved }) => {
                let (woken, said) = wake_moved(opts, moved).await;
                say(
                    opts,
                    json!({"wrote": commit.to_string(), "message": message, "woken": woken}),
                    &format!(
                        "wrote {}: {message}{}",
                        short(&commit.to_string()),
                        if said.is_empty() { said } else { format!("\n{said}") }
                    ),
                );
                Some(0)
            }
            Ok(Passed::Waits { why, until, soon: s }) => {
                say(opts, json!({"waits": why, "until": until, "soon": s}), &format!("waits: {why}"));
                soon = *s;
                *until
            }
            Ok(Passed::NoFleet) => {
                say(
                    opts,
                    json!({"waits": "no fleet file"}),
                    "the followed branch's head has no fleet file: nothing to promote",
                );
                None
            }
            Err(e) if watch.is_some() => {
                tracing::warn!("promote: {e:#}");
                None
            }
            Err(_) => return passed.map(|_| 0),
        };
        let Some(every) = watch else { return Ok(0) };
        // A step written: look again at once (the next step may be due); a bake that ends
        // sooner than the interval: look then; a host applying: a pass every SOON.
        let pause = match until {
            Some(0) => Duration::ZERO,
            Some(t) => every.min(Duration::from_secs(t.saturating_sub(now()))),
            None if soon => every.min(SOON).saturating_sub(started.elapsed()),
            None => every,
        };
        tokio::time::sleep(pause).await;
    }
}

/// Wakes the agents of the hosts a step moved ([`wake`]): what to print of it, as JSON and text
/// (nothing when it moved none).
async fn wake_moved(opts: &Options, moved: &[(String, wake::Target)]) -> (serde_json::Value, String) {
    if moved.is_empty() {
        return (json!(null), String::new());
    }
    let woken = match prometheus(opts) {
        Ok(p) => wake::wake(&p, moved).await,
        Err(e) => Err(format!("{e:#}")),
    };
    match woken {
        Ok(w) => {
            let missed =
                if w.unreached.is_empty() { String::new() } else { format!("; not: {}", w.unreached.join(", ")) };
            let said = format!("woke {} of the {} agents it moved{missed}", w.answered, w.asked);
            (json!({"asked": w.asked, "answered": w.answered, "unreached": w.unreached}), said)
        }
        Err(why) => {
            let said = format!("woke none of the {} agents it moved ({why}): they poll at their interval", moved.len());
            (json!({"asked": moved.len(), "answered": 0, "unreached": [why]}), said)
        }
    }
}

fn say(opts: &Options, j: serde_json::Value, text: &str) {
    if opts.json {
        println!("{j}");
    } else {
        println!("{text}");
    }
}

/// `specd fleet halt` / `resume`: a person's step, written like the promoter's.
pub async fn by_hand(opts: &Options, person: &str, halt: Option<&str>) -> Result<u8> {
    for _ in 0..RACES {
        let Some((src, l)) = blocking_look(opts).await? else { bail!("the followed branch's head has no fleet file") };
        let Some((parent, record)) = &l.record else {
            bail!("{} has no promotion record yet: run `specd promote` first", l.branch)
        };
        let step = match halt {
            Some(reason) => rollout::halted_by(record, person, reason, now()),
            None => rollout::resumed(record, person),
        };
        let Step::Write { record, message } = step.map_err(|e| anyhow!(e))? else {
            unreachable!("a person's step writes")
        };
        let (opts2, branch, parent) = (opts.clone(), l.branch.clone(), *parent);
        let wrote = tokio::task::spawn_blocking(move || write(&src, &opts2, &branch, Some(parent), &record, &message))
            .await??;
        if let Some(c) = wrote {
            println!("wrote {}", short(&c.to_string()));
            return Ok(0);
        }
    }
    bail!("the promotion record moved under this command {RACES} times in a row; try again")
}

/// `specd fleet status`: the rollout's position, its waves summarized, and the units of the
/// hosts `only` names (of every host when it names none and the fleet is small; see
/// [`crate::fleet::status`]). Exit 1 when halted, 2 when Prometheus could not be asked (the list
/// then lacks the hosts only it knows).
pub async fn status(opts: &Options, only: &[String]) -> Result<u8> {
    let Some((src, l)) = blocking_look(opts).await? else {
        bail!("the followed branch's head has no fleet file: there is no fleet to show")
    };
    let Some((_, record)) = &l.record else {
        bail!("{} has no promotion record yet: run `specd promote` first", l.branch)
    };
    let ev = evidence(opts, Some(record)).await;
    let (record, json, only) = (record.clone(), opts.json, only.to_vec());
    tokio::task::spawn_blocking(move || {
        let r = Renderer { src: &src, revisions: Default::default() };
        let expected = |h: &str, rev: &str| r.units(h, rev);
        let head = l.head.to_string();
        let inputs = Inputs {
            fleet: &l.fleet,
            record: Some(&record),
            head: &head,
            evidence: &ev,
            expected: &expected,
            now: now(),
        };
        let position = match rollout::decide(&inputs) {
            Step::Wait { why, until, .. } => (why, until),
            Step::Write { message, .. } => {
                (format!("the promoter's next step: {}", message.lines().next().unwrap_or_default()), None)
            }
        };
        let hosts = rollout::positions(&inputs, &record);
        let view = View { record: &record, position: &position, hosts: &hosts, evidence: &ev, only: &only };
        if json {
            println!("{}", serde_json::to_string_pretty(&view.json()?).expect("json"));
        } else {
            print!("{}", view.text()?);
        }
        // Without evidence it cannot tell: the hosts only Prometheus knows (selected by labels or
        // a pattern, and not promoted yet) are missing from the list.
        Ok(if ev.unavailable.is_some() { 2 } else { u8::from(record.state == RolloutState::Halted) })
    })
    .await?
}

/// The person a halt or resume is written by: `--by`, else the sudo user or the user, at this host.
pub fn person(by: Option<String>) -> String {
    by.unwrap_or_else(|| {
        let user = std::env::var("SUDO_USER").or_else(|_| std::env::var("USER")).unwrap_or_else(|_| "root".into());
        let host = nix::unistd::gethostname().ok().and_then(|h| h.into_string().ok()).unwrap_or_default();
        format!("{user}@{host}")
    })
}

/// The options from the command line and the agent config (the same repository and credentials).
pub fn options(cfg: &crate::config::AgentConfig, cache: PathBuf, common: Common) -> Result<Options> {
    let source = cfg.source().context("the repository to promote in")?;
    let signing = match (common.sign_ssh_key, common.sign_gpg_key) {
        (Some(_), Some(_)) => bail!("give one of --sign-ssh-key and --sign-gpg-key"),
        (Some(key), None) => Some(Signing::Ssh { key }),
        (None, Some(key)) => Some(Signing::Gpg { key }),
        (None, None) => None,
    };
    Ok(Options {
        source,
        cache,
        prometheus: common.prometheus,
        prometheus_ca: common.prometheus_ca,
        ask_within: Duration::from_secs_f64(common.prometheus_timeout),
        stale_after: common.stale_after,
        signing,
        author: common.author,
        json: common.json,
    })
}

/// The flags every promoter command shares.
#[derive(clap::Args, Debug, Clone)]
pub struct Common {
    /// Prometheus's base URL, which scrapes every agent of the fleet.
    #[arg(long, env = "SPECD_PROMETHEUS", default_value = "http://127.0.0.1:9090")]
    pub prometheus: String,
    /// CA certificates (PEM) trusted for an https:// Prometheus besides the system's.
    #[arg(long)]
    pub prometheus_ca: Option<PathBuf>,
    /// Seconds each question to Prometheus may take (a Prometheus of thousands of hosts on few
    /// cores may need more).
    #[arg(long, default_value_t = 5.0, value_parser = positive_seconds)]
    pub prometheus_timeout: f64,
    /// A sample older than this many seconds is no evidence.
    #[arg(long, default_value_t = 60)]
    pub stale_after: u64,
    /// Sign the record's commits with this SSH private key (agents verify with allowed signers).
    #[arg(long)]
    pub sign_ssh_key: Option<PathBuf>,
    /// Sign the record's commits with this OpenPGP key id.
    #[arg(long)]
    pub sign_gpg_key: Option<String>,
    /// Author and committer of the record's commits.
    #[arg(long, default_value = "specd promote <specd@localhost>")]
    pub author: String,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

fn positive_seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v <= 3600.0 => Ok(v),
        _ => Err(format!("`{s}` is not a number of seconds from 0 to 3600")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_renders_as_its_own_resolution_says_with_or_without_an_overlay() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/qwen35-122b-mtp.yaml");
        let text = std::fs::read_to_string(path).unwrap();
        let specs = vec![specd_spec::parse("qwen.yaml", &text).unwrap()];
        let overlaid: Vec<String> = specs[0].document.hosts.keys().cloned().collect();
        assert!(!overlaid.is_empty());
        let r = Revision { common: render_all(&specs, None), specs };
        for host in overlaid.iter().map(String::as_str).chain(["gpu-77", "h0001"]) {
            assert_eq!(r.units(host), render_all(&r.specs, Some(host)), "{host}");
        }
        assert_ne!(r.units(&overlaid[0]), r.units("gpu-77"));
    }
}
