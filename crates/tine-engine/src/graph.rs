//! Graph checkpoints for an agent framework's checkpointer (LangGraph's,
//! `tine.langgraph`): stored in the repository (`tine_store::graph`), each
//! root checkpoint of a thread bound to a sandbox paired with a snapshot of
//! that sandbox, taken as it is stored; loading an earlier one to run from
//! it (`rewind`) rolls the sandbox back to its snapshot; a copy of a thread
//! forks its sandbox; deleting a thread removes what only it held.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use tine_store::graph::{GraphCheckpoint, GraphQuery, GraphWrite, ThreadBinding, Typed};
use tine_store::{ErrorKind, HasKind, ObjectId, now_ns};

use crate::{Ctx, Engine, EngineError, ForkRequest, SnapshotRequest};

impl From<tine_store::graph::GraphError> for EngineError {
    fn from(e: tine_store::graph::GraphError) -> EngineError {
        EngineError::Reported {
            kind: e.kind(),
            message: e.to_string(),
        }
    }
}

/// A checkpoint to store in a thread.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GraphPut {
    #[serde(default)]
    pub ns: String,
    pub id: String,
    #[serde(default)]
    pub parent: Option<String>,
    pub checkpoint: Typed,
    pub metadata: Typed,
    /// Top-level metadata keys whose values are JSON, as canonical JSON.
    #[serde(default)]
    pub filter: BTreeMap<String, String>,
    #[serde(default)]
    pub run_id: Option<String>,
    /// The sandbox the thread acts in (name or id), bound to the thread
    /// from now on; none: the one it is bound to, if any.
    #[serde(default)]
    pub sandbox: Option<String>,
}

/// What storing a checkpoint did.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GraphPutOutcome {
    /// The sandbox snapshotted with it (root checkpoints of a bound thread).
    pub sandbox: Option<String>,
    pub snapshot: Option<ObjectId>,
    /// The snapshot's own time, ms.
    pub snapshot_ms: f64,
}

/// A checkpoint with the writes of the tasks run from it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GraphTuple {
    #[serde(flatten)]
    pub checkpoint: GraphCheckpoint,
    pub writes: Vec<GraphWrite>,
    /// Loaded to run from (`rewind`): the thread's sandbox rolled back to
    /// the checkpoint's snapshot, and how long that paused it (ms); none
    /// when it was there already or has no sandbox.
    #[serde(default)]
    pub rewound: Option<f64>,
}

/// A page of checkpoints, and where the next one starts.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GraphPage {
    pub checkpoints: Vec<GraphTuple>,
    pub next: Option<(String, String, String)>,
}

/// Writes of one task run from a checkpoint.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GraphWrites {
    #[serde(default)]
    pub ns: String,
    pub checkpoint: String,
    pub task: String,
    #[serde(default)]
    pub task_path: String,
    pub writes: Vec<TaskWrite>,
}

/// One write of a task.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskWrite {
    pub idx: i64,
    pub channel: String,
    pub value: Typed,
}

/// What a thread's removal, copy or pruning did.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct GraphChange {
    /// Checkpoints removed or copied.
    pub checkpoints: usize,
    /// The sandbox removed with a thread (one made for it), or made for a
    /// copy (a fork of the source's).
    pub sandbox: Option<String>,
}

/// The most writes one request stores.
pub const MAX_WRITES: usize = 10_000;

