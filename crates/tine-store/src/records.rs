//! Sandbox records: what `tine ps` lists. The repository only stores them; what
//! the fields mean (the run options in `spec`, the termination reason in `exit`,
//! both JSON) belongs to `tine-sandbox`.

use rusqlite::types::{FromSql, FromSqlError, FromSqlResult, ToSql, ToSqlOutput, ValueRef};
use rusqlite::{OptionalExtension, Row, params};
use serde::{Deserialize, Serialize};

use crate::error::{ErrorKind, HasKind};
use crate::repo::{Repository, WriteLock, now_ns};

pub(crate) const SANDBOX_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    created_ns INTEGER NOT NULL,
    updated_ns INTEGER NOT NULL,
    state TEXT NOT NULL,
    spec TEXT NOT NULL,
    supervisor_pid INTEGER,
    init_pid INTEGER,
    restarts INTEGER NOT NULL DEFAULT 0,
    exit TEXT
);
";

/// Where a sandbox is in its life, as its supervisor last recorded it (the
/// `state` column, and the JSON of `tine ps` and the API: lowercase words).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SandboxState {
    /// Made by `tine fork --no-start`; not started yet.
    Created,
    Starting,
    Running,
    /// Its command ended and its restart policy starts it again.
    Restarting,
    Exited,
    Stopped,
    /// A native fork made ahead of a `tine fork` (`snapshot --prepare-forks`):
    /// supervised, its processes stopped until a fork claims it.
    Prepared,
    /// Shown (never stored) when the record says live but no supervisor answers.
    Stale,
}

impl SandboxState {
    pub const ALL: [SandboxState; 8] = [
        SandboxState::Created,
        SandboxState::Starting,
        SandboxState::Running,
        SandboxState::Restarting,
        SandboxState::Exited,
        SandboxState::Stopped,
        SandboxState::Prepared,
        SandboxState::Stale,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            SandboxState::Created => "created",
            SandboxState::Starting => "starting",
            SandboxState::Running => "running",
            SandboxState::Restarting => "restarting",
            SandboxState::Exited => "exited",
            SandboxState::Stopped => "stopped",
            SandboxState::Prepared => "prepared",
            SandboxState::Stale => "stale",
        }
    }

    /// Whether a supervisor looks after it (starting, running, restarting,
    /// prepared).
    pub fn is_live(self) -> bool {
        matches!(
            self,
            SandboxState::Starting
                | SandboxState::Running
                | SandboxState::Restarting
                | SandboxState::Prepared
        )
    }

    /// Whether it ran and ended (exited or stopped).
    pub fn has_ended(self) -> bool {
        matches!(self, SandboxState::Exited | SandboxState::Stopped)
    }
}

impl std::fmt::Display for SandboxState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for SandboxState {
    type Err = String;
    fn from_str(s: &str) -> Result<SandboxState, String> {
        SandboxState::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| format!("unknown sandbox state {s:?}"))
    }
}

impl ToSql for SandboxState {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        Ok(ToSqlOutput::from(self.as_str()))
    }
}

