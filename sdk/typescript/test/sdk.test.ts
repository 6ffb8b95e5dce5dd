// The TypeScript SDK against a real `tine serve`.

import assert from "node:assert/strict";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";

import {
  Client,
  InvalidInput,
  NotFound,
  Sandbox,
  TineError,
  Unauthorized,
  Workspace,
  type Snapshot,
} from "../src/index.js";
import { startDaemon, type Daemon } from "./daemon.js";

let d: Daemon;
let remotes: string;

before(async () => {
  remotes = mkdtempSync(join(tmpdir(), "tine-ts-remotes-"));
  d = await startDaemon({ remoteRoot: remotes });
});

after(async () => {
  await d.stop();
  rmSync(remotes, { recursive: true, force: true });
});

async function withSandbox<T>(f: (sb: Sandbox) => Promise<T>): Promise<T> {
  const sb = await Sandbox.create({ client: d.client });
  try {
    return await f(sb);
  } finally {
    await sb.kill();
  }
}

/** An exec aborted while its command runs quietly has the command killed. */
async function abortKills(sb: Sandbox, how: "streamed" | "collected", secs: number): Promise<void> {
  const ac = new AbortController();
  const mark = `started-${secs}`;
  const run = sb.exec(`touch /workspace/${mark}; sleep ${secs}`, {
    signal: ac.signal,
    ...(how === "streamed" ? { onStdout: () => {} } : {}),
  });
  for (let i = 0; i < 100 && !(await sb.files.list()).some((e) => e.name === mark); i++) {
    await new Promise((res) => setTimeout(res, 50));
  }
  ac.abort();
  await assert.rejects(run);
  // (The bracket keeps the check's own command line from matching.)
  const left = await sb.exec(`sleep 0.5; ps -eo args | grep '[s]leep ${secs}' || echo none`);
  assert.equal(left.stdout.trim(), "none", `${how}: the command still runs`);
}

