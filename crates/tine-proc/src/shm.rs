//! Shared memory a copy must not share with its origin: anonymous shared
//! mappings, memfds and `/dev/shm` files. A fork shares their pages, so the
//! template would see the origin keep writing them. At the checkpoint the
//! template copies each such object into a memfd of its own and maps that
//! in its place; every copy made from it does the same from the template's
//! memfd. Mappings of one object stay one object (a ring buffer mapped
//! twice still aliases). The cost is a copy of the shared bytes, not of the
//! process's memory.

use std::collections::BTreeMap;
use std::path::PathBuf;

use nix::libc;
use serde::{Deserialize, Serialize};

use crate::inspect::ProcError;
use crate::ptrace::Tracee;

/// One mapping of a shared object: where, with what protection, at what
/// offset of the object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShmMap {
    pub start: u64,
    pub end: u64,
    /// `PROT_*` bits.
    pub prot: u64,
    pub offset: u64,
}

/// One shared memory object and its mappings in the process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShmObject {
    /// As `/proc/PID/maps` names it (for messages).
    pub name: String,
    pub maps: Vec<ShmMap>,
    /// The process's descriptors on it (a memfd it keeps open, as Python's
    /// `mmap` does), with whether each is close-on-exec: they are pointed at
    /// the copy too.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fds: Vec<(i32, bool)>,
    /// The object in the origin (device and inode, as maps gives them):
    /// processes of one tree that mapped the same object share one copy.
    #[serde(default)]
    pub dev: String,
    #[serde(default)]
    pub inode: u64,
}

impl ShmObject {
    /// The bytes the object needs to hold every mapping.
    fn size(&self) -> u64 {
        self.maps
            .iter()
            .map(|m| m.offset + (m.end - m.start))
            .max()
            .unwrap_or(0)
    }
}

/// Whether a shared mapping of `path` (as `/proc/PID/maps` shows it) is
/// memory a copy would share with its origin.
pub fn is_shared_memory(path: &str) -> bool {
    path == "/dev/zero (deleted)"
        || (path.starts_with("/memfd:") && path.ends_with(" (deleted)"))
        // System V shared memory (`shmat`; PostgreSQL keeps a small segment):
        // its copies are memfds, which a later `shmdt` does not detach.
        || (path.starts_with("/SYSV") && path.ends_with(" (deleted)"))
        || path.starts_with("/dev/shm/")
}

/// The shared memory objects process `pid` maps, grouped by object (device
/// and inode), its memory map being `maps` (its `/proc/PID/maps` text).
pub fn objects(pid: u32, maps: &str) -> Result<Vec<ShmObject>, ProcError> {
    use std::os::unix::fs::MetadataExt;
    let mut by_object = parse(maps);
    if by_object.is_empty() {
        return Ok(vec![]);
    }
    // Descriptors on the same objects (device and inode, as maps gives them).
    let dir = PathBuf::from(format!("/proc/{pid}/fd"));
    let entries = std::fs::read_dir(&dir).map_err(|e| ProcError::read(pid, &dir, e))?;
    for e in entries.flatten() {
        let (Some(fd), Ok(link)) = (
            e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()),
            std::fs::read_link(e.path()),
        ) else {
            continue;
        };
        if !is_shared_memory(&link.to_string_lossy()) {
            continue;
        }
        let Ok(meta) = std::fs::metadata(e.path()) else {
            continue;
        };
        let dev = format!(
            "{:02x}:{:02x}",
            libc::major(meta.dev()),
            libc::minor(meta.dev())
        );
        if let Some(o) = by_object.get_mut(&(dev, meta.ino())) {
            let info =
                std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}")).unwrap_or_default();
            let cloexec = info
                .lines()
                .find_map(|l| l.strip_prefix("flags:"))
                .and_then(|f| u32::from_str_radix(f.trim(), 8).ok())
                .is_some_and(|f| f & libc::O_CLOEXEC as u32 != 0);
            o.fds.push((fd, cloexec));
        }
    }
    Ok(by_object.into_values().collect())
}

