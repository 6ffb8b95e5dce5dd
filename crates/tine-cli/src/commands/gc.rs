//! `tine gc`: retention, sweep and compaction, with the stat caches and process state of removed snapshots.

use serde_json::json;
use tine_store::{ErrorKind, GcOptions, ObjectId};

use super::Cx;
use crate::output::{CliError, plural, size};
use crate::{emit, write_lock};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Keep the N newest snapshots (tagged snapshots and directory heads are always kept).
    #[arg(long, value_name = "N")]
    pub keep_last: Option<usize>,
    #[arg(long)]
    pub dry_run: bool,
    /// Do not recompress the packs snapshots wrote (gc compacts them by default:
    /// about 15 % smaller for text, costs seconds of CPU per 50 MB).
    #[arg(long)]
    pub no_compact: bool,
}

pub fn run(cx: &Cx<'_>, a: Args) -> Result<(), CliError> {
    let Args {
        keep_last,
        dry_run,
        no_compact,
    } = a;
    let json = cx.json;
    let repo = cx.repo;
    let lock = write_lock(repo, cx.no_wait)?;
    let opts = GcOptions {
        keep_last,
        dry_run,
        compact: !no_compact,
    };
    let r = tine_store::gc(&lock, &opts, cx.bars)?;
    // Stat caches of directories that no longer exist only take space.
    let caches = if dry_run {
        Vec::new()
    } else {
        tine_fs::prune_caches(lock.repo()).map_err(|e| {
            CliError::new(
                ErrorKind::Io,
                format!(
                    "gc: pruning stat caches in {}: {e}",
                    lock.repo().cache_dir().display()
                ),
            )
        })?
    };
    // Process state of snapshots gc removed: templates and CRIU images.
    let procs = tine_sandbox::processes::prune(
        lock.repo().path(),
        // (On a dry run the removed snapshots are still there.)
        |hex| {
            ObjectId::from_hex(hex).is_some_and(|id| {
                !r.snapshots_removed.contains(&id)
                    && lock.repo().snapshot_info(&id).ok().flatten().is_some()
            })
        },
        dry_run,
    );
    let mut doc = serde_json::to_value(&r).unwrap_or_default();
    doc["stat_caches_removed"] = json!(caches);
    doc["process_states_removed"] = json!(procs);
    emit(json, doc, || {
        let verb = if dry_run { "would remove" } else { "removed" };
        let caches = if caches.is_empty() {
            String::new()
        } else {
            format!(
                "; {} of vanished directories",
                plural(caches.len() as u64, "stat cache")
            )
        };
        let caches = if procs.records + procs.image_dirs == 0 {
            caches
        } else {
            format!(
                "{caches}; {} of removed snapshots, {} of CRIU images ({})",
                plural(procs.records as u64, "process-state record"),
                plural(procs.image_dirs as u64, "directory"),
                size(procs.image_bytes)
            )
        };
        let rewritten = if dry_run { "to rewrite" } else { "rewritten" };
        format!(
            "{verb} {}, {}, {} and {}; {} {rewritten} ({} compacted); store {} -> {}{caches}\n",
            plural(r.snapshots_removed.len() as u64, "snapshot"),
            plural(r.objects_removed, "object"),
            plural(r.packs_removed, "pack"),
            plural(r.leftover_files_removed.len() as u64, "leftover file"),
            plural(r.packs_rewritten, "pack"),
            r.packs_compacted,
            size(r.bytes_before),
            size(r.bytes_after)
        )
    });
    Ok(())
}
