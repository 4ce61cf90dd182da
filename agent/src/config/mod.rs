//! The agent's configuration: `/etc/specd/agent.yaml`; command-line flags override it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use serde::Deserialize;

use crate::source::git::{SourceConfig, Verify};

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    /// A local path or URL of the config repository.
    pub repo: Option<String>,
    /// Branch to follow (default `main`).
    pub branch: Option<String>,
    /// Follow a tag instead of a branch.
    pub tag: Option<String>,
    /// A spec file or a directory of specs in the repository (default: the repository root).
    pub path: Option<String>,
    /// Seconds between polls of a remote repository (jittered). Default 60.
    pub interval: Option<u64>,
    /// Seconds between full looks at every unit. Default: 300 for a remote repository; none for a
    /// local one (its refs, the unit files and systemd's unit changes are all watched).
    pub resync: Option<u64>,
    pub state_dir: Option<PathBuf>,
    pub unit_dir: Option<PathBuf>,
    /// Hostname for host overlays (default: this machine's).
    pub hostname: Option<String>,
    /// What this host is, as `name: value` pairs (`gpu: h100`, `zone: eu-1`): a fleet file's
    /// waves select hosts by them, and the agent serves them on `specd_host_info`. Names are
    /// Prometheus label names, not `host` (the hostname's label there).
    #[serde(default)]
    pub labels: HostLabels,
    /// A file holding an HTTPS token: the password `git fetch` is given when the remote asks
    /// (read then, never copied), with the URL's user or `x-access-token`.
    pub token_file: Option<PathBuf>,
    /// An SSH private key for ssh:// remotes (the only key ssh offers; the remote's host key
    /// must be in root's `known_hosts`, as for any `git fetch` that asks nobody).
    pub ssh_key_file: Option<PathBuf>,
    /// A PEM file of CA certificates trusted for an https:// remote besides the system's (a
    /// private CA, or the server's own self-signed certificate).
    pub ca_file: Option<PathBuf>,
    /// Only deploy commits signed by a key listed in this allowed-signers file.
    pub verify_ssh_allowed_signers: Option<PathBuf>,
    /// Only deploy commits signed by a key in this OpenPGP keyring.
    pub verify_gpg_keyring: Option<PathBuf>,
    /// Deploy a head that does not descend from the deployed commit (force push). Default false.
    #[serde(default)]
    pub allow_rewind: bool,
    /// Stop and remove units whose spec was removed from the repository. Default false: they are
    /// left running and reported as orphaned.
    #[serde(default)]
    pub prune: bool,
    /// Address of the read-only metrics endpoint (`GET /metrics`, `GET /healthz`); any address,
    /// so that Prometheus on another host can scrape it. Default `127.0.0.1:9464`.
    pub listen: Option<String>,
    /// The Unix socket of control actions (`specd reconcile`, `specd unquarantine`). Default
    /// `/run/specd/control.sock`, root's only (directory 0700, socket 0600).
    pub control_socket: Option<PathBuf>,
    /// A group whose members may use the control socket too (directory 0750, socket 0660).
    pub control_group: Option<String>,
    /// Only units whose names match this pattern (`*`, `?`) are managed; a commit with any other
    /// is not deployed. Default: any name (specd's own, systemd's and D-Bus's units never are).
    pub manage_units: Option<String>,
    /// Who hears about applies, rollbacks, quarantines and servers left down.
    #[serde(default)]
    pub notify: NotifyConfig,
    /// How the units' load balancers are answered and waited for before a stop.
    #[serde(default)]
    pub load_balancer: LoadBalancerConfig,
    /// The agent's own `specd tune` on a schedule (opt-in): what the data says of each
    /// speculating unit's draft length, exported beside what runs, and proposed when asked.
    pub tune: Option<TuneConfig>,
}

/// `tune:` of the agent config.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TuneConfig {
    /// Seconds between two evaluations of every speculating unit (the first one this long after
    /// the agent starts).
    pub interval: u64,
    /// Write each recommended change as a signed commit on `specd-proposals/<unit>` of the
    /// repository (never the followed branch). Default false: the metrics only.
    #[serde(default)]
    pub propose: bool,
    /// Fewer drafts than this since an instance started: it cannot tell yet (default 200).
    pub min_drafts: Option<u64>,
    /// Sign the proposals with this SSH private key (as `specd promote --sign-ssh-key`).
    pub sign_ssh_key: Option<PathBuf>,
    /// Sign the proposals with this OpenPGP key of root's keyring.
    pub sign_gpg_key: Option<String>,
    /// The proposals' author and committer (default `specd tune <specd@HOSTNAME>`).
    pub author: Option<String>,
}

