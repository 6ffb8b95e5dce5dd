//! What a process's pipes and Unix stream sockets hold, copied at the
//! checkpoint without being consumed (the origin runs on and reads them):
//! a pipe's bytes through `tee` from a duplicate of its read end
//! (`pidfd_getfd`), a socket's with `MSG_PEEK`. Each copy writes them into
//! the objects it makes anew (libuv keeps a lock's token in a pipe; a
//! message sent just before the checkpoint must not be lost).

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;

use crate::fdtable::{FdEntry, FdTarget};
use crate::objects::Object;

/// The most bytes read from one Unix socket (its default receive buffer
/// holds about 208 KiB).
const SOCKET_LIMIT: usize = 256 << 10;

/// The most bytes read from one pipe (a pipe's default size).
pub(crate) const PIPE_LIMIT: usize = 1 << 16;

/// What pipe `theirs` (a duplicate of a read end) holds, copied without
/// being consumed (at most [`PIPE_LIMIT`]).
pub(crate) fn pipe_contents(theirs: &OwnedFd) -> std::io::Result<Vec<u8>> {
    use rustix::pipe::{PipeFlags, SpliceFlags, pipe_with, tee};
    if rustix::io::ioctl_fionread(theirs)? == 0 {
        return Ok(vec![]);
    }
    let (r, w) = pipe_with(PipeFlags::CLOEXEC | PipeFlags::NONBLOCK)?;
    let n = match tee(theirs, &w, PIPE_LIMIT, SpliceFlags::NONBLOCK) {
        Ok(n) => n,
        // Emptied meanwhile.
        Err(rustix::io::Errno::AGAIN) => 0,
        Err(e) => return Err(e.into()),
    };
    drop(w);
    let mut buf = vec![0u8; n];
    let mut at = 0;
    while at < n {
        match rustix::io::read(&r, &mut buf[at..])? {
            0 => break,
            k => at += k,
        }
    }
    buf.truncate(at);
    Ok(buf)
}

/// The bytes waiting to be read on Unix stream socket `theirs` (a
/// duplicate), copied without being consumed.
fn socket_contents(theirs: &OwnedFd) -> std::io::Result<Vec<u8>> {
    use rustix::net::RecvFlags;
    let waiting = rustix::io::ioctl_fionread(theirs)? as usize;
    if waiting == 0 {
        return Ok(vec![]);
    }
    let mut buf = vec![0u8; waiting.min(SOCKET_LIMIT)];
    let n = match rustix::net::recv(theirs, &mut buf[..], RecvFlags::PEEK | RecvFlags::DONTWAIT) {
        Ok((_, n)) => n,
        Err(rustix::io::Errno::AGAIN) => 0,
        Err(e) => return Err(e.into()),
    };
    buf.truncate(n);
    Ok(buf)
}

/// What each pipe (both of whose ends `fds` holds) and each connected Unix
/// stream socket of process `pid` holds, by the descriptor it is read
/// from, hex-encoded (as the template's record keeps it); empty ones left
/// out. Read while the process is stopped, so that it is the checkpoint's.
pub fn at_checkpoint(pid: u32, fds: &[FdEntry]) -> std::io::Result<BTreeMap<i32, String>> {
    let mut out = BTreeMap::new();
    let mut pipes: BTreeMap<u64, (Option<i32>, bool)> = BTreeMap::new();
    let mut sockets = BTreeMap::new();
    for e in fds {
        match (&e.target, &e.object) {
            (_, Some(Object::UnixEnd { inode, socket_type }))
                if *socket_type == nix::libc::SOCK_STREAM =>
            {
                sockets.entry(*inode).or_insert(e.fd);
            }
            (FdTarget::Pipe { inode }, _) => {
                let p = pipes.entry(*inode).or_default();
                if e.flags as i32 & nix::libc::O_ACCMODE == nix::libc::O_RDONLY {
                    p.0.get_or_insert(e.fd);
                } else {
                    p.1 = true;
                }
            }
            _ => {}
        }
    }
    let reads = pipes
        .into_values()
        .filter_map(|(read, write)| read.filter(|_| write))
        .map(|fd| {
            (
                fd,
                pipe_contents as fn(&OwnedFd) -> std::io::Result<Vec<u8>>,
            )
        });
    let peeks = sockets.into_values().map(|fd| {
        (
            fd,
            socket_contents as fn(&OwnedFd) -> std::io::Result<Vec<u8>>,
        )
    });
    let mut pidfd = None;
    for (fd, contents) in reads.chain(peeks) {
        // One pidfd for them all.
        let pidfd = match &pidfd {
            Some(p) => p,
            None => {
                let p = rustix::process::Pid::from_raw(pid as i32)
                    .ok_or_else(|| std::io::Error::other("no such process"))?;
                pidfd.insert(rustix::process::pidfd_open(
                    p,
                    rustix::process::PidfdFlags::empty(),
                )?)
            }
        };
        let theirs =
            rustix::process::pidfd_getfd(pidfd, fd, rustix::process::PidfdGetfdFlags::empty())?;
        let data = contents(&theirs)?;
        if !data.is_empty() {
            out.insert(fd, hex(&data));
        }
    }
    Ok(out)
}

