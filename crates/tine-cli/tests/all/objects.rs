//! Kernel objects, shared memory and file locks in native forks and
//! rollbacks, as root: what a copy would share with its origin is made anew
//! in it, from what was recorded at the checkpoint.

use crate::common::{Env, skipped_without_root};
use std::time::{Duration, Instant};

use crate::native::{next_line_text, signal, workspace_of};

/// Waits until /workspace/log of sandbox `sb` has `n` lines.
fn wait_for_log_lines(env: &Env, sb: &str, n: usize) {
    let log = workspace_of(env, sb).join("log");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.lines().count() >= n {
            return;
        }
        assert!(Instant::now() < deadline, "{sb}: {text:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A program (Python, through ctypes) holding a timerfd (an hour, every
/// hour), a signalfd reading SIGHUP, an inotify instance watching
/// /workspace/watched (as watch 2: watch 1 was removed) and an eventfd
/// holding 5, all in one epoll. It prints what each delivers; SIGUSR1
/// prints "timer INTERVAL LEFT_OVER_3000S eventfd COUNT".
const OBJECTS: &str = r#"
import ctypes, os, select, signal, struct
libc = ctypes.CDLL(None, use_errno=True)
tfd = libc.timerfd_create(1, os.O_CLOEXEC)
assert libc.timerfd_settime(tfd, 0, struct.pack('qqqq', 3600, 0, 3600, 0), None) == 0
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGHUP])
sfd = libc.signalfd(-1, struct.pack('Q', 1 << (signal.SIGHUP - 1)), os.O_CLOEXEC)
os.makedirs('/workspace/watched', exist_ok=True)
ifd = libc.inotify_init1(os.O_CLOEXEC | os.O_NONBLOCK)
w1 = libc.inotify_add_watch(ifd, b'/workspace', 0x100)
w2 = libc.inotify_add_watch(ifd, b'/workspace/watched', 0x100)
libc.inotify_rm_watch(ifd, w1)
try:
    os.read(ifd, 4096)
except BlockingIOError:
    pass
efd = os.eventfd(5)
ep = select.epoll()
ep.register(sfd, select.EPOLLIN)
ep.register(ifd, select.EPOLLIN)
def report(*_):
    cur = ctypes.create_string_buffer(32)
    libc.timerfd_gettime(tfd, cur)
    interval, _, left, _ = struct.unpack('qqqq', cur.raw)
    print('timer', interval, left > 3000, 'eventfd', os.eventfd_read(efd), flush=True)
    os.eventfd_write(efd, 5)
signal.signal(signal.SIGUSR1, report)
print('ready', w2, flush=True)
while True:
    for fd, _ in ep.poll():
        if fd == sfd:
            print('signal', struct.unpack_from('I', os.read(sfd, 128))[0], flush=True)
        else:
            b = os.read(ifd, 4096)
            wd, mask, _, n = struct.unpack_from('iIII', b)
            print('created', b[16:16 + n].rstrip(b'\0').decode(), 'watch', wd, flush=True)
"#;

/// Native forks of a program holding a timerfd, a signalfd, an inotify
/// instance (with a gap in its watch numbers), an eventfd and an epoll over
/// them each get their own: the timer still has about an hour left, a
/// SIGHUP sent to a fork is read from its signalfd, a file made in a fork's
/// workspace is reported by its own watch, and none of it reaches the
/// origin or the other fork. A rollback keeps them working.
#[test]
fn timerfd_signalfd_inotify_and_eventfd_are_made_anew_in_native_forks() {
    if skipped_without_root() {
        return;
    }
    let env = Env::new();
    env.ok(&["run", "--name", "ob", "--", "python3", "-c", OBJECTS]);
    let mut seen = 0;
    assert_eq!(next_line_text(&env, "ob", &mut seen), "ready 2");
    let s = env.json(&["snapshot", "--sandbox", "ob", "--tag", "k"]);
    assert_eq!(s["processes"], 1, "natively: {s}");
    let f = env.json(&["fork", "k", "-n", "2", "--name", "of"]);
    assert_eq!(f["via"], "native", "{f}");
    let mut seen_kid = [0usize; 2];
    for (i, kid) in ["of-1", "of-2"].iter().enumerate() {
        let seen = &mut seen_kid[i];
        signal(&env, kid, "-USR1", 2);
        assert_eq!(next_line_text(&env, kid, seen), "timer 3600 True eventfd 5");
        signal(&env, kid, "-HUP", 2);
        assert_eq!(next_line_text(&env, kid, seen), "signal 1");
        let name = format!("made-in-{kid}");
        env.ok(&[
            "exec",
            kid,
            "--",
            "touch",
            &format!("/workspace/watched/{name}"),
        ]);
        assert_eq!(
            next_line_text(&env, kid, seen),
            format!("created {name} watch 2")
        );
    }
    // The origin saw none of it, and still works.
    assert_eq!(env.ok(&["logs", "ob"]), "ready 2\n");
    env.ok(&["exec", "ob", "--", "touch", "/workspace/watched/o"]);
    assert_eq!(next_line_text(&env, "ob", &mut seen), "created o watch 2");
    // Each fork saw only its own file.
    for kid in ["of-1", "of-2"] {
        let logs = env.ok(&["logs", kid]);
        assert_eq!(logs.matches("created").count(), 1, "{kid}: {logs}");
    }
    let r = env.json(&["restore", "k"]);
    assert_eq!(r["processes"], 1, "{r}");
    let mut seen = env.ok(&["logs", "ob"]).lines().count();
    signal(&env, "ob", "-HUP", 2);
    assert_eq!(next_line_text(&env, "ob", &mut seen), "signal 1");
    env.ok(&["rm", "-f", "of-1", "of-2", "ob"]);
}

