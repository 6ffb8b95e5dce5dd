//! Named remotes: where `tine push`/`pull` send and fetch snapshots. Only the
//! address and connection settings are kept; credentials never are (they come
//! from the environment or flags at each use).

use std::collections::BTreeMap;

use rusqlite::{OptionalExtension, params};
use serde::{Deserialize, Serialize};

use crate::records::RecordError;
use crate::repo::{Repository, WriteLock};

pub(crate) const REMOTE_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS remotes (
    name TEXT PRIMARY KEY,
    url TEXT NOT NULL,
    settings TEXT NOT NULL
);
";

/// One named remote.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteRecord {
    pub name: String,
    pub url: String,
    /// Connection settings that are not secret (endpoint, region, ...).
    pub settings: BTreeMap<String, String>,
}

fn remote_record(name: String, url: String, settings: &str) -> RemoteRecord {
    RemoteRecord {
        name,
        url,
        settings: serde_json::from_str(settings).unwrap_or_default(),
    }
}

fn db(step: &'static str) -> impl FnOnce(rusqlite::Error) -> RecordError {
    move |source| RecordError::Db { step, source }
}

impl Repository {
    /// Every remote, by name.
    pub fn remotes(&self) -> Result<Vec<RemoteRecord>, RecordError> {
        self.record_rows(
            "list remotes",
            "SELECT name, url, settings FROM remotes ORDER BY name",
            [],
            |r| Ok(remote_record(r.get(0)?, r.get(1)?, &r.get::<_, String>(2)?)),
        )
    }

    /// The remote called `name`, if there is one.
    pub fn remote(&self, name: &str) -> Result<Option<RemoteRecord>, RecordError> {
        let row = self
            .db()
            .query_row(
                "SELECT url, settings FROM remotes WHERE name = ?1",
                [name],
                |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)),
            )
            .optional()
            .map_err(db("read remote"))?;
        Ok(row.map(|(url, settings)| remote_record(name.to_string(), url, &settings)))
    }
}

impl WriteLock<'_> {
    /// Records a remote; refused when the name is taken.
    pub fn add_remote(&self, r: &RemoteRecord) -> Result<(), RecordError> {
        if self.repo().remote(&r.name)?.is_some() {
            return Err(RecordError::RemoteTaken {
                name: r.name.clone(),
            });
        }
        let settings = serde_json::to_string(&r.settings).expect("a string map serializes");
        self.repo()
            .db()
            .execute(
                "INSERT INTO remotes (name, url, settings) VALUES (?1, ?2, ?3)",
                params![r.name, r.url, settings],
            )
            .map_err(db("add remote"))?;
        Ok(())
    }

    /// Forgets a remote (not what it holds); false when there was none.
    pub fn remove_remote(&self, name: &str) -> Result<bool, RecordError> {
        let n = self
            .repo()
            .db()
            .execute("DELETE FROM remotes WHERE name = ?1", [name])
            .map_err(db("remove remote"))?;
        Ok(n > 0)
    }
}
