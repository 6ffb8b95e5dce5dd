//! Templates: copy-on-write copies of a process made by an injected fork and
//! parked stopped; and processes brought back from them.
//!
//! A template is made a child of its origin's parent (`CLONE_PARENT`; in a
//! sandbox that is its init), so the program never sees an extra child, and
//! put in a session of its own, so a terminal hanging up on the origin's
//! session never wakes it. A process made from a template gets the template's
//! memory and registers (which are the origin's at the checkpoint), becomes a
//! session leader again, takes back its terminal, and gets its descriptors
//! fixed up as the caller asks (offsets reset, workspace files reopened).

use std::path::PathBuf;

use nix::libc;
use serde::{Deserialize, Serialize};

use crate::fdtable::{FdEntry, FdTarget, fd_table};
use crate::inspect::{ProcError, cloneable, stat};
use crate::ptrace::Tracee;

/// A parked template and what a process made from it must get back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Template {
    /// The template's PID (as the caller's PID namespace sees it).
    pub pid: u32,
    /// Its start time, so a reused PID is never taken for it.
    pub start_time: u64,
    /// The process it was made from.
    pub origin: u32,
    /// The origin's descriptors at the checkpoint (offsets are shared with
    /// the origin afterwards, so they are recorded here).
    pub fds: Vec<FdEntry>,
    /// The origin had a controlling terminal and was its foreground group.
    pub foreground: bool,
    /// The origin had a controlling terminal.
    pub has_tty: bool,
    /// Where its vDSO's `syscall` instruction is (0: look it up).
    #[serde(default)]
    pub syscall_at: u64,
    /// The origin's working directory at the checkpoint (as its mount
    /// namespace names it), for copies that land in another one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<PathBuf>,
    /// The origin's `PR_GET_DUMPABLE` (templates themselves are parked not
    /// dumpable; copies get this back).
    #[serde(default = "dumpable_default")]
    pub dumpable: u64,
    /// The origin's other threads at the checkpoint, which every copy gets
    /// back (the template itself, made by fork, has only the main one).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub threads: Vec<crate::threads::ThreadState>,
    /// The main thread's robust futex list (a fork's child starts without).
    #[serde(default)]
    pub robust_list: (u64, u64),
    /// The origin's mappings marked `MADV_DONTFORK`/`MADV_WIPEONFORK`:
    /// cleared in the template (it holds their content), set again in
    /// every copy.
    #[serde(default)]
    pub fork_flags: crate::forkflags::ForkFlags,
}

fn dumpable_default() -> u64 {
    1
}

/// How to fix one descriptor of a process made from a template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FdFix {
    /// Set the shared offset back.
    Seek { fd: i32, pos: u64 },
    /// Open `path` (as the new process sees it) again in its place, with the
    /// same flags, at `pos`.
    Reopen {
        fd: i32,
        path: PathBuf,
        flags: u32,
        pos: u64,
    },
    /// Open the FIFO at `path` (made in the copy's own workspace) in its
    /// place, read-write (see `apply_fix`), with `flags`' status flags.
    ReopenFifo { fd: i32, path: PathBuf, flags: u32 },
}

/// How to make a process from a template.
#[derive(Debug, Clone, Default)]
pub struct Respawn {
    /// Its PID in the template's PID namespace (the one a rollback keeps);
    /// `None` for any free PID.
    pub set_tid: Option<u32>,
    /// Make it a child of the template's parent rather than of the template.
    pub parent: bool,
    pub fds: Vec<FdFix>,
    /// Enter this directory again (a copy in another mount namespace still
    /// stands in the origin's workspace).
    pub chdir: Option<PathBuf>,
    /// Shared file mappings to map again from the file the copy sees (a copy
    /// in another mount namespace would otherwise share the origin's file).
    pub maps: Vec<MapFix>,
    /// Kernel objects to make anew (a copy in namespaces of its own must not
    /// share the origin's pipes, eventfds, epoll instances, listeners).
    pub remake: Vec<crate::objects::Remake>,
}

/// A `MAP_SHARED` mapping of a file, to be made again from `path` as the
/// copy sees it, at the same place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapFix {
    pub start: u64,
    pub end: u64,
    /// `PROT_*` bits.
    pub prot: u64,
    pub offset: u64,
    pub path: PathBuf,
}

