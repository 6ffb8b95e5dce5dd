"""The SDK against a real daemon."""

import asyncio
import os

import pytest

import tine
from tine import AsyncClient, AsyncSandbox, Client, Sandbox, Workspace


def test_sandbox_files_exec_snapshot_restore_fork(client):
    with Sandbox.create(client=client) as sb:
        assert sb.state == "running"
        sb.files.write("/workspace/a.txt", "one\n")
        sb.files.write("/workspace/bin/run.sh", "#!/bin/sh\necho run $1\n", mode=0o755)
        assert sb.files.read("/workspace/a.txt") == "one\n"
        names = [e.name for e in sb.files.list("/workspace")]
        assert names == ["a.txt", "bin"]
        r = sb.exec("cat a.txt; echo oops >&2; exit 4")
        assert (r.stdout, r.stderr, r.exit_code) == ("one\n", "oops\n", 4)
        assert sb.exec(["bin/run.sh", "x"]).stdout == "run x\n"
        assert sb.exec("echo $V", env={"V": "set"}).stdout == "set\n"
        seen = []
        r = sb.exec("for i in 1 2 3; do echo $i; sleep 0.05; done", on_stdout=seen.append)
        assert "".join(seen) == "1\n2\n3\n" and r.stdout == "1\n2\n3\n" and r.exit_code == 0
        r = sb.exec("sleep 20", timeout_s=0.5)
        assert r.timed_out and r.exit_code == 137
        snap = sb.snapshot(message="one")
        sb.files.write("a.txt", "two\n")
        sb.restore(snap)
        assert sb.files.read("a.txt") == "one\n"
        forks = sb.fork(3)
        try:
            assert len({f.id for f in forks}) == 3
            for k, f in enumerate(forks):
                f.files.write("k", str(k))
            for k, f in enumerate(forks):
                assert f.exec("cat a.txt k").stdout == f"one\n{k}"
        finally:
            for f in forks:
                f.kill()
        same = Sandbox.connect(sb.name, client=client)
        assert same.id == sb.id
    # The context manager removed it.
    with pytest.raises(tine.NotFound):
        Sandbox.connect(sb.id, client=client)


def test_forks_prepared_with_a_snapshot_are_claimed_by_its_fork(client):
    with Sandbox.create(client=client) as sb:
        sb.files.write("a.txt", "one\n")
        snap = sb.snapshot(prepare_forks=2)
        assert snap.info["prepared_forks"]["forks"] == 2, snap.info
        prepared = {s.id for s in Sandbox.list(all=True, client=client) if s.state == "prepared"}
        assert len(prepared) == 2
        sb.files.write("a.txt", "two\n")
        forks = sb.fork(2, name="pf", snapshot=snap)
        try:
            assert {f.id for f in forks} == prepared
            for k, f in enumerate(forks):
                assert f.name == f"pf-{k + 1}" and f.state == "running"
                assert f.exec("cat a.txt; hostname").stdout == f"one\npf-{k + 1}\n"
        finally:
            for f in forks:
                f.kill()


def test_merge_brings_two_branches_together_in_a_sandbox(client):
    with Sandbox.create(client=client) as sb:
        sb.files.write("t", "a\nb\nc\n")
        base = sb.snapshot(message="base")
        sb.files.write("t", "A\nb\nc\n")
        ours = sb.snapshot(message="ours")
        sb.restore(base)
        sb.files.write("t", "a\nb\nC\n")
        theirs = sb.snapshot(message="theirs")
        r = sb.merge(ours, theirs)
        assert r["conflicts"] == [] and r["base"] == base.id and r["merged"] == 1
        assert sb.files.read("t") == "A\nb\nC\n"
        sb.files.write("t", "x\nb\nC\n")
        mine = sb.snapshot()
        r = sb.merge(mine, ours, base=theirs)
        assert [c["path"] for c in r["conflicts"]] == ["t"]


async def _async_merge(server):
    async with AsyncClient(server["url"], token=server["token"]) as c:
        sb = await AsyncSandbox.create(client=c)
        try:
            await sb.files.write("t", "a\n")
            base = await sb.snapshot()
            await sb.files.write("u", "u\n")
            ours = await sb.snapshot()
            await sb.restore(base)
            await sb.files.write("v", "v\n")
            theirs = await sb.snapshot()
            r = await sb.merge(ours, theirs, message="both")
            assert r["conflicts"] == [] and r["taken"] == 1
            assert await sb.files.read("u") == "u\n"
        finally:
            await sb.kill()


def test_async_merge(server):
    asyncio.run(_async_merge(server))


