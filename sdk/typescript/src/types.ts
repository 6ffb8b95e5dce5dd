// The shapes of the tine API's requests and answers (docs/openapi.yaml).

export type SandboxState =
  | "created"
  | "starting"
  | "running"
  | "restarting"
  | "exited"
  | "stopped"
  | "prepared"
  | "stale";

/** A sandbox as the daemon describes it. */
export interface SandboxInfo {
  id: string;
  name: string;
  state: SandboxState;
  command: string[];
  isolation?: string;
  base: string | null;
  workspace: string;
  restarts: number;
  exit: { code?: number | null; signal?: number | null; oom?: boolean } | null;
  created_ns: number;
  init_pid: number | null;
  limits: { memory_bytes: number | null; pids: number | null; disk_bytes: number | null };
  disk?: { limit_bytes: number | null; used_bytes: number | null; unlimited_because?: string };
}

/** How a new sandbox is made. */
export interface CreateSandboxOptions {
  name?: string;
  /** A base snapshot (tag or id prefix). */
  snapshot?: string | Snapshot;
  /** A host directory under one of the daemon's --import-root, snapshotted as the base. */
  directory?: string;
  /** Default: `sleep infinity` (a sandbox for exec). */
  command?: string[];
  env?: Record<string, string>;
  memoryBytes?: number;
  pids?: number;
  diskBytes?: number;
  net?: "none" | "private" | "host";
  seccomp?: boolean;
  /**
   * An imported image (name or id) as the sandbox's whole root: its command,
   * environment, working directory and user apply; `command` replaces its cmd.
   */
  image?: string;
}

/** An image in the repository (`tine image import`). */
export interface Image {
  id: string;
  names: string[];
  snapshot: string;
  layers: number;
  source: string;
  created_ns: number;
  entrypoint: string[];
  cmd: string[];
  env: string[];
  workdir: string | null;
  user: string | null;
}

export interface BuiltStep {
  step: number;
  line: number;
  instruction: string;
  cached: boolean;
  snapshot: string | null;
  seconds: number;
  /** A RUN step run: its output's last 4 KiB. */
  output?: string;
}

export interface BuiltImage {
  image: Image;
  steps: BuiltStep[];
  run: number;
  cached: number;
  seconds: number;
}

export interface ImportedImage {
  image: Image;
  layers_applied: number;
  layers_reused: number;
  stored_bytes: number;
  skipped: string[];
  seconds: number;
}

export interface ImageRemoved {
  id: string;
  names: string[];
  image: boolean;
  released: string[];
}

/** One entry of a directory listing (or the file just written). */
export interface FileEntry {
  name: string;
  path: string;
  kind: "file" | "dir" | "symlink" | "other";
  size: number;
  mode: number;
  mtime_ns: number;
}

/** How a command ended, with what it wrote. */
export interface ExecResult {
  stdout: string;
  stderr: string;
  exitCode: number;
  timedOut: boolean;
  durationMs: number;
  /** Output beyond what the daemon keeps was left out. */
  truncated: boolean;
  /** Why it ended, when a rollback of the sandbox's processes killed it. */
  rolledBack: string | null;
}

export interface ExecOptions {
  env?: Record<string, string>;
  timeoutS?: number;
  /** With either callback, output is streamed and reaches it as it comes. */
  onStdout?: (text: string) => void;
  onStderr?: (text: string) => void;
  /** Aborting closes the connection, which kills the command. */
  signal?: AbortSignal;
}

/** A snapshot: its id, and what the daemon said about it. */
export interface Snapshot {
  id: string;
  info: Record<string, unknown>;
}

export interface SnapshotOptions {
  message?: string;
  tags?: string[];
  filesOnly?: boolean;
  /** Then prepare that many native forks of it, which `fork` of it claims. */
  prepareForks?: number;
  /** Also persist the processes with CRIU. */
  persist?: boolean;
}

/** What a rollback changed. */
export interface RestoreResult {
  added: number;
  modified: number;
  deleted: number;
  paused_ms?: number;
  duration_ms?: number;
  [key: string]: unknown;
}

