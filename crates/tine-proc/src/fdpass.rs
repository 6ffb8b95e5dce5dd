//! Descriptors handed to a stopped process from outside: a socket pair is
//! made in it (injected `socketpair`), one end taken out with
//! `pidfd_getfd`, and descriptors the caller holds are sent over it with
//! `SCM_RIGHTS` and received by an injected `recvmsg`. This works across
//! namespaces and needs no permission inside the sandbox.

use std::io::IoSlice;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use nix::libc;
use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
use rustix::process::{PidfdFlags, PidfdGetfdFlags, pidfd_getfd, pidfd_open};

use crate::inspect::ProcError;
use crate::ptrace::Tracee;

/// Descriptors per message (the kernel's `SCM_MAX_FD` is 253).
const BATCH: usize = 250;

/// An open channel into a stopped process.
#[derive(Debug)]
pub struct Channel {
    host: OwnedFd,
    /// The process's end, at a number above any it is given.
    theirs: i32,
}

fn io_step(pid: u32, step: &'static str) -> impl FnOnce(std::io::Error) -> ProcError {
    move |source| ProcError::Ptrace { pid, step, source }
}

impl Channel {
    /// Opens a channel into `t`, its end at a number at least `above`.
    pub fn open(t: &mut Tracee, above: i32) -> Result<Channel, ProcError> {
        let at = t.scratch(0, &[0u8; 8])?;
        t.syscall(
            "socketpair",
            libc::SYS_socketpair,
            [
                libc::AF_UNIX as u64,
                (libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC) as u64,
                0,
                at,
                0,
                0,
            ],
        )?;
        let sv = t.peek(at, 8)?;
        let end = |i: usize| i32::from_le_bytes(sv[i..i + 4].try_into().expect("4 bytes"));
        let (theirs, ours) = (end(0), end(4));
        let pid = t.pid();
        let taken = pidfd_open(
            rustix::process::Pid::from_raw(pid as i32).ok_or(ProcError::Gone { pid })?,
            PidfdFlags::empty(),
        )
        .and_then(|p| pidfd_getfd(&p, ours, PidfdGetfdFlags::empty()))
        .map_err(|e| io_step(pid, "take a socket out (pidfd_getfd)")(e.into()));
        t.syscall("close", libc::SYS_close, [ours as u64, 0, 0, 0, 0, 0])?;
        let host = taken?;
        let moved = t.syscall(
            "fcntl(F_DUPFD_CLOEXEC)",
            libc::SYS_fcntl,
            [
                theirs as u64,
                libc::F_DUPFD_CLOEXEC as u64,
                above as u64,
                0,
                0,
                0,
            ],
        )?;
        t.syscall("close", libc::SYS_close, [theirs as u64, 0, 0, 0, 0, 0])?;
        Ok(Channel {
            host,
            theirs: moved as i32,
        })
    }

    /// The process's end.
    pub fn theirs(&self) -> i32 {
        self.theirs
    }

    /// Sends `fds` into `t`; returns the numbers they got there, in order
    /// (the lowest free ones, close-on-exec).
    pub fn pass(&self, t: &mut Tracee, fds: &[BorrowedFd<'_>]) -> Result<Vec<i32>, ProcError> {
        let mut got = Vec::with_capacity(fds.len());
        for chunk in fds.chunks(BATCH) {
            let mut space =
                vec![MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(chunk.len()))];
            let mut control = SendAncillaryBuffer::new(&mut space);
            control.push(SendAncillaryMessage::ScmRights(chunk));
            rustix::net::sendmsg(
                self.host.as_fd(),
                &[IoSlice::new(b"f")],
                &mut control,
                SendFlags::empty(),
            )
            .map_err(|e| io_step(t.pid(), "send descriptors (SCM_RIGHTS)")(e.into()))?;
            got.extend(self.receive(t, chunk.len())?);
        }
        Ok(got)
    }

    /// An injected `recvmsg` of one message carrying `n` descriptors.
    fn receive(&self, t: &mut Tracee, n: usize) -> Result<Vec<i32>, ProcError> {
        // msghdr (56) | iovec (16) | one byte (16) | control.
        let control_len = 16 + (n * 4).div_ceil(8) * 8;
        let len = 56 + 16 + 16 + control_len;
        let base = t.scratch(0, &vec![0u8; len])?;
        let (iov, byte, control) = (base + 56, base + 72, base + 88);
        let mut block = Vec::with_capacity(len);
        for w in [0u64, 0, iov, 1, control, control_len as u64, 0] {
            block.extend_from_slice(&w.to_le_bytes());
        }
        block.extend_from_slice(&byte.to_le_bytes());
        block.extend_from_slice(&1u64.to_le_bytes());
        block.resize(len, 0);
        t.poke_at(base, &block)?;
        t.syscall(
            "recvmsg",
            libc::SYS_recvmsg,
            [
                self.theirs as u64,
                base,
                libc::MSG_CMSG_CLOEXEC as u64,
                0,
                0,
                0,
            ],
        )?;
        let c = t.peek(control, control_len)?;
        let cmsg_len = u64::from_le_bytes(c[0..8].try_into().expect("8 bytes")) as usize;
        let (level, kind) = (
            i32::from_le_bytes(c[8..12].try_into().expect("4 bytes")),
            i32::from_le_bytes(c[12..16].try_into().expect("4 bytes")),
        );
        let count = cmsg_len.saturating_sub(16) / 4;
        if level != libc::SOL_SOCKET || kind != libc::SCM_RIGHTS || count != n {
            return Err(ProcError::Ptrace {
                pid: t.pid(),
                step: "receive descriptors (SCM_RIGHTS)",
                source: std::io::Error::other(format!(
                    "{count} of {n} descriptors arrived (the process's descriptor limit?)"
                )),
            });
        }
        Ok((0..n)
            .map(|i| i32::from_le_bytes(c[16 + 4 * i..20 + 4 * i].try_into().expect("4 bytes")))
            .collect())
    }

    /// Closes the process's end.
    pub fn close(self, t: &mut Tracee) -> Result<(), ProcError> {
        t.syscall(
            "close",
            libc::SYS_close,
            [self.theirs as u64, 0, 0, 0, 0, 0],
        )?;
        Ok(())
    }
}
