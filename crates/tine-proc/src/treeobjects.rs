//! Pipes and socket pairs that connect the processes of a tree (a pool's
//! task queues, a shell's pipeline, a server's workers): at a rollback each
//! is made anew once, holding what it held at the checkpoint, and handed to
//! every process of the tree that held one of its ends, at the same
//! descriptors. Left shared with the templates, they would hold whatever
//! the killed processes left in them (tasks already taken, half a message).
//! One with an end outside the tree stays shared, as for a single process.

use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::{AsFd, OwnedFd};

use crate::fdtable::{FdEntry, FdTarget};
use crate::inspect::ProcError;
use crate::objects::Object;
use crate::ptrace::Tracee;
use crate::remake::{Pair, make_pair, place};

/// One holder of an end: the member's index, its descriptor, its flags.
pub type Holder = (usize, i32, u32);

/// An object that connects processes of a tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Shared {
    Pair {
        kind: Pair,
        /// A pipe's read and write ends, or a socket pair's two ends.
        ends: [Vec<Holder>; 2],
        /// A pipe's contents (`data[0]`), or what waited at each socket end.
        data: [Vec<u8>; 2],
    },
    /// One socket several processes hold (a server's listener, inherited
    /// by its workers; a connection, reset).
    Socket {
        object: Object,
        holders: Vec<Holder>,
    },
}

/// One process of the tree, as its template recorded it.
#[derive(Debug)]
pub struct Of<'a> {
    pub pid: u32,
    pub fds: &'a [FdEntry],
    pub queued: &'a BTreeMap<i32, String>,
}

