//! The ptrace requests and system calls about a thread that `nix` has no
//! safe wrapper for — its extended register state (`NT_X86_XSTATE`), its
//! signal mask, its rseq registration, its robust futex list — and the
//! ioctls of dirty-page tracking (`UFFDIO_API`, `UFFDIO_REGISTER`,
//! `PAGEMAP_SCAN`), called through `libc`, each on a buffer of the size the
//! kernel documents; the pre-faulted buffer copies between processes go
//! through (`Bounce`); and read-only views of shared memory (`FileView`).
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

/// Whether this machine's XSAVE areas may hold features a task must ask
/// for (`ARCH_GET_XCOMP_SUPP` shows AMX tiles, or cannot be asked): a
/// task's area then need not be as large as ptrace reads it.
pub fn dynamic_xfeatures() -> bool {
    static ANSWER: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ANSWER.get_or_init(|| {
        /// `ARCH_GET_XCOMP_SUPP` (arch/x86/include/uapi/asm/prctl.h).
        const ARCH_GET_XCOMP_SUPP: libc::c_long = 0x1021;
        /// `XFEATURE_MASK_XTILEDATA`.
        const XTILEDATA: u64 = 1 << 18;
        let mut supported: u64 = 0;
        // SAFETY: ARCH_GET_XCOMP_SUPP writes one u64 at the address given.
        let r = unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_GET_XCOMP_SUPP,
                &mut supported as *mut u64,
            )
        };
        r != 0 || supported & XTILEDATA != 0
    })
}

/// The seccomp filter `index` of stopped tracee `tid` (0: the oldest), as
/// its `struct sock_filter` instructions (8 bytes each); `None` past its
/// oldest. Needs `CAP_SYS_ADMIN` in the host's user namespace.
pub fn seccomp_filter(tid: u32, index: u64) -> io::Result<Option<Vec<u8>>> {
    /// `PTRACE_SECCOMP_GET_FILTER` (include/uapi/linux/ptrace.h).
    const PTRACE_SECCOMP_GET_FILTER: libc::c_uint = 0x420c;
    // SAFETY: with a null buffer the kernel writes nothing and returns the
    // number of instructions.
    let n = unsafe {
        libc::ptrace(
            PTRACE_SECCOMP_GET_FILTER,
            tid as libc::pid_t,
            index as *mut libc::c_void,
            std::ptr::null_mut::<libc::c_void>(),
        )
    };
    if n < 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::ENOENT) => Ok(None),
            _ => Err(e),
        };
    }
    let mut buf = vec![0u8; n as usize * 8];
    // SAFETY: the kernel writes `n` instructions of 8 bytes into `buf`,
    // which is that large and outlives the call.
    ok(unsafe {
        libc::ptrace(
            PTRACE_SECCOMP_GET_FILTER,
            tid as libc::pid_t,
            index as *mut libc::c_void,
            buf.as_mut_ptr().cast::<libc::c_void>(),
        )
    })?;
    Ok(Some(buf))
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

/// The calling thread's scheduling policy and its priority.
pub fn sched_policy() -> io::Result<(i32, i32)> {
    // SAFETY: sched_getscheduler takes no pointer.
    let policy = ok(unsafe { libc::sched_getscheduler(0) } as libc::c_long)?;
    let mut param = libc::sched_param { sched_priority: 0 };
    // SAFETY: sched_getparam writes one `struct sched_param` into `param`.
    ok(unsafe { libc::sched_getparam(0, &mut param) } as libc::c_long)?;
    Ok((policy as i32, param.sched_priority))
}

/// Sets the calling thread's scheduling policy and priority.
pub fn set_sched_policy(policy: i32, priority: i32) -> io::Result<()> {
    let param = libc::sched_param {
        sched_priority: priority,
    };
    // SAFETY: sched_setscheduler reads one `struct sched_param` from `param`.
    ok(unsafe { libc::sched_setscheduler(0, policy, &param) } as libc::c_long).map(|_| ())
}

/// `ranges` as `process_vm_*` takes them.
fn remote(ranges: &[(u64, u64)]) -> Vec<nix::sys::uio::RemoteIoVec> {
    ranges
        .iter()
        .map(|&(a, b)| nix::sys::uio::RemoteIoVec {
            base: a as usize,
            len: (b - a) as usize,
        })
        .collect()
}

