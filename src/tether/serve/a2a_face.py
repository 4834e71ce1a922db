"""The A2A face: Tether's root sessions as A2A agents, with the official ``a2a-sdk`` server
(JSON-RPC at ``POST /a2a``, Agent Card at ``/.well-known/agent-card.json``).

A task is a turn, a context a session. The mapping of messages, states and cancels:
docs/design.md, section 13, and docs/semantics.md section 15.7.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any, Final, ParamSpec, TypeVar

import anyio
import anyio.to_thread
import structlog
from a2a.server.context import ServerCallContext
from a2a.server.events.event_queue import Event as A2AEvent
from a2a.server.request_handlers.request_handler import RequestHandler
from a2a.server.routes import DefaultServerCallContextBuilder, create_jsonrpc_routes
from a2a.types.a2a_pb2 import (
    AgentCapabilities,
    AgentCard,
    AgentInterface,
    AgentSkill,
    Artifact,
    CancelTaskRequest,
    DeleteTaskPushNotificationConfigRequest,
    GetExtendedAgentCardRequest,
    GetTaskPushNotificationConfigRequest,
    GetTaskRequest,
    HTTPAuthSecurityScheme,
    ListTaskPushNotificationConfigsRequest,
    ListTaskPushNotificationConfigsResponse,
    ListTasksRequest,
    ListTasksResponse,
    Message,
    Part,
    Role,
    SecurityRequirement,
    SecurityScheme,
    SendMessageRequest,
    StringList,
    SubscribeToTaskRequest,
    Task,
    TaskArtifactUpdateEvent,
    TaskPushNotificationConfig,
    TaskState,
    TaskStatus,
    TaskStatusUpdateEvent,
)
from a2a.utils.constants import PROTOCOL_VERSION_1_0
from a2a.utils.errors import (
    JSON_RPC_ERROR_CODE_MAP,
    A2AError,
    ContentTypeNotSupportedError,
    InternalError,
    InvalidParamsError,
    InvalidRequestError,
    PushNotificationNotSupportedError,
    TaskNotCancelableError,
    TaskNotFoundError,
    UnsupportedOperationError,
)
from a2a.utils.proto_utils import validate_proto_required_fields
from a2a.utils.task import (
    ListTasksCursor,
    decode_list_tasks_cursor,
    encode_list_tasks_cursor,
    validate_history_length,
    validate_page_size,
)
from google.protobuf.json_format import MessageToDict
from google.protobuf.struct_pb2 import Struct
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from tether import AgentInfo, Entry, Event, Runtime, TurnRecord, User
from tether.serve.a2a_approvals import approvals_part, decide, decision_of, waiting_note
from tether.serve.face_kit import FaceOptions, last_seq, turn_entries, turn_record
from tether.wire.approval import Approval
from tether.wire.errors import TetherError

__all__ = ["A2aHttp", "TetherA2A", "agent_card"]

log = structlog.get_logger("tether.a2a")

_P = ParamSpec("_P")
_R = TypeVar("_R")
_E = TypeVar("_E")

# A wait sleeps until the runtime says the session changed; it looks again after this
# many seconds all the same, as a backstop, never as the way it learns of a change.
_RECHECK: Final = 5.0
_DEFAULT_PAGE: Final = 50  # ListTasks' page size when the caller names none (the spec's)
_CANCEL_REASON: Final = "cancelled over A2A"
_STOPPED: Final = {
    "completed": TaskState.TASK_STATE_COMPLETED,
    "cancelled": TaskState.TASK_STATE_CANCELED,
    "aborted": TaskState.TASK_STATE_CANCELED,
    "failed": TaskState.TASK_STATE_FAILED,
    "crashed": TaskState.TASK_STATE_FAILED,
}
_TERMINAL: Final = frozenset(
    {
        TaskState.TASK_STATE_COMPLETED,
        TaskState.TASK_STATE_CANCELED,
        TaskState.TASK_STATE_FAILED,
    }
)


@dataclass(frozen=True)
class _Known:
    """A task this server handed out: its session, and the transcript seq before its turn
    (its entries come after it, so reading them never starts from the beginning)."""

    session: str
    after: int


@dataclass
class _Snapshot:
    record: TurnRecord
    info: AgentInfo
    latest: bool  # the session's last turn
    approvals: list[Approval] = field(default_factory=list)  # the turn's pending ones


class _Waiter:
    """One call waiting on a session: woken by the session's changes, and by its caller
    hanging up (``gone``)."""

    def __init__(self) -> None:
        self.wake = asyncio.Event()
        self.gone = False


class _Changes:
    """Wakes the calls waiting on a session when a turn of it starts or ends, its state
    moves or its transcript grows. Subscribed to the runtime only while a call waits,
    so that an idle face makes the runtime build no events."""

    _NAMES: Final = frozenset({"turn.started", "turn.ended", "state", "entry", "marker"})

    def __init__(self, rt: Runtime) -> None:
        self._rt = rt
        self._waiting: dict[str, set[_Waiter]] = {}
        self._sessions: frozenset[str] = frozenset()  # read on the runtime's threads
        self._unsubscribe: Callable[[], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def waiters(self) -> int:
        return sum(len(w) for w in self._waiting.values())

    @contextmanager
    def watch(self, session: str, waiter: _Waiter) -> Iterator[_Waiter]:
        if self._unsubscribe is None:
            self._loop = asyncio.get_running_loop()
            self._unsubscribe = self._rt.subscribe(self._deliver)
        self._waiting.setdefault(session, set()).add(waiter)
        self._sessions = frozenset(self._waiting)
        try:
            yield waiter
        finally:
            left = self._waiting.get(session, set())
            left.discard(waiter)
            if not left:
                self._waiting.pop(session, None)
            self._sessions = frozenset(self._waiting)
            if not self._waiting and self._unsubscribe is not None:
                self._unsubscribe()
                self._unsubscribe = None

    def _deliver(self, event: Event) -> None:  # on a runtime thread: hand over, never block
        loop = self._loop
        if event.name in self._NAMES and event.session in self._sessions and loop is not None:
            loop.call_soon_threadsafe(self._wake, event.session)

    def _wake(self, session: str) -> None:
        for waiter in self._waiting.get(session, ()):
            waiter.wake.set()


async def _until_gone(request: Request, waiter: _Waiter) -> None:
    """Return once the caller has hung up (the body is read: the next message the
    server has for us is the disconnect), and wake the call waiting for it."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    waiter.gone = True
    waiter.wake.set()


