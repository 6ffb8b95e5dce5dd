"""The SDKs' surface: the async classes have every method the sync ones have
(same parameters), and every route of docs/openapi.yaml is used by a method
of the Python SDK and of the TypeScript SDK (read from their sources)."""

import ast
import inspect
import re
from pathlib import Path

import pytest

import tine
from tine import _async, _sync

ROOT = Path(__file__).resolve().parents[2]
METHODS = {"GET", "POST", "PUT", "DELETE"}
# Served for LangGraph's checkpointer, which only the Python SDK has.
PYTHON_ONLY = re.compile(r"^/v1/graph/")

PAIRS = [
    (_sync.Client, _async.AsyncClient),
    (_sync.Files, _async.AsyncFiles),
    (_sync.Ledger, _async.AsyncLedger),
    (_sync.Sandbox, _async.AsyncSandbox),
    (_sync.Workspace, _async.AsyncWorkspace),
]
# What differs by nature: context managers, and the async client's
# conventional alias for close.
SYNC_ONLY = {"__enter__", "__exit__"}
ASYNC_ONLY = {"__aenter__", "__aexit__", "aclose"}


def public(cls):
    return {
        n
        for n, _ in inspect.getmembers(cls)
        if (not n.startswith("_") or n in SYNC_ONLY | ASYNC_ONLY)
        and n not in ("info", "name", "id")
    }


def params(member):
    f = member.fget if isinstance(member, property) else member
    if not callable(f):
        return None
    return [p for p in inspect.signature(f).parameters if p not in ("self", "cls")]


@pytest.mark.parametrize("sync_cls,async_cls", PAIRS, ids=[p[1].__name__ for p in PAIRS])
def test_the_async_classes_have_every_method_of_the_sync_ones(sync_cls, async_cls):
    s, a = public(sync_cls) - SYNC_ONLY, public(async_cls) - ASYNC_ONLY
    assert s - a == set(), f"{async_cls.__name__} lacks {sorted(s - a)}"
    assert a - s == set(), f"{async_cls.__name__} has more than {sync_cls.__name__}: {sorted(a - s)}"
    for n in sorted(s):
        sm, am = inspect.getattr_static(sync_cls, n), inspect.getattr_static(async_cls, n)
        if isinstance(sm, (classmethod, staticmethod)):
            sm, am = sm.__func__, am.__func__
        ps, pa = params(sm), params(am)
        if ps is None:
            continue
        assert sorted(ps) == sorted(pa), f"{n}: {ps} vs {pa}"
        f = am.fget if isinstance(am, property) else am
        # A call that asks the daemon is awaited; a property of what is known is not.
        if not isinstance(am, property):
            assert inspect.iscoroutinefunction(f), f"{async_cls.__name__}.{n} is not async"


def test_the_package_is_typed():
    assert (Path(tine.__file__).parent / "py.typed").exists()
    hints = inspect.get_annotations(_sync.Sandbox.snapshot, eval_str=True)
    assert hints["return"] is tine.Snapshot
    from tine import types

    assert "state" in types.SandboxInfo.__annotations__
    assert "snapshots_sent" in types.PushReport.__annotations__


def routes():
    """(method, path) of every operation in docs/openapi.yaml."""
    out, path = [], None
    for line in (ROOT / "docs" / "openapi.yaml").read_text().splitlines():
        if m := re.match(r"^  (/\S*):\s*$", line):
            path = m.group(1)
        elif path and (m := re.match(r"^    (get|post|put|delete):", line)):
            out.append((m.group(1).upper(), path))
        elif line and not line.startswith(" "):
            path = None
    return out


def pattern(template: str) -> re.Pattern:
    parts = re.split(r"\{[^}]+\}", template)
    return re.compile("^" + "[^/]+".join(re.escape(p) for p in parts) + "$")


def python_uses():
    """(method, path with {} for what is filled in) per function of the
    package; a helper that builds a path without naming the method takes
    the methods of the functions that call it."""
    funcs = {}
    for src in sorted(Path(tine.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(src.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            methods, paths, calls = set(), set(), set()
            for n in ast.walk(node):
                if isinstance(n, ast.Constant) and isinstance(n.value, str):
                    if n.value in METHODS:
                        methods.add(n.value)
                    elif n.value.startswith("/"):
                        paths.add(n.value)
                elif isinstance(n, ast.JoinedStr):
                    text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in n.values)
                    if text.startswith("/"):
                        paths.add(text)
                elif isinstance(n, ast.Attribute):
                    calls.add(n.attr)
                elif isinstance(n, ast.Name):
                    calls.add(n.id)
            funcs.setdefault(node.name, []).append((methods, paths, calls))
    uses = set()
    for name, defs in funcs.items():
        for methods, paths, _ in defs:
            if not methods:
                methods = {
                    m for defs2 in funcs.values() for ms, _, calls in defs2 if name in calls for m in ms
                }
            uses |= {(m, p) for m in methods for p in paths}
    return uses


def typescript_uses():
    """(method, path) of each call in the TypeScript SDK's sources: a method
    followed by a path, or by a constant holding one."""
    uses = set()
    for src in sorted((ROOT / "sdk" / "typescript" / "src").glob("*.ts")):
        text = src.read_text()
        consts = {}
        for m in re.finditer(r"const (\w+) =\s*`([^`]*)`", text):
            consts.setdefault(m.group(1), []).append(m.group(2))
        for m in re.finditer(r'"(GET|POST|PUT|DELETE)",\s*(?:[`"]([^`"]*)[`"]|(\w+))', text):
            paths = [m.group(2)] if m.group(2) is not None else consts.get(m.group(3), [])
            for p in paths:
                uses.add((m.group(1), re.sub(r"\$\{[^}]*\}", "{}", p)))
    return uses


def covered(route, uses):
    method, template = route
    pat = pattern(template)
    return any(m == method and pat.match(p.replace("{}", "x")) for m, p in uses)


def test_every_route_is_used_by_the_python_sdk():
    all_routes = routes()
    assert len(all_routes) > 40
    missing = [r for r in all_routes if not covered(r, python_uses())]
    assert missing == [], f"routes no Python SDK method uses: {missing}"


def test_every_route_is_used_by_the_typescript_sdk():
    missing = [r for r in routes() if not PYTHON_ONLY.match(r[1]) and not covered(r, typescript_uses())]
    assert missing == [], f"routes no TypeScript SDK method uses: {missing}"
