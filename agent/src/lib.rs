//! specd, the agent: CLI, reconciler, systemd and cgroup access, readiness probes, state.
//!
//! See ARCHITECTURE.md at the repository root for the map and the invariants.

pub mod cgroup;
pub mod cli;
pub mod diagnose;
pub mod fsx;
pub mod lock;
pub mod ops;
pub mod plan;
pub mod probe;
pub mod reconcile;
pub mod specs;
pub mod state;
pub mod systemd;
