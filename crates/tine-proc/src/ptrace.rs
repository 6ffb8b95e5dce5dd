//! Syscall injection with ptrace: a process is stopped where it is, made to
//! execute system calls of our choosing (a `syscall` instruction of its vDSO
//! runs them), and put back exactly as it was.
//!
//! The stop protocol (see MACHINE.md, "Native fork by ptrace"):
//! - `PTRACE_SEIZE` then `PTRACE_INTERRUPT`; a process already stopped by a
//!   signal re-traps by itself when seized.
//! - Each injected call: registers pointing at the `syscall` instruction, the
//!   call number in `rax`, `orig_rax = -1` (so the kernel never "restarts"
//!   the interrupted call with our registers), one single step.
//! - The saved registers go back at the signal-delivery stop that ends the last
//!   step. The kernel's restart logic then sees the original registers, so a
//!   `read` or `sleep` the stop interrupted is restarted, not failed.
//! - A fork's child is attached automatically and starts at an event stop.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use nix::errno::Errno;
use nix::libc;
use nix::sched::{CpuSet, sched_getaffinity, sched_getcpu, sched_setaffinity};
use nix::sys::ptrace::{self, Event, Options};
use nix::sys::signal::Signal;
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;

/// The sentinel for the calling process (`linux/fcntl.h`, 6.14 and later).
const PIDFD_SELF_THREAD_GROUP: i64 = -10001;

/// Ranges per injected `process_madvise` (their iovecs go below the stack).
const MADVISE_BATCH: usize = 256;

use crate::inspect::ProcError;

pub type Regs = libc::user_regs_struct;

/// The x86-64 red zone: the 128 bytes below the stack pointer that leaf
/// functions may use without moving it; scratch data goes below it.
const RED_ZONE: u64 = 128;

thread_local! {
    /// How many [`HeldHere`] guards this thread holds, and its affinity
    /// before the first.
    static HELD: std::cell::Cell<(usize, Option<CpuSet>)> = const { std::cell::Cell::new((0, None)) };
}

/// Keeps the calling thread on the CPU it runs on while it lives (nested
/// guards share the first's), so that the processes it injects calls into,
/// held on that CPU too (see [`Tracee::colocate`]), never wait for a wakeup
/// from the other CPU. Not `Send`: it puts back this thread's affinity.
#[derive(Debug)]
pub struct HeldHere(std::marker::PhantomData<*const ()>);

/// Holds the calling thread on its CPU until the guard is dropped.
pub fn hold_here() -> HeldHere {
    HELD.with(|h| {
        let (depth, before) = h.get();
        let me = Pid::from_raw(0);
        let before = if depth == 0 {
            let mine = sched_getaffinity(me).ok();
            let mut here = CpuSet::new();
            match (mine, sched_getcpu()) {
                (Some(mine), Ok(cpu))
                    if here.set(cpu).is_ok() && sched_setaffinity(me, &here).is_ok() =>
                {
                    Some(mine)
                }
                _ => None,
            }
        } else {
            before
        };
        h.set((depth + 1, before));
    });
    HeldHere(std::marker::PhantomData)
}

/// While it lives, the calling thread runs before any ordinary thread on
/// its CPU (`SCHED_FIFO`, lowest priority; not passed on to what it
/// starts): for letting go of a stopped program's threads one by one. A
/// thread let go that takes the CPU held by [`hold_here`] (a BLAS worker
/// spinning, a program computing) kept the rest stopped for a scheduler's
/// time slice, up to 6 ms, where letting go of all takes 0.05. Without
/// the privilege it asks for, nothing changes. Not `Send`: it puts back
/// this thread's policy.
#[derive(Debug)]
pub struct Urgent {
    before: Option<(i32, i32)>,
    _here: std::marker::PhantomData<*const ()>,
}

/// Makes the calling thread [`Urgent`] until the guard is dropped: one of
/// an ordinary policy only (a thread already real-time, or run so by its
/// user, keeps its own).
pub fn urgent() -> Urgent {
    let ordinary = [libc::SCHED_OTHER, libc::SCHED_BATCH, libc::SCHED_IDLE];
    let before = crate::raw::sched_policy().ok().filter(|&(policy, _)| {
        ordinary.contains(&(policy & !libc::SCHED_RESET_ON_FORK))
            && crate::raw::set_sched_policy(libc::SCHED_FIFO | libc::SCHED_RESET_ON_FORK, 1).is_ok()
    });
    Urgent {
        before,
        _here: std::marker::PhantomData,
    }
}

impl Drop for Urgent {
    fn drop(&mut self) {
        if let Some((policy, priority)) = self.before {
            let _ = crate::raw::set_sched_policy(policy, priority);
        }
    }
}

/// The CPUs the calling thread may use apart from any [`HeldHere`] guard it
/// holds: its affinity before the first guard, or now.
pub fn allowed_cpus() -> Option<CpuSet> {
    HELD.with(|h| h.get().1)
        .or_else(|| sched_getaffinity(Pid::from_raw(0)).ok())
}

impl Drop for HeldHere {
    fn drop(&mut self) {
        HELD.with(|h| {
            let (depth, before) = h.get();
            if depth <= 1 {
                if let Some(set) = before {
                    let _ = sched_setaffinity(Pid::from_raw(0), &set);
                }
                h.set((0, None));
            } else {
                h.set((depth - 1, before));
            }
        });
    }
}

