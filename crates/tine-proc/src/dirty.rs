//! Which pages of a process changed since a moment: the kernel's dirty-page
//! tracking, a userfaultfd in asynchronous write-protect mode
//! (`UFFD_FEATURE_WP_ASYNC`) read with `PAGEMAP_SCAN`. Once its memory is
//! registered and protected, the first write to a page lifts the page's
//! protection (no fault reaches anyone), so a scan finds every page written
//! since — and every page that is missing (dropped, or never touched), which
//! a write-protect bit cannot follow. A scan walks page tables only: a
//! fraction of a millisecond at 566 MB, where reading `pagemap` takes 2.5 ms
//! and a fork's page-table copy 8.
//!
//! The userfaultfd is made by the process itself (an injected call: it
//! belongs to the caller's memory), taken out of it at once and held by
//! whoever tracks it; closing it ends the tracking and lifts every
//! protection, after which every page reads as written — slower, never
//! wrong.

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;

use nix::libc;
use serde::{Deserialize, Serialize};

use crate::inspect::ProcError;
use crate::layout::Mapping;
use crate::ptrace::Tracee;
use crate::raw::{PageRegion, PmScan};

const PAGE: u64 = 4096;
/// `PAGE_IS_*` categories and `PM_SCAN_*` flags (include/uapi/linux/fs.h).
const PAGE_IS_WPALLOWED: u64 = 1 << 0;
const PAGE_IS_WRITTEN: u64 = 1 << 1;
const PAGE_IS_FILE: u64 = 1 << 2;
const PAGE_IS_PRESENT: u64 = 1 << 3;
const PAGE_IS_SWAPPED: u64 = 1 << 4;
const PAGE_IS_PFNZERO: u64 = 1 << 5;
const PM_SCAN_WP_MATCHING: u64 = 1 << 0;
/// `UFFD_FEATURE_WP_ASYNC`, `UFFD_USER_MODE_ONLY`.
const UFFD_FEATURE_WP_ASYNC: u64 = 1 << 15;
const UFFD_USER_MODE_ONLY: u64 = 1;
/// Regions read per `PAGEMAP_SCAN`.
const BATCH: usize = 4096;
/// Past this many ranges a set is kept as one range over them all: a
/// superset costs copies, never correctness.
const MOST_RANGES: usize = 1 << 16;

/// Page-aligned address ranges, sorted, disjoint and not touching.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Ranges(Vec<(u64, u64)>);

impl Ranges {
    pub fn new() -> Ranges {
        Ranges(Vec::new())
    }

    /// From any ranges (unsorted, overlapping, empty ones skipped).
    pub fn from_unsorted(mut v: Vec<(u64, u64)>) -> Ranges {
        v.retain(|(a, b)| a < b);
        v.sort_unstable();
        let mut out: Vec<(u64, u64)> = Vec::with_capacity(v.len());
        for (a, b) in v {
            match out.last_mut() {
                Some(last) if a <= last.1 => last.1 = last.1.max(b),
                _ => out.push((a, b)),
            }
        }
        let mut r = Ranges(out);
        r.bound();
        r
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.0.iter().copied()
    }

    /// How many pages they cover.
    pub fn pages(&self) -> u64 {
        self.0.iter().map(|(a, b)| (b - a) / PAGE).sum()
    }

    /// Adds every range of `other`.
    pub fn add(&mut self, other: &Ranges) {
        if other.is_empty() {
            return;
        }
        let mut v = std::mem::take(&mut self.0);
        v.extend_from_slice(&other.0);
        *self = Ranges::from_unsorted(v);
    }

    /// The parts of these ranges inside `other`'s.
    pub fn intersect(&self, other: &Ranges) -> Ranges {
        let mut out = Vec::new();
        for (a, b) in other.iter() {
            out.extend(self.within(a, b));
        }
        Ranges::from_unsorted(out)
    }