/// Reads `ranges` of process `pid`'s memory into `buf` (as long as they
/// are together), `IOV_MAX` ranges per call.
pub fn read_ranges(pid: u32, ranges: &[(u64, u64)], buf: &mut [u8]) -> io::Result<()> {
    let mut off = 0usize;
    for chunk in ranges.chunks(1024) {
        let remote = remote(chunk);
        let len: usize = remote.iter().map(|r| r.len).sum();
        let mut local = [std::io::IoSliceMut::new(&mut buf[off..off + len])];
        let got = nix::sys::uio::process_vm_readv(
            nix::unistd::Pid::from_raw(pid as i32),
            &mut local,
            &remote,
        )?;
        if got != len {
            return Err(io::Error::from_raw_os_error(libc::EFAULT));
        }
        off += len;
    }
    Ok(())
}

/// Writes `buf[from[i]..]` into `ranges[i]` of process `pid`'s memory,
/// `IOV_MAX` ranges per call; returns how many ranges were written whole
/// (the rest need another way: a page not writable, say).
pub fn write_ranges(pid: u32, ranges: &[(u64, u64)], from: &[usize], buf: &[u8]) -> usize {
    let mut done = 0;
    for (chunk, offs) in ranges.chunks(1024).zip(from.chunks(1024)) {
        let remote = remote(chunk);
        let local: Vec<std::io::IoSlice<'_>> = chunk
            .iter()
            .zip(offs)
            .map(|(&(a, b), &o)| std::io::IoSlice::new(&buf[o..o + (b - a) as usize]))
            .collect();
        let mut wrote = nix::sys::uio::process_vm_writev(
            nix::unistd::Pid::from_raw(pid as i32),
            &local,
            &remote,
        )
        .unwrap_or(0);
        for r in &remote {
            if wrote < r.len {
                return done;
            }
            wrote -= r.len;
            done += 1;
        }
    }
    done
}

/// Whether descriptor `fd1` of `pid1` and `fd2` of `pid2` are one open file
/// description (`kcmp(KCMP_FILE)`).
pub fn same_file(pid1: u32, fd1: i32, pid2: u32, fd2: i32) -> io::Result<bool> {
    const KCMP_FILE: libc::c_long = 0;
    kcmp(
        pid1,
        pid2,
        KCMP_FILE,
        fd1 as libc::c_long,
        fd2 as libc::c_long,
    )
}

/// Whether processes `pid1` and `pid2` share one address space
/// (`kcmp(KCMP_VM)`).
pub fn same_memory(pid1: u32, pid2: u32) -> io::Result<bool> {
    const KCMP_VM: libc::c_long = 1;
    kcmp(pid1, pid2, KCMP_VM, 0, 0)
}

/// `kcmp(pid1, pid2, kind, a, b) == 0`: the two are the same kernel object.
fn kcmp(
    pid1: u32,
    pid2: u32,
    kind: libc::c_long,
    a: libc::c_long,
    b: libc::c_long,
) -> io::Result<bool> {
    // SAFETY: kcmp takes plain integers and touches no memory of ours.
    let r = ok(unsafe {
        libc::syscall(
            libc::SYS_kcmp,
            pid1 as libc::c_long,
            pid2 as libc::c_long,
            kind,
            a,
            b,
        )
    })?;
    Ok(r == 0)
}

/// `struct uffdio_api` / `uffdio_register` / `pm_scan_arg` and their
/// requests (include/uapi/linux/userfaultfd.h, fs.h; Debian 12's headers
/// predate `PAGEMAP_SCAN`).
#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}
#[repr(C)]
struct UffdioRegister {
    start: u64,
    len: u64,
    mode: u64,
    ioctls: u64,
}
const UFFDIO_API: libc::c_ulong = 0xc018_aa3f;
const UFFDIO_REGISTER: libc::c_ulong = 0xc020_aa00;
const UFFD_API: u64 = 0xaa;
const UFFDIO_REGISTER_MODE_WP: u64 = 2;

/// `UFFDIO_API` on a new userfaultfd, asking for `features`.
pub fn uffd_api(fd: std::os::fd::BorrowedFd<'_>, features: u64) -> io::Result<()> {
    let mut a = UffdioApi {
        api: UFFD_API,
        features,
        ioctls: 0,
    };
    // SAFETY: UFFDIO_API reads and writes one `struct uffdio_api`, which
    // `a` is (#[repr(C)], three u64), alive for the call.
    ok(unsafe { libc::ioctl(std::os::fd::AsRawFd::as_raw_fd(&fd), UFFDIO_API, &mut a) }.into())?;
    Ok(())
}