/// The shared mappings of process `pid` (from `/proc/PID/maps`): each with
/// whether it is writable, and its path (`None`: anonymous or deleted).
pub fn shared_maps(pid: u32) -> Result<Vec<(MapFix, bool)>, ProcError> {
    let path = PathBuf::from(format!("/proc/{pid}/maps"));
    let text = crate::inspect::read_proc(pid, &path)?;
    let mut out = Vec::new();
    for line in text.lines() {
        // start-end perms offset dev inode [path]
        let mut f = line.splitn(6, char::is_whitespace);
        let (Some(range), Some(perms), Some(offset)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        let p = perms.as_bytes();
        if p.len() != 4 || p[3] != b's' {
            continue;
        }
        let (Some((a, b)), Ok(offset)) = (range.split_once('-'), u64::from_str_radix(offset, 16))
        else {
            continue;
        };
        let (Ok(start), Ok(end)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) else {
            continue;
        };
        let file = f.nth(2).unwrap_or_default().trim_start();
        let bit = |on: bool, prot: i32| if on { prot as u64 } else { 0 };
        let prot = bit(p[0] == b'r', libc::PROT_READ)
            | bit(p[1] == b'w', libc::PROT_WRITE)
            | bit(p[2] == b'x', libc::PROT_EXEC);
        out.push((
            MapFix {
                start,
                end,
                prot,
                offset,
                path: PathBuf::from(file),
            },
            p[1] == b'w',
        ));
    }
    Ok(out)
}

/// `CLONE_PARENT`: the new process is a sibling of the caller.
const CLONE_PARENT: u64 = 0x0000_8000;
/// `sizeof(struct clone_args)` up to `set_tid_size` (`CLONE_ARGS_SIZE_VER1`).
const CLONE_ARGS_SIZE: u64 = 80;

/// Encodes `struct clone_args` (include/uapi/linux/sched.h).
fn clone_args(flags: u64, set_tid_addr: u64, set_tid_size: u64) -> Vec<u8> {
    let fields: [u64; 10] = [
        flags,
        0, // pidfd
        0, // child_tid
        0, // parent_tid
        // exit_signal: with CLONE_PARENT the kernel takes the caller's own
        // (and refuses any other).
        if flags & CLONE_PARENT != 0 {
            0
        } else {
            libc::SIGCHLD as u64
        },
        0,            // stack
        0,            // stack_size
        0,            // tls
        set_tid_addr, // set_tid
        set_tid_size, // set_tid_size
    ];
    fields.iter().flat_map(|f| f.to_le_bytes()).collect()
}

/// Injects `clone3` into `t` and returns the new process, stopped.
fn inject_fork(t: &mut Tracee, parent: bool, set_tid: Option<u32>) -> Result<Tracee, ProcError> {
    let flags = if parent { CLONE_PARENT } else { 0 };
    let (tid_addr, tid_size) = match set_tid {
        Some(tid) => (t.scratch(0, &(tid as i32).to_le_bytes())?, 1),
        None => (0, 0),
    };
    let args = clone_args(flags, tid_addr, tid_size);
    let at = t.scratch(64, &args)?;
    t.clone3(at, CLONE_ARGS_SIZE)
}

/// Makes a template of the stopped process `t`: checks that a fork copies it
/// faithfully, records its descriptors, forks it and parks the copy.
/// `t` stays stopped; the caller lets it go.
pub fn make_template(t: &mut Tracee) -> Result<Template, ProcError> {
    let (tpl, unsettled) = fork_template(t, &mut [], None)?;
    unsettled.settle()?;
    Ok(tpl)
}

/// A template just forked, its memory already out of the sandbox's reach,
/// that still needs a session of its own and parking: work that can wait
/// until its origin runs again. Dropped unsettled, it is killed.
#[derive(Debug)]
#[must_use = "an unsettled template is killed when dropped"]
pub struct Unsettled(Option<Tracee>);

impl Unsettled {
    /// Gives it a session of its own (signals to its origin's group or
    /// session no longer reach it) and parks it.
    pub fn settle(mut self) -> Result<(), ProcError> {
        let mut child = self.0.take().expect("settled once");
        match child.syscall("setsid", libc::SYS_setsid, [0; 6]) {
            Ok(_) => child.park(),
            Err(e) => {
                child.kill();
                Err(e)
            }
        }
    }
}

impl Drop for Unsettled {
    fn drop(&mut self) {
        if let Some(child) = self.0.take() {
            child.kill();
        }
    }
}

/// What of [`make_template`] must happen while `t` is stopped: the state of
/// its other threads, stopped too (`others`, see
/// [`crate::threads::stop_others`]), the fork, and the copy made
/// undumpable. The rest ([`Unsettled::settle`]) can wait until `t` runs
/// again, off its pause. `flags`: its mappings' fork flags as scanned
/// before it stopped (checked, and scanned again if they changed).
pub fn fork_template(
    t: &mut Tracee,
    others: &mut [Tracee],
    flags: Option<&crate::forkflags::Scan>,
) -> Result<(Template, Unsettled), ProcError> {
    let pid = t.pid();
    let st = cloneable(pid)?;
    // Every thread must be held: one still running would change memory
    // the fork copies, and its state would be missing from the copies.
    let tids = crate::threads::other_threads(pid)?;
    if tids.len() != others.len() || !others.iter().all(|o| tids.contains(&o.pid())) {
        return Err(ProcError::NotCloneable(crate::inspect::NotCloneable::of(
            pid,
            crate::inspect::cmdline(pid),
            format!(
                "it has {} threads, of which {} were not stopped for the checkpoint",
                tids.len() + 1,
                tids.len().saturating_sub(others.len())
            ),
        )));
    }
    let threads = others
        .iter_mut()
        .map(crate::threads::capture)
        .collect::<Result<Vec<_>, _>>()?;
    let robust_list = crate::raw::get_robust_list(pid).unwrap_or_default();
    let fds = fd_table(pid)?;
    let cwd = std::fs::read_link(format!("/proc/{pid}/cwd")).ok();
    // What a fork would leave out or zero is copied whole, then marked again.
    let fork_flags = crate::forkflags::current(pid, flags)?;
    crate::forkflags::clear(t, &fork_flags)?;
    let forked = inject_fork(t, true, None);
    let marked = crate::forkflags::set(t, &fork_flags);
    let mut child = forked?;
    if let Err(e) = marked {
        child.kill();
        return Err(e);
    }
    // The copy continues (when a process is made from it) where `t` was stopped.
    child.set_saved_regs(*t.saved_regs());
    // Not dumpable while parked: a sandbox's processes (root there, without
    // CAP_SYS_PTRACE) can then neither trace it nor write its memory, so
    // what a rollback brings back is what was checkpointed. Done before `t`
    // runs again: a descriptor on the copy's memory opened while it was
    // dumpable would stay usable after.
    let made = prctl(
        &mut child,
        "prctl(PR_GET_DUMPABLE)",
        libc::PR_GET_DUMPABLE,
        0,
    )
    .and_then(|dumpable| {
        prctl(
            &mut child,
            "prctl(PR_SET_DUMPABLE)",
            libc::PR_SET_DUMPABLE,
            0,
        )?;
        Ok((dumpable, stat(child.pid())?.start_time))
    });
    let (dumpable, start_time) = match made {
        Ok(m) => m,
        Err(e) => {
            child.kill();
            return Err(e);
        }
    };
    let tpl = Template {
        pid: child.pid(),
        start_time,
        origin: pid,
        fds,
        has_tty: st.tty_nr != 0,
        foreground: st.tty_nr != 0 && st.tpgid == pid as i32,
        syscall_at: t.syscall_at(),
        cwd,
        dumpable,
        threads,
        robust_list,
        fork_flags,
    };
    Ok((tpl, Unsettled(Some(child))))
}

fn prctl(t: &mut Tracee, call: &'static str, op: i32, arg: u64) -> Result<u64, ProcError> {
    t.syscall(call, libc::SYS_prctl, [op as u64, arg, 0, 0, 0, 0])
}

/// Whether the template is still the process it names.
/// One being killed (exiting, or a zombie not yet reaped) is not.
pub fn template_alive(tpl: &Template) -> bool {
    stat(tpl.pid).is_ok_and(|s| s.start_time == tpl.start_time && !s.exiting())
}

/// Seizes a live template (through its recorded `syscall` address when it
/// has one).
fn seize_template(tpl: &Template) -> Result<Tracee, ProcError> {
    if !template_alive(tpl) {
        return Err(ProcError::TemplateGone { pid: tpl.pid });
    }
    if tpl.syscall_at != 0 {
        Tracee::seize_at(tpl.pid, tpl.syscall_at)
    } else {
        Tracee::seize(tpl.pid)
    }
}

/// Makes a new process from a template and lets it run. Returns its PID.
pub fn respawn(tpl: &Template, how: &Respawn) -> Result<u32, ProcError> {
    let mut pids = respawn_many(tpl, std::slice::from_ref(how))?;
    Ok(pids.pop().expect("one process per Respawn"))
}

/// Makes one process per entry of `hows` from a template (held once for all
/// of them) and lets each run. Returns their PIDs, in order. All or nothing:
/// on an error, the copies made so far are killed before they ever ran.
pub fn respawn_many(tpl: &Template, hows: &[Respawn]) -> Result<Vec<u32>, ProcError> {
    clone_stopped(tpl, hows)?.finish()
}

/// Copies made from a template that have not run yet: each is stopped (and
/// traced by the calling thread, which must be the one to finish them),
/// back at the checkpoint's registers. Dropped unfinished, they are killed.
#[derive(Debug)]
pub struct Copies<'a> {
    tpl: &'a Template,
    made: Vec<(Tracee, &'a Respawn)>,
    /// Whether each has its own session already ([`Copies::prepare`]).
    prepared: bool,
}

impl Copies<'_> {
    /// Their PIDs (as the caller's namespace sees them).
    pub fn pids(&self) -> Vec<u32> {
        self.made.iter().map(|(c, _)| c.pid()).collect()
    }

    /// Gives each copy a session of its own and its origin's dumpable flag:
    /// what does not depend on its files, so that it can be done while they
    /// are put back. On an error, dropping `self` kills them all.
    pub fn prepare(&mut self) -> Result<(), ProcError> {
        if !self.prepared {
            for (child, _) in &mut self.made {
                own_session(child, self.tpl)?;
            }
            self.prepared = true;
        }
        Ok(())
    }

    /// Gives each copy its own state (a session, fixed descriptors, its
    /// terminal) and lets it run; returns their PIDs. A copy that cannot be
    /// finished is killed, and so are the ones after it: half made (its
    /// descriptors not fixed), it must not run.
    pub fn finish(mut self) -> Result<Vec<u32>, ProcError> {
        let mut pids = Vec::with_capacity(self.made.len());
        let mut made = std::mem::take(&mut self.made).into_iter();
        while let Some((mut child, how)) = made.next() {
            let done = if self.prepared {
                own_files(&mut child, self.tpl, how)
            } else {
                finish_copy(&mut child, self.tpl, how)
            };
            let threads = done.and_then(|()| own_threads(&mut child, self.tpl));
            let threads = match threads {
                Ok(t) => t,
                Err(e) => {
                    child.kill();
                    made.for_each(|(c, _)| c.kill());
                    return Err(e);
                }
            };
            pids.push(child.pid());
            child.resume()?;
            for t in threads {
                t.resume()?;
            }
        }
        Ok(pids)
    }
}