    /// These ranges less `other`'s.
    pub fn without(&self, other: &Ranges) -> Ranges {
        let mut out = Vec::new();
        for (a, b) in self.iter() {
            let mut at = a;
            for (x, y) in other.within(a, b) {
                if at < x {
                    out.push((at, x));
                }
                at = y;
            }
            if at < b {
                out.push((at, b));
            }
        }
        Ranges::from_unsorted(out)
    }

    /// The parts of these ranges inside `[start, end)`.
    pub fn within(&self, start: u64, end: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        let first = self.0.partition_point(|&(_, b)| b <= start);
        self.0[first..]
            .iter()
            .take_while(move |&&(a, _)| a < end)
            .map(move |&(a, b)| (a.max(start), b.min(end)))
    }

    fn bound(&mut self) {
        if self.0.len() > MOST_RANGES {
            let (a, b) = (self.0[0].0, self.0[self.0.len() - 1].1);
            self.0 = vec![(a, b)];
        }
    }
}

/// The mappings whose pages are the process's own: private ones, writable
/// or not (a page written while writable stays written once read-only),
/// but the kernel's.
pub fn tracked(maps: &[Mapping]) -> Vec<(u64, u64)> {
    maps.iter()
        .filter(|m| own(m))
        .map(|m| (m.start, m.end))
        .collect()
}

/// The [`tracked`] mappings worth registering and protecting: those the
/// process can touch. Protecting a `PROT_NONE` reservation (V8 keeps one of
/// half a gigabyte, glibc one of 64 MiB per arena) fills page tables with
/// markers that every later scan walks (node: ~0.5 ms a scan). Left out,
/// such a mapping stays unregistered, so that any page it holds (written
/// while it was accessible) reads as written, and the part made accessible
/// later is registered at the next checkpoint as a mapping made since.
pub fn armable(maps: &[Mapping]) -> Vec<(u64, u64)> {
    maps.iter()
        .filter(|m| own(m) && m.prot != 0)
        .map(|m| (m.start, m.end))
        .collect()
}

/// A private mapping not the kernel's: the process's own pages.
fn own(m: &Mapping) -> bool {
    !m.shared && !m.special() && m.path != "[vsyscall]"
}

/// [`tracked`] mappings in runs, each from one to the last before a
/// mapping not tracked (over unmapped gaps, which a scan skips): what one
/// scan call covers.
pub fn runs(maps: &[Mapping]) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    let mut open = false;
    for m in maps {
        if own(m) {
            match out.last_mut() {
                Some(last) if open => last.1 = m.end,
                _ => out.push((m.start, m.end)),
            }
            open = true;
        } else {
            open = false;
        }
    }
    out
}

fn io(pid: u32, step: &'static str) -> impl FnOnce(std::io::Error) -> ProcError {
    move |source| ProcError::Ptrace { pid, step, source }
}

pub(crate) fn open_pagemap(pid: u32) -> Result<File, ProcError> {
    let path = PathBuf::from(format!("/proc/{pid}/pagemap"));
    File::open(&path).map_err(|e| ProcError::read(pid, &path, e))
}

/// Makes a userfaultfd for the memory of stopped process `t` (a call it
/// makes itself), takes it out of its descriptor table and readies it for
/// asynchronous write protection.
pub fn open_tracker(t: &mut Tracee) -> Result<OwnedFd, ProcError> {
    let pid = t.pid();
    let fd = t.syscall(
        "userfaultfd",
        libc::SYS_userfaultfd,
        [
            (libc::O_CLOEXEC | libc::O_NONBLOCK) as u64 | UFFD_USER_MODE_ONLY,
            0,
            0,
            0,
            0,
            0,
        ],
    )?;
    let taken = rustix::process::pidfd_open(
        rustix::process::Pid::from_raw(pid as i32).ok_or(ProcError::Gone { pid })?,
        rustix::process::PidfdFlags::empty(),
    )
    .and_then(|p| {
        rustix::process::pidfd_getfd(&p, fd as i32, rustix::process::PidfdGetfdFlags::empty())
    });
    t.syscall("close", libc::SYS_close, [fd, 0, 0, 0, 0, 0])?;
    let uffd = taken.map_err(|e| io(pid, "take its userfaultfd (pidfd_getfd)")(e.into()))?;
    crate::raw::uffd_api(uffd.as_fd(), UFFD_FEATURE_WP_ASYNC)
        .map_err(io(pid, "set up its userfaultfd (UFFDIO_API)"))?;
    Ok(uffd)
}

