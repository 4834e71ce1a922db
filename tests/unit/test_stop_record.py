"""The one stop record: the frames that carry a stop take it whole and refuse a stop of
another kind, also when a worker's frame is decoded (the host writes a stop report from a
``ToolKilled``: one naming an abort must never become an abort's report)."""

from __future__ import annotations

import msgspec
import pytest

from tether.wire.frames import Cancel, HostFrame, Preempt, ToolKilled, WorkerFrame
from tether.wire.records import Stop, StopKind, StopReport

pytestmark = pytest.mark.unit  # starts no process: make test-unit

_KINDS: list[StopKind] = ["cancel", "abort", "preempt", "pause"]


def test_a_cancel_reads_as_its_stop() -> None:
    cancel = Cancel(Stop("cancel", "parent", "s_root", "wrap <up>"))
    assert (cancel.reason, cancel.origin, cancel.by) == ("wrap <up>", "parent", "s_root")
    assert cancel.render() == '<cancel origin="parent" by="s_root">wrap &lt;up&gt;</cancel>'


@pytest.mark.parametrize("kind", [k for k in _KINDS if k != "cancel"])
def test_a_cancel_refuses_another_kind(kind: StopKind) -> None:
    with pytest.raises(ValueError, match="expected a cancel"):
        Cancel(Stop(kind, "user", "u"))


@pytest.mark.parametrize("kind", [k for k in _KINDS if k != "preempt"])
def test_a_worker_frame_naming_another_kind_is_refused_at_decoding(kind: StopKind) -> None:
    decoder = msgspec.msgpack.Decoder(WorkerFrame)
    good = ToolKilled("t_1", Stop("preempt", "user", "u", "stuck"))
    assert decoder.decode(msgspec.msgpack.encode(good)) == good
    encode = msgspec.msgpack.encode
    forged = encode(good).replace(encode("preempt"), encode(kind))
    with pytest.raises(msgspec.ValidationError, match="expected a preempt stop"):
        decoder.decode(forged)


def test_a_preempt_frame_round_trips_with_its_stop() -> None:
    decoder = msgspec.msgpack.Decoder(HostFrame)
    frame = Preempt("t_1", Stop("preempt", "watchdog", "watchdog", "idle 5 s"))
    back = decoder.decode(msgspec.msgpack.encode(frame))
    assert back == frame and hash(back.stop) == hash(frame.stop)


def test_a_report_gives_its_stop_back() -> None:
    stop = Stop("abort", "budget", "budget", "over the cap")
    report = StopReport(turn="t_1", session="s_1", kind="abort", origin="budget", by="budget",
                        reason="over the cap")  # fmt: skip
    assert report.stop == stop
