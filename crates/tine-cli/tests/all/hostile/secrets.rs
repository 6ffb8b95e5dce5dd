//! Secrets given to a sandbox (`tine run -e`, the API's `env`, an image's
//! `Env`) never appear on any host process's command line, which every host
//! user reads with `ps`: a sandbox's init takes its spec from a memory file.
//! A variable too large for the kernel to pass to a program is named as
//! such, not as an init that "ended before setting it up".

use std::path::Path;

use serde_json::json;

use crate::common::{Env, skipped_without_root};
use crate::images::{archive, busybox_root, skipped_without_busybox};
use crate::serve::Server;

/// Every host process whose command line holds `needle`.
fn argv_holding(needle: &str) -> Vec<String> {
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        if !e
            .file_name()
            .to_string_lossy()
            .bytes()
            .all(|b| b.is_ascii_digit())
        {
            continue;
        }
        if let Ok(c) = std::fs::read(e.path().join("cmdline"))
            && String::from_utf8_lossy(&c).contains(needle)
        {
            found.push(String::from_utf8_lossy(&c).replace('\0', " "));
        }
    }
    found
}

#[test]
fn secrets_given_to_a_sandbox_are_on_no_command_line() {
    if skipped_without_root() {
        return;
    }
    let env = Env::in_dir(Path::new("/var/tmp"));
    // Assembled here, so that this test's own command line holds none.
    let cli_secret = format!("sk-{}-cli", "S3CR3T");
    let api_secret = format!("sk-{}-api", "S3CR3T");
    let kv = format!("OPENAI_API_KEY={cli_secret}");
    env.ok(&["run", "--name", "s", "-e", &kv, "--", "sleep", "100000"]);
    let srv = Server::start(&env, &[]);
    srv.expect(
        201,
        "POST",
        "/v1/sandboxes",
        Some(json!({"name": "a", "env": {"OPENAI_API_KEY": api_secret}, "command": ["sleep", "100000"]})),
    );
    // A fork and a rollback start inits too.
    let snap = env.json(&["snapshot", "--sandbox", "s"]);
    env.ok(&[
        "fork",
        snap["id"].as_str().unwrap(),
        "-n",
        "1",
        "--name",
        "sf",
    ]);
    env.ok(&["restore", snap["id"].as_str().unwrap()]);
    for (sb, secret) in [
        ("s", &cli_secret),
        ("a", &api_secret),
        ("sf-1", &cli_secret),
    ] {
        let seen = env.ok(&["exec", sb, "--", "sh", "-c", "echo $OPENAI_API_KEY"]);
        assert_eq!(seen.trim(), secret.as_str(), "{sb}");
    }
    let held = argv_holding("S3CR3T");
    assert!(held.is_empty(), "on a command line: {held:?}");
    // Nor the repository's path in an init's.
    let repo = env.work().join(".tine");
    let inits: Vec<String> = argv_holding("__sandbox-init")
        .into_iter()
        .filter(|a| a.contains(repo.to_str().unwrap()))
        .collect();
    assert!(inits.is_empty(), "{inits:?}");
    // A variable over the kernel's 128 KiB per string, but one the init
    // once could not take either: 120,000 bytes run.
    let big = "x".repeat(120_000);
    srv.expect(
        201,
        "POST",
        "/v1/sandboxes",
        Some(json!({"name": "big", "env": {"BIG": big}, "command": ["sleep", "100000"]})),
    );
    let n = env.ok(&[
        "exec",
        "big",
        "--",
        "sh",
        "-c",
        "printf %s \"$BIG\" | wc -c",
    ]);
    assert_eq!(n.trim(), "120000");
    drop(srv);
    env.ok(&["rm", "-f", "s", "a", "sf-1", "big"]);
}

#[test]
fn an_image_env_too_large_to_pass_is_named_as_such() {
    if skipped_without_busybox() {
        return;
    }
    let env = Env::in_dir(Path::new("/var/tmp"));
    let root = env.tmp.path().join("bb");
    busybox_root(&root);
    let huge = format!("HUGE={}", "y".repeat(3 << 20));
    let tar = archive(
        &env.tmp.path().join("bb.tar"),
        "bb",
        json!({"Cmd": ["/bin/sh", "-c", "sleep 100000"], "Env": [huge]}),
        &[&root],
    );
    env.ok(&["image", "import", tar.to_str().unwrap(), "-t", "bb"]);
    let o = env.run(&["run", "--name", "h", "--image", "bb"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("Argument list too long") || err.contains("too long"),
        "{err}"
    );
    assert!(!err.contains("ended before setting it up"), "{err}");
}
