//! Kernel objects a process holds that a copy must not share with its
//! origin, as recorded at the checkpoint (fdinfo, the sockets themselves), and the
//! plan of what each copy makes anew ([`crate::remake`] makes it): pipes
//! whose two ends the process holds and socketpairs (with what they held at
//! the checkpoint, [`crate::queued`]), eventfds, timerfds, signalfds,
//! inotify instances, listening TCP sockets (bound again to the same
//! address, in the copy's own network namespace), established connections
//! (reset) and epoll instances (every registration, onto the new objects
//! under the same descriptor numbers).

use std::collections::BTreeMap;

use nix::libc;
use serde::{Deserialize, Serialize};

use crate::fdtable::{FdEntry, FdTarget};

/// What the fd table records of a descriptor's kernel object (`fdinfo`, or
/// the socket asked through a duplicate).
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
    /// (network order, 4 or 16 bytes) and port, and for IPv6 whether it
    /// takes IPv6 only (`IPV6_V6ONLY`: a server listening on `::` beside
    /// `0.0.0.0`, as redis does, holds the v4 port with its other socket).
    Listener {
        family: i32,
        addr: Vec<u8>,
        port: u16,
        #[serde(default)]
        v6only: bool,
    },
    /// A connected TCP socket: a copy cannot take over the connection, so
    /// it gets one that was reset.
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
            // Printed in hex (`%16llx`).
            count: u64::from_str_radix(&field("eventfd-count:")?, 16).ok()?,
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
                // Every field in hex (`wd:%x`).
                watches.push(Watch {
                    wd: i32::from_str_radix(&kv("wd:")?, 16).ok()?,
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

/// The object behind socket descriptor `fd` of the process `pidfd` names,
/// asked of the socket itself (a duplicate through `pidfd_getfd`): a
/// listening TCP socket (its address), a connected TCP socket, a connected
/// Unix socket (`inode`, its type). `None` for any other (a UDP socket, an
/// unconnected one) or one that cannot be asked. Reading
/// `/proc/PID/net/tcp` instead walks the whole connection table of the host
/// (over a millisecond on a machine with much memory), inside the pause.
pub fn socket_object(pidfd: &std::os::fd::OwnedFd, fd: i32, inode: u64) -> Option<Object> {
    use rustix::net::{AddressFamily, SocketType, sockopt};
    let s =
        rustix::process::pidfd_getfd(pidfd, fd, rustix::process::PidfdGetfdFlags::empty()).ok()?;
    let domain = sockopt::socket_domain(&s).ok()?;
    let kind = sockopt::socket_type(&s).ok()?;
    let connected = !matches!(
        rustix::net::getpeername(&s),
        Err(rustix::io::Errno::NOTCONN)
    );
    if domain == AddressFamily::UNIX {
        return connected.then_some(Object::UnixEnd {
            inode,
            socket_type: kind.as_raw() as i32,
        });
    }
    let family = if domain == AddressFamily::INET {
        libc::AF_INET
    } else if domain == AddressFamily::INET6 {
        libc::AF_INET6
    } else {
        return None;
    };
    if kind != SocketType::STREAM {
        return None;
    }
    if sockopt::socket_acceptconn(&s).ok()? {
        let local = rustix::net::getsockname(&s).ok()?;
        let (addr, port) = match std::net::SocketAddr::try_from(local).ok()? {
            std::net::SocketAddr::V4(a) => (a.ip().octets().to_vec(), a.port()),
            std::net::SocketAddr::V6(a) => (a.ip().octets().to_vec(), a.port()),
        };
        let v6only = family == libc::AF_INET6 && sockopt::ipv6_v6only(&s).ok()?;
        return Some(Object::Listener {
            family,
            addr,
            port,
            v6only,
        });
    }
    connected.then_some(Object::Connection { family })
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
    /// A socketpair: the descriptors of each end, and what was waiting to
    /// be read at each (written from the other).
    SocketPair {
        socket_type: i32,
        ends: [Ends; 2],
        data: [Vec<u8>; 2],
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

/// The descriptors of `fds` (of process `pid`; `queued`: what its pipes and
/// sockets held at the checkpoint) a copy in namespaces of its own must
/// make anew, or why it cannot: a pipe or Unix socket whose other end is
/// elsewhere, a socket that is neither a listener nor a TCP connection, an
/// anonymous inode of another kind.
pub fn plan(
    pid: u32,
    fds: &[FdEntry],
    queued: &BTreeMap<i32, String>,
) -> Result<Vec<Remake>, String> {
    plan_with(pid, fds, queued, true)
}

/// [`plan`], leaving out the pipes and Unix sockets (by inode) of `skip`:
/// those a process tree shares, made once for the whole tree.
pub fn plan_except(
    pid: u32,
    fds: &[FdEntry],
    queued: &BTreeMap<i32, String>,
    skip: &std::collections::BTreeSet<u64>,
) -> Result<Vec<Remake>, String> {
    plan_with(pid, &without(fds, skip), queued, true)
}

/// `fds` without the pipes and Unix sockets of `skip`.
fn without(fds: &[FdEntry], skip: &std::collections::BTreeSet<u64>) -> Vec<FdEntry> {
    fds.iter()
        .filter(|e| {
            let inode = match (&e.target, &e.object) {
                (_, Some(Object::UnixEnd { inode, .. }))
                | (FdTarget::Pipe { inode } | FdTarget::Socket { inode }, _) => Some(*inode),
                _ => None,
            };
            inode.is_none_or(|i| !skip.contains(&i))
        })
        .cloned()
        .collect()
}

/// What a rollback in place makes anew: epoll instances (the kernel wakes a
/// registration on a signalfd through the queue of the process that
/// registered it: the killed origin's), the objects whose state the origin
/// kept changing after the checkpoint (eventfd counts, timers, signalfds),
/// and the pipes and socketpairs only the process holds (with what they
/// held at the checkpoint: the origin may have read it since). The rest
/// stays shared with the template: listeners must keep their address,
/// connections and inotify instances are not the process's alone.
///
/// Leaves out the pipes and Unix sockets (by inode) of `skip`: those a
/// process tree shares, made once for the whole tree (`treeobjects`).
pub fn plan_in_place_except(
    pid: u32,
    fds: &[FdEntry],
    queued: &BTreeMap<i32, String>,
    skip: &std::collections::BTreeSet<u64>,
) -> Vec<Remake> {
    plan_with(pid, &without(fds, skip), queued, false).unwrap_or_default()
}

/// [`plan`] (`fork`), or [`plan_in_place_except`], which never fails: what it
/// cannot make anew it leaves shared.
fn plan_with(
    pid: u32,
    fds: &[FdEntry],
    queued: &BTreeMap<i32, String>,
    fork: bool,
) -> Result<Vec<Remake>, String> {
    let mut pipes: BTreeMap<u64, (Ends, Ends)> = BTreeMap::new();
    // Pipes opened read-write somewhere (a rollback leaves them shared).
    let mut read_write = std::collections::BTreeSet::new();
    let mut unix: BTreeMap<u64, (i32, Ends)> = BTreeMap::new();
    let mut out = Vec::new();
    let mut epolls = Vec::new();
    let object = |e: &FdEntry, o: &Object| Remake::Object {
        fd: e.fd,
        flags: e.flags,
        object: o.clone(),
    };
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
                    _ if fork => {
                        return Err(format!("a pipe opened read-write (descriptor {})", e.fd));
                    }
                    // Left shared, with every other end of it.
                    _ => {
                        read_write.insert(*inode);
                    }
                }
            }
            (_, Some(o @ Object::Epoll { .. })) => epolls.push(object(e, o)),
            (
                _,
                Some(
                    o @ (Object::EventFd { .. } | Object::TimerFd { .. } | Object::SignalFd { .. }),
                ),
            ) => out.push(object(e, o)),
            (_, Some(_)) if !fork => {}
            (_, Some(Object::Inotify { watches })) => out.push(Remake::Inotify {
                fd: e.fd,
                flags: e.flags,
                watches: watch_paths(pid, watches)
                    .map_err(|w| format!("an inotify instance (descriptor {}): {w}", e.fd))?,
            }),
            (FdTarget::Socket { .. } | FdTarget::AnonInode { .. }, Some(o)) => {
                out.push(object(e, o))
            }
            (FdTarget::Socket { .. }, None) if fork => {
                return Err(format!(
                    "a socket (descriptor {}) other than a listening TCP one: a copy would share it with the origin",
                    e.fd
                ));
            }
            (FdTarget::AnonInode { name }, None) if fork => {
                return Err(format!("{name} (descriptor {})", e.fd));
            }
            _ => {}
        }
    }
    for (inode, (read, write)) in pipes {
        if read.is_empty() || write.is_empty() || read_write.contains(&inode) {
            if !fork {
                continue;
            }
            let fd = read.first().or(write.first()).map_or(-1, |x| x.0);
            return Err(format!(
                "a pipe (descriptor {fd}) whose other end is outside the process: a copy would share it with the origin"
            ));
        }
        let data = crate::queued::recorded(queued, read[0].0);
        out.push(Remake::Pipe { read, write, data });
    }
    // Unix sockets connected to each other, by their peers (sock_diag):
    // each pair is made again as a socketpair.
    if !unix.is_empty() {
        let peers = match crate::unixdiag::peers(pid) {
            Ok(p) => p,
            Err(e) if fork => {
                return Err(format!("Unix sockets whose peers could not be read: {e}"));
            }
            Err(_) => BTreeMap::new(),
        };
        let mut left = unix;
        while let Some((inode, (socket_type, a))) = left.pop_first() {
            let Some((_, b)) = peers.get(&inode).and_then(|p| left.remove(p)) else {
                if !fork {
                    continue;
                }
                return Err(format!(
                    "a Unix socket (descriptor {}) connected to a process other than itself: a copy would share the connection with the origin",
                    a[0].0
                ));
            };
            let data = [
                crate::queued::recorded(queued, a[0].0),
                crate::queued::recorded(queued, b[0].0),
            ];
            out.push(Remake::SocketPair {
                socket_type,
                ends: [a, b],
                data,
            });
        }
    }
    // Last: their registrations name the descriptors made before them.
    out.extend(epolls);
    Ok(out)
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
    fn an_eventfds_count_is_read_as_the_kernel_prints_it_in_hex() {
        let fd = nix::sys::eventfd::EventFd::from_value(26).unwrap();
        use std::os::fd::AsRawFd;
        let info =
            std::fs::read_to_string(format!("/proc/self/fdinfo/{}", fd.as_raw_fd())).unwrap();
        assert_eq!(
            parse_anon("[eventfd]", &info),
            Some(Object::EventFd {
                count: 26,
                semaphore: false
            })
        );
    }

    #[test]
    fn an_inotify_instances_watch_numbers_are_read_as_the_kernel_prints_them_in_hex() {
        let dir = tempfile::tempdir().unwrap();
        let i = nix::sys::inotify::Inotify::init(nix::sys::inotify::InitFlags::IN_CLOEXEC).unwrap();
        // Watches 1 to 17: `a` and `10` among them.
        for k in 1..=17 {
            let d = dir.path().join(k.to_string());
            std::fs::create_dir(&d).unwrap();
            i.add_watch(&d, nix::sys::inotify::AddWatchFlags::IN_CREATE)
                .unwrap();
        }
        use std::os::fd::{AsFd, AsRawFd};
        let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", i.as_fd().as_raw_fd()))
            .unwrap();
        let Some(Object::Inotify { watches }) = parse_anon("inotify", &info) else {
            panic!("{info}")
        };
        let wds: Vec<i32> = watches.iter().map(|w| w.wd).collect();
        assert_eq!(wds, (1..=17).collect::<Vec<_>>());
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
    fn sockets_are_told_apart_by_asking_them() {
        use std::os::fd::AsRawFd;
        let me = rustix::process::Pid::from_raw(std::process::id() as i32).unwrap();
        let pidfd = rustix::process::pidfd_open(me, rustix::process::PidfdFlags::empty()).unwrap();
        let ask = |fd: i32| socket_object(&pidfd, fd, 42);
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        assert_eq!(
            ask(listener.as_raw_fd()),
            Some(Object::Listener {
                family: libc::AF_INET,
                addr: vec![127, 0, 0, 1],
                port,
                v6only: false,
            })
        );
        // An IPv6 listener says whether it takes IPv6 only.
        let v6 = rustix::net::socket(
            rustix::net::AddressFamily::INET6,
            rustix::net::SocketType::STREAM,
            None,
        )
        .unwrap();
        rustix::net::sockopt::set_ipv6_v6only(&v6, true).unwrap();
        rustix::net::bind(
            &v6,
            &std::net::SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, 0)),
        )
        .unwrap();
        rustix::net::listen(&v6, 8).unwrap();
        assert!(matches!(
            ask(v6.as_raw_fd()),
            Some(Object::Listener {
                family: libc::AF_INET6,
                v6only: true,
                ..
            })
        ));
        let client = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        assert_eq!(
            ask(client.as_raw_fd()),
            Some(Object::Connection {
                family: libc::AF_INET
            })
        );
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        assert_eq!(
            ask(a.as_raw_fd()),
            Some(Object::UnixEnd {
                inode: 42,
                socket_type: libc::SOCK_STREAM
            })
        );
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        assert_eq!(ask(udp.as_raw_fd()), None, "UDP is not made anew");
        let lone = rustix::net::socket(
            rustix::net::AddressFamily::INET,
            rustix::net::SocketType::STREAM,
            None,
        )
        .unwrap();
        assert_eq!(
            ask(lone.as_raw_fd()),
            None,
            "neither listening nor connected"
        );
    }

    #[test]
    fn sockaddrs_have_the_kernels_layout() {
        let v4 = crate::remake::sockaddr(libc::AF_INET, &[127, 0, 0, 1], 8000);
        assert_eq!(v4.len(), 16);
        assert_eq!(&v4[..8], &[2, 0, 0x1f, 0x40, 127, 0, 0, 1]);
        assert_eq!(
            crate::remake::sockaddr(libc::AF_INET6, &[0; 16], 80).len(),
            28
        );
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
        let fds = [e(rf, 7, 0o2000000), e(wf, 7, 0o2000001)];
        // What it holds, as the checkpoint recorded it.
        let queued = crate::queued::at_checkpoint(me, &fds).unwrap();
        let p = plan(me, &fds, &queued).unwrap();
        assert_eq!(
            p,
            vec![Remake::Pipe {
                read: vec![(rf, 0o2000000)],
                write: vec![(wf, 0o2000001)],
                data: b"ab".to_vec(),
            }]
        );
        let none = BTreeMap::new();
        assert!(
            plan(me, &[e(4, 7, 0)], &none)
                .unwrap_err()
                .contains("other end")
        );
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
        let p = plan(me, &all, &none).unwrap();
        assert_eq!(p.len(), 2, "{p:?}");
        for (a, b) in &pairs {
            assert!(p.contains(&Remake::SocketPair {
                socket_type: 1,
                ends: if ino(a) < ino(b) {
                    [vec![(a.as_raw_fd(), 2)], vec![(b.as_raw_fd(), 2)]]
                } else {
                    [vec![(b.as_raw_fd(), 2)], vec![(a.as_raw_fd(), 2)]]
                },
                data: [vec![], vec![]],
            }));
        }
        assert!(
            plan(me, &all[..3], &none)
                .unwrap_err()
                .contains("other than itself")
        );
    }
}
