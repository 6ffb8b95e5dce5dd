use crate::common::{Env, listing};

#[test]
fn the_main_job_through_the_cli() {
    let env = Env::new();
    env.write("src/main.rs", b"fn main() {}\n");
    env.write("notes.txt", b"one\ntwo\nthree\n");
    env.write("trace.jsonl", b"{\"role\":\"user\"}\n");
    let s1 = env.json(&[
        "snapshot",
        "-m",
        "first",
        "--tag",
        "base",
        "--attach",
        "chat=trace.jsonl",
    ]);
    let id1 = s1["id"].as_str().unwrap().to_string();
    assert_eq!(s1["stats"]["files"], 3);
    let before = listing(&env.work());

    env.write("notes.txt", b"one\nTWO\nthree\n");
    std::fs::remove_file(env.work().join("src/main.rs")).unwrap();
    env.write("new.txt", b"new\n");
    let s2 = env.json(&["snapshot", "-m", "second"]);
    assert_eq!(s2["parent"].as_str().unwrap(), id1);

    let log = env.json(&["log"]);
    assert_eq!(log.as_array().unwrap().len(), 2);
    assert_eq!(log[0]["message"], "second");
    assert!(env.ok(&["log", "--graph"]).contains("[base]"));

    let diff = env.ok(&["diff", "base", "-p"]);
    assert!(diff.contains("-two") && diff.contains("+TWO"), "{diff}");
    assert!(
        diff.contains("A  new.txt") && diff.contains("D  src/main.rs"),
        "{diff}"
    );
    let d = env.json(&["diff", "base", &s2["id"].as_str().unwrap()[..12]]);
    assert_eq!(d["changes"].as_array().unwrap().len(), 3);

    assert_eq!(
        env.ok(&["show", "base", "--attachment", "chat"]),
        "{\"role\":\"user\"}\n"
    );
    assert!(env.ok(&["show", &id1[..6]]).contains("attachment  chat"));

    let r = env.json(&["restore", "base"]);
    assert_eq!(
        (
            r["added"].as_u64(),
            r["modified"].as_u64(),
            r["deleted"].as_u64()
        ),
        (Some(1), Some(1), Some(1))
    );
    assert_eq!(listing(&env.work()), before);

    let forks = env.tmp.path().join("forks");
    let f = env.json(&["fork", "base", "-n", "3", "--into", forks.to_str().unwrap()]);
    assert_eq!(f["dirs"].as_array().unwrap().len(), 3);
    for i in 1..=3 {
        assert_eq!(listing(&forks.join(i.to_string())), before);
    }
    // Forks diverge independently.
    std::fs::write(forks.join("1/notes.txt"), b"fork one").unwrap();
    assert_eq!(
        std::fs::read(forks.join("2/notes.txt")).unwrap(),
        b"one\ntwo\nthree\n"
    );

    env.ok(&["tag", "v2", &s2["id"].as_str().unwrap()[..12]]);
    assert!(env.ok(&["tag"]).contains("v2"));
    let fsck = env.json(&["fsck"]);
    assert_eq!(fsck["damaged_objects"].as_array().unwrap().len(), 0);
}

#[test]
fn errors_are_clear_and_have_stable_exit_codes() {
    let env = Env::new();
    let o = env.run(&["show", "nosuchtag"]);
    assert_eq!(o.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&o.stderr).contains("no snapshot or tag named \"nosuchtag\""));
    let o = env.run(&["--json", "show", "nosuchtag"]);
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(doc["error"]["code"], "not_found");
    assert_eq!(env.run(&["init"]).status.code(), Some(4));
    let o = env.run(&["snapshot", "/definitely/not/here"]);
    assert_eq!(
        o.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(String::from_utf8_lossy(&o.stderr).contains("/definitely/not/here"));
    let o = env.run(&["snapshot", "--attach", "nofile"]);
    assert_eq!(o.status.code(), Some(2));
    let elsewhere = tempfile::tempdir().unwrap();
    let o = env
        .cmd(&["log"])
        .current_dir(elsewhere.path())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&o.stderr).contains("tine init"));
}

