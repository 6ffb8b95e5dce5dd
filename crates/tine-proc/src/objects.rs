//! Kernel objects a process holds that a copy in a sandbox of its own must
//! not share with its origin, recorded at the checkpoint and made anew in
//! each such copy by injected calls: pipes whose two ends the process holds,
//! eventfds (their count), listening TCP sockets (bound again to the same
//! address, in the copy's own network namespace) and epoll instances (every
//! registration, with its events and data, onto the new objects under the
//! same descriptor numbers). What a pipe holds is carried (libuv keeps a
//! lock's token in one): copied without being consumed (`tee`) from the
//! template's end when the fork is planned.

use std::collections::BTreeMap;

use nix::libc;
use serde::{Deserialize, Serialize};

use crate::fdtable::{FdEntry, FdTarget};
#[cfg(target_arch = "x86_64")]
use crate::inspect::ProcError;
#[cfg(target_arch = "x86_64")]
use crate::ptrace::Tracee;

/// What the fd table records of a descriptor's kernel object (`fdinfo`,
/// `/proc/PID/net/tcp`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Object {
    EventFd {
        count: u64,
        semaphore: bool,
    },
    /// Registrations: (target descriptor, events, data).
    Epoll {
        entries: Vec<(i32, u32, u64)>,
    },
    /// A listening TCP socket: its family (`AF_INET`/`AF_INET6`), address
    /// (network order, 4 or 16 bytes) and port.
    Listener {
        family: i32,
        addr: Vec<u8>,
        port: u16,
    },
    /// A TCP socket that is not listening (connected, or closing): a copy
    /// cannot take over the connection, so it gets one that was reset.
    Connection {
        family: i32,
    },
    /// A connected, unnamed Unix socket (an end of a `socketpair`): its
    /// inode and type (`SOCK_STREAM`, `SOCK_DGRAM`, `SOCK_SEQPACKET`).
    UnixEnd {
        inode: u64,
        socket_type: i32,
    },
    /// A timerfd: its clock, expirations not yet read, and the time left
    /// and interval as (seconds, nanoseconds).
    TimerFd {
        clock: i32,
        ticks: u64,
        value: (i64, i64),
        interval: (i64, i64),
    },
    /// A signalfd and the signals it reads.
    SignalFd {
        mask: u64,
    },
    /// An inotify instance: its watches, by descriptor number.
    Inotify {
        watches: Vec<Watch>,
    },
}

/// One inotify watch, as `fdinfo` names it: by inode and device, not path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Watch {
    pub wd: i32,
    pub mask: u32,
    pub ino: u64,
    /// The kernel's device number (`MKDEV`: major << 20 | minor).
    pub sdev: u64,
}

/// The object `fdinfo` text describes, for an anonymous inode named `name`.
pub fn parse_anon(name: &str, info: &str) -> Option<Object> {
    let field = |key: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(key))
            .map(|v| v.trim().to_string())
    };
    match name {
        "[eventfd]" => Some(Object::EventFd {
            count: field("eventfd-count:")?.parse().ok()?,
            semaphore: field("eventfd-semaphore:").is_some_and(|v| v == "1"),
        }),
        "[eventpoll]" => {
            let entries = info
                .lines()
                .filter_map(|l| {
                    let f: Vec<&str> = l.split_whitespace().collect();
                    // tfd: N events: HEX data: HEX pos: ...
                    match f.as_slice() {
                        ["tfd:", tfd, "events:", ev, "data:", data, ..] => Some((
                            tfd.parse().ok()?,
                            u32::from_str_radix(ev, 16).ok()?,
                            u64::from_str_radix(data, 16).ok()?,
                        )),
                        _ => None,
                    }
                })
                .collect();
            Some(Object::Epoll { entries })
        }
        "[timerfd]" => {
            let pair = |key: &str| -> Option<(i64, i64)> {
                let v = field(key)?;
                let (a, b) = v.trim_matches(|c| c == '(' || c == ')').split_once(',')?;
                Some((a.trim().parse().ok()?, b.trim().parse().ok()?))
            };
            Some(Object::TimerFd {
                clock: field("clockid:")?.parse().ok()?,
                ticks: field("ticks:")?.parse().ok()?,
                value: pair("it_value:")?,
                interval: pair("it_interval:")?,
            })
        }
        "[signalfd]" => Some(Object::SignalFd {
            mask: u64::from_str_radix(&field("sigmask:")?, 16).ok()?,
        }),
        "inotify" => {
            let mut watches = Vec::new();
            for l in info.lines().filter_map(|l| l.strip_prefix("inotify ")) {
                let kv = |k: &str| {
                    l.split_whitespace()
                        .find_map(|w| w.strip_prefix(k))
                        .map(str::to_string)
                };
                watches.push(Watch {
                    wd: kv("wd:")?.parse().ok()?,
                    mask: u32::from_str_radix(&kv("mask:")?, 16).ok()?,
                    ino: u64::from_str_radix(&kv("ino:")?, 16).ok()?,
                    sdev: u64::from_str_radix(&kv("sdev:")?, 16).ok()?,
                });
            }
            watches.sort_by_key(|w| w.wd);
            Some(Object::Inotify { watches })
        }
        _ => None,
    }
}