/// A program holding a `flock` on /workspace/a.lock and an OFD lock on
/// bytes 0..9 of /workspace/b.db; SIGUSR2 closes both (which releases them).
const LOCKS: &str = r#"
import fcntl, os, signal, struct
# Blocked from the start (threads inherit it) and taken with sigwaitinfo:
# pause() misses a signal that lands just before it.
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
a = open('/workspace/a.lock', 'w')
fcntl.flock(a, fcntl.LOCK_EX)
b = open('/workspace/b.db', 'w')
fcntl.fcntl(b, 37, struct.pack('hhqqi4x', fcntl.F_WRLCK, 0, 0, 10, 0))
def release(*_):
    a.close()
    b.close()
    print('released', flush=True)
handlers = {signal.SIGUSR2: release}
print('locked', flush=True)
while True:
    handlers[signal.sigwaitinfo(handlers).si_signo]()
"#;

/// Prints whether the `flock` and the OFD lock of [`LOCKS`] could be taken.
const PROBE: &str = r#"
import fcntl, struct
out = []
try:
    fcntl.flock(open('/workspace/a.lock', 'r'), fcntl.LOCK_EX | fcntl.LOCK_NB)
    out.append('free')
except OSError:
    out.append('held')
try:
    fcntl.fcntl(open('/workspace/b.db', 'r+'), 37, struct.pack('hhqqi4x', fcntl.F_WRLCK, 0, 0, 10, 0))
    out.append('free')
except OSError:
    out.append('held')
print(*out)
"#;

/// `flock` and OFD locks belong to an open file description, which a
/// template would share with its origin: the origin's locks are released
/// when it closes them after a checkpoint (the parked template does not
/// keep them), and they are held again by a rolled-back copy and by each
/// native fork, each through a description of its own (a fork releasing
/// them releases only its own).
#[test]
fn flocks_and_ofd_locks_go_with_the_process_through_checkpoints_rollbacks_and_forks() {
    if skipped_without_root() {
        return;
    }
    let env = Env::new();
    env.ok(&["run", "--name", "fl", "--", "python3", "-c", LOCKS]);
    let mut seen = 0;
    assert_eq!(next_line_text(&env, "fl", &mut seen), "locked");
    let probe = |sb: &str| env.ok(&["exec", sb, "--", "python3", "-c", PROBE]);
    assert_eq!(probe("fl"), "held held\n");
    let s = env.json(&["snapshot", "--sandbox", "fl", "--tag", "k"]);
    assert_eq!(s["processes"], 1, "natively: {s}");
    assert_eq!(probe("fl"), "held held\n");
    signal(&env, "fl", "-USR2", 2);
    assert_eq!(next_line_text(&env, "fl", &mut seen), "released");
    assert_eq!(probe("fl"), "free free\n", "the template keeps none");
    let r = env.json(&["restore", "k"]);
    assert_eq!(r["processes"], 1, "{r}");
    assert_eq!(probe("fl"), "held held\n", "held again by the copy");
    let f = env.json(&["fork", "k", "-n", "2", "--name", "fk"]);
    assert_eq!(f["via"], "native", "{f}");
    for kid in ["fk-1", "fk-2"] {
        assert_eq!(probe(kid), "held held\n", "{kid}");
    }
    signal(&env, "fk-1", "-USR2", 2);
    let mut seen_kid = 0;
    assert_eq!(next_line_text(&env, "fk-1", &mut seen_kid), "released");
    assert_eq!(probe("fk-1"), "free free\n");
    assert_eq!(probe("fk-2"), "held held\n");
    assert_eq!(probe("fl"), "held held\n");
    // A second rollback to the same checkpoint takes them again.
    let r = env.json(&["restore", "k"]);
    assert_eq!(r["processes"], 1, "{r}");
    assert_eq!(probe("fl"), "held held\n");
    env.ok(&["rm", "-f", "fk-1", "fk-2", "fl"]);
}

