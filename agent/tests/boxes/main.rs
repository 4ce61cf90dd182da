//! The box tier: specd end to end against a real systemd, each test in private systemd boxes
//! (PID 1 of new namespaces: `specd_e2e::SystemdBox`), with the stand-in and the real engines.
//! Needs root.

#[path = "../common/mod.rs"]
mod common;

mod agent;
mod agent_ops;
mod apply;
mod deb;
mod diagnose;
mod disturbed;
mod door;
mod fleet;
mod hardening;
mod lb;
mod llama;
mod notify;
mod ops;
mod prometheus;
mod render;
mod secrets;
mod sweep;
mod tune;
mod vllm;
