"""The asyncio client: the same shapes as the synchronous one, awaited."""

from __future__ import annotations

from typing import Optional, Sequence, Union

import httpx

from . import _core as core
from .errors import ConnectionFailed, NotFound


class AsyncClient:
    """A connection to `tine serve` for asyncio code."""

    def __init__(self, url: Optional[str] = None, token: Optional[str] = None, timeout: float = 300.0):
        self.url, token = core.settings(url, token)
        base, socket = core.split_unix(self.url)
        self._http = httpx.AsyncClient(
            base_url=base,
            transport=httpx.AsyncHTTPTransport(uds=socket) if socket else None,
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout,
        )

    async def request(self, method: str, path: str, **kw) -> httpx.Response:
        try:
            r = await self._http.request(method, path, **kw)
        except httpx.TransportError as e:
            raise ConnectionFailed(f"{self.url}: {e}") from e
        core.raise_for(r.status_code, r.content)
        return r

    async def json(self, method: str, path: str, **kw):
        return (await self.request(method, path, **kw)).json()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class AsyncFiles:
    def __init__(self, sandbox: "AsyncSandbox"):
        self._sb = sandbox

    async def read_bytes(self, path: str) -> bytes:
        r = await self._sb._client.request(
            "GET", f"/v1/sandboxes/{self._sb.id}/files/content", params=core.file_params(path)
        )
        return r.content

    async def read(self, path: str) -> str:
        return (await self.read_bytes(path)).decode("utf-8")

    async def write(self, path: str, data: Union[str, bytes], mode: Optional[int] = None) -> core.EntryInfo:
        content = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        doc = await self._sb._client.json(
            "PUT",
            f"/v1/sandboxes/{self._sb.id}/files/content",
            params=core.file_params(path, mode),
            content=content,
        )
        return core.entries([doc])[0]

    async def list(self, path: str = "/workspace") -> list:
        docs = await self._sb._client.json("GET", f"/v1/sandboxes/{self._sb.id}/files", params={"path": path})
        return core.entries(docs)


class AsyncLedger:
    def __init__(self, sandbox: "AsyncSandbox"):
        self._sb = sandbox

    async def record(self, kind: str, key: str, request, result) -> dict:
        return await self._sb._client.json(
            "POST",
            f"/v1/sandboxes/{self._sb.id}/ledger",
            json={"kind": kind, "key": key, "request": request, "result": result},
        )

    async def lookup(self, key: str) -> Optional[dict]:
        try:
            return await self._sb._client.json(
                "GET", f"/v1/sandboxes/{self._sb.id}/ledger/lookup", params={"key": key}
            )
        except NotFound:
            return None


class AsyncSandbox(core.Described):
    """A live sandbox; `async with await AsyncSandbox.create(client=c) as sb:`."""

    def __init__(self, info: dict, client: AsyncClient):
        self.info = info
        self._client = client
        self.files = AsyncFiles(self)
        self.ledger = AsyncLedger(self)

    @property
    def id(self) -> str:
        return self.info["id"]

    @classmethod
    async def create(
        cls,
        *,
        client: AsyncClient,
        name: Optional[str] = None,
        snapshot: Optional[Union[str, core.Snapshot]] = None,
        directory: Optional[str] = None,
        command: Optional[Sequence[str]] = None,
        env: Optional[dict] = None,
        memory_bytes: Optional[int] = None,
        net: Optional[str] = None,
        seccomp: Optional[bool] = None,
        disk_bytes: Optional[int] = None,
    ) -> "AsyncSandbox":
        body = core.create_body(
            name, snapshot, directory, command, env, memory_bytes, net, seccomp, disk_bytes
        )
        return cls(await client.json("POST", "/v1/sandboxes", json=body), client)

    @classmethod
    async def connect(cls, sandbox_id: str, *, client: AsyncClient) -> "AsyncSandbox":
        return cls(await client.json("GET", f"/v1/sandboxes/{sandbox_id}"), client)

    async def exec(
        self,
        cmd: core.Command,
        *,
        env: Optional[dict] = None,
        timeout_s: Optional[float] = None,
        on_stdout: Optional[core.OutputCallback] = None,
        on_stderr: Optional[core.OutputCallback] = None,
    ) -> core.ExecResult:
        body = core.exec_body(cmd, env, timeout_s)
        path = f"/v1/sandboxes/{self.id}/exec"
        timeout = httpx.Timeout(30.0, read=None)
        if on_stdout is None and on_stderr is None:
            return core.exec_result(await self._client.json("POST", path, json=body, timeout=timeout))
        state = core.StreamState(on_stdout, on_stderr)
        try:
            async with self._client._http.stream(
                "POST", path, json=body, params={"stream": "true"}, timeout=timeout
            ) as r:
                if r.status_code >= 400:
                    core.raise_for(r.status_code, await r.aread())
                async for line in r.aiter_lines():
                    state.line(line)
        except httpx.TransportError as e:
            raise ConnectionFailed(f"{self._client.url}: {e}") from e
        return state.result()

    async def snapshot(
        self, message: str = "", *, tags: Sequence[str] = (), files_only: bool = False, prepare_forks: int = 0
    ) -> core.Snapshot:
        """Snapshots this sandbox; with `prepare_forks`, then prepares that many native forks of it,
        which `fork` of the snapshot claims instead of making them."""
        doc = await self._client.json(
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

    async def restore(self, snapshot: Union[str, core.Snapshot], *, files_only: bool = False) -> dict:
        return await self._client.json(
            "POST",
            f"/v1/sandboxes/{self.id}/restore",
            json={"snapshot": core.snapshot_id(snapshot), "files_only": files_only},
        )

    async def fork(
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
        doc = await self._client.json("POST", url, json=body)
        return [AsyncSandbox(i, self._client) for i in doc["sandboxes"]]

    async def merge(
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
        return await self._client.json("POST", f"/v1/sandboxes/{self.id}/merge", json=body)

    async def kill(self) -> None:
        await self._client.request("DELETE", f"/v1/sandboxes/{self.id}", params={"force": "true"})

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.kill()


class AsyncWorkspace(core.Described):
    def __init__(self, info: dict, client: AsyncClient):
        self.info = info
        self._client = client

    @classmethod
    async def create(
        cls,
        name: str,
        *,
        client: AsyncClient,
        snapshot: Optional[Union[str, core.Snapshot]] = None,
        command: Optional[Sequence[str]] = None,
        keep: Optional[int] = None,
        idle_suspend_s: Optional[int] = None,
    ) -> "AsyncWorkspace":
        body: dict = {"name": name, "sandbox": core.create_body(None, snapshot, None, command, None, None, None)}
        if keep is not None:
            body["keep"] = keep
        if idle_suspend_s is not None:
            body["idle_suspend_s"] = idle_suspend_s
        return cls(await client.json("POST", "/v1/workspaces", json=body), client)

    @classmethod
    async def connect(cls, name: str, *, client: AsyncClient) -> "AsyncWorkspace":
        return cls(await client.json("GET", f"/v1/workspaces/{name}"), client)

    async def suspend(self) -> dict:
        return await self._client.json("POST", f"/v1/workspaces/{self.name}/suspend")

    async def resume(self) -> dict:
        doc = await self._client.json("POST", f"/v1/workspaces/{self.name}/resume")
        self.info = doc["workspace"]
        return doc

    async def delete(self) -> None:
        await self._client.request("DELETE", f"/v1/workspaces/{self.name}")
