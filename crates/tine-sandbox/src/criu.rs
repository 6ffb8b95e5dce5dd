//! Process state that outlives templates: a template dumped with CRIU into
//! the repository (`REPO/sandboxes/ID/criu/SNAPHEX-NSPID/`), and brought back
//! from there as a parked template again when the live one is gone (evicted
//! from the pool, or the machine restarted).
//!
//! CRIU runs inside the sandbox: `nsenter` into all of its init's namespaces
//! and its root, started from a child that first joined the sandbox's
//! cgroups, so that the restored process lands in the sandbox's cgroup and
//! CRIU dumps no namespace of its own. The images directory and the
//! descriptors CRIU cannot reach are handed over as open descriptors.
#![allow(unsafe_code)]

use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde::{Deserialize, Serialize};
use tine_proc::ProcError;
use tine_proc::criu::{External, dump_args, externals, restore_args};

/// A CRIU binary (4.1 or later: earlier ones do not run on kernels >= 6.13).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Criu {
    pub bin: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum CriuError {
    #[error(
        "CRIU at {}: {reason}; install it with scripts/install-criu.sh, or point TINE_CRIU at a CRIU 4.1 (or later) binary",
        bin.display()
    )]
    Unavailable { bin: PathBuf, reason: String },
    #[error("criu {step} of process {ns_pid} failed ({status}): {tail} (log: {})", log.display())]
    Failed {
        step: &'static str,
        ns_pid: u32,
        status: String,
        tail: String,
        log: PathBuf,
    },
    #[error("CRIU restored process {ns_pid}, but it is not in the sandbox's cgroup")]
    Lost { ns_pid: u32 },
    #[error(
        "process {ns_pid} runs under the sandbox's seccomp filter, which CRIU cannot dump from inside the sandbox's user namespace; start the sandbox with --no-seccomp (a workspace's sandbox has it off) to persist its processes"
    )]
    Filtered { ns_pid: u32 },
    #[error("{step} {}: {source}", path.display())]
    Io {
        step: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Proc(#[from] ProcError),
}

tine_store::from_io_at!(CriuError, fn io);

/// The persisted images of one template.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Image {
    /// Directory name under `REPO/sandboxes/ID/criu/`.
    pub dir: String,
    /// The template's PID in the sandbox, which CRIU gives it back.
    pub ns_pid: u32,
    pub externals: Vec<External>,
    pub bytes: u64,
}

/// Descriptor numbers CRIU gets its inputs under (above what it opens itself).
const IMAGES_FD: i32 = 200;
const FIRST_INHERITED_FD: i32 = 201;

impl Criu {
    /// Runs `criu check`: whether this kernel gives CRIU what it needs.
    pub fn check(&self) -> Result<(), CriuError> {
        let out = Command::new(&self.bin)
            .arg("check")
            .stdin(Stdio::null())
            .output()
            .map_err(|e| CriuError::Unavailable {
                bin: self.bin.clone(),
                reason: e.to_string(),
            })?;
        if out.status.success() {
            return Ok(());
        }
        let text = String::from_utf8_lossy(&out.stderr);
        Err(CriuError::Unavailable {
            bin: self.bin.clone(),
            reason: format!("`criu check` failed: {}", last_lines(&text)),
        })
    }
}

/// The last few lines of a CRIU log that say what went wrong (its
/// "Error" lines, without the harmless ones this machine always prints).
fn last_lines(text: &str) -> String {
    let errors: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("Error") && !l.contains("RLIMIT_NOFILE") && !l.contains("tun:"))
        .collect();
    let pick = if errors.is_empty() {
        text.lines().rev().take(3).collect::<Vec<_>>()
    } else {
        errors.into_iter().rev().take(3).collect()
    };
    pick.into_iter()
        .rev()
        .map(str::trim)
        .collect::<Vec<_>>()
        .join("; ")
}

/// What a CRIU run is, for its error: the step, the process, its log.
struct Run<'a> {
    step: &'static str,
    ns_pid: u32,
    log: &'a Path,
}

