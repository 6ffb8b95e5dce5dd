// The connection to `tine serve`: HTTP over TCP or its Unix socket, the bearer
// token, errors as classes; and the repository-wide calls (snapshots, tags,
// the ledger, workspaces, remotes, push, pull, clone, health).

import * as http from "node:http";
import { readFileSync } from "node:fs";

import { ConnectionFailed, fromResponse } from "./errors.js";
import type {
  AddRemoteOptions,
  DiffResult,
  LedgerEntry,
  PullReport,
  PushReport,
  Image,
  ImageRemoved,
  ImportedImage,
  BuiltImage,
  RemoteRecord,
  RemoteShow,
  Snapshot,
  SnapshotEntry,
} from "./types.js";

export const DEFAULT_URL = "http://127.0.0.1:7777";

export interface ClientOptions {
  /** `http://HOST:PORT` or `unix:/path/server.sock` (default: TINE_URL, else http://127.0.0.1:7777). */
  url?: string;
  /** The bearer token (default: TINE_TOKEN, else the file TINE_TOKEN_FILE names). */
  token?: string;
  /** Longest wait for an answer, in ms (exec waits for its command instead). Default 300 s. */
  timeoutMs?: number;
}

export type Query = Record<string, string | number | boolean | undefined>;

export interface RequestOptions {
  query?: Query;
  json?: unknown;
  body?: Uint8Array | string;
  /** No timeout (an exec runs as long as its command). */
  noTimeout?: boolean;
  signal?: AbortSignal;
}

/** An answer, read whole. */
export interface Answer {
  status: number;
  headers: http.IncomingHttpHeaders;
  body: Buffer;
}

/** A snapshot's id, from a snapshot or its name. */
export function snapshotId(s: string | Snapshot): string {
  return typeof s === "string" ? s : s.id;
}

/** A path segment, percent-encoded. */
export function seg(s: string): string {
  return encodeURIComponent(s);
}

export class Client {
  readonly url: string;
  readonly #token: string;
  readonly #timeoutMs: number;
  readonly #base: URL;
  readonly #socketPath: string | undefined;
  readonly #agent: http.Agent;

  constructor(opts: ClientOptions = {}) {
    const url = (opts.url ?? process.env["TINE_URL"] ?? DEFAULT_URL).replace(/\/+$/, "");
    let token = opts.token ?? process.env["TINE_TOKEN"];
    const tokenFile = process.env["TINE_TOKEN_FILE"];
    if (token === undefined && tokenFile) {
      token = readFileSync(tokenFile, "utf8").trim();
    }
    this.url = url;
    this.#token = token ?? "";
    this.#timeoutMs = opts.timeoutMs ?? 300_000;
    if (url.startsWith("unix:")) {
      this.#socketPath = url.slice("unix:".length);
      this.#base = new URL("http://tine");
    } else {
      this.#base = new URL(url);
      if (this.#base.protocol !== "http:") {
        throw new ConnectionFailed("connection", `${url}: only http:// and unix: URLs are supported`);
      }
    }
    this.#agent = new http.Agent({ keepAlive: true });
  }

