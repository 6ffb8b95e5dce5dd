//! Making a copy's kernel objects anew, by calls injected into it: pipes
//! (with what they held), socketpairs, eventfds, timerfds, signalfds,
//! inotify instances, listening sockets, reset connections and epoll
//! instances with their registrations, each put at its descriptor number
//! with its flags. What to make is planned in [`crate::objects`].

use nix::libc;

use crate::batch::{Arg, Batch};
use crate::inspect::ProcError;
use crate::objects::{Object, Remake};
use crate::ptrace::Tracee;

/// Puts a copy of `new` (a descriptor of `t`, never one of the numbers
/// being replaced: those are all open, and new ones take the lowest free)
/// at `fd` with `flags`' close-on-exec and status flags.
pub(crate) fn place(t: &mut Tracee, new: u64, fd: i32, flags: u32) -> Result<(), ProcError> {
    crate::fixes::dup_onto(t, new, fd, flags)?;
    crate::fixes::set_status(t, fd, flags, libc::O_NONBLOCK)
}

/// [`place`] for a description made with `O_NONBLOCK` set as `nonblock`
/// and no other status flag, queued in `tail`: its status is set only
/// where it differs (a call each saved, most of the time); `None`: in any
/// case.
fn place_made(tail: &mut Batch, new: impl Into<Arg>, fd: i32, flags: u32, nonblock: Option<bool>) {
    let cloexec = (flags as i32) & libc::O_CLOEXEC;
    tail.call(
        "dup3",
        libc::SYS_dup3,
        [
            new.into(),
            (fd as u64).into(),
            (cloexec as u64).into(),
            0.into(),
            0.into(),
            0.into(),
        ],
    );
    if nonblock != Some(wants_nonblock(flags)) {
        let status = (flags as i32) & libc::O_NONBLOCK;
        tail.call_vals(
            "fcntl(F_SETFL)",
            libc::SYS_fcntl,
            [fd as u64, libc::F_SETFL as u64, status as u64, 0, 0, 0],
        );
    }
}

/// Queues closing `new` in `tail`.
fn close_later(tail: &mut Batch, new: impl Into<Arg>) {
    tail.call(
        "close",
        libc::SYS_close,
        [new.into(), 0.into(), 0.into(), 0.into(), 0.into(), 0.into()],
    );
}

/// Past this many calls queued, the queue is made at once (each holds a
/// new descriptor open till then).
const TAIL_AT_MOST: usize = 128;

fn wants_nonblock(flags: u32) -> bool {
    (flags as i32) & libc::O_NONBLOCK != 0
}

/// Whether every end of `ends` wants `O_NONBLOCK` (a pair made so needs no
/// status set), for a pair holding `data` bytes: what fits a new pipe's
/// default capacity is written without blocking.
fn all_nonblock<'a>(mut ends: impl Iterator<Item = &'a (i32, u32)>, data: usize) -> bool {
    data <= PIPE_CAPACITY && ends.all(|&(_, f)| wants_nonblock(f))
}

/// A new pipe's capacity (and a socket pair's buffer holds more).
const PIPE_CAPACITY: usize = 64 << 10;

/// A pipe, or a socket pair of a type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pair {
    Pipe,
    Socket(i32),
}

/// Makes a pipe (read end, write end) or a socket pair in `t`, holding
/// `data`: for a pipe, `data[0]`; for a socket pair, what waits to be read
/// at each end (sent from the other). Returns the two new descriptors
/// (close-on-exec).
pub(crate) fn make_pair(
    t: &mut Tracee,
    kind: Pair,
    data: [&[u8]; 2],
) -> Result<[u64; 2], ProcError> {
    make_pair_with(t, kind, data, false)
}

