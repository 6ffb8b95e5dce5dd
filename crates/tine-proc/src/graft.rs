//! Grafts: a process forked from its parent's copy (so that it is that
//! copy's child, in its session and process group, as the kernel keeps
//! them) made into a copy of another template — the way a process tree
//! comes back whole. A stock kernel has no call that gives a process
//! another's memory, so the graft rebuilds it: the fork's mappings that the
//! template lacks go, its vDSO moves to the template's place, the template's
//! other mappings are made (files through its `map_files`), and only the
//! pages whose frames differ from the template's (`/proc/PID/pagemap`) are
//! copied or dropped — for a child forked without exec, what it wrote since
//! it was forked. Then its memory's bounds and executable (`PR_SET_MM_MAP`),
//! its descriptor table (handed over by `fdpass`), signal dispositions,
//! main thread's state (rseq, robust list, clear-tid, alternate stack,
//! name, extended registers, signal mask) and umask become the template's.
//! The same graft rolls a template's own origin back in place (`tree`): then
//! only the pages the origin wrote since the checkpoint differ in frame.

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::PathBuf;

use nix::libc;

use crate::fdpass::Channel;
use crate::inspect::{NotCloneable, ProcError, read_proc};
use crate::layout::{Mapping, Step, parse_maps, plan};
use crate::ptrace::{Regs, Tracee};
use crate::template::{Template, seize_template};
use crate::threads::ThreadState;

const PAGE: u64 = 4096;
const PM_PRESENT: u64 = 1 << 63;
const PM_SWAP: u64 = 1 << 62;
const PM_FILE: u64 = 1 << 61;
const PM_PFN: u64 = (1 << 55) - 1;
/// `PR_SET_MM`, `PR_SET_MM_MAP` (include/uapi/linux/prctl.h).
const PR_SET_MM: u64 = 35;
const PR_SET_MM_MAP: u64 = 14;
/// The most bytes of anonymous memory zeroed rather than dropped.
const ZERO_AT_MOST: u64 = 64 << 10;
/// The most bytes of pages read and written at once.
const COPY_CHUNK: usize = 8 << 20;

/// What is read from the template itself (seized for it).
struct Source {
    regs: Regs,
    main: ThreadState,
    brk: u64,
    /// `(signal, struct sigaction as the kernel takes it)` of each caught signal.
    caught: Vec<(u64, [u64; 4])>,
    ignored: u64,
    maps: Vec<Mapping>,
    stat: Vec<u64>,
    umask: Option<u64>,
    pages: Option<(crate::dirty::Ranges, crate::dirty::Ranges)>,
}

/// What a graft reads from its template, which never changes: read once
/// (off the pause, as the template is settled) and kept beside it, it
/// saves each graft seizing the template and a call per caught signal.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SourceRecord {
    main: ThreadState,
    brk: u64,
    caught: Vec<(u64, [u64; 4])>,
    ignored: u64,
    /// Its `/proc/PID/maps`, `stat` fields and umask.
    #[serde(default)]
    maps: String,
    #[serde(default)]
    stat: Vec<u64>,
    #[serde(default)]
    umask: Option<u64>,
    /// The pages it holds of its private mappings: its own (anonymous, or
    /// swapped out), and a file's, unchanged (`None`: not read).
    #[serde(default)]
    pages: Option<(crate::dirty::Ranges, crate::dirty::Ranges)>,
    /// `maps` parsed ([`SourceRecord::parse`]), when it was.
    #[serde(skip)]
    parsed: Option<Vec<Mapping>>,
    /// A rollback's walks of its origin's memory, worked out with `parsed`
    /// when its own pages were read.
    #[serde(skip)]
    walks: Option<std::sync::Arc<crate::shares::Plan>>,
}

impl SourceRecord {
    /// The pages of its own the template holds, when they were read.
    pub fn own_pages(&self) -> Option<&crate::dirty::Ranges> {
        self.pages.as_ref().map(|(own, _)| own)
    }

    /// Parses its memory map ahead (off the pause of the graft to come).
    pub fn parse(&mut self) {
        if self.parsed.is_none() && !self.maps.is_empty() {
            let maps = parse_maps(&self.maps);
            self.walks = self.pages.as_ref().map(|(own, _)| {
                let (anon, files) = crate::dirty::by_backing(own, &maps);
                // A walk reads every entry of a file's mapping, held or not:
                // each is protected, under a marker where not held (numpy's
                // 153 libraries' mappings, 15.6 k entries, fell in the last
                // piece, which took 0.27 ms while the others took 0.04).
                let armed = crate::dirty::Ranges::from_unsorted(crate::dirty::armable(&maps));
                let mut weight = crate::dirty::by_backing(&armed, &maps).1;
                weight.add(own);
                let plan =
                    crate::shares::Plan::new(crate::dirty::runs(&maps), &weight, anon, files);
                std::sync::Arc::new(plan)
            });
            self.parsed = Some(maps);
        }
    }

    /// The walks of a rollback of its origin ([`SourceRecord::parse`]d,
    /// with its own pages read).
    pub fn walks(&self) -> Option<&std::sync::Arc<crate::shares::Plan>> {
        self.walks.as_ref()
    }

    /// Its memory map, when recorded (and [`SourceRecord::parse`]d).
    pub fn mappings(&self) -> Option<&[Mapping]> {
        self.parsed.as_deref()
    }
}

/// The [`SourceRecord`] of template `s` (seized; its registers the
/// checkpoint's); with the pages it holds when `pages`.
pub fn source_of(s: &mut Tracee, pages: bool) -> Result<SourceRecord, ProcError> {
    source_with(s, pages, None)
}

/// [`source_of`], its `/proc/PID/maps` text given where it was read since
/// it stopped (and nothing changed its mappings since).
pub fn source_with(
    s: &mut Tracee,
    pages: bool,
    maps: Option<String>,
) -> Result<SourceRecord, ProcError> {
    let pid = s.pid();
    let maps = match maps {
        Some(m) => m,
        None => crate::inspect::maps_text(pid)?,
    };
    let stat = stat_fields(pid)?;
    // (The calls injected below change neither its dispositions nor its
    // umask: one reading for both.)
    let now = status_now(pid)?;
    let pages = if pages {
        Some(crate::dirty::held(
            pid,
            &crate::dirty::tracked(&parse_maps(&maps)),
        )?)
    } else {
        None
    };
    let main = crate::threads::capture(s)?;
    let brk = s.syscall("brk", libc::SYS_brk, [0; 6])?;
    let (caught_mask, ignored, umask) = (now.caught, now.ignored, now.umask);
    let mut caught = Vec::new();
    let at = s.scratch(0, &[0u8; 32])?;
    for sig in (1..=64u64).filter(|n| caught_mask & (1 << (n - 1)) != 0) {
        s.syscall(
            "rt_sigaction",
            libc::SYS_rt_sigaction,
            [sig, 0, at, 8, 0, 0],
        )?;
        let b = s.peek(at, 32)?;
        let w = |i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
        caught.push((sig, [w(0), w(1), w(2), w(3)]));
    }
    Ok(SourceRecord {
        main,
        brk,
        caught,
        ignored,
        maps,
        stat,
        umask,
        pages,
        parsed: None,
        walks: None,
    })
}

