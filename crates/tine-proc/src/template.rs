//! Templates: copy-on-write copies of a process made by an injected fork and
//! parked stopped; and processes brought back from them.
//!
//! A template is made a child of its origin's parent (`CLONE_PARENT`; in a
//! sandbox that is its init), so the program never sees an extra child, and
//! put in a session of its own, so a terminal hanging up on the origin's
//! session never wakes it. A process made from a template gets the template's
//! memory and registers (which are the origin's at the checkpoint), becomes a
//! session leader again, takes back its terminal, and gets its descriptors
//! fixed up as the caller asks (offsets reset, workspace files reopened:
//! `fixes`), its threads back (`threads`) and its kernel objects made anew
//! where asked (`objects`). Copies in namespaces of their own: `nest`.

use std::path::PathBuf;

use nix::libc;
use serde::{Deserialize, Serialize};

use crate::fdtable::FdEntry;
use crate::fixes::{apply_fix, lock_again, map_again, tty_fd};
use crate::inspect::{ProcError, cloneable, stat};
use crate::ptrace::Tracee;

pub use crate::fixes::{FdFix, MapFix, fixes_for, shared_maps};
pub use crate::nest::{IdWriter, Nest, Nested, clone_nested};

/// A parked template and what a process made from it must get back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Template {
    /// The template's PID (as the caller's PID namespace sees it).
    pub pid: u32,
    /// Its start time, so a reused PID is never taken for it.
    pub start_time: u64,
    /// The process it was made from.
    pub origin: u32,
    /// The origin's start time (0: not recorded), so that a rollback can
    /// tell the origin from a process that took its PID since.
    #[serde(default)]
    pub origin_start: u64,
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
    /// How long the injected fork that made it took, in µs: the floor of a
    /// checkpoint's pause (the kernel copying the page tables).
    #[serde(default)]
    pub fork_us: u64,
    /// The origin's mappings marked `MADV_DONTFORK`/`MADV_WIPEONFORK`:
    /// cleared in the template (it holds their content), set again in
    /// every copy.
    #[serde(default)]
    pub fork_flags: crate::forkflags::ForkFlags,
    /// What its pipes and Unix stream sockets held at the checkpoint, by the
    /// descriptor each is read from (hex): written into the ones a copy
    /// makes anew.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub queued: std::collections::BTreeMap<i32, String>,
    /// Shared memory (anonymous, memfd, `/dev/shm`) copied at the checkpoint
    /// into memfds of the template's own; each copy copies it again.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shm: Vec<crate::shm::ShmObject>,
    /// Its main thread's signal mask, the one its copies start with. Parked,
    /// it blocks every signal it can instead (see
    /// `Tracee::block_signals_when_parked`); seized, it gets this back.
    /// `None` (a record from before): it is parked with this mask.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sigmask: Option<u64>,
    /// It stayed in its origin's session and process group (an origin that
    /// does not lead its session: [`make_template_in_session`]), and so do
    /// the copies made from it, instead of each leading a session of its own.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub in_origin_session: bool,
}

fn dumpable_default() -> u64 {
    1
}

/// `how.remake` without the objects template `tpl`'s descriptions still
/// hold as recorded, when `how` keeps those ([`Respawn::keep_unchanged`]):
/// what a rollback in place makes anew. Read once nothing else that shares
/// them runs (all stopped or killed).
pub fn still_to_make(tpl: &Template, how: &Respawn) -> Vec<crate::objects::Remake> {
    if how.keep_unchanged {
        crate::unchanged::still_to_make(tpl.pid, &tpl.fds, &how.remake)
    } else {
        how.remake.clone()
    }
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
    /// Leave the objects of `remake` whose template's descriptions still
    /// hold the checkpoint's state as they are (a rollback in place, where
    /// the origin is gone; never a copy beside its origin).
    pub keep_unchanged: bool,
}

/// `CLONE_PARENT`: the new process is a sibling of the caller.
pub(crate) const CLONE_PARENT: u64 = 0x0000_8000;

