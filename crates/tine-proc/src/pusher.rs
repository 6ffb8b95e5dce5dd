//! A second tracer thread for parked templates: the pages a rollback in
//! place copies back are pushed from the template into the process (a
//! `process_vm_writev` injected into the template, `graft::direct`) on this
//! thread, while the rollback's own thread goes on with the process's other
//! state (dispositions, main thread, descriptors, threads) on the other CPU.
//! The template can be seized here early ([`Hand::hold`]), while the
//! rollback is still stopping and killing processes, and other work can
//! run here meanwhile ([`Hand::run`]: a scan of the process's page tables
//! while the rollback's thread reads its memory map).
//!
//! A tracer is a thread: what this thread seized only it can inject into,
//! and it parks every template again before it reports a push done, and
//! before it ends.

use std::sync::mpsc;
use std::thread::JoinHandle;

use nix::libc;
use nix::sched::{CpuSet, sched_getaffinity, sched_setaffinity};
use nix::unistd::Pid;

use crate::inspect::ProcError;
use crate::ptrace::Tracee;
use crate::template::{Parked, Template, seize_parked};

/// The thread; dropped, it parks what it holds and is waited for.
#[derive(Debug)]
pub struct Pusher {
    hand: Option<Hand>,
    thread: Option<JoinHandle<()>>,
}

/// What the rollback's thread (and each graft) sends work with.
#[derive(Debug, Clone)]
pub struct Hand(mpsc::Sender<Job>);

enum Job {
    Hold(Parked),
    Run {
        work: Box<dyn FnOnce() + Send>,
        /// As for a push: the sender waits on its CPU meanwhile, or works.
        away_from: Option<usize>,
    },
    /// Whether the process's descriptors are the template's
    /// ([`crate::graft::same_table`]).
    Table {
        from: u32,
        fds: Vec<crate::FdEntry>,
        into: u32,
        away_from: Option<usize>,
        done: mpsc::Sender<bool>,
    },
    /// Park what it holds and end (whoever still has a [`Hand`]).
    End,
    Push {
        from: Parked,
        into: u32,
        ranges: Vec<(u64, u64)>,
        /// The CPU the sender's thread is held on: this one runs elsewhere.
        away_from: Option<usize>,
        done: mpsc::Sender<usize>,
    },
}

/// A push under way: `ranges` (sorted) are being written into the process.
#[derive(Debug)]
pub(crate) struct Pushed {
    pub ranges: Vec<(u64, u64)>,
    done: mpsc::Receiver<usize>,
}

impl Pushed {
    /// Waits for the push to end: how many of `ranges`, from the first,
    /// were copied whole (none if the thread could not seize the template
    /// or is gone).
    fn wait(&self) -> usize {
        self.done.recv().unwrap_or(0)
    }

    /// Waits for the push to end: the ranges it did not copy whole, to be
    /// copied otherwise (each writable: `(start, end, true)`).
    pub fn left(&self) -> Vec<(u64, u64, bool)> {
        self.ranges[self.wait()..]
            .iter()
            .map(|&(a, b)| (a, b, true))
            .collect()
    }
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Job::Hold(_) => "Hold",
            Job::Run { .. } => "Run",
            Job::Table { .. } => "Table",
            Job::End => "End",
            Job::Push { .. } => "Push",
        })
    }
}

/// What [`Hand::run`] returns: the work's result once it is done.
#[derive(Debug)]
pub struct Ran<T>(mpsc::Receiver<T>);

impl<T> Ran<T> {
    /// Its result (`None`: the thread was gone, or the work panicked).
    pub fn wait(self) -> Option<T> {
        self.0.recv().ok()
    }
}

