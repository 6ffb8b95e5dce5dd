//! Scanning a directory into trees: a parallel walk, `.tineignore`, the stat cache,
//! and content-defined chunking of large files.

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use ignore::gitignore::{Gitignore, GitignoreBuilder};
use rayon::prelude::*;
use serde::Serialize;
use tine_store::{
    ChunkList, Content, HasKind, Kind, Node, ObjectId, PackBuilder, Progress, Tree, TreeEntry,
    WriteError,
};

use crate::paths::{inner_ancestors, join};
use crate::statcache::{CacheBuilder, CacheEntry, StatCache, StatKey};

/// Files larger than this are split into chunks; smaller ones are one blob.
pub const CHUNK_THRESHOLD: u64 = 1 << 20;
/// FastCDC parameters: small enough that a 1 MiB edit stores about 2 MiB.
pub const CHUNK_MIN: usize = 128 << 10;
pub const CHUNK_AVG: usize = 512 << 10;
pub const CHUNK_MAX: usize = 2 << 20;
/// Large files are read in segments of this size; one is hashed while the next is read.
const SEGMENT: usize = 32 << 20;
/// Directories of files only with fewer entries than this are scanned by one thread.
const SMALL_DIR: usize = 32;
/// Name of the per-directory ignore file (gitignore syntax).
pub const IGNORE_FILE: &str = ".tineignore";

#[derive(Debug, thiserror::Error)]
pub enum ScanError {
    #[error("{step} {}: {source}", crate::paths::shown(path))]
    Io {
        step: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("{path} is not a directory")]
    NotADirectory { path: PathBuf },
    #[error("storing {path}: {source}")]
    Store { path: PathBuf, source: WriteError },
    #[error(
        "{} is more than {max} directories deep; tine does not capture trees that deep \
         (move or remove what is below it)",
        crate::paths::shown(path),
        max = crate::paths::MAX_DEPTH
    )]
    TooDeep { path: PathBuf },
}

impl HasKind for ScanError {
    fn kind(&self) -> tine_store::ErrorKind {
        match self {
            ScanError::Io { source, .. } if source.kind() == io::ErrorKind::NotFound => {
                tine_store::ErrorKind::NotFound
            }
            ScanError::Io { .. } => tine_store::ErrorKind::Io,
            ScanError::NotADirectory { .. } | ScanError::TooDeep { .. } => {
                tine_store::ErrorKind::InvalidInput
            }
            ScanError::Store { source, .. } => source.kind(),
        }
    }
}

tine_store::from_io_at!(ScanError, fn io_err);

/// Something skipped or suspicious, reported but not fatal.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct Warning {
    pub path: String,
    pub message: String,
}

#[derive(Debug, Clone, Default, Serialize, serde::Deserialize)]
pub struct ScanStats {
    pub files: u64,
    pub dirs: u64,
    pub symlinks: u64,
    /// Total size of all files.
    pub bytes: u64,
    /// Files whose content was read (stat cache misses).
    pub hashed_files: u64,
    pub hashed_bytes: u64,
    pub skipped: u64,
}

#[derive(Debug, Default)]
struct Counters {
    files: AtomicU64,
    dirs: AtomicU64,
    symlinks: AtomicU64,
    bytes: AtomicU64,
    hashed_files: AtomicU64,
    hashed_bytes: AtomicU64,
    skipped: AtomicU64,
}

/// Says whether the directory at a relative path, with the given cached tree
/// id, is known unchanged.
pub type Unchanged<'a> = dyn Fn(&[u8], &ObjectId) -> bool + Sync + 'a;

