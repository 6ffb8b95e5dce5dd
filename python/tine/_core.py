"""What the sync and async clients share: settings, request bodies, results."""

from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Sequence, Union

from .errors import from_response

DEFAULT_URL = "http://127.0.0.1:7777"

Command = Union[str, Sequence[str]]
OutputCallback = Callable[[str], Any]


def split_unix(url: str) -> tuple[str, Optional[str]]:
    """`unix:/path/server.sock` (the daemon's Unix socket) as a base URL for
    HTTP over it and the socket's path; any other URL as it is."""
    if url.startswith("unix:"):
        return "http://tine", url[len("unix:"):]
    return url, None


def settings(url: Optional[str], token: Optional[str]) -> tuple[str, str]:
    """The daemon's URL and token: the arguments, else TINE_URL and TINE_TOKEN
    (or the file TINE_TOKEN_FILE names)."""
    url = url or os.environ.get("TINE_URL") or DEFAULT_URL
    if token is None:
        token = os.environ.get("TINE_TOKEN")
    if token is None and os.environ.get("TINE_TOKEN_FILE"):
        with open(os.environ["TINE_TOKEN_FILE"], encoding="utf-8") as f:
            token = f.read().strip()
    return url.rstrip("/"), token or ""


def raise_for(status: int, body: bytes) -> None:
    if status >= 400:
        raise from_response(status, body)


class Described:
    """What the daemon last said of a sandbox or workspace (`info`, typed by
    each class), and its name."""

    info: Any

    @property
    def name(self) -> str:
        return self.info["name"]


@dataclass
class ExecResult:
    """How a command ended, with what it wrote."""

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool = False
    duration_ms: float = 0.0
    #: Why it ended, when a rollback of the sandbox's processes killed it.
    rolled_back: str | None = None


@dataclass
class EntryInfo:
    """One entry of a directory listing."""

    name: str
    path: str
    kind: str
    size: int
    mode: int
    mtime_ns: int


@dataclass
class Snapshot:
    """A snapshot: its id, and what the daemon said about it."""

    id: str
    info: dict = field(default_factory=dict, repr=False)

    def __str__(self) -> str:
        return self.id


def snapshot_id(snapshot: Union[str, Snapshot]) -> str:
    return snapshot.id if isinstance(snapshot, Snapshot) else str(snapshot)


def merge_body(
    ours: Union[str, Snapshot],
    theirs: Union[str, Snapshot],
    base: Optional[Union[str, Snapshot]],
    message: Optional[str],
) -> dict:
    body: dict = {"ours": snapshot_id(ours), "theirs": snapshot_id(theirs)}
    if base is not None:
        body["base"] = snapshot_id(base)
    if message is not None:
        body["message"] = message
    return body


