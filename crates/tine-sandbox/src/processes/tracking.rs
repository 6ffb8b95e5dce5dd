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
//! The record lives beside the templates (`REPO/sandboxes/ID/tracking`)
//! and means nothing once the processes are gone. It is rewritten in place
//! inside the pause (a rename costs ext4 a flush), never truncated (which
//! costs the same): the BLAKE3 digest of its JSON on the first line, then
//! the JSON, then spaces over whatever was longer before. One torn by a
//! crash fails its digest and tracks nothing — every template untracked,
//! rolled back by cloning. No fsync: a reboot ends the templates too.

use super::*;
use std::sync::Arc;
use tine_proc::dirty::{self, Ranges};
use tine_proc::graft::SourceRecord;
use tine_proc::layout::{Mapping, parse_maps};
use tine_proc::shares::Shares;

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

/// Copying a page back over one the process holds, and onto one it has not
/// (a first touch: 7.6 µs measured on the development VM), in µs.
const COPY_US: u64 = 1;
const FIRST_TOUCH_US: u64 = 8;

/// A rollback in place of a tracked process: where it may differ from its
/// template, what a graft reads from the template (when kept), and what
/// copying the pages back is expected to cost, in µs (when known).
#[derive(Debug)]
pub struct InPlace {
    pub changed: Ranges,
    pub source: Option<Arc<SourceRecord>>,
    pub cost_us: Option<u64>,
    /// Its memory map as the scan read it (stopped: still true for the graft).
    pub maps: Vec<tine_proc::layout::Mapping>,
}

/// A sandbox's tracking record, loaded (what is gone left out).
#[derive(Debug)]
pub struct Book {
    path: PathBuf,
    dirs: SandboxDirs,
    rec: Record,
    /// What each process wrote since the last scan, as the checkpoint's
    /// pause found it (see [`Book::before_fork`]).
    pause_written: std::collections::HashMap<u32, Ranges>,
    /// Each process's `/proc/PID/maps` text as [`Book::before_fork`] read it
    /// in the checkpoint's pause, where nothing it did changed the mappings
    /// (see [`Book::maps_read`]).
    pause_maps: std::collections::HashMap<u32, String>,
    /// The templates' sources read so far (see [`Book::preload`]; a
    /// checkpoint reads their own pages before its pause and again inside it).
    sources: std::cell::RefCell<Sources>,
}

fn start_of(pid: u32) -> Option<u64> {
    tine_proc::stat(pid).ok().map(|s| s.start_time)
}

/// Keeps what a graft reads from template `pid` in a file of its own
/// (`sources/PID.START`, written atomically), read only by a rollback to it.
pub(crate) fn keep_source(dirs: &SandboxDirs, pid: u32, source: &SourceRecord) {
    let Some(start) = start_of(pid) else { return };
    let dir = dirs.root.join("sources");
    if std::fs::create_dir_all(&dir).is_ok()
        && let Ok(data) = serde_json::to_vec(source)
    {
        let tmp = dir.join(format!("{pid}.{start}.tmp"));
        if std::fs::write(&tmp, data).is_ok() {
            let _ = std::fs::rename(&tmp, dir.join(format!("{pid}.{start}")));
        }
    }
}

type Spans = Vec<(u64, u64)>;

/// Templates' sources by PID and start time (`None`: none kept).
type Sources = std::collections::HashMap<(u32, u64), Option<Arc<SourceRecord>>>;

/// The memory a scan covers: every private mapping (written while writable
/// stays written when made read-only), each, and in runs; and the map they
/// were read from.
fn spans(pid: u32) -> Option<(Spans, Spans, Vec<tine_proc::layout::Mapping>)> {
    spans_read(pid).map(|(_, s)| s)
}

