//! Process trees checkpointed and rolled back natively: a shell waiting on
//! its command, a shell in the middle of a pytest run, a multiprocessing
//! pool in the middle of a map. Each is snapshotted busy, changed, rolled
//! back, and checked from outside (its tree, its files, what it goes on to
//! do).

use std::time::{Duration, Instant};

use crate::common::{Env, run_idle_python, run_python, skipped_without_root};
use crate::native::{next_line_text, signal, skipped_without, workspace_of};

/// `ps` inside the sandbox: "pid ppid pgid sid command" lines of every
/// process but init, the templates (stopped) and ps itself.
fn tree(env: &Env, sb: &str) -> Vec<String> {
    env.ok(&[
        "exec",
        sb,
        "--",
        "ps",
        "-o",
        "pid=,ppid=,pgid=,sid=,stat=,comm=",
        "-e",
    ])
    .lines()
    .map(|l| l.split_whitespace().collect::<Vec<_>>())
    .filter(|w| w.len() == 6 && w[0] != "1" && !w[4].starts_with('T') && w[5] != "ps")
    .map(|w| format!("{} {} {} {} {}", w[0], w[1], w[2], w[3], w[5]))
    .collect()
}

/// Waits until `path` (a file of the workspace, seen from outside) reads `want`.
fn wait_text(path: &std::path::Path, want: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let got = std::fs::read_to_string(path).unwrap_or_default();
        if got == want || Instant::now() > deadline {
            return got;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_shell_waiting_on_its_command_rolls_back_with_the_child_it_waits_for() {
    if skipped_without_root() {
        return;
    }
    let env = Env::new();
    let script = r#"n=0; while :; do sleep 1000 & echo "sleeping $! n=$n"; wait $!; n=$((n+1)); echo "woke $n" >> /workspace/log; done"#;
    env.ok(&["run", "--name", "sh", "--", "bash", "-c", script]);
    let mut seen = 0;
    assert_eq!(next_line_text(&env, "sh", &mut seen), "sleeping 3 n=0");
    let at_k = tree(&env, "sh");
    assert_eq!(at_k, ["2 1 2 2 bash", "3 2 2 2 sleep"]);
    let s = env.json(&["snapshot", "--sandbox", "sh", "--tag", "k"]);
    assert_eq!(s["processes"], 2, "{s}");
    // The command ends: the shell counts, logs and starts another.
    env.ok(&["exec", "sh", "--", "kill", "3"]);
    let log = workspace_of(&env, "sh").join("log");
    assert_eq!(wait_text(&log, "woke 1\n"), "woke 1\n");
    assert!(next_line_text(&env, "sh", &mut seen).ends_with("n=1"));
    let r = env.json(&["restore", "k"]);
    assert_eq!(r["processes"], 2, "{r}");
    // The checkpoint's tree: the shell, its child at its PID, one group.
    assert_eq!(tree(&env, "sh"), at_k);
    assert!(!log.exists(), "the log was written after the checkpoint");
    // The shell still waits for that child and sees it end: its count
    // goes on from the checkpoint's.
    env.ok(&["exec", "sh", "--", "kill", "3"]);
    assert_eq!(wait_text(&log, "woke 1\n"), "woke 1\n");
    assert!(next_line_text(&env, "sh", &mut seen).ends_with("n=1"));
    // And again, from the same checkpoint.
    env.json(&["restore", "k"]);
    assert_eq!(tree(&env, "sh"), at_k);
    // Three forks, each the whole tree, each going its own way.
    let f = env.json(&["fork", "k", "-n", "3", "--name", "f"]);
    assert_eq!(
        (f["processes"].as_u64(), f["via"].as_str()),
        (Some(2), Some("native")),
        "{f}"
    );
    for (i, kid) in ["f-1", "f-2", "f-3"].iter().enumerate() {
        assert_eq!(tree(&env, kid), at_k, "{kid}");
        for _ in 0..=i {
            let before = tree(&env, kid);
            let child = before[1].split_whitespace().next().unwrap().to_string();
            env.ok(&["exec", kid, "--", "kill", &child]);
            let deadline = Instant::now() + Duration::from_secs(30);
            while tree(&env, kid) == before {
                assert!(Instant::now() < deadline, "{kid}'s shell did not go on");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let want: String = (1..=i + 1).map(|n| format!("woke {n}\n")).collect();
        let log = workspace_of(&env, kid).join("log");
        assert_eq!(wait_text(&log, &want), want, "{kid}");
    }
    assert!(!log.exists() || std::fs::read_to_string(&log).unwrap() == "woke 1\n");
    // A fork rolls back natively too, from its own templates.
    env.ok(&["snapshot", "--sandbox", "f-2", "--tag", "k2"]);
    let at_k2 = tree(&env, "f-2");
    env.ok(&[
        "exec",
        "f-2",
        "--",
        "kill",
        at_k2[1].split_whitespace().next().unwrap(),
    ]);
    let r = env.json(&["restore", "k2"]);
    assert_eq!(r["processes"], 2, "{r}");
    assert_eq!(tree(&env, "f-2"), at_k2);
    env.ok(&["rm", "-f", "f-1", "f-2", "f-3", "sh"]);
}

/// Every process of sandbox `sb` but init: "state comm SigBlk" lines.
fn masks(env: &Env, sb: &str) -> Vec<String> {
    let script = r#"for d in /proc/[0-9]*; do [ "${d#/proc/}" = 1 ] || [ "${d#/proc/}" = $$ ] && continue; s=$(cut -d' ' -f3 $d/stat 2>/dev/null) || continue; echo "$s $(cat $d/comm) $(grep SigBlk $d/status | cut -f2)"; done"#;
    let mut out: Vec<String> = env
        .ok(&["exec", sb, "--", "sh", "-c", script])
        .lines()
        .filter(|l| l.split(' ').count() == 3)
        .map(str::to_string)
        .collect();
    out.sort();
    out
}

/// Parked, a template or spare blocks every signal but SIGKILL and SIGSTOP.
const ALL_BLOCKED: &str = "fffffffffffbfeff";

#[test]
fn killing_the_programs_by_name_leaves_their_templates_to_roll_back_to() {
    if skipped_without_root() {
        return;
    }
    let env = Env::new();
    // A shell with a counter beside it that blocks SIGWINCH: a mask of its
    // own, which every copy of it must get back.
    let counter = "import signal, time\nsignal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGWINCH})\nn = 0\nwhile True:\n    print(n, flush=True)\n    n += 1\n    time.sleep(0.05)\n";
    let script = r#"python3 -c "$1" > /workspace/out & while :; do sleep 1; done"#;
    env.ok(&[
        "run", "--name", "pk", "--", "sh", "-c", script, "sh", counter,
    ]);
    let out = workspace_of(&env, "pk").join("out");
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::fs::read_to_string(&out)
        .unwrap_or_default()
        .lines()
        .count()
        < 3
    {
        assert!(Instant::now() < deadline, "the counter did not count");
        std::thread::sleep(Duration::from_millis(20));
    }
    let s = env.json(&["snapshot", "--sandbox", "pk", "--tag", "k"]);
    assert_eq!(s["processes"], 3, "{s}");
    let own = "0000000008000000";
    let parked = |m: &[String]| -> Vec<String> {
        m.iter()
            .filter(|l| l.starts_with('T'))
            .map(|l| l[2..].to_string())
            .collect()
    };
    let running = |m: &[String]| -> Vec<String> {
        m.iter()
            .filter(|l| !l.starts_with('T'))
            .map(|l| l[2..].to_string())
            .collect()
    };
    let m = masks(&env, "pk");
    let templates = parked(&m);
    for name in ["sh", "python3", "sleep"] {
        let t = format!("{name} {ALL_BLOCKED}");
        assert!(templates.contains(&t), "no template {t}: {m:?}");
    }
    assert!(templates.iter().all(|t| t.ends_with(ALL_BLOCKED)), "{m:?}");
    assert!(running(&m).contains(&format!("python3 {own}")), "{m:?}");
    // By name, with SIGTERM and SIGHUP (and SIGINT to every process the
    // shell may signal): the programs end, their templates stay parked.
    env.ok(&["exec", "pk", "--", "pkill", "-x", "python3"]);
    env.ok(&["exec", "pk", "--", "pkill", "-HUP", "-x", "sleep"]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while running(&masks(&env, "pk"))
        .iter()
        .any(|l| l.starts_with("python3"))
    {
        assert!(Instant::now() < deadline, "the counter did not end");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(parked(&masks(&env, "pk")), templates);
    // The rollback brings all three back, each with its own mask.
    let r = env.json(&["restore", "k"]);
    assert_eq!(r["processes"], 3, "{r}");
    let m = masks(&env, "pk");
    assert!(running(&m).contains(&format!("python3 {own}")), "{m:?}");
    assert!(
        running(&m).contains(&"sh 0000000000000000".to_string()),
        "{m:?}"
    );
    assert_eq!(parked(&m), templates);
    let counted = std::fs::read_to_string(&out).unwrap().lines().count();
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::fs::read_to_string(&out).unwrap().lines().count() < counted + 3 {
        assert!(Instant::now() < deadline, "the counter did not go on");
        std::thread::sleep(Duration::from_millis(20));
    }
    // A native fork's copies get their own masks too.
    let f = env.json(&["fork", "k", "-n", "1", "--name", "pf"]);
    assert_eq!(f["via"], "native", "{f}");
    let m = masks(&env, "pf-1");
    assert!(running(&m).contains(&format!("python3 {own}")), "{m:?}");
    assert!(parked(&m).iter().all(|t| t.ends_with(ALL_BLOCKED)), "{m:?}");
    env.ok(&["rm", "-f", "pf-1", "pk"]);
}

const TESTS: &str = r#"import os, time
def test_one():
    assert 1 + 1 == 2
def test_waits():
    while not os.path.exists('/workspace/go'):
        time.sleep(0.02)
    assert open('/workspace/go').read() == 'yes'
def test_three():
    assert 'x' * 3 == 'xxx'
"#;

/// Writes `text` to `path` whole at once (a temporary file renamed over
/// it): the program polls for the file and reads it as soon as it exists.
fn put(path: &std::path::Path, text: &str) {
    let tmp = path.with_extension("part");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// The lines of a pytest summary without its timing.
fn summary(out: &str) -> Vec<String> {
    out.lines()
        .map(|l| match l.split_once(" in ") {
            Some((a, _)) if a.contains("passed") || a.contains("failed") => a.to_string(),
            _ => l.split_whitespace().collect::<Vec<_>>().join(" "),
        })
        .collect()
}

#[test]
fn a_shell_in_the_middle_of_a_pytest_run_rolls_back_and_the_run_ends_as_an_uninterrupted_one() {
    if skipped_without("/usr/lib/python3/dist-packages/pytest", "python3-pytest") {
        return;
    }
    let env = Env::new();
    std::fs::write(env.work().join("test_a.py"), TESTS).unwrap();
    let work = env.work();
    // (Output captured in memory: pytest's default capture holds deleted
    // files in the sandbox's /tmp, which native forks refuse.)
    let script = "cd /workspace; python3 -m pytest -q -p no:cacheprovider --capture=sys test_a.py > out.txt 2>&1; echo \"exit $?\" >> out.txt; echo done; sleep 1000";
    let run = |name: &str| {
        env.ok(&[
            "run",
            "--name",
            name,
            "--workspace",
            work.to_str().unwrap(),
            "--",
            "bash",
            "-c",
            script,
        ]);
    };
    // Uninterrupted.
    run("whole");
    let ws = workspace_of(&env, "whole");
    put(&ws.join("go"), "yes");
    let mut seen = 0;
    assert_eq!(next_line_text(&env, "whole", &mut seen), "done");
    let whole = summary(&std::fs::read_to_string(ws.join("out.txt")).unwrap());
    assert!(whole.iter().any(|l| l == "3 passed"), "{whole:?}");
    // Snapshotted in the middle of test_waits.
    run("mid");
    let ws = workspace_of(&env, "mid");
    let out = ws.join("out.txt");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !std::fs::read_to_string(&out)
        .unwrap_or_default()
        .starts_with('.')
    {
        assert!(Instant::now() < deadline, "pytest did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let s = env.json(&["snapshot", "--sandbox", "mid", "--tag", "k"]);
    assert_eq!(s["processes"], 2, "{s}");
    let at_k = std::fs::read_to_string(&out).unwrap();
    put(&ws.join("go"), "no");
    let mut seen = 0;
    assert_eq!(next_line_text(&env, "mid", &mut seen), "done");
    let failed = summary(&std::fs::read_to_string(&out).unwrap());
    assert!(
        failed.iter().any(|l| l == "1 failed, 2 passed"),
        "{failed:?}"
    );
    let r = env.json(&["restore", "k"]);
    assert_eq!(r["processes"], 2, "{r}");
    assert_eq!(std::fs::read_to_string(&out).unwrap(), at_k);
    assert!(!ws.join("go").exists());
    put(&ws.join("go"), "yes");
    assert_eq!(next_line_text(&env, "mid", &mut seen), "done");
    let rolled = summary(&std::fs::read_to_string(&out).unwrap());
    assert_eq!(
        rolled, whole,
        "the rolled-back run ends as the uninterrupted one"
    );
    // Three forks of the run in the middle: each ends as its input says.
    let f = env.json(&["fork", "k", "-n", "3", "--name", "f"]);
    assert_eq!(
        (f["processes"].as_u64(), f["via"].as_str()),
        (Some(2), Some("native")),
        "{f}"
    );
    for (kid, go, want) in [
        ("f-1", "yes", "3 passed"),
        ("f-2", "no", "1 failed, 2 passed"),
        ("f-3", "yes", "3 passed"),
    ] {
        let ws = workspace_of(&env, kid);
        assert_eq!(
            std::fs::read_to_string(ws.join("out.txt")).unwrap(),
            at_k,
            "{kid}"
        );
        put(&ws.join("go"), go);
        let mut seen = 0;
        assert_eq!(next_line_text(&env, kid, &mut seen), "done", "{kid}");
        let got = summary(&std::fs::read_to_string(ws.join("out.txt")).unwrap());
        assert!(got.iter().any(|l| l == want), "{kid}: {got:?}");
    }
    env.ok(&["rm", "-f", "whole", "mid", "f-1", "f-2", "f-3"]);
}

const POOL: &str = r#"import multiprocessing as mp, os, sys, time
def work(i):
    while not os.path.exists(f'/workspace/go{i % 2}'):
        time.sleep(0.01)
    return i * i + int(open(f'/workspace/go{i % 2}').read() or 0)
if __name__ == '__main__':
    print('ready', flush=True)
    with mp.Pool(2) as p:
        r = p.map(work, range(6), chunksize=1)
    print('result', sum(r), flush=True)
    time.sleep(1000)
"#;

#[test]
fn a_multiprocessing_pool_in_the_middle_of_a_map_rolls_back_and_maps_again() {
    if skipped_without_root() {
        return;
    }
    let env = Env::new();
    std::fs::write(env.work().join("pool.py"), POOL).unwrap();
    let work = env.work();
    env.ok(&[
        "run",
        "--name",
        "pool",
        "--workspace",
        work.to_str().unwrap(),
        "--",
        "python3",
        "/workspace/pool.py",
    ]);
    let mut seen = 0;
    assert_eq!(next_line_text(&env, "pool", &mut seen), "ready");
    // Both workers busy with their first task.
    let deadline = Instant::now() + Duration::from_secs(30);
    while tree(&env, "pool").len() < 3 {
        assert!(Instant::now() < deadline, "no workers");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    let at_k = tree(&env, "pool");
    let s = env.json(&["snapshot", "--sandbox", "pool", "--tag", "k"]);
    assert_eq!(s["processes"], 3, "{s}");
    let ws = workspace_of(&env, "pool");
    let go = |a: &str, b: &str| {
        put(&ws.join("go0"), a);
        put(&ws.join("go1"), b);
    };
    // 0+1+4+9+16+25 = 55, plus 3 per task of worker input 0 and 5 per task of 1.
    go("3", "5");
    assert_eq!(next_line_text(&env, "pool", &mut seen), "result 79");
    let r = env.json(&["restore", "k"]);
    assert_eq!(r["processes"], 3, "{r}");
    assert_eq!(tree(&env, "pool"), at_k);
    // The same map, from the same tasks in the same queues, other inputs.
    go("1", "0");
    assert_eq!(next_line_text(&env, "pool", &mut seen), "result 58");
    // Three forks, each a whole pool with its own queues.
    let f = env.json(&["fork", "k", "-n", "3", "--name", "f"]);
    assert_eq!(
        (f["processes"].as_u64(), f["via"].as_str()),
        (Some(3), Some("native")),
        "{f}"
    );
    for (i, kid) in ["f-1", "f-2", "f-3"].iter().enumerate() {
        assert_eq!(tree(&env, kid), at_k, "{kid}");
        let ws = workspace_of(&env, kid);
        for (name, v) in [("go0", i), ("go1", 10 * i)] {
            put(&ws.join(name), &v.to_string());
        }
        let mut seen = 0;
        let want = format!("result {}", 55 + 3 * i + 30 * i);
        assert_eq!(next_line_text(&env, kid, &mut seen), want, "{kid}");
    }
    env.ok(&["rm", "-f", "pool", "f-1", "f-2", "f-3"]);
}

/// Four processes (a parent and the three it forked), each holding 8 MiB
/// of its own: at each new command in `/workspace/cmd` ("N bump" or
/// "N report"), each bumps a byte in every seventh page of its memory for
/// the first, then writes "N count sum" of its memory to `/workspace/rI`.
const HOLDERS: &str = r#"import os, time
i = 0
for k in (1, 2, 3):
    if os.fork() == 0:
        i = k
        break
mem = bytearray(8 << 20)
for p in range(0, len(mem), 4096):
    mem[p] = 1
count, last = 0, None
open(f'/workspace/up{i}', 'w').close()
while True:
    try:
        cmd = open('/workspace/cmd').read().split()
    except FileNotFoundError:
        cmd = []
    if len(cmd) == 2 and cmd[0] != last:
        last = cmd[0]
        if cmd[1] == 'bump':
            count += 1
            for p in range(0, len(mem), 7 * 4096):
                mem[p] = (mem[p] + 1) % 256
        with open(f'/workspace/r{i}.part', 'w') as f:
            f.write(f'{last} {count} {sum(mem[::4096])}')
        os.rename(f'/workspace/r{i}.part', f'/workspace/r{i}')
    time.sleep(0.01)
"#;

#[test]
fn each_process_of_a_tree_has_its_memory_of_the_checkpoint_after_each_of_several_rollbacks() {
    if skipped_without_root() {
        return;
    }
    let env = Env::new();
    let work = env.work();
    std::fs::write(work.join("holders.py"), HOLDERS).unwrap();
    env.ok(&[
        "run",
        "--name",
        "hold",
        "--workspace",
        work.to_str().unwrap(),
        "--",
        "python3",
        "/workspace/holders.py",
    ]);
    let ws = workspace_of(&env, "hold");
    for i in 0..4 {
        wait_text(&ws.join(format!("up{i}")), "");
    }
    let mut n = 0;
    let mut ask = |what: &str| -> Vec<String> {
        n += 1;
        put(&ws.join("cmd"), &format!("{n} {what}"));
        (0..4)
            .map(|i| {
                let deadline = Instant::now() + Duration::from_secs(30);
                loop {
                    let got = std::fs::read_to_string(ws.join(format!("r{i}"))).unwrap_or_default();
                    if got.split_whitespace().next() == Some(&n.to_string()) {
                        // (Without the command's number.)
                        return got.split_once(' ').unwrap().1.to_string();
                    }
                    assert!(Instant::now() < deadline, "process {i}: {got:?} at {n}");
                    std::thread::sleep(Duration::from_millis(20));
                }
            })
            .collect()
    };
    let at_k = ask("report");
    assert_eq!(at_k, vec!["0 2048"; 4], "each with its own memory");
    let s = env.json(&["snapshot", "--sandbox", "hold", "--tag", "k"]);
    assert_eq!(s["processes"], 4, "{s}");
    for round in 0..3 {
        ask("bump");
        let bumped = ask("bump");
        assert_eq!(
            bumped,
            vec![format!("2 {}", 2048 + 2 * 293); 4],
            "round {round}"
        );
        let r = env.json(&["restore", "k"]);
        assert_eq!(r["processes"], 4, "{r}");
        assert_eq!(
            ask("report"),
            at_k,
            "round {round}: the memory of the checkpoint"
        );
    }
    env.ok(&["rm", "-f", "hold"]);
}

const ASGI: &str = r#"import os
hits = {'n': 0}
async def app(scope, receive, send):
    if scope['type'] != 'http':
        return
    hits['n'] += 1
    await send({'type': 'http.response.start', 'status': 200, 'headers': []})
    await send({'type': 'http.response.body', 'body': f"{os.getpid()} {hits['n']}".encode()})
"#;

/// Asks sandbox `sb`'s server until each of its two workers has answered
/// (at most 200 requests a round; another round while a worker that just
/// started is not accepting yet); returns each worker's first and last
/// count.
fn ask_both(env: &Env, sb: &str) -> std::collections::BTreeMap<u64, (u64, u64)> {
    let script = "import urllib.request\nfor _ in range(200):\n    print(urllib.request.urlopen('http://127.0.0.1:8000/').read().decode(), flush=True)";
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let o = env.run(&["exec", sb, "--", "python3", "-c", script]);
        if o.status.success() {
            let mut seen = std::collections::BTreeMap::new();
            for l in String::from_utf8_lossy(&o.stdout).lines() {
                let w: Vec<u64> = l.split_whitespace().map(|x| x.parse().unwrap()).collect();
                seen.entry(w[0]).or_insert((w[1], w[1])).1 = w[1];
            }
            if seen.len() < 2 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
            assert_eq!(seen.len(), 2, "{sb}: both workers answer: {seen:?}");
            return seen;
        }
        assert!(Instant::now() < deadline, "{sb} does not serve");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn uvicorn_with_two_workers_rolls_back_and_forks_each_worker_serving() {
    if skipped_without("/usr/lib/python3/dist-packages/uvicorn", "python3-uvicorn") {
        return;
    }
    let env = Env::new();
    std::fs::write(env.work().join("app.py"), ASGI).unwrap();
    let work = env.work();
    env.ok(&[
        "run",
        "--name",
        "uv",
        "--workspace",
        work.to_str().unwrap(),
        "--",
        "python3",
        "-m",
        "uvicorn",
        "--app-dir",
        "/workspace",
        "app:app",
        "--port",
        "8000",
        "--workers",
        "2",
        "--log-level",
        "warning",
    ]);
    let first = ask_both(&env, "uv");
    let at_k: std::collections::BTreeMap<u64, u64> =
        first.iter().map(|(p, (_, last))| (*p, *last)).collect();
    let tree_k = tree(&env, "uv");
    let s = env.json(&["snapshot", "--sandbox", "uv", "--tag", "k"]);
    assert_eq!(s["processes"], tree_k.len(), "{s}");
    ask_both(&env, "uv");
    let r = env.json(&["restore", "k"]);
    assert_eq!(r["processes"], tree_k.len(), "{r}");
    assert_eq!(tree(&env, "uv"), tree_k);
    // Each worker counts on from the checkpoint's count.
    let again = ask_both(&env, "uv");
    for (pid, (first, _)) in &again {
        assert_eq!(*first, at_k[pid] + 1, "worker {pid} after the rollback");
    }
    let f = env.json(&["fork", "k", "-n", "3", "--name", "f"]);
    assert_eq!(
        (f["processes"].as_u64(), f["via"].as_str()),
        (Some(tree_k.len() as u64), Some("native")),
        "{f}"
    );
    for kid in ["f-1", "f-2", "f-3"] {
        assert_eq!(tree(&env, kid), tree_k, "{kid}");
        for (pid, (first, _)) in ask_both(&env, kid) {
            assert_eq!(first, at_k[&pid] + 1, "{kid}: worker {pid}");
        }
    }
    env.ok(&["rm", "-f", "uv", "f-1", "f-2", "f-3"]);
}

/// A PostgreSQL 15 server (Debian's) run as `postgres` over a data
/// directory in the workspace, listening on 127.0.0.1:5432 only.
const POSTGRES: &str = "B=/usr/lib/postgresql/15/bin; as() { setpriv --reuid=postgres --regid=postgres --init-groups \"$@\"; }; mkdir -p /workspace/pgdata && chown postgres:postgres /workspace/pgdata && as $B/initdb -D /workspace/pgdata -A trust -U postgres > /workspace/initdb.log 2>&1 && exec setpriv --reuid=postgres --regid=postgres --init-groups $B/postgres -D /workspace/pgdata -c listen_addresses=127.0.0.1 -c unix_socket_directories= -c port=5432";

/// Runs `sql` with psql in sandbox `sb`; returns its unaligned output.
fn psql(env: &Env, sb: &str, sql: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let o = env.run(&[
            "exec",
            sb,
            "--",
            "setpriv",
            "--reuid=postgres",
            "--regid=postgres",
            "--init-groups",
            "/usr/bin/psql",
            "-h",
            "127.0.0.1",
            "-U",
            "postgres",
            "-At",
            "-c",
            sql,
        ]);
        if o.status.success() {
            return String::from_utf8_lossy(&o.stdout).trim().to_string();
        }
        let err = String::from_utf8_lossy(&o.stderr);
        // Only a server not up yet (or starting up) is waited for.
        let starting = err.contains("Connection refused") || err.contains("starting up");
        assert!(starting && Instant::now() < deadline, "psql in {sb}: {err}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn postgresql_rolls_back_and_forks_natively_with_its_rows_and_shared_memory() {
    if skipped_without("/usr/lib/postgresql/15/bin/postgres", "postgresql-15") {
        return;
    }
    let env = Env::new();
    env.ok(&["run", "--name", "pg", "--", "sh", "-c", POSTGRES]);
    psql(
        &env,
        "pg",
        "create table t (v int); insert into t values (1), (2)",
    );
    // Its background processes, each a child of the postmaster.
    let deadline = Instant::now() + Duration::from_secs(30);
    while tree(&env, "pg").len() < 6 {
        assert!(Instant::now() < deadline, "{:?}", tree(&env, "pg"));
        std::thread::sleep(Duration::from_millis(50));
    }
    let at_k = tree(&env, "pg");
    let s = env.json(&["snapshot", "--sandbox", "pg", "--tag", "k"]);
    assert_eq!(s["processes"], at_k.len(), "{s}");
    psql(
        &env,
        "pg",
        "insert into t values (100); create table u (w int)",
    );
    assert_eq!(psql(&env, "pg", "select sum(v) from t"), "103");
    let r = env.json(&["restore", "k"]);
    assert_eq!(r["processes"], at_k.len(), "{r}");
    assert_eq!(tree(&env, "pg"), at_k);
    // New backends (forked by the copy of the postmaster) attach to the
    // copies' shared memory and see the checkpoint's rows and catalog.
    assert_eq!(psql(&env, "pg", "select sum(v) from t"), "3");
    assert_eq!(
        psql(
            &env,
            "pg",
            "select count(*) from pg_class where relname = 'u'"
        ),
        "0"
    );
    psql(&env, "pg", "insert into t values (10)");
    assert_eq!(psql(&env, "pg", "select sum(v) from t"), "13");
    // And again from the same checkpoint.
    env.json(&["restore", "k"]);
    assert_eq!(psql(&env, "pg", "select sum(v) from t"), "3");
    // Three forks: each a running server (its data directory still the
    // postgres user's) with the checkpoint's rows, each writing its own.
    let f = env.json(&["fork", "k", "-n", "3", "--name", "pf"]);
    assert_eq!(
        (f["processes"].as_u64(), f["via"].as_str()),
        (Some(at_k.len() as u64), Some("native")),
        "{f}"
    );
    let kids = ["pf-1", "pf-2", "pf-3"];
    for (i, kid) in kids.iter().enumerate() {
        assert_eq!(tree(&env, kid), at_k, "{kid}");
        assert_eq!(psql(&env, kid, "select sum(v) from t"), "3", "{kid}");
        psql(
            &env,
            kid,
            &format!("insert into t values ({})", 1000 * (i + 1)),
        );
    }
    for (i, kid) in kids.iter().enumerate() {
        let want = (3 + 1000 * (i + 1)).to_string();
        assert_eq!(psql(&env, kid, "select sum(v) from t"), want, "{kid}");
    }
    assert_eq!(psql(&env, "pg", "select sum(v) from t"), "3");
    env.ok(&["rm", "-f", "pg", "pf-1", "pf-2", "pf-3"]);
}

/// A parent and its child sharing an anonymous shared mapping (three
/// pages; the last a hole at the checkpoint) and a pipe holding "tok":
/// SIGUSR2 makes the child write into the first and last pages, SIGHUP
/// into the pipe, then tell the parent, which reports (as SIGUSR1 makes
/// it) the first page's word, the last page's first byte and what the pipe
/// holds.
const SHARING: &str = r#"import mmap, os, select, signal
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP})
m = mmap.mmap(-1, 3 * 4096)
m[0:4] = b'then'
r, w = os.pipe()
os.write(w, b'tok')
kid = os.fork()
if kid == 0:
    while True:
        if signal.sigwaitinfo({signal.SIGUSR2, signal.SIGHUP}).si_signo == signal.SIGHUP:
            os.write(w, b'+')
        else:
            m[0:4] = b'kid!'
            m[8192] = 120
        os.kill(os.getppid(), signal.SIGUSR1)
print('ready', kid, flush=True)
while True:
    signal.sigwaitinfo({signal.SIGUSR1})
    held = b''
    while select.select([r], [], [], 0)[0]:
        held += os.read(r, 64)
    os.write(w, held)
    print(m[0:4].decode(), m[8192], held.decode(), flush=True)
"#;

/// The identity (device and inode) of the shared mapping of `pid` in
/// sandbox `sb`, and its pipes, as `/proc` shows them.
fn shared_ids(env: &Env, sb: &str, pid: &str) -> (String, String) {
    let maps = env.ok(&["exec", sb, "--", "cat", &format!("/proc/{pid}/maps")]);
    let map = maps
        .lines()
        .find(|l| l.contains(" rw-s ") && l.ends_with(" (deleted)"))
        .map(|l| {
            l.split_whitespace()
                .skip(3)
                .take(2)
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_else(|| panic!("process {pid} maps no shared memory: {maps}"));
    let fds = env.ok(&["exec", sb, "--", "ls", "-l", &format!("/proc/{pid}/fd")]);
    let mut pipes: Vec<&str> = fds
        .lines()
        .filter_map(|l| l.split("-> ").nth(1))
        .filter(|t| t.starts_with("pipe:"))
        .collect();
    pipes.sort_unstable();
    pipes.dedup();
    (map, pipes.join(" "))
}

/// A rollback in place of a tree leaves the shared memory its processes
/// share where it is (the same object in both, still shared: a write by
/// one is seen by the other) with what it held at the checkpoint put back
/// — a page written since that was a hole then reads as zeros again — and
/// the pipe they share too while it holds what it held then; a pipe
/// written since is made anew with the checkpoint's bytes. Twice from the
/// same checkpoint; a fork gets copies of its own.
#[test]
fn shared_memory_and_pipes_of_a_tree_stay_the_same_objects_with_their_checkpoint_contents() {
    if skipped_without_root() {
        return;
    }
    let env = Env::new();
    run_python(&env, "sh", SHARING);
    let mut seen = 0;
    let ready = next_line_text(&env, "sh", &mut seen);
    let kid = ready.split_whitespace().nth(1).unwrap().to_string();
    let ids = |sb: &str| [shared_ids(&env, sb, "2"), shared_ids(&env, sb, &kid)];
    let first = ids("sh");
    assert_eq!(first[0], first[1], "one object each, shared");
    let s = env.json(&["snapshot", "--sandbox", "sh", "--tag", "k"]);
    assert_eq!(s["processes"], 2, "{s}");
    let ask = |sb: &str, seen: &mut usize, sig: &str, pid: &str| {
        signal(&env, sb, sig, pid.parse().unwrap());
        next_line_text(&env, sb, seen)
    };
    let roll_back = |seen: &mut usize| {
        let r = env.json(&["restore", "k"]);
        assert_eq!(r["processes"], 2, "{r}");
        *seen = env.ok(&["logs", "sh"]).lines().count();
    };
    for round in 0..2 {
        assert_eq!(ask("sh", &mut seen, "-USR2", &kid), "kid! 120 tok");
        roll_back(&mut seen);
        assert_eq!(ids("sh"), first, "round {round}: the same objects");
        assert_eq!(
            ask("sh", &mut seen, "-USR1", "2"),
            "then 0 tok",
            "round {round}"
        );
    }
    // The pipe written since: made anew, the memory still kept.
    assert_eq!(ask("sh", &mut seen, "-HUP", &kid), "then 0 tok+");
    roll_back(&mut seen);
    let now = ids("sh");
    assert_eq!(now[0], now[1], "still shared");
    assert_eq!(now[0].0, first[0].0, "the same shared memory");
    assert_ne!(now[0].1, first[0].1, "the pipe made anew");
    assert_eq!(ask("sh", &mut seen, "-USR1", "2"), "then 0 tok");
    assert_eq!(ask("sh", &mut seen, "-USR2", &kid), "kid! 120 tok");
    let f = env.json(&["fork", "k", "-n", "1", "--name", "shf"]);
    assert_eq!(f["via"], "native", "{f}");
    let mut seen_f = 0;
    assert_eq!(ask("shf-1", &mut seen_f, "-USR1", "2"), "then 0 tok");
    assert_eq!(ask("shf-1", &mut seen_f, "-USR2", &kid), "kid! 120 tok");
    assert_ne!(
        shared_ids(&env, "shf-1", "2").0,
        first[0].0,
        "the fork's own"
    );
    assert_eq!(
        ask("sh", &mut seen, "-USR1", "2"),
        "kid! 120 tok",
        "the origin's as it was"
    );
    env.ok(&["rm", "-f", "sh", "shf-1"]);
}

/// A parent and its child share a `/dev/shm` file mapped with its
/// descriptor closed (as PostgreSQL's dynamic shared memory; with `keep`,
/// as Python's `mmap`, which keeps a descriptor on it): SIGUSR2 has the
/// child write to it, SIGHUP grow it by name; each reports to the parent,
/// which prints its first bytes, byte 8192 and the file's size.
fn named_shm(keep: bool) -> String {
    let map = if keep {
        "import mmap\nm = mmap.mmap(fd, 3 * 4096)"
    } else {
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.mmap.restype = ctypes.c_void_p\nlibc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]\nm = memoryview((ctypes.c_ubyte * (3 * 4096)).from_address(libc.mmap(None, 3 * 4096, 3, 1, fd, 0))).cast('B')"
    };
    format!(
        r#"import os, signal
signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP}})
fd = os.open('/dev/shm/seg', os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 3 * 4096)
{map}
os.close(fd)
m[0:4] = b'then'
kid = os.fork()
if kid == 0:
    while True:
        if signal.sigwaitinfo({{signal.SIGUSR2, signal.SIGHUP}}).si_signo == signal.SIGHUP:
            fd = os.open('/dev/shm/seg', os.O_RDWR)
            os.ftruncate(fd, 5 * 4096)
            os.close(fd)
        else:
            m[0:4] = b'kid!'
            m[8192] = 120
        os.kill(os.getppid(), signal.SIGUSR1)
print('ready', kid, flush=True)
while True:
    signal.sigwaitinfo({{signal.SIGUSR1}})
    print(bytes(m[0:4]).decode(), m[8192], os.stat('/dev/shm/seg').st_size, flush=True)
"#
    )
}

/// The inode of the `/dev/shm` file `pid` of sandbox `sb` maps, and the
/// one its name names now.
fn named_ids(env: &Env, sb: &str, pid: &str) -> (String, String) {
    let maps = env.ok(&["exec", sb, "--", "cat", &format!("/proc/{pid}/maps")]);
    let mapped = maps
        .lines()
        .find(|l| l.ends_with(" /dev/shm/seg"))
        .and_then(|l| l.split_whitespace().nth(4))
        .unwrap_or_else(|| panic!("process {pid} maps no /dev/shm/seg: {maps}"))
        .to_string();
    let named = env.ok(&["exec", sb, "--", "stat", "-c", "%i", "/dev/shm/seg"]);
    (mapped, named.trim().to_string())
}

/// A rollback in place of a tree leaves a `/dev/shm` file its processes
/// map where it is while its name still names it: the same file, in both,
/// with the checkpoint's bytes and length (grown by name since). Where the
/// name was taken by another file since, the file is made again under it.
/// With a descriptor kept on it too, the file is filled again by name.
#[test]
fn a_named_shared_memory_file_of_a_tree_stays_the_same_file_with_its_checkpoint_contents() {
    if skipped_without_root() {
        return;
    }
    for keep in [false, true] {
        named_shm_rolls_back(keep);
    }
}

fn named_shm_rolls_back(keep: bool) {
    let env = Env::new();
    run_python(&env, "sn", &named_shm(keep));
    let mut seen = 0;
    let ready = next_line_text(&env, "sn", &mut seen);
    let kid = ready.split_whitespace().nth(1).unwrap().to_string();
    let first = named_ids(&env, "sn", "2");
    assert_eq!(first.0, first.1, "the name's file mapped");
    assert_eq!(named_ids(&env, "sn", &kid), first, "shared");
    let s = env.json(&["snapshot", "--sandbox", "sn", "--tag", "k"]);
    assert_eq!(s["processes"], 2, "{s}");
    let ask = |seen: &mut usize, sig: &str, pid: &str| {
        signal(&env, "sn", sig, pid.parse().unwrap());
        next_line_text(&env, "sn", seen)
    };
    let roll_back = |seen: &mut usize| {
        let r = env.json(&["restore", "k"]);
        assert_eq!(r["processes"], 2, "{r}");
        *seen = env.ok(&["logs", "sn"]).lines().count();
    };
    for round in 0..2 {
        assert_eq!(ask(&mut seen, "-USR2", &kid), "kid! 120 12288");
        assert_eq!(ask(&mut seen, "-HUP", &kid), "kid! 120 20480");
        roll_back(&mut seen);
        assert_eq!(
            named_ids(&env, "sn", "2"),
            first,
            "round {round}: the same file ({keep})"
        );
        assert_eq!(named_ids(&env, "sn", &kid), first, "round {round}: shared");
        assert_eq!(
            ask(&mut seen, "-USR1", "2"),
            "then 0 12288",
            "round {round} ({keep})"
        );
    }
    // Another file under the name: the checkpoint's made again there.
    assert_eq!(ask(&mut seen, "-USR2", &kid), "kid! 120 12288");
    env.ok(&[
        "exec",
        "sn",
        "--",
        "sh",
        "-c",
        "rm /dev/shm/seg && echo other > /dev/shm/seg",
    ]);
    roll_back(&mut seen);
    let now = named_ids(&env, "sn", "2");
    assert_eq!(now.0, now.1, "the name's file mapped again");
    assert_eq!(named_ids(&env, "sn", &kid), now, "shared again");
    assert_eq!(ask(&mut seen, "-USR1", "2"), "then 0 12288");
    assert_eq!(ask(&mut seen, "-USR2", &kid), "kid! 120 12288");
    env.ok(&["rm", "-f", "sn"]);
}

/// Children that ended before the checkpoint, not reaped: one with exit
/// code 7, one killed by SIGTERM. SIGUSR1 reaps both and prints how each
/// ended.
const ZOMBIES: &str = r#"import os, signal, sys, time
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
a = os.fork()
if a == 0:
    os._exit(7)
b = os.fork()
if b == 0:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(10)
    os._exit(0)
time.sleep(0.3)
print('ready', a, b, flush=True)
signal.sigwaitinfo({signal.SIGUSR1})
for p in (a, b):
    _, st = os.waitpid(p, 0)
    print(p, os.waitstatus_to_exitcode(st), flush=True)
time.sleep(1000)
"#;

#[test]
fn children_that_ended_unreaped_come_back_as_zombies_with_their_statuses() {
    if skipped_without_root() {
        return;
    }
    let env = Env::new();
    env.ok(&["run", "--name", "z", "--", "python3", "-c", ZOMBIES]);
    let mut seen = 0;
    let ready = next_line_text(&env, "z", &mut seen);
    let pids: Vec<&str> = ready.split_whitespace().skip(1).collect();
    let s = env.json(&["snapshot", "--sandbox", "z", "--tag", "k"]);
    assert_eq!(s["processes"], 1, "{s}");
    // The next two lines of its output (they may come at once).
    let reap = |sb: &str, seen: &mut usize| {
        env.ok(&["exec", sb, "--", "kill", "-USR1", "2"]);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let out = env.ok(&["logs", sb]);
            let lines: Vec<String> = out.lines().map(str::to_string).collect();
            if lines.len() >= *seen + 2 {
                let got = [lines[*seen].clone(), lines[*seen + 1].clone()];
                *seen += 2;
                return got;
            }
            assert!(Instant::now() < deadline, "{sb} did not reap: {out}");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let want = [format!("{} 7", pids[0]), format!("{} -15", pids[1])];
    assert_eq!(reap("z", &mut seen), want);
    env.json(&["restore", "k"]);
    assert_eq!(
        reap("z", &mut seen),
        want,
        "reaped again after the rollback"
    );
    let f = env.json(&["fork", "k", "-n", "1", "--name", "f"]);
    assert_eq!(f["via"], "native", "{f}");
    let mut seen_f = 0;
    assert_eq!(reap("f-1", &mut seen_f), want, "and in a fork");
    env.ok(&["rm", "-f", "z", "f-1"]);
}

#[test]
fn a_child_that_ended_unreaped_since_the_checkpoint_leaves_its_pid_to_the_rollback() {
    if skipped_without_root() {
        return;
    }
    let env = Env::new();
    let script = "import subprocess, time\np = subprocess.Popen(['sleep', '1000'])\nprint('ready', p.pid, flush=True)\ntime.sleep(1000)\n";
    env.ok(&["run", "--name", "zp", "--", "python3", "-c", script]);
    let mut seen = 0;
    assert_eq!(next_line_text(&env, "zp", &mut seen), "ready 3");
    let at_k = tree(&env, "zp");
    assert_eq!(at_k, ["2 1 2 2 python3", "3 2 2 2 sleep"]);
    let s = env.json(&["snapshot", "--sandbox", "zp", "--tag", "k"]);
    assert_eq!(s["processes"], 2, "{s}");
    // Killed, the child stays a zombie (its parent does not wait for it),
    // holding PID 3, which the rollback gives the checkpoint's child.
    env.ok(&["exec", "zp", "--", "pkill", "-x", "sleep"]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !env
        .ok(&["exec", "zp", "--", "ps", "-o", "stat=", "-p", "3"])
        .starts_with('Z')
    {
        assert!(Instant::now() < deadline, "the child did not end");
        std::thread::sleep(Duration::from_millis(20));
    }
    let r = env.json(&["restore", "k"]);
    assert_eq!(r["processes"], 2, "{r}");
    assert_eq!(tree(&env, "zp"), at_k);
    env.ok(&["rm", "-f", "zp"]);
}

/// A `tine exec -i` session's shell is part of the sandbox's state: it is
/// snapshotted idle and while a command runs, and after a rollback it goes
/// on from the checkpoint, its client and pipes the same; forks get it
/// without the client, reached through the files of its streams.
#[test]
fn an_exec_session_rolls_back_in_place_and_forks_idle_and_in_the_middle_of_a_command() {
    use std::io::{BufRead, BufReader, Write};
    use std::process::Stdio;
    if skipped_without_root() {
        return;
    }
    let env = Env::new();
    run_idle_python(&env, "s");
    let mut session = env
        .cmd(&["exec", "-i", "s", "--", "bash"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut to = session.stdin.take().unwrap();
    let mut from = BufReader::new(session.stdout.take().unwrap());
    let mut say = |line: &str| {
        to.write_all(line.as_bytes()).unwrap();
        to.flush().unwrap();
    };
    let mut hear = || {
        let mut l = String::new();
        from.read_line(&mut l).unwrap();
        l.trim_end().to_string()
    };
    say("x=5; echo ready $x\n");
    assert_eq!(hear(), "ready 5");
    // Idle between commands.
    let s = env.json(&["snapshot", "--sandbox", "s", "--tag", "idle"]);
    assert_eq!(s["processes"], 2, "{s}");
    say("x=7; echo now $x\n");
    assert_eq!(hear(), "now 7");
    let r = env.json(&["restore", "idle"]);
    assert_eq!(r["processes"], 2, "{r}");
    say("echo back $x\n");
    assert_eq!(hear(), "back 5", "the session goes on from the checkpoint");
    // In the middle of a command.
    say("sleep 1000; echo after $x\n");
    let deadline = Instant::now() + Duration::from_secs(20);
    while env
        .run(&["exec", "s", "--", "pgrep", "-x", "sleep"])
        .status
        .code()
        != Some(0)
    {
        assert!(Instant::now() < deadline, "the command did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let s = env.json(&["snapshot", "--sandbox", "s", "--tag", "mid"]);
    assert_eq!(s["processes"], 3, "{s}");
    env.ok(&["exec", "s", "--", "pkill", "-x", "sleep"]);
    assert_eq!(hear(), "after 5");
    say("x=9\n");
    let r = env.json(&["restore", "mid"]);
    assert_eq!(r["processes"], 3, "{r}");
    // The shell waits for the checkpoint's command again, with its x.
    env.ok(&["exec", "s", "--", "pkill", "-x", "sleep"]);
    assert_eq!(hear(), "after 5");
    // Forks get the session without its client, its streams files in
    // their /tmp: fed commands through its FIFO, each shell goes its own way.
    for (tag, n) in [("idle", 2), ("mid", 3)] {
        let f = env.json(&["fork", tag, "-n", "3", "--name", tag]);
        assert_eq!(
            (f["processes"].as_u64(), f["via"].as_str()),
            (Some(n), Some("native")),
            "{f}"
        );
        let note = f["note"].as_str().unwrap_or_default();
        let dir = note
            .split_whitespace()
            .find_map(|w| w.strip_suffix("/stdin,"))
            .unwrap_or_else(|| panic!("no session streams named: {f}"))
            .to_string();
        for i in 1..=3 {
            let kid = format!("{tag}-{i}");
            let feed = |line: &str| {
                let script = format!("printf '%s\\n' \"$1\" > {dir}/stdin");
                env.ok(&["exec", &kid, "--", "sh", "-c", &script, "sh", line]);
            };
            if tag == "mid" {
                env.ok(&["exec", &kid, "--", "pkill", "-x", "sleep"]);
            }
            feed(&format!("x=${{x}}${{x}}{i}; echo fork {i} $x"));
            let want = match tag {
                "mid" => format!("after 5\nfork {i} 55{i}\n"),
                _ => format!("fork {i} 55{i}\n"),
            };
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                let out = env.ok(&["exec", &kid, "--", "cat", &format!("{dir}/stdout")]);
                if out == want {
                    break;
                }
                assert!(Instant::now() < deadline, "{kid}: {out:?}, not {want:?}");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        env.ok(&[
            "rm",
            "-f",
            &format!("{tag}-1"),
            &format!("{tag}-2"),
            &format!("{tag}-3"),
        ]);
    }
    say("echo end\n");
    assert_eq!(hear(), "end");
    drop(to);
    assert_eq!(session.wait().unwrap().code(), Some(0));
    env.ok(&["rm", "-f", "s"]);
}

/// A daemon beside the sandbox's command (a child of init of its own, as
/// `pg_ctl start` leaves the postmaster) comes back with it in rollbacks
/// and in native forks, under the fork's init.
#[test]
fn a_daemon_beside_the_command_comes_with_rollbacks_and_native_forks() {
    if skipped_without_root() {
        return;
    }
    let env = Env::new();
    env.ok(&[
        "run",
        "--name",
        "d",
        "--",
        "sh",
        "-c",
        "(setsid sleep 1000000 &); exec sleep 2000000",
    ]);
    let deadline = Instant::now() + Duration::from_secs(20);
    while tree(&env, "d").len() < 2 {
        assert!(Instant::now() < deadline, "{:?}", tree(&env, "d"));
        std::thread::sleep(Duration::from_millis(20));
    }
    let at_k = tree(&env, "d");
    assert!(
        at_k.iter()
            .all(|l| l.split_whitespace().nth(1) == Some("1")),
        "{at_k:?}"
    );
    let s = env.json(&["snapshot", "--sandbox", "d", "--tag", "k"]);
    assert_eq!(s["processes"], 2, "{s}");
    let daemon = at_k[1].split_whitespace().next().unwrap().to_string();
    env.ok(&["exec", "d", "--", "kill", &daemon]);
    let r = env.json(&["restore", "k"]);
    assert_eq!(r["processes"], 2, "{r}");
    assert_eq!(tree(&env, "d"), at_k);
    let f = env.json(&["fork", "k", "-n", "2", "--name", "df"]);
    assert_eq!(
        (f["processes"].as_u64(), f["via"].as_str()),
        (Some(2), Some("native")),
        "{f}"
    );
    for kid in ["df-1", "df-2"] {
        assert_eq!(tree(&env, kid), at_k, "{kid}");
    }
    // Each fork's daemon is its own.
    env.ok(&["exec", "df-1", "--", "kill", &daemon]);
    let deadline = Instant::now() + Duration::from_secs(20);
    while tree(&env, "df-1").len() != 1 {
        assert!(Instant::now() < deadline, "{:?}", tree(&env, "df-1"));
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(tree(&env, "df-2"), at_k);
    // The origin's own are untouched (it also sees the forks' processes,
    // whose PID namespaces are nested in its own).
    let origin = tree(&env, "d");
    assert!(at_k.iter().all(|l| origin.contains(l)), "{origin:?}");
    env.ok(&["rm", "-f", "d", "df-1", "df-2"]);
}

/// Drives `tine exec -it SB -- bash` on a terminal of its own (argv: tine,
/// the sandbox): a job in the foreground at the checkpoint is in the
/// foreground again after the rollback (Ctrl-C reaches it, not the shell).
const TERMINAL: &str = r#"
import os, pty, select, subprocess, sys, time
tine, sb = sys.argv[1], sys.argv[2]
pid, fd = pty.fork()
if pid == 0:
    os.execv(tine, [tine, "exec", "-it", sb, "--", "bash", "--norc", "-i"])
def hear(s):
    buf, end = b"", time.time() + 20
    while s.encode() not in buf and time.time() < end:
        if select.select([fd], [], [], 0.1)[0]:
            buf += os.read(fd, 4096)
    print(("heard " if s.encode() in buf else "missed ") + s, flush=True)
def say(line):
    os.write(fd, (line + "\n").encode())
def run(*a):
    subprocess.run([tine, *a], check=True, stdout=subprocess.DEVNULL)
say("x=5; echo re''ady $x"); hear("ready 5")
run("snapshot", "--sandbox", sb, "--tag", "idle")
say("x=7; echo n''ow $x"); hear("now 7")
run("restore", "idle")
say("echo ba''ck $x"); hear("back 5")
say("sleep 1000"); time.sleep(0.5)
run("snapshot", "--sandbox", sb, "--tag", "mid")
os.write(fd, b"\x03"); say("x=9; echo af''ter $x"); hear("after 9")
run("restore", "mid")
os.write(fd, b"\x03"); say("echo ag''ain $x"); hear("again 5")
say("exit 3")
print("exit", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"#;

#[test]
fn a_terminal_session_rolls_back_with_its_foreground_job() {
    if skipped_without_root() {
        return;
    }
    let env = Env::new();
    run_idle_python(&env, "t");
    let out = std::process::Command::new("python3")
        .args(["-c", TERMINAL, env!("CARGO_BIN_EXE_tine"), "t"])
        .current_dir(env.work())
        .env_remove("TINE_REPO")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        text.lines().collect::<Vec<_>>(),
        [
            "heard ready 5",
            "heard now 7",
            "heard back 5",
            "heard after 9",
            "heard again 5",
            "exit 3"
        ],
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    env.ok(&["rm", "-f", "t"]);
}
