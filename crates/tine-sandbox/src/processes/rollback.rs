//! Rollbacks of a sandbox's processes: the live ones killed, copies made from
//! the templates (or from CRIU images), adopted by the init; persisting
//! templates with CRIU.

use super::*;

/// Where a rollback's processes came from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rolled {
    /// Host PIDs of the processes brought back.
    pub pids: Vec<u32>,
    /// How many templates were first brought back from CRIU images.
    pub from_images: usize,
    /// From the first process killed to the last copy running.
    pub paused: Duration,
    /// Why the processes did not come back: the rollback failed after it
    /// killed them, and the command was started afresh over the restored
    /// files instead (see [`rollback`]).
    pub failed: Option<String>,
}

/// What a rollback's restore of the files may ask ahead: the workspace's
/// change tracker (another process, which may wait for a CPU inside the
/// pause: 0.2-1 ms) asked as soon as nothing in the sandbox can write,
/// instead of when the restore starts.
pub trait FilesAhead: Sync {
    /// Every process that could write to the workspace is stopped: ask now.
    fn ask(&self);
    /// A process was killed after the asking (it may have written since).
    fn forget(&self);
    /// Runs `f` (the files' restorer, waiting for its turns) where the
    /// restore's own work will run, so that it starts there in place: handed
    /// over from another thread, the restore's end woke that thread on a CPU
    /// the rollback and a push held (numpy: 0.4-0.6 ms inside the pause).
    fn host(&self, f: &mut (dyn FnMut() + Send)) {
        f();
    }
}

/// What the files' restorer of a rollback in place is told, in order.
enum FilesTurn<'a> {
    /// Ask the change tracker now ([`FilesAhead::ask`]).
    Ask,
    /// Work of the rollback's done beside it (nothing else in the sandbox runs).
    Run(Box<dyn FnOnce() + Send + 'a>),
    /// Forget that answer ([`FilesAhead::forget`]).
    Forget,
    /// Restore the files (unfrozen).
    Go,
}

/// Nothing asked ahead.
#[derive(Debug)]
pub struct NoneAhead;

impl FilesAhead for NoneAhead {
    fn ask(&self) {}
    fn forget(&self) {}
}

/// The host PID of the process of `cg` whose PID in the sandbox is `ns_pid`.
fn find_ns_pid(cg: &Cgroup, ns_pid: u32) -> Option<u32> {
    cg.processes()
        .ok()?
        .into_iter()
        .find(|p| tine_proc::template::ns_pid(*p) == Some(ns_pid))
}

/// The descriptors a copy opens again (at their offsets): those of the
/// sandbox's own files, which the rollback may have replaced — under
/// `files_at` (`/workspace`, or `/` for an image's root, whose `/proc`,
/// `/dev`, `/sys` and private `/tmp` are not its files).
fn reopened(fds: &[tine_proc::FdEntry], files_at: &Path) -> Vec<tine_proc::FdFix> {
    let own = ["/proc", "/dev", "/sys", "/tmp"];
    fixes_for(fds, Some(files_at))
        .into_iter()
        .filter(|f| match f {
            tine_proc::FdFix::Reopen { path, .. } => !own.iter().any(|o| path.starts_with(o)),
            _ => true,
        })
        .collect()
}

/// Rolls the sandbox's processes back to `st`: init (`init_pid`, the
/// sandbox's current one) holds on, every live process (not init, not a
/// template) is killed, `restore_files` puts the workspace back, templates
/// that are gone are brought back from their CRIU images (after the files:
/// CRIU checks the files its process holds), and each template gives a copy
/// under its origin's PID, with its workspace files opened again at their
/// offsets. `restore_files(frozen)` is called unfrozen first (nothing but
/// init and stopped processes is left), possibly from another thread, and
/// again if a process joined meanwhile; `ahead` is asked as soon as nothing
/// in the sandbox can write (see [`FilesAhead`]). Check [`ProcessState::restorable`]
/// first: a template that is gone without images fails the rollback after
/// the live processes were killed.
#[allow(clippy::too_many_arguments)]
pub fn rollback<R: Send>(
    name: &str,
    cg: &Cgroup,
    dirs: &SandboxDirs,
    files_at: &Path,
    init_pid: u32,
    st: &mut ProcessState,
    criu: Option<&Criu>,
    restore_files: impl Fn(bool) -> R + Sync,
    ahead: &dyn FilesAhead,
) -> Result<(R, Rolled), ProcessError> {
    let hold = crate::ns::hold_signal();
    let release = crate::ns::release_signal();
    let templates = template_pids(dirs);
    let init_start = tine_proc::stat(init_pid)?.start_time;
    let same_run = st.same_run(init_pid, init_start);
    let all_alive = same_run
        && st
            .processes
            .iter()
            .all(|c| tine_proc::template::template_alive(&c.template));
    // Pipes and socket pairs between processes that come back together
    // are made once for all of them; each process's own, for it alone.
    let (shared, skip) = if st.together() {
        st.tree_objects(false, &Default::default())
            .unwrap_or_default()
    } else {
        Default::default()
    };
    let hows: Vec<Respawn> = st
        .processes
        .iter()
        .map(|c| Respawn {
            set_tid: Some(c.ns_pid),
            parent: true,
            fds: reopened(&c.template.fds, files_at),
            chdir: None,
            maps: vec![],
            remake: tine_proc::objects::plan_in_place_except(
                c.template.pid,
                &c.template.fds,
                &c.template.queued,
                &skip,
            ),
            keep_unchanged: true,
        })
        .collect();
    signal_init(init_pid, hold)?;
    let result = if all_alive {
        rollback_live(
            name,
            cg,
            dirs,
            init_pid,
            st,
            (&hows, &shared),
            &templates,
            &restore_files,
            ahead,
        )
    } else {
        let run = (same_run, init_start);
        rollback_persisted(
            name,
            cg,
            dirs,
            init_pid,
            run,
            st,
            criu,
            &hows,
            &templates,
            &restore_files,
        )
    };
    // Failed once the program was gone (the sandbox would end with it): the
    // command starts afresh over the restored files instead, and says why.
    let result = match result {
        Err(e) if can_restart(init_pid) && !program_runs(name, cg, init_pid, &templates) => {
            // (Asked of a rollback that did not come through: asked again.)
            ahead.forget();
            let t0 = Instant::now();
            match restart_held(name, cg, init_pid, &templates, &restore_files) {
                Ok(r) => Ok((
                    r,
                    Rolled {
                        paused: t0.elapsed(),
                        failed: Some(e.to_string()),
                        ..Rolled::default()
                    },
                )),
                Err(_) => Err(e),
            }
        }
        r => r,
    };
    let _ = signal_init(init_pid, release);
    result
}