/// Encodes `struct clone_args` (include/uapi/linux/sched.h) up to
/// `set_tid_size`: 80 bytes, `CLONE_ARGS_SIZE_VER1`.
pub(crate) fn clone_args(flags: u64, set_tid_addr: u64, set_tid_size: u64) -> Vec<u8> {
    // With CLONE_PARENT the kernel takes the caller's own exit signal (and
    // refuses any other).
    let exit_signal = if flags & CLONE_PARENT != 0 {
        0
    } else {
        libc::SIGCHLD as u64
    };
    clone_args_with(flags, exit_signal, set_tid_addr, set_tid_size)
}

/// [`clone_args`] with the signal the parent gets at the child's end.
pub(crate) fn clone_args_with(
    flags: u64,
    exit_signal: u64,
    set_tid_addr: u64,
    set_tid_size: u64,
) -> Vec<u8> {
    let fields: [u64; 10] = [
        flags,
        0, // pidfd
        0, // child_tid
        0, // parent_tid
        exit_signal,
        0,            // stack
        0,            // stack_size
        0,            // tls
        set_tid_addr, // set_tid
        set_tid_size, // set_tid_size
    ];
    fields.iter().flat_map(|f| f.to_le_bytes()).collect()
}

/// Where a template goes in the process tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hop {
    /// A sibling of its origin (`CLONE_PARENT`): for a child of the
    /// sandbox's init, which reaps it.
    Sibling,
    /// Handed to the PID namespace's reaper (init) through a short-lived
    /// process sharing the origin's memory: for a process whose parent is
    /// another program (a shell's command, a pool's worker), which must
    /// never see the template among its children.
    Orphan,
    /// The origin's own child: for the init of a PID namespace (a
    /// container's first process), which may make no sibling and is its
    /// own reaper. A program that waits for any child never sees it end.
    Child,
}

/// Injects `clone3` into `t` and returns the new process, stopped.
pub(crate) fn inject_fork(
    t: &mut Tracee,
    parent: bool,
    set_tid: Option<u32>,
) -> Result<Tracee, ProcError> {
    let flags = if parent { CLONE_PARENT } else { 0 };
    let (tid_addr, tid_size) = match set_tid {
        Some(tid) => (t.scratch(0, &(tid as i32).to_le_bytes())?, 1),
        None => (0, 0),
    };
    t.clone3(&clone_args(flags, tid_addr, tid_size))
}

/// Makes a template of the stopped process `t`: checks that a fork copies it
/// faithfully, records its descriptors, forks it and parks the copy.
/// `t` stays stopped; the caller lets it go.
pub fn make_template(t: &mut Tracee) -> Result<Template, ProcError> {
    let (tpl, unsettled) = fork_template(t, &mut [], None)?;
    unsettled.settle()?;
    Ok(tpl)
}

/// [`make_template`] for a process that does not lead its session (one
/// tine did not start, a child of a shell or a container's init): the
/// template stays in that session and process group, parked with its
/// signals blocked, and the copies made from it are in them too (a signal
/// to the group that cannot be blocked, SIGKILL, reaches the template).
pub fn make_template_in_session(t: &mut Tracee) -> Result<Template, ProcError> {
    make_template_among(
        t,
        &mut [],
        &[],
        Placement::BesideInSession,
        &mut Default::default(),
    )
}

/// Where the template of a process tine did not start goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// Beside it (its parent's child), in a session of its own.
    Beside,
    /// Beside it, in its session and process group (see
    /// [`make_template_in_session`]).
    BesideInSession,
    /// Its own child, in a session of its own: for the init of a PID
    /// namespace (a container's first process), which may make no sibling.
    Child,
}

/// The template of stopped process `t` (its other threads in `others`),
/// the root of a tree whose processes are `members` (its live children
/// among them need not be brought along: their own templates are made),
/// placed as `placement` says. `tree`: the shared memory of the tree's
/// templates so far.
pub fn make_template_among(
    t: &mut Tracee,
    others: &mut [Tracee],
    members: &[u32],
    placement: Placement,
    tree: &mut crate::shm::TreeShm,
) -> Result<Template, ProcError> {
    crate::inspect::cloneable_in(t.pid(), members, false)?;
    let hop = match placement {
        Placement::Child => Hop::Child,
        Placement::Beside | Placement::BesideInSession => Hop::Sibling,
    };
    let (mut tpl, mut unsettled) = fork_template_via(t, others, None, hop, tree, None)?;
    if placement == Placement::BesideInSession {
        tpl.in_origin_session = true;
        // Parked as it is, in its origin's session.
        unsettled.1 = Session::Has;
    }
    unsettled.settle()?;
    Ok(tpl)
}

