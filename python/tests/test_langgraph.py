"""tine.langgraph against a real daemon: LangGraph's published conformance
suite, concurrent writers, and a graph whose rewind rewinds its sandbox."""

import asyncio
import threading
import uuid

from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.capabilities import ALL_CAPABILITIES

from tine import AsyncClient, Client
from tine.langgraph import TineSaver


def test_the_published_conformance_suite_passes_every_capability(server):
    @checkpointer_test(name="TineSaver")
    async def tine_saver():
        async with AsyncClient(server["url"], server["token"]) as ac:
            with Client(server["url"], server["token"]) as c:
                yield TineSaver(c, aclient=ac)

    report = asyncio.run(validate(tine_saver))
    report.print_report()
    results = {name: r for name, r in report.results.items()}
    assert set(results) == {c.value for c in ALL_CAPABILITIES}
    for name, r in results.items():
        assert r.detected, f"{name}: not detected"
        assert r.passed is True, f"{name}: {r.failures}"
    counted = sum(r.tests_passed for r in results.values())
    print(f"conformance: {len(results)} of {len(ALL_CAPABILITIES)} capabilities passed, {counted} tests")
    assert report.conformance_level() == "FULL"


def _put(saver, thread, parent, step):
    from langgraph.checkpoint.base import empty_checkpoint
    from langgraph.checkpoint.base.id import uuid6

    cp = empty_checkpoint()
    cp["id"] = str(uuid6(clock_seq=-1))
    cp["channel_values"] = {"step": step}
    cp["channel_versions"] = {"step": step + 1}
    config = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
    if parent:
        config["configurable"]["checkpoint_id"] = parent
    return saver.put(config, cp, {"source": "loop", "step": step, "parents": {}}, {"step": step + 1})


def test_concurrent_writers_lose_nothing(server):
    # Eight writers (each its own client, as separate processes would be)
    # put chains of checkpoints and writes into threads of their own and
    # into one shared thread at once: every one is stored, in each chain's
    # order, and the shared thread holds all of them.
    shared = f"shared-{uuid.uuid4()}"
    errors = []

    def writer(k):
        try:
            with Client(server["url"], server["token"]) as c:
                saver = TineSaver(c)
                own = f"own-{k}-{uuid.uuid4()}"
                parent = None
                for step in range(6):
                    stored = _put(saver, own, parent, step)
                    parent = stored["configurable"]["checkpoint_id"]
                    saver.put_writes(stored, [("ch", f"{k}:{step}")], task_id=f"t{k}")
                    _put(saver, shared, None, k * 100 + step)
                tuples = list(saver.list({"configurable": {"thread_id": own}}))
                assert [t.checkpoint["channel_values"]["step"] for t in tuples] == [5, 4, 3, 2, 1, 0]
                assert [t.pending_writes[0][2] for t in tuples] == [f"{k}:{s}" for s in (5, 4, 3, 2, 1, 0)]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    with Client(server["url"], server["token"]) as c:
        steps = sorted(t.checkpoint["channel_values"]["step"] for t in TineSaver(c).list({"configurable": {"thread_id": shared}}))
    assert steps == sorted(k * 100 + s for k in range(8) for s in range(6))


# The sandbox's main process: a counter held in memory, bumped by SIGUSR1,
# written to /workspace/count each time (so files alone cannot tell a rolled
# back process from one that ran on).
COUNTER = """
import os, signal, time
n = 0
def bump(*_):
    global n
    n += 1
    with open("/workspace/count.tmp", "w") as f:
        f.write(str(n))
    os.rename("/workspace/count.tmp", "/workspace/count")
signal.signal(signal.SIGUSR1, bump)
with open("/workspace/counter.pid", "w") as f:
    f.write(str(os.getpid()))
while True:
    signal.pause()
"""


def test_a_graph_rewound_two_steps_and_run_down_another_branch_leaves_the_sandbox_as_that_branch_made_it(server):
    from typing import TypedDict

    from langgraph.graph import END, START, StateGraph

    from tine import Sandbox

    with Client(server["url"], server["token"]) as c:
        sb = Sandbox.create(client=c, command=["python3", "-c", COUNTER])
        try:
            _wait_for(lambda: sb.exec("test -s counter.pid").exit_code == 0)

            class State(TypedDict):
                branch: str
                done: list

            def node(name):
                def act(state):
                    # Each step writes a file, appends to a log and bumps the
                    # counter process, all inside the sandbox.
                    sb.exec(
                        f"echo {name} > step-{name}; echo {name} >> log; "
                        f"n=$(cat count 2>/dev/null || echo 0); kill -USR1 $(cat counter.pid); "
                        f"while [ \"$(cat count 2>/dev/null || echo 0)\" = \"$n\" ]; do sleep 0.01; done"
                    )
                    return {"done": state["done"] + [name]}

                return act

            g = StateGraph(State)
            for name in "abcde":
                g.add_node(name, node(name))
            g.add_edge(START, "a")
            g.add_edge("a", "b")
            g.add_edge("b", "c")
            g.add_conditional_edges("c", lambda s: "d" if s["branch"] == "x" else "e")
            g.add_edge("d", END)
            g.add_edge("e", END)
            graph = g.compile(checkpointer=TineSaver(c, sandbox=sb))
            config = {"configurable": {"thread_id": f"rewind-{uuid.uuid4()}"}}

            # (Durability "sync": each checkpoint, and its snapshot, is stored
            # before the next step acts in the sandbox.)
            out = graph.invoke({"branch": "x", "done": []}, config, durability="sync")
            assert out["done"] == ["a", "b", "c", "d"]
            assert sb.files.read("log") == "a\nb\nc\nd\n" and sb.files.read("count") == "4"

            # Two steps back from the end: the checkpoint after b, c next.
            history = list(graph.get_state_history(config))
            after_b = next(h for h in history if h.values.get("done") == ["a", "b"])
            assert after_b.next == ("c",)
            forked = graph.update_state(after_b.config, {"branch": "y"})
            # The update rewound the sandbox to its checkpoint's snapshot.
            assert sb.files.read("log") == "a\nb\n" and sb.files.read("count") == "2"
            out = graph.invoke(None, forked, durability="sync")
            assert out["done"] == ["a", "b", "c", "e"]

            # The sandbox is exactly as that branch made it: its files, and
            # its counter process, which counted a, b, c, e — not 6.
            names = sorted(e.name for e in sb.files.list("/workspace"))
            assert names == ["count", "counter.pid", "log", "step-a", "step-b", "step-c", "step-e"]
            assert sb.files.read("log") == "a\nb\nc\ne\n"
            assert sb.files.read("count") == "4"
            sb.exec("kill -USR1 $(cat counter.pid)")
            _wait_for(lambda: sb.files.read("count") == "5")
            # And the graph's own state agrees: the latest is the new branch.
            assert graph.get_state(config).values["done"] == ["a", "b", "c", "e"]
        finally:
            sb.kill()


def _wait_for(ok, timeout=30.0):
    import time

    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
