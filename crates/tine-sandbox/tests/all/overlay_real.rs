//! Real overlay mounts (root only).

use std::fs;

use tine_sandbox::overlay::{Overlay, UpperEntry, classify};

#[test]
fn writes_land_in_upper_with_whiteouts_and_opaque_dirs() {
    if !crate::need_root("an overlay mount") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let o = Overlay {
        lower: tmp.path().join("lower"),
        upper: tmp.path().join("upper"),
        work: tmp.path().join("work"),
        merged: tmp.path().join("merged"),
        limit_bytes: None,
    };
    fs::create_dir_all(o.lower.join("d")).unwrap();
    fs::create_dir_all(o.lower.join("e")).unwrap();
    fs::write(o.lower.join("a"), "lower a").unwrap();
    fs::write(o.lower.join("d/b"), "lower b").unwrap();
    fs::write(o.lower.join("e/x"), "lower x").unwrap();
    o.mount(None).unwrap();
    assert!(o.is_mounted());
    let m = &o.merged;
    assert_eq!(fs::read_to_string(m.join("d/b")).unwrap(), "lower b");
    fs::write(m.join("a"), "upper a").unwrap();
    fs::write(m.join("c"), "new c").unwrap();
    fs::remove_file(m.join("d/b")).unwrap();
    fs::remove_dir_all(m.join("e")).unwrap();
    fs::create_dir(m.join("e")).unwrap();
    assert_eq!(classify(&o.upper.join("a")).unwrap(), UpperEntry::Present);
    assert_eq!(classify(&o.upper.join("c")).unwrap(), UpperEntry::Present);
    assert_eq!(
        classify(&o.upper.join("d/b")).unwrap(),
        UpperEntry::Whiteout
    );
    assert_eq!(classify(&o.upper.join("e")).unwrap(), UpperEntry::OpaqueDir);
    // The lower layer never changes.
    assert_eq!(fs::read_to_string(o.lower.join("a")).unwrap(), "lower a");
    assert!(o.lower.join("d/b").exists() && o.lower.join("e/x").exists());
    o.unmount().unwrap();
    assert!(!o.is_mounted());
    o.unmount().unwrap();
    let bad = Overlay {
        lower: tmp.path().join("a,b"),
        ..o
    };
    assert!(
        bad.mount(None)
            .unwrap_err()
            .to_string()
            .contains("cannot carry")
    );
}
