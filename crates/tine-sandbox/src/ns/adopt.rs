//! A native fork's init (`tine __sandbox-adopt`): taking over the copy made
//! in its namespaces, and the status file the supervisor reads.

use super::*;

/// What the init of a native fork reports in its status file (handed over
/// as `HANDOVER/status`; the host reads it at `SandboxDirs::init_status`):
/// one line each, in this order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Adopted {
    /// Nothing yet.
    Pending,
    /// Set up; its processes are held stopped until the init is let go (a
    /// prepared fork's, `--held`).
    Held,
    /// Set up; the process runs.
    Ready,
    /// Its setup failed (the process never ran).
    Failed(String),
    /// The process ended, with this exit code (128 + a signal).
    Exited(i32),
}

impl Adopted {
    /// Reads a status file's text.
    pub fn parse(text: &str) -> Adopted {
        let mut out = Adopted::Pending;
        // Only whole lines: one may be read while it is written.
        for line in text
            .split_inclusive('\n')
            .filter_map(|l| l.strip_suffix('\n'))
        {
            out = if line == "ok" {
                Adopted::Ready
            } else if line == "held" {
                Adopted::Held
            } else if let Some(e) = line.strip_prefix("error: ") {
                Adopted::Failed(e.to_string())
            } else if let Some(c) = line.strip_prefix("exit ").and_then(|c| c.parse().ok()) {
                Adopted::Exited(c)
            } else {
                out
            };
        }
        out
    }
}

/// The init of a native fork (`tine __sandbox-adopt MAIN [OTHER...]`): the copy of a
/// template that made these namespaces (`tine_proc::template::clone_nested`),
/// furnished from outside ([`furnish_here`]) and then made to execute this.
/// Its command, `main`, is already its child, stopped. It takes its standard
/// descriptors and status file from what was handed over, closes what it
/// kept of the template's, removes the handover, enters `/workspace`, gives
/// up its capabilities as any sandbox process does, reports ready, lets
/// the others of its tree (`others`, stopped too) and `main` run, and lives
/// as a sandbox's init does until `main` ends.
///
/// `held` (a fork prepared ahead of `tine fork`): once set up it reports
/// `held` and keeps its processes stopped until the release signal, which
/// the fork's supervisor sends when a fork claims it; a signal that would
/// end it (a stop, the discarding of a prepared fork) ends it at once.
pub fn run_adopted(main: u32, others: &[u32], held: bool) -> Result<i32, NsError> {
    use std::io::Write;
    let dir = Path::new(HANDOVER);
    let status_path = dir.join("status");
    let mut status = File::options()
        .append(true)
        .open(&status_path)
        .map_err(at("open", &status_path))?;
    match adopt_setup(main, dir, &status) {
        Ok(set) => {
            if held {
                let _ = status.write_all(b"held\n");
                if let Some(code) = wait_for_release(&set, main as libc::pid_t) {
                    let _ = writeln!(status, "exit {code}");
                    return Ok(code);
                }
            }
            let _ = status.write_all(b"ok\n");
            // The rest of its tree (stopped too), its command last.
            for pid in others.iter().chain([&main]) {
                // SAFETY: kill(2) with a PID of this namespace and SIGCONT.
                unsafe { libc::kill(*pid as libc::pid_t, libc::SIGCONT) };
            }
            let code = reap(&set, main as libc::pid_t, false, &|| {
                Err(io::Error::other(
                    "a native fork's init does not know the command",
                ))
            });
            let _ = writeln!(status, "exit {code}");
            Ok(code)
        }
        Err(e) => {
            let _ = writeln!(status, "error: {e}");
            Err(e)
        }
    }
}

/// Waits (signals blocked in `set`) for the release signal: `None` then, or
/// the exit code the init ends with instead: 128 + a signal that ends it,
/// or its command's, killed while held (children that end meanwhile are
/// reaped here: their `SIGCHLD` is taken). Its processes stay stopped.
fn wait_for_release(set: &libc::sigset_t, main: libc::pid_t) -> Option<i32> {
    loop {
        // SAFETY: sigwaitinfo on the blocked set, into a zeroed local siginfo.
        let sig = unsafe {
            let mut info: libc::siginfo_t = std::mem::zeroed();
            libc::sigwaitinfo(set, &mut info)
        };
        match sig {
            s if s == release_signal() => return None,
            libc::SIGTERM | libc::SIGINT | libc::SIGHUP | libc::SIGQUIT => return Some(128 + sig),
            libc::SIGCHLD => loop {
                let mut st = 0;
                // SAFETY: waitpid into a local status, non-blocking.
                let pid = unsafe { libc::waitpid(-1, &mut st, libc::WNOHANG) };
                if pid <= 0 {
                    break;
                }
                if pid == main {
                    return Some(exit_code(st));
                }
            },
            _ => {}
        }
    }
}

pub(super) fn adopt_setup(main: u32, dir: &Path, status: &File) -> Result<libc::sigset_t, NsError> {
    let null = File::options()
        .read(true)
        .write(true)
        .open("/dev/null")
        .map_err(at("open", "/dev/null"))?;
    let stdout = dir.join("stdout");
    let stderr = dir.join("stderr");
    let out = File::options()
        .append(true)
        .open(&stdout)
        .map_err(at("open", &stdout))?;
    let err = File::options()
        .append(true)
        .open(&stderr)
        .map_err(at("open", &stderr))?;
    for (f, to) in [(&null, 0), (&out, 1), (&err, 2)] {
        // SAFETY: dup2 onto a standard descriptor number, from an open file.
        if unsafe { libc::dup2(f.as_raw_fd(), to) } < 0 {
            return Err(at("take standard descriptors from", dir)(
                io::Error::last_os_error(),
            ));
        }
    }
    // What the template held (the origin's files) is not this init's.
    close_other_fds(&[
        null.as_raw_fd(),
        out.as_raw_fd(),
        err.as_raw_fd(),
        status.as_raw_fd(),
    ])
    .map_err(at("list", "/proc/self/fd"))?;
    for f in [&null, &out, &err, status] {
        rustix::io::fcntl_setfd(f, rustix::io::FdFlags::CLOEXEC)
            .map_err(at("set close-on-exec", dir))?;
    }
    for e in fs::read_dir(dir).map_err(at("list", dir))?.flatten() {
        let p = e.path();
        rustix::mount::unmount(&p, UnmountFlags::DETACH).map_err(at("detach", &p))?;
        fs::remove_file(&p).map_err(at("remove", &p))?;
    }
    fs::remove_dir(dir).map_err(at("remove", dir))?;
    // An image's root has no /workspace: its init waits at /.
    let start = if Path::new(WORKSPACE).is_dir() {
        WORKSPACE
    } else {
        "/"
    };
    std::env::set_current_dir(start).map_err(at("enter", start))?;
    let set = block_signals();
    // (Its filter, if its sandbox has one, came with the template.)
    lock_down(false)?;
    guard_init()?;
    // SAFETY: kill(2) with signal 0 only checks that the PID exists.
    if unsafe { libc::kill(main as libc::pid_t, 0) } != 0 {
        return Err(NsError::Invalid(format!("process {main} is not there")));
    }
    Ok(set)
}