/// A process stopped under our ptrace control.
///
/// Dropping it without [`Tracee::resume`] or [`Tracee::park`] puts its
/// registers back and lets it run, so an error never leaves a program stopped
/// in the middle of an injected call. A `Tracee` exists only once its
/// registers were read, so there is always something true to put back.
#[derive(Debug)]
pub struct Tracee {
    pid: Pid,
    /// The registers at the stop, put back when we let go.
    saved: Regs,
    /// Where a `syscall` instruction is (in the vDSO).
    syscall_at: u64,
    /// `/proc/PID/mem`, opened at the first write.
    mem: Option<File>,
    /// Its `fdinfo` files, opened before it stopped, where given
    /// ([`Tracee::use_fdinfos`]).
    fdinfos: crate::fdtable::FdInfos,
    /// Whether a single step ended the last stop (a signal-delivery stop,
    /// where registers can be put back safely).
    stepped: bool,
    /// Signals that arrived while we held the process, delivered when we let go.
    deferred: Vec<Signal>,
    released: bool,
    /// The CPU affinity to put back when we let go, once we held it on our
    /// CPU (see [`Tracee::colocate`]) or were told what it must be.
    put_back: Option<CpuSet>,
    /// The CPU we hold it on.
    on_cpu: Option<usize>,
    /// Parked, it blocks every signal it can (see
    /// [`Tracee::block_signals_when_parked`]).
    block_parked: bool,
    /// Pages still being written into it by another thread (`pusher`), and
    /// what ends that: done before it runs or its memory there is touched.
    settle: Option<Settle>,
    /// Calls left to make before it runs (see [`Tracee::call_later`]).
    later: crate::batch::Batch,
    /// Its memory is partly its template's already (pages pushed ahead of
    /// a rollback in place): dropped unfinished, it is killed, not let go.
    altered: bool,
}

/// Work on a held process's memory under way elsewhere (see
/// [`Tracee::settle_later`]).
pub(crate) struct Settle {
    /// Sorted: where that work writes.
    ranges: Vec<(u64, u64)>,
    finish: Finish,
}

type Finish = Box<dyn FnOnce(&mut Tracee) -> Result<(), ProcError> + Send>;

impl std::fmt::Debug for Settle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Settle")
            .field("ranges", &self.ranges.len())
            .finish_non_exhaustive()
    }
}

fn perr(pid: Pid, step: &'static str) -> impl FnOnce(Errno) -> ProcError {
    move |e| {
        if e == Errno::ESRCH {
            ProcError::Gone {
                pid: pid.as_raw() as u32,
            }
        } else {
            ProcError::Ptrace {
                pid: pid.as_raw() as u32,
                step,
                source: std::io::Error::from_raw_os_error(e as i32),
            }
        }
    }
}

/// A raw system call result as a `Result`: -4095..-1 are errnos.
pub fn check(pid: u32, call: &'static str, r: i64) -> Result<u64, ProcError> {
    if (-4095..0).contains(&r) {
        return Err(ProcError::Injected {
            pid,
            call,
            source: std::io::Error::from_raw_os_error(-r as i32),
        });
    }
    Ok(r as u64)
}

fn wait_for(pid: Pid) -> Result<WaitStatus, ProcError> {
    loop {
        match waitpid(pid, Some(WaitPidFlag::__WALL)) {
            Err(Errno::EINTR) => continue,
            other => return other.map_err(perr(pid, "wait for stop")),
        }
    }
}

/// Waits until an attached process reports the stop we asked for (an event
/// stop); signals that arrive first are returned, to be delivered later.
fn wait_stop(pid: Pid) -> Result<Vec<Signal>, ProcError> {
    let mut deferred = Vec::new();
    loop {
        match wait_for(pid)? {
            WaitStatus::PtraceEvent(_, _, ev) if ev == Event::PTRACE_EVENT_STOP as i32 => {
                return Ok(deferred);
            }
            WaitStatus::Exited(..) | WaitStatus::Signaled(..) => {
                return Err(ProcError::Gone {
                    pid: pid.as_raw() as u32,
                });
            }
            status => {
                if let WaitStatus::Stopped(_, sig) = status {
                    deferred.push(sig);
                }
                ptrace::cont(pid, None).map_err(perr(pid, "continue to the stop"))?;
            }
        }
    }
}

/// What stopped a tracee running injected calls (see `Tracee::next_turn`).
enum Turn {
    /// The trap that ends them.
    Trap,
    /// A fork or clone event: the process or thread made.
    Made(u32),
    /// An `execve` that succeeded.
    Exec,
    /// Anything else (a signal held back, a group stop).
    Other,
}

/// `PTRACE_O_SUSPEND_SECCOMP` (not in nix).
fn suspend_seccomp() -> Options {
    Options::from_bits_retain(1 << 21)
}

impl Tracee {
    /// Seizes `pid` and stops it. A process that is stopped already (a
    /// template) re-traps by itself and is taken at its group stop.
    pub fn seize(pid: u32) -> Result<Tracee, ProcError> {
        Tracee::seize_at(pid, find_syscall_instruction(pid)?)
    }

    /// Checks that a `syscall` instruction is where it was said to be (its
    /// template's, say: a fork inherits the vDSO; or one found while it
    /// ran) by two bytes read once stopped; else (moved, or 0) finds one as
    /// [`Tracee::seize`] does, reading its whole memory map.
    pub fn expect_syscall_at(&mut self) -> Result<(), ProcError> {
        let mut code = [0u8; 2];
        let read = nix::sys::uio::process_vm_readv(
            self.pid,
            &mut [std::io::IoSliceMut::new(&mut code)],
            &[nix::sys::uio::RemoteIoVec {
                base: self.syscall_at as usize,
                len: 2,
            }],
        );
        if self.syscall_at == 0 || read != Ok(2) || code != [0x0f, 0x05] {
            self.syscall_at = find_syscall_instruction(self.pid())?;
        }
        Ok(())
    }

