//! Whether a process can be cloned faithfully by an injected fork, and the
//! `/proc` reading that everything in this crate shares.

use std::io;
use std::path::{Path, PathBuf};

/// Why a process cannot become a template, with what names it for the user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotCloneable {
    pub pid: u32,
    /// Its command line, arguments joined by spaces.
    pub cmdline: String,
    pub reason: String,
}

#[derive(Debug, thiserror::Error)]
pub enum ProcError {
    #[error("process {pid}: read {}: {source}", path.display())]
    Read {
        pid: u32,
        path: PathBuf,
        source: io::Error,
    },
    #[error("process {pid} is gone")]
    Gone { pid: u32 },
    #[error("process {pid}: {} is not in the format the kernel documents", path.display())]
    Malformed { pid: u32, path: PathBuf },
    #[error(
        "process {} ({}) cannot be checkpointed by native fork: {}; take the snapshot with --files-only",
        .0.pid, .0.cmdline, .0.reason
    )]
    NotCloneable(NotCloneable),
}

impl ProcError {
    pub(crate) fn read(pid: u32, path: &Path, source: io::Error) -> ProcError {
        if source.kind() == io::ErrorKind::NotFound || source.raw_os_error() == Some(3) {
            ProcError::Gone { pid }
        } else {
            ProcError::Read {
                pid,
                path: path.to_path_buf(),
                source,
            }
        }
    }
}

/// Reads a small `/proc` file of process `pid`; a vanished process is [`ProcError::Gone`].
pub(crate) fn read_proc(pid: u32, path: &Path) -> Result<String, ProcError> {
    std::fs::read_to_string(path).map_err(|source| ProcError::read(pid, path, source))
}

/// The command line of `pid` (NUL-separated in `/proc`), for messages.
pub fn cmdline_at(proc_root: &Path, pid: u32) -> String {
    let raw = std::fs::read(proc_root.join(pid.to_string()).join("cmdline")).unwrap_or_default();
    let parts: Vec<String> = raw
        .split(|b| *b == 0)
        .filter(|p| !p.is_empty())
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .collect();
    if parts.is_empty() {
        format!("pid {pid}")
    } else {
        parts.join(" ")
    }
}

/// The threads of `pid`.
fn threads(proc_root: &Path, pid: u32) -> Result<Vec<u32>, ProcError> {
    let dir = proc_root.join(pid.to_string()).join("task");
    let mut out: Vec<u32> = std::fs::read_dir(&dir)
        .map_err(|source| ProcError::read(pid, &dir, source))?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    out.sort_unstable();
    Ok(out)
}

/// The live children of `pid`, from each thread's `children` file.
fn children(proc_root: &Path, pid: u32, tids: &[u32]) -> Result<Vec<u32>, ProcError> {
    let mut out = Vec::new();
    for tid in tids {
        let path = proc_root
            .join(pid.to_string())
            .join("task")
            .join(tid.to_string())
            .join("children");
        match read_proc(pid, &path) {
            Ok(t) => out.extend(t.split_whitespace().filter_map(|c| c.parse::<u32>().ok())),
            // A thread that ended meanwhile has no children left to report.
            Err(ProcError::Gone { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    out.sort_unstable();
    Ok(out)
}

/// Checks that `pid` can be cloned faithfully by an injected fork: a fork copies
/// only the calling thread, and leaves the children with their old parent.
pub fn cloneable(pid: u32) -> Result<(), ProcError> {
    cloneable_at(Path::new("/proc"), pid)
}

/// [`cloneable`] under another procfs mount.
pub fn cloneable_at(proc_root: &Path, pid: u32) -> Result<(), ProcError> {
    let tids = threads(proc_root, pid)?;
    let reason = if tids.len() > 1 {
        Some(format!(
            "it has {} threads, and a fork copies only one",
            tids.len()
        ))
    } else {
        let kids = children(proc_root, pid, &tids)?;
        (!kids.is_empty()).then(|| {
            let shown: Vec<String> = kids.iter().take(5).map(|k| k.to_string()).collect();
            format!(
                "it has {} live child process{} (PID {}), which a fork would not bring along",
                kids.len(),
                if kids.len() == 1 { "" } else { "es" },
                shown.join(", ")
            )
        })
    };
    match reason {
        None => Ok(()),
        Some(reason) => Err(ProcError::NotCloneable(NotCloneable {
            pid,
            cmdline: cmdline_at(proc_root, pid),
            reason,
        })),
    }
}