/// Shared memory mappings of `maps` text, by object (device and inode).
fn parse(maps: &str) -> BTreeMap<(String, u64), ShmObject> {
    let mut by_object: BTreeMap<(String, u64), ShmObject> = BTreeMap::new();
    for line in maps.lines() {
        // start-end perms offset dev inode [path]
        let f: Vec<&str> = line.splitn(6, char::is_whitespace).collect();
        let [range, perms, offset, dev, inode, rest] = f.as_slice() else {
            continue;
        };
        let p = perms.as_bytes();
        let name = rest.trim_start();
        if p.len() != 4 || p[3] != b's' || !is_shared_memory(name) {
            continue;
        }
        let (Some((a, b)), Ok(offset), Ok(inode)) = (
            range.split_once('-'),
            u64::from_str_radix(offset, 16),
            inode.parse::<u64>(),
        ) else {
            continue;
        };
        let (Ok(start), Ok(end)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) else {
            continue;
        };
        let bit = |on: bool, prot: i32| if on { prot as u64 } else { 0 };
        let prot = bit(p[0] == b'r', libc::PROT_READ)
            | bit(p[1] == b'w', libc::PROT_WRITE)
            | bit(p[2] == b'x', libc::PROT_EXEC);
        by_object
            .entry((dev.to_string(), inode))
            .or_insert_with(|| ShmObject {
                name: name.to_string(),
                maps: vec![],
                fds: vec![],
                dev: dev.to_string(),
                inode,
            })
            .maps
            .push(ShmMap {
                start,
                end,
                prot,
                offset,
            });
    }
    by_object
}

/// The memfd name a captured object gets (`/memfd:tine-shm (deleted)` in
/// the maps of the template and its copies).
const MEMFD_NAME: &[u8] = b"tine-shm\0";

/// Whether a mapping path is one of tine's captured objects.
pub fn is_captured(path: &str) -> bool {
    path == "/memfd:tine-shm (deleted)"
}

/// Copies `objects` (mapped in stopped process `t`) into memfds of its own
/// and maps those in their place: afterwards `t` shares none of it.
///
/// `named`: `t` is a copy (not a template), whose `/dev/shm` files are
/// files of its own `/dev/shm` again, by the same name (the sandbox's at a
/// rollback, put back to the checkpoint; a fork's own): a process that
/// opens one by name later (`shm_open`, as a database's new backend does)
/// must find what the others map. A template keeps memfds: the origin's
/// files are in use.
pub fn make_private(t: &mut Tracee, objects: &[ShmObject], named: bool) -> Result<(), ProcError> {
    for o in objects {
        let fd = if named && o.name.starts_with("/dev/shm/") && !o.name.ends_with(" (deleted)") {
            let at = crate::template::scratch_path(t, 0, std::path::Path::new(&o.name))?;
            // Emptied first: the file there may hold data where the
            // checkpoint's had holes, which the copy below does not write.
            t.syscall(
                "openat(shared memory)",
                libc::SYS_openat,
                [
                    libc::AT_FDCWD as u64,
                    at,
                    (libc::O_RDWR
                        | libc::O_CREAT
                        | libc::O_TRUNC
                        | libc::O_CLOEXEC
                        | libc::O_NOFOLLOW) as u64,
                    0o600,
                    0,
                    0,
                ],
            )?
        } else {
            let at = t.scratch(0, MEMFD_NAME)?;
            t.syscall(
                "memfd_create(shared memory)",
                libc::SYS_memfd_create,
                [at, libc::MFD_CLOEXEC as u64, 0, 0, 0, 0],
            )?
        };
        let done = copy_into(t, fd, o);
        t.syscall("close", libc::SYS_close, [fd, 0, 0, 0, 0, 0])?;
        done?;
    }
    Ok(())
}

/// Where the copy of each shared object of a process tree lives, by the
/// object's identity in the origin (device, inode): a process that maps
/// the copy and one of its mappings there (opened through `map_files`),
/// and whether that is the object itself, kept in place (`shmback`); with
/// the templates' copies mapped ahead for a rollback to compare with.
#[derive(Debug, Default)]
pub struct TreeShm {
    objects: BTreeMap<(String, u64), TreeObject>,
    pub(crate) views: crate::shmback::Views,
}

/// Where a tree's object is: mapped by process `pid` from `start` to `end`;
/// `kept`: the object itself, left in place by a rollback.
#[derive(Debug, Clone, Copy)]
struct TreeObject {
    pid: u32,
    start: u64,
    end: u64,
    kept: bool,
}

impl TreeShm {
    /// A tree's, rolled back with the templates' copies in `views`.
    pub fn with_views(views: crate::shmback::Views) -> TreeShm {
        TreeShm {
            objects: BTreeMap::new(),
            views,
        }
    }

    /// Whether the tree has a copy of `o` already.
    pub fn has(&self, o: &ShmObject) -> bool {
        o.inode != 0 && self.objects.contains_key(&(o.dev.clone(), o.inode))
    }

