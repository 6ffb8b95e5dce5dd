//! The address-space layout a graft must reach: from two `/proc/PID/maps`
//! listings — a fresh fork's (its parent's layout) and a template's — which
//! of the fork's mappings stay, which go, where its vDSO moves, and which of
//! the template's mappings are made anew. Pure: `graft` carries it out.

/// One line of `/proc/PID/maps`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    /// `PROT_READ | PROT_WRITE | PROT_EXEC` bits.
    pub prot: u64,
    pub shared: bool,
    pub offset: u64,
    pub dev: String,
    pub inode: u64,
    pub path: String,
}

impl Mapping {
    pub fn bytes(&self) -> u64 {
        self.end - self.start
    }

    /// A mapping the kernel makes (`[vdso]`, `[vvar]`, `[vvar_vclock]`):
    /// moved, never made.
    pub fn special(&self) -> bool {
        matches!(self.path.as_str(), "[vdso]" | "[vvar]" | "[vvar_vclock]")
    }

    /// At the same place in every process (`[vsyscall]`): left alone.
    fn fixed(&self) -> bool {
        self.path == "[vsyscall]" || self.path == "[uprobes]"
    }

    fn anonymous(&self) -> bool {
        self.inode == 0 && !self.special() && !self.fixed()
    }

    fn contains(&self, addr: u64) -> bool {
        self.start <= addr && addr < self.end
    }
}

/// Parses `/proc/PID/maps`; lines not in the documented format are skipped.
pub fn parse_maps(text: &str) -> Vec<Mapping> {
    text.lines().filter_map(parse_line).collect()
}

fn parse_line(line: &str) -> Option<Mapping> {
    let mut f = line.splitn(6, ' ');
    let (range, perms, offset, dev, inode) =
        (f.next()?, f.next()?, f.next()?, f.next()?, f.next()?);
    let path = f.next().unwrap_or("").trim_start().to_string();
    let (a, b) = range.split_once('-')?;
    let p = perms.as_bytes();
    if p.len() != 4 {
        return None;
    }
    let bit = |i: usize, c: u8, v: u64| if p[i] == c { v } else { 0 };
    Some(Mapping {
        start: u64::from_str_radix(a, 16).ok()?,
        end: u64::from_str_radix(b, 16).ok()?,
        prot: bit(0, b'r', 1) | bit(1, b'w', 2) | bit(2, b'x', 4),
        shared: p[3] == b's',
        offset: u64::from_str_radix(offset, 16).ok()?,
        dev: dev.to_string(),
        inode: inode.parse().ok()?,
        path,
    })
}

/// One change to the fork's address space, in the order given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    Unmap {
        start: u64,
        len: u64,
    },
    /// A kernel mapping moved (`mremap`); `via_elsewhere`: first anywhere
    /// the kernel likes, as its place now overlaps where another must go.
    Move {
        from: u64,
        len: u64,
        to: u64,
        via_elsewhere: bool,
    },
    MapAnon {
        start: u64,
        len: u64,
        prot: u64,
        /// The main thread's stack (`MAP_GROWSDOWN`).
        stack: bool,
    },
    /// The template's mapping `want[source]`, mapped from its file (which
    /// the graft opens through the template's `map_files`).
    MapFile {
        source: usize,
    },
    Protect {
        start: u64,
        len: u64,
        prot: u64,
    },
}

/// What a graft does to the fork's address space.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    pub steps: Vec<Step>,
    /// The template's private mappings whose pages are then compared and
    /// copied: index into `want`, and whether it was made anew (nothing of
    /// the fork's is in it).
    pub pages: Vec<(usize, bool)>,
}

