//! Following the source: fetch the followed ref, gate its head (no rewind, signatures) and read
//! the desired states of the revision this host deploys. Without a fleet file that revision is
//! the head. With one beside the specs (`fleet.yaml`, `kind: Fleet`), it is the revision the
//! promotion record (`promotions.yaml` on the record branch) assigns this host, by its name and
//! labels: its wave's good revision, or the rollout's target once the host was promoted. No
//! record yet: the host keeps what it runs and says it waits. Blocking (git): callers run it on
//! `spawn_blocking`.

use std::collections::BTreeMap;

use git2::Oid;
use specd_spec::fleet::{ParsedFleet, RECORD_FILE, Record};
use specd_spec::short;

use crate::core::guard::catch;
use crate::core::record::Source;
use crate::machine::store::FleetPosition;
use crate::reconcile::DesiredState;
use crate::source::git::GitSource;

/// What a read of the source says.
pub struct Evaluation {
    /// The head of the followed ref.
    pub head: Option<String>,
    /// Why nothing is deployed from this read, if so.
    pub error: Option<String>,
    /// The desired states of the revision to deploy (empty with an error, or while waiting).
    pub desired: Vec<DesiredState>,
    /// With a fleet file at the head: where this host stands in the rollout.
    pub fleet: Option<FleetPosition>,
}

impl Evaluation {
    /// The revision `desired` comes from: the one the record assigns, else the head.
    pub fn revision(&self) -> Option<&str> {
        self.fleet.as_ref().and_then(|f| f.assigned.as_deref()).or(self.head.as_deref())
    }

    /// Why this host keeps what it runs, waiting on a promotion (no error, nothing to deploy).
    pub fn waiting(&self) -> Option<&str> {
        self.fleet.as_ref().and_then(|f| f.waiting.as_deref())
    }

    /// What this read saw: the head, and the record's commit when there is one. A read that sees
    /// the same has nothing new to hand the units.
    pub fn seen(&self) -> Option<String> {
        let record = self.fleet.as_ref().and_then(|f| f.record.as_deref());
        self.head.as_ref().map(|h| format!("{h}{}", record.map(|r| format!(" record {r}")).unwrap_or_default()))
    }
}

/// Who follows: this host's name and labels (a fleet's waves select by them), and the record
/// commit it last accepted a revision from (the record may not go back from it).
#[derive(Clone, Copy, Debug)]
pub struct Follower<'a> {
    pub host: &'a str,
    pub labels: &'a BTreeMap<String, String>,
    pub record: Option<&'a str>,
}

static NO_LABELS: BTreeMap<String, String> = BTreeMap::new();

/// A host by its name alone: no labels, no record followed yet.
impl<'a> From<&'a str> for Follower<'a> {
    fn from(host: &'a str) -> Follower<'a> {
        Follower { host, labels: &NO_LABELS, record: None }
    }
}

fn fail(head: Option<String>, e: String) -> Evaluation {
    Evaluation { head, error: Some(e), desired: vec![], fleet: None }
}

/// Fetch, gate and read what this host deploys. Without a fleet file at the head: the head, if
/// it descends from `accepted` (or `allow_rewind`) and verifies. With one: see [`by_record`].
pub fn evaluate<'a>(
    s: &GitSource,
    accepted: Option<&str>,
    allow_rewind: bool,
    who: impl Into<Follower<'a>>,
) -> Evaluation {
    let who = who.into();
    if let Err(e) = s.fetch() {
        return fail(None, format!("{e:#}"));
    }
    let head = match s.head() {
        Ok(h) => h,
        Err(e) => return fail(None, format!("{e:#}")),
    };
    let hs = head.to_string();
    let fleet_file = match catch(|| s.fleet_file(head)) {
        Ok(Ok(f)) => f,
        Ok(Err(e)) => return fail(Some(hs), format!("{e:#}")),
        Err(e) => {
            let why = format!("commit {}: internal error while reading the fleet file: {e}", short(&hs));
            return fail(Some(hs), why);
        }
    };
    if let Some(old) = accepted.and_then(|a| Oid::from_str(a).ok())
        && old != head
        && !allow_rewind
    {
        let forward = s.has_commit(old) && s.descends_from(head, old).unwrap_or(false);
        if !forward {
            return fail(
                Some(hs.clone()),
                format!(
                    "{} moved to {} which does not contain the deployed commit {} (a force push or reset?); refusing to go backwards (set allow_rewind: true to allow)",
                    s.followed(),
                    short(&hs),
                    short(&old.to_string())
                ),
            );
        }
    }
    if let Some(f) = fleet_file {
        return by_record(s, head, &f, allow_rewind, who);
    }
    if let Err(e) = verified(s, head, "") {
        return fail(Some(hs), e);
    }
    match read_commit(s, head, who.host) {
        Ok(desired) => Evaluation { head: Some(hs), error: None, desired, fleet: None },
        Err(e) => fail(Some(hs), e),
    }
}

/// The signature check of `oid` when one is configured; `what` names the commit's role in an
/// error (`the record's `).
fn verified(s: &GitSource, oid: Oid, what: &str) -> Result<(), String> {
    match s.verify(oid) {
        Ok(Some(signer)) => {
            tracing::info!(commit = %short(&oid.to_string()), %signer, "signature verified");
            Ok(())
        }
        Ok(None) => Ok(()),
        Err(e) => Err(format!("{what}{e:#}; staying on the last good commit")),
    }
}

