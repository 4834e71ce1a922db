"""A stateful property test: the public API against a small reference model (issue 10).

Hypothesis drives a real runtime (real workers, in-memory store) through random
sequences of the public calls — open, spawn (continuable and one-shot), send (waking or
not, with right and wrong authorities), every interrupt kind from every kind of caller
(``User`` with the right or a wrong parent, ``Ancestor`` of a live ancestor, a
sibling, the target itself, a stale ref), the ``turn=`` guard, pause/resume (one
session or a subtree), release, dispose, a one-shot's ``kill`` — and after every step
compares the runtime with what ``Model`` predicts from semantics §4–§6, §14.2 and §14.4 and
docs/DECISIONS.md:

* every session's state, pending count, running turn and ``stopping``;
* its inbox, in order (FIFO: user messages by id, notices and prompts as "other");
* its turns, in order: the message each claimed, outcome, cause, ``by``, reason;
* its markers, in order: action, origin, ``by``, reason and the exact text;
* what each call returned, or the exact error class it raised; a refused call must
  leave every one of the above unchanged.

Determinism, so that shrinking works: turns are Scripted and of two shapes only, a
``hang`` (boundaries every 10 ms until stopped) or a turn with no steps (completes at
once). At most one hang turn runs at a time (``MAX_HANG``), so a short turn always finds
a free worker (2 workers). After every step the test waits (polling, with a deadline,
never a fixed sleep) until the runtime shows what the model predicts; every stop of a
running turn therefore converges before the next step. A step whose effect the model
cannot predict exactly is not taken: it is simulated first on a copy of the model and
skipped when it would start a second hang turn.

Runs 25 examples of 30 steps by default; ``TETHER_MODEL_EXAMPLES`` / ``TETHER_MODEL_STEPS``
scale it (e.g. for a long local hunt), ``TETHER_MODEL_EXPLORE=1`` lets Hypothesis pick
fresh random examples instead of the fixed derandomized set CI runs.

Its power was checked by mutation: with one rule of the model changed (a notice
waking a parked parent), the default run fails and shrinks to a readable sequence
(open a root, run and cancel its turn, let a child's turn end: the root must stay
parked). Real bugs it finds are kept below as plain regression tests (none so far: the
runtime agreed with the model over the default run and over 300 random 40-step
examples).
"""

from __future__ import annotations

import collections
import copy
import html
import inspect
import os
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import tether
from drivers import HANG, SCRIPTED, eventually
from tether import AgentRef, Ancestor, User

MAX_HANG = 1  # hang turns running (or paused) at once: one worker stays free for short turns
MAX_SESSIONS = 5  # not settled, at once
MAX_TOTAL = 16
MAX_ROOTS = 2  # not settled, at once
CONVERGE = 10.0  # seconds for the runtime to show what the model predicts
REASON_CAP = 2000
NO_TURN = "t_" + "0" * 32  # a turn id of the runtime's shape that names no turn

# ---- the reference model ------------------------------------------------------------------


@dataclass
class MMsg:
    label: str  # the message id for a user message (we know it); "other" for prompts, notices
    hang: bool


@dataclass
class MTurn:
    label: str
    hang: bool
    id: str | None = None  # learned from the runtime once the turn shows
    outcome: str | None = None
    cause: str | None = None
    by: str | None = None
    reason: str | None = None
    stop: tuple[str, str, str, str] | None = None  # (kind, origin, by, reason)
    paused: bool = False
    held_steers: list[tuple[str, str, str]] = field(default_factory=list)
    latch: bool = False


@dataclass
class MSession:
    id: str
    parent: str | None
    mode: str
    live: bool = True
    settled: bool = False
    disposing: bool = False
    gen: int = 1  # bumped at each materialization: a ref of an older gen is stale
    hold: bool = False
    started: int = 0
    inbox: list[MMsg] = field(default_factory=list)
    turn: MTurn | None = None
    turns: list[MTurn] = field(default_factory=list)
    markers: list[tuple[str, str, str, str]] = field(default_factory=list)
    children: list[str] = field(default_factory=list)


# An authority as the model sees it: ("user", parent, name) or ("anc", session, gen).
Auth = tuple[Any, ...]


class Refused(Exception):
    """The model's prediction that a call is refused with ``cls``."""

    def __init__(self, cls: type[tether.TetherError]) -> None:
        super().__init__(cls.__name__)
        self.cls = cls


def cap(text: str) -> str:
    if len(text) <= REASON_CAP:
        return text
    return f"{text[:REASON_CAP]}…[truncated {len(text) - REASON_CAP} characters]"


_VERB = {
    "steered": "↪ Steered",
    "cancelled": "⊘ Cancelled",
    "aborted": "⊘ Aborted",
    "paused": "⏸ Paused",
    "resumed": "▶ Resumed",
}


