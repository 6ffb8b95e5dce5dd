//! A process's credentials (user and group IDs, supplementary groups, the
//! five capability sets, securebits, `no_new_privs`): read from
//! `/proc/PID/status` and given back by injected calls to a copy made in a
//! user namespace of its own, which starts with every capability there. A
//! copy is never more privileged than its original: a program that dropped
//! to an unprivileged user before a checkpoint stays that user, with the
//! capabilities it had, in every fork (and never any outside the sandbox's
//! bounding set).

use nix::libc;

use crate::inspect::ProcError;
use crate::ptrace::Tracee;

/// Supplementary groups a copy can be given back (they are written below
/// its stack pointer).
const MAX_GROUPS: usize = 256;

const PR_CAPBSET_DROP: u64 = 24;
const PR_SET_NO_NEW_PRIVS: u64 = 38;
const PR_SET_SECUREBITS: u64 = 28;
const PR_GET_SECUREBITS: u64 = 27;
const PR_CAP_AMBIENT: u64 = 47;
const PR_CAP_AMBIENT_RAISE: u64 = 2;
const PR_CAP_AMBIENT_CLEAR_ALL: u64 = 4;
const SECBIT_KEEP_CAPS: u64 = 1 << 4;
const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;

/// What a process runs as.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Credentials {
    /// Real, effective, saved (and filesystem) user IDs.
    pub uids: [u32; 3],
    pub gids: [u32; 3],
    pub groups: Vec<u32>,
    pub inheritable: u64,
    pub permitted: u64,
    pub effective: u64,
    pub bounding: u64,
    pub ambient: u64,
    pub no_new_privs: bool,
    /// How many seccomp filters it runs under (not a credential: read from
    /// the same `status`, and never given by [`Credentials::give`]).
    pub filters: u64,
}

impl Credentials {
    /// Host process `pid`'s, as its own user namespace sees them (`status`
    /// shows IDs as the reader's namespace does: they are mapped back
    /// through the process's `uid_map` and `gid_map`).
    pub fn of(pid: u32) -> Result<Credentials, ProcError> {
        let read = |name: &str| {
            let path = std::path::PathBuf::from(format!("/proc/{pid}/{name}"));
            std::fs::read_to_string(&path).map_err(|e| ProcError::read(pid, &path, e))
        };
        let bad = |what: &str| {
            ProcError::read(
                pid,
                std::path::Path::new(&format!("/proc/{pid}/{what}")),
                std::io::Error::other("its credentials do not parse or map"),
            )
        };
        let mut c = Credentials::parse(&read("status")?).ok_or_else(|| bad("status"))?;
        let (umap, gmap) = (read("uid_map")?, read("gid_map")?);
        for id in &mut c.uids {
            *id = inner_id(*id, &umap).ok_or_else(|| bad("uid_map"))?;
        }
        for id in c.gids.iter_mut().chain(c.groups.iter_mut()) {
            *id = inner_id(*id, &gmap).ok_or_else(|| bad("gid_map"))?;
        }
        Ok(c)
    }

