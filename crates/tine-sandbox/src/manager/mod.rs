//! Sandboxes as tine's clients drive them: the shared errors and helpers
//! here; each verb in a file of its own (`lifecycle`: prepare, launch, view,
//! stop, remove; `snapshot`; `restore`; `fork`; `freeze`: the frozen window).

mod fork;
mod freeze;
mod lifecycle;
pub mod prepared;
mod restore;
mod snapshot;

pub(crate) use fork::PrivateMounts;
pub use fork::*;
use freeze::Freeze;
pub use freeze::thaw_abandoned;
pub use lifecycle::*;
use lifecycle::{launch_from_images, launch_with, materialize_base, new_id, new_record};
pub use restore::*;
use snapshot::shared_writable_mapping;
pub use snapshot::*;

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde::Serialize;
use tine_store::{
    ErrorKind, HasKind, NoProgress, ObjectId, Progress, RecordError, Repository, SandboxRecord,
    WriteLock, now_ns,
};

use crate::cgroup::{CgroupRoot, DEFAULT_ROOT, Limits};
use crate::ns::Net;
use crate::supervisor::{self, FirstRun, Isolation, Request, Restart, RunSpec, SandboxDirs};
use tine_fs::Tracked;
pub use tine_store::SandboxState;

use crate::processes::ProcessState;

/// Restores into the repository's own directories (unisolated sandboxes'
/// files) keep set-user-ID bits: only the repository's owner reaches them,
/// and they are what the sandbox made.
const IN_REPOSITORY: tine_fs::RestoreOptions = tine_fs::RestoreOptions::FAITHFUL;

/// The owner of an isolated sandbox's files, as the host sees it: the root
/// of its user namespace (the repository's ID range).
pub fn sandbox_owner(repo: &Repository) -> (u32, u32) {
    sandbox_ids(repo).root()
}