/// [`make_pair`], its descriptions `O_NONBLOCK` when `nonblock`.
fn make_pair_with(
    t: &mut Tracee,
    kind: Pair,
    data: [&[u8]; 2],
    nonblock: bool,
) -> Result<[u64; 2], ProcError> {
    let at = t.scratch(0, &[0u8; 8])?;
    let nb = if nonblock { libc::O_NONBLOCK } else { 0 };
    match kind {
        Pair::Pipe => t.syscall(
            "pipe2",
            libc::SYS_pipe2,
            [at, (libc::O_CLOEXEC | nb) as u64, 0, 0, 0, 0],
        )?,
        Pair::Socket(socket_type) => t.syscall(
            "socketpair",
            libc::SYS_socketpair,
            [
                libc::AF_UNIX as u64,
                (socket_type | libc::SOCK_CLOEXEC | nb) as u64,
                0,
                at,
                0,
                0,
            ],
        )?,
    };
    let b = t.peek(at, 8)?;
    let made = [
        i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as u64,
        i32::from_le_bytes([b[4], b[5], b[6], b[7]]) as u64,
    ];
    match kind {
        Pair::Pipe => write_all(t, made[1], data[0], false, "write(pipe contents)")?,
        Pair::Socket(_) => {
            // What waited at one end is sent from the other.
            write_all(t, made[1], data[0], true, "send(socket contents)")?;
            write_all(t, made[0], data[1], true, "send(socket contents)")?;
        }
    }
    Ok(made)
}

