//! Process trees brought back whole. A root (a child of the sandbox's init)
//! is cloned from its template as a single process is; every other process
//! is forked by its parent's copy before that copy ever runs — so it is that
//! copy's child, in its session and process group, as the kernel keeps
//! them — and its template grafted onto it (`graft`). Parents come before
//! their children; a process that led a session or a group of its own leads
//! it again. The copies run only once all of them are finished, children
//! first, so that no parent waits on a child not yet whole. A rollback
//! whose processes still live grafts each one's template onto the process
//! itself instead (`roll_back_tree`): it keeps its PID, parent and children.

use nix::libc;

use crate::graft::graft;
use crate::inspect::ProcError;
use crate::ptrace::Tracee;
use crate::shm::TreeShm;
use crate::template::{
    Respawn, Template, TreeCopy, above, inject_fork, own_files, own_session, seize_template,
};

/// One process of a tree to bring back.
#[derive(Debug, Clone)]
pub struct Member<'a> {
    pub tpl: &'a Template,
    /// Its PID (`set_tid`), descriptor fixes and objects made anew; a
    /// root's `parent` flag says whether it is a sibling of its template.
    pub how: &'a Respawn,
    /// Its parent among the members (an earlier index); `None`: a root.
    pub parent: Option<usize>,
    /// It led a session of its own (roots always do).
    pub leads_session: bool,
    /// The process group it joins (its PID in the innermost namespace)
    /// when it is neither the one it inherits nor its own new session's.
    pub pgid: Option<u32>,
    /// Its children that had ended, not reaped, at the checkpoint: (PID,
    /// wait status). Each is made again as a zombie with that status.
    pub zombies: &'a [(u32, i32)],
    /// It leads a session with a controlling terminal whose foreground
    /// process group was this (a PID in its namespace): given back.
    pub foreground: Option<u32>,
}

/// A tree's copies, made and stopped, not run yet. Dropped unfinished,
/// they are killed.
#[derive(Debug)]
pub struct TreeCopies<'a> {
    members: &'a [Member<'a>],
    made: Vec<Tracee>,
    /// Of each made in place, its threads of the checkpoint that still
    /// run, stopped, with their indexes in its template's threads.
    kept: Vec<Vec<(Tracee, usize)>>,
    /// The templates' shared memory mapped for a rollback's put-backs:
    /// unmapped by whoever takes it ([`TreeCopies::take_views`]), after the
    /// pause (PostgreSQL's 146 MB with 16 MB faulted in: ~1 ms).
    views: crate::shmback::Views,
    /// Put-backs of shared memory the second thread may still be making:
    /// seen through before any copy runs (apart from the views, which are
    /// taken to be unmapped after the pause).
    pending: crate::shmback::Pending,
    /// Of the pipes and socket pairs connecting the tree, those still to
    /// make, where worked out ahead ([`TreeCopies::with_shared_left`]).
    shared_left: Option<Vec<crate::treeobjects::Shared>>,
}

/// Of `shared` (the pipes and socket pairs connecting the tree of
/// `members`), those a rollback in place of every member must still make
/// ([`TreeCopies::fix`]), as work another thread may do once the rollback
/// killed what it kills (a pool's: 0.12 ms).
pub fn shared_left_of(
    members: &[Member<'_>],
    shared: &[crate::treeobjects::Shared],
) -> impl FnOnce() -> Vec<crate::treeobjects::Shared> + Send + 'static {
    let tpids: Vec<u32> = members.iter().map(|m| m.tpl.pid).collect();
    let shared = shared.to_vec();
    move || crate::unchanged::shared_still_to_make(&tpids, &shared)
}

/// Makes every member's copy, parents first, each stopped at its
/// template's registers. All or nothing.
/// `next_pid`: sets the next PID of the namespace (see `lastpid`), for a
/// copy made by a process without the capability to pick one.
pub fn clone_tree<'a>(
    members: &'a [Member<'a>],
    next_pid: NextPidFn<'_>,
) -> Result<TreeCopies<'a>, ProcError> {
    clone_tree_from(members, None, next_pid)
}

