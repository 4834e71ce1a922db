"""Fuzzing the worker -> host frame decoder (issue 10, item 3; semantics §10, §14.3).

A worker runs driver code, so its end of the channel is a peer the host must not
trust. ``drivers:Hostile`` writes what Hypothesis generates straight onto its own
socket: random bytes, well-framed garbage, msgpack maps with wrong or foreign tags and
wrong field types, length prefixes over the cap, frames cut short, valid frames for a
turn that is not the worker's. After each hostile write:

* the host never crashes or wedges: the hostile turn ends (``completed`` when the
  stream stayed in step, ``crashed`` when the worker was marked faulty; a turn whose
  stream was thrown out of step is still stopped at once by an abort), and a normal
  turn on another session completes within a deadline;
* a worker that was marked faulty is replaced (its pid leaves the pool, which refills);
* every payload that does not decode is logged as ``frame.rejected``;
* nothing a hostile frame names (another turn, another session) is changed.

Bugs found here are kept as plain regression tests at the bottom, marked
``xfail(strict=True)`` with the reason, so the suite stays green until the fix lands
and then fails loudly until the marker is removed.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Iterator
from typing import Any

import msgspec
import psutil
import pytest
import structlog
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tether
from drivers import HANG, SCRIPTED, eventually, local_pool, runtime
from tether import User
from tether.wire.codec import MAX_FRAME
from tether.wire.frames import (
    Delivered,
    Escalating,
    Progress,
    Ready,
    Say,
    Steer,
    ToolCall,
    ToolKilled,
    TurnEnd,
    WorkerFrame,
)
from tether.wire.records import Stop

DEADLINE = 10.0  # seconds for anything that must converge
_decoder = msgspec.msgpack.Decoder(WorkerFrame)
_encoder = msgspec.msgpack.Encoder()

WORKER_TAGS = ["ready", "say", "call", "delivered", "tool_killed", "end", "progress",
               "escalating", "probe_reply"]  # fmt: skip
HOST_TAGS = ["run", "steer", "cancel", "preempt", "reply", "escalate", "probe", "shutdown"]


def _settings(n: int) -> settings:
    return settings(
        max_examples=int(os.environ.get("TETHER_FUZZ_EXAMPLES", str(n))),
        deadline=None,
        derandomize=os.environ.get("TETHER_FUZZ_EXPLORE") != "1",
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# ---- what a hostile peer writes -----------------------------------------------------------

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=20),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def _tagged_maps(draw: st.DrawFn) -> bytes:
    """A msgpack map that looks like a frame: a real, foreign or bogus tag, plausible and
    implausible fields."""
    tag = draw(st.sampled_from([*WORKER_TAGS, *HOST_TAGS, "bogus", ""]) | st.text(max_size=6))
    fields = draw(
        st.dictionaries(
            st.sampled_from(["turn", "kind", "text", "call", "name", "args", "steers",
                             "cancel", "outcome", "final", "error", "pid", "driver", "data"])
            | st.text(max_size=6),
            _values,
            max_size=5,
        )
    )  # fmt: skip
    if draw(st.booleans()):
        fields["type"] = tag
    return _encoder.encode(fields)


def _nested(depth: int, container: str) -> bytes:
    """A Say frame whose ``data`` holds ``depth`` nested arrays or maps."""
    opener = b"\x91" if container == "array" else b"\x81\xa1k"
    head = _encoder.encode({"type": "say", "turn": "t_x", "kind": "assistant", "text": "x"})
    return b"\x85" + head[1:] + _encoder.encode("data") + b"\x81\xa1a" + opener * depth + b"\xc0"


def _decodes(payload: bytes) -> str:
    """What the host's decoder makes of ``payload``: ``frame:<Tag>`` or ``rejected``."""
    try:
        frame = _decoder.decode(payload)
    except (msgspec.DecodeError, RecursionError):
        return "rejected"
    return f"frame:{type(frame).__name__}"


# ---- the harness --------------------------------------------------------------------------


