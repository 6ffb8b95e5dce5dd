//! What a copy made from a template gets fixed before it runs: its
//! descriptors (offsets set back, workspace files and FIFOs opened again),
//! its shared file mappings made again from its own files, and its POSIX
//! locks taken again.

use std::path::PathBuf;

use nix::libc;

use crate::fdtable::{FdEntry, FdTarget};
use crate::inspect::ProcError;
use crate::ptrace::Tracee;
use crate::template::scratch_path;

/// How to fix one descriptor of a process made from a template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FdFix {
    /// Set the shared offset back.
    Seek { fd: i32, pos: u64 },
    /// Open `path` (as the new process sees it) again in its place, with the
    /// same flags, at `pos`.
    Reopen {
        fd: i32,
        path: PathBuf,
        flags: u32,
        pos: u64,
    },
    /// Open the FIFO at `path` (made in the copy's own workspace) in its
    /// place, read-write (see `apply_fix`), with `flags`' status flags.
    ReopenFifo { fd: i32, path: PathBuf, flags: u32 },
}

impl FdFix {
    /// The descriptor it fixes.
    pub fn fd(&self) -> i32 {
        match self {
            FdFix::Seek { fd, .. } | FdFix::Reopen { fd, .. } | FdFix::ReopenFifo { fd, .. } => *fd,
        }
    }
}

/// A `MAP_SHARED` mapping of a file, to be made again from `path` as the
/// copy sees it, at the same place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapFix {
    pub start: u64,
    pub end: u64,
    /// `PROT_*` bits.
    pub prot: u64,
    pub offset: u64,
    pub path: PathBuf,
}

