//! The `specd` command line.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};

use crate::config::{self, AgentConfig};
use crate::reconcile::context::Dirs;
use crate::{commands, daemon, source::spec_files, sweep};

/// The exit codes of every command, as `specd --help` and the README's Commands section give
/// them.
pub const EXIT_CODES: &str = "\
Exit codes (every command):
  0    done, and everything is as asked: valid, applied and verified (or in sync), no
       difference, the agent stopped cleanly
  1    done, and the answer is no: a spec not valid (validate, render, apply); refused before
       anything changed (a unit held, one that cannot start here, results already there); a
       unit that does not run its spec after apply, rollback or sweep (rolled back, failed);
       status not all in sync and healthy; diff found a difference; a UNIT specd has no
       state for (suspend, resume, rollback)
  2    specd could not do it, or cannot tell: a usage error (bad arguments, a UNIT that is no
       unit name); specd's own failure (state, systemd, files, an agent that does not
       answer); status or diff given a spec that is not valid; diagnose without a verdict
  130  interrupted: sweep stopped by SIGINT/SIGTERM (the unit restored), or any command quit by
       a second signal
With --json, apply, diff, rollback and sweep print one JSON document on stdout, whose `ok` is
true exactly when the exit code is 0, and nothing else there (progress stays on stderr).";

/// `specd --version`: the version and the commit it was built from (build.rs), so that two
/// builds of one version can be told apart.
pub const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (rev ", env!("SPECD_REVISION"), ")");

#[derive(Parser, Debug)]
#[command(
    name = "specd",
    version = VERSION,
    about = "GitOps agent for GPU inference hosts: specs in git, systemd units that provably run them",
    after_long_help = EXIT_CODES
)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(clap::Args, Debug, Clone)]
pub struct Global {
    /// specd's state directory.
    #[arg(long, global = true, env = "SPECD_STATE_DIR", default_value = "/var/lib/specd")]
    pub state_dir: PathBuf,
    /// Where specd writes unit files.
    #[arg(long, global = true, env = "SPECD_UNIT_DIR", default_value = "/etc/systemd/system")]
    pub unit_dir: PathBuf,
}

