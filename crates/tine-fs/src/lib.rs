//! tine-fs: file trees to and from directories. Scanning with a persisted stat
//! cache, differential in-place restore, diff, and fork.
#![forbid(unsafe_code)]

pub mod diff;
pub mod layered;
pub mod merge;
pub mod ops;
pub mod owners;
pub mod paths;
pub mod restore;
pub mod scan;
pub mod sparse;
pub mod statcache;

pub use diff::{Change, ChangeKind, EntryInfo, Trees, diff_trees, text_diff};
pub use layered::{DirtySet, Layered, Stamp, Tracked, layered_tree, snapshot_layered};
pub use merge::{Conflict, ConflictKind, MergeError, MergeOutcome, common_ancestor, merge};
pub use ops::{
    ForkError, ForkOutcome, SnapshotError, SnapshotOptions, SnapshotOutcome, diff_with_dir, fork,
    read_content, scan_only, snapshot,
};
pub use owners::IdMap;
pub use restore::{
    RestoreError, RestoreOptions, RestoreOutcome, restore, restore_known, restore_with,
};
pub use scan::{ScanError, ScanStats, Warning};
pub use statcache::prune_caches;

/// Starts the worker threads scans and restores use, so that a later one
/// (under a frozen or stopped sandbox) does not pay for creating them:
/// those of [`on_pool`], or (`small`) the one of [`on_one_thread`].
pub fn warm_up(small: bool) {
    scan::warm_up(small);
}

/// Runs `f` on one of those threads. The scans and restores `f` makes then
/// start in place: without it, each hands its work to the pool and waits to
/// be woken, two wake-ups across CPUs (0.1-0.2 ms on a small VM) inside
/// whatever window the caller holds (a frozen sandbox).
pub fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    scan::in_pool(f)
}

/// [`on_pool`] for work known to be small (a few directories to read
/// and write), on a thread of its own that does it all in turn: the pool's
/// threads, idle again, spin for a while on CPUs the caller's pause needs.
pub fn on_one_thread<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    scan::in_one(f)
}

/// [`on_one_thread`] where `small`, else [`on_pool`].
pub fn on_pool_sized<R: Send>(small: bool, f: impl FnOnce() -> R + Send) -> R {
    if small { on_one_thread(f) } else { on_pool(f) }
}