/// What to scan with.
#[derive(Clone, Copy)]
pub struct ScanConfig<'a> {
    /// Where new objects go; `None` only computes ids (for diff and restore).
    pub sink: Option<&'a PackBuilder<'a>>,
    pub cache: &'a StatCache,
    /// (dev, ino) of a directory never to enter: the repository itself.
    pub exclude: Option<(u64, u64)>,
    pub progress: &'a dyn Progress,
    /// Keep every directory's tree in [`Scan::trees`] (needed to diff or restore).
    pub keep_trees: bool,
    /// The directory is an overlay's upper layer: record whiteouts (0:0 character
    /// devices) and opaque directories instead of skipping or ignoring them.
    pub overlay_upper: bool,
    /// Directories (relative paths) known unchanged since `cache` was written: their
    /// tree ids and stat-cache entries are taken from the cache without reading them.
    /// Only directories with a cached tree id are skipped; they are listed in
    /// [`Scan::pruned`] and their trees are not in [`Scan::trees`].
    pub unchanged: Option<&'a Unchanged<'a>>,
    /// Record owners as this ID range's namespace sees them (a sandbox's
    /// files); `None` records 0:0 for every entry.
    pub owners: Option<crate::IdMap>,
}

impl std::fmt::Debug for ScanConfig<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScanConfig")
            .field("store", &self.sink.is_some())
            .field("exclude", &self.exclude)
            .finish()
    }
}

/// The result of a scan: the root tree id and every directory's tree.
#[derive(Debug, Default)]
pub struct Scan {
    pub root: ObjectId,
    pub trees: HashMap<ObjectId, Tree>,
    /// Trustworthy stat-cache entries for the next scan.
    pub cache: CacheBuilder,
    pub stats: ScanStats,
    pub warnings: Vec<Warning>,
    /// Names at the top level that were left out because they are the repository.
    pub excluded_root_names: Vec<Vec<u8>>,
    /// When the scan started (ns since the epoch).
    pub started_ns: i64,
    /// With `overlay_upper`: relative paths of whiteouts (deleted lower entries).
    pub whiteouts: Vec<Vec<u8>>,
    /// With `overlay_upper`: relative paths of opaque directories.
    pub opaque_dirs: Vec<Vec<u8>>,
    /// Directories not read because `unchanged` vouched for them. Their
    /// stat-cache entries are not in `cache`: see [`carry_over`].
    pub pruned: Vec<Vec<u8>>,
}

struct Walker<'a> {
    cfg: ScanConfig<'a>,
    started_ns: i64,
    counters: Counters,
    trees: Mutex<HashMap<ObjectId, Tree>>,
    cache_out: Mutex<CacheBuilder>,
    warnings: Mutex<Vec<Warning>>,
    excluded_root: Mutex<Vec<Vec<u8>>>,
    whiteouts: Mutex<Vec<Vec<u8>>>,
    opaque: Mutex<Vec<Vec<u8>>>,
    pruned: Mutex<Vec<Vec<u8>>>,
}

/// What the next stat cache should hold for a file.
enum Remember {
    Nothing,
    /// The loaded cache's entry at this position, unchanged.
    Raw(u32),
    New(CacheEntry),
}

#[derive(Clone, Default)]
struct IgnoreChain(Vec<Arc<Gitignore>>);

/// Where an ignore file is rooted, and how the paths it is asked about are
/// named: `/` and the path from the scan's root. Not the real paths: past
/// 2 KiB a directory is named through a descriptor of its own
/// (`/proc/self/fd/N`), and a pattern of a directory above must still match
/// below it.
fn logical(rel: &[u8]) -> PathBuf {
    let mut p = PathBuf::from("/");
    if !rel.is_empty() {
        p.push(std::ffi::OsStr::from_bytes(rel));
    }
    p
}

impl IgnoreChain {
    fn is_ignored(&self, path: &Path, is_dir: bool) -> bool {
        for gi in self.0.iter().rev() {
            let m = gi.matched(path, is_dir);
            if m.is_ignore() {
                return true;
            }
            if m.is_whitelist() {
                return false;
            }
        }
        false
    }
}

pub(crate) fn now_ns() -> i64 {
    tine_store::now_ns() as i64
}

/// The threads scans run on: rayon's, with stacks for the deepest tree
/// accepted (the global pool's 2 MiB overflow at about a thousand levels).
/// Made on first use, so a process that never scans never has them (one
/// that joins a sandbox's mount namespace must have no other thread).
fn walk_pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: std::sync::OnceLock<Option<rayon::ThreadPool>> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .stack_size(crate::paths::WALK_STACK)
            .thread_name(|i| format!("tine-walk-{i}"))
            .build()
            .ok()
    })
    .as_ref()
}

