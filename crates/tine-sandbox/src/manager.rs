//! Sandbox lifecycle as the CLI (and later the daemon) drives it: prepare a
//! sandbox (its base, workspace and record), launch its supervisor, list, stop
//! and remove sandboxes.

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
use crate::supervisor::{
    self, CREATED, FirstRun, Isolation, RUNNING, Request, Restart, RunSpec, STALE, STARTING,
    STOPPED, SandboxDirs,
};
use tine_fs::Tracked;

use crate::processes::ProcessState;

/// Restores into the repository's own directories (unisolated sandboxes'
/// files) keep set-user-ID bits: only the repository's owner reaches them,
/// and they are what the sandbox made.
const IN_REPOSITORY: tine_fs::RestoreOptions = tine_fs::RestoreOptions::FAITHFUL;

/// The owner of an isolated sandbox's files, as the host sees it: the root
/// of its user namespace (the repository's ID range).
pub fn sandbox_owner(repo: &Repository) -> (u32, u32) {
    crate::ns::Ids::for_repository(repo.repo_id()).owner()
}

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error(transparent)]
    Record(#[from] RecordError),
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
    #[error("no command given: `tine run [OPTIONS] -- CMD [ARGS...]`")]
    NoCommand,
    #[error("{what} {given} is out of range: give {range}")]
    OutOfRange {
        what: &'static str,
        given: String,
        range: String,
    },
    #[error("sandbox {name} is {state}; `tine stop {name}` it first, or pass --force")]
    Live { name: String, state: String },
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
            SandboxError::Snapshot(e) => e.kind(),
            SandboxError::Restore(e) => e.kind(),
            SandboxError::Object(e) => e.kind(),
            SandboxError::Ledger(e) => e.kind(),
            SandboxError::BadName { .. }
            | SandboxError::NoCommand
            | SandboxError::OutOfRange { .. }
            | SandboxError::BadRootfs { .. } => ErrorKind::InvalidInput,
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

/// What `tine run` asks for.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    pub name: Option<String>,
    /// Base snapshot.
    pub from: Option<ObjectId>,
    /// A directory to snapshot and use as the base (it is never modified).
    pub workspace: Option<PathBuf>,
    pub limits: Limits,
    pub net: Net,
    pub restart: Restart,
    pub rootfs: Option<PathBuf>,
    pub command: Vec<String>,
    pub env: Vec<(String, String)>,
    pub stop_timeout: Duration,
    /// Run its processes under the seccomp filter (`seccomp`).
    pub seccomp: bool,
}

/// The least memory a sandbox can start in (its init and a small command).
pub const MIN_MEMORY_BYTES: u64 = 16 << 20;
/// The smallest disk limit: room for the directories overlayfs makes.
pub const MIN_DISK_BYTES: u64 = 1 << 20;
/// The fewest processes: its init, its command, an `exec` and its helper.
pub const MIN_PIDS: u64 = 8;
/// The longest wait a caller may ask for (stop, exec): 30 days.
pub const MAX_TIMEOUT_S: u64 = 30 * 24 * 3600;

/// Limits and timeouts within what the kernel and tine can honour, refused
/// by name before anything is made.
fn check_run_options(opts: &RunOptions) -> Result<(), SandboxError> {
    let range =
        |what, given: String, range: String| SandboxError::OutOfRange { what, given, range };
    if let Some(m) = opts.limits.memory_bytes
        && m < MIN_MEMORY_BYTES
    {
        return Err(range(
            "memory limit",
            format!("{m} bytes"),
            format!("at least {} MiB", MIN_MEMORY_BYTES >> 20),
        ));
    }
    if let Some(p) = opts.limits.pids
        && !(MIN_PIDS..=1 << 22).contains(&p)
    {
        return Err(range(
            "process limit",
            p.to_string(),
            format!("{MIN_PIDS} to {}", 1u64 << 22),
        ));
    }
    if let Some(d) = opts.limits.disk_bytes
        && d < MIN_DISK_BYTES
    {
        return Err(range(
            "disk limit",
            format!("{d} bytes"),
            format!("at least {} MiB", MIN_DISK_BYTES >> 20),
        ));
    }
    check_timeout("stop timeout", opts.stop_timeout)
}

/// A timeout of at most [`MAX_TIMEOUT_S`].
pub fn check_timeout(what: &'static str, t: Duration) -> Result<(), SandboxError> {
    if t > Duration::from_secs(MAX_TIMEOUT_S) {
        return Err(SandboxError::OutOfRange {
            what,
            given: format!("{} s", t.as_secs()),
            range: format!("at most {MAX_TIMEOUT_S} s (30 days)"),
        });
    }
    Ok(())
}

/// Whether this host can isolate sandboxes, and if not, why.
pub fn isolation_available() -> Isolation {
    if !rustix::process::geteuid().is_root() {
        return Isolation::None {
            reason: "not running as root (namespaces, overlay mounts and cgroups need root)".into(),
        };
    }
    if let Err(e) = CgroupRoot::detect(Path::new(DEFAULT_ROOT)) {
        return Isolation::None {
            reason: e.to_string(),
        };
    }
    let fs = std::fs::read_to_string("/proc/filesystems").unwrap_or_default();
    if !fs.lines().any(|l| l.trim_end().ends_with("overlay")) {
        return Isolation::None {
            reason: "this kernel has no overlayfs".into(),
        };
    }
    Isolation::Full
}

