// A live sandbox: exec (collected or streamed), files, snapshot, restore,
// fork, merge, its ledger, stop and removal.

import { Client, getDefaultClient, readAll, seg, snapshotId } from "./client.js";
import { Internal, fromResponse } from "./errors.js";
import type {
  CreateSandboxOptions,
  ExecOptions,
  ExecResult,
  FileEntry,
  ForkOptions,
  ForkResult,
  LedgerEntry,
  MergeResult,
  RestoreResult,
  SandboxInfo,
  SandboxState,
  Snapshot,
  SnapshotOptions,
} from "./types.js";

/** A command: a string runs through `sh -c`; an array runs as is. */
export type Command = string | string[];

/** The body of `POST /v1/sandboxes` for these options. */
export function createBody(o: CreateSandboxOptions): Record<string, unknown> {
  const body: Record<string, unknown> = {};
  if (o.name !== undefined) body["name"] = o.name;
  if (o.snapshot !== undefined) body["from"] = snapshotId(o.snapshot);
  if (o.directory !== undefined) body["directory"] = o.directory;
  if (o.command !== undefined) body["command"] = o.command;
  if (o.env !== undefined) body["env"] = o.env;
  if (o.memoryBytes !== undefined) body["memory_bytes"] = o.memoryBytes;
  if (o.pids !== undefined) body["pids"] = o.pids;
  if (o.diskBytes !== undefined) body["disk_bytes"] = o.diskBytes;
  if (o.net !== undefined) body["net"] = o.net;
  if (o.seccomp !== undefined) body["seccomp"] = o.seccomp;
  if (o.image !== undefined) body["image"] = o.image;
  return body;
}

interface ExecAnswer {
  stdout?: string;
  stderr?: string;
  exit_code: number;
  timed_out?: boolean;
  duration_ms?: number;
  truncated?: boolean;
  rolled_back?: string | null;
  error?: { code: string; message: string };
}

function execResult(doc: ExecAnswer, stdout: string, stderr: string): ExecResult {
  return {
    stdout,
    stderr,
    exitCode: doc.exit_code,
    timedOut: doc.timed_out ?? false,
    durationMs: doc.duration_ms ?? 0,
    truncated: doc.truncated ?? false,
    rolledBack: doc.rolled_back ?? null,
  };
}

/** A sandbox's files, by the paths it sees (`/workspace/...`, or relative to it). */
export class Files {
  readonly #sb: Sandbox;

  constructor(sandbox: Sandbox) {
    this.#sb = sandbox;
  }

  async readBytes(path: string): Promise<Buffer> {
    const a = await this.#sb.client.request("GET", `/v1/sandboxes/${seg(this.#sb.id)}/files/content`, {
      query: { path },
    });
    return a.body;
  }

  async read(path: string): Promise<string> {
    return (await this.readBytes(path)).toString("utf8");
  }

  /** Writes atomically, making parent directories; `mode` as a number (0o755). */
  write(path: string, data: string | Uint8Array, mode?: number): Promise<FileEntry> {
    return this.#sb.client.json("PUT", `/v1/sandboxes/${seg(this.#sb.id)}/files/content`, {
      query: { path, mode: mode === undefined ? undefined : mode.toString(8) },
      body: data,
    });
  }

  list(path = "/workspace"): Promise<FileEntry[]> {
    return this.#sb.client.json("GET", `/v1/sandboxes/${seg(this.#sb.id)}/files`, { query: { path } });
  }
}

/** A sandbox's effects ledger: record what it did outside, look it up before doing it again. */
export class Ledger {
  readonly #sb: Sandbox;

  constructor(sandbox: Sandbox) {
    this.#sb = sandbox;
  }

