//! Container images as sandboxes, end to end as root: images made here from
//! Debian's busybox-static (and by `podman import`), imported, run, snapshot,
//! rolled back and forked; shared bases; damaged layers.

use std::path::{Path, PathBuf};

use crate::common::*;
use tine_image::write::{NewImage, dir_layer, write_oci_archive};

const BUSYBOX: &str = "/usr/bin/busybox";

/// A busybox root filesystem at `dir`: the static busybox, its applets as
/// links, a user `app` (1000) owning /srv and /etc.
pub(crate) fn busybox_root(dir: &Path) {
    for d in ["bin", "etc", "root", "srv"] {
        std::fs::create_dir_all(dir.join(d)).unwrap();
    }
    std::fs::copy(BUSYBOX, dir.join("bin/busybox")).unwrap();
    for a in [
        "sh", "ls", "cat", "echo", "sleep", "id", "pwd", "wc", "rm", "ps", "grep", "head",
    ] {
        std::os::unix::fs::symlink("busybox", dir.join("bin").join(a)).unwrap();
    }
    std::fs::write(
        dir.join("etc/passwd"),
        "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000::/srv:/bin/sh\n",
    )
    .unwrap();
    std::fs::write(dir.join("etc/group"), "root:x:0:\napp:x:1000:\n").unwrap();
    // Theirs too, so that the image's user can change the root's files.
    for p in ["srv", "etc", "etc/group"] {
        std::os::unix::fs::chown(dir.join(p), Some(1000), Some(1000)).unwrap();
    }
}

/// True (and says so) when this host cannot make busybox images.
pub(crate) fn skipped_without_busybox() -> bool {
    if skipped_without_root() {
        return true;
    }
    if !Path::new(BUSYBOX).exists() {
        return tine_testkit::skip("no /usr/bin/busybox (Debian's busybox-static)");
    }
    false
}

/// An OCI archive at `out` of the directories `layers` (lowest first).
pub(crate) fn archive(out: &Path, name: &str, run: serde_json::Value, layers: &[&Path]) -> PathBuf {
    let tars: Vec<PathBuf> = layers
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let t = out.with_extension(format!("layer{i}.tar"));
            dir_layer(d, &t).unwrap();
            t
        })
        .collect();
    write_oci_archive(
        out,
        &NewImage {
            name: Some(name.into()),
            run,
            layers: tars,
            history: vec![],
        },
    )
    .unwrap();
    out.to_path_buf()
}

/// Podman, if installed (else the test says it is skipped).
pub(crate) fn podman() -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join("podman"))
            .find(|p| p.is_file())
    });
    if found.is_none() {
        tine_testkit::skip("podman is not installed (Debian's podman)");
    }
    found
}

/// Runs `podman ARGS`, asserting it succeeded; its stdout.
pub(crate) fn podman_ok(podman: &Path, args: &[&str]) -> String {
    let o = std::process::Command::new(podman)
        .args(args)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "podman {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub(crate) fn exec(env: &Env, sb: &str, script: &str) -> String {
    env.ok(&["exec", sb, "--", "sh", "-c", script])
}

