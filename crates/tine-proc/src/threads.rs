//! The threads of a process besides its main one. A fork copies only the
//! thread that calls it, so at a checkpoint every other thread is stopped
//! and its state recorded — registers, extended (FPU/SSE/AVX) state, signal
//! mask, rseq registration, robust futex list, the address the kernel
//! clears at its exit, alternate signal stack, name, CPU affinity — and a
//! copy made from the template gets each back: an injected `clone3`
//! (`CLONE_THREAD`, its TID by `set_tid`, its TLS) in the copy's main
//! thread, then the state. A thread stopped in a system call restarts it as
//! the kernel would after a signal (it is let go from a signal-delivery
//! stop, see `ptrace`). A process rolled back in place keeps those of its
//! threads the checkpoint had: each puts its state back itself, its first
//! act an `rt_sigreturn` from a frame written below its stack ([`Frame`]).

use std::path::Path;

use nix::libc;
use serde::{Deserialize, Serialize};

use crate::batch::{Batch, Stub};
use crate::inspect::{ProcError, ns_pids};
use crate::ptrace::{Regs, Tracee};
use crate::raw;

/// One thread's state at a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ThreadState {
    /// Its TID in its PID namespace, which its copies get back (programs
    /// keep their threads' TIDs: glibc's mutexes record their owner by it).
    pub ns_tid: u32,
    /// `user_regs_struct`, word by word (see [`regs_to_words`]).
    pub regs: Vec<u64>,
    /// Its XSAVE area (`NT_X86_XSTATE`), hex.
    pub xstate: String,
    pub sigmask: u64,
    /// Its rseq area, its size and signature (none: not registered).
    #[serde(default)]
    pub rseq: Option<(u64, u32, u32)>,
    /// Its robust futex list: head and length (head 0: none).
    #[serde(default)]
    pub robust_list: (u64, u64),
    /// Where the kernel writes 0 (and wakes futex waiters) when it exits:
    /// what `pthread_join` waits on.
    #[serde(default)]
    pub clear_tid: u64,
    /// Its alternate signal stack: base, flags, size (none: disabled).
    #[serde(default)]
    pub altstack: Option<(u64, i32, u64)>,
    pub name: String,
    /// The CPUs it may run on (empty: left as the copy's).
    #[serde(default)]
    pub cpus: Vec<usize>,
}

/// `clone3` flags of a thread as `pthread_create` makes it.
const THREAD_FLAGS: u64 = (libc::CLONE_VM
    | libc::CLONE_FS
    | libc::CLONE_FILES
    | libc::CLONE_SIGHAND
    | libc::CLONE_THREAD
    | libc::CLONE_SYSVSEM
    | libc::CLONE_SETTLS
    | libc::CLONE_CHILD_CLEARTID) as u64;

/// `PR_GET_TID_ADDRESS` (include/uapi/linux/prctl.h).
const PR_GET_TID_ADDRESS: u64 = 40;
/// `SS_DISABLE`.
pub(crate) const SS_DISABLE: i32 = 2;
/// `sizeof(struct robust_list_head)`, the one length `set_robust_list` takes.
const ROBUST_LIST_HEAD: u64 = 24;

/// `-ERESTART_RESTARTBLOCK` and `-ERESTARTNOINTR` (include/linux/errno.h).
const ERESTART_RESTARTBLOCK: u64 = -516i64 as u64;
const ERESTARTNOINTR: u64 = -513i64 as u64;

/// Registers for a task made by `clone3` that must continue a system call
/// interrupted at the checkpoint: one the kernel would restart through the
/// task's restart block (`clock_nanosleep`, a timed futex wait) is made to
/// restart as it was called instead, since a new task's restart block is its
/// maker's (another thread's, another process's), not the interrupted one's.
pub fn restartable(mut r: Regs) -> Regs {
    if r.orig_rax as i64 >= 0 && r.rax == ERESTART_RESTARTBLOCK {
        r.rax = ERESTARTNOINTR;
    }
    r
}

/// `regs` as words, in `user_regs_struct`'s order.
pub fn regs_to_words(r: &Regs) -> Vec<u64> {
    vec![
        r.r15, r.r14, r.r13, r.r12, r.rbp, r.rbx, r.r11, r.r10, r.r9, r.r8, r.rax, r.rcx, r.rdx,
        r.rsi, r.rdi, r.orig_rax, r.rip, r.cs, r.eflags, r.rsp, r.ss, r.fs_base, r.gs_base, r.ds,
        r.es, r.fs, r.gs,
    ]
}

/// [`regs_to_words`] back; `None` when there are not 27 words.
pub fn regs_from_words(w: &[u64]) -> Option<Regs> {
    let w: &[u64; 27] = w.try_into().ok()?;
    Some(Regs {
        r15: w[0],
        r14: w[1],
        r13: w[2],
        r12: w[3],
        rbp: w[4],
        rbx: w[5],
        r11: w[6],
        r10: w[7],
        r9: w[8],
        r8: w[9],
        rax: w[10],
        rcx: w[11],
        rdx: w[12],
        rsi: w[13],
        rdi: w[14],
        orig_rax: w[15],
        rip: w[16],
        cs: w[17],
        eflags: w[18],
        rsp: w[19],
        ss: w[20],
        fs_base: w[21],
        gs_base: w[22],
        ds: w[23],
        es: w[24],
        fs: w[25],
        gs: w[26],
    })
}

