//! Which kernel objects a rollback in place may leave as its template holds
//! them: those whose state is still the checkpoint's. The template shares
//! its descriptions with the process it was forked from, so an eventfd
//! holding the same count, a pipe holding the same bytes, an epoll instance
//! with the same registrations (on objects that stay too) need not be made
//! anew — most of a rollback's injected work for node (4 pipes, 3 eventfds,
//! 3 epoll instances); a pipe between a tree's processes (a pool's task
//! queues) likewise. Read once everything that shared them is stopped or
//! killed; anything not read as recorded is made anew, as before.

use std::collections::BTreeSet;
use std::os::fd::OwnedFd;

use nix::libc;

use crate::fdtable::{FdEntry, FdTarget};
use crate::objects::{Object, Remake};
use crate::remake::Pair;
use crate::treeobjects::{Holder, Shared};

/// `plan` (what a rollback would make anew in a copy of template `tpid`,
/// whose descriptors were recorded as `fds`) without the objects the
/// template's descriptions still hold as recorded.
pub(crate) fn still_to_make(tpid: u32, fds: &[FdEntry], plan: &[Remake]) -> Vec<Remake> {
    let mut look = Look {
        tpid,
        fds,
        pidfds: Pidfds::default(),
    };
    // Descriptors left as they are, so far.
    let mut stay = BTreeSet::new();
    let mut out = Vec::new();
    let mut epolls = Vec::new();
    for r in plan {
        let unchanged = match r {
            Remake::Pipe { read, write, data } => look.pipe_as_recorded(read, write, data),
            Remake::Object {
                object: Object::Epoll { .. },
                ..
            } => {
                epolls.push(r);
                continue;
            }
            Remake::Object {
                fd,
                flags,
                object:
                    o @ (Object::EventFd { .. } | Object::TimerFd { .. } | Object::SignalFd { .. }),
            } => look.anon_as_recorded(*fd, *flags, o),
            _ => false,
        };
        if unchanged {
            stay.extend(fds_of(r));
        } else {
            out.push(r.clone());
        }
    }
    // Last, as in the plan: an instance stays only if every object it
    // watches does (a registration is on the file: one made anew at the
    // same number would not be watched).
    for r in epolls {
        let Remake::Object {
            fd,
            flags,
            object: o @ Object::Epoll { entries },
        } = r
        else {
            continue;
        };
        let watched_stay = entries.iter().all(|&(tfd, events, _)| {
            // An edge the origin took since would not come again.
            let edge = (libc::EPOLLET | libc::EPOLLONESHOT) as u32;
            events & edge == 0 && (stay.contains(&tfd) || left_shared(fds, tfd))
        });
        if watched_stay && look.anon_as_recorded(*fd, *flags, o) {
            continue;
        }
        out.push(r.clone());
    }
    out
}

/// The descriptors a planned object takes.
fn fds_of(r: &Remake) -> Vec<i32> {
    match r {
        Remake::Pipe { read, write, .. } => read.iter().chain(write).map(|e| e.0).collect(),
        Remake::SocketPair { ends, .. } => ends.iter().flatten().map(|e| e.0).collect(),
        Remake::Object { fd, .. } | Remake::Inotify { fd, .. } => vec![*fd],
    }
}

/// Whether descriptor `fd` is one a rollback in place never makes anew
/// (whatever the plan): a socket other than an end of a socket pair (a
/// listener, a connection) or an inotify instance. Anything else an epoll
/// instance watches (a signalfd: the kernel wakes it through the queue of
/// the process that registered it) makes the instance anew.
fn left_shared(fds: &[FdEntry], fd: i32) -> bool {
    fds.iter().find(|e| e.fd == fd).is_some_and(|e| {
        matches!(
            (&e.target, &e.object),
            (
                FdTarget::Socket { .. },
                None | Some(Object::Listener { .. } | Object::Connection { .. })
            ) | (FdTarget::AnonInode { .. }, Some(Object::Inotify { .. }))
        )
    })
}

/// Reads a template's descriptors.
struct Look<'a> {
    tpid: u32,
    fds: &'a [FdEntry],
    pidfds: Pidfds,
}

