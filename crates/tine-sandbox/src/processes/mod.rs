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
//!
//! This file: the records of templates and their errors; `capture` takes
//! checkpoints, `prepare` readies their templates after them, `rollback`
//! brings processes back, `pool` bounds the templates.

mod capture;
mod pool;
pub mod prepare;
mod rollback;
mod spares;
mod tracking;
pub use capture::*;
pub use pool::*;
pub use rollback::*;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tine_proc::ProcError;
use tine_proc::ptrace::Tracee;
use tine_proc::template::{Hop, Respawn, Template, Unsettled, fixes_for, fork_template_via};
use tine_store::{ObjectId, now_ns};

use crate::cgroup::Cgroup;
use crate::criu::Criu;
use crate::supervisor::SandboxDirs;

/// Format version of a templates file.
const VERSION: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error(transparent)]
    Proc(#[from] ProcError),
    #[error(
        "process {pid} ({cmdline}) cannot be checkpointed by native fork: its parent is neither the sandbox's init nor another of its processes (it was started with `tine exec`?); wait for it to end, or take the snapshot with --files-only"
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
    /// Its parent's PID inside the sandbox when that is another captured
    /// process (not init): it is brought back as that process's child.
    /// Parents are listed before their children.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<u32>,
    /// For the command of a `tine exec` session: its client, outside the
    /// sandbox's PID namespace (host PID and start time). It comes back in
    /// place only, under the same client.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub anchor: Option<(u32, u64)>,
    /// It led a session of its own (`setsid`), as every child of init does.
    #[serde(default = "yes")]
    pub leads_session: bool,
    /// Its process group inside the sandbox (0: not recorded).
    #[serde(default)]
    pub pgid: u32,
    /// When it leads a session with a controlling terminal (a `tine exec
    /// -it` shell): the terminal's foreground process group inside the
    /// sandbox (a job the shell runs), given back at a rollback.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub foreground: Option<u32>,
    /// Its children that had ended, not reaped, at the checkpoint: (PID
    /// inside the sandbox, wait status); made again as zombies.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub zombies: Vec<(u32, i32)>,
    /// The template persisted with CRIU (`--persist`), which outlives it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<crate::criu::Image>,
}

fn yes() -> bool {
    true
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
    /// When the pool let its templates go (they were killed to stay within
    /// its limits), if it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evicted_ns: Option<u64>,
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
        let alive = |c: &Captured| same_run && tine_proc::template::template_alive(&c.template);
        // A tree comes back only from its templates (each child grafted
        // onto its parent's copy), not from CRIU images.
        if self.is_tree() {
            return self.processes.iter().all(alive);
        }
        self.processes
            .iter()
            .all(|c| alive(c) || (with_criu && c.image.is_some()))
    }

    /// Why its processes cannot come back from their templates (when
    /// [`ProcessState::restorable`] says so), for the user.
    pub fn why_let_go(&self) -> String {
        if !self.init_alive() {
            return "the sandbox restarted since the snapshot, and its templates ended with that run".into();
        }
        if self.evicted_ns.is_some() {
            return "the template pool let them go to stay within its limits (raise --max-templates or --max-template-memory to keep more)".into();
        }
        let killed: Vec<String> = self
            .processes
            .iter()
            .filter(|c| !tine_proc::template::template_alive(&c.template))
            .map(|c| {
                // A command line on one short line (a script given with
                // `-c` can be long).
                let words = c.cmdline.split_whitespace().collect::<Vec<_>>().join(" ");
                let shown = match words.char_indices().nth(40) {
                    Some((at, _)) => format!("{}…", &words[..at]),
                    None => words,
                };
                format!(
                    "the template of PID {} ({shown}) was killed [host PID {}]",
                    c.ns_pid, c.template.pid
                )
            })
            .collect();
        killed.join("; ")
    }

    /// Whether some process is another's child (a tree, not only children
    /// of init).
    pub fn is_tree(&self) -> bool {
        self.processes.iter().any(|c| c.parent.is_some())
    }

    /// Whether its processes must come back together: one is another's
    /// child, or two shared memory (which their copies share again).
    pub fn together(&self) -> bool {
        let mut seen = std::collections::HashSet::new();
        self.is_tree()
            || self
                .processes
                .iter()
                .flat_map(|c| c.template.shm.iter().map(|o| (o.dev.clone(), o.inode)))
                .filter(|k| k.1 != 0)
                .any(|k| !seen.insert(k))
    }

    /// The pipes and sockets between its processes, made once for all of
    /// them ([`tine_proc::treeobjects`]): for copies in namespaces of their
    /// own (`fork`: nothing may stay shared with the origin), or a rollback.
    /// Pipes and sockets of `except` (inodes) are left to the caller.
    pub fn tree_objects(
        &self,
        fork: bool,
        except: &std::collections::BTreeSet<u64>,
    ) -> Result<
        (
            Vec<tine_proc::treeobjects::Shared>,
            std::collections::BTreeSet<u64>,
        ),
        String,
    > {
        // Copied only where something is left out (not on a rollback's path).
        let kept: Vec<std::borrow::Cow<'_, [tine_proc::FdEntry]>> = self
            .processes
            .iter()
            .map(|c| {
                if except.is_empty() {
                    return std::borrow::Cow::Borrowed(c.template.fds.as_slice());
                }
                c.template
                    .fds
                    .iter()
                    .filter(|e| match &e.target {
                        tine_proc::FdTarget::Pipe { inode }
                        | tine_proc::FdTarget::Socket { inode } => !except.contains(inode),
                        _ => true,
                    })
                    .cloned()
                    .collect()
            })
            .collect();
        let of: Vec<_> = self
            .processes
            .iter()
            .zip(&kept)
            .map(|(c, fds)| tine_proc::treeobjects::Of {
                pid: c.template.pid,
                fds,
                queued: &c.template.queued,
            })
            .collect();
        if fork {
            tine_proc::treeobjects::plan_fork(&of)
        } else {
            Ok(tine_proc::treeobjects::plan(&of))
        }
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

/// Host PIDs of every live template of the sandbox, and of its spares
/// (records also name templates that are gone, whose PIDs may have been
/// reused).
pub(crate) fn template_pids(dirs: &SandboxDirs) -> Vec<u32> {
    let mut pids = recorded_template_pids(dirs);
    pids.extend(spares::pids(dirs));
    pids
}

/// Host PIDs of the live templates the snapshots' records name.
fn recorded_template_pids(dirs: &SandboxDirs) -> Vec<u32> {
    all_states(dirs)
        .iter()
        .flat_map(|(_, s)| s.processes.iter().map(|c| &c.template))
        .filter(|t| tine_proc::template::template_alive(t))
        .map(|t| t.pid)
        .collect()
}
