//! Native fork into new sandboxes: a live template of the source sandbox is
//! cloned into namespaces of its own, nested in the source's
//! (`tine_proc::template::clone_nested`), with no CRIU image in between.
//!
//! For each fork: the copy's new init (Z) and process (P) are moved into the
//! fork's cgroup; `tine __sandbox-furnish` gives their namespaces the fork's
//! workspace, `/proc`, `/tmp`, devpts, hostname and loopback, and hands over
//! tine's executable, the fork's logs and a status file; P gets its
//! descriptors pointed at the fork's files and enters its working directory
//! again; Z executes `tine __sandbox-adopt` (`ns::run_adopted`), which
//! removes the handover, lets P run and reports on the status file; the
//! fork's supervisor adopts Z. Z is a child of the source's init, and its
//! PID namespace is nested in the source's: the source's init stays while
//! forks run (`ns`), and `tine stop`/`rm` of the source refuse meanwhile.
//! Other children of the source's init (a daemon, the commands of `tine
//! exec` sessions) come with their trees under Z: sessions without their
//! clients, their streams files in the fork's `/tmp` ([`session_dir`]).

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tine_proc::ptrace::Tracee;
use tine_proc::{FdFix, FdTarget, Respawn};
use tine_store::{ObjectId, SandboxRecord};

use crate::cgroup::{CgroupRoot, DEFAULT_ROOT};
use crate::manager::{PrivateMounts, SandboxError, io_error, process_error};
use crate::ns::{Adopted, FurnishSpec, HANDOVER, Net, WORKSPACE};
use crate::processes::{Captured, ProcessState};
use crate::supervisor::{RunSpec, SandboxDirs};

/// Where a native fork's PID namespace is nested: the source sandbox, and
/// the fork's first init (host PID and start time). Recorded in the fork's
/// directory (`SandboxDirs::nested_in`); while that init runs, the source's
/// init must stay.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NestedIn {
    /// The source sandbox's id.
    pub origin: String,
    pub init_pid: u32,
    pub init_start: u64,
}

impl NestedIn {
    /// Whether the fork's first init still runs.
    pub fn alive(&self) -> bool {
        tine_proc::stat(self.init_pid)
            .is_ok_and(|s| s.start_time == self.init_start && !s.exiting())
    }
}

/// The record of where sandbox `dirs`'s first run is nested, if it is a
/// native fork.
pub fn nested_in(dirs: &SandboxDirs) -> Option<NestedIn> {
    serde_json::from_slice(&std::fs::read(dirs.nested_in()).ok()?).ok()
}

/// What every native fork of one snapshot is made from.
pub(crate) struct Plan {
    origin: String,
    /// The snapshot's process state in the origin: one process tree, its
    /// root first and parents before children.
    state: ProcessState,
    /// What each process gets, in the order of `state.processes`.
    procs: Vec<ProcPlan>,
    /// FIFOs of the workspace the processes hold (snapshots skip them):
    /// made in each fork's workspace, as `(path under /workspace, mode)`.
    fifos: Vec<(PathBuf, u32)>,
    /// Pipes and socket pairs between processes of the tree, made once.
    shared: Vec<tine_proc::treeobjects::Shared>,
    /// The other process trees the forks get (children of init beside the
    /// command, `tine exec` sessions), each listed after the command's tree
    /// in `state.processes`.
    others: Vec<OtherTree>,
    /// Processes of `tine exec` sessions the forks do not get, and why.
    sessions_left_out: Vec<(usize, String)>,
    /// Copies of one template are made one at a time (each holds it), and
    /// so are grafts of its children's. A fork's init shares the template's
    /// memory until it execs (see `tine_proc::template::Nested`): what is
    /// injected into it waits for this too.
    clone_lock: Mutex<()>,
}

/// A process tree of the forks other than the command's: made under the
/// fork's init. A `tine exec` session's command (and what it started) comes
/// so without its client, its standard streams the files of
/// [`session_dir`] in the fork's `/tmp`.
struct OtherTree {
    /// Where its processes start in `state.processes`, and how many.
    start: usize,
    len: usize,
    /// It is a `tine exec` session's.
    session: bool,
    /// Pipes and socket pairs between its processes, by index in it.
    shared: Vec<tine_proc::treeobjects::Shared>,
    /// Who owns its files (its command's user, as the host sees it).
    owner: Option<(u32, u32)>,
}

/// Where the standard streams of the `tine exec` session whose command
/// was PID `pid` are in a native fork: the FIFO `stdin` (written to, it
/// is the shell's input) and the files `stdout` and `stderr`.
pub fn session_dir(pid: u32) -> PathBuf {
    PathBuf::from(format!("/tmp/tine-session-{pid}"))
}

/// The streams of a session's command that lead to its client, with the
/// file of [`session_dir`] each becomes in a fork: pipes (by inode) and
/// files the sandbox does not see (by device and inode: its client's
/// output redirected to a host file).
#[derive(Default)]
struct SessionStreams {
    pipes: std::collections::BTreeMap<u64, PathBuf>,
    files: std::collections::BTreeMap<(u64, u64), PathBuf>,
}

/// What one process of a native fork gets that is not its origin's.
struct ProcPlan {
    fds: Vec<FdFix>,
    /// Shared mappings of workspace files, mapped again from the fork's own.
    maps: Vec<tine_proc::template::MapFix>,
    /// Pipes, eventfds, epoll instances and listeners made anew in the fork.
    remake: Vec<tine_proc::objects::Remake>,
}