/// `load_balancer:` of the agent config. Every unit's serving state is answered on `listen`
/// (`GET /serving/<unit>`) whatever this says.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoadBalancerConfig {
    /// Where HAProxy's agent-check is answered (`host:port`, e.g. `0.0.0.0:9540`); none: not
    /// answered.
    pub agent_check: Option<std::net::SocketAddr>,
    /// With no load balancer seen polling a unit, how long an apply waits after telling it
    /// `drain` before it stops its server (for load balancers specd cannot see). Default 0.
    #[serde(default)]
    pub settle_sec: u32,
    /// How many failed HTTP checks in a row an HTTP-checking load balancer needs before it takes
    /// a server out (HAProxy's `fall`). Default 3.
    pub http_fall: Option<u32>,
    /// After a load balancer first reads a restarted unit `ready`, how long it may still take to
    /// send to it again: its health check's `rise × inter` and a margin (HAProxy takes a server
    /// its check found down back only after `rise` passing checks, whatever its agent says). The
    /// next replica of a group waits this long. Default 5 (HAProxy's `inter 2s rise 2`).
    pub rise_sec: Option<u32>,
}

impl LoadBalancerConfig {
    /// How an apply waits for the load balancers.
    pub fn balancers(&self) -> crate::core::serving::Balancers {
        let d = crate::core::serving::Balancers::default();
        crate::core::serving::Balancers {
            settle: std::time::Duration::from_secs(self.settle_sec.into()),
            http_fall: self.http_fall.unwrap_or(d.http_fall).max(1),
            rise: self.rise_sec.map_or(d.rise, |s| std::time::Duration::from_secs(s.into())),
            answering_since_ms: None,
        }
    }
}

/// `labels:` of the agent config: each name a Prometheus label name other than `host`, each
/// value not empty; checked as the config is read (an error names the line and the label).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostLabels(pub BTreeMap<String, String>);

/// A label name a host may declare, or why not.
pub fn label_name_problem(name: &str) -> Option<String> {
    if name == "host" {
        Some("`host` is the hostname's label (`hostname:`); give this label another name".into())
    } else if !specd_spec::fleet::is_label_name(name) {
        Some(format!("`{name}` is not a label name: a letter or `_`, then letters, digits or `_` (not `__` first)"))
    } else {
        None
    }
}

/// A `name=value` label given on the command line (`--label`).
pub fn label_arg(arg: &str) -> std::result::Result<(String, String), String> {
    let (k, v) = arg.split_once('=').ok_or_else(|| format!("`{arg}` is not name=value"))?;
    if let Some(p) = label_name_problem(k) {
        return Err(p);
    }
    if v.is_empty() {
        return Err(format!("label `{k}` has no value"));
    }
    Ok((k.to_string(), v.to_string()))
}

impl<'de> Deserialize<'de> for HostLabels {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        Ok(HostLabels(
            BTreeMap::<LabelName, LabelValue>::deserialize(d)?.into_iter().map(|(k, v)| (k.0, v.0)).collect(),
        ))
    }
}

/// A label's name, checked where it is read (so that an error points at its line).
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct LabelName(String);

impl<'de> Deserialize<'de> for LabelName {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let k = String::deserialize(d)?;
        match label_name_problem(&k) {
            Some(p) => Err(serde::de::Error::custom(format!("labels: {p}"))),
            None => Ok(LabelName(k)),
        }
    }
}

/// A label's value: a string, not empty.
struct LabelValue(String);

impl<'de> Deserialize<'de> for LabelValue {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let v = String::deserialize(d)?;
        if v.is_empty() {
            return Err(serde::de::Error::custom("labels: a label's value is empty: give the value this host carries"));
        }
        Ok(LabelValue(v))
    }
}

/// `notify:` of the agent config.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NotifyConfig {
    #[serde(default)]
    pub webhooks: Vec<Webhook>,
}

