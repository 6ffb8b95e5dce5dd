//! Namespaces: a sandbox's init started in new user, mount, PID, UTS, IPC
//! (and optionally network) namespaces, and what it does inside them. One
//! job per file: `spawn` (the clone and the exec of `tine __sandbox-init`),
//! `rootfs` (the root it builds and pivots into), `caps` (what its processes
//! keep), `init` (PID 1: the command, signals, orphans), `enter` (`tine
//! exec`), `adopt` (a native fork's init), `furnish` (a fork's namespaces
//! furnished from outside), `pty` (terminals), `pipes` (commands on pipes); the shared types here.
#![allow(unsafe_code)]

mod adopt;
mod caps;
mod enter;
mod furnish;
mod init;
mod pipes;
mod pty;
mod rootfs;
mod spawn;

pub use adopt::*;
pub use caps::*;
pub use enter::*;
pub use furnish::*;
pub use init::*;
pub use pipes::*;
pub use pty::*;
use rootfs::*;
pub use spawn::*;

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

/// A sandbox whose whole root is its workspace: an image's root
/// filesystem (its top layer's snapshot as the lower layer, the sandbox's
/// upper layer over it), mounted read-write at `/`, with no `/workspace`
/// and nothing of the host's. Its programs start where and as whom the
/// image says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageRoot {
    /// The image's id (`sha256:HEX` of its configuration).
    pub image: String,
    /// Where its commands start (an absolute path in the image).
    pub workdir: String,
    /// Who they run as, inside the sandbox's user namespace.
    pub uid: u32,
    pub gid: u32,
}

impl ImageRoot {
    /// Where commands start: `workdir` when the root has it, else `/`.
    pub fn start_dir(&self) -> &str {
        if Path::new(&self.workdir).is_dir() {
            &self.workdir
        } else {
            "/"
        }
    }
}

/// Where a sandbox's commands start: its image's working directory, or
/// `/workspace`.
pub fn start_dir(image: Option<&ImageRoot>) -> &str {
    image.map_or(WORKSPACE, ImageRoot::start_dir)
}

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

    /// The range as scans and restores of a sandbox's files take it.
    pub fn map(&self) -> tine_fs::IdMap {
        tine_fs::IdMap {
            host_uid: self.host_uid,
            host_gid: self.host_gid,
            count: self.count,
        }
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
    /// The workspace is the whole root (an image's): see [`ImageRoot`].
    #[serde(default)]
    pub image: Option<ImageRoot>,
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
        assert_eq!(Adopted::parse("held\n"), Adopted::Held);
        assert_eq!(Adopted::parse("held\nok\n"), Adopted::Ready);
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
