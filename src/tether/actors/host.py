"""The dispatcher: a few pykka actors that host every live session (semantics §14.1).

Each session id belongs to exactly one ``SessionHost`` (chosen by hash), and every
operation that reads or changes that session — send, interrupt, status, release,
dispose, materialization, its worker's frames, its timers, its turn's end — is a message
to that one actor, handled in order. That is the whole concurrency story: a release and
a send, or a stop and a turn's natural end, can no longer interleave, because they are
two messages in one mailbox. The registry entry of a session is added and removed only
here, so "is it live?" and "what is it doing?" are answered by the same thread that
changes them.

A handler never asks another actor: it only tells (a child's turn-end notice to the
parent's host). It does not wait on a worker or on SQLite (the executor and the store
queue; a send's *caller* waits for durability) but in two places: a pause waits,
bounded, for the tree to stop, and a waking send to a dormant session reads its queue
(``Store.pending``) in line.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgspec
import pykka
import structlog

from tether.actors._reply import Call, Reply, durable_reply
from tether.actors._timers import TimerHandle, TimerQueue
from tether.actors.agent import Session, Wake, make_info
from tether.actors.approvals import Decide
from tether.actors.authority import Authority, Host
from tether.actors.budget import Governor, TurnStep
from tether.actors.directory import Directory
from tether.actors.ports import AgentStore, Durable, EventSink, Executor, KeptTurn, TurnOver
from tether.actors.services import SessionServices, TimerKind
from tether.actors.states import AgentState
from tether.actors.stops import Interrupt
from tether.telemetry.hooks import NOOP, Telemetry
from tether.wire.approval import Approval
from tether.wire.errors import AlreadyDecided, InvalidParams, NotFound, TetherError
from tether.wire.frames import (
    Delivered,
    Escalating,
    Progress,
    Say,
    ToolCall,
    ToolKilled,
    ToolReply,
)
from tether.wire.records import AgentInfo, AgentRef, Message, SessionHeader, StopOrigin
from tether.wire.vocab import Kind

__all__ = [
    "Adopt",
    "Dispatcher",
    "DisposeOp",
    "Enqueued",
    "InterruptOp",
    "PauseOp",
    "RecoverTurn",
    "RefOp",
    "ReleaseOp",
    "RunningOp",
    "SessionHost",
    "StatusOp",
    "SuspendOp",
    "SyncOp",
    "simple_inbox",
]

log = structlog.get_logger("tether.host")


# ---- messages (asked unless noted) -------------------------------------------------


@dataclass(frozen=True, slots=True)
class Adopt:
    """Told by the supervisor: a new session (or a root at recovery) goes live here.

    The supervisor made it and put it in the registry, so discovery sees it live as
    soon as ``spawn()`` returns; anything else about it reaches this host after this.
    """

    session: Session


@dataclass(frozen=True, slots=True)
class Enqueued:
    """Told by a sender: ``message`` is authorized and committed; queue it, then wake.

    The send's fast path: the caller authorizes against the directory and makes the
    message durable itself, so a send costs one commit and no round trip. Everything
    that can happen between that and this message arriving is decided here, in order:
    the inbox closed meanwhile (the message is closed with it), the session went
    dormant (a waking send brings it back, and its load already holds the message), or
    a materialization loaded it already (``Session.horizon``).
    """

    message: Message
    wake: bool
    waking: bool = False  # the sender marked the dormant target waking (Directory.waking)


@dataclass(frozen=True, slots=True)
class InterruptOp:
    target: str
    authority: Authority | Host
    kind: Kind
    reason: str
    grace: float
    deadline: float | None = None
    turn: str | None = None
    trace: str | None = None  # the caller's trace context (telemetry on)


@dataclass(frozen=True, slots=True)
class PauseOp:
    """Answered with the turn frozen (or thawed), or None. A descendant of a subtree
    pause comes with a ``Host`` authority: it was authorized at the subtree's top."""

    session: str
    authority: Authority | Host
    reason: str = ""
    resume: bool = False
    turn: str | None = None  # the guard: act only if this is still the running turn
    trace: str | None = None  # the caller's trace context (telemetry on)


@dataclass(frozen=True, slots=True)
class StatusOp:
    session: str


@dataclass(frozen=True, slots=True)
class RefOp:
    session: str


@dataclass(frozen=True, slots=True)
class ReleaseOp:
    session: str


