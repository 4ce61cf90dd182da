//! Where desired states come from: the git repository the agent follows (`git`: fetch, read a
//! commit's specs, the no-rewind and signature gates, the fleet file and the promotion record),
//! what a read of it deploys on this host (`follow`), and spec files on disk (`spec_files`, for the
//! one-shot commands); a bundle carried to an air-gapped site put into the local mirror the agent
//! follows, under the same rules (`bundle`).
//!
//! It may not act on the host: it returns desired states and why a head is refused; the
//! reconciler and the agent act on them.

pub mod bundle;
pub mod follow;
pub mod git;
pub mod spec_files;
