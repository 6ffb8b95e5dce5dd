//! Ledger rows: the stored form of the effects ledger (what tine-ledger
//! chains with HMACs), and each sandbox's head on it.

use rusqlite::{OptionalExtension, params};
use serde::Serialize;

use crate::records::RecordError;
use crate::repo::{Repository, WriteLock};

fn db(step: &'static str) -> impl FnOnce(rusqlite::Error) -> RecordError {
    move |source| RecordError::Db { step, source }
}

pub(crate) const LEDGER_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS ledger (
    id INTEGER PRIMARY KEY,
    parent INTEGER,
    sandbox TEXT NOT NULL,
    kind TEXT NOT NULL,
    key TEXT NOT NULL,
    request TEXT NOT NULL,
    result TEXT NOT NULL,
    time_ns INTEGER NOT NULL,
    mac BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS ledger_heads (
    sandbox TEXT PRIMARY KEY,
    entry INTEGER
);
";

/// What authenticates the heads (tine-ledger computes the MACs): each
/// head's MAC and the counter value it was set at, and one seal over the
/// whole ledger (the counter, how many entries, the newest id, every head).
/// Tables of their own, so repositories from before them gain them as is.
pub(crate) const LEDGER_SEAL_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS ledger_head_macs (
    sandbox TEXT PRIMARY KEY,
    counter INTEGER NOT NULL,
    mac BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS ledger_seal (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    counter INTEGER NOT NULL,
    mac BLOB NOT NULL
);
";

/// A sandbox's head as stored, with what authenticates it (`None`: set by a
/// tine from before heads were authenticated).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeadRow {
    pub sandbox: String,
    pub entry: Option<u64>,
    pub auth: Option<(u64, Vec<u8>)>,
}

/// The whole ledger's seal: the counter (bumped at every append and head
/// move) and its MAC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seal {
    pub counter: u64,
    pub mac: Vec<u8>,
}

/// One stored ledger entry (tine-ledger gives it meaning: the MAC chain).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LedgerRow {
    pub id: u64,
    /// The entry before it on its sandbox's chain.
    pub parent: Option<u64>,
    pub sandbox: String,
    pub kind: String,
    pub key: String,
    pub request: String,
    pub result: String,
    pub time_ns: u64,
    #[serde(skip)]
    pub mac: Vec<u8>,
}

fn ledger_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<LedgerRow> {
    Ok(LedgerRow {
        id: r.get::<_, i64>(0)? as u64,
        parent: r.get::<_, Option<i64>>(1)?.map(|p| p as u64),
        sandbox: r.get(2)?,
        kind: r.get(3)?,
        key: r.get(4)?,
        request: r.get(5)?,
        result: r.get(6)?,
        time_ns: r.get::<_, i64>(7)? as u64,
        mac: r.get(8)?,
    })
}

const LEDGER_COLUMNS: &str = "id, parent, sandbox, kind, key, request, result, time_ns, mac";

impl Repository {
    /// Every ledger entry, oldest first.
    pub fn ledger_rows(&self) -> Result<Vec<LedgerRow>, RecordError> {
        self.record_rows(
            "list ledger",
            &format!("SELECT {LEDGER_COLUMNS} FROM ledger ORDER BY id"),
            [],
            ledger_row,
        )
    }

    pub fn ledger_row(&self, id: u64) -> Result<Option<LedgerRow>, RecordError> {
        self.db()
            .query_row(
                &format!("SELECT {LEDGER_COLUMNS} FROM ledger WHERE id = ?1"),
                [id as i64],
                ledger_row,
            )
            .optional()
            .map_err(db("read ledger entry"))
    }

    /// The last visible entry of a sandbox's ledger.
    pub fn ledger_head(&self, sandbox: &str) -> Result<Option<u64>, RecordError> {
        Ok(self
            .db()
            .query_row(
                "SELECT entry FROM ledger_heads WHERE sandbox = ?1",
                [sandbox],
                |r| r.get::<_, Option<i64>>(0),
            )
            .optional()
            .map_err(db("read ledger head"))?
            .flatten()
            .map(|e| e as u64))
    }

    /// Every head with its authentication, by sandbox.
    pub fn ledger_head_rows(&self) -> Result<Vec<HeadRow>, RecordError> {
        self.record_rows(
            "list ledger heads",
            "SELECT h.sandbox, h.entry, m.counter, m.mac FROM ledger_heads h \
             LEFT JOIN ledger_head_macs m ON m.sandbox = h.sandbox ORDER BY h.sandbox",
            [],
            |r| {
                let counter: Option<i64> = r.get(2)?;
                let mac: Option<Vec<u8>> = r.get(3)?;
                Ok(HeadRow {
                    sandbox: r.get(0)?,
                    entry: r.get::<_, Option<i64>>(1)?.map(|e| e as u64),
                    auth: counter.zip(mac).map(|(c, m)| (c as u64, m)),
                })
            },
        )
    }

    /// The ledger's seal, if it has one.
    pub fn ledger_seal(&self) -> Result<Option<Seal>, RecordError> {
        self.db()
            .query_row(
                "SELECT counter, mac FROM ledger_seal WHERE id = 1",
                [],
                |r| {
                    Ok(Seal {
                        counter: r.get::<_, i64>(0)? as u64,
                        mac: r.get(1)?,
                    })
                },
            )
            .optional()
            .map_err(db("read ledger seal"))
    }

