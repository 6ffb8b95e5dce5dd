//! Spare templates: a copy of a template forked off the pause, made into
//! the next checkpoint's template by copying in only what its origin
//! changed since — so that a checkpoint's pause no longer pays for the
//! kernel copying every page table of the process (`fork`), which grows
//! with its memory (7–9 ms at 566 MB of 4 KiB pages on the development VM).
//!
//! A spare is forked from a template after its checkpoint returned
//! (`template::prepare_parked`, by the sandbox's supervisor), its origin
//! running again. At the next checkpoint of a tracked origin whose
//! template's spare is ready, the origin stays stopped while the spare is
//! grafted (`graft`) into its copy: the pages the origin may differ in from
//! that template (its tracking set, plus pages of the template it dropped),
//! its layout, descriptors, signal dispositions and main thread's state.
//! Whatever a graft does not carry and a fork would (credentials,
//! namespaces, limits, seccomp filters, shared memory) must be the same in
//! both, or the checkpoint forks as before. Most pages reach
//! the spare before the pause, while the origin still runs (`precopy`);
//! the pause copies those written since.

use nix::libc;
use serde::{Deserialize, Serialize};

use crate::inspect::{ProcError, stat};
use crate::ptrace::Tracee;
use crate::template::{Session, Template, Unsettled, inject_fork, origin_state};

/// A spare: a parked copy of a template, ready to become the next one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Spare {
    pub pid: u32,
    pub start_time: u64,
    /// How long the fork that made it took, in µs: what the checkpoint it
    /// serves does not pay in its pause.
    pub fork_us: u64,
}

/// Forks a spare from template `tpl` (held): a sibling of it
/// (the sandbox's init's child), in a session of its own, parked.
pub(crate) fn make(tpl: &mut Tracee) -> Result<Spare, ProcError> {
    let t0 = std::time::Instant::now();
    let mut child = inject_fork(tpl, true, None)?;
    let fork_us = t0.elapsed().as_micros() as u64;
    // It continues (when made a template and cloned) where the template does.
    child.set_saved_regs(*tpl.saved_regs());
    let made = child
        .syscall("setsid", libc::SYS_setsid, [0; 6])
        .and_then(|_| stat(child.pid()));
    match made {
        Ok(st) => {
            let spare = Spare {
                pid: child.pid(),
                start_time: st.start_time,
                fork_us,
            };
            child.block_signals_when_parked();
            child.park()?;
            Ok(spare)
        }
        Err(e) => {
            child.kill();
            Err(e)
        }
    }
}

/// Whether spare `s` is still the process it names.
pub fn alive(s: &Spare) -> bool {
    stat(s.pid).is_ok_and(|st| st.start_time == s.start_time && !st.exiting())
}

/// Kills spare `s` (one no longer needed), if it is still that process.
pub fn discard(s: &Spare) {
    if alive(s) {
        crate::template::kill_and_reap(s.pid);
    }
}

/// What [`take`] reads of a spare, which never runs, before the pause
/// (inside it, with its process's: 0.3 ms): what it inherited, and its
/// `fdinfo` files, opened (see [`crate::fdtable::FdInfos`]).
#[derive(Debug, Default)]
pub struct Ahead {
    inherited: Option<String>,
    fds: crate::fdtable::FdInfos,
}

impl Ahead {
    /// Of spare `spare`, whose descriptors are `fds`.
    pub fn read(spare: &Spare, fds: impl Iterator<Item = i32>) -> Ahead {
        Ahead {
            inherited: inherited(spare.pid),
            fds: crate::fdtable::FdInfos::open(spare.pid, fds),
        }
    }
}

/// What of `/proc/PID/status` a fork inherits and a graft does not set.
const STATUS_KEPT: &[&str] = &[
    "Uid:",
    "Gid:",
    "Groups:",
    "CapInh:",
    "CapPrm:",
    "CapEff:",
    "CapBnd:",
    "CapAmb:",
    "NoNewPrivs:",
    "Seccomp:",
    "Seccomp_filters:",
    "THP_enabled:",
    "Speculation_Store_Bypass:",
];

/// The state of process `pid` that a fork inherits and a graft does not
/// set: credentials, seccomp, limits, namespaces, cgroup, personality.
pub(crate) fn inherited(pid: u32) -> Option<String> {
    let read = |what: &str| std::fs::read_to_string(format!("/proc/{pid}/{what}")).ok();
    let status = read("status")?;
    let mut out: String = status
        .lines()
        .filter(|l| STATUS_KEPT.iter().any(|k| l.starts_with(k)))
        .collect::<Vec<_>>()
        .join("\n");
    for what in ["limits", "cgroup", "personality", "oom_score_adj"] {
        out.push_str(&read(what)?);
    }
    for ns in ["mnt", "net", "user", "uts", "ipc", "cgroup", "time", "pid"] {
        let link = std::fs::read_link(format!("/proc/{pid}/ns/{ns}")).ok()?;
        out.push_str(&link.to_string_lossy());
    }
    Some(out)
}

