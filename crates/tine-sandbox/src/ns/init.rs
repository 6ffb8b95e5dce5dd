//! The sandbox's PID 1: setting up and starting the command, forwarding
//! signals, reaping orphans, and the descriptors nothing may inherit.

use super::*;

/// Blocks the signals init handles synchronously; returns the set.
pub(super) fn block_signals() -> libc::sigset_t {
    // SAFETY: sigset manipulation on a local, then sigprocmask on this
    // single-threaded process.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in [
            libc::SIGCHLD,
            libc::SIGTERM,
            libc::SIGINT,
            libc::SIGHUP,
            libc::SIGQUIT,
            libc::SIGUSR1,
            libc::SIGUSR2,
        ] {
            libc::sigaddset(&mut set, s);
        }
        libc::sigaddset(&mut set, hold_signal());
        libc::sigaddset(&mut set, release_signal());
        libc::sigaddset(&mut set, restart_signal());
        libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

/// Exit code for a wait status: the code, or 128 + the signal.
pub(super) fn exit_code(status: libc::c_int) -> i32 {
    if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else if libc::WIFSIGNALED(status) {
        128 + libc::WTERMSIG(status)
    } else {
        255
    }
}

/// The sandbox's PID 1. Sets everything up, runs the command, and returns the
/// exit code to leave with (the command's). Errors leave before the command starts.
pub fn run_init(spec: &InitSpec) -> Result<i32, NsError> {
    use std::io::Write;
    // SAFETY: fd 3 is the readiness pipe spawn_init put there, owned by
    // nothing else in this process. (Not reopened through /proc: in a user
    // namespace the host's pipe is not this root's to open.)
    let fd3 = unsafe { OwnedFd::from_raw_fd(READY_FD) };
    let mut ready = rustix::io::fcntl_setfd(&fd3, rustix::io::FdFlags::CLOEXEC)
        .ok()
        .map(|()| File::from(fd3));
    match setup_and_start(spec) {
        Ok((set, main)) => {
            if let Some(r) = ready.as_mut() {
                let _ = r.write_all(b"ok\n");
            }
            Ok(reap(&set, main, spec.held, &|| start_command(spec)))
        }
        Err(e) => {
            if let Some(r) = ready.as_mut() {
                let _ = writeln!(r, "error: {e}");
            }
            Err(e)
        }
    }
}

pub(super) fn setup_and_start(spec: &InitSpec) -> Result<(libc::sigset_t, libc::pid_t), NsError> {
    if spec.command.is_empty() {
        return Err(NsError::Invalid("no command given".into()));
    }
    // (Its cgroup: joined by spawn_init before it ran.)
    rustix::system::sethostname(spec.hostname.as_bytes())
        .map_err(at("set hostname", &spec.hostname))?;
    if spec.net != Net::Host {
        loopback_up()?;
    }
    rustix::mount::mount_change(
        "/",
        MountPropagationFlags::REC | MountPropagationFlags::PRIVATE,
    )
    .map_err(at("make mounts private", "/"))?;
    // The trees spawn_init took (with the host's privileges) and handed over.
    // SAFETY: fds 4 and 5 were put there by spawn_init's child before exec
    // (5 only with a rootfs) and nothing else in this process owns them.
    let workspace = unsafe { OwnedFd::from_raw_fd(WORKSPACE_FD) };
    let rootfs = spec.rootfs.as_ref().map(|_| {
        // SAFETY: as above: fd 5 is the rootfs tree handed over, owned by nothing else.
        unsafe { OwnedFd::from_raw_fd(ROOTFS_FD) }
    });
    for fd in std::iter::once(&workspace).chain(rootfs.as_ref()) {
        rustix::io::fcntl_setfd(fd, rustix::io::FdFlags::CLOEXEC)
            .map_err(at("set close-on-exec", "mount tree"))?;
    }
    // In a directory of its own, so that mounts the tmpfs covers (still in
    // the mount table) are never mistaken for the new root's.
    let new_root = root_stage()?;
    match &rootfs {
        None if spec.image.is_some() => {
            // The workspace is the root: read-write, the image's files in
            // its lower layer. Mount points it lacks are made in its upper
            // layer (as a container runtime does).
            attach(&workspace, new_root)?;
            image_mount_points(new_root)?;
        }
        None => mount_fs(
            "tmpfs",
            new_root,
            MountFlags::NOSUID | MountFlags::NODEV,
            "mode=0755",
        )?,
        Some(tree) => {
            attach(tree, new_root)?;
            remount_readonly_below(new_root)?;
            // Its mount points must exist: creating them would write to the
            // user's rootfs, so they are required instead.
            for d in OWN {
                if !new_root.join(d).is_dir() {
                    return Err(NsError::Invalid(format!(
                        "--rootfs {} has no /{d} directory to mount on; create it",
                        spec.rootfs
                            .as_ref()
                            .map(|p| p.display().to_string())
                            .unwrap_or_default()
                    )));
                }
            }
        }
    }
    build_root(
        spec,
        new_root,
        &mut Kernel {
            workspace: &workspace,
        },
    )?;
    // A root of its own (a tmpfs) takes the old root on a directory it
    // then removes; a given root (a rootfs, an image's) on its `/tmp`,
    // which the old root's detach uncovers.
    let own_top = rootfs.is_none() && spec.image.is_none();
    let old = new_root.join(".oldroot");
    if own_top {
        mkdir(&old)?;
    }
    std::env::set_current_dir(new_root).map_err(at("enter", new_root))?;
    let old_rel = if own_top { ".oldroot" } else { "tmp" };
    rustix::process::pivot_root(".", old_rel).map_err(at("pivot_root", new_root))?;
    rustix::mount::unmount(Path::new("/").join(old_rel).as_path(), UnmountFlags::DETACH)
        .map_err(at("detach old root", "/"))?;
    if own_top {
        let _ = fs::remove_dir("/.oldroot");
        // The tmpfs holding the mount points becomes read-only too.
        rustix::mount::mount_remount(
            "/",
            MountFlags::BIND | MountFlags::RDONLY | MountFlags::NOSUID | MountFlags::NODEV,
            "",
        )
        .map_err(at("make read-only", "/"))?;
    }
    let start = start_dir(spec.image.as_ref());
    std::env::set_current_dir(start).map_err(at("enter", start))?;
    lock_down(spec.seccomp)?;
    guard_init()?;

    let set = block_signals();
    if spec.held {
        // The first PID the namespace gives: the command's, as a copy will have it.
        return Ok((set, HELD_MAIN));
    }
    let main = start_command(spec).map_err(at("start command", &spec.command[0]))?;
    Ok((set, main))
}