impl Plan {
    /// How many processes each fork gets.
    pub(crate) fn processes(&self) -> usize {
        self.state.processes.len()
    }

    /// What the forks get that is not the origin's: its connections, reset.
    pub(crate) fn note(&self) -> Option<String> {
        let mut notes: Vec<String> = self
            .state
            .processes
            .iter()
            .zip(&self.procs)
            .filter_map(|(c, p)| reset_note(c, &p.remake))
            .collect();
        for s in self.others.iter().filter(|s| s.session) {
            let c = &self.state.processes[s.start];
            notes.push(format!(
                "the tine exec session's command {} ({}) is in the forks without its client: its input is the FIFO {dir}/stdin, its output {dir}/stdout and {dir}/stderr (reach it with tine exec FORK -- sh -c 'echo COMMAND > {dir}/stdin')",
                c.ns_pid,
                c.cmdline,
                dir = session_dir(c.ns_pid).display()
            ));
        }
        for (n, why) in &self.sessions_left_out {
            notes.push(format!(
                "{} of a tine exec session {} not in the forks: {why}",
                crate::manager::plural_processes(*n),
                if *n == 1 { "is" } else { "are" }
            ));
        }
        (!notes.is_empty()).then(|| notes.join("; "))
    }
}

/// The note of process `c`'s connections a fork resets, if it had any.
fn reset_note(c: &Captured, remake: &[tine_proc::objects::Remake]) -> Option<String> {
    {
        let fds = tine_proc::objects::resets(remake);
        if fds.is_empty() {
            return None;
        }
        let list: Vec<String> = fds.iter().map(i32::to_string).collect();
        Some(format!(
            "process {} ({}) had {} TCP connection{} open (descriptor{} {}): a fork cannot take a connection over, so in the forks {} reset",
            c.ns_pid,
            c.cmdline,
            fds.len(),
            if fds.len() == 1 { "" } else { "s" },
            if fds.len() == 1 { "" } else { "s" },
            list.join(", "),
            if fds.len() == 1 {
                "it was"
            } else {
                "they were"
            },
        ))
    }
}

/// Devices whose open descriptions carry nothing to keep apart: shared with
/// the origin, as they are.
const SHARED_DEVICES: [&str; 5] = [
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/random",
    "/dev/urandom",
];

/// Why a snapshot's process cannot be forked natively.
#[derive(Debug)]
pub(crate) struct Refusal {
    pub why: String,
    /// Whether CRIU may bring it instead (else the forks start afresh).
    pub criu_can: bool,
}

impl From<String> for Refusal {
    fn from(why: String) -> Refusal {
        Refusal {
            why,
            criu_can: true,
        }
    }
}

/// Plans native forks of `snap` from sandbox `origin`, or says why they
/// cannot be made (then CRIU or a fresh start takes over).
pub(crate) fn plan(
    origin: &SandboxRecord,
    snap: &ObjectId,
    repo_path: &Path,
    private_mounts: &PrivateMounts,
) -> Result<Plan, Refusal> {
    let dirs = SandboxDirs::new(repo_path, &origin.id);
    let st: ProcessState = crate::processes::load(&dirs, snap)
        .ok_or_else(|| "the snapshot holds no processes".to_string())?;
    if !st.alive() {
        return Err(Refusal::from(format!(
            "the snapshot's templates were let go (evicted, or sandbox {} restarted)",
            origin.name
        )));
    }
    // One tree per child of init: the first is the sandbox's command's, made
    // from the nested clone; the others come as trees of their own under the
    // fork's init. The commands of `tine exec` sessions (and what they
    // started) belong to their clients, which a fork does not have: their
    // streams to the client become files there.
    let mut st_rest = st;
    let all = std::mem::take(&mut st_rest.processes);
    let mut trees: Vec<Vec<Captured>> = Vec::new();
    for c in all {
        match trees
            .iter_mut()
            .find(|t| c.parent.is_some_and(|p| t.iter().any(|x| x.ns_pid == p)))
        {
            Some(t) => t.push(c),
            None if c.parent.is_none() => trees.push(vec![c]),
            None => {
                return Err(Refusal::from(format!(
                    "process {} ({}) is listed before its parent {}",
                    c.ns_pid,
                    c.cmdline,
                    c.parent.unwrap_or(0)
                )));
            }
        }
    }
    let Some(at) = trees.iter().position(|t| t[0].anchor.is_none()) else {
        return Err(Refusal::from(
            "the snapshot holds only the commands of tine exec sessions".to_string(),
        ));
    };
    let main = trees.remove(at);
    let others = trees;
    let subset = |processes: Vec<Captured>| ProcessState {
        processes,
        ..st_rest.clone()
    };
    let main = subset(main);
    let (shared, skip) = main
        .tree_objects(true, &Default::default())
        .map_err(Refusal::from)?;
    let mut procs = Vec::with_capacity(main.processes.len());
    let mut fifos = Vec::new();
    for c in &main.processes {
        procs.push(plan_process(
            c,
            &dirs,
            private_mounts,
            &skip,
            &mut fifos,
            None,
        )?);
    }
    let mut state = main;
    let mut planned = Vec::new();
    let mut left_out = Vec::new();
    for s in others {
        let n = s.len();
        let s = subset(s);
        let mut session_fifos = Vec::new();
        let session = s.processes[0].anchor.is_some();
        let streams = if session {
            session_streams(&s.processes[0])
        } else {
            Ok(SessionStreams::default())
        };
        let made = streams.and_then(|streams| {
            let mine = streams.pipes.keys().copied().collect();
            let (shared, mut skip) = s.tree_objects(true, &mine).map_err(Refusal::from)?;
            skip.extend(streams.pipes.keys());
            let p = s
                .processes
                .iter()
                .map(|c| {
                    plan_process(
                        c,
                        &dirs,
                        private_mounts,
                        &skip,
                        &mut session_fifos,
                        Some(&streams),
                    )
                })
                .collect::<Result<Vec<_>, _>>()?;
            Ok((shared, p))
        });
        match made {
            Ok((shared, p)) => {
                planned.push(OtherTree {
                    start: state.processes.len(),
                    len: n,
                    session,
                    shared,
                    owner: crate::ns::owner_of_process(s.processes[0].template.pid).ok(),
                });
                state.processes.extend(s.processes);
                procs.extend(p);
                fifos.extend(session_fifos);
            }
            Err(r) if session => left_out.push((n, r.why)),
            // Not a session: the forks need all of it.
            Err(r) => return Err(r),
        }
    }
    Ok(Plan {
        origin: origin.id.clone(),
        state,
        procs,
        fifos,
        shared,
        others: planned,
        sessions_left_out: left_out,
        clone_lock: Mutex::new(()),
    })
}

