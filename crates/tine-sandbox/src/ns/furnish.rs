//! Furnishing a native fork's namespaces from outside (`tine
//! __sandbox-furnish`): its mounts, `/proc`, workspace and handover.

use super::*;

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
    /// The workspace is the whole root (an image's, [`ImageRoot`]): it
    /// replaces the origin's root instead of its `/workspace`.
    #[serde(default)]
    pub image_root: bool,
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
pub(super) type NsFiles<'a> = (
    &'a (File, PathBuf),
    &'a (File, PathBuf),
    &'a (File, PathBuf),
    &'a (File, PathBuf),
);

pub(super) fn furnish_inside(
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
    if spec.image_root {
        swap_root(workspace)?;
    }
    attach(&tree, proc_)?;
    proc_knobs_readonly(proc_)?;
    if !spec.image_root {
        attach(workspace, Path::new(WORKSPACE))?;
    }
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
            // Only the logs and the status are written through; the host's
            // programs and libraries handed over (tine, its loader) are
            // bound read-only.
            if !matches!(*name, "stdout" | "stderr" | "status") {
                readonly_recursive(&p)?;
            }
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

/// Makes the fork's own overlay (`workspace`, the whole root of an image's
/// sandbox) the root of this mount namespace in place of the origin's, with
/// the origin's `/dev` and `/sys` mounts (binds of the host's nodes, read-only)
/// bound onto it; the origin's root is detached. `pivot_root` moves every
/// process of the namespace whose root was the old one (the fork's init and
/// its first process, cloned already); the copies made after find their
/// files, working directories and descriptors' paths in the new root.
fn swap_root(workspace: &OwnedFd) -> Result<(), NsError> {
    let stage = root_stage()?;
    attach(workspace, stage)?;
    image_mount_points(stage)?;
    // (Bound, not moved: mounts that came from the host are locked to the
    // ones they sit on, and a recursive bind takes them along.)
    for d in ["dev", "sys"] {
        bind(&Path::new("/").join(d), &stage.join(d))?;
    }
    readonly_recursive(&stage.join("sys"))?;
    rustix::process::chdir(stage).map_err(at("enter", stage))?;
    // The old root stacks on the new one and is detached from there.
    rustix::process::pivot_root(".", ".").map_err(at("pivot_root", stage))?;
    rustix::mount::unmount(".", UnmountFlags::DETACH).map_err(at("detach old root", "/"))?;
    rustix::process::chdir("/").map_err(at("enter", "/"))
}
