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
use std::sync::Arc;

use crate::inspect::ProcError;
use crate::layout::Mapping;
use crate::pusher::Hand;
use crate::sharedwork::SharedWork;
use crate::shm::{ShmMap, ShmObject, TreeShm};

/// Whether object `o` may be kept in place wherever it is still mapped as
/// at the checkpoint: no descriptor on it (a copy's table would point at
/// the template's copy) and no name it could be opened by again (a
/// `/dev/shm` file still linked: a rollback puts those back by name).
fn keepable(o: &ShmObject) -> bool {
    o.inode != 0 && !o.maps.is_empty() && o.fds.is_empty() && o.name.ends_with(" (deleted)")
}

/// Whether object `o` is a `/dev/shm` file (no descriptor on it) that may
/// be kept in place where its name still names it too ([`same_name`]):
/// the sandbox's `/dev/shm` is its own, which no snapshot holds, so the
/// file a rollback would open by that name and fill is this one
/// (PostgreSQL's dynamic shared memory: ~0.15 ms a process to map again).
fn named(o: &ShmObject) -> bool {
    o.inode != 0
        && !o.maps.is_empty()
        && o.fds.is_empty()
        && o.name.starts_with("/dev/shm/")
        && !o.name.ends_with(" (deleted)")
}

/// Whether `o`'s name, in process `pid`'s root, is the object `o`. (Only
/// looked at: where a link led outside, what it finds there is not `o`.)
fn same_name(pid: u32, o: &ShmObject) -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(format!("/proc/{pid}/root{}", o.name))
        .is_ok_and(|m| m.is_file() && dev_name(m.dev()) == o.dev && m.ino() == o.inode)
}

