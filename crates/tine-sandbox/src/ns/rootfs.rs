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

/// Where a new root is put together: a directory on a fresh tmpfs over
/// `/tmp` (a mount of this namespace's own, which the sandbox's `/tmp`
/// replaces anyway), so that binding host directories never copies the new
/// root into itself and nothing is written to the root being left.
pub(super) fn root_stage() -> Result<&'static Path, NsError> {
    mount_fs(
        "tmpfs",
        Path::new("/tmp"),
        MountFlags::NOSUID | MountFlags::NODEV,
        "mode=0700",
    )?;
    let stage = Path::new("/tmp/.tine-root");
    mkdir(stage)?;
    Ok(stage)
}

/// The mount points a sandbox's own `/proc`, `/sys`, `/dev` and `/tmp` need
/// in an image's root, made (in its upper layer) where the image lacks them.
pub(super) fn image_mount_points(root: &Path) -> Result<(), NsError> {
    for d in OWN.iter().filter(|d| **d != "workspace") {
        let p = root.join(d);
        if fs::symlink_metadata(&p).is_ok_and(|m| !m.is_dir()) {
            return Err(NsError::Invalid(format!(
                "the image's /{d} is not a directory; a sandbox mounts its own there"
            )));
        }
        mkdir(&p)?;
    }
    Ok(())
}

/// Top-level host entries that a sandbox gets its own version of.
pub(super) const OWN: [&str; 5] = ["proc", "sys", "dev", "tmp", "workspace"];

/// A top-level entry of the host's root, as building a root treats it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum TopEntry {
    /// Bound read-only.
    Dir,
    /// Made again with the same target (`/bin -> usr/bin`).
    Symlink(PathBuf),
    /// Left out (a file at the top).
    Other,
}

/// The calls that build a sandbox's root, one method each, so that what the
/// root holds (bound, read-only, hidden, private) is unit-tested without
/// root: [`Kernel`] makes them, the tests record them.
pub(super) trait RootOps {
    /// The host root's top-level entries.
    fn host_top(&mut self) -> Result<Vec<(std::ffi::OsString, TopEntry)>, NsError>;
    fn is_dir(&mut self, p: &Path) -> bool;
    fn mkdir(&mut self, p: &Path) -> Result<(), NsError>;
    fn symlink(&mut self, target: &Path, p: &Path) -> Result<(), NsError>;
    fn create_file(&mut self, p: &Path) -> Result<(), NsError>;
    fn bind(&mut self, src: &Path, dst: &Path) -> Result<(), NsError>;
    fn mount_fs(
        &mut self,
        fstype: &str,
        target: &Path,
        flags: MountFlags,
        data: &str,
    ) -> Result<(), NsError>;
    /// The workspace's mount tree, handed over, attached at `target`.
    fn attach_workspace(&mut self, target: &Path) -> Result<(), NsError>;
    /// [`remount_readonly_hiding`].
    fn readonly_hiding(&mut self, tops: &[PathBuf], hidden: &[PathBuf]) -> Result<(), NsError>;
    /// [`cgroup_view`].
    fn cgroup_view(&mut self, spec: &InitSpec, at: &Path) -> Result<(), NsError>;
    /// [`proc_knobs_readonly`].
    fn proc_knobs_readonly(&mut self, proc_: &Path) -> Result<(), NsError>;
}

/// The real calls; `workspace` is the workspace's detached mount tree.
pub(super) struct Kernel<'a> {
    pub workspace: &'a OwnedFd,
}