/// A program keeping a counter in three kinds of shared memory: an
/// anonymous shared mapping, a memfd mapped twice (the second mapping must
/// alias the first) and a /dev/shm file (its descriptor closed). SIGUSR2
/// counts one step; SIGUSR1 prints "anon memfd alias shm".
const SHARED: &str = r#"
import mmap, os, signal
# Blocked from the start (threads inherit it) and taken with sigwaitinfo:
# pause() misses a signal that lands just before it.
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGUSR2})
anon = mmap.mmap(-1, 8192, mmap.MAP_SHARED)
fd = os.memfd_create('ring')
os.ftruncate(fd, 8192)
ring = mmap.mmap(fd, 8192, mmap.MAP_SHARED)
alias = mmap.mmap(fd, 8192, mmap.MAP_SHARED)
os.close(fd)
sfd = os.open('/dev/shm/counter', os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(sfd, 8192)
shm = mmap.mmap(sfd, 8192, mmap.MAP_SHARED)
os.close(sfd)
def step(*_):
    for m in (anon, ring, shm):
        m[4096] = m[4096] + 1
    open('/workspace/log', 'a').write('x\n')
def report(*_):
    print(anon[4096], ring[4096], alias[4096], shm[4096], flush=True)
handlers = {signal.SIGUSR2: step, signal.SIGUSR1: report}
step()
report()
while True:
    handlers[signal.sigwaitinfo(handlers).si_signo]()
"#;

/// Shared memory is captured at the checkpoint: a rollback brings back the
/// checkpoint's counts, not what the origin wrote after it (the template
/// would otherwise share the origin's pages), and each native fork counts
/// on its own, with a memfd's two mappings still aliasing.
#[test]
fn shared_memory_is_captured_at_the_checkpoint_and_private_to_each_copy() {
    if skipped_without_root() {
        return;
    }
    let env = Env::new();
    env.ok(&["run", "--name", "sh", "--", "python3", "-c", SHARED]);
    let mut seen = 0;
    assert_eq!(next_line_text(&env, "sh", &mut seen), "1 1 1 1");
    let s = env.json(&["snapshot", "--sandbox", "sh", "--tag", "k"]);
    assert_eq!(s["processes"], 1, "natively: {s}");
    signal(&env, "sh", "-USR2", 2);
    signal(&env, "sh", "-USR2", 2);
    wait_for_log_lines(&env, "sh", 3);
    signal(&env, "sh", "-USR1", 2);
    assert_eq!(next_line_text(&env, "sh", &mut seen), "3 3 3 3");
    let r = env.json(&["restore", "k"]);
    assert_eq!(r["processes"], 1, "{r}");
    let mut seen = env.ok(&["logs", "sh"]).lines().count();
    signal(&env, "sh", "-USR1", 2);
    assert_eq!(
        next_line_text(&env, "sh", &mut seen),
        "1 1 1 1",
        "the checkpoint's"
    );
    let f = env.json(&["fork", "k", "-n", "2", "--name", "sf"]);
    assert_eq!(f["via"], "native", "{f}");
    signal(&env, "sf-1", "-USR2", 2);
    wait_for_log_lines(&env, "sf-1", 2);
    for (sb, want) in [("sf-1", "2 2 2 2"), ("sf-2", "1 1 1 1"), ("sh", "1 1 1 1")] {
        let mut seen = env.ok(&["logs", sb]).lines().count();
        signal(&env, sb, "-USR1", 2);
        assert_eq!(next_line_text(&env, sb, &mut seen), want, "{sb}");
    }
    env.ok(&["rm", "-f", "sf-1", "sf-2", "sh"]);
}

/// A program with a TCP connection open (to itself, over the sandbox's
/// loopback) and a listener. SIGUSR1 sends a byte down the connection and
/// prints what came back, or the error's name; then it accepts one more
/// connection on the listener (made by SIGUSR1's caller) and prints "served".
const CONNECTED: &str = r#"
import signal, socket
# Blocked from the start (threads inherit it) and taken with sigwaitinfo:
# pause() misses a signal that lands just before it.
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
lst = socket.create_server(('127.0.0.1', 9000))
cli = socket.create_connection(('127.0.0.1', 9000))
srv, _ = lst.accept()
def probe(*_):
    try:
        srv.sendall(b'x')
        print(cli.recv(1).decode(), flush=True)
    except OSError as e:
        print(type(e).__name__, flush=True)
handlers = {signal.SIGUSR1: probe}
print('connected', flush=True)
while True:
    handlers[signal.sigwaitinfo(handlers).si_signo]()
"#;

/// Established TCP connections cannot be taken over by a fork: each fork
/// gets them reset (the next read fails with ECONNRESET), and the fork's
/// result says so; the origin's connection keeps working, and the listener
/// is bound again in each fork.
#[test]
fn native_forks_get_established_connections_reset_and_say_so() {
    if skipped_without_root() {
        return;
    }
    let env = Env::new();
    env.ok(&["run", "--name", "tc", "--", "python3", "-c", CONNECTED]);
    let mut seen = 0;
    assert_eq!(next_line_text(&env, "tc", &mut seen), "connected");
    env.ok(&["snapshot", "--sandbox", "tc", "--tag", "k"]);
    let f = env.json(&["fork", "k", "-n", "2", "--name", "tf"]);
    assert_eq!(f["via"], "native", "{f}");
    let note = f["note"].as_str().unwrap_or_default();
    assert!(
        note.contains("had 2 TCP connections open") && note.contains("reset"),
        "{f}"
    );
    for kid in ["tf-1", "tf-2"] {
        let mut seen = 0;
        signal(&env, kid, "-USR1", 2);
        assert_eq!(
            next_line_text(&env, kid, &mut seen),
            "ConnectionResetError",
            "{kid}"
        );
        // Its listener is its own: it accepts a connection made in the fork.
        env.ok(&[
            "exec",
            kid,
            "--",
            "python3",
            "-c",
            "import socket; socket.create_connection(('127.0.0.1', 9000))",
        ]);
    }
    signal(&env, "tc", "-USR1", 2);
    assert_eq!(next_line_text(&env, "tc", &mut seen), "x", "the origin's");
    env.ok(&["rm", "-f", "tf-1", "tf-2", "tc"]);
}

/// An ipykernel (threads, ZeroMQ over TCP, Unix socketpairs paired by
/// their peers, epolls, eventfds) forks natively: each fork runs as a
/// kernel of its own, on its own loopback, answering from the checkpoint's
/// variables; a variable set in one fork is in no other, nor in the origin.
#[test]
fn an_ipykernel_forks_natively_into_kernels_of_their_own() {
    if crate::native::skipped_without(
        "/usr/lib/python3/dist-packages/ipykernel",
        "python3-ipykernel",
    ) {
        return;
    }
    let env = Env::new();
    env.ok(&[
        "run",
        "--name",
        "jo",
        "--",
        "python3",
        "-m",
        "ipykernel_launcher",
        "-f",
        "/workspace/conn.json",
        // IPython's history database would refuse writes in the forks:
        // SQLite remembers its file's inode number, and a fork's copy of
        // the file has another (README, "what is refused").
        "--HistoryManager.hist_file=:memory:",
    ]);
    let ws = workspace_of(&env, "jo");
    std::fs::write(ws.join("client.py"), crate::native::KERNEL_CLIENT).unwrap();
    crate::native::wait_for_file(&ws.join("conn.json"));
    // Driven from inside each sandbox: a fork's kernel listens on its own
    // loopback.
    let run = |sb: &str, code: &str| {
        env.ok(&[
            "exec",
            sb,
            "--",
            "python3",
            "/workspace/client.py",
            "/workspace/conn.json",
            code,
        ])
    };
    assert_eq!(run("jo", "x = 41; x + 1"), "42\n");
    let s = env.json(&["snapshot", "--sandbox", "jo", "--tag", "k"]);
    assert_eq!(s["processes"], 1, "natively: {s}");
    let f = env.json(&["fork", "k", "-n", "2", "--name", "jg"]);
    assert_eq!(f["via"], "native", "{f}");
    assert_eq!(run("jg-1", "x"), "41\n");
    assert_eq!(run("jg-1", "x = 1; x"), "1\n");
    assert_eq!(run("jg-2", "x"), "41\n", "fork 1's variable is its own");
    assert_eq!(run("jo", "x"), "41\n", "and not the origin's");
    env.ok(&["rm", "-f", "jg-1", "jg-2", "jo"]);
}

/// Threads with CPU affinities of their own (one on CPU 0, one on the last
/// CPU) and a main thread on all of them. SIGUSR1 prints each thread's
/// name and allowed CPUs, as the kernel reports them, in thread-ID order.
const AFFINITY: &str = r#"
import os, signal, threading
# Blocked from the start (threads inherit it) and taken with sigwaitinfo:
# pause() misses a signal that lands just before it.
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
last = max(os.sched_getaffinity(0))
def pinned(cpu):
    os.sched_setaffinity(0, {cpu})
    threading.Event().wait()
for name, cpu in (('first', 0), ('last', last)):
    threading.Thread(target=pinned, args=(cpu,), name=name, daemon=True).start()
def report(*_):
    out = []
    for tid in sorted(os.listdir('/proc/self/task'), key=int):
        comm = open(f'/proc/self/task/{tid}/comm').read().strip()
        cpus = [l.split()[1] for l in open(f'/proc/self/task/{tid}/status') if l.startswith('Cpus_allowed_list')][0]
        out.append(f'{comm}={cpus}')
    print(' '.join(out), flush=True)
handlers = {signal.SIGUSR1: report}
import time
time.sleep(0.2)
report()
while True:
    handlers[signal.sigwaitinfo(handlers).si_signo]()
"#;

/// The line sandbox `sb`'s program (PID 2) prints on `SIGUSR1`.
fn usr1_report(env: &Env, sb: &str) -> String {
    let mut seen = env.ok(&["logs", sb]).lines().count();
    signal(env, sb, "-USR1", 2);
    next_line_text(env, sb, &mut seen)
}

/// Checkpoints, rollbacks and forks hold the processes they inject calls
/// into on one CPU meanwhile: every thread gets its own CPU affinity back
/// (the origin's, after a checkpoint; the checkpoint's, in a rolled-back
/// copy and in a fork).
#[test]
fn threads_keep_their_cpu_affinity_through_checkpoints_rollbacks_and_forks() {
    if skipped_without_root() {
        return;
    }
    let env = Env::new();
    env.ok(&["run", "--name", "af", "--", "python3", "-c", AFFINITY]);
    let mut seen = 0;
    let before = next_line_text(&env, "af", &mut seen);
    // In thread-ID order (which copies keep): the main thread on every
    // CPU, then one on CPU 0 (Python does not name its threads).
    assert!(
        before.split(' ').count() == 3 && before.contains("=0 "),
        "{before}"
    );
    let report = |sb: &str| usr1_report(&env, sb);
    let s = env.json(&["snapshot", "--sandbox", "af", "--tag", "k"]);
    assert_eq!(s["processes"], 1, "natively: {s}");
    assert_eq!(report("af"), before, "after the checkpoint");
    let r = env.json(&["restore", "k"]);
    assert_eq!(r["processes"], 1, "{r}");
    assert_eq!(report("af"), before, "after a rollback");
    let f = env.json(&["fork", "k", "-n", "1", "--name", "ag"]);
    assert_eq!(f["via"], "native", "{f}");
    assert_eq!(report("ag-1"), before, "in a fork");
    env.ok(&["rm", "-f", "ag-1", "af"]);
}

/// Threads that named themselves and set alternate signal stacks of their
/// own (sizes told apart); SIGUSR1 has each thread say, in thread-ID
/// order, its name (as the kernel reports it) and its alternate stack's
/// size and flags (as `sigaltstack` tells the thread itself); SIGUSR2 has
/// alpha drop its stack, beta take one, gamma rename itself and take
/// another, then they say so.
const OWN_STATE: &str = r#"
import ctypes, os, signal, threading, queue
libc = ctypes.CDLL(None, use_errno=True)
class Stack(ctypes.Structure):
    _fields_ = [('sp', ctypes.c_void_p), ('flags', ctypes.c_int), ('size', ctypes.c_size_t)]
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGUSR2})
keep, asks = [], {}
def mine():
    old = Stack()
    libc.sigaltstack(None, ctypes.byref(old))
    return f'{old.size}/{old.flags}'
