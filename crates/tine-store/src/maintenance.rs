//! `gc` (mark and sweep from snapshots, with retention) and `fsck` (re-hash everything).

use std::collections::{HashMap, HashSet};
use std::fs;
use std::path::PathBuf;

use rayon::prelude::*;
use serde::Serialize;

use crate::error::{MaintenanceError, ObjectError, WriteError};
use crate::id::{Kind, ObjectId};
use crate::object::references;
use crate::pack::{
    self, Density, Encoded, EncodedBlock, FinishedPack, PackEntry, PackWriter, PendingBlock,
};
use crate::progress::Progress;
use crate::repo::{ObjectLocation, Repository, SnapshotInfo, WriteLock};

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

fn db_step(step: &'static str) -> impl FnOnce(rusqlite::Error) -> MaintenanceError {
    move |source| MaintenanceError::Db { step, source }
}

fn all_locations(repo: &Repository) -> Result<Vec<(ObjectLocation, String)>, MaintenanceError> {
    let db = repo.db();
    let mut stmt = db
        .prepare(
            "SELECT o.id, o.kind, o.pack, o.offset, o.stored_len, o.raw_len, o.codec, p.name, o.block_offset
             FROM objects o JOIN packs p ON p.id = o.pack ORDER BY o.pack, o.offset",
        )
        .map_err(db_step("prepare object scan"))?;
    let rows = stmt
        .query_map([], |r| {
            Ok((
                r.get::<_, Vec<u8>>(0)?,
                r.get::<_, u8>(1)?,
                r.get::<_, i64>(2)?,
                r.get::<_, i64>(3)? as u64,
                r.get::<_, u32>(4)?,
                r.get::<_, u32>(5)?,
                r.get::<_, u8>(6)?,
                r.get::<_, String>(7)?,
                r.get::<_, u32>(8)?,
            ))
        })
        .map_err(db_step("scan objects"))?;
    let mut out = Vec::new();
    for row in rows {
        let (id, kind, pack, offset, stored_len, raw_len, codec, name, block_offset) =
            row.map_err(db_step("scan objects"))?;
        let Some(id) = ObjectId::from_slice(&id) else {
            continue;
        };
        // An unknown kind byte is reported as damage by fsck via a bogus kind.
        let kind = Kind::from_u8(kind).unwrap_or(Kind::Blob);
        out.push((
            ObjectLocation {
                pack,
                entry: PackEntry {
                    id,
                    kind,
                    codec,
                    raw_len,
                    stored_len,
                    offset,
                    block_offset,
                },
            },
            name,
        ));
    }
    Ok(out)
}

fn registered_packs(repo: &Repository) -> Result<Vec<(i64, String)>, MaintenanceError> {
    let db = repo.db();
    let mut stmt = db
        .prepare("SELECT id, name FROM packs ORDER BY id")
        .map_err(db_step("prepare pack scan"))?;
    let rows = stmt
        .query_map([], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?)))
        .map_err(db_step("scan packs"))?;
    rows.collect::<Result<Vec<_>, _>>()
        .map_err(db_step("scan packs"))
}

