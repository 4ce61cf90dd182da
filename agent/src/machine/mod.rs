//! The machine's parts as specd drives them, each behind a small API: systemd over its D-Bus
//! (`systemd`, on specd's own client `dbus`), cgroups (`cgroup`), processes (`process`), the
//! servers' HTTP (`probe`), atomic files (`atomic`), per-unit locks (`lock`), specd's own state
//! files (`store`), what load balancers are told and their polls (`serving`), its log stream
//! (`log`), the GPUs' memory (`gpu`, `nvidia-smi`) and specd's own nftables table (`nft`).
//!
//! It decides nothing: what to do with what it reads is the core's (`crate::core`), and the
//! reconciler reaches these parts only through the host boundary (`host/`).

pub mod atomic;
pub mod cgroup;
pub mod dbus;
pub mod gpu;
pub mod lock;
pub mod log;
pub mod nft;
pub mod probe;
pub mod process;
pub mod serving;
pub mod store;
pub mod systemd;
