//! Workspace records: a named, long-lived sandbox and the states it was
//! suspended in. The repository only stores them; what a state means (how
//! its processes come back) belongs to tine-engine. Each state's snapshot is
//! also a head (`workspace:NAME:SEQ`), so `gc` keeps it.

use rusqlite::{OptionalExtension, params};
use serde::{Deserialize, Serialize};

use crate::id::ObjectId;
use crate::records::RecordError;
use crate::repo::{Repository, WriteLock, now_ns};

pub(crate) const WORKSPACE_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS workspaces (
    name TEXT PRIMARY KEY,
    sandbox TEXT NOT NULL,
    created_ns INTEGER NOT NULL,
    updated_ns INTEGER NOT NULL,
    settings TEXT NOT NULL,
    current INTEGER
);
CREATE TABLE IF NOT EXISTS workspace_states (
    workspace TEXT NOT NULL,
    seq INTEGER NOT NULL,
    snapshot BLOB NOT NULL,
    time_ns INTEGER NOT NULL,
    detail TEXT NOT NULL,
    PRIMARY KEY (workspace, seq)
);
";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkspaceRecord {
    pub name: String,
    /// The id of the sandbox it lives in.
    pub sandbox: String,
    pub created_ns: u64,
    pub updated_ns: u64,
    /// Retention and idle settings, JSON.
    pub settings: String,
    /// The state it sits in while not running (set with the state, cleared
    /// once a resume has it running again).
    pub current: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct WorkspaceState {
    pub workspace: String,
    pub seq: u64,
    pub snapshot: ObjectId,
    pub time_ns: u64,
    /// How its processes come back, JSON.
    pub detail: String,
}

fn db(step: &'static str) -> impl FnOnce(rusqlite::Error) -> RecordError {
    move |source| RecordError::Db { step, source }
}

/// The head that keeps a state's snapshot.
pub fn state_head(workspace: &str, seq: u64) -> String {
    format!("workspace:{workspace}:{seq}")
}

fn ws_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<WorkspaceRecord> {
    Ok(WorkspaceRecord {
        name: r.get(0)?,
        sandbox: r.get(1)?,
        created_ns: r.get::<_, i64>(2)? as u64,
        updated_ns: r.get::<_, i64>(3)? as u64,
        settings: r.get(4)?,
        current: r.get::<_, Option<i64>>(5)?.map(|c| c as u64),
    })
}

const WS_COLUMNS: &str = "name, sandbox, created_ns, updated_ns, settings, current";

impl Repository {
    /// Every workspace, by name.
    pub fn workspaces(&self) -> Result<Vec<WorkspaceRecord>, RecordError> {
        self.record_rows(
            "list workspaces",
            &format!("SELECT {WS_COLUMNS} FROM workspaces ORDER BY name"),
            [],
            ws_row,
        )
    }

    pub fn workspace(&self, name: &str) -> Result<Option<WorkspaceRecord>, RecordError> {
        self.db()
            .query_row(
                &format!("SELECT {WS_COLUMNS} FROM workspaces WHERE name = ?1"),
                [name],
                ws_row,
            )
            .optional()
            .map_err(db("look up workspace"))
    }

    /// The states of a workspace, oldest first.
    pub fn workspace_states(&self, name: &str) -> Result<Vec<WorkspaceState>, RecordError> {
        let rows = self.record_rows(
            "list workspace states",
            "SELECT workspace, seq, snapshot, time_ns, detail FROM workspace_states
             WHERE workspace = ?1 ORDER BY seq",
            [name],
            |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, i64>(1)?,
                    r.get::<_, Vec<u8>>(2)?,
                    r.get::<_, i64>(3)?,
                    r.get::<_, String>(4)?,
                ))
            },
        )?;
        Ok(rows
            .into_iter()
            .filter_map(|(workspace, seq, snap, time_ns, detail)| {
                Some(WorkspaceState {
                    workspace,
                    seq: seq as u64,
                    snapshot: ObjectId::from_slice(&snap)?,
                    time_ns: time_ns as u64,
                    detail,
                })
            })
            .collect())
    }
}

