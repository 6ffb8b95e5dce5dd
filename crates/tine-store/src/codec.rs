//! A tiny canonical binary codec (LEB128 varints, length-prefixed bytes) with size limits.

use crate::id::ObjectId;

/// Why an encoded value could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("truncated while reading {0}")]
    Truncated(&'static str),
    #[error("{what} is {len} bytes, over the limit of {limit}")]
    TooLarge {
        what: &'static str,
        len: u64,
        limit: u64,
    },
    #[error("invalid {what}: {reason}")]
    Invalid { what: &'static str, reason: String },
    #[error("unsupported {what} version {version} (this tine reads version {supported})")]
    Version {
        what: &'static str,
        version: u8,
        supported: u8,
    },
    #[error("{0} trailing bytes after the encoded value")]
    Trailing(usize),
}

#[derive(Debug, Default)]
pub struct Writer {
    pub buf: Vec<u8>,
}

impl Writer {
    pub fn new() -> Writer {
        Writer::default()
    }

    pub fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }

    pub fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.buf.push((v as u8) | 0x80);
            v >>= 7;
        }
        self.buf.push(v as u8);
    }

    pub fn bytes(&mut self, b: &[u8]) {
        self.varint(b.len() as u64);
        self.buf.extend_from_slice(b);
    }

    pub fn id(&mut self, id: &ObjectId) {
        self.buf.extend_from_slice(id.as_bytes());
    }

    pub fn finish(self) -> Vec<u8> {
        self.buf
    }
}

#[derive(Debug)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Reader<'a> {
        Reader { buf, pos: 0 }
    }

    pub fn u8(&mut self, what: &'static str) -> Result<u8, DecodeError> {
        let v = *self.buf.get(self.pos).ok_or(DecodeError::Truncated(what))?;
        self.pos += 1;
        Ok(v)
    }

    pub fn varint(&mut self, what: &'static str) -> Result<u64, DecodeError> {
        let mut v: u64 = 0;
        for shift in (0..64).step_by(7) {
            let b = self.u8(what)?;
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                // Reject non-canonical encodings so that one value has one encoding.
                if b == 0 && shift > 0 {
                    return Err(invalid(what, "non-canonical varint"));
                }
                return Ok(v);
            }
        }
        Err(invalid(what, "varint longer than 64 bits"))
    }

    /// A varint that must not exceed `limit`.
    pub fn count(&mut self, what: &'static str, limit: u64) -> Result<usize, DecodeError> {
        let v = self.varint(what)?;
        if v > limit {
            return Err(DecodeError::TooLarge {
                what,
                len: v,
                limit,
            });
        }
        Ok(v as usize)
    }

    pub fn bytes(&mut self, what: &'static str, limit: u64) -> Result<&'a [u8], DecodeError> {
        let len = self.count(what, limit)?;
        let end = self
            .pos
            .checked_add(len)
            .ok_or(DecodeError::Truncated(what))?;
        let s = self
            .buf
            .get(self.pos..end)
            .ok_or(DecodeError::Truncated(what))?;
        self.pos = end;
        Ok(s)
    }

    pub fn string(&mut self, what: &'static str, limit: u64) -> Result<String, DecodeError> {
        let b = self.bytes(what, limit)?;
        String::from_utf8(b.to_vec()).map_err(|_| invalid(what, "not UTF-8"))
    }

    pub fn id(&mut self, what: &'static str) -> Result<ObjectId, DecodeError> {
        let end = self.pos + 32;
        let s = self
            .buf
            .get(self.pos..end)
            .ok_or(DecodeError::Truncated(what))?;
        self.pos = end;
        Ok(ObjectId::from_slice(s).expect("32 bytes"))
    }

    pub fn finish(self) -> Result<(), DecodeError> {
        match self.buf.len() - self.pos {
            0 => Ok(()),
            n => Err(DecodeError::Trailing(n)),
        }
    }
}

pub fn invalid(what: &'static str, reason: impl Into<String>) -> DecodeError {
    DecodeError::Invalid {
        what,
        reason: reason.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varint_round_trip_and_canonical() {
        for v in [0u64, 1, 127, 128, 300, u32::MAX as u64, u64::MAX] {
            let mut w = Writer::new();
            w.varint(v);
            let buf = w.finish();
            let mut r = Reader::new(&buf);
            assert_eq!(r.varint("v").unwrap(), v);
            r.finish().unwrap();
        }
        // 0x80 0x00 encodes 0 non-canonically.
        assert!(Reader::new(&[0x80, 0x00]).varint("v").is_err());
    }

    #[test]
    fn limits_are_enforced() {
        let mut w = Writer::new();
        w.bytes(&[0u8; 10]);
        let buf = w.finish();
        assert!(matches!(
            Reader::new(&buf).bytes("name", 5),
            Err(DecodeError::TooLarge { .. })
        ));
        assert!(matches!(
            Reader::new(&buf[..4]).bytes("name", 50),
            Err(DecodeError::Truncated(_))
        ));
    }
}
