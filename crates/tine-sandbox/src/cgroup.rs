//! Control groups: one per sandbox, for its memory and pids limits, for freezing
//! it while a snapshot or rollback runs, and for knowing (and killing) every
//! process in it. Works on cgroup v2 (most hosts) and on v1 hierarchies (this
//! project's CI machine); the version is detected at run time.
//!
//! Layout: v2 `ROOT/tine/NAME`; v1 `ROOT/{memory,pids,freezer}/tine/NAME`, and
//! `ROOT/devices/tine/NAME` where the host has the v1 devices hierarchy: there
//! the group may use only the usual character devices (see [`ALLOWED_DEVICES`]).
//! Everything is plain file I/O under a root directory that the caller passes,
//! so the logic runs in tests against a fake tree.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Serialize;
use tine_store::{ErrorKind, HasKind};

/// The usual mount point of the cgroup filesystems.
pub const DEFAULT_ROOT: &str = "/sys/fs/cgroup";
/// Parent group of every sandbox's group.
pub const PARENT: &str = "tine";
/// v1 hierarchies a sandbox needs, in the order [`Cgroup`] keeps their directories.
const V1_CONTROLLERS: [&str; 3] = ["freezer", "memory", "pids"];
/// The v1 hierarchy that limits device access: used where the host has it,
/// its directory kept after [`V1_CONTROLLERS`]'.
const V1_DEVICES: &str = "devices";

/// The devices a sandbox's processes may create and open (as the v1
/// `devices.allow` lines; everything else is denied): the nodes of a
/// sandbox's `/dev` and its own pseudo-terminals — what Docker allows
/// by default, less `mknod` of anything else.
pub const ALLOWED_DEVICES: [&str; 9] = [
    "c 1:3 rwm",   // null
    "c 1:5 rwm",   // zero
    "c 1:7 rwm",   // full
    "c 1:8 rwm",   // random
    "c 1:9 rwm",   // urandom
    "c 5:0 rwm",   // tty
    "c 5:1 rwm",   // console
    "c 5:2 rwm",   // ptmx
    "c 136:* rwm", // pts/N
];

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CgroupVersion {
    V1,
    V2,
}

impl std::fmt::Display for CgroupVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CgroupVersion::V1 => "v1",
            CgroupVersion::V2 => "v2",
        })
    }
}

/// Resource limits of one sandbox (`None`: unlimited).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Limits {
    pub memory_bytes: Option<u64>,
    pub pids: Option<u64>,
    /// What its upper layer may hold, where the repository's filesystem
    /// keeps project quotas (`quota`). Records from before: none.
    #[serde(default)]
    pub disk_bytes: Option<u64>,
}

/// Processes a sandbox may have when none is given: room for thread pools
/// and build tools, not for a fork bomb.
pub const DEFAULT_PIDS: u64 = 4096;

/// What a sandbox's upper layer may hold when no limit is given.
pub const DEFAULT_DISK_BYTES: u64 = 10 << 30;

impl Limits {
    /// These limits with each one not given set to its default: memory, half
    /// of the host's (`host_memory`, bytes; none when unknown),
    /// [`DEFAULT_PIDS`] processes and [`DEFAULT_DISK_BYTES`] of upper layer.
    /// A sandbox is never unlimited by omission.
    pub fn or_defaults(self, host_memory: Option<u64>) -> Limits {
        Limits {
            memory_bytes: self.memory_bytes.or(host_memory.map(|m| m / 2)),
            pids: self.pids.or(Some(DEFAULT_PIDS)),
            disk_bytes: self.disk_bytes.or(Some(DEFAULT_DISK_BYTES)),
        }
    }
}

