//! The git source: a local repository or a remote one (file://, git://, http(s)://, ssh) cloned
//! into the state dir. Specs are read from a commit's tree, never from a working tree, so an
//! uncommitted edit never deploys. Objects are read with libgit2; a remote is fetched by the `git`
//! command. Both block: callers run this on `spawn_blocking`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, anyhow, bail};
use git2::{Oid, Repository};
use specd_spec::fleet::{FILE_NAME as FLEET_FILE, RECORD_FILE};
use specd_spec::short;

/// Where a remote's record branch is fetched to in the cache (never a branch: nothing checks it
/// out, and the followed branch's `refs/remotes/origin/*` stay the followed branch's).
pub const RECORD_REF: &str = "refs/specd/record";

/// Which signatures a commit must carry to deploy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verify {
    /// SSH signatures checked with `ssh-keygen -Y verify` against an allowed-signers file.
    Ssh { allowed_signers: PathBuf },
    /// OpenPGP signatures checked with `gpg --verify` against a keyring.
    Gpg { keyring: PathBuf },
}

#[derive(Clone, Debug)]
pub struct SourceConfig {
    /// A local path, or a URL (file://, git://, http://, https://, ssh://, user@host:path).
    pub repo: String,
    /// The branch to follow (default `main`), unless `tag` is set.
    pub branch: String,
    pub tag: Option<String>,
    /// A spec file, or a directory of specs (`*.yaml`, one unit each), in the repository.
    pub path: String,
    pub token_file: Option<PathBuf>,
    pub ssh_key_file: Option<PathBuf>,
    pub verify: Option<Verify>,
    /// A PEM file of CA certificates trusted for an https:// remote, besides the system's.
    pub ca_file: Option<PathBuf>,
}

impl SourceConfig {
    /// Repository `repo` followed on branch `main`, its specs under `specs/`; no credentials, no
    /// signatures required.
    pub fn new(repo: &str) -> SourceConfig {
        SourceConfig {
            repo: repo.to_string(),
            branch: "main".into(),
            tag: None,
            path: "specs".into(),
            token_file: None,
            ssh_key_file: None,
            verify: None,
            ca_file: None,
        }
    }
}

pub struct GitSource {
    pub cfg: SourceConfig,
    repo: Repository,
    remote: bool,
    /// The record branch last fetched: asked about with the followed ref at the next poll's one
    /// look at the remote ([`fetch`](Self::fetch)).
    record_branch: std::sync::Mutex<Option<String>>,
    /// What that look found, until the record's fetch uses it: the refs asked about, and where
    /// those the remote has point.
    advertised: std::sync::Mutex<Option<Advertised>>,
}

/// A look at the remote's refs: the refs asked about, and where those it has point.
type Advertised = (Vec<String>, BTreeMap<String, Oid>);

/// One spec file of a commit.
#[derive(Clone, Debug)]
pub struct SpecFile {
    /// Path in the repository, e.g. `specs/qwen.yaml`.
    pub path: String,
    pub text: String,
}

/// A `ca_file` is read and looks like PEM certificates: a missing or unreadable file is named
/// when the agent starts, not at its first fetch in a TLS library's words.
fn check_ca_file(file: &Path) -> Result<()> {
    let pem = std::fs::read(file).with_context(|| format!("ca_file: reading {}", file.display()))?;
    if !pem.windows(27).any(|w| w == b"-----BEGIN CERTIFICATE-----") {
        bail!("ca_file: {} holds no PEM certificate (-----BEGIN CERTIFICATE-----)", file.display());
    }
    Ok(())
}

/// The longest a fetch may take.
pub const FETCH_WITHIN: std::time::Duration = std::time::Duration::from_secs(600);

/// The URL git fetches: an `ssh://` URL without a user logs in as `git` (as every git host
/// expects, and as specd did with libgit2), not as the agent's own user.
fn fetch_url(url: &str) -> String {
    match url.strip_prefix("ssh://") {
        Some(rest) if !rest.split('/').next().unwrap_or_default().contains('@') => format!("ssh://git@{rest}"),
        _ => url.to_string(),
    }
}

