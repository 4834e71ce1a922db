"""Hosted agents (semantics §16.1): async drivers that run an agent written with another
framework inside a Tether turn, so that every stop reaches inside it.

One module per framework, each needing its own extra: ``pydantic_ai``
(``tether-runtime[pydantic-ai]``), ``openai_agents`` (``tether-runtime[openai-agents]``) and
``claude_code`` (``tether-runtime[claude]``). Nothing here is imported by the engine.
"""

from __future__ import annotations

__all__: list[str] = []