/// Makes spare `spare` of template `base` into the template of stopped
/// process `t` (its other threads stopped in `others`), which may differ
/// from `base` only in the pages of `changed`. `Ok(None)`: the spare cannot
/// serve this checkpoint (it is left as it was; fork instead). On an error
/// the spare is killed; `t` is never changed either way. `maps`: `t`'s
/// `/proc/PID/maps` text where it was read since `t` stopped (and nothing
/// changed its mappings since); `ahead`: what was read of the spare
/// before the pause.
pub fn take(
    t: &mut Tracee,
    others: &mut [Tracee],
    flags: Option<&crate::forkflags::Scan>,
    (spare, ahead): (&Spare, &Ahead),
    base: &Template,
    changed: &crate::dirty::Ranges,
    maps: Option<String>,
) -> Result<Option<(Template, Unsettled)>, ProcError> {
    let pid = t.pid();
    let _here = crate::ptrace::hold_here();
    if !alive(spare) || !base.shm.is_empty() {
        return Ok(None);
    }
    let o = origin_state(t, others, flags, maps)?;
    // Shared memory the template must copy: the fork's way. (Mappings a
    // fork leaves out or wipes are the spare's like any other — its
    // template had them copied whole — and their flags are recorded for
    // the copies, as a fork's template records them.)
    if !o.shm.is_empty() {
        return Ok(None);
    }
    let mine = inherited(pid);
    if mine.is_none() || mine != ahead.inherited {
        return Ok(None);
    }
    let mut child = Tracee::seize_at(spare.pid, base.syscall_at)?;
    let made = graft_into(t, &mut child, &o, changed, &ahead.fds);
    let dumpable = match made {
        Ok(d) => d,
        Err(e) => {
            child.kill();
            return Err(e);
        }
    };
    // The fork that made its memory, off the pause.
    let tpl = o.template(&mut child, spare.start_time, t, dumpable, spare.fork_us);
    Ok(Some((tpl, Unsettled::new(child, Session::Has))))
}

/// The graft of `child` (the spare) into `t`'s copy; returns `t`'s dumpable
/// flag (the copy stays not dumpable).
pub(crate) fn graft_into(
    t: &mut Tracee,
    child: &mut Tracee,
    o: &crate::template::Origin,
    changed: &crate::dirty::Ranges,
    infos: &crate::fdtable::FdInfos,
) -> Result<u64, ProcError> {
    // (Its map as its state was read: nothing changed it since.)
    let source = crate::graft::source_with(t, false, Some(o.maps.clone()))?;
    let dumpable = t.syscall(
        "prctl(PR_GET_DUMPABLE)",
        libc::SYS_prctl,
        [libc::PR_GET_DUMPABLE as u64, 0, 0, 0, 0, 0],
    )?;
    // `t` as the graft's template: its descriptors, its shared memory
    // (none), and the copy left not dumpable.
    let from = Template {
        pid: t.pid(),
        start_time: 0,
        origin: 0,
        origin_start: 0,
        fds: o.fds.clone(),
        foreground: false,
        has_tty: false,
        syscall_at: t.syscall_at(),
        cwd: o.cwd.clone(),
        dumpable: 0,
        threads: Vec::new(),
        robust_list: o.robust_list,
        fork_us: 0,
        fork_flags: Default::default(),
        queued: Default::default(),
        in_origin_session: false,
        shm: Vec::new(),
        sigmask: None,
    };
    crate::graft::graft_untracked(child, &from, changed, &source, infos)?;
    // A fork's copy has its maker's CPU affinity.
    if let Some(cpus) = t.affinity() {
        child.set_affinity_at_release(cpus);
    }
    // As a fork's copy does: descriptions of its own for locked files.
    for e in o
        .fds
        .iter()
        .filter(|e| e.locks.iter().any(crate::fixes::held_by_description))
    {
        crate::fixes::own_description(child, e)?;
    }
    Ok(dumpable)
}

/// Before a checkpoint, while process `pid` still runs: copies into spare
/// `spare` (of template `base`) the pages of `changed` (where `pid` may
/// differ from `base`, its writes up to now protected again first) that
/// `pid` holds of its own, in the private writable mappings both have alike
/// — so that the checkpoint's pause copies only what `pid` writes from here
/// (see [`take`]'s `changed`). Returns the ranges copied. A page `pid`
/// writes meanwhile is copied torn, and found written at the checkpoint.
pub fn precopy(
    spare: &Spare,
    base: &Template,
    pid: u32,
    changed: &crate::dirty::Ranges,
) -> Result<crate::dirty::Ranges, ProcError> {
    let maps = |p: u32| -> Result<Vec<crate::layout::Mapping>, ProcError> {
        Ok(crate::layout::parse_maps(&crate::inspect::maps_text(p)?))
    };
    let (mine, theirs) = (maps(pid)?, maps(spare.pid)?);
    let spans: Vec<(u64, u64)> = mine
        .iter()
        .filter(|m| !m.shared && m.prot & 2 != 0 && !m.special() && theirs.contains(m))
        .flat_map(|m| changed.within(m.start, m.end))
        .collect();
    if spans.is_empty() || !alive(spare) {
        return Ok(crate::dirty::Ranges::new());
    }
    let (own, _) = crate::dirty::held(pid, &spans)?;
    let ranges: Vec<(u64, u64)> = own.iter().collect();
    let _here = crate::ptrace::hold_here();
    let mut s = Tracee::seize_at(spare.pid, base.syscall_at)?;
    s.block_signals_when_parked();
    let done = crate::graft::direct(&mut s, pid, &ranges, libc::SYS_process_vm_readv);
    s.park()?;
    Ok(crate::dirty::Ranges::from_unsorted(ranges[..done].to_vec()))
}