/// Runs CRIU inside the sandbox whose init is `init_pid`, with `fds` as
/// descriptors (each at its number).
fn run_inside(
    criu: &Criu,
    init_pid: u32,
    cgroup_procs: &[PathBuf],
    args: &[String],
    fds: &[(i32, OwnedFd)],
    run: Run<'_>,
) -> Result<(), CriuError> {
    let procs: Vec<File> = cgroup_procs
        .iter()
        .map(|p| File::options().write(true).open(p).map_err(io("open", p)))
        .collect::<Result<_, _>>()?;
    let procs_raw: Vec<i32> = procs.iter().map(|f| f.as_raw_fd()).collect();
    let moves: Vec<(i32, i32)> = fds.iter().map(|(n, f)| (f.as_raw_fd(), *n)).collect();
    let above = moves.iter().map(|(_, d)| *d).max().unwrap_or(0) + 1;
    // Filled in the child (allocated here: nothing may allocate there).
    let mut tmps = vec![0i32; moves.len()];
    // In the sandbox's user namespace CRIU is root there only: it must not
    // try what needs the host's privileges (forcing socket buffer sizes).
    let own = |ns: &str| !crate::ns::shares_namespace(init_pid, ns);
    let own_user = own("user");
    // Every namespace the sandbox has of its own; one it shares with the
    // host (`--net host`) is joined already, and from inside its user
    // namespace could not be joined again.
    let joins = [
        ("user", "-U"),
        ("mnt", "-m"),
        ("uts", "-u"),
        ("ipc", "-i"),
        ("net", "-n"),
        ("pid", "-p"),
        ("cgroup", "-C"),
    ]
    .into_iter()
    .filter(|(ns, _)| own(ns))
    .map(|(_, flag)| flag);
    let mut cmd = Command::new("nsenter");
    cmd.arg("-t")
        .arg(init_pid.to_string())
        .args(joins)
        .args(["-r", "-w", "--"])
        .arg(&criu.bin)
        .args(own_user.then_some("--unprivileged"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    // SAFETY: runs in the forked child before exec, calling only
    // async-signal-safe functions (write, dup2, fcntl) on descriptors opened
    // before the fork, and writing into a vector allocated before it.
    unsafe {
        cmd.pre_exec(move || {
            for fd in &procs_raw {
                if libc::write(*fd, b"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            // First above every target (a source may sit where another
            // goes: other threads' descriptors are copied into this child
            // too), then each to its place (dup2 clears close-on-exec).
            for (i, (src, _)) in moves.iter().enumerate() {
                tmps[i] = libc::fcntl(*src, libc::F_DUPFD_CLOEXEC, above);
                if tmps[i] < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            for (i, (_, dst)) in moves.iter().enumerate() {
                if libc::dup2(tmps[i], *dst) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().map_err(io("start", Path::new("nsenter")))?;
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    let status = child.wait().map_err(io("wait for", &criu.bin))?;
    drop(procs);
    if status.success() {
        return Ok(());
    }
    let text = std::fs::read_to_string(run.log).unwrap_or_default();
    Err(CriuError::Failed {
        step: run.step,
        ns_pid: run.ns_pid,
        status: format!("{status}; {}", last_lines(&err)),
        tail: last_lines(&text),
        log: run.log.to_path_buf(),
    })
}

fn fsync_dir_tree(dir: &Path) -> Result<u64, CriuError> {
    let mut bytes = 0;
    for e in std::fs::read_dir(dir).map_err(io("list", dir))? {
        let p = e.map_err(io("list", dir))?.path();
        let f = File::open(&p).map_err(io("open", &p))?;
        bytes += f.metadata().map_err(io("stat", &p))?.len();
        f.sync_all().map_err(io("fsync", &p))?;
    }
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io("fsync", dir))?;
    Ok(bytes)
}

/// Dumps the parked template `template_pid` of the sandbox into `dest` (a new
/// directory, written under a temporary name and renamed when complete).
/// The template stays parked. `origin`: the PID in the sandbox and command
/// line of the process it was made from, for messages.
pub fn dump(
    criu: &Criu,
    init_pid: u32,
    cgroup_procs: &[PathBuf],
    template_pid: u32,
    origin: (u32, &str),
    dest: &Path,
) -> Result<Image, CriuError> {
    let ns_pid = tine_proc::template::ns_pid(template_pid)
        .ok_or(ProcError::TemplateGone { pid: template_pid })?;
    // CRIU must suspend a filter to dump a process (PTRACE_O_SUSPEND_SECCOMP,
    // the host's CAP_SYS_ADMIN), and it runs in the user namespace.
    if crate::seccomp::filtered(template_pid) {
        // Named by its origin's PID: the template's own means nothing to
        // the user.
        return Err(CriuError::Filtered { ns_pid: origin.0 });
    }
    let ext = externals(template_pid, origin.0, origin.1)?;
    let tmp = dest.with_extension("tmp");
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(io("create", &tmp))?;
    give_to_sandbox(&tmp, init_pid)?;
    let dir: OwnedFd = File::open(&tmp).map_err(io("open", &tmp))?.into();
    let args = dump_args(ns_pid, &format!("/proc/self/fd/{IMAGES_FD}"), &ext);
    let log = tmp.join("dump.log");
    let run = Run {
        step: "dump",
        ns_pid,
        log: &log,
    };
    if let Err(e) = run_inside(
        criu,
        init_pid,
        cgroup_procs,
        &args,
        &[(IMAGES_FD, dir)],
        run,
    ) {
        return Err(drop_partial_images(e, &tmp, dest));
    }
    let bytes = fsync_dir_tree(&tmp)?;
    if dest.exists() {
        std::fs::remove_dir_all(dest).map_err(io("replace", dest))?;
    }
    std::fs::rename(&tmp, dest).map_err(io("rename into place", dest))?;
    if let Some(parent) = dest.parent() {
        File::open(parent)
            .and_then(|d| d.sync_all())
            .map_err(io("fsync", parent))?;
    }
    let name = dest
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    Ok(Image {
        dir: name,
        ns_pid,
        externals: ext,
        bytes,
    })
}

/// After a failed dump: the partial images go, and only CRIU's log stays,
/// beside where the images would have been (`DEST.log`), for the error to
/// point at.
fn drop_partial_images(mut e: CriuError, tmp: &Path, dest: &Path) -> CriuError {
    if let CriuError::Failed { log, .. } = &mut e {
        let kept = dest.with_extension("log");
        if std::fs::rename(&*log, &kept).is_ok() {
            *log = kept;
        }
    }
    let _ = std::fs::remove_dir_all(tmp);
    e
}

/// Makes the images directory `dir` (not what is in it) the sandbox's root's
/// — the owner of its init, `init_pid` — as CRIU runs as that root, in the
/// sandbox's user namespace, and writes its images and log there.
fn give_to_sandbox(dir: &Path, init_pid: u32) -> Result<(), CriuError> {
    let (uid, gid) = crate::ns::owner_of_process(init_pid)
        .map_err(io("stat", Path::new(&format!("/proc/{init_pid}"))))?;
    std::os::unix::fs::lchown(dir, Some(uid), Some(gid))
        .map_err(io("give to the sandbox's root", dir))
}

/// Brings a dumped template back into the sandbox, parked at its old PID, and
/// returns its host PID. `find` looks the restored process up by its PID in
/// the sandbox (among the sandbox cgroup's processes).
pub fn restore(
    criu: &Criu,
    init_pid: u32,
    cgroup_procs: &[PathBuf],
    image: &Image,
    dir: &Path,
    find: impl Fn(u32) -> Option<u32>,
) -> Result<u32, CriuError> {
    give_to_sandbox(dir, init_pid)?;
    let images: OwnedFd = File::open(dir).map_err(io("open", dir))?.into();
    let mut fds = vec![(IMAGES_FD, images)];
    let mut inherited = Vec::new();
    for (i, e) in image.externals.iter().enumerate() {
        let acc = e.flags as i32 & libc::O_ACCMODE;
        let f = File::options()
            .read(acc == libc::O_RDONLY || acc == libc::O_RDWR)
            .write(acc == libc::O_WRONLY || acc == libc::O_RDWR)
            .append(e.flags as i32 & libc::O_APPEND != 0)
            .open(&e.path)
            .map_err(io(
                "open again (a descriptor of the persisted process)",
                &e.path,
            ))?;
        let n = FIRST_INHERITED_FD + i as i32;
        fds.push((n, f.into()));
        inherited.push((n, e.key.as_str()));
    }
    let args = restore_args(&format!("/proc/self/fd/{IMAGES_FD}"), &inherited);
    let log = dir.join("restore.log");
    let run = Run {
        step: "restore",
        ns_pid: image.ns_pid,
        log: &log,
    };
    run_inside(criu, init_pid, cgroup_procs, &args, &fds, run)?;
    find(image.ns_pid).ok_or(CriuError::Lost {
        ns_pid: image.ns_pid,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_tail_names_the_real_errors() {
        let log = "(00.1) Error (criu/tun.c:85): tun: Unable to create tun\n\
                   (00.2) Error (criu/util.c:1533): rlimit: Can't setup RLIMIT_NOFILE for self\n\
                   (00.3) Error (criu/files-reg.c:1790): Can't lookup mount=27 for fd=1\n\
                   (00.4) Error (criu/cr-dump.c:2111): Dumping FAILED.\n";
        let t = last_lines(log);
        assert!(t.contains("Can't lookup mount=27"), "{t}");
        assert!(t.contains("Dumping FAILED"), "{t}");
        assert!(!t.contains("RLIMIT"), "{t}");
    }
}