export interface ForkOptions {
  /** Forks are named NAME-1 .. NAME-n. */
  name?: string;
  /** Fork this snapshot (claiming its prepared forks first); default: one taken now. */
  snapshot?: string | Snapshot;
}

export interface ForkResult {
  snapshot: string;
  sandboxes: SandboxInfo[];
  started: boolean;
  processes: number;
  via: "afresh" | "native" | "criu";
  note: string | null;
  duration_ms: number;
  prepared: number;
}

export interface MergeResult {
  base: string;
  ours: string;
  theirs: string;
  snapshot: string;
  merged: number;
  taken: number;
  conflicts: { path: string; kind: string }[];
  duration_ms: number;
  [key: string]: unknown;
}

/** One effect on the ledger. */
export interface LedgerEntry {
  id: number;
  parent: number | null;
  sandbox: string;
  kind: string;
  key: string;
  request: unknown;
  result: unknown;
  time_ns: number;
  visible: boolean;
}

/** A snapshot in a listing. */
export interface SnapshotEntry {
  id: string;
  seq: number;
  tree: string;
  time_ns: number;
  message: string;
  source: string;
  parents: string[];
  tags: string[];
  files: number;
  bytes: number;
  live_processes: number;
  persisted_processes: number;
}

export interface DiffChange {
  path: string;
  kind: string;
  old: unknown;
  new: unknown;
}

export interface DiffResult {
  changes: DiffChange[];
  patches: string[] | null;
  [key: string]: unknown;
}

export interface WorkspaceState {
  seq: number;
  snapshot: string;
  time_ns: number;
  processes: "criu" | "restart";
  process_count: number;
  reason: string | null;
}

export interface WorkspaceInfo {
  name: string;
  state: "running" | "suspended" | "stale";
  sandbox: SandboxInfo;
  keep: number;
  idle_suspend_s: number | null;
  current: number | null;
  states: WorkspaceState[];
}

export interface CreateWorkspaceOptions {
  snapshot?: string | Snapshot;
  directory?: string;
  command?: string[];
  env?: Record<string, string>;
  /** Suspended states kept (default 3). */
  keep?: number;
  /** Suspend after this many seconds without API activity and CPU use. */
  idleSuspendS?: number;
}

export interface Suspended {
  workspace: string;
  state: WorkspaceState;
  already: boolean;
  pruned: number[];
  duration_ms: number;
  [key: string]: unknown;
}

export interface Resumed {
  workspace: WorkspaceInfo;
  from: number | null;
  processes: "criu" | "restart";
  process_count: number;
  already: boolean;
  note: string | null;
  duration_ms: number;
  [key: string]: unknown;
}

/** A named remote: an object store (s3://bucket/prefix) or a directory (file:///path). */
export interface RemoteRecord {
  name: string;
  url: string;
  settings: Record<string, string>;
}

export interface AddRemoteOptions {
  /** S3 only: the endpoint, e.g. http://127.0.0.1:8333. */
  endpoint?: string;
  region?: string;
}

/** A snapshot a remote holds. */
export interface RemoteSnapshot {
  id: string;
  parents: string[];
  time_ns: number;
  message: string;
  bytes: number;
  [key: string]: unknown;
}

export interface RemoteShow {
  remote: RemoteRecord;
  snapshots: RemoteSnapshot[];
  /** [tag, snapshot id] pairs. */
  tags: [string, string][];
}

export interface PushReport {
  remote: string;
  url: string;
  snapshots_sent: string[];
  snapshots_already: number;
  objects_sent: number;
  pack: string | null;
  pack_bytes: number;
  bytes_sent: number;
  finished_earlier_pack: string | null;
  resumed: { parts_already_sent: number; parts: number; bytes_already_sent: number } | null;
  tags_sent: string[];
  duration_ms: number;
}

export interface PullReport {
  remote: string;
  url: string;
  snapshots_received: string[];
  snapshots_already: number;
  packs: string[];
  bytes_received: number;
  objects_verified: number;
  tags_set: string[];
  tags_kept: { name: string; local: string; remote: string }[];
  duration_ms: number;
}