@dataclass(frozen=True, slots=True)
class DisposeOp:
    """Told by the supervisor, which has already marked the subtree disposing."""

    session: str
    origin: StopOrigin
    by: str
    grace: float


@dataclass(frozen=True, slots=True)
class RunningOp:
    """The ids of this host's sessions with a turn claimed (for the runtime's drain)."""


@dataclass(frozen=True, slots=True)
class SyncOp:
    """Answered once everything told to this host before it has been handled."""


class SuspendOp:
    """The runtime closes with ``turns="suspend"``: each recoverable turn of this host's
    sessions is left open, to recover at the next start; the ids of their sessions."""


@dataclass(frozen=True, slots=True)
class RecoverTurn:
    """A turn a dead host left open runs on, on this one (semantics §17.1)."""

    turn: KeptTurn


@dataclass(frozen=True, slots=True)
class _Notice:
    parent: str
    message: Message  # written already, with the child's turn end


@dataclass(frozen=True, slots=True)
class _Frame:
    """A report from the session's worker: a driver's entry, a delivery, a killed tool,
    progress, or the answer to an Escalate."""

    session: str
    frame: Say | Delivered | ToolKilled | Progress | Escalating


@dataclass(frozen=True, slots=True)
class _Begin:
    """A tool call's start, to make durable before its tool runs: ``answer`` gets the
    call key once it is."""

    session: str
    frame: ToolCall
    answer: Callable[[ToolReply], None]


@dataclass(frozen=True, slots=True)
class _Took:
    """A worker took the session's turn (said only of a watched turn)."""

    session: str
    turn: str


@dataclass(frozen=True, slots=True)
class _Ended:
    session: str
    over: TurnOver


@dataclass(frozen=True, slots=True)
class _Timer:
    session: str
    turn: str
    which: TimerKind
    gen: int


def _tell(ref: pykka.ActorRef[Any], message: Any) -> None:
    """Tell from a pool or timer thread; an actor already stopped (at close) is fine.
    (A try, not ``contextlib.suppress``: this is on every turn's path several times.)"""
    try:
        ref.tell(message)
    except pykka.ActorDeadError:
        return


def _ignore_usage(turn: str, usage: dict[str, int]) -> None:
    """No governor: usage is counted by the turn's record alone."""


class _Sink:
    """The executor's view of one turn: every report becomes a message to its host,
    except usage, which goes straight to the governor (its one home, with a lock), so a
    budget's stop is issued by the report's own thread."""

    __slots__ = ("_ref", "_session", "usage")

    def __init__(self, ref: pykka.ActorRef[Any], session: str, gov: Governor | None) -> None:
        self._ref = ref
        self._session = session
        # ``TurnSink.usage``: the governor's own method with the session bound (once a
        # model response: no Python frame of the sink's between the report and the lock)
        self.usage: Callable[[str, dict[str, int]], None] = (
            _ignore_usage if gov is None else functools.partial(gov.usage, session)
        )

    def said(self, frame: Say) -> None:
        _tell(self._ref, _Frame(self._session, frame))

    def delivered(self, frame: Delivered) -> None:
        _tell(self._ref, _Frame(self._session, frame))

    def tool_killed(self, frame: ToolKilled) -> None:
        _tell(self._ref, _Frame(self._session, frame))

    def begin_call(self, frame: ToolCall, answer: Callable[[ToolReply], None]) -> None:
        _tell(self._ref, _Begin(self._session, frame, answer))

    def started(self, turn: str) -> None:
        _tell(self._ref, _Took(self._session, turn))

    def ended(self, over: TurnOver) -> None:
        _tell(self._ref, _Ended(self._session, over))

    def progress(self, frame: Progress) -> None:
        _tell(self._ref, _Frame(self._session, frame))

    def escalating(self, frame: Escalating) -> None:
        _tell(self._ref, _Frame(self._session, frame))


