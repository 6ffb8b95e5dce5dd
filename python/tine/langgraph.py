"""A LangGraph checkpointer that keeps its checkpoints in tine and rewinds
the sandbox the graph acts in with the graph.

    from tine import Sandbox
    from tine.langgraph import TineSaver

    sb = Sandbox.create()
    graph = builder.compile(checkpointer=TineSaver(sandbox=sb))
    graph.invoke(inputs, {"configurable": {"thread_id": "t1"}})

Checkpoints and the writes of the tasks run from them are stored by the
daemon in its repository (SQLite, `graph_checkpoints` / `graph_writes`:
docs/FORMAT.md), durable across restarts, values as LangGraph's serializer
made them. A thread is bound to a sandbox (``sandbox=`` here, or
``config["configurable"]["tine_sandbox"]``): each checkpoint of the root
graph snapshots it (files, processes, ledger head) and is paired with that
snapshot. Loading an earlier checkpoint by id to run from it — a replay, a
fork, ``update_state`` on it, ``get_state`` of it — rolls the sandbox back
to its snapshot first (``list`` and ``get_state_history`` never do).
``copy_thread`` gives the copy a fork of the sandbox; ``delete_thread`` and
``prune`` release what only they held (the fork, the snapshots' pairing).
Subgraph checkpoints (a namespace other than the root) are stored without
a snapshot.

Run graphs with ``durability="sync"`` (``graph.invoke(..., durability="sync")``)
when a checkpoint's snapshot must be the sandbox exactly as that step left
it: with LangGraph's default (``"async"``) a checkpoint is stored while the
next step already runs, and its snapshot can catch that step's first
effects.

Needs ``pip install tine[langgraph]`` (``langgraph-checkpoint``).
"""

from __future__ import annotations

import base64
import json
import random
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any, Optional, Union
from urllib.parse import quote

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    DeltaChannelHistory,
    PendingWrite,
    get_checkpoint_id,
    get_checkpoint_metadata,
)
from langgraph.checkpoint.serde.base import SerializerProtocol

from ._async import AsyncClient
from ._sync import Client, Sandbox
from .errors import NotFound

__all__ = ["TineSaver"]

#: A config key naming the sandbox a thread acts in (name or id).
SANDBOX_KEY = "tine_sandbox"


def _canonical(value: Any) -> Optional[str]:
    """A metadata value as the canonical JSON the daemon filters on (None
    when it is not JSON)."""
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError):
        return None


def _thread(thread_id: Any) -> str:
    return quote(str(thread_id), safe="")