/// The host's memory in bytes (`MemTotal` of `/proc/meminfo`).
pub fn host_memory() -> Option<u64> {
    let text = fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("no usable cgroup hierarchy at {}: {why}", root.display())]
    Unsupported { root: PathBuf, why: String },
    #[error(
        "cgroup name {name:?} is not valid: use 1-64 letters, digits, '-', '_' or '.', not starting with '.'"
    )]
    InvalidName { name: String },
    #[error("cgroup {}: {step}: {source}", path.display())]
    Io {
        step: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("cgroup {} did not freeze within {timeout:?} (state: {state})", path.display())]
    FreezeTimeout {
        path: PathBuf,
        timeout: Duration,
        state: String,
    },
    #[error("cgroup {} still holds processes {pids:?} after {timeout:?}", path.display())]
    StillBusy {
        path: PathBuf,
        pids: Vec<u32>,
        timeout: Duration,
    },
}

impl HasKind for CgroupError {
    fn kind(&self) -> ErrorKind {
        match self {
            CgroupError::Unsupported { .. } => ErrorKind::Unsupported,
            CgroupError::InvalidName { .. } => ErrorKind::InvalidInput,
            CgroupError::Io { source, .. } if source.kind() == io::ErrorKind::NotFound => {
                ErrorKind::NotFound
            }
            CgroupError::Io { .. } | CgroupError::FreezeTimeout { .. } => ErrorKind::Io,
            CgroupError::StillBusy { .. } => ErrorKind::Io,
        }
    }
}

tine_store::from_io_at!(CgroupError, fn io_err);

fn write_file(path: &Path, value: &str, step: &'static str) -> Result<(), CgroupError> {
    fs::write(path, value).map_err(io_err(step, path))
}

fn read_file(path: &Path, step: &'static str) -> Result<String, CgroupError> {
    fs::read_to_string(path).map_err(io_err(step, path))
}

fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// The cgroup filesystems of this host.
#[derive(Debug, Clone)]
pub struct CgroupRoot {
    root: PathBuf,
    version: CgroupVersion,
}

impl CgroupRoot {
    /// Finds out which cgroup version `root` offers. A pure v2 mount with the
    /// memory and pids controllers is v2; separate memory, pids and freezer
    /// hierarchies are v1 (a hybrid host's near-empty `unified` mount is ignored).
    pub fn detect(root: &Path) -> Result<CgroupRoot, CgroupError> {
        let unsupported = |why: String| CgroupError::Unsupported {
            root: root.to_path_buf(),
            why,
        };
        if let Ok(controllers) = fs::read_to_string(root.join("cgroup.controllers")) {
            let have: Vec<&str> = controllers.split_whitespace().collect();
            let missing: Vec<&str> = ["memory", "pids"]
                .into_iter()
                .filter(|c| !have.contains(c))
                .collect();
            if !missing.is_empty() {
                return Err(unsupported(format!(
                    "cgroup v2 without the {} controller(s)",
                    missing.join(" and ")
                )));
            }
            return Ok(CgroupRoot {
                root: root.to_path_buf(),
                version: CgroupVersion::V2,
            });
        }
        let missing: Vec<&str> = V1_CONTROLLERS
            .into_iter()
            .filter(|c| !root.join(c).join("cgroup.procs").is_file())
            .collect();
        if missing.is_empty() {
            return Ok(CgroupRoot {
                root: root.to_path_buf(),
                version: CgroupVersion::V1,
            });
        }
        Err(unsupported(format!(
            "neither cgroup v2 (no cgroup.controllers) nor the cgroup v1 hierarchies {}",
            missing.join(", ")
        )))
    }

    pub fn version(&self) -> CgroupVersion {
        self.version
    }

    pub fn path(&self) -> &Path {
        &self.root
    }

    fn dirs(&self, name: &str) -> Result<Vec<PathBuf>, CgroupError> {
        if !valid_name(name) {
            return Err(CgroupError::InvalidName { name: name.into() });
        }
        Ok(match self.version {
            CgroupVersion::V2 => vec![self.root.join(PARENT).join(name)],
            CgroupVersion::V1 => {
                let mut dirs: Vec<PathBuf> = V1_CONTROLLERS
                    .iter()
                    .map(|c| self.root.join(c).join(PARENT).join(name))
                    .collect();
                if self.root.join(V1_DEVICES).join("cgroup.procs").is_file() {
                    dirs.push(self.root.join(V1_DEVICES).join(PARENT).join(name));
                }
                dirs
            }
        })
    }

