//! The repository: packs of objects plus SQLite metadata, guarded by file locks.
//!
//! Locks (advisory `flock`s, released by the kernel when a process dies):
//! - `gc.lock`: every open [`Repository`] holds it shared; `gc` takes it exclusive,
//!   so packs never disappear under a reader.
//! - `write.lock`: held exclusive by a [`WriteLock`]; one writer at a time.

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use rusqlite::{Connection, OptionalExtension, params};
use serde::Serialize;

use crate::error::{ObjectError, OpenError, ResolveError, WriteError};
use crate::id::{Kind, ObjectId, is_hex_prefix};
use crate::object::{Attachment, ChunkList, Content, SnapshotObject, Tree};
use crate::pack::{self, Density, Encoded, PackEntry, PackWriter};

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
#[derive(Debug, Clone, Serialize)]
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
#[derive(Debug, Clone, Serialize)]
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
        let later: [(&str, &str, &'static str); 5] = [
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
        ];
        let present: Vec<String> = conn
            .prepare(
                "SELECT name FROM sqlite_master WHERE name IN ('sandboxes', 'workspace_states', 'ledger_heads', 'remotes', 'ledger_seal')",
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

    /// Where an object is stored, if it is.
    pub fn locate(&self, id: &ObjectId) -> Result<Option<ObjectLocation>, ObjectError> {
        let db = self.db();
        let mut stmt = db
            .prepare_cached(
                "SELECT kind, pack, offset, stored_len, raw_len, codec, block_offset FROM objects WHERE id = ?1",
            )
            .map_err(|source| ObjectError::Db {
                step: "prepare object lookup",
                source,
            })?;
        stmt.query_row([id.as_bytes().as_slice()], |r| {
            Ok((
                r.get::<_, u8>(0)?,
                r.get::<_, i64>(1)?,
                r.get::<_, i64>(2)? as u64,
                r.get::<_, u32>(3)?,
                r.get::<_, u32>(4)?,
                r.get::<_, u8>(5)?,
                r.get::<_, u32>(6)?,
            ))
        })
        .optional()
        .map_err(|source| ObjectError::Db {
            step: "look up object",
            source,
        })?
        .map(
            |(kind, pack, offset, stored_len, raw_len, codec, block_offset)| {
                let kind = Kind::from_u8(kind).ok_or_else(|| ObjectError::Damaged {
                    id: *id,
                    pack: pack.to_string(),
                    offset,
                    reason: format!("index has unknown kind {kind}"),
                })?;
                Ok(ObjectLocation {
                    pack,
                    entry: PackEntry {
                        id: *id,
                        kind,
                        codec,
                        raw_len,
                        stored_len,
                        offset,
                        block_offset,
                    },
                })
            },
        )
        .transpose()
    }

    pub fn has_object(&self, id: &ObjectId) -> Result<bool, ObjectError> {
        Ok(self.locate(id)?.is_some())
    }

    pub(crate) fn pack_file(&self, pack: i64) -> Result<(String, Arc<File>), ObjectError> {
        if let Some(p) = self
            .packs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&pack)
        {
            return Ok(p.clone());
        }
        let name: String = self
            .db()
            .query_row("SELECT name FROM packs WHERE id = ?1", [pack], |r| r.get(0))
            .map_err(|source| ObjectError::Db {
                step: "look up pack",
                source,
            })?;
        let path = self.pack_path(&name);
        let file = File::open(&path).map_err(|source| ObjectError::Io {
            step: "open pack",
            path: path.clone(),
            source,
        })?;
        let entry = (name, Arc::new(file));
        self.packs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(pack, entry.clone());
        Ok(entry)
    }

    pub fn pack_path(&self, name: &str) -> PathBuf {
        self.packs_dir()
            .join(format!("{name}{}", pack::PACK_SUFFIX))
    }

    /// Reads and verifies one object (its hash is always checked).
    pub fn read_object(&self, id: &ObjectId) -> Result<(Kind, Vec<u8>), ObjectError> {
        let loc = self.locate(id)?.ok_or(ObjectError::Missing { id: *id })?;
        let (name, file) = self.pack_file(loc.pack)?;
        let raw = match loc.entry.codec {
            pack::CODEC_BLOCK | pack::CODEC_RAW_BLOCK => self
                .block(loc.pack, &file, &loc.entry)
                .and_then(|frame| pack::extract(&frame, &loc.entry)),
            _ => pack::read_verified(&file, &loc.entry),
        }
        .map_err(|reason| ObjectError::Damaged {
            id: *id,
            pack: name,
            offset: loc.entry.offset,
            reason,
        })?;
        Ok((loc.entry.kind, raw))
    }

    /// The decompressed block holding `e`, from the cache or the pack. Every member
    /// read from it is still re-hashed by [`pack::extract`].
    fn block(&self, pack: i64, file: &File, e: &PackEntry) -> Result<Arc<Vec<u8>>, String> {
        const CACHED_BLOCKS: usize = 64;
        let key = (pack, e.offset);
        let cached = self
            .blocks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, b)| b.clone());
        if let Some(b) = cached {
            return Ok(b);
        }
        let frame = Arc::new(pack::read_frame(file, e)?);
        let mut cache = self.blocks.lock().unwrap_or_else(|e| e.into_inner());
        if cache.len() >= CACHED_BLOCKS {
            cache.pop_front();
        }
        cache.push_back((key, frame.clone()));
        Ok(frame)
    }

    /// Reads an object that must be of `kind`.
    pub fn read_kind(&self, id: &ObjectId, kind: Kind) -> Result<Vec<u8>, ObjectError> {
        let (found, raw) = self.read_object(id)?;
        if found != kind {
            return Err(ObjectError::WrongKind {
                id: *id,
                expected: kind,
                found,
            });
        }
        Ok(raw)
    }

    pub fn read_tree(&self, id: &ObjectId) -> Result<Tree, ObjectError> {
        let raw = self.read_kind(id, Kind::Tree)?;
        Tree::decode(&raw).map_err(|source| ObjectError::Decode {
            id: *id,
            kind: Kind::Tree,
            source,
        })
    }

    pub fn read_chunk_list(&self, id: &ObjectId) -> Result<ChunkList, ObjectError> {
        let raw = self.read_kind(id, Kind::Chunked)?;
        ChunkList::decode(&raw).map_err(|source| ObjectError::Decode {
            id: *id,
            kind: Kind::Chunked,
            source,
        })
    }

    pub fn read_snapshot(&self, id: &ObjectId) -> Result<SnapshotObject, ObjectError> {
        let raw = self.read_kind(id, Kind::Snapshot)?;
        SnapshotObject::decode(&raw).map_err(|source| ObjectError::Decode {
            id: *id,
            kind: Kind::Snapshot,
            source,
        })
    }

    /// Writes a file's content (a blob or all chunks of a chunk list) to `out`.
    pub fn write_content(
        &self,
        content: &Content,
        out: &mut dyn Write,
        path_for_errors: &Path,
    ) -> Result<u64, ObjectError> {
        let write = |out: &mut dyn Write, b: &[u8]| {
            out.write_all(b).map_err(|source| ObjectError::Io {
                step: "write",
                path: path_for_errors.to_path_buf(),
                source,
            })
        };
        match content.kind {
            Kind::Chunked => {
                let list = self.read_chunk_list(&content.id)?;
                for (chunk, _) in &list.chunks {
                    write(out, &self.read_kind(chunk, Kind::Blob)?)?;
                }
                Ok(list.size)
            }
            _ => {
                let raw = self.read_kind(&content.id, Kind::Blob)?;
                write(out, &raw)?;
                Ok(raw.len() as u64)
            }
        }
    }

    /// Snapshot metadata, oldest first.
    pub fn snapshots(&self) -> Result<Vec<SnapshotInfo>, ObjectError> {
        self.query_snapshots("", [])
    }

    pub fn snapshot_info(&self, id: &ObjectId) -> Result<Option<SnapshotInfo>, ObjectError> {
        Ok(self
            .query_snapshots("WHERE id = ?1", [id.as_bytes().to_vec()])?
            .into_iter()
            .next())
    }

    fn query_snapshots<P: rusqlite::Params>(
        &self,
        filter: &str,
        p: P,
    ) -> Result<Vec<SnapshotInfo>, ObjectError> {
        let db = self.db();
        let dberr = |step| move |source| ObjectError::Db { step, source };
        let mut parents: HashMap<ObjectId, Vec<ObjectId>> = HashMap::new();
        let mut stmt = db
            .prepare_cached("SELECT child, parent FROM snapshot_parents ORDER BY child, idx")
            .map_err(dberr("prepare parents"))?;
        let rows = stmt
            .query_map([], |r| {
                Ok((r.get::<_, Vec<u8>>(0)?, r.get::<_, Vec<u8>>(1)?))
            })
            .map_err(dberr("read parents"))?;
        for row in rows {
            let (c, p) = row.map_err(dberr("read parents"))?;
            if let (Some(c), Some(p)) = (ObjectId::from_slice(&c), ObjectId::from_slice(&p)) {
                parents.entry(c).or_default().push(p);
            }
        }
        let mut tags: HashMap<ObjectId, Vec<String>> = HashMap::new();
        let mut stmt = db
            .prepare_cached("SELECT name, snapshot FROM tags ORDER BY name")
            .map_err(dberr("prepare tags"))?;
        let rows = stmt
            .query_map([], |r| {
                Ok((r.get::<_, String>(0)?, r.get::<_, Vec<u8>>(1)?))
            })
            .map_err(dberr("read tags"))?;
        for row in rows {
            let (n, s) = row.map_err(dberr("read tags"))?;
            if let Some(s) = ObjectId::from_slice(&s) {
                tags.entry(s).or_default().push(n);
            }
        }
        let sql = format!(
            "SELECT id, seq, tree, time_ns, message, source, files, bytes FROM snapshots {filter} ORDER BY seq"
        );
        let mut stmt = db.prepare(&sql).map_err(dberr("prepare snapshots"))?;
        let rows = stmt
            .query_map(p, |r| {
                Ok((
                    r.get::<_, Vec<u8>>(0)?,
                    r.get::<_, i64>(1)?,
                    r.get::<_, Vec<u8>>(2)?,
                    r.get::<_, i64>(3)?,
                    r.get::<_, String>(4)?,
                    r.get::<_, String>(5)?,
                    r.get::<_, i64>(6)?,
                    r.get::<_, i64>(7)?,
                ))
            })
            .map_err(dberr("read snapshots"))?;
        let mut out = Vec::new();
        for row in rows {
            let (id, seq, tree, time_ns, message, source, files, bytes) =
                row.map_err(dberr("read snapshots"))?;
            let (Some(id), Some(tree)) = (ObjectId::from_slice(&id), ObjectId::from_slice(&tree))
            else {
                continue;
            };
            out.push(SnapshotInfo {
                id,
                seq,
                tree,
                time_ns: time_ns as u64,
                message,
                source,
                parents: parents.remove(&id).unwrap_or_default(),
                tags: tags.remove(&id).unwrap_or_default(),
                files: files as u64,
                bytes: bytes as u64,
            });
        }
        Ok(out)
    }

    /// Resolves a tag or a unique hex prefix (at least [`MIN_PREFIX`] digits) to a snapshot.
    pub fn resolve(&self, spec: &str) -> Result<ObjectId, ResolveError> {
        let db = self.db();
        let dberr = |step| move |source| ResolveError::Db { step, source };
        let tagged: Option<Vec<u8>> = db
            .query_row("SELECT snapshot FROM tags WHERE name = ?1", [spec], |r| {
                r.get(0)
            })
            .optional()
            .map_err(dberr("look up tag"))?;
        if let Some(id) = tagged.and_then(|b| ObjectId::from_slice(&b)) {
            return Ok(id);
        }
        if !is_hex_prefix(spec) {
            return Err(ResolveError::NotFound { spec: spec.into() });
        }
        if spec.len() < MIN_PREFIX {
            return Err(ResolveError::TooShort {
                spec: spec.into(),
                min: MIN_PREFIX,
            });
        }
        let lo = ObjectId::from_hex(&format!("{:0<64}", spec.to_ascii_lowercase())).expect("hex");
        let hi = ObjectId::from_hex(&format!("{:f<64}", spec.to_ascii_lowercase())).expect("hex");
        let mut stmt = db
            .prepare_cached("SELECT id FROM snapshots WHERE id >= ?1 AND id <= ?2 LIMIT 6")
            .map_err(dberr("prepare prefix lookup"))?;
        let ids = stmt
            .query_map([lo.as_bytes().as_slice(), hi.as_bytes().as_slice()], |r| {
                r.get::<_, Vec<u8>>(0)
            })
            .map_err(dberr("prefix lookup"))?
            .filter_map(|r| r.ok().and_then(|b| ObjectId::from_slice(&b)))
            .collect::<Vec<_>>();
        match ids.as_slice() {
            [] => Err(ResolveError::NotFound { spec: spec.into() }),
            [one] => Ok(*one),
            many => Err(ResolveError::Ambiguous {
                spec: spec.into(),
                candidates: many.iter().map(|i| i.short()).collect(),
            }),
        }
    }

    /// All tags and the snapshots they point at, by name.
    pub fn tags(&self) -> Result<Vec<(String, ObjectId)>, ObjectError> {
        self.string_id_rows("SELECT name, snapshot FROM tags ORDER BY name")
    }

    /// Directory heads: the snapshot each known directory was last snapshotted or restored to.
    pub fn heads(&self) -> Result<Vec<(String, ObjectId)>, ObjectError> {
        self.string_id_rows("SELECT path, snapshot FROM heads ORDER BY path")
    }

    pub fn head(&self, path: &str) -> Result<Option<ObjectId>, ObjectError> {
        let b: Option<Vec<u8>> = self
            .db()
            .query_row("SELECT snapshot FROM heads WHERE path = ?1", [path], |r| {
                r.get(0)
            })
            .optional()
            .map_err(|source| ObjectError::Db {
                step: "read head",
                source,
            })?;
        Ok(b.and_then(|b| ObjectId::from_slice(&b)))
    }

    fn string_id_rows(&self, sql: &str) -> Result<Vec<(String, ObjectId)>, ObjectError> {
        let db = self.db();
        let dberr = |source| ObjectError::Db {
            step: "read refs",
            source,
        };
        let mut stmt = db.prepare_cached(sql).map_err(dberr)?;
        let rows = stmt
            .query_map([], |r| {
                Ok((r.get::<_, String>(0)?, r.get::<_, Vec<u8>>(1)?))
            })
            .map_err(dberr)?;
        let mut out = Vec::new();
        for r in rows {
            let (n, b) = r.map_err(dberr)?;
            if let Some(id) = ObjectId::from_slice(&b) {
                out.push((n, id));
            }
        }
        Ok(out)
    }

    /// Total bytes of all registered packs.
    pub fn store_bytes(&self) -> Result<u64, ObjectError> {
        self.db()
            .query_row("SELECT coalesce(sum(bytes), 0) FROM packs", [], |r| {
                r.get::<_, i64>(0)
            })
            .map(|v| v as u64)
            .map_err(|source| ObjectError::Db {
                step: "sum pack sizes",
                source,
            })
    }
}