def test_from_a_snapshot_and_from_a_directory(server, client):
    with Sandbox.create(directory=str(server["import"]), client=client) as sb:
        assert sb.files.read("/workspace/hello.txt") == "from the host\n"
        snap = sb.snapshot(message="base", tags=["sdk-base"])
        with Sandbox.create(snapshot="sdk-base", client=client) as other:
            assert other.files.read("hello.txt") == "from the host\n"
        with Sandbox.create(snapshot=snap, client=client) as third:
            assert third.exec("cat hello.txt").stdout == "from the host\n"
    with pytest.raises(tine.InvalidInput) as e:
        Sandbox.create(directory="/etc", client=client)
    assert "--import-root" in str(e.value)


def test_errors_have_one_class_per_code(server, client):
    with pytest.raises(tine.NotFound):
        Sandbox.connect("nosuch", client=client)
    with Client(server["url"], "wrong-token-000000") as bad:
        with pytest.raises(tine.Unauthorized) as e:
            Sandbox.list(client=bad)
        assert e.value.status == 401
    with Sandbox.create(client=client) as sb:
        with pytest.raises(tine.InvalidInput) as e:
            sb.files.read("/workspace/../../etc/passwd")
        assert "'..'" in str(e.value)
        with pytest.raises(tine.InvalidInput):
            sb.files.read("/etc/passwd")
        with pytest.raises(tine.NotFound):
            sb.files.read("/workspace/missing.txt")
        with pytest.raises(tine.AlreadyExists):
            Sandbox.create(name=sb.name, client=client)
    with Client("http://127.0.0.1:9", "x" * 20) as nowhere:
        with pytest.raises(tine.ConnectionFailed):
            Sandbox.list(client=nowhere)
    assert issubclass(tine.Capacity, tine.TineError)


def test_environment_names_the_daemon(server, monkeypatch):
    monkeypatch.setenv("TINE_URL", server["url"])
    monkeypatch.setenv("TINE_TOKEN", server["token"])
    with Client() as c:
        assert isinstance(Sandbox.list(client=c), list)


def test_async_client(server):
    async def main():
        async with AsyncClient(server["url"], server["token"]) as c:
            async with await AsyncSandbox.create(client=c) as sb:
                await sb.files.write("/workspace/x", b"\x00\x01")
                assert await sb.files.read_bytes("x") == b"\x00\x01"
                results = await asyncio.gather(*(sb.exec(f"echo {i}") for i in range(5)))
                assert [r.stdout for r in results] == [f"{i}\n" for i in range(5)]
                out = []
                r = await sb.exec("echo a; echo b", on_stdout=out.append)
                assert "".join(out) == "a\nb\n" and r.exit_code == 0
                snap = await sb.snapshot(message="s")
                forks = await sb.fork(2)
                assert len(forks) == 2
                for f in forks:
                    await f.kill()
                await sb.restore(snap)

    asyncio.run(main())


def test_workspace_suspend_resume(client):
    ws = Workspace.create("sdk-ws", client=client, keep=2)
    try:
        sb = ws.sandbox
        sb.files.write("/workspace/state.txt", "kept\n")
        s = ws.suspend()
        assert s["state"]["processes"] in ("criu", "restart")
        if s["state"]["processes"] == "restart":
            assert s["state"]["reason"]
        assert ws.state == "suspended"
        r = ws.resume()
        assert ws.state == "running" and r["from"] == 1
        assert ws.sandbox.files.read("state.txt") == "kept\n"
    finally:
        ws.delete()


def test_ledger_survives_a_rollback_as_history(client):
    with Sandbox.create(client=client) as sb:
        sb.ledger.record("payment", "order-1", {"amount": 5}, {"charge": "ch_1"})
        snap = sb.snapshot(message="paid once", files_only=True)
        sb.ledger.record("payment", "order-2", {"amount": 7}, {"charge": "ch_2"})
        assert sb.ledger.lookup("order-2")["result"] == {"charge": "ch_2"}
        sb.restore(snap, files_only=True)
        # Recorded before the snapshot: a fact; after it, on the abandoned branch: gone.
        assert sb.ledger.lookup("order-1")["result"] == {"charge": "ch_1"}
        assert sb.ledger.lookup("order-2") is None
        history = sb.ledger.list(all=True)
        assert [e["visible"] for e in history if e["key"] == "order-2"] == [False]
        forks = sb.fork(1)
        try:
            assert forks[0].ledger.lookup("order-1")["result"] == {"charge": "ch_1"}
        finally:
            forks[0].kill()


def test_the_unix_socket_serves_the_same_api_and_wants_the_token(server):
    import stat

    assert stat.S_IMODE(os.stat(server["socket"]).st_mode) == 0o600
    url = "unix:" + server["socket"]
    with Client(url, server["token"]) as c:
        with Sandbox.create(client=c, seccomp=False) as sb:
            assert sb.exec("echo over the socket").stdout == "over the socket\n"
    with Client(url, "wrong") as c:
        with pytest.raises(tine.Unauthorized):
            Sandbox.list(client=c)

    async def go():
        async with AsyncClient(url, server["token"]) as c:
            return await c.json("GET", "/v1/sandboxes")

    assert isinstance(asyncio.run(go()), list)


