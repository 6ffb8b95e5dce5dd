//! A checkpoint's templates made ready for what comes next, after the
//! checkpoint returned: what a rollback's graft reads of each (its source,
//! `tine_proc::graft::source_of`) and a spare copy for the next checkpoint
//! (`tine_proc::spare`: the kernel's fork of its page tables, 7 ms at
//! 566 MB of 4 KiB pages on the development VM, which a checkpoint's call
//! waited for).
//!
//! The sandbox's supervisor does this work ([`Preparer`], on a thread of
//! its own), since it outlives the call. The next operation on the sandbox
//! tells it to stop and waits for the step in hand
//! (`supervisor::quiesce`), so that no two tracers seize one template and
//! nothing reads a record half written; what it left undone is done there
//! (a rollback reads a template's source itself, before its pause: see
//! `Book::preload`) or not at all (the next checkpoint forks).

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use super::*;

/// At most this many templates in one preparation (a request's bound).
pub const MAX_ITEMS: usize = 4096;

/// One template to prepare: which (its PID and start time), and what for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Item {
    pub pid: u32,
    pub start: u64,
    /// Read what a graft of it reads.
    pub source: bool,
    /// Fork a spare of it.
    pub spare: bool,
}

/// What a checkpoint left to do once it returned: handed to the sandbox's
/// supervisor ([`Preparation::hand_off`]), or done in the call
/// ([`Preparation::run`]) where none takes it.
#[derive(Debug, Default)]
#[must_use = "a checkpoint's templates are prepared by handing this off or running it"]
pub struct Preparation {
    pub(crate) dirs: Option<SandboxDirs>,
    /// The snapshot whose templates these are (hex id).
    pub(crate) snapshot: String,
    pub(crate) items: Vec<Item>,
}

/// How far a preparation got.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// The snapshot whose templates it prepared (hex id).
    pub snapshot: String,
    /// It went through every template; false: told to stop first, by the
    /// operation that reports it.
    pub finished: bool,
    /// How long it ran, in ms: wall time, and CPU time — its thread's and
    /// the templates' (the calls it injects into them run there: a spare's
    /// fork is the kernel copying the template's page tables).
    pub ms: f64,
    #[serde(default)]
    pub cpu_ms: f64,
    /// Templates whose sources it read, and spares it made.
    pub sources: usize,
    pub spares: usize,
    /// What it left undone, told to stop (see [`Report::rest`]).
    #[serde(default)]
    pub left: Vec<Item>,
}

impl Report {
    /// What this preparation left, to be handed off again by the
    /// operation that stopped it once it is done with the templates (a
    /// rollback or a fork leaves them as they were; a checkpoint makes
    /// others, whose preparation replaces this one's).
    pub fn rest(&self, dirs: &SandboxDirs) -> Preparation {
        Preparation {
            dirs: Some(dirs.clone()),
            snapshot: self.snapshot.clone(),
            items: self.left.clone(),
        }
    }
}

impl Preparation {
    /// Of the templates of snapshot `hex` (its id is known once its files
    /// are stored, after the templates were settled).
    pub(crate) fn of_snapshot(mut self, hex: String) -> Preparation {
        self.snapshot = hex;
        self
    }

    /// Nothing to do.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Hands it to the sandbox's supervisor, which prepares the templates
    /// after this call returns; `Err(self)` when none took it (a supervisor
    /// of an earlier tine, or none there): then [`Preparation::run`] it.
    pub fn hand_off(self) -> Result<(), Preparation> {
        let Some(dirs) = &self.dirs else {
            return Ok(());
        };
        if self.items.is_empty() || crate::supervisor::prepare(dirs, &self.snapshot, &self.items) {
            return Ok(());
        }
        Err(self)
    }

    /// Prepares the templates here, to the end.
    pub fn run(self) -> Report {
        match &self.dirs {
            Some(dirs) => prepare(dirs, &self.snapshot, &self.items, &|| false),
            None => Report {
                snapshot: self.snapshot,
                finished: true,
                ..Report::default()
            },
        }
    }
}

