//! A rollback's page-table walks shared between threads: the written scan
//! of a process's memory and, within what it finds, the walk for its
//! template's anonymous pages the process dropped, cut in pieces of about
//! equal size that each thread takes in turn till none is left. One thread
//! starts at once; the other joins once its own walks (the memory map,
//! the files' mappings) are done, and takes what is left: node's written
//! scan alone outlasted them by 0.2 ms. A walk costs by the page tables it
//! reads, not by the addresses it spans: the pieces hold equal shares of
//! the pages the template holds (cut by address, numpy's 540 MB fell in
//! one piece of eight, the others spanning unmapped gaps of terabytes).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::dirty::{ABSENT, Ranges, WRITTEN, collect_close, collect_in, open_pagemap};
use crate::inspect::ProcError;

/// Pieces the walks are cut in: enough for the thread that joins late to
/// find some left, few enough that each costs little more than its walk.
const PIECES: u64 = 8;

/// The walks of a template's memory, worked out once from what was read of
/// it, off the pause (numpy's took the rollback's thread 0.02-0.04 ms of its
/// pause, before the helper thread had anything to walk).
#[derive(Debug, PartialEq, Eq)]
pub struct Plan {
    /// The runs of mappings the written scan covers, as the template had them.
    runs: Ranges,
    pieces: Vec<Vec<(u64, u64)>>,
    /// The template's own pages in anonymous memory, and in files' private
    /// mappings ([`crate::dirty::by_backing`]).
    anon: Ranges,
    files: Ranges,
}

impl Plan {
    /// The walks of `runs` (sorted) of a process whose page tables hold
    /// entries at `weight` (the pages its template holds of its own, and
    /// those protected under markers), `anon` and `files` its template's own
    /// pages by backing.
    pub fn new(runs: Vec<(u64, u64)>, weight: &Ranges, anon: Ranges, files: Ranges) -> Plan {
        Plan {
            pieces: cut(&runs, weight, PIECES),
            runs: Ranges::from_unsorted(runs),
            anon,
            files,
        }
    }

    /// The runs the pieces cover.
    pub fn runs(&self) -> &Ranges {
        &self.runs
    }

    /// The template's own pages in anonymous memory.
    pub fn anon(&self) -> &Ranges {
        &self.anon
    }

    /// The template's own pages in files' private mappings.
    pub fn files(&self) -> &Ranges {
        &self.files
    }
}

/// What is left to walk, and what was found.
#[derive(Debug)]
pub struct Shares {
    pid: u32,
    plan: Arc<Plan>,
    next: AtomicUsize,
    found: Mutex<Found>,
}

#[derive(Debug, Default)]
struct Found {
    written: Vec<(u64, u64)>,
    dropped: Vec<(u64, u64)>,
    failed: Option<ProcError>,
}

impl Shares {
    /// The walks `plan` of process `pid`'s memory (stopped). Only where the
    /// kernel's written scan reports dropped pages
    /// ([`crate::dirty::scan_sees_holes`]): the dropped ones are then among
    /// the written.
    pub fn new(pid: u32, plan: Arc<Plan>) -> Shares {
        Shares {
            pid,
            plan,
            next: AtomicUsize::new(0),
            found: Mutex::new(Found::default()),
        }
    }

    /// Walks pieces till none is left.
    pub fn take(&self) {
        let pm = match open_pagemap(self.pid) {
            Ok(pm) => pm,
            Err(e) => return self.failed(e),
        };
        let pieces = &self.plan.pieces;
        while let Some(piece) = pieces.get(self.next.fetch_add(1, Ordering::Relaxed)) {
            let walked = collect_in(&pm, self.pid, piece.iter().copied(), WRITTEN).and_then(|w| {
                let dropped = self.plan.anon.intersect(&w);
                collect_close(&pm, self.pid, &dropped, ABSENT).map(|d| (w, d))
            });
            let mut found = self.found.lock().unwrap_or_else(|p| p.into_inner());
            match walked {
                Ok((w, d)) => {
                    found.written.extend(w.iter());
                    found.dropped.extend(d.iter());
                }
                Err(e) => {
                    found.failed.get_or_insert(e);
                }
            }
        }
    }

    fn failed(&self, e: ProcError) {
        let mut found = self.found.lock().unwrap_or_else(|p| p.into_inner());
        found.failed.get_or_insert(e);
        // Nothing more for anyone.
        self.next.store(self.plan.pieces.len(), Ordering::Relaxed);
    }

    /// (Pages written, anonymous pages of the template's own dropped),
    /// once every thread that took pieces is done.
    pub fn found(self) -> Result<(Ranges, Ranges), ProcError> {
        let f = self.found.into_inner().unwrap_or_else(|p| p.into_inner());
        match f.failed {
            Some(e) => Err(e),
            None => Ok((
                Ranges::from_unsorted(f.written),
                Ranges::from_unsorted(f.dropped),
            )),
        }
    }
}

