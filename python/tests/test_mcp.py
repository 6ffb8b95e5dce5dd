"""tine's MCP server, with the official MCP Python client (`mcp` on PyPI) as
a real client: `tine mcp` over stdio (acting through the test's daemon)
and the daemon's /mcp over streamable HTTP, behind its token."""

import asyncio
import json
import os

import httpx
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import create_mcp_http_client, streamable_http_client

# Every tool, and the hints it must carry: (readOnly, destructive, idempotent).
HINTS = {
    "sandbox_create": (False, False, False),
    "sandbox_list": (True, False, True),
    "sandbox_remove": (False, True, True),
    "exec": (False, True, False),
    "file_read": (True, False, True),
    "file_write": (False, True, True),
    "file_list": (True, False, True),
    "snapshot": (False, False, False),
    "restore": (False, True, True),
    "fork": (False, False, False),
    "diff": (True, False, True),
    "log": (True, False, True),
    "ledger_record": (False, False, False),
    "ledger_lookup": (True, False, True),
}


async def _call(session, tool, **args):
    r = await session.call_tool(tool, args)
    text = r.content[0].text
    assert not r.is_error, f"{tool}: {text}"
    return json.loads(text)


async def _session_run(session, tag):
    tools = (await session.list_tools()).tools
    assert {t.name for t in tools} == set(HINTS)
    for t in tools:
        a = t.annotations
        assert (a.read_only_hint, a.destructive_hint, a.idempotent_hint) == HINTS[t.name], t.name
        assert a.open_world_hint is False, t.name
        assert t.input_schema["type"] == "object", t.name
    sb = await _call(session, "sandbox_create", name=f"mcp-{tag}")
    name = sb["name"]
    try:
        await _call(session, "file_write", sandbox=name, path="note.txt", content="good\n")
        snap = await _call(session, "snapshot", sandbox=name, message="before breaking it")
        await _call(session, "exec", sandbox=name, command="echo broken > note.txt; rm -f other")
        assert (await _call(session, "file_read", sandbox=name, path="note.txt"))["content"] == "broken\n"
        await _call(session, "restore", sandbox=name, snapshot=snap["id"])
        assert (await _call(session, "file_read", sandbox=name, path="note.txt"))["content"] == "good\n"
        forked = await _call(session, "fork", snapshot=snap["id"], n=2, name=f"mcpf-{tag}")
        kids = [s["name"] for s in forked["sandboxes"]]
        assert len(kids) == 2
        try:
            for k, kid in enumerate(kids):
                await _call(session, "exec", sandbox=kid, command=["sh", "-c", f"echo fork{k} >> note.txt"])
            for k, kid in enumerate(kids):
                got = await _call(session, "file_read", sandbox=kid, path="/workspace/note.txt")
                assert got["content"] == f"good\nfork{k}\n"
        finally:
            for kid in kids:
                await _call(session, "sandbox_remove", sandbox=kid)
        # Output is bounded, and what was left out is counted.
        out = await _call(session, "exec", sandbox=name, command="head -c 100000 /dev/zero | tr '\\0' x", max_output_bytes=1000)
        assert len(out["stdout"]) == 1000 and out["stdout_bytes_left_out"] == 99000
        # A failed call is a result the model reads, with the error's code.
        r = await session.call_tool("file_read", {"sandbox": name, "path": "no-such"})
        assert r.is_error and json.loads(r.content[0].text)["error"]["code"] == "not_found"
        log = await _call(session, "log", limit=5)
        assert any(s["id"] == snap["id"] for s in log)
        listed = await _call(session, "sandbox_list")
        assert name in {s["name"] for s in listed}
    finally:
        await _call(session, "sandbox_remove", sandbox=name)


def test_tine_mcp_over_stdio(server):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TINE_")}
    env.update(TINE_URL=server["url"], TINE_TOKEN=server["token"])
    params = StdioServerParameters(command=server["tine"], args=["mcp"], env=env, cwd=str(server["work"]))

    async def run():
        async with stdio_client(params) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                await _session_run(session, "stdio")

    asyncio.run(run())


def test_the_daemons_mcp_over_streamable_http(server):
    url = server["url"] + "/mcp"

    async def run():
        http = create_mcp_http_client(headers={"Authorization": f"Bearer {server['token']}"})
        async with http:
            async with streamable_http_client(url, http_client=http) as (read, write, *_):
                async with ClientSession(read, write) as session:
                    await session.initialize()
                    await _session_run(session, "http")

    asyncio.run(run())
    # Without the token, /mcp is refused as every route is.
    r = httpx.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
    assert r.status_code == 401