/// [`spans`], with the `/proc/PID/maps` text they were read from.
#[allow(clippy::type_complexity)]
fn spans_read(pid: u32) -> Option<(String, (Spans, Spans, Vec<tine_proc::layout::Mapping>))> {
    let text = tine_proc::inspect::maps_text(pid).ok()?;
    let maps = parse_maps(&text);
    Some((text, (dirty::tracked(&maps), dirty::runs(&maps), maps)))
}

/// [`spans`] of a stopped process whose map was `known` (its template's)
/// at the checkpoint: asked of the kernel, the names of mappings still as
/// they were taken from there (`inspect::maps_like`: numpy's in 0.14 ms
/// against 0.3 read as text, inside a rollback's pause).
fn spans_like(
    pid: u32,
    known: Option<&[Mapping]>,
) -> Option<(Spans, Spans, Vec<tine_proc::layout::Mapping>)> {
    match known.and_then(|k| tine_proc::inspect::maps_like(pid, k)) {
        Some(maps) => Some((dirty::tracked(&maps), dirty::runs(&maps), maps)),
        None => spans(pid),
    }
}

/// The pages template `tpl` holds of its own that process `pid` (mappings
/// `maps`, pages `absent` missing) lost, where what the template holds was
/// not read before: those missing, and in files' private mappings those
/// where it reads the file's page (present, so not among them).
fn lost_unknown(pid: u32, tpid: u32, absent: &Ranges, maps: &[Mapping]) -> Option<Ranges> {
    let mut missing = dirty::present(tpid, absent).ok()?;
    let (_, files) = dirty::by_backing(&Ranges::from_unsorted(dirty::tracked(maps)), maps);
    let lost: Vec<(u64, u64)> = dirty::lost(pid, &files).ok()?.iter().collect();
    missing.add(&dirty::held(tpid, &lost).ok()?.0);
    Some(missing)
}

/// The record in `bytes` when its digest holds.
fn decode(bytes: &[u8]) -> Option<Record> {
    let nl = bytes.iter().position(|b| *b == b'\n')?;
    let (sum, rest) = (&bytes[..nl], &bytes[nl + 1..]);
    let end = rest.iter().rposition(|b| !b.is_ascii_whitespace())? + 1;
    let json = &rest[..end];
    (blake3::hash(json).to_hex().as_bytes() == sum)
        .then(|| serde_json::from_slice(json).ok())
        .flatten()
}

/// What a scan of a live process needs: its PID, its template's, and what
/// a graft reads of the template ([`Book::to_scan`]).
#[derive(Debug)]
pub struct ToScan {
    pid: u32,
    tpid: u32,
    source: Option<Arc<SourceRecord>>,
}

/// What a scan of a stopped process found: the pages it wrote since the
/// last scan, those of its template's it lost, its mappings as spans, and
/// its memory map.
#[derive(Debug)]
pub struct Scanned {
    written: Ranges,
    missing: Ranges,
    each: Spans,
    maps: Vec<tine_proc::layout::Mapping>,
    source: Option<Arc<SourceRecord>>,
}