/// How the first member's copy comes about.
enum First {
    /// Cloned from its template (or rolled back in place).
    Template,
    /// Made already: a copy of its template.
    Given(Tracee),
    /// A plain fork of another process, its template still to be grafted
    /// on (a tree brought under a process other than its parent).
    Graft(Tracee),
}

/// Forks `parent` (stopped, traced) into a child with PID `set_tid`,
/// stopped and not run: the start of a tree made under it by
/// [`clone_tree_onto`].
pub fn fork_child(parent: &mut Tracee, set_tid: Option<u32>) -> Result<Tracee, ProcError> {
    inject_fork(parent, false, set_tid)
}

/// [`clone_tree`] under another process than the root's parent: `forked`
/// (from [`fork_child`]) becomes the root, its template grafted on and a
/// session of its own; the rest is made below it as usual. A native
/// fork's `tine exec` session is made so under the fork's init.
pub fn clone_tree_onto<'a>(
    members: &'a [Member<'a>],
    forked: Tracee,
    next_pid: NextPidFn<'_>,
) -> Result<TreeCopies<'a>, ProcError> {
    build(
        members,
        First::Graft(forked),
        Vec::new(),
        TreeShm::default(),
        next_pid,
    )
}

/// A member's origin, still alive and stopped (with its other threads):
/// rolled back in place rather than made again.
#[derive(Debug)]
pub struct Live {
    pub main: Tracee,
    /// Its other threads, stopped (see [`Live::end_new_threads`]).
    pub others: Vec<Tracee>,
    /// Those of its threads that its template has too (by TID), each with
    /// its index in the template's threads: set back in place.
    pub kept: Vec<(Tracee, usize)>,
    /// Its children killed for the rollback (their PIDs as it sees them),
    /// to be reaped in its name.
    pub killed_children: Vec<u32>,
    /// Where its memory may differ from its template's, when its writes are
    /// tracked (`dirty`): only those pages are compared. `None`: all.
    pub changed: Option<crate::dirty::Ranges>,
    /// What was read from its template before (see `graft::source_of`).
    pub source: Option<std::sync::Arc<crate::graft::SourceRecord>>,
    /// Its memory map, read since it was stopped (else read by the graft).
    pub maps: Option<Vec<crate::layout::Mapping>>,
    /// A thread of its own that pushes its pages back from the template
    /// (`pusher`) while this one goes on; else they are copied here.
    pub pusher: Option<crate::pusher::Hand>,
    /// Pages that thread pushes back already ([`Live::push_ahead`]).
    pub ahead: Option<crate::graft::Ahead>,
    /// Whether its descriptors are its template's, asked of that thread
    /// ([`Live::ask_table`]).
    pub table: Option<crate::pusher::Ran<bool>>,
    /// Its threads' `children` files, opened before the pause.
    pub children: crate::inspect::ChildrenFiles,
}

impl Live {
    /// Starts pushing back, on its pusher thread, the pages it changed in
    /// the mappings it kept as they were ([`crate::graft::push_ahead`]),
    /// while the rollback goes on. Once an error can no longer let it run
    /// on as it was: from here it is rolled back or killed.
    pub fn push_ahead(&mut self, tpl: &Template) {
        if let (Some(hand), Some(changed), Some(source), Some(maps), None) = (
            &self.pusher,
            &self.changed,
            &self.source,
            &self.maps,
            &self.ahead,
        ) {
            let table = self.table.take();
            let a =
                crate::graft::push_ahead(&mut self.main, tpl, changed, source, maps, hand, table);
            self.ahead = Some(a);
        }
    }