    /// [`Tracee::seize`] with the address of its `syscall` instruction known
    /// already (a template's is its origin's: the vDSO is inherited).
    pub fn seize_at(pid: u32, syscall_at: u64) -> Result<Tracee, ProcError> {
        Tracee::seize_all_at(&[pid], syscall_at)
            .pop()
            .expect("one result per PID")
    }

    /// [`Tracee::seize_at`] of several processes (a process's threads):
    /// every one is attached and asked to stop first, so that they stop
    /// together rather than one after another. One result per PID.
    pub fn seize_all_at(pids: &[u32], syscall_at: u64) -> Vec<Result<Tracee, ProcError>> {
        let attached: Vec<Result<Pid, ProcError>> = pids
            .iter()
            .map(|&pid| {
                let p = Pid::from_raw(pid as i32);
                let opts = Options::PTRACE_O_TRACEFORK | Options::PTRACE_O_TRACECLONE;
                // A sandbox's processes run under a seccomp filter that
                // refuses some of what is injected (`clone3`, namespace
                // flags): suspended while attached, for a tracer with the
                // host's CAP_SYS_ADMIN. Without it (an unprivileged tine,
                // whose processes have no filter) plainly.
                ptrace::seize(p, opts | suspend_seccomp())
                    .or_else(|e| match e {
                        Errno::EPERM | Errno::EINVAL => ptrace::seize(p, opts),
                        e => Err(e),
                    })
                    .map_err(|e| match e {
                        // One that ended since it was listed (a shell's
                        // command, a zombie till the shell reaps it) is
                        // refused so: gone, as one reaped is.
                        Errno::EPERM if crate::stat(pid).map_or(true, |s| s.exiting()) => {
                            ProcError::Gone { pid }
                        }
                        e => perr(p, "attach (PTRACE_SEIZE)")(e),
                    })?;
                if let Err(e) = ptrace::interrupt(p).map_err(perr(p, "stop (PTRACE_INTERRUPT)")) {
                    let _ = ptrace::detach(p, None);
                    return Err(e);
                }
                Ok(p)
            })
            .collect();
        attached
            .into_iter()
            .map(|a| {
                let p = a?;
                let held = Tracee::at_stop(p, syscall_at);
                if held.is_err() {
                    // Nothing was changed yet: let it go as it is.
                    let _ = ptrace::detach(p, None);
                }
                held
            })
            .collect()
    }

    /// Takes an attached process at its next stop: a seized one after the
    /// interrupt, or the child of a fork we injected (attached already).
    fn at_stop(pid: Pid, syscall_at: u64) -> Result<Tracee, ProcError> {
        let deferred = wait_stop(pid)?;
        let saved = ptrace::getregs(pid).map_err(perr(pid, "read registers"))?;
        Ok(Tracee {
            pid,
            saved,
            syscall_at,
            mem: None,
            fdinfos: Default::default(),
            stepped: false,
            deferred,
            released: false,
            put_back: None,
            on_cpu: None,
            block_parked: false,
            settle: None,
            later: crate::batch::Batch::new(),
            altered: false,
        })
    }

    /// When parked ([`Tracee::park`]), it blocks every signal but `SIGKILL`
    /// and `SIGSTOP` (which cannot be): a parked template or spare sits in
    /// the sandbox's PID namespace, where a `pkill`, `killall` or
    /// `kill -TERM -1` of the program's would otherwise end it too (a
    /// stopped process is ended at once by a signal whose default action
    /// is to end it). Signals sent to it stay pending, and a fork does not
    /// inherit them. Whoever seizes it again puts its own mask back before
    /// anything reads or forks it (`template::seize_template`).
    pub fn block_signals_when_parked(&mut self) {
        self.block_parked = true;
    }

    /// Parks it as it is (see [`Tracee::block_signals_when_parked`]).
    pub fn leave_signals_when_parked(&mut self) {
        self.block_parked = false;
    }

    /// Holds the process on the CPU this thread runs on, so that each
    /// injected call is a switch on one CPU rather than a wakeup of another
    /// CPU each way (tens of µs in a VM, several per call). Its affinity
    /// goes back when we let go; processes it makes meanwhile inherit the
    /// hold and get the same affinity back.
    fn colocate(&mut self) {
        let Ok(cpu) = sched_getcpu() else {
            return;
        };
        if self.on_cpu == Some(cpu) {
            return;
        }
        if self.put_back.is_none() {
            match sched_getaffinity(self.pid) {
                Ok(set) => self.put_back = Some(set),
                Err(_) => return,
            }
        }
        let mut here = CpuSet::new();
        // A CPU its cpuset does not allow is refused: it stays where it is.
        if here.set(cpu).is_ok() && sched_setaffinity(self.pid, &here).is_ok() {
            self.on_cpu = Some(cpu);
        }
    }

    /// Its CPU affinity as it was before we held it on our CPU.
    pub fn affinity(&self) -> Option<CpuSet> {
        self.put_back.or_else(|| sched_getaffinity(self.pid).ok())
    }

    /// The CPU affinity it gets when we let go (instead of its own).
    pub fn set_affinity_at_release(&mut self, set: CpuSet) {
        self.put_back = Some(set);
    }

    /// Puts its affinity back (or sets the one it was given).
    fn unpin(&mut self) {
        if let Some(set) = self.put_back.take() {
            let _ = sched_setaffinity(self.pid, &set);
        }
        self.on_cpu = None;
    }

    /// The address of the `syscall` instruction injected calls run through.
    pub fn syscall_at(&self) -> u64 {
        self.syscall_at
    }