/// Checks a tag name: printable, no whitespace, not a path escape, not hex-only
/// (which would shadow id prefixes).
pub fn check_tag_name(name: &str) -> Result<(), WriteError> {
    let bad = |reason| WriteError::Invalid {
        what: "tag name",
        value: name.to_string(),
        reason,
    };
    if name.is_empty() || name.len() > 200 {
        return Err(bad("must be 1 to 200 characters"));
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '/' | '+' | '@'))
    {
        return Err(bad("use letters, digits and . _ - / + @ only"));
    }
    if name.starts_with(['-', '.', '/']) {
        return Err(bad("must not start with '-', '.' or '/'"));
    }
    if is_hex_prefix(name) {
        return Err(bad(
            "a tag of hex digits only would be confused with a snapshot id",
        ));
    }
    Ok(())
}

/// Proof that this process is the repository's only writer.
#[derive(Debug)]
pub struct WriteLock<'r> {
    repo: &'r Repository,
    _file: File,
}

/// Objects being collected into one new pack. Safe to share between threads.
#[derive(Debug)]
pub struct PackBuilder<'r> {
    repo: &'r Repository,
    writer: Mutex<PackWriter>,
}

impl PackBuilder<'_> {
    /// Stores `raw` as an object of `kind` unless the repository or this pack has it.
    /// Compression happens outside the lock, so callers can run in parallel.
    pub fn put(&self, kind: Kind, raw: &[u8]) -> Result<ObjectId, WriteError> {
        let id = ObjectId::compute(kind, raw);
        self.put_with_id(kind, id, raw)?;
        Ok(id)
    }

    /// Like [`PackBuilder::put`] for a caller that has already computed the id.
    pub fn put_with_id(&self, kind: Kind, id: ObjectId, raw: &[u8]) -> Result<bool, WriteError> {
        if self.contains(&id)? {
            return Ok(false);
        }
        if raw.len() < Density::Fast.small_object() {
            let (added, full) = self
                .writer
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push_small(kind, id, raw);
            if let Some(block) = full {
                // Compress outside the lock; other threads keep filling the next block.
                let enc = block.compress();
                self.writer
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .add_block(enc)
                    .map_err(WriteError::from)?;
            }
            return Ok(added);
        }
        let enc = pack::encode(kind, id, raw, Density::Fast);
        self.add_encoded(&enc)
    }

    pub fn add_encoded(&self, enc: &Encoded) -> Result<bool, WriteError> {
        let mut w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        w.add(enc).map_err(WriteError::from)
    }

    /// True if the repository or this pack already holds `id`.
    pub fn contains(&self, id: &ObjectId) -> Result<bool, WriteError> {
        if self
            .writer
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(id)
        {
            return Ok(true);
        }
        Ok(self.repo.has_object(id)?)
    }
}

