//! `tine build` and `tine image export` end to end as root: a Dockerfile
//! over a busybox image (Debian's busybox-static), its steps as snapshots
//! with the build cache reusing an unchanged prefix, a failing step, a copy
//! out of the context, and the exported archive loaded and run by Podman.

use std::path::Path;

use crate::common::*;
use crate::images::{archive, busybox_root, podman, podman_ok, skipped_without_busybox};

/// A repository with the busybox image `bb` imported, and a build context.
fn with_busybox(env: &Env) -> std::path::PathBuf {
    let root = env.tmp.path().join("root");
    busybox_root(&root);
    let a = archive(
        &env.tmp.path().join("bb.tar"),
        "bb",
        serde_json::json!({}),
        &[&root],
    );
    env.ok(&["image", "import", a.to_str().unwrap()]);
    let ctx = env.tmp.path().join("ctx");
    std::fs::create_dir(&ctx).unwrap();
    ctx
}

fn dockerfile(ctx: &Path, last: &str) {
    std::fs::write(
        ctx.join("Dockerfile"),
        format!(
            "FROM bb\n\
             ENV GREETING=hello\n\
             WORKDIR /srv/app\n\
             COPY app.sh lib ./\n\
             # a slow step: what the cache saves\n\
             RUN sleep 1 && sh app.sh > out.txt \\\n  && rm /bin/wc\n\
             {last}\n\
             CMD [\"sh\", \"-c\", \"cat out.txt version lib.txt; ls /bin/wc 2>&1; id -u\"]\n"
        ),
    )
    .unwrap();
}

/// Runs image `image` as sandbox `name` until its command exits: its last
/// view and its output.
fn run_to_end(env: &Env, name: &str, image: &str) -> (serde_json::Value, String) {
    env.ok(&["run", "--name", name, "--image", image]);
    let v = env.wait_for(name, |v| v["state"] == "exited");
    (v, env.ok(&["logs", name]))
}

