//! Shared memory a rollback in place leaves where it is: an object a live
//! process still maps as it did at the checkpoint (the same object, at the
//! same places) gets the template's bytes back in place, once for the whole
//! tree, instead of being copied into a new object and mapped over in each
//! of its processes (a multiprocessing pool's six semaphores cost ~1 ms per
//! process that way). The tree's other processes that map it keep it too;
//! one made anew maps it from there (`shm::TreeShm`). The template's copy
//! is mapped here before the pause (`Views`), so that only the live object
//! is read inside it.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use crate::inspect::ProcError;
use crate::layout::Mapping;
use crate::pusher::Hand;
use crate::shm::{ShmMap, ShmObject, TreeShm};

/// Whether object `o` may be kept in place wherever it is still mapped as
/// at the checkpoint: no descriptor on it (a copy's table would point at
/// the template's copy) and no name it could be opened by again (a
/// `/dev/shm` file still linked: a rollback puts those back by name).
fn keepable(o: &ShmObject) -> bool {
    o.inode != 0 && !o.maps.is_empty() && o.fds.is_empty() && o.name.ends_with(" (deleted)")
}

/// The objects of `objects` (template `tpid`'s, as its origin mapped them
/// at the checkpoint) that process `pid`, whose memory map is `cur`, keeps
/// where they are: those [`keepable`] with every mapping the same in `cur`
/// (place, offset, protection, the object's device and inode). The first
/// process of `tree` to keep one writes the template's bytes back into it
/// (through `views`, where they were mapped ahead); one the tree copied
/// already is not kept.
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
        if !(keepable(o) && still_mapped) {
            continue;
        }
        match tree.kept_where(o) {
            Some(true) => {}
            // The tree made a copy of its own already: mapped from there.
            Some(false) => continue,
            None => {
                for m in &o.maps {
                    let view = match tree.views.get(o, m) {
                        Some(v) => v.clone(),
                        None => Arc::new(View::open(tpid, m)?),
                    };
                    put_back(&view, pid, m, tree.views.helper.as_ref())?;
                }
                tree.note_kept(o, pid);
            }
        }
        kept.push(o);
    }
    Ok(kept)
}

/// The templates' copies of the shared memory a rollback may keep in
/// place, mapped into this process and faulted in before the pause, by
/// object (device, inode) and range of it: inside, the put-back compares
/// the live object with them where they are instead of reading both
/// (PostgreSQL's 16 MB of shared buffers: 8 ms read both ways). The
/// copies are the templates' memfds, which no descriptor is on and no
/// process but the template maps: nothing can shrink them under a view.
#[derive(Debug, Default)]
pub struct Views {
    views: HashMap<(String, u64, u64, u64), Arc<View>>,
    /// A second thread a long put-back hands half its pages to.
    helper: Option<Hand>,
}

impl Views {
    /// Views of every [`keepable`] object of `templates`, one per range of
    /// each object however many map it. One that cannot be made is left
    /// out (the put-back makes it then).
    pub fn open<'t>(templates: impl IntoIterator<Item = &'t crate::template::Template>) -> Views {
        let mut views = HashMap::new();
        for t in templates {
            for o in t.shm.iter().filter(|o| keepable(o)) {
                for m in &o.maps {
                    if let Entry::Vacant(e) = views.entry(Views::key(o, m))
                        && let Ok(v) = View::open(t.pid, m)
                    {
                        for &(from, to) in &v.runs {
                            // Faulted in as it is read where this fails.
                            let _ = v.map.populate(from as usize, (to - from) as usize);
                        }
                        e.insert(Arc::new(v));
                    }
                }
            }
        }
        Views {
            views,
            helper: None,
        }
    }

    /// Hands half of each long put-back to `helper`'s thread, which
    /// compares and writes its pages beside this one (PostgreSQL's 16 MB
    /// of shared buffers: 3.7 ms on one thread).
    pub fn lend(&mut self, helper: Hand) {
        self.helper = Some(helper);
    }

    fn key(o: &ShmObject, m: &ShmMap) -> (String, u64, u64, u64) {
        (o.dev.clone(), o.inode, m.offset, m.end - m.start)
    }

    fn get(&self, o: &ShmObject, m: &ShmMap) -> Option<&Arc<View>> {
        self.views.get(&Views::key(o, m))
    }
}

