//! Moving objects between repositories (what remotes are built on): the objects
//! a set of snapshots needs, a pack made of chosen objects with their stored
//! frames copied as they are, and the verified import of a pack that came from
//! elsewhere.

use std::collections::{HashMap, HashSet};
use std::fs::{self, File};
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::error::{ObjectError, WriteError};
use crate::id::{Kind, ObjectId};
use crate::object::{SnapshotObject, references};
use crate::pack::{self, Density, Encoded, FinishedPack, PackEntry, PackWriter};
use crate::progress::Progress;
use crate::repo::{Repository, WriteLock, insert_snapshot, record_pack};

/// Every object reachable from the snapshots `roots` (the snapshot objects
/// included) that `have` does not claim, with its kind. The walk does not go
/// below an object `have` claims: a store that holds an object holds everything
/// it refers to.
pub fn closure(
    repo: &Repository,
    roots: &[ObjectId],
    have: impl Fn(&ObjectId) -> bool,
) -> Result<Vec<(Kind, ObjectId)>, ObjectError> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    let mut stack: Vec<(Kind, ObjectId)> = roots.iter().map(|r| (Kind::Snapshot, *r)).collect();
    while let Some((kind, id)) = stack.pop() {
        if !seen.insert(id) || have(&id) {
            continue;
        }
        out.push((kind, id));
        if kind == Kind::Blob {
            continue;
        }
        let raw = repo.read_kind(&id, kind)?;
        let refs =
            references(kind, &raw).map_err(|source| ObjectError::Decode { id, kind, source })?;
        stack.extend(refs.into_iter().filter(|(_, r)| !seen.contains(r)));
    }
    Ok(out)
}

/// Writes `objects` (all in `repo`) into one new pack in `dir`. Objects stored
/// in their own frame are copied without decompressing; members of blocks are
/// gathered into new blocks. The objects are read in their stored order, so a
/// large transfer reads the packs sequentially. `None` when `objects` is empty.
pub fn write_pack(
    repo: &Repository,
    objects: &[(Kind, ObjectId)],
    dir: &Path,
    progress: &dyn Progress,
) -> Result<Option<FinishedPack>, WriteError> {
    if objects.is_empty() {
        return Ok(None);
    }
    let mut located = Vec::with_capacity(objects.len());
    for (_, id) in objects {
        let loc = repo.locate(id)?.ok_or(ObjectError::Missing { id: *id })?;
        located.push(loc);
    }
    located.sort_unstable_by_key(|l| (l.pack, l.entry.offset, l.entry.block_offset));
    progress.start(
        "pack",
        located.iter().map(|l| u64::from(l.entry.raw_len)).sum(),
    );
    let mut writer = PackWriter::create(dir, Density::Fast)?;
    for loc in &located {
        let e = &loc.entry;
        match e.codec {
            pack::CODEC_RAW | pack::CODEC_ZSTD => {
                let (name, file) = repo.pack_file(loc.pack)?;
                let mut data = vec![0u8; e.stored_len as usize];
                file.read_exact_at(&mut data, e.offset)
                    .map_err(|source| ObjectError::Io {
                        step: "read object frame",
                        path: repo.pack_path(&name),
                        source,
                    })?;
                writer.add(&Encoded {
                    id: e.id,
                    kind: e.kind,
                    codec: e.codec,
                    raw_len: e.raw_len,
                    data,
                })?;
            }
            _ => {
                let (kind, raw) = repo.read_object(&e.id)?;
                writer.add_object(kind, e.id, &raw)?;
            }
        }
        progress.advance(u64::from(e.raw_len));
    }
    progress.finish();
    Ok(Some(writer.finish()?))
}

/// A pack file whose every object was read back and found to match its id.
#[derive(Debug, Clone)]
pub struct VerifiedPack {
    /// The name its header and index give it (what the local store calls it).
    pub name: String,
    pub entries: Vec<PackEntry>,
    pub bytes: u64,
}

