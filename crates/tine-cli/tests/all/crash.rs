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
    let full = full.max(Duration::from_millis(20));
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