fn io_err(tid: u32, step: &'static str) -> impl FnOnce(std::io::Error) -> ProcError {
    move |source| {
        if source.raw_os_error() == Some(libc::ESRCH) {
            ProcError::Gone { pid: tid }
        } else {
            ProcError::Ptrace {
                pid: tid,
                step,
                source,
            }
        }
    }
}

/// The TIDs of process `pid` other than its main thread.
pub fn other_threads(pid: u32) -> Result<Vec<u32>, ProcError> {
    let mut tids = crate::inspect::threads(Path::new("/proc"), pid)?;
    tids.retain(|t| *t != pid);
    Ok(tids)
}

/// The TIDs the threads of process `pid` other than its main one have in
/// its PID namespace, by their TIDs in ours (those that cannot be read are
/// left out: gone meanwhile).
pub fn ns_tids(pid: u32) -> std::collections::HashMap<u32, u32> {
    other_threads(pid)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|t| Some((t, *ns_pids(t)?.last()?)))
        .collect()
}

/// Stops every thread of process `pid` together (all asked before any is
/// waited for, where stopping the main one first, then the others, waited
/// twice): the main one, and the others. `syscall_at`: where a `syscall`
/// instruction was found before (0: none), checked once stopped.
pub fn stop_all(pid: u32, syscall_at: u64) -> Result<(Tracee, Vec<Tracee>), ProcError> {
    let mut tids = vec![pid];
    tids.extend(other_threads(pid)?);
    let mut got = Tracee::seize_all_at(&tids, syscall_at).into_iter();
    let mut main = got.next().expect("one result per PID")?;
    let mut held = Vec::with_capacity(tids.len() - 1);
    for r in got {
        match r {
            Ok(t) => held.push(t),
            // It ended meanwhile.
            Err(ProcError::Gone { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    main.expect_syscall_at()?;
    for t in &mut held {
        t.set_syscall_at(main.syscall_at());
    }
    let others = stop_more(pid, main.syscall_at(), held)?;
    Ok((main, others))
}

/// Stops every thread of `pid` but the main one (which the caller holds),
/// until none is left running: a thread may start another meanwhile.
pub fn stop_others(pid: u32, syscall_at: u64) -> Result<Vec<Tracee>, ProcError> {
    stop_more(pid, syscall_at, Vec::new())
}

/// [`stop_others`] with those in `held` stopped already.
fn stop_more(pid: u32, syscall_at: u64, mut held: Vec<Tracee>) -> Result<Vec<Tracee>, ProcError> {
    loop {
        let new: Vec<u32> = other_threads(pid)?
            .into_iter()
            .filter(|t| !held.iter().any(|h| h.pid() == *t))
            .collect();
        if new.is_empty() {
            return Ok(held);
        }
        // All asked to stop at once: they stop together.
        for r in Tracee::seize_all_at(&new, syscall_at) {
            match r {
                Ok(t) => held.push(t),
                // It ended meanwhile.
                Err(ProcError::Gone { .. }) => {}
                Err(e) => return Err(e),
            }
        }
    }
}

/// The rseq registration of stopped thread `tid`: area, size, signature
/// (none: not registered).
fn rseq_of(tid: u32) -> Result<Option<(u64, u32, u32)>, ProcError> {
    let r = raw::get_rseq(tid).map_err(io_err(tid, "read rseq registration"))?;
    Ok((r.abi_pointer != 0).then_some((r.abi_pointer, r.abi_size, r.signature)))
}

/// Records the state of stopped thread `t` (injecting what only the thread
/// itself can tell: its clear-tid address and alternate stack). Give it
/// its process's memory handle first where one is open
/// ([`Tracee::share_memory_of`]): opening one costs tens of µs.
pub fn capture(t: &mut Tracee) -> Result<ThreadState, ProcError> {
    let tid = t.pid();
    let regs = regs_to_words(t.saved_regs());
    let xstate = raw::get_xstate(tid).map_err(io_err(tid, "read extended registers"))?;
    let sigmask = raw::get_sigmask(tid).map_err(io_err(tid, "read signal mask"))?;
    let rseq = rseq_of(tid)?;
    let robust_list = raw::get_robust_list(tid).map_err(io_err(tid, "read robust list"))?;
    // Both answers written by the kernel below its stack's red zone, side
    // by side, and read back at once.
    let at = t.scratch_address(0, 64);
    t.syscall(
        "prctl(PR_GET_TID_ADDRESS)",
        libc::SYS_prctl,
        [PR_GET_TID_ADDRESS, at, 0, 0, 0, 0],
    )?;
    t.syscall(
        "sigaltstack",
        libc::SYS_sigaltstack,
        [0, at + 32, 0, 0, 0, 0],
    )?;
    let answers = t.peek(at, 56)?;
    let clear_tid = u64::from_le_bytes(answers[..8].try_into().unwrap_or_default());
    // stack_t: void *ss_sp; int ss_flags; (pad) size_t ss_size.
    let ss = &answers[32..];
    let word = |i: usize| u64::from_le_bytes(ss[i..i + 8].try_into().unwrap_or_default());
    let flags = i32::from_le_bytes(ss[8..12].try_into().unwrap_or_default());
    let altstack = (flags & SS_DISABLE == 0).then(|| (word(0), flags, word(16)));
    let pid_dir = format!("/proc/{tid}/comm");
    let name = std::fs::read_to_string(&pid_dir)
        .map(|n| n.trim_end_matches('\n').to_string())
        .unwrap_or_default();
    // As it was before we held it on our CPU for the calls above.
    let cpus = t
        .affinity()
        .map(|set| {
            (0..nix::sched::CpuSet::count())
                .filter(|c| set.is_set(*c).unwrap_or(false))
                .collect()
        })
        .unwrap_or_default();
    let ns_tid = ns_pids(tid)
        .and_then(|p| p.last().copied())
        .ok_or(ProcError::Gone { pid: tid })?;
    Ok(ThreadState {
        ns_tid,
        regs,
        xstate: crate::queued::hex(&xstate),
        sigmask,
        rseq,
        robust_list,
        clear_tid,
        altstack,
        name,
        cpus,
    })
}

/// Gives stopped thread `t` the robust futex list `(head, len)` (head 0:
/// none, left so).
pub(crate) fn set_robust_list(t: &mut Tracee, (head, len): (u64, u64)) -> Result<(), ProcError> {
    if head != 0 {
        t.syscall(
            "set_robust_list",
            libc::SYS_set_robust_list,
            [head, len, 0, 0, 0, 0],
        )?;
    }
    Ok(())
}

/// Registers (or, `unregister`: `RSEQ_FLAG_UNREGISTER`, lets go) rseq area `(area, size,
/// signature)` for stopped thread `t`.
pub(crate) fn set_rseq(
    t: &mut Tracee,
    (area, size, sig): (u64, u32, u32),
    unregister: bool,
) -> Result<(), ProcError> {
    t.syscall(
        if unregister {
            "rseq (unregister)"
        } else {
            "rseq"
        },
        libc::SYS_rseq,
        [
            area,
            u64::from(size),
            u64::from(unregister),
            u64::from(sig),
            0,
            0,
        ],
    )?;
    Ok(())
}

/// Gives stopped thread `t` the CPUs `cpus` when it is let go (`false`:
/// none given, or none this host has).
fn give_cpus(t: &mut Tracee, cpus: &[usize]) -> bool {
    let mut set = nix::sched::CpuSet::new();
    for c in cpus {
        let _ = set.set(*c);
    }
    let ok = !cpus.is_empty()
        && nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(t.pid() as i32), &set).is_ok();
    if ok {
        t.set_affinity_at_release(set);
    }
    ok
}

/// Encodes `struct clone_args` for a thread (see `template::clone_args`).
fn thread_args(st: &ThreadState, tls: u64, set_tid_addr: u64) -> Vec<u8> {
    let fields: [u64; 10] = [
        THREAD_FLAGS,
        0,            // pidfd
        st.clear_tid, // child_tid (CLONE_CHILD_CLEARTID)
        0,            // parent_tid
        0,            // exit_signal: none for a thread
        0,            // stack: its registers are set before it runs
        0,            // stack_size
        tls,          // tls (CLONE_SETTLS)
        set_tid_addr, // set_tid
        1,            // set_tid_size: its TID in the innermost namespace
    ];
    fields.iter().flat_map(|f| f.to_le_bytes()).collect()
}

/// Gives stopped copy `main` (made by fork from a template) the threads
/// `states` recorded; returns them, stopped, to be let go after `main`.
/// On an error the ones made are killed, and with them the whole copy
/// (a half-made process must not run).
pub fn recreate(main: &mut Tracee, states: &[ThreadState]) -> Result<Vec<Tracee>, ProcError> {
    // (No thread kept: no frame.)
    recreate_keeping(main, states, Vec::new()).map(|(made, _)| made)
}

/// [`recreate`] for a process rolled back in place whose threads of the
/// checkpoint still run: `kept` (stopped, each with its index in `states`)
/// are set back to their state then, without being ended and made again;
/// the others of `states` are made. Returns all of them, stopped, and the
/// frames those set back by their own `rt_sigreturn` take (see
/// [`Frame`]), to be written before any runs.
pub fn recreate_keeping(
    main: &mut Tracee,
    states: &[ThreadState],
    kept: Vec<(Tracee, usize)>,
) -> Result<(Vec<Tracee>, Vec<Frame>), ProcError> {
    let mut made = Vec::with_capacity(states.len());
    if states.is_empty() {
        return Ok((made, Vec::new()));
    }
    let _here = crate::ptrace::hold_here();
    let main_cpus = main.affinity();
    let mut ready = Vec::new();
    let mut frames = Vec::new();
    let mut have = vec![None; states.len()];
    let mut kept = kept.into_iter();
    let mut failed = None;
    for (mut t, i) in kept.by_ref() {
        let Some(st) = states.get(i) else {
            // (Not one of the checkpoint's: it must not run as it is.)
            made.push(t);
            failed = Some(ProcError::Malformed {
                pid: main.pid(),
                path: "template record: thread state".into(),
            });
            break;
        };
        match own_frame(&mut t, st, main.syscall_at(), main_cpus.as_ref()) {
            Ok(Some(f)) => {
                frames.push(f);
                ready.push(t);
                have[i] = Some(FRAMED);
            }
            Ok(None) => {
                made.push(t);
                have[i] = Some(made.len() - 1);
            }
            Err(e) => {
                made.push(t);
                failed = Some(e);
                break;
            }
        }
    }
    // (Those set back by their frames are neither made nor called into.)
    let calls = have.iter().any(|h| *h != Some(FRAMED));
    let done = match failed {
        Some(e) => Err(e),
        None if calls => recreate_into(main, states, &have, &mut made, main_cpus.as_ref()),
        None => Ok(()),
    };
    match done {
        Ok(()) => {
            made.extend(ready);
            Ok((made, frames))
        }
        Err(e) => {
            let rest = kept.map(|(t, _)| t);
            for t in made.into_iter().chain(ready).chain(rest) {
                t.kill();
            }
            Err(e)
        }
    }
}

/// In `have` (see [`recreate_into`]): a kept thread set back by its frame.
const FRAMED: usize = usize::MAX;

/// `FP_XSTATE_MAGIC1` and `FP_XSTATE_MAGIC2`
/// (arch/x86/include/uapi/asm/sigcontext.h): an XSAVE area in a signal
/// frame is taken whole only between them.
const FP_XSTATE_MAGIC1: u32 = 0x4650_5853;
const FP_XSTATE_MAGIC2: u32 = 0x4650_5845;
/// Where `struct _fpx_sw_bytes` lies in an XSAVE area (`sw_reserved`).
const SW_BYTES_AT: usize = 464;
/// `XFEATURE_MASK_FPSSE`: x87 and SSE state, always restored.
const XFEATURE_MASK_FPSSE: u64 = 0x3;
/// `UC_FP_XSTATE | UC_SIGCONTEXT_SS | UC_STRICT_RESTORE_SS`, as the kernel
/// sets them delivering a signal.
const UC_FLAGS: u64 = 0x7;
/// `struct rt_sigframe` on x86-64: the return address, `struct ucontext`
/// (304 bytes), `struct siginfo` (128).
const SIGFRAME: u64 = 8 + 304 + 128;
/// The stack's red zone (x86-64 ABI), which a frame stays below.
const RED_ZONE: u64 = 128;
/// `-ERESTARTSYS`, `-ERESTARTNOHAND` (include/linux/errno.h).
const ERESTARTSYS: u64 = -512i64 as u64;
const ERESTARTNOHAND: u64 = -514i64 as u64;

/// A kept thread's state at the checkpoint as the frame `rt_sigreturn`
/// takes (registers, signal mask, alternate stack, extended state), written
/// at `at` below that checkpoint's stack pointer (memory free then, as a
/// signal handler's frame would be), once the process's pages are back: the
/// thread's first act when let go is that call, so nothing is injected into
/// it (each round trip with a thread costs tens of µs here).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub at: u64,
    pub bytes: Vec<u8>,
}

/// Sets kept thread `t` (stopped) up to put back its state at the
/// checkpoint, `st`, itself with `rt_sigreturn` (at `syscall_at`, a
/// `syscall` instruction) from the [`Frame`] returned: signals blocked
/// till then, its CPUs given (else `main_cpus`). `None` where what a frame
/// does not carry differs from `st` (rseq registration, robust list, name:
/// set by injected calls then) or its extended state is not in the form a
/// frame takes. The address its exit clears is left: only `set_tid_address`
/// changes it, which libcs call as a process starts, never in a thread.
fn own_frame(
    t: &mut Tracee,
    st: &ThreadState,
    syscall_at: u64,
    main_cpus: Option<&nix::sched::CpuSet>,
) -> Result<Option<Frame>, ProcError> {
    let tid = t.pid();
    let bad = || ProcError::Malformed {
        pid: tid,
        path: "template record: thread state".into(),
    };
    let regs = regs_from_words(&st.regs).ok_or_else(bad)?;
    let xstate = crate::queued::unhex(&st.xstate).ok_or_else(bad)?;
    let same = rseq_of(tid)? == st.rseq
        && raw::get_robust_list(tid).ok() == Some(st.robust_list)
        && std::fs::read_to_string(format!("/proc/{tid}/comm"))
            .is_ok_and(|n| n.trim_end_matches('\n') == st.name);
    let Some(frame) = same
        .then(|| sigreturn_frame(&regs, st.sigmask, st.altstack, &xstate))
        .flatten()
    else {
        return Ok(None);
    };
    if !give_cpus(t, &st.cpus)
        && let Some(cpus) = main_cpus
    {
        t.set_affinity_at_release(*cpus);
    }
    // No handler may run on the checkpoint's stack before the frame is
    // taken (which sets the mask of then).
    raw::set_sigmask(tid, u64::MAX).map_err(io_err(tid, "block signals"))?;
    let mut entry = regs;
    entry.rip = syscall_at;
    entry.rax = libc::SYS_rt_sigreturn as u64;
    entry.orig_rax = u64::MAX;
    // `rt_sigreturn` reads its frame one word below the stack pointer (the
    // return address a handler's `ret` popped).
    entry.rsp = frame.at + 8;
    t.set_saved_regs(entry);
    Ok(Some(frame))
}

/// The frame `rt_sigreturn` takes to give a thread registers `regs` (a
/// system call interrupted in them restarted, as the kernel would, since
/// the call marks none to restart), signal mask `sigmask`, alternate stack
/// `altstack` and extended state `xstate` (as ptrace reads it); `None` when
/// `xstate` is not an XSAVE area the kernel would take whole.
pub(crate) fn sigreturn_frame(
    regs: &Regs,
    sigmask: u64,
    altstack: Option<(u64, i32, u64)>,
    xstate: &[u8],
) -> Option<Frame> {
    // The area as a signal frame holds it: its size (the task's, as ptrace
    // reads it where no feature is asked for by tasks), the words saying
    // what it holds (which ptrace leaves unset), the magic word after it.
    let size = xstate.len();
    let header = xstate.get(512..520)?;
    if size < 576 || crate::raw::dynamic_xfeatures() {
        return None;
    }
    let xfeatures = u64::from_le_bytes(header.try_into().ok()?) | XFEATURE_MASK_FPSSE;
    let mut area = xstate.to_vec();
    let mut sw = Vec::with_capacity(48);
    sw.extend_from_slice(&FP_XSTATE_MAGIC1.to_le_bytes());
    sw.extend_from_slice(&(size as u32 + 4).to_le_bytes());
    sw.extend_from_slice(&xfeatures.to_le_bytes());
    sw.extend_from_slice(&(size as u32).to_le_bytes());
    sw.resize(48, 0);
    area[SW_BYTES_AT..SW_BYTES_AT + 48].copy_from_slice(&sw);
    area.extend_from_slice(&FP_XSTATE_MAGIC2.to_le_bytes());
    let mut r = *regs;
    if r.orig_rax as i64 >= 0
        && [
            ERESTARTSYS,
            ERESTARTNOINTR,
            ERESTARTNOHAND,
            ERESTART_RESTARTBLOCK,
        ]
        .contains(&r.rax)
    {
        r.rax = r.orig_rax;
        r.rip = r.rip.wrapping_sub(2);
    }
    // XRSTOR takes a 64-byte aligned area; the magic word follows it.
    let fp_at = (regs.rsp.checked_sub(RED_ZONE + size as u64 + 4)?) & !63;
    let at = fp_at.checked_sub(SIGFRAME)? & !15;
    let mut b: Vec<u8> = Vec::with_capacity((fp_at - at) as usize + size + 4);
    let mut put = |v: u64| b.extend_from_slice(&v.to_le_bytes());
    put(0); // return address (unused)
    put(UC_FLAGS);
    put(0); // uc_link
    let (sp, flags, ss_size) = altstack.unwrap_or((0, SS_DISABLE, 0));
    put(sp);
    put(u64::from(flags as u32));
    put(ss_size);
    // struct sigcontext.
    for v in [
        r.r8, r.r9, r.r10, r.r11, r.r12, r.r13, r.r14, r.r15, r.rdi, r.rsi, r.rbp, r.rbx, r.rdx,
        r.rax, r.rcx, r.rsp, r.rip, r.eflags,
    ] {
        put(v);
    }
    // cs, gs, fs, ss (16 bits each).
    put((r.cs & 0xffff) | (r.gs & 0xffff) << 16 | (r.fs & 0xffff) << 32 | (r.ss & 0xffff) << 48);
    for _ in 0..4 {
        put(0); // err, trapno, oldmask, cr2
    }
    put(fp_at);
    for _ in 0..8 {
        put(0);
    }
    put(sigmask);
    b.resize((fp_at - at) as usize, 0); // siginfo (unused), then padding
    b.extend_from_slice(&area);
    Some(Frame { at, bytes: b })
}

/// Writes `frames` into process `pid` (not through `/proc/PID/mem`, which
/// would write into a stack's guard page too).
pub fn write_frames(pid: u32, frames: &[Frame]) -> Result<(), ProcError> {
    let ranges: Vec<(u64, u64)> = frames
        .iter()
        .map(|f| (f.at, f.at + f.bytes.len() as u64))
        .collect();
    let mut from = Vec::with_capacity(frames.len());
    let mut buf = Vec::new();
    for f in frames {
        from.push(buf.len());
        buf.extend_from_slice(&f.bytes);
    }
    if raw::write_ranges(pid, &ranges, &from, &buf) == frames.len() {
        return Ok(());
    }
    Err(ProcError::Ptrace {
        pid,
        step: "write its threads' state below their stacks",
        source: std::io::Error::other("a thread's stack has no room below its checkpoint's"),
    })
}

/// [`recreate_keeping`]; `have`: for each state, where its kept thread is
/// in `made` (none: made here; [`FRAMED`]: neither); `main_cpus`: the main thread's affinity,
/// which a thread recorded without one gets. The calls go in batches
/// (`batch`): every thread made by one batch of `clone3` in `main`, then
/// each thread's own calls (rseq, robust list, alternate stack, name) in a
/// batch of its own, all of those running side by side: two round trips
/// with the process instead of five a thread.
fn recreate_into(
    main: &mut Tracee,
    states: &[ThreadState],
    have: &[Option<usize>],
    made: &mut Vec<Tracee>,
    main_cpus: Option<&nix::sched::CpuSet>,
) -> Result<(), ProcError> {
    let bad = |pid: u32| ProcError::Malformed {
        pid,
        path: "template record: thread state".into(),
    };
    let mut decoded = Vec::with_capacity(states.len());
    for st in states {
        let regs = regs_from_words(&st.regs).ok_or_else(|| bad(main.pid()))?;
        let xstate = crate::queued::unhex(&st.xstate).ok_or_else(|| bad(main.pid()))?;
        decoded.push((regs, xstate));
    }
    let mut stub = Stub::map(main)?;
    let done = make_threads(main, &mut stub, states, &decoded, have, made, main_cpus);
    // (After an error the copy is killed: the mapping goes with it.)
    done?;
    stub.unmap(main)
}

fn make_threads(
    main: &mut Tracee,
    stub: &mut Stub,
    states: &[ThreadState],
    decoded: &[(Regs, Vec<u8>)],
    have: &[Option<usize>],
    made: &mut Vec<Tracee>,
    main_cpus: Option<&nix::sched::CpuSet>,
) -> Result<(), ProcError> {
    // Which state each thread of `made` takes: the kept ones first.
    let mut of: Vec<usize> = vec![0; made.len()];
    for (i, h) in have.iter().enumerate() {
        if let Some(k) = h.filter(|k| *k != FRAMED) {
            of[k] = i;
        }
    }
    let missing: Vec<usize> = (0..states.len()).filter(|i| have[*i].is_none()).collect();
    if !missing.is_empty() {
        ending_gone(main.pid(), missing.iter().map(|&i| states[i].ns_tid));
        let mut forks = Batch::new();
        for &i in &missing {
            let (st, (regs, _)) = (&states[i], &decoded[i]);
            // clone_args, then its TID in the innermost namespace (set_tid).
            let mut args = thread_args(st, regs.fs_base, 0);
            let tid_at = args.len();
            args.extend_from_slice(&(st.ns_tid as i32).to_le_bytes());
            let a = forks.data_linked(&args, &[(8 * 8, tid_at)]);
            forks.call(
                "clone3 (a thread)",
                libc::SYS_clone3,
                [
                    a.into(),
                    (tid_at as u64).into(),
                    0.into(),
                    0.into(),
                    0.into(),
                    0.into(),
                ],
            );
        }
        let placed = stub.place(main, &forks)?;
        let (_, tids) = stub.run(main, placed, &forks).map_err(|e| match e {
            ProcError::Injected { source, .. } if source.raw_os_error() == Some(libc::EEXIST) => {
                taken_tids(main.pid(), missing.iter().map(|&i| states[i].ns_tid))
            }
            e => e,
        })?;
        if tids.len() != missing.len() {
            return Err(ProcError::Ptrace {
                pid: main.pid(),
                step: "make its threads (clone3)",
                source: std::io::Error::other(format!(
                    "{} threads made, {} wanted",
                    tids.len(),
                    missing.len()
                )),
            });
        }
        for (&i, tid) in missing.iter().zip(tids) {
            let t = main.take_made(tid)?;
            // Held from here: an error below kills it (and the copy) unrun.
            made.push(t);
            of.push(i);
        }
    }
    let kept = of.len() - missing.len();
    let mut own = Vec::with_capacity(made.len());
    for (k, (t, &i)) in made.iter_mut().zip(&of).enumerate() {
        t.share_memory_of(main);
        // Before any call: the calls run on its stack from here (a kept
        // thread's own stack pointer may lie above the checkpoint's, in
        // memory just put back).
        t.set_saved_regs(restartable(decoded[i].0));
        let mut b = Batch::new();
        if k < kept {
            reset_calls(&mut b, t, &states[i])?;
        } else {
            own_calls(&mut b, Own::all(&states[i]));
        }
        let p = stub.place(t, &b)?;
        own.push((p, b));
    }
    // Each thread's own calls, all started before any is waited for.
    for (t, (p, _)) in made.iter_mut().zip(&own) {
        stub.start(t, *p)?;
    }
    for (t, (p, b)) in made.iter_mut().zip(&own) {
        stub.finish(t, *p, b)?;
    }
    for (t, &i) in made.iter_mut().zip(&of) {
        let (st, (_, xstate)) = (&states[i], &decoded[i]);
        // Its own affinity (it was held on our CPU, as the main thread it
        // was made from, for the calls above: nothing is injected after).
        // One this host cannot give (no such CPU) is refused: then the main
        // thread's. Kept for when it is let go, which puts one back.
        if !give_cpus(t, &st.cpus)
            && let Some(cpus) = main_cpus
        {
            t.set_affinity_at_release(*cpus);
        }
        // Last: nothing injected after them may change them.
        raw::set_xstate(t.pid(), xstate).map_err(io_err(t.pid(), "set extended registers"))?;
        raw::set_sigmask(t.pid(), st.sigmask).map_err(io_err(t.pid(), "set signal mask"))?;
    }
    Ok(())
}

/// Waits (a second at most) till no task still ending holds a TID of
/// `tids` (in the PID namespace of process `pid`): a thread that was
/// ending as the process was stopped (no tracer holds it), or one of a
/// process killed by the rollback, keeps its TID till it is released, and
/// a `clone3` asking for it meanwhile is refused. A live task holding one
/// is not waited for (the `clone3` says it is taken).
fn ending_gone(pid: u32, tids: impl Iterator<Item = u32>) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
    for tid in tids {
        let path = format!("/proc/{pid}/root/proc/{tid}/stat");
        while std::fs::read_to_string(&path)
            .ok()
            .and_then(|s| crate::inspect::parse_stat(&s))
            .is_some_and(|s| s.exiting())
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
    }
}

/// The error of a `clone3` refused a TID of `tids` (in the PID namespace
/// of process `pid`) because a task holds it already: which tasks those are
/// (read through the process's own `/proc`), for whoever looks into it.
fn taken_tids(pid: u32, tids: impl Iterator<Item = u32>) -> ProcError {
    let held: Vec<String> = tids
        .filter_map(|tid| {
            let status =
                std::fs::read_to_string(format!("/proc/{pid}/root/proc/{tid}/status")).ok()?;
            let field = |k: &str| {
                status
                    .lines()
                    .find_map(|l| l.strip_prefix(k))
                    .map_or("?", str::trim)
                    .to_string()
            };
            Some(format!(
                "TID {tid} by {} (process {}, {})",
                field("Name:"),
                field("Tgid:"),
                field("State:")
            ))
        })
        .collect();
    ProcError::Ptrace {
        pid,
        step: "make its threads again (clone3 with their TIDs)",
        source: std::io::Error::other(format!(
            "a TID it needs is taken: {}",
            if held.is_empty() {
                "by a task gone since".to_string()
            } else {
                held.join("; ")
            }
        )),
    }
}

/// What thread `t`, which ran on since the checkpoint, must set of its
/// state then, `st`, as a batch: what cannot be read from outside (the
/// address cleared at its exit, its alternate stack) is set in any case,
/// its name too (as cheap as reading it); its rseq registration and robust
/// list where they differ.
fn reset_calls(b: &mut Batch, t: &Tracee, st: &ThreadState) -> Result<(), ProcError> {
    let tid = t.pid();
    let now = rseq_of(tid)?;
    if now != st.rseq
        && let Some((area, size, sig)) = now
    {
        b.call_vals(
            "rseq (unregister)",
            libc::SYS_rseq,
            [area, u64::from(size), 1, u64::from(sig), 0, 0],
        );
    }
    b.call_vals(
        "set_tid_address",
        libc::SYS_set_tid_address,
        [st.clear_tid, 0, 0, 0, 0, 0],
    );
    if raw::get_robust_list(tid).ok() != Some(st.robust_list) {
        // (A list of none is set as one of none, of the kernel's size.)
        let (head, len) = match st.robust_list {
            (0, _) => (0, ROBUST_LIST_HEAD),
            r => r,
        };
        b.call_vals(
            "set_robust_list",
            libc::SYS_set_robust_list,
            [head, len, 0, 0, 0, 0],
        );
    }
    // Registered anew where it differed; the alternate stack set (or
    // disabled) in any case.
    own_calls(
        b,
        Own {
            rseq: st.rseq.filter(|_| now != st.rseq),
            robust_list: (0, 0),
            altstack: Some(st.altstack.unwrap_or((0, SS_DISABLE, 0))),
            name: Some(&st.name),
        },
    );
    Ok(())
}

/// The part of a thread's state it must set itself (by calls injected
/// into it), each where given.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Own<'a> {
    pub rseq: Option<(u64, u32, u32)>,
    /// Its robust futex list (head 0: none set).
    pub robust_list: (u64, u64),
    pub altstack: Option<(u64, i32, u64)>,
    pub name: Option<&'a str>,
}