impl Drop for Copies<'_> {
    fn drop(&mut self) {
        for (c, _) in std::mem::take(&mut self.made) {
            c.kill();
        }
    }
}

/// Clones the template once per entry of `hows` (held once for all of them)
/// and parks it again; the copies stay stopped until [`Copies::finish`] (so
/// that their workspace files can be put back meanwhile). All or nothing.
pub fn clone_stopped<'a>(tpl: &'a Template, hows: &'a [Respawn]) -> Result<Copies<'a>, ProcError> {
    let mut t = seize_template(tpl)?;
    let regs = *t.saved_regs();
    let mut copies = Copies {
        tpl,
        made: Vec::with_capacity(hows.len()),
        prepared: false,
    };
    let mut result = Ok(());
    for how in hows {
        match inject_fork(&mut t, how.parent, how.set_tid) {
            Ok(mut child) => {
                // It continues (when let go) where the template's origin was stopped.
                child.set_saved_regs(regs);
                copies.made.push((child, how))
            }
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    // The template goes back to its parked stop before the copies run (on
    // an error, dropping `copies` kills them).
    t.park().and(result)?;
    Ok(copies)
}

/// A new copy's own state: a session of its own (its PID as the id: the
/// origin's, for a rollback), its descriptors fixed (`how.fds`), its
/// terminal back. The copy stays stopped.
pub fn finish_copy(child: &mut Tracee, tpl: &Template, how: &Respawn) -> Result<(), ProcError> {
    own_session(child, tpl)?;
    own_files(child, tpl, how)
}

/// A copy's threads: its main one's robust list, and the origin's other
/// threads made again (stopped; the caller lets them go after the main one).
pub fn own_threads(child: &mut Tracee, tpl: &Template) -> Result<Vec<Tracee>, ProcError> {
    crate::forkflags::set(child, &tpl.fork_flags)?;
    if tpl.robust_list.0 != 0 {
        child.syscall(
            "set_robust_list",
            libc::SYS_set_robust_list,
            [tpl.robust_list.0, tpl.robust_list.1, 0, 0, 0, 0],
        )?;
    }
    crate::threads::recreate(child, &tpl.threads)
}

/// A copy's session of its own (its PID as the id) and its origin's
/// dumpable flag back (templates are parked undumpable).
fn own_session(child: &mut Tracee, tpl: &Template) -> Result<(), ProcError> {
    child.syscall("setsid", libc::SYS_setsid, [0; 6])?;
    if tpl.dumpable == 1 {
        prctl(
            child,
            "prctl(PR_SET_DUMPABLE)",
            libc::PR_SET_DUMPABLE,
            tpl.dumpable,
        )?;
    }
    Ok(())
}

/// A copy's working directory, descriptors (`how.fds`) and terminal.
fn own_files(child: &mut Tracee, tpl: &Template, how: &Respawn) -> Result<(), ProcError> {
    if let Some(dir) = &how.chdir {
        let at = scratch_path(child, 0, dir)?;
        child.syscall("chdir", libc::SYS_chdir, [at, 0, 0, 0, 0, 0])?;
    }
    for fix in &how.fds {
        apply_fix(child, fix)?;
    }
    for m in &how.maps {
        map_again(child, m)?;
    }
    crate::objects::remake(child, &how.remake)?;
    // POSIX locks belong to the process: a fork does not inherit them. (OFD
    // locks and flocks belong to the open file description, which the
    // template shares: they stay held through it.)
    for e in &tpl.fds {
        for l in e.locks.iter().filter(|l| l.kind == "posix") {
            lock_again(child, e, l)?;
        }
    }
    if tpl.has_tty
        && let Some(fd) = tty_fd(&tpl.fds)
    {
        // The terminal was released when the origin's session ended.
        child.syscall(
            "ioctl(TIOCSCTTY)",
            libc::SYS_ioctl,
            [fd as u64, libc::TIOCSCTTY, 0, 0, 0, 0],
        )?;
        if tpl.foreground {
            // TIOCSPGRP takes the group id as the process sees its own PID.
            let me = ns_pid(child.pid()).unwrap_or(child.pid()) as i32;
            let at = child.scratch(0, &me.to_le_bytes())?;
            child.syscall(
                "ioctl(TIOCSPGRP)",
                libc::SYS_ioctl,
                [fd as u64, libc::TIOCSPGRP, at, 0, 0, 0],
            )?;
        }
    }
    Ok(())
}

/// A descriptor open on a terminal (for taking it back as the controlling one).
fn tty_fd(fds: &[FdEntry]) -> Option<i32> {
    fds.iter()
        .find(|e| {
            matches!(&e.target, FdTarget::Path { path }
                if path.starts_with("/dev/pts") || path.starts_with("/dev/tty"))
        })
        .map(|e| e.fd)
}

/// The PID `pid` has in its own (innermost) PID namespace.
pub fn ns_pid(pid: u32) -> Option<u32> {
    crate::inspect::ns_pids(pid)?.last().copied()
}

/// Writes `path` NUL-terminated into `t`'s scratch area, `below` bytes down
/// (see [`Tracee::scratch`]); returns its address.
fn scratch_path(t: &mut Tracee, below: u64, path: &std::path::Path) -> Result<u64, ProcError> {
    use std::os::unix::ffi::OsStrExt;
    let mut c = path.as_os_str().as_bytes().to_vec();
    c.push(0);
    t.scratch(below, &c)
}

/// Takes POSIX lock `l` again through descriptor `e.fd` of `t` (without
/// waiting: at a rollback or a fork nobody else should hold it).
fn lock_again(t: &mut Tracee, e: &FdEntry, l: &crate::fdtable::FileLock) -> Result<(), ProcError> {
    let r = {
        // struct flock: l_type, l_whence (i16 each), pad, l_start, l_len (i64), l_pid (i32), pad.
        let mut f = Vec::with_capacity(32);
        let kind = if l.write {
            libc::F_WRLCK
        } else {
            libc::F_RDLCK
        } as i16;
        f.extend_from_slice(&kind.to_le_bytes());
        f.extend_from_slice(&(libc::SEEK_SET as i16).to_le_bytes());
        f.extend_from_slice(&[0u8; 4]);
        f.extend_from_slice(&(l.start as i64).to_le_bytes());
        let len = l.end.map_or(0, |end| end + 1 - l.start) as i64;
        f.extend_from_slice(&len.to_le_bytes());
        f.extend_from_slice(&[0u8; 8]);
        let at = t.scratch(0, &f)?;
        t.syscall_raw(
            libc::SYS_fcntl,
            [e.fd as u64, libc::F_SETLK as u64, at, 0, 0, 0],
        )?
    };
    if r < 0 {
        return Err(ProcError::Injected {
            pid: t.pid(),
            call: "take a file lock back",
            source: std::io::Error::other(format!(
                "its {} {} lock on descriptor {} ({:?}): {}",
                l.kind,
                if l.write { "write" } else { "read" },
                e.fd,
                e.target,
                std::io::Error::from_raw_os_error(-r as i32)
            )),
        });
    }
    Ok(())
}

/// Maps `m.path` (as `t` sees it) over the mapping it replaces, shared.
fn map_again(t: &mut Tracee, m: &MapFix) -> Result<(), ProcError> {
    let at = scratch_path(t, 0, &m.path)?;
    let flags = if m.prot & libc::PROT_WRITE as u64 != 0 {
        libc::O_RDWR
    } else {
        libc::O_RDONLY
    };
    let fd = t.syscall(
        "openat(shared mapping)",
        libc::SYS_openat,
        [
            libc::AT_FDCWD as u64,
            at,
            (flags | libc::O_CLOEXEC) as u64,
            0,
            0,
            0,
        ],
    )?;
    let mapped = t.syscall_raw(
        libc::SYS_mmap,
        [
            m.start,
            m.end - m.start,
            m.prot,
            (libc::MAP_SHARED | libc::MAP_FIXED) as u64,
            fd,
            m.offset,
        ],
    );
    t.syscall("close", libc::SYS_close, [fd, 0, 0, 0, 0, 0])?;
    crate::ptrace::check(t.pid(), "mmap(shared mapping)", mapped?)?;
    Ok(())
}

fn apply_fix(t: &mut Tracee, fix: &FdFix) -> Result<(), ProcError> {
    match fix {
        FdFix::Seek { fd, pos } => {
            lseek(t, *fd, *pos)?;
        }
        FdFix::Reopen {
            fd,
            path,
            flags,
            pos,
        } => {
            let at = scratch_path(t, 0, path)?;
            let open_flags = (*flags as i32) & !(libc::O_CREAT | libc::O_EXCL | libc::O_TRUNC);
            let new = t.syscall(
                "openat",
                libc::SYS_openat,
                [libc::AT_FDCWD as u64, at, open_flags as u64, 0, 0, 0],
            )?;
            if new != *fd as u64 {
                let cloexec = (*flags as i32) & libc::O_CLOEXEC;
                t.syscall(
                    "dup3",
                    libc::SYS_dup3,
                    [new, *fd as u64, cloexec as u64, 0, 0, 0],
                )?;
                t.syscall("close", libc::SYS_close, [new, 0, 0, 0, 0, 0])?;
            }
            lseek(t, *fd, *pos)?;
        }
        FdFix::ReopenFifo { fd, path, flags } => {
            // Read-write and non-blocking: the open waits for no peer, and a
            // reader does not see an end of file while its writer is gone.
            let at = scratch_path(t, 0, path)?;
            let open = (libc::O_RDWR | libc::O_NONBLOCK | libc::O_CLOEXEC) as u64;
            let new = t.syscall(
                "openat(FIFO)",
                libc::SYS_openat,
                [libc::AT_FDCWD as u64, at, open, 0, 0, 0],
            )?;
            let cloexec = (*flags as i32) & libc::O_CLOEXEC;
            if new != *fd as u64 {
                t.syscall(
                    "dup3",
                    libc::SYS_dup3,
                    [new, *fd as u64, cloexec as u64, 0, 0, 0],
                )?;
                t.syscall("close", libc::SYS_close, [new, 0, 0, 0, 0, 0])?;
            }
            // Its status flags back (O_NONBLOCK as it had them).
            let status = (*flags as i32) & (libc::O_NONBLOCK | libc::O_APPEND);
            t.syscall(
                "fcntl(F_SETFL)",
                libc::SYS_fcntl,
                [*fd as u64, libc::F_SETFL as u64, status as u64, 0, 0, 0],
            )?;
        }
    }
    Ok(())
}

/// Sets a descriptor's offset; one that has none (a FIFO opened by path) is left alone.
fn lseek(t: &mut Tracee, fd: i32, pos: u64) -> Result<(), ProcError> {
    let r = t.syscall_raw(
        libc::SYS_lseek,
        [fd as u64, pos, libc::SEEK_SET as u64, 0, 0, 0],
    )?;
    if r != -(libc::ESPIPE as i64) {
        crate::ptrace::check(t.pid(), "lseek", r)?;
    }
    Ok(())
}

/// The fixes a rollback needs. With `reopen_below` (a sandbox's workspace),
/// the files under it are opened again at their offsets (a restore may have
/// replaced them) and every other descriptor is left alone: what lies
/// outside the workspace (a log, a terminal) is not rolled back. Without it,
/// every regular file's shared offset is set back.
pub fn fixes_for(fds: &[FdEntry], reopen_below: Option<&std::path::Path>) -> Vec<FdFix> {
    fds.iter()
        .filter_map(|e| match (&e.target, reopen_below) {
            (FdTarget::Path { path }, Some(root)) if path.starts_with(root) => {
                Some(FdFix::Reopen {
                    fd: e.fd,
                    path: path.clone(),
                    flags: e.flags,
                    pos: e.pos,
                })
            }
            (FdTarget::Path { path }, None) if !path.starts_with("/dev/") => Some(FdFix::Seek {
                fd: e.fd,
                pos: e.pos,
            }),
            _ => None,
        })
        .collect()
}

/// Kills a template (eviction).
pub fn discard(tpl: &Template) {
    if template_alive(tpl) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(tpl.pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

/// Kills a process the caller is the parent of (a clone made with
/// `parent: true` from a template the caller's child made) and reaps it.
pub fn kill_and_reap(pid: u32) {
    let p = nix::unistd::Pid::from_raw(pid as i32);
    if nix::sys::signal::kill(p, nix::sys::signal::Signal::SIGKILL).is_ok() {
        let _ = nix::sys::wait::waitpid(p, None);
    }
}

/// `MADV_COLLAPSE` (since Linux 6.1).
const MADV_COLLAPSE: u64 = 25;

/// Collapses the template's anonymous memory into huge pages (`MADV_COLLAPSE`,
/// injected into the parked template), so that processes made from it copy
/// one entry per 2 MiB instead of one per 4 KiB. The collapsed pages are the
/// template's own copies: it then holds that memory privately. Returns the
/// bytes of the regions asked for; regions the kernel refuses (marked
/// `MADV_NOHUGEPAGE`, or not fully mapped) are left as they are.
pub fn collapse(tpl: &Template) -> Result<u64, ProcError> {
    let mut t = seize_template(tpl)?;
    let maps_path = PathBuf::from(format!("/proc/{}/maps", tpl.pid));
    let maps = crate::inspect::read_proc(tpl.pid, &maps_path)?;
    const HUGE: u64 = 2 << 20;
    let regions: Vec<(u64, u64)> = maps
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let range = f.next()?;
            let perms = f.next()?;
            let inode = f.nth(2)?;
            // Private writable anonymous memory (the heap too); not the stack.
            let anon = inode == "0" && !l.ends_with("[stack]") && !l.contains("[v");
            if !(anon && perms.starts_with("rw") && perms.ends_with('p')) {
                return None;
            }
            let (a, b) = range.split_once('-')?;
            let (a, b) = (
                u64::from_str_radix(a, 16).ok()?,
                u64::from_str_radix(b, 16).ok()?,
            );
            // Whole huge pages inside the region only.
            let (start, end) = (a.div_ceil(HUGE) * HUGE, b / HUGE * HUGE);
            (end > start).then_some((start, end - start))
        })
        .collect();
    let mut bytes = 0;
    for (start, len) in regions {
        if t.syscall_raw(libc::SYS_madvise, [start, len, MADV_COLLAPSE, 0, 0, 0])? == 0 {
            bytes += len;
        }
    }
    t.park()?;
    Ok(bytes)
}

/// `clone3` flags for a copy in namespaces of its own: a user namespace (in
/// which it holds every capability, though the template holds few), and PID,
/// mount, UTS and IPC namespaces owned by it (network: see [`Nest::new_net`]).
const NEW_NAMESPACES: u64 = 0x1000_0000 // CLONE_NEWUSER
    | 0x2000_0000 // CLONE_NEWPID
    | 0x0002_0000 // CLONE_NEWNS
    | 0x0400_0000 // CLONE_NEWUTS
    | 0x0800_0000; // CLONE_NEWIPC
const CLONE_NEWNET: u64 = 0x4000_0000;

/// How to make a [`Nested`] copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Nest {
    /// The process's PID in the new PID namespace (its origin's, usually).
    pub pid: u32,
    /// The capabilities the process keeps (a bit per capability number).
    pub keep_caps: u64,
    /// A network namespace of its own too (else the template's).
    pub new_net: bool,
}

/// A copy of a template in namespaces of its own, both stopped: `init`, PID 1
/// of a new PID namespace (nested in the template's), whose user namespace
/// maps every ID to itself, and which holds every capability there (it is to
/// become the namespaces' init, which finishes their setup); and `process`,
/// its child, at [`Nest::pid`] there, back at the checkpoint, holding only
/// [`Nest::keep_caps`] and `no_new_privs`. The caller makes `init` the
/// namespaces' init and lets `process` run (see [`Copies::finish`] for what
/// a copy needs); dropped unfinished, both are killed.
#[derive(Debug)]
pub struct Nested {
    init: Option<Tracee>,
    process: Option<Tracee>,
}

impl Nested {
    /// Their host PIDs: (init, process).
    pub fn pids(&self) -> (u32, u32) {
        let pid = |t: &Option<Tracee>| t.as_ref().map_or(0, Tracee::pid);
        (pid(&self.init), pid(&self.process))
    }

    /// Both, for the caller to finish: (init, process).
    pub fn into_parts(mut self) -> (Tracee, Tracee) {
        (
            self.init.take().expect("present until taken"),
            self.process.take().expect("present until taken"),
        )
    }
}

impl Drop for Nested {
    fn drop(&mut self) {
        // The init last: its end would kill the process anyway.
        for t in [self.process.take(), self.init.take()]
            .into_iter()
            .flatten()
        {
            t.kill();
        }
    }
}

/// Makes a [`Nested`] copy of `tpl`: an injected `clone3` with
/// [`NEW_NAMESPACES`] (no privilege needed: a new user namespace grants its
/// own), the identity ID maps written from here; the new init clones the
/// process with `set_tid` [`Nest::pid`], which then gives up every capability
/// not kept (bounding, permitted, effective and inheritable sets) and sets
/// `no_new_privs`. The new PID namespace lives only as long as the
/// template's (it is nested in it).
pub fn clone_nested(tpl: &Template, nest: &Nest) -> Result<Nested, ProcError> {
    let mut t = seize_template(tpl)?;
    let regs = *t.saved_regs();
    let flags = NEW_NAMESPACES | if nest.new_net { CLONE_NEWNET } else { 0 };
    let made = (|| {
        let args = clone_args(flags | CLONE_PARENT, 0, 0);
        let at = t.scratch(64, &args)?;
        t.clone3(at, CLONE_ARGS_SIZE)
    })();
    // From here on an error drops `nested`, which kills what it holds.
    let mut nested = Nested {
        init: None,
        process: None,
    };
    let mapped = made.and_then(|init| {
        let pid = init.pid();
        nested.init = Some(init);
        write_id_maps(&mut t, pid)
    });
    t.park()?;
    mapped?;
    let init = nested.init.as_mut().expect("just set");
    init.set_saved_regs(regs);
    let mut process = inject_fork(init, false, Some(nest.pid))?;
    process.set_saved_regs(regs);
    let process = nested.process.insert(process);
    drop_capabilities(process, nest.keep_caps)?;
    Ok(nested)
}

/// An ID map (`uid_map` text) of a namespace nested in one whose map is
/// `parent`: each ID the parent has, mapped to itself.
fn identity_over(parent: &str) -> String {
    let mut out = String::new();
    for line in parent.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if let [inner, _, count] = f[..] {
            out.push_str(&format!("{inner} {inner} {count}\n"));
        }
    }
    if out.is_empty() {
        out.push_str("0 0 4294967295\n");
    }
    out
}