/// Whether a process of the sandbox other than init and `templates` runs
/// (not ending).
fn program_runs(name: &str, cg: &Cgroup, init_pid: u32, templates: &[u32]) -> bool {
    targets(name, cg, init_pid, templates).map_or(true, |pids| {
        pids.iter()
            .any(|&p| tine_proc::stat(p).is_ok_and(|s| !s.exiting()))
    })
}

/// A process a rollback killed: its host PID, its PID in the sandbox, and
/// whether init is its parent (and reaps it at once).
#[derive(Debug, Clone, Copy)]
struct Killed {
    pid: u32,
    ns_pid: Option<u32>,
    child_of_init: bool,
    /// Its parent's host PID when it was killed.
    parent: u32,
}

/// Kills every live process of the sandbox (not init, not `skip`) and waits
/// until each is exiting: it runs no code of its own any more. A process
/// that joined the sandbox only for its children (`tine exec`, the daemon's
/// exec helper: outside the sandbox's PID namespace) is left to see its
/// command killed and say so.
fn kill_live(
    name: &str,
    cg: &Cgroup,
    init_pid: u32,
    skip: &[u32],
) -> Result<Vec<Killed>, ProcessError> {
    let sandbox_ns = pid_ns(init_pid);
    let mut killed = Vec::new();
    for pid in targets(name, cg, init_pid, skip)? {
        let ns = pid_ns(pid);
        if ns.is_some() && ns != sandbox_ns {
            continue;
        }
        let ns_pid = tine_proc::template::ns_pid(pid);
        let parent = tine_proc::stat(pid).map_or(0, |s| s.ppid);
        let child_of_init = parent == init_pid;
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
        killed.push(Killed {
            pid,
            ns_pid,
            child_of_init,
            parent,
        });
    }
    wait_exiting(&killed.iter().map(|k| k.pid).collect::<Vec<_>>());
    Ok(killed)
}

/// The IDs in the sandbox that a rollback's copies take, of processes
/// (`Captured`, whether it is made anew): the PIDs of those made anew, and
/// every process's threads' TIDs (made again with it, or where a thread of
/// one rolled back in place ended since). `clone3` refuses an ID a task
/// still holds (EEXIST): a killed `tine exec` command not yet reaped held a
/// thread's TID so now and then, when only processes' PIDs were waited for.
fn ids_taken<'a>(procs: impl Iterator<Item = (&'a Captured, bool)>) -> Vec<u32> {
    procs
        .flat_map(|(c, anew)| {
            anew.then_some(c.ns_pid)
                .into_iter()
                .chain(c.template.threads.iter().map(|t| t.ns_tid))
        })
        .collect()
}

/// Waits until those of `killed` whose PIDs in the sandbox a copy takes
/// (`wanted`) are reaped; the others need only be exiting. (A command of
/// `tine exec` whose session was outside the sandbox is reaped by whoever
/// inherits it, perhaps much later.)
fn wait_freed(killed: &[Killed], wanted: &[u32]) {
    let pids: Vec<u32> = killed
        .iter()
        .filter(|k| k.ns_pid.is_none_or(|n| wanted.contains(&n)))
        .map(|k| k.pid)
        .collect();
    wait_gone(&pids);
}

/// After the first restore of the files (`r`): a process that joined the
/// sandbox meanwhile (`tine exec`) is killed too and the files restored
/// again (frozen from the third round), up to five rounds in all.
fn kill_joiners<R>(
    name: &str,
    cg: &Cgroup,
    init_pid: u32,
    skip: &[u32],
    wanted: &[u32],
    mut r: R,
    restore_files: &impl Fn(bool) -> R,
) -> Result<R, ProcessError> {
    for round in 2..=5 {
        let joined = kill_live(name, cg, init_pid, skip)?;
        if joined.is_empty() {
            break;
        }
        r = restore_files(round > 2);
        wait_freed(&joined, wanted);
    }
    Ok(r)
}