impl RootOps for Kernel<'_> {
    fn host_top(&mut self) -> Result<Vec<(std::ffi::OsString, TopEntry)>, NsError> {
        let mut out = Vec::new();
        for e in fs::read_dir("/").map_err(at("list", "/"))? {
            let e = e.map_err(at("list", "/"))?;
            let src = Path::new("/").join(e.file_name());
            let ft = e.file_type().map_err(at("stat", &src))?;
            let kind = if ft.is_symlink() {
                TopEntry::Symlink(fs::read_link(&src).map_err(at("read link", &src))?)
            } else if ft.is_dir() {
                TopEntry::Dir
            } else {
                TopEntry::Other
            };
            out.push((e.file_name(), kind));
        }
        Ok(out)
    }
    fn is_dir(&mut self, p: &Path) -> bool {
        p.is_dir()
    }
    fn mkdir(&mut self, p: &Path) -> Result<(), NsError> {
        mkdir(p)
    }
    fn symlink(&mut self, target: &Path, p: &Path) -> Result<(), NsError> {
        std::os::unix::fs::symlink(target, p).map_err(at("symlink", p))
    }
    fn create_file(&mut self, p: &Path) -> Result<(), NsError> {
        File::create(p).map(drop).map_err(at("create", p))
    }
    fn bind(&mut self, src: &Path, dst: &Path) -> Result<(), NsError> {
        bind(src, dst)
    }
    fn mount_fs(
        &mut self,
        fstype: &str,
        target: &Path,
        flags: MountFlags,
        data: &str,
    ) -> Result<(), NsError> {
        mount_fs(fstype, target, flags, data)
    }
    fn attach_workspace(&mut self, target: &Path) -> Result<(), NsError> {
        attach(self.workspace, target)
    }
    fn readonly_hiding(&mut self, tops: &[PathBuf], hidden: &[PathBuf]) -> Result<(), NsError> {
        remount_readonly_hiding(tops, hidden)
    }
    fn cgroup_view(&mut self, spec: &InitSpec, at: &Path) -> Result<(), NsError> {
        cgroup_view(spec, at)
    }
    fn proc_knobs_readonly(&mut self, proc_: &Path) -> Result<(), NsError> {
        proc_knobs_readonly(proc_)
    }
}

/// The device nodes a sandbox's `/dev` holds, bound from the host's.
pub(super) const DEV_NODES: [&str; 6] = ["null", "zero", "full", "random", "urandom", "tty"];

/// Builds the sandbox's root under `new_root` (a fresh tmpfs).
pub(super) fn build_root(
    spec: &InitSpec,
    new_root: &Path,
    ops: &mut dyn RootOps,
) -> Result<(), NsError> {
    let mut readonly = Vec::new();
    // An image's root is the workspace itself: nothing of the host's is bound.
    let image = spec.image.is_some();
    if spec.rootfs.is_none() && !image {
        // The host's top-level entries, each bound read-only (directories) or
        // recreated (symlinks such as /bin -> usr/bin).
        for (name, kind) in ops.host_top()? {
            if OWN.iter().any(|o| OsStr::new(o) == name) || name == "lost+found" {
                continue;
            }
            let src = Path::new("/").join(&name);
            let dst = new_root.join(&name);
            match kind {
                TopEntry::Symlink(target) => ops.symlink(&target, &dst)?,
                TopEntry::Dir => {
                    ops.mkdir(&dst)?;
                    ops.bind(&src, &dst)?;
                    readonly.push(dst);
                }
                TopEntry::Other => {}
            }
        }
    }
    for d in OWN.iter().filter(|d| !(image && **d == "workspace")) {
        ops.mkdir(&new_root.join(d))?;
    }
    // /sys read-only; /workspace read-write; /tmp private.
    ops.bind(Path::new("/sys"), &new_root.join("sys"))?;
    readonly.push(new_root.join("sys"));
    ops.cgroup_view(spec, &new_root.join("sys/fs/cgroup"))?;
    // Hidden directories as the new root shows them (those under a directory
    // the sandbox gets its own version of are not shown anyway).
    let hidden: Vec<PathBuf> = spec
        .hide
        .iter()
        .filter_map(|h| h.strip_prefix("/").ok())
        .map(|h| new_root.join(h))
        .filter(|h| readonly.iter().any(|top| h.starts_with(top)))
        .filter(|h| ops.is_dir(h))
        .collect();
    ops.readonly_hiding(&readonly, &hidden)?;
    for h in &hidden {
        ops.mount_fs(
            "tmpfs",
            h,
            MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC | MountFlags::RDONLY,
            "mode=0555,size=4k",
        )?;
    }
    if !image {
        ops.attach_workspace(&new_root.join("workspace"))?;
    }
    let (flags, opts) = private_tmpfs(spec.tmp_bytes);
    ops.mount_fs("tmpfs", &new_root.join("tmp"), flags, &opts)?;
    // /proc of the new PID namespace, with the kernel knobs read-only.
    let proc_ = new_root.join("proc");
    ops.mount_fs(
        "proc",
        &proc_,
        MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC,
        "",
    )?;
    ops.proc_knobs_readonly(&proc_)?;
    // A minimal /dev.
    let dev = new_root.join("dev");
    // nodev: a node made here opens nothing (the ones bound in are mounts
    // of their own); the devices cgroup denies the rest.
    ops.mount_fs(
        "tmpfs",
        &dev,
        MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC,
        "mode=0755,size=64k",
    )?;
    for n in DEV_NODES {
        let p = dev.join(n);
        ops.create_file(&p)?;
        ops.bind(&Path::new("/dev").join(n), &p)?;
    }
    for (link, target) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
        ("ptmx", "pts/ptmx"),
    ] {
        ops.symlink(Path::new(target), &dev.join(link))?;
    }
    let pts = dev.join("pts");
    ops.mkdir(&pts)?;
    ops.mount_fs("devpts", &pts, DEVPTS.0, DEVPTS.1)?;
    let shm = dev.join("shm");
    ops.mkdir(&shm)?;
    ops.mount_fs("tmpfs", &shm, flags, &opts)
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
    let (flags, opts) = private_tmpfs(bytes);
    mount_fs("tmpfs", dir, flags, &opts)
}