def own(name, size):
    libc.prctl(15, name.encode(), 0, 0, 0)
    if size:
        buf = ctypes.create_string_buffer(size)
        keep.append(buf)
        libc.sigaltstack(ctypes.byref(Stack(ctypes.cast(buf, ctypes.c_void_p), 0, size)), None)
    else:
        libc.sigaltstack(ctypes.byref(Stack(None, 2, 0)), None)
changed = {'alpha': ('alpha', 0), 'beta': ('beta', 32768), 'gamma': ('gamma2', 16384)}
def worker(name, size, q):
    own(name, size)
    asks[threading.get_native_id()] = q
    while True:
        reply, change = q.get()
        if change:
            own(*changed[name])
        reply.put(mine())
for name, size in (('alpha', 65536), ('beta', 0), ('gamma', 131072)):
    threading.Thread(target=worker, args=(name, size, queue.Queue()), daemon=True).start()
def report(change=False):
    out = []
    for tid in sorted(os.listdir('/proc/self/task'), key=int):
        comm = open(f'/proc/self/task/{tid}/comm').read().strip()
        q = asks.get(int(tid))
        if q is None:
            state = mine()
        else:
            reply = queue.Queue()
            q.put((reply, change))
            state = reply.get()
            comm = open(f'/proc/self/task/{tid}/comm').read().strip()
        out.append(f'{comm}:{state}')
    print(' '.join(out), flush=True)