/// Listening TCP sockets and connected unnamed Unix sockets of process
/// `pid`'s network namespace, by inode (`/proc/PID/net/tcp`, `tcp6`, `unix`).
pub fn listeners(pid: u32) -> BTreeMap<u64, Object> {
    let mut out = BTreeMap::new();
    let unix = std::fs::read_to_string(format!("/proc/{pid}/net/unix")).unwrap_or_default();
    for line in unix.lines().skip(1) {
        // Num RefCount Protocol Flags Type St Inode [Path]
        let f: Vec<&str> = line.split_whitespace().collect();
        if let [_, _, _, _, ty, "03", inode] = f.as_slice()
            && let (Ok(socket_type), Ok(inode)) =
                (i32::from_str_radix(ty, 16), inode.parse::<u64>())
        {
            out.insert(inode, Object::UnixEnd { inode, socket_type });
        }
    }
    for (file, family) in [("tcp", libc::AF_INET), ("tcp6", libc::AF_INET6)] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{file}")).unwrap_or_default();
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // sl local rem st tx:rx tr:when retrnsmt uid timeout inode
            let (Some(local), Some(st), Some(inode)) = (f.get(1), f.get(3), f.get(9)) else {
                continue;
            };
            let (Some((a, p)), Ok(inode)) = (local.split_once(':'), inode.parse::<u64>()) else {
                continue;
            };
            if *st != "0A" {
                // Sockets being made (SYN_SENT, CLOSE) count too: a copy
                // could not finish them either.
                if inode != 0 {
                    out.insert(inode, Object::Connection { family });
                }
                continue;
            }
            // The kernel prints the address as 32-bit words in host order.
            let addr: Option<Vec<u8>> = (0..a.len() / 8)
                .map(|i| {
                    u32::from_str_radix(&a[i * 8..i * 8 + 8], 16)
                        .ok()
                        .map(u32::to_le_bytes)
                })
                .collect::<Option<Vec<_>>>()
                .map(|w| w.concat());
            let (Some(addr), Ok(port)) = (addr, u16::from_str_radix(p, 16)) else {
                continue;
            };
            out.insert(inode, Object::Listener { family, addr, port });
        }
    }
    out
}

/// Descriptors with their open flags: the ends of one pipe.
type Ends = Vec<(i32, u32)>;

/// How each descriptor of a copy is made anew.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Remake {
    /// A pipe: its read ends and write ends (each with its flags).
    Pipe {
        read: Ends,
        write: Ends,
        /// What it held (written into the new pipe).
        data: Vec<u8>,
    },
    /// A socketpair: the descriptors of each end.
    SocketPair {
        socket_type: i32,
        ends: [Ends; 2],
    },
    Object {
        fd: i32,
        flags: u32,
        object: Object,
    },
    /// An inotify instance and its watches, each as (descriptor number,
    /// mask, path in the copy's view), in descriptor order.
    Inotify {
        fd: i32,
        flags: u32,
        watches: Vec<(i32, u32, std::path::PathBuf)>,
    },
}

