//! Remotes through the engine: name one (add, list, show, remove), push
//! snapshots to it, pull from it, and clone all it holds into this
//! repository. How to reach them (S3 credentials, setting overrides, retries)
//! comes with the engine's configuration: the CLI's flags, the daemon's
//! environment at start. Credentials are never stored, logged or answered.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tine_remote::{Connect, Credentials, Location, PullReport, PushOptions, PushReport, Remote};
use tine_store::{ErrorKind, HasKind, ObjectId, RemoteRecord, Repository};

use crate::{Ctx, Engine, EngineError};

/// Snapshots one push or pull names at most.
pub const MAX_NAMED: usize = 4096;

/// How remotes are reached; never serialized, and its `Debug` leaves the
/// secret out.
#[derive(Clone)]
pub struct RemoteAccess {
    /// None: anonymous requests (a public bucket, a file remote).
    pub credentials: Option<Credentials>,
    /// Settings (`endpoint`, `region`) over those each remote keeps.
    pub overrides: BTreeMap<String, String>,
    /// Attempts after the first for a failing request.
    pub retries: usize,
    /// Where a `file://` remote added through the engine may be (its daemon's
    /// `--remote-root`); None: anywhere (the CLI, on its own host).
    pub file_roots: Option<Vec<PathBuf>>,
    /// The S3 endpoints (`host[:port]`) a remote may name (its daemon's
    /// `--remote-endpoint`); None: any http(s) endpoint.
    pub endpoints: Option<Vec<String>>,
}

impl Default for RemoteAccess {
    fn default() -> RemoteAccess {
        RemoteAccess {
            credentials: None,
            overrides: BTreeMap::new(),
            retries: 3,
            file_roots: None,
            endpoints: None,
        }
    }
}

impl std::fmt::Debug for RemoteAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteAccess")
            .field("credentials", &self.credentials)
            .field("overrides", &self.overrides)
            .field("retries", &self.retries)
            .field("file_roots", &self.file_roots)
            .field("endpoints", &self.endpoints)
            .finish()
    }
}

/// A remote to name (`POST /v1/remotes`, `tine remote add`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AddRemote {
    pub name: String,
    /// `s3://bucket/prefix` or `file:///path`.
    pub url: String,
    /// Kept with the remote (S3 only): the endpoint, e.g. `http://127.0.0.1:8333`.
    pub endpoint: Option<String>,
    pub region: Option<String>,
}

/// What a remote holds (`tine remote show`, `GET /v1/remotes/{name}`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RemoteShow {
    pub remote: RemoteRecord,
    pub snapshots: Vec<tine_remote::layout::SnapshotRecord>,
    pub tags: Vec<(String, ObjectId)>,
}

/// A push (`tine push`, `POST /v1/remotes/{name}/push`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PushRequest {
    /// The remote (None: `origin`, else the only one).
    pub remote: Option<String>,
    /// Snapshots (tags or id prefixes) to send with their ancestors; empty:
    /// every snapshot and every tag. A tag named here goes too.
    pub snapshots: Vec<String>,
    /// Packs larger than this go up in parts of this size, resumable.
    pub part_size: u64,
    /// Parts in flight at once.
    pub concurrency: usize,
    /// A pause before each part (the CLI's tests interrupt an upload with
    /// it; not taken over HTTP).
    #[serde(skip)]
    pub part_pause: Duration,
}

impl Default for PushRequest {
    fn default() -> PushRequest {
        let o = PushOptions::default();
        PushRequest {
            remote: None,
            snapshots: Vec::new(),
            part_size: o.part_size,
            concurrency: o.concurrency,
            part_pause: o.part_pause,
        }
    }
}

/// A pull (`tine pull`, `POST /v1/remotes/{name}/pull`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PullRequest {
    /// The remote (None: `origin`, else the only one).
    pub remote: Option<String>,
    /// The remote's snapshots (tags or id prefixes) to fetch with their
    /// ancestors; empty: all it holds.
    pub snapshots: Vec<String>,
}

