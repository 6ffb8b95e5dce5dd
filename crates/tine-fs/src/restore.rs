//! Differential, in-place restore of a snapshot into a directory.
//!
//! 1. Plan: scan the target (stat cache, nothing stored), compare with the
//!    snapshot's tree, and list the operations. Decoding every tree needed here
//!    refuses names that could escape the target (`..`, `/`, NUL).
//! 2. Verify: read and hash every object the plan will write, before touching
//!    anything, so damaged data fails the restore instead of being written.
//! 3. Apply: removals, then directories and symlinks, then file contents (in
//!    parallel), then directory modes. Every path is opened relative to its parent
//!    directory's descriptor with `O_NOFOLLOW`, so a symlink in the target can
//!    never redirect a write outside it. Existing files are rewritten in place
//!    (same inode), so open descriptors see the restored content — except
//!    files with more than one link, which are replaced by a new file, so a
//!    hard link never carries a write (or a mode) to another name.

use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use rayon::prelude::*;
use rustix::fs::{AtFlags, Mode, OFlags};
use serde::Serialize;
use tine_store::{
    Content, ErrorKind, HasKind, Kind, Node, ObjectError, ObjectId, Progress, Repository, Tree,
    TreeEntry, WriteError, WriteLock,
};

use crate::diff::{Trees, pair_up};
use crate::paths::{inner_ancestors, is_at_or_below, join, split};
use crate::scan::{Scan, ScanConfig, ScanError, Warning, now_ns, scan};
use crate::statcache::{CacheBuilder, CacheEntry, StatCache, StatKey, cache_path};

/// Objects up to this many bytes in total are kept in memory between verify and apply.
const PREFETCH_BUDGET: u64 = 256 << 20;

/// The set-user-ID and set-group-ID bits of a file's mode.
pub const SETID_BITS: u32 = 0o6000;

/// How a restore treats what the snapshot holds.
#[derive(Debug, Clone, Copy, Default)]
pub struct RestoreOptions {
    /// Give files their set-user-ID and set-group-ID bits. Off by default:
    /// a snapshot of a sandbox may hold a program its root made setuid, which
    /// in a host directory would run as the file's owner for any user. Where
    /// it is off, each file that lost a bit is named in the warnings.
    pub keep_setuid: bool,
    /// The owner (uid, gid) of every file, directory and symlink the restore
    /// creates (`None`: whoever restores). A sandbox's files belong to the
    /// root of its user namespace, not to the host's. Files rewritten in
    /// place keep theirs.
    pub owner: Option<(u32, u32)>,
}

impl RestoreOptions {
    /// Exactly what was stored, modes included, owned by whoever restores:
    /// for the repository's own directories (only its owner reaches them)
    /// and for a merge's result (which becomes a snapshot).
    pub const FAITHFUL: RestoreOptions = RestoreOptions {
        keep_setuid: true,
        owner: None,
    };

    /// What a sandbox's own view gets: modes as stored (its mounts are
    /// `nosuid`, its directories private), files owned by `owner`.
    pub fn sandbox(owner: Option<(u32, u32)>) -> RestoreOptions {
        RestoreOptions {
            owner,
            ..Self::FAITHFUL
        }
    }

    /// Gives `name` in `pfd` (just made) the owner asked for.
    fn own(&self, pfd: &OwnedFd, name: &[u8]) -> rustix::io::Result<()> {
        match self.owner {
            Some((uid, gid)) => rustix::fs::chownat(
                pfd,
                os(name),
                Some(rustix::fs::Uid::from_raw(uid)),
                Some(rustix::fs::Gid::from_raw(gid)),
                AtFlags::SYMLINK_NOFOLLOW,
            ),
            None => Ok(()),
        }
    }

