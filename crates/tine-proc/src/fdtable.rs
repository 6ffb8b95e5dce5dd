//! A process's descriptor table, read from `/proc/PID/fd` and `/proc/PID/fdinfo`:
//! what a rollback must reset (offsets) or reopen (workspace files).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::inspect::{ProcError, read_proc};

/// What a descriptor refers to, from its `/proc/PID/fd/N` link.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum FdTarget {
    /// A file or directory at this path (as the process's mount namespace names it).
    Path {
        path: PathBuf,
    },
    /// An open file whose path was unlinked.
    Deleted {
        path: PathBuf,
    },
    Pipe {
        inode: u64,
    },
    Socket {
        inode: u64,
    },
    /// `anon_inode:[eventfd]`, `anon_inode:inotify` and the like.
    AnonInode {
        name: String,
    },
    /// Anything else the kernel reports (kept verbatim).
    Other {
        link: String,
    },
}

impl FdTarget {
    /// A terminal: a pseudo-terminal's side or a `/dev/tty*` device.
    pub fn is_terminal(&self) -> bool {
        matches!(self, FdTarget::Path { path }
            if path.starts_with("/dev/pts") || path.starts_with("/dev/tty"))
    }
}

/// One open descriptor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FdEntry {
    pub fd: i32,
    pub target: FdTarget,
    /// The open file description's offset (`pos:`).
    pub pos: u64,
    /// `open(2)` flags, as `fdinfo` gives them (`flags:`, octal there).
    pub flags: u32,
    /// The mount the file lives on (`mnt_id:`), to tell workspace files apart.
    pub mnt_id: Option<u64>,
    /// File locks the process holds through it (`lock:` lines of `fdinfo`),
    /// which a copy must take again: a fork does not inherit POSIX locks,
    /// and a reopened file has none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub locks: Vec<FileLock>,
    /// The kernel object behind it, where a copy can make it anew (an
    /// eventfd, an epoll instance, a listening TCP socket).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub object: Option<crate::objects::Object>,
}

/// One file lock.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileLock {
    /// `posix` (`fcntl` `F_SETLK`, owned by the process), `ofd` (`F_OFD_SETLK`,
    /// owned by the open file description) or `flock`.
    pub kind: String,
    pub write: bool,
    pub start: u64,
    /// Its last byte; `None`: to the end of the file (`EOF`).
    pub end: Option<u64>,
}

/// The locks of `fdinfo` text: lines like
/// `lock:\t1: POSIX  ADVISORY  WRITE 1234 00:2f:5678 0 EOF`.
pub fn parse_locks(info: &str) -> Vec<FileLock> {
    info.lines()
        .filter_map(|l| l.strip_prefix("lock:"))
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // id: KIND ADVISORY|MANDATORY READ|WRITE pid dev:ino start end
            let [_, kind, _, rw, _, _, start, end] = f.as_slice() else {
                return None;
            };
            let kind = match *kind {
                "POSIX" => "posix",
                "OFDLCK" => "ofd",
                "FLOCK" => "flock",
                // Leases and the like are not taken again.
                _ => return None,
            };
            Some(FileLock {
                kind: kind.into(),
                write: *rw == "WRITE",
                start: start.parse().ok()?,
                end: if *end == "EOF" {
                    None
                } else {
                    Some(end.parse().ok()?)
                },
            })
        })
        .collect()
}

/// Classifies the target of a `/proc/PID/fd/N` link.
pub fn classify(link: &str) -> FdTarget {
    let bracketed = |prefix: &str| {
        link.strip_prefix(prefix)
            .and_then(|r| r.strip_prefix('['))
            .and_then(|r| r.strip_suffix(']'))
            .and_then(|n| n.parse::<u64>().ok())
    };
    if let Some(inode) = bracketed("pipe:") {
        FdTarget::Pipe { inode }
    } else if let Some(inode) = bracketed("socket:") {
        FdTarget::Socket { inode }
    } else if let Some(name) = link.strip_prefix("anon_inode:") {
        FdTarget::AnonInode {
            name: name.to_string(),
        }
    } else if link.starts_with('/') {
        match link.strip_suffix(" (deleted)") {
            Some(p) => FdTarget::Deleted { path: p.into() },
            None => FdTarget::Path { path: link.into() },
        }
    } else {
        FdTarget::Other {
            link: link.to_string(),
        }
    }
}

/// The `pos`, `flags` and `mnt_id` fields of a `/proc/PID/fdinfo/N` text.
pub fn parse_fdinfo(text: &str) -> Option<(u64, u32, Option<u64>)> {
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name).map(|v| v.trim().to_string()))
    };
    let pos = field("pos:")?.parse().ok()?;
    let flags = u32::from_str_radix(&field("flags:")?, 8).ok()?;
    let mnt_id = field("mnt_id:").and_then(|v| v.parse().ok());
    Some((pos, flags, mnt_id))
}

