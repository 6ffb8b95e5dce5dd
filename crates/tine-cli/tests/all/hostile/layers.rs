//! Names from images: a layer entry `.wh...` (a whiteout of `..`), `..`,
//! a way down through a link, a gzip bomb, an import killed half-way. Every
//! name goes through one validating type and every write through a
//! directory handle resolved beneath the import's staging root; imports
//! are bounded, hold the repository's lock only to store, and leave nothing
//! that `gc` cannot remove. Through the CLI and the daemon alike.

use std::path::{Path, PathBuf};

use serde_json::json;

use crate::common::{Env, skipped_without_root};
use crate::images::{archive, busybox_root, skipped_without_busybox};
use crate::serve::Server;

/// The repository's own entries, as a listing to compare before and after.
fn repo_listing(env: &Env) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(env.work().join(".tine"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        // (A daemon's socket and token come and go with it.)
        .filter(|n| n != "staging" && !n.starts_with("server."))
        .collect();
    v.sort();
    v
}

/// What is left in the staging directory (nothing, after any import).
fn staged(env: &Env) -> Vec<String> {
    std::fs::read_dir(env.work().join(".tine/staging"))
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// A one-layer OCI archive whose layer holds `dir`'s files.
fn layer_of(env: &Env, name: &str, fill: impl Fn(&Path)) -> PathBuf {
    let d = env.tmp.path().join(format!("src-{name}"));
    std::fs::create_dir_all(&d).unwrap();
    fill(&d);
    archive(
        &env.tmp.path().join(format!("{name}.tar")),
        name,
        json!({}),
        &[&d],
    )
}

#[test]
fn a_whiteout_of_dotdot_or_a_way_through_a_link_is_refused_and_the_repository_stays_whole() {
    if skipped_without_root() {
        return;
    }
    let env = Env::in_dir(Path::new("/var/tmp"));
    env.write("kept.txt", b"mine");
    env.ok(&["snapshot", "-m", "before", "--tag", "before"]);
    // A running sandbox: its base and upper layer are in the repository.
    env.ok(&[
        "run",
        "--name",
        "live",
        "--workspace",
        ".",
        "--",
        "sleep",
        "100000",
    ]);
    env.ok(&[
        "exec",
        "live",
        "--",
        "sh",
        "-c",
        "echo up > /workspace/upper.txt",
    ]);
    let before = repo_listing(&env);
    let wh = layer_of(&env, "wh", |d| {
        std::fs::write(d.join("ok.txt"), "x").unwrap();
        std::fs::write(d.join(".wh..."), "").unwrap();
    });
    let nested = layer_of(&env, "nested", |d| {
        std::fs::create_dir(d.join("sub")).unwrap();
        std::fs::write(d.join("sub/.wh.."), "").unwrap();
    });
    for (what, tar) in [("wh", &wh), ("nested", &nested)] {
        let o = env.run(&["image", "import", tar.to_str().unwrap(), "-t", what]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{what}: {err}");
        assert!(
            err.contains(".wh.") && err.contains("whiteout"),
            "{what}: {err}"
        );
        assert_eq!(repo_listing(&env), before, "{what}");
        assert!(staged(&env).is_empty(), "{what}: {:?}", staged(&env));
    }
    // The repository and the sandbox are as they were.
    env.ok(&["fsck"]);
    assert_eq!(
        env.ok(&[
            "exec",
            "live",
            "--",
            "cat",
            "/workspace/upper.txt",
            "/workspace/kept.txt"
        ]),
        "up\nmine"
    );
    env.ok(&["restore", "before", "--to", "restored"]);
    assert_eq!(
        std::fs::read(env.work().join("restored/kept.txt")).unwrap(),
        b"mine"
    );
    // Through the daemon (an import root holding the archive).
    let srv = Server::start(&env, &["--import-root", env.tmp.path().to_str().unwrap()]);
    let (code, body) = srv.call("POST", "/v1/images", Some(json!({"path": wh})));
    assert_eq!(code, 400, "{body}");
    assert!(body.to_string().contains(".wh..."), "{body}");
    assert_eq!(repo_listing(&env), before);
    drop(srv);
    // A second layer writing through a link the first made, to a host
    // directory (its tar names `x/planted` alone, as a hand-made one
    // would): refused, nothing written there.
    let host = env.tmp.path().join("host");
    std::fs::create_dir(&host).unwrap();
    let l1 = env.tmp.path().join("l1");
    std::fs::create_dir(&l1).unwrap();
    std::os::unix::fs::symlink(&host, l1.join("x")).unwrap();
    let l1_tar = env.tmp.path().join("l1.tar");
    tine_image::write::dir_layer(&l1, &l1_tar).unwrap();
    let l2 = env.tmp.path().join("l2");
    std::fs::create_dir_all(l2.join("x")).unwrap();
    std::fs::write(l2.join("x/planted"), "p").unwrap();
    let l2_tar = env.tmp.path().join("l2.tar");
    let made = std::process::Command::new("tar")
        .args([
            "-cf",
            l2_tar.to_str().unwrap(),
            "-C",
            l2.to_str().unwrap(),
            "x/planted",
        ])
        .status()
        .unwrap();
    assert!(made.success());
    let linked = env.tmp.path().join("linked.tar");
    tine_image::write::write_oci_archive(
        &linked,
        &tine_image::write::NewImage {
            name: Some("linked".into()),
            run: json!({}),
            layers: vec![l1_tar, l2_tar],
            history: vec![],
        },
    )
    .unwrap();
    let o = env.run(&["image", "import", linked.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("symbolic link"), "{err}");
    assert!(!host.join("planted").exists());
    assert!(staged(&env).is_empty());
    env.ok(&["rm", "-f", "live"]);
}

#[test]
fn a_layer_over_the_size_limit_stops_and_an_import_killed_half_way_is_cleaned_by_gc() {
    if skipped_without_root() {
        return;
    }
    let env = Env::in_dir(Path::new("/var/tmp"));
    // 128 MiB of bytes that are not zeros (a sparse file is now written
    // sparse, in no time), so that an import takes long enough to be killed.
    let big = layer_of(&env, "big", |d| {
        let block: Vec<u8> = (0..1u32 << 20)
            .map(|i| (i.wrapping_mul(2654435761) >> 24) as u8 | 1)
            .collect();
        let mut f = std::fs::File::create(d.join("data")).unwrap();
        for _ in 0..128 {
            std::io::Write::write_all(&mut f, &block).unwrap();
        }
    });
    let started = std::time::Instant::now();
    let o = env.run(&[
        "image",
        "import",
        big.to_str().unwrap(),
        "--max-size",
        "16M",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("16777216 bytes") && err.contains("limit"),
        "{err}"
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(30));
    assert!(staged(&env).is_empty(), "{:?}", staged(&env));
    assert!(env.json(&["image", "ls"]).as_array().unwrap().is_empty());
    // Killed while unpacking: its staging directory stays, held by nobody;
    // gc removes it (and gc itself never fails on it).
    let mut c = env.cmd(&["image", "import", big.to_str().unwrap()]);
    let mut child = c.spawn().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while staged(&env).iter().all(|n| !n.ends_with(".lock")) {
        assert!(
            std::time::Instant::now() < deadline,
            "no staging directory appeared"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        !staged(&env).is_empty(),
        "the import finished before it was killed"
    );
    let gc = env.json(&["gc"]);
    assert!(staged(&env).is_empty(), "{gc} left {:?}", staged(&env));
    let removed = gc["leftover_files_removed"].to_string();
    assert!(removed.contains("staging/import-"), "{gc}");
    env.ok(&["fsck"]);
}

#[test]
fn a_file_named_like_a_whiteout_never_reaches_an_image_layer() {
    if skipped_without_busybox() {
        return;
    }
    let env = Env::in_dir(Path::new("/var/tmp"));
    let root = env.tmp.path().join("bb");
    busybox_root(&root);
    let tar = archive(
        &env.tmp.path().join("bb.tar"),
        "bb",
        json!({"Cmd": ["/bin/sh"]}),
        &[&root],
    );
    env.ok(&["image", "import", tar.to_str().unwrap(), "-t", "bb"]);
    let ctx = env.tmp.path().join("ctx");
    std::fs::create_dir(&ctx).unwrap();
    std::fs::write(
        ctx.join("Dockerfile"),
        "FROM bb\nRUN touch /.wh... /srv/.wh.x\n",
    )
    .unwrap();
    // Refused when the build writes the step's layer, naming the file.
    let o = env.run(&["build", ctx.to_str().unwrap(), "-t", "wh"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains(".wh...") && err.contains("whiteout"), "{err}");
    let out = env.tmp.path().join("wh.oci.tar");
    assert!(
        !env.run(&["image", "export", "wh", "-o", out.to_str().unwrap()])
            .status
            .success()
    );
    assert!(!out.exists());
}
