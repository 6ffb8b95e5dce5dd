//! `tine attach`, end to end as root: a Python counter started outside
//! tine, attached with its working directory as its files, checkpointed,
//! rolled back in place (process and files, its PID kept), forked into
//! directories of their own, and let go; a Podman container's counter
//! rolled back in place under Podman.

use std::time::{Duration, Instant};

use crate::common::*;

const COUNTER: &str = "import os, time\nn = 0\nwhile True:\n    n += 1\n    with open('count.tmp', 'w') as f:\n        f.write(str(n))\n    os.rename('count.tmp', 'count')\n    time.sleep(0.05)\n";

fn count(dir: &std::path::Path) -> u64 {
    std::fs::read_to_string(dir.join("count"))
        .unwrap_or_default()
        .trim()
        .parse()
        .unwrap_or(0)
}

fn wait_count(dir: &std::path::Path, at_least: u64) -> u64 {
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let c = count(dir);
        if c >= at_least || Instant::now() > until {
            return c;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_process_started_outside_tine_is_attached_checkpointed_and_rolled_back_in_place() {
    if skipped_without_root() {
        return;
    }
    let env = Env::new();
    let dir = env.tmp.path().join("app");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("counter.py"), COUNTER).unwrap();
    // A child of this test, in its session and process group (not their
    // leader): its template and copies stay in them.
    let mut child = std::process::Command::new("python3")
        .arg("counter.py")
        .current_dir(&dir)
        .stdin(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    wait_count(&dir, 5);
    let v = env.json(&["attach", "--pid", &pid.to_string(), "--name", "ctr"]);
    assert_eq!(
        v["workspace"],
        dir.canonicalize().unwrap().to_str().unwrap()
    );
    assert_eq!(v["running"], true);

    let s = env.json(&["snapshot", "--sandbox", "ctr", "-m", "at n"]);
    assert_eq!(s["processes"], 1, "{s}");
    // The checkpoint's count, as its files hold it (read from a copy).
    let copy = env.tmp.path().join("copy");
    env.ok(&[
        "restore",
        s["id"].as_str().unwrap(),
        "--to",
        copy.to_str().unwrap(),
    ]);
    let at = count(&copy);
    assert!(at >= 5, "{at}");
    let later = wait_count(&dir, at + 20);
    assert!(later >= at + 20);
    std::fs::write(dir.join("junk"), "x").unwrap();

    let r = env.json(&["restore", s["id"].as_str().unwrap(), "--sandbox", "ctr"]);
    assert_eq!(r["processes"], 1, "{r}");
    // Rolled back in place: the same process, which never ended (its
    // parent, this test, saw nothing).
    assert_eq!(child.try_wait().unwrap(), None, "the rollback ended it");
    // Back at the checkpoint, and counting on from there.
    let back = count(&dir);
    assert!(
        back <= at + 5,
        "the count went on from {back}, the checkpoint was at {at}"
    );
    assert!(wait_count(&dir, back + 5) >= back + 5);
    assert!(!dir.join("junk").exists());
    let list = env.json(&["attach", "--list"]);
    assert_eq!(list[0]["running"], true, "{list}");
    assert_eq!(list[0]["pid"], pid, "{list}");

    // A second rollback to the same checkpoint: again from there.
    let r = env.json(&["restore", s["id"].as_str().unwrap(), "--sandbox", "ctr"]);
    assert_eq!(r["processes"], 1, "{r}");
    assert!(count(&dir) <= at + 5);
    assert_eq!(child.try_wait().unwrap(), None);

    // Forked: two copies from the checkpoint, each counting in its own copy
    // of the files, beside the original.
    let out = env.tmp.path().join("forks");
    let f = env.json(&[
        "fork",
        s["id"].as_str().unwrap(),
        "-n",
        "2",
        "--into",
        out.to_str().unwrap(),
    ]);
    let forks = f["forks"].as_array().unwrap();
    assert_eq!(forks.len(), 2, "{f}");
    let starts: Vec<u64> = (1..=2).map(|k| count(&out.join(k.to_string()))).collect();
    let mut fork_pids = Vec::new();
    for (k, fk) in forks.iter().enumerate() {
        assert_eq!(fk["name"], format!("ctr-{}", k + 1));
        let d = out.join((k + 1).to_string());
        let c0 = starts[k];
        assert!(
            c0 <= at + 5,
            "fork {k} starts at {c0}, the checkpoint was at {at}"
        );
        assert!(
            wait_count(&d, c0 + 5) >= c0 + 5,
            "fork {k} counts on in {d:?}"
        );
        fork_pids.push(fk["pid"].as_u64().unwrap());
    }
    // The original counts on in its own directory meanwhile.
    let o = count(&dir);
    assert!(wait_count(&dir, o + 3) >= o + 3);
    assert_eq!(env.json(&["attach", "--list"]).as_array().unwrap().len(), 3);
    // A fork into sandboxes is refused, naming what to give.
    let o = env.run(&["fork", s["id"].as_str().unwrap(), "-n", "1"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("give --into DIR"));
    for k in ["ctr-1", "ctr-2"] {
        env.ok(&["attach", "--detach", k]);
    }
    for p in fork_pids {
        let _ = std::process::Command::new("kill")
            .args(["-9", &p.to_string()])
            .status();
    }

    // Let go: the process runs on, no longer attached.
    let d = env.json(&["attach", "--detach", "ctr"]);
    assert_eq!(d["name"], "ctr");
    assert_eq!(env.json(&["attach", "--list"]), serde_json::json!([]));
    assert_eq!(d["pid"], pid);
    let c = count(&dir);
    assert!(wait_count(&dir, c + 3) >= c + 3);
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn attaching_what_cannot_be_attached_is_refused_naming_it() {
    if skipped_without_root() {
        return;
    }
    let env = Env::new();
    let o = env.run(&["attach", "--pid", "4194000"]);
    assert_eq!(o.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&o.stderr).contains("no running process 4194000"));
    // The host's init is named as such, not as missing.
    let o = env.run(&["attach", "--pid", "1"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("PID 1 is the host's init"), "{err}");
    // Its files must not be the whole root.
    let mut p = std::process::Command::new("sleep")
        .arg("30")
        .current_dir("/")
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let o = env.run(&["attach", "--pid", &p.id().to_string()]);
    let _ = p.kill();
    let _ = p.wait();
    assert!(String::from_utf8_lossy(&o.stderr).contains("give --workspace DIR"));
}

/// A container Podman runs, removed (with its image) when dropped.
struct Container<'a> {
    podman: &'a std::path::Path,
    name: String,
    image: String,
}

impl Drop for Container<'_> {
    fn drop(&mut self) {
        for args in [
            vec!["rm", "-f", "-t", "0", self.name.as_str()],
            vec!["rmi", "-f", self.image.as_str()],
        ] {
            let _ = std::process::Command::new(self.podman).args(&args).output();
        }
    }
}

/// A Python counter writing `/data/count` (replaced whole) and appending
/// to `/data/log`, in an image made of a few directories over the host's
/// `/usr` (mounted read-only), run by Podman with `--init` or without.
fn counter_container<'a>(
    env: &Env,
    podman: &'a std::path::Path,
    name: &str,
    init: bool,
) -> Container<'a> {
    let opts: &[&str] = if init { &["--init"] } else { &[] };
    container_running(
        env,
        podman,
        name,
        opts,
        &["/usr/bin/python3", "/data/counter.py"],
    )
}

