//! The directory operations the CLI offers: snapshot, fork, and status/diff of a
//! live directory. Each takes the repository's write lock as proof of exclusivity.

use std::collections::HashMap;
use std::fs::{self, File};
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use rayon::prelude::*;
use serde::Serialize;
use tine_store::{
    Attachment, CommitStats, ErrorKind, HasKind, NewSnapshot, Node, ObjectError, ObjectId,
    Progress, Repository, Tree, WriteError, WriteLock,
};

use crate::diff::{Change, Trees, diff_trees};
use crate::paths::join;
use crate::restore::{RestoreError, RestoreOptions, RestoreOutcome, restore_with};
use crate::scan::{Scan, ScanConfig, ScanError, ScanStats, Warning, scan, store_file};
use crate::statcache::{StatCache, cache_path};

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error(transparent)]
    Scan(#[from] ScanError),
    #[error(transparent)]
    Write(#[from] WriteError),
    #[error(transparent)]
    Object(#[from] ObjectError),
    #[error("invalid attachment name {name:?}: {reason}")]
    BadAttachment { name: String, reason: &'static str },
    #[error("cannot resolve {path}: {source}")]
    Resolve { path: PathBuf, source: io::Error },
    /// The change tracker vouched for a directory whose remembered merge no longer
    /// applies; the caller takes the snapshot again without tracking.
    #[error(
        "the change tracker's view of {upper} is out of date at {rel}; take it again with a full scan"
    )]
    TrackerStale { upper: PathBuf, rel: String },
    /// The caller saw the workspace change while it was read; nothing was stored.
    #[error("{} changed while it was read (a process joined the sandbox); take the snapshot again", upper.display())]
    Interfered { upper: PathBuf },
}

impl HasKind for SnapshotError {
    fn kind(&self) -> ErrorKind {
        match self {
            SnapshotError::Scan(e) => e.kind(),
            SnapshotError::Write(e) => e.kind(),
            SnapshotError::Object(e) => e.kind(),
            SnapshotError::BadAttachment { .. } => ErrorKind::InvalidInput,
            SnapshotError::Resolve { source, .. } if source.kind() == io::ErrorKind::NotFound => {
                ErrorKind::NotFound
            }
            SnapshotError::Resolve { .. } => ErrorKind::Io,
            SnapshotError::TrackerStale { .. } | SnapshotError::Interfered { .. } => {
                ErrorKind::Internal
            }
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct SnapshotOptions {
    pub message: String,
    pub tags: Vec<String>,
    pub force_tags: bool,
    /// (name, file) pairs stored with the snapshot.
    pub attachments: Vec<(String, PathBuf)>,
    /// Parents to record instead of the directory's head (a merge has two).
    pub parents: Option<Vec<ObjectId>>,
    /// (name, bytes) pairs stored with the snapshot like attachments (the
    /// ledger head of a sandbox snapshot).
    pub notes: Vec<(String, Vec<u8>)>,
    /// Record owners as this ID range sees them (an image's root
    /// filesystem: `IdMap::IDENTITY`); `None` records 0:0.
    pub owners: Option<crate::IdMap>,
    /// Record no directory head (a scratch directory's snapshot, kept by
    /// what refers to it: an image's layers).
    pub detached: bool,
}

/// The attachments and notes of a snapshot, stored in `pack`.
pub(crate) fn store_attachments(
    opts: &SnapshotOptions,
    pack: &tine_store::PackBuilder<'_>,
) -> Result<Vec<Attachment>, SnapshotError> {
    let mut out = Vec::new();
    for (name, path) in &opts.attachments {
        let (content, size) = store_file(path, pack)?;
        out.push(Attachment {
            name: name.clone(),
            content,
            size,
        });
    }
    for (name, bytes) in &opts.notes {
        let (content, size) = crate::scan::store_bytes(name, bytes, pack)?;
        out.push(Attachment {
            name: name.clone(),
            content,
            size,
        });
    }
    Ok(out)
}

#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct SnapshotOutcome {
    pub id: ObjectId,
    pub tree: ObjectId,
    pub parent: Option<ObjectId>,
    pub source: PathBuf,
    pub stats: ScanStats,
    pub commit: CommitStats,
    pub warnings: Vec<Warning>,
}

/// The canonical form of a directory path, its key for heads and stat caches.
fn resolve_dir(dir: &Path) -> Result<PathBuf, SnapshotError> {
    fs::canonicalize(dir).map_err(|source| SnapshotError::Resolve {
        path: dir.to_path_buf(),
        source,
    })
}

fn repo_exclude(repo: &Repository) -> Option<(u64, u64)> {
    fs::metadata(repo.path()).ok().map(|m| (m.dev(), m.ino()))
}

/// Snapshots directory `dir`: only files whose stat changed since the last scan are read.
pub fn snapshot(
    lock: &WriteLock<'_>,
    dir: &Path,
    opts: &SnapshotOptions,
    progress: &dyn Progress,
) -> Result<SnapshotOutcome, SnapshotError> {
    let repo = lock.repo();
    let dir = resolve_dir(dir)?;
    // Fail before the scan, not after it.
    repo.check_new_tags(&opts.tags, opts.force_tags)?;
    let mut names = std::collections::HashSet::new();
    for (name, _) in &opts.attachments {
        if name.is_empty() || name.len() > 200 || name.contains(['/', '\0']) {
            return Err(SnapshotError::BadAttachment {
                name: name.clone(),
                reason: "use 1 to 200 characters, no '/'",
            });
        }
        if !names.insert(name) {
            return Err(SnapshotError::BadAttachment {
                name: name.clone(),
                reason: "given twice",
            });
        }
    }
    let key = dir.to_string_lossy().into_owned();
    let cpath = cache_path(repo, &dir);
    let generation = repo.gc_generation()?;
    let cache = StatCache::load(&cpath, repo.repo_id(), generation);
    let pack = lock.pack()?;
    let s = scan(
        &dir,
        ScanConfig {
            sink: Some(&pack),
            cache: &cache,
            exclude: repo_exclude(repo),
            progress,
            keep_trees: false,
            overlay_upper: false,
            unchanged: None,
            owners: opts.owners,
        },
    )?;
    let attachments = store_attachments(opts, &pack)?;
    let parent = if opts.detached {
        None
    } else {
        repo.head(&key)?
    };
    let new_snapshot = NewSnapshot {
        tree: s.root,
        parents: opts
            .parents
            .clone()
            .unwrap_or_else(|| parent.into_iter().collect()),
        message: opts.message.clone(),
        source: key.clone(),
        tags: opts.tags.clone(),
        attachments,
        files: s.stats.files,
        bytes: s.stats.bytes,
        head: (!opts.detached).then_some(key),
        force_tags: opts.force_tags,
    };
    // The next stat cache is encoded and written while the commit waits on fsync,
    // but renamed into place only after the commit: it must only name stored objects.
    let unchanged =
        s.stats.hashed_files == 0 && !cache.needs_validation && s.cache.len() == cache.len();
    let (commit, pending) = std::thread::scope(|sc| {
        let writer = (!unchanged).then(|| {
            sc.spawn(|| {
                StatCache::write_pending(&cpath, &s.cache.encode(repo.repo_id(), generation, &dir))
            })
        });
        let commit = lock.commit(pack, Some(new_snapshot));
        (commit, writer.and_then(|w| w.join().ok()))
    });
    let commit = commit?;
    if let Some(Ok(p)) = pending {
        let _ = p.persist();
    }
    Ok(SnapshotOutcome {
        id: commit.snapshot.expect("commit with a snapshot"),
        tree: s.root,
        parent,
        source: dir,
        stats: s.stats,
        commit,
        warnings: s.warnings,
    })
}

/// Scans `dir` without storing anything (for diff against the live directory).
pub fn scan_only(
    repo: &Repository,
    dir: &Path,
    progress: &dyn Progress,
) -> Result<Scan, SnapshotError> {
    let dir = resolve_dir(dir)?;
    let cache = StatCache::load(
        &cache_path(repo, &dir),
        repo.repo_id(),
        repo.gc_generation()?,
    );
    Ok(scan(
        &dir,
        ScanConfig {
            sink: None,
            cache: &cache,
            exclude: repo_exclude(repo),
            progress,
            keep_trees: true,
            overlay_upper: false,
            unchanged: None,
            owners: None,
        },
    )?)
}

/// Changes from snapshot `a` to the live directory `dir`.
pub fn diff_with_dir(
    repo: &Repository,
    a: &ObjectId,
    dir: &Path,
    progress: &dyn Progress,
) -> Result<Vec<Change>, SnapshotError> {
    let s = scan_only(repo, dir, progress)?;
    let tree = repo.read_snapshot(a)?.tree;
    Ok(diff_trees(
        &Trees::new(repo, Some(&s.trees)),
        &tree,
        &s.root,
    )?)
}

#[derive(Debug, thiserror::Error)]
pub enum ForkError {
    #[error("fork count must be at least 1")]
    ZeroCount,
    #[error("{path} exists and is not empty; choose another --into directory")]
    NotEmpty { path: PathBuf },
    #[error(transparent)]
    Restore(#[from] RestoreError),
    #[error("fork into {path} failed ({step}): {source}")]
    Io {
        step: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error(transparent)]
    Object(#[from] ObjectError),
    #[error(transparent)]
    Write(#[from] WriteError),
}

impl HasKind for ForkError {
    fn kind(&self) -> ErrorKind {
        match self {
            ForkError::ZeroCount => ErrorKind::InvalidInput,
            ForkError::NotEmpty { .. } => ErrorKind::AlreadyExists,
            ForkError::Restore(e) => e.kind(),
            ForkError::Io { .. } => ErrorKind::Io,
            ForkError::Object(e) => e.kind(),
            ForkError::Write(e) => e.kind(),
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ForkOutcome {
    pub snapshot: ObjectId,
    pub dirs: Vec<PathBuf>,
    /// "reflink" when every file was cloned, else "copy".
    pub method: &'static str,
    pub files: u64,
    pub bytes_per_fork: u64,
    /// What the first copy's restore reported (every copy has the same).
    pub warnings: Vec<Warning>,
}

/// Materializes snapshot `snap` into `into/1` .. `into/N`: the first from the
/// store, the others cloned from it (reflink where the filesystem can, else copy).
pub fn fork(
    lock: &WriteLock<'_>,
    snap: &ObjectId,
    into: &Path,
    n: usize,
    opts: RestoreOptions,
    progress: &dyn Progress,
) -> Result<ForkOutcome, ForkError> {
    if n == 0 {
        return Err(ForkError::ZeroCount);
    }
    fs::create_dir_all(into).map_err(|source| ForkError::Io {
        step: "create",
        path: into.to_path_buf(),
        source,
    })?;
    let dirs: Vec<PathBuf> = (1..=n).map(|i| into.join(i.to_string())).collect();
    for d in &dirs {
        if let Ok(mut rd) = fs::read_dir(d)
            && rd.next().is_some()
        {
            return Err(ForkError::NotEmpty { path: d.clone() });
        }
    }
    let first: RestoreOutcome = restore_with(lock, snap, &dirs[0], opts, progress)?;
    let repo = lock.repo();
    let tree = repo.read_snapshot(snap)?.tree;
    let trees = Trees::new(repo, None);
    let mut entries = Vec::new();
    flatten(&trees, &tree, &[], &mut entries)?;
    for (_, kind, mode) in &mut entries {
        if matches!(kind, FlatKind::File(..)) {
            *mode = opts.file_mode(*mode);
        }
    }
    let all_reflinked = AtomicBool::new(true);
    let mut out_dirs = vec![first.target.clone()];
    progress.start("forking", (n as u64 - 1) * entries.len() as u64);
    for d in &dirs[1..] {
        fs::create_dir_all(d).map_err(|source| ForkError::Io {
            step: "create",
            path: d.clone(),
            source,
        })?;
        let d = fs::canonicalize(d).map_err(|source| ForkError::Io {
            step: "resolve",
            path: d.clone(),
            source,
        })?;
        clone_into(&first.target, &d, &entries, &all_reflinked, progress)?;
        lock.set_head(&d.to_string_lossy(), snap)?;
        out_dirs.push(d);
    }
    progress.finish();
    let bytes_per_fork = entries
        .iter()
        .map(|e| match e.1 {
            FlatKind::File(s, _) => s,
            _ => 0,
        })
        .sum();
    Ok(ForkOutcome {
        snapshot: *snap,
        dirs: out_dirs,
        method: if n > 1 && all_reflinked.load(Ordering::Relaxed) {
            "reflink"
        } else {
            "copy"
        },
        files: first.files,
        bytes_per_fork,
        warnings: first.warnings,
    })
}

#[derive(Debug, Clone)]
enum FlatKind {
    Dir,
    File(u64, tine_store::Content),
    Symlink(Vec<u8>),
}

fn flatten(
    trees: &Trees<'_>,
    tree: &ObjectId,
    prefix: &[u8],
    out: &mut Vec<(Vec<u8>, FlatKind, u32)>,
) -> Result<(), ObjectError> {
    let t: Tree = trees.load(tree)?.into_owned();
    for e in &t.entries {
        let p = join(prefix, &e.name);
        match &e.node {
            Node::Dir { tree } => {
                out.push((p.clone(), FlatKind::Dir, e.mode));
                flatten(trees, tree, &p, out)?;
            }
            Node::File { size, content } => out.push((p, FlatKind::File(*size, *content), e.mode)),
            Node::Symlink { target } => out.push((p, FlatKind::Symlink(target.clone()), e.mode)),
        }
    }
    Ok(())
}

/// Copies the (trusted, just materialized) tree at `src` into the empty `dst`.
fn clone_into(
    src: &Path,
    dst: &Path,
    entries: &[(Vec<u8>, FlatKind, u32)],
    reflinked: &AtomicBool,
    progress: &dyn Progress,
) -> Result<(), ForkError> {
    use std::os::unix::ffi::OsStrExt;
    let p = |base: &Path, rel: &[u8]| base.join(std::ffi::OsStr::from_bytes(rel));
    let ioe =
        |step: &'static str, path: PathBuf| move |source| ForkError::Io { step, path, source };
    for (rel, kind, _) in entries {
        match kind {
            FlatKind::Dir => {
                fs::create_dir(p(dst, rel)).map_err(ioe("create directory", p(dst, rel)))?
            }
            FlatKind::Symlink(t) => {
                std::os::unix::fs::symlink(std::ffi::OsStr::from_bytes(t), p(dst, rel))
                    .map_err(ioe("create symlink", p(dst, rel)))?
            }
            FlatKind::File(..) => {}
        }
    }
    crate::scan::in_pool(|| {
        entries
            .par_iter()
            .filter(|e| matches!(e.1, FlatKind::File(..)))
            .try_for_each(|(rel, _, mode)| {
                let (s, d) = (p(src, rel), p(dst, rel));
                let sf = File::open(&s).map_err(ioe("open", s.clone()))?;
                let df = fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(&d)
                    .map_err(ioe("create", d.clone()))?;
                if reflinked.load(Ordering::Relaxed) && rustix::fs::ioctl_ficlone(&df, &sf).is_ok()
                {
                    // Cloned: shares extents with the first fork until either is written.
                } else {
                    reflinked.store(false, Ordering::Relaxed);
                    crate::sparse::copy(&sf, &df).map_err(ioe("copy", d.clone()))?;
                }
                rustix::fs::fchmod(&df, rustix::fs::Mode::from_raw_mode(*mode)).map_err(|e| {
                    ForkError::Io {
                        step: "chmod",
                        path: d.clone(),
                        source: e.into(),
                    }
                })?;
                progress.advance(1);
                Ok::<(), ForkError>(())
            })
    })?;
    // Directory modes last, deepest first, so read-only directories can be filled.
    for (rel, kind, mode) in entries.iter().rev() {
        if matches!(kind, FlatKind::Dir) {
            fs::set_permissions(
                p(dst, rel),
                std::os::unix::fs::PermissionsExt::from_mode(*mode),
            )
            .map_err(ioe("chmod", p(dst, rel)))?;
        }
    }
    let root_mode = fs::metadata(src)
        .map(|m| m.mode() & 0o7777)
        .unwrap_or(0o755);
    fs::set_permissions(dst, std::os::unix::fs::PermissionsExt::from_mode(root_mode))
        .map_err(ioe("chmod", dst.to_path_buf()))?;
    Ok(())
}

/// Reads a whole stored file's content into memory.
pub fn read_content(
    repo: &Repository,
    content: &tine_store::Content,
) -> Result<Vec<u8>, ObjectError> {
    let mut v = Vec::new();
    repo.write_content(content, &mut v, Path::new("<memory>"))?;
    Ok(v)
}

/// Map of every file path in a tree to its content (for tests and tools).
pub fn list_files(
    repo: &Repository,
    tree: &ObjectId,
) -> Result<HashMap<Vec<u8>, tine_store::Content>, ObjectError> {
    let mut out = Vec::new();
    flatten(&Trees::new(repo, None), tree, &[], &mut out)?;
    Ok(out
        .into_iter()
        .filter_map(|(p, k, _)| match k {
            FlatKind::File(_, c) => Some((p, c)),
            _ => None,
        })
        .collect())
}
