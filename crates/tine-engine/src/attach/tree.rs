//! The process tree of an attached process: its descendants stopped with
//! it at a checkpoint, each forking a template (the root beside it or as
//! its own child, the others handed to their namespace's reaper so that no
//! program sees an extra child); and rolled back together in place — the
//! ones still running grafted back, those that ended since made again
//! from their parents under their PIDs, whatever was started since killed.

use std::time::{Duration, Instant};

use super::proc_error;
use crate::EngineError;
use serde::{Deserialize, Serialize};
use tine_proc::ProcError;
use tine_proc::ptrace::Tracee;
use tine_proc::template::{
    Hop, Placement, Respawn, Template, Unsettled, fork_template_via, make_template_among,
};

/// How many times the stops are tried when the tree changes under them (a
/// shell starts a command every few milliseconds).
const STOP_TRIES: usize = 5;

/// The most processes a tree may have.
pub(super) const MOST: usize = 512;

/// A process of an attached tree below its root, as a checkpoint holds it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct Below {
    pub template: Template,
    /// Its parent: 0 for the root, else 1 + its index among the others
    /// (listed before it).
    pub parent: usize,
    /// Its PID in its namespace, which it gets back when made again.
    pub ns_pid: u32,
    pub leads_session: bool,
    /// Its process group (in its namespace), where not its parent's.
    pub pgid: Option<u32>,
    /// Its children that had ended, unreaped, at the checkpoint.
    pub zombies: Vec<(u32, i32)>,
}

/// The processes of a tree, stopped (with their other threads), parents
/// first: the root, then the others with their parents' indexes. Dropped,
/// they run on.
pub(super) struct Stopped {
    pub procs: Vec<(Tracee, Vec<Tracee>)>,
    pub parents: Vec<usize>,
}

/// Whether `pid` runs and is not a zombie.
fn running(pid: u32) -> bool {
    tine_proc::stat(pid).is_ok_and(|s| s.state != 'Z' && s.state != 'X' && !s.exiting())
}

/// The tree under `root` (root first, parents before children, each with
/// its parent's index), leaving out `skip` (templates) and zombies.
fn listed(root: u32, skip: &[u32]) -> Vec<(u32, usize)> {
    let mut out = vec![(root, 0)];
    let mut i = 0;
    while i < out.len() && out.len() <= MOST {
        for c in tine_proc::inspect::children_of(out[i].0) {
            if !skip.contains(&c) && running(c) && !out.iter().any(|(p, _)| *p == c) {
                out.push((c, i));
            }
        }
        i += 1;
    }
    out
}

/// Stops `root` and every process below it (but `skip`, its templates),
/// checking each can be forked. A tree that changed between the listing
/// and the stops lets them run again and is stopped again, a few times.
pub(super) fn stop(root: u32, skip: &[u32]) -> Result<Stopped, ProcError> {
    let mut tries = 0;
    loop {
        tries += 1;
        match stop_once(root, skip) {
            Err(Changed::Again(_)) if tries < STOP_TRIES => {}
            Err(Changed::Again(e) | Changed::Fail(e)) => return Err(e),
            Ok(s) => return Ok(s),
        }
    }
}

enum Changed {
    /// The tree changed meanwhile: try again.
    Again(ProcError),
    Fail(ProcError),
}

