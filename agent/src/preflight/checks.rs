//! What would fail a start, decided from the spec, the rendered unit and its drop-ins alone: the
//! list of [`Check`]s to look at. Pure.

use super::*;
use specd_spec::{Engine, Spec};

/// The form of an engine's model argument. Not in the engine table (`specd_spec::engine_facts`),
/// where it belongs once anything besides the pre-flight needs it.
pub(super) fn model_form(engine: Engine) -> ModelForm {
    match engine {
        Engine::LlamaCpp => ModelForm::GgufFile,
        Engine::Sglang | Engine::Vllm => ModelForm::FolderOrGguf,
    }
}

/// What to check on the host before stopping anything for `spec`, whose rendered unit is
/// `unit_text`, with the drop-ins that will apply to it (`drop_ins`: path and text, in systemd's
/// order). Paths, users, the environment and the sandbox are read from the unit text and the
/// drop-ins (what systemd sees), the model, draft model and port from the spec (what the
/// engine's flags say).
pub fn checks(spec: &Spec, unit_text: &str, drop_ins: &[(String, String)]) -> Vec<Check> {
    let mut files = vec![("", unit_text)];
    files.extend(drop_ins.iter().map(|(p, t)| (p.as_str(), t.as_str())));
    let svc = ServiceSection::read_all(&files);
    let mut out = Vec::new();
    let mut value = |kind: CheckKind, key: &str, raw: &str| match unspecify(raw) {
        Ok(v) => Some(v),
        Err(s) => {
            out.push(Check::NotChecked {
                kind,
                why: format!("{key}={raw} uses the specifier {s}, which the pre-flight does not resolve"),
            });
            None
        }
    };
    let user = svc.user.as_deref().and_then(|u| value(CheckKind::User, "User", u));
    let group = svc.group.as_deref().and_then(|g| value(CheckKind::Group, "Group", g));
    let wd = svc.working_directory.as_deref().and_then(|w| value(CheckKind::WorkingDirectory, "WorkingDirectory", w));
    // A dynamic user is made at the start: there is nothing to look up before.
    if !svc.dynamic_user {
        out.extend(user.iter().map(|u| Check::User { name: u.clone() }));
        out.extend(group.iter().map(|g| Check::Group { name: g.clone() }));
    }
    let runs_as = svc.runs_as(user, group);
    let sandbox = svc.sandbox();
    let texts: Vec<&str> = files.iter().map(|f| f.1).collect();
    let argv = specd_spec::exec_start_value(&texts)
        .as_deref()
        .and_then(specd_spec::parse_command_line)
        .unwrap_or_else(|| spec.argv.clone());
    if let Some(p) = argv.first() {
        let program = program(p, &svc.exec_search_path);
        out.push(Check::Program { program, runs_as: runs_as.clone(), sandbox: sandbox.clone() });
    }
    let (cwd, optional) = match wd.as_deref().map(|w| w.strip_prefix('-').map_or((w, false), |w| (w, true))) {
        Some(("~", optional)) => (Cwd::Home, Some(optional)),
        Some((w, optional)) => (Cwd::Path(w.to_string()), Some(optional)),
        None => (Cwd::Path("/".to_string()), None),
    };
    if let Some(optional) = optional {
        let (dir, runs_as, sandbox) = (cwd.clone(), runs_as.clone(), sandbox.clone());
        out.push(Check::WorkingDirectory { dir, optional, runs_as, sandbox });
    }
    let form = model_form(spec.engine);
    let model = |role, value: &str| Check::Model {
        role,
        value: value.to_string(),
        form,
        cwd: cwd.clone(),
        runs_as: runs_as.clone(),
        sandbox: sandbox.clone(),
        verify: spec.weights.verify,
    };
    out.push(model(ModelRole::Model, &spec.model));
    if let Some(d) = spec.speculative.as_ref().and_then(|s| s.draft_model.as_deref()) {
        out.push(model(ModelRole::Draft, d));
    }
    out.extend(svc.environment_files.iter().map(|f| environment_file(f)));
    out.extend(svc.credentials.iter().map(|c| credential(c)));
    out.push(Check::Port { unit: spec.unit.clone(), host: spec.server.host.clone(), port: spec.server.port });
    if let Some(v) = svc.environment("CUDA_VISIBLE_DEVICES") {
        out.extend(gpus(&v));
    }
    out.push(Check::UnitFile { unit: spec.unit.clone(), text: unit_text.to_string() });
    out
}

