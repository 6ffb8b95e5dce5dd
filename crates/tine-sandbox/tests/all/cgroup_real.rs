//! Real control groups on this host (v1 or v2, whichever it has).

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use tine_sandbox::cgroup::{CgroupRoot, DEFAULT_ROOT, Limits};

#[test]
fn freeze_stops_a_writer_and_thaw_resumes_it() {
    if !crate::need_root("a real cgroup") {
        return;
    }
    let root = match CgroupRoot::detect(Path::new(DEFAULT_ROOT)) {
        Ok(r) => r,
        Err(e) => {
            tine_testkit::skip(&e.to_string());
            return;
        }
    };
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("ticks");
    let name = format!("test-{}", std::process::id());
    let cg = root
        .create(
            &name,
            &Limits {
                memory_bytes: Some(256 << 20),
                pids: Some(32),
                disk_bytes: None,
            },
        )
        .unwrap();
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "while :; do echo x >> {}; sleep 0.005; done",
            out.display()
        ))
        .spawn()
        .unwrap();
    cg.add_process(child.id()).unwrap();
    assert!(cg.processes().unwrap().contains(&child.id()));
    std::thread::sleep(Duration::from_millis(100));
    let t0 = std::time::Instant::now();
    cg.freeze(Duration::from_secs(5)).unwrap();
    let took = t0.elapsed();
    assert!(cg.is_frozen().unwrap());
    let len = || std::fs::metadata(&out).map(|m| m.len()).unwrap_or(0);
    let frozen_at = len();
    assert!(frozen_at > 0, "the writer never ran");
    std::thread::sleep(Duration::from_millis(150));
    assert_eq!(len(), frozen_at, "a frozen group kept writing");
    cg.thaw().unwrap();
    std::thread::sleep(Duration::from_millis(150));
    assert!(len() > frozen_at, "a thawed group did not resume");
    eprintln!("cgroup {}: freeze took {took:?}", root.version());
    child.kill().unwrap();
    child.wait().unwrap();
    // sleep children may linger a moment after their shell dies.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !cg.processes().unwrap().is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    cg.remove().unwrap();
    assert!(cg.dirs().iter().all(|d| !d.exists()));
}

/// The cgroup v2 devices program: a process in a group that has it opens
/// `/dev/null` but neither opens nor makes a block device, while one in a
/// group without it can. Tried on the host's cgroup2 mount (the whole
/// hierarchy on a v2 host, `unified` on a hybrid one like CI's).
#[test]
fn the_v2_devices_program_allows_the_usual_nodes_and_refuses_the_rest() {
    if !crate::need_root("a real cgroup and bpf") {
        return;
    }
    let v2 = [Path::new(DEFAULT_ROOT).join("unified"), DEFAULT_ROOT.into()]
        .into_iter()
        .find(|d| rustix::fs::statfs(d.as_path()).is_ok_and(|s| s.f_type == 0x6367_7270))
        .expect("this host has no cgroup2 mount");
    let tmp = tempfile::tempdir().unwrap();
    let probe = |group: &Path, tag: &str| -> String {
        let node = tmp.path().join(format!("blk-{tag}"));
        let script = format!(
            "echo $$ > {procs} || exit 9
             (exec 3</dev/null) 2>/dev/null && echo null-ok || echo null-denied
             (exec 3</dev/loop0) 2>/dev/null && echo loop-ok || echo loop-denied
             mknod {node} b 7 0 2>/dev/null && echo mknod-ok || echo mknod-denied",
            procs = group.join("cgroup.procs").display(),
            node = node.display()
        );
        let out = Command::new("sh").arg("-c").arg(&script).output().unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let make = |tag: &str| {
        let g = v2.join(format!("tine-devtest-{tag}-{}", std::process::id()));
        std::fs::create_dir(&g).unwrap();
        g
    };
    let (open, limited) = (make("open"), make("limited"));
    tine_sandbox::cgroup::limit_devices_v2(&limited).unwrap();
    let (a, b) = (probe(&open, "open"), probe(&limited, "limited"));
    for g in [&open, &limited] {
        // Empty once the probes ended.
        let _ = std::fs::remove_dir(g);
    }
    assert_eq!(a, "null-ok\nloop-ok\nmknod-ok\n");
    assert_eq!(b, "null-ok\nloop-denied\nmknod-denied\n");
}
