//! The repository: packs of objects plus SQLite metadata, guarded by file locks.
//!
//! Locks (advisory `flock`s, released by the kernel when a process dies):
//! - `gc.lock`: every open [`Repository`] holds it shared; `gc` takes it exclusive,
//!   so packs never disappear under a reader.
//! - `write.lock`: held exclusive by a [`WriteLock`]; one writer at a time.
//!
//! This file opens, creates and locks a repository; `read` reads objects and
//! metadata, `write` is the writer's side (packs, commits, tags, heads).

mod read;
mod write;

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};
pub use write::{PackBuilder, WriteLock, check_tag_name, write_atomic};
pub(crate) use write::{insert_snapshot, record_pack};

use rusqlite::{Connection, params};
use serde::Serialize;

use crate::error::{ObjectError, OpenError};
use crate::id::ObjectId;
use crate::object::Attachment;
use crate::pack::PackEntry;

/// Version of the repository layout and database schema.
pub const REPO_FORMAT: u32 = 1;
const FORMAT_FILE: &str = "FORMAT";
const DB_FILE: &str = "tine.db";
const PACKS_DIR: &str = "packs";
const CACHE_DIR: &str = "cache";
const WRITE_LOCK: &str = "write.lock";
const GC_LOCK: &str = "gc.lock";
/// Shortest id prefix accepted when naming a snapshot.
pub const MIN_PREFIX: usize = 4;

const SCHEMA: &str = "
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE packs (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    bytes INTEGER NOT NULL,
    objects INTEGER NOT NULL,
    created_ns INTEGER NOT NULL
);
CREATE TABLE objects (
    id BLOB PRIMARY KEY,
    kind INTEGER NOT NULL,
    pack INTEGER NOT NULL REFERENCES packs(id),
    offset INTEGER NOT NULL,
    stored_len INTEGER NOT NULL,
    raw_len INTEGER NOT NULL,
    codec INTEGER NOT NULL,
    block_offset INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TABLE snapshots (
    id BLOB PRIMARY KEY,
    seq INTEGER NOT NULL UNIQUE,
    tree BLOB NOT NULL,
    time_ns INTEGER NOT NULL,
    message TEXT NOT NULL,
    source TEXT NOT NULL,
    files INTEGER NOT NULL,
    bytes INTEGER NOT NULL
);
CREATE TABLE snapshot_parents (
    child BLOB NOT NULL,
    idx INTEGER NOT NULL,
    parent BLOB NOT NULL,
    PRIMARY KEY (child, idx)
) WITHOUT ROWID;
CREATE INDEX snapshot_parents_parent ON snapshot_parents(parent);
CREATE TABLE tags (name TEXT PRIMARY KEY, snapshot BLOB NOT NULL);
CREATE TABLE heads (path TEXT PRIMARY KEY, snapshot BLOB NOT NULL);
";

/// Folds the WAL into the database and truncates it. Best effort: whatever it
/// holds is committed either way.
pub(crate) fn fold_wal(db: &Connection) {
    let _ = db.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()));
}

/// Wall-clock time in ns since the Unix epoch (0 if the clock is before it).
pub fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// What the metadata says about one snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct SnapshotInfo {
    pub id: ObjectId,
    pub seq: i64,
    pub tree: ObjectId,
    pub time_ns: u64,
    pub message: String,
    pub source: String,
    pub parents: Vec<ObjectId>,
    /// Tags that point at it now.
    pub tags: Vec<String>,
    pub files: u64,
    pub bytes: u64,
}

/// A snapshot to record in [`WriteLock::commit`].
#[derive(Debug, Clone, Default)]
pub struct NewSnapshot {
    pub tree: ObjectId,
    pub parents: Vec<ObjectId>,
    pub message: String,
    pub source: String,
    pub tags: Vec<String>,
    pub attachments: Vec<Attachment>,
    pub files: u64,
    pub bytes: u64,
    /// Set this directory's head to the new snapshot.
    pub head: Option<String>,
    /// Move tags that exist already instead of refusing.
    pub force_tags: bool,
}

impl NewSnapshot {
    /// A snapshot of `tree` with no parents, message, tags or attachments.
    pub fn new(tree: ObjectId) -> NewSnapshot {
        NewSnapshot {
            tree,
            ..NewSnapshot::default()
        }
    }
}

