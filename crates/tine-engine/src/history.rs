//! The operations on a sandbox's history that every client shares: snapshot,
//! restore, fork, diff (with patches) and merge (into a directory or a
//! running sandbox). The CLI, the CLI through a daemon and the daemon get
//! the same results from here, so they print the same JSON.

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use tine_fs::{Change, MergeOutcome, RestoreOutcome, SnapshotOutcome};
use tine_sandbox::manager::{self, ForkVia, Frozen, SandboxView};
use tine_store::{ErrorKind, ObjectId, Repository, SandboxRecord};

use crate::{Ctx, Engine, EngineError};

/// Options of a sandbox snapshot.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SnapshotRequest {
    pub message: String,
    pub tags: Vec<String>,
    /// Move tags that exist already.
    pub force: bool,
    /// Files only, not the processes.
    pub files_only: bool,
    /// Also persist the processes with CRIU.
    pub persist: bool,
    /// Then prepare this many native forks of it ahead of `tine fork`
    /// (`manager::prepared`), replacing the sandbox's earlier ones.
    pub prepare_forks: usize,
}

/// What a snapshot or restore of a sandbox did, with its timings (the JSON
/// of `tine snapshot --sandbox --json` and of the API).
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct SandboxOp<T> {
    #[serde(flatten)]
    pub outcome: T,
    #[serde(flatten)]
    pub frozen: Frozen,
    pub sandbox: String,
    /// The operation's own time (a preparation of forks after it apart).
    pub duration_ms: f64,
    /// The forks prepared after a snapshot (`prepare_forks`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prepared_forks: Option<manager::prepared::Prepared>,
}

/// Options of a fork into sandboxes.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ForkRequest {
    /// How many (default 1).
    pub n: Option<usize>,
    /// Names PREFIX-1 .. PREFIX-N (default: their ids).
    pub name: Option<String>,
    pub command: Vec<String>,
    pub no_start: bool,
    pub files_only: bool,
    pub through_criu: bool,
}

/// The most sandboxes one fork call makes.
pub const MAX_FORKS: usize = 256;

/// A fork: one entry per new sandbox.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct ForkResult {
    pub snapshot: ObjectId,
    pub sandboxes: Vec<SandboxView>,
    pub started: bool,
    pub processes: usize,
    pub via: ForkVia,
    pub persist_ms: f64,
    pub note: Option<String>,
    pub duration_ms: f64,
    /// Of the forks, how many were prepared ahead (`snapshot --prepare-forks`)
    /// and only claimed by this call.
    #[serde(default)]
    pub prepared: usize,
}

/// What to compare a snapshot with.
#[derive(Debug, Clone, Default)]
pub struct DiffRequest {
    /// Another snapshot; none: the live files the snapshot was taken of (a
    /// sandbox's, or `dir`).
    pub to: Option<String>,
    /// A host directory to compare with instead of the snapshot's source
    /// (local clients only: the daemon never reads host directories).
    pub dir: Option<PathBuf>,
    /// Unified diffs of text files, one per change.
    pub patch: bool,
}

/// A diff: the changes and, when asked for, one patch per change (empty for
/// changes without content, such as a mode change).
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct DiffResult {
    pub changes: Vec<Change>,
    pub patches: Option<Vec<String>>,
}

/// Where a merge's result goes.
#[derive(Debug, Clone)]
pub enum MergeInto {
    /// A new or empty host directory (local clients only).
    Dir(PathBuf),
    /// A running sandbox: its files are restored to the result, its
    /// processes run on.
    Sandbox(String),
}

/// A three-way merge of `theirs` into `ours` (`POST /v1/sandboxes/{sb}/merge`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MergeRequest {
    pub ours: String,
    pub theirs: String,
    /// The common ancestor (default: the nearest in the snapshot graph).
    #[serde(default)]
    pub base: Option<String>,
    /// The merge snapshot's message (default: "merge THEIRS into OURS").
    #[serde(default)]
    pub message: Option<String>,
}

/// What a merge did; `target` is the directory, or `/workspace` of the
/// sandbox named in `sandbox`. Conflicts are listed (their files hold
/// markers); the CLI exits 11 when there are any.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct MergeResult {
    #[serde(flatten)]
    pub outcome: MergeOutcome,
    pub sandbox: Option<String>,
    pub duration_ms: f64,
}

