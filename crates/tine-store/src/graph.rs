//! Graph checkpoints: the records an agent framework's checkpointer keeps
//! through the daemon (LangGraph's `BaseCheckpointSaver`: `tine.langgraph`),
//! by thread, namespace and checkpoint id, with the writes of the tasks run
//! from each, each checkpoint optionally paired with the snapshot of the
//! sandbox its graph acts in. Values are opaque to tine (the framework's
//! serializer's type name and bytes); metadata also comes as a map of
//! top-level keys to canonical JSON, which lists filter on. A thread may be
//! bound to a sandbox (`graph_threads`): the one its checkpoints snapshot,
//! and where it is now. See docs/FORMAT.md ("Graph checkpoints").

use std::collections::BTreeMap;

use rusqlite::{OptionalExtension, params};
use serde::{Deserialize, Serialize};

use crate::error::{ErrorKind, HasKind};
use crate::id::ObjectId;
use crate::repo::{Repository, WriteLock};

pub(crate) const GRAPH_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS graph_checkpoints (
    thread TEXT NOT NULL,
    ns TEXT NOT NULL,
    id TEXT NOT NULL,
    parent TEXT,
    checkpoint_type TEXT NOT NULL,
    checkpoint BLOB NOT NULL,
    metadata_type TEXT NOT NULL,
    metadata BLOB NOT NULL,
    filter TEXT NOT NULL,
    run_id TEXT,
    sandbox TEXT,
    snapshot BLOB,
    created_ns INTEGER NOT NULL,
    PRIMARY KEY (thread, ns, id)
);
CREATE INDEX IF NOT EXISTS graph_checkpoints_run ON graph_checkpoints(run_id);
CREATE TABLE IF NOT EXISTS graph_writes (
    thread TEXT NOT NULL,
    ns TEXT NOT NULL,
    checkpoint TEXT NOT NULL,
    task TEXT NOT NULL,
    idx INTEGER NOT NULL,
    channel TEXT NOT NULL,
    value_type TEXT NOT NULL,
    value BLOB NOT NULL,
    task_path TEXT NOT NULL,
    PRIMARY KEY (thread, ns, checkpoint, task, idx)
);
CREATE TABLE IF NOT EXISTS graph_threads (
    thread TEXT PRIMARY KEY,
    sandbox TEXT NOT NULL,
    owned INTEGER NOT NULL,
    at_ns TEXT,
    at_id TEXT
);
";

/// Longest thread id, namespace, checkpoint id, task id, channel or type
/// name taken, in bytes.
pub const MAX_NAME: usize = 4096;
/// Most checkpoints one list returns (a client pages with its cursor).
pub const MAX_LIST: usize = 1000;

/// What a graph store operation could not do.
#[derive(Debug, thiserror::Error)]
pub enum GraphError {
    #[error("graph checkpoint: {what} is empty or over {MAX_NAME} bytes, or holds a NUL")]
    BadName { what: &'static str },
    #[error("repository database ({step}): {source}")]
    Db {
        step: &'static str,
        source: rusqlite::Error,
    },
}

impl HasKind for GraphError {
    fn kind(&self) -> ErrorKind {
        match self {
            GraphError::BadName { .. } => ErrorKind::InvalidInput,
            GraphError::Db { source, .. } => crate::error::db_kind(source),
        }
    }
}

fn db(step: &'static str) -> impl FnOnce(rusqlite::Error) -> GraphError {
    move |source| GraphError::Db { step, source }
}

/// Checks a name the framework gives (`empty_ok`: the root namespace, a
/// task path).
pub fn check_name(what: &'static str, s: &str, empty_ok: bool) -> Result<(), GraphError> {
    if (s.is_empty() && !empty_ok) || s.len() > MAX_NAME || s.contains('\0') {
        return Err(GraphError::BadName { what });
    }
    Ok(())
}

/// A value as the framework's serializer made it: its type name and bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Typed {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(with = "b64")]
    pub data: Vec<u8>,
}