def marker_text(action: str, origin: str, by: str, reason: str) -> str:
    """semantics §5/§14.4, written out independently of ``tether.wire.text``: a person
    by name (``by user alice``, or ``by user`` with none), an agent by id."""
    if origin == "user":
        head = f"{_VERB[action]} by user" + (
            "" if by == "user" else f" {html.escape(by, quote=True)}"
        )
    else:
        head = f"{_VERB[action]} by {origin} ({html.escape(by, quote=True)})"
    return f"{head}: {html.escape(reason, quote=True)}" if reason else head


class Model:
    """semantics §4–§6, §14.2, §14.4 for Scripted hang/short turns, as plain bookkeeping."""

    def __init__(self) -> None:
        self.sessions: dict[str, MSession] = {}
        self.order: list[str] = []  # creation order

    # -- tree -----------------------------------------------------------------------------

    def ancestors(self, sid: str) -> list[str]:
        out = []
        p = self.sessions[sid].parent
        while p is not None:
            out.append(p)
            p = self.sessions[p].parent
        return out

    def preorder(self, sid: str) -> list[str]:
        out: list[str] = []
        for c in self.sessions[sid].children:
            out.append(c)
            out.extend(self.preorder(c))
        return out

    def owner(self, s: MSession) -> str:
        return s.parent if s.parent is not None else s.id

    def hang_turns(self) -> int:
        return sum(1 for s in self.sessions.values() if s.turn is not None and s.turn.hang)

    def ref_valid(self, auth: Auth) -> bool:
        _, sid, gen = auth
        s = self.sessions.get(sid)
        return s is not None and s.live and not s.settled and s.gen == gen

    @staticmethod
    def origin_by(auth: Auth) -> tuple[str, str]:
        if auth[0] == "user":
            return "user", auth[2] or "user"  # a person's name, never the address
        return "parent", auth[1]

    # -- inbox (§4) -------------------------------------------------------------------------

    def start_next(self, s: MSession) -> None:
        while (
            s.live
            and not s.settled
            and not s.disposing
            and s.turn is None
            and not s.hold
            and s.inbox
            and (s.mode != "one-shot" or s.started == 0)
        ):
            msg = s.inbox.pop(0)
            t = MTurn(msg.label, msg.hang)
            s.turns.append(t)
            s.started += 1
            s.turn = t
            if msg.hang:
                return
            t.outcome = "completed"  # a turn with no steps completes at once
            self.ended(s, t)
            if s.turn is not None or s.settled:
                return

    def ended(self, s: MSession, t: MTurn) -> None:
        s.turn = None
        if t.outcome != "completed":
            s.hold = not t.latch  # §4.3, and the wake latch of §4.5
        if s.parent is not None:
            self.notify(s.parent, s.id)
        if s.mode == "one-shot" or s.disposing:
            s.settled = True
            s.live = False
            s.inbox.clear()
        else:
            self.start_next(s)

    def notify(self, parent: str, child: str) -> None:
        """§5: a ChildTurnEnded notice wakes an idle parent, never a parked/dormant one."""
        p = self.sessions[parent]
        if p.settled or p.disposing:
            return  # README: written and kept for a disposing parent, never queued to it
        p.inbox.append(MMsg("other", False))
        if p.live and p.turn is None and not p.hold:
            self.start_next(p)

    def end_turn(self, s: MSession, outcome: str) -> None:
        t = s.turn
        assert t is not None and t.stop is not None
        _, origin, by, reason = t.stop
        t.outcome, t.cause, t.by, t.reason = outcome, origin, by, reason
        self.ended(s, t)

    # -- calls --------------------------------------------------------------------------------

    def open_root(self, sid: str) -> None:
        self.sessions[sid] = MSession(sid, None, "continuable")
        self.order.append(sid)

    def spawn(self, sid: str, parent: str, mode: str, prompt: bool | None) -> None:
        """``prompt``: None (no first message), False (a short one), True (a hang)."""
        p = self.sessions[parent]
        if p.settled or p.disposing:
            raise Refused(tether.InvalidParams)
        if mode == "one-shot" and prompt is None:
            raise Refused(tether.InvalidParams)
        s = MSession(sid, parent, mode)
        self.sessions[sid] = s
        self.order.append(sid)
        p.children.append(sid)
        if prompt is not None:
            s.inbox.append(MMsg("other", prompt))
            self.start_next(s)

    def check_send(self, target: str, auth: Auth | None) -> MSession:
        s = self.sessions.get(target)
        if s is None:
            raise Refused(tether.NotFound)
        if s.settled or s.disposing:
            raise Refused(tether.InvalidParams)
        if auth is None:  # rt.prompt: the embedding host, roots only
            if s.parent is not None:
                raise Refused(tether.InvalidParams)
            return s
        if s.mode == "one-shot":
            raise Refused(tether.InvalidParams)
        if auth[0] == "anc":
            if not self.ref_valid(auth):
                raise Refused(tether.Unauthorized)
            if auth[1] != s.parent:
                raise Refused(tether.Unauthorized)
        elif s.parent is None:
            if auth[1] != s.id:
                raise Refused(tether.Unauthorized)
        else:
            if auth[1] != s.parent:
                raise Refused(tether.Unauthorized)
            if not self.sessions[s.parent].live:
                raise Refused(tether.ParentOffline)
        return s

    def send(self, target: str, auth: Auth | None, label: str, hang: bool, wake: bool) -> None:
        s = self.sessions[target]
        s.inbox.append(MMsg(label, hang))
        if not s.live:
            if wake:  # a waking send materializes a dormant session (new epoch)
                s.live = True
                s.gen += 1
                s.hold = False
                self.start_next(s)
            return
        t = s.turn
        if wake:
            if t is not None:
                if t.stop is not None:
                    t.latch = True
            else:
                s.hold = False
                self.start_next(s)
        elif t is None:
            s.hold = True

    def authorize_interrupt(self, target: str, auth: Auth) -> MSession | None:
        if auth[0] == "anc" and not self.ref_valid(auth):
            raise Refused(tether.Unauthorized)  # stale even for an absent target
        s = self.sessions.get(target)
        if s is None or not s.live or s.settled:
            return None
        if s.mode == "one-shot":
            return None
        if auth[0] == "user":
            if self.owner(s) != auth[1]:
                raise Refused(tether.Unauthorized)
        else:
            if auth[1] == target:
                raise Refused(tether.Unauthorized)
            if auth[1] not in self.ancestors(target):
                raise Refused(tether.Unauthorized)
        return s

    def interrupt(
        self, target: str, auth: Auth | None, kind: str, reason: str, guard: str | None
    ) -> str | None:
        """``auth`` None: the one-shot holder's kill (the host, trusted)."""
        if kind == "steer" and not reason.strip():
            raise Refused(tether.InvalidParams)
        if auth is None:
            s0 = self.sessions[target]
            s = s0 if s0.live and not s0.settled else None
            origin, by = "user", "holder"
        else:
            s = self.authorize_interrupt(target, auth)
            origin, by = self.origin_by(auth)
        if s is None:
            return None
        t = s.turn
        if s.disposing or t is None or (guard is not None and guard != t.id):
            return None
        reason = cap(reason)
        if kind == "steer":
            if t.stop is not None:
                return None  # README: a steer to a stopping turn returns None
            if t.paused:
                t.held_steers.append((origin, by, reason))
            else:
                s.markers.append(("steered", origin, by, reason))
        elif kind == "cancel":
            if t.stop is None:
                t.stop = ("cancel", origin, by, reason)
                t.held_steers.clear()  # a stop discards the steers pending before it
                s.markers.append(("cancelled", origin, by, reason))
                if not t.paused:
                    self.end_turn(s, "cancelled")
        elif kind == "abort" and (t.stop is None or t.stop[0] != "abort"):
            t.stop = ("abort", origin, by, reason)  # an abort overrides a pending cancel
            t.held_steers.clear()
            s.markers.append(("aborted", origin, by, reason))
            self.end_turn(s, "aborted")  # a frozen tree is killed at once too
        return t.id  # preempt with no run_command: the turn's id, nothing happens

    def pause_one(self, s: MSession, origin: str, by: str, reason: str) -> str | None:
        t = s.turn
        if t is None or s.disposing or s.settled:
            return None
        if t.paused:
            return t.id
        t.paused = True
        s.markers.append(("paused", origin, by, reason))
        return t.id

    def resume_one(self, s: MSession, origin: str, by: str) -> str | None:
        t = s.turn
        if t is None or not t.paused:
            return None
        t.paused = False
        s.markers.append(("resumed", origin, by, ""))
        for origin_, by_, text in t.held_steers:
            s.markers.append(("steered", origin_, by_, text))
        t.held_steers.clear()
        tid = t.id
        if t.stop is not None and t.stop[0] == "cancel":
            self.end_turn(s, "cancelled")
        return tid

    def _toggle(self, s: MSession, origin: str, by: str, reason: str, resume: bool) -> str | None:
        return self.resume_one(s, origin, by) if resume else self.pause_one(s, origin, by, reason)

    def pause(self, target: str, auth: Auth, scope: str, reason: str, resume: bool) -> list[str]:
        origin, by = self.origin_by(auth)
        reason = cap(reason)
        if scope == "session":
            s = self.authorize_interrupt(target, auth)
            if s is None:
                return []
            got = self._toggle(s, origin, by, reason, resume)
            return [] if got is None else [got]
        # subtree: authorized at the top against the catalog, then each live session
        top = self.sessions.get(target)
        if top is None:
            raise Refused(tether.NotFound)
        if auth[0] == "anc":
            if not self.ref_valid(auth) or auth[1] == target:
                raise Refused(tether.Unauthorized)
            if auth[1] not in self.ancestors(target):
                raise Refused(tether.Unauthorized)
        elif self.owner(top) != auth[1]:
            raise Refused(tether.Unauthorized)
        out = []
        for sid in [target, *self.preorder(target)]:
            s = self.sessions[sid]
            if not s.live or s.settled:
                continue  # one-shots included: the delegate is the host (see report)
            got = self._toggle(s, origin, by, reason, resume)
            if got is not None:
                out.append(got)
        return out

    def release(self, target: str) -> None:
        s = self.sessions[target]
        if s.settled or s.disposing:
            raise Refused(tether.InvalidParams)
        if not s.live:
            return
        if s.turn is not None:
            raise Refused(tether.InvalidParams)  # README: release of a running turn is refused
        s.live = False
        s.hold = False  # a dormant session's hold is not kept; a waking send resumes it

    def dispose(self, target: str, auth: Auth) -> None:
        top = self.sessions.get(target)
        if top is None:
            raise Refused(tether.NotFound)
        if auth[0] == "anc":
            if not self.ref_valid(auth) or auth[1] != top.parent:
                raise Refused(tether.Unauthorized)
        elif auth[1] != self.owner(top):
            raise Refused(tether.Unauthorized)
        origin, by = self.origin_by(auth)
        order = [*reversed(self.preorder(target)), target]
        todo = [sid for sid in order if not self.sessions[sid].settled]
        for sid in todo:
            self.sessions[sid].disposing = True
        for sid in todo:
            s = self.sessions[sid]
            t = s.turn
            if t is None:
                s.settled, s.live = True, False
                s.inbox.clear()
                continue
            # §8: cancelled with grace (a Scripted hang takes it at once); §14.4: a
            # paused turn is aborted; an abort overrides a pending cancel.
            kind = "abort" if t.paused else "cancel"
            if t.stop is None or kind == "abort":
                t.stop = (kind, origin, by, "disposed")
                action = "cancelled" if kind == "cancel" else "aborted"
                s.markers.append((action, origin, by, "disposed"))
            self.end_turn(s, "aborted" if t.stop[0] == "abort" else "cancelled")

    # -- what the runtime must show -----------------------------------------------------------

    def state(self, s: MSession) -> str:
        if s.settled:
            return "settled"
        if not s.live:
            return "dormant"
        if s.turn is not None:
            return "paused" if s.turn.paused else "running"
        return "idle" if not s.inbox and not s.hold else "parked"

    def expected(self, sid: str) -> dict[str, Any]:
        s = self.sessions[sid]
        t = s.turn
        return {
            "state": self.state(s),
            "pending": 0 if s.settled else len(s.inbox),
            "stopping": None if t is None or t.stop is None else t.stop[0],
            "turn": None if t is None else (t.id or "?"),
            "inbox": [] if s.settled else [m.label for m in s.inbox],
            "turns": [(t.label, t.outcome, t.cause, t.by, t.reason) for t in s.turns],
            "markers": [(*m, marker_text(*m)) for m in s.markers],
        }


