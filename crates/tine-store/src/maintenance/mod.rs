//! `gc` (mark and sweep from snapshots, with retention) and `fsck` (re-hash everything).
//!
//! This file: what both walk (the index's locations, registered packs,
//! leftover files, marking from roots); `gc`, `fsck` and `rebuild` (the
//! index from the packs) each have a file.

mod fsck;
mod gc;
mod rebuild;
pub use fsck::*;
pub use gc::*;
pub use rebuild::*;

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
    // Those a graph checkpoint pairs with: a rewind of its thread restores them.
    let paired = repo
        .graph_snapshots()
        .map_err(|source| MaintenanceError::Db {
            step: "list graph snapshots",
            source,
        })?;
    keep.extend(paired);
    // Those of imported images: sandboxes are made from them.
    let images = repo
        .image_snapshots()
        .map_err(|e| MaintenanceError::Images(Box::new(e)))?;
    keep.extend(images);
    Ok(keep)
}