describe("sandboxes", () => {
  test("files, exec, snapshot, restore and fork", async () => {
    await withSandbox(async (sb) => {
      assert.equal(await sb.state(), "running");
      await sb.files.write("/workspace/a.txt", "one\n");
      const w = await sb.files.write("bin/run.sh", "#!/bin/sh\necho run $1\n", 0o755);
      assert.equal(w.mode & 0o777, 0o755);
      assert.equal(await sb.files.read("/workspace/a.txt"), "one\n");
      assert.deepEqual(
        (await sb.files.list()).map((e) => [e.name, e.kind]),
        [
          ["a.txt", "file"],
          ["bin", "dir"],
        ],
      );
      const r = await sb.exec("cat a.txt; echo oops >&2; exit 4");
      assert.deepEqual([r.stdout, r.stderr, r.exitCode, r.timedOut], ["one\n", "oops\n", 4, false]);
      assert.equal((await sb.exec(["bin/run.sh", "x"])).stdout, "run x\n");
      assert.equal((await sb.exec("echo $V", { env: { V: "set" } })).stdout, "set\n");
      const t = await sb.exec("sleep 20", { timeoutS: 0.5 });
      assert.ok(t.timedOut && t.exitCode === 137, JSON.stringify(t));

      const snap = await sb.snapshot({ message: "one" });
      assert.match(snap.id, /^[0-9a-f]{64}$/);
      await sb.files.write("a.txt", "two\n");
      await sb.files.write("new.txt", "x");
      const back = await sb.restore(snap);
      assert.equal(back.modified, 1);
      assert.equal(back.deleted, 1);
      assert.equal(await sb.files.read("a.txt"), "one\n");
      await assert.rejects(sb.files.read("new.txt"), NotFound);

      const forks = await sb.fork(3);
      try {
        assert.equal(new Set(forks.map((f) => f.id)).size, 3);
        await Promise.all(forks.map((f, k) => f.files.write("k", String(k))));
        for (const [k, f] of forks.entries()) {
          assert.equal((await f.exec("cat a.txt k")).stdout, `one\n${k}`);
        }
      } finally {
        await Promise.all(forks.map((f) => f.kill()));
      }
      const same = await Sandbox.connect(sb.name, { client: d.client });
      assert.equal(same.id, sb.id);
      assert.ok((await Sandbox.list({ client: d.client })).some((s) => s.id === sb.id));
    });
  });

  test("exec streams output as it comes, and an abort kills the command", async () => {
    await withSandbox(async (sb) => {
      const seen: [number, string][] = [];
      const t0 = Date.now();
      const r = await sb.exec("for i in 1 2 3; do echo $i; sleep 0.2; done; echo e >&2", {
        onStdout: (s) => seen.push([Date.now() - t0, s]),
      });
      assert.equal(r.stdout, "1\n2\n3\n");
      assert.equal(r.stderr, "e\n");
      assert.equal(seen.map(([, s]) => s).join(""), "1\n2\n3\n");
      // The first line arrived well before the command ended.
      assert.ok(seen[0]![0] < r.durationMs - 250, JSON.stringify({ seen, ms: r.durationMs }));

      await abortKills(sb, "streamed", 31);
      await abortKills(sb, "collected", 32);
    });
  });

  test("processes come back with a rollback, and forks run on", async () => {
    const counter = "i=0; while :; do i=$((i+1)); echo $i > /workspace/n; sleep 0.05; done";
    const sb = await Sandbox.create({ client: d.client, command: ["sh", "-c", counter] });
    // The shell truncates the file, then writes it: a read between the two
    // sees it empty, and is made again.
    const count = async (s: Sandbox): Promise<number> => {
      for (;;) {
        const text = (await s.files.read("n")).trim();
        if (text !== "") return Number(text);
        await new Promise((res) => setTimeout(res, 10));
      }
    };
    const pause = (ms: number) => new Promise((res) => setTimeout(res, ms));
    try {
      await pause(300);
      const snap = await sb.snapshot({ message: "counting" });
      // The shell and its sleep.
      assert.ok((snap.info["processes"] as number) >= 1, JSON.stringify(snap.info));
      const at = await count(sb);
      await pause(500);
      assert.ok((await count(sb)) > at + 4, "the counter ran on after the snapshot");
      await sb.restore(snap);
      const back = await count(sb);
      assert.ok(back < at + 4, `after the rollback the counter is at ${back}; it was ${at} at the snapshot`);
      await pause(300);
      assert.ok((await count(sb)) > back, "the counter runs on from where it was");
      const [f] = await sb.fork(1, { snapshot: snap });
      try {
        await pause(300);
        const n = await count(f!);
        assert.ok(n > at && n < at + 40, `the fork counts on from ${at}: ${n}`);
      } finally {
        await f!.kill();
      }
    } finally {
      await sb.kill();
    }
  });

  test("the ledger rewinds with a restore", async () => {
    await withSandbox(async (sb) => {
      const before = await sb.snapshot();
      const e = await sb.ledger.record("email", "welcome-1", { to: "a@b" }, { id: "m1" });
      assert.equal(e.key, "welcome-1");
      assert.deepEqual((await sb.ledger.lookup("welcome-1"))?.result, { id: "m1" });
      await sb.restore(before);
      assert.equal(await sb.ledger.lookup("welcome-1"), null);
      assert.equal((await sb.ledger.list()).length, 0);
      const all = await sb.ledger.list({ all: true });
      assert.equal(all.length, 1);
      assert.equal(all[0]!.visible, false);
      assert.ok((await d.client.ledger()).some((x) => x.id === e.id));
      assert.ok((await d.client.verifyLedger()).verified >= 1);
    });
  });

  test("merge, snapshots, diffs and tags", async () => {
    await withSandbox(async (sb) => {
      await sb.files.write("t", "a\nb\nc\n");
      const base = await sb.snapshot({ message: "base" });
      await sb.files.write("t", "A\nb\nc\n");
      const ours = await sb.snapshot({ message: "ours" });
      await sb.restore(base);
      await sb.files.write("t", "a\nb\nC\n");
      const theirs = await sb.snapshot({ message: "theirs" });
      const m = await sb.merge(ours, theirs);
      assert.deepEqual(m.conflicts, []);
      assert.equal(m.base, base.id);
      assert.equal(await sb.files.read("t"), "A\nb\nC\n");

      const diff = await d.client.diff(base, { to: ours, patch: true });
      assert.deepEqual(
        diff.changes.map((c) => [c.path, c.kind]),
        [["t", "modified"]],
      );
      assert.match(diff.patches![0]!, /-a\n\+A/);
      const list = await d.client.snapshots(50);
      assert.ok(list.some((s) => s.id === ours.id && s.message === "ours"));
      const tagName = `ts-${Date.now()}`;
      assert.equal((await d.client.tag(ours, tagName)).snapshot, ours.id);
      assert.equal((await d.client.snapshot(tagName))["id"], ours.id);
      assert.equal((await d.client.untag(tagName)).was, ours.id);
      await assert.rejects(d.client.snapshot(tagName), NotFound);
      // theirs is a parent of the merge: its deletion is refused, naming why.
      await assert.rejects(d.client.deleteSnapshot(theirs), (e: TineError) => /depend/.test(e.message));
    });
  });

  test("prepared forks are claimed by the snapshot's fork", async () => {
    await withSandbox(async (sb) => {
      await sb.files.write("a.txt", "one\n");
      const snap: Snapshot = await sb.snapshot({ prepareForks: 2 });
      assert.equal((snap.info["prepared_forks"] as { forks: number }).forks, 2);
      await sb.files.write("a.txt", "two\n");
      const forks = await sb.fork(2, { name: `pf${Date.now() % 100000}`, snapshot: snap });
      try {
        for (const f of forks) assert.equal((await f.exec("cat a.txt")).stdout, "one\n");
      } finally {
        await Promise.all(forks.map((f) => f.kill()));
      }
    });
  });
});