/// A process's `/proc/PID/fdinfo/N` files, opened ahead of a pause: a read
/// says what descriptor N is at the time of the read (the kernel looks the
/// number up then; one closed since fails), and opening costs more than
/// reading (node's 20-odd descriptors: 0.1-0.5 ms inside a pause, most of
/// it opening). For a rollback's descriptor-table check (`graft`), a
/// spare's, and the table a checkpoint reads ([`fd_table_with`]).
#[derive(Debug, Default)]
pub struct FdInfos(Vec<(i32, std::fs::File)>);

impl FdInfos {
    /// Those of descriptors `fds` of process `pid` (one that cannot be
    /// opened is left out: read afresh when asked).
    pub fn open(pid: u32, fds: impl Iterator<Item = i32>) -> FdInfos {
        FdInfos(
            fds.filter_map(|fd| {
                std::fs::File::open(format!("/proc/{pid}/fdinfo/{fd}"))
                    .ok()
                    .map(|f| (fd, f))
            })
            .collect(),
        )
    }

    /// Those of every descriptor process `pid` has now.
    pub fn open_all(pid: u32) -> FdInfos {
        let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok());
        FdInfos::open(pid, fds)
    }

    /// Descriptor `fd`'s `fdinfo` text as it is now, through the file
    /// opened ahead (`None`: none, or it no longer reads).
    pub(crate) fn read_opened(&self, fd: i32) -> Option<String> {
        let (_, f) = self.0.iter().find(|(n, _)| *n == fd)?;
        crate::inspect::read_from_start(f)
    }

    /// [`FdInfos::read_opened`], else read afresh.
    pub(crate) fn read(&self, pid: u32, fd: i32) -> Option<String> {
        self.read_opened(fd)
            .or_else(|| std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}")).ok())
    }
}

/// The descriptor table of process `pid`, sorted by descriptor. Descriptors
/// closed while it is read are left out (stop the process first for a
/// consistent table).
pub fn fd_table(pid: u32) -> Result<Vec<FdEntry>, ProcError> {
    fd_table_at(Path::new("/proc"), pid)
}

/// [`fd_table`] through `infos`, its `fdinfo` files opened before it
/// stopped, where they read (the others are read afresh).
pub fn fd_table_with(pid: u32, infos: &FdInfos) -> Result<Vec<FdEntry>, ProcError> {
    table(Path::new("/proc"), pid, infos)
}

/// [`fd_table`] under another procfs mount (a sandbox's, or a test's).
pub fn fd_table_at(proc_root: &Path, pid: u32) -> Result<Vec<FdEntry>, ProcError> {
    table(proc_root, pid, &FdInfos::default())
}