/// Registers `ranges` (whole mappings among `maps`) of `pid`'s memory
/// with its userfaultfd `uffd`, then write-protects them: from here on
/// every write there is seen. Ranges already registered are registered
/// again (a no-op); one the kernel refuses stays unregistered (its pages
/// read as written).
pub fn arm(
    pid: u32,
    uffd: &OwnedFd,
    ranges: &[(u64, u64)],
    maps: &[Mapping],
) -> Result<(), ProcError> {
    for &(a, b) in ranges {
        let _ = crate::raw::uffd_register_wp(uffd.as_fd(), a, b - a);
    }
    let (anon, files) = by_backing(&Ranges::from_unsorted(ranges.to_vec()), maps);
    protect(pid, &anon, &files)
}

/// Write-protects the pages written of `anon` and `files` (ranges of
/// anonymous memory and of files' private mappings: [`by_backing`]), so
/// that the next write to each is seen; ranges not registered are left
/// alone. In anonymous memory only the pages held are: protecting an empty
/// entry, or a range without a page table, makes page tables of markers
/// (asynchronous protection implies `UFFD_FEATURE_WP_UNPOPULATED`) that
/// every later scan walks — numpy's two 128 MiB OpenBLAS buffers never
/// touched, 65 k entries. Left alone, such a page reads as written (an
/// empty entry; a range without a table where [`scan_sees_holes`]), which a
/// set holds as a range, and a write there faults in a page unprotected.
/// In a file's mapping a page faulted in unprotected would read as
/// unwritten only under a marker: there every page is protected.
pub fn protect(pid: u32, anon: &Ranges, files: &Ranges) -> Result<(), ProcError> {
    let pm = open_pagemap(pid)?;
    let held = PAGE_IS_PRESENT | PAGE_IS_SWAPPED;
    let each = anon
        .iter()
        .map(|r| (r, held))
        .chain(files.iter().map(|r| (r, 0)));
    for ((a, b), anyof) in each {
        let q = PmScan {
            flags: PM_SCAN_WP_MATCHING,
            start: a,
            end: b,
            category_mask: PAGE_IS_WRITTEN,
            category_anyof_mask: anyof,
            return_mask: PAGE_IS_WRITTEN,
            ..PmScan::default()
        };
        crate::raw::pagemap_scan(pm.as_fd(), &q, &mut [])
            .map_err(io(pid, "write-protect its pages (PAGEMAP_SCAN)"))?;
    }
    Ok(())
}

/// [`protect`] of a stopped process every written page of whose
/// registered memory is in a set already (the scan that found them was
/// recorded): ranges less than [`PROTECT_GAP`] apart go in one call,
/// since protecting a page not written is a no-op and a written one
/// between them is recorded. Each call costs a few µs (a TLB flush among
/// them), walking a gap's page-table entries far less (numpy's 67 ranges
/// after a rollback: 0.32 ms one by one). Not for a running process: a page
/// it wrote in a gap after the scan would be protected unrecorded.
pub fn protect_stopped(pid: u32, anon: &Ranges, files: &Ranges) -> Result<(), ProcError> {
    protect(
        pid,
        &over_gaps(anon, PROTECT_GAP),
        &over_gaps(files, PROTECT_GAP),
    )
}

