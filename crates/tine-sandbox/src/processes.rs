//! The process state of live sandboxes: templates made by native fork when a
//! snapshot is taken, and rollbacks that bring the processes back from them.
//!
//! Which processes: every process of the sandbox's cgroup except its init and
//! the templates. Each must be a child of the init (the command, or orphans
//! it adopted) and pass `tine_proc::cloneable`; processes entered with
//! `tine exec` are refused with their PID, command line and the reason.
//!
//! A snapshot's templates are recorded in `REPO/sandboxes/ID/templates/HEX.json`
//! (written atomically). Templates live in the sandbox's PID namespace: they
//! end with the sandbox's run (stop, restart, reboot), and the snapshot stays
//! restorable from its files.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tine_proc::ProcError;
use tine_proc::ptrace::Tracee;
use tine_proc::template::{Respawn, Template, Unsettled, fixes_for, fork_template};
use tine_store::{ObjectId, now_ns};

use crate::cgroup::Cgroup;
use crate::criu::Criu;
use crate::ns::WORKSPACE;
use crate::supervisor::SandboxDirs;

/// Format version of a templates file.
const VERSION: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error(transparent)]
    Proc(#[from] ProcError),
    #[error(
        "process {pid} ({cmdline}) cannot be checkpointed by native fork: its parent is not the sandbox's init (it was started with `tine exec`?); wait for it to end, or take the snapshot with --files-only"
    )]
    NotInTree { pid: u32, cmdline: String },
    #[error(transparent)]
    Criu(Box<crate::criu::CriuError>),
    #[error("sandbox {name}: {step}: {source}")]
    Io {
        name: String,
        step: &'static str,
        source: std::io::Error,
    },
}

impl ProcessError {
    /// Maps an I/O error of sandbox `name` at `step`.
    fn io(name: &str, step: &'static str) -> impl FnOnce(std::io::Error) -> ProcessError + use<> {
        let name = name.to_string();
        move |source| ProcessError::Io { name, step, source }
    }
}

impl From<crate::criu::CriuError> for ProcessError {
    fn from(e: crate::criu::CriuError) -> Self {
        ProcessError::Criu(Box::new(e))
    }
}

/// One process of a snapshot: where it lived and its template.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Captured {
    /// Its PID inside the sandbox, which a rollback gives back.
    pub ns_pid: u32,
    pub cmdline: String,
    pub template: Template,
    /// The template persisted with CRIU (`--persist`), which outlives it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<crate::criu::Image>,
}

/// The process state a snapshot holds in one sandbox.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProcessState {
    pub version: u32,
    pub snapshot: String,
    /// The init the templates are children of (host PID and start time): a
    /// new run of the sandbox has another one, and none of these templates.
    pub init_pid: u32,
    pub init_start: u64,
    pub created_ns: u64,
    pub processes: Vec<Captured>,
    /// The templates' private bytes when last measured, and when (reading
    /// `smaps_rollup` walks every page: the pool reuses a recent figure).
    #[serde(default)]
    pub measured_bytes: u64,
    #[serde(default)]
    pub measured_ns: u64,
}

impl ProcessState {
    /// Whether `init_pid` (with its start time) is the init the templates
    /// were made under: the same run of the sandbox.
    fn same_run(&self, init_pid: u32, init_start: u64) -> bool {
        self.init_pid == init_pid && self.init_start == init_start
    }

    /// Whether the init the templates were made under still runs.
    fn init_alive(&self) -> bool {
        tine_proc::stat(self.init_pid).is_ok_and(|s| s.start_time == self.init_start)
    }

    /// Whether every template is still there (same init, same processes).
    pub fn alive(&self) -> bool {
        self.init_alive()
            && self
                .processes
                .iter()
                .all(|c| tine_proc::template::template_alive(&c.template))
    }

    /// Whether every process can be brought back: from its live template,
    /// or (when CRIU is at hand) from its persisted images.
    pub fn restorable(&self, with_criu: bool) -> bool {
        let same_run = self.init_alive();
        self.processes.iter().all(|c| {
            (same_run && tine_proc::template::template_alive(&c.template))
                || (with_criu && c.image.is_some())
        })
    }