/// A template just forked, its memory already out of the sandbox's reach,
/// that still needs a session of its own and parking: work that can wait
/// until its origin runs again. Dropped unsettled, it is killed.
#[derive(Debug)]
#[must_use = "an unsettled template is killed when dropped"]
pub struct Unsettled(Option<Tracee>, Session);

/// Whether a template still needs a session of its own (a spare made into
/// a template has one: `spare`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Session {
    Needed,
    Has,
}

/// What preparing a template made ([`prepare_parked`]).
#[derive(Debug, Default)]
pub struct Settled {
    /// The template's PID.
    pub pid: u32,
    /// What a graft of it reads (`graft::source_of`), when asked for.
    pub source: Option<crate::graft::SourceRecord>,
    /// A spare copy of it made for the next checkpoint, when asked for.
    pub spare: Option<crate::spare::Spare>,
}

impl Unsettled {
    pub(crate) fn new(child: Tracee, session: Session) -> Unsettled {
        Unsettled(Some(child), session)
    }

    /// Gives it a session of its own (signals to its origin's group or
    /// session no longer reach it) and parks it.
    pub fn settle(mut self) -> Result<(), ProcError> {
        let mut child = self.0.take().expect("settled once");
        if self.1 == Session::Needed
            && let Err(e) = child.syscall("setsid", libc::SYS_setsid, [0; 6])
        {
            child.kill();
            return Err(e);
        }
        child.park()
    }

    /// The template's PID.
    pub fn pid(&self) -> u32 {
        self.0.as_ref().map_or(0, Tracee::pid)
    }
}

/// Prepares a settled (parked) template for what comes after its
/// checkpoint — work a checkpoint leaves for after it returns: seized
/// again, it gives what a graft of it reads (`graft::source_of`) when
/// `source` (none when that cannot be read: a graft then reads it itself)
/// and a spare copy of it (`spare::make`) when `spare()` says so once the
/// source is read (none when that fails: the next checkpoint forks); then
/// it is parked again.
pub fn prepare_parked(
    tpl: &Template,
    source: bool,
    spare: &dyn Fn() -> bool,
) -> Result<Settled, ProcError> {
    let mut t = seize_template(tpl)?;
    let source = if source {
        crate::graft::source_of(&mut t, true).ok()
    } else {
        None
    };
    let spare = if spare() {
        crate::spare::make(&mut t).ok()
    } else {
        None
    };
    t.park().map(|()| Settled {
        pid: tpl.pid,
        source,
        spare,
    })
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
    cloneable(t.pid())?;
    fork_template_via(
        t,
        others,
        flags,
        Hop::Sibling,
        &mut Default::default(),
        None,
    )
}

