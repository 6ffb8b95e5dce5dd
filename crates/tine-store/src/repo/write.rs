//! Writing a repository as its one writer ([`WriteLock`]): packs built by
//! many threads, the commit that makes a snapshot durable and recorded, tags,
//! heads and snapshot deletion; atomic file writes.

use crate::error::{ObjectError, WriteError};
use crate::id::{Kind, ObjectId, is_hex_prefix};
use crate::object::SnapshotObject;
use crate::pack::{self, Density, Encoded, PackEntry, PackWriter};
use rusqlite::params;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::Path;
use std::sync::Mutex;

use super::{CommitStats, NewSnapshot, Repository, fold_wal, now_ns};

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
    pub(super) repo: &'r Repository,
    pub(super) _file: File,
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