/// Reads a whole pack file and verifies it: header, index checksum, and every
/// object decompressed and re-hashed (each block decompressed once). Returns
/// the first problem, naming the object.
pub fn verify_pack(path: &Path, progress: &dyn Progress) -> Result<VerifiedPack, String> {
    let file = File::open(path).map_err(|e| format!("open: {e}"))?;
    let bytes = file.metadata().map_err(|e| format!("stat: {e}"))?.len();
    let (header, _) = pack::read_header(&file)?;
    let entries = pack::read_index(&file)?;
    let name = pack::pack_name(&header, &entries);
    // Members of one block share its frame: group them by offset.
    let mut by_frame: HashMap<u64, Vec<&PackEntry>> = HashMap::new();
    for e in &entries {
        by_frame.entry(e.offset).or_default().push(e);
    }
    let mut frames: Vec<_> = by_frame.into_iter().collect();
    frames.sort_unstable_by_key(|(off, _)| *off);
    progress.start("verify", bytes);
    for (_, members) in frames {
        let frame = pack::read_frame(&file, members[0]).map_err(|r| {
            format!(
                "object {} at offset {}: {r}",
                members[0].id, members[0].offset
            )
        })?;
        for e in &members {
            pack::extract(&frame, e).map_err(|r| format!("object {}: {r}", e.id))?;
        }
        progress.advance(u64::from(members[0].stored_len));
    }
    progress.finish();
    Ok(VerifiedPack {
        name,
        entries,
        bytes,
    })
}

impl WriteLock<'_> {
    /// Adopts a pack file that came from elsewhere: it is verified in full
    /// (see [`verify_pack`]) and must carry the name `expect` (when given), then
    /// moved in as [`WriteLock::import_verified`] does. A pack that fails
    /// verification is left where it is and nothing is recorded.
    pub fn import_pack(
        &self,
        path: &Path,
        expect: Option<&str>,
        progress: &dyn Progress,
    ) -> Result<VerifiedPack, WriteError> {
        let verified = verify_pack(path, progress).map_err(|reason| WriteError::BadPack {
            path: path.to_path_buf(),
            reason,
        })?;
        if let Some(want) = expect
            && want != verified.name
        {
            return Err(WriteError::BadPack {
                path: path.to_path_buf(),
                reason: format!("its index gives it the name {}, not {want}", verified.name),
            });
        }
        self.import_verified(path, &verified)?;
        Ok(verified)
    }

    /// Moves a pack that [`verify_pack`] accepted (a private file nobody else
    /// writes) into the pack directory — fsync, rename (same filesystem), fsync
    /// of the directory — and records it with its objects in one transaction.
    pub fn import_verified(&self, path: &Path, verified: &VerifiedPack) -> Result<(), WriteError> {
        let repo = self.repo();
        let dest = repo.pack_path(&verified.name);
        // fsync before the rename: the pack must be durable before anything refers to it.
        File::open(path)
            .and_then(|f| f.sync_all())
            .map_err(|source| ObjectError::Io {
                step: "fsync pulled pack",
                path: path.to_path_buf(),
                source,
            })?;
        fs::rename(path, &dest).map_err(|source| ObjectError::Io {
            step: "move pulled pack into place",
            path: dest.clone(),
            source,
        })?;
        pack::sync_dir(&repo.packs_dir()).map_err(|source| ObjectError::Io {
            step: "fsync pack directory",
            path: repo.packs_dir(),
            source,
        })?;
        let finished = FinishedPack {
            name: verified.name.clone(),
            path: dest,
            bytes: verified.bytes,
            entries: verified.entries.clone(),
        };
        let mut db = repo.db();
        let dberr = |step| move |source| WriteError::Db { step, source };
        let tx = db.transaction().map_err(dberr("begin"))?;
        record_pack(&tx, &finished).map_err(dberr("record pulled pack"))?;
        tx.commit().map_err(dberr("commit"))?;
        Ok(())
    }

    /// Records snapshot `id`, whose object (and everything it refers to) is
    /// already in the store, as a snapshot of this repository: what a pull does
    /// once it has the objects. The object's own tags are not applied (the
    /// remote's current tags are, by the caller). Nothing when it is recorded already.
    pub fn adopt_snapshot(
        &self,
        id: &ObjectId,
        files: u64,
        bytes: u64,
    ) -> Result<bool, WriteError> {
        let repo = self.repo();
        if repo.snapshot_info(id)?.is_some() {
            return Ok(false);
        }
        let obj: SnapshotObject = repo.read_snapshot(id)?;
        let mut db = repo.db();
        let dberr = |step| move |source| WriteError::Db { step, source };
        let tx = db.transaction().map_err(dberr("begin"))?;
        insert_snapshot(&tx, id, &obj, files, bytes)?;
        tx.commit().map_err(dberr("commit"))?;
        Ok(true)
    }
}
