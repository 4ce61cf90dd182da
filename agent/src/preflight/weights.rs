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

#[cfg(test)]
mod tests;

/// How long the looks may take when a check reads weights whole (`weights.verify`): reading
/// 240 GB at 100 MB/s takes 40 minutes. The serving instance serves meanwhile.
pub(super) const DIGESTS_WITHIN: Duration = Duration::from_secs(2 * 3600);

/// The most of a safetensors header the loader reads (the safetensors crate's
/// `MAX_HEADER_SIZE`).
const SAFETENSORS_MAX_HEADER: u64 = 100_000_000;

/// The index the engines read to choose a sharded model's safetensors files (vLLM's
/// `SAFE_WEIGHTS_INDEX_NAME`, transformers').
const SAFETENSORS_INDEX: &str = "model.safetensors.index.json";

/// The most of an index file read (a large model's is a few hundred kB).
const INDEX_MAX: u64 = 64 << 20;

/// The most of a GGUF key or tensor name read (llama.cpp's names are under 64 bytes).
const GGUF_NAME_MAX: u64 = 1 << 16;

/// The state file that remembers digests, in the state directory.
const DIGESTS_FILE: &str = "weight-digests.json";

/// How many digests are remembered (the most recent).
const DIGESTS_KEPT: usize = 4096;

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

// ---------------------------------------------------------------------------------------------
// A model folder.

/// The files of the model folder `dir` that the engine loads, with what is wrong with its
/// weights said into `out`.
fn folder(s: &Sight, what: &str, dir: &Path, out: &mut Vec<Found>) -> Vec<Loaded> {
    let Ok(entries) = s.real(dir).and_then(std::fs::read_dir) else { return Vec::new() };
    let mut names: Vec<String> = entries.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    let safetensors = names.iter().any(|n| n.ends_with(".safetensors"));
    let d = dir.display();
    let said = |name: &str| format!("{name} in {what} {d}");
    let index = names.iter().any(|n| n == SAFETENSORS_INDEX).then(|| dir.join(SAFETENSORS_INDEX));
    // The shards the engine loads: those the index names (the others it ignores), or every
    // safetensors file.
    let shards: Option<BTreeMap<String, BTreeSet<String>>> = match &index {
        Some(p) => match weight_map(s, p) {
            Ok(m) => Some(m),
            Err(wrong) => {
                out.push(problem(s, p, format!("{}: {wrong}", said(SAFETENSORS_INDEX))));
                return Vec::new();
            }
        },
        None => None,
    };
    let weights: Vec<String> = match &shards {
        Some(m) => m.keys().cloned().collect(),
        None => names.iter().filter(|n| n.ends_with(".safetensors")).cloned().collect(),
    };
    let mut missing = Vec::new();
    let mut unindexed = Vec::new();
    for name in &weights {
        let path = dir.join(name);
        match safetensors_file(s, &path) {
            Ok(header) => {
                let listed = shards.as_ref().and_then(|m| m.get(name));
                if let Some(t) = listed.and_then(|l| l.difference(&header.tensors).next()) {
                    unindexed.push((name, t.clone(), listed.map_or(0, |l| l.difference(&header.tensors).count())));
                }
                for n in header.notes {
                    out.push(Found::Note(format!("not checked: {}: {n}", said(name))));
                }
            }
            Err(Wrong::Missing) => missing.push(name),
            Err(Wrong::Broken(wrong)) => out.push(problem(s, &path, format!("{}: {wrong}", said(name)))),
            Err(Wrong::Unknown(why)) => out.push(Found::Note(format!("not checked: {}: {why}", said(name)))),
        }
    }
    if let Some(first) = missing.first() {
        let more = match missing.len() {
            1 => String::new(),
            n => format!(" and {} more", n - 1),
        };
        let message = match shards {
            Some(_) => {
                format!("{} names the shard {first}{more}, which {what} {d} does not have", said(SAFETENSORS_INDEX))
            }
            None => format!("{first}{more} in {what} {d} does not exist"),
        };
        out.push(problem(s, &dir.join(first), message));
    }
    for (name, tensor, n) in unindexed {
        let more = if n > 1 { format!(" and {} more of its tensors", n - 1) } else { String::new() };
        out.push(Found::Note(format!(
            "{} puts the tensor {tensor}{more} in {name}, whose header does not have it",
            said(SAFETENSORS_INDEX)
        )));
    }
    // Every file the engine reads (for a digest), its weights as the index chose them.
    let mut loads: Vec<String> = names
        .iter()
        .filter(|n| engine_reads(n, safetensors) && (shards.is_none() || !n.ends_with(".safetensors")))
        .cloned()
        .collect();
    if shards.is_some() {
        loads.extend(weights.iter().filter(|w| !missing.contains(w)).cloned());
    }
    loads.into_iter().map(|n| Loaded { said: said(&n), path: dir.join(&n) }).collect()
}

