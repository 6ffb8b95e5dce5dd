//! Sandboxes for real (root only): isolation of files, processes, network and
//! privileges, as seen from inside.

use std::fs::File;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use tine_sandbox::ns::{self, InitSpec, Net};

use crate::common::{is_root, skipped_without_root};

/// Runs `script` with `sh` inside a sandbox over `ws`; returns (exit code, stdout, stderr).
fn run(ws: &Path, logs: &Path, net: Net, script: &str) -> (i32, String, String) {
    // Its root's, as a sandbox's workspace is.
    let ids = ns::Ids::for_repository("tine-test");
    tine_sandbox::overlay::chown_tree(ws, (ids.host_uid, ids.host_gid)).unwrap();
    let spec = InitSpec {
        workspace: ws.to_path_buf(),
        rootfs: None,
        hostname: "tine-test".into(),
        net,
        command: vec!["sh".into(), "-c".into(), script.into()],
        env: vec![("PATH".into(), "/usr/bin:/bin:/usr/sbin:/sbin".into())],
        cgroup_procs: vec![],
        hide: vec![],
        held: false,
        ids: Some(ids),
        tmp_bytes: None,
        seccomp: true,
        image: None,
    };
    let (o, e) = (logs.join("out"), logs.join("err"));
    let pid = ns::spawn_init(
        Path::new(env!("CARGO_BIN_EXE_tine")),
        &spec,
        &File::create(&o).unwrap(),
        &File::create(&e).unwrap(),
    )
    .unwrap()
    .wait_ready()
    .unwrap();
    let code = ns::wait(pid).unwrap();
    (
        code,
        std::fs::read_to_string(o).unwrap(),
        std::fs::read_to_string(e).unwrap(),
    )
}

#[test]
fn a_sandbox_writes_only_its_workspace_and_tmp_and_sees_nothing_of_the_host() {
    if skipped_without_root() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let ws = tmp.path().join("ws");
    std::fs::create_dir(&ws).unwrap();
    std::fs::write(ws.join("given.txt"), "from the host\n").unwrap();
    let host_tmp_probe = format!("tine-probe-{}", std::process::id());
    let script = format!(
        r#"
        cat /workspace/given.txt
        echo made-inside > /workspace/made.txt && echo ws-write-ok
        echo x > /tmp/{host_tmp_probe} && echo tmp-write-ok
        for p in /etc/tine-escape /usr/tine-escape /tine-escape {ws}/direct /sys/tine-escape /proc/sys/kernel/hostname; do
            (echo x > $p) 2>/dev/null && echo "ESCAPED $p"
        done
        mount -o remount,rw / 2>/dev/null && echo "ESCAPED remount"
        echo "pid $$"
        echo "procs $(ls /proc | grep -c '^[0-9]')"
        echo "host $(cat /proc/sys/kernel/hostname)"
        echo "nnp $(grep NoNewPrivs /proc/self/status | tr -s '\t ' ' ')"
        echo "capeff $(grep CapEff /proc/self/status | tr -s '\t ' ' ')"
        echo "ifaces $(tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | tr '\n' ' ')"
        echo "routes $(tail -n +2 /proc/net/route | wc -l)"
        exit 7
        "#,
        ws = ws.display()
    );
    let (code, out, err) = run(&ws, tmp.path(), Net::None, &script);
    assert_eq!(code, 7, "stdout:\n{out}\nstderr:\n{err}");
    assert!(!out.contains("ESCAPED"), "{out}");
    for want in [
        "from the host",
        "ws-write-ok",
        "tmp-write-ok",
        "pid 2",
        "host tine-test",
        "nnp NoNewPrivs: 1",
        "ifaces lo ",
        "routes 0",
    ] {
        assert!(
            out.contains(want),
            "missing {want:?} in:\n{out}\nstderr:\n{err}"
        );
    }
    // Only init, sh and the ls pipeline exist in its PID namespace.
    let procs: usize = out
        .lines()
        .find_map(|l| l.strip_prefix("procs "))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(procs <= 5, "saw {procs} processes:\n{out}");
    // CAP_SYS_ADMIN (bit 21) is gone.
    let capeff = out
        .lines()
        .find_map(|l| l.strip_prefix("capeff CapEff: "))
        .unwrap();
    let caps = u64::from_str_radix(capeff.trim(), 16).unwrap();
    assert_eq!(caps & (1 << 21), 0, "CapEff {capeff}");
    assert_eq!(
        std::fs::read_to_string(ws.join("made.txt")).unwrap(),
        "made-inside\n"
    );
    assert!(!Path::new("/tmp").join(&host_tmp_probe).exists());
    assert!(!Path::new("/etc/tine-escape").exists());

    // With the host's network, the host's interfaces are visible.
    let (code, out, _) = run(
        &ws,
        tmp.path(),
        Net::Host,
        "tail -n +3 /proc/net/dev | wc -l",
    );
    assert_eq!(code, 0);
    assert!(out.trim().parse::<u32>().unwrap() >= 2, "{out}");
}