/// One webhook: a JSON body is POSTed to `url` for each reconcile whose outcome is one of
/// `events` (the webhook notices module builds it).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, try_from = "RawWebhook")]
pub struct Webhook {
    pub url: WebhookUrl,
    /// Default: every event.
    pub events: Vec<NotifyEvent>,
    /// A file holding a token sent as `Authorization: Bearer <token>` (read at each delivery,
    /// so that a rotated token is used at once; never put in the body). Only over https://, or
    /// http:// to a loopback address: never in the clear over a network.
    pub token_file: Option<PathBuf>,
    /// CA certificates (PEM) trusted for this webhook's https:// server besides the public CAs
    /// specd knows (an internal CA); read and checked when the config is read.
    pub ca_file: Option<CaFile>,
    /// A file holding the secret each body is signed with (HMAC-SHA256, the
    /// `X-Specd-Signature-256` header: the notices' `signature`); checked when the config is
    /// read, read again at each delivery (a rotated secret is used at once).
    pub secret_file: Option<SecretFile>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawWebhook {
    url: WebhookUrl,
    #[serde(default = "all_events", deserialize_with = "some_events")]
    events: Vec<NotifyEvent>,
    token_file: Option<PathBuf>,
    ca_file: Option<CaFile>,
    secret_file: Option<SecretFile>,
}

/// `ca_file` of a webhook: its certificates, read when the config is read (an error names the
/// file, and the config's line and field).
#[derive(Clone, Debug)]
pub struct CaFile {
    pub certs: Vec<reqwest::Certificate>,
}

impl CaFile {
    /// The certificates of a PEM bundle, each one a CA rustls accepts as a root.
    pub fn read(path: &Path) -> std::result::Result<CaFile, String> {
        let shown = path.display();
        let pem = std::fs::read(path).map_err(|e| format!("ca_file: cannot read {shown}: {e}"))?;
        let certs = reqwest::Certificate::from_pem_bundle(&pem)
            .map_err(|_| format!("ca_file: {shown}: a certificate in it is not valid PEM"))?;
        if certs.is_empty() {
            return Err(format!("ca_file: {shown}: no certificate in it (a PEM file of `BEGIN CERTIFICATE` blocks)"));
        }
        // What rustls makes of them: a certificate it cannot parse fails here, not at the first notice.
        let mut b = reqwest::Client::builder();
        for c in &certs {
            b = b.add_root_certificate(c.clone());
        }
        b.build().map_err(|e| {
            let why = std::error::Error::source(&e).map_or_else(|| e.to_string(), ToString::to_string);
            format!("ca_file: {shown}: not a usable CA certificate ({why})")
        })?;
        Ok(CaFile { certs })
    }
}

impl<'de> Deserialize<'de> for CaFile {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        CaFile::read(&PathBuf::deserialize(d)?).map_err(serde::de::Error::custom)
    }
}

/// `secret_file` of a webhook: a file whose content (surrounding whitespace removed) is the
/// signing secret; checked when the config is read, the secret itself read at each delivery.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SecretFile(pub PathBuf);

impl SecretFile {
    /// The secret in it, as the signature's key.
    pub fn secret(&self) -> std::result::Result<Vec<u8>, String> {
        let shown = self.0.display();
        let text = std::fs::read(&self.0).map_err(|e| format!("secret_file: cannot read {shown}: {e}"))?;
        let secret = text.trim_ascii();
        if secret.is_empty() {
            return Err(format!("secret_file: {shown} is empty: put the webhook's shared secret in it"));
        }
        Ok(secret.to_vec())
    }
}

impl<'de> Deserialize<'de> for SecretFile {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let f = SecretFile(PathBuf::deserialize(d)?);
        f.secret().map_err(serde::de::Error::custom)?;
        Ok(f)
    }
}

impl TryFrom<RawWebhook> for Webhook {
    type Error = String;

    fn try_from(r: RawWebhook) -> std::result::Result<Webhook, String> {
        let u = &r.url.0;
        let host = u.host_str().unwrap_or("").trim_start_matches('[').trim_end_matches(']');
        let loopback = host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|a| a.is_loopback());
        if r.token_file.is_some() && u.scheme() == "http" && !loopback {
            return Err(format!(
                "token_file: the token would cross the network in the clear to {}: use an https:// url (http:// only to a loopback address)",
                r.url
            ));
        }
        if r.ca_file.is_some() && u.scheme() != "https" {
            return Err(format!("ca_file: {} is not an https:// url: a CA is only used for https", r.url));
        }
        Ok(Webhook {
            url: r.url,
            events: r.events,
            token_file: r.token_file,
            ca_file: r.ca_file,
            secret_file: r.secret_file,
        })
    }
}

/// What a reconcile's notice says happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum NotifyEvent {
    /// The desired unit runs, verified and ready (or a stopped one was started again).
    Applied,
    /// A new unit failed and the last good one was restored.
    Rollback,
    /// A unit hash failed and will not be tried again until `specd unquarantine`.
    Quarantine,
    /// The service is not running after the reconcile.
    Down,
    /// A new unit failed and nothing was restored.
    Failed,
}