impl ToScan {
    /// Scans the stopped process, with `helper` taking a share of its
    /// walks.
    pub fn scan(self, helper: Option<&tine_proc::pusher::Hand>) -> Option<Scanned> {
        let ToScan { pid, tpid, source } = self;
        // The template's own pages, in anonymous memory and in files'
        // private mappings (whose drops no written scan shows), and the
        // pieces of the walks below, worked out as its source was read.
        let plan = source.as_ref().and_then(|r| r.walks()).cloned();
        // The written scan and the walk for anonymous pages dropped, over
        // the memory the template had (numpy: 0.45 and 0.1 ms), start on
        // the helper thread while this one reads the process's map and
        // walks the files' mappings for pages lost there (0.3 and 0.1 ms),
        // then takes its share of what is left (`Shares`); what the
        // process mapped since is walked after.
        let had = source.as_ref().and_then(|r| r.mappings());
        let ahead = match (helper, &plan) {
            (Some(h), Some(plan)) if dirty::scan_sees_holes() => {
                let shares = Arc::new(Shares::new(pid, plan.clone()));
                let theirs = shares.clone();
                let walks = h.run(move || theirs.take());
                Some((walks, shares))
            }
            _ => None,
        };
        let (each, sp, maps) = spans_like(pid, had)?;
        // Written since the last scan; and of the pages the template holds
        // of its own, those the process lost (dropped since).
        let (written, missing) = match (ahead, &plan) {
            (Some((walks, shares)), Some(plan)) => {
                let lost = dirty::lost(pid, plan.files()).ok()?;
                // What the helper has not taken yet.
                shares.take();
                walks.wait()?;
                let (mut written, mut missing) = Arc::into_inner(shares)?.found().ok()?;
                missing.add(&lost);
                let rest: Vec<(u64, u64)> = Ranges::from_unsorted(sp)
                    .without(plan.runs())
                    .iter()
                    .collect();
                if !rest.is_empty() {
                    written.add(&dirty::written(pid, &rest).ok()?);
                }
                (written, missing)
            }
            (_, Some(plan)) => {
                let written = dirty::written(pid, &sp).ok()?;
                let missing =
                    dirty::dropped(pid, plan.anon(), plan.files(), Some(&written)).ok()?;
                (written, missing)
            }
            (_, None) => {
                let seen = dirty::changed(pid, &sp).ok()?;
                let missing = lost_unknown(pid, tpid, &seen.absent, &maps)?;
                (seen.written, missing)
            }
        };
        Some(Scanned {
            written,
            missing,
            each,
            maps,
            source,
        })
    }
}

impl Book {
    pub fn load(dirs: &SandboxDirs) -> Book {
        let path = dirs.root.join("tracking");
        let mut rec: Record = std::fs::read(&path)
            .ok()
            .and_then(|b| decode(&b))
            .filter(|r: &Record| r.version == TRACKING_VERSION)
            .unwrap_or_default();
        rec.processes.retain(|p| start_of(p.pid) == Some(p.start));
        for p in &mut rec.processes {
            p.templates.retain(|t| start_of(t.pid) == Some(t.start));
        }
        // The kernel asked once, before any pause that walks memory.
        if !rec.processes.is_empty() {
            dirty::scan_sees_holes();
        }
        Book {
            path,
            dirs: dirs.clone(),
            rec,
            pause_written: Default::default(),
            pause_maps: Default::default(),
            sources: Default::default(),
        }
    }

