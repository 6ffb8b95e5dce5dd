//! Checkpoints of a sandbox's processes: which processes, stopping them with
//! ptrace, the templates each forks, and letting them run again.

use super::*;
use tine_proc::dirty::Ranges;

/// The processes a checkpoint covers: the cgroup's, minus init and the
/// templates (`skip`).
pub(super) fn targets(
    name: &str,
    cg: &Cgroup,
    init_pid: u32,
    skip: &[u32],
) -> Result<Vec<u32>, ProcessError> {
    let mut pids: Vec<u32> = cg
        .processes()
        .map_err(|e| {
            ProcessError::io(name, "list processes")(std::io::Error::other(e.to_string()))
        })?
        .into_iter()
        .filter(|p| *p != init_pid && !skip.contains(p))
        .collect();
    pids.sort_unstable();
    Ok(pids)
}

/// The sandbox's processes, stopped with ptrace (not frozen: a stopped
/// process can be made to fork, a frozen one cannot).
#[derive(Debug)]
pub struct Stopped {
    tracees: Vec<Tracee>,
    /// Each process's other threads, stopped too (in the order of `tracees`).
    threads: Vec<Vec<Tracee>>,
    /// Each process's mappings' fork flags, scanned before it stopped.
    hints: Vec<Option<tine_proc::forkflags::Scan>>,
    /// Clients of `tine exec` sessions (see [`exec_clients`]).
    clients: Vec<u32>,
    init_pid: u32,
    /// The sandbox's templates: the ones there before, and those made since.
    templates: Vec<u32>,
    /// Templates made, to be settled once the processes run again.
    unsettled: Vec<Unsettled>,
    /// Where each process may differ from its templates.
    book: tracking::Book,
    /// Spares that can become this checkpoint's templates, and those that did.
    spares: Vec<spares::Entry>,
    /// What each process's spare got before the pause (see `spare::precopy`).
    precopied: Precopied,
    /// What was read of each spare before the pause, by its PID: what it
    /// inherited, which its process's must be, and its `fdinfo` files, for
    /// the question whether its descriptors are its process's (node's,
    /// opened inside the pause: 0.3-0.5 ms).
    spare_ahead: Vec<(u32, tine_proc::spare::Ahead)>,
    taken: Vec<u32>,
    /// The templates made (for their spares, when settled).
    made: Vec<Template>,
    dirs: SandboxDirs,
    /// When the first process was stopped.
    pub since: Instant,
}

/// Why a process is refused that was started between the listing and the
/// stops (the stop is tried again: see [`stop_all`]).
const JOINED: &str = "it was started while the snapshot was being taken";

/// How many times the stops are tried when a process is started between
/// the listing and them (a shell loop forks every few milliseconds).
const STOP_TRIES: usize = 5;

/// Stops every process a checkpoint covers, after checking each can be
/// cloned. One started between the listing and the stops lets the others
/// run again (their tracees dropped) and the stops are tried again, a few
/// times, before it is refused.
pub fn stop_all(
    name: &str,
    cg: &Cgroup,
    init_pid: u32,
    dirs: &SandboxDirs,
) -> Result<Stopped, ProcessError> {
    let mut tries = 1;
    loop {
        match stop_all_once(name, cg, init_pid, dirs) {
            // Started after the listing: stopped, or seen as a listed
            // process's child not in the list (`cloneable_in`'s reason).
            Err(ProcessError::Proc(ProcError::NotCloneable(n)))
                if (n.reason == JOINED || n.reason.contains("live child process"))
                    && tries < STOP_TRIES =>
            {
                tries += 1;
            }
            r => return r,
        }
    }
}

