//! specd, the agent: CLI, reconciler, systemd and cgroup access, readiness probes, state.
//!
//! See ARCHITECTURE.md at the repository root for the map and the invariants. The modules are
//! private; what the tests and the examples drive is in [`parts`].

mod cli;
mod commands;
mod config;
mod core;
mod daemon;
mod diagnose;
mod fleet;
mod host;
mod lb;
mod machine;
mod notify;
mod preflight;
mod reconcile;
mod source;
mod sweep;
mod tune;

/// The `specd` command line (the binary is only this).
pub use cli::main;

/// What specd's own integration tests (`agent/tests`) and benchmarks (`agent/examples`) drive
/// directly, by component, under the names the code gives them. Not a library API: it follows
/// the code, and nothing else is public.
pub mod parts {
    /// The git source, and what a read of it deploys on a host (`follow`).
    pub mod source {
        pub use crate::source::follow::{Evaluation, Follower, evaluate};
        pub use crate::source::git::{GitSource, RECORD_REF, SourceConfig, SpecFile, Verify};
    }
    /// The promoter: its decision (pure), its evidence from Prometheus, its record's commits.
    pub mod fleet {
        pub use crate::fleet::evidence::{Prometheus, Sample, deaths_since, gather};
        pub use crate::fleet::promote::SOON;
        pub use crate::fleet::publish::{Pushed, Signing, commit_record, push_record};
        pub use crate::fleet::rollout::{
            Evidence, ExpectedUnit, HostEvidence, Inputs, Served, Step, UnitEvidence, decide,
        };
    }
    /// The agent's exporter: the fleet simulator of the bench serves each simulated host's
    /// figures with it, as the agent does.
    pub mod daemon {
        pub use crate::core::sync::SyncStatus;
        pub use crate::daemon::metrics::{Metrics, UnitFigures};
    }
    /// A sweep's load generator and its records (`results.jsonl`).
    pub mod sweep {
        pub use crate::sweep::loadgen::{Api, BUILTIN_PROMPTS, Level, LevelResult, prompts_from_jsonl, run};
        pub use crate::sweep::report::{PointOutcome, PointResult};
    }
    /// `specd tune`'s model (pure), the counts it reads of an engine, its proposals' branches.
    pub mod tune {
        pub use crate::core::counts::{Counts, observe};
        pub use crate::core::tune::{
            Acceptance, Decode, Goal, MIN_DRAFTS, Observed, Prediction, Row, Verdict, predict,
        };
        pub use crate::tune::propose::{BRANCH_PREFIX, Options as ProposeOptions, Proposed, propose};
    }
    /// The diagnosis of an instance's end, from the journal it gathers.
    pub mod diagnose {
        pub use crate::diagnose::{
            Line, MAX_INSTANCES, Raw, assemble, classify, gather_raw, journal_note, last_verdict,
        };
    }
    /// The pre-flight: what it would check of a spec's unit, and its look (the benchmarks time it).
    pub mod preflight {
        pub use crate::preflight::{Check, checks, run};
    }
    /// The core's figures the benchmarks wait and ask by: the readiness poll's backoff, the
    /// speculation proof's length.
    pub mod core {
        pub use crate::core::speculation::TOKENS;
        pub use crate::core::timing::readiness_backoff;
    }
    /// What the benchmarks time specd's own looks with: readiness, the unit properties it reads.
    pub mod machine {
        pub use crate::machine::probe::{Health, Probe};
        pub use crate::machine::systemd::PROPS;
    }
}
