//! The quick tier of the harness: the stand-in against the fixtures recorded from the real
//! engines, its performance model, its processes and signals, the load generator's verdicts. No
//! root, no box.

mod standin_fixtures;
mod standin_perf;
mod standin_process;
mod standin_sigterm;
mod traffic;