impl Engine {
    /// Stores checkpoint `req` in `thread`. A root checkpoint of a thread
    /// bound to a sandbox (or given one) snapshots that sandbox first; the
    /// snapshot is paired with it and the sandbox is at it from then on.
    pub fn graph_put(
        &self,
        thread: &str,
        req: &GraphPut,
        ctx: &Ctx<'_>,
    ) -> Result<GraphPutOutcome, EngineError> {
        tine_store::graph::check_name("thread", thread, false)?;
        let repo = self.open()?;
        let bound = repo.graph_thread(thread)?;
        let sandbox = match (&req.sandbox, &bound) {
            (Some(sb), _) => Some(repo.sandbox(sb)?),
            (None, Some(b)) => repo.sandbox(&b.sandbox).ok(),
            (None, None) => None,
        };
        drop(repo);
        let mut out = GraphPutOutcome {
            sandbox: sandbox.as_ref().map(|s| s.name.clone()),
            snapshot: None,
            snapshot_ms: 0.0,
        };
        if let Some(sb) = sandbox.as_ref().filter(|_| req.ns.is_empty()) {
            let snap = self.snapshot_sandbox(
                &sb.id,
                &SnapshotRequest {
                    message: format!("graph thread {thread}: checkpoint {}", req.id),
                    ..Default::default()
                },
                ctx,
            )?;
            out.snapshot = Some(snap.outcome.id);
            out.snapshot_ms = snap.duration_ms;
        }
        let repo = self.open()?;
        let lock = ctx.lock(&repo)?;
        lock.put_graph_checkpoint(&GraphCheckpoint {
            thread: thread.to_string(),
            ns: req.ns.clone(),
            id: req.id.clone(),
            parent: req.parent.clone(),
            checkpoint: req.checkpoint.clone(),
            metadata: req.metadata.clone(),
            filter: req.filter.clone(),
            run_id: req.run_id.clone(),
            sandbox: sandbox.as_ref().map(|s| s.id.clone()),
            snapshot: out.snapshot,
            created_ns: now_ns(),
        })?;
        if let Some(sb) = &sandbox {
            let at = match &out.snapshot {
                Some(_) => Some((req.ns.clone(), req.id.clone())),
                None => bound.as_ref().and_then(|b| b.at.clone()),
            };
            let owned = bound
                .as_ref()
                .is_some_and(|b| b.owned && b.sandbox == sb.id);
            lock.bind_graph_thread(&ThreadBinding {
                thread: thread.to_string(),
                sandbox: sb.id.clone(),
                owned,
                at,
            })?;
        }
        Ok(out)
    }

    /// Checkpoint `id` of `thread` in `ns` (none: its latest there), with
    /// its writes. With `rewind`, a root checkpoint asked for by id that
    /// holds a snapshot rolls the thread's sandbox back to it, unless the
    /// sandbox is at it already.
    pub fn graph_get(
        &self,
        thread: &str,
        ns: &str,
        id: Option<&str>,
        rewind: bool,
        ctx: &Ctx<'_>,
    ) -> Result<Option<GraphTuple>, EngineError> {
        let repo = self.open()?;
        let Some(c) = repo.graph_checkpoint(thread, ns, id)? else {
            return Ok(None);
        };
        let writes = repo.graph_writes(thread, ns, &c.id)?;
        let bound = repo.graph_thread(thread)?;
        drop(repo);
        let mut rewound = None;
        let here = Some((ns.to_string(), c.id.clone()));
        if let (true, Some(_), Some(snap), Some(b)) =
            (rewind && ns.is_empty(), id, c.snapshot, &bound)
            && b.at != here
        {
            let done = self.restore_sandbox(&b.sandbox, &snap.to_hex(), false, ctx)?;
            rewound = Some(done.frozen.paused_ms);
            let repo = self.open()?;
            ctx.lock(&repo)?.bind_graph_thread(&ThreadBinding {
                at: here,
                ..b.clone()
            })?;
        }
        Ok(Some(GraphTuple {
            checkpoint: c,
            writes,
            rewound,
        }))
    }

    /// The checkpoints `q` asks for, with their writes, a page at a time.
    pub fn graph_list(&self, q: &GraphQuery) -> Result<GraphPage, EngineError> {
        let repo = self.open()?;
        let (found, more) = repo.graph_list(q)?;
        let next = found
            .last()
            .filter(|_| more)
            .map(|c| (c.thread.clone(), c.ns.clone(), c.id.clone()));
        let checkpoints = found
            .into_iter()
            .map(|c| {
                let writes = repo.graph_writes(&c.thread, &c.ns, &c.id)?;
                Ok(GraphTuple {
                    checkpoint: c,
                    writes,
                    rewound: None,
                })
            })
            .collect::<Result<_, EngineError>>()?;
        Ok(GraphPage { checkpoints, next })
    }

