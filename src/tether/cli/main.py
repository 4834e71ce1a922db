"""The ``tether`` command: drive a running ``tether serve`` from a terminal.

Exit codes: 0 done, 1 refused (the error code goes to stderr), 2 usage.
Every client command takes ``--url`` (``$TETHER_URL``), ``--token`` (``$TETHER_TOKEN``)
and ``--json`` (machine-readable output).
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import queue
import sys
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, NoReturn
from urllib.parse import quote

import msgspec

from tether.cli._terminal import json_line, shown
from tether.cli.client import DEFAULT_URL, Client, RpcError, in_background
from tether.serve.token import blank_is_none, find_token
from tether.wire.approval import call_text
from tether.wire.budget import LIMITS, check_budget, limit_text, parse_budget, spent_text
from tether.wire.errors import TetherError
from tether.wire.text import who
from tether.wire.vocab import MAX_SECONDS

__all__ = ["main"]

_POLL: Final = 1.0  # seconds between transcript --follow polls when no event arrives

Command = Callable[[argparse.Namespace, Client], int]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: usage error: {message}\n")


def _out(args: argparse.Namespace, value: Any, text: str | None = None) -> None:
    """Print ``value`` as JSON with --json, else ``text`` (if any); either way with no
    control character raw (what a model, a tool or a person wrote is in both)."""
    if args.json:
        print(json_line(value))
    elif text is not None:
        print(shown(text))


def _json_arg(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc})") from None


_STALL_STEPS: Final = ("steer", "cancel", "abort", "preempt")
_STALL_KEYS: Final = ("after", "every", "steps", "nudge", "repeat", "grace")
_STALL_USAGE: Final = (
    "KEY=VALUE pairs separated by commas, e.g. after=60,every=30,steps=steer+cancel+abort"
    "[,nudge=TEXT][,repeat=N][,grace=S]"
)


def _seconds(text: str, *, zero: bool = False) -> float:
    """A duration: a finite number of seconds, positive (``zero``: or 0), at most
    MAX_SECONDS (30 days), as every entry point takes it (``wire.vocab``)."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    low_ok = seconds >= 0 if zero else seconds > 0
    if not (low_ok and seconds <= MAX_SECONDS):
        what = "a non-negative" if zero else "a positive"
        raise argparse.ArgumentTypeError(
            f"must be {what} number of seconds, at most {MAX_SECONDS:.0f} (30 days), not {text!r}"
        )
    return seconds


def _grace_arg(text: str) -> float:
    return _seconds(text, zero=True)


def _stall_arg(text: str) -> dict[str, Any]:
    """``--stall after=60,every=30,steps=steer+cancel+abort[,nudge=TEXT][,repeat=N]``.

    Seconds are positive numbers, ``steps`` joins steps with ``+``, ``repeat`` is an
    integer of at least 2. The nudge may hold commas: a piece that does not start with a
    known ``KEY=`` continues the nudge before it. The server checks the policy again
    (semantics §14.5); this catches what a person mistyped, as a usage error.
    """
    policy = {key: _stall_value(key, value) for key, value in _stall_pairs(text)}
    if "after" not in policy:
        raise argparse.ArgumentTypeError(f"after=SECONDS is required; use {_STALL_USAGE}")
    return policy


def _stall_pairs(text: str) -> list[list[str]]:
    """``text``'s ``KEY=VALUE`` pieces, in order; a piece that is no known ``KEY=``
    continues the nudge before it (a nudge may hold commas)."""
    pairs: list[list[str]] = []
    for piece in text.split(","):
        key, eq, value = piece.partition("=")
        key = key.strip()
        if eq and key in _STALL_KEYS:
            if any(k == key for k, _ in pairs):
                raise argparse.ArgumentTypeError(f"{key} given twice")
            pairs.append([key, value])
        elif pairs and pairs[-1][0] == "nudge":
            pairs[-1][1] += "," + piece
        elif eq:
            known = ", ".join(_STALL_KEYS)
            raise argparse.ArgumentTypeError(f"unknown key {key!r} (known: {known})")
        else:
            raise argparse.ArgumentTypeError(f"{piece!r} is not KEY=VALUE; use {_STALL_USAGE}")
    return pairs


def _stall_value(key: str, value: str) -> Any:
    if key == "nudge":
        if not value.strip():
            raise argparse.ArgumentTypeError("nudge must not be empty")
        return value
    value = value.strip()
    if key in ("after", "every", "grace"):
        try:
            return _seconds(value)
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"{key} {exc}") from None
    if key == "steps":
        steps = value.split("+")
        bad = [step for step in steps if step not in _STALL_STEPS]
        if bad:
            raise argparse.ArgumentTypeError(
                f"steps are {'+'.join(_STALL_STEPS)} joined by '+', not {'+'.join(bad)!r}"
            )
        return steps
    # repeat
    if not value.isdigit() or int(value) < 2:
        raise argparse.ArgumentTypeError(f"repeat must be an integer of at least 2, not {value!r}")
    return int(value)


def _data(args: argparse.Namespace) -> dict[str, Any] | None:
    data = dict(args.data) if args.data is not None else None
    if args.steps is not None:
        data = {**(data or {}), "steps": args.steps}
    return data


def _parent(args: argparse.Namespace, client: Client) -> str:
    """The target's durable parent: --parent, else what subagent.status says.

    A root session has no parent: its owner's address is the root's own id.
    """
    if args.parent:
        return str(args.parent)
    info = client.call("subagent.status", {"session": args.id})
    return str(info["parent"] if info.get("parent") is not None else args.id)


