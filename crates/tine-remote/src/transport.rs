//! Requests to the store: small records, listings, the index cache, and the
//! transfer of whole packs (downloads streamed to a file; uploads in parts,
//! resumable on a store with the multipart API).

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use futures::{StreamExt, TryStreamExt};
use object_store::path::Path as Key;
use object_store::{ObjectStoreExt, PutMode, PutOptions, PutPayload};
use serde::{Deserialize, Serialize};
use tine_store::{Kind, ObjectId, Progress, write_atomic};

use crate::layout::{self, Marker, SnapshotRecord, TagRecord};
use crate::push::{PushOptions, Resumed};
use crate::{Remote, RemoteError, io};

/// Where an interrupted multipart upload stands (a local JSON file, rewritten
/// atomically after every part).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct UploadState {
    pub version: u32,
    pub url: String,
    pub key: String,
    pub pack: String,
    pub size: u64,
    pub part_size: u64,
    pub upload_id: String,
    /// Part index -> the part id (ETag) the store gave it.
    pub parts: BTreeMap<usize, String>,
}

pub(crate) const UPLOAD_STATE: &str = "upload.json";

impl Remote {
    pub(crate) fn key(&self, parts: &[&str]) -> Key {
        let mut k = self.prefix.clone();
        for p in parts {
            k = k.clone().join(*p);
        }
        k
    }

    /// `packs/NAME.pack`: the same name and suffix as in the local store.
    pub(crate) fn pack_key(&self, name: &str) -> Key {
        self.key(&[
            layout::PACKS,
            &format!("{name}{}", tine_store::pack::PACK_SUFFIX),
        ])
    }

    /// `packs/NAME.idx`.
    pub(crate) fn idx_key(&self, name: &str) -> Key {
        self.key(&[layout::PACKS, &format!("{name}{}", layout::IDX_EXT)])
    }

    fn key_str(&self, k: &Key) -> String {
        k.as_ref().to_string()
    }

