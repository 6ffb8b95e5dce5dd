//! A process's memory kept past its end: a stopped process sharing it
//! (`CLONE_VM`) holds it, so the process's exit does not tear it down —
//! killing the holder later does, off a rollback's critical path.

use nix::libc;

use crate::inspect::ProcError;
use crate::ptrace::Tracee;
use crate::template::clone_args_with;

/// Makes process `pid` (host PID) share its memory with a new process,
/// left stopped without a tracer, and leaves `pid` stopped too (for the
/// caller to kill). Returns the holder's host PID. The holder never runs:
/// the caller kills it (`SIGKILL`) once the memory may go; until then it
/// is a child of `pid` (of its reaper once `pid` is gone) that no signal
/// but `SIGKILL` moves.
pub fn hold_memory(pid: u32) -> Result<u32, ProcError> {
    let mut t = Tracee::seize(pid)?;
    // No exit signal: `pid` is never told of it (its reaper, later, is).
    let args = clone_args_with(libc::CLONE_VM as u64, 0, 0, 0);
    let holder = t.clone3(&args);
    let parked = t.park();
    let mut holder = holder?;
    let hp = holder.pid();
    // A session of its own: in `pid`'s session and group it would keep
    // `pid`'s PID in use (as their id), which its copy must take again.
    if let Err(e) = holder.syscall("setsid", libc::SYS_setsid, [0; 6]) {
        holder.kill();
        return Err(e);
    }
    holder.park()?;
    parked?;
    Ok(hp)
}
