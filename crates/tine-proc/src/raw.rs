//! The ptrace requests and system calls about a thread that `nix` has no
//! safe wrapper for — its extended register state (`NT_X86_XSTATE`), its
//! signal mask, its rseq registration, its robust futex list — called
//! through `libc`, each on a buffer of the size the kernel documents.
#![allow(unsafe_code)]

use std::io;

use nix::libc;

/// `NT_X86_XSTATE` (include/uapi/linux/elf.h).
const NT_X86_XSTATE: libc::c_int = 0x202;
/// Room for the largest XSAVE area of current x86-64 CPUs (AVX-512, AMX
/// tiles need 11 KiB); the kernel says how much it used.
const XSTATE_MAX: usize = 16 << 10;

fn ok(r: libc::c_long) -> io::Result<libc::c_long> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// The extended register state (FPU, SSE, AVX, ...) of stopped tracee `tid`.
pub fn get_xstate(tid: u32) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; XSTATE_MAX];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: PTRACE_GETREGSET writes at most `iov_len` bytes into `buf`,
    // which outlives the call, and updates `iov_len` to what it wrote.
    ok(unsafe {
        libc::ptrace(
            libc::PTRACE_GETREGSET,
            tid as libc::pid_t,
            NT_X86_XSTATE as usize as *mut libc::c_void,
            (&mut iov as *mut libc::iovec).cast::<libc::c_void>(),
        )
    })?;
    buf.truncate(iov.iov_len.min(XSTATE_MAX));
    Ok(buf)
}

/// Sets the extended register state of stopped tracee `tid`.
pub fn set_xstate(tid: u32, state: &[u8]) -> io::Result<()> {
    let mut buf = state.to_vec();
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: PTRACE_SETREGSET reads `iov_len` bytes from `buf`, which
    // outlives the call.
    ok(unsafe {
        libc::ptrace(
            libc::PTRACE_SETREGSET,
            tid as libc::pid_t,
            NT_X86_XSTATE as usize as *mut libc::c_void,
            (&mut iov as *mut libc::iovec).cast::<libc::c_void>(),
        )
    })?;
    Ok(())
}

/// The signal mask of stopped tracee `tid` (a bit per signal, bit 0 is signal 1).
pub fn get_sigmask(tid: u32) -> io::Result<u64> {
    let mut mask: u64 = 0;
    // SAFETY: PTRACE_GETSIGMASK writes `data` = 8 bytes (the kernel's
    // sigset_t) into `mask`.
    ok(unsafe {
        libc::ptrace(
            libc::PTRACE_GETSIGMASK,
            tid as libc::pid_t,
            std::mem::size_of::<u64>(),
            (&mut mask as *mut u64).cast::<libc::c_void>(),
        )
    })?;
    Ok(mask)
}

/// Sets the signal mask of stopped tracee `tid`.
pub fn set_sigmask(tid: u32, mask: u64) -> io::Result<()> {
    let mut mask = mask;
    // SAFETY: PTRACE_SETSIGMASK reads 8 bytes from `mask`.
    ok(unsafe {
        libc::ptrace(
            libc::PTRACE_SETSIGMASK,
            tid as libc::pid_t,
            std::mem::size_of::<u64>(),
            (&mut mask as *mut u64).cast::<libc::c_void>(),
        )
    })?;
    Ok(())
}

/// A thread's rseq registration (`struct ptrace_rseq_configuration`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(C)]
pub struct RseqConfig {
    pub abi_pointer: u64,
    pub abi_size: u32,
    pub signature: u32,
    pub flags: u32,
    pad: u32,
}

/// The rseq registration of stopped tracee `tid` (`abi_pointer` 0: none).
pub fn get_rseq(tid: u32) -> io::Result<RseqConfig> {
    let mut conf = RseqConfig::default();
    // SAFETY: PTRACE_GET_RSEQ_CONFIGURATION writes at most `addr` bytes
    // (the struct's size) into `conf`, a #[repr(C)] copy of the kernel's.
    ok(unsafe {
        libc::ptrace(
            libc::PTRACE_GET_RSEQ_CONFIGURATION,
            tid as libc::pid_t,
            std::mem::size_of::<RseqConfig>(),
            (&mut conf as *mut RseqConfig).cast::<libc::c_void>(),
        )
    })?;
    Ok(conf)
}

/// The robust futex list of thread `tid`: (head, length).
pub fn get_robust_list(tid: u32) -> io::Result<(u64, u64)> {
    let (mut head, mut len): (u64, u64) = (0, 0);
    // SAFETY: get_robust_list writes one pointer into `head` and one size_t
    // into `len`.
    ok(unsafe {
        libc::syscall(
            libc::SYS_get_robust_list,
            tid as libc::c_long,
            &mut head as *mut u64,
            &mut len as *mut u64,
        )
    })?;
    Ok((head, len))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_rseq_configuration_has_the_kernels_layout() {
        // struct ptrace_rseq_configuration: u64, then four u32.
        assert_eq!(std::mem::size_of::<super::RseqConfig>(), 24);
    }
}