/// Whether `n` may name a sandbox (or a workspace): 1-64 letters, digits,
/// '-', '_' or '.', starting with a letter or digit.
pub fn valid_name(n: &str) -> bool {
    (1..=64).contains(&n.len())
        && n.as_bytes()[0].is_ascii_alphanumeric()
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

fn new_id() -> String {
    use std::hash::BuildHasher;
    let h = std::collections::hash_map::RandomState::new()
        .hash_one((std::time::SystemTime::now(), std::process::id()));
    format!("{:012x}", h & 0xffff_ffff_ffff)
}

/// The base snapshot materialized once, read-only by convention, shared by
/// every sandbox built on it (`REPO/bases/HEX`; `HEX.complete` marks it done).
fn materialize_base(
    lock: &WriteLock<'_>,
    base: Option<&ObjectId>,
    isolation: &Isolation,
    progress: &dyn Progress,
) -> Result<PathBuf, SandboxError> {
    let bases = lock.repo().path().join("bases");
    let io = |step, path: &Path| io_error("base", step, path);
    let Some(id) = base else {
        let empty = bases.join("empty");
        std::fs::create_dir_all(&empty).map_err(io("create", &empty))?;
        return Ok(empty);
    };
    let dir = bases.join(id.to_hex());
    let done = bases.join(format!("{}.complete", id.to_hex()));
    if !done.exists() {
        // A restore is differential, so an interrupted one is finished here.
        // For isolated sandboxes, made their root's as it is written (the
        // mount's `chown_tree` then finds it done), the top directory last.
        let owner = (*isolation == Isolation::Full).then(|| sandbox_owner(lock.repo()));
        tine_fs::restore_with(
            lock,
            id,
            &dir,
            tine_fs::RestoreOptions::sandbox(owner),
            progress,
        )?;
        if let Some((uid, gid)) = owner {
            std::os::unix::fs::lchown(&dir, Some(uid), Some(gid))
                .map_err(io("give to the sandboxes' root", &dir))?;
        }
        std::fs::write(&done, b"").map_err(io("mark complete", &done))?;
    }
    Ok(dir)
}

/// Creates the sandbox's record and files; [`launch`] starts it.
pub fn prepare(
    lock: &WriteLock<'_>,
    opts: &RunOptions,
    isolation: Isolation,
    progress: &dyn Progress,
) -> Result<SandboxRecord, SandboxError> {
    if opts.command.is_empty() {
        return Err(SandboxError::NoCommand);
    }
    check_run_options(opts)?;
    if let Some(r) = &opts.rootfs
        && !r.is_dir()
    {
        return Err(SandboxError::BadRootfs { path: r.clone() });
    }
    let id = new_id();
    let name = opts.name.clone().unwrap_or_else(|| id.clone());
    if !valid_name(&name) {
        return Err(SandboxError::BadName { name });
    }
    let repo = lock.repo();
    // Fail on a taken name before any work.
    match repo.sandbox(&name) {
        Ok(r) if r.name == name => return Err(RecordError::NameTaken { name }.into()),
        _ => {}
    }
    let base = match (&opts.workspace, &opts.from) {
        (Some(dir), _) => {
            let out = tine_fs::snapshot(
                lock,
                dir,
                &tine_fs::SnapshotOptions {
                    message: format!("base of sandbox {name}"),
                    ..Default::default()
                },
                progress,
            )?;
            Some(out.id)
        }
        (None, from) => *from,
    };
    let lower = materialize_base(lock, base.as_ref(), &isolation, progress)?;
    let dirs = SandboxDirs::new(repo.path(), &id);
    std::fs::create_dir_all(&dirs.root).map_err(io_error(&name, "create", &dirs.root))?;
    if let Isolation::None { .. } = isolation {
        match &base {
            Some(b) => {
                tine_fs::restore_with(lock, b, &dirs.plain(), IN_REPOSITORY, &NoProgress)?;
            }
            None => std::fs::create_dir_all(dirs.plain()).map_err(io_error(
                &name,
                "create",
                &dirs.plain(),
            ))?,
        }
    }
    let limits = match isolation {
        Isolation::Full => opts.limits.or_defaults(crate::cgroup::host_memory()),
        Isolation::None { .. } => opts.limits,
    };
    let spec = RunSpec {
        command: opts.command.clone(),
        env: opts.env.clone(),
        limits,
        net: opts.net,
        restart: opts.restart,
        rootfs: opts.rootfs.clone(),
        base: base.map(|b| b.to_hex()),
        lower,
        isolation,
        stop_timeout_ms: opts.stop_timeout.as_millis() as u64,
        seccomp: opts.seccomp,
    };
    let rec = new_record(id, name, STARTING, &spec);
    repo.insert_sandbox(&rec)?;
    Ok(rec)
}

/// Starts the sandbox's supervisor (`exe __supervise REPO ID`, detached) and
/// waits until the sandbox's command has started.
pub fn launch(repo: &Repository, rec: &SandboxRecord, exe: &Path) -> Result<(), SandboxError> {
    launch_with(repo, rec, exe, FirstRun::Start)
}

/// Starts a sandbox that is not running (stopped, ended, or stale after a
/// reboot) again. When `processes` names a snapshot whose processes this
/// sandbox persisted with CRIU, it starts held and they come back from the
/// images, where they were; otherwise its command starts afresh. Returns the
/// number of processes brought back.
pub fn start(
    repo: &Repository,
    rec: &SandboxRecord,
    exe: &Path,
    processes: Option<(&ObjectId, &crate::criu::Criu)>,
) -> Result<usize, SandboxError> {
    let dirs = SandboxDirs::new(repo.path(), &rec.id);
    let state = processes.and_then(|(snap, criu)| {
        crate::processes::load(&dirs, snap)
            .filter(|st| st.restorable(true))
            .map(|st| (st, criu))
    });
    let Some((mut own, criu)) = state else {
        launch(repo, rec, exe)?;
        return Ok(0);
    };
    let n = own.processes.len();
    launch_from_images(repo, rec, exe, &mut own, criu)?;
    Ok(n)
}

/// Starts sandbox `rec` held and brings `own` (its process state, with CRIU
/// images) back from the images: nothing to kill and no files to restore;
/// the templates come back, the processes from them, then init is released
/// (and ends, if they could not be brought).
fn launch_from_images(
    repo: &Repository,
    rec: &SandboxRecord,
    exe: &Path,
    own: &mut ProcessState,
    criu: &crate::criu::Criu,
) -> Result<(), SandboxError> {
    let dirs = SandboxDirs::new(repo.path(), &rec.id);
    launch_with(repo, rec, exe, FirstRun::Held)?;
    let live = repo.sandbox(&rec.id)?;
    let (Some(cg), Some(init)) = (live_cgroup(&live), live.init_pid) else {
        return Err(SandboxError::Launch {
            name: rec.name.clone(),
            message: "it did not start".into(),
            log: dirs.supervisor_log(),
        });
    };
    crate::processes::rollback(&rec.name, &cg, &dirs, init, own, Some(criu), |_| ())
        .map_err(|e| process_error(&rec.name, e))?;
    Ok(())
}

/// [`launch`], with the first run begun as `first_run` says (held: its
/// processes are brought from templates next, then init is released;
/// adopted: a native fork's init already runs).
fn launch_with(
    repo: &Repository,
    rec: &SandboxRecord,
    exe: &Path,
    first_run: FirstRun,
) -> Result<(), SandboxError> {
    let dirs = SandboxDirs::new(repo.path(), &rec.id);
    let log_path = dirs.supervisor_log();
    let io = |step, path: &Path| io_error(&rec.name, step, path);
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .map_err(io("open", &log_path))?;
    let mut child = Command::new(exe);
    child.arg("__supervise").arg(repo.path()).arg(&rec.id);
    match first_run {
        FirstRun::Start => {}
        FirstRun::Held => {
            child.arg("--held");
        }
        FirstRun::Adopt(pid) => {
            child.arg("--adopt").arg(pid.to_string());
        }
    }
    let mut child = child
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log)
        .spawn()
        .map_err(io("start supervisor", exe))?;
    let mut line = String::new();
    if let Some(out) = child.stdout.take() {
        let _ = BufReader::new(out).read_line(&mut line);
    }
    let fail = |message: String| SandboxError::Launch {
        name: rec.name.clone(),
        message,
        log: log_path.clone(),
    };
    let v: serde_json::Value = serde_json::from_str(&line).map_err(|_| {
        let status = child.try_wait().ok().flatten();
        fail(format!(
            "its supervisor ended without a word ({})",
            status.map_or("still running".into(), |s| s.to_string())
        ))
    })?;
    if let Some(e) = v["error"].as_str() {
        let _ = child.wait();
        return Err(fail(e.to_string()));
    }
    // The supervisor lives on; its exit is reaped by whoever inherits it.
    drop(child);
    Ok(())
}