/// A pool like [`walk_pool`] of one thread, for work known to be small
/// inside a pause (a rollback's files when few directories changed): a
/// pool's idle threads spin (yielding) for about 0.3 ms after each burst
/// before they sleep, and [`walk_pool`]'s two, on the one CPU a paused
/// rollback leaves free, took turns there with each other.
fn one_pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: std::sync::OnceLock<Option<rayon::ThreadPool>> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .stack_size(crate::paths::WALK_STACK)
            .thread_name(|_| "tine-walk-one".into())
            .build()
            .ok()
    })
    .as_ref()
}

/// Starts [`one_pool`]'s thread (`small`) or [`walk_pool`]'s.
pub(crate) fn warm_up(small: bool) {
    if let Some(pool) = if small { one_pool() } else { walk_pool() } {
        pool.broadcast(|_| ());
    }
}

/// Runs `f` (parallel work of this crate) on [`walk_pool`]: one pool for
/// all of it. A second (rayon's global one) doubled the threads that spin
/// idle after each burst, on two cores taking turns from the caller.
pub(crate) fn in_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    run_on(walk_pool, f)
}

/// Runs `f` on [`one_pool`]'s thread: its parallel work there, in turn.
pub(crate) fn in_one<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    run_on(one_pool, f)
}

/// Runs `f` on `pool`, or in place on a pool's thread already (either).
fn run_on<R: Send>(
    pool: fn() -> Option<&'static rayon::ThreadPool>,
    f: impl FnOnce() -> R + Send,
) -> R {
    // (Asked first: a pool is made on first use.)
    if rayon::current_thread_index().is_some() {
        return f();
    }
    match pool() {
        Some(pool) => pool.install(f),
        None => f(),
    }
}

/// Scans `root` into trees, storing new objects in `cfg.sink` if given.
pub fn scan(root: &Path, cfg: ScanConfig<'_>) -> Result<Scan, ScanError> {
    let md = fs::metadata(root).map_err(io_err("open directory", root))?;
    if !md.is_dir() {
        return Err(ScanError::NotADirectory {
            path: root.to_path_buf(),
        });
    }
    let w = Walker {
        cfg,
        started_ns: now_ns(),
        counters: Counters::default(),
        trees: Mutex::new(HashMap::new()),
        cache_out: Mutex::new(CacheBuilder::default()),
        warnings: Mutex::new(Vec::new()),
        excluded_root: Mutex::new(Vec::new()),
        whiteouts: Mutex::new(Vec::new()),
        opaque: Mutex::new(Vec::new()),
        pruned: Mutex::new(Vec::new()),
    };
    cfg.progress.start("scanning", 0);
    let walk = || w.scan_dir(root, &[], &IgnoreChain::default());
    let root_id = in_pool(walk)?;
    cfg.progress.finish();
    let pruned = w.pruned.into_inner().unwrap_or_else(|e| e.into_inner());
    let cache = w.cache_out.into_inner().unwrap_or_else(|e| e.into_inner());
    let c = &w.counters;
    let mut warnings = w.warnings.into_inner().unwrap_or_else(|e| e.into_inner());
    warnings.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(Scan {
        root: root_id,
        trees: w.trees.into_inner().unwrap_or_else(|e| e.into_inner()),
        cache,
        stats: ScanStats {
            files: c.files.load(Ordering::Relaxed),
            dirs: c.dirs.load(Ordering::Relaxed),
            symlinks: c.symlinks.load(Ordering::Relaxed),
            bytes: c.bytes.load(Ordering::Relaxed),
            hashed_files: c.hashed_files.load(Ordering::Relaxed),
            hashed_bytes: c.hashed_bytes.load(Ordering::Relaxed),
            skipped: c.skipped.load(Ordering::Relaxed),
        },
        warnings,
        whiteouts: w.whiteouts.into_inner().unwrap_or_else(|e| e.into_inner()),
        opaque_dirs: w.opaque.into_inner().unwrap_or_else(|e| e.into_inner()),
        pruned,
        excluded_root_names: w
            .excluded_root
            .into_inner()
            .unwrap_or_else(|e| e.into_inner()),
        started_ns: w.started_ns,
    })
}

