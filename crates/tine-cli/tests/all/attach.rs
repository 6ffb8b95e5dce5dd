//! `tine attach --pid`, end to end as root: a Python counter started outside
//! tine, attached with its working directory as its files, checkpointed,
//! rolled back in place (process and files), forked into directories of
//! their own, and let go.

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
    // The original is gone, killed by the rollback: reap it.
    let _ = child.wait();
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
    let now = list[0]["pid"].as_u64().unwrap() as u32;
    assert!(std::path::Path::new(&format!("/proc/{now}")).exists());

    // A second rollback to the same checkpoint: again from there.
    let r = env.json(&["restore", s["id"].as_str().unwrap(), "--sandbox", "ctr"]);
    assert_eq!(r["processes"], 1, "{r}");
    assert!(count(&dir) <= at + 5);

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
    let pid_now = d["pid"].as_u64().unwrap() as i32;
    let c = count(&dir);
    assert!(wait_count(&dir, c + 3) >= c + 3);
    let _ = std::process::Command::new("kill")
        .args(["-9", &pid_now.to_string()])
        .status();
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
    // A process with children: not yet.
    let mut sh = std::process::Command::new("sh")
        .args(["-c", "sleep 30 & wait"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let o = env.run(&[
        "attach",
        "--pid",
        &sh.id().to_string(),
        "--workspace",
        env.work().to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    let kids = std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", sh.id()))
        .unwrap_or_default();
    for k in kids.split_whitespace() {
        let _ = std::process::Command::new("kill").args(["-9", k]).status();
    }
    let _ = sh.kill();
    let _ = sh.wait();
    assert!(
        !o.status.success() && err.contains("has child processes"),
        "{err}"
    );
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