def _address(args: argparse.Namespace, client: Client) -> dict[str, str]:
    return {"session": args.id, "parent": _parent(args, client), "mode": "continuable"}


def _login() -> str | None:
    """The login name (``--as``'s default), or None where the system knows none."""
    try:
        return getpass.getuser()
    except (OSError, KeyError):  # no $LOGNAME and no passwd entry for the uid
        return None


def _as(args: argparse.Namespace) -> dict[str, str]:
    """The ``name`` field: who is acting, said as ``by user NAME`` (``--as ''``: none)."""
    return {"name": args.name} if args.name else {}


# ---- commands --------------------------------------------------------------------------


def _open(args: argparse.Namespace, client: Client) -> int:
    params = {"driver": args.driver, "slug": args.slug, "config": args.config}
    params = {**params, "permissions": args.permissions, **_stall(args)}
    result = client.call("session.open", params)
    _out(args, result, result["session"])
    return 0


def _stall(args: argparse.Namespace) -> dict[str, Any]:
    """The ``stall`` and ``limits`` fields, only when given (an older server knows no
    such field)."""
    out: dict[str, Any] = {} if args.stall is None else {"stall": args.stall}
    if getattr(args, "limits", None) is not None:
        out["limits"] = args.limits
    if getattr(args, "budget", None) is not None:
        out["budget"] = args.budget
    if getattr(args, "on_crash", None) is not None:
        out["on_crash"] = args.on_crash
    if getattr(args, "max_recoveries", None) is not None:
        out["max_recoveries"] = args.max_recoveries
    return out


def _budget_arg(text: str) -> dict[str, Any]:
    """``--budget tokens=200000,cost_usd=5,turn_seconds=600,turns=50,soft=0.8,
    on_soft=steer,on_hard=cancel`` (semantics §16.2); the server checks it again."""
    try:
        return check_budget_dict(text)
    except TetherError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


def check_budget_dict(text: str) -> dict[str, Any]:
    """The budget ``text`` names, checked, as the dict RPC takes."""
    budget = check_budget(parse_budget(text))
    assert budget is not None
    out: dict[str, Any] = msgspec.to_builtins(budget)
    return out


def budget_lines(status: dict[str, Any]) -> Iterator[str]:
    """A tree's budget (``subagent.budget``) as a person reads it."""
    decided = status.get("decided_by")
    head = f"budget of {status['session']}: {status['state']}"
    yield head + (f" (decided by {decided})" if decided else "")
    limits, remaining = status.get("limits") or {}, status.get("remaining") or {}
    for key in LIMITS:
        spent = status["spent"].get(key, 0)
        if key in limits:
            left = limit_text(key, remaining.get(key, 0))
            yield f"  {key:<13} {spent_text(key, spent, limits[key])}  ({left} left)"
        else:
            yield f"  {key:<13} {limit_text(key, spent)} spent"


def _limits_arg(text: str) -> dict[str, float]:
    """``--limits memory_mb=512,pids=64,cpu=1.5``; the server checks them again, and
    refuses one the kernel cannot enforce there (semantics §15.5)."""
    out: dict[str, float] = {}
    for piece in text.split(","):
        key, eq, value = piece.partition("=")
        key = key.strip()
        if not eq or key not in ("memory_mb", "pids", "cpu"):
            raise argparse.ArgumentTypeError(
                f"{piece!r}: expected KEY=NUMBER with KEY one of memory_mb, pids, cpu"
            )
        try:
            out[key] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{key}: {value!r} is not a number") from None
    return out


def _message_id(result: dict[str, Any]) -> str:
    """A send's answer as a person reads it: the new message's id."""
    return str(result.get("message") or "accepted")  # an older server names no message


def _prompt(args: argparse.Namespace, client: Client) -> int:
    params = {"session": args.id, "content": args.text, "data": _data(args)}
    result = client.call("session.prompt", params)
    _out(args, result, _message_id(result))
    return 0


def _spawn(args: argparse.Namespace, client: Client) -> int:
    params = {
        "parent": args.id,
        "driver": args.driver,
        "prompt": args.prompt,
        "data": _data(args),
        "slug": args.slug,
        "config": args.config,
        "permissions": args.permissions,
        **_stall(args),
    }
    result = client.call("subagent.spawn", params)
    _out(args, result, result["session"])
    return 0


def _send(args: argparse.Namespace, client: Client) -> int:
    params = {
        "address": _address(args, client),
        "content": args.text,
        "data": _data(args),
        "wake": not args.no_wake,
        **_as(args),
    }
    result = client.call("subagent.send", params)
    _out(args, result, _message_id(result))
    return 0


_DONE: Final = {
    "steer": "steered",
    "cancel": "cancelled",
    "abort": "aborted",
    "preempt": "preempted",
}


def _interrupt(kind: str) -> Command:
    def run(args: argparse.Namespace, client: Client) -> int:
        reason = args.reason if args.reason is not None else (getattr(args, "text", None) or "")
        params: dict[str, Any] = {"address": _address(args, client), "kind": kind, "reason": reason}
        params.update(_as(args))
        if args.grace is not None:
            params["grace"] = args.grace
        if args.deadline is not None:
            params["deadline"] = args.deadline
        if args.turn is not None:
            params["turn"] = args.turn
        subtree = bool(getattr(args, "subtree", False))
        if subtree:
            params["scope"] = "subtree"
        result = client.call("subagent.interrupt", params)
        if subtree:
            turns = list(result.get("turns") or [])
            text = (
                "\n".join(f"{_DONE[kind]} {turn}" for turn in turns)
                if turns
                else "no-op: no running turn in the subtree"
            )
        elif "turn" not in result:  # an older server does not say which turn
            text = f"{kind} accepted for {args.id}"
        elif result["turn"] is not None:
            text = f"{_DONE[kind]} {result['turn']}"
        elif args.turn is not None:
            text = f"no-op: {args.turn} is not the running turn"
        elif kind == "steer":  # a steer is also dropped for a turn that is already stopping
            text = "no-op: no running turn, or it is stopping"
        else:
            text = "no-op: no running turn"
        _out(args, result, text)
        return 0

    return run


