//! specd, the agent: CLI, reconciler, systemd and cgroup access, readiness probes, state.
//!
//! See ARCHITECTURE.md at the repository root for the map and the invariants. The modules are
//! private; what the binary, the tests and the examples use is exported below, item by item.

mod agent;
mod cgroup;
mod cli;
mod conclude;
mod config;
mod context;
mod dbus;
/// Public for the end-to-end tests of the diagnosis (`agent/tests/e2e_diagnose.rs`).
pub mod diagnose;
mod explain;
mod follow;
mod fsx;
mod guard;
mod hold;
mod host;
mod listen;
mod loadgen;
mod lock;
mod log;
mod metrics;
mod notify;
mod ops;
mod owner;
mod plan;
mod preflight;
mod probe;
mod process;
mod prometheus;
mod promote;
mod publish;
mod reconcile;
mod record;
mod recovery;
mod report;
/// Public for the fleet bench (`agent/examples/bench.rs`): the promoter's decision, pure.
pub mod rollout;
mod service;
mod source;
mod specs;
mod speculation;
mod state;
mod sweep;
mod sync;
mod systemd;
mod timing;

/// The `specd` command line (the binary is only this).
pub use cli::main;

/// Reading and gating the source's head, for the source tests.
pub use follow::{Evaluation, Follower, evaluate};
/// Writing the promotion record (the promoter's), for its tests.
pub use publish::{Pushed, Signing, commit_record, push_record};
pub use source::{GitSource, RECORD_REF, SourceConfig, SpecFile, Verify};

/// What the benchmarks measure specd's readiness policy with.
pub use probe::{Health, Probe};
/// The unit properties specd reads (the benchmarks time one `systemctl show` of them).
pub use speculation::TOKENS as PROOF_TOKENS;
pub use systemd::PROPS as UNIT_PROPERTIES;
pub use timing::readiness_backoff;

/// The sweep's load generator, for its tests against the stand-in and the real llama-server.
pub use loadgen::{
    Api as LoadApi, BUILTIN_PROMPTS, Level as LoadLevel, LevelResult, prompts_from_jsonl, run as run_load,
};
/// The pre-flight: what is checked on the host before an apply stops anything.
pub use preflight::{
    Check as PreflightCheck, CheckKind as PreflightCheckKind, Note as PreflightNote, Outcome as PreflightOutcome,
    Problem as PreflightProblem, checks as preflight_checks, run as run_preflight, summary as preflight_summary,
};
/// The promoter's evidence from Prometheus, for its tests against a real one.
pub use prometheus::{Prometheus, Sample, gather};
/// A sweep's records (`results.jsonl`), for the end-to-end tests of `specd sweep`.
pub use report::{PointOutcome, PointResult};
pub use rollout::{Evidence, HostEvidence, UnitEvidence};

#[cfg(test)]
mod faults;