impl Global {
    fn dirs(&self) -> Dirs {
        Dirs { state_dir: self.state_dir.clone(), unit_dir: self.unit_dir.clone() }
    }
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Check spec files (or directories of them): exit 0 when all are valid, 1 otherwise.
    /// Every problem of every file is reported, with file, line, column and field.
    Validate {
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Print a JSON array of the diagnostics (file, line, column, field, severity, message)
        /// on stdout instead of text.
        #[arg(long)]
        json: bool,
        /// Also check, on this host, that each spec's unit could start here (its program, model
        /// and draft, files, user, port, GPUs; what an apply checks before it stops anything).
        /// Exit 1 if one could not.
        #[arg(long)]
        on_host: bool,
        /// With --on-host: merge this host's overlay (default: this machine's hostname).
        #[arg(long, requires = "on_host")]
        host: Option<String>,
    },
    /// Print the unit file a spec renders to.
    Render {
        file: PathBuf,
        /// Merge this host's overlay (default: the base spec, no overlay).
        #[arg(long)]
        host: Option<String>,
        /// Print the sha256 of the unit instead of the unit.
        #[arg(long)]
        hash: bool,
    },
    /// Print the JSON Schema of spec files (or, with `--kind sweep`, of sweep files).
    Schema {
        /// Which document: `inference-service` (a spec) or `sweep`.
        #[arg(long, value_enum, default_value = "inference-service")]
        kind: SchemaKind,
    },
    /// Reconcile specs now: stop, wait for an empty cgroup, write, reload, start, verify, wait
    /// for readiness; roll back if it fails. Several files are all checked first, then applied
    /// at once.
    Apply {
        /// A spec file; several (`-f a.yaml -f b.yaml`) are checked first, then applied at once.
        #[arg(long = "file", short = 'f', required = true)]
        file: Vec<PathBuf>,
        /// Print the plan and change nothing.
        #[arg(long)]
        dry_run: bool,
        /// Print one JSON document of the outcome of every unit on stdout instead of the verdict
        /// lines (progress stays on stderr).
        #[arg(long)]
        json: bool,
        /// Hostname whose overlay applies (default: this machine's hostname).
        #[arg(long)]
        host: Option<String>,
        /// The agent config whose `notify.webhooks` are told of the outcome (if it has any).
        #[arg(long, default_value = "/etc/specd/agent.yaml")]
        config: PathBuf,
    },
    /// Per unit: sync, health, desired vs deployed unit, running config vs spec, last result.
    /// Exit 0 when all are in sync and healthy, 1 otherwise, 2 when it cannot tell.
    Status {
        #[arg(long)]
        json: bool,
        /// Compare with this spec instead of the last desired state specd recorded.
        #[arg(long = "file", short = 'f')]
        file: Option<PathBuf>,
        #[arg(long)]
        host: Option<String>,
    },
    /// Run the agent: follow a git repository and reconcile every unit it holds a spec for.
    #[command(mut_args(run_repo_help))]
    Run {
        #[command(flatten)]
        repo: RepoArgs,
        /// Hostname for host overlays.
        #[arg(long)]
        hostname: Option<String>,
        /// A label of this host, NAME=VALUE (repeatable): added to the config's `labels`, or
        /// replacing the config's value of NAME.
        #[arg(long = "label", value_name = "NAME=VALUE", value_parser = config::label_arg)]
        labels: Vec<(String, String)>,
        /// Seconds between polls of a remote repository.
        #[arg(long)]
        interval: Option<u64>,
        /// Address of the read-only metrics endpoint (GET /metrics, /healthz), any address.
        #[arg(long)]
        listen: Option<String>,
        /// The Unix socket of control actions.
        #[arg(long)]
        control_socket: Option<PathBuf>,
    },
    /// Advance the fleet's rollout by one step (or keep going with --watch): read the followed
    /// branch's head, its fleet file, the promotion record and what Prometheus says every host
    /// runs; write the next step (promote hosts, start a bake, pass a wave, halt) as one
    /// fast-forward commit of the record branch. Stateless: run it from cron or CI.
    Promote {
        #[command(flatten)]
        repo: RepoArgs,
        /// Keep going: a pass every --interval seconds (sooner when a bake ends).
        #[arg(long)]
        watch: bool,
        /// Seconds between passes with --watch.
        #[arg(long, default_value_t = 30)]
        interval: u64,
        #[command(flatten)]
        common: crate::fleet::promote::Common,
    },
    /// The fleet's rollout: status of every host, halt and resume by hand.
    Fleet {
        #[command(subcommand)]
        command: FleetCommand,
    },
    /// A bundle carried to an air-gapped site: `specd bundle import FILE`.
    #[command(subcommand)]
    Bundle(commands::bundle::BundleCommand),
    /// Ask the running agent to reconcile now (one unit, or all), over its control socket.
    Reconcile {
        #[arg(value_parser = unit_arg)]
        unit: Option<String>,
        /// The agent's control socket [default: `control_socket` of the agent config, else
        /// /run/specd/control.sock].
        #[arg(long)]
        socket: Option<PathBuf>,
        /// The agent config that names the control socket.
        #[arg(long, default_value = "/etc/specd/agent.yaml")]
        config: PathBuf,
    },
    /// Clear the quarantine of a unit (its failed hashes are tried again), recorded in its
    /// history. Works while the agent runs.
    Unquarantine {
        #[arg(value_parser = unit_arg)]
        unit: String,
        /// The control socket of the agent to notify, if one runs [default: `control_socket` of
        /// the agent config, else /run/specd/control.sock].
        #[arg(long)]
        socket: Option<PathBuf>,
        /// The agent config that names the control socket.
        #[arg(long, default_value = "/etc/specd/agent.yaml")]
        config: PathBuf,
    },
    /// The agent keeps its hands off a unit: it observes it and reports drift, and changes
    /// nothing, until `specd resume` (or the end of --for). Shown in status, metrics and
    /// history. A hand `specd apply` still applies. Works while the agent runs.
    Suspend {
        #[arg(value_parser = unit_arg)]
        unit: String,
        /// End the suspend by itself after this long (90s, 15m, 2h, 1d, 1h30m).
        #[arg(long = "for", value_parser = commands::holds::parse_duration)]
        for_: Option<std::time::Duration>,
        /// Why, for status and history.
        #[arg(long)]
        reason: Option<String>,
        /// The control socket of the agent to notify, if one runs [default: `control_socket` of
        /// the agent config, else /run/specd/control.sock].
        #[arg(long)]
        socket: Option<PathBuf>,
        /// The agent config that names the control socket.
        #[arg(long, default_value = "/etc/specd/agent.yaml")]
        config: PathBuf,
    },
    /// End a unit's suspend or pin: the agent reconciles it again (to the source's desired unit).
    Resume {
        #[arg(value_parser = unit_arg)]
        unit: String,
        #[arg(long)]
        socket: Option<PathBuf>,
        #[arg(long, default_value = "/etc/specd/agent.yaml")]
        config: PathBuf,
    },
    /// Apply an earlier good unit again (the one before the deployed unit, or --to HASH) through
    /// the normal apply, and pin it: the agent leaves it there until the source has a new
    /// desired unit or `specd resume`.
    Rollback {
        #[arg(value_parser = unit_arg)]
        unit: String,
        /// The unit hash (a prefix of 4 hex digits or more; see `specd history`).
        #[arg(long)]
        to: Option<String>,
        /// Why, for status and history.
        #[arg(long)]
        reason: Option<String>,
        /// The control socket of the agent to notify, if one runs [default: `control_socket` of
        /// the agent config, else /run/specd/control.sock].
        #[arg(long)]
        socket: Option<PathBuf>,
        /// The agent config that names the control socket and the webhooks told of the outcome.
        #[arg(long, default_value = "/etc/specd/agent.yaml")]
        config: PathBuf,
        /// Print one JSON document of the outcome on stdout (the rest goes to stderr).
        #[arg(long)]
        json: bool,
    },
    /// The applies of each unit: time, commit or file, unit hash, result.
    History {
        #[arg(value_parser = unit_arg)]
        unit: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Why did the last instance of a unit end: stop-timeout SIGKILL, OOM kill, CUDA OOM, crash...
    Diagnose {
        #[arg(value_parser = unit_arg)]
        unit: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Unified diff of the deployed unit against the desired one, and the server's args against
    /// the spec. Exit 0 when there is no difference, 1 otherwise.
    Diff {
        #[arg(long = "file", short = 'f')]
        file: PathBuf,
        #[arg(long)]
        host: Option<String>,
        /// Print one JSON document (the unit file's diff and hashes, the server's args that
        /// differ) on stdout instead of the diff.
        #[arg(long)]
        json: bool,
    },
    /// Print the shell completion script of specd for bash, zsh or fish.
    Completions { shell: clap_complete::Shell },
    /// Write the man pages of specd and of each of its commands (specd.1, specd-apply.1, ...),
    /// generated from this command line, into a directory.
    Man {
        #[arg(long, default_value = ".")]
        out: PathBuf,
    },
    /// What the running instance's own counts say of its draft length: the accept length and
    /// decode speed of each speculative.num_steps up to the running one, predicted from the
    /// engine's acceptance by position and step time since it started (with their uncertainty
    /// and the drafts they rest on), the best one, and the spec change that applies it. Exit 0:
    /// keep; 1: a change is recommended; 2: it cannot tell yet.
    Tune(TuneArgs),
    /// Run a benchmarking campaign (a `kind: Sweep` file): apply each point of its matrix
    /// through the apply path, load it at each concurrency, record the results (a point that
    /// fails is recorded with its diagnosis), then restore the unit (or apply the best point;
    /// on SIGINT/SIGTERM the unit is restored). Writes results.jsonl, table.md, results.csv and
    /// plot.svg, and prints the spec change that applies the best point.
    Sweep {
        #[arg(long = "file", short = 'f')]
        file: PathBuf,
        /// Go on with the results in the output directory: points measured before are skipped.
        #[arg(long)]
        resume: bool,
        /// Write the best point's values into the base spec file.
        #[arg(long)]
        write: bool,
        /// Where the results go [default: ./specd-sweep-NAME].
        #[arg(long)]
        out: Option<PathBuf>,
        /// Print the final summary (the best point, where the unit was left, every point's
        /// record) as one JSON document on stdout instead of the table and the spec diff.
        #[arg(long)]
        json: bool,
        /// Measure only the base spec's speculative.num_steps and the one below it (a short
        /// calibration of the step cost for `specd tune`), whatever the matrix says.
        #[arg(long)]
        calibrate: bool,
    },
}

/// `specd tune`'s flags.
#[derive(clap::Args, Debug)]
pub struct TuneArgs {
    #[arg(value_parser = unit_arg)]
    unit: String,
    /// A sweep file of the unit: its objective says what is best, and its records (of
    /// speculative.num_steps alone: a sweep over it, or `specd sweep --calibrate`) calibrate the
    /// step cost and are compared with the predictions.
    #[arg(long)]
    sweep: Option<PathBuf>,
    /// The sweep's output directory [default: ./specd-sweep-NAME].
    #[arg(long)]
    out: Option<PathBuf>,
    /// The spec file the change is shown against [default: the file the unit was applied from].
    #[arg(long = "file", short = 'f')]
    file: Option<PathBuf>,
    /// Fewer drafts than this since the instance started: it cannot tell yet, and proposes
    /// nothing.
    #[arg(long, default_value_t = crate::core::tune::MIN_DRAFTS)]
    min_drafts: u64,
    /// The host whose overlay applies [default: this machine's name].
    #[arg(long)]
    host: Option<String>,
    /// Write the recommended change as a signed commit on the branch specd-proposals/UNIT of
    /// the repository the agent follows (never the followed branch), for a person to merge.
    #[arg(long)]
    propose: bool,
    #[command(flatten)]
    repo: RepoArgs,
    /// Sign the proposal with this SSH private key.
    #[arg(long)]
    sign_ssh_key: Option<PathBuf>,
    /// Sign the proposal with this OpenPGP key id.
    #[arg(long)]
    sign_gpg_key: Option<String>,
    /// The proposal's author and committer [default: specd tune <specd@HOSTNAME>].
    #[arg(long)]
    author: Option<String>,
    /// Print one JSON document on stdout instead of the table.
    #[arg(long)]
    json: bool,
}

impl TuneArgs {
    fn options(self, dirs: &Dirs) -> anyhow::Result<crate::tune::Options> {
        let host = crate::reconcile::context::hostname(self.host.clone());
        let propose = if self.propose {
            let cfg = self.repo.config()?;
            let signing = crate::tune::propose::signing(self.sign_ssh_key, self.sign_gpg_key)?;
            Some(crate::tune::propose::Options {
                source: cfg.source()?,
                cache: dirs.state_dir.join("propose"),
                host: host.clone(),
                signing,
                author: self.author.unwrap_or_else(|| crate::tune::propose::author(&host)),
            })
        } else {
            None
        };
        Ok(crate::tune::Options {
            unit: self.unit,
            json: self.json,
            sweep: self.sweep,
            out: self.out,
            file: self.file,
            min_drafts: self.min_drafts,
            host: self.host,
            propose,
        })
    }
}

/// A UNIT argument: a name a spec could give (`specd_spec::unit_name_problem`), checked before
/// any state, lock or unit file path is built from it. A bad one is a usage error (exit 2) and
/// nothing is read or created.
fn unit_arg(v: &str) -> Result<String, String> {
    match specd_spec::unit_name_problem(v) {
        Some(why) => Err(why),
        None => Ok(v.to_string()),
    }
}

/// The repository a command works on (the agent's, a promoter's): the agent config's, or flags.
#[derive(clap::Args, Debug, Clone)]
pub struct RepoArgs {
    /// An agent configuration file: its repository, branch, path and credentials.
    #[arg(long, default_value = "/etc/specd/agent.yaml")]
    config: PathBuf,
    /// The config repository (a path or URL); overrides the config file.
    #[arg(long)]
    repo: Option<String>,
    #[arg(long)]
    branch: Option<String>,
    /// A spec file or directory of specs in the repository (the fleet file is beside them).
    #[arg(long)]
    path: Option<String>,
}

#[derive(Subcommand, Debug)]
pub enum FleetCommand {
    /// The rollout's position and what it waits for, each wave's hosts by standing, and every
    /// host × unit (wave, the revision given and deployed, standing, args verified, accept
    /// length, deaths): all of them in a small fleet, those named by --host or not good in a
    /// large one. Exit 1 when halted, 2 when it cannot tell (no evidence:
    /// the hosts only Prometheus knows are missing).
    Status {
        #[command(flatten)]
        repo: RepoArgs,
        /// List this host's units (repeatable); without it, a fleet of more than 20 hosts is
        /// summarized by wave, with the hosts that are not good.
        #[arg(long = "host", value_name = "NAME")]
        hosts: Vec<String>,
        #[command(flatten)]
        common: crate::fleet::promote::Common,
    },
    /// Halt the rollout: nothing advances (new revisions included) until `specd fleet resume`.
    Halt {
        #[command(flatten)]
        repo: RepoArgs,
        /// Why, recorded in the promotion record.
        #[arg(long)]
        reason: String,
        /// Who halts [default: the sudo user or user, at this host].
        #[arg(long)]
        by: Option<String>,
        #[command(flatten)]
        common: crate::fleet::promote::Common,
    },
    /// Resume a halted rollout: its wave promotes again.
    Resume {
        #[command(flatten)]
        repo: RepoArgs,
        #[arg(long)]
        by: Option<String>,
        #[command(flatten)]
        common: crate::fleet::promote::Common,
    },
}

/// `specd run`'s own words for the repository flags it shares with the promoter's commands (the
/// whole agent config is the agent's; no fleet file is read beside its specs). In place, so that
/// the flags keep their order in the completions.
fn run_repo_help(a: clap::Arg) -> clap::Arg {
    match a.get_id().as_str() {
        "config" => a.help("The agent's configuration file"),
        "path" => a.help("A spec file or directory of specs in the repository"),
        _ => a,
    }
}

impl RepoArgs {
    /// The agent config at `--config`, its repository, branch and path overridden by the flags.
    fn config(self) -> anyhow::Result<AgentConfig> {
        let mut cfg = AgentConfig::load(&self.config)?;
        cfg.repo = self.repo.or(cfg.repo);
        cfg.branch = self.branch.or(cfg.branch);
        cfg.path = self.path.or(cfg.path);
        Ok(cfg)
    }
}

/// The promoter's options from its flags.
fn promoter(
    dirs: &Dirs,
    repo: RepoArgs,
    common: crate::fleet::promote::Common,
) -> anyhow::Result<crate::fleet::promote::Options> {
    crate::fleet::promote::options(&repo.config()?, dirs.state_dir.join("promote"), common)
}

/// The documents `specd schema` describes.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum SchemaKind {
    /// A spec (`kind: InferenceService`).
    InferenceService,
    /// A sweep (`kind: Sweep`).
    Sweep,
    /// A fleet's rollout (`kind: Fleet`).
    Fleet,
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let dirs = cli.global.dirs();
    crate::machine::log::init(match cli.command {
        Command::Run { .. } => crate::machine::log::Mode::Agent,
        _ => crate::machine::log::Mode::Command,
    });
    match cli.command {
        Command::Apply { file, dry_run, json, host, config } => run_async(async move {
            let answers = (!dry_run).then(|| {
                install_notifier(&config);
                answer_load_balancers(&config)
            });
            let done = commands::apply::apply(&dirs, &file, host, dry_run, json).await;
            if let Some(a) = answers {
                a.finish().await;
            }
            done
        }),
        Command::Status { json, file, host } => run_async(commands::status::status(&dirs, json, file.as_deref(), host)),
        Command::Diff { file, host, json } => run_async(commands::diff::diff(&dirs, &file, host, json)),
        Command::Sweep { file, resume, write, out, json, calibrate } => {
            let mut rt = tokio::runtime::Builder::new_multi_thread();
            rt.worker_threads(2);
            run_on(rt, async move {
                let answers = answer_load_balancers(std::path::Path::new(config::DEFAULT_PATH));
                let done = sweep::run(&dirs, sweep::Options { file, resume, write, out, json, calibrate }).await;
                answers.finish().await;
                done
            })
        }
        Command::Tune(args) => run_async(async move { crate::tune::run(&dirs, args.options(&dirs)?).await }),
        Command::Run { repo, hostname, labels, interval, listen, control_socket } => {
            let flags = RunFlags { hostname, labels, interval, listen, control_socket };
            run_async(run_agent(dirs, repo, flags))
        }
        Command::Promote { repo, watch, interval, common } => run_async(async move {
            let opts = promoter(&dirs, repo, common)?;
            crate::fleet::promote::promote(&opts, watch.then(|| std::time::Duration::from_secs(interval.max(1)))).await
        }),
        Command::Fleet { command } => run_async(fleet(dirs, command)),
        Command::Bundle(command) => run_async(async move { commands::bundle::run(command, &dirs.state_dir) }),
        Command::Reconcile { unit, socket, config } => {
            run_async(commands::control::ask_reconcile(config::control_socket(socket, &config), unit))
        }
        Command::Unquarantine { unit, socket, config } => {
            run_async(commands::quarantine::unquarantine(&dirs, unit, config::control_socket(socket, &config)))
        }
        Command::Suspend { unit, for_, reason, socket, config } => {
            run_async(commands::holds::suspend(&dirs, unit, for_, reason, config::control_socket(socket, &config)))
        }
        Command::Resume { unit, socket, config } => {
            run_async(commands::holds::resume(&dirs, unit, config::control_socket(socket, &config)))
        }
        Command::Rollback { unit, to, reason, socket, config, json } => run_async(async move {
            install_notifier(&config);
            let answers = answer_load_balancers(&config);
            let done =
                commands::rollback::rollback(&dirs, unit, to, reason, config::control_socket(socket, &config), json)
                    .await;
            answers.finish().await;
            done
        }),
        Command::History { unit, json } => run_async(commands::history::history(&dirs, unit, json)),
        Command::Diagnose { unit, json } => run_async(commands::diagnose::run(unit.as_deref(), json, &dirs.state_dir)),
        Command::Validate { files, json, on_host, host } => match validate(&files, json) {
            ok if ok == ExitCode::SUCCESS && on_host => {
                run_async(commands::apply::preflight(&files, host, &dirs.state_dir))
            }
            other => other,
        },
        Command::Render { file, host, hash } => render(&file, host.as_deref(), hash),
        Command::Schema { kind } => {
            print!("{}", schema(kind));
            ExitCode::SUCCESS
        }
        Command::Completions { shell } => {
            clap_complete::generate(shell, &mut Cli::command(), "specd", &mut std::io::stdout());
            ExitCode::SUCCESS
        }
        Command::Man { out } => match man_pages(&out) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("specd: error: {e:#}");
                ExitCode::from(2)
            }
        },
    }
}

