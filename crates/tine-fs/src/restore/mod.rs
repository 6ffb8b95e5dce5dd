//! Differential, in-place restore of a snapshot into a directory.
//!
//! 1. Plan: scan the target (stat cache, nothing stored), compare with the
//!    snapshot's tree, and list the operations. Decoding every tree needed here
//!    refuses names that could escape the target (`..`, `/`, NUL).
//! 2. Verify: read and hash every object the plan will write, before touching
//!    anything, so damaged data fails the restore instead of being written.
//!    Of an existing file rewritten in place, the chunks it holds already
//!    (hashed where they lie in the file) are neither read nor written.
//! 3. Apply: removals, then directories and symlinks, then file contents (in
//!    parallel), then directory modes. Every path is opened relative to its parent
//!    directory's descriptor with `O_NOFOLLOW`, so a symlink in the target can
//!    never redirect a write outside it. Existing files are rewritten in place
//!    (same inode), so open descriptors see the restored content — except
//!    files with more than one link, which are replaced by a new file, so a
//!    hard link never carries a write (or a mode) to another name.
//!
//! This file: the options, errors, outcome and entry points; `plan` finds
//! what differs, `fsops` are the descriptor-relative file operations, `apply`
//! runs a plan.

mod apply;
mod fsops;
mod plan;
use apply::*;
use fsops::*;
use plan::*;

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
    Content, ErrorKind, HasKind, Kind, Node, ObjectError, ObjectId, Owner, Progress, Repository,
    Tree, TreeEntry, WriteError, WriteLock,
};

use crate::IdMap;

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
    /// A sandbox's ID range: every entry gets the owner the snapshot
    /// records for it, as the host sees it (created ones at creation, others
    /// changed where they differ). `None`: what the restore creates belongs
    /// to whoever restores and owners are left as they are.
    pub owners: Option<IdMap>,
}

impl RestoreOptions {
    /// Exactly what was stored, modes included, owned by whoever restores:
    /// for the repository's own directories (only its owner reaches them)
    /// and for a merge's result (which becomes a snapshot).
    pub const FAITHFUL: RestoreOptions = RestoreOptions {
        keep_setuid: true,
        owners: None,
    };

    /// What a sandbox's own view gets: modes as stored (its mounts are
    /// `nosuid`, its directories private), owners as recorded, in `owners`.
    pub fn sandbox(owners: Option<IdMap>) -> RestoreOptions {
        RestoreOptions {
            owners,
            ..Self::FAITHFUL
        }
    }

    /// The host's (uid, gid) for a recorded owner, if owners are restored.
    fn host(&self, owner: Owner) -> Option<(u32, u32)> {
        self.owners.map(|m| m.host(owner))
    }

    /// Gives `name` in `pfd` (just made, or found with another owner) the
    /// owner recorded for it.
    fn own(&self, pfd: &OwnedFd, name: &[u8], owner: Owner) -> rustix::io::Result<()> {
        match self.host(owner) {
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

tine_store::from_io_at!(RestoreError, fn io_err);

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
#[derive(Debug, Clone, Default, Serialize, serde::Deserialize)]
pub struct RestoreOutcome {
    pub snapshot: Option<ObjectId>,
    pub target: PathBuf,
    pub added: u64,
    pub modified: u64,
    pub deleted: u64,
    pub mode_changed: u64,
    /// Entries whose owner alone was changed (restores with an ID range).
    #[serde(default)]
    pub owner_changed: u64,
    pub bytes_written: u64,
    /// Files in the target after the restore.
    pub files: u64,
    pub warnings: Vec<Warning>,
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
            owners: opts.owners,
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
