//! Pre-flight: what can be known about a spec without starting its server, checked before an
//! apply drains and stops the instance that serves.
//!
//! A spec whose program or draft model is not on the disk fails at its start, and the rollback
//! that follows loads the old model again: on a host serving a large model that is two model loads
//! of downtime for a failure one look at the disk would have found. So before anything is stopped:
//! the program (as systemd finds it, executable by the unit's user), the model and draft model,
//! the environment files and credentials systemd reads, the user, group and working directory,
//! the port (free, or held by the unit's own instance, which is about to stop), the GPUs named
//! in `CUDA_VISIBLE_DEVICES`, and the unit as `systemd-analyze verify` reads it.
//!
//! Two parts: [`checks`] decides what to look at, from the resolved spec and the rendered unit
//! text with its drop-ins (what systemd sees); it is pure. [`run`] looks, on this machine.
//!
//! A file is judged as the unit will see it: in the host's view (PID 1's mount namespace, which
//! specd's own sandbox may not share: [`sight`]), through the unit's own sandbox for what its
//! server opens (the program, the working directory, the model), not for what systemd reads
//! before it sets the sandbox up (environment files, credentials).
//!
//! A problem is a fact about this host that makes the start fail; anything specd cannot be sure
//! of (a Hugging Face repo id, a GPU UUID, a file with an ACL, a socket whose process it cannot
//! see) is a note, never a problem: a pre-flight that refuses a spec which would have started is
//! worse than none, as the apply's own verification still catches what it lets through.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::Metadata;
use std::io::{ErrorKind, Read};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::unistd::{Gid, Group, Uid, User};
use serde::{Deserialize, Serialize};
use specd_spec::{Engine, Spec, Verify};

mod sight;
use sight::Sight;
mod weights;

/// What a check is about: the label of a problem in state, status, metrics and notices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CheckKind {
    Program,
    Model,
    DraftModel,
    EnvironmentFile,
    Credential,
    User,
    Group,
    WorkingDirectory,
    Port,
    Gpu,
    UnitFile,
}

impl CheckKind {
    /// The name in serialized form (a metric label).
    pub fn as_str(self) -> &'static str {
        match self {
            CheckKind::Program => "program",
            CheckKind::Model => "model",
            CheckKind::DraftModel => "draft_model",
            CheckKind::EnvironmentFile => "environment_file",
            CheckKind::Credential => "credential",
            CheckKind::User => "user",
            CheckKind::Group => "group",
            CheckKind::WorkingDirectory => "working_directory",
            CheckKind::Port => "port",
            CheckKind::Gpu => "gpu",
            CheckKind::UnitFile => "unit_file",
        }
    }
}

/// Something that would make the start fail, said so that a person can act on it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Problem {
    pub check: CheckKind,
    pub message: String,
}

/// Something not checked, or worth knowing, that does not stop the apply.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Note {
    pub check: CheckKind,
    pub message: String,
}

/// What the pre-flight found. The apply goes on only when `problems` is empty.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Outcome {
    pub problems: Vec<Problem>,
    pub notes: Vec<Note>,
}

impl Outcome {
    pub fn passed(&self) -> bool {
        self.problems.is_empty()
    }
}

/// Why a unit cannot start, in one line for a verdict: every problem, in the order found.
pub fn summary(problems: &[Problem]) -> String {
    let what: Vec<&str> = problems.iter().map(|p| p.message.as_str()).collect();
    what.join("; ")
}

/// One thing to look at on the host before the stop.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "check", rename_all = "snake_case")]
pub enum Check {
    /// `ExecStart=`'s program exists, is a regular file, and the process's user may execute it
    /// (a script: read it, and its interpreter exists), where the unit's sandbox lets its server
    /// see it.
    Program {
        program: Program,
        runs_as: RunAs,
        #[serde(default, skip_serializing_if = "Sandbox::is_empty")]
        sandbox: Sandbox,
    },
    /// A model or draft model the engine loads from the disk: there, of the engine's form, and
    /// readable by the process's user. A relative value is looked for in the working directory,
    /// as the engine does; one that is not there and reads as a Hugging Face repo id is a note.
    Model {
        role: ModelRole,
        value: String,
        form: ModelForm,
        cwd: Cwd,
        runs_as: RunAs,
        #[serde(default, skip_serializing_if = "Sandbox::is_empty")]
        sandbox: Sandbox,
        /// Whether its weights are read whole and compared with their digests (`weights`).
        #[serde(default, skip_serializing_if = "is_none")]
        verify: Verify,
    },
    /// An `EnvironmentFile=`: systemd (root) reads it before the start, outside the unit's
    /// sandbox; a missing one fails the start unless it is optional (a leading `-`).
    EnvironmentFile { path: String, optional: bool },
    /// `LoadCredential=ID:PATH`: systemd (root) reads PATH (a file, a directory of files, or a
    /// socket) at the start, outside the unit's sandbox; a missing one fails the start.
    Credential { id: String, path: String },
    /// `User=` exists (by name, or a numeric id that has an entry): systemd fails the start
    /// otherwise.
    User { name: String },
    /// `Group=` exists.
    Group { name: String },
    /// `WorkingDirectory=` exists and the process's user may enter it; a leading `-` makes
    /// a failure to enter it harmless.
    WorkingDirectory {
        dir: Cwd,
        optional: bool,
        runs_as: RunAs,
        #[serde(default, skip_serializing_if = "Sandbox::is_empty")]
        sandbox: Sandbox,
    },
    /// Nothing outside the unit listens on the server's port (the unit's own instance does not
    /// count: it is stopped before the start).
    Port { unit: String, host: String, port: u16 },
    /// The GPUs `CUDA_VISIBLE_DEVICES` names by index exist, on a host that has NVIDIA devices.
    Gpus { indices: Vec<u32> },
    /// `systemd-analyze verify` accepts the unit text, written under the unit's own name.
    UnitFile { unit: String, text: String },
    /// Known without looking to be beyond a look: said as a note.
    NotChecked { kind: CheckKind, why: String },
}

fn is_none(v: &Verify) -> bool {
    *v == Verify::None
}

impl Check {
    pub fn kind(&self) -> CheckKind {
        match self {
            Check::Program { .. } => CheckKind::Program,
            Check::Model { role: ModelRole::Model, .. } => CheckKind::Model,
            Check::Model { role: ModelRole::Draft, .. } => CheckKind::DraftModel,
            Check::EnvironmentFile { .. } => CheckKind::EnvironmentFile,
            Check::Credential { .. } => CheckKind::Credential,
            Check::User { .. } => CheckKind::User,
            Check::Group { .. } => CheckKind::Group,
            Check::WorkingDirectory { .. } => CheckKind::WorkingDirectory,
            Check::Port { .. } => CheckKind::Port,
            Check::Gpus { .. } => CheckKind::Gpu,
            Check::UnitFile { .. } => CheckKind::UnitFile,
            Check::NotChecked { kind, .. } => *kind,
        }
    }
}

/// How systemd finds `ExecStart=`'s program.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Program {
    /// As written (systemd refuses a relative path with a `/`: a problem).
    Path(String),
    /// A bare name, looked up in `dirs` in order: the first regular file with an execute bit.
    Search { name: String, dirs: Vec<String> },
}

/// Who the server's process runs as, for the kernel's permission checks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunAs {
    Root,
    /// `User=` (and `Group=`, else the user's own group; its supplementary groups apply too).
    User {
        user: String,
        group: Option<String>,
    },
    /// `DynamicUser=yes`: an id allocated at the start, which owns nothing on the disk.
    Dynamic,
}

/// What the unit's own sandbox does to the file system its server sees (the `[Service]` settings
/// of the unit and its drop-ins): the program, the working directory and the model are looked
/// at as the server would find them. systemd itself reads environment files and credentials
/// before it sets the sandbox up: those are not in it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sandbox {
    /// Directories the server finds empty or cannot enter (`PrivateTmp=`, `ProtectHome=`,
    /// `InaccessiblePaths=`, `TemporaryFileSystem=`; `DynamicUser=` implies `PrivateTmp=`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hidden: Vec<Shadow>,
    /// Directories where the server finds other files than the host's there (a bind mount's
    /// destination; all of them under `RootDirectory=` or `RootImage=`): not checked.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub elsewhere: Vec<Shadow>,
}

/// A directory the sandbox changes, and the setting that does it (with the drop-in it is in).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shadow {
    pub dir: String,
    pub setting: String,
}

impl Sandbox {
    pub fn is_empty(&self) -> bool {
        self.hidden.is_empty() && self.elsewhere.is_empty()
    }
}

/// A working directory as `WorkingDirectory=` gives it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Cwd {
    Path(String),
    /// `~`: the user's home directory.
    Home,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelRole {
    Model,
    Draft,
}

impl ModelRole {
    fn what(self) -> &'static str {
        match self {
            ModelRole::Model => "the model",
            ModelRole::Draft => "the draft model",
        }
    }
}

/// What an engine's model argument names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelForm {
    /// llama-server's `--model`: one GGUF file (it downloads by name only with other flags).
    GgufFile,
    /// SGLang's `--model-path`, vLLM's model: a Hugging Face model folder or a GGUF file; a
    /// name that is neither is a repo id the engine downloads at its start.
    FolderOrGguf,
}

/// The form of an engine's model argument. Not in the engine table (`specd_spec::engine_facts`),
/// where it belongs once anything besides the pre-flight needs it.
fn model_form(engine: Engine) -> ModelForm {
    match engine {
        Engine::LlamaCpp => ModelForm::GgufFile,
        Engine::Sglang | Engine::Vllm => ModelForm::FolderOrGguf,
    }
}

/// systemd's fixed search path for a bare `ExecStart=` name (systemd.service(5), "Command
/// lines"; `systemd-path search-binaries-default`): systemd 252 as Debian 12 builds it (split
/// /usr: `DEFAULT_PATH` in `src/basic/path-util.h`). Later systemd dropped `/sbin:/bin` (and, with
/// a merged sbin, `/usr/local/sbin:` and `/usr/sbin`), which on the systems it is built for
/// are links into the directories before them: the same files are found in the same order.
const SEARCH_PATH: [&str; 6] = ["/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"];

/// How long `systemd-analyze verify` may take (0.1 s on an idle host); killed after.
const VERIFY_WITHIN: Duration = Duration::from_secs(10);

/// How long the looks at files and `/proc` may take (milliseconds, unless a file system hangs:
/// then the apply goes on without them, and their thread is left to the hung call).
const LOOK_WITHIN: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------------------------
// The pure part: what to check.

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
struct ServiceSection {
    /// The raw value of `ExecStart=`, with its prefixes.
    exec_start: Option<String>,
    user: Option<String>,
    group: Option<String>,
    dynamic_user: bool,
    working_directory: Option<String>,
    environment: Vec<String>,
    environment_files: Vec<String>,
    credentials: Vec<String>,
    exec_search_path: Vec<String>,
    /// The settings that change what the server sees of the file system, each as `Key=value`
    /// with the drop-in it is in: the last `PrivateTmp=` and `ProtectHome=` that hide a
    /// directory, the last `DynamicUser=`, the lists' words, the root.
    private_tmp: Option<String>,
    protect_home: Option<String>,
    dynamic_user_at: String,
    inaccessible: Vec<(String, String)>,
    temporary: Vec<(String, String)>,
    binds: Vec<(String, String)>,
    root: Option<String>,
}

/// systemd's booleans (`parse_boolean`): what reads as yes.
fn yes(v: &str) -> bool {
    matches!(v, "1" | "yes" | "y" | "true" | "t" | "on")
}

impl ServiceSection {
    #[cfg(test)]
    fn read(text: &str) -> ServiceSection {
        ServiceSection::read_all(&[("", text)])
    }