/// `UFFDIO_REGISTER` of `[start, start + len)` for write protection.
pub fn uffd_register_wp(fd: std::os::fd::BorrowedFd<'_>, start: u64, len: u64) -> io::Result<()> {
    let mut r = UffdioRegister {
        start,
        len,
        mode: UFFDIO_REGISTER_MODE_WP,
        ioctls: 0,
    };
    // SAFETY: UFFDIO_REGISTER reads a `struct uffdio_register` and writes
    // its `ioctls` field; `r` is that struct (#[repr(C)]), alive for the call.
    ok(unsafe {
        libc::ioctl(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            UFFDIO_REGISTER,
            &mut r,
        )
    }
    .into())?;
    Ok(())
}

/// A userfaultfd of this process's own memory (`flags`: `O_CLOEXEC`,
/// `O_NONBLOCK`, `UFFD_USER_MODE_ONLY`): for probing what the kernel does.
pub fn userfaultfd_here(flags: u64) -> io::Result<std::os::fd::OwnedFd> {
    // SAFETY: userfaultfd(2) takes its flags by value and touches no memory.
    let fd = ok(unsafe { libc::syscall(libc::SYS_userfaultfd, flags) })?;
    // SAFETY: the call returned a new descriptor, owned by nothing else.
    Ok(unsafe { std::os::fd::FromRawFd::from_raw_fd(fd as i32) })
}

/// A private anonymous region of this process, `len` bytes from a
/// multiple of `align`, in huge pages only where advised to
/// (`MADV_HUGEPAGE`); unmapped when dropped.
#[derive(Debug)]
pub struct Region {
    map: *mut libc::c_void,
    total: usize,
    pub base: u64,
    pub len: usize,
}

impl Region {
    pub fn new(len: usize, align: usize) -> io::Result<Region> {
        let total = len + align;
        // SAFETY: a new private anonymous mapping; no existing memory is
        // touched, and the result is checked.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                total,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let r = Region {
            map,
            total,
            base: (map as u64).next_multiple_of(align as u64),
            len,
        };
        // SAFETY: covers only the mapping just made.
        ok(unsafe { libc::madvise(map, total, libc::MADV_NOHUGEPAGE) }.into())?;
        Ok(r)
    }

    /// `madvise` of `len` bytes from `offset`.
    pub fn advise(&self, offset: usize, len: usize, advice: libc::c_int) -> io::Result<()> {
        assert!(offset + len <= self.len, "outside the region");
        // SAFETY: the range lies inside the mapping made in `new`, which
        // only this value refers to; advice changes no Rust-visible memory
        // that is borrowed (the region is never handed out).
        ok(unsafe {
            libc::madvise(
                (self.base as usize + offset) as *mut libc::c_void,
                len,
                advice,
            )
        }
        .into())?;
        Ok(())
    }

    /// Writes one byte at `offset` (faulting its page in).
    pub fn touch(&self, offset: usize) {
        assert!(offset < self.len, "outside the region");
        // SAFETY: `base + offset` lies inside the mapping, which is
        // writable and lives as long as `self`; nothing else refers to it.
        unsafe { std::ptr::write_volatile((self.base as usize + offset) as *mut u8, 1) }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, which nothing borrows.
        unsafe {
            libc::munmap(self.map, self.total);
        }
    }
}

/// One `struct page_region` of a `PAGEMAP_SCAN` answer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(C)]
pub struct PageRegion {
    pub start: u64,
    pub end: u64,
    pub categories: u64,
}

/// The query of one `PAGEMAP_SCAN` (`struct pm_scan_arg`, without its
/// size, output and walk-end fields, which the call fills in).
#[derive(Debug, Clone, Copy, Default)]
pub struct PmScan {
    pub flags: u64,
    pub start: u64,
    pub end: u64,
    pub category_inverted: u64,
    pub category_mask: u64,
    pub category_anyof_mask: u64,
    pub return_mask: u64,
}