/// Prepares the templates `items` names of snapshot `snapshot` in the
/// sandbox at `dirs`, in order, until `stop()` says so (asked before each
/// template, and before each spare's fork). Each source and spare is
/// recorded as soon as it is made.
pub fn prepare(
    dirs: &SandboxDirs,
    snapshot: &str,
    items: &[Item],
    stop: &dyn Fn() -> bool,
) -> Report {
    let t0 = Instant::now();
    let cpu0 = thread_cpu_ms();
    let st = ObjectId::from_hex(snapshot).and_then(|id| load(dirs, &id));
    let mut report = Report {
        snapshot: snapshot.to_string(),
        finished: true,
        ..Report::default()
    };
    for (k, item) in items.iter().enumerate() {
        if stop() {
            report.finished = false;
            report.left = items[k..].to_vec();
            break;
        }
        let template = st.iter().flat_map(|s| &s.processes).find_map(|c| {
            (c.template.pid == item.pid && c.template.start_time == item.start)
                .then_some(&c.template)
        });
        // (A template gone since is nothing to prepare.)
        let Some(template) = template else { continue };
        let spare = || item.spare && !stop();
        let ran = run_ms(template.pid);
        let done = tine_proc::template::prepare_parked(template, item.source, &spare);
        report.cpu_ms += run_ms(template.pid) - ran;
        let Ok(done) = done else { continue };
        if let Some(source) = &done.source {
            tracking::keep_source(dirs, done.pid, source);
            report.sources += 1;
        }
        if let Some(spare) = done.spare {
            spares::add(
                dirs,
                spares::Entry {
                    spare,
                    base: template.clone(),
                },
            );
            report.spares += 1;
        } else if item.spare && stop() {
            report.finished = false;
            report.left = items[k..].to_vec();
            report.left[0].source &= done.source.is_none();
            break;
        }
    }
    report.ms = t0.elapsed().as_secs_f64() * 1e3;
    report.cpu_ms += thread_cpu_ms() - cpu0;
    report
}

/// The CPU time process `pid` has run, in ms (`/proc/PID/schedstat`; 0
/// when it cannot be read).
fn run_ms(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/schedstat"))
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<f64>().ok())
        .map_or(0.0, |ns| ns / 1e6)
}

/// The CPU time this thread has used, in ms.
fn thread_cpu_ms() -> f64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    t.tv_sec as f64 * 1e3 + t.tv_nsec as f64 / 1e6
}

/// An earlier checkpoint's preparation stopped while an operation uses
/// the sandbox's templates (`supervisor::quiesce`); what it left goes on
/// when this is dropped, the operation done with them (a rollback or a
/// fork leaves them as they were), unless a checkpoint's new templates
/// supersede it ([`Paused::superseded`]).
#[derive(Debug)]
#[must_use = "the preparation goes on when this is dropped"]
pub struct Paused {
    dirs: SandboxDirs,
    report: Option<Report>,
}

impl Paused {
    /// Stops the preparation of the sandbox at `dirs`, if one runs, and
    /// waits for the step in hand.
    pub fn stop(dirs: &SandboxDirs) -> Paused {
        Paused {
            dirs: dirs.clone(),
            report: crate::supervisor::quiesce(dirs, false),
        }
    }

    /// Waits for the preparation of the sandbox at `dirs`, if one runs, to
    /// finish (a checkpoint: the spares are what it makes its templates of,
    /// and their forks would otherwise be in its pause).
    pub fn finish(dirs: &SandboxDirs) -> Paused {
        Paused {
            dirs: dirs.clone(),
            report: crate::supervisor::quiesce(dirs, true),
        }
    }

    /// How far the last preparation got, if one ran since it was last told.
    pub fn report(&self) -> Option<Report> {
        self.report.clone()
    }

