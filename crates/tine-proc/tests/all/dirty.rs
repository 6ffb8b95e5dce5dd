//! Dirty-page tracking against a real program: armed while it is stopped,
//! invisible to it, and a scan finds what it wrote since.

use tine_proc::dirty;
use tine_proc::layout::parse_maps;
use tine_proc::ptrace::Tracee;

use crate::native::Holder;

fn spans(pid: u32) -> Vec<(u64, u64)> {
    dirty::tracked(&maps_of(pid))
}

fn maps_of(pid: u32) -> Vec<tine_proc::layout::Mapping> {
    parse_maps(&std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap())
}

/// `pid`'s page tables (`VmPTE:`), KiB.
fn page_tables_kib(pid: u32) -> i64 {
    tine_proc::inspect::status_kib(pid, "VmPTE:").unwrap() as i64
}

/// `ranges` split by the kind of mapping holding them in `pid`.
fn split(pid: u32, ranges: &dirty::Ranges) -> (dirty::Ranges, dirty::Ranges) {
    dirty::by_backing(ranges, &maps_of(pid))
}

#[test]
fn a_scan_finds_the_pages_a_program_wrote_since_it_was_armed() {
    if tine_testkit::skipped_without_root("a dirty-tracking test") {
        return;
    }
    let mut h = Holder::start(64);
    let pid = h.child.id();
    let before = h.ask("add 0");
    let mut t = Tracee::seize(pid).unwrap();
    let uffd = dirty::open_tracker(&mut t).unwrap();
    dirty::arm(pid, &uffd, &spans(pid), &maps_of(pid)).unwrap();
    assert!(dirty::unregistered(pid, &spans(pid)).unwrap().is_empty());
    let quiet = dirty::changed(pid, &spans(pid)).unwrap();
    assert_eq!(quiet.written.pages(), 0, "nothing ran since it was armed");
    // No descriptor of the tracker stays in the program.
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count();
    t.resume().unwrap();
    // The program runs on unaware: its checksums are those of a program
    // never tracked (each step writes one page of its 64 MiB).
    let a = h.ask("tick");
    assert_eq!(a.0, before.0 + 1);
    let b = h.ask("tick");
    assert_eq!(b.0, before.0 + 2);
    let t = Tracee::seize(pid).unwrap();
    let seen = dirty::changed(pid, &spans(pid)).unwrap();
    let total: u64 = spans(pid).iter().map(|(a, b)| (b - a) / 4096).sum();
    assert!(
        seen.written.pages() >= 2 && seen.written.pages() < total / 20,
        "{} of {total} pages written",
        seen.written.pages()
    );
    assert_eq!(
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .count(),
        fds
    );
    // Protected again, nothing is written until it runs.
    let (anon, files) = split(pid, &seen.written);
    dirty::protect(pid, &anon, &files).unwrap();
    assert_eq!(dirty::changed(pid, &spans(pid)).unwrap().written.pages(), 0);
    t.resume().unwrap();
    // Protected with the gaps between written ranges (a stopped process's
    // recorded scan): nothing reads as written, and the next write is seen.
    assert_eq!(h.ask("tick").0, before.0 + 3);
    let t = Tracee::seize(pid).unwrap();
    let seen = dirty::changed(pid, &spans(pid)).unwrap();
    assert!(seen.written.pages() >= 1);
    let (anon, files) = split(pid, &seen.written);
    dirty::protect_stopped(pid, &anon, &files).unwrap();
    assert_eq!(dirty::changed(pid, &spans(pid)).unwrap().written.pages(), 0);
    t.resume().unwrap();
    assert_eq!(h.ask("tick").0, before.0 + 4);
    let t = Tracee::seize(pid).unwrap();
    assert!(dirty::changed(pid, &spans(pid)).unwrap().written.pages() >= 1);
    // The tracker closed, every page reads as written: slower, never wrong.
    drop(uffd);
    assert!(!dirty::unregistered(pid, &spans(pid)).unwrap().is_empty());
    let all = dirty::changed(pid, &spans(pid)).unwrap();
    assert!(
        all.written.pages() > total / 2,
        "{} of {total}",
        all.written.pages()
    );
    t.resume().unwrap();
    assert_eq!(h.ask("tick").0, before.0 + 5);
    let _ = h.child.kill();
    let _ = h.child.wait();
}