/// A sandbox as `tine ps` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct SandboxView {
    pub id: String,
    pub name: String,
    /// The recorded state, or `stale` when its supervisor is gone.
    pub state: String,
    pub command: Vec<String>,
    pub isolation: Isolation,
    pub base: Option<String>,
    pub workspace: PathBuf,
    pub restarts: u32,
    pub exit: Option<supervisor::Exit>,
    pub created_ns: u64,
    pub init_pid: Option<u32>,
    /// Its limits as recorded (unset ones are unlimited).
    pub limits: Limits,
    /// Its disk limit as it stands (isolated sandboxes: their upper layer).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disk: Option<crate::quota::DiskStatus>,
}

/// Whether a recorded state is one of a live sandbox (starting, running,
/// restarting).
pub fn is_live(state: &str) -> bool {
    matches!(state, STARTING | RUNNING | supervisor::RESTARTING)
}

/// Whether the sandbox takes a place under a limit on live sandboxes: its
/// record says starting (its supervisor may not listen yet), or live with a
/// supervisor there. Unlike [`view`], a supervisor too busy to answer in
/// time (many sandboxes starting at once) still counts, so a capacity check
/// never lets one more in.
pub fn holds_a_place(repo: &Repository, rec: &SandboxRecord) -> bool {
    rec.state == STARTING
        || (is_live(&rec.state) && supervisor::reachable(&SandboxDirs::new(repo.path(), &rec.id)))
}

impl SandboxView {
    /// Starting, running or restarting (as its supervisor says).
    pub fn live(&self) -> bool {
        is_live(&self.state)
    }

    /// It ran and is over (exited or stopped), as opposed to live, created or stale.
    pub fn ended(&self) -> bool {
        matches!(self.state.as_str(), supervisor::EXITED | STOPPED)
    }
}

/// The sandbox's current view, asking its supervisor when the record says live.
pub fn view(repo: &Repository, rec: &SandboxRecord) -> SandboxView {
    let dirs = SandboxDirs::new(repo.path(), &rec.id);
    let mut rec = rec.clone();
    if is_live(&rec.state) {
        match supervisor::request(&dirs, &Request::Status, Duration::from_millis(500)) {
            Some(r) => rec = r,
            None => rec.state = STALE.into(),
        }
    }
    let spec: Option<RunSpec> = serde_json::from_str(&rec.spec).ok();
    SandboxView {
        id: rec.id.clone(),
        name: rec.name.clone(),
        state: rec.state.clone(),
        command: spec.as_ref().map(|s| s.command.clone()).unwrap_or_default(),
        isolation: spec
            .as_ref()
            .map(|s| s.isolation.clone())
            .unwrap_or(Isolation::Full),
        base: spec.as_ref().and_then(|s| s.base.clone()),
        workspace: spec.as_ref().map(|s| dirs.workspace(s)).unwrap_or_default(),
        restarts: rec.restarts,
        exit: rec
            .exit
            .as_deref()
            .and_then(|e| serde_json::from_str(e).ok()),
        created_ns: rec.created_ns,
        init_pid: rec.init_pid,
        limits: spec.as_ref().map(|s| s.limits).unwrap_or_default(),
        disk: match spec.as_ref().map(|s| &s.isolation) {
            Some(Isolation::Full) => Some(crate::quota::status(&dirs.upper())),
            _ => None,
        },
    }
}

/// Stops a sandbox: SIGTERM, then SIGKILL after `timeout` (default: the one it
/// was started with). A stale sandbox (its supervisor gone) has whatever is
/// left of it killed and released.
pub fn stop(
    repo: &Repository,
    rec: &SandboxRecord,
    timeout: Option<Duration>,
) -> Result<SandboxView, SandboxError> {
    refuse_with_forks(repo, rec)?;
    stop_checked(repo, rec, timeout)
}

/// [`stop`], once [`refuse_with_forks`] has let it.
fn stop_checked(
    repo: &Repository,
    rec: &SandboxRecord,
    timeout: Option<Duration>,
) -> Result<SandboxView, SandboxError> {
    let dirs = SandboxDirs::new(repo.path(), &rec.id);
    if is_live(&rec.state) {
        let timeout = timeout.unwrap_or_else(|| {
            spec_of(rec).map_or(Duration::from_secs(10), |s| {
                Duration::from_millis(s.stop_timeout_ms)
            })
        });
        let req = Request::Stop {
            timeout_ms: timeout.as_millis() as u64,
        };
        if supervisor::request(&dirs, &req, timeout + Duration::from_secs(10)).is_none() {
            // No supervisor: clean up after it.
            release(repo, rec);
            let mut r = rec.clone();
            r.supervisor_pid = None;
            r.init_pid = None;
            r.state = STOPPED.into();
            repo.save_sandbox(&r)?;
        }
    }
    Ok(view(repo, &repo.sandbox(&rec.id)?))
}

/// Refuses to end sandbox `rec` while native forks of it run: their PID
/// namespaces are nested in its init's and would end with it.
fn refuse_with_forks(repo: &Repository, rec: &SandboxRecord) -> Result<(), SandboxError> {
    let forks: Vec<String> = repo
        .sandboxes()?
        .into_iter()
        .filter(|r| {
            crate::nested::nested_in(&SandboxDirs::new(repo.path(), &r.id))
                .is_some_and(|n| n.origin == rec.id && n.alive())
        })
        .map(|r| r.name)
        .collect();
    if forks.is_empty() {
        Ok(())
    } else {
        Err(SandboxError::HoldsForks {
            name: rec.name.clone(),
            forks,
        })
    }
}

/// Kills anything left in the sandbox's cgroup and detaches its overlay.
fn release(repo: &Repository, rec: &SandboxRecord) {
    let dirs = SandboxDirs::new(repo.path(), &rec.id);
    let Ok(spec) = spec_of(rec) else {
        return;
    };
    if spec.isolation != Isolation::Full {
        return;
    }
    if let Ok(root) = CgroupRoot::detect(Path::new(DEFAULT_ROOT))
        && let Ok(cg) = root.open(&rec.id)
    {
        let _ = cg.freeze(Duration::from_secs(2));
        for pid in cg.processes().unwrap_or_default() {
            if let Some(p) = rustix::process::Pid::from_raw(pid as i32) {
                let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
            }
        }
        let _ = cg.thaw();
        let _ = cg.remove_when_empty(Duration::from_secs(5));
    }
    let _ = dirs.overlay(&spec).unmount();
}

/// Removes a sandbox: its record and all its files. A live one only with `force`
/// (it is stopped first, without grace).
pub fn remove(repo: &Repository, rec: &SandboxRecord, force: bool) -> Result<(), SandboxError> {
    let v = view(repo, rec);
    refuse_with_forks(repo, rec)?;
    if is_live(&v.state) {
        if !force {
            return Err(SandboxError::Live {
                name: rec.name.clone(),
                state: v.state,
            });
        }
        stop_checked(repo, rec, Some(Duration::ZERO))?;
    }
    release(repo, rec);
    let dirs = SandboxDirs::new(repo.path(), &rec.id);
    crate::quota::release(&dirs.upper());
    match std::fs::remove_dir_all(&dirs.root) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_error(&rec.name, "remove", &dirs.root)(e)),
    }
    repo.delete_sandbox(&rec.id)?;
    Ok(())
}