/// The shared mappings of process `pid` (from `/proc/PID/maps`): each with
/// whether it is writable, and its path (`None`: anonymous or deleted).
pub fn shared_maps(pid: u32) -> Result<Vec<(MapFix, bool)>, ProcError> {
    let text = crate::inspect::maps_text(pid)?;
    let mut out = Vec::new();
    for line in text.lines() {
        // start-end perms offset dev inode [path]
        let mut f = line.splitn(6, char::is_whitespace);
        let (Some(range), Some(perms), Some(offset)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        let p = perms.as_bytes();
        if p.len() != 4 || p[3] != b's' {
            continue;
        }
        let (Some((a, b)), Ok(offset)) = (range.split_once('-'), u64::from_str_radix(offset, 16))
        else {
            continue;
        };
        let (Ok(start), Ok(end)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) else {
            continue;
        };
        let file = f.nth(2).unwrap_or_default().trim_start();
        let bit = |on: bool, prot: i32| if on { prot as u64 } else { 0 };
        let prot = bit(p[0] == b'r', libc::PROT_READ)
            | bit(p[1] == b'w', libc::PROT_WRITE)
            | bit(p[2] == b'x', libc::PROT_EXEC);
        out.push((
            MapFix {
                start,
                end,
                prot,
                offset,
                path: PathBuf::from(file),
            },
            p[1] == b'w',
        ));
    }
    Ok(out)
}

/// A descriptor open on a terminal (for taking it back as the controlling one).
pub(crate) fn tty_fd(fds: &[FdEntry]) -> Option<i32> {
    fds.iter().find(|e| e.target.is_terminal()).map(|e| e.fd)
}

/// `F_OFD_SETLK`: a record lock owned by the open file description.
const F_OFD_SETLK: u64 = 37;

/// Whether lock `l` belongs to an open file description (`flock`, OFD)
/// rather than to the process (POSIX).
pub(crate) fn held_by_description(l: &crate::fdtable::FileLock) -> bool {
    l.kind == "flock" || l.kind == "ofd"
}

/// Gives descriptor `e.fd` of `t` an open file description of its own, on
/// the same file (through `/proc/self/fd`, so a rename or an unlink since
/// does not matter), at its recorded offset: the locks of a description are
/// held as long as any process holds it, so a template or a copy sharing
/// its origin's would keep the origin's `flock` and OFD locks held.
pub(crate) fn own_description(t: &mut Tracee, e: &FdEntry) -> Result<(), ProcError> {
    let path = PathBuf::from(format!("/proc/self/fd/{}", e.fd));
    apply_fix(
        t,
        &FdFix::Reopen {
            fd: e.fd,
            path,
            flags: e.flags,
            pos: e.pos,
        },
    )
}

/// Takes lock `l` again through descriptor `e.fd` of `t` (without waiting:
/// at a rollback or a fork nobody else should hold it): a POSIX or OFD
/// record lock over the same bytes, or a `flock`.
pub(crate) fn lock_again(
    t: &mut Tracee,
    e: &FdEntry,
    l: &crate::fdtable::FileLock,
) -> Result<(), ProcError> {
    let r = if l.kind == "flock" {
        let how = if l.write {
            libc::LOCK_EX
        } else {
            libc::LOCK_SH
        } | libc::LOCK_NB;
        t.syscall_raw(libc::SYS_flock, [e.fd as u64, how as u64, 0, 0, 0, 0])?
    } else {
        // struct flock: l_type, l_whence (i16 each), pad, l_start, l_len (i64), l_pid (i32), pad.
        let mut f = Vec::with_capacity(32);
        let kind = if l.write {
            libc::F_WRLCK
        } else {
            libc::F_RDLCK
        } as i16;
        f.extend_from_slice(&kind.to_le_bytes());
        f.extend_from_slice(&(libc::SEEK_SET as i16).to_le_bytes());
        f.extend_from_slice(&[0u8; 4]);
        f.extend_from_slice(&(l.start as i64).to_le_bytes());
        let len = l.end.map_or(0, |end| end + 1 - l.start) as i64;
        f.extend_from_slice(&len.to_le_bytes());
        f.extend_from_slice(&[0u8; 8]);
        let at = t.scratch(0, &f)?;
        let cmd = if l.kind == "ofd" {
            F_OFD_SETLK
        } else {
            libc::F_SETLK as u64
        };
        t.syscall_raw(libc::SYS_fcntl, [e.fd as u64, cmd, at, 0, 0, 0])?
    };
    if r < 0 {
        return Err(ProcError::Injected {
            pid: t.pid(),
            call: "take a file lock back",
            source: std::io::Error::other(format!(
                "its {} {} lock on descriptor {} ({:?}): {}",
                l.kind,
                if l.write { "write" } else { "read" },
                e.fd,
                e.target,
                std::io::Error::from_raw_os_error(-r as i32)
            )),
        });
    }
    Ok(())
}

/// Maps `m.path` (as `t` sees it) over the mapping it replaces, shared.
pub(crate) fn map_again(t: &mut Tracee, m: &MapFix) -> Result<(), ProcError> {
    let at = scratch_path(t, 0, &m.path)?;
    let flags = if m.prot & libc::PROT_WRITE as u64 != 0 {
        libc::O_RDWR
    } else {
        libc::O_RDONLY
    };
    let fd = t.syscall(
        "openat(shared mapping)",
        libc::SYS_openat,
        [
            libc::AT_FDCWD as u64,
            at,
            (flags | libc::O_CLOEXEC) as u64,
            0,
            0,
            0,
        ],
    )?;
    let mapped = t.syscall_raw(
        libc::SYS_mmap,
        [
            m.start,
            m.end - m.start,
            m.prot,
            (libc::MAP_SHARED | libc::MAP_FIXED) as u64,
            fd,
            m.offset,
        ],
    );
    t.syscall("close", libc::SYS_close, [fd, 0, 0, 0, 0, 0])?;
    crate::ptrace::check(t.pid(), "mmap(shared mapping)", mapped?)?;
    Ok(())
}

/// Of a process rolled back in place (`pid`), whether `fix` (a
/// [`FdFix::Reopen`]) has nothing to open: its descriptor is open on the
/// regular file its path names now (the restore left that file in place,
/// writing into it) with the flags it had then, and holds no lock (`e`,
/// its entry at the checkpoint). Then only its offset may differ: `Some`
/// with the offset to set back, if it does. Each reopen is four calls
/// injected one after another (PostgreSQL's log and tables: 0.16 ms a
/// process inside the pause); this reads three files.
pub(crate) fn open_as_before(pid: u32, fix: &FdFix, e: Option<&FdEntry>) -> Option<Option<u64>> {
    use std::os::unix::fs::MetadataExt;
    let FdFix::Reopen {
        fd,
        path,
        flags,
        pos,
    } = fix
    else {
        return None;
    };
    if e.is_none_or(|e| !e.locks.is_empty()) {
        return None;
    }
    let open = std::fs::metadata(format!("/proc/{pid}/fd/{fd}")).ok()?;
    // The path as the process sees it, its last component not followed
    // (a link put there since is not the file).
    let named = std::fs::symlink_metadata(
        std::path::Path::new(&format!("/proc/{pid}/root")).join(path.strip_prefix("/").ok()?),
    )
    .ok()?;
    if !open.is_file() || (open.dev(), open.ino()) != (named.dev(), named.ino()) {
        return None;
    }
    let info = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}")).ok()?;
    let (now, now_flags, _) = crate::fdtable::parse_fdinfo(&info)?;
    (now_flags == *flags).then_some((now != *pos).then_some(*pos))
}

