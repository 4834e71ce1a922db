"""The agent kit's measurements (issue 18): a cancel reaching inside a model request.

The model server (`tether.testing.model_server`) runs on loopback, the agents in worker
processes; for the cancel cases in a process of its own, so that it notices a disconnect
without waiting for the host's GIL. A stream is "in flight" once the server has sent what it will
and hangs, and the agent has read all of it (its socket's receive queue, in
/proc/net/tcp, is empty). Each cancel sample checks that the server recorded the client's
disconnect no later than the turn's recorded end (both `time.time()`, one clock), and
also yields the time from the cancel call to that disconnect (`disconnect_ms`), the
figure the framework adapters' cancels are compared with (benchmarks/adapter_cases.py).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import tether
from benchmarks._case import Cfg, Samples, Skip, ms_since, poll_until
from benchmarks.tether_cases import WAIT, Events, _last_seq, _on, _pool_steady, _quiet_parent
from tether.testing import ModelServer

CHAT = "tether.agents:ChatAgent"
SYNC = "benchmarks.drivers:SyncStreamer"
HUNG = [{"text": "a partial answer that will never end", "chunk": 6, "hang": True}]


def _need_openai() -> None:
    try:
        import openai  # noqa: F401
    except ImportError:
        raise Skip("the agent kit needs the extra tether-runtime[agents] (openai)") from None


def _port(server: ModelServer) -> int:
    return int(server.url.rsplit(":", 1)[1].split("/")[0])


def _all_read(server: ModelServer) -> bool | None:
    """True when every client connection to the server has an empty receive queue."""
    port = f"{_port(server):04X}"
    found = False
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[2].endswith(f":{port}") and fields[3] == "01":
                found = True
                if int(fields[4].split(":")[1], 16):
                    return None
    return True if found else None


def _in_flight(server: ModelServer, script: str, count: int) -> str:
    """Wait until the `count`-th request of `script` hangs with all it sent read; its id."""
    requests = server.wait_requests(count, script=script, timeout=WAIT)
    request = requests[count - 1]
    server.wait_for(lambda s: s.requests_for(script)[count - 1].hanging, timeout=WAIT)
    poll_until(lambda: _all_read(server), WAIT, "the agent to read the stream")
    return request.id


def _check_cut(rt: tether.Runtime, child: str, after: int) -> None:
    """The cancelled turn kept its partial reply: its assistant entry (past seq `after`)
    is a prefix of the hung reply's text, marked `cut`."""
    said = [e for e in rt.transcript(child, after=after) if e.kind == "assistant"]
    cut = said[-1] if said else None
    text = str(HUNG[0]["text"])
    if cut is None or not cut.text or not text.startswith(cut.text):
        raise RuntimeError(f"the cancelled turn kept no partial reply: {cut!r}")
    if not (cut.data or {}).get("cut"):
        raise RuntimeError(f"the partial reply is not marked cut: {cut.data!r}")


def _cancel_case(
    cfg: Cfg,
    driver: str,
    config: Callable[[ModelServer], dict[str, Any]],
    script: str,
    grace: float,
    samples_n: int,
    deadline: float | None = None,
) -> Iterator[Samples]:
    """Cancel one session's turns mid-stream, `samples_n` per repetition. `cancel_ms`:
    the cancel call → the turn's end event; `disconnect_ms`: the cancel call → the
    disconnect the model server recorded (both `time.time()`, one clock). A cancel (no
    `deadline`) must end the turn `cancelled` with its partial reply kept."""
    with (
        ModelServer(process=True, realtime=True) as server,
        tether.Runtime(workers=2, grace=grace) as rt,
    ):
        server.script(script, HUNG)
        parent, auth = _quiet_parent(rt)
        child = str(rt.spawn(parent, driver, config=config(server)))
        events = Events(rt, {"turn.ended"}, sessions={child})
        _pool_steady(rt, 2)
        count = late = 0
        while True:
            samples: list[float] = []
            gaps: list[float] = []
            for _ in range(samples_n):
                mark, after = events.mark(), _last_seq(rt, child)
                rt.send(child, "go", authority=auth)
                count += 1
                request = _in_flight(server, script, count)
                called = time.time()
                t0 = time.perf_counter_ns()
                rt.interrupt(
                    child, authority=auth, kind="cancel", reason="bench", deadline=deadline
                )
                ended, ev = events.wait(mark, _on(child, "turn.ended"))
                want = "cancelled" if deadline is None else "aborted"
                if ev.data["outcome"] != want:
                    raise RuntimeError(f"the turn ended {ev.data['outcome']}, not {want}")
                samples.append(ms_since(t0, ended))
                gone = server.wait_disconnect(request, timeout=WAIT)
                gaps.append((gone.time - called) * 1000)
                end_at = rt.turns(child)[-1].ended_at
                if end_at is None or gone.time > end_at:
                    late += 1
                if deadline is None:
                    _check_cut(rt, child, after)
                _pool_steady(rt, 2)
            how = f"grace {grace:g} s" if deadline is None else f"deadline {deadline:g} s"
            cfg.note(
                f"{how}; disconnect recorded after the turn's end in {late} of {count} samples",
                key="order",
            )
            yield {"cancel_ms": samples, "disconnect_ms": gaps}