/// [`fork_template`], the template placed in the tree as `hop` says.
/// `tree`: the shared memory the templates of the same checkpoint copied
/// already (an object shared by processes stays shared by their templates).
/// `maps`: `t`'s `/proc/PID/maps` text where it was read since `t` stopped
/// (and nothing changed its mappings since), else read here.
pub fn fork_template_via(
    t: &mut Tracee,
    others: &mut [Tracee],
    flags: Option<&crate::forkflags::Scan>,
    hop: Hop,
    tree: &mut crate::shm::TreeShm,
    maps: Option<String>,
) -> Result<(Template, Unsettled), ProcError> {
    let _here = crate::ptrace::hold_here();
    let o = origin_state(t, others, flags, maps)?;
    let (fds, fork_flags, shm) = (&o.fds, &o.fork_flags, &o.shm);
    crate::forkflags::clear(t, fork_flags)?;
    let fork_started = std::time::Instant::now();
    let forked = match hop {
        Hop::Sibling => inject_fork(t, true, None),
        Hop::Orphan => inject_orphan_fork(t),
        Hop::Child => inject_fork(t, false, None),
    };
    let fork_us = fork_started.elapsed().as_micros() as u64;
    let marked = crate::forkflags::set(t, fork_flags);
    let mut child = forked?;
    if let Err(e) = marked {
        child.kill();
        return Err(e);
    }
    // The copy continues (when a process is made from it) where `t` was stopped.
    child.set_saved_regs(*t.saved_regs());
    // A parked template must not keep its origin's flocks and OFD locks
    // held (a program that takes one again after closing it would wait for
    // ever): it gets descriptions of its own, without locks.
    let own = fds
        .iter()
        .filter(|e| e.locks.iter().any(crate::fixes::held_by_description))
        .try_for_each(|e| crate::fixes::own_description(&mut child, e))
        // The origin's shared memory as it is now, which it goes on writing.
        .and_then(|()| crate::shm::make_private_in(&mut child, shm, tree, above(fds), false));
    if let Err(err) = own {
        child.kill();
        return Err(err);
    }
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
    let tpl = o.template(&mut child, start_time, t, dumpable, fork_us);
    Ok((tpl, Unsettled::new(child, Session::Needed)))
}

/// What a template records of its origin `t` (stopped, its other threads
/// in `others`) besides its memory, read inside the checkpoint's pause.
pub(crate) struct Origin {
    pub st: crate::inspect::Stat,
    pub threads: Vec<crate::threads::ThreadState>,
    pub robust_list: (u64, u64),
    pub fds: Vec<FdEntry>,
    pub cwd: Option<PathBuf>,
    pub fork_flags: crate::forkflags::ForkFlags,
    pub shm: Vec<crate::shm::ShmObject>,
    pub queued: std::collections::BTreeMap<i32, String>,
    /// Its `/proc/PID/maps` text, as all of the above was read.
    pub maps: String,
}

impl Origin {
    /// The record of template `child` (held; started at `start`) of origin
    /// `t`: this state, its dumpable flag, how long the fork that made its
    /// memory took, and its signal mask (then blocked once it is parked).
    pub(crate) fn template(
        self,
        child: &mut Tracee,
        start: u64,
        t: &Tracee,
        dumpable: u64,
        fork_us: u64,
    ) -> Template {
        let origin = t.pid();
        let sigmask = crate::raw::get_sigmask(child.pid()).ok();
        if sigmask.is_some() {
            child.block_signals_when_parked();
        }
        Template {
            pid: child.pid(),
            sigmask,
            start_time: start,
            origin,
            origin_start: self.st.start_time,
            has_tty: self.st.tty_nr != 0,
            foreground: self.st.tty_nr != 0 && self.st.tpgid == origin as i32,
            syscall_at: t.syscall_at(),
            fds: self.fds,
            cwd: self.cwd,
            dumpable,
            threads: self.threads,
            robust_list: self.robust_list,
            fork_us,
            fork_flags: self.fork_flags,
            queued: self.queued,
            shm: self.shm,
            in_origin_session: false,
        }
    }
}