/// One checkpoint of a thread.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GraphCheckpoint {
    pub thread: String,
    pub ns: String,
    pub id: String,
    /// The checkpoint it was made from (the same thread and namespace).
    pub parent: Option<String>,
    pub checkpoint: Typed,
    pub metadata: Typed,
    /// Top-level metadata keys whose values are JSON, each as canonical
    /// JSON text: what lists filter on.
    pub filter: BTreeMap<String, String>,
    /// The run that made it (metadata `run_id`), for deletes by run.
    pub run_id: Option<String>,
    /// The sandbox snapshotted with it, and that snapshot.
    pub sandbox: Option<String>,
    pub snapshot: Option<ObjectId>,
    pub created_ns: u64,
}

/// One write of a task run from a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GraphWrite {
    pub task: String,
    /// Its place in the task's writes; negative for the framework's special
    /// channels (errors, interrupts), which a later write replaces.
    pub idx: i64,
    pub channel: String,
    pub value: Typed,
    pub task_path: String,
}

/// The sandbox a thread acts in, and the checkpoint it is at now (its last
/// snapshot, or the one it was rolled back to).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ThreadBinding {
    pub thread: String,
    pub sandbox: String,
    /// Made for the thread (a copy's fork): removed with it.
    pub owned: bool,
    pub at: Option<(String, String)>,
}

/// Which checkpoints a list returns: newest first within a thread and
/// namespace (by checkpoint id, which the framework makes time-ordered),
/// threads and namespaces in name order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GraphQuery {
    #[serde(default)]
    pub thread: Option<String>,
    #[serde(default)]
    pub ns: Option<String>,
    #[serde(default)]
    pub id: Option<String>,
    /// Only checkpoints whose id sorts before this one.
    #[serde(default)]
    pub before: Option<String>,
    /// Metadata keys and the canonical JSON their values must be.
    #[serde(default)]
    pub filter: BTreeMap<String, String>,
    #[serde(default)]
    pub limit: Option<usize>,
    /// Only checkpoints after this one in the listing order (thread,
    /// namespace, id): where the previous page ended.
    #[serde(default)]
    pub after: Option<(String, String, String)>,
}

const COLUMNS: &str = "thread, ns, id, parent, checkpoint_type, checkpoint, metadata_type, metadata, filter, run_id, sandbox, snapshot, created_ns";

fn from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<GraphCheckpoint> {
    let filter: String = r.get(8)?;
    let snapshot: Option<Vec<u8>> = r.get(11)?;
    Ok(GraphCheckpoint {
        thread: r.get(0)?,
        ns: r.get(1)?,
        id: r.get(2)?,
        parent: r.get(3)?,
        checkpoint: Typed {
            kind: r.get(4)?,
            data: r.get(5)?,
        },
        metadata: Typed {
            kind: r.get(6)?,
            data: r.get(7)?,
        },
        filter: serde_json::from_str(&filter).unwrap_or_default(),
        run_id: r.get(9)?,
        sandbox: r.get(10)?,
        snapshot: snapshot.and_then(|b| ObjectId::from_slice(&b)),
        created_ns: r.get::<_, i64>(12)? as u64,
    })
}

impl Repository {
    /// Checkpoint `id` of `thread` in `ns`, or (`id` none) its latest there.
    pub fn graph_checkpoint(
        &self,
        thread: &str,
        ns: &str,
        id: Option<&str>,
    ) -> Result<Option<GraphCheckpoint>, GraphError> {
        let conn = self.db();
        let found = match id {
            Some(id) => conn.query_row(
                &format!(
                    "SELECT {COLUMNS} FROM graph_checkpoints WHERE thread = ?1 AND ns = ?2 AND id = ?3"
                ),
                params![thread, ns, id],
                from_row,
            ),
            None => conn.query_row(
                &format!(
                    "SELECT {COLUMNS} FROM graph_checkpoints WHERE thread = ?1 AND ns = ?2 ORDER BY id DESC LIMIT 1"
                ),
                params![thread, ns],
                from_row,
            ),
        };
        found.optional().map_err(db("read graph checkpoint"))
    }

