//! A directory remote (`file://`): the whole protocol without a server.

use std::fs;

use tine_remote::{Connect, PushOptions, RemoteError};
use tine_store::{ErrorKind, HasKind, NoProgress};

use crate::common::{Host, noise, read_tree, workspace};

#[test]
fn push_clone_restore_is_byte_identical_and_only_what_is_missing_travels() {
    let tmp = tempfile::tempdir().unwrap();
    let url = format!("file://{}", tmp.path().join("remote").display());
    let c = Connect::new(&url);
    let (a, b) = (Host::new(tmp.path(), "a"), Host::new(tmp.path(), "b"));
    let src = tmp.path().join("src");
    workspace(&src, 200);
    fs::write(src.join("big.bin"), noise(3 << 20, 7)).unwrap();
    let s1 = a.snapshot(&src, "first");
    a.repo
        .lock(true)
        .unwrap()
        .set_tag("v1", &s1, false)
        .unwrap();

    let ra = a.remote("origin", &c);
    let opts = PushOptions {
        part_size: 1 << 20,
        ..PushOptions::default()
    };
    let first = ra
        .push(&a.repo, &[s1], &[("v1".into(), s1)], &opts, &NoProgress)
        .unwrap();
    assert_eq!(first.snapshots_sent, vec![s1.to_hex()]);
    assert!(first.objects_sent > 200, "{first:?}");
    assert!(first.pack_bytes > 3 << 20, "{first:?}");
    assert_eq!(first.tags_sent, vec!["v1".to_string()]);

    let again = ra
        .push(&a.repo, &[s1], &[("v1".into(), s1)], &opts, &NoProgress)
        .unwrap();
    assert_eq!(again.bytes_sent, 0, "{again:?}");
    assert_eq!(again.objects_sent, 0);
    assert!(again.snapshots_sent.is_empty() && again.tags_sent.is_empty());
    assert_eq!(again.snapshots_already, 1);

    // Another host: pull everything, restore, compare.
    let rb = b.remote("origin", &c);
    let got = rb.pull(&b.repo, &[], &NoProgress).unwrap();
    assert_eq!(got.snapshots_received, vec![s1.to_hex()]);
    assert_eq!(got.tags_set, vec!["v1".to_string()]);
    assert!(got.objects_verified >= first.objects_sent);
    let out = tmp.path().join("out");
    b.restore(&b.repo.resolve("v1").unwrap(), &out);
    assert_eq!(read_tree(&out), read_tree(&src));
    let info = b.repo.snapshot_info(&s1).unwrap().unwrap();
    assert_eq!(info.message, "first");
    let fsck = tine_store::fsck(&b.repo, &NoProgress).unwrap();
    assert!(
        fsck.damaged_objects.is_empty()
            && fsck.missing_objects.is_empty()
            && fsck.damaged_packs.is_empty()
    );

    // One file changes: only its blob, the trees above it and the snapshot travel.
    fs::write(src.join("pkg3/mod3.py"), "changed\n").unwrap();
    let s2 = a.snapshot(&src, "second");
    let second = ra.push(&a.repo, &[s2], &[], &opts, &NoProgress).unwrap();
    assert_eq!(second.snapshots_sent, vec![s2.to_hex()]);
    assert!(second.objects_sent <= 4, "{second:?}");
    assert!(
        second.bytes_sent * 100 <= first.bytes_sent,
        "second push {} bytes vs first {}",
        second.bytes_sent,
        first.bytes_sent
    );
    let got = rb.pull(&b.repo, &[s2.short()], &NoProgress).unwrap();
    assert_eq!(got.snapshots_received, vec![s2.to_hex()]);
    assert_eq!(got.packs.len(), 1);
    assert_eq!(
        b.repo.snapshot_info(&s2).unwrap().unwrap().parents,
        vec![s1]
    );
    b.restore(&s2, &out);
    assert_eq!(read_tree(&out), read_tree(&src));

    // Host b changes one file and pushes: what a already sent is not sent again.
    fs::write(out.join("pkg4/new.txt"), "from b\n").unwrap();
    let s3 = b.snapshot(&out, "from b");
    let from_b = rb.push(&b.repo, &[s3], &[], &opts, &NoProgress).unwrap();
    assert_eq!(from_b.snapshots_sent, vec![s3.to_hex()]);
    assert!(from_b.objects_sent <= 4, "{from_b:?}");
    let back = ra.pull(&a.repo, &[], &NoProgress).unwrap();
    assert_eq!(back.snapshots_received, vec![s3.to_hex()]);
    assert_eq!(back.snapshots_already, 2);
}

