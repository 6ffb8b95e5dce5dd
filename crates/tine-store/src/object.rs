//! The typed objects and their canonical encodings (see docs/FORMAT.md).
//!
//! Every encoder here is canonical: one value has exactly one encoding, so equal
//! content always gets the same id. Every decoder enforces size limits and rejects
//! anything non-canonical, including tree entry names that could escape a directory.

use serde::Serialize;

use crate::codec::{DecodeError, Reader, Writer, invalid};
use crate::id::{Kind, ObjectId};

/// Version byte that starts every tree, chunk list and snapshot encoding.
pub const OBJECT_VERSION: u8 = 1;
/// Version of a tree whose entries carry owners: used only when some entry's
/// owner is not 0:0, so a tree of root-owned files keeps its version-1 id.
pub const TREE_OWNERS_VERSION: u8 = 2;

/// Largest raw object the decoders accept (trees, chunk lists and snapshots).
pub const MAX_OBJECT_SIZE: u64 = 64 << 20;
/// Longest entry name (Linux NAME_MAX).
pub const MAX_NAME_LEN: u64 = 255;
/// Longest symlink target (Linux PATH_MAX).
pub const MAX_SYMLINK_LEN: u64 = 4096;
pub const MAX_TREE_ENTRIES: u64 = 1 << 20;
pub const MAX_CHUNKS: u64 = 1 << 24;
pub const MAX_CHUNK_SIZE: u64 = 16 << 20;
pub const MAX_MESSAGE_LEN: u64 = 1 << 20;
pub const MAX_PARENTS: u64 = 64;
pub const MAX_TAGS: u64 = 256;
pub const MAX_ATTACHMENTS: u64 = 256;
const MAX_SHORT_STRING: u64 = 4096;

/// How a file's content is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, serde::Deserialize)]
pub struct Content {
    /// `Blob` (the whole file in one object) or `Chunked` (a chunk list).
    pub kind: Kind,
    pub id: ObjectId,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Node {
    File { content: Content, size: u64 },
    Dir { tree: ObjectId },
    Symlink { target: Vec<u8> },
}

/// What kind of file an entry is, as listings and diffs name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EntryKind {
    File,
    Dir,
    Symlink,
    /// A device, FIFO or socket (seen in live directories; never stored).
    Other,
}

impl EntryKind {
    pub fn as_str(self) -> &'static str {
        match self {
            EntryKind::File => "file",
            EntryKind::Dir => "dir",
            EntryKind::Symlink => "symlink",
            EntryKind::Other => "other",
        }
    }
}

impl Node {
    pub fn kind(&self) -> EntryKind {
        match self {
            Node::File { .. } => EntryKind::File,
            Node::Dir { .. } => EntryKind::Dir,
            Node::Symlink { .. } => EntryKind::Symlink,
        }
    }
}

/// Who owns an entry, as IDs inside the sandbox it was taken from (0:0 is
/// its root). Scans that are not given an ID range record 0:0 for all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, serde::Deserialize)]
pub struct Owner {
    pub uid: u32,
    pub gid: u32,
}

impl Owner {
    pub const ROOT: Owner = Owner { uid: 0, gid: 0 };

    pub fn is_root(self) -> bool {
        self == Owner::ROOT
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeEntry {
    /// One path component, as raw bytes (Unix names need not be UTF-8).
    pub name: Vec<u8>,
    /// Permission bits (`0o7777` at most).
    pub mode: u32,
    /// Its owner; 0:0 unless the scan was given an ID range.
    pub owner: Owner,
    pub node: Node,
}

/// One directory. Entries are sorted by name bytes and names are unique.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Tree {
    pub entries: Vec<TreeEntry>,
}

const ENTRY_FILE: u8 = 1;
const ENTRY_DIR: u8 = 2;
const ENTRY_SYMLINK: u8 = 3;

/// Why a name may not be used as a directory entry.
pub fn check_name(name: &[u8]) -> Result<(), &'static str> {
    if name.is_empty() {
        return Err("empty name");
    }
    if name == b"." || name == b".." {
        return Err("name is '.' or '..'");
    }
    if name.contains(&b'/') {
        return Err("name contains '/'");
    }
    if name.contains(&0) {
        return Err("name contains NUL");
    }
    if name.len() as u64 > MAX_NAME_LEN {
        return Err("name longer than 255 bytes");
    }
    Ok(())
}