class Dispatcher:
    """Routes a session id to the actor that hosts it (and to that host's services)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.refs: list[pykka.ActorRef[Any]] = []
        self.services: list[SessionServices] = []
        self._reads: ThreadPoolExecutor | None = None
        self._reads_lock = threading.Lock()

    def read(self, fn: Callable[[], None]) -> None:
        """Run a store read off the hosts' threads: a read may wait for SQLite (a commit
        it must see, another process's write lock), and a host that waited would hold
        up every stop queued behind it (semantics §2: a stop never waits behind queued work)."""
        with self._reads_lock:
            if self._reads is None:
                self._reads = ThreadPoolExecutor(2, thread_name_prefix="tether-read")
            self._reads.submit(fn)

    def close(self) -> None:
        with self._reads_lock:
            if self._reads is not None:
                self._reads.shutdown(wait=False)  # queued reads still answer their askers

    def route(self, session: str) -> pykka.ActorRef[Any]:
        return self.refs[hash(session) % self.size]

    def services_for(self, session: str) -> SessionServices:
        return self.services[hash(session) % self.size]

    def ask(self, session: str, message: Any) -> Any:
        """Ask the session's host; an answer handed over with one lock, not a future."""
        reply = Reply()
        self.route(session).tell(Call(message, reply))
        return reply.get()

    def tell(self, session: str, message: Any) -> None:
        _tell(self.route(session), message)

    def sync(self) -> None:
        """A barrier: every host has handled what was told to it before this call."""
        replies = []
        for ref in self.refs:
            reply = Reply()
            ref.tell(Call(SyncOp(), reply))
            replies.append(reply)
        for reply in replies:
            reply.get()


def simple_inbox() -> Any:
    """An actor inbox on ``queue.SimpleQueue`` (in C, no Condition): a host's mailbox is
    the hottest queue in the runtime, and pykka's default ``queue.Queue`` spends more
    per message on its locks than a handler spends on the message."""
    return queue.SimpleQueue()


_OWN_BATCH = 32  # messages a host handles at most before it commits what they queued


