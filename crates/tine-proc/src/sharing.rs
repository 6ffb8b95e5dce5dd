//! A native fork's own template that shares its source template's memory
//! instead of holding a copy: made by the fork's init while that still
//! shares the source's memory (`CLONE_VM`, see [`crate::template::Nested`]),
//! then grafted with the fork's process's descriptors, directory, signal
//! dispositions and thread state, no page copied. A fork made so costs one
//! copy of the page tables (its process) instead of two.

use crate::inspect::{ProcError, stat};
use crate::ptrace::Tracee;
use crate::template::{CLONE_VM, Session, Template, Unsettled, clone_args, origin_state};

/// Makes the fork's template of `p` (the fork's copy of `source`, fixed and
/// stopped; its other threads stopped in `threads`) from `init`, the fork's
/// init, which must still share `source`'s memory: a child of `init`
/// sharing that memory, holding `p`'s descriptors, state and credentials
/// (no capability outside `keep_caps`). `Ok(None)`: it
/// cannot be made so (shared memory to copy, a layout or inherited state
/// that differs from `p`'s): make it by a fork. Injections into `init` and
/// the template write below `source`'s stack: the caller holds what
/// serializes those. On an error nothing is left behind; `p` is not changed.
pub fn share(
    init: &mut Tracee,
    source: &Template,
    p: &mut Tracee,
    threads: &mut [Tracee],
    flags: Option<&crate::forkflags::Scan>,
    keep_caps: u64,
) -> Result<Option<(Template, Unsettled)>, ProcError> {
    let _here = crate::ptrace::hold_here();
    let shares = crate::raw::same_memory(init.pid(), source.pid).unwrap_or(false);
    if !shares || !source.shm.is_empty() || !same_maps(source.pid, p.pid()) {
        return Ok(None);
    }
    let o = origin_state(p, threads, flags, None)?;
    if !o.shm.is_empty() {
        return Ok(None);
    }
    // What `p` runs as (given back to it when it was made): the template's too.
    let creds = crate::creds::Credentials::of(p.pid())?;
    let bits = crate::creds::securebits(p)?;
    let mut child = init.clone3(&clone_args(CLONE_VM, 0, 0))?;
    child.set_saved_regs(*init.saved_regs());
    let made = (|| {
        creds.give(&mut child, bits, keep_caps)?;
        let mine = crate::spare::inherited(p.pid());
        if mine.is_none() || mine != crate::spare::inherited(child.pid()) {
            return Ok(None);
        }
        // Nothing to copy: its memory is the checkpoint's already.
        let dumpable = crate::spare::graft_into(
            p,
            &mut child,
            &o,
            &crate::dirty::Ranges::new(),
            &crate::fdtable::FdInfos::default(),
        )?;
        Ok(Some((dumpable, stat(child.pid())?.start_time)))
    })();
    match made {
        Ok(Some((dumpable, start))) => {
            // A copy made from it forks this memory: as long as `source`'s.
            let tpl = o.template(&mut child, start, p, dumpable, source.fork_us);
            Ok(Some((tpl, Unsettled::new(child, Session::Needed))))
        }
        Ok(None) => {
            child.kill();
            Ok(None)
        }
        Err(e) => {
            child.kill();
            Err(e)
        }
    }
}

/// Whether processes `a` and `b` have the same mappings (ranges,
/// protections, offsets and files): the graft then changes none.
fn same_maps(a: u32, b: u32) -> bool {
    let maps = |pid: u32| std::fs::read_to_string(format!("/proc/{pid}/maps")).ok();
    matches!((maps(a), maps(b)), (Some(x), Some(y)) if x == y)
}