  /** Sends one request; the answer's headers come with its body as a stream. */
  open(method: string, path: string, opts: RequestOptions = {}): Promise<http.IncomingMessage> {
    const target = new URL(path, this.#base);
    for (const [k, v] of Object.entries(opts.query ?? {})) {
      if (v !== undefined) target.searchParams.set(k, String(v));
    }
    let payload: Buffer | undefined;
    const headers: Record<string, string> = { Authorization: `Bearer ${this.#token}` };
    if (opts.json !== undefined) {
      payload = Buffer.from(JSON.stringify(opts.json));
      headers["Content-Type"] = "application/json";
    } else if (opts.body !== undefined) {
      payload = Buffer.from(opts.body);
      headers["Content-Type"] = "application/octet-stream";
    }
    if (payload !== undefined) headers["Content-Length"] = String(payload.length);
    return new Promise((resolve, reject) => {
      const req = http.request(
        {
          method,
          host: this.#base.hostname,
          port: this.#base.port || 80,
          socketPath: this.#socketPath,
          path: target.pathname + target.search,
          headers,
          agent: this.#agent,
          signal: opts.signal,
        },
        resolve,
      );
      if (!opts.noTimeout) {
        req.setTimeout(this.#timeoutMs, () =>
          req.destroy(new Error(`no answer in ${this.#timeoutMs} ms`)),
        );
      }
      req.on("error", (e: Error) => reject(new ConnectionFailed("connection", `${this.url}: ${e.message}`)));
      req.end(payload);
    });
  }

  /** One request, its answer read whole; an error answer is thrown as its class. */
  async request(method: string, path: string, opts: RequestOptions = {}): Promise<Answer> {
    const res = await this.open(method, path, opts);
    const body = await readAll(res, this.url);
    const status = res.statusCode ?? 0;
    if (status >= 400) throw fromResponse(status, body.toString("utf8"));
    return { status, headers: res.headers, body };
  }

  /** One request, its JSON answer. */
  async json<T>(method: string, path: string, opts: RequestOptions = {}): Promise<T> {
    const a = await this.request(method, path, opts);
    return JSON.parse(a.body.toString("utf8")) as T;
  }

  /** Closes kept-alive connections. */
  close(): void {
    this.#agent.destroy();
  }

  // Health and self-description.

  /** Liveness (needs no token). */
  health(): Promise<{ ok: boolean }> {
    return this.json("GET", "/healthz");
  }

  version(): Promise<{ version: string; api: string }> {
    return this.json("GET", "/version");
  }

  /** Prometheus metrics (OpenMetrics text). */
  async metrics(): Promise<string> {
    return (await this.request("GET", "/metrics")).body.toString("utf8");
  }

  /** The daemon's OpenAPI description (YAML). */
  async openapi(): Promise<string> {
    return (await this.request("GET", "/v1/openapi.yaml")).body.toString("utf8");
  }

  // Snapshots and tags.

  /** Snapshots, newest first. */
  snapshots(limit?: number): Promise<SnapshotEntry[]> {
    return this.json("GET", "/v1/snapshots", { query: { limit } });
  }

  /** One snapshot with its attachments and the process state it holds. */
  snapshot(spec: string | Snapshot): Promise<Record<string, unknown>> {
    return this.json("GET", `/v1/snapshots/${seg(snapshotId(spec))}`);
  }

  /** Deletes a snapshot (refused while anything depends on it). */
  deleteSnapshot(spec: string | Snapshot): Promise<{ deleted: string }> {
    return this.json("DELETE", `/v1/snapshots/${seg(snapshotId(spec))}`);
  }

  /** Changes from `from` to `to` (default: its live sandbox). */
  diff(from: string | Snapshot, opts: { to?: string | Snapshot; patch?: boolean } = {}): Promise<DiffResult> {
    return this.json("GET", `/v1/snapshots/${seg(snapshotId(from))}/diff`, {
      query: { to: opts.to === undefined ? undefined : snapshotId(opts.to), patch: opts.patch },
    });
  }

  /** Points tag `name` at a snapshot (`force`: move it if it exists). */
  tag(spec: string | Snapshot, name: string, force = false): Promise<{ tag: string; snapshot: string }> {
    return this.json("POST", `/v1/snapshots/${seg(snapshotId(spec))}/tags`, { json: { name, force } });
  }

  untag(name: string): Promise<{ deleted: string; was: string }> {
    return this.json("DELETE", `/v1/tags/${seg(name)}`);
  }

  // The ledger, repository-wide.

  /** Every ledger entry ever recorded, of every sandbox. */
  ledger(): Promise<LedgerEntry[]> {
    return this.json("GET", "/v1/ledger");
  }

  /** Checks every entry's HMAC chain and every snapshot's recorded head. */
  verifyLedger(): Promise<{ verified: number }> {
    return this.json("GET", "/v1/ledger/verify");
  }

  // Remotes.

  /** The images imported into the repository. */
  images(): Promise<Image[]> {
    return this.json("GET", "/v1/images");
  }

  /** One image, by name or id: its layers, and what it runs. */
  image(name: string): Promise<Image> {
    return this.json("GET", `/v1/images/${seg(name)}`);
  }

  /**
   * Imports an OCI layout or archive, or a docker/podman save archive, under
   * the daemon's --import-root; each layer becomes a snapshot.
   */
  importImage(path: string, opts: { image?: string; names?: string[] } = {}): Promise<ImportedImage> {
    return this.json("POST", "/v1/images", { json: { path, names: opts.names ?? [], ...(opts.image ? { image: opts.image } : {}) } });
  }

  /** Builds an image from a Dockerfile (its context under the daemon's --import-root): each step a snapshot, unchanged steps from the cache. */
  buildImage(
    context: string,
    opts: {
      dockerfile?: string;
      names?: string[];
      net?: "none" | "host" | "private";
      noCache?: boolean;
      buildArgs?: Record<string, string>;
    } = {},
  ): Promise<BuiltImage> {
    return this.json("POST", "/v1/builds", {
      json: {
        context,
        names: opts.names ?? [],
        no_cache: opts.noCache ?? false,
        ...(opts.dockerfile ? { dockerfile: opts.dockerfile } : {}),
        ...(opts.net ? { net: opts.net } : {}),
        ...(opts.buildArgs ? { build_args: opts.buildArgs } : {}),
      },
      noTimeout: true,
    });
  }

  /** Imports an image of the daemon host's Podman store (a name or id). */
  importPodmanImage(name: string, opts: { names?: string[] } = {}): Promise<ImportedImage> {
    return this.json("POST", "/v1/images", { json: { podman: name, names: opts.names ?? [] } });
  }

  /** Removes an image, or one of its names. */
  removeImage(name: string): Promise<ImageRemoved> {
    return this.json("DELETE", `/v1/images/${seg(name)}`);
  }

  remotes(): Promise<RemoteRecord[]> {
    return this.json("GET", "/v1/remotes");
  }

  /** Names a remote: s3://bucket/prefix, or file:///path under the daemon's --remote-root. */
  addRemote(name: string, url: string, opts: AddRemoteOptions = {}): Promise<RemoteRecord> {
    return this.json("POST", "/v1/remotes", { json: { name, url, ...opts } });
  }

  /** What a remote holds: its snapshots and tags. */
  remote(name: string): Promise<RemoteShow> {
    return this.json("GET", `/v1/remotes/${seg(name)}`);
  }

  /** Forgets a remote (what it holds stays where it is). */
  removeRemote(name: string): Promise<RemoteRecord> {
    return this.json("DELETE", `/v1/remotes/${seg(name)}`);
  }

  /** Sends snapshots (default: all, with every tag) and their ancestors; only what the remote lacks travels. */
  push(opts: { remote?: string; snapshots?: (string | Snapshot)[] } = {}): Promise<PushReport> {
    return this.json("POST", "/v1/push", {
      json: { remote: opts.remote, snapshots: (opts.snapshots ?? []).map(snapshotId) },
      noTimeout: true,
    });
  }

  /** Fetches snapshots (default: all the remote has), each object verified by its hash. */
  pull(opts: { remote?: string; snapshots?: string[] } = {}): Promise<PullReport> {
    return this.json("POST", "/v1/pull", {
      json: { remote: opts.remote, snapshots: opts.snapshots ?? [] },
      noTimeout: true,
    });
  }

  /** Names the remote at `url` (`origin` by default) and pulls everything it holds. */
  clone(url: string, opts: AddRemoteOptions & { name?: string } = {}): Promise<PullReport> {
    return this.json("POST", "/v1/clone", { json: { url, ...opts }, noTimeout: true });
  }
}

/** An answer's body, whole. */
export function readAll(res: http.IncomingMessage, url: string): Promise<Buffer> {
  return new Promise((resolve, reject) => {
    const parts: Buffer[] = [];
    res.on("data", (c: Buffer) => parts.push(c));
    res.on("end", () => resolve(Buffer.concat(parts)));
    res.on("error", (e: Error) => reject(new ConnectionFailed("connection", `${url}: ${e.message}`)));
  });
}

let defaultClient: Client | undefined;

/** The client made from TINE_URL and TINE_TOKEN, on first use. */
export function getDefaultClient(): Client {
  defaultClient ??= new Client();
  return defaultClient;
}