/// `ranges` with each gap shorter than `gap` filled.
fn over_gaps(ranges: &Ranges, gap: u64) -> Ranges {
    let mut merged: Vec<(u64, u64)> = Vec::new();
    for (a, b) in ranges.iter() {
        match merged.last_mut() {
            Some(last) if a - last.1 < gap => last.1 = b,
            _ => merged.push((a, b)),
        }
    }
    Ranges(merged)
}

/// Ranges of a stopped process's set closer than this are protected in one
/// call ([`protect_stopped`]): 4 MiB, two page tables' entries to walk.
const PROTECT_GAP: u64 = 1024 * PAGE;

/// The pages of `spans` written since they were protected (or in memory
/// not registered; and, as the kernel may count them, some that are
/// missing): the fast scan, for what a checkpoint adds to the sets.
pub fn written(pid: u32, spans: &[(u64, u64)]) -> Result<Ranges, ProcError> {
    collect(pid, spans.iter().copied(), WRITTEN)
}

/// The query of [`written`].
pub(crate) const WRITTEN: PmScan = PmScan {
    category_mask: PAGE_IS_WRITTEN,
    return_mask: PAGE_IS_WRITTEN,
    ..PmScan::EMPTY
};

/// What a scan found in a process's memory.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Changed {
    /// Pages present and written since they were last protected (or in
    /// memory not registered: all of its present pages).
    pub written: Ranges,
    /// Pages not present (dropped, or never touched).
    pub absent: Ranges,
}

/// Scans `spans` of `pid`'s memory for pages written since they were
/// protected, and pages missing.
pub fn changed(pid: u32, spans: &[(u64, u64)]) -> Result<Changed, ProcError> {
    // Written, or (inverted) not present.
    let q = PmScan {
        category_inverted: PAGE_IS_PRESENT,
        category_anyof_mask: PAGE_IS_WRITTEN | PAGE_IS_PRESENT,
        return_mask: PAGE_IS_WRITTEN | PAGE_IS_PRESENT,
        ..PmScan::default()
    };
    let (mut written, mut absent) = (Vec::new(), Vec::new());
    scan(pid, spans.iter().copied(), q, |r| {
        if r.categories & PAGE_IS_PRESENT != 0 {
            written.push((r.start, r.end));
        } else {
            absent.push((r.start, r.end));
        }
    })?;
    Ok(Changed {
        written: Ranges::from_unsorted(written),
        absent: Ranges::from_unsorted(absent),
    })
}

/// The parts of `spans` not registered for write tracking: mappings made
/// since the process was armed.
pub fn unregistered(pid: u32, spans: &[(u64, u64)]) -> Result<Ranges, ProcError> {
    let q = PmScan {
        category_inverted: PAGE_IS_WPALLOWED,
        category_mask: PAGE_IS_WPALLOWED,
        return_mask: PAGE_IS_WPALLOWED,
        ..PmScan::default()
    };
    collect(pid, spans.iter().copied(), q)
}

/// The pages of `ranges` that `pid` does not hold (neither present nor
/// swapped out).
pub fn absent(pid: u32, ranges: &Ranges) -> Result<Ranges, ProcError> {
    collect_close(&open_pagemap(pid)?, pid, ranges, ABSENT)
}

/// The query of [`absent`].
pub(crate) const ABSENT: PmScan = PmScan {
    category_inverted: PAGE_IS_PRESENT | PAGE_IS_SWAPPED,
    category_mask: PAGE_IS_PRESENT | PAGE_IS_SWAPPED,
    return_mask: PAGE_IS_PRESENT,
    ..PmScan::EMPTY
};

