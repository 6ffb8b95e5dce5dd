"""tine: fork() for an AI agent's whole world — the Python SDK.

    from tine import Sandbox
    with Sandbox.create() as sb:                 # TINE_URL / TINE_TOKEN name the daemon
        sb.files.write("/workspace/a.txt", "hi")
        print(sb.exec("cat a.txt").stdout)
        snap = sb.snapshot(message="before")
        sb.exec("rm a.txt")
        sb.restore(snap)
        branches = sb.fork(4)
"""

from . import types
from ._async import AsyncClient, AsyncFiles, AsyncLedger, AsyncSandbox, AsyncWorkspace
from ._core import EntryInfo, ExecResult, Snapshot
from ._sync import Client, Files, Ledger, Sandbox, Workspace
from .errors import (
    AlreadyExists,
    Ambiguous,
    Capacity,
    Conflict,
    ConnectionFailed,
    Corrupt,
    Internal,
    InvalidInput,
    IoError,
    Locked,
    NotFound,
    TineError,
    Unauthorized,
    Unavailable,
    Unsupported,
)

__all__ = [
    "AlreadyExists",
    "Ambiguous",
    "AsyncClient",
    "AsyncFiles",
    "AsyncLedger",
    "AsyncSandbox",
    "AsyncWorkspace",
    "Capacity",
    "Client",
    "Conflict",
    "ConnectionFailed",
    "Corrupt",
    "EntryInfo",
    "ExecResult",
    "Files",
    "Internal",
    "InvalidInput",
    "IoError",
    "Ledger",
    "Locked",
    "NotFound",
    "Sandbox",
    "Snapshot",
    "TineError",
    "Unauthorized",
    "Unavailable",
    "Unsupported",
    "Workspace",
    "types",
]