    /// How many entries there are, and the newest id (0: none).
    pub fn ledger_extent(&self) -> Result<(u64, u64), RecordError> {
        self.db()
            .query_row(
                "SELECT count(*), coalesce(max(id), 0) FROM ledger",
                [],
                |r| Ok((r.get::<_, i64>(0)? as u64, r.get::<_, i64>(1)? as u64)),
            )
            .map_err(db("read ledger"))
    }

    /// The id the next entry gets.
    pub fn next_ledger_id(&self) -> Result<u64, RecordError> {
        let max: Option<i64> = self
            .db()
            .query_row("SELECT max(id) FROM ledger", [], |r| r.get(0))
            .map_err(db("read ledger"))?;
        Ok(max.map_or(1, |m| m as u64 + 1))
    }
}

impl WriteLock<'_> {
    /// Appends an entry, makes `head` (its sandbox's head, now the entry)
    /// current and stores `seal`: one transaction.
    pub fn append_ledger(
        &self,
        row: &LedgerRow,
        head: &HeadRow,
        seal: &Seal,
    ) -> Result<(), RecordError> {
        let mut conn = self.repo().db();
        let tx = conn.transaction().map_err(db("begin"))?;
        tx.execute(
            &format!(
                "INSERT INTO ledger ({LEDGER_COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)"
            ),
            params![
                row.id as i64,
                row.parent.map(|p| p as i64),
                row.sandbox,
                row.kind,
                row.key,
                row.request,
                row.result,
                row.time_ns as i64,
                row.mac
            ],
        )
        .map_err(db("append ledger entry"))?;
        write_head(&tx, head, seal)?;
        tx.commit().map_err(db("commit"))
    }

    /// Points a sandbox's ledger at `head.entry` (none: empty), with its
    /// authentication and the new seal: one transaction.
    pub fn set_ledger_head(&self, head: &HeadRow, seal: &Seal) -> Result<(), RecordError> {
        self.set_ledger_heads(std::slice::from_ref(head), seal)
    }

    /// [`Self::set_ledger_head`] for several sandboxes at once (the forks of
    /// one call): their heads and one seal, one transaction.
    pub fn set_ledger_heads(&self, heads: &[HeadRow], seal: &Seal) -> Result<(), RecordError> {
        let mut conn = self.repo().db();
        let tx = conn.transaction().map_err(db("begin"))?;
        for head in heads {
            write_head_row(&tx, head)?;
        }
        write_seal(&tx, seal)?;
        tx.commit().map_err(db("commit"))
    }
}

fn write_head(
    tx: &rusqlite::Transaction<'_>,
    head: &HeadRow,
    seal: &Seal,
) -> Result<(), RecordError> {
    write_head_row(tx, head)?;
    write_seal(tx, seal)
}

fn write_head_row(tx: &rusqlite::Transaction<'_>, head: &HeadRow) -> Result<(), RecordError> {
    tx.execute(
        "INSERT OR REPLACE INTO ledger_heads (sandbox, entry) VALUES (?1, ?2)",
        params![head.sandbox, head.entry.map(|e| e as i64)],
    )
    .map_err(db("write ledger head"))?;
    if let Some((counter, mac)) = &head.auth {
        tx.execute(
            "INSERT OR REPLACE INTO ledger_head_macs (sandbox, counter, mac) VALUES (?1, ?2, ?3)",
            params![head.sandbox, *counter as i64, mac],
        )
        .map_err(db("write ledger head"))?;
    }
    Ok(())
}

fn write_seal(tx: &rusqlite::Transaction<'_>, seal: &Seal) -> Result<(), RecordError> {
    tx.execute(
        "INSERT OR REPLACE INTO ledger_seal (id, counter, mac) VALUES (1, ?1, ?2)",
        params![seal.counter as i64, seal.mac],
    )
    .map_err(db("write ledger seal"))?;
    Ok(())
}

/// The snapshot note that records a sandbox's ledger head.
pub const HEAD_NOTE: &str = "ledger-head";

/// A MAC as lowercase hex (how notes and reports show it).
pub fn mac_hex(mac: &[u8]) -> String {
    mac.iter().map(|b| format!("{b:02x}")).collect()
}

/// The note's content: `{"entry": ID, "mac": HEX}`.
pub fn head_note(entry: u64, mac: &[u8]) -> Vec<u8> {
    serde_json::json!({"entry": entry, "mac": mac_hex(mac)})
        .to_string()
        .into_bytes()
}

/// The ledger head a snapshot recorded (entry id and MAC in hex), if any.
pub fn head_note_of(
    repo: &Repository,
    snap: &crate::ObjectId,
) -> Result<Option<(u64, String)>, crate::ObjectError> {
    let obj = repo.read_snapshot(snap)?;
    let Some(a) = obj.attachments.iter().find(|a| a.name == HEAD_NOTE) else {
        return Ok(None);
    };
    let mut bytes = Vec::new();
    repo.write_content(&a.content, &mut bytes, std::path::Path::new(HEAD_NOTE))?;
    let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
    Ok(v["entry"]
        .as_u64()
        .map(|e| (e, v["mac"].as_str().unwrap_or_default().to_string())))
}

/// The ledger head a snapshot recorded (none: its ledger was empty).
pub fn head_of(
    repo: &Repository,
    snap: &crate::ObjectId,
) -> Result<Option<u64>, crate::ObjectError> {
    Ok(head_note_of(repo, snap)?.map(|(e, _)| e))
}
