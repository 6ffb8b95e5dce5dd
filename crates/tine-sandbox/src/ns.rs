//! Namespaces: starting a sandbox's init in new mount, PID, UTS, IPC (and
//! optionally network) namespaces, and what that init does inside them.
//!
//! The supervisor calls [`spawn_init`], which clones a child into the new
//! namespaces and executes `tine __sandbox-init SPEC`. That process is PID 1 of the
//! sandbox: [`run_init`] joins the sandbox's cgroup, builds the sandbox's root
//! (the host's root read-only, or `--rootfs`; the workspace read-write at
//! `/workspace`; a private `/tmp`, `/proc` and a minimal `/dev`), pivots into it,
//! drops capabilities, sets `no_new_privs`, starts the command, forwards signals
//! to it, reaps orphans, and exits with the command's status.
#![allow(unsafe_code)]

use std::ffi::{CString, OsStr};
use std::fs::{self, File};
use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};

use rustix::mount::{
    MountFlags, MountPropagationFlags, MoveMountFlags, OpenTreeFlags, UnmountFlags,
};
use serde::{Deserialize, Serialize};
use tine_store::{ErrorKind, HasKind};

/// Where the workspace appears inside a sandbox.
pub const WORKSPACE: &str = "/workspace";

/// The `PATH` a sandbox's processes get unless they are given another.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Net {
    /// Its own network namespace with only loopback.
    #[default]
    None,
    /// The host's network.
    Host,
    /// Its own network namespace with outbound access through a user-mode
    /// stack (slirp4netns), without the host's loopback.
    Private,
}

/// The host IDs a sandbox's user namespace maps its IDs 0..`count` to:
/// root inside is `host_uid` outside, an unprivileged ID of no host user.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ids {
    pub host_uid: u32,
    pub host_gid: u32,
    pub count: u32,
}

impl Ids {
    /// IDs per sandbox: as many as a Linux system has users and groups
    /// (`/etc/subuid` ranges are this size too).
    pub const COUNT: u32 = 65536;
    /// Where the ranges start: above the IDs of host users and of the usual
    /// `/etc/subuid` allocations (which start at 100000, 65536 per user).
    const FIRST: u32 = 1 << 30;
    /// Ranges to choose among (up to 2^31, where IDs become negative to some tools).
    const SLOTS: u32 = (1 << 30) / Self::COUNT;

    /// The range of the repository `repo_id`: every sandbox of one
    /// repository shares it (their bases are shared, owned by its root), and
    /// it follows from the repository's id, so it is the same on every open.
    pub fn for_repository(repo_id: &str) -> Ids {
        let h = tine_fs::paths::stable_hash(repo_id.as_bytes());
        let slot = (h % u64::from(Self::SLOTS)) as u32;
        let first = Self::FIRST + slot * Self::COUNT;
        Ids {
            host_uid: first,
            host_gid: first,
            count: Self::COUNT,
        }
    }

    /// Root inside as the host sees it: (uid, gid).
    pub fn owner(&self) -> (u32, u32) {
        (self.host_uid, self.host_gid)
    }

    /// The `uid_map` / `gid_map` lines.
    fn maps(&self) -> (String, String) {
        (
            format!("0 {} {}\n", self.host_uid, self.count),
            format!("0 {} {}\n", self.host_gid, self.count),
        )
    }
}

/// The size of a sandbox's `/tmp` (and of its `/dev/shm`) under a memory
/// limit of `memory_bytes`: a quarter each, so that filling both leaves the
/// programs half of their memory.
pub fn tmp_bytes(memory_bytes: Option<u64>) -> Option<u64> {
    memory_bytes.map(|m| (m / 4).max(1 << 20))
}