/// The snapshot's processes cannot come back (their templates were let go,
/// and no CRIU image can bring them): so that the program does not run on
/// out of step with the restored files (a file offset past their end, a
/// count the files no longer hold), the live processes are killed, the files
/// restored, and init starts the command afresh over them, as a fork's
/// starts. Only an init that knows the command can ([`can_restart`]).
/// Returns what `restore_files` did and how long the program did not run.
pub fn restart_afresh<R>(
    name: &str,
    cg: &Cgroup,
    dirs: &SandboxDirs,
    init_pid: u32,
    restore_files: impl Fn(bool) -> R,
) -> Result<(R, Duration), ProcessError> {
    let templates = template_pids(dirs);
    signal_init(init_pid, crate::ns::hold_signal())?;
    let t0 = Instant::now();
    let result = restart_held(name, cg, init_pid, &templates, &restore_files);
    let _ = signal_init(init_pid, crate::ns::release_signal());
    Ok((result?, t0.elapsed()))
}

/// [`restart_afresh`] with init held already.
fn restart_held<R>(
    name: &str,
    cg: &Cgroup,
    init_pid: u32,
    templates: &[u32],
    restore_files: &impl Fn(bool) -> R,
) -> Result<R, ProcessError> {
    let killed = kill_live(name, cg, init_pid, templates)?;
    let r = restore_files(false);
    // Init must have reaped the command before it starts another.
    let reaped: Vec<u32> = killed
        .iter()
        .filter(|k| k.child_of_init)
        .map(|k| k.pid)
        .collect();
    wait_gone(&reaped);
    let r = kill_joiners(name, cg, init_pid, templates, &[], r, restore_files)?;
    signal_init(init_pid, crate::ns::restart_signal())?;
    Ok(r)
}

/// Whether the sandbox's init can start its command afresh: a sandbox's own
/// init can, a native fork's (which adopted a copy) does not know it.
pub fn can_restart(init_pid: u32) -> bool {
    std::fs::read(format!("/proc/{init_pid}/cmdline"))
        .is_ok_and(|c| c.split(|b| *b == 0).any(|a| a == b"__sandbox-init"))
}