impl<'r> WriteLock<'r> {
    pub fn repo(&self) -> &'r Repository {
        self.repo
    }

    /// Starts collecting objects for one pack.
    pub fn pack(&self) -> Result<PackBuilder<'r>, WriteError> {
        let dir = self.repo.packs_dir();
        let writer = PackWriter::create(&dir, Density::Fast).map_err(WriteError::from)?;
        Ok(PackBuilder {
            repo: self.repo,
            writer: Mutex::new(writer),
        })
    }

    /// Makes the pack durable, then records it, its objects and (optionally) a
    /// snapshot in one SQLite transaction. Until that transaction commits, nothing
    /// refers to the new pack, so a crash at any point leaves only an unreferenced
    /// leftover for `gc`.
    pub fn commit(
        &self,
        pack: PackBuilder<'r>,
        snapshot: Option<NewSnapshot>,
    ) -> Result<CommitStats, WriteError> {
        let mut snap_row = None;
        if let Some(s) = snapshot {
            self.repo.check_new_tags(&s.tags, s.force_tags)?;
            let obj = SnapshotObject {
                tree: s.tree,
                parents: s.parents.clone(),
                time_ns: now_ns(),
                message: s.message.clone(),
                source: s.source.clone(),
                tags: s.tags.clone(),
                attachments: s.attachments.clone(),
            };
            let raw = obj.encode();
            let id = pack.put(Kind::Snapshot, &raw)?;
            snap_row = Some((id, obj, s));
        }
        let writer = pack.writer.into_inner().unwrap_or_else(|e| e.into_inner());
        let finished = if writer.is_empty() {
            None
        } else {
            Some(writer.finish().map_err(WriteError::from)?)
        };
        let mut db = self.repo.db();
        let dberr = |step| move |source| WriteError::Db { step, source };
        let tx = db.transaction().map_err(dberr("begin"))?;
        let mut stats = CommitStats {
            snapshot: None,
            pack: None,
            new_objects: 0,
            new_bytes: 0,
        };
        if let Some(p) = &finished {
            record_pack(&tx, p).map_err(dberr("record pack and objects"))?;
            stats.pack = Some(p.name.clone());
            stats.new_objects = p.entries.len() as u64;
            stats.new_bytes = p.bytes;
        }
        if let Some((id, obj, s)) = snap_row {
            insert_snapshot(&tx, &id, &obj, s.files, s.bytes)?;
            for t in &obj.tags {
                tx.execute(
                    "INSERT OR REPLACE INTO tags (name, snapshot) VALUES (?1, ?2)",
                    params![t, id.as_bytes().as_slice()],
                )
                .map_err(dberr("record tag"))?;
            }
            if let Some(h) = &s.head {
                tx.execute(
                    "INSERT OR REPLACE INTO heads (path, snapshot) VALUES (?1, ?2)",
                    params![h, id.as_bytes().as_slice()],
                )
                .map_err(dberr("record head"))?;
            }
            stats.snapshot = Some(id);
        }
        tx.commit().map_err(dberr("commit"))?;
        if stats.new_objects > 2000 {
            // A large commit filled the WAL; fold it into the database now rather than
            // leaving megabytes of log behind. Best effort: the data is committed.
            fold_wal(&db);
        }
        Ok(stats)
    }

    /// Points tag `name` at `snapshot`.
    pub fn set_tag(&self, name: &str, snapshot: &ObjectId, force: bool) -> Result<(), WriteError> {
        check_tag_name(name)?;
        if self.repo.snapshot_info(snapshot)?.is_none() {
            return Err(WriteError::NoSuchSnapshot { id: *snapshot });
        }
        if !force
            && let Some((_, target)) = self.repo.tags()?.into_iter().find(|(n, _)| n == name)
            && target != *snapshot
        {
            return Err(WriteError::TagExists {
                name: name.into(),
                target,
            });
        }
        self.repo
            .db()
            .execute(
                "INSERT OR REPLACE INTO tags (name, snapshot) VALUES (?1, ?2)",
                params![name, snapshot.as_bytes().as_slice()],
            )
            .map_err(|source| WriteError::Db {
                step: "write tag",
                source,
            })?;
        Ok(())
    }

    pub fn delete_tag(&self, name: &str) -> Result<ObjectId, WriteError> {
        let target = self
            .repo
            .resolve_tag(name)?
            .ok_or_else(|| WriteError::NoSuchTag { name: name.into() })?;
        self.repo
            .db()
            .execute("DELETE FROM tags WHERE name = ?1", [name])
            .map_err(|source| WriteError::Db {
                step: "delete tag",
                source,
            })?;
        Ok(target)
    }

    /// Deletes snapshot `id`'s metadata, so that `gc` sweeps what only it
    /// used. Refused while a child snapshot, a tag or a head (a directory's
    /// or a sandbox's current state) names it, or one of `also_depending`
    /// (what the caller knows depends on it, e.g. sandboxes based on it).
    pub fn delete_snapshot(
        &self,
        id: &ObjectId,
        also_depending: Vec<String>,
    ) -> Result<(), WriteError> {
        if self.repo.snapshot_info(id)?.is_none() {
            return Err(WriteError::NoSuchSnapshot { id: *id });
        }
        let db_err = |step| move |source| WriteError::Db { step, source };
        let mut by = also_depending;
        let children: Vec<Vec<u8>> = {
            let db = self.repo.db();
            let mut q = db
                .prepare("SELECT child FROM snapshot_parents WHERE parent = ?1")
                .map_err(db_err("find children"))?;
            q.query_map([id.as_bytes().as_slice()], |r| r.get::<_, Vec<u8>>(0))
                .map_err(db_err("find children"))?
                .collect::<Result<_, _>>()
                .map_err(db_err("find children"))?
        };
        for c in children.iter().filter_map(|c| ObjectId::from_slice(c)) {
            // A pruned child's row is gone with it; only listed ones count.
            if self.repo.snapshot_info(&c)?.is_some() {
                by.push(format!("snapshot {}", c.short()));
            }
        }
        for (name, t) in self.repo.tags()? {
            if t == *id {
                by.push(format!("tag {name}"));
            }
        }
        for (path, t) in self.repo.heads()? {
            if t == *id {
                by.push(format!("head {path}"));
            }
        }
        if !by.is_empty() {
            return Err(WriteError::Depended { id: *id, by });
        }
        let mut db = self.repo.db();
        let tx = db.transaction().map_err(db_err("begin"))?;
        let b = id.as_bytes().as_slice();
        tx.execute("DELETE FROM snapshots WHERE id = ?1", [b])
            .map_err(db_err("delete snapshot"))?;
        tx.execute("DELETE FROM snapshot_parents WHERE child = ?1", [b])
            .map_err(db_err("delete snapshot parents"))?;
        tx.commit().map_err(db_err("commit"))?;
        Ok(())
    }

    /// Forgets head `path` (nothing when there is none).
    pub fn delete_head(&self, path: &str) -> Result<(), WriteError> {
        self.repo
            .db()
            .execute("DELETE FROM heads WHERE path = ?1", [path])
            .map_err(|source| WriteError::Db {
                step: "delete head",
                source,
            })?;
        Ok(())
    }

    /// Records that directory `path` now holds `snapshot`.
    pub fn set_head(&self, path: &str, snapshot: &ObjectId) -> Result<(), WriteError> {
        self.repo
            .db()
            .execute(
                "INSERT OR REPLACE INTO heads (path, snapshot) VALUES (?1, ?2)",
                params![path, snapshot.as_bytes().as_slice()],
            )
            .map_err(|source| WriteError::Db {
                step: "write head",
                source,
            })?;
        Ok(())
    }
}