impl Tree {
    /// Encodes the tree. Entries must already be sorted; names are not checked here
    /// (the decoder checks them) so that tests can build hostile trees.
    pub fn encode(&self) -> Vec<u8> {
        let owners = !self.entries.iter().all(|e| e.owner.is_root());
        let mut w = Writer::new();
        w.u8(if owners {
            TREE_OWNERS_VERSION
        } else {
            OBJECT_VERSION
        });
        w.varint(self.entries.len() as u64);
        for e in &self.entries {
            w.bytes(&e.name);
            let owner = |w: &mut Writer| {
                if owners {
                    w.varint(u64::from(e.owner.uid));
                    w.varint(u64::from(e.owner.gid));
                }
            };
            match &e.node {
                Node::File { content, size } => {
                    w.u8(ENTRY_FILE);
                    w.varint(u64::from(e.mode));
                    owner(&mut w);
                    w.u8(content.kind as u8);
                    w.varint(*size);
                    w.id(&content.id);
                }
                Node::Dir { tree } => {
                    w.u8(ENTRY_DIR);
                    w.varint(u64::from(e.mode));
                    owner(&mut w);
                    w.id(tree);
                }
                Node::Symlink { target } => {
                    w.u8(ENTRY_SYMLINK);
                    w.varint(u64::from(e.mode));
                    owner(&mut w);
                    w.bytes(target);
                }
            }
        }
        w.finish()
    }

    pub fn decode(buf: &[u8]) -> Result<Tree, DecodeError> {
        let mut r = Reader::new(buf);
        let owners = match r.u8("version")? {
            OBJECT_VERSION => false,
            TREE_OWNERS_VERSION => true,
            v => {
                return Err(DecodeError::Version {
                    what: "tree",
                    version: v,
                    supported: TREE_OWNERS_VERSION,
                });
            }
        };
        let n = r.count("tree entry count", MAX_TREE_ENTRIES)?;
        let mut entries: Vec<TreeEntry> = Vec::with_capacity(n.min(4096));
        for _ in 0..n {
            let name = r.bytes("entry name", MAX_NAME_LEN)?.to_vec();
            check_name(&name).map_err(|reason| {
                invalid(
                    "entry name",
                    format!("{reason}: {:?}", String::from_utf8_lossy(&name)),
                )
            })?;
            if let Some(prev) = entries.last()
                && prev.name >= name
            {
                return Err(invalid("tree", "entries not sorted or duplicated"));
            }
            let tag = r.u8("entry type")?;
            let mode = r.varint("entry mode")?;
            if mode > 0o7777 {
                return Err(invalid("entry mode", format!("{mode:o}")));
            }
            let owner = if owners {
                Owner {
                    uid: owner_id(&mut r, "entry uid")?,
                    gid: owner_id(&mut r, "entry gid")?,
                }
            } else {
                Owner::ROOT
            };
            let node = match tag {
                ENTRY_FILE => {
                    let kind = match Kind::from_u8(r.u8("content kind")?) {
                        Some(k @ (Kind::Blob | Kind::Chunked)) => k,
                        _ => return Err(invalid("content kind", "not blob or chunked")),
                    };
                    let size = r.varint("file size")?;
                    let id = r.id("content id")?;
                    Node::File {
                        content: Content { kind, id },
                        size,
                    }
                }
                ENTRY_DIR => Node::Dir {
                    tree: r.id("tree id")?,
                },
                ENTRY_SYMLINK => {
                    let target = r.bytes("symlink target", MAX_SYMLINK_LEN)?.to_vec();
                    if target.is_empty() || target.contains(&0) {
                        return Err(invalid("symlink target", "empty or contains NUL"));
                    }
                    Node::Symlink { target }
                }
                t => return Err(invalid("entry type", format!("{t}"))),
            };
            entries.push(TreeEntry {
                name,
                mode: mode as u32,
                owner,
                node,
            });
        }
        r.finish()?;
        // Canonical: a tree of root-owned entries has one encoding, version 1.
        if owners && entries.iter().all(|e| e.owner.is_root()) {
            return Err(invalid("tree", "version 2 with every owner 0:0"));
        }
        Ok(Tree { entries })
    }

