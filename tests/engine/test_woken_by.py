"""`TurnRecord.woken_by`: the host names the waking send that started a turn.

It is the host's own order of sends and turn ends, which no caller's clock can give
(issue 16 item 18: the soak's checker needs it to tell a legitimate wake from a parked
queue that started by itself).
"""

from __future__ import annotations

import tether
from drivers import HANG, eventually
from tether import User


def test_a_turn_names_the_waking_send_that_started_it_and_a_follow_on_turn_names_none(
    rt: tether.Runtime,
) -> None:
    root = rt.open_session("tether:Scripted")
    me = User(parent=root)
    first = rt.send(root, "one", authority=me, data=HANG)
    second = rt.send(root, "two", authority=me, wake=False)  # queued behind it
    turn = rt.interrupt(root, authority=me, kind="cancel")
    rt.wait(root, until="parked")
    third = rt.send(root, "three", authority=me)  # the waking send after the stop
    rt.wait(root, until="idle")
    turns = rt.turns(root)
    assert [t.message for t in turns] == [first, second, third]
    assert turns[0].id == turn and turns[0].woken_by == first
    assert turns[1].woken_by == third  # parked B runs first, woken by C's send
    assert turns[2].woken_by is None  # it followed B's completion


def test_a_send_that_latches_during_a_stop_and_one_that_wakes_a_dormant_session_are_named(
    rt: tether.Runtime,
) -> None:
    root = rt.open_session("tether:Scripted")
    me = User(parent=root)
    # a model call that hangs: no boundary, so the cancel converges until the abort
    hang = {"op": "sleep", "seconds": 60, "say": "in the call"}
    rt.send(root, "one", authority=me, data={"steps": [hang]})
    # in the call first: a cancel that reached the turn's start would end it at its first
    # boundary, before the next send, which would then start a turn rather than latch
    eventually(
        lambda: any(e.text == "in the call" for e in rt.transcript(root)),
        what="the turn in its hung call",
    )
    rt.interrupt(root, authority=me, kind="cancel", grace=30.0)
    latched = rt.send(root, "two", authority=me)  # accepted while the stop converges
    rt.interrupt(root, authority=me, kind="abort")
    rt.wait(root, until="idle")
    assert [t.woken_by for t in rt.turns(root)][1] == latched

    child = rt.spawn(root, "tether:Scripted", slug="kid")
    rt.release(child)
    woke = rt.send(child, "wake up", authority=me)
    rt.wait(child, until="idle")
    [turn] = rt.turns(child)
    assert turn.woken_by == woke