fn parents(env: &Env, snap: &str) -> Vec<String> {
    env.json(&["show", snap])["parents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap().to_string())
        .collect()
}

#[test]
fn a_dockerfile_builds_its_changed_last_step_alone_is_rebuilt_and_its_export_runs_under_podman() {
    if skipped_without_busybox() {
        return;
    }
    let Some(podman) = podman() else { return };
    let env = Env::new();
    let ctx = with_busybox(&env);
    std::fs::write(ctx.join("app.sh"), "echo \"$GREETING from $(pwd)\"\n").unwrap();
    std::fs::create_dir(ctx.join("lib")).unwrap();
    std::fs::write(ctx.join("lib/lib.txt"), "lib\n").unwrap();
    dockerfile(&ctx, "RUN echo v1 > version");
    let c = ctx.to_str().unwrap();

    let first = env.json(&["build", "-q", "-t", "app", c]);
    let steps = first["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 7, "{first}");
    // WORKDIR (its directory made), COPY and both RUNs change files.
    assert_eq!(first["run"], 4, "{first}");
    assert_eq!(first["cached"], 0);
    // Each step that changes files is a snapshot whose parent is the one before.
    let snaps: Vec<String> = steps
        .iter()
        .filter_map(|s| s["snapshot"].as_str().map(str::to_string))
        .collect();
    assert_eq!(snaps.len(), 5, "FROM and four steps: {first}");
    for w in snaps.windows(2) {
        assert_eq!(parents(&env, &w[1]), vec![w[0].clone()]);
    }

    // Only the last step changed: it alone runs, on the cached step before.
    dockerfile(&ctx, "RUN echo v2 > version");
    let second = env.json(&["build", "-q", "-t", "app", c]);
    assert_eq!(second["run"], 1, "{second}");
    assert_eq!(second["cached"], 3, "{second}");
    let s2 = second["steps"].as_array().unwrap();
    for (a, b) in steps.iter().zip(s2).take(5) {
        assert_eq!(a["snapshot"], b["snapshot"], "{a} {b}");
    }
    assert_eq!(s2[5]["cached"], false);
    assert_ne!(s2[5]["snapshot"], steps[5]["snapshot"]);
    let last = s2[5]["snapshot"].as_str().unwrap();
    assert_eq!(parents(&env, last), vec![snaps[3].clone()]);
    eprintln!(
        "measured: first build {:.2} s (4 steps run), rebuild with the last step changed {:.2} s (1 run, 3 cached)",
        first["seconds"].as_f64().unwrap(),
        second["seconds"].as_f64().unwrap()
    );

    // The image runs as a sandbox: its command, its files.
    let (v, out) = run_to_end(&env, "a", "app");
    assert_eq!(v["exit"]["code"], 0, "{v}");
    let want = "hello from /srv/app\nv2\nlib\nls: /bin/wc: No such file or directory\n0\n";
    assert_eq!(out, want);

    // Exported, loaded by Podman and run there alike.
    let tar = env.tmp.path().join("app.tar");
    let exported = env.json(&["image", "export", "app", "-o", tar.to_str().unwrap()]);
    assert_eq!(exported["layers"], 5, "{exported}");
    let name = format!("localhost/tine-build-{}", std::process::id());
    let pm = |args: &[&str]| podman_ok(&podman, args);
    let loaded = pm(&["load", "-q", "-i", tar.to_str().unwrap()]);
    assert!(loaded.contains("localhost/app"), "{loaded}");
    pm(&["tag", "localhost/app:latest", &name]);
    let id = pm(&["image", "inspect", "--format", "{{.Id}}", &name]);
    assert_eq!(
        id.trim(),
        exported["id"]
            .as_str()
            .unwrap()
            .trim_start_matches("sha256:")
    );
    let ran = pm(&[
        "run",
        "--rm",
        "--runtime",
        "runc",
        "--ulimit",
        "nofile=1024:1024",
        "--ulimit",
        "nproc=4096:4096",
        &name,
    ]);
    let _ = std::process::Command::new(&podman)
        .args(["rmi", "-f", &name, "localhost/app:latest"])
        .output();
    assert_eq!(ran, want);
}

#[test]
fn a_failing_step_is_named_with_its_output_and_leaves_nothing_behind() {
    if skipped_without_busybox() {
        return;
    }
    let env = Env::new();
    let ctx = with_busybox(&env);
    let c = ctx.to_str().unwrap();
    std::fs::write(
        ctx.join("Dockerfile"),
        "FROM bb\nRUN echo before > /srv/x\nRUN echo oops; exit 3\n",
    )
    .unwrap();
    let o = env.run(&["build", c]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("step 3 (RUN echo oops; exit 3): the command exited with 3")
            && err.contains("oops"),
        "{err}"
    );
    // No sandbox, scratch directory or image is left; the good step is cached.
    assert_eq!(env.json(&["ps", "--all"]), serde_json::json!([]));
    assert_eq!(env.json(&["image", "ls"]).as_array().unwrap().len(), 1);
    let left: Vec<_> = std::fs::read_dir(env.work().join(".tine"))
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("tmp-"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    std::fs::write(
        ctx.join("Dockerfile"),
        "FROM bb\nRUN echo before > /srv/x\nRUN echo fixed\n",
    )
    .unwrap();
    let b = env.json(&["build", "-q", c]);
    assert_eq!(
        (b["run"].as_u64(), b["cached"].as_u64()),
        (Some(1), Some(1)),
        "{b}"
    );

    // A source that leads out of the context is refused, naming it.
    std::os::unix::fs::symlink("/etc", ctx.join("etc")).unwrap();
    std::fs::write(ctx.join("Dockerfile"), "FROM bb\nCOPY etc/passwd /x\n").unwrap();
    let o = env.run(&["build", c]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("etc/passwd leads outside the build context"),
        "{err}"
    );
    // An instruction tine does not run: its line named.
    std::fs::write(ctx.join("Dockerfile"), "FROM bb\n\nSHELL [\"/bin/bash\"]\n").unwrap();
    let err = String::from_utf8_lossy(&env.run(&["build", c]).stderr).into_owned();
    assert!(err.contains("line 3: SHELL is not supported"), "{err}");
}

#[test]
fn build_arguments_reach_from_and_run_change_the_key_and_stay_out_of_the_image() {
    if skipped_without_busybox() {
        return;
    }
    let env = Env::new();
    let ctx = with_busybox(&env);
    let c = ctx.to_str().unwrap();
    std::fs::write(
        ctx.join("Dockerfile"),
        "ARG BASE=bb\nFROM $BASE\nARG GREETING=hi\nRUN echo \"$GREETING\" > /srv/g\nCMD [\"cat\", \"/srv/g\"]\n",
    )
    .unwrap();
    let a = env.json(&["build", "-q", "-t", "a", c]);
    assert_eq!(a["run"], 1, "{a}");
    let b = env.json(&["build", "-q", "-t", "b", "--build-arg", "GREETING=yo", c]);
    // Another value: another key, run again.
    assert_eq!(
        (b["run"].as_u64(), b["cached"].as_u64()),
        (Some(1), Some(0)),
        "{b}"
    );
    for (img, want) in [("a", "hi\n"), ("b", "yo\n")] {
        let (v, out) = run_to_end(&env, img, img);
        assert_eq!(v["exit"]["code"], 0, "{v}");
        assert_eq!(out, want);
        // An argument is the build's, not the image's environment.
        let shown = env.json(&["image", "show", img]);
        assert!(!shown["env"].to_string().contains("GREETING"), "{shown}");
    }
    // The same value again: from the cache.
    let again = env.json(&["build", "-q", "--build-arg", "GREETING=yo", c]);
    assert_eq!(again["cached"], 1, "{again}");
    let o = env.run(&["build", "--build-arg", "NOEQUALS", c]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("give NAME=VALUE"));
}

#[test]
fn what_the_dockerignore_leaves_out_is_never_copied() {
    if skipped_without_busybox() {
        return;
    }
    let env = Env::new();
    let ctx = with_busybox(&env);
    let c = ctx.to_str().unwrap();
    for (f, body) in [
        (".dockerignore", "secret\n**/*.log\n"),
        ("secret", "token\n"),
        ("keep.txt", "kept\n"),
        ("logs/a.log", "noise\n"),
        ("logs/b.txt", "b\n"),
    ] {
        std::fs::create_dir_all(ctx.join(f).parent().unwrap()).unwrap();
        std::fs::write(ctx.join(f), body).unwrap();
    }
    std::fs::write(
        ctx.join("Dockerfile"),
        "FROM bb\nCOPY . /srv/ctx/\nCMD [\"sh\", \"-c\", \"cd /srv/ctx && ls -a . logs\"]\n",
    )
    .unwrap();
    let b = env.json(&["build", "-q", "-t", "ign", c]);
    assert_eq!(b["run"], 1, "{b}");
    let (_, listed) = run_to_end(&env, "i", "ign");
    assert!(
        listed.contains("keep.txt") && listed.contains("b.txt"),
        "{listed}"
    );
    assert!(
        !listed.contains("secret") && !listed.contains("a.log"),
        "{listed}"
    );
    // Changing a file it leaves out changes nothing: the step is cached.
    std::fs::write(ctx.join("secret"), "another\n").unwrap();
    assert_eq!(env.json(&["build", "-q", c])["cached"], 1);
    // Named on its own: refused, saying why.
    std::fs::write(ctx.join("Dockerfile"), "FROM bb\nCOPY secret /x\n").unwrap();
    let err = String::from_utf8_lossy(&env.run(&["build", c]).stderr).into_owned();
    assert!(
        err.contains("secret: the context's .dockerignore leaves it out"),
        "{err}"
    );
}
