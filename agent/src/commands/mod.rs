//! The one-shot commands a person runs on a host (`specd apply`, `status`, `diff`, `history`,
//! `rollback`, `suspend`, `resume`, `unquarantine`, `reconcile`, `diagnose`), and what they share.

pub mod diagnose;
pub mod ops;