/// `want` with each plain anonymous private mapping (no name) cut where
/// one of `cur`'s mappings starts or ends inside it: the kernel merges
/// adjacent anonymous mappings made before their first touch into one, and
/// splits them again at an `munmap` or `mprotect` of a part, so that the
/// fork may hold the template's memory in pieces. Each piece is then kept
/// or made on its own, instead of the whole (all its pages copied, and no
/// longer tracked) when one part changed.
pub fn split_like(want: Vec<Mapping>, cur: &[Mapping]) -> Vec<Mapping> {
    let mut cuts: Vec<u64> = cur.iter().flat_map(|c| [c.start, c.end]).collect();
    cuts.sort_unstable();
    cuts.dedup();
    let mut out = Vec::with_capacity(want.len());
    for w in want {
        if !(w.anonymous() && !w.shared && w.path.is_empty()) {
            out.push(w);
            continue;
        }
        let from = cuts.partition_point(|&x| x <= w.start);
        let mut at = w.start;
        for &x in cuts[from..].iter().take_while(|&&x| x < w.end) {
            out.push(Mapping {
                start: at,
                end: x,
                ..w.clone()
            });
            at = x;
        }
        out.push(Mapping { start: at, ..w });
    }
    out
}

/// Whether the fork's mapping `c` already is the template's `w` (or holds
/// it): the same object at the same offsets, both the stack or neither.
fn same_object(c: &Mapping, w: &Mapping, stacks: (u64, u64)) -> bool {
    if !(c.start <= w.start && w.end <= c.end && c.shared == w.shared) {
        return false;
    }
    if c.contains(stacks.0) != w.contains(stacks.1) {
        return false;
    }
    if c.anonymous() || w.anonymous() {
        return c.anonymous() && w.anonymous();
    }
    !c.special()
        && !w.special()
        && c.dev == w.dev
        && c.inode == w.inode
        && c.offset + (w.start - c.start) == w.offset
}