/// Holds a private mapping of a file, every page written (its own copies),
/// and 8 MiB of anonymous memory, written (in huge pages where it is
/// aligned and the kernel has them); prints both addresses. "drop"
/// drops the file mapping's first 16 pages and all of the anonymous
/// memory; "read" reads the file mapping's first 8 pages (the file's bytes
/// again). A third region, 64 MiB, is never touched but by "poke" (one
/// byte 1 MiB in); its address is printed third.
const DROPPER: &str = r#"
import ctypes, mmap, os, sys
path = sys.argv[1]
with open(path, 'wb') as f:
    f.write(b'f' * (64 * 4096))
fm = mmap.mmap(os.open(path, os.O_RDWR), 64 * 4096, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
am = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
um = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
am.madvise(mmap.MADV_HUGEPAGE)
fm[:] = b'w' * len(fm)
am[:] = b'w' * len(am)
addr = lambda m: ctypes.addressof(ctypes.c_char.from_buffer(m))
print(addr(fm), addr(am), addr(um), flush=True)
for line in sys.stdin:
    if line.strip() == 'poke':
        um[1 << 20] = 1
    elif line.strip() == 'drop':
        fm.madvise(mmap.MADV_DONTNEED, 0, 16 * 4096)
        am.madvise(mmap.MADV_DONTNEED, 0, len(am))
    else:
        sum(fm[:8 * 4096])
    print('ok', flush=True)
"#;

#[test]
fn pages_dropped_in_anonymous_memory_and_in_a_files_private_mapping_are_found() {
    use std::io::{BufRead, BufReader, Write};
    if tine_testkit::skipped_without_root("a dirty-tracking test") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut child = std::process::Command::new("python3")
        .args(["-c", DROPPER])
        .arg(dir.path().join("data"))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let mut stdin = child.stdin.take().unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    let at: Vec<u64> = line
        .split_whitespace()
        .map(|w| w.parse().unwrap())
        .collect();
    let (file_at, anon_at, untouched_at) = (at[0], at[1], at[2]);
    let mut say = |what: &str| {
        writeln!(stdin, "{what}").unwrap();
        let mut ok = String::new();
        out.read_line(&mut ok).unwrap();
        assert_eq!(ok.trim(), "ok");
    };
    let range = |a: u64, pages: u64| dirty::Ranges::from_unsorted(vec![(a, a + pages * 4096)]);

    // Armed, with what it holds of its own told apart by mapping (as a
    // template's is).
    let mut t = Tracee::seize(pid).unwrap();
    let uffd = dirty::open_tracker(&mut t).unwrap();
    let tables = page_tables_kib(pid);
    dirty::arm(pid, &uffd, &spans(pid), &maps_of(pid)).unwrap();
    // Memory never touched gets no page tables (of markers) from it: 64 MiB
    // would take 128 KiB of them.
    let grown = page_tables_kib(pid) - tables;
    assert!(grown < 64, "page tables grew by {grown} KiB");
    let maps = parse_maps(&std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap());
    let own = dirty::held(pid, &spans(pid)).unwrap().0;
    let (anon, files) = dirty::by_backing(&own, &maps);
    assert!(range(file_at, 64).without(&files).is_empty(), "{files:?}");
    assert!(range(anon_at, 2048).without(&anon).is_empty());
    t.resume().unwrap();
    // Dropped, and half of the file's part read again (the file's pages);
    // one page of the untouched region written.
    say("drop");
    say("read");
    say("poke");
    let _t = Tracee::seize(pid).unwrap();
    let written = dirty::written(pid, &dirty::runs(&maps)).unwrap();
    let poked = range(untouched_at + (1 << 20), 1);
    assert!(poked.without(&written).is_empty());
    let seen = dirty::changed(pid, &spans(pid)).unwrap();
    assert_eq!(seen.written.intersect(&range(untouched_at, 16384)), poked);
    let found = dirty::dropped(pid, &anon, &files, Some(&written)).unwrap();
    assert!(range(file_at, 16).without(&found).is_empty(), "{found:?}");
    assert!(range(anon_at, 2048).without(&found).is_empty(), "{found:?}");
    assert!(found.intersect(&range(file_at + 16 * 4096, 48)).is_empty());
    // A walk of every page the process held finds nothing more: where
    // the kernel says so, the written scan saw every anonymous drop
    // (huge pages, and whole page tables freed, among them).
    assert_eq!(dirty::dropped(pid, &anon, &files, None).unwrap(), found);
    if dirty::scan_sees_holes() {
        assert!(range(anon_at, 2048).without(&written).is_empty());
    }
    // No write-protect bit shows the file's pages: the written scan does
    // not, and neither does a walk for missing pages alone.
    assert!(written.intersect(&range(file_at, 8)).is_empty());
    assert!(dirty::absent(pid, &range(file_at, 8)).unwrap().is_empty());
    drop(uffd);
    let _ = child.kill();
    let _ = child.wait();
}
