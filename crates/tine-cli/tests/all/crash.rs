//! `kill -9` of `tine snapshot` at many moments never damages an earlier snapshot.

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
    // How long a snapshot with fresh data takes, to spread the kills over it.
    env.write("big.bin", &big[1..]);
    let t0 = Instant::now();
    env.ok(&["snapshot", "-m", "timing"]);
    let full = t0.elapsed().max(Duration::from_millis(20));
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
        let delay = full.mul_f64(round as f64 / rounds as f64 * 1.2);
        let mut child = env
            .cmd(&["snapshot", "-m", &format!("round {round}")])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(delay);
        let _ = child.kill(); // SIGKILL
        let status = child.wait().unwrap();
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
        if !status.success() {
            killed += 1;
        }
        if status.success() {
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
    for (i, (id, want)) in committed.iter().enumerate() {
        let dir = env.tmp.path().join(format!("check{i}"));
        env.ok(&["restore", id, "--to", dir.to_str().unwrap()]);
        assert_eq!(&listing(&dir), want, "snapshot {id}");
    }
    // Leftovers from the kills are all removed by gc.
    env.ok(&["gc"]);
    let fsck = env.json(&["fsck"]);
    assert!(
        fsck["leftover_files"].as_array().unwrap().is_empty(),
        "{fsck}"
    );
    assert_eq!(fsck["unreachable_objects"], 0, "{fsck}");
}