/// Bytes as lowercase hex (how the template's record keeps them: a
/// thread's XSAVE area is kilobytes, read inside the checkpoint's pause and
/// decoded in the rollback's, hence the `hex` crate's table-driven codec).
pub(crate) fn hex(bytes: &[u8]) -> String {
    ::hex::encode(bytes)
}

/// The bytes of [`hex`] text; `None` if it is not hex.
pub(crate) fn unhex(s: &str) -> Option<Vec<u8>> {
    ::hex::decode(s).ok()
}

/// The bytes recorded for descriptor `fd`, if any.
pub fn recorded(queued: &BTreeMap<i32, String>, fd: i32) -> Vec<u8> {
    queued.get(&fd).and_then(|h| unhex(h)).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_text_decodes_to_its_bytes_and_anything_else_is_refused() {
        let all: Vec<u8> = (0..=255).collect();
        assert_eq!(unhex(&hex(&all)).unwrap(), all);
        assert_eq!(unhex("0aFf").unwrap(), [0x0a, 0xff]);
        assert_eq!(unhex("").unwrap(), Vec::<u8>::new());
        for bad in ["abc", "0g", "+1", " 1", "é"] {
            assert!(unhex(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn pipes_and_sockets_are_read_without_being_consumed() {
        use std::os::fd::AsRawFd;
        let me = std::process::id();
        let (r, w) = rustix::pipe::pipe().unwrap();
        rustix::io::write(&w, b"ab").unwrap();
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        use std::io::Write;
        (&b).write_all(b"to a").unwrap();
        let e = |fd: i32, target, flags, object| FdEntry {
            fd,
            target,
            pos: 0,
            flags,
            mnt_id: None,
            locks: vec![],
            object,
        };
        let unix = |s: &std::os::unix::net::UnixStream, inode| {
            e(
                s.as_raw_fd(),
                FdTarget::Socket { inode },
                2,
                Some(Object::UnixEnd {
                    inode,
                    socket_type: nix::libc::SOCK_STREAM,
                }),
            )
        };
        let fds = [
            e(r.as_raw_fd(), FdTarget::Pipe { inode: 7 }, 0, None),
            e(w.as_raw_fd(), FdTarget::Pipe { inode: 7 }, 1, None),
            unix(&a, 10),
            unix(&b, 11),
        ];
        let q = at_checkpoint(me, &fds).unwrap();
        assert_eq!(recorded(&q, r.as_raw_fd()), b"ab");
        assert_eq!(recorded(&q, a.as_raw_fd()), b"to a");
        assert!(!q.contains_key(&b.as_raw_fd()), "nothing waits on b");
        // Still there.
        let mut buf = [0u8; 8];
        assert_eq!(rustix::io::read(&r, &mut buf).unwrap(), 2);
        use std::io::Read;
        assert_eq!((&a).read(&mut buf).unwrap(), 4);
    }
}