    /// From the text of a `/proc/PID/status`.
    pub fn parse(status: &str) -> Option<Credentials> {
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                .map(str::trim)
        };
        let ids = |name: &str| -> Option<[u32; 3]> {
            let v: Vec<u32> = field(name)?
                .split_whitespace()
                .map(|x| x.parse().ok())
                .collect::<Option<_>>()?;
            Some([*v.first()?, *v.get(1)?, *v.get(2)?])
        };
        let caps = |name: &str| u64::from_str_radix(field(name)?, 16).ok();
        Some(Credentials {
            uids: ids("Uid")?,
            gids: ids("Gid")?,
            groups: field("Groups")?
                .split_whitespace()
                .map(|x| x.parse().ok())
                .collect::<Option<_>>()?,
            inheritable: caps("CapInh")?,
            permitted: caps("CapPrm")?,
            effective: caps("CapEff")?,
            bounding: caps("CapBnd")?,
            ambient: caps("CapAmb")?,
            no_new_privs: field("NoNewPrivs").is_some_and(|v| v == "1"),
            filters: field("Seccomp_filters")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0),
        })
    }

    /// Gives `t` (a copy holding every capability in a user namespace of
    /// its own, whose ID maps are the identity) these credentials, each
    /// capability set cut to `keep`; `securebits` as the original's;
    /// `no_new_privs` always (every sandbox process has it).
    pub fn give(&self, t: &mut Tracee, bits: u64, keep: u64) -> Result<(), ProcError> {
        if self.groups.len() > MAX_GROUPS {
            return Err(ProcError::Injected {
                pid: t.pid(),
                call: "setgroups",
                source: std::io::Error::other(format!(
                    "the original has {} supplementary groups; a copy can be given back at most {MAX_GROUPS}",
                    self.groups.len()
                )),
            });
        }
        // What it holds now: every capability of its user namespace, or its
        // parent's copy's (the permitted set stays so through the change of
        // user below, which KEEP_CAPS keeps it across).
        let now = Credentials::of(t.pid())?;
        for cap in 0..=u64::from(crate::inspect::last_cap()) {
            // (Dropping one that is gone already would still need CAP_SETPCAP.)
            if (self.bounding & keep) & (1 << cap) == 0 && now.bounding & (1 << cap) != 0 {
                t.syscall(
                    "prctl(PR_CAPBSET_DROP)",
                    libc::SYS_prctl,
                    [PR_CAPBSET_DROP, cap, 0, 0, 0, 0],
                )?;
            }
        }
        // Keep the permitted set across the change of user; the effective
        // one is cleared by it and set again below.
        let current = securebits(t)?;
        t.syscall(
            "prctl(PR_SET_SECUREBITS)",
            libc::SYS_prctl,
            [PR_SET_SECUREBITS, current | SECBIT_KEEP_CAPS, 0, 0, 0, 0],
        )?;
        let groups: Vec<u8> = self.groups.iter().flat_map(|g| g.to_le_bytes()).collect();
        let at = t.scratch(0, &groups)?;
        t.syscall(
            "setgroups",
            libc::SYS_setgroups,
            [self.groups.len() as u64, at, 0, 0, 0, 0],
        )?;
        let [r, e, s] = self.gids.map(u64::from);
        t.syscall("setresgid", libc::SYS_setresgid, [r, e, s, 0, 0, 0])?;
        let [r, e, s] = self.uids.map(u64::from);
        t.syscall("setresuid", libc::SYS_setresuid, [r, e, s, 0, 0, 0])?;
        // Every permitted capability effective for a moment (setting
        // securebits needs CAP_SETPCAP), then the original's sets.
        capset(t, now.permitted, now.permitted, 0)?;
        t.syscall(
            "prctl(PR_SET_SECUREBITS)",
            libc::SYS_prctl,
            [PR_SET_SECUREBITS, bits, 0, 0, 0, 0],
        )?;
        capset(
            t,
            self.effective & keep,
            self.permitted & keep,
            self.inheritable & keep,
        )?;
        t.syscall(
            "prctl(PR_CAP_AMBIENT_CLEAR_ALL)",
            libc::SYS_prctl,
            [PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0, 0],
        )?;
        for cap in 0..=u64::from(crate::inspect::last_cap()) {
            if self.ambient & keep & (1 << cap) != 0 {
                t.syscall(
                    "prctl(PR_CAP_AMBIENT_RAISE)",
                    libc::SYS_prctl,
                    [PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, cap, 0, 0, 0],
                )?;
            }
        }
        // Set whatever the original had: a copy runs in a sandbox, whose
        // processes all have it (it cannot be unset anyway).
        no_new_privs(t)
    }
}

/// The seccomp filters of stopped tracee `pid`, oldest first (the kernel's
/// index 0 is the oldest: it counts back from the newest by the total).
fn filters(pid: u32) -> Result<Vec<Vec<u8>>, ProcError> {
    let mut out = Vec::new();
    for i in 0.. {
        match crate::raw::seccomp_filter(pid, i) {
            Ok(Some(f)) => out.push(f),
            Ok(None) => break,
            Err(source) => {
                return Err(ProcError::Ptrace {
                    pid,
                    step: "PTRACE_SECCOMP_GET_FILTER",
                    source,
                });
            }
        }
    }
    Ok(out)
}