impl<'a> Own<'a> {
    /// All of recorded state `st`, as a thread just made needs it.
    fn all(st: &'a ThreadState) -> Own<'a> {
        Own {
            rseq: st.rseq,
            robust_list: st.robust_list,
            altstack: st.altstack,
            name: Some(&st.name),
        }
    }
}

/// The calls that set `own` (rseq, robust list, alternate stack, name),
/// added to batch `b`.
pub(crate) fn own_calls(b: &mut Batch, own: Own<'_>) {
    if let Some((area, size, sig)) = own.rseq {
        b.call_vals(
            "rseq",
            libc::SYS_rseq,
            [area, u64::from(size), 0, u64::from(sig), 0, 0],
        );
    }
    let (head, len) = own.robust_list;
    if head != 0 {
        b.call_vals(
            "set_robust_list",
            libc::SYS_set_robust_list,
            [head, len, 0, 0, 0, 0],
        );
    }
    if let Some((sp, flags, size)) = own.altstack {
        let mut ss = Vec::with_capacity(24);
        ss.extend_from_slice(&sp.to_le_bytes());
        ss.extend_from_slice(&flags.to_le_bytes());
        ss.extend_from_slice(&[0u8; 4]);
        ss.extend_from_slice(&size.to_le_bytes());
        let at = b.data(&ss);
        b.call(
            "sigaltstack",
            libc::SYS_sigaltstack,
            [at.into(), 0.into(), 0.into(), 0.into(), 0.into(), 0.into()],
        );
    }
    let Some(name) = own.name else {
        return;
    };
    let mut name = name.as_bytes().to_vec();
    name.truncate(15);
    name.push(0);
    let at = b.data(&name);
    b.call(
        "prctl(PR_SET_NAME)",
        libc::SYS_prctl,
        [
            (libc::PR_SET_NAME as u64).into(),
            at.into(),
            0.into(),
            0.into(),
            0.into(),
            0.into(),
        ],
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sigreturn_frame_holds_the_registers_mask_stack_and_extended_state_where_the_kernel_reads_them()
     {
        let w: Vec<u64> = (1..=27).map(|i| i * 0x1000).collect();
        let mut regs = regs_from_words(&w).unwrap();
        regs.rsp = 0x7fff_0000_1238;
        regs.orig_rax = u64::MAX;
        let mut xstate = vec![0u8; 2432];
        xstate[512] = 0x7; // x87, SSE, AVX in use
        xstate[0] = 0xaa;
        let Some(f) = sigreturn_frame(&regs, 0x5a5a, Some((0x1000, 0, 0x8000)), &xstate) else {
            // Only where tasks may ask for more state (AMX): then none.
            assert!(crate::raw::dynamic_xfeatures());
            return;
        };
        let word = |at: usize| u64::from_le_bytes(f.bytes[at..at + 8].try_into().unwrap());
        assert_eq!(f.at % 16, 0);
        // Return address, uc_flags, uc_link, uc_stack.
        assert_eq!((word(8), word(16)), (UC_FLAGS, 0));
        assert_eq!((word(24), word(32), word(40)), (0x1000, 0, 0x8000));
        // sigcontext (at 48): r8 first, rsp at 15, rip at 16, fpstate at 23.
        let sc = |i: usize| word(48 + 8 * i);
        assert_eq!((sc(0), sc(15), sc(16)), (regs.r8, regs.rsp, regs.rip));
        assert_eq!(sc(13), regs.rax);
        let fp = sc(23);
        assert_eq!(fp % 64, 0);
        assert!(fp > f.at && fp + 2432 + 4 <= regs.rsp - RED_ZONE);
        // The signal mask after the sigcontext (uc_sigmask).
        assert_eq!(word(8 + 296), 0x5a5a);
        let area = &f.bytes[(fp - f.at) as usize..];
        assert_eq!(area.len(), 2432 + 4);
        assert_eq!(area[0], 0xaa);
        let at32 = |a: usize| u32::from_le_bytes(area[a..a + 4].try_into().unwrap());
        assert_eq!(
            (at32(464), at32(468), at32(480)),
            (FP_XSTATE_MAGIC1, 2436, 2432)
        );
        assert_eq!(u64::from_le_bytes(area[472..480].try_into().unwrap()), 0x7);
        assert_eq!(at32(2432), FP_XSTATE_MAGIC2);
        // A call interrupted at the checkpoint is made again (the frame
        // marks none to restart).
        regs.orig_rax = 202;
        regs.rax = ERESTARTSYS;
        let f = sigreturn_frame(&regs, 0, None, &xstate).unwrap();
        let word = |at: usize| u64::from_le_bytes(f.bytes[at..at + 8].try_into().unwrap());
        assert_eq!((word(48 + 8 * 13), word(48 + 8 * 16)), (202, regs.rip - 2));
        assert_eq!(word(32), SS_DISABLE as u64);
        // Not an XSAVE area: none.
        assert!(sigreturn_frame(&regs, 0, None, &xstate[..512]).is_none());
    }

    #[test]
    fn registers_survive_words_and_hex_survives_bytes() {
        let w: Vec<u64> = (1..=27).collect();
        let r = regs_from_words(&w).unwrap();
        assert_eq!((r.r15, r.rip, r.fs_base, r.gs), (1, 17, 22, 27));
        assert_eq!(regs_to_words(&r), w);
        assert!(regs_from_words(&w[..26]).is_none());
        let b = vec![0u8, 1, 0xab, 0xff];
        assert_eq!(crate::queued::unhex(&crate::queued::hex(&b)).unwrap(), b);
        assert!(crate::queued::unhex("zz").is_none());
    }
}
