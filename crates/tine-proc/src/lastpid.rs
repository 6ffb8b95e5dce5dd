//! The next PID of a PID namespace, set from inside it. `clone3` picks a
//! PID (`set_tid`) only for a caller holding `CAP_CHECKPOINT_RESTORE` over
//! the namespace: a copy made by a process that runs as another user (a
//! database server's postmaster, as `postgres`) cannot. Instead the
//! namespace's `ns_last_pid` is set to the PID before the wanted one, by a
//! process of the namespace that holds the capability (its init, held
//! here), and the copy is made by a plain fork. The file is opened here, in
//! the host's `/proc` (a sandbox's `/proc/sys` is read-only), and handed to
//! the holder: the kernel takes the namespace and the capability from the
//! writer.

use std::fs::File;
use std::os::fd::AsFd;

use nix::libc;

use crate::fdpass::Channel;
use crate::inspect::ProcError;
use crate::ptrace::Tracee;

const NS_LAST_PID: &str = "/proc/sys/kernel/ns_last_pid";

/// A holder of the namespace, stopped, with `ns_last_pid` open.
#[derive(Debug)]
pub struct NextPid {
    holder: Option<Tracee>,
    fd: u64,
}

impl NextPid {
    /// Hands `ns_last_pid` to `holder` (stopped; a process of the PID
    /// namespace whose PIDs are to be set, with the capability there).
    pub fn new(mut holder: Tracee) -> Result<NextPid, ProcError> {
        let file = File::options()
            .write(true)
            .open(NS_LAST_PID)
            .map_err(|e| ProcError::read(holder.pid(), std::path::Path::new(NS_LAST_PID), e))?;
        let ch = Channel::open(&mut holder, 3)?;
        let got = ch.pass(&mut holder, &[file.as_fd()]);
        ch.close(&mut holder)?;
        let fd = got?[0] as u64;
        Ok(NextPid {
            holder: Some(holder),
            fd,
        })
    }

    /// The holder back, the file closed in it.
    pub fn into_holder(mut self) -> Result<Tracee, ProcError> {
        let mut h = self.holder.take().expect("held until taken");
        h.syscall("close", libc::SYS_close, [self.fd, 0, 0, 0, 0, 0])?;
        Ok(h)
    }

    /// The namespace's next new process gets `pid` (if it is free).
    pub fn set(&mut self, pid: u32) -> Result<(), ProcError> {
        let text = pid.saturating_sub(1).to_string();
        let h = self.holder.as_mut().expect("held until taken");
        let at = h.scratch(0, text.as_bytes())?;
        h.syscall(
            "pwrite64(ns_last_pid)",
            libc::SYS_pwrite64,
            [self.fd, at, text.len() as u64, 0, 0, 0],
        )?;
        Ok(())
    }
}

impl Drop for NextPid {
    fn drop(&mut self) {
        if let Some(h) = &mut self.holder {
            let _ = h.syscall("close", libc::SYS_close, [self.fd, 0, 0, 0, 0, 0]);
        }
    }
}
