//! The root a sandbox's init builds and pivots into: the host's root (or
//! `--rootfs`) read-only, the workspace, a private `/tmp`, `/proc`, `/dev`
//! and cgroup view, the repository hidden.

use super::*;

/// Parsed line of `/proc/self/mountinfo`: the mount point.
pub(super) struct MountEntry {
    point: PathBuf,
}

pub(super) fn unescape(s: &str) -> PathBuf {
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

pub(super) fn mounts() -> Result<Vec<MountEntry>, NsError> {
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
pub(super) fn remount_readonly_below(top: &Path) -> Result<(), NsError> {
    remount_readonly_hiding(&[top.to_path_buf()], &[])
}

/// Detaches every mount at or below any of `hidden` where it may (in a user
/// namespace of its own, mounts that came from the host are locked to the
/// ones they sit on: those stay, covered by the caller), then makes every
/// mount at or below any of `tops` read-only.
pub(super) fn remount_readonly_hiding(tops: &[PathBuf], hidden: &[PathBuf]) -> Result<(), NsError> {
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
pub(super) fn readonly_recursive(path: &Path) -> Result<(), NsError> {
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

pub(super) fn mount_fs(
    fstype: &str,
    target: &Path,
    flags: MountFlags,
    data: &str,
) -> Result<(), NsError> {
    let data = CString::new(data).map_err(|_| NsError::Invalid("mount options".into()))?;
    rustix::mount::mount(fstype, target, fstype, flags, data.as_c_str())
        .map_err(at("mount", target))
}

pub(super) fn bind(src: &Path, dst: &Path) -> Result<(), NsError> {
    rustix::mount::mount_bind_recursive(src, dst).map_err(at("bind-mount", dst))
}

/// A detached copy of the mount tree at `path`, to attach after `path` is hidden.
pub(super) fn clone_tree(path: &Path) -> Result<OwnedFd, NsError> {
    rustix::mount::open_tree(
        rustix::fs::CWD,
        path,
        OpenTreeFlags::OPEN_TREE_CLONE
            | OpenTreeFlags::AT_RECURSIVE
            | OpenTreeFlags::OPEN_TREE_CLOEXEC,
    )
    .map_err(at("clone mount tree", path))
}

pub(super) fn attach(tree: &OwnedFd, target: &Path) -> Result<(), NsError> {
    rustix::mount::move_mount(
        tree.as_fd(),
        "",
        rustix::fs::CWD,
        target,
        MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
    )
    .map_err(at("attach mount", target))
}

pub(super) fn mkdir(p: &Path) -> Result<(), NsError> {
    match fs::create_dir(p) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(at("create directory", p)(e)),
    }
}

/// Top-level host entries that a sandbox gets its own version of.
pub(super) const OWN: [&str; 5] = ["proc", "sys", "dev", "tmp", "workspace"];

/// Builds the sandbox's root under `new_root` (a fresh tmpfs).
pub(super) fn build_root(
    spec: &InitSpec,
    new_root: &Path,
    workspace: &OwnedFd,
) -> Result<(), NsError> {
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
pub(super) fn cgroup_view(spec: &InitSpec, at: &Path) -> Result<(), NsError> {
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
pub(super) fn proc_knobs_readonly(proc_: &Path) -> Result<(), NsError> {
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
pub(super) fn mount_private_tmpfs(dir: &Path, bytes: Option<u64>) -> Result<(), NsError> {
    let opts = match bytes {
        Some(b) => format!("mode=1777,size={b}"),
        None => "mode=1777".into(),
    };
    mount_fs("tmpfs", dir, MountFlags::NOSUID | MountFlags::NODEV, &opts)
}

/// A sandbox's own pseudo-terminals.
pub(super) fn mount_devpts(pts: &Path) -> Result<(), NsError> {
    mount_fs(
        "devpts",
        pts,
        MountFlags::NOSUID | MountFlags::NOEXEC,
        "newinstance,ptmxmode=0666,mode=0620",
    )
}

/// Brings the loopback interface up in a new network namespace.
pub(super) fn loopback_up() -> Result<(), NsError> {
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