/// Plans the changes that turn layout `cur` (the fork's, whose main stack
/// holds `stacks.0`) into `want` (the template's, stack at `stacks.1`).
/// Errors name a kernel mapping the fork lacks or has at another size.
pub fn plan(cur: &[Mapping], want: &[Mapping], stacks: (u64, u64)) -> Result<Plan, String> {
    let mut out = Plan::default();
    // The same layout (a process rolled back in place that kept its
    // mappings): nothing to change, every private mapping kept.
    if cur == want && stacks.0 == stacks.1 {
        out.pages = want
            .iter()
            .enumerate()
            .filter(|(_, w)| !w.shared && !w.special() && !w.fixed())
            .map(|(i, _)| (i, false))
            .collect();
        return Ok(out);
    }
    // Looked up by address (a server's 236 mappings each way: 2 ms as a
    // search of all for each).
    let mut by_start: Vec<&Mapping> = cur.iter().collect();
    by_start.sort_by_key(|c| c.start);
    // The fork's mapping that holds `w` already, if any.
    let holder = |w: &Mapping| {
        let i = by_start.partition_point(|c| c.start <= w.start);
        i.checked_sub(1)
            .map(|i| by_start[i])
            .filter(|c| same_object(c, w, stacks))
    };
    let kept: Vec<Option<&Mapping>> = want
        .iter()
        .map(|w| holder(w).filter(|_| !w.special() && !w.fixed()))
        .collect();
    let mut keep: Vec<(u64, u64)> = want
        .iter()
        .zip(&kept)
        .filter(|(_, k)| k.is_some())
        .map(|(w, _)| (w.start, w.end))
        .collect();
    keep.sort_unstable();
    // What of the fork is not kept goes.
    for c in by_start.iter().filter(|c| !c.special() && !c.fixed()) {
        let mut at = c.start;
        let from = keep.partition_point(|&(_, end)| end <= c.start);
        for &(a, b) in keep[from..].iter().take_while(|&&(a, _)| a < c.end) {
            if at < a {
                out.steps.push(Step::Unmap {
                    start: at,
                    len: a - at,
                });
            }
            at = at.max(b);
        }
        if at < c.end {
            out.steps.push(Step::Unmap {
                start: at,
                len: c.end - at,
            });
        }
    }
    // The kernel's mappings move to the template's places.
    let mut moves = Vec::new();
    for w in want.iter().filter(|w| w.special()) {
        let Some(c) = cur.iter().find(|c| c.path == w.path) else {
            return Err(format!("it has no {} to move", w.path));
        };
        if c.bytes() != w.bytes() {
            return Err(format!(
                "its {} is {} bytes, the template's {}",
                w.path,
                c.bytes(),
                w.bytes()
            ));
        }
        if c.start != w.start {
            moves.push((c.start, c.bytes(), w.start));
        }
    }
    let specials: Vec<(u64, u64)> = cur
        .iter()
        .filter(|c| c.special())
        .map(|c| (c.start, c.end))
        .collect();
    let overlap = moves
        .iter()
        .any(|(_, len, to)| specials.iter().any(|(a, b)| *to < *b && *a < to + len));
    out.steps
        .extend(moves.into_iter().map(|(from, len, to)| Step::Move {
            from,
            len,
            to,
            via_elsewhere: overlap,
        }));
    for (i, w) in want.iter().enumerate() {
        if w.special() || w.fixed() {
            continue;
        }
        if let Some(c) = kept[i] {
            if c.prot != w.prot {
                out.steps.push(Step::Protect {
                    start: w.start,
                    len: w.bytes(),
                    prot: w.prot,
                });
            }
        } else if w.anonymous() && !w.shared {
            out.steps.push(Step::MapAnon {
                start: w.start,
                len: w.bytes(),
                prot: w.prot,
                stack: w.contains(stacks.1),
            });
        } else {
            out.steps.push(Step::MapFile { source: i });
        }
        if !w.shared {
            out.pages.push((i, kept[i].is_none()));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASH: &str = "\
55d0a0000000-55d0a0030000 r--p 00000000 08:01 1311 /usr/bin/bash
55d0a0030000-55d0a0100000 r-xp 00030000 08:01 1311 /usr/bin/bash
55d0a1000000-55d0a1100000 rw-p 00000000 00:00 0 [heap]
7f0000000000-7f0000200000 r--p 00000000 08:01 2000 /usr/lib/x86_64-linux-gnu/libc.so.6
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0 [stack]
7ffd00100000-7ffd00104000 r--p 00000000 00:00 0 [vvar]
7ffd00104000-7ffd00106000 r-xp 00000000 00:00 0 [vdso]
ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0 [vsyscall]
";

    const SLEEP: &str = "\
5600b0000000-5600b0004000 r--p 00000000 08:01 1500 /usr/bin/sleep
5600b1000000-5600b1021000 rw-p 00000000 00:00 0 [heap]
7f0000000000-7f0000200000 r--p 00000000 08:01 2000 /usr/lib/x86_64-linux-gnu/libc.so.6
7ffe00000000-7ffe00021000 rw-p 00000000 00:00 0 [stack]
7ffe00100000-7ffe00104000 r--p 00000000 00:00 0 [vvar]
7ffe00104000-7ffe00106000 r-xp 00000000 00:00 0 [vdso]
ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0 [vsyscall]
";

    #[test]
    fn the_same_layout_needs_no_step_and_keeps_every_private_mapping() {
        let m = parse_maps(BASH);
        let p = plan(&m, &m, (0x7ffd00020000, 0x7ffd00020000)).unwrap();
        assert!(p.steps.is_empty());
        assert_eq!(
            p.pages,
            [(0, false), (1, false), (2, false), (3, false), (4, false)]
        );
        let slow = plan(&m, &m[..m.len()], (0x7ffd00020000, 0x7ffd00010000)).unwrap();
        assert_eq!(slow.pages.len(), 5);
    }

    #[test]
    fn a_mapping_the_fork_holds_in_pieces_keeps_them_and_makes_only_what_is_missing() {
        // The template's one anonymous mapping; the fork's first part of
        // it, a read-only part (split by `mprotect`), and nothing for the
        // rest (unmapped).
        let want = parse_maps("7f0000000000-7f0000009000 rw-p 00000000 00:00 0 \n");
        let cur = parse_maps(
            "7f0000000000-7f0000005000 rw-p 00000000 00:00 0 \n\
             7f0000005000-7f0000006000 r--p 00000000 00:00 0 \n",
        );
        let want = split_like(want, &cur);
        let starts: Vec<(u64, u64)> = want.iter().map(|w| (w.start, w.end)).collect();
        assert_eq!(
            starts,
            [
                (0x7f0000000000, 0x7f0000005000),
                (0x7f0000005000, 0x7f0000006000),
                (0x7f0000006000, 0x7f0000009000)
            ]
        );
        let p = plan(&cur, &want, (0, 0)).unwrap();
        assert_eq!(p.pages, [(0, false), (1, false), (2, true)]);
        assert_eq!(
            p.steps,
            [
                Step::Protect {
                    start: 0x7f0000005000,
                    len: 0x1000,
                    prot: 3
                },
                Step::MapAnon {
                    start: 0x7f0000006000,
                    len: 0x3000,
                    prot: 3,
                    stack: false
                }
            ]
        );
        // Named mappings (the heap, the stack) are left whole.
        let heap = parse_maps("5600b1000000-5600b1021000 rw-p 00000000 00:00 0 [heap]\n");
        assert_eq!(split_like(heap.clone(), &cur[..1]), heap);
        let inner = parse_maps("5600b1001000-5600b1002000 rw-p 00000000 00:00 0 \n");
        assert_eq!(split_like(heap.clone(), &inner), heap);
    }

    #[test]
    fn maps_lines_are_read_as_documented() {
        let m = parse_maps(BASH);
        assert_eq!(m.len(), 8);
        assert_eq!((m[1].prot, m[1].shared, m[1].offset), (5, false, 0x30000));
        assert_eq!(m[1].path, "/usr/bin/bash");
        assert!(m[5].special() && m[7].fixed() && m[2].anonymous());
        assert!(parse_maps("garbage\n").is_empty());
    }

    #[test]
    fn an_execd_child_replaces_all_but_what_it_shares_and_moves_the_vdso() {
        let (cur, want) = (parse_maps(BASH), parse_maps(SLEEP));
        let p = plan(&cur, &want, (0x7ffd00020000, 0x7ffe00020000)).unwrap();
        // libc is the same file at the same place: kept, its pages compared.
        assert!(
            !p.steps
                .iter()
                .any(|s| matches!(s, Step::Unmap { start, .. } if *start == 0x7f0000000000))
        );
        assert!(p.pages.contains(&(2, false)));
        // bash's own mappings, heap and stack go.
        for start in [
            0x55d0a0000000,
            0x55d0a0030000,
            0x55d0a1000000,
            0x7ffd00000000,
        ] {
            assert!(
                p.steps
                    .iter()
                    .any(|s| matches!(s, Step::Unmap { start: a, .. } if *a == start)),
                "{start:x}"
            );
        }
        assert!(p.steps.contains(&Step::Move {
            from: 0x7ffd00104000,
            len: 0x2000,
            to: 0x7ffe00104000,
            via_elsewhere: false
        }));
        assert!(p.steps.contains(&Step::MapFile { source: 0 }));
        assert!(p.steps.contains(&Step::MapAnon {
            start: 0x7ffe00000000,
            len: 0x21000,
            prot: 3,
            stack: true
        }));
        assert!(p.pages.contains(&(3, true)));
        // Unmaps come before moves, moves before maps.
        let first_map = p
            .steps
            .iter()
            .position(|s| matches!(s, Step::MapFile { .. } | Step::MapAnon { .. }))
            .unwrap();
        let last_unmap = p
            .steps
            .iter()
            .rposition(|s| matches!(s, Step::Unmap { .. }))
            .unwrap();
        assert!(last_unmap < first_map);
    }

    #[test]
    fn a_forked_child_keeps_its_layout_and_only_fixes_what_differs() {
        let cur = parse_maps(BASH);
        let mut want = cur.clone();
        want[2].end = 0x55d0a1200000; // its heap grew
        want[3].prot = 5; // mprotect
        let p = plan(&cur, &want, (0x7ffd00020000, 0x7ffd00020000)).unwrap();
        assert_eq!(
            p.steps,
            vec![
                Step::Unmap {
                    start: 0x55d0a1000000,
                    len: 0x100000
                },
                Step::MapAnon {
                    start: 0x55d0a1000000,
                    len: 0x200000,
                    prot: 3,
                    stack: false
                },
                Step::Protect {
                    start: 0x7f0000000000,
                    len: 0x200000,
                    prot: 5
                },
            ]
        );
        assert_eq!(p.pages.len(), 5);
    }

    #[test]
    fn a_vdso_moving_onto_another_kernel_mapping_goes_elsewhere_first() {
        let cur = parse_maps(BASH);
        let mut want = cur.clone();
        // vvar and vdso swap places (overlap).
        (want[6].start, want[6].end) = (0x7ffd00100000, 0x7ffd00102000);
        (want[5].start, want[5].end) = (0x7ffd00102000, 0x7ffd00106000);
        let p = plan(&cur, &want, (0x7ffd00020000, 0x7ffd00020000)).unwrap();
        assert!(p.steps.iter().all(|s| !matches!(
            s,
            Step::Move {
                via_elsewhere: false,
                ..
            }
        )));
        let mut bad = want.clone();
        bad[6].end += 0x1000;
        assert!(plan(&cur, &bad, (0, 0)).unwrap_err().contains("[vdso]"));
    }

    /// A layout of up to 12 mappings in 64 pages, sorted and apart: each
    /// anonymous or a page range of one of two files, readable or not.
    fn layout() -> impl proptest::strategy::Strategy<Value = Vec<Mapping>> {
        use proptest::prelude::*;
        proptest::collection::vec((0u64..64, 1u64..8, 0u8..3, any::<bool>()), 0..12).prop_map(
            |raw| {
                let mut out: Vec<Mapping> = Vec::new();
                let mut taken = [false; 72];
                for (page, len, kind, readable) in raw {
                    let span = page as usize..(page + len) as usize;
                    if taken[span.clone()].iter().any(|t| *t) {
                        continue;
                    }
                    taken[span].iter_mut().for_each(|t| *t = true);
                    let start = 0x10000 + page * 4096;
                    out.push(Mapping {
                        start,
                        end: start + len * 4096,
                        prot: if readable { 3 } else { 0 },
                        shared: false,
                        offset: if kind == 0 { 0 } else { page * 4096 },
                        dev: if kind == 0 { "00:00" } else { "08:01" }.into(),
                        inode: u64::from(kind) * 100,
                        path: if kind == 0 {
                            String::new()
                        } else {
                            format!("/f{kind}")
                        },
                    });
                }
                out.sort_by_key(|m| m.start);
                out
            },
        )
    }

    proptest::proptest! {
        /// What the plan keeps is what the fork holds already (the same
        /// object at the same offsets), and its unmaps take exactly the
        /// rest of the fork's pages, each once.
        #[test]
        fn the_plan_keeps_what_the_fork_holds_and_unmaps_exactly_the_rest(
            cur in layout(),
            want in layout(),
        ) {
            let p = plan(&cur, &want, (0, 0)).unwrap();
            let page = |a: u64| ((a - 0x10000) / 4096) as usize;
            let mut kept = [false; 72];
            for (i, w) in want.iter().enumerate() {
                let held = cur.iter().any(|c| same_object(c, w, (0, 0)));
                let made = p.steps.iter().any(|s| matches!(s,
                    Step::MapAnon { start, .. } if *start == w.start)
                    || *s == Step::MapFile { source: i });
                proptest::prop_assert_eq!(held, !made, "{:?}", w);
                proptest::prop_assert!(p.pages.contains(&(i, !held)));
                if held {
                    (page(w.start)..page(w.end)).for_each(|x| kept[x] = true);
                }
            }
            let mut unmapped = [0u8; 72];
            for s in &p.steps {
                if let Step::Unmap { start, len } = s {
                    (page(*start)..page(start + len)).for_each(|x| unmapped[x] += 1);
                }
            }
            for c in &cur {
                for x in page(c.start)..page(c.end) {
                    proptest::prop_assert_eq!(unmapped[x], u8::from(!kept[x]), "page {}", x);
                }
            }
            proptest::prop_assert!(unmapped.iter().all(|&n| n <= 1));
        }
    }
}
