//! The Hugging Face cache a snapshot is in, and the downloads into it that did not finish.

use super::*;

/// The repository folder of the Hugging Face cache (`models--ORG--NAME`, with `blobs/` and
/// `snapshots/`) that `path` is in a snapshot of, as the host names it.
pub(super) fn cache_of(s: &Sight, path: &Path, is_dir: bool) -> Option<PathBuf> {
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
pub(super) fn unfinished(s: &Sight, what: &str, path: &Path, repo: &Path) -> Vec<Found> {
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