fn stop_all_once(
    name: &str,
    cg: &Cgroup,
    init_pid: u32,
    dirs: &SandboxDirs,
) -> Result<Stopped, ProcessError> {
    let recorded = recorded_template_pids(dirs);
    // A spare already made into a template (a crash before its record was
    // replaced) is one no more.
    let ready: Vec<spares::Entry> = spares::load(dirs)
        .into_iter()
        .filter(|e| !recorded.contains(&e.spare.pid))
        // (One an earlier try precopied into, then discarded, is gone.)
        .filter(|e| tine_proc::spare::alive(&e.spare))
        .collect();
    let mut skip = recorded;
    skip.extend(ready.iter().map(|e| e.spare.pid));
    let mut pids = targets(name, cg, init_pid, &skip)?;
    // Clients of `tine exec` sessions (in the cgroup, outside the PID
    // namespace) are not the sandbox's: their commands are, as trees of
    // their own, rolled back in place under them.
    let clients = exec_clients(init_pid, &pids);
    pids.retain(|p| !clients.contains(p));
    // A process already ending runs no more code (a rollback's holder of
    // memory, killed as its copy runs, among them): nothing to capture.
    pids.retain(|p| !tine_proc::stat(*p).is_ok_and(|s| s.exiting()));
    // Trees: every process is init's child, another's of the sandbox, or a
    // session's command.
    let mut parents = std::collections::HashMap::new();
    for &pid in &pids {
        match tine_proc::stat(pid) {
            Ok(st)
                if st.ppid == init_pid || pids.contains(&st.ppid) || clients.contains(&st.ppid) =>
            {
                parents.insert(pid, st.ppid);
            }
            Ok(_) => {
                return Err(ProcessError::NotInTree {
                    pid: tine_proc::template::ns_pid(pid).unwrap_or(pid),
                    cmdline: tine_proc::inspect::cmdline(pid),
                });
            }
            Err(ProcError::Gone { .. }) => {}
            Err(e) => return Err(e.into()),
        }
    }
    pids.retain(|p| parents.contains_key(p));
    for &pid in &pids {
        let root = parents.get(&pid) == Some(&init_pid);
        match tine_proc::inspect::cloneable_in(pid, &pids, root) {
            Ok(_) | Err(ProcError::Gone { .. }) => {}
            Err(e) => return Err(e.into()),
        }
    }
    // Parents before their children (each is made again from its parent's copy).
    let most = pids.len();
    let depth = |mut p: u32| {
        let mut d = 0;
        while let Some(&up) = parents.get(&p) {
            if up == init_pid || d > most {
                break;
            }
            (p, d) = (up, d + 1);
        }
        d
    };
    pids.sort_by_key(|p| (depth(*p), *p));
    // Scanned before the stops (it walks page tables): checked, and scanned
    // again only if their mappings changed, while they are stopped.
    let flags: Vec<Option<tine_proc::forkflags::Scan>> = pids
        .iter()
        .map(|p| tine_proc::forkflags::scan(*p).ok())
        .collect();
    // Spares get what their processes wrote up to now while they still
    // run: the pause then copies only what they write from here.
    let mut book = tracking::Book::load(dirs);
    let mut precopied = Precopied(Vec::new());
    for &pid in &pids {
        let Some(e) = ready.iter().find(|e| e.base.origin == pid) else {
            continue;
        };
        if e.spare.fork_us < SPARE_GRAFT_US || !book.scan_running(pid) {
            continue;
        }
        let Some(changed) = book.differs_from(pid, &e.base) else {
            continue;
        };
        // From here the spare is its template's copy no more: if this
        // checkpoint does not take it, it is killed (`Precopied`).
        let copied = tine_proc::spare::precopy(&e.spare, &e.base, pid, &changed);
        precopied.0.push((pid, e.spare, copied.unwrap_or_default()));
    }
    let spare_ahead = ready
        .iter()
        .filter(|e| pids.contains(&e.base.origin) && e.spare.fork_us >= SPARE_GRAFT_US)
        .map(|e| {
            let fds = e.base.fds.iter().map(|f| f.fd);
            (e.spare.pid, tine_proc::spare::Ahead::read(&e.spare, fds))
        })
        .collect();
    // Where each has a `syscall` instruction, found while it runs (its
    // memory map read: a third of a millisecond for numpy), checked once
    // stopped.
    let calls: Vec<u64> = pids
        .iter()
        .map(|&p| tine_proc::ptrace::find_syscall_instruction(p).unwrap_or(0))
        .collect();
    // Each one's `fdinfo` files, opened while it runs: its descriptor
    // table is read through them inside the pause (node's checkpoint,
    // opening them there: 4.82 ms paused against 4.15).
    let mut fdinfos: Vec<tine_proc::fdtable::FdInfos> = pids
        .iter()
        .map(|&p| tine_proc::fdtable::FdInfos::open_all(p))
        .collect();
    let since = Instant::now();
    let mut tracees = Vec::with_capacity(pids.len());
    let mut threads = Vec::with_capacity(pids.len());
    let mut hints = Vec::with_capacity(pids.len());
    for (((&pid, hint), &at), infos) in pids.iter().zip(flags).zip(&calls).zip(&mut fdinfos) {
        let held = tine_proc::threads::stop_all(pid, at).map(|(mut t, mut others)| {
            t.use_fdinfos(std::mem::take(infos));
            // Each thread's state is read through the one descriptor of
            // their memory.
            for o in &mut others {
                o.share_memory_of(&mut t);
            }
            (t, others)
        });
        match held {
            Ok((t, others)) => {
                tracees.push(t);
                threads.push(others);
                hints.push(hint);
            }
            // It ended meanwhile: nothing to capture.
            Err(ProcError::Gone { .. }) => {}
            Err(e) => return Err(e.into()),
        }
    }
    // Whatever was started between the listing and the stops is refused below
    // (its parent now has a live child).
    let now = targets(name, cg, init_pid, &skip)?;
    for pid in now {
        if !pids.contains(&pid) && !clients.contains(&pid) {
            return Err(ProcessError::Proc(ProcError::NotCloneable(
                tine_proc::NotCloneable::of(pid, tine_proc::inspect::cmdline(pid), JOINED.into()),
            )));
        }
    }
    Ok(Stopped {
        tracees,
        threads,
        hints,
        clients,
        init_pid,
        templates: skip,
        unsettled: Vec::new(),
        book,
        spares: ready,
        precopied,
        spare_ahead,
        taken: Vec::new(),
        made: Vec::new(),
        dirs: dirs.clone(),
        since,
    })
}