impl Pusher {
    /// Starts the thread on another CPU than the caller's, where one is
    /// allowed, and waits till it is there. What it is sent later runs away
    /// from the sender's CPU too. A caller that holds its CPU
    /// ([`crate::ptrace::hold_here`]) while it works or waits has the two
    /// run side by side: work handed to a thread on the sender's CPU waits
    /// till the sender blocks, the scheduler slow to move it to the idle
    /// one (numpy's walks started 0.6 ms late so).
    ///
    /// `ahead` are the pushes it may be sent: what each needs that holds
    /// till the pause is read before this returns ([`Ready`]).
    pub fn start(ahead: Vec<Ahead>) -> Result<Pusher, ProcError> {
        let (tx, rx) = mpsc::channel();
        let (ready, there) = mpsc::channel();
        let allowed = crate::ptrace::allowed_cpus();
        let from = nix::sched::sched_getcpu().ok();
        let thread = std::thread::Builder::new()
            .name("tine-pusher".into())
            .spawn(move || {
                run_away_from(allowed.as_ref(), from);
                let readies = ahead.into_iter().map(Ready::read).collect();
                let _ = ready.send(());
                serve(rx, allowed, readies)
            })
            .map_err(|source| ProcError::Ptrace {
                pid: std::process::id(),
                step: "start the template pusher thread",
                source,
            })?;
        let _ = there.recv();
        Ok(Pusher {
            hand: Some(Hand(tx)),
            thread: Some(thread),
        })
    }

    pub fn hand(&self) -> Hand {
        self.hand.clone().expect("held until dropped")
    }
}