/// The streams a session's command `c` reads and writes its client
/// through (its descriptors 0, 1 and 2), with the file each becomes in a
/// fork.
fn session_streams(c: &Captured) -> Result<SessionStreams, Refusal> {
    use std::os::unix::fs::MetadataExt;
    let dir = session_dir(c.ns_pid);
    let mut out = SessionStreams::default();
    let pid = c.template.pid;
    for e in &c.template.fds {
        let name = match e.fd {
            0 => "stdin",
            1 => "stdout",
            2 => "stderr",
            _ => continue,
        };
        match &e.target {
            FdTarget::Pipe { inode } => {
                out.pipes.entry(*inode).or_insert_with(|| dir.join(name));
            }
            FdTarget::Path { path } if e.target.is_terminal() => {
                return Err(Refusal::from(format!(
                    "its command {} ({}) has the terminal {} of its client",
                    c.ns_pid,
                    c.cmdline,
                    path.display()
                )));
            }
            FdTarget::Path { path } => {
                // A file of the client's, unless the sandbox sees it there.
                let rel = path.strip_prefix("/").unwrap_or(path);
                let in_view = Path::new(&format!("/proc/{pid}/root")).join(rel);
                let seen = std::fs::metadata(in_view).ok().map(|m| (m.dev(), m.ino()));
                if let Ok(h) = std::fs::metadata(format!("/proc/{pid}/fd/{}", e.fd))
                    && h.is_file()
                    && seen != Some((h.dev(), h.ino()))
                {
                    out.files
                        .entry((h.dev(), h.ino()))
                        .or_insert_with(|| dir.join(name));
                }
            }
            _ => {}
        }
    }
    Ok(out)
}

/// The descriptor fix that points descriptor `e` (an end of a session's
/// stream) at its file `path` in a fork, or why it cannot be.
fn stream_fix(e: &tine_proc::FdEntry, path: PathBuf) -> Result<FdFix, String> {
    let input = path.ends_with("stdin");
    let access = e.flags as i32 & nix::libc::O_ACCMODE;
    match access {
        nix::libc::O_RDONLY | nix::libc::O_RDWR if input => Ok(FdFix::ReopenFifo {
            fd: e.fd,
            path,
            flags: e.flags,
        }),
        // Appended to: each process that holds it writes through a
        // description of its own.
        nix::libc::O_WRONLY | nix::libc::O_RDWR if !input => Ok(FdFix::Reopen {
            fd: e.fd,
            path,
            flags: (e.flags & !(nix::libc::O_ACCMODE as u32))
                | (nix::libc::O_WRONLY | nix::libc::O_APPEND) as u32,
            pos: 0,
        }),
        _ => Err(format!(
            "the other end of its session's {} (descriptor {})",
            path.file_name().unwrap_or_default().to_string_lossy(),
            e.fd
        )),
    }
}