impl WriteLock<'_> {
    /// Records a new workspace. Its name must be free.
    pub fn insert_workspace(&self, w: &WorkspaceRecord) -> Result<(), RecordError> {
        let n = self
            .repo()
            .db()
            .execute(
                &format!(
                    "INSERT OR IGNORE INTO workspaces ({WS_COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6)"
                ),
                params![
                    w.name,
                    w.sandbox,
                    w.created_ns as i64,
                    w.updated_ns as i64,
                    w.settings,
                    w.current.map(|c| c as i64)
                ],
            )
            .map_err(db("insert workspace"))?;
        if n == 0 {
            return Err(RecordError::WorkspaceTaken {
                name: w.name.clone(),
            });
        }
        Ok(())
    }

    /// Records a state of a workspace as its current one, with the head that
    /// keeps its snapshot: one transaction, so either all of it is durable
    /// or none.
    pub fn add_workspace_state(&self, s: &WorkspaceState) -> Result<(), RecordError> {
        let mut conn = self.repo().db();
        let tx = conn.transaction().map_err(db("begin"))?;
        tx.execute(
            "INSERT INTO workspace_states (workspace, seq, snapshot, time_ns, detail)
             VALUES (?1, ?2, ?3, ?4, ?5)",
            params![
                s.workspace,
                s.seq as i64,
                s.snapshot.as_bytes().as_slice(),
                s.time_ns as i64,
                s.detail
            ],
        )
        .map_err(db("insert workspace state"))?;
        tx.execute(
            "INSERT OR REPLACE INTO heads (path, snapshot) VALUES (?1, ?2)",
            params![
                state_head(&s.workspace, s.seq),
                s.snapshot.as_bytes().as_slice()
            ],
        )
        .map_err(db("write head"))?;
        tx.execute(
            "UPDATE workspaces SET current = ?2, updated_ns = ?3 WHERE name = ?1",
            params![s.workspace, s.seq as i64, now_ns() as i64],
        )
        .map_err(db("update workspace"))?;
        tx.commit().map_err(db("commit"))
    }

    /// Sets (or clears) the state a workspace sits in.
    pub fn set_workspace_current(
        &self,
        name: &str,
        current: Option<u64>,
    ) -> Result<(), RecordError> {
        self.repo()
            .db()
            .execute(
                "UPDATE workspaces SET current = ?2, updated_ns = ?3 WHERE name = ?1",
                params![name, current.map(|c| c as i64), now_ns() as i64],
            )
            .map_err(db("update workspace"))?;
        Ok(())
    }

    /// Forgets one state of a workspace and its head.
    pub fn delete_workspace_state(&self, name: &str, seq: u64) -> Result<(), RecordError> {
        let mut conn = self.repo().db();
        let tx = conn.transaction().map_err(db("begin"))?;
        tx.execute(
            "DELETE FROM workspace_states WHERE workspace = ?1 AND seq = ?2",
            params![name, seq as i64],
        )
        .map_err(db("delete workspace state"))?;
        tx.execute("DELETE FROM heads WHERE path = ?1", [state_head(name, seq)])
            .map_err(db("delete head"))?;
        tx.commit().map_err(db("commit"))
    }

    /// Forgets a workspace, its states and their heads.
    pub fn delete_workspace(&self, name: &str) -> Result<(), RecordError> {
        let mut conn = self.repo().db();
        let tx = conn.transaction().map_err(db("begin"))?;
        tx.execute("DELETE FROM workspaces WHERE name = ?1", [name])
            .map_err(db("delete workspace"))?;
        tx.execute("DELETE FROM workspace_states WHERE workspace = ?1", [name])
            .map_err(db("delete workspace states"))?;
        tx.execute(
            "DELETE FROM heads WHERE path LIKE ?1 ESCAPE '\\'",
            [format!(
                "workspace:{}:%",
                name.replace('\\', "\\\\")
                    .replace('%', "\\%")
                    .replace('_', "\\_")
            )],
        )
        .map_err(db("delete heads"))?;
        tx.commit().map_err(db("commit"))
    }
}