/// What the unit text's `[Service]` section says, as systemd reads it (later assignments win;
/// an empty one resets a list).
#[derive(Debug, Default)]
pub(super) struct ServiceSection {
    /// The raw value of `ExecStart=`, with its prefixes.
    pub(super) exec_start: Option<String>,
    pub(super) user: Option<String>,
    pub(super) group: Option<String>,
    pub(super) dynamic_user: bool,
    pub(super) working_directory: Option<String>,
    pub(super) environment: Vec<String>,
    pub(super) environment_files: Vec<String>,
    pub(super) credentials: Vec<String>,
    pub(super) exec_search_path: Vec<String>,
    /// The settings that change what the server sees of the file system, each as `Key=value`
    /// with the drop-in it is in: the last `PrivateTmp=` and `ProtectHome=` that hide a
    /// directory, the last `DynamicUser=`, the lists' words, the root.
    pub(super) private_tmp: Option<String>,
    pub(super) protect_home: Option<String>,
    pub(super) dynamic_user_at: String,
    pub(super) inaccessible: Vec<(String, String)>,
    pub(super) temporary: Vec<(String, String)>,
    pub(super) binds: Vec<(String, String)>,
    pub(super) root: Option<String>,
}

/// systemd's booleans (`parse_boolean`): what reads as yes.
pub(super) fn yes(v: &str) -> bool {
    matches!(v, "1" | "yes" | "y" | "true" | "t" | "on")
}

impl ServiceSection {
    #[cfg(test)]
    pub(super) fn read(text: &str) -> ServiceSection {
        ServiceSection::read_all(&[("", text)])
    }

    /// The `[Service]` section of a unit file and its drop-ins (`(path, text)`, the unit's own
    /// text first with an empty path), read in order as systemd reads them.
    pub(super) fn read_all(files: &[(&str, &str)]) -> ServiceSection {
        let mut s = ServiceSection::default();
        let list = |l: &mut Vec<String>, v: &str| if v.is_empty() { l.clear() } else { l.push(v.to_string()) };
        let one = |v: &str| (!v.is_empty()).then(|| v.to_string());
        for (at, text) in files {
            for (k, v) in specd_spec::service_assignments(text) {
                let setting = match *at {
                    "" => format!("{k}={v}"),
                    at => format!("{k}={v} (in {at})"),
                };
                match k.as_str() {
                    "ExecStart" => s.exec_start = one(&v),
                    "User" => s.user = one(&v),
                    "Group" => s.group = one(&v),
                    "DynamicUser" => (s.dynamic_user, s.dynamic_user_at) = (yes(&v), setting),
                    "WorkingDirectory" => s.working_directory = one(&v),
                    "Environment" => list(&mut s.environment, &v),
                    "EnvironmentFile" => list(&mut s.environment_files, &v),
                    "LoadCredential" => list(&mut s.credentials, &v),
                    // systemd.exec(5): several assignments append, an empty one resets.
                    "ExecSearchPath" if v.is_empty() => s.exec_search_path.clear(),
                    "ExecSearchPath" => s.exec_search_path.extend(v.split(':').map(str::to_string)),
                    _ => s.read_sandbox(&k, &v, setting),
                }
            }
        }
        s
    }

    /// One of the sandbox's settings (systemd.exec(5), "Sandboxing"): modes, the later winning;
    /// lists, appending, an empty value resetting.
    pub(super) fn read_sandbox(&mut self, key: &str, v: &str, setting: String) {
        let words = || v.split_whitespace().map(|w| (w.to_string(), setting.clone()));
        match key {
            // `disconnected` (systemd 256): a /tmp of its own too.
            "PrivateTmp" => self.private_tmp = (yes(v) || v == "disconnected").then_some(setting),
            // `read-only` leaves the files there.
            "ProtectHome" => self.protect_home = (yes(v) || v == "tmpfs").then_some(setting),
            "InaccessiblePaths" if v.is_empty() => self.inaccessible.clear(),
            "InaccessiblePaths" => self.inaccessible.extend(words()),
            "TemporaryFileSystem" if v.is_empty() => self.temporary.clear(),
            "TemporaryFileSystem" => self.temporary.extend(words()),
            "BindPaths" | "BindReadOnlyPaths" if v.is_empty() => {
                self.binds.retain(|(_, s)| !s.starts_with(&format!("{key}=")))
            }
            "BindPaths" | "BindReadOnlyPaths" => self.binds.extend(words()),
            "RootDirectory" | "RootImage" => self.root = (!v.is_empty()).then_some(setting),
            _ => {}
        }
    }

