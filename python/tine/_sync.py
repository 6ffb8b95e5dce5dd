"""The synchronous client."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Union

import httpx

from . import _core as core
from . import types as t
from .errors import ConnectionFailed, NotFound


class Client:
    """A connection to `tine serve` (URL and token from the arguments, else
    TINE_URL and TINE_TOKEN / TINE_TOKEN_FILE)."""

    def __init__(self, url: Optional[str] = None, token: Optional[str] = None, timeout: float = 300.0):
        self.url, token = core.settings(url, token)
        base, socket = core.split_unix(self.url)
        self._http = httpx.Client(
            base_url=base,
            transport=httpx.HTTPTransport(uds=socket) if socket else None,
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout,
        )

    def request(self, method: str, path: str, **kw) -> httpx.Response:
        try:
            r = self._http.request(method, path, **kw)
        except httpx.TransportError as e:
            raise ConnectionFailed(f"{self.url}: {e}") from e
        core.raise_for(r.status_code, r.content)
        return r

    def json(self, method: str, path: str, **kw) -> Any:
        return self.request(method, path, **kw).json()

    def send(self, call: core.Call) -> Any:
        method, path, kw = call
        return self.json(method, path, **kw)

    def close(self) -> None:
        self._http.close()

    # Health and self-description.

    def health(self) -> dict:
        """Liveness (needs no token)."""
        return self.json("GET", "/healthz")

    def version(self) -> dict:
        return self.json("GET", "/version")

    def metrics(self) -> str:
        """Prometheus metrics (OpenMetrics text)."""
        return self.request("GET", "/metrics").text

    def openapi(self) -> str:
        """The daemon's OpenAPI description (YAML)."""
        return self.request("GET", "/v1/openapi.yaml").text

    # Snapshots and tags.

    def snapshots(self, limit: Optional[int] = None) -> List[t.SnapshotEntry]:
        """Snapshots, newest first."""
        return self.send(core.call_snapshots(limit))

    def snapshot(self, spec: Union[str, core.Snapshot]) -> dict:
        """One snapshot, with its attachments and the process state it holds."""
        return self.send(core.call_snapshot(spec))

    def delete_snapshot(self, spec: Union[str, core.Snapshot]) -> dict:
        """Deletes a snapshot (refused while anything depends on it)."""
        return self.send(core.call_delete_snapshot(spec))

    def diff(
        self, a: Union[str, core.Snapshot], to: Optional[Union[str, core.Snapshot]] = None, *, patch: bool = False
    ) -> t.DiffResult:
        """Changes from snapshot `a` to `to` (default: its live sandbox)."""
        return self.send(core.call_diff(a, to, patch))

    def tag(self, spec: Union[str, core.Snapshot], name: str, *, force: bool = False) -> dict:
        return self.send(core.call_tag(spec, name, force))

    def untag(self, name: str) -> dict:
        return self.send(core.call_untag(name))

    # The ledger, repository-wide.

    def ledger(self) -> List[t.LedgerEntry]:
        """Every ledger entry ever recorded, of every sandbox."""
        return self.json("GET", "/v1/ledger")

    def verify_ledger(self) -> dict:
        """Checks every entry's HMAC chain and every snapshot's recorded head."""
        return self.json("GET", "/v1/ledger/verify")

    # Remotes.

    def images(self) -> List[t.Image]:
        """The images imported into the repository."""
        return self.json("GET", "/v1/images")

    def image(self, name: str) -> t.Image:
        """One image, by name or id: its layers, and what it runs."""
        return self.json("GET", f"/v1/images/{core.quote(name)}")

    def import_image(
        self,
        path: Optional[str] = None,
        *,
        image: Optional[str] = None,
        names: Sequence[str] = (),
        podman: Optional[str] = None,
    ) -> t.ImportedImage:
        """Imports an OCI layout or archive, or a docker/podman save archive, under the
        daemon's --import-root, or (``podman=NAME``) an image of the daemon host's
        Podman store; each layer becomes a snapshot."""
        return self.send(core.call_import_image(path, image, names, podman))

    def build_image(
        self,
        context: str,
        *,
        dockerfile: Optional[str] = None,
        names: Sequence[str] = (),
        net: Optional[str] = None,
        no_cache: bool = False,
        build_args: Optional[Dict[str, str]] = None,
    ) -> t.BuiltImage:
        """Builds an image from a Dockerfile (its context under the daemon's
        --import-root); each step a snapshot, unchanged steps from the cache."""
        return self.send(
            core.call_build_image(context, dockerfile, names, net, no_cache, build_args)
        )

    def remove_image(self, name: str) -> dict:
        """Removes an image, or one of its names."""
        return self.json("DELETE", f"/v1/images/{core.quote(name)}")

    def remotes(self) -> List[t.RemoteRecord]:
        return self.json("GET", "/v1/remotes")

    def add_remote(
        self, name: str, url: str, *, endpoint: Optional[str] = None, region: Optional[str] = None
    ) -> t.RemoteRecord:
        """Names a remote: s3://bucket/prefix, or file:///path under the daemon's --remote-root."""
        return self.send(core.call_add_remote(name, url, endpoint, region))

    def remote(self, name: str) -> t.RemoteShow:
        """What a remote holds: its snapshots and tags."""
        return self.json("GET", f"/v1/remotes/{core.quote(name)}")

    def remove_remote(self, name: str) -> t.RemoteRecord:
        """Forgets a remote (what it holds stays where it is)."""
        return self.json("DELETE", f"/v1/remotes/{core.quote(name)}")

    def push(
        self, remote: Optional[str] = None, snapshots: Sequence[Union[str, core.Snapshot]] = ()
    ) -> t.PushReport:
        """Sends snapshots (default: all, with every tag) and their ancestors; only what the remote lacks travels."""
        return self.send(core.call_push(remote, snapshots))

    def pull(self, remote: Optional[str] = None, snapshots: Sequence[str] = ()) -> t.PullReport:
        """Fetches snapshots (default: all the remote has), each object verified by its hash."""
        return self.send(core.call_pull(remote, snapshots))

    def clone(
        self,
        url: str,
        *,
        name: Optional[str] = None,
        endpoint: Optional[str] = None,
        region: Optional[str] = None,
    ) -> t.PullReport:
        """Names the remote at `url` (`origin` by default) and pulls everything it holds."""
        return self.send(core.call_clone(url, name, endpoint, region))

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_default: Optional[Client] = None