/// What a commit wrote.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct CommitStats {
    pub snapshot: Option<ObjectId>,
    pub pack: Option<String>,
    pub new_objects: u64,
    /// Bytes added to the store (pack size).
    pub new_bytes: u64,
}

/// Row of the object index.
#[derive(Debug, Clone, Copy)]
pub struct ObjectLocation {
    pub pack: i64,
    pub entry: PackEntry,
}

/// Decompressed blocks by (pack, frame offset), oldest first.
type BlockCache = std::collections::VecDeque<((i64, u64), Arc<Vec<u8>>)>;

/// An open repository.
#[derive(Debug)]
pub struct Repository {
    root: PathBuf,
    db: Mutex<Connection>,
    packs: Mutex<HashMap<i64, (String, Arc<File>)>>,
    /// Recently decompressed blocks, so neighbouring small objects cost one decompression.
    blocks: Mutex<BlockCache>,
    repo_id: String,
    gc_lock: File,
}

fn db_err<'a>(
    path: &'a Path,
    step: &'static str,
) -> impl FnOnce(rusqlite::Error) -> OpenError + 'a {
    move |source| OpenError::Db {
        step,
        path: path.to_path_buf(),
        source,
    }
}

fn open_io<'a>(
    path: &'a Path,
    step: &'static str,
) -> impl FnOnce(std::io::Error) -> OpenError + 'a {
    move |source| OpenError::Io {
        step,
        path: path.to_path_buf(),
        source,
    }
}

/// WAL pages after which a commit folds the WAL into the database.
const WAL_CHECKPOINT_PAGES: u32 = 64;

fn configure(conn: &Connection) -> rusqlite::Result<()> {
    conn.pragma_update(None, "journal_mode", "WAL")?;
    // FULL: a committed snapshot survives power loss, not just a process crash.
    conn.pragma_update(None, "synchronous", "FULL")?;
    conn.busy_timeout(std::time::Duration::from_secs(30))?;
    // Checkpointing on close would make every short CLI call pay for copying the
    // WAL into the database; SQLite's automatic checkpoint amortizes it instead.
    conn.set_db_config(
        rusqlite::config::DbConfig::SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE,
        true,
    )?;
    // But often: each process that opens the database first reads every frame
    // of the WAL to index it (1.7 ms at SQLite's default of 1,000 pages, 0.9
    // ms on average per CLI call), while a checkpoint of the few pages a
    // snapshot touches costs one sync every few commits.
    conn.pragma_update(None, "wal_autocheckpoint", WAL_CHECKPOINT_PAGES)?;
    Ok(())
}

/// Sets `path`'s mode to `mode` (no group or other bits).
fn owner_only(path: &Path, mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
}

fn lock_file(path: &Path) -> Result<File, OpenError> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(open_io(path, "open lock file"))
}

impl Repository {
    /// Creates a repository at `path` (a new or empty directory).
    pub fn init(path: &Path) -> Result<Repository, OpenError> {
        if path.join(FORMAT_FILE).exists() {
            return Err(OpenError::AlreadyExists {
                path: path.to_path_buf(),
            });
        }
        fs::create_dir_all(path).map_err(open_io(path, "create directory"))?;
        owner_only(path, 0o700).map_err(open_io(path, "make private"))?;
        fs::create_dir_all(path.join(PACKS_DIR)).map_err(open_io(path, "create directory"))?;
        fs::create_dir_all(path.join(CACHE_DIR)).map_err(open_io(path, "create directory"))?;
        let db_path = path.join(DB_FILE);
        {
            let mut conn = Connection::open(&db_path).map_err(db_err(&db_path, "create"))?;
            // SQLite gives its -wal and -shm files the database's mode.
            owner_only(&db_path, 0o600).map_err(open_io(&db_path, "make private"))?;
            configure(&conn).map_err(db_err(&db_path, "configure"))?;
            let tx = conn.transaction().map_err(db_err(&db_path, "begin"))?;
            let has_schema: bool = tx
                .query_row(
                    "SELECT count(*) FROM sqlite_master WHERE name = 'meta'",
                    [],
                    |r| r.get::<_, i64>(0),
                )
                .map_err(db_err(&db_path, "inspect schema"))?
                > 0;
            if !has_schema {
                tx.execute_batch(SCHEMA)
                    .map_err(db_err(&db_path, "create schema"))?;
                let repo_id =
                    blake3::hash(format!("{}-{}", now_ns(), std::process::id()).as_bytes())
                        .to_hex()[..32]
                        .to_string();
                tx.execute(
                    "INSERT INTO meta (key, value) VALUES ('format', ?1), ('repo_id', ?2), ('gc_generation', '0')",
                    params![REPO_FORMAT.to_string(), repo_id],
                )
                .map_err(db_err(&db_path, "write meta"))?;
            }
            tx.commit().map_err(db_err(&db_path, "commit"))?;
        }
        // The FORMAT file is written last: its presence marks a complete repository.
        write_atomic(
            &path.join(FORMAT_FILE),
            format!("tine-repository {REPO_FORMAT}\n").as_bytes(),
        )
        .map_err(open_io(path, "write FORMAT"))?;
        Repository::open(path)
    }