pub(crate) fn origin_state(
    t: &mut Tracee,
    others: &mut [Tracee],
    flags: Option<&crate::forkflags::Scan>,
    maps: Option<String>,
) -> Result<Origin, ProcError> {
    let pid = t.pid();
    // The caller checked its place in the tree (`cloneable`, or
    // `cloneable_in` for a process tree).
    let st = crate::inspect::cloneable_member(pid)?;
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
        .map(|o| {
            o.share_memory_of(t);
            crate::threads::capture(o)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let robust_list = crate::raw::get_robust_list(pid).unwrap_or_default();
    let fds = crate::fdtable::fd_table_with(pid, t.fdinfos())?;
    let cwd = std::fs::read_link(format!("/proc/{pid}/cwd")).ok();
    // Its map read once for all that looks at it (numpy's 185 mappings as
    // text: 0.22 ms a reading), or given, read since it stopped.
    let maps = match maps {
        Some(m) => m,
        None => crate::inspect::maps_text(pid)?,
    };
    // What a fork would leave out or zero is copied whole, then marked again.
    let fork_flags = crate::forkflags::current(pid, &maps, flags)?;
    let shm = crate::shm::objects(pid, &maps)?;
    let queued = crate::queued::at_checkpoint(pid, &fds)
        .map_err(|e| ProcError::read(pid, &PathBuf::from(format!("/proc/{pid}/fd")), e))?;
    Ok(Origin {
        st,
        threads,
        robust_list,
        fds,
        cwd,
        fork_flags,
        shm,
        queued,
        maps,
    })
}

/// A descriptor number above every one of `fds`.
pub(crate) fn above(fds: &[FdEntry]) -> i32 {
    fds.iter().map(|e| e.fd).max().unwrap_or(2).max(2) + 1
}

/// `CLONE_VM`.
pub(crate) const CLONE_VM: u64 = libc::CLONE_VM as u64;

/// Forks `t` into a process that ends up a child of the PID namespace's
/// reaper: `t` makes a go-between sharing its memory (`CLONE_VM`, so no page
/// table is copied; no exit signal, so `t` is never told), the go-between
/// forks the copy and exits, and `t` reaps it (an injected `wait4`). The
/// copy is returned stopped. Refused when an ancestor of `t` is a child
/// subreaper, which would be given the copy instead.
fn inject_orphan_fork(t: &mut Tracee) -> Result<Tracee, ProcError> {
    let mut between = t.clone3(&clone_args_with(CLONE_VM, 0, 0, 0))?;
    let between_ns = ns_pid(between.pid());
    let copy = inject_fork(&mut between, false, None);
    between.exit();
    // Its parent reaps it (it may have been reaped already: SIGCHLD ignored).
    if let Some(ns) = between_ns {
        let r = t.syscall_raw(
            libc::SYS_wait4,
            [ns as u64, 0, libc::__WALL as u64, 0, 0, 0],
        )?;
        if r < 0 && r != -(libc::ECHILD as i64) {
            if let Ok(c) = copy {
                c.kill();
            }
            return Err(ProcError::Injected {
                pid: t.pid(),
                call: "wait4",
                source: std::io::Error::from_raw_os_error(-r as i32),
            });
        }
    }
    let copy = copy?;
    let reaper = crate::inspect::stat(copy.pid())?.ppid;
    let origin = crate::inspect::stat(t.pid())?;
    // (A tracer that made itself the subreaper, as tests do, gets it too.)
    if ns_pid(reaper) != Some(1) && reaper != std::process::id() {
        let who = crate::inspect::cmdline(reaper);
        copy.kill();
        return Err(ProcError::NotCloneable(crate::inspect::NotCloneable::of(
            t.pid(),
            crate::inspect::cmdline(t.pid()),
            format!(
                "its ancestor {} ({who}) is a child subreaper, which would see its template (parent {})",
                crate::inspect::ShownPid(reaper),
                origin.ppid
            ),
        )));
    }
    Ok(copy)
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
///
/// Its own signal mask is put back (parked, it blocks every signal; parked
/// again, it does again).
pub(crate) fn seize_template(tpl: &Template) -> Result<Tracee, ProcError> {
    seize_parked(&Parked::of(tpl))
}

/// What seizing a parked template takes of it: a few words, sent to
/// another tracer thread (`pusher`) instead of the whole record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Parked {
    pub pid: u32,
    start_time: u64,
    syscall_at: u64,
    sigmask: Option<u64>,
}

impl Parked {
    pub fn of(tpl: &Template) -> Parked {
        Parked {
            pid: tpl.pid,
            start_time: tpl.start_time,
            syscall_at: tpl.syscall_at,
            sigmask: tpl.sigmask,
        }
    }
}

/// [`seize_template`] of the template `p` names.
pub(crate) fn seize_parked(p: &Parked) -> Result<Tracee, ProcError> {
    if !stat(p.pid).is_ok_and(|s| s.start_time == p.start_time && !s.exiting()) {
        return Err(ProcError::TemplateGone { pid: p.pid });
    }
    let mut t = if p.syscall_at != 0 {
        Tracee::seize_at(p.pid, p.syscall_at)?
    } else {
        Tracee::seize(p.pid)?
    };
    if let Some(mask) = p.sigmask {
        t.block_signals_when_parked();
        if let Err(source) = crate::raw::set_sigmask(p.pid, mask) {
            // Parked again (dropped, it would run).
            let _ = t.park();
            return Err(ProcError::Ptrace {
                pid: p.pid,
                step: "put its signal mask back",
                source,
            });
        }
    }
    Ok(t)
}

/// Template `tpl` parked with its own signal mask (for a tool that reads
/// it whole, CRIU's dump) until the guard is dropped: then it blocks every
/// signal again.
pub fn exposed(tpl: &Template) -> Result<Exposed<'_>, ProcError> {
    let mut t = seize_template(tpl)?;
    t.leave_signals_when_parked();
    t.park()?;
    Ok(Exposed(tpl))
}

/// See [`exposed`].
#[derive(Debug)]
pub struct Exposed<'a>(&'a Template);