/// Of `ranges` of `pid`'s memory, the pages it does not hold a copy of
/// its own in: not present (dropped, never touched, swapped out, or the
/// marker a tracked file mapping's dropped page leaves), or a file's page
/// (its copy dropped and the file read there since: no write-protect bit
/// tells). The kernel looks up every present page for this (10 ms at
/// 566 MB, where [`absent`] walks it in 0.4): for file mappings' pages.
pub fn lost(pid: u32, ranges: &Ranges) -> Result<Ranges, ProcError> {
    // Not present, or a file's.
    let q = PmScan {
        category_inverted: PAGE_IS_PRESENT,
        category_anyof_mask: PAGE_IS_PRESENT | PAGE_IS_FILE,
        return_mask: PAGE_IS_PRESENT,
        ..PmScan::default()
    };
    // Range by range: each page between them would be looked up too
    // (numpy's 40 ranges walked over their gaps, libraries' text among
    // them: 0.43 ms against 0.2).
    collect(pid, ranges.iter(), q)
}

/// `own` (pages a template holds of its own, or any ranges of a process's
/// memory) split by the kind of its mappings `maps`: (in anonymous memory,
/// in mappings of files).
pub fn by_backing(own: &Ranges, maps: &[Mapping]) -> (Ranges, Ranges) {
    let files = Ranges::from_unsorted(
        maps.iter()
            .filter(|m| m.inode != 0)
            .map(|m| (m.start, m.end))
            .collect(),
    );
    (own.without(&files), own.intersect(&files))
}

/// The pages of a template's own (`anon`, `files`: [`by_backing`]) that
/// process `pid` lost since: anonymous ones dropped, and file mappings'
/// ones it no longer holds a copy of ([`lost`]). `written`: pages known
/// written since (a scan's, or sets holding one) — where the kernel's
/// written scan reports dropped pages ([`scan_sees_holes`]), the lost
/// anonymous pages are among them, so only those are walked, not every
/// page the template holds (numpy with 146 k pages: 0.4 ms a walk).
pub fn dropped(
    pid: u32,
    anon: &Ranges,
    files: &Ranges,
    written: Option<&Ranges>,
) -> Result<Ranges, ProcError> {
    let mut gone = match written.filter(|_| scan_sees_holes()) {
        Some(w) => absent(pid, &anon.intersect(w))?,
        None => absent(pid, anon)?,
    };
    if !files.is_empty() {
        gone.add(&lost(pid, files)?);
    }
    Ok(gone)
}

/// Whether this kernel's written scan ([`written`]) reports registered
/// anonymous memory whose page table went with the pages dropped there —
/// `MADV_DONTNEED` frees an empty table where `CONFIG_PT_RECLAIM` is set,
/// and a huge page dropped leaves none — as written, as it reports an
/// empty entry. The 6.18 kernels here do (a fix proposed in July 2026, for
/// stable kernels too, makes every kernel do so); where one does not, only
/// a walk for missing pages finds such drops. Probed once, in this
/// process's own memory (0.2-0.9 ms: a huge page is made for it), so
/// asked before a pause.
pub fn scan_sees_holes() -> bool {
    static SEES: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SEES.get_or_init(|| probe_holes().unwrap_or(false))
}

/// `MADV_COLLAPSE` (Linux 6.1).
const MADV_COLLAPSE: libc::c_int = 25;