    /// The `[Service]` section of a unit file and its drop-ins (`(path, text)`, the unit's own
    /// text first with an empty path), read in order as systemd reads them.
    fn read_all(files: &[(&str, &str)]) -> ServiceSection {
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
    fn read_sandbox(&mut self, key: &str, v: &str, setting: String) {
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
    fn sandbox(&self) -> Sandbox {
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
    fn runs_as(&self, user: Option<String>, group: Option<String>) -> RunAs {
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
    fn environment(&self, name: &str) -> Option<String> {
        let (_, v) =
            self.environment.iter().rev().filter_map(|e| specd_spec::parse_environment(e)).find(|(k, _)| k == name)?;
        unspecify(&v).ok()
    }
}

/// A unit-file value with its specifiers resolved: `%%` is `%`; any other specifier (`%h`...)
/// is the `Err`, as the pre-flight does not know what systemd would put there.
fn unspecify(v: &str) -> Result<String, String> {
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
fn program(p: &str, exec_search_path: &[String]) -> Program {
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

fn environment_file(raw: &str) -> Check {
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

fn credential(raw: &str) -> Check {
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
fn gpus(value: &str) -> Vec<Check> {
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
fn looks_like_repo_id(v: &str) -> bool {
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

// ---------------------------------------------------------------------------------------------
// The executor: looking on this machine.

/// Carry `checks` out on this machine. `own_cgroup` is the unit's control group (systemd's
/// `ControlGroup`; empty when no instance runs): a process in it that holds the port is the
/// instance about to be stopped, not a conflict.
pub async fn run(checks: &[Check], own_cgroup: &str) -> Outcome {
    run_on(checks, own_cgroup, &Machine::seeing(Sight::of_this_process())).await
}

/// The whole pre-flight of `spec`'s unit on this host: the drop-ins that will apply to it read
/// (`drop_ins`, paths as systemd lists them; one that cannot be read is left out), [`checks`]
/// decided, [`run`] looked, the weights' digests remembered in `state_dir`. The checks are
/// returned with what they found.
pub async fn on_this_host(
    spec: &Spec,
    unit_text: &str,
    drop_ins: &[String],
    own_cgroup: &str,
    state_dir: &Path,
) -> (Vec<Check>, Outcome) {
    let sight = Sight::of_this_process();
    let texts: Vec<(String, String)> = drop_ins
        .iter()
        .filter_map(|p| Some((p.clone(), std::fs::read_to_string(sight.real(Path::new(p)).ok()?).ok()?)))
        .collect();
    let checks = checks(spec, unit_text, &texts);
    let m = Machine { state_dir: Some(state_dir.to_path_buf()), ..Machine::seeing(sight) };
    let outcome = run_on(&checks, own_cgroup, &m).await;
    (checks, outcome)
}

/// Where the executor looks besides the checks' own paths and `/proc`: how it sees the host's
/// files, the device directory (NVIDIA's nodes), the `systemd-analyze` command and how long it
/// may take, the state directory (where weights' digests are remembered).
struct Machine {
    sight: Sight,
    dev: PathBuf,
    analyze: Vec<String>,
    verify_within: Duration,
    state_dir: Option<PathBuf>,
}

impl Machine {
    /// This host, its files seen as `sight` says.
    fn seeing(sight: Sight) -> Machine {
        Machine {
            sight,
            dev: PathBuf::from("/dev"),
            analyze: vec!["systemd-analyze".to_string()],
            verify_within: VERIFY_WITHIN,
            state_dir: None,
        }
    }
}

/// What one look found, before it is labelled with its check's kind.
#[derive(Clone, Debug, PartialEq)]
enum Found {
    Problem(String),
    Note(String),
}

async fn run_on(checks: &[Check], own_cgroup: &str, m: &Machine) -> Outcome {
    // Files and /proc can block (a model on a stalled network mount): off the runtime's thread,
    // while systemd-analyze runs.
    let looks = {
        let (checks, own, dev, s) = (checks.to_vec(), own_cgroup.to_string(), m.dev.clone(), m.sight.clone());
        let state = m.state_dir.clone();
        tokio::task::spawn_blocking(move || {
            checks.iter().map(|c| look(&s, c, &own, &dev, state.as_deref())).collect::<Vec<_>>()
        })
    };
    // Weights read whole take the time their size does.
    let reads = checks.iter().any(|c| matches!(c, Check::Model { verify: Verify::Sha256, .. }));
    let within = if reads { weights::DIGESTS_WITHIN } else { LOOK_WITHIN };
    let mut verified = Vec::new();
    for c in checks {
        if let Check::UnitFile { unit, text } = c {
            verified.push(verify(unit, text, m).await);
        }
    }
    let looked = match tokio::time::timeout(within, looks).await {
        Ok(Ok(l)) => l,
        Ok(Err(e)) => checks.iter().map(|_| vec![Found::Note(format!("not checked: the look failed: {e}"))]).collect(),
        Err(_) => {
            let why = format!("not checked: the file system did not answer within {} s", within.as_secs());
            checks.iter().map(|_| vec![Found::Note(why.clone())]).collect()
        }
    };
    let mut verified = verified.into_iter();
    let mut out = Outcome::default();
    for (c, found) in checks.iter().zip(looked) {
        let found = if matches!(c, Check::UnitFile { .. }) { verified.next().unwrap_or_default() } else { found };
        for f in found {
            match f {
                Found::Problem(message) => out.problems.push(Problem { check: c.kind(), message }),
                Found::Note(message) => out.notes.push(Note { check: c.kind(), message }),
            }
        }
    }
    out
}

/// One check, on the file system (as `s` sees the host's) and `/proc` (blocking).
fn look(s: &Sight, c: &Check, own_cgroup: &str, dev: &Path, state_dir: Option<&Path>) -> Vec<Found> {
    match c {
        Check::Program { program, runs_as, sandbox } => look_program(s, program, runs_as, sandbox),
        Check::Model { role, value, form, cwd, runs_as, sandbox, verify } => {
            let found = look_model(s, *role, value, *form, cwd, runs_as, sandbox);
            // A model that is there and may be read: its weights, whole.
            let path = if value.starts_with('/') {
                Some(PathBuf::from(value))
            } else {
                cwd_path(cwd, runs_as).map(|d| d.join(value))
            };
            match path {
                Some(p) if found.is_empty() => weights::look(s, role.what(), &p, *verify, state_dir),
                _ => found,
            }
        }
        Check::EnvironmentFile { path, optional } => look_environment_file(s, path, *optional),
        Check::Credential { id, path } => look_credential(s, id, path),
        Check::User { name } => look_user(name),
        Check::Group { name } => look_group(name),
        Check::WorkingDirectory { dir, optional, runs_as, sandbox } => {
            look_working_directory(s, dir, *optional, runs_as, sandbox)
        }
        Check::Port { unit, host, port } => look_port(unit, host, *port, own_cgroup),
        Check::Gpus { indices } => look_gpus(indices, dev),
        Check::UnitFile { .. } => Vec::new(),
        Check::NotChecked { why, .. } => vec![Found::Note(format!("not checked: {why}"))],
    }
}

/// Something wrong with `path`, as found: a problem, or a note where specd cannot see `path` as
/// the host does (what it found is about its own view).
fn problem(s: &Sight, path: &Path, message: String) -> Found {
    match s.blind_at(path) {
        Some(why) => Found::Note(format!("not checked from here: {why}; in specd's own view, {message}")),
        None => Found::Problem(message),
    }
}

/// Whether the unit's sandbox keeps its server from `path` as the host has it (as written, or
/// where its links lead): a problem where it hides the directory, a note where it shows other
/// files there. `said` names the path in the message.
fn sandboxed(s: &Sight, sandbox: &Sandbox, said: &str, path: &Path) -> Option<Found> {
    if sandbox.is_empty() {
        return None;
    }
    let real = s.canonical(path).ok().filter(|r| r != path);
    let paths: Vec<&Path> = std::iter::once(path).chain(real.as_deref()).collect();
    fn at<'a>(paths: &[&'a Path], list: &'a [Shadow]) -> Option<(&'a Path, &'a Shadow)> {
        paths.iter().find_map(|p| list.iter().find(|x| p.starts_with(&x.dir)).map(|x| (*p, x)))
    }
    let leads = |p: &Path| if p == path { String::new() } else { format!(" (it leads to {})", p.display()) };
    if let Some((p, x)) = at(&paths, &sandbox.hidden) {
        return Some(Found::Problem(format!(
            "{said}{} is under {}, which the unit's {} hides from its server: the server would not find it there",
            leads(p),
            x.dir,
            x.setting
        )));
    }
    let (p, x) = at(&paths, &sandbox.elsewhere)?;
    Some(Found::Note(format!(
        "not checked: {said}{} is under {}, where the unit's {} shows its server other files than the host's",
        leads(p),
        x.dir,
        x.setting
    )))
}

// Who may do what.

/// The process's identity as the kernel's permission checks see it.
#[derive(Debug)]
enum Who {
    /// Reads and enters everything; executes what has an execute bit.
    Root,
    Ids {
        name: String,
        uid: u32,
        gids: Vec<u32>,
    },
    /// A dynamic user owns nothing and is in no file's group: the "other" bits.
    Dynamic,
}

impl std::fmt::Display for Who {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Who::Root => f.write_str("root"),
            Who::Ids { name, .. } => write!(f, "user {name}"),
            Who::Dynamic => f.write_str("the unit's dynamic user"),
        }
    }
}

/// `None` when the user or group does not exist (their own checks say so) or cannot be looked
/// up: then nothing is said about permissions.
fn who(runs_as: &RunAs) -> Option<Who> {
    let (user, group) = match runs_as {
        RunAs::Root => return Some(Who::Root),
        RunAs::Dynamic => return Some(Who::Dynamic),
        RunAs::User { user, group } => (user, group),
    };
    let u = lookup_user(user).ok()??;
    if u.uid.is_root() {
        return Some(Who::Root);
    }
    let gid = match group {
        Some(g) => lookup_group(g).ok()??.gid,
        None => u.gid,
    };
    // systemd gives a `User=` its supplementary groups (initgroups) besides the primary one.
    let name = std::ffi::CString::new(u.name.as_bytes()).ok()?;
    let mut gids: Vec<u32> =
        nix::unistd::getgrouplist(&name, gid).map(|g| g.into_iter().map(Gid::as_raw).collect()).unwrap_or_default();
    gids.push(gid.as_raw());
    Some(Who::Ids { name: user.clone(), uid: u.uid.as_raw(), gids })
}

/// A user by name, or by number as systemd reads an all-digits `User=` (which needs an entry).
fn lookup_user(name: &str) -> nix::Result<Option<User>> {
    match name.parse::<u32>() {
        Ok(uid) => User::from_uid(Uid::from_raw(uid)),
        Err(_) => User::from_name(name),
    }
}

fn lookup_group(name: &str) -> nix::Result<Option<Group>> {
    match name.parse::<u32>() {
        Ok(gid) => Group::from_gid(Gid::from_raw(gid)),
        Err(_) => Group::from_name(name),
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Want {
    Read,
    Execute,
    /// Search a directory (its execute bit): to reach anything below it, or to `chdir` into it.
    Enter,
}

/// The kernel's mode-bit check (ACLs aside: see [`denied`]).
fn allowed(who: &Who, meta: &Metadata, want: Want) -> bool {
    let mode = meta.mode();
    let bit = if want == Want::Read { 4 } else { 1 };
    match who {
        Who::Root => want != Want::Execute || meta.is_dir() || mode & 0o111 != 0,
        Who::Ids { uid, gids, .. } => {
            // The owner's bits alone apply to the owner, the group's to its members.
            let class = if meta.uid() == *uid {
                mode >> 6
            } else if gids.contains(&meta.gid()) {
                mode >> 3
            } else {
                mode
            };
            class & bit != 0
        }
        Who::Dynamic => mode & bit != 0,
    }
}

/// Whether `who` may reach `path` (enter each directory above it) and then `want` it; a refusal
/// names the place and its mode and owner.
fn access(s: &Sight, who: &Who, path: &Path, want: Want, what: &str) -> Option<Found> {
    for dir in ancestors(s, path) {
        let Ok(meta) = s.metadata(&dir) else { continue };
        if !allowed(who, &meta, Want::Enter) {
            let m = mode_owner(&meta);
            return Some(denied(
                s,
                &dir,
                format!("{who} cannot enter {} ({m}), which holds {what} {}", dir.display(), path.display()),
            ));
        }
    }
    let meta = s.metadata(path).ok()?;
    if allowed(who, &meta, want) {
        return None;
    }
    let verb = match want {
        Want::Read => "read",
        Want::Execute => "execute",
        Want::Enter => "enter",
    };
    Some(denied(s, path, format!("{who} cannot {verb} {what} {} ({})", path.display(), mode_owner(&meta))))
}

/// A refusal by the mode bits is a problem, unless an ACL may grant what they do not: then the
/// pre-flight cannot tell, and says so.
fn denied(s: &Sight, path: &Path, message: String) -> Found {
    if has_acl(s, path) {
        Found::Note(format!("not checked: {message}, but it has an ACL, which may allow it"))
    } else {
        problem(s, path, message)
    }
}

fn has_acl(s: &Sight, path: &Path) -> bool {
    let Ok(real) = s.real(path) else { return false };
    let Ok(p) = std::ffi::CString::new(real.as_os_str().as_bytes()) else { return false };
    // SAFETY: two NUL-terminated strings; a null buffer of size 0 asks only for the value's size.
    unsafe { libc::getxattr(p.as_ptr(), c"system.posix_acl_access".as_ptr(), std::ptr::null_mut(), 0) >= 0 }
}

/// The directories a lookup of `path` passes through, outermost first: those above it as
/// written, then those above where its links lead.
fn ancestors(s: &Sight, path: &Path) -> Vec<PathBuf> {
    let real = s.canonical(path).ok();
    let mut out: Vec<PathBuf> = Vec::new();
    for p in std::iter::once(path).chain(real.as_deref()) {
        let mut above: Vec<&Path> = p.ancestors().skip(1).filter(|a| !a.as_os_str().is_empty()).collect();
        above.reverse();
        for a in above {
            if !out.iter().any(|o| o == a) {
                out.push(a.to_path_buf());
            }
        }
    }
    out
}

/// `mode 0700, owner root:root`.
fn mode_owner(meta: &Metadata) -> String {
    let user = User::from_uid(Uid::from_raw(meta.uid())).ok().flatten().map_or(meta.uid().to_string(), |u| u.name);
    let group = Group::from_gid(Gid::from_raw(meta.gid())).ok().flatten().map_or(meta.gid().to_string(), |g| g.name);
    format!("mode {:04o}, owner {user}:{group}", meta.mode() & 0o7777)
}

/// Why `path` could not be looked at: absent (or a link to nothing) is a problem; anything else
/// (specd itself not allowed to look) a note.
fn missing(s: &Sight, what: &str, path: &Path, e: &std::io::Error) -> Found {
    let p = path.display();
    match e.kind() {
        ErrorKind::NotFound => match s.read_link(path) {
            Ok(to) => {
                problem(s, path, format!("{what} {p} is a symbolic link to {}, which does not exist", to.display()))
            }
            Err(_) => problem(s, path, format!("{what} {p} does not exist")),
        },
        ErrorKind::NotADirectory => {
            problem(s, path, format!("{what} {p} does not exist: a part of its path is not a directory"))
        }
        _ => Found::Note(format!("not checked: {what} {p}: {e}")),
    }
}

fn first_bytes(s: &Sight, path: &Path, n: usize) -> Vec<u8> {
    let mut buf = Vec::with_capacity(n);
    let _ = s.real(path).and_then(std::fs::File::open).and_then(|f| f.take(n as u64).read_to_end(&mut buf));
    buf
}

// The looks, one per kind of check.

fn look_program(s: &Sight, program: &Program, runs_as: &RunAs, sandbox: &Sandbox) -> Vec<Found> {
    let path = match program {
        Program::Path(p) if !p.starts_with('/') => {
            return vec![Found::Problem(format!(
                "the program {p} is neither an absolute path nor a bare name: systemd refuses it"
            ))];
        }
        Program::Path(p) => PathBuf::from(p),
        Program::Search { name, dirs } => match search(s, name, dirs) {
            Some(p) => p,
            None => {
                let at = dirs.first().map(PathBuf::from).unwrap_or_default();
                return vec![problem(
                    s,
                    &at,
                    format!(
                        "the program {name} is not in systemd's search path ({}): give its absolute path",
                        dirs.join(":")
                    ),
                )];
            }
        },
    };
    let what = "the program";
    let p = path.display();
    if let Some(f) = sandboxed(s, sandbox, &format!("{what} {p}"), &path) {
        return vec![f];
    }
    let meta = match s.metadata(&path) {
        Ok(m) => m,
        Err(e) => return vec![missing(s, what, &path, &e)],
    };
    if meta.is_dir() {
        return vec![problem(s, &path, format!("{what} {p} is a directory"))];
    }
    if !meta.is_file() {
        return vec![problem(s, &path, format!("{what} {p} is not a regular file"))];
    }
    // systemd itself (root) needs an execute bit to take it.
    if meta.mode() & 0o111 == 0 {
        return vec![problem(s, &path, format!("{what} {p} is not executable ({})", mode_owner(&meta)))];
    }
    let who = who(runs_as);
    if let Some(f) = who.as_ref().and_then(|w| access(s, w, &path, Want::Execute, what)) {
        return vec![f];
    }
    interpreter(s, &path, who.as_ref(), sandbox)
}

/// The file systemd runs for a bare name: the first in `dirs` that is a regular file with an
/// execute bit (systemd looks as root, before it becomes the unit's user).
fn search(s: &Sight, name: &str, dirs: &[String]) -> Option<PathBuf> {
    dirs.iter()
        .map(|d| Path::new(d).join(name))
        .find(|p| s.metadata(p).is_ok_and(|m| m.is_file() && m.mode() & 0o111 != 0))
}

/// How many bytes of a file the kernel reads to tell its format (`BINPRM_BUF_SIZE`, Linux 5.1
/// and later): a `#!` line must end within them.
const SHEBANG_BYTES: usize = 256;

/// How many interpreters the kernel follows (Linux fs/exec.c, `exec_binprm`: a program and five
/// rewrites, `depth > 5` is ELOOP): the program and up to four scripts as interpreters; the
/// fifth interpreter must be a binary.
const INTERPRETERS: usize = 5;

/// What the kernel makes of a file's first bytes (Linux fs/binfmt_script.c).
#[derive(Debug, PartialEq)]
enum Shebang {
    /// No `#!`: another format (ELF), not checked further.
    NotAScript,
    /// `#!`, but no interpreter the kernel takes (ENOEXEC): why.
    Unusable(&'static str),
    /// The interpreter's path, byte for byte as the kernel opens it.
    Interpreter(Vec<u8>),
}

/// The interpreter of a file that starts with `head`, read as the kernel reads it: the first
/// line within the first [`SHEBANG_BYTES`] bytes; only spaces and tabs separate (a carriage
/// return is part of the name); trailing spaces and tabs trimmed; the name ends at the first
/// space, tab or NUL. A line longer than the buffer is taken only when the name ends within it.
fn shebang(head: &[u8]) -> Shebang {
    let mut buf = [0u8; SHEBANG_BYTES];
    let n = head.len().min(SHEBANG_BYTES);
    buf[..n].copy_from_slice(&head[..n]);
    if !buf.starts_with(b"#!") {
        return Shebang::NotAScript;
    }
    let blank = |c: u8| c == b' ' || c == b'\t';
    let last = SHEBANG_BYTES - 1;
    let mut end = match buf.iter().position(|&b| b == b'\n') {
        Some(i) => i,
        None => {
            let Some(first) = (2..=last).find(|&i| !blank(buf[i])) else {
                return Shebang::Unusable("its first line holds no interpreter");
            };
            if !(first..=last).any(|i| blank(buf[i]) || buf[i] == 0) {
                return Shebang::Unusable(
                    "its first line is longer than the kernel reads, which would cut the interpreter's name",
                );
            }
            last
        }
    };
    while blank(buf[end - 1]) {
        end -= 1;
    }
    let Some(name) = (2..end).find(|&i| !blank(buf[i])) else {
        return Shebang::Unusable("its first line holds no interpreter");
    };
    let name_end = (name..end).find(|&i| blank(buf[i]) || buf[i] == 0).unwrap_or(end);
    // A NUL first (a file of just `#!`): the kernel opens "" and fails.
    if name_end == name {
        return Shebang::Unusable("its first line holds no interpreter");
    }
    Shebang::Interpreter(buf[name..name_end].to_vec())
}

/// An interpreter's name for a message: as written when it is plain text, else quoted with its
/// control characters escaped.
fn interpreter_name(name: &[u8]) -> String {
    let text = String::from_utf8_lossy(name);
    if text.chars().any(|c| c.is_control() || c == char::REPLACEMENT_CHARACTER) {
        format!("{text:?}")
    } else {
        text.into_owned()
    }
}

/// A script runs through its `#!` interpreter, which may be a script too, as far as the kernel
/// follows ([`INTERPRETERS`]): each must exist and be executable, and each script readable (its
/// interpreter reads it), by the process's user. An entry point of a moved virtualenv (`vllm`)
/// fails here with the engine's "No such file or directory" at its start; a script saved with
/// Windows line endings with `203/EXEC`.
fn interpreter(s: &Sight, program: &Path, who: Option<&Who>, sandbox: &Sandbox) -> Vec<Found> {
    let mut out = Vec::new();
    let mut said = format!("the program {}", program.display());
    let mut file = program.to_path_buf();
    for depth in 0..=INTERPRETERS {
        let name = match shebang(&first_bytes(s, &file, SHEBANG_BYTES)) {
            Shebang::NotAScript => break,
            Shebang::Unusable(why) => {
                out.push(problem(s, &file, format!("{said} cannot be run: it starts with #!, but {why}")));
                break;
            }
            Shebang::Interpreter(name) => name,
        };
        if depth == INTERPRETERS {
            let m = format!("{said} is a script too: the kernel follows at most {INTERPRETERS} interpreters (ELOOP)");
            out.push(problem(s, &file, m));
            break;
        }
        out.extend(who.and_then(|w| access(s, w, &file, Want::Read, "the script")));
        let shown = interpreter_name(&name);
        said = format!("{said} is a script whose interpreter {shown}");
        let interp = PathBuf::from(std::ffi::OsStr::from_bytes(&name));
        if !interp.is_absolute() {
            out.push(Found::Note(format!(
                "not checked: {said} is a relative path, which the kernel opens from the working directory"
            )));
            break;
        }
        if let Some(f) = sandboxed(s, sandbox, &said, &interp) {
            out.push(f);
            break;
        }
        let cr = if name.ends_with(b"\r") {
            ": its first line ends in a carriage return (Windows line endings), which the kernel reads as part of the interpreter's name"
        } else {
            ""
        };
        match s.metadata(&interp) {
            Err(e) if e.kind() == ErrorKind::NotFound => {
                out.push(problem(s, &interp, format!("{said} does not exist{cr}")));
                break;
            }
            Err(e) => {
                out.push(Found::Note(format!("not checked: {said}: {e}")));
                break;
            }
            Ok(m) if !m.is_file() || m.mode() & 0o111 == 0 => {
                out.push(problem(s, &interp, format!("{said} is not executable ({})", mode_owner(&m))));
                break;
            }
            Ok(_) => {
                if let Some(f) = who.and_then(|w| access(s, w, &interp, Want::Execute, "the interpreter")) {
                    out.push(f);
                    break;
                }
            }
        }
        file = interp;
    }
    out
}

#[allow(clippy::too_many_arguments)]
fn look_model(
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
fn model_form_found(s: &Sight, what: &str, path: &Path, meta: &Metadata, form: ModelForm) -> Option<Found> {
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
fn engine_reads(name: &str, safetensors: bool) -> bool {
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
fn unreadable_files(s: &Sight, who: &Who, dir: &Path, what: &str) -> Vec<Found> {
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
fn starts_with(magic: &[u8]) -> String {
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
fn cwd_path(cwd: &Cwd, runs_as: &RunAs) -> Option<PathBuf> {
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

fn look_environment_file(s: &Sight, path: &str, optional: bool) -> Vec<Found> {
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
fn look_credential(s: &Sight, id: &str, path: &str) -> Vec<Found> {
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
fn manager_reads(s: &Sight, what: &str, path: &Path) -> Option<Found> {
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

fn look_user(name: &str) -> Vec<Found> {
    match lookup_user(name) {
        Ok(Some(_)) => Vec::new(),
        Ok(None) => vec![Found::Problem(format!("the user {name} does not exist on this host (User={name})"))],
        Err(e) => vec![Found::Note(format!("not checked: looking up the user {name}: {e}"))],
    }
}

fn look_group(name: &str) -> Vec<Found> {
    match lookup_group(name) {
        Ok(Some(_)) => Vec::new(),
        Ok(None) => vec![Found::Problem(format!("the group {name} does not exist on this host (Group={name})"))],
        Err(e) => vec![Found::Note(format!("not checked: looking up the group {name}: {e}"))],
    }
}

/// With a leading `-`, systemd starts the server wherever it cannot enter the directory: a note.
fn look_working_directory(s: &Sight, dir: &Cwd, optional: bool, runs_as: &RunAs, sandbox: &Sandbox) -> Vec<Found> {
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

fn look_gpus(indices: &[u32], dev: &Path) -> Vec<Found> {
    let devices = nvidia_devices(dev);
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

/// The numbers of the `nvidiaN` device nodes (not `nvidiactl`, `nvidia-uvm`...), sorted.
fn nvidia_devices(dev: &Path) -> Vec<u32> {
    let mut out: Vec<u32> = std::fs::read_dir(dev)
        .map(|rd| {
            rd.flatten().filter_map(|e| e.file_name().to_str()?.strip_prefix("nvidia")?.parse::<u32>().ok()).collect()
        })
        .unwrap_or_default();
    out.sort_unstable();
    out
}

// The port.

/// A listening TCP socket, from `/proc/net/tcp` or `tcp6`.
#[derive(Clone, Debug, PartialEq)]
struct Listener {
    addr: IpAddr,
    uid: u32,
    inode: u64,
}

fn look_port(unit: &str, host: &str, port: u16, own_cgroup: &str) -> Vec<Found> {
    // A host name (not an address) may resolve to any address: every listener on the port counts.
    let ours = host.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>().ok();
    let mut listeners: Vec<Listener> = ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|f| std::fs::read_to_string(f).ok())
        .flat_map(|t| listening(&t, port))
        .filter(|l| collides(ours, l.addr))
        .collect();
    if listeners.is_empty() {
        return Vec::new();
    }
    listeners.sort_by_key(|l| l.inode);
    let holders = socket_holders(&listeners.iter().map(|l| l.inode).collect());
    // Each process outside the unit once, with the addresses it listens on.
    let mut outside: BTreeMap<u32, Vec<String>> = BTreeMap::new();
    let mut unseen = Vec::new();
    for l in &listeners {
        let pids = holders.get(&l.inode).map(Vec::as_slice).unwrap_or_default();
        let at = std::net::SocketAddr::new(l.addr, port).to_string();
        if pids.is_empty() {
            unseen.push(format!(
                "not checked: a socket of uid {} listens on {at}, and specd cannot see its process: whether it is {unit}'s is not known",
                l.uid
            ));
            continue;
        }
        // A process gone since the look at its files (its cgroup file with it) holds nothing.
        let live: Vec<(u32, String)> = pids.iter().filter_map(|p| Some((*p, cgroup_of(*p)?))).collect();
        if let Some((pid, _)) = live.first().filter(|_| !live.iter().any(|(_, cg)| in_cgroup(cg, own_cgroup))) {
            outside.entry(*pid).or_default().push(at);
        }
    }
    let mut out: Vec<Found> = outside
        .into_iter()
        .map(|(pid, at)| {
            let cmd =
                crate::cgroup::cmdline(pid).map_or_else(|| "its command line is gone".to_string(), |c| c.join(" "));
            Found::Problem(format!(
                "port {port} is held by pid {pid} ({cmd}), which is not part of {unit} (it listens on {})",
                at.join(", ")
            ))
        })
        .collect();
    out.extend(unseen.into_iter().map(Found::Note));
    out
}

/// The LISTEN sockets on `port` in a `/proc/net/tcp` or `tcp6` text: `sl local_address
/// rem_address st tx:rx tr:when retrnsmt uid timeout inode`, addresses in hex as the kernel
/// stores them (32-bit words in the host's byte order), the port in hex, LISTEN is `0A`.
fn listening(text: &str, port: u16) -> Vec<Listener> {
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (addr, p) = f.get(1)?.split_once(':')?;
            if *f.get(3)? != "0A" || u16::from_str_radix(p, 16).ok()? != port {
                return None;
            }
            Some(Listener { addr: hex_addr(addr)?, uid: f.get(7)?.parse().ok()?, inode: f.get(9)?.parse().ok()? })
        })
        .collect()
}

/// An address of `/proc/net/tcp` (8 hex digits) or `tcp6` (32); an IPv4-mapped one as IPv4.
fn hex_addr(hex: &str) -> Option<IpAddr> {
    let word = |i: usize| hex.get(i * 8..i * 8 + 8).and_then(|w| u32::from_str_radix(w, 16).ok()).map(u32::to_ne_bytes);
    match hex.len() {
        8 => Some(IpAddr::V4(Ipv4Addr::from(word(0)?))),
        32 => {
            let mut b = [0u8; 16];
            for i in 0..4 {
                b[i * 4..i * 4 + 4].copy_from_slice(&word(i)?);
            }
            let a = Ipv6Addr::from(b);
            Some(a.to_ipv4_mapped().map_or(IpAddr::V6(a), IpAddr::V4))
        }
        _ => None,
    }
}

/// Whether binding `ours` (`None`: any address) fails on a port where `theirs` listens: the same
/// address, or a wildcard of the family. An IPv6 wildcard takes IPv4 too (Linux's default,
/// `net.ipv6.bindv6only = 0`).
fn collides(ours: Option<IpAddr>, theirs: IpAddr) -> bool {
    let Some(ours) = ours else { return true };
    let covers = |a: IpAddr, b: IpAddr| a == b || (a.is_unspecified() && (a.is_ipv6() || b.is_ipv4()));
    covers(ours, theirs) || covers(theirs, ours)
}

/// The processes that have each socket inode open (`/proc/PID/fd/* -> socket:[INODE]`), by pid.
fn socket_holders(inodes: &BTreeSet<u64>) -> BTreeMap<u64, Vec<u32>> {
    let mut out: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
    let Ok(procs) = std::fs::read_dir("/proc") else { return out };
    for p in procs.flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        let Ok(fds) = std::fs::read_dir(p.path().join("fd")) else { continue };
        for fd in fds.flatten() {
            let inode = std::fs::read_link(fd.path())
                .ok()
                .and_then(|l| l.to_str()?.strip_prefix("socket:[")?.strip_suffix(']')?.parse::<u64>().ok());
            if let Some(i) = inode.filter(|i| inodes.contains(i)) {
                out.entry(i).or_default().push(pid);
            }
        }
    }
    for pids in out.values_mut() {
        pids.sort_unstable();
        pids.dedup();
    }
    out
}

fn cgroup_of(pid: u32) -> Option<String> {
    unit_cgroup(&std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?)
}

/// A process's cgroup as systemd names it, from `/proc/PID/cgroup`: the unified hierarchy's line
/// (`0::/system.slice/x.service`), else systemd's own v1 hierarchy (`N:name=systemd:/…`).
fn unit_cgroup(text: &str) -> Option<String> {
    let mut v1 = None;
    for l in text.lines() {
        let mut f = l.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (f.next(), f.next(), f.next()) else { continue };
        if id == "0" && controllers.is_empty() {
            return Some(path.to_string());
        }
        if controllers == "name=systemd" {
            v1 = Some(path.to_string());
        }
    }
    v1
}

/// `cg` is the unit's cgroup `own` or below it (a unit may make child cgroups).
fn in_cgroup(cg: &str, own: &str) -> bool {
    !own.is_empty() && (cg == own || cg.starts_with(&format!("{}/", own.trim_end_matches('/'))))
}

// The unit file.

/// `systemd-analyze verify` of the unit text, written under the unit's own name in a private
/// directory (the directory of a file given to `verify` comes first in its unit path).
async fn verify(unit: &str, text: &str, m: &Machine) -> Vec<Found> {
    let not = |why: String| vec![Found::Note(format!("not checked: {why}"))];
    let Some((prog, pre)) = m.analyze.split_first() else { return Vec::new() };
    let dir = match tempfile::Builder::new().prefix("specd-preflight.").tempdir() {
        Ok(d) => d,
        Err(e) => return not(format!("{prog} verify: no temporary directory: {e}")),
    };
    let file = dir.path().join(unit);
    if let Err(e) = std::fs::write(&file, text) {
        return not(format!("{prog} verify: writing {}: {e}", file.display()));
    }
    let mut cmd = tokio::process::Command::new(prog);
    // `--recursive-errors=no`: the exit status is this unit's alone, not the host's other units'.
    cmd.args(pre)
        .args(["verify", "--recursive-errors=no", "--man=no"])
        .arg(&file)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    let child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) if e.kind() == ErrorKind::NotFound => return not(format!("{prog} is not installed")),
        Err(e) => return not(format!("running {prog}: {e}")),
    };
    // On the timeout the child is dropped, which kills it.
    let out = match tokio::time::timeout(m.verify_within, child.wait_with_output()).await {
        Ok(Ok(o)) => o,
        Ok(Err(e)) => return not(format!("{prog} verify: {e}")),
        Err(_) => return not(format!("{prog} verify did not finish within {} s", m.verify_within.as_secs_f64())),
    };
    let output = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    judge(unit, &file.to_string_lossy(), out.status.success(), &output, m.sight == Sight::Own)
}

/// `systemd-analyze verify`'s verdict on one unit, from its exit status and its lines about the
/// unit (starting with the file's path or the unit's name; the private directory left out).
/// With `--recursive-errors=no`, systemd 252 fails a unit for an unknown key, a value it cannot
/// parse or a program that is not executable, not for a warning ("Special user nobody
/// configured, this is not safe!"): a warning is a note. It runs in specd's view of the file
/// system: where that is not the host's (`host_view` false), what it says of the programs is
/// a note (the program's own check looks at it as the unit will).
fn judge(unit: &str, file: &str, success: bool, output: &str, host_view: bool) -> Vec<Found> {
    let dir = Path::new(file).parent().map(|d| format!("{}/", d.display())).unwrap_or_default();
    let ours: Vec<&str> = output
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with(&format!("{file}:")) || l.starts_with(&format!("{unit}:")))
        .map(|l| l.strip_prefix(dir.as_str()).unwrap_or(l))
        .collect();
    let program = |l: &&str| l.starts_with(&format!("{unit}: Command ")) && l.contains(" is not executable");
    let (elsewhere, ours): (Vec<&str>, Vec<&str>) = ours.into_iter().partition(|l| !host_view && program(l));
    let mut out: Vec<Found> = elsewhere
        .iter()
        .map(|l| {
            Found::Note(format!(
                "not checked: systemd-analyze verify, run in specd's own view of the file system, which is not the host's: {l}"
            ))
        })
        .collect();
    let said = format!("systemd-analyze verify: {}", ours.join("; "));
    out.extend(match (success, ours.is_empty()) {
        (true, true) => None,
        (true, false) => Some(Found::Note(said)),
        (false, false) => Some(Found::Problem(said)),
        (false, true) if !elsewhere.is_empty() => None,
        // Not about this unit (an option this systemd does not know): nothing is known.
        (false, true) => {
            let first = output.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or("no output");
            Some(Found::Note(format!("not checked: systemd-analyze verify failed without naming {unit}: {first}")))
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const UNIT: &str = "sglang-qwen.service";

    fn resolve(body: &str) -> Spec {
        let yaml = format!("apiVersion: specd/v1\nkind: InferenceService\nmetadata: {{name: qwen}}\nspec:\n{body}");
        specd_spec::parse("t.yaml", &yaml).unwrap().resolve(None).unwrap()
    }

    fn full_spec() -> Spec {
        resolve(&format!(
            "  unit: {UNIT}\n  engine: sglang\n  command: [/opt/sglang/bin/python3, -m, sglang.launch_server]\n  model: /models/Qwen3.5-122B-A10B\n  server: {{port: 30000}}\n  speculative: {{algorithm: EAGLE, draft_model: /models/draft, num_steps: 3, eagle_topk: 1, num_draft_tokens: 4}}\n  service:\n    user: sglang\n    group: gpu\n    working_directory: /opt/sglang\n    environment: {{CUDA_VISIBLE_DEVICES: \"0,1\"}}\n    environment_files: [/etc/sglang/env, -/etc/sglang/optional.env]\n    credentials: {{hf_token: /run/secrets/hf-token}}\n"
        ))
    }

    fn user(u: &str, g: Option<&str>) -> RunAs {
        RunAs::User { user: u.to_string(), group: g.map(str::to_string) }
    }

    fn s(v: &str) -> String {
        v.to_string()
    }

    /// `judge` where specd's view is the host's.
    fn judge(unit: &str, file: &str, success: bool, output: &str) -> Vec<Found> {
        super::judge(unit, file, success, output, true)
    }

    // The pure part.

    #[test]
    fn a_spec_s_checks_come_from_its_unit_text_and_its_engine_s_flags() {
        let spec = full_spec();
        let text = specd_spec::render(&spec).text;
        let as_ = user("sglang", Some("gpu"));
        let cwd = Cwd::Path(s("/opt/sglang"));
        let model = |role, value: &str| Check::Model {
            role,
            value: s(value),
            form: ModelForm::FolderOrGguf,
            cwd: cwd.clone(),
            runs_as: as_.clone(),
            sandbox: Sandbox::default(),
            verify: Verify::None,
        };
        assert_eq!(
            checks(&spec, &text, &[]),
            [
                Check::User { name: s("sglang") },
                Check::Group { name: s("gpu") },
                Check::Program {
                    program: Program::Path(s("/opt/sglang/bin/python3")),
                    runs_as: as_.clone(),
                    sandbox: Sandbox::default()
                },
                Check::WorkingDirectory {
                    dir: cwd.clone(),
                    optional: false,
                    runs_as: as_.clone(),
                    sandbox: Sandbox::default()
                },
                model(ModelRole::Model, "/models/Qwen3.5-122B-A10B"),
                model(ModelRole::Draft, "/models/draft"),
                Check::EnvironmentFile { path: s("/etc/sglang/env"), optional: false },
                Check::EnvironmentFile { path: s("/etc/sglang/optional.env"), optional: true },
                Check::Credential { id: s("hf_token"), path: s("/run/secrets/hf-token") },
                Check::Port { unit: s(UNIT), host: s("127.0.0.1"), port: 30000 },
                Check::Gpus { indices: vec![0, 1] },
                Check::UnitFile { unit: s(UNIT), text: text.clone() },
            ]
        );
    }

    #[test]
    fn a_bare_program_is_looked_up_in_systemd_s_search_path_and_llama_cpp_loads_gguf_files() {
        let spec = resolve(
            "  unit: llama.service\n  engine: llama-cpp\n  model: /models/m.gguf\n  speculative: {draft_model: /models/d.gguf}\n",
        );
        let text = specd_spec::render(&spec).text;
        let model = |role, value: &str| Check::Model {
            role,
            value: s(value),
            form: ModelForm::GgufFile,
            cwd: Cwd::Path(s("/")),
            runs_as: RunAs::Root,
            sandbox: Sandbox::default(),
            verify: Verify::None,
        };
        let search = SEARCH_PATH.iter().map(|d| s(d)).collect();
        assert_eq!(
            checks(&spec, &text, &[]),
            [
                Check::Program {
                    program: Program::Search { name: s("llama-server"), dirs: search },
                    runs_as: RunAs::Root,
                    sandbox: Sandbox::default(),
                },
                model(ModelRole::Model, "/models/m.gguf"),
                model(ModelRole::Draft, "/models/d.gguf"),
                Check::Port { unit: s("llama.service"), host: s("127.0.0.1"), port: 8080 },
                Check::UnitFile { unit: s("llama.service"), text: text.clone() },
            ]
        );
    }

    #[test]
    fn the_unit_text_is_what_systemd_sees() {
        let spec = full_spec();
        // Another program, a search path of the unit's own, a dynamic user, `~`, specifiers,
        // a wildcard, a credential without a path, a GPU UUID.
        let text = "[Unit]\nUser=not-this-one\n[Service]\n# User=nor-this\nExecStart=/x\nExecStart=\nExecStart=-tool \\\n  --flag\nExecSearchPath=/opt/bin\nExecSearchPath=/opt/sbin\nUser=qwen\nDynamicUser=yes\nWorkingDirectory=-~\nEnvironment=\"CUDA_VISIBLE_DEVICES=GPU-8f2e,1\"\nEnvironmentFile=/etc/%h/env\nEnvironmentFile=-/etc/a*.env\nLoadCredential=tok\n";
        let got = checks(&spec, text, &[]);
        let program = Program::Search { name: s("tool"), dirs: vec![s("/opt/bin"), s("/opt/sbin")] };
        // A dynamic user has a /tmp of its own.
        let implied = |dir: &str| Shadow { dir: s(dir), setting: s("DynamicUser=yes (which implies PrivateTmp=yes)") };
        let sandbox = Sandbox { hidden: vec![implied("/tmp"), implied("/var/tmp")], elsewhere: vec![] };
        assert_eq!(got[0], Check::Program { program, runs_as: RunAs::Dynamic, sandbox: sandbox.clone() }, "{got:#?}");
        assert_eq!(
            got[1],
            Check::WorkingDirectory { dir: Cwd::Home, optional: true, runs_as: RunAs::Dynamic, sandbox }
        );
        let kinds: Vec<(CheckKind, bool)> =
            got.iter().map(|c| (c.kind(), matches!(c, Check::NotChecked { .. }))).collect();
        assert_eq!(
            kinds,
            [
                (CheckKind::Program, false),
                (CheckKind::WorkingDirectory, false),
                (CheckKind::Model, false),
                (CheckKind::DraftModel, false),
                (CheckKind::EnvironmentFile, true),
                (CheckKind::EnvironmentFile, true),
                (CheckKind::Credential, true),
                (CheckKind::Port, false),
                (CheckKind::Gpu, false),
                (CheckKind::Gpu, true),
                (CheckKind::UnitFile, false),
            ]
        );
        let why = |i: usize| match &got[i] {
            Check::NotChecked { why, .. } => why.clone(),
            c => panic!("{c:?}"),
        };
        assert_eq!(why(4), "EnvironmentFile=/etc/%h/env uses the specifier %h, which the pre-flight does not resolve");
        assert_eq!(why(5), "the environment files /etc/a*.env are a wildcard: whether they match is not checked");
        assert_eq!(
            why(6),
            "the credential tok is passed on from the service manager or its credential store, not read from a path"
        );
        assert_eq!(got[8], Check::Gpus { indices: vec![1] });
        assert_eq!(why(9), "CUDA_VISIBLE_DEVICES names GPU-8f2e: GPU UUIDs and MIG ids need the driver's tools");
        // Without an `ExecStart=` specd's parser reads, the spec's argv.
        let got = checks(&spec, "[Service]\nExecStart=/opt/%n serve\n", &[]);
        assert_eq!(
            got[0],
            Check::Program {
                program: Program::Path(s("/opt/sglang/bin/python3")),
                runs_as: RunAs::Root,
                sandbox: Sandbox::default()
            }
        );
    }

    #[test]
    fn the_unit_s_sandbox_is_read_from_the_unit_and_its_drop_ins() {
        let spec = full_spec();
        let text = specd_spec::render(&spec).text;
        let sandbox = |drop_ins: &[(&str, &str)]| {
            let d: Vec<(String, String)> = drop_ins.iter().map(|(p, t)| (s(p), format!("[Service]\n{t}"))).collect();
            match checks(&spec, &text, &d).into_iter().find(|c| matches!(c, Check::Model { .. })) {
                Some(Check::Model { sandbox, .. }) => sandbox,
                c => panic!("{c:?}"),
            }
        };
        let at = |dir: &str, setting: &str| Shadow { dir: s(dir), setting: s(setting) };
        // The rendered unit has none: specd's specs cannot ask for one.
        assert_eq!(sandbox(&[]), Sandbox::default());
        let a = "/etc/systemd/system/service.d/a.conf";
        let b = "/etc/systemd/system/sglang-.service.d/b.conf";
        assert_eq!(
            sandbox(&[(a, "PrivateTmp=yes\nProtectHome=read-only\n")]),
            Sandbox {
                hidden: vec![
                    at("/tmp", &format!("PrivateTmp=yes (in {a})")),
                    at("/var/tmp", &format!("PrivateTmp=yes (in {a})"))
                ],
                elsewhere: vec![]
            }
        );
        // A later drop-in wins; `tmpfs` hides /home as `yes` does.
        let home = |setting: &str| vec![at("/home", setting), at("/root", setting), at("/run/user", setting)];
        assert_eq!(
            sandbox(&[(a, "PrivateTmp=yes\nProtectHome=yes\n"), (b, "PrivateTmp=no\nProtectHome=tmpfs\n")]),
            Sandbox { hidden: home(&format!("ProtectHome=tmpfs (in {b})")), elsewhere: vec![] }
        );
        let lists = "InaccessiblePaths=-/srv/secret /opt/x\nInaccessiblePaths=\nInaccessiblePaths=/data\nTemporaryFileSystem=/var/cache:ro\nBindReadOnlyPaths=/srv/models:/models -/same\nBindPaths=/a:/b:rbind\nRootDirectory=\n";
        let setting = |v: &str| format!("{v} (in {a})");
        assert_eq!(
            sandbox(&[(a, lists)]),
            Sandbox {
                hidden: vec![
                    at("/data", &setting("InaccessiblePaths=/data")),
                    at("/var/cache", &setting("TemporaryFileSystem=/var/cache:ro")),
                ],
                elsewhere: vec![
                    at("/models", &setting("BindReadOnlyPaths=/srv/models:/models -/same")),
                    at("/b", &setting("BindPaths=/a:/b:rbind")),
                ],
            }
        );
        assert_eq!(
            sandbox(&[(a, "RootDirectory=/srv/root\nBindPaths=/x:%t/y\n")]).elsewhere,
            [at("/", &setting("RootDirectory=/srv/root")), at("/", &setting("BindPaths=/x:%t/y"))]
        );
        // A drop-in's other settings count too: who runs the program.
        let c = checks(&spec, &text, &[(s(a), s("[Service]\nUser=other\n"))]);
        assert!(c.contains(&Check::User { name: s("other") }), "{c:?}");
    }

    #[test]
    fn the_program_s_prefixes_and_the_user_settings_decide_who_runs_it() {
        let exec_as = |lines: &str| {
            let svc = ServiceSection::read(&format!("[Service]\n{lines}"));
            svc.runs_as(svc.user.clone(), svc.group.clone())
        };
        let qwen = user("qwen", None);
        for (lines, want) in [
            ("ExecStart=/x\n", RunAs::Root),
            ("ExecStart=/x\nUser=qwen\n", qwen.clone()),
            ("ExecStart=/x\nUser=qwen\nGroup=gpu\n", user("qwen", Some("gpu"))),
            ("ExecStart=/x\nGroup=gpu\n", RunAs::Root),
            ("ExecStart=/x\nUser=root\n", RunAs::Root),
            ("ExecStart=/x\nUser=0\n", RunAs::Root),
            ("ExecStart=/x\nUser=qwen\nUser=\n", RunAs::Root),
            // Full privileges; no user change; `!!` changes nothing with ambient capabilities.
            ("ExecStart=+/x\nUser=qwen\n", RunAs::Root),
            ("ExecStart=!/x\nUser=qwen\n", RunAs::Root),
            ("ExecStart=!!/x\nUser=qwen\n", qwen.clone()),
            ("ExecStart=-@:/x x\nUser=qwen\n", qwen.clone()),
            ("ExecStart=-+/x\nUser=qwen\n", RunAs::Root),
            ("ExecStart=/x\nUser=qwen\nDynamicUser=yes\n", RunAs::Dynamic),
            ("ExecStart=/x\nDynamicUser=true\n", RunAs::Dynamic),
            ("ExecStart=/x\nDynamicUser=no\nUser=qwen\n", qwen.clone()),
            ("ExecStart=!/x\nDynamicUser=yes\n", RunAs::Root),
        ] {
            assert_eq!(exec_as(lines), want, "{lines}");
        }
    }

    #[test]
    fn users_groups_and_working_directories_are_checked_as_systemd_reads_them() {
        let spec = full_spec();
        let got = |lines: &str| checks(&spec, &format!("[Service]\nExecStart=/x\n{lines}"), &[]);
        // A dynamic user is made at the start: nothing to look up.
        assert!(!got("User=qwen\nDynamicUser=yes\n").iter().any(|c| matches!(c, Check::User { .. })));
        assert_eq!(got("User=1000\n")[0], Check::User { name: s("1000") });
        let c = got("User=%u\n");
        assert_eq!(c[0].kind(), CheckKind::User);
        assert!(matches!(&c[0], Check::NotChecked { why, .. } if why.contains("%u")), "{c:?}");
        assert_eq!(
            c[1],
            Check::Program { program: Program::Path(s("/x")), runs_as: RunAs::Root, sandbox: Sandbox::default() }
        );
        for (lines, dir, optional) in [
            ("WorkingDirectory=/srv/m\n", Cwd::Path(s("/srv/m")), false),
            ("WorkingDirectory=-/srv/m\n", Cwd::Path(s("/srv/m")), true),
            ("WorkingDirectory=~\n", Cwd::Home, false),
            ("WorkingDirectory=/srv/100%%\n", Cwd::Path(s("/srv/100%")), false),
        ] {
            let c = got(lines);
            assert_eq!(
                c[1],
                Check::WorkingDirectory {
                    dir: dir.clone(),
                    optional,
                    runs_as: RunAs::Root,
                    sandbox: Sandbox::default()
                },
                "{lines}"
            );
            // A relative model would be looked for there.
            assert!(matches!(&c[2], Check::Model { cwd, .. } if *cwd == dir), "{c:?}");
        }
    }

    #[test]
    fn environment_and_credentials_as_the_unit_lists_them() {
        let svc = ServiceSection::read(
            "[Service]\nEnvironment=\"A=1\"\nEnvironment=\nEnvironment=\"CUDA_VISIBLE_DEVICES=0\"\nEnvironment=\"CUDA_VISIBLE_DEVICES=2,3\"\nEnvironmentFile=/a\nEnvironmentFile=\nEnvironmentFile=-/b\nLoadCredential=x:/c\n",
        );
        assert_eq!(svc.environment, [r#""CUDA_VISIBLE_DEVICES=0""#, r#""CUDA_VISIBLE_DEVICES=2,3""#]);
        assert_eq!(svc.environment("CUDA_VISIBLE_DEVICES").as_deref(), Some("2,3"));
        assert_eq!(svc.environment("A"), None);
        assert_eq!(svc.environment_files, ["-/b"]);
        assert_eq!(environment_file("-/b"), Check::EnvironmentFile { path: s("/b"), optional: true });
        assert_eq!(environment_file("/100%%.env"), Check::EnvironmentFile { path: s("/100%.env"), optional: false });
        assert!(
            matches!(environment_file("b.env"), Check::NotChecked { why, .. } if why.contains("not an absolute path"))
        );
        assert_eq!(credential("x:/c"), Check::Credential { id: s("x"), path: s("/c") });
        assert!(matches!(credential("x:%d/c"), Check::NotChecked { why, .. } if why.contains("%d")));
    }

    #[test]
    fn specifiers_other_than_a_percent_sign_are_not_resolved() {
        assert_eq!(unspecify("/a/100%%/b"), Ok(s("/a/100%/b")));
        assert_eq!(unspecify("plain"), Ok(s("plain")));
        assert_eq!(unspecify("%h/x"), Err(s("%h")));
        assert_eq!(unspecify("x%"), Err(s("%")));
    }

    #[test]
    fn cuda_visible_devices_is_read_as_cuda_reads_it() {
        let gpu = |v: &str| gpus(v);
        assert_eq!(gpu("0,1, 2"), [Check::Gpus { indices: vec![0, 1, 2] }]);
        assert_eq!(gpu("GPU-1,MIG-2").len(), 1);
        assert!(
            matches!(&gpu("GPU-1,MIG-2")[0], Check::NotChecked { kind: CheckKind::Gpu, why } if why.contains("GPU-1, MIG-2"))
        );
        let hidden = gpu("-1");
        assert!(
            matches!(&hidden[..], [Check::NotChecked { why, .. }] if why.contains("CUDA ignores `-1`")),
            "{hidden:?}"
        );
        let cut = gpu("0,x,3");
        assert_eq!(cut[0], Check::Gpus { indices: vec![0] }, "3 comes after an entry CUDA stops at");
        assert_eq!(cut.len(), 2);
        assert!(gpu("").iter().all(|c| matches!(c, Check::NotChecked { .. })));
    }

    #[test]
    fn hugging_face_repo_ids_are_told_from_paths() {
        for id in ["Qwen/Qwen3-8B", "gpt2", "meta-llama/Llama-3.1-8B-Instruct", "a_b/c.d"] {
            assert!(looks_like_repo_id(id), "{id}");
        }
        for p in ["/models/x", "./x", "../x", "~/x", "a/b/c", "a//b", "-a/b", "a./b", "a--b/c", "a..b", "", "a b/c"] {
            assert!(!looks_like_repo_id(p), "{p}");
        }
    }

    #[test]
    fn listening_sockets_are_read_from_proc_net_tcp() {
        // Addresses as the kernel prints them: each 32-bit word in this host's byte order.
        let v4 = |a: [u8; 4]| format!("{:08X}", u32::from_ne_bytes(a));
        let v6 = |a: Ipv6Addr| a.octets().chunks(4).map(|w| v4([w[0], w[1], w[2], w[3]])).collect::<String>();
        let header =
            "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n";
        let row = |addr: &str, port: u16, st: &str, inode: u64| {
            format!(
                "   0: {addr}:{port:04X} 00000000:0000 {st} 00000000:00000000 00:00000000 00000000  1000        0 {inode} 1 0000000000000000 100 0 0 10 0\n"
            )
        };
        let text = header.to_string()
            + &row(&v4([127, 0, 0, 1]), 30000, "0A", 11)
            + &row(&v4([0, 0, 0, 0]), 30000, "01", 12)
            + &row(&v4([10, 1, 2, 3]), 8080, "0A", 13);
        let l = listening(&text, 30000);
        assert_eq!(l, [Listener { addr: IpAddr::from([127, 0, 0, 1]), uid: 1000, inode: 11 }]);
        let text6 = header.to_string()
            + &row(&v6(Ipv6Addr::UNSPECIFIED), 8000, "0A", 21)
            + &row(&v6(Ipv4Addr::new(127, 0, 0, 1).to_ipv6_mapped()), 8000, "0A", 22);
        let addrs: Vec<IpAddr> = listening(&text6, 8000).iter().map(|l| l.addr).collect();
        assert_eq!(addrs, [IpAddr::from(Ipv6Addr::UNSPECIFIED), IpAddr::from([127, 0, 0, 1])]);
        assert_eq!(hex_addr("XYZ"), None);
    }

    #[test]
    fn a_bind_collides_with_the_same_address_or_a_wildcard_of_its_family() {
        let ip = |a: &str| a.parse::<IpAddr>().unwrap();
        for (ours, theirs, want) in [
            ("127.0.0.1", "127.0.0.1", true),
            ("127.0.0.1", "0.0.0.0", true),
            ("0.0.0.0", "127.0.0.1", true),
            ("127.0.0.1", "10.0.0.1", false),
            // A v6 wildcard takes IPv4 too; a v4 wildcard no IPv6.
            ("127.0.0.1", "::", true),
            ("::", "10.0.0.1", true),
            ("::1", "0.0.0.0", false),
            ("0.0.0.0", "::1", false),
            ("::1", "::1", true),
            ("::1", "::2", false),
        ] {
            assert_eq!(collides(Some(ip(ours)), ip(theirs)), want, "{ours} vs {theirs}");
        }
        assert!(collides(None, ip("10.0.0.1")), "a host name may be any address");
    }

    #[test]
    fn a_process_s_cgroup_and_whether_it_is_the_unit_s() {
        assert_eq!(unit_cgroup("0::/system.slice/a.service\n").as_deref(), Some("/system.slice/a.service"));
        let hybrid =
            "12:memory:/system.slice/a.service\n1:name=systemd:/system.slice/a.service\n0::/system.slice/a.service\n";
        assert_eq!(unit_cgroup(hybrid).as_deref(), Some("/system.slice/a.service"));
        assert_eq!(unit_cgroup("1:name=systemd:/system.slice/b.service\n").as_deref(), Some("/system.slice/b.service"));
        assert_eq!(unit_cgroup("garbage\n"), None);
        let own = "/system.slice/a.service";
        assert!(in_cgroup("/system.slice/a.service", own));
        assert!(in_cgroup("/system.slice/a.service/worker", own));
        assert!(!in_cgroup("/system.slice/a.service2", own));
        assert!(!in_cgroup("/system.slice/a.service", ""), "no instance: nothing is the unit's");
    }

    #[test]
    fn systemd_analyze_verify_s_word_on_a_program_specd_sees_in_another_view_is_a_note() {
        let file = "/tmp/specd-preflight.x/a.service";
        let cmd = "a.service: Command /tmp/llama-server is not executable: No such file or directory\n";
        let note = Found::Note(s(
            "not checked: systemd-analyze verify, run in specd's own view of the file system, which is not the host's: a.service: Command /tmp/llama-server is not executable: No such file or directory",
        ));
        assert_eq!(super::judge("a.service", file, false, cmd, false), std::slice::from_ref(&note));
        assert_eq!(
            super::judge("a.service", file, false, cmd, true),
            [Found::Problem(format!("systemd-analyze verify: {}", cmd.trim()))]
        );
        // Anything else it says stays its verdict.
        let both = format!(
            "{cmd}/tmp/specd-preflight.x/a.service:8: Unknown key 'BogusKey' in section [Service], ignoring.\n"
        );
        assert_eq!(
            super::judge("a.service", file, false, &both, false),
            [
                note,
                Found::Problem(s(
                    "systemd-analyze verify: a.service:8: Unknown key 'BogusKey' in section [Service], ignoring."
                ))
            ]
        );
    }

    #[test]
    fn systemd_analyze_verify_s_verdict_is_its_exit_status_and_its_lines_about_the_unit() {
        let file = "/tmp/specd-preflight.x/a.service";
        let nobody = "/tmp/specd-preflight.x/a.service:9: Special user nobody configured, this is not safe!";
        assert_eq!(judge("a.service", file, true, ""), []);
        assert_eq!(
            judge("a.service", file, true, nobody),
            [Found::Note(s("systemd-analyze verify: a.service:9: Special user nobody configured, this is not safe!"))]
        );
        // What systemd 252 printed for a unit whose program does not exist (exit status 1).
        let missing = format!(
            "{nobody}\na.service: Command /opt/nowhere/vllm is not executable: No such file or directory\nb.service: something else\n"
        );
        assert_eq!(
            judge("a.service", file, false, &missing),
            [Found::Problem(s(
                "systemd-analyze verify: a.service:9: Special user nobody configured, this is not safe!; a.service: Command /opt/nowhere/vllm is not executable: No such file or directory"
            ))]
        );
        let bad_key = "/tmp/specd-preflight.x/a.service:8: Unknown key 'BogusKey' in section [Service], ignoring.\n";
        assert_eq!(
            judge("a.service", file, false, bad_key),
            [Found::Problem(s(
                "systemd-analyze verify: a.service:8: Unknown key 'BogusKey' in section [Service], ignoring."
            ))]
        );
        // An older systemd without the option: nothing known about the unit.
        assert_eq!(
            judge("a.service", file, false, "systemd-analyze: unrecognized option '--recursive-errors=no'\n"),
            [Found::Note(s(
                "not checked: systemd-analyze verify failed without naming a.service: systemd-analyze: unrecognized option '--recursive-errors=no'"
            ))]
        );
    }

    #[test]
    fn an_engine_reads_a_model_folder_s_config_weights_and_tokenizer_only() {
        for name in [
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "model-00001-of-00004.safetensors",
            "model.safetensors.index.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "tokenizer.model",
            "special_tokens_map.json",
            "vocab.txt",
            "merges.txt",
            "qwen.tiktoken",
            "chat_template.jinja",
            "preprocessor_config.json",
            "modeling_custom.py",
        ] {
            assert!(engine_reads(name, true), "{name}");
        }
        for name in [
            "README.md",
            "LICENSE",
            ".gitattributes",
            "trainer_state.json",
            "figure.png",
            "pytorch_model.bin",
            "consolidated.pth",
            "m.gguf",
        ] {
            assert!(!engine_reads(name, true), "{name}, with safetensors there");
        }
        // Without safetensors, PyTorch's weights, but not training state.
        for (name, read) in [
            ("pytorch_model-00001-of-00002.bin", true),
            ("pytorch_model.bin.index.json", true),
            ("consolidated.pth", true),
            ("training_args.bin", false),
            ("optimizer.pt", false),
            ("model.safetensors.index.json", false),
        ] {
            assert_eq!(engine_reads(name, false), read, "{name}, without safetensors");
        }
    }

    #[test]
    fn a_shebang_is_read_as_the_kernel_reads_it() {
        let i = |v: &str| Shebang::Interpreter(v.as_bytes().to_vec());
        let long = |tail: &str| format!("#!/bin/sh{tail}");
        for (head, want) in [
            ("#!/bin/sh\n", i("/bin/sh")),
            ("#!/bin/sh", i("/bin/sh")),
            ("#!/bin/sh\r\n", i("/bin/sh\r")),
            ("#!/bin/sh \r\n", i("/bin/sh")),
            ("#! \t/usr/bin/env  python3 -u \t\n", i("/usr/bin/env")),
            ("#!/bin/sh\x0bx\n", i("/bin/sh\x0bx")),
            ("#!/bin/sh\0-e\n", i("/bin/sh")),
            ("#!/bin/sh -e\n#!/other\n", i("/bin/sh")),
            ("#!\n", Shebang::Unusable("its first line holds no interpreter")),
            ("#! \t \n/bin/sh\n", Shebang::Unusable("its first line holds no interpreter")),
            ("#!", Shebang::Unusable("its first line holds no interpreter")),
            ("#!\0/bin/sh\n", Shebang::Unusable("its first line holds no interpreter")),
            ("\u{feff}#!/bin/sh\n", Shebang::NotAScript),
            (" #!/bin/sh\n", Shebang::NotAScript),
            ("\x7fELF", Shebang::NotAScript),
            ("", Shebang::NotAScript),
        ] {
            assert_eq!(shebang(head.as_bytes()), want, "{head:?}");
        }
        // Past the kernel's 256 bytes: a name that ends within them is taken, its argument cut;
        // a name that does not is refused rather than cut.
        assert_eq!(shebang(long(&format!(" {}", "a".repeat(300))).as_bytes()), i("/bin/sh"));
        assert_eq!(shebang(long(&" ".repeat(300)).as_bytes()), i("/bin/sh"));
        assert_eq!(
            shebang(format!("#!/{}", "a".repeat(300)).as_bytes()),
            Shebang::Unusable("its first line is longer than the kernel reads, which would cut the interpreter's name")
        );
        // A newline as the 256th byte is seen, one after it is not.
        assert_eq!(shebang(format!("#!/{}\n", "b".repeat(252)).as_bytes()), i(&format!("/{}", "b".repeat(252))));
        assert!(matches!(shebang(format!("#!/{}\n", "b".repeat(253)).as_bytes()), Shebang::Unusable(_)));
        assert_eq!(interpreter_name(b"/bin/sh"), "/bin/sh");
        assert_eq!(interpreter_name(b"/bin/sh\r"), "\"/bin/sh\\r\"");
    }

    #[test]
    fn a_refusal_says_all_its_problems_in_one_line() {
        let p = |check, m: &str| Problem { check, message: s(m) };
        assert_eq!(summary(&[]), "");
        assert_eq!(
            summary(&[
                p(CheckKind::Program, "the program /opt/nowhere/vllm does not exist"),
                p(CheckKind::DraftModel, "the draft model /models/no-such-draft does not exist"),
            ]),
            "the program /opt/nowhere/vllm does not exist; the draft model /models/no-such-draft does not exist"
        );
    }

    #[test]
    fn checks_and_problems_serialize_for_state_and_notices() {
        let c = Check::Model {
            role: ModelRole::Draft,
            value: s("/m"),
            form: ModelForm::GgufFile,
            cwd: Cwd::Home,
            runs_as: user("qwen", None),
            sandbox: Sandbox::default(),
            verify: Verify::None,
        };
        let j = serde_json::to_value(&c).unwrap();
        assert_eq!(
            j,
            serde_json::json!({"check": "model", "role": "draft", "value": "/m", "form": "gguf_file", "cwd": "home", "runs_as": {"user": {"user": "qwen", "group": null}}})
        );
        assert_eq!(serde_json::from_value::<Check>(j).unwrap(), c);
        let p = Problem { check: CheckKind::DraftModel, message: s("m") };
        assert_eq!(serde_json::to_value(&p).unwrap(), serde_json::json!({"check": "draft_model", "message": "m"}));
        assert_eq!(CheckKind::DraftModel.as_str(), "draft_model");
    }

    #[test]
    fn the_search_path_is_this_host_s_systemd_s() {
        let Ok(out) = std::process::Command::new("systemd-path").arg("search-binaries-default").output() else {
            return;
        };
        // systemd 252 as Debian 12 builds it: the same; later ones: a part, in the same order.
        let theirs = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let mut ours = SEARCH_PATH.iter();
        for d in theirs.split(':') {
            assert!(ours.any(|o| *o == d), "{d} of {theirs} is not in {SEARCH_PATH:?} in this order");
        }
    }
}

/// The executor on real files, a real socket, real users and the real `systemd-analyze`.
#[cfg(test)]
mod look_tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn s(v: &str) -> String {
        v.to_string()
    }

    fn problem(m: impl Into<String>) -> Found {
        Found::Problem(m.into())
    }

    fn nobody() -> RunAs {
        RunAs::User { user: s("nobody"), group: None }
    }

    // The looks as specd sees its own view, for a unit without a sandbox.
    fn look_program(p: &Program, as_: &RunAs) -> Vec<Found> {
        super::look_program(&Sight::Own, p, as_, &Sandbox::default())
    }

    fn look_model(role: ModelRole, v: &str, form: ModelForm, cwd: &Cwd, as_: &RunAs) -> Vec<Found> {
        super::look_model(&Sight::Own, role, v, form, cwd, as_, &Sandbox::default())
    }

    fn look_environment_file(path: &str, optional: bool) -> Vec<Found> {
        super::look_environment_file(&Sight::Own, path, optional)
    }

    fn look_credential(id: &str, path: &str) -> Vec<Found> {
        super::look_credential(&Sight::Own, id, path)
    }

    fn look_working_directory(dir: &Cwd, optional: bool, as_: &RunAs) -> Vec<Found> {
        super::look_working_directory(&Sight::Own, dir, optional, as_, &Sandbox::default())
    }

    /// A temporary directory others may enter, as a model directory usually is.
    fn open_dir() -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        d
    }

    fn write(path: &Path, bytes: &[u8], mode: u32) -> String {
        std::fs::write(path, bytes).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
        path.display().to_string()
    }

    fn mkdir(path: &Path, mode: u32) -> String {
        std::fs::create_dir(path).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
        path.display().to_string()
    }

    /// The one problem found, which must start with `start`.
    #[track_caller]
    fn one_problem_starting(found: Vec<Found>, start: &str) -> String {
        match &found[..] {
            [Found::Problem(m)] if m.starts_with(start) => m.clone(),
            _ => panic!("expected one problem starting with {start:?}, got {found:?}"),
        }
    }

    fn resolve(body: &str) -> Spec {
        let yaml = format!("apiVersion: specd/v1\nkind: InferenceService\nmetadata: {{name: t}}\nspec:\n{body}");
        specd_spec::parse("t.yaml", &yaml).unwrap().resolve(None).unwrap()
    }

    #[test]
    fn a_program_that_is_missing_or_cannot_run_is_named() {
        let d = open_dir();
        let p = |n: &str| d.path().join(n);
        let tool = write(&p("tool"), b"\x7fELF", 0o755);
        let plain = write(&p("plain"), b"x", 0o644);
        let mine = write(&p("mine"), b"\x7fELF", 0o700);
        let script = write(&p("script"), b"#!/no/such/interp -u\nprint()\n", 0o755);
        let good_script = write(&p("good-script"), b"#!/bin/sh\nexit 0\n", 0o755);
        let unreadable_script = write(&p("unreadable-script"), b"#!/bin/sh\nexit 0\n", 0o711);
        std::os::unix::fs::symlink(p("nowhere"), p("dangling")).unwrap();
        let path = |v: &str| Program::Path(s(v));
        let look = |prog: Program, as_: &RunAs| look_program(&prog, as_);
        assert_eq!(
            look(path("/opt/nowhere/vllm"), &RunAs::Root),
            [problem("the program /opt/nowhere/vllm does not exist")]
        );
        assert_eq!(look(path(&tool), &RunAs::Root), []);
        assert_eq!(look(path(&tool), &nobody()), []);
        assert_eq!(look(path(&good_script), &nobody()), []);
        one_problem_starting(
            look(path(&plain), &RunAs::Root),
            &format!("the program {plain} is not executable (mode 0644, owner "),
        );
        assert_eq!(look(path(&mine), &RunAs::Root), []);
        one_problem_starting(
            look(path(&mine), &nobody()),
            &format!("user nobody cannot execute the program {mine} (mode 0700, owner "),
        );
        one_problem_starting(
            look(path(&unreadable_script), &nobody()),
            &format!("user nobody cannot read the script {unreadable_script} (mode 0711, owner "),
        );
        assert_eq!(
            look(path(&script), &RunAs::Root),
            [problem(format!("the program {script} is a script whose interpreter /no/such/interp does not exist"))]
        );
        let dir = d.path().display().to_string();
        assert_eq!(look(path(&dir), &RunAs::Root), [problem(format!("the program {dir} is a directory"))]);
        assert_eq!(
            look(path(&p("dangling").display().to_string()), &RunAs::Root),
            [problem(format!(
                "the program {} is a symbolic link to {}, which does not exist",
                p("dangling").display(),
                p("nowhere").display()
            ))]
        );
        assert_eq!(
            look(path("opt/vllm"), &RunAs::Root),
            [problem("the program opt/vllm is neither an absolute path nor a bare name: systemd refuses it")]
        );
        // Bare names, in systemd's search path or the unit's own; a file without an execute
        // bit is not found.
        let search =
            |name: &str, dirs: &[&str]| Program::Search { name: s(name), dirs: dirs.iter().map(|d| s(d)).collect() };
        assert_eq!(look(search("sh", &SEARCH_PATH), &RunAs::Root), []);
        assert_eq!(
            look(search("no-such-program-x", &SEARCH_PATH), &RunAs::Root),
            [problem(
                "the program no-such-program-x is not in systemd's search path (/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin): give its absolute path"
            )]
        );
        assert_eq!(look(search("tool", &[&dir]), &RunAs::Root), []);
        one_problem_starting(
            look(search("plain", &[&dir]), &RunAs::Root),
            "the program plain is not in systemd's search path",
        );
    }

    /// Whether the kernel runs `path` (exit status 0), as execve(2) does it, without a shell's
    /// fallback for a file it refuses.
    fn kernel_runs(path: &str) -> bool {
        std::process::Command::new(path)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    #[test]
    fn a_script_passes_where_the_kernel_runs_it_and_only_there() {
        let d = open_dir();
        let p = |n: &str| d.path().join(n);
        let long_arg = format!("#!/bin/sh -e{}\nexit 0\n", " ".repeat(300));
        let long_name = format!("#!/{}\nexit 0\n", "a".repeat(300));
        let mut cases: Vec<(String, Vec<u8>)> = [
            ("plain", "#!/bin/sh\nexit 0\n"),
            ("crlf", "#!/bin/sh\r\nexit 0\r\n"),
            ("blanks", "#! \t/bin/sh \t\nexit 0\n"),
            ("argument", "#!/bin/sh -e\nexit 0\n"),
            ("nothing", "#!\nexit 0\n"),
            ("only-blanks", "#! \t \nexit 0\n"),
            ("long-argument", &long_arg),
            ("long-name", &long_name),
            ("nul", "#!/bin/sh\0x\nexit 0\n"),
            ("just-the-mark", "#!"),
        ]
        .into_iter()
        .map(|(n, t)| (n.to_string(), t.as_bytes().to_vec()))
        .collect();
        // Scripts run by scripts: `chain-N` is N scripts, each the interpreter of the one before.
        for n in 1..=7 {
            for i in 0..n {
                let next =
                    if i + 1 == n { s("/bin/sh") } else { p(&format!("chain-{n}.{}", i + 1)).display().to_string() };
                write(&p(&format!("chain-{n}.{i}")), format!("#!{next}\nexit 0\n").as_bytes(), 0o755);
            }
            cases.push((format!("chain-{n}.0"), Vec::new()));
        }
        let mut ran = Vec::new();
        for (name, text) in &cases {
            if !text.is_empty() {
                write(&p(name), text, 0o755);
            }
            let path = p(name).display().to_string();
            let kernel = kernel_runs(&path);
            let looked = look_program(&Program::Path(path.clone()), &RunAs::Root);
            assert_eq!(looked.is_empty(), kernel, "{name}: the kernel runs it: {kernel}; the look: {looked:?}");
            if kernel {
                ran.push(name.as_str());
            }
        }
        // What this kernel did, for the record of what the look follows.
        assert_eq!(
            ran,
            [
                "plain",
                "blanks",
                "argument",
                "long-argument",
                "nul",
                "chain-1.0",
                "chain-2.0",
                "chain-3.0",
                "chain-4.0",
                "chain-5.0"
            ]
        );
        let chain = |n: usize, i: usize| p(&format!("chain-{n}.{i}")).display().to_string();
        let said: String = (1..6).map(|i| format!(" is a script whose interpreter {}", chain(6, i))).collect();
        assert_eq!(
            look_program(&Program::Path(chain(6, 0)), &RunAs::Root),
            [problem(format!(
                "the program {}{said} is a script too: the kernel follows at most 5 interpreters (ELOOP)",
                chain(6, 0)
            ))]
        );
        let crlf = p("crlf").display().to_string();
        assert_eq!(
            look_program(&Program::Path(crlf.clone()), &RunAs::Root),
            [problem(format!(
                "the program {crlf} is a script whose interpreter \"/bin/sh\\r\" does not exist: its first line ends in a carriage return (Windows line endings), which the kernel reads as part of the interpreter's name"
            ))]
        );
    }

    #[test]
    fn models_are_checked_in_their_engine_s_form() {
        let d = open_dir();
        let p = |n: &str| d.path().join(n);
        let hf = mkdir(&p("hf"), 0o755);
        write(&p("hf/config.json"), b"{}", 0o644);
        write(&p("hf/model.safetensors"), b"\x08\x00", 0o644);
        let bare = mkdir(&p("bare"), 0o755);
        let mistral = mkdir(&p("mistral"), 0o755);
        write(&p("mistral/params.json"), b"{}", 0o644);
        let gguf = write(&p("m.gguf"), b"GGUF\x03\x00\x00\x00", 0o644);
        let elf = write(&p("elf.gguf"), b"\x7fELF\x02", 0o644);
        let empty = write(&p("empty.gguf"), b"", 0o644);
        let text = write(&p("notes.txt"), b"hello", 0o644);
        let root = Cwd::Path(s("/"));
        let look = |role, v: &str, form, cwd: &Cwd| look_model(role, v, form, cwd, &RunAs::Root);
        use ModelForm::{FolderOrGguf, GgufFile};
        use ModelRole::{Draft, Model};
        assert_eq!(look(Model, &hf, FolderOrGguf, &root), []);
        assert_eq!(look(Model, &gguf, FolderOrGguf, &root), []);
        assert_eq!(look(Draft, &gguf, GgufFile, &root), []);
        assert_eq!(
            look(Draft, &bare, FolderOrGguf, &root),
            [problem(format!("the draft model {bare} has no config.json: not a Hugging Face model folder"))]
        );
        assert_eq!(
            look(Model, &mistral, FolderOrGguf, &root),
            [Found::Note(format!(
                "not checked: the model {mistral} has no config.json but a params.json (Mistral's format)"
            ))]
        );
        assert_eq!(
            look(Model, &hf, GgufFile, &root),
            [problem(format!("the model {hf} is a directory: llama-server loads one GGUF file"))]
        );
        assert_eq!(
            look(Model, &elf, GgufFile, &root),
            [problem(format!("the model {elf} is not a GGUF file (it starts with 0x7f454c46)"))]
        );
        assert_eq!(
            look(Model, &elf, FolderOrGguf, &root),
            [problem(format!(
                "the model {elf} is not a GGUF file nor a Hugging Face model folder (it starts with 0x7f454c46)"
            ))]
        );
        assert_eq!(
            look(Draft, &empty, GgufFile, &root),
            [problem(format!("the draft model {empty} is not a GGUF file (it is empty)"))]
        );
        assert_eq!(
            look(Model, &text, GgufFile, &root),
            [problem(format!("the model {text} is not a GGUF file (it starts with \"hell\")"))]
        );
        let gone = p("no-such-draft").display().to_string();
        assert_eq!(
            look(Draft, &gone, FolderOrGguf, &root),
            [problem(format!("the draft model {gone} does not exist"))]
        );
        // Not a path: a repo id the engine downloads, unless the working directory has it.
        assert_eq!(
            look(Model, "Qwen/Qwen3-8B", FolderOrGguf, &root),
            [Found::Note(s(
                "not checked: the model Qwen/Qwen3-8B is a Hugging Face repo id; the engine downloads it at start"
            ))]
        );
        assert_eq!(
            look(Model, "Qwen/Qwen3-8B", GgufFile, &root),
            [problem("the model Qwen/Qwen3-8B does not exist (looked for at /Qwen/Qwen3-8B)")]
        );
        assert_eq!(
            look(Model, "~/m.gguf", GgufFile, &root),
            [problem(
                "the model ~/m.gguf does not exist (looked for at /~/m.gguf; systemd does not expand ~ in a command line)"
            )]
        );
        let here = Cwd::Path(d.path().display().to_string());
        assert_eq!(look(Model, "hf", FolderOrGguf, &here), []);
        assert_eq!(
            look(Model, "bare", FolderOrGguf, &here),
            [problem(format!("the model {bare} has no config.json: not a Hugging Face model folder"))]
        );
    }

    #[test]
    fn files_the_engine_never_reads_do_not_refuse_a_model() {
        let d = open_dir();
        let p = |n: &str| d.path().join(n);
        let m = mkdir(&p("m"), 0o755);
        write(&p("m/config.json"), b"{}", 0o644);
        write(&p("m/model.safetensors"), b"x", 0o644);
        write(&p("m/tokenizer.json"), b"{}", 0o644);
        // Root's own README and training leftovers, a link to nothing among the notes.
        write(&p("m/README.md"), b"x", 0o600);
        write(&p("m/training_args.bin"), b"x", 0o600);
        std::os::unix::fs::symlink("../gone", p("m/notes.txt")).unwrap();
        let look = |as_: &RunAs| look_model(ModelRole::Model, &m, ModelForm::FolderOrGguf, &Cwd::Path(s("/")), as_);
        let got = look(&nobody());
        assert!(!got.iter().any(|f| matches!(f, Found::Problem(_))), "{got:?}");
        assert!(
            matches!(&got[..], [Found::Note(a), Found::Note(b)]
                if a.starts_with(&format!("user nobody cannot read README.md and 1 more in the model {m} (mode 0600, owner "))
                    && a.ends_with("; the engine does not read them")
                    && *b == format!("notes.txt in the model {m} is a symbolic link to nothing; the engine does not read it")),
            "{got:?}"
        );
        // What the engine does read still refuses it.
        write(&p("m/tokenizer.json"), b"{}", 0o600);
        std::os::unix::fs::symlink("../gone", p("m/model-00002.safetensors")).unwrap();
        let got = look(&nobody());
        let problems: Vec<&Found> = got.iter().filter(|f| matches!(f, Found::Problem(_))).collect();
        assert!(
            matches!(&problems[..], [Found::Problem(a), Found::Problem(b)]
                if a.starts_with(&format!("user nobody cannot read tokenizer.json in the model {m} (mode 0600, owner "))
                    && *b == format!("model-00002.safetensors in the model {m} is a symbolic link to nothing")),
            "{got:?}"
        );
    }

    /// A root directory standing for the host's (`/proc/1/root`), with `path` written under it.
    fn host_file(root: &Path, path: &str, bytes: &[u8]) {
        let at = root.join(path.trim_start_matches('/'));
        std::fs::create_dir_all(at.parent().unwrap()).unwrap();
        std::fs::write(at, bytes).unwrap();
    }

    #[test]
    fn files_are_looked_at_in_the_host_s_view_where_specd_s_own_differs() {
        let host = open_dir();
        let s_ = Sight::Through(host.path().to_path_buf());
        let none = Sandbox::default();
        // Only the host's /tmp and /var/tmp have them: not this process's.
        let (model, env) = ("/tmp/specd-preflight-host-only/m.gguf", "/var/tmp/specd-preflight-host-only/env");
        assert!(!Path::new(model).exists() && !Path::new(env).exists());
        host_file(host.path(), model, b"GGUF\x03\x00\x00\x00");
        host_file(host.path(), env, b"A=1\n");
        host_file(host.path(), "/srv/models/real.gguf", b"GGUF");
        std::os::unix::fs::symlink(
            "/srv/models/real.gguf",
            host.path().join("tmp/specd-preflight-host-only/link.gguf"),
        )
        .unwrap();
        let root = Cwd::Path(s("/"));
        let look =
            |v: &str| super::look_model(&s_, ModelRole::Model, v, ModelForm::GgufFile, &root, &RunAs::Root, &none);
        assert_eq!(look(model), []);
        // An absolute link leads within the host's root, not into specd's own /srv.
        assert_eq!(look("/tmp/specd-preflight-host-only/link.gguf"), []);
        assert_eq!(
            look("/tmp/specd-preflight-host-only/gone.gguf"),
            [problem("the model /tmp/specd-preflight-host-only/gone.gguf does not exist")]
        );
        assert_eq!(super::look_environment_file(&s_, env, false), []);
        assert_eq!(super::look_credential(&s_, "tok", env), []);
        // The same looks in specd's own view do not find them.
        let own =
            super::look_model(&Sight::Own, ModelRole::Model, model, ModelForm::GgufFile, &root, &RunAs::Root, &none);
        assert_eq!(own, [problem(format!("the model {model} does not exist"))]);
        // Where specd cannot look at the host's view, what it does not find there is a note.
        let blind = Sight::Blind {
            dirs: vec![PathBuf::from("/tmp"), PathBuf::from("/var/tmp")],
            why: s("/proc/1/root: Permission denied"),
        };
        let found = super::look_environment_file(&blind, env, false);
        assert_eq!(
            found,
            [Found::Note(format!(
                "not checked from here: specd's own view of /var/tmp differs from the unit's (specd runs in a mount namespace of its own: its unit's PrivateTmp=, ProtectHome= or the like), and it cannot look at the host's (/proc/1/root: Permission denied); in specd's own view, the environment file {env} does not exist"
            ))]
        );
        let elsewhere = super::look_model(
            &blind,
            ModelRole::Model,
            "/srv/nowhere.gguf",
            ModelForm::GgufFile,
            &root,
            &RunAs::Root,
            &none,
        );
        assert_eq!(elsewhere, [problem("the model /srv/nowhere.gguf does not exist")], "outside the dirs that differ");
    }

    #[test]
    fn what_the_unit_s_sandbox_hides_from_its_server_refuses_it() {
        let d = open_dir();
        let p = |n: &str| d.path().join(n).display().to_string();
        let tmp = mkdir(Path::new(&p("tmp")), 0o1777);
        let model = write(Path::new(&format!("{tmp}/m.gguf")), b"GGUF", 0o644);
        let link = p("models-link.gguf");
        std::os::unix::fs::symlink(&model, &link).unwrap();
        let setting = "PrivateTmp=yes (in /etc/systemd/system/service.d/tmp.conf)";
        let hidden = Sandbox { hidden: vec![Shadow { dir: tmp.clone(), setting: s(setting) }], elsewhere: vec![] };
        let root = Cwd::Path(s("/"));
        let look = |v: &str, sb: &Sandbox| {
            super::look_model(&Sight::Own, ModelRole::Model, v, ModelForm::GgufFile, &root, &RunAs::Root, sb)
        };
        assert_eq!(look(&model, &Sandbox::default()), []);
        let said = format!(
            "is under {tmp}, which the unit's {setting} hides from its server: the server would not find it there"
        );
        assert_eq!(look(&model, &hidden), [problem(format!("the model {model} {said}"))]);
        assert_eq!(look(&link, &hidden), [problem(format!("the model {link} (it leads to {model}) {said}"))]);
        // The program and its working directory too; not what systemd reads before the sandbox.
        let program = Program::Path(format!("{tmp}/server"));
        write(Path::new(&format!("{tmp}/server")), b"\x7fELF", 0o755);
        assert_eq!(
            super::look_program(&Sight::Own, &program, &RunAs::Root, &hidden),
            [problem(format!("the program {tmp}/server {said}"))]
        );
        let wd = super::look_working_directory(&Sight::Own, &Cwd::Path(tmp.clone()), false, &RunAs::Root, &hidden);
        assert_eq!(wd, [problem(format!("the working directory {tmp} {said}"))]);
        assert_eq!(super::look_environment_file(&Sight::Own, &model, false), []);
        // A script whose interpreter the sandbox hides.
        let script = write(Path::new(&p("script")), format!("#!{tmp}/server\n").as_bytes(), 0o755);
        assert_eq!(
            super::look_program(&Sight::Own, &Program::Path(script.clone()), &RunAs::Root, &hidden),
            [problem(format!("the program {script} is a script whose interpreter {tmp}/server {said}"))]
        );
        // Another file system shown there: not checked.
        let bound =
            Sandbox { hidden: vec![], elsewhere: vec![Shadow { dir: tmp.clone(), setting: s("BindPaths=/srv:/tmp") }] };
        assert_eq!(
            look(&format!("{tmp}/other.gguf"), &bound),
            [Found::Note(format!(
                "not checked: the model {tmp}/other.gguf is under {tmp}, where the unit's BindPaths=/srv:/tmp shows its server other files than the host's"
            ))],
            "what the host has at that path is not what the server finds"
        );
        assert_eq!(
            look(&model, &bound),
            [Found::Note(format!(
                "not checked: the model {model} is under {tmp}, where the unit's BindPaths=/srv:/tmp shows its server other files than the host's"
            ))]
        );
    }

    #[test]
    fn a_model_its_user_cannot_read_is_named() {
        let d = open_dir();
        let p = |n: &str| d.path().join(n);
        let private = mkdir(&p("private"), 0o700);
        write(&p("private/config.json"), b"{}", 0o644);
        let locked = mkdir(&p("locked"), 0o755);
        write(&p("locked/config.json"), b"{}", 0o644);
        write(&p("locked/model-00001.safetensors"), b"x", 0o600);
        write(&p("locked/model-00002.safetensors"), b"x", 0o600);
        let no_entry = mkdir(&p("no-entry"), 0o744);
        write(&p("no-entry/config.json"), b"{}", 0o644);
        let gated = mkdir(&p("gated"), 0o700);
        let inner = write(&p("gated/m.gguf"), b"GGUF", 0o644);
        let links = mkdir(&p("links"), 0o755);
        write(&p("links/config.json"), b"{}", 0o644);
        std::os::unix::fs::symlink("../blobs/gone", p("links/model.safetensors")).unwrap();
        let root = Cwd::Path(s("/"));
        let look = |v: &str, form, as_: &RunAs| look_model(ModelRole::Model, v, form, &root, as_);
        let folder = ModelForm::FolderOrGguf;
        for as_ in [nobody(), RunAs::Dynamic] {
            let who = if as_ == RunAs::Dynamic { "the unit's dynamic user" } else { "user nobody" };
            one_problem_starting(
                look(&private, folder, &as_),
                &format!("{who} cannot read the model {private} (mode 0700, owner "),
            );
            one_problem_starting(
                look(&locked, folder, &as_),
                &format!(
                    "{who} cannot read model-00001.safetensors and 1 more in the model {locked} (mode 0600, owner "
                ),
            );
            one_problem_starting(
                look(&no_entry, folder, &as_),
                &format!("{who} cannot enter the model {no_entry} (mode 0744, owner "),
            );
            let m = one_problem_starting(
                look(&inner, ModelForm::GgufFile, &as_),
                &format!("{who} cannot enter {gated} (mode 0700, owner "),
            );
            assert!(m.ends_with(&format!("), which holds the model {inner}")), "{m}");
        }
        // Root reads everything.
        for v in [&private, &locked, &no_entry] {
            assert_eq!(look(v, folder, &RunAs::Root), [], "{v}");
        }
        assert_eq!(
            look(&links, folder, &RunAs::Root),
            [problem(format!("model.safetensors in the model {links} is a symbolic link to nothing"))]
        );
    }

    #[test]
    fn systemd_reads_environment_files_and_credentials_as_root() {
        let d = open_dir();
        let p = |n: &str| d.path().join(n).display().to_string();
        let secret = write(&d.path().join("env"), b"HF_TOKEN=x\n", 0o600);
        let gone = p("gone");
        assert_eq!(look_environment_file(&secret, false), []);
        assert_eq!(look_environment_file(&gone, true), []);
        assert_eq!(
            look_environment_file(&gone, false),
            [problem(format!("the environment file {gone} does not exist"))]
        );
        let dir = p("");
        let dir = dir.trim_end_matches('/');
        assert_eq!(look_environment_file(dir, true), [problem(format!("the environment file {dir} is a directory"))]);
        // Root reads a file whatever its mode; specd not root can only say it could not.
        let shut = write(&d.path().join("shut"), b"A=1\n", 0o000);
        let got = look_environment_file(&shut, false);
        if nix::unistd::geteuid().is_root() {
            assert_eq!(got, []);
        } else {
            assert!(
                matches!(&got[..], [Found::Note(m)] if m.ends_with("(specd is not root; systemd reads it as root)")),
                "{got:?}"
            );
        }
        assert_eq!(look_credential("hf_token", &secret), []);
        assert_eq!(look_credential("keys", dir), [], "a directory of credentials");
        assert_eq!(
            look_credential("hf_token", &gone),
            [problem(format!("the credential hf_token's file {gone} does not exist"))]
        );
    }

    #[test]
    fn users_and_groups_must_exist() {
        for u in ["root", "nobody", "0"] {
            assert_eq!(look_user(u), [], "{u}");
        }
        assert_eq!(
            look_user("no-such-user-x"),
            [problem("the user no-such-user-x does not exist on this host (User=no-such-user-x)")]
        );
        assert_eq!(
            look_user("3999999999"),
            [problem("the user 3999999999 does not exist on this host (User=3999999999)")]
        );
        assert_eq!(look_group("root"), []);
        assert_eq!(
            look_group("no-such-group-x"),
            [problem("the group no-such-group-x does not exist on this host (Group=no-such-group-x)")]
        );
        assert!(matches!(who(&nobody()), Some(Who::Ids { uid: 65534, .. })));
        assert!(matches!(who(&RunAs::User { user: s("root"), group: None }), Some(Who::Root)));
        assert!(who(&RunAs::User { user: s("no-such-user-x"), group: None }).is_none());
        assert!(who(&RunAs::User { user: s("nobody"), group: Some(s("no-such-group-x")) }).is_none());
    }

    #[test]
    fn a_working_directory_must_exist_and_be_entered() {
        let d = open_dir();
        let gone = d.path().join("gone").display().to_string();
        let file = write(&d.path().join("file"), b"", 0o644);
        let closed = mkdir(&d.path().join("closed"), 0o700);
        let look = |dir: &str, optional, as_: &RunAs| look_working_directory(&Cwd::Path(s(dir)), optional, as_);
        assert_eq!(look(&gone, false, &RunAs::Root), [problem(format!("the working directory {gone} does not exist"))]);
        assert_eq!(
            look(&gone, true, &RunAs::Root),
            [Found::Note(format!(
                "the working directory {gone} does not exist (optional: the server starts without it)"
            ))]
        );
        assert_eq!(
            look(&file, false, &RunAs::Root),
            [problem(format!("the working directory {file} is not a directory"))]
        );
        assert_eq!(look(&closed, false, &RunAs::Root), []);
        one_problem_starting(
            look(&closed, false, &nobody()),
            &format!("user nobody cannot enter the working directory {closed} (mode 0700, owner "),
        );
        assert_eq!(look_working_directory(&Cwd::Home, false, &RunAs::Root), []);
        assert_eq!(
            look_working_directory(&Cwd::Home, false, &RunAs::User { user: s("no-such-user-x"), group: None }),
            []
        );
    }

    #[test]
    fn the_port_must_be_free_or_held_by_the_unit_s_own_instance() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let me = std::process::id();
        let m = one_problem_starting(
            look_port("x.service", "127.0.0.1", port, ""),
            &format!("port {port} is held by pid {me} ("),
        );
        assert!(m.ends_with(&format!("), which is not part of x.service (it listens on 127.0.0.1:{port})")), "{m}");
        let argv0 = std::env::args().next().unwrap();
        assert!(m.contains(&argv0), "{m} names the command line");
        assert_eq!(look_port("x.service", "0.0.0.0", port, "").len(), 1, "a wildcard takes the port too");
        assert_eq!(look_port("x.service", "127.0.0.2", port, ""), [], "another address");
        // The unit's own instance is about to be stopped.
        let own = cgroup_of(me).unwrap();
        assert_eq!(look_port("x.service", "127.0.0.1", port, &own), []);
        drop(l);
        // A process another test spawns holds a copy of the socket from its fork to its exec
        // (where close-on-exec drops it): the port is free once none does, within a bound.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let mut found = look_port("x.service", "127.0.0.1", port, "");
        while !found.is_empty() && std::time::Instant::now() < deadline {
            std::thread::yield_now();
            found = look_port("x.service", "127.0.0.1", port, "");
        }
        assert_eq!(found, []);
    }

    #[test]
    fn gpus_named_by_index_must_exist() {
        let d = open_dir();
        let dev = d.path().display().to_string();
        assert_eq!(
            look_gpus(&[0, 1], d.path()),
            [Found::Note(format!(
                "not checked: CUDA_VISIBLE_DEVICES names GPU 0,1, and this host shows no NVIDIA device ({dev}/nvidia0 …)"
            ))]
        );
        for n in ["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-caps"] {
            write(&d.path().join(n), b"", 0o666);
        }
        assert_eq!(look_gpus(&[0, 1], d.path()), []);
        assert_eq!(
            look_gpus(&[1, 2, 3], d.path()),
            [problem(format!(
                "CUDA_VISIBLE_DEVICES names GPU 2, 3, but this host has 2 NVIDIA GPUs ({dev}/nvidia0, {dev}/nvidia1)"
            ))]
        );
    }

    #[tokio::test]
    async fn systemd_analyze_verify_reads_the_unit_as_systemd_does() {
        let host = Machine::seeing(Sight::Own);
        let unit = "verify-me.service";
        let spec = resolve(&format!("  unit: {unit}\n  engine: vllm\n  command: [/bin/sh]\n  model: /models/m\n"));
        let text = specd_spec::render(&spec).text;
        assert_eq!(verify(unit, &text, &host).await, []);
        let bad = text.replace("Type=exec\n", "Type=exec\nBogusKey=1\n");
        let m = one_problem_starting(verify(unit, &bad, &host).await, &format!("systemd-analyze verify: {unit}:"));
        assert!(m.contains("BogusKey"), "{m}");
        let missing = text.replace("ExecStart=/bin/sh", "ExecStart=/opt/nowhere/vllm");
        assert_eq!(
            verify(unit, &missing, &host).await,
            [problem(format!(
                "systemd-analyze verify: {unit}: Command /opt/nowhere/vllm is not executable: No such file or directory"
            ))]
        );
    }

    #[tokio::test]
    async fn without_systemd_analyze_or_when_it_hangs_the_unit_is_not_checked() {
        let gone = Machine { analyze: vec![s("/no/such/systemd-analyze")], ..Machine::seeing(Sight::Own) };
        assert_eq!(
            verify("a.service", "", &gone).await,
            [Found::Note(s("not checked: /no/such/systemd-analyze is not installed"))]
        );
        let d = open_dir();
        let pid_file = d.path().join("pid");
        let hang = format!("echo $$ > {}; exec sleep 600", pid_file.display());
        let hung = Machine {
            analyze: vec![s("sh"), s("-c"), hang, s("sh")],
            verify_within: Duration::from_millis(300),
            ..Machine::seeing(Sight::Own)
        };
        assert_eq!(
            verify("a.service", "", &hung).await,
            [Found::Note(s("not checked: sh verify did not finish within 0.3 s"))]
        );
        // It was killed, not left behind.
        let pid: u32 = std::fs::read_to_string(&pid_file).unwrap().trim().parse().unwrap();
        let exit = crate::process::exited(pid, None).expect("a pidfd");
        tokio::time::timeout(Duration::from_secs(10), exit).await.expect("the hung verify was killed");
    }

    #[tokio::test]
    async fn a_spec_that_cannot_start_is_refused_before_any_stop() {
        let d = open_dir();
        let model = mkdir(&d.path().join("model"), 0o755);
        write(&d.path().join("model/config.json"), b"{}", 0o644);
        let draft = d.path().join("no-such-draft").display().to_string();
        // The port is held by the unit's old instance (this process, in the unit's cgroup).
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let own = cgroup_of(std::process::id()).unwrap();
        let spec = resolve(&format!(
            "  unit: vllm-llama.service\n  engine: vllm\n  command: [/opt/nowhere/vllm, serve]\n  model: {model}\n  server: {{port: {port}}}\n  speculative: {{algorithm: eagle, draft_model: {draft}, num_steps: 3}}\n"
        ));
        let out = run(&checks(&spec, &specd_spec::render(&spec).text, &[]), &own).await;
        let p = |check, m: &str| Problem { check, message: s(m) };
        assert_eq!(
            out.problems,
            [
                p(CheckKind::Program, "the program /opt/nowhere/vllm does not exist"),
                p(CheckKind::DraftModel, &format!("the draft model {draft} does not exist")),
                p(
                    CheckKind::UnitFile,
                    "systemd-analyze verify: vllm-llama.service: Command /opt/nowhere/vllm is not executable: No such file or directory"
                ),
            ]
        );
        assert_eq!(out.notes, []);
        assert!(!out.passed());
        assert_eq!(
            summary(&out.problems),
            format!(
                "the program /opt/nowhere/vllm does not exist; the draft model {draft} does not exist; systemd-analyze verify: vllm-llama.service: Command /opt/nowhere/vllm is not executable: No such file or directory"
            )
        );
        // The same with the program and the draft there, run by nobody: it passes, with
        // systemd's warning about that user as a note.
        let draft = mkdir(&d.path().join("draft"), 0o755);
        write(&d.path().join("draft/config.json"), b"{}", 0o644);
        let spec = resolve(&format!(
            "  unit: vllm-llama.service\n  engine: vllm\n  command: [/bin/sh, serve]\n  model: {model}\n  server: {{port: {port}}}\n  speculative: {{algorithm: eagle, draft_model: {draft}, num_steps: 3}}\n  service: {{user: nobody}}\n"
        ));
        let out = run(&checks(&spec, &specd_spec::render(&spec).text, &[]), &own).await;
        assert!(out.passed(), "{out:?}");
        assert!(
            matches!(&out.notes[..], [Note { check: CheckKind::UnitFile, message }] if message.contains("Special user nobody configured")),
            "{out:?}"
        );
        drop(l);
    }
}