class TineSaver(BaseCheckpointSaver[str]):
    """LangGraph's ``BaseCheckpointSaver`` over a tine daemon (``TINE_URL``,
    ``TINE_TOKEN``), sync and async. ``sandbox``: the sandbox (a
    :class:`tine.Sandbox`, or its name or id) threads act in unless their
    config names one; none: checkpoints only."""

    def __init__(
        self,
        client: Optional[Client] = None,
        *,
        aclient: Optional[AsyncClient] = None,
        sandbox: Union[Sandbox, str, None] = None,
        serde: Optional[SerializerProtocol] = None,
    ) -> None:
        super().__init__(serde=serde)
        self._client = client
        self._aclient = aclient
        self.sandbox = sandbox.id if isinstance(sandbox, Sandbox) else sandbox

    # The daemon's clients, made when first needed (from the environment).
    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = Client()
        return self._client

    @property
    def aclient(self) -> AsyncClient:
        if self._aclient is None:
            self._aclient = AsyncClient()
        return self._aclient

    # -- requests and answers, shared by the sync and async methods --

    def _put_request(
        self, config: RunnableConfig, checkpoint: Checkpoint, metadata: CheckpointMetadata
    ) -> tuple[str, dict, RunnableConfig]:
        conf = config["configurable"]
        thread_id = str(conf["thread_id"])
        ns = conf.get("checkpoint_ns", "")
        md = get_checkpoint_metadata(config, metadata)
        ctype, cdata = self.serde.dumps_typed(checkpoint)
        mtype, mdata = self.serde.dumps_typed(md)
        body: dict = {
            "ns": ns,
            "id": checkpoint["id"],
            "parent": conf.get("checkpoint_id"),
            "checkpoint": _typed(ctype, cdata),
            "metadata": _typed(mtype, mdata),
            "filter": {k: c for k, v in md.items() if (c := _canonical(v)) is not None},
            "run_id": str(md["run_id"]) if md.get("run_id") is not None else None,
        }
        sandbox = conf.get(SANDBOX_KEY) or self.sandbox
        if sandbox is not None:
            body["sandbox"] = sandbox.id if isinstance(sandbox, Sandbox) else str(sandbox)
        stored: RunnableConfig = {
            "configurable": {
                "thread_id": thread_id,
                "checkpoint_ns": ns,
                "checkpoint_id": checkpoint["id"],
            }
        }
        return f"/v1/graph/threads/{_thread(thread_id)}/checkpoints", body, stored

    def _get_request(self, config: RunnableConfig, rewind: bool) -> tuple[str, dict]:
        conf = config["configurable"]
        params = {"ns": conf.get("checkpoint_ns", ""), "rewind": str(rewind).lower()}
        if checkpoint_id := get_checkpoint_id(config):
            params["id"] = checkpoint_id
        return f"/v1/graph/threads/{_thread(conf['thread_id'])}/checkpoint", params

    def _list_body(
        self,
        config: Optional[RunnableConfig],
        filter: Optional[dict[str, Any]],
        before: Optional[RunnableConfig],
    ) -> dict:
        body: dict = {}
        if config is not None:
            conf = config["configurable"]
            body["thread"] = str(conf["thread_id"])
            if "checkpoint_ns" in conf:
                body["ns"] = conf["checkpoint_ns"]
            if checkpoint_id := get_checkpoint_id(config):
                body["id"] = checkpoint_id
        if before is not None and (before_id := get_checkpoint_id(before)):
            body["before"] = before_id
        if filter:
            body["filter"] = {k: c for k, v in filter.items() if (c := _canonical(v)) is not None}
        return body

    def _writes_request(
        self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str, task_path: str
    ) -> tuple[str, dict]:
        conf = config["configurable"]
        items = []
        for idx, (channel, value) in enumerate(writes):
            vtype, vdata = self.serde.dumps_typed(value)
            items.append(
                {"idx": WRITES_IDX_MAP.get(channel, idx), "channel": channel, "value": _typed(vtype, vdata)}
            )
        body = {
            "ns": conf.get("checkpoint_ns", ""),
            "checkpoint": conf["checkpoint_id"],
            "task": task_id,
            "task_path": task_path,
            "writes": items,
        }
        return f"/v1/graph/threads/{_thread(conf['thread_id'])}/writes", body

    def _tuple(self, doc: dict) -> CheckpointTuple:
        thread, ns = doc["thread"], doc["ns"]
        parent = doc.get("parent")
        return CheckpointTuple(
            config={"configurable": {"thread_id": thread, "checkpoint_ns": ns, "checkpoint_id": doc["id"]}},
            checkpoint=self.serde.loads_typed(_untyped(doc["checkpoint"])),
            metadata=self.serde.loads_typed(_untyped(doc["metadata"])),
            parent_config=(
                {"configurable": {"thread_id": thread, "checkpoint_ns": ns, "checkpoint_id": parent}}
                if parent
                else None
            ),
            pending_writes=[
                (w["task"], w["channel"], self.serde.loads_typed(_untyped(w["value"]))) for w in doc["writes"]
            ],
        )

    def _wanted(self, t: CheckpointTuple, filter: Optional[dict[str, Any]]) -> bool:
        """The filter, checked on the decoded metadata too (keys whose value
        is not JSON are filtered here only)."""
        return not filter or all(t.metadata.get(k) == v for k, v in filter.items())

    # -- sync --

    def get_tuple(self, config: RunnableConfig) -> Optional[CheckpointTuple]:
        """The checkpoint ``config`` names (or the thread's latest); one named
        by id is loaded to run from: the thread's sandbox is rolled back to
        it."""
        return self._get(config, rewind=True)

    def _get(self, config: RunnableConfig, rewind: bool) -> Optional[CheckpointTuple]:
        path, params = self._get_request(config, rewind)
        try:
            return self._tuple(self.client.json("GET", path, params=params))
        except NotFound:
            return None

    def list(
        self,
        config: Optional[RunnableConfig],
        *,
        filter: Optional[dict[str, Any]] = None,
        before: Optional[RunnableConfig] = None,
        limit: Optional[int] = None,
    ) -> Iterator[CheckpointTuple]:
        pages = _Pages(self, config, filter, before, limit)
        while (body := pages.request()) is not None:
            yield from pages.take(self.client.json("POST", "/v1/graph/list", json=body))

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        path, body, stored = self._put_request(config, checkpoint, metadata)
        self.client.json("POST", path, json=body)
        return stored

    def put_writes(
        self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str, task_path: str = ""
    ) -> None:
        path, body = self._writes_request(config, writes, task_id, task_path)
        self.client.json("POST", path, json=body)

    def delete_thread(self, thread_id: str) -> None:
        self.client.send(_delete_thread(thread_id))

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        self.client.send(_delete_for_runs(run_ids))

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        self.client.send(_copy_thread(source_thread_id, target_thread_id))

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        self.client.send(_prune(thread_ids, strategy))

    def get_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        # The base walks the ancestors through get_tuple, which would rewind
        # the sandbox to each: they are read as they are instead.
        walk = _DeltaWalk(channels)
        cursor = walk.start(self._get(config, rewind=False))
        while cursor is not None:
            cursor = walk.step(self._get(cursor, rewind=False))
        return walk.result()

    # -- async --

    async def aget_tuple(self, config: RunnableConfig) -> Optional[CheckpointTuple]:
        return await self._aget(config, rewind=True)

    async def _aget(self, config: RunnableConfig, rewind: bool) -> Optional[CheckpointTuple]:
        path, params = self._get_request(config, rewind)
        try:
            return self._tuple(await self.aclient.json("GET", path, params=params))
        except NotFound:
            return None

    async def alist(
        self,
        config: Optional[RunnableConfig],
        *,
        filter: Optional[dict[str, Any]] = None,
        before: Optional[RunnableConfig] = None,
        limit: Optional[int] = None,
    ) -> AsyncIterator[CheckpointTuple]:
        pages = _Pages(self, config, filter, before, limit)
        while (body := pages.request()) is not None:
            for t in pages.take(await self.aclient.json("POST", "/v1/graph/list", json=body)):
                yield t

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        path, body, stored = self._put_request(config, checkpoint, metadata)
        await self.aclient.json("POST", path, json=body)
        return stored

    async def aput_writes(
        self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str, task_path: str = ""
    ) -> None:
        path, body = self._writes_request(config, writes, task_id, task_path)
        await self.aclient.json("POST", path, json=body)

    async def adelete_thread(self, thread_id: str) -> None:
        await self.aclient.send(_delete_thread(thread_id))

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        await self.aclient.send(_delete_for_runs(run_ids))

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        await self.aclient.send(_copy_thread(source_thread_id, target_thread_id))

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        await self.aclient.send(_prune(thread_ids, strategy))

    async def aget_delta_channel_history(
        self, *, config: RunnableConfig, channels: Sequence[str]
    ) -> Mapping[str, DeltaChannelHistory]:
        walk = _DeltaWalk(channels)
        cursor = walk.start(await self._aget(config, rewind=False))
        while cursor is not None:
            cursor = walk.step(await self._aget(cursor, rewind=False))
        return walk.result()

    def get_next_version(self, current: Optional[str], channel: None) -> str:
        # As LangGraph's own savers: a counter, and a random tail so that two
        # branches from one checkpoint never make the same version.
        if current is None:
            current_v = 0
        elif isinstance(current, int):
            current_v = current
        else:
            current_v = int(current.split(".")[0])
        return f"{current_v + 1:032}.{random.random():016}"