impl Walker<'_> {
    /// Leaves `path` out of the snapshot, and says why.
    fn skip(&self, path: &Path, message: impl Into<String>) {
        self.counters.skipped.fetch_add(1, Ordering::Relaxed);
        self.warn(path, message);
    }

    fn warn(&self, path: &Path, message: impl Into<String>) {
        self.warnings
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Warning {
                path: path.display().to_string(),
                message: message.into(),
            });
    }

    fn store(&self, kind: Kind, id: ObjectId, raw: &[u8], path: &Path) -> Result<(), ScanError> {
        if let Some(sink) = self.cfg.sink {
            sink.put_with_id(kind, id, raw)
                .map_err(|source| ScanError::Store {
                    path: path.to_path_buf(),
                    source,
                })?;
        }
        Ok(())
    }

    fn scan_dir(
        &self,
        abs: &Path,
        rel: &[u8],
        parent_ign: &IgnoreChain,
    ) -> Result<ObjectId, ScanError> {
        if crate::paths::depth(rel) > crate::paths::MAX_DEPTH {
            return Err(ScanError::TooDeep {
                path: abs.to_path_buf(),
            });
        }
        // Deep below the root, what is below is named through a descriptor.
        let anchor = crate::paths::Anchor::at(abs).map_err(io_err("open directory", abs))?;
        let abs = anchor.as_ref().map_or(abs, |a| a.path());
        self.counters.dirs.fetch_add(1, Ordering::Relaxed);
        let rd = fs::read_dir(abs).map_err(io_err("read directory", abs))?;
        let mut des = Vec::new();
        let mut has_ignore_file = false;
        for de in rd {
            let de = de.map_err(io_err("read directory", abs))?;
            if de.file_name().as_bytes() == IGNORE_FILE.as_bytes() {
                has_ignore_file = true;
            }
            des.push(de);
        }
        let mut ign = parent_ign.clone();
        if has_ignore_file {
            let mut b = GitignoreBuilder::new(logical(rel));
            let file = abs.join(IGNORE_FILE);
            if let Some(e) = b.add(&file) {
                self.warn(&file, format!("some patterns were not understood: {e}"));
            }
            match b.build() {
                Ok(gi) => ign.0.push(Arc::new(gi)),
                Err(e) => self.warn(&file, format!("ignored: {e}")),
            }
        }
        // A small directory of files only is cheaper to do in place than to split
        // into tasks; parallelism comes from its siblings.
        let has_subdirs = des
            .iter()
            .any(|de| de.file_type().is_ok_and(|t| t.is_dir()));
        let results: Vec<Result<Option<(TreeEntry, Remember)>, ScanError>> =
            if has_subdirs || des.len() >= SMALL_DIR {
                des.par_iter()
                    .map(|de| self.scan_entry(de, abs, rel, &ign))
                    .collect()
            } else {
                des.iter()
                    .map(|de| self.scan_entry(de, abs, rel, &ign))
                    .collect()
            };
        let (mut files, mut bytes) = (0u64, 0u64);
        let mut entries = Vec::with_capacity(results.len());
        let mut cache = CacheBuilder::default();
        for r in results {
            if let Some((e, remember)) = r? {
                if let Node::File { size, .. } = &e.node {
                    files += 1;
                    bytes += size;
                }
                match remember {
                    Remember::Nothing => {}
                    Remember::Raw(at) => cache.push_raw(self.cfg.cache.raw(at)),
                    Remember::New(c) => cache.push(rel, &e.name, &c),
                }
                entries.push(e);
            }
        }
        // Counted once per directory: per-file atomics would bounce between cores.
        self.counters.files.fetch_add(files, Ordering::Relaxed);
        self.counters.bytes.fetch_add(bytes, Ordering::Relaxed);
        entries.sort_unstable_by(|a, b| a.name.cmp(&b.name));
        let tree = Tree { entries };
        let raw = tree.encode();
        let id = ObjectId::compute(Kind::Tree, &raw);
        if self.cfg.sink.is_some() {
            // Unchanged since the last snapshot: stored then, so no lookup needed.
            let known = !self.cfg.cache.needs_validation && self.cfg.cache.get_dir(rel) == Some(id);
            if !known {
                self.store(Kind::Tree, id, &raw, abs)?;
            }
            cache.push_dir(rel, id);
        }
        if !cache.is_empty() {
            self.cache_out
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .append(cache);
        }
        if self.cfg.keep_trees {
            self.trees
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(id, tree);
        }
        Ok(id)
    }

    fn scan_entry(
        &self,
        de: &fs::DirEntry,
        dir: &Path,
        rel: &[u8],
        ign: &IgnoreChain,
    ) -> Result<Option<(TreeEntry, Remember)>, ScanError> {
        let name = de.file_name().into_vec();
        // Built only when needed: most files are stat-cache hits and never opened.
        let path = || dir.join(std::ffi::OsStr::from_bytes(&name));
        let md = match de.metadata() {
            Ok(md) => md,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                self.skip(&path(), "vanished while scanning");
                return Ok(None);
            }
            Err(e) => return Err(io_err("stat", &path())(e)),
        };
        let ft = md.file_type();
        if !ign.0.is_empty()
            && ign.is_ignored(
                &logical(rel).join(std::ffi::OsStr::from_bytes(&name)),
                ft.is_dir(),
            )
        {
            return Ok(None);
        }
        let mode = md.mode() & 0o7777;
        let owner = self
            .cfg
            .owners
            .map_or(tine_store::Owner::ROOT, |m| m.inside(md.uid(), md.gid()));
        let mut remember = Remember::Nothing;
        let node = if ft.is_dir() {
            if self.cfg.exclude == Some((md.dev(), md.ino())) {
                if rel.is_empty() {
                    self.excluded_root
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(name);
                }
                return Ok(None);
            }
            let sub = join(rel, &name);
            if let Some(unchanged) = self.cfg.unchanged
                && let Some(tree) = self.cfg.cache.get_dir(&sub)
                && unchanged(&sub, &tree)
            {
                self.pruned
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(sub);
                return Ok(Some((
                    TreeEntry {
                        name,
                        mode,
                        owner,
                        node: Node::Dir { tree },
                    },
                    Remember::Nothing,
                )));
            }
            if self.cfg.overlay_upper && is_opaque(&path()) {
                self.opaque
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(sub.clone());
            }
            Node::Dir {
                tree: self.scan_dir(&path(), &sub, ign)?,
            }
        } else if ft.is_symlink() {
            self.counters.symlinks.fetch_add(1, Ordering::Relaxed);
            let p = path();
            let target = fs::read_link(&p).map_err(io_err("read symlink", &p))?;
            Node::Symlink {
                target: target.into_os_string().into_vec(),
            }
        } else if ft.is_file() {
            let key = StatKey::of(&md);
            let (content, size, r) = self.file_content(rel, &name, &path, key)?;
            remember = r;
            Node::File { content, size }
        } else if self.cfg.overlay_upper && is_whiteout(&md) {
            self.whiteouts
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(join(rel, &name));
            return Ok(None);
        } else {
            self.skip(
                &path(),
                format!(
                    "skipped: {} (only files, directories and symlinks are captured)",
                    special_kind(&ft)
                ),
            );
            return Ok(None);
        };
        Ok(Some((
            TreeEntry {
                name,
                mode,
                owner,
                node,
            },
            remember,
        )))
    }

    fn file_content(
        &self,
        rel: &[u8],
        name: &[u8],
        path: &dyn Fn() -> PathBuf,
        key: StatKey,
    ) -> Result<(Content, u64, Remember), ScanError> {
        if let Some((hit, at)) = self.cfg.cache.get(rel, name)
            && hit.stat == key
            && hit.content.kind != Kind::Tree
        {
            let still_stored = match (self.cfg.sink, self.cfg.cache.needs_validation) {
                (Some(sink), true) => {
                    sink.contains(&hit.content.id)
                        .map_err(|source| ScanError::Store {
                            path: path(),
                            source,
                        })?
                }
                _ => true,
            };
            if still_stored {
                // Stored entries were not racy then, so they are not racy now.
                return Ok((hit.content, key.size, Remember::Raw(at)));
            }
        }
        let p = path();
        let (content, size, after) = self.hash_file(&p)?;
        self.counters.hashed_files.fetch_add(1, Ordering::Relaxed);
        self.counters
            .hashed_bytes
            .fetch_add(size, Ordering::Relaxed);
        self.cfg.progress.advance(size);
        let remember = match after {
            Some(stat) if !stat.is_racy(self.started_ns) => {
                Remember::New(CacheEntry { stat, content })
            }
            _ => Remember::Nothing,
        };
        Ok((content, size, remember))
    }

    /// Reads and hashes one file. Returns the stat to cache, or `None` if the file
    /// changed while it was read (then it must be read again next time).
    fn hash_file(&self, path: &Path) -> Result<(Content, u64, Option<StatKey>), ScanError> {
        let mut file = open_regular(path)?;
        let md = file.metadata().map_err(io_err("stat", path))?;
        let before = StatKey::of(&md);
        let store = |k, id, raw: &[u8]| self.store(k, id, raw, path);
        let (content, size) = if is_sparse(&md) {
            store_sparse(&file, md.len(), path, &store)?
        } else {
            store_reader(&mut file, path, &store)?
        };
        let after = StatKey::of(&file.metadata().map_err(io_err("stat", path))?);
        if after != before || after.size != size {
            self.warn(
                path,
                "changed while being read; the snapshot holds what was read",
            );
            return Ok((content, size, None));
        }
        Ok((content, size, Some(before)))
    }
}