/// Starts the sandbox's command as init's child (its own session, signals
/// unblocked); its PID.
fn start_command(spec: &InitSpec) -> io::Result<libc::pid_t> {
    let mut cmd = std::process::Command::new(&spec.command[0]);
    cmd.args(&spec.command[1..])
        .env_clear()
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .current_dir(start_dir(spec.image.as_ref()));
    if let Some(img) = &spec.image {
        // The image's user (std drops the supplementary groups with it).
        cmd.uid(img.uid).gid(img.gid);
    }
    // SAFETY: the hook runs in the forked child before exec and only calls
    // async-signal-safe functions (sigprocmask, setsid).
    unsafe {
        cmd.pre_exec(|| {
            let mut empty: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut empty);
            libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
            libc::setsid();
            prefer_for_oom();
            Ok(())
        });
    }
    // Reaped by init's loop (`waitpid(-1)`), not through this handle.
    Ok(cmd.spawn()?.id() as libc::pid_t)
}

/// Marks every descriptor above 2 close-on-exec: nothing this process was
/// given reaches what it executes, while it keeps using them itself. For
/// whatever starts a program in a sandbox (the CLI at its start, [`enter`]).
pub fn cloexec_inherited() -> io::Result<()> {
    const CLOSE_RANGE_CLOEXEC: libc::c_uint = 1 << 2;
    // SAFETY: close_range with CLOSE_RANGE_CLOEXEC only sets a flag on open
    // descriptors; it closes nothing and touches no memory.
    let r = unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, CLOSE_RANGE_CLOEXEC) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Closes every descriptor above 2 but `keep`: for a process that must not
/// pass on what it was given (the supervisor, from whoever started it: a
/// sandbox must get no descriptor of the host's).
pub fn close_other_fds(keep: &[i32]) -> io::Result<()> {
    let open: Vec<i32> = fs::read_dir("/proc/self/fd")?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    for fd in open {
        if fd > 2 && !keep.contains(&fd) {
            // SAFETY: closing a descriptor number that nothing in this
            // process holds as an owned handle (callers run this first
            // thing, or after taking what they keep); the listing's own, by
            // now closed, fails harmlessly.
            unsafe { libc::close(fd) };
        }
    }
    Ok(())
}

