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

use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use specd_spec::{Spec, Verify};

mod checks;
mod files;
mod look;
mod port;
mod program;
mod sight;
mod verify;
mod weights;
pub use checks::checks;
use look::{Machine, run_on};
use sight::Sight;

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

// ---------------------------------------------------------------------------------------------
// The executor: looking on this machine.

/// Carry `checks` out on this machine. `own_cgroup` is the unit's control group (systemd's
/// `ControlGroup`; empty when no instance runs): a process in it that holds the port is the
/// instance about to be stopped, not a conflict. (The commands look through [`on_this_host`];
/// the benchmarks time this.)
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

#[cfg(test)]
mod tests;

#[cfg(test)]
mod look_tests;