/// The `Umask:` of a `/proc/PID/status` text.
fn umask_in(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("Umask:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 8).ok())
}

fn read_source(tpl: &Template, kept: Option<&SourceRecord>) -> Result<Source, ProcError> {
    let rec = match kept {
        Some(r) => r.clone(),
        None => {
            let mut s = seize_template(tpl)?;
            let r = source_of(&mut s, false)?;
            s.park()?;
            r
        }
    };
    let regs = crate::threads::regs_from_words(&rec.main.regs).ok_or(ProcError::Malformed {
        pid: tpl.pid,
        path: "template's registers".into(),
    })?;
    // Records of an older tine lack them.
    let (maps, stat) = if rec.stat.len() < 49 {
        (
            parse_maps(&crate::inspect::maps_text(tpl.pid)?),
            stat_fields(tpl.pid)?,
        )
    } else {
        let maps = rec.parsed.unwrap_or_else(|| parse_maps(&rec.maps));
        (maps, rec.stat)
    };
    Ok(Source {
        regs,
        main: rec.main,
        brk: rec.brk,
        caught: rec.caught,
        ignored: rec.ignored,
        maps,
        stat,
        umask: rec.umask,
        pages: rec.pages,
    })
}

/// `SigCgt` and `SigIgn` of a `/proc/PID/status` text.
fn signal_masks_in(status: &str) -> (u64, u64) {
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
            .unwrap_or(0)
    };
    (field("SigCgt:"), field("SigIgn:"))
}

/// Fields of `/proc/PID/stat` after the command (`f[0]` is field 3).
fn stat_fields(pid: u32) -> Result<Vec<u64>, ProcError> {
    let path = PathBuf::from(format!("/proc/{pid}/stat"));
    let text = read_proc(pid, &path)?;
    let rest = text
        .rfind(')')
        .map(|i| &text[i + 1..])
        .ok_or(ProcError::Malformed {
            pid,
            path: path.clone(),
        })?;
    let f: Vec<u64> = rest
        .split_whitespace()
        .skip(1)
        .map(|v| v.parse::<i64>().map_or(0, |n| n as u64))
        .collect();
    if f.len() < 49 {
        return Err(ProcError::Malformed { pid, path });
    }
    // Put the state back at f[0] so that field n is f[n - 3].
    Ok(std::iter::once(0).chain(f).collect())
}

fn not_graftable(tpl: &Template, reason: String) -> ProcError {
    ProcError::NotCloneable(NotCloneable::of(
        tpl.origin,
        crate::inspect::cmdline(tpl.pid),
        reason,
    ))
}

/// Makes stopped `child` (a fresh fork not run yet, or `tpl`'s own origin,
/// rolled back in place) a copy of `tpl`; its shared memory is the tree's
/// copy of each object (`shm`).
pub fn graft(
    child: &mut Tracee,
    tpl: &Template,
    shm: &mut crate::shm::TreeShm,
) -> Result<(), ProcError> {
    graft_changed(child, tpl, shm, None, None, None, None, None)
}

/// [`graft`] onto `tpl`'s origin whose memory is tracked (`dirty`): of the
/// mappings it keeps, only the pages in `changed` (where it may differ from
/// `tpl`) are compared; those are protected again afterwards, so that the
/// next scan finds only what it writes from here. `kept`: what was read
/// from the template before (see [`source_of`]). `maps`: `child`'s memory
/// map, when it was read since it stopped. `pusher`: a thread of its own
/// that pushes the pages from the template while this one goes on; the
/// push (and the protection after it) then ends at [`Tracee::settle`],
/// before `child` runs at the latest. `ahead`: pages that thread pushes
/// already ([`push_ahead`]).
#[allow(clippy::too_many_arguments)]
pub fn graft_changed(
    child: &mut Tracee,
    tpl: &Template,
    shm: &mut crate::shm::TreeShm,
    changed: Option<&crate::dirty::Ranges>,
    kept: Option<&SourceRecord>,
    maps: Option<Vec<Mapping>>,
    pusher: Option<&crate::pusher::Hand>,
    ahead: Option<Ahead>,
) -> Result<(), ProcError> {
    let how = Copy::Pushed(pusher);
    let none = crate::fdtable::FdInfos::default();
    graft_inner(child, tpl, shm, changed, kept, maps, how, ahead, &none)
}

/// Pages of a rollback in place pushed back ahead of its graft, and a
/// question asked ahead of them (see [`push_ahead`]).
#[derive(Debug)]
pub struct Ahead {
    /// Where the pages are being written: the graft copies the rest.
    pushed: crate::dirty::Ranges,
    /// Whether its descriptors are the template's (its origin's only).
    table: Option<crate::pusher::Ran<bool>>,
}

impl Ahead {
    /// Nothing pushed ahead; only whether its descriptors are the
    /// template's asked.
    pub fn asked(table: crate::pusher::Ran<bool>) -> Ahead {
        Ahead {
            pushed: Default::default(),
            table: Some(table),
        }
    }
}

/// Starts pushing back, on the pusher thread (`hand`), the pages of
/// stopped process `child` in `changed` that its template `tpl` holds of
/// its own (`source`), in the writable private mappings that `child` has
/// exactly as the template had them (`maps`: its memory map now) — those a
/// graft keeps and copies into — while the rollback goes on with the rest
/// (killing, reaping, the graft's other work): numpy's 300 pages take
/// 0.4 ms, as long as all that. Not the pages below its stack pointer,
/// where injected calls write. Only once an error can no longer let the
/// process run on as it was: from here it is finished or killed
/// ([`Tracee::altered`]). The graft ([`graft_changed`]) does the rest.
pub fn push_ahead(
    child: &mut Tracee,
    tpl: &Template,
    changed: &crate::dirty::Ranges,
    source: &SourceRecord,
    maps: &[Mapping],
    hand: &crate::pusher::Hand,
    table: Option<crate::pusher::Ran<bool>>,
) -> Ahead {
    let cpid = child.pid();
    // Asked first (where not before, `table`): the graft waits for it, not
    // for the push.
    let table = table.or_else(|| (cpid == tpl.origin).then(|| hand.same_table(tpl, cpid)));
    let far = kept_as_they_were(child, changed, source, maps);
    if far.is_empty() {
        return Ahead {
            pushed: Default::default(),
            table,
        };
    }
    child.altered();
    let p = hand.push(tpl, cpid, far.clone());
    let tpid = tpl.pid;
    child.settle_later(far.clone(), move |child| {
        copy_through(child, tpid, &p.left())
    });
    Ahead {
        pushed: crate::dirty::Ranges::from_unsorted(far),
        table,
    }
}

/// What [`push_ahead`] pushes: the pages of `changed` the template holds of
/// its own, in writable private mappings `child` has (`maps`) exactly as
/// the template had them, but for its scratch zone.
fn kept_as_they_were(
    child: &Tracee,
    changed: &crate::dirty::Ranges,
    source: &SourceRecord,
    maps: &[Mapping],
) -> Vec<(u64, u64)> {
    let (Some(own), Some(had)) = (source.own_pages(), source.mappings()) else {
        return Vec::new();
    };
    let same = |w: &Mapping| {
        let i = maps.partition_point(|c| c.start < w.start);
        maps.get(i) == Some(w)
    };
    let mine = changed.intersect(own);
    let mut spans = Vec::new();
    for w in crate::layout::split_like(had.to_vec(), maps) {
        if w.prot & 2 != 0 && !w.shared && !w.special() && same(&w) {
            spans.extend(mine.within(w.start, w.end));
        }
    }
    let (lo, hi) = scratch_zone(child);
    split_off(&spans, lo, hi).1
}