impl Repository {
    /// Checks that `tags` are valid names and, unless `force`, not taken yet.
    pub fn check_new_tags(&self, tags: &[String], force: bool) -> Result<(), WriteError> {
        if tags.is_empty() {
            return Ok(());
        }
        let existing = self.tags()?;
        for t in tags {
            check_tag_name(t)?;
            if !force && let Some((_, target)) = existing.iter().find(|(n, _)| n == t) {
                return Err(WriteError::TagExists {
                    name: t.clone(),
                    target: *target,
                });
            }
        }
        Ok(())
    }

    fn resolve_tag(&self, name: &str) -> Result<Option<ObjectId>, ObjectError> {
        Ok(self
            .tags()?
            .into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, id)| id))
    }
}

/// Records snapshot `id` (its object `obj`) with the next sequence number, and its parents.
pub(crate) fn insert_snapshot(
    tx: &rusqlite::Transaction<'_>,
    id: &ObjectId,
    obj: &SnapshotObject,
    files: u64,
    bytes: u64,
) -> Result<(), WriteError> {
    let dberr = |step| move |source| WriteError::Db { step, source };
    let seq: i64 = tx
        .query_row("SELECT coalesce(max(seq), 0) + 1 FROM snapshots", [], |r| {
            r.get(0)
        })
        .map_err(dberr("next sequence number"))?;
    tx.execute(
        "INSERT OR IGNORE INTO snapshots (id, seq, tree, time_ns, message, source, files, bytes) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
        params![
            id.as_bytes().as_slice(),
            seq,
            obj.tree.as_bytes().as_slice(),
            obj.time_ns as i64,
            obj.message,
            obj.source,
            files as i64,
            bytes as i64
        ],
    )
    .map_err(dberr("record snapshot"))?;
    for (i, p) in obj.parents.iter().enumerate() {
        tx.execute(
            "INSERT OR IGNORE INTO snapshot_parents (child, idx, parent) VALUES (?1, ?2, ?3)",
            params![id.as_bytes().as_slice(), i as i64, p.as_bytes().as_slice()],
        )
        .map_err(dberr("record parent"))?;
    }
    Ok(())
}