/// The shards an index names, each with the tensors it puts there (`weight_map`: tensor →
/// file).
fn weight_map(s: &Sight, index: &Path) -> Result<BTreeMap<String, BTreeSet<String>>, String> {
    let mut text = Vec::new();
    let f = s.real(index).and_then(File::open).map_err(|e| format!("cannot be read: {e}"))?;
    f.take(INDEX_MAX + 1).read_to_end(&mut text).map_err(|e| format!("cannot be read: {e}"))?;
    if text.len() as u64 > INDEX_MAX {
        return Err(format!("larger than {}: not an index", size(INDEX_MAX)));
    }
    let v: serde_json::Value =
        serde_json::from_slice(&text).map_err(|e| format!("not valid JSON ({e}): the engine cannot read it"))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or("has no weight_map (tensor → file): the engine cannot tell its shards")?;
    let mut shards: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (tensor, file) in map {
        let file = file.as_str().ok_or_else(|| format!("puts the tensor {tensor} in {file}, not a file name"))?;
        shards.entry(file.to_string()).or_default().insert(tensor.clone());
    }
    Ok(shards)
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

/// A safetensors file, opened and its header checked.
fn safetensors_file(s: &Sight, path: &Path) -> Result<Header, Wrong> {
    let (f, len) = open(s, path)?;
    safetensors(&mut BufReader::new(f), len)
}

fn open(s: &Sight, path: &Path) -> Result<(File, u64), Wrong> {
    let f = s.real(path).and_then(File::open).map_err(|e| match e.kind() {
        ErrorKind::NotFound => Wrong::Missing,
        _ => Wrong::Unknown(format!("it cannot be read: {e}")),
    })?;
    let len = f.metadata().map_err(|e| Wrong::Unknown(format!("it cannot be read: {e}")))?.len();
    Ok((f, len))
}

/// What a header says that matters beyond its being whole: a safetensors file's tensor names,
/// and what specd could not check.
#[derive(Debug, Default)]
struct Header {
    tensors: BTreeSet<String>,
    notes: Vec<String>,
}

/// The bits of one element of a safetensors dtype (safetensors' `Dtype::bitsize`).
fn dtype_bits(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "F4" => 4,
        "F6_E3M2" | "F6_E2M3" => 6,
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" | "F8_E4M3FNUZ" | "F8_E5M2FNUZ" => 8,
        "I16" | "U16" | "F16" | "BF16" => 16,
        "I32" | "U32" | "F32" => 32,
        "I64" | "U64" | "F64" | "C64" => 64,
        _ => return None,
    })
}

/// One tensor of a safetensors header.
#[derive(Deserialize)]
struct TensorEntry {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: (u64, u64),
}