fn table(proc_root: &Path, pid: u32, infos: &FdInfos) -> Result<Vec<FdEntry>, ProcError> {
    let dir = proc_root.join(pid.to_string()).join("fd");
    let list = std::fs::read_dir(&dir).map_err(|source| ProcError::read(pid, &dir, source))?;
    let mut out = Vec::new();
    // Opened once, when the first socket is met.
    let mut pidfd = None;
    for e in list {
        let e = e.map_err(|source| ProcError::read(pid, &dir, source))?;
        let Some(fd) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(link) = std::fs::read_link(e.path()) else {
            continue; // closed meanwhile
        };
        let info_path = proc_root
            .join(pid.to_string())
            .join("fdinfo")
            .join(fd.to_string());
        let info = match infos
            .read_opened(fd)
            .map_or_else(|| read_proc(pid, &info_path), Ok)
        {
            Ok(t) => t,
            Err(ProcError::Gone { .. }) => continue,
            Err(e) => return Err(e),
        };
        let (pos, flags, mnt_id) = parse_fdinfo(&info).ok_or_else(|| ProcError::Malformed {
            pid,
            path: info_path.clone(),
        })?;
        let target = classify(&link.to_string_lossy());
        let object = match &target {
            FdTarget::AnonInode { name } => crate::objects::parse_anon(name, &info),
            FdTarget::Socket { inode } => pidfd
                .get_or_insert_with(|| {
                    rustix::process::Pid::from_raw(pid as i32).and_then(|p| {
                        rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()).ok()
                    })
                })
                .as_ref()
                .and_then(|pf| crate::objects::socket_object(pf, fd, *inode)),
            _ => None,
        };
        out.push(FdEntry {
            fd,
            target,
            pos,
            flags,
            mnt_id,
            locks: parse_locks(&info),
            object,
        });
    }
    out.sort_by_key(|e| e.fd);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_read_through_fdinfo_opened_ahead_is_the_table_read_afresh() {
        use std::os::fd::AsRawFd;
        let me = std::process::id();
        let before = std::fs::File::open("/dev/null").expect("/dev/null");
        let infos = FdInfos::open_all(me);
        // Opened after: read afresh. Changed after: read as it is now.
        let after = std::fs::File::open("/proc/self/status").expect("status");
        let mine = [before.as_raw_fd(), after.as_raw_fd()];
        let pick = |t: Vec<FdEntry>| -> Vec<FdEntry> {
            t.into_iter().filter(|e| mine.contains(&e.fd)).collect()
        };
        let through = pick(fd_table_with(me, &infos).expect("through"));
        let afresh = pick(fd_table(me).expect("afresh"));
        assert_eq!(through.len(), 2);
        assert_eq!(through, afresh);
    }

    #[test]
    fn fdinfo_opened_ahead_reads_the_descriptor_as_it_is_at_the_read() {
        use std::os::fd::AsFd;
        let f = std::fs::File::open("/dev/null").expect("/dev/null");
        let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
        let me = std::process::id();
        let infos = FdInfos::open(me, [fd].into_iter());
        let cloexec = |infos: &FdInfos| {
            let text = infos.read(me, fd).expect("fdinfo");
            let flags = text
                .lines()
                .find_map(|l| l.strip_prefix("flags:"))
                .expect("flags");
            u32::from_str_radix(flags.trim(), 8).expect("octal") & nix::libc::O_CLOEXEC as u32 != 0
        };
        assert!(cloexec(&infos));
        // Changed after the file was opened: the next read says so.
        rustix::io::fcntl_setfd(f.as_fd(), rustix::io::FdFlags::empty()).expect("setfd");
        assert!(!cloexec(&infos));
        rustix::io::fcntl_setfd(f.as_fd(), rustix::io::FdFlags::CLOEXEC).expect("setfd");
        assert!(cloexec(&infos));
    }

    #[test]
    fn links_are_classified() {
        assert_eq!(classify("pipe:[1234]"), FdTarget::Pipe { inode: 1234 });
        assert_eq!(classify("socket:[77]"), FdTarget::Socket { inode: 77 });
        assert_eq!(
            classify("anon_inode:[eventfd]"),
            FdTarget::AnonInode {
                name: "[eventfd]".into()
            }
        );
        assert_eq!(
            classify("/workspace/log.txt"),
            FdTarget::Path {
                path: "/workspace/log.txt".into()
            }
        );
        assert_eq!(
            classify("/tmp/x (deleted)"),
            FdTarget::Deleted {
                path: "/tmp/x".into()
            }
        );
        assert_eq!(
            classify("pipe:[oops]"),
            FdTarget::Other {
                link: "pipe:[oops]".into()
            }
        );
    }

    #[test]
    fn locks_are_parsed_from_fdinfo() {
        let t = "pos:\t0\nflags:\t02\nlock:\t1: POSIX  ADVISORY  WRITE 1234 00:2f:5678 0 EOF\nlock:\t2: OFDLCK ADVISORY  READ  -1 00:2f:5678 100 199\nlock:\t3: FLOCK  ADVISORY  WRITE 1234 00:2f:5678 0 EOF\nlock:\t4: LEASE  ACTIVE    READ 1 00:2f:5678 0 EOF\n";
        let l = parse_locks(t);
        assert_eq!(l.len(), 3);
        assert_eq!(
            (l[0].kind.as_str(), l[0].write, l[0].start, l[0].end),
            ("posix", true, 0, None)
        );
        assert_eq!(
            (l[1].kind.as_str(), l[1].write, l[1].start, l[1].end),
            ("ofd", false, 100, Some(199))
        );
        assert_eq!(l[2].kind, "flock");
    }

    #[test]
    fn fdinfo_fields_are_parsed_and_flags_are_octal() {
        let t = "pos:\t4096\nflags:\t02100002\nmnt_id:\t31\nino:\t5\n";
        assert_eq!(parse_fdinfo(t), Some((4096, 0o2100002, Some(31))));
        assert_eq!(parse_fdinfo("pos:\t1\nflags:\t0\n"), Some((1, 0, None)));
        assert_eq!(parse_fdinfo("flags:\t0\n"), None, "pos is required");
        assert_eq!(parse_fdinfo("pos:\tx\nflags:\t0\n"), None);
        assert_eq!(parse_fdinfo("pos:\t1\nflags:\t9\n"), None, "not octal");
    }
}
