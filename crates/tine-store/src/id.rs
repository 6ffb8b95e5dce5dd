//! Object ids: BLAKE3-256 over a one-byte kind tag followed by the object's raw encoding.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The kind of a stored object. The numeric value is part of the on-disk format.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
#[repr(u8)]
pub enum Kind {
    /// Raw file bytes (a whole small file or one chunk of a large one).
    Blob = 1,
    /// The ordered list of chunk blobs of a large file.
    Chunked = 2,
    /// One directory: sorted entries.
    Tree = 3,
    /// A snapshot: root tree, parents, time, message, tags, attachments.
    Snapshot = 4,
}

impl Kind {
    pub fn from_u8(v: u8) -> Option<Kind> {
        match v {
            1 => Some(Kind::Blob),
            2 => Some(Kind::Chunked),
            3 => Some(Kind::Tree),
            4 => Some(Kind::Snapshot),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Kind::Blob => "blob",
            Kind::Chunked => "chunked",
            Kind::Tree => "tree",
            Kind::Snapshot => "snapshot",
        }
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A 32-byte content address.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct ObjectId([u8; 32]);

/// Length of the abbreviated form shown to people.
pub const SHORT_HEX_LEN: usize = 12;

impl ObjectId {
    /// The id of an object of `kind` whose raw encoding is `data`.
    pub fn compute(kind: Kind, data: &[u8]) -> ObjectId {
        let mut h = blake3::Hasher::new();
        h.update(&[kind as u8]);
        h.update(data);
        ObjectId(*h.finalize().as_bytes())
    }

    pub const fn from_bytes(bytes: [u8; 32]) -> ObjectId {
        ObjectId(bytes)
    }

    pub fn from_slice(bytes: &[u8]) -> Option<ObjectId> {
        Some(ObjectId(bytes.try_into().ok()?))
    }

    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    pub fn to_hex(&self) -> String {
        let mut s = String::with_capacity(64);
        for b in self.0 {
            s.push(char::from(HEX[usize::from(b >> 4)]));
            s.push(char::from(HEX[usize::from(b & 15)]));
        }
        s
    }

    /// The first [`SHORT_HEX_LEN`] hex digits.
    pub fn short(&self) -> String {
        let mut s = self.to_hex();
        s.truncate(SHORT_HEX_LEN);
        s
    }

    /// Parses a full 64-digit hex id.
    pub fn from_hex(s: &str) -> Option<ObjectId> {
        if s.len() != 64 {
            return None;
        }
        let mut out = [0u8; 32];
        let bytes = s.as_bytes();
        for (i, o) in out.iter_mut().enumerate() {
            *o = (hex_val(bytes[2 * i])? << 4) | hex_val(bytes[2 * i + 1])?;
        }
        Some(ObjectId(out))
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

fn hex_val(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

/// True when `s` could be the start of an id (hex digits only).
pub fn is_hex_prefix(s: &str) -> bool {
    !s.is_empty() && s.len() <= 64 && s.bytes().all(|c| hex_val(c).is_some())
}

impl fmt::Display for ObjectId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for ObjectId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ObjectId({})", self.short())
    }
}

impl Serialize for ObjectId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for ObjectId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<ObjectId, D::Error> {
        let hex = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        ObjectId::from_hex(&hex)
            .ok_or_else(|| serde::de::Error::custom(format!("{hex:?} is not an object id")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trip() {
        let id = ObjectId::compute(Kind::Blob, b"hello");
        assert_eq!(ObjectId::from_hex(&id.to_hex()), Some(id));
        assert_eq!(id.short().len(), SHORT_HEX_LEN);
        assert!(ObjectId::from_hex("zz").is_none());
    }

    #[test]
    fn json_round_trip() {
        let id = ObjectId::compute(Kind::Blob, b"hello");
        let text = serde_json::to_string(&id).unwrap();
        assert_eq!(serde_json::from_str::<ObjectId>(&text).unwrap(), id);
        assert!(serde_json::from_str::<ObjectId>("\"zz\"").is_err());
    }

    #[test]
    fn kind_is_part_of_the_id() {
        assert_ne!(
            ObjectId::compute(Kind::Blob, b"x"),
            ObjectId::compute(Kind::Tree, b"x")
        );
    }
}