    pub fn id(&self) -> ObjectId {
        ObjectId::compute(Kind::Tree, &self.encode())
    }
}

/// A uid or gid: `u32::MAX` is `chown`'s "leave as is", never an owner.
fn owner_id(r: &mut Reader<'_>, what: &'static str) -> Result<u32, DecodeError> {
    let v = r.varint(what)?;
    if v >= u64::from(u32::MAX) {
        return Err(invalid(what, format!("{v}")));
    }
    Ok(v as u32)
}

fn check_version(r: &mut Reader<'_>, what: &'static str) -> Result<(), DecodeError> {
    let v = r.u8("version")?;
    if v != OBJECT_VERSION {
        return Err(DecodeError::Version {
            what,
            version: v,
            supported: OBJECT_VERSION,
        });
    }
    Ok(())
}

/// The chunks of a large file, in order. A piece whose id is
/// [`ChunkList::HOLE`] is a hole: that many zero bytes, stored as nothing
/// and written back as a hole (a sparse file stays sparse, and a terabyte
/// of apparent size costs what its data costs).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ChunkList {
    pub size: u64,
    /// (chunk blob id, chunk length)
    pub chunks: Vec<(ObjectId, u32)>,
}

/// Chunk lists that hold holes are encoded in this version; those that do
/// not keep version 1, so their ids are what they always were.
const SPARSE_VERSION: u8 = 2;

impl ChunkList {
    /// The id a hole has in [`ChunkList::chunks`]: all zero bytes, which no
    /// BLAKE3 hash is in practice; never stored, never read.
    pub const HOLE: ObjectId = ObjectId::from_bytes([0; 32]);

    /// Whether any piece is a hole.
    pub fn has_holes(&self) -> bool {
        self.chunks.iter().any(|(id, _)| *id == Self::HOLE)
    }

    /// The pieces that are data: (id, length).
    pub fn data(&self) -> impl Iterator<Item = &(ObjectId, u32)> {
        self.chunks.iter().filter(|(id, _)| *id != Self::HOLE)
    }

    pub fn encode(&self) -> Vec<u8> {
        let sparse = self.has_holes();
        let mut w = Writer::new();
        w.u8(if sparse {
            SPARSE_VERSION
        } else {
            OBJECT_VERSION
        });
        w.varint(self.size);
        w.varint(self.chunks.len() as u64);
        for (id, len) in &self.chunks {
            w.varint(u64::from(*len));
            if sparse {
                w.u8(u8::from(*id == Self::HOLE));
                if *id == Self::HOLE {
                    continue;
                }
            }
            w.id(id);
        }
        w.finish()
    }

    pub fn decode(buf: &[u8]) -> Result<ChunkList, DecodeError> {
        let mut r = Reader::new(buf);
        let sparse = match r.u8("version")? {
            OBJECT_VERSION => false,
            SPARSE_VERSION => true,
            v => {
                return Err(DecodeError::Version {
                    what: "chunk list",
                    version: v,
                    supported: SPARSE_VERSION,
                });
            }
        };
        let size = r.varint("file size")?;
        let n = r.count("chunk count", MAX_CHUNKS)?;
        let mut chunks = Vec::with_capacity(n.min(65536));
        let mut total: u64 = 0;
        let mut holes = 0;
        for _ in 0..n {
            let len = r.count("chunk length", u64::from(u32::MAX))? as u64;
            if len == 0 {
                return Err(invalid("chunk length", "zero"));
            }
            let hole = sparse
                && match r.u8("piece kind")? {
                    0 => false,
                    1 => true,
                    k => return Err(invalid("piece kind", format!("{k}"))),
                };
            if !hole && len > MAX_CHUNK_SIZE {
                return Err(invalid("chunk length", format!("{len}")));
            }
            total += len;
            let id = if hole {
                holes += 1;
                Self::HOLE
            } else {
                let id = r.id("chunk id")?;
                if id == Self::HOLE {
                    return Err(invalid("chunk id", "the hole's"));
                }
                id
            };
            chunks.push((id, len as u32));
        }
        r.finish()?;
        if total != size {
            return Err(invalid(
                "chunk list",
                format!("chunks add up to {total} bytes, file size says {size}"),
            ));
        }
        // One encoding per value: version 2 only where there are holes.
        if sparse && holes == 0 {
            return Err(invalid("chunk list", "version 2 without a hole"));
        }
        Ok(ChunkList { size, chunks })
    }
}

