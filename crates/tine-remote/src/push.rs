//! Push: send the snapshots (and their ancestors) that the remote lacks, with
//! only the objects it lacks, as one new pack; then the pack's index; then the
//! snapshot records and tags. An upload interrupted earlier is finished first.

use std::collections::HashSet;
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tine_store::transfer::{closure, write_pack};
use tine_store::{Kind, ObjectId, Progress, Repository, pack};

use crate::layout::{self, SnapshotRecord, TagRecord};
use crate::transport::{UPLOAD_STATE, is_pack_name};
use crate::{Remote, RemoteError, io};

/// How a push uploads.
#[derive(Debug, Clone)]
pub struct PushOptions {
    /// Packs larger than this go up in parts of this size (S3 needs >= 5 MiB).
    pub part_size: u64,
    /// Parts in flight at once.
    pub concurrency: usize,
    /// A pause before each part (tests use it to interrupt an upload for real).
    pub part_pause: Duration,
}

impl Default for PushOptions {
    fn default() -> PushOptions {
        PushOptions {
            part_size: 16 << 20,
            concurrency: 4,
            part_pause: Duration::ZERO,
        }
    }
}

/// An upload that an earlier, interrupted push had started.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Resumed {
    pub parts_already_sent: usize,
    pub parts: usize,
    pub bytes_already_sent: u64,
}

/// What a push did.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PushReport {
    pub remote: String,
    pub url: String,
    /// Snapshots recorded on the remote by this push, oldest first.
    pub snapshots_sent: Vec<String>,
    /// Snapshots asked for (with their ancestors) that the remote had already.
    pub snapshots_already: usize,
    pub objects_sent: u64,
    /// The new pack, if any object was missing.
    pub pack: Option<String>,
    pub pack_bytes: u64,
    /// Every byte this push sent (packs, indexes, records, tags, marker).
    pub bytes_sent: u64,
    /// A pack left by an interrupted push and finished by this one.
    pub finished_earlier_pack: Option<String>,
    pub resumed: Option<Resumed>,
    pub tags_sent: Vec<String>,
}

impl Remote {
    /// Pushes `snapshots` (and every ancestor the repository has) and points
    /// the remote's `tags` at theirs.
    pub fn push(
        &self,
        repo: &Repository,
        snapshots: &[ObjectId],
        tags: &[(String, ObjectId)],
        opts: &PushOptions,
        progress: &dyn Progress,
    ) -> Result<PushReport, RemoteError> {
        let _lock = self.lock()?;
        self.rt
            .block_on(self.push_async(repo, snapshots, tags, opts, progress))
    }