/// The record of a sandbox not started yet.
fn new_record(id: String, name: String, state: &str, spec: &RunSpec) -> SandboxRecord {
    let t = now_ns();
    SandboxRecord {
        id,
        name,
        created_ns: t,
        updated_ns: t,
        state: state.into(),
        spec: serde_json::to_string(spec).unwrap_or_default(),
        supervisor_pid: None,
        init_pid: None,
        restarts: 0,
        exit: None,
    }
}

/// The head key of a sandbox's snapshots.
pub fn head_key(id: &str) -> String {
    format!("sandbox:{id}")
}

fn spec_of(rec: &SandboxRecord) -> Result<RunSpec, SandboxError> {
    serde_json::from_str(&rec.spec).map_err(|e| SandboxError::Io {
        name: rec.name.clone(),
        step: "read run options",
        path: PathBuf::from(&rec.id),
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, e),
    })
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
    let cg = cg?;
    let mut t = supervisor::dirty(dirs)?.tracked();
    let mapped = shared_writable_mapping(cg, &dirs.merged(), templates);
    if mapped {
        t.dirty = None;
        t.rehash = true;
    }
    Some((t, mapped))
}

/// Whether a process of `cg` maps a file of the overlay at `merged` shared
/// and writable (templates are skipped: they never run).
fn shared_writable_mapping(cg: &crate::cgroup::Cgroup, merged: &Path, templates: &[u32]) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Ok(md) = std::fs::metadata(merged) else {
        return true;
    };
    let dev = format!(
        "{:02x}:{:02x}",
        rustix::fs::major(md.dev()),
        rustix::fs::minor(md.dev())
    );
    let Ok(pids) = cg.processes() else {
        return true;
    };
    pids.iter().filter(|p| !templates.contains(p)).any(|pid| {
        std::fs::read_to_string(format!("/proc/{pid}/maps")).is_ok_and(|maps| {
            maps.lines().any(|l| {
                let mut f = l.split_ascii_whitespace();
                let perms = f.nth(1).unwrap_or("");
                perms.as_bytes().get(1) == Some(&b'w')
                    && perms.as_bytes().get(3) == Some(&b's')
                    && f.nth(1) == Some(dev.as_str())
            })
        })
    })
}

/// The files read (`read`, on a thread of its own) while the stopped
/// processes make their templates: once both are done, the processes run
/// again, and `read`'s `after_scan` learns whether the files held still (no
/// process joined meanwhile). Returns the templates, what `read` returned
/// (an error if its thread could not start or panicked) and how long the
/// processes were stopped.
fn read_while_templates_are_made<R: Send>(
    mut stopped: crate::processes::Stopped,
    cg: &crate::cgroup::Cgroup,
    read: impl FnOnce(&mut dyn FnMut() -> bool) -> R + Send,
) -> (
    Result<ProcessState, crate::processes::ProcessError>,
    std::io::Result<R>,
    Duration,
) {
    use std::sync::mpsc::sync_channel;
    let (scanned, scanned_rx) = sync_channel::<()>(1);
    let (held, held_rx) = sync_channel::<bool>(1);
    std::thread::scope(|sc| {
        // A walker's stack: merging the trees read recurses once per level.
        let reader = tine_fs::paths::spawn_walker(sc, move || {
            read(&mut || {
                let _ = scanned.send(());
                // No answer (the other side is gone): the files did not hold.
                held_rx.recv().unwrap_or(false)
            })
        });
        let state = stopped.make_templates();
        // The read is over (or failed, or panicked, or never started: the
        // sender is dropped).
        let _ = scanned_rx.recv();
        let joined = stopped.joined(cg);
        let (paused, unsettled) = stopped.resume();
        let _ = held.send(!joined);
        // Settled while the reader stores what it read.
        unsettled.settle();
        let read = reader.and_then(|h| {
            h.join()
                .map_err(|_| std::io::Error::other("the reading thread panicked"))
        });
        (state, read, paused)
    })
}

/// A live sandbox frozen (or nothing, without a cgroup), thawed on the
/// first [`Freeze::thaw`] or when dropped: no early return or panic leaves
/// it frozen.
struct Freeze<'a> {
    cg: Option<&'a crate::cgroup::Cgroup>,
    /// When the freeze was asked for.
    t0: std::time::Instant,
    /// How long it was frozen, once thawed.
    thawed: Option<Duration>,
}

impl<'a> Freeze<'a> {
    /// Freezes `cg`. Callers start the worker threads first
    /// ([`tine_fs::warm_up`]), so that the frozen window does not pay for them.
    fn begin(
        rec: &SandboxRecord,
        cg: Option<&'a crate::cgroup::Cgroup>,
    ) -> Result<Freeze<'a>, SandboxError> {
        let t0 = std::time::Instant::now();
        if let Some(cg) = cg
            && let Err(e) = cg.freeze(Duration::from_secs(5))
        {
            // A freeze that did not complete (a task stuck in the kernel) must
            // not leave the group FREEZING: the sandbox would hang.
            let _ = cg.thaw();
            return Err(io_error(&rec.name, "freeze", &cg.dirs()[0])(
                std::io::Error::other(e.to_string()),
            ));
        }
        Ok(Freeze {
            cg,
            t0,
            thawed: None,
        })
    }

    /// Thaws (the first time); how long the sandbox was frozen, in ms (0
    /// without a cgroup).
    fn thaw(&mut self) -> f64 {
        let took = *self.thawed.get_or_insert_with(|| {
            if let Some(cg) = self.cg {
                let _ = cg.thaw();
            }
            self.t0.elapsed()
        });
        if self.cg.is_some() {
            took.as_secs_f64() * 1e3
        } else {
            0.0
        }
    }
}

impl Drop for Freeze<'_> {
    fn drop(&mut self) {
        self.thaw();
    }
}

/// What a sandbox snapshot does with the processes.
#[derive(Debug, Clone, Default)]
pub struct ProcessOptions {
    /// Capture the files only.
    pub files_only: bool,
    /// The template pool's limits, enforced after each capture.
    pub pool: crate::processes::PoolLimits,
    /// Also persist the templates with this CRIU (after the thaw: the
    /// program runs on meanwhile), so they outlive eviction and reboots.
    pub persist: Option<crate::criu::Criu>,
}

/// How long a live sandbox's processes were stopped.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Frozen {
    /// Freeze requested to thaw done, in ms; 0 when nothing was running.
    pub frozen_ms: f64,
    /// Processes whose state was captured (snapshot) or brought back (restore).
    pub processes: usize,
    /// How long the program did not run, in ms (0 when no process state was
    /// involved): snapshot, from the first process stopped to the last one
    /// running again; restore, from the first process killed to the last
    /// copy running.
    pub paused_ms: f64,
    /// Snapshots whose templates the pool let go to stay within its limits.
    pub evicted: Vec<crate::processes::Evicted>,
    /// Snapshot: CRIU images written (`--persist`), and how long that took.
    pub persisted_bytes: u64,
    pub persist_ms: f64,
    /// Restore: templates first brought back from CRIU images.
    pub from_images: usize,
    /// Restore: the snapshot had process state, but it was let go (evicted
    /// without images, or the sandbox restarted): only the files went back.
    pub processes_let_go: usize,
}

