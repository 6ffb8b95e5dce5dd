//! What a sandbox's processes keep: the container's capabilities, in their
//! own user namespace only, with `no_new_privs` and the seccomp filter.

use super::*;

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
pub(super) fn lock_down(seccomp: bool) -> Result<(), NsError> {
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
pub(super) fn guard_init() -> Result<(), NsError> {
    rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable)
        .map_err(at("make not dumpable", "init"))
}

pub(super) fn drop_capabilities() -> Result<(), NsError> {
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
