//! The files a start reads: the model and the draft (only what the engine reads), environment
//! files and credentials, the working directory, the user and group, the GPU devices.

use super::checks::looks_like_repo_id;
use super::look::{
    Found, Want, Who, access, allowed, denied, first_bytes, lookup_group, lookup_user, missing, mode_owner, problem,
    sandboxed, who,
};
use super::*;
use nix::unistd::{Uid, User};
use sight::Sight;
use std::fs::Metadata;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};

#[allow(clippy::too_many_arguments)]
pub(super) fn look_model(
    s: &Sight,
    role: ModelRole,
    value: &str,
    form: ModelForm,
    cwd: &Cwd,
    runs_as: &RunAs,
    sandbox: &Sandbox,
) -> Vec<Found> {
    let what = role.what();
    let relative = !value.starts_with('/');
    let path = if relative {
        // The engine opens a relative path from its working directory.
        match cwd_path(cwd, runs_as) {
            Some(d) => d.join(value),
            None => return Vec::new(),
        }
    } else {
        PathBuf::from(value)
    };
    let p = path.display();
    let said = format!("{what} {p}");
    // Where the sandbox shows the server other files, what the host has there does not count;
    // a relative name the working directory does not have may be a repo id, looked at below.
    if let Some(f) = sandboxed(s, sandbox, &said, &path).filter(|_| !relative) {
        return vec![f];
    }
    let meta = match s.metadata(&path) {
        Ok(m) => m,
        Err(e) if relative && e.kind() == ErrorKind::NotFound => {
            return vec![if form == ModelForm::FolderOrGguf && looks_like_repo_id(value) {
                Found::Note(format!(
                    "not checked: {what} {value} is a Hugging Face repo id; the engine downloads it at start"
                ))
            } else {
                let tilde = if value.starts_with('~') { "; systemd does not expand ~ in a command line" } else { "" };
                problem(s, &path, format!("{what} {value} does not exist (looked for at {p}{tilde})"))
            }];
        }
        Err(e) => return vec![missing(s, what, &path, &e)],
    };
    if let Some(f) = sandboxed(s, sandbox, &said, &path).filter(|_| relative) {
        return vec![f];
    }
    if let Some(f) = model_form_found(s, what, &path, &meta, form) {
        return vec![f];
    }
    let Some(who) = who(runs_as) else { return Vec::new() };
    if !meta.is_dir() {
        return access(s, &who, &path, Want::Read, what).into_iter().collect();
    }
    // A folder is listed (r) and entered (x), and its files read.
    if let Some(f) = access(s, &who, &path, Want::Read, what) {
        return vec![f];
    }
    if !allowed(&who, &meta, Want::Enter) {
        return vec![denied(s, &path, format!("{who} cannot enter {what} {p} ({})", mode_owner(&meta)))];
    }
    unreadable_files(s, &who, &path, what)
}

/// Whether the model at `path` has its engine's form: a GGUF file (its magic), or for SGLang
/// and vLLM a Hugging Face folder (its `config.json`) too.
pub(super) fn model_form_found(s: &Sight, what: &str, path: &Path, meta: &Metadata, form: ModelForm) -> Option<Found> {
    let p = path.display();
    let is_file = |name: &str| s.metadata(&path.join(name)).is_ok_and(|m| m.is_file());
    if meta.is_dir() {
        if form == ModelForm::GgufFile {
            return Some(problem(s, path, format!("{what} {p} is a directory: llama-server loads one GGUF file")));
        }
        if !is_file("config.json") {
            return Some(if is_file("params.json") {
                Found::Note(format!("not checked: {what} {p} has no config.json but a params.json (Mistral's format)"))
            } else {
                problem(s, path, format!("{what} {p} has no config.json: not a Hugging Face model folder"))
            });
        }
    } else if meta.is_file() {
        let magic = first_bytes(s, path, 4);
        if magic != b"GGUF" {
            let nor = if form == ModelForm::FolderOrGguf { " nor a Hugging Face model folder" } else { "" };
            return Some(problem(s, path, format!("{what} {p} is not a GGUF file{nor} ({})", starts_with(&magic))));
        }
    } else {
        return Some(problem(s, path, format!("{what} {p} is neither a file nor a folder")));
    }
    None
}