/// The header of a safetensors file of `len` bytes read from `r` (at its start) and checked
/// as the safetensors loader checks it: an 8-byte little-endian size N, N bytes of JSON, then
/// the tensors' data, which they cover exactly (contiguous from 0, each as large as its dtype
/// and shape make it, the last ending at the file's end).
fn safetensors(r: &mut impl Read, len: u64) -> Result<Header, Wrong> {
    let broken = |m: String| Wrong::Broken(m);
    if len < 8 {
        return Err(broken(format!("{}, too short for a safetensors file: cut short ({INTERRUPTED})", size(len))));
    }
    let mut n = [0u8; 8];
    r.read_exact(&mut n).map_err(|e| Wrong::Unknown(format!("it cannot be read: {e}")))?;
    let n = u64::from_le_bytes(n);
    if n > SAFETENSORS_MAX_HEADER {
        return Err(broken(format!(
            "its first 8 bytes give a header of {n} bytes, more than the safetensors loader reads ({}): not a safetensors file, or its start is corrupt",
            size(SAFETENSORS_MAX_HEADER)
        )));
    }
    if n > len - 8 {
        return Err(broken(format!(
            "{}, but its header alone is to take {}: cut short ({INTERRUPTED})",
            size(len),
            size(n + 8)
        )));
    }
    let mut text = Vec::new();
    r.take(n).read_to_end(&mut text).map_err(|e| Wrong::Unknown(format!("it cannot be read: {e}")))?;
    if (text.len() as u64) < n {
        return Err(Wrong::Unknown("it got shorter while it was read".into()));
    }
    let map: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&text)
        .map_err(|e| broken(format!("its header is not the JSON safetensors writes ({e}): corrupt")))?;
    let mut header = Header::default();
    let mut tensors = Vec::new();
    for (name, v) in map {
        if name == "__metadata__" {
            continue;
        }
        let t: TensorEntry = serde_json::from_value(v).map_err(|e| {
            broken(format!("its header's entry for the tensor {name} is not a tensor's ({e}): corrupt"))
        })?;
        header.tensors.insert(name.clone());
        tensors.push((name, t));
    }
    // The loader sorts the tensors by their offsets, then walks them.
    tensors.sort_by_key(|(_, t)| t.data_offsets);
    let mut end = 0u64;
    for (name, t) in &tensors {
        let (b, e) = t.data_offsets;
        if b != end || e < b {
            return Err(broken(format!(
                "its header puts the tensor {name} at bytes {b}..{e} of the data, but the tensors before it end at {end}: overlapping or with a gap, which the safetensors loader refuses: corrupt"
            )));
        }
        end = e;
        let Some(bits) = dtype_bits(&t.dtype) else {
            header.notes.push(format!("the tensor {name} has the dtype {}, which specd does not know", t.dtype));
            continue;
        };
        let nbits = t.shape.iter().try_fold(bits, |a, d| a.checked_mul(*d));
        let want = match nbits {
            Some(nbits) if nbits % 8 == 0 => nbits / 8,
            _ => {
                return Err(broken(format!(
                    "its header gives the tensor {name} the shape {:?} of {}, which is not a whole number of bytes: corrupt",
                    t.shape, t.dtype
                )));
            }
        };
        if e - b != want {
            return Err(broken(format!(
                "its header gives the tensor {name} the shape {:?} of {} ({want} bytes) but {} bytes of data: corrupt",
                t.shape,
                t.dtype,
                e - b
            )));
        }
    }
    let ends = 8 + n + end;
    if ends > len {
        return Err(broken(format!(
            "{}, but its header says its tensors end at {}: cut short by {} ({INTERRUPTED})",
            size(len),
            size(ends),
            size(ends - len)
        )));
    }
    if ends < len {
        return Err(broken(format!(
            "{}, {} more than its header's tensors take (they end at {}): the safetensors loader refuses a file its tensors do not cover exactly (written over, or appended to?)",
            size(len),
            size(len - ends),
            size(ends)
        )));
    }
    Ok(header)
}

// ---------------------------------------------------------------------------------------------
// GGUF.

/// A GGUF model file and its other parts (a split model), checked; the files it loads.
fn gguf_model(s: &Sight, what: &str, path: &Path, out: &mut Vec<Found>) -> Vec<Loaded> {
    let p = path.display();
    let mut loads = vec![Loaded { said: format!("{what} {p}"), path: path.to_path_buf() }];
    let split = match gguf_file(s, path) {
        Ok(g) => g.split,
        Err(Wrong::Broken(wrong)) => {
            out.push(problem(s, path, format!("{what} {p}: {wrong}")));
            return loads;
        }
        Err(Wrong::Unknown(why)) => {
            out.push(Found::Note(format!("not checked: {what} {p}: {why}")));
            return loads;
        }
        // The look at the model itself says so.
        Err(Wrong::Missing) => return loads,
    };
    let Some((no, count)) = split.filter(|(_, count)| *count > 1) else { return loads };
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let Some(prefix) = name.strip_suffix(&split_suffix(no, count)) else {
        out.push(Found::Note(format!(
            "not checked: {what} {p} is part {} of {count} of a split model, but its name does not end in {}, from which llama.cpp names the other parts",
            no + 1,
            split_suffix(no, count)
        )));
        return loads;
    };
    for other in (0..count).filter(|i| *i != no) {
        let part = path.with_file_name(format!("{prefix}{}", split_suffix(other, count)));
        let said = format!("{} (part {} of {count} of {what} {p})", part.display(), other + 1);
        match gguf_file(s, &part) {
            Ok(_) => {}
            Err(Wrong::Missing) => out.push(problem(s, &part, format!("{said} does not exist"))),
            Err(Wrong::Broken(wrong)) => out.push(problem(s, &part, format!("{said}: {wrong}"))),
            Err(Wrong::Unknown(why)) => out.push(Found::Note(format!("not checked: {said}: {why}"))),
        }
        loads.push(Loaded { said, path: part });
    }
    loads
}

/// llama.cpp's name ending for part `no` (from 0) of `count` (`llama_split_path`).
fn split_suffix(no: u16, count: u16) -> String {
    format!("-{:05}-of-{count:05}.gguf", u32::from(no) + 1)
}

fn gguf_file(s: &Sight, path: &Path) -> Result<Gguf, Wrong> {
    let (f, len) = open(s, path)?;
    gguf(f, len)
}

/// What a GGUF header says beyond its being whole: which part of a split model it is (from 0),
/// of how many.
#[derive(Debug, Default, PartialEq)]
struct Gguf {
    split: Option<(u16, u16)>,
}

