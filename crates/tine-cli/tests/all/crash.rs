//! `kill -9` of `tine snapshot` or `tine gc` at many moments never damages a
//! committed snapshot.

use std::time::{Duration, Instant};

use crate::common::{Env, listing};

#[test]
fn kill_9_during_snapshot_never_damages_earlier_snapshots() {
    let env = Env::new();
    let mut seed: u64 = 42;
    let mut rnd = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let big: Vec<u8> = (0..12 << 20).map(|_| rnd() as u8).collect();
    env.write("big.bin", &big);
    for i in 0..600 {
        env.write(
            &format!("src/m{}/f{i}.txt", i % 12),
            format!("file {i}\n").repeat(20).as_bytes(),
        );
    }
    let base = env.json(&["snapshot", "-m", "base", "--tag", "base"]);
    let base_listing = listing(&env.work());
    // How long a snapshot with fresh data takes, to spread the kills over it:
    // the fastest of three, so that a slow sample on a noisy machine does not
    // push the kills past the end of most snapshots.
    let mut full = Duration::MAX;
    for k in 1..=3 {
        env.write("big.bin", &big[k..]);
        let t0 = Instant::now();
        env.ok(&["snapshot", "-m", "timing"]);
        full = full.min(t0.elapsed());
    }
    let mut full = full.max(Duration::from_millis(20));
    let mut killed = 0;
    let mut committed = vec![(base["id"].as_str().unwrap().to_string(), base_listing)];
    let rounds = 24;
    for round in 0..rounds {
        // Fresh content each round so the snapshot has real work to do.
        let mut data = big.clone();
        data[round * 1000] ^= 0xff;
        data.truncate(big.len() - round * 4096);
        env.write("big.bin", &data);
        env.write(
            &format!("src/m{}/f{round}.txt", round % 12),
            format!("round {round}").as_bytes(),
        );
        let delay = full.mul_f64(round as f64 / rounds as f64 * 0.95);
        let finished = !kill_after(&env, &["snapshot", "-m", &format!("round {round}")], delay);
        let fsck = env.json(&["fsck"]);
        assert!(
            fsck["damaged_objects"].as_array().unwrap().is_empty(),
            "round {round}: {fsck}"
        );
        assert!(
            fsck["damaged_packs"].as_array().unwrap().is_empty(),
            "round {round}: {fsck}"
        );
        assert!(
            fsck["affected_snapshots"].as_array().unwrap().is_empty(),
            "round {round}: {fsck}"
        );
        if !finished {
            killed += 1;
        }
        if finished {
            // The machine got faster (a neighbour finished): later kills
            // come sooner, so that they still land inside snapshots.
            full = full.mul_f64(0.85);
            let log = env.json(&["log", "-n", "1"]);
            committed.push((
                log[0]["id"].as_str().unwrap().to_string(),
                listing(&env.work()),
            ));
        }
    }
    assert!(
        killed >= rounds / 2,
        "only {killed} of {rounds} snapshots were killed mid-way"
    );
    // Every committed snapshot restores exactly.
    restores_exactly(&env, &committed);
    // Leftovers from the kills are all removed by gc.
    env.ok(&["gc"]);
    let fsck = env.json(&["fsck"]);
    assert!(
        fsck["leftover_files"].as_array().unwrap().is_empty(),
        "{fsck}"
    );
    assert_eq!(fsck["unreachable_objects"], 0, "{fsck}");
}

/// Runs tine with `args` and SIGKILLs it after `delay`; true if it was killed
/// before it finished successfully.
fn kill_after(env: &Env, args: &[&str], delay: Duration) -> bool {
    let mut child = env
        .cmd(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(delay);
    let _ = child.kill();
    !child.wait().unwrap().success()
}

/// Compressible text that differs from round to round.
fn text(round: usize, i: usize, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len + 64);
    let mut k = 0usize;
    while v.len() < len {
        k += 1;
        v.extend_from_slice(
            format!(
                "let v{} = self.value({round}, {i}) + {};\n",
                k % 97,
                (k * 7919 + i) % 1000
            )
            .as_bytes(),
        );
    }
    v.truncate(len);
    v
}

#[test]
fn kill_9_during_gc_compaction_loses_nothing() {
    let env = Env::new();
    let add_round = |round: usize| {
        for i in 0..150 {
            env.write(
                &format!("r{round}/m{}/f{i}.txt", i % 8),
                &text(round, i, 2_000 + (i % 5) * 9_000),
            );
        }
    };
    add_round(0);
    env.ok(&["snapshot", "-m", "round 0"]);
    // How long compacting one round's pack takes, to spread the kills over it.
    add_round(1);
    env.ok(&["snapshot", "-m", "round 1"]);
    let t0 = Instant::now();
    env.ok(&["gc"]);
    let full = t0.elapsed().max(Duration::from_millis(20));
    let mut committed = Vec::new();
    let mut killed = 0;
    let rounds = 12;
    for round in 2..2 + rounds {
        add_round(round);
        let snap = env.json(&["snapshot", "-m", &format!("round {round}")]);
        committed.push((
            snap["id"].as_str().unwrap().to_string(),
            listing(&env.work()),
        ));
        let delay = full.mul_f64((round - 2) as f64 / rounds as f64 * 1.2);
        if kill_after(&env, &["gc"], delay) {
            killed += 1;
        }
        let fsck = env.json(&["fsck"]);
        for key in [
            "damaged_objects",
            "damaged_packs",
            "missing_objects",
            "affected_snapshots",
        ] {
            assert!(
                fsck[key].as_array().unwrap().is_empty(),
                "round {round}: {fsck}"
            );
        }
    }
    assert!(
        killed >= rounds / 2,
        "only {killed} of {rounds} gc runs were killed mid-way"
    );
    restores_exactly(&env, &committed);
    // A finished gc leaves one dense pack set and nothing else behind.
    let g = env.json(&["gc"]);
    let fsck = env.json(&["fsck"]);
    assert!(
        fsck["leftover_files"].as_array().unwrap().is_empty(),
        "{fsck}"
    );
    assert_eq!(env.json(&["gc"])["packs_rewritten"], 0, "after {g}");
}

