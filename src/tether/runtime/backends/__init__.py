"""What every worker backend shares: the turn table (``_turns``).

The backends themselves (the local pool, ``runtime.pool``, and Ray,
``runtime.ray_backend``) drive their workers and leave each turn's life to the table.
"""

__all__: list[str] = []
