//! The sandbox's spare templates (`tine_proc::spare`): one per tracked
//! process, a parked copy of its latest template forked after that
//! checkpoint, which its next checkpoint makes into its template instead of
//! forking inside the pause.
//!
//! Recorded in `REPO/sandboxes/ID/spares` (JSON, written atomically; no
//! fsync: a reboot ends the processes it names). Each entry names the
//! spare, the template it is a copy of, and that template's origin. A
//! spare never runs; like a template it is left alone by the sandbox's
//! scans and rollbacks, and it is killed when it is replaced, when its
//! template is gone, or with the sandbox.

use super::*;
use tine_proc::spare::Spare;

const SPARES_VERSION: u32 = 1;

/// A spare, the template it copies, and that template's origin.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Entry {
    pub spare: Spare,
    pub base: Template,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Record {
    version: u32,
    spares: Vec<Entry>,
}

fn path(dirs: &SandboxDirs) -> PathBuf {
    dirs.root.join("spares")
}

/// The spares recorded (none when there is no record, or one of another
/// version).
fn recorded(dirs: &SandboxDirs) -> Record {
    std::fs::read(path(dirs))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .filter(|r: &Record| r.version == SPARES_VERSION)
        .unwrap_or_default()
}

/// The recorded spares that are still the processes they name, whose
/// templates are alive too; spares of templates that are gone are killed.
pub(crate) fn load(dirs: &SandboxDirs) -> Vec<Entry> {
    live(recorded(dirs))
}

fn live(rec: Record) -> Vec<Entry> {
    let (live, gone): (Vec<Entry>, Vec<Entry>) = rec
        .spares
        .into_iter()
        .filter(|e| tine_proc::spare::alive(&e.spare))
        .partition(|e| tine_proc::template::template_alive(&e.base));
    for e in &gone {
        tine_proc::spare::discard(&e.spare);
    }
    live
}

/// Host PIDs of the live spares.
pub(crate) fn pids(dirs: &SandboxDirs) -> Vec<u32> {
    load(dirs).iter().map(|e| e.spare.pid).collect()
}

/// Records `made` as the sandbox's spares. Of the earlier ones, those made
/// into templates since (`taken`) are left; the others are killed.
pub(crate) fn replace(dirs: &SandboxDirs, made: Vec<Entry>, taken: &[u32]) {
    let rec = recorded(dirs);
    // Nothing recorded, nothing to record (a sandbox whose forks are
    // cheap): no file written in the checkpoint's call.
    if rec.spares.is_empty() && made.is_empty() {
        return;
    }
    for old in live(rec) {
        if !taken.contains(&old.spare.pid) && !made.iter().any(|m| m.spare == old.spare) {
            tine_proc::spare::discard(&old.spare);
        }
    }
    write(dirs, made);
}

/// Adds `made` to the sandbox's spares (a checkpoint's preparation, one
/// at a time: each is recorded as soon as it exists, so that no scan takes
/// it for one of the sandbox's processes).
pub(crate) fn add(dirs: &SandboxDirs, made: Entry) {
    let mut all = load(dirs);
    all.push(made);
    write(dirs, all);
}

fn write(dirs: &SandboxDirs, made: Vec<Entry>) {
    let rec = Record {
        version: SPARES_VERSION,
        spares: made,
    };
    if let Ok(data) = serde_json::to_vec(&rec) {
        let tmp = dirs.root.join("spares.tmp");
        if std::fs::write(&tmp, data).is_ok() {
            let _ = std::fs::rename(&tmp, path(dirs));
        }
    }
}