/// The flags and options of a private `/tmp` or `/dev/shm` of at most `bytes`.
pub(super) fn private_tmpfs(bytes: Option<u64>) -> (MountFlags, String) {
    let opts = match bytes {
        Some(b) => format!("mode=1777,size={b}"),
        None => "mode=1777".into(),
    };
    (MountFlags::NOSUID | MountFlags::NODEV, opts)
}

/// A sandbox's own pseudo-terminals.
pub(super) fn mount_devpts(pts: &Path) -> Result<(), NsError> {
    mount_fs("devpts", pts, DEVPTS.0, DEVPTS.1)
}

/// A sandbox's own instance of devpts: its flags and options.
pub(super) const DEVPTS: (MountFlags, &str) = (
    MountFlags::NOSUID.union(MountFlags::NOEXEC),
    "newinstance,ptmxmode=0666,mode=0620",
);

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

#[cfg(test)]
mod tests {
    use super::*;

    /// Records what building a root asks for, as text; the host's root is
    /// `usr` and `etc` (directories), `bin -> usr/bin`, a file `swapfile`,
    /// and the directories a sandbox gets its own of.
    #[derive(Default)]
    struct Recorder {
        calls: Vec<String>,
        dirs: Vec<PathBuf>,
    }

    fn flags(f: MountFlags) -> String {
        let mut out = Vec::new();
        for (flag, name) in [
            (MountFlags::RDONLY, "ro"),
            (MountFlags::NOSUID, "nosuid"),
            (MountFlags::NODEV, "nodev"),
            (MountFlags::NOEXEC, "noexec"),
        ] {
            if f.contains(flag) {
                out.push(name);
            }
        }
        out.join(",")
    }

    impl Recorder {
        fn record(&mut self, call: String) -> Result<(), NsError> {
            self.calls.push(call);
            Ok(())
        }
    }

