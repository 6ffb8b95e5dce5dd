//! Copying files that may be sparse: data extents only (`SEEK_DATA` and
//! `SEEK_HOLE`), holes left as holes. A plain copy (`copy_file_range`
//! included, on a filesystem without reflinks) reads a hole as zeros and
//! writes them: a 1 TB file of no blocks that a sandbox made would cost a
//! terabyte of reads and writes to fork.

use std::fs::File;
use std::io;

/// Copies `from` into the empty file `to`, keeping its holes; the size.
pub fn copy(from: &File, to: &File) -> io::Result<u64> {
    use rustix::fs::SeekFrom;
    let size = from.metadata()?.len();
    let mut pos = 0u64;
    while pos < size {
        let data = match rustix::fs::seek(from, SeekFrom::Data(pos)) {
            Ok(d) => d.min(size),
            Err(rustix::io::Errno::NXIO) => size,
            Err(e) => return Err(e.into()),
        };
        if data >= size {
            break;
        }
        let end = rustix::fs::seek(from, SeekFrom::Hole(data))?.min(size);
        let (mut src_at, mut dst_at) = (data, data);
        while src_at < end {
            let want = usize::try_from(end - src_at)
                .unwrap_or(usize::MAX)
                .min(1 << 30);
            let n =
                rustix::fs::copy_file_range(from, Some(&mut src_at), to, Some(&mut dst_at), want)?;
            if n == 0 {
                // It shrank meanwhile.
                break;
            }
        }
        pos = end;
    }
    to.set_len(size)?;
    Ok(size)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{FileExt, MetadataExt};

    #[test]
    fn holes_stay_holes_and_data_is_copied() {
        let d = tempfile::tempdir().unwrap();
        let (a, b) = (d.path().join("a"), d.path().join("b"));
        let f = File::create(&a).unwrap();
        f.set_len(1 << 40).unwrap();
        f.write_all_at(b"middle", 1 << 30).unwrap();
        f.write_all_at(b"end", (1 << 40) - 3).unwrap();
        let to = File::create(&b).unwrap();
        let from = File::open(&a).unwrap();
        assert_eq!(copy(&from, &to).unwrap(), 1 << 40);
        let md = std::fs::metadata(&b).unwrap();
        assert_eq!(md.len(), 1 << 40);
        assert!(md.blocks() < 1024, "{} blocks", md.blocks());
        let mut buf = [0u8; 6];
        to.sync_all().unwrap();
        let r = File::open(&b).unwrap();
        r.read_exact_at(&mut buf, 1 << 30).unwrap();
        assert_eq!(&buf, b"middle");
        r.read_exact_at(&mut buf[..3], (1 << 40) - 3).unwrap();
        assert_eq!(&buf[..3], b"end");
        r.read_exact_at(&mut buf, 4096).unwrap();
        assert_eq!(buf, [0; 6]);
    }
}