/// [`scan_sees_holes`] asked of the kernel, with 4 MiB registered: each
/// 2 MiB half holds one page written, then (where this kernel makes one)
/// the second becomes a huge page; both are protected, then dropped
/// whole; the scan must report every page of both.
fn probe_holes() -> std::io::Result<bool> {
    const HALF: usize = 2 << 20;
    let r = crate::raw::Region::new(2 * HALF, HALF)?;
    r.touch(0);
    r.advise(HALF, HALF, libc::MADV_HUGEPAGE)?;
    r.touch(HALF);
    // No huge page (none allowed, or no memory for one): then no program
    // has one to drop either.
    let _ = r.advise(HALF, HALF, MADV_COLLAPSE);
    let uffd = crate::raw::userfaultfd_here(
        (libc::O_CLOEXEC | libc::O_NONBLOCK) as u64 | UFFD_USER_MODE_ONLY,
    )?;
    crate::raw::uffd_api(uffd.as_fd(), UFFD_FEATURE_WP_ASYNC)?;
    crate::raw::uffd_register_wp(uffd.as_fd(), r.base, 2 * HALF as u64)?;
    let pm = File::open("/proc/self/pagemap")?;
    let q = PmScan {
        start: r.base,
        end: r.base + 2 * HALF as u64,
        category_mask: PAGE_IS_WRITTEN,
        return_mask: PAGE_IS_WRITTEN,
        ..PmScan::default()
    };
    let protect = PmScan {
        flags: PM_SCAN_WP_MATCHING,
        ..q
    };
    crate::raw::pagemap_scan(pm.as_fd(), &protect, &mut [])?;
    let mut out = [PageRegion::default(); 4];
    // Protected: nothing reads as written.
    if crate::raw::pagemap_scan(pm.as_fd(), &q, &mut out)?.0 != 0 {
        return Ok(false);
    }
    r.advise(0, 2 * HALF, libc::MADV_DONTNEED)?;
    let (n, _) = crate::raw::pagemap_scan(pm.as_fd(), &q, &mut out)?;
    Ok(n == 1 && out[0].start == q.start && out[0].end == q.end)
}

/// The pages of `ranges` that `pid` holds (present or swapped out).
pub fn present(pid: u32, ranges: &Ranges) -> Result<Ranges, ProcError> {
    let q = PmScan {
        category_anyof_mask: PAGE_IS_PRESENT | PAGE_IS_SWAPPED,
        return_mask: PAGE_IS_PRESENT,
        ..PmScan::default()
    };
    collect_close(&open_pagemap(pid)?, pid, ranges, q)
}

/// The pages `pid` holds in `spans`: its own (anonymous, or swapped out),
/// and those of a file it has not changed. The shared zero page (an
/// anonymous page read, never written) is not its own: a copy lacking it
/// reads the same zeros, and a fork leaves it out. Nor is a tracked
/// process's write-protect marker on a page it never had, which a scan
/// reports as swapped: when nothing of it is swapped out, none is.
pub fn held(pid: u32, spans: &[(u64, u64)]) -> Result<(Ranges, Ranges), ProcError> {
    let q = PmScan {
        category_anyof_mask: PAGE_IS_PRESENT | PAGE_IS_SWAPPED,
        return_mask: PAGE_IS_PRESENT | PAGE_IS_SWAPPED | PAGE_IS_FILE | PAGE_IS_PFNZERO,
        ..PmScan::default()
    };
    let swaps = swapped_out(pid)?;
    let (mut own, mut file) = (Vec::new(), Vec::new());
    scan(pid, spans.iter().copied(), q, |r| {
        let swapped = r.categories & PAGE_IS_SWAPPED != 0;
        if r.categories & PAGE_IS_PFNZERO != 0 || (swapped && !swaps) {
            // Reads as if it were not there.
        } else if r.categories & PAGE_IS_FILE != 0 && !swapped {
            file.push((r.start, r.end));
        } else {
            own.push((r.start, r.end));
        }
    })?;
    Ok((Ranges::from_unsorted(own), Ranges::from_unsorted(file)))
}