impl Stopped {
    /// Makes a template of every stopped process (they stay stopped). The
    /// snapshot's id is filled in once it is known.
    pub fn make_templates(&mut self) -> Result<ProcessState, ProcessError> {
        let init_start = tine_proc::stat(self.init_pid)?.start_time;
        let mut processes = Vec::with_capacity(self.tracees.len());
        // Shared memory stays shared among the templates of one checkpoint.
        let mut shm = tine_proc::shm::TreeShm::default();
        for ((t, others), hint) in self
            .tracees
            .iter_mut()
            .zip(&mut self.threads)
            .zip(&self.hints)
        {
            let tracked = self.book.before_fork(t);
            // (Its map as read there: nothing below changes it before the
            // template's state is read.)
            let maps = self.book.maps_read(t.pid());
            let spared = if tracked {
                let before = self
                    .precopied
                    .0
                    .iter()
                    .find(|(p, _, _)| *p == t.pid())
                    .map(|(_, _, r)| r);
                let maps = maps.clone();
                from_spare(
                    &self.book,
                    (&self.spares, &self.spare_ahead),
                    before,
                    t,
                    others,
                    hint.as_ref(),
                    maps,
                )
            } else {
                None
            };
            if let Some((tpl, _)) = &spared {
                self.taken.push(tpl.pid);
                self.precopied.0.retain(|(_, s, _)| s.pid != tpl.pid);
            }
            let made = capture_one(
                &mut shm,
                &self.clients,
                self.init_pid,
                t,
                others,
                hint.as_ref(),
                spared.ok_or(maps),
            );
            match made {
                Ok((c, unsettled)) => {
                    if tracked {
                        self.book.forked(t.pid(), &c.template);
                    }
                    self.templates.push(c.template.pid);
                    self.unsettled.push(unsettled);
                    self.made.push(c.template.clone());
                    processes.push(c)
                }
                Err(e) => {
                    // Dropped unsettled, the ones made so far are killed.
                    self.unsettled.clear();
                    self.made.clear();
                    return Err(e.into());
                }
            }
        }
        self.book.commit();
        Ok(ProcessState {
            version: VERSION,
            snapshot: String::new(),
            init_pid: self.init_pid,
            init_start,
            created_ns: now_ns(),
            processes,
            measured_bytes: 0,
            measured_ns: 0,
            evicted_ns: None,
        })
    }

