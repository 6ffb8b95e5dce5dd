//! A sandbox's life: options checked, prepared (its base, workspace and
//! record), its supervisor launched, viewed, stopped and removed.

use super::*;

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
    /// Its root is this image's (`from` is the image's snapshot).
    pub image: Option<crate::ns::ImageRoot>,
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

pub(super) fn new_id() -> String {
    use std::hash::BuildHasher;
    let h = std::collections::hash_map::RandomState::new()
        .hash_one((std::time::SystemTime::now(), std::process::id()));
    format!("{:012x}", h & 0xffff_ffff_ffff)
}

/// The base snapshot materialized once, read-only by convention, shared by
/// every sandbox built on it (`REPO/bases/HEX`; `HEX.complete` marks it done).
pub(super) fn materialize_base(
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
        let ids = (*isolation == Isolation::Full).then(|| sandbox_ids(lock.repo()));
        tine_fs::restore_with(
            lock,
            id,
            &dir,
            tine_fs::RestoreOptions::sandbox(ids),
            progress,
        )?;
        if let Some((uid, gid)) = ids.map(|m| m.root()) {
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
    if opts.image.is_some() && (opts.rootfs.is_some() || opts.workspace.is_some()) {
        return Err(SandboxError::ImageWith {
            what: if opts.rootfs.is_some() {
                "--rootfs"
            } else {
                "--workspace"
            },
        });
    }
    if opts.image.is_some() && isolation != Isolation::Full {
        return Err(SandboxError::ImageUnisolated {
            reason: match &isolation {
                Isolation::None { reason } => reason.clone(),
                Isolation::Full => String::new(),
            },
        });
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
        image: opts.image.clone(),
    };
    let rec = new_record(id, name, SandboxState::Starting, &spec);
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
pub(super) fn launch_from_images(
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
    let none = crate::processes::NoneAhead;
    crate::processes::rollback(
        &rec.name,
        &cg,
        &dirs,
        files_at(rec),
        init,
        own,
        Some(criu),
        |_| (),
        &none,
    )
    .map_err(|e| process_error(&rec.name, e))?;
    Ok(())
}

/// [`launch`], with the first run begun as `first_run` says (held: its
/// processes are brought from templates next, then init is released;
/// adopted: a native fork's init already runs).
pub(super) fn launch_with(
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
        FirstRun::Prepared(pid) => {
            child.arg("--prepared").arg(pid.to_string());
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
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct SandboxView {
    pub id: String,
    pub name: String,
    /// The recorded state, or `stale` when its supervisor is gone.
    pub state: SandboxState,
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
    /// The image its root is (`sha256:HEX`); its files are then at `/`,
    /// not `/workspace`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
}

/// Whether the sandbox takes a place under a limit on live sandboxes: its
/// record says starting (its supervisor may not listen yet), or live with a
/// supervisor there. Unlike [`view`], a supervisor too busy to answer in
/// time (many sandboxes starting at once) still counts, so a capacity check
/// never lets one more in.
pub fn holds_a_place(repo: &Repository, rec: &SandboxRecord) -> bool {
    rec.state == SandboxState::Starting
        || (rec.state.is_live() && supervisor::reachable(&SandboxDirs::new(repo.path(), &rec.id)))
}

impl SandboxView {
    /// Starting, running or restarting (as its supervisor says).
    pub fn live(&self) -> bool {
        self.state.is_live()
    }

    /// It ran and is over (exited or stopped), as opposed to live, created or stale.
    pub fn ended(&self) -> bool {
        self.state.has_ended()
    }
}

/// The sandbox's current view, asking its supervisor when the record says live.
pub fn view(repo: &Repository, rec: &SandboxRecord) -> SandboxView {
    let dirs = SandboxDirs::new(repo.path(), &rec.id);
    let mut rec = rec.clone();
    if rec.state.is_live() {
        match supervisor::request(&dirs, &Request::Status, Duration::from_millis(500)) {
            Some(r) => rec = r,
            None => rec.state = SandboxState::Stale,
        }
    }
    let spec = RunSpec::of(&rec).ok();
    SandboxView {
        id: rec.id.clone(),
        name: rec.name.clone(),
        state: rec.state,
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
        image: spec.and_then(|s| s.image.map(|i| i.image)),
    }
}

/// Where sandbox `rec`'s files are as its processes see them: `/workspace`,
/// or `/` when its root is an image's.
pub(crate) fn files_at(rec: &SandboxRecord) -> &'static Path {
    match RunSpec::of(rec).map(|s| s.image.is_some()) {
        Ok(true) => Path::new("/"),
        _ => Path::new(crate::ns::WORKSPACE),
    }
}

impl SandboxView {
    /// Where its files are as its processes see them: `/workspace`, or `/`
    /// when its root is an image's.
    pub fn files_at(&self) -> &'static str {
        if self.image.is_some() {
            "/"
        } else {
            crate::ns::WORKSPACE
        }
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
    if rec.state.is_live() {
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
            r.state = SandboxState::Stopped;
            repo.save_sandbox(&r)?;
        }
    }
    Ok(view(repo, &repo.sandbox(&rec.id)?))
}

/// Refuses to end sandbox `rec` while native forks of it run: their PID
/// namespaces are nested in its init's and would end with it. Its prepared
/// forks (`prepared`), which no one uses yet, are removed first.
fn refuse_with_forks(repo: &Repository, rec: &SandboxRecord) -> Result<(), SandboxError> {
    super::prepared::discard(repo, &rec.id);
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
        // (Held while frozen, so that the supervisor does not take the
        // freeze for one left behind.)
        let _held = super::freeze::take_freeze_lock(&dirs);
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
    if v.state.is_live() {
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
    remove_dir(&dirs.root).map_err(io_error(&rec.name, "remove", &dirs.root))?;
    repo.delete_sandbox(&rec.id)?;
    Ok(())
}

/// Removes a stopped sandbox's directory. What its processes were doing as
/// they were stopped (a supervisor's last words, a session's status) may
/// still land in it for a moment: found not empty, it is tried again.
fn remove_dir(root: &Path) -> std::io::Result<()> {
    let mut tries = 0;
    loop {
        match std::fs::remove_dir_all(root) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::DirectoryNotEmpty && tries < 20 => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(e),
        }
    }
}

/// The record of a sandbox not started yet.
pub(super) fn new_record(
    id: String,
    name: String,
    state: SandboxState,
    spec: &RunSpec,
) -> SandboxRecord {
    let t = now_ns();
    SandboxRecord {
        id,
        name,
        created_ns: t,
        updated_ns: t,
        state,
        spec: serde_json::to_string(spec).unwrap_or_default(),
        supervisor_pid: None,
        init_pid: None,
        restarts: 0,
        exit: None,
    }
}
