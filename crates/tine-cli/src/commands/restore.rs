//! `tine restore`: a directory or a running sandbox back to a snapshot (sandboxes through the engine).

use std::path::PathBuf;
use std::time::Instant;

use tine_store::{ErrorKind, HasKind};

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
    let ops = cx.ops()?;
    // A snapshot of a sandbox goes back into that sandbox by default; one of
    // a directory, into that directory.
    let (sandbox, source) = match (sandbox, &to) {
        (None, None) => {
            let d = ops.snapshot(&snapshot)?;
            match tine_engine::sandbox_id_of_source(&d.info.source) {
                Some(sb) => match ops.sandbox(sb) {
                    Ok(v) => (Some(v.id), None),
                    // Its source is `sandbox:ID`, which must not become ./sandbox:ID.
                    Err(e) if e.kind() == ErrorKind::NotFound => {
                        let id = d.info.id.short();
                        return Err(CliError::new(
                            ErrorKind::NotFound,
                            format!(
                                "snapshot {id} is of sandbox {sb}, which no longer exists: give --to DIR to restore its files into a directory, or `tine fork {id}` to run it in a new sandbox"
                            ),
                        ));
                    }
                    Err(e) => return Err(e.into()),
                },
                None => (None, Some(PathBuf::from(d.info.source))),
            }
        }
        (sb, _) => (sb, None),
    };
    if let Some(sb) = sandbox {
        let out = ops.restore_sandbox(&sb, &snapshot, files_only, &cx.ctx)?;
        warn_all(json, &out.outcome.warnings);
        let doc = serde_json::to_value(&out).unwrap_or_default();
        if !json && let Some(note) = render::let_go_note(&doc) {
            eprintln!("note: {note}");
        }
        emit(json, doc.clone(), || render::sandbox_restore(&doc));
        return Ok(());
    }
    cx.local(if to.is_some() {
        "restore --to DIR"
    } else {
        "restore of a directory's snapshot (give --sandbox SB)"
    })?;
    let repo = cx.repo()?;
    let id = cx.resolve(&snapshot)?;
    let target = match to.or(source) {
        Some(t) => t,
        None => unreachable!("a directory's snapshot names its directory"),
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
