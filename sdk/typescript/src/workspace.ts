// A workspace: a named, long-lived sandbox that suspends and resumes.

import { Client, getDefaultClient, seg } from "./client.js";
import { Sandbox, createBody } from "./sandbox.js";
import type { CreateWorkspaceOptions, Resumed, Suspended, WorkspaceInfo } from "./types.js";

export class Workspace {
  info: WorkspaceInfo;
  readonly client: Client;

  constructor(info: WorkspaceInfo, client: Client = getDefaultClient()) {
    this.info = info;
    this.client = client;
  }

  get name(): string {
    return this.info.name;
  }

  /** Its sandbox, as last described. */
  get sandbox(): Sandbox {
    return new Sandbox(this.info.sandbox, this.client);
  }

  static async create(name: string, opts: CreateWorkspaceOptions & { client?: Client } = {}): Promise<Workspace> {
    const c = opts.client ?? getDefaultClient();
    const body: Record<string, unknown> = {
      name,
      sandbox: createBody({
        snapshot: opts.snapshot,
        directory: opts.directory,
        command: opts.command,
        env: opts.env,
      }),
    };
    if (opts.keep !== undefined) body["keep"] = opts.keep;
    if (opts.idleSuspendS !== undefined) body["idle_suspend_s"] = opts.idleSuspendS;
    return new Workspace(await c.json("POST", "/v1/workspaces", { json: body }), c);
  }

  static async connect(name: string, opts: { client?: Client } = {}): Promise<Workspace> {
    const c = opts.client ?? getDefaultClient();
    return new Workspace(await c.json("GET", `/v1/workspaces/${seg(name)}`), c);
  }

  static async list(opts: { client?: Client } = {}): Promise<Workspace[]> {
    const c = opts.client ?? getDefaultClient();
    const infos = await c.json<WorkspaceInfo[]>("GET", "/v1/workspaces");
    return infos.map((i) => new Workspace(i, c));
  }

  async refresh(): Promise<Workspace> {
    this.info = await this.client.json("GET", `/v1/workspaces/${seg(this.name)}`);
    return this;
  }

  async state(): Promise<WorkspaceInfo["state"]> {
    return (await this.refresh()).info.state;
  }

  /** Makes its state durable (processes through CRIU where that works) and stops it. */
  suspend(): Promise<Suspended> {
    return this.client.json("POST", `/v1/workspaces/${seg(this.name)}/suspend`, { noTimeout: true });
  }

  async resume(): Promise<Resumed> {
    const doc = await this.client.json<Resumed>("POST", `/v1/workspaces/${seg(this.name)}/resume`, {
      noTimeout: true,
    });
    this.info = doc.workspace;
    return doc;
  }

  async delete(): Promise<void> {
    await this.client.request("DELETE", `/v1/workspaces/${seg(this.name)}`);
  }
}