/// Whether an engine loading a Hugging Face model folder reads the file `name` in it (vLLM and
/// SGLang through transformers): the config, the weights (safetensors when the folder has any,
/// else PyTorch's, without training state), their index, the tokenizer, the chat template, the
/// processor and quantization configs, and remote code. What else lies there (a README, a
/// licence, training leftovers) is never opened.
pub(super) fn engine_reads(name: &str, safetensors: bool) -> bool {
    const NAMED: [&str; 20] = [
        "config.json",
        "generation_config.json",
        "params.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "tokenizer.model",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "vocab.txt",
        "merges.txt",
        "tekken.json",
        "chat_template.jinja",
        "chat_template.json",
        "preprocessor_config.json",
        "processor_config.json",
        "quantize_config.json",
        "quant_config.json",
        "hf_quant_config.json",
        "modules.json",
    ];
    const TRAINING: [&str; 5] = ["training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt"];
    let weights = |n: &str| match safetensors {
        true => n.ends_with(".safetensors"),
        false => [".bin", ".pt", ".pth"].iter().any(|e| n.ends_with(e)) && !TRAINING.contains(&n),
    };
    NAMED.contains(&name)
        || weights(name)
        || name.strip_suffix(".index.json").is_some_and(weights)
        || name.ends_with(".tiktoken")
        || name.ends_with(".py")
}

/// The files of a model folder its user cannot read, or links to nothing: a problem when the
/// engine reads them ([`engine_reads`]), a note otherwise; one finding for each kind.
pub(super) fn unreadable_files(s: &Sight, who: &Who, dir: &Path, what: &str) -> Vec<Found> {
    let Ok(entries) = s.real(dir).and_then(std::fs::read_dir) else { return Vec::new() };
    let mut files: Vec<(String, std::io::Result<Metadata>, bool)> = entries
        .flatten()
        .map(|e| {
            let link = e.file_type().is_ok_and(|t| t.is_symlink());
            let name = e.file_name();
            (name.to_string_lossy().into_owned(), s.metadata(&dir.join(&name)), link)
        })
        .collect();
    files.sort_by(|a, b| a.0.cmp(&b.0));
    // The engine chooses its weights by name, links to nothing included.
    let safetensors = files.iter().any(|(n, _, _)| n.ends_with(".safetensors"));
    let d = dir.display();
    let mut out = Vec::new();
    for read in [true, false] {
        let ours = || files.iter().filter(|(n, _, _)| engine_reads(n, safetensors) == read);
        let unreadable: Vec<(&String, &Metadata)> = ours()
            .filter_map(|(n, m, _)| {
                m.as_ref().ok().filter(|m| m.is_file() && !allowed(who, m, Want::Read)).map(|m| (n, m))
            })
            .collect();
        let dangling: Vec<&String> = ours().filter(|(_, m, link)| *link && m.is_err()).map(|(n, _, _)| n).collect();
        let more = |n: usize| if n == 1 { String::new() } else { format!(" and {} more", n - 1) };
        let (them, it) =
            if read { ("", "") } else { ("; the engine does not read them", "; the engine does not read it") };
        if let Some((name, m)) = unreadable.first() {
            let message = format!(
                "{who} cannot read {name}{} in {what} {d} ({}){}",
                more(unreadable.len()),
                mode_owner(m),
                if unreadable.len() == 1 { it } else { them }
            );
            out.push(match denied(s, &dir.join(name), message) {
                Found::Problem(m) if !read => Found::Note(m),
                f => f,
            });
        }
        if let Some(name) = dangling.first() {
            let (n, one) = (dangling.len(), dangling.len() == 1);
            let (is, tail) = if one { ("is a symbolic link", it) } else { ("are symbolic links", them) };
            let message = format!("{name}{} in {what} {d} {is} to nothing{tail}", more(n));
            out.push(if read { problem(s, &dir.join(name), message) } else { Found::Note(message) });
        }
    }
    out
}

/// How the first bytes of a file that should be GGUF look.
pub(super) fn starts_with(magic: &[u8]) -> String {
    if magic.is_empty() {
        return "it is empty".to_string();
    }
    if magic.iter().all(|b| b.is_ascii_graphic()) {
        return format!("it starts with {:?}", String::from_utf8_lossy(magic));
    }
    let hex: String = magic.iter().map(|b| format!("{b:02x}")).collect();
    format!("it starts with 0x{hex}")
}

/// The directory a `Cwd` names (`~`: the user's home); `None` when its user does not exist.
pub(super) fn cwd_path(cwd: &Cwd, runs_as: &RunAs) -> Option<PathBuf> {
    match (cwd, runs_as) {
        (Cwd::Path(p), _) => Some(PathBuf::from(p)),
        (Cwd::Home, RunAs::Root) => {
            Some(User::from_uid(Uid::from_raw(0)).ok().flatten().map_or("/root".into(), |u| u.dir))
        }
        (Cwd::Home, RunAs::User { user, .. }) => lookup_user(user).ok().flatten().map(|u| u.dir),
        // systemd gives a dynamic user the home directory `/`.
        (Cwd::Home, RunAs::Dynamic) => Some(PathBuf::from("/")),
    }
}