    /// Creates the group `name` (or takes over an existing one) with `limits`.
    pub fn create(&self, name: &str, limits: &Limits) -> Result<Cgroup, CgroupError> {
        let dirs = self.dirs(name)?;
        if self.version == CgroupVersion::V2 {
            // Controllers must be enabled on every level above the group.
            let parent = self.root.join(PARENT);
            fs::create_dir_all(&parent).map_err(io_err("create parent group", &parent))?;
            for dir in [&self.root, &parent] {
                let p = dir.join("cgroup.subtree_control");
                let enabled = fs::read_to_string(&p).unwrap_or_default();
                if !(enabled.contains("memory") && enabled.contains("pids")) {
                    write_file(&p, "+memory +pids", "enable memory and pids controllers")?;
                }
            }
        }
        for d in &dirs {
            fs::create_dir_all(d).map_err(io_err("create group", d))?;
        }
        let cg = Cgroup {
            version: self.version,
            dirs,
        };
        cg.set_limits(limits)?;
        cg.limit_devices()?;
        Ok(cg)
    }

    /// The group `name`, which must exist.
    pub fn open(&self, name: &str) -> Result<Cgroup, CgroupError> {
        let mut dirs = self.dirs(name)?;
        // A group made before devices were limited has no devices directory.
        if dirs.len() > V1_CONTROLLERS.len() && !dirs[V1_CONTROLLERS.len()].is_dir() {
            dirs.truncate(V1_CONTROLLERS.len());
        }
        for d in &dirs {
            fs::metadata(d).map_err(io_err("open group", d))?;
        }
        Ok(Cgroup {
            version: self.version,
            dirs,
        })
    }
}

/// One sandbox's control group.
#[derive(Debug, Clone)]
pub struct Cgroup {
    version: CgroupVersion,
    /// v2: the group; v1: its directory in each of [`V1_CONTROLLERS`].
    dirs: Vec<PathBuf>,
}

impl Cgroup {
    pub fn version(&self) -> CgroupVersion {
        self.version
    }