    /// Whether every process is persisted with CRIU.
    pub fn persisted(&self) -> bool {
        !self.processes.is_empty() && self.processes.iter().all(|c| c.image.is_some())
    }

    /// Private memory of the templates: what their copy-on-write copies cost
    /// (pages the origin changed since), from `/proc/PID/smaps_rollup`.
    pub fn private_bytes(&self) -> u64 {
        self.processes
            .iter()
            .map(|c| private_bytes(c.template.pid))
            .sum()
    }

    pub fn discard(&self) {
        for c in &self.processes {
            tine_proc::template::discard(&c.template);
        }
    }
}

/// `Private_Clean + Private_Dirty` of a process, in bytes.
pub fn private_bytes(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .map(|t| {
            t.lines()
                .filter(|l| l.starts_with("Private_Clean:") || l.starts_with("Private_Dirty:"))
                .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                .sum::<u64>()
                * 1024
        })
        .unwrap_or(0)
}

fn templates_dir(dirs: &SandboxDirs) -> PathBuf {
    dirs.root.join("templates")
}

fn state_path(dirs: &SandboxDirs, snap: &ObjectId) -> PathBuf {
    templates_dir(dirs).join(format!("{}.json", snap.to_hex()))
}

/// Every templates file of a sandbox.
pub fn all_states(dirs: &SandboxDirs) -> Vec<(PathBuf, ProcessState)> {
    let Ok(rd) = std::fs::read_dir(templates_dir(dirs)) else {
        return Vec::new();
    };
    rd.filter_map(|e| {
        let p = e.ok()?.path();
        let text = std::fs::read(&p).ok()?;
        let st: ProcessState = serde_json::from_slice(&text).ok()?;
        (st.version == VERSION).then_some((p, st))
    })
    .collect()
}

/// The process state recorded for `snap` in this sandbox (its templates may
/// be gone: see [`ProcessState::restorable`]).
pub fn load(dirs: &SandboxDirs, snap: &ObjectId) -> Option<ProcessState> {
    let text = std::fs::read(state_path(dirs, snap)).ok()?;
    let st: ProcessState = serde_json::from_slice(&text).ok()?;
    (st.version == VERSION).then_some(st)
}

/// Records a snapshot's templates (atomically; replacing an earlier record
/// of the same snapshot, whose templates not in `st` are discarded).
pub fn save(dirs: &SandboxDirs, st: &ProcessState) -> std::io::Result<()> {
    let dir = templates_dir(dirs);
    std::fs::create_dir_all(&dir)?;
    let path = dir.join(format!("{}.json", st.snapshot));
    if let Ok(old) = std::fs::read(&path)
        && let Ok(old) = serde_json::from_slice::<ProcessState>(&old)
    {
        for c in &old.processes {
            if !st.processes.iter().any(|n| n.template == c.template) {
                tine_proc::template::discard(&c.template);
            }
        }
    }
    let data = serde_json::to_vec_pretty(st).map_err(std::io::Error::other)?;
    tine_store::write_atomic(&path, &data)
}

/// Marks a snapshot's templates as just used (for least-recently-used eviction).
pub fn touch(dirs: &SandboxDirs, snap: &ObjectId) {
    set_used(&state_path(dirs, snap), std::time::SystemTime::now());
}

/// A record's last use is its modification time.
fn set_used(path: &Path, when: std::time::SystemTime) {
    if let Ok(f) = std::fs::File::options().append(true).open(path) {
        let _ = f.set_modified(when);
    }
}

/// Host PIDs of every live template of the sandbox (records also name
/// templates that are gone, whose PIDs may have been reused).
pub(crate) fn template_pids(dirs: &SandboxDirs) -> Vec<u32> {
    all_states(dirs)
        .iter()
        .flat_map(|(_, s)| s.processes.iter().map(|c| &c.template))
        .filter(|t| tine_proc::template::template_alive(t))
        .map(|t| t.pid)
        .collect()
}

/// The processes a checkpoint covers: the cgroup's, minus init and the
/// templates (`skip`).
fn targets(name: &str, cg: &Cgroup, init_pid: u32, skip: &[u32]) -> Result<Vec<u32>, ProcessError> {
    let mut pids: Vec<u32> = cg
        .processes()
        .map_err(|e| {
            ProcessError::io(name, "list processes")(std::io::Error::other(e.to_string()))
        })?
        .into_iter()
        .filter(|p| *p != init_pid && !skip.contains(p))
        .collect();
    pids.sort_unstable();
    Ok(pids)
}