fn ms(t0: Instant) -> f64 {
    t0.elapsed().as_secs_f64() * 1e3
}

impl Engine {
    /// Snapshots a running sandbox: its files, and its processes unless
    /// `files_only`.
    pub fn snapshot_sandbox(
        &self,
        sb: &str,
        req: &SnapshotRequest,
        ctx: &Ctx<'_>,
    ) -> Result<SandboxOp<SnapshotOutcome>, EngineError> {
        if self.is_attached(sb) {
            if req.persist || req.prepare_forks > 0 || req.files_only {
                return Err(EngineError::Invalid {
                    message: format!(
                        "{sb} is an attached process: its checkpoints hold its process and files (no --persist, --prepare-forks or --files-only)"
                    ),
                });
            }
            return self.snapshot_attached(sb, req, ctx);
        }
        let repo = self.open()?;
        let rec = repo.sandbox(sb)?;
        let persist = if req.persist {
            let criu = self
                .config()
                .criu
                .clone()
                .ok_or_else(|| EngineError::Reported {
                    kind: ErrorKind::Unsupported,
                    message:
                        "persist: no CRIU (4.1 or later) is installed (scripts/install-criu.sh)"
                            .into(),
                })?;
            criu.check().map_err(|e| EngineError::Reported {
                kind: ErrorKind::Unsupported,
                message: e.to_string(),
            })?;
            Some(criu)
        } else {
            None
        };
        let procs = manager::ProcessOptions {
            files_only: req.files_only,
            pool: self.config().pool,
            persist,
        };
        let opts = tine_fs::SnapshotOptions {
            message: req.message.clone(),
            tags: req.tags.clone(),
            force_tags: req.force,
            attachments: vec![],
            parents: None,
            notes: vec![],
            ..Default::default()
        };
        if req.prepare_forks > MAX_FORKS {
            return Err(EngineError::Invalid {
                message: format!(
                    "prepare_forks: {} is over the limit of {MAX_FORKS}",
                    req.prepare_forks
                ),
            });
        }
        let lock = ctx.lock(&repo)?;
        let t0 = Instant::now();
        let (outcome, mut frozen, prep) =
            manager::snapshot(&lock, &rec, &opts, &procs, ctx.progress)?;
        let duration_ms = ms(t0);
        let prepared_forks = if req.prepare_forks > 0 {
            // Those it replaces make room first. The snapshot is made: what
            // stops the preparation is told with it, not as an error.
            manager::prepared::discard(&repo, &rec.id);
            let exe = &self.config().exe;
            let prepared = self
                .check_capacity(&repo, req.prepare_forks)
                .map_err(|e| e.to_string())
                .and_then(|()| {
                    manager::prepared::prepare(&lock, &outcome.id, req.prepare_forks, exe)
                        .map_err(|e| e.to_string())
                });
            Some(prepared.unwrap_or_else(|e| manager::prepared::Prepared {
                note: Some(format!("no forks were prepared: {e}")),
                ..Default::default()
            }))
        } else {
            None
        };
        // What the templates need for what comes next, once the forks
        // above are made from them: prepared by the sandbox's supervisor
        // after this call returns, or here where none takes it.
        frozen.preparing = !prep.is_empty();
        if let Err(prep) = prep.hand_off() {
            frozen.preparing = false;
            frozen.prepared_ms += prep.run().ms;
        }
        Ok(SandboxOp {
            outcome,
            frozen,
            sandbox: rec.name,
            duration_ms,
            prepared_forks,
        })
    }

    /// The sandbox a snapshot was taken of, while it exists.
    pub fn sandbox_of_snapshot(
        &self,
        snapshot: &str,
    ) -> Result<Option<SandboxRecord>, EngineError> {
        let repo = self.open()?;
        let id = repo.resolve(snapshot)?;
        Ok(manager::sandbox_of_source(
            &repo,
            &repo.read_snapshot(&id)?.source,
        ))
    }