def default_client() -> Client:
    global _default
    if _default is None:
        _default = Client()
    return _default


class Files:
    """A sandbox's files, by the paths it sees (`/workspace/...`)."""

    def __init__(self, sandbox: "Sandbox"):
        self._sb = sandbox

    def read_bytes(self, path: str) -> bytes:
        return self._sb._client.request(
            "GET", f"/v1/sandboxes/{self._sb.id}/files/content", params=core.file_params(path)
        ).content

    def read(self, path: str) -> str:
        return self.read_bytes(path).decode("utf-8")

    def write(self, path: str, data: Union[str, bytes], mode: Optional[int] = None) -> core.EntryInfo:
        content = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        doc = self._sb._client.json(
            "PUT",
            f"/v1/sandboxes/{self._sb.id}/files/content",
            params=core.file_params(path, mode),
            content=content,
        )
        return core.entries([doc])[0]

    def list(self, path: str = "/workspace") -> List[core.EntryInfo]:
        return core.entries(
            self._sb._client.json("GET", f"/v1/sandboxes/{self._sb.id}/files", params={"path": path})
        )


class Ledger:
    """A sandbox's effects ledger: record what it did to the outside world,
    look it up (by idempotency key) before doing it again."""

    def __init__(self, sandbox: "Sandbox"):
        self._sb = sandbox

    def record(self, kind: str, key: str, request: Any, result: Any) -> t.LedgerEntry:
        return self._sb._client.json(
            "POST",
            f"/v1/sandboxes/{self._sb.id}/ledger",
            json={"kind": kind, "key": key, "request": request, "result": result},
        )

    def lookup(self, key: str) -> Optional[t.LedgerEntry]:
        """The earlier effect recorded under `key` (as of the sandbox's
        current state), or None."""
        try:
            return self._sb._client.json(
                "GET", f"/v1/sandboxes/{self._sb.id}/ledger/lookup", params={"key": key}
            )
        except NotFound:
            return None

    def list(self, *, all: bool = False) -> List[t.LedgerEntry]:
        """The visible ledger (`all`: with entries a rollback abandoned)."""
        return self._sb._client.json(
            "GET", f"/v1/sandboxes/{self._sb.id}/ledger", params={"all": str(all).lower()}
        )


