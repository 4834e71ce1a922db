"""The pool's worker slots while turns wait on approvals (semantics §17.2): a turn that
waits on approvals alone counts against no slot of ``workers``, so the pool keeps one more
worker active for each such turn (the spare steps in at once, and the spawner makes a new
one); when its decision comes, the surplus goes back as workers free up.

Functions of ``Pool`` (``pool.py``), called under its lock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tether.wire.frames import Shutdown

if TYPE_CHECKING:
    from tether.runtime.backends.pool import Pool

__all__ = ["fit_locked", "target_locked"]


def target_locked(pool: Pool) -> int:
    """How many workers to keep active: ``workers``, and one for each active worker
    whose turn waits on approvals alone."""
    waiting = pool.waiting_turns
    if not waiting:
        return pool.size
    specs = (pool.turns.spec_of_locked(w) for w in pool._active)
    return pool.size + sum(1 for spec in specs if spec is not None and spec.turn in waiting)


def fit_locked(pool: Pool) -> None:
    """Bring the active workers to ``target_locked``: the spare steps in when one is
    missing (the spawner replaces it); an idle worker past it goes back to being the
    spare, or is shut down."""
    target = target_locked(pool)
    if len(pool._active) < target and pool._spare is not None:
        pool._active.append(pool._spare)
        pool._spare = None
    while len(pool._active) > target:
        idle = next(
            (
                w
                for w in pool._active
                if pool.turns.spec_of_locked(w) is None and w.frozen_for is None
            ),
            None,
        )
        if idle is None:
            break  # each is busy: the next to free up goes
        pool._active.remove(idle)
        if pool._spare is None:
            pool._spare = idle
        else:
            idle.post(Shutdown())  # it exits; its stream's end finishes it
    pool.turns.dispatch_locked()
    pool._changed.notify_all()