/// Snapshots a sandbox's workspace, and (unless `files_only`) its processes:
/// they are stopped with ptrace, and each forks a template while the upper
/// layer is read (only what changed since its base); without processes, or
/// when one joined during the read, the sandbox is frozen for the read
/// instead. The processes run on before the pack is made durable.
pub fn snapshot(
    lock: &WriteLock<'_>,
    rec: &SandboxRecord,
    opts: &tine_fs::SnapshotOptions,
    procs: &ProcessOptions,
    progress: &dyn Progress,
) -> Result<(tine_fs::SnapshotOutcome, Frozen), SandboxError> {
    let repo = lock.repo();
    let spec = spec_of(rec)?;
    let dirs = SandboxDirs::new(repo.path(), &rec.id);
    // The sandbox's ledger head goes with the snapshot (a restore or a fork
    // of it starts its ledger there).
    let mut with_head;
    let opts = match repo.ledger_head(&rec.id)? {
        Some(entry) => {
            let mac = repo.ledger_row(entry)?.map(|r| r.mac).unwrap_or_default();
            with_head = opts.clone();
            with_head.notes.push((
                tine_store::ledger::HEAD_NOTE.to_string(),
                tine_store::ledger::head_note(entry, &mac),
            ));
            &with_head
        }
        None => opts,
    };
    if let Isolation::None { .. } = spec.isolation {
        let out = tine_fs::snapshot(lock, &dirs.plain(), opts, progress)?;
        return Ok((out, Frozen::default()));
    }
    let cg = live_cgroup(rec);
    // Before the processes stop: their pause does not pay for threads.
    tine_fs::warm_up();
    let mut frozen_ms = 0.0;
    let mut paused_ms = 0.0;
    let mut retried = false;
    let mut must_freeze = false;
    let (out, state) = loop {
        // Loaded before the freeze: the frozen window pays only for the reading.
        let ws = layered(repo, &spec, &dirs)?;
        let pack = lock.pack().map_err(tine_fs::SnapshotError::from)?;
        // Processes are stopped and forked before the freeze (a frozen process
        // cannot be made to fork); stopped, they change nothing meanwhile.
        let stopped = match (&cg, rec.init_pid) {
            (Some(cg), Some(init)) if !procs.files_only => Some(
                crate::processes::stop_all(&rec.name, cg, init, &dirs)
                    .map_err(|e| process_error(&rec.name, e))?,
            ),
            _ => None,
        };
        // With every process of the sandbox stopped (init never writes to the
        // workspace, templates never run), nothing changes its files: no
        // freeze, and the files are read while the templates are made. One
        // that joins meanwhile is caught after the read, and the snapshot is
        // taken again, frozen.
        let skip = match &stopped {
            Some(s) => s.templates().to_vec(),
            None => crate::processes::template_pids(&dirs),
        };
        let key = head_key(&rec.id);
        let read =
            |pack, tracked: &Option<(Tracked, bool)>, after_scan: &mut dyn FnMut() -> bool| {
                tine_fs::snapshot_layered(
                    lock,
                    pack,
                    &ws,
                    &key,
                    tracked.as_ref().map(|(t, _)| t),
                    opts,
                    after_scan,
                    progress,
                )
            };
        let tracked_now = || {
            let mut t = tracked(&dirs, cg.as_ref(), &skip);
            if retried && let Some((t, _)) = &mut t {
                t.dirty = None;
            }
            t
        };
        // Frozen: the read, then `thawed` (the processes' resumption) as
        // soon as the files are read; returns the frozen time in ms.
        let read_frozen = |pack, thawed: &mut dyn FnMut()| {
            let mut freeze = Freeze::begin(rec, cg.as_ref())?;
            let tracked = tracked_now();
            let mut frozen_ms = 0.0;
            let out = read(pack, &tracked, &mut || {
                frozen_ms = freeze.thaw();
                thawed();
                true
            });
            // Also when the snapshot failed before reading anything.
            drop(freeze);
            Ok::<_, SandboxError>((out, tracked, frozen_ms))
        };
        let (mut state, out, tracked) = match (stopped, &cg) {
            (Some(stopped), Some(cg)) if !must_freeze => {
                let (state, read, paused) = read_while_templates_are_made(stopped, cg, |after| {
                    let t = tracked_now();
                    (read(pack, &t, after), t)
                });
                paused_ms += paused.as_secs_f64() * 1e3;
                let state = state.map_err(|e| process_error(&rec.name, e))?;
                let (out, tracked) = match read {
                    Ok(read) => read,
                    Err(e) => {
                        state.discard();
                        return Err(io_error(&rec.name, "read the workspace", &dirs.upper())(e));
                    }
                };
                (Some(state), out, tracked)
            }
            (None, _) => {
                // On a pool thread: the read starts in place, not handed over.
                let (out, tracked, thawed) = tine_fs::on_pool(|| read_frozen(pack, &mut || {}))?;
                frozen_ms += thawed;
                (None, out, tracked)
            }
            (Some(mut stopped), _) => {
                // A process joined during an unfrozen read: frozen this time,
                // on this thread (the processes' tracer), which resumes them.
                let state = stopped
                    .make_templates()
                    .map_err(|e| process_error(&rec.name, e))?;
                let mut stopped = Some(stopped);
                let mut resume = || {
                    if let Some(s) = stopped.take() {
                        let (paused, unsettled) = s.resume();
                        paused_ms += paused.as_secs_f64() * 1e3;
                        unsettled.settle();
                    }
                };
                let read = read_frozen(pack, &mut resume);
                // Also when the read failed before thawing.
                resume();
                let (out, tracked, thawed) = match read {
                    Ok(read) => read,
                    Err(e) => {
                        state.discard();
                        return Err(e);
                    }
                };
                frozen_ms += thawed;
                (Some(state), out, tracked)
            }
        };
        match out {
            // The tracker's claim did not hold up: read everything, frozen
            // again, with templates made again (the processes ran meanwhile).
            Err(tine_fs::SnapshotError::TrackerStale { .. }) if !retried => {
                if let Some(st) = state.take() {
                    st.discard();
                }
                retried = true
            }
            // A process joined while the files were read unfrozen: again, frozen.
            Err(tine_fs::SnapshotError::Interfered { .. }) if !must_freeze => {
                if let Some(st) = state.take() {
                    st.discard();
                }
                must_freeze = true
            }
            Ok(o) => {
                if let Some((t, mapped)) = tracked {
                    supervisor::clean(&dirs, t.now.seq, mapped);
                }
                break (o, state);
            }
            Err(e) => {
                if let Some(st) = state.take() {
                    st.discard();
                }
                return Err(e.into());
            }
        }
    };
    let (mut persisted_bytes, mut persist_ms) = (0, 0.0);
    let processes = match state {
        Some(mut st) => {
            st.snapshot = out.id.to_hex();
            let n = st.processes.len();
            crate::processes::save(&dirs, &st).map_err(|e| {
                st.discard();
                io_error(&rec.name, "record templates", &dirs.root)(e)
            })?;
            if let (Some(criu), Some(cg)) = (&procs.persist, &cg) {
                let t0 = std::time::Instant::now();
                persisted_bytes = crate::processes::persist(&rec.name, criu, cg, &dirs, &mut st)
                    .map_err(|source| SandboxError::Persist {
                        name: rec.name.clone(),
                        snapshot: out.id.to_hex(),
                        source: Box::new(source),
                    })?;
                persist_ms = t0.elapsed().as_secs_f64() * 1e3;
            }
            n
        }
        None => 0,
    };
    let evicted = if processes > 0 {
        crate::processes::enforce(repo.path(), procs.pool)
    } else {
        Vec::new()
    };
    Ok((
        out,
        Frozen {
            frozen_ms,
            processes,
            paused_ms,
            evicted,
            persisted_bytes,
            persist_ms,
            ..Frozen::default()
        },
    ))
}