    /// Stores the writes of a task run from a checkpoint of `thread`.
    pub fn graph_put_writes(
        &self,
        thread: &str,
        req: &GraphWrites,
        ctx: &Ctx<'_>,
    ) -> Result<(), EngineError> {
        if req.writes.len() > MAX_WRITES {
            return Err(EngineError::Invalid {
                message: format!(
                    "{} writes in one request, over the limit of {MAX_WRITES}",
                    req.writes.len()
                ),
            });
        }
        let writes: Vec<GraphWrite> = req
            .writes
            .iter()
            .map(|w| GraphWrite {
                task: req.task.clone(),
                idx: w.idx,
                channel: w.channel.clone(),
                value: w.value.clone(),
                task_path: req.task_path.clone(),
            })
            .collect();
        let repo = self.open()?;
        ctx.lock(&repo)?
            .put_graph_writes((thread, &req.ns, &req.checkpoint), &writes)?;
        Ok(())
    }

    /// Removes `thread`'s checkpoints and writes, and the sandbox made for
    /// it (a copy's fork); a sandbox it was only bound to stays.
    pub fn graph_delete_thread(
        &self,
        thread: &str,
        ctx: &Ctx<'_>,
    ) -> Result<GraphChange, EngineError> {
        let repo = self.open()?;
        let (checkpoints, bound) = ctx.lock(&repo)?.delete_graph_thread(thread)?;
        drop(repo);
        let sandbox = match bound.filter(|b| b.owned) {
            Some(b) => match self.remove_sandbox(&b.sandbox, true) {
                Ok(r) => Some(r.name),
                Err(e) if e.kind() == ErrorKind::NotFound => None,
                Err(e) => return Err(e),
            },
            None => None,
        };
        Ok(GraphChange {
            checkpoints,
            sandbox,
        })
    }

    /// Copies `from`'s checkpoints and writes to thread `to`. A source
    /// bound to a sandbox gets the copy a sandbox of its own: a fork of the
    /// snapshot of its latest root checkpoint that has one, bound to `to`
    /// at that checkpoint, and removed with it.
    pub fn graph_copy_thread(
        &self,
        from: &str,
        to: &str,
        ctx: &Ctx<'_>,
    ) -> Result<GraphChange, EngineError> {
        if from == to {
            return Err(EngineError::Invalid {
                message: format!("copy of thread {from:?} onto itself"),
            });
        }
        let repo = self.open()?;
        let lock = ctx.lock(&repo)?;
        let checkpoints = lock.copy_graph_thread(from, to)?;
        let bound = repo.graph_thread(from)?;
        let paired = repo
            .graph_list(&GraphQuery {
                thread: Some(from.to_string()),
                ns: Some(String::new()),
                ..Default::default()
            })?
            .0
            .into_iter()
            .find_map(|c| c.snapshot.map(|s| (c.id, s)));
        drop(lock);
        drop(repo);
        let (Some(_), Some((id, snap))) = (bound, paired) else {
            return Ok(GraphChange {
                checkpoints,
                sandbox: None,
            });
        };
        let forked = self.fork(&snap.to_hex(), &ForkRequest::default(), ctx)?;
        let Some(sb) = forked.sandboxes.first() else {
            return Err(EngineError::Internal {
                message: format!("the fork of thread {from:?}'s sandbox made none"),
            });
        };
        let repo = self.open()?;
        ctx.lock(&repo)?.bind_graph_thread(&ThreadBinding {
            thread: to.to_string(),
            sandbox: sb.id.clone(),
            owned: true,
            at: Some((String::new(), id)),
        })?;
        Ok(GraphChange {
            checkpoints,
            sandbox: Some(sb.name.clone()),
        })
    }

    /// Removes the checkpoints (and their writes) of runs `run_ids`.
    pub fn graph_delete_runs(
        &self,
        run_ids: &[String],
        ctx: &Ctx<'_>,
    ) -> Result<GraphChange, EngineError> {
        let repo = self.open()?;
        let checkpoints = ctx.lock(&repo)?.delete_graph_runs(run_ids)?;
        Ok(GraphChange {
            checkpoints,
            sandbox: None,
        })
    }

    /// Removes the checkpoints of `threads` but (`keep_latest`) the latest
    /// of each namespace; their sandboxes stay bound.
    pub fn graph_prune(
        &self,
        threads: &[String],
        keep_latest: bool,
        ctx: &Ctx<'_>,
    ) -> Result<GraphChange, EngineError> {
        let repo = self.open()?;
        let checkpoints = ctx.lock(&repo)?.prune_graph(threads, keep_latest)?;
        Ok(GraphChange {
            checkpoints,
            sandbox: None,
        })
    }
}
