//! Copies of a template in namespaces of their own (a native fork into a
//! new sandbox): the clone into new user, PID, mount, UTS, IPC (and network)
//! namespaces, their identity ID maps, and the capabilities the process
//! keeps.

use nix::libc;

use crate::inspect::ProcError;
use crate::ptrace::Tracee;
use crate::template::{
    CLONE_PARENT, CLONE_VM, Template, clone_args, inject_fork, scratch_path, seize_template,
};

/// `clone3` flags for a copy in namespaces of its own: a user namespace (in
/// which it holds every capability, though the template holds few), and PID,
/// mount, UTS and IPC namespaces owned by it (network: see [`Nest::new_net`]).
const NEW_NAMESPACES: u64 = 0x1000_0000 // CLONE_NEWUSER
    | 0x2000_0000 // CLONE_NEWPID
    | 0x0002_0000 // CLONE_NEWNS
    | 0x0400_0000 // CLONE_NEWUTS
    | 0x0800_0000; // CLONE_NEWIPC
const CLONE_NEWNET: u64 = 0x4000_0000;

/// Writes a new user namespace's ID maps: (its process, `uid_map`,
/// `gid_map`).
pub type IdWriter<'w> = &'w dyn Fn(u32, &str, &str) -> std::io::Result<()>;

/// How to make a [`Nested`] copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Nest {
    /// The process's PID in the new PID namespace (its origin's, usually).
    pub pid: u32,
    /// The capabilities the process keeps (a bit per capability number).
    pub keep_caps: u64,
    /// A network namespace of its own too (else the template's).
    pub new_net: bool,
}

/// A copy of a template in namespaces of its own, both stopped: `init`, PID 1
/// of a new PID namespace (nested in the template's), whose user namespace
/// maps every ID to itself, and which holds every capability there (it is to
/// become the namespaces' init, which finishes their setup); and `process`,
/// its child, at [`Nest::pid`] there, back at the checkpoint, holding only
/// only [`Nest::keep_caps`] and `no_new_privs` (its template's own
/// credentials once finished, see `own_files`). The caller makes `init` the
/// namespaces' init and lets `process` run (see [`Copies::finish`] for what
/// a copy needs); dropped unfinished, both are killed.
#[derive(Debug)]
pub struct Nested {
    init: Option<Tracee>,
    process: Option<Tracee>,
}

impl Nested {
    /// Their host PIDs: (init, process).
    pub fn pids(&self) -> (u32, u32) {
        let pid = |t: &Option<Tracee>| t.as_ref().map_or(0, Tracee::pid);
        (pid(&self.init), pid(&self.process))
    }

    /// Both, for the caller to finish: (init, process).
    pub fn into_parts(mut self) -> (Tracee, Tracee) {
        (
            self.init.take().expect("present until taken"),
            self.process.take().expect("present until taken"),
        )
    }
}

impl Drop for Nested {
    fn drop(&mut self) {
        // The init last: its end would kill the process anyway.
        for t in [self.process.take(), self.init.take()]
            .into_iter()
            .flatten()
        {
            t.kill();
        }
    }
}

/// Makes a [`Nested`] copy of `tpl`: an injected `clone3` with
/// [`NEW_NAMESPACES`] (no privilege needed: a new user namespace grants its
/// own) and `CLONE_VM`, the identity ID maps written from here; the new
/// init clones the process with `set_tid` [`Nest::pid`], which then gives
/// up every capability not kept and sets `no_new_privs`; finishing it
/// (`own_files`) gives it the template's own credentials. The new PID namespace lives
/// only as long as the template's (it is nested in it).
///
/// `id_writer`: writes the maps (`pid`, `uid_map` and `gid_map` text)
/// from the template's user namespace with every capability there, for a
/// template that may not (it runs as a user without `CAP_SETUID`, as a
/// database server does); the caller joins that namespace to do it.
pub fn clone_nested(
    tpl: &Template,
    nest: &Nest,
    id_writer: Option<IdWriter<'_>>,
) -> Result<Nested, ProcError> {
    let mut t = seize_template(tpl)?;
    let regs = *t.saved_regs();
    let flags = NEW_NAMESPACES | if nest.new_net { CLONE_NEWNET } else { 0 };
    let made = t.clone3(&clone_args(flags | CLONE_PARENT | CLONE_VM, 0, 0));
    // From here on an error drops `nested`, which kills what it holds.
    let mut nested = Nested {
        init: None,
        process: None,
    };
    let mapped = made.and_then(|init| {
        let pid = init.pid();
        nested.init = Some(init);
        match id_writer {
            Some(w) => {
                let map = |file: &str| {
                    std::fs::read_to_string(format!("/proc/{}/{file}", t.pid()))
                        .map(|m| identity_over(&m))
                };
                map("uid_map")
                    .and_then(|u| Ok((u, map("gid_map")?)))
                    .and_then(|(u, g)| w(pid, &u, &g))
                    .map_err(|source| ProcError::Ptrace {
                        pid,
                        step: "write the ID maps",
                        source,
                    })
            }
            None => write_id_maps(&mut t, pid),
        }
    });
    t.park()?;
    mapped?;
    let init = nested.init.as_mut().expect("just set");
    init.set_saved_regs(regs);
    let mut process = inject_fork(init, false, Some(nest.pid))?;
    process.set_saved_regs(regs);
    let process = nested.process.insert(process);
    // Root of its namespace with the sandbox's capabilities until its files
    // are open again (`own_files`, which then gives it the template's own
    // credentials: a process that dropped its privileges while holding a
    // file only root may open keeps it open in the copy).
    crate::creds::cut_capabilities(process, nest.keep_caps)?;
    Ok(nested)
}

