"""The shapes of the tine API's answers (docs/openapi.yaml), as TypedDicts:
what `Sandbox.info`, `Workspace.info` and the calls that answer plain JSON
return. Extra keys a newer daemon adds are kept as they come."""

from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional, Tuple

if sys.version_info >= (3, 11):
    from typing import Literal, NotRequired, TypedDict
else:  # pragma: no cover - older Pythons
    from typing_extensions import Literal, NotRequired, TypedDict

SandboxState = Literal["created", "starting", "running", "restarting", "exited", "stopped", "prepared", "stale"]


class Limits(TypedDict):
    memory_bytes: Optional[int]
    pids: Optional[int]
    disk_bytes: Optional[int]


class SandboxInfo(TypedDict):
    id: str
    name: str
    state: SandboxState
    command: List[str]
    base: Optional[str]
    workspace: str
    restarts: int
    exit: Optional[Dict[str, Any]]
    created_ns: int
    init_pid: Optional[int]
    limits: Limits
    isolation: NotRequired[str]
    disk: NotRequired[Dict[str, Any]]


class RestoreResult(TypedDict):
    added: int
    modified: int
    deleted: int
    paused_ms: NotRequired[float]
    duration_ms: NotRequired[float]


class MergeResult(TypedDict):
    base: str
    ours: str
    theirs: str
    snapshot: str
    merged: int
    taken: int
    conflicts: List[Dict[str, str]]
    duration_ms: float


class LedgerEntry(TypedDict):
    id: int
    parent: Optional[int]
    sandbox: str
    kind: str
    key: str
    request: Any
    result: Any
    time_ns: int
    visible: bool


class SnapshotEntry(TypedDict):
    id: str
    seq: int
    tree: str
    time_ns: int
    message: str
    source: str
    parents: List[str]
    tags: List[str]
    files: int
    bytes: int
    live_processes: int
    persisted_processes: int


class DiffResult(TypedDict):
    changes: List[Dict[str, Any]]
    patches: Optional[List[str]]


class WorkspaceStateRecord(TypedDict):
    seq: int
    snapshot: str
    time_ns: int
    processes: Literal["criu", "restart"]
    process_count: int
    reason: Optional[str]


class WorkspaceInfo(TypedDict):
    name: str
    state: Literal["running", "suspended", "stale"]
    sandbox: SandboxInfo
    keep: int
    idle_suspend_s: Optional[int]
    current: Optional[int]
    states: List[WorkspaceStateRecord]


class Suspended(TypedDict):
    workspace: str
    state: WorkspaceStateRecord
    already: bool
    pruned: List[int]
    duration_ms: float


class Resumed(TypedDict):
    workspace: WorkspaceInfo
    processes: Literal["criu", "restart"]
    process_count: int
    already: bool
    note: Optional[str]
    duration_ms: float


class Image(TypedDict):
    id: str
    names: List[str]
    snapshot: str
    layers: int
    source: str
    created_ns: int
    entrypoint: List[str]
    cmd: List[str]
    env: List[str]
    workdir: Optional[str]
    user: Optional[str]


class ImportedImage(TypedDict):
    image: Image
    layers_applied: int
    layers_reused: int
    stored_bytes: int
    skipped: List[str]
    seconds: float


class BuiltStep(TypedDict, total=False):
    step: int
    line: int
    instruction: str
    cached: bool
    snapshot: Optional[str]
    seconds: float
    output: str


class BuiltImage(TypedDict):
    image: Image
    steps: List[BuiltStep]
    run: int
    cached: int
    seconds: float


class RemoteRecord(TypedDict):
    name: str
    url: str
    settings: Dict[str, str]


class RemoteShow(TypedDict):
    remote: RemoteRecord
    snapshots: List[Dict[str, Any]]
    #: [tag, snapshot id] pairs.
    tags: List[Tuple[str, str]]


class PushReport(TypedDict):
    remote: str
    url: str
    snapshots_sent: List[str]
    snapshots_already: int
    objects_sent: int
    pack: Optional[str]
    pack_bytes: int
    bytes_sent: int
    finished_earlier_pack: Optional[str]
    resumed: Optional[Dict[str, int]]
    tags_sent: List[str]
    duration_ms: float


class PullReport(TypedDict):
    remote: str
    url: str
    snapshots_received: List[str]
    snapshots_already: int
    packs: List[str]
    bytes_received: int
    objects_verified: int
    tags_set: List[str]
    tags_kept: List[Dict[str, str]]
    duration_ms: float