/// A head with a fleet file: the head verifies (its fleet file is trusted), the fleet file
/// parses, the record branch is read: none yet, the host waits; a record that goes back from
/// the one followed is refused (unless `allow_rewind`), it verifies, it parses, and the
/// revision it assigns this host must be the head or in its history, and verify. That revision
/// is read and deployed, older than the head or not (a revert is the record's decision).
fn by_record(
    s: &GitSource,
    head: Oid,
    file: &crate::source::git::SpecFile,
    allow_rewind: bool,
    who: Follower,
) -> Evaluation {
    let hs = head.to_string();
    if let Err(e) = verified(s, head, "") {
        return fail(Some(hs), e);
    }
    let fleet = match specd_spec::fleet::parse_fleet(&file.text, &format!("{}@{}", file.path, short(&hs))) {
        Ok(f) => f,
        Err(d) => {
            return fail(Some(hs.clone()), format!("commit {} is not deployed; nothing changed:\n{d}", short(&hs)));
        }
    };
    let mut pos = FleetPosition {
        file: format!("{}@{}", file.path, short(&hs)),
        record_branch: fleet.record_branch().to_string(),
        wave: fleet.wave_of(who.host, who.labels).map(|i| fleet.waves()[i].name.clone()),
        ..Default::default()
    };
    let mut out = Evaluation { head: Some(hs), error: None, desired: vec![], fleet: None };
    match assign(s, head, &fleet, &mut pos, allow_rewind, who) {
        Ok(Some(desired)) => out.desired = desired,
        Ok(None) => {}
        Err(e) => out.error = Some(e),
    }
    out.fleet = Some(pos);
    out
}

/// The desired states of the revision the record assigns (`pos` filled in as it is found);
/// `Ok(None)`: the host waits (`pos.waiting` says why).
fn assign(
    s: &GitSource,
    head: Oid,
    fleet: &ParsedFleet,
    pos: &mut FleetPosition,
    allow_rewind: bool,
    who: Follower,
) -> Result<Option<Vec<DesiredState>>, String> {
    let branch = fleet.record_branch();
    let rc = match s.fetch_record(branch) {
        Ok(Some(rc)) => rc,
        Ok(None) => {
            pos.waiting =
                Some(format!("waiting for a promotion: {branch} has no promotion record yet (run specd promote)"));
            return Ok(None);
        }
        Err(e) => return Err(format!("{e:#}; staying on what runs")),
    };
    let rcs = rc.to_string();
    pos.record = Some(rcs.clone());
    if let Some(old) = who.record.and_then(|a| Oid::from_str(a).ok())
        && old != rc
        && !allow_rewind
        && !(s.has_commit(old) && s.descends_from(rc, old).unwrap_or(false))
    {
        return Err(format!(
            "the record branch {branch} moved to {} which does not contain the record {} this host followed (a force push or reset?); refusing to go backwards (set allow_rewind: true to allow)",
            short(&rcs),
            short(&old.to_string())
        ));
    }
    verified(s, rc, &format!("the promotion record ({branch}): "))?;
    let text = s.read_record(rc).map_err(|e| format!("{e:#}; staying on what runs"))?;
    let record = Record::parse(&text, &format!("{RECORD_FILE}@{} ({branch})", short(&rcs)))
        .map_err(|d| format!("the promotion record is not usable; staying on what runs:\n{d}"))?;
    let assigned = match record.revision_for(fleet, who.host, who.labels) {
        Ok(a) => a,
        Err(why) => {
            pos.waiting = Some(format!("waiting for a promotion: {why}"));
            return Ok(None);
        }
    };
    pos.wave = assigned.wave;
    pos.promoted = assigned.promoted;
    pos.assigned = Some(assigned.revision.clone());
    let r =
        Oid::from_str(&assigned.revision).map_err(|e| format!("the record's revision {}: {e}", assigned.revision))?;
    if !(s.has_commit(r) && s.descends_from(head, r).unwrap_or(false)) {
        return Err(format!(
            "the record names {} which is not in the history of {}; staying on what runs",
            short(&assigned.revision),
            s.followed()
        ));
    }
    verified(s, r, "the assigned revision: ")?;
    read_commit(s, r, who.host).map(Some)
}

/// The desired states of one commit for `host`; every spec must be valid (a commit deploys whole).
pub fn read_commit(s: &GitSource, head: Oid, host: &str) -> Result<Vec<DesiredState>, String> {
    let hs = head.to_string();
    let files = catch(|| s.read_specs(head))
        .map_err(|e| format!("commit {}: internal error while reading specs: {e}", short(&hs)))?
        .map_err(|e| format!("{e:#}"))?;
    let mut desired = Vec::new();
    let mut errors = Vec::new();
    for f in files {
        let shown = format!("{}@{}", f.path, short(&hs));
        // A panic on one spec (a bug in validation or rendering) fails this commit like an invalid
        // spec does, and is reported; it never reaches the agent's loop.
        let read = catch(|| {
            specd_spec::parse(&shown, &f.text)
                .and_then(|p| p.resolve(Some(host)))
                .map(|spec| DesiredState::new(spec, None))
        });
        let read = match read {
            Ok(r) => r,
            Err(e) => {
                errors.push(format!("{shown}: commit {}: internal error while reading specs: {e}", short(&hs)));
                continue;
            }
        };
        match read {
            Ok(DesiredState { spec, unit, .. }) => {
                if desired.iter().any(|d: &DesiredState| d.spec.unit == spec.unit) {
                    errors.push(format!(
                        "{shown}: spec.unit: {} is already managed by another spec in this commit",
                        spec.unit
                    ));
                    continue;
                }
                let src = Source::Commit { repo: s.cfg.repo.clone(), commit: hs.clone(), path: f.path.clone() };
                desired.push(DesiredState { spec, unit, source: Some(src) });
            }
            Err(d) => errors.push(d.to_string()),
        }
    }
    if !errors.is_empty() {
        return Err(format!("commit {} is not deployed; nothing changed:\n{}", short(&hs), errors.join("\n")));
    }
    Ok(desired)
}