def exec_body(cmd: Command, env: Optional[dict], timeout_s: Optional[float]) -> dict:
    """A string runs through `sh -c`; a list runs as is."""
    command = ["sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
    body: dict = {"command": command}
    if env:
        body["env"] = {str(k): str(v) for k, v in env.items()}
    if timeout_s is not None:
        body["timeout_s"] = float(timeout_s)
    return body


def create_body(
    name: Optional[str],
    snapshot: Optional[Union[str, Snapshot]],
    directory: Optional[str],
    command: Optional[Sequence[str]],
    env: Optional[dict],
    memory_bytes: Optional[int],
    net: Optional[str],
    seccomp: Optional[bool] = None,
    disk_bytes: Optional[int] = None,
    image: Optional[str] = None,
) -> dict:
    body: dict = {}
    if image is not None:
        body["image"] = image
    if name is not None:
        body["name"] = name
    if snapshot is not None:
        body["from"] = snapshot_id(snapshot)
    if directory is not None:
        body["directory"] = os.path.abspath(directory)
    if command is not None:
        body["command"] = list(command)
    if env:
        body["env"] = {str(k): str(v) for k, v in env.items()}
    if memory_bytes is not None:
        body["memory_bytes"] = int(memory_bytes)
    if disk_bytes is not None:
        body["disk_bytes"] = int(disk_bytes)
    if net is not None:
        body["net"] = net
    if seccomp is not None:
        body["seccomp"] = bool(seccomp)
    return body


class StreamState:
    """Collects a streamed exec: pieces go to the callbacks as they come."""

    def __init__(self, on_stdout: Optional[OutputCallback], on_stderr: Optional[OutputCallback]):
        self.on = {"stdout": on_stdout, "stderr": on_stderr}
        self.parts: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
        self.end: Optional[dict] = None

    def line(self, line: str) -> None:
        if not line.strip():
            return
        event = json.loads(line)
        stream = event.get("stream")
        if stream in self.parts:
            if "data" in event:
                data = event["data"].encode("utf-8")
            else:
                data = base64.b64decode(event.get("data_b64", ""))
            self.parts[stream].append(data)
            cb = self.on[stream]
            if cb is not None:
                cb(data.decode("utf-8", "replace"))
            return
        self.end = event

    def result(self) -> ExecResult:
        end = self.end
        if end is None:
            raise from_response(500, b'{"error":{"code":"internal","message":"the exec stream ended without an outcome"}}')
        if "error" in end:
            raise from_response(500, json.dumps(end).encode())
        return ExecResult(
            stdout=b"".join(self.parts["stdout"]).decode("utf-8", "replace"),
            stderr=b"".join(self.parts["stderr"]).decode("utf-8", "replace"),
            exit_code=end["exit_code"],
            timed_out=end.get("timed_out", False),
            duration_ms=end.get("duration_ms", 0.0),
            rolled_back=end.get("rolled_back"),
        )


def exec_result(doc: dict) -> ExecResult:
    return ExecResult(
        stdout=doc.get("stdout", ""),
        stderr=doc.get("stderr", ""),
        exit_code=doc["exit_code"],
        timed_out=doc.get("timed_out", False),
        duration_ms=doc.get("duration_ms", 0.0),
        rolled_back=doc.get("rolled_back"),
    )


def entries(docs: list) -> list[EntryInfo]:
    return [EntryInfo(**{k: d[k] for k in EntryInfo.__dataclass_fields__}) for d in docs]


def file_params(path: str, mode: Optional[int] = None) -> dict:
    params = {"path": path}
    if mode is not None:
        params["mode"] = format(mode, "o")
    return params


# The repository-wide calls, as (method, path, request keywords): the sync
# and async clients send them alike.
Call = tuple


def quote(segment: str) -> str:
    """A path segment, percent-encoded."""
    from urllib.parse import quote as q

    return q(segment, safe="")


def call_snapshots(limit: Optional[int]) -> Call:
    return ("GET", "/v1/snapshots", {"params": {} if limit is None else {"limit": int(limit)}})


def call_snapshot(spec: Union[str, Snapshot]) -> Call:
    return ("GET", f"/v1/snapshots/{quote(snapshot_id(spec))}", {})


def call_delete_snapshot(spec: Union[str, Snapshot]) -> Call:
    return ("DELETE", f"/v1/snapshots/{quote(snapshot_id(spec))}", {})


def call_diff(a: Union[str, Snapshot], to: Optional[Union[str, Snapshot]], patch: bool) -> Call:
    params: dict = {"patch": str(patch).lower()}
    if to is not None:
        params["to"] = snapshot_id(to)
    return ("GET", f"/v1/snapshots/{quote(snapshot_id(a))}/diff", {"params": params})


def call_tag(spec: Union[str, Snapshot], name: str, force: bool) -> Call:
    return ("POST", f"/v1/snapshots/{quote(snapshot_id(spec))}/tags", {"json": {"name": name, "force": force}})


def call_untag(name: str) -> Call:
    return ("DELETE", f"/v1/tags/{quote(name)}", {})


def call_add_remote(name: str, url: str, endpoint: Optional[str], region: Optional[str]) -> Call:
    body: dict = {"name": name, "url": url}
    if endpoint is not None:
        body["endpoint"] = endpoint
    if region is not None:
        body["region"] = region
    return ("POST", "/v1/remotes", {"json": body})


def call_import_image(
    path: Optional[str], image: Optional[str], names: Sequence[str], podman: Optional[str] = None
) -> Call:
    if (path is None) == (podman is None):
        raise ValueError("import_image: give a path, or podman= (an image in Podman's local store)")
    body: dict = {"names": list(names)}
    if path is not None:
        body["path"] = os.path.abspath(path)
    if podman is not None:
        body["podman"] = podman
    if image is not None:
        body["image"] = image
    return ("POST", "/v1/images", {"json": body})


def call_build_image(
    context: str,
    dockerfile: Optional[str],
    names: Sequence[str],
    net: Optional[str],
    no_cache: bool,
    build_args: Optional[Dict[str, str]] = None,
) -> Call:
    body: dict = {"context": os.path.abspath(context), "names": list(names), "no_cache": no_cache}
    if build_args:
        body["build_args"] = dict(build_args)
    if dockerfile is not None:
        body["dockerfile"] = os.path.abspath(dockerfile)
    if net is not None:
        body["net"] = net
    return ("POST", "/v1/builds", {"json": body, "timeout": None})


def call_push(remote: Optional[str], snapshots: Sequence[Union[str, Snapshot]]) -> Call:
    body: dict = {"snapshots": [snapshot_id(s) for s in snapshots]}
    if remote is not None:
        body["remote"] = remote
    return ("POST", "/v1/push", {"json": body, "timeout": None})


def call_pull(remote: Optional[str], snapshots: Sequence[str]) -> Call:
    body: dict = {"snapshots": list(snapshots)}
    if remote is not None:
        body["remote"] = remote
    return ("POST", "/v1/pull", {"json": body, "timeout": None})


def call_clone(url: str, name: Optional[str], endpoint: Optional[str], region: Optional[str]) -> Call:
    _, _, kw = call_add_remote(name or "origin", url, endpoint, region)
    return ("POST", "/v1/clone", {**kw, "timeout": None})


def workspace_body(
    name: str,
    snapshot: Optional[Union[str, Snapshot]],
    directory: Optional[str],
    command: Optional[Sequence[str]],
    env: Optional[dict],
    keep: Optional[int],
    idle_suspend_s: Optional[int],
) -> dict:
    body: dict = {"name": name, "sandbox": create_body(None, snapshot, directory, command, env, None, None)}
    if keep is not None:
        body["keep"] = keep
    if idle_suspend_s is not None:
        body["idle_suspend_s"] = idle_suspend_s
    return body


def snapshot_body(message: str, tags: Sequence[str], files_only: bool, prepare_forks: int, persist: bool) -> dict:
    return {
        "message": message,
        "tags": list(tags),
        "files_only": files_only,
        "prepare_forks": prepare_forks,
        "persist": persist,
    }


def fork_call(sandbox_id: str, n: int, name: Optional[str], snapshot: Optional[Union[str, Snapshot]]) -> Call:
    """A fork of `snapshot` (claiming its prepared forks), or of one taken now."""
    body: dict = {"n": n}
    if name is not None:
        body["name"] = name
    if snapshot is not None:
        return ("POST", f"/v1/snapshots/{quote(snapshot_id(snapshot))}/fork", {"json": body})
    return ("POST", f"/v1/sandboxes/{sandbox_id}/fork", {"json": body})
