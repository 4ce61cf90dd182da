//! The pure core: every decision specd makes and the records it makes them on. What to do with a
//! unit (`plan`), what follows a failed step (`recovery`), how a reconcile ends (`conclude`), what
//! status a unit has (`sync`), whether a hold keeps the agent's hands off (`hold`), what is
//! recorded per unit (`record`), every duration specd waits or asks by (`timing`), systemd's unit
//! states as types (`unit_state`), the engine's evidence of drafting (`speculation`), what an
//! engine counted since it started (`counts`) and what another draft length would give
//! (`tune`), which units specd may manage (`owner`), how a panic is contained rather than reach
//! the agent's loop (`guard`), the GPUs' memory before a start (`gpu`), what a unit's load
//! balancers are told and whether they saw it (`serving`), whether a replica of a group may go
//! down now (`roll`), what closes a draining unit's port to new connections (`door`).
//!
//! It may not know the machine: no file, process, socket, clock or runtime (no `std::fs`, tokio,
//! nix, reqwest or git2; the test `the_core_does_no_io` reads its source). Every function here
//! is tested on its table of cases, without a host.

pub mod conclude;
pub mod counts;
pub mod door;
pub mod gpu;
pub mod guard;
pub mod hold;
pub mod owner;
pub mod plan;
pub mod record;
pub mod recovery;
pub mod roll;
pub mod serving;
pub mod speculation;
pub mod sync;
pub mod timing;
pub mod tune;
pub mod unit_state;