    /// The mode a file of mode `mode` gets.
    pub fn file_mode(&self, mode: u32) -> u32 {
        if self.keep_setuid {
            mode
        } else {
            mode & !SETID_BITS
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error("cannot restore: {0}")]
    Object(#[from] ObjectError),
    #[error(transparent)]
    Scan(#[from] ScanError),
    #[error("restore into {path} failed ({step}): {source}")]
    Io {
        step: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error(transparent)]
    Write(#[from] WriteError),
    #[error(
        "the snapshot has an entry {name:?} where the target holds the repository; restore somewhere else"
    )]
    WouldOverwriteRepository { name: String },
    #[error(
        "the snapshot's directory {path} is more than {max} directories deep; tine does not restore trees that deep",
        max = crate::paths::MAX_DEPTH
    )]
    TooDeep { path: String },
}

impl HasKind for RestoreError {
    fn kind(&self) -> ErrorKind {
        match self {
            RestoreError::Object(e) => e.kind(),
            RestoreError::Scan(e) => e.kind(),
            RestoreError::Io { .. } => ErrorKind::Io,
            RestoreError::Write(e) => e.kind(),
            RestoreError::WouldOverwriteRepository { .. } | RestoreError::TooDeep { .. } => {
                ErrorKind::InvalidInput
            }
        }
    }
}

/// What a restore did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RestoreOutcome {
    pub snapshot: Option<ObjectId>,
    pub target: PathBuf,
    pub added: u64,
    pub modified: u64,
    pub deleted: u64,
    pub mode_changed: u64,
    pub bytes_written: u64,
    /// Files in the target after the restore.
    pub files: u64,
    pub warnings: Vec<Warning>,
}

#[derive(Debug, Clone)]
enum Op {
    /// Remove an entry the target has and the snapshot does not (a directory
    /// recursively, but only what the scan saw: ignored files stay).
    Remove {
        path: Vec<u8>,
        current: TreeEntry,
    },
    Mkdir {
        path: Vec<u8>,
    },
    /// Create a symlink, replacing whatever is at its path.
    Symlink {
        path: Vec<u8>,
        target: Vec<u8>,
    },
    Write {
        path: Vec<u8>,
        content: Content,
        size: u64,
        mode: u32,
        existing: bool,
    },
    Chmod {
        path: Vec<u8>,
        mode: u32,
        dir: bool,
    },
}

#[derive(Debug, Default)]
struct Plan {
    ops: Vec<Op>,
    added: u64,
    modified: u64,
    deleted: u64,
    mode_changed: u64,
    opts: RestoreOptions,
    /// Files whose set-user-ID or set-group-ID bits are not given.
    setid_dropped: Vec<Vec<u8>>,
}