/// A named blob attached to a snapshot (e.g. an agent's chat trace).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Attachment {
    pub name: String,
    pub content: Content,
    pub size: u64,
}

/// The immutable record of one snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotObject {
    pub tree: ObjectId,
    pub parents: Vec<ObjectId>,
    /// Creation time, nanoseconds since the Unix epoch.
    pub time_ns: u64,
    pub message: String,
    /// The directory the snapshot was taken from (informational).
    pub source: String,
    /// Tags given when the snapshot was made (tags can later move; see refs).
    pub tags: Vec<String>,
    pub attachments: Vec<Attachment>,
}

impl SnapshotObject {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        w.u8(OBJECT_VERSION);
        w.id(&self.tree);
        w.varint(self.parents.len() as u64);
        for p in &self.parents {
            w.id(p);
        }
        w.varint(self.time_ns);
        w.bytes(self.message.as_bytes());
        w.bytes(self.source.as_bytes());
        w.varint(self.tags.len() as u64);
        for t in &self.tags {
            w.bytes(t.as_bytes());
        }
        w.varint(self.attachments.len() as u64);
        for a in &self.attachments {
            w.bytes(a.name.as_bytes());
            w.u8(a.content.kind as u8);
            w.varint(a.size);
            w.id(&a.content.id);
        }
        w.finish()
    }

    pub fn decode(buf: &[u8]) -> Result<SnapshotObject, DecodeError> {
        let mut r = Reader::new(buf);
        check_version(&mut r, "snapshot")?;
        let tree = r.id("tree id")?;
        let np = r.count("parent count", MAX_PARENTS)?;
        let parents = (0..np)
            .map(|_| r.id("parent id"))
            .collect::<Result<Vec<_>, _>>()?;
        let time_ns = r.varint("time")?;
        let message = r.string("message", MAX_MESSAGE_LEN)?;
        let source = r.string("source", MAX_SHORT_STRING)?;
        let nt = r.count("tag count", MAX_TAGS)?;
        let tags = (0..nt)
            .map(|_| r.string("tag", MAX_SHORT_STRING))
            .collect::<Result<Vec<_>, _>>()?;
        let na = r.count("attachment count", MAX_ATTACHMENTS)?;
        let mut attachments = Vec::with_capacity(na);
        for _ in 0..na {
            let name = r.string("attachment name", MAX_SHORT_STRING)?;
            let kind = match Kind::from_u8(r.u8("attachment kind")?) {
                Some(k @ (Kind::Blob | Kind::Chunked)) => k,
                _ => return Err(invalid("attachment kind", "not blob or chunked")),
            };
            let size = r.varint("attachment size")?;
            let id = r.id("attachment id")?;
            attachments.push(Attachment {
                name,
                content: Content { kind, id },
                size,
            });
        }
        r.finish()?;
        Ok(SnapshotObject {
            tree,
            parents,
            time_ns,
            message,
            source,
            tags,
            attachments,
        })
    }

    pub fn id(&self) -> ObjectId {
        ObjectId::compute(Kind::Snapshot, &self.encode())
    }
}