/// A device number as `/proc/PID/maps` writes it.
fn dev_name(dev: u64) -> String {
    format!(
        "{:02x}:{:02x}",
        rustix::fs::major(dev),
        rustix::fs::minor(dev)
    )
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
        if !(still_mapped && (keepable(o) || (named(o) && same_name(pid, o)))) {
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
                    let live = tree.views.live.get(&Views::key(o, m)).cloned();
                    let left = put_back(&view, live, pid, m, named(o), tree.views.helper.as_ref())?;
                    tree.views.pending.0.extend(left.map(|s| (pid, s)));
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
    /// The live objects where the templates' origins map them, mapped and
    /// faulted in here too (their data: inside the pause only compared,
    /// 1.3 ms for 16 MB, where reading them cost 3.6).
    live: HashMap<(String, u64, u64, u64), Arc<LiveView>>,
    /// A second thread a long put-back hands half its pages to.
    helper: Option<Hand>,
    /// Put-backs handed to `helper` and not yet seen through.
    pending: Pending,
}

/// Put-backs handed to a second thread and not yet seen through, with the
/// PID of the process each was for.
#[derive(Debug, Default)]
pub(crate) struct Pending(Vec<(u32, Arc<Shared>)>);

impl Pending {
    /// Sees every one through: takes what the second thread has not, and
    /// waits for what it has. Before any process that maps the objects
    /// runs (in the meantime the caller grafted the others).
    pub(crate) fn settle(self) -> Result<(), ProcError> {
        for (pid, s) in self.0 {
            s.take();
            s.wait().map_err(|source| ProcError::Ptrace {
                pid,
                step: "put its shared memory back",
                source,
            })?;
        }
        Ok(())
    }
}

impl Views {
    /// Views of every [`keepable`] object of `templates`, one per range of
    /// each object however many map it. One that cannot be made is left
    /// out (the put-back makes it then).
    pub fn open<'t>(templates: impl IntoIterator<Item = &'t crate::template::Template>) -> Views {
        let mut views = HashMap::new();
        let mut live = HashMap::new();
        for t in templates {
            for o in t.shm.iter().filter(|o| keepable(o) || named(o)) {
                for m in &o.maps {
                    if let Entry::Vacant(e) = live.entry(Views::key(o, m))
                        && let Some(v) = LiveView::open(t.origin, o, m)
                    {
                        e.insert(Arc::new(v));
                    }
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
            live,
            helper: None,
            pending: Pending::default(),
        }
    }

    /// Hands half of each long put-back to `helper`'s thread, which
    /// compares and writes its pages beside this one (PostgreSQL's 16 MB
    /// of shared buffers: 3.7 ms on one thread).
    pub fn lend(&mut self, helper: Hand) {
        self.helper = Some(helper);
    }

    /// The put-backs handed to the second thread, to be seen through.
    pub(crate) fn take_pending(&mut self) -> Pending {
        std::mem::take(&mut self.pending)
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

/// A live object where a process maps it, mapped here read-only over the
/// same range, its data faulted in (`MADV_POPULATE_READ`: a page past its
/// end fails the call, it raises no signal). It is read only inside the
/// pause, where nothing runs that could shrink it (a `/dev/shm` file may
/// be, by name, before), and only its runs of data as they are then (a
/// hole read would allocate a page in it, a page past its end would raise
/// `SIGBUS`).
#[derive(Debug)]
struct LiveView {
    map: crate::raw::FileView,
    /// The object (device, inode), to be told from another mapped there since.
    id: (u64, u64),
    /// Its runs of data when the view was made, and what `fstat` told of
    /// it then: while that is the same, so are they (finding them again
    /// walks the object: 0.6 ms for PostgreSQL's 16 MB).
    runs: Option<(Stamp, Runs)>,
}

/// What tells an object's runs of data changed: a page allocated adds to
/// its blocks, a hole punched (`MADV_REMOVE`) or a length set changes its
/// times (to the nanosecond where the kernel has multigrain timestamps,
/// 6.13 on; before, a stamp within the last 50 ms is not trusted).
type Stamp = (u64, u64, i64, i64, i64, i64);

fn stamp(meta: &std::fs::Metadata) -> Stamp {
    use std::os::unix::fs::MetadataExt;
    (
        meta.len(),
        meta.blocks(),
        meta.ctime(),
        meta.ctime_nsec(),
        meta.mtime(),
        meta.mtime_nsec(),
    )
}

/// Whether a stamp's times lie far enough back for a change since to
/// show in them with coarse timestamps (a tick is 4 ms at most).
fn settled(s: &Stamp) -> bool {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i128);
    let at = |sec: i64, nsec: i64| i128::from(sec) * 1_000_000_000 + i128::from(nsec);
    now - at(s.2, s.3).max(at(s.4, s.5)) > 50_000_000
}

impl LiveView {
    /// Of process `pid`'s mapping `m` of object `o`, where it is still `o`.
    fn open(pid: u32, o: &ShmObject, m: &ShmMap) -> Option<LiveView> {
        use std::os::unix::fs::MetadataExt;
        let f = File::open(crate::inspect::map_file(pid, m.start, m.end)).ok()?;
        let meta = f.metadata().ok()?;
        if dev_name(meta.dev()) != o.dev || meta.ino() != o.inode {
            return None;
        }
        let runs = crate::shm::data_runs_strict(&f, m)?;
        let map = crate::raw::FileView::new(&f, m.offset, (m.end - m.start) as usize).ok()?;
        for &(from, to) in &runs {
            map.populate(from as usize, (to - from) as usize).ok()?;
        }
        // (The processes run: runs found between two same stamps.)
        let (before, after) = (stamp(&meta), stamp(&f.metadata().ok()?));
        Some(LiveView {
            map,
            id: (meta.dev(), meta.ino()),
            runs: (before == after && settled(&before)).then_some((before, runs)),
        })
    }
}

/// Pages compared, and written where they differ, at a time.
const CHUNK: usize = 64 << 10;

/// A page of zeros: what a hole of the template's copy reads as.
static ZEROS: [u8; 4096] = [0; 4096];

/// Makes mapping `m` of process `pid`'s object hold what the template's
/// copy (`theirs`) holds there ([`put_back_into`]); or hands that to
/// `helper`'s thread and returns it, to be seen through later.
fn put_back(
    theirs: &Arc<View>,
    mapped: Option<Arc<LiveView>>,
    pid: u32,
    m: &ShmMap,
    exact: bool,
    helper: Option<&Hand>,
) -> Result<Option<Arc<Shared>>, ProcError> {
    use std::os::unix::fs::MetadataExt;
    let lp = crate::inspect::map_file(pid, m.start, m.end);
    let live = File::options()
        .read(true)
        .write(true)
        .open(&lp)
        .map_err(|e| ProcError::read(pid, &lp, e))?;
    // The view made before is of this object still.
    let mapped = mapped.filter(|v| {
        live.metadata()
            .is_ok_and(|meta| (meta.dev(), meta.ino()) == v.id)
    });
    put_back_into(theirs, &live, mapped, m, exact, helper).map_err(|source| ProcError::Ptrace {
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
/// shared buffers are mostly holes), the live object through `mapped` (its
/// view made before the pause) or by `pread`, and only pages that differ
/// written. An object shrunk since is made as long as the copy again (and
/// one grown since as short, with `exact`: a named one, whose length its
/// processes may see). With `helper`, a long one is cut in pieces, handed
/// to its thread and returned: the caller takes what is left of them
/// later ([`Shared::take`]) and waits for the rest ([`Shared::wait`]).
fn put_back_into(
    theirs: &Arc<View>,
    live: &File,
    mapped: Option<Arc<LiveView>>,
    m: &ShmMap,
    exact: bool,
    helper: Option<&Hand>,
) -> std::io::Result<Option<Arc<Shared>>> {
    let len = live.metadata()?.len();
    if len < theirs.len || (exact && len != theirs.len) {
        live.set_len(theirs.len)?;
    }
    // Through the view only where the object tells its holes (a hole is
    // never read through it); those found before where it is as it was.
    let now = stamp(&live.metadata()?);
    let (mapped, live_runs) = match mapped.and_then(|v| {
        let known = v.runs.as_ref().filter(|(then, _)| *then == now);
        match known {
            Some((_, r)) => Some(r.clone()),
            None => crate::shm::data_runs_strict(live, m),
        }
        .map(|r| (v, r))
    }) {
        Some((v, r)) => (Some((v, r.clone())), r),
        None => (None, crate::shm::data_runs_of(live, m)),
    };
    let mut runs = theirs.runs.clone();
    runs.extend(live_runs);
    let runs = merged(runs);
    let total: u64 = runs.iter().map(|(a, b)| b - a).sum();
    match helper {
        Some(h) if total >= SHARED_FROM => {
            let cut = pieces(&runs, total, PIECES);
            let shared = Arc::new(Shared {
                view: theirs.clone(),
                live: live.try_clone()?,
                mapped,
                offset: m.offset,
                work: SharedWork::new(cut.len()),
                pieces: cut,
            });
            // (Not waited for: what it has not taken when the caller sees
            // it through, the caller takes.)
            shared.clone().lend(h.clone());
            Ok(Some(shared))
        }
        _ => put_back_runs(theirs, live, mapped.as_ref(), m.offset, &runs).map(|()| None),
    }
}

/// A live object's view and its runs of data (from the mapping's start).
type Mapped = (Arc<LiveView>, Runs);

/// A put-back shared between threads ([`put_back_into`]).
#[derive(Debug)]
struct Shared {
    view: Arc<View>,
    live: File,
    mapped: Option<Mapped>,
    offset: u64,
    pieces: Vec<Runs>,
    work: SharedWork<std::io::Result<()>>,
}

impl Shared {
    /// Puts pieces back till none is left.
    fn take(&self) {
        while self.take_one() {}
    }

    /// Puts the next piece back, if one is left (whether one was).
    fn take_one(&self) -> bool {
        self.work.take_one(|i| {
            put_back_runs(
                &self.view,
                &self.live,
                self.mapped.as_ref(),
                self.offset,
                &self.pieces[i],
            )
        })
    }

    /// Has `helper`'s thread put back a piece at a time, each sent after
    /// what was sent to it meanwhile: a question a graft waits for is
    /// answered between two pieces, not after them all (1.5 ms).
    fn lend(self: Arc<Self>, helper: Hand) {
        let next = helper.clone();
        drop(helper.run(move || self.next_piece(next)));
    }

    /// On `helper`'s thread: a piece, and the next sent behind.
    fn next_piece(self: Arc<Self>, helper: Hand) {
        if self.take_one() {
            let next = helper.clone();
            helper.run_later(move || self.next_piece(next));
        }
    }

    /// Once every piece is done: the first error.
    fn wait(&self) -> std::io::Result<()> {
        match self.work.wait() {
            Some(done) => done.into_iter().collect(),
            None => Err(std::io::Error::other("a put-back's piece panicked")),
        }
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
    mapped: Option<&Mapped>,
    offset: u64,
    runs: &[(u64, u64)],
) -> std::io::Result<()> {
    let differ = match mapped {
        Some((view, data)) => differing_mapped(theirs, &view.map, data, runs),
        None => differing_read(theirs, live, offset, runs)?,
    };
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

/// Whether `runs` (sorted, disjoint) hold all of `from..to`.
fn covers(runs: &[(u64, u64)], from: u64, to: u64) -> bool {
    let i = runs.partition_point(|&(_, end)| end <= from);
    runs.get(i).is_some_and(|&(a, b)| a <= from && to <= b)
}

/// The pages of `runs` (with their lengths) where the live object, seen
/// through `view` where it holds data (`data`), differs from the copy:
/// a chunk both hold whole compared at once, the others page by page.
fn differing_mapped(
    theirs: &View,
    view: &crate::raw::FileView,
    data: &[(u64, u64)],
    runs: &[(u64, u64)],
) -> Vec<(u64, usize)> {
    let mut differ = Vec::new();
    for &(from, to) in runs {
        let mut at = from;
        while at < to {
            let end = (at + CHUNK as u64).min(to);
            let n = (end - at) as usize;
            let whole = covers(&theirs.runs, at, end) && covers(data, at, end);
            if !(whole && theirs.map.same_as(view, at as usize, n)) {
                for page in (at..end).step_by(PAGE as usize) {
                    let n = (end - page).min(PAGE) as usize;
                    let same = match (theirs.has_data(page), covers(data, page, page + 1)) {
                        (true, true) => theirs.map.same_as(view, page as usize, n),
                        (true, false) => theirs.map.holds(page as usize, &ZEROS[..n]),
                        (false, true) => view.holds(page as usize, &ZEROS[..n]),
                        (false, false) => true,
                    };
                    if !same {
                        differ.push((page, n));
                    }
                }
            }
            at = end;
        }
    }
    differ
}

/// [`differing_mapped`] with the live object read by `pread`.
fn differing_read(
    theirs: &View,
    live: &File,
    offset: u64,
    runs: &[(u64, u64)],
) -> std::io::Result<Vec<(u64, usize)>> {
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
    Ok(differ)
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

    /// A memfd of `pages` pages.
    fn sized(name: &str, pages: u64) -> File {
        let f = memfd(name);
        f.set_len(pages * P).unwrap();
        f
    }

    /// A mapping of an object's first `pages` pages, read-write, at `start`.
    fn whole(start: u64, pages: u64) -> ShmMap {
        ShmMap {
            start,
            end: start + pages * P,
            prot: 3,
            offset: 0,
        }
    }

    fn page(f: &File, at: u64, byte: u8) {
        f.write_all_at(&[byte; P as usize], at * P).unwrap();
    }

    fn bytes(f: &File, from: u64, to: u64) -> Vec<u8> {
        let mut b = vec![0u8; ((to - from) * P) as usize];
        read_at(f, &mut b, from * P).unwrap();
        b
    }

    /// Takes what is left of a put-back handed over and waits for the rest.
    fn see_through(left: Option<Arc<Shared>>) {
        let s = left.expect("handed over");
        s.take();
        s.wait().unwrap();
    }

    /// A view of `live` as one made before the pause.
    fn live_view(live: &File, m: &ShmMap) -> Arc<LiveView> {
        use std::os::unix::fs::MetadataExt;
        let meta = live.metadata().unwrap();
        let map = crate::raw::FileView::new(live, m.offset, (m.end - m.start) as usize).unwrap();
        Arc::new(LiveView {
            map,
            id: (meta.dev(), meta.ino()),
            runs: None,
        })
    }

    #[test]
    fn a_put_back_makes_the_live_object_the_copy_across_holes_and_a_shrink() {
        // Read by `pread`, then through a view of the live object.
        for mapped in [false, true] {
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
            // the mapping; zeros where the copy has a hole; and shrunk
            // since, losing pages 40 and 71.
            for (at, byte) in [
                (8, b'a'),
                (9, b'x'),
                (11, b'y'),
                (2, b'z'),
                (13, 0),
                (41, b'w'),
            ] {
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
            let through = mapped.then(|| live_view(&live, &m));
            put_back_into(&view, &live, through, &m, false, None).unwrap();
            assert_eq!(live.metadata().unwrap().len(), 72 * P, "as long again");
            assert!(
                bytes(&live, 8, 72) == bytes(&tpl, 8, 72),
                "the copy's bytes ({mapped})"
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
            let live_runs = crate::shm::data_runs_of(&live, &m);
            assert!(
                !covers(&live_runs, 4 * P, 5 * P) && covers(&live_runs, 5 * P, 6 * P),
                "the live object's hole at 12 read as none, its zeros at 13 kept ({mapped}): {live_runs:?}"
            );
            assert!(
                view.has_data(P) && !view.has_data(3 * P),
                "page 9 data, 11 a hole"
            );
        }
    }

    #[test]
    fn a_long_put_back_shared_with_a_second_thread_makes_the_live_object_the_copy() {
        // 2048 pages (8 MiB) mapped whole: above the size from which half
        // is handed over.
        let n = 2048;
        let m = whole(0x2000_0000, n);
        let (tpl, live) = (sized("copy", n), sized("live", n));
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
        let view = Arc::new(view);
        let pusher = crate::pusher::Pusher::start(Vec::new()).unwrap();
        // Read by `pread`, then through a view of the live object.
        let again = sized("again", n);
        for at in 0..n {
            let mut b = vec![0u8; P as usize];
            read_at(&live, &mut b, at * P).unwrap();
            if b.iter().any(|&x| x != 0) {
                again.write_all_at(&b, at * P).unwrap();
            }
        }
        see_through(put_back_into(&view, &live, None, &m, false, Some(&pusher.hand())).unwrap());
        assert!(bytes(&live, 0, n) == bytes(&tpl, 0, n), "the copy's bytes");
        let through = live_view(&again, &m);
        see_through(
            put_back_into(
                &view,
                &again,
                Some(through),
                &m,
                false,
                Some(&pusher.hand()),
            )
            .unwrap(),
        );
        assert!(
            bytes(&again, 0, n) == bytes(&tpl, 0, n),
            "the copy's bytes, through a view"
        );
    }

    /// Writes `byte` over page `at` of `f` through a mapping, as a process
    /// does (no time of the file changes).
    /// A shared writable mapping of a test's memfd, written as a process
    /// writes: only a page's first write faults (and sets the file's times).
    struct Poker(*mut nix::libc::c_void, usize);

    #[allow(unsafe_code)]
    impl Poker {
        fn new(f: &File, pages: u64) -> Poker {
            use nix::libc;
            use std::os::fd::AsRawFd;
            let len = (pages * P) as usize;
            // SAFETY: a new shared mapping of the test's own memfd, checked.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    f.as_raw_fd(),
                    0,
                )
            };
            assert_ne!(p, libc::MAP_FAILED);
            Poker(p, len)
        }

        fn poke(&self, at: u64, byte: u8) {
            assert!(((at + 1) * P) as usize <= self.1);
            // SAFETY: inside the mapping made in `new` (checked above).
            unsafe {
                std::ptr::write_bytes((self.0 as *mut u8).add((at * P) as usize), byte, P as usize)
            };
        }
    }

    #[allow(unsafe_code)]
    impl Drop for Poker {
        fn drop(&mut self) {
            // SAFETY: the mapping made in `new`; nothing borrows it.
            unsafe { nix::libc::munmap(self.0, self.1) };
        }
    }

    #[test]
    fn runs_found_before_the_pause_are_used_only_while_the_object_is_as_it_was() {
        let n = 32;
        let m = whole(0x3000_0000, n);
        let tpl = sized("copy", n);
        for at in [0, 1, 2, 10, 11] {
            page(&tpl, at, at as u8 + 1);
        }
        let view = Arc::new(View::of(&tpl, &m).unwrap());
        // Unchanged since the view: only a page written where it was data.
        // Then pages allocated and a hole punched, as many: the blocks the
        // same, the times not.
        for punched in [false, true] {
            let live = sized("live", n);
            // And page 5, where the copy has a hole.
            for at in [0, 1, 2, 5, 10, 11] {
                page(&live, at, at as u8 + 1);
            }
            // Pages 1 and 5 written by a process before the view (their
            // first faults).
            let poker = Poker::new(&live, n);
            poker.poke(1, 2);
            poker.poke(5, 6);
            std::thread::sleep(std::time::Duration::from_millis(60));
            let runs = crate::shm::data_runs_of(&live, &m);
            let then = stamp(&live.metadata().unwrap());
            assert!(settled(&then));
            let lv = {
                let v = live_view(&live, &m);
                Arc::new(LiveView {
                    map: crate::raw::FileView::new(&live, 0, (n * P) as usize).unwrap(),
                    id: v.id,
                    runs: Some((then, runs)),
                })
            };
            poker.poke(1, 0xee);
            poker.poke(5, 0xef);
            if punched {
                use std::os::fd::AsFd;
                rustix::fs::fallocate(
                    live.as_fd(),
                    rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE,
                    10 * P,
                    P,
                )
                .unwrap();
                poker.poke(20, 0x55);
                assert_ne!(stamp(&live.metadata().unwrap()), then, "the times changed");
            } else {
                assert_eq!(
                    stamp(&live.metadata().unwrap()),
                    then,
                    "a write through a mapping"
                );
            }
            put_back_into(&view, &live, Some(lv), &m, false, None).unwrap();
            assert!(
                bytes(&live, 0, n) == bytes(&tpl, 0, n),
                "the copy's bytes (punched: {punched})"
            );
        }
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