async def _next_change(waiter: _Waiter, deadline: float | None = None) -> None:
    """Sleep until the waited-on session changes, the caller leaves or ``deadline``."""
    if deadline is None:
        await waiter.wake.wait()
    else:
        with anyio.move_on_after(max(deadline - time.monotonic(), 0.0)):
            await waiter.wake.wait()


def _struct(doc: dict[str, Any]) -> Struct:
    out = Struct()
    out.update(doc)
    return out


_TEXT_TYPES: Final = ("", "text/plain")
_DATA_TYPES: Final = ("", "application/json")


def _content(message: Message) -> tuple[str, dict[str, Any] | None]:
    """Text parts joined are the content; data parts (objects) merged are the data. A
    file (raw or url) or a media type other than the card's input modes is refused."""
    texts: list[str] = []
    data: dict[str, Any] | None = None
    for part in message.parts:
        kind = part.WhichOneof("content")
        media = part.media_type.split(";")[0].strip().lower()
        if kind is None:
            raise InvalidParamsError(message="a part holds text, raw, url or data: this one none")
        if kind in ("raw", "url") or media not in (_TEXT_TYPES if kind == "text" else _DATA_TYPES):
            what = f"{kind} part" + (f" of type {part.media_type}" if part.media_type else "")
            raise ContentTypeNotSupportedError(
                message=f"a {what} is not supported: send text/plain text or application/json data"
            )
        if kind == "text":
            texts.append(part.text)
        else:
            value = MessageToDict(part.data)
            if not isinstance(value, dict):
                raise InvalidParamsError(message="a data part must hold a JSON object")
            data = {**(data or {}), **value}
    return "\n".join(texts), data


def _check_send(params: SendMessageRequest) -> None:
    """Every parameter of a SendMessage, before anything is acted on."""
    validate_proto_required_fields(params)  # a message, its id, its role, its parts
    if params.message.role != Role.ROLE_USER:
        raise InvalidParamsError(message="a message sent to the agent has the role ROLE_USER")
    config = params.configuration
    validate_history_length(config)
    if config.HasField("task_push_notification_config"):
        raise PushNotificationNotSupportedError
    modes = [m.split(";")[0].strip().lower() for m in config.accepted_output_modes]
    if modes and not any(m in ("text/plain", "text/*", "*/*") for m in modes):
        raise ContentTypeNotSupportedError(
            message="this agent answers in text/plain, which accepted_output_modes leaves out"
        )


