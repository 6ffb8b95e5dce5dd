//! What a remote holds, under its prefix (documented in docs/FORMAT.md):
//!
//! ```text
//! tine-remote            marker: {"format":"tine-remote","version":1}
//! packs/NAME.pack        a pack, byte for byte the local pack format
//! packs/NAME.idx         the ids it holds (binary, below); written after the pack
//! snapshots/HEX          a snapshot record (JSON); written after its objects
//! tags/NAME              {"format":"tine-tag","version":1,"snapshot":HEX}
//! workspaces/NAME        a suspended workspace (JSON, written by tine-engine)
//!                        after its state's snapshot
//! ```
//! Readers only trust what is reachable from a record, and every record is
//! written after what it refers to, so an interrupted writer leaves at worst
//! unreferenced packs behind.

use serde::{Deserialize, Serialize};
use tine_store::{Kind, ObjectId};

pub const MARKER: &str = "tine-remote";
pub const REMOTE_FORMAT: &str = "tine-remote";
pub const REMOTE_VERSION: u32 = 1;
pub const PACKS: &str = "packs";
pub const SNAPSHOTS: &str = "snapshots";
pub const TAGS: &str = "tags";
pub const WORKSPACES: &str = "workspaces";
pub const IDX_EXT: &str = ".idx";

/// Size limits for what is read back from a remote (decoders never trust sizes).
pub const MAX_MARKER: u64 = 4 << 10;
pub const MAX_RECORD: u64 = 1 << 20;
pub const MAX_TAG: u64 = 4 << 10;
pub const MAX_WORKSPACE: u64 = 1 << 20;
/// 16 M objects per pack.
pub const MAX_IDX_ENTRIES: u64 = 16 << 20;

pub const IDX_MAGIC: [u8; 8] = *b"TINERIDX";
pub const IDX_VERSION: u32 = 1;
const IDX_HEADER: usize = 8 + 4 + 8;
const IDX_ENTRY: usize = 33;
const IDX_TRAILER: usize = 32;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Marker {
    pub format: String,
    pub version: u32,
}

impl Marker {
    pub fn current() -> Marker {
        Marker {
            format: REMOTE_FORMAT.into(),
            version: REMOTE_VERSION,
        }
    }
}

/// What a remote knows of one snapshot beyond its object (which is in a pack).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct SnapshotRecord {
    pub format: String,
    pub version: u32,
    pub id: String,
    pub parents: Vec<String>,
    pub time_ns: u64,
    pub message: String,
    pub files: u64,
    pub bytes: u64,
}

pub const SNAPSHOT_FORMAT: &str = "tine-snapshot";
pub const TAG_FORMAT: &str = "tine-tag";

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TagRecord {
    pub format: String,
    pub version: u32,
    pub snapshot: String,
}

/// Decodes a JSON record of `format`, checking its format and version.
pub fn decode_json<T: for<'de> Deserialize<'de>>(
    bytes: &[u8],
    limit: u64,
    format: &str,
    get: impl Fn(&T) -> (&str, u32),
) -> Result<T, String> {
    if bytes.len() as u64 > limit {
        return Err(format!("{} bytes, over the limit of {limit}", bytes.len()));
    }
    // Nothing of what was read goes into the reason (serde's messages quote
    // the values they met): where the remote is any service a client
    // named, its answer is not reflected.
    let v: T = serde_json::from_slice(bytes).map_err(|e| {
        format!(
            "not a valid record ({:?} error at line {}, column {})",
            e.classify(),
            e.line(),
            e.column()
        )
    })?;
    let (f, version) = get(&v);
    if f != format {
        return Err(format!("not of format {format:?}"));
    }
    if version != REMOTE_VERSION {
        return Err(format!(
            "version {version}; this tine reads version {REMOTE_VERSION}"
        ));
    }
    Ok(v)
}

impl SnapshotRecord {
    pub fn decode(bytes: &[u8], key_hex: &str) -> Result<SnapshotRecord, String> {
        let r: SnapshotRecord =
            decode_json(bytes, MAX_RECORD, SNAPSHOT_FORMAT, |r: &SnapshotRecord| {
                (&r.format, r.version)
            })?;
        if r.id != key_hex {
            // (What it says is not quoted: a remote's answers are not reflected.)
            return Err("it describes another snapshot".into());
        }
        r.parent_ids()?;
        Ok(r)
    }

    pub fn id(&self) -> ObjectId {
        ObjectId::from_hex(&self.id).expect("checked when decoded or made")
    }

    pub fn parent_ids(&self) -> Result<Vec<ObjectId>, String> {
        self.parents
            .iter()
            .map(|p| ObjectId::from_hex(p).ok_or_else(|| "a parent id is not an id".to_string()))
            .collect()
    }
}