#[test]
fn gc_keep_last_and_fsck_on_damage() {
    let env = Env::new();
    for i in 0..5 {
        env.write(
            "f.txt",
            format!("version {i} {}", "x".repeat(200)).as_bytes(),
        );
        env.ok(&["snapshot", "-m", &format!("v{i}")]);
    }
    let g = env.json(&["gc", "--keep-last", "2", "--dry-run"]);
    assert_eq!(g["snapshots_removed"].as_array().unwrap().len(), 3);
    assert_eq!(env.json(&["log"]).as_array().unwrap().len(), 5);
    let g = env.json(&["gc", "--keep-last", "2", "--no-compact"]);
    assert_eq!(g["snapshots_removed"].as_array().unwrap().len(), 3);
    assert_eq!(g["packs_compacted"], 0);
    assert_eq!(env.json(&["log"]).as_array().unwrap().len(), 2);
    // The two fast packs left are compacted by a plain gc, once.
    assert_eq!(env.json(&["gc"])["packs_compacted"], 2);
    assert_eq!(env.json(&["gc"])["packs_rewritten"], 0);
    assert!(
        env.json(&["fsck"])["damaged_objects"]
            .as_array()
            .unwrap()
            .is_empty()
    );
    // Damage the first frame of every pack: fsck exits with the corruption code.
    for e in std::fs::read_dir(env.work().join(".tine/packs")).unwrap() {
        let p = e.unwrap().path();
        let mut b = std::fs::read(&p).unwrap();
        let mid = 16 + 2;
        b[mid] ^= 0xff;
        std::fs::write(&p, b).unwrap();
    }
    let o = env.run(&["fsck"]);
    assert_eq!(o.status.code(), Some(5));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("damaged object") && out.contains("repository is DAMAGED"),
        "{out}"
    );
}