/// A snapshot id and the listing of its directory when it was made.
type Committed = (String, Vec<(String, Vec<u8>)>);

/// Every committed snapshot restores to exactly the listing taken when it was made.
fn restores_exactly(env: &Env, committed: &[Committed]) {
    for (i, (id, want)) in committed.iter().enumerate() {
        let dir = env.tmp.path().join(format!("check{i}"));
        env.ok(&["restore", id, "--to", dir.to_str().unwrap()]);
        assert_eq!(&listing(&dir), want, "snapshot {id}");
    }
}

/// Runs `sql` on the repository's database behind tine's back.
fn tamper(env: &Env, sql: &str) {
    let db = rusqlite::Connection::open(env.work().join(".tine/tine.db")).unwrap();
    db.execute_batch(sql).unwrap();
}

#[test]
fn a_snapshot_row_that_lies_fails_fsck_and_rebuild_index_puts_it_right() {
    let env = Env::new();
    env.write("a.txt", b"one\n");
    let one = env.json(&["snapshot", "-m", "first", "--tag", "one"]);
    env.write("a.txt", b"two\n");
    let two = env.json(&["snapshot", "-m", "second"]);
    let id = two["id"].as_str().unwrap();
    // The second row now claims the first's tree and another message.
    tamper(
        &env,
        &format!(
            "UPDATE snapshots SET tree = (SELECT tree FROM snapshots WHERE id = x'{}'), message = 'forged' WHERE id = x'{id}'",
            one["id"].as_str().unwrap()
        ),
    );
    let o = env.run(&["--json", "fsck"]);
    assert_eq!(o.status.code(), Some(5), "corrupt");
    // The report first (an error document may follow).
    let r: serde_json::Value = serde_json::Deserializer::from_slice(&o.stdout)
        .into_iter()
        .next()
        .unwrap()
        .unwrap();
    let m = &r["mismatched_snapshots"][0];
    assert_eq!(m["id"], id, "{r}");
    assert_eq!(m["fields"], serde_json::json!(["tree", "message"]), "{r}");
    // Rebuilt from the objects: the row says what the snapshot is again.
    let o = env.run(&["fsck", "--rebuild-index"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr).contains("1 snapshot row repaired"));
    let shown = env.json(&["show", id]);
    assert_eq!(shown["message"], "second", "{shown}");
    env.ok(&["restore", id, "--to", "out"]);
    assert_eq!(
        std::fs::read(env.work().join("out/a.txt")).unwrap(),
        b"two\n"
    );
}

#[test]
fn an_index_that_lost_its_rows_is_rebuilt_from_the_packs() {
    let env = Env::new();
    env.write("d/a.txt", b"alpha\n");
    env.write("d/b.txt", b"beta\n");
    let s = env.json(&["snapshot", "-m", "kept", "--tag", "k"]);
    let id = s["id"].as_str().unwrap().to_string();
    tamper(
        &env,
        "DELETE FROM objects; DELETE FROM packs; DELETE FROM snapshot_parents; DELETE FROM snapshots;",
    );
    let o = env.run(&["restore", &id, "--to", "out"]);
    assert!(!o.status.success(), "nothing is indexed");
    let o = env.run(&["fsck", "--rebuild-index"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let said = String::from_utf8_lossy(&o.stderr);
    assert!(
        said.contains("1 pack listed again") && said.contains("1 snapshot recorded"),
        "{said}"
    );
    env.ok(&["restore", &id, "--to", "out"]);
    assert_eq!(
        std::fs::read(env.work().join("out/d/b.txt")).unwrap(),
        b"beta\n"
    );
    assert_eq!(env.json(&["log"]).as_array().unwrap().len(), 1);
}

#[test]
fn a_malformed_database_is_corrupt_exit_5_for_fsck_and_restore() {
    let env = Env::new();
    for i in 0..200 {
        env.write(&format!("f{i}.txt"), format!("{i}\n").repeat(50).as_bytes());
    }
    let s = env.json(&["snapshot", "--tag", "k"]);
    let db = env.work().join(".tine/tine.db");
    {
        let c = rusqlite::Connection::open(&db).unwrap();
        c.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
            .unwrap();
    }
    let len = std::fs::metadata(&db).unwrap().len();
    assert!(len > 4 * 4096, "{len}");
    // Garbage over the pages after the first (the schema's).
    let mut bytes = std::fs::read(&db).unwrap();
    for b in &mut bytes[4096..len as usize] {
        *b = 0xde;
    }
    std::fs::write(&db, &bytes).unwrap();
    for args in [
        vec!["fsck"],
        vec!["restore", s["id"].as_str().unwrap(), "--to", "out"],
    ] {
        let o = env.run(&args);
        assert_eq!(
            o.status.code(),
            Some(5),
            "{args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
}