/// Everything the sandbox's init needs, handed over as JSON.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct InitSpec {
    /// Host directory mounted read-write at `/workspace` (the overlay's merged dir).
    pub workspace: PathBuf,
    /// Root filesystem; `None`: the host's root, read-only.
    pub rootfs: Option<PathBuf>,
    pub hostname: String,
    pub net: Net,
    /// The command and its arguments.
    pub command: Vec<String>,
    pub env: Vec<(String, String)>,
    /// `cgroup.procs` files of the sandbox's group(s); init moves itself in first,
    /// so everything it starts is inside from the beginning.
    pub cgroup_procs: Vec<PathBuf>,
    /// Host directories the sandbox must not see (the repository: other
    /// sandboxes' workspaces, every snapshot, its keys): each is covered by an
    /// empty read-only directory, and the mounts below it are detached.
    #[serde(default)]
    pub hide: Vec<PathBuf>,
    /// Start holding, without the command: its process (PID 2) comes from a
    /// template, and the host releases init once it is there (a fork that
    /// brings its snapshot's processes).
    #[serde(default)]
    pub held: bool,
    /// A user namespace of its own, mapping its IDs to these (`None`: the
    /// host's IDs, for callers that have no range).
    #[serde(default)]
    pub ids: Option<Ids>,
    /// The size of its `/tmp` and of its `/dev/shm`, each (`None`: the
    /// kernel's default, half the host's memory): a full `/tmp` is then an
    /// error to the writer, not an out-of-memory kill in the sandbox.
    #[serde(default)]
    pub tmp_bytes: Option<u64>,
    /// Install the seccomp filter (`seccomp`) before the command starts.
    #[serde(default)]
    pub seccomp: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum NsError {
    #[error("sandbox setup: {step} {}: {source}", path.display())]
    Setup {
        step: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("sandbox setup: {0}")]
    Invalid(String),
    #[error("sandbox setup: {0}")]
    Seccomp(#[from] crate::seccomp::SeccompError),
}

impl HasKind for NsError {
    fn kind(&self) -> ErrorKind {
        match self {
            NsError::Setup { source, .. } if source.kind() == io::ErrorKind::PermissionDenied => {
                ErrorKind::Unsupported
            }
            NsError::Setup { .. } => ErrorKind::Io,
            NsError::Invalid(_) => ErrorKind::InvalidInput,
            NsError::Seccomp(_) => ErrorKind::Unsupported,
        }
    }
}

/// Maps an error (std's or an errno) of setup step `step` on `path`.
fn at<E: Into<io::Error>>(step: &'static str, path: impl AsRef<Path>) -> impl FnOnce(E) -> NsError {
    let path = path.as_ref().to_path_buf();
    move |e| NsError::Setup {
        step,
        path,
        source: e.into(),
    }
}

fn cstring(s: &OsStr) -> Result<CString, NsError> {
    CString::new(s.as_bytes()).map_err(|_| NsError::Invalid(format!("{s:?} contains NUL")))
}

/// What the cloned child needs; prepared before the clone, because between
/// clone and exec only async-signal-safe calls are allowed.
struct ChildArgs {
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
    /// The child waits for a byte here: its ID maps and cgroup are set.
    go: i32,
    /// In a user namespace of its own: become its root once mapped.
    userns: bool,
}

/// Where the init finds the trees [`ChildArgs`] hands over.
const WORKSPACE_FD: i32 = 4;
const ROOTFS_FD: i32 = 5;

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
        {
            libc::_exit(126);
        }
        // Nothing else of the supervisor's reaches the sandbox, whatever it
        // was given; the executable's descriptor closes on exec.
        libc::syscall(libc::SYS_close_range, ROOTFS_FD + 2, u32::MAX, 0u32);
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
const READY_FD: i32 = 3;

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
    let json = serde_json::to_string(spec).map_err(|e| NsError::Invalid(e.to_string()))?;
    let argv_c = [
        cstring(OsStr::new("tine"))?,
        cstring(OsStr::new("__sandbox-init"))?,
        cstring(OsStr::new(&json))?,
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

/// Parsed line of `/proc/self/mountinfo`: the mount point.
struct MountEntry {
    point: PathBuf,
}

fn unescape(s: &str) -> PathBuf {
    // mountinfo escapes space, tab, newline and backslash as \ooo.
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|d| b[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)));
        if let Some(d) = octal {
            out.push(d.iter().fold(0u8, |a, c| a.wrapping_mul(8) + (c - b'0')));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    PathBuf::from(OsStr::from_bytes(&out))
}

fn mounts() -> Result<Vec<MountEntry>, NsError> {
    let text =
        fs::read_to_string("/proc/self/mountinfo").map_err(at("read", "/proc/self/mountinfo"))?;
    let mut out = Vec::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split(' ').collect();
        if f.len() < 6 {
            continue;
        }
        out.push(MountEntry {
            point: unescape(f[4]),
        });
    }
    Ok(out)
}

/// Makes every mount at or below `top` read-only (a recursive bind is not).
fn remount_readonly_below(top: &Path) -> Result<(), NsError> {
    remount_readonly_hiding(&[top.to_path_buf()], &[])
}

/// Detaches every mount at or below any of `hidden` where it may (in a user
/// namespace of its own, mounts that came from the host are locked to the
/// ones they sit on: those stay, covered by the caller), then makes every
/// mount at or below any of `tops` read-only.
fn remount_readonly_hiding(tops: &[PathBuf], hidden: &[PathBuf]) -> Result<(), NsError> {
    if !hidden.is_empty() {
        let table = mounts()?;
        // Newest first, so a mount goes before the one it sits on. A lazy detach
        // takes what is below along, so later ones may be gone already.
        for m in table.iter().rev() {
            if hidden.iter().any(|h| m.point.starts_with(h)) {
                let _ = rustix::mount::unmount(&m.point, UnmountFlags::DETACH);
            }
        }
    }
    for top in tops {
        readonly_recursive(top)?;
    }
    Ok(())
}