/// A template's copy of mapping `m` of an object, mapped here: its size
/// and its runs of data (from the mapping's start).
#[derive(Debug)]
struct View {
    map: crate::raw::FileView,
    len: u64,
    runs: Vec<(u64, u64)>,
}

impl View {
    fn open(tpid: u32, m: &ShmMap) -> Result<View, ProcError> {
        let at = crate::inspect::map_file(tpid, m.start, m.end);
        File::open(&at)
            .and_then(|f| View::of(&f, m))
            .map_err(|e| ProcError::read(tpid, &at, e))
    }

    /// Of file `f` (the template's copy) where `m` maps it.
    fn of(f: &File, m: &ShmMap) -> std::io::Result<View> {
        let len = f.metadata()?.len();
        let map = crate::raw::FileView::new(f, m.offset, (m.end - m.start) as usize)?;
        let runs = crate::shm::data_runs_of(f, m);
        Ok(View { map, len, runs })
    }

    /// Whether page `at` (from the mapping's start) holds data: reading a
    /// hole through the view would allocate a page there.
    fn has_data(&self, at: u64) -> bool {
        let i = self.runs.partition_point(|&(_, to)| to <= at);
        self.runs.get(i).is_some_and(|&(from, _)| from <= at)
    }
}

/// Pages compared, and written where they differ, at a time.
const CHUNK: usize = 64 << 10;

/// A page of zeros: what a hole of the template's copy reads as.
static ZEROS: [u8; 4096] = [0; 4096];

/// Makes mapping `m` of process `pid`'s object hold what the template's
/// copy (`theirs`) holds there ([`put_back_into`]).
fn put_back(
    theirs: &Arc<View>,
    pid: u32,
    m: &ShmMap,
    helper: Option<&Hand>,
) -> Result<(), ProcError> {
    let lp = crate::inspect::map_file(pid, m.start, m.end);
    let live = File::options()
        .read(true)
        .write(true)
        .open(&lp)
        .map_err(|e| ProcError::read(pid, &lp, e))?;
    put_back_into(theirs, &live, m, helper).map_err(|source| ProcError::Ptrace {
        pid,
        step: "put its shared memory back",
        source,
    })
}

/// Bytes of data from which a put-back is shared with a second thread: a
/// hand-off each way costs about what comparing 0.5 MB does.
const SHARED_FROM: u64 = 2 << 20;

/// Pieces a shared put-back is cut in: the second thread may come to it
/// late (behind other work handed to it), and takes only what is left.
const PIECES: usize = 8;

/// Makes `live` (the object mapping `m` maps) hold what the template's copy
/// holds there: only the runs where either holds data are read (a server's
/// shared buffers are mostly holes), the live object by `pread` (a process
/// holding a descriptor on it could shrink it under a mapping), and only
/// pages that differ written. An object shrunk since is made as long as
/// the copy again. With `helper`, a long one is cut in pieces that its
/// thread takes too, each comparing and writing the pages of its own.
fn put_back_into(
    theirs: &Arc<View>,
    live: &File,
    m: &ShmMap,
    helper: Option<&Hand>,
) -> std::io::Result<()> {
    if live.metadata()?.len() < theirs.len {
        live.set_len(theirs.len)?;
    }
    let mut runs = theirs.runs.clone();
    runs.extend(crate::shm::data_runs_of(live, m));
    let runs = merged(runs);
    let total: u64 = runs.iter().map(|(a, b)| b - a).sum();
    match helper {
        Some(h) if total >= SHARED_FROM => {
            let shared = Arc::new(Shared {
                view: theirs.clone(),
                live: live.try_clone()?,
                offset: m.offset,
                pieces: pieces(&runs, total, PIECES),
                next: AtomicUsize::new(0),
                done: Mutex::new((0, None)),
                all_done: Condvar::new(),
            });
            let theirs = shared.clone();
            // (Not waited for: what it has not taken when this thread is
            // through, this thread took.)
            drop(h.run(move || theirs.take()));
            shared.take();
            shared.wait()
        }
        _ => put_back_runs(theirs, live, m.offset, &runs),
    }
}

