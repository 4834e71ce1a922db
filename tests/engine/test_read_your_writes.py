"""Read-your-writes across sessions (semantics §15.8): a call that returned is seen by every
later call, whichever sessions they touch.

Each case is a race between a session's host and the caller's next call, so each is
looped a couple of hundred times with a small switch interval.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import tether
from drivers import HANG, switching_fast
from tether import Ancestor, User

pytestmark = pytest.mark.timeout(180)

TRIES = 200


@pytest.fixture
def fast_switches() -> Iterator[None]:
    with switching_fast():
        yield


def _tree(rt: tether.Runtime) -> tuple[str, str, str]:
    """A root, its child ``parent`` and that one's child ``child``, all idle."""
    root = rt.open_session("tether:Scripted")
    parent = rt.spawn(root, "tether:Scripted")
    child = rt.spawn(parent, "tether:Scripted")
    return root, parent, child


def test_a_send_that_woke_a_dormant_parent_lets_the_next_send_reach_its_child(
    rt: tether.Runtime, fast_switches: None
) -> None:
    """The issue's repro: `ParentOffline` on 200 of 200 tries before the fix."""
    root, parent, child = _tree(rt)
    offline = 0
    for i in range(TRIES):
        rt.release(child)
        rt.release(parent)
        assert rt.status(parent).state == "dormant"
        rt.send(parent, f"wake {i}", authority=User(parent=root))
        try:
            rt.send(child, f"task {i}", authority=User(parent=parent))
        except tether.ParentOffline:
            offline += 1
        # the child first: its turn's end notice may wake the idle parent once more
        rt.wait(child, until=("idle", "dormant"), timeout=10.0)
        rt.wait(parent, until="idle", timeout=10.0)
    assert offline == 0, f"ParentOffline on {offline} of {TRIES} tries"


def test_a_send_that_woke_a_dormant_parent_lets_its_ref_act_on_its_child_at_once(
    rt: tether.Runtime, fast_switches: None
) -> None:
    """A waking send, then the parent's ref, then that ref's authority over its child."""
    root, parent, child = _tree(rt)
    for i in range(TRIES):
        rt.release(child)
        rt.release(parent)
        rt.send(parent, f"wake {i}", authority=Ancestor(rt.agent_ref(root)))
        ref = rt.agent_ref(parent)  # the parent's new activation, at once
        rt.send(child, f"task {i}", authority=Ancestor(ref), data=HANG)
        assert rt.interrupt(child, authority=Ancestor(ref), kind="abort") is not None
        rt.wait(child, until="parked", timeout=10.0)
        rt.wait(parent, until="idle", timeout=10.0)


def test_a_spawned_child_can_be_sent_to_paused_and_stopped_at_once(
    rt: tether.Runtime, fast_switches: None
) -> None:
    """After spawn returns: a send with the parent's address or ref, a pause and an
    abort bound to its first turn, and a grandchild under the parent's authority."""
    root = rt.open_session("tether:Scripted")
    parent = rt.spawn(root, "tether:Scripted")
    for i in range(TRIES):
        child = rt.spawn(parent, "tether:Scripted", prompt=f"task {i}", data=HANG)
        rt.send(child, "more", authority=User(parent=parent), wake=False)
        ref = rt.agent_ref(parent)
        rt.send(child, "more", authority=Ancestor(ref), wake=False)
        grandchild = rt.spawn(child, "tether:Scripted")
        rt.send(grandchild, "hi", authority=Ancestor(rt.agent_ref(child)), wake=False)
        frozen = rt.pause(child, authority=User(parent=parent))
        assert len(frozen) == 1, f"try {i}: the pause found no turn"
        turn = rt.interrupt(child, authority=Ancestor(ref), kind="abort")
        assert turn == frozen[0], f"try {i}: the abort was bound to {turn}"
        rt.dispose(child, authority=User(parent=parent), wait=False)


def test_status_right_after_an_interrupt_shows_the_stop_pending_or_taken(
    rt: tether.Runtime, fast_switches: None
) -> None:
    root = rt.open_session("tether:Scripted")
    for i in range(TRIES):
        child = rt.spawn(root, "tether:Scripted", prompt=f"task {i}", data=HANG)
        kind = "cancel" if i % 2 else "abort"
        turn = rt.interrupt(child, authority=User(parent=root), kind=kind, grace=0.0)
        assert turn is not None, f"try {i}: nothing to stop right after spawn"
        info = rt.status(child)
        taken = info.state == "parked" and info.turn is None
        pending = info.turn == turn and info.stopping in (kind, "abort")
        assert taken or pending, f"try {i}: {info}"
        if not taken:
            rt.interrupt(child, authority=User(parent=root), kind="abort")
        rt.wait(child, until="parked", timeout=10.0)
        assert rt.turns(child)[-1].outcome in ("cancelled", "aborted")
