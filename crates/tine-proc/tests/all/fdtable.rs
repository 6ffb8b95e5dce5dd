use std::io::{Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;

use tine_proc::{FdTarget, fd_table};

#[test]
fn the_table_shows_paths_offsets_flags_and_pipes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("log.txt");
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .unwrap();
    f.write_all(b"0123456789").unwrap();
    let mut r = std::fs::File::open(&path).unwrap();
    r.seek(SeekFrom::Start(3)).unwrap();
    let (pipe_r, _pipe_w) = std::io::pipe().unwrap();
    let table = fd_table(std::process::id()).unwrap();
    let canonical = std::fs::canonicalize(&path).unwrap();
    let of = |fd: i32| table.iter().find(|e| e.fd == fd).unwrap();
    let (w, rd) = (of(f.as_raw_fd()), of(r.as_raw_fd()));
    assert_eq!(
        w.target,
        FdTarget::Path {
            path: canonical.clone()
        }
    );
    assert_eq!(w.pos, 10);
    assert_ne!(w.flags & 0o2000, 0, "O_APPEND");
    assert_eq!(w.flags & 0o3, 0o1, "O_WRONLY");
    assert_eq!(rd.target, FdTarget::Path { path: canonical });
    assert_eq!((rd.pos, rd.flags & 0o3), (3, 0));
    assert!(w.mnt_id.is_some());
    assert!(table.windows(2).all(|p| p[0].fd < p[1].fd), "sorted");
    assert!(matches!(
        of(pipe_r.as_raw_fd()).target,
        FdTarget::Pipe { .. }
    ));
}

#[test]
fn an_unlinked_file_is_reported_deleted() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gone");
    let f = std::fs::File::create(&path).unwrap();
    let canonical = std::fs::canonicalize(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    let table = fd_table(std::process::id()).unwrap();
    let e = table.iter().find(|e| e.fd == f.as_raw_fd()).unwrap();
    assert_eq!(e.target, FdTarget::Deleted { path: canonical });
}

#[test]
fn a_process_that_does_not_exist_is_gone() {
    // PIDs above pid_max are never used.
    let err = fd_table(u32::MAX - 1).unwrap_err();
    assert!(matches!(err, tine_proc::ProcError::Gone { .. }), "{err}");
}
