//! Starting a sandbox's init: the clone into new namespaces (user first),
//! its ID maps and cgroup set from outside, and the exec of
//! `tine __sandbox-init -`, its spec handed over in a memory file (never on
//! its command line, which every host user reads: the spec holds the
//! environment given to the sandbox, API keys included).

use super::*;

/// What the cloned child needs; prepared before the clone, because between
/// clone and exec only async-signal-safe calls are allowed.
pub(super) struct ChildArgs {
    /// The executable, opened by the parent: in a user namespace of its own
    /// the child may not be allowed to look up its path.
    exe: i32,
    argv: Vec<*const libc::c_char>,
    envp: Vec<*const libc::c_char>,
    stdin: i32,
    stdout: i32,
    stderr: i32,
    /// Becomes fd 3: the init reports "ok" or its setup error there.
    ready: i32,
    /// Become fds 4 and 5: detached copies of the workspace's and the root
    /// filesystem's mount trees (-1: none), made by the parent, which can
    /// reach them (the repository is private to its owner).
    workspace: i32,
    rootfs: i32,
    /// Becomes fd 7: the spec, as JSON in a memory file.
    spec: i32,
    /// The child waits for a byte here: its ID maps and cgroup are set.
    go: i32,
    /// In a user namespace of its own: become its root once mapped.
    userns: bool,
}

/// Where the init finds the trees [`ChildArgs`] hands over.
pub(super) const WORKSPACE_FD: i32 = 4;
pub(super) const ROOTFS_FD: i32 = 5;
/// Where the init reads its spec (fd 6 is the executable, closed on exec).
pub(super) const SPEC_FD: i32 = 7;