fn stop_once(root: u32, skip: &[u32]) -> Result<Stopped, Changed> {
    let list = listed(root, skip);
    if list.len() > MOST {
        return Err(Changed::Fail(ProcError::NotCloneable(
            tine_proc::NotCloneable::of(
                root,
                tine_proc::inspect::cmdline(root),
                format!("its tree has more than {MOST} processes"),
            ),
        )));
    }
    let pids: Vec<u32> = list.iter().map(|(p, _)| *p).collect();
    let mut members = pids.clone();
    members.extend(skip);
    for (i, &pid) in pids.iter().enumerate() {
        match tine_proc::inspect::cloneable_in(pid, &members, false) {
            Ok(_) => {}
            // One ended, or a child was started, since the listing.
            Err(e @ ProcError::Gone { .. }) if i > 0 => return Err(Changed::Again(e)),
            Err(ProcError::NotCloneable(n)) if n.reason.contains("live child process") => {
                return Err(Changed::Again(ProcError::NotCloneable(n)));
            }
            Err(e) => return Err(Changed::Fail(e)),
        }
    }
    let calls: Vec<u64> = pids
        .iter()
        .map(|&p| tine_proc::ptrace::find_syscall_instruction(p).unwrap_or(0))
        .collect();
    let mut procs = Vec::with_capacity(pids.len());
    for (&pid, &at) in pids.iter().zip(&calls) {
        match tine_proc::threads::stop_all(pid, at) {
            Ok(held) => procs.push(held),
            Err(e @ ProcError::Gone { .. }) if pid != root => return Err(Changed::Again(e)),
            Err(e) => return Err(Changed::Fail(e)),
        }
    }
    // All stopped: the tree is what was listed, or it is stopped again.
    let now: Vec<u32> = listed(root, skip).into_iter().map(|(p, _)| p).collect();
    if now != pids {
        let new = now
            .iter()
            .find(|p| !pids.contains(p))
            .copied()
            .unwrap_or(root);
        return Err(Changed::Again(ProcError::NotCloneable(
            tine_proc::NotCloneable::of(
                new,
                tine_proc::inspect::cmdline(new),
                "it was started while the checkpoint was being taken".into(),
            ),
        )));
    }
    Ok(Stopped {
        procs,
        parents: list.into_iter().map(|(_, p)| p).collect(),
    })
}

/// What a checkpoint's templates are: the root's, the others', and those
/// still to settle once the tree runs again (dropped, they are killed).
pub(super) struct Made {
    pub root: Template,
    pub below: Vec<Below>,
    pub unsettled: Vec<Unsettled>,
}

/// Forks every stopped process's template. `skip`: templates there
/// already (a namespace's init has them as children).
pub(super) fn templates(s: &mut Stopped, skip: &[u32]) -> Result<Made, ProcError> {
    let root_pid = s.procs[0].0.pid();
    let root_stat = tine_proc::stat(root_pid)?;
    // The first process of a PID namespace may make no sibling: its
    // template is its own child. One that does not lead its session keeps
    // its template (and copies) in it.
    let placement = if is_ns_init(root_pid) {
        Placement::Child
    } else if root_stat.session == root_pid {
        Placement::Beside
    } else {
        Placement::BesideInSession
    };
    let mut members: Vec<u32> = s.procs.iter().map(|(t, _)| t.pid()).collect();
    members.extend(skip);
    // Shared memory stays shared among the templates of one checkpoint.
    let mut shm = tine_proc::shm::TreeShm::default();
    let root = {
        let (t, others) = &mut s.procs[0];
        make_template_among(t, others, &members, placement, &mut shm)
    }?;
    match below(s, &root_stat, &mut shm) {
        Ok((below, unsettled)) => Ok(Made {
            root,
            below,
            unsettled,
        }),
        Err(e) => {
            tine_proc::template::discard(&root);
            Err(e)
        }
    }
}

/// The templates of the processes below the root, handed to their
/// namespace's reaper.
fn below(
    s: &mut Stopped,
    root_stat: &tine_proc::Stat,
    shm: &mut tine_proc::shm::TreeShm,
) -> Result<(Vec<Below>, Vec<Unsettled>), ProcError> {
    let mut below = Vec::new();
    let mut unsettled = Vec::new();
    let groups: Vec<u32> = s
        .procs
        .iter()
        .map(|(t, _)| tine_proc::stat(t.pid()).map_or(root_stat.pgrp, |st| st.pgrp))
        .collect();
    for i in 1..s.procs.len() {
        let parent = s.parents[i];
        let (t, others) = &mut s.procs[i];
        let pid = t.pid();
        let st = tine_proc::stat(pid)?;
        let zombies = tine_proc::inspect::zombies(pid)?;
        let (tpl, u) = fork_template_via(t, others, None, Hop::Orphan, shm, None)?;
        unsettled.push(u);
        let leads_session = st.session == pid;
        below.push(Below {
            ns_pid: tine_proc::template::ns_pid(pid).unwrap_or(pid),
            template: tpl,
            parent,
            leads_session,
            pgid: (!leads_session && st.pgrp != groups[parent])
                .then(|| tine_proc::inspect::ns_pgid(pid))
                .flatten(),
            zombies,
        });
    }
    Ok((below, unsettled))
}

