//! The supervisor's change tracker: inotify watches on every directory of a
//! sandbox's upper layer, turned into the set of directories changed since the
//! last snapshot, so a snapshot or rollback reads those and nothing else.
//!
//! Through the overlay, writes show on the upper layer as MODIFY/CREATE/DELETE,
//! copy-ups as CREATE (files) or MOVED_TO (directories), deletions of lower
//! entries as a whiteout's MOVED_TO. What inotify cannot report — writes
//! through shared memory mappings — the snapshot checks for itself (see
//! `manager`). A lost event (queue overflow), a watch that could not be added,
//! or a fresh tracker means it vouches for nothing until the next snapshot has
//! read everything.
//!
//! [`Tracker`] is the bookkeeping alone, fed events by [`Watcher`] (the kernel
//! side, behind [`Watches`] so that tests drive the tracker with a recording
//! double).

use std::collections::HashMap;
use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustix::fs::inotify::{self, CreateFlags, ReadFlags, WatchFlags};
use serde::{Deserialize, Serialize};
use tine_fs::paths::{is_at_or_below, join};
use tine_fs::{DirtySet, Stamp, Tracked};

/// One inotify event, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub wd: i32,
    pub mask: ReadFlags,
    pub cookie: u32,
    pub name: Vec<u8>,
}

/// Adding and removing watches: the kernel, or a test double.
pub trait Watches {
    /// Watches the directory at `rel` (relative to the upper layer) and every
    /// directory below it; returns (watch, path) for each.
    fn add_tree(&mut self, rel: &[u8]) -> io::Result<Vec<(i32, Vec<u8>)>>;
    fn remove(&mut self, wd: i32);
}

/// The most path bytes a reply lists (16 MiB); past this the tracker vouches for
/// nothing and the snapshot reads the whole upper layer.
const MAX_REPLY_PATHS: usize = 16 << 20;

/// What the tracker answers a snapshot (one JSON line on the supervisor socket).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DirtyReply {
    pub now: Stamp,
    pub since: Stamp,
    /// `None`: it cannot vouch for anything; read everything.
    pub dirty: Option<DirtyPaths>,
    /// The last snapshot saw a shared writable mapping: read every file's content.
    #[serde(default)]
    pub rehash: bool,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct DirtyPaths {
    pub dirs: Vec<Vec<u8>>,
    pub trees: Vec<Vec<u8>>,
}

impl DirtyReply {
    pub fn tracked(self) -> Tracked {
        Tracked {
            now: self.now,
            since: self.since,
            dirty: self
                .dirty
                .filter(|_| !self.rehash)
                .map(|d| DirtySet::new(d.dirs, d.trees)),
            rehash: self.rehash,
        }
    }
}

/// The bookkeeping: which upper directories changed since the last snapshot.
#[derive(Debug)]
pub struct Tracker {
    watch: u64,
    /// Events read so far.
    seq: u64,
    /// Where the last snapshot's read ended.
    clean_seq: u64,
    /// It cannot vouch for what happened from this position on.
    blind_since: Option<u64>,
    /// A watch could not be added: never vouch again.
    broken: bool,
    wds: HashMap<i32, Vec<u8>>,
    /// Directory -> position of its latest change.
    dirs: HashMap<Vec<u8>, u64>,
    trees: HashMap<Vec<u8>, u64>,
    /// A directory moved away, waiting for the event saying where to.
    moved_from: Option<(u32, Vec<u8>)>,
    /// The last snapshot saw a shared writable mapping of a workspace file.
    mapped: bool,
}

impl Tracker {
    /// A tracker for a freshly watched upper layer: blind until a snapshot
    /// has read everything once.
    pub fn new(watch: u64, w: &mut dyn Watches) -> Tracker {
        let mut t = Tracker {
            watch,
            seq: 0,
            clean_seq: 0,
            blind_since: Some(0),
            broken: false,
            wds: HashMap::new(),
            dirs: HashMap::new(),
            trees: HashMap::new(),
            moved_from: None,
            mapped: false,
        };
        t.add_tree(b"", w);
        t
    }

