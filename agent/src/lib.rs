//! specd, the agent: CLI, reconciler, systemd and cgroup access, readiness probes, state.
//!
//! See ARCHITECTURE.md at the repository root for the map and the invariants.

pub mod cli;
pub mod specs;
