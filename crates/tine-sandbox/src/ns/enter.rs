//! Joining a running sandbox (`tine exec`): its namespaces, cgroup, root and
//! IDs, and what the host can ask of its processes.

use super::*;

/// Moves the calling process into a running sandbox: its cgroup, its IPC, UTS,
/// network, PID (for the children it starts next) and mount namespaces, then
/// its commands' directory (`/workspace`, or its image's working directory), with the sandbox's capabilities and `no_new_privs`. The caller
/// must be single-threaded (joining a mount namespace requires it) and starts
/// the command as a child afterwards, which is then PID-namespaced too.
pub fn enter(
    init_pid: u32,
    cgroup_procs: &[PathBuf],
    image: Option<&ImageRoot>,
) -> Result<(), NsError> {
    use rustix::thread::LinkNameSpaceType as T;
    // Open every namespace first: after joining the mount namespace, /proc is the sandbox's.
    let kinds = [
        ("cgroup", T::ControlGroup),
        ("ipc", T::InterProcessCommunication),
        ("uts", T::HostNameAndNISDomainName),
        ("net", T::Network),
        ("pid", T::ProcessID),
        ("mnt", T::Mount),
    ];
    let mut fds = Vec::new();
    // Its user namespace (when it has one of its own) last: with the host's
    // privileges every other namespace can be joined, also one owned by an
    // outer user namespace (a native fork's cgroup namespace is its
    // source's); from inside it, not.
    let user = PathBuf::from(format!("/proc/{init_pid}/ns/user"));
    let own_user = !shares_namespace(init_pid, "user");
    for (name, kind) in kinds {
        // One it shares with the host (`--net host`) is joined already, and
        // from its user namespace could not be joined again.
        if shares_namespace(init_pid, name) {
            continue;
        }
        let p = PathBuf::from(format!("/proc/{init_pid}/ns/{name}"));
        fds.push((File::open(&p).map_err(at("open namespace", &p))?, kind, p));
    }
    if own_user {
        fds.push((
            File::open(&user).map_err(at("open namespace", &user))?,
            T::User,
            user,
        ));
    }
    let root_path = PathBuf::from(format!("/proc/{init_pid}/root"));
    let root = File::open(&root_path).map_err(at("open", &root_path))?;
    // What runs in it gets the filter its init has.
    let seccomp = crate::seccomp::filtered(init_pid);
    // While the host's /proc is this process's (the sandbox's has no entry
    // for a process that only joined its PID namespace).
    prefer_for_oom();
    for p in cgroup_procs {
        fs::write(p, "0").map_err(at("join cgroup", p))?;
    }
    for (f, kind, p) in &fds {
        rustix::thread::move_into_link_name_space(f.as_fd(), Some(*kind))
            .map_err(at("join namespace", p))?;
    }
    // Joining a mount namespace lands at the namespace's original root, not
    // at the root the sandbox pivoted into: take that from its init.
    rustix::process::fchdir(&root).map_err(at("enter the root of", &root_path))?;
    rustix::process::chroot(".").map_err(at("chroot into", &root_path))?;
    if own_user && !take_root_ids() {
        return Err(at("become root of the user namespace", "self")(
            io::Error::last_os_error(),
        ));
    }
    // (Looked up in its root, which this process has now.)
    let start = start_dir(image);
    std::env::set_current_dir(start).map_err(at("enter", start))?;
    // What the caller holds (a descriptor of a host directory given by
    // whoever ran `tine exec`, a daemon's sockets) must not reach the command.
    cloexec_inherited().map_err(at("mark descriptors close-on-exec", "self"))?;
    lock_down(seccomp)
}

/// In a user namespace just made or joined: takes its root's IDs (the
/// host's root is no ID there), with no supplementary groups; false on a
/// failure (errno says which). Raw system calls, per thread — the caller has
/// one thread (glibc's wrappers would signal others) — so it is
/// async-signal-safe, for a cloned child before exec too.
pub(super) fn take_root_ids() -> bool {
    // SAFETY: set*id system calls with constant arguments; the only pointer
    // passed is a null group list of length 0.
    unsafe {
        libc::syscall(libc::SYS_setresgid, 0, 0, 0) == 0
            && libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<libc::gid_t>()) == 0
            && libc::syscall(libc::SYS_setresuid, 0, 0, 0) == 0
    }
}

/// Whether host process `pid` is in this process's namespace of kind `ns`
/// (`user`, `net`, ... as under `/proc/PID/ns`).
pub fn shares_namespace(pid: u32, ns: &str) -> bool {
    fs::read_link(format!("/proc/{pid}/ns/{ns}")).ok()
        == fs::read_link(format!("/proc/self/ns/{ns}")).ok()
}

/// The owner of host process `pid`, as the host sees it: (uid, gid) — for a
/// sandbox's process, the root of its user namespace.
pub fn owner_of_process(pid: u32) -> io::Result<(u32, u32)> {
    use std::os::unix::fs::MetadataExt;
    let md = fs::metadata(format!("/proc/{pid}"))?;
    Ok((md.uid(), md.gid()))
}

/// The OOM score adjustment of a sandbox's processes (raising one's own
/// needs no privilege; lowering does): under memory pressure the kernel
/// kills one of them before the sandbox's init, which stays at 0 (or at
/// -1000 where the supervisor may set that), so the sandbox survives an
/// out-of-memory program.
pub(super) const PROCESS_OOM_SCORE_ADJ: &[u8] = b"500";

/// Raises the calling process's OOM score adjustment to
/// [`PROCESS_OOM_SCORE_ADJ`]. Async-signal-safe (open, write, close).
pub(super) fn prefer_for_oom() {
    // SAFETY: open/write/close on a NUL-terminated constant path and a
    // constant buffer; nothing else is touched.
    unsafe {
        let fd = libc::open(
            c"/proc/self/oom_score_adj".as_ptr(),
            libc::O_WRONLY | libc::O_CLOEXEC,
        );
        if fd >= 0 {
            libc::write(
                fd,
                PROCESS_OOM_SCORE_ADJ.as_ptr().cast(),
                PROCESS_OOM_SCORE_ADJ.len(),
            );
            libc::close(fd);
        }
    }
}
