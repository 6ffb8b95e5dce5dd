use std::process::{Command, Stdio};

use tine_proc::{ProcError, cloneable};

fn spawn(script: &str) -> std::process::Child {
    Command::new("sh")
        .args(["-c", script])
        .stdin(Stdio::null())
        .spawn()
        .unwrap()
}

/// Waits (at most 10 s) until `ok` holds.
fn settle(mut ok: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !ok() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

#[test]
fn a_single_threaded_process_without_children_is_cloneable() {
    let mut c = Command::new("setsid")
        .args(["sleep", "30"])
        .spawn()
        .unwrap();
    let pid = c.id();
    settle(|| tine_proc::stat(pid).is_ok_and(|s| s.session == pid));
    let r = cloneable(pid);
    let _ = c.kill();
    let _ = c.wait();
    r.unwrap();
}

#[test]
fn live_children_are_refused_with_pid_command_and_reason() {
    // The shell is the parent of both sleeps while it waits for them.
    let mut c = spawn("sleep 30 & sleep 30 & wait");
    let pid = c.id();
    let children = || {
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
            .map(|t| t.split_whitespace().count())
            .unwrap_or(0)
    };
    settle(|| children() == 2);
    let r = cloneable(pid);
    let _ = Command::new("pkill")
        .args(["-P", &pid.to_string()])
        .status();
    let _ = c.kill();
    let _ = c.wait();
    let Err(ProcError::NotCloneable(n)) = r else {
        panic!("expected NotCloneable, got {r:?}")
    };
    assert_eq!(n.pid, pid);
    assert_eq!(n.cmdline, "sh -c sleep 30 & sleep 30 & wait");
    assert!(n.reason.contains("2 live child processes"), "{}", n.reason);
    let msg = ProcError::NotCloneable(n).to_string();
    assert!(
        msg.contains(&pid.to_string()) && msg.contains("--files-only"),
        "{msg}"
    );
}

#[test]
fn several_threads_are_refused() {
    // This test binary runs its tests on threads: the harness plus this one.
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let t = std::thread::spawn(move || rx.recv());
    let r = cloneable(std::process::id());
    drop(tx);
    let _ = t.join();
    let Err(ProcError::NotCloneable(n)) = r else {
        panic!("expected NotCloneable, got {r:?}")
    };
    assert!(n.reason.contains("threads"), "{}", n.reason);
}