    /// The checkpoints `q` asks for, at most [`MAX_LIST`] (and its limit),
    /// and whether more follow.
    pub fn graph_list(&self, q: &GraphQuery) -> Result<(Vec<GraphCheckpoint>, bool), GraphError> {
        let mut sql = format!("SELECT {COLUMNS} FROM graph_checkpoints WHERE 1");
        let mut args: Vec<String> = Vec::new();
        let mut arg = |sql: &mut String, clause: &str, v: &str| {
            args.push(v.to_string());
            sql.push_str(&clause.replace('?', &format!("?{}", args.len())));
        };
        if let Some(t) = &q.thread {
            arg(&mut sql, " AND thread = ?", t);
        }
        if let Some(n) = &q.ns {
            arg(&mut sql, " AND ns = ?", n);
        }
        if let Some(i) = &q.id {
            arg(&mut sql, " AND id = ?", i);
        }
        if let Some(b) = &q.before {
            arg(&mut sql, " AND id < ?", b);
        }
        if let Some((t, n, i)) = &q.after {
            // After (t, n, i) in (thread, ns) ascending, id descending order.
            arg(&mut sql, " AND (thread > ?", t);
            arg(&mut sql, " OR (thread = ?", t);
            arg(&mut sql, " AND (ns > ?", n);
            arg(&mut sql, " OR (ns = ?", n);
            arg(&mut sql, " AND id < ?))))", i);
        }
        sql.push_str(" ORDER BY thread, ns, id DESC");
        let want = q.limit.unwrap_or(MAX_LIST).min(MAX_LIST);
        let conn = self.db();
        let mut stmt = conn.prepare(&sql).map_err(db("list graph checkpoints"))?;
        let rows = stmt
            .query_map(rusqlite::params_from_iter(args.iter()), from_row)
            .map_err(db("list graph checkpoints"))?;
        let mut out = Vec::new();
        for row in rows {
            let c = row.map_err(db("list graph checkpoints"))?;
            if !q.filter.iter().all(|(k, v)| c.filter.get(k) == Some(v)) {
                continue;
            }
            if out.len() == want {
                // A full page that the caller's own limit did not end.
                return Ok((out, q.limit.is_none_or(|l| l > want)));
            }
            out.push(c);
        }
        Ok((out, false))
    }

    /// The writes of the tasks run from checkpoint `id`, in the order the
    /// framework applies them (task path, task id, index).
    pub fn graph_writes(
        &self,
        thread: &str,
        ns: &str,
        id: &str,
    ) -> Result<Vec<GraphWrite>, GraphError> {
        let conn = self.db();
        let mut stmt = conn
            .prepare(
                "SELECT task, idx, channel, value_type, value, task_path FROM graph_writes
                 WHERE thread = ?1 AND ns = ?2 AND checkpoint = ?3 ORDER BY task_path, task, idx",
            )
            .map_err(db("read graph writes"))?;
        stmt.query_map(params![thread, ns, id], |r| {
            Ok(GraphWrite {
                task: r.get(0)?,
                idx: r.get(1)?,
                channel: r.get(2)?,
                value: Typed {
                    kind: r.get(3)?,
                    data: r.get(4)?,
                },
                task_path: r.get(5)?,
            })
        })
        .map_err(db("read graph writes"))?
        .collect::<Result<_, _>>()
        .map_err(db("read graph writes"))
    }

    /// The sandbox `thread` is bound to, if any.
    pub fn graph_thread(&self, thread: &str) -> Result<Option<ThreadBinding>, GraphError> {
        self.db()
            .query_row(
                "SELECT thread, sandbox, owned, at_ns, at_id FROM graph_threads WHERE thread = ?1",
                [thread],
                |r| {
                    let (ns, id): (Option<String>, Option<String>) = (r.get(3)?, r.get(4)?);
                    Ok(ThreadBinding {
                        thread: r.get(0)?,
                        sandbox: r.get(1)?,
                        owned: r.get::<_, i64>(2)? != 0,
                        at: ns.zip(id),
                    })
                },
            )
            .optional()
            .map_err(db("read graph thread"))
    }