/// How the pages come back: pushed from the parked template (by another
/// thread, when given), or pulled from a live one (a spare's source).
#[derive(Clone, Copy)]
enum Copy<'a> {
    Pushed(Option<&'a crate::pusher::Hand>),
    Pulled,
}

/// [`graft_changed`] onto a process whose memory is not tracked (a spare
/// template, `spare`, or a fork's template sharing its source's memory,
/// `sharing`): the pages of `changed` are put back, none protected. Its
/// calls are all made before this returns: the memory they write their
/// arguments to may be another's too, into which calls are injected once
/// the caller lets go of what serializes those. `infos`: `child`'s
/// `fdinfo` files, where they were opened before the pause.
pub(crate) fn graft_untracked(
    child: &mut Tracee,
    tpl: &Template,
    changed: &crate::dirty::Ranges,
    kept: &SourceRecord,
    infos: &crate::fdtable::FdInfos,
) -> Result<(), ProcError> {
    graft_inner(
        child,
        tpl,
        &mut Default::default(),
        Some(changed),
        Some(kept),
        None,
        Copy::Pulled,
        None,
        infos,
    )?;
    child.make_later_calls()
}

#[allow(clippy::too_many_arguments)]
fn graft_inner(
    child: &mut Tracee,
    tpl: &Template,
    shm: &mut crate::shm::TreeShm,
    changed: Option<&crate::dirty::Ranges>,
    kept: Option<&SourceRecord>,
    maps: Option<Vec<Mapping>>,
    how: Copy<'_>,
    ahead: Option<Ahead>,
    infos: &crate::fdtable::FdInfos,
) -> Result<(), ProcError> {
    let _here = crate::ptrace::hold_here();
    // Whether its descriptors are the template's, asked on the pusher
    // thread while this one plans (a file read a descriptor: node's 20 took
    // 0.3 ms), or asked already.
    let (pushed_ahead, table_ahead) = match ahead {
        Some(a) => (a.pushed, a.table),
        None => (Default::default(), None),
    };
    let table_ahead = match how {
        Copy::Pushed(Some(hand)) if child.pid() == tpl.origin && table_ahead.is_none() => {
            Some(hand.same_table(tpl, child.pid()))
        }
        _ => table_ahead,
    };
    let mut src = read_source(tpl, kept)?;
    let (tpid, cpid) = (tpl.pid, child.pid());
    let mut want = std::mem::take(&mut src.maps);
    let cur = match maps {
        Some(m) => m,
        None => parse_maps(&crate::inspect::maps_text(cpid)?),
    };
    // Shared memory it still maps as at the checkpoint stays (its bytes put
    // back): those mappings are wanted as they are.
    let stay = crate::shmback::keep_in_place(cpid, tpid, &tpl.shm, &cur, shm)?;
    // The template's copies of shared memory the tree copied already are
    // not mapped from the template: the tree's copies are, below. (Those
    // only this process had are mapped from the template's, then copied.)
    let taken: Vec<(u64, u64)> = tpl
        .shm
        .iter()
        .filter(|o| shm.has(o))
        .flat_map(|o| o.maps.iter().map(|m| (m.start, m.end)))
        .collect();
    want.retain(|m| !taken.contains(&(m.start, m.end)));
    let staying = |c: &&Mapping| {
        stay.iter()
            .any(|o| o.maps.iter().any(|m| (m.start, m.end) == (c.start, c.end)))
    };
    if !stay.is_empty() {
        want.extend(cur.iter().filter(staying).cloned());
        want.sort_by_key(|m| m.start);
    }
    let want = crate::layout::split_like(want, &cur);
    let (tst, cst) = (&src.stat, stat_fields(cpid)?);
    // The template's own origin, rolled back in place: much of its state
    // may be the template's still, and is then left as it is.
    let origin = cpid == tpl.origin && tpl.origin_start != 0 && cst[22 - 3] == tpl.origin_start;
    let plan = plan(&cur, &want, (cst[28 - 3], tst[28 - 3]))
        .map_err(|r| not_graftable(tpl, format!("its memory cannot be rebuilt: {r}")))?;
    // The kernel writes to a registered rseq area on the way back to user
    // space: the parent's, in memory about to go, is let go first (the
    // template's is registered at the end).
    let inherited = crate::raw::get_rseq(cpid).map_err(|source| ProcError::Ptrace {
        pid: cpid,
        step: "read rseq registration",
        source,
    })?;
    let rseq_kept = origin
        && src.main.rseq
            == (inherited.abi_pointer != 0).then_some((
                inherited.abi_pointer,
                inherited.abi_size,
                inherited.signature,
            ));
    if inherited.abi_pointer != 0 && !rseq_kept {
        crate::threads::set_rseq(
            child,
            (
                inherited.abi_pointer,
                inherited.abi_size,
                inherited.signature,
            ),
            true,
        )?;
    }
    let exe_of = |pid: u32| std::fs::metadata(format!("/proc/{pid}/exe")).ok();
    let same_exe = match (exe_of(tpid), exe_of(cpid)) {
        (Some(a), Some(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => true,
    };
    let top = tpl.fds.iter().map(|e| e.fd).max().unwrap_or(2).max(2);
    // The template's origin rolled back in place whose descriptors, working
    // directory and files mapped are the template's already needs none
    // handed over.
    let keep_table = same_exe
        && !plan.steps.iter().any(|s| matches!(s, Step::MapFile { .. }))
        && same_cwd(tpid, cpid)
        && match table_ahead {
            Some(r) => r.wait().unwrap_or(false),
            None => same_table(tpl.pid, &tpl.fds, cpid, infos),
        };
    if keep_table {
        reshape(child, &plan.steps, &want, |_| -1)?;
        child.set_saved_regs(crate::threads::restartable(src.regs));
        // (Not `brk` alone, even with the same bounds: where the heap's
        // mapping was made anew, `brk` fails silently and leaves the kernel's
        // break short of the program's heap.)
        set_mm_later(child, tpl, tst, src.brk)?;
    } else {
        hand_over(child, tpl, &want, &plan, tst, &src, same_exe, top)?;
    }
    let rest = tpl
        .shm
        .iter()
        .filter(|o| !stay.iter().any(|s| std::ptr::eq(*s, *o)));
    crate::shm::make_private_in(child, rest, shm, top + 1, true)?;
    // The pages first: those pushed by another thread come back while the
    // calls below run (their scratch space is not pushed).
    let pushed = match (changed, &src.pages) {
        (Some(c), Some(held)) => {
            copy_changed(child, tpl, &want, &plan.pages, c, held, how, &pushed_ahead)?
        }
        (Some(c), None) => {
            // What the template holds, read where it is needed only.
            let spans: Vec<(u64, u64)> = plan
                .pages
                .iter()
                .flat_map(|&(i, anew)| {
                    let w = &want[i];
                    if anew {
                        vec![(w.start, w.end)]
                    } else {
                        c.within(w.start, w.end).collect()
                    }
                })
                .collect();
            let held = crate::dirty::held(tpid, &spans)?;
            copy_changed(child, tpl, &want, &plan.pages, c, &held, how, &pushed_ahead)?
        }
        _ => {
            copy_pages(child, tpid, &want, &plan.pages, changed)?;
            None
        }
    };
    // Its pages protected again once they are back.
    let protect = changed
        .filter(|_| matches!(how, Copy::Pushed(_)))
        .map(|c| crate::dirty::by_backing(c, &want));
    let pushing = match how {
        Copy::Pushed(Some(hand)) if pushed.is_some() || !pushed_ahead.is_empty() => Some(hand),
        _ => None,
    };
    match pushing {
        Some(hand) => {
            // Protected by that thread too, once it has pushed them (a page
            // this one writes meanwhile reads as written: a copy more).
            let protected = protect.map(|c| {
                hand.run(move || crate::dirty::protect_stopped(cpid, &c.0, &c.1).map(|()| c))
            });
            let ranges = pushed
                .as_ref()
                .map(|p| p.ranges.clone())
                .unwrap_or_default();
            child.settle_later(ranges, move |child| {
                let rest = pushed
                    .as_ref()
                    .map(crate::pusher::Pushed::left)
                    .unwrap_or_default();
                let protected = match protected.map(|r| r.wait()) {
                    Some(Some(r)) => Some(r?),
                    Some(None) => {
                        return Err(ProcError::Ptrace {
                            pid: cpid,
                            step: "protect its pages again (the pusher thread is gone)",
                            source: std::io::Error::other("no answer"),
                        });
                    }
                    None => None,
                };
                copy_through(child, tpid, &rest)?;
                // What it copied after the protection is protected again.
                match protected.filter(|_| !rest.is_empty()) {
                    Some(c) => crate::dirty::protect_stopped(child.pid(), &c.0, &c.1),
                    None => Ok(()),
                }
            })
        }
        None => {
            if let Some(c) = &protect {
                crate::dirty::protect_stopped(cpid, &c.0, &c.1)?;
            }
        }
    }
    // (One reading of its status for both: the calls they leave are made
    // later, so neither changes what the other reads.)
    let now = status_now(child.pid())?;
    set_signals(child, &src, &now)?;
    set_main_thread(child, tpl, &src, rseq_kept, &now)?;
    // Last: nothing injected after may change them.
    let xstate = crate::queued::unhex(&src.main.xstate).ok_or(ProcError::Malformed {
        pid: tpid,
        path: "extended registers".into(),
    })?;
    let io = |step: &'static str| {
        move |source| ProcError::Ptrace {
            pid: cpid,
            step,
            source,
        }
    };
    crate::raw::set_xstate(cpid, &xstate).map_err(io("set extended registers"))?;
    crate::raw::set_sigmask(cpid, src.main.sigmask).map_err(io("set signal mask"))?;
    Ok(())
}

/// Hands `child` its new descriptor table (the template's), the files of
/// the mappings made anew, its executable and its working directory over
/// a channel, and carries out the layout steps with them.
#[allow(clippy::too_many_arguments)]
fn hand_over(
    child: &mut Tracee,
    tpl: &Template,
    want: &[Mapping],
    plan: &crate::layout::Plan,
    tst: &[u64],
    src: &Source,
    same_exe: bool,
    top: i32,
) -> Result<(), ProcError> {
    let tpid = tpl.pid;
    // Everything the fork inherited from its parent goes; the channel's
    // end sits above every number the table needs.
    child.syscall(
        "close_range",
        libc::SYS_close_range,
        [0, u64::from(u32::MAX), 0, 0, 0, 0],
    )?;
    let ch = Channel::open(child, top + 1)?;
    // The files of the mappings made anew, its executable, its directory.
    let mut extras: Vec<OwnedFd> = Vec::new();
    let mut map_fd = std::collections::HashMap::new();
    for step in &plan.steps {
        if let Step::MapFile { source } = step {
            let w = &want[*source];
            let path = crate::inspect::map_file(tpid, w.start, w.end);
            let write = w.shared && w.prot & 2 != 0;
            let f = File::options()
                .read(true)
                .write(write)
                .custom_flags(libc::O_CLOEXEC)
                .open(&path)
                .map_err(|e| ProcError::read(tpid, std::path::Path::new(&path), e))?;
            map_fd.insert(*source, extras.len());
            extras.push(f.into());
        }
    }
    let exe_at = (!same_exe).then(|| {
        let path = format!("/proc/{tpid}/exe");
        File::open(&path)
            .map(|f| {
                extras.push(f.into());
                extras.len() - 1
            })
            .map_err(|e| ProcError::read(tpid, std::path::Path::new(&path), e))
    });
    let exe_at = exe_at.transpose()?;
    let cwd_path = format!("/proc/{tpid}/cwd");
    let cwd_at = File::options()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(&cwd_path)
        .ok()
        .map(|f| {
            extras.push(f.into());
            extras.len() - 1
        });
    let fds: Vec<_> = extras.iter().map(|f| f.as_fd()).collect();
    let got = ch.pass(child, &fds)?;
    drop(fds);
    drop(extras);
    reshape(child, &plan.steps, want, |i| got[map_fd[&i]])?;
    // From here its scratch area is on the template's stack.
    child.set_saved_regs(crate::threads::restartable(src.regs));
    set_mm(child, tpl, tst, src.brk, exe_at.map(|i| got[i]))?;
    if let Some(i) = cwd_at {
        child.syscall("fchdir", libc::SYS_fchdir, [got[i] as u64, 0, 0, 0, 0, 0])?;
    }
    let theirs = ch.theirs() as u64;
    child.syscall(
        "close_range",
        libc::SYS_close_range,
        [0, theirs - 1, 0, 0, 0, 0],
    )?;
    child.syscall(
        "close_range",
        libc::SYS_close_range,
        [theirs + 1, u64::from(u32::MAX), 0, 0, 0, 0],
    )?;
    install_table(child, &ch, tpl)?;
    ch.close(child)?;
    Ok(())
}

/// Whether processes `a` and `b` work in the same directory.
fn same_cwd(a: u32, b: u32) -> bool {
    let cwd = |pid: u32| std::fs::metadata(format!("/proc/{pid}/cwd")).ok();
    match (cwd(a), cwd(b)) {
        (Some(x), Some(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => false,
    }
}

/// Whether process `pid`'s descriptors are exactly the template's: the
/// same numbers, each the same open file description (`kcmp`) with the same
/// close-on-exec flag, and no other. `infos`: its `fdinfo` files opened
/// ahead.
pub(crate) fn same_table(
    tpid: u32,
    fds: &[crate::FdEntry],
    pid: u32,
    infos: &crate::fdtable::FdInfos,
) -> bool {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    if dir.count() != fds.len() {
        return false;
    }
    fds.iter().all(|e| {
        crate::raw::same_file(pid, e.fd, tpid, e.fd).unwrap_or(false)
            && infos
                .read(pid, e.fd)
                .and_then(|t| {
                    let f = t.lines().find_map(|l| l.strip_prefix("flags:"))?;
                    u32::from_str_radix(f.trim(), 8).ok()
                })
                .is_some_and(|f| f & libc::O_CLOEXEC as u32 == e.flags & libc::O_CLOEXEC as u32)
    })
}

/// Carries out the layout steps (calls that take only registers: the old
/// stack may be gone). `fd_of(i)`: the descriptor `want[i]`'s file got.
fn reshape(
    child: &mut Tracee,
    steps: &[Step],
    want: &[Mapping],
    fd_of: impl Fn(usize) -> i32,
) -> Result<(), ProcError> {
    for step in steps {
        match *step {
            Step::Unmap { start, len } => {
                child.syscall("munmap", libc::SYS_munmap, [start, len, 0, 0, 0, 0])?;
            }
            Step::Move {
                from,
                len,
                to,
                via_elsewhere,
            } => {
                let mut at = from;
                if via_elsewhere {
                    let tmp = child.syscall(
                        "mremap",
                        libc::SYS_mremap,
                        [at, len, len, libc::MREMAP_MAYMOVE as u64, 0, 0],
                    )?;
                    follow(child, at, len, tmp);
                    at = tmp;
                }
                child.syscall(
                    "mremap",
                    libc::SYS_mremap,
                    [
                        at,
                        len,
                        len,
                        (libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED) as u64,
                        to,
                        0,
                    ],
                )?;
                follow(child, at, len, to);
            }
            Step::MapAnon {
                start,
                len,
                prot,
                stack,
            } => {
                let mut flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED;
                if stack {
                    flags |= libc::MAP_GROWSDOWN;
                }
                child.syscall(
                    "mmap",
                    libc::SYS_mmap,
                    [start, len, prot, flags as u64, u64::MAX, 0],
                )?;
            }
            Step::MapFile { source } => {
                let w = &want[source];
                let share = if w.shared {
                    libc::MAP_SHARED
                } else {
                    libc::MAP_PRIVATE
                };
                child.syscall(
                    "mmap",
                    libc::SYS_mmap,
                    [
                        w.start,
                        w.bytes(),
                        w.prot,
                        (share | libc::MAP_FIXED) as u64,
                        fd_of(source) as u64,
                        w.offset,
                    ],
                )?;
            }
            Step::Protect { start, len, prot } => {
                child.syscall("mprotect", libc::SYS_mprotect, [start, len, prot, 0, 0, 0])?;
            }
        }
    }
    Ok(())
}

/// After a kernel mapping moved from `from` to `to`: calls go through the
/// `syscall` instruction at its new place if it was in it.
fn follow(child: &mut Tracee, from: u64, len: u64, to: u64) {
    let at = child.syscall_at();
    if from <= at && at < from + len {
        child.set_syscall_at(at - from + to);
    }
}

/// `PR_SET_MM_MAP`: the template's memory bounds, auxiliary vector and
/// (when another) executable.
fn set_mm(
    child: &mut Tracee,
    tpl: &Template,
    st: &[u64],
    brk: u64,
    exe_fd: Option<i32>,
) -> Result<(), ProcError> {
    let auxv = auxv_of(tpl)?;
    let auxv_at = child.scratch(0, &auxv)?;
    let map = mm_map(st, brk, auxv_at, auxv.len(), exe_fd);
    let at = child.scratch(auxv.len() as u64 + 16, &map)?;
    child.syscall(
        "prctl(PR_SET_MM_MAP)",
        libc::SYS_prctl,
        [PR_SET_MM, PR_SET_MM_MAP, at, map.len() as u64, 0, 0],
    )?;
    Ok(())
}

/// [`set_mm`] (its executable left) among the calls made before it runs
/// ([`Tracee::call_later`]), not in a round trip of its own (0.05-0.25 ms
/// a process inside the pause).
fn set_mm_later(child: &mut Tracee, tpl: &Template, st: &[u64], brk: u64) -> Result<(), ProcError> {
    let auxv = auxv_of(tpl)?;
    let mut bytes = mm_map(st, brk, 0, auxv.len(), None);
    let map_len = bytes.len();
    bytes.extend_from_slice(&auxv);
    // Its `auxv` field (the twelfth word) points at the bytes after it.
    let b = child.call_later();
    let at = b.data_linked(&bytes, &[(11 * 8, map_len)]);
    b.call(
        "prctl(PR_SET_MM_MAP)",
        libc::SYS_prctl,
        [
            PR_SET_MM.into(),
            PR_SET_MM_MAP.into(),
            at.into(),
            (map_len as u64).into(),
            0.into(),
            0.into(),
        ],
    );
    Ok(())
}

/// The auxiliary vector of template `tpl`.
fn auxv_of(tpl: &Template) -> Result<Vec<u8>, ProcError> {
    let auxv_path = PathBuf::from(format!("/proc/{}/auxv", tpl.pid));
    std::fs::read(&auxv_path).map_err(|e| ProcError::read(tpl.pid, &auxv_path, e))
}

/// `struct prctl_mm_map` from the template's `stat` fields `st`, its
/// `brk`, and its auxiliary vector's place and size.
fn mm_map(st: &[u64], brk: u64, auxv_at: u64, auxv_len: usize, exe_fd: Option<i32>) -> Vec<u8> {
    let f = |n: usize| st[n - 3];
    let mut map = Vec::with_capacity(104);
    for v in [
        f(26),
        f(27),
        f(45),
        f(46),
        f(47),
        brk.max(f(47)),
        f(28),
        f(48),
        f(49),
        f(50),
        f(51),
        auxv_at,
    ] {
        map.extend_from_slice(&v.to_le_bytes());
    }
    map.extend_from_slice(&(auxv_len as u32).to_le_bytes());
    map.extend_from_slice(&exe_fd.map_or(u32::MAX, |fd| fd as u32).to_le_bytes());
    map
}

/// Gives `child` (whose table is empty but for the channel) the template's
/// descriptors, each sharing its open file description with the
/// template's, at the same numbers and close-on-exec flags.
fn install_table(child: &mut Tracee, ch: &Channel, tpl: &Template) -> Result<(), ProcError> {
    let mut entries: Vec<_> = tpl.fds.iter().collect();
    entries.sort_by_key(|e| e.fd);
    let pidfd = rustix::process::pidfd_open(
        rustix::process::Pid::from_raw(tpl.pid as i32).ok_or(ProcError::Gone { pid: tpl.pid })?,
        rustix::process::PidfdFlags::empty(),
    )
    .map_err(|e| ProcError::read(tpl.pid, std::path::Path::new("pidfd"), e.into()))?;
    for batch in entries.chunks(250) {
        let mut held = Vec::with_capacity(batch.len());
        for e in batch {
            let fd = rustix::process::pidfd_getfd(
                &pidfd,
                e.fd,
                rustix::process::PidfdGetfdFlags::empty(),
            )
            .map_err(|err| ProcError::Ptrace {
                pid: tpl.pid,
                step: "take a descriptor of the template (pidfd_getfd)",
                source: err.into(),
            })?;
            held.push(fd);
        }
        let borrowed: Vec<_> = held.iter().map(|f| f.as_fd()).collect();
        let got = ch.pass(child, &borrowed)?;
        // Received at the lowest free numbers, each at most its target:
        // placed from the last down, none lands on one not yet placed.
        for (e, r) in batch.iter().zip(got).rev() {
            let cloexec = e.flags & libc::O_CLOEXEC as u32 != 0;
            if r == e.fd {
                if !cloexec {
                    child.syscall(
                        "fcntl(F_SETFD)",
                        libc::SYS_fcntl,
                        [r as u64, libc::F_SETFD as u64, 0, 0, 0, 0],
                    )?;
                }
                continue;
            }
            let flags = if cloexec { libc::O_CLOEXEC as u64 } else { 0 };
            child.syscall(
                "dup3",
                libc::SYS_dup3,
                [r as u64, e.fd as u64, flags, 0, 0, 0],
            )?;
            child.syscall("close", libc::SYS_close, [r as u64, 0, 0, 0, 0, 0])?;
        }
    }
    Ok(())
}

/// What `/proc/PID/status` says of a process's signal dispositions
/// (`SigCgt`, `SigIgn`) and umask.
struct StatusNow {
    caught: u64,
    ignored: u64,
    umask: Option<u64>,
}

/// [`StatusNow`] of process `pid`, from one reading.
fn status_now(pid: u32) -> Result<StatusNow, ProcError> {
    let status = read_proc(pid, &PathBuf::from(format!("/proc/{pid}/status")))?;
    let (caught, ignored) = signal_masks_in(&status);
    Ok(StatusNow {
        caught,
        ignored,
        umask: umask_in(&status),
    })
}

/// The template's signal dispositions, where the fork's (its parent's)
/// differ (`now`: what it has).
fn set_signals(child: &mut Tracee, src: &Source, now: &StatusNow) -> Result<(), ProcError> {
    let (caught, ignored) = (now.caught, now.ignored);
    let b = child.call_later();
    for sig in 1..=64u64 {
        if sig == libc::SIGKILL as u64 || sig == libc::SIGSTOP as u64 {
            continue;
        }
        let bit = 1u64 << (sig - 1);
        let act = match src.caught.iter().find(|(s, _)| *s == sig) {
            Some((_, act)) => *act,
            None if src.ignored & bit != 0 => {
                if ignored & bit != 0 {
                    continue;
                }
                [1, 0, 0, 0]
            }
            None => {
                if (caught | ignored) & bit == 0 {
                    continue;
                }
                [0, 0, 0, 0]
            }
        };
        let bytes: Vec<u8> = act.iter().flat_map(|w| w.to_le_bytes()).collect();
        let at = b.data(&bytes);
        b.call(
            "rt_sigaction",
            libc::SYS_rt_sigaction,
            [
                sig.into(),
                at.into(),
                0.into(),
                8.into(),
                0.into(),
                0.into(),
            ],
        );
    }
    Ok(())
}

/// The main thread's state that lives in the kernel: rseq, robust list,
/// clear-tid address, alternate stack, name; the umask and dumpable flag
/// (calls left to make before it runs: [`Tracee::call_later`]). Of those
/// that can be read from outside, the umask the child has already is left
/// (`rseq_kept`: its rseq registration is the template's).
fn set_main_thread(
    child: &mut Tracee,
    tpl: &Template,
    src: &Source,
    rseq_kept: bool,
    now: &StatusNow,
) -> Result<(), ProcError> {
    let m = &src.main;
    let cpid = child.pid();
    let umask = src.umask.filter(|u| now.umask != Some(*u));
    let robust_kept = crate::raw::get_robust_list(cpid).ok() == Some(m.robust_list);
    let comm = std::fs::read_to_string(format!("/proc/{cpid}/comm")).unwrap_or_default();
    let b = child.call_later();
    // (The inherited rseq registration was let go before the memory
    // changed.) What is the template's already is left: fewer calls may
    // go one by one (`batch::run_in`).
    crate::threads::own_calls(
        b,
        crate::threads::Own {
            rseq: m.rseq.filter(|_| !rseq_kept),
            robust_list: if robust_kept { (0, 0) } else { m.robust_list },
            altstack: Some(m.altstack.unwrap_or((0, crate::threads::SS_DISABLE, 0))),
            name: (comm.trim_end_matches('\n') != m.name).then_some(m.name.as_str()),
        },
    );
    // The address its exit clears: left on the thread the template was
    // forked from, as on its other threads kept (only `set_tid_address`
    // changes it, which libcs call as a process starts); a copy's is the
    // fork's (none).
    if cpid != tpl.origin {
        b.call_vals(
            "set_tid_address",
            libc::SYS_set_tid_address,
            [m.clear_tid, 0, 0, 0, 0, 0],
        );
    }
    if let Some(mask) = umask {
        b.call_vals("umask", libc::SYS_umask, [mask, 0, 0, 0, 0, 0]);
    }
    b.call_vals(
        "prctl(PR_SET_DUMPABLE)",
        libc::SYS_prctl,
        [libc::PR_SET_DUMPABLE as u64, tpl.dumpable, 0, 0, 0, 0],
    );
    Ok(())
}

/// Puts back the pages of `changed` (where the child may differ from the
/// template) of each mapping it kept, and the template's own pages of each
/// mapping made anew, from what the template holds (`held`: its own pages,
/// and a file's unchanged ones): its own are copied; where it holds none
/// of its own, the child's go (a file's page is read from the file again,
/// a missing one reads as zeros). The copies go in two calls. Those pushed
/// by another thread (`how`) are returned, under way; those pushed
/// `ahead` ([`push_ahead`]) are left to that push.
#[allow(clippy::too_many_arguments)]
fn copy_changed(
    child: &mut Tracee,
    tpl: &Template,
    want: &[Mapping],
    pages: &[(usize, bool)],
    changed: &crate::dirty::Ranges,
    (own, _): &(crate::dirty::Ranges, crate::dirty::Ranges),
    how: Copy<'_>,
    ahead: &crate::dirty::Ranges,
) -> Result<Option<crate::pusher::Pushed>, ProcError> {
    let tpid = tpl.pid;
    // Of the mappings kept, pages pushed ahead are under way already.
    let left;
    let changed = if ahead.is_empty() {
        changed
    } else {
        left = changed.without(ahead);
        &left
    };
    let mut copy: Vec<(u64, u64, bool)> = Vec::new();
    let mut drop: Vec<(u64, u64)> = Vec::new();
    // Small ones of anonymous writable memory are zeroed instead, in the
    // copy's calls (a zero page reads the same as a missing one): an
    // injected call each would cost more.
    let mut zero: Vec<(u64, u64)> = Vec::new();
    for &(i, anew) in pages {
        let w = &want[i];
        let writable = w.prot & 2 != 0;
        let zeroable = writable && w.inode == 0;
        let parts: Vec<(u64, u64)> = if anew {
            vec![(w.start, w.end)]
        } else {
            changed.within(w.start, w.end).collect()
        };
        let mut gone = |a: u64, b: u64| {
            if zeroable && b - a <= ZERO_AT_MOST {
                zero.push((a, b));
            } else {
                drop.push((a, b));
            }
        };
        for (a, b) in parts {
            let mut at = a;
            for (x, y) in own.within(a, b) {
                if at < x && !anew {
                    gone(at, x);
                }
                copy.push((x, y, writable));
                at = y;
            }
            if at < b && !anew {
                gone(at, b);
            }
        }
    }
    let drop: Vec<(u64, u64)> = crate::dirty::Ranges::from_unsorted(drop).iter().collect();
    child.madvise_all(&drop, libc::MADV_DONTNEED as u64)?;
    let zeros = vec![0u8; ZERO_AT_MOST as usize];
    let from = vec![0usize; zero.len()];
    let done = crate::raw::write_ranges(child.pid(), &zero, &from, &zeros);
    for &(a, b) in &zero[done..] {
        child.poke_at(a, &zeros[..(b - a) as usize])?;
    }
    // Many pages of writable memory go from the template straight into
    // the child, by a call injected into one of them: no page passes
    // through tine's memory, whose first touch of each costs more than
    // the copy. From a parked template (not dumpable) it is pushed; from a
    // live process (a spare's source) the child pulls it.
    let writable: u64 = copy.iter().filter(|c| c.2).map(|(a, b, _)| b - a).sum();
    let mut pushed = None;
    // (Pushed by another thread, any costs this one nothing.)
    let at_least = match how {
        Copy::Pushed(Some(_)) => 1,
        _ => DIRECT_AT_LEAST,
    };
    if writable >= at_least {
        let lead: Vec<(u64, u64)> = copy
            .iter()
            .filter(|c| c.2)
            .map(|&(a, b, _)| (a, b))
            .collect();
        let done = match how {
            Copy::Pushed(Some(hand)) => {
                // Not where calls injected meanwhile put their arguments:
                // those pages are copied here, before any is put there.
                let (lo, hi) = scratch_zone(child);
                let (near, far) = split_off(&lead, lo, hi);
                // (A push of nothing still seizes and parks the template:
                // 0.05-0.1 ms of the other CPU's.)
                if !far.is_empty() {
                    pushed = Some(hand.push(tpl, child.pid(), far));
                }
                copy.retain(|c| !c.2);
                copy.extend(near.into_iter().map(|(a, b)| (a, b, true)));
                copy.sort_unstable();
                0
            }
            Copy::Pushed(None) => match crate::template::seize_template(tpl) {
                Ok(mut t) => {
                    let done = direct(&mut t, child.pid(), &lead, libc::SYS_process_vm_writev);
                    let _ = t.park();
                    done
                }
                Err(_) => 0,
            },
            Copy::Pulled => direct(child, tpid, &lead, libc::SYS_process_vm_readv),
        };
        let moved = &lead[..done];
        copy.retain(|&(a, b, w)| !(w && moved.binary_search(&(a, b)).is_ok()));
    }
    copy_through(child, tpid, &copy)?;
    Ok(pushed)
}

/// Copies `copy` (sorted ranges, each writable or not in `child`) from
/// `tpid` through a buffer: the writable ones in one call, the rest through
/// `/proc/PID/mem`.
fn copy_through(child: &mut Tracee, tpid: u32, copy: &[(u64, u64, bool)]) -> Result<(), ProcError> {
    if copy.is_empty() {
        return Ok(());
    }
    let total: u64 = copy.iter().map(|(a, b, _)| b - a).sum();
    let mut buf = crate::raw::Bounce::new(total as usize);
    let ranges: Vec<(u64, u64)> = copy.iter().map(|&(a, b, _)| (a, b)).collect();
    if crate::raw::read_ranges(tpid, &ranges, &mut buf).is_err() {
        // (A page it may not read as it is, say: read through `mem`.)
        let path = PathBuf::from(format!("/proc/{tpid}/mem"));
        let mem = File::open(&path).map_err(|e| ProcError::read(tpid, &path, e))?;
        let mut off = 0usize;
        for &(a, b) in &ranges {
            let len = (b - a) as usize;
            mem.read_exact_at(&mut buf[off..off + len], a)
                .map_err(|e| ProcError::read(tpid, &path, e))?;
            off += len;
        }
    }
    // Writable ones in one call; the rest through `/proc/PID/mem`.
    let mut offs = Vec::with_capacity(copy.len());
    let mut off = 0usize;
    for &(a, b, _) in copy {
        offs.push(off);
        off += (b - a) as usize;
    }
    let lead: Vec<usize> = (0..copy.len()).filter(|&i| copy[i].2).collect();
    let writable: Vec<(u64, u64)> = lead.iter().map(|&i| ranges[i]).collect();
    let from: Vec<usize> = lead.iter().map(|&i| offs[i]).collect();
    let done = crate::raw::write_ranges(child.pid(), &writable, &from, &buf);
    let written: std::collections::HashSet<usize> = lead.into_iter().take(done).collect();
    for (i, &(a, b)) in ranges.iter().enumerate() {
        if !written.contains(&i) {
            child.poke_at(a, &buf[offs[i]..offs[i] + (b - a) as usize])?;
        }
    }
    Ok(())
}

/// Below the stack pointer, where calls injected into a process write their
/// arguments (`Tracee::scratch`): pages there are not pushed by another
/// thread, which those writes would wait for.
const SCRATCH_ZONE: u64 = 64 << 10;

type Spans = Vec<(u64, u64)>;

/// Where [`SCRATCH_ZONE`] lies in `t`'s memory: whole pages from below
/// its stack pointer.
fn scratch_zone(t: &Tracee) -> (u64, u64) {
    let sp = t.saved_regs().rsp;
    (
        sp.saturating_sub(SCRATCH_ZONE) & !(PAGE - 1),
        sp.next_multiple_of(PAGE),
    )
}

/// `ranges` (sorted) cut at `lo` and `hi`: the parts within, the rest.
fn split_off(ranges: &[(u64, u64)], lo: u64, hi: u64) -> (Spans, Spans) {
    let (mut near, mut far) = (Vec::new(), Vec::new());
    for &(a, b) in ranges {
        let (x, y) = (a.max(lo), b.min(hi));
        if x >= y {
            far.push((a, b));
            continue;
        }
        if a < x {
            far.push((a, x));
        }
        near.push((x, y));
        if y < b {
            far.push((y, b));
        }
    }
    (near, far)
}

/// Bytes of writable pages from which [`direct`] pays: seizing and parking
/// the template again costs about what faulting in 64 pages of a buffer
/// does.
const DIRECT_AT_LEAST: u64 = 64 * PAGE;

/// The most ranges one injected call takes (its two iovec arrays are
/// written below the stack pointer).
const DIRECT_RANGES: usize = 128;

/// Copies `ranges` (sorted, writable in the child) between process `t`
/// (held) and process `other`, at the same addresses in both, by
/// `process_vm_writev` (`t` to `other`) or `process_vm_readv` (`other` to
/// `t`) injected into `t`: it needs `t` may access `other` (same
/// credentials, `other` dumpable). Returns how many of `ranges`, from the
/// first, were copied whole; the rest go the ordinary way.
pub(crate) fn direct(t: &mut Tracee, other: u32, ranges: &[(u64, u64)], call: i64) -> usize {
    let target = direct_target(t.pid(), other);
    direct_to(t, target, ranges, call)
}

/// Process `other` by its PID in the namespace process `t` sees, which
/// must be theirs both (`None` if not: no [`direct`] copy between them).
pub(crate) fn direct_target(t: u32, other: u32) -> Option<u32> {
    let ns = |pid: u32| std::fs::read_link(format!("/proc/{pid}/ns/pid")).ok();
    let target = crate::template::ns_pid(other)?;
    (ns(other)? == ns(t)?).then_some(target)
}

/// [`direct`] to `other` as `t` sees it, `target` ([`direct_target`]).
pub(crate) fn direct_to(
    t: &mut Tracee,
    target: Option<u32>,
    ranges: &[(u64, u64)],
    call: i64,
) -> usize {
    let Some(target) = target else {
        return 0;
    };
    let mut done = 0;
    for chunk in ranges.chunks(DIRECT_RANGES) {
        let iov: Vec<u8> = chunk
            .iter()
            .flat_map(|&(a, b)| a.to_le_bytes().into_iter().chain((b - a).to_le_bytes()))
            .collect();
        let Ok(at) = t.scratch(0, &iov) else { break };
        let n = chunk.len() as u64;
        let want: u64 = chunk.iter().map(|(a, b)| b - a).sum();
        match t.syscall_raw(call, [u64::from(target), at, n, at, n, 0]) {
            Ok(r) if r as u64 == want => done += chunk.len(),
            Ok(r) if r > 0 => {
                // The whole ranges of a partial copy.
                let mut left = r as u64;
                for (a, b) in chunk {
                    if left < b - a {
                        break;
                    }
                    left -= b - a;
                    done += 1;
                }
                break;
            }
            _ => break,
        }
    }
    done
}

/// What a page of the child needs, from the two pagemap entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Need {
    Keep,
    Copy,
    Drop,
}

fn need(t: u64, c: u64) -> Need {
    let (tp, cp) = (t & PM_PRESENT != 0, c & PM_PRESENT != 0);
    let (tf, tpfn, cpfn) = (t & PM_FILE != 0, t & PM_PFN, c & PM_PFN);
    let same = tp && cp && tpfn != 0 && tpfn == cpfn;
    if tp && tf {
        // A page of the file, unchanged: the child reads the same one.
        if cp && !same { Need::Drop } else { Need::Keep }
    } else if tp || t & PM_SWAP != 0 {
        if same { Need::Keep } else { Need::Copy }
    } else if cp {
        Need::Drop
    } else {
        Need::Keep
    }
}

/// Compares the template's and the child's pages of each private mapping
/// (of those kept, only the parts in `changed`, when given) and copies (or
/// drops) those that differ.
fn copy_pages(
    child: &mut Tracee,
    tpid: u32,
    want: &[Mapping],
    pages: &[(usize, bool)],
    changed: Option<&crate::dirty::Ranges>,
) -> Result<(), ProcError> {
    let open = |pid: u32, what: &str| {
        let path = PathBuf::from(format!("/proc/{pid}/{what}"));
        File::open(&path).map_err(|e| ProcError::read(pid, &path, e))
    };
    let (tmap, cmap, tmem) = (
        open(tpid, "pagemap")?,
        open(child.pid(), "pagemap")?,
        open(tpid, "mem")?,
    );
    let entries = |f: &File, pid: u32, (start, end): (u64, u64)| -> Result<Vec<u64>, ProcError> {
        let n = ((end - start) / PAGE) as usize;
        let mut raw = vec![0u8; n * 8];
        f.read_exact_at(&mut raw, start / PAGE * 8)
            .map_err(|e| ProcError::read(pid, std::path::Path::new("pagemap"), e))?;
        Ok(raw
            .chunks_exact(8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
            .collect())
    };
    let mut buf = Vec::new();
    let mut drop = Vec::new();
    for &(i, anew) in pages {
        let w = &want[i];
        let parts: Vec<(u64, u64)> = match changed {
            Some(c) if !anew => c.within(w.start, w.end).collect(),
            _ => vec![(w.start, w.end)],
        };
        for part in parts {
            let (t, c) = (
                entries(&tmap, tpid, part)?,
                entries(&cmap, child.pid(), part)?,
            );
            let mut p = 0;
            while p < t.len() {
                let kind = need(t[p], c[p]);
                let mut q = p + 1;
                while q < t.len()
                    && need(t[q], c[q]) == kind
                    && ((q - p) * PAGE as usize) < COPY_CHUNK
                {
                    q += 1;
                }
                let (at, len) = (part.0 + p as u64 * PAGE, (q - p) as u64 * PAGE);
                match kind {
                    Need::Keep => {}
                    Need::Drop => drop.push((at, at + len)),
                    Need::Copy => {
                        buf.resize(len as usize, 0);
                        tmem.read_exact_at(&mut buf, at)
                            .map_err(|e| ProcError::read(tpid, std::path::Path::new("mem"), e))?;
                        child.poke_at(at, &buf)?;
                    }
                }
                p = q;
            }
        }
    }
    child.madvise_all(&drop, libc::MADV_DONTNEED as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_direct_copy_targets_the_pid_its_maker_sees_and_none_that_is_gone() {
        // This process and its child share a PID namespace: the child's PID
        // there is the one a call injected into this process would name.
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("sleep");
        let me = std::process::id();
        assert_eq!(direct_target(me, child.id()), Some(child.id()));
        child.kill().expect("kill");
        child.wait().expect("reaped");
        assert_eq!(direct_target(me, child.id()), None);
    }

    #[test]
    fn ranges_are_cut_around_the_scratch_zone() {
        let r = [(0x1000, 0x3000), (0x5000, 0x9000), (0xa000, 0xb000)];
        let (near, far) = split_off(&r, 0x2000, 0x6000);
        assert_eq!(near, vec![(0x2000, 0x3000), (0x5000, 0x6000)]);
        assert_eq!(
            far,
            vec![(0x1000, 0x2000), (0x6000, 0x9000), (0xa000, 0xb000)]
        );
        let (near, far) = split_off(&r, 0xc000, 0xd000);
        assert!(near.is_empty());
        assert_eq!(far, r.to_vec());
    }

    #[test]
    fn pages_are_copied_only_where_frames_differ() {
        let anon = |pfn: u64| PM_PRESENT | pfn;
        assert_eq!(need(anon(7), anon(7)), Need::Keep);
        assert_eq!(need(anon(7), anon(8)), Need::Copy);
        assert_eq!(need(anon(7), 0), Need::Copy);
        // Without the frame numbers (no CAP_SYS_ADMIN) nothing is taken as the same.
        assert_eq!(need(PM_PRESENT, PM_PRESENT), Need::Copy);
        assert_eq!(need(0, anon(3)), Need::Drop);
        assert_eq!(need(0, 0), Need::Keep);
        assert_eq!(need(PM_SWAP, 0), Need::Copy);
        // A file's page: read again from the file where the child changed it.
        assert_eq!(need(PM_PRESENT | PM_FILE | 5, 0), Need::Keep);
        assert_eq!(
            need(PM_PRESENT | PM_FILE | 5, PM_PRESENT | PM_FILE | 5),
            Need::Keep
        );
        assert_eq!(need(PM_PRESENT | PM_FILE | 5, anon(9)), Need::Drop);
    }
}