def _pause(resume: bool) -> Command:
    def run(args: argparse.Namespace, client: Client) -> int:
        scope = "subtree" if args.subtree else "session"
        params: dict[str, Any] = {"address": _address(args, client), "scope": scope, **_as(args)}
        if not resume and args.reason is not None:
            params["reason"] = args.reason
        result = client.call("subagent.resume" if resume else "subagent.pause", params)
        turns = list(result.get("turns") or [])
        done = "resumed" if resume else "paused"
        if turns:
            text = "\n".join(f"{done} {turn}" for turn in turns)
        elif resume:
            text = "no-op: nothing paused" + (" in the subtree" if args.subtree else "")
        else:
            text = "no-op: no running turn" + (" in the subtree" if args.subtree else "")
        _out(args, result, text)
        return 0

    return run


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    stamp = datetime.fromtimestamp(ts, tz=UTC)
    return stamp.strftime("%Y-%m-%d %H:%M:%S.") + f"{stamp.microsecond // 1000:03d} UTC"


def _budget(args: argparse.Namespace, client: Client) -> int:
    if args.set is not None:
        budget = None if args.set in ("none", "") else check_budget_dict(args.set)
        params = {"address": _address(args, client), "budget": budget}
        client.call("subagent.setBudget", params)
    status = client.call("subagent.budget", {"session": args.id})["budget"]
    _out(args, {"budget": status}, "\n".join(budget_lines(status)))
    return 0


def report_lines(r: dict[str, Any]) -> Iterator[str]:
    """A stop report (semantics §15.6) as a person reads it."""
    head = f"{r['turn']} ({r['session']}): {r['kind']} by {who(r['origin'], r['by'])}"
    yield head + (f": {_one_line(r['reason'], 200)}" if r.get("reason") else "")
    yield f"  requested  {_when(r.get('requested_at'))}"
    yield _effective_line(r)
    flags = [f for f in ("forced", "escalated") if r.get(f)]
    yield f"  outcome    {r.get('outcome') or 'running'}" + "".join(f"  [{f}]" for f in flags)
    yield from _process_lines(r.get("processes") or [])
    yield from _tool_lines(r.get("tools") or [])
    if r.get("partial"):
        yield f"  partial    {_one_line(r['partial'], 200)}"


def _effective_line(r: dict[str, Any]) -> str:
    """When the stop took effect, and how long after it was requested."""
    if r.get("effective_at") is None:
        return "  effective  not yet (the turn is still ending)"
    how = f"{r['latency_ms']:.1f} ms after the request, via {r.get('via') or 'unknown'}"
    return f"  effective  {_when(r['effective_at'])}  ({how})"


def _process_lines(procs: list[dict[str, Any]]) -> Iterator[str]:
    yield f"  processes  {len(procs) or 'none listed'}"
    for p in procs:
        argv = _one_line(" ".join(p.get("argv") or []), 80)
        yield f"    pid {p['pid']}  {p.get('signal', '')}  {p.get('fate', '')}  {argv}"


def _tool_lines(tools: list[dict[str, Any]]) -> Iterator[str]:
    yield f"  tools      {len(tools) or 'none open'}"
    for t in tools:
        call = f"  ({t['call']})" if t.get("call") else ""
        yield f"    {t['name']}  {t['fate']}{call}"


def _report(args: argparse.Namespace, client: Client) -> int:
    report = client.call("subagent.stopReport", {"turn": args.turn})["report"]
    if args.json:
        _out(args, {"report": report})
    elif report is None:
        print(shown(f"no stop reached {args.turn}"))
    else:
        print(shown("\n".join(report_lines(report))))
    return 0


def _tree_lines(root: dict[str, Any], agents: list[dict[str, Any]]) -> Iterator[str]:
    for info in [root, *agents]:
        depth = 0 if info is root else int(info["depth"])
        stopping = f"  stopping={info['stopping']}" if info.get("stopping") else ""
        yield (
            f"{'  ' * depth}{info['id']}  {info.get('slug') or '-'}  {info['state']}"
            f"  pending={info.get('pending', 0)}{stopping}{_waiting(info)}"
        )


def _waiting(info: dict[str, Any]) -> str:
    """A running turn that no worker has taken yet (an older server does not say)."""
    waiting = info["state"] == "running" and info.get("dispatched") is False
    return "  waiting for a worker" if waiting else ""


def _tree(args: argparse.Namespace, client: Client) -> int:
    root = client.call("subagent.status", {"session": args.id})
    agents = client.call("subagent.list", {"root": args.id, "scope": "descendants"})["agents"]
    if args.json:
        _out(args, {"root": root, "agents": agents})
    else:
        print(shown("\n".join(_tree_lines(root, agents))))
    return 0


def _status(args: argparse.Namespace, client: Client) -> int:
    info = client.call("subagent.status", {"session": args.id})
    _out(args, info, next(_tree_lines(info, [])))
    return 0