    impl RootOps for Recorder {
        fn host_top(&mut self) -> Result<Vec<(std::ffi::OsString, TopEntry)>, NsError> {
            Ok([
                ("usr", TopEntry::Dir),
                ("etc", TopEntry::Dir),
                ("var", TopEntry::Dir),
                ("bin", TopEntry::Symlink("usr/bin".into())),
                ("swapfile", TopEntry::Other),
                ("proc", TopEntry::Dir),
                ("tmp", TopEntry::Dir),
                ("dev", TopEntry::Dir),
                ("lost+found", TopEntry::Dir),
            ]
            .into_iter()
            .map(|(n, k)| (n.into(), k))
            .collect())
        }
        fn is_dir(&mut self, p: &Path) -> bool {
            self.dirs.iter().any(|d| d == p)
        }
        fn mkdir(&mut self, p: &Path) -> Result<(), NsError> {
            self.record(format!("mkdir {}", p.display()))
        }
        fn symlink(&mut self, target: &Path, p: &Path) -> Result<(), NsError> {
            self.record(format!("symlink {} -> {}", p.display(), target.display()))
        }
        fn create_file(&mut self, p: &Path) -> Result<(), NsError> {
            self.record(format!("create {}", p.display()))
        }
        fn bind(&mut self, src: &Path, dst: &Path) -> Result<(), NsError> {
            self.record(format!("bind {} {}", src.display(), dst.display()))
        }
        fn mount_fs(
            &mut self,
            fstype: &str,
            target: &Path,
            f: MountFlags,
            data: &str,
        ) -> Result<(), NsError> {
            self.record(format!(
                "mount {fstype} {} {} {data}",
                target.display(),
                flags(f)
            ))
        }
        fn attach_workspace(&mut self, target: &Path) -> Result<(), NsError> {
            self.record(format!("workspace {}", target.display()))
        }
        fn readonly_hiding(&mut self, tops: &[PathBuf], hidden: &[PathBuf]) -> Result<(), NsError> {
            let list = |v: &[PathBuf]| {
                v.iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(" ")
            };
            self.record(format!("readonly {} hiding {}", list(tops), list(hidden)))
        }
        fn cgroup_view(&mut self, _: &InitSpec, at: &Path) -> Result<(), NsError> {
            self.record(format!("cgroup view {}", at.display()))
        }
        fn proc_knobs_readonly(&mut self, proc_: &Path) -> Result<(), NsError> {
            self.record(format!("proc knobs readonly {}", proc_.display()))
        }
    }

    fn spec(rootfs: Option<&str>) -> InitSpec {
        serde_json::from_value(serde_json::json!({
            "workspace": "/repo/sandboxes/x/merged",
            "rootfs": rootfs,
            "hostname": "x",
            "net": "none",
            "command": ["sh"],
            "env": [],
            "cgroup_procs": [],
            "hide": ["/var/lib/repo", "/tmp/elsewhere", "/var/absent"],
            "tmp_bytes": 1048576,
        }))
        .unwrap()
    }

    fn built(spec: &InitSpec) -> Vec<String> {
        let mut r = Recorder {
            dirs: vec![
                PathBuf::from("/n/var/lib/repo"),
                PathBuf::from("/n/tmp/elsewhere"),
            ],
            ..Recorder::default()
        };
        build_root(spec, Path::new("/n"), &mut r).unwrap();
        r.calls
    }

    fn at(calls: &[String], call: &str) -> usize {
        calls
            .iter()
            .position(|c| c == call)
            .unwrap_or_else(|| panic!("no `{call}` in {calls:#?}"))
    }