    /// Saves the record: false where it could not be (what was merged
    /// since must not be relied on then).
    pub fn save(&self) -> bool {
        use std::os::unix::fs::FileExt;
        if self.rec.version != TRACKING_VERSION {
            return false;
        }
        let Ok(json) = serde_json::to_vec(&self.rec) else {
            return false;
        };
        let mut data = format!("{}\n", blake3::hash(&json).to_hex()).into_bytes();
        data.extend_from_slice(&json);
        data.push(b'\n');
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&self.path);
        f.is_ok_and(|f| {
            let old = f.metadata().map_or(0, |m| m.len()) as usize;
            data.resize(data.len().max(old), b' ');
            f.write_all_at(&data, 0).is_ok()
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
        let (Some(start), Some((text, (_, runs, maps)))) = (start_of(pid), spans_read(pid)) else {
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
            return self.save() && dirty::arm(pid, &uffd, &dirty::armable(&maps), &maps).is_ok();
        };
        let Some(written) = self.record_written(i, pid, &runs) else {
            return false;
        };
        self.pause_written.insert(pid, written.clone());
        // Mappings made since (their pages all read as written) are
        // registered now.
        let loose = dirty::unregistered(pid, &runs).unwrap_or_default();
        let fresh: Vec<(u64, u64)> = dirty::armable(&maps)
            .into_iter()
            .filter(|&(a, b)| loose.within(a, b).next().is_some())
            .collect();
        if !fresh.is_empty() {
            let Some(uffd) = crate::supervisor::tracker(&self.dirs, pid, start) else {
                return false;
            };
            if dirty::arm(pid, &uffd, &fresh, &maps).is_err() {
                return false;
            }
        } else {
            // Registering mappings may merge or split them; protecting
            // pages changes none.
            self.pause_maps.insert(pid, text);
        }
        let (anon, files) = dirty::by_backing(&written, &maps);
        dirty::protect_stopped(pid, &anon, &files).is_ok()
    }

    /// Stopped process `pid`'s `/proc/PID/maps` text as [`Book::before_fork`]
    /// read it, once, where its mappings are still as read then (nothing
    /// was registered for tracking since): the rest of its checkpoint reads
    /// them from here (numpy's: 0.22 ms a reading).
    pub fn maps_read(&mut self, pid: u32) -> Option<String> {
        self.pause_maps.remove(&pid)
    }

    /// What tracked process `pid` (the record's `i`th) wrote in `runs` since
    /// the last scan, added to every one of its templates' sets and saved —
    /// before those pages are protected again, so that a crash leaves the
    /// sets too large, never too small.
    fn record_written(&mut self, i: usize, pid: u32, runs: &[(u64, u64)]) -> Option<Ranges> {
        let written = dirty::written(pid, runs).ok()?;
        for s in &mut self.rec.processes[i].templates {
            s.changed.add(&written);
        }
        self.save().then_some(written)
    }

    /// While tracked process `pid` still runs, before its checkpoint stops
    /// it: what it wrote since the last scan is added to every template's
    /// set (saved) and protected again, so that the pause's scan finds only
    /// what it writes from here. (A page written between the scan and its
    /// protection is in the scan already.) Whether that was done.
    pub fn scan_running(&mut self, pid: u32) -> bool {
        let Some(i) = self.rec.processes.iter().position(|p| p.pid == pid) else {
            return false;
        };
        let Some((_, runs, maps)) = spans(pid) else {
            return false;
        };
        let Some(written) = self.record_written(i, pid, &runs) else {
            return false;
        };
        // Mappings made since are registered in the pause.
        let loose = dirty::unregistered(pid, &runs).unwrap_or_default();
        let (anon, files) = dirty::by_backing(&written.without(&loose), &maps);
        dirty::protect(pid, &anon, &files).is_ok()
    }

    /// What process `pid` wrote since the last scan, as the checkpoint's
    /// pause found it.
    pub fn written_in_pause(&self, pid: u32) -> Option<&Ranges> {
        self.pause_written.get(&pid)
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

    /// How many pages of its own template `tpl` holds, when its source was
    /// read with them.
    pub fn own_pages_of(&self, tpl: &Template) -> Option<u64> {
        self.with_source(tpl, |r| r.own_pages().map(|o| o.pages()))
            .flatten()
    }

    /// Whether template `pid` is tracked (its source is worth reading).
    pub fn has_template(&self, pid: u32) -> bool {
        self.rec
            .processes
            .iter()
            .any(|p| p.templates.iter().any(|s| s.pid == pid))
    }

    /// Removes the kept sources of templates that are gone.
    pub fn prune_sources(&self) {
        let Ok(rd) = std::fs::read_dir(self.dirs.root.join("sources")) else {
            return;
        };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            let alive = name.split_once('.').is_some_and(|(p, s)| {
                p.parse::<u32>()
                    .ok()
                    .zip(s.parse::<u64>().ok())
                    .is_some_and(|(p, s)| start_of(p) == Some(s))
            });
            if !alive {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }

    /// What a graft reads from template `tpl`, read from its file the first
    /// time only; shared, not copied (numpy's copy took 0.05 ms of a
    /// rollback's pause).
    fn source(&self, tpl: &Template) -> Option<Arc<SourceRecord>> {
        let key = (tpl.pid, tpl.start_time);
        let mut sources = self.sources.borrow_mut();
        let kept = sources.entry(key).or_insert_with(|| {
            let path = self
                .dirs
                .root
                .join("sources")
                .join(format!("{}.{}", tpl.pid, tpl.start_time));
            std::fs::read(path)
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok())
                .map(|mut r: SourceRecord| {
                    r.parse();
                    Arc::new(r)
                })
        });
        kept.clone()
    }

    /// `f` of what a graft reads from template `tpl` ([`Book::source`]).
    fn with_source<T>(&self, tpl: &Template, f: impl FnOnce(&SourceRecord) -> T) -> Option<T> {
        self.source(tpl).map(|r| f(&r))
    }

    /// Reads what a graft reads from template `tpl` (when tracked) ahead,
    /// off the pause of the rollback about to use it.
    /// One not kept (its checkpoint's preparation was cut short by this
    /// rollback, `prepare`) is read from the template here, still off the
    /// pause, and kept.
    pub fn preload(&self, tpl: &Template) {
        if !self.has_template(tpl.pid) || self.source(tpl).is_some() {
            return;
        }
        if let Ok(done) = tine_proc::template::prepare_parked(tpl, true, &|| false)
            && let Some(source) = &done.source
        {
            keep_source(&self.dirs, tpl.pid, source);
            let key = (tpl.pid, tpl.start_time);
            self.sources.borrow_mut().remove(&key);
            let _ = self.source(tpl);
        }
    }

    /// The tracked processes that follow template `tpl` (copies cloned from
    /// it since its origin was rolled back).
    pub fn followers<'a>(&'a self, tpl: &'a Template) -> impl Iterator<Item = u32> + 'a {
        self.rec
            .processes
            .iter()
            .filter(move |p| {
                p.templates
                    .iter()
                    .any(|s| s.pid == tpl.pid && s.start == tpl.start_time)
            })
            .map(|p| p.pid)
            .filter(move |&p| p != tpl.origin)
    }

    /// Where live process `pid` (stopped) may differ from its template
    /// `tpl`: its set, what it wrote since the last scan, and the pages the
    /// template holds that it has not. Every template's set takes all of it
    /// (saved) before the rollback changes anything. `None`: not tracked.
    pub fn changed_since(
        &mut self,
        pid: u32,
        tpl: &Template,
        helper: Option<&tine_proc::pusher::Hand>,
    ) -> Option<InPlace> {
        let scanned = self.to_scan(pid, tpl)?.scan(helper)?;
        let how = self.merge_unsaved(pid, tpl, scanned)?;
        self.save().then_some(how)
    }

    /// What a scan of live process `pid` against its template `tpl` needs
    /// of the record, taken here so that another thread may scan (a tree's
    /// processes are scanned on two). `None`: not tracked.
    pub fn to_scan(&self, pid: u32, tpl: &Template) -> Option<ToScan> {
        self.rec
            .processes
            .iter()
            .find(|p| p.pid == pid)?
            .templates
            .iter()
            .find(|s| s.pid == tpl.pid && s.start == tpl.start_time)?;
        Some(ToScan {
            pid,
            tpid: tpl.pid,
            source: self.source(tpl),
        })
    }

    /// Takes what `scanned` found of live process `pid` into its sets
    /// ([`Book::changed_since`]), unsaved: every process's are saved at
    /// once after ([`Book::save`]; PostgreSQL's seven saves, each of the
    /// whole record, took 0.03-0.05 ms apiece).
    pub fn merge_unsaved(&mut self, pid: u32, tpl: &Template, scanned: Scanned) -> Option<InPlace> {
        let p = self.rec.processes.iter().position(|p| p.pid == pid)?;
        let s = self.rec.processes[p]
            .templates
            .iter()
            .position(|s| s.pid == tpl.pid && s.start == tpl.start_time)?;
        let Scanned {
            written,
            missing,
            each,
            maps,
            source,
        } = scanned;
        let mut d = self.rec.processes[p].templates[s].changed.clone();
        d.add(&written);
        d.add(&missing);
        for t in &mut self.rec.processes[p].templates {
            t.changed.add(&d);
        }
        // What copying it back will cost: pages over pages the process
        // holds, and (a first touch each) pages where it holds none —
        // dropped, or in mappings it no longer has.
        let cost_us = source.as_ref().and_then(|r| r.own_pages()).map(|own| {
            let copied = d.intersect(own).pages();
            let mapped = own.intersect(&Ranges::from_unsorted(each)).pages();
            let fresh = missing.pages() + (own.pages() - mapped);
            copied.saturating_sub(missing.pages()) * COPY_US + fresh * FIRST_TOUCH_US
        });
        Some(InPlace {
            changed: d,
            source,
            cost_us,
            maps,
        })
    }

    /// Where stopped process `pid`, whose writes since the last scan were
    /// just added to its sets ([`Book::before_fork`]), may differ from its
    /// template `tpl`: that template's set, and the pages the template
    /// holds that the process has not (dropped since). `None`: not tracked.
    pub fn differs_from(&self, pid: u32, tpl: &Template) -> Option<Ranges> {
        let p = self.rec.processes.iter().find(|p| p.pid == pid)?;
        let s = p
            .templates
            .iter()
            .find(|s| s.pid == tpl.pid && s.start == tpl.start_time)?;
        let plan = self.source(tpl).and_then(|r| r.walks().cloned());
        let missing = match &plan {
            // What it wrote or dropped since is in the set already.
            Some(plan) => dirty::dropped(pid, plan.anon(), plan.files(), Some(&s.changed)).ok()?,
            None => {
                let (_, sp, maps) = spans(pid)?;
                let seen = dirty::changed(pid, &sp).ok()?;
                lost_unknown(pid, tpl.pid, &seen.absent, &maps)?
            }
        };
        let mut d = s.changed.clone();
        d.add(&missing);
        Some(d)
    }

    /// Of `ranges`, the pages process `pid` (stopped) no longer holds a copy
    /// of its own in ([`dirty::dropped`]: anonymous ones missing, files'
    /// ones missing or the file's), told apart by template `tpl`'s mappings
    /// (the process's own where those were not read).
    pub fn lost_of(&self, pid: u32, tpl: &Template, ranges: &Ranges) -> Option<Ranges> {
        let split = self
            .with_source(tpl, |r| {
                r.mappings().map(|maps| dirty::by_backing(ranges, maps))
            })
            .flatten();
        let (anon, files) = match split {
            Some(split) => split,
            None => dirty::by_backing(ranges, &spans(pid)?.2),
        };
        dirty::dropped(pid, &anon, &files, None).ok()
    }

    /// How many pages of `changed` a graft of process `pid` into a copy of
    /// template `tpl` would copy, told without a walk: those the template
    /// holds of its own, and as many more as the process's anonymous
    /// memory grew past them (pages it wrote where the template held
    /// none). A range never touched reads as written ([`dirty::protect`])
    /// and costs nothing: numpy's 65 k such pages made the spare look
    /// dearer than the fork.
    pub fn copy_estimate(&self, pid: u32, tpl: &Template, changed: &Ranges) -> u64 {
        let source = self.source(tpl);
        let Some(own) = source.as_ref().and_then(|r| r.own_pages()) else {
            return changed.pages();
        };
        let beyond = changed.without(own).pages();
        // (Its anonymous pages in memory: `RssAnon`, in KiB.)
        let grown = tine_proc::inspect::status_kib(pid, "RssAnon:")
            .map_or(beyond, |kib| (kib / 4).saturating_sub(own.pages()));
        changed.intersect(own).pages() + grown.min(beyond)
    }

    /// Whether process `pid` is tracked.
    pub fn tracks(&self, pid: u32) -> bool {
        self.rec.processes.iter().any(|p| p.pid == pid)
    }

    /// Whether process `pid` (started at `start`) is tracked since template
    /// `tpl`.
    pub fn follows(&self, pid: u32, start: u64, tpl: &Template) -> bool {
        self.rec.processes.iter().any(|p| {
            p.pid == pid
                && p.start == start
                && p.templates
                    .iter()
                    .any(|s| s.pid == tpl.pid && s.start == tpl.start_time)
        })
    }

    /// Arms copy `t` (stopped, not yet run) of a template: from its first
    /// instruction every write of it is seen, by the tracker returned,
    /// which [`Book::adopt`] hands to the supervisor once it runs.
    pub fn arm_copy(t: &mut Tracee) -> Option<std::os::fd::OwnedFd> {
        let (_, _, maps) = spans(t.pid())?;
        let uffd = dirty::open_tracker(t).ok()?;
        dirty::arm(t.pid(), &uffd, &dirty::armable(&maps), &maps).ok()?;
        Some(uffd)
    }

    /// After tracked process `origin` was rolled back by cloning `copy`
    /// from template `tpl` (armed by [`Book::arm_copy`], `uffd`): the copy
    /// is tracked in its place, the template's it is page for page. When
    /// `merged` (the rollback's [`Book::changed_since`] added what the
    /// origin may differ from `tpl` in to every other template's set),
    /// those templates are tracked too: the copy may differ from each only
    /// where the origin may have differed from it or from `tpl`.
    pub fn adopt(
        &mut self,
        origin: u32,
        copy: u32,
        uffd: std::os::fd::OwnedFd,
        tpl: &Template,
        merged: bool,
    ) {
        use std::os::fd::AsFd;
        let Some(start) = start_of(copy) else { return };
        let mut templates = Vec::new();
        if merged && let Some(p) = self.rec.processes.iter().find(|p| p.pid == origin) {
            templates = p.templates.clone();
        }
        templates.retain(|s| !(s.pid == tpl.pid && s.start == tpl.start_time));
        templates.push(Since {
            pid: tpl.pid,
            start: tpl.start_time,
            changed: Ranges::new(),
        });
        self.rec
            .processes
            .retain(|p| p.pid != origin && p.pid != copy);
        self.rec.version = TRACKING_VERSION;
        if crate::supervisor::keep(&self.dirs, copy, start, uffd.as_fd()).is_none() {
            let _ = self.save();
            return;
        }
        self.rec.processes.push(Tracked {
            pid: copy,
            start,
            templates,
        });
        if !self.save() {
            self.forget(copy);
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_torn_or_changed_tracks_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let dirs = SandboxDirs {
            root: dir.path().to_path_buf(),
        };
        let mut b = Book::load(&dirs);
        b.rec.version = TRACKING_VERSION;
        // A process that is alive: this test's own.
        let me = std::process::id();
        b.rec.processes.push(Tracked {
            pid: me,
            start: start_of(me).unwrap(),
            templates: vec![Since {
                pid: me,
                start: start_of(me).unwrap(),
                changed: Ranges::from_unsorted(vec![(0x1000, 0x9000)]),
            }],
        });
        assert!(b.save());
        assert_eq!(Book::load(&dirs).rec.processes.len(), 1);
        // A shorter record over a longer one: the rest is blanked out.
        b.rec.processes[0].templates.clear();
        assert!(b.save());
        let again = Book::load(&dirs);
        assert!(again.rec.processes[0].templates.is_empty());
        // One byte changed (a torn write): nothing is tracked.
        let path = dir.path().join("tracking");
        let mut bytes = std::fs::read(&path).unwrap();
        let at = bytes.iter().position(|c| *c == b'[').unwrap();
        bytes[at] = b'{';
        std::fs::write(&path, bytes).unwrap();
        assert!(Book::load(&dirs).rec.processes.is_empty());
    }
}