/// Copies the loaded cache's entries at and below the `pruned` directories: they
/// still describe those unread directories.
pub fn carry_over(old: &StatCache, pruned: &[Vec<u8>], out: &mut CacheBuilder) {
    let set: std::collections::HashSet<&[u8]> = pruned.iter().map(|p| p.as_slice()).collect();
    for (path, raw) in old.entries_raw() {
        let under = set.contains(path) || inner_ancestors(path).any(|a| set.contains(a));
        if under {
            out.push_raw(raw);
        }
    }
}

/// overlayfs marks a deleted lower entry with a 0:0 character device.
pub fn is_whiteout(md: &fs::Metadata) -> bool {
    use std::os::unix::fs::FileTypeExt;
    md.file_type().is_char_device() && md.rdev() == 0
}

/// The xattr (value `y`) by which overlayfs marks a directory that hides the lower one.
pub const OPAQUE_XATTR: &str = "trusted.overlay.opaque";

/// Whether the directory at `path` is opaque (see [`OPAQUE_XATTR`]).
pub fn is_opaque(path: &Path) -> bool {
    let mut buf = [0u8; 4];
    rustix::fs::lgetxattr(path, OPAQUE_XATTR, &mut buf).is_ok_and(|n| &buf[..n] == b"y")
}

fn special_kind(ft: &fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if ft.is_socket() {
        "socket"
    } else if ft.is_fifo() {
        "named pipe"
    } else if ft.is_block_device() {
        "block device"
    } else if ft.is_char_device() {
        "character device"
    } else {
        "special file"
    }
}