/// What `specd run`'s flags override in the agent config, besides its repository.
struct RunFlags {
    hostname: Option<String>,
    labels: Vec<(String, String)>,
    interval: Option<u64>,
    listen: Option<String>,
    control_socket: Option<PathBuf>,
}

/// `specd run`: the agent config with the flags over it (a label is added, or replaces the
/// config's value), and the directories it names over the global flags.
async fn run_agent(dirs: Dirs, repo: RepoArgs, f: RunFlags) -> anyhow::Result<u8> {
    let mut cfg = repo.config()?;
    cfg.hostname = f.hostname.or(cfg.hostname);
    cfg.labels.0.extend(f.labels);
    cfg.interval = f.interval.or(cfg.interval);
    cfg.listen = f.listen.or(cfg.listen);
    cfg.control_socket = f.control_socket.or(cfg.control_socket);
    let dirs = Dirs {
        state_dir: cfg.state_dir.clone().unwrap_or(dirs.state_dir),
        unit_dir: cfg.unit_dir.clone().unwrap_or(dirs.unit_dir),
    };
    daemon::run(daemon::RunOptions { config: cfg, dirs }).await?;
    Ok(0)
}

/// `specd fleet status|halt|resume`.
async fn fleet(dirs: Dirs, command: FleetCommand) -> anyhow::Result<u8> {
    match command {
        FleetCommand::Status { repo, hosts, common } => {
            crate::fleet::promote::status(&promoter(&dirs, repo, common)?, &hosts).await
        }
        FleetCommand::Halt { repo, reason, by, common } => {
            let opts = promoter(&dirs, repo, common)?;
            crate::fleet::promote::by_hand(&opts, &crate::fleet::promote::person(by), Some(&reason)).await
        }
        FleetCommand::Resume { repo, by, common } => {
            let opts = promoter(&dirs, repo, common)?;
            crate::fleet::promote::by_hand(&opts, &crate::fleet::promote::person(by), None).await
        }
    }
}