/// Sets descriptor `fd`'s offset to `pos` among the calls made before `t`
/// runs ([`Tracee::call_later`]).
pub(crate) fn seek_later(t: &mut Tracee, fd: i32, pos: u64) {
    t.call_later().call_vals(
        "lseek",
        libc::SYS_lseek,
        [fd as u64, pos, libc::SEEK_SET as u64, 0, 0, 0],
    );
}

pub(crate) fn apply_fix(t: &mut Tracee, fix: &FdFix) -> Result<(), ProcError> {
    match fix {
        FdFix::Seek { fd, pos } => {
            lseek(t, *fd, *pos)?;
        }
        FdFix::Reopen {
            fd,
            path,
            flags,
            pos,
        } => {
            let at = scratch_path(t, 0, path)?;
            let open_flags = (*flags as i32) & !(libc::O_CREAT | libc::O_EXCL | libc::O_TRUNC);
            let new = t.syscall(
                "openat",
                libc::SYS_openat,
                [libc::AT_FDCWD as u64, at, open_flags as u64, 0, 0, 0],
            )?;
            move_to(t, new, *fd, *flags)?;
            lseek(t, *fd, *pos)?;
        }
        FdFix::ReopenFifo { fd, path, flags } => {
            // Read-write and non-blocking: the open waits for no peer, and a
            // reader does not see an end of file while its writer is gone.
            let at = scratch_path(t, 0, path)?;
            let open = (libc::O_RDWR | libc::O_NONBLOCK | libc::O_CLOEXEC) as u64;
            let new = t.syscall(
                "openat(FIFO)",
                libc::SYS_openat,
                [libc::AT_FDCWD as u64, at, open, 0, 0, 0],
            )?;
            move_to(t, new, *fd, *flags)?;
            // Its status flags back (O_NONBLOCK as it had them).
            set_status(t, *fd, *flags, libc::O_NONBLOCK | libc::O_APPEND)?;
        }
    }
    Ok(())
}

/// Puts descriptor `new` of `t` at number `fd` (close-on-exec as `flags`
/// says) and closes `new`.
fn move_to(t: &mut Tracee, new: u64, fd: i32, flags: u32) -> Result<(), ProcError> {
    if new != fd as u64 {
        dup_onto(t, new, fd, flags)?;
        t.syscall("close", libc::SYS_close, [new, 0, 0, 0, 0, 0])?;
    }
    Ok(())
}

/// Makes number `fd` of `t` a copy of descriptor `new`, close-on-exec as
/// `flags` says.
pub(crate) fn dup_onto(t: &mut Tracee, new: u64, fd: i32, flags: u32) -> Result<(), ProcError> {
    let cloexec = (flags as i32) & libc::O_CLOEXEC;
    t.syscall(
        "dup3",
        libc::SYS_dup3,
        [new, fd as u64, cloexec as u64, 0, 0, 0],
    )?;
    Ok(())
}

/// Sets the status flags of `fd`'s description to those of `flags` in `mask`.
pub(crate) fn set_status(t: &mut Tracee, fd: i32, flags: u32, mask: i32) -> Result<(), ProcError> {
    let status = (flags as i32) & mask;
    t.syscall(
        "fcntl(F_SETFL)",
        libc::SYS_fcntl,
        [fd as u64, libc::F_SETFL as u64, status as u64, 0, 0, 0],
    )?;
    Ok(())
}

/// Sets a descriptor's offset; one that has none (a FIFO opened by path) is left alone.
fn lseek(t: &mut Tracee, fd: i32, pos: u64) -> Result<(), ProcError> {
    let r = t.syscall_raw(
        libc::SYS_lseek,
        [fd as u64, pos, libc::SEEK_SET as u64, 0, 0, 0],
    )?;
    if r != -(libc::ESPIPE as i64) {
        crate::ptrace::check(t.pid(), "lseek", r)?;
    }
    Ok(())
}

/// The fixes a rollback needs. With `reopen_below` (a sandbox's workspace),
/// the files under it are opened again at their offsets (a restore may have
/// replaced them) and every other descriptor is left alone: what lies
/// outside the workspace (a log, a terminal) is not rolled back. Without it,
/// every regular file's shared offset is set back.
pub fn fixes_for(fds: &[FdEntry], reopen_below: Option<&std::path::Path>) -> Vec<FdFix> {
    fds.iter()
        .filter_map(|e| match (&e.target, reopen_below) {
            (FdTarget::Path { path }, Some(root)) if path.starts_with(root) => {
                Some(FdFix::Reopen {
                    fd: e.fd,
                    path: path.clone(),
                    flags: e.flags,
                    pos: e.pos,
                })
            }
            (FdTarget::Path { path }, None) if !path.starts_with("/dev/") => Some(FdFix::Seek {
                fd: e.fd,
                pos: e.pos,
            }),
            _ => None,
        })
        .collect()
}