/// A state the database holds that this version does not know is a damaged
/// (or newer) repository: `corrupt`, like any value of the wrong type.
impl FromSql for SandboxState {
    fn column_result(v: ValueRef<'_>) -> FromSqlResult<SandboxState> {
        v.as_str()?
            .parse()
            .map_err(|e: String| FromSqlError::Other(e.into()))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxRecord {
    /// 12 hex digits, fixed at creation.
    pub id: String,
    /// Unique; given by the user or generated.
    pub name: String,
    pub created_ns: u64,
    pub updated_ns: u64,
    /// As last recorded by the sandbox's supervisor (`tine ps` checks it is alive).
    pub state: SandboxState,
    /// Run options, JSON.
    pub spec: String,
    pub supervisor_pid: Option<u32>,
    pub init_pid: Option<u32>,
    pub restarts: u32,
    /// Termination reason of the last run, JSON.
    pub exit: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("no sandbox named {spec:?} (see `tine ps`)")]
    NotFound { spec: String },
    #[error("{spec:?} matches several sandboxes: {}; give more digits", candidates.join(", "))]
    Ambiguous {
        spec: String,
        candidates: Vec<String>,
    },
    #[error("a sandbox named {name:?} exists already; pick another --name or `tine rm` it")]
    NameTaken { name: String },
    #[error("a workspace named {name:?} exists already; pick another name or delete it")]
    WorkspaceTaken { name: String },
    #[error("a remote named {name:?} exists already; pick another name or `tine remote rm` it")]
    RemoteTaken { name: String },
    #[error("repository database ({step}): {source}")]
    Db {
        step: &'static str,
        source: rusqlite::Error,
    },
}

impl HasKind for RecordError {
    fn kind(&self) -> ErrorKind {
        match self {
            RecordError::NotFound { .. } => ErrorKind::NotFound,
            RecordError::Ambiguous { .. } => ErrorKind::Ambiguous,
            RecordError::NameTaken { .. }
            | RecordError::WorkspaceTaken { .. }
            | RecordError::RemoteTaken { .. } => ErrorKind::AlreadyExists,
            RecordError::Db { source, .. } => crate::error::db_kind(source),
        }
    }
}

fn db(step: &'static str) -> impl FnOnce(rusqlite::Error) -> RecordError {
    move |source| RecordError::Db { step, source }
}

impl Repository {
    /// Every row `sql` selects, each made by `row`; a failure names `step`.
    pub(crate) fn record_rows<T, P: rusqlite::Params>(
        &self,
        step: &'static str,
        sql: &str,
        params: P,
        row: impl FnMut(&Row<'_>) -> rusqlite::Result<T>,
    ) -> Result<Vec<T>, RecordError> {
        let conn = self.db();
        let mut q = conn.prepare(sql).map_err(db(step))?;
        q.query_map(params, row)
            .map_err(db(step))?
            .collect::<Result<_, _>>()
            .map_err(db(step))
    }
}

const COLUMNS: &str =
    "id, name, created_ns, updated_ns, state, spec, supervisor_pid, init_pid, restarts, exit";

fn from_row(r: &Row<'_>) -> rusqlite::Result<SandboxRecord> {
    Ok(SandboxRecord {
        id: r.get(0)?,
        name: r.get(1)?,
        created_ns: r.get::<_, i64>(2)? as u64,
        updated_ns: r.get::<_, i64>(3)? as u64,
        state: r.get(4)?,
        spec: r.get(5)?,
        supervisor_pid: r.get(6)?,
        init_pid: r.get(7)?,
        restarts: r.get(8)?,
        exit: r.get(9)?,
    })
}

fn insert(conn: &rusqlite::Connection, r: &SandboxRecord) -> Result<(), RecordError> {
    let n = conn
        .execute(
            &format!(
                "INSERT OR IGNORE INTO sandboxes ({COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)"
            ),
            params![
                r.id,
                r.name,
                r.created_ns as i64,
                r.updated_ns as i64,
                r.state,
                r.spec,
                r.supervisor_pid,
                r.init_pid,
                r.restarts,
                r.exit
            ],
        )
        .map_err(db("insert sandbox"))?;
    if n == 0 {
        return Err(RecordError::NameTaken {
            name: r.name.clone(),
        });
    }
    Ok(())
}

impl WriteLock<'_> {
    /// Records new sandboxes and sets heads, all in one transaction (one fsync).
    pub fn record_sandboxes(
        &self,
        records: &[SandboxRecord],
        heads: &[(String, crate::ObjectId)],
    ) -> Result<(), RecordError> {
        let mut db_ = self.repo().db();
        let tx = db_.transaction().map_err(db("begin"))?;
        for r in records {
            insert(&tx, r)?;
        }
        for (path, id) in heads {
            tx.execute(
                "INSERT OR REPLACE INTO heads (path, snapshot) VALUES (?1, ?2)",
                params![path, id.as_bytes().as_slice()],
            )
            .map_err(db("write head"))?;
        }
        tx.commit().map_err(db("commit"))
    }

