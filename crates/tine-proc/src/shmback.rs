//! Shared memory a rollback in place leaves where it is: an object a live
//! process still maps as it did at the checkpoint (the same object, at the
//! same places) gets the template's bytes back in place, once for the whole
//! tree, instead of being copied into a new object and mapped over in each
//! of its processes (a multiprocessing pool's six semaphores cost ~1 ms per
//! process that way). The tree's other processes that map it keep it too;
//! one made anew maps it from there (`shm::TreeShm`).

use std::fs::File;
use std::os::unix::fs::FileExt;

use crate::inspect::ProcError;
use crate::layout::Mapping;
use crate::shm::{ShmMap, ShmObject, TreeShm};

/// The objects of `objects` (template `tpid`'s, as its origin mapped them
/// at the checkpoint) that process `pid`, whose memory map is `cur`, keeps
/// where they are: every mapping of the object the same in `cur` (place,
/// offset, protection, the object's device and inode), no descriptor on it
/// (a copy's table would point at the template's copy) and no name it could
/// be opened by again (a `/dev/shm` file still linked: a rollback puts
/// those back by name). The first process of `tree` to keep one writes the
/// template's bytes back into it; one the tree copied already is not kept.
pub fn keep_in_place<'o>(
    pid: u32,
    tpid: u32,
    objects: &'o [ShmObject],
    cur: &[Mapping],
    tree: &mut TreeShm,
) -> Result<Vec<&'o ShmObject>, ProcError> {
    let mut kept = Vec::new();
    for o in objects {
        let still_mapped = o.maps.iter().all(|m| {
            let i = cur.partition_point(|c| c.start < m.start);
            cur.get(i).is_some_and(|c| {
                c.start == m.start
                    && c.end == m.end
                    && c.offset == m.offset
                    && c.prot == m.prot
                    && c.shared
                    && c.dev == o.dev
                    && c.inode == o.inode
            })
        });
        let keepable = o.inode != 0
            && !o.maps.is_empty()
            && o.fds.is_empty()
            && o.name.ends_with(" (deleted)")
            && still_mapped;
        if !keepable {
            continue;
        }
        match tree.kept_where(o) {
            Some(true) => {}
            // The tree made a copy of its own already: mapped from there.
            Some(false) => continue,
            None => {
                for m in &o.maps {
                    put_back(tpid, pid, m)?;
                }
                tree.note_kept(o, pid);
            }
        }
        kept.push(o);
    }
    Ok(kept)
}

/// Pages compared, and written where they differ, at a time.
const CHUNK: usize = 64 << 10;

/// Makes mapping `m` of process `pid`'s object hold what the template's
/// copy holds there: only the runs where either holds data are read (a
/// server's shared buffers are mostly holes), and only pages that differ
/// written. An object shrunk since is made as long as the copy again.
fn put_back(tpid: u32, pid: u32, m: &ShmMap) -> Result<(), ProcError> {
    let path = |p: u32| crate::inspect::map_file(p, m.start, m.end);
    let (tp, lp) = (path(tpid), path(pid));
    let theirs = File::open(&tp).map_err(|e| ProcError::read(tpid, &tp, e))?;
    let live = File::options()
        .read(true)
        .write(true)
        .open(&lp)
        .map_err(|e| ProcError::read(pid, &lp, e))?;
    let written = |source| ProcError::Ptrace {
        pid,
        step: "put its shared memory back",
        source,
    };
    let size = |f: &File, p: u32, at: &std::path::Path| {
        f.metadata()
            .map(|s| s.len())
            .map_err(|e| ProcError::read(p, at, e))
    };
    let (want_len, live_len) = (size(&theirs, tpid, &tp)?, size(&live, pid, &lp)?);
    if live_len < want_len {
        live.set_len(want_len).map_err(written)?;
    }
    let mut runs = crate::shm::data_runs_of(&theirs, m);
    runs.extend(crate::shm::data_runs_of(&live, m));
    runs.sort_unstable();
    let (mut want, mut have) = (vec![0u8; CHUNK], vec![0u8; CHUNK]);
    let mut done = 0;
    for (from, to) in runs {
        let mut at = from.max(done);
        while at < to {
            let n = (to - at).min(CHUNK as u64) as usize;
            let off = m.offset + at;
            read_at(&theirs, &mut want[..n], off).map_err(|e| ProcError::read(tpid, &tp, e))?;
            read_at(&live, &mut have[..n], off).map_err(|e| ProcError::read(pid, &lp, e))?;
            let pages = want[..n].chunks(4096).zip(have[..n].chunks(4096));
            for (p, (w, h)) in pages.enumerate() {
                if w != h {
                    live.write_all_at(w, off + (p * 4096) as u64)
                        .map_err(written)?;
                }
            }
            at += n as u64;
        }
        done = done.max(to);
    }
    Ok(())
}

/// Fills `buf` from `f` at `off`; past the end of the file, with zeros (as
/// the mapping reads there).
fn read_at(f: &File, buf: &mut [u8], off: u64) -> std::io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        match f.read_at(&mut buf[got..], off + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    buf[got..].fill(0);
    Ok(())
}