class Sandbox(core.Described):
    """A live sandbox. `with Sandbox.create() as sb:` removes it at the end."""

    info: t.SandboxInfo

    def __init__(self, info: t.SandboxInfo, client: Optional[Client] = None):
        self.info = info
        self._client = client or default_client()
        self.files = Files(self)
        self.ledger = Ledger(self)

    @property
    def id(self) -> str:
        return self.info["id"]

    @property
    def state(self) -> t.SandboxState:
        """Its state now (asked of the daemon)."""
        return self.refresh().info["state"]

    @classmethod
    def create(
        cls,
        *,
        name: Optional[str] = None,
        snapshot: Optional[Union[str, core.Snapshot]] = None,
        directory: Optional[str] = None,
        command: Optional[Sequence[str]] = None,
        env: Optional[dict] = None,
        memory_bytes: Optional[int] = None,
        net: Optional[str] = None,
        seccomp: Optional[bool] = None,
        disk_bytes: Optional[int] = None,
        image: Optional[str] = None,
        client: Optional[Client] = None,
    ) -> "Sandbox":
        """An empty workspace by default, or one from a snapshot or a host
        directory (under one of the daemon's --import-root)."""
        c = client or default_client()
        body = core.create_body(
            name, snapshot, directory, command, env, memory_bytes, net, seccomp, disk_bytes, image
        )
        return cls(c.json("POST", "/v1/sandboxes", json=body), c)

    @classmethod
    def connect(cls, sandbox_id: str, *, client: Optional[Client] = None) -> "Sandbox":
        c = client or default_client()
        return cls(c.json("GET", f"/v1/sandboxes/{sandbox_id}"), c)

    @classmethod
    def list(cls, *, all: bool = False, client: Optional[Client] = None) -> List["Sandbox"]:
        c = client or default_client()
        return [cls(i, c) for i in c.json("GET", "/v1/sandboxes", params={"all": str(all).lower()})]

    def refresh(self) -> "Sandbox":
        self.info = self._client.json("GET", f"/v1/sandboxes/{self.id}")
        return self

    def exec(
        self,
        cmd: core.Command,
        *,
        env: Optional[dict] = None,
        timeout_s: Optional[float] = None,
        on_stdout: Optional[core.OutputCallback] = None,
        on_stderr: Optional[core.OutputCallback] = None,
    ) -> core.ExecResult:
        """Runs `cmd` (a string goes through `sh -c`) and returns its output and
        exit code; with callbacks, output reaches them as it comes."""
        body = core.exec_body(cmd, env, timeout_s)
        path = f"/v1/sandboxes/{self.id}/exec"
        timeout = httpx.Timeout(30.0, read=None)
        if on_stdout is None and on_stderr is None:
            return core.exec_result(self._client.json("POST", path, json=body, timeout=timeout))
        state = core.StreamState(on_stdout, on_stderr)
        try:
            with self._client._http.stream(
                "POST", path, json=body, params={"stream": "true"}, timeout=timeout
            ) as r:
                if r.status_code >= 400:
                    core.raise_for(r.status_code, r.read())
                for line in r.iter_lines():
                    state.line(line)
        except httpx.TransportError as e:
            raise ConnectionFailed(f"{self._client.url}: {e}") from e
        return state.result()

    def snapshot(
        self,
        message: str = "",
        *,
        tags: Sequence[str] = (),
        files_only: bool = False,
        prepare_forks: int = 0,
        persist: bool = False,
    ) -> core.Snapshot:
        """Snapshots this sandbox; with `prepare_forks`, then prepares that many native forks of it,
        which `fork` of the snapshot claims instead of making them; `persist`: also CRIU images."""
        body = core.snapshot_body(message, tags, files_only, prepare_forks, persist)
        doc = self._client.json("POST", f"/v1/sandboxes/{self.id}/snapshot", json=body)
        return core.Snapshot(doc["id"], doc)

    def restore(self, snapshot: Union[str, core.Snapshot], *, files_only: bool = False) -> t.RestoreResult:
        return self._client.json(
            "POST",
            f"/v1/sandboxes/{self.id}/restore",
            json={"snapshot": core.snapshot_id(snapshot), "files_only": files_only},
        )

    def fork(
        self, n: int = 1, *, name: Optional[str] = None, snapshot: Optional[Union[str, core.Snapshot]] = None
    ) -> List["Sandbox"]:
        """Returns `n` new sandboxes from a snapshot of this sandbox: `snapshot` (whose forks
        prepared with `snapshot(prepare_forks=K)` it claims first), or one taken now."""
        doc = self._client.send(core.fork_call(self.id, n, name, snapshot))
        return [Sandbox(i, self._client) for i in doc["sandboxes"]]

    def merge(
        self,
        ours: Union[str, core.Snapshot],
        theirs: Union[str, core.Snapshot],
        *,
        base: Optional[Union[str, core.Snapshot]] = None,
        message: Optional[str] = None,
    ) -> t.MergeResult:
        """Three-way merge of snapshot `theirs` into `ours`, into this sandbox's
        files (its processes run on). The result lists `conflicts` (their files
        hold markers) and names the merge `snapshot`."""
        body = core.merge_body(ours, theirs, base, message)
        return self._client.json("POST", f"/v1/sandboxes/{self.id}/merge", json=body)

    def stop(self, *, timeout_s: Optional[int] = None) -> None:
        """Stops it (SIGTERM, then SIGKILL after `timeout_s`)."""
        params = {} if timeout_s is None else {"timeout_s": int(timeout_s)}
        self.info = self._client.json("POST", f"/v1/sandboxes/{self.id}/stop", params=params)

    def kill(self) -> None:
        """Removes the sandbox and its files (stopping it first)."""
        self._client.request("DELETE", f"/v1/sandboxes/{self.id}", params={"force": "true"})

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    def __repr__(self) -> str:
        return f"Sandbox(id={self.id!r}, name={self.name!r})"


