//! `gc`: its options and report; retention, mark from the retained snapshots, copy the live objects
//! of partly dead and fast packs into one dense pack, switch the index, then
//! delete what is dead.

use super::*;

/// What `gc` should keep.
#[derive(Debug, Clone, Default)]
pub struct GcOptions {
    /// Keep only the N most recent snapshots (plus every tagged snapshot and every
    /// directory head). `None` keeps all snapshots and only sweeps leftovers.
    pub keep_last: Option<usize>,
    pub dry_run: bool,
    /// Also rewrite every fast pack (as snapshots write them) into one dense pack.
    pub compact: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct GcReport {
    pub dry_run: bool,
    pub snapshots_removed: Vec<ObjectId>,
    pub objects_removed: u64,
    pub packs_removed: u64,
    pub packs_rewritten: u64,
    /// Of those, packs rewritten only to compact them (they held no garbage).
    pub packs_compacted: u64,
    pub leftover_files_removed: Vec<PathBuf>,
    pub bytes_before: u64,
    pub bytes_after: u64,
}

/// Whether a pack was written dense. A pack whose header cannot be read counts as
/// fast: compacting it reads its objects, which reports any damage by name.
pub(super) fn is_dense(repo: &Repository, name: &str) -> bool {
    fs::File::open(repo.pack_path(name))
        .ok()
        .and_then(|f| pack::read_header(&f).ok())
        .is_some_and(|(_, d)| d == Density::Dense)
}

/// Raw bytes collected for compression, and the same compressed.
pub(super) enum Batched {
    Block(PendingBlock),
    Single(Kind, ObjectId, Vec<u8>),
}
pub(super) enum Compressed {
    Block(EncodedBlock),
    Single(Encoded),
}

/// Raw bytes gathered before compressing them in parallel.
pub(super) const REWRITE_BATCH: usize = 16 << 20;

/// Copies objects into one new durable pack of `density`. Reading is sequential
/// (in pack order, so each block is decompressed once); compression, the slow part
/// of a dense pack, runs on every core a batch at a time.
pub(super) fn rewrite(
    repo: &Repository,
    locs: &[ObjectLocation],
    density: Density,
    progress: &dyn Progress,
) -> Result<FinishedPack, MaintenanceError> {
    let mut w = PackWriter::create(&repo.packs_dir(), density).map_err(WriteError::from)?;
    let mut batch = Vec::new();
    let mut batch_bytes = 0;
    let flush = |w: &mut PackWriter, batch: &mut Vec<Batched>| -> Result<(), WriteError> {
        let done: Vec<Compressed> = std::mem::take(batch)
            .into_par_iter()
            .map(|b| match b {
                Batched::Block(p) => Compressed::Block(p.compress()),
                Batched::Single(kind, id, raw) => {
                    Compressed::Single(pack::encode(kind, id, &raw, density))
                }
            })
            .collect();
        for c in done {
            match c {
                Compressed::Block(b) => w.add_block(b)?,
                Compressed::Single(e) => {
                    w.add(&e)?;
                }
            }
        }
        Ok(())
    };
    for loc in locs {
        let id = loc.entry.id;
        let (kind, raw) = repo.read_object(&id)?;
        if raw.len() < density.small_object() {
            if let (_, Some(full)) = w.push_small(kind, id, &raw) {
                batch_bytes += full.raw_len();
                batch.push(Batched::Block(full));
            }
        } else {
            batch_bytes += raw.len();
            batch.push(Batched::Single(kind, id, raw));
        }
        if batch_bytes >= REWRITE_BATCH {
            flush(&mut w, &mut batch)?;
            batch_bytes = 0;
        }
        progress.advance(1);
    }
    flush(&mut w, &mut batch)?;
    Ok(w.finish().map_err(WriteError::from)?)
}

/// Removes what no retained snapshot needs. Holds the write lock and, while it
/// deletes, the exclusive gc lock (so no reader is inside a pack).
pub fn gc(
    lock: &WriteLock<'_>,
    opts: &GcOptions,
    progress: &dyn Progress,
) -> Result<GcReport, MaintenanceError> {
    let repo = lock.repo();
    let bytes_before = repo.store_bytes()?;
    let snapshots = repo.snapshots()?;
    let keep = retained(repo, &snapshots, opts.keep_last)?;
    let removed: Vec<ObjectId> = snapshots
        .iter()
        .filter(|s| !keep.contains(&s.id))
        .map(|s| s.id)
        .collect();
    progress.start("marking", keep.len() as u64);
    let roots: Vec<ObjectId> = keep.iter().copied().collect();
    let live = mark(repo, &roots)?;
    progress.finish();

    let locations = all_locations(repo)?;
    let packs = registered_packs(repo)?;
    let registered: HashSet<String> = packs.iter().map(|(_, n)| n.clone()).collect();
    let mut leftovers = leftover_files(repo, &registered)?;
    // Staging directories of imports and builds that were killed.
    let stale = crate::staging::stale(repo).map_err(|source| MaintenanceError::Io {
        step: "list",
        path: repo.path().join(crate::staging::STAGING_DIR),
        source,
    })?;
    leftovers.extend(stale.iter().map(|s| s.dir.clone()));
    let mut per_pack: HashMap<i64, (Vec<ObjectLocation>, u64)> = HashMap::new();
    for (loc, _) in &locations {
        let e = per_pack.entry(loc.pack).or_default();
        if live.contains(&loc.entry.id) {
            e.0.push(*loc);
        } else {
            e.1 += 1;
        }
    }
    let objects_removed: u64 = per_pack.values().map(|(_, d)| d).sum();
    let dead_packs: Vec<(i64, String)> = packs
        .iter()
        .filter(|(id, _)| per_pack.get(id).is_none_or(|(l, _)| l.is_empty()))
        .cloned()
        .collect();
    // Packs whose live objects move to a new pack: those holding garbage, and
    // when compacting, fast ones.
    let mut rewritten: Vec<(i64, String, Vec<ObjectLocation>)> = Vec::new();
    let mut packs_compacted = 0;
    for (id, name) in &packs {
        let Some((l, d)) = per_pack.get(id).filter(|(l, _)| !l.is_empty()) else {
            continue;
        };
        let compact = opts.compact && *d == 0 && !is_dense(repo, name);
        if *d > 0 || compact {
            packs_compacted += u64::from(compact);
            rewritten.push((*id, name.clone(), l.clone()));
        }
    }

    let mut report = GcReport {
        dry_run: opts.dry_run,
        snapshots_removed: removed.clone(),
        objects_removed,
        packs_removed: dead_packs.len() as u64,
        packs_rewritten: rewritten.len() as u64,
        packs_compacted,
        leftover_files_removed: leftovers.clone(),
        bytes_before,
        bytes_after: bytes_before,
    };
    if opts.dry_run {
        // Frames whose objects are all dead (a block counts once).
        let mut frames: HashMap<(i64, u64), (u64, bool)> = HashMap::new();
        for (l, _) in &locations {
            let f = frames
                .entry((l.pack, l.entry.offset))
                .or_insert((u64::from(l.entry.stored_len), false));
            f.1 |= live.contains(&l.entry.id);
        }
        let dead_bytes: u64 = frames
            .values()
            .filter(|(_, alive)| !alive)
            .map(|(n, _)| n)
            .sum();
        report.bytes_after = bytes_before.saturating_sub(dead_bytes);
        return Ok(report);
    }

    // Copy the live objects of those packs into one new, durable pack first.
    let mut new_pack = None;
    if !rewritten.is_empty() {
        let density = if opts.compact {
            Density::Dense
        } else {
            Density::Fast
        };
        let locs: Vec<ObjectLocation> = rewritten.iter().flat_map(|p| p.2.clone()).collect();
        progress.start(
            if opts.compact {
                "compacting"
            } else {
                "repacking"
            },
            locs.len() as u64,
        );
        new_pack = Some(rewrite(repo, &locs, density, progress)?);
        progress.finish();
    }

    // A rewrite that happens to produce a pack that exists already (same name)
    // must not delete it: that pack is where the objects now live.
    if let Some(p) = &new_pack {
        rewritten.retain(|(_, n, _)| *n != p.name);
    }

    // Exclude readers while the index changes and packs disappear.
    repo.gc_lock_exclusive()?;
    let result = (|| -> Result<(), MaintenanceError> {
        let mut db = repo.db();
        let tx = db.transaction().map_err(db_step("begin"))?;
        for id in &removed {
            let b = id.as_bytes().as_slice();
            tx.execute("DELETE FROM snapshots WHERE id = ?1", [b])
                .map_err(db_step("delete snapshot"))?;
            tx.execute("DELETE FROM snapshot_parents WHERE child = ?1", [b])
                .map_err(db_step("delete snapshot parents"))?;
        }
        {
            let mut del = tx
                .prepare("DELETE FROM objects WHERE id = ?1")
                .map_err(db_step("prepare object delete"))?;
            for (loc, _) in &locations {
                if !live.contains(&loc.entry.id) {
                    del.execute([loc.entry.id.as_bytes().as_slice()])
                        .map_err(db_step("delete object"))?;
                }
            }
        }
        if let Some(p) = &new_pack {
            crate::repo::record_pack(&tx, p).map_err(db_step("record repacked objects"))?;
        }
        let doomed_ids = dead_packs
            .iter()
            .map(|(i, _)| *i)
            .chain(rewritten.iter().map(|(i, _, _)| *i));
        for id in doomed_ids {
            tx.execute("DELETE FROM packs WHERE id = ?1", [id])
                .map_err(db_step("delete pack"))?;
        }
        tx.execute(
            "UPDATE meta SET value = CAST(CAST(value AS INTEGER) + 1 AS TEXT) WHERE key = 'gc_generation'",
            [],
        )
        .map_err(db_step("bump gc generation"))?;
        tx.commit().map_err(db_step("commit"))?;
        // gc rewrites many rows: give back the space of deleted ones and the log.
        let free: i64 = db
            .query_row("PRAGMA freelist_count", [], |r| r.get(0))
            .unwrap_or(0);
        let pages: i64 = db
            .query_row("PRAGMA page_count", [], |r| r.get(0))
            .unwrap_or(0);
        if free > 16 && free * 4 > pages {
            let _ = db.execute_batch("VACUUM");
        }
        crate::repo::fold_wal(&db);
        Ok(())
    })();
    repo.forget_open_packs();
    let unlink_result = result.and_then(|()| {
        let doomed = dead_packs
            .iter()
            .map(|(_, n)| repo.pack_path(n))
            .chain(rewritten.iter().map(|(_, n, _)| repo.pack_path(n)))
            .chain(leftovers.iter().cloned());
        for path in doomed {
            // A scratch directory an older tine left beside the packs goes whole.
            let removed = if fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir()) {
                fs::remove_dir_all(&path)
            } else {
                fs::remove_file(&path)
            };
            match removed {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(source) => {
                    return Err(MaintenanceError::Io {
                        step: "remove",
                        path,
                        source,
                    });
                }
            }
        }
        crate::staging::remove_stale(stale).map_err(|source| MaintenanceError::Io {
            step: "remove",
            path: repo.path().join(crate::staging::STAGING_DIR),
            source,
        })?;
        pack::sync_dir(&repo.packs_dir()).map_err(|source| MaintenanceError::Io {
            step: "fsync",
            path: repo.packs_dir(),
            source,
        })
    });
    repo.gc_lock_shared()?;
    unlink_result?;
    report.bytes_after = repo.store_bytes()?;
    Ok(report)
}