/// The ID range of the repository's sandboxes, as scans and restores of
/// their files take it (owners are recorded as the sandboxes see them).
pub fn sandbox_ids(repo: &Repository) -> tine_fs::IdMap {
    crate::ns::Ids::for_repository(repo.repo_id()).map()
}

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error(transparent)]
    Record(#[from] RecordError),
    #[error(transparent)]
    Spec(#[from] crate::supervisor::SpecError),
    #[error(transparent)]
    Snapshot(#[from] tine_fs::SnapshotError),
    #[error(transparent)]
    Restore(#[from] tine_fs::RestoreError),
    #[error(transparent)]
    Object(#[from] tine_store::ObjectError),
    #[error(transparent)]
    Ledger(#[from] tine_ledger::LedgerError),
    #[error(
        "sandbox name {name:?} is not valid: use 1-64 letters, digits, '-', '_' or '.', starting with a letter or digit"
    )]
    BadName { name: String },
    #[error("--rootfs {}: not a directory", path.display())]
    BadRootfs { path: PathBuf },
    #[error("an image is the sandbox's root and its files: give it without {what}")]
    ImageWith { what: &'static str },
    #[error("a sandbox from an image needs isolation, which this host lacks: {reason}")]
    ImageUnisolated { reason: String },
    #[error("no command given: `tine run [OPTIONS] -- CMD [ARGS...]`")]
    NoCommand,
    #[error("{what} {given} is out of range: give {range}")]
    OutOfRange {
        what: &'static str,
        given: String,
        range: String,
    },
    #[error("sandbox {name} is {state}; `tine stop {name}` it first, or pass --force")]
    Live { name: String, state: SandboxState },
    #[error(
        "sandbox {name} holds the PID namespaces of its native forks {} (they would end with it): stop or remove them first",
        forks.join(", ")
    )]
    HoldsForks { name: String, forks: Vec<String> },
    #[error("sandbox {name} did not start: {message} (see {})", log.display())]
    Launch {
        name: String,
        message: String,
        log: PathBuf,
    },
    #[error("sandbox {name}: {source}")]
    Process {
        name: String,
        source: crate::processes::ProcessError,
    },
    #[error(
        "sandbox {name}: snapshot {snapshot} was taken, but its processes could not be persisted: {source}"
    )]
    Persist {
        name: String,
        snapshot: String,
        source: Box<crate::processes::ProcessError>,
    },
    #[error("sandbox {name}: {step} {}: {source}", path.display())]
    Io {
        name: String,
        step: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

impl HasKind for SandboxError {
    fn kind(&self) -> ErrorKind {
        match self {
            SandboxError::Record(e) => e.kind(),
            SandboxError::Spec(e) => e.kind(),
            SandboxError::Snapshot(e) => e.kind(),
            SandboxError::Restore(e) => e.kind(),
            SandboxError::Object(e) => e.kind(),
            SandboxError::Ledger(e) => e.kind(),
            SandboxError::BadName { .. }
            | SandboxError::NoCommand
            | SandboxError::OutOfRange { .. }
            | SandboxError::BadRootfs { .. }
            | SandboxError::ImageWith { .. } => ErrorKind::InvalidInput,
            SandboxError::ImageUnisolated { .. } => ErrorKind::Unsupported,
            SandboxError::Live { .. } | SandboxError::HoldsForks { .. } => ErrorKind::AlreadyExists,
            SandboxError::Launch { .. } | SandboxError::Io { .. } => ErrorKind::Io,
            SandboxError::Process { source, .. } => process_kind(source),
            SandboxError::Persist { source, .. } => process_kind(source),
        }
    }
}

/// Processes native fork or CRIU cannot handle are unsupported; the rest is I/O.
fn process_kind(source: &crate::processes::ProcessError) -> ErrorKind {
    use crate::criu::CriuError;
    use crate::processes::ProcessError as P;
    match source {
        P::NotInTree { .. } | P::Proc(tine_proc::ProcError::NotCloneable(_)) => {
            ErrorKind::Unsupported
        }
        P::Criu(c) => match **c {
            CriuError::Unavailable { .. }
            | CriuError::Filtered { .. }
            | CriuError::Proc(
                tine_proc::ProcError::NotCloneable(_) | tine_proc::ProcError::NotPersistable(_),
            ) => ErrorKind::Unsupported,
            _ => ErrorKind::Io,
        },
        _ => ErrorKind::Io,
    }
}

/// The head key of a sandbox's snapshots (also their `source`).
pub fn head_key(id: &str) -> String {
    format!("sandbox:{id}")
}

/// The sandbox id a snapshot's `source` names, if it is a sandbox's
/// ([`head_key`] read back).
pub fn sandbox_id_of_source(source: &str) -> Option<&str> {
    source.strip_prefix("sandbox:")
}

fn spec_of(rec: &SandboxRecord) -> Result<RunSpec, SandboxError> {
    Ok(RunSpec::of(rec)?)
}

fn base_of(spec: &RunSpec) -> Option<ObjectId> {
    spec.base.as_deref().and_then(ObjectId::from_hex)
}

/// The live sandbox's cgroup, to freeze it (none when it is not running).
/// The cgroup itself says whether anything runs: no round trip to the
/// supervisor on the snapshot and rollback path.
fn live_cgroup(rec: &SandboxRecord) -> Option<crate::cgroup::Cgroup> {
    let cg = CgroupRoot::detect(Path::new(DEFAULT_ROOT))
        .ok()?
        .open(&rec.id)
        .ok()?;
    (!cg.processes().ok()?.is_empty()).then_some(cg)
}

/// A sandbox's overlay workspace, ready to be read.
fn layered(
    repo: &Repository,
    spec: &RunSpec,
    dirs: &SandboxDirs,
) -> Result<tine_fs::Layered, tine_fs::SnapshotError> {
    tine_fs::Layered::load(
        repo,
        base_of(spec).as_ref(),
        &dirs.upper(),
        &dirs.merge_memo(),
        Some(sandbox_ids(repo)),
    )
}

/// The tree of an overlay workspace as it is now (see `tine_fs::layered_tree`).
fn current_tree(
    repo: &Repository,
    ws: &tine_fs::Layered,
    tracked: Option<&Tracked>,
    progress: &dyn Progress,
) -> Result<(ObjectId, HashMap<ObjectId, tine_store::Tree>), tine_fs::SnapshotError> {
    match tine_fs::layered_tree(repo, ws, tracked, progress) {
        Err(tine_fs::SnapshotError::TrackerStale { .. }) => {
            tine_fs::layered_tree(repo, ws, None, progress)
        }
        r => r,
    }
}

/// What the supervisor's change tracker vouches for, asked while the sandbox
/// is frozen, and whether a shared writable mapping of a workspace file
/// exists. Writes through such mappings make no inotify events and may leave
/// a file's stat unchanged: while one exists, and for one snapshot after, a
/// snapshot reads every file of the upper layer.
fn tracked(
    dirs: &SandboxDirs,
    cg: Option<&crate::cgroup::Cgroup>,
    templates: &[u32],
) -> Option<(Tracked, bool)> {
    tracked_asked(dirs, cg, templates, None)
}

/// The change tracker's answer, and whether a shared writable mapping of a
/// workspace file exists (looked for while the supervisor answers: another
/// process, which may wait for a CPU inside a pause).
fn ask_tracker(
    dirs: &SandboxDirs,
    cg: &crate::cgroup::Cgroup,
    templates: &[u32],
) -> Option<(supervisor::Asked, bool)> {
    let asked = supervisor::ask_dirty(dirs)?;
    Some((
        asked,
        shared_writable_mapping(cg, &dirs.merged(), templates),
    ))
}

/// [`tracked`], its answer (and whether such a mapping exists) read from
/// `asked` where both were asked ahead.
fn tracked_asked(
    dirs: &SandboxDirs,
    cg: Option<&crate::cgroup::Cgroup>,
    templates: &[u32],
    asked: Option<(supervisor::Asked, bool)>,
) -> Option<(Tracked, bool)> {
    let cg = cg?;
    let (asked, mapped) = asked.or_else(|| ask_tracker(dirs, cg, templates))?;
    let mut t = asked.dirty()?.tracked();
    if mapped {
        t.dirty = None;
        t.rehash = true;
    }
    Some((t, mapped))
}

pub(crate) fn process_error(name: &str, e: crate::processes::ProcessError) -> SandboxError {
    SandboxError::Process {
        name: name.to_string(),
        source: e,
    }
}

pub(crate) fn plural_processes(n: usize) -> String {
    if n == 1 {
        "1 process".into()
    } else {
        format!("{n} processes")
    }
}

/// Maps an I/O error of sandbox `name` at `step` on `path`.
pub(crate) fn io_error(
    name: &str,
    step: &'static str,
    path: &Path,
) -> impl FnOnce(std::io::Error) -> SandboxError + use<> {
    let (name, path) = (name.to_string(), path.to_path_buf());
    move |source| SandboxError::Io {
        name,
        step,
        path,
        source,
    }
}

/// Mounts sandbox `name`'s overlay, its layers made its root's.
fn mount(repo: &Repository, name: &str, ov: &crate::overlay::Overlay) -> Result<(), SandboxError> {
    ov.mount(Some(sandbox_owner(repo)))
        .map_err(overlay_error(name, "mount", &ov.merged))
}

/// An overlay's error as sandbox `name`'s, at `step` on `path`.
fn overlay_error(
    name: &str,
    step: &'static str,
    path: &Path,
) -> impl FnOnce(crate::overlay::OverlayError) -> SandboxError + use<> {
    let io = io_error(name, step, path);
    move |e| io(std::io::Error::other(e.to_string()))
}