pub(super) fn look_environment_file(s: &Sight, path: &str, optional: bool) -> Vec<Found> {
    let what = "the environment file";
    let at = Path::new(path);
    match s.metadata(at) {
        Err(e) if e.kind() == ErrorKind::NotFound && optional => Vec::new(),
        Err(e) => vec![missing(s, what, at, &e)],
        Ok(m) if m.is_dir() => vec![problem(s, at, format!("{what} {path} is a directory"))],
        Ok(_) => manager_reads(s, what, at).into_iter().collect(),
    }
}

/// A credential's path may also be a directory (each file in it a credential) or a socket.
pub(super) fn look_credential(s: &Sight, id: &str, path: &str) -> Vec<Found> {
    let what = format!("the credential {id}'s file");
    let at = Path::new(path);
    match s.metadata(at) {
        Err(e) => vec![missing(s, &what, at, &e)],
        Ok(m) if m.is_file() => manager_reads(s, &what, at).into_iter().collect(),
        Ok(_) => Vec::new(),
    }
}

/// systemd reads environment files and credentials as root: whether specd, root too, can open
/// one is the same question (a file system may refuse root: NFS's root_squash). specd not root
/// cannot tell. Opened without blocking, so that a FIFO does not hang the look.
pub(super) fn manager_reads(s: &Sight, what: &str, path: &Path) -> Option<Found> {
    use std::os::unix::fs::OpenOptionsExt;
    let open = |p: PathBuf| std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(p);
    let e = s.real(path).and_then(open).err()?;
    let m = format!("{what} {} cannot be read: {e}", path.display());
    Some(if nix::unistd::geteuid().is_root() {
        problem(s, path, m)
    } else {
        Found::Note(format!("not checked: {m} (specd is not root; systemd reads it as root)"))
    })
}

pub(super) fn look_user(name: &str) -> Vec<Found> {
    match lookup_user(name) {
        Ok(Some(_)) => Vec::new(),
        Ok(None) => vec![Found::Problem(format!("the user {name} does not exist on this host (User={name})"))],
        Err(e) => vec![Found::Note(format!("not checked: looking up the user {name}: {e}"))],
    }
}

pub(super) fn look_group(name: &str) -> Vec<Found> {
    match lookup_group(name) {
        Ok(Some(_)) => Vec::new(),
        Ok(None) => vec![Found::Problem(format!("the group {name} does not exist on this host (Group={name})"))],
        Err(e) => vec![Found::Note(format!("not checked: looking up the group {name}: {e}"))],
    }
}

/// With a leading `-`, systemd starts the server wherever it cannot enter the directory: a note.
pub(super) fn look_working_directory(
    s: &Sight,
    dir: &Cwd,
    optional: bool,
    runs_as: &RunAs,
    sandbox: &Sandbox,
) -> Vec<Found> {
    let what = "the working directory";
    // `~` of a user that does not exist: the user's own check says so.
    let Some(path) = cwd_path(dir, runs_as) else { return Vec::new() };
    let found =
        sandboxed(s, sandbox, &format!("{what} {}", path.display()), &path).or_else(|| match s.metadata(&path) {
            Err(e) => Some(missing(s, what, &path, &e)),
            Ok(m) if !m.is_dir() => Some(problem(s, &path, format!("{what} {} is not a directory", path.display()))),
            Ok(_) => who(runs_as).and_then(|w| access(s, &w, &path, Want::Enter, what)),
        });
    match found {
        Some(Found::Problem(m)) if optional => {
            vec![Found::Note(format!("{m} (optional: the server starts without it)"))]
        }
        f => f.into_iter().collect(),
    }
}

pub(super) fn look_gpus(indices: &[u32], dev: &Path) -> Vec<Found> {
    let devices = crate::machine::gpu::nvidia_devices(dev);
    let named: Vec<String> = indices.iter().map(u32::to_string).collect();
    let d = dev.display();
    if devices.is_empty() {
        return vec![Found::Note(format!(
            "not checked: CUDA_VISIBLE_DEVICES names GPU {}, and this host shows no NVIDIA device ({d}/nvidia0 …)",
            named.join(",")
        ))];
    }
    // CUDA numbers the GPUs it finds from 0, whatever their device nodes' numbers.
    let n = devices.len();
    let absent: Vec<String> = indices.iter().filter(|i| **i as usize >= n).map(u32::to_string).collect();
    if absent.is_empty() {
        return Vec::new();
    }
    let list: Vec<String> = devices.iter().map(|i| format!("{d}/nvidia{i}")).collect();
    let s = if n == 1 { "" } else { "s" };
    vec![Found::Problem(format!(
        "CUDA_VISIBLE_DEVICES names GPU {}, but this host has {n} NVIDIA GPU{s} ({})",
        absent.join(", "),
        list.join(", ")
    ))]
}