/// A put-back shared between threads ([`put_back_into`]).
struct Shared {
    view: Arc<View>,
    live: File,
    offset: u64,
    pieces: Vec<Runs>,
    next: AtomicUsize,
    /// Pieces done, and the first error.
    done: Mutex<(usize, Option<std::io::Error>)>,
    all_done: Condvar,
}

impl Shared {
    /// Puts pieces back till none is left.
    fn take(&self) {
        while let Some(piece) = self.pieces.get(self.next.fetch_add(1, Ordering::Relaxed)) {
            // (Counted done even if it panics: the other thread waits for it.)
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                put_back_runs(&self.view, &self.live, self.offset, piece)
            }))
            .unwrap_or_else(|_| Err(std::io::Error::other("a put-back's piece panicked")));
            let mut d = self.done.lock().unwrap_or_else(|p| p.into_inner());
            d.0 += 1;
            if let Err(e) = r {
                d.1.get_or_insert(e);
            }
            self.all_done.notify_all();
        }
    }

    /// Once every piece is done: the first error.
    fn wait(&self) -> std::io::Result<()> {
        let mut d = self.done.lock().unwrap_or_else(|p| p.into_inner());
        while d.0 < self.pieces.len() {
            d = self.all_done.wait(d).unwrap_or_else(|p| p.into_inner());
        }
        d.1.take().map_or(Ok(()), Err)
    }
}

const PAGE: u64 = 4096;

/// Runs of an object's pages, from its mapping's start.
type Runs = Vec<(u64, u64)>;