    /// Opens an existing repository.
    pub fn open(path: &Path) -> Result<Repository, OpenError> {
        let format_path = path.join(FORMAT_FILE);
        let format = match fs::read_to_string(&format_path) {
            Ok(s) => s,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(OpenError::NotARepository {
                    path: path.to_path_buf(),
                });
            }
            Err(e) => return Err(open_io(&format_path, "read")(e)),
        };
        if format.trim() != format!("tine-repository {REPO_FORMAT}") {
            return Err(OpenError::Version {
                path: path.to_path_buf(),
                found: format.trim().to_string(),
                supported: REPO_FORMAT,
            });
        }
        // A repository made before it was private (or loosened by hand) is
        // made so by its owner: it holds every sandbox's files and upper
        // layers, which may carry set-user-ID programs. Others' opens
        // (read-only access) leave it as it is.
        if fs::symlink_metadata(path).is_ok_and(|m| m.mode() & 0o077 != 0) {
            let _ = owner_only(path, 0o700);
        }
        let gc_lock = lock_file(&path.join(GC_LOCK))?;
        gc_lock
            .lock_shared()
            .map_err(open_io(path, "take shared gc lock"))?;
        let db_path = path.join(DB_FILE);
        let conn = Connection::open(&db_path).map_err(db_err(&db_path, "open"))?;
        configure(&conn).map_err(db_err(&db_path, "configure"))?;
        let repo_id: String = conn
            .query_row("SELECT value FROM meta WHERE key = 'repo_id'", [], |r| {
                r.get(0)
            })
            .map_err(db_err(&db_path, "read meta"))?;
        // Tables added after format 1 was first written are created on first
        // use (one query on every open: which of them exist).
        let later: [(&str, &str, &'static str); 8] = [
            (
                "sandboxes",
                crate::records::SANDBOX_SCHEMA,
                "create sandbox table",
            ),
            (
                "workspace_states",
                crate::workspaces::WORKSPACE_SCHEMA,
                "create workspace tables",
            ),
            (
                "ledger_heads",
                crate::ledger::LEDGER_SCHEMA,
                "create ledger tables",
            ),
            (
                "remotes",
                crate::remotes::REMOTE_SCHEMA,
                "create remote table",
            ),
            (
                "ledger_seal",
                crate::ledger::LEDGER_SEAL_SCHEMA,
                "create ledger seal tables",
            ),
            (
                "graph_threads",
                crate::graph::GRAPH_SCHEMA,
                "create graph checkpoint tables",
            ),
            (
                "image_layers",
                crate::images::IMAGE_SCHEMA,
                "create image tables",
            ),
            (
                "build_steps",
                crate::images::BUILD_SCHEMA,
                "create build cache table",
            ),
        ];
        let present: Vec<String> = conn
            .prepare(
                "SELECT name FROM sqlite_master WHERE name IN ('sandboxes', 'workspace_states', 'ledger_heads', 'remotes', 'ledger_seal', 'graph_threads', 'image_layers', 'build_steps')",
            )
            .and_then(|mut q| q.query_map([], |r| r.get(0))?.collect())
            .map_err(db_err(&db_path, "inspect schema"))?;
        for (table, schema, step) in later {
            if !present.iter().any(|p| p == table) {
                conn.execute_batch(schema).map_err(db_err(&db_path, step))?;
            }
        }
        Ok(Repository {
            root: path.to_path_buf(),
            db: Mutex::new(conn),
            packs: Mutex::new(HashMap::new()),
            blocks: Mutex::new(std::collections::VecDeque::new()),
            repo_id,
            gc_lock,
        })
    }