impl Drop for Exposed<'_> {
    fn drop(&mut self) {
        if self.0.sigmask.is_some()
            && let Ok(t) = seize_template(self.0)
        {
            let _ = t.park();
        }
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
}

impl Copies<'_> {
    /// Their PIDs (as the caller's namespace sees them).
    pub fn pids(&self) -> Vec<u32> {
        self.made.iter().map(|(c, _)| c.pid()).collect()
    }

    /// Gives each copy its own state (a session, fixed descriptors, its
    /// terminal) and lets it run; returns their PIDs. A copy that cannot be
    /// finished is killed, and so are the ones after it: half made (its
    /// descriptors not fixed), it must not run.
    pub fn finish(mut self) -> Result<Vec<u32>, ProcError> {
        let _here = crate::ptrace::hold_here();
        let mut pids = Vec::with_capacity(self.made.len());
        let mut made = std::mem::take(&mut self.made).into_iter();
        while let Some((mut child, how)) = made.next() {
            let done = finish_copy(&mut child, self.tpl, how);
            let threads = done
                .and_then(|()| own_threads(&mut child, self.tpl))
                .and_then(|mut t| {
                    child.make_later_calls()?;
                    crate::creds::match_template(&mut child, &mut t, self.tpl, u64::MAX)?;
                    Ok(t)
                });
            let threads = match threads {
                Ok(t) => t,
                Err(e) => {
                    child.kill();
                    made.for_each(|(c, _)| c.kill());
                    return Err(e);
                }
            };
            pids.push(child.pid());
            // (Its other threads first, as `tree` lets them go.)
            for t in threads {
                t.resume()?;
            }
            child.resume()?;
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
    own_files(child, tpl, how, None)
}

/// A copy's threads: its main one's robust list, and the origin's other
/// threads made again (stopped; the caller lets them go after the main one).
pub fn own_threads(child: &mut Tracee, tpl: &Template) -> Result<Vec<Tracee>, ProcError> {
    own_threads_keeping(child, tpl, Vec::new()).map(|(made, _)| made)
}

/// [`own_threads`] for a process rolled back in place, whose threads of the
/// checkpoint that still run (`kept`, stopped, each with its index in
/// `tpl.threads`) are set back to their state then instead of made again
/// (see [`crate::threads::recreate_keeping`]: with the frames to write).
/// On an error every one of them is killed.
pub(crate) fn own_threads_keeping(
    child: &mut Tracee,
    tpl: &Template,
    kept: Vec<(Tracee, usize)>,
) -> Result<(Vec<Tracee>, Vec<crate::threads::Frame>), ProcError> {
    let shared = crate::forkflags::set(child, &tpl.fork_flags).and_then(|()| {
        // (One rolled back in place may have it already.)
        if crate::raw::get_robust_list(child.pid()).ok() != Some(tpl.robust_list) {
            crate::threads::set_robust_list(child, tpl.robust_list)
        } else {
            Ok(())
        }
    });
    if let Err(e) = shared {
        for (t, _) in kept {
            t.kill();
        }
        return Err(e);
    }
    crate::threads::recreate_keeping(child, &tpl.threads, kept)
}

/// A copy's session of its own (its PID as the id) and its origin's
/// dumpable flag back (templates are parked undumpable).
pub(crate) fn own_session(child: &mut Tracee, tpl: &Template) -> Result<(), ProcError> {
    if !tpl.in_origin_session {
        child.syscall("setsid", libc::SYS_setsid, [0; 6])?;
    }
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

/// What [`own_files`] must know of a copy in a process tree.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TreeCopy {
    /// It leads its session (and so takes its terminal back).
    pub leads_session: bool,
}

/// A copy's working directory, descriptors (`how.fds`) and terminal.
pub(crate) fn own_files(
    child: &mut Tracee,
    tpl: &Template,
    how: &Respawn,
    tree: Option<TreeCopy>,
) -> Result<(), ProcError> {
    // A tree's copies got their shared memory when they were made.
    let in_tree = tree.is_some();
    let leads_session = tree.is_none_or(|t| t.leads_session);
    if let Some(dir) = &how.chdir {
        let at = scratch_path(child, 0, dir)?;
        child.syscall("chdir", libc::SYS_chdir, [at, 0, 0, 0, 0, 0])?;
    }
    // Rolled back in place, a descriptor still open on the file it names
    // is left, its offset set back.
    let in_place = child.pid() == tpl.origin;
    // Descriptors opened again: one that shared its description with one
    // of them at the checkpoint (`> log 2>&1`) gets a copy of it, so that
    // their writes still follow each other instead of going over each other.
    let mut reopened: Vec<i32> = Vec::new();
    for fix in &how.fds {
        let entry = || tpl.fds.iter().find(|e| e.fd == fix.fd());
        match in_place
            .then(|| crate::fixes::open_as_before(child.pid(), fix, entry()))
            .flatten()
        {
            Some(Some(pos)) => crate::fixes::seek_later(child, fix.fd(), pos),
            Some(None) => {}
            None => match fix {
                FdFix::Reopen { fd, flags, .. } => {
                    let shared = reopened.iter().copied().find(|&o| {
                        crate::raw::same_file(tpl.pid, o, tpl.pid, *fd).unwrap_or(false)
                    });
                    match shared {
                        Some(o) => crate::fixes::dup_onto(child, o as u64, *fd, *flags)?,
                        None => {
                            apply_fix(child, fix)?;
                            reopened.push(*fd);
                        }
                    }
                }
                _ => apply_fix(child, fix)?,
            },
        }
    }
    for m in &how.maps {
        map_again(child, m)?;
    }
    if !in_tree {
        crate::shm::make_private(child, &tpl.shm, true)?;
    }
    if how.keep_unchanged {
        let plan = crate::unchanged::still_to_make(tpl.pid, &tpl.fds, &how.remake);
        crate::remake::remake(child, &plan)?;
    } else {
        crate::remake::remake(child, &how.remake)?;
    }
    // POSIX locks belong to the process: a fork does not inherit them. OFD
    // locks and flocks belong to the open file description: the copy takes
    // them through one of its own (reopened here unless `how.fds` did), so
    // that they go with it.
    for e in &tpl.fds {
        let reopened = how.fds.iter().any(
            |f| matches!(f, FdFix::Reopen { fd, .. } | FdFix::ReopenFifo { fd, .. } if *fd == e.fd),
        );
        if !reopened && e.locks.iter().any(crate::fixes::held_by_description) {
            crate::fixes::own_description(child, e)?;
        }
        for l in &e.locks {
            lock_again(child, e, l)?;
        }
    }
    // Only a session's leader takes its terminal (the others of a tree are
    // in that session already).
    if tpl.has_tty
        && leads_session
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

/// The PID `pid` has in its own (innermost) PID namespace.
pub fn ns_pid(pid: u32) -> Option<u32> {
    crate::inspect::ns_pids(pid)?.last().copied()
}

/// Writes `path` NUL-terminated into `t`'s scratch area, `below` bytes down
/// (see [`Tracee::scratch`]); returns its address.
pub(crate) fn scratch_path(
    t: &mut Tracee,
    below: u64,
    path: &std::path::Path,
) -> Result<u64, ProcError> {
    use std::os::unix::ffi::OsStrExt;
    let mut c = path.as_os_str().as_bytes().to_vec();
    c.push(0);
    t.scratch(below, &c)
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
    let maps = crate::inspect::maps_text(tpl.pid)?;
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