/// The JSON Schema `specd schema --kind KIND` prints.
fn schema(kind: SchemaKind) -> String {
    match kind {
        SchemaKind::InferenceService => specd_spec::json_schema(),
        SchemaKind::Sweep => specd_spec::sweep::json_schema(),
        SchemaKind::Fleet => specd_spec::fleet::json_schema(),
    }
}

/// `specd.1` and one page per command (`specd-apply.1`...), from the clap definition, so
/// that they never disagree with `--help`.
fn man_pages(out: &std::path::Path) -> anyhow::Result<()> {
    use anyhow::Context;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let cmd = Cli::command();
    let page = |cmd: clap::Command, name: &str| -> anyhow::Result<()> {
        let mut buf = Vec::new();
        clap_mangen::Man::new(cmd).render(&mut buf)?;
        let path = out.join(format!("{name}.1"));
        crate::machine::atomic::atomic_write(&path, &buf, 0o644).with_context(|| format!("writing {}", path.display()))
    };
    for sub in cmd.get_subcommands().filter(|s| s.get_name() != "help") {
        let name = format!("specd-{}", sub.get_name());
        let sub = sub.clone().display_name(name.clone()).bin_name(format!("specd {}", sub.get_name()));
        page(sub, &name)?;
    }
    page(cmd, "specd")
}

