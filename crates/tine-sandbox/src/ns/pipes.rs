//! Commands started on pipes of tine's own (`tine exec` without `-t`): the
//! command never holds the caller's terminal, so it can neither push input
//! into it (`TIOCSTI`) nor read what the user types after it returned.

use super::*;

use std::io::{Read, Write};
use std::os::fd::BorrowedFd;
use std::process::{Child, ExitStatus, Stdio};

use nix::sys::signal::{SigSet, SigmaskHow, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};

/// Signals a user sends the command through its caller (Ctrl-C, Ctrl-\, a
/// closed terminal, `kill`): passed on to the command's process group, which
/// no terminal reaches any more.
const PASSED_ON: [Signal; 4] = [
    Signal::SIGINT,
    Signal::SIGQUIT,
    Signal::SIGHUP,
    Signal::SIGTERM,
];

/// How long output is still read once the command ended, while something
/// it left running holds its pipes open.
const AFTER_END: std::time::Duration = std::time::Duration::from_millis(100);

/// Makes `cmd` start as the leader of a new session, without a controlling
/// terminal: whatever terminal its starter has (`/dev/tty` included) is not
/// its.
pub fn in_new_session(cmd: &mut std::process::Command) {
    // SAFETY: runs in the forked child before exec; setsid is
    // async-signal-safe. (A command an earlier hook made a session leader
    // stays one: the error is ignored.)
    unsafe {
        cmd.pre_exec(|| {
            let _ = rustix::process::setsid();
            Ok(())
        });
    }
}

/// Whether the calling process has a controlling terminal (which a command
/// started in its session could open as `/dev/tty`): `tty_nr` in its
/// `/proc/self/stat` (0: none); one that cannot be read counts as one.
pub fn session_has_terminal() -> bool {
    let Ok(stat) = fs::read_to_string("/proc/self/stat") else {
        return true;
    };
    // Fields after the command name (which may hold spaces), from field 3.
    let rest = stat.rsplit_once(") ").map_or("", |(_, r)| r);
    rest.split_whitespace()
        .nth(4)
        .and_then(|t| t.parse::<i64>().ok())
        .is_none_or(|tty| tty != 0)
}

/// A command started on pipes, in a session of its own.
#[derive(Debug)]
pub struct OnPipes {
    pub child: Child,
    stdin: Option<File>,
    stdout: File,
    stderr: File,
}