/// Makes the mount at `path` and every mount below it read-only, in one
/// call that looks up no path below (some are not this process's to reach:
/// other users' private directories, as seen from a user namespace).
fn readonly_recursive(path: &Path) -> Result<(), NsError> {
    /// `struct mount_attr`: attr_set, attr_clr, propagation, userns_fd.
    #[repr(C)]
    struct MountAttr {
        set: u64,
        clr: u64,
        propagation: u64,
        userns_fd: u64,
    }
    const MOUNT_ATTR_RDONLY: u64 = 0x1;
    const AT_RECURSIVE: libc::c_uint = 0x8000;
    let c = cstring(path.as_os_str())?;
    let attr = MountAttr {
        set: MOUNT_ATTR_RDONLY,
        clr: 0,
        propagation: 0,
        userns_fd: 0,
    };
    // SAFETY: mount_setattr reads `size_of::<MountAttr>()` bytes from `attr`
    // (the kernel's struct mount_attr, version 0) and the NUL-terminated path.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            libc::AT_FDCWD,
            c.as_ptr(),
            AT_RECURSIVE | libc::AT_SYMLINK_NOFOLLOW as libc::c_uint,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(at("make read-only", path)(io::Error::last_os_error()))
    }
}

fn mount_fs(fstype: &str, target: &Path, flags: MountFlags, data: &str) -> Result<(), NsError> {
    let data = CString::new(data).map_err(|_| NsError::Invalid("mount options".into()))?;
    rustix::mount::mount(fstype, target, fstype, flags, data.as_c_str())
        .map_err(at("mount", target))
}

fn bind(src: &Path, dst: &Path) -> Result<(), NsError> {
    rustix::mount::mount_bind_recursive(src, dst).map_err(at("bind-mount", dst))
}

/// A detached copy of the mount tree at `path`, to attach after `path` is hidden.
fn clone_tree(path: &Path) -> Result<OwnedFd, NsError> {
    rustix::mount::open_tree(
        rustix::fs::CWD,
        path,
        OpenTreeFlags::OPEN_TREE_CLONE
            | OpenTreeFlags::AT_RECURSIVE
            | OpenTreeFlags::OPEN_TREE_CLOEXEC,
    )
    .map_err(at("clone mount tree", path))
}

fn attach(tree: &OwnedFd, target: &Path) -> Result<(), NsError> {
    rustix::mount::move_mount(
        tree.as_fd(),
        "",
        rustix::fs::CWD,
        target,
        MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
    )
    .map_err(at("attach mount", target))
}

fn mkdir(p: &Path) -> Result<(), NsError> {
    match fs::create_dir(p) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(at("create directory", p)(e)),
    }
}

/// Top-level host entries that a sandbox gets its own version of.
const OWN: [&str; 5] = ["proc", "sys", "dev", "tmp", "workspace"];

/// Builds the sandbox's root under `new_root` (a fresh tmpfs).
fn build_root(spec: &InitSpec, new_root: &Path, workspace: &OwnedFd) -> Result<(), NsError> {
    let mut readonly = Vec::new();
    if spec.rootfs.is_none() {
        // The host's top-level entries, each bound read-only (directories) or
        // recreated (symlinks such as /bin -> usr/bin).
        for e in fs::read_dir("/").map_err(at("list", "/"))? {
            let e = e.map_err(at("list", "/"))?;
            let name = e.file_name();
            if OWN.iter().any(|o| OsStr::new(o) == name) || name == "lost+found" {
                continue;
            }
            let src = Path::new("/").join(&name);
            let dst = new_root.join(&name);
            let ft = e.file_type().map_err(at("stat", &src))?;
            if ft.is_symlink() {
                let target = fs::read_link(&src).map_err(at("read link", &src))?;
                std::os::unix::fs::symlink(target, &dst).map_err(at("symlink", &dst))?;
            } else if ft.is_dir() {
                mkdir(&dst)?;
                bind(&src, &dst)?;
                readonly.push(dst);
            }
        }
    }
    for d in OWN {
        mkdir(&new_root.join(d))?;
    }
    // /sys read-only; /workspace read-write; /tmp private.
    bind(Path::new("/sys"), &new_root.join("sys"))?;
    readonly.push(new_root.join("sys"));
    cgroup_view(spec, &new_root.join("sys/fs/cgroup"))?;
    // Hidden directories as the new root shows them (those under a directory
    // the sandbox gets its own version of are not shown anyway).
    let hidden: Vec<PathBuf> = spec
        .hide
        .iter()
        .filter_map(|h| h.strip_prefix("/").ok())
        .map(|h| new_root.join(h))
        .filter(|h| h.is_dir() && readonly.iter().any(|top| h.starts_with(top)))
        .collect();
    remount_readonly_hiding(&readonly, &hidden)?;
    for h in &hidden {
        mount_fs(
            "tmpfs",
            h,
            MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC | MountFlags::RDONLY,
            "mode=0555,size=4k",
        )?;
    }
    attach(workspace, &new_root.join("workspace"))?;
    mount_private_tmpfs(&new_root.join("tmp"), spec.tmp_bytes)?;
    // /proc of the new PID namespace, with the kernel knobs read-only.
    let proc_ = new_root.join("proc");
    mount_fs(
        "proc",
        &proc_,
        MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC,
        "",
    )?;
    proc_knobs_readonly(&proc_)?;
    // A minimal /dev.
    let dev = new_root.join("dev");
    // nodev: a node made here opens nothing (the ones bound in are mounts
    // of their own); the devices cgroup denies the rest.
    mount_fs(
        "tmpfs",
        &dev,
        MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC,
        "mode=0755,size=64k",
    )?;
    for n in ["null", "zero", "full", "random", "urandom", "tty"] {
        let p = dev.join(n);
        File::create(&p).map_err(at("create", &p))?;
        bind(&Path::new("/dev").join(n), &p)?;
    }
    for (link, target) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
        ("ptmx", "pts/ptmx"),
    ] {
        let p = dev.join(link);
        std::os::unix::fs::symlink(target, &p).map_err(at("symlink", &p))?;
    }
    let pts = dev.join("pts");
    mkdir(&pts)?;
    mount_devpts(&pts)?;
    let shm = dev.join("shm");
    mkdir(&shm)?;
    mount_private_tmpfs(&shm, spec.tmp_bytes)
}

