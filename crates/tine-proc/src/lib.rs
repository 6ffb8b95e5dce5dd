//! tine-proc: the state of a live process that a checkpoint must capture or
//! refuse. This first part reads it from `/proc`: the descriptor table (what
//! each descriptor refers to, its flags and offset), and whether the process
//! can be cloned faithfully by an injected fork (one thread, no live children).
//! Attaching with ptrace and making templates build on it.
#![forbid(unsafe_code)]

pub mod fdtable;
pub mod inspect;

pub use fdtable::{FdEntry, FdTarget, fd_table};
pub use inspect::{NotCloneable, ProcError, cloneable};