/// Records a durable pack and points every object in it at its place there
/// (replacing older locations: gc moves live objects this way).
pub(crate) fn record_pack(
    tx: &rusqlite::Transaction<'_>,
    p: &pack::FinishedPack,
) -> rusqlite::Result<i64> {
    tx.execute(
        "INSERT OR IGNORE INTO packs (name, bytes, objects, created_ns) VALUES (?1, ?2, ?3, ?4)",
        params![
            p.name,
            p.bytes as i64,
            p.entries.len() as i64,
            now_ns() as i64
        ],
    )?;
    let pack_id: i64 = tx.query_row("SELECT id FROM packs WHERE name = ?1", [&p.name], |r| {
        r.get(0)
    })?;
    let mut ins = tx.prepare_cached(
        "INSERT OR REPLACE INTO objects (id, kind, pack, offset, stored_len, raw_len, codec, block_offset) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
    )?;
    // In id order, so SQLite fills its B-tree pages densely.
    let mut sorted: Vec<&PackEntry> = p.entries.iter().collect();
    sorted.sort_unstable_by_key(|e| e.id);
    for e in sorted {
        ins.execute(params![
            e.id.as_bytes().as_slice(),
            e.kind as u8,
            pack_id,
            e.offset as i64,
            e.stored_len,
            e.raw_len,
            e.codec,
            e.block_offset
        ])?;
    }
    Ok(pack_id)
}

/// Writes `data` to `path` atomically: temporary file in the same directory,
/// fsync, rename, fsync of the directory.
pub fn write_atomic(path: &Path, data: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = pack::temp_path(dir, ".tmp");
    let result = (|| {
        let mut f = OpenOptions::new().write(true).create_new(true).open(&tmp)?;
        f.write_all(data)?;
        f.sync_all()?;
        fs::rename(&tmp, path)?;
        pack::sync_dir(dir)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}