    fn add_tree(&mut self, rel: &[u8], w: &mut dyn Watches) {
        match w.add_tree(rel) {
            Ok(added) => self.wds.extend(added),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(_) => {
                // Out of watches (max_user_watches) or worse.
                self.broken = true;
                self.blind_since.get_or_insert(self.seq);
            }
        }
    }

    fn dirty(&mut self, rel: Vec<u8>) {
        self.dirs.insert(rel, self.seq);
    }

    /// Takes in one event.
    pub fn apply(&mut self, ev: &Event, w: &mut dyn Watches) {
        self.seq += 1;
        if ev.mask.contains(ReadFlags::QUEUE_OVERFLOW) {
            // Events were lost: watch anything new, and read everything next time.
            self.blind_since.get_or_insert(self.seq);
            self.add_tree(b"", w);
            return;
        }
        let Some(dir) = self.wds.get(&ev.wd).cloned() else {
            return;
        };
        if ev.mask.contains(ReadFlags::IGNORED) {
            self.wds.remove(&ev.wd);
            return;
        }
        if ev.name.is_empty() {
            // About the watched directory itself (its mode, an opaque mark, its removal).
            if ev.mask.contains(ReadFlags::ATTRIB) {
                self.trees.insert(dir.clone(), self.seq);
            }
            self.dirty(dir);
            return;
        }
        let path = join(&dir, &ev.name);
        self.dirty(dir);
        if !ev.mask.contains(ReadFlags::ISDIR) {
            return;
        }
        if ev.mask.contains(ReadFlags::MOVED_FROM) {
            self.moved_from = Some((ev.cookie, path));
        } else if ev.mask.contains(ReadFlags::MOVED_TO) {
            match self.moved_from.take() {
                Some((cookie, from)) if cookie == ev.cookie => {
                    // The watches moved with the directory: rename their paths.
                    for p in self.wds.values_mut() {
                        if is_at_or_below(p, &from) {
                            *p = [&path[..], &p[from.len()..]].concat();
                        }
                    }
                    self.trees.insert(path, self.seq);
                }
                other => {
                    if let Some((_, from)) = other {
                        self.moved_away(&from, w);
                    }
                    // In from outside the layer (an overlay copy-up): new to us.
                    self.add_tree(&path, w);
                    self.trees.insert(path, self.seq);
                }
            }
        } else if ev.mask.contains(ReadFlags::CREATE) {
            self.add_tree(&path, w);
            self.trees.insert(path, self.seq);
        } else if ev.mask.contains(ReadFlags::ATTRIB) {
            // An opaque mark changes what the directory hides: read all of it.
            self.trees.insert(path, self.seq);
        }
    }

    /// A directory left the layer: its watches now describe nothing here.
    fn moved_away(&mut self, from: &[u8], w: &mut dyn Watches) {
        let gone: Vec<i32> = self
            .wds
            .iter()
            .filter(|(_, p)| is_at_or_below(p, from))
            .map(|(wd, _)| *wd)
            .collect();
        for wd in gone {
            self.wds.remove(&wd);
            w.remove(wd);
        }
    }

    /// Everything read so far has been applied: settles a pending move.
    pub fn settle(&mut self, w: &mut dyn Watches) {
        if let Some((_, from)) = self.moved_from.take() {
            self.moved_away(&from, w);
        }
    }

    /// What a snapshot taken now may trust.
    pub fn reply(&self) -> DirtyReply {
        let now = Stamp {
            watch: self.watch,
            seq: self.seq,
        };
        let since = Stamp {
            watch: self.watch,
            seq: self.clean_seq,
        };
        // A list longer than a full read is worth is not sent: a deep chain
        // of new directories makes one of tens of megabytes.
        let bytes: usize = self
            .dirs
            .keys()
            .chain(self.trees.keys())
            .map(Vec::len)
            .sum();
        let dirty =
            (self.blind_since.is_none() && !self.broken && bytes <= MAX_REPLY_PATHS).then(|| {
                DirtyPaths {
                    dirs: self.dirs.keys().cloned().collect(),
                    trees: self.trees.keys().cloned().collect(),
                }
            });
        DirtyReply {
            now,
            since,
            dirty,
            rehash: self.mapped,
        }
    }