/// Whether any of `pid`'s memory is swapped out (`VmSwap:`).
fn swapped_out(pid: u32) -> Result<bool, ProcError> {
    let path = std::path::PathBuf::from(format!("/proc/{pid}/status"));
    let status = std::fs::read_to_string(&path).map_err(|e| ProcError::read(pid, &path, e))?;
    Ok(status
        .lines()
        .find_map(|l| l.strip_prefix("VmSwap:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .is_none_or(|kib| kib > 0))
}

/// The regions query `q` finds in `ranges` of `pid`'s memory.
fn collect(
    pid: u32,
    ranges: impl Iterator<Item = (u64, u64)>,
    q: PmScan,
) -> Result<Ranges, ProcError> {
    collect_in(&open_pagemap(pid)?, pid, ranges, q)
}

/// Ranges closer than this are walked in one call ([`collect_close`]): a
/// call costs 1-5 µs before it walks (numpy's 130 dropped pages asked in
/// as many ranges: 0.13 ms), an entry between them nanoseconds — unless
/// the query looks each page up (`PAGE_IS_FILE`).
const ASK_OVER_GAP: u64 = 256 * PAGE;

/// What query `q` finds in `ranges` of `pid`'s memory, through `pm`: those
/// closer than [`ASK_OVER_GAP`] walked as one, what is found between them
/// left out. (`q` must neither protect nor ask `PAGE_IS_FILE`: what lies
/// between is walked too.)
pub(crate) fn collect_close(
    pm: &File,
    pid: u32,
    ranges: &Ranges,
    q: PmScan,
) -> Result<Ranges, ProcError> {
    debug_assert_eq!(q.flags & PM_SCAN_WP_MATCHING, 0);
    debug_assert_eq!(
        (q.category_mask | q.category_anyof_mask | q.return_mask) & PAGE_IS_FILE,
        0
    );
    let cover = over_gaps(ranges, ASK_OVER_GAP);
    if cover.0.len() == ranges.0.len() {
        return collect_in(pm, pid, ranges.iter(), q);
    }
    Ok(collect_in(pm, pid, cover.iter(), q)?.intersect(ranges))
}

/// [`collect`] through `pm`, `pid`'s pagemap, open already.
pub(crate) fn collect_in(
    pm: &File,
    pid: u32,
    ranges: impl Iterator<Item = (u64, u64)>,
    q: PmScan,
) -> Result<Ranges, ProcError> {
    let mut found = Vec::new();
    scan_in(pm, pid, ranges, q, |r| found.push((r.start, r.end)))?;
    Ok(Ranges::from_unsorted(found))
}

/// Runs query `q` over each of `ranges` of `pid`'s memory, each region it
/// finds to `each`.
fn scan(
    pid: u32,
    ranges: impl Iterator<Item = (u64, u64)>,
    q: PmScan,
    each: impl FnMut(&PageRegion),
) -> Result<(), ProcError> {
    scan_in(&open_pagemap(pid)?, pid, ranges, q, each)
}

/// [`scan`] through `pm`, `pid`'s pagemap, open already.
fn scan_in(
    pm: &File,
    pid: u32,
    ranges: impl Iterator<Item = (u64, u64)>,
    q: PmScan,
    mut each: impl FnMut(&PageRegion),
) -> Result<(), ProcError> {
    // Room for as many regions as a range has pages (at most `BATCH`): the
    // kernel allocates a buffer by it for each call (a range of 14 pages
    // asked with room for 4096: 2.0 µs a call, with room for 14: 1.5).
    let mut out = Vec::new();
    for (a, b) in ranges {
        let room = ((b.saturating_sub(a) / PAGE) as usize).clamp(1, BATCH);
        if out.len() < room {
            out.resize(room, PageRegion::default());
        }
        walk(
            pm,
            pid,
            PmScan {
                start: a,
                end: b,
                ..q
            },
            &mut out[..room],
            &mut each,
        )?;
    }
    Ok(())
}

/// Runs scan `q` to its end, `out` a batch at a time, each region to `each`.
fn walk(
    pm: &File,
    pid: u32,
    mut q: PmScan,
    out: &mut [PageRegion],
    mut each: impl FnMut(&PageRegion),
) -> Result<(), ProcError> {
    loop {
        let (n, walk_end) = crate::raw::pagemap_scan(pm.as_fd(), &q, out)
            .map_err(io(pid, "scan its page tables (PAGEMAP_SCAN)"))?;
        out[..n].iter().for_each(&mut each);
        if n < out.len() || walk_end >= q.end || walk_end <= q.start {
            return Ok(());
        }
        q.start = walk_end;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_walked_as_one_find_what_each_walked_alone_finds() {
        // 600 pages of this process, every third touched; asked: scattered
        // single pages and runs, some closer than the gap walked over, one
        // farther, both present and absent pages among them.
        let n = 600usize;
        let r = crate::raw::Region::new(n * PAGE as usize, PAGE as usize).unwrap();
        for i in (0..n).step_by(3) {
            r.touch(i * PAGE as usize);
        }
        let p = |i: u64| r.base + i * PAGE;
        let asked = Ranges::from_unsorted(vec![
            (p(1), p(2)),
            (p(5), p(9)),
            (p(30), p(31)),
            (p(33), p(40)),
            (p(590), p(600)),
        ]);
        let me = std::process::id();
        let pm = open_pagemap(me).unwrap();
        for q in [ABSENT, WRITTEN] {
            let one = collect_close(&pm, me, &asked, q).unwrap();
            let each = collect_in(&pm, me, asked.iter(), q).unwrap();
            assert_eq!(one, each);
            assert!(one.without(&asked).is_empty());
        }
        let gone = absent(me, &asked).unwrap();
        // Untouched: 1, 5, 7, 8, 31, 34, 35, 37, 38, and 7 of 590-599.
        assert_eq!(gone.within(p(1), p(2)).count(), 1);
        assert_eq!(gone.within(p(6), p(7)).count(), 0);
        assert_eq!(
            gone.intersect(&Ranges::from_unsorted(vec![(p(590), p(600))]))
                .pages(),
            7
        );
    }

    #[test]
    fn gaps_shorter_than_asked_are_filled() {
        let r = Ranges::from_unsorted(vec![(0x1000, 0x2000), (0x4000, 0x5000), (0x9000, 0xa000)]);
        assert_eq!(
            over_gaps(&r, 0x3000).iter().collect::<Vec<_>>(),
            vec![(0x1000, 0x5000), (0x9000, 0xa000)]
        );
        assert_eq!(over_gaps(&r, 0x2000), r);
        assert_eq!(
            over_gaps(&r, 0x10000).iter().collect::<Vec<_>>(),
            vec![(0x1000, 0xa000)]
        );
    }

    #[test]
    fn ranges_merge_and_clip() {
        let r = Ranges::from_unsorted(vec![(0x5000, 0x6000), (0x1000, 0x2000), (0x2000, 0x3000)]);
        assert_eq!(
            r.iter().collect::<Vec<_>>(),
            [(0x1000, 0x3000), (0x5000, 0x6000)]
        );
        assert_eq!(r.pages(), 3);
        assert_eq!(
            r.within(0x2800, 0x5800).collect::<Vec<_>>(),
            [(0x2800, 0x3000), (0x5000, 0x5800)]
        );
        assert_eq!(
            r.intersect(&Ranges::from_unsorted(vec![(0x2000, 0x5800)]))
                .iter()
                .collect::<Vec<_>>(),
            [(0x2000, 0x3000), (0x5000, 0x5800)]
        );
        let mut s = Ranges::from_unsorted(vec![(0x3000, 0x5000)]);
        s.add(&r);
        assert_eq!(s.iter().collect::<Vec<_>>(), [(0x1000, 0x6000)]);
        assert!(Ranges::from_unsorted(vec![(5, 5)]).is_empty());
        // Less another's: holes cut, edges trimmed, the rest kept.
        let cut = Ranges::from_unsorted(vec![(0x1800, 0x2000), (0x2800, 0x5800)]);
        assert_eq!(
            r.without(&cut).iter().collect::<Vec<_>>(),
            [(0x1000, 0x1800), (0x2000, 0x2800), (0x5800, 0x6000)]
        );
        assert!(r.without(&r).is_empty());
        assert_eq!(r.without(&Ranges::new()), r);
    }
}