    /// Every snapshot a graph checkpoint is paired with (kept by `gc`).
    pub(crate) fn graph_snapshots(&self) -> rusqlite::Result<Vec<ObjectId>> {
        let conn = self.db();
        let mut stmt = conn.prepare(
            "SELECT DISTINCT snapshot FROM graph_checkpoints WHERE snapshot IS NOT NULL",
        )?;
        let ids: Vec<Vec<u8>> = stmt
            .query_map([], |r| r.get(0))?
            .collect::<Result<_, _>>()?;
        Ok(ids.iter().filter_map(|b| ObjectId::from_slice(b)).collect())
    }
}

impl WriteLock<'_> {
    /// Stores checkpoint `c` (replacing one of the same thread, namespace
    /// and id).
    pub fn put_graph_checkpoint(&self, c: &GraphCheckpoint) -> Result<(), GraphError> {
        check_name("thread", &c.thread, false)?;
        check_name("namespace", &c.ns, true)?;
        check_name("checkpoint id", &c.id, false)?;
        let filter = serde_json::to_string(&c.filter).unwrap_or_else(|_| "{}".into());
        self.repo()
            .db()
            .execute(
                &format!(
                    "INSERT OR REPLACE INTO graph_checkpoints ({COLUMNS})
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)"
                ),
                params![
                    c.thread,
                    c.ns,
                    c.id,
                    c.parent,
                    c.checkpoint.kind,
                    c.checkpoint.data,
                    c.metadata.kind,
                    c.metadata.data,
                    filter,
                    c.run_id,
                    c.sandbox,
                    c.snapshot.map(|s| s.as_bytes().to_vec()),
                    c.created_ns as i64,
                ],
            )
            .map_err(db("write graph checkpoint"))?;
        Ok(())
    }

    /// Stores the writes of task `task` from checkpoint `id`: one at an
    /// index the task wrote before is kept (a retried task writes the same
    /// again), except at the special channels' negative indexes, where the
    /// last one counts.
    pub fn put_graph_writes(
        &self,
        (thread, ns, id): (&str, &str, &str),
        writes: &[GraphWrite],
    ) -> Result<(), GraphError> {
        check_name("thread", thread, false)?;
        check_name("namespace", ns, true)?;
        check_name("checkpoint id", id, false)?;
        let conn = self.repo().db();
        for w in writes {
            check_name("task id", &w.task, false)?;
            check_name("task path", &w.task_path, true)?;
            check_name("channel", &w.channel, false)?;
            let verb = if w.idx < 0 { "REPLACE" } else { "IGNORE" };
            conn.execute(
                &format!(
                    "INSERT OR {verb} INTO graph_writes
                     (thread, ns, checkpoint, task, idx, channel, value_type, value, task_path)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)"
                ),
                params![
                    thread,
                    ns,
                    id,
                    w.task,
                    w.idx,
                    w.channel,
                    w.value.kind,
                    w.value.data,
                    w.task_path
                ],
            )
            .map_err(db("write graph writes"))?;
        }
        Ok(())
    }

    /// Binds `thread` to sandbox `sandbox` at checkpoint `at`.
    pub fn bind_graph_thread(&self, b: &ThreadBinding) -> Result<(), GraphError> {
        check_name("thread", &b.thread, false)?;
        let (ns, id) = b.at.clone().unzip();
        self.repo()
            .db()
            .execute(
                "INSERT OR REPLACE INTO graph_threads (thread, sandbox, owned, at_ns, at_id)
                 VALUES (?1, ?2, ?3, ?4, ?5)",
                params![b.thread, b.sandbox, b.owned as i64, ns, id],
            )
            .map_err(db("bind graph thread"))?;
        Ok(())
    }

    /// Removes every checkpoint and write of `thread`, and its binding
    /// (returned: an owned sandbox is the caller's to remove). Returns the
    /// number of checkpoints removed.
    pub fn delete_graph_thread(
        &self,
        thread: &str,
    ) -> Result<(usize, Option<ThreadBinding>), GraphError> {
        let binding = self.repo().graph_thread(thread)?;
        let conn = self.repo().db();
        let n = conn
            .execute("DELETE FROM graph_checkpoints WHERE thread = ?1", [thread])
            .map_err(db("delete graph thread"))?;
        conn.execute("DELETE FROM graph_writes WHERE thread = ?1", [thread])
            .map_err(db("delete graph thread"))?;
        conn.execute("DELETE FROM graph_threads WHERE thread = ?1", [thread])
            .map_err(db("delete graph thread"))?;
        Ok((n, binding))
    }

    /// Copies every checkpoint and write of `from` to thread `to` (replacing
    /// those of the same namespace and id there). Returns how many
    /// checkpoints it copied.
    pub fn copy_graph_thread(&self, from: &str, to: &str) -> Result<usize, GraphError> {
        check_name("thread", to, false)?;
        let conn = self.repo().db();
        let rest = COLUMNS.trim_start_matches("thread, ");
        let n = conn
            .execute(
                &format!(
                    "INSERT OR REPLACE INTO graph_checkpoints ({COLUMNS})
                     SELECT ?2, {rest} FROM graph_checkpoints WHERE thread = ?1"
                ),
                params![from, to],
            )
            .map_err(db("copy graph thread"))?;
        conn.execute(
            "INSERT OR REPLACE INTO graph_writes
             (thread, ns, checkpoint, task, idx, channel, value_type, value, task_path)
             SELECT ?2, ns, checkpoint, task, idx, channel, value_type, value, task_path
             FROM graph_writes WHERE thread = ?1",
            params![from, to],
        )
        .map_err(db("copy graph thread"))?;
        Ok(n)
    }

    /// Removes the checkpoints made by runs `run_ids`, with their writes.
    pub fn delete_graph_runs(&self, run_ids: &[String]) -> Result<usize, GraphError> {
        let conn = self.repo().db();
        let mut n = 0;
        for run in run_ids {
            conn.execute(
                "DELETE FROM graph_writes WHERE (thread, ns, checkpoint) IN
                 (SELECT thread, ns, id FROM graph_checkpoints WHERE run_id = ?1)",
                [run],
            )
            .map_err(db("delete graph runs"))?;
            n += conn
                .execute("DELETE FROM graph_checkpoints WHERE run_id = ?1", [run])
                .map_err(db("delete graph runs"))?;
        }
        Ok(n)
    }

    /// Removes the checkpoints of `threads` (with their writes) but, with
    /// `keep_latest`, the latest of each namespace. Bindings stay. Returns
    /// how many it removed.
    pub fn prune_graph(&self, threads: &[String], keep_latest: bool) -> Result<usize, GraphError> {
        let conn = self.repo().db();
        let keep = if keep_latest {
            " AND id < (SELECT max(id) FROM graph_checkpoints k WHERE k.thread = c.thread AND k.ns = c.ns)"
        } else {
            ""
        };
        let mut n = 0;
        for t in threads {
            conn.execute(
                &format!(
                    "DELETE FROM graph_writes WHERE (thread, ns, checkpoint) IN
                     (SELECT thread, ns, id FROM graph_checkpoints c WHERE thread = ?1{keep})"
                ),
                [t],
            )
            .map_err(db("prune graph"))?;
            n += conn
                .execute(
                    &format!("DELETE FROM graph_checkpoints AS c WHERE thread = ?1{keep}"),
                    [t],
                )
                .map_err(db("prune graph"))?;
        }
        Ok(n)
    }
}