def _steer(message: Message) -> bool:
    meta = MessageToDict(message.metadata) if message.HasField("metadata") else {}
    tether = meta.get("tether")
    return isinstance(tether, dict) and tether.get("steer") is True


def _entry_message(entry: Entry, task: str) -> Message:
    role = Role.ROLE_USER if entry.kind == "user" else Role.ROLE_AGENT
    message = Message(
        message_id=f"{entry.session}:{entry.seq}",
        context_id=entry.session,
        task_id=task,
        role=role,
        parts=[Part(text=entry.text)],
    )
    if entry.kind not in ("user", "assistant"):
        tether: dict[str, Any] = {"kind": entry.kind, "seq": entry.seq}
        if entry.action is not None:
            tether["action"] = entry.action
        message.metadata.CopyFrom(_struct({"tether": tether}))
    return message


def _state(snap: _Snapshot) -> TaskState:
    record, info = snap.record, snap.info
    if record.outcome is None:  # waiting for a decision: a person's input is required
        return (
            TaskState.TASK_STATE_INPUT_REQUIRED if snap.approvals else TaskState.TASK_STATE_WORKING
        )
    # Parked with messages waiting (semantics §3): the stop holds queued work until a person
    # sends again. A stopped session with an empty inbox also reads parked; its task is
    # simply over.
    if snap.latest and info.state == "parked" and info.pending > 0:
        return TaskState.TASK_STATE_INPUT_REQUIRED
    return _STOPPED.get(record.outcome, TaskState.TASK_STATE_FAILED)


def _status_note(snap: _Snapshot) -> str | None:
    record, info = snap.record, snap.info
    if record.outcome is None and snap.approvals:
        return waiting_note(snap.approvals)
    if record.outcome is None:
        return "paused" if info.state == "paused" else None
    if _state(snap) == TaskState.TASK_STATE_INPUT_REQUIRED:
        return (
            f"the turn ended {record.outcome}; {info.pending} message(s) wait: send a message "
            "to this context to go on"
        )
    return record.error or record.reason


def agent_card(base_url: str, options: FaceOptions) -> AgentCard:
    """The card: one skill, the configured root driver; the bearer scheme when the
    server asks for a token."""
    card = AgentCard(
        name="Tether",
        description="Background agents you can steer, cancel, abort, preempt, pause and "
        "resume without destroying them. A task is one turn; a context is one session.",
        version="3",
        supported_interfaces=[
            AgentInterface(
                url=base_url.rstrip("/") + "/a2a",
                protocol_binding="JSONRPC",
                protocol_version=PROTOCOL_VERSION_1_0,
            )
        ],
        capabilities=AgentCapabilities(streaming=True, push_notifications=False),
        default_input_modes=["text/plain", "application/json"],
        default_output_modes=["text/plain"],
        skills=[
            AgentSkill(
                id=options.driver,
                name=options.driver,
                description=f"A root session running the driver {options.driver}. A message "
                'with metadata {"tether": {"steer": true}} to a working task steers it.',
                tags=["tether"],
            )
        ],
    )
    if options.bearer:
        card.security_schemes["bearer"].CopyFrom(
            SecurityScheme(http_auth_security_scheme=HTTPAuthSecurityScheme(scheme="bearer"))
        )
        card.security_requirements.append(SecurityRequirement(schemes={"bearer": StringList()}))
    return card


def _internal(exc: BaseException) -> InternalError:
    """An unexpected failure as its caller sees it: the id that finds it in the host's
    log, never its text (which may hold paths or data)."""
    error_id = "err_" + uuid.uuid4().hex[:16]
    code = exc.code if isinstance(exc, TetherError) else None
    log.error("a2a.internal_error", error_id=error_id, code=code, exc_info=exc)
    return InternalError(message=f"internal error (id {error_id})")


def _answered(
    fn: Callable[_P, Coroutine[Any, Any, _R]],
) -> Callable[_P, Coroutine[Any, Any, _R]]:
    """A handler whose unexpected failure reaches its caller as ``_internal`` makes it:
    the SDK would answer it with the exception's text."""

    @functools.wraps(fn)
    async def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return await fn(*args, **kwargs)
        except A2AError:
            raise
        except Exception as exc:
            raise _internal(exc) from None

    return call


