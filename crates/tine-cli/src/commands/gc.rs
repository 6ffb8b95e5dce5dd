//! `tine gc`: retention, sweep and compaction, with the stat caches and process
//! state of removed snapshots (the engine's `gc`).

use tine_store::GcOptions;

use crate::emit;
use crate::output::{CliError, plural, size};

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

pub fn run(
    repo_path: &std::path::Path,
    json: bool,
    ctx: &tine_engine::Ctx<'_>,
    a: Args,
) -> Result<(), CliError> {
    let Args {
        keep_last,
        dry_run,
        no_compact,
    } = a;
    let opts = GcOptions {
        keep_last,
        dry_run,
        compact: !no_compact,
    };
    let out = crate::commands::local_engine(repo_path)?.gc(&opts, ctx)?;
    let (r, caches, procs) = (
        &out.report,
        &out.stat_caches_removed,
        &out.process_states_removed,
    );
    let doc = serde_json::to_value(&out).unwrap_or_default();
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