extern "C" fn child_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` points to the ChildArgs that `spawn_init` keeps alive until
    // clone returns; this copy of the address space is private to the child. Only
    // async-signal-safe calls follow (read, set*id, dup2, close_range, execveat, _exit).
    unsafe {
        let a = &*(arg as *const ChildArgs);
        let mut byte = 0u8;
        if libc::read(a.go, (&mut byte as *mut u8).cast(), 1) != 1 {
            libc::_exit(125);
        }
        // Its own cgroup namespace, rooted at the sandbox's group (which the
        // parent moved it into): it sees no other group.
        if libc::unshare(libc::CLONE_NEWCGROUP) != 0 {
            libc::_exit(123);
        }
        if a.userns && !take_root_ids() {
            libc::_exit(124);
        }
        if libc::dup2(a.stdin, 0) < 0
            || libc::dup2(a.stdout, 1) < 0
            || libc::dup2(a.stderr, 2) < 0
            || libc::dup2(a.ready, READY_FD) < 0
            || (a.workspace >= 0 && libc::dup2(a.workspace, WORKSPACE_FD) < 0)
            || (a.rootfs >= 0 && libc::dup2(a.rootfs, ROOTFS_FD) < 0)
            || libc::dup2(a.exe, ROOTFS_FD + 1) < 0
            || libc::dup2(a.spec, SPEC_FD) < 0
        {
            libc::_exit(126);
        }
        // Nothing else of the supervisor's reaches the sandbox, whatever it
        // was given; the executable's descriptor closes on exec.
        libc::syscall(libc::SYS_close_range, SPEC_FD + 1, u32::MAX, 0u32);
        libc::fcntl(ROOTFS_FD + 1, libc::F_SETFD, libc::FD_CLOEXEC);
        libc::syscall(
            libc::SYS_execveat,
            ROOTFS_FD + 1,
            c"".as_ptr(),
            a.argv.as_ptr(),
            a.envp.as_ptr(),
            libc::AT_EMPTY_PATH,
        );
        libc::_exit(127)
    }
}

/// A started init: its PID as the host sees it, and the pipe on which it
/// reports the end of its setup.
#[derive(Debug)]
pub struct Started {
    pub pid: u32,
    ready: File,
    /// `--net private`'s user-mode network stack (the caller keeps it for
    /// as long as the sandbox runs).
    pub net: Option<crate::slirp::NetHelper>,
}

impl Started {
    /// Waits until the init has set the sandbox up and started the command;
    /// returns the init's setup error otherwise.
    pub fn wait_ready(&self) -> Result<u32, String> {
        use std::io::BufRead;
        let mut line = String::new();
        let _ = std::io::BufReader::new(&self.ready).read_line(&mut line);
        match line.trim_end() {
            "ok" => Ok(self.pid),
            "" => Err("the sandbox's init ended before setting it up".into()),
            e => Err(e.strip_prefix("error: ").unwrap_or(e).to_string()),
        }
    }
}

/// The fd on which `tine __sandbox-init` reports readiness.
pub(super) const READY_FD: i32 = 3;

/// Starts `exe __sandbox-init SPEC` as PID 1 of new namespaces (a user
/// namespace too when `spec.ids` says so), in the cgroup `spec.cgroup_procs`
/// name, its stdout and stderr going to the given files.
pub fn spawn_init(
    exe: &Path,
    spec: &InitSpec,
    stdout: &File,
    stderr: &File,
) -> Result<Started, NsError> {
    let null = File::open("/dev/null").map_err(at("open", "/dev/null"))?;
    let (ready_r, ready_w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
        .map_err(at("create pipe", "ready"))?;
    let (go_r, go_w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
        .map_err(at("create pipe", "go"))?;
    let exe_fd = File::open(exe).map_err(at("open", exe))?;
    // Taken before anything moves: they may live under the private
    // repository, or in /tmp, which the init covers.
    let workspace = clone_tree(&spec.workspace)?;
    let rootfs = spec.rootfs.as_deref().map(clone_tree).transpose()?;
    let json = serde_json::to_vec(spec).map_err(|e| NsError::Invalid(e.to_string()))?;
    let spec_fd = spec_file(&json)?;
    let argv_c = [
        cstring(OsStr::new("tine"))?,
        cstring(OsStr::new("__sandbox-init"))?,
        cstring(OsStr::new("-"))?,
    ];
    let envp_c = [cstring(OsStr::new(&format!("PATH={DEFAULT_PATH}")))?];
    let mut argv: Vec<*const libc::c_char> = argv_c.iter().map(|c| c.as_ptr()).collect();
    argv.push(std::ptr::null());
    let mut envp: Vec<*const libc::c_char> = envp_c.iter().map(|c| c.as_ptr()).collect();
    envp.push(std::ptr::null());
    let child = ChildArgs {
        exe: exe_fd.as_raw_fd(),
        argv,
        envp,
        stdin: null.as_raw_fd(),
        stdout: stdout.as_raw_fd(),
        stderr: stderr.as_raw_fd(),
        ready: ready_w.as_raw_fd(),
        workspace: workspace.as_raw_fd(),
        rootfs: rootfs.as_ref().map_or(-1, |t| t.as_raw_fd()),
        spec: spec_fd.as_raw_fd(),
        go: go_r.as_raw_fd(),
        userns: spec.ids.is_some(),
    };
    let mut flags = libc::CLONE_NEWNS
        | libc::CLONE_NEWPID
        | libc::CLONE_NEWUTS
        | libc::CLONE_NEWIPC
        | libc::SIGCHLD;
    if spec.net != Net::Host {
        flags |= libc::CLONE_NEWNET;
    }
    if spec.ids.is_some() {
        // First: the other namespaces are then owned by it, so root inside
        // holds its capabilities over them and over nothing of the host's.
        flags |= libc::CLONE_NEWUSER;
    }
    let mut stack = vec![0u8; 256 << 10];
    // SAFETY: the stack grows down from its end (aligned to 16 bytes); clone
    // without CLONE_VM gives the child its own copy of memory, so `child` and the
    // stack stay valid in it; in the parent both outlive the call.
    let pid = unsafe {
        let top = stack.as_mut_ptr().add(stack.len());
        let top = (top as usize & !15) as *mut libc::c_void;
        libc::clone(
            child_main,
            top,
            flags,
            &child as *const ChildArgs as *mut libc::c_void,
        )
    };
    if pid < 0 {
        return Err(at("clone into new namespaces", exe)(
            io::Error::last_os_error(),
        ));
    }
    // Only the child holds the write end now: its end means end of file.
    drop(ready_w);
    drop(go_r);
    let mut started = Started {
        pid: pid as u32,
        ready: File::from(ready_r),
        net: None,
    };
    // The child waits for `go`; dropped without it, it exits at once.
    let pid = started.pid;
    let mut go = File::from(go_w);
    let kill = |e: NsError| {
        let _ = send_signal(pid, libc::SIGKILL);
        let _ = wait(pid);
        e
    };
    if let Some(ids) = &spec.ids {
        let (uid_map, gid_map) = ids.maps();
        for (file, map) in [("uid_map", uid_map), ("gid_map", gid_map)] {
            let p = PathBuf::from(format!("/proc/{pid}/{file}"));
            fs::write(&p, map).map_err(|e| kill(at("write", &p)(e)))?;
        }
    }
    // In the cgroup before it runs a step of its own (from here: in a user
    // namespace of its own it may not write the host's cgroup files).
    for p in &spec.cgroup_procs {
        fs::write(p, pid.to_string()).map_err(|e| kill(at("join cgroup", p)(e)))?;
    }
    // Its network before its command runs.
    if spec.net == Net::Private {
        started.net = Some(crate::slirp::attach(pid).map_err(kill)?);
    }
    use std::io::Write;
    go.write_all(b"g")
        .map_err(|e| kill(at("release", "init")(e)))?;
    Ok(started)
}

/// `json` in a memory file (no size limit but memory's, unlike an argument's
/// 128 KiB), read from its start.
fn spec_file(json: &[u8]) -> Result<OwnedFd, NsError> {
    use std::io::{Seek, Write};
    let fd = rustix::fs::memfd_create("tine-init-spec", rustix::fs::MemfdFlags::CLOEXEC)
        .map_err(at("make a memory file for", "the init's spec"))?;
    let mut f = File::from(fd);
    f.write_all(json)
        .and_then(|()| f.rewind())
        .map_err(at("write", "the init's spec"))?;
    // Above the numbers the child's dup2s fill (3..=7), so that none of them
    // overwrites it, and not 7 itself (dup2 onto itself would keep it
    // close-on-exec).
    let high = rustix::io::fcntl_dupfd_cloexec(&f, 64).map_err(at("move", "the init's spec"))?;
    Ok(high)
}

/// The spec [`spawn_init`] handed over on [`SPEC_FD`], for `tine
/// __sandbox-init -`; the descriptor is closed, so nothing the init starts
/// holds it.
pub fn read_init_spec() -> Result<InitSpec, NsError> {
    use std::io::Read;
    // SAFETY: fd 7 is the spec's memory file spawn_init put there, owned by
    // nothing else in this process; taken once, at the init's start.
    let mut f = File::from(unsafe { OwnedFd::from_raw_fd(SPEC_FD) });
    let mut json = Vec::new();
    f.read_to_end(&mut json)
        .map_err(at("read", "the init's spec"))?;
    serde_json::from_slice(&json).map_err(|e| NsError::Invalid(format!("the init's spec: {e}")))
}

/// Waits for a child started by [`spawn_init`]; returns its exit code (128 + the
/// signal for a signal).
pub fn wait(pid: u32) -> io::Result<i32> {
    let pid = rustix::process::Pid::from_raw(pid as i32)
        .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
    loop {
        match rustix::process::waitpid(Some(pid), rustix::process::WaitOptions::empty()) {
            Ok(Some((_, st))) => {
                return Ok(match (st.exit_status(), st.terminating_signal()) {
                    (Some(c), _) => c,
                    (_, Some(s)) => 128 + s,
                    _ => 255,
                });
            }
            Ok(None) => continue,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}
