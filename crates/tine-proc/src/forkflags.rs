//! Mappings a fork would not copy as they are: `MADV_DONTFORK` ones are left
//! out of the child (V8 marks its heap so), `MADV_WIPEONFORK` ones are
//! zeroed in it. Around the injected fork that makes a template, the origin's
//! are cleared and set again after, so the template holds their content;
//! every copy made from the template gets the flags back, so that the
//! program's own forks still leave them out.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::inspect::{ProcError, read_proc};
use crate::ptrace::Tracee;

const MADV_DONTFORK: u64 = 10;
const MADV_DOFORK: u64 = 11;
const MADV_WIPEONFORK: u64 = 18;
const MADV_KEEPONFORK: u64 = 19;

/// A process's mappings with a fork flag.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForkFlags {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dontfork: Vec<(u64, u64)>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub wipeonfork: Vec<(u64, u64)>,
}

/// A [`scan`]: the flags, and every mapping (to tell whether the scan
/// still holds later).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Scan {
    pub ranges: Vec<(u64, u64)>,
    pub flags: ForkFlags,
}

fn range(line: &str) -> Option<(u64, u64)> {
    let (a, b) = line.split_whitespace().next()?.split_once('-')?;
    Some((
        u64::from_str_radix(a, 16).ok()?,
        u64::from_str_radix(b, 16).ok()?,
    ))
}

/// The ranges of `pid`'s mappings (`/proc/PID/maps`: cheap).
pub fn ranges(pid: u32) -> Result<Vec<(u64, u64)>, ProcError> {
    Ok(ranges_in(&crate::inspect::maps_text(pid)?))
}

/// The ranges of the mappings of `maps` (a `/proc/PID/maps` text).
fn ranges_in(maps: &str) -> Vec<(u64, u64)> {
    maps.lines().filter_map(range).collect()
}

/// Scans `pid`'s mappings and their flags (`/proc/PID/smaps`: it walks the
/// page tables, about a millisecond per 500 MB: best done before the process
/// is stopped, then checked with [`ranges`]).
pub fn scan(pid: u32) -> Result<Scan, ProcError> {
    let path = PathBuf::from(format!("/proc/{pid}/smaps"));
    let text = read_proc(pid, &path)?;
    let mut out = Scan::default();
    let mut current = None;
    for line in text.lines() {
        let Some(first) = line.split_whitespace().next() else {
            continue;
        };
        if first == "VmFlags:" {
            if let Some(r) = current {
                let has = |f: &str| line.split_whitespace().any(|x| x == f);
                if has("dc") {
                    out.flags.dontfork.push(r);
                }
                if has("wf") {
                    out.flags.wipeonfork.push(r);
                }
            }
        } else if !first.ends_with(':')
            && let Some(r) = range(line)
        {
            // A mapping's first line ("start-end perms ..."); the others
            // are "Name: value".
            out.ranges.push(r);
            current = Some(r);
        }
    }
    Ok(out)
}

/// The flags of `pid` now, its memory map being `maps` (its
/// `/proc/PID/maps` text, read since it stopped): `hint` (a [`scan`] made
/// before it stopped) when its mappings are still the same, else a new scan.
pub fn current(pid: u32, maps: &str, hint: Option<&Scan>) -> Result<ForkFlags, ProcError> {
    match hint {
        Some(h) if ranges_in(maps) == h.ranges => Ok(h.flags.clone()),
        _ => Ok(scan(pid)?.flags),
    }
}

fn madvise(t: &mut Tracee, regions: &[(u64, u64)], advice: u64) -> Result<(), ProcError> {
    t.madvise_all(regions, advice)
}

/// Clears the flags in stopped `t` (before the fork that makes a template).
pub fn clear(t: &mut Tracee, f: &ForkFlags) -> Result<(), ProcError> {
    madvise(t, &f.dontfork, MADV_DOFORK)?;
    madvise(t, &f.wipeonfork, MADV_KEEPONFORK)
}

/// Sets the flags in stopped `t` (the origin after the fork, and each copy).
pub fn set(t: &mut Tracee, f: &ForkFlags) -> Result<(), ProcError> {
    madvise(t, &f.dontfork, MADV_DONTFORK)?;
    madvise(t, &f.wipeonfork, MADV_WIPEONFORK)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scan_finds_a_dontfork_and_a_wipeonfork_mapping() {
        // Python marks two anonymous mappings of 64 and 128 KiB (18:
        // MADV_WIPEONFORK, which its mmap module does not name).
        let (mut c, line) = tine_testkit::started_and_ready(
            std::process::Command::new("python3").args(["-c", "import mmap, time\na = mmap.mmap(-1, 65536); a.madvise(mmap.MADV_DONTFORK)\nb = mmap.mmap(-1, 131072, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS); b.madvise(18)\nprint('ready', flush=True)\ntime.sleep(30)"]),
        );
        let f = scan(c.id());
        let r = ranges(c.id());
        let _ = c.kill();
        let _ = c.wait();
        let f = f.unwrap();
        assert_eq!(line, "ready\n");
        assert!(
            f.flags.dontfork.iter().any(|(a, b)| b - a == 65536),
            "{f:?}"
        );
        assert!(
            f.flags.wipeonfork.iter().any(|(a, b)| b - a == 131072),
            "{f:?}"
        );
        assert_eq!(
            r.unwrap(),
            f.ranges,
            "maps and smaps list the same mappings"
        );
    }
}