/// The sandbox's processes, stopped with ptrace (not frozen: a stopped
/// process can be made to fork, a frozen one cannot).
#[derive(Debug)]
pub struct Stopped {
    tracees: Vec<Tracee>,
    init_pid: u32,
    /// The sandbox's templates: the ones there before, and those made since.
    templates: Vec<u32>,
    /// Templates made, to be settled once the processes run again.
    unsettled: Vec<Unsettled>,
    /// When the first process was stopped.
    pub since: Instant,
}

/// Stops every process a checkpoint covers, after checking each can be cloned.
pub fn stop_all(
    name: &str,
    cg: &Cgroup,
    init_pid: u32,
    dirs: &SandboxDirs,
) -> Result<Stopped, ProcessError> {
    let skip = template_pids(dirs);
    let pids = targets(name, cg, init_pid, &skip)?;
    // The reasons a fork cannot copy a process first (a shell with a live
    // child is named for its child, not the child for its parent).
    for &pid in &pids {
        match tine_proc::cloneable(pid) {
            Ok(_) | Err(ProcError::Gone { .. }) => {}
            Err(e) => return Err(e.into()),
        }
    }
    for &pid in &pids {
        let st = tine_proc::stat(pid)?;
        if st.ppid != init_pid {
            return Err(ProcessError::NotInTree {
                pid: tine_proc::template::ns_pid(pid).unwrap_or(pid),
                cmdline: tine_proc::inspect::cmdline(pid),
            });
        }
    }
    let since = Instant::now();
    let mut tracees = Vec::with_capacity(pids.len());
    for &pid in &pids {
        match Tracee::seize(pid) {
            Ok(t) => tracees.push(t),
            // It ended meanwhile: nothing to capture.
            Err(ProcError::Gone { .. }) => {}
            Err(e) => return Err(e.into()),
        }
    }
    // Whatever was started between the listing and the stops is refused below
    // (its parent now has a live child).
    let now = targets(name, cg, init_pid, &skip)?;
    for pid in now {
        if !pids.contains(&pid) {
            return Err(ProcessError::Proc(ProcError::NotCloneable(
                tine_proc::NotCloneable {
                    pid,
                    cmdline: tine_proc::inspect::cmdline(pid),
                    reason: "it was started while the snapshot was being taken".into(),
                },
            )));
        }
    }
    Ok(Stopped {
        tracees,
        init_pid,
        templates: skip,
        unsettled: Vec::new(),
        since,
    })
}

impl Stopped {
    /// Makes a template of every stopped process (they stay stopped). The
    /// snapshot's id is filled in once it is known.
    pub fn make_templates(&mut self) -> Result<ProcessState, ProcessError> {
        let init_start = tine_proc::stat(self.init_pid)?.start_time;
        let mut processes = Vec::with_capacity(self.tracees.len());
        for t in &mut self.tracees {
            let pid = t.pid();
            let made = fork_template(t).and_then(|(template, unsettled)| {
                let c = Captured {
                    ns_pid: tine_proc::template::ns_pid(pid).ok_or(ProcError::Gone { pid })?,
                    cmdline: tine_proc::inspect::cmdline(pid),
                    template,
                    image: None,
                };
                Ok((c, unsettled))
            });
            match made {
                Ok((c, unsettled)) => {
                    self.templates.push(c.template.pid);
                    self.unsettled.push(unsettled);
                    processes.push(c)
                }
                Err(e) => {
                    // Dropped unsettled, the ones made so far are killed.
                    self.unsettled.clear();
                    return Err(e.into());
                }
            }
        }
        Ok(ProcessState {
            version: VERSION,
            snapshot: String::new(),
            init_pid: self.init_pid,
            init_start,
            created_ns: now_ns(),
            processes,
            measured_bytes: 0,
            measured_ns: 0,
        })
    }

    /// The sandbox's templates (for scans that skip them: they never run).
    pub fn templates(&self) -> &[u32] {
        &self.templates
    }

