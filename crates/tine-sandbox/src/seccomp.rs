//! The seccomp filter every process in a sandbox runs under, in the spirit of
//! Docker's default profile: the kernel's attack surface that a container
//! does not need is refused (new namespaces, mounts, keyrings, BPF, module and
//! kexec loading, io_uring, clock setting, the page-table scan that could
//! hide writes from tine's memory tracking, ...), everything else is allowed.
//!
//! It is a deny list on top of the user namespace, which is the sandbox's
//! real boundary: the refused calls are those that reach code a rootless
//! container should never reach, whether or not its capabilities would let
//! them succeed. Refused calls fail with `EPERM`; `clone3` (whose flags sit
//! behind a pointer a filter cannot read) fails with `ENOSYS`, so that C
//! libraries fall back to `clone`, whose flags the filter checks.
//!
//! tine itself injects system calls into sandbox processes (forks, nested
//! sandboxes' `clone3` with namespace flags): it attaches with
//! `PTRACE_O_SUSPEND_SECCOMP`, which only a tracer with the host's
//! `CAP_SYS_ADMIN` may set — a tracer inside the sandbox cannot lift the
//! filter, and none of its rules returns `SECCOMP_RET_TRACE`, which a tracer
//! in the sandbox could turn into an allow.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, sock_filter,
};

/// Namespace flags of `clone` and `unshare` (`CLONE_NEWTIME` only exists for
/// `unshare`; for `clone` its bit is `CSIGNAL`'s, a signal number).
const CLONE_NS_FLAGS: [u64; 7] = [
    libc::CLONE_NEWNS as u64,
    libc::CLONE_NEWCGROUP as u64,
    libc::CLONE_NEWUTS as u64,
    libc::CLONE_NEWIPC as u64,
    libc::CLONE_NEWUSER as u64,
    libc::CLONE_NEWPID as u64,
    libc::CLONE_NEWNET as u64,
];
const CLONE_NEWTIME: u64 = 0x80;

/// `personality` values a program may set (Docker's list): `PER_LINUX`,
/// `PER_LINUX32`, either with `UNAME26`, and the query (`0xffffffff`).
const PERSONALITIES: [u64; 5] = [0x0, 0x8, 0x20000, 0x20008, 0xffff_ffff];

/// `ioctl` commands refused (the kernel takes the command's low 32 bits).
const PAGEMAP_SCAN: u64 = 0xc060_6610;
const TIOCSTI: u64 = libc::TIOCSTI;
const TIOCLINUX: u64 = libc::TIOCLINUX;

/// Calls refused outright.
const REFUSED: &[i64] = &[
    // New namespaces and joining others: clone/unshare are checked by flag.
    libc::SYS_setns,
    // Mounts, old and new API. (`umount2` is allowed: it needs
    // CAP_SYS_ADMIN over the mount namespace, which no sandbox process keeps
    // once set up; a native fork's new init, under its origin's filter,
    // detaches the files handed over to it before it locks itself down.)
    libc::SYS_mount,
    libc::SYS_pivot_root,
    libc::SYS_fsopen,
    libc::SYS_fsconfig,
    libc::SYS_fsmount,
    libc::SYS_fspick,
    libc::SYS_move_mount,
    libc::SYS_open_tree,
    libc::SYS_mount_setattr,
    libc::SYS_swapon,
    libc::SYS_swapoff,
    libc::SYS_quotactl,
    libc::SYS_quotactl_fd,
    // Keyrings (not namespaced: keys of other users' sessions are kernel-wide).
    libc::SYS_keyctl,
    libc::SYS_add_key,
    libc::SYS_request_key,
    // BPF, perf, and io_uring (whose operations bypass this filter).
    libc::SYS_bpf,
    libc::SYS_perf_event_open,
    libc::SYS_io_uring_setup,
    libc::SYS_io_uring_enter,
    libc::SYS_io_uring_register,
    libc::SYS_userfaultfd,
    // Kernel modules, kexec, reboot, accounting.
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_delete_module,
    libc::SYS_kexec_load,
    libc::SYS_kexec_file_load,
    libc::SYS_reboot,
    libc::SYS_acct,
    // The host's clock (not namespaced).
    libc::SYS_settimeofday,
    libc::SYS_clock_settime,
    libc::SYS_clock_adjtime,
    libc::SYS_adjtimex,
    // Handles that open files by inode number, past any mount or chroot.
    libc::SYS_open_by_handle_at,
    libc::SYS_name_to_handle_at,
    // Ports, and obsolete calls nobody needs.
    libc::SYS_iopl,
    libc::SYS_ioperm,
    libc::SYS_uselib,
    libc::SYS_ustat,
    libc::SYS_sysfs,
    libc::SYS__sysctl,
    libc::SYS_lookup_dcookie,
    libc::SYS_nfsservctl,
    libc::SYS_vhangup,
    libc::SYS_kcmp,
];

#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("build the sandbox's seccomp filter: {0}")]
    Build(String),
    #[error("install the sandbox's seccomp filter: {0}")]
    Install(String),
}

fn build(e: impl std::fmt::Display) -> SeccompError {
    SeccompError::Build(e.to_string())
}

fn when_bit(arg: u8, bit: u64) -> Result<SeccompRule, SeccompError> {
    let c = SeccompCondition::new(
        arg,
        SeccompCmpArgLen::Qword,
        SeccompCmpOp::MaskedEq(bit),
        bit,
    )
    .map_err(build)?;
    SeccompRule::new(vec![c]).map_err(build)
}

