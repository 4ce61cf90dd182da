//! specd, the agent: CLI, reconciler, systemd and cgroup access, readiness probes, state.
//!
//! See ARCHITECTURE.md at the repository root for the map and the invariants.

pub mod agent;
pub mod cgroup;
pub mod cli;
pub mod config;
pub mod diagnose;
pub mod fsx;
pub mod host;
pub mod lock;
pub mod metrics;
pub mod ops;
pub mod owner;
pub mod plan;
pub mod probe;
pub mod reconcile;
pub mod recovery;
pub mod service;
pub mod source;
pub mod specs;
pub mod speculation;
pub mod state;
pub mod systemd;

#[cfg(test)]
mod faults;