    /// The group's directories (one on v2, one per hierarchy on v1).
    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }

    fn file(&self, controller: &str, name: &str) -> PathBuf {
        let i = match (self.version, controller) {
            (CgroupVersion::V2, _) => 0,
            (CgroupVersion::V1, c) => V1_CONTROLLERS.iter().position(|x| *x == c).unwrap_or(0),
        };
        self.dirs[i].join(name)
    }

    fn set_limits(&self, limits: &Limits) -> Result<(), CgroupError> {
        let (mem_file, pids_file) = match self.version {
            CgroupVersion::V2 => ("memory.max", "pids.max"),
            CgroupVersion::V1 => ("memory.limit_in_bytes", "pids.max"),
        };
        let mem = match (self.version, limits.memory_bytes) {
            (_, Some(n)) => n.to_string(),
            (CgroupVersion::V2, None) => "max".into(),
            (CgroupVersion::V1, None) => "-1".into(),
        };
        write_file(&self.file("memory", mem_file), &mem, "set the memory limit")?;
        if self.version == CgroupVersion::V2 && limits.memory_bytes.is_some() {
            // Without this the kernel swaps instead of stopping a runaway process.
            let swap = self.file("memory", "memory.swap.max");
            if swap.exists() {
                write_file(&swap, "0", "disable swap")?;
            }
        }
        let pids = limits.pids.map_or("max".into(), |n| n.to_string());
        write_file(&self.file("pids", pids_file), &pids, "set the pids limit")
    }

    /// v1 with the devices hierarchy: deny every device, then allow
    /// [`ALLOWED_DEVICES`]; v2: the same as an eBPF program attached to the
    /// group (`devices_bpf`). Everywhere, too, the sandbox's mounts are
    /// `nodev` except for the nodes bound into its `/dev`.
    fn limit_devices(&self) -> Result<(), CgroupError> {
        if self.version == CgroupVersion::V2 {
            return limit_devices_v2(&self.dirs[0]);
        }
        let Some(dir) = self.dirs.get(V1_CONTROLLERS.len()) else {
            return Ok(());
        };
        write_file(&dir.join("devices.deny"), "a", "deny every device")?;
        for rule in ALLOWED_DEVICES {
            write_file(&dir.join("devices.allow"), rule, "allow a device")?;
        }
        Ok(())
    }

    /// The `cgroup.procs` files a process writes itself into to join (one per hierarchy).
    pub fn procs_files(&self) -> Vec<PathBuf> {
        self.dirs.iter().map(|d| d.join("cgroup.procs")).collect()
    }

    /// Moves process `pid` (and, on v2, the threads with it) into the group.
    pub fn add_process(&self, pid: u32) -> Result<(), CgroupError> {
        for p in self.procs_files() {
            write_file(&p, &pid.to_string(), "move a process into the group")?;
        }
        Ok(())
    }

    /// The processes in the group.
    pub fn processes(&self) -> Result<Vec<u32>, CgroupError> {
        let p = self.file("freezer", "cgroup.procs");
        Ok(read_file(&p, "list processes")?
            .split_whitespace()
            .filter_map(|s| s.parse().ok())
            .collect())
    }

    /// Stops every process in the group and waits until the kernel says they are.
    pub fn freeze(&self, timeout: Duration) -> Result<(), CgroupError> {
        match self.version {
            CgroupVersion::V2 => {
                write_file(&self.file("", "cgroup.freeze"), "1", "freeze")?;
            }
            CgroupVersion::V1 => {
                write_file(&self.file("freezer", "freezer.state"), "FROZEN", "freeze")?;
            }
        }
        let t0 = Instant::now();
        let mut pause = Duration::from_micros(20);
        loop {
            if self.is_frozen()? {
                return Ok(());
            }
            if t0.elapsed() > timeout {
                let state = self.state_text().unwrap_or_default();
                // Leave it running rather than half frozen.
                let _ = self.thaw();
                return Err(CgroupError::FreezeTimeout {
                    path: self.dirs[0].clone(),
                    timeout,
                    state,
                });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
            if self.version == CgroupVersion::V1 {
                // The v1 freezer visits the group's tasks once: a child forked
                // meanwhile escapes and the group stays FREEZING until asked again.
                write_file(&self.file("freezer", "freezer.state"), "FROZEN", "freeze")?;
            }
        }
    }

    /// Lets the group's processes run again.
    pub fn thaw(&self) -> Result<(), CgroupError> {
        match self.version {
            CgroupVersion::V2 => write_file(&self.file("", "cgroup.freeze"), "0", "thaw"),
            CgroupVersion::V1 => {
                write_file(&self.file("freezer", "freezer.state"), "THAWED", "thaw")
            }
        }
    }

    fn state_text(&self) -> Result<String, CgroupError> {
        match self.version {
            CgroupVersion::V2 => read_file(&self.file("", "cgroup.events"), "read freeze state"),
            CgroupVersion::V1 => {
                read_file(&self.file("freezer", "freezer.state"), "read freeze state")
            }
        }
    }

    /// Whether the kernel reports the whole group frozen.
    pub fn is_frozen(&self) -> Result<bool, CgroupError> {
        let text = self.state_text()?;
        Ok(match self.version {
            CgroupVersion::V2 => text.lines().any(|l| l.trim() == "frozen 1"),
            CgroupVersion::V1 => text.trim() == "FROZEN",
        })
    }

    /// How many processes the kernel's OOM killer has killed in this group.
    pub fn oom_kills(&self) -> Result<u64, CgroupError> {
        let (file, key) = match self.version {
            CgroupVersion::V2 => ("memory.events", "oom_kill"),
            CgroupVersion::V1 => ("memory.oom_control", "oom_kill"),
        };
        let text = read_file(&self.file("memory", file), "read OOM events")?;
        Ok(text
            .lines()
            .filter_map(|l| l.split_once(' '))
            .find(|(k, _)| *k == key)
            .and_then(|(_, v)| v.trim().parse().ok())
            .unwrap_or(0))
    }

    /// Memory the group uses now, in bytes.
    pub fn memory_current(&self) -> Result<u64, CgroupError> {
        let file = match self.version {
            CgroupVersion::V2 => "memory.current",
            CgroupVersion::V1 => "memory.usage_in_bytes",
        };
        Ok(read_file(&self.file("memory", file), "read memory usage")?
            .trim()
            .parse()
            .unwrap_or(0))
    }

    /// Removes the group. It must be empty (see [`Cgroup::processes`]).
    pub fn remove(&self) -> Result<(), CgroupError> {
        for d in &self.dirs {
            match fs::remove_dir(d) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_err("remove group", d)(e)),
            }
        }
        Ok(())
    }

    /// Waits (at most `timeout`) until the group's processes are gone, then
    /// removes it.
    pub fn remove_when_empty(&self, timeout: Duration) -> Result<(), CgroupError> {
        let deadline = Instant::now() + timeout;
        while self.processes().is_ok_and(|p| !p.is_empty()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        self.remove()
    }
}