    /// Makes the process execute `path` with `argv` and `envp` (an injected
    /// `execve`): it becomes that program, running, and is let go. On an
    /// error it is the same process as before (and put back when dropped).
    pub fn execve(mut self, path: &[u8], argv: &[&[u8]], envp: &[&[u8]]) -> Result<(), ProcError> {
        // One block below the red zone: the two pointer arrays, then the
        // NUL-terminated strings they point to.
        let strings: Vec<&[u8]> = std::iter::once(path)
            .chain(argv.iter().copied())
            .chain(envp.iter().copied())
            .collect();
        let ptrs = (argv.len() + 1 + envp.len() + 1) * 8;
        let len = ptrs + strings.iter().map(|s| s.len() + 1).sum::<usize>();
        let base = (self.saved.rsp - RED_ZONE - len as u64) & !15;
        let mut at = base + ptrs as u64;
        let mut addrs = Vec::with_capacity(strings.len());
        let mut text = Vec::new();
        for s in &strings {
            addrs.push(at);
            text.extend_from_slice(s);
            text.push(0);
            at += s.len() as u64 + 1;
        }
        let mut block = Vec::with_capacity(len);
        let (argv_at, envp_at) = (&addrs[1..1 + argv.len()], &addrs[1 + argv.len()..]);
        for a in argv_at.iter().chain([&0]).chain(envp_at).chain([&0]) {
            block.extend_from_slice(&a.to_le_bytes());
        }
        block.extend_from_slice(&text);
        self.poke(base, &block)?;
        let argv_addr = base;
        let envp_addr = base + (argv.len() as u64 + 1) * 8;
        ptrace::setoptions(
            self.pid,
            Options::PTRACE_O_TRACEFORK
                | Options::PTRACE_O_TRACECLONE
                | Options::PTRACE_O_TRACEEXEC,
        )
        .map_err(perr(self.pid, "set options"))?;
        let r = self.syscall_inner(
            libc::SYS_execve,
            [addrs[0], argv_addr, envp_addr, 0, 0, 0],
            None,
        )?;
        check(self.pid(), "execve", r)?;
        // The old registers mean nothing to the new program: let it run as is.
        self.unpin();
        self.released = true;
        self.deferred.clear();
        ptrace::detach(self.pid, None).map_err(perr(self.pid, "detach"))
    }

    /// Ends the process with an injected `exit(0)` (a go-between made for
    /// one fork) and hears of its end as its tracer, so that its parent can
    /// reap it. One that does not end so is killed.
    pub fn exit(mut self) {
        match self.syscall_inner(libc::SYS_exit, [0; 6], None) {
            Err(ProcError::Gone { .. }) => {}
            _ => self.kill(),
        }
    }

    /// Ends threads `ts` (held) with an injected `exit(0)` each, all on
    /// their way before any is waited for (one at a time, each exit is a
    /// round trip of wakeups). One whose call cannot be set up ends as
    /// [`Tracee::exit`] ends it.
    pub fn exit_all(ts: Vec<Tracee>) {
        let mut going = Vec::with_capacity(ts.len());
        for t in ts {
            let r = t.call_regs(libc::SYS_exit, [0; 6]);
            if ptrace::setregs(t.pid, r).is_ok() && ptrace::cont(t.pid, None).is_ok() {
                going.push(t);
            } else {
                t.exit();
            }
        }
        for mut t in going {
            t.released = true;
            loop {
                match waitpid(t.pid, Some(WaitPidFlag::__WALL)) {
                    Ok(WaitStatus::Exited(..) | WaitStatus::Signaled(..)) | Err(_) => break,
                    // (A signal it took on its way out is dropped with it,
                    // as `exit` drops it.)
                    Ok(_) => {
                        let _ = ptrace::cont(t.pid, None);
                    }
                }
            }
        }
    }

    /// Ends the whole process with an injected `exit_group(code)`, heard of
    /// as its tracer: its parent finds it a zombie with that status.
    pub fn exit_group(mut self, code: i32) {
        match self.syscall_inner(libc::SYS_exit_group, [code as u64, 0, 0, 0, 0, 0], None) {
            Err(ProcError::Gone { .. }) => {}
            _ => self.kill(),
        }
    }

    /// Calls are injected through the `syscall` instruction at `addr` from
    /// now on (its vDSO was moved).
    pub fn set_syscall_at(&mut self, addr: u64) {
        self.syscall_at = addr;
    }