def _delete_thread(thread_id: str) -> tuple:
    return ("DELETE", f"/v1/graph/threads/{_thread(thread_id)}", {})


def _delete_for_runs(run_ids: Sequence[str]) -> tuple:
    return ("POST", "/v1/graph/runs/delete", {"json": {"run_ids": [str(r) for r in run_ids]}})


def _copy_thread(source: str, target: str) -> tuple:
    return ("POST", f"/v1/graph/threads/{_thread(source)}/copy", {"json": {"to": str(target)}})


def _prune(thread_ids: Sequence[str], strategy: str) -> tuple:
    return ("POST", "/v1/graph/prune", {"json": {"threads": [str(t) for t in thread_ids], "strategy": strategy}})


class _Pages:
    """A listing page by page: the body that asks for the next page (None
    when done), and which of a page's checkpoints are wanted, up to the
    limit."""

    def __init__(self, saver: "TineSaver", config, filter, before, limit: Optional[int]):
        self.saver, self.filter, self.left = saver, filter, limit
        self.body = saver._list_body(config, filter, before)
        # The daemon stops at the limit where it filters on every key.
        self.exact = not filter or len(self.body.get("filter", {})) == len(filter)
        self.done = False

    def request(self) -> Optional[dict]:
        if self.done or self.left == 0:
            return None
        if self.exact and self.left is not None:
            self.body["limit"] = self.left
        return self.body

    def take(self, page: dict) -> list:
        out = []
        for doc in page["checkpoints"]:
            t = self.saver._tuple(doc)
            if self.saver._wanted(t, self.filter):
                out.append(t)
                if self.left is not None:
                    self.left -= 1
                    if self.left == 0:
                        return out
        if page.get("next"):
            self.body["after"] = page["next"]
        else:
            self.done = True
        return out


