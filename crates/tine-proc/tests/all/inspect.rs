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

/// A session leader running `script` in Python; its PID, once `ready` is printed.
fn python_leader(script: &str) -> std::process::Child {
    let (c, line) =
        tine_testkit::started_and_ready(Command::new("setsid").args(["python3", "-c", script]));
    assert_eq!(line, "ready\n");
    c
}

#[test]
fn threads_are_no_reason_to_refuse_but_posix_timers_are() {
    // Threads are made again in each copy (see `threads`).
    let mut c = python_leader(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\nprint('ready', flush=True)\ntime.sleep(60)",
    );
    let r = cloneable(c.id());
    let _ = c.kill();
    let _ = c.wait();
    r.unwrap();
    // A POSIX timer is not: a copy would not have it.
    let mut c = python_leader(
        "import ctypes, time\nlibc = ctypes.CDLL(None)\nt = ctypes.c_void_p()\nassert libc.timer_create(1, None, ctypes.byref(t)) == 0\nprint('ready', flush=True)\ntime.sleep(60)",
    );
    let r = cloneable(c.id());
    let _ = c.kill();
    let _ = c.wait();
    let Err(ProcError::NotCloneable(n)) = r else {
        panic!("expected NotCloneable, got {r:?}")
    };
    assert!(
        n.reason.contains("1 POSIX timer (timer_create)"),
        "{}",
        n.reason
    );
}

#[test]
fn a_process_that_ended_unreaped_is_gone_to_a_tracer() {
    // A zombie refuses PTRACE_SEIZE with EPERM, as a process one may not
    // trace does: a checkpoint that listed it running must see it ended.
    let mut c = Command::new("true").spawn().unwrap();
    let pid = c.id();
    settle(|| tine_proc::stat(pid).is_ok_and(|s| s.state == 'Z'));
    let r = tine_proc::ptrace::Tracee::seize_at(pid, 0);
    let _ = c.wait();
    assert!(
        matches!(r, Err(ProcError::Gone { pid: p }) if p == pid),
        "{r:?}"
    );
}

#[test]
fn a_held_process_whose_memory_was_changed_is_killed_not_let_go_when_dropped() {
    // A rollback that pushed pages into a process ahead of the rest and
    // then failed must not let it run on half its template's.
    let mut kept = Command::new("sleep").arg("30").spawn().unwrap();
    let mut changed = Command::new("sleep").arg("30").spawn().unwrap();
    // (Its exec done: named so, and its vDSO mapped.)
    let is_sleep = |pid: u32| {
        let read =
            |f: &str| std::fs::read_to_string(format!("/proc/{pid}/{f}")).unwrap_or_default();
        read("comm").trim() == "sleep" && read("maps").contains("[vdso]")
    };
    settle(|| is_sleep(kept.id()) && is_sleep(changed.id()));
    drop(tine_proc::ptrace::Tracee::seize(kept.id()).unwrap());
    let mut t = tine_proc::ptrace::Tracee::seize(changed.id()).unwrap();
    t.altered();
    drop(t);
    // (Its tracer, here its parent too, waited for its end: it is gone.)
    let gone = tine_proc::stat(changed.id()).is_err();
    let alive = tine_proc::stat(kept.id()).is_ok_and(|s| s.state != 'Z');
    let _ = kept.kill();
    let _ = (kept.wait(), changed.wait());
    assert!(gone, "the changed process still exists");
    assert!(alive, "the process let go as it was still runs");
}