    /// The sandbox as the server meets it.
    pub(super) fn sandbox(&self) -> Sandbox {
        let shadow = |dir: &str, setting: &str| Shadow { dir: dir.to_string(), setting: setting.to_string() };
        let implied = format!("{} (which implies PrivateTmp=yes)", self.dynamic_user_at);
        let tmp = self.private_tmp.clone().or_else(|| self.dynamic_user.then_some(implied));
        let mut hidden = Vec::new();
        for (dirs, setting) in
            [(&["/tmp", "/var/tmp"][..], tmp), (&["/home", "/root", "/run/user"], self.protect_home.clone())]
        {
            hidden.extend(setting.iter().flat_map(|s| dirs.iter().map(|d| shadow(d, s))));
        }
        // `-` (a missing path is no error) and `+` (under RootDirectory=) before a path, and a
        // temporary file system's `:options` after it.
        let path = |w: &str| unspecify(w.trim_start_matches(['-', '+']).split(':').next().unwrap_or_default()).ok();
        for (w, setting) in self.inaccessible.iter().chain(&self.temporary) {
            hidden.extend(path(w).filter(|p| p.starts_with('/')).map(|p| shadow(&p, setting)));
        }
        let mut elsewhere: Vec<Shadow> = self.root.iter().map(|setting| shadow("/", setting)).collect();
        for (w, setting) in &self.binds {
            // `[-]SOURCE[:DESTINATION[:OPTIONS]]`: the destination shows the source's files.
            let mut f = w.trim_start_matches('-').splitn(3, ':');
            let (source, dest) = (f.next().unwrap_or_default(), f.next());
            match (unspecify(source), dest.map(unspecify).transpose()) {
                (Ok(src), Ok(dst)) if dst.as_deref().is_none_or(|d| d == src) => {}
                (Ok(src), Ok(dst)) => elsewhere.push(shadow(&dst.unwrap_or(src), setting)),
                // A specifier: where it binds is not known.
                _ => elsewhere.push(shadow("/", setting)),
            }
        }
        Sandbox { hidden, elsewhere }
    }

    /// Who `ExecStart=`'s process is: `+` (full privileges) and `!` (no user or group change)
    /// make it root; `!!` changes nothing where the kernel has ambient capabilities.
    pub(super) fn runs_as(&self, user: Option<String>, group: Option<String>) -> RunAs {
        let prefix: String =
            self.exec_start.as_deref().unwrap_or_default().chars().take_while(|c| "@-:+!".contains(*c)).collect();
        if prefix.contains('+') || (prefix.contains('!') && !prefix.contains("!!")) {
            return RunAs::Root;
        }
        if self.dynamic_user {
            return RunAs::Dynamic;
        }
        match user {
            Some(u) if u != "root" && u != "0" => RunAs::User { user: u, group },
            _ => RunAs::Root,
        }
    }

    /// The value of an `Environment=` variable (the last assignment wins, as in systemd); `None`
    /// also when it holds a specifier.
    pub(super) fn environment(&self, name: &str) -> Option<String> {
        let (_, v) =
            self.environment.iter().rev().filter_map(|e| specd_spec::parse_environment(e)).find(|(k, _)| k == name)?;
        unspecify(&v).ok()
    }
}

/// A unit-file value with its specifiers resolved: `%%` is `%`; any other specifier (`%h`...)
/// is the `Err`, as the pre-flight does not know what systemd would put there.
pub(super) fn unspecify(v: &str) -> Result<String, String> {
    let mut out = String::with_capacity(v.len());
    let mut chars = v.chars();
    while let Some(c) = chars.next() {
        match (c, c == '%') {
            (_, false) => out.push(c),
            (_, true) => match chars.next() {
                Some('%') => out.push('%'),
                Some(s) => return Err(format!("%{s}")),
                None => return Err("%".to_string()),
            },
        }
    }
    Ok(out)
}

