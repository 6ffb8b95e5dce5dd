//! Whether a process can be cloned faithfully by an injected fork, and the
//! `/proc` reading that everything in this crate shares.

use std::io;
use std::path::{Path, PathBuf};

/// Why a process cannot become a template, with what names it for the user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotCloneable {
    /// Its host PID.
    pub pid: u32,
    /// Its PID in its sandbox, when it is in one: what messages name it by.
    pub ns_pid: Option<u32>,
    /// Its command line, arguments joined by spaces.
    pub cmdline: String,
    pub reason: String,
}

impl NotCloneable {
    /// Process `pid`, named by its PID in its sandbox as it is now.
    pub fn of(pid: u32, cmdline: String, reason: String) -> NotCloneable {
        let ns_pid = ns_pids(pid)
            .filter(|p| p.len() > 1)
            .and_then(|p| p.last().copied());
        NotCloneable {
            pid,
            ns_pid,
            cmdline,
            reason,
        }
    }

    /// How messages name it: its PID in the sandbox, the host's in brackets.
    pub fn who(&self) -> String {
        match self.ns_pid {
            Some(n) => format!("{n} [host PID {}]", self.pid),
            None => format!("[host PID {}]", self.pid),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ProcError {
    #[error("process {}: read {}: {source}", ShownPid(*.pid), path.display())]
    Read {
        pid: u32,
        path: PathBuf,
        source: io::Error,
    },
    #[error("process {} is gone", ShownPid(*.pid))]
    Gone { pid: u32 },
    #[error("process {}: {} is not in the format the kernel documents", ShownPid(*.pid), path.display())]
    Malformed { pid: u32, path: PathBuf },
    #[error("process {}: {step} failed: {source}", ShownPid(*.pid))]
    Ptrace {
        pid: u32,
        step: &'static str,
        source: io::Error,
    },
    #[error("process {}: injected {call} failed: {source}", ShownPid(*.pid))]
    Injected {
        pid: u32,
        call: &'static str,
        source: io::Error,
    },
    #[error(
        "template {} is gone or was replaced (it was killed, or the machine restarted)",
        ShownPid(*.pid)
    )]
    TemplateGone { pid: u32 },
    #[error(
        "process {} ({}) cannot be checkpointed by native fork: {}; take the snapshot with --files-only",
        .0.who(), .0.cmdline, .0.reason
    )]
    NotCloneable(NotCloneable),
    #[error(
        "process {} ({}) cannot be persisted with CRIU: {}",
        .0.who(), .0.cmdline, .0.reason
    )]
    NotPersistable(NotCloneable),
}

/// A host PID as messages show it: the process's PID in its sandbox (the
/// innermost PID namespace), the host's in brackets; only the host's when
/// the process is gone or in the host's namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShownPid(pub u32);

impl std::fmt::Display for ShownPid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match ns_pids(self.0).as_deref() {
            Some([_, .., inner]) => write!(f, "{inner} [host PID {}]", self.0),
            _ => write!(f, "[host PID {}]", self.0),
        }
    }
}

impl ProcError {
    pub(crate) fn read(pid: u32, path: &Path, source: io::Error) -> ProcError {
        if source.kind() == io::ErrorKind::NotFound || source.raw_os_error() == Some(3) {
            ProcError::Gone { pid }
        } else {
            ProcError::Read {
                pid,
                path: path.to_path_buf(),
                source,
            }
        }
    }
}

/// Reads a small `/proc` file of process `pid`; a vanished process is [`ProcError::Gone`].
pub(crate) fn read_proc(pid: u32, path: &Path) -> Result<String, ProcError> {
    read_whole(path).map_err(|source| ProcError::read(pid, path, source))
}

/// Process `pid`'s memory map, its `/proc/PID/maps` text.
pub fn maps_text(pid: u32) -> Result<String, ProcError> {
    read_proc(pid, &PathBuf::from(format!("/proc/{pid}/maps")))
}