    /// Whether a process joined the sandbox since the processes were stopped
    /// (entered with `tine exec`): it was not stopped, so it may have changed
    /// files meanwhile.
    pub fn joined(&self, cg: &Cgroup) -> bool {
        cg.processes().map_or(true, |pids| {
            pids.iter().any(|p| {
                *p != self.init_pid
                    && !self.templates.contains(p)
                    && !self.tracees.iter().any(|t| t.pid() == *p)
            })
        })
    }

    /// Lets every process run on; returns how long they were stopped, and
    /// the templates made, to be settled now that their origins run.
    pub fn resume(self) -> (Duration, ToSettle) {
        for t in self.tracees {
            let _ = t.resume();
        }
        (self.since.elapsed(), ToSettle(self.unsettled))
    }
}

/// Templates made while their origins were stopped: dropped unsettled, they
/// are killed.
#[derive(Debug)]
#[must_use = "templates not settled are killed"]
pub struct ToSettle(Vec<Unsettled>);

impl ToSettle {
    /// Gives each its own session and parks it. One that cannot be settled
    /// is killed: a rollback to it says it is gone.
    pub fn settle(self) {
        for u in self.0 {
            let _ = u.settle();
        }
    }
}

/// Sends init a control signal (hold or release) and waits until it took it
/// (the signal is no longer pending).
fn signal_init(init_pid: u32, sig: i32) -> Result<(), ProcError> {
    crate::ns::send_signal(init_pid, sig).map_err(|_| ProcError::Gone { pid: init_pid })?;
    let bit = 1u64 << (sig - 1);
    let mut gone = false;
    let taken = poll_until(Duration::from_secs(5), || {
        let Ok(status) = std::fs::read_to_string(format!("/proc/{init_pid}/status")) else {
            gone = true;
            return true;
        };
        let pending = status
            .lines()
            .filter(|l| l.starts_with("ShdPnd:") || l.starts_with("SigPnd:"))
            .filter_map(|l| u64::from_str_radix(l.split_whitespace().nth(1)?, 16).ok())
            .fold(0, |a, b| a | b);
        pending & bit == 0
    });
    if gone {
        return Err(ProcError::Gone { pid: init_pid });
    }
    if taken {
        return Ok(());
    }
    Err(ProcError::Ptrace {
        pid: init_pid,
        step: "wait for the sandbox's init to take a request",
        source: std::io::Error::from(std::io::ErrorKind::TimedOut),
    })
}

/// Polls `done` (yielding in between) until it holds or `timeout` passed;
/// returns whether it held.
fn poll_until(timeout: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if done() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::yield_now();
    }
}

/// Waits until each of `pids` is exiting (or gone): it runs no code of its
/// own any more, so it writes to no file.
fn wait_exiting(pids: &[u32]) {
    for pid in pids {
        poll_until(Duration::from_secs(10), || {
            tine_proc::stat(*pid).map_or(true, |st| st.exiting())
        });
    }
}

/// Waits until `pids` are gone (killed and reaped by init).
fn wait_gone(pids: &[u32]) {
    for pid in pids {
        poll_until(Duration::from_secs(10), || {
            !Path::new(&format!("/proc/{pid}")).exists()
        });
    }
}

/// Where a rollback's processes came from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rolled {
    /// Host PIDs of the processes brought back.
    pub pids: Vec<u32>,
    /// How many templates were first brought back from CRIU images.
    pub from_images: usize,
    /// From the first process killed to the last copy running.
    pub paused: Duration,
}

/// The host PID of the process of `cg` whose PID in the sandbox is `ns_pid`.
fn find_ns_pid(cg: &Cgroup, ns_pid: u32) -> Option<u32> {
    cg.processes()
        .ok()?
        .into_iter()
        .find(|p| tine_proc::template::ns_pid(*p) == Some(ns_pid))
}