/// Opens a regular file for reading without following symlinks and without
/// blocking (a FIFO swapped in after the `lstat` must not hang the scan).
pub fn open_regular(path: &Path) -> Result<File, ScanError> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags((rustix::fs::OFlags::NOFOLLOW | rustix::fs::OFlags::NONBLOCK).bits() as i32)
        .open(path)
        .map_err(io_err("open", path))?;
    let md = file.metadata().map_err(io_err("stat", path))?;
    if !md.is_file() {
        return Err(ScanError::Io {
            step: "open",
            path: path.to_path_buf(),
            source: io::Error::other("changed into a non-regular file while scanning"),
        });
    }
    Ok(file)
}

type StoreFn<'a> = dyn Fn(Kind, ObjectId, &[u8]) -> Result<(), ScanError> + Sync + 'a;

/// Hashes (and through `store`, stores) everything `r` yields: one blob up to
/// [`CHUNK_THRESHOLD`] bytes, otherwise FastCDC chunks and a chunk list.
pub fn store_reader(
    r: &mut (dyn Read + Send),
    path: &Path,
    store: &StoreFn<'_>,
) -> Result<(Content, u64), ScanError> {
    let mut head = Vec::new();
    r.take(CHUNK_THRESHOLD + 1)
        .read_to_end(&mut head)
        .map_err(io_err("read", path))?;
    if head.len() as u64 <= CHUNK_THRESHOLD {
        let id = ObjectId::compute(Kind::Blob, &head);
        store(Kind::Blob, id, &head)?;
        return Ok((
            Content {
                kind: Kind::Blob,
                id,
            },
            head.len() as u64,
        ));
    }
    let (chunks, total) = chunk_stream(r, head, path, store)?;
    chunk_list(
        ChunkList {
            size: total,
            chunks,
        },
        store,
    )
}

