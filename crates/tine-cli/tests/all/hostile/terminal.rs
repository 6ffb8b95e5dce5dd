//! The caller's terminal: no sandbox process ever holds it. Without `-t` a
//! command's descriptors 0-2 are pipes tine relays (or /dev/null) and it
//! runs in a session of its own, so it can neither push input into the
//! caller's shell (`TIOCSTI`) nor open it as `/dev/tty`, not even from a
//! process it leaves running; with `-t` it gets a terminal of its own, on
//! which the seccomp filter refuses `TIOCSTI` too. A daemon started from a
//! terminal lends it to no command either.

use std::path::Path;
use std::process::Command;

use serde_json::json;

use crate::common::{Env, skipped_without_root};
use crate::serve::Server;

/// Tries `TIOCSTI` on descriptors 0-2 and on `/dev/tty` (pushing `#`, which
/// the terminal would echo), and says what it holds.
const PROBE: &str = r#"
import errno, fcntl, os, termios
res = []
for fd in (0, 1, 2):
    try:
        fcntl.ioctl(fd, termios.TIOCSTI, b'#'); res.append(f'sti{fd}:ok')
    except OSError as e:
        res.append(f'sti{fd}:{errno.errorcode[e.errno]}')
try:
    t = os.open('/dev/tty', os.O_RDWR)
    try:
        fcntl.ioctl(t, termios.TIOCSTI, b'#'); res.append('tty:sti')
    except OSError as e:
        res.append('tty:open:' + errno.errorcode[e.errno])
except OSError as e:
    res.append('tty:' + errno.errorcode[e.errno])
res.append('isatty:' + ''.join(str(int(os.isatty(f))) for f in (0, 1, 2)))
# TIOCSTI with a bit set above the 32 the kernel reads (CVE-2019-10063: a
# filter comparing all 64 let it through).
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
c = ctypes.c_char(b'#')
r = libc.syscall(16, 1, ctypes.c_ulong(termios.TIOCSTI | (1 << 32)), ctypes.byref(c))
res.append('stihigh:' + ('ok' if r == 0 else errno.errorcode[ctypes.get_errno()]))
print(' '.join(res), flush=True)
"#;

/// Runs `argv` as the leader of a session whose controlling terminal is a
/// new pseudo-terminal (as a user's shell runs `tine`), keeps reading the
/// terminal for `linger` seconds after it ended (what a process it left
/// behind writes or pushes), and returns all the terminal showed.
fn on_a_terminal(argv: &[&str], linger: f64) -> String {
    const HARNESS: &str = r#"
import os, pty, select, sys, time
linger = float(sys.argv[1])
pid, fd = pty.fork()
if pid == 0:
    os.execvp(sys.argv[2], sys.argv[2:])
out, ended = b'', None
while True:
    if ended is None:
        p, _ = os.waitpid(pid, os.WNOHANG)
        if p:
            ended = time.time()
    if ended is not None and time.time() > ended + linger:
        break
    r, _, _ = select.select([fd], [], [], 0.1)
    if r:
        try:
            d = os.read(fd, 4096)
        except OSError:
            d = b''
        if not d:
            # Nobody holds the terminal now; wait out the rest.
            time.sleep(max(0.0, (ended or time.time()) + linger - time.time()))
            if ended is not None:
                break
        out += d
sys.stdout.write(out.decode(errors='replace'))
"#;
    let o = Command::new("python3")
        .args(["-c", HARNESS, &linger.to_string()])
        .args(argv)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).replace('\r', "")
}