/// Rolls the sandbox's processes back to `st`: init (`init_pid`, the
/// sandbox's current one) holds on, every live process (not init, not a
/// template) is killed, `restore_files` puts the workspace back, templates
/// that are gone are brought back from their CRIU images (after the files:
/// CRIU checks the files its process holds), and each template gives a copy
/// under its origin's PID, with its workspace files opened again at their
/// offsets. `restore_files(frozen)` is called unfrozen first (nothing but
/// init and stopped processes is left), possibly from another thread, and
/// again if a process joined meanwhile. Check [`ProcessState::restorable`]
/// first: a template that is gone without images fails the rollback after
/// the live processes were killed.
pub fn rollback<R: Send>(
    name: &str,
    cg: &Cgroup,
    dirs: &SandboxDirs,
    init_pid: u32,
    st: &mut ProcessState,
    criu: Option<&Criu>,
    restore_files: impl Fn(bool) -> R + Sync,
) -> Result<(R, Rolled), ProcessError> {
    let hold = crate::ns::hold_signal();
    let release = crate::ns::release_signal();
    let templates = template_pids(dirs);
    let init_start = tine_proc::stat(init_pid)?.start_time;
    let same_run = st.same_run(init_pid, init_start);
    let all_alive = same_run
        && st
            .processes
            .iter()
            .all(|c| tine_proc::template::template_alive(&c.template));
    let hows: Vec<Respawn> = st
        .processes
        .iter()
        .map(|c| Respawn {
            set_tid: Some(c.ns_pid),
            parent: true,
            fds: fixes_for(&c.template.fds, Some(Path::new(WORKSPACE))),
            chdir: None,
        })
        .collect();
    signal_init(init_pid, hold)?;
    let result = if all_alive {
        rollback_live(name, cg, init_pid, st, &hows, &templates, &restore_files)
    } else {
        let run = (same_run, init_start);
        rollback_persisted(
            name,
            cg,
            dirs,
            init_pid,
            run,
            st,
            criu,
            &hows,
            &templates,
            &restore_files,
        )
    };
    let _ = signal_init(init_pid, release);
    result
}

