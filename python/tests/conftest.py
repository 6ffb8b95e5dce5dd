"""Starts a real `tine serve` on loopback over a fresh repository."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# What would point the CLI at another repository or daemon than the
# test's own (a developer's shell may export them).
FOREIGN = ("TINE_REPO", "TINE_URL", "TINE_TOKEN", "TINE_TOKEN_FILE")


def hermetic_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in FOREIGN}


def tine_binary() -> str:
    if os.environ.get("TINE_BIN"):
        return os.environ["TINE_BIN"]
    for profile in ("release", "debug"):
        p = ROOT / "target" / profile / "tine"
        if p.exists():
            return str(p)
    found = shutil.which("tine")
    if not found:
        pytest.exit("no tine binary: build it (cargo build --release) or set TINE_BIN", 2)
    return found


@contextlib.contextmanager
def daemon(tmp: Path, remote_root: Path):
    """A `tine serve` on loopback over a new repository under `tmp`."""
    work = tmp / "work"
    (tmp / "import").mkdir(parents=True)
    (tmp / "import" / "hello.txt").write_text("from the host\n")
    work.mkdir()
    tine = tine_binary()
    env = hermetic_env()
    subprocess.run([tine, "init"], cwd=work, check=True, capture_output=True, env=env)
    log = open(tmp / "serve.log", "wb")
    proc = subprocess.Popen(
        [
            tine,
            "--json",
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--import-root",
            str(tmp / "import"),
            "--remote-root",
            str(remote_root),
        ],
        cwd=work,
        stdout=subprocess.PIPE,
        stderr=log,
        env=env,
    )
    line = proc.stdout.readline()
    info = json.loads(line)
    token = Path(info["token_file"]).read_text().strip()
    try:
        yield {
            "url": info["url"],
            "socket": info["socket"],
            "token": token,
            "import": tmp / "import",
            "work": work,
            "tine": tine,
            "remotes": remote_root,
        }
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        subprocess.run(
            [tine, "rm", "-f", *_all_sandboxes(tine, work)], cwd=work, capture_output=True, env=env
        )


@pytest.fixture(scope="session")
def server():
    tmp = Path(tempfile.mkdtemp(prefix="tine-sdk-"))
    (tmp / "remotes").mkdir()
    with daemon(tmp / "a", tmp / "remotes") as d:
        d["tmp"] = tmp
        yield d
    shutil.rmtree(tmp, ignore_errors=True)


def _all_sandboxes(tine, work):
    out = subprocess.run(
        [tine, "--json", "ps", "--all"], cwd=work, capture_output=True, env=hermetic_env()
    )
    try:
        return [s["id"] for s in json.loads(out.stdout)]
    except ValueError:
        return []


@pytest.fixture()
def client(server):
    from tine import Client

    with Client(server["url"], server["token"]) as c:
        yield c