/// Starts `cmd` with pipes for its output (and its input when
/// `with_input`, else `/dev/null`), as the leader of a new session without a
/// controlling terminal.
pub fn spawn_on_pipes(
    cmd: &mut std::process::Command,
    with_input: bool,
) -> Result<OnPipes, NsError> {
    cmd.stdin(if with_input {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    in_new_session(cmd);
    let mut child = cmd.spawn().map_err(at("start command on", "pipes"))?;
    let file = |fd: OwnedFd| File::from(fd);
    let stdin = child.stdin.take().map(|p| file(p.into()));
    let (Some(out), Some(err)) = (child.stdout.take(), child.stderr.take()) else {
        return Err(at("start command on", "pipes")(io::Error::other(
            "its output pipes are missing",
        )));
    };
    Ok(OnPipes {
        child,
        stdin,
        stdout: file(out.into()),
        stderr: file(err.into()),
    })
}

impl OnPipes {
    /// Copies `input` (when the command was given an input pipe) to the
    /// command and its output to `out` and `err` until it has ended and its
    /// output pipes are empty, passing on [`PASSED_ON`] signals the caller
    /// gets for as long as it runs; then reaps it. Input goes through a
    /// non-blocking pipe with a buffer of its own, so a command that writes
    /// much before it reads never stalls this loop. A closed `out` (`tine
    /// exec ... | head`) closes the command's output pipe, so its next
    /// write gets `SIGPIPE`, as it would have writing there itself. What
    /// the command left running may hold its pipes: their output is read
    /// for [`AFTER_END`] after it ended, then what they hold. Single-threaded
    /// (a process that joined a PID namespace cannot start threads).
    pub fn relay(
        mut self,
        input: Option<BorrowedFd<'_>>,
        out: &mut dyn Write,
        err: &mut dyn Write,
    ) -> Result<ExitStatus, NsError> {
        use rustix::event::{PollFd, PollFlags, Timespec, poll};
        let signals = PassedOn::block().map_err(at("block signals in", "tine exec"))?;
        let pgid = rustix::process::Pid::from_raw(self.child.id() as i32);
        let ended = pgid.and_then(|p| {
            rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()).ok()
        });
        for f in [&self.stdout, &self.stderr]
            .into_iter()
            .chain(self.stdin.as_ref())
        {
            let flags = rustix::fs::fcntl_getfl(f).map_err(at("set up", "the command's pipes"))?;
            rustix::fs::fcntl_setfl(f, flags | rustix::fs::OFlags::NONBLOCK)
                .map_err(at("set up", "the command's pipes"))?;
        }
        let mut outputs: [Option<(File, &mut dyn Write)>; 2] =
            [Some((self.stdout, out)), Some((self.stderr, err))];
        let mut input = input.filter(|_| self.stdin.is_some());
        let mut pending: Vec<u8> = Vec::new();
        let mut exited = ended.is_none();
        let mut drain_until = None;
        let mut buf = vec![0u8; 64 * 1024];
        // Copies what an output holds now; closes it (None) at its end.
        // Copies one read's worth of what an output holds (a chatty
        // command never keeps this loop from its signals and its input);
        // closes it (None) at its end. False when nothing was there.
        let pump = |o: &mut Option<(File, &mut dyn Write)>, buf: &mut [u8]| -> bool {
            let Some((f, sink)) = o else { return false };
            match f.read(buf) {
                Ok(0) => *o = None,
                Ok(n) => {
                    if sink
                        .write_all(&buf[..n])
                        .and_then(|_| sink.flush())
                        .is_err()
                    {
                        // Closed: the command learns it at its next write.
                        *o = None;
                    }
                    return true;
                }
                Err(e)
                    if e.kind() == io::ErrorKind::WouldBlock
                        || e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => *o = None,
            }
            false
        };
        loop {
            let now = std::time::Instant::now();
            let draining_over = drain_until.is_some_and(|d| now >= d);
            if exited && (draining_over || outputs.iter().all(Option::is_none)) {
                // What the pipes hold now (a pipe's buffer at most: what
                // keeps writing past that is left), then done.
                for o in &mut outputs {
                    for _ in 0..16 {
                        if !pump(o, &mut buf) {
                            break;
                        }
                    }
                }
                break;
            }
            // Order: the outputs, the end, the signals, the input, the
            // command's stdin (writable).
            let mut fds: Vec<PollFd<'_>> = Vec::with_capacity(6);
            let mut which = Vec::with_capacity(6);
            for (i, o) in outputs.iter().enumerate() {
                if let Some((f, _)) = o {
                    fds.push(PollFd::new(f, PollFlags::IN));
                    which.push(i);
                }
            }
            if let Some(e) = ended.as_ref().filter(|_| !exited) {
                fds.push(PollFd::new(e, PollFlags::IN));
                which.push(2);
            }
            if let Some(s) = signals.as_ref().filter(|_| !exited) {
                fds.push(PollFd::new(&s.fd, PollFlags::IN));
                which.push(3);
            }
            if let Some(i) = input.filter(|_| pending.is_empty() && !exited) {
                fds.push(PollFd::from_borrowed_fd(i, PollFlags::IN));
                which.push(4);
            }
            if let Some(w) = self.stdin.as_ref().filter(|_| !pending.is_empty()) {
                fds.push(PollFd::new(w, PollFlags::OUT));
                which.push(5);
            }
            let wait = drain_until.map(|d: std::time::Instant| {
                let w = d.saturating_duration_since(now);
                Timespec {
                    tv_sec: w.as_secs() as i64,
                    tv_nsec: w.subsec_nanos() as i64,
                }
            });
            let ready: Vec<usize> = match poll(&mut fds, wait.as_ref()) {
                Ok(_) => fds
                    .iter()
                    .zip(&which)
                    .filter(|(f, _)| !f.revents().is_empty())
                    .map(|(_, w)| *w)
                    .collect(),
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(at("poll", "the command's pipes")(e)),
            };
            drop(fds);
            for w in ready {
                match w {
                    0 | 1 => {
                        pump(&mut outputs[w], &mut buf);
                    }
                    2 => {
                        exited = true;
                        drain_until = Some(std::time::Instant::now() + AFTER_END);
                        // Its input is of no use to it any more.
                        input = None;
                        pending.clear();
                        self.stdin = None;
                    }
                    3 => {
                        if let (Some(s), Some(p)) = (&signals, pgid) {
                            for sig in s.take() {
                                let _ = rustix::process::kill_process_group(p, sig);
                            }
                        }
                    }
                    4 => {
                        let Some(i) = input else { continue };
                        match rustix::io::read(i, &mut buf) {
                            Ok(n) if n > 0 => pending.extend_from_slice(&buf[..n]),
                            Err(rustix::io::Errno::INTR | rustix::io::Errno::AGAIN) => {}
                            // End of input: the command reads end of file.
                            _ => {
                                input = None;
                                self.stdin = None;
                            }
                        }
                    }
                    _ => {
                        let Some(w) = self.stdin.as_mut() else {
                            continue;
                        };
                        match w.write(&pending) {
                            Ok(n) => {
                                pending.drain(..n);
                            }
                            Err(e)
                                if e.kind() == io::ErrorKind::WouldBlock
                                    || e.kind() == io::ErrorKind::Interrupted => {}
                            // It closed its input: nothing more goes there.
                            Err(_) => {
                                pending.clear();
                                input = None;
                                self.stdin = None;
                            }
                        }
                        if pending.is_empty() && input.is_none() {
                            self.stdin = None;
                        }
                    }
                }
            }
        }
        // What it left running gets end of file and SIGPIPE from here on.
        drop(outputs);
        drop(self.stdin.take());
        let status = self.child.wait().map_err(at("wait for", "the command"));
        drop(signals);
        status
    }
}

/// [`PASSED_ON`] blocked and read through a signalfd; unblocked when dropped.
#[derive(Debug)]
struct PassedOn {
    fd: SignalFd,
    old: SigSet,
}

impl PassedOn {
    /// None when a signalfd cannot be had (the signals then act as before).
    fn block() -> io::Result<Option<PassedOn>> {
        let mut set = SigSet::empty();
        for s in PASSED_ON {
            set.add(s);
        }
        let mut old = SigSet::empty();
        nix::sys::signal::pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&set), Some(&mut old))?;
        match SignalFd::with_flags(&set, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC) {
            Ok(fd) => Ok(Some(PassedOn { fd, old })),
            Err(_) => {
                let _ =
                    nix::sys::signal::pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&old), None);
                Ok(None)
            }
        }
    }

    /// The signals received since the last call.
    fn take(&self) -> Vec<rustix::process::Signal> {
        let mut got = Vec::new();
        while let Ok(Some(info)) = self.fd.read_signal() {
            if let Some(s) = rustix::process::Signal::from_named_raw(info.ssi_signo as i32) {
                got.push(s);
            }
        }
        got
    }
}

impl Drop for PassedOn {
    fn drop(&mut self) {
        let _ = nix::sys::signal::pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&self.old), None);
    }
}