/// What a sandbox sees at `/sys/fs/cgroup` (`at`): its own group and
/// nothing else — on v1 each hierarchy's directory of its group at
/// `/sys/fs/cgroup/CONTROLLER`, on v2 its group at `/sys/fs/cgroup` (read-only
/// with the rest of `/sys`), so programs read their limits where they look
/// for them and learn nothing of the host's other groups.
fn cgroup_view(spec: &InitSpec, at: &Path) -> Result<(), NsError> {
    if !at.is_dir() {
        return Ok(());
    }
    let groups: Vec<&Path> = spec
        .cgroup_procs
        .iter()
        .filter_map(|p| p.parent())
        .collect();
    mount_fs(
        "tmpfs",
        at,
        MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC,
        "mode=0755,size=4k",
    )?;
    let host = Path::new(crate::cgroup::DEFAULT_ROOT);
    for g in groups {
        // v1: ROOT/CONTROLLER/tine/ID; v2: ROOT/tine/ID.
        let controller = g
            .strip_prefix(host)
            .ok()
            .and_then(|r| r.components().next())
            .map(|c| c.as_os_str().to_owned())
            .filter(|c| c != crate::cgroup::PARENT);
        let dst = match controller {
            Some(c) => {
                let d = at.join(c);
                mkdir(&d)?;
                d
            }
            None => at.to_path_buf(),
        };
        bind(g, &dst)?;
    }
    Ok(())
}

/// The kernel knobs under a fresh `/proc` (`proc_`), bound read-only.
fn proc_knobs_readonly(proc_: &Path) -> Result<(), NsError> {
    let mut knobs = Vec::new();
    for p in ["sys", "sysrq-trigger", "irq", "bus"] {
        let p = proc_.join(p);
        if p.exists() {
            bind(&p, &p)?;
            knobs.push(p);
        }
    }
    remount_readonly_hiding(&knobs, &[])
}

/// A sandbox's own `/tmp` or `/dev/shm`, of at most `bytes`.
fn mount_private_tmpfs(dir: &Path, bytes: Option<u64>) -> Result<(), NsError> {
    let opts = match bytes {
        Some(b) => format!("mode=1777,size={b}"),
        None => "mode=1777".into(),
    };
    mount_fs("tmpfs", dir, MountFlags::NOSUID | MountFlags::NODEV, &opts)
}

/// A sandbox's own pseudo-terminals.
fn mount_devpts(pts: &Path) -> Result<(), NsError> {
    mount_fs(
        "devpts",
        pts,
        MountFlags::NOSUID | MountFlags::NOEXEC,
        "newinstance,ptmxmode=0666,mode=0620",
    )
}

/// Brings the loopback interface up in a new network namespace.
fn loopback_up() -> Result<(), NsError> {
    // SAFETY: plain socket/ioctl calls on a zeroed ifreq naming "lo"; the socket
    // is closed on every path.
    unsafe {
        let s = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if s < 0 {
            return Err(at("socket", "lo")(io::Error::last_os_error()));
        }
        let mut req: libc::ifreq = std::mem::zeroed();
        for (i, b) in b"lo".iter().enumerate() {
            req.ifr_name[i] = *b as libc::c_char;
        }
        let mut r = libc::ioctl(s, libc::SIOCGIFFLAGS, &mut req);
        if r == 0 {
            req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
            r = libc::ioctl(s, libc::SIOCSIFFLAGS, &req);
        }
        let err = io::Error::last_os_error();
        libc::close(s);
        if r != 0 {
            return Err(at("bring up", "lo")(err));
        }
    }
    Ok(())
}