/// Makes `copy` (a fresh copy, its template grafted on or forked from it,
/// its files open and its other `threads` made) run as `tpl` does: its
/// credentials, and the seccomp filters the template installed beyond those
/// the copy inherited. A copy's credentials can only be lowered from its
/// parent's, and a filter only added: where the template holds more
/// privilege than its parent's copy, or lacks a filter the copy has, the
/// fork is refused, naming the process, never made more privileged.
pub fn match_template(
    copy: &mut Tracee,
    threads: &mut [Tracee],
    template: &crate::template::Template,
    keep: u64,
) -> Result<(), ProcError> {
    let tpl = template.pid;
    let have = Credentials::of(copy.pid())?;
    // Never more than the copy's bounding set allows (a copy made in a
    // sandbox of its own was cut to the sandbox's already).
    let mut want = Credentials::of(tpl)?;
    let bound = have.bounding & keep;
    for set in [
        &mut want.inheritable,
        &mut want.permitted,
        &mut want.effective,
        &mut want.bounding,
        &mut want.ambient,
    ] {
        *set &= bound;
    }
    want.no_new_privs |= have.no_new_privs;
    // (Filters are compared below, not given with the credentials.)
    let their_filters = std::mem::replace(&mut want.filters, have.filters);
    let refuse = |copy: &Tracee, why: String| ProcError::Injected {
        pid: copy.pid(),
        call: "the template's credentials",
        source: std::io::Error::other(why),
    };
    if want != have {
        // (Its parent's securebits: a parked template's are not read here,
        // and programs that change them are rare.)
        let bits = securebits(copy)?;
        // Credentials are each thread's own (the calls are raw, not libc's
        // broadcast to every thread).
        for t in std::iter::once(&mut *copy).chain(threads.iter_mut()) {
            want.give(t, bits, keep).map_err(|e| {
                refuse(
                    t,
                    format!("they cannot be given to a copy of its parent ({e})"),
                )
            })?;
        }
    }
    if their_filters == have.filters {
        // (Siblings that each added one after they parted are not told
        // apart: the count decides, as reading a template's filters means
        // seizing it.)
        return Ok(());
    }
    // Its filters are read from it seized (the kernel shows a tracee's
    // only), and it is parked again.
    let seized = crate::template::seize_template(template)?;
    let theirs = filters(seized.pid());
    seized.park()?;
    let (theirs, mine) = (theirs?, filters(copy.pid())?);
    if theirs.len() < mine.len() || theirs[..mine.len()] != mine[..] {
        return Err(refuse(
            copy,
            format!(
                "its seccomp filters ({} of {:?} instructions) are not its parent's ({:?}) with more added, and a filter cannot be taken away",
                theirs.len(),
                theirs.iter().map(|f| f.len() / 8).collect::<Vec<_>>(),
                mine.iter().map(|f| f.len() / 8).collect::<Vec<_>>()
            ),
        ));
    }
    for f in &theirs[mine.len()..] {
        install_filter(copy, f, !threads.is_empty())?;
    }
    Ok(())
}

/// Injects `seccomp(SECCOMP_SET_MODE_FILTER)` of program `prog` into `t`
/// (which has `no_new_privs`, as every sandbox process).
fn install_filter(t: &mut Tracee, prog: &[u8], all_threads: bool) -> Result<(), ProcError> {
    const SECCOMP_SET_MODE_FILTER: u64 = 1;
    /// `SECCOMP_FILTER_FLAG_TSYNC`: on every thread of the process.
    const TSYNC: u64 = 1;
    // Room of its own for the program (up to 32 KiB): below the stack
    // pointer is not always mapped that far.
    let len = (prog.len() as u64 + 16 + 4095) & !4095;
    let at = t.map_anonymous("mmap(seccomp filter)", len)?;
    let done = (|| {
        t.poke_at(at + 16, prog)?;
        // struct sock_fprog { unsigned short len; struct sock_filter *filter; }
        let mut fprog = Vec::with_capacity(16);
        fprog.extend_from_slice(&((prog.len() / 8) as u64).to_le_bytes());
        fprog.extend_from_slice(&(at + 16).to_le_bytes());
        t.poke_at(at, &fprog)?;
        t.syscall(
            "seccomp(SECCOMP_SET_MODE_FILTER)",
            libc::SYS_seccomp,
            [
                SECCOMP_SET_MODE_FILTER,
                if all_threads { TSYNC } else { 0 },
                at,
                0,
                0,
                0,
            ],
        )
    })();
    t.syscall("munmap", libc::SYS_munmap, [at, len, 0, 0, 0, 0])?;
    done.map(|_| ())
}