/// Kills every live process of the sandbox (not init, not `skip`) and waits
/// until each is exiting: it runs no code of its own any more.
fn kill_live(
    name: &str,
    cg: &Cgroup,
    init_pid: u32,
    skip: &[u32],
) -> Result<Vec<u32>, ProcessError> {
    let live = targets(name, cg, init_pid, skip)?;
    for pid in &live {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(*pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    wait_exiting(&live);
    Ok(live)
}

/// After the first restore of the files (`r`): a process that joined the
/// sandbox meanwhile (`tine exec`) is killed too and the files restored
/// again (frozen from the third round), up to five rounds in all.
fn kill_joiners<R>(
    name: &str,
    cg: &Cgroup,
    init_pid: u32,
    skip: &[u32],
    mut r: R,
    restore_files: &impl Fn(bool) -> R,
) -> Result<R, ProcessError> {
    for round in 2..=5 {
        let joined = kill_live(name, cg, init_pid, skip)?;
        if joined.is_empty() {
            break;
        }
        r = restore_files(round > 2);
        wait_gone(&joined);
    }
    Ok(r)
}

/// Every template alive: the copies are made (stopped, each in its own
/// session) while the files are restored on another thread, unfrozen, as the
/// killed processes' memory is torn down; then they get their descriptors
/// and run.
fn rollback_live<R: Send>(
    name: &str,
    cg: &Cgroup,
    init_pid: u32,
    st: &ProcessState,
    hows: &[Respawn],
    templates: &[u32],
    restore_files: &(impl Fn(bool) -> R + Sync),
) -> Result<(R, Rolled), ProcessError> {
    let t0 = Instant::now();
    let live = kill_live(name, cg, init_pid, templates)?;
    let (r, copies) = std::thread::scope(|sc| {
        let files = tine_fs::paths::spawn_walker(sc, || restore_files(false));
        // The PIDs the copies take are free once the killed processes are reaped.
        wait_gone(&live);
        let copies: Result<Vec<_>, ProcError> = st
            .processes
            .iter()
            .zip(hows)
            .map(|(c, how)| {
                let mut copies =
                    tine_proc::template::clone_stopped(&c.template, std::slice::from_ref(how))?;
                // Sessions while the files are still being put back.
                copies.prepare()?;
                Ok(copies)
            })
            .collect();
        let files = files.map(|h| {
            h.join()
                .map_err(|_| std::io::Error::other("the restoring thread panicked"))
        });
        (files.and_then(|r| r), copies)
    });
    let r = r.map_err(|source| ProcessError::Io {
        name: name.to_string(),
        step: "restore the files",
        source,
    })?;
    let copies = copies?;
    let mut skip: Vec<u32> = templates.to_vec();
    skip.extend(copies.iter().flat_map(|c| c.pids()));
    let r = kill_joiners(name, cg, init_pid, &skip, r, restore_files)?;
    let mut rolled = Rolled::default();
    for c in copies {
        rolled.pids.extend(c.finish()?);
    }
    rolled.paused = t0.elapsed();
    Ok((r, rolled))
}

/// Some template gone: the files are restored first (CRIU checks the files
/// its process holds), the templates brought back from their images, then
/// the copies made from all of them. `run`: whether the record is of this
/// run of the sandbox, and the current init's start time.
#[allow(clippy::too_many_arguments)]
fn rollback_persisted<R>(
    name: &str,
    cg: &Cgroup,
    dirs: &SandboxDirs,
    init_pid: u32,
    (same_run, init_start): (bool, u64),
    st: &mut ProcessState,
    criu: Option<&Criu>,
    hows: &[Respawn],
    templates: &[u32],
    restore_files: &impl Fn(bool) -> R,
) -> Result<(R, Rolled), ProcessError> {
    let t0 = Instant::now();
    let live = kill_live(name, cg, init_pid, templates)?;
    let r = restore_files(false);
    wait_gone(&live);
    let r = kill_joiners(name, cg, init_pid, templates, r, restore_files)?;
    let mut rolled = Rolled::default();
    for c in &mut st.processes {
        if same_run && tine_proc::template::template_alive(&c.template) {
            continue;
        }
        let (Some(img), Some(criu)) = (&c.image, criu) else {
            return Err(ProcError::TemplateGone {
                pid: c.template.pid,
            }
            .into());
        };
        // A template just let go may still be exiting: its PID comes free
        // only once it is reaped.
        poll_until(Duration::from_secs(10), || {
            !tine_proc::stat(c.template.pid).is_ok_and(|s| s.start_time == c.template.start_time)
        });
        let pid = crate::criu::restore(
            criu,
            init_pid,
            &cg.procs_files(),
            img,
            &criu_dir(dirs).join(&img.dir),
            |ns| find_ns_pid(cg, ns),
        )?;
        c.template.pid = pid;
        c.template.start_time = tine_proc::stat(pid)?.start_time;
        // CRIU may have put its vDSO elsewhere: looked up again.
        c.template.syscall_at = 0;
        rolled.from_images += 1;
    }
    if rolled.from_images > 0 {
        // The templates now live in this run of the sandbox.
        st.init_pid = init_pid;
        st.init_start = init_start;
        save(dirs, st).map_err(ProcessError::io(
            name,
            "record templates brought back by CRIU",
        ))?;
    }
    for (c, how) in st.processes.iter().zip(hows) {
        rolled.pids.extend(tine_proc::template::respawn_many(
            &c.template,
            std::slice::from_ref(how),
        )?);
    }
    rolled.paused = t0.elapsed();
    Ok((r, rolled))
}

fn criu_dir(dirs: &SandboxDirs) -> PathBuf {
    dirs.root.join("criu")
}

/// Creates a sandbox's CRIU images directory (root only: images hold memory).
fn create_criu_dir(name: &str, dirs: &SandboxDirs) -> Result<PathBuf, ProcessError> {
    use std::os::unix::fs::DirBuilderExt;
    let dir = criu_dir(dirs);
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
        .map_err(ProcessError::io(name, "create the CRIU images directory"))?;
    Ok(dir)
}

/// Gives the sandbox at `dst` (a fork of `src`) the persisted process state
/// `st` as its own: the images hard-linked into its directory, descriptors
/// of `src`'s own files (its logs) pointed at `dst`'s, and a record of no
/// live template, so that a rollback there brings the processes back from
/// the images. Returns that record.
pub fn adopt(
    name: &str,
    st: &ProcessState,
    src: &SandboxDirs,
    dst: &SandboxDirs,
) -> Result<ProcessState, ProcessError> {
    let io = |step| ProcessError::io(name, step);
    let to = create_criu_dir(name, dst)?;
    let mut out = st.clone();
    out.init_pid = 0;
    out.init_start = 0;
    for c in &mut out.processes {
        c.template.pid = 0;
        c.template.start_time = 0;
        let Some(img) = &mut c.image else { continue };
        let (from, into) = (criu_dir(src).join(&img.dir), to.join(&img.dir));
        std::fs::create_dir_all(&into).map_err(io("create a fork's images directory"))?;
        for e in std::fs::read_dir(&from).map_err(io("list images"))? {
            let e = e.map_err(io("list images"))?;
            let target = into.join(e.file_name());
            if !target.exists() {
                std::fs::hard_link(e.path(), &target).map_err(io("link images"))?;
            }
        }
        for x in &mut img.externals {
            if let Ok(rest) = x.path.strip_prefix(&src.root) {
                x.path = dst.root.join(rest);
            }
        }
    }
    save(dst, &out).map_err(io("record a fork's process state"))?;
    Ok(out)
}

/// Persists every template of `st` with CRIU into the sandbox's directory
/// and records the images. The templates stay parked, the program runs on.
/// Returns the bytes written.
pub fn persist(
    name: &str,
    criu: &Criu,
    cg: &Cgroup,
    dirs: &SandboxDirs,
    st: &mut ProcessState,
) -> Result<u64, ProcessError> {
    let dir = create_criu_dir(name, dirs)?;
    let mut bytes = 0;
    for c in &mut st.processes {
        let dest = dir.join(format!("{}-{}", st.snapshot, c.ns_pid));
        let img = crate::criu::dump(
            criu,
            st.init_pid,
            &cg.procs_files(),
            c.template.pid,
            (c.ns_pid, &c.cmdline),
            &dest,
        )?;
        bytes += img.bytes;
        c.image = Some(img);
    }
    save(dirs, st).map_err(ProcessError::io(name, "record CRIU images"))?;
    Ok(bytes)
}

/// How many templates may be kept, and how much private memory they may
/// hold, across all sandboxes of a repository.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolLimits {
    pub max_templates: usize,
    pub max_bytes: u64,
}

impl Default for PoolLimits {
    fn default() -> Self {
        PoolLimits {
            max_templates: 64,
            max_bytes: 8 << 30,
        }
    }
}

/// A snapshot's process state that was let go.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Evicted {
    pub sandbox: String,
    pub snapshot: String,
    pub bytes: u64,
    /// Its processes stay restorable from CRIU images.
    pub persisted: bool,
}