/// Capabilities a sandbox keeps (the usual container default set, plus
/// `CHECKPOINT_RESTORE`): enough to act as root over its own files, not enough
/// to remount, load modules, trace host processes or reconfigure the network.
/// `CHECKPOINT_RESTORE` is what lets a template, forking at tine's request,
/// give the copy its origin's PID (`clone3` `set_tid`); it reaches only the
/// sandbox's own PID namespace (and `/proc/PID/map_files` of processes the
/// holder may trace anyway).
pub const KEPT_CAPABILITIES: [rustix::thread::CapabilitySet; 15] = {
    use rustix::thread::CapabilitySet as C;
    [
        C::CHOWN,
        C::DAC_OVERRIDE,
        C::FSETID,
        C::FOWNER,
        C::MKNOD,
        C::NET_RAW,
        C::SETGID,
        C::SETUID,
        C::SETFCAP,
        C::SETPCAP,
        C::NET_BIND_SERVICE,
        C::SYS_CHROOT,
        C::KILL,
        C::AUDIT_WRITE,
        C::CHECKPOINT_RESTORE,
    ]
};

/// [`KEPT_CAPABILITIES`] as a mask (a bit per capability number).
pub fn kept_capabilities() -> u64 {
    KEPT_CAPABILITIES.iter().fold(0, |a, c| a | c.bits())
}

/// What every process entering a sandbox gives up: the capabilities outside
/// the kept set, gaining privileges through exec, and (`seccomp`: a sandbox
/// that has the filter) the system calls the seccomp filter refuses.
fn lock_down(seccomp: bool) -> Result<(), NsError> {
    drop_capabilities()?;
    rustix::thread::set_no_new_privs(true).map_err(at("set no_new_privs", "self"))?;
    if seccomp {
        crate::seccomp::install()?;
    }
    Ok(())
}

/// A sandbox's init, once set up, is not dumpable: a process of the sandbox
/// (root there, but without `CAP_SYS_PTRACE`) can then neither trace it nor
/// write its memory through `/proc`, so it cannot be made to run what its
/// filter refuses or to lie to the supervisor. Its children are dumpable
/// again once they exec.
fn guard_init() -> Result<(), NsError> {
    rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable)
        .map_err(at("make not dumpable", "init"))
}

fn drop_capabilities() -> Result<(), NsError> {
    use rustix::thread::{CapabilitySet, CapabilitySets};
    let keep = KEPT_CAPABILITIES
        .iter()
        .fold(CapabilitySet::empty(), |a, c| a | *c);
    let last = tine_proc::inspect::last_cap();
    // The bounding set first (that needs SETPCAP, which is kept), so nothing
    // executed later can regain what is dropped; then this process's own sets.
    for bit in 0..=last.min(63) {
        let cap = CapabilitySet::from_bits_retain(1u64 << bit);
        if !keep.contains(cap) {
            rustix::thread::remove_capability_from_bounding_set(cap)
                .map_err(at("drop capability from the bounding set", "self"))?;
        }
    }
    rustix::thread::set_capabilities(
        None,
        CapabilitySets {
            effective: keep,
            permitted: keep,
            inheritable: CapabilitySet::empty(),
        },
    )
    .map_err(at("set capabilities", "self"))
}

