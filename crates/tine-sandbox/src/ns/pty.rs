//! Commands started on a new pseudo-terminal (`tine exec -t`).

use super::*;

/// A command started on a new pseudo-terminal, and the terminal's master side.
#[derive(Debug)]
pub struct OnTerminal {
    pub child: std::process::Child,
    pub master: File,
}

/// Starts `cmd` as the session leader of a new pseudo-terminal, taken from the
/// `devpts` of the mount namespace the caller is in (a sandbox's own, after
/// [`enter`]). The terminal gets the size of `size_from` when that is one.
pub fn spawn_on_terminal(
    cmd: &mut std::process::Command,
    size_from: Option<std::os::fd::BorrowedFd<'_>>,
) -> Result<OnTerminal, NsError> {
    use rustix::pty::OpenptFlags;
    let master =
        rustix::pty::openpt(OpenptFlags::RDWR | OpenptFlags::NOCTTY | OpenptFlags::CLOEXEC)
            .map_err(at("open terminal", "/dev/ptmx"))?;
    rustix::pty::grantpt(&master).map_err(at("grant terminal", "/dev/ptmx"))?;
    rustix::pty::unlockpt(&master).map_err(at("unlock terminal", "/dev/ptmx"))?;
    let slave = rustix::pty::ioctl_tiocgptpeer(&master, OpenptFlags::RDWR | OpenptFlags::NOCTTY)
        .map_err(at("open terminal peer", "/dev/ptmx"))?;
    if let Some(fd) = size_from
        && let Ok(ws) = rustix::termios::tcgetwinsize(fd)
    {
        let _ = rustix::termios::tcsetwinsize(&master, ws);
    }
    let slave = File::from(slave);
    let dup = |f: &File| f.try_clone().map_err(at("duplicate", "terminal"));
    cmd.stdin(dup(&slave)?).stdout(dup(&slave)?).stderr(slave);
    // SAFETY: runs in the forked child before exec; setsid and the TIOCSCTTY
    // ioctl on fd 0 (the terminal just put there) are async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            // (Already a session leader when an earlier hook made it one.)
            let _ = rustix::process::setsid();
            rustix::process::ioctl_tiocsctty(std::os::fd::BorrowedFd::borrow_raw(0))
                .map_err(io::Error::from)
        });
    }
    let child = cmd.spawn();
    // Our copies of the terminal's other side must go, or it never closes.
    cmd.stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let child = child.map_err(at("start command on", "terminal"))?;
    Ok(OnTerminal {
        child,
        master: File::from(master),
    })
}
