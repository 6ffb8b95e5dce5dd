//! `tine fork`: a snapshot into N directories, or into N sandboxes (through the engine).

use std::path::PathBuf;
use std::time::Instant;

use super::Cx;
use crate::output::{CliError, duration, plural, size};
use crate::{emit, emit_timed, render, warn_all, write_lock};

#[derive(clap::Args, Debug)]
pub struct Args {
    pub snapshot: String,
    #[arg(short = 'n', long, default_value_t = 1)]
    pub count: usize,
    /// Fork into directories DIR/1 .. DIR/N (default: into N new sandboxes).
    #[arg(long, value_name = "DIR")]
    pub into: Option<PathBuf>,
    /// With --into: give files their set-user-ID/set-group-ID bits
    /// (dropped by default, and each such file named).
    #[arg(long, requires = "into")]
    pub keep_setuid: bool,
    /// Sandboxes are named PREFIX-1 .. PREFIX-N (default: their ids).
    #[arg(long, value_name = "PREFIX", conflicts_with = "into")]
    pub name: Option<String>,
    /// Create the sandboxes without starting them.
    #[arg(long, conflicts_with = "into")]
    pub no_start: bool,
    /// Start the command afresh in each fork, even when the snapshot
    /// holds its sandbox's processes (which forks otherwise get: cloned
    /// from the live templates, or through CRIU images).
    #[arg(long, conflicts_with = "into")]
    pub files_only: bool,
    /// Bring the processes through CRIU images even where they can be
    /// cloned natively (for comparison; needs CRIU).
    #[arg(long, conflicts_with = "files_only")]
    pub through_criu: bool,
    /// The command the sandboxes run (default: that of the snapshot's sandbox).
    #[arg(last = true, value_name = "CMD")]
    pub command: Vec<String>,
}

pub fn run(cx: &Cx<'_>, a: Args) -> Result<(), CliError> {
    let Args {
        snapshot,
        count: n,
        into,
        keep_setuid,
        name,
        no_start,
        files_only,
        through_criu,
        command,
    } = a;
    let json = cx.json;
    let Some(into) = into else {
        if let super::Route::Local(p) = &cx.route
            && super::local_engine(p)?
                .is_attached_checkpoint(&snapshot)
                .unwrap_or(false)
        {
            return Err(CliError::new(
                tine_store::ErrorKind::InvalidInput,
                "a checkpoint of an attached process forks into directories beside it: give --into DIR (each copy its own DIR/K)",
            ));
        }
        let req = tine_engine::ForkRequest {
            n: Some(n),
            name,
            command,
            no_start,
            files_only,
            through_criu,
        };
        let out = cx.ops()?.fork(&snapshot, &req, &cx.ctx)?;
        if !json && let Some(note) = &out.note {
            eprintln!("note: {note}");
        }
        let doc = serde_json::to_value(&out).unwrap_or_default();
        emit(json, doc.clone(), || render::fork(&doc));
        return Ok(());
    };
    let engine = super::local_engine(cx.local("fork --into DIR")?)?;
    if engine.is_attached_checkpoint(&snapshot)? {
        let out = engine.fork_attached(&snapshot, &into, n, &cx.ctx)?;
        emit(json, serde_json::to_value(&out).unwrap_or_default(), || {
            let mut s = format!(
                "forked {} of an attached process into {} in {:.1} ms\n",
                &out.snapshot[..12],
                plural(n as u64, "copy"),
                out.duration_ms
            );
            for f in &out.forks {
                s += &format!(
                    "  {} (process {}) in {}\n",
                    f.name,
                    f.pid,
                    f.workspace.display()
                );
            }
            s
        });
        return Ok(());
    }
    let id = cx.resolve(&snapshot)?;
    let lock = write_lock(cx.repo()?, cx.no_wait)?;
    let t0 = Instant::now();
    let opts = tine_fs::RestoreOptions {
        keep_setuid,
        ..Default::default()
    };
    let out = tine_fs::fork(&lock, &id, &into, n, opts, cx.bars)?;
    let took = t0.elapsed();
    warn_all(json, &out.warnings);
    emit_timed(json, &out, took, || {
        let mut s = format!(
            "forked {} into {} ({}, {} and {} each) in {}\n",
            id.short(),
            plural(n as u64, "directory"),
            out.method,
            plural(out.files, "file"),
            size(out.bytes_per_fork),
            duration(took)
        );
        for d in &out.dirs {
            s += &format!("  {}\n", d.display());
        }
        s
    });
    Ok(())
}
