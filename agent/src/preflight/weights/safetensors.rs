//! A model folder's safetensors weights: the index and the shards it names, each header checked
//! against its file's size.

use super::*;

/// The most of a safetensors header the loader reads (the safetensors crate's
/// `MAX_HEADER_SIZE`).
pub(super) const SAFETENSORS_MAX_HEADER: u64 = 100_000_000;

/// The index the engines read to choose a sharded model's safetensors files (vLLM's
/// `SAFE_WEIGHTS_INDEX_NAME`, transformers').
pub(super) const SAFETENSORS_INDEX: &str = "model.safetensors.index.json";

/// The most of an index file read (a large model's is a few hundred kB).
pub(super) const INDEX_MAX: u64 = 64 << 20;

/// The files of the model folder `dir` that the engine loads, with what is wrong with its
/// weights said into `out`.
pub(super) fn folder(s: &Sight, what: &str, dir: &Path, out: &mut Vec<Found>) -> Vec<Loaded> {
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
pub(super) fn weight_map(s: &Sight, index: &Path) -> Result<BTreeMap<String, BTreeSet<String>>, String> {
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

/// A safetensors file, opened and its header checked.
pub(super) fn safetensors_file(s: &Sight, path: &Path) -> Result<Header, Wrong> {
    let (f, len) = open(s, path)?;
    safetensors(&mut BufReader::new(f), len)
}

/// What a header says that matters beyond its being whole: a safetensors file's tensor names,
/// and what specd could not check.
#[derive(Debug, Default)]
pub(super) struct Header {
    pub(super) tensors: BTreeSet<String>,
    pub(super) notes: Vec<String>,
}

/// The bits of one element of a safetensors dtype (safetensors' `Dtype::bitsize`).
pub(super) fn dtype_bits(dtype: &str) -> Option<u64> {
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
pub(super) struct TensorEntry {
    pub(super) dtype: String,
    pub(super) shape: Vec<u64>,
    pub(super) data_offsets: (u64, u64),
}

/// The header of a safetensors file of `len` bytes read from `r` (at its start) and checked
/// as the safetensors loader checks it: an 8-byte little-endian size N, N bytes of JSON, then
/// the tensors' data, which they cover exactly (contiguous from 0, each as large as its dtype
/// and shape make it, the last ending at the file's end).
pub(super) fn safetensors(r: &mut impl Read, len: u64) -> Result<Header, Wrong> {
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