pub(crate) fn process_error(name: &str, e: crate::processes::ProcessError) -> SandboxError {
    SandboxError::Process {
        name: name.to_string(),
        source: e,
    }
}

/// Rolls a sandbox's workspace back (or forward) to `snap`, in place through its
/// overlay while it runs: frozen, only the differing paths rewritten (open files
/// see the new content), thawed. When `snap` holds live templates of this
/// sandbox (and not `files_only`), its processes go back too: the live ones
/// are killed and copies of the templates take their PIDs, after the files.
pub fn restore(
    lock: &WriteLock<'_>,
    rec: &SandboxRecord,
    snap: &ObjectId,
    files_only: bool,
    criu: Option<&crate::criu::Criu>,
    progress: &dyn Progress,
) -> Result<(tine_fs::RestoreOutcome, Frozen), SandboxError> {
    let repo = lock.repo();
    let spec = spec_of(rec)?;
    let dirs = SandboxDirs::new(repo.path(), &rec.id);
    let ledger_head = tine_store::ledger::head_of(repo, snap)?;
    if let Isolation::None { .. } = spec.isolation {
        let out = tine_fs::restore_with(lock, snap, &dirs.plain(), IN_REPOSITORY, progress)?;
        tine_ledger::set_head(lock, &rec.id, ledger_head)?;
        return Ok((out, Frozen::default()));
    }
    let ws = layered(repo, &spec, &dirs)?;
    let ov = dirs.overlay(&spec);
    // Mounted for this restore only when the sandbox is not running.
    let _unmount = if ov.is_mounted() {
        None
    } else {
        mount(repo, &rec.name, &ov)?;
        Some(crate::overlay::Unmounting(&ov))
    };
    let cg = live_cgroup(rec);
    // Before any process is killed or frozen: the pause pays for no thread.
    tine_fs::warm_up();
    // A first pass while the sandbox still runs loads the trees it needs into
    // the block cache; the pass that counts happens frozen, below.
    let early = cg
        .as_ref()
        .and_then(|_| supervisor::dirty(&dirs))
        .map(|r| r.tracked());
    let _ = current_tree(repo, &ws, early.as_ref(), progress);
    let templates = crate::processes::template_pids(&dirs);
    // Frozen, unless a rollback killed every process but init (which never
    // writes to the workspace) and the templates (which never run).
    // On a pool thread: the scan and the writes start in place, not handed over.
    let files = |frozen: bool| -> Result<(tine_fs::RestoreOutcome, f64), SandboxError> {
        tine_fs::on_pool(|| {
            let mut freeze = Freeze::begin(rec, if frozen { cg.as_ref() } else { None })?;
            let tracked = tracked(&dirs, cg.as_ref(), &templates).map(|(t, _)| t);
            let result = repo.in_read_transaction(|| {
                let (current, made) = current_tree(repo, &ws, tracked.as_ref(), progress)?;
                Ok::<_, SandboxError>(tine_fs::restore_known(
                    lock,
                    snap,
                    &dirs.merged(),
                    current,
                    made,
                    tine_fs::RestoreOptions::sandbox(Some(sandbox_owner(repo))),
                    progress,
                )?)
            });
            let frozen_ms = freeze.thaw();
            Ok((result?, frozen_ms))
        })
    };
    // The snapshot's processes: from their templates in this sandbox, or
    // from CRIU images; a state that was let go leaves the processes alone.
    let recorded = match (&cg, files_only) {
        (Some(_), false) => crate::processes::load(&dirs, snap),
        _ => None,
    };
    let (mut state, let_go) = match recorded {
        Some(st) if st.restorable(criu.is_some()) => (Some(st), 0),
        Some(st) => (None, st.processes.len()),
        None => (None, 0),
    };
    let (files, rolled, paused_ms) = match (&mut state, &cg, rec.init_pid) {
        (Some(st), Some(cg), Some(init)) => {
            let (files, rolled) =
                crate::processes::rollback(&rec.name, cg, &dirs, init, st, criu, files)
                    .map_err(|e| process_error(&rec.name, e))?;
            crate::processes::touch(&dirs, snap);
            let paused = rolled.paused.as_secs_f64() * 1e3;
            (files, rolled, paused)
        }
        _ => (files(true), crate::processes::Rolled::default(), 0.0),
    };
    let (result, frozen) = match files {
        Ok((out, frozen_ms)) => (
            Ok(out),
            Frozen {
                frozen_ms,
                processes: rolled.pids.len(),
                paused_ms,
                from_images: rolled.from_images,
                processes_let_go: let_go,
                ..Frozen::default()
            },
        ),
        Err(e) => (Err(e), Frozen::default()),
    };
    // Recorded after the thaw: the sandbox need not wait for this fsync.
    if result.is_ok() {
        lock.set_head(&head_key(&rec.id), snap)
            .map_err(tine_fs::RestoreError::from)?;
        // The visible ledger rewinds with it (every entry stays stored).
        tine_ledger::set_head(lock, &rec.id, ledger_head)?;
    }
    Ok((result?, frozen))
}

/// The sandbox a snapshot was taken from (its `source` is `sandbox:ID`).
pub fn sandbox_of_source(repo: &Repository, source: &str) -> Option<SandboxRecord> {
    let id = source.strip_prefix("sandbox:")?;
    repo.sandbox(id).ok().filter(|r| r.id == id)
}

/// Changes from snapshot `a` to a sandbox's workspace as it is now (reading
/// only its upper layer); also where its live files can be read.
pub fn diff_live(
    repo: &Repository,
    rec: &SandboxRecord,
    a: &ObjectId,
    progress: &dyn Progress,
) -> Result<(Vec<tine_fs::Change>, PathBuf), SandboxError> {
    let spec = spec_of(rec)?;
    let dirs = SandboxDirs::new(repo.path(), &rec.id);
    if let Isolation::None { .. } = spec.isolation {
        let d = dirs.plain();
        return Ok((tine_fs::diff_with_dir(repo, a, &d, progress)?, d));
    }
    let templates = crate::processes::template_pids(&dirs);
    let tracked = tracked(&dirs, live_cgroup(rec).as_ref(), &templates).map(|(t, _)| t);
    let ws = layered(repo, &spec, &dirs)?;
    let (root, made) = current_tree(repo, &ws, tracked.as_ref(), progress)?;
    let tree = repo
        .read_snapshot(a)
        .map_err(tine_fs::SnapshotError::from)?
        .tree;
    let changes = tine_fs::diff_trees(&tine_fs::Trees::new(repo, Some(&made)), &tree, &root)
        .map_err(tine_fs::SnapshotError::from)?;
    Ok((changes, dirs.merged()))
}