def test_push_clone_and_pull_between_two_daemons(server, client):
    from conftest import daemon

    url = f"file://{server['remotes']}/py-remote"
    with Sandbox.create(client=client) as sb:
        sb.files.write("travels.txt", "across daemons\n")
        snap = sb.snapshot(message="to travel", tags=["py-travel"])
    rec = client.add_remote("py", url)
    assert (rec["name"], rec["url"]) == ("py", url)
    assert any(r["name"] == "py" for r in client.remotes())
    # Named by its tag, the tag travels too.
    pushed = client.push("py", ["py-travel"])
    assert snap.id in pushed["snapshots_sent"] and pushed["bytes_sent"] > 0
    assert pushed["tags_sent"] == ["py-travel"]
    assert client.push("py", [snap])["snapshots_sent"] == []
    shown = client.remote("py")
    assert any(s["id"] == snap.id for s in shown["snapshots"])
    assert ["py-travel", snap.id] in [list(t) for t in shown["tags"]]
    with daemon(server["tmp"] / "b", server["remotes"]) as other:
        with Client(other["url"], other["token"]) as c2:
            cloned = c2.clone(url)
            assert snap.id in cloned["snapshots_received"] and cloned["objects_verified"] > 0
            assert "py-travel" in cloned["tags_set"]
            assert c2.pull()["snapshots_received"] == []
            with Sandbox.create(snapshot="py-travel", client=c2) as there:
                assert there.files.read("travels.txt") == "across daemons\n"
            with pytest.raises(tine.AlreadyExists):
                c2.clone(f"file://{server['remotes']}/elsewhere")
    with pytest.raises(tine.InvalidInput) as e:
        client.add_remote("out", "file:///etc/tine-py")
    assert "--remote-root" in str(e.value)
    assert client.remove_remote("py")["url"] == url
    with pytest.raises(tine.NotFound):
        client.remote("py")


def test_repository_calls_sync_and_async_alike(server, client):
    with Sandbox.create(client=client) as sb:
        sb.files.write("f", "1\n")
        a = sb.snapshot(message="a")
        sb.files.write("f", "2\n")
        b = sb.snapshot(message="b")
        d = client.diff(a, b, patch=True)
        assert [c["path"] for c in d["changes"]] == ["f"] and "-1\n+2" in d["patches"][0]
        assert client.tag(b, "sdk-b")["snapshot"] == b.id
        assert client.snapshot("sdk-b")["id"] == b.id
        assert any(s["id"] == a.id for s in client.snapshots(limit=20))
        assert client.untag("sdk-b")["was"] == b.id
        sb.ledger.record("k", "key-1", {}, {})
        assert client.verify_ledger()["verified"] >= 1
        assert any(e["key"] == "key-1" for e in client.ledger())
        assert client.health() == {"ok": True} and client.version()["api"] == "v1"
        assert "tine_live_sandboxes" in client.metrics()
        assert client.openapi().startswith("openapi: 3")

        async def main():
            async with AsyncClient(server["url"], server["token"]) as c:
                asb = await AsyncSandbox.connect(sb.id, client=c)
                assert await asb.state() == "running"
                assert any(s.id == sb.id for s in await AsyncSandbox.list(client=c))
                assert [e["key"] for e in await asb.ledger.list()] == ["key-1"]
                assert (await c.diff(a, b))["changes"] == d["changes"]
                assert [s["id"] for s in await c.snapshots(limit=5)] == [s["id"] for s in client.snapshots(limit=5)]
                assert await c.remotes() == client.remotes()
                ws = await tine.AsyncWorkspace.create("sdk-aws", client=c)
                try:
                    assert await ws.state() == "running"
                    assert any(w.name == "sdk-aws" for w in await tine.AsyncWorkspace.list(client=c))
                    await ws.sandbox.files.write("w", "w\n")
                    await ws.refresh()
                    assert ws.info["sandbox"]["state"] == "running"
                finally:
                    await ws.delete()
                await asb.stop(timeout_s=1)
                assert asb.info["state"] in ("stopped", "exited")

        asyncio.run(main())