/// Writes the identity ID maps of `pid`, a copy `t` made in a new user
/// namespace. Only a process of the parent user namespace may: from here
/// when that is the host's (the template's sandbox has none of its own),
/// else from the template itself (injected; it keeps `CAP_SETUID` and
/// `CAP_SETGID` in its own).
fn write_id_maps(t: &mut Tracee, pid: u32) -> Result<(), ProcError> {
    for (file, step) in [("uid_map", "write uid_map"), ("gid_map", "write gid_map")] {
        // Identity over the IDs the template's namespace has: all of them
        // on the host, a sandbox's range in a sandbox's user namespace.
        let parent = std::fs::read_to_string(format!("/proc/{}/{file}", t.pid()))
            .map_err(|source| ProcError::Ptrace { pid, step, source })?;
        let map = identity_over(&parent);
        let map = map.as_bytes();
        let err = match std::fs::write(format!("/proc/{pid}/{file}"), map) {
            Ok(()) => continue,
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => e,
            Err(source) => return Err(ProcError::Ptrace { pid, step, source }),
        };
        // The copy's PID as the template's namespace sees it.
        let Some(there) = pid_seen_by(pid, t.pid()) else {
            return Err(ProcError::Ptrace {
                pid,
                step,
                source: err,
            });
        };
        let path_at = scratch_path(t, 0, std::path::Path::new(&format!("/proc/{there}/{file}")))?;
        let map_at = t.scratch(128, map)?;
        let fd = t.syscall(
            "openat(ID map)",
            libc::SYS_openat,
            [
                libc::AT_FDCWD as u64,
                path_at,
                (libc::O_WRONLY | libc::O_CLOEXEC) as u64,
                0,
                0,
                0,
            ],
        )?;
        let written = t.syscall_raw(libc::SYS_write, [fd, map_at, map.len() as u64, 0, 0, 0]);
        t.syscall("close", libc::SYS_close, [fd, 0, 0, 0, 0, 0])?;
        crate::ptrace::check(t.pid(), "write(ID map)", written?)?;
    }
    Ok(())
}

