//! Integration tests of tine-ledger.

use std::os::unix::fs::PermissionsExt;

use tine_ledger::{LedgerError, Record};
use tine_store::Repository;

fn rec(key: &str, n: u32) -> Record {
    Record {
        kind: "email".into(),
        key: key.into(),
        request: format!("{{\"to\": \"a@b\", \"n\": {n}}}"),
        result: format!("{{\"id\": {n}}}"),
    }
}

#[test]
fn entries_chain_and_lookup_follows_the_visible_ledger() {
    let t = tempfile::tempdir().unwrap();
    let repo = Repository::init(&t.path().join("r")).unwrap();
    let lock = repo.lock(true).unwrap();
    let e1 = tine_ledger::append(&lock, "sb", &rec("k1", 1)).unwrap();
    let e2 = tine_ledger::append(&lock, "sb", &rec("k2", 2)).unwrap();
    tine_ledger::append(&lock, "other", &rec("k1", 9)).unwrap();
    assert_eq!(e2.parent, Some(e1.id));
    assert_eq!(e1.request["n"], 1);
    // The key file is private.
    let mode = std::fs::metadata(repo.path().join("ledger.key"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    let found = tine_ledger::lookup(&repo, "sb", "k2").unwrap().unwrap();
    assert_eq!(found.result["id"], 2);
    assert_eq!(
        tine_ledger::lookup(&repo, "sb", "k1")
            .unwrap()
            .unwrap()
            .result["id"],
        1
    );
    assert!(tine_ledger::lookup(&repo, "sb", "nope").unwrap().is_none());
    // A rollback to just after e1: k2 is no longer visible, but still in the history.
    tine_ledger::set_head(&lock, "sb", Some(e1.id)).unwrap();
    assert!(tine_ledger::lookup(&repo, "sb", "k2").unwrap().is_none());
    let e3 = tine_ledger::append(&lock, "sb", &rec("k3", 3)).unwrap();
    assert_eq!(e3.parent, Some(e1.id), "the new branch grows from the head");
    let vis: Vec<u64> = tine_ledger::visible(&repo, "sb")
        .unwrap()
        .iter()
        .map(|e| e.id)
        .collect();
    assert_eq!(vis, vec![e1.id, e3.id]);
    let all = tine_ledger::history(&repo, Some("sb")).unwrap();
    assert_eq!(all.len(), 3);
    assert!(all.iter().any(|e| e.id == e2.id && !e.visible));
    assert_eq!(tine_ledger::verify(&repo).unwrap(), 4);
}

#[test]
fn one_changed_byte_makes_verify_name_the_first_bad_entry() {
    let t = tempfile::tempdir().unwrap();
    let repo = Repository::init(&t.path().join("r")).unwrap();
    {
        let lock = repo.lock(true).unwrap();
        for i in 0..5 {
            tine_ledger::append(&lock, "sb", &rec(&format!("k{i}"), i)).unwrap();
        }
    }
    assert_eq!(tine_ledger::verify(&repo).unwrap(), 5);
    let db = rusqlite::Connection::open(repo.path().join("tine.db")).unwrap();
    // One byte of entry 3's result: {"id":2} -> {"id":7}.
    db.execute(
        "UPDATE ledger SET result = replace(result, '2', '7') WHERE id = 3",
        [],
    )
    .unwrap();
    match tine_ledger::verify(&repo) {
        Err(LedgerError::Tampered { id, ok, .. }) => assert_eq!((id, ok), (3, 2)),
        other => panic!("{other:?}"),
    }
    // Putting it back makes it verify again; changing a MAC is caught too.
    db.execute(
        "UPDATE ledger SET result = replace(result, '7', '2') WHERE id = 3",
        [],
    )
    .unwrap();
    assert_eq!(tine_ledger::verify(&repo).unwrap(), 5);
    db.execute("UPDATE ledger SET mac = zeroblob(32) WHERE id = 4", [])
        .unwrap();
    assert!(matches!(
        tine_ledger::verify(&repo),
        Err(LedgerError::Tampered { id: 4, .. })
    ));
}

#[test]
fn bad_records_are_refused() {
    let t = tempfile::tempdir().unwrap();
    let repo = Repository::init(&t.path().join("r")).unwrap();
    let lock = repo.lock(true).unwrap();
    let mut r = rec("k", 1);
    r.request = "{not json".into();
    assert!(matches!(
        tine_ledger::append(&lock, "sb", &r),
        Err(LedgerError::NotJson {
            field: "request",
            ..
        })
    ));
    let mut r = rec("", 1);
    r.key.clear();
    assert!(matches!(
        tine_ledger::append(&lock, "sb", &r),
        Err(LedgerError::Empty { field: "key" })
    ));
    assert!(tine_ledger::history(&repo, None).unwrap().is_empty());
}

/// A ledger of sandbox "sb" rolled back once: entries 1 (k0) and 2 (k1) on
/// its chain, 3 (k2) abandoned, 4 (k3) its head; "other" has entry 5.
fn rolled_back() -> (tempfile::TempDir, Repository) {
    let t = tempfile::tempdir().unwrap();
    let repo = Repository::init(&t.path().join("r")).unwrap();
    {
        let lock = repo.lock(true).unwrap();
        for i in 0..3 {
            tine_ledger::append(&lock, "sb", &rec(&format!("k{i}"), i)).unwrap();
        }
        tine_ledger::set_head(&lock, "sb", Some(2)).unwrap();
        tine_ledger::append(&lock, "sb", &rec("k3", 3)).unwrap();
        tine_ledger::append(&lock, "other", &rec("k0", 9)).unwrap();
    }
    assert_eq!(tine_ledger::verify(&repo).unwrap(), 5);
    (t, repo)
}

#[test]
fn heads_are_authenticated_and_every_edit_of_them_fails_verify() {
    let edits: [(&str, &str); 7] = [
        ("the head entry deleted", "DELETE FROM ledger WHERE id = 4"),
        (
            "a head pointed at an abandoned entry",
            "UPDATE ledger_heads SET entry = 3 WHERE sandbox = 'sb'",
        ),
        (
            "a head pointed at nothing",
            "UPDATE ledger_heads SET entry = NULL WHERE sandbox = 'sb'",
        ),
        (
            "an abandoned entry deleted",
            "DELETE FROM ledger WHERE id = 3",
        ),
        (
            "a head deleted",
            "DELETE FROM ledger_heads WHERE sandbox = 'other'",
        ),
        (
            "a head's MAC deleted",
            "DELETE FROM ledger_head_macs WHERE sandbox = 'other'",
        ),
        ("the seal deleted", "DELETE FROM ledger_seal"),
    ];
    for (what, sql) in edits {
        let (_t, repo) = rolled_back();
        let db = rusqlite::Connection::open(repo.path().join("tine.db")).unwrap();
        db.execute(sql, []).unwrap();
        let r = tine_ledger::verify(&repo);
        assert!(
            matches!(
                r,
                Err(LedgerError::HeadTampered { .. }
                    | LedgerError::Unsealed { .. }
                    | LedgerError::Tampered { .. })
            ),
            "{what}: {r:?}"
        );
        let msg = r.unwrap_err().to_string();
        assert!(msg.contains("verification"), "{what}: {msg}");
    }
}

#[test]
fn the_newest_entries_cut_off_with_an_older_head_put_back_fail_verify() {
    let (_t, repo) = rolled_back();
    let db = rusqlite::Connection::open(repo.path().join("tine.db")).unwrap();
    // The state as it was before entry 5 ("other"'s only one): its head and
    // MAC, kept by someone, put back after deleting the entry.
    let old_seal: (i64, Vec<u8>) = db
        .query_row("SELECT counter, mac FROM ledger_seal", [], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .unwrap();
    {
        let lock = repo.lock(true).unwrap();
        tine_ledger::append(&lock, "sb", &rec("k4", 4)).unwrap();
    }
    assert_eq!(tine_ledger::verify(&repo).unwrap(), 6);
    db.execute("DELETE FROM ledger WHERE id = 6", []).unwrap();
    db.execute("UPDATE ledger_heads SET entry = 4 WHERE sandbox = 'sb'", [])
        .unwrap();
    db.execute(
        "UPDATE ledger_seal SET counter = ?1, mac = ?2",
        rusqlite::params![old_seal.0, old_seal.1],
    )
    .unwrap();
    assert!(matches!(
        tine_ledger::verify(&repo),
        Err(LedgerError::HeadTampered { .. } | LedgerError::Unsealed { .. })
    ));
}

#[test]
fn heads_set_together_are_each_authenticated_and_an_edit_of_one_fails_verify() {
    let (_t, repo) = rolled_back();
    {
        let lock = repo.lock(true).unwrap();
        tine_ledger::set_heads(&lock, &["f1", "f2", "f3"], Some(2)).unwrap();
    }
    assert_eq!(tine_ledger::verify(&repo).unwrap(), 5);
    // Each fork sees the ledger up to entry 2 (k0, k1), none sees k3.
    for f in ["f1", "f2", "f3"] {
        let vis: Vec<u64> = tine_ledger::visible(&repo, f)
            .unwrap()
            .iter()
            .map(|e| e.id)
            .collect();
        assert_eq!(vis, vec![1, 2], "{f}");
        assert!(tine_ledger::lookup(&repo, f, "k3").unwrap().is_none());
    }
    // One head of the batch moved by hand: verify names it.
    let db = rusqlite::Connection::open(repo.path().join("tine.db")).unwrap();
    db.execute("UPDATE ledger_heads SET entry = 4 WHERE sandbox = 'f2'", [])
        .unwrap();
    match tine_ledger::verify(&repo) {
        Err(LedgerError::HeadTampered { sandbox, .. }) => assert_eq!(sandbox, "f2"),
        other => panic!("{other:?}"),
    }
}
