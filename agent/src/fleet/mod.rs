//! Fleet rollouts: the promoter's decision (`rollout`, pure), its evidence from Prometheus
//! (`evidence`), the promotion record's commits (`publish`) and the commands that drive them
//! (`promote`: `specd promote`, `specd fleet status|halt|resume`) and what `fleet status` prints
//! (`status`: by wave, a host's units when named).
//!
//! It may not act on a host: a host acts on the record through its own agent (`crate::source::follow`).

pub mod evidence;
pub mod prometheus;
pub mod promote;
pub mod publish;
pub mod rollout;
pub mod status;
pub mod wake;