    /// Lets the process run into the fatal signal it has pending (or held
    /// back here) and hears of its end as its tracer before returning, so
    /// that its parent finds it a zombie with that status already. (Let go
    /// instead, it could still be alive when the caller's next step kills
    /// what it does not know, and end by that `SIGKILL`.) One that has not
    /// ended within a second is killed.
    pub fn run_to_end(mut self) {
        self.released = true;
        self.unpin();
        let pid = self.pid;
        let _ = ptrace::setregs(pid, self.saved);
        for s in std::mem::take(&mut self.deferred) {
            let _ = nix::sys::signal::kill(pid, s);
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
        let mut pass = None;
        loop {
            if ptrace::cont(pid, pass).is_err() {
                break;
            }
            let status = loop {
                match waitpid(pid, Some(WaitPidFlag::__WALL | WaitPidFlag::WNOHANG)) {
                    Ok(WaitStatus::StillAlive) | Err(Errno::EINTR)
                        if std::time::Instant::now() < deadline =>
                    {
                        std::thread::sleep(std::time::Duration::from_micros(50));
                    }
                    other => break other,
                }
            };
            match status {
                Ok(WaitStatus::Exited(..) | WaitStatus::Signaled(..)) => return,
                Ok(WaitStatus::Stopped(_, s)) => pass = Some(s),
                Ok(WaitStatus::StillAlive) => break,
                Ok(_) => pass = None,
                Err(_) => return,
            }
        }
        self.kill();
    }

    /// Kills the process (a copy that could not be finished) and forgets it.
    pub fn kill(mut self) {
        self.end();
    }

    /// Kills it (see [`Tracee::kill`]), through a handle that stays.
    fn end(&mut self) {
        self.released = true;
        let _ = nix::sys::signal::kill(self.pid, Signal::SIGKILL);
        // As its tracer we hear of its end first: until we have, its parent
        // cannot reap it (and a PID 1 above it waits for it forever).
        loop {
            match waitpid(self.pid, Some(WaitPidFlag::__WALL)) {
                Ok(WaitStatus::Exited(..) | WaitStatus::Signaled(..)) | Err(_) => break,
                Ok(_) => {}
            }
        }
    }

    pub fn pid(&self) -> u32 {
        self.pid.as_raw() as u32
    }

    /// The registers the process had when it was stopped.
    pub fn saved_regs(&self) -> &Regs {
        &self.saved
    }

    /// Replaces the registers the process will continue with.
    pub fn set_saved_regs(&mut self, regs: Regs) {
        self.saved = regs;
    }

    /// Runs one system call in the process and returns its raw result
    /// (a negative errno on failure).
    pub fn syscall_raw(&mut self, nr: i64, args: [u64; 6]) -> Result<i64, ProcError> {
        self.syscall_inner(nr, args, None)
    }

    /// Runs one system call; a failure is [`ProcError::Injected`] naming `call`.
    pub fn syscall(
        &mut self,
        call: &'static str,
        nr: i64,
        args: [u64; 6],
    ) -> Result<u64, ProcError> {
        let r = self.syscall_raw(nr, args)?;
        check(self.pid(), call, r)
    }

    /// Its saved registers set to make system call `nr` with `args` at its
    /// `syscall` instruction.
    fn call_regs(&self, nr: i64, args: [u64; 6]) -> Regs {
        let mut r = self.saved;
        r.rip = self.syscall_at;
        r.rax = nr as u64;
        r.orig_rax = u64::MAX;
        r.rdi = args[0];
        r.rsi = args[1];
        r.rdx = args[2];
        r.r10 = args[3];
        r.r8 = args[4];
        r.r9 = args[5];
        r
    }

    fn syscall_inner(
        &mut self,
        nr: i64,
        args: [u64; 6],
        mut child: Option<&mut Option<Pid>>,
    ) -> Result<i64, ProcError> {
        self.colocate();
        ptrace::setregs(self.pid, self.call_regs(nr, args))
            .map_err(perr(self.pid, "set registers"))?;
        ptrace::step(self.pid, None).map_err(perr(self.pid, "single-step"))?;
        loop {
            match self.next_turn("single-step an injected call")? {
                Turn::Trap => break,
                Turn::Made(new) => {
                    if let Some(slot) = child.as_deref_mut() {
                        *slot = Some(Pid::from_raw(new as i32));
                    }
                }
                // An injected execve succeeded: the new program is not
                // stepped into (detaching ends the single step).
                Turn::Exec => {
                    self.stepped = true;
                    return Ok(0);
                }
                // (A signal held back: the call is restarted by the kernel,
                // we are at its entry again.)
                Turn::Other => {}
            }
            ptrace::step(self.pid, None).map_err(perr(self.pid, "single-step"))?;
        }
        self.stepped = true;
        let after = ptrace::getregs(self.pid).map_err(perr(self.pid, "read registers"))?;
        Ok(after.rax as i64)
    }

    /// `madvise(advice)` of every range of `ranges` (sorted, disjoint): many
    /// at once by one `process_madvise` of its own memory, which the kernel
    /// allows a process with any advice (6.14 and later), else one `madvise`
    /// each. The iovecs go into the scratch area.
    pub fn madvise_all(&mut self, ranges: &[(u64, u64)], advice: u64) -> Result<(), ProcError> {
        let one_by_one = |t: &mut Tracee, ranges: &[(u64, u64)]| {
            ranges.iter().try_for_each(|&(at, end)| {
                t.syscall(
                    "madvise",
                    libc::SYS_madvise,
                    [at, end - at, advice, 0, 0, 0],
                )
                .map(|_| ())
            })
        };
        for batch in ranges.chunks(MADVISE_BATCH) {
            if batch.len() == 1 {
                one_by_one(self, batch)?;
                continue;
            }
            let iov: Vec<u8> = batch
                .iter()
                .flat_map(|&(at, end)| at.to_le_bytes().into_iter().chain((end - at).to_le_bytes()))
                .collect();
            let total: u64 = batch.iter().map(|(a, b)| b - a).sum();
            let at = self.scratch(0, &iov)?;
            let r = self.syscall_raw(
                libc::SYS_process_madvise,
                [
                    PIDFD_SELF_THREAD_GROUP as u64,
                    at,
                    batch.len() as u64,
                    advice,
                    0,
                    0,
                ],
            )?;
            // Refused (an older kernel) or cut short: each range again (an
            // advice given twice is given once).
            if r != total as i64 {
                one_by_one(self, batch)?;
            }
        }
        Ok(())
    }

    /// Runs `clone3` with `args` (a `struct clone_args`, written into the
    /// scratch area 64 bytes down, below what a caller put at its top) and
    /// returns the new process, stopped and attached.
    pub fn clone3(&mut self, args: &[u8]) -> Result<Tracee, ProcError> {
        let at = self.scratch(64, args)?;
        let size = args.len() as u64;
        let mut child = None;
        let r = self.syscall_inner(libc::SYS_clone3, [at, size, 0, 0, 0, 0], Some(&mut child))?;
        let r = check(self.pid(), "clone3", r)?;
        let pid = child.unwrap_or(Pid::from_raw(r as i32));
        let mut made = Tracee::at_stop(pid, self.syscall_at)?;
        // It inherited our hold: it gets the affinity we put back.
        made.put_back = self.put_back;
        made.on_cpu = self.on_cpu;
        Ok(made)
    }

    /// Runs its code at `rip` from its saved registers, with `rbx` and
    /// `r12` set, without waiting for it to trap ([`Tracee::wait_made`]):
    /// the way a batch of calls runs (`batch`).
    pub(crate) fn start_at(&mut self, rip: u64, rbx: u64, r12: u64) -> Result<(), ProcError> {
        self.colocate();
        let mut r = self.saved;
        r.rip = rip;
        r.rbx = rbx;
        r.r12 = r12;
        r.orig_rax = u64::MAX;
        ptrace::setregs(self.pid, r).map_err(perr(self.pid, "set registers"))?;
        self.stepped = true;
        ptrace::cont(self.pid, None).map_err(perr(self.pid, "continue"))
    }

    /// Waits for code started by [`Tracee::start_at`] to trap (`int3`):
    /// its registers then, and the threads or processes it made meanwhile
    /// (each stopped by the kernel as it was made, not yet waited for).
    /// Signals that come meanwhile wait until it is let go.
    pub(crate) fn wait_made(&mut self) -> Result<(Regs, Vec<u32>), ProcError> {
        let mut made = Vec::new();
        loop {
            match self.next_turn("run injected calls")? {
                Turn::Trap => break,
                Turn::Made(new) => made.push(new),
                Turn::Exec | Turn::Other => {}
            }
            ptrace::cont(self.pid, None).map_err(perr(self.pid, "continue"))?;
        }
        let after = ptrace::getregs(self.pid).map_err(perr(self.pid, "read registers"))?;
        Ok((after, made))
    }

    /// What stopped it next while it runs injected calls (`step` names
    /// them in errors). A signal that comes meanwhile is held back until
    /// it is let go; one that comes back every time is a fault: the calls
    /// never run.
    fn next_turn(&mut self, step: &'static str) -> Result<Turn, ProcError> {
        match wait_for(self.pid)? {
            WaitStatus::Stopped(_, Signal::SIGTRAP) => Ok(Turn::Trap),
            WaitStatus::PtraceEvent(_, _, ev)
                if ev == Event::PTRACE_EVENT_FORK as i32
                    || ev == Event::PTRACE_EVENT_CLONE as i32 =>
            {
                let new = ptrace::getevent(self.pid).map_err(perr(self.pid, "read fork event"))?;
                Ok(Turn::Made(new as u32))
            }
            WaitStatus::PtraceEvent(_, _, ev) if ev == Event::PTRACE_EVENT_EXEC as i32 => {
                Ok(Turn::Exec)
            }
            WaitStatus::Stopped(_, sig) => {
                if self.deferred.iter().filter(|s| **s == sig).count() >= 32 {
                    return Err(ProcError::Ptrace {
                        pid: self.pid(),
                        step,
                        source: std::io::Error::other(format!(
                            "{sig} at every step (the process faults)"
                        )),
                    });
                }
                self.deferred.push(sig);
                Ok(Turn::Other)
            }
            WaitStatus::Exited(..) | WaitStatus::Signaled(..) => {
                self.released = true;
                Err(ProcError::Gone { pid: self.pid() })
            }
            _ => Ok(Turn::Other),
        }
    }

    /// Takes thread (or process) `tid`, made by this one while traced (see
    /// [`Tracee::wait_made`]), at its first stop.
    pub(crate) fn take_made(&self, tid: u32) -> Result<Tracee, ProcError> {
        let mut made = Tracee::at_stop(Pid::from_raw(tid as i32), self.syscall_at)?;
        made.put_back = self.put_back;
        made.on_cpu = self.on_cpu;
        Ok(made)
    }

    /// Takes `infos`, the process's `fdinfo` files opened before it
    /// stopped, for reading its descriptor table inside the pause
    /// ([`crate::fdtable::fd_table_with`]).
    pub fn use_fdinfos(&mut self, infos: crate::fdtable::FdInfos) {
        self.fdinfos = infos;
    }

    /// Its `fdinfo` files given by [`Tracee::use_fdinfos`] (none: empty).
    pub(crate) fn fdinfos(&self) -> &crate::fdtable::FdInfos {
        &self.fdinfos
    }

    /// Writes into its memory through `thread`'s descriptor of it from now
    /// on: `thread` is another thread of the same process (one memory), and
    /// opening `/proc/TID/mem` again would cost tens of µs.
    pub fn share_memory_of(&mut self, thread: &mut Tracee) {
        if self.mem.is_none() {
            self.mem = thread.memory().ok().and_then(|f| f.try_clone().ok());
        }
    }

    /// Leaves `finish` to run before the process runs again or its memory
    /// in `ranges` (sorted) is read or written through this handle: another
    /// thread writes there meanwhile (see `pusher`). Not for memory a call
    /// injected meanwhile may touch other than through this handle's
    /// scratch or pokes.
    pub(crate) fn settle_later(
        &mut self,
        ranges: Vec<(u64, u64)>,
        finish: impl FnOnce(&mut Tracee) -> Result<(), ProcError> + Send + 'static,
    ) {
        // After one under way already (pages pushed ahead): that first.
        self.settle = Some(match self.settle.take() {
            None => Settle {
                ranges,
                finish: Box::new(finish),
            },
            Some(before) => {
                let mut all = before.ranges;
                all.extend(ranges);
                all.sort_unstable();
                Settle {
                    ranges: all,
                    finish: Box::new(move |t: &mut Tracee| {
                        (before.finish)(t)?;
                        finish(t)
                    }),
                }
            }
        });
    }

    /// Marks its memory as changed already: from here it must be finished
    /// or killed, never let go as it is ([`Drop`]).
    pub fn altered(&mut self) {
        self.altered = true;
    }

    /// Calls to make before it runs, whose order among the other calls
    /// injected meanwhile does not matter: they go in one batch with the
    /// next one (`remake`), or at [`Tracee::make_later_calls`], instead of a
    /// round trip each. Not for a process whose memory another shares
    /// (`CLONE_VM`): their arguments may be written below its stack pointer
    /// when they are made, where calls injected into the other write too.
    pub(crate) fn call_later(&mut self) -> &mut crate::batch::Batch {
        &mut self.later
    }

    /// Takes the calls [`Tracee::call_later`] left, to make them now.
    pub(crate) fn take_later(&mut self) -> crate::batch::Batch {
        std::mem::take(&mut self.later)
    }

    /// Makes the calls [`Tracee::call_later`] left, if any.
    pub fn make_later_calls(&mut self) -> Result<(), ProcError> {
        let later = self.take_later();
        if later.is_empty() {
            return Ok(());
        }
        crate::batch::run_in(self, &later).map(|_| ())
    }

    /// Ends what [`Tracee::settle_later`] left, if anything.
    pub fn settle(&mut self) -> Result<(), ProcError> {
        match self.settle.take() {
            Some(s) => (s.finish)(self),
            None => Ok(()),
        }
    }

    fn settle_touching(&mut self, addr: u64, len: usize) -> Result<(), ProcError> {
        let end = addr.saturating_add(len as u64);
        let touches = self.settle.as_ref().is_some_and(|s| {
            let i = s.ranges.partition_point(|&(_, b)| b <= addr);
            s.ranges.get(i).is_some_and(|&(a, _)| a < end)
        });
        if touches { self.settle() } else { Ok(()) }
    }

    /// Writes `bytes` into the process's memory below its stack's red zone,
    /// `below` bytes further down, and returns their address. The area is
    /// unused by definition; a signal handler would overwrite it just the same.
    pub fn scratch(&mut self, below: u64, bytes: &[u8]) -> Result<u64, ProcError> {
        let addr = self.scratch_address(below, bytes.len());
        self.poke(addr, bytes)?;
        Ok(addr)
    }

    /// Where [`Tracee::scratch`] would write `len` bytes.
    pub(crate) fn scratch_address(&self, below: u64, len: usize) -> u64 {
        (self.saved.rsp - RED_ZONE - below - len as u64) & !15
    }

    /// Injects an anonymous private read-write `mmap` of `len` bytes (named
    /// `call` in errors); its address.
    pub(crate) fn map_anonymous(&mut self, call: &'static str, len: u64) -> Result<u64, ProcError> {
        self.syscall(
            call,
            libc::SYS_mmap,
            [
                0,
                len,
                (libc::PROT_READ | libc::PROT_WRITE) as u64,
                (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS) as u64,
                u64::MAX,
                0,
            ],
        )
    }

    /// Writes `bytes` into the process's memory at `addr` (memory made for
    /// them, such as an injected `mmap`).
    pub fn poke_at(&mut self, addr: u64, bytes: &[u8]) -> Result<(), ProcError> {
        self.poke(addr, bytes)
    }

    /// Reads `len` bytes of the process's memory at `addr`.
    pub fn peek(&mut self, addr: u64, len: usize) -> Result<Vec<u8>, ProcError> {
        self.settle_touching(addr, len)?;
        let path = PathBuf::from(format!("/proc/{}/mem", self.pid));
        // The descriptor a write opened, if any: opening one costs tens of µs.
        let opened;
        let f = match &self.mem {
            Some(f) => f,
            None => {
                opened = File::open(&path).map_err(|e| ProcError::read(self.pid(), &path, e))?;
                &opened
            }
        };
        let mut buf = vec![0u8; len];
        f.read_exact_at(&mut buf, addr)
            .map_err(|e| ProcError::read(self.pid(), &path, e))?;
        Ok(buf)
    }

    /// Writes into the process's memory.
    fn poke(&mut self, addr: u64, bytes: &[u8]) -> Result<(), ProcError> {
        self.settle_touching(addr, bytes.len())?;
        let pid = self.pid();
        self.memory()?
            .write_all_at(bytes, addr)
            .map_err(|e| ProcError::read(pid, &PathBuf::from(format!("/proc/{pid}/mem")), e))
    }

    /// Takes `f`, this process's `/proc/PID/mem` opened for reading and
    /// writing ahead, unless one is open already.
    pub(crate) fn use_memory(&mut self, f: File) {
        self.mem.get_or_insert(f);
    }

    /// `/proc/PID/mem`, opened for reading and writing at the first need.
    fn memory(&mut self) -> Result<&File, ProcError> {
        let f = match self.mem.take() {
            Some(f) => f,
            None => {
                let path = PathBuf::from(format!("/proc/{}/mem", self.pid));
                File::options()
                    .read(true)
                    .write(true)
                    .open(&path)
                    .map_err(|e| ProcError::read(self.pid(), &path, e))?
            }
        };
        Ok(self.mem.insert(f))
    }

    /// Puts the registers back and lets the process run on.
    pub fn resume(mut self) -> Result<(), ProcError> {
        self.let_go(None)
    }

    /// Puts the registers back and leaves the process stopped by `SIGSTOP`
    /// (a group stop), without a tracer: a parked template.
    pub fn park(mut self) -> Result<(), ProcError> {
        if self.block_parked {
            crate::raw::set_sigmask(self.pid(), u64::MAX).map_err(|source| ProcError::Ptrace {
                pid: self.pid(),
                step: "block signals to park",
                source,
            })?;
        }
        self.let_go(Some(Signal::SIGSTOP))
    }

    fn let_go(&mut self, stop: Option<Signal>) -> Result<(), ProcError> {
        if let Err(e) = self.settle().and_then(|()| self.make_later_calls()) {
            // Its memory (or state) is not what it must be: it must not run.
            self.end();
            return Err(e);
        }
        self.released = true;
        self.unpin();
        let pid = self.pid;
        ptrace::setregs(pid, self.saved).map_err(perr(pid, "restore registers"))?;
        match stop {
            Some(sig) => {
                if !self.stepped {
                    // At an event stop a detach ignores its signal: queue the
                    // stop, run up to its delivery, and detach there.
                    nix::sys::signal::kill(pid, sig).map_err(perr(pid, "queue SIGSTOP"))?;
                    ptrace::cont(pid, None).map_err(perr(pid, "continue to SIGSTOP"))?;
                    loop {
                        match wait_for(pid)? {
                            WaitStatus::Stopped(_, s) if s == sig => break,
                            WaitStatus::Exited(..) | WaitStatus::Signaled(..) => {
                                return Err(ProcError::Gone { pid: self.pid() });
                            }
                            status => {
                                if let WaitStatus::Stopped(_, s) = status {
                                    self.deferred.push(s);
                                }
                                ptrace::cont(pid, None)
                                    .map_err(perr(pid, "continue to SIGSTOP"))?;
                            }
                        }
                    }
                }
                ptrace::detach(pid, sig).map_err(perr(pid, "detach stopped"))?;
            }
            None => {
                // A deferred signal is delivered with the detach (one can be
                // passed; the others are queued again, in order).
                let mut deferred = std::mem::take(&mut self.deferred).into_iter();
                let first = if self.stepped { deferred.next() } else { None };
                for s in deferred {
                    let _ = nix::sys::signal::kill(pid, s);
                }
                // A process that was in a group stop stays stopped: the kernel
                // reinstates the stop when its tracer goes.
                ptrace::detach(pid, first).map_err(perr(pid, "detach"))?;
            }
        }
        // Signals held back while it was stopped for parking are queued again.
        for s in std::mem::take(&mut self.deferred) {
            let _ = nix::sys::signal::kill(pid, s);
        }
        Ok(())
    }
}

impl Drop for Tracee {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        if self.altered {
            // (A push still writing into it fails once it is gone.)
            self.end();
        } else {
            let _ = self.let_go(None);
        }
    }
}

