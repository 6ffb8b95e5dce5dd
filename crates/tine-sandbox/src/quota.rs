//! The disk limit of a sandbox's upper layer: a project quota, where the
//! repository's filesystem keeps them (XFS mounted with `prjquota`; ext4
//! with the `project` feature, mounted with `prjquota`).
//!
//! The upper and work directories get a project ID of their own, inherited
//! by everything made below them (`FS_XFLAG_PROJINHERIT`), and that project
//! a hard limit on blocks and inodes. Writes past it fail with `EDQUOT` in
//! the sandbox; the sandbox itself stays up. Elsewhere the layer is not
//! limited, and [`status`] says why.
#![allow(unsafe_code)]

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;

use serde::Serialize;

/// `PRJQUOTA` (linux/quota.h).
const PRJQUOTA: libc::c_int = 2;
/// `_IOR('X', 31, struct fsxattr)`.
const FS_IOC_FSGETXATTR: libc::c_ulong = 0x801c_581f;
/// `_IOW('X', 32, struct fsxattr)`.
const FS_IOC_FSSETXATTR: libc::c_ulong = 0x401c_5820;
const FS_XFLAG_PROJINHERIT: u32 = 0x200;
/// `QIF_BLIMITS | QIF_ILIMITS`.
const QIF_LIMITS: u32 = 1 | 2;
/// Quota block size (`QIF_DQBLKSIZE`).
const QUOTA_BLOCK: u64 = 1024;
/// Project IDs tine picks from: above those administrators number by hand.
const FIRST_PROJECT: u32 = 1 << 20;
const PROJECTS: u32 = (1 << 31) - FIRST_PROJECT;

/// `struct fsxattr` (linux/fs.h).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct FsXattr {
    xflags: u32,
    extsize: u32,
    nextents: u32,
    projid: u32,
    cowextsize: u32,
    pad: [u8; 8],
}