impl PmScan {
    /// No range, no category (for `..` in constants).
    pub const EMPTY: PmScan = PmScan {
        flags: 0,
        start: 0,
        end: 0,
        category_inverted: 0,
        category_mask: 0,
        category_anyof_mask: 0,
        return_mask: 0,
    };
}

#[repr(C)]
struct PmScanArg {
    size: u64,
    flags: u64,
    start: u64,
    end: u64,
    walk_end: u64,
    vec: u64,
    vec_len: u64,
    max_pages: u64,
    category_inverted: u64,
    category_mask: u64,
    category_anyof_mask: u64,
    return_mask: u64,
}
/// `_IOWR('f', 16, struct pm_scan_arg)`.
const PAGEMAP_SCAN: libc::c_ulong = 0xc060_6610;

/// `PAGEMAP_SCAN` on an opened `/proc/PID/pagemap`: fills `out` and
/// returns how many regions it holds and where the walk stopped (before
/// `q.end` when `out` filled up).
pub fn pagemap_scan(
    pagemap: std::os::fd::BorrowedFd<'_>,
    q: &PmScan,
    out: &mut [PageRegion],
) -> io::Result<(usize, u64)> {
    let mut a = PmScanArg {
        size: std::mem::size_of::<PmScanArg>() as u64,
        flags: q.flags,
        start: q.start,
        end: q.end,
        walk_end: 0,
        // No answer asked (`out` empty): a null vector.
        vec: if out.is_empty() {
            0
        } else {
            out.as_mut_ptr() as u64
        },
        vec_len: out.len() as u64,
        max_pages: 0,
        category_inverted: q.category_inverted,
        category_mask: q.category_mask,
        category_anyof_mask: q.category_anyof_mask,
        return_mask: q.return_mask,
    };
    // SAFETY: PAGEMAP_SCAN reads `a` (#[repr(C)], the kernel's layout,
    // `size` set) and writes at most `vec_len` `struct page_region`s at
    // `vec`, which is `out` (#[repr(C)], same layout), alive for the call.
    let n = ok(unsafe {
        libc::ioctl(
            std::os::fd::AsRawFd::as_raw_fd(&pagemap),
            PAGEMAP_SCAN,
            &mut a,
        )
    }
    .into())?;
    Ok((n as usize, a.walk_end))
}

/// `struct procmap_query` (include/uapi/linux/fs.h, Linux 6.11).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct ProcmapQuery {
    size: u64,
    query_flags: u64,
    query_addr: u64,
    vma_start: u64,
    vma_end: u64,
    vma_flags: u64,
    vma_page_size: u64,
    vma_offset: u64,
    inode: u64,
    dev_major: u32,
    dev_minor: u32,
    vma_name_size: u32,
    build_id_size: u32,
    vma_name_addr: u64,
    build_id_addr: u64,
}

/// `PROCMAP_QUERY`: `_IOWR('f', 17, struct procmap_query)`.
const PROCMAP_QUERY: libc::c_ulong = 0xc068_6611;

/// A mapping `PROCMAP_QUERY` found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Queried {
    pub start: u64,
    pub end: u64,
    /// `PROCMAP_QUERY_VMA_READABLE` (1), `_WRITABLE` (2), `_EXECUTABLE`
    /// (4), `_SHARED` (8).
    pub flags: u64,
    pub offset: u64,
    pub inode: u64,
    pub dev: (u32, u32),
    /// The length of its name written into the buffer given (0: none, or
    /// none asked for), with its NUL.
    pub name_len: usize,
}

