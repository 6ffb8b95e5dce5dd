//! tine-sandbox integration tests. Privileged ones run for real as root and say
//! clearly when they cannot (not root, no cgroup hierarchy).
#![allow(clippy::print_stderr)]

mod cgroup_real;
mod overlay_real;

/// Root is needed for cgroups, mounts and namespaces; without it a test is skipped with a message.
pub fn need_root(what: &str) -> bool {
    !tine_testkit::skipped_without_root(what)
}
