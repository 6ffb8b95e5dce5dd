//! `fsck`: every pack trailer against the index, every object re-hashed, missing
//! references, snapshot rows against their objects, and the snapshots that
//! depend on anything damaged.

use super::*;

/// An object's id, kind, and either its references or what is wrong with it.
pub(super) type Verified = (ObjectId, Kind, Result<Vec<(Kind, ObjectId)>, DamagedObject>);

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
pub(super) fn row_differs(row: &SnapshotInfo, obj: &crate::SnapshotObject) -> Vec<&'static str> {
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
pub(super) fn bad_below(
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
