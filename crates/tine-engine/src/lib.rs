//! tine-engine: the operations a client asks for — sandboxes (create, list,
//! exec, files, snapshot, restore, fork, remove), snapshots (list, show,
//! diff, merge, tag, delete) and workspaces (suspend, resume) — over
//! tine-store, tine-fs and tine-sandbox. The HTTP server calls nothing else;
//! the CLI calls these for workspaces, `rm`, `exec` and the history verbs
//! (`history`). The results serialize to the JSON both print. Each call opens the repository
//! and closes it when done (an open repository holds the gc lock shared, and
//! `tine gc` must not wait for a daemon that runs for weeks).
#![forbid(unsafe_code)]

pub mod attach;
pub mod build;
mod ctx;
pub mod exec;
pub mod export;
pub mod files;
pub mod graph;
pub mod helpers;
mod history;
pub mod images;
mod maintenance;
mod ops;
mod podman;
pub mod remote_ws;
pub mod remotes;
pub mod workspace;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tine_sandbox::SandboxDirs;
use tine_sandbox::manager;
use tine_store::{ErrorKind, HasKind, ObjectId, Repository, SnapshotInfo, WriteLock};

pub use attach::{Attach, AttachedForks, AttachedView};
pub use build::{BuildEvent, BuildImage, Built, BuiltStep};
pub use ctx::Ctx;
pub use exec::{ExecOutcome, ExecRequest, Stream};
pub use export::{ExportImage, Exported};
pub use files::FileEntry;
pub use history::{
    DiffRequest, DiffResult, ForkRequest, ForkResult, MAX_FORKS, MergeInto, MergeRequest,
    MergeResult, SandboxOp, SnapshotRequest,
};
pub use images::{ImageView, ImportImage, Imported};
pub use maintenance::GcResult;
pub use ops::Operations;
pub use remote_ws::{SuspendedTo, WorkspaceOnRemote};
pub use remotes::{AddRemote, PullRequest, Pulled, PushRequest, Pushed, RemoteAccess, RemoteShow};
pub use tine_fs::paths::WALK_STACK;
// The engine's requests and results name these; embedders (the CLI too)
// name them through the engine.
pub use tine_sandbox::criu::Criu;
pub use tine_sandbox::manager::{
    ForkVia, Frozen, SandboxError, SandboxView, sandbox_id_of_source, valid_name,
};
pub use tine_sandbox::processes::PoolLimits;
pub use tine_sandbox::{Isolation, Limits, Net, Restart};
pub use workspace::{SuspendStep, WorkspaceView};