/// [`counter_container`]'s image, running `cmd` with Podman's `opts`.
fn container_running<'a>(
    env: &Env,
    podman: &'a std::path::Path,
    name: &str,
    opts: &[&str],
    cmd: &[&str],
) -> Container<'a> {
    let root = env.tmp.path().join(format!("{name}-root"));
    for d in ["usr", "etc", "data", "tmp", "proc", "dev", "sys", "run"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    for l in ["bin", "lib", "lib64", "sbin"] {
        std::os::unix::fs::symlink(format!("usr/{l}"), root.join(l)).unwrap();
    }
    std::fs::write(root.join("etc/passwd"), "root:x:0:0::/root:/bin/sh\n").unwrap();
    std::fs::write(
        root.join("data/counter.py"),
        "import os, time\nn = 0\nwhile True:\n    n += 1\n    with open('/data/count.tmp', 'w') as f:\n        f.write(str(n))\n    os.rename('/data/count.tmp', '/data/count')\n    with open('/data/log', 'a') as f:\n        f.write(f'{n}\\n')\n    time.sleep(0.05)\n",
    )
    .unwrap();
    let tar = env.tmp.path().join(format!("{name}.tar"));
    let st = std::process::Command::new("tar")
        .arg("-C")
        .arg(&root)
        .arg("-cf")
        .arg(&tar)
        .arg(".")
        .status()
        .unwrap();
    assert!(st.success());
    let c = Container {
        podman,
        name: name.to_string(),
        image: format!("localhost/{name}:1"),
    };
    crate::images::podman_ok(podman, &["import", "-q", tar.to_str().unwrap(), &c.image]);
    let mut run = vec!["--runtime", "runc", "run", "-d", "--name", name];
    run.extend(opts);
    run.extend([
        "-v",
        "/usr:/usr:ro",
        "--ulimit",
        "nofile=1024:1024",
        "--ulimit",
        "nproc=4096:4096",
        &c.image,
    ]);
    run.extend(cmd);
    crate::images::podman_ok(podman, &run);
    c
}