/// The objects that connect two or more of `members` with every end in
/// the tree, and the inodes (pipes, socket ends) that the members' own
/// plans must leave to them.
pub fn plan(members: &[Of<'_>]) -> (Vec<Shared>, BTreeSet<u64>) {
    plan_with(members, false).unwrap_or_default()
}

/// [`plan`] for copies in namespaces of their own (native forks), which
/// must share nothing with the origin: an object between members with an
/// end outside the tree (or a pipe opened read-write) is refused, naming it.
pub fn plan_fork(members: &[Of<'_>]) -> Result<(Vec<Shared>, BTreeSet<u64>), String> {
    plan_with(members, true)
}

fn plan_with(members: &[Of<'_>], fork: bool) -> Result<(Vec<Shared>, BTreeSet<u64>), String> {
    let mut pipes: BTreeMap<u64, [Vec<Holder>; 2]> = BTreeMap::new();
    let mut read_write = BTreeSet::new();
    let mut sockets: BTreeMap<u64, (i32, Vec<Holder>)> = BTreeMap::new();
    let mut inet: BTreeMap<u64, (Object, Vec<Holder>)> = BTreeMap::new();
    for (i, m) in members.iter().enumerate() {
        for e in m.fds {
            match (&e.target, &e.object) {
                (
                    FdTarget::Socket { inode },
                    Some(o @ (Object::Listener { .. } | Object::Connection { .. })),
                ) => {
                    inet.entry(*inode)
                        .or_insert((o.clone(), vec![]))
                        .1
                        .push((i, e.fd, e.flags));
                }
                (_, Some(Object::UnixEnd { inode, socket_type })) => {
                    sockets
                        .entry(*inode)
                        .or_insert((*socket_type, vec![]))
                        .1
                        .push((i, e.fd, e.flags));
                }
                (FdTarget::Pipe { inode }, _) => {
                    let ends = pipes.entry(*inode).or_default();
                    match e.flags as i32 & nix::libc::O_ACCMODE {
                        nix::libc::O_RDONLY => ends[0].push((i, e.fd, e.flags)),
                        nix::libc::O_WRONLY => ends[1].push((i, e.fd, e.flags)),
                        _ => {
                            read_write.insert(*inode);
                        }
                    }
                }
                _ => {}
            }
        }
    }
    let spans = |holders: &[&Vec<Holder>]| {
        let who: BTreeSet<usize> = holders.iter().flat_map(|h| h.iter().map(|x| x.0)).collect();
        who.len() >= 2
    };
    let queued = |h: &Holder| crate::queued::recorded(members[h.0].queued, h.1);
    let mut out = Vec::new();
    let mut skip = BTreeSet::new();
    for (inode, ends) in pipes {
        if !spans(&[&ends[0], &ends[1]]) {
            continue;
        }
        // Shared in the tree either way: the members' own plans leave it.
        skip.insert(inode);
        if ends[0].is_empty() || ends[1].is_empty() || read_write.contains(&inode) {
            if fork {
                let h = ends.iter().flatten().next().copied().unwrap_or_default();
                return Err(format!(
                    "process {} holds a pipe (descriptor {}) shared with others of its tree whose other end is outside it",
                    members[h.0].pid, h.1
                ));
            }
            continue;
        }
        let data = queued(&ends[0][0]);
        out.push(Shared::Pair {
            kind: Pair::Pipe,
            ends,
            data: [data, vec![]],
        });
    }
    if !sockets.is_empty() {
        let peers = members
            .first()
            .and_then(|m| crate::unixdiag::peers(m.pid).ok())
            .unwrap_or_default();
        let mut left = sockets;
        while let Some((inode, (socket_type, a))) = left.pop_first() {
            let peer = peers.get(&inode).copied();
            let b = peer.and_then(|p| left.remove(&p)).map(|(_, b)| b);
            let spanning = match &b {
                Some(b) => spans(&[&a, b]),
                None => spans(&[&a]),
            };
            if !spanning {
                continue;
            }
            skip.insert(inode);
            let Some(b) = b else {
                if fork {
                    return Err(format!(
                        "process {} holds a Unix socket (descriptor {}) shared with others of its tree whose peer is outside it",
                        members[a[0].0].pid, a[0].1
                    ));
                }
                continue;
            };
            skip.extend(peer);
            let data = [queued(&a[0]), queued(&b[0])];
            out.push(Shared::Pair {
                kind: Pair::Socket(socket_type),
                ends: [a, b],
                data,
            });
        }
    }
    // A rollback leaves sockets shared with the templates (a listener keeps
    // its address); forks make each once for the tree.
    for (inode, (object, holders)) in inet {
        if fork && spans(&[&holders]) {
            skip.insert(inode);
            out.push(Shared::Socket { object, holders });
        }
    }
    Ok((out, skip))
}

/// Makes each object in the copy of its first holder (`copies[i]` is
/// member `i`'s copy, stopped) and hands its ends to the others.
/// `above[i]`: a descriptor number above every one member `i` uses.
pub fn make(copies: &mut [Tracee], shared: &[Shared], above: &[i32]) -> Result<(), ProcError> {
    // Per member: the ends it gets from another's copy (host descriptor,
    // its number there, flags).
    let mut handed: BTreeMap<usize, Vec<(OwnedFd, i32, u32)>> = BTreeMap::new();
    for s in shared {
        // The object made in its first holder's copy, one descriptor per end.
        let (first, made, ends): (usize, Vec<u64>, Vec<&Vec<Holder>>) = match s {
            Shared::Pair { kind, ends, data } => {
                let Some(first) = ends.iter().flatten().map(|h| h.0).min() else {
                    continue;
                };
                let made = make_pair(&mut copies[first], *kind, [&data[0], &data[1]])?;
                (first, made.to_vec(), ends.iter().collect())
            }
            Shared::Socket { object, holders } => {
                let Some(&(first, fd, flags)) = holders.first() else {
                    continue;
                };
                let t = &mut copies[first];
                crate::remake::remake(
                    t,
                    &[crate::objects::Remake::Object {
                        fd,
                        flags,
                        object: object.clone(),
                    }],
                )?;
                // A descriptor of its own, closed below as the others are.
                let dup = t.syscall(
                    "fcntl(F_DUPFD_CLOEXEC)",
                    nix::libc::SYS_fcntl,
                    [fd as u64, nix::libc::F_DUPFD_CLOEXEC as u64, 0, 0, 0, 0],
                )?;
                (first, vec![dup], vec![holders])
            }
        };
        let t = &mut copies[first];
        let pidfd = rustix::process::pidfd_open(
            rustix::process::Pid::from_raw(t.pid() as i32)
                .ok_or(ProcError::Gone { pid: t.pid() })?,
            rustix::process::PidfdFlags::empty(),
        )
        .map_err(|e| ProcError::Ptrace {
            pid: t.pid(),
            step: "open a pidfd",
            source: e.into(),
        })?;
        for (end, new) in ends.into_iter().zip(made) {
            for &(m, fd, flags) in end {
                if m == first {
                    place(t, new, fd, flags)?;
                } else {
                    let host = rustix::process::pidfd_getfd(
                        &pidfd,
                        new as i32,
                        rustix::process::PidfdGetfdFlags::empty(),
                    )
                    .map_err(|e| ProcError::Ptrace {
                        pid: t.pid(),
                        step: "take a new pipe or socket end (pidfd_getfd)",
                        source: e.into(),
                    })?;
                    handed.entry(m).or_default().push((host, fd, flags));
                }
            }
            t.syscall("close", nix::libc::SYS_close, [new, 0, 0, 0, 0, 0])?;
        }
    }
    for (m, ends) in handed {
        let t = &mut copies[m];
        let ch = crate::fdpass::Channel::open(t, above[m])?;
        let fds: Vec<_> = ends.iter().map(|(f, _, _)| f.as_fd()).collect();
        let got = ch.pass(t, &fds);
        let placed = got.and_then(|got| {
            for (new, (_, fd, flags)) in got.into_iter().zip(&ends) {
                place(t, new as u64, *fd, *flags)?;
                t.syscall("close", nix::libc::SYS_close, [new as u64, 0, 0, 0, 0, 0])?;
            }
            Ok(())
        });
        ch.close(t)?;
        placed?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pipe_end(fd: i32, inode: u64, write: bool) -> FdEntry {
        FdEntry {
            fd,
            target: FdTarget::Pipe { inode },
            pos: 0,
            flags: if write { 1 } else { 0 },
            mnt_id: None,
            locks: vec![],
            object: None,
        }
    }

    #[test]
    fn pipes_between_members_are_the_trees_and_their_own_are_theirs() {
        let none = BTreeMap::new();
        // 7: read by the parent, written by the child; 8: the parent's own;
        // 9: written by the child only (its reader is elsewhere).
        let parent = [
            pipe_end(3, 7, false),
            pipe_end(4, 8, false),
            pipe_end(5, 8, true),
        ];
        let child = [
            pipe_end(3, 7, true),
            pipe_end(6, 9, true),
            pipe_end(7, 7, false),
        ];
        let members = [
            Of {
                pid: 1,
                fds: &parent,
                queued: &none,
            },
            Of {
                pid: 2,
                fds: &child,
                queued: &none,
            },
        ];
        let (shared, skip) = plan(&members);
        assert_eq!(skip, BTreeSet::from([7]));
        let [Shared::Pair { ends, .. }] = shared.as_slice() else {
            panic!("{shared:?}");
        };
        assert_eq!(ends[0], vec![(0, 3, 0), (1, 7, 0)]);
        assert_eq!(ends[1], vec![(1, 3, 1)]);
    }
}
