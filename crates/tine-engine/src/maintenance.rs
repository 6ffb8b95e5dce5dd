//! Keeping a repository in shape: `gc` (retention, sweep, compaction) with
//! what goes with the snapshots it removes (stat caches of vanished
//! directories, process templates and CRIU images).

use serde::Serialize;
use tine_store::{GcOptions, GcReport, ObjectId};

use crate::{Ctx, Engine, EngineError};

/// What `gc` did (or, on a dry run, would do).
#[derive(Debug, Clone, Serialize)]
pub struct GcResult {
    #[serde(flatten)]
    pub report: GcReport,
    /// Stat caches of directories that no longer exist (none on a dry run).
    pub stat_caches_removed: Vec<std::path::PathBuf>,
    /// Process state of removed snapshots: templates' records, CRIU images.
    pub process_states_removed: tine_sandbox::processes::Pruned,
}

impl Engine {
    /// Removes unreferenced data (with `keep_last`, old snapshots too) and
    /// what only those snapshots held.
    pub fn gc(&self, opts: &GcOptions, ctx: &Ctx<'_>) -> Result<GcResult, EngineError> {
        let repo = self.open()?;
        let lock = ctx.lock(&repo)?;
        let report = tine_store::gc(&lock, opts, ctx.progress)?;
        // Stat caches of directories that no longer exist only take space.
        let stat_caches_removed = if opts.dry_run {
            Vec::new()
        } else {
            tine_fs::prune_caches(&repo).map_err(|source| EngineError::File {
                path: repo.cache_dir().display().to_string(),
                step: "gc: prune stat caches",
                source,
            })?
        };
        // Process state of the snapshots gc removed. (On a dry run the
        // removed snapshots are still there.)
        let process_states_removed = tine_sandbox::processes::prune(
            repo.path(),
            |hex| {
                ObjectId::from_hex(hex).is_some_and(|id| {
                    !report.snapshots_removed.contains(&id)
                        && repo.snapshot_info(&id).ok().flatten().is_some()
                })
            },
            opts.dry_run,
        );
        Ok(GcResult {
            report,
            stat_caches_removed,
            process_states_removed,
        })
    }
}