    /// Rolls a running sandbox back to a snapshot, its processes too when
    /// the snapshot holds them (unless `files_only`).
    pub fn restore_sandbox(
        &self,
        sb: &str,
        snapshot: &str,
        files_only: bool,
        ctx: &Ctx<'_>,
    ) -> Result<SandboxOp<RestoreOutcome>, EngineError> {
        if self.is_attached(sb) {
            return self.restore_attached(sb, snapshot, files_only, ctx);
        }
        let repo = self.open()?;
        let rec = repo.sandbox(sb)?;
        let id = repo.resolve(snapshot)?;
        let lock = ctx.lock(&repo)?;
        let t0 = Instant::now();
        let (outcome, frozen) = manager::restore(
            &lock,
            &rec,
            &id,
            files_only,
            self.config().criu.as_ref(),
            ctx.progress,
        )?;
        Ok(SandboxOp {
            outcome,
            frozen,
            sandbox: rec.name,
            duration_ms: ms(t0),
            prepared_forks: None,
        })
    }

    /// Forks a snapshot into new sandboxes.
    pub fn fork(
        &self,
        snapshot: &str,
        req: &ForkRequest,
        ctx: &Ctx<'_>,
    ) -> Result<ForkResult, EngineError> {
        let n = req.n.unwrap_or(1);
        if n == 0 {
            return Err(EngineError::Invalid {
                message: "fork: n must be at least 1".into(),
            });
        }
        if n > MAX_FORKS {
            return Err(EngineError::Invalid {
                message: format!("fork: n = {n} is over the limit of {MAX_FORKS} per call"),
            });
        }
        let repo = self.open()?;
        let id = repo.resolve(snapshot)?;
        let opts = manager::ForkOptions {
            prefix: req.name.clone(),
            command: req.command.clone(),
            no_start: req.no_start,
            files_only: req.files_only,
            criu: self.config().criu.clone(),
            through_criu: req.through_criu,
            prepare: false,
        };
        let lock = ctx.lock(&repo)?;
        if !req.no_start && self.config().max_sandboxes.is_some() {
            // Prepared forks it claims hold their places already.
            let ready = manager::prepared::ready(&repo, &id);
            self.check_capacity(&repo, n.saturating_sub(ready))?;
        }
        let t0 = Instant::now();
        let forked = manager::fork(&lock, &id, n, &opts, &self.config().exe, ctx.progress)?;
        let duration_ms = ms(t0);
        drop(lock);
        Ok(ForkResult {
            snapshot: id,
            sandboxes: forked
                .records
                .iter()
                .map(|r| manager::view(&repo, r))
                .collect(),
            started: !req.no_start,
            processes: forked.processes,
            via: forked.via,
            persist_ms: forked.persist_ms,
            note: forked.note,
            duration_ms,
            prepared: forked.prepared,
        })
    }

    /// Changes from snapshot `a` to `req.to`, or to the live files it was
    /// taken of; with `req.patch`, unified diffs of the text files too.
    pub fn diff(
        &self,
        a: &str,
        req: &DiffRequest,
        ctx: &Ctx<'_>,
    ) -> Result<DiffResult, EngineError> {
        let repo = self.open()?;
        let ida = repo.resolve(a)?;
        let (changes, live) = match &req.to {
            Some(b) => {
                let idb = repo.resolve(b)?;
                let (ta, tb) = (
                    repo.read_snapshot(&ida)?.tree,
                    repo.read_snapshot(&idb)?.tree,
                );
                let trees = tine_fs::Trees::new(&repo, None);
                (tine_fs::diff_trees(&trees, &ta, &tb)?, None)
            }
            None => {
                let source = repo.read_snapshot(&ida)?.source;
                match (&req.dir, manager::sandbox_of_source(&repo, &source)) {
                    (None, Some(rec)) => {
                        let (c, d) = manager::diff_live(&repo, &rec, &ida, ctx.progress)?;
                        (c, Some(d))
                    }
                    (None, None) if manager::sandbox_id_of_source(&source).is_some() => {
                        return Err(EngineError::Invalid {
                            message: format!(
                                "snapshot {} is of a sandbox that no longer exists; give a second snapshot to compare with",
                                ida.short()
                            ),
                        });
                    }
                    (d, _) => {
                        let d = d.clone().unwrap_or_else(|| PathBuf::from(source));
                        (
                            tine_fs::diff_with_dir(&repo, &ida, &d, ctx.progress)?,
                            Some(d),
                        )
                    }
                }
            }
        };
        let patches = if req.patch {
            Some(
                changes
                    .iter()
                    .map(|c| patch(&repo, c, live.as_deref()))
                    .collect::<Result<Vec<_>, _>>()?,
            )
        } else {
            None
        };
        Ok(DiffResult { changes, patches })
    }