    /// Asks its pusher thread whether its descriptors are its template's
    /// (where it is the template's origin), before that thread seizes the
    /// template and pushes: the graft waits for the answer early, the
    /// pushed pages only as it ends (a pool's parent waited 0.3 ms behind
    /// four seizes and its push).
    /// Without a pusher of its own, `hand`'s thread is asked (PostgreSQL's
    /// processes: 0.13 ms each on the rollback's thread).
    pub fn ask_table(&mut self, tpl: &Template, hand: Option<&crate::pusher::Hand>) {
        if let (Some(hand), None) = (self.pusher.as_ref().or(hand), &self.table)
            && self.main.pid() == tpl.origin
        {
            self.table = Some(hand.same_table(tpl, tpl.origin));
        }
    }

    /// Ends those of its other threads that its template does not have
    /// (started since the checkpoint); keeps the others (`kept`), to be set
    /// back to their state then. `known`: the TIDs threads have in their
    /// namespace, by host TID, where read before (the others are read now).
    /// A thread whose TID cannot be read is ended.
    pub fn end_new_threads(&mut self, tpl: &Template, known: &std::collections::HashMap<u32, u32>) {
        let mut ending = Vec::new();
        for t in std::mem::take(&mut self.others) {
            let ns_tid = known
                .get(&t.pid())
                .copied()
                .or_else(|| crate::inspect::ns_pids(t.pid()).and_then(|p| p.last().copied()));
            let at = ns_tid.and_then(|tid| tpl.threads.iter().position(|s| s.ns_tid == tid));
            match at {
                Some(i) if !self.kept.iter().any(|(_, k)| *k == i) => self.kept.push((t, i)),
                _ => ending.push(t),
            }
        }
        Tracee::exit_all(ending);
    }
}

/// [`clone_tree`] where some members' origins still live (`live`, by
/// index; their parents' too): each is rolled back in place — its threads
/// of the checkpoint set back, the others ended, its killed children
/// reaped, its template grafted onto it
/// (only the pages it changed since are copied back) — keeping its PID,
/// parent and children without making anything anew. The others are made
/// as in [`clone_tree`]. `views`: the templates' shared memory, mapped
/// ahead for the objects left in place to be compared with.
pub fn roll_back_tree<'a>(
    members: &'a [Member<'a>],
    live: Vec<Option<Live>>,
    views: crate::shmback::Views,
    next_pid: NextPidFn<'_>,
) -> Result<TreeCopies<'a>, ProcError> {
    let shm = TreeShm::with_views(views);
    build(members, First::Template, live, shm, next_pid)
}

/// Rolls live process `l` back to template `m.tpl` in place; with its
/// threads of the checkpoint that still run (set back later, in `fix`).
fn in_place(
    mut l: Live,
    m: &Member<'_>,
    shm: &mut TreeShm,
) -> Result<(Tracee, Vec<(Tracee, usize)>), ProcError> {
    // Its threads started since end, if the caller did not end them
    // already; the others are kept.
    l.end_new_threads(m.tpl, &Default::default());
    let Live {
        mut main,
        others: _,
        kept,
        mut killed_children,
        changed,
        source,
        maps,
        pusher,
        ahead,
        table,
        children,
    } = l;
    // Its descriptors asked ahead, where no push took the question along.
    let ahead = ahead.or_else(|| table.map(crate::graft::Ahead::asked));
    // Children that ended since the checkpoint unreaped (zombies it did not
    // have then) hold PIDs its copies may need: reaped in its name too.
    let tids: Vec<u32> = std::iter::once(main.pid())
        .chain(kept.iter().map(|(t, _)| t.pid()))
        .collect();
    if let Ok(z) = crate::inspect::zombies_through(main.pid(), &tids, &children) {
        killed_children.extend(
            z.into_iter()
                .map(|(ns, _)| ns)
                .filter(|ns| !m.zombies.iter().any(|(then, _)| then == ns)),
        );
    }
    let done = reap(&mut main, &killed_children).and_then(|()| {
        crate::graft::graft_changed(
            &mut main,
            m.tpl,
            shm,
            changed.as_ref(),
            source.as_deref(),
            maps,
            pusher.as_ref(),
            ahead,
        )
    });
    match killed_on_error(main, done) {
        Ok(main) => Ok((main, kept)),
        Err(e) => {
            for (t, _) in kept {
                t.kill();
            }
            Err(e)
        }
    }
}