def _turns(args: argparse.Namespace, client: Client) -> int:
    turns = client.call("subagent.turns", {"session": args.id})["turns"]
    lines = [
        f"{t['id']}  {t.get('outcome') or 'running'}"
        + (f"  by {who(t['cause'], t.get('by'))}" if t.get("cause") else "")
        + (f"  {t['reason']}" if t.get("reason") else "")
        + (f"  {t['error']}" if t.get("error") else "")  # a failed turn's why, as a stop's
        for t in turns
    ]
    _out(args, {"turns": turns}, "\n".join(lines) if lines else None)
    return 0


def _one_line(text: str, width: int = 60) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def _inbox(args: argparse.Namespace, client: Client) -> int:
    messages = client.call("subagent.inbox", {"session": args.id})["messages"]
    lines = [
        f"{m['id']}  {m['kind']}  {m.get('sender') or '-'}  {_one_line(m.get('preview', ''))}"
        for m in messages
    ]
    _out(args, {"messages": messages}, "\n".join(lines) if lines else None)
    return 0


def approval_line(a: dict[str, Any]) -> str:
    """One pending approval as a person reads it: its id, its session, the call (one
    line), and who may decide when only a person may."""
    # The call as the model wrote it (capped), on one line: a person decides on it.
    call = call_text(str(a.get("tool", "?")), a.get("arguments"))
    call = call.replace("\r", "\\r").replace("\n", "\\n")
    only = "  (a person decides)" if a.get("approver") == "user" else ""
    return f"{a['id']}  {a['session']}  {call}{only}"


def _approvals(args: argparse.Namespace, client: Client) -> int:
    scope = "subtree" if args.subtree else "session"
    found = client.call("subagent.approvals", {"session": args.id, "scope": scope})["approvals"]
    lines = [approval_line(a) for a in found]
    _out(args, {"approvals": found}, "\n".join(lines) if lines else None)
    return 0


def _approval_parent(args: argparse.Namespace, client: Client) -> str:
    """The parent of the approval's session: --parent, else looked up (the approval's
    session, then its durable parent; a root's is its own id)."""
    if args.parent:
        return str(args.parent)
    session = client.call("subagent.approval", {"approval": args.approval})["approval"]["session"]
    info = client.call("subagent.status", {"session": session})
    return str(info["parent"] if info.get("parent") is not None else session)


def _decide(decision: str) -> Command:
    def run(args: argparse.Namespace, client: Client) -> int:
        params: dict[str, Any] = {
            "approval": args.approval,
            "parent": _approval_parent(args, client),
            "decision": decision,
            **_as(args),
        }
        if args.reason:
            params["reason"] = args.reason
        if getattr(args, "arguments", None) is not None:
            params["arguments"] = args.arguments
        a = client.call("subagent.decide", params)["approval"]
        edited = " with edited arguments" if a.get("arguments_used") != a.get("arguments") else ""
        text = f"{a['state']} {a['id']}{edited if a['state'] == 'approved' else ''}"
        _out(args, {"approval": a}, text)
        return 0

    return run


def _dispose(args: argparse.Namespace, client: Client) -> int:
    _out(args, client.call("subagent.dispose", {"address": _address(args, client)}))
    return 0


def _release(args: argparse.Namespace, client: Client) -> int:
    _out(args, client.call("session.release", {"session": args.id}))
    return 0


def entry_line(entry: dict[str, Any]) -> str:
    """One transcript entry as a person reads it. A reply that is only tool calls has no
    text: its calls are named, so no entry prints as nothing."""
    data = entry.get("data") or {}
    calls = data.get("tool_calls") if isinstance(data, dict) else None
    names = [str((c.get("function") or {}).get("name") or "?") for c in calls or ()]
    text = entry["text"]
    if names:
        text += ("  " if text else "") + f"(calls {', '.join(names)})"
    return f"[{entry['seq']}] {entry['kind']}: {text or '(no text)'}"


def _print_entry(args: argparse.Namespace, entry: dict[str, Any]) -> None:
    if args.json:
        print(json_line(entry), flush=True)
    else:
        print(shown(entry_line(entry)), flush=True)


def _print_after(args: argparse.Namespace, client: Client, after: int) -> int:
    """Print every entry with ``seq > after``, page by page; the last seq printed."""
    while True:
        page = client.call("subagent.transcript", {"session": args.id, "after": after})
        for entry in page["entries"]:
            _print_entry(args, entry)
            after = int(entry["seq"])
        if not page["more"]:
            return after


def _transcript(args: argparse.Namespace, client: Client) -> int:
    # Subscribe before the first page, so nothing lands between the page and the stream.
    events = client.events(session=args.id) if args.follow else None
    after = _print_after(args, client, args.after)
    if events is None:
        return 0
    pending = in_background(events)
    while True:
        try:
            ev = pending.get(timeout=_POLL)
        except queue.Empty:
            pass  # poll anyway: entries written by say() raise no event
        else:
            if ev is None or ev.event == "closed":
                print("tether: the server ended the event stream", file=sys.stderr)
                return 0
        after = _print_after(args, client, after)


def _watch(args: argparse.Namespace, client: Client) -> int:
    from tether.cli.watch import watch

    return watch(client, args.id, as_json=args.json)


TUI_EXTRA: Final = "pip install 'tether-runtime[tui]'"


def _tui(args: argparse.Namespace, client: Client) -> int:
    """The terminal UI (SPEC §17.3), imported only now: Textual is an extra."""
    if args.json:
        print("tether tui: usage error: --json does not apply to a screen", file=sys.stderr)
        return 2
    try:
        from tether.tui import run
    except ImportError as exc:
        if exc.name is not None and exc.name.split(".")[0] == "textual":
            print(f"tether tui: needs the extra tether-runtime[tui]: {TUI_EXTRA}", file=sys.stderr)
            return 1
        raise
    return run(client, root=args.id, name=args.name)