#[test]
fn concurrent_writers_wait_for_each_other() {
    let env = Env::new();
    for i in 0..200 {
        env.write(&format!("d/f{i}"), format!("{i}").as_bytes());
    }
    let children: Vec<_> = (0..4)
        .map(|i| {
            env.cmd(&["snapshot", "-m", &format!("c{i}")])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    for mut c in children {
        assert!(c.wait().unwrap().success());
    }
    assert_eq!(env.json(&["log"]).as_array().unwrap().len(), 4);
    let f = env.json(&["fsck"]);
    assert!(
        f["damaged_objects"].as_array().unwrap().is_empty()
            && f["leftover_files"].as_array().unwrap().is_empty(),
        "{f}"
    );
    // Another process holds the lock: --no-wait fails at once; without it, tine waits.
    let held = std::fs::OpenOptions::new()
        .write(true)
        .open(env.work().join(".tine/write.lock"))
        .unwrap();
    held.lock().unwrap();
    let o = env.run(&["--no-wait", "snapshot"]);
    assert_eq!(o.status.code(), Some(7));
    assert!(String::from_utf8_lossy(&o.stderr).contains("locked by another tine process"));
    let mut waiter = env
        .cmd(&["snapshot", "-m", "waited"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(
        waiter.try_wait().unwrap().is_none(),
        "must wait for the lock"
    );
    held.unlock().unwrap();
    let out = waiter.wait_with_output().unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("waiting for the repository lock"));
}

#[test]
fn merge_into_a_running_sandbox_restores_its_files_to_the_result() {
    if crate::common::skipped_without_root() {
        return;
    }
    let env = Env::new();
    let lines: String = (1..=10).map(|i| format!("line {i}\n")).collect();
    env.write("a.txt", lines.as_bytes());
    env.ok(&["snapshot", "--tag", "base"]);
    let other = env.tmp.path().join("other");
    env.ok(&["restore", "base", "--to", other.to_str().unwrap()]);
    std::fs::write(other.join("a.txt"), lines.replace("line 9\n", "theirs 9\n")).unwrap();
    std::fs::write(other.join("new.txt"), "from theirs\n").unwrap();
    env.ok(&["snapshot", other.to_str().unwrap(), "--tag", "theirs"]);
    // The agent's sandbox works on from base; its edit becomes "ours".
    let sb = env.json(&[
        "run", "--name", "agent", "--from", "base", "--", "sleep", "infinity",
    ]);
    let id = sb["id"].as_str().unwrap().to_string();
    env.ok(&[
        "exec",
        &id,
        "--",
        "sh",
        "-c",
        "sed -i 's/line 2/ours 2/' /workspace/a.txt",
    ]);
    let ours = env.json(&["snapshot", "--sandbox", &id, "--files-only"]);
    let ours_id = ours["id"].as_str().unwrap().to_string();
    let v = env.json(&["merge", &ours_id, "theirs", "--sandbox", "agent"]);
    assert_eq!(v["conflicts"], serde_json::json!([]), "{v}");
    let a = env.ok(&["exec", &id, "--", "cat", "/workspace/a.txt"]);
    assert!(a.contains("ours 2") && a.contains("theirs 9"), "{a}");
    assert_eq!(
        env.ok(&["exec", &id, "--", "cat", "/workspace/new.txt"]),
        "from theirs\n"
    );
    let shown = env.json(&["show", v["snapshot"].as_str().unwrap()]);
    assert_eq!(shown["parents"].as_array().unwrap().len(), 2, "{shown}");
    // It still runs, and no scratch directory is left in the repository.
    assert_eq!(
        env.wait_for("agent", |v| v["state"] == "running")["state"],
        "running"
    );
    let left: Vec<_> = std::fs::read_dir(env.work().join(".tine"))
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("tmp-merge-"))
        .collect();
    assert!(left.is_empty());
    assert_eq!(
        env.run(&["merge", &ours_id, "theirs", "--sandbox", "nosuch"])
            .status
            .code(),
        Some(3)
    );
    assert_eq!(
        env.run(&["merge", &ours_id, "theirs"]).status.code(),
        Some(2)
    );
    env.ok(&["rm", "-f", &id]);
}

#[test]
fn merge_brings_two_branches_together_and_exits_11_on_conflicts() {
    let env = Env::new();
    let lines: String = (1..=10).map(|i| format!("line {i}\n")).collect();
    env.write("a.txt", lines.as_bytes());
    env.write("b.txt", b"bee\n");
    env.ok(&["snapshot", "--tag", "base"]);
    env.write("a.txt", lines.replace("line 2\n", "ours 2\n").as_bytes());
    env.ok(&["snapshot", "--tag", "ours"]);
    let other = env.tmp.path().join("other");
    env.ok(&["restore", "base", "--to", other.to_str().unwrap()]);
    std::fs::write(other.join("a.txt"), lines.replace("line 9\n", "theirs 9\n")).unwrap();
    std::fs::remove_file(other.join("b.txt")).unwrap();
    env.ok(&["snapshot", other.to_str().unwrap(), "--tag", "theirs"]);
    let out = env.tmp.path().join("merged");
    let v = env.json(&["merge", "ours", "theirs", "--into", out.to_str().unwrap()]);
    assert_eq!(v["conflicts"], serde_json::json!([]), "{v}");
    let a = std::fs::read_to_string(out.join("a.txt")).unwrap();
    assert!(a.contains("ours 2") && a.contains("theirs 9"), "{a}");
    assert!(!out.join("b.txt").exists());
    let shown = env.json(&["show", v["snapshot"].as_str().unwrap()]);
    assert_eq!(shown["parents"].as_array().unwrap().len(), 2, "{shown}");
    // Both change line 5: markers, a conflict listed, exit code 11.
    std::fs::write(other.join("a.txt"), lines.replace("line 5\n", "theirs 5\n")).unwrap();
    env.ok(&["snapshot", other.to_str().unwrap(), "--tag", "theirs2"]);
    env.write("a.txt", lines.replace("line 5\n", "ours 5\n").as_bytes());
    env.ok(&["snapshot", "--tag", "ours2"]);
    let out2 = env.tmp.path().join("merged2");
    let o = env.run(&[
        "--json",
        "merge",
        "ours2",
        "theirs2",
        "--into",
        out2.to_str().unwrap(),
    ]);
    assert_eq!(
        o.status.code(),
        Some(11),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        v["conflicts"],
        serde_json::json!([{"path": "a.txt", "kind": "content"}]),
        "{v}"
    );
    assert!(
        std::fs::read_to_string(out2.join("a.txt"))
            .unwrap()
            .contains("<<<<<<<")
    );
    // A target that is not empty is refused, untouched.
    let o = env.run(&["merge", "ours", "theirs", "--into", out.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(4));
    assert!(String::from_utf8_lossy(&o.stderr).contains("not empty"));
}

#[test]
fn the_ledger_rewinds_with_a_rollback_keeps_history_and_forks_inherit_it() {
    // Without root the sandbox runs unisolated; the ledger works the same.
    let env = Env::new();
    env.ok(&["run", "--name", "agent", "--", "sleep", "infinity"]);
    let append = |key: &str, n: u32| {
        env.json(&[
            "ledger",
            "append",
            "--sandbox",
            "agent",
            "--kind",
            "email",
            "--key",
            key,
            "--request",
            &format!("{{\"to\": \"x@y\", \"n\": {n}}}"),
            "--result",
            &format!("{{\"message_id\": \"m{n}\"}}"),
        ])
    };
    let e1 = append("welcome-mail", 1);
    assert_eq!(e1["request"]["n"], 1);
    env.ok(&[
        "snapshot",
        "--sandbox",
        "agent",
        "--files-only",
        "--tag",
        "before",
    ]);
    append("invoice-mail", 2);
    let found = env.json(&["ledger", "lookup", "--sandbox", "agent", "invoice-mail"]);
    assert_eq!(found["result"]["message_id"], "m2");
    env.ok(&["restore", "before", "--sandbox", "agent", "--files-only"]);
    // Before the snapshot: still a fact. After it, on the abandoned branch: not visible...
    let found = env.json(&["ledger", "lookup", "--sandbox", "agent", "welcome-mail"]);
    assert_eq!(found["result"]["message_id"], "m1");
    let o = env.run(&["ledger", "lookup", "--sandbox", "agent", "invoice-mail"]);
    assert_eq!(
        o.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let visible = env.json(&["ledger", "list", "--sandbox", "agent"]);
    assert_eq!(visible.as_array().unwrap().len(), 1, "{visible}");
    // ...but still listed as having happened.
    let all = env.json(&["ledger", "list", "--sandbox", "agent", "--all"]);
    let inv: Vec<_> = all
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["key"] == "invoice-mail")
        .collect();
    assert_eq!(inv.len(), 1, "{all}");
    assert_eq!(inv[0]["visible"], false);
    // A new effect grows from the rewound head.
    let e3 = append("retry-mail", 3);
    assert_eq!(e3["parent"], e1["id"]);
    // Forks inherit the ledger up to their snapshot.
    let f = env.json(&[
        "fork",
        "before",
        "-n",
        "1",
        "--name",
        "branch",
        "--files-only",
    ]);
    assert_eq!(f["sandboxes"].as_array().unwrap().len(), 1);
    assert_eq!(
        env.json(&["ledger", "lookup", "--sandbox", "branch-1", "welcome-mail"])["id"],
        e1["id"]
    );
    assert_eq!(
        env.run(&["ledger", "lookup", "--sandbox", "branch-1", "retry-mail"])
            .status
            .code(),
        Some(3)
    );
    let v = env.json(&["ledger", "verify"]);
    assert_eq!(v["verified"], 3);
    let o = env.run(&[
        "ledger",
        "append",
        "--sandbox",
        "agent",
        "--kind",
        "x",
        "--key",
        "k",
        "--request",
        "{bad",
        "--result",
        "{}",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("request is not valid JSON"));
    env.ok(&["rm", "-f", "branch-1", "agent"]);
}
