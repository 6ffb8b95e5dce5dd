//! Where each of a sandbox's processes may differ from each of its
//! templates, so that a rollback copies back only those pages instead of
//! cloning the whole process (`tine_proc::dirty`).
//!
//! A process is armed at its first checkpoint: a userfaultfd tracks its
//! private memory, held by the sandbox's supervisor. At every later
//! checkpoint the pages written since the last scan are added to what
//! every earlier template of it may differ in, then protected again; the
//! new template starts with nothing. A rollback in place copies back what
//! its template may differ in (plus what was written since, and pages the
//! template holds that the process dropped), then adds all of that to the
//! other templates'. The sets are saved before any protection is lifted
//! from the kernel's view, so that a crash leaves them too large, never too
//! small; a set that is too large costs copies, never correctness.
//!
//! The record lives beside the templates (`REPO/sandboxes/ID/tracking.json`)
//! and means nothing once the processes are gone: it is written atomically
//! for crashes of tine, without fsync (a reboot ends the templates too).

use super::*;
use tine_proc::dirty::{self, Ranges};
use tine_proc::layout::parse_maps;

const TRACKING_VERSION: u32 = 1;

/// One template of a tracked process: where the process may differ from it.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Since {
    pid: u32,
    start: u64,
    changed: Ranges,
}

/// A tracked process (its host PID and start time) and its templates.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Tracked {
    pid: u32,
    start: u64,
    templates: Vec<Since>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Record {
    version: u32,
    processes: Vec<Tracked>,
}

/// A sandbox's tracking record, loaded (what is gone left out).
#[derive(Debug)]
pub struct Book {
    path: PathBuf,
    dirs: SandboxDirs,
    rec: Record,
}

fn start_of(pid: u32) -> Option<u64> {
    tine_proc::stat(pid).ok().map(|s| s.start_time)
}

/// The memory a scan covers: every private mapping (written while writable
/// stays written when made read-only).
fn spans(pid: u32) -> Option<Vec<(u64, u64)>> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    Some(dirty::tracked(&parse_maps(&maps)))
}

impl Book {
    pub fn load(dirs: &SandboxDirs) -> Book {
        let path = dirs.root.join("tracking.json");
        let mut rec: Record = std::fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .filter(|r: &Record| r.version == TRACKING_VERSION)
            .unwrap_or_default();
        rec.processes.retain(|p| start_of(p.pid) == Some(p.start));
        for p in &mut rec.processes {
            p.templates.retain(|t| start_of(t.pid) == Some(t.start));
        }
        Book {
            path,
            dirs: dirs.clone(),
            rec,
        }
    }

    fn save(&self) -> bool {
        self.rec.version == TRACKING_VERSION
            && serde_json::to_vec(&self.rec).is_ok_and(|data| {
                let tmp = self.path.with_extension("tmp");
                std::fs::write(&tmp, data).is_ok() && std::fs::rename(&tmp, &self.path).is_ok()
            })
    }

    fn forget(&mut self, pid: u32) {
        self.rec.processes.retain(|p| p.pid != pid);
        self.rec.version = TRACKING_VERSION;
        let _ = self.save();
    }

    /// Before stopped process `t` forks its template: arms it (first
    /// checkpoint) or records what it wrote since the last scan in every
    /// earlier template's set and protects those pages again. Whether the
    /// template about to be made will be tracked.
    pub fn before_fork(&mut self, t: &mut Tracee) -> bool {
        let pid = t.pid();
        let ok = self.prepare(t);
        if !ok {
            self.forget(pid);
        }
        ok
    }

    fn prepare(&mut self, t: &mut Tracee) -> bool {
        self.rec.version = TRACKING_VERSION;
        let pid = t.pid();
        let (Some(start), Some(spans)) = (start_of(pid), spans(pid)) else {
            return false;
        };
        let Some(i) = self.rec.processes.iter().position(|p| p.pid == pid) else {
            // First checkpoint: a tracker for it, held by the supervisor.
            let Ok(uffd) = dirty::open_tracker(t) else {
                return false;
            };
            use std::os::fd::AsFd;
            if crate::supervisor::keep(&self.dirs, pid, start, uffd.as_fd()).is_none() {
                return false;
            }
            self.rec.processes.push(Tracked {
                pid,
                start,
                templates: Vec::new(),
            });
            return self.save() && dirty::arm(pid, &uffd, &spans).is_ok();
        };
        let Ok(seen) = dirty::changed(pid, &spans) else {
            return false;
        };
        for s in &mut self.rec.processes[i].templates {
            s.changed.add(&seen.written);
        }
        // Saved before the pages are protected again.
        if !self.save() {
            return false;
        }
        // Mappings made since (their pages all read as written) are
        // registered now.
        let fresh = dirty::unregistered(pid, &spans).unwrap_or_default();
        if !fresh.is_empty() {
            let Some(uffd) = crate::supervisor::tracker(&self.dirs, pid, start) else {
                return false;
            };
            if dirty::arm(pid, &uffd, &fresh).is_err() {
                return false;
            }
        }
        dirty::protect(pid, &seen.written).is_ok()
    }

    /// After `origin` forked `tpl` (tracked: [`Book::before_fork`] said so):
    /// the process is the template's, page for page.
    pub fn forked(&mut self, origin: u32, tpl: &Template) {
        if let Some(p) = self.rec.processes.iter_mut().find(|p| p.pid == origin) {
            p.templates.push(Since {
                pid: tpl.pid,
                start: tpl.start_time,
                changed: Ranges::new(),
            });
        }
    }

    /// Saves what the checkpoint added.
    pub fn commit(&self) {
        let _ = self.save();
    }

    /// Where live process `pid` (stopped) may differ from its template
    /// `tpl`: its set, what it wrote since the last scan, and the pages the
    /// template holds that it has not. Every template's set takes all of it
    /// (saved) before the rollback changes anything. `None`: not tracked.
    pub fn changed_since(&mut self, pid: u32, tpl: &Template) -> Option<Ranges> {
        let p = self.rec.processes.iter().position(|p| p.pid == pid)?;
        let s = self.rec.processes[p]
            .templates
            .iter()
            .position(|s| s.pid == tpl.pid && s.start == tpl.start_time)?;
        let seen = dirty::changed(pid, &spans(pid)?).ok()?;
        let missing = dirty::present(tpl.pid, &seen.absent).ok()?;
        let mut d = self.rec.processes[p].templates[s].changed.clone();
        d.add(&seen.written);
        d.add(&missing);
        for t in &mut self.rec.processes[p].templates {
            t.changed.add(&d);
        }
        self.save().then_some(d)
    }

    /// After live process `pid` was rolled back in place to `tpl`.
    pub fn rolled_back(&mut self, pid: u32, tpl: &Template) {
        if let Some(s) = self
            .rec
            .processes
            .iter_mut()
            .find(|p| p.pid == pid)
            .and_then(|p| {
                p.templates
                    .iter_mut()
                    .find(|s| s.pid == tpl.pid && s.start == tpl.start_time)
            })
        {
            s.changed = Ranges::new();
            let _ = self.save();
        }
    }
}