    /// Whether the tree kept `o` in place (`Some(true)`), made a copy of
    /// its own (`Some(false)`), or has neither yet.
    pub(crate) fn kept_where(&self, o: &ShmObject) -> Option<bool> {
        self.objects.get(&(o.dev.clone(), o.inode)).map(|e| e.kept)
    }

    /// Notes that process `pid` keeps `o` in place, as mapped there.
    pub(crate) fn note_kept(&mut self, o: &ShmObject, pid: u32) {
        if let Some(m) = o.maps.first() {
            let (start, end) = (m.start, m.end);
            self.objects.insert(
                (o.dev.clone(), o.inode),
                TreeObject {
                    pid,
                    start,
                    end,
                    kept: true,
                },
            );
        }
    }
}

/// [`make_private`] for a process of a tree: an object another process of
/// the tree copied already (or kept in place in a rollback: `shmback`) is
/// mapped from there (one object stays one object across the tree, and
/// shared with nothing outside it); the others are copied and noted in
/// `tree`. `above`: a descriptor number above every one `t` uses (for the
/// one handed over meanwhile).
pub fn make_private_in<'o>(
    t: &mut Tracee,
    objects: impl IntoIterator<Item = &'o ShmObject>,
    tree: &mut TreeShm,
    above: i32,
    named: bool,
) -> Result<(), ProcError> {
    // Those the tree has a copy of are handed over through one channel (a
    // pool's six semaphores: six channels cost a worker ~0.9 ms).
    let mut from_tree = Vec::new();
    for o in objects {
        let key = (o.dev.clone(), o.inode);
        match tree.objects.get(&key) {
            Some(&TreeObject {
                pid, start, end, ..
            }) if o.inode != 0 => {
                let path = crate::inspect::map_file(pid, start, end);
                let file = std::fs::File::options()
                    .read(true)
                    .write(true)
                    .open(&path)
                    .map_err(|e| ProcError::read(pid, &path, e))?;
                from_tree.push((o, file));
            }
            _ => {
                make_private(t, std::slice::from_ref(o), named)?;
                if let Some(m) = o.maps.first() {
                    let at = TreeObject {
                        pid: t.pid(),
                        start: m.start,
                        end: m.end,
                        kept: false,
                    };
                    tree.objects.insert(key, at);
                }
            }
        }
    }
    if from_tree.is_empty() {
        return Ok(());
    }
    let ch = crate::fdpass::Channel::open(t, above)?;
    let files: Vec<_> = from_tree
        .iter()
        .map(|(_, f)| std::os::fd::AsFd::as_fd(f))
        .collect();
    let got = ch.pass(t, &files);
    let mapped = got.and_then(|got| {
        for (&(o, _), fd) in from_tree.iter().zip(&got) {
            map_over(t, *fd as u64, o)?;
        }
        Ok(got)
    });
    ch.close(t)?;
    for fd in mapped? {
        t.syscall("close", libc::SYS_close, [fd as u64, 0, 0, 0, 0, 0])?;
    }
    Ok(())
}

/// Sizes memfd `fd` of `t` for `o`, writes each mapping's bytes at its
/// offset and maps the memfd over it.
fn copy_into(t: &mut Tracee, fd: u64, o: &ShmObject) -> Result<(), ProcError> {
    t.syscall(
        "ftruncate(shared memory)",
        libc::SYS_ftruncate,
        [fd, o.size(), 0, 0, 0, 0],
    )?;
    for m in &o.maps {
        let len = m.end - m.start;
        let readable = m.prot & libc::PROT_READ as u64 != 0;
        if !readable {
            t.syscall(
                "mprotect(shared memory)",
                libc::SYS_mprotect,
                [m.start, len, m.prot | libc::PROT_READ as u64, 0, 0, 0],
            )?;
        }
        // Only what the object holds: a hole reads as zeros in the new one
        // too, and reading it through the mapping would fill it (a server's
        // shared buffers are mostly never touched).
        for (from, to) in data_runs(t.pid(), m) {
            let mut done = from;
            while done < to {
                let n = t.syscall(
                    "pwrite64(shared memory)",
                    libc::SYS_pwrite64,
                    [fd, m.start + done, to - done, m.offset + done, 0, 0],
                )?;
                if n == 0 {
                    return Err(ProcError::Injected {
                        pid: t.pid(),
                        call: "pwrite64(shared memory)",
                        source: std::io::Error::other(format!("{} wrote nothing", o.name)),
                    });
                }
                done += n;
            }
        }
    }
    map_over(t, fd, o)
}

