//! The per-sandbox supervisor: a small process that outlives the CLI call (like
//! a container shim). It holds the sandbox's cgroup and overlay, starts its init,
//! restarts it according to the restart policy, stops it gracefully, records the
//! termination reason, and answers requests on a unix socket.
//!
//! Protocol on `SANDBOX_DIR/sock`: one JSON request per connection, one JSON
//! line in reply. `{"op":"status"}` → the record; `{"op":"stop","timeout_ms":N}`
//! → the record once the sandbox has stopped; `{"op":"dirty"}` → the change
//! tracker's [`DirtyReply`] (upper directories changed since the last
//! snapshot); `{"op":"clean","seq":N,"mapped":B}` → `{}` once the tracker
//! knows a snapshot read everything up to position N (and whether it saw a
//! shared writable mapping of a workspace file);
//! `{"op":"keep","pid":P,"start":S,"from":C,"fd":F}` → `{"holder":H,"fd":N}`:
//! the supervisor takes descriptor F of process C (the userfaultfd that
//! tracks the memory of the sandbox's process P, started at S) and holds it
//! as its own N while P runs; `{"op":"tracker","pid":P,"start":S}` → the
//! same reply for the one it holds (or `{}`);
//! `{"op":"prepare","snapshot":HEX,"items":[…]}` → `{}` once it started
//! preparing a checkpoint's templates on a thread of its own
//! (`processes::prepare`); `{"op":"quiesce","finish":B}` → `{"report":R}`
//! once no preparation runs: one still running is told to stop after the
//! step in hand (B: let finish), and R (or null) says how far the last one
//! got.

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tine_store::{ErrorKind, HasKind, Repository, SandboxRecord, SandboxState, now_ns};

use crate::cgroup::{Cgroup, CgroupRoot, DEFAULT_ROOT, Limits};
use crate::ns::{self, InitSpec, Net};
use crate::overlay::Overlay;
use crate::watch::{self, DirtyReply, Watcher};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum Restart {
    #[default]
    No,
    OnFailure,
    Always,
}

/// How a sandbox is isolated.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Isolation {
    /// Namespaces, cgroup, overlay workspace.
    Full,
    /// The command runs directly in a plain directory (no root, or no kernel support).
    None { reason: String },
}

/// A record's run options that do not parse: a damaged repository (or one
/// from a newer tine), `corrupt`.
#[derive(Debug, thiserror::Error)]
#[error("sandbox {name}: its record's run options do not parse: {source}")]
pub struct SpecError {
    pub name: String,
    pub source: serde_json::Error,
}

impl HasKind for SpecError {
    fn kind(&self) -> ErrorKind {
        ErrorKind::Corrupt
    }
}

impl RunSpec {
    /// The run options a sandbox's record holds (the one place they are parsed).
    pub fn of(rec: &SandboxRecord) -> Result<RunSpec, SpecError> {
        serde_json::from_str(&rec.spec).map_err(|source| SpecError {
            name: rec.name.clone(),
            source,
        })
    }
}

/// A sandbox's run options, stored with its record.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunSpec {
    pub command: Vec<String>,
    pub env: Vec<(String, String)>,
    pub limits: Limits,
    pub net: Net,
    pub restart: Restart,
    pub rootfs: Option<PathBuf>,
    /// Base snapshot (hex id), if any.
    pub base: Option<String>,
    /// The read-only lower layer (the base materialized once).
    pub lower: PathBuf,
    pub isolation: Isolation,
    pub stop_timeout_ms: u64,
    /// Its processes run under the seccomp filter (records from before the
    /// filter existed: off, as their processes were started).
    #[serde(default)]
    pub seccomp: bool,
    /// Its root is an image's (`ns::ImageRoot`); `None`: the host's root
    /// read-only (or `rootfs`) and the workspace at `/workspace`.
    #[serde(default)]
    pub image: Option<crate::ns::ImageRoot>,
}

/// Why the last run ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Exit {
    /// Exit code, or 128 + signal.
    pub code: i32,
    pub signal: Option<i32>,
    /// The kernel's OOM killer acted in the sandbox during this run.
    pub oom: bool,
    /// `tine stop` asked for it.
    pub stopped: bool,
    pub at_ns: u64,
}

/// Where a sandbox's files live: `REPO/sandboxes/ID/`.
#[derive(Debug, Clone)]
pub struct SandboxDirs {
    pub root: PathBuf,
}

