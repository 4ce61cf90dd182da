//! The quick tier: checks of specd's own source and of the command line's handling of specs,
//! needing no root, no systemd box and no tool beyond the build (`systemd-analyze`, which every
//! systemd host has, checks rendered units). `scripts/test --quick` runs it with the unit tests.

mod cli_spec;
mod layers;
mod source;
mod structure;