import time
time.sleep(0.3)
report()
while True:
    report(signal.sigwaitinfo({signal.SIGUSR1, signal.SIGUSR2}).si_signo == signal.SIGUSR2)
"#;

/// Each thread has the name and the alternate signal stack it set itself,
/// after a rollback (twice: the threads changed both since) and in a fork.
#[test]
fn threads_keep_their_names_and_alternate_stacks_through_rollbacks_and_forks() {
    if skipped_without_root() {
        return;
    }
    let env = Env::new();
    env.ok(&["run", "--name", "os", "--", "python3", "-c", OWN_STATE]);
    let mut seen = 0;
    let before = next_line_text(&env, "os", &mut seen);
    let all_in = |line: &str, parts: [&str; 3]| parts.iter().all(|p| line.contains(p));
    assert!(
        all_in(&before, ["alpha:65536/0", "beta:0/2", "gamma:131072/0"]),
        "{before}"
    );
    let report = |sb: &str| usr1_report(&env, sb);
    let s = env.json(&["snapshot", "--sandbox", "os", "--tag", "k"]);
    assert_eq!(s["processes"], 1, "natively: {s}");
    assert_eq!(report("os"), before, "after the checkpoint");
    for round in 0..2 {
        let mut at = env.ok(&["logs", "os"]).lines().count();
        signal(&env, "os", "-USR2", 2);
        let changed = next_line_text(&env, "os", &mut at);
        assert!(
            all_in(&changed, ["alpha:0/2", "beta:32768/0", "gamma2:16384/0"]),
            "{changed}"
        );
        let r = env.json(&["restore", "k"]);
        assert_eq!(r["processes"], 1, "{r}");
        assert_eq!(report("os"), before, "after rollback {round}");
    }
    let f = env.json(&["fork", "k", "-n", "1", "--name", "ot"]);
    assert_eq!(f["via"], "native", "{f}");
    assert_eq!(report("ot-1"), before, "in a fork");
    env.ok(&["rm", "-f", "ot-1", "os"]);
}

