//! Scanning behaviour: ignore files, special files, the stat cache, chunk dedup,
//! and in-place restore that open descriptors observe.

use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::time::Duration;

use crate::common::{Env, read_tree, write_file};

#[test]
fn tineignore_and_special_files() {
    let env = Env::new();
    let src = env.dir("src");
    write_file(&src.join("keep.txt"), b"k", 0o644);
    write_file(&src.join("build/out.o"), b"o", 0o644);
    write_file(&src.join("sub/x.log"), b"l", 0o644);
    write_file(&src.join("sub/important.log"), b"i", 0o644);
    fs::write(src.join(".tineignore"), "build/\n*.log\n").unwrap();
    fs::write(src.join("sub/.tineignore"), "!important.log\n").unwrap();
    rustix::fs::mknodat(
        rustix::fs::CWD,
        src.join("fifo"),
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o644),
        0,
    )
    .unwrap();
    let out = env.snapshot(&src);
    assert_eq!(out.warnings.len(), 1, "{:?}", out.warnings);
    assert!(out.warnings[0].message.contains("named pipe"));
    let files = tine_fs::ops::list_files(&env.repo, &out.tree).unwrap();
    let mut names: Vec<String> = files
        .keys()
        .map(|k| String::from_utf8_lossy(k).into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        vec![
            ".tineignore",
            "keep.txt",
            "sub/.tineignore",
            "sub/important.log"
        ]
    );
}

#[test]
fn tineignore_patterns_hold_below_directories_named_through_descriptors() {
    let env = Env::new();
    let src = env.dir("src");
    // 40 levels of 60 bytes: past the 2 KiB after which a scan names each
    // directory through a descriptor of its own.
    let chain: Vec<String> = (0..40)
        .map(|i| format!("{i:02}{}", "d".repeat(58)))
        .collect();
    let rel_deep = chain.join("/");
    let deep = src.join(&rel_deep);
    for name in ["skip.log", "keep.log", "sub/x.log", "sub/y.log", "far.tmp"] {
        write_file(&deep.join(name), b"f", 0o644);
    }
    // Anchored to the deep directory, and with a slash inside.
    fs::write(deep.join(".tineignore"), "/skip.log\nsub/x.log\n").unwrap();
    // From the top: anchored, through every level below.
    fs::write(src.join(".tineignore"), format!("/{rel_deep}/far.tmp\n")).unwrap();
    let out = env.snapshot(&src);
    let files = tine_fs::ops::list_files(&env.repo, &out.tree).unwrap();
    let mut names: Vec<String> = files
        .keys()
        .map(|k| String::from_utf8_lossy(k).into_owned())
        .filter_map(|k| k.strip_prefix(&format!("{rel_deep}/")).map(str::to_string))
        .collect();
    names.sort();
    assert_eq!(names, vec![".tineignore", "keep.log", "sub/y.log"]);
}

#[test]
fn unchanged_files_are_never_read_again() {
    let env = Env::new();
    let src = env.dir("src");
    for i in 0..50 {
        write_file(
            &src.join(format!("d{}/f{i}", i % 5)),
            format!("file {i}").as_bytes(),
            0o644,
        );
    }
    // Past the racy window, so the cache may trust these files.
    std::thread::sleep(Duration::from_millis(250));
    let first = env.snapshot(&src);
    assert_eq!(first.stats.hashed_files, 50);
    let second = env.snapshot(&src);
    assert_eq!(second.stats.hashed_files, 0);
    assert_eq!(second.tree, first.tree);
    write_file(&src.join("d1/f1"), b"changed", 0o644);
    let third = env.snapshot(&src);
    assert_eq!(third.stats.hashed_files, 1);
    assert_ne!(third.tree, first.tree);
    // A same-size rewrite right after a snapshot is still seen (racy entries are not cached).
    write_file(&src.join("d1/f1"), b"CHANGED", 0o644);
    let fourth = env.snapshot(&src);
    assert_ne!(fourth.tree, third.tree);
}

#[test]
fn overwriting_one_mib_of_a_large_file_stores_little() {
    let env = Env::new();
    let src = env.dir("src");
    let mut data = vec![0u8; 48 << 20];
    let mut x: u64 = 0x9E3779B97F4A7C15;
    for b in data.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    write_file(&src.join("big.bin"), &data, 0o644);
    let first = env.snapshot(&src);
    assert!(
        first.commit.new_bytes > 48 << 20,
        "random data is stored whole"
    );
    let mut f = fs::OpenOptions::new()
        .write(true)
        .open(src.join("big.bin"))
        .unwrap();
    f.seek(SeekFrom::Start(20 << 20)).unwrap();
    f.write_all(&vec![7u8; 1 << 20]).unwrap();
    drop(f);
    let second = env.snapshot(&src);
    assert!(
        second.commit.new_bytes <= 4 << 20,
        "added {} bytes",
        second.commit.new_bytes
    );
    let t = env.dir("t");
    env.restore(&second.id, &t).unwrap();
    assert_eq!(read_tree(&t), read_tree(&src));
}