impl Look<'_> {
    /// Whether anonymous object `fd` is still `object`, its description's
    /// flags still `flags`, as the template's `fdinfo` reads.
    fn anon_as_recorded(&self, fd: i32, flags: u32, object: &Object) -> bool {
        let Some(FdTarget::AnonInode { name }) =
            self.fds.iter().find(|e| e.fd == fd).map(|e| &e.target)
        else {
            return false;
        };
        let Ok(info) = std::fs::read_to_string(format!("/proc/{}/fdinfo/{fd}", self.tpid)) else {
            return false;
        };
        crate::fdtable::parse_fdinfo(&info).is_some_and(|(_, f, _)| f == flags)
            && crate::objects::parse_anon(name, &info).as_ref() == Some(object)
    }

    /// Whether the pipe of `read` and `write` ends holds `data` (libuv
    /// keeps a lock's token in one) and each end's description has its
    /// recorded status flags.
    fn pipe_as_recorded(&mut self, read: &[(i32, u32)], write: &[(i32, u32)], data: &[u8]) -> bool {
        let tpid = self.tpid;
        let ends = read
            .iter()
            .chain(write)
            .map(|&(fd, flags)| (tpid, fd, flags));
        self.pidfds
            .pipe_as_recorded(read.first().map(|r| (tpid, r.0)), ends, data)
    }
}

/// `shared` (the pipes and socket pairs connecting a tree's processes
/// that a rollback would make anew) without the pipes the templates
/// (`tpids`, by member) still hold as recorded: the same bytes, each end's
/// description with its flags. Every holder is a process of the tree (the
/// rollback killed the others): one kept in place holds the same pipe, one
/// made anew gets its template's table, with it.
pub(crate) fn shared_still_to_make(tpids: &[u32], shared: &[Shared]) -> Vec<Shared> {
    let mut pidfds = Pidfds::default();
    shared
        .iter()
        .filter(|s| {
            let Shared::Pair {
                kind: Pair::Pipe,
                ends,
                data,
            } = s
            else {
                return true;
            };
            let end = |&(m, fd, flags): &Holder| (tpids.get(m).copied().unwrap_or(0), fd, flags);
            let reader = ends[0].first().map(|h| (end(h).0, h.1));
            !pidfds.pipe_as_recorded(reader, ends.iter().flatten().map(end), &data[0])
        })
        .cloned()
        .collect()
}

/// Templates' descriptors, taken with `pidfd_getfd`; each template's pidfd
/// opened once.
#[derive(Default)]
struct Pidfds(std::collections::BTreeMap<u32, Option<OwnedFd>>);

impl Pidfds {
    /// Template `tpid`'s descriptor `fd`.
    fn get(&mut self, tpid: u32, fd: i32) -> Option<OwnedFd> {
        let pidfd = self.0.entry(tpid).or_insert_with(|| {
            rustix::process::Pid::from_raw(tpid as i32).and_then(|p| {
                rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()).ok()
            })
        });
        rustix::process::pidfd_getfd(
            pidfd.as_ref()?,
            fd,
            rustix::process::PidfdGetfdFlags::empty(),
        )
        .ok()
    }

    /// Whether the pipe read at `reader` (template, descriptor) holds
    /// `data` and each of its `ends` (template, descriptor, recorded flags)
    /// has its recorded status flags.
    fn pipe_as_recorded(
        &mut self,
        reader: Option<(u32, i32)>,
        mut ends: impl Iterator<Item = (u32, i32, u32)>,
        data: &[u8],
    ) -> bool {
        let Some((tpid, fd)) = reader else {
            return false;
        };
        // (What was recorded of a fuller pipe was cut short.)
        if data.len() >= crate::queued::PIPE_LIMIT {
            return false;
        }
        let holds = self
            .get(tpid, fd)
            .and_then(|d| crate::queued::pipe_contents(&d).ok())
            .is_some_and(|now| now == data);
        // `F_GETFL` gives the description's flags; `fdinfo` (as recorded)
        // adds the descriptor's close-on-exec.
        let cloexec = libc::O_CLOEXEC as u32;
        holds
            && ends.all(|(tpid, fd, flags)| {
                self.get(tpid, fd)
                    .and_then(|d| rustix::fs::fcntl_getfl(&d).ok())
                    .is_some_and(|now| now.bits() == flags & !cloexec)
            })
    }
}