    /// The sandbox's templates (for scans that skip them: they never run).
    pub fn templates(&self) -> &[u32] {
        &self.templates
    }

    /// Whether a process joined the sandbox since the processes were stopped
    /// (entered with `tine exec`): it was not stopped, so it may have changed
    /// files meanwhile.
    pub fn joined(&self, cg: &Cgroup) -> bool {
        cg.processes().map_or(true, |pids| {
            pids.iter().any(|p| {
                *p != self.init_pid
                    && !self.templates.contains(p)
                    && !self.clients.contains(p)
                    && !self.tracees.iter().any(|t| t.pid() == *p)
            })
        })
    }

    /// Lets every process run on; returns how long they were stopped, and
    /// the templates made, to be settled now that their origins run.
    pub fn resume(self) -> (Duration, ToSettle) {
        // None let go takes this thread's CPU before all are (till the pause
        // is measured: their turn would come before this thread's then).
        let urgent = tine_proc::ptrace::urgent();
        for (t, others) in self.tracees.into_iter().zip(self.threads) {
            let _ = t.resume();
            for o in others {
                let _ = o.resume();
            }
        }
        let paused = self.since.elapsed();
        drop(urgent);
        let settle = ToSettle {
            unsettled: self.unsettled.into_iter().zip(self.made).collect(),
            book: self.book,
            taken: self.taken,
            dirs: self.dirs,
        };
        (paused, settle)
    }
}

/// Spares that got pages before the pause, and what: each is a copy of its
/// template no more, so one this checkpoint does not make a template (an
/// error, a refusal, a process it no longer suits) is killed when dropped.
#[derive(Debug)]
struct Precopied(Vec<(u32, tine_proc::spare::Spare, Ranges)>);

impl Drop for Precopied {
    fn drop(&mut self) {
        for (_, spare, _) in &self.0 {
            tine_proc::spare::discard(spare);
        }
    }
}

/// What making a spare into a template costs inside the pause, besides its
/// pages, in µs (measured on the development VM: 1.5–2 ms, most of it
/// injected calls), and per page copied in. A process whose fork costs less
/// (huge pages, little memory) forks, and gets no spare.
const SPARE_GRAFT_US: u64 = 2500;
const SPARE_PAGE_US: u64 = 1;

/// The template of stopped, tracked process `t` made from a spare of one
/// of its templates, when one is ready and can serve (`tine_proc::spare`);
/// `None`: fork it.
#[allow(clippy::too_many_arguments)]
fn from_spare(
    book: &tracking::Book,
    (ready, spare_ahead): (&[spares::Entry], &[(u32, tine_proc::spare::Ahead)]),
    precopied: Option<&Ranges>,
    t: &mut Tracee,
    others: &mut [Tracee],
    hint: Option<&tine_proc::forkflags::Scan>,
    maps: Option<String>,
) -> Option<(Template, Unsettled)> {
    let pid = t.pid();
    let e = ready.iter().find(|e| e.base.origin == pid)?;
    let mut changed = book.differs_from(pid, &e.base)?;
    // Of what the spare got before the pause, the pages not written since
    // (and still held: a page dropped since is dropped in the spare) are
    // the process's already.
    if let Some(before) = precopied.filter(|r| !r.is_empty()) {
        let since = book.written_in_pause(pid)?;
        let gone = book.lost_of(pid, &e.base, before)?;
        changed = changed.without(&before.without(since).without(&gone));
    }
    // Only where the graft costs less than the fork it saves.
    if e.spare.fork_us < SPARE_GRAFT_US + book.copy_estimate(pid, &e.base, &changed) * SPARE_PAGE_US
    {
        return None;
    }
    // (Nothing read of it before the pause: it cannot serve.)
    let (_, ahead) = spare_ahead.iter().find(|(p, _)| *p == e.spare.pid)?;
    tine_proc::spare::take(t, others, hint, (&e.spare, ahead), &e.base, &changed, maps)
        .ok()
        .flatten()
}

