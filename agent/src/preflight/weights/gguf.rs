//! A GGUF model file and the other parts of a split model: header, key-values and tensor infos,
//! each tensor within the file.

use super::*;

/// The most of a GGUF key or tensor name read (llama.cpp's names are under 64 bytes).
pub(super) const GGUF_NAME_MAX: u64 = 1 << 16;

/// A GGUF model file and its other parts (a split model), checked; the files it loads.
pub(super) fn gguf_model(s: &Sight, what: &str, path: &Path, out: &mut Vec<Found>) -> Vec<Loaded> {
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
pub(super) fn split_suffix(no: u16, count: u16) -> String {
    format!("-{:05}-of-{count:05}.gguf", u32::from(no) + 1)
}

pub(super) fn gguf_file(s: &Sight, path: &Path) -> Result<Gguf, Wrong> {
    let (f, len) = open(s, path)?;
    gguf(f, len)
}

/// What a GGUF header says beyond its being whole: which part of a split model it is (from 0),
/// of how many.
#[derive(Debug, Default, PartialEq)]
pub(super) struct Gguf {
    pub(super) split: Option<(u16, u16)>,
}

/// The GGUF value types (gguf.h `gguf_type`).
pub(super) mod ty {
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
pub(super) fn fixed_size(t: u32) -> Option<u64> {
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
pub(super) fn ggml_block(t: u32) -> Option<(u64, u64)> {
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
pub(super) struct Reader<R> {
    pub(super) r: BufReader<R>,
    pub(super) at: u64,
    pub(super) len: u64,
}

impl<R: Read + Seek> Reader<R> {
    /// `n` more bytes are to come: within the file, or it is corrupt (more than it has at all)
    /// or cut short.
    pub(super) fn need(&self, n: u64, what: &str) -> Result<(), Wrong> {
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

    pub(super) fn bytes<const N: usize>(&mut self, what: &str) -> Result<[u8; N], Wrong> {
        self.need(N as u64, what)?;
        let mut b = [0u8; N];
        self.r.read_exact(&mut b).map_err(|e| Wrong::Unknown(format!("it cannot be read: {e}")))?;
        self.at += N as u64;
        Ok(b)
    }

    pub(super) fn u32(&mut self, what: &str) -> Result<u32, Wrong> {
        self.bytes::<4>(what).map(u32::from_le_bytes)
    }

    pub(super) fn u64(&mut self, what: &str) -> Result<u64, Wrong> {
        self.bytes::<8>(what).map(u64::from_le_bytes)
    }

    pub(super) fn skip(&mut self, n: u64, what: &str) -> Result<(), Wrong> {
        self.need(n, what)?;
        let by = i64::try_from(n).map_err(|_| Wrong::Broken(format!("its header gives {what} {n} bytes: corrupt")))?;
        self.r.seek_relative(by).map_err(|e| Wrong::Unknown(format!("it cannot be read: {e}")))?;
        self.at += n;
        Ok(())
    }

    /// A string (its length, then its bytes), up to `max` bytes kept (the rest skipped).
    pub(super) fn string(&mut self, what: &str, max: u64) -> Result<String, Wrong> {
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
    pub(super) fn skip_value(&mut self, t: u32, key: &str) -> Result<(), Wrong> {
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
pub(super) struct TensorInfo {
    pub(super) name: String,
    pub(super) ne: [u64; 4],
    pub(super) ggml_type: u32,
    pub(super) offset: u64,
}

/// A GGUF file of `len` bytes, its header read and checked as llama.cpp reads it (gguf.cpp
/// `gguf_init_from_reader`, the model loader's bounds): the magic and version, the key-values
/// (`general.alignment`, default 32, a power of two; `split.no` and `split.count`), the tensor
/// infos, each tensor at the running sum of the aligned sizes before it, and the data of every
/// one within the file.
pub(super) fn gguf<R: Read + Seek>(f: R, len: u64) -> Result<Gguf, Wrong> {
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
pub(super) fn gguf_counts<R: Read + Seek>(r: &mut Reader<R>) -> Result<(u64, u64), Wrong> {
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
pub(super) struct KeyValues {
    /// `general.alignment`: the data's, and each tensor's (32 unless it says).
    pub(super) alignment: u64,
    pub(super) split_no: Option<u16>,
    pub(super) split_count: Option<u16>,
}

/// The `n_kv` key-values of a GGUF header: those the layout depends on read and checked, the
/// others skipped.
pub(super) fn gguf_key_values<R: Read + Seek>(r: &mut Reader<R>, n_kv: u64) -> Result<KeyValues, Wrong> {
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
pub(super) fn tensor_infos<R: Read + Seek>(r: &mut Reader<R>, n: u64) -> Result<Vec<TensorInfo>, Wrong> {
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
pub(super) fn tensors_end(infos: &[TensorInfo], data: u64, alignment: u64, len: u64) -> Result<u64, Wrong> {
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
