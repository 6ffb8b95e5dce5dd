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
            eprintln!("skipped: {e}");
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