/// Every template alive: the copies are made (stopped, each in its own
/// session) while the files are restored on another thread, unfrozen, as the
/// killed processes' memory is torn down; then they get their descriptors
/// and run.
#[allow(clippy::too_many_arguments)]
fn rollback_live<R: Send>(
    name: &str,
    cg: &Cgroup,
    dirs: &SandboxDirs,
    init_pid: u32,
    st: &ProcessState,
    (hows, shared): (&[Respawn], &[tine_proc::treeobjects::Shared]),
    templates: &[u32],
    restore_files: &(impl Fn(bool) -> R + Sync),
    ahead: &dyn FilesAhead,
) -> Result<(R, Rolled), ProcessError> {
    // Read while the processes still run: the tracking record and what
    // the grafts read of each template.
    let mut book = tracking::Book::load(dirs);
    for c in &st.processes {
        book.preload(&c.template);
    }
    // The templates' shared memory that may be left in place, mapped here
    // and faulted in (PostgreSQL's 16 MB of data: ~1.3 ms) for the put-back
    // to compare with inside the pause.
    let views = tine_proc::shmback::Views::open(st.processes.iter().map(|c| &c.template));
    // The TIDs the threads of the processes to keep have in the sandbox,
    // read while they run (~10 µs each): in the pause only those of threads
    // started since are. (A host TID read here and found again then is the
    // same thread: the host's PIDs would have to wrap around meanwhile.)
    // (Each process that may be rolled back in place: its template's
    // origin, or a copy a rollback tracked since; with whether it had
    // threads at the checkpoint.)
    let hosts: Vec<(u32, bool)> = st
        .processes
        .iter()
        .flat_map(|c| {
            let threaded = !c.template.threads.is_empty();
            std::iter::once(c.template.origin)
                .chain(book.followers(&c.template))
                .map(move |p| (p, threaded))
        })
        .collect();
    let ns_tids: std::collections::HashMap<u32, u32> = hosts
        .iter()
        .filter(|(_, threaded)| *threaded)
        .flat_map(|&(p, _)| tine_proc::threads::ns_tids(p))
        .collect();
    // Their PIDs in the sandbox, read while they run too (a process keeps
    // its own for life; one ended since is told by its start time): in the
    // pause, only whether each is still that process is (PostgreSQL's
    // seven: 0.24 ms for both).
    let ns_pids: std::collections::HashMap<u32, u32> = hosts
        .iter()
        .filter_map(|&(p, _)| tine_proc::template::ns_pid(p).map(|n| (p, n)))
        .collect();
    // Each thread's `children` file of each, opened while they run: read
    // inside the pause for the zombies to reap in its name (opening them
    // there cost node 0.1 ms).
    let mut children: std::collections::HashMap<u32, tine_proc::inspect::ChildrenFiles> = hosts
        .iter()
        .map(|&(p, _)| (p, tine_proc::inspect::ChildrenFiles::open(p)))
        .collect();
    std::thread::scope(|sc| {
        // The files' restorer is started before the pause (a thread costs
        // tens of µs to start, and its first run came 0.1-0.3 ms after the
        // spawn inside it) and before this thread holds its CPU (it would
        // be held there too); it waits for the go. Ended without one. It
        // asks the change tracker ahead too (a connection to the
        // supervisor: 0.03 ms this thread spends on the walks instead),
        // and forgets the answer, in the order they are sent.
        // It runs where the restore's work does ([`FilesAhead::host`]) and
        // hands back what it restored itself: this thread takes it without
        // waiting for its own thread to be woken.
        let (go, wait) = std::sync::mpsc::channel::<FilesTurn>();
        let (done, restored) = std::sync::mpsc::sync_channel(1);
        let files = tine_fs::paths::spawn_walker(sc, move || {
            let mut turns = Some(move || {
                for turn in wait {
                    match turn {
                        FilesTurn::Ask => ahead.ask(),
                        FilesTurn::Forget => ahead.forget(),
                        FilesTurn::Run(work) => work(),
                        FilesTurn::Go => {
                            let _ = done.send(restore_files(false));
                            return;
                        }
                    }
                }
            });
            ahead.host(&mut || {
                if let Some(turns) = turns.take() {
                    turns();
                }
            });
        });
        // (Started off the pause: a thread costs tens of µs to start.) On
        // another CPU than this thread, which keeps its own while it stops and
        // scans the processes: the walks handed over run beside its reading of
        // their memory maps. (Not longer: threads started later, the files'
        // restorer among them, would be kept on it too.)
        let here = tine_proc::ptrace::hold_here();
        // (What its pushes need is read first, off the pause.)
        let pushes: Vec<tine_proc::pusher::Ahead> = st
            .processes
            .iter()
            .filter(|c| pushed_from(&book, &c.template))
            .map(|c| tine_proc::pusher::Ahead {
                from: c.template.pid,
                into: c.template.origin,
                fds: c.template.fds.iter().map(|e| e.fd).collect(),
            })
            .collect();
        let pusher = tine_proc::pusher::Pusher::start(pushes).ok();
        let t0 = Instant::now();
        // A tree's processes that still live are rolled back in place (held
        // first, so that none sees the others killed); the rest are killed.
        let hand = pusher.as_ref().map(|p| p.hand());
        let mut views = views;
        if let Some(h) = &hand {
            views.lend(h.clone());
        }
        // Once the last is stopped: nothing else left in the sandbox that
        // could write (init never does, templates and spares never run), the
        // files' change tracker is asked now.
        let mut alone: Option<Vec<u32>> = None;
        // Which kernel objects of each process must be made anew (node: 10
        // read, 0.17 ms): read beside the walks once nothing else runs,
        // instead of as each process's own files are set back; what is
        // left of it when this thread needs it, this thread reads too
        // (PostgreSQL's seven: 0.75 ms on one thread).
        let plan_of =
            |i: usize| tine_proc::template::still_to_make(&st.processes[i].template, &hows[i]);
        let planning =
            std::sync::Arc::new(tine_proc::sharedwork::SharedWork::new(st.processes.len()));
        let mut planned = Some(planning.clone());
        let mut all_held = |stopped: &[u32]| -> bool {
            let others = cg.processes().map(|ps| {
                ps.into_iter()
                    .any(|p| p != init_pid && !templates.contains(&p) && !stopped.contains(&p))
            });
            if matches!(others, Ok(false)) {
                let _ = go.send(FilesTurn::Ask);
                let Some(planned) = planned.take() else {
                    return true;
                };
                let _ = go.send(FilesTurn::Run(Box::new(move || planned.take(plan_of))));
                alone = Some(stopped.to_vec());
                return true;
            }
            false
        };
        let (mut origins, passing) = live_origins(
            init_pid,
            st,
            &mut book,
            hand.as_ref(),
            &mut all_held,
            &mut children,
            &ns_pids,
        );
        drop((hand, here));
        let in_place: Vec<u32> = origins.iter().flatten().map(|l| l.main.pid()).collect();
        // Those whose memory is tracked: each is its template's again once done.
        let tracked: Vec<(u32, &Template)> = origins
            .iter()
            .zip(&st.processes)
            .filter_map(|(l, c)| {
                l.as_ref()
                    .filter(|l| l.changed.is_some())
                    .map(|l| (l.main.pid(), &c.template))
            })
            .collect();
        let wanted = ids_taken(
            st.processes
                .iter()
                .zip(&origins)
                .map(|(c, l)| (c, l.is_none())),
        );
        let mut skip = templates.to_vec();
        skip.extend(&in_place);
        // Processes killed whole keep their memory in holders till the copies
        // run: their exits then free no page, and the PIDs come free sooner.
        let holders = Holders(if in_place.is_empty() {
            hold_memories(name, cg, init_pid, &skip)
        } else {
            Vec::new()
        });
        skip.extend(&holders.0);
        // Nothing to kill where nothing else was there once the last was
        // stopped and all stopped stay (one that joins since is killed by
        // `kill_joiners`, and the files restored again).
        let nothing_else = alone.is_some_and(|held| held.iter().all(|p| in_place.contains(p)));
        let live = if nothing_else {
            Vec::new()
        } else {
            kill_live(name, cg, init_pid, &skip)?
        };
        // (Read beside: only what is left is read again.)
        let early: Option<Vec<Respawn>> = (nothing_else && planned.is_none())
            .then(|| {
                planning.take(plan_of);
                planning.wait()
            })
            .flatten()
            .map(|plans| {
                hows.iter()
                    .zip(plans)
                    .map(|(how, remake)| Respawn {
                        remake,
                        ..how.clone()
                    })
                    .collect()
            });
        let members = members(st, early.as_deref().unwrap_or(hows));
        if !live.is_empty() {
            let _ = go.send(FilesTurn::Forget);
        }
        // Killed children of processes kept are reaped in their parents' names
        // (once they are zombies); init reaps the others.
        let (theirs, init_reaps): (Vec<Killed>, Vec<Killed>) =
            live.into_iter().partition(|k| in_place.contains(&k.parent));
        for k in &theirs {
            poll_until(Duration::from_secs(10), || {
                tine_proc::stat(k.pid).map_or(true, |s| s.state == 'Z' || s.state == 'X')
            });
            if let Some(l) = origins
                .iter_mut()
                .flatten()
                .find(|l| l.main.pid() == k.parent)
            {
                l.killed_children.extend(k.ns_pid);
            }
        }
        // The threads of those rolled back in place that their templates do not
        // have end before the files' restore starts beside them, which would
        // take a CPU their exits wait for (node's six: 0.3-1.1 ms, against 0.15
        // alone); the others are kept, to be set back. (Not earlier: until here
        // an error lets the processes run on as they were.)
        // From here an error kills them: their pages can go back now, on the
        // second thread, beside the rest of the rollback.
        for (l, c) in origins.iter_mut().zip(&st.processes) {
            if let Some(l) = l {
                l.end_new_threads(&c.template, &ns_tids);
                l.push_ahead(&c.template);
            }
        }
        let (r, copies, left) = {
            // (The files' restorer, waiting since before the pause.)
            let _ = go.send(FilesTurn::Go);
            // Which pipes between them are as they were, asked beside.
            let left = pusher.as_ref().filter(|_| !shared.is_empty()).map(|p| {
                p.hand()
                    .run(tine_proc::tree::shared_left_of(&members, shared))
            });
            // The PIDs the copies take are free once the killed processes are reaped.
            wait_freed(&init_reaps, &wanted);
            // A copy made by a process that may not pick its PID (one running
            // as another user) gets it through init (`lastpid`).
            let mut setter: Option<tine_proc::lastpid::NextPid> = None;
            let mut next_pid = |pid: u32| -> Result<(), ProcError> {
                let s = match &mut setter {
                    Some(s) => s,
                    None => {
                        setter.insert(tine_proc::lastpid::NextPid::new(Tracee::seize(init_pid)?)?)
                    }
                };
                s.set(pid)
            };
            // Each child forked by its parent's copy, its template grafted on,
            // while the files are still being put back.
            let copies = tine_proc::tree::roll_back_tree(&members, origins, views, &mut next_pid);
            drop(setter);
            let files = files.and_then(|h| match restored.recv() {
                Ok(r) => Ok(r),
                // Ended without restoring: it panicked, or never had the go.
                Err(_) => Err(std::io::Error::other(match h.join() {
                    Err(_) => "the restoring thread panicked",
                    Ok(()) => "the restoring thread did not start",
                })),
            });
            (files, copies, left)
        };
        let r = r.map_err(|source| ProcessError::Io {
            name: name.to_string(),
            step: "restore the files",
            source,
        })?;
        let mut copies = copies?;
        if let Some(left) = left.and_then(|l| l.wait()) {
            copies.with_shared_left(left);
        }
        let views = copies.take_views();
        let wanted = ids_taken(st.processes.iter().map(|c| (c, true)));
        let mut skip: Vec<u32> = templates.to_vec();
        skip.extend(copies.pids());
        skip.extend(&holders.0);
        let r = kill_joiners(name, cg, init_pid, &skip, &wanted, r, restore_files)?;
        // A tracked process cloned is followed by its copy, armed before it runs.
        let mut armed = None;
        // (Till the pause is measured: the threads let go run on from there,
        // and this thread's turn would come after theirs.)
        let urgent = tine_proc::ptrace::urgent();
        let pids = copies.finish_with(shared, |made| {
            if let (Some(_), [(copy, _)]) = (&passing, made) {
                armed = tracking::Book::arm_copy(copy).map(|fd| (copy.pid(), fd));
            }
        })?;
        // Their memory is torn down as the copies run.
        drop(holders);
        let paused = t0.elapsed();
        drop((urgent, pusher, views));
        if let (Some(p), Some((copy, fd))) = (passing, armed) {
            book.adopt(p.origin, copy, fd, &st.processes[0].template, p.merged);
        }
        for (pid, tpl) in tracked {
            book.rolled_back(pid, tpl);
        }
        Ok((
            r,
            Rolled {
                pids,
                paused,
                ..Rolled::default()
            },
        ))
    })
}