/// Moves the calling process into a running sandbox: its cgroup, its IPC, UTS,
/// network, PID (for the children it starts next) and mount namespaces, then
/// `/workspace`, with the sandbox's capabilities and `no_new_privs`. The caller
/// must be single-threaded (joining a mount namespace requires it) and starts
/// the command as a child afterwards, which is then PID-namespaced too.
pub fn enter(init_pid: u32, cgroup_procs: &[PathBuf]) -> Result<(), NsError> {
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
    std::env::set_current_dir(WORKSPACE).map_err(at("enter", WORKSPACE))?;
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
fn take_root_ids() -> bool {
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
const PROCESS_OOM_SCORE_ADJ: &[u8] = b"500";

/// Raises the calling process's OOM score adjustment to
/// [`PROCESS_OOM_SCORE_ADJ`]. Async-signal-safe (open, write, close).
fn prefer_for_oom() {
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

/// Blocks the signals init handles synchronously; returns the set.
fn block_signals() -> libc::sigset_t {
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
        libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

/// Exit code for a wait status: the code, or 128 + the signal.
fn exit_code(status: libc::c_int) -> i32 {
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
            Ok(reap(&set, main, spec.held))
        }
        Err(e) => {
            if let Some(r) = ready.as_mut() {
                let _ = writeln!(r, "error: {e}");
            }
            Err(e)
        }
    }
}

fn setup_and_start(spec: &InitSpec) -> Result<(libc::sigset_t, libc::pid_t), NsError> {
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
    // The new root is built under a tmpfs over /tmp, which the sandbox replaces
    // anyway, so binding host directories never copies the new root into itself;
    // and in a directory of its own, so that mounts the tmpfs covers (still in
    // the mount table) are never mistaken for the new root's.
    mount_fs(
        "tmpfs",
        Path::new("/tmp"),
        MountFlags::NOSUID | MountFlags::NODEV,
        "mode=0700",
    )?;
    let new_root = Path::new("/tmp/.tine-root");
    mkdir(new_root)?;
    match &rootfs {
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
    build_root(spec, new_root, &workspace)?;
    let old = new_root.join(".oldroot");
    if rootfs.is_none() {
        mkdir(&old)?;
    }
    std::env::set_current_dir(new_root).map_err(at("enter", new_root))?;
    let old_rel = if rootfs.is_none() { ".oldroot" } else { "tmp" };
    rustix::process::pivot_root(".", old_rel).map_err(at("pivot_root", new_root))?;
    rustix::mount::unmount(Path::new("/").join(old_rel).as_path(), UnmountFlags::DETACH)
        .map_err(at("detach old root", "/"))?;
    if rootfs.is_none() {
        let _ = fs::remove_dir("/.oldroot");
        // The tmpfs holding the mount points becomes read-only too.
        rustix::mount::mount_remount(
            "/",
            MountFlags::BIND | MountFlags::RDONLY | MountFlags::NOSUID | MountFlags::NODEV,
            "",
        )
        .map_err(at("make read-only", "/"))?;
    }
    // (With --rootfs the old root was stacked on the private /tmp; detaching it
    // uncovered that.)
    std::env::set_current_dir(WORKSPACE).map_err(at("enter", WORKSPACE))?;
    lock_down(spec.seccomp)?;
    guard_init()?;

    let set = block_signals();
    if spec.held {
        // The first PID the namespace gives: the command's, as a copy will have it.
        return Ok((set, HELD_MAIN));
    }
    let mut cmd = std::process::Command::new(&spec.command[0]);
    cmd.args(&spec.command[1..])
        .env_clear()
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .current_dir(WORKSPACE);
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
    let child = cmd.spawn().map_err(at("start command", &spec.command[0]))?;
    Ok((set, child.id() as libc::pid_t))
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

/// What the init of a native fork reports in its status file (handed over
/// as `HANDOVER/status`; the host reads it at `SandboxDirs::init_status`):
/// one line each, in this order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Adopted {
    /// Nothing yet.
    Pending,
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

/// The init of a native fork (`tine __sandbox-adopt MAIN`): the copy of a
/// template that made these namespaces (`tine_proc::template::clone_nested`),
/// furnished from outside ([`furnish_here`]) and then made to execute this.
/// Its command, `main`, is already its child, stopped. It takes its standard
/// descriptors and status file from what was handed over, closes what it
/// kept of the template's, removes the handover, enters `/workspace`, gives
/// up its capabilities as any sandbox process does, reports ready, lets
/// `main` run, and lives as a sandbox's init does until `main` ends.
pub fn run_adopted(main: u32) -> Result<i32, NsError> {
    use std::io::Write;
    let dir = Path::new(HANDOVER);
    let status_path = dir.join("status");
    let mut status = File::options()
        .append(true)
        .open(&status_path)
        .map_err(at("open", &status_path))?;
    match adopt_setup(main, dir, &status) {
        Ok(set) => {
            let _ = status.write_all(b"ok\n");
            // SAFETY: kill(2) with a PID of this namespace and SIGCONT.
            unsafe { libc::kill(main as libc::pid_t, libc::SIGCONT) };
            let code = reap(&set, main as libc::pid_t, false);
            let _ = writeln!(status, "exit {code}");
            Ok(code)
        }
        Err(e) => {
            let _ = writeln!(status, "error: {e}");
            Err(e)
        }
    }
}

fn adopt_setup(main: u32, dir: &Path, status: &File) -> Result<libc::sigset_t, NsError> {
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
    std::env::set_current_dir(WORKSPACE).map_err(at("enter", WORKSPACE))?;
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
const HELD_MAIN: libc::pid_t = 2;

fn reap(set: &libc::sigset_t, main: libc::pid_t, start_held: bool) -> i32 {
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
        // Reap everything that exited; the command's end ends the sandbox.
        loop {
            let mut status = 0;
            // SAFETY: waitpid into a local status, non-blocking.
            let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
            if pid <= 0 {
                break;
            }
            if pid == main {
                match &mut held {
                    // Its copy takes the same PID; the next reap of it counts again.
                    Some(slot) => *slot = Some(status),
                    None => ended = Some(status),
                }
            }
        }
    }
}

/// Whether a child of this init is the init of a nested PID namespace (a
/// native fork of a process of this sandbox).
fn has_nested_children() -> bool {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes_are_undone() {
        assert_eq!(unescape("/a\\040b"), PathBuf::from("/a b"));
        assert_eq!(unescape("/x\\134y\\012"), PathBuf::from("/x\\y\n"));
        // Not an escape: kept as is, also next to non-ASCII bytes.
        assert_eq!(unescape("/é\\9z\\"), PathBuf::from("/é\\9z\\"));
    }

    #[test]
    fn an_adopted_inits_status_is_its_last_line() {
        assert_eq!(Adopted::parse(""), Adopted::Pending);
        assert_eq!(Adopted::parse("ok\n"), Adopted::Ready);
        assert_eq!(Adopted::parse("ok\nexit 3\n"), Adopted::Exited(3));
        assert_eq!(
            Adopted::parse("error: detach /tmp/.tine/x: EBUSY\n"),
            Adopted::Failed("detach /tmp/.tine/x: EBUSY".into())
        );
        // A line cut short (read while written) changes nothing.
        assert_eq!(Adopted::parse("ok\nexit 1"), Adopted::Ready);
    }

    #[test]
    fn exit_codes_follow_the_shell_convention() {
        assert_eq!(exit_code(3 << 8), 3);
        assert_eq!(exit_code(libc::SIGKILL), 128 + 9);
    }
}

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
            rustix::process::setsid().map_err(io::Error::from)?;
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

/// What [`furnish_here`] gives a process tree that was cloned into
/// namespaces of its own (`tine_proc::template::clone_nested`): the mounts,
/// name and network a sandbox has.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FurnishSpec {
    /// The tree's init (host PID).
    pub init_pid: u32,
    /// Host directory attached at `/workspace` (the fork's overlay).
    pub workspace: PathBuf,
    pub hostname: String,
    pub net: Net,
    /// Host files handed over to the tree's init, each bound at
    /// `HANDOVER/NAME` in a private `/tmp` (which the init empties before
    /// anything else runs): (host path, NAME).
    #[serde(default)]
    pub handover: Vec<(PathBuf, String)>,
    /// Who the handover directory belongs to (the root of the tree's user
    /// namespace, as the host sees it), so that its processes may enter it.
    #[serde(default)]
    pub owner: Option<(u32, u32)>,
    /// As [`InitSpec::tmp_bytes`].
    #[serde(default)]
    pub tmp_bytes: Option<u64>,
}

/// Where [`furnish_here`] puts the files it hands over ([`FurnishSpec::handover`]).
pub const HANDOVER: &str = "/tmp/.tine";

/// Furnishes the namespaces of `spec.init_pid` from outside: a `/proc` of
/// their PID namespace (made by a child of this process that is in it: proc
/// takes the PID namespace of whoever creates it; mounted from inside a
/// mount namespace its user namespace owns, it is refused as too revealing),
/// with the kernel knobs read-only; `spec.workspace` at `/workspace`; private
/// `/tmp` and `/dev/shm`; its own `/dev/pts`; the hostname; loopback up; the
/// files handed over. The mounts these replace (copies of the origin's,
/// since a new mount namespace starts as a copy) are detached first.
///
/// Forks: run it in a process of its own with no other threads
/// (`tine __sandbox-furnish`).
pub fn furnish_here(spec: &FurnishSpec) -> Result<(), NsError> {
    use rustix::thread::LinkNameSpaceType as T;
    let open = |what: &str| {
        let p = PathBuf::from(format!("/proc/{}/{what}", spec.init_pid));
        File::open(&p).map_err(at("open", &p)).map(|f| (f, p))
    };
    let (pid_ns, pid_path) = open("ns/pid")?;
    let mnt_ns = open("ns/mnt")?;
    let uts_ns = open("ns/uts")?;
    let net_ns = open("ns/net")?;
    let root = open("root")?;
    let workspace = clone_tree(&spec.workspace)?;
    let handover = spec
        .handover
        .iter()
        .map(|(host, name)| {
            if name.is_empty() || name.contains('/') || name.starts_with('.') {
                return Err(NsError::Invalid(format!("cannot hand over as {name:?}")));
            }
            Ok((clone_tree(host)?, name.as_str()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    rustix::thread::move_into_link_name_space(pid_ns.as_fd(), Some(T::ProcessID))
        .map_err(at("join namespace", &pid_path))?;
    // The child's error comes back as text on this pipe.
    let (err_r, err_w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
        .map_err(at("create pipe", "furnish"))?;
    // SAFETY: this process has no other thread (see above), so the child may
    // run ordinary code; it leaves with `exit` and never returns here.
    let child = unsafe { libc::fork() };
    if child < 0 {
        return Err(at("fork", &pid_path)(io::Error::last_os_error()));
    }
    if child == 0 {
        drop(err_r);
        let ns = (&mnt_ns, &uts_ns, &net_ns, &root);
        let code = match furnish_inside(spec, ns, &workspace, &handover) {
            Ok(()) => 0,
            Err(e) => {
                use std::io::Write;
                let _ = File::from(err_w).write_all(e.to_string().as_bytes());
                1
            }
        };
        std::process::exit(code);
    }
    drop(err_w);
    let mut message = String::new();
    {
        use std::io::Read;
        let _ = File::from(err_r).read_to_string(&mut message);
    }
    match wait(child as u32).map_err(at("wait for", &pid_path))? {
        0 => Ok(()),
        code => Err(NsError::Invalid(format!(
            "furnishing the namespaces of process {} failed ({code}): {message}",
            spec.init_pid
        ))),
    }
}

/// The part of [`furnish_here`] that runs inside the PID namespace.
type NsFiles<'a> = (
    &'a (File, PathBuf),
    &'a (File, PathBuf),
    &'a (File, PathBuf),
    &'a (File, PathBuf),
);

fn furnish_inside(
    spec: &FurnishSpec,
    (mnt_ns, uts_ns, net_ns, root): NsFiles<'_>,
    workspace: &OwnedFd,
    handover: &[(OwnedFd, &str)],
) -> Result<(), NsError> {
    use rustix::mount::{FsMountFlags, FsOpenFlags, MountAttrFlags};
    use rustix::thread::LinkNameSpaceType as T;
    let proc_ = Path::new("/proc");
    let fs = rustix::mount::fsopen("proc", FsOpenFlags::FSOPEN_CLOEXEC)
        .map_err(at("open a new filesystem", proc_))?;
    rustix::mount::fsconfig_create(&fs).map_err(at("create", proc_))?;
    let tree = rustix::mount::fsmount(
        &fs,
        FsMountFlags::FSMOUNT_CLOEXEC,
        MountAttrFlags::MOUNT_ATTR_NOSUID
            | MountAttrFlags::MOUNT_ATTR_NODEV
            | MountAttrFlags::MOUNT_ATTR_NOEXEC,
    )
    .map_err(at("make a mount of", proc_))?;
    rustix::thread::move_into_link_name_space(mnt_ns.0.as_fd(), Some(T::Mount))
        .map_err(at("join namespace", &mnt_ns.1))?;
    // Joining a mount namespace lands at its original root, not at the one
    // the sandbox pivoted into: take that from its init.
    rustix::process::fchdir(&root.0).map_err(at("enter the root of", &root.1))?;
    rustix::process::chroot(".").map_err(at("chroot into", &root.1))?;
    // The origin's, copied with the mount namespace: gone from this one
    // (the origin keeps its own), so nothing here holds them.
    for covered in ["/proc", WORKSPACE, "/tmp", "/dev/shm", "/dev/pts"] {
        let _ = rustix::mount::unmount(covered, UnmountFlags::DETACH);
    }
    attach(&tree, proc_)?;
    proc_knobs_readonly(proc_)?;
    attach(workspace, Path::new(WORKSPACE))?;
    mount_private_tmpfs(Path::new("/tmp"), spec.tmp_bytes)?;
    mount_private_tmpfs(Path::new("/dev/shm"), spec.tmp_bytes)?;
    mount_devpts(Path::new("/dev/pts"))?;
    if !handover.is_empty() {
        let dir = Path::new(HANDOVER);
        fs::create_dir(dir).map_err(at("create directory", dir))?;
        fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))
            .map_err(at("chmod", dir))?;
        if let Some((uid, gid)) = spec.owner {
            std::os::unix::fs::lchown(dir, Some(uid), Some(gid)).map_err(at("chown", dir))?;
        }
        for (tree, name) in handover {
            let p = dir.join(name);
            File::create(&p).map_err(at("create", &p))?;
            attach(tree, &p)?;
        }
    }
    rustix::thread::move_into_link_name_space(uts_ns.0.as_fd(), Some(T::HostNameAndNISDomainName))
        .map_err(at("join namespace", &uts_ns.1))?;
    rustix::system::sethostname(spec.hostname.as_bytes())
        .map_err(at("set hostname", &spec.hostname))?;
    if spec.net != Net::Host {
        rustix::thread::move_into_link_name_space(net_ns.0.as_fd(), Some(T::Network))
            .map_err(at("join namespace", &net_ns.1))?;
        loopback_up()?;
    }
    Ok(())
}
