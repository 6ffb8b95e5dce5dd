//! Forks prepared ahead of `tine fork` (`tine snapshot --prepare-forks K`):
//! native forks of a snapshot made off every call's critical path, each a
//! whole sandbox (overlay seeded, cgroup, supervisor, nested init, its own
//! templates) recorded as prepared under its id, its processes held
//! stopped by its init. A fork of that snapshot claims them: a name and
//! the running state each, in one transaction, then each supervisor names
//! its host and lets its init go. A sandbox keeps the prepared forks of its
//! latest preparation only; ending it discards them.

use super::*;

/// What `tine snapshot --prepare-forks K` made.
#[derive(Debug, Clone, Default, Serialize, serde::Deserialize)]
pub struct Prepared {
    /// Prepared forks now ready.
    pub forks: usize,
    /// The preparation's wall time, in ms.
    pub ms: f64,
    /// What it took of the host's memory: the page tables of the forks'
    /// copies and of their templates (`VmPTE`), in bytes.
    pub page_table_bytes: u64,
    /// Why none could be prepared (the forks' processes would not come
    /// natively), if so.
    pub note: Option<String>,
}

/// The prepared forks of sandbox `origin` (by id), of any snapshot, with
/// the snapshot each is of.
pub fn of_origin(
    repo: &Repository,
    origin: &str,
) -> Result<Vec<(SandboxRecord, ObjectId)>, SandboxError> {
    let mut out = Vec::new();
    for r in repo.sandboxes()? {
        if r.state != SandboxState::Prepared {
            continue;
        }
        let nested = crate::nested::nested_in(&SandboxDirs::new(repo.path(), &r.id));
        if nested.is_some_and(|n| n.origin == origin)
            && let Some(snap) = repo.head(&head_key(&r.id))?
        {
            out.push((r, snap));
        }
    }
    // Oldest first: claimed in the order they were made.
    out.sort_by_key(|(r, _)| r.created_ns);
    Ok(out)
}

/// The prepared forks of snapshot `snap`.
fn of_snapshot(repo: &Repository, snap: &ObjectId) -> Vec<SandboxRecord> {
    let Ok(Some(src)) = repo
        .read_snapshot(snap)
        .map(|s| sandbox_of_source(repo, &s.source))
    else {
        return Vec::new();
    };
    of_origin(repo, &src.id)
        .unwrap_or_default()
        .into_iter()
        .filter(|(_, s)| s == snap)
        .map(|(r, _)| r)
        .collect()
}

/// How many prepared forks of snapshot `snap` are ready to be claimed.
pub fn ready(repo: &Repository, snap: &ObjectId) -> usize {
    of_snapshot(repo, snap).len()
}

/// The prepared forks of snapshot `snap` and the page tables they hold
/// (bytes), as `tine show` reports them.
pub fn held(repo: &Repository, snap: &ObjectId) -> (usize, u64) {
    let forks = of_snapshot(repo, snap);
    let bytes = forks.iter().map(|r| page_tables(&r.id)).sum();
    (forks.len(), bytes)
}

/// Removes sandbox `origin`'s prepared forks, and those that ended
/// unclaimed (killed while held); what could not be removed is left for
/// `tine rm`.
pub fn discard(repo: &Repository, origin: &str) -> usize {
    let Ok(all) = repo.sandboxes() else {
        return 0;
    };
    all.iter()
        .filter(|r| {
            let dirs = SandboxDirs::new(repo.path(), &r.id);
            dirs.prepared_mark().exists()
                && crate::nested::nested_in(&dirs).is_some_and(|n| n.origin == origin)
        })
        .filter(|r| remove(repo, r, true).is_ok())
        .count()
}

