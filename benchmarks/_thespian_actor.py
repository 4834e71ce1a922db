"""Thespian's echo actor, in its own module: importing it needs thespian, which is optional."""

from __future__ import annotations

from typing import Any

from thespian.actors import Actor  # type: ignore[import-untyped]


class Echo(Actor):  # type: ignore[misc]
    def receiveMessage(self, message: Any, sender: Any) -> None:
        if isinstance(message, int):
            self.send(sender, message)