impl SandboxDirs {
    pub fn new(repo: &Path, id: &str) -> SandboxDirs {
        SandboxDirs {
            root: repo.join("sandboxes").join(id),
        }
    }
    pub fn upper(&self) -> PathBuf {
        self.root.join("upper")
    }
    pub fn work(&self) -> PathBuf {
        self.root.join("work")
    }
    /// The overlay's merged view (isolated sandboxes).
    pub fn merged(&self) -> PathBuf {
        self.root.join("merged")
    }
    /// The plain workspace directory (sandboxes without isolation).
    pub fn plain(&self) -> PathBuf {
        self.root.join("workspace")
    }
    pub fn stdout_log(&self) -> PathBuf {
        self.root.join("stdout.log")
    }
    pub fn stderr_log(&self) -> PathBuf {
        self.root.join("stderr.log")
    }
    pub fn supervisor_log(&self) -> PathBuf {
        self.root.join("supervisor.log")
    }
    /// Remembered merges of the workspace's directories (disposable).
    pub fn merge_memo(&self) -> PathBuf {
        self.root.join("merge.cache")
    }
    pub fn socket(&self) -> PathBuf {
        self.root.join("sock")
    }
    /// Held (flock) by whoever has the sandbox frozen.
    pub fn freeze_lock(&self) -> PathBuf {
        self.root.join("freeze.lock")
    }
    /// The status file of a native fork's init (`ns::Adopted`).
    pub fn init_status(&self) -> PathBuf {
        self.root.join("init.status")
    }
    /// Where a native fork's PID namespace is nested (`nested::NestedIn`).
    pub fn nested_in(&self) -> PathBuf {
        self.root.join("nested-in.json")
    }
    /// Marks a fork prepared ahead until it is claimed (empty file): one
    /// that ended unclaimed goes with its source's prepared forks.
    pub fn prepared_mark(&self) -> PathBuf {
        self.root.join("prepared")
    }
    /// Where the sandbox's files are seen from the host while it runs.
    pub fn workspace(&self, spec: &RunSpec) -> PathBuf {
        match spec.isolation {
            Isolation::Full => self.merged(),
            Isolation::None { .. } => self.plain(),
        }
    }
    pub fn overlay(&self, spec: &RunSpec) -> Overlay {
        Overlay {
            lower: spec.lower.clone(),
            upper: self.upper(),
            work: self.work(),
            merged: self.merged(),
            limit_bytes: spec.limits.disk_bytes,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SuperviseError {
    #[error(transparent)]
    Record(#[from] tine_store::RecordError),
    #[error(transparent)]
    Open(#[from] tine_store::OpenError),
    #[error(transparent)]
    Cgroup(#[from] crate::cgroup::CgroupError),
    #[error(transparent)]
    Overlay(#[from] crate::overlay::OverlayError),
    #[error(transparent)]
    Ns(#[from] crate::ns::NsError),
    #[error("sandbox {id}: {message}")]
    Start { id: String, message: String },
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error("sandbox {id}: {step} {}: {source}", path.display())]
    Io {
        id: String,
        step: &'static str,
        path: PathBuf,
        source: io::Error,
    },
}

impl HasKind for SuperviseError {
    fn kind(&self) -> ErrorKind {
        match self {
            SuperviseError::Record(e) => e.kind(),
            SuperviseError::Open(e) => e.kind(),
            SuperviseError::Cgroup(e) => e.kind(),
            SuperviseError::Overlay(e) => e.kind(),
            SuperviseError::Ns(e) => e.kind(),
            SuperviseError::Spec(e) => e.kind(),
            SuperviseError::Start { .. } => ErrorKind::Io,
            SuperviseError::Io { .. } => ErrorKind::Io,
        }
    }
}

/// A request to the supervisor.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
pub enum Request {
    Status,
    Stop {
        timeout_ms: u64,
    },
    Dirty,
    Clean {
        seq: u64,
        mapped: bool,
    },
    Keep {
        pid: u32,
        start: u64,
        from: u32,
        fd: i32,
    },
    Tracker {
        pid: u32,
        start: u64,
    },
    /// A prepared fork claimed by `tine fork`: take its record again (its
    /// name, now written), name its host so, and let its processes run.
    Claim,
    /// Prepare these templates of a checkpoint for what comes next.
    Prepare {
        snapshot: String,
        items: Vec<crate::processes::prepare::Item>,
    },
    /// Stop preparing (after the step in hand; `finish`: once all is
    /// prepared); answer once nothing is being prepared.
    Quiesce {
        #[serde(default)]
        finish: bool,
    },
}

/// Where the supervisor holds a process's tracker: its PID and descriptor.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Held {
    pub holder: u32,
    pub fd: i32,
}

/// Has the sandbox's supervisor hold `fd` (this process's) for as long as
/// process `pid` (started at `start`) runs; `None` when no supervisor takes it.
pub fn keep(
    dirs: &SandboxDirs,
    pid: u32,
    start: u64,
    fd: std::os::fd::BorrowedFd<'_>,
) -> Option<Held> {
    use std::os::fd::AsRawFd;
    let req = Request::Keep {
        pid,
        start,
        from: std::process::id(),
        fd: fd.as_raw_fd(),
    };
    serde_json::from_str(&request_line(dirs, &req, Duration::from_secs(2))?).ok()
}

/// A descriptor of the tracker the supervisor holds for `pid` (started at
/// `start`), taken from it; `None` when it holds none.
pub fn tracker(dirs: &SandboxDirs, pid: u32, start: u64) -> Option<std::os::fd::OwnedFd> {
    let held: Held = serde_json::from_str(&request_line(
        dirs,
        &Request::Tracker { pid, start },
        Duration::from_secs(2),
    )?)
    .ok()?;
    let p = rustix::process::pidfd_open(
        rustix::process::Pid::from_raw(held.holder as i32)?,
        rustix::process::PidfdFlags::empty(),
    )
    .ok()?;
    rustix::process::pidfd_getfd(&p, held.fd, rustix::process::PidfdGetfdFlags::empty()).ok()
}

/// The trackers a supervisor holds, by the PID of the process each tracks.
#[derive(Debug, Default)]
struct Trackers(std::collections::HashMap<u32, (u64, std::os::fd::OwnedFd)>);

impl Trackers {
    fn keep(&mut self, pid: u32, start: u64, from: u32, fd: i32) -> Option<Held> {
        // Those of processes that ended go.
        self.0
            .retain(|p, (s, _)| tine_proc::stat(*p).is_ok_and(|st| st.start_time == *s));
        let p = rustix::process::pidfd_open(
            rustix::process::Pid::from_raw(from as i32)?,
            rustix::process::PidfdFlags::empty(),
        )
        .ok()?;
        let taken =
            rustix::process::pidfd_getfd(&p, fd, rustix::process::PidfdGetfdFlags::empty()).ok()?;
        self.0.insert(pid, (start, taken));
        self.held(pid, start)
    }

    fn held(&self, pid: u32, start: u64) -> Option<Held> {
        use std::os::fd::AsRawFd;
        let (s, fd) = self.0.get(&pid)?;
        (*s == start).then(|| Held {
            holder: std::process::id(),
            fd: fd.as_raw_fd(),
        })
    }
}

/// Sends one request to a sandbox's supervisor; its reply line, or `None`
/// when none answers.
fn request_line(dirs: &SandboxDirs, req: &Request, timeout: Duration) -> Option<String> {
    send(dirs, req, timeout)?.reply()
}

/// A request sent, its answer not read yet.
#[derive(Debug)]
pub struct Asked(UnixStream);

impl Asked {
    /// The answer's line (`None`: none came in time).
    fn reply(self) -> Option<String> {
        let mut reply = String::new();
        BufReader::new(self.0).read_line(&mut reply).ok()?;
        Some(reply)
    }

    /// The answer to [`ask_dirty`].
    pub fn dirty(self) -> Option<DirtyReply> {
        serde_json::from_str(&self.reply()?).ok()
    }
}

/// Sends `req`; its answer is read within `timeout`.
fn send(dirs: &SandboxDirs, req: &Request, timeout: Duration) -> Option<Asked> {
    let mut s = UnixStream::connect(dirs.socket()).ok()?;
    s.set_read_timeout(Some(timeout)).ok()?;
    s.set_write_timeout(Some(Duration::from_secs(2))).ok()?;
    let mut line = serde_json::to_string(req).ok()?;
    line.push('\n');
    s.write_all(line.as_bytes()).ok()?;
    Some(Asked(s))
}

/// [`dirty`] asked, to be answered while the caller does other work
/// ([`Asked::dirty`]).
pub fn ask_dirty(dirs: &SandboxDirs) -> Option<Asked> {
    send(dirs, &Request::Dirty, Duration::from_secs(2))
}

/// Lets prepared fork `dirs` go (`Request::Claim`): its record as its
/// supervisor took it again, running; or why not.
pub fn claim(dirs: &SandboxDirs, timeout: Duration) -> Result<SandboxRecord, String> {
    let line = request_line(dirs, &Request::Claim, timeout)
        .ok_or_else(|| "its supervisor did not answer".to_string())?;
    if let Ok(rec) = serde_json::from_str::<SandboxRecord>(&line) {
        return Ok(rec);
    }
    let v: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
    Err(v["error"]
        .as_str()
        .unwrap_or("its supervisor's answer was not understood")
        .to_string())
}

/// Hands the preparation of checkpoint `snapshot`'s templates `items` to
/// the sandbox's supervisor; whether it took it (one of an earlier tine
/// does not know the request).
pub fn prepare(
    dirs: &SandboxDirs,
    snapshot: &str,
    items: &[crate::processes::prepare::Item],
) -> bool {
    let req = Request::Prepare {
        snapshot: snapshot.to_string(),
        items: items.to_vec(),
    };
    request_line(dirs, &req, Duration::from_secs(2)).is_some_and(|l| l.trim() == "{}")
}

/// Has the sandbox's supervisor stop any preparation of templates it is
/// making (after the step in hand: a spare's fork, tens of ms at most; or,
/// `finish`, once it is through) and waits for it; how far the last one
/// got, if one ran since the last ask.
pub fn quiesce(dirs: &SandboxDirs, finish: bool) -> Option<crate::processes::prepare::Report> {
    #[derive(Deserialize)]
    struct Answer {
        report: Option<crate::processes::prepare::Report>,
    }
    let line = request_line(dirs, &Request::Quiesce { finish }, Duration::from_secs(60))?;
    serde_json::from_str::<Answer>(&line).ok()?.report
}

/// Whether the sandbox's supervisor is there to take a request (a connect,
/// which the kernel completes even while the supervisor is busy).
pub fn reachable(dirs: &SandboxDirs) -> bool {
    UnixStream::connect(dirs.socket()).is_ok()
}

/// What the sandbox's change tracker vouches for; `None` when there is no
/// supervisor or it tracks nothing.
pub fn dirty(dirs: &SandboxDirs) -> Option<DirtyReply> {
    ask_dirty(dirs)?.dirty()
}

/// Tells the change tracker that a snapshot read everything up to `seq`.
pub fn clean(dirs: &SandboxDirs, seq: u64, mapped: bool) {
    let _ = request_line(
        dirs,
        &Request::Clean { seq, mapped },
        Duration::from_secs(2),
    );
}

/// Sends a status or stop request; the record in reply, or `None` when no supervisor answers.
pub fn request(dirs: &SandboxDirs, req: &Request, timeout: Duration) -> Option<SandboxRecord> {
    serde_json::from_str(&request_line(dirs, req, timeout)?).ok()
}

fn answer_quiesced(mut conn: UnixStream, report: Option<crate::processes::prepare::Report>) {
    let line = serde_json::json!({ "report": report }).to_string();
    let _ = conn.write_all(format!("{line}\n").as_bytes());
}

enum Event {
    Exited { run: u64, code: i32 },
    Request(Request, UnixStream),
    StopTimeout { run: u64 },
}

fn reply(mut s: UnixStream, rec: &SandboxRecord) {
    let mut line = serde_json::to_string(rec).unwrap_or_default();
    line.push('\n');
    let _ = s.write_all(line.as_bytes());
}

fn signal(pid: u32, isolated: bool, sig: rustix::process::Signal) {
    let Some(p) = rustix::process::Pid::from_raw(pid as i32) else {
        return;
    };
    if isolated {
        // The sandbox's init forwards it to the command's process group.
        let _ = rustix::process::kill_process(p, sig);
    } else {
        // Without isolation the command leads its own process group.
        let _ = rustix::process::kill_process_group(p, sig);
    }
}

struct Supervisor {
    /// Opened only to record a state: an open repository holds the gc lock
    /// shared, and `tine gc` must not wait for sandboxes that run for days.
    repo_path: PathBuf,
    rec: SandboxRecord,
    spec: RunSpec,
    dirs: SandboxDirs,
    exe: PathBuf,
    cgroup: Option<Cgroup>,
    tx: mpsc::Sender<Event>,
    /// The user namespace's IDs (the repository's range).
    ids: ns::Ids,
    /// `--net private`'s network stack for the current run (replaced by the
    /// next run's, dropped with the supervisor).
    net: std::sync::Mutex<Option<crate::slirp::NetHelper>>,
}

impl Supervisor {
    fn io(&self, step: &'static str, path: &Path) -> impl FnOnce(io::Error) -> SuperviseError {
        let id = self.rec.id.clone();
        let path = path.to_path_buf();
        move |source| SuperviseError::Io {
            id,
            step,
            path,
            source,
        }
    }

    fn log_file(&self, path: &Path) -> Result<File, SuperviseError> {
        use std::os::unix::fs::OpenOptionsExt;
        let f = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(path)
            .map_err(self.io("open log", path))?;
        // The sandbox's root's (in the private repository): a process that
        // reopens its output (CRIU bringing one back, a native fork's copy)
        // does so from inside the sandbox's user namespace.
        if self.spec.isolation == Isolation::Full {
            let (uid, gid) = self.ids.owner();
            std::os::unix::fs::fchown(&f, Some(uid), Some(gid))
                .map_err(self.io("give to the sandbox's root", path))?;
        }
        Ok(f)
    }

    /// Takes over an init that is not this process's child (a native
    /// fork's, see `ns::run_adopted`): watched through a pidfd; its exit code
    /// comes from its status file.
    fn adopt(&self, run: u64, pid: u32) -> u32 {
        protect_from_oom(pid);
        let tx = self.tx.clone();
        let status = self.dirs.init_status();
        std::thread::spawn(move || {
            let fd = rustix::process::Pid::from_raw(pid as i32).and_then(|p| {
                rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()).ok()
            });
            if let Some(fd) = fd {
                // Readable once the process has ended.
                let mut fds = [rustix::event::PollFd::new(
                    &fd,
                    rustix::event::PollFlags::IN,
                )];
                // Until readable (or an error that will not pass).
                while let Ok(0) | Err(rustix::io::Errno::INTR) = rustix::event::poll(&mut fds, None)
                {
                }
            }
            let text = fs::read_to_string(&status).unwrap_or_default();
            let code = match ns::Adopted::parse(&text) {
                ns::Adopted::Exited(c) => c,
                // Ended without a word: the init of a PID namespace takes
                // no signal from outside but SIGKILL.
                _ => 128 + libc::SIGKILL,
            };
            let _ = tx.send(Event::Exited { run, code });
        });
        pid
    }

    /// Starts one run; returns the PID to watch.
    fn start(&self, run: u64, held: bool) -> Result<u32, SuperviseError> {
        let out = self.log_file(&self.dirs.stdout_log())?;
        let err = self.log_file(&self.dirs.stderr_log())?;
        let pid = match &self.spec.isolation {
            Isolation::Full => {
                let init = InitSpec {
                    workspace: self.dirs.merged(),
                    rootfs: self.spec.rootfs.clone(),
                    hostname: self.rec.name.clone(),
                    net: self.spec.net,
                    command: self.spec.command.clone(),
                    env: self.spec.env.clone(),
                    cgroup_procs: self.cgroup.iter().flat_map(Cgroup::procs_files).collect(),
                    hide: vec![
                        fs::canonicalize(&self.repo_path)
                            .map_err(self.io("resolve", &self.repo_path))?,
                    ],
                    held,
                    ids: Some(self.ids),
                    tmp_bytes: ns::tmp_bytes(self.spec.limits.memory_bytes),
                    seccomp: self.spec.seccomp,
                    image: self.spec.image.clone(),
                };
                let mut started = ns::spawn_init(&self.exe, &init, &out, &err)?;
                let pid = started.pid;
                *self.net.lock().unwrap_or_else(|e| e.into_inner()) = started.net.take();
                if let Err(message) = started.wait_ready() {
                    let _ = ns::wait(pid);
                    return Err(SuperviseError::Start {
                        id: self.rec.id.clone(),
                        message,
                    });
                }
                protect_from_oom(pid);
                pid
            }
            Isolation::None { .. } => {
                use std::os::unix::process::CommandExt;
                let ws = self.dirs.plain();
                let child = std::process::Command::new(&self.spec.command[0])
                    .args(&self.spec.command[1..])
                    .env_clear()
                    .envs(self.spec.env.iter().map(|(k, v)| (k, v)))
                    .current_dir(&ws)
                    .stdin(std::process::Stdio::null())
                    .stdout(out)
                    .stderr(err)
                    .process_group(0)
                    .spawn()
                    .map_err(self.io("start command in", &ws))?;
                child.id()
            }
        };
        let tx = self.tx.clone();
        std::thread::spawn(move || {
            let code = ns::wait(pid).unwrap_or(255);
            let _ = tx.send(Event::Exited { run, code });
        });
        Ok(pid)
    }

    /// Claims prepared fork `pid` (its init, held): its record again, as
    /// the claim wrote it (name, state), its host named so, its init let go
    /// and its processes running.
    fn claim(&mut self, pid: u32) -> Result<(), String> {
        // Claimed already (its claimer's request behind a status request
        // that finished the claim).
        if self.rec.state == SandboxState::Running {
            return Ok(());
        }
        if self.rec.state != SandboxState::Prepared {
            return Err(format!(
                "sandbox {} is {}, not prepared",
                self.rec.name, self.rec.state
            ));
        }
        let rec = Repository::open(&self.repo_path)
            .map_err(|e| e.to_string())
            .and_then(|r| r.sandbox(&self.rec.id).map_err(|e| e.to_string()))
            .map_err(|e| format!("its record: {e}"))?;
        if rec.state != SandboxState::Running {
            return Err(format!("its record says {}, not running", rec.state));
        }
        let status = self.dirs.init_status();
        // Let go before its claim (its processes ran on from the snapshot):
        // the claim must not pass it off as the snapshot's.
        if ns::Adopted::parse(&fs::read_to_string(&status).unwrap_or_default()) != ns::Adopted::Held
        {
            return Err("its init was let go before it was claimed".to_string());
        }
        set_hostname(pid, &rec.name).map_err(|e| format!("naming its host: {e}"))?;
        ns::send_signal(pid, ns::release_signal())
            .map_err(|e| format!("letting its init go: {e}"))?;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match ns::Adopted::parse(&fs::read_to_string(&status).unwrap_or_default()) {
                ns::Adopted::Ready => break,
                // Killed while held (the source's processes can reach it).
                ns::Adopted::Exited(code) => {
                    return Err(format!("its program ended before it was claimed ({code})"));
                }
                ns::Adopted::Failed(e) => return Err(e),
                ns::Adopted::Held | ns::Adopted::Pending if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_micros(100))
                }
                _ => return Err("its init did not let its processes go".to_string()),
            }
        }
        self.rec = SandboxRecord {
            supervisor_pid: self.rec.supervisor_pid,
            init_pid: self.rec.init_pid,
            ..rec
        };
        Ok(())
    }

    /// Whether its record says it was claimed (running) while it still
    /// holds it prepared.
    fn claimed(&self) -> bool {
        Repository::open(&self.repo_path)
            .ok()
            .and_then(|r| r.sandbox(&self.rec.id).ok())
            .is_some_and(|r| r.state == SandboxState::Running)
    }

    fn save(&mut self, state: SandboxState) -> Result<(), SuperviseError> {
        self.rec.state = state;
        self.rec.updated_ns = now_ns();
        let repo = Repository::open(&self.repo_path)?;
        // Many supervisors start at once (a fork); their state updates need no fsync each.
        repo.relax_durability();
        repo.save_sandbox(&self.rec)?;
        Ok(())
    }
}

/// Names the host of init `pid`'s UTS namespace `name`, from a thread that
/// enters it (a namespace entered is the thread's own).
fn set_hostname(pid: u32, name: &str) -> io::Result<()> {
    let ns = File::open(format!("/proc/{pid}/ns/uts"))?;
    let name = name.as_bytes().to_vec();
    std::thread::spawn(move || -> io::Result<()> {
        use rustix::thread::{LinkNameSpaceType, move_into_link_name_space};
        move_into_link_name_space(
            std::os::fd::AsFd::as_fd(&ns),
            Some(LinkNameSpaceType::HostNameAndNISDomainName),
        )?;
        rustix::system::sethostname(&name)?;
        Ok(())
    })
    .join()
    .unwrap_or_else(|_| Err(io::Error::other("the naming thread panicked")))
}

/// Keeps the OOM killer off a sandbox's init (`pid`), once its command has
/// started (so the command does not inherit it): an out-of-memory sandbox
/// loses the process that ran out, not its init, and keeps running; the
/// termination reason of a command killed so says OOM. A sandbox's root
/// cannot take this from other processes (lowering it needs a privilege of
/// the host's).
fn protect_from_oom(pid: u32) {
    let _ = fs::write(format!("/proc/{pid}/oom_score_adj"), "-1000");
}

fn backoff(restarts: u32, ran: Duration) -> Duration {
    if ran > Duration::from_secs(10) {
        return Duration::from_millis(500);
    }
    Duration::from_millis(500u64 << restarts.min(5)).min(Duration::from_secs(10))
}

/// How a sandbox's first run begins.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FirstRun {
    /// Its init starts the command.
    #[default]
    Start,
    /// Its init starts holding, without the command (its processes come from
    /// templates; see [`InitSpec::held`]).
    Held,
    /// Its init is already running (a native fork's, host PID given).
    Adopt(u32),
    /// As `Adopt`, a fork prepared ahead: its init holds its processes
    /// until a claim ([`Request::Claim`]); recorded as prepared till then.
    Prepared(u32),
}

/// Runs the supervisor of sandbox `id` until the sandbox ends for good. Writes
/// one JSON line to `ready` once the first run has started (or failed to).
/// Later runs (restarts) always start the command.
pub fn supervise(
    repo_path: &Path,
    id: &str,
    exe: &Path,
    first_run: FirstRun,
    mut ready: impl Write,
) -> Result<(), SuperviseError> {
    // Descriptors its starter left open would reach the sandbox's command.
    let _ = ns::close_other_fds(&[]);
    let _ = rustix::process::setsid();
    let (rec, ids) = {
        let repo = Repository::open(repo_path)?;
        (repo.sandbox(id)?, ns::Ids::for_repository(repo.repo_id()))
    };
    let spec = RunSpec::of(&rec)?;
    let dirs = SandboxDirs::new(repo_path, &rec.id);
    let (tx, rx) = mpsc::channel();
    let mut sv = Supervisor {
        repo_path: repo_path.to_path_buf(),
        rec,
        spec,
        dirs,
        exe: exe.to_path_buf(),
        cgroup: None,
        tx,
        ids,
        net: std::sync::Mutex::new(None),
    };
    let setup = (|| -> Result<UnixListener, SuperviseError> {
        if sv.spec.isolation == Isolation::Full {
            let root = CgroupRoot::detect(Path::new(DEFAULT_ROOT))?;
            sv.cgroup = Some(root.create(&sv.rec.id, &sv.spec.limits)?);
            let ov = sv.dirs.overlay(&sv.spec);
            if !ov.is_mounted() {
                ov.mount(Some(sv.ids.owner()))?;
            }
        }
        let sock = sv.dirs.socket();
        let _ = fs::remove_file(&sock);
        UnixListener::bind(&sock).map_err(sv.io("listen on", &sock))
    })();
    let watcher = match &setup {
        Ok(_) if sv.spec.isolation == Isolation::Full => start_watcher(&sv),
        _ => None,
    };
    if setup.is_ok()
        && let Some(cg) = sv.cgroup.clone()
    {
        // A snapshot or rollback killed inside its frozen window (SIGKILL
        // runs no guard) leaves the sandbox frozen: its freeze lock is then
        // free, and this thaws it within half a second.
        let dirs = sv.dirs.clone();
        std::thread::spawn(move || {
            loop {
                std::thread::sleep(Duration::from_millis(500));
                crate::manager::thaw_abandoned(&dirs, &cg);
            }
        });
    }
    let listener = match setup {
        Ok(l) => l,
        Err(e) => {
            let _ = writeln!(ready, "{}", serde_json::json!({"error": e.to_string()}));
            sv.rec.supervisor_pid = None;
            let _ = sv.save(SandboxState::Exited);
            return Err(e);
        }
    };
    let tx = sv.tx.clone();
    let preparer = Arc::new(crate::processes::prepare::Preparer::default());
    let prep_dirs = sv.dirs.clone();
    std::thread::spawn(move || {
        let mut trackers = Trackers::default();
        for conn in listener.incoming().flatten() {
            let mut line = String::new();
            let Ok(c2) = conn.try_clone() else { continue };
            let _ = c2.set_read_timeout(Some(Duration::from_secs(2)));
            if BufReader::new(c2).read_line(&mut line).is_err() {
                continue;
            }
            match serde_json::from_str::<Request>(&line) {
                // Answered here: a frozen sandbox's snapshot waits for these.
                // While the tracker is busy (a sandbox can keep it so), on a
                // thread of its own, so that the requests behind this one are
                // not held up; else at once, which saves the snapshot's frozen
                // window a thread's start (0.2-0.3 ms on a 2-core host).
                Ok(Request::Dirty) => match watcher.as_deref().map(Mutex::try_lock) {
                    Some(Err(std::sync::TryLockError::WouldBlock)) => {
                        let w = watcher.clone();
                        std::thread::spawn(move || {
                            let w = w
                                .as_deref()
                                .map(|w| w.lock().unwrap_or_else(|e| e.into_inner()));
                            answer_dirty(w, conn)
                        });
                    }
                    Some(Ok(w)) => answer_dirty(Some(w), conn),
                    Some(Err(std::sync::TryLockError::Poisoned(e))) => {
                        answer_dirty(Some(e.into_inner()), conn)
                    }
                    None => answer_dirty(None, conn),
                },
                Ok(Request::Clean { seq, mapped }) => {
                    if let Some(w) = &watcher {
                        w.lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .tracker
                            .clean(seq, mapped);
                    }
                    let mut conn = conn;
                    let _ = conn.write_all(b"{}\n");
                }
                Ok(Request::Keep {
                    pid,
                    start,
                    from,
                    fd,
                }) => answer_held(conn, trackers.keep(pid, start, from, fd)),
                Ok(Request::Tracker { pid, start }) => answer_held(conn, trackers.held(pid, start)),
                Ok(Request::Prepare { snapshot, items }) => {
                    let mut conn = conn;
                    if items.len() > crate::processes::prepare::MAX_ITEMS {
                        let _ = conn.write_all(b"{\"error\":\"too many templates\"}\n");
                        continue;
                    }
                    preparer.start(prep_dirs.clone(), snapshot, items);
                    let _ = conn.write_all(b"{}\n");
                }
                // Waited for on a thread of its own while a preparation
                // runs, so that the requests behind it are answered.
                Ok(Request::Quiesce { finish }) if preparer.busy() => {
                    let p = Arc::clone(&preparer);
                    std::thread::spawn(move || answer_quiesced(conn, p.quiesce(finish)));
                }
                Ok(Request::Quiesce { finish }) => answer_quiesced(conn, preparer.quiesce(finish)),
                Ok(req) => {
                    if tx.send(Event::Request(req, conn)).is_err() {
                        break;
                    }
                }
                Err(_) => {}
            }
        }
    });

    sv.rec.supervisor_pid = Some(std::process::id());
    let isolated = sv.spec.isolation == Isolation::Full;
    let mut run: u64 = 0;
    let mut stopping = false;
    let mut stop_waiters: Vec<UnixStream> = Vec::new();
    let mut first = true;
    'runs: loop {
        run += 1;
        let oom_before = sv
            .cgroup
            .as_ref()
            .and_then(|c| c.oom_kills().ok())
            .unwrap_or(0);
        let started = Instant::now();
        let begun = match first_run {
            FirstRun::Adopt(pid) | FirstRun::Prepared(pid) if first => Ok(sv.adopt(run, pid)),
            how => sv.start(run, how == FirstRun::Held && first),
        };
        let pid = match begun {
            Ok(p) => p,
            Err(e) => {
                if first {
                    let _ = writeln!(ready, "{}", serde_json::json!({"error": e.to_string()}));
                }
                sv.rec.init_pid = None;
                let _ = sv.save(SandboxState::Exited);
                cleanup(&sv);
                return Err(e);
            }
        };
        sv.rec.init_pid = Some(pid);
        sv.save(match first_run {
            FirstRun::Prepared(_) if first => SandboxState::Prepared,
            _ => SandboxState::Running,
        })?;
        if first {
            let _ = writeln!(ready, "{}", serde_json::json!({"ok": sv.rec.id}));
            let _ = ready.flush();
            first = false;
        }
        // Serve requests until this run ends.
        let code = loop {
            match rx.recv() {
                Ok(Event::Exited { run: r, code }) if r == run => break code,
                Ok(Event::StopTimeout { run: r }) if r == run => {
                    signal(pid, isolated, rustix::process::Signal::KILL);
                }
                Ok(Event::Request(Request::Status, s)) => {
                    // A claim whose claimer died between recording it and
                    // asking for it is finished here.
                    if sv.rec.state == SandboxState::Prepared && sv.claimed() {
                        let _ = sv.claim(pid);
                    }
                    reply(s, &sv.rec)
                }
                Ok(Event::Request(Request::Claim, mut s)) => match sv.claim(pid) {
                    Ok(()) => reply(s, &sv.rec),
                    Err(e) => {
                        let line = serde_json::json!({ "error": e }).to_string();
                        let _ = s.write_all(format!("{line}\n").as_bytes());
                    }
                },
                Ok(Event::Request(Request::Stop { timeout_ms }, s)) => {
                    stop_waiters.push(s);
                    if !stopping {
                        stopping = true;
                        signal(pid, isolated, rustix::process::Signal::TERM);
                        let tx = sv.tx.clone();
                        std::thread::spawn(move || {
                            std::thread::sleep(Duration::from_millis(timeout_ms));
                            let _ = tx.send(Event::StopTimeout { run });
                        });
                    }
                }
                // Events of earlier runs.
                Ok(_) => {}
                Err(_) => break 255,
            }
        };
        let oom = sv
            .cgroup
            .as_ref()
            .and_then(|c| c.oom_kills().ok())
            .is_some_and(|n| n > oom_before);
        let exit = Exit {
            code,
            signal: (code > 128).then_some(code - 128),
            oom,
            stopped: stopping,
            at_ns: now_ns(),
        };
        sv.rec.exit = serde_json::to_string(&exit).ok();
        sv.rec.init_pid = None;
        let again = !stopping
            && match sv.spec.restart {
                Restart::No => false,
                Restart::OnFailure => code != 0,
                Restart::Always => true,
            };
        if !again {
            break 'runs;
        }
        sv.save(SandboxState::Restarting)?;
        let delay = backoff(sv.rec.restarts, started.elapsed());
        sv.rec.restarts += 1;
        let deadline = Instant::now() + delay;
        // Keep answering while waiting; a stop during the delay ends it.
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match rx.recv_timeout(left) {
                Ok(Event::Request(Request::Status, s)) => reply(s, &sv.rec),
                Ok(Event::Request(Request::Stop { .. }, s)) => {
                    stop_waiters.push(s);
                    stopping = true;
                    break 'runs;
                }
                Ok(_) => {}
                Err(_) => break,
            }
        }
    }
    sv.rec.supervisor_pid = None;
    sv.save(if stopping {
        SandboxState::Stopped
    } else {
        SandboxState::Exited
    })?;
    cleanup(&sv);
    for s in stop_waiters {
        reply(s, &sv.rec);
    }
    Ok(())
}