#[test]
fn restore_rewrites_in_place_so_open_descriptors_see_it() {
    let env = Env::new();
    let src = env.dir("src");
    write_file(&src.join("log.txt"), b"version one\n", 0o644);
    let snap = env.snapshot(&src).id;
    write_file(&src.join("log.txt"), b"version two, longer\n", 0o644);
    let mut held = fs::File::open(src.join("log.txt")).unwrap();
    env.restore(&snap, &src).unwrap();
    let mut s = String::new();
    held.read_to_string(&mut s).unwrap();
    assert_eq!(s, "version one\n");
}

#[test]
fn restore_touches_only_what_differs() {
    let env = Env::new();
    let src = env.dir("src");
    for i in 0..20 {
        write_file(&src.join(format!("f{i}")), format!("{i}").as_bytes(), 0o644);
    }
    let snap = env.snapshot(&src).id;
    let ino = |n: &str| std::os::unix::fs::MetadataExt::ino(&fs::metadata(src.join(n)).unwrap());
    let before: Vec<u64> = (0..20).map(|i| ino(&format!("f{i}"))).collect();
    write_file(&src.join("f3"), b"changed", 0o644);
    fs::remove_file(src.join("f4")).unwrap();
    write_file(&src.join("new"), b"n", 0o644);
    let out = env.restore(&snap, &src).unwrap();
    assert_eq!((out.added, out.modified, out.deleted), (1, 1, 1));
    assert!(!src.join("new").exists());
    for i in (0..20).filter(|i| *i != 4) {
        assert_eq!(
            ino(&format!("f{i}")),
            before[i],
            "f{i} was replaced, not rewritten in place"
        );
    }
}

/// `n` bytes no two runs of which repeat (xorshift).
fn varied(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[test]
fn a_large_file_written_in_a_few_places_is_restored_writing_only_the_chunks_that_differ() {
    let env = Env::new();
    let src = env.dir("src");
    // Like a database's 16 MiB log segment: stored in chunks.
    let data = varied(16 << 20, 7);
    write_file(&src.join("wal"), &data, 0o600);
    let snap = env.snapshot(&src).id;
    let ino = || std::os::unix::fs::MetadataExt::ino(&fs::metadata(src.join("wal")).unwrap());
    let before = ino();
    // Two blocks written in place.
    let mut changed = data.clone();
    changed[(1 << 20)..(1 << 20) + 8192].copy_from_slice(&varied(8192, 1));
    changed[(9 << 20)..(9 << 20) + 8192].copy_from_slice(&varied(8192, 2));
    write_file(&src.join("wal"), &changed, 0o600);
    let out = env.restore(&snap, &src).unwrap();
    assert!(
        fs::read(src.join("wal")).unwrap() == data,
        "the snapshot's bytes"
    );
    assert_eq!(ino(), before, "rewritten in place");
    assert_eq!(out.modified, 1);
    // At most the two chunks holding the blocks (2 MiB at most each).
    assert!(
        out.bytes_written > 0 && out.bytes_written <= 4 << 20,
        "{} bytes written",
        out.bytes_written
    );
    // Grown and written at its start: what it holds past the snapshot's
    // end goes, the rest is its chunks again.
    let mut grown = varied(4096, 3);
    grown.extend_from_slice(&data[4096..]);
    grown.extend_from_slice(&varied(300 << 10, 4));
    write_file(&src.join("wal"), &grown, 0o600);
    let out = env.restore(&snap, &src).unwrap();
    assert!(
        fs::read(src.join("wal")).unwrap() == data,
        "the snapshot's bytes"
    );
    assert!(out.bytes_written <= 2 << 20, "{}", out.bytes_written);
    // Cut short: the chunks past its end are written.
    let f = fs::OpenOptions::new()
        .write(true)
        .open(src.join("wal"))
        .unwrap();
    f.set_len(5 << 20).unwrap();
    drop(f);
    let out = env.restore(&snap, &src).unwrap();
    assert!(
        fs::read(src.join("wal")).unwrap() == data,
        "the snapshot's bytes"
    );
    assert!(
        out.bytes_written >= 11 << 20 && out.bytes_written < 16 << 20,
        "{}",
        out.bytes_written
    );
}

#[test]
fn gc_prunes_stat_caches_of_vanished_directories() {
    let env = Env::new();
    let src = env.dir("src");
    write_file(&src.join("f"), b"x", 0o644);
    let snap = env.snapshot(&src).id;
    let gone = env.dir("gone");
    env.restore(&snap, &gone).unwrap();
    let caches = || fs::read_dir(env.repo.cache_dir()).unwrap().count();
    assert_eq!(caches(), 2);
    fs::remove_dir_all(&gone).unwrap();
    let _lock = env.repo.lock(true).unwrap();
    let removed = tine_fs::prune_caches(&env.repo).unwrap();
    assert_eq!(removed.len(), 1);
    assert_eq!(caches(), 1, "the cache of the existing directory stays");
    assert!(tine_fs::prune_caches(&env.repo).unwrap().is_empty());
}