/// Everything an operation can fail with; [`HasKind`] classifies it.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Open(#[from] tine_store::OpenError),
    #[error(transparent)]
    Record(#[from] tine_store::RecordError),
    #[error(transparent)]
    Resolve(#[from] tine_store::ResolveError),
    #[error(transparent)]
    Object(#[from] tine_store::ObjectError),
    #[error(transparent)]
    Write(#[from] tine_store::WriteError),
    #[error(transparent)]
    Maintenance(#[from] tine_store::MaintenanceError),
    #[error(transparent)]
    Sandbox(#[from] tine_sandbox::SandboxError),
    #[error(transparent)]
    Snapshot(#[from] tine_fs::SnapshotError),
    #[error(transparent)]
    Restore(#[from] tine_fs::RestoreError),
    /// Boxed: its paths would make every result of the engine larger.
    #[error(transparent)]
    Merge(Box<tine_fs::MergeError>),
    #[error("{message}")]
    Invalid { message: String },
    #[error("path {path:?}: {reason}")]
    BadPath { path: String, reason: String },
    #[error("{what} is {size} bytes, over the limit of {limit}")]
    TooLarge { what: String, size: u64, limit: u64 },
    #[error("{path}: {step}: {source}")]
    File {
        path: String,
        step: &'static str,
        source: std::io::Error,
    },
    #[error("sandbox {name} is {state}; only a running sandbox can do that")]
    NotRunning { name: String, state: String },
    #[error(
        "{live} sandboxes are live, the most this daemon runs at once ({max}); remove some, or raise --max-sandboxes"
    )]
    Capacity { live: usize, max: usize },
    #[error(
        "{}: not under a directory this daemon may import from ({}); start it with --import-root",
        path.display(), if roots.is_empty() { "none given".to_string() } else { roots.iter().map(|r| r.display().to_string()).collect::<Vec<_>>().join(", ") }
    )]
    NotImportable { path: PathBuf, roots: Vec<PathBuf> },
    #[error("{program}: {source}")]
    NoCommand {
        program: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Workspace(#[from] workspace::WorkspaceError),
    #[error(transparent)]
    Ledger(#[from] tine_ledger::LedgerError),
    #[error(transparent)]
    RemoteWorkspace(#[from] remote_ws::RemoteWorkspaceError),
    #[error(transparent)]
    RemoteName(#[from] remotes::RemoteNameError),
    #[error(transparent)]
    Image(#[from] tine_image::ImageError),
    #[error(transparent)]
    ImageRecord(#[from] tine_store::ImageRecordError),
    #[error(transparent)]
    Build(#[from] build::BuildError),
    /// An error a helper process reported, with its kind.
    #[error("{message}")]
    Reported { kind: ErrorKind, message: String },
    #[error("{message}")]
    Internal { message: String },
}

impl From<tine_fs::MergeError> for EngineError {
    fn from(e: tine_fs::MergeError) -> EngineError {
        EngineError::Merge(Box::new(e))
    }
}

impl HasKind for EngineError {
    fn kind(&self) -> ErrorKind {
        use EngineError as E;
        match self {
            E::Open(e) => e.kind(),
            E::Record(e) => e.kind(),
            E::Resolve(e) => e.kind(),
            E::Object(e) => e.kind(),
            E::Write(e) => e.kind(),
            E::Maintenance(e) => e.kind(),
            E::Sandbox(e) => e.kind(),
            E::Snapshot(e) => e.kind(),
            E::Restore(e) => e.kind(),
            E::Merge(e) => e.kind(),
            E::Invalid { .. } | E::BadPath { .. } | E::TooLarge { .. } => ErrorKind::InvalidInput,
            E::NotImportable { .. } => ErrorKind::InvalidInput,
            E::File { source, .. } => match source.kind() {
                std::io::ErrorKind::NotFound => ErrorKind::NotFound,
                std::io::ErrorKind::AlreadyExists => ErrorKind::AlreadyExists,
                std::io::ErrorKind::NotADirectory | std::io::ErrorKind::IsADirectory => {
                    ErrorKind::InvalidInput
                }
                _ if source.raw_os_error() == Some(rustix::io::Errno::LOOP.raw_os_error()) => {
                    ErrorKind::InvalidInput
                }
                _ => ErrorKind::Io,
            },
            E::NotRunning { .. } => ErrorKind::InvalidInput,
            E::Capacity { .. } => ErrorKind::Capacity,
            E::NoCommand { source, .. } => match source.kind() {
                std::io::ErrorKind::NotFound => ErrorKind::NotFound,
                _ => ErrorKind::InvalidInput,
            },
            E::Workspace(e) => e.kind(),
            E::Ledger(e) => e.kind(),
            E::RemoteWorkspace(e) => e.kind(),
            E::RemoteName(e) => e.kind(),
            E::Image(e) => images::image_error_kind(e),
            E::ImageRecord(e) => e.kind(),
            E::Build(e) => e.kind(),
            E::Reported { kind, .. } => *kind,
            E::Internal { .. } => ErrorKind::Internal,
        }
    }
}

/// A number unique within this process (temporary names).
pub(crate) fn unique() -> u64 {
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// How the engine is set up; the caller (CLI, daemon) reads flags and the
/// environment, the engine never does.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub repo: PathBuf,
    /// The `tine` binary: supervisors and exec helpers run it.
    pub exe: PathBuf,
    /// A CRIU binary (4.1 or later), when one is installed.
    pub criu: Option<tine_sandbox::criu::Criu>,
    pub pool: PoolLimits,
    /// Live sandboxes at most (creating or forking more is a capacity error).
    pub max_sandboxes: Option<usize>,
    /// Host directories sandboxes may be created from (`directory`); none:
    /// only snapshots and empty workspaces.
    pub import_roots: Vec<PathBuf>,
    /// Largest file `read_file` returns.
    pub max_file_bytes: u64,
    /// How remotes are reached (push, pull, clone, a workspace's trips).
    pub remote_access: remotes::RemoteAccess,
    /// A Podman binary, when one is installed: images are imported from
    /// its local store through it (`podman image save`).
    pub podman: Option<PathBuf>,
}

impl EngineConfig {
    pub fn new(repo: PathBuf, exe: PathBuf) -> EngineConfig {
        EngineConfig {
            repo,
            exe,
            criu: None,
            podman: None,
            pool: PoolLimits::default(),
            max_sandboxes: None,
            import_roots: Vec::new(),
            max_file_bytes: 256 << 20,
            remote_access: remotes::RemoteAccess::default(),
        }
    }
}

/// The operations; cheap to share between threads (it holds only paths).
#[derive(Debug, Clone)]
pub struct Engine {
    cfg: EngineConfig,
}

/// How a new sandbox is made (`POST /v1/sandboxes`, `tine run`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CreateSandbox {
    pub name: Option<String>,
    /// Base snapshot (id prefix or tag).
    pub from: Option<String>,
    /// A host directory to snapshot as the base (never modified); must be
    /// under one of the engine's import roots.
    pub directory: Option<PathBuf>,
    /// A root filesystem for the sandbox instead of the host's, read-only
    /// (a host directory under one of the engine's import roots).
    pub rootfs: Option<PathBuf>,
    /// Default: `sleep infinity`, a main process that only keeps the
    /// sandbox up for `exec`.
    pub command: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub memory_bytes: Option<u64>,
    pub pids: Option<u64>,
    /// What its upper layer may hold (default 10 GiB), where the
    /// repository's filesystem keeps project quotas.
    pub disk_bytes: Option<u64>,
    /// `none` (default: loopback only) or `host`.
    pub net: Net,
    pub restart: Restart,
    /// Seconds between SIGTERM and SIGKILL when stopping (default 10).
    pub stop_timeout_s: Option<u64>,
    /// The seccomp filter (default: on; a workspace's sandbox: off, as CRIU
    /// cannot persist filtered processes, see docs/SECURITY.md).
    pub seccomp: Option<bool>,
    /// An imported image (name or id) as the sandbox's whole root: its
    /// files are the sandbox's (snapshotted, rolled back and forked with
    /// it), and its configuration gives the command, environment,
    /// working directory and user. Not with `from`, `directory` or `rootfs`.
    pub image: Option<String>,
    /// With `image`: instead of its entrypoint (Docker's `--entrypoint`).
    pub entrypoint: Option<Vec<String>>,
}

/// The environment a sandbox's command starts with, before its own settings.
pub fn default_env() -> Vec<(String, String)> {
    vec![
        ("PATH".to_string(), tine_sandbox::DEFAULT_PATH.to_string()),
        ("HOME".to_string(), tine_sandbox::WORKSPACE.to_string()),
    ]
}

/// What depends on snapshot `id` besides other snapshots, tags and heads
/// (which the store checks itself): sandboxes based on it, workspace
/// states, images holding it.
pub(crate) fn dependents(repo: &Repository, id: &ObjectId) -> Result<Vec<String>, EngineError> {
    let hex = id.to_hex();
    let mut by: Vec<String> = repo
        .sandboxes()?
        .iter()
        .filter(|r| {
            tine_sandbox::RunSpec::of(r).is_ok_and(|s| s.base.as_deref() == Some(hex.as_str()))
        })
        .map(|r| format!("sandbox {}", r.name))
        .collect();
    by.extend(workspace::states_using(repo, id)?);
    for img in repo.images()? {
        if img.snapshot == *id || img.layers.iter().any(|l| l.snapshot == *id) {
            by.push(format!("image {}", img.names.first().unwrap_or(&img.id)));
        }
    }
    Ok(by)
}

/// The default main process of a sandbox made without a command.
pub const IDLE_COMMAND: [&str; 2] = ["sleep", "infinity"];

/// A snapshot in a listing (`tine log`, `GET /v1/snapshots`): its metadata
/// and how many processes it holds as live templates or CRIU images.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct SnapshotEntry {
    #[serde(flatten)]
    pub info: SnapshotInfo,
    pub live_processes: usize,
    pub persisted_processes: usize,
}

/// One snapshot in full (`tine show`, `GET /v1/snapshots/{id}`).
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct SnapshotDetail {
    #[serde(flatten)]
    pub info: SnapshotInfo,
    pub created_with_tags: Vec<String>,
    pub attachments: Vec<tine_store::Attachment>,
    pub processes: Option<ProcessesHeld>,
    /// Forks of it prepared ahead (`snapshot --prepare-forks`), ready to be
    /// claimed, and the page tables they hold.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prepared_forks: Option<PreparedHeld>,
}

/// Prepared forks a snapshot has ready.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct PreparedHeld {
    pub forks: usize,
    pub page_table_bytes: u64,
}

/// Snapshot `id` in full: its metadata, attachments and the process state
/// it holds (`tine show` prints this too).
pub fn snapshot_detail(repo: &Repository, id: &ObjectId) -> Result<SnapshotDetail, EngineError> {
    let obj = repo.read_snapshot(id)?;
    let info = repo
        .snapshot_info(id)?
        .ok_or(tine_store::WriteError::NoSuchSnapshot { id: *id })?;
    let held = tine_sandbox::processes::held(repo.path(), true).remove(&id.to_hex());
    let (forks, page_table_bytes) = manager::prepared::held(repo, id);
    Ok(SnapshotDetail {
        prepared_forks: (forks > 0).then_some(PreparedHeld {
            forks,
            page_table_bytes,
        }),
        info,
        created_with_tags: obj.tags,
        attachments: obj.attachments,
        processes: held.map(|h| ProcessesHeld {
            live: h.live,
            private_bytes: h.live_bytes,
            persisted: h.persisted,
            persisted_bytes: h.persisted_bytes,
        }),
    })
}

/// The process state a snapshot holds.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct ProcessesHeld {
    pub live: usize,
    pub private_bytes: u64,
    pub persisted: usize,
    pub persisted_bytes: u64,
}

/// A sandbox removed.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct Removed {
    pub removed: String,
    pub name: String,
}

impl Engine {
    pub fn new(cfg: EngineConfig) -> Engine {
        Engine { cfg }
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    pub fn config_mut(&mut self) -> &mut EngineConfig {
        &mut self.cfg
    }

    pub fn repo_path(&self) -> &Path {
        &self.cfg.repo
    }

    /// The repository, opened for one operation.
    pub fn open(&self) -> Result<Repository, EngineError> {
        Ok(Repository::open(&self.cfg.repo)?)
    }

    fn lock<'r>(&self, repo: &'r Repository) -> Result<WriteLock<'r>, EngineError> {
        Ctx::QUIET.lock(repo)
    }

    /// Live sandboxes, for the capacity check and the metrics.
    pub fn live_count(&self, repo: &Repository) -> Result<usize, EngineError> {
        Ok(repo
            .sandboxes()?
            .iter()
            .filter(|r| manager::holds_a_place(repo, r))
            .count())
    }

    fn check_capacity(&self, repo: &Repository, more: usize) -> Result<(), EngineError> {
        if let Some(max) = self.cfg.max_sandboxes {
            let live = self.live_count(repo)?;
            if live + more > max {
                return Err(EngineError::Capacity { live, max });
            }
        }
        Ok(())
    }

    fn importable(&self, dir: &Path) -> Result<PathBuf, EngineError> {
        let refuse = || EngineError::NotImportable {
            path: dir.to_path_buf(),
            roots: self.cfg.import_roots.clone(),
        };
        // Missing: said so only where it may be looked at (a daemon's client
        // learns nothing of paths outside its import roots).
        let real = std::fs::canonicalize(dir).map_err(|source| {
            let lexically_inside = self.cfg.import_roots.iter().any(|r| dir.starts_with(r));
            if lexically_inside {
                EngineError::File {
                    path: dir.display().to_string(),
                    step: "find",
                    source,
                }
            } else {
                refuse()
            }
        })?;
        let ok = self
            .cfg
            .import_roots
            .iter()
            .any(|r| std::fs::canonicalize(r).is_ok_and(|r| real.starts_with(r)));
        if ok { Ok(real) } else { Err(refuse()) }
    }

    /// Makes and starts a sandbox.
    pub fn create_sandbox(
        &self,
        req: &CreateSandbox,
        ctx: &Ctx<'_>,
    ) -> Result<SandboxView, EngineError> {
        let directory = req
            .directory
            .as_deref()
            .map(|d| self.importable(d))
            .transpose()?;
        let rootfs = req
            .rootfs
            .as_deref()
            .map(|d| self.importable(d))
            .transpose()?;
        if directory.is_some() && req.from.is_some() {
            return Err(EngineError::Invalid {
                message: "give either `from` (a snapshot) or `directory`, not both".into(),
            });
        }
        if req.image.is_some() && (req.from.is_some() || directory.is_some() || rootfs.is_some()) {
            return Err(EngineError::Invalid {
                message: "an image is the sandbox's root and its files: give `image` without `from`, `directory` or `rootfs`".into(),
            });
        }
        if req.entrypoint.is_some() && req.image.is_none() {
            return Err(EngineError::Invalid {
                message: "`entrypoint` replaces an image's: give it with `image`".into(),
            });
        }
        let repo = self.open()?;
        let image = req
            .image
            .as_deref()
            .map(|i| images::image_run(&repo, i, req.entrypoint.as_deref(), &req.command))
            .transpose()?;
        let from = match &image {
            Some((run, _)) => Some(run.snapshot),
            None => req.from.as_deref().map(|s| repo.resolve(s)).transpose()?,
        };
        let given: Vec<(String, String)> = req
            .env
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let env = match &image {
            Some((run, _)) => exec::merge_env(run.env.clone(), &given),
            None => exec::merge_env(default_env(), &given),
        };
        let command = match &image {
            Some((run, true)) => run.command.clone(),
            _ if req.command.is_empty() => IDLE_COMMAND.iter().map(|s| s.to_string()).collect(),
            _ => req.command.clone(),
        };
        let opts = tine_sandbox::RunOptions {
            name: req.name.clone(),
            from,
            workspace: directory,
            limits: Limits {
                memory_bytes: req.memory_bytes,
                pids: req.pids,
                disk_bytes: req.disk_bytes,
            },
            net: req.net,
            restart: req.restart,
            rootfs,
            command,
            env,
            stop_timeout: Duration::from_secs(req.stop_timeout_s.unwrap_or(10)),
            seccomp: req.seccomp.unwrap_or(true),
            image: image.map(|(run, _)| run.root),
        };
        let isolation = manager::isolation_available();
        let rec = {
            let lock = ctx.lock(&repo)?;
            // Under the lock: a sandbox counts as live from its record on
            // (starting), so concurrent creates cannot overshoot the limit.
            self.check_capacity(&repo, 1)?;
            manager::prepare(&lock, &opts, isolation, ctx.progress)?
        };
        if let Err(e) = manager::launch(&repo, &rec, &self.cfg.exe) {
            // A create that failed leaves nothing: no record holding the
            // name, no files (the error carries what its log said).
            if let Ok(r) = repo.sandbox(&rec.id) {
                let _ = manager::remove(&repo, &r, true);
            }
            return Err(e.into());
        }
        Ok(manager::view(&repo, &repo.sandbox(&rec.id)?))
    }

    /// Sandboxes: live ones, or with `all` ended ones too.
    pub fn sandboxes(&self, all: bool) -> Result<Vec<SandboxView>, EngineError> {
        let repo = self.open()?;
        Ok(repo
            .sandboxes()?
            .iter()
            .map(|r| manager::view(&repo, r))
            .filter(|v| all || !(v.ended() || v.state == tine_store::SandboxState::Prepared))
            .collect())
    }

    /// One sandbox, by name or id (prefix).
    pub fn sandbox(&self, spec: &str) -> Result<SandboxView, EngineError> {
        let repo = self.open()?;
        Ok(manager::view(&repo, &repo.sandbox(spec)?))
    }

    pub fn stop_sandbox(
        &self,
        spec: &str,
        timeout: Option<Duration>,
    ) -> Result<SandboxView, EngineError> {
        if let Some(t) = timeout {
            manager::check_timeout("stop timeout", t)?;
        }
        let repo = self.open()?;
        let rec = repo.sandbox(spec)?;
        Ok(manager::stop(&repo, &rec, timeout)?)
    }

    /// Removes a sandbox and its files (a live one only with `force`); one
    /// that belongs to a workspace is refused (delete the workspace).
    pub fn remove_sandbox(&self, spec: &str, force: bool) -> Result<Removed, EngineError> {
        let repo = self.open()?;
        let rec = repo.sandbox(spec)?;
        workspace::refuse_if_owned(&repo, &rec)?;
        manager::remove(&repo, &rec, force)?;
        Ok(Removed {
            removed: rec.id,
            name: rec.name,
        })
    }

    /// The workspace directory of a sandbox, as the host sees it, and where
    /// its processes see it.
    fn workspace_dir(&self, spec: &str) -> Result<(PathBuf, &'static str), EngineError> {
        let v = self.sandbox(spec)?;
        // A stopped isolated sandbox has no merged view: its files are in
        // the layers, reachable again once it runs.
        if !v.workspace.is_dir() || (v.isolation == tine_sandbox::Isolation::Full && !v.live()) {
            return Err(EngineError::NotRunning {
                name: v.name,
                state: v.state.to_string(),
            });
        }
        let at = v.files_at();
        Ok((v.workspace, at))
    }

    /// Reads a file of a running sandbox (`/workspace/...`).
    pub fn read_file(&self, sb: &str, path: &str) -> Result<Vec<u8>, EngineError> {
        let (dir, at) = self.workspace_dir(sb)?;
        let rel = files::relative_in(path, at)?;
        files::read_at(&dir, at, &rel, self.cfg.max_file_bytes)
    }

    /// Writes a file of a running sandbox, atomically.
    pub fn write_file(
        &self,
        sb: &str,
        path: &str,
        data: &mut dyn std::io::Read,
        mode: Option<u32>,
    ) -> Result<FileEntry, EngineError> {
        let (dir, at) = self.workspace_dir(sb)?;
        let rel = files::relative_in(path, at)?;
        files::write_at(&dir, at, &rel, data, mode)
    }

    /// Lists a directory of a running sandbox.
    pub fn list_files(&self, sb: &str, path: &str) -> Result<Vec<FileEntry>, EngineError> {
        let (dir, at) = self.workspace_dir(sb)?;
        let rel = files::relative_in(path, at)?;
        files::list_at(&dir, at, &rel)
    }

    /// Runs a command in a running sandbox, handing its output to `sink` as
    /// it comes (`sink` returning false kills it).
    pub fn exec(
        &self,
        sb: &str,
        req: &ExecRequest,
        sink: &mut exec::Sink<'_>,
    ) -> Result<ExecOutcome, EngineError> {
        if req.command.is_empty() {
            return Err(EngineError::Invalid {
                message: "exec: `command` is empty; give the program and its arguments".into(),
            });
        }
        if let Some(t) = req.timeout_s
            && !(t.is_finite() && t > 0.0 && t <= manager::MAX_TIMEOUT_S as f64)
        {
            return Err(EngineError::Invalid {
                message: format!(
                    "exec: timeout_s {t} is out of range: give seconds above 0 and at most {} (30 days), or leave it out for none",
                    manager::MAX_TIMEOUT_S
                ),
            });
        }
        // The helper checks that it runs (asking its supervisor once).
        let rec = self.open()?.sandbox(sb)?;
        exec::run(&self.cfg.exe, &self.cfg.repo, &rec.id, &rec.name, req, sink)
    }

    /// Snapshots, newest first, each with the processes it holds.
    pub fn snapshots(&self, limit: Option<usize>) -> Result<Vec<SnapshotEntry>, EngineError> {
        let repo = self.open()?;
        let mut all = repo.snapshots()?;
        all.sort_by_key(|s| std::cmp::Reverse(s.seq));
        if let Some(n) = limit {
            all.truncate(n);
        }
        // Counts only: a listing shows no bytes.
        let held = tine_sandbox::processes::held(repo.path(), false);
        Ok(all
            .into_iter()
            .map(|info| {
                let h = held.get(&info.id.to_hex()).copied().unwrap_or_default();
                SnapshotEntry {
                    info,
                    live_processes: h.live,
                    persisted_processes: h.persisted,
                }
            })
            .collect())
    }

    /// One snapshot in full.
    pub fn snapshot(&self, spec: &str) -> Result<SnapshotDetail, EngineError> {
        let repo = self.open()?;
        let id = repo.resolve(spec)?;
        snapshot_detail(&repo, &id)
    }

    /// Points tag `name` at a snapshot.
    pub fn tag(
        &self,
        snapshot: &str,
        name: &str,
        force: bool,
        ctx: &Ctx<'_>,
    ) -> Result<ObjectId, EngineError> {
        let repo = self.open()?;
        let id = repo.resolve(snapshot)?;
        ctx.lock(&repo)?.set_tag(name, &id, force)?;
        Ok(id)
    }

    /// Deletes a tag; returns what it pointed at.
    pub fn untag(&self, name: &str, ctx: &Ctx<'_>) -> Result<ObjectId, EngineError> {
        let repo = self.open()?;
        Ok(ctx.lock(&repo)?.delete_tag(name)?)
    }

    /// Deletes a snapshot (its data goes at the next `gc`), refused while a
    /// child snapshot, a tag, a head, a sandbox built on it or a workspace's
    /// suspended state depends on it.
    pub fn delete_snapshot(&self, spec: &str, ctx: &Ctx<'_>) -> Result<ObjectId, EngineError> {
        let repo = self.open()?;
        let id = repo.resolve(spec)?;
        let by = dependents(&repo, &id)?;
        let lock = ctx.lock(&repo)?;
        lock.delete_snapshot(&id, by)?;
        Ok(id)
    }

    /// The template memory all snapshots' live templates hold, in bytes.
    pub fn template_bytes(&self) -> u64 {
        tine_sandbox::processes::held(&self.cfg.repo, true)
            .values()
            .map(|h| h.live_bytes)
            .sum()
    }

    /// Records an effect on a sandbox's ledger.
    pub fn ledger_record(
        &self,
        sb: &str,
        rec: &tine_ledger::Record,
    ) -> Result<tine_ledger::Entry, EngineError> {
        let repo = self.open()?;
        let id = repo.sandbox(sb)?.id;
        let lock = self.lock(&repo)?;
        Ok(tine_ledger::append(&lock, &id, rec)?)
    }

    /// The effect a sandbox's visible ledger holds under `key`, if any.
    pub fn ledger_lookup(
        &self,
        sb: &str,
        key: &str,
    ) -> Result<Option<tine_ledger::Entry>, EngineError> {
        let repo = self.open()?;
        let id = repo.sandbox(sb)?.id;
        Ok(tine_ledger::lookup(&repo, &id, key)?)
    }

    /// A sandbox's visible ledger, or with `all` every entry it ever
    /// recorded (those a rollback abandoned marked not visible); `sb` none:
    /// every sandbox's history.
    pub fn ledger_list(
        &self,
        sb: Option<&str>,
        all: bool,
    ) -> Result<Vec<tine_ledger::Entry>, EngineError> {
        let repo = self.open()?;
        let id = sb.map(|s| repo.sandbox(s).map(|r| r.id)).transpose()?;
        Ok(match (&id, all) {
            (Some(id), false) => tine_ledger::visible(&repo, id)?,
            (id, _) => tine_ledger::history(&repo, id.as_deref())?,
        })
    }

    /// Verifies the whole ledger; the number of entries checked.
    pub fn ledger_verify(&self) -> Result<usize, EngineError> {
        Ok(tine_ledger::verify(&self.open()?)?)
    }

    /// A sandbox's id and the files its stdout and stderr go to.
    pub fn log_files(&self, sb: &str) -> Result<(String, PathBuf, PathBuf), EngineError> {
        let rec = self.open()?.sandbox(sb)?;
        let dirs = self.sandbox_dirs(&rec.id);
        Ok((rec.id, dirs.stdout_log(), dirs.stderr_log()))
    }

    pub fn sandbox_dirs(&self, id: &str) -> SandboxDirs {
        SandboxDirs::new(&self.cfg.repo, id)
    }
}