/// Processes whose memory a rollback keeps past their end (see
/// `tine_proc::memhold`), killed (not waited for) when dropped.
struct Holders(Vec<u32>);

impl Drop for Holders {
    fn drop(&mut self) {
        for &pid in &self.0 {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

/// Pages of its own a template holds from which a rollback in place to it
/// uses the second thread (`tine_proc::pusher`): 32 MiB. Below, its walks
/// and copies take less than the hand-offs (a bash tree's rollback: 1.3 ms
/// inline, 2.0 through the thread).
const PUSHER_FROM_PAGES: u64 = 8192;

/// Pages changed since the checkpoint from which a rollback in place
/// pushes them back on the second thread (and seizes the template there).
const PUSHED_FROM_CHANGED: u64 = 64;

/// Whether a rollback in place to `tpl` uses the second thread: its
/// template holds [`PUSHER_FROM_PAGES`] of its own or more.
fn pushed_from(book: &tracking::Book, tpl: &Template) -> bool {
    book.own_pages_of(tpl)
        .is_some_and(|p| p >= PUSHER_FROM_PAGES)
}

/// What a clone costs besides its fork (the kill, the threads and objects
/// made again), in µs: a rollback in place costing less goes in place.
const CLONE_EXTRA_US: u64 = 1000;

/// Below this much resident memory a process's exit costs less than
/// holding its memory does.
const HOLD_AT_LEAST: u64 = 64 << 20;

/// Holders of the memory of the processes of the sandbox a rollback is
/// about to kill (in its PID namespace, not in `skip`) that hold at least
/// [`HOLD_AT_LEAST`]; one that cannot be held is killed as it is.
fn hold_memories(name: &str, cg: &Cgroup, init_pid: u32, skip: &[u32]) -> Vec<u32> {
    let sandbox_ns = pid_ns(init_pid);
    let resident = |pid: u32| {
        std::fs::read_to_string(format!("/proc/{pid}/statm"))
            .ok()
            .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
            .map_or(0, |pages| pages * 4096)
    };
    targets(name, cg, init_pid, skip)
        .unwrap_or_default()
        .into_iter()
        .filter(|&p| {
            // (A holder of an earlier rollback still ending is not held.)
            pid_ns(p) == sandbox_ns
                && resident(p) >= HOLD_AT_LEAST
                && !tine_proc::stat(p).is_ok_and(|s| s.exiting())
        })
        .filter_map(|p| tine_proc::memhold::hold_memory(p).ok())
        .collect()
}

/// A tracked single process a rollback clones: its copy is tracked in its
/// place (see [`tracking::Book::adopt`]).
struct Passing {
    origin: u32,
    merged: bool,
}

/// The origins of a tree's processes (`st`) that still live, unchanged in
/// their place (the same process, its parent the one kept before it), held
/// stopped with their threads, by index, each with where its memory may
/// differ from its template's when it is tracked (`book`); none when one
/// cannot be held, nor for a single process whose memory is not tracked
/// (its copy is cloned from its template, cheaper than comparing all its
/// pages) — and then, when it is tracked, what passes to its copy.
/// `ns_pids`: the PID in the sandbox of each that may be one, read before.
fn live_origins(
    init_pid: u32,
    st: &ProcessState,
    book: &mut tracking::Book,
    pusher: Option<&tine_proc::pusher::Hand>,
    all_held: &mut dyn FnMut(&[u32]) -> bool,
    children: &mut std::collections::HashMap<u32, tine_proc::inspect::ChildrenFiles>,
    ns_pids: &std::collections::HashMap<u32, u32>,
) -> (Vec<Option<tine_proc::tree::Live>>, Option<Passing>) {
    let none = || st.processes.iter().map(|_| None).collect();
    let sessions = st.processes.iter().any(|c| c.anchor.is_some());
    let single = !st.is_tree() && !sessions;
    let mut hosts: Vec<Option<u32>> = Vec::with_capacity(st.processes.len());
    for c in &st.processes {
        // Its origin, or a copy of it that a rollback tracked since: asked
        // by PID, not by listing the sandbox (templates and spares
        // included: 0.2-0.5 ms).
        let tpl = &c.template;
        let parent = match (c.parent, c.anchor) {
            // A session's command: under its client, which still runs.
            (None, Some((client, start))) => tine_proc::stat(client)
                .is_ok_and(|s| s.start_time == start)
                .then_some(client),
            (None, None) => Some(init_pid),
            (Some(p), _) => st
                .processes
                .iter()
                .position(|x| x.ns_pid == p)
                .and_then(|i| hosts.get(i).copied().flatten()),
        };
        let host = std::iter::once(tpl.origin)
            .chain(book.followers(tpl))
            .filter(|h| ns_pids.get(h) == Some(&c.ns_pid))
            .find(|h| {
                // (Or a copy cloned from it that a rollback tracked since.)
                tine_proc::stat(*h).is_ok_and(|s| {
                    ((c.template.origin_start != 0 && s.start_time == c.template.origin_start)
                        || book.follows(*h, s.start_time, &c.template))
                        && !s.exiting()
                        && Some(s.ppid) == parent
                })
            });
        hosts.push(host);
    }
    if single && hosts.iter().all(Option::is_none) {
        return (none(), None);
    }
    let last = hosts.iter().rposition(Option::is_some);
    // A tree's processes are scanned on both threads, every other one
    // handed to the second (PostgreSQL's seven: ~1 ms each, one after
    // another); there each scan is walked whole by the thread it is on.
    // Not the last: the files' restorer starts then, on the second CPU.
    let across = !single && hosts.iter().flatten().count() > 1;
    let away = pusher.filter(|_| across);
    let mut stopped = Vec::with_capacity(hosts.len());
    let mut scans = Vec::with_capacity(hosts.len());
    // Nothing else was left in the sandbox once the last was stopped.
    let mut alone = false;
    for (i, (h, c)) in hosts.iter().zip(&st.processes).enumerate() {
        let Some(pid) = *h else {
            scans.push(None);
            continue;
        };
        match tine_proc::threads::stop_all(pid, c.template.syscall_at) {
            Ok(threads) => {
                stopped.push(pid);
                if Some(i) == last {
                    alone = all_held(&stopped);
                }
                let scan = match away {
                    Some(hand) if stopped.len() % 2 == 1 && Some(i) != last => {
                        let to = book.to_scan(pid, &c.template);
                        Scan::Away(to.map(|to| hand.run(move || to.scan(None))))
                    }
                    Some(_) => {
                        Scan::Found(book.to_scan(pid, &c.template).and_then(|to| to.scan(None)))
                    }
                    // The second thread pays for its hand-offs (a wakeup
                    // each way) only where the walks and copies are long:
                    // not for a shell.
                    None => Scan::Done(book.changed_since(
                        pid,
                        &c.template,
                        pusher.filter(|_| pushed_from(book, &c.template)),
                    )),
                };
                scans.push(Some((threads, scan)));
            }
            // Dropped, the ones held so far run on: all are made anew.
            Err(_) => return (none(), None),
        }
    }
    // What the scans found, taken into the record and saved once.
    let mut unsaved = false;
    let found: Vec<_> = scans
        .into_iter()
        .zip(&st.processes)
        .map(|(scan, c)| {
            scan.map(|(threads, scan)| {
                let pid = threads.0.pid();
                let found = match scan {
                    Scan::Done(how) => return (threads, how),
                    Scan::Found(found) => found,
                    Scan::Away(ran) => ran.and_then(|r| r.wait().flatten()),
                };
                unsaved = true;
                let how = found.and_then(|f| book.merge_unsaved(pid, &c.template, f));
                (threads, how)
            })
        })
        .collect();
    let saved = !unsaved || book.save();
    let mut held = Vec::with_capacity(hosts.len());
    for (found, c) in found.into_iter().zip(&st.processes) {
        let Some(((main, others), how)) = found else {
            held.push(None);
            continue;
        };
        let pid = main.pid();
        let how = how.filter(|_| saved);
        // A single process whose pages would cost more to copy back than
        // its template's fork did is cloned instead (it freed and touched
        // much memory since, say).
        let clone = single
            && how.as_ref().is_none_or(|h| {
                h.cost_us
                    .is_some_and(|us| us > c.template.fork_us + CLONE_EXTRA_US)
            });
        let merged = how.is_some();
        if clone {
            let passing = book.tracks(pid).then_some(Passing {
                origin: pid,
                merged,
            });
            return (none(), passing);
        }
        let (changed, source, maps) = how.map_or((None, None, None), |h| {
            (Some(h.changed), h.source, Some(h.maps))
        });
        // Its pages pushed back by that thread, from what was read of the
        // template before; not a few, which the graft copies in less time
        // than that thread takes to seize the template (a pool's: 8 pages,
        // 0.1-0.6 ms a seize, the last push late in the pause).
        let pusher = pusher
            .filter(|_| pushed_from(book, &c.template))
            .filter(|_| {
                changed
                    .as_ref()
                    .is_some_and(|c| c.pages() >= PUSHED_FROM_CHANGED)
            })
            .filter(|_| source.is_some())
            .cloned();
        held.push(Some(tine_proc::tree::Live {
            main,
            others,
            kept: vec![],
            killed_children: vec![],
            changed,
            source,
            maps,
            pusher,
            ahead: None,
            table: None,
            children: children.remove(&pid).unwrap_or_default(),
        }));
    }
    // The templates pushed from are seized by that thread now, while the
    // rest is killed (not earlier: until here all may be made anew).
    // (Each asked first whether its descriptors are its template's, which
    // its graft waits for before its pushed pages; only where nothing is
    // left to kill that could share its table and change it meanwhile.)
    for (l, c) in held.iter_mut().zip(&st.processes) {
        if let Some(l) = l.as_mut().filter(|_| alone) {
            l.ask_table(&c.template, pusher);
        }
        if let Some(hand) = l.as_ref().and_then(|l| l.pusher.as_ref()) {
            hand.hold(&c.template);
        }
    }
    (held, None)
}

/// A stopped process's scan: done and saved, done on this thread, or
/// handed to the second (`None`: not tracked).
enum Scan {
    Done(Option<tracking::InPlace>),
    Found(Option<tracking::Scanned>),
    Away(Option<tine_proc::pusher::Ran<Option<tracking::Scanned>>>),
}

/// The processes of `st` as members of a tree, each with its parent's
/// index (listed before it) and `hows`' entry.
pub(crate) fn members<'a>(
    st: &'a ProcessState,
    hows: &'a [Respawn],
) -> Vec<tine_proc::tree::Member<'a>> {
    members_of(&st.processes, hows)
}

/// [`members`] of a list of processes (parents first; a parent not in it
/// makes a root).
pub(crate) fn members_of<'a>(
    processes: &'a [Captured],
    hows: &'a [Respawn],
) -> Vec<tine_proc::tree::Member<'a>> {
    let index = |ns: u32| processes.iter().position(|c| c.ns_pid == ns);
    processes
        .iter()
        .zip(hows)
        .map(|(c, how)| tine_proc::tree::Member {
            tpl: &c.template,
            how,
            // A parent missing from the record: refused as listed out of order.
            parent: c.parent.map(|p| index(p).unwrap_or(usize::MAX)),
            leads_session: c.leads_session || c.parent.is_none(),
            pgid: (c.pgid != 0 && !c.leads_session).then_some(c.pgid),
            foreground: c.foreground,
            zombies: &c.zombies,
        })
        .collect()
}