impl Plan {
    fn sync(
        &mut self,
        trees: &Trees<'_>,
        cur: Option<&ObjectId>,
        tgt: &ObjectId,
        prefix: &[u8],
    ) -> Result<(), RestoreError> {
        if cur == Some(tgt) {
            return Ok(());
        }
        if crate::paths::depth(prefix) > crate::paths::MAX_DEPTH {
            return Err(RestoreError::TooDeep {
                path: String::from_utf8_lossy(prefix).into_owned(),
            });
        }
        let ct = cur.map(|c| trees.load(c)).transpose()?;
        let tt = trees.load(tgt)?;
        let empty = Tree::default();
        let ce = ct.as_deref().unwrap_or(&empty);
        // Removals first so that a name can change type.
        let pairs = pair_up(&ce.entries, &tt.entries);
        for (c, t) in &pairs {
            if let Some(c) = c {
                let same_type = t.is_some_and(|t| {
                    std::mem::discriminant(&t.node) == std::mem::discriminant(&c.node)
                });
                if !same_type {
                    self.deleted += u64::from(t.is_none());
                    self.ops.push(Op::Remove {
                        path: join(prefix, &c.name),
                        current: (*c).clone(),
                    });
                }
            }
        }
        for (c, t) in pairs {
            let Some(t) = t else { continue };
            let path = join(prefix, &t.name);
            let c =
                c.filter(|c| std::mem::discriminant(&t.node) == std::mem::discriminant(&c.node));
            let file_mode = self.opts.file_mode(t.mode);
            if matches!(t.node, Node::File { .. }) && file_mode != t.mode {
                self.setid_dropped.push(path.clone());
            }
            match (&t.node, c) {
                (Node::File { content, size }, Some(c)) => {
                    if let Node::File {
                        content: cc,
                        size: cs,
                    } = &c.node
                        && (cc.id != content.id || cs != size)
                    {
                        self.modified += 1;
                        self.ops.push(Op::Write {
                            path,
                            content: *content,
                            size: *size,
                            mode: file_mode,
                            existing: true,
                        });
                    } else if c.mode != file_mode {
                        self.mode_changed += 1;
                        self.ops.push(Op::Chmod {
                            path,
                            mode: file_mode,
                            dir: false,
                        });
                    }
                }
                (Node::File { content, size }, None) => {
                    self.added += 1;
                    self.ops.push(Op::Write {
                        path,
                        content: *content,
                        size: *size,
                        mode: file_mode,
                        existing: false,
                    });
                }
                (Node::Symlink { target }, c) => {
                    let changed = match c.map(|c| &c.node) {
                        Some(Node::Symlink { target: ct }) => ct != target,
                        _ => true,
                    };
                    if changed {
                        if c.is_some() {
                            self.modified += 1
                        } else {
                            self.added += 1
                        }
                        self.ops.push(Op::Symlink {
                            path,
                            target: target.clone(),
                        });
                    }
                }
                (Node::Dir { tree }, c) => {
                    let ctree = match c.map(|c| &c.node) {
                        Some(Node::Dir { tree }) => Some(*tree),
                        _ => None,
                    };
                    if ctree.is_none() {
                        self.ops.push(Op::Mkdir { path: path.clone() });
                    }
                    self.sync(trees, ctree.as_ref(), tree, &path)?;
                    if c.is_none_or(|c| c.mode != t.mode) {
                        if c.is_some() {
                            self.mode_changed += 1;
                        }
                        self.ops.push(Op::Chmod {
                            path,
                            mode: t.mode,
                            dir: true,
                        });
                    }
                }
            }
        }
        Ok(())
    }
}

fn errno(e: rustix::io::Errno) -> io::Error {
    io::Error::from(e)
}

fn os(b: &[u8]) -> &OsStr {
    OsStr::from_bytes(b)
}

/// Open directory descriptors by relative path, opened without following symlinks.
struct Dirs {
    root: PathBuf,
    fds: HashMap<Vec<u8>, OwnedFd>,
}

const DIR_FLAGS: OFlags = OFlags::RDONLY
    .union(OFlags::DIRECTORY)
    .union(OFlags::NOFOLLOW)
    .union(OFlags::CLOEXEC);

impl Dirs {
    fn new(root: &Path) -> Result<Dirs, RestoreError> {
        let fd = rustix::fs::open(root, DIR_FLAGS.difference(OFlags::NOFOLLOW), Mode::empty())
            .map_err(|e| io_err("open target directory", root.to_path_buf())(errno(e)))?;
        let mut fds = HashMap::new();
        fds.insert(Vec::new(), fd);
        Ok(Dirs {
            root: root.to_path_buf(),
            fds,
        })
    }

    fn abs(&self, rel: &[u8]) -> PathBuf {
        self.root.join(os(rel))
    }

    fn get(&mut self, rel: &[u8]) -> Result<&OwnedFd, RestoreError> {
        if !self.fds.contains_key(rel) {
            let (parent, name) = split(rel);
            let parent = parent.to_vec();
            self.get(&parent)?;
            let pfd = &self.fds[&parent];
            let fd = rustix::fs::openat(pfd, os(name), DIR_FLAGS, Mode::empty()).map_err(|e| {
                io_err(
                    "open directory (refusing to follow a symlink)",
                    self.abs(rel),
                )(errno(e))
            })?;
            self.fds.insert(rel.to_vec(), fd);
        }
        Ok(&self.fds[rel])
    }

    fn forget_below(&mut self, rel: &[u8]) {
        self.fds.retain(|k, _| !is_at_or_below(k, rel));
    }
}

