//! The tool tier: specd against the real tools it drives or is driven by, as plain processes —
//! git (sources, signatures with ssh-keygen and gpg, the promotion record), a real Prometheus
//! (the promoter's evidence), promtool (the alert rules), dpkg-buildpackage, debhelper and
//! lintian (the package). No root.

mod follow;
mod monitoring;
mod package;
mod prometheus_evidence;
mod propose;
mod publish;
mod source;
