//! `tine snapshot`: a directory, or a running sandbox (files and processes, through the engine).

use std::path::PathBuf;
use std::time::Instant;

use tine_fs::SnapshotOptions;

use super::Cx;
use crate::output::{CliError, duration, plural, size};
use crate::{default_dir, emit, emit_timed, parse_attach, render, warn_all, write_lock};

#[derive(clap::Args, Debug)]
pub struct Args {
    pub path: Option<PathBuf>,
    #[arg(short, long, default_value = "")]
    pub message: String,
    /// Tag the new snapshot (repeatable).
    #[arg(long = "tag", value_name = "TAG")]
    pub tags: Vec<String>,
    /// Store a file with the snapshot under a name, e.g. --attach trace=chat.jsonl (repeatable).
    #[arg(long = "attach", value_name = "NAME=FILE")]
    pub attach: Vec<String>,
    /// Move tags that already exist.
    #[arg(long)]
    pub force: bool,
    /// Snapshot a running sandbox: its files and its processes (templates
    /// made by native fork; stopped while they fork and its changes are read).
    #[arg(long, value_name = "SB", conflicts_with_all = ["path", "attach"])]
    pub sandbox: Option<String>,
    /// With --sandbox: capture the files only, not the processes (for
    /// processes native fork cannot copy: several threads, live children).
    #[arg(long, requires = "sandbox")]
    pub files_only: bool,
    #[command(flatten)]
    pub pool: crate::commands::PoolArgs,
    /// With --sandbox: also persist the processes with CRIU into the
    /// repository (after they run on; takes seconds per GiB), so they
    /// can be restored after their templates were let go or a reboot.
    #[arg(long, requires = "sandbox", conflicts_with = "files_only")]
    pub persist: bool,
    /// With --sandbox: then prepare K native forks of the snapshot (after
    /// the sandbox runs on), so that a `tine fork` of it claims them
    /// instead of making them; replaces the sandbox's earlier ones. They
    /// hold their page tables and a place each until claimed, or until the
    /// sandbox ends.
    #[arg(
        long,
        value_name = "K",
        requires = "sandbox",
        conflicts_with = "files_only"
    )]
    pub prepare_forks: Option<usize>,
}

pub fn run(cx: &Cx<'_>, a: Args) -> Result<(), CliError> {
    let Args {
        path,
        message,
        tags,
        attach,
        force,
        sandbox,
        files_only,
        pool,
        persist,
        prepare_forks,
    } = a;
    let json = cx.json;
    if let Some(sb) = sandbox {
        let req = tine_engine::SnapshotRequest {
            message,
            tags,
            force,
            files_only,
            persist,
            prepare_forks: prepare_forks.unwrap_or(0),
        };
        let out = cx
            .ops_with(Some(pool))?
            .snapshot_sandbox(&sb, &req, &cx.ctx)?;
        warn_all(json, &out.outcome.warnings);
        let doc = serde_json::to_value(&out).unwrap_or_default();
        if !json {
            for note in render::evicted_notes(&doc) {
                eprintln!("note: {note}");
            }
        }
        emit(json, doc.clone(), || render::sandbox_snapshot(&doc));
        return Ok(());
    }
    let repo_path = cx.local("a snapshot of a directory (give --sandbox SB)")?;
    let mut opts = SnapshotOptions {
        message,
        tags,
        force_tags: force,
        attachments: vec![],
        parents: None,
        notes: vec![],
        ..Default::default()
    };
    let dir = path.unwrap_or_else(|| default_dir(repo_path));
    opts.attachments = attach
        .iter()
        .map(|a| parse_attach(a))
        .collect::<Result<Vec<_>, _>>()?;
    let lock = write_lock(cx.repo()?, cx.no_wait)?;
    let t0 = Instant::now();
    let out = tine_fs::snapshot(&lock, &dir, &opts, cx.bars)?;
    let took = t0.elapsed();
    warn_all(json, &out.warnings);
    emit_timed(json, &out, took, || {
        format!(
            "snapshot {}{}: {}, {}; read {} ({}), stored {} ({}) in {}\n",
            out.id.short(),
            out.parent
                .map(|p| format!(" (parent {})", p.short()))
                .unwrap_or_default(),
            plural(out.stats.files, "file"),
            size(out.stats.bytes),
            plural(out.stats.hashed_files, "file"),
            size(out.stats.hashed_bytes),
            plural(out.commit.new_objects, "new object"),
            size(out.commit.new_bytes),
            duration(took),
        )
    });
    Ok(())
}