tine_store::from_io_at!(RestoreError, fn io_err);

/// Removes `name` in `dir`: a directory only as far as the scan saw it.
fn remove_entry(
    dirs: &mut Dirs,
    trees: &Trees<'_>,
    parent: &[u8],
    e: &TreeEntry,
    warnings: &mut Vec<Warning>,
) -> Result<(), RestoreError> {
    let rel = join(parent, &e.name);
    if let Node::Dir { tree } = &e.node {
        let t = trees.load(tree)?.into_owned();
        for c in &t.entries {
            remove_entry(dirs, trees, &rel, c, warnings)?;
        }
        dirs.forget_below(&rel);
        let pfd = dirs.get(parent)?;
        match rustix::fs::unlinkat(pfd, os(&e.name), AtFlags::REMOVEDIR) {
            Ok(()) => {}
            Err(rustix::io::Errno::NOTEMPTY) => warnings.push(Warning {
                path: dirs.abs(&rel).display().to_string(),
                message: "kept: holds files excluded by .tineignore".into(),
            }),
            Err(rustix::io::Errno::NOENT) => {}
            Err(err) => return Err(io_err("remove directory", dirs.abs(&rel))(errno(err))),
        }
        return Ok(());
    }
    let pfd = dirs.get(parent)?;
    match rustix::fs::unlinkat(pfd, os(&e.name), AtFlags::empty()) {
        Ok(()) | Err(rustix::io::Errno::NOENT) => Ok(()),
        Err(err) => Err(io_err("remove", dirs.abs(&rel))(errno(err))),
    }
}

/// Removes whatever untracked thing (e.g. an ignored file) is in the way at `name`.
fn clear_path(pfd: &OwnedFd, name: &[u8]) -> io::Result<()> {
    match rustix::fs::unlinkat(pfd, os(name), AtFlags::empty()) {
        Ok(()) | Err(rustix::io::Errno::NOENT) => Ok(()),
        Err(rustix::io::Errno::ISDIR) => {
            rustix::fs::unlinkat(pfd, os(name), AtFlags::REMOVEDIR).map_err(errno)
        }
        Err(e) => Err(errno(e)),
    }
}

/// Creates `name` with `create`; if something untracked (an ignored file) is in the
/// way, removes it and tries once more.
fn create_replacing<T>(
    pfd: &OwnedFd,
    name: &[u8],
    create: impl Fn() -> rustix::io::Result<T>,
) -> io::Result<T> {
    match create() {
        Err(rustix::io::Errno::EXIST) => {
            clear_path(pfd, name)?;
            create().map_err(errno)
        }
        r => r.map_err(errno),
    }
}

/// Reads and verifies every object the writes need; keeps them while under budget.
fn prefetch(
    repo: &Repository,
    contents: &[Content],
    progress: &dyn Progress,
) -> Result<HashMap<ObjectId, Vec<u8>>, ObjectError> {
    let mut ids: Vec<ObjectId> = Vec::new();
    let mut seen = HashSet::new();
    for c in contents {
        if !seen.insert(c.id) {
            continue;
        }
        match c.kind {
            Kind::Chunked => {
                let list = repo.read_chunk_list(&c.id)?;
                ids.extend(
                    list.chunks
                        .iter()
                        .map(|(id, _)| *id)
                        .filter(|id| seen.insert(*id)),
                );
            }
            _ => ids.push(c.id),
        }
    }
    progress.start("verifying", ids.len() as u64);
    let kept = Mutex::new((HashMap::new(), 0u64));
    crate::scan::in_pool(|| {
        ids.par_iter()
            .try_for_each(|id| -> Result<(), ObjectError> {
                let raw = repo.read_kind(id, Kind::Blob)?;
                progress.advance(1);
                let mut k = kept.lock().unwrap_or_else(|e| e.into_inner());
                if k.1 + raw.len() as u64 <= PREFETCH_BUDGET {
                    k.1 += raw.len() as u64;
                    k.0.insert(*id, raw);
                }
                Ok(())
            })
    })?;
    progress.finish();
    Ok(kept.into_inner().unwrap_or_else(|e| e.into_inner()).0)
}