fn validate(paths: &[PathBuf], json: bool) -> ExitCode {
    // A directory that cannot be read, or a link in one: reported with the files' problems.
    let (files, unread) = spec_files::expand(paths);
    if !json {
        for d in &unread {
            eprintln!("{d}");
        }
    }
    let mut bad = unread.len();
    let total = files.len() + unread.len();
    let mut all = unread;
    for f in &files {
        let diags = match std::fs::read_to_string(f) {
            Ok(text) if specd_spec::sweep::is_sweep(&text) => validate_sweep(f, &text),
            Ok(text) if specd_spec::fleet::is_fleet(&text) => specd_spec::fleet::check(&text, &f.display().to_string()),
            Ok(text) => specd_spec::check(&f.display().to_string(), &text),
            Err(e) => specd_spec::Diagnostics(vec![spec_files::io_diag(f, &e)]),
        };
        if !json {
            for d in &diags.0 {
                eprintln!("{d}");
            }
        }
        if diags.has_errors() {
            bad += 1;
        } else if !json {
            println!("{}: ok", f.display());
        }
        all.extend(diags.0);
    }
    if json {
        println!("{}", diagnostics_json(&all));
    }
    if bad > 0 {
        eprintln!("{bad} of {total} file(s) invalid");
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

/// The webhooks of the agent config, for a one-shot command that applies. A config that cannot be
/// read is a warning: the apply goes on, unannounced.
/// For a one-shot command that stops units (`apply`, `rollback`, `sweep`): its reconciles wait
/// for the load balancers as the agent config's `load_balancer:` says, and while it runs, where no
/// agent answers them (their ports free), it answers them itself: the agent-check, and the HTTP
/// checks on the agent's `listen`. What it returns stops them when dropped.
fn answer_load_balancers(config: &std::path::Path) -> crate::lb::Endpoints {
    let cfg = AgentConfig::load(config).unwrap_or_else(|e| {
        tracing::warn!("{e:#}; load balancers are answered and waited for by the defaults");
        AgentConfig::default()
    });
    let answers = crate::lb::Answers::new(crate::machine::serving::ServingFiles::host());
    let mut out = crate::lb::serve_one_shot(&cfg.load_balancer, &answers);
    if let Some(h) = daemon::listen::serve_checks(&cfg.listen(), answers.clone()) {
        out.push(h, &answers);
    }
    crate::reconcile::context::set_balancers(out.balancers(&cfg.load_balancer));
    out
}

fn install_notifier(config: &std::path::Path) {
    match AgentConfig::load(config) {
        Ok(cfg) => {
            crate::notify::install(&cfg.notify.webhooks, &crate::reconcile::context::hostname(cfg.hostname.clone()));
        }
        Err(e) => tracing::warn!("{e:#}; no webhook is told of this apply"),
    }
}

/// `specd validate --json`: one object per diagnostic; `[]` when every file is valid.
fn diagnostics_json(diags: &[specd_spec::Diagnostic]) -> String {
    serde_json::to_string_pretty(&spec_files::diagnostics_json(diags)).unwrap_or_else(|_| "[]".into())
}

/// A sweep document, its base spec and every point of it.
fn validate_sweep(f: &std::path::Path, text: &str) -> specd_spec::Diagnostics {
    let sweep = match specd_spec::sweep::parse_sweep(text, &f.display().to_string()) {
        Ok(s) => s,
        Err(d) => return d,
    };
    let base = sweep.base_path(f);
    match spec_files::load(&base).and_then(|b| specd_spec::sweep::points(&sweep, &b)) {
        Ok(_) => specd_spec::Diagnostics::default(),
        Err(d) => d,
    }
}

fn render(file: &std::path::Path, host: Option<&str>, hash: bool) -> ExitCode {
    let spec = match spec_files::load(file).and_then(|p| p.resolve(host)) {
        Ok(s) => s,
        Err(d) => {
            eprintln!("{d}");
            return ExitCode::from(1);
        }
    };
    let unit = specd_spec::render(&spec);
    if hash {
        println!("{}", unit.sha256);
    } else {
        print!("{}", unit.text);
    }
    ExitCode::SUCCESS
}

/// Commands and the agent run on one thread: they wait on systemd, sockets and files, never on
/// the CPU (git reads go to tokio's blocking pool), and one thread is one malloc arena and no
/// cross-thread wake-ups. A sweep's load generator gets worker threads, so that a stream's
/// timestamps are not taken behind another stream's parsing.
fn run_async(f: impl std::future::Future<Output = anyhow::Result<u8>>) -> ExitCode {
    run_on(tokio::runtime::Builder::new_current_thread(), f)
}

fn run_on(mut rt: tokio::runtime::Builder, f: impl std::future::Future<Output = anyhow::Result<u8>>) -> ExitCode {
    let rt = rt.enable_all().build().expect("a tokio runtime");
    let result = rt.block_on(f);
    // What is left in the blocking pool (a wait for another process's unit lock, say) does not
    // keep the process: the command has finished, and the agent joined its workers.
    rt.shutdown_timeout(std::time::Duration::from_secs(1));
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            crate::machine::log::fatal(&format!("{e:#}"));
            ExitCode::from(2)
        }
    }
}