/// Makes the objects of `plan` anew in stopped copy `t`. An eventfd, epoll
/// instance or signalfd is made in one batch (`batch`) with every call
/// after that, its result feeding them; the others (whose descriptors are
/// written to memory, or whose making needs more) by calls of their own,
/// every call after them — put at its numbers (`dup3`), status set,
/// closed, an epoll instance's registrations — going into the same batch,
/// made at the end, in the same order: the new descriptors take numbers
/// that no wanted one has (those are all open), so that making the next
/// object before the last is placed changes nothing. (node: ~40 calls in
/// one round trip.)
pub fn remake(t: &mut Tracee, plan: &[Remake]) -> Result<(), ProcError> {
    // With the calls left to make before it runs (`Tracee::call_later`).
    let mut tail = t.take_later();
    for r in plan {
        if tail.len() >= TAIL_AT_MOST {
            crate::batch::run_in(t, &std::mem::take(&mut tail))?;
        }
        match r {
            Remake::Pipe { read, write, data } => {
                let nb = all_nonblock(read.iter().chain(write), data.len());
                let made = make_pair_with(t, Pair::Pipe, [data, &[]], nb)?;
                for (ends, new) in [(read, made[0]), (write, made[1])] {
                    for &(fd, flags) in ends {
                        place_made(&mut tail, new, fd, flags, Some(nb));
                    }
                    close_later(&mut tail, new);
                }
            }
            Remake::SocketPair {
                socket_type,
                ends,
                data,
            } => {
                let held = data[0].len().max(data[1].len());
                let nb = all_nonblock(ends.iter().flatten(), held);
                let made = make_pair_with(t, Pair::Socket(*socket_type), [&data[0], &data[1]], nb)?;
                for (end, new) in ends.iter().zip(made) {
                    for &(fd, flags) in end {
                        place_made(&mut tail, new, fd, flags, Some(nb));
                    }
                    close_later(&mut tail, new);
                }
            }
            Remake::Inotify { fd, flags, watches } => {
                let new = inotify(t, watches)?;
                place_made(&mut tail, new, *fd, *flags, Some(true));
                close_later(&mut tail, new);
            }
            Remake::Object { fd, flags, object } => {
                let nb = wants_nonblock(*flags);
                // Whether the new description is made O_NONBLOCK (`None`:
                // its status is set in any case).
                let made_nb = match object {
                    Object::EventFd { .. } | Object::SignalFd { .. } => Some(nb),
                    Object::Connection { .. } | Object::Listener { .. } => None,
                    _ => Some(false),
                };
                // Made in the batch itself where the call needs nothing
                // back but its result (which the placement and the close
                // take), else by a call of its own.
                let new: Arg = match object {
                    Object::EventFd { count, semaphore } => {
                        let f = libc::EFD_CLOEXEC
                            | if *semaphore { libc::EFD_SEMAPHORE } else { 0 }
                            | if nb { libc::EFD_NONBLOCK } else { 0 };
                        Arg::Result(tail.call_vals(
                            "eventfd2",
                            libc::SYS_eventfd2,
                            [*count, f as u64, 0, 0, 0, 0],
                        ))
                    }
                    Object::Epoll { .. } => Arg::Result(tail.call_vals(
                        "epoll_create1",
                        libc::SYS_epoll_create1,
                        [libc::EPOLL_CLOEXEC as u64, 0, 0, 0, 0, 0],
                    )),
                    Object::UnixEnd { .. } => {
                        unreachable!("planned as a socketpair")
                    }
                    Object::Inotify { .. } => unreachable!("planned with its paths"),
                    Object::Connection { family } => reset_connection(t, *family)?.into(),
                    Object::TimerFd {
                        clock,
                        ticks,
                        value,
                        interval,
                    } => timerfd(t, *clock, *ticks, *value, *interval)?.into(),
                    Object::SignalFd { mask } => {
                        let f = libc::SFD_CLOEXEC | if nb { libc::SFD_NONBLOCK } else { 0 };
                        let at = tail.data(&mask.to_le_bytes());
                        Arg::Result(tail.call(
                            "signalfd4",
                            libc::SYS_signalfd4,
                            [
                                u64::MAX.into(),
                                at.into(),
                                8.into(),
                                (f as u64).into(),
                                0.into(),
                                0.into(),
                            ],
                        ))
                    }
                    Object::Listener {
                        family,
                        addr,
                        port,
                        v6only,
                    } => {
                        let s = t.syscall(
                            "socket",
                            libc::SYS_socket,
                            [
                                *family as u64,
                                (libc::SOCK_STREAM | libc::SOCK_CLOEXEC) as u64,
                                0,
                                0,
                                0,
                                0,
                            ],
                        )?;
                        let one = t.scratch(0, &1i32.to_le_bytes())?;
                        t.syscall(
                            "setsockopt(SO_REUSEADDR)",
                            libc::SYS_setsockopt,
                            [
                                s,
                                libc::SOL_SOCKET as u64,
                                libc::SO_REUSEADDR as u64,
                                one,
                                4,
                                0,
                            ],
                        )?;
                        if *v6only {
                            t.syscall(
                                "setsockopt(IPV6_V6ONLY)",
                                libc::SYS_setsockopt,
                                [
                                    s,
                                    libc::IPPROTO_IPV6 as u64,
                                    libc::IPV6_V6ONLY as u64,
                                    one,
                                    4,
                                    0,
                                ],
                            )?;
                        }
                        let sa = sockaddr(*family, addr, *port);
                        let at = t.scratch(64, &sa)?;
                        t.syscall("bind", libc::SYS_bind, [s, at, sa.len() as u64, 0, 0, 0])?;
                        t.syscall("listen", libc::SYS_listen, [s, 511, 0, 0, 0, 0])?;
                        s.into()
                    }
                };
                place_made(&mut tail, new, *fd, *flags, made_nb);
                close_later(&mut tail, new);
                if let Object::Epoll { entries } = object {
                    for &(tfd, events, data) in entries {
                        let mut ev = Vec::with_capacity(12);
                        ev.extend_from_slice(&events.to_le_bytes());
                        ev.extend_from_slice(&data.to_le_bytes());
                        let at = tail.data(&ev);
                        tail.call(
                            "epoll_ctl(EPOLL_CTL_ADD)",
                            libc::SYS_epoll_ctl,
                            [
                                (*fd as u64).into(),
                                (libc::EPOLL_CTL_ADD as u64).into(),
                                (tfd as u64).into(),
                                at.into(),
                                0.into(),
                                0.into(),
                            ],
                        );
                    }
                }
            }
        }
    }
    if !tail.is_empty() {
        crate::batch::run_in(t, &tail)?;
    }
    Ok(())
}

