//! Against a real S3-compatible server (SeaweedFS on loopback).

use std::fs;
use std::time::{Duration, Instant};

use object_store::ObjectStoreExt;
use object_store::path::Path as Key;
use tine_remote::{PushOptions, RemoteError};
use tine_store::{ErrorKind, HasKind, NoProgress};

use crate::common::{Host, connect, noise, read_tree, seaweed, workspace};

#[test]
fn push_clone_restore_through_s3_and_a_corrupted_object_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(server) = seaweed(&tmp.path().join("weed")) else {
        return;
    };
    let c = connect(&server, "s3://tine-test/team/agents");
    // No bucket yet: the error says so.
    let a = Host::new(tmp.path(), "a");
    let e = a
        .remote("origin", &c)
        .pull(&a.repo, &[], &NoProgress)
        .unwrap_err();
    assert!(
        e.to_string().contains("bucket tine-test does not exist"),
        "{e}"
    );
    server.create_bucket("tine-test").unwrap();
    let src = tmp.path().join("src");
    workspace(&src, 300);
    fs::write(src.join("weights.bin"), noise(12 << 20, 11)).unwrap();
    let s1 = a.snapshot(&src, "s3 first");
    let opts = PushOptions {
        part_size: 5 << 20,
        ..PushOptions::default()
    };
    let ra = a.remote("origin", &c);
    let first = ra
        .push(&a.repo, &[s1], &[("v1".into(), s1)], &opts, &NoProgress)
        .unwrap();
    assert!(first.pack_bytes > 12 << 20, "multipart expected: {first:?}");
    let again = ra
        .push(&a.repo, &[s1], &[("v1".into(), s1)], &opts, &NoProgress)
        .unwrap();
    assert_eq!(again.bytes_sent, 0, "{again:?}");

    let listing = ra.listing().unwrap();
    assert_eq!(listing.snapshots.len(), 1);
    assert_eq!(listing.tags, vec![("v1".to_string(), s1)]);

    let b = Host::new(tmp.path(), "b");
    let got = b
        .remote("origin", &c)
        .pull(&b.repo, &["v1".into()], &NoProgress)
        .unwrap();
    assert_eq!(got.snapshots_received, vec![s1.to_hex()]);
    let out = tmp.path().join("out");
    b.restore(&s1, &out);
    assert_eq!(read_tree(&out), read_tree(&src));

    // Damage one byte of the pack on the server: a new host refuses it.
    let store = server.store("tine-test");
    let key = Key::from(format!("team/agents/packs/{}.pack", first.pack.unwrap()));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let good = rt.block_on(async { store.get(&key).await.unwrap().bytes().await.unwrap() });
    let mut bad = good.to_vec();
    bad[good.len() / 2] ^= 1;
    rt.block_on(store.put(&key, bad.into())).unwrap();
    let h = Host::new(tmp.path(), "c");
    let e = h
        .remote("origin", &c)
        .pull(&h.repo, &[], &NoProgress)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    assert!(e.to_string().contains(key.as_ref()), "{e}");
    assert!(h.repo.snapshots().unwrap().is_empty());

    // Wrong credentials are named as such.
    let mut wrong = c.clone();
    wrong.credentials.as_mut().unwrap().secret_access_key = "nope-nope-nope".into();
    let e = h
        .remote("origin", &wrong)
        .pull(&h.repo, &[], &NoProgress)
        .unwrap_err();
    assert!(
        matches!(e, RemoteError::Denied { .. }) || e.to_string().contains("403"),
        "{e}"
    );
}

#[test]
fn a_push_interrupted_by_killing_the_server_resumes_and_completes() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(mut server) = seaweed(&tmp.path().join("weed")) else {
        return;
    };
    let c = connect(&server, "s3://tine-resume/x");
    server.create_bucket("tine-resume").unwrap();
    let a = Host::new(tmp.path(), "a");
    let src = tmp.path().join("src");
    workspace(&src, 20);
    fs::write(src.join("data.bin"), noise(64 << 20, 5)).unwrap();
    let s1 = a.snapshot(&src, "big");
    let opts = PushOptions {
        part_size: 5 << 20,
        concurrency: 1,
        // Slow enough that the server can be killed while parts are going up.
        part_pause: Duration::from_millis(150),
    };
    let state = a.path.join("remotes/origin/upload.json");
    let push = {
        let (path, c, opts) = (a.path.clone(), c.clone(), opts.clone());
        std::thread::spawn(move || {
            let repo = tine_store::Repository::open(&path).unwrap();
            let r = tine_remote::Remote::open("origin", &c, &path.join("remotes/origin")).unwrap();
            r.push(&repo, &[s1], &[], &opts, &NoProgress)
        })
    };
    let start = Instant::now();
    loop {
        let parts = fs::read(&state)
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .and_then(|v| v["parts"].as_object().map(|m| m.len()))
            .unwrap_or(0);
        if parts >= 3 {
            break;
        }
        assert!(
            !push.is_finished(),
            "the push ended before it could be interrupted"
        );
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no part was recorded"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    server.kill();
    let e = push.join().unwrap().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    assert!(e.to_string().contains("could not be reached"), "{e}");

    server.restart().unwrap();
    let r = a.remote("origin", &c);
    let fast = PushOptions {
        part_pause: Duration::ZERO,
        ..opts
    };
    let done = r.push(&a.repo, &[s1], &[], &fast, &NoProgress).unwrap();
    let resumed = done.resumed.clone().expect("the upload resumed");
    assert!(resumed.parts_already_sent >= 3, "{done:?}");
    assert!(done.finished_earlier_pack.is_some(), "{done:?}");
    assert_eq!(done.snapshots_sent, vec![s1.to_hex()]);
    assert!(
        done.bytes_sent + resumed.bytes_already_sent <= (64 << 20) + (1 << 20),
        "parts sent twice: {done:?}"
    );
    assert!(!state.exists());
    let again = r.push(&a.repo, &[s1], &[], &fast, &NoProgress).unwrap();
    assert_eq!(again.bytes_sent, 0);

    let b = Host::new(tmp.path(), "b");
    b.remote("origin", &c)
        .pull(&b.repo, &[], &NoProgress)
        .unwrap();
    let out = tmp.path().join("out");
    b.restore(&s1, &out);
    assert_eq!(read_tree(&out), read_tree(&src));
}
