//! What a sandbox writes never costs what it appears to: a 1 TB sparse file
//! (no blocks) is snapshotted, rolled back, forked and restored to a
//! directory by its extents, in well under a second, and stays sparse; and a
//! sandbox left frozen by a snapshot that was killed inside its frozen
//! window (no guard runs on SIGKILL) is thawed by its supervisor, and by the
//! next `tine exec`, instead of hanging them.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::common::{Env, skipped_without_root};

fn exec(env: &Env, sb: &str, script: &str) -> String {
    env.ok(&["exec", sb, "--", "sh", "-c", script])
}

#[test]
fn a_terabyte_sparse_file_is_snapshotted_rolled_back_and_forked_in_well_under_a_second() {
    if skipped_without_root() {
        return;
    }
    let env = Env::in_dir(Path::new("/var/tmp"));
    env.ok(&["run", "--name", "sp", "--", "sleep", "100000"]);
    exec(
        &env,
        "sp",
        "truncate -s 1T /workspace/f && printf end >> /workspace/f",
    );
    let t = Instant::now();
    let snap = env.json(&["snapshot", "--sandbox", "sp", "--files-only"]);
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    assert!(snap["frozen_ms"].as_f64().unwrap() < 500.0, "{snap}");
    let id = snap["id"].as_str().unwrap().to_string();
    // Stored as what it holds: a few hundred bytes, not a terabyte.
    assert!(
        snap["commit"]["new_bytes"].as_u64().unwrap() < 64 << 10,
        "{snap}"
    );
    exec(&env, "sp", "echo changed > /workspace/f");
    let t = Instant::now();
    env.ok(&["restore", &id]);
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    let shown = exec(
        &env,
        "sp",
        "stat -c '%s %b' /workspace/f; tail -c 3 /workspace/f",
    );
    let (size, blocks) = {
        let mut w = shown.split_whitespace();
        let s: u64 = w.next().unwrap().parse().unwrap();
        let b: u64 = w.next().unwrap().parse().unwrap();
        (s, b)
    };
    assert_eq!(size, (1 << 40) + 3, "{shown}");
    assert!(blocks < 1024, "{shown}");
    assert!(shown.ends_with("end"), "{shown}");
    // Forks and a restore into a directory keep it sparse too.
    let t = Instant::now();
    env.ok(&["fork", &id, "-n", "2", "--name", "spf"]);
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    let shown = exec(
        &env,
        "spf-2",
        "stat -c '%s %b' /workspace/f; tail -c 3 /workspace/f",
    );
    assert!(
        shown.starts_with(&format!("{} ", (1u64 << 40) + 3)),
        "{shown}"
    );
    assert!(shown.ends_with("end"), "{shown}");
    let out = env.tmp.path().join("out");
    env.ok(&["restore", &id, "--to", out.to_str().unwrap()]);
    let md = std::fs::metadata(out.join("f")).unwrap();
    assert_eq!(md.len(), (1 << 40) + 3);
    assert!(md.blocks() < 1024, "{}", md.blocks());
    env.ok(&["rm", "-f", "sp", "spf-1", "spf-2"]);
}

/// The freezer cgroup (v1) or group (v2) directory of host process `pid`.
fn freezer_of(pid: u32) -> (std::path::PathBuf, &'static str, &'static str) {
    let cg = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    for l in cg.lines() {
        let mut f = l.splitn(3, ':');
        let (_, ctl, path) = (f.next(), f.next().unwrap_or(""), f.next().unwrap_or(""));
        if ctl.split(',').any(|c| c == "freezer") {
            let dir = Path::new("/sys/fs/cgroup/freezer").join(path.trim_start_matches('/'));
            return (dir.join("freezer.state"), "FROZEN", "THAWED");
        }
    }
    let path = cg.lines().find_map(|l| l.strip_prefix("0::")).unwrap();
    let dir = Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/'));
    (dir.join("cgroup.freeze"), "1", "0")
}

#[test]
fn a_sandbox_left_frozen_by_a_killed_snapshot_is_thawed() {
    if skipped_without_root() {
        return;
    }
    let env = Env::in_dir(Path::new("/var/tmp"));
    let view = env.json(&["run", "--name", "fz", "--", "sleep", "100000"]);
    let id = view["id"].as_str().unwrap().to_string();
    let init = view["init_pid"].as_u64().unwrap() as u32;
    let (state, frozen, thawed) = freezer_of(init);
    let lock = env.work().join(format!(".tine/sandboxes/{id}/freeze.lock"));
    // A freezer as tine's: it takes the lock, freezes, and is killed.
    let script = format!(
        "exec 9>>'{}'; flock -x 9; echo {frozen} > '{}'; echo held; exec sleep 1000",
        lock.display(),
        state.display()
    );
    let mut freezer = std::process::Command::new("sh")
        .args(["-c", &script])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut held = [0u8; 5];
    std::io::Read::read_exact(freezer.stdout.as_mut().unwrap(), &mut held).unwrap();
    // While its freezer lives, it stays frozen.
    std::thread::sleep(Duration::from_millis(1200));
    let st = std::fs::read_to_string(&state).unwrap();
    assert!(st.contains(frozen) || st.contains("FREEZING"), "{st}");
    freezer.kill().unwrap();
    freezer.wait().unwrap();
    // The supervisor thaws it.
    let deadline = Instant::now() + Duration::from_secs(5);
    while !std::fs::read_to_string(&state).unwrap().contains(thawed) {
        assert!(Instant::now() < deadline, "still frozen");
        std::thread::sleep(Duration::from_millis(50));
    }
    // And with no supervisor to do it, the next exec does.
    let sup = env
        .json(&["ps"])
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "fz")
        .and_then(|v| v["supervisor_pid"].as_u64());
    std::fs::write(&state, frozen).unwrap();
    if let Some(sup) = sup {
        // Stopped, it cannot thaw anything.
        rustix::process::kill_process(
            rustix::process::Pid::from_raw(sup as i32).unwrap(),
            rustix::process::Signal::STOP,
        )
        .unwrap();
    }
    let t = Instant::now();
    let out = exec(&env, "fz", "echo alive");
    assert_eq!(out, "alive\n");
    assert!(t.elapsed() < Duration::from_secs(5));
    if let Some(sup) = sup {
        rustix::process::kill_process(
            rustix::process::Pid::from_raw(sup as i32).unwrap(),
            rustix::process::Signal::CONT,
        )
        .unwrap();
    }
    env.ok(&["rm", "-f", "fz"]);
}