/// Stores `list` as the content of a large file.
fn chunk_list(list: ChunkList, store: &StoreFn<'_>) -> Result<(Content, u64), ScanError> {
    let raw = list.encode();
    let id = ObjectId::compute(Kind::Chunked, &raw);
    store(Kind::Chunked, id, &raw)?;
    Ok((
        Content {
            kind: Kind::Chunked,
            id,
        },
        list.size,
    ))
}

/// Cuts what `r` yields (after `cur`, read already) into FastCDC chunks,
/// hashing and storing each; the chunks and their total length.
fn chunk_stream(
    r: &mut (dyn Read + Send),
    cur: Vec<u8>,
    path: &Path,
    store: &StoreFn<'_>,
) -> Result<(Vec<(ObjectId, u32)>, u64), ScanError> {
    let mut chunks: Vec<(ObjectId, u32)> = Vec::new();
    let mut total: u64 = 0;
    let mut cur = cur;
    let mut eof = fill(r, &mut cur, SEGMENT).map_err(io_err("read", path))?;
    loop {
        let bounds: Vec<(usize, usize)> =
            fastcdc::v2020::FastCDC::new(&cur, CHUNK_MIN, CHUNK_AVG, CHUNK_MAX)
                .map(|c| (c.offset, c.length))
                .collect();
        // The last chunk may have been cut by the end of the buffer: carry it over.
        let complete = if eof {
            bounds.len()
        } else {
            bounds.len().saturating_sub(1)
        };
        let keep_from = if complete == bounds.len() {
            cur.len()
        } else {
            bounds[complete].0
        };
        let mut next = cur[keep_from..].to_vec();
        let (hashed, read) = rayon::join(
            || -> Result<Vec<(ObjectId, u32)>, ScanError> {
                bounds[..complete]
                    .par_iter()
                    .map(|&(off, len)| {
                        let data = &cur[off..off + len];
                        let id = ObjectId::compute(Kind::Blob, data);
                        store(Kind::Blob, id, data)?;
                        Ok((id, len as u32))
                    })
                    .collect()
            },
            || {
                if eof {
                    Ok(true)
                } else {
                    fill(r, &mut next, SEGMENT)
                }
            },
        );
        let hashed = hashed?;
        total += hashed.iter().map(|(_, l)| u64::from(*l)).sum::<u64>();
        chunks.extend(hashed);
        if eof {
            break;
        }
        eof = read.map_err(io_err("read", path))?;
        cur = next;
    }
    Ok((chunks, total))
}

/// Holes shorter than this are read as zeros with the data around them.
const MIN_HOLE: u64 = 1 << 20;
/// Data extents (after joining those less than [`MIN_HOLE`] apart) a
/// sparse file may have: a million pieces keep its chunk list well under
/// the store's largest object.
const MAX_EXTENTS: usize = 1 << 20;

/// Whether `md` describes a sparse file worth reading by its extents: over
/// [`CHUNK_THRESHOLD`] bytes with fewer blocks than its size needs.
pub fn is_sparse(md: &fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    md.len() > CHUNK_THRESHOLD && md.blocks().saturating_mul(512) < md.len()
}