    /// Maps a store error to what the user can act on.
    pub(crate) fn net(
        &self,
        op: &'static str,
        key: &Key,
    ) -> impl FnOnce(object_store::Error) -> RemoteError + use<'_> {
        let key = self.key_str(key);
        move |e| match e {
            object_store::Error::Unauthenticated { .. }
            | object_store::Error::PermissionDenied { .. } => RemoteError::Denied {
                url: self.url.clone(),
                op,
                key,
                reason: summary(&e),
            },
            _ => {
                let chain = error_chain(&e);
                let reason = summary(&e);
                if chain.contains("NoSuchBucket") {
                    return RemoteError::NoBucket {
                        url: self.url.clone(),
                        bucket: match crate::Location::parse(&self.url) {
                            Ok(crate::Location::S3 { bucket, .. }) => bucket,
                            _ => String::new(),
                        },
                    };
                }
                RemoteError::Unreachable {
                    url: self.url.clone(),
                    op,
                    key,
                    reason,
                }
            }
        }
    }

    pub(crate) fn corrupt(&self, key: &Key, reason: impl Into<String>) -> RemoteError {
        RemoteError::Corrupt {
            url: self.url.clone(),
            key: self.key_str(key),
            reason: reason.into(),
        }
    }

    /// Reads a small object whole; None when it does not exist. Refuses one
    /// over `limit` bytes without reading it.
    pub(crate) async fn get_small(
        &self,
        key: &Key,
        limit: u64,
    ) -> Result<Option<Vec<u8>>, RemoteError> {
        let res = match self.store.get(key).await {
            Ok(r) => r,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(self.net("GET", key)(e)),
        };
        if res.meta.size > limit {
            return Err(self.corrupt(
                key,
                format!("{} bytes, over the limit of {limit}", res.meta.size),
            ));
        }
        let bytes = res.bytes().await.map_err(self.net("GET", key))?;
        Ok(Some(bytes.to_vec()))
    }

    /// Writes a small object (replacing it). Returns the bytes sent.
    pub(crate) async fn put_small(&self, key: &Key, data: Vec<u8>) -> Result<u64, RemoteError> {
        let n = data.len() as u64;
        self.store
            .put(key, PutPayload::from(data))
            .await
            .map_err(self.net("PUT", key))?;
        Ok(n)
    }

    /// The names directly or indirectly under `dir` (relative to it).
    pub(crate) async fn list_names(&self, dir: &str) -> Result<Vec<String>, RemoteError> {
        let base = self.key(&[dir]);
        let metas: Vec<_> = self
            .store
            .list(Some(&base))
            .try_collect()
            .await
            .map_err(self.net("LIST", &base))?;
        let strip = format!("{}/", base.as_ref());
        Ok(metas
            .into_iter()
            .filter_map(|m| m.location.as_ref().strip_prefix(&strip).map(str::to_string))
            .collect())
    }

    /// Checks the marker. When `create` and the prefix holds nothing at all,
    /// writes one (a first push); otherwise a missing marker means this is not
    /// a tine remote.
    pub(crate) async fn check_marker(&self, create: bool) -> Result<u64, RemoteError> {
        // A file remote tine makes is its owner's only (0700): the packs it
        // holds are what the 0700 repository protects.
        if create
            && let Ok(crate::Location::File { path }) = crate::Location::parse(&self.url)
            && !path.exists()
        {
            use std::os::unix::fs::DirBuilderExt;
            let made = path
                .parent()
                .map_or(Ok(()), std::fs::create_dir_all)
                .and_then(|()| std::fs::DirBuilder::new().mode(0o700).create(&path));
            match made {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(crate::io("create the remote's directory", &path)(e)),
            }
        }
        let key = self.key(&[layout::MARKER]);
        let not_remote = |reason: String| RemoteError::NotARemote {
            url: self.url.clone(),
            reason,
        };
        if let Some(bytes) = self.get_small(&key, layout::MAX_MARKER).await? {
            layout::decode_json(
                &bytes,
                layout::MAX_MARKER,
                layout::REMOTE_FORMAT,
                |m: &Marker| (&m.format, m.version),
            )
            .map_err(|r| not_remote(format!("its marker {}: {r}", self.key_str(&key))))?;
            return Ok(0);
        }
        // A listing tells a missing bucket from an empty prefix.
        let mut anything = self.store.list(if self.prefix.as_ref().is_empty() {
            None
        } else {
            Some(&self.prefix)
        });
        let first = anything
            .next()
            .await
            .transpose()
            .map_err(self.net("LIST", &self.prefix))?;
        if !create {
            return Err(not_remote(format!(
                "there is no {} (push to it first)",
                self.key_str(&key)
            )));
        }
        if let Some(first) = first {
            return Err(not_remote(format!(
                "it holds other data ({}) and no {} marker; use an empty prefix",
                first.location,
                layout::MARKER
            )));
        }
        drop(anything);
        let data = serde_json::to_vec(&Marker::current()).expect("marker serializes");
        let n = data.len() as u64;
        let opts = PutOptions {
            mode: PutMode::Create,
            ..PutOptions::default()
        };
        match self
            .store
            .put_opts(&key, PutPayload::from(data), opts)
            .await
        {
            // Someone else created it at the same moment: theirs is as good.
            Ok(_) | Err(object_store::Error::AlreadyExists { .. }) => Ok(n),
            Err(e) => Err(self.net("PUT", &key)(e)),
        }
    }

    /// The ids of the snapshots the remote has records of.
    pub(crate) async fn snapshot_ids(&self) -> Result<Vec<ObjectId>, RemoteError> {
        Ok(self
            .list_names(layout::SNAPSHOTS)
            .await?
            .iter()
            .filter_map(|n| ObjectId::from_hex(n))
            .collect())
    }

    /// One snapshot record; None when the remote has none for `id`.
    pub(crate) async fn record(
        &self,
        id: &ObjectId,
    ) -> Result<Option<SnapshotRecord>, RemoteError> {
        let hex = id.to_hex();
        let key = self.key(&[layout::SNAPSHOTS, &hex]);
        match self.get_small(&key, layout::MAX_RECORD).await? {
            None => Ok(None),
            Some(b) => SnapshotRecord::decode(&b, &hex)
                .map(Some)
                .map_err(|r| self.corrupt(&key, r)),
        }
    }

    /// Every snapshot record (fetched 16 at a time), oldest first.
    pub(crate) async fn records(&self) -> Result<Vec<SnapshotRecord>, RemoteError> {
        let ids = self.snapshot_ids().await?;
        let mut out: Vec<SnapshotRecord> = futures::stream::iter(ids)
            .map(|id| async move { self.record(&id).await })
            .buffer_unordered(16)
            .try_filter_map(|r| async move { Ok(r) })
            .try_collect()
            .await?;
        out.sort_by(|a, b| a.time_ns.cmp(&b.time_ns).then(a.id.cmp(&b.id)));
        Ok(out)
    }

    /// Every tag of the remote.
    pub(crate) async fn tags(&self) -> Result<Vec<(String, ObjectId)>, RemoteError> {
        let mut out = Vec::new();
        for name in self.list_names(layout::TAGS).await? {
            let key = self.key(&[layout::TAGS, &name]);
            if let Some(b) = self.get_small(&key, layout::MAX_TAG).await? {
                let id = TagRecord::decode(&b).map_err(|r| self.corrupt(&key, r))?;
                out.push((name, id));
            }
        }
        out.sort();
        Ok(out)
    }

    /// The local copy of a pack's index (indexes never change once written).
    fn idx_cache(&self, pack: &str) -> PathBuf {
        self.state_dir
            .join("idx")
            .join(format!("{pack}{}", layout::IDX_EXT))
    }

    /// Which pack of the remote holds each object, from the packs' indexes;
    /// each index is fetched once, then read from the state directory.
    pub(crate) async fn inventory(&self) -> Result<HashMap<ObjectId, String>, RemoteError> {
        let mut map = HashMap::new();
        for name in self.list_names(layout::PACKS).await? {
            let Some(pack) = name
                .strip_suffix(layout::IDX_EXT)
                .filter(|p| is_pack_name(p))
            else {
                continue;
            };
            let cached = self.idx_cache(pack);
            let entries = match std::fs::read(&cached) {
                Ok(b) => layout::decode_idx(&b).map_err(|_| {
                    // Damaged here, not there: dropped, so the next call fetches it again.
                    let _ = std::fs::remove_file(&cached);
                    RemoteError::Corrupt {
                        url: self.url.clone(),
                        key: cached.display().to_string(),
                        reason: "the cached index is damaged (removed; run the command again)"
                            .into(),
                    }
                })?,
                Err(_) => {
                    let key = self.idx_key(pack);
                    let limit = 20 + 33 * layout::MAX_IDX_ENTRIES + 32;
                    let Some(b) = self.get_small(&key, limit).await? else {
                        continue;
                    };
                    let entries = layout::decode_idx(&b).map_err(|r| self.corrupt(&key, r))?;
                    write_atomic(&cached, &b).map_err(io("cache pack index", &cached))?;
                    entries
                }
            };
            for (id, _) in entries {
                map.entry(id).or_insert_with(|| pack.to_string());
            }
        }
        Ok(map)
    }

    /// Writes a pack's index (after the pack itself), and keeps a copy.
    pub(crate) async fn put_idx(
        &self,
        pack: &str,
        entries: &[(ObjectId, Kind)],
    ) -> Result<u64, RemoteError> {
        let data = layout::encode_idx(entries);
        let n = self.put_small(&self.idx_key(pack), data.clone()).await?;
        let cached = self.idx_cache(pack);
        write_atomic(&cached, &data).map_err(io("cache pack index", &cached))?;
        Ok(n)
    }

    /// Streams object `key` into a new file `dest`. Returns its size.
    pub(crate) async fn download(
        &self,
        key: &Key,
        dest: &Path,
        progress: &dyn Progress,
    ) -> Result<u64, RemoteError> {
        let res = self.store.get(key).await.map_err(self.net("GET", key))?;
        progress.start("download", res.meta.size);
        let mut out = std::io::BufWriter::with_capacity(
            1 << 20,
            File::create(dest).map_err(io("create download file", dest))?,
        );
        let mut stream = res.into_stream();
        let mut n = 0u64;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(self.net("GET", key))?;
            out.write_all(&chunk)
                .map_err(io("write download file", dest))?;
            n += chunk.len() as u64;
            progress.advance(chunk.len() as u64);
        }
        out.flush().map_err(io("write download file", dest))?;
        progress.finish();
        Ok(n)
    }

    /// Uploads file `src` (pack `pack`) to `key`: one request when it fits in
    /// a part; otherwise in parts, concurrently, recording each finished part
    /// in the upload state so that a later call resumes instead of starting
    /// again. Returns the bytes sent by this call and what was resumed.
    pub(crate) async fn upload(
        &self,
        key: &Key,
        pack: &str,
        src: &Path,
        opts: &PushOptions,
        progress: &dyn Progress,
    ) -> Result<(u64, Option<Resumed>), RemoteError> {
        let file = File::open(src).map_err(io("open pack to upload", src))?;
        let size = file
            .metadata()
            .map_err(io("stat pack to upload", src))?
            .len();
        let part_size = opts.part_size.max(1);
        progress.start("upload", size);
        if size <= part_size {
            let mut data = vec![0u8; size as usize];
            file.read_exact_at(&mut data, 0)
                .map_err(io("read pack to upload", src))?;
            let n = self.put_small(key, data).await?;
            progress.advance(n);
            progress.finish();
            return Ok((n, None));
        }
        let parts = size.div_ceil(part_size) as usize;
        let read_part = |i: usize| -> Result<Vec<u8>, RemoteError> {
            let start = i as u64 * part_size;
            let len = part_size.min(size - start) as usize;
            let mut data = vec![0u8; len];
            file.read_exact_at(&mut data, start)
                .map_err(io("read pack to upload", src))?;
            Ok(data)
        };
        let Some(mp) = self.multipart.clone() else {
            // A directory: a streamed write, renamed into place when complete.
            let mut up = self
                .store
                .put_multipart(key)
                .await
                .map_err(self.net("PUT", key))?;
            for i in 0..parts {
                let data = read_part(i)?;
                let n = data.len() as u64;
                up.put_part(PutPayload::from(data))
                    .await
                    .map_err(self.net("PUT part", key))?;
                progress.advance(n);
            }
            up.complete()
                .await
                .map_err(self.net("complete upload", key))?;
            progress.finish();
            return Ok((size, None));
        };
        let state_path = self.state_dir.join(UPLOAD_STATE);
        let key_s = self.key_str(key);
        let mut state = match load_state(&state_path) {
            Some(s)
                if s.url == self.url
                    && s.key == key_s
                    && s.pack == pack
                    && s.size == size
                    && s.part_size == part_size =>
            {
                s
            }
            _ => {
                let upload_id = mp
                    .create_multipart(key)
                    .await
                    .map_err(self.net("start upload", key))?;
                let s = UploadState {
                    version: 1,
                    url: self.url.clone(),
                    key: key_s.clone(),
                    pack: pack.to_string(),
                    size,
                    part_size,
                    upload_id,
                    parts: BTreeMap::new(),
                };
                save_state(&state_path, &s)?;
                s
            }
        };
        let resumed = (!state.parts.is_empty()).then(|| Resumed {
            parts_already_sent: state.parts.len(),
            parts,
            bytes_already_sent: state
                .parts
                .keys()
                .map(|&i| part_size.min(size - i as u64 * part_size))
                .sum(),
        });
        if let Some(r) = &resumed {
            progress.advance(r.bytes_already_sent);
        }
        let todo: Vec<usize> = (0..parts)
            .filter(|i| !state.parts.contains_key(i))
            .collect();
        let shared = Mutex::new(state.clone());
        let id = state.upload_id.clone();
        let sent: u64 = futures::stream::iter(todo)
            .map(|i| {
                let (mp, id, shared, state_path) = (&mp, &id, &shared, &state_path);
                async move {
                    if !opts.part_pause.is_zero() {
                        tokio::time::sleep(opts.part_pause).await;
                    }
                    let data = read_part(i)?;
                    let n = data.len() as u64;
                    let part = mp
                        .put_part(key, id, i, PutPayload::from(data))
                        .await
                        .map_err(self.net("PUT part", key))?;
                    let snapshot = {
                        let mut s = shared.lock().unwrap_or_else(|e| e.into_inner());
                        s.parts.insert(i, part.content_id);
                        s.clone()
                    };
                    save_state(state_path, &snapshot)?;
                    progress.advance(n);
                    Ok::<u64, RemoteError>(n)
                }
            })
            .buffer_unordered(opts.concurrency.max(1))
            .try_fold(0u64, |acc, n| async move { Ok(acc + n) })
            .await?;
        state = shared.into_inner().unwrap_or_else(|e| e.into_inner());
        let ids: Vec<object_store::multipart::PartId> = (0..parts)
            .map(|i| object_store::multipart::PartId {
                content_id: state.parts[&i].clone(),
            })
            .collect();
        match mp.complete_multipart(key, &state.upload_id, ids).await {
            Ok(_) => {}
            Err(object_store::Error::NotFound { .. }) => {
                // The store forgot the upload (expired or aborted): start over once.
                let _ = std::fs::remove_file(&state_path);
                return Box::pin(self.upload(key, pack, src, opts, progress)).await;
            }
            Err(e) => return Err(self.net("complete upload", key)(e)),
        }
        let _ = std::fs::remove_file(&state_path);
        progress.finish();
        Ok((sent, resumed))
    }
}