/// What a push did, and how long it took.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Pushed {
    #[serde(flatten)]
    pub report: PushReport,
    pub duration_ms: f64,
}

/// What a pull (or a clone) did, and how long it took.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Pulled {
    #[serde(flatten)]
    pub report: PullReport,
    pub duration_ms: f64,
}

/// Why a remote could not be named or picked.
#[derive(Debug, thiserror::Error)]
pub enum RemoteNameError {
    #[error(
        "remote name {name:?}: use 1-64 letters, digits, '-', '_' or '.', starting with a letter or digit"
    )]
    BadName { name: String },
    #[error("no remote named {name:?} ({known})")]
    Unknown { name: String, known: String },
    #[error("name the remote to use ({known})")]
    Unnamed { known: String },
    #[error(
        "remote {name:?} is {existing}, not {url}; remove it first or clone under another name"
    )]
    Elsewhere {
        name: String,
        existing: String,
        url: String,
    },
    #[error(
        "remote URL {url}: this daemon keeps file remotes under {} only (start it with --remote-root)",
        if roots.is_empty() { "none".to_string() } else { roots.iter().map(|r| r.display().to_string()).collect::<Vec<_>>().join(", ") }
    )]
    FileOutsideRoots { url: String, roots: Vec<PathBuf> },
    #[error("{what}: {n} snapshots named, over the limit of {MAX_NAMED}")]
    TooMany { what: &'static str, n: usize },
    #[error("push: {what} {value} is out of range ({range})")]
    OutOfRange {
        what: &'static str,
        value: u64,
        range: &'static str,
    },
}

impl HasKind for RemoteNameError {
    fn kind(&self) -> ErrorKind {
        match self {
            RemoteNameError::Unknown { .. } => ErrorKind::NotFound,
            RemoteNameError::Elsewhere { .. } => ErrorKind::AlreadyExists,
            _ => ErrorKind::InvalidInput,
        }
    }
}

/// This repository's private directory for remote `name` (cached indexes,
/// upload state).
pub fn state_dir(repo: &Repository, name: &str) -> PathBuf {
    repo.path().join("remotes").join(name)
}

fn known(all: &[RemoteRecord]) -> String {
    if all.is_empty() {
        "there are none; add one with `tine remote add NAME URL`".to_string()
    } else {
        let names: Vec<&str> = all.iter().map(|r| r.name.as_str()).collect();
        format!("known: {}", names.join(", "))
    }
}

/// The remote `name`, or (none named) `origin`, else the only one.
pub fn pick(repo: &Repository, name: Option<&str>) -> Result<RemoteRecord, EngineError> {
    let all = repo.remotes()?;
    let found = match name {
        Some(n) => all
            .iter()
            .find(|r| r.name == n)
            .ok_or_else(|| RemoteNameError::Unknown {
                name: n.to_string(),
                known: known(&all),
            }),
        None => all
            .iter()
            .find(|r| r.name == "origin")
            .or(if all.len() == 1 { all.first() } else { None })
            .ok_or_else(|| RemoteNameError::Unnamed { known: known(&all) }),
    }?;
    Ok(found.clone())
}

/// The record of a new remote: its URL parsed, its settings checked.
pub fn record(req: &AddRemote) -> Result<RemoteRecord, EngineError> {
    if !crate::valid_name(&req.name) {
        return Err(RemoteNameError::BadName {
            name: req.name.clone(),
        }
        .into());
    }
    let mut settings = BTreeMap::new();
    if matches!(Location::parse(&req.url)?, Location::S3 { .. }) {
        if let Some(e) = &req.endpoint {
            settings.insert("endpoint".to_string(), e.clone());
        }
        if let Some(r) = &req.region {
            settings.insert("region".to_string(), r.clone());
        }
    }
    tine_remote::check_settings(&settings)?;
    Ok(RemoteRecord {
        name: req.name.clone(),
        url: req.url.clone(),
        settings,
    })
}

