//! Reading a repository: where objects are, their bytes (each re-hashed),
//! trees, snapshots and their metadata, names (tags, id prefixes) and heads.

use crate::error::{ObjectError, ResolveError};
use crate::id::{Kind, ObjectId, is_hex_prefix};
use crate::object::{ChunkList, Content, SnapshotObject, Tree};
use crate::pack::{self, PackEntry};
use rusqlite::OptionalExtension;
use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::{MIN_PREFIX, ObjectLocation, Repository, SnapshotInfo};

impl Repository {
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
                let zeros = vec![0u8; 64 << 10];
                for (chunk, len) in &list.chunks {
                    if *chunk == ChunkList::HOLE {
                        let mut left = u64::from(*len);
                        while left > 0 {
                            let n = left.min(zeros.len() as u64) as usize;
                            write(out, &zeros[..n])?;
                            left -= n as u64;
                        }
                        continue;
                    }
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
        self.query_snapshots(None)
    }

    pub fn snapshot_info(&self, id: &ObjectId) -> Result<Option<SnapshotInfo>, ObjectError> {
        Ok(self.query_snapshots(Some(id))?.into_iter().next())
    }

    /// Every snapshot, or only `one` (its parents and tags read alone, not
    /// every snapshot's: a rollback's pause asks for one, and a long
    /// history made that 0.1 ms).
    fn query_snapshots(&self, one: Option<&ObjectId>) -> Result<Vec<SnapshotInfo>, ObjectError> {
        let db = self.db();
        let dberr = |step| move |source| ObjectError::Db { step, source };
        let key: Vec<u8> = one.map(|id| id.as_bytes().to_vec()).unwrap_or_default();
        let (of_child, of_snapshot, filter) = if one.is_some() {
            ("WHERE child = ?1", "WHERE snapshot = ?1", "WHERE id = ?1")
        } else {
            // (Every row; the parameter is bound either way.)
            ("WHERE ?1 = ?1", "WHERE ?1 = ?1", "WHERE ?1 = ?1")
        };
        let mut parents: HashMap<ObjectId, Vec<ObjectId>> = HashMap::new();
        let mut stmt = db
            .prepare_cached(&format!(
                "SELECT child, parent FROM snapshot_parents {of_child} ORDER BY child, idx"
            ))
            .map_err(dberr("prepare parents"))?;
        let rows = stmt
            .query_map([&key], |r| {
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
            .prepare_cached(&format!(
                "SELECT name, snapshot FROM tags {of_snapshot} ORDER BY name"
            ))
            .map_err(dberr("prepare tags"))?;
        let rows = stmt
            .query_map([&key], |r| {
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
        let mut stmt = db
            .prepare_cached(&sql)
            .map_err(dberr("prepare snapshots"))?;
        let rows = stmt
            .query_map([&key], |r| {
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