/// Some template gone: the files are restored first (CRIU checks the files
/// its process holds), the templates brought back from their images, then
/// the copies made from all of them. `run`: whether the record is of this
/// run of the sandbox, and the current init's start time.
#[allow(clippy::too_many_arguments)]
fn rollback_persisted<R>(
    name: &str,
    cg: &Cgroup,
    dirs: &SandboxDirs,
    init_pid: u32,
    (same_run, init_start): (bool, u64),
    st: &mut ProcessState,
    criu: Option<&Criu>,
    hows: &[Respawn],
    templates: &[u32],
    restore_files: &impl Fn(bool) -> R,
) -> Result<(R, Rolled), ProcessError> {
    let t0 = Instant::now();
    let wanted = ids_taken(st.processes.iter().map(|c| (c, true)));
    let live = kill_live(name, cg, init_pid, templates)?;
    let r = restore_files(false);
    wait_freed(&live, &wanted);
    let r = kill_joiners(name, cg, init_pid, templates, &wanted, r, restore_files)?;
    let mut rolled = Rolled::default();
    for c in &mut st.processes {
        if same_run && tine_proc::template::template_alive(&c.template) {
            continue;
        }
        let (Some(img), Some(criu)) = (&c.image, criu) else {
            return Err(ProcError::TemplateGone {
                pid: c.template.pid,
            }
            .into());
        };
        // A template just let go may still be exiting: its PID comes free
        // only once it is reaped.
        poll_until(Duration::from_secs(10), || {
            !tine_proc::stat(c.template.pid).is_ok_and(|s| s.start_time == c.template.start_time)
        });
        let pid = crate::criu::restore(
            criu,
            init_pid,
            &cg.procs_files(),
            img,
            &criu_dir(dirs).join(&img.dir),
            |ns| find_ns_pid(cg, ns),
        )?;
        c.template.pid = pid;
        c.template.start_time = tine_proc::stat(pid)?.start_time;
        // CRIU may have put its vDSO elsewhere: looked up again.
        c.template.syscall_at = 0;
        rolled.from_images += 1;
    }
    if rolled.from_images > 0 {
        // The templates now live in this run of the sandbox.
        st.init_pid = init_pid;
        st.init_start = init_start;
        save(dirs, st).map_err(ProcessError::io(
            name,
            "record templates brought back by CRIU",
        ))?;
    }
    for (c, how) in st.processes.iter().zip(hows) {
        rolled.pids.extend(tine_proc::template::respawn_many(
            &c.template,
            std::slice::from_ref(how),
        )?);
    }
    rolled.paused = t0.elapsed();
    Ok((r, rolled))
}