pub const ALL_EVENTS: [NotifyEvent; 5] =
    [NotifyEvent::Applied, NotifyEvent::Rollback, NotifyEvent::Quarantine, NotifyEvent::Down, NotifyEvent::Failed];

fn all_events() -> Vec<NotifyEvent> {
    ALL_EVENTS.to_vec()
}

fn some_events<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Vec<NotifyEvent>, D::Error> {
    let v = Vec::<NotifyEvent>::deserialize(d)?;
    if v.is_empty() {
        return Err(serde::de::Error::custom(
            "events is empty: name at least one of applied, rollback, quarantine, down, failed (or leave it out for all)",
        ));
    }
    Ok(v)
}

/// An http:// or https:// URL with a host, checked when the config is read. Shown without its
/// path and query (`Display`), which may hold a secret (Slack's do).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WebhookUrl(pub reqwest::Url);

impl std::fmt::Display for WebhookUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let u = &self.0;
        write!(f, "{}://{}", u.scheme(), u.host_str().unwrap_or(""))?;
        if let Some(p) = u.port() {
            write!(f, ":{p}")?;
        }
        Ok(())
    }
}

impl<'de> Deserialize<'de> for WebhookUrl {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error;
        let s = String::deserialize(d)?;
        let u = reqwest::Url::parse(&s).map_err(|e| D::Error::custom(format!("url: not a URL ({e})")))?;
        if !matches!(u.scheme(), "http" | "https") {
            return Err(D::Error::custom(format!("url: must be http:// or https://, not {}://", u.scheme())));
        }
        if u.host_str().is_none_or(str::is_empty) {
            return Err(D::Error::custom("url: has no host"));
        }
        if !u.username().is_empty() || u.password().is_some() {
            return Err(D::Error::custom("url: carries credentials; put the token in token_file instead"));
        }
        Ok(WebhookUrl(u))
    }
}

/// Where the agent listens for control actions unless configured otherwise.
pub const CONTROL_SOCKET: &str = "/run/specd/control.sock";
/// The agent config's path by default.
pub const DEFAULT_PATH: &str = "/etc/specd/agent.yaml";
/// The agent's read-only endpoint by default.
pub const LISTEN: &str = "127.0.0.1:9464";

impl AgentConfig {
    /// Where the agent serves its read-only endpoint (`listen`, else [`LISTEN`]).
    pub fn listen(&self) -> String {
        self.listen.clone().unwrap_or_else(|| LISTEN.into())
    }

    pub fn load(path: &Path) -> Result<AgentConfig> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(AgentConfig::default()),
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        };
        serde_saphyr::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
    }

    /// The control socket: `control_socket`, else [`CONTROL_SOCKET`].
    pub fn control_socket(&self) -> PathBuf {
        self.control_socket.clone().unwrap_or_else(|| PathBuf::from(CONTROL_SOCKET))
    }

    pub fn source(&self) -> Result<SourceConfig> {
        let Some(repo) = self.repo.clone() else {
            bail!("no repository configured: set `repo` in the agent config or pass --repo")
        };
        let verify = match (&self.verify_ssh_allowed_signers, &self.verify_gpg_keyring) {
            (Some(_), Some(_)) => bail!("configure one of verify_ssh_allowed_signers and verify_gpg_keyring, not both"),
            (Some(f), None) => Some(Verify::Ssh { allowed_signers: f.clone() }),
            (None, Some(k)) => Some(Verify::Gpg { keyring: k.clone() }),
            (None, None) => None,
        };
        Ok(SourceConfig {
            repo,
            branch: self.branch.clone().unwrap_or_else(|| "main".into()),
            tag: self.tag.clone(),
            path: self.path.clone().unwrap_or_default(),
            token_file: self.token_file.clone(),
            ssh_key_file: self.ssh_key_file.clone(),
            verify,
            ca_file: self.ca_file.clone(),
        })
    }
}

