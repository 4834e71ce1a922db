"""The facade's approvals (semantics §17.2): ``decide``, ``approvals`` and ``approval``, the base of
``Runtime`` above ``Engine``.

A decision is checked here (its arguments), found in the store (``not-found``,
``already-decided``), then asked of its session's host, which authorizes it as an
interrupt of the session and decides it in order with everything else the turn does
(``actors.approvals``); it returns once its record is durable.
"""

from __future__ import annotations

import json
from typing import Any

from tether.actors.approvals import Decide
from tether.actors.authority import Authority
from tether.runtime._checks import check_authority, check_id, check_text
from tether.runtime._engine import Engine
from tether.wire.approval import Approval
from tether.wire.errors import AlreadyDecided, InvalidParams, NotFound, StoreUnavailable
from tether.wire.text import cap, who

__all__ = ["Approvals"]

_DECISIONS = ("approve", "deny")
_SCOPES = ("session", "subtree")


class Approvals(Engine):
    """``Runtime``'s approvals: see ``decide`` and ``approvals``."""

    def decide(
        self,
        approval_id: str,
        decision: str = "approve",
        *,
        authority: Authority,
        reason: str = "",
        arguments: dict[str, Any] | None = None,
    ) -> Approval:
        """Decide a pending tool call (semantics §17.2): ``"approve"`` runs it (with
        ``arguments`` in place of the model's, when given: checked against the tool's
        schema), ``"deny"`` tells the model ``denied by …: <reason>`` and the turn goes
        on. The authority of an interrupt of the call's session: a person holding its
        parent's address, or a live ancestor (unless its ``approver`` is ``"user"``).

        Returns the approval as decided, once its record is durable. The first decision
        stands: a later one is ``AlreadyDecided``; an unknown id ``NotFound``; an edit
        the schema refuses ``InvalidParams`` (nothing changes)."""
        check_authority(authority)
        if decision not in _DECISIONS:
            raise InvalidParams(f"decision must be one of {_DECISIONS}, not {decision!r}")
        if not isinstance(reason, str):
            raise InvalidParams("reason must be a string")
        check_text("reason", reason)
        if arguments is not None:
            if decision != "approve":
                raise InvalidParams("arguments are an approval's edit: give them to approve")
            _check_json(arguments)
        found = self.approval(approval_id)
        if found.state != "pending":
            raise AlreadyDecided(_decided(found))
        op = Decide(
            found.session,
            approval_id,
            decision == "approve",
            authority,
            cap(reason),
            arguments,
            arguments is not None,
        )
        try:
            decided, ticket = self._dispatcher.ask(found.session, op)
        except AlreadyDecided:
            latest = self._store.approval(approval_id)
            raise AlreadyDecided(_decided(latest or found)) from None
        try:
            ticket.wait()
        except StoreUnavailable as exc:
            raise StoreUnavailable(
                f"the decision took effect, but its record may not survive a crash: {exc.message}"
            ) from None
        result: Approval = decided
        return result

    def approval(self, approval_id: str) -> Approval:
        """One approval as it stands, in whatever state (``NotFound`` for an unknown id):
        how a face finds the session of the approval it is asked to decide."""
        if not isinstance(approval_id, str):
            raise InvalidParams("an approval id is a string")
        self._check_open()
        found = self._store.approval(approval_id)
        if found is None:
            raise NotFound(f"no approval {approval_id!r}")
        return found

    def approvals(self, target: str, *, scope: str = "session") -> list[Approval]:
        """The pending approvals of ``target`` (``scope="subtree"``: and of every session
        below it), oldest first: a nested one is seen from its root."""
        if scope not in _SCOPES:
            raise InvalidParams(f"scope must be one of {_SCOPES}, not {scope!r}")
        check_id(target)
        self._check_open()
        if target not in self._dir.catalog.nodes:
            raise NotFound(f"no session {target!r}")
        sessions = [target]
        if scope == "subtree":  # the target's own, then every session below it
            sessions += self._dir.catalog.preorder(target)
        return self._store.pending_approvals(sessions)


def _decided(a: Approval) -> str:
    by = who(a.origin or "system", a.decided_by)
    return f"approval {a.id} was {a.state} already (by {by})"


def _check_json(arguments: object) -> None:
    if not isinstance(arguments, dict):
        raise InvalidParams("arguments must be a JSON object (the call's arguments, edited)")
    try:
        json.dumps(arguments)
    except (TypeError, ValueError) as exc:
        raise InvalidParams(f"arguments must be JSON: {exc}") from None