def _streamed(fn: Callable[_P, AsyncGenerator[_E]]) -> Callable[_P, AsyncGenerator[_E]]:
    """``_answered`` for a streaming handler, whose failure may come at any event."""

    @functools.wraps(fn)
    async def call(*args: _P.args, **kwargs: _P.kwargs) -> AsyncGenerator[_E]:
        try:
            async with contextlib.aclosing(fn(*args, **kwargs)) as stream:
                async for event in stream:
                    yield event
        except A2AError:
            raise
        except Exception as exc:
            raise _internal(exc) from None

    return call


class TetherA2A(RequestHandler):
    """The A2A request handler over one runtime."""

    def __init__(self, rt: Runtime, options: FaceOptions) -> None:
        self.rt = rt
        self.options = options
        self._tasks: dict[str, _Known] = {}
        # The root sessions this face opened since the server started: its callers'
        # contexts, and the only ones it serves (one opened over /rpc or MCP is not).
        self._contexts: set[str] = set()
        self._contexts_lock = threading.Lock()  # added to on the loop, read on threads
        self._lane = anyio.CapacityLimiter(32)
        self._stop_lane = anyio.CapacityLimiter(4)  # a cancel never waits behind other calls
        self.changes = _Changes(rt)

    async def _run(self, fn: Callable[..., Any], *args: Any, stop: bool = False) -> Any:
        lane = self._stop_lane if stop else self._lane
        try:
            return await anyio.to_thread.run_sync(lambda: fn(*args), limiter=lane)
        except TetherError as exc:
            raise _a2a_error(exc) from None

    # ---- reading a task ------------------------------------------------------------------

    def _known(self, task: str) -> _Known:
        """Where ``task`` lives. A turn this face did not see start (a message that was
        queued behind another turn) is looked for in the contexts it opened."""
        known = self._tasks.get(task)
        if known is None:
            with self._contexts_lock:
                contexts = list(self._contexts)
            for session in contexts:
                if any(t.id == task for t in self.rt.turns(session)):
                    known = self._tasks[task] = _Known(session, 0)
                    break
            else:
                raise TaskNotFoundError(message=f"no task {task!r} on this server")
        return known

    def _snapshot(self, task: str, known: _Known) -> _Snapshot:
        turns = self.rt.turns(known.session)
        record = next((t for t in reversed(turns) if t.id == task), None)
        if record is None:
            raise TaskNotFoundError(message=f"no task {task!r} on this server")
        info = self.rt.status(known.session)
        pending: list[Approval] = []
        if record.outcome is None and info.approvals:
            pending = [a for a in self.rt.approvals(known.session) if a.turn == task]
        return _Snapshot(record, info, latest=turns[-1].id == task, approvals=pending)

    def _entries(self, task: str, known: _Known) -> list[Entry]:
        out: list[Entry] = []
        cursor = known.after
        while True:
            entries, after = turn_entries(self.rt, known.session, task, cursor)
            out.extend(entries)
            if after == cursor:
                return out
            cursor = after

    def _task(self, task: str, history_length: int | None = None) -> tuple[Task, _Snapshot]:
        known = self._known(task)
        snap = self._snapshot(task, known)
        entries = self._entries(task, known)
        state = _state(snap)
        status = TaskStatus(state=state)
        status.timestamp.FromNanoseconds(_stamp(snap.record))
        note = _status_note(snap)
        if note:
            status.message.CopyFrom(
                Message(
                    message_id=f"{task}:status",
                    context_id=known.session,
                    task_id=task,
                    role=Role.ROLE_AGENT,
                    parts=[Part(text=note)],
                )
            )
            if snap.approvals:
                status.message.parts.append(approvals_part(snap.approvals))
        history = [_entry_message(e, task) for e in entries]
        if history_length is not None:  # 0: none at all
            history = history[-history_length:] if history_length > 0 else []
        out = Task(id=task, context_id=known.session, status=status, history=history)
        final = next((e.text for e in reversed(entries) if e.kind == "assistant"), None)
        if snap.record.outcome is not None and final is not None:
            out.artifacts.append(_result(task, final))
        return out, snap

    # ---- sending -------------------------------------------------------------------------

    async def _accept(
        self, params: SendMessageRequest, *, immediate: bool, waiter: _Waiter | None = None
    ) -> str | Message:
        """Act on a message: the task it concerns (the steered one, or the one its turn
        became), or, asked to return at once for a message queued behind a running
        turn, an acknowledgement naming the queued message."""
        _check_send(params)
        message = params.message
        content, data = _content(message)
        if not content.strip() and data is None:
            raise InvalidParamsError(message="a message needs text or data")
        session = message.context_id
        if message.task_id:
            session = await self._open_task(message.task_id, session)
            decision = decision_of(data, content)
            if decision is not None:  # a decision on a call the task waits for
                task = message.task_id
                await self._run(lambda: decide(self.rt, session, task, decision), stop=True)
                log.info("a2a.decided", session=session, task=task, approval=decision.approval)
                return task
        if _steer(message):
            return await self._steer_task(message, session, content)
        session, after = await self._context(session)
        sent: str = await self._run(lambda: self.rt.prompt(session, content, data=data))
        return await self._task_of(session, sent, after, immediate=immediate, waiter=waiter)

    async def _open_task(self, task: str, session: str) -> str:
        """The session of a task that takes messages: it must exist, its context is the
        message's (given or not), and a task that has ended takes no more (a new one goes
        to its context)."""
        known: _Known = await self._run(self._known, task)
        if session and session != known.session:
            raise InvalidParamsError(
                message=f"task {task} is in context {known.session}, not {session}"
            )
        snap = await self._run(self._snapshot, task, known)
        if _state(snap) in _TERMINAL:
            raise UnsupportedOperationError(
                message=f"task {task} has ended: send to its context "
                f"{known.session} without a taskId to start the next task"
            )
        return known.session

    async def _steer_task(self, message: Message, session: str, content: str) -> str:
        if not message.task_id:
            raise InvalidParamsError(message="a steer names its task")
        if not content.strip():
            raise InvalidParamsError(message="a steer needs text")
        task = message.task_id
        turn = await self._run(
            lambda: self.rt.interrupt(
                session, authority=User(parent=session), kind="steer", reason=content, turn=task
            ),
            stop=True,
        )
        log.info("a2a.steer", session=session, task=task, bound=turn)
        return task

    async def _context(self, session: str) -> tuple[str, int]:
        """The message's session and its transcript's last seq: the context given (one
        this face opened: it makes up none), or a new root session."""
        if not session:
            opts = self.options
            opened = await self._run(lambda: self.rt.open_session(opts.driver, config=opts.config))
            with self._contexts_lock:
                self._contexts.add(opened)
            log.info("a2a.context_opened", session=opened)
            return opened, 0
        # Another face's session (a root opened over /rpc or MCP) is refused as an unknown
        # one is, in the same words: whether it exists, and whose it is, stays unsaid.
        unknown = InvalidParamsError(
            message=f"no context {session!r} here: leave contextId out to open one"
        )
        with self._contexts_lock:
            mine = session in self._contexts
        if not mine:
            raise unknown
        try:
            return session, await self._run(last_seq, self.rt, session)
        except TaskNotFoundError:
            raise unknown from None

    async def _task_of(
        self, session: str, sent: str, after: int, *, immediate: bool, waiter: _Waiter | None
    ) -> str | Message:
        """The task the sent message became, once a turn claims it; with ``immediate``,
        or once the caller hung up, the acknowledgement of a message queued behind a
        running turn."""
        rt = self.rt
        # Asked after the prompt, the session's host answers after it has queued it: a
        # turn named here that claimed another message means ours waits behind it.
        with self.changes.watch(session, waiter or _Waiter()) as w:
            running = (await self._run(rt.status, session)).turn
            while True:  # the task exists once a turn has claimed the message
                w.wake.clear()  # before the look: a change after it wakes the wait below
                turns: list[TurnRecord] = await self._run(rt.turns, session)
                mine = next((t for t in reversed(turns) if t.message == sent), None)
                if mine is not None:
                    self._tasks[mine.id] = _Known(session, after)
                    return mine.id
                if immediate and any(t.id == running and t.message != sent for t in turns):
                    return _queued(session, sent, str(running))
                if w.gone:  # the message stays queued; nobody is left to tell
                    self._gone(session=session, message=sent)
                    return _queued(session, sent, str(running))
                await _next_change(w, time.monotonic() + _RECHECK)

    def _gone(self, **where: str) -> None:
        # The call that noticed is still counted among the waiters.
        log.info("a2a.caller_gone", waiting=self.changes.waiters - 1, **where)

    async def _until_ended(
        self, task: str, timeout: float | None = None, waiter: _Waiter | None = None
    ) -> bool:
        """Wait for the task's turn to end or to wait for a decision (True), the timeout,
        or the caller to hang up (False either way: the turn goes on, nobody is left to
        tell)."""
        known = await self._run(self._known, task)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.changes.watch(known.session, waiter or _Waiter()) as w:
            while True:
                w.wake.clear()
                record = await self._run(turn_record, self.rt, known.session, task)
                if record is None or record.outcome is not None:
                    return True
                if await self._run(self._asks, known.session, task):
                    return True  # input-required: the caller decides
                if w.gone:
                    self._gone(session=known.session, task=task)
                    return False
                now = time.monotonic()
                if deadline is not None and now > deadline:
                    return False
                await _next_change(w, min(deadline or math.inf, now + _RECHECK))

    def _asks(self, session: str, task: str) -> bool:
        """Whether ``task``'s turn waits for a decision."""
        info = self.rt.status(session)
        return info.turn == task and bool(info.approvals)

    async def _snapshot_task(self, task: str, history_length: int | None = None) -> Task:
        out, _ = await self._run(self._task, task, history_length)
        result: Task = out
        return result

    @_answered
    async def on_message_send(
        self, params: SendMessageRequest, context: ServerCallContext
    ) -> Task | Message:
        immediate = params.configuration.return_immediately
        request = context.state.get("request")
        waiter = _Waiter()
        failed: Exception | None = None
        async with anyio.create_task_group() as tg:
            if not immediate and isinstance(request, Request):
                tg.start_soon(_until_gone, request, waiter)
            try:
                task = await self._accept(params, immediate=immediate, waiter=waiter)
                if not isinstance(task, Message) and not immediate and not _steer(params.message):
                    await self._until_ended(task, waiter=waiter)
            except Exception as exc:  # raised below as itself, not in an ExceptionGroup
                failed = exc
            finally:
                tg.cancel_scope.cancel()  # the hang-up watch: the wait is over either way
        if failed is not None:
            raise failed
        if isinstance(task, Message):
            return task
        config = params.configuration
        length = config.history_length if config.HasField("history_length") else None
        return await self._snapshot_task(task, length)

    @_streamed
    async def on_message_send_stream(
        self, params: SendMessageRequest, context: ServerCallContext
    ) -> AsyncGenerator[A2AEvent]:
        task = await self._accept(params, immediate=False)
        assert isinstance(task, str)
        async for event in self._stream(task):
            yield event

    @_streamed
    async def on_subscribe_to_task(
        self, params: SubscribeToTaskRequest, context: ServerCallContext
    ) -> AsyncGenerator[A2AEvent]:
        first, _ = await self._run(self._task, params.id)
        if first.status.state in _TERMINAL:
            raise UnsupportedOperationError(
                message=f"task {params.id} is in a terminal state: nothing more to stream"
            )
        async for event in self._stream(params.id, first):
            yield event

    async def _stream(self, task: str, first: Task | None = None) -> AsyncIterator[A2AEvent]:
        """The task, then one status update per new entry of its turn, then its result
        and its final status. Ends when the turn has ended."""
        if first is None:
            first, _ = await self._run(self._task, task)
        yield first
        known = await self._run(self._known, task)
        seen = {m.message_id for m in first.history}
        cursor = known.after
        final: str | None = None
        with self.changes.watch(known.session, _Waiter()) as w:
            while True:
                w.wake.clear()  # before the look: an entry after it wakes the wait below
                # Look at the record before the entries: an end seen here has all its
                # entries written, so the last page read below holds them.
                snap: _Snapshot = await self._run(self._snapshot, task, known)
                while True:
                    entries, after = await self._run(
                        turn_entries, self.rt, known.session, task, cursor
                    )
                    for entry in entries:
                        if entry.kind == "assistant":
                            final = entry.text
                        message = _entry_message(entry, task)
                        if message.message_id in seen:
                            continue
                        seen.add(message.message_id)
                        yield TaskStatusUpdateEvent(
                            task_id=task,
                            context_id=known.session,
                            status=TaskStatus(state=TaskState.TASK_STATE_WORKING, message=message),
                        )
                    if after == cursor:
                        break
                    cursor = after
                if snap.record.outcome is not None:
                    break
                await _next_change(w, time.monotonic() + _RECHECK)
        if final is not None:
            yield TaskArtifactUpdateEvent(
                task_id=task,
                context_id=known.session,
                artifact=_result(task, final),
                last_chunk=True,
            )
        last, _ = await self._run(self._task, task, 1)
        yield TaskStatusUpdateEvent(task_id=task, context_id=known.session, status=last.status)

    # ---- tasks -------------------------------------------------------------------------

    @_answered
    async def on_get_task(self, params: GetTaskRequest, context: ServerCallContext) -> Task | None:
        length = params.history_length if params.HasField("history_length") else None
        return await self._snapshot_task(params.id, length)

    @_answered
    async def on_cancel_task(
        self, params: CancelTaskRequest, context: ServerCallContext
    ) -> Task | None:
        """A cancel bound to the task's turn; the configured deadline escalates it to an
        abort when no boundary comes. Returns once the turn has ended."""
        task = params.id
        known = await self._run(self._known, task)
        session = known.session
        bound = await self._run(
            lambda: self.rt.interrupt(
                session,
                authority=User(parent=session),
                kind="cancel",
                reason=_CANCEL_REASON,
                deadline=self.options.cancel_deadline,
                turn=task,
            ),
            stop=True,
        )
        if bound is None:  # the turn had already ended (or ended just now)
            raise TaskNotCancelableError(message=f"task {task} has already ended")
        log.info("a2a.cancel", session=session, task=task)
        limit = self.rt.grace + (self.options.cancel_deadline or 0.0) + 10.0
        await self._until_ended(task, limit)
        return await self._snapshot_task(task)

    @_answered
    async def on_list_tasks(
        self, params: ListTasksRequest, context: ServerCallContext
    ) -> ListTasksResponse:
        """The tasks of the contexts this face opened (every caller holds the same
        token, so all of them), newest status first, a page at a time; a page token
        is the position of the last task of the page before."""
        validate_history_length(params)
        size = _DEFAULT_PAGE
        if params.HasField("page_size"):
            validate_page_size(params.page_size)
            size = params.page_size
        if params.status not in TaskState.values():
            raise InvalidParamsError(message=f"no task state {params.status}")
        after: tuple[bool, int, str] | None = None
        if params.page_token:
            cursor = decode_list_tasks_cursor(params.page_token)
            if cursor is None:
                raise InvalidParamsError(message="not a page token this server gave")
            after = cursor.sort_key()
        result: ListTasksResponse = await self._run(self._list, params, size, after)
        return result

    def _list(
        self, params: ListTasksRequest, size: int, after: tuple[bool, int, str] | None
    ) -> ListTasksResponse:
        rows = self._listed(params)
        rows.sort(reverse=True)
        total = len(rows)
        if after is not None:  # every task carries a timestamp: only the last two count
            rows = [r for r in rows if (True, r[0], r[1]) < after]
        page, rest = rows[:size], rows[size:]
        tasks: list[Task] = []
        length = params.history_length if params.HasField("history_length") else None
        for _, task, session in page:
            self._tasks.setdefault(task, _Known(session, 0))
            out, _ = self._task(task, length)
            if not params.include_artifacts:
                out.ClearField("artifacts")
            tasks.append(out)
        token = ""
        if rest:
            stamp, task, _ = page[-1]
            token = encode_list_tasks_cursor(ListTasksCursor(timestamp_ns=stamp, task_id=task))
        return ListTasksResponse(
            tasks=tasks, next_page_token=token, page_size=size, total_size=total
        )

    def _listed(self, params: ListTasksRequest) -> list[tuple[int, str, str]]:
        """Every task of the contexts this face opened that the filters keep, as
        (status timestamp, task, context)."""
        with self._contexts_lock:
            contexts = sorted(self._contexts)
        if params.context_id:
            contexts = [c for c in contexts if c == params.context_id]
        since = (
            params.status_timestamp_after.ToNanoseconds()
            if params.HasField("status_timestamp_after")
            else None
        )
        rows: list[tuple[int, str, str]] = []
        for session in contexts:
            turns = self.rt.turns(session)
            info = self.rt.status(session) if params.status else None
            for record in turns:
                stamp = _stamp(record)
                if since is not None and stamp < since:
                    continue
                if info is not None:
                    snap = _Snapshot(record, info, latest=record.id == turns[-1].id)
                    if _state(snap) != params.status:
                        continue
                rows.append((stamp, record.id, session))
        return rows

    async def on_create_task_push_notification_config(
        self, params: TaskPushNotificationConfig, context: ServerCallContext
    ) -> TaskPushNotificationConfig:
        raise PushNotificationNotSupportedError

    async def on_get_task_push_notification_config(
        self, params: GetTaskPushNotificationConfigRequest, context: ServerCallContext
    ) -> TaskPushNotificationConfig:
        raise PushNotificationNotSupportedError

    async def on_list_task_push_notification_configs(
        self, params: ListTaskPushNotificationConfigsRequest, context: ServerCallContext
    ) -> ListTaskPushNotificationConfigsResponse:
        raise PushNotificationNotSupportedError

    async def on_delete_task_push_notification_config(
        self, params: DeleteTaskPushNotificationConfigRequest, context: ServerCallContext
    ) -> None:
        raise PushNotificationNotSupportedError

    async def on_get_extended_agent_card(
        self, params: GetExtendedAgentCardRequest, context: ServerCallContext
    ) -> AgentCard:
        raise UnsupportedOperationError(message="there is no extended agent card")


