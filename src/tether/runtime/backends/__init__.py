"""The worker backends (semantics §14.6) and what they share.

- ``_turns``: the turn table, one turn's life on any backend.
- ``_io``: the local pool's one I/O loop over its worker sockets.
- ``pool``: the local process pool (``backend="local"``).
- ``ray``, with ``_ray_actors`` (slot and reaper actors), ``_ray_child`` (a slot's turn
  worker and its keeper) and ``_ray_guard`` (takes down a Ray the host started):
  ``backend="ray"``, the extra ``tether-runtime[ray]``; imported only when asked for.

Each backend drives its workers and leaves each turn's life to the table.
"""

__all__: list[str] = []
