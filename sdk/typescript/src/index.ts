// tine: fork() for an AI agent's whole world — the TypeScript SDK.
//
//   import { Sandbox } from "@tine/sdk";
//   const sb = await Sandbox.create();            // TINE_URL / TINE_TOKEN name the daemon
//   await sb.files.write("a.txt", "hi");
//   const snap = await sb.snapshot({ message: "before" });
//   await sb.exec("rm a.txt");
//   await sb.restore(snap);
//   const branches = await sb.fork(4);

export { Client, DEFAULT_URL, getDefaultClient, snapshotId } from "./client.js";
export type { Answer, ClientOptions, Query, RequestOptions } from "./client.js";
export { Files, Ledger, Sandbox } from "./sandbox.js";
export type { Command } from "./sandbox.js";
export { Workspace } from "./workspace.js";
export * from "./errors.js";
export type * from "./types.js";