/// The runs of mapping `m` of process `pid` (offsets into the mapping,
/// page-aligned) where its object holds data (`SEEK_DATA`/`SEEK_HOLE` on
/// the object, opened through `map_files`); the whole mapping when the
/// object cannot be asked.
fn data_runs(pid: u32, m: &ShmMap) -> Vec<(u64, u64)> {
    match std::fs::File::open(crate::inspect::map_file(pid, m.start, m.end)) {
        Ok(f) => data_runs_of(&f, m),
        Err(_) => vec![(0, m.end - m.start)],
    }
}

/// [`data_runs`] of mapping `m`'s object, opened as `f`.
pub(crate) fn data_runs_of(f: &std::fs::File, m: &ShmMap) -> Vec<(u64, u64)> {
    data_runs_strict(f, m).unwrap_or_else(|| vec![(0, m.end - m.start)])
}

/// [`data_runs_of`], or none where the file cannot tell its holes.
pub(crate) fn data_runs_strict(f: &std::fs::File, m: &ShmMap) -> Option<Vec<(u64, u64)>> {
    use std::os::fd::AsFd;
    let len = m.end - m.start;
    let (lo, hi) = (m.offset, m.offset + len);
    let mut runs = Vec::new();
    let mut at = lo;
    while at < hi {
        let data = match rustix::fs::seek(f.as_fd(), rustix::fs::SeekFrom::Data(at)) {
            Ok(d) => d,
            // No data from here on (ENXIO).
            Err(rustix::io::Errno::NXIO) => break,
            Err(_) => return None,
        };
        if data >= hi {
            break;
        }
        let hole =
            rustix::fs::seek(f.as_fd(), rustix::fs::SeekFrom::Hole(data)).map_or(hi, |h| h.min(hi));
        let (a, b) = (data & !4095, hole.div_ceil(4096) * 4096);
        runs.push((a.max(lo) - lo, b.min(hi) - lo));
        at = hole.max(data + 1);
    }
    Some(runs)
}

/// Maps memfd `fd` of `t` over each mapping of `o` and puts it at `o`'s
/// descriptors.
fn map_over(t: &mut Tracee, fd: u64, o: &ShmObject) -> Result<(), ProcError> {
    for m in &o.maps {
        t.syscall(
            "mmap(shared memory)",
            libc::SYS_mmap,
            [
                m.start,
                m.end - m.start,
                m.prot,
                (libc::MAP_SHARED | libc::MAP_FIXED) as u64,
                fd,
                m.offset,
            ],
        )?;
    }
    for &(at, cloexec) in &o.fds {
        let flags = if cloexec { libc::O_CLOEXEC as u64 } else { 0 };
        t.syscall(
            "dup3(shared memory)",
            libc::SYS_dup3,
            [fd, at as u64, flags, 0, 0, 0],
        )?;
    }
    Ok(())
}

/// Whether descriptor `fd` is on shared memory that `objects` captured.
pub fn captures_fd(objects: &[ShmObject], fd: i32) -> bool {
    objects.iter().any(|o| o.fds.iter().any(|&(f, _)| f == fd))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_memory_is_grouped_by_object_and_files_are_left_out() {
        let maps = "\
7ffb1b5bc000-7ffb1b5be000 rw-s 00000000 00:1b 2                          /dev/shm/psm_88fd6d39
7ffb1b5dd000-7ffb1b5df000 rw-s 00000000 00:01 1142                       /memfd:ring (deleted)
7ffb1b5df000-7ffb1b5e1000 rw-s 00000000 00:01 1142                       /memfd:ring (deleted)
7ffb1b791000-7ffb1b793000 r--s 00001000 00:01 1141                       /dev/zero (deleted)
7ffb1b793000-7ffb1b79a000 r--s 00000000 fe:00 325745                     /usr/lib/x86_64-linux-gnu/gconv/gconv-modules.cache
7ffb1b79a000-7ffb1b79b000 rw-p 00000000 00:01 1141                       /dev/zero (deleted)
7ffb1b7a0000-7ffb1b7a1000 rw-s 00000000 00:01 65538                      /SYSV00b16363 (deleted)
";
        let o: Vec<ShmObject> = parse(maps).into_values().collect();
        assert_eq!(o.len(), 4, "{o:?}");
        let ring = o.iter().find(|o| o.name.contains("ring")).unwrap();
        assert_eq!(ring.maps.len(), 2, "one object, mapped twice");
        assert_eq!(ring.size(), 0x2000);
        let zero = o.iter().find(|o| o.name.starts_with("/dev/zero")).unwrap();
        assert_eq!(zero.maps[0].prot, libc::PROT_READ as u64);
        assert_eq!(zero.size(), 0x3000);
        assert!(is_captured("/memfd:tine-shm (deleted)"));
    }
}