/// Keeps the repository's templates within `limits`, letting go of the least
/// recently used snapshots' first (the record's modification time is its
/// last use). The records stay: they say that the process state was let go,
/// and keep the CRIU images of persisted ones. The snapshots stay restorable
/// from their files (and their processes from the images).
pub fn enforce(repo: &Path, limits: PoolLimits) -> Vec<Evicted> {
    let mut all = Vec::new();
    for (sandbox, path, st) in repo_states(repo) {
        if !st.alive() {
            continue;
        }
        let used = std::fs::metadata(&path)
            .and_then(|m| m.modified())
            .unwrap_or(std::time::UNIX_EPOCH);
        all.push((used, sandbox, path, st));
    }
    // Newest first: they are kept while they fit.
    all.sort_by_key(|b| std::cmp::Reverse(b.0));
    let (mut count, mut bytes) = (0usize, 0u64);
    let mut evicted = Vec::new();
    for (i, (_, sandbox, path, mut st)) in all.into_iter().enumerate() {
        // The most recent one is kept even alone over the limits: it was just
        // made (and holds next to nothing of its own yet: not measured).
        let b = if i == 0 { 0 } else { measured(&path, &mut st) };
        let fits = count + st.processes.len() <= limits.max_templates
            && bytes.saturating_add(b) <= limits.max_bytes;
        if fits || i == 0 {
            count += st.processes.len();
            bytes = bytes.saturating_add(b);
            continue;
        }
        st.discard();
        evicted.push(Evicted {
            sandbox,
            persisted: st.persisted(),
            snapshot: st.snapshot,
            bytes: b,
        });
    }
    evicted
}

/// How long the pool trusts a measurement of a record's private bytes.
const MEASURE_EVERY_NS: u64 = 10_000_000_000;