describe("workspaces", () => {
  test("create, list, suspend, resume, delete", async () => {
    const name = `tsws${Date.now() % 100000}`;
    const ws = await Workspace.create(name, { client: d.client });
    try {
      assert.equal(await ws.state(), "running");
      await ws.sandbox.files.write("kept.txt", "kept\n");
      assert.ok((await Workspace.list({ client: d.client })).some((w) => w.name === name));
      const s = await ws.suspend();
      assert.equal(s.workspace, name);
      assert.equal(await ws.state(), "suspended");
      const r = await ws.resume();
      assert.equal(r.workspace.name, name);
      assert.equal(await ws.sandbox.files.read("kept.txt"), "kept\n");
      assert.equal((await Workspace.connect(name, { client: d.client })).info.state, "running");
    } finally {
      await ws.delete();
    }
    await assert.rejects(Workspace.connect(name, { client: d.client }), NotFound);
  });
});

describe("remotes", () => {
  test("push to a directory remote, clone it into a second daemon, fork there", async () => {
    const url = `file://${remotes}/r1`;
    const snap = await withSandbox(async (sb) => {
      await sb.files.write("hello.txt", "from the first daemon\n");
      return sb.snapshot({ message: "to travel", tags: [`travel-${Date.now()}`] });
    });
    const rec = await d.client.addRemote("r1", url);
    assert.deepEqual([rec.name, rec.url], ["r1", url]);
    assert.ok((await d.client.remotes()).some((r) => r.name === "r1"));
    const pushed = await d.client.push({ remote: "r1", snapshots: [snap] });
    assert.ok(pushed.snapshots_sent.includes(snap.id), JSON.stringify(pushed));
    assert.ok(pushed.bytes_sent > 0);
    const again = await d.client.push({ remote: "r1", snapshots: [snap] });
    assert.deepEqual(again.snapshots_sent, []);
    const show = await d.client.remote("r1");
    assert.ok(show.snapshots.some((s) => s.id === snap.id));

    const other = await startDaemon({ remoteRoot: remotes });
    try {
      const cloned = await other.client.clone(url);
      assert.ok(cloned.snapshots_received.includes(snap.id), JSON.stringify(cloned));
      assert.ok(cloned.objects_verified > 0);
      const pulled = await other.client.pull({ remote: "origin" });
      assert.deepEqual(pulled.snapshots_received, []);
      const sb = await Sandbox.create({ client: other.client, snapshot: snap.id });
      try {
        assert.equal(await sb.files.read("hello.txt"), "from the first daemon\n");
      } finally {
        await sb.kill();
      }
    } finally {
      await other.stop();
    }
    // A directory outside the daemon's --remote-root is refused, naming the flag.
    await assert.rejects(d.client.addRemote("out", "file:///etc/tine-x"), (e: TineError) => {
      return e instanceof InvalidInput && /--remote-root/.test(e.message);
    });
    assert.equal((await d.client.removeRemote("r1")).url, url);
    await assert.rejects(d.client.remote("r1"), NotFound);
  });
});

describe("the client", () => {
  test("errors are classes, and the daemon describes itself", async () => {
    await assert.rejects(Sandbox.connect("no-such-sandbox", { client: d.client }), (e: TineError) => {
      return e instanceof NotFound && e.status === 404 && e.code === "not_found";
    });
    const wrong = new Client({ url: d.url, token: "wrong" });
    await assert.rejects(Sandbox.list({ client: wrong }), Unauthorized);
    assert.deepEqual(await wrong.health(), { ok: true });
    wrong.close();
    assert.equal((await d.client.version()).api, "v1");
    assert.match(await d.client.metrics(), /tine_live_sandboxes/);
    assert.match(await d.client.openapi(), /^openapi: 3/);
    // `await using` removes the sandbox at the end of its block.
    let id: string;
    {
      await using sb = await Sandbox.create({ client: d.client });
      id = sb.id;
      assert.equal(await sb.state(), "running");
    }
    await assert.rejects(Sandbox.connect(id, { client: d.client }), NotFound);
    // The Unix socket serves the same API.
    const local = new Client({ url: `unix:${d.socket}`, token: d.token });
    assert.ok(Array.isArray(await Sandbox.list({ client: local })));
    local.close();
  });
});