/// A TCP socket of `family` whose connection was reset: connected over the
/// copy's loopback to a socket closed at once with a zero linger (which
/// sends a reset), so that the program's next read or write fails with
/// `ECONNRESET` and its poll reports an error, as for a connection the
/// network dropped. Where the loopback is not up, an unconnected socket
/// (`ENOTCONN`).
fn reset_connection(t: &mut Tracee, family: i32) -> Result<u64, ProcError> {
    let stream = (libc::SOCK_STREAM | libc::SOCK_CLOEXEC) as u64;
    let socket = |t: &mut Tracee| {
        t.syscall(
            "socket(reset connection)",
            libc::SYS_socket,
            [family as u64, stream, 0, 0, 0, 0],
        )
    };
    let client = socket(t)?;
    let server = socket(t)?;
    let loopback: Vec<u8> = if family == libc::AF_INET6 {
        std::net::Ipv6Addr::LOCALHOST.octets().to_vec()
    } else {
        std::net::Ipv4Addr::LOCALHOST.octets().to_vec()
    };
    let sa = sockaddr(family, &loopback, 0);
    let len = sa.len() as u64;
    let at = t.scratch(64, &sa)?;
    let len_at = t.scratch(0, &(len as u32).to_le_bytes())?;
    let connected = (|| -> Result<(), ProcError> {
        t.syscall("bind", libc::SYS_bind, [server, at, len, 0, 0, 0])?;
        t.syscall("listen", libc::SYS_listen, [server, 1, 0, 0, 0, 0])?;
        t.syscall(
            "getsockname",
            libc::SYS_getsockname,
            [server, at, len_at, 0, 0, 0],
        )?;
        t.syscall("connect", libc::SYS_connect, [client, at, len, 0, 0, 0])?;
        let peer = t.syscall(
            "accept4",
            libc::SYS_accept4,
            [server, 0, 0, libc::SOCK_CLOEXEC as u64, 0, 0],
        )?;
        // struct linger { l_onoff = 1, l_linger = 0 }: close sends a reset.
        let linger: Vec<u8> = [1i32, 0].iter().flat_map(|v| v.to_le_bytes()).collect();
        let lat = t.scratch(128, &linger)?;
        let set = t.syscall(
            "setsockopt(SO_LINGER)",
            libc::SYS_setsockopt,
            [
                peer,
                libc::SOL_SOCKET as u64,
                libc::SO_LINGER as u64,
                lat,
                8,
                0,
            ],
        );
        t.syscall("close", libc::SYS_close, [peer, 0, 0, 0, 0, 0])?;
        set.map(|_| ())
    })();
    t.syscall("close", libc::SYS_close, [server, 0, 0, 0, 0, 0])?;
    if connected.is_err() {
        // No loopback: an unconnected socket says the connection is gone.
        t.syscall("close", libc::SYS_close, [client, 0, 0, 0, 0, 0])?;
        return socket(t);
    }
    Ok(client)
}

/// Writes `data` whole into descriptor `fd` of `t` (a new, empty pipe, or
/// a socket: sent without waiting): from below the stack for a few bytes, else
/// from a mapping made for it (a stack may not reach that far down).
fn write_all(
    t: &mut Tracee,
    fd: u64,
    data: &[u8],
    socket: bool,
    call: &'static str,
) -> Result<(), ProcError> {
    if data.is_empty() {
        return Ok(());
    }
    let len = data.len() as u64;
    let (at, mapped) = if data.len() <= 4096 {
        (t.scratch(64, data)?, false)
    } else {
        let at = t.map_anonymous("mmap(contents)", len)?;
        (at, true)
    };
    let written = (|| {
        if mapped {
            t.poke_at(at, data)?;
        }
        if socket {
            t.syscall(
                call,
                libc::SYS_sendto,
                [fd, at, len, libc::MSG_DONTWAIT as u64, 0, 0],
            )
        } else {
            // A new pipe has room for all a pipe held (64 KiB at most).
            t.syscall(call, libc::SYS_write, [fd, at, len, 0, 0, 0])
        }
    })();
    if mapped {
        t.syscall("munmap(contents)", libc::SYS_munmap, [at, len, 0, 0, 0, 0])?;
    }
    if written? != len {
        return Err(ProcError::Injected {
            pid: t.pid(),
            call,
            source: std::io::Error::other(format!("wrote part of {len} bytes")),
        });
    }
    Ok(())
}

/// `TFD_IOC_SET_TICKS`: `_IOW('T', 0, u64)`.
const TFD_IOC_SET_TICKS: u64 = 0x4008_5400;

