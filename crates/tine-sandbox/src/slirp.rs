//! User-mode networking for `--net private`: slirp4netns (Debian's
//! `slirp4netns`) attached to a sandbox's network namespace gives it a
//! `tap0` with 10.0.2.100/24, a default route through 10.0.2.2 and DNS at
//! 10.0.2.3, with outbound access through the host's sockets and without the
//! host's loopback (`--disable-host-loopback`: the daemon and other services
//! on 127.0.0.1 stay out of reach). It runs on the host as root, with its own
//! seccomp filter and mount sandbox, and ends when its exit descriptor, held
//! by the supervisor, closes. It starts in a mount namespace of its own
//! whose mounts are all slaves of the host's: its sandbox (`--enable-sandbox`)
//! makes only `/` private before it detaches the old root, so where a
//! directory like `/run` is no mount of its own, the detach of the shared
//! mounts below it (Podman's `/run/netns/*`) went back to the host's.
#![allow(unsafe_code)]

use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::ns::NsError;

/// The address the sandbox's resolver is at.
pub const DNS: &str = "10.0.2.3";

/// A running slirp4netns; killed when dropped.
#[derive(Debug)]
pub struct NetHelper {
    child: Child,
    /// Its exit descriptor's other end: closing it ends it.
    _exit: OwnedFd,
}

impl Drop for NetHelper {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn failed(why: impl Into<String>) -> NsError {
    NsError::Invalid(format!(
        "--net private: {}; install it with `apt-get install slirp4netns`, or use --net none",
        why.into()
    ))
}

/// Attaches slirp4netns to the network namespace of host process `pid` and
/// waits until it has configured it (at most 10 s).
pub fn attach(pid: u32) -> Result<NetHelper, NsError> {
    let pipe = || {
        rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
            .map_err(|e| failed(format!("cannot create a pipe: {e}")))
    };
    let (ready_r, ready_w) = pipe()?;
    let (exit_r, exit_w) = pipe()?;
    let fds = [(ready_w.as_raw_fd(), 3), (exit_r.as_raw_fd(), 4)];
    let mut cmd = Command::new("slirp4netns");
    cmd.args([
        "--configure",
        "--mtu=65520",
        "--disable-host-loopback",
        "--enable-sandbox",
        "--enable-seccomp",
        "--ready-fd=3",
        "--exit-fd=4",
    ])
    .arg(pid.to_string())
    .arg("tap0")
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(Stdio::piped());
    // SAFETY: runs in the forked child before exec and calls only dup2,
    // unshare and mount (async-signal-safe system calls) on descriptors
    // opened before the fork and a static path; the sources are above 4
    // (opened after stdio and CLOEXEC pipes exist), and dup2 clears
    // close-on-exec on the copies.
    unsafe {
        cmd.pre_exec(move || {
            for (src, dst) in fds {
                if libc::dup2(src, dst) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            // Nothing it mounts or unmounts reaches the host's mounts.
            if libc::unshare(libc::CLONE_NEWNS) < 0
                || libc::mount(
                    std::ptr::null(),
                    c"/".as_ptr(),
                    std::ptr::null(),
                    libc::MS_REC | libc::MS_SLAVE,
                    std::ptr::null(),
                ) < 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn().map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => failed("slirp4netns is not installed"),
        _ => failed(format!("cannot start slirp4netns: {e}")),
    })?;
    drop(ready_w);
    drop(exit_r);
    let mut helper = NetHelper {
        child,
        _exit: exit_w,
    };
    let ready = wait_readable(&ready_r, Duration::from_secs(10));
    let mut byte = [0u8; 1];
    if ready && File::from(ready_r).read(&mut byte).is_ok_and(|n| n == 1) {
        return Ok(helper);
    }
    let _ = helper.child.kill();
    let mut err = String::new();
    if let Some(mut e) = helper.child.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    Err(failed(format!(
        "slirp4netns did not set up the network: {}",
        err.lines().last().unwrap_or("no message")
    )))
}

fn wait_readable(fd: &OwnedFd, timeout: Duration) -> bool {
    use rustix::event::{PollFd, PollFlags, Timespec, poll};
    let mut fds = [PollFd::new(fd, PollFlags::IN)];
    let t = Timespec {
        tv_sec: timeout.as_secs() as i64,
        tv_nsec: 0,
    };
    poll(&mut fds, Some(&t)).is_ok_and(|n| n > 0)
}