/// The GGUF value types (gguf.h `gguf_type`).
mod ty {
    pub const UINT8: u32 = 0;
    pub const INT8: u32 = 1;
    pub const UINT16: u32 = 2;
    pub const INT16: u32 = 3;
    pub const UINT32: u32 = 4;
    pub const INT32: u32 = 5;
    pub const FLOAT32: u32 = 6;
    pub const BOOL: u32 = 7;
    pub const STRING: u32 = 8;
    pub const ARRAY: u32 = 9;
    pub const UINT64: u32 = 10;
    pub const INT64: u32 = 11;
    pub const FLOAT64: u32 = 12;
}

/// The bytes of a fixed-size GGUF value type.
fn fixed_size(t: u32) -> Option<u64> {
    use ty::*;
    match t {
        UINT8 | INT8 | BOOL => Some(1),
        UINT16 | INT16 => Some(2),
        UINT32 | INT32 | FLOAT32 => Some(4),
        UINT64 | INT64 | FLOAT64 => Some(8),
        _ => None,
    }
}

/// A ggml type's block: elements per block and bytes per block (ggml.c `type_traits`). Types
/// llama.cpp removed (their block size is 0 there) and types newer than specd are `None`.
fn ggml_block(t: u32) -> Option<(u64, u64)> {
    Some(match t {
        0 => (1, 4),      // F32
        1 => (1, 2),      // F16
        2 => (32, 18),    // Q4_0
        3 => (32, 20),    // Q4_1
        6 => (32, 22),    // Q5_0
        7 => (32, 24),    // Q5_1
        8 => (32, 34),    // Q8_0
        9 => (32, 36),    // Q8_1
        10 => (256, 84),  // Q2_K
        11 => (256, 110), // Q3_K
        12 => (256, 144), // Q4_K
        13 => (256, 176), // Q5_K
        14 => (256, 210), // Q6_K
        15 => (256, 292), // Q8_K
        16 => (256, 66),  // IQ2_XXS
        17 => (256, 74),  // IQ2_XS
        18 => (256, 98),  // IQ3_XXS
        19 => (256, 50),  // IQ1_S
        20 => (32, 18),   // IQ4_NL
        21 => (256, 110), // IQ3_S
        22 => (256, 82),  // IQ2_S
        23 => (256, 136), // IQ4_XS
        24 => (1, 1),     // I8
        25 => (1, 2),     // I16
        26 => (1, 4),     // I32
        27 => (1, 8),     // I64
        28 => (1, 8),     // F64
        29 => (256, 56),  // IQ1_M
        30 => (1, 2),     // BF16
        34 => (256, 54),  // TQ1_0
        35 => (256, 66),  // TQ2_0
        39 => (32, 17),   // MXFP4
        40 => (64, 36),   // NVFP4
        41 => (128, 18),  // Q1_0
        42 => (64, 18),   // Q2_0
        _ => return None,
    })
}

/// A GGUF file read from its start, every read bounded by its length.
struct Reader<R> {
    r: BufReader<R>,
    at: u64,
    len: u64,
}

impl<R: Read + Seek> Reader<R> {
    /// `n` more bytes are to come: within the file, or it is corrupt (more than it has at all)
    /// or cut short.
    fn need(&self, n: u64, what: &str) -> Result<(), Wrong> {
        if n > self.len {
            return Err(Wrong::Broken(format!(
                "its header gives {what} {n} bytes at byte {}, more than the whole file ({}): corrupt, or cut short",
                self.at,
                size(self.len)
            )));
        }
        if n > self.len - self.at {
            return Err(Wrong::Broken(format!(
                "{}, but its header goes on past its end: cut short ({INTERRUPTED})",
                size(self.len)
            )));
        }
        Ok(())
    }

    fn bytes<const N: usize>(&mut self, what: &str) -> Result<[u8; N], Wrong> {
        self.need(N as u64, what)?;
        let mut b = [0u8; N];
        self.r.read_exact(&mut b).map_err(|e| Wrong::Unknown(format!("it cannot be read: {e}")))?;
        self.at += N as u64;
        Ok(b)
    }