/// The ids an object refers to (for gc and fsck reachability).
pub fn references(kind: Kind, raw: &[u8]) -> Result<Vec<(Kind, ObjectId)>, DecodeError> {
    Ok(match kind {
        Kind::Blob => Vec::new(),
        Kind::Chunked => ChunkList::decode(raw)?
            .data()
            .map(|(id, _)| (Kind::Blob, *id))
            .collect(),
        Kind::Tree => Tree::decode(raw)?
            .entries
            .into_iter()
            .filter_map(|e| match e.node {
                Node::File { content, .. } => Some((content.kind, content.id)),
                Node::Dir { tree } => Some((Kind::Tree, tree)),
                Node::Symlink { .. } => None,
            })
            .collect(),
        Kind::Snapshot => {
            let s = SnapshotObject::decode(raw)?;
            let mut v = vec![(Kind::Tree, s.tree)];
            v.extend(s.attachments.iter().map(|a| (a.content.kind, a.content.id)));
            v
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(name: &str, data: &[u8]) -> TreeEntry {
        TreeEntry {
            name: name.as_bytes().to_vec(),
            mode: 0o644,
            owner: Owner::ROOT,
            node: Node::File {
                content: Content {
                    kind: Kind::Blob,
                    id: ObjectId::compute(Kind::Blob, data),
                },
                size: data.len() as u64,
            },
        }
    }

    #[test]
    fn tree_round_trip() {
        let t = Tree {
            entries: vec![
                file("a", b"1"),
                TreeEntry {
                    name: b"l".to_vec(),
                    mode: 0o777,
                    owner: Owner::ROOT,
                    node: Node::Symlink {
                        target: b"/etc/passwd".to_vec(),
                    },
                },
                TreeEntry {
                    name: b"sub".to_vec(),
                    mode: 0o755,
                    owner: Owner::ROOT,
                    node: Node::Dir {
                        tree: Tree::default().id(),
                    },
                },
            ],
        };
        assert_eq!(Tree::decode(&t.encode()).unwrap(), t);
    }

    #[test]
    fn owners_round_trip_and_root_owned_trees_keep_version_1() {
        let mut t = Tree {
            entries: vec![file("a", b"1"), file("b", b"2")],
        };
        let root_only = t.encode();
        assert_eq!(root_only[0], OBJECT_VERSION);
        t.entries[1].owner = Owner { uid: 105, gid: 108 };
        let owned = t.encode();
        assert_eq!(owned[0], TREE_OWNERS_VERSION);
        assert_eq!(Tree::decode(&owned).unwrap(), t);
        assert_ne!(Tree::decode(&root_only).unwrap().id(), t.id());
    }

    #[test]
    fn a_version_2_tree_of_root_owners_or_an_owner_of_minus_one_is_refused() {
        let mut t = Tree {
            entries: vec![file("a", b"1")],
        };
        let mut raw = t.encode();
        raw[0] = TREE_OWNERS_VERSION;
        // Version 2 wants two more varints after the mode: insert 0, 0.
        let at = 1 + 1 + 1 + 1 + 1 + 2; // count, name len, 'a', type, mode (2 bytes)
        raw.splice(at..at, [0u8, 0u8]);
        let err = Tree::decode(&raw).unwrap_err();
        assert!(err.to_string().contains("0:0"), "{err}");
        t.entries[0].owner = Owner {
            uid: u32::MAX,
            gid: 0,
        };
        let err = Tree::decode(&t.encode()).unwrap_err();
        assert!(err.to_string().contains("uid"), "{err}");
    }

    #[test]
    fn hostile_names_are_refused() {
        for bad in ["..", ".", "a/b", "/etc", "x\0y", ""] {
            let t = Tree {
                entries: vec![file(bad, b"x")],
            };
            let err = Tree::decode(&t.encode()).unwrap_err();
            assert!(matches!(err, DecodeError::Invalid { .. }), "{bad:?}: {err}");
        }
    }

    #[test]
    fn unsorted_entries_are_refused() {
        let t = Tree {
            entries: vec![file("b", b"1"), file("a", b"2")],
        };
        assert!(Tree::decode(&t.encode()).is_err());
    }

    #[test]
    fn snapshot_round_trip() {
        let s = SnapshotObject {
            tree: Tree::default().id(),
            parents: vec![ObjectId::compute(Kind::Snapshot, b"p")],
            time_ns: 1_700_000_000_000_000_000,
            message: "hello".into(),
            source: "/tmp/x".into(),
            tags: vec!["v1".into()],
            attachments: vec![Attachment {
                name: "trace".into(),
                content: Content {
                    kind: Kind::Blob,
                    id: ObjectId::compute(Kind::Blob, b"t"),
                },
                size: 1,
            }],
        };
        assert_eq!(SnapshotObject::decode(&s.encode()).unwrap(), s);
    }

    #[test]
    fn chunk_list_sizes_must_add_up() {
        let c = ChunkList {
            size: 10,
            chunks: vec![(ObjectId::compute(Kind::Blob, b"a"), 4)],
        };
        assert!(ChunkList::decode(&c.encode()).is_err());
    }
}