def _oci_archive(out, root_files, run):
    """An OCI archive of one layer holding `root_files` ({path: (bytes, mode)}
    or a symlink target as str), with `run` as its configuration."""
    import hashlib
    import io
    import json
    import tarfile

    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as t:
        dirs = sorted({"/".join(p.split("/")[:i]) for p in root_files for i in range(1, p.count("/") + 1)})
        for d in dirs:
            ti = tarfile.TarInfo(d)
            ti.type, ti.mode = tarfile.DIRTYPE, 0o755
            t.addfile(ti)
        for p, v in sorted(root_files.items()):
            ti = tarfile.TarInfo(p)
            if isinstance(v, str):
                ti.type, ti.linkname = tarfile.SYMTYPE, v
                t.addfile(ti)
            else:
                data, mode = v
                ti.size, ti.mode = len(data), mode
                t.addfile(ti, io.BytesIO(data))
    layer = layer.getvalue()
    sha = lambda b: "sha256:" + hashlib.sha256(b).hexdigest()  # noqa: E731
    config = json.dumps({"architecture": "amd64", "os": "linux", "config": run,
                         "rootfs": {"type": "layers", "diff_ids": [sha(layer)]}}).encode()
    manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": sha(config), "size": len(config)},
                           "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": sha(layer), "size": len(layer)}]}).encode()
    index = json.dumps({"schemaVersion": 2, "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                        "digest": sha(manifest), "size": len(manifest)}]}).encode()
    with tarfile.open(out, "w") as t:
        for name, data in [("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'), ("index.json", index)] + [
            ("blobs/sha256/" + sha(b)[7:], b) for b in (config, manifest, layer)
        ]:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            t.addfile(ti, io.BytesIO(data))


def test_an_image_as_a_sandbox_through_the_sdk(server, client):
    if os.geteuid() != 0 or not os.path.exists("/usr/bin/busybox"):
        pytest.skip("needs root and Debian's busybox-static")
    files = {"bin/busybox": (open("/usr/bin/busybox", "rb").read(), 0o755)}
    for a in ["sh", "cat", "echo", "ls", "sleep"]:
        files[f"bin/{a}"] = "busybox"
    files["srv/hello"] = (b"from the image\n", 0o644)
    (server["import"] / "images").mkdir(exist_ok=True)
    path = server["import"] / "images" / "bb.tar"
    _oci_archive(path, files, {"Cmd": ["sleep", "1000"], "WorkingDir": "/srv", "Env": ["WHO=image"]})
    imported = client.import_image(str(path), names=["sdk/bb:1"])
    assert imported["layers_applied"] == 1 and imported["image"]["names"] == ["sdk/bb:1"]
    assert [i["names"] for i in client.images()] == [["sdk/bb:1"]]
    assert client.image("sdk/bb:1")["workdir"] == "/srv"
    with Sandbox.create(image="sdk/bb:1", client=client) as sb:
        assert sb.exec("pwd; echo $WHO; cat hello").stdout == "/srv\nimage\nfrom the image\n"
        # Files are the image's paths.
        assert sb.files.read("/srv/hello") == "from the image\n"
        snap = sb.snapshot(message="image")
        sb.files.write("/srv/hello", "changed\n")
        sb.exec("echo x > /bin/new")
        sb.restore(snap)
        assert sb.exec("cat /srv/hello; ls /bin/new 2>&1; true").stdout.startswith("from the image\nls: /bin/new")
        forks = sb.fork(2)
        try:
            forks[0].files.write("/srv/mine", "0")
            assert forks[1].exec("ls /srv").stdout == "hello\n"
        finally:
            for f in forks:
                f.kill()
    # A build over it, through the daemon: its context under the import root.
    ctx = server["import"] / "build"
    ctx.mkdir()
    (ctx / "note.txt").write_text("copied\n")
    (ctx / "Dockerfile").write_text(
        "FROM sdk/bb:1\nCOPY note.txt /srv/\nRUN echo built > /srv/built && cat /srv/note.txt\nCMD [\"cat\", \"/srv/built\"]\n"
    )
    built = client.build_image(str(ctx), names=["sdk/app"])
    assert (built["run"], built["cached"]) == (2, 0), built
    assert built["steps"][2]["output"] == "copied\n"
    again = client.build_image(str(ctx), names=["sdk/app"])
    assert (again["run"], again["cached"]) == (0, 2), again
    assert again["image"]["id"] == built["image"]["id"]
    with Sandbox.create(image="sdk/app", command=["sleep", "1000"], client=client) as sb:
        assert sb.exec("cat /srv/built /srv/note.txt").stdout == "built\ncopied\n"
    (ctx / "Dockerfile").write_text("FROM sdk/bb:1\nARG CODE=0\nRUN exit $CODE\n")
    ok = client.build_image(str(ctx))
    assert ok["run"] == 1
    client.remove_image(ok["image"]["id"])
    with pytest.raises(tine.InvalidInput, match="exited with 7"):
        client.build_image(str(ctx), build_args={"CODE": "7"})
    (ctx / "Dockerfile").write_text("FROM sdk/bb:1\nRUN exit 7\n")
    with pytest.raises(tine.InvalidInput, match="exited with 7"):
        client.build_image(str(ctx))
    client.remove_image("sdk/app")
    removed = client.remove_image("sdk/bb:1")
    assert removed["image"] is True
    assert client.images() == []