class SessionHost(pykka.ThreadingActor):
    """Hosts the live sessions whose ids route here."""

    _create_actor_inbox = staticmethod(simple_inbox)
    # A program that forgets close() must still exit (the runtime closes itself then).
    use_daemon_thread = True

    def __init__(
        self,
        *,
        directory: Directory,
        dispatcher: Dispatcher,
        store: AgentStore,
        executor: Executor,
        events: EventSink,
        timers: TimerQueue,
        grace: float,
        cancel_deadline: float | None = None,
        telemetry: Telemetry = NOOP,
        governor: Governor | None = None,
    ) -> None:
        super().__init__()
        self._dir = directory
        self._dispatcher = dispatcher
        self._store = store
        self._executor = executor
        self._events = events
        self._timers = timers
        self._live: dict[str, Session] = {}  # the sessions hosted here
        self._handled = 0  # messages handled since this host last committed its writes
        ref = self.actor_ref
        self._services = SessionServices(
            store=self._store,
            executor=self._executor,
            events=self._events,
            sink=lambda sid: _Sink(ref, sid, governor),
            arm=self._arm,
            notify_parent=lambda parent, msg: self._dispatcher.tell(parent, _Notice(parent, msg)),
            inbox_open=self._inbox_open,
            grace=grace,
            cancel_deadline=cancel_deadline,
            telemetry=telemetry,
            budget=governor,
        )
        dispatcher.services.append(self._services)  # hosts start in routing order

    def _arm(
        self, session: str, turn: str, which: TimerKind, delay: float, gen: int
    ) -> TimerHandle:
        ref = self.actor_ref
        timer = _Timer(session, turn, which, gen)
        return self._timers.after(delay, lambda: _tell(ref, timer))

    def on_start(self) -> None:
        self._store.own_writes()

    def on_receive(self, message: Any) -> Any:
        try:
            return self._receive(message)
        finally:
            # The writes a burst of messages queued (entries, ends, claims) commit on
            # this thread once the mailbox runs dry, in one commit, instead of waking
            # the store's writer thread: a claim's dispatch follows that commit here.
            self._handled += 1
            if self._handled >= _OWN_BATCH or self.actor_inbox.empty():
                self._handled = 0
                self._store.commit_own()

    def _receive(self, message: Any) -> Any:
        if isinstance(message, Call):
            op = message.message
            if isinstance(op, StatusOp) and op.session not in self._live:
                self._status_offline(op.session, message.reply)
                return None
            try:
                value = self._answer(message.message)
            except BaseException as exc:  # the asker re-raises it
                message.reply.set(None, exc)
            else:
                if value is not None and self._recovers(op):
                    durable_reply(self._store.barrier(), message.reply, value)
                else:
                    message.reply.set(value)
            return None
        return self._answer(message)

    def _recovers(self, op: Any) -> bool:
        """``op`` is a control of a session whose turns recover from a crash: it is
        answered once its record is durable, so that the recovered turn keeps it
        (semantics §17.1). Any other turn ends at a crash, and its control is answered
        at once."""
        match op:
            case InterruptOp(target=sid) | PauseOp(session=sid):
                s = self._live.get(sid)
                return s is not None and s.recovers
        return False

    def _answer(self, message: Any) -> Any:
        match message:
            case InterruptOp():
                return self._interrupt(message)
            case PauseOp():
                return self._pause(message)
            case Decide():
                return self._decide(message)
            case StatusOp(session=sid):
                return self._status(sid)
            case RefOp(session=sid):
                s = self._live.get(sid)
                if s is None:
                    self._dir.catalog.get(sid)
                    raise NotFound(f"session {sid!r} is not live")
                return AgentRef(sid, s.epoch)
            case ReleaseOp(session=sid):
                return self._release(sid)
            case RunningOp():
                return [
                    (sid, s.turn.paused)
                    for sid, s in self._live.items()
                    if s.turn and not s.suspended
                ]
            case SuspendOp():
                return [sid for sid, s in self._live.items() if s.suspend()]
            case SyncOp():
                return None
        # Told: a failure here has no caller to reach, and must not stop the actor.
        try:
            self._told(message)
        except Exception:
            log.exception("host.error", message=type(message).__name__)
        return None

    def _told(self, message: Any) -> None:
        match message:
            case Enqueued(message=msg, wake=wake, waking=waking):
                try:
                    self._enqueued(msg, wake)
                finally:
                    if waking:
                        self._dir.woken(msg.session)
            case Adopt(session=session):
                self._adopt(session)
            case _Notice(parent=parent, message=msg):
                self._notice(parent, msg)
            # an entry, progress or a worker taking the turn change nothing shown: no publish
            case _Frame(session=sid, frame=Say() as say):
                self._quietly(sid, lambda s: s.said(say))
            case _Frame(session=sid, frame=Progress() as beat):
                self._quietly(sid, lambda s: s.progress(beat))
            case _Took(session=sid, turn=turn):
                self._quietly(sid, lambda s: s.took(turn))
            case _Begin(session=sid, frame=frame, answer=answer):
                self._begin_call(sid, frame, answer)
            case _Frame(session=sid, frame=frame):
                self._on(sid, lambda s: s.from_worker(frame))
            case _Ended(session=sid, over=over):
                self._on(sid, lambda s: s.ended(over))
            case _Timer(session=sid, turn=turn, which=which, gen=gen):
                self._on(sid, lambda s: s.timer(turn, which, gen))
            case TurnStep(session=sid, turn=turn, kind=kind, text=text):
                self._on(sid, lambda s: s.budget_step(turn, kind, text))
            case DisposeOp():
                self._dispose(message)
            case RecoverTurn(turn=kept):
                self._on(kept.session, lambda s: s.recover_kept(kept))

    def _begin_call(self, sid: str, frame: ToolCall, answer: Callable[[ToolReply], None]) -> None:
        s = self._live.get(sid)
        if s is None:  # its turn is over: nobody runs the tool
            answer(ToolReply(frame.turn, frame.call, code="not-found", message="no such turn"))
            return
        try:
            s.begin_call(frame, answer)
        finally:
            self._after(s)  # an approval it asked for shows in its status

    def _quietly(self, sid: str, action: Callable[[Session], None]) -> None:
        s = self._live.get(sid)
        if s is not None:
            action(s)

    def _on(self, sid: str, action: Any) -> None:
        s = self._live.get(sid)
        if s is None:
            return
        try:
            action(s)
        finally:
            self._after(s)

    def _after(self, s: Session) -> None:
        """Publish what changed; a session that settled leaves the registry."""
        if s.settled:
            sid = s.id
            self._live.pop(sid, None)
            self._dir.registry.pop(sid, None)
            node = self._dir.catalog.nodes.get(sid)
            if node is not None:
                node.settled = True
            self._store.settle(sid)
            self._executor.disposed([sid])  # what workers keep for it may go
        s.publish()

    # ---- materialization ----------------------------------------------------------

    def _adopt(self, s: Session) -> None:
        self._live[s.id] = s
        self._dir.registry[s.id] = s
        if s.inbox and not s.parked:  # a spawn with a prompt: it starts the first turn
            s.woken_by = s.inbox[0].id
        s.start_next()
        self._after(s)

    def _materialize(
        self,
        h: SessionHeader,
        inbox: list[Message],
        *,
        parked: bool,
        horizon: int,
        woken_by: str | None = None,
    ) -> Session:
        node = self._dir.catalog.nodes[h.id]
        s = Session(
            self._services,
            h,
            self._dir.catalog.lineage(h.id),
            node.depth,
            self._dir.next_epoch(),
            inbox,
            parked,
            horizon,
        )
        self._live[h.id] = s
        self._dir.registry[h.id] = s
        log.debug("agent.materialized", session=h.id, epoch=s.epoch)
        s.woken_by = woken_by
        s.start_next()
        self._after(s)
        return s

    # ---- inbox --------------------------------------------------------------------

    def _enqueued(self, msg: Message, wake: bool) -> None:
        sid = msg.session
        node = self._dir.catalog.nodes[sid]
        if node.settled or node.disposing:
            self._store.close_message(msg.id)
            log.info("message.closed", session=sid, message=msg.id, why="inbox closed")
            return
        s = self._live.get(sid)
        if s is None and wake:
            # A waking send brings a dormant session back (a new epoch), with what was
            # queued while it slept (this message included).
            inbox, horizon = self._store.pending(sid)
            s = self._materialize(
                node.header, inbox, parked=False, horizon=horizon, woken_by=msg.id
            )
        self._accepted(msg, s.lineage if s is not None else None)
        if s is not None:
            self._enqueue(s, msg, "yes" if wake else "no")

    def _enqueue(self, s: Session, msg: Message, wake: Wake) -> None:
        try:
            s.enqueue(msg, wake)
        finally:
            self._after(s)

    def _accepted(self, msg: Message, lineage: tuple[str, ...] | None) -> None:
        if self._events.wants("message.accepted"):
            if lineage is None:
                lineage = self._dir.catalog.lineage(msg.session)
            data = {"message": msg.id, "kind": msg.kind}
            self._events.emit("message.accepted", msg.session, lineage, data)

    def _inbox_open(self, parent: str) -> bool:
        """Whether ``parent`` still takes a notice (asked by a child's host as its turn
        ends; checked again here when the notice arrives). A parent being disposed does:
        its settle closes every pending message in one commit, and a host killed before
        that settle leaves the next host to finish the disposal, which closes them too."""
        node = self._dir.catalog.nodes.get(parent)
        return node is not None and not node.settled

    def _notice(self, parent: str, msg: Message) -> None:
        """A child's turn-end notice, durable in ``parent``'s inbox already: queue it."""
        node = self._dir.catalog.nodes.get(parent)
        if node is None or node.settled:
            # its inbox closed after the child's host looked: the notice goes its way
            log.debug("notice.dropped", session=parent, child=msg.sender, why="inbox closed")
            self._store.close_message(msg.id)
            return
        if node.disposing:
            # kept, not queued: the parent's settle closes it with its inbox (or, after a
            # host kill, the next host's finish of the disposal does)
            log.debug("notice.kept", session=parent, child=msg.sender, why="disposing")
            return
        s = self._live.get(parent)
        self._accepted(msg, s.lineage if s is not None else None)
        if s is not None:
            self._enqueue(s, msg, "if-idle")  # never wakes a parked or dormant parent

    # ---- interrupts ---------------------------------------------------------------

    def _interrupt(self, op: InterruptOp) -> str | None:
        s = self._authorized(op.kind, op.target, op.authority, op.turn, op.trace)
        if s is None:
            return None
        auth = op.authority
        i = Interrupt(
            op.kind, auth.origin, auth.by, op.reason, op.grace, op.deadline, op.turn, op.trace
        )
        try:
            return s.interrupt(i)
        finally:
            self._after(s)

    def _authorized(
        self, verb: str, target: str, auth: Authority | Host, turn: str | None, trace: str | None
    ) -> Session | None:
        """The live target an authorized control action acts on; None: an accepted no-op.
        With telemetry on, a refused or no-op action's span is ended here (one that
        reaches its session is the session's to end)."""
        listener = self._services.listener
        if not listener.on:
            return self._dir.authorize_interrupt(target, auth)
        try:
            s = self._dir.authorize_interrupt(target, auth)
        except TetherError:
            listener.unbound("refused", verb, auth.origin, auth.by, target, turn, trace)
            raise
        if s is None:
            listener.unbound("no-op", verb, auth.origin, auth.by, target, turn, trace)
        return s

    def _pause(self, op: PauseOp) -> str | None:
        self._store.commit_own()  # a pause may wait for the tree to stop: not these writes
        verb = "resume" if op.resume else "pause"
        s = self._authorized(verb, op.session, op.authority, op.turn, op.trace)
        if s is None:
            return None
        auth = op.authority
        if op.turn is not None and (s.turn is None or s.turn.id != op.turn):
            s.control_noop(verb, auth.origin, auth.by, op.turn, op.trace)
            return None  # a stale click: that turn is over
        try:
            if op.resume:
                return s.resume(auth.origin, auth.by, op.trace)
            return s.pause(auth.origin, auth.by, op.reason, op.trace)
        finally:
            self._after(s)

    def _decide(self, d: Decide) -> tuple[Approval, Durable]:
        """A decision on an approval of ``d.session``'s turn, with the authority of an
        interrupt of the session (semantics §17.2): the approval as decided, and the
        ticket its caller waits on."""
        s = self._dir.authorize_interrupt(d.session, d.authority, one_shot=True)
        if s is None:  # not live: nothing of it waits
            raise AlreadyDecided(f"approval {d.approval} is no longer pending")
        try:
            return s.decide(d)
        finally:
            self._after(s)

    # ---- status -------------------------------------------------------------------

    def _status(self, sid: str) -> AgentInfo:
        """A live session's status (``on_receive`` sends the others to _status_offline)."""
        self._dir.catalog.get(sid)
        s = self._live.get(sid)
        if s is None:  # not asked this way (see on_receive); answered all the same
            node = self._dir.catalog.nodes[sid]
            state = AgentState.SETTLED if node.settled else AgentState.DORMANT
            pending = 0 if node.settled else self._store.pending_count(sid)
            return make_info(node.header, node.depth, state, pending)
        info = s.info
        if s.turn is not None and self._executor.dispatched(s.turn.id):
            return _with_dispatched(info)
        return info

    def _status_offline(self, sid: str, reply: Reply) -> None:
        """A dormant session's status: decided here, in order (dormant or settled), but
        its pending count is read off this thread, so that a slow store never holds up
        this host's other sessions (an abort queued behind it, say)."""
        node = self._dir.catalog.nodes.get(sid)
        if node is None:
            reply.set(None, NotFound(f"no session {sid!r}"))
            return
        header, depth = node.header, node.depth
        if node.settled:
            reply.set(make_info(header, depth, AgentState.SETTLED, 0))
            return

        def read() -> None:
            try:
                pending = self._store.pending_count(sid)
            except BaseException as exc:  # StoreUnavailable: the asker re-raises it
                reply.set(None, exc)
            else:
                reply.set(make_info(header, depth, AgentState.DORMANT, pending))

        self._dispatcher.read(read)

    # ---- lifecycle ----------------------------------------------------------------

    def _release(self, sid: str) -> None:
        node = self._dir.catalog.get(sid)
        if node.settled or node.disposing:
            raise InvalidParams(f"session {sid} is settled")
        s = self._live.get(sid)
        if s is None:
            return
        s.check_release()
        del self._live[sid]
        del self._dir.registry[sid]
        data = {"state": "dormant", "pending": 0, "stopping": None, "turn": None}
        self._events.emit("state", sid, s.lineage, data)

    def _dispose(self, d: DisposeOp) -> None:
        sid = d.session
        s = self._live.get(sid)
        if s is not None:
            self._on(sid, lambda s: s.dispose(d.origin, d.by, d.grace))
            return
        node = self._dir.catalog.nodes.get(sid)
        if node is None or node.settled:
            return
        node.settled = True
        self._store.settle(sid)
        self._executor.disposed([sid])  # dormant: a worker may still keep its servers
        if self._events.wants("state"):
            lineage = self._dir.catalog.lineage(sid)
            data = {"state": "settled", "pending": 0, "stopping": None, "turn": None}
            self._events.emit("state", sid, lineage, data)

    def on_stop(self) -> None:
        for s in self._live.values():
            t = s.turn
            if t is not None and t.stop is not None and t.stop.timer is not None:
                t.stop.timer.cancel()
        self._live.clear()
        # Calls that will never be handled must not leave their askers blocked.
        while not self.actor_inbox.empty():
            envelope = self.actor_inbox.get()
            if isinstance(envelope.message, Call):
                envelope.message.reply.set(None, pykka.ActorDeadError(f"{self} stopped"))


def _with_dispatched(info: AgentInfo) -> AgentInfo:
    return msgspec.structs.replace(info, dispatched=True)