/// `runs` sorted, those that overlap or touch made one.
fn merged(mut runs: Runs) -> Runs {
    runs.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(runs.len());
    for (a, b) in runs {
        match out.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

/// `runs` (disjoint, sorted, page-aligned; `total` bytes) cut in at most
/// `n` pieces of about equal bytes, at pages, in order.
fn pieces(runs: &[(u64, u64)], total: u64, n: usize) -> Vec<Runs> {
    let each = total
        .div_ceil(n.max(1) as u64)
        .next_multiple_of(PAGE)
        .max(PAGE);
    let mut out: Vec<Runs> = vec![Vec::new()];
    let mut room = each;
    for &(mut from, to) in runs {
        while from < to {
            if room == 0 {
                out.push(Vec::new());
                room = each;
            }
            let cut = to.min(from + room);
            out.last_mut().expect("one at least").push((from, cut));
            room -= cut - from;
            from = cut;
        }
    }
    out.retain(|p| !p.is_empty());
    out
}

/// [`put_back_into`] of the pages of `runs` (disjoint, from the mapping's
/// start), the object mapped from `offset`.
fn put_back_runs(
    theirs: &View,
    live: &File,
    offset: u64,
    runs: &[(u64, u64)],
) -> std::io::Result<()> {
    let mut have = vec![0u8; CHUNK];
    let mut differ = Vec::new();
    for &(from, to) in runs {
        let mut at = from;
        while at < to {
            let n = (to - at).min(CHUNK as u64) as usize;
            read_at(live, &mut have[..n], offset + at)?;
            for (p, h) in have[..n].chunks(4096).enumerate() {
                let page = at + (p * 4096) as u64;
                let same = if theirs.has_data(page) {
                    theirs.map.holds(page as usize, h)
                } else {
                    h == &ZEROS[..h.len()]
                };
                if !same {
                    differ.push((page, h.len()));
                }
            }
            at += n as u64;
        }
    }
    for (page, n) in differ {
        let off = offset + page;
        if theirs.has_data(page) {
            theirs.map.write_into(page as usize, n, live, off)?;
        } else {
            live.write_all_at(&ZEROS[..n], off)?;
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    const P: u64 = 4096;

    fn memfd(name: &str) -> File {
        rustix::fs::memfd_create(name, rustix::fs::MemfdFlags::CLOEXEC)
            .unwrap()
            .into()
    }

    fn page(f: &File, at: u64, byte: u8) {
        f.write_all_at(&[byte; P as usize], at * P).unwrap();
    }

    fn bytes(f: &File, from: u64, to: u64) -> Vec<u8> {
        let mut b = vec![0u8; ((to - from) * P) as usize];
        read_at(f, &mut b, from * P).unwrap();
        b
    }

    #[test]
    fn a_put_back_makes_the_live_object_the_copy_across_holes_and_a_shrink() {
        // Mapped from its page 8 to its page 72.
        let m = ShmMap {
            start: 0x1000_0000,
            end: 0x1000_0000 + 64 * P,
            prot: 3,
            offset: 8 * P,
        };
        let tpl = memfd("copy");
        tpl.set_len(72 * P).unwrap();
        for (at, byte) in [(8, b'a'), (9, b'b'), (10, 0), (40, b'c'), (71, b'd')] {
            page(&tpl, at, byte);
        }
        let live = memfd("live");
        live.set_len(72 * P).unwrap();
        // The same; different; data where the copy has a hole; outside
        // the mapping; and shrunk since, losing pages 40 and 71.
        for (at, byte) in [(8, b'a'), (9, b'x'), (11, b'y'), (2, b'z'), (41, b'w')] {
            page(&live, at, byte);
        }
        live.set_len(30 * P).unwrap();
        let runs = crate::shm::data_runs_of(&tpl, &m);
        let view = Arc::new(View::of(&tpl, &m).unwrap());
        for &(from, to) in &view.runs {
            view.map
                .populate(from as usize, (to - from) as usize)
                .unwrap();
        }
        put_back_into(&view, &live, &m, None).unwrap();
        assert_eq!(live.metadata().unwrap().len(), 72 * P, "as long again");
        assert!(
            bytes(&live, 8, 72) == bytes(&tpl, 8, 72),
            "the copy's bytes"
        );
        assert!(
            bytes(&live, 2, 3).iter().all(|&b| b == b'z'),
            "outside: kept"
        );
        assert_eq!(
            crate::shm::data_runs_of(&tpl, &m),
            runs,
            "the copy's holes read as zeros, none filled"
        );
        assert!(
            view.has_data(P) && !view.has_data(3 * P),
            "page 9 data, 11 a hole"
        );
    }

    #[test]
    fn a_long_put_back_shared_with_a_second_thread_makes_the_live_object_the_copy() {
        // 2048 pages (8 MiB) mapped whole: above the size from which half
        // is handed over.
        let n = 2048;
        let m = ShmMap {
            start: 0x2000_0000,
            end: 0x2000_0000 + n * P,
            prot: 3,
            offset: 0,
        };
        let tpl = memfd("copy");
        tpl.set_len(n * P).unwrap();
        let live = memfd("live");
        live.set_len(n * P).unwrap();
        // Data in both halves: the same, different, and where either has
        // a hole; the copy holes across the cut too.
        for at in (0..n).filter(|at| at % 5 != 0 && !(1000..1100).contains(at)) {
            page(&tpl, at, (at % 251) as u8 + 1);
        }
        for at in (0..n).filter(|at| at % 3 != 0) {
            let byte = if at % 7 == 0 {
                0xee
            } else {
                (at % 251) as u8 + 1
            };
            page(&live, at, byte);
        }
        let view = View::of(&tpl, &m).unwrap();
        assert!(view.runs.len() > 2, "{:?}", view.runs);
        let pusher = crate::pusher::Pusher::start(Vec::new()).unwrap();
        put_back_into(&Arc::new(view), &live, &m, Some(&pusher.hand())).unwrap();
        assert!(bytes(&live, 0, n) == bytes(&tpl, 0, n), "the copy's bytes");
    }

    #[test]
    fn runs_are_cut_in_pieces_of_about_equal_bytes_at_pages() {
        let runs = merged(vec![(8 * P, 10 * P), (0, 4 * P), (3 * P, 6 * P)]);
        assert_eq!(runs, [(0, 6 * P), (8 * P, 10 * P)]);
        assert_eq!(
            pieces(&runs, 8 * P, 2),
            [vec![(0, 4 * P)], vec![(4 * P, 6 * P), (8 * P, 10 * P)]]
        );
        // 8 pages in 3: pieces of 3, 3 and 2.
        assert_eq!(
            pieces(&runs, 8 * P, 3),
            [
                vec![(0, 3 * P)],
                vec![(3 * P, 6 * P)],
                vec![(8 * P, 10 * P)]
            ]
        );
        assert_eq!(pieces(&runs, 8 * P, 100).len(), 8, "a page at least each");
        assert!(pieces(&[], 0, 8).is_empty());
    }
}