/// Reaps `killed_children` in `main`'s name.
fn reap(main: &mut Tracee, killed_children: &[u32]) -> Result<(), ProcError> {
    for &pid in killed_children {
        let r = main.syscall_raw(
            libc::SYS_wait4,
            [
                u64::from(pid),
                0,
                (libc::WNOHANG | libc::__WALL) as u64,
                0,
                0,
                0,
            ],
        )?;
        if r < 0 && r != -(libc::ECHILD as i64) {
            return Err(ProcError::Injected {
                pid: main.pid(),
                call: "wait4",
                source: std::io::Error::from_raw_os_error(-r as i32),
            });
        }
    }
    Ok(())
}

/// Sets the next PID of the copies' namespace (see `lastpid`).
pub type NextPidFn<'n> = &'n mut dyn FnMut(u32) -> Result<(), ProcError>;

/// Forks `t` into a process with PID `set_tid` (see [`inject_fork`]); when
/// `t` may not pick it, the namespace's next PID is set and `t` forks
/// plainly.
fn fork_at(
    t: &mut Tracee,
    parent: bool,
    set_tid: Option<u32>,
    next_pid: &mut NextPidFn<'_>,
) -> Result<Tracee, ProcError> {
    match (inject_fork(t, parent, set_tid), set_tid) {
        (
            Err(ProcError::Injected {
                call: "clone3",
                source,
                ..
            }),
            Some(pid),
        ) if source.raw_os_error() == Some(libc::EPERM) => {
            next_pid(pid)?;
            let c = inject_fork(t, parent, None)?;
            if crate::template::ns_pid(c.pid()) == Some(pid) {
                return Ok(c);
            }
            c.kill();
            Err(ProcError::Injected {
                pid: t.pid(),
                call: "clone3",
                source: std::io::Error::other(format!(
                    "PID {pid} was taken by another process meanwhile"
                )),
            })
        }
        (r, _) => r,
    }
}

/// [`clone_tree`], the first member's copy made already (`root`: a copy of
/// its template in namespaces of its own, see `nest`); it is given its
/// session and shared memory here.
pub fn clone_tree_from<'a>(
    members: &'a [Member<'a>],
    root: Option<Tracee>,
    next_pid: NextPidFn<'_>,
) -> Result<TreeCopies<'a>, ProcError> {
    let first = match root {
        Some(c) => First::Given(c),
        None => First::Template,
    };
    build(members, first, Vec::new(), TreeShm::default(), next_pid)
}