    /// Its report; what it left is not taken up again.
    pub fn superseded(mut self) -> Option<Report> {
        self.report.take()
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        if let Some(r) = self.report.take().filter(|r| !r.left.is_empty()) {
            // Where no supervisor takes it, it is left undone.
            let _ = r.rest(&self.dirs).hand_off();
        }
    }
}

/// The supervisor's side: one preparation at a time, each on a thread of
/// its own; the last one's report kept until an operation asks for it.
#[derive(Debug, Default)]
pub struct Preparer {
    state: Mutex<State>,
    done: Condvar,
    stop: AtomicBool,
}

#[derive(Debug, Default)]
struct State {
    running: bool,
    last: Option<Report>,
}

impl Preparer {
    /// Starts preparing `items` of `snapshot` (an earlier preparation still
    /// running is stopped first).
    pub fn start(self: &Arc<Self>, dirs: SandboxDirs, snapshot: String, items: Vec<Item>) {
        let _ = self.quiesce(false);
        self.stop.store(false, Ordering::SeqCst);
        self.lock().running = true;
        let me = Arc::clone(self);
        let spawned = std::thread::Builder::new()
            .name("prepare".into())
            .spawn(move || {
                let stop = || me.stop.load(Ordering::SeqCst);
                // A panic is a preparation cut short, never the supervisor's
                // end (a template seized is put back as its tracer unwinds).
                let report = std::panic::catch_unwind(AssertUnwindSafe(|| {
                    prepare(&dirs, &snapshot, &items, &stop)
                }))
                .unwrap_or_else(|_| Report {
                    snapshot,
                    ..Report::default()
                });
                me.finish(Some(report));
            });
        if spawned.is_err() {
            self.finish(None);
        }
    }

    fn finish(&self, report: Option<Report>) {
        let mut s = self.lock();
        s.running = false;
        s.last = report;
        self.done.notify_all();
    }

    /// Whether a preparation is running.
    pub fn busy(&self) -> bool {
        self.lock().running
    }

    /// Tells the preparation running to stop after the step in hand (or,
    /// `finish`, lets it finish), waits for it, and returns the last
    /// preparation's report (once: the next call returns `None` until
    /// another ran).
    pub fn quiesce(&self, finish: bool) -> Option<Report> {
        if !finish {
            self.stop.store(true, Ordering::SeqCst);
        }
        let mut s = self.lock();
        while s.running {
            s = self.done.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        s.last.take()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sandbox directory of its own, empty (kept while the guard lives).
    fn scratch() -> (tempfile::TempDir, SandboxDirs) {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_path_buf();
        (dir, SandboxDirs { root })
    }

    fn item(pid: u32, spare: bool) -> Item {
        Item {
            pid,
            start: 1,
            source: true,
            spare,
        }
    }

    #[test]
    fn a_preparation_of_templates_that_are_gone_finishes_having_made_nothing() {
        let (_dir, dirs) = scratch();
        let r = prepare(&dirs, &"0".repeat(64), &[item(u32::MAX, true)], &|| false);
        assert!(r.finished);
        assert_eq!((r.sources, r.spares), (0, 0));
    }

    #[test]
    fn a_preparation_told_to_stop_says_it_did_not_finish() {
        let (_dir, dirs) = scratch();
        let items = [item(1, false)];
        let r = prepare(&dirs, &"0".repeat(64), &items, &|| true);
        assert!(!r.finished);
        assert_eq!(r.left, items);
    }

    #[test]
    fn the_preparer_reports_its_last_preparation_once_and_waits_for_it() {
        let (_dir, dirs) = scratch();
        let p = Arc::new(Preparer::default());
        assert_eq!(p.quiesce(false), None);
        p.start(dirs, "0".repeat(64), vec![]);
        let r = p.quiesce(true).expect("the preparation's report");
        assert!(!p.busy() && r.finished);
        assert_eq!(r.snapshot, "0".repeat(64));
        assert_eq!(p.quiesce(false), None);
    }
}