/// Watches the upper layer for changes, on a thread of its own; `None` when
/// inotify is unavailable (snapshots then read the whole upper layer).
fn start_watcher(sv: &Supervisor) -> Option<Arc<Mutex<Watcher>>> {
    let id = now_ns() ^ (u64::from(std::process::id()) << 40);
    let w = Watcher::new(&sv.dirs.upper(), id).ok()?;
    let fd = w.inotify.handle();
    let w = Arc::new(Mutex::new(w));
    let w2 = w.clone();
    std::thread::spawn(move || {
        loop {
            watch::wait(&fd, 1000);
            let ok = w2.lock().unwrap_or_else(|e| e.into_inner()).drain();
            if !ok {
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    });
    Some(w)
}

fn answer_held(mut conn: UnixStream, held: Option<Held>) {
    let mut line = held
        .and_then(|h| serde_json::to_string(&h).ok())
        .unwrap_or_else(|| "{}".to_string());
    line.push('\n');
    let _ = conn.write_all(line.as_bytes());
}

fn answer_dirty(watcher: Option<std::sync::MutexGuard<'_, Watcher>>, mut conn: UnixStream) {
    let line = match watcher {
        Some(mut w) => {
            // Everything the (frozen) sandbox did is queued by now.
            w.drain();
            serde_json::to_string(&w.tracker.reply()).unwrap_or_default()
        }
        None => r#"{"error":"this sandbox has no change tracker"}"#.to_string(),
    };
    let _ = conn.write_all(format!("{line}\n").as_bytes());
}

/// Releases what a finished sandbox holds on the host (its files stay).
fn cleanup(sv: &Supervisor) {
    if let Some(cg) = &sv.cgroup {
        // PID 1 leaving ends the namespace; its processes go with it.
        let _ = cg.remove_when_empty(Duration::from_secs(5));
    }
    if sv.spec.isolation == Isolation::Full {
        let _ = sv.dirs.overlay(&sv.spec).unmount();
    }
    let _ = fs::remove_file(sv.dirs.socket());
}