/// A timerfd on `clock` with `value` left to run, then every `interval`,
/// and `ticks` expirations waiting to be read.
fn timerfd(
    t: &mut Tracee,
    clock: i32,
    ticks: u64,
    value: (i64, i64),
    interval: (i64, i64),
) -> Result<u64, ProcError> {
    let fd = t.syscall(
        "timerfd_create",
        libc::SYS_timerfd_create,
        [clock as u64, libc::TFD_CLOEXEC as u64, 0, 0, 0, 0],
    )?;
    if value != (0, 0) {
        // struct itimerspec: interval first. The time left is relative (an
        // absolute deadline would have passed for a fork made later).
        let spec: Vec<u8> = [interval.0, interval.1, value.0, value.1]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let at = t.scratch(0, &spec)?;
        t.syscall(
            "timerfd_settime",
            libc::SYS_timerfd_settime,
            [fd, 0, at, 0, 0, 0],
        )?;
    }
    if ticks > 0 {
        let at = t.scratch(0, &ticks.to_le_bytes())?;
        t.syscall(
            "ioctl(TFD_IOC_SET_TICKS)",
            libc::SYS_ioctl,
            [fd, TFD_IOC_SET_TICKS, at, 0, 0, 0],
        )?;
    }
    Ok(fd)
}

/// An inotify instance with `watches` at their descriptor numbers: a new
/// instance numbers watches 1, 2, ... (cyclically: a removed number is not
/// reused), so a gap is filled by a watch on `/` removed at once, and the
/// events that leaves are read off before the program sees them.
fn inotify(t: &mut Tracee, watches: &[(i32, u32, std::path::PathBuf)]) -> Result<u64, ProcError> {
    let fd = t.syscall(
        "inotify_init1",
        libc::SYS_inotify_init1,
        [(libc::IN_CLOEXEC | libc::IN_NONBLOCK) as u64, 0, 0, 0, 0, 0],
    )?;
    let mut next = 1;
    let mut gaps = false;
    for (wd, mask, path) in watches {
        while next < *wd {
            let at = crate::template::scratch_path(t, 0, std::path::Path::new("/"))?;
            let got = t.syscall(
                "inotify_add_watch(a gap)",
                libc::SYS_inotify_add_watch,
                [fd, at, libc::IN_ATTRIB as u64, 0, 0, 0],
            )?;
            if (got as i32) < next {
                // `/` is watched itself: its watch must stay.
                return Err(ProcError::Injected {
                    pid: t.pid(),
                    call: "inotify_add_watch (a gap)",
                    source: std::io::Error::other("/ is watched, so cannot fill a gap"),
                });
            }
            t.syscall(
                "inotify_rm_watch(a gap)",
                libc::SYS_inotify_rm_watch,
                [fd, got, 0, 0, 0, 0],
            )?;
            next = got as i32 + 1;
            gaps = true;
        }
        let at = crate::template::scratch_path(t, 0, path)?;
        let got = t.syscall(
            "inotify_add_watch",
            libc::SYS_inotify_add_watch,
            [fd, at, *mask as u64, 0, 0, 0],
        )? as i32;
        if got != *wd {
            return Err(ProcError::Injected {
                pid: t.pid(),
                call: "inotify_add_watch (its number)",
                source: std::io::Error::other(format!(
                    "{} got watch {got}, not {wd}",
                    path.display()
                )),
            });
        }
        next = got + 1;
    }
    if gaps {
        let at = t.scratch(4096, &[])?;
        while t.syscall_raw(libc::SYS_read, [fd, at, 4096, 0, 0, 0])? > 0 {}
    }
    Ok(fd)
}

/// `struct sockaddr_in` / `sockaddr_in6` for `addr` and `port`.
pub(crate) fn sockaddr(family: i32, addr: &[u8], port: u16) -> Vec<u8> {
    let mut sa = Vec::with_capacity(28);
    sa.extend_from_slice(&(family as u16).to_le_bytes());
    sa.extend_from_slice(&port.to_be_bytes());
    if family == libc::AF_INET6 {
        sa.extend_from_slice(&[0u8; 4]); // flowinfo
        sa.extend_from_slice(addr);
        sa.extend_from_slice(&[0u8; 4]); // scope id
    } else {
        sa.extend_from_slice(addr);
        sa.extend_from_slice(&[0u8; 8]);
    }
    sa
}