    async fn push_async(
        &self,
        repo: &Repository,
        snapshots: &[ObjectId],
        tags: &[(String, ObjectId)],
        opts: &PushOptions,
        progress: &dyn Progress,
    ) -> Result<PushReport, RemoteError> {
        let mut report = PushReport {
            remote: self.name.clone(),
            url: self.url.clone(),
            snapshots_sent: Vec::new(),
            snapshots_already: 0,
            objects_sent: 0,
            pack: None,
            pack_bytes: 0,
            bytes_sent: 0,
            finished_earlier_pack: None,
            resumed: None,
            tags_sent: Vec::new(),
        };
        report.bytes_sent += self.check_marker(true).await?;
        let outgoing = self.state_dir.join("outgoing");
        std::fs::create_dir_all(&outgoing).map_err(io("create outgoing directory", &outgoing))?;
        self.finish_outgoing(&outgoing, opts, progress, &mut report)
            .await?;

        // Which snapshots: those asked for and their ancestors, parents first.
        let on_remote: HashSet<ObjectId> = self.snapshot_ids().await?.into_iter().collect();
        let mut todo = Vec::new();
        let mut seen = HashSet::new();
        let mut stack: Vec<ObjectId> = snapshots.to_vec();
        while let Some(id) = stack.pop() {
            if !seen.insert(id) {
                continue;
            }
            if on_remote.contains(&id) {
                report.snapshots_already += 1;
                continue;
            }
            // An ancestor pruned from this repository is named, not sent.
            let Some(info) = repo.snapshot_info(&id)? else {
                continue;
            };
            stack.extend(info.parents.iter().copied());
            todo.push(info);
        }
        todo.sort_by_key(|s| s.seq);

        if !todo.is_empty() {
            let have = self.inventory().await?;
            let ids: Vec<ObjectId> = todo.iter().map(|s| s.id).collect();
            let objects = closure(repo, &ids, |id| have.contains_key(id))?;
            if let Some(p) = write_pack(repo, &objects, &outgoing, progress)? {
                report.objects_sent = p.entries.len() as u64;
                report.pack_bytes = p.bytes;
                report.pack = Some(p.name.clone());
                let entries: Vec<(ObjectId, Kind)> =
                    p.entries.iter().map(|e| (e.id, e.kind)).collect();
                let (sent, resumed) = self
                    .send_pack(&p.name, &p.path, &entries, opts, progress)
                    .await?;
                report.bytes_sent += sent;
                report.resumed = resumed;
            }
        }
        for s in &todo {
            let rec = SnapshotRecord {
                format: layout::SNAPSHOT_FORMAT.into(),
                version: layout::REMOTE_VERSION,
                id: s.id.to_hex(),
                parents: s.parents.iter().map(ObjectId::to_hex).collect(),
                time_ns: s.time_ns,
                message: s.message.clone(),
                files: s.files,
                bytes: s.bytes,
            };
            let key = self.key(&[layout::SNAPSHOTS, &rec.id]);
            report.bytes_sent += self
                .put_small(&key, serde_json::to_vec(&rec).expect("record serializes"))
                .await?;
            report.snapshots_sent.push(rec.id);
        }
        for (name, id) in tags {
            let key = self.key(&[layout::TAGS, name]);
            let current = self
                .get_small(&key, layout::MAX_TAG)
                .await?
                .and_then(|b| TagRecord::decode(&b).ok());
            if current != Some(*id) {
                let data = serde_json::to_vec(&TagRecord::new(id)).expect("tag serializes");
                report.bytes_sent += self.put_small(&key, data).await?;
                report.tags_sent.push(name.clone());
            }
        }
        Ok(report)
    }

    /// Uploads a pack, then its index, then forgets the local copy.
    async fn send_pack(
        &self,
        name: &str,
        path: &Path,
        entries: &[(ObjectId, Kind)],
        opts: &PushOptions,
        progress: &dyn Progress,
    ) -> Result<(u64, Option<crate::Resumed>), RemoteError> {
        let key = self.pack_key(name);
        let (mut sent, resumed) = self.upload(&key, name, path, opts, progress).await?;
        sent += self.put_idx(name, entries).await?;
        std::fs::remove_file(path).map_err(io("remove uploaded pack", path))?;
        Ok((sent, resumed))
    }

    /// Finishes what an interrupted push left in `outgoing`: complete packs
    /// whose upload (or index) did not finish.
    async fn finish_outgoing(
        &self,
        outgoing: &Path,
        opts: &PushOptions,
        progress: &dyn Progress,
        report: &mut PushReport,
    ) -> Result<(), RemoteError> {
        let dir = std::fs::read_dir(outgoing).map_err(io("list outgoing packs", outgoing))?;
        for entry in dir {
            let entry = entry.map_err(io("list outgoing packs", outgoing))?;
            let path = entry.path();
            let fname = entry.file_name().to_string_lossy().into_owned();
            let Some(name) = fname
                .strip_suffix(pack::PACK_SUFFIX)
                .filter(|n| is_pack_name(n))
            else {
                // A pack being written when the push died: never complete, never sent.
                let _ = std::fs::remove_file(&path);
                continue;
            };
            let read = std::fs::File::open(&path)
                .map_err(|e| e.to_string())
                .and_then(|f| pack::read_index(&f));
            let entries = match read {
                Ok(e) => e,
                Err(_) => {
                    let _ = std::fs::remove_file(&path);
                    continue;
                }
            };
            let ids: Vec<(ObjectId, Kind)> = entries.iter().map(|e| (e.id, e.kind)).collect();
            let (sent, resumed) = self.send_pack(name, &path, &ids, opts, progress).await?;
            report.bytes_sent += sent;
            report.resumed = resumed;
            report.finished_earlier_pack = Some(name.to_string());
        }
        // An upload state without its pack cannot be resumed.
        let state = self.state_dir.join(UPLOAD_STATE);
        if let Some(s) = crate::transport::load_state(&state)
            && !outgoing
                .join(format!("{}{}", s.pack, pack::PACK_SUFFIX))
                .exists()
        {
            let _ = std::fs::remove_file(&state);
        }
        Ok(())
    }
}