class Harness:
    """One runtime for many hostile examples: each gets a fresh hostile session; one
    witness session proves after each that the host still serves."""

    def __init__(self, rt: tether.Runtime) -> None:
        self.rt = rt
        self.root = rt.open_session(SCRIPTED)
        self.me = User(parent=self.root)
        witness = rt.spawn(self.root, SCRIPTED)
        self.witness = witness
        self.n = 0

    def hostile(self, data: dict[str, Any]) -> tuple[str, tether.TurnRecord, int, list[Any]]:
        """Run one hostile turn; returns (session, its ended turn, its worker pid, logs)."""
        rt = self.rt
        bad = rt.spawn(self.root, "drivers:Hostile")
        self.n += 1
        with structlog.testing.capture_logs() as logs:
            rt.send(bad, "go", authority=self.me, data=data)
            said = eventually(
                lambda: next((e for e in rt.transcript(bad) if e.text.startswith("pid ")), None),
                timeout=DEADLINE,
                what="the hostile driver to start",
            )
            pid = int(said.text.split()[1])
            if data.get("then") == "hang" and data.get("how") in ("raw", "truncated"):
                # The stream may be out of step now: whatever it does with the rest, an
                # abort must still stop the turn at once (semantics §14.3).
                rt.interrupt(bad, authority=self.me, kind="abort", reason="fuzz")
            turn = self.ended(bad)
        self.check_host_serves()
        return bad, turn, pid, logs

    def ended(self, sid: str, timeout: float = DEADLINE) -> tether.TurnRecord:
        def last() -> tether.TurnRecord | None:
            turns = self.rt.turns(sid)
            return turns[-1] if turns and turns[-1].outcome is not None else None

        return eventually(last, timeout=timeout, what=f"the hostile turn of {sid} to end")

    def check_host_serves(self) -> None:
        """A normal turn on another session completes within the deadline."""
        rt = self.rt
        before = len(rt.turns(self.witness))
        rt.send(self.witness, "ping", authority=self.me)
        done = eventually(
            lambda: (
                len(t := rt.turns(self.witness)) > before and t[-1].outcome is not None and t[-1]
            ),
            timeout=DEADLINE,
            what="a normal turn on another session to complete",
        )
        assert done.outcome == "completed", done

    def check_replaced(self, pid: int) -> None:
        """The faulty worker is gone and the pool is whole again (2 workers + a spare)."""
        rt = self.rt
        eventually(lambda: pid not in rt.worker_pids, timeout=DEADLINE, what="the worker to go")
        eventually(lambda: len(rt.worker_pids) == 3, timeout=DEADLINE, what="the pool to refill")
        with contextlib.suppress(psutil.NoSuchProcess):
            assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.fixture
def harness() -> Iterator[Harness]:
    """A runtime per test (the fuzzers share it across their examples; a runtime per
    test keeps the leak check exact, since faulty workers are replaced by new ones)."""
    with runtime(workers=2, grace=0.5) as rt:
        yield Harness(rt)


fresh = harness


def _rejections(logs: list[dict[str, Any]], pid: int) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == "frame.rejected" and e.get("pid") == pid]


# ---- the fuzzers --------------------------------------------------------------------------

_payloads = st.one_of(
    st.binary(max_size=300),
    _tagged_maps(),
    # Nesting past the interpreter's recursion limit too (it killed the reader once),
    # as deep as a message's data may carry it (the hex of 100,000 maps is under 1 MB).
    st.builds(_nested, st.integers(1, 100_000), st.sampled_from(["array", "map"])),
)


@pytest.mark.timeout(300)
def test_a_well_framed_hostile_payload_never_crashes_or_wedges_the_host(
    harness: Harness,
) -> None:
    """Random bytes, msgpack with wrong/foreign tags and wrong field types, moderate
    nesting, each as one well-framed payload: rejected and logged, or harmless."""

    @_settings(200)
    @given(payload=_payloads)
    def one(payload: bytes) -> None:
        verdict = _decodes(payload)
        if verdict == "frame:Ready":  # a repeated handshake: see its regression test below
            return
        sid, turn, pid, logs = harness.hostile({"how": "framed", "hex": payload.hex()})
        # semantics §14.3: an undecodable frame marks the worker faulty (crashed, replaced);
        # a decodable one that names nothing of this turn is dropped and the turn goes on.
        assert turn.outcome in ("completed", "crashed"), turn
        if turn.outcome == "crashed":
            harness.check_replaced(pid)
        else:
            assert [e.text for e in harness.rt.transcript(sid) if e.kind == "marker"] == []
        if verdict == "rejected":
            rejected = _rejections(logs, pid)
            assert rejected, f"an undecodable frame was not logged: {payload[:40]!r}"
            assert all(e["log_level"] == "error" for e in rejected)

    one()
    print(f"examples run: {harness.n}")