  record(kind: string, key: string, request: unknown, result: unknown): Promise<LedgerEntry> {
    return this.#sb.client.json("POST", `/v1/sandboxes/${seg(this.#sb.id)}/ledger`, {
      json: { kind, key, request, result },
    });
  }

  /** The effect recorded under `key` as of the sandbox's current state, or null. */
  async lookup(key: string): Promise<LedgerEntry | null> {
    try {
      return await this.#sb.client.json("GET", `/v1/sandboxes/${seg(this.#sb.id)}/ledger/lookup`, {
        query: { key },
      });
    } catch (e) {
      if (e instanceof Error && (e as { code?: string }).code === "not_found") return null;
      throw e;
    }
  }

  /** The visible ledger (`all`: with entries a rollback abandoned). */
  list(opts: { all?: boolean } = {}): Promise<LedgerEntry[]> {
    return this.#sb.client.json("GET", `/v1/sandboxes/${seg(this.#sb.id)}/ledger`, {
      query: { all: opts.all ?? false },
    });
  }
}

export class Sandbox {
  info: SandboxInfo;
  readonly client: Client;
  readonly files: Files;
  readonly ledger: Ledger;

  constructor(info: SandboxInfo, client: Client = getDefaultClient()) {
    this.info = info;
    this.client = client;
    this.files = new Files(this);
    this.ledger = new Ledger(this);
  }

  get id(): string {
    return this.info.id;
  }

  get name(): string {
    return this.info.name;
  }

  /** Makes and starts a sandbox: an empty workspace, or one from a snapshot or host directory. */
  static async create(opts: CreateSandboxOptions & { client?: Client } = {}): Promise<Sandbox> {
    const c = opts.client ?? getDefaultClient();
    return new Sandbox(await c.json("POST", "/v1/sandboxes", { json: createBody(opts) }), c);
  }

  /** The sandbox named `nameOrId` (a name or an id prefix). */
  static async connect(nameOrId: string, opts: { client?: Client } = {}): Promise<Sandbox> {
    const c = opts.client ?? getDefaultClient();
    return new Sandbox(await c.json("GET", `/v1/sandboxes/${seg(nameOrId)}`), c);
  }

  /** Live sandboxes (`all`: ended ones too). */
  static async list(opts: { all?: boolean; client?: Client } = {}): Promise<Sandbox[]> {
    const c = opts.client ?? getDefaultClient();
    const infos = await c.json<SandboxInfo[]>("GET", "/v1/sandboxes", { query: { all: opts.all ?? false } });
    return infos.map((i) => new Sandbox(i, c));
  }

  /** Reads its record again. */
  async refresh(): Promise<Sandbox> {
    this.info = await this.client.json("GET", `/v1/sandboxes/${seg(this.id)}`);
    return this;
  }

  /** Its state now. */
  async state(): Promise<SandboxState> {
    return (await this.refresh()).info.state;
  }

  /**
   * Runs `cmd` and resolves to its output and exit code. With `onStdout` or
   * `onStderr`, output reaches them as it comes.
   */
  async exec(cmd: Command, opts: ExecOptions = {}): Promise<ExecResult> {
    const body: Record<string, unknown> = {
      command: typeof cmd === "string" ? ["sh", "-c", cmd] : cmd,
    };
    if (opts.env !== undefined) body["env"] = opts.env;
    if (opts.timeoutS !== undefined) body["timeout_s"] = opts.timeoutS;
    const path = `/v1/sandboxes/${seg(this.id)}/exec`;
    if (opts.onStdout === undefined && opts.onStderr === undefined) {
      const doc = await this.client.json<ExecAnswer>("POST", path, {
        json: body,
        noTimeout: true,
        signal: opts.signal,
      });
      return execResult(doc, doc.stdout ?? "", doc.stderr ?? "");
    }
    const res = await this.client.open("POST", path, {
      json: body,
      query: { stream: true },
      noTimeout: true,
      signal: opts.signal,
    });
    if ((res.statusCode ?? 0) >= 400) {
      throw fromResponse(res.statusCode ?? 0, (await readAll(res, this.client.url)).toString("utf8"));
    }
    const parts: Record<"stdout" | "stderr", Buffer[]> = { stdout: [], stderr: [] };
    const on = { stdout: opts.onStdout, stderr: opts.onStderr };
    let end: ExecAnswer | undefined;
    let pending = "";
    const take = (line: string): void => {
      if (!line.trim()) return;
      const ev = JSON.parse(line) as { stream?: string; data?: string; data_b64?: string } & ExecAnswer;
      if (ev.stream === "stdout" || ev.stream === "stderr") {
        const data = ev.data !== undefined ? Buffer.from(ev.data, "utf8") : Buffer.from(ev.data_b64 ?? "", "base64");
        parts[ev.stream].push(data);
        on[ev.stream]?.(data.toString("utf8"));
        return;
      }
      end = ev;
    };
    for await (const chunk of res) {
      pending += (chunk as Buffer).toString("utf8");
      let nl: number;
      while ((nl = pending.indexOf("\n")) >= 0) {
        take(pending.slice(0, nl));
        pending = pending.slice(nl + 1);
      }
    }
    take(pending);
    if (end === undefined) throw new Internal("internal", "the exec stream ended without an outcome");
    if (end.error !== undefined) throw fromResponse(500, JSON.stringify(end));
    return execResult(end, Buffer.concat(parts.stdout).toString("utf8"), Buffer.concat(parts.stderr).toString("utf8"));
  }