/// An `ssh_key_file` that ssh would refuse (readable by others) is named when the agent starts.
fn check_ssh_key(file: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(file)
        .with_context(|| format!("ssh_key_file: reading {}", file.display()))?
        .permissions()
        .mode();
    if mode & 0o077 != 0 {
        bail!(
            "ssh_key_file: {} is readable by others (mode {:o}), and ssh refuses such a key: chmod 600 it",
            file.display(),
            mode & 0o777
        );
    }
    Ok(())
}

/// The credential helper git runs when a remote asks for a password: the token of
/// `$SPECD_TOKEN_FILE`, read at that moment (white space dropped, as a trailing newline), as the
/// password of the URL's user (or `x-access-token`). Only for `get`, so nothing is ever stored.
/// It answers only for the remote's own host (`$SPECD_TOKEN_HOST`): a server that redirects
/// elsewhere gets no token.
const TOKEN_HELPER: &str = r#"!f() { test "$1" = get || return 0; u=x-access-token; h=; while read -r l; do case "$l" in username=?*) u=${l#username=};; host=*) h=${l#host=};; esac; done; test "$h" = "$SPECD_TOKEN_HOST" || return 0; printf 'username=%s\n' "$u"; printf 'password=%s\n' "$(tr -d '[:space:]' <"$SPECD_TOKEN_FILE")"; }; f"#;

/// The `host=` git's credential protocol names for `url`: the host, and the port when the URL
/// has one (`127.0.0.1:8443`).
fn credential_host(url: &str) -> Option<String> {
    let u = reqwest::Url::parse(url).ok()?;
    let host = u.host_str()?;
    Some(match u.port() {
        Some(p) => format!("{host}:{p}"),
        None => host.to_string(),
    })
}

pub fn is_remote(repo: &str) -> bool {
    repo.contains("://") || (repo.contains('@') && repo.contains(':') && !repo.starts_with('/'))
}

impl GitSource {
    /// Open the repository; a remote one is cloned (bare) into `cache` on first use.
    pub fn open(cfg: SourceConfig, cache: &Path) -> Result<GitSource> {
        let remote = is_remote(&cfg.repo);
        if let Some(ca) = &cfg.ca_file {
            check_ca_file(ca)?;
        }
        if let Some(k) = &cfg.ssh_key_file {
            check_ssh_key(k)?;
        }
        let repo = if remote {
            match Repository::open_bare(cache) {
                Ok(r) => r,
                Err(_) => {
                    std::fs::create_dir_all(cache).with_context(|| format!("creating {}", cache.display()))?;
                    let r =
                        Repository::init_bare(cache).with_context(|| format!("initializing {}", cache.display()))?;
                    r.remote("origin", &cfg.repo)?;
                    r
                }
            }
        } else {
            Repository::open(&cfg.repo).with_context(|| format!("opening the git repository {}", cfg.repo))?
        };
        // No fetch here: an unreachable remote is an error of the next read (reported in status,
        // retried at the next poll), not a reason for the agent to fail to start.
        Ok(GitSource { cfg, repo, remote, record_branch: Default::default(), advertised: Default::default() })
    }

    pub fn is_remote(&self) -> bool {
        self.remote
    }

    fn refspec(&self) -> (String, String) {
        match &self.cfg.tag {
            Some(t) => (format!("+refs/tags/{t}:refs/tags/{t}"), format!("refs/tags/{t}")),
            None => (
                format!("+refs/heads/{b}:refs/remotes/origin/{b}", b = self.cfg.branch),
                format!("refs/remotes/origin/{}", self.cfg.branch),
            ),
        }
    }