class Workspace(core.Described):
    """A named, long-lived sandbox that suspends and resumes."""

    info: t.WorkspaceInfo

    def __init__(self, info: t.WorkspaceInfo, client: Optional[Client] = None):
        self.info = info
        self._client = client or default_client()

    @property
    def state(self) -> str:
        """Its state now (asked of the daemon)."""
        return self.refresh().info["state"]

    @property
    def sandbox(self) -> Sandbox:
        """Its sandbox, as last described."""
        return Sandbox(self.info["sandbox"], self._client)

    @classmethod
    def create(
        cls,
        name: str,
        *,
        snapshot: Optional[Union[str, core.Snapshot]] = None,
        directory: Optional[str] = None,
        command: Optional[Sequence[str]] = None,
        env: Optional[dict] = None,
        keep: Optional[int] = None,
        idle_suspend_s: Optional[int] = None,
        client: Optional[Client] = None,
    ) -> "Workspace":
        c = client or default_client()
        body = core.workspace_body(name, snapshot, directory, command, env, keep, idle_suspend_s)
        return cls(c.json("POST", "/v1/workspaces", json=body), c)

    @classmethod
    def connect(cls, name: str, *, client: Optional[Client] = None) -> "Workspace":
        c = client or default_client()
        return cls(c.json("GET", f"/v1/workspaces/{name}"), c)

    @classmethod
    def list(cls, *, client: Optional[Client] = None) -> List["Workspace"]:
        c = client or default_client()
        return [cls(i, c) for i in c.json("GET", "/v1/workspaces")]

    def refresh(self) -> "Workspace":
        self.info = self._client.json("GET", f"/v1/workspaces/{self.name}")
        return self

    def suspend(self) -> t.Suspended:
        """Makes its state durable (processes through CRIU where that works)
        and stops it; the answer says how its processes will come back."""
        return self._client.json("POST", f"/v1/workspaces/{self.name}/suspend")

    def resume(self) -> t.Resumed:
        doc = self._client.json("POST", f"/v1/workspaces/{self.name}/resume")
        self.info = doc["workspace"]
        return doc

    def delete(self) -> None:
        self._client.request("DELETE", f"/v1/workspaces/{self.name}")

    def __repr__(self) -> str:
        return f"Workspace(name={self.name!r})"
