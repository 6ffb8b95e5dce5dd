//! The cost of what a copy rebuilds, per item: threads made again, and the
//! kernel objects a native fork makes anew (pipes, socketpairs, eventfds,
//! timerfds, epoll registrations). A Python program holds 64 of one kind;
//! one template of it is cloned through the library with and without the
//! rebuild (for threads: against the same program without them), and the
//! difference of the medians is divided by 64.

use std::path::Path;
use std::time::Instant;

use crate::{BenchError, err, ioe, median_f64 as med, ms};

/// How many of each kind the program holds.
const ITEMS: usize = 64;

/// Holds `argv[2]` items of kind `argv[1]`; creates `argv[3]` when ready.
const HOLDER: &str = r#"
import ctypes, os, select, signal, socket, sys, threading
kind, n = sys.argv[1], int(sys.argv[2])
keep = []
if kind == 'thread':
    stop = threading.Event()
    for _ in range(n):
        threading.Thread(target=stop.wait, daemon=True).start()
elif kind == 'pipe':
    keep = [os.pipe() for _ in range(n)]
elif kind == 'socketpair':
    keep = [socket.socketpair() for _ in range(n)]
elif kind in ('eventfd', 'epoll'):
    keep = [os.eventfd(0) for _ in range(n)]
    if kind == 'epoll':
        ep = select.epoll()
        for e in keep:
            ep.register(e, select.EPOLLIN)
elif kind == 'timerfd':
    libc = ctypes.CDLL(None)
    keep = [libc.timerfd_create(1, 0) for _ in range(n)]
open(sys.argv[3], 'w').close()
while True:
    signal.pause()
"#;

/// Median ms of making one copy of a template of a program holding `n`
/// items of `kind` (with its objects made anew when `remake`), over `runs`.
fn copy_ms(dir: &Path, kind: &str, n: usize, remake: bool, runs: usize) -> Result<f64, BenchError> {
    let ready = dir.join(format!("rebuild-{kind}.ready"));
    let _ = std::fs::remove_file(&ready);
    let mut child = std::process::Command::new("setsid")
        .args(["python3", "-c", HOLDER, kind, &n.to_string()])
        .arg(&ready)
        // Its template must not hold the bench's output open.
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(ioe("start python3"))?;
    let pid = child.id();
    let result = (|| {
        let child = &mut child;
        crate::proc::wait_for(&ready, "the program")?;
        let perr = |e: tine_proc::ProcError| err(format!("bench: rebuild ({kind}): {e}"));
        let mut t = tine_proc::ptrace::Tracee::seize(pid).map_err(perr)?;
        let mut others = tine_proc::threads::stop_others(pid, t.syscall_at()).map_err(perr)?;
        let made = tine_proc::template::fork_template(&mut t, &mut others, None);
        let _ = t.resume();
        for o in others {
            let _ = o.resume();
        }
        let (tpl, unsettled) = made.map_err(perr)?;
        let timed = unsettled.settle().map_err(perr).and_then(|()| {
            // Copies take the origin's thread IDs, as in a rollback: it goes.
            let _ = child.kill();
            let _ = child.wait();
            time_copies(&tpl, remake, runs)
                .map_err(|e| err(format!("bench: rebuild ({kind}): {e}")))
        });
        // Whatever happened, the template goes too.
        tine_proc::template::kill_and_reap(tpl.pid);
        timed
    })();
    let _ = child.kill();
    let _ = child.wait();
    result
}

/// Median ms of one copy of `tpl` (its objects made anew when `remake`).
fn time_copies(tpl: &tine_proc::Template, remake: bool, runs: usize) -> Result<f64, String> {
    let plan = if remake {
        tine_proc::objects::plan(tpl.pid, &tpl.fds, &tpl.queued)?
    } else {
        vec![]
    };
    let how = tine_proc::Respawn {
        parent: true,
        remake: plan,
        ..Default::default()
    };
    let mut times = Vec::with_capacity(runs);
    let mut retries = 0;
    while times.len() < runs {
        let t0 = Instant::now();
        let p = match tine_proc::respawn(tpl, &how) {
            Ok(p) => p,
            // These copies are made in the host's PID namespace: another
            // process of the host may hold a thread's TID a while (it ran
            // one between two copies). That copy is not timed; another is.
            Err(tine_proc::ProcError::Ptrace { step, .. })
                if step.starts_with("make its threads again") && retries < 5 =>
            {
                retries += 1;
                std::thread::sleep(std::time::Duration::from_millis(20));
                continue;
            }
            Err(e) => return Err(e.to_string()),
        };
        times.push(ms(t0.elapsed()));
        tine_proc::template::kill_and_reap(p);
    }
    Ok(med(times))
}

/// µs per rebuilt item, by kind.
pub(crate) fn per_item(dir: &Path, runs: usize) -> Result<Vec<(&'static str, f64)>, BenchError> {
    let runs = runs.max(9);
    let mut out = Vec::new();
    let none = copy_ms(dir, "none", 0, false, runs)?;
    let threads = copy_ms(dir, "thread", ITEMS, false, runs)?;
    out.push(("thread", (threads - none) * 1e3 / ITEMS as f64));
    let mut eventfd = 0.0;
    for kind in ["pipe", "socketpair", "eventfd", "timerfd", "epoll"] {
        let shared = copy_ms(dir, kind, ITEMS, false, runs)?;
        let rebuilt = copy_ms(dir, kind, ITEMS, true, runs)?;
        let per = (rebuilt - shared) * 1e3 / ITEMS as f64;
        match kind {
            "eventfd" => {
                eventfd = per;
                out.push((kind, per));
            }
            // Its eventfds are made anew too: the registration is the rest.
            "epoll" => out.push(("epoll registration", per - eventfd)),
            _ => out.push((kind, per)),
        }
    }
    Ok(out)
}