impl TagRecord {
    pub fn new(snapshot: &ObjectId) -> TagRecord {
        TagRecord {
            format: TAG_FORMAT.into(),
            version: REMOTE_VERSION,
            snapshot: snapshot.to_hex(),
        }
    }

    pub fn decode(bytes: &[u8]) -> Result<ObjectId, String> {
        let r: TagRecord = decode_json(bytes, MAX_TAG, TAG_FORMAT, |r: &TagRecord| {
            (&r.format, r.version)
        })?;
        ObjectId::from_hex(&r.snapshot).ok_or_else(|| "its snapshot id is not an id".to_string())
    }
}

/// Encodes a pack's id list: magic, version, count, then (id, kind) per
/// object, then a BLAKE3 checksum of everything before it.
pub fn encode_idx(entries: &[(ObjectId, Kind)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(IDX_HEADER + entries.len() * IDX_ENTRY + IDX_TRAILER);
    out.extend_from_slice(&IDX_MAGIC);
    out.extend_from_slice(&IDX_VERSION.to_le_bytes());
    out.extend_from_slice(&(entries.len() as u64).to_le_bytes());
    for (id, kind) in entries {
        out.extend_from_slice(id.as_bytes());
        out.push(*kind as u8);
    }
    let sum = blake3::hash(&out);
    out.extend_from_slice(sum.as_bytes());
    out
}

/// Decodes and checks a pack's id list.
pub fn decode_idx(bytes: &[u8]) -> Result<Vec<(ObjectId, Kind)>, String> {
    if bytes.len() < IDX_HEADER + IDX_TRAILER {
        return Err(format!("{} bytes is too short for an index", bytes.len()));
    }
    if bytes[..8] != IDX_MAGIC {
        return Err("bad magic (not a tine pack index)".into());
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if version != IDX_VERSION {
        return Err(format!(
            "index version {version}, this tine reads {IDX_VERSION}"
        ));
    }
    let count = u64::from_le_bytes(bytes[12..20].try_into().expect("8 bytes"));
    if count > MAX_IDX_ENTRIES {
        return Err(format!(
            "{count} entries, over the limit of {MAX_IDX_ENTRIES}"
        ));
    }
    let body_end = bytes.len() - IDX_TRAILER;
    if (body_end - IDX_HEADER) as u64 != count * IDX_ENTRY as u64 {
        return Err("length does not match the entry count".into());
    }
    if blake3::hash(&bytes[..body_end]).as_bytes()[..] != bytes[body_end..] {
        return Err("checksum mismatch".into());
    }
    bytes[IDX_HEADER..body_end]
        .chunks_exact(IDX_ENTRY)
        .map(|c| {
            let id = ObjectId::from_slice(&c[..32]).expect("32 bytes");
            let kind = Kind::from_u8(c[32]).ok_or("unknown object kind")?;
            Ok((id, kind))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idx_round_trips_and_detects_every_flipped_byte() {
        let entries: Vec<(ObjectId, Kind)> = (0..5u8)
            .map(|i| (ObjectId::compute(Kind::Blob, &[i]), Kind::Blob))
            .collect();
        let enc = encode_idx(&entries);
        assert_eq!(decode_idx(&enc).unwrap(), entries);
        for i in 0..enc.len() {
            let mut bad = enc.clone();
            bad[i] ^= 1;
            assert!(decode_idx(&bad).is_err(), "flip at {i} went unnoticed");
        }
        assert!(decode_idx(&enc[..enc.len() - 1]).is_err());
    }

    #[test]
    fn records_check_format_version_and_id() {
        let id = ObjectId::compute(Kind::Snapshot, b"x");
        let r = SnapshotRecord {
            format: SNAPSHOT_FORMAT.into(),
            version: 1,
            id: id.to_hex(),
            parents: vec![],
            time_ns: 1,
            message: "m".into(),
            files: 1,
            bytes: 2,
        };
        let enc = serde_json::to_vec(&r).unwrap();
        assert_eq!(SnapshotRecord::decode(&enc, &id.to_hex()).unwrap(), r);
        assert!(
            SnapshotRecord::decode(&enc, &ObjectId::compute(Kind::Blob, b"y").to_hex()).is_err()
        );
        let mut v2 = r.clone();
        v2.version = 2;
        let e =
            SnapshotRecord::decode(&serde_json::to_vec(&v2).unwrap(), &id.to_hex()).unwrap_err();
        assert!(e.contains("version 2"), "{e}");
        assert!(
            SnapshotRecord::decode(&vec![b' '; (MAX_RECORD + 1) as usize], &id.to_hex()).is_err()
        );
        assert_eq!(
            TagRecord::decode(&serde_json::to_vec(&TagRecord::new(&id)).unwrap()).unwrap(),
            id
        );
    }
}