/// Makes (or, where `live` holds its origin, rolls back in place) every
/// member's copy, parents first. `root`: the first member's copy, made.
/// `shm`: where each shared object is, copied once for the whole tree.
fn build<'a>(
    members: &'a [Member<'a>],
    first: First,
    mut live: Vec<Option<Live>>,
    mut shm: TreeShm,
    mut next_pid: NextPidFn<'_>,
) -> Result<TreeCopies<'a>, ProcError> {
    let _here = crate::ptrace::hold_here();
    live.resize_with(members.len(), || None);
    let mut copies = TreeCopies {
        members,
        made: Vec::with_capacity(members.len()),
        kept: Vec::with_capacity(members.len()),
        views: Default::default(),
        pending: Default::default(),
        shared_left: None,
    };
    let (mut root, mut graft_root) = match first {
        First::Template => (None, None),
        First::Given(c) => (Some(c), None),
        First::Graft(c) => (None, Some(c)),
    };
    for (m, here) in members.iter().zip(live) {
        if let Some(mut c) = graft_root.take() {
            let done = graft(&mut c, m.tpl, &mut shm).and_then(|()| own_session(&mut c, m.tpl));
            let mut made = killed_on_error(c, done)?;
            let zombies = add_zombies(&mut made, m, &mut next_pid);
            copies.made.push(made);
            copies.kept.push(Vec::new());
            zombies?;
            continue;
        }
        let mut kept = Vec::new();
        let made = match (here, m.parent, root.take()) {
            (Some(l), _, given) => {
                if let Some(c) = given {
                    c.kill();
                }
                in_place(l, m, &mut shm).map(|(main, k)| {
                    kept = k;
                    main
                })
            }
            (None, None, given) => {
                let c = match given {
                    Some(c) => Ok(c),
                    None => root_copy(m, &mut next_pid),
                };
                // Its children are forked from it: they must find its
                // session, group and shared memory in place.
                c.and_then(|mut c| {
                    let done = own_session(&mut c, m.tpl).and_then(|()| {
                        crate::shm::make_private_in(
                            &mut c,
                            &m.tpl.shm,
                            &mut shm,
                            above(&m.tpl.fds),
                            true,
                        )
                    });
                    killed_on_error(c, done)
                })
            }
            (None, Some(p), None) if p < copies.made.len() => {
                let forked = fork_at(&mut copies.made[p], false, m.how.set_tid, &mut next_pid);
                forked.and_then(|mut c| {
                    let done = graft(&mut c, m.tpl, &mut shm).and_then(|()| join_group(&mut c, m));
                    killed_on_error(c, done)
                })
            }
            (None, Some(_), given) => {
                if let Some(c) = given {
                    c.kill();
                }
                return Err(ProcError::Malformed {
                    pid: m.tpl.pid,
                    path: "template record: a process listed before its parent".into(),
                });
            }
        };
        let mut made = made?;
        let zombies = add_zombies(&mut made, m, &mut next_pid);
        copies.made.push(made);
        copies.kept.push(kept);
        zombies?;
    }
    // No member to graft it into: it must never run.
    if let Some(c) = graft_root {
        c.kill();
    }
    copies.pending = shm.views.take_pending();
    copies.views = std::mem::take(&mut shm.views);
    Ok(copies)
}

/// `c` when `done` is fine; else `c` is killed (half made, it must not
/// run) and the error returned.
fn killed_on_error(c: Tracee, done: Result<(), ProcError>) -> Result<Tracee, ProcError> {
    match done {
        Ok(()) => Ok(c),
        Err(e) => {
            c.kill();
            Err(e)
        }
    }
}

/// Makes `m`'s zombie children again in its copy `c` (those it does not
/// have already: a process rolled back in place may still hold them).
fn add_zombies(
    c: &mut Tracee,
    m: &Member<'_>,
    next_pid: &mut NextPidFn<'_>,
) -> Result<(), ProcError> {
    if m.zombies.is_empty() {
        return Ok(());
    }
    let have: Vec<u32> = crate::inspect::zombies(c.pid())?
        .into_iter()
        .map(|(ns, _)| ns)
        .collect();
    for &(pid, status) in m.zombies {
        if have.contains(&pid) {
            continue;
        }
        let z = fork_at(c, false, Some(pid), next_pid)?;
        end_as(z, status)?;
    }
    Ok(())
}

/// Ends process `z` (a fork of its parent's copy, not run) so that its
/// parent reaps `status`: an exit code, or death by a signal (its default
/// action restored, unblocked, no core dump).
fn end_as(mut z: Tracee, status: i32) -> Result<(), ProcError> {
    let sig = (status & 0x7f) as u64;
    if sig == 0 {
        z.exit_group((status >> 8) & 0xff);
        return Ok(());
    }
    let zeros = z.scratch(0, &[0u8; 32])?;
    z.syscall(
        "prlimit64(RLIMIT_CORE)",
        libc::SYS_prlimit64,
        [0, libc::RLIMIT_CORE as u64, zeros, 0, 0, 0],
    )?;
    z.syscall(
        "rt_sigaction",
        libc::SYS_rt_sigaction,
        [sig, zeros, 0, 8, 0, 0],
    )?;
    z.syscall(
        "rt_sigprocmask",
        libc::SYS_rt_sigprocmask,
        [libc::SIG_SETMASK as u64, zeros, 0, 8, 0, 0],
    )?;
    let me = crate::template::ns_pid(z.pid()).unwrap_or(0);
    z.syscall("kill", libc::SYS_kill, [u64::from(me), sig, 0, 0, 0, 0])?;
    // The signal, held back while it was stopped, ends it as it runs on:
    // a zombie before the rollback goes on to kill what it did not make.
    z.run_to_end();
    Ok(())
}

