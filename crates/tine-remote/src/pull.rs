//! Pull: fetch snapshots the repository lacks. Records first (to know what is
//! wanted), then, walking from each snapshot object down, every pack that
//! holds a missing object: downloaded into the state directory, verified
//! object by object, then moved into the repository. Snapshots are recorded
//! last, parents first, so a pull that fails leaves no snapshot whose objects
//! are missing (only unreferenced packs, which `gc` sweeps).

use std::collections::{HashMap, HashSet};

use serde::{Deserialize, Serialize};
use tine_store::object::references;
use tine_store::pack::PACK_SUFFIX;
use tine_store::transfer::verify_pack;
use tine_store::{Kind, ObjectId, Progress, Repository};

use crate::layout::{self, SnapshotRecord};
use crate::{Remote, RemoteError, io};

/// A tag that the remote points elsewhere than this repository does (left as it is).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct TagConflict {
    pub name: String,
    pub local: String,
    pub remote: String,
}

/// What a pull did.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PullReport {
    pub remote: String,
    pub url: String,
    /// Snapshots recorded by this pull, oldest first.
    pub snapshots_received: Vec<String>,
    /// Snapshots asked for that the repository had already.
    pub snapshots_already: usize,
    pub packs: Vec<String>,
    pub bytes_received: u64,
    /// Objects read back and checked against their ids.
    pub objects_verified: u64,
    pub tags_set: Vec<String>,
    pub tags_kept: Vec<TagConflict>,
}

impl Remote {
    /// Resolves `spec` (a full id, a unique prefix of at least 4 hex digits, or
    /// a tag) against the remote's snapshots and tags.
    fn resolve_remote(
        &self,
        spec: &str,
        ids: &[ObjectId],
        tags: &[(String, ObjectId)],
    ) -> Result<ObjectId, RemoteError> {
        if let Some((_, id)) = tags.iter().find(|(n, _)| n == spec) {
            return Ok(*id);
        }
        let lower = spec.to_ascii_lowercase();
        if lower.len() >= tine_store::repo::MIN_PREFIX && tine_store::id::is_hex_prefix(&lower) {
            let hits: Vec<&ObjectId> = ids
                .iter()
                .filter(|i| i.to_hex().starts_with(&lower))
                .collect();
            match hits.as_slice() {
                [one] => return Ok(**one),
                [] => {}
                many => {
                    return Err(RemoteError::Ambiguous {
                        url: self.url.clone(),
                        spec: spec.to_string(),
                        candidates: many.iter().map(|i| i.short()).collect(),
                    });
                }
            }
        }
        Err(RemoteError::NoSuchSnapshot {
            url: self.url.clone(),
            spec: spec.to_string(),
        })
    }

    /// Pulls the snapshots named in `want` (all of the remote's when empty),
    /// with their ancestors, and the remote's tags on them.
    pub fn pull(
        &self,
        repo: &Repository,
        want: &[String],
        progress: &dyn Progress,
    ) -> Result<PullReport, RemoteError> {
        let _lock = self.lock()?;
        self.rt.block_on(self.pull_async(repo, want, progress))
    }

    async fn pull_async(
        &self,
        repo: &Repository,
        want: &[String],
        progress: &dyn Progress,
    ) -> Result<PullReport, RemoteError> {
        let mut report = PullReport {
            remote: self.name.clone(),
            url: self.url.clone(),
            snapshots_received: Vec::new(),
            snapshots_already: 0,
            packs: Vec::new(),
            bytes_received: 0,
            objects_verified: 0,
            tags_set: Vec::new(),
            tags_kept: Vec::new(),
        };
        self.check_marker(false).await?;
        let ids = self.snapshot_ids().await?;
        let tags = self.tags().await?;
        let targets: Vec<ObjectId> = if want.is_empty() {
            ids.clone()
        } else {
            want.iter()
                .map(|w| self.resolve_remote(w, &ids, &tags))
                .collect::<Result<_, _>>()?
        };

        // The records of what is missing here, following parents.
        let target_set: HashSet<ObjectId> = targets.iter().copied().collect();
        let mut records: Vec<SnapshotRecord> = Vec::new();
        let mut seen = HashSet::new();
        let mut stack = targets.clone();
        while let Some(id) = stack.pop() {
            if !seen.insert(id) {
                continue;
            }
            if repo.snapshot_info(&id)?.is_some() {
                if target_set.contains(&id) {
                    report.snapshots_already += 1;
                }
                continue;
            }
            match self.record(&id).await? {
                Some(r) => {
                    stack
                        .extend(r.parent_ids().map_err(|e| {
                            self.corrupt(&self.key(&[layout::SNAPSHOTS, &r.id]), e)
                        })?);
                    records.push(r);
                }
                // A target listed a moment ago must exist; a parent the
                // remote never had is named by its child, not fetched.
                None if target_set.contains(&id) => {
                    return Err(RemoteError::NoSuchSnapshot {
                        url: self.url.clone(),
                        spec: id.to_hex(),
                    });
                }
                None => {}
            }
        }

        if !records.is_empty() {
            self.fetch_objects(repo, &records, progress, &mut report)
                .await?;
            let lock = repo.lock(true)?;
            for r in parents_first(records) {
                if lock.adopt_snapshot(&r.id(), r.files, r.bytes)? {
                    report.snapshots_received.push(r.id.clone());
                }
            }
        }

        // Tags on what is now here: set when missing, kept (and reported) when they differ.
        let local_tags: HashMap<String, ObjectId> = repo.tags()?.into_iter().collect();
        let mut to_set = Vec::new();
        for (name, id) in tags {
            if !(want.is_empty() || target_set.contains(&id) || want.contains(&name)) {
                continue;
            }
            if repo.snapshot_info(&id)?.is_none() {
                continue;
            }
            match local_tags.get(&name) {
                Some(l) if *l == id => {}
                Some(l) => report.tags_kept.push(crate::TagConflict {
                    name,
                    local: l.to_hex(),
                    remote: id.to_hex(),
                }),
                None => to_set.push((name, id)),
            }
        }
        if !to_set.is_empty() {
            let lock = repo.lock(true)?;
            for (name, id) in to_set {
                lock.set_tag(&name, &id, false)?;
                report.tags_set.push(name);
            }
        }
        Ok(report)
    }