/// Stores the sparse file `file` of `size` bytes by its extents
/// (`SEEK_DATA`/`SEEK_HOLE`): its data chunked as any file's, its holes as
/// hole pieces, so that a terabyte of apparent size costs what its data
/// costs, to read and to store.
pub fn store_sparse(
    file: &File,
    size: u64,
    path: &Path,
    store: &StoreFn<'_>,
) -> Result<(Content, u64), ScanError> {
    use rustix::fs::SeekFrom;
    let mut chunks: Vec<(ObjectId, u32)> = Vec::new();
    let hole = |chunks: &mut Vec<(ObjectId, u32)>, mut len: u64| {
        while len > 0 {
            let n = len.min(u64::from(u32::MAX));
            chunks.push((ChunkList::HOLE, n as u32));
            len -= n;
        }
    };
    // The data extents, holes under MIN_HOLE read as data (zeros): a file
    // of many small extents costs what a dense file does, never a list of
    // pieces larger than the store takes.
    let mut extents: Vec<(u64, u64)> = Vec::new();
    let mut pos = 0u64;
    while pos < size {
        let data = match rustix::fs::seek(file, SeekFrom::Data(pos)) {
            Ok(d) => d.min(size),
            // None past `pos`: the rest is a hole.
            Err(rustix::io::Errno::NXIO) => size,
            Err(e) => return Err(io_err("seek data in", path)(e.into())),
        };
        if data >= size {
            break;
        }
        let end = match rustix::fs::seek(file, SeekFrom::Hole(data)) {
            Ok(h) => h.min(size),
            Err(e) => return Err(io_err("seek hole in", path)(e.into())),
        };
        match extents.last_mut() {
            Some(last) if data - last.1 < MIN_HOLE => last.1 = end,
            _ => extents.push((data, end)),
        }
        if extents.len() > MAX_EXTENTS {
            return Err(io_err("read the extents of", path)(io::Error::other(
                format!(
                    "over {MAX_EXTENTS} data extents a MiB apart; a sparse file this fragmented is not snapshotted"
                ),
            )));
        }
        pos = end;
    }
    let mut pos = 0u64;
    for (data, end) in extents {
        hole(&mut chunks, data - pos);
        let mut range = ReadRange {
            file,
            at: data,
            end,
        };
        let (got, n) = chunk_stream(&mut range, Vec::new(), path, store)?;
        if n != end - data {
            // It shrank meanwhile: what was read is what is stored.
            chunks.extend(got);
            let size = chunks.iter().map(|(_, l)| u64::from(*l)).sum();
            return chunk_list(ChunkList { size, chunks }, store);
        }
        chunks.extend(got);
        pos = end;
    }
    // A hole up to `size` (none: a file that ends in data).
    hole(&mut chunks, size - pos);
    chunk_list(ChunkList { size, chunks }, store)
}

/// Bytes `at..end` of a file, read by position.
struct ReadRange<'f> {
    file: &'f File,
    at: u64,
    end: u64,
}

impl Read for ReadRange<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        use std::os::unix::fs::FileExt;
        let want = (self.end - self.at).min(buf.len() as u64) as usize;
        if want == 0 {
            return Ok(0);
        }
        let n = self.file.read_at(&mut buf[..want], self.at)?;
        self.at += n as u64;
        Ok(n)
    }
}

/// Reads until `buf` holds `target` bytes or the reader ends. Returns true at the end.
fn fill(r: &mut (dyn Read + Send), buf: &mut Vec<u8>, target: usize) -> io::Result<bool> {
    if buf.len() >= target {
        return Ok(false);
    }
    let want = (target - buf.len()) as u64;
    let n = r.take(want).read_to_end(buf)?;
    Ok((n as u64) < want)
}

/// Stores bytes as content (a snapshot's notes).
pub fn store_bytes(
    name: &str,
    bytes: &[u8],
    sink: &PackBuilder<'_>,
) -> Result<(Content, u64), ScanError> {
    let path = Path::new(name);
    store_reader(&mut &bytes[..], path, &|k, id, raw| {
        sink.put_with_id(k, id, raw)
            .map(|_| ())
            .map_err(|source| ScanError::Store {
                path: path.to_path_buf(),
                source,
            })
    })
}

/// Stores a file as content (used for attachments).
pub fn store_file(path: &Path, sink: &PackBuilder<'_>) -> Result<(Content, u64), ScanError> {
    let mut f = File::open(path).map_err(io_err("open", path))?;
    store_reader(&mut f, path, &|k, id, raw| {
        sink.put_with_id(k, id, raw)
            .map(|_| ())
            .map_err(|source| ScanError::Store {
                path: path.to_path_buf(),
                source,
            })
    })
}