/// What process `c` of a snapshot of the sandbox at `dirs` needs in a
/// native fork (the FIFOs it holds are added to `fifos`), or why it cannot
/// be forked. `skip`: pipes and sockets its tree makes for it.
fn plan_process(
    c: &Captured,
    dirs: &SandboxDirs,
    private_mounts: &PrivateMounts,
    skip: &std::collections::BTreeSet<u64>,
    fifos: &mut Vec<(PathBuf, u32)>,
    streams: Option<&SessionStreams>,
) -> Result<ProcPlan, Refusal> {
    // Descriptors name the real path.
    let real = SandboxDirs {
        root: std::fs::canonicalize(&dirs.root).unwrap_or_else(|_| dirs.root.clone()),
    };
    let why = |what: String| format!("process {} ({}) holds {what}", c.ns_pid, c.cmdline);
    // The sandbox's logs, told by identity: in a native fork their mounts
    // are detached, and the descriptors name no path.
    let identity = |m: &std::fs::Metadata| {
        use std::os::unix::fs::MetadataExt;
        (m.dev(), m.ino())
    };
    let identity_of = |p: &Path| std::fs::metadata(p).ok().map(|m| identity(&m));
    let logs = [
        (identity_of(&real.stdout_log()), "stdout"),
        (identity_of(&real.stderr_log()), "stderr"),
    ];
    let mut fds = Vec::new();
    for e in &c.template.fds {
        let fix = |path: PathBuf| FdFix::Reopen {
            fd: e.fd,
            path,
            flags: e.flags,
            pos: e.pos,
        };
        let held = std::fs::metadata(format!("/proc/{}/fd/{}", c.template.pid, e.fd)).ok();
        let held_id = held.as_ref().map(identity);
        if let Some((_, name)) = logs.iter().find(|(id, _)| id.is_some() && *id == held_id) {
            fds.push(fix(Path::new(HANDOVER).join(name)));
            continue;
        }
        let fifo = held.as_ref().is_some_and(|m| {
            use std::os::unix::fs::FileTypeExt;
            m.file_type().is_fifo()
        });
        let special = held.is_some_and(|m| !m.is_file() && !m.is_dir());
        match &e.target {
            FdTarget::Pipe { inode } if streams.is_some_and(|s| s.pipes.contains_key(inode)) => {
                let path = streams.and_then(|s| s.pipes.get(inode)).cloned();
                fds.push(stream_fix(e, path.unwrap_or_default()).map_err(why)?);
            }
            FdTarget::Path { .. }
                if streams.is_some_and(|s| held_id.is_some_and(|id| s.files.contains_key(&id))) =>
            {
                let path = streams.and_then(|s| held_id.and_then(|id| s.files.get(&id)));
                fds.push(stream_fix(e, path.cloned().unwrap_or_default()).map_err(why)?);
            }
            FdTarget::Path { path } if path.starts_with(WORKSPACE) && fifo => {
                use std::os::unix::fs::PermissionsExt;
                let mode = std::fs::metadata(format!("/proc/{}/fd/{}", c.template.pid, e.fd))
                    .map(|m| m.permissions().mode() & 0o7777)
                    .unwrap_or(0o600);
                fifos.push((path.clone(), mode));
                fds.push(FdFix::ReopenFifo {
                    fd: e.fd,
                    path: path.clone(),
                    flags: e.flags,
                });
            }
            FdTarget::Path { path } if path.starts_with(WORKSPACE) && special => {
                return Err(Refusal {
                    why: why(format!(
                        "{}, which is not a regular file (snapshots skip FIFOs, sockets and devices): no fork can bring it",
                        path.display()
                    )),
                    criu_can: false,
                });
            }
            FdTarget::Path { path } if path.starts_with(WORKSPACE) => fds.push(fix(path.clone())),
            FdTarget::Path { path } if SHARED_DEVICES.iter().any(|d| path == Path::new(d)) => {}
            FdTarget::Path { path } if e.target.is_terminal() => {
                return Err(why(format!("the terminal {}", path.display())).into());
            }
            FdTarget::Path { path } if path.starts_with(&real.root) => {
                return Err(why(format!("the sandbox's own file {}", path.display())).into());
            }
            // Shared memory the template captured (a /dev/shm file mapped
            // and held): the copy's descriptor is on its own copy.
            FdTarget::Path { .. } if tine_proc::shm::captures_fd(&c.template.shm, e.fd) => {}
            FdTarget::Path { path } if private_mounts.hold(e, path, false) => {
                return Err(Refusal::from(why(format!(
                    "{}, in the sandbox's private /tmp or /dev/shm, which snapshots do not hold",
                    path.display()
                ))));
            }
            // The sandbox's read-only view of the host: the same path there.
            FdTarget::Path { path } => fds.push(fix(path.clone())),
            // A memfd whose mappings the template captured: each copy's
            // descriptor is pointed at its own copy.
            FdTarget::Deleted { .. } if tine_proc::shm::captures_fd(&c.template.shm, e.fd) => {}
            FdTarget::Deleted { path } => {
                return Err(why(format!("the deleted file {}", path.display())).into());
            }
            // Made anew in the fork where they can be (below).
            FdTarget::Pipe { .. } | FdTarget::Socket { .. } | FdTarget::AnonInode { .. } => {}
            FdTarget::Other { link } => {
                return Err(why(format!("{link} (descriptor {})", e.fd)).into());
            }
        }
    }
    let remake =
        tine_proc::objects::plan_except(c.template.pid, &c.template.fds, &c.template.queued, skip)
            .map_err(|w| Refusal::from(why(w)))?;
    // Shared mappings: a workspace file's is made again from the fork's own
    // file (else a write in one fork would show in the origin and the other
    // forks); shared memory the template captured, each copy copies (in
    // `finish_copy`); a writable one of anything else would be shared with
    // the origin; read-only ones of the read-only root are harmless.
    let mut maps = Vec::new();
    let shared = tine_proc::template::shared_maps(c.template.pid)
        .map_err(|e| Refusal::from(format!("its mappings cannot be read: {e}")))?;
    for (m, writable) in shared {
        let deleted = m.path.to_string_lossy().ends_with(" (deleted)");
        if m.path.starts_with(WORKSPACE) && !deleted {
            maps.push(m);
        } else if writable && !tine_proc::shm::is_captured(&m.path.to_string_lossy()) {
            return Err(why(format!(
                "a shared writable mapping of {} (anonymous or /dev/shm memory, or a file outside the workspace) that a copy would share with the origin",
                if m.path.as_os_str().is_empty() {
                    "anonymous memory".to_string()
                } else {
                    m.path.display().to_string()
                }
            ))
            .into());
        }
    }
    Ok(ProcPlan { fds, maps, remake })
}