/// Bytes as base64 in JSON.
mod b64 {
    use base64::Engine as _;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(b: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(b))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let s = String::deserialize(d)?;
        base64::engine::general_purpose::STANDARD
            .decode(s.as_bytes())
            .map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn repo() -> (tempfile::TempDir, Repository) {
        let dir = tempfile::tempdir().unwrap();
        let repo = Repository::init(&dir.path().join("r")).unwrap();
        (dir, repo)
    }

    fn typed(s: &str) -> Typed {
        Typed {
            kind: "json".into(),
            data: s.as_bytes().to_vec(),
        }
    }

    fn cp(thread: &str, ns: &str, id: &str, parent: Option<&str>, source: &str) -> GraphCheckpoint {
        GraphCheckpoint {
            thread: thread.into(),
            ns: ns.into(),
            id: id.into(),
            parent: parent.map(str::to_string),
            checkpoint: typed(&format!("cp {id}")),
            metadata: typed("md"),
            filter: [("source".to_string(), format!("\"{source}\""))].into(),
            run_id: Some(format!("run-{source}")),
            sandbox: None,
            snapshot: None,
            created_ns: 1,
        }
    }

    fn write(task: &str, idx: i64, v: &str) -> GraphWrite {
        GraphWrite {
            task: task.into(),
            idx,
            channel: "ch".into(),
            value: typed(v),
            task_path: String::new(),
        }
    }

