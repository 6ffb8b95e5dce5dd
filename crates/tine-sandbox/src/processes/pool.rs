//! The template pool across a repository's sandboxes: its limits, eviction
//! of the least recently used, what each snapshot holds, and pruning the
//! process state of removed snapshots.

use super::*;

/// How many templates may be kept, and how much private memory they may
/// hold, across all sandboxes of a repository.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolLimits {
    pub max_templates: usize,
    pub max_bytes: u64,
}

impl Default for PoolLimits {
    fn default() -> Self {
        PoolLimits {
            max_templates: 64,
            max_bytes: 8 << 30,
        }
    }
}

/// A snapshot's process state that was let go.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Evicted {
    pub sandbox: String,
    pub snapshot: String,
    pub bytes: u64,
    /// Its processes stay restorable from CRIU images.
    pub persisted: bool,
}

/// Keeps the repository's templates within `limits`, letting go of the least
/// recently used snapshots' first (the record's modification time is its
/// last use). The records stay: they say that the process state was let go,
/// and keep the CRIU images of persisted ones. The snapshots stay restorable
/// from their files (and their processes from the images).
pub fn enforce(repo: &Path, limits: PoolLimits) -> Vec<Evicted> {
    let mut all = Vec::new();
    for (sandbox, path, st) in repo_states(repo) {
        if !st.alive() {
            continue;
        }
        let used = std::fs::metadata(&path)
            .and_then(|m| m.modified())
            .unwrap_or(std::time::UNIX_EPOCH);
        all.push((used, sandbox, path, st));
    }
    // Newest first: they are kept while they fit.
    all.sort_by_key(|b| std::cmp::Reverse(b.0));
    let (mut count, mut bytes) = (0usize, 0u64);
    let mut evicted = Vec::new();
    for (i, (_, sandbox, path, mut st)) in all.into_iter().enumerate() {
        // The most recent one is kept even alone over the limits: it was just
        // made (and holds next to nothing of its own yet: not measured).
        let b = if i == 0 { 0 } else { measured(&path, &mut st) };
        let fits = count + st.processes.len() <= limits.max_templates
            && bytes.saturating_add(b) <= limits.max_bytes;
        if fits || i == 0 {
            count += st.processes.len();
            bytes = bytes.saturating_add(b);
            continue;
        }
        st.discard();
        // Recorded, so that a restore says why they are gone.
        st.evicted_ns = Some(tine_store::now_ns());
        if let Ok(data) = serde_json::to_vec_pretty(&st) {
            let _ = tine_store::write_atomic(&path, &data);
        }
        evicted.push(Evicted {
            sandbox,
            persisted: st.persisted(),
            snapshot: st.snapshot,
            bytes: b,
        });
    }
    evicted
}

/// How long the pool trusts a measurement of a record's private bytes.
const MEASURE_EVERY_NS: u64 = 10_000_000_000;

/// The record's private bytes: measured again when the last figure is older
/// than [`MEASURE_EVERY_NS`] (and written back, keeping the record's time,
/// which is its last use).
fn measured(path: &Path, st: &mut ProcessState) -> u64 {
    let now = now_ns();
    if now.saturating_sub(st.measured_ns) < MEASURE_EVERY_NS {
        return st.measured_bytes;
    }
    st.measured_bytes = st.private_bytes();
    st.measured_ns = now;
    let used = std::fs::metadata(path).and_then(|m| m.modified());
    if let Ok(data) = serde_json::to_vec_pretty(st)
        && tine_store::write_atomic(path, &data).is_ok()
        && let Ok(t) = used
    {
        set_used(path, t);
    }
    st.measured_bytes
}

/// What one snapshot's process state holds, across sandboxes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Held {
    /// Live templates, and their private bytes.
    pub live: usize,
    pub live_bytes: u64,
    /// Processes persisted with CRIU, and the size of their images.
    pub persisted: usize,
    pub persisted_bytes: u64,
}

/// The process state the repository holds, per snapshot (hex): live
/// templates and CRIU images. `live_bytes` is measured only `with_bytes`
/// (reading `smaps_rollup` walks every page of every template).
pub fn held(repo: &Path, with_bytes: bool) -> std::collections::HashMap<String, Held> {
    let mut out = std::collections::HashMap::<String, Held>::new();
    // Per snapshot, the templates counted: a native fork's template may
    // share its source template's memory (`tine_proc::sharing`), counted once.
    let mut counted = std::collections::HashMap::<String, Vec<u32>>::new();
    for (_, _, st) in repo_states(repo) {
        let alive = st.alive();
        if !alive && !st.persisted() {
            continue;
        }
        let slot = out.entry(st.snapshot.clone()).or_default();
        if alive {
            slot.live += st.processes.len();
            if with_bytes {
                let seen = counted.entry(st.snapshot.clone()).or_default();
                for c in &st.processes {
                    let pid = c.template.pid;
                    let shared = seen
                        .iter()
                        .any(|&o| tine_proc::raw::same_memory(pid, o).unwrap_or(false));
                    if !shared {
                        slot.live_bytes += super::private_bytes(pid);
                        seen.push(pid);
                    }
                }
            }
        }
        for img in st.processes.iter().filter_map(|c| c.image.as_ref()) {
            slot.persisted += 1;
            slot.persisted_bytes += img.bytes;
        }
    }
    out
}

/// Every templates record of every sandbox of the repository at `repo`:
/// (sandbox id, record path, record).
fn repo_states(repo: &Path) -> Vec<(String, PathBuf, ProcessState)> {
    let Ok(rd) = std::fs::read_dir(repo.join("sandboxes")) else {
        return Vec::new();
    };
    rd.flatten()
        .flat_map(|e| {
            let sandbox = e.file_name().to_string_lossy().into_owned();
            all_states(&SandboxDirs { root: e.path() })
                .into_iter()
                .map(move |(path, st)| (sandbox.clone(), path, st))
        })
        .collect()
}

/// What [`prune`] removed (or would remove).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Pruned {
    /// Process-state records of snapshots that are gone.
    pub records: usize,
    /// CRIU image directories no record names any more, and their bytes.
    pub image_dirs: usize,
    pub image_bytes: u64,
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum()
}

/// Drops the process state of snapshots that no longer exist (`exists` says
/// which do, by hex id): their templates are killed, their records and CRIU
/// images removed; and image directories no record names (a dump cut short).
/// With `dry_run`, only counts.
pub fn prune(repo: &Path, exists: impl Fn(&str) -> bool, dry_run: bool) -> Pruned {
    let mut out = Pruned::default();
    let Ok(rd) = std::fs::read_dir(repo.join("sandboxes")) else {
        return out;
    };
    for e in rd.flatten() {
        let dirs = SandboxDirs { root: e.path() };
        let mut named = std::collections::HashSet::new();
        for (path, st) in all_states(&dirs) {
            if exists(&st.snapshot) {
                named.extend(
                    st.processes
                        .iter()
                        .filter_map(|c| Some(c.image.as_ref()?.dir.clone())),
                );
                continue;
            }
            out.records += 1;
            if !dry_run {
                st.discard();
                let _ = std::fs::remove_file(&path);
            }
        }
        let images = criu_dir(&dirs);
        for img in std::fs::read_dir(&images).into_iter().flatten().flatten() {
            // (The logs of failed dumps are files; each is replaced by the next.)
            if !img.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let name = img.file_name().to_string_lossy().into_owned();
            if named.contains(&name) {
                continue;
            }
            out.image_dirs += 1;
            out.image_bytes += dir_bytes(&img.path());
            if !dry_run {
                let _ = std::fs::remove_dir_all(img.path());
            }
        }
    }
    out
}