/// A program with bytes waiting in a pipe and in a socketpair at the
/// checkpoint; SIGUSR2 reads them (as a program does after a checkpoint),
/// SIGUSR1 prints what is waiting now, without blocking.
const WAITING: &str = r#"
import os, signal, socket
# Blocked from the start (threads inherit it) and taken with sigwaitinfo:
# pause() misses a signal that lands just before it.
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGUSR2})
r, w = os.pipe()
os.write(w, b'world')
a, b = socket.socketpair()
b.sendall(b'hello')
os.set_blocking(r, False)
a.setblocking(False)
def take(*_):
    os.read(r, 100)
    a.recv(100)
    print('taken', flush=True)
def show(*_):
    got = []
    for read in (lambda: a.recv(100), lambda: os.read(r, 100)):
        try:
            got.append(read().decode())
        except BlockingIOError:
            got.append('-')
    print(*got, flush=True)
handlers = {signal.SIGUSR2: take, signal.SIGUSR1: show}
print('ready', flush=True)
while True:
    handlers[signal.sigwaitinfo(handlers).si_signo]()
"#;

/// What a pipe and a socketpair held at the checkpoint is what a rollback
/// and each fork find in them, even after the origin read it.
#[test]
fn pipes_and_socketpairs_hold_the_checkpoints_bytes_after_rollbacks_and_in_forks() {
    if skipped_without_root() {
        return;
    }
    let env = Env::new();
    env.ok(&["run", "--name", "wq", "--", "python3", "-c", WAITING]);
    let mut seen = 0;
    assert_eq!(next_line_text(&env, "wq", &mut seen), "ready");
    let s = env.json(&["snapshot", "--sandbox", "wq", "--tag", "k"]);
    assert_eq!(s["processes"], 1, "natively: {s}");
    signal(&env, "wq", "-USR2", 2);
    assert_eq!(next_line_text(&env, "wq", &mut seen), "taken");
    signal(&env, "wq", "-USR1", 2);
    assert_eq!(
        next_line_text(&env, "wq", &mut seen),
        "- -",
        "read by the origin"
    );
    let f = env.json(&["fork", "k", "-n", "2", "--name", "wf"]);
    assert_eq!(f["via"], "native", "{f}");
    for kid in ["wf-1", "wf-2"] {
        let mut seen = 0;
        signal(&env, kid, "-USR1", 2);
        assert_eq!(next_line_text(&env, kid, &mut seen), "hello world", "{kid}");
    }
    let r = env.json(&["restore", "k"]);
    assert_eq!(r["processes"], 1, "{r}");
    let mut seen = env.ok(&["logs", "wq"]).lines().count();
    signal(&env, "wq", "-USR1", 2);
    assert_eq!(
        next_line_text(&env, "wq", &mut seen),
        "hello world",
        "rolled back"
    );
    env.ok(&["rm", "-f", "wf-1", "wf-2", "wq"]);
}

/// A program holding an eventfd (5), a pipe holding "tok" and an epoll
/// instance watching both. SIGUSR1 says what they hold, how many are
/// ready and whether the pipe's read end blocks, leaving them as they
/// were; SIGUSR2 adds 2 to the count, "more" to the pipe, and stops
/// watching the eventfd; SIGHUP makes the pipe's read end non-blocking.
const HELD_OBJECTS: &str = r#"
import os, select, signal
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP})
efd = os.eventfd(5)
r, w = os.pipe()
os.write(w, b'tok')
ep = select.epoll()
ep.register(r, select.EPOLLIN)
ep.register(efd, select.EPOLLIN)
def report():
    ready = len(ep.poll(0))
    n = os.eventfd_read(efd)
    os.eventfd_write(efd, n)
    b = os.read(r, 4096)
    os.write(w, b)
    print('eventfd', n, 'pipe', b.decode(), 'ready', ready, 'blocking', os.get_blocking(r), flush=True)