/// `ExecStart=`'s program: a bare name (no `/`) is looked up as systemd does, in
/// `ExecSearchPath=` when the unit sets it, else in systemd's fixed search path.
pub(super) fn program(p: &str, exec_search_path: &[String]) -> Program {
    if p.contains('/') {
        return Program::Path(p.to_string());
    }
    let dirs = if exec_search_path.is_empty() {
        SEARCH_PATH.iter().map(|d| d.to_string()).collect()
    } else {
        exec_search_path.to_vec()
    };
    Program::Search { name: p.to_string(), dirs }
}

pub(super) fn environment_file(raw: &str) -> Check {
    let (path, optional) = raw.strip_prefix('-').map_or((raw, false), |p| (p, true));
    let not = |why: String| Check::NotChecked { kind: CheckKind::EnvironmentFile, why };
    match unspecify(path) {
        Err(s) => not(format!("EnvironmentFile={raw} uses the specifier {s}, which the pre-flight does not resolve")),
        Ok(p) if p.contains(['*', '?', '[']) => {
            not(format!("the environment files {p} are a wildcard: whether they match is not checked"))
        }
        Ok(p) if !p.starts_with('/') => not(format!("the environment file {p} is not an absolute path")),
        Ok(p) => Check::EnvironmentFile { path: p, optional },
    }
}

pub(super) fn credential(raw: &str) -> Check {
    let not = |why: String| Check::NotChecked { kind: CheckKind::Credential, why };
    let (id, path) = raw.split_once(':').unwrap_or((raw, ""));
    match (unspecify(id), unspecify(path)) {
        (Ok(id), Ok(path)) if path.starts_with('/') => Check::Credential { id, path },
        (Ok(id), Ok(_)) => not(format!(
            "the credential {id} is passed on from the service manager or its credential store, not read from a path"
        )),
        (Err(s), _) | (_, Err(s)) => {
            not(format!("LoadCredential={raw} uses the specifier {s}, which the pre-flight does not resolve"))
        }
    }
}

/// `CUDA_VISIBLE_DEVICES`'s GPUs as CUDA reads it: indices, UUIDs (`GPU-…`) and MIG ids
/// (`MIG-…`), up to the first entry that is none of them (CUDA ignores it and all after it).
pub(super) fn gpus(value: &str) -> Vec<Check> {
    let mut indices = Vec::new();
    let mut ids = Vec::new();
    let mut out = Vec::new();
    for e in value.split(',').map(str::trim) {
        if let Ok(i) = e.parse::<u32>() {
            indices.push(i);
        } else if e.starts_with("GPU-") || e.starts_with("MIG-") {
            ids.push(e);
        } else {
            out.push(Check::NotChecked {
                kind: CheckKind::Gpu,
                why: format!("CUDA_VISIBLE_DEVICES={value}: CUDA ignores `{e}` and every GPU listed after it"),
            });
            break;
        }
    }
    if !ids.is_empty() {
        out.push(Check::NotChecked {
            kind: CheckKind::Gpu,
            why: format!(
                "CUDA_VISIBLE_DEVICES names {}: GPU UUIDs and MIG ids need the driver's tools",
                ids.join(", ")
            ),
        });
    }
    if !indices.is_empty() {
        out.insert(0, Check::Gpus { indices });
    }
    out
}

/// Whether a model argument reads as a Hugging Face repo id (`Qwen/Qwen3-8B`, `gpt2`): one or
/// two names of letters, digits, `-`, `_` and `.`, none starting or ending with `-` or `.`, no
/// `--` or `..`. A path (`/`, `./`, `~`, more than one `/`) never does.
pub(super) fn looks_like_repo_id(v: &str) -> bool {
    let parts: Vec<&str> = v.split('/').collect();
    parts.len() <= 2
        && parts.iter().all(|p| {
            !p.is_empty()
                && p.len() <= 96
                && p.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
                && !p.starts_with(['-', '.'])
                && !p.ends_with(['-', '.'])
                && !p.contains("--")
                && !p.contains("..")
        })
}