/// Attaches the program that allows [`ALLOWED_DEVICES`] only to the v2
/// group `dir`. A directory that is not on a cgroup2 filesystem (a test's
/// fake tree) has nothing to attach to.
pub fn limit_devices_v2(dir: &Path) -> Result<(), CgroupError> {
    const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;
    let on_cgroup2 = rustix::fs::statfs(dir)
        .map_err(|e| io_err("statfs", dir)(e.into()))?
        .f_type
        == CGROUP2_SUPER_MAGIC;
    if !on_cgroup2 {
        return Ok(());
    }
    let rules: Vec<_> = ALLOWED_DEVICES
        .iter()
        .filter_map(|l| crate::devices_bpf::parse(l))
        .collect();
    crate::devices_bpf::attach(dir, &rules)
        .map_err(io_err("attach the devices program (bpf) to", dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake cgroup v1 tree: the hierarchies and their root files.
    fn fake_v1(root: &Path) {
        for c in V1_CONTROLLERS {
            fs::create_dir_all(root.join(c)).unwrap();
            fs::write(root.join(c).join("cgroup.procs"), "1\n").unwrap();
        }
    }

    #[test]
    fn detects_v1_v2_and_explains_what_is_missing() {
        let tmp = tempfile::tempdir().unwrap();
        let e = CgroupRoot::detect(tmp.path()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported);
        assert!(e.to_string().contains("freezer, memory, pids"), "{e}");
        fake_v1(tmp.path());
        assert_eq!(
            CgroupRoot::detect(tmp.path()).unwrap().version(),
            CgroupVersion::V1
        );
        let v2 = tempfile::tempdir().unwrap();
        fs::write(v2.path().join("cgroup.controllers"), "cpu io memory\n").unwrap();
        let e = CgroupRoot::detect(v2.path()).unwrap_err();
        assert!(e.to_string().contains("pids controller"), "{e}");
        fs::write(v2.path().join("cgroup.controllers"), "cpu memory pids\n").unwrap();
        assert_eq!(
            CgroupRoot::detect(v2.path()).unwrap().version(),
            CgroupVersion::V2
        );
    }

    #[test]
    fn v1_group_limits_membership_freeze_and_oom() {
        let tmp = tempfile::tempdir().unwrap();
        fake_v1(tmp.path());
        let root = CgroupRoot::detect(tmp.path()).unwrap();
        assert!(root.create("../escape", &Limits::default()).is_err());
        let cg = root
            .create(
                "sb1",
                &Limits {
                    memory_bytes: Some(1 << 30),
                    pids: Some(64),
                    disk_bytes: None,
                },
            )
            .unwrap();
        let read = |rel: &str| fs::read_to_string(tmp.path().join(rel)).unwrap();
        assert_eq!(read("memory/tine/sb1/memory.limit_in_bytes"), "1073741824");
        assert_eq!(read("pids/tine/sb1/pids.max"), "64");
        cg.add_process(42).unwrap();
        for c in V1_CONTROLLERS {
            assert_eq!(read(&format!("{c}/tine/sb1/cgroup.procs")), "42");
        }
        assert_eq!(cg.processes().unwrap(), vec![42]);
        // The fake kernel reports what was written, so freezing completes at once.
        cg.freeze(Duration::from_millis(50)).unwrap();
        assert_eq!(read("freezer/tine/sb1/freezer.state"), "FROZEN");
        cg.thaw().unwrap();
        assert_eq!(read("freezer/tine/sb1/freezer.state"), "THAWED");
        fs::write(
            tmp.path().join("memory/tine/sb1/memory.oom_control"),
            "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n",
        )
        .unwrap();
        assert_eq!(cg.oom_kills().unwrap(), 3);
        assert_eq!(root.open("sb1").unwrap().dirs(), cg.dirs());
        assert_eq!(root.open("nope").unwrap_err().kind(), ErrorKind::NotFound);
    }

    #[test]
    fn v1_devices_are_denied_but_the_usual_nodes_where_the_hierarchy_exists() {
        let tmp = tempfile::tempdir().unwrap();
        fake_v1(tmp.path());
        let root = CgroupRoot::detect(tmp.path()).unwrap();
        // A group made while the host had no devices hierarchy still opens.
        let old = root.create("old", &Limits::default()).unwrap();
        fs::create_dir_all(tmp.path().join("devices")).unwrap();
        fs::write(tmp.path().join("devices/cgroup.procs"), "1\n").unwrap();
        assert_eq!(root.open("old").unwrap().dirs(), old.dirs());
        let cg = root.create("sb2", &Limits::default()).unwrap();
        let dir = tmp.path().join("devices/tine/sb2");
        assert_eq!(cg.dirs().last().unwrap(), &dir);
        assert_eq!(fs::read_to_string(dir.join("devices.deny")).unwrap(), "a");
        // The fake keeps the last line written: the rules end with the terminals.
        assert_eq!(
            fs::read_to_string(dir.join("devices.allow")).unwrap(),
            *ALLOWED_DEVICES.last().unwrap()
        );
        cg.add_process(7).unwrap();
        assert_eq!(fs::read_to_string(dir.join("cgroup.procs")).unwrap(), "7");
        assert_eq!(root.open("sb2").unwrap().dirs(), cg.dirs());
    }

    #[test]
    fn v2_group_enables_controllers_and_waits_for_the_frozen_event() {
        let tmp = tempfile::tempdir().unwrap();
        fs::write(tmp.path().join("cgroup.controllers"), "memory pids\n").unwrap();
        let root = CgroupRoot::detect(tmp.path()).unwrap();
        let cg = root
            .create(
                "sb2",
                &Limits {
                    memory_bytes: None,
                    pids: Some(10),
                    disk_bytes: None,
                },
            )
            .unwrap();
        let read = |rel: &str| fs::read_to_string(tmp.path().join(rel)).unwrap();
        assert_eq!(read("cgroup.subtree_control"), "+memory +pids");
        assert_eq!(read("tine/cgroup.subtree_control"), "+memory +pids");
        assert_eq!(read("tine/sb2/memory.max"), "max");
        assert_eq!(read("tine/sb2/pids.max"), "10");
        // A kernel that never reports "frozen 1": the freeze times out and thaws.
        fs::write(
            tmp.path().join("tine/sb2/cgroup.events"),
            "populated 1\nfrozen 0\n",
        )
        .unwrap();
        let e = cg.freeze(Duration::from_millis(5)).unwrap_err();
        assert!(matches!(e, CgroupError::FreezeTimeout { .. }), "{e}");
        assert_eq!(read("tine/sb2/cgroup.freeze"), "0");
        fs::write(
            tmp.path().join("tine/sb2/cgroup.events"),
            "populated 1\nfrozen 1\n",
        )
        .unwrap();
        cg.freeze(Duration::from_millis(5)).unwrap();
        assert_eq!(read("tine/sb2/cgroup.freeze"), "1");
        fs::write(
            tmp.path().join("tine/sb2/memory.events"),
            "low 0\nhigh 0\nmax 2\noom 1\noom_kill 1\n",
        )
        .unwrap();
        assert_eq!(cg.oom_kills().unwrap(), 1);
    }
}