/// The record's private bytes: measured again when the last figure is older
/// than [`MEASURE_EVERY_NS`] (and written back, keeping the record's time,
/// which is its last use).
fn measured(path: &Path, st: &mut ProcessState) -> u64 {
    let now = now_ns();
    if now.saturating_sub(st.measured_ns) < MEASURE_EVERY_NS {
        return st.measured_bytes;
    }
    st.measured_bytes = st.private_bytes();
    st.measured_ns = now;
    let used = std::fs::metadata(path).and_then(|m| m.modified());
    if let Ok(data) = serde_json::to_vec_pretty(st)
        && tine_store::write_atomic(path, &data).is_ok()
        && let Ok(t) = used
    {
        set_used(path, t);
    }
    st.measured_bytes
}

/// What one snapshot's process state holds, across sandboxes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Held {
    /// Live templates, and their private bytes.
    pub live: usize,
    pub live_bytes: u64,
    /// Processes persisted with CRIU, and the size of their images.
    pub persisted: usize,
    pub persisted_bytes: u64,
}

/// The process state the repository holds, per snapshot (hex): live
/// templates and CRIU images. `live_bytes` is measured only `with_bytes`
/// (reading `smaps_rollup` walks every page of every template).
pub fn held(repo: &Path, with_bytes: bool) -> std::collections::HashMap<String, Held> {
    let mut out = std::collections::HashMap::<String, Held>::new();
    for (_, _, st) in repo_states(repo) {
        let alive = st.alive();
        if !alive && !st.persisted() {
            continue;
        }
        let slot = out.entry(st.snapshot.clone()).or_default();
        if alive {
            slot.live += st.processes.len();
            if with_bytes {
                slot.live_bytes += st.private_bytes();
            }
        }
        for img in st.processes.iter().filter_map(|c| c.image.as_ref()) {
            slot.persisted += 1;
            slot.persisted_bytes += img.bytes;
        }
    }
    out
}

/// Every templates record of every sandbox of the repository at `repo`:
/// (sandbox id, record path, record).
fn repo_states(repo: &Path) -> Vec<(String, PathBuf, ProcessState)> {
    let Ok(rd) = std::fs::read_dir(repo.join("sandboxes")) else {
        return Vec::new();
    };
    rd.flatten()
        .flat_map(|e| {
            let sandbox = e.file_name().to_string_lossy().into_owned();
            all_states(&SandboxDirs { root: e.path() })
                .into_iter()
                .map(move |(path, st)| (sandbox.clone(), path, st))
        })
        .collect()
}

/// What [`prune`] removed (or would remove).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Pruned {
    /// Process-state records of snapshots that are gone.
    pub records: usize,
    /// CRIU image directories no record names any more, and their bytes.
    pub image_dirs: usize,
    pub image_bytes: u64,
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum()
}

/// Drops the process state of snapshots that no longer exist (`exists` says
/// which do, by hex id): their templates are killed, their records and CRIU
/// images removed; and image directories no record names (a dump cut short).
/// With `dry_run`, only counts.
pub fn prune(repo: &Path, exists: impl Fn(&str) -> bool, dry_run: bool) -> Pruned {
    let mut out = Pruned::default();
    let Ok(rd) = std::fs::read_dir(repo.join("sandboxes")) else {
        return out;
    };
    for e in rd.flatten() {
        let dirs = SandboxDirs { root: e.path() };
        let mut named = std::collections::HashSet::new();
        for (path, st) in all_states(&dirs) {
            if exists(&st.snapshot) {
                named.extend(
                    st.processes
                        .iter()
                        .filter_map(|c| Some(c.image.as_ref()?.dir.clone())),
                );
                continue;
            }
            out.records += 1;
            if !dry_run {
                st.discard();
                let _ = std::fs::remove_file(&path);
            }
        }
        let images = criu_dir(&dirs);
        for img in std::fs::read_dir(&images).into_iter().flatten().flatten() {
            let name = img.file_name().to_string_lossy().into_owned();
            if named.contains(&name) {
                continue;
            }
            out.image_dirs += 1;
            out.image_bytes += dir_bytes(&img.path());
            if !dry_run {
                let _ = std::fs::remove_dir_all(img.path());
            }
        }
    }
    out
}