def change():
    os.eventfd_write(efd, 2)
    os.write(w, b'more')
    ep.unregister(efd)
    print('changed', flush=True)
def unblock():
    os.set_blocking(r, False)
    print('unblocked', flush=True)
print('ready', r, efd, flush=True)
handlers = {signal.SIGUSR1: report, signal.SIGUSR2: change, signal.SIGHUP: unblock}
while True:
    handlers[signal.sigwaitinfo(handlers).si_signo]()
"#;

/// Which pipe and which eventfd descriptors `pipe` and `eventfd` of the
/// program (PID 2) of sandbox `sb` are: the pipe's inode, the eventfd's id.
fn object_ids(env: &Env, sb: &str, pipe: &str, eventfd: &str) -> (String, String) {
    let link = env.ok(&["exec", sb, "--", "readlink", &format!("/proc/2/fd/{pipe}")]);
    let info = env.ok(&[
        "exec",
        sb,
        "--",
        "cat",
        &format!("/proc/2/fdinfo/{eventfd}"),
    ]);
    let id = info
        .lines()
        .find(|l| l.starts_with("eventfd-id:"))
        .unwrap_or_else(|| panic!("no eventfd id: {info}"));
    (link.trim().to_string(), id.to_string())
}

/// A rollback in place leaves an eventfd, a pipe and an epoll instance the
/// process holds as they are when they still hold what they held at the
/// checkpoint (the same objects, working), and makes them anew, with the
/// checkpoint's count, bytes, flags and registrations, when the process
/// changed them after it (the pipe alone when only its read end was made
/// non-blocking) — again at a second rollback to the same checkpoint,
/// whose template still holds the changed ones.
#[test]
fn objects_unchanged_since_the_checkpoint_stay_and_changed_ones_are_made_anew_in_rollbacks() {
    if skipped_without_root() {
        return;
    }
    let env = Env::new();
    env.ok(&["run", "--name", "ok", "--", "python3", "-c", HELD_OBJECTS]);
    let mut seen = 0;
    let ready = next_line_text(&env, "ok", &mut seen);
    let fds: Vec<&str> = ready.split_whitespace().skip(1).collect();
    let [pipe, eventfd] = fds[..] else {
        panic!("{ready}")
    };
    let first = object_ids(&env, "ok", pipe, eventfd);
    let s = env.json(&["snapshot", "--sandbox", "ok", "--tag", "k"]);
    assert_eq!(s["processes"], 1, "natively: {s}");
    let as_then = "eventfd 5 pipe tok ready 2 blocking True";
    // What the program says to a signal.
    let answer = |seen: &mut usize, sig: &str| {
        signal(&env, "ok", sig, 2);
        next_line_text(&env, "ok", seen)
    };
    assert_eq!(answer(&mut seen, "-USR1"), as_then);
    let roll_back = |seen: &mut usize| {
        let r = env.json(&["restore", "k"]);
        assert_eq!(r["processes"], 1, "{r}");
        *seen = env.ok(&["logs", "ok"]).lines().count();
    };
    roll_back(&mut seen);
    assert_eq!(
        object_ids(&env, "ok", pipe, eventfd),
        first,
        "left as they were"
    );
    assert_eq!(answer(&mut seen, "-USR1"), as_then);
    // Only the pipe's flags changed: it alone is made anew.
    assert_eq!(answer(&mut seen, "-HUP"), "unblocked");
    assert_eq!(
        answer(&mut seen, "-USR1"),
        "eventfd 5 pipe tok ready 2 blocking False"
    );
    roll_back(&mut seen);
    let now = object_ids(&env, "ok", pipe, eventfd);
    assert_ne!(now.0, first.0, "the pipe made anew");
    assert_eq!(now.1, first.1, "the eventfd left as it was");
    assert_eq!(answer(&mut seen, "-USR1"), as_then);
    assert_eq!(answer(&mut seen, "-USR2"), "changed");
    assert_eq!(
        answer(&mut seen, "-USR1"),
        "eventfd 7 pipe tokmore ready 1 blocking True"
    );
    for round in 0..2 {
        roll_back(&mut seen);
        let now = object_ids(&env, "ok", pipe, eventfd);
        assert_ne!(now.0, first.0, "round {round}: the pipe made anew");
        assert_ne!(now.1, first.1, "round {round}: the eventfd made anew");
        assert_eq!(answer(&mut seen, "-USR1"), as_then, "round {round}");
    }
    env.ok(&["rm", "-f", "ok"]);
}

