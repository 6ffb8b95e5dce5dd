//! Where the processes tine makes (templates, and copies of them) run while
//! it injects calls into them: on the tracing thread's CPU, so that each
//! stop and resume is a switch on one CPU instead of a wake-up across CPUs
//! (about 15 µs against 36–100 µs per injected call on a 2-CPU VM). A
//! sandbox's own processes are never moved; the ones made get their
//! origin's mask back before they run on their own. All best effort: a mask
//! that cannot be read or set only makes injection slower.

use nix::sched::{CpuSet, sched_getaffinity, sched_getcpu, sched_setaffinity};
use nix::unistd::Pid;

/// The CPUs `pid` may run on (empty when they cannot be read).
pub fn cpus_of(pid: u32) -> Vec<usize> {
    let Ok(set) = sched_getaffinity(Pid::from_raw(pid as i32)) else {
        return Vec::new();
    };
    (0..CpuSet::count())
        .filter(|&c| set.is_set(c).unwrap_or(false))
        .collect()
}

/// Moves `pid` to the calling thread's CPU, if `allowed` (its origin's
/// CPUs) has it.
pub fn pin_here(pid: u32, allowed: &[usize]) {
    if let Ok(cpu) = sched_getcpu()
        && allowed.contains(&cpu)
    {
        set(pid, &[cpu]);
    }
}

/// Gives `pid` the mask `cpus` (empty: leaves it as it is).
pub fn set(pid: u32, cpus: &[usize]) {
    if cpus.is_empty() {
        return;
    }
    let mut set = CpuSet::new();
    for &c in cpus {
        if set.set(c).is_err() {
            return;
        }
    }
    let _ = sched_setaffinity(Pid::from_raw(pid as i32), &set);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mask_is_read_pinned_and_given_back() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id();
        let own = cpus_of(pid);
        assert!(!own.is_empty());
        pin_here(pid, &own);
        let pinned = cpus_of(pid);
        assert_eq!(pinned.len(), 1, "{pinned:?}");
        assert!(own.contains(&pinned[0]));
        set(pid, &own);
        assert_eq!(cpus_of(pid), own);
        let _ = child.kill();
        let _ = child.wait();
    }
}