fn get_xattr(f: &File) -> io::Result<FsXattr> {
    let mut x = FsXattr::default();
    // SAFETY: FS_IOC_FSGETXATTR writes one `struct fsxattr` (28 bytes, the
    // layout of `FsXattr`) through the pointer, which is valid for it.
    let r = unsafe { libc::ioctl(f.as_raw_fd(), FS_IOC_FSGETXATTR, &mut x as *mut FsXattr) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(x)
}

fn set_xattr(f: &File, x: &FsXattr) -> io::Result<()> {
    // SAFETY: FS_IOC_FSSETXATTR reads one `struct fsxattr` from the pointer,
    // valid for the call.
    let r = unsafe { libc::ioctl(f.as_raw_fd(), FS_IOC_FSSETXATTR, x as *const FsXattr) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `quotactl_fd(fd, QCMD(cmd, PRJQUOTA), id, q)`.
fn quotactl(f: &File, cmd: libc::c_int, id: u32, q: &mut libc::dqblk) -> io::Result<()> {
    // SAFETY: quotactl_fd takes a descriptor, a command, an ID and, for
    // Q_GETQUOTA/Q_SETQUOTA, a `struct if_dqblk` (libc's `dqblk`) that it
    // reads or writes; `q` is valid for both.
    let r = unsafe {
        libc::syscall(
            libc::SYS_quotactl_fd,
            f.as_raw_fd(),
            libc::QCMD(cmd, PRJQUOTA),
            id,
            q as *mut libc::dqblk,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn open_dir(dir: &Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(dir)
}

fn get_quota(f: &File, id: u32) -> io::Result<libc::dqblk> {
    // SAFETY: `dqblk` is plain integers; all zeroes is a valid value.
    let mut q: libc::dqblk = unsafe { std::mem::zeroed() };
    quotactl(f, libc::Q_GETQUOTA, id, &mut q)?;
    Ok(q)
}

/// Why project quotas cannot limit what is below the directory `f`, or
/// `None` when they can.
fn unavailable(f: &File) -> Option<String> {
    match get_quota(f, 0) {
        Ok(_) => None,
        // On, with no usage recorded for project 0 (XFS says so).
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => None,
        Err(e) => Some(match e.raw_os_error() {
            Some(libc::ESRCH) => {
                "project quotas are not on for the repository's filesystem (they need \
                 XFS mounted with prjquota, or ext4 with the project feature mounted with \
                 prjquota, on a kernel built with quota support)"
                    .into()
            }
            Some(libc::ENOSYS) | Some(libc::EINVAL) | Some(libc::ENOTTY) => {
                "the repository's filesystem has no project quotas".into()
            }
            _ => format!("project quotas: {e}"),
        }),
    }
}

/// A project ID no other directory of the filesystem uses, picked from
/// `seed` (different for each sandbox) onwards.
fn free_project(f: &File, seed: u64) -> io::Result<u32> {
    for i in 0..256u64 {
        let id = FIRST_PROJECT + ((seed.wrapping_add(i)) % u64::from(PROJECTS)) as u32;
        let q = match get_quota(f, id) {
            Ok(q) => q,
            // Never used (XFS keeps no record of it).
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(id),
            Err(e) => return Err(e),
        };
        if q.dqb_curspace == 0
            && q.dqb_curinodes == 0
            && q.dqb_bhardlimit == 0
            && q.dqb_ihardlimit == 0
        {
            return Ok(id);
        }
    }
    Err(io::Error::other("no free project ID found"))
}

/// The inodes a limit of `bytes` allows: one per 4 KiB, at least 65,536
/// (without a limit on inodes, empty files would fill the filesystem).
fn inode_limit(bytes: u64) -> u64 {
    (bytes / 4096).max(65_536)
}

/// Limits what `dirs` (on one filesystem: the first is the upper layer)
/// and everything made below them may hold to `bytes`. The first keeps the
/// project it has; when it has none, a `fresh` (empty) one gets a new
/// project (picked from `seed`), and one that is not stays unlimited
/// (`None`: what it holds would not be counted), and so does every one on
/// a filesystem without project quotas ([`status`] says why). Returns the
/// project ID.
pub fn limit(dirs: &[&Path], bytes: u64, seed: u64, fresh: bool) -> io::Result<Option<u32>> {
    let files = dirs
        .iter()
        .map(|d| open_dir(d))
        .collect::<io::Result<Vec<_>>>()?;
    let first = files
        .first()
        .ok_or_else(|| io::Error::other("no directory"))?;
    if unavailable(first).is_some() {
        return Ok(None);
    }
    let x = get_xattr(first)?;
    let id = if x.projid >= FIRST_PROJECT {
        x.projid
    } else if fresh {
        free_project(first, seed)?
    } else {
        return Ok(None);
    };
    // SAFETY: `dqblk` is plain integers; all zeroes is a valid value.
    let mut q: libc::dqblk = unsafe { std::mem::zeroed() };
    q.dqb_bhardlimit = bytes.div_ceil(QUOTA_BLOCK);
    q.dqb_bsoftlimit = q.dqb_bhardlimit;
    q.dqb_ihardlimit = inode_limit(bytes);
    q.dqb_isoftlimit = q.dqb_ihardlimit;
    q.dqb_valid = QIF_LIMITS;
    // The limit first: the directories count against it from the start.
    quotactl(first, libc::Q_SETQUOTA, id, &mut q)?;
    for f in &files {
        let mut x = get_xattr(f)?;
        x.projid = id;
        x.xflags |= FS_XFLAG_PROJINHERIT;
        set_xattr(f, &x)?;
    }
    Ok(Some(id))
}

/// Lifts the limit of `upper`'s project (its sandbox being removed), so
/// that the ID is free again once its files are gone.
pub fn release(upper: &Path) {
    let Ok(f) = open_dir(upper) else { return };
    let id = match get_xattr(&f) {
        Ok(x) if x.projid >= FIRST_PROJECT => x.projid,
        _ => return,
    };
    // SAFETY: `dqblk` is plain integers; all zeroes is a valid value.
    let mut q: libc::dqblk = unsafe { std::mem::zeroed() };
    q.dqb_valid = QIF_LIMITS;
    let _ = quotactl(&f, libc::Q_SETQUOTA, id, &mut q);
}

/// A sandbox's disk limit as it stands.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct DiskStatus {
    /// The limit in force, in bytes (`None`: not limited).
    pub limit_bytes: Option<u64>,
    /// What its upper layer holds now, in bytes (when limited).
    pub used_bytes: Option<u64>,
    /// Why it is not limited.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unlimited_because: Option<String>,
}

/// The disk limit of the upper layer `upper`: in force when its directory
/// carries a project of tine's with a limit.
pub fn status(upper: &Path) -> DiskStatus {
    let not = |why: String| DiskStatus {
        limit_bytes: None,
        used_bytes: None,
        unlimited_because: Some(why),
    };
    let f = match open_dir(upper) {
        Ok(f) => f,
        Err(e) => return not(format!("{}: {e}", upper.display())),
    };
    if let Some(why) = unavailable(&f) {
        return not(why);
    }
    let found = get_xattr(&f).and_then(|x| {
        if x.projid < FIRST_PROJECT {
            return Ok(None);
        }
        Ok(Some(get_quota(&f, x.projid)?))
    });
    match found {
        Ok(Some(q)) if q.dqb_bhardlimit > 0 => DiskStatus {
            limit_bytes: Some(q.dqb_bhardlimit * QUOTA_BLOCK),
            used_bytes: Some(q.dqb_curspace),
            unlimited_because: None,
        },
        Ok(_) => not("its upper layer was made before it had a disk limit".into()),
        Err(e) => not(format!("project quotas: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fsxattr_has_the_kernels_layout() {
        assert_eq!(std::mem::size_of::<FsXattr>(), 28);
        // _IOR/_IOW('X', 31/32, 28 bytes).
        let ioc = |dir: libc::c_ulong, nr: libc::c_ulong| {
            (dir << 30) | (28 << 16) | ((b'X' as libc::c_ulong) << 8) | nr
        };
        assert_eq!(FS_IOC_FSGETXATTR, ioc(2, 31));
        assert_eq!(FS_IOC_FSSETXATTR, ioc(1, 32));
    }

    #[test]
    fn inode_limits_grow_with_the_byte_limit_from_a_floor() {
        assert_eq!(inode_limit(1 << 20), 65_536);
        assert_eq!(inode_limit(10 << 30), (10 << 30) / 4096);
    }
}
