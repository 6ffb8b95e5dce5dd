//! CRIU, the second process backend: the command lines that persist a parked
//! template into an images directory and bring it back, and the descriptors
//! CRIU cannot reach on its own.
//!
//! CRIU runs inside the sandbox's namespaces (the caller arranges that), so
//! it sees the template as an ordinary process of its own PID and mount
//! namespaces and dumps no namespace. What the template holds from outside
//! them (its stdout log, `/dev/null` opened by the supervisor, a pipe whose
//! other end is elsewhere) is "external": named at dump time, and handed to
//! CRIU as an open descriptor at restore time.
//!
//! A template is dumped, not the live process: it is already stopped and
//! never changes, so the dump takes none of the program's time, and a
//! template brought back by CRIU is a template again (parked, at its old
//! PID), from which the rollback makes the process as from any other.

use std::collections::{HashMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::fdtable::{FdTarget, fd_table};
use crate::inspect::{NotCloneable, ProcError, read_proc};

/// One descriptor CRIU cannot reopen by itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct External {
    pub fd: i32,
    /// CRIU's name for it: `file[MNT:INO]` (hex) or `pipe:[INO]`.
    pub key: String,
    /// What is opened in its place on restore, as the host names it: the
    /// same file, or `/dev/null` for a pipe whose other end is gone by then.
    pub path: PathBuf,
    /// `open(2)` flags to open `path` with (access mode and `O_APPEND`).
    pub flags: u32,
}

/// The mount ids of the mount namespace `pid` lives in.
fn mount_ids(pid: u32) -> Result<HashSet<u64>, ProcError> {
    let path = PathBuf::from(format!("/proc/{pid}/mountinfo"));
    let text = read_proc(pid, &path)?;
    Ok(text
        .lines()
        .filter_map(|l| l.split_whitespace().next()?.parse().ok())
        .collect())
}

/// The descriptors of `pid` that CRIU cannot reach from `pid`'s namespaces:
/// files on mounts outside its mount namespace, and pipes only one of whose
/// ends it holds. Sockets are left to CRIU (which names what it cannot do);
/// terminals, deleted files from outside and pipes opened read-write cannot
/// be persisted. `name` is the PID messages name the process by (its
/// origin's, in the sandbox).
pub fn externals(pid: u32, name: u32, cmdline: &str) -> Result<Vec<External>, ProcError> {
    let mounts = mount_ids(pid)?;
    let fds = fd_table(pid)?;
    let mut pipe_ends: HashMap<u64, usize> = HashMap::new();
    for e in &fds {
        if let FdTarget::Pipe { inode } = e.target {
            *pipe_ends.entry(inode).or_default() += 1;
        }
    }
    let refuse = |reason: String| {
        ProcError::NotPersistable(NotCloneable {
            pid,
            ns_pid: Some(name),
            cmdline: cmdline.to_string(),
            reason,
        })
    };
    let mut out = Vec::new();
    for e in &fds {
        let foreign = e.mnt_id.is_some_and(|m| !mounts.contains(&m));
        match &e.target {
            FdTarget::Path { path } if foreign => {
                let link = format!("/proc/{pid}/fd/{}", e.fd);
                let ino = std::fs::metadata(&link)
                    .map_err(|source| ProcError::read(pid, Path::new(&link), source))?
                    .ino();
                out.push(External {
                    fd: e.fd,
                    key: format!("file[{:x}:{:x}]", e.mnt_id.unwrap_or(0), ino),
                    path: path.clone(),
                    flags: e.flags,
                });
            }
            FdTarget::Deleted { path } if foreign => {
                return Err(refuse(format!(
                    "descriptor {} is a deleted file outside the sandbox ({}), which CRIU cannot persist",
                    e.fd,
                    path.display()
                )));
            }
            // Opened read-write (through /proc/PID/fd): one descriptor is both
            // ends, which CRIU brings back as one end only (reads then see
            // the end of the pipe at once).
            FdTarget::Pipe { .. } if e.flags & 0o3 == nix::libc::O_RDWR as u32 => {
                return Err(refuse(format!(
                    "descriptor {} is a pipe opened for reading and writing, which CRIU does not bring back faithfully",
                    e.fd
                )));
            }
            FdTarget::Pipe { inode } if pipe_ends[inode] == 1 => out.push(External {
                fd: e.fd,
                key: format!("pipe:[{inode}]"),
                path: PathBuf::from("/dev/null"),
                flags: e.flags,
            }),
            FdTarget::Path { path } if e.target.is_terminal() => {
                return Err(refuse(format!(
                    "descriptor {} is a terminal ({}), which CRIU cannot persist here",
                    e.fd,
                    path.display()
                )));
            }
            _ => {}
        }
    }
    Ok(out)
}

/// Options every CRIU call shares. Cgroups are the caller's business (CRIU
/// runs inside the sandbox's cgroup, and the restored process lands there).
fn common(images: &str, log: &str) -> Vec<String> {
    ["-D", images, "-o", log, "-v2", "--manage-cgroups=ignore"]
        .iter()
        .map(|s| s.to_string())
        .collect()
}

/// `criu dump` of the template whose PID (in the namespace CRIU runs in) is
/// `ns_pid`, leaving it parked.
pub fn dump_args(ns_pid: u32, images: &str, externals: &[External]) -> Vec<String> {
    let mut a = vec![
        "dump".to_string(),
        "-t".into(),
        ns_pid.to_string(),
        "--leave-running".into(),
    ];
    a.extend(common(images, "dump.log"));
    for e in externals.iter().filter(|e| e.key.starts_with("file[")) {
        a.push("--external".into());
        a.push(e.key.clone());
    }
    a
}

/// `criu restore` of a dumped template, detached (it is parked again, a child
/// of the sandbox's init). `inherited` pairs each external's key with the
/// descriptor number CRIU gets it under.
pub fn restore_args(images: &str, inherited: &[(i32, &str)]) -> Vec<String> {
    let mut a = vec!["restore".to_string(), "--restore-detached".into()];
    a.extend(common(images, "restore.log"));
    for (fd, key) in inherited {
        a.push("--inherit-fd".into());
        a.push(format!("fd[{fd}]:{key}"));
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dump_names_only_files_as_external() {
        let ext = [
            External {
                fd: 1,
                key: "file[1b:a4c701]".into(),
                path: "/repo/out.log".into(),
                flags: 0o102001,
            },
            External {
                fd: 9,
                key: "pipe:[77]".into(),
                path: "/dev/null".into(),
                flags: 1,
            },
        ];
        let a = dump_args(29, "/proc/self/fd/3", &ext);
        assert_eq!(&a[..4], ["dump", "-t", "29", "--leave-running"]);
        assert!(a.windows(2).any(|w| w == ["--external", "file[1b:a4c701]"]));
        assert!(!a.iter().any(|s| s.contains("pipe")));
        assert!(a.windows(2).any(|w| w == ["-D", "/proc/self/fd/3"]));
    }

    #[test]
    fn restore_hands_every_external_over() {
        let a = restore_args("/proc/self/fd/3", &[(5, "file[18:3]"), (6, "pipe:[77]")]);
        assert!(
            a.windows(2)
                .any(|w| w == ["--inherit-fd", "fd[5]:file[18:3]"])
        );
        assert!(
            a.windows(2)
                .any(|w| w == ["--inherit-fd", "fd[6]:pipe:[77]"])
        );
        assert!(a.contains(&"--restore-detached".to_string()));
    }
}