/// A root's copy, cloned from its template (which is parked again).
fn root_copy(m: &Member<'_>, next_pid: &mut NextPidFn<'_>) -> Result<Tracee, ProcError> {
    let mut t = seize_template(m.tpl)?;
    let regs = *t.saved_regs();
    let forked = fork_at(&mut t, m.how.parent, m.how.set_tid, next_pid);
    t.park()?;
    let mut c = forked?;
    c.set_saved_regs(regs);
    Ok(c)
}

/// Makes process group `pgid` the foreground one of `c`'s controlling
/// terminal (held at one of its descriptors, as its template's show), with
/// `SIGTTOU` blocked meanwhile: `c` itself may be in the background.
fn set_foreground(c: &mut Tracee, tpl: &Template, pgid: u32) -> Result<(), ProcError> {
    let Some(fd) = crate::fixes::tty_fd(&tpl.fds) else {
        return Ok(());
    };
    let pid = c.pid();
    let io = |step: &'static str| move |source| ProcError::Ptrace { pid, step, source };
    let mask = crate::raw::get_sigmask(pid).map_err(io("read signal mask"))?;
    crate::raw::set_sigmask(pid, mask | 1 << (libc::SIGTTOU - 1)).map_err(io("block SIGTTOU"))?;
    let at = c.scratch(0, &(pgid as i32).to_le_bytes());
    let r = at.and_then(|at| {
        c.syscall(
            "ioctl(TIOCSPGRP)",
            libc::SYS_ioctl,
            [fd as u64, libc::TIOCSPGRP, at, 0, 0, 0],
        )
    });
    crate::raw::set_sigmask(pid, mask).map_err(io("set signal mask back"))?;
    r.map(|_| ())
}

/// A grafted child's session or process group, where not its parent's.
fn join_group(c: &mut Tracee, m: &Member<'_>) -> Result<(), ProcError> {
    if m.leads_session {
        c.syscall("setsid", libc::SYS_setsid, [0; 6])?;
    } else if let Some(pgid) = m.pgid {
        c.syscall(
            "setpgid",
            libc::SYS_setpgid,
            [0, u64::from(pgid), 0, 0, 0, 0],
        )?;
    }
    Ok(())
}

