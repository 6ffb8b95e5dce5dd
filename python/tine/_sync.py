"""The synchronous client."""

from __future__ import annotations

from typing import Optional, Sequence, Union

import httpx

from . import _core as core
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

    def json(self, method: str, path: str, **kw):
        return self.request(method, path, **kw).json()

    def close(self) -> None:
        self._http.close()

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

    def list(self, path: str = "/workspace") -> list:
        return core.entries(
            self._sb._client.json("GET", f"/v1/sandboxes/{self._sb.id}/files", params={"path": path})
        )


class Ledger:
    """A sandbox's effects ledger: record what it did to the outside world,
    look it up (by idempotency key) before doing it again."""

    def __init__(self, sandbox: "Sandbox"):
        self._sb = sandbox

    def record(self, kind: str, key: str, request, result) -> dict:
        return self._sb._client.json(
            "POST",
            f"/v1/sandboxes/{self._sb.id}/ledger",
            json={"kind": kind, "key": key, "request": request, "result": result},
        )

    def lookup(self, key: str) -> Optional[dict]:
        """The earlier effect recorded under `key` (as of the sandbox's
        current state), or None."""
        try:
            return self._sb._client.json(
                "GET", f"/v1/sandboxes/{self._sb.id}/ledger/lookup", params={"key": key}
            )
        except NotFound:
            return None

    def list(self, *, all: bool = False) -> list:
        return self._sb._client.json(
            "GET", f"/v1/sandboxes/{self._sb.id}/ledger", params={"all": str(all).lower()}
        )


class Sandbox(core.Described):
    """A live sandbox. `with Sandbox.create() as sb:` removes it at the end."""

    def __init__(self, info: dict, client: Optional[Client] = None):
        self.info = info
        self._client = client or default_client()
        self.files = Files(self)
        self.ledger = Ledger(self)

    @property
    def id(self) -> str:
        return self.info["id"]

    @property
    def state(self) -> str:
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
        client: Optional[Client] = None,
    ) -> "Sandbox":
        """An empty workspace by default, or one from a snapshot or a host
        directory (under one of the daemon's --import-root)."""
        c = client or default_client()
        body = core.create_body(
            name, snapshot, directory, command, env, memory_bytes, net, seccomp, disk_bytes
        )
        return cls(c.json("POST", "/v1/sandboxes", json=body), c)

    @classmethod
    def connect(cls, sandbox_id: str, *, client: Optional[Client] = None) -> "Sandbox":
        c = client or default_client()
        return cls(c.json("GET", f"/v1/sandboxes/{sandbox_id}"), c)

    @classmethod
    def list(cls, *, all: bool = False, client: Optional[Client] = None) -> list:
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
        self, message: str = "", *, tags: Sequence[str] = (), files_only: bool = False, prepare_forks: int = 0
    ) -> core.Snapshot:
        """Snapshots this sandbox; with `prepare_forks`, then prepares that many native forks of it,
        which `fork` of the snapshot claims instead of making them."""
        doc = self._client.json(
            "POST",
            f"/v1/sandboxes/{self.id}/snapshot",
            json={
                "message": message,
                "tags": list(tags),
                "files_only": files_only,
                "prepare_forks": prepare_forks,
            },
        )
        return core.Snapshot(doc["id"], doc)

    def restore(self, snapshot: Union[str, core.Snapshot], *, files_only: bool = False) -> dict:
        return self._client.json(
            "POST",
            f"/v1/sandboxes/{self.id}/restore",
            json={"snapshot": core.snapshot_id(snapshot), "files_only": files_only},
        )

    def fork(
        self, n: int = 1, *, name: Optional[str] = None, snapshot: Optional[Union[str, core.Snapshot]] = None
    ) -> list:
        """Returns `n` new sandboxes from a snapshot of this sandbox: `snapshot` (whose forks
        prepared with `snapshot(prepare_forks=K)` it claims first), or one taken now."""
        body: dict = {"n": n}
        if name is not None:
            body["name"] = name
        if snapshot is not None:
            url = f"/v1/snapshots/{core.snapshot_id(snapshot)}/fork"
        else:
            url = f"/v1/sandboxes/{self.id}/fork"
        doc = self._client.json("POST", url, json=body)
        return [Sandbox(i, self._client) for i in doc["sandboxes"]]

    def merge(
        self,
        ours: Union[str, core.Snapshot],
        theirs: Union[str, core.Snapshot],
        *,
        base: Optional[Union[str, core.Snapshot]] = None,
        message: Optional[str] = None,
    ) -> dict:
        """Three-way merge of snapshot `theirs` into `ours`, into this sandbox's
        files (its processes run on). The result lists `conflicts` (their files
        hold markers) and names the merge `snapshot`."""
        body = core.merge_body(ours, theirs, base, message)
        return self._client.json("POST", f"/v1/sandboxes/{self.id}/merge", json=body)

    def stop(self) -> None:
        self.info = self._client.json("POST", f"/v1/sandboxes/{self.id}/stop")

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

    def __init__(self, info: dict, client: Optional[Client] = None):
        self.info = info
        self._client = client or default_client()

    @property
    def state(self) -> str:
        return self.refresh().info["state"]

    @property
    def sandbox(self) -> Sandbox:
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
        body: dict = {
            "name": name,
            "sandbox": core.create_body(None, snapshot, directory, command, env, None, None),
        }
        if keep is not None:
            body["keep"] = keep
        if idle_suspend_s is not None:
            body["idle_suspend_s"] = idle_suspend_s
        return cls(c.json("POST", "/v1/workspaces", json=body), c)

    @classmethod
    def connect(cls, name: str, *, client: Optional[Client] = None) -> "Workspace":
        c = client or default_client()
        return cls(c.json("GET", f"/v1/workspaces/{name}"), c)

    def refresh(self) -> "Workspace":
        self.info = self._client.json("GET", f"/v1/workspaces/{self.name}")
        return self

    def suspend(self) -> dict:
        """Makes its state durable (processes through CRIU where that works)
        and stops it; the answer says how its processes will come back."""
        return self._client.json("POST", f"/v1/workspaces/{self.name}/suspend")

    def resume(self) -> dict:
        doc = self._client.json("POST", f"/v1/workspaces/{self.name}/resume")
        self.info = doc["workspace"]
        return doc

    def delete(self) -> None:
        self._client.request("DELETE", f"/v1/workspaces/{self.name}")

    def __repr__(self) -> str:
        return f"Workspace(name={self.name!r})"