    /// A snapshot that read the layer as of position `seq` is durable. With
    /// `mapped` (it saw a shared writable mapping of a workspace file, whose
    /// writes make no events and may not even change the file's stat), the
    /// next one must read every file's content too.
    pub fn clean(&mut self, seq: u64, mapped: bool) {
        if seq < self.clean_seq || seq > self.seq {
            return;
        }
        self.mapped = mapped;
        self.clean_seq = seq;
        self.dirs.retain(|_, s| *s > seq);
        self.trees.retain(|_, s| *s > seq);
        if self.blind_since.is_some_and(|b| b <= seq) {
            self.blind_since = None;
        }
        if mapped {
            self.blind_since.get_or_insert(self.seq);
        }
    }

    pub fn watches(&self) -> usize {
        self.wds.len()
    }
}

/// Watches on the real upper directory.
#[derive(Debug)]
pub struct Inotify {
    fd: Arc<OwnedFd>,
    upper: PathBuf,
    /// Watch descriptors given out. A directory whose watch already exists
    /// was walked when it got it, and what was made below it since has
    /// reported itself: walking it again would make a deep chain of new
    /// directories (one event each) cost the square of its depth. (The
    /// kernel hands out descriptors cyclically, so a removed one is not
    /// soon given to another directory.)
    given: std::collections::HashSet<i32>,
}

const MASK: WatchFlags = WatchFlags::MODIFY
    .union(WatchFlags::ATTRIB)
    .union(WatchFlags::CLOSE_WRITE)
    .union(WatchFlags::MOVED_FROM)
    .union(WatchFlags::MOVED_TO)
    .union(WatchFlags::CREATE)
    .union(WatchFlags::DELETE)
    .union(WatchFlags::DELETE_SELF)
    .union(WatchFlags::ONLYDIR)
    .union(WatchFlags::DONT_FOLLOW);

impl Inotify {
    pub fn new(upper: &Path) -> io::Result<Inotify> {
        let fd = Arc::new(inotify::init(CreateFlags::CLOEXEC | CreateFlags::NONBLOCK)?);
        Ok(Inotify {
            fd,
            upper: upper.to_path_buf(),
            given: std::collections::HashSet::new(),
        })
    }

