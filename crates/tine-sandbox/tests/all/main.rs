//! tine-sandbox integration tests. Privileged ones run for real as root and say
//! clearly when they cannot (not root, no cgroup hierarchy).
#![allow(clippy::print_stderr)]

mod cgroup_real;
mod overlay_real;

/// Root is needed for cgroups, mounts and namespaces; without it a test is skipped with a message.
pub fn need_root(what: &str) -> bool {
    let root = rustix_uid_is_root();
    if !root {
        eprintln!("skipped: {what} needs root");
    }
    root
}

fn rustix_uid_is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2).map(|e| e == "0"))
        })
        .unwrap_or(false)
}