/// The ID that `outer` (as this process's user namespace sees it) is in
/// the namespace whose map (`uid_map` text, read from here) is `map`.
fn inner_id(outer: u32, map: &str) -> Option<u32> {
    map.lines().find_map(|l| {
        let f: Vec<u64> = l
            .split_whitespace()
            .map(|x| x.parse().ok())
            .collect::<Option<_>>()?;
        let [inner, start, count] = f[..] else {
            return None;
        };
        let o = u64::from(outer);
        (o >= start && o < start + count).then(|| (inner + o - start) as u32)
    })
}

/// Injected into `t`: drops every capability not in `keep` from its
/// bounding, permitted, effective and inheritable sets (ambient ones go
/// with the inheritable) and sets `no_new_privs`. For a copy just made in a
/// user namespace of its own, before it is finished.
pub fn cut_capabilities(t: &mut Tracee, keep: u64) -> Result<(), ProcError> {
    for cap in 0..=u64::from(crate::inspect::last_cap()) {
        if keep & (1 << cap) == 0 {
            t.syscall(
                "prctl(PR_CAPBSET_DROP)",
                libc::SYS_prctl,
                [PR_CAPBSET_DROP, cap, 0, 0, 0, 0],
            )?;
        }
    }
    capset(t, keep, keep, 0)?;
    no_new_privs(t)
}

/// Injected `prctl(PR_SET_NO_NEW_PRIVS, 1)`.
fn no_new_privs(t: &mut Tracee) -> Result<(), ProcError> {
    t.syscall(
        "prctl(PR_SET_NO_NEW_PRIVS)",
        libc::SYS_prctl,
        [PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0, 0],
    )?;
    Ok(())
}

/// The securebits of `t` (injected `prctl(PR_GET_SECUREBITS)`).
pub fn securebits(t: &mut Tracee) -> Result<u64, ProcError> {
    t.syscall(
        "prctl(PR_GET_SECUREBITS)",
        libc::SYS_prctl,
        [PR_GET_SECUREBITS, 0, 0, 0, 0, 0],
    )
}

/// Injected `capset` of `t`'s own sets.
fn capset(
    t: &mut Tracee,
    effective: u64,
    permitted: u64,
    inheritable: u64,
) -> Result<(), ProcError> {
    // struct __user_cap_header_struct { u32 version; i32 pid } and two
    // struct __user_cap_data_struct { u32 effective, permitted, inheritable }.
    let mut block = Vec::with_capacity(32);
    block.extend_from_slice(&LINUX_CAPABILITY_VERSION_3.to_le_bytes());
    block.extend_from_slice(&0i32.to_le_bytes());
    for shift in [0, 32] {
        for set in [effective, permitted, inheritable] {
            block.extend_from_slice(&((set >> shift) as u32).to_le_bytes());
        }
    }
    let at = t.scratch(0, &block)?;
    t.syscall("capset", libc::SYS_capset, [at, at + 8, 0, 0, 0, 0])?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_are_read_from_a_status_file() {
        let status = "Name:\tpython3\nUid:\t1000\t1001\t1002\t1000\nGid:\t100\t100\t100\t100\n\
            Groups:\t100 1001 \nNoNewPrivs:\t1\nCapInh:\t0000000000000000\n\
            CapPrm:\t0000000000000400\nCapEff:\t0000000000000400\n\
            CapBnd:\t00000100a80425fb\nCapAmb:\t0000000000000000\n";
        let c = Credentials::parse(status).unwrap();
        assert_eq!(c.uids, [1000, 1001, 1002]);
        assert_eq!(c.gids, [100, 100, 100]);
        assert_eq!(c.groups, vec![100, 1001]);
        assert_eq!(c.permitted, 0x400);
        assert_eq!(c.bounding, 0x100a80425fb);
        assert!(c.no_new_privs);
        let none = "Uid:\t0\t0\t0\t0\nGid:\t0\t0\t0\t0\nGroups:\t\nCapInh:\t0\nCapPrm:\t0\n\
            CapEff:\t0\nCapBnd:\t0\nCapAmb:\t0\n";
        assert_eq!(Credentials::parse(none).unwrap().groups, Vec::<u32>::new());
        assert!(Credentials::parse("Uid:\tx\n").is_none());
    }

    #[test]
    fn host_ids_map_back_into_the_namespace() {
        let map = "         0 1073741824      65536\n";
        assert_eq!(inner_id(1073741824 + 1000, map), Some(1000));
        assert_eq!(inner_id(1073741824, map), Some(0));
        assert_eq!(inner_id(5, map), None);
        assert_eq!(inner_id(7, "0 0 4294967295\n"), Some(7));
    }
}