    /// Claims prepared sandboxes: each `(id, name)` still prepared takes its
    /// name and is recorded running, made now, all in one transaction (one
    /// fsync). Returns the ids claimed (one whose supervisor recorded it
    /// ended meanwhile is not). Refused (nothing changed) when a name is
    /// taken.
    pub fn claim_sandboxes(&self, claims: &[(String, String)]) -> Result<Vec<String>, RecordError> {
        let mut db_ = self.repo().db();
        let tx = db_.transaction().map_err(db("begin"))?;
        let now = now_ns() as i64;
        let mut claimed = Vec::with_capacity(claims.len());
        for (id, name) in claims {
            let taken: bool = tx
                .query_row(
                    "SELECT EXISTS (SELECT 1 FROM sandboxes WHERE name = ?1 AND id != ?2)",
                    params![name, id],
                    |r| r.get(0),
                )
                .map_err(db("read sandbox names"))?;
            if taken {
                return Err(RecordError::NameTaken { name: name.clone() });
            }
            let n = tx
                .execute(
                    "UPDATE sandboxes SET name = ?2, state = ?3, created_ns = ?4, updated_ns = ?4
                     WHERE id = ?1 AND state = ?5",
                    params![id, name, SandboxState::Running, now, SandboxState::Prepared],
                )
                .map_err(db("claim sandbox"))?;
            if n == 1 {
                claimed.push(id.clone());
            }
        }
        tx.commit().map_err(db("commit"))?;
        Ok(claimed)
    }
}

impl Repository {
    /// Records a new sandbox. Its name must be free.
    pub fn insert_sandbox(&self, r: &SandboxRecord) -> Result<(), RecordError> {
        insert(&self.db(), r)
    }

    /// Saves the mutable fields of a sandbox (state, pids, restarts, exit).
    pub fn save_sandbox(&self, r: &SandboxRecord) -> Result<(), RecordError> {
        let n = self
            .db()
            .execute(
                "UPDATE sandboxes SET updated_ns = ?2, state = ?3, supervisor_pid = ?4, init_pid = ?5,
                 restarts = ?6, exit = ?7 WHERE id = ?1",
                params![
                    r.id,
                    now_ns() as i64,
                    r.state,
                    r.supervisor_pid,
                    r.init_pid,
                    r.restarts,
                    r.exit
                ],
            )
            .map_err(db("update sandbox"))?;
        if n == 0 {
            return Err(RecordError::NotFound { spec: r.id.clone() });
        }
        Ok(())
    }

    /// Every sandbox, oldest first.
    pub fn sandboxes(&self) -> Result<Vec<SandboxRecord>, RecordError> {
        self.record_rows(
            "list sandboxes",
            &format!("SELECT {COLUMNS} FROM sandboxes ORDER BY created_ns, id"),
            [],
            from_row,
        )
    }

    /// A sandbox by exact name, or by a unique prefix of its id.
    pub fn sandbox(&self, spec: &str) -> Result<SandboxRecord, RecordError> {
        let db_ = self.db();
        if let Some(r) = db_
            .query_row(
                &format!("SELECT {COLUMNS} FROM sandboxes WHERE name = ?1"),
                [spec],
                from_row,
            )
            .optional()
            .map_err(db("look up sandbox"))?
        {
            return Ok(r);
        }
        if spec.is_empty() || !spec.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(RecordError::NotFound { spec: spec.into() });
        }
        drop(db_);
        let found = self.record_rows(
            "look up sandbox",
            &format!("SELECT {COLUMNS} FROM sandboxes WHERE substr(id, 1, ?2) = ?1 LIMIT 6"),
            params![spec.to_ascii_lowercase(), spec.len() as i64],
            from_row,
        )?;
        match found.len() {
            0 => Err(RecordError::NotFound { spec: spec.into() }),
            1 => Ok(found.into_iter().next().expect("one")),
            _ => Err(RecordError::Ambiguous {
                spec: spec.into(),
                candidates: found.into_iter().map(|r| r.name).collect(),
            }),
        }
    }

    pub fn delete_sandbox(&self, id: &str) -> Result<(), RecordError> {
        self.db()
            .execute("DELETE FROM sandboxes WHERE id = ?1", [id])
            .map_err(db("delete sandbox"))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::SandboxState;

    #[test]
    fn states_read_back_as_they_are_written_in_words_and_json() {
        for st in SandboxState::ALL {
            assert_eq!(st.as_str().parse::<SandboxState>(), Ok(st));
            let json = serde_json::to_string(&st).unwrap();
            assert_eq!(json, format!("\"{st}\""));
            assert_eq!(serde_json::from_str::<SandboxState>(&json).unwrap(), st);
        }
        assert!("Running".parse::<SandboxState>().is_err());
        let live: Vec<_> = SandboxState::ALL
            .into_iter()
            .filter(|s| s.is_live())
            .collect();
        assert_eq!(
            live,
            [
                SandboxState::Starting,
                SandboxState::Running,
                SandboxState::Restarting,
                SandboxState::Prepared
            ]
        );
    }
}