/// The address of a `syscall` instruction (`0f 05`) in the process's vDSO.
pub fn find_syscall_instruction(pid: u32) -> Result<u64, ProcError> {
    let maps_path = PathBuf::from(format!("/proc/{pid}/maps"));
    let maps = crate::inspect::read_proc(pid, &maps_path)?;
    // An exiting process (or a zombie) has no memory left to list.
    if maps.is_empty() {
        return Err(ProcError::Gone { pid });
    }
    let (start, end) = maps
        .lines()
        .find(|l| l.ends_with("[vdso]"))
        .and_then(|l| {
            let range = l.split_whitespace().next()?;
            let (a, b) = range.split_once('-')?;
            Some((
                u64::from_str_radix(a, 16).ok()?,
                u64::from_str_radix(b, 16).ok()?,
            ))
        })
        .ok_or(ProcError::Malformed {
            pid,
            path: maps_path.clone(),
        })?;
    let mem_path = PathBuf::from(format!("/proc/{pid}/mem"));
    let f = File::open(&mem_path).map_err(|e| ProcError::read(pid, &mem_path, e))?;
    let mut buf = vec![0u8; (end - start) as usize];
    f.read_exact_at(&mut buf, start)
        .map_err(|e| ProcError::read(pid, &mem_path, e))?;
    buf.windows(2)
        .position(|w| w == [0x0f, 0x05])
        .map(|i| start + i as u64)
        .ok_or(ProcError::Malformed {
            pid,
            path: maps_path,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_urgent_thread_is_real_time_while_its_guard_lives_and_as_before_after() {
        if tine_testkit::skipped_without_root("an urgent thread (SCHED_FIFO)") {
            return;
        }
        // On a thread of its own: the test harness's may be shared.
        std::thread::spawn(|| {
            let before = crate::raw::sched_policy().unwrap();
            let outer = urgent();
            let (policy, priority) = crate::raw::sched_policy().unwrap();
            assert_eq!(policy & !libc::SCHED_RESET_ON_FORK, libc::SCHED_FIFO);
            assert_ne!(policy & libc::SCHED_RESET_ON_FORK, 0, "not passed on");
            assert_eq!(priority, 1);
            // A guard inside another leaves the outer one's policy in place.
            drop(urgent());
            assert_eq!(crate::raw::sched_policy().unwrap(), (policy, priority));
            drop(outer);
            assert_eq!(crate::raw::sched_policy().unwrap(), before);
            // One its user made real-time keeps its own policy.
            crate::raw::set_sched_policy(libc::SCHED_RR, 7).unwrap();
            let guard = urgent();
            assert_eq!(crate::raw::sched_policy().unwrap(), (libc::SCHED_RR, 7));
            drop(guard);
            assert_eq!(crate::raw::sched_policy().unwrap(), (libc::SCHED_RR, 7));
        })
        .join()
        .unwrap();
    }
}