#[test]
fn run_ps_logs_stop_rm_and_the_directory_is_never_modified() {
    if skipped_without_root() {
        return;
    }
    let env = crate::common::Env::new();
    let proj = env.tmp.path().join("proj");
    std::fs::create_dir(&proj).unwrap();
    std::fs::write(proj.join("a.txt"), "hello\n").unwrap();
    let v = env.json(&[
        "run",
        "--name",
        "web",
        "--workspace",
        proj.to_str().unwrap(),
        "--",
        "sh",
        "-c",
        "trap 'echo bye > /workspace/bye; exit 0' TERM; cat /workspace/a.txt; echo new > /workspace/b.txt; while :; do sleep 0.05; done",
    ]);
    assert_eq!(v["state"], "running", "{v}");
    assert_eq!(v["isolation"]["kind"], "full");
    let v = env.wait_for("web", |v| {
        v["workspace"]
            .as_str()
            .is_some_and(|w| std::path::Path::new(w).join("b.txt").exists())
    });
    let ws = std::path::PathBuf::from(v["workspace"].as_str().unwrap());
    assert_eq!(
        std::fs::read_to_string(ws.join("a.txt")).unwrap(),
        "hello\n"
    );
    assert_eq!(env.ok(&["logs", "web"]), "hello\n");
    // exec joins it: same workspace, its PID namespace, its exit code, stdin with -i.
    let o = env.run(&[
        "exec",
        "web",
        "--",
        "sh",
        "-c",
        "cat /workspace/b.txt; echo pid $$; exit 9",
    ]);
    assert_eq!(o.status.code(), Some(9));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("new")
            && out
                .lines()
                .any(|l| l.starts_with("pid ") && l[4..].parse::<u32>().unwrap() < 10),
        "{out}"
    );
    let mut child = env
        .cmd(&["exec", "-i", "web", "--", "tr", "a-z", "A-Z"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write as _;
    child.stdin.take().unwrap().write_all(b"shout\n").unwrap();
    let o = child.wait_with_output().unwrap();
    assert_eq!(String::from_utf8_lossy(&o.stdout), "SHOUT\n");
    // Without -i, piped input is not forwarded, and the caller is told.
    let mut child = env
        .cmd(&["exec", "web", "--", "sh", "-c", "cat; echo done"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"lost\n").unwrap();
    let o = child.wait_with_output().unwrap();
    assert_eq!(String::from_utf8_lossy(&o.stdout), "done\n");
    assert!(
        String::from_utf8_lossy(&o.stderr)
            .contains("stdin is not forwarded to the command; give -i to forward it"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    // -t: the command gets its own terminal in the sandbox; -it feeds it input.
    let o = env.run(&[
        "exec",
        "-t",
        "web",
        "--",
        "sh",
        "-c",
        "tty; test -t 0 && echo on-a-terminal; exit 3",
    ]);
    assert_eq!(o.status.code(), Some(3));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.starts_with("/dev/pts/") && out.contains("on-a-terminal"),
        "{out}"
    );
    let mut child = env
        .cmd(&["exec", "-it", "web", "--", "sh"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"echo typed-$((6*7))\nexit 4\n")
        .unwrap();
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(4));
    assert!(String::from_utf8_lossy(&o.stdout).contains("typed-42"));
    // A root filesystem that is not there: not found, named.
    let o = env.run(&["run", "--rootfs", "/nonexistent", "--", "true"]);
    assert_eq!(o.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&o.stderr).contains("/nonexistent: find: No such file"));
    // A second sandbox cannot take the name.
    let o = env.run(&["run", "--name", "web", "--", "true"]);
    assert_eq!(
        o.status.code(),
        Some(4),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    // rm refuses a running sandbox.
    assert_eq!(env.run(&["rm", "web"]).status.code(), Some(4));
    let t0 = std::time::Instant::now();
    let v = env.json(&["stop", "web", "--timeout", "5"]);
    assert!(
        t0.elapsed() < std::time::Duration::from_secs(4),
        "stop was not graceful"
    );
    assert_eq!(v["state"], "stopped", "{v}");
    assert_eq!(v["exit"]["code"], 0, "{v}");
    assert_eq!(v["exit"]["stopped"], true);
    // The TERM trap ran: its file is in the sandbox's upper layer.
    let upper = env
        .work()
        .join(".tine/sandboxes")
        .join(v["id"].as_str().unwrap())
        .join("upper");
    assert_eq!(std::fs::read_to_string(upper.join("bye")).unwrap(), "bye\n");
    assert!(upper.join("b.txt").exists() && !upper.join("a.txt").exists());
    // The source directory is untouched; the sandbox's writes are its own.
    let names: Vec<String> = std::fs::read_dir(&proj)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, vec!["a.txt"]);
    env.ok(&["rm", "web"]);
    assert!(env.json(&["ps", "--all"]).as_array().unwrap().is_empty());
}

#[test]
fn oom_is_reported_and_on_failure_restarts() {
    if skipped_without_root() {
        return;
    }
    let env = crate::common::Env::new();
    // A runaway: doubles a string until the memory limit stops it.
    env.ok(&[
        "run",
        "--name",
        "hog",
        "--memory",
        "64M",
        "--",
        "sh",
        "-c",
        "s=x; while :; do s=\"$s$s\"; done",
    ]);
    let v = env.wait_for("hog", |v| v["state"] == "exited");
    assert_eq!(v["state"], "exited", "{v}");
    assert_eq!(v["exit"]["oom"], true, "{v}");
    assert!(env.ok(&["ps", "--all"]).contains("exited (OOM)"));

    env.ok(&[
        "run",
        "--name",
        "flaky",
        "--restart",
        "on-failure",
        "--",
        "sh",
        "-c",
        "echo run >> /workspace/runs; exit 3",
    ]);
    let v = env.wait_for("flaky", |v| v["restarts"].as_u64() >= Some(2));
    assert!(v["restarts"].as_u64().unwrap() >= 2, "{v}");
    let runs = std::fs::read_to_string(
        std::path::Path::new(v["workspace"].as_str().unwrap()).join("runs"),
    )
    .unwrap();
    assert!(runs.lines().count() >= 2, "{runs}");
    assert_eq!(v["exit"]["code"], 3);
    let v = env.json(&["stop", "flaky"]);
    assert_eq!(v["state"], "stopped", "{v}");
    env.ok(&["rm", "hog"]);
    env.ok(&["rm", "flaky"]);
}

#[test]
fn a_killed_supervisor_shows_as_stale_and_stop_cleans_up() {
    if skipped_without_root() {
        return;
    }
    let env = crate::common::Env::new();
    let v = env.json(&[
        "run",
        "--name",
        "orphan",
        "--",
        "sh",
        "-c",
        "echo kept > /workspace/f; sleep 600",
    ]);
    let id = v["id"].as_str().unwrap().to_string();
    std::thread::sleep(std::time::Duration::from_millis(100));
    let snap = env.json(&["snapshot", "--sandbox", "orphan", "--files-only"])["id"]
        .as_str()
        .unwrap()
        .to_string();
    let rec_pid = env.json(&["ps"])[0]["init_pid"].as_u64().unwrap();
    // Find the supervisor: the parent of the sandbox's init.
    let stat = std::fs::read_to_string(format!("/proc/{rec_pid}/stat")).unwrap();
    let ppid: i32 = stat
        .rsplit(") ")
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        std::fs::read_to_string(format!("/proc/{ppid}/cmdline"))
            .unwrap()
            .contains("__supervise"),
        "parent {ppid} is not the supervisor"
    );
    std::process::Command::new("kill")
        .args(["-9", &ppid.to_string()])
        .status()
        .unwrap();
    let v = env.wait_for("orphan", |v| v["state"] == "stale");
    assert_eq!(v["state"], "stale", "{v}");
    // stop cleans up what the dead supervisor left: the processes, the mount, the cgroup.
    let v = env.json(&["stop", "orphan"]);
    assert_eq!(v["state"], "stopped", "{v}");
    let gone = || !std::path::Path::new(&format!("/proc/{rec_pid}")).exists();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while !gone() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(gone(), "the sandbox's init {rec_pid} survived stop");
    // No snapshot was lost with the supervisor.
    let out = env.tmp.path().join("restored");
    env.ok(&["restore", &snap, "--to", out.to_str().unwrap()]);
    assert_eq!(std::fs::read_to_string(out.join("f")).unwrap(), "kept\n");
    assert!(
        env.json(&["fsck"])["damaged_objects"]
            .as_array()
            .unwrap()
            .is_empty()
    );
    env.ok(&["rm", &id]);
}

/// Every snapshot of a sandbox whose program keeps rewriting files is the state
/// of one instant: the writer renames values into f0..f9 in turn, so at any
/// instant the files read i,..,i,i-1,..,i-1; an unfrozen read would catch
/// later values in later files.
#[test]
fn snapshots_of_a_busy_writer_are_each_one_instant() {
    if skipped_without_root() {
        return;
    }
    let env = crate::common::Env::new();
    env.ok(&[
        "run", "--name", "busy", "--", "sh", "-c",
        "i=1; for j in 0 1 2 3 4 5 6 7 8 9; do echo 0 > /workspace/f$j; done; \
         while :; do for j in 0 1 2 3 4 5 6 7 8 9; do echo $i > /workspace/t; mv /workspace/t /workspace/f$j; done; i=$((i+1)); done",
    ]);
    std::thread::sleep(std::time::Duration::from_millis(100));
    let staircase = |vals: &[u64]| {
        let top = vals[0];
        let cut = vals.iter().position(|v| *v != top).unwrap_or(vals.len());
        vals[cut..].iter().all(|v| *v + 1 == top) && (cut == vals.len() || top > 0)
    };
    let mut seen = std::collections::HashSet::new();
    for k in 0..12 {
        let s = env.json(&[
            "snapshot",
            "--sandbox",
            "busy",
            "--files-only",
            "-m",
            &format!("s{k}"),
        ]);
        let id = s["id"].as_str().unwrap().to_string();
        let dir = env.tmp.path().join(format!("r{k}"));
        env.ok(&["restore", &id, "--to", dir.to_str().unwrap()]);
        let vals: Vec<u64> = (0..10)
            .map(|j| {
                std::fs::read_to_string(dir.join(format!("f{j}")))
                    .unwrap()
                    .trim()
                    .parse()
                    .unwrap()
            })
            .collect();
        assert!(
            staircase(&vals),
            "snapshot {k} is not one instant: {vals:?}"
        );
        seen.insert(vals);
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(seen.len() > 3, "the writer did not make progress: {seen:?}");
    env.ok(&["rm", "-f", "busy"]);
}

#[test]
fn sixteen_forks_diverge_independently() {
    if skipped_without_root() {
        return;
    }
    let env = crate::common::Env::new();
    let proj = env.tmp.path().join("proj");
    std::fs::create_dir(&proj).unwrap();
    std::fs::write(proj.join("shared.txt"), "base\n").unwrap();
    std::fs::create_dir_all(proj.join("old/deep")).unwrap();
    std::fs::write(proj.join("old/deep/gone"), "x").unwrap();
    env.ok(&[
        "run",
        "--name",
        "parent",
        "--workspace",
        proj.to_str().unwrap(),
        "--",
        "sleep",
        "600",
    ]);
    env.ok(&[
        "exec",
        "parent",
        "--",
        "sh",
        "-c",
        "echo parent > /workspace/state; rm /workspace/shared.txt; rm -r /workspace/old; mkdir -p /workspace/old/new; echo n > /workspace/old/new/f",
    ]);
    let s = env.json(&["snapshot", "--sandbox", "parent", "--tag", "point"]);
    // Held still while read: frozen, or (here) its process stopped by ptrace.
    assert!(
        s["frozen_ms"].as_f64().unwrap() > 0.0 || s["paused_ms"].as_f64().unwrap() > 0.0,
        "{s}"
    );
    let f = env.json(&["fork", "point", "-n", "16", "--name", "kid"]);
    assert_eq!(f["sandboxes"].as_array().unwrap().len(), 16);
    // Every fork's workspace is exactly the snapshot (the first computed, the
    // others copied from it: files, whiteouts and the opaque directory).
    let point_tree = env.json(&["show", "point"])["tree"].clone();
    for v in env.json(&["ps"]).as_array().unwrap() {
        if v["name"].as_str().unwrap().starts_with("kid-") {
            let full = env.json(&["snapshot", v["workspace"].as_str().unwrap()]);
            assert_eq!(full["tree"], point_tree, "{}", v["name"]);
        }
    }
    // Each fork starts at the snapshot, then writes its own value.
    for k in 1..=16 {
        let o = env.ok(&[
            "exec", &format!("kid-{k}"), "--", "sh", "-c",
            &format!("cat /workspace/state; test ! -e /workspace/shared.txt && echo gone; echo kid{k} > /workspace/state"),
        ]);
        assert_eq!(o, "parent\ngone\n", "kid-{k}");
    }
    for k in 1..=16 {
        let o = env.ok(&["exec", &format!("kid-{k}"), "--", "cat", "/workspace/state"]);
        assert_eq!(o, format!("kid{k}\n"), "kid-{k} saw another fork's write");
    }
    assert_eq!(
        env.ok(&["exec", "parent", "--", "cat", "/workspace/state"]),
        "parent\n"
    );
    // gc (with compaction) waits neither for running sandboxes nor for a long
    // `tine exec` into one, and they keep working.
    let mut long_exec = env
        .cmd(&["exec", "kid-1", "--", "sleep", "120"])
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(200));
    let mut gc = env
        .cmd(&["gc"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let status = loop {
        if let Some(st) = gc.try_wait().unwrap() {
            break st;
        }
        if std::time::Instant::now() > deadline {
            let _ = gc.kill();
            panic!("tine gc waited for running sandboxes");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert!(status.success());
    let _ = long_exec.kill();
    let _ = long_exec.wait();
    assert_eq!(
        env.ok(&["exec", "kid-3", "--", "cat", "/workspace/state"]),
        "kid3\n"
    );
    // Their snapshots descend from the fork point.
    let s = env.json(&["snapshot", "--sandbox", "kid-5"]);
    assert_eq!(s["parent"], env.json(&["show", "point"])["id"]);
    // One `rm` for all, and one name it does not know: the others still go.
    let names: Vec<String> = std::iter::once("parent".to_string())
        .chain(std::iter::once("no-such-sandbox".to_string()))
        .chain((1..=16).map(|k| format!("kid-{k}")))
        .collect();
    let mut args = vec!["rm", "-f"];
    args.extend(names.iter().map(String::as_str));
    let o = env.run(&args);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("no-such-sandbox"));
    assert_eq!(String::from_utf8_lossy(&o.stdout).lines().count(), 17);
    assert_eq!(env.json(&["ps", "--all"]), serde_json::json!([]));
}

/// Without root the same commands work, unisolated, and `run` says so once.
#[test]
fn without_root_sandboxes_run_unisolated_and_say_so() {
    if !is_root() || !std::path::Path::new("/usr/bin/setpriv").exists() {
        tine_testkit::skip("needs root (to become nobody) and setpriv");
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let w = tmp.path().join("w");
    std::fs::create_dir(&w).unwrap();
    std::fs::write(w.join("a"), "hi\n").unwrap();
    std::fs::set_permissions(&w, std::fs::Permissions::from_mode(0o777)).unwrap();
    std::fs::set_permissions(w.join("a"), std::fs::Permissions::from_mode(0o666)).unwrap();
    let tine = |args: &[&str]| {
        std::process::Command::new("/usr/bin/setpriv")
            .args([
                "--reuid",
                "65534",
                "--regid",
                "65534",
                "--clear-groups",
                "--",
            ])
            .arg(env!("CARGO_BIN_EXE_tine"))
            .args(args)
            .current_dir(tmp.path())
            .env_remove("TINE_REPO")
            .output()
            .unwrap()
    };
    assert!(tine(&["init"]).status.success());
    let o = tine(&[
        "run",
        "--name",
        "u",
        "--workspace",
        "w",
        "--",
        "sh",
        "-c",
        "echo out > b; sleep 60",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(err.matches("WITHOUT isolation").count(), 1, "{err}");
    assert!(err.contains("not running as root"), "{err}");
    let ps: serde_json::Value = serde_json::from_slice(&tine(&["--json", "ps"]).stdout).unwrap();
    assert_eq!(ps[0]["isolation"]["kind"], "none", "{ps}");
    assert_eq!(ps[0]["state"], "running");
    let o = tine(&["exec", "u", "--", "sh", "-c", "sleep 0.2; cat a b"]);
    assert_eq!(String::from_utf8_lossy(&o.stdout), "hi\nout\n");
    let s: serde_json::Value =
        serde_json::from_slice(&tine(&["--json", "snapshot", "--sandbox", "u"]).stdout).unwrap();
    assert!(s["id"].is_string(), "{s}");
    let o = tine(&["--json", "stop", "u", "--timeout", "2"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["state"], "stopped", "{v}");
    assert!(tine(&["rm", "u"]).status.success());
    // The source directory is untouched.
    assert!(!w.join("b").exists());
}

/// A sandbox snapshot's tree, built from the base and the upper layer (and
/// remembered merges), is exactly the tree of its merged view scanned in full.
#[test]
fn sandbox_snapshots_equal_a_full_scan_of_the_merged_view() {
    if skipped_without_root() {
        return;
    }
    let env = crate::common::Env::new();
    let proj = env.tmp.path().join("proj");
    for (p, c) in [
        ("a/x", "1"),
        ("a/keep", "k"),
        ("b/c/y", "2"),
        ("b/c/w", "3"),
        ("d/e/f", "4"),
    ] {
        let f = proj.join(p);
        std::fs::create_dir_all(f.parent().unwrap()).unwrap();
        std::fs::write(f, c).unwrap();
    }
    let v = env.json(&[
        "run",
        "--name",
        "m",
        "--workspace",
        proj.to_str().unwrap(),
        "--",
        "sleep",
        "600",
    ]);
    let merged = std::path::PathBuf::from(v["workspace"].as_str().unwrap());
    let check = |step: &str| {
        let s = env.json(&["snapshot", "--sandbox", "m", "-m", step]);
        let full = env.json(&["snapshot", merged.to_str().unwrap()]);
        assert_eq!(s["tree"], full["tree"], "step {step}: {s} vs {full}");
        s["id"].as_str().unwrap().to_string()
    };
    let m = |p: &str| merged.join(p);
    std::fs::write(m("a/x"), "changed").unwrap();
    check("modify");
    std::fs::remove_file(m("b/c/y")).unwrap();
    let after_delete = check("delete");
    std::fs::remove_dir_all(m("b")).unwrap();
    std::fs::create_dir(m("b")).unwrap();
    std::fs::write(m("b/z"), "new").unwrap();
    check("opaque directory");
    check("no change");
    std::fs::write(m("a/x"), "again").unwrap();
    std::fs::create_dir_all(m("d/e/g")).unwrap();
    std::fs::write(m("d/e/g/h"), "deep").unwrap();
    check("modify and add below");
    env.ok(&["restore", &after_delete, "--sandbox", "m"]);
    check("after a rollback");
    std::fs::remove_dir_all(m("d")).unwrap();
    check("delete a whole directory");
    std::fs::write(m("b/c2"), "copy-up of a lower directory").unwrap_or(());
    std::fs::write(m("a/keep"), "copied up").unwrap();
    std::fs::create_dir_all(m("n/o/p")).unwrap();
    std::fs::write(m("n/o/p/q"), "nested").unwrap();
    check("nested new directories");
    std::fs::rename(m("n/o"), m("a/moved")).unwrap();
    std::fs::write(m("a/moved/p/r"), "after the move").unwrap();
    check("directory renamed, then written in");
    std::os::unix::fs::symlink("moved/p/q", m("a/link")).unwrap();
    std::fs::set_permissions(m("a/moved/p/q"), std::fs::Permissions::from_mode(0o600)).unwrap();
    check("symlink and chmod");

    // Cost follows the change: with many upper directories, a one-file
    // change reads only the directories on its path.
    for i in 0..200 {
        let d = m(&format!("many/d{i}"));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("f"), "x").unwrap();
    }
    check("many directories");
    std::fs::write(m("many/d7/f"), "y").unwrap();
    let s = env.json(&["snapshot", "--sandbox", "m", "-m", "one change"]);
    let full = env.json(&["snapshot", merged.to_str().unwrap()]);
    assert_eq!(s["tree"], full["tree"]);
    let read = s["stats"]["dirs"].as_u64().unwrap();
    assert!(read <= 3, "a one-file change read {read} directories: {s}");
    env.ok(&["rm", "-f", "m"]);
}

/// Writes through a shared memory mapping make no inotify events (and may not
/// change the file's stat): snapshots while such a mapping exists, and the one
/// after, still capture them.
#[test]
fn writes_through_shared_mappings_are_captured() {
    if skipped_without_root() {
        return;
    }
    let env = crate::common::Env::new();
    let script = r#"
import mmap, os, time
os.makedirs("/workspace/sub", exist_ok=True)
f = open("/workspace/sub/m.bin", "w+b")
f.write(b"A" * 4096); f.flush()
mm = mmap.mmap(f.fileno(), 4096)
open("/tmp/ready", "w").close()
def step(go, done, data, unmap):
    global mm
    while not os.path.exists(go): time.sleep(0.02)
    if mm is None: mm = mmap.mmap(f.fileno(), 4096)
    mm[0:1] = data
    if unmap: mm.close(); mm = None
    open(done, "w").close()
step("/tmp/go1", "/tmp/done1", b"B", False)
step("/tmp/go2", "/tmp/done2", b"C", True)
time.sleep(600)
"#;
    env.ok(&["run", "--name", "mm", "--", "python3", "-c", script]);
    let wait = |f: &str| {
        let code = env
            .cmd(&["exec", "mm", "--", "sh", "-c"])
            .arg(format!(
                "for i in $(seq 500); do test -e {f} && exit 0; sleep 0.02; done; exit 1"
            ))
            .status()
            .unwrap();
        assert!(code.success(), "{f} never appeared");
    };
    let first_byte = |snap: &str| {
        let out = env.tmp.path().join(format!("out-{snap}"));
        env.ok(&["restore", snap, "--to", out.to_str().unwrap()]);
        std::fs::read(out.join("sub/m.bin")).unwrap()[0]
    };
    let snap = || {
        env.json(&["snapshot", "--sandbox", "mm"])["id"]
            .as_str()
            .unwrap()
            .to_string()
    };
    wait("/tmp/ready");
    assert_eq!(first_byte(&snap()), b'A');
    env.ok(&["exec", "mm", "--", "touch", "/tmp/go1"]);
    wait("/tmp/done1");
    assert_eq!(first_byte(&snap()), b'B', "written through a live mapping");
    env.ok(&["exec", "mm", "--", "touch", "/tmp/go2"]);
    wait("/tmp/done2");
    assert_eq!(
        first_byte(&snap()),
        b'C',
        "written through a mapping gone since"
    );
    assert_eq!(first_byte(&snap()), b'C');
    env.ok(&["rm", "-f", "mm"]);
}

/// `--rootfs DIR` replaces the host's root: the host's files are not there, the
/// rootfs is read-only, the workspace and /tmp are writable.
#[test]
fn a_rootfs_replaces_the_host_root() {
    if skipped_without_root() {
        return;
    }
    let env = crate::common::Env::new();
    let rootfs = env.tmp.path().join("rootfs");
    for d in [
        "bin",
        "lib/x86_64-linux-gnu",
        "lib64",
        "proc",
        "sys",
        "dev",
        "tmp",
        "workspace",
    ] {
        std::fs::create_dir_all(rootfs.join(d)).unwrap();
    }
    // A shell and what it links: enough for a root of its own.
    for (from, to) in [
        ("/bin/dash", "bin/sh"),
        (
            "/lib/x86_64-linux-gnu/libc.so.6",
            "lib/x86_64-linux-gnu/libc.so.6",
        ),
        ("/lib64/ld-linux-x86-64.so.2", "lib64/ld-linux-x86-64.so.2"),
    ] {
        if std::fs::copy(from, rootfs.join(to)).is_err() {
            tine_testkit::skip(&format!("{from} is not on this host"));
            return;
        }
    }
    env.ok(&[
        "run", "--name", "r", "--rootfs", rootfs.to_str().unwrap(), "--", "/bin/sh", "-c",
        "test -e /etc/passwd || echo no-host-etc; (echo x > /bin/y) 2>/dev/null || echo rootfs-read-only; \
         echo in > /workspace/w && echo ws-ok; echo t > /tmp/t && echo tmp-ok",
    ]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while env.json(&["ps"]).as_array().is_some_and(|a| !a.is_empty())
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(
        env.ok(&["logs", "r"]),
        "no-host-etc\nrootfs-read-only\nws-ok\ntmp-ok\n"
    );
    assert!(!rootfs.join("bin/y").exists() && !rootfs.join("workspace/w").exists());
    env.ok(&["rm", "r"]);
}

#[test]
fn sandboxes_cannot_see_the_repository_or_each_other() {
    if skipped_without_root() {
        return;
    }
    // Outside /tmp, which every sandbox replaces with its own.
    let env = crate::common::Env::in_dir(Path::new("/var/tmp"));
    env.write("proj/a.txt", b"shared\n");
    let proj = env.work().join("proj");
    let proj = proj.to_str().unwrap();
    let repo = env.work().join(".tine");
    let a = env.json(&[
        "run",
        "--name",
        "a",
        "--workspace",
        proj,
        "--",
        "sleep",
        "1000",
    ]);
    env.ok(&[
        "exec",
        "a",
        "--",
        "sh",
        "-c",
        "echo secret > /workspace/s.txt",
    ]);
    let a_ws = a["workspace"].as_str().unwrap().to_string();
    assert!(Path::new(&a_ws).join("s.txt").exists());
    env.ok(&[
        "run",
        "--name",
        "b",
        "--workspace",
        proj,
        "--",
        "sleep",
        "1000",
    ]);
    let script = format!(
        "cat /workspace/a.txt; ls -A {repo}; cat {a_ws}/s.txt 2>/dev/null || echo no-a; \
         test -e {repo}/tine.db || echo no-db; (touch {repo}/x) 2>/dev/null || echo ro",
        repo = repo.display()
    );
    let o = env.run(&["exec", "b", "--", "sh", "-c", &script]);
    assert_eq!(
        String::from_utf8_lossy(&o.stdout),
        "shared\nno-a\nno-db\nro\n",
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    // The host still sees everything.
    assert!(repo.join("tine.db").exists());
    env.ok(&["rm", "-f", "a"]);
    env.ok(&["rm", "-f", "b"]);
}

/// `fork --no-start` seeds the forks' workspaces through a mount of the
/// first one's overlay and leaves no mount behind: the forks are created,
/// not running, with the snapshot's files in their upper layers.
#[test]
fn forks_made_without_starting_hold_the_files_and_leave_no_mount() {
    if skipped_without_root() {
        return;
    }
    let env = crate::common::Env::new();
    env.ok(&["run", "--name", "src", "--", "sleep", "1000"]);
    env.ok(&[
        "exec",
        "src",
        "--",
        "sh",
        "-c",
        "echo seeded > /workspace/f",
    ]);
    env.ok(&["snapshot", "--sandbox", "src", "--tag", "s", "--files-only"]);
    let f = env.json(&["fork", "s", "-n", "2", "--name", "k", "--no-start"]);
    assert_eq!(f["started"], false, "{f}");
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    for k in ["k-1", "k-2"] {
        let v = env.wait_for(k, |v| v["state"] == "created");
        let id = v["id"].as_str().unwrap();
        let dir = env.work().join(".tine/sandboxes").join(id);
        assert!(
            !mounts.contains(&*dir.join("merged").to_string_lossy()),
            "{k}'s overlay is still mounted"
        );
        assert_eq!(
            std::fs::read_to_string(dir.join("upper/f")).unwrap(),
            "seeded\n"
        );
    }
    env.ok(&["rm", "-f", "k-1", "k-2", "src"]);
}

#[test]
fn restoring_a_snapshot_of_a_removed_sandbox_names_it_and_writes_nothing() {
    if skipped_without_root() {
        return;
    }
    let env = crate::common::Env::new();
    env.ok(&[
        "run",
        "--name",
        "gone",
        "--",
        "sh",
        "-c",
        "echo x > /workspace/f; sleep infinity",
    ]);
    env.wait_for("gone", |v| {
        v["workspace"]
            .as_str()
            .is_some_and(|w| std::path::Path::new(w).join("f").exists())
    });
    let snap = env.json(&["snapshot", "--sandbox", "gone", "--files-only"])["id"]
        .as_str()
        .unwrap()
        .to_string();
    env.ok(&["rm", "-f", "gone"]);
    let before: Vec<_> = std::fs::read_dir(env.work())
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    let o = env.run(&["restore", &snap]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(3), "{err}");
    assert!(
        err.contains("no longer exists") && err.contains("--to DIR"),
        "{err}"
    );
    let after: Vec<_> = std::fs::read_dir(env.work())
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(before, after, "nothing was written beside the repository");
    // --to still restores its files into a directory.
    let into = env.tmp.path().join("into");
    env.ok(&["restore", &snap, "--to", into.to_str().unwrap()]);
    assert_eq!(std::fs::read_to_string(into.join("f")).unwrap(), "x\n");
}