/// The control socket of the agent that `config` configures, for the commands that talk to it:
/// `flag`, else the config's `control_socket`, else the default. A config that cannot be read is
/// a warning, not an error: the default socket is tried.
pub fn control_socket(flag: Option<PathBuf>, config: &Path) -> PathBuf {
    if let Some(s) = flag {
        return s;
    }
    match AgentConfig::load(config) {
        Ok(cfg) => cfg.control_socket(),
        Err(e) => {
            tracing::warn!("{e:#}; using {CONTROL_SOCKET}");
            PathBuf::from(CONTROL_SOCKET)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(text: &str) -> Result<AgentConfig> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("agent.yaml");
        std::fs::write(&p, text).unwrap();
        AgentConfig::load(&p)
    }

    #[test]
    fn the_load_balancer_section_is_read_with_its_defaults_and_a_bad_address_names_its_line() {
        let cfg = load("repo: /r\n").unwrap();
        assert_eq!(cfg.load_balancer.agent_check, None);
        assert_eq!(cfg.load_balancer.balancers(), crate::core::serving::Balancers::default());
        let cfg = load(
            "repo: /r\nload_balancer:\n  agent_check: 0.0.0.0:9540\n  settle_sec: 2\n  http_fall: 2\n  rise_sec: 9\n",
        )
        .unwrap();
        assert_eq!(cfg.load_balancer.agent_check, Some("0.0.0.0:9540".parse().unwrap()));
        let b = cfg.load_balancer.balancers();
        assert_eq!(
            (b.settle, b.http_fall, b.rise),
            (std::time::Duration::from_secs(2), 2, std::time::Duration::from_secs(9))
        );
        let e = format!("{:#}", load("repo: /r\nload_balancer:\n  agent_check: localhost\n").unwrap_err());
        assert!(e.contains("line 3") && e.contains("agent_check"), "{e}");
        let e = format!("{:#}", load("repo: /r\nload_balancer:\n  agent_chek: 0.0.0.0:1\n").unwrap_err());
        assert!(e.contains("agent_chek"), "{e}");
    }

    #[test]
    fn webhooks_are_read_with_their_events_and_default_to_all() {
        let cfg = load(
            "repo: /r\nnotify:\n  webhooks:\n    - url: https://hooks.example.com/T0/B0/secret\n      events: [rollback, down]\n      token_file: /etc/specd/hook-token\n    - url: http://127.0.0.1:9000/hook\n",
        )
        .unwrap();
        let w = &cfg.notify.webhooks;
        assert_eq!(w.len(), 2);
        assert_eq!(w[0].events, [NotifyEvent::Rollback, NotifyEvent::Down]);
        assert_eq!(w[0].token_file.as_deref(), Some(Path::new("/etc/specd/hook-token")));
        // Shown without the path, which may be the secret.
        assert_eq!(w[0].url.to_string(), "https://hooks.example.com");
        assert_eq!(w[1].events, ALL_EVENTS);
        assert_eq!(w[1].url.to_string(), "http://127.0.0.1:9000");
        assert!(load("repo: /r\n").unwrap().notify.webhooks.is_empty());
    }

    /// A CA made by openssl (as an operator makes an internal one), and files that are not one.
    #[test]
    fn a_webhook_s_ca_file_and_secret_file_are_checked_when_the_config_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let ca = d.join("ca.pem");
        let out = std::process::Command::new("openssl")
            .args(["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2"])
            .args(["-subj", "/CN=specd test CA", "-keyout"])
            .arg(d.join("ca.key"))
            .arg("-out")
            .arg(&ca)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        std::fs::write(d.join("secret"), "s3cret\n").unwrap();
        std::fs::write(d.join("empty"), " \n").unwrap();
        std::fs::write(d.join("text.pem"), "not a certificate\n").unwrap();
        let pem = std::fs::read_to_string(&ca).unwrap();
        let mangled = pem.replacen("MII", "MII*", 1);
        std::fs::write(d.join("mangled.pem"), mangled).unwrap();
        let cut = pem.lines().filter(|l| !l.starts_with("-----END")).collect::<Vec<_>>().join("\n");
        std::fs::write(d.join("cut.pem"), cut).unwrap();
        // Base64 of bytes that are no certificate, in a certificate's armour.
        std::fs::write(
            d.join("junk.pem"),
            "-----BEGIN CERTIFICATE-----\naGVsbG8gd29ybGQ=\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        let hook = |extra: &str| {
            format!(
                "repo: /r\nnotify:\n  webhooks:\n    - url: https://hooks.example.com/x\n      events: [rollback]\n{extra}"
            )
        };
        let at = |name: &str| d.join(name).display().to_string();
        let cfg =
            load(&hook(&format!("      ca_file: {}\n      secret_file: {}\n", at("ca.pem"), at("secret")))).unwrap();
        let w = &cfg.notify.webhooks[0];
        assert_eq!(w.ca_file.as_ref().map(|c| c.certs.len()), Some(1));
        assert_eq!(w.secret_file.as_ref().unwrap().secret().unwrap(), b"s3cret");

        for (extra, line, says) in [
            (format!("      ca_file: {}\n", at("missing.pem")), 6, "ca_file: cannot read"),
            (format!("      ca_file: {}\n", at("text.pem")), 6, "no certificate in it"),
            (format!("      ca_file: {}\n", at("mangled.pem")), 6, "not valid PEM"),
            (format!("      ca_file: {}\n", at("cut.pem")), 6, "not valid PEM"),
            (format!("      ca_file: {}\n", at("junk.pem")), 6, "not a usable CA certificate"),
            (format!("      token_file: /t\n      secret_file: {}\n", at("missing")), 7, "secret_file: cannot read"),
            (format!("      secret_file: {}\n", at("empty")), 6, "is empty"),
        ] {
            let e = format!("{:#}", load(&hook(&extra)).unwrap_err());
            assert!(e.contains("agent.yaml"), "{e}");
            assert!(e.contains(&format!("line {line} ")), "{extra}: {e}");
            assert!(e.contains(says), "{extra}: {e}");
        }
        let e = format!(
            "{:#}",
            load(&format!("notify:\n  webhooks:\n    - url: http://127.0.0.1:9/x\n      ca_file: {}\n", at("ca.pem")))
                .unwrap_err()
        );
        assert!(e.contains("ca_file:") && e.contains("not an https:// url"), "{e}");
    }

    #[test]
    fn labels_are_prometheus_label_names_with_values_and_a_bad_one_is_located() {
        let cfg = load("repo: /r\nlabels:\n  gpu: h100\n  zone: eu-1\n").unwrap();
        let want: BTreeMap<String, String> =
            [("gpu", "h100"), ("zone", "eu-1")].map(|(k, v)| (k.into(), v.into())).into();
        assert_eq!(cfg.labels.0, want);
        assert!(load("repo: /r\n").unwrap().labels.0.is_empty());
        for (text, line, says) in [
            ("repo: /r\nlabels:\n  gpu: h100\n  host: a\n", 4, "`host` is the hostname's label"),
            ("labels:\n  gpu-model: h100\n", 2, "`gpu-model` is not a label name"),
            ("labels:\n  __name: x\n", 2, "`__name` is not a label name"),
            ("labels:\n  gpu: \"\"\n", 2, "value is empty"),
            ("labels:\n  gpu: [a]\n", 2, "labels"),
            ("labels: [gpu]\n", 1, "labels"),
        ] {
            let e = format!("{:#}", load(text).unwrap_err());
            assert!(e.contains("agent.yaml"), "{e}");
            assert!(e.contains(&format!("line {line} ")), "{text}: {e}");
            assert!(e.contains(says), "{text}: {e}");
        }
        assert_eq!(label_arg("gpu=h100"), Ok(("gpu".into(), "h100".into())));
        assert!(label_arg("gpu").unwrap_err().contains("not name=value"));
        assert!(label_arg("host=x").unwrap_err().contains("hostname's label"));
        assert!(label_arg("gpu=").unwrap_err().contains("no value"));
    }

    #[test]
    fn a_bad_webhook_is_an_error_naming_file_line_and_field() {
        for (text, line, says) in [
            ("notify:\n  webhooks:\n    - url: http://h/x\n      events: [rollback, rollbak]\n", 4, "rollbak"),
            ("notify:\n  webhooks:\n    - url: ftp://h/x\n", 3, "must be http:// or https://"),
            ("notify:\n  webhooks:\n    - url: https://user:pw@h/x\n", 3, "token_file"),
            ("notify:\n  webhooks:\n    - url: not a url\n", 3, "not a URL"),
            ("notify:\n  webhooks:\n    - url: http://h/x\n      events: []\n", 4, "events is empty"),
            ("notify:\n  webhooks:\n    - url: http://h/x\n      secret: 1\n", 4, "unknown field `secret`"),
            ("notify:\n  webhook: []\n", 2, "unknown field `webhook`"),
            ("notify:\n  webhooks:\n    - url: http://hooks.example.com/x\n      token_file: /t\n", 3, "in the clear"),
        ] {
            let e = format!("{:#}", load(text).unwrap_err());
            assert!(e.contains("agent.yaml"), "{e}");
            assert!(e.contains(&format!("line {line} ")), "{text}: {e}");
            assert!(e.contains(says), "{text}: {e}");
        }
    }
}