    /// Merges `req.theirs` into `req.ours` (three-way, against their
    /// nearest common ancestor or `req.base`) into a directory or a running
    /// sandbox, and snapshots the result.
    pub fn merge(
        &self,
        req: &MergeRequest,
        into: &MergeInto,
        ctx: &Ctx<'_>,
    ) -> Result<MergeResult, EngineError> {
        let repo = self.open()?;
        let (ours, theirs) = (repo.resolve(&req.ours)?, repo.resolve(&req.theirs)?);
        let base = req.base.as_deref().map(|b| repo.resolve(b)).transpose()?;
        let message = req
            .message
            .clone()
            .unwrap_or_else(|| format!("merge {} into {}", req.theirs, req.ours));
        let sandbox = match into {
            MergeInto::Sandbox(sb) => Some(repo.sandbox(sb)?),
            MergeInto::Dir(_) => None,
        };
        // Into a sandbox: merged in a scratch directory beside the
        // repository (never seen by the sandbox), then the sandbox's files
        // are restored to the result in place.
        let scratch = match &sandbox {
            Some(_) => Some(tine_store::staging::Staging::new(&repo, "merge").map_err(
                |source| EngineError::File {
                    path: repo.path().display().to_string(),
                    step: "make the merge's staging directory",
                    source,
                },
            )?),
            None => None,
        };
        let target = match (&scratch, into) {
            (Some(s), _) => s.path().join("result"),
            (None, MergeInto::Dir(d)) => d.clone(),
            (None, MergeInto::Sandbox(_)) => unreachable!("a sandbox has its scratch directory"),
        };
        let t0 = Instant::now();
        let mut outcome = {
            let lock = ctx.lock(&repo)?;
            tine_fs::merge(
                &lock,
                &ours,
                &theirs,
                base.as_ref(),
                &target,
                &message,
                ctx.progress,
            )?
        };
        if let Some(rec) = &sandbox {
            self.restore_sandbox(&rec.id, &outcome.snapshot.to_hex(), true, ctx)?;
            outcome.target = PathBuf::from(tine_sandbox::WORKSPACE);
        }
        drop(scratch);
        Ok(MergeResult {
            outcome,
            sandbox: sandbox.map(|r| r.name),
            duration_ms: ms(t0),
        })
    }
}

/// The unified diff of one change: the old side from the repository, the
/// new side from the repository or, for a live comparison, from `live`
/// (read inside it by the kernel, so a link planted there cannot lead a
/// daemon to a host file). Files over `MAX_TEXT_DIFF` are named, not read.
fn patch(repo: &Repository, c: &Change, live: Option<&Path>) -> Result<String, EngineError> {
    let too_big = |size: u64| size > tine_fs::diff::MAX_TEXT_DIFF as u64;
    let (old, new) = (c.old.as_ref(), c.new.as_ref());
    if old.is_some_and(|o| o.content.is_some() && o.size.is_some_and(too_big))
        || new.is_some_and(|n| n.content.is_some() && n.size.is_some_and(too_big))
    {
        return Ok(format!("Large file {} differs (not shown)\n", c.path));
    }
    let old = match old.and_then(|o| o.content.as_ref()) {
        Some(ct) => Some(tine_fs::read_content(repo, ct)?),
        None => None,
    };
    let new = match (new.and_then(|n| n.content.as_ref()), live) {
        (Some(_), Some(dir)) => {
            match crate::files::read(dir, &c.path, tine_fs::diff::MAX_TEXT_DIFF as u64) {
                Ok(v) => Some(v),
                // It grew since the diff looked.
                Err(EngineError::TooLarge { .. }) => {
                    return Ok(format!("Large file {} differs (not shown)\n", c.path));
                }
                Err(e) => return Err(e),
            }
        }
        (Some(ct), None) => Some(tine_fs::read_content(repo, ct)?),
        (None, _) => None,
    };
    Ok(if old.is_some() || new.is_some() {
        tine_fs::text_diff(&c.path, old.as_deref(), new.as_deref())
    } else {
        String::new()
    })
}