@pytest.mark.timeout(300)
def test_a_stream_thrown_out_of_step_never_wedges_the_host(harness: Harness) -> None:
    """Unframed random bytes, and frames announced longer than what follows: the
    reader may be out of step for good, but an abort still stops the turn at once and
    the rest of the runtime serves."""

    @_settings(60)
    @given(
        how=st.sampled_from(["raw", "truncated"]),
        payload=st.binary(min_size=1, max_size=200),
        extra=st.integers(1, 4096),
    )
    def one(how: str, payload: bytes, extra: int) -> None:
        data = {"how": how, "hex": payload.hex(), "then": "hang", "length": len(payload) + extra}
        _, turn, pid, logs = harness.hostile(data)
        # aborted as asked, or crashed first when the garbage read as an oversized length
        assert turn.outcome in ("aborted", "crashed"), turn
        harness.check_replaced(pid)
        if turn.outcome == "crashed":
            assert _rejections(logs, pid), "the frame that broke the stream was not logged"

    one()
    print(f"examples run: {harness.n}")


@pytest.mark.timeout(120)
def test_a_length_prefix_over_the_cap_marks_the_worker_faulty(harness: Harness) -> None:
    @_settings(15)
    @given(length=st.integers(MAX_FRAME + 1, 2**32 - 1))
    def one(length: int) -> None:
        data = {"how": "header", "length": length, "then": "hang"}
        _, turn, pid, logs = harness.hostile(data)
        assert turn.outcome == "crashed" and turn.error and "over" in turn.error, turn
        assert turn.cause == "system"
        harness.check_replaced(pid)
        rejected = _rejections(logs, pid)
        assert rejected and rejected[0]["log_level"] == "error"

    one()
    print(f"examples run: {harness.n}")


@pytest.mark.timeout(120)
def test_a_peer_that_dies_mid_frame_crashes_its_turn_only(harness: Harness) -> None:
    @_settings(20)
    @given(payload=st.binary(max_size=64), extra=st.integers(1, 1000), header=st.booleans())
    def one(payload: bytes, extra: int, header: bool) -> None:
        if header:  # a length prefix and part of its payload
            data = {"how": "truncated", "length": len(payload) + extra, "hex": payload.hex()}
        else:  # part of a length prefix
            data = {"how": "raw", "hex": b"\x00\x00"[: 1 + extra % 2].hex()}
        _, turn, pid, _ = harness.hostile({**data, "then": "exit"})
        assert turn.outcome == "crashed" and turn.cause == "system", turn
        harness.check_replaced(pid)

    one()
    print(f"examples run: {harness.n}")


@st.composite
def _wrong_turn_frames(draw: st.DrawFn, turns: list[str]) -> bytes:
    """A valid worker frame that names a turn not the worker's own."""
    turn = draw(st.sampled_from(turns) | st.text(max_size=12))
    frame = draw(
        st.sampled_from(
            [
                Say(turn=turn, kind="assistant", text="planted"),
                Say(turn=turn, kind="tool", text="planted"),
                ToolCall(turn=turn, call=1, name="send_message", args={"to": "x", "text": "y"}),
                ToolCall(turn=turn, call=2, name="interrupt_agent", args={"agent_id": "x"}),
                Delivered(turn=turn, steers=[Steer("planted", "user", "mallory")], cancel=True),
                ToolKilled(turn=turn, stop=Stop("preempt", "user", "mallory", "planted")),
                TurnEnd(turn=turn, outcome="completed", final="planted"),
                TurnEnd(turn=turn, outcome="cancelled"),
                Progress(turn=turn),
                Escalating(turn=turn),
            ]
        )
    )
    return _encoder.encode(frame)