/// A fork's own template shares its source template's memory when that
/// template's fork took longer than this (µs): below it, a fork costs less
/// than the calls that make the template so.
const SHARE_US: u64 = 2_500;

/// Makes FIFO `path` (under /workspace) in the workspace `root` (the fork's
/// merged view), resolved inside it (a link in the snapshot cannot lead
/// elsewhere), unless one is there; owned by the sandbox's root.
fn make_fifo(
    root: &Path,
    path: &Path,
    mode: u32,
    owner: Option<(u32, u32)>,
) -> std::io::Result<()> {
    use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags};
    let rel = path
        .strip_prefix(WORKSPACE)
        .map_err(std::io::Error::other)?;
    let (Some(name), parent) = (rel.file_name(), rel.parent().unwrap_or(Path::new(""))) else {
        return Err(std::io::Error::other("no file name"));
    };
    let top = rustix::fs::open(
        root,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let dir = rustix::fs::openat2(
        &top,
        if parent.as_os_str().is_empty() {
            Path::new(".")
        } else {
            parent
        },
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS,
    )?;
    match rustix::fs::mknodat(&dir, name, FileType::Fifo, Mode::from_raw_mode(mode), 0) {
        Ok(()) => {}
        Err(rustix::io::Errno::EXIST) => return Ok(()),
        Err(e) => return Err(e.into()),
    }
    if let Some((uid, gid)) = owner {
        rustix::fs::chownat(
            &dir,
            name,
            Some(rustix::fs::Uid::from_raw(uid)),
            Some(rustix::fs::Gid::from_raw(gid)),
            AtFlags::SYMLINK_NOFOLLOW,
        )?;
    }
    Ok(())
}

/// Creates (or empties) a file the fork's init is handed, owner-only.
fn handover_file(path: &Path, truncate: bool, owner: Option<(u32, u32)>) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .create(true)
        .append(!truncate)
        .write(truncate)
        .truncate(truncate)
        .mode(0o600)
        .open(path)?;
    // The copy reopens them from inside its user namespace, as its root.
    match owner {
        Some((uid, gid)) => std::os::unix::fs::fchown(&f, Some(uid), Some(gid)),
        None => Ok(()),
    }
}