/// The counter's `echo $n > count` truncates before it writes, so a read
/// can fall between the two (also in a snapshot taken there): read again.
fn count(env: &Env, sb: &str) -> u64 {
    for _ in 0..50 {
        if let Ok(n) = exec(env, sb, "cat /srv/count").trim().parse() {
            return n;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    panic!("{sb}'s /srv/count stayed empty for 0.5 s");
}

#[test]
fn an_image_runs_as_a_sandbox_its_whole_root_snapshotted_rolled_back_and_forked() {
    if skipped_without_busybox() {
        return;
    }
    let env = Env::new();
    let root = env.tmp.path().join("root");
    busybox_root(&root);
    // A counter as the image's command, as its user, in its directory.
    let img = archive(
        &env.tmp.path().join("bb.tar"),
        "bb:1",
        serde_json::json!({
            "Cmd": ["sh", "-c", "n=0; while true; do n=$((n+1)); echo $n > count; sleep 0.05; done"],
            "Env": ["GREETING=hi"],
            "WorkingDir": "/srv",
            "User": "app",
        }),
        &[&root],
    );
    let out = env.json(&["image", "import", img.to_str().unwrap()]);
    assert_eq!(out["layers_applied"], 1, "{out}");
    assert_eq!(out["image"]["names"][0], "bb:1");
    env.ok(&["run", "--name", "b", "--image", "bb:1"]);
    // Where, as whom and with what the image says.
    assert_eq!(
        exec(&env, "b", "id -u; id -g; pwd; echo $GREETING $HOME; ls /"),
        "1000\n1000\n/srv\nhi /srv\nbin\ndev\netc\nproc\nroot\nsrv\nsys\ntmp\n"
    );
    // Nothing of the host's: no /usr, no repository, no host files.
    assert!(!exec(&env, "b", "ls / /usr 2>&1; true").contains("lib"));
    while count(&env, "b") < 3 {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let snap = env.json(&["snapshot", "--sandbox", "b", "-m", "before"]);
    let id = snap["id"].as_str().unwrap().to_string();
    let at = count(&env, "b");
    // Changes anywhere in the root: /etc, /srv, a new top-level directory.
    exec(
        &env,
        "b",
        "echo changed > /srv/note; rm /etc/group; echo new > /etc/motd",
    );
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(count(&env, "b") > at + 2);
    let r = env.json(&["restore", "--sandbox", "b", &id]);
    assert!(r["processes"].as_u64().unwrap() >= 1, "{r}");
    assert_eq!(
        exec(
            &env,
            "b",
            "ls /srv/note /etc/motd 2>&1; cat /etc/group | head -1"
        ),
        "ls: /srv/note: No such file or directory\nls: /etc/motd: No such file or directory\nroot:x:0:\n"
    );
    // The counter goes on from where the snapshot held it.
    let back = count(&env, "b");
    assert!(back <= at + 3, "counted {back}, snapshot at {at}");
    // Forks: natively, each with its own root, going on from the snapshot.
    let forked = env.json(&["fork", &id, "-n", "2", "--name", "f"]);
    assert_eq!(forked["via"], "native", "{forked}");
    exec(&env, "f-1", "echo one > /srv/mine");
    assert_eq!(exec(&env, "f-1", "cat /srv/mine; id -u"), "one\n1000\n");
    assert_eq!(
        exec(&env, "f-2", "ls /srv/mine 2>&1; true"),
        "ls: /srv/mine: No such file or directory\n"
    );
    assert_eq!(
        exec(&env, "b", "ls /srv/mine 2>&1; true"),
        "ls: /srv/mine: No such file or directory\n"
    );
    for f in ["f-1", "f-2"] {
        let c0 = count(&env, f);
        assert!(c0 <= at + 40, "{f} counted {c0}, snapshot at {at}");
        std::thread::sleep(std::time::Duration::from_millis(300));
        assert!(count(&env, f) > c0, "{f}'s counter runs on");
    }
    // The files API takes the image's paths.
    let ls = env.json(&["image", "show", "bb:1"]);
    assert_eq!(ls["workdir"], "/srv");
}

#[test]
fn two_images_sharing_a_base_share_its_snapshot_and_storage() {
    if skipped_without_busybox() {
        return;
    }
    let env = Env::new();
    let base = env.tmp.path().join("base");
    busybox_root(&base);
    let (a, b) = (env.tmp.path().join("a"), env.tmp.path().join("b"));
    for (d, name) in [(&a, "a.txt"), (&b, "b.txt")] {
        std::fs::create_dir_all(d.join("srv")).unwrap();
        std::fs::write(d.join("srv").join(name), name.repeat(100)).unwrap();
    }
    let run = serde_json::json!({"Cmd": ["sleep", "1000"]});
    let ia = archive(
        &env.tmp.path().join("a.tar"),
        "a",
        run.clone(),
        &[&base, &a],
    );
    let ib = archive(&env.tmp.path().join("b.tar"), "b", run, &[&base, &b]);
    let first = env.json(&["image", "import", ia.to_str().unwrap()]);
    let second = env.json(&["image", "import", ib.to_str().unwrap()]);
    let (sa, sb) = (
        first["stored_bytes"].as_u64().unwrap(),
        second["stored_bytes"].as_u64().unwrap(),
    );
    println!("image a stored {sa} bytes; image b, on the same base, {sb} bytes");
    assert_eq!(first["layers_applied"], 2);
    assert_eq!(second["layers_reused"], 1, "{second}");
    assert_eq!(second["layers_applied"], 1);
    // The base (busybox, ~1 MB compressed) is stored once.
    assert!(sb * 10 < sa, "b stored {sb} bytes against a's {sa}");
    // Both layer chains start at the same snapshot.
    let log = env.json(&["log"]);
    let layer1: Vec<&serde_json::Value> = log
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["message"].as_str().unwrap_or("").contains("layer 1/2"))
        .collect();
    assert_eq!(layer1.len(), 1, "{log}");
    // Each runs with its own top layer.
    env.ok(&["run", "--name", "sa", "--image", "a"]);
    env.ok(&["run", "--name", "sb", "--image", "b"]);
    assert_eq!(exec(&env, "sa", "ls /srv"), "a.txt\n");
    assert_eq!(exec(&env, "sb", "ls /srv"), "b.txt\n");
    // Removing one keeps the base for the other.
    env.ok(&["rm", "-f", "sa"]);
    env.ok(&["image", "rm", "a"]);
    let left = env.json(&["image", "ls"]);
    assert_eq!(left.as_array().unwrap().len(), 1, "{left}");
    env.ok(&["run", "--name", "sb2", "--image", "b"]);
    assert_eq!(
        exec(&env, "sb2", "ls /srv; cat /etc/group | head -1"),
        "b.txt\nroot:x:0:\n"
    );
}

#[test]
fn a_corrupted_layer_is_refused_with_its_digest_named_and_nothing_imported() {
    if skipped_without_busybox() {
        return;
    }
    let env = Env::new();
    let root = env.tmp.path().join("root");
    busybox_root(&root);
    std::fs::write(root.join("srv/marker"), "MARKER-0123456789").unwrap();
    let img = archive(
        &env.tmp.path().join("bad.tar"),
        "bad",
        serde_json::json!({}),
        &[&root],
    );
    let layer_digest = tine_image::write::digest_file(&img.with_extension("layer0.tar")).unwrap();
    let mut bytes = std::fs::read(&img).unwrap();
    let at = bytes
        .windows(17)
        .position(|w| w == b"MARKER-0123456789")
        .unwrap();
    bytes[at] = b'N';
    std::fs::write(&img, &bytes).unwrap();
    let o = env.run(&["image", "import", img.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(5), "corrupt exits 5: {err}");
    assert!(err.contains(layer_digest.as_str()), "{err}");
    let ls = env.json(&["image", "ls"]);
    assert_eq!(ls, serde_json::json!([]));
    // No scratch directory is left in the repository.
    let left: Vec<_> = std::fs::read_dir(env.work().join(".tine"))
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("tmp-image-"))
        .collect();
    assert!(left.is_empty());
}

#[test]
fn an_image_podman_made_runs_from_its_store_and_from_a_saved_archive() {
    if skipped_without_busybox() {
        return;
    }
    let Some(podman) = podman() else {
        return;
    };
    let env = Env::new();
    let root = env.tmp.path().join("root");
    busybox_root(&root);
    let tar = env.tmp.path().join("root.tar");
    dir_layer(&root, &tar).unwrap();
    let name = format!("localhost/tine-test-{}", std::process::id());
    let run = |args: &[&str]| {
        podman_ok(&podman, args);
    };
    run(&[
        "import",
        "--change",
        "CMD [\"sleep\", \"1000\"]",
        "--change",
        "WORKDIR /srv",
        tar.to_str().unwrap(),
        &name,
    ]);
    // Straight from Podman's local store.
    let from_store = env.json(&["image", "import", "--podman", &name]);
    assert_eq!(from_store["image"]["source"], format!("podman:{name}"));
    assert_eq!(from_store["image"]["names"][0], format!("{name}:latest"));
    let missing = env.run(&[
        "image",
        "import",
        "--podman",
        "localhost/no-such-image-here",
    ]);
    assert_eq!(missing.status.code(), Some(3), "{missing:?}");
    assert!(String::from_utf8_lossy(&missing.stderr).contains("no-such-image-here"));
    let saved = env.tmp.path().join("saved.tar");
    run(&[
        "save",
        "--format",
        "docker-archive",
        "-o",
        saved.to_str().unwrap(),
        &name,
    ]);
    run(&["rmi", &name]);
    let out = env.json(&["image", "import", saved.to_str().unwrap()]);
    assert_eq!(out["image"]["names"][0], format!("{name}:latest"));
    // The same layer as from the store: reused.
    assert_eq!(out["layers_reused"], 1, "{out}");
    env.ok(&["run", "--name", "p", "--image", &name]);
    assert_eq!(
        exec(&env, "p", "pwd; cat /etc/passwd | head -1"),
        "/srv\nroot:x:0:0:root:/root:/bin/sh\n"
    );
}