def _queued(session: str, message: str, behind: str) -> Message:
    """The answer to a message that waits behind a running turn: it becomes a task when
    its own turn starts (SubscribeToTask or GetTask then find it by that turn's id)."""
    return Message(
        message_id=f"{session}:{message}",
        context_id=session,
        role=Role.ROLE_AGENT,
        parts=[Part(text=f"queued as {message} behind task {behind}")],
        metadata=_struct({"tether": {"queued": message, "behind": behind}}),
    )


def _stamp(record: TurnRecord) -> int:
    """A task's status timestamp (ns): when its turn ended, or started while it runs."""
    return int((record.ended_at or record.started_at) * 1e9)


def _result(task: str, text: str) -> Artifact:
    return Artifact(artifact_id=f"{task}:result", name="result", parts=[Part(text=text)])


def _a2a_error(exc: TetherError) -> A2AError:
    match exc.code:
        case "invalid-params" | "driver-not-found":
            return InvalidParamsError(message=exc.message)
        case "not-found":
            return TaskNotFoundError(message=exc.message)
        case "subagent-unauthorized" | "parent-offline" | "already-decided":
            return InvalidRequestError(message=exc.message)
    return _internal(exc)


class _Context(DefaultServerCallContextBuilder):
    """The SDK's call context, also holding the request, so that a blocking call can
    see its caller hang up."""

    def build(self, request: Request) -> ServerCallContext:
        context = super().build(request)
        context.state["request"] = request
        return context


