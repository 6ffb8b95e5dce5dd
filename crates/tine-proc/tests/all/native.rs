//! Native fork against real processes: templates, rollback with the same
//! PID, descriptors set back, and forks that diverge.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use tine_proc::ptrace::Tracee;
use tine_proc::template::{FdFix, Respawn, Template, fixes_for, make_template, respawn};

/// A Python program holding `mib` MiB and a counter. Each line it reads
/// ("tick" or "add N") changes both; it answers with "counter checksum pid".
const HOLDER: &str = r#"
import os, sys, zlib
size = int(sys.argv[1]) << 20
buf = bytearray(size)
for i in range(0, size, 4096):
    buf[i] = i // 4096 % 251
counter = 0
for line in sys.stdin:
    word = line.split()
    if word[0] == "add":
        counter += int(word[1])
    else:
        counter += 1
    buf[(counter * 4096) % size] = (counter * 37 + 11) % 256
    print(counter, zlib.crc32(buf), os.getpid(), flush=True)
"#;

pub struct Holder {
    pub child: Child,
    pub stdin: ChildStdin,
    pub stdout: BufReader<ChildStdout>,
}

impl Holder {
    pub fn start(mib: u32) -> Holder {
        let mut child = Command::new("setsid")
            .args(["python3", "-c", HOLDER, &mib.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let mut h = Holder {
            child,
            stdin,
            stdout,
        };
        // The first answer means the memory is filled and it reads its input.
        h.ask("add 0");
        h
    }

    /// Sends one line and returns (counter, checksum, pid).
    pub fn ask(&mut self, line: &str) -> (u64, u32, u32) {
        writeln!(self.stdin, "{line}").unwrap();
        let mut answer = String::new();
        self.stdout.read_line(&mut answer).unwrap();
        let f: Vec<u64> = answer
            .split_whitespace()
            .map(|w| w.parse().unwrap())
            .collect();
        assert_eq!(f.len(), 3, "answer {answer:?}");
        (f[0], f[1] as u32, f[2] as u32)
    }
}

/// True (and says so) when not root: `set_tid` needs it (and ptrace of
/// processes of other users).
fn skipped_without_root() -> bool {
    tine_testkit::skipped_without_root("a native fork test")
}

/// Kills `child` (reaped here) and makes a copy of `tpl` under its PID with
/// `fds` fixed; returns that PID.
fn roll_back(child: &mut Child, tpl: &Template, fds: Vec<FdFix>) -> u32 {
    let pid = child.id();
    child.kill().unwrap();
    child.wait().unwrap();
    let new = respawn(
        tpl,
        &Respawn {
            set_tid: Some(pid),
            parent: true,
            fds,
            chdir: None,
            maps: vec![],
            remake: vec![],
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(new, pid, "the copy has the origin's PID");
    new
}

/// Kills and reaps the processes it names when dropped, also when a test
/// fails half-way (a stopped template would otherwise hold the test's pipes).
struct Reaper(Vec<u32>);

impl Drop for Reaper {
    fn drop(&mut self) {
        for pid in &self.0 {
            reap(*pid);
        }
    }
}

fn reap(pid: u32) {
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    );
    let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid as i32), None);
}

/// A FIFO at `dir/name`, held open for writing here: the reader's open
/// never waits, and we write into it.
fn fifo(dir: &std::path::Path, name: &str) -> std::fs::File {
    use std::os::unix::fs::OpenOptionsExt;
    let p = dir.join(name);
    nix::unistd::mkfifo(&p, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    std::fs::File::options()
        .read(true)
        .write(true)
        .custom_flags(nix::libc::O_NONBLOCK)
        .open(&p)
        .unwrap()
}

/// The answers ("counter checksum pid") in the file `p`, once there are `n`
/// of them (or 20 s passed).
fn read_answers(p: &std::path::Path, n: usize) -> Vec<Vec<u64>> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let text = std::fs::read_to_string(p).unwrap_or_default();
        // Whole lines only: one being written may be read in part.
        let whole = &text[..text.rfind('\n').map_or(0, |i| i + 1)];
        let lines: Vec<Vec<u64>> = whole
            .lines()
            .map(|l| l.split_whitespace().map(|w| w.parse().unwrap()).collect())
            .collect();
        if lines.len() >= n || std::time::Instant::now() > deadline {
            return lines;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// Descriptors 0 and 1 of a copy of `tpl` opened again on `input` and `output`.
fn own_io(tpl: &Template, input: &std::path::Path, output: &std::path::Path) -> Vec<FdFix> {
    let flags = |fd: i32| tpl.fds.iter().find(|e| e.fd == fd).unwrap().flags;
    [(0, input), (1, output)]
        .into_iter()
        .map(|(fd, path)| FdFix::Reopen {
            fd,
            path: path.to_path_buf(),
            flags: flags(fd),
            pos: 0,
        })
        .collect()
}

#[test]
fn rollback_continues_from_the_checkpoint_with_the_same_pid_and_memory() {
    if skipped_without_root() {
        return;
    }
    let mut h = Holder::start(64);
    let pid = h.child.id();
    let (k, sum_k, _) = h.ask("tick");
    let mut t = Tracee::seize(pid).unwrap();
    let tpl = make_template(&mut t).unwrap();
    t.resume().unwrap();
    let _reaper = Reaper(vec![tpl.pid]);
    // It runs on.
    for _ in 0..5 {
        h.ask("tick");
    }
    let (k5, _, _) = h.ask("tick");
    assert_eq!(k5, k + 6);
    // Roll back: the live process goes, a copy of the template takes its PID.
    let new = roll_back(&mut h.child, &tpl, fixes_for(&tpl.fds, None));
    let (k1, _, p1) = h.ask("tick");
    assert_eq!((k1, p1), (k + 1, pid), "continues from the checkpoint");
    // Memory as at the checkpoint: roll back again and compare the checksum.
    reap(new);
    let again = respawn(
        &tpl,
        &Respawn {
            set_tid: Some(pid),
            parent: true,
            fds: vec![],
            chdir: None,
            maps: vec![],
            remake: vec![],
            ..Default::default()
        },
    )
    .unwrap();
    let (k0, sum0, _) = h.ask("add 0");
    assert_eq!((k0, sum0), (k, sum_k), "memory as at the checkpoint");
    reap(again);
}

/// Collects what a terminal's master side prints, from a thread.
struct Screen {
    master: std::fs::File,
    text: std::sync::Arc<std::sync::Mutex<String>>,
}

impl Screen {
    fn new(master: std::os::fd::OwnedFd) -> Screen {
        let master = std::fs::File::from(master);
        let text = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let (mut r, t) = (master.try_clone().unwrap(), text.clone());
        std::thread::spawn(move || {
            use std::io::Read;
            let mut buf = [0u8; 4096];
            while let Ok(n) = r.read(&mut buf) {
                if n == 0 {
                    break;
                }
                t.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        Screen { master, text }
    }

    /// Types `line`, and waits until `expect` appears in what follows.
    fn type_and_wait(&mut self, line: &str, expect: &str) -> String {
        let start = self.text.lock().unwrap().len();
        writeln!(self.master, "{line}").unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let seen = self.text.lock().unwrap()[start..].to_string();
            if seen.contains(expect) {
                return seen;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "waiting for {expect:?} after {line:?}; the terminal shows {seen:?}"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
}

#[test]
fn an_interactive_bash_on_a_terminal_rolls_back_between_commands() {
    if skipped_without_root() {
        return;
    }
    let pty = nix::pty::openpty(None, None).unwrap();
    let slave = std::fs::File::from(pty.slave);
    let mut bash = Command::new("setsid")
        .args(["--ctty", "bash", "--norc", "--noprofile", "-i"])
        .env_clear()
        .env("PS1", "$ ")
        .env("TERM", "dumb")
        .env("PATH", "/usr/bin:/bin")
        .stdin(slave.try_clone().unwrap())
        .stdout(slave.try_clone().unwrap())
        .stderr(slave)
        .spawn()
        .unwrap();
    let pid = bash.id();
    let mut screen = Screen::new(pty.master);
    // Arithmetic in the commands: the terminal echoes what is typed, so only
    // bash's own output contains the results.
    screen.type_and_wait(
        "x=42; f() { echo fn-$1; }; cd /tmp; history -s marker-$((1+1)); echo $((40+2))-set",
        "42-set",
    );
    // Between commands: bash waits for the next line.
    std::thread::sleep(std::time::Duration::from_millis(200));
    let mut t = Tracee::seize(pid).unwrap();
    let tpl = make_template(&mut t).unwrap();
    t.resume().unwrap();
    let mut reaper = Reaper(vec![tpl.pid]);
    assert!(tpl.has_tty && tpl.foreground, "{tpl:?}");

    screen.type_and_wait("x=99; unset -f f; cd /; echo $((1+1))-changed", "2-changed");
    let new = roll_back(&mut bash, &tpl, fixes_for(&tpl.fds, None));
    reaper.0.push(new);
    let after = screen.type_and_wait(
        "echo \"$x $(f a) $PWD $((6*7))-after\"; history | tail -n 4",
        // The result, not the echo of what was typed (which holds "-after" too).
        "42-after",
    );
    assert!(after.contains("42 fn-a /tmp 42-after"), "{after:?}");
    let after = screen.type_and_wait("history | tail -n 5; echo $((2+3))-hist", "5-hist");
    assert!(after.contains("marker-2"), "history survives: {after:?}");
    assert!(
        !after.contains("unset -f f"),
        "history is the checkpoint's: {after:?}"
    );
    // The terminal keeps working, with job control: a foreground child.
    let job = screen.type_and_wait("sleep 0.1; tty; echo $((3*3))-job", "9-job");
    assert!(
        !job.contains("Inappropriate")
            && !job.contains("no job control")
            && job.contains("/dev/pts/"),
        "{job:?}"
    );
}

#[test]
fn eight_forks_of_one_template_continue_independently() {
    if skipped_without_root() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut input = fifo(dir.path(), "in0");
    let out0 = dir.path().join("out0");
    // Killed and reaped by the Reaper below.
    #[allow(clippy::zombie_processes)]
    let origin = Command::new("setsid")
        .args(["python3", "-c", HOLDER, "16"])
        .stdin(std::fs::File::open(dir.path().join("in0")).unwrap())
        .stdout(std::fs::File::create(&out0).unwrap())
        .spawn()
        .unwrap();
    writeln!(input, "add 0").unwrap();
    writeln!(input, "add 10").unwrap();
    let base = read_answers(&out0, 2)[1].clone();
    assert_eq!(base[0], 10);
    std::thread::sleep(std::time::Duration::from_millis(100));
    let mut t = Tracee::seize(origin.id()).unwrap();
    let tpl = make_template(&mut t).unwrap();
    t.resume().unwrap();
    let mut reaper = Reaper(vec![tpl.pid, origin.id()]);
    let mut forks = Vec::new();
    for k in 1..=8u64 {
        let mut w = fifo(dir.path(), &format!("in{k}"));
        let out = dir.path().join(format!("out{k}"));
        std::fs::write(&out, "").unwrap();
        let pid = respawn(
            &tpl,
            &Respawn {
                set_tid: None,
                parent: true,
                fds: own_io(&tpl, &dir.path().join(format!("in{k}")), &out),
                chdir: None,
                maps: vec![],
                remake: vec![],
                ..Default::default()
            },
        )
        .unwrap();
        reaper.0.push(pid);
        writeln!(w, "add {k}").unwrap();
        forks.push((k, pid, w, out));
    }
    // The origin goes on by itself meanwhile.
    writeln!(input, "add 100").unwrap();
    let mut sums = std::collections::HashSet::new();
    for (k, pid, w, out) in &mut forks {
        let a = read_answers(out, 1);
        assert_eq!(a.len(), 1, "fork {k} answered once, in its own file: {a:?}");
        assert_eq!(
            a[0][0],
            10 + *k,
            "fork {k} continued from the template's counter"
        );
        assert_eq!(a[0][2], *pid as u64);
        sums.insert(a[0][1]);
        // And keeps its own state.
        writeln!(w, "add 0").unwrap();
        assert_eq!(read_answers(out, 2)[1][0], 10 + *k);
    }
    assert_eq!(sums.len(), 8, "each fork's memory diverged on its own");
    let origin_lines = read_answers(&out0, 3);
    assert_eq!(
        origin_lines.len(),
        3,
        "no fork wrote to the origin's output"
    );
    assert_eq!(origin_lines[2][0], 110);
}

/// Capabilities a nested copy keeps in these tests: CHOWN (0), KILL (5) and
/// CHECKPOINT_RESTORE (40).
const KEEP: u64 = 1 | 1 << 5 | 1 << 40;

/// A nested copy as the tests make it: PID 2, only [`KEEP`], no network.
const NEST: tine_proc::template::Nest = tine_proc::template::Nest {
    pid: 2,
    keep_caps: KEEP,
    new_net: true,
};

#[test]
fn a_copy_in_namespaces_of_its_own_is_pid_2_there_and_continues_from_the_checkpoint() {
    if skipped_without_root() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut h = Holder::start(16);
    let (k, _, _) = h.ask("add 7");
    let mut t = Tracee::seize(h.child.id()).unwrap();
    let tpl = make_template(&mut t).unwrap();
    t.resume().unwrap();
    let mut reaper = Reaper(vec![tpl.pid]);
    // The origin runs on.
    assert_eq!(h.ask("tick").0, k + 1);

    let nested = tine_proc::template::clone_nested(&tpl, &NEST, None).unwrap();
    let (init, mut process) = nested.into_parts();
    let ns_pids = |pid: u32| tine_proc::inspect::ns_pids(pid).unwrap();
    assert_eq!(
        ns_pids(init.pid()).last(),
        Some(&1),
        "PID 1 of a new namespace"
    );
    assert_eq!(ns_pids(process.pid()).last(), Some(&2), "PID 2 there");
    assert_eq!(
        ns_pids(process.pid()).len(),
        2,
        "one level below the test's"
    );
    let map = std::fs::read_to_string(format!("/proc/{}/uid_map", process.pid())).unwrap();
    assert_eq!(
        map.split_whitespace().collect::<Vec<_>>(),
        ["0", "0", "4294967295"]
    );
    reaper.0.push(init.pid());
    let field = |pid: u32, name: &str| -> String {
        std::fs::read_to_string(format!("/proc/{pid}/status"))
            .unwrap()
            .lines()
            .find_map(|l| Some(l.strip_prefix(name)?.trim().to_string()))
            .unwrap()
    };
    let kept = format!("{KEEP:016x}");
    for set in ["CapEff:", "CapPrm:", "CapBnd:"] {
        assert_eq!(field(process.pid(), set), kept, "the process's {set}");
    }
    assert_eq!(field(process.pid(), "CapInh:"), format!("{:016x}", 0));
    assert_eq!(field(process.pid(), "NoNewPrivs:"), "1");
    let all = (1u64 << (tine_proc::inspect::last_cap() + 1)) - 1;
    assert_eq!(
        field(init.pid(), "CapEff:"),
        format!("{all:016x}"),
        "the init holds every capability of its user namespace"
    );

    let mut input = fifo(dir.path(), "in");
    let out = dir.path().join("out");
    std::fs::write(&out, "").unwrap();
    let how = Respawn {
        set_tid: None,
        parent: false,
        fds: own_io(&tpl, &dir.path().join("in"), &out),
        chdir: None,
        maps: vec![],
        remake: vec![],
        ..Default::default()
    };
    tine_proc::template::finish_copy(&mut process, &tpl, &how).unwrap();
    process.resume().unwrap();
    // The init stays parked (a caller makes it the namespaces' init).
    init.park().unwrap();
    writeln!(input, "tick").unwrap();
    let answers = read_answers(&out, 1);
    assert!(!answers.is_empty(), "no answer from the copy");
    let f = &answers[0];
    assert_eq!(
        (f[0], f[2]),
        (k + 1, 2),
        "from the checkpoint, as PID 2: {f:?}"
    );
    // The origin was not touched by it.
    assert_eq!(h.ask("tick").0, k + 2);
}

#[test]
fn the_init_of_a_nested_copy_can_become_another_program() {
    if skipped_without_root() {
        return;
    }
    let mut h = Holder::start(8);
    h.ask("tick");
    let mut t = Tracee::seize(h.child.id()).unwrap();
    let tpl = make_template(&mut t).unwrap();
    t.resume().unwrap();
    let mut reaper = Reaper(vec![tpl.pid]);
    let (init, process) = tine_proc::template::clone_nested(&tpl, &NEST, None)
        .unwrap()
        .into_parts();
    let z = init.pid();
    reaper.0.push(z);
    process.kill();
    init.execve(b"/bin/sleep", &[b"sleep", b"77"], &[b"PATH=/bin"])
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let cmdline = std::fs::read(format!("/proc/{z}/cmdline")).unwrap_or_default();
        if cmdline == b"sleep\x0077\x00" {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{cmdline:?}");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let status = std::fs::read_to_string(format!("/proc/{z}/status")).unwrap();
    assert!(
        status
            .lines()
            .any(|l| l.starts_with("NSpid:") && l.ends_with("\t1")),
        "still PID 1 of its namespace: {status}"
    );
    // The origin runs on untouched.
    assert_eq!(h.ask("tick").0, 2);
}