/// Prepares `k` native forks of snapshot `snap` (its sandbox's earlier
/// prepared forks discarded first by the caller, [`discard`], so that
/// their places count as free). The snapshot stands whatever happens
/// here: forks that cannot be prepared are told in the note, and a
/// preparation that fails leaves none of its forks.
pub fn prepare(
    lock: &WriteLock<'_>,
    snap: &ObjectId,
    k: usize,
    exe: &Path,
) -> Result<Prepared, SandboxError> {
    let t0 = std::time::Instant::now();
    let repo = lock.repo();
    if k == 0 {
        return Ok(Prepared::default());
    }
    let opts = ForkOptions {
        prepare: true,
        ..ForkOptions::default()
    };
    // Under the lock no other fork is made: what is new after a failure is
    // this preparation's, and goes.
    let before: std::collections::HashSet<String> =
        repo.sandboxes()?.into_iter().map(|r| r.id).collect();
    let forked = match fork(lock, snap, k, &opts, exe, &NoProgress) {
        Ok(f) => f,
        Err(e) => {
            for r in repo.sandboxes().unwrap_or_default() {
                if !before.contains(&r.id) {
                    let _ = remove(repo, &r, true);
                }
            }
            return Ok(Prepared {
                ms: t0.elapsed().as_secs_f64() * 1e3,
                note: Some(format!("preparing the forks failed: {e}")),
                ..Prepared::default()
            });
        }
    };
    let page_table_bytes = forked.records.iter().map(|r| page_tables(&r.id)).sum();
    Ok(Prepared {
        forks: forked.records.len(),
        ms: t0.elapsed().as_secs_f64() * 1e3,
        page_table_bytes,
        note: forked.note,
    })
}

/// The page tables (`VmPTE`) of a fork's processes: its copies, their
/// templates and its init, all in its cgroup.
fn page_tables(id: &str) -> u64 {
    let pids = CgroupRoot::detect(Path::new(DEFAULT_ROOT))
        .and_then(|r| r.open(id))
        .and_then(|cg| cg.processes())
        .unwrap_or_default();
    pids.into_iter()
        .filter_map(tine_proc::inspect::page_table_bytes)
        .sum()
}

/// Claims up to `names.len()` prepared forks of snapshot `snap` of
/// sandbox `origin`, naming them `names` in order (`None`: its id): the
/// records of those claimed, running. One that cannot be let go is removed (the caller
/// makes its place's fork another way).
pub(super) fn claim(
    lock: &WriteLock<'_>,
    origin: &str,
    snap: &ObjectId,
    names: &[Option<String>],
) -> Result<Vec<SandboxRecord>, SandboxError> {
    let repo = lock.repo();
    let ready: Vec<SandboxRecord> = of_origin(repo, origin)?
        .into_iter()
        .filter(|(r, s)| {
            s == snap
                && crate::nested::nested_in(&SandboxDirs::new(repo.path(), &r.id))
                    .is_some_and(|n| n.alive())
        })
        .map(|(r, _)| r)
        .take(names.len())
        .collect();
    if ready.is_empty() {
        return Ok(Vec::new());
    }
    let claims: Vec<(String, String)> = ready
        .iter()
        .zip(names)
        .map(|(r, n)| (r.id.clone(), n.clone().unwrap_or_else(|| r.id.clone())))
        .collect();
    let taken = lock.claim_sandboxes(&claims)?;
    let ready: Vec<SandboxRecord> = ready
        .into_iter()
        .filter(|r| taken.contains(&r.id))
        .collect();
    let let_go: Vec<Result<SandboxRecord, String>> = std::thread::scope(|sc| {
        let handles: Vec<_> = ready
            .iter()
            .map(|r| {
                let dirs = SandboxDirs::new(repo.path(), &r.id);
                sc.spawn(move || supervisor::claim(&dirs, Duration::from_secs(15)))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("the claiming thread panicked".into()))
            })
            .collect()
    });
    let mut claimed = Vec::with_capacity(let_go.len());
    for (r, got) in ready.iter().zip(let_go) {
        match got {
            Ok(rec) => {
                let _ = std::fs::remove_file(SandboxDirs::new(repo.path(), &r.id).prepared_mark());
                claimed.push(rec)
            }
            Err(_) => {
                // Its name goes to a fork made the other way.
                if let Ok(rec) = repo.sandbox(&r.id) {
                    let _ = remove(repo, &rec, true);
                }
            }
        }
    }
    Ok(claimed)
}
