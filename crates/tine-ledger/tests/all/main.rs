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
    lock.set_ledger_head("sb", Some(e1.id)).unwrap();
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
