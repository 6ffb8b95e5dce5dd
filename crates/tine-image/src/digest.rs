//! Content digests (`sha256:HEX`, the only algorithm OCI images use in
//! practice) and a reader that checks one as it reads.

use std::io::Read;

use sha2::{Digest as _, Sha256};

use crate::ImageError;

/// A `sha256:` digest, its hex checked.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(transparent)]
pub struct Digest(String);

impl Digest {
    pub fn parse(s: &str) -> Result<Digest, ImageError> {
        let hex = s
            .strip_prefix("sha256:")
            .ok_or_else(|| ImageError::BadDigest {
                digest: s.to_string(),
                reason: "only sha256 digests are read".into(),
            })?;
        if hex.len() != 64 || !hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return Err(ImageError::BadDigest {
                digest: s.to_string(),
                reason: "not 64 lowercase hex digits".into(),
            });
        }
        Ok(Digest(s.to_string()))
    }

    /// The digest of `bytes`.
    pub fn of(bytes: &[u8]) -> Digest {
        Digest(format!("sha256:{}", hex::encode(Sha256::digest(bytes))))
    }

    /// The hex part (a blob's file name in an OCI layout).
    pub fn hex(&self) -> &str {
        &self.0["sha256:".len()..]
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for Digest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Reads through, hashing; [`Verifying::finish`] says whether what was read
/// has the digest expected.
pub struct Verifying<R> {
    inner: R,
    hash: Sha256,
    bytes: u64,
}

impl<R> std::fmt::Debug for Verifying<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Verifying")
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl<R: Read> Verifying<R> {
    pub fn new(inner: R) -> Verifying<R> {
        Verifying {
            inner,
            hash: Sha256::new(),
            bytes: 0,
        }
    }

    /// Bytes read so far.
    pub fn bytes_read(&self) -> u64 {
        self.bytes
    }

    /// The digest of what was read so far.
    pub fn digest(self) -> Digest {
        Digest(format!("sha256:{}", hex::encode(self.hash.finalize())))
    }

    /// Reads what is left (a tar reader stops at its end marker), then
    /// compares; a mismatch names `what` and the digest.
    pub fn finish(mut self, expected: &Digest, what: &str) -> Result<u64, ImageError> {
        std::io::copy(&mut self, &mut std::io::sink()).map_err(|e| ImageError::Read {
            what: what.to_string(),
            source: e,
        })?;
        let got = format!("sha256:{}", hex::encode(self.hash.finalize()));
        if got != expected.as_str() {
            return Err(ImageError::DigestMismatch {
                what: what.to_string(),
                expected: expected.to_string(),
                got,
            });
        }
        Ok(self.bytes)
    }
}

impl<R: Read> Read for Verifying<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hash.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }
}

/// A writer that passes what it writes on to `W` and digests it.
pub struct Hashing<W> {
    inner: W,
    hash: Sha256,
    written: u64,
}

impl<W> std::fmt::Debug for Hashing<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hashing")
            .field("written", &self.written)
            .finish_non_exhaustive()
    }
}

impl<W: std::io::Write> Hashing<W> {
    pub fn new(inner: W) -> Hashing<W> {
        Hashing {
            inner,
            hash: Sha256::new(),
            written: 0,
        }
    }

    /// The digest of what was written, its size, and the writer.
    pub fn finish(self) -> (Digest, u64, W) {
        let d = Digest(format!("sha256:{}", hex::encode(self.hash.finalize())));
        (d, self.written, self.inner)
    }
}

impl<W: std::io::Write> std::io::Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        self.written += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_are_checked_as_they_are_read() {
        let d = Digest::of(b"hello");
        assert_eq!(Digest::parse(d.as_str()).unwrap(), d);
        assert!(Digest::parse("sha512:00").is_err());
        assert!(Digest::parse("sha256:ABC").is_err());
        let mut v = Verifying::new(&b"hello"[..]);
        let mut first = [0u8; 2];
        v.read_exact(&mut first).unwrap();
        assert_eq!(v.finish(&d, "blob").unwrap(), 5);
        let err = Verifying::new(&b"hellO"[..])
            .finish(&d, "layer x")
            .unwrap_err();
        assert!(err.to_string().contains(d.as_str()), "{err}");
    }
}