    /// The `git` command for a transfer with the remote (a fetch, a push), ready for its
    /// subcommand: [`fetch`](Self::fetch) says what it guarantees.
    pub(crate) fn transfer(&self) -> Result<Command> {
        let mut cmd = Command::new("timeout");
        // The whole process group (git and its transport) is killed at the deadline.
        cmd.args(["--kill-after=10s", &format!("{}s", FETCH_WITHIN.as_secs()), "git"]);
        for (k, _) in std::env::vars_os() {
            if k.to_string_lossy().starts_with("GIT_") {
                cmd.env_remove(k);
            }
        }
        let mut config: Vec<(&str, String)> = vec![
            ("http.lowSpeedLimit", "1000".into()),
            ("http.lowSpeedTime", "60".into()),
            ("core.askPass", String::new()),
            ("gc.auto", "0".into()),
            ("maintenance.auto", "false".into()),
        ];
        if let Some(ca) = &self.cfg.ca_file {
            // Besides the system's CAs (curl reads both the file and the directory).
            config.push(("http.sslCAInfo", ca.display().to_string()));
            config.push(("http.sslCAPath", "/etc/ssl/certs".into()));
        }
        if let Some(t) = &self.cfg.token_file {
            std::fs::File::open(t).with_context(|| format!("reading the token file {}", t.display()))?;
            // An empty value first: no helper of the user's configuration is asked.
            config.push(("credential.helper", String::new()));
            config.push(("credential.helper", TOKEN_HELPER.into()));
            cmd.env("SPECD_TOKEN_FILE", t).env("SPECD_TOKEN_HOST", credential_host(&self.cfg.repo).unwrap_or_default());
        }
        let mut ssh = String::from(
            "ssh -o BatchMode=yes -o ConnectTimeout=30 -o ServerAliveInterval=15 -o ServerAliveCountMax=4",
        );
        if let Some(k) = &self.cfg.ssh_key_file {
            ssh.push_str(r#" -o IdentitiesOnly=yes -i "$SPECD_SSH_KEY""#);
            cmd.env("SPECD_SSH_KEY", k);
        }
        // None of these values is a secret (the helper names a variable, not the token).
        for (k, v) in &config {
            cmd.arg("-c").arg(format!("{k}={v}"));
        }
        cmd.env("GIT_SSH_COMMAND", ssh)
            .env("GIT_TERMINAL_PROMPT", "0")
            .env("LC_ALL", "C")
            .env_remove("SSH_ASKPASS")
            .arg("--git-dir")
            .arg(self.repo.path())
            .stdin(Stdio::null());
        Ok(cmd)
    }

    /// Run a [`transfer`](Self::transfer); `what` (`fetching branch main from <url>`) names it
    /// when it outlived its deadline or was killed. Otherwise git's output, success or not.
    pub(crate) fn run_transfer(&self, mut cmd: Command, what: &str) -> Result<std::process::Output> {
        let out = cmd.output().context("running git (are git and timeout installed?)")?;
        match out.status.code() {
            Some(124) => bail!("{what}: not done within {} s (stopped)", FETCH_WITHIN.as_secs()),
            Some(137) | None => {
                bail!("{what}: git was killed (at the {} s deadline, or by a signal)", FETCH_WITHIN.as_secs())
            }
            Some(_) => Ok(out),
        }
    }

    /// The URL a transfer names.
    pub(crate) fn url(&self) -> String {
        fetch_url(&self.cfg.repo)
    }

    /// The libgit2 repository: the local one, or the remote's cache.
    pub(crate) fn repository(&self) -> &Repository {
        &self.repo
    }

    /// Fetch the followed ref from the remote (no-op for a local repository), with the `git`
    /// command: its transports use the system's TLS and SSH setup (the CA store, `known_hosts`,
    /// `~/.ssh/config`), and specd links no TLS or SSH library of its own for git.
    /// - Nothing asks a person for anything, and a fetch ends within [`FETCH_WITHIN`] (then it
    ///   is killed, with its ssh or https helper); a stalled https transfer ends sooner (under
    ///   1 KB/s for 60 s), as does an ssh server that stopped answering (60 s).
    /// - The token and the key are given by file name through the environment, never on a
    ///   command line; the environment's own `GIT_*` variables and the user's askpass are not
    ///   passed on, and no gc or maintenance runs in the cache behind the fetch.
    /// - A poll first looks at the remote's refs (one `git ls-remote` of the followed ref and the
    ///   record branch last fetched) and fetches only a ref that moved: N agents polling put one
    ///   request each on the remote per poll while nothing changes.
    pub fn fetch(&self) -> Result<()> {
        if !self.remote {
            return Ok(());
        }
        let (spec, local) = self.refspec();
        let what = format!("fetching {} from {}", self.followed(), self.cfg.repo);
        let followed = spec.trim_start_matches('+').split(':').next().unwrap_or_default().to_string();
        let mut asked = vec![followed.clone()];
        asked.extend(crate::core::guard::lock(&self.record_branch).iter().map(|b| format!("refs/heads/{b}")));
        let seen = self.ls_remote(&asked, &what)?;
        let unmoved = seen.get(&followed).is_some_and(|o| self.repo.refname_to_id(&local).ok() == Some(*o));
        *crate::core::guard::lock(&self.advertised) = Some((asked, seen));
        if unmoved {
            return Ok(());
        }
        let mut cmd = self.transfer()?;
        cmd.args(["fetch", "--quiet", "--no-tags", "--", &self.url(), &spec]);
        let out = self.run_transfer(cmd, &what)?;
        if !out.status.success() {
            bail!("{what}: {}", git_words(&out.stderr));
        }
        Ok(())
    }

    /// Where the remote's `refs` point (those it has), by one `git ls-remote`.
    fn ls_remote(&self, refs: &[String], what: &str) -> Result<BTreeMap<String, Oid>> {
        let mut cmd = self.transfer()?;
        cmd.args(["ls-remote", "--", &self.url()]).args(refs);
        let out = self.run_transfer(cmd, what)?;
        if !out.status.success() {
            bail!("{what}: {}", git_words(&out.stderr));
        }
        let text = String::from_utf8_lossy(&out.stdout);
        Ok(text
            .lines()
            .filter_map(|l| l.split_once('\t'))
            .filter(|(_, name)| refs.iter().any(|r| r == name))
            .filter_map(|(oid, name)| Some((name.to_string(), Oid::from_str(oid).ok()?)))
            .collect())
    }

    /// The head of the promotion record's branch (`None` while it does not exist). Right after
    /// [`fetch`](Self::fetch) (the same poll), as that fetch's look at the remote found it:
    /// fetched only if it moved. A remote's
    /// is fetched into [`RECORD_REF`] of the cache (forced: whether the record may move that
    /// way is the reader's decision, with [`descends_from`](Self::descends_from)); a branch
    /// the remote does not have (any more) is `None`, not an error. A local repository's
    /// branch is read as it is.
    pub fn fetch_record(&self, branch: &str) -> Result<Option<Oid>> {
        let name = format!("refs/heads/{branch}");
        if !git2::Reference::is_valid_name(&name) {
            bail!("the record branch {branch:?} is not a usable branch name");
        }
        if !self.remote {
            return self.commit_of(&name);
        }
        *crate::core::guard::lock(&self.record_branch) = Some(branch.to_string());
        // The poll's look at the remote asked about this branch: fetched only if it moved.
        if let Some((asked, seen)) = crate::core::guard::lock(&self.advertised).take()
            && asked.contains(&name)
        {
            match seen.get(&name) {
                None => return self.record_gone(),
                Some(o) if self.repo.refname_to_id(RECORD_REF).ok() == Some(*o) => return Ok(Some(*o)),
                Some(_) => {}
            }
        }
        let what = format!("fetching the record branch {branch} from {}", self.cfg.repo);
        let mut cmd = self.transfer()?;
        cmd.args(["fetch", "--quiet", "--no-tags", "--", &self.url(), &format!("+{name}:{RECORD_REF}")]);
        let out = self.run_transfer(cmd, &what)?;
        if !out.status.success() {
            let why = git_words(&out.stderr);
            // git's words (LC_ALL=C) for a ref the remote does not have.
            if why.contains(&format!("couldn't find remote ref {name}")) {
                return self.record_gone();
            }
            bail!("{what}: {why}");
        }
        self.commit_of(RECORD_REF)
    }

    /// The remote has no record branch (any more): its copy goes too.
    fn record_gone(&self) -> Result<Option<Oid>> {
        if let Ok(mut r) = self.repo.find_reference(RECORD_REF) {
            r.delete().with_context(|| format!("deleting {RECORD_REF} in {}", self.repo.path().display()))?;
        }
        Ok(None)
    }

    /// The commit a ref points at, `None` when there is no such ref.
    fn commit_of(&self, name: &str) -> Result<Option<Oid>> {
        match self.repo.find_reference(name) {
            Ok(r) => Ok(Some(r.peel_to_commit().with_context(|| format!("{name} does not point at a commit"))?.id())),
            Err(e) if e.code() == git2::ErrorCode::NotFound => Ok(None),
            Err(e) => Err(e).with_context(|| format!("reading {name} in {}", self.cfg.repo)),
        }
    }

    /// The promotion record ([`RECORD_FILE`]) of a commit of the record branch.
    pub fn read_record(&self, oid: Oid) -> Result<String> {
        let commit = short(&oid.to_string()).to_string();
        let c = self
            .repo
            .find_commit(oid)
            .with_context(|| format!("the record's commit {commit} is not in {}", self.cfg.repo))?;
        let tree = c.tree()?;
        let entry = tree
            .get_path(Path::new(RECORD_FILE))
            .map_err(|_| anyhow!("{RECORD_FILE} does not exist in commit {commit} of the record branch"))?;
        let obj = entry.to_object(&self.repo)?;
        let Some(blob) = obj.as_blob() else {
            bail!("{RECORD_FILE}@{commit}: is not a file");
        };
        refuse_link(RECORD_FILE, &commit, Some(entry.filemode()), blob.content())?;
        text_of(RECORD_FILE, blob.content())
    }

    /// The fleet file of a commit: [`FLEET_FILE`] in the directory of the specs (`path` itself
    /// when it is a directory, the repository's root when it is empty or `.`, the spec file's
    /// directory when it is a file). `None` when there is none. Refused as a spec is when it is
    /// a symbolic link or not UTF-8, and when its kind is not `Fleet`.
    pub fn fleet_file(&self, oid: Oid) -> Result<Option<SpecFile>> {
        let tree = self.repo.find_commit(oid)?.tree()?;
        let commit = short(&oid.to_string()).to_string();
        let path = self.cfg.path.trim_matches('/');
        let dir = if path.is_empty() || path == "." {
            ""
        } else {
            let e = tree.get_path(Path::new(path)).map_err(|_| anyhow!("{path} does not exist in commit {commit}"))?;
            match e.kind() {
                Some(git2::ObjectType::Tree) => path,
                _ => path.rsplit_once('/').map_or("", |(d, _)| d),
            }
        };
        let file = if dir.is_empty() { FLEET_FILE.to_string() } else { format!("{dir}/{FLEET_FILE}") };
        let entry = match tree.get_path(Path::new(&file)) {
            Ok(e) => e,
            Err(e) if e.code() == git2::ErrorCode::NotFound => return Ok(None),
            Err(e) => return Err(e).with_context(|| format!("reading {file} in commit {commit}")),
        };
        let obj = entry.to_object(&self.repo)?;
        let Some(blob) = obj.as_blob() else {
            bail!("{file}@{commit}: is a directory, not a fleet file");
        };
        refuse_link(&file, &commit, Some(entry.filemode()), blob.content())?;
        let text = text_of(&file, blob.content())?;
        if !specd_spec::fleet::is_fleet(&text) {
            let kind = specd_spec::kind_of(&text).unwrap_or_else(|| "none".into());
            bail!(
                "{file}@{commit}: a file named {FLEET_FILE} beside the specs is the fleet file, and its kind is {kind}, not Fleet"
            );
        }
        Ok(Some(SpecFile { path: file, text }))
    }

    /// What is followed, for messages: `branch main` / `tag v1`.
    pub fn followed(&self) -> String {
        match &self.cfg.tag {
            Some(t) => format!("tag {t}"),
            None => format!("branch {}", self.cfg.branch),
        }
    }

    /// The commit the followed ref points at now.
    pub fn head(&self) -> Result<Oid> {
        let name = if self.remote {
            self.refspec().1
        } else {
            match &self.cfg.tag {
                Some(t) => format!("refs/tags/{t}"),
                None => format!("refs/heads/{}", self.cfg.branch),
            }
        };
        let r = self
            .repo
            .find_reference(&name)
            .with_context(|| format!("{} not found in {}", self.followed(), self.cfg.repo))?;
        let c = r.peel_to_commit().with_context(|| format!("{name} does not point at a commit"))?;
        Ok(c.id())
    }

    /// The spec files of a commit: `path` itself if it is a file, else the `*.yaml`/`*.yml`
    /// files directly in that directory, sorted (sweep documents, `kind: Sweep`, left out).
    pub fn read_specs(&self, oid: Oid) -> Result<Vec<SpecFile>> {
        let commit = self.repo.find_commit(oid)?;
        let tree = commit.tree()?;
        let path = self.cfg.path.trim_matches('/');
        let commit = short(&oid.to_string()).to_string();
        let (entry_obj, mode) = if path.is_empty() || path == "." {
            (tree.as_object().clone(), None)
        } else {
            let e = tree.get_path(Path::new(path)).map_err(|_| anyhow!("{path} does not exist in commit {commit}"))?;
            (e.to_object(&self.repo)?, Some(e.filemode()))
        };
        let mut out = Vec::new();
        if let Some(blob) = entry_obj.as_blob() {
            refuse_link(path, &commit, mode, blob.content())?;
            out.push(SpecFile { path: path.to_string(), text: text_of(path, blob.content())? });
        } else if let Some(dir) = entry_obj.as_tree() {
            for e in dir.iter() {
                let name = e.name().unwrap_or_default().to_string();
                if !(name.ends_with(".yaml") || name.ends_with(".yml")) {
                    continue;
                }
                let obj = e.to_object(&self.repo)?;
                if let Some(blob) = obj.as_blob() {
                    let p = if path.is_empty() || path == "." { name.clone() } else { format!("{path}/{name}") };
                    refuse_link(&p, &commit, Some(e.filemode()), blob.content())?;
                    let text = text_of(&p, blob.content())?;
                    // A sweep kept beside the specs is an operator's campaign (`specd sweep`),
                    // and a fleet file the rollout's plan: neither is a unit to deploy.
                    if specd_spec::sweep::is_sweep(&text) || specd_spec::fleet::is_fleet(&text) {
                        continue;
                    }
                    out.push(SpecFile { text, path: p });
                }
            }
            out.sort_by(|a, b| a.path.cmp(&b.path));
        } else {
            bail!("{path} is neither a file nor a directory in commit {commit}");
        }
        Ok(out)
    }

    /// `new` has `old` in its history (or is `old`).
    pub fn descends_from(&self, new: Oid, old: Oid) -> Result<bool> {
        Ok(new == old || self.repo.graph_descendant_of(new, old)?)
    }

    pub fn has_commit(&self, oid: Oid) -> bool {
        self.repo.find_commit(oid).is_ok()
    }

    /// Check the commit's signature against the configured signers. `Ok(None)` when no
    /// verification is configured, `Ok(Some(signer))` when it verifies.
    pub fn verify(&self, oid: Oid) -> Result<Option<String>> {
        let Some(v) = &self.cfg.verify else {
            return Ok(None);
        };
        let (sig, data) = self
            .repo
            .extract_signature(&oid, None)
            .map_err(|_| anyhow!("commit {} is not signed", short(&oid.to_string())))?;
        let sig = sig.as_str().unwrap_or_default().to_string();
        let dir = tempfile::tempdir()?;
        let sig_path = dir.path().join("commit.sig");
        let data_path = dir.path().join("commit.data");
        std::fs::write(&sig_path, &sig)?;
        std::fs::write(&data_path, &*data)?;
        match v {
            Verify::Ssh { allowed_signers } => {
                if !sig.starts_with("-----BEGIN SSH SIGNATURE-----") {
                    bail!("commit {} is not signed with an SSH key", short(&oid.to_string()));
                }
                let find = Command::new("ssh-keygen")
                    .args(["-Y", "find-principals", "-s"])
                    .arg(&sig_path)
                    .arg("-f")
                    .arg(allowed_signers)
                    .output()
                    .context("running ssh-keygen")?;
                let principal =
                    String::from_utf8_lossy(&find.stdout).lines().next().unwrap_or_default().trim().to_string();
                if !find.status.success() || principal.is_empty() {
                    bail!(
                        "commit {} is signed by a key that is not in {}",
                        short(&oid.to_string()),
                        allowed_signers.display()
                    );
                }
                let data_file = std::fs::File::open(&data_path)?;
                let out = Command::new("ssh-keygen")
                    .args(["-Y", "verify", "-n", "git", "-f"])
                    .arg(allowed_signers)
                    .arg("-I")
                    .arg(&principal)
                    .arg("-s")
                    .arg(&sig_path)
                    .stdin(Stdio::from(data_file))
                    .output()
                    .context("running ssh-keygen")?;
                if !out.status.success() {
                    bail!(
                        "the SSH signature of commit {} does not verify: {}",
                        short(&oid.to_string()),
                        String::from_utf8_lossy(&out.stderr).trim()
                    );
                }
                Ok(Some(principal))
            }
            Verify::Gpg { keyring } => {
                if !sig.starts_with("-----BEGIN PGP SIGNATURE-----") {
                    bail!("commit {} is not signed with an OpenPGP key", short(&oid.to_string()));
                }
                let home = tempfile::tempdir()?;
                let out = Command::new("gpg")
                    .arg("--homedir")
                    .arg(home.path())
                    .args(["--batch", "--no-default-keyring", "--keyring"])
                    .arg(std::path::absolute(keyring)?)
                    .args(["--status-fd", "1", "--verify"])
                    .arg(&sig_path)
                    .arg(&data_path)
                    .output()
                    .context("running gpg")?;
                let status = String::from_utf8_lossy(&out.stdout);
                let good = status.lines().find(|l| l.starts_with("[GNUPG:] VALIDSIG "));
                match good {
                    Some(l) if out.status.success() => {
                        Ok(Some(l.split_whitespace().nth(2).unwrap_or_default().to_string()))
                    }
                    _ => bail!(
                        "the OpenPGP signature of commit {} does not verify against {}: {}",
                        short(&oid.to_string()),
                        keyring.display(),
                        String::from_utf8_lossy(&out.stderr).trim()
                    ),
                }
            }
        }
    }

    /// Files whose change means the followed ref may have moved (a local repository's refs).
    pub fn watch_paths(&self) -> Vec<PathBuf> {
        if self.remote {
            return vec![];
        }
        // The common directory: a worktree's branches are there, not in its own git dir.
        let git = self.repo.commondir().to_path_buf();
        vec![git.join("refs"), git.join("packed-refs"), git.clone()]
    }
}

/// git keeps a symbolic link as a blob whose content is the link's target (mode 120000): read as
/// a spec, it would be a YAML scalar (`../../etc/x.yaml`), refused for a reason that is not the
/// real one. specd reads only regular files from the repository.
fn refuse_link(path: &str, commit: &str, mode: Option<i32>, content: &[u8]) -> Result<()> {
    const LINK: i32 = 0o120000;
    if mode == Some(LINK) {
        let target = String::from_utf8_lossy(content).escape_debug().to_string();
        bail!("{path}@{commit}: {}", crate::source::spec_files::link_refusal(&target));
    }
    Ok(())
}

/// git's message on stderr as one line (`a; b`), for an error.
pub(crate) fn git_words(stderr: &[u8]) -> String {
    let why = String::from_utf8_lossy(stderr);
    why.lines().map(str::trim).filter(|l| !l.is_empty()).collect::<Vec<_>>().join("; ")
}

fn text_of(path: &str, bytes: &[u8]) -> Result<String> {
    String::from_utf8(bytes.to_vec()).map_err(|_| anyhow!("{path} is not UTF-8 text"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The helper as git runs it (`sh -c '<helper> get'`, the request on stdin).
    fn ask_helper(token_file: &Path, remote_host: &str, request: &str) -> String {
        let out = Command::new("sh")
            .arg("-c")
            .arg(format!("{} get", &TOKEN_HELPER[1..]))
            .env("SPECD_TOKEN_FILE", token_file)
            .env("SPECD_TOKEN_HOST", remote_host)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .and_then(|mut c| {
                use std::io::Write;
                c.stdin.take().unwrap().write_all(request.as_bytes())?;
                c.wait_with_output()
            })
            .unwrap();
        assert!(out.status.success());
        String::from_utf8(out.stdout).unwrap()
    }

    #[test]
    fn the_token_goes_to_the_remote_s_host_only() {
        let dir = tempfile::tempdir().unwrap();
        let t = dir.path().join("token");
        std::fs::write(&t, "s3cr3t \r\n").unwrap();
        let host = credential_host("https://git.example.com:8443/infra/c.git").unwrap();
        assert_eq!(host, "git.example.com:8443");
        assert_eq!(credential_host("https://git.example.com/c.git").unwrap(), "git.example.com");
        let asked = |h: &str, user: &str| ask_helper(&t, &host, &format!("protocol=https\nhost={h}\n{user}\n"));
        assert_eq!(asked("git.example.com:8443", ""), "username=x-access-token\npassword=s3cr3t\n");
        assert_eq!(asked("git.example.com:8443", "username=ops"), "username=ops\npassword=s3cr3t\n");
        assert_eq!(asked("elsewhere.example.com", ""), "", "a redirect to another host gets nothing");
        assert_eq!(asked("git.example.com", ""), "", "another port is another server");
    }

    #[test]
    fn an_ssh_url_without_a_user_logs_in_as_git() {
        assert_eq!(fetch_url("ssh://git.example.com/infra/c.git"), "ssh://git@git.example.com/infra/c.git");
        assert_eq!(fetch_url("ssh://ops@git.example.com:2222/c.git"), "ssh://ops@git.example.com:2222/c.git");
        assert_eq!(fetch_url("git@git.example.com:infra/c.git"), "git@git.example.com:infra/c.git");
        assert_eq!(fetch_url("https://git.example.com/a@b.git"), "https://git.example.com/a@b.git");
    }

    #[test]
    fn an_ssh_key_others_can_read_is_named() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let k = dir.path().join("id");
        std::fs::write(&k, "key").unwrap();
        std::fs::set_permissions(&k, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = format!("{:#}", check_ssh_key(&k).unwrap_err());
        assert!(e.contains("is readable by others (mode 644)") && e.contains("chmod 600"), "{e}");
        std::fs::set_permissions(&k, std::fs::Permissions::from_mode(0o600)).unwrap();
        check_ssh_key(&k).unwrap();
    }

    #[test]
    fn a_ca_file_that_is_missing_or_not_pem_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("ca.pem");
        let e = format!("{:#}", check_ca_file(&missing).unwrap_err());
        assert!(e.starts_with(&format!("ca_file: reading {}", missing.display())), "{e}");
        std::fs::write(&missing, "not a certificate\n").unwrap();
        let e = format!("{:#}", check_ca_file(&missing).unwrap_err());
        assert!(e.contains("holds no PEM certificate"), "{e}");
    }
}
