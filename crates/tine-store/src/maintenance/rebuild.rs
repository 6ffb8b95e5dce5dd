//! `fsck --rebuild-index`: the database's index rebuilt from the packs where it
//! can, without removing anything.

use super::*;

/// What `fsck --rebuild-index` did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RebuildReport {
    /// Pack files whose own index was read.
    pub packs_read: u64,
    /// Pack files whose own index could not be read (left as they are).
    pub packs_unreadable: Vec<DamagedPack>,
    /// Packs on disk the database did not list, now listed.
    pub packs_registered: u64,
    /// Objects found in packs that the database did not index, now indexed.
    pub objects_indexed: u64,
    /// Snapshot objects without a row, now recorded.
    pub snapshots_recorded: Vec<ObjectId>,
    /// Snapshot rows rewritten from their objects.
    pub snapshots_repaired: Vec<ObjectId>,
}

/// Rebuilds what the database says from what the packs hold, where it can:
/// every pack file is listed, every object its own index names is indexed
/// (an object already indexed keeps its place), and every snapshot object
/// gets a row that says what the object says. Nothing stored is removed.
pub fn rebuild_index(
    lock: &crate::WriteLock<'_>,
    progress: &dyn Progress,
) -> Result<RebuildReport, MaintenanceError> {
    let repo = lock.repo();
    let mut report = RebuildReport::default();
    let dir = repo.packs_dir();
    let mut names: Vec<String> = fs::read_dir(&dir)
        .map_err(|source| MaintenanceError::Io {
            step: "list",
            path: dir.clone(),
            source,
        })?
        .flatten()
        .filter_map(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            (!n.starts_with(pack::TEMP_PREFIX))
                .then(|| n.strip_suffix(pack::PACK_SUFFIX).map(str::to_string))
                .flatten()
        })
        .collect();
    names.sort();
    progress.start("rebuilding the index", names.len() as u64);
    let dberr = |step| move |source| MaintenanceError::Db { step, source };
    for name in &names {
        progress.advance(1);
        let path = repo.pack_path(name);
        let entries = match fs::File::open(&path)
            .map_err(|e| format!("cannot open: {e}"))
            .and_then(|f| pack::read_index(&f).map(|e| (e, f)))
        {
            Ok((e, f)) => (e, f.metadata().map(|m| m.len()).unwrap_or(0)),
            Err(reason) => {
                report.packs_unreadable.push(DamagedPack {
                    pack: name.clone(),
                    reason,
                });
                continue;
            }
        };
        report.packs_read += 1;
        let mut conn = repo.db();
        let tx = conn.transaction().map_err(dberr("begin"))?;
        let added = tx
            .execute(
                "INSERT OR IGNORE INTO packs (name, bytes, objects, created_ns) VALUES (?1, ?2, ?3, ?4)",
                rusqlite::params![name, entries.1 as i64, entries.0.len() as i64, crate::now_ns() as i64],
            )
            .map_err(dberr("list pack"))?;
        report.packs_registered += added as u64;
        let pid: i64 = tx
            .query_row("SELECT id FROM packs WHERE name = ?1", [name], |r| r.get(0))
            .map_err(dberr("look up pack"))?;
        for e in &entries.0 {
            report.objects_indexed += tx
                .execute(
                    "INSERT OR IGNORE INTO objects (id, kind, pack, offset, stored_len, raw_len, codec, block_offset) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
                    rusqlite::params![
                        e.id.as_bytes().as_slice(),
                        e.kind as i64,
                        pid,
                        e.offset as i64,
                        i64::from(e.stored_len),
                        i64::from(e.raw_len),
                        i64::from(e.codec),
                        i64::from(e.block_offset)
                    ],
                )
                .map_err(dberr("index object"))? as u64;
        }
        tx.commit().map_err(dberr("commit"))?;
    }
    progress.finish();
    // Snapshot rows from snapshot objects.
    let ids: Vec<ObjectId> = all_locations(repo)?
        .into_iter()
        .filter(|(l, _)| l.entry.kind == crate::Kind::Snapshot)
        .map(|(l, _)| l.entry.id)
        .collect();
    let rows: HashMap<ObjectId, crate::SnapshotInfo> =
        repo.snapshots()?.into_iter().map(|s| (s.id, s)).collect();
    for id in ids {
        let Ok(obj) = repo.read_snapshot(&id) else {
            continue;
        };
        let mut conn = repo.db();
        let tx = conn.transaction().map_err(dberr("begin"))?;
        match rows.get(&id) {
            None => {
                crate::repo::insert_snapshot(&tx, &id, &obj, 0, 0)?;
                report.snapshots_recorded.push(id);
            }
            Some(s) if !row_differs(s, &obj).is_empty() => {
                tx.execute(
                    "UPDATE snapshots SET tree = ?2, time_ns = ?3, message = ?4, source = ?5 WHERE id = ?1",
                    rusqlite::params![
                        id.as_bytes().as_slice(),
                        obj.tree.as_bytes().as_slice(),
                        obj.time_ns as i64,
                        obj.message,
                        obj.source
                    ],
                )
                .map_err(dberr("repair snapshot"))?;
                tx.execute(
                    "DELETE FROM snapshot_parents WHERE child = ?1",
                    [id.as_bytes().as_slice()],
                )
                .map_err(dberr("repair snapshot"))?;
                for (i, p) in obj.parents.iter().enumerate() {
                    tx.execute(
                        "INSERT INTO snapshot_parents (child, idx, parent) VALUES (?1, ?2, ?3)",
                        rusqlite::params![
                            id.as_bytes().as_slice(),
                            i as i64,
                            p.as_bytes().as_slice()
                        ],
                    )
                    .map_err(dberr("repair snapshot"))?;
                }
                report.snapshots_repaired.push(id);
            }
            Some(_) => {}
        }
        tx.commit().map_err(dberr("commit"))?;
    }
    Ok(report)
}