/// Makes native fork `rec` (its overlay mounted, its record written) from
/// `plan`: returns its init's host PID, running, with its process released
/// (or, `held`, still stopped until its init is let go: a prepared fork).
/// The caller starts the fork's supervisor adopting it. On an error the
/// copy is killed.
pub(crate) fn fork_into(
    plan: &Plan,
    rec: &SandboxRecord,
    spec: &RunSpec,
    repo_path: &Path,
    exe: &Path,
    held: bool,
) -> Result<NestedIn, SandboxError> {
    let dirs = SandboxDirs::new(repo_path, &rec.id);
    let launch = |message: String| SandboxError::Launch {
        name: rec.name.clone(),
        message,
        log: dirs.supervisor_log(),
    };
    let io = |step, path: &Path| io_error(&rec.name, step, path);
    let perr = |e: tine_proc::ProcError| process_error(&rec.name, e.into());
    let owner = crate::ns::owner_of_process(plan.state.processes[0].template.pid).ok();
    for (p, truncate) in [
        (dirs.stdout_log(), false),
        (dirs.stderr_log(), false),
        (dirs.init_status(), true),
    ] {
        handover_file(&p, truncate, owner).map_err(io("create", &p))?;
    }
    // The FIFOs its process holds, in its own workspace (snapshots skip them).
    for (path, mode) in &plan.fifos {
        make_fifo(&dirs.merged(), path, *mode, owner).map_err(io("make the FIFO", path))?;
    }
    let cg = CgroupRoot::detect(Path::new(DEFAULT_ROOT))
        .and_then(|r| r.create(&rec.id, &spec.limits))
        .map_err(|e| launch(format!("its cgroup: {e}")))?;
    let c = &plan.state.processes[0];
    let nest = tine_proc::template::Nest {
        pid: c.ns_pid,
        keep_caps: crate::ns::kept_capabilities(),
        new_net: spec.net != Net::Host,
    };
    let nested = {
        let _one = plan.clone_lock.lock().unwrap_or_else(|e| e.into_inner());
        // A template running as a user without CAP_SETUID cannot write the
        // new namespace's ID maps: the origin's init does.
        let caps = |pid: u32| tine_proc::creds::Credentials::of(pid).map_or(0, |c| c.effective);
        // CAP_SETGID (6) and CAP_SETUID (7).
        let setid = (1 << 6) | (1 << 7);
        let init_pid = plan.state.init_pid;
        let writer = |pid: u32, uid: &str, gid: &str| write_maps_in(init_pid, pid, uid, gid);
        let writer: Option<tine_proc::template::IdWriter> =
            (caps(c.template.pid) & setid != setid).then_some(&writer);
        tine_proc::template::clone_nested(&c.template, &nest, writer)
    }
    .map_err(perr)?;
    let (z, p) = nested.pids();
    // Before either runs a step of its own: everything they start is inside.
    for pid in [z, p] {
        cg.add_process(pid)
            .map_err(|e| launch(format!("its cgroup: {e}")))?;
    }
    let furnish = FurnishSpec {
        init_pid: z,
        workspace: dirs.merged(),
        hostname: rec.name.clone(),
        net: spec.net,
        handover: [
            (exe.to_path_buf(), "init".to_string()),
            (dirs.stdout_log(), "stdout".into()),
            (dirs.stderr_log(), "stderr".into()),
            (dirs.init_status(), "status".into()),
        ]
        .into_iter()
        .chain(if spec.image.is_some() {
            loader_files()
        } else {
            Vec::new()
        })
        .collect(),
        owner,
        tmp_bytes: crate::ns::tmp_bytes(spec.limits.memory_bytes),
        image_root: spec.image.is_some(),
    };
    let json = serde_json::to_string(&furnish).unwrap_or_default();
    let out = std::process::Command::new(exe)
        .arg("__sandbox-furnish")
        .arg(&json)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(io("start", exe))?;
    if !out.status.success() {
        return Err(launch(
            String::from_utf8_lossy(&out.stderr)
                .trim()
                .trim_start_matches("tine: sandbox furnish: ")
                .to_string(),
        ));
    }
    let (init, process) = nested.into_parts();
    let procs = &plan.state.processes;
    let hows: Vec<Respawn> = procs
        .iter()
        .zip(&plan.procs)
        .map(|(c, p)| Respawn {
            // The root has its PID from the nested clone.
            set_tid: c.parent.map(|_| c.ns_pid),
            parent: false,
            fds: p.fds.clone(),
            chdir: c.template.cwd.clone(),
            maps: p.maps.clone(),
            remake: p.remake.clone(),
            // Beside its origin: its own objects, always.
            keep_unchanged: false,
        })
        .collect();
    let main_len = plan.others.first().map_or(procs.len(), |s| s.start);
    let members = crate::processes::members_of(&procs[..main_len], &hows[..main_len]);
    // The copies (each child forked by its parent's copy, its template
    // grafted on), their descriptors and threads (their TIDs, the origin's,
    // are free in the new namespace until something else takes them); then
    // the fork's own templates of the checkpoint (children of its init,
    // made with those threads held), so that its rollbacks there are native
    // too; then all are left stopped, for the init to let run.
    // A copy made by a process that may not pick its PID (one running as
    // another user) gets it through the fork's init (`lastpid`).
    let (fixed, init) = through_init(init, |next_pid| {
        // Grafts hold the children's templates (seized) as they read them.
        let _one = plan.clone_lock.lock().unwrap_or_else(|e| e.into_inner());
        tine_proc::tree::clone_tree_from(&members, Some(process), next_pid)
            .and_then(|copies| copies.fix(&plan.shared))
    });
    let (mut fixed, mut init) = match (fixed, init) {
        (Ok(f), Some(init)) => (f, init),
        (Ok(f), None) => {
            abort(f, None, z);
            return Err(launch("its init could not be held".to_string()));
        }
        (Err(e), init) => {
            abort(Vec::new(), init, z);
            return Err(perr(e));
        }
    };
    // Each `tine exec` session's command, a tree of its own under the
    // fork's init, its streams to its client the files of `session_dir`.
    for s in &plan.others {
        let range = s.start..s.start + s.len;
        let root = &procs[s.start];
        let files = match s.session {
            true => session_files(z, root.ns_pid, s.owner),
            false => Ok(()),
        };
        if let Err(e) = files {
            abort(fixed, Some(init), z);
            return Err(io(
                "make the session's streams in",
                &session_dir(root.ns_pid),
            )(e));
        }
        let forked = {
            // Injected into the init, which shares the template's memory.
            let _one = plan.clone_lock.lock().unwrap_or_else(|e| e.into_inner());
            tine_proc::tree::fork_child(&mut init, Some(root.ns_pid))
        };
        let forked = match forked {
            Ok(c) => c,
            Err(e) => {
                abort(fixed, Some(init), z);
                return Err(perr(e));
            }
        };
        let members = crate::processes::members_of(&procs[range.clone()], &hows[range]);
        let (made, back) = through_init(init, |next_pid| {
            let _one = plan.clone_lock.lock().unwrap_or_else(|e| e.into_inner());
            tine_proc::tree::clone_tree_onto(&members, forked, next_pid)
                .and_then(|copies| copies.fix(&s.shared))
        });
        match (made, back) {
            (Ok(m), Some(back)) => {
                fixed.extend(m);
                init = back;
            }
            (Ok(m), None) => {
                fixed.extend(m);
                abort(fixed, None, z);
                return Err(launch("its init could not be held".to_string()));
            }
            (Err(e), back) => {
                abort(fixed, back, z);
                return Err(perr(e));
            }
        }
    }
    let mut shm = tine_proc::shm::TreeShm::default();
    let mut made = Vec::with_capacity(fixed.len());
    let mut failed = None;
    // A fork of one process whose fork is costly gets its own template
    // sharing the source template's memory, which its init still shares:
    // one copy of the page tables per fork instead of two.
    let share = fixed.len() == 1 && plan.others.is_empty() && procs[0].template.fork_us > SHARE_US;
    for ((t, threads), c) in fixed.iter_mut().zip(procs) {
        let hop = if c.parent.is_none() {
            tine_proc::template::Hop::Sibling
        } else {
            tine_proc::template::Hop::Orphan
        };
        // The copy's fork flags are its template's (set on it as it was
        // made): its page tables need no scan for them while its mappings
        // are the template's.
        let flags = tine_proc::forkflags::ranges(c.template.pid)
            .ok()
            .map(|ranges| tine_proc::forkflags::Scan {
                ranges,
                flags: c.template.fork_flags.clone(),
            });
        let shared = if share {
            let _one = plan.clone_lock.lock().unwrap_or_else(|e| e.into_inner());
            let (tpl, keep) = (&c.template, nest.keep_caps);
            // Refused or failed (nothing left behind): forked instead.
            tine_proc::sharing::share(&mut init, tpl, t, threads, flags.as_ref(), keep)
                .ok()
                .flatten()
        } else {
            None
        };
        let made_one = match shared {
            Some(m) => Ok(m),
            None => tine_proc::template::fork_template_via(
                t,
                threads,
                flags.as_ref(),
                hop,
                &mut shm,
                None,
            ),
        };
        match made_one {
            Ok(m) => made.push(m),
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    let parked = match failed {
        Some(e) => Err(e),
        None => {
            let mut templates = Vec::with_capacity(made.len());
            let mut settled = Ok(());
            for (tpl, unsettled) in made {
                settled = settled.and(unsettled.settle());
                templates.push(tpl);
            }
            // Stopped without a tracer: the init lets them run once it is
            // set up. Their threads, let go after them, join their group stops.
            let mut parked = settled;
            for (t, threads) in fixed.drain(..) {
                parked = parked.and(t.park());
                for th in threads {
                    parked = parked.and(th.resume());
                }
            }
            parked
                .and_then(|()| Ok(tine_proc::stat(z)?.start_time))
                .map(|start| (templates, start))
        }
    };
    let (templates, init_start) = match parked {
        Ok(p) => p,
        Err(e) => {
            // The processes first: as their tracer we must hear of their
            // ends before their init can be reaped.
            for (t, threads) in fixed.into_iter().rev() {
                for th in threads {
                    th.kill();
                }
                t.kill();
            }
            init.kill();
            return Err(perr(e));
        }
    };
    let nested = NestedIn {
        origin: plan.origin.clone(),
        init_pid: z,
        init_start,
    };
    let record = serde_json::to_vec(&nested).unwrap_or_default();
    if let Err(e) = tine_store::write_atomic(&dirs.nested_in(), &record) {
        init.kill();
        return Err(io("record the origin of", &dirs.root)(e));
    }
    let st = ProcessState {
        init_pid: z,
        init_start,
        created_ns: tine_store::now_ns(),
        processes: procs
            .iter()
            .zip(templates)
            .map(|(c, template)| Captured {
                template,
                image: None,
                // A session's command has no client in the fork.
                anchor: None,
                ..c.clone()
            })
            .collect(),
        measured_bytes: 0,
        measured_ns: 0,
        ..plan.state.clone()
    };
    if let Err(e) = crate::processes::save(&dirs, &st) {
        init.kill();
        return Err(io("record the process state of", &dirs.root)(e));
    }
    let path = format!("{HANDOVER}/init");
    // Its command first, then the others of its tree.
    let pids: Vec<String> = procs.iter().map(|c| c.ns_pid.to_string()).collect();
    let mut argv: Vec<&[u8]> = vec![b"tine", b"__sandbox-adopt"];
    if held {
        argv.push(b"--held");
    }
    argv.extend(pids.iter().map(|p| p.as_bytes()));
    let env = format!("PATH={}", crate::DEFAULT_PATH);
    // The fork's init is root in its namespaces (a copy of a template that
    // runs as another user would lose its capabilities at the exec).
    let mut init = init;
    // Until its exec the init shares the template's memory, where the
    // exec's arguments are written.
    let one = plan.clone_lock.lock().unwrap_or_else(|e| e.into_inner());
    let root = [
        ("setgroups", nix::libc::SYS_setgroups, [0u64, 0, 0]),
        ("setresgid", nix::libc::SYS_setresgid, [0, 0, 0]),
        ("setresuid", nix::libc::SYS_setresuid, [0, 0, 0]),
    ]
    .into_iter()
    .try_for_each(|(call, nr, a)| {
        init.syscall(call, nr, [a[0], a[1], a[2], 0, 0, 0])
            .map(|_| ())
    });
    // An image's root lacks the host's libraries tine is linked with: the
    // init runs through the handed-over loader, which finds them beside it.
    let (path, argv) = match spec.image {
        None => (path, argv),
        Some(_) => {
            let mut through: Vec<&[u8]> = vec![
                b"ld.so",
                b"--library-path",
                HANDOVER.as_bytes(),
                b"--argv0",
                b"tine",
                path.as_bytes(),
            ];
            through.extend(&argv[1..]);
            (format!("{HANDOVER}/{LOADER}"), through)
        }
    };
    root.and_then(|()| init.execve(path.as_bytes(), &argv, &[env.as_bytes()]))
        .map_err(|e| {
            kill(z);
            perr(e)
        })?;
    drop(one);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = std::fs::read_to_string(dirs.init_status()).unwrap_or_default();
        match Adopted::parse(&text) {
            Adopted::Ready | Adopted::Exited(_) => break,
            Adopted::Held if held => break,
            Adopted::Failed(e) => return Err(launch(e)),
            Adopted::Pending | Adopted::Held => {}
        }
        if !nested.alive() || Instant::now() > deadline {
            kill(z);
            return Err(launch(
                "its init ended (or hung) before it was set up".to_string(),
            ));
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    Ok(nested)
}

/// Writes the ID maps of `pid` (a process in a user namespace nested in
/// the one of sandbox init `init_pid`) from that sandbox's user namespace,
/// joined with every capability there (`nsenter`): only a writer in the
/// parent namespace may, and the sandbox's own processes lack
/// `CAP_SYS_ADMIN`.
fn write_maps_in(init_pid: u32, pid: u32, uid: &str, gid: &str) -> std::io::Result<()> {
    let out = std::process::Command::new("nsenter")
        .arg(format!("--user=/proc/{init_pid}/ns/user"))
        .args([
            "--",
            "sh",
            "-c",
            "printf '%s' \"$1\" > /proc/$3/uid_map && printf '%s' \"$2\" > /proc/$3/gid_map",
            "sh",
            uid,
            gid,
            &pid.to_string(),
        ])
        .stdin(std::process::Stdio::null())
        .output()?;
    if out.status.success() {
        Ok(())
    } else {
        Err(std::io::Error::other(
            String::from_utf8_lossy(&out.stderr).trim().to_string(),
        ))
    }
}

/// Runs `f` with a setter of the fork's next PID (see `lastpid`), which
/// hands `ns_last_pid` to the fork's init (`init`, held) when first asked;
/// returns what `f` did and the init, held again (`None`: lost).
fn through_init<R>(
    init: Tracee,
    f: impl FnOnce(tine_proc::tree::NextPidFn<'_>) -> R,
) -> (R, Option<Tracee>) {
    let z = init.pid();
    let mut slot = Some(init);
    let mut setter: Option<tine_proc::lastpid::NextPid> = None;
    let r = {
        let mut next_pid = |pid: u32| -> Result<(), tine_proc::ProcError> {
            let s = match &mut setter {
                Some(s) => s,
                None => {
                    let held = slot.take().ok_or(tine_proc::ProcError::Gone { pid: z })?;
                    setter.insert(tine_proc::lastpid::NextPid::new(held)?)
                }
            };
            s.set(pid)
        };
        f(&mut next_pid)
    };
    let init = match setter.map(|s| s.into_holder()) {
        Some(Ok(held)) => Some(held),
        Some(Err(_)) => None,
        None => slot.take(),
    };
    (r, init)
}

/// Kills a half-made fork: its copies (children first, unrun) and init.
fn abort(fixed: Vec<(Tracee, Vec<Tracee>)>, init: Option<Tracee>, z: u32) {
    for (t, threads) in fixed.into_iter().rev() {
        threads.into_iter().for_each(Tracee::kill);
        t.kill();
    }
    match init {
        Some(init) => init.kill(),
        None => kill(z),
    }
}

/// Makes the streams of the session whose command is `pid` in the fork
/// whose init is host PID `z` (its private `/tmp`, mounted already and
/// untouched by any of its processes yet): [`session_dir`] with the FIFO
/// `stdin` and the files `stdout` and `stderr`, all `owner`'s, 0600.
fn session_files(z: u32, pid: u32, owner: Option<(u32, u32)>) -> std::io::Result<()> {
    use rustix::fs::{FileType, Mode, OFlags, ResolveFlags};
    let root = rustix::fs::open(
        format!("/proc/{z}/root"),
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let rel = session_dir(pid);
    let rel = rel.strip_prefix("/").map_err(std::io::Error::other)?;
    let (Some(name), Some(parent)) = (rel.file_name(), rel.parent()) else {
        return Err(std::io::Error::other("no file name"));
    };
    let beneath = |dir: &dyn rustix::fd::AsFd, path: &Path| {
        rustix::fs::openat2(
            dir,
            path,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
            ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS,
        )
    };
    let tmp = beneath(&root, parent)?;
    rustix::fs::mkdirat(&tmp, name, Mode::from_raw_mode(0o700))?;
    let dir = beneath(&tmp, Path::new(name))?;
    let own = |at: &rustix::fd::OwnedFd, name: &str| match owner {
        Some((uid, gid)) => rustix::fs::chownat(
            at,
            name,
            Some(rustix::fs::Uid::from_raw(uid)),
            Some(rustix::fs::Gid::from_raw(gid)),
            rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
        ),
        None => Ok(()),
    };
    rustix::fs::mknodat(&dir, "stdin", FileType::Fifo, Mode::from_raw_mode(0o600), 0)?;
    own(&dir, "stdin")?;
    for f in ["stdout", "stderr"] {
        drop(rustix::fs::openat(
            &dir,
            f,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )?);
        own(&dir, f)?;
    }
    own(&tmp, name.to_str().unwrap_or_default())?;
    Ok(())
}

/// Kills a fork's init: its PID namespace, and the process in it, end with it
/// (the source's init reaps it).
fn kill(z: u32) {
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(z as i32),
        nix::sys::signal::Signal::SIGKILL,
    );
}

/// The name the dynamic loader is handed over as.
const LOADER: &str = "ld.so";

/// The dynamic loader and the shared libraries this program (tine, whose
/// copy a fork's init runs) has mapped, as handover entries: each library
/// by its file name, the loader as [`LOADER`]. A fork of a sandbox whose
/// root is an image's execs its init through them (the image has its own
/// libraries, or none).
fn loader_files() -> Vec<(PathBuf, String)> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let mut out: Vec<(PathBuf, String)> = Vec::new();
    for line in maps.lines() {
        let Some(path) = line
            .split_whitespace()
            .nth(5)
            .filter(|p| p.starts_with('/'))
        else {
            continue;
        };
        let p = Path::new(path);
        let Some(name) = p.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if !name.contains(".so") {
            continue;
        }
        let name = if name.starts_with("ld-linux") {
            LOADER.to_string()
        } else {
            name.to_string()
        };
        if !out.iter().any(|(_, n)| *n == name) {
            out.push((p.to_path_buf(), name));
        }
    }
    out
}