#[test]
fn a_corrupted_pack_index_or_record_is_refused_and_nothing_is_recorded() {
    let tmp = tempfile::tempdir().unwrap();
    let remote_dir = tmp.path().join("remote");
    let url = format!("file://{}", remote_dir.display());
    let c = Connect::new(&url);
    let a = Host::new(tmp.path(), "a");
    let src = tmp.path().join("src");
    workspace(&src, 50);
    fs::write(src.join("big.bin"), noise(1 << 20, 3)).unwrap();
    let s1 = a.snapshot(&src, "one");
    let report = a
        .remote("origin", &c)
        .push(&a.repo, &[s1], &[], &PushOptions::default(), &NoProgress)
        .unwrap();
    let pack = remote_dir
        .join("packs")
        .join(format!("{}.pack", report.pack.unwrap()));
    let good = fs::read(&pack).unwrap();

    // One byte flipped inside the data (the big blob, stored raw).
    let mut bad = good.clone();
    bad[good.len() / 3] ^= 0x40;
    fs::write(&pack, &bad).unwrap();
    let b = Host::new(tmp.path(), "b");
    let e = b
        .remote("origin", &c)
        .pull(&b.repo, &[], &NoProgress)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("packs/") && msg.contains("does not match its hash"),
        "{msg}"
    );
    assert!(b.repo.snapshots().unwrap().is_empty());
    assert!(!b.repo.has_object(&s1).unwrap());
    let incoming = b.path.join("remotes/origin/incoming");
    assert_eq!(
        fs::read_dir(&incoming).unwrap().count(),
        0,
        "refused pack kept"
    );

    // A truncated pack: its footer is gone.
    fs::write(&pack, &good[..good.len() - 10]).unwrap();
    let e = b
        .remote("origin", &c)
        .pull(&b.repo, &[], &NoProgress)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");

    // Back to the good pack: the same pull now works.
    fs::write(&pack, &good).unwrap();
    b.remote("origin", &c)
        .pull(&b.repo, &[], &NoProgress)
        .unwrap();
    assert!(b.repo.snapshot_info(&s1).unwrap().is_some());

    // A damaged snapshot record.
    let rec = remote_dir.join("snapshots").join(s1.to_hex());
    fs::write(&rec, b"{\"format\":\"tine-snapshot\"").unwrap();
    let h = Host::new(tmp.path(), "c");
    let e = h
        .remote("origin", &c)
        .pull(&h.repo, &[], &NoProgress)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    assert!(e.to_string().contains(&s1.to_hex()), "{e}");
}

#[test]
fn what_is_not_a_remote_is_refused_clearly() {
    let tmp = tempfile::tempdir().unwrap();
    let a = Host::new(tmp.path(), "a");
    let empty = tmp.path().join("empty");
    let e = a
        .remote("x", &Connect::new(&format!("file://{}", empty.display())))
        .pull(&a.repo, &[], &NoProgress)
        .unwrap_err();
    assert!(matches!(e, RemoteError::NotARemote { .. }), "{e}");
    assert_eq!(e.kind(), ErrorKind::NotFound);
    assert!(!empty.exists(), "a pull created the remote's directory");

    // A directory holding other data is not taken over by a push.
    let other = tmp.path().join("other");
    fs::create_dir_all(&other).unwrap();
    fs::write(other.join("notes.txt"), "mine").unwrap();
    let src = tmp.path().join("src");
    workspace(&src, 3);
    let s = a.snapshot(&src, "");
    let e = a
        .remote("y", &Connect::new(&format!("file://{}", other.display())))
        .push(&a.repo, &[s], &[], &PushOptions::default(), &NoProgress)
        .unwrap_err();
    assert!(e.to_string().contains("notes.txt"), "{e}");

    for url in ["ftp://x", "s3://Bad_Bucket/x", "file://rel"] {
        let e =
            tine_remote::Remote::open("z", &Connect::new(url), &tmp.path().join("st")).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    }
    let mut c = Connect::new("s3://bucket/p");
    c.settings.insert("endpoitn".into(), "http://x".into());
    let e = tine_remote::Remote::open("z", &c, &tmp.path().join("st")).unwrap_err();
    assert!(e.to_string().contains("endpoitn"), "{e}");

    // A name the remote does not have.
    let good = format!("file://{}", tmp.path().join("r").display());
    a.remote("r", &Connect::new(&good))
        .push(&a.repo, &[s], &[], &PushOptions::default(), &NoProgress)
        .unwrap();
    let e = a
        .remote("r", &Connect::new(&good))
        .pull(&a.repo, &["nosuchtag".into()], &NoProgress)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
}

#[test]
fn a_tag_that_differs_here_is_kept_and_reported() {
    let tmp = tempfile::tempdir().unwrap();
    let c = Connect::new(&format!("file://{}", tmp.path().join("remote").display()));
    let (a, b) = (Host::new(tmp.path(), "a"), Host::new(tmp.path(), "b"));
    let src = tmp.path().join("src");
    workspace(&src, 5);
    let s1 = a.snapshot(&src, "a1");
    a.remote("o", &c)
        .push(
            &a.repo,
            &[s1],
            &[("best".into(), s1)],
            &PushOptions::default(),
            &NoProgress,
        )
        .unwrap();
    let other = tmp.path().join("other");
    workspace(&other, 6);
    let mine = b.snapshot(&other, "b1");
    b.repo
        .lock(true)
        .unwrap()
        .set_tag("best", &mine, false)
        .unwrap();
    let got = b.remote("o", &c).pull(&b.repo, &[], &NoProgress).unwrap();
    assert_eq!(got.tags_kept.len(), 1);
    assert_eq!(got.tags_kept[0].remote, s1.to_hex());
    assert_eq!(b.repo.resolve("best").unwrap(), mine);
}