fn write_content(
    repo: &Repository,
    cache: &HashMap<ObjectId, Vec<u8>>,
    content: &Content,
    out: &mut File,
    path: &Path,
) -> Result<u64, RestoreError> {
    let blob = |id: &ObjectId| -> Result<std::borrow::Cow<'_, [u8]>, ObjectError> {
        match cache.get(id) {
            Some(b) => Ok(std::borrow::Cow::Borrowed(b.as_slice())),
            None => Ok(std::borrow::Cow::Owned(repo.read_kind(id, Kind::Blob)?)),
        }
    };
    let ids = match content.kind {
        Kind::Chunked => repo
            .read_chunk_list(&content.id)?
            .chunks
            .into_iter()
            .map(|(id, _)| id)
            .collect(),
        _ => vec![content.id],
    };
    let mut n = 0;
    for id in ids {
        let b = blob(&id)?;
        out.write_all(&b).map_err(io_err("write", path))?;
        n += b.len() as u64;
    }
    Ok(n)
}

/// Restores snapshot `snap` into `target` (created if missing), touching only what
/// differs (paths excluded by `.tineignore` and the repository itself are left alone),
/// with the default [`RestoreOptions`].
pub fn restore(
    lock: &WriteLock<'_>,
    snap: &ObjectId,
    target: &Path,
    progress: &dyn Progress,
) -> Result<RestoreOutcome, RestoreError> {
    restore_with(lock, snap, target, RestoreOptions::default(), progress)
}

/// [`restore`] with `opts`.
pub fn restore_with(
    lock: &WriteLock<'_>,
    snap: &ObjectId,
    target: &Path,
    opts: RestoreOptions,
    progress: &dyn Progress,
) -> Result<RestoreOutcome, RestoreError> {
    let repo = lock.repo();
    // Read what is on disk now, not blocks this process decompressed earlier.
    repo.forget_blocks();
    // An unknown snapshot fails before anything is made.
    repo.read_snapshot(snap)?;
    std::fs::create_dir_all(target).map_err(io_err("create target directory", target))?;
    let target =
        std::fs::canonicalize(target).map_err(io_err("resolve target directory", target))?;
    let exclude = std::fs::metadata(repo.path())
        .ok()
        .map(|m| (m.dev(), m.ino()));
    let cpath = cache_path(repo, &target);
    let generation = repo.gc_generation()?;
    let cache = StatCache::load(&cpath, repo.repo_id(), generation);
    let mut current = scan(
        &target,
        ScanConfig {
            sink: None,
            cache: &cache,
            exclude,
            progress,
            keep_trees: true,
            overlay_upper: false,
            unchanged: None,
        },
    )?;
    let new_cache = std::mem::take(&mut current.cache);
    apply(
        lock,
        snap,
        target,
        current,
        Some((cpath, generation, new_cache)),
        opts,
        progress,
    )
}

/// Restores snapshot `snap` into `target` whose content is known to be the tree
/// `current` (trees not in the repository are in `made`): nothing is scanned,
/// so the cost follows the difference, not the size of `target`. Used for
/// overlay workspaces, whose tree comes from their upper layer (their caller
/// records the head; a sandbox's view wants [`RestoreOptions::sandbox`]).
pub fn restore_known(
    lock: &WriteLock<'_>,
    snap: &ObjectId,
    target: &Path,
    current: ObjectId,
    made: HashMap<ObjectId, Tree>,
    opts: RestoreOptions,
    progress: &dyn Progress,
) -> Result<RestoreOutcome, RestoreError> {
    // Not forgetting cached blocks: the caller has just read these trees
    // (verified then) to compute `current`, to keep its frozen window short.
    let target =
        std::fs::canonicalize(target).map_err(io_err("resolve target directory", target))?;
    let current = Scan {
        root: current,
        trees: made,
        started_ns: now_ns(),
        ..Default::default()
    };
    apply(lock, snap, target, current, None, opts, progress)
}