def _console(args: argparse.Namespace, _client: Client) -> int:
    token = find_token(args.url, args.token)
    if token is None:
        print(
            f"tether: no token for {args.url}: pass --token, or run this as the user that runs"
            " the server on this machine",
            file=sys.stderr,
        )
        return 1
    print(f"{args.url.rstrip('/')}/#token={quote(token, safe='')}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from tether.serve.server import is_loopback, serve

    if blank_is_none(args.token) is None and not is_loopback(args.host):
        print(
            f"tether serve: usage error: binding {args.host} (not loopback) requires --token "
            "(or $TETHER_TOKEN), not empty",
            file=sys.stderr,
        )
        return 2
    if args.ray_address is not None and args.backend != "ray":
        print("tether serve: usage error: --ray-address needs --backend ray", file=sys.stderr)
        return 2
    try:
        return _run_serve(serve, args)
    except TetherError as exc:  # e.g. --backend ray without the extra tether-runtime[ray]
        print(f"tether serve: {exc.message}", file=sys.stderr)
        return 1


def _face_options(args: argparse.Namespace) -> Any:
    """The driver and config of the roots MCP and A2A clients open (``--driver``,
    ``--config FILE``), and the roots MCP clients hold from the start (``--root``)."""
    from tether.serve.face_kit import FaceOptions
    from tether.serve.faces import load_config

    return FaceOptions(
        driver=args.driver,
        config=load_config(args.config),
        roots=tuple(args.root or ()),
        cancel_deadline=getattr(args, "cancel_deadline", None),
    )


def _mcp(args: argparse.Namespace) -> int:
    from tether.serve.faces import missing_extra

    why = missing_extra("mcp")
    if why is not None:
        print(f"tether mcp: {why}", file=sys.stderr)
        return 1
    from tether.serve.mcp_face import run_stdio

    try:
        options = _face_options(args)
        args.path.parent.mkdir(parents=True, exist_ok=True)
        return run_stdio(
            path=str(args.path), workers=args.workers, grace=args.grace, options=options
        )
    except TetherError as exc:
        print(f"tether mcp: {exc.message}", file=sys.stderr)
        return 1


def _run_serve(serve: Any, args: argparse.Namespace) -> int:
    return int(
        serve(
            path=args.path,
            host=args.host,
            port=args.port,
            token=args.token,
            workers=args.workers,
            grace=args.grace,
            backend=args.backend,
            ray_address=args.ray_address,
            containment=args.containment,
            max_body=args.max_body,
            max_streams=args.max_streams,
            fd_reserve=args.fd_reserve,
            faces=_face_options(args),
            otlp=args.otlp,
            tool_user=args.tool_user,
            secret_env=args.secret_env,
            on_stop=args.on_stop,
        )
    )


# ---- the parser -------------------------------------------------------------------------


def _common() -> _Parser:
    common = _Parser(add_help=False)
    group = common.add_argument_group("server")
    group.add_argument(
        "--url",
        default=os.environ.get("TETHER_URL", DEFAULT_URL),
        help=f"the server (default $TETHER_URL or {DEFAULT_URL})",
    )
    group.add_argument(
        "--token",
        default=os.environ.get("TETHER_TOKEN"),
        help="bearer token (default $TETHER_TOKEN, else the token file of the server on this"
        " machine at --url)",
    )
    group.add_argument("--json", action="store_true", help="print machine-readable JSON")
    return common


def _add_as(p: argparse.ArgumentParser) -> None:
    login = _login()
    p.add_argument(
        "--as",
        dest="name",
        metavar="NAME",
        default=login,
        help="who you are, shown as 'by user NAME' in the marker (default: your login name"
        + (f", {login.replace('%', '%%')}" if login else "")
        + "; '' for none: 'by user')",
    )


def _add_data(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", type=_json_arg, help="a JSON object attached to the message")
    p.add_argument(
        "--steps",
        type=_json_arg,
        help="shorthand for --data '{\"steps\": STEPS}' (tether:Scripted)",
    )


def _add_session_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--driver", default="tether:Scripted", help="driver import string")
    p.add_argument("--slug", help="a short name, unique among siblings")
    p.add_argument("--config", type=_json_arg, help="driver config, a JSON object")
    p.add_argument("--permissions", type=_json_arg, help='e.g. \'{"interrupt": "deny"}\'')
    p.add_argument(
        "--stall",
        type=_stall_arg,
        metavar="SPEC",
        help="the stall watchdog's policy: after=60,every=30,steps=steer+cancel+abort"
        "[,nudge=TEXT][,repeat=N][,grace=S] (a child without one inherits its parent's)",
    )
    p.add_argument(
        "--limits",
        type=_limits_arg,
        metavar="SPEC",
        help="each turn's limits, enforced by its cgroup: memory_mb=512,pids=64,cpu=1.5 "
        "(a child without its own inherits its parent's; unenforceable here: an error)",
    )

    p.add_argument(
        "--budget",
        type=_budget_arg,
        metavar="SPEC",
        help="the tree's budget: tokens=N,cost_usd=X,turn_seconds=S,turns=K[,soft=0.8]"
        "[,on_soft=steer|pause|none][,on_hard=cancel|abort|pause] (a child's must fit in "
        "what its ancestors' have left)",
    )
    p.add_argument(
        "--on-crash",
        choices=("recover", "park"),
        default=None,
        help="what a crash does to a running turn of a recoverable driver: it runs on from"
        " its last step (recover), or ends crashed (park) (default: the parent's, else"
        " the server's: recover)",
    )
    p.add_argument(
        "--max-recoveries",
        type=int,
        default=None,
        metavar="N",
        help="how often one turn may recover before it ends crashed (default: the parent's,"
        " else 3)",
    )


def _add_store_path(p: argparse.ArgumentParser) -> None:
    """The store a runtime the command runs itself keeps (``serve``, ``mcp``)."""
    p.add_argument(
        "--path",
        type=Path,
        default=Path(".tether") / "state.db",
        help="the store (default: %(default)s)",
    )


def _add_face_options(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("MCP and A2A clients (the extra tether-runtime[agents])")
    group.add_argument(
        "--driver",
        default="tether:Scripted",
        help="driver import string of the root agents clients open (default: %(default)s)",
    )
    group.add_argument(
        "--config", metavar="FILE", help="their driver config, a JSON file (default: none)"
    )
    group.add_argument(
        "--root",
        action="append",
        metavar="ID",
        help="a root session every MCP client holds from the start (repeatable; default: none)",
    )


_INTERRUPTS: Final = {
    "steer": "redirect the running turn at its next boundary (the text is the guidance)",
    "cancel": "ask the running turn to wrap up at its next boundary (killed after --grace)",
    "abort": "kill the running turn's whole process tree now",
    "preempt": "kill only the running command of the turn; the turn goes on",
}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="tether",
        description="Drive a Tether runtime: start it with `tether serve`, then open "
        "sessions, spawn subagents and steer, cancel, abort or preempt them, and approve or"
        " deny the tool calls they wait on.",
        epilog="Exit codes: 0 done, 1 refused (error code on stderr), 2 usage.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    common = _common()

    def command(name: str, summary: str, example: str, run: Command) -> argparse.ArgumentParser:
        p = sub.add_parser(
            name,
            help=summary,
            description=summary[0].upper() + summary[1:] + ".",
            epilog=f"example:\n  {example}",
            parents=[common],
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.set_defaults(run=run)
        return p

    p = command("open", "open a root session", "tether open --slug main", _open)
    _add_session_options(p)

    command(
        "console",
        "print a link to the web console that signs this browser in (the token in its"
        " fragment, which no server sees)",
        "tether console",
        _console,
    )

    p = command(
        "prompt",
        "send the owner's message to a root session",
        "tether prompt s_01H… 'summarise the repo' --steps '[{\"op\":\"hang\"}]'",
        _prompt,
    )
    p.add_argument("id", help="root session id")
    p.add_argument("text", help="the message")
    _add_data(p)

    p = command(
        "spawn",
        "spawn a continuable subagent under a session",
        "tether spawn s_01H… --slug researcher --prompt 'find the bug'",
        _spawn,
    )
    p.add_argument("id", help="the parent session id")
    p.add_argument("--prompt", help="its first (waking) message")
    _add_session_options(p)
    _add_data(p)

    p = command(
        "send",
        "send a message to a subagent as its parent's user",
        "tether send s_01J… 'also check the tests'",
        _send,
    )
    p.add_argument("id", help="subagent id")
    p.add_argument("text", help="the message")
    p.add_argument("--parent", help="its parent id (looked up when left out)")
    p.add_argument("--no-wake", action="store_true", help="queue it without starting a turn")
    _add_as(p)
    _add_data(p)

    for kind, summary in _INTERRUPTS.items():
        example = {
            "steer": "tether steer s_01J… 'focus on the failing test'",
            "cancel": "tether cancel s_01J… --reason 'wrong approach' --grace 3",
        }.get(kind, f"tether {kind} s_01J… --reason 'stuck'")
        p = command(kind, summary, example, _interrupt(kind))
        p.add_argument("id", help="subagent id")
        if kind == "steer":
            p.add_argument("text", nargs="?", help="the guidance (or --reason)")
        p.add_argument("--reason", help="why (shown in the marker; a steer's guidance)")
        p.add_argument("--parent", help="its parent id (looked up when left out)")
        p.add_argument("--grace", type=_grace_arg, help="seconds a cancelled turn gets to wrap up")
        p.add_argument("--deadline", type=_seconds, help="abort a cancel not seen within this long")
        p.add_argument(
            "--turn", help="act only if this turn is still the running one (else a no-op)"
        )
        _add_as(p)
        if kind in ("cancel", "abort"):
            p.add_argument(
                "--subtree",
                action="store_true",
                help="stop every running descendant too, each on its own turn",
            )

    for resume in (False, True):
        name = "resume" if resume else "pause"
        summary = (
            "thaw a paused subagent: its turn goes on where it was"
            if resume
            else "freeze a subagent's running turn in place (SIGSTOP), keeping everything"
        )
        example = f"tether {name} s_01J…" + ("" if resume else " --reason 'let me look'")
        p = command(name, summary, example, _pause(resume))
        p.add_argument("id", help="subagent id")
        p.add_argument(
            "--subtree",
            action="store_true",
            help="every paused descendant too" if resume else "every running descendant too",
        )
        if not resume:
            p.add_argument("--reason", help="why (shown in the marker)")
        p.add_argument("--parent", help="its parent id (looked up when left out)")
        _add_as(p)

    p = command(
        "tree",
        "show a session and its descendants: id, slug, state, pending messages",
        "tether tree s_01H…",
        _tree,
    )
    p.add_argument("id", help="root of the tree")

    p = command("status", "show one session's state", "tether status s_01J…", _status)
    p.add_argument("id", help="session id")

    p = command("turns", "list a session's turns and how they ended", "tether turns s_01J…", _turns)
    p.add_argument("id", help="session id")

    p = command(
        "report",
        "show what a stop did to a turn: when, how, the processes killed, the tools cut",
        "tether report t_01J…",
        _report,
    )
    p.add_argument("turn", help="turn id (t_…)")

    p = command(
        "budget",
        "show a tree's budget: spent, limits, what is left (with --set, change it first)",
        "tether budget s_01H… --set tokens=500000,cost_usd=10",
        _budget,
    )
    p.add_argument("id", help="session id")
    p.add_argument(
        "--set",
        metavar="SPEC",
        help="its new budget (as --budget; 'none' removes it), with its parent's authority",
    )
    p.add_argument("--parent", help="its parent id (looked up when left out)")

    p = command(
        "inbox",
        "list a session's pending messages: id, kind, sender, preview",
        "tether inbox s_01J…",
        _inbox,
    )
    p.add_argument("id", help="session id")

    p = command(
        "transcript",
        "print a session's transcript (with --follow, keep printing new entries)",
        "tether transcript s_01J… --follow\n\n"
        "Every entry is printed, as [seq] kind: text. Seq numbers count across the whole\n"
        "store, so one session's skip the numbers of other sessions' entries: a gap is\n"
        "not a missing entry. A reply that is only tool calls names them; --json prints\n"
        "every field (data included).",
        _transcript,
    )
    p.add_argument("id", help="session id")
    p.add_argument("--after", type=int, default=0, help="start after this entry seq")
    p.add_argument("--follow", "-f", action="store_true", help="keep following until Ctrl-C")

    p = command(
        "watch",
        "live tree of a session's subtree, with markers as they happen (Ctrl-C ends)",
        "tether watch s_01H…",
        _watch,
    )
    p.add_argument("id", help="root of the tree")

    p = command(
        "tui",
        "the terminal UI: a root's live tree, a session's transcript, and every verb on a"
        " key (needs the extra tether-runtime[tui])",
        "tether tui s_01H… --as alice\n\n"
        "Without ROOT it lists the server's roots, newest first. Keys (also in its footer):\n"
        "  up/down, j/k   move in the tree (the session under the cursor is shown)\n"
        "  enter          write to the selected session; enter sends, esc goes back\n"
        "  esc            stop menu of the turn on screen: s steer, c cancel, a abort,\n"
        "                 p preempt, each asking a reason (enter confirms, esc backs out)\n"
        "  z              pause the running turn (asking a reason), or resume a paused one\n"
        "  S              stop the subtree: c cancel or a abort, then a reason\n"
        "  t, i           the session's turns, its pending inbox (again: the transcript)\n"
        "  r              the stop report under a stop marker\n"
        "  o              open another root\n"
        "  q              quit",
        _tui,
    )
    p.add_argument("id", nargs="?", metavar="ROOT", help="the root to open (default: choose)")
    _add_as(p)

    p = command(
        "approvals",
        "list a session's tool calls that wait for a decision: id, session, call"
        " (with --subtree, those of every session below it too)",
        "tether approvals s_01H… --subtree",
        _approvals,
    )
    p.add_argument("id", help="session id")
    p.add_argument(
        "--subtree", action="store_true", help="every session below it too (seen from the root)"
    )

    for decision, summary, example in (
        (
            "approve",
            "approve a pending tool call: it runs (with --arguments, with those instead)",
            'tether approve a_01J… --arguments \'{"argv": ["rm", "-rf", "build/tmp"]}\'',
        ),
        (
            "deny",
            "deny a pending tool call: it never runs, and the agent is told who denied it and why",
            "tether deny a_01J… --reason 'not the build dir'",
        ),
    ):
        p = command(decision, summary, example, _decide(decision))
        p.add_argument("approval", help="approval id (a_…)")
        if decision == "approve":
            p.add_argument(
                "--arguments",
                type=_json_arg,
                metavar="JSON",
                help="the call's arguments, edited (a JSON object, checked against the"
                " tool's schema)",
            )
            p.add_argument("--reason", help="why (shown in the marker)")
        else:
            p.add_argument("--reason", required=True, help="why (the agent is told)")
        p.add_argument("--parent", help="the parent of its session (looked up when left out)")
        _add_as(p)

    p = command(
        "dispose",
        "end a subagent and its subtree (records are kept)",
        "tether dispose s_01J…",
        _dispose,
    )
    p.add_argument("id", help="subagent id")
    p.add_argument("--parent", help="its parent id (looked up when left out)")

    p = command(
        "release",
        "take a session offline (dormant) until a waking send",
        "tether release s_01H…",
        _release,
    )
    p.add_argument("id", help="session id")

    p = sub.add_parser(
        "serve",
        help="run the runtime as a server (JSON-RPC at /rpc, events at /events)",
        description="Run a Tether runtime with a durable store behind JSON-RPC 2.0\n"
        "(POST /rpc) and server-sent events (GET /events). SIGINT/SIGTERM stop it:\n"
        "recoverable turns (ChatAgent's, the adapters') are left open to recover at the\n"
        "next start (--on-stop suspend), the others cancelled with grace, the rest\n"
        "aborted; no process is left.",
        epilog="example:\n  tether serve --path ./.tether/state.db --port 7777\n"
        "  TETHER_TOKEN=$(openssl rand -hex 32) tether serve --host 0.0.0.0",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_store_path(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    p.add_argument(
        "--port", type=int, default=7777, help="port, 0 picks a free one (default: %(default)s)"
    )
    p.add_argument(
        "--token",
        default=os.environ.get("TETHER_TOKEN"),
        help="the bearer token every request needs (default: $TETHER_TOKEN; none given: the"
        " one in the file 'token' beside the store, made if missing, mode 0600)",
    )
    p.add_argument(
        "--tool-user",
        metavar="NAME",
        default=None,
        help="run the agents' tools (commands, MCP servers, CLIs) as this user, so they can"
        " read neither the token's file nor the server's memory (the server must run as"
        " root, or with CAP_SETUID and CAP_SETGID; default: the server's own user)",
    )
    p.add_argument(
        "--secret-env",
        metavar="NAME",
        action="append",
        default=[],
        help="an environment variable no agent's tool may see (repeatable; default: none);"
        " the token and the variables sessions name as keys (api_key_env) are kept from"
        " them anyway",
    )
    p.add_argument(
        "--on-stop",
        choices=("suspend", "cancel"),
        default="suspend",
        help="what SIGINT/SIGTERM does to a running recoverable turn: leave it open to"
        " recover at the next start, so a deploy loses nothing (suspend), or cancel it"
        " (default: %(default)s)",
    )
    p.add_argument("--workers", type=int, default=2, help="worker processes (default: %(default)s)")
    p.add_argument(
        "--backend",
        choices=("local", "ray"),
        default="local",
        help="where turns run: local worker processes, or a Ray cluster (tether-runtime[ray];"
        " default: %(default)s)",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        help="the Ray cluster to join (e.g. ray://head:10001 or auto; default: start one)",
    )
    p.add_argument(
        "--containment",
        choices=("auto", "cgroup", "walk"),
        default=os.environ.get("TETHER_CONTAINMENT") or "auto",
        help="how a turn's processes are held: a cgroup v2 leaf per worker (cgroup), the "
        "process-tree walk (walk), or cgroup where available: auto (default: "
        "$TETHER_CONTAINMENT, else auto)",
    )
    p.add_argument(
        "--grace",
        type=_grace_arg,
        default=5.0,
        help="a cancel's grace when it names none, seconds (default: %(default)s)",
    )
    p.add_argument(
        "--max-body",
        type=int,
        default=1 << 20,
        help="request body cap, bytes, on /rpc, /mcp and /a2a (default: %(default)s, 1 MiB)",
    )
    p.add_argument(
        "--max-streams",
        type=int,
        default=64,
        help="concurrent /events streams, more: 503 (default: %(default)s)",
    )
    p.add_argument(
        "--fd-reserve",
        type=int,
        default=64,
        help="file descriptors kept for the runtime's workers, fewer free: 503"
        " (default: %(default)s)",
    )
    _add_face_options(p)
    p.add_argument(
        "--otlp",
        metavar="ENDPOINT",
        default=None,
        help="export OpenTelemetry traces over OTLP/HTTP to this base URL, e.g. "
        "http://127.0.0.1:4318 (tether-runtime[otel]; OTEL_EXPORTER_OTLP_ENDPOINT does the same;"
        " default: none)",
    )
    p.add_argument(
        "--cancel-deadline",
        type=float,
        default=30.0,
        help="an A2A CancelTask that reaches no boundary this soon escalates to an abort,"
        " seconds (default: %(default)s)",
    )

    p = sub.add_parser(
        "mcp",
        help="serve the runtime to an MCP client on stdin/stdout (tools: spawn_agent, ...)",
        description="Run a Tether runtime embedded, speaking the Model Context Protocol on\n"
        "stdin/stdout (stdout carries only the protocol; logs go to stderr). The client\n"
        "owns the root agents it opens with spawn_agent (and those given with --root).\n"
        "Needs the extra tether-runtime[agents].",
        epilog="example (an MCP client's config):\n"
        '  {"mcpServers": {"tether": {"command": "tether", "args": ["mcp", "--path", '
        '"/home/me/.tether/state.db"]}}}',
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_store_path(p)
    p.add_argument("--workers", type=int, default=2, help="worker processes (default: %(default)s)")
    p.add_argument(
        "--grace",
        type=float,
        default=5.0,
        help="a cancel's grace when it names none, seconds (default: %(default)s)",
    )
    _add_face_options(p)

    sub.add_parser(
        "demo",
        help="run the scripted demonstration (see `tether demo --help`)",
        add_help=False,
    )
    return parser


def _import_from_cwd() -> None:
    """A server's workers import the user's drivers and factories from the directory it
    was started in, as ``python -m`` or a script's would: the workers take the host's
    import path, and the ``tether`` script's first entry is its own bin directory."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["demo"]:  # the demo owns its arguments and its --help
        from tether.cli.demo import main as demo_main

        return int(demo_main(args_list[1:]))
    parser = build_parser()
    args = parser.parse_args(args_list)
    if args.command == "steer" and not (args.text or args.reason):
        parser.error("steer needs the guidance: TEXT or --reason")
    if args.command in ("serve", "mcp"):
        _import_from_cwd()
        return _serve(args) if args.command == "serve" else _mcp(args)
    client = Client(args.url, token=find_token(args.url, args.token))
    try:
        return int(args.run(args, client))
    except RpcError as exc:
        if args.json:
            error = {"code": exc.code, "message": exc.message, "error_id": exc.error_id}
            print(json_line({"error": error}), file=sys.stderr)
        else:
            print(shown(f"tether: {exc.code}: {exc.message}"), file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # how --follow and watch are meant to end
        return 0