/// The bytes pipe descriptor `fd` of process `pid` holds, copied without
/// being consumed (at most 64 KiB: a pipe's default size).
pub fn pipe_contents(pid: u32, fd: i32) -> std::io::Result<Vec<u8>> {
    use rustix::pipe::{PipeFlags, SpliceFlags, pipe_with, tee};
    let p = rustix::process::Pid::from_raw(pid as i32)
        .ok_or_else(|| std::io::Error::other("no such process"))?;
    let pidfd = rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty())?;
    let theirs =
        rustix::process::pidfd_getfd(&pidfd, fd, rustix::process::PidfdGetfdFlags::empty())?;
    let (r, w) = pipe_with(PipeFlags::CLOEXEC | PipeFlags::NONBLOCK)?;
    let n = match tee(&theirs, &w, 1 << 16, SpliceFlags::NONBLOCK) {
        Ok(n) => n,
        // Empty.
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

/// The descriptors of `fds` (of process `pid`, whose pipes' contents are
/// read) a copy must make anew, or why it cannot: a pipe whose other end is
/// elsewhere, a socket that is not a listener, an anonymous inode of
/// another kind.
pub fn plan(pid: u32, fds: &[FdEntry]) -> Result<Vec<Remake>, String> {
    let mut pipes: BTreeMap<u64, (Ends, Ends)> = BTreeMap::new();
    let mut unix: BTreeMap<u64, (i32, Ends)> = BTreeMap::new();
    let mut out = Vec::new();
    let mut epolls = Vec::new();
    for e in fds {
        match (&e.target, &e.object) {
            (_, Some(Object::UnixEnd { inode, socket_type })) => {
                let end = unix.entry(*inode).or_insert((*socket_type, vec![]));
                end.1.push((e.fd, e.flags));
            }
            (FdTarget::Pipe { inode }, _) => {
                let ends = pipes.entry(*inode).or_default();
                match e.flags as i32 & libc::O_ACCMODE {
                    libc::O_RDONLY => ends.0.push((e.fd, e.flags)),
                    libc::O_WRONLY => ends.1.push((e.fd, e.flags)),
                    _ => return Err(format!("a pipe opened read-write (descriptor {})", e.fd)),
                }
            }
            (_, Some(Object::Inotify { watches })) => out.push(Remake::Inotify {
                fd: e.fd,
                flags: e.flags,
                watches: watch_paths(pid, watches)
                    .map_err(|w| format!("an inotify instance (descriptor {}): {w}", e.fd))?,
            }),
            (_, Some(o @ Object::Epoll { .. })) => epolls.push(Remake::Object {
                fd: e.fd,
                flags: e.flags,
                object: o.clone(),
            }),
            (FdTarget::Socket { .. } | FdTarget::AnonInode { .. }, Some(o)) => {
                out.push(Remake::Object {
                    fd: e.fd,
                    flags: e.flags,
                    object: o.clone(),
                })
            }
            (FdTarget::Socket { .. }, None) => {
                return Err(format!(
                    "a socket (descriptor {}) other than a listening TCP one: a copy would share it with the origin",
                    e.fd
                ));
            }
            (FdTarget::AnonInode { name }, None) => {
                return Err(format!("{name} (descriptor {})", e.fd));
            }
            _ => {}
        }
    }
    for (_, (read, write)) in pipes {
        if read.is_empty() || write.is_empty() {
            let fd = read.first().or(write.first()).map_or(-1, |x| x.0);
            return Err(format!(
                "a pipe (descriptor {fd}) whose other end is outside the process: a copy would share it with the origin"
            ));
        }
        let data = pipe_contents(pid, read[0].0)
            .map_err(|e| format!("what its pipe (descriptor {}) holds: {e}", read[0].0))?;
        out.push(Remake::Pipe { read, write, data });
    }
    // Unix sockets connected to each other, by their peers (sock_diag):
    // each pair is made again as a socketpair.
    if !unix.is_empty() {
        let peers = crate::unixdiag::peers(pid)
            .map_err(|e| format!("Unix sockets whose peers could not be read: {e}"))?;
        let mut left = unix;
        while let Some((inode, (socket_type, a))) = left.pop_first() {
            let Some((_, b)) = peers.get(&inode).and_then(|p| left.remove(p)) else {
                return Err(format!(
                    "a Unix socket (descriptor {}) connected to a process other than itself: a copy would share the connection with the origin",
                    a[0].0
                ));
            };
            out.push(Remake::SocketPair {
                socket_type,
                ends: [a, b],
            });
        }
    }
    // Last: their registrations name the descriptors made before them.
    out.extend(epolls);
    Ok(out)
}

/// What a rollback in place makes anew: epoll instances (the kernel wakes a
/// registration on a signalfd through the queue of the process that
/// registered it: the killed origin's) and the objects whose state the
/// origin kept changing after the checkpoint (eventfd counts, timers,
/// signalfds). Pipes, sockets and inotify instances stay shared with the
/// template: nothing ties them to the process, and listeners must keep
/// their address.
pub fn plan_in_place(fds: &[FdEntry]) -> Vec<Remake> {
    let (epolls, others): (Vec<_>, Vec<_>) = fds
        .iter()
        .filter_map(|e| match (&e.target, &e.object) {
            (
                FdTarget::AnonInode { .. },
                Some(
                    o @ (Object::Epoll { .. }
                    | Object::EventFd { .. }
                    | Object::TimerFd { .. }
                    | Object::SignalFd { .. }),
                ),
            ) => Some(Remake::Object {
                fd: e.fd,
                flags: e.flags,
                object: o.clone(),
            }),
            _ => None,
        })
        .partition(|r| {
            matches!(
                r,
                Remake::Object {
                    object: Object::Epoll { .. },
                    ..
                }
            )
        });
    // Epolls last: their registrations name the descriptors made before.
    others.into_iter().chain(epolls).collect()
}

/// The most directories and files searched for the paths of inotify
/// watches (which `fdinfo` names by inode).
const WATCH_SEARCH_LIMIT: usize = 200_000;

/// The paths, under `/workspace` as process `pid` sees it, of `watches`
/// (found by device and inode), with their descriptor numbers and masks.
fn watch_paths(pid: u32, watches: &[Watch]) -> Result<Vec<(i32, u32, std::path::PathBuf)>, String> {
    use std::os::unix::fs::MetadataExt;
    if watches.is_empty() {
        return Ok(vec![]);
    }
    let root = std::path::PathBuf::from(format!("/proc/{pid}/root"));
    let key = |dev: u64, ino: u64| (dev >> 20, dev & 0xf_ffff, ino);
    let mut want: BTreeMap<(u64, u64, u64), Option<std::path::PathBuf>> =
        watches.iter().map(|w| (key(w.sdev, w.ino), None)).collect();
    let mut todo = vec![std::path::PathBuf::from("/workspace")];
    let mut seen = 0usize;
    while let Some(dir) = todo.pop() {
        let Ok(meta) = std::fs::symlink_metadata(root.join(dir.strip_prefix("/").unwrap_or(&dir)))
        else {
            continue;
        };
        seen += 1;
        if seen > WATCH_SEARCH_LIMIT {
            return Err(format!(
                "its watches were not found among the first {WATCH_SEARCH_LIMIT} files of /workspace"
            ));
        }
        let dev = meta.dev();
        let k = (libc::major(dev) as u64, libc::minor(dev) as u64, meta.ino());
        if let Some(slot) = want.get_mut(&k)
            && slot.is_none()
        {
            *slot = Some(dir.clone());
        }
        if want.values().all(Option::is_some) {
            break;
        }
        if meta.is_dir()
            && let Ok(rd) = std::fs::read_dir(root.join(dir.strip_prefix("/").unwrap_or(&dir)))
        {
            todo.extend(rd.flatten().map(|e| dir.join(e.file_name())));
        }
    }
    watches
        .iter()
        .map(|w| match &want[&key(w.sdev, w.ino)] {
            Some(p) => Ok((w.wd, w.mask, p.clone())),
            None => Err(format!(
                "watch {} is on a file outside /workspace (inode {}), which a fork does not hold",
                w.wd, w.ino
            )),
        })
        .collect()
}

/// Puts a copy of `new` (a descriptor of `t`, never one of the numbers
/// being replaced: those are all open, and new ones take the lowest free)
/// at `fd` with `flags`' close-on-exec and status flags.
#[cfg(target_arch = "x86_64")]
fn place(t: &mut Tracee, new: u64, fd: i32, flags: u32) -> Result<(), ProcError> {
    crate::fixes::dup_onto(t, new, fd, flags)?;
    crate::fixes::set_status(t, fd, flags, libc::O_NONBLOCK)
}

/// Makes the objects of `plan` anew in stopped copy `t`.
#[cfg(target_arch = "x86_64")]
pub fn remake(t: &mut Tracee, plan: &[Remake]) -> Result<(), ProcError> {
    for r in plan {
        match r {
            Remake::Pipe { read, write, data } => {
                let at = t.scratch(0, &[0u8; 8])?;
                t.syscall(
                    "pipe2",
                    libc::SYS_pipe2,
                    [at, libc::O_CLOEXEC as u64, 0, 0, 0, 0],
                )?;
                let b = t.peek(at, 8)?;
                let (r0, w0) = (
                    i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as u64,
                    i32::from_le_bytes([b[4], b[5], b[6], b[7]]) as u64,
                );
                if !data.is_empty() {
                    let at = t.scratch(64, data)?;
                    t.syscall(
                        "write(pipe contents)",
                        libc::SYS_write,
                        [w0, at, data.len() as u64, 0, 0, 0],
                    )?;
                }
                for (ends, made) in [(read, r0), (write, w0)] {
                    for &(fd, flags) in ends {
                        place(t, made, fd, flags)?;
                    }
                    t.syscall("close", libc::SYS_close, [made, 0, 0, 0, 0, 0])?;
                }
            }
            Remake::SocketPair { socket_type, ends } => {
                let at = t.scratch(0, &[0u8; 8])?;
                t.syscall(
                    "socketpair",
                    libc::SYS_socketpair,
                    [
                        libc::AF_UNIX as u64,
                        (*socket_type | libc::SOCK_CLOEXEC) as u64,
                        0,
                        at,
                        0,
                        0,
                    ],
                )?;
                let b = t.peek(at, 8)?;
                let made = [
                    i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as u64,
                    i32::from_le_bytes([b[4], b[5], b[6], b[7]]) as u64,
                ];
                for (end, new) in ends.iter().zip(made) {
                    for &(fd, flags) in end {
                        place(t, new, fd, flags)?;
                    }
                    t.syscall("close", libc::SYS_close, [new, 0, 0, 0, 0, 0])?;
                }
            }
            Remake::Inotify { fd, flags, watches } => {
                let new = inotify(t, watches)?;
                place(t, new, *fd, *flags)?;
                t.syscall("close", libc::SYS_close, [new, 0, 0, 0, 0, 0])?;
            }
            Remake::Object { fd, flags, object } => {
                let new = match object {
                    Object::EventFd { count, semaphore } => {
                        let f =
                            libc::EFD_CLOEXEC | if *semaphore { libc::EFD_SEMAPHORE } else { 0 };
                        t.syscall(
                            "eventfd2",
                            libc::SYS_eventfd2,
                            [*count, f as u64, 0, 0, 0, 0],
                        )?
                    }
                    Object::Epoll { .. } => t.syscall(
                        "epoll_create1",
                        libc::SYS_epoll_create1,
                        [libc::EPOLL_CLOEXEC as u64, 0, 0, 0, 0, 0],
                    )?,
                    Object::UnixEnd { .. } => {
                        unreachable!("planned as a socketpair")
                    }
                    Object::Inotify { .. } => unreachable!("planned with its paths"),
                    Object::Connection { family } => reset_connection(t, *family)?,
                    Object::TimerFd {
                        clock,
                        ticks,
                        value,
                        interval,
                    } => timerfd(t, *clock, *ticks, *value, *interval)?,
                    Object::SignalFd { mask } => {
                        let at = t.scratch(0, &mask.to_le_bytes())?;
                        t.syscall(
                            "signalfd4",
                            libc::SYS_signalfd4,
                            [u64::MAX, at, 8, libc::SFD_CLOEXEC as u64, 0, 0],
                        )?
                    }
                    Object::Listener { family, addr, port } => {
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
                        let sa = sockaddr(*family, addr, *port);
                        let at = t.scratch(64, &sa)?;
                        t.syscall("bind", libc::SYS_bind, [s, at, sa.len() as u64, 0, 0, 0])?;
                        t.syscall("listen", libc::SYS_listen, [s, 511, 0, 0, 0, 0])?;
                        s
                    }
                };
                place(t, new, *fd, *flags)?;
                t.syscall("close", libc::SYS_close, [new, 0, 0, 0, 0, 0])?;
                if let Object::Epoll { entries } = object {
                    for &(tfd, events, data) in entries {
                        let mut ev = Vec::with_capacity(12);
                        ev.extend_from_slice(&events.to_le_bytes());
                        ev.extend_from_slice(&data.to_le_bytes());
                        let at = t.scratch(0, &ev)?;
                        t.syscall(
                            "epoll_ctl(EPOLL_CTL_ADD)",
                            libc::SYS_epoll_ctl,
                            [*fd as u64, libc::EPOLL_CTL_ADD as u64, tfd as u64, at, 0, 0],
                        )?;
                    }
                }
            }
        }
    }
    Ok(())
}

/// The descriptors of `plan` that a copy gets as reset connections.
pub fn resets(plan: &[Remake]) -> Vec<i32> {
    plan.iter()
        .filter_map(|r| match r {
            Remake::Object {
                fd,
                object: Object::Connection { .. },
                ..
            } => Some(*fd),
            _ => None,
        })
        .collect()
}

/// A TCP socket of `family` whose connection was reset: connected over the
/// copy's loopback to a socket closed at once with a zero linger (which
/// sends a reset), so that the program's next read or write fails with
/// `ECONNRESET` and its poll reports an error, as for a connection the
/// network dropped. Where the loopback is not up, an unconnected socket
/// (`ENOTCONN`).
#[cfg(target_arch = "x86_64")]
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

/// `TFD_IOC_SET_TICKS`: `_IOW('T', 0, u64)`.
#[cfg(target_arch = "x86_64")]
const TFD_IOC_SET_TICKS: u64 = 0x4008_5400;

/// A timerfd on `clock` with `value` left to run, then every `interval`,
/// and `ticks` expirations waiting to be read.
#[cfg(target_arch = "x86_64")]
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
#[cfg(target_arch = "x86_64")]
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
fn sockaddr(family: i32, addr: &[u8], port: u16) -> Vec<u8> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fdinfo_of_eventfds_and_epolls_is_read() {
        let ev = "pos:\t0\nflags:\t02004002\nmnt_id:\t16\nino:\t1038\neventfd-count:                5\neventfd-id: 2\neventfd-semaphore: 1\n";
        assert_eq!(
            parse_anon("[eventfd]", ev),
            Some(Object::EventFd {
                count: 5,
                semaphore: true
            })
        );
        let ep = "pos:\t0\nflags:\t02\nmnt_id:\t16\nino:\t1038\ntfd:       14 events:       19 data:                e  pos:0 ino:48a626 sdev:f\ntfd:       18 events: 80000001 data:     7f5500000012  pos:0 ino:48a62a sdev:9\n";
        assert_eq!(
            parse_anon("[eventpoll]", ep),
            Some(Object::Epoll {
                entries: vec![(14, 0x19, 0xe), (18, 0x8000_0001, 0x7f55_0000_0012)]
            })
        );
        assert_eq!(parse_anon("[timerfd]", ep), None);
    }

    #[test]
    fn fdinfo_of_timerfds_signalfds_and_inotify_is_read() {
        let head = "pos:\t0\nflags:\t02000002\nmnt_id:\t17\nino:\t1038\n";
        let t = format!(
            "{head}clockid: 1\nticks: 3\nsettime flags: 00\nit_value: (5, 499730748)\nit_interval: (2, 0)\n"
        );
        assert_eq!(
            parse_anon("[timerfd]", &t),
            Some(Object::TimerFd {
                clock: 1,
                ticks: 3,
                value: (5, 499_730_748),
                interval: (2, 0)
            })
        );
        let s = format!("{head}sigmask:\t0000000000000200\n");
        assert_eq!(
            parse_anon("[signalfd]", &s),
            Some(Object::SignalFd { mask: 0x200 })
        );
        let i = format!(
            "{head}inotify wd:3 ino:98c22b sdev:fe00000 mask:102 ignored_mask:0 fhandle-bytes:8 fhandle-type:1 f_handle:2bc298008b76f018\ninotify wd:1 ino:2 sdev:2b mask:100 ignored_mask:0\n"
        );
        assert_eq!(
            parse_anon("inotify", &i),
            Some(Object::Inotify {
                watches: vec![
                    Watch {
                        wd: 1,
                        mask: 0x100,
                        ino: 2,
                        sdev: 0x2b
                    },
                    Watch {
                        wd: 3,
                        mask: 0x102,
                        ino: 0x98c22b,
                        sdev: 0xfe0_0000
                    }
                ]
            })
        );
        assert_eq!(parse_anon("[signalfd]", head), None, "no mask: unknown");
    }

    #[test]
    fn sockaddrs_have_the_kernels_layout() {
        let v4 = sockaddr(libc::AF_INET, &[127, 0, 0, 1], 8000);
        assert_eq!(v4.len(), 16);
        assert_eq!(&v4[..8], &[2, 0, 0x1f, 0x40, 127, 0, 0, 1]);
        assert_eq!(sockaddr(libc::AF_INET6, &[0; 16], 80).len(), 28);
    }

    #[test]
    fn a_pipe_with_one_end_elsewhere_is_refused_and_pairs_are_remade() {
        let e = |fd, inode, flags| FdEntry {
            fd,
            target: FdTarget::Pipe { inode },
            pos: 0,
            flags,
            mnt_id: None,
            locks: vec![],
            object: None,
        };
        // This process's own pipe, holding two bytes.
        let (r, w) = rustix::pipe::pipe().unwrap();
        rustix::io::write(&w, b"ab").unwrap();
        use std::os::fd::AsRawFd;
        let (rf, wf) = (r.as_raw_fd(), w.as_raw_fd());
        let me = std::process::id();
        let p = plan(me, &[e(rf, 7, 0o2000000), e(wf, 7, 0o2000001)]).unwrap();
        assert_eq!(
            p,
            vec![Remake::Pipe {
                read: vec![(rf, 0o2000000)],
                write: vec![(wf, 0o2000001)],
                data: b"ab".to_vec(),
            }]
        );
        // Not consumed.
        let mut buf = [0u8; 4];
        assert_eq!(rustix::io::read(&r, &mut buf).unwrap(), 2);
        assert!(plan(me, &[e(4, 7, 0)]).unwrap_err().contains("other end"));
        // Unix sockets are paired by their peers; one whose peer is not
        // the process's is refused.
        if tine_testkit::skipped_without_root("reading Unix sockets' peers") {
            return;
        }
        let ino = |s: &std::os::unix::net::UnixStream| {
            use std::os::unix::fs::MetadataExt;
            std::fs::metadata(format!("/proc/self/fd/{}", s.as_raw_fd()))
                .unwrap()
                .ino()
        };
        let pairs = [
            std::os::unix::net::UnixStream::pair().unwrap(),
            std::os::unix::net::UnixStream::pair().unwrap(),
        ];
        let u = |s: &std::os::unix::net::UnixStream| FdEntry {
            fd: s.as_raw_fd(),
            target: FdTarget::Socket { inode: ino(s) },
            pos: 0,
            flags: 2,
            mnt_id: None,
            locks: vec![],
            object: Some(Object::UnixEnd {
                inode: ino(s),
                socket_type: 1,
            }),
        };
        let all: Vec<FdEntry> = pairs.iter().flat_map(|(a, b)| [u(a), u(b)]).collect();
        let p = plan(me, &all).unwrap();
        assert_eq!(p.len(), 2, "{p:?}");
        for (a, b) in &pairs {
            assert!(p.contains(&Remake::SocketPair {
                socket_type: 1,
                ends: if ino(a) < ino(b) {
                    [vec![(a.as_raw_fd(), 2)], vec![(b.as_raw_fd(), 2)]]
                } else {
                    [vec![(b.as_raw_fd(), 2)], vec![(a.as_raw_fd(), 2)]]
                }
            }));
        }
        assert!(
            plan(me, &all[..3])
                .unwrap_err()
                .contains("other than itself")
        );
    }
}