/// Makes the template of stopped process `t` (its other threads stopped in
/// `others`) and records its place in the tree: `spared`, the template made
/// already from a spare, or else its fork (`t`'s `/proc/PID/maps` text
/// given where it was read since it stopped).
fn capture_one(
    shm: &mut tine_proc::shm::TreeShm,
    clients: &[u32],
    init_pid: u32,
    t: &mut Tracee,
    others: &mut [Tracee],
    hint: Option<&tine_proc::forkflags::Scan>,
    spared: Result<(Template, Unsettled), Option<String>>,
) -> Result<(Captured, Unsettled), ProcError> {
    let pid = t.pid();
    let st = tine_proc::stat(pid)?;
    let root = st.ppid == init_pid;
    let ns = |p: u32| tine_proc::template::ns_pid(p).ok_or(ProcError::Gone { pid: p });
    let hop = if root { Hop::Sibling } else { Hop::Orphan };
    let (template, unsettled) = match spared {
        Ok(made) => made,
        Err(maps) => fork_template_via(t, others, hint, hop, shm, maps)?,
    };
    let client = clients.contains(&st.ppid);
    let anchor = if client {
        Some((st.ppid, tine_proc::stat(st.ppid)?.start_time))
    } else {
        None
    };
    let c = Captured {
        ns_pid: ns(pid)?,
        cmdline: tine_proc::inspect::cmdline(pid),
        template,
        parent: if root || client {
            None
        } else {
            Some(ns(st.ppid)?)
        },
        anchor,
        leads_session: st.session == pid,
        pgid: tine_proc::inspect::ns_pgid(pid).unwrap_or(0),
        foreground: (st.session == pid && st.tty_nr != 0 && st.tpgid > 0)
            .then(|| tine_proc::template::ns_pid(st.tpgid as u32))
            .flatten(),
        zombies: tine_proc::inspect::zombies(pid)?,
        image: None,
    };
    Ok((c, unsettled))
}

/// The processes of `pids` outside init's PID namespace: clients of
/// `tine exec` sessions (and the daemon's exec helpers), which joined the
/// cgroup only for the commands they start.
fn exec_clients(init_pid: u32, pids: &[u32]) -> Vec<u32> {
    let sandbox = pid_ns(init_pid);
    pids.iter()
        .copied()
        .filter(|p| pid_ns(*p).is_some_and(|n| Some(n) != sandbox))
        .collect()
}

/// Which PID namespace process `pid` is in (`None`: gone).
pub(super) fn pid_ns(pid: u32) -> Option<std::path::PathBuf> {
    std::fs::read_link(format!("/proc/{pid}/ns/pid")).ok()
}

/// Templates made while their origins were stopped: dropped unsettled, they
/// are killed.
#[derive(Debug)]
#[must_use = "templates not settled are killed"]
pub struct ToSettle {
    unsettled: Vec<(Unsettled, Template)>,
    book: tracking::Book,
    /// Spares made into templates by this checkpoint.
    taken: Vec<u32>,
    dirs: SandboxDirs,
}

impl ToSettle {
    /// How many of the checkpoint's templates were spares made into them
    /// (no fork inside the pause).
    pub fn from_spares(&self) -> usize {
        self.taken.len()
    }