/// What `tine fork SNAP -n N` (into sandboxes) asks for.
#[derive(Debug, Clone, Default)]
pub struct ForkOptions {
    /// Names are PREFIX-1 .. PREFIX-N (default: the ids).
    pub prefix: Option<String>,
    /// The command; default: that of the sandbox the snapshot was taken from.
    pub command: Vec<String>,
    /// Create the sandboxes without starting them.
    pub no_start: bool,
    /// Start the command afresh even when the snapshot holds processes.
    pub files_only: bool,
    /// Brings the snapshot's processes into the forks (persisting its
    /// templates first when they are not yet) when native forks cannot.
    pub criu: Option<crate::criu::Criu>,
    /// Go through CRIU even where native forks can be made.
    pub through_criu: bool,
}

/// How a fork's processes came to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ForkVia {
    /// Its command started afresh (or it was not started).
    #[default]
    Afresh,
    /// Cloned from the live template (`nested`).
    Native,
    /// Restored from CRIU images.
    Criu,
}

/// What a fork made.
#[derive(Debug, Clone, Default)]
pub struct Forked {
    pub records: Vec<SandboxRecord>,
    /// Processes each fork got from the snapshot (0: its command started afresh).
    pub processes: usize,
    /// Time spent persisting the snapshot's templates first, in ms.
    pub persist_ms: f64,
    /// Why the snapshot's processes were not brought (they started afresh),
    /// or not natively.
    pub note: Option<String>,
    pub via: ForkVia,
}

/// Forks snapshot `snap` into `n` new sandboxes over one shared lower layer.
/// For a snapshot of a sandbox the lower layer is that sandbox's, and each new
/// upper layer is seeded with just the snapshot's difference from it, written
/// through the new overlay. Returns the new records (started unless `no_start`).
///
/// When the snapshot holds processes of its sandbox (and with CRIU), each
/// fork starts holding, without its command, and gets them from the
/// templates' CRIU images (persisted first if they are not yet): restored
/// into the fork as templates, then cloned under their PIDs as a rollback
/// does. Native clones of the live templates cannot be moved into another
/// sandbox's namespaces without privileges the sandboxes do not have.
pub fn fork(
    lock: &WriteLock<'_>,
    snap: &ObjectId,
    n: usize,
    opts: &ForkOptions,
    exe: &Path,
    progress: &dyn Progress,
) -> Result<Forked, SandboxError> {
    if n == 0 {
        return Ok(Forked::default());
    }
    let repo = lock.repo();
    let source = sandbox_of_source(repo, &repo.read_snapshot(snap)?.source);
    let source_spec = source.as_ref().map(spec_of).transpose()?;
    let command = if opts.command.is_empty() {
        source_spec
            .as_ref()
            .map(|s| s.command.clone())
            .ok_or(SandboxError::NoCommand)?
    } else {
        opts.command.clone()
    };
    let isolation = isolation_available();
    let mut forked = Forked::default();
    let mut native = None;
    let procs = match &source {
        Some(src)
            if !opts.files_only
                && !opts.no_start
                && opts.command.is_empty()
                && isolation == Isolation::Full =>
        {
            let private = PrivateMounts::of(src.init_pid);
            match crate::nested::plan(src, snap, repo.path(), &private) {
                Ok(plan) if !opts.through_criu => {
                    native = Some(plan);
                    None
                }
                Err(no) if !no.criu_can => {
                    forked.note = Some(format!("{}: the forks start their command afresh", no.why));
                    None
                }
                planned => {
                    let criu = opts.criu.as_ref();
                    let procs =
                        fork_processes(src, snap, &private, criu, repo.path(), &mut forked)?;
                    if let (Err(no), Some(_), None) = (planned, &procs, &forked.note) {
                        forked.note = Some(format!("{}: through CRIU instead of natively", no.why));
                    }
                    procs
                }
            }
        }
        _ => None,
    };
    // The shared lower layer, and the tree it holds.
    let (base, lower) = match &source_spec {
        Some(s) if s.isolation == Isolation::Full && isolation == Isolation::Full => {
            (base_of(s), s.lower.clone())
        }
        _ => (
            Some(*snap),
            materialize_base(lock, Some(snap), &isolation, progress)?,
        ),
    };
    let (base_tree, made) = match &base {
        Some(b) => (repo.read_snapshot(b)?.tree, HashMap::new()),
        None => {
            let empty = tine_store::Tree::default();
            let id = ObjectId::compute(tine_store::Kind::Tree, &empty.encode());
            (id, HashMap::from([(id, empty)]))
        }
    };
    let template = source_spec.unwrap_or(RunSpec {
        command: command.clone(),
        env: vec![("PATH".into(), crate::DEFAULT_PATH.into())],
        limits: Limits::default().or_defaults(crate::cgroup::host_memory()),
        net: Net::None,
        restart: Restart::No,
        rootfs: None,
        base: None,
        lower: lower.clone(),
        isolation: isolation.clone(),
        stop_timeout_ms: 10_000,
        seccomp: true,
    });
    let mut out = Vec::with_capacity(n);
    for k in 1..=n {
        let id = new_id();
        let name = match &opts.prefix {
            Some(p) => format!("{p}-{k}"),
            None => id.clone(),
        };
        if !valid_name(&name) {
            return Err(SandboxError::BadName { name });
        }
        let spec = RunSpec {
            command: command.clone(),
            base: base.map(|b| b.to_hex()),
            lower: lower.clone(),
            isolation: isolation.clone(),
            ..template.clone()
        };
        let root = SandboxDirs::new(repo.path(), &id).root;
        std::fs::create_dir_all(&root).map_err(io_error(&name, "create", &root))?;
        out.push(new_record(
            id,
            name,
            if opts.no_start { CREATED } else { STARTING },
            &spec,
        ));
    }
    let first = &out[0];
    let first_dirs = SandboxDirs::new(repo.path(), &first.id);
    match &isolation {
        Isolation::Full => {
            // Only the snapshot's difference from the lower layer is written, once,
            // through the first fork's mount; the others copy its upper layer.
            let ov = first_dirs.overlay(&spec_of(first)?);
            mount(repo, &first.name, &ov)?;
            tine_fs::restore_known(
                lock,
                snap,
                &first_dirs.merged(),
                base_tree,
                made,
                tine_fs::RestoreOptions::sandbox(Some(sandbox_owner(repo))),
                &NoProgress,
            )?;
            if opts.no_start {
                let _ = ov.unmount();
            }
        }
        Isolation::None { .. } => {
            for rec in &out {
                let plain = SandboxDirs::new(repo.path(), &rec.id).plain();
                tine_fs::restore_with(lock, snap, &plain, IN_REPOSITORY, &NoProgress)?;
            }
        }
    }
    // Records and heads in one transaction: one fsync for all forks.
    lock.record_sandboxes(
        &out,
        &out.iter()
            .map(|r| (head_key(&r.id), *snap))
            .collect::<Vec<_>>(),
    )?;
    // Each fork inherits the ledger up to the snapshot.
    let ledger_head = tine_store::ledger::head_of(repo, snap)?;
    for r in &out {
        tine_ledger::set_head(lock, &r.id, ledger_head)?;
    }
    // The other forks are seeded, mounted and started in parallel: a start is
    // mostly waiting on new processes, and a seed on the filesystem.
    let seed = |k: usize, rec: &SandboxRecord| -> Result<(), SandboxError> {
        if k > 0 && isolation == Isolation::Full {
            let ov = SandboxDirs::new(repo.path(), &rec.id).overlay(&spec_of(rec)?);
            ov.make_upper()
                .map_err(overlay_error(&rec.name, "make upper layer", &ov.upper))?;
            crate::overlay::copy_upper(&first_dirs.upper(), &ov.upper).map_err(io_error(
                &rec.name,
                "seed upper layer",
                &ov.upper,
            ))?;
            if !opts.no_start {
                mount(repo, &rec.name, &ov)?;
            }
        }
        if opts.no_start {
            return Ok(());
        }
        if let Some(plan) = &native {
            let nested = crate::nested::fork_into(plan, rec, &spec_of(rec)?, repo.path(), exe)?;
            return launch_with(repo, rec, exe, FirstRun::Adopt(nested.init_pid));
        }
        let Some((st, src_dirs, criu)) = &procs else {
            return launch(repo, rec, exe);
        };
        let dirs = SandboxDirs::new(repo.path(), &rec.id);
        let mut own = crate::processes::adopt(&rec.name, st, src_dirs, &dirs)
            .map_err(|e| process_error(&rec.name, e))?;
        launch_from_images(repo, rec, exe, &mut own, criu)
    };
    let results: Vec<Result<(), SandboxError>> = std::thread::scope(|sc| {
        // Seeding walks the snapshot's tree: threads with stacks for it.
        let handles: Vec<_> = out
            .iter()
            .enumerate()
            .map(|(k, rec)| tine_fs::paths::spawn_walker(sc, move || seed(k, rec)))
            .collect();
        handles
            .into_iter()
            .zip(&out)
            .map(|(h, rec)| {
                let failed = |e: std::io::Error| io_error(&rec.name, "seed", Path::new(&rec.id))(e);
                h.map_err(failed)?.join().unwrap_or_else(|_| {
                    Err(failed(std::io::Error::other("the seeding thread panicked")))
                })
            })
            .collect()
    });
    for r in results {
        r?;
    }
    (forked.processes, forked.via) = match (&native, &procs) {
        (Some(_), _) => (1, ForkVia::Native),
        (None, Some((st, _, _))) => (st.processes.len(), ForkVia::Criu),
        (None, None) => (0, ForkVia::Afresh),
    };
    forked.records = out;
    Ok(forked)
}