/// Refuses an endpoint in `settings` that `access` does not allow.
fn allowed_endpoint(
    url: &str,
    settings: &BTreeMap<String, String>,
    access: &RemoteAccess,
) -> Result<(), EngineError> {
    if !matches!(Location::parse(url)?, Location::S3 { .. }) {
        return Ok(());
    }
    let Some(allow) = &access.endpoints else {
        return Ok(());
    };
    // Where requests go: the endpoint, or AWS's host for the region.
    let host = tine_remote::s3_host(settings)?;
    if allow.iter().any(|a| a.eq_ignore_ascii_case(&host)) {
        return Ok(());
    }
    Err(EngineError::Reported {
        kind: ErrorKind::InvalidInput,
        message: format!(
            "remote endpoint {host} is not one this daemon reaches (its --remote-endpoint: {})",
            allow.join(", ")
        ),
    })
}

/// Opens `rec` as `access` says to reach it.
pub fn open(
    repo: &Repository,
    rec: &RemoteRecord,
    access: &RemoteAccess,
) -> Result<Remote, EngineError> {
    let mut c = Connect::new(&rec.url);
    c.settings = rec.settings.clone();
    c.settings.extend(access.overrides.clone());
    // Also for remotes named before the daemon was given its list.
    allowed_endpoint(&rec.url, &c.settings, access)?;
    c.credentials = access.credentials.clone();
    c.retries = access.retries;
    Ok(Remote::open(&rec.name, &c, &state_dir(repo, &rec.name))?)
}

/// Tags and the snapshots they point at.
type Tags = Vec<(String, ObjectId)>;

/// What `snapshots` names, and the tags among them (all of both when empty).
fn to_push(repo: &Repository, specs: &[String]) -> Result<(Vec<ObjectId>, Tags), EngineError> {
    let tags_now = repo.tags()?;
    if specs.is_empty() {
        let all = repo.snapshots()?.into_iter().map(|s| s.id).collect();
        return Ok((all, tags_now));
    }
    let mut snaps = Vec::new();
    let mut tags = Vec::new();
    for s in specs {
        let id = repo.resolve(s)?;
        snaps.push(id);
        if let Some((n, _)) = tags_now.iter().find(|(n, _)| n == s) {
            tags.push((n.clone(), id));
        }
    }
    Ok((snaps, tags))
}

