//! tine-proc: native fork. A live process is stopped with ptrace and made to
//! fork itself (an injected `clone3`); the copy is parked stopped as a
//! template, and processes are made from it again to roll back or fork.
//! What a checkpoint must capture or refuse is read from `/proc`: the
//! descriptor table (targets, flags, offsets) and whether a fork copies the
//! process faithfully (one thread, no live children, a session leader).
//!
//! The ptrace calls go through `nix`'s safe wrappers, except the few about a
//! thread that `nix` does not wrap (its extended registers, signal mask,
//! rseq and robust list), which `raw` makes, the one module allowed `unsafe`.
#![deny(unsafe_code)]

#[cfg(target_arch = "x86_64")]
pub mod batch;
pub mod creds;
pub mod criu;
#[cfg(target_arch = "x86_64")]
pub mod dirty;
#[cfg(target_arch = "x86_64")]
pub mod fdpass;
pub mod fdtable;
#[cfg(target_arch = "x86_64")]
mod fixes;
#[cfg(target_arch = "x86_64")]
pub mod forkflags;
#[cfg(target_arch = "x86_64")]
pub mod graft;
pub mod inspect;
#[cfg(target_arch = "x86_64")]
pub mod lastpid;
pub mod layout;
pub mod memhold;
#[cfg(target_arch = "x86_64")]
mod nest;
pub mod objects;
#[cfg(target_arch = "x86_64")]
pub mod ptrace;
#[cfg(target_arch = "x86_64")]
pub mod pusher;
pub mod queued;
#[cfg(target_arch = "x86_64")]
pub mod raw;
#[cfg(target_arch = "x86_64")]
pub mod remake;
pub mod sharedwork;
#[cfg(target_arch = "x86_64")]
pub mod shares;
#[cfg(target_arch = "x86_64")]
pub mod sharing;
#[cfg(target_arch = "x86_64")]
pub mod shm;
#[cfg(target_arch = "x86_64")]
pub mod shmback;
#[cfg(target_arch = "x86_64")]
pub mod spare;
#[cfg(target_arch = "x86_64")]
pub mod template;
#[cfg(target_arch = "x86_64")]
pub mod threads;
#[cfg(target_arch = "x86_64")]
pub mod tree;
#[cfg(target_arch = "x86_64")]
pub mod treeobjects;
#[cfg(target_arch = "x86_64")]
mod unchanged;
pub mod unixdiag;

pub use fdtable::{FdEntry, FdTarget, fd_table};
pub use inspect::{NotCloneable, ProcError, Stat, cloneable, stat};
#[cfg(target_arch = "x86_64")]
pub use template::{FdFix, Respawn, Template, make_template, respawn};