    /// Runs `f` inside one database read transaction: its many small lookups
    /// then share one snapshot of the database and one lock round-trip (what a
    /// sandbox rollback does while the sandbox is frozen). `f` must not write.
    pub fn in_read_transaction<T>(&self, f: impl FnOnce() -> T) -> T {
        let began = self.db().execute_batch("BEGIN").is_ok();
        let out = f();
        if began {
            let _ = self.db().execute_batch("COMMIT");
        }
        out
    }

    /// For a connection that only records sandbox states (a supervisor): its
    /// commits reach the disk with the next checkpoint instead of each one being
    /// fsynced. A state lost to a power cut is corrected by `tine ps`, which asks
    /// the supervisor; snapshots are never committed through such a connection.
    pub fn relax_durability(&self) {
        let _ = self.db().pragma_update(None, "synchronous", "NORMAL");
    }

    /// The repository directory (`.tine`).
    pub fn path(&self) -> &Path {
        &self.root
    }

    pub fn packs_dir(&self) -> PathBuf {
        self.root.join(PACKS_DIR)
    }

    /// Where caches (stat caches) live; they are never needed for correctness.
    pub fn cache_dir(&self) -> PathBuf {
        self.root.join(CACHE_DIR)
    }

    /// A random id fixed at `init`.
    pub fn repo_id(&self) -> &str {
        &self.repo_id
    }

    pub(crate) fn db(&self) -> MutexGuard<'_, Connection> {
        self.db.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counter bumped by every gc that removes objects; caches of object ids
    /// made under another generation must be re-validated.
    pub fn gc_generation(&self) -> Result<u64, ObjectError> {
        let v: String = self
            .db()
            .query_row(
                "SELECT value FROM meta WHERE key = 'gc_generation'",
                [],
                |r| r.get(0),
            )
            .map_err(|source| ObjectError::Db {
                step: "read gc generation",
                source,
            })?;
        Ok(v.parse().unwrap_or(0))
    }

    /// Takes the single-writer lock. With `wait` false, fails at once if held.
    pub fn lock(&self, wait: bool) -> Result<WriteLock<'_>, OpenError> {
        let path = self.root.join(WRITE_LOCK);
        let mut file = lock_file(&path)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(fs::TryLockError::WouldBlock) if wait => {
                file.lock().map_err(open_io(&path, "take write lock"))?
            }
            Err(fs::TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                return Err(OpenError::Locked {
                    path: self.root.clone(),
                    holder: if holder.trim().is_empty() {
                        "unknown process".into()
                    } else {
                        holder.trim().to_string()
                    },
                });
            }
            Err(fs::TryLockError::Error(e)) => return Err(open_io(&path, "take write lock")(e)),
        }
        // Record the holder for the error message of whoever waits next.
        let _ = file.set_len(0);
        let _ = file.write_all(format!("pid {}", std::process::id()).as_bytes());
        Ok(WriteLock {
            repo: self,
            _file: file,
        })
    }

    /// Upgrades this handle's shared gc lock to exclusive (waits for readers).
    pub(crate) fn gc_lock_exclusive(&self) -> Result<(), crate::MaintenanceError> {
        self.gc_lock
            .lock()
            .map_err(|source| crate::MaintenanceError::Io {
                step: "take exclusive gc lock",
                path: self.root.join(GC_LOCK),
                source,
            })
    }

    pub(crate) fn gc_lock_shared(&self) -> Result<(), crate::MaintenanceError> {
        self.gc_lock
            .lock_shared()
            .map_err(|source| crate::MaintenanceError::Io {
                step: "take shared gc lock",
                path: self.root.join(GC_LOCK),
                source,
            })
    }

    /// Drops cached pack handles (after gc removed or replaced packs).
    pub(crate) fn forget_open_packs(&self) {
        self.packs.lock().unwrap_or_else(|e| e.into_inner()).clear();
        self.forget_blocks();
    }

    /// Forgets decompressed blocks, so the next reads see what is on disk now
    /// (an operation that must notice damage, like restore, starts with this).
    pub fn forget_blocks(&self) {
        self.blocks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }
}