/// Whether `pid` is the first process of a PID namespace of its own (a
/// container's init).
pub(super) fn is_ns_init(pid: u32) -> bool {
    tine_proc::inspect::ns_pids(pid).is_some_and(|p| p.len() > 1 && p.last() == Some(&1))
}

/// Whether `pid` holds `CAP_CHECKPOINT_RESTORE` or `CAP_SYS_ADMIN` (its
/// `CapEff`).
fn may_restore(pid: u32) -> bool {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .unwrap_or(0);
    const CAP_SYS_ADMIN: u32 = 21;
    const CAP_CHECKPOINT_RESTORE: u32 = 40;
    eff & (1 << CAP_SYS_ADMIN | 1 << CAP_CHECKPOINT_RESTORE) != 0
}

/// Kills every process below `root` but `keep` (its live members and its
/// templates), deepest first, and waits (up to 5 s) until each has ended:
/// a rollback in place then reaps those that are its members' children.
fn kill_started_since(root: u32, keep: &[u32]) {
    // (A set: a fork bomb below it must not make the walk quadratic.)
    let mut seen = std::collections::HashSet::from([root]);
    let mut next = vec![root];
    let mut doomed = Vec::new();
    while let Some(p) = next.pop() {
        for c in tine_proc::inspect::children_of(p) {
            if seen.len() < 100_000 && seen.insert(c) {
                next.push(c);
                if !keep.contains(&c) {
                    doomed.push(c);
                }
            }
        }
    }
    for &c in doomed.iter().rev() {
        if let Some(p) = rustix::process::Pid::from_raw(c as i32) {
            let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
        }
    }
    let until = Instant::now() + Duration::from_secs(5);
    for &c in &doomed {
        while running(c) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// Sets the next PID of `root`'s PID namespace (a process below the root,
/// made again by its parent's copy, gets its PID back so, its parent
/// lacking the capability to ask for it). In tine's own namespace the file
/// is written here; in a container's, by a shell `nsenter` starts there
/// (the kernel takes the namespace from the writer; tine's user namespace
/// owns a root Podman container's, so the write is allowed).
fn next_pid_of(root: u32) -> impl FnMut(u32) -> Result<(), ProcError> {
    let here = tine_proc::inspect::ns_pids(root).is_some_and(|p| p.len() == 1);
    let last = |pid: u32| pid.saturating_sub(1).to_string();
    move |pid: u32| {
        let failed = |source: std::io::Error| ProcError::Injected {
            pid,
            call: "write ns_last_pid",
            source,
        };
        if here {
            return std::fs::write("/proc/sys/kernel/ns_last_pid", last(pid)).map_err(failed);
        }
        let o = std::process::Command::new("nsenter")
            .arg("--target")
            .arg(root.to_string())
            .args(["--pid", "--", "/bin/sh", "-c"])
            .arg(format!("echo {} > /proc/sys/kernel/ns_last_pid", last(pid)))
            .stdin(std::process::Stdio::null())
            .output()
            .map_err(|e| {
                failed(std::io::Error::other(format!(
                    "run nsenter (util-linux): {e}"
                )))
            })?;
        if o.status.success() {
            Ok(())
        } else {
            Err(failed(std::io::Error::other(format!(
                "nsenter: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            ))))
        }
    }
}

/// Rolls the tree of `root` (the origin of `tpl`, still running) back to
/// its checkpoint in place: its members that still run (the same
/// processes under the same parents) are stopped, whatever else runs below
/// it is killed, `files` runs while nothing of it runs, then each member
/// still running gets its template grafted on and each that ended is made
/// again from its parent's copy under its PID. It keeps its PID, parent
/// and session. If `files` fails it runs on as it was.
pub(super) fn roll_back<R>(
    name: &str,
    root: u32,
    tpl: &Template,
    below: &[Below],
    hows: &[Respawn],
    templates: &[u32],
    files: impl FnOnce() -> Result<R, EngineError>,
) -> Result<R, EngineError> {
    // Which members still run: the same process (its start time), under
    // the same parent, which runs too.
    let mut hosts: Vec<Option<u32>> = vec![Some(root)];
    for b in below {
        let parent = hosts[b.parent];
        let o = b.template.origin;
        let same = tine_proc::stat(o).is_ok_and(|s| {
            s.start_time == b.template.origin_start && !s.exiting() && Some(s.ppid) == parent
        });
        hosts.push(same.then_some(o));
    }
    // One that ended is made again by its parent's copy and its template
    // grafted on, which sets its executable (`PR_SET_MM_MAP`): that needs
    // the capability in the tree itself. Refused before anything is done,
    // for a failed graft would leave the tree half made.
    if let Some(i) = hosts.iter().position(Option::is_none)
        && !may_restore(root)
    {
        let b = &below[i - 1];
        return Err(EngineError::Reported {
            kind: tine_store::ErrorKind::Unsupported,
            message: format!(
                "attached {name}: its process {} ({}) ended since the checkpoint, and making it again needs CAP_CHECKPOINT_RESTORE (or CAP_SYS_ADMIN) in its tree, which it lacks (a container: `podman run --cap-add CHECKPOINT_RESTORE`); nothing was changed",
                b.ns_pid,
                tine_proc::inspect::cmdline(b.template.pid)
            ),
        });
    }
    let tpls: Vec<&Template> = std::iter::once(tpl)
        .chain(below.iter().map(|b| &b.template))
        .collect();
    let mut lives: Vec<Option<tine_proc::tree::Live>> = Vec::with_capacity(hosts.len());
    for (h, t) in hosts.iter().zip(&tpls) {
        lives.push(match h {
            Some(pid) => {
                let (main, others) = tine_proc::threads::stop_all(*pid, t.syscall_at)
                    .map_err(|e| proc_error(name, "stop it", e))?;
                Some(tine_proc::tree::Live {
                    main,
                    others,
                    kept: vec![],
                    killed_children: vec![],
                    changed: None,
                    source: None,
                    maps: None,
                    pusher: None,
                    ahead: None,
                    table: None,
                    children: Default::default(),
                })
            }
            None => None,
        });
    }
    let mut keep: Vec<u32> = templates.to_vec();
    keep.extend(hosts.iter().flatten());
    kill_started_since(root, &keep);
    let r = files()?;
    let root_leads = tine_proc::stat(root).is_ok_and(|s| s.session == root);
    let mut members = vec![tine_proc::tree::Member {
        tpl,
        how: &hows[0],
        parent: None,
        leads_session: root_leads,
        pgid: None,
        zombies: &[],
        foreground: None,
    }];
    for (b, how) in below.iter().zip(&hows[1..]) {
        members.push(tine_proc::tree::Member {
            tpl: &b.template,
            how,
            parent: Some(b.parent),
            leads_session: b.leads_session,
            pgid: b.pgid,
            zombies: &b.zombies,
            foreground: None,
        });
    }
    let mut next_pid = next_pid_of(root);
    tine_proc::tree::roll_back_tree(&members, lives, Default::default(), &mut next_pid)
        .and_then(|copies| copies.finish(&[]))
        .map_err(|e| proc_error(name, "roll it back in place", e))?;
    Ok(r)
}