def cancel_inflight(cfg: Cfg) -> Iterator[Samples]:
    """`interrupt(kind="cancel")` → the turn ended `cancelled`, an async ChatAgent
    mid-stream (its reply hung after the first words): the cancel lands at the stream's
    await, the response is closed, the partial reply kept."""

    def config(server: ModelServer) -> dict[str, Any]:
        return {"model": {"base_url": server.url, "name": "inflight", "retries": 0}}

    _need_openai()
    return _cancel_case(cfg, CHAT, config, "inflight", 5.0, cfg.n(20, 60))


def cancel_inflight_sync(cfg: Cfg) -> Iterator[Samples]:
    """The same stop of a sync driver blocked in the same hung stream (the sync `openai`
    client): it never reaches a boundary, so the cancel is never taken; the kill comes
    from the cancel's deadline (1 s, escalating to an abort), what a sync driver's stop
    costs when its model call hangs."""

    def config(server: ModelServer) -> dict[str, Any]:
        return {"base_url": server.url, "model": "inflight-sync"}

    _need_openai()
    return _cancel_case(cfg, SYNC, config, "inflight-sync", 1.0, cfg.n(4, 10), deadline=1.0)


def agent_turn(cfg: Cfg) -> Iterator[Samples]:
    """A one-reply ChatAgent turn (send → turn ended event) minus the model server's own
    time on its request (arrival to last byte): what Tether and the agent add. Each
    sample is the first turn of a fresh session (spawned before the clock starts), so
    the request carries one message, not a growing history."""
    _need_openai()
    with ModelServer() as server, tether.Runtime(workers=2) as rt:
        server.script("one", [{"text": "ok"}])
        parent, auth = _quiet_parent(rt)
        config = {"model": {"base_url": server.url, "name": "one", "retries": 0}}
        events = Events(rt, {"turn.ended"})
        _pool_steady(rt, 2)

        def once() -> float:
            child = str(rt.spawn(parent, CHAT, config=config))
            mark = events.mark()
            t0 = time.perf_counter_ns()
            rt.send(child, "hi", authority=auth)
            ended, ev = events.wait(mark, _on(child, "turn.ended"))
            if ev.data["outcome"] != "completed":
                raise RuntimeError(f"the turn ended {ev.data['outcome']}: {ev.data['error']}")
            served = server.requests_for("one")[-1].served_s * 1000
            return ms_since(t0, ended) - served

        for _ in range(10):  # warm: the worker imports the client and opens a connection
            once()
        while True:
            yield {"overhead_ms": [once() for _ in range(cfg.n(40, 150))]}


# ---------------------------------------------------------------- floors


def stream_floor(cfg: Cfg) -> Iterator[Samples]:
    """Floors with no Tether: one process, one event loop thread, the official async
    client against the same server. `cancel_ms`: `call_soon_threadsafe(task.cancel)`
    from another thread on a task reading a hung stream (what the worker's reader does)
    → the task done with its response closed. `overhead_ms`: a one-reply streamed request
    minus the server's own time."""
    _need_openai()
    import openai

    with ModelServer() as server:
        server.script("floor", HUNG)
        server.script("floor-one", [{"text": "ok"}])
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        client = openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0)
        count = 0

        async def read(model: str) -> None:
            stream = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "go"}],
                stream=True,
                stream_options={"include_usage": True},
            )
            try:
                async for _ in stream:
                    pass
            finally:
                await stream.close()

        def cancel_once() -> float:
            nonlocal count
            future = asyncio.run_coroutine_threadsafe(read("floor"), loop)
            count += 1
            _in_flight(server, "floor", count)
            done = threading.Event()
            future.add_done_callback(lambda _: done.set())
            t0 = time.perf_counter_ns()
            loop.call_soon_threadsafe(future.cancel)
            done.wait(WAIT)
            return ms_since(t0, time.perf_counter_ns())

        def request_once() -> float:
            t0 = time.perf_counter_ns()
            asyncio.run_coroutine_threadsafe(read("floor-one"), loop).result(WAIT)
            total = ms_since(t0, time.perf_counter_ns())
            return total - server.requests_for("floor-one")[-1].served_s * 1000

        try:
            for _ in range(5):
                request_once()
            while True:
                yield {
                    "cancel_ms": [cancel_once() for _ in range(cfg.n(20, 60))],
                    "overhead_ms": [request_once() for _ in range(cfg.n(40, 150))],
                }
        finally:
            asyncio.run_coroutine_threadsafe(client.close(), loop).result(WAIT)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(WAIT)
