//! Which Unix socket is connected to which: `/proc/PID/net/unix` lists a
//! network namespace's sockets but not their peers, so the kernel's
//! sock_diag netlink interface (`UDIAG_SHOW_PEER`) is asked, from a socket
//! made inside the process's network namespace (by a short-lived thread
//! that enters it: the namespace of a thread only).

use std::collections::BTreeMap;
use std::io;
use std::os::fd::OwnedFd;

use rustix::net::{AddressFamily, RecvFlags, SendFlags, SocketType, netlink};

/// `SOCK_DIAG_BY_FAMILY`.
const SOCK_DIAG_BY_FAMILY: u16 = 20;
/// `NLM_F_REQUEST | NLM_F_DUMP`.
const REQUEST_DUMP: u16 = 0x1 | 0x300;
/// `NLMSG_DONE`, `NLMSG_ERROR`.
const DONE: u16 = 3;
const ERROR: u16 = 2;
/// `UDIAG_SHOW_PEER`, and the attribute carrying it (`UNIX_DIAG_PEER`).
const SHOW_PEER: u32 = 0x4;
const ATTR_PEER: u16 = 2;
/// The most reply bytes read (a namespace with very many sockets is
/// refused rather than read without end).
const MAX_REPLY: usize = 64 << 20;

/// The peer of every connected Unix socket of process `pid`'s network
/// namespace, by inode.
pub fn peers(pid: u32) -> io::Result<BTreeMap<u64, u64>> {
    let sock = socket_in_netns_of(pid)?;
    rustix::net::send(&sock, &request(), SendFlags::empty())?;
    let mut out = BTreeMap::new();
    let mut buf = vec![0u8; 1 << 16];
    let mut read = 0usize;
    loop {
        let (_, n) = rustix::net::recv(&sock, &mut buf[..], RecvFlags::empty())?;
        read += n;
        if n == 0 || read > MAX_REPLY {
            return Err(io::Error::other("sock_diag: the reply did not end"));
        }
        if parse_reply(&buf[..n], &mut out)? {
            return Ok(out);
        }
    }
}

/// A netlink sock_diag socket in the network namespace of `pid`.
fn socket_in_netns_of(pid: u32) -> io::Result<OwnedFd> {
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/net"))?;
    std::thread::scope(|s| {
        s.spawn(|| -> io::Result<OwnedFd> {
            use std::os::fd::AsFd;
            rustix::thread::move_into_link_name_space(
                ns.as_fd(),
                Some(rustix::thread::LinkNameSpaceType::Network),
            )?;
            Ok(rustix::net::socket(
                AddressFamily::NETLINK,
                SocketType::DGRAM,
                Some(netlink::SOCK_DIAG),
            )?)
        })
        .join()
        .map_err(|_| io::Error::other("the thread entering the namespace panicked"))?
    })
}

/// `struct nlmsghdr` + `struct unix_diag_req` asking for every Unix socket
/// with its peer.
fn request() -> Vec<u8> {
    let mut m = Vec::with_capacity(40);
    m.extend_from_slice(&40u32.to_ne_bytes()); // nlmsg_len
    m.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    m.extend_from_slice(&REQUEST_DUMP.to_ne_bytes());
    m.extend_from_slice(&1u32.to_ne_bytes()); // seq
    m.extend_from_slice(&0u32.to_ne_bytes()); // pid
    m.push(libc_af_unix()); // sdiag_family
    m.push(0); // sdiag_protocol
    m.extend_from_slice(&0u16.to_ne_bytes()); // pad
    m.extend_from_slice(&u32::MAX.to_ne_bytes()); // udiag_states: all
    m.extend_from_slice(&0u32.to_ne_bytes()); // udiag_ino
    m.extend_from_slice(&SHOW_PEER.to_ne_bytes()); // udiag_show
    m.extend_from_slice(&[0xff; 8]); // udiag_cookie: none
    m
}

fn libc_af_unix() -> u8 {
    nix::libc::AF_UNIX as u8
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// Adds the (inode, peer) pairs of one datagram of replies to `out`;
/// whether the dump is over.
fn parse_reply(b: &[u8], out: &mut BTreeMap<u64, u64>) -> io::Result<bool> {
    let bad = || io::Error::other("sock_diag: a malformed reply");
    let mut at = 0;
    while at + 16 <= b.len() {
        let len = u32_at(b, at).ok_or_else(bad)? as usize;
        let kind = u16_at(b, at + 4).ok_or_else(bad)?;
        if len < 16 || at + len > b.len() {
            return Err(bad());
        }
        match kind {
            DONE => return Ok(true),
            ERROR => {
                let errno = u32_at(b, at + 16).map_or(0, |e| e as i32);
                return Err(io::Error::from_raw_os_error(-errno));
            }
            _ => {}
        }
        // struct unix_diag_msg: family, type, state, pad (u8 each), ino, cookie[2].
        let msg = at + 16;
        let ino = u32_at(b, msg + 4).ok_or_else(bad)? as u64;
        let mut attr = msg + 16;
        while attr + 4 <= at + len {
            let alen = u16_at(b, attr).ok_or_else(bad)? as usize;
            let akind = u16_at(b, attr + 2).ok_or_else(bad)?;
            if alen < 4 {
                return Err(bad());
            }
            if akind == ATTR_PEER
                && let Some(peer) = u32_at(b, attr + 4)
                && peer != 0
            {
                out.insert(ino, peer as u64);
            }
            attr += (alen + 3) & !3;
        }
        at += (len + 3) & !3;
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peers_of_this_processs_socketpairs_are_found() {
        use std::os::unix::fs::MetadataExt;
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let ino = |s: &std::os::unix::net::UnixStream| {
            use std::os::fd::AsRawFd;
            std::fs::metadata(format!("/proc/self/fd/{}", s.as_raw_fd()))
                .unwrap()
                .ino()
        };
        // Entering a network namespace needs CAP_SYS_ADMIN.
        if tine_testkit::skipped_without_root("entering a network namespace") {
            return;
        }
        let p = peers(std::process::id()).unwrap();
        assert_eq!(p.get(&ino(&a)), Some(&ino(&b)));
        assert_eq!(p.get(&ino(&b)), Some(&ino(&a)));
    }

    #[test]
    fn malformed_replies_are_refused() {
        let mut out = BTreeMap::new();
        let mut m = vec![0u8; 16];
        m[0] = 8; // shorter than a header
        assert!(parse_reply(&m, &mut out).is_err());
        let mut done = vec![0u8; 20];
        done[0] = 20;
        done[4] = DONE as u8;
        assert!(parse_reply(&done, &mut out).unwrap());
    }
}
