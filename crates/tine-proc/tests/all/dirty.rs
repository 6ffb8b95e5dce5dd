//! Dirty-page tracking against a real program: armed while it is stopped,
//! invisible to it, and a scan finds what it wrote since.

use tine_proc::dirty;
use tine_proc::layout::parse_maps;
use tine_proc::ptrace::Tracee;

use crate::native::Holder;

fn spans(pid: u32) -> Vec<(u64, u64)> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    dirty::tracked(&parse_maps(&maps))
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
    dirty::arm(pid, &uffd, &spans(pid)).unwrap();
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
    dirty::protect(pid, &seen.written).unwrap();
    assert_eq!(dirty::changed(pid, &spans(pid)).unwrap().written.pages(), 0);
    t.resume().unwrap();
    // Protected with the gaps between written ranges (a stopped process's
    // recorded scan): nothing reads as written, and the next write is seen.
    assert_eq!(h.ask("tick").0, before.0 + 3);
    let t = Tracee::seize(pid).unwrap();
    let seen = dirty::changed(pid, &spans(pid)).unwrap();
    assert!(seen.written.pages() >= 1);
    dirty::protect_stopped(pid, &seen.written).unwrap();
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