pub(super) fn criu_dir(dirs: &SandboxDirs) -> PathBuf {
    dirs.root.join("criu")
}

/// Creates a sandbox's CRIU images directory (root only: images hold memory).
fn create_criu_dir(name: &str, dirs: &SandboxDirs) -> Result<PathBuf, ProcessError> {
    use std::os::unix::fs::DirBuilderExt;
    let dir = criu_dir(dirs);
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
        .map_err(ProcessError::io(name, "create the CRIU images directory"))?;
    Ok(dir)
}

/// Gives the sandbox at `dst` (a fork of `src`) the persisted process state
/// `st` as its own: the images hard-linked into its directory, descriptors
/// of `src`'s own files (its logs) pointed at `dst`'s, and a record of no
/// live template, so that a rollback there brings the processes back from
/// the images. Returns that record.
pub fn adopt(
    name: &str,
    st: &ProcessState,
    src: &SandboxDirs,
    dst: &SandboxDirs,
) -> Result<ProcessState, ProcessError> {
    let io = |step| ProcessError::io(name, step);
    let to = create_criu_dir(name, dst)?;
    let mut out = st.clone();
    out.init_pid = 0;
    out.init_start = 0;
    for c in &mut out.processes {
        c.template.pid = 0;
        c.template.start_time = 0;
        let Some(img) = &mut c.image else { continue };
        let (from, into) = (criu_dir(src).join(&img.dir), to.join(&img.dir));
        std::fs::create_dir_all(&into).map_err(io("create a fork's images directory"))?;
        for e in std::fs::read_dir(&from).map_err(io("list images"))? {
            let e = e.map_err(io("list images"))?;
            let target = into.join(e.file_name());
            if !target.exists() {
                std::fs::hard_link(e.path(), &target).map_err(io("link images"))?;
            }
        }
        for x in &mut img.externals {
            if let Ok(rest) = x.path.strip_prefix(&src.root) {
                x.path = dst.root.join(rest);
            }
        }
    }
    save(dst, &out).map_err(io("record a fork's process state"))?;
    Ok(out)
}