/// The main filter: [`REFUSED`], namespace flags of `clone` and `unshare`,
/// and `personality` beyond the usual values, each `EPERM`.
fn refusals() -> Result<BpfProgram, SeccompError> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        REFUSED.iter().map(|nr| (*nr, Vec::new())).collect();
    let clone = CLONE_NS_FLAGS
        .iter()
        .map(|b| when_bit(0, *b))
        .collect::<Result<Vec<_>, _>>()?;
    let mut unshare = clone.clone();
    unshare.push(when_bit(0, CLONE_NEWTIME)?);
    rules.insert(libc::SYS_clone, clone);
    rules.insert(libc::SYS_unshare, unshare);
    let odd = PERSONALITIES
        .iter()
        .map(|v| SeccompCondition::new(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Ne, *v))
        .collect::<Result<Vec<_>, _>>()
        .map_err(build)?;
    rules.insert(
        libc::SYS_personality,
        vec![SeccompRule::new(odd).map_err(build)?],
    );
    // `PAGEMAP_SCAN` (`_IOWR('f', 16, struct pm_scan_arg)`): a program that write-protects its own pages
    // with it would hide its writes from the tracking of its memory, and so
    // from its own rollbacks. tine scans from outside, unfiltered.
    // `TIOCSTI` and `TIOCLINUX` push input into a terminal (or select and
    // paste on a virtual console): the second line of defence, behind never
    // handing a sandbox a host terminal, against typing into whoever's shell.
    let ioctl = [PAGEMAP_SCAN, TIOCSTI, TIOCLINUX]
        .iter()
        .map(|cmd| {
            let c = SeccompCondition::new(1, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, *cmd)
                .map_err(build)?;
            SeccompRule::new(vec![c]).map_err(build)
        })
        .collect::<Result<Vec<_>, _>>()?;
    rules.insert(libc::SYS_ioctl, ioctl);
    compile(rules, libc::EPERM)
}

/// A program that allows every call but those `rules` match, which fail
/// with `errno`.
fn compile(rules: BTreeMap<i64, Vec<SeccompRule>>, errno: i32) -> Result<BpfProgram, SeccompError> {
    SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(errno as u32),
        std::env::consts::ARCH.try_into().map_err(build)?,
    )
    .map_err(build)?
    .try_into()
    .map_err(build)
}

/// `clone3` → `ENOSYS`; and calls of the x32 ABI (numbers with bit 30 set,
/// which share x86-64's audit architecture and would slip past the rules
/// above where a kernel has that ABI) → `ENOSYS` too.
fn fallbacks() -> Result<BpfProgram, SeccompError> {
    let mut prog = compile(
        BTreeMap::from([(libc::SYS_clone3, Vec::new())]),
        libc::ENOSYS,
    )?;
    const BPF_LD_W_ABS: u16 = 0x20;
    const BPF_JGE_K: u16 = 0x35;
    const BPF_RET_K: u16 = 0x06;
    const X32_BIT: u32 = 0x4000_0000;
    let x32 = [
        // seccomp_data.nr
        ins(BPF_LD_W_ABS, 0, 0, 0),
        ins(BPF_JGE_K, 0, 1, X32_BIT),
        ins(
            BPF_RET_K,
            0,
            0,
            libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32,
        ),
    ];
    // Before the compiled program (which starts by checking the
    // architecture): a miss falls through into it.
    prog.splice(0..0, x32);
    Ok(prog)
}

fn ins(code: u16, jt: u8, jf: u8, k: u32) -> sock_filter {
    sock_filter { code, jt, jf, k }
}

/// The programs to install, in order.
pub fn programs() -> Result<Vec<BpfProgram>, SeccompError> {
    Ok(vec![fallbacks()?, refusals()?])
}

/// Installs the sandbox's filter on the calling thread (single-threaded
/// callers: a sandbox's init, and `enter` before it starts a command), after
/// `no_new_privs` is set. Inherited by every child and kept across exec.
pub fn install() -> Result<(), SeccompError> {
    for p in programs()? {
        seccompiler::apply_filter(&p).map_err(|e| SeccompError::Install(e.to_string()))?;
    }
    Ok(())
}

/// Whether host process `pid` runs under a seccomp filter (`Seccomp: 2` in
/// its status); false when it cannot be read.
pub fn filtered(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .map(|s| seccomp_mode(&s) == Some(2))
        .unwrap_or(false)
}

fn seccomp_mode(status: &str) -> Option<u32> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("Seccomp:"))
        .and_then(|v| v.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_programs_compile_and_fit_the_kernels_limit() {
        let ps = programs().unwrap();
        assert_eq!(ps.len(), 2);
        for p in &ps {
            assert!(!p.is_empty() && p.len() < 4096, "{} instructions", p.len());
        }
        // The x32 guard comes first and jumps into the compiled program.
        assert_eq!(ps[0][0].k, 0);
        assert_eq!(ps[0][1].k, 0x4000_0000);
    }

    #[test]
    fn the_mode_is_read_from_a_status_file() {
        let s = "Name:\tsh\nNoNewPrivs:\t1\nSeccomp:\t2\nSeccomp_filters:\t2\n";
        assert_eq!(seccomp_mode(s), Some(2));
        assert_eq!(seccomp_mode("Name:\tsh\n"), None);
    }

    #[test]
    fn every_refused_call_is_listed_once() {
        let mut seen = std::collections::HashSet::new();
        for nr in REFUSED {
            assert!(seen.insert(nr), "syscall {nr} listed twice");
            assert!(*nr != libc::SYS_clone && *nr != libc::SYS_unshare);
        }
    }
}