/// The process state forks of `snap` get from `src`, persisted with CRIU
/// first if it is not yet; `None` (with a note in `forked`) when they start
/// their command afresh instead.
fn fork_processes(
    src: &SandboxRecord,
    snap: &ObjectId,
    private_mounts: &PrivateMounts,
    criu: Option<&crate::criu::Criu>,
    repo_path: &Path,
    forked: &mut Forked,
) -> Result<Option<(ProcessState, SandboxDirs, crate::criu::Criu)>, SandboxError> {
    let src_dirs = SandboxDirs::new(repo_path, &src.id);
    let Some(mut st) = crate::processes::load(&src_dirs, snap) else {
        return Ok(None);
    };
    // What lives in the sandbox's private mounts (not its workspace) is not
    // in the snapshot: a fork cannot give it back. (Descriptors of host
    // files, such as the sandbox's logs, are on other mounts.)
    let private = st.processes.iter().find_map(|c| {
        let external = |fd: i32| {
            c.image
                .as_ref()
                .is_some_and(|i| i.externals.iter().any(|x| x.fd == fd))
        };
        c.template.fds.iter().find_map(|e| match &e.target {
            tine_proc::FdTarget::Path { path } | tine_proc::FdTarget::Deleted { path }
                if private_mounts.hold(e, path, external(e.fd)) =>
            {
                Some((c, path.clone()))
            }
            _ => None,
        })
    });
    if let Some((c, path)) = private {
        forked.note = Some(format!(
            "process {} ({}) holds {}, in sandbox {}'s private {}, which is not part of snapshots: the forks start their command afresh",
            c.ns_pid,
            c.cmdline,
            path.display(),
            src.name,
            if path.starts_with("/tmp") {
                "/tmp"
            } else {
                "/dev/shm"
            }
        ));
        return Ok(None);
    }
    let Some(criu) = criu else {
        forked.note = Some(format!(
            "the snapshot holds {} of sandbox {}, but bringing processes into new sandboxes needs CRIU (scripts/install-criu.sh): the forks start their command afresh",
            plural_processes(st.processes.len()),
            src.name
        ));
        return Ok(None);
    };
    if !st.persisted() {
        let cg = live_cgroup(src).filter(|_| st.alive());
        let Some(cg) = cg else {
            forked.note = Some(format!(
                "the snapshot's processes were let go (evicted, or sandbox {} restarted) and were not persisted: the forks start their command afresh",
                src.name
            ));
            return Ok(None);
        };
        let t0 = std::time::Instant::now();
        match crate::processes::persist(&src.name, criu, &cg, &src_dirs, &mut st) {
            Ok(_) => {}
            // What CRIU cannot persist, forks cannot get: they start afresh.
            Err(e) if process_kind(&e) == ErrorKind::Unsupported => {
                forked.note = Some(format!("{e}: the forks start their command afresh"));
                return Ok(None);
            }
            Err(e) => return Err(process_error(&src.name, e)),
        }
        forked.persist_ms = t0.elapsed().as_secs_f64() * 1e3;
    }
    Ok(Some((st, src_dirs, criu.clone())))
}

/// A sandbox's private, unsnapshotted mounts (`/tmp`, `/dev/shm` and below,
/// in the mount namespace of its init): what lives there a fork cannot get.
pub(crate) struct PrivateMounts(std::collections::HashSet<u64>);

impl PrivateMounts {
    pub(crate) fn of(init_pid: Option<u32>) -> PrivateMounts {
        let Some(pid) = init_pid else {
            return PrivateMounts(Default::default());
        };
        PrivateMounts(
            std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))
                .unwrap_or_default()
                .lines()
                .filter_map(|l| {
                    let mut f = l.split_whitespace();
                    let id = f.next()?.parse().ok()?;
                    let point = f.nth(3)?;
                    let private = ["/tmp", "/dev/shm"]
                        .iter()
                        .any(|p| point == *p || point.starts_with(&format!("{p}/")));
                    private.then_some(id)
                })
                .collect(),
        )
    }

    /// Whether descriptor `e` (open on `path`) is on one of them. Without
    /// the mount ids (the sandbox is not running) the path decides, unless
    /// the caller knows the file lives elsewhere (`outside`).
    pub(crate) fn hold(&self, e: &tine_proc::FdEntry, path: &Path, outside: bool) -> bool {
        e.mnt_id.is_some_and(|m| self.0.contains(&m))
            || (self.0.is_empty()
                && !outside
                && (path.starts_with("/tmp") || path.starts_with("/dev/shm")))
    }
}

fn plural_processes(n: usize) -> String {
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