/// Persists every template of `st` with CRIU into the sandbox's directory
/// and records the images. The templates stay parked, the program runs on.
/// Returns the bytes written.
pub fn persist(
    name: &str,
    criu: &Criu,
    cg: &Cgroup,
    dirs: &SandboxDirs,
    st: &mut ProcessState,
) -> Result<u64, ProcessError> {
    if let Some(c) = st.processes.iter().find(|c| c.parent.is_some()) {
        return Err(ProcError::NotPersistable(tine_proc::NotCloneable::of(
            c.template.origin,
            c.cmdline.clone(),
            format!(
                "it is a child of process {} in the sandbox; process trees are checkpointed natively only",
                c.parent.unwrap_or(0)
            ),
        ))
        .into());
    }
    let dir = create_criu_dir(name, dirs)?;
    let mut bytes = 0;
    for c in &mut st.processes {
        let dest = dir.join(format!("{}-{}", st.snapshot, c.ns_pid));
        // CRIU reads the template's own signal mask (parked, it blocks all).
        let _exposed = tine_proc::template::exposed(&c.template)?;
        let img = crate::criu::dump(
            criu,
            st.init_pid,
            &cg.procs_files(),
            c.template.pid,
            (c.ns_pid, &c.cmdline),
            &dest,
        )?;
        bytes += img.bytes;
        c.image = Some(img);
    }
    save(dirs, st).map_err(ProcessError::io(name, "record CRIU images"))?;
    Ok(bytes)
}
