//! The box tier of the harness: the systemd box itself (boot, exec, isolation, teardown), the
//! seed's race reproduced in it, and a real HAProxy in front of a server in a box. Needs root.

mod boot;
mod exec;
mod haproxy;
mod isolation;
mod seed_race;