pub(crate) fn load_state(path: &Path) -> Option<UploadState> {
    let bytes = std::fs::read(path).ok()?;
    if bytes.len() > 16 << 20 {
        return None;
    }
    serde_json::from_slice::<UploadState>(&bytes)
        .ok()
        .filter(|s| s.version == 1)
}

fn save_state(path: &Path, s: &UploadState) -> Result<(), RemoteError> {
    let data = serde_json::to_vec(s).expect("upload state serializes");
    write_atomic(path, &data).map_err(io("write upload state", path))
}

/// A pack name is 64 lowercase hex digits.
pub(crate) fn is_pack_name(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// An error with its sources, on one line (connection errors hide the cause).
/// What a store error says, in one line, with nothing the server sent: its
/// status where it gave one, and what kind of failure it was. (A response
/// body is the server's to say, and an endpoint a client named may be any
/// service the daemon reaches: nothing of it goes back to the client.)
pub(crate) fn summary(e: &object_store::Error) -> String {
    use object_store::Error as E;
    let chain = error_chain(e);
    let kind = match e {
        E::NotFound { .. } => "not found",
        E::AlreadyExists { .. } => "already exists",
        E::Precondition { .. } => "precondition failed",
        E::NotModified { .. } => "not modified",
        E::NotImplemented { .. } => "not implemented by the server",
        E::Unauthenticated { .. } => "not authenticated",
        E::PermissionDenied { .. } => "permission denied",
        _ if chain.contains("NoSuchBucket") => "no such bucket",
        _ if chain.contains("Connection refused") => "connection refused",
        _ if chain.contains("timed out") || chain.contains("Timeout") => "timed out",
        _ if chain.contains("dns error") || chain.contains("failed to lookup") => {
            "host name not resolved"
        }
        _ if chain.contains("error sending request") || chain.contains("connect") => {
            "connection failed"
        }
        _ => "request failed",
    };
    match http_status(&chain) {
        Some(code) => format!("{kind} (HTTP {code})"),
        None => kind.to_string(),
    }
}

/// The first HTTP status a store error's text names (`status code: 404`,
/// `status: 503`).
fn http_status(chain: &str) -> Option<u16> {
    for marker in ["status code: ", "status: ", "Status: "] {
        if let Some(i) = chain.find(marker) {
            let digits: String = chain[i + marker.len()..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            if let Ok(code) = digits.parse::<u16>()
                && (100..600).contains(&code)
            {
                return Some(code);
            }
        }
    }
    None
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = c.source();
    }
    s
}