fn bounded(what: &'static str, specs: &[String]) -> Result<(), EngineError> {
    if specs.len() > MAX_NAMED {
        return Err(RemoteNameError::TooMany {
            what,
            n: specs.len(),
        }
        .into());
    }
    Ok(())
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

impl Engine {
    /// A `file://` URL added through this engine must be under its file
    /// roots, when it has them.
    fn check_file_root(&self, url: &str) -> Result<(), EngineError> {
        let Some(roots) = &self.cfg.remote_access.file_roots else {
            return Ok(());
        };
        let Location::File { path } = Location::parse(url)? else {
            return Ok(());
        };
        let refuse = || RemoteNameError::FileOutsideRoots {
            url: url.to_string(),
            roots: roots.clone(),
        };
        if path
            .components()
            .any(|c| c == std::path::Component::ParentDir)
        {
            return Err(refuse().into());
        }
        // The directory may not exist yet: its nearest existing ancestor
        // decides (canonical, so no link leads out).
        let mut probe: &Path = &path;
        let real = loop {
            if let Ok(r) = std::fs::canonicalize(probe) {
                break r;
            }
            probe = probe.parent().ok_or_else(refuse)?;
        };
        let inside = roots
            .iter()
            .any(|r| std::fs::canonicalize(r).is_ok_and(|r| real.starts_with(r)));
        if inside { Ok(()) } else { Err(refuse().into()) }
    }

    /// Every remote, by name.
    pub fn remotes(&self) -> Result<Vec<RemoteRecord>, EngineError> {
        Ok(self.open()?.remotes()?)
    }

    /// Names a remote (refused when the name is taken).
    pub fn add_remote(&self, req: &AddRemote, ctx: &Ctx<'_>) -> Result<RemoteRecord, EngineError> {
        let rec = record(req)?;
        self.check_file_root(&rec.url)?;
        allowed_endpoint(&rec.url, &rec.settings, &self.cfg.remote_access)?;
        let repo = self.open()?;
        ctx.lock(&repo)?.add_remote(&rec)?;
        Ok(rec)
    }

    /// Forgets a remote and what this repository cached of it (what it holds
    /// stays where it is).
    pub fn remove_remote(&self, name: &str, ctx: &Ctx<'_>) -> Result<RemoteRecord, EngineError> {
        let repo = self.open()?;
        let rec = pick(&repo, Some(name))?;
        ctx.lock(&repo)?.remove_remote(name)?;
        let _ = std::fs::remove_dir_all(state_dir(&repo, name));
        Ok(rec)
    }

    /// What remote `name` holds.
    pub fn remote_show(&self, name: &str) -> Result<RemoteShow, EngineError> {
        let repo = self.open()?;
        let rec = pick(&repo, Some(name))?;
        let listing = open(&repo, &rec, &self.cfg.remote_access)?.listing()?;
        Ok(RemoteShow {
            remote: rec,
            snapshots: listing.snapshots,
            tags: listing.tags,
        })
    }

    /// Pushes snapshots (with their ancestors) to `req.remote`; only what it
    /// lacks travels.
    pub fn push(&self, req: &PushRequest, ctx: &Ctx<'_>) -> Result<Pushed, EngineError> {
        bounded("push", &req.snapshots)?;
        if !(1 << 20..=5 << 30).contains(&req.part_size) {
            return Err(RemoteNameError::OutOfRange {
                what: "part_size",
                value: req.part_size,
                range: "1 MiB to 5 GiB",
            }
            .into());
        }
        if !(1..=64).contains(&req.concurrency) {
            return Err(RemoteNameError::OutOfRange {
                what: "concurrency",
                value: req.concurrency as u64,
                range: "1 to 64",
            }
            .into());
        }
        let t0 = Instant::now();
        let repo = self.open()?;
        let rec = pick(&repo, req.remote.as_deref())?;
        let (snapshots, tags) = to_push(&repo, &req.snapshots)?;
        let opts = PushOptions {
            part_size: req.part_size,
            concurrency: req.concurrency,
            part_pause: req.part_pause,
        };
        let r = open(&repo, &rec, &self.cfg.remote_access)?;
        let report = r.push(&repo, &snapshots, &tags, &opts, ctx.progress)?;
        Ok(Pushed {
            report,
            duration_ms: ms(t0),
        })
    }

    /// Pulls snapshots (with their ancestors and tags; all when none are
    /// named) from `req.remote`, each object verified by its hash.
    pub fn pull(&self, req: &PullRequest, ctx: &Ctx<'_>) -> Result<Pulled, EngineError> {
        bounded("pull", &req.snapshots)?;
        let t0 = Instant::now();
        let repo = self.open()?;
        let rec = pick(&repo, req.remote.as_deref())?;
        let r = open(&repo, &rec, &self.cfg.remote_access)?;
        let report = r.pull(&repo, &req.snapshots, ctx.progress)?;
        Ok(Pulled {
            report,
            duration_ms: ms(t0),
        })
    }

    /// Clones a remote into this repository: names it (`origin` unless
    /// `req.name` says otherwise; a remote of that name must already be this
    /// URL, if there is one) and pulls everything it holds.
    pub fn clone_remote(&self, req: &AddRemote, ctx: &Ctx<'_>) -> Result<Pulled, EngineError> {
        let mut req = req.clone();
        if req.name.is_empty() {
            req.name = "origin".into();
        }
        let rec = record(&req)?;
        let repo = self.open()?;
        match repo.remote(&rec.name)? {
            Some(existing) if existing.url != rec.url => {
                return Err(RemoteNameError::Elsewhere {
                    name: rec.name,
                    existing: existing.url,
                    url: rec.url,
                }
                .into());
            }
            Some(_) => {}
            None => {
                self.add_remote(&req, ctx)?;
            }
        }
        let pull = PullRequest {
            remote: Some(rec.name),
            snapshots: Vec::new(),
        };
        self.pull(&pull, ctx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine_in(dir: &Path, roots: Option<Vec<PathBuf>>) -> Engine {
        let repo = dir.join("repo");
        Repository::init(&repo).unwrap();
        let mut cfg = crate::EngineConfig::new(repo, PathBuf::from("/bin/false"));
        cfg.remote_access.file_roots = roots;
        Engine::new(cfg)
    }

    fn add(name: &str, url: &str) -> AddRemote {
        AddRemote {
            name: name.into(),
            url: url.into(),
            ..AddRemote::default()
        }
    }

    #[test]
    fn a_file_remote_outside_the_daemons_roots_is_refused_and_one_inside_is_named() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("remotes");
        std::fs::create_dir(&root).unwrap();
        let e = engine_in(t.path(), Some(vec![root.clone()]));
        let out = e.add_remote(&add("r", "file:///etc/tine-remote"), &Ctx::QUIET);
        let err = out.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidInput);
        assert!(err.to_string().contains("--remote-root"), "{err}");
        let dotdot = format!("file://{}/../escape", root.display());
        assert!(e.add_remote(&add("d", &dotdot), &Ctx::QUIET).is_err());
        let inside = format!("file://{}/new/r", root.display());
        assert_eq!(
            e.add_remote(&add("r", &inside), &Ctx::QUIET).unwrap().url,
            inside
        );
        assert_eq!(e.remotes().unwrap().len(), 1);
    }

    #[test]
    fn picking_a_remote_names_the_known_ones_and_a_clone_under_a_taken_name_is_refused() {
        let t = tempfile::tempdir().unwrap();
        let e = engine_in(t.path(), None);
        let repo = e.open().unwrap();
        let err = pick(&repo, None).unwrap_err();
        assert!(err.to_string().contains("there are none"), "{err}");
        let a = format!("file://{}/a", t.path().display());
        let b = format!("file://{}/b", t.path().display());
        e.add_remote(&add("origin", &a), &Ctx::QUIET).unwrap();
        e.add_remote(&add("other", &b), &Ctx::QUIET).unwrap();
        assert_eq!(pick(&repo, None).unwrap().name, "origin");
        let err = pick(&repo, Some("nope")).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::NotFound);
        assert!(err.to_string().contains("known: origin, other"), "{err}");
        let err = e.clone_remote(&add("", &b), &Ctx::QUIET).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::AlreadyExists);
        assert!(e.add_remote(&add("bad/name", &a), &Ctx::QUIET).is_err());
        let removed = e.remove_remote("other", &Ctx::QUIET).unwrap();
        assert_eq!(removed.url, b);
        assert_eq!(e.remotes().unwrap().len(), 1);
    }

    #[test]
    fn the_access_debug_leaves_the_secret_out() {
        let a = RemoteAccess {
            credentials: Some(Credentials {
                access_key_id: "AKID".into(),
                secret_access_key: "very-secret".into(),
                session_token: Some("tok-secret".into()),
            }),
            ..RemoteAccess::default()
        };
        let s = format!("{a:?}");
        assert!(s.contains("AKID") && !s.contains("secret\""), "{s}");
        assert!(
            !s.contains("very-secret") && !s.contains("tok-secret"),
            "{s}"
        );
    }
}