    /// Makes every object reachable from `records` present, fetching the packs
    /// that hold the missing ones.
    async fn fetch_objects(
        &self,
        repo: &Repository,
        records: &[SnapshotRecord],
        progress: &dyn Progress,
        report: &mut PullReport,
    ) -> Result<(), RemoteError> {
        let inventory = self.inventory().await?;
        let incoming = self.state_dir.join("incoming");
        std::fs::create_dir_all(&incoming).map_err(io("create incoming directory", &incoming))?;
        let mut seen = HashSet::new();
        let mut stack: Vec<(Kind, ObjectId, ObjectId)> = records
            .iter()
            .map(|r| (Kind::Snapshot, r.id(), r.id()))
            .collect();
        while let Some((kind, id, snapshot)) = stack.pop() {
            if !seen.insert(id) {
                continue;
            }
            if !repo.has_object(&id)? {
                let Some(pack) = inventory.get(&id) else {
                    return Err(self.corrupt(
                        &self.key(&[layout::SNAPSHOTS, &snapshot.to_hex()]),
                        format!("object {id}, which it needs, is in none of the remote's packs"),
                    ));
                };
                self.fetch_pack(repo, pack, &incoming, progress, report)
                    .await?;
                if !repo.has_object(&id)? {
                    return Err(self.corrupt(
                        &self.pack_key(pack),
                        format!("its index lists object {id}, which the pack does not hold"),
                    ));
                }
            }
            if kind != Kind::Blob {
                let raw = repo.read_kind(&id, kind)?;
                let refs = references(kind, &raw)
                    .map_err(|source| tine_store::ObjectError::Decode { id, kind, source })?;
                stack.extend(
                    refs.into_iter()
                        .filter(|(_, r)| !seen.contains(r))
                        .map(|(k, r)| (k, r, snapshot)),
                );
            }
        }
        Ok(())
    }

    /// Downloads pack `name`, verifies every object in it, and moves it into
    /// the repository. A pack that fails is deleted and named in the error.
    async fn fetch_pack(
        &self,
        repo: &Repository,
        name: &str,
        incoming: &std::path::Path,
        progress: &dyn Progress,
        report: &mut PullReport,
    ) -> Result<(), RemoteError> {
        let key = self.pack_key(name);
        let path = incoming.join(format!("{name}{PACK_SUFFIX}"));
        report.bytes_received += self.download(&key, &path, progress).await?;
        let verified = match verify_pack(&path, progress) {
            Ok(v) if v.name == name => v,
            Ok(v) => {
                let _ = std::fs::remove_file(&path);
                return Err(self.corrupt(
                    &key,
                    format!(
                        "its index gives it the name {}, so its content is not what was pushed",
                        v.name
                    ),
                ));
            }
            Err(reason) => {
                let _ = std::fs::remove_file(&path);
                return Err(self.corrupt(&key, reason));
            }
        };
        let lock = repo.lock(true)?;
        lock.import_verified(&path, &verified)?;
        report.objects_verified += verified.entries.len() as u64;
        report.packs.push(name.to_string());
        Ok(())
    }
}

/// Orders records so that every parent among them comes before its children.
fn parents_first(mut records: Vec<SnapshotRecord>) -> Vec<SnapshotRecord> {
    records.sort_by(|a, b| a.time_ns.cmp(&b.time_ns).then(a.id.cmp(&b.id)));
    let mut done: HashSet<String> = HashSet::new();
    let all: HashSet<String> = records.iter().map(|r| r.id.clone()).collect();
    let mut out = Vec::with_capacity(records.len());
    while !records.is_empty() {
        let before = records.len();
        let mut rest = Vec::new();
        for r in records {
            if r.parents
                .iter()
                .all(|p| !all.contains(p) || done.contains(p))
            {
                done.insert(r.id.clone());
                out.push(r);
            } else {
                rest.push(r);
            }
        }
        if rest.len() == before {
            // A cycle cannot come from content hashes; keep the order given.
            out.extend(rest);
            break;
        }
        records = rest;
    }
    out
}