/// The PID host process `pid` has in the PID namespace of host process
/// `viewer` (which must be an ancestor namespace of `pid`'s).
fn pid_seen_by(pid: u32, viewer: u32) -> Option<u32> {
    use crate::inspect::ns_pids;
    let depth = ns_pids(viewer)?.len();
    ns_pids(pid)?.get(depth.checked_sub(1)?).copied()
}

/// `PR_CAPBSET_DROP`, `PR_SET_NO_NEW_PRIVS` and the capability ABI version 3.
const PR_CAPBSET_DROP: u64 = 24;
const PR_SET_NO_NEW_PRIVS: u64 = 38;
const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;

/// Injected into `t`: drops every capability not in `keep` from all its sets
/// and sets `no_new_privs`.
fn drop_capabilities(t: &mut Tracee, keep: u64) -> Result<(), ProcError> {
    for cap in 0..=u64::from(crate::inspect::last_cap()) {
        if keep & (1 << cap) == 0 {
            t.syscall(
                "prctl(PR_CAPBSET_DROP)",
                libc::SYS_prctl,
                [PR_CAPBSET_DROP, cap, 0, 0, 0, 0],
            )?;
        }
    }
    // struct __user_cap_header_struct { u32 version; i32 pid } and two
    // struct __user_cap_data_struct { u32 effective, permitted, inheritable }.
    let mut block = Vec::with_capacity(32);
    block.extend_from_slice(&LINUX_CAPABILITY_VERSION_3.to_le_bytes());
    block.extend_from_slice(&0i32.to_le_bytes());
    for half in [keep as u32, (keep >> 32) as u32] {
        for set in [half, half, 0] {
            block.extend_from_slice(&set.to_le_bytes());
        }
    }
    let at = t.scratch(0, &block)?;
    t.syscall("capset", libc::SYS_capset, [at, at + 8, 0, 0, 0, 0])?;
    t.syscall(
        "prctl(PR_SET_NO_NEW_PRIVS)",
        libc::SYS_prctl,
        [PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0, 0],
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::identity_over;

    #[test]
    fn nested_id_maps_are_the_identity_over_the_parents_ids() {
        // The host's namespace: everything.
        assert_eq!(
            identity_over("         0          0 4294967295\n"),
            "0 0 4294967295\n"
        );
        // A sandbox's: its 65536 IDs, whatever they are on the host.
        assert_eq!(
            identity_over("         0 1073741824      65536\n"),
            "0 0 65536\n"
        );
        assert_eq!(identity_over(""), "0 0 4294967295\n");
    }
}