impl Drop for Pusher {
    fn drop(&mut self) {
        if let Some(hand) = self.hand.take() {
            let _ = hand.0.send(Job::End);
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Hand {
    /// Runs `f` on the thread (after what was sent before).
    pub fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> Ran<T> {
        let (tx, rx) = mpsc::channel();
        let _ = self.0.send(Job::Run {
            work: Box::new(move || {
                let _ = tx.send(f());
            }),
            away_from: nix::sched::sched_getcpu().ok(),
        });
        Ran(rx)
    }

    /// Sends `f` to the thread behind what was sent before, from the thread
    /// itself (where it runs stays as it is), not waited for.
    pub(crate) fn run_later(&self, f: impl FnOnce() + Send + 'static) {
        let _ = self.0.send(Job::Run {
            work: Box::new(f),
            away_from: None,
        });
    }

    /// Asks on the thread whether process `into`'s descriptors are exactly
    /// template `tpl`'s ([`crate::graft::same_table`]).
    pub(crate) fn same_table(&self, tpl: &Template, into: u32) -> Ran<bool> {
        let (done, rx) = mpsc::channel();
        let _ = self.0.send(Job::Table {
            from: tpl.pid,
            fds: tpl.fds.clone(),
            into,
            away_from: nix::sched::sched_getcpu().ok(),
            done,
        });
        Ran(rx)
    }

    /// Seizes `tpl` on the thread now, ahead of a push from it. Only for a
    /// template nothing else will seize before it is pushed from.
    pub fn hold(&self, tpl: &Template) {
        let _ = self.0.send(Job::Hold(Parked::of(tpl)));
    }

    /// Starts copying `ranges` (sorted, writable in `into`) from template
    /// `tpl` into process `into` at the same addresses.
    pub(crate) fn push(&self, tpl: &Template, into: u32, ranges: Vec<(u64, u64)>) -> Pushed {
        let (done, rx) = mpsc::channel();
        let away_from = nix::sched::sched_getcpu().ok();
        let job = Job::Push {
            from: Parked::of(tpl),
            into,
            ranges: ranges.clone(),
            away_from,
            done,
        };
        // (Sent to a thread that is gone, the receiver reads none done.)
        let _ = self.0.send(job);
        Pushed { ranges, done: rx }
    }
}

/// A push the pusher may be sent: from template `from` into process
/// `into` (rolled back in place), whose descriptors `fds` the template's
/// are.
#[derive(Debug, Clone)]
pub struct Ahead {
    pub from: u32,
    pub into: u32,
    pub fds: Vec<i32>,
}

/// What a push from template `from` into process `into` needs that can be
/// read before the pause (numpy's: 0.07-0.14 ms of this thread inside it):
/// the process's PID as the template sees it
/// ([`crate::graft::direct_target`]), the template's `/proc/PID/mem` and
/// the process's `fdinfo` files, opened. (The memory file is the
/// template's if it is seized later: a process seized as the template, by
/// its start time, was it since the checkpoint, and a PID is not reused
/// while its process lives.)
struct Ready {
    from: u32,
    into: u32,
    target: Option<u32>,
    mem: Option<std::fs::File>,
    /// The process's `fdinfo` files of the template's descriptors, for
    /// [`Job::Table`].
    fdinfo: crate::fdtable::FdInfos,
}

impl Ready {
    fn read(Ahead { from, into, fds }: Ahead) -> Ready {
        let mem = std::fs::File::options()
            .read(true)
            .write(true)
            .open(format!("/proc/{from}/mem"))
            .ok();
        Ready {
            from,
            into,
            target: crate::graft::direct_target(from, into),
            mem,
            fdinfo: crate::fdtable::FdInfos::open(into, fds.into_iter()),
        }
    }
}

/// `t` (just seized) given the memory file read ahead for it, if any.
fn with_ready_memory(mut t: Tracee, readies: &mut [Ready]) -> Tracee {
    if let Some(f) = readies
        .iter_mut()
        .find(|r| r.from == t.pid())
        .and_then(|r| r.mem.take())
    {
        t.use_memory(f);
    }
    t
}

fn serve(jobs: mpsc::Receiver<Job>, allowed: Option<CpuSet>, mut readies: Vec<Ready>) {
    let mut held: Vec<Tracee> = Vec::new();
    let away = |cpu| run_away_from(allowed.as_ref(), cpu);
    for job in jobs {
        match job {
            Job::End => break,
            Job::Run { work, away_from } => {
                away(away_from);
                // (A panic drops its sender: the caller reads no result.)
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(work));
            }
            Job::Table {
                from,
                fds,
                into,
                away_from,
                done,
            } => {
                away(away_from);
                let none = crate::fdtable::FdInfos::default();
                let infos = readies
                    .iter()
                    .find(|r| (r.from, r.into) == (from, into))
                    .map_or(&none, |r| &r.fdinfo);
                let _ = done.send(crate::graft::same_table(from, &fds, into, infos));
            }
            Job::Hold(p) => {
                if !held.iter().any(|t| t.pid() == p.pid)
                    && let Ok(t) = seize_parked(&p)
                {
                    held.push(with_ready_memory(t, &mut readies));
                }
            }
            Job::Push {
                from,
                into,
                ranges,
                away_from,
                done,
            } => {
                away(away_from);
                let _here = crate::ptrace::hold_here();
                let t = match held.iter().position(|t| t.pid() == from.pid) {
                    Some(i) => Ok(held.swap_remove(i)),
                    None => seize_parked(&from).map(|t| with_ready_memory(t, &mut readies)),
                };
                let target = match readies
                    .iter()
                    .find(|r| (r.from, r.into) == (from.pid, into))
                {
                    Some(r) => r.target,
                    None => crate::graft::direct_target(from.pid, into),
                };
                let n = match t {
                    Ok(mut t) => {
                        let n = crate::graft::direct_to(
                            &mut t,
                            target,
                            &ranges,
                            libc::SYS_process_vm_writev,
                        );
                        // Parked before the push is reported done: the
                        // rollback may seize it again after.
                        let _ = t.park();
                        n
                    }
                    Err(_) => 0,
                };
                let _ = done.send(n);
            }
        }
    }
    for t in held {
        let _ = t.park();
    }
}

/// Moves this thread off `cpu` (where the sender's thread is held, with
/// the process it injects into) to the others of `allowed`, where there
/// are others.
fn run_away_from(allowed: Option<&CpuSet>, cpu: Option<usize>) {
    let me = Pid::from_raw(0);
    let (Some(cpu), Some(mut set)) = (cpu, allowed.copied()) else {
        return;
    };
    if set.is_set(cpu) != Ok(true) || set.unset(cpu).is_err() {
        return;
    }
    if !(0..CpuSet::count()).any(|c| set.is_set(c) == Ok(true)) {
        return;
    }
    // (Already there: no call, the thread stays on its CPU.)
    if sched_getaffinity(me).is_ok_and(|now| now == set) {
        return;
    }
    let _ = sched_setaffinity(me, &set);
}