    fn u32(&mut self, what: &str) -> Result<u32, Wrong> {
        self.bytes::<4>(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Result<u64, Wrong> {
        self.bytes::<8>(what).map(u64::from_le_bytes)
    }

    fn skip(&mut self, n: u64, what: &str) -> Result<(), Wrong> {
        self.need(n, what)?;
        let by = i64::try_from(n).map_err(|_| Wrong::Broken(format!("its header gives {what} {n} bytes: corrupt")))?;
        self.r.seek_relative(by).map_err(|e| Wrong::Unknown(format!("it cannot be read: {e}")))?;
        self.at += n;
        Ok(())
    }

    /// A string (its length, then its bytes), up to `max` bytes kept (the rest skipped).
    fn string(&mut self, what: &str, max: u64) -> Result<String, Wrong> {
        let n = self.u64(what)?;
        self.need(n, what)?;
        let keep = n.min(max);
        let mut b = Vec::with_capacity(keep as usize);
        (&mut self.r).take(keep).read_to_end(&mut b).map_err(|e| Wrong::Unknown(format!("it cannot be read: {e}")))?;
        self.at += keep;
        self.skip(n - keep, what)?;
        Ok(String::from_utf8_lossy(&b).into_owned())
    }

    /// Past one value of type `t`.
    fn skip_value(&mut self, t: u32, key: &str) -> Result<(), Wrong> {
        match t {
            ty::STRING => self.string("a string of", 0).map(drop),
            ty::ARRAY => {
                let et = self.u32("an array type of")?;
                let count = self.u64("an array of")?;
                match (et, fixed_size(et)) {
                    (_, Some(n)) => {
                        let bytes = count.checked_mul(n).ok_or_else(|| {
                            Wrong::Broken(format!("its header gives the key {key} an array of {count} values: corrupt"))
                        })?;
                        self.skip(bytes, "an array of")
                    }
                    (ty::STRING, None) => {
                        // Each string takes 8 bytes at least.
                        self.need(count.saturating_mul(8), "an array of strings of")?;
                        (0..count).try_for_each(|_| self.string("a string of", 0).map(drop))
                    }
                    _ => Err(Wrong::Broken(format!(
                        "its header gives the key {key} an array of type {et}, which llama.cpp refuses: corrupt"
                    ))),
                }
            }
            t => match fixed_size(t) {
                Some(n) => self.skip(n, "a value of"),
                None => Err(Wrong::Broken(format!(
                    "its header gives the key {key} the type {t}, which GGUF does not have: corrupt"
                ))),
            },
        }
    }
}

/// One tensor info of a GGUF header.
struct TensorInfo {
    name: String,
    ne: [u64; 4],
    ggml_type: u32,
    offset: u64,
}

/// A GGUF file of `len` bytes, its header read and checked as llama.cpp reads it (gguf.cpp
/// `gguf_init_from_reader`, the model loader's bounds): the magic and version, the key-values
/// (`general.alignment`, default 32, a power of two; `split.no` and `split.count`), the tensor
/// infos, each tensor at the running sum of the aligned sizes before it, and the data of every
/// one within the file.
fn gguf<R: Read + Seek>(f: R, len: u64) -> Result<Gguf, Wrong> {
    let mut r = Reader { r: BufReader::with_capacity(1 << 16, f), at: 0, len };
    let (n_tensors, n_kv) = gguf_counts(&mut r)?;
    let kv = gguf_key_values(&mut r, n_kv)?;
    let infos = tensor_infos(&mut r, n_tensors)?;
    let data = r.at.next_multiple_of(kv.alignment);
    let last_end = tensors_end(&infos, data, kv.alignment, len)?;
    if last_end > len {
        return Err(Wrong::Broken(format!(
            "{}, but its header says its tensors end at {}: cut short by {} ({INTERRUPTED})",
            size(len),
            size(last_end),
            size(last_end - len)
        )));
    }
    let split = match (kv.split_no, kv.split_count) {
        (Some(no), Some(count)) if no >= count => {
            return Err(Wrong::Broken(format!("its header says it is part {} of {count}: corrupt", u32::from(no) + 1)));
        }
        (no, Some(count)) => Some((no.unwrap_or(0), count)),
        _ => None,
    };
    Ok(Gguf { split })
}

/// A GGUF header's start: its magic, a version llama.cpp loads, and its counts of tensors and
/// of key-values (in that order).
fn gguf_counts<R: Read + Seek>(r: &mut Reader<R>) -> Result<(u64, u64), Wrong> {
    let broken = |m: String| Err(Wrong::Broken(m));
    if r.bytes::<4>("its magic")? != *b"GGUF" {
        return broken("it does not start with GGUF's magic: not a GGUF file".into());
    }
    let version = r.u32("its version")?;
    match version {
        2 | 3 => {}
        1 => return broken("GGUF version 1, which llama.cpp no longer loads".into()),
        v if v & 0xffff == 0 => return Err(Wrong::Unknown(format!("GGUF version {v}: big-endian, or corrupt"))),
        v => return Err(Wrong::Unknown(format!("GGUF version {v}, which specd does not know"))),
    }
    let n_tensors = r.u64("its tensor count")?;
    let n_kv = r.u64("its key-value count")?;
    // Each read below is bounded by the file; counts beyond any model's are corrupt.
    if n_kv > u64::from(u32::MAX) || n_tensors > u64::from(u32::MAX) {
        return broken(format!("its header counts {n_tensors} tensors and {n_kv} key-values: corrupt"));
    }
    Ok((n_tensors, n_kv))
}

/// What a GGUF header's key-values say of its layout and its part of a split model.
struct KeyValues {
    /// `general.alignment`: the data's, and each tensor's (32 unless it says).
    alignment: u64,
    split_no: Option<u16>,
    split_count: Option<u16>,
}

/// The `n_kv` key-values of a GGUF header: those the layout depends on read and checked, the
/// others skipped.
fn gguf_key_values<R: Read + Seek>(r: &mut Reader<R>, n_kv: u64) -> Result<KeyValues, Wrong> {
    let mut kv = KeyValues { alignment: 32, split_no: None, split_count: None };
    for _ in 0..n_kv {
        let key = r.string("a key of", GGUF_NAME_MAX)?;
        let t = r.u32("a type of")?;
        match (key.as_str(), t) {
            ("general.alignment", ty::UINT32) => {
                let a = r.u32("its alignment")?;
                if a == 0 || !a.is_power_of_two() {
                    return Err(Wrong::Broken(format!(
                        "its general.alignment is {a}, not a power of two, which llama.cpp refuses: corrupt"
                    )));
                }
                kv.alignment = u64::from(a);
            }
            ("general.alignment", t) => {
                return Err(Wrong::Broken(format!(
                    "its general.alignment has the type {t}, not UINT32, which llama.cpp refuses: corrupt"
                )));
            }
            ("split.no", ty::UINT16) => kv.split_no = Some(u16::from_le_bytes(r.bytes::<2>("split.no")?)),
            ("split.count", ty::UINT16) => kv.split_count = Some(u16::from_le_bytes(r.bytes::<2>("split.count")?)),
            (k, t) => r.skip_value(t, k)?,
        }
    }
    Ok(kv)
}

/// The `n` tensor infos of a GGUF header: name, shape (at most 4 dimensions, none negative),
/// ggml type and offset in the data.
fn tensor_infos<R: Read + Seek>(r: &mut Reader<R>, n: u64) -> Result<Vec<TensorInfo>, Wrong> {
    let mut infos = Vec::with_capacity(n.min(1 << 16) as usize);
    for _ in 0..n {
        let name = r.string("a tensor name of", GGUF_NAME_MAX)?;
        let n_dims = r.u32("a tensor's dimensions")?;
        if n_dims > 4 {
            return Err(Wrong::Broken(format!(
                "its tensor {name} has {n_dims} dimensions; GGUF has at most 4: corrupt"
            )));
        }
        let mut ne = [1u64; 4];
        for d in ne.iter_mut().take(n_dims as usize) {
            let v = r.u64("a tensor's dimension")?;
            if v > i64::MAX as u64 {
                return Err(Wrong::Broken(format!("its tensor {name} has a negative dimension: corrupt")));
            }
            *d = v;
        }
        let ggml_type = r.u32("a tensor's type")?;
        let offset = r.u64("a tensor's offset")?;
        infos.push(TensorInfo { name, ne, ggml_type, offset });
    }
    Ok(infos)
}

/// Where the tensors' data ends in a file of `len` bytes whose data starts at `data`: each
/// tensor of a type specd knows, whole blocks in a row, at the running sum of the `alignment`ed
/// sizes before it. Only the tensors' data must be there (the padding after the last one need
/// not).
fn tensors_end(infos: &[TensorInfo], data: u64, alignment: u64, len: u64) -> Result<u64, Wrong> {
    let broken = |m: String| Err(Wrong::Broken(m));
    let mut expected = 0u64;
    let mut last_end = 0;
    for t in infos {
        let name = &t.name;
        let Some((block, bytes)) = ggml_block(t.ggml_type) else {
            return Err(Wrong::Unknown(format!(
                "its tensor {name} has the ggml type {}, which specd does not know",
                t.ggml_type
            )));
        };
        if t.ne[0] % block != 0 {
            return broken(format!(
                "its tensor {name} has {} elements in a row, not a multiple of its type's block of {block}, which llama.cpp refuses: corrupt",
                t.ne[0]
            ));
        }
        let nbytes = [t.ne[1], t.ne[2], t.ne[3]]
            .iter()
            .try_fold((t.ne[0] / block).checked_mul(bytes), |a, d| a.map(|a| a.checked_mul(*d)))
            .flatten()
            .filter(|n| *n <= len);
        let Some(nbytes) = nbytes else {
            return broken(format!(
                "its tensor {name} of shape {:?} takes more than the whole file ({}): corrupt",
                t.ne,
                size(len)
            ));
        };
        if t.offset != expected {
            return broken(format!(
                "its tensor {name} is at offset {} of the data, where llama.cpp expects it at {expected}: corrupt",
                t.offset
            ));
        }
        last_end = data.saturating_add(expected).saturating_add(nbytes);
        expected = expected.saturating_add(nbytes.next_multiple_of(alignment));
    }
    Ok(last_end)
}

// ---------------------------------------------------------------------------------------------
// The Hugging Face cache.

/// The repository folder of the Hugging Face cache (`models--ORG--NAME`, with `blobs/` and
/// `snapshots/`) that `path` is in a snapshot of, as the host names it.
fn cache_of(s: &Sight, path: &Path, is_dir: bool) -> Option<PathBuf> {
    // A snapshot's files are links into blobs/; its folders are folders.
    let real = if is_dir { s.canonical(path).ok()? } else { s.canonical(path.parent()?).ok()?.join(path.file_name()?) };
    let snapshots = real.ancestors().find(|a| a.file_name().is_some_and(|n| n == "snapshots"))?;
    let repo = snapshots.parent()?;
    s.metadata(&repo.join("blobs")).is_ok_and(|m| m.is_dir()).then(|| repo.to_path_buf())
}

/// Downloads into the cache `repo` that did not finish (`blobs/<digest>[.<8 hex>].incomplete`,
/// renamed to `blobs/<digest>` when whole): the snapshot may lack the files they were to become
/// (huggingface_hub links a file into the snapshot only once its blob is whole). One whose blob
/// is there was left by a download another one finished.
fn unfinished(s: &Sight, what: &str, path: &Path, repo: &Path) -> Vec<Found> {
    let blobs = repo.join("blobs");
    let Ok(entries) = s.real(&blobs).and_then(std::fs::read_dir) else { return Vec::new() };
    let names: BTreeSet<String> = entries.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    let mut partial: Vec<String> = names
        .iter()
        .filter(|n| n.ends_with(".incomplete"))
        .filter(|n| n.split('.').next().is_none_or(|blob| !names.contains(blob)))
        .cloned()
        .collect();
    partial.sort();
    let Some(first) = partial.first() else { return Vec::new() };
    let more = if partial.len() > 1 { format!(" and {} more", partial.len() - 1) } else { String::new() };
    vec![problem(
        s,
        &blobs.join(first),
        format!(
            "{what} {} is a snapshot of the Hugging Face cache {}, where the download of blobs/{first}{more} did not finish: the snapshot may lack files (finish the download, or remove what an abandoned one left)",
            path.display(),
            repo.display()
        ),
    )]
}

// ---------------------------------------------------------------------------------------------
// Digests.

/// How a blob's name is its digest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
enum Algorithm {
    /// An LFS file: the sha256 of its content.
    Sha256,
    /// A file git stores itself: git's blob sha1 (`git hash-object`).
    GitSha1,
}

impl Algorithm {
    /// The digest a Hugging Face cache blob named `name` has.
    fn of_blob(name: &str) -> Option<Algorithm> {
        let hex = name.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        match name.len() {
            64 if hex => Some(Algorithm::Sha256),
            40 if hex => Some(Algorithm::GitSha1),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Algorithm::Sha256 => "sha256",
            Algorithm::GitSha1 => "git blob sha1",
        }
    }

    /// The digest of the file `f`, read whole.
    fn digest(self, f: &mut File, path: &Path) -> std::io::Result<String> {
        match self {
            Algorithm::Sha256 => {
                use sha2::Digest;
                let mut h = sha2::Sha256::new();
                let mut buf = vec![0u8; 1 << 20];
                loop {
                    match f.read(&mut buf) {
                        Ok(0) => break,
                        Ok(n) => h.update(&buf[..n]),
                        Err(e) if e.kind() == ErrorKind::Interrupted => {}
                        Err(e) => return Err(e),
                    }
                }
                Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
            }
            Algorithm::GitSha1 => {
                git2::Oid::hash_file(git2::ObjectType::Blob, path).map(|o| o.to_string()).map_err(std::io::Error::other)
            }
        }
    }
}

/// What specd remembers of the digests it computed (`weight-digests.json` in the state
/// directory), each by the file's identity: device, inode, size and modification time. A file
/// written since (a new download, a copy, an edit) has another identity and is read again; one
/// damaged without a write (a failing disk) is not, which only a read of it would find.
#[derive(Debug, Default, Serialize, Deserialize)]
pub(super) struct Digests {
    #[serde(default)]
    files: Vec<Known>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Known {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: i64,
    mtime_nsec: i64,
    algorithm: Algorithm,
    digest: String,
    /// Where it was found: for a person reading the file.
    path: String,
}

impl Known {
    fn is(&self, meta: &std::fs::Metadata, algorithm: Algorithm) -> bool {
        (self.dev, self.ino, self.size, self.mtime, self.mtime_nsec, self.algorithm)
            == (meta.dev(), meta.ino(), meta.size(), meta.mtime(), meta.mtime_nsec(), algorithm)
    }
}

impl Digests {
    fn load(file: &Path) -> Digests {
        std::fs::read(file).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default()
    }

    /// Written atomically; a state directory specd cannot write (a user's `validate --on-host`)
    /// leaves it unwritten. Two applies that write it at once keep one's digests: the other's
    /// are computed again when asked.
    fn save(&self, file: &Path) {
        if let Ok(bytes) = serde_json::to_vec_pretty(self) {
            let _ = crate::machine::atomic::atomic_write(file, &bytes, 0o600);
        }
    }

    /// The digest of the host's file `path`, remembered or read.
    fn of(&mut self, s: &Sight, path: &Path, algorithm: Algorithm) -> std::io::Result<(String, bool)> {
        let real = s.real(path)?;
        let mut f = File::open(&real)?;
        let meta = f.metadata()?;
        if let Some(k) = self.files.iter().find(|k| k.is(&meta, algorithm)) {
            return Ok((k.digest.clone(), false));
        }
        let digest = algorithm.digest(&mut f, &real)?;
        // The identity after the read: a file written meanwhile is not remembered as read.
        if f.metadata().is_ok_and(|after| after.mtime() == meta.mtime() && after.mtime_nsec() == meta.mtime_nsec()) {
            self.files.retain(|k| (k.dev, k.ino) != (meta.dev(), meta.ino()) || k.algorithm != algorithm);
            self.files.push(Known {
                dev: meta.dev(),
                ino: meta.ino(),
                size: meta.size(),
                mtime: meta.mtime(),
                mtime_nsec: meta.mtime_nsec(),
                algorithm,
                digest: digest.clone(),
                path: path.display().to_string(),
            });
            let over = self.files.len().saturating_sub(DIGESTS_KEPT);
            self.files.drain(..over);
        }
        Ok((digest, true))
    }
}

/// Every file in `loads` compared with the digest its Hugging Face cache blob is named by; the
/// digests remembered in `state_dir`. A file outside a cache has no digest to compare with: a
/// note says so.
fn verified(
    s: &Sight,
    what: &str,
    path: &Path,
    loads: &[Loaded],
    cache: Option<&Path>,
    state_dir: Option<&Path>,
) -> Vec<Found> {
    let mut out = Vec::new();
    let file = state_dir.map(|d| d.join(DIGESTS_FILE));
    let mut digests = file.as_deref().map(Digests::load).unwrap_or_default();
    let mut changed = false;
    let mut unnamed = Vec::new();
    for l in loads {
        let blob = s.canonical(&l.path).ok();
        let named = blob.as_deref().and_then(|b| {
            let in_blobs = cache.is_some_and(|c| b.parent() == Some(&c.join("blobs")));
            let name = b.file_name()?.to_str()?;
            Some((Algorithm::of_blob(name).filter(|_| in_blobs)?, name.to_string()))
        });
        let Some((algorithm, want)) = named else {
            unnamed.push(l.path.file_name().map_or(l.said.clone(), |n| n.to_string_lossy().into_owned()));
            continue;
        };
        match digests.of(s, &l.path, algorithm) {
            Ok((got, read)) => {
                changed |= read;
                // A large file's digest is kept at once: an apply stopped meanwhile does not
                // read it again.
                if read
                    && algorithm == Algorithm::Sha256
                    && let Some(f) = &file
                {
                    digests.save(f);
                    changed = false;
                }
                if got != want {
                    out.push(problem(
                        s,
                        &l.path,
                        format!(
                            "{}: its {} is {got}, not {want}, which its blob in the Hugging Face cache is named by: it is not what was downloaded (damaged on the disk, or written over); remove the blob and download it again",
                            l.said,
                            algorithm.name()
                        ),
                    ));
                }
            }
            Err(e) => out.push(Found::Note(format!("not verified: {}: {e}", l.said))),
        }
    }
    if changed && let Some(f) = &file {
        digests.save(f);
    }
    if let Some(first) = unnamed.first() {
        let p = path.display();
        let more = if unnamed.len() > 1 { format!(" and {} more", unnamed.len() - 1) } else { String::new() };
        out.push(Found::Note(match cache {
            None => format!(
                "not verified: {what} {p} is not in a Hugging Face cache, which names files by their digests: there is nothing to compare them with"
            ),
            Some(c) => format!(
                "not verified: {first}{more} of {what} {p}: not a blob of the Hugging Face cache {}, which names files by their digests: there is nothing to compare with",
                c.display()
            ),
        }));
    }
    out
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
