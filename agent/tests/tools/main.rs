//! The tool tier: specd against the real tools it drives or is driven by, as plain processes —
//! git (sources, signatures with ssh-keygen and gpg, the promotion record, bundles), a real Prometheus
//! (the promoter's evidence), promtool (the alert rules), HAProxy (`haproxy -c` of the example config), dpkg-buildpackage, debhelper and
//! lintian (the package). No root.

mod bundle;
mod follow;
mod load_balancer;
mod monitoring;
mod package;
mod prometheus_evidence;
mod propose;
mod publish;
mod source;

/// A unit spec of the git-source tests, its `STEPS` and `DRAFT` replaced by each commit.
const SPEC: &str = "apiVersion: specd/v1
kind: InferenceService
metadata: {name: qwen}
spec:
  unit: qwen.service
  engine: sglang
  model: /models/qwen
  server: {port: 30000, max_running_requests: 16}
  speculative: {algorithm: NEXTN, num_steps: STEPS, eagle_topk: 1, num_draft_tokens: DRAFT}
";