STATS: collections.Counter[str] = collections.Counter()  # what the steps did, for the log


def event(what: str) -> None:
    STATS[what] += 1


# ---- the state machine ---------------------------------------------------------------------

AUTHS = (
    "user",  # User(parent=<the durable parent / the root's own id>)
    "user-named",  # the same, with a name (markers' by)
    "user-wrong",  # User with some other session's id
    "parent",  # Ancestor(current ref of the direct parent)
    "ancestor",  # Ancestor(current ref of the root of the target's tree)
    "sibling",  # Ancestor(current ref of another session, not an ancestor)
    "self",  # Ancestor(the target's own current ref)
    "stale",  # Ancestor(a ref of an earlier activation, or one never issued)
)
# Weighted: the right caller often enough that most steps take effect.
AUTH = st.sampled_from(
    ["user", "user", "user", "parent", "parent", "ancestor", "ancestor", *AUTHS[1:3], *AUTHS[5:]]
)
# For steps aimed at a running turn: mostly a caller that may act.
RIGHT = st.sampled_from(["user", "user", "user-named", "parent", "parent", "ancestor", "stale"])
REASONS = ("", "wrap up", 'stop <now> & "go"', "x" * (REASON_CAP + 7))


class TetherModel(RuleBasedStateMachine):
    sessions = Bundle("sessions")
    oneshots = Bundle("oneshots")

    def __init__(self) -> None:
        super().__init__()
        self.rt = tether.Runtime(workers=2, grace=0.5)
        self.model = Model()
        self.refs: dict[tuple[str, int], AgentRef] = {}  # every ref seen, by (session, gen)
        self.handles: dict[str, tether.OneShot] = {}
        self._detail = ""  # for the statistics

    def teardown(self) -> None:
        self.rt.close()

    # -- helpers ----------------------------------------------------------------------------

    def _ref(self, sid: str) -> AgentRef | None:
        """The current ref of ``sid`` (checked against the one seen before for this gen)."""
        s = self.model.sessions[sid]
        if not s.live or s.settled:
            with pytest.raises(tether.NotFound):
                self.rt.agent_ref(sid)
            return None
        ref = self.rt.agent_ref(sid)
        seen = self.refs.setdefault((sid, s.gen), ref)
        assert seen == ref, f"{sid}: the ref of one activation changed: {seen} -> {ref}"
        for (other, gen), old in self.refs.items():
            if other == sid and gen != s.gen:
                assert old.epoch != ref.epoch, f"{sid}: an epoch repeated across activations"
        return ref

    def _focus(self, s: str, focus: bool, pick: int) -> str:
        """With ``focus``, a session with a turn (running or paused) instead of ``s``, so
        that interrupts and pauses often meet a running turn."""
        m = self.model
        busy = [sid for sid in m.order if m.sessions[sid].turn is not None]
        kids = [sid for sid in busy if m.sessions[sid].parent is not None]
        busy = kids if kids and pick % 4 else busy  # mostly a subagent's turn
        return busy[pick % len(busy)] if focus and busy else s

    def _auth(self, target: str, how: str, pick: int) -> tuple[Auth, tether.User | Ancestor]:
        """The authority ``how`` for acting on ``target``, as the model and the runtime
        see it; an ancestor that is not live now is presented as a never-issued ref."""
        m = self.model
        s = m.sessions[target]
        others = [sid for sid in m.order if sid != target]
        if how in ("user", "user-named"):
            name = "alice <&>" if how == "user-named" else None
            return ("user", m.owner(s), name), User(parent=m.owner(s), name=name)
        if how == "user-wrong":
            wrong = [x for x in [*others, target, "s_nobody"] if x != m.owner(s)]
            w = wrong[pick % len(wrong)]
            return ("user", w, None), User(parent=w)
        if how == "stale":
            stale = sorted(k for k in self.refs if not m.ref_valid(("anc", *k)))
            if stale and pick % 3:
                key = stale[pick % len(stale)]
                return ("anc", *key), Ancestor(self.refs[key])
            sid = (others or [target])[pick % len(others or [target])]
            return ("anc", sid, -1), Ancestor(AgentRef(sid, 987_654_321))  # never issued
        if how == "parent":
            cands = [s.parent] if s.parent is not None else []
        elif how == "ancestor":
            cands = m.ancestors(target)[-1:]  # the root of its tree
        elif how == "self":
            cands = [target]
        else:  # sibling: a session that is not an ancestor of the target
            anc = set(m.ancestors(target))
            cands = [x for x in others if x not in anc]
        for c in cands:
            self._ref(c)  # NotFound unless live
        cands = [c for c in cands if m.sessions[c].live and not m.sessions[c].settled]
        if not cands:  # no such live session now: a ref that was never issued instead
            sid = (others or [target])[pick % len(others or [target])]
            return ("anc", sid, -1), Ancestor(AgentRef(sid, 987_654_321))
        sid = cands[pick % len(cands)]
        ref = self._ref(sid)
        assert ref is not None
        return ("anc", sid, m.sessions[sid].gen), Ancestor(ref)

    def _call(self, predict: Any, act: Any, where: str = "") -> Any:
        """Run the model's prediction on a copy and the real call; they must agree.

        Returns (predicted, actual); the model is replaced by the copy only if the real
        call did what the copy said. A step that would run two hang turns at once is
        not taken (returns None)."""
        trial = copy.deepcopy(self.model)
        try:
            want: Any = predict(trial)
            refused = None
        except Refused as exc:
            want, refused = None, exc.cls
        where = where or inspect.stack()[1].function
        if trial.hang_turns() > MAX_HANG:
            event(f"{where}: skipped (a second hang turn)")
            return None
        try:
            got = act()
        except tether.TetherError as exc:
            assert refused is not None, f"refused with {type(exc).__name__} ({exc}); model: ok"
            assert type(exc) is refused, f"refused with {type(exc).__name__}, model: {refused}"
            assert exc.code == refused("x").code
            event(f"{where}: refused {refused.__name__}")
            return ("refused", refused)
        assert refused is None, f"accepted (returned {got!r}); the model refuses: {refused}"
        if where in ("interrupt", "pause", "resume", "stop_then_send", "kill_one_shot"):
            what = "no-op" if want is None or want == [] else "took effect"
            event(f"{where}: {what}{self._detail}")
        else:
            event(f"{where}: accepted")
        self.model = trial
        return ("ok", want, got)

    # -- rules ----------------------------------------------------------------------------------

    def _room(self) -> bool:
        m = self.model
        alive = sum(1 for s in m.sessions.values() if not s.settled)
        return alive < MAX_SESSIONS and len(m.order) < MAX_TOTAL

    def _roots(self) -> int:
        return sum(1 for s in self.model.sessions.values() if s.parent is None and not s.settled)

    @precondition(lambda self: self._room() and self._roots() < MAX_ROOTS)
    @rule(target=sessions)
    def open_root(self) -> Any:
        m = self.model
        sid = self.rt.open_session(SCRIPTED)
        m.open_root(sid)
        return sid

    @precondition(lambda self: self._room())
    @rule(
        target=sessions,
        parent=sessions,
        mode=st.sampled_from(["continuable", "continuable", "one-shot"]),
        prompt=st.sampled_from([None, False, True]),
    )
    def spawn(self, parent: str, mode: str, prompt: bool | None) -> Any:
        m = self.model
        if m.sessions[parent].mode == "one-shot":
            return parent  # the model spawns under continuable sessions only
        made: list[str] = []

        def act() -> None:
            got = self.rt.spawn(
                parent,
                SCRIPTED,
                mode=mode,
                prompt=None if prompt is None else "task",
                data=HANG if prompt else None,
            )
            sid = got.id if isinstance(got, tether.OneShot) else got
            assert isinstance(sid, str)
            if isinstance(got, tether.OneShot):
                self.handles[sid] = got
            made.append(sid)

        result = self._call(lambda m: m.spawn("s_new", parent, mode, prompt), act)
        if result is None or result[0] != "ok":
            return parent
        (sid,) = made
        # The trial named the new session "s_new": name it as the runtime did.
        self.model = copy.deepcopy(m)
        self.model.spawn(sid, parent, mode, prompt)
        return sid

    @rule(s=sessions, hang=st.sampled_from([False, False, True]), child=st.integers(0, 4))
    def prompt(self, s: str, hang: bool, child: int) -> None:
        """The embedding host's message to a root (refused for a subagent)."""
        if child:  # mostly a root; now and then ``s`` itself, maybe a subagent
            s = self.model.order[0] if self.model.sessions[s].parent is not None else s
        data = HANG if hang else None
        label: list[str] = []

        def act() -> str:
            mid = self.rt.prompt(s, "go", data=data)
            label.append(mid)
            return mid

        def predict(m: Model) -> None:
            m.check_send(s, None)
            m.send(s, None, "?", hang, True)

        self._relabel(self._call(predict, act), s, label)

    @rule(
        s=sessions,
        how=AUTH,
        pick=st.integers(0, 7),
        hang=st.booleans(),
        wake=st.sampled_from([True, True, False]),
    )
    def send(self, s: str, how: str, pick: int, hang: bool, wake: bool) -> None:
        auth, real = self._auth(s, how, pick)
        data = HANG if hang else None
        label: list[str] = []

        def act() -> str:
            mid = self.rt.send(s, "msg", authority=real, data=data, wake=wake)
            label.append(mid)
            return mid

        def predict(m: Model) -> None:
            m.check_send(s, auth)
            m.send(s, auth, "?", hang, wake)

        self._relabel(self._call(predict, act), s, label)

    def _idle_targets(self) -> list[str]:
        m = self.model
        if m.hang_turns():
            return []
        return [
            s.id
            for s in m.sessions.values()
            if s.mode == "continuable"
            and not s.settled
            and (s.parent is None or m.sessions[s.parent].live)
        ]

    @precondition(lambda self: bool(self._idle_targets()))
    @rule(pick=st.integers(0, 7))
    def start_hang(self, pick: int) -> None:
        """Give a session a turn that runs until stopped (its owner's waking send), so
        that interrupts and pauses have something to act on."""
        idle = self._idle_targets()
        kids = [sid for sid in idle if self.model.sessions[sid].parent is not None]
        idle = kids if kids and pick % 4 else idle  # mostly a subagent
        s = idle[pick % len(idle)]
        sess = self.model.sessions[s]
        owner = self.model.owner(sess)
        auth: Auth = ("user", owner, None)
        label: list[str] = []

        def act() -> str:
            label.append(self.rt.send(s, "work", authority=User(parent=owner), data=HANG))
            return label[0]

        def predict(m: Model) -> None:
            m.check_send(s, auth)
            m.send(s, auth, "?", True, True)

        self._relabel(self._call(predict, act), s, label)

    def _children(self) -> list[str]:
        m = self.model
        return [
            s.id
            for s in m.sessions.values()
            if s.parent is not None
            and s.mode == "continuable"
            and not s.settled
            and m.sessions[s.parent].live
        ]

    @precondition(lambda self: bool(self._children()))
    @rule(pick=st.integers(0, 7), wake=st.sampled_from([True, True, False]))
    def nudge_child(self, pick: int, wake: bool) -> None:
        """A short message to a subagent from the person holding its parent address: a
        turn that ends at once, so its parent gets a notice (which must wake an idle
        parent and never a parked or dormant one)."""
        kids = self._children()
        s = kids[pick % len(kids)]
        parent = self.model.sessions[s].parent or ""
        auth: Auth = ("user", parent, None)
        label: list[str] = []

        def act() -> str:
            label.append(self.rt.send(s, "nudge", authority=User(parent=parent), wake=wake))
            return label[0]

        def predict(m: Model) -> None:
            m.check_send(s, auth)
            m.send(s, auth, "?", False, wake)

        self._relabel(self._call(predict, act, "send"), s, label)

    def _relabel(self, result: Any, s: str, label: list[str]) -> None:
        """Name the accepted message by its id in the model (it was "?" until known)."""
        if result is None or result[0] != "ok":
            return
        (mid,) = label
        assert mid.startswith("m_")
        sess = self.model.sessions[s]
        found = [m for m in sess.inbox if m.label == "?"] + [
            t for t in sess.turns if t.label == "?"
        ]
        assert len(found) == 1
        found[0].label = mid

    KIND = st.sampled_from(["steer", "cancel", "abort", "preempt"])

    @rule(
        s=sessions,
        how=AUTH,
        pick=st.integers(0, 7),
        kind=KIND,
        reason=st.sampled_from(REASONS),
        guard=st.sampled_from([None, None, "current", "earlier", "bogus"]),
        ghost=st.booleans(),
    )
    def interrupt(
        self, s: str, how: str, pick: int, kind: str, reason: str, guard: str | None, ghost: bool
    ) -> None:
        target = "s_ghost_never_made" if ghost and pick == 0 else s
        self._interrupt(target, s, how, pick, kind, reason, guard)

    @precondition(lambda self: any(s.turn for s in self.model.sessions.values()))
    @rule(
        how=RIGHT,
        pick=st.integers(0, 7),
        kind=st.sampled_from(["cancel", "cancel", "abort", "steer", "steer", "preempt"]),
        reason=st.sampled_from(REASONS),
        guard=st.sampled_from([None, None, None, None, None, "current", "earlier", "bogus"]),
    )
    def interrupt_running(
        self, how: str, pick: int, kind: str, reason: str, guard: str | None
    ) -> None:
        s = self._focus("", True, pick)
        self._interrupt(s, s, how, pick, kind, reason, guard)

    def _interrupt(
        self,
        target: str,
        s: str,
        how: str,
        pick: int,
        kind: str,
        reason: str,
        guard: str | None,
    ) -> None:
        auth, real = self._auth(s, how, pick)
        sess = self.model.sessions[s]
        turn_id: str | None = None
        if guard == "current":
            turn_id = sess.turn.id if sess.turn is not None else None
        elif guard == "earlier":
            done = [t.id for t in sess.turns if t.outcome is not None and t.id]
            turn_id = done[-1] if done else NO_TURN
        elif guard == "bogus":  # well formed (a malformed one is refused, not a no-op)
            turn_id = NO_TURN

        def predict(m: Model) -> str | None:
            if target not in m.sessions:
                if kind == "steer" and not reason.strip():
                    raise Refused(tether.InvalidParams)
                if auth[0] == "anc" and not m.ref_valid(auth):
                    raise Refused(tether.Unauthorized)
                return None
            return m.interrupt(target, auth, kind, reason, turn_id)

        def act() -> str | None:
            return self.rt.interrupt(target, authority=real, kind=kind, reason=reason, turn=turn_id)

        self._detail = f" ({kind}{', paused' if sess.turn and sess.turn.paused else ''})"
        result = self._call(predict, act, "interrupt")
        self._detail = ""
        if result is not None and result[0] == "ok":
            _, want, got = result
            assert got == want, f"interrupt {kind} returned {got!r}, the model says {want!r}"

    def _stoppable(self) -> list[str]:
        """Subagents with a turn whose parent is live (a User may send to them)."""
        m = self.model
        return [
            s.id
            for s in m.sessions.values()
            if s.turn is not None
            and s.parent is not None
            and s.mode == "continuable"
            and m.sessions[s.parent].live
        ]

    @precondition(lambda self: bool(self._stoppable()))
    @rule(kind=st.sampled_from(["cancel", "abort"]), wake=st.booleans(), pick=st.integers(0, 3))
    def stop_then_send(self, kind: str, wake: bool, pick: int) -> None:
        """A stop and, at once, a send by the same person: whether the send lands while
        the stop converges (the wake latch) or after, the outcome is the same."""
        m = self.model
        busy = self._stoppable()
        s = busy[pick % len(busy)]
        sess = m.sessions[s]
        auth: Auth = ("user", sess.parent, None)
        label: list[str] = []

        def predict(m: Model) -> str | None:
            got = m.interrupt(s, auth, kind, "and then", None)
            m.check_send(s, auth)
            m.send(s, auth, "?", False, wake)
            return got

        def act() -> str | None:
            me = User(parent=sess.parent or "")
            got = self.rt.interrupt(s, authority=me, kind=kind, reason="and then")
            label.append(self.rt.send(s, "after the stop", authority=me, wake=wake))
            return got

        result = self._call(predict, act)
        if result is not None and result[0] == "ok":
            assert result[2] == result[1]
        self._relabel(result, s, label)

    SCOPE = st.sampled_from(["session", "session", "subtree"])

    @rule(
        s=sessions,
        how=AUTH,
        pick=st.integers(0, 7),
        scope=SCOPE,
        reason=st.sampled_from(REASONS[:3]),
        resume=st.booleans(),
    )
    def pause_or_resume(
        self, s: str, how: str, pick: int, scope: str, reason: str, resume: bool
    ) -> None:
        self._pause(s, how, pick, scope, reason, resume)

    @precondition(lambda self: any(s.turn for s in self.model.sessions.values()))
    @rule(how=RIGHT, pick=st.integers(0, 7), scope=SCOPE, reason=st.sampled_from(REASONS[:3]))
    def pause_or_resume_running(self, how: str, pick: int, scope: str, reason: str) -> None:
        s = self._focus("", True, pick)
        t = self.model.sessions[s].turn
        self._pause(s, how, pick, scope, reason, resume=t is not None and t.paused)

    def _pause(self, s: str, how: str, pick: int, scope: str, reason: str, resume: bool) -> None:
        auth, real = self._auth(s, how, pick)

        def predict(m: Model) -> list[str]:
            return m.pause(s, auth, scope, reason, resume)

        def act() -> list[str]:
            if resume:
                return self.rt.resume(s, authority=real, scope=scope)
            return self.rt.pause(s, authority=real, scope=scope, reason=reason)

        result = self._call(predict, act, "resume" if resume else "pause")
        if result is not None and result[0] == "ok":
            assert result[2] == result[1], f"{'resume' if resume else 'pause'} returned {result[2]}"

    @rule(s=sessions)
    def release(self, s: str) -> None:
        self._call(lambda m: m.release(s), lambda: self.rt.release(s))

    @rule(s=sessions, how=AUTH, pick=st.integers(0, 7), focus=st.booleans())
    def dispose(self, s: str, how: str, pick: int, focus: bool) -> None:
        s = self._focus(s, focus, pick)
        auth, real = self._auth(s, how, pick)
        self._call(lambda m: m.dispose(s, auth), lambda: self.rt.dispose(s, authority=real))

    @precondition(lambda self: bool(self.handles))
    @rule(pick=st.integers(0, 7))
    def kill_one_shot(self, pick: int) -> None:
        """The holder's hard stop (settled one-shots too: an accepted no-op)."""
        s = sorted(self.handles)[pick % len(self.handles)]
        handle = self.handles[s]
        self._call(
            lambda m: m.interrupt(s, None, "abort", "killed by its holder", None), handle.kill
        )

    # -- the check ------------------------------------------------------------------------------

    def _observe(self, sid: str) -> dict[str, Any]:
        rt = self.rt
        known = {m.label for s in self.model.sessions.values() for m in s.inbox} | {
            t.label for s in self.model.sessions.values() for t in s.turns
        }

        def label(mid: str) -> str:
            return mid if mid in known else "other"

        info = rt.status(sid)
        markers = [e for e in rt.transcript(sid) if e.kind == "marker"]
        return {
            "state": info.state,
            "pending": info.pending,
            "stopping": info.stopping,
            "turn": info.turn,
            "inbox": [label(p.id) for p in rt.inbox(sid)],
            "turns": [
                (label(t.message), t.outcome, t.cause, t.by, t.reason) for t in rt.turns(sid)
            ],
            "markers": [(e.action, e.origin, e.by, e.reason, e.text) for e in markers],
        }

    def _matches(self) -> bool:
        for sid in self.model.order:
            want = self.model.expected(sid)
            got = self._observe(sid)
            if want["turn"] == "?" and got["turn"] is not None:
                want["turn"] = got["turn"]
            if want != got:
                return False
        return True

    @invariant()
    def runtime_matches_model(self) -> None:
        busy = [s for s in self.model.sessions.values() if s.turn is not None]
        event(f"state: {'a turn running' if busy else 'no turn running'}")
        try:
            eventually(self._matches, timeout=CONVERGE, what="the runtime to match the model")
        except AssertionError:
            diffs = []
            for sid in self.model.order:
                want, got = self.model.expected(sid), self._observe(sid)
                for key in want:
                    if want[key] != got[key] and not (key == "turn" and want[key] == "?"):
                        diffs.append(f"{sid}.{key}: model {want[key]!r} != runtime {got[key]!r}")
            raise AssertionError("runtime and model differ:\n  " + "\n  ".join(diffs)) from None
        # Learn the ids of turns the model did not know yet (for guards and returns).
        for sid in self.model.order:
            s = self.model.sessions[sid]
            for t, rec in zip(s.turns, self.rt.turns(sid), strict=True):
                if t.id is None:
                    t.id = rec.id
                assert t.id == rec.id


def _settings() -> settings:
    explore = os.environ.get("TETHER_MODEL_EXPLORE") == "1"
    return settings(
        max_examples=int(os.environ.get("TETHER_MODEL_EXAMPLES", "25")),
        stateful_step_count=int(os.environ.get("TETHER_MODEL_STEPS", "30")),
        deadline=None,
        derandomize=not explore,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        print_blob=True,
    )


@pytest.mark.timeout(600)
@pytest.mark.long
def test_the_runtime_follows_the_model() -> None:
    started = time.monotonic()
    run_state_machine_as_test(TetherModel, settings=_settings())
    print(f"model test: {time.monotonic() - started:.1f}s")
    for what, n in sorted(STATS.items()):
        print(f"  {n:5d}  {what}")


# ---- regression tests: shrunk cases the model found ------------------------------------------