    /// Gives each its own session and parks it (a spare of an earlier
    /// checkpoint that none of its templates is made from is killed), and
    /// returns what is left for after the call: of those whose origins are
    /// tracked, what a graft reads from them, and a spare of each whose
    /// fork cost more than a spare's graft, for the next checkpoint (see
    /// [`super::prepare`]). One that cannot be settled is killed: a
    /// rollback to it says it is gone.
    pub fn settle(self) -> (Duration, super::prepare::Preparation) {
        let t0 = Instant::now();
        let mut items = Vec::new();
        for (u, tpl) in self.unsettled {
            let tracked = self.book.has_template(u.pid());
            if u.settle().is_ok() && tracked {
                items.push(super::prepare::Item {
                    pid: tpl.pid,
                    start: tpl.start_time,
                    source: true,
                    spare: tpl.fork_us > SPARE_GRAFT_US,
                });
            }
        }
        spares::replace(&self.dirs, Vec::new(), &self.taken);
        self.book.prune_sources();
        let prep = super::prepare::Preparation {
            dirs: Some(self.dirs),
            snapshot: String::new(),
            items,
        };
        (t0.elapsed(), prep)
    }
}

/// The sandbox's init held (see docs/FORMAT.md, "Sandbox init control
/// signals"): its command may end and come back under its PID without the
/// sandbox ending. Released when dropped.
#[derive(Debug)]
pub struct HeldInit(u32);

impl HeldInit {
    /// Holds init `init_pid` (host PID), once it has taken the request.
    pub fn hold(init_pid: u32) -> Result<HeldInit, ProcError> {
        signal_init(init_pid, crate::ns::hold_signal())?;
        Ok(HeldInit(init_pid))
    }
}

impl Drop for HeldInit {
    fn drop(&mut self) {
        let _ = signal_init(self.0, crate::ns::release_signal());
    }
}

/// Sends init a control signal (hold or release) and waits until it took it
/// (the signal is no longer pending).
pub(super) fn signal_init(init_pid: u32, sig: i32) -> Result<(), ProcError> {
    crate::ns::send_signal(init_pid, sig).map_err(|_| ProcError::Gone { pid: init_pid })?;
    let bit = 1u64 << (sig - 1);
    let mut gone = false;
    let taken = poll_until(Duration::from_secs(5), || {
        let Ok(status) = std::fs::read_to_string(format!("/proc/{init_pid}/status")) else {
            gone = true;
            return true;
        };
        let pending = status
            .lines()
            .filter(|l| l.starts_with("ShdPnd:") || l.starts_with("SigPnd:"))
            .filter_map(|l| u64::from_str_radix(l.split_whitespace().nth(1)?, 16).ok())
            .fold(0, |a, b| a | b);
        pending & bit == 0
    });
    if gone {
        return Err(ProcError::Gone { pid: init_pid });
    }
    if taken {
        return Ok(());
    }
    Err(ProcError::Ptrace {
        pid: init_pid,
        step: "wait for the sandbox's init to take a request",
        source: std::io::Error::from(std::io::ErrorKind::TimedOut),
    })
}

/// Polls `done` (yielding in between) until it holds or `timeout` passed;
/// returns whether it held.
pub(super) fn poll_until(timeout: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if done() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::yield_now();
    }
}

/// Waits until each of `pids` is exiting (or gone): it runs no code of its
/// own any more, so it writes to no file.
pub(super) fn wait_exiting(pids: &[u32]) {
    for pid in pids {
        poll_until(Duration::from_secs(10), || {
            tine_proc::stat(*pid).map_or(true, |st| st.exiting())
        });
    }
}

/// Waits until `pids` are gone (killed and reaped by init).
pub(super) fn wait_gone(pids: &[u32]) {
    for pid in pids {
        poll_until(Duration::from_secs(10), || {
            !Path::new(&format!("/proc/{pid}")).exists()
        });
    }
}