    /// Reads every event queued now (none: an empty list).
    pub fn read(&self) -> io::Result<Vec<Event>> {
        let mut buf = [std::mem::MaybeUninit::<u8>::uninit(); 16 << 10];
        let mut r = inotify::Reader::new(&*self.fd, &mut buf);
        let mut out = Vec::new();
        loop {
            match r.next() {
                Ok(e) => out.push(Event {
                    wd: e.wd(),
                    mask: e.events(),
                    cookie: e.cookie(),
                    name: e
                        .file_name()
                        .map(|n| n.to_bytes().to_vec())
                        .unwrap_or_default(),
                }),
                Err(rustix::io::Errno::AGAIN) => return Ok(out),
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// The descriptor to wait on without holding the watcher.
    pub fn handle(&self) -> Arc<OwnedFd> {
        self.fd.clone()
    }
}

/// Blocks until events are queued on `fd` (or `timeout_ms` passes).
pub fn wait(fd: &OwnedFd, timeout_ms: i32) {
    {
        let mut fds = [rustix::event::PollFd::new(fd, rustix::event::PollFlags::IN)];
        let ts = rustix::event::Timespec {
            tv_sec: i64::from(timeout_ms / 1000),
            tv_nsec: i64::from(timeout_ms % 1000) * 1_000_000,
        };
        let _ = rustix::event::poll(&mut fds, Some(&ts));
    }
}

impl Watches for Inotify {
    fn add_tree(&mut self, rel: &[u8]) -> io::Result<Vec<(i32, Vec<u8>)>> {
        use std::os::unix::ffi::OsStrExt;
        if rel.is_empty() {
            // The whole layer (at the start, or after lost events): walked
            // again everywhere, to find what was made while nothing was heard.
            self.given.clear();
        }
        let mut out = Vec::new();
        let mut stack = vec![rel.to_vec()];
        while let Some(r) = stack.pop() {
            let abs = self.upper.join(std::ffi::OsStr::from_bytes(&r));
            // Watch before listing: whatever is created meanwhile is then either
            // listed or reported.
            let wd = match inotify::add_watch(&*self.fd, &abs, MASK) {
                Ok(wd) => wd,
                // Gone or replaced by a non-directory since it was reported
                // (overlay moves directories through its work dir): later
                // events say what became of it.
                Err(rustix::io::Errno::NOENT | rustix::io::Errno::NOTDIR) => continue,
                Err(e) => return Err(e.into()),
            };
            out.push((wd, r.clone()));
            if !self.given.insert(wd) {
                continue;
            }
            let Ok(rd) = std::fs::read_dir(&abs) else {
                continue;
            };
            for e in rd.flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    stack.push(join(&r, e.file_name().as_bytes()));
                }
            }
        }
        Ok(out)
    }

    fn remove(&mut self, wd: i32) {
        self.given.remove(&wd);
        let _ = inotify::remove_watch(&*self.fd, wd);
    }
}

/// The tracker with its watches: what the supervisor holds.
#[derive(Debug)]
pub struct Watcher {
    pub inotify: Inotify,
    pub tracker: Tracker,
}

impl Watcher {
    pub fn new(upper: &Path, watch: u64) -> io::Result<Watcher> {
        let mut inotify = Inotify::new(upper)?;
        let tracker = Tracker::new(watch, &mut inotify);
        Ok(Watcher { inotify, tracker })
    }