def _json_only(route: BaseRoute) -> BaseRoute:
    """A JSON-RPC route that answers 415 with ``ContentTypeNotSupportedError`` to a body
    whose declared type is not JSON (the binding is ``application/json``): a parse error
    would blame the body for what the header already said. A request that declares no
    type goes through."""
    if not isinstance(route, Route) or "POST" not in (route.methods or ()):
        return route
    inner = route.endpoint

    async def endpoint(request: Request) -> Response:
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind and kind != "application/json" and not kind.endswith("+json"):
            # HTTP says 415; the body says it as the binding's own error, so a JSON-RPC
            # client reads ContentTypeNotSupportedError like any other.
            code = JSON_RPC_ERROR_CODE_MAP[ContentTypeNotSupportedError]
            message = f"unsupported media type {kind!r}: the JSON-RPC binding is application/json"
            return JSONResponse(
                {"jsonrpc": "2.0", "id": None, "error": {"code": code, "message": message}},
                status_code=415,
            )
        answer: Response = await inner(request)
        return answer

    return Route(route.path, endpoint, methods=list(route.methods or ()), name=route.name)


class A2aHttp:
    """``/a2a`` (JSON-RPC) and the Agent Card on ``tether serve``."""

    def __init__(self, rt: Runtime, options: FaceOptions) -> None:
        self.handler = TetherA2A(rt, options)

        async def card(request: Request) -> Response:
            doc = MessageToDict(agent_card(str(request.base_url), options))
            return JSONResponse(doc)

        self.routes: list[BaseRoute] = [
            # Both spellings: a client whose base URL is ``.../a2a`` may post to ``/a2a/``
            # and not follow the redirect Starlette would answer with.
            *map(
                _json_only,
                [
                    *create_jsonrpc_routes(self.handler, "/a2a", context_builder=_Context()),
                    *create_jsonrpc_routes(self.handler, "/a2a/", context_builder=_Context()),
                ],
            ),
            Route("/.well-known/agent-card.json", card, methods=["GET"]),
        ]

    @asynccontextmanager
    async def lifespan(self) -> AsyncIterator[None]:
        yield