/// Files in the repository that nothing refers to: temporary files of interrupted
/// writes and packs that never got registered.
fn leftover_files(
    repo: &Repository,
    registered: &HashSet<String>,
) -> Result<Vec<PathBuf>, MaintenanceError> {
    let mut out = Vec::new();
    for dir in [
        repo.packs_dir(),
        repo.cache_dir(),
        repo.path().to_path_buf(),
    ] {
        let rd = fs::read_dir(&dir).map_err(|source| MaintenanceError::Io {
            step: "list",
            path: dir.clone(),
            source,
        })?;
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with(pack::TEMP_PREFIX) {
                out.push(e.path());
            } else if dir == repo.packs_dir() {
                let stem = name.strip_suffix(pack::PACK_SUFFIX).unwrap_or(&name);
                if !registered.contains(stem) {
                    out.push(e.path());
                }
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Every object reachable from `roots`, with its kind. Fails if any is missing or
/// damaged: sweeping with an incomplete mark would delete live data.
fn mark(repo: &Repository, roots: &[ObjectId]) -> Result<HashSet<ObjectId>, MaintenanceError> {
    let mut live = HashSet::new();
    for (kind, id) in crate::transfer::closure(repo, roots, |_| false)? {
        // The walk read every other kind; blobs it only named.
        if kind == Kind::Blob && !repo.has_object(&id)? {
            return Err(ObjectError::Missing { id }.into());
        }
        live.insert(id);
    }
    Ok(live)
}

/// Which snapshots `gc` keeps.
fn retained(
    repo: &Repository,
    snapshots: &[SnapshotInfo],
    keep_last: Option<usize>,
) -> Result<HashSet<ObjectId>, MaintenanceError> {
    let Some(n) = keep_last else {
        return Ok(snapshots.iter().map(|s| s.id).collect());
    };
    let mut keep: HashSet<ObjectId> = snapshots.iter().rev().take(n).map(|s| s.id).collect();
    keep.extend(
        snapshots
            .iter()
            .filter(|s| !s.tags.is_empty())
            .map(|s| s.id),
    );
    keep.extend(repo.heads()?.into_iter().map(|(_, id)| id));
    Ok(keep)
}

/// Whether a pack was written dense. A pack whose header cannot be read counts as
/// fast: compacting it reads its objects, which reports any damage by name.
fn is_dense(repo: &Repository, name: &str) -> bool {
    fs::File::open(repo.pack_path(name))
        .ok()
        .and_then(|f| pack::read_header(&f).ok())
        .is_some_and(|(_, d)| d == Density::Dense)
}

/// Raw bytes collected for compression, and the same compressed.
enum Batched {
    Block(PendingBlock),
    Single(Kind, ObjectId, Vec<u8>),
}
enum Compressed {
    Block(EncodedBlock),
    Single(Encoded),
}

/// Raw bytes gathered before compressing them in parallel.
const REWRITE_BATCH: usize = 16 << 20;

/// Copies objects into one new durable pack of `density`. Reading is sequential
/// (in pack order, so each block is decompressed once); compression, the slow part
/// of a dense pack, runs on every core a batch at a time.
fn rewrite(
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
    let leftovers = leftover_files(repo, &registered)?;
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
            match fs::remove_file(&path) {
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

/// An object's id, kind, and either its references or what is wrong with it.
type Verified = (ObjectId, Kind, Result<Vec<(Kind, ObjectId)>, DamagedObject>);

#[derive(Debug, Clone, Serialize)]
pub struct DamagedObject {
    pub id: ObjectId,
    pub kind: Kind,
    pub pack: String,
    pub offset: u64,
    pub reason: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct MissingObject {
    pub id: ObjectId,
    pub referenced_by: ObjectId,
}

#[derive(Debug, Clone, Serialize)]
pub struct DamagedPack {
    pub pack: String,
    pub reason: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct AffectedSnapshot {
    pub id: ObjectId,
    pub tags: Vec<String>,
    pub message: String,
    /// Damaged or missing objects this snapshot needs.
    pub bad_objects: Vec<ObjectId>,
}

/// A snapshot whose row in the database (what `log` and `show` display, and
/// what restores start from) does not say what its stored object says.
#[derive(Debug, Clone, Serialize)]
pub struct MismatchedSnapshot {
    pub id: ObjectId,
    /// The fields that differ (`tree`, `parents`, `time`, `message`,
    /// `source`), or `object` when the object cannot be read.
    pub fields: Vec<&'static str>,
}

#[derive(Debug, Clone, Serialize)]
pub struct FsckReport {
    pub packs_checked: u64,
    pub objects_checked: u64,
    pub bytes_checked: u64,
    pub damaged_objects: Vec<DamagedObject>,
    pub missing_objects: Vec<MissingObject>,
    pub damaged_packs: Vec<DamagedPack>,
    pub affected_snapshots: Vec<AffectedSnapshot>,
    /// Snapshot rows that disagree with their objects.
    pub mismatched_snapshots: Vec<MismatchedSnapshot>,
    /// Files nothing refers to (interrupted writes); `gc` removes them.
    pub leftover_files: Vec<PathBuf>,
    /// Indexed objects no snapshot reaches; `gc` removes them.
    pub unreachable_objects: u64,
}

impl FsckReport {
    /// No damage (leftovers are not damage).
    pub fn is_clean(&self) -> bool {
        self.damaged_objects.is_empty()
            && self.missing_objects.is_empty()
            && self.damaged_packs.is_empty()
            && self.affected_snapshots.is_empty()
            && self.mismatched_snapshots.is_empty()
    }
}

/// Re-hashes every object, checks every pack's index, and works out which
/// snapshots depend on anything damaged or missing.
pub fn fsck(repo: &Repository, progress: &dyn Progress) -> Result<FsckReport, MaintenanceError> {
    let packs = registered_packs(repo)?;
    let registered: HashSet<String> = packs.iter().map(|(_, n)| n.clone()).collect();
    let locations = all_locations(repo)?;

    // Pack trailers must agree with the database index.
    let mut damaged_packs = Vec::new();
    let mut by_pack: HashMap<i64, Vec<PackEntry>> = HashMap::new();
    for (loc, _) in &locations {
        by_pack.entry(loc.pack).or_default().push(loc.entry);
    }
    for (pid, name) in &packs {
        let path = repo.pack_path(name);
        let trailer = fs::File::open(&path)
            .map_err(|e| format!("cannot open: {e}"))
            .and_then(|f| pack::read_index(&f));
        match trailer {
            Err(reason) => damaged_packs.push(DamagedPack {
                pack: name.clone(),
                reason,
            }),
            Ok(entries) => {
                let set: HashSet<PackEntry> = entries.into_iter().collect();
                let mismatched = by_pack
                    .get(pid)
                    .map(|v| v.iter().filter(|e| !set.contains(e)).count())
                    .unwrap_or(0);
                if mismatched > 0 {
                    damaged_packs.push(DamagedPack {
                        pack: name.clone(),
                        reason: format!(
                            "{mismatched} objects in the database index are not in the pack's own index"
                        ),
                    });
                }
            }
        }
    }

    progress.start(
        "verifying",
        locations
            .iter()
            .map(|(l, _)| u64::from(l.entry.raw_len))
            .sum(),
    );
    // One decompression per frame: group the objects of each block.
    let mut frames: HashMap<(i64, u64), Vec<&(ObjectLocation, String)>> = HashMap::new();
    for l in &locations {
        frames
            .entry((l.0.pack, l.0.entry.offset))
            .or_default()
            .push(l);
    }
    let frames: Vec<Vec<&(ObjectLocation, String)>> = frames.into_values().collect();
    let verified: Vec<Verified> = frames
        .par_iter()
        .flat_map_iter(|members| {
            let (first, name) = members[0];
            let frame = repo
                .pack_file(first.pack)
                .map_err(|err| err.to_string())
                .and_then(|(_, file)| pack::read_frame(&file, &first.entry));
            let out: Vec<Verified> = members
                .iter()
                .map(|(loc, _)| {
                    let e = &loc.entry;
                    let damaged = |reason: String| DamagedObject {
                        id: e.id,
                        kind: e.kind,
                        pack: name.clone(),
                        offset: e.offset,
                        reason,
                    };
                    let res = frame
                        .as_ref()
                        .map_err(|err| damaged(err.clone()))
                        .and_then(|f| pack::extract(f, e).map_err(damaged))
                        .and_then(|raw| {
                            references(e.kind, &raw)
                                .map_err(|err| damaged(format!("cannot decode: {err}")))
                        });
                    progress.advance(u64::from(e.raw_len));
                    (e.id, e.kind, res)
                })
                .collect();
            out
        })
        .collect();
    progress.finish();

    let bytes_checked = locations
        .iter()
        .map(|(l, _)| u64::from(l.entry.raw_len))
        .sum();
    let mut refs: HashMap<ObjectId, Vec<ObjectId>> = HashMap::new();
    let mut damaged_objects = Vec::new();
    let mut bad: HashSet<ObjectId> = HashSet::new();
    for (id, _, res) in verified {
        match res {
            Ok(r) => {
                refs.insert(id, r.into_iter().map(|(_, i)| i).collect());
            }
            Err(d) => {
                bad.insert(id);
                damaged_objects.push(d);
            }
        }
    }
    let mut missing_objects = Vec::new();
    for (id, rs) in &refs {
        for r in rs {
            if !refs.contains_key(r) && !bad.contains(r) {
                missing_objects.push(MissingObject {
                    id: *r,
                    referenced_by: *id,
                });
            }
        }
    }
    let missing: HashSet<ObjectId> = missing_objects.iter().map(|m| m.id).collect();

    // Which bad objects each snapshot reaches (memoized over shared subtrees).
    let snapshots = repo.snapshots()?;
    let mut memo: HashMap<ObjectId, Vec<ObjectId>> = HashMap::new();
    let mut reachable: HashSet<ObjectId> = HashSet::new();
    let mut affected_snapshots = Vec::new();
    for s in &snapshots {
        let badlist = bad_below(&s.id, &refs, &bad, &missing, &mut memo, &mut reachable);
        if !badlist.is_empty() {
            affected_snapshots.push(AffectedSnapshot {
                id: s.id,
                tags: s.tags.clone(),
                message: s.message.clone(),
                bad_objects: badlist,
            });
        }
    }
    let mismatched_snapshots = snapshots
        .iter()
        .filter(|s| !bad.contains(&s.id) && !missing.contains(&s.id))
        .filter_map(|s| {
            let fields = match repo.read_snapshot(&s.id) {
                Err(_) => vec!["object"],
                Ok(o) => row_differs(s, &o),
            };
            (!fields.is_empty()).then_some(MismatchedSnapshot { id: s.id, fields })
        })
        .collect();
    let unreachable_objects = locations
        .iter()
        .filter(|(l, _)| !reachable.contains(&l.entry.id))
        .count() as u64;
    damaged_objects.sort_by_key(|d| d.id);
    missing_objects.sort_by_key(|m| m.id);
    Ok(FsckReport {
        packs_checked: packs.len() as u64,
        objects_checked: locations.len() as u64,
        bytes_checked,
        damaged_objects,
        missing_objects,
        damaged_packs,
        affected_snapshots,
        mismatched_snapshots,
        leftover_files: leftover_files(repo, &registered)?,
        unreachable_objects,
    })
}

/// The fields in which a snapshot's row says other than its object.
fn row_differs(row: &SnapshotInfo, obj: &crate::SnapshotObject) -> Vec<&'static str> {
    [
        ("tree", obj.tree != row.tree),
        ("parents", obj.parents != row.parents),
        ("time", obj.time_ns != row.time_ns),
        ("message", obj.message != row.message),
        ("source", obj.source != row.source),
    ]
    .into_iter()
    .filter_map(|(f, differs)| differs.then_some(f))
    .collect()
}

/// Bad (damaged or missing) objects reachable from `id`, iteratively to survive deep trees.
fn bad_below(
    root: &ObjectId,
    refs: &HashMap<ObjectId, Vec<ObjectId>>,
    bad: &HashSet<ObjectId>,
    missing: &HashSet<ObjectId>,
    memo: &mut HashMap<ObjectId, Vec<ObjectId>>,
    reachable: &mut HashSet<ObjectId>,
) -> Vec<ObjectId> {
    // Post-order traversal with an explicit stack.
    let mut stack = vec![(*root, false)];
    while let Some((id, expanded)) = stack.pop() {
        if memo.contains_key(&id) {
            continue;
        }
        reachable.insert(id);
        if bad.contains(&id) || missing.contains(&id) || !refs.contains_key(&id) {
            memo.insert(id, vec![id]);
            continue;
        }
        let children = &refs[&id];
        if expanded {
            let mut v: Vec<ObjectId> = children
                .iter()
                .flat_map(|c| memo.get(c).cloned().unwrap_or_default())
                .collect();
            v.sort();
            v.dedup();
            memo.insert(id, v);
        } else {
            stack.push((id, true));
            for c in children {
                if !memo.contains_key(c) {
                    stack.push((*c, false));
                }
            }
        }
    }
    memo.get(root).cloned().unwrap_or_default()
}

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