    /// Applies every queued event; false if reading them failed.
    pub fn drain(&mut self) -> bool {
        let mut ok = true;
        loop {
            match self.inotify.read() {
                Ok(evs) if evs.is_empty() => break,
                Ok(evs) => {
                    for e in &evs {
                        self.tracker.apply(e, &mut self.inotify);
                    }
                }
                Err(_) => {
                    self.tracker.blind_since.get_or_insert(self.tracker.seq);
                    ok = false;
                    break;
                }
            }
        }
        self.tracker.settle(&mut self.inotify);
        ok
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records calls; hands out watch numbers for the directories it is told exist.
    #[derive(Default)]
    struct Fake {
        dirs: Vec<Vec<u8>>,
        next: i32,
        added: Vec<Vec<u8>>,
        removed: Vec<i32>,
        fail: bool,
    }

    impl Watches for Fake {
        fn add_tree(&mut self, rel: &[u8]) -> io::Result<Vec<(i32, Vec<u8>)>> {
            if self.fail {
                return Err(io::Error::from_raw_os_error(libc::ENOSPC));
            }
            self.added.push(rel.to_vec());
            let mut out = Vec::new();
            for d in self.dirs.iter().filter(|d| is_at_or_below(d, rel)) {
                self.next += 1;
                out.push((self.next, d.clone()));
            }
            Ok(out)
        }
        fn remove(&mut self, wd: i32) {
            self.removed.push(wd);
        }
    }

    fn ev(wd: i32, mask: ReadFlags, name: &str) -> Event {
        Event {
            wd,
            mask,
            cookie: 0,
            name: name.as_bytes().to_vec(),
        }
    }

    fn sorted(mut v: Vec<Vec<u8>>) -> Vec<String> {
        v.sort();
        v.into_iter()
            .map(|p| String::from_utf8(p).unwrap())
            .collect()
    }

    #[test]
    fn blind_until_a_snapshot_read_everything_then_tracks_changed_directories() {
        let mut w = Fake {
            dirs: vec![b"".to_vec(), b"a".to_vec(), b"a/b".to_vec()],
            ..Fake::default()
        };
        let mut t = Tracker::new(7, &mut w);
        assert!(
            t.reply().dirty.is_none(),
            "a new tracker vouches for nothing"
        );
        let r = t.reply();
        t.clean(r.now.seq, false);
        let r = t.reply();
        assert_eq!(r.since, r.now);
        assert!(r.dirty.as_ref().unwrap().dirs.is_empty());

        // wd 3 is a/b; a file written there, one deleted at the top.
        t.apply(&ev(3, ReadFlags::MODIFY, "f"), &mut w);
        t.apply(&ev(1, ReadFlags::DELETE, "g"), &mut w);
        let r = t.reply();
        let d = r.dirty.clone().unwrap();
        assert_eq!(sorted(d.dirs), ["", "a/b"]);
        assert!(d.trees.is_empty());

        // A change after the snapshot's read stays dirty after it is cleaned.
        t.apply(&ev(2, ReadFlags::CLOSE_WRITE, "h"), &mut w);
        t.clean(r.now.seq, false);
        let d = t.reply().dirty.unwrap();
        assert_eq!(sorted(d.dirs), ["a"]);
    }

    #[test]
    fn new_and_moved_directories_are_read_whole_and_watched() {
        let mut w = Fake {
            dirs: vec![b"".to_vec(), b"a".to_vec(), b"a/b".to_vec()],
            ..Fake::default()
        };
        let mut t = Tracker::new(1, &mut w);
        t.clean(0, false);
        w.dirs.push(b"a/new".to_vec());
        t.apply(&ev(2, ReadFlags::CREATE | ReadFlags::ISDIR, "new"), &mut w);
        assert_eq!(w.added.last().unwrap(), b"a/new");
        assert_eq!(t.watches(), 4);
        // a/b renamed to c: its watch follows, under the new path.
        let mut from = ev(2, ReadFlags::MOVED_FROM | ReadFlags::ISDIR, "b");
        from.cookie = 9;
        let mut to = ev(1, ReadFlags::MOVED_TO | ReadFlags::ISDIR, "c");
        to.cookie = 9;
        t.apply(&from, &mut w);
        t.apply(&to, &mut w);
        t.settle(&mut w);
        t.apply(&ev(3, ReadFlags::MODIFY, "x"), &mut w);
        let d = t.reply().dirty.unwrap();
        assert_eq!(sorted(d.trees), ["a/new", "c"]);
        assert_eq!(sorted(d.dirs), ["", "a", "c"]);
        assert!(w.removed.is_empty());

        // Moved out of the layer (overlay deleting it through its work dir):
        // its watches are dropped.
        let mut out = ev(1, ReadFlags::MOVED_FROM | ReadFlags::ISDIR, "c");
        out.cookie = 10;
        t.apply(&out, &mut w);
        t.settle(&mut w);
        assert_eq!(w.removed, [3]);
        // An opaque mark set on a directory: all of it is read.
        t.apply(&ev(2, ReadFlags::ATTRIB, ""), &mut w);
        assert!(t.reply().dirty.unwrap().trees.contains(&b"a".to_vec()));
    }

    #[test]
    fn overflow_and_missing_watches_make_it_blind() {
        let mut w = Fake {
            dirs: vec![b"".to_vec()],
            ..Fake::default()
        };
        let mut t = Tracker::new(1, &mut w);
        t.clean(0, false);
        t.apply(&ev(-1, ReadFlags::QUEUE_OVERFLOW, ""), &mut w);
        let r = t.reply();
        assert!(r.dirty.is_none());
        // A snapshot that read everything after the overflow restores trust.
        t.clean(r.now.seq, false);
        assert!(t.reply().dirty.is_some());
        // The snapshot saw a shared writable mapping: the next reads and rehashes all.
        t.clean(t.reply().now.seq, true);
        let r = t.reply();
        assert!(r.dirty.is_none() && r.rehash);
        t.clean(r.now.seq, false);
        let r = t.reply();
        assert!(r.dirty.is_some() && !r.rehash);
        // A watch that cannot be added (out of watches): never trusted again.
        w.fail = true;
        t.apply(&ev(1, ReadFlags::CREATE | ReadFlags::ISDIR, "d"), &mut w);
        let r = t.reply();
        t.clean(r.now.seq, false);
        assert!(t.reply().dirty.is_none());
    }
}
