// Starts a real `tine serve` on loopback over a fresh repository, for the tests.

import { spawn, spawnSync, type ChildProcess } from "node:child_process";
import { existsSync, mkdirSync, mkdtempSync, openSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";

import { Client } from "../src/index.js";

const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), "../../../..");

// What would point the CLI at another repository or daemon than the test's own.
const FOREIGN = ["TINE_REPO", "TINE_URL", "TINE_TOKEN", "TINE_TOKEN_FILE"];

function hermeticEnv(): NodeJS.ProcessEnv {
  const env = { ...process.env };
  for (const k of FOREIGN) delete env[k];
  return env;
}

export function tineBinary(): string {
  const given = process.env["TINE_BIN"];
  if (given) return given;
  for (const profile of ["release", "debug"]) {
    const p = join(ROOT, "target", profile, "tine");
    if (existsSync(p)) return p;
  }
  throw new Error("no tine binary: build it (cargo build -p tine-cli) or set TINE_BIN");
}

export interface Daemon {
  url: string;
  socket: string;
  token: string;
  dir: string;
  client: Client;
  stop(): Promise<void>;
}

/** A daemon over a new repository; `remoteRoot` is its --remote-root. */
export async function startDaemon(opts: { remoteRoot?: string } = {}): Promise<Daemon> {
  const tine = tineBinary();
  const dir = mkdtempSync(join(tmpdir(), "tine-ts-"));
  const work = join(dir, "work");
  mkdirSync(work);
  mkdirSync(join(dir, "import"));
  const env = hermeticEnv();
  const init = spawnSync(tine, ["init"], { cwd: work, env });
  if (init.status !== 0) throw new Error(`tine init: ${init.stderr.toString()}`);
  const args = ["--json", "serve", "--listen", "127.0.0.1:0", "--import-root", join(dir, "import")];
  if (opts.remoteRoot) args.push("--remote-root", opts.remoteRoot);
  // The daemon's log (audit lines) goes to a file beside its repository.
  const log = openSync(join(dir, "serve.log"), "a");
  const proc: ChildProcess = spawn(tine, args, { cwd: work, env, stdio: ["ignore", "pipe", log] });
  const lines = createInterface({ input: proc.stdout! });
  const first = await new Promise<string>((res, rej) => {
    lines.once("line", res);
    proc.once("exit", (code) => rej(new Error(`tine serve exited (${code}) before it listened`)));
  });
  const info = JSON.parse(first) as { url: string; socket: string; token_file: string };
  const token = readFileSync(info.token_file, "utf8").trim();
  const client = new Client({ url: info.url, token });
  return {
    url: info.url,
    socket: info.socket,
    token,
    dir,
    client,
    async stop() {
      client.close();
      const ended = new Promise((res) => proc.once("exit", res));
      proc.kill("SIGTERM");
      await ended;
      const ps = spawnSync(tine, ["--json", "ps", "--all"], { cwd: work, env });
      let ids: string[] = [];
      try {
        ids = (JSON.parse(ps.stdout.toString()) as { id: string }[]).map((s) => s.id);
      } catch {
        // No sandboxes left to list.
      }
      if (ids.length) spawnSync(tine, ["rm", "-f", ...ids], { cwd: work, env });
      rmSync(dir, { recursive: true, force: true });
    },
  };
}