#[test]
fn no_command_holds_or_types_into_the_callers_terminal() {
    if skipped_without_root() {
        return;
    }
    let env = Env::in_dir(Path::new("/var/tmp"));
    let repo = env.work().join(".tine");
    let repo = repo.to_str().unwrap();
    let bin = env!("CARGO_BIN_EXE_tine").to_string();
    env.ok(&["run", "--name", "f", "--", "sleep", "100000"]);
    // Without the filter, only the terminal's absence protects.
    env.ok(&[
        "run",
        "--name",
        "open",
        "--no-seccomp",
        "--",
        "sleep",
        "100000",
    ]);
    for sb in ["f", "open"] {
        for flags in [&[][..], &["-i"][..]] {
            let mut argv = vec![bin.as_str(), "--repo", repo, "exec"];
            argv.extend_from_slice(flags);
            argv.extend_from_slice(&[sb, "--", "python3", "-c", PROBE]);
            let shown = on_a_terminal(&argv, 0.0);
            assert!(
                !shown.contains('#'),
                "{sb} {flags:?}: input was pushed into the caller's terminal: {shown:?}"
            );
            assert!(shown.contains("tty:ENXIO"), "{sb} {flags:?}: {shown:?}");
            assert!(shown.contains("isatty:000"), "{sb} {flags:?}: {shown:?}");
            assert!(!shown.contains(":ok"), "{sb} {flags:?}: {shown:?}");
        }
    }
    // A process the command leaves running, once `exec` returned, has
    // nothing of the terminal either (it would read what the user types).
    let late = "(sleep 0.5; python3 -c \"$1\" > /tmp/late 2>&1) & echo started";
    let argv = [
        bin.as_str(),
        "--repo",
        repo,
        "exec",
        "open",
        "--",
        "sh",
        "-c",
        late,
        "sh",
        PROBE,
    ];
    let shown = on_a_terminal(&argv, 2.0);
    assert!(shown.contains("started"), "{shown:?}");
    assert!(!shown.contains('#'), "{shown:?}");
    let late = env.ok(&["exec", "open", "--", "cat", "/tmp/late"]);
    assert!(
        late.contains("tty:ENXIO") && !late.contains(":ok"),
        "{late}"
    );
    // With -t: a terminal of its own, and the filter refuses TIOCSTI on it.
    let argv = [
        bin.as_str(),
        "--repo",
        repo,
        "exec",
        "-t",
        "f",
        "--",
        "python3",
        "-c",
        PROBE,
    ];
    let shown = on_a_terminal(&argv, 0.0);
    assert!(
        shown.contains("sti1:EPERM") && shown.contains("tty:open:EPERM"),
        "{shown:?}"
    );
    assert!(shown.contains("isatty:111"), "{shown:?}");
    assert!(shown.contains("stihigh:EPERM"), "{shown:?}");
    assert!(!shown.contains('#'), "{shown:?}");
    // Ctrl-C's SIGINT to `tine exec` still reaches the command (passed on
    // to its process group, which the terminal no longer reaches).
    let mut c = env.cmd(&[
        "exec",
        "f",
        "--",
        "sh",
        "-c",
        "trap 'echo got-int; exit 7' INT; echo up; while :; do sleep 0.1; done",
    ]);
    let mut child = c.stdout(std::process::Stdio::piped()).spawn().unwrap();
    let mut out = child.stdout.take().unwrap();
    let mut first = [0u8; 3];
    std::io::Read::read_exact(&mut out, &mut first).unwrap();
    assert_eq!(&first, b"up\n");
    rustix::process::kill_process(
        rustix::process::Pid::from_child(&child),
        rustix::process::Signal::INT,
    )
    .unwrap();
    let status = child.wait().unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
    assert_eq!(rest, "got-int\n");
    assert_eq!(status.code(), Some(7));
    env.ok(&["rm", "-f", "f", "open"]);
}

#[test]
fn a_daemon_started_from_a_terminal_lends_it_to_no_command() {
    if skipped_without_root() {
        return;
    }
    let env = Env::in_dir(Path::new("/var/tmp"));
    // `tine serve` as the leader of a session with a terminal: stdin is it
    // (the master side kept open in it, or the terminal hangs up).
    const WRAP: &str = "import fcntl, os, pty, sys, termios\n\
        m, s = pty.openpty()\nos.setsid()\nfcntl.ioctl(s, termios.TIOCSCTTY, 0)\n\
        os.dup2(s, 0)\nos.set_inheritable(m, True)\nos.execvp(sys.argv[1], sys.argv[1:])\n";
    let mut c = Command::new("python3");
    c.args(["-c", WRAP, env!("CARGO_BIN_EXE_tine")])
        .args(["--json", "serve", "--listen", "127.0.0.1:0"])
        .current_dir(env.work())
        .env_remove("TINE_REPO");
    let srv = Server::spawn(&env, c);
    srv.expect(
        201,
        "POST",
        "/v1/sandboxes",
        Some(json!({"name": "d", "seccomp": false})),
    );
    let out = srv.expect(
        200,
        "POST",
        "/v1/sandboxes/d/exec",
        Some(json!({"command": ["python3", "-c", PROBE]})),
    );
    let said = out["stdout"].as_str().unwrap();
    assert!(said.contains("tty:ENXIO"), "{out}");
    assert!(
        said.contains("isatty:000") && !said.contains(":ok"),
        "{out}"
    );
    srv.expect(200, "DELETE", "/v1/sandboxes/d?force=true", None);
}

#[test]
fn exec_on_pipes_neither_stalls_nor_loses_what_a_command_writes() {
    if skipped_without_root() {
        return;
    }
    let env = Env::in_dir(Path::new("/var/tmp"));
    env.ok(&["run", "--name", "p", "--", "sleep", "100000"]);
    // A command that writes 1 MiB before it reads its 1 MiB of input: the
    // relay must not block on either pipe.
    let mut c = env.cmd(&[
        "exec",
        "-i",
        "p",
        "--",
        "sh",
        "-c",
        "head -c 1048576 /dev/zero | tr '\\0' o; wc -c",
    ]);
    let mut child = c
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    let feeder = std::thread::spawn(move || {
        std::io::Write::write_all(&mut input, &vec![b'i'; 1 << 20]).unwrap();
    });
    let out = child.wait_with_output().unwrap();
    feeder.join().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.matches('o').count(), 1 << 20);
    assert!(
        text.ends_with("1048576\n"),
        "{:?}",
        &text[text.len().saturating_sub(40)..]
    );
    // A command that closes its output and runs on still gets Ctrl-C.
    let mut c = env.cmd(&[
        "exec",
        "p",
        "--",
        "sh",
        "-c",
        "trap 'touch /tmp/int; exit 3' INT; exec >&- 2>&-; while :; do sleep 0.1; done",
    ]);
    let mut child = c.spawn().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(500));
    rustix::process::kill_process(
        rustix::process::Pid::from_child(&child),
        rustix::process::Signal::INT,
    )
    .unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(3));
    env.ok(&["exec", "p", "--", "test", "-e", "/tmp/int"]);
    env.ok(&["rm", "-f", "p"]);
}
