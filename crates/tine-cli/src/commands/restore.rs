//! `tine restore`: a directory or a running sandbox back to a snapshot (sandboxes through the engine).

use std::path::PathBuf;
use std::time::Instant;

use tine_store::ErrorKind;

use super::Cx;
use crate::output::{CliError, duration, size};
use crate::{emit, emit_timed, render, warn_all, write_lock};

#[derive(clap::Args, Debug)]
pub struct Args {
    pub snapshot: String,
    /// Target directory (default: the directory the snapshot was taken from).
    #[arg(long, value_name = "DIR")]
    pub to: Option<PathBuf>,
    /// Roll a sandbox back to the snapshot, in place while it runs; its
    /// processes too when the snapshot holds live templates of it.
    #[arg(long, value_name = "SB", conflicts_with = "to")]
    pub sandbox: Option<String>,
    /// Restore the files only; leave the running processes alone.
    #[arg(long)]
    pub files_only: bool,
    /// Give files their set-user-ID/set-group-ID bits (into a directory;
    /// dropped by default, and each such file named).
    #[arg(long, conflicts_with = "sandbox")]
    pub keep_setuid: bool,
}

pub fn run(cx: &Cx<'_>, a: Args) -> Result<(), CliError> {
    let Args {
        snapshot,
        to,
        sandbox,
        files_only,
        keep_setuid,
    } = a;
    let json = cx.json;
    let repo_path = cx.repo_path;
    let ctx = cx.ctx;
    let engine = crate::commands::local_engine(repo_path)?;
    // A snapshot of a sandbox goes back into that sandbox by default.
    let sandbox = match (&sandbox, &to) {
        (None, None) => engine.sandbox_of_snapshot(&snapshot)?.map(|r| r.id),
        _ => sandbox,
    };
    if let Some(sb) = sandbox {
        let out = engine.restore_sandbox(&sb, &snapshot, files_only, &ctx)?;
        warn_all(json, &out.outcome.warnings);
        let doc = serde_json::to_value(&out).unwrap_or_default();
        if !json && let Some(note) = render::let_go_note(&doc) {
            eprintln!("note: {note}");
        }
        emit(json, doc.clone(), || render::sandbox_restore(&doc));
        return Ok(());
    }
    let repo = cx.repo()?;
    let id = cx.resolve(&snapshot)?;
    let target = match to {
        Some(t) => t,
        None => {
            let source = repo.read_snapshot(&id)?.source;
            // A snapshot of a sandbox that is gone names no directory: its
            // source is `sandbox:ID`, which must not become ./sandbox:ID.
            if let Some(sb) = tine_engine::sandbox_id_of_source(&source) {
                return Err(CliError::new(
                    ErrorKind::NotFound,
                    format!(
                        "snapshot {} is of sandbox {sb}, which no longer exists: give --to DIR to restore its files into a directory, or `tine fork {}` to run it in a new sandbox",
                        id.short(),
                        id.short()
                    ),
                ));
            }
            PathBuf::from(source)
        }
    };
    let lock = write_lock(repo, cx.no_wait)?;
    let t0 = Instant::now();
    let opts = tine_fs::RestoreOptions {
        keep_setuid,
        ..Default::default()
    };
    let out = tine_fs::restore_with(&lock, &id, &target, opts, cx.bars)?;
    let took = t0.elapsed();
    warn_all(json, &out.warnings);
    emit_timed(json, &out, took, || {
        format!(
            "restored {} into {}: {} added, {} modified, {} deleted, {} mode changed ({} written) in {}\n",
            id.short(),
            out.target.display(),
            out.added,
            out.modified,
            out.deleted,
            out.mode_changed,
            size(out.bytes_written),
            duration(took)
        )
    });
    Ok(())
}