  /** Snapshots files and processes (templates by native fork). */
  async snapshot(opts: SnapshotOptions = {}): Promise<Snapshot> {
    const doc = await this.client.json<Record<string, unknown>>("POST", `/v1/sandboxes/${seg(this.id)}/snapshot`, {
      json: {
        message: opts.message ?? "",
        tags: opts.tags ?? [],
        files_only: opts.filesOnly ?? false,
        prepare_forks: opts.prepareForks ?? 0,
        persist: opts.persist ?? false,
      },
    });
    return { id: String(doc["id"]), info: doc };
  }

  /** Rolls back in place to `snapshot`, processes too when it holds them. */
  restore(snapshot: string | Snapshot, opts: { filesOnly?: boolean } = {}): Promise<RestoreResult> {
    return this.client.json("POST", `/v1/sandboxes/${seg(this.id)}/restore`, {
      json: { snapshot: snapshotId(snapshot), files_only: opts.filesOnly ?? false },
    });
  }

  /** `n` new running sandboxes from a snapshot of this one (taken now, or `opts.snapshot`). */
  async fork(n = 1, opts: ForkOptions = {}): Promise<Sandbox[]> {
    const body: Record<string, unknown> = { n };
    if (opts.name !== undefined) body["name"] = opts.name;
    const doc =
      opts.snapshot !== undefined
        ? await this.client.json<ForkResult>("POST", `/v1/snapshots/${seg(snapshotId(opts.snapshot))}/fork`, {
            json: body,
          })
        : await this.client.json<ForkResult>("POST", `/v1/sandboxes/${seg(this.id)}/fork`, { json: body });
    return doc.sandboxes.map((i) => new Sandbox(i, this.client));
  }

  /** Three-way merge of snapshot `theirs` into `ours`, into this sandbox's files. */
  merge(
    ours: string | Snapshot,
    theirs: string | Snapshot,
    opts: { base?: string | Snapshot; message?: string } = {},
  ): Promise<MergeResult> {
    const body: Record<string, unknown> = { ours: snapshotId(ours), theirs: snapshotId(theirs) };
    if (opts.base !== undefined) body["base"] = snapshotId(opts.base);
    if (opts.message !== undefined) body["message"] = opts.message;
    return this.client.json("POST", `/v1/sandboxes/${seg(this.id)}/merge`, { json: body });
  }

  /** Stops it (SIGTERM, then SIGKILL after `timeoutS`). */
  async stop(opts: { timeoutS?: number } = {}): Promise<void> {
    this.info = await this.client.json("POST", `/v1/sandboxes/${seg(this.id)}/stop`, {
      query: { timeout_s: opts.timeoutS },
    });
  }

  /** Removes the sandbox and its files (stopping it first). */
  async kill(): Promise<void> {
    await this.client.request("DELETE", `/v1/sandboxes/${seg(this.id)}`, { query: { force: true } });
  }

  /** `await using sb = await Sandbox.create()` removes it at the end. */
  async [Symbol.asyncDispose](): Promise<void> {
    await this.kill();
  }
}