/// `runs` (sorted, page-aligned) cut in at most `n` pieces, in order, each
/// holding about as many pages of `weight` as the others (`weight` outside
/// `runs` counts for nothing; with none inside, by pages spanned).
fn cut(runs: &[(u64, u64)], weight: &Ranges, n: u64) -> Vec<Vec<(u64, u64)>> {
    const PAGE: u64 = 4096;
    let n = n.max(1);
    let inside = weight.intersect(&Ranges::from_unsorted(runs.to_vec()));
    let weight = if inside.is_empty() {
        Ranges::from_unsorted(runs.to_vec())
    } else {
        inside
    };
    // The addresses at which each piece but the first starts: where the
    // weight's pages reach the next share.
    let each = weight.pages().div_ceil(n).max(1);
    let mut bounds = Vec::new();
    let mut seen = 0;
    for (a, b) in weight.iter() {
        let pages = (b - a) / PAGE;
        while bounds.len() < n as usize - 1 && seen + pages > each * (bounds.len() as u64 + 1) {
            let k = each * (bounds.len() as u64 + 1) - seen;
            bounds.push(a + k * PAGE);
        }
        seen += pages;
    }
    let mut pieces: Vec<Vec<(u64, u64)>> = vec![Vec::new(); bounds.len() + 1];
    for &(mut a, b) in runs {
        while a < b {
            let i = bounds.partition_point(|&x| x <= a);
            let end = bounds.get(i).map_or(b, |&x| x.min(b));
            pieces[i].push((a, end));
            a = end;
        }
    }
    pieces.retain(|p| !p.is_empty());
    pieces
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_are_cut_in_pieces_of_about_equal_pages_covering_them_all() {
        let p = 4096;
        let runs = [(0, 10 * p), (20 * p, 21 * p), (30 * p, 36 * p)];
        let pieces = cut(&runs, &Ranges::new(), 4);
        // 17 pages: pieces of 5.
        let sizes: Vec<u64> = pieces
            .iter()
            .map(|x| x.iter().map(|(a, b)| (b - a) / p).sum())
            .collect();
        assert_eq!(sizes, [5, 5, 5, 2]);
        let all: Vec<(u64, u64)> = pieces.into_iter().flatten().collect();
        assert_eq!(
            Ranges::from_unsorted(all),
            Ranges::from_unsorted(runs.to_vec())
        );
        assert!(cut(&[], &Ranges::new(), 8).is_empty());
        assert_eq!(cut(&[(0, p)], &Ranges::new(), 8), [[(0, p)]]);
    }

    #[test]
    fn pieces_share_the_pages_held_not_the_addresses_spanned() {
        let p = 4096;
        // One run over a gap of a terabyte, the pages held at both ends
        // (12 and 4), and a run holding none.
        let far = 1u64 << 40;
        let runs = [(0, far + 8 * p), (2 * far, 2 * far + 100 * p)];
        let held = Ranges::from_unsorted(vec![(0, 12 * p), (far + 4 * p, far + 8 * p)]);
        let pieces = cut(&runs, &held, 4);
        let weights: Vec<u64> = pieces
            .iter()
            .map(|x| {
                x.iter()
                    .map(|&(a, b)| held.within(a, b).map(|(a, b)| (b - a) / p).sum::<u64>())
                    .sum()
            })
            .collect();
        assert_eq!(weights, [4, 4, 4, 4]);
        // Every address of the runs still in exactly one piece, in order.
        let all: Vec<(u64, u64)> = pieces.iter().flatten().copied().collect();
        assert!(all.windows(2).all(|w| w[0].1 <= w[1].0));
        assert_eq!(
            Ranges::from_unsorted(all),
            Ranges::from_unsorted(runs.to_vec())
        );
        assert_eq!(pieces.last().unwrap().last(), Some(&runs[1]));
    }

    #[test]
    fn two_threads_taking_pieces_find_what_one_walk_finds() {
        // This process's own memory: a region, half of it written.
        let len = 64 * 4096;
        let mut v = vec![0u8; len];
        for i in (0..len).step_by(8192) {
            v[i] = 1;
        }
        let a = v.as_ptr() as u64 & !4095;
        let runs = [(a, a + len as u64)];
        let me = std::process::id();
        let all = Ranges::from_unsorted(runs.to_vec());
        let plan = Plan::new(runs.to_vec(), &all, all.clone(), Ranges::new());
        let s = Shares::new(me, Arc::new(plan));
        std::thread::scope(|sc| {
            sc.spawn(|| s.take());
            s.take();
        });
        let (w, d) = s.found().unwrap();
        let one = crate::dirty::written(me, &runs).unwrap();
        assert_eq!(w, one);
        assert_eq!(
            d,
            crate::dirty::absent(me, &one.intersect(&Ranges::from_unsorted(runs.to_vec())))
                .unwrap()
        );
        std::hint::black_box(&v);
    }
}
