//! tine-sandbox: what a live sandbox is made of. Control groups (v1 and v2,
//! detected at run time) for limits, freezing and membership; namespaces,
//! overlay workspaces, the supervisor, and the process state of snapshots
//! (templates by native fork, `processes`); the seccomp filter and
//! `--net private`'s network helper; the disk limit (`quota`). Unsafe code
//! lives only in `ns` (clone, signals, ioctl), `criu` and `slirp`
//! (descriptors handed to a helper before exec), `quota` (its ioctl and
//! `quotactl_fd`) and `devices_bpf` (the `bpf` system call), each block with
//! a SAFETY comment.
//!
//! Kernel-facing code takes the filesystem root it works on (`/sys/fs/cgroup`),
//! so tests run it against a fake tree in a temporary directory.
#![deny(unsafe_code)]

pub mod cgroup;
pub mod criu;
pub mod devices_bpf;
pub mod manager;
pub mod nested;
pub mod ns;
pub mod overlay;
pub mod processes;
pub mod quota;
pub mod rollback_mark;
pub mod seccomp;
pub mod slirp;
pub mod supervisor;
pub mod watch;

pub use cgroup::{Cgroup, CgroupError, CgroupRoot, CgroupVersion, Limits};
pub use manager::{RunOptions, SandboxError, SandboxView};
pub use ns::{DEFAULT_PATH, InitSpec, Net, NsError, WORKSPACE};
pub use overlay::{Overlay, OverlayError, UpperEntry};
pub use supervisor::{Isolation, Restart, RunSpec, SandboxDirs};