/// A file of `/proc` read whole in few calls. Each `read` of a generated
/// file (a `seq_file`) makes what fits the buffer it is given, so the
/// small first reads of `read_to_string` cost a large `maps` more calls
/// than its size needs.
pub fn read_whole(path: &Path) -> std::io::Result<String> {
    use std::io::Read;
    let mut f = std::fs::File::open(path)?;
    let mut buf = vec![0u8; 16 << 10];
    let mut n = 0;
    loop {
        if n == buf.len() {
            buf.resize(buf.len() * 2, 0);
        }
        match f.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(r) => n += r,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    buf.truncate(n);
    String::from_utf8(buf).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// Whether process `pid` maps a file of device `dev` (major, minor) shared
/// and writable (`None`: it could not be read). Asked of the kernel by
/// `PROCMAP_QUERY` (Linux 6.11), which filters the mappings itself: one
/// call where a program's `maps` text costs a third of a millisecond
/// (numpy's 190 lines); the text where the call is missing.
pub fn maps_file_shared_writable(pid: u32, dev: (u32, u32)) -> Option<bool> {
    let path = PathBuf::from(format!("/proc/{pid}/maps"));
    #[cfg(target_arch = "x86_64")]
    {
        use std::os::fd::AsFd;
        // PROCMAP_QUERY_VMA_WRITABLE | _VMA_SHARED | _FILE_BACKED_VMA.
        const FLAGS: u64 = 0x02 | 0x08 | 0x20;
        let f = std::fs::File::open(&path).ok()?;
        let mut at = 0;
        loop {
            match crate::raw::procmap_query(f.as_fd(), at, FLAGS, None) {
                Ok(None) => return Some(false),
                Ok(Some(q)) if q.dev == dev => return Some(true),
                Ok(Some(q)) if q.end > at => at = q.end,
                _ => break,
            }
        }
    }
    let shown = format!("{:02x}:{:02x}", dev.0, dev.1);
    let maps = read_whole(&path).ok()?;
    Some(maps.lines().any(|l| {
        let mut f = l.split_ascii_whitespace();
        let perms = f.nth(1).unwrap_or("").as_bytes();
        perms.get(1) == Some(&b'w') && perms.get(3) == Some(&b's') && f.nth(1) == Some(&shown)
    }))
}

/// Process `pid`'s memory map as [`crate::layout::parse_maps`] reads it
/// from `/proc/PID/maps`, asked of the kernel mapping by mapping
/// (`PROCMAP_QUERY`, Linux 6.11) instead of read as text: each name is
/// taken from `known` (an earlier reading, sorted: its template's) where
/// the mapping is as it was there (bounds, protection, sharing, offset,
/// file), and asked for where not. numpy's 185 mappings: 0.14 ms, against
/// 0.3 for the text (most of it the paths of its libraries). A name
/// changed under the same mapping (an anonymous one renamed with
/// `PR_SET_VMA_ANON_NAME`) reads as it was. `None` where the call is
/// missing. The process should be stopped.
#[cfg(target_arch = "x86_64")]
pub fn maps_like(
    pid: u32,
    known: &[crate::layout::Mapping],
) -> Option<Vec<crate::layout::Mapping>> {
    use std::os::fd::AsFd;
    let f = std::fs::File::open(format!("/proc/{pid}/maps")).ok()?;
    let mut out = Vec::with_capacity(known.len());
    // A path's most bytes, with its NUL.
    let mut name = vec![0u8; 4096];
    let mut at = 0;
    while let Some(q) = crate::raw::procmap_query(f.as_fd(), at, 0, None).ok()? {
        let (prot, shared) = (q.flags & 7, q.flags & 8 != 0);
        let dev = format!("{:02x}:{:02x}", q.dev.0, q.dev.1);
        let i = known.partition_point(|m| m.start < q.start);
        let m = match known.get(i) {
            Some(k)
                if k.start == q.start
                    && k.end == q.end
                    && k.prot == prot
                    && k.shared == shared
                    && k.offset == q.offset
                    && k.inode == q.inode
                    && k.dev == dev =>
            {
                k.clone()
            }
            _ => {
                let n =
                    crate::raw::procmap_query(f.as_fd(), q.start, 0, Some(&mut name)).ok()??;
                if (n.start, n.end) != (q.start, q.end) {
                    return None;
                }
                crate::layout::Mapping {
                    start: q.start,
                    end: q.end,
                    prot,
                    shared,
                    offset: q.offset,
                    dev,
                    inode: q.inode,
                    path: String::from_utf8_lossy(&name[..n.name_len.saturating_sub(1)])
                        .into_owned(),
                }
            }
        };
        at = m.end;
        out.push(m);
    }
    // The gate mapping is no mapping of the process's: `maps` adds it last.
    out.extend(
        known
            .iter()
            .filter(|m| m.start >= at && m.path == "[vsyscall]")
            .cloned(),
    );
    Some(out)
}

/// `/proc/PID/map_files/` of process `pid`'s mapping from `start` to `end`:
/// the file it maps, opened as itself.
pub(crate) fn map_file(pid: u32, start: u64, end: u64) -> PathBuf {
    PathBuf::from(format!("/proc/{pid}/map_files/{start:x}-{end:x}"))
}

/// The command line of `pid`, arguments joined by spaces, for messages.
pub fn cmdline(pid: u32) -> String {
    cmdline_at(Path::new("/proc"), pid)
}

/// The command line of `pid` (NUL-separated in `/proc`), for messages.
pub fn cmdline_at(proc_root: &Path, pid: u32) -> String {
    let raw = std::fs::read(proc_root.join(pid.to_string()).join("cmdline")).unwrap_or_default();
    let parts: Vec<String> = raw
        .split(|b| *b == 0)
        .filter(|p| !p.is_empty())
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .collect();
    if parts.is_empty() {
        format!("pid {pid}")
    } else {
        parts.join(" ")
    }
}

/// The threads of `pid`.
pub(crate) fn threads(proc_root: &Path, pid: u32) -> Result<Vec<u32>, ProcError> {
    let dir = proc_root.join(pid.to_string()).join("task");
    let mut out: Vec<u32> = std::fs::read_dir(&dir)
        .map_err(|source| ProcError::read(pid, &dir, source))?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    out.sort_unstable();
    Ok(out)
}

/// The live children of `pid`, from each thread's `children` file.
fn children(proc_root: &Path, pid: u32, tids: &[u32]) -> Result<Vec<u32>, ProcError> {
    let mut out = Vec::new();
    for tid in tids {
        let path = proc_root
            .join(pid.to_string())
            .join("task")
            .join(tid.to_string())
            .join("children");
        match read_proc(pid, &path) {
            Ok(t) => out.extend(t.split_whitespace().filter_map(|c| c.parse::<u32>().ok())),
            // A thread that ended meanwhile has no children left to report.
            Err(ProcError::Gone { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    out.sort_unstable();
    Ok(out)
}

/// The children of process `pid` (of all its threads, zombies included),
/// sorted; none if it is gone.
pub fn children_of(pid: u32) -> Vec<u32> {
    let root = Path::new("/proc");
    let tids = threads(root, pid).unwrap_or_default();
    let mut out = children(root, pid, &tids).unwrap_or_default();
    out.dedup();
    out
}

/// Whether `pid` is a zombie, waiting up to 100 ms for one that is exiting.
fn zombie_soon(proc_root: &Path, pid: u32) -> bool {
    let deadline = std::time::Instant::now() + std::time::Duration::from_millis(100);
    loop {
        let path = proc_root.join(pid.to_string()).join("stat");
        let Some(st) = read_proc(pid, &path).ok().and_then(|t| parse_stat(&t)) else {
            // Reaped meanwhile: not a child any more.
            return true;
        };
        if st.state == 'Z' {
            return true;
        }
        if !st.exiting() || std::time::Instant::now() > deadline {
            return false;
        }
        std::thread::yield_now();
    }
}

/// The children of `pid` that ended and are not reaped yet: their PIDs in
/// their innermost PID namespace and their wait statuses (as `waitpid`
/// would give them).
pub fn zombies(pid: u32) -> Result<Vec<(u32, i32)>, ProcError> {
    let root = Path::new("/proc");
    let tids = threads(root, pid)?;
    Ok(zombies_among(children(root, pid, &tids)?))
}

/// Each thread's `/proc/PID/task/TID/children` of a process, opened ahead
/// of a rollback's pause (a read lists the thread's children at the time
/// of the read): [`zombies_through`] then reads them without opening a
/// file a thread (node's seven: 0.06-0.12 ms of the pause).
#[derive(Debug, Default)]
pub struct ChildrenFiles(Vec<(u32, std::fs::File)>);

impl ChildrenFiles {
    /// Those of process `pid`'s threads now.
    pub fn open(pid: u32) -> ChildrenFiles {
        let tids = threads(Path::new("/proc"), pid).unwrap_or_default();
        ChildrenFiles(
            tids.into_iter()
                .filter_map(|t| {
                    std::fs::File::open(format!("/proc/{pid}/task/{t}/children"))
                        .ok()
                        .map(|f| (t, f))
                })
                .collect(),
        )
    }
}

/// [`zombies`] of stopped process `pid` whose threads are `tids` (all of
/// them: a thread that ended hands its children to one that lives),
/// through `files` where each of them has one that reads; else as
/// [`zombies`] does.
pub fn zombies_through(
    pid: u32,
    tids: &[u32],
    files: &ChildrenFiles,
) -> Result<Vec<(u32, i32)>, ProcError> {
    let mut kids = Vec::new();
    for t in tids {
        let text = files
            .0
            .iter()
            .find(|(tid, _)| tid == t)
            .and_then(|(_, f)| read_from_start(f));
        match text {
            Some(text) => kids.extend(
                text.split_whitespace()
                    .filter_map(|c| c.parse::<u32>().ok()),
            ),
            None => return zombies(pid),
        }
    }
    kids.sort_unstable();
    Ok(zombies_among(kids))
}

/// A generated `/proc` file's text, read from its start through `f` (the
/// kernel makes it again at offset 0: what it says then).
pub(crate) fn read_from_start(f: &std::fs::File) -> Option<String> {
    use std::os::unix::fs::FileExt;
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match f.read_at(&mut buf, out.len() as u64) {
            Ok(0) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
    String::from_utf8(out).ok()
}

/// Of `kids`, those that ended and are not reaped yet, as [`zombies`]
/// gives them.
fn zombies_among(kids: Vec<u32>) -> Vec<(u32, i32)> {
    let root = Path::new("/proc");
    let mut out = Vec::new();
    for k in kids {
        let Ok(text) = read_proc(k, &root.join(k.to_string()).join("stat")) else {
            continue;
        };
        let Some(st) = parse_stat(&text) else {
            continue;
        };
        if st.state != 'Z' {
            continue;
        }
        // Field 52, the last: the exit status.
        let status = text
            .rsplit(' ')
            .next()
            .and_then(|v| v.trim().parse::<i32>().ok())
            .unwrap_or(0);
        if let Some(ns) = ns_pids(k).and_then(|p| p.last().copied()) {
            out.push((ns, status));
        }
    }
    out
}

/// Its process group in its innermost PID namespace (`NSpgid`'s last field).
pub fn ns_pgid(pid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("NSpgid:"))?
        .split_whitespace()
        .last()?
        .parse()
        .ok()
}

/// The fields of `/proc/PID/stat` that native fork needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    /// One letter: R, S, D, T, t, Z, X...
    pub state: char,
    pub ppid: u32,
    pub pgrp: u32,
    pub session: u32,
    /// The controlling terminal's device number, 0 for none.
    pub tty_nr: u32,
    /// The terminal's foreground process group, or -1.
    pub tpgid: i32,
    /// The kernel's `PF_*` flags (field 9).
    pub flags: u64,
    /// Clock ticks after boot when it started: with the PID, names a process
    /// for good (a PID alone can be reused).
    pub start_time: u64,
    /// CPU time used, its own and its reaped children's (utime + stime +
    /// cutime + cstime, clock ticks).
    pub cpu_ticks: u64,
}

/// The highest capability number this kernel knows (`cap_last_cap`).
pub fn last_cap() -> u32 {
    std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(40)
}

/// `PF_EXITING` among the flags of `/proc/PID/stat`.
const PF_EXITING: u64 = 0x4;

impl Stat {
    /// Whether the process is being killed or has ended: exiting, or a
    /// zombie not yet reaped. It runs no code of its own any more.
    pub fn exiting(&self) -> bool {
        self.flags & PF_EXITING != 0 || matches!(self.state, 'Z' | 'X')
    }
}

/// The PIDs `pid` has in each PID namespace it is in, from the one of the
/// `/proc` it is read through down to its own (`NSpid:`).
pub fn ns_pids(pid: u32) -> Option<Vec<u32>> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find_map(|l| l.strip_prefix("NSpid:"))?;
    Some(
        line.split_whitespace()
            .filter_map(|w| w.parse().ok())
            .collect(),
    )
}

/// The memory `pid`'s page tables take (`VmPTE:`), in bytes: all that a
/// copy sharing its pages with a template holds of its own.
pub fn page_table_bytes(pid: u32) -> Option<u64> {
    status_kib(pid, "VmPTE:").map(|kib| kib * 1024)
}

/// A figure in KiB of `/proc/PID/status` (`field` with its colon, e.g.
/// `RssAnon:`).
pub fn status_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib = status.lines().find_map(|l| l.strip_prefix(field))?;
    kib.split_whitespace().next()?.parse().ok()
}

/// Reads `/proc/PID/stat` (PIDs in it are as the reader's PID namespace sees them).
pub fn stat(pid: u32) -> Result<Stat, ProcError> {
    let path = PathBuf::from(format!("/proc/{pid}/stat"));
    let text = read_proc(pid, &path)?;
    parse_stat(&text).ok_or(ProcError::Malformed { pid, path })
}

/// Parses a `stat` line; the command name may hold spaces and parentheses,
/// so fields are counted after its last `)`.
pub fn parse_stat(text: &str) -> Option<Stat> {
    let rest = &text[text.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    if f.len() < 20 {
        return None;
    }
    // f[0] is field 3 (state); field n is f[n - 3].
    Some(Stat {
        state: f.first()?.chars().next()?,
        ppid: f.get(1)?.parse().ok()?,
        pgrp: f.get(2)?.parse().ok()?,
        session: f.get(3)?.parse().ok()?,
        tty_nr: f.get(4)?.parse().ok()?,
        tpgid: f.get(5)?.parse().ok()?,
        flags: f.get(6)?.parse().ok()?,
        start_time: f.get(19)?.parse().ok()?,
        cpu_ticks: f[11..15]
            .iter()
            .map(|v| v.parse::<i64>().unwrap_or(0).max(0) as u64)
            .sum(),
    })
}

/// Checks that `pid` can be cloned faithfully by an injected fork (its other
/// threads made again in each copy, see `threads`): a fork leaves the
/// children with their old parent, a copy can only lead a session of its
/// own, and POSIX timers are not copied. Returns its `stat` fields.
pub fn cloneable(pid: u32) -> Result<Stat, ProcError> {
    cloneable_at(Path::new("/proc"), pid)
}

/// [`cloneable`] under another procfs mount.
pub fn cloneable_at(proc_root: &Path, pid: u32) -> Result<Stat, ProcError> {
    cloneable_with(proc_root, pid, &[], true)
}

/// Checks that `pid`, a process of a tree that is copied whole (`members`:
/// every process of it), can be: its live children are members, and a root
/// of the tree (`root`: its parent is not copied) leads its session, which
/// copies of the others rejoin. Returns its `stat` fields.
pub fn cloneable_in(pid: u32, members: &[u32], root: bool) -> Result<Stat, ProcError> {
    cloneable_with(Path::new("/proc"), pid, members, root)
}

/// What a fork copies of any process (its other threads are made again):
/// everything but POSIX timers. Returns its `stat` fields.
pub fn cloneable_member(pid: u32) -> Result<Stat, ProcError> {
    let proc_root = Path::new("/proc");
    let path = proc_root.join(pid.to_string()).join("stat");
    let st = parse_stat(&read_proc(pid, &path)?).ok_or(ProcError::Malformed { pid, path })?;
    match timers_reason(proc_root, pid) {
        Some(reason) => Err(ProcError::NotCloneable(NotCloneable::of(
            pid,
            cmdline_at(proc_root, pid),
            reason,
        ))),
        None => Ok(st),
    }
}

fn timers_reason(proc_root: &Path, pid: u32) -> Option<String> {
    let timers = std::fs::read_to_string(proc_root.join(pid.to_string()).join("timers"))
        .map(|t| t.lines().filter(|l| l.starts_with("ID:")).count())
        .unwrap_or(0);
    (timers > 0).then(|| {
        format!(
            "it has {timers} POSIX timer{} (timer_create), which a copy would not have",
            if timers == 1 { "" } else { "s" }
        )
    })
}

fn cloneable_with(
    proc_root: &Path,
    pid: u32,
    members: &[u32],
    root: bool,
) -> Result<Stat, ProcError> {
    let tids = threads(proc_root, pid)?;
    let mut kids = children(proc_root, pid, &tids)?;
    kids.retain(|k| !members.contains(k));
    if !members.is_empty() {
        // A child that ended, not reaped yet, is made again as one (its
        // exit status recorded: `zombies`); one that is ending soon is.
        kids.retain(|k| !zombie_soon(proc_root, *k));
    }
    let path = proc_root.join(pid.to_string()).join("stat");
    let st = parse_stat(&read_proc(pid, &path)?).ok_or(ProcError::Malformed { pid, path })?;
    let reason = if let Some(r) = timers_reason(proc_root, pid) {
        r
    } else if !kids.is_empty() {
        let shown: Vec<String> = kids
            .iter()
            .take(5)
            .map(|k| ShownPid(*k).to_string())
            .collect();
        format!(
            "it has {} live child process{} (PID {}), which a fork would not bring along",
            kids.len(),
            if kids.len() == 1 { "" } else { "es" },
            shown.join(", ")
        )
    } else if root && st.session != pid {
        format!(
            "it is not the leader of its session (session {}), and a copy could not rejoin that session",
            st.session
        )
    } else {
        return Ok(st);
    };
    Err(ProcError::NotCloneable(NotCloneable::of(
        pid,
        cmdline_at(proc_root, pid),
        reason,
    )))
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    #[test]
    fn zombies_read_through_files_opened_ahead_are_those_read_afresh() {
        let me = std::process::id();
        let files = ChildrenFiles::open(me);
        // A child that ends after the files were opened, left unreaped.
        let mut child = std::process::Command::new("true").spawn().expect("true");
        let kid = child.id();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !stat(kid).is_ok_and(|s| s.state == 'Z') {
            assert!(std::time::Instant::now() < deadline, "{kid} never ended");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let tids = threads(Path::new("/proc"), me).expect("threads");
        let through = zombies_through(me, &tids, &files).expect("through the files");
        let afresh = zombies(me).expect("afresh");
        // (In this namespace the child's PID is the one seen here.)
        assert!(through.iter().any(|(p, _)| *p == kid), "{through:?}");
        assert!(afresh.iter().any(|(p, _)| *p == kid), "{afresh:?}");
        child.wait().expect("reaped");
        // Reaped: no longer among them.
        let through = zombies_through(me, &tids, &files).expect("through the files");
        assert!(!through.iter().any(|(p, _)| *p == kid), "{through:?}");
    }

    /// A Python holding its libraries (and, where numpy is installed,
    /// OpenBLAS's), stopped: its map asked mapping by mapping reads as its
    /// text does, names asked for all of them or taken from the text.
    #[test]
    fn a_map_asked_of_the_kernel_reads_as_its_text() {
        let (mut child, _) = tine_testkit::started_and_ready(
            std::process::Command::new("/usr/bin/python3").args(["-c", "import time\ntry:\n import numpy\nexcept ImportError:\n pass\nprint('r', flush=True)\ntime.sleep(60)"]),
        );
        let pid = child.id();
        let p = nix::unistd::Pid::from_raw(pid as i32);
        nix::sys::signal::kill(p, nix::sys::signal::Signal::SIGSTOP).unwrap();
        let text = crate::layout::parse_maps(
            &read_whole(&PathBuf::from(format!("/proc/{pid}/maps"))).unwrap(),
        );
        let named = maps_like(pid, &text);
        let asked = maps_like(pid, &[]);
        let _ = child.kill();
        let _ = child.wait();
        assert!(text.len() > 20, "{}", text.len());
        assert_eq!(named.as_ref(), Some(&text));
        let own: Vec<_> = text
            .iter()
            .filter(|m| m.path != "[vsyscall]")
            .cloned()
            .collect();
        assert_eq!(asked, Some(own));
    }
}