    #[test]
    fn the_hosts_directories_are_bound_read_only_and_the_repository_is_hidden() {
        let calls = built(&spec(None));
        for d in ["usr", "etc", "var"] {
            at(&calls, &format!("bind /{d} /n/{d}"));
        }
        at(&calls, "symlink /n/bin -> usr/bin");
        // What the sandbox gets its own of, files and lost+found: not bound.
        for d in ["proc", "tmp", "dev", "swapfile", "lost+found"] {
            assert!(
                !calls.iter().any(|c| c.starts_with(&format!("bind /{d} "))),
                "{d}: {calls:#?}"
            );
        }
        // One read-only pass over every bound host directory and /sys, which
        // also detaches what is below the repository (a hidden path outside
        // them, or absent, is left alone).
        let ro = at(
            &calls,
            "readonly /n/usr /n/etc /n/var /n/sys hiding /n/var/lib/repo",
        );
        let cover = at(
            &calls,
            "mount tmpfs /n/var/lib/repo ro,nosuid,nodev,noexec mode=0555,size=4k",
        );
        assert!(ro < cover, "{calls:#?}");
        // What is writable comes after the read-only pass, so it stays writable.
        for writable in [
            "workspace /n/workspace",
            "mount tmpfs /n/tmp nosuid,nodev mode=1777,size=1048576",
            "mount tmpfs /n/dev/shm nosuid,nodev mode=1777,size=1048576",
        ] {
            assert!(ro < at(&calls, writable), "{writable}: {calls:#?}");
        }
        at(&calls, "bind /sys /n/sys");
        at(&calls, "cgroup view /n/sys/fs/cgroup");
        at(&calls, "mount proc /n/proc nosuid,nodev,noexec ");
        at(&calls, "proc knobs readonly /n/proc");
    }

    #[test]
    fn dev_holds_the_usual_nodes_only_on_a_nodev_tmpfs() {
        let calls = built(&spec(None));
        let dev = at(
            &calls,
            "mount tmpfs /n/dev nosuid,nodev,noexec mode=0755,size=64k",
        );
        let bound: Vec<&String> = calls
            .iter()
            .filter(|c| c.starts_with("bind /dev/"))
            .collect();
        assert_eq!(
            bound,
            DEV_NODES
                .iter()
                .map(|n| format!("bind /dev/{n} /n/dev/{n}"))
                .collect::<Vec<_>>()
                .iter()
                .collect::<Vec<_>>()
        );
        for n in DEV_NODES {
            assert!(dev < at(&calls, &format!("create /n/dev/{n}")));
        }
        at(
            &calls,
            "mount devpts /n/dev/pts nosuid,noexec newinstance,ptmxmode=0666,mode=0620",
        );
        at(&calls, "symlink /n/dev/ptmx -> pts/ptmx");
        // No other device node is made: only files, links and directories.
        assert!(!calls.iter().any(|c| c.contains("mknod")), "{calls:#?}");
    }

    #[test]
    fn with_a_rootfs_no_host_directory_is_bound() {
        let calls = built(&spec(Some("/images/debian")));
        assert!(
            !calls
                .iter()
                .any(|c| c.starts_with("bind /usr") || c.starts_with("symlink /n/bin")),
            "{calls:#?}"
        );
        // Only /sys is made read-only, and nothing there is to hide.
        at(&calls, "readonly /n/sys hiding ");
        at(&calls, "workspace /n/workspace");
    }

    #[test]
    fn an_images_root_binds_nothing_of_the_hosts_and_has_no_workspace_mount() {
        let mut s = spec(None);
        s.image = Some(ImageRoot {
            image: "sha256:00".into(),
            workdir: "/app".into(),
            uid: 1000,
            gid: 1000,
        });
        let calls = built(&s);
        assert!(
            !calls.iter().any(|c| c.starts_with("bind /usr")
                || c.starts_with("bind /etc")
                || c.starts_with("symlink /n/bin")
                || c.starts_with("workspace ")
                || c == "mkdir /n/workspace"),
            "{calls:#?}"
        );
        // Its own /proc, /dev, /tmp and a read-only /sys all the same.
        at(&calls, "bind /sys /n/sys");
        at(&calls, "mount proc /n/proc nosuid,nodev,noexec ");
        at(
            &calls,
            "mount tmpfs /n/tmp nosuid,nodev mode=1777,size=1048576",
        );
        at(
            &calls,
            "mount devpts /n/dev/pts nosuid,noexec newinstance,ptmxmode=0666,mode=0620",
        );
    }
}