/// A thread that keeps its state in vector registers (all four lanes of
/// `ymm0` where the CPU has AVX, both of `xmm0` else), counting in them and
/// in memory at once and checking every turn that they agree; its main
/// thread, on SIGUSR1, says the count and whether they ever disagreed.
const VECTORS: &str = r#"
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
volatile long count, bad;
static void *sse(void *_) {
    __asm__ volatile(
        "xorpd %%xmm0, %%xmm0\n"
        "mov $1, %%rax\n cvtsi2sd %%rax, %%xmm1\n unpcklpd %%xmm1, %%xmm1\n"
        "1: addpd %%xmm1, %%xmm0\n incq %0\n"
        "cvtsi2sdq %0, %%xmm2\n unpcklpd %%xmm2, %%xmm2\n"
        "cmpneqpd %%xmm0, %%xmm2\n movmskpd %%xmm2, %%rax\n test %%rax, %%rax\n jz 1b\n"
        "movq $1, %1\n 2: pause\n jmp 2b\n"
        : "+m"(count), "+m"(bad) : : "rax", "xmm0", "xmm1", "xmm2", "memory");
    return 0;
}
__attribute__((target("avx"))) static void *avx(void *_) {
    __asm__ volatile(
        "vxorpd %%ymm0, %%ymm0, %%ymm0\n"
        "mov $1, %%rax\n vcvtsi2sd %%rax, %%xmm1, %%xmm1\n vbroadcastsd %%xmm1, %%ymm1\n"
        "1: vaddpd %%ymm1, %%ymm0, %%ymm0\n incq %0\n"
        "vcvtsi2sdq %0, %%xmm2, %%xmm2\n vbroadcastsd %%xmm2, %%ymm2\n"
        "vcmpneqpd %%ymm0, %%ymm2, %%ymm2\n vmovmskpd %%ymm2, %%rax\n test %%rax, %%rax\n jz 1b\n"
        "movq $1, %1\n 2: pause\n jmp 2b\n"
        : "+m"(count), "+m"(bad) : : "rax", "xmm0", "xmm1", "xmm2", "memory");
    return 0;
}
int main(void) {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGUSR1);
    pthread_sigmask(SIG_BLOCK, &set, 0);
    pthread_t t;
    pthread_create(&t, 0, __builtin_cpu_supports("avx") ? avx : sse, 0);
    for (;;) {
        int sig;
        sigwait(&set, &sig);
        printf("%ld %ld\n", count, bad);
        fflush(stdout);
    }
}
"#;

/// A thread stopped in the middle of a computation held in its vector
/// registers goes on from the checkpoint's registers and memory, all of
/// them, after rollbacks in place (where it is kept, its state put back
/// by its own `rt_sigreturn`) and in forks (where it is made again).
#[test]
fn a_thread_computing_in_vector_registers_goes_on_after_rollbacks_and_in_forks() {
    if skipped_without_root() {
        return;
    }
    let env = Env::new();
    let work = env.work();
    std::fs::write(work.join("vectors.c"), VECTORS).unwrap();
    let cc = std::process::Command::new("cc")
        .args(["-O2", "-pthread", "-o"])
        .arg(work.join("vectors"))
        .arg(work.join("vectors.c"))
        .output()
        .expect("a C compiler (cc), as Rust needs one to link");
    assert!(
        cc.status.success(),
        "{}",
        String::from_utf8_lossy(&cc.stderr)
    );
    env.ok(&[
        "run",
        "--name",
        "vx",
        "--workspace",
        work.to_str().unwrap(),
        "--",
        "/workspace/vectors",
    ]);
    let report = |sb: &str| -> (u64, u64) {
        let line = usr1_report(&env, sb);
        let w: Vec<u64> = line.split(' ').map(|x| x.parse().unwrap()).collect();
        (w[0], w[1])
    };
    let first = report("vx");
    assert_eq!(first.1, 0, "{first:?}");
    let s = env.json(&["snapshot", "--sandbox", "vx", "--tag", "k"]);
    assert_eq!(s["processes"], 1, "natively: {s}");
    let mut last = first.0;
    for round in 0..3 {
        let (n, bad) = report("vx");
        assert!(n > last && bad == 0, "round {round} before: {n} {bad}");
        let r = env.json(&["restore", "k"]);
        assert_eq!(r["processes"], 1, "{r}");
        std::thread::sleep(Duration::from_millis(50));
        let (n, bad) = report("vx");
        assert_eq!(
            bad, 0,
            "round {round}: registers and memory disagree after the rollback"
        );
        assert!(n > first.0, "round {round}: it counts on ({n})");
        last = n;
    }
    let f = env.json(&["fork", "k", "-n", "2", "--name", "vf"]);
    assert_eq!(f["via"], "native", "{f}");
    for kid in ["vf-1", "vf-2"] {
        std::thread::sleep(Duration::from_millis(50));
        let (n, bad) = report(kid);
        assert_eq!(bad, 0, "{kid}: registers and memory disagree");
        assert!(n > first.0, "{kid} counts on ({n})");
    }
    env.ok(&["rm", "-f", "vf-1", "vf-2", "vx"]);
}
