//! The weights checked whole before any stop: what the engine will load of a model or draft
//! model, by format, from the files' headers and sizes, never their tensors' data.
//!
//! A weight file cut short by an interrupted download or copy, a shard that an index names and
//! the folder lacks, a Hugging Face cache snapshot whose download has not finished: the engine
//! finds out only when it loads them, after the serving instance was stopped (vLLM after its
//! start-up, llama-server at once; both then fail, and the rollback loads the old model again).
//! Their headers say it first:
//! - safetensors (vLLM, SGLang): the index `model.safetensors.index.json` names the shards the
//!   engine loads (its `weight_map`), or without one every `*.safetensors` of the folder; each
//!   header parses, and its tensors cover the data exactly, contiguous from its first byte to
//!   the file's last, each as large as its dtype and shape say (the safetensors loader's own
//!   rules);
//! - GGUF (llama-server; vLLM loads it too): header, key-values, tensor infos, each tensor at
//!   the offset llama.cpp expects and within the file; the other parts of a split model;
//! - a Hugging Face cache snapshot (`models--ORG--NAME/snapshots/REV`): no download left
//!   unfinished in its `blobs/` (a `.incomplete` file), where the snapshot may lack files.
//!
//! `weights.verify: sha256` also reads every file the engine loads whole and compares it with
//! the digest the Hugging Face cache names its blob by (sha256; git's blob sha1 for small
//! files), remembering each digest by the file's identity ([`Digests`]) so that an unchanged
//! file is read once. Without it, no weight data is read.
//!
//! Every read is bounded by the file's size (a header that claims 2^60 bytes allocates
//! nothing); what specd does not know (a dtype, a ggml type, a GGUF version) is a note.
//!
//! A file per format: `safetensors` (a model folder), `gguf`, `hf_cache`, and `digests`.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::{BufReader, ErrorKind, Read, Seek};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use specd_spec::Verify;

use super::Sight;
use super::files::engine_reads;
use super::look::{Found, problem};

mod digests;
mod gguf;
mod hf_cache;
mod safetensors;
#[cfg(test)]
mod tests;

use digests::*;
use gguf::*;
use hf_cache::*;
use safetensors::*;

/// How long the looks may take when a check reads weights whole (`weights.verify`): reading
/// 240 GB at 100 MB/s takes 40 minutes. The serving instance serves meanwhile.
pub(super) const DIGESTS_WITHIN: Duration = Duration::from_secs(2 * 3600);

/// What a file may be when it is not what its header says.
const INTERRUPTED: &str = "an interrupted download or copy?";

/// The model (or draft model) at `path` (as the host names it), checked as its engine will load
/// it: a folder's weights and index, a GGUF file and its other parts, the Hugging Face cache
/// it is a snapshot of; with `verify`, every file it loads read and compared with its digest,
/// remembered in `state_dir`. `what` names the role ("the model").
pub(super) fn look(s: &Sight, what: &str, path: &Path, verify: Verify, state_dir: Option<&Path>) -> Vec<Found> {
    let Ok(meta) = s.metadata(path) else { return Vec::new() };
    let mut out = Vec::new();
    let loads = if meta.is_dir() { folder(s, what, path, &mut out) } else { gguf_model(s, what, path, &mut out) };
    let cache = cache_of(s, path, meta.is_dir());
    if let Some(repo) = &cache {
        out.extend(unfinished(s, what, path, repo));
    }
    if verify == Verify::Sha256 && !out.iter().any(|f| matches!(f, Found::Problem(_))) {
        out.extend(verified(s, what, path, &loads, cache.as_deref(), state_dir));
    }
    out
}

/// A file the engine loads: as a message names it, and where it is.
struct Loaded {
    said: String,
    path: PathBuf,
}

/// What is wrong with a weight file.
#[derive(Debug, PartialEq)]
enum Wrong {
    /// It is not there (or is a link to nothing).
    Missing,
    /// The engine would fail to load it: why.
    Broken(String),
    /// specd cannot tell: why.
    Unknown(String),
}

/// The file at `path`, opened, and its size.
fn open(s: &Sight, path: &Path) -> Result<(File, u64), Wrong> {
    let f = s.real(path).and_then(File::open).map_err(|e| match e.kind() {
        ErrorKind::NotFound => Wrong::Missing,
        _ => Wrong::Unknown(format!("it cannot be read: {e}")),
    })?;
    let len = f.metadata().map_err(|e| Wrong::Unknown(format!("it cannot be read: {e}")))?.len();
    Ok((f, len))
}

/// A size as people read it: bytes up to 10 kB, then kB, MB, GB, TB with one decimal (powers
/// of 1000, as downloads and disks count).
fn size(n: u64) -> String {
    if n < 10_000 {
        return format!("{n} bytes");
    }
    let mut v = n as f64 / 1000.0;
    let mut unit = 0;
    const UNITS: [&str; 5] = ["kB", "MB", "GB", "TB", "PB"];
    while v >= 1000.0 && unit < UNITS.len() - 1 {
        v /= 1000.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
}