/// `podman exec NAME ARGS`'s output, asserting it ran.
fn in_container(podman: &std::path::Path, name: &str, args: &[&str]) -> String {
    let mut all = vec!["exec", name];
    all.extend(args);
    crate::images::podman_ok(podman, &all)
}

/// The container's counter; read again while it is empty (the shell
/// truncates the file, then writes it).
fn container_count(podman: &std::path::Path, name: &str) -> u64 {
    let until = Instant::now() + Duration::from_secs(2);
    loop {
        let read = in_container(podman, name, &["cat", "/data/count"]);
        match read.trim().parse() {
            Ok(n) => return n,
            Err(e) if Instant::now() > until => panic!("count {read:?}: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

#[test]
fn a_podman_container_is_rolled_back_in_place_and_podman_runs_it_on() {
    if skipped_without_root() {
        return;
    }
    let Some(podman) = crate::images::podman() else {
        return;
    };
    let env = Env::new();
    for init in [false, true] {
        let name = format!("tine-attach-{}-{}", std::process::id(), init as u8);
        let c = counter_container(&env, &podman, &name, init);
        let inspect = |f: &str| {
            crate::images::podman_ok(&podman, &["inspect", "--format", f, &name])
                .trim()
                .to_string()
        };
        let first = inspect("{{.State.Pid}}");
        let until = Instant::now() + Duration::from_secs(20);
        while in_container(&podman, &name, &["cat", "/data/log"])
            .lines()
            .count()
            < 3
        {
            assert!(Instant::now() < until, "{name}'s counter never counted");
            std::thread::sleep(Duration::from_millis(50));
        }
        let v = env.json(&["attach", "--container", &name]);
        assert_eq!(v["container"], name.as_str(), "{v}");
        assert_eq!(
            v["workspace"],
            inspect("{{.GraphDriver.Data.MergedDir}}").as_str(),
            "its files are the container's root"
        );
        // The application: the first process, or --init's child.
        if init {
            assert_ne!(v["pid"].to_string(), first, "{v}");
        } else {
            assert_eq!(v["pid"].to_string(), first, "{v}");
        }
        let app = v["pid"].as_u64().unwrap();

        let s = env.json(&["snapshot", "--sandbox", &name, "-m", "at n"]);
        assert_eq!(s["processes"], 1, "{s}");
        let id = s["id"].as_str().unwrap().to_string();
        let copy = env.tmp.path().join(format!("{name}-copy"));
        env.ok(&["restore", &id, "--to", copy.to_str().unwrap()]);
        let at: u64 = std::fs::read_to_string(copy.join("data/count"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let log_at = std::fs::read_to_string(copy.join("data/log")).unwrap();
        assert_eq!(log_at.lines().last(), Some(at.to_string().as_str()));
        // The container goes on, and something in it writes a file.
        while container_count(&podman, &name) < at + 15 {
            std::thread::sleep(Duration::from_millis(50));
        }
        in_container(
            &podman,
            &name,
            &[
                "/usr/bin/python3",
                "-c",
                "open('/data/junk', 'w').write('x')",
            ],
        );

        for round in 0..2 {
            let r = env.json(&["restore", &id, "--sandbox", &name]);
            assert_eq!(r["processes"], 1, "{r}");
            // Back at the checkpoint, files and process, and on from there.
            let back = container_count(&podman, &name);
            assert!(back <= at + 12, "round {round}: {back}, checkpoint at {at}");
            let log = in_container(&podman, &name, &["cat", "/data/log"]);
            assert!(
                log.starts_with(&log_at),
                "round {round}: the log is not the checkpoint's"
            );
            let after: Vec<u64> = log[log_at.len()..]
                .lines()
                .map(|l| l.parse().unwrap())
                .collect();
            assert!(
                after.iter().zip(at + 1..).all(|(n, want)| *n == want),
                "round {round}: the log goes on from {at} as {after:?}"
            );
            let ls = in_container(&podman, &name, &["ls", "/data"]);
            assert!(!ls.contains("junk"), "round {round}: {ls}");
            // The same process, under Podman as before.
            assert_eq!(inspect("{{.State.Pid}}"), first);
            assert_eq!(inspect("{{.State.Status}}"), "running");
            let listed = env.json(&["attach", "--list"]);
            assert_eq!(listed[0]["pid"], app, "{listed}");
            let ps = crate::images::podman_ok(&podman, &["ps", "--format", "{{.Names}}"]);
            assert!(ps.lines().any(|l| l == name), "{ps}");
            let until = Instant::now() + Duration::from_secs(20);
            while container_count(&podman, &name) < back + 5 {
                assert!(Instant::now() < until, "round {round}: it stopped counting");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        // A fork would need a container of its own: refused, saying so.
        let o = env.run(&[
            "fork",
            &id,
            "-n",
            "1",
            "--into",
            env.tmp.path().join("f").to_str().unwrap(),
        ]);
        assert!(!o.status.success());
        assert!(
            String::from_utf8_lossy(&o.stderr).contains("a container of its own"),
            "{}",
            String::from_utf8_lossy(&o.stderr)
        );
        // Let go, it runs on under Podman, which stops it as ever.
        env.ok(&["attach", "--detach", &name]);
        let n = container_count(&podman, &name);
        while container_count(&podman, &name) < n + 3 {
            std::thread::sleep(Duration::from_millis(50));
        }
        crate::images::podman_ok(&podman, &["stop", "-t", "1", &name]);
        assert_eq!(inspect("{{.State.Status}}"), "exited");
        drop(c);
    }
    // What is not a running container is refused, naming it.
    let o = env.run(&["attach", "--container", "tine-no-such-container"]);
    assert_eq!(o.status.code(), Some(3), "{o:?}");
    assert!(String::from_utf8_lossy(&o.stderr).contains("tine-no-such-container"));
    let o = env.run(&["attach", "--container=-rm"]);
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    assert!(String::from_utf8_lossy(&o.stderr).contains("not a container name"));
}

/// The numbers a counter appended to `log`, one per line.
fn logged(text: &str) -> Vec<u64> {
    text.lines().filter_map(|l| l.trim().parse().ok()).collect()
}

#[test]
fn a_shell_running_commands_is_attached_as_a_tree_and_rolled_back_in_place() {
    if skipped_without_root() {
        return;
    }
    let env = Env::new();
    let dir = env.tmp.path().join("sh");
    std::fs::create_dir(&dir).unwrap();
    // A shell that runs a command between its writes: most of the time it
    // has a child (sleep), which ends and is replaced by another.
    let mut sh = std::process::Command::new("sh")
        .args([
            "-c",
            "n=0; while :; do n=$((n+1)); echo $n > count; echo $n >> log; sleep 0.3; done",
        ])
        .current_dir(&dir)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let pid = sh.id();
    wait_count(&dir, 2);
    env.json(&["attach", "--pid", &pid.to_string(), "--name", "sh"]);
    // Taken while its sleep runs (the tree is two processes).
    let until = Instant::now() + Duration::from_secs(20);
    let s = loop {
        let s = env.json(&["snapshot", "--sandbox", "sh"]);
        if s["processes"] == 2 || Instant::now() > until {
            break s;
        }
    };
    assert_eq!(s["processes"], 2, "{s}");
    let id = s["id"].as_str().unwrap().to_string();
    let copy = env.tmp.path().join("copy");
    env.ok(&["restore", &id, "--to", copy.to_str().unwrap()]);
    let at = count(&copy);
    let log_at = std::fs::read_to_string(copy.join("log")).unwrap();
    for round in 0..2 {
        // Its sleep ends and others run since.
        wait_count(&dir, at + 4);
        let r = env.json(&["restore", &id, "--sandbox", "sh"]);
        assert_eq!(r["processes"], 2, "{r}");
        assert_eq!(
            sh.try_wait().unwrap(),
            None,
            "round {round}: the shell ended"
        );
        assert_eq!(count(&dir), at, "round {round}");
        // Its sleep, made again under its PID, ends as it would have; the
        // shell waits for it and goes on counting from the checkpoint.
        wait_count(&dir, at + 3);
        let log = std::fs::read_to_string(dir.join("log")).unwrap();
        assert!(log.starts_with(&log_at), "round {round}");
        let all = logged(&log);
        assert_eq!(
            all,
            (1..=*all.last().unwrap()).collect::<Vec<_>>(),
            "round {round}: the log has gaps or repeats"
        );
        // The sleeps it started since the checkpoint were killed: it has
        // one child at most.
        let kids = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap();
        assert!(
            kids.split_whitespace().count() <= 1,
            "round {round}: {kids}"
        );
    }
    // A tree forks only in a sandbox: refused, saying why.
    let o = env.run(&[
        "fork",
        &id,
        "-n",
        "1",
        "--into",
        env.tmp.path().join("f").to_str().unwrap(),
    ]);
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("a tree of 2 processes"),
        "{o:?}"
    );
    env.ok(&["attach", "--detach", "sh"]);
    let c = count(&dir);
    assert!(wait_count(&dir, c + 2) >= c + 2);
    let _ = sh.kill();
    let _ = sh.wait();
}

#[test]
fn a_container_running_a_shell_loop_rolls_back_as_a_tree_given_the_capability() {
    if skipped_without_root() {
        return;
    }
    let Some(podman) = crate::images::podman() else {
        return;
    };
    let env = Env::new();
    let looped = [
        "/bin/sh",
        "-c",
        "n=0; while :; do n=$((n+1)); echo $n > /data/count; echo $n >> /data/log; sleep 0.3; done",
    ];
    for cap in [false, true] {
        let name = format!("tine-tree-{}-{}", std::process::id(), cap as u8);
        let opts: &[&str] = if cap {
            &["--cap-add", "CHECKPOINT_RESTORE"]
        } else {
            &[]
        };
        let c = container_running(&env, &podman, &name, opts, &looped);
        let until = Instant::now() + Duration::from_secs(20);
        while logged(&in_container(&podman, &name, &["cat", "/data/log"])).len() < 2 {
            assert!(Instant::now() < until, "{name} never counted");
            std::thread::sleep(Duration::from_millis(50));
        }
        env.json(&["attach", "--container", &name]);
        let until = Instant::now() + Duration::from_secs(20);
        let s = loop {
            let s = env.json(&["snapshot", "--sandbox", &name]);
            if s["processes"] == 2 || Instant::now() > until {
                break s;
            }
        };
        assert_eq!(s["processes"], 2, "{s}");
        let id = s["id"].as_str().unwrap().to_string();
        let copy = env.tmp.path().join(format!("{name}-copy"));
        env.ok(&["restore", &id, "--to", copy.to_str().unwrap()]);
        let at = logged(&std::fs::read_to_string(copy.join("data/log")).unwrap());
        // Its sleep ends since.
        while container_count(&podman, &name) < at.len() as u64 + 4 {
            std::thread::sleep(Duration::from_millis(50));
        }
        let o = env.run(&["restore", &id, "--sandbox", &name]);
        let before = logged(&in_container(&podman, &name, &["cat", "/data/log"]));
        if !cap {
            // Making its sleep again needs the capability, which Podman
            // does not give: refused before anything changed.
            let err = String::from_utf8_lossy(&o.stderr);
            assert!(!o.status.success());
            assert!(
                err.contains("CAP_CHECKPOINT_RESTORE") && err.contains("nothing was changed"),
                "{err}"
            );
            assert!(before.len() > at.len() + 3, "the files were not put back");
        } else {
            assert!(o.status.success(), "{o:?}");
            assert!(
                before.starts_with(&at) && before.len() <= at.len() + 1,
                "{before:?}, checkpoint {at:?}"
            );
        }
        // Either way it runs on under Podman, its log without gaps.
        let n = container_count(&podman, &name);
        let until = Instant::now() + Duration::from_secs(20);
        while container_count(&podman, &name) < n + 2 {
            assert!(Instant::now() < until, "{name} stopped counting");
            std::thread::sleep(Duration::from_millis(50));
        }
        let all = logged(&in_container(&podman, &name, &["cat", "/data/log"]));
        assert_eq!(all, (1..=*all.last().unwrap()).collect::<Vec<_>>());
        let ps = crate::images::podman_ok(&podman, &["ps", "--format", "{{.Names}}"]);
        assert!(ps.lines().any(|l| l == name), "{ps}");
        env.ok(&["attach", "--detach", &name]);
        drop(c);
    }
}