/// The signal that asks a sandbox's init to hold on when its command ends:
/// a rollback is about to replace the command with a copy from a template,
/// under the same PID. Never forwarded to the command.
pub fn hold_signal() -> libc::c_int {
    libc::SIGRTMAX()
}

/// The signal that ends a hold: if the command is not back by then, its end
/// (as reaped during the hold) ends the sandbox after all.
pub fn release_signal() -> libc::c_int {
    libc::SIGRTMAX() - 1
}

/// The signal that asks a sandbox's init, during a hold, to start its
/// command afresh (a rollback whose processes could not come back: the
/// command starts over the restored files, as a fork's does). Ignored by
/// the init of a native fork, which does not know the command.
pub fn restart_signal() -> libc::c_int {
    libc::SIGRTMAX() - 2
}

/// Sends `sig` (which may be a realtime signal, as the hold and release
/// signals are) to the host process `pid`.
pub fn send_signal(pid: u32, sig: libc::c_int) -> io::Result<()> {
    // SAFETY: kill(2) with a positive PID and a signal number; no memory involved.
    if unsafe { libc::kill(pid as libc::pid_t, sig) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Init's life after the start: forward signals to the command, reap orphans,
/// and return the command's exit code when it ends.
/// The command's PID in a sandbox started held (see [`InitSpec::held`]).
pub(super) const HELD_MAIN: libc::pid_t = 2;

/// `restart` starts the command afresh (see [`restart_signal`]).
pub(super) fn reap(
    set: &libc::sigset_t,
    mut main: libc::pid_t,
    start_held: bool,
    restart: &dyn Fn() -> io::Result<libc::pid_t>,
) -> i32 {
    // The command's status when it ended during a hold. Started held, it is
    // as if it had ended with 127: released without a copy, init ends so.
    let mut held: Option<Option<libc::c_int>> = start_held.then_some(Some(127 << 8));
    // The command's status once it has ended for good.
    let mut ended: Option<libc::c_int> = None;
    loop {
        // PID 1 leaving kills every other process of the namespace, and
        // the namespaces nested in it: native forks of this sandbox's
        // processes. Init stays, as a bare holder, until they are gone.
        if let Some(status) = ended
            && !has_nested_children()
        {
            return exit_code(status);
        }
        // SAFETY: sigwaitinfo on the blocked set, into a zeroed local siginfo.
        let sig = unsafe {
            let mut info: libc::siginfo_t = std::mem::zeroed();
            libc::sigwaitinfo(set, &mut info)
        };
        if sig < 0 {
            continue;
        }
        if sig == hold_signal() {
            // A hold already on (a held start) keeps what it knows.
            held.get_or_insert(None);
            continue;
        }
        if sig == restart_signal() {
            // Only during a hold, once the command has ended and been
            // reaped: never a second one beside it.
            reap_exited(main, &mut held, &mut ended);
            if matches!(held, Some(Some(_)))
                && let Ok(pid) = restart()
            {
                main = pid;
                held = Some(None);
            }
            continue;
        }
        if sig == release_signal() {
            if let Some(Some(status)) = held.take() {
                // SAFETY: kill(2) with signal 0 only checks that the PID exists.
                if unsafe { libc::kill(main, 0) } != 0 {
                    ended = Some(status);
                }
            }
            continue;
        }
        if sig != libc::SIGCHLD {
            // Forward to the command's whole process group.
            // SAFETY: kill(2) with a negative pid signals a process group.
            unsafe { libc::kill(-main, sig) };
            continue;
        }
        reap_exited(main, &mut held, &mut ended);
    }
}

/// Reaps everything that exited; the command's (`main`) end ends the
/// sandbox, or during a hold is kept in `held`.
fn reap_exited(
    main: libc::pid_t,
    held: &mut Option<Option<libc::c_int>>,
    ended: &mut Option<libc::c_int>,
) {
    loop {
        let mut status = 0;
        // SAFETY: waitpid into a local status, non-blocking.
        let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        if pid <= 0 {
            return;
        }
        if pid == main {
            match held {
                // Its copy takes the same PID; the next reap of it counts again.
                Some(slot) => *slot = Some(status),
                None => *ended = Some(status),
            }
        }
    }
}

/// Whether a child of this init is the init of a nested PID namespace (a
/// native fork of a process of this sandbox).
pub(super) fn has_nested_children() -> bool {
    let Ok(dir) = fs::read_dir("/proc") else {
        return false;
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .any(|pid| {
            tine_proc::stat(pid).is_ok_and(|s| s.ppid == 1)
                && tine_proc::inspect::ns_pids(pid).is_some_and(|p| p.len() > 1)
        })
}