def _typed(kind: str, data: bytes) -> dict:
    return {"type": kind, "data": base64.b64encode(data).decode("ascii")}


def _untyped(doc: dict) -> tuple[str, bytes]:
    return doc["type"], base64.b64decode(doc["data"])


class _DeltaWalk:
    """BaseCheckpointSaver's walk of a checkpoint's parent chain for the
    history of delta channels, fed one ancestor at a time (by the sync and
    the async saver alike): each channel's writes until an ancestor that
    holds its value (its seed)."""

    def __init__(self, channels: Sequence[str]):
        self.channels = list(channels)
        self.collected: dict[str, list[PendingWrite]] = {c: [] for c in channels}
        self.seed: dict[str, Any] = {}
        self.remaining = set(channels)

    def start(self, target: Optional[CheckpointTuple]) -> Optional[RunnableConfig]:
        """The first ancestor to read (the target's parent)."""
        return target.parent_config if target and self.remaining else None

    def step(self, t: Optional[CheckpointTuple]) -> Optional[RunnableConfig]:
        """Takes ancestor `t` in; the next one to read, or None when done."""
        if t is None:
            return None
        for write in reversed(t.pending_writes or []):
            if write[1] in self.remaining:
                self.collected[write[1]].append(write)
        for ch in list(self.remaining):
            if ch in t.checkpoint["channel_values"]:
                self.seed[ch] = t.checkpoint["channel_values"][ch]
                self.remaining.discard(ch)
        return t.parent_config if self.remaining else None

    def result(self) -> Mapping[str, DeltaChannelHistory]:
        out: dict[str, DeltaChannelHistory] = {}
        for ch in self.channels:
            entry: DeltaChannelHistory = {"writes": list(reversed(self.collected[ch]))}
            if ch in self.seed:
                entry["seed"] = self.seed[ch]
            out[ch] = entry
        return out