impl TreeCopies<'_> {
    /// The views of the templates' shared memory the put-backs read, for
    /// the caller to drop once the copies run.
    pub fn take_views(&mut self) -> crate::shmback::Views {
        std::mem::take(&mut self.views)
    }

    /// [`shared_left_of`] its templates, worked out ahead.
    pub fn with_shared_left(&mut self, left: Vec<crate::treeobjects::Shared>) {
        self.shared_left = Some(left);
    }

    /// The copies' PIDs (as the caller's namespace sees them), in order.
    pub fn pids(&self) -> Vec<u32> {
        self.made.iter().map(Tracee::pid).collect()
    }

    /// Gives the copies the pipes and socket pairs that connect them
    /// (`shared`, from [`crate::treeobjects::plan`]), then each its
    /// descriptors' fixes, objects, locks and threads, and lets them all
    /// run, children first. Returns their PIDs. On an error every copy is
    /// killed unrun.
    pub fn finish(self, shared: &[crate::treeobjects::Shared]) -> Result<Vec<u32>, ProcError> {
        self.finish_with(shared, |_| {})
    }

    /// [`TreeCopies::finish`], `last` given the copies (each with its other
    /// threads, all fixed and still stopped) just before they run.
    pub fn finish_with(
        self,
        shared: &[crate::treeobjects::Shared],
        last: impl FnOnce(&mut [(Tracee, Vec<Tracee>)]),
    ) -> Result<Vec<u32>, ProcError> {
        let pids = self.pids();
        let mut made = self.fix(shared)?;
        last(&mut made);
        // None let go takes this thread's CPU before all are.
        let _urgent = crate::ptrace::urgent();
        for (c, ts) in made.into_iter().rev() {
            // Its other threads first: the main one, run, would take the
            // CPU the rest are let go from (it is held there till then).
            for t in ts {
                t.resume()?;
            }
            c.resume()?;
        }
        Ok(pids)
    }

    /// [`TreeCopies::finish`] without letting them run: each copy, in
    /// order, with its other threads (all stopped). On an error every copy
    /// is killed.
    pub fn fix(
        mut self,
        shared: &[crate::treeobjects::Shared],
    ) -> Result<Vec<(Tracee, Vec<Tracee>)>, ProcError> {
        let _here = crate::ptrace::hold_here();
        // Shared memory put back by the second thread while this one
        // grafted: all of it back before any of them runs.
        std::mem::take(&mut self.pending).settle()?;
        let above: Vec<i32> = self.members.iter().map(|m| above(&m.tpl.fds)).collect();
        // A rollback in place leaves the pipes that are as they were.
        let shared = if self.members.iter().all(|m| m.how.keep_unchanged) {
            std::borrow::Cow::Owned(match self.shared_left.take() {
                Some(left) => left,
                None => shared_left_of(self.members, shared)(),
            })
        } else {
            std::borrow::Cow::Borrowed(shared)
        };
        crate::treeobjects::make(&mut self.made, &shared, &above)?;
        let mut threads = Vec::with_capacity(self.made.len());
        let mut kept = std::mem::take(&mut self.kept).into_iter();
        for (c, m) in self.made.iter_mut().zip(self.members) {
            let mut k = kept.next().unwrap_or_default();
            let tree = TreeCopy {
                leads_session: m.leads_session,
            };
            let done = own_files(c, m.tpl, m.how, Some(tree))
                .and_then(|()| match m.foreground {
                    Some(pgid) => set_foreground(c, m.tpl, pgid),
                    None => Ok(()),
                })
                .and_then(|()| {
                    crate::template::own_threads_keeping(c, m.tpl, std::mem::take(&mut k))
                })
                // Pages pushed back by another thread meanwhile are all
                // back (and protected) before anything runs; then the kept
                // threads' frames are written over them.
                .and_then(|(mut t, frames)| {
                    c.settle()?;
                    // (Its dispositions and the like are set before any
                    // of its threads runs.)
                    c.make_later_calls()?;
                    // A copy made fresh runs as its template does; given
                    // last, once its files are open and its threads made
                    // (both may need what its parent's copy holds).
                    if c.pid() != m.tpl.origin {
                        crate::creds::match_template(c, &mut t, m.tpl, u64::MAX)?;
                    }
                    crate::threads::write_frames(c.pid(), &frames).map(|()| t)
                });
            match done {
                Ok(t) => threads.push(t),
                Err(e) => {
                    // (Dropped, a kept thread would run.)
                    let unset = k.into_iter().chain(kept.flatten()).map(|(t, _)| t);
                    for t in threads.into_iter().flatten().chain(unset) {
                        t.kill();
                    }
                    return Err(e);
                }
            }
        }
        Ok(std::mem::take(&mut self.made)
            .into_iter()
            .zip(threads)
            .collect())
    }
}

impl Drop for TreeCopies<'_> {
    fn drop(&mut self) {
        for (t, _) in std::mem::take(&mut self.kept).into_iter().flatten() {
            t.kill();
        }
        // Children first: a parent's end must not let one run.
        for c in std::mem::take(&mut self.made).into_iter().rev() {
            c.kill();
        }
    }
}