/// An ID map (`uid_map` text) of a namespace nested in one whose map is
/// `parent`: each ID the parent has, mapped to itself.
fn identity_over(parent: &str) -> String {
    let mut out = String::new();
    for line in parent.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if let [inner, _, count] = f[..] {
            out.push_str(&format!("{inner} {inner} {count}\n"));
        }
    }
    if out.is_empty() {
        out.push_str("0 0 4294967295\n");
    }
    out
}

/// Writes the identity ID maps of `pid`, a copy `t` made in a new user
/// namespace. Only a process of the parent user namespace may: from here
/// when that is the host's (the template's sandbox has none of its own),
/// else from the template itself (injected; it keeps `CAP_SETUID` and
/// `CAP_SETGID` in its own).
/// Writes the ID maps of `pid`, made by `t` with a user namespace of its own.
fn write_id_maps(t: &mut Tracee, pid: u32) -> Result<(), ProcError> {
    for (file, step) in [("uid_map", "write uid_map"), ("gid_map", "write gid_map")] {
        // Identity over the IDs the template's namespace has: all of them
        // on the host, a sandbox's range in a sandbox's user namespace.
        let theirs = std::fs::read_to_string(format!("/proc/{}/{file}", t.pid()))
            .map_err(|source| ProcError::Ptrace { pid, step, source })?;
        let map = identity_over(&theirs);
        let map = map.as_bytes();
        let err = match std::fs::write(format!("/proc/{pid}/{file}"), map) {
            Ok(()) => continue,
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => e,
            Err(source) => return Err(ProcError::Ptrace { pid, step, source }),
        };
        // The copy's PID as the template's namespace sees it.
        let Some(there) = pid_seen_by(pid, t.pid()) else {
            return Err(ProcError::Ptrace {
                pid,
                step,
                source: err,
            });
        };
        let path_at = scratch_path(t, 0, std::path::Path::new(&format!("/proc/{there}/{file}")))?;
        let map_at = t.scratch(128, map)?;
        let fd = t.syscall(
            "openat(ID map)",
            libc::SYS_openat,
            [
                libc::AT_FDCWD as u64,
                path_at,
                (libc::O_WRONLY | libc::O_CLOEXEC) as u64,
                0,
                0,
                0,
            ],
        )?;
        let written = t.syscall_raw(libc::SYS_write, [fd, map_at, map.len() as u64, 0, 0, 0]);
        t.syscall("close", libc::SYS_close, [fd, 0, 0, 0, 0, 0])?;
        crate::ptrace::check(t.pid(), "write(ID map)", written?)?;
    }
    Ok(())
}

/// The PID host process `pid` has in the PID namespace of host process
/// `viewer` (which must be an ancestor namespace of `pid`'s).
fn pid_seen_by(pid: u32, viewer: u32) -> Option<u32> {
    use crate::inspect::ns_pids;
    let depth = ns_pids(viewer)?.len();
    ns_pids(pid)?.get(depth.checked_sub(1)?).copied()
}

#[cfg(test)]
mod tests {
    use super::identity_over;

    #[test]
    fn nested_id_maps_are_the_identity_over_the_parents_ids() {
        // The host's namespace: everything.
        assert_eq!(
            identity_over("         0          0 4294967295\n"),
            "0 0 4294967295\n"
        );
        // A sandbox's: its 65536 IDs, whatever they are on the host.
        assert_eq!(
            identity_over("         0 1073741824      65536\n"),
            "0 0 65536\n"
        );
        assert_eq!(identity_over(""), "0 0 4294967295\n");
    }
}