/// Plans, verifies and applies a restore over what `current` says is in
/// `target`; with `cache`, writes the target's stat cache and records its head.
fn apply(
    lock: &WriteLock<'_>,
    snap: &ObjectId,
    target: PathBuf,
    mut current: Scan,
    cache: Option<(PathBuf, u64, CacheBuilder)>,
    opts: RestoreOptions,
    progress: &dyn Progress,
) -> Result<RestoreOutcome, RestoreError> {
    let repo = lock.repo();
    let tree = &repo.read_snapshot(snap)?.tree;
    let trees = Trees::new(repo, Some(&current.trees));

    // 1. Plan.
    let mut plan = Plan {
        opts,
        ..Plan::default()
    };
    plan.sync(&trees, Some(&current.root), tree, &[])?;
    if !current.excluded_root_names.is_empty() {
        let top = trees.load(tree)?;
        for n in &current.excluded_root_names {
            if top.entries.iter().any(|e| &e.name == n) {
                return Err(RestoreError::WouldOverwriteRepository {
                    name: String::from_utf8_lossy(n).into_owned(),
                });
            }
        }
    }

    // 2. Verify everything that will be written.
    let contents: Vec<Content> = plan
        .ops
        .iter()
        .filter_map(|op| match op {
            Op::Write { content, .. } => Some(*content),
            _ => None,
        })
        .collect();
    let fetched = prefetch(repo, &contents, progress)?;

    // 3. Apply.
    let mut warnings = std::mem::take(&mut current.warnings);
    let mut dirs = Dirs::new(&target)?;
    for p in &plan.setid_dropped {
        warnings.push(Warning {
            path: dirs.abs(p).display().to_string(),
            message: "set-user-ID/set-group-ID bit not restored (--keep-setuid restores it)".into(),
        });
    }
    let mut touched: Vec<Vec<u8>> = Vec::new();
    for op in &plan.ops {
        match op {
            Op::Remove { path, current } => {
                let (parent, _) = split(path);
                remove_entry(&mut dirs, &trees, parent, current, &mut warnings)?;
                touched.push(path.clone());
            }
            Op::Mkdir { path } => {
                let (parent, name) = split(path);
                let abs = dirs.abs(path);
                let pfd = dirs.get(parent)?;
                match rustix::fs::mkdirat(pfd, os(name), Mode::from_raw_mode(0o700))
                    .and_then(|()| opts.own(pfd, name))
                {
                    Ok(()) => {}
                    Err(rustix::io::Errno::EXIST) => {
                        // Something untracked (ignored) is in the way; a directory is fine.
                        let is_dir = rustix::fs::statat(pfd, os(name), AtFlags::SYMLINK_NOFOLLOW)
                            .map(|st| {
                                rustix::fs::FileType::from_raw_mode(st.st_mode)
                                    == rustix::fs::FileType::Directory
                            })
                            .unwrap_or(false);
                        if !is_dir {
                            clear_path(pfd, name).map_err(io_err("replace", abs.clone()))?;
                            rustix::fs::mkdirat(pfd, os(name), Mode::from_raw_mode(0o700))
                                .and_then(|()| opts.own(pfd, name))
                                .map_err(|e| io_err("create directory", abs)(errno(e)))?;
                        }
                    }
                    Err(e) => return Err(io_err("create directory", abs)(errno(e))),
                }
            }
            Op::Symlink { path, target: link } => {
                let (parent, name) = split(path);
                let abs = dirs.abs(path);
                let pfd = dirs.get(parent)?;
                create_replacing(pfd, name, || rustix::fs::symlinkat(os(link), pfd, os(name)))
                    .and_then(|()| opts.own(pfd, name).map_err(errno))
                    .map_err(io_err("create symlink", abs))?;
                touched.push(path.clone());
            }
            Op::Write { path, .. } => {
                dirs.get(split(path).0)?;
            }
            Op::Chmod { .. } => {}
        }
    }
    let writes: Vec<&Op> = plan
        .ops
        .iter()
        .filter(|op| matches!(op, Op::Write { .. }))
        .collect();
    progress.start("writing", writes.len() as u64);
    let written: Vec<Result<Written, RestoreError>> = crate::scan::in_pool(|| {
        writes
            .par_iter()
            .map(|op| {
                let Op::Write {
                    path,
                    content,
                    size,
                    mode,
                    existing,
                } = op
                else {
                    unreachable!()
                };
                let (parent, name) = split(path);
                let abs = dirs.abs(path);
                let pfd = &dirs.fds[parent];
                let file = open_for_write(pfd, name, *existing, &opts)
                    .map_err(io_err("open for writing", abs.clone()))?;
                let mut file = File::from(file);
                let n = write_content(repo, &fetched, content, &mut file, &abs)?;
                if n != *size {
                    return Err(RestoreError::Object(ObjectError::Damaged {
                        id: content.id,
                        pack: "?".into(),
                        offset: 0,
                        reason: format!("content is {n} bytes, the tree says {size}"),
                    }));
                }
                file.set_len(*size)
                    .map_err(io_err("truncate", abs.clone()))?;
                rustix::fs::fchmod(file.as_fd(), Mode::from_raw_mode(*mode))
                    .map_err(|e| io_err("chmod", abs.clone())(errno(e)))?;
                let md = file.metadata().map_err(io_err("stat", abs.clone()))?;
                progress.advance(1);
                Ok((
                    path.clone(),
                    CacheEntry {
                        stat: StatKey::of(&md),
                        content: *content,
                    },
                    n,
                ))
            })
            .collect()
    });
    progress.finish();
    let mut bytes_written = 0;
    let mut first_err = None;
    let mut fresh = crate::statcache::CacheBuilder::default();
    for r in written {
        match r {
            Ok((path, entry, n)) => {
                bytes_written += n;
                if !entry.stat.is_racy(current.started_ns) {
                    let (dir, name) = split(&path);
                    fresh.push(dir, name, &entry);
                }
                touched.push(path);
            }
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    for op in &plan.ops {
        if let Op::Chmod { path, mode, dir } = op {
            let abs = dirs.abs(path);
            if *dir {
                let fd = dirs.get(path)?;
                rustix::fs::fchmod(fd, Mode::from_raw_mode(*mode))
                    .map_err(|e| io_err("chmod", abs)(errno(e)))?;
            } else {
                let (parent, name) = split(path);
                let pfd = dirs.get(parent)?;
                let mut fd = rustix::fs::openat(
                    pfd,
                    os(name),
                    OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
                    Mode::empty(),
                )
                .map_err(|e| io_err("open for chmod", abs.clone())(errno(e)))?;
                if is_linked(&fd) {
                    // The mode of every link would change: a copy of its own.
                    fd = unlink_copy(pfd, name, fd)
                        .map_err(io_err("copy a hard-linked file", abs.clone()))?;
                }
                rustix::fs::fchmod(&fd, Mode::from_raw_mode(*mode))
                    .map_err(|e| io_err("chmod", abs)(errno(e)))?;
                touched.push(path.clone());
            }
        }
    }
    let Some((cpath, generation, mut new_cache)) = cache else {
        return outcome(repo, snap, target, &plan, bytes_written, warnings);
    };
    if !touched.is_empty() {
        let touched: HashSet<&[u8]> = touched.iter().map(|t| t.as_slice()).collect();
        // Drop entries for touched paths and anything below them.
        new_cache
            .retain(|k| !(touched.contains(k) || inner_ancestors(k).any(|a| touched.contains(a))));
    }
    new_cache.append(fresh);
    // The cache only saves time; failing to write it must not fail the restore.
    // It is written while the head is recorded (an fsync).
    let head_result = std::thread::scope(|sc| {
        let writer = sc.spawn(|| new_cache.save(&cpath, repo.repo_id(), generation, &target));
        let head_result = lock.set_head(&target.to_string_lossy(), snap);
        let _ = writer.join();
        head_result
    });
    head_result?;
    outcome(repo, snap, target, &plan, bytes_written, warnings)
}

fn outcome(
    repo: &tine_store::Repository,
    snap: &ObjectId,
    target: PathBuf,
    plan: &Plan,
    bytes_written: u64,
    warnings: Vec<Warning>,
) -> Result<RestoreOutcome, RestoreError> {
    Ok(RestoreOutcome {
        snapshot: Some(*snap),
        target,
        added: plan.added,
        modified: plan.modified,
        deleted: plan.deleted,
        mode_changed: plan.mode_changed,
        bytes_written,
        files: repo.snapshot_info(snap)?.map_or(0, |i| i.files),
        warnings,
    })
}

/// Replaces `name` in `pfd` (open at `fd`, which has other links) with a
/// copy of its content (temporary name, then rename); returns the copy.
fn unlink_copy(pfd: &OwnedFd, name: &[u8], fd: OwnedFd) -> io::Result<OwnedFd> {
    let mut tmp = b".tine-restore-".to_vec();
    tmp.extend_from_slice(name.get(..200).unwrap_or(name));
    let copy = create_replacing(pfd, &tmp, || {
        rustix::fs::openat(
            pfd,
            os(&tmp),
            OFlags::RDWR | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )
    })?;
    // The copy keeps the original's owner.
    let owner = rustix::fs::fstat(&fd).map_err(errno)?;
    let (mut from, mut to) = (File::from(fd), File::from(copy));
    let copied = rustix::fs::fchown(
        &to,
        Some(rustix::fs::Uid::from_raw(owner.st_uid)),
        Some(rustix::fs::Gid::from_raw(owner.st_gid)),
    )
    .map_err(errno)
    .and_then(|()| io::copy(&mut from, &mut to))
    .and_then(|_| rustix::fs::renameat(pfd, os(&tmp), pfd, os(name)).map_err(errno));
    if let Err(e) = copied {
        let _ = rustix::fs::unlinkat(pfd, os(&tmp), AtFlags::empty());
        return Err(e);
    }
    Ok(OwnedFd::from(to))
}

/// A file written by restore: its path, what to cache for it, and bytes written.
type Written = (Vec<u8>, CacheEntry, u64);

/// Whether the file open at `fd` has other names: writing it in place would
/// write them too (a link made in the target may name a file outside it).
fn is_linked(fd: &OwnedFd) -> bool {
    rustix::fs::fstat(fd).is_ok_and(|st| st.st_nlink > 1)
}

fn open_for_write(
    pfd: &OwnedFd,
    name: &[u8],
    existing: bool,
    opts: &RestoreOptions,
) -> io::Result<OwnedFd> {
    // NONBLOCK: a FIFO swapped in since the scan fails (ENXIO) instead of hanging.
    let base = OFlags::WRONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK;
    if existing {
        // In place: same inode, so descriptors other processes hold see the
        // new content — unless the file has other links: then a new file.
        match rustix::fs::openat(pfd, os(name), base, Mode::empty()) {
            Ok(fd) if is_linked(&fd) => {
                drop(fd);
                clear_path(pfd, name)?;
            }
            Ok(fd) => return Ok(fd),
            // Read-only file (and not root): replace it instead.
            Err(rustix::io::Errno::ACCESS | rustix::io::Errno::PERM) => clear_path(pfd, name)?,
            Err(e) => return Err(errno(e)),
        }
    }
    let fd = create_replacing(pfd, name, || {
        rustix::fs::openat(
            pfd,
            os(name),
            base | OFlags::CREATE | OFlags::EXCL,
            Mode::from_raw_mode(0o600),
        )
    })?;
    if let Some((uid, gid)) = opts.owner {
        rustix::fs::fchown(
            &fd,
            Some(rustix::fs::Uid::from_raw(uid)),
            Some(rustix::fs::Gid::from_raw(gid)),
        )
        .map_err(errno)?;
    }
    Ok(fd)
}