@pytest.mark.timeout(300)
def test_a_valid_frame_for_another_turn_changes_nothing(harness: Harness) -> None:
    """Frames naming an ended turn, the witness's turn or a made-up one: dropped; no
    entry, marker, end or tool call lands anywhere."""
    rt = harness.rt
    # A bystander whose turn is live while the hostile frames name it.
    bystander = rt.spawn(harness.root, SCRIPTED, prompt="hang", data=HANG)
    rt.wait(bystander, until="running")
    live = rt.status(bystander).turn
    assert live is not None
    witness_turns = [t.id for t in rt.turns(harness.witness)]
    names = [live, *witness_turns, "t_00000000000000000000000000000000"]

    @_settings(60)
    @given(payload=_wrong_turn_frames(names))
    def one(payload: bytes) -> None:
        sid, turn, _, _ = harness.hostile({"how": "framed", "hex": payload.hex()})
        assert turn.outcome == "completed" and turn.error is None, turn
        for s in (sid, bystander, harness.witness, harness.root):
            planted = [e for e in rt.transcript(s) if "planted" in e.text or e.by == "mallory"]
            assert planted == [], f"a frame for another turn landed in {s}: {planted}"
        info = rt.status(bystander)
        assert info.state == "running" and info.turn == live and info.stopping is None
        assert [t.outcome for t in rt.turns(bystander)] == [None]

    try:
        one()
    finally:
        rt.interrupt(bystander, authority=harness.me, kind="abort")
        rt.wait(bystander)


# ---- regression tests: what the fuzzers found ---------------------------------------------


@pytest.mark.timeout(60)
def test_a_deeply_nested_frame_is_rejected_and_the_turn_still_ends(fresh: Harness) -> None:
    """Shrunk from the fuzzer: a Say whose data nests 100,000 arrays (2 + 100 kB)."""
    payload = _nested(100_000, "array")
    assert _decodes(payload) == "rejected"
    rt = fresh.rt
    bad = rt.spawn(fresh.root, "drivers:Hostile")
    with structlog.testing.capture_logs() as logs:
        rt.send(bad, "go", authority=fresh.me, data={"how": "framed", "hex": payload.hex()})
        turn = fresh.ended(bad, timeout=10.0)
    assert turn.outcome == "crashed", turn  # the worker is faulty (semantics §14.3)
    assert any(e["event"] == "frame.rejected" for e in logs)
    fresh.check_host_serves()


@pytest.mark.timeout(60)
def test_a_repeated_ready_from_a_busy_worker_is_rejected(fresh: Harness) -> None:
    rt = fresh.rt
    payload = _encoder.encode(Ready(pid=1))
    _, turn, pid, logs = fresh.hostile({"how": "framed", "hex": payload.hex()})
    assert turn.outcome == "completed"
    assert _rejections(logs, pid), "the repeated Ready was not logged as frame.rejected"
    assert pid in rt.worker_pids, "the worker that repeated Ready was shut down"
    assert local_pool(rt)._starting >= 0


@pytest.mark.timeout(60)
def test_a_frame_cut_short_is_logged_as_rejected(fresh: Harness) -> None:
    data = {"how": "truncated", "length": 100, "hex": b"\x81".hex(), "then": "exit"}
    _, turn, pid, logs = fresh.hostile(data)
    assert turn.outcome == "crashed"
    assert _rejections(logs, pid)


@pytest.mark.timeout(60)
def test_a_frame_for_another_turn_is_logged_as_rejected(fresh: Harness) -> None:
    payload = _encoder.encode(Say(turn="t_not_mine", kind="assistant", text="planted"))
    _, turn, pid, logs = fresh.hostile({"how": "framed", "hex": payload.hex()})
    assert turn.outcome == "completed"
    assert _rejections(logs, pid)


@pytest.mark.unit
def test_the_framing_the_fuzzers_write_is_the_codecs() -> None:
    """The Hostile driver's ``framed`` bytes are exactly what ``Channel.send_bytes``
    writes (so the fuzzers test the decoder, not a framing of their own)."""
    assert struct.pack(">I", 3) + b"abc" == b"\x00\x00\x00\x03abc"
    assert _decodes(_encoder.encode(Say(turn="t", kind="assistant", text="x"))) == "frame:Say"