/// `PROCMAP_QUERY` on an opened `/proc/PID/maps`: the first mapping at or
/// after `addr` with every property of `flags` (`PROCMAP_QUERY_VMA_*`,
/// `PROCMAP_QUERY_FILE_BACKED_VMA`; the next one is always asked for), or
/// `None` when there is none; its name (as `maps` shows it) into `name`
/// when one is given. The kernel's filter and one call, where the text of
/// `maps` costs microseconds a line.
pub fn procmap_query(
    maps: std::os::fd::BorrowedFd<'_>,
    addr: u64,
    flags: u64,
    name: Option<&mut [u8]>,
) -> io::Result<Option<Queried>> {
    const COVERING_OR_NEXT: u64 = 0x10;
    let (name_addr, name_size) = match name {
        Some(b) => (b.as_mut_ptr() as u64, b.len().min(u32::MAX as usize) as u32),
        None => (0, 0),
    };
    let mut q = ProcmapQuery {
        size: std::mem::size_of::<ProcmapQuery>() as u64,
        query_flags: flags | COVERING_OR_NEXT,
        query_addr: addr,
        vma_name_size: name_size,
        vma_name_addr: name_addr,
        ..ProcmapQuery::default()
    };
    // SAFETY: PROCMAP_QUERY reads and writes `q` (#[repr(C)], the kernel's
    // layout, `size` set) and writes at most `vma_name_size` bytes at
    // `vma_name_addr` (the buffer borrowed mutably above, alive through the
    // call; none when the size is 0); no build id is asked for.
    match ok(unsafe {
        libc::ioctl(
            std::os::fd::AsRawFd::as_raw_fd(&maps),
            PROCMAP_QUERY,
            &mut q,
        )
    }
    .into())
    {
        Ok(_) => Ok(Some(Queried {
            start: q.vma_start,
            end: q.vma_end,
            flags: q.vma_flags,
            offset: q.vma_offset,
            inode: q.inode,
            dev: (q.dev_major, q.dev_minor),
            name_len: if name_size == 0 {
                0
            } else {
                q.vma_name_size as usize
            },
        })),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

/// `MADV_POPULATE_WRITE` (Linux 5.14).
const MADV_POPULATE_WRITE: libc::c_int = 23;

/// `MADV_POPULATE_READ` (Linux 5.14).
const MADV_POPULATE_READ: libc::c_int = 22;

/// A read-only shared mapping of `len` bytes of a file from `offset` (a
/// page multiple), unmapped when dropped: comparing a shared memory object
/// in place costs no copy of it (PostgreSQL's 16 MB of shared buffers read
/// into a buffer cost 3-4 ms). Its bytes are only read by `memcmp` and
/// `pwrite` through the pointer, never lent out as a slice, since others
/// may write the object meanwhile. Reading a page past the file's end
/// raises `SIGBUS`, and reading a hole of shared memory allocates a page
/// in it: the callers read only the runs of data of an object nothing can
/// shrink (see `shmback`).
#[derive(Debug)]
pub struct FileView {
    map: *mut libc::c_void,
    len: usize,
}

// SAFETY: the mapping is plain memory of this process, read only through
// `memcmp` and `pwrite`, which any thread may call on it.
unsafe impl Send for FileView {}
// SAFETY: as for `Send`; no method writes through the pointer.
unsafe impl Sync for FileView {}

impl FileView {
    pub fn new(f: &std::fs::File, offset: u64, len: usize) -> io::Result<FileView> {
        use std::os::fd::AsRawFd;
        if len == 0 {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        }
        // SAFETY: a new shared read-only mapping of an open file; no
        // existing memory is touched, and the result is checked.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                offset as libc::off_t,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(FileView { map, len })
    }

    fn at(&self, at: usize, n: usize) -> *const u8 {
        assert!(at <= self.len && n <= self.len - at, "outside the view");
        (self.map as usize + at) as *const u8
    }

    /// Faults in `n` bytes from `at` with one call (page multiples).
    pub fn populate(&self, at: usize, n: usize) -> io::Result<()> {
        let p = self.at(at, n);
        // SAFETY: the range lies inside the mapping made in `new`; the
        // advice only maps pages, it changes no memory.
        ok(unsafe { libc::madvise(p as *mut libc::c_void, n, MADV_POPULATE_READ) }.into())?;
        Ok(())
    }

    /// Whether the `bytes.len()` bytes from `at` are `bytes`.
    pub fn holds(&self, at: usize, bytes: &[u8]) -> bool {
        let p = self.at(at, bytes.len());
        // SAFETY: both ranges are readable for `bytes.len()` bytes: the
        // first inside the mapping (checked in `at`), the second a slice.
        unsafe { libc::memcmp(p as *const libc::c_void, bytes.as_ptr().cast(), bytes.len()) == 0 }
    }

    /// Whether the `n` bytes from `at` are the same here and in `other`.
    pub fn same_as(&self, other: &FileView, at: usize, n: usize) -> bool {
        let (p, q) = (self.at(at, n), other.at(at, n));
        // SAFETY: both ranges lie inside their mappings (checked in `at`)
        // and are readable for `n` bytes.
        unsafe { libc::memcmp(p as *const libc::c_void, q as *const libc::c_void, n) == 0 }
    }

    /// Writes the `n` bytes from `at` into `f` at `off`.
    pub fn write_into(&self, at: usize, n: usize, f: &std::fs::File, off: u64) -> io::Result<()> {
        use std::os::fd::AsRawFd;
        let p = self.at(at, n);
        let mut done = 0;
        while done < n {
            // SAFETY: `n - done` bytes from `p + done` lie inside the
            // mapping (checked in `at`); pwrite only reads them.
            let r = unsafe {
                libc::pwrite(
                    f.as_raw_fd(),
                    p.add(done) as *const libc::c_void,
                    n - done,
                    (off + done as u64) as libc::off_t,
                )
            };
            match r {
                0 => return Err(io::Error::from(io::ErrorKind::WriteZero)),
                r if r > 0 => done += r as usize,
                _ => {
                    let e = io::Error::last_os_error();
                    if e.kind() != io::ErrorKind::Interrupted {
                        return Err(e);
                    }
                }
            }
        }
        Ok(())
    }
}

impl Drop for FileView {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`; nothing borrows it.
        unsafe {
            libc::munmap(self.map, self.len);
        }
    }
}

/// Below this many bytes a buffer is an ordinary allocation: its pages
/// are most likely faulted in already, and a mapping costs three calls.
const BOUNCE_MAPPED_FROM: usize = 64 << 10;

/// A zeroed buffer for copies between processes; a large one is a mapping
/// faulted in with one call (`MADV_POPULATE_WRITE`): one the kernel first
/// touches as it copies into it costs a fault per page (7.6 µs each on the
/// development VM), more than the copy itself.
#[derive(Debug)]
pub enum Bounce {
    Mapped(*mut libc::c_void, usize),
    Plain(Vec<u8>),
}

impl Bounce {
    pub fn new(len: usize) -> Bounce {
        if len < BOUNCE_MAPPED_FROM {
            return Bounce::Plain(vec![0u8; len]);
        }
        // SAFETY: a new private anonymous mapping; no existing memory is
        // touched, and the result is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Bounce::Plain(vec![0u8; len]);
        }
        // SAFETY: covers only the mapping just made. (Faulted in as it is
        // used where this fails.)
        unsafe {
            libc::madvise(p, len, MADV_POPULATE_WRITE);
        }
        Bounce::Mapped(p, len)
    }
}

impl std::ops::Deref for Bounce {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            // SAFETY: `len` bytes are the mapping, which lives as long as
            // `self`; anonymous memory is initialised (zeros).
            Bounce::Mapped(p, len) => unsafe { std::slice::from_raw_parts(*p as *const u8, *len) },
            Bounce::Plain(v) => v,
        }
    }
}

impl std::ops::DerefMut for Bounce {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            // SAFETY: as in `deref`; `&mut self` makes this the only view.
            Bounce::Mapped(p, len) => unsafe {
                std::slice::from_raw_parts_mut(*p as *mut u8, *len)
            },
            Bounce::Plain(v) => v,
        }
    }
}

impl Drop for Bounce {
    fn drop(&mut self) {
        if let Bounce::Mapped(p, len) = *self {
            // SAFETY: the mapping made in `new`, no longer borrowed.
            unsafe {
                libc::munmap(p, len);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_bounce_buffer_is_zeroed_writable_and_of_its_length() {
        for len in [0usize, 1, 4096, 3 << 20] {
            let mut b = super::Bounce::new(len);
            assert_eq!(b.len(), len);
            assert!(b.iter().all(|x| *x == 0));
            if len > 0 {
                b[len - 1] = 7;
                assert_eq!(b[len - 1], 7);
            }
        }
    }

    #[test]
    fn the_dirty_tracking_structs_have_the_kernels_layout() {
        assert_eq!(std::mem::size_of::<super::PmScanArg>(), 96);
        assert_eq!(std::mem::size_of::<super::PageRegion>(), 24);
        assert_eq!(std::mem::size_of::<super::UffdioRegister>(), 32);
        assert_eq!(std::mem::size_of::<super::UffdioApi>(), 24);
    }

    #[test]
    fn the_rseq_configuration_has_the_kernels_layout() {
        // struct ptrace_rseq_configuration: u64, then four u32.
        assert_eq!(std::mem::size_of::<super::RseqConfig>(), 24);
    }
}