    fn ids(cs: &[GraphCheckpoint]) -> Vec<&str> {
        cs.iter().map(|c| c.id.as_str()).collect()
    }

    #[test]
    fn checkpoints_are_listed_newest_first_filtered_and_paged() {
        let (_d, repo) = repo();
        let lock = repo.lock(true).unwrap();
        for (i, source) in ["input", "loop", "loop", "input"].iter().enumerate() {
            let id = format!("c{i}");
            lock.put_graph_checkpoint(&cp("t", "", &id, None, source))
                .unwrap();
        }
        lock.put_graph_checkpoint(&cp("t", "child", "c9", None, "loop"))
            .unwrap();
        lock.put_graph_checkpoint(&cp("u", "", "c5", None, "loop"))
            .unwrap();
        let q = |f: &dyn Fn(&mut GraphQuery)| {
            let mut q = GraphQuery {
                thread: Some("t".into()),
                ns: Some(String::new()),
                ..Default::default()
            };
            f(&mut q);
            repo.graph_list(&q).unwrap()
        };
        assert_eq!(ids(&q(&|_| {}).0), ["c3", "c2", "c1", "c0"]);
        let loops = q(&|q| {
            q.filter.insert("source".into(), "\"loop\"".into());
        });
        assert_eq!(ids(&loops.0), ["c2", "c1"]);
        assert_eq!(ids(&q(&|q| q.before = Some("c2".into())).0), ["c1", "c0"]);
        let (page, more) = q(&|q| q.limit = Some(2));
        assert_eq!((ids(&page), more), (vec!["c3", "c2"], false));
        // All namespaces and threads, in pages.
        let mut all = vec![];
        let mut after = None;
        loop {
            let (page, more) = repo
                .graph_list(&GraphQuery {
                    after: after.clone(),
                    limit: None,
                    ..Default::default()
                })
                .unwrap();
            all.extend(
                page.iter()
                    .map(|c| format!("{}/{}/{}", c.thread, c.ns, c.id)),
            );
            let Some(last) = page.last() else { break };
            after = Some((last.thread.clone(), last.ns.clone(), last.id.clone()));
            if !more {
                break;
            }
        }
        assert_eq!(
            all,
            ["t//c3", "t//c2", "t//c1", "t//c0", "t/child/c9", "u//c5"]
        );
        assert_eq!(
            repo.graph_checkpoint("t", "", None).unwrap().unwrap().id,
            "c3"
        );
        assert!(
            repo.graph_checkpoint("t", "", Some("zz"))
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn writes_keep_the_first_at_an_index_but_the_last_at_a_special_one() {
        let (_d, repo) = repo();
        let lock = repo.lock(true).unwrap();
        lock.put_graph_checkpoint(&cp("t", "", "c0", None, "loop"))
            .unwrap();
        let at = ("t", "", "c0");
        lock.put_graph_writes(at, &[write("b", 0, "b0"), write("a", 1, "a1")])
            .unwrap();
        lock.put_graph_writes(at, &[write("a", 0, "a0"), write("a", 1, "again")])
            .unwrap();
        lock.put_graph_writes(at, &[write("a", -1, "e1")]).unwrap();
        lock.put_graph_writes(at, &[write("a", -1, "e2")]).unwrap();
        let got: Vec<(String, i64, Vec<u8>)> = repo
            .graph_writes("t", "", "c0")
            .unwrap()
            .into_iter()
            .map(|w| (w.task, w.idx, w.value.data))
            .collect();
        assert_eq!(
            got,
            [
                ("a".to_string(), -1, b"e2".to_vec()),
                ("a".to_string(), 0, b"a0".to_vec()),
                ("a".to_string(), 1, b"a1".to_vec()),
                ("b".to_string(), 0, b"b0".to_vec()),
            ]
        );
    }

    #[test]
    fn threads_copy_delete_prune_and_runs_go_with_their_writes() {
        let (_d, repo) = repo();
        let lock = repo.lock(true).unwrap();
        for (ns, id, parent) in [("", "c0", None), ("", "c1", Some("c0")), ("x", "c2", None)] {
            lock.put_graph_checkpoint(&cp("t", ns, id, parent, "loop"))
                .unwrap();
            lock.put_graph_writes(("t", ns, id), &[write("a", 0, id)])
                .unwrap();
        }
        assert_eq!(lock.copy_graph_thread("t", "t2").unwrap(), 3);
        let copied = repo
            .graph_checkpoint("t2", "", Some("c1"))
            .unwrap()
            .unwrap();
        assert_eq!(copied.parent.as_deref(), Some("c0"));
        assert_eq!(repo.graph_writes("t2", "", "c1").unwrap().len(), 1);
        assert_eq!(lock.prune_graph(&["t2".into()], true).unwrap(), 1);
        let left = repo
            .graph_list(&GraphQuery {
                thread: Some("t2".into()),
                ..Default::default()
            })
            .unwrap()
            .0;
        assert_eq!(ids(&left), ["c1", "c2"]);
        assert!(repo.graph_writes("t2", "", "c0").unwrap().is_empty());
        assert_eq!(repo.graph_writes("t2", "", "c1").unwrap().len(), 1);
        lock.bind_graph_thread(&ThreadBinding {
            thread: "t".into(),
            sandbox: "sb".into(),
            owned: true,
            at: Some((String::new(), "c1".into())),
        })
        .unwrap();
        let (n, binding) = lock.delete_graph_thread("t").unwrap();
        assert_eq!((n, binding.map(|b| b.sandbox)), (3, Some("sb".into())));
        assert!(repo.graph_writes("t", "", "c0").unwrap().is_empty());
        assert!(repo.graph_thread("t").unwrap().is_none());
        // The copy is untouched; a run's checkpoints go by its id.
        assert_eq!(lock.delete_graph_runs(&["run-loop".into()]).unwrap(), 2);
        assert!(repo.graph_checkpoint("t2", "", None).unwrap().is_none());
        assert!(repo.graph_writes("t2", "", "c1").unwrap().is_empty());
    }

    #[test]
    fn names_are_bounded() {
        let (_d, repo) = repo();
        let lock = repo.lock(true).unwrap();
        let mut c = cp("t", "", "c0", None, "loop");
        c.thread = String::new();
        assert!(matches!(
            lock.put_graph_checkpoint(&c),
            Err(GraphError::BadName { what: "thread" })
        ));
        c.thread = "x".repeat(MAX_NAME + 1);
        assert!(lock.put_graph_checkpoint(&c).is_err());
        c.thread = "a\0b".into();
        assert!(lock.put_graph_checkpoint(&c).is_err());
    }
}
