"""Fuzzing ``POST /rpc`` and ``GET /events`` of a real ``tether serve`` (issue 10, item 3).

Request bodies are generated from the RPC schemas themselves (``tether.wire.rpc.METHODS``
read with ``msgspec.inspect``): valid calls, near-valid ones (one field wrong, missing,
out of range or unknown) and hostile ones (random bytes, random JSON, broken envelopes,
deep nesting, odd numbers and strings). ``Last-Event-ID`` gets arbitrary header bytes.
The server must answer every one with its typed error (never a 500, never ``internal``)
and stay up: a plain call still works after each test.
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from typing import Any

import msgspec.inspect as mi
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from drivers import SCRIPTED, eventually
from tether.wire.rpc import MAX_DEPTH, METHODS, RPC_ERROR_CODES
from tether_server import LiveServer, settle

pytestmark = pytest.mark.unit  # starts no process: make test-unit

FUZZ = settings(
    max_examples=150,
    deadline=None,
    database=None,  # nothing written to the work tree; failures print their example
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture
def live(shared: LiveServer) -> Iterator[tuple[LiveServer, list[str]]]:
    """The module's server with a root and a continuable child of the test's own; the ids
    fuzzed calls may name. What the calls left running is aborted after the test."""
    server = shared
    root = server.call("session.open", {"driver": SCRIPTED, "slug": "root"})["session"]
    child = server.call("subagent.spawn", {"parent": root, "driver": SCRIPTED})["session"]
    yield server, [root, child, "s_nobody"]
    assert server.call("subagent.status", {"session": root})["id"] == root  # still up
    assert server.request("GET", "/health") == (200, b'{"ok":true}')
    settle(server)


# ---- strategies from the schemas ---------------------------------------------------------

ODD_TEXT = st.sampled_from(
    ["", "\x00", "a" * 3000, "<steer>&\"'", "\u202e", "\n\r\t", "é" * 300, "\U0001f600"]
)
# Escaped lone surrogates: msgspec refuses them as a parse error (-32700), so they are
# hostile input, kept out of the calls that must reach the schema.
SURROGATES = st.sampled_from(["\ud800", "\udfff", "a\udc80b"])
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
    | ODD_TEXT
)
JSON = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
IDS = {"session", "parent", "root"}


def _value(t: mi.Type, name: str, ids: list[str]) -> st.SearchStrategy[Any]:
    """Values that satisfy ``t`` (a msgspec type), ids drawn mostly from real sessions."""
    if isinstance(t, mi.StrType):
        if name in IDS:
            return st.sampled_from(ids)
        if name == "driver":
            return st.sampled_from([SCRIPTED, "tether:Nope", "x"])
        return st.text(min_size=t.min_length or 0, max_size=min(t.max_length or 40, 40))
    if isinstance(t, mi.IntType):
        low = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else -(2**40))
        return st.integers(low, t.le if t.le is not None else 2**63 - 1)
    if isinstance(t, mi.FloatType):
        floor = t.ge if t.ge is not None else (t.gt if t.gt is not None else -1e6)
        return st.floats(floor, 30.0, exclude_min=t.gt is not None, allow_nan=False)
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.LiteralType):
        return st.sampled_from(t.values)
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, mi.UnionType):
        return st.one_of(*(_value(u, name, ids) for u in t.types))
    if isinstance(t, mi.DictType):
        values = JSON if isinstance(t.value_type, mi.AnyType) else st.text(max_size=10)
        return st.dictionaries(st.text(max_size=8), values, max_size=3)
    if isinstance(t, mi.StructType):
        return _params(t, ids)
    return JSON


def _params(t: mi.StructType, ids: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    required = {f.encode_name: _value(f.type, f.name, ids) for f in t.fields if f.required}
    optional = {f.encode_name: _value(f.type, f.name, ids) for f in t.fields if not f.required}
    return st.fixed_dictionaries(required, optional=optional)


def _wrong(t: mi.Type) -> st.SearchStrategy[Any]:
    """Values that ``t`` refuses: another JSON type, or out of its range."""
    if isinstance(t, mi.UnionType):
        members = t.types
        return st.one_of(*(_wrong(u) for u in members)).filter(
            lambda v: not any(_fits(v, u) for u in members)
        )
    out: list[st.SearchStrategy[Any]] = [st.lists(st.integers(), max_size=2)]
    if isinstance(t, mi.StrType):
        out += [st.integers(), st.booleans(), st.dictionaries(st.text(max_size=3), st.none())]
        if t.min_length:
            out.append(st.just(""))
        if t.max_length:
            out.append(st.just("x" * (t.max_length + 1)))
    elif isinstance(t, mi.IntType):
        out += [st.text(max_size=3), st.floats(0.5, 9.5), st.booleans()]
        if t.ge is not None:
            out.append(st.integers(-(2**40), t.ge - 1))
        if t.le is not None:
            out.append(st.integers(t.le + 1, t.le + 2**40))
    elif isinstance(t, mi.FloatType):
        out += [st.text(max_size=3), st.booleans()]
        if t.ge is not None:
            out.append(st.floats(-1e6, t.ge, exclude_max=True))
        if t.gt is not None:
            out.append(st.floats(-1e6, t.gt))
    elif isinstance(t, mi.BoolType):
        out += [st.integers(), st.text(max_size=3)]
    elif isinstance(t, mi.LiteralType):
        out += [st.text(max_size=12).filter(lambda s: s not in t.values), st.integers()]
    elif isinstance(t, mi.DictType | mi.StructType):
        out += [st.integers(), st.text(max_size=3)]
        if isinstance(t, mi.DictType) and isinstance(t.value_type, mi.StrType):
            out.append(st.dictionaries(st.text(max_size=3), st.integers(), min_size=1, max_size=2))
    elif isinstance(t, mi.NoneType):
        out += [st.integers(), st.text(max_size=3)]
    return st.one_of(*out)


def _fits(v: Any, t: mi.Type) -> bool:
    """Whether ``v`` would pass ``t`` (only for the values ``_wrong`` makes)."""
    if isinstance(t, mi.NoneType):
        return v is None
    if isinstance(t, mi.StrType):
        n = len(v) if isinstance(v, str) else -1
        return n >= (t.min_length or 0) and (t.max_length is None or n <= t.max_length)
    if isinstance(t, mi.FloatType):
        if isinstance(v, bool) or not isinstance(v, int | float):
            return False
        return (t.ge is None or v >= t.ge) and (t.gt is None or v > t.gt)
    if isinstance(t, mi.DictType):
        return isinstance(v, dict) and (
            not isinstance(t.value_type, mi.StrType) or all(isinstance(x, str) for x in v.values())
        )
    return False


@st.composite
def near_valid(draw: st.DrawFn, ids: list[str]) -> tuple[str, dict[str, Any]]:
    """A call with one thing wrong in its params: the schema must refuse it."""
    method = draw(st.sampled_from(sorted(METHODS)))
    info = mi.type_info(METHODS[method])
    assert isinstance(info, mi.StructType)
    params = dict(draw(_params(info, ids)))
    fields = {f.encode_name: f for f in info.fields}
    required = [f for f in info.fields if f.required]
    hows = ["unknown", "wrong", "missing"] if required else ["unknown", "wrong"]
    how = draw(st.sampled_from(hows))
    if how == "unknown":
        params[draw(st.text(min_size=1, max_size=8).filter(lambda k: k not in fields))] = 1
    elif how == "missing":
        del params[draw(st.sampled_from(required)).encode_name]
    else:
        field = draw(st.sampled_from(info.fields))
        if isinstance(field.type, mi.StructType) and draw(st.booleans()):
            inner = dict(draw(_params(field.type, ids)))
            sub = draw(st.sampled_from(field.type.fields))
            inner[sub.encode_name] = draw(_wrong(sub.type))
            params[field.encode_name] = inner
        else:
            params[field.encode_name] = draw(_wrong(field.type))
    return method, params


def _envelope(method: str, params: Any, rid: Any = 1) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rid, "method": method, "params": params}


HOSTILE_DOCS = st.one_of(
    JSON,  # any JSON value as the whole document
    st.builds(  # a lone surrogate in an otherwise good call
        lambda m, s: _envelope(m, {"session": s, "content": s, "address": {"session": s}}),
        st.sampled_from(sorted(METHODS)),
        SURROGATES,
    ),
    st.fixed_dictionaries(  # a broken envelope
        {},
        optional={
            "jsonrpc": st.sampled_from(["2.0", "1.0", 2, None]),
            "id": JSON,
            "method": st.sampled_from(sorted(METHODS)) | JSON,
            "params": JSON,
        },
    ),
    st.lists(JSON, min_size=0, max_size=3) | st.just([1] * 101),  # batches of odd things
)


# ---- the checks ----------------------------------------------------------------------------


def _post(server: LiveServer, body: bytes) -> tuple[int, Any]:
    status, raw = server.request("POST", "/rpc", body, timeout=20.0)
    assert status in (200, 204, 413), (status, raw[:300])
    return status, json.loads(raw) if raw else None


def _typed(answer: Any) -> list[dict[str, Any]]:
    """Every response object is JSON-RPC 2.0 with a result or a typed, non-internal error."""
    answers = answer if isinstance(answer, list) else [answer]
    assert answers, answer
    for a in answers:
        assert a["jsonrpc"] == "2.0" and "id" in a, a
        if "error" in a:
            err = a["error"]
            assert isinstance(err["code"], int) and isinstance(err["message"], str), a
            assert err["data"]["code"] in RPC_ERROR_CODES, a
            assert err["data"]["code"] != "internal", a  # a bad input is never a crash
        else:
            assert "result" in a, a
    return answers


@pytest.mark.timeout(120)
def test_valid_calls_from_the_schemas_get_a_result_or_a_typed_refusal(
    live: tuple[LiveServer, list[str]],
) -> None:
    server, ids = live
    calls = st.sampled_from(sorted(METHODS)).flatmap(
        lambda m: st.tuples(st.just(m), _params(_struct(m), ids))
    )

    @FUZZ
    @given(call=calls)
    def check(call: tuple[str, dict[str, Any]]) -> None:
        method, params = call
        status, answer = _post(server, json.dumps(_envelope(method, params)).encode())
        assert status == 200
        (a,) = _typed(answer)
        if "error" in a:  # the schema passed: what is left is the runtime's word
            assert a["error"]["code"] in (-32602, -32000), a

    check()


def _struct(method: str) -> mi.StructType:
    info = mi.type_info(METHODS[method])
    assert isinstance(info, mi.StructType)
    return info


@pytest.mark.timeout(120)
def test_near_valid_calls_are_invalid_params(live: tuple[LiveServer, list[str]]) -> None:
    server, ids = live

    @settings(FUZZ, max_examples=200)
    @given(call=near_valid(ids))
    def check(call: tuple[str, dict[str, Any]]) -> None:
        method, params = call
        _, answer = _post(server, json.dumps(_envelope(method, params)).encode())
        (a,) = _typed(answer)
        assert (a["error"]["code"], a["error"]["data"]["code"]) == (-32602, "invalid-params"), (
            method,
            params,
            a,
        )

    check()


@pytest.mark.timeout(120)
def test_hostile_bodies_get_typed_errors_and_the_server_stays_up(
    live: tuple[LiveServer, list[str]],
) -> None:
    server, _ = live

    @settings(FUZZ, max_examples=200)
    @given(doc=HOSTILE_DOCS)
    def documents(doc: Any) -> None:
        status, answer = _post(server, json.dumps(doc).encode())
        if status == 204:
            assert isinstance(doc, list | dict)  # only notifications, all in order
            return
        _typed(answer)

    @settings(FUZZ, max_examples=40)
    @given(
        method=st.sampled_from(sorted(METHODS)),
        depth=st.integers(MAX_DEPTH - 4, MAX_DEPTH + 2) | st.integers(MAX_DEPTH, 5000),
    )
    def deep(method: str, depth: int) -> None:
        # Written as text: nesting this deep would overflow the test's own recursion.
        data = "[" * depth + "1" + "]" * depth
        body = f'{{"jsonrpc":"2.0","id":5,"method":"{method}","params":{{"data":{data}}}}}'
        _, answer = _post(server, body.encode())
        (a,) = _typed(answer)
        too_deep = 2 + depth > MAX_DEPTH  # the request object and its params count too
        assert (a["error"]["code"] == -32600) is too_deep, (depth, a)
        assert a["error"]["data"]["code"] == "invalid-params"

    @settings(FUZZ, max_examples=100)
    @given(body=st.binary(max_size=200) | st.sampled_from([b"", b"[", b"{" * 4000, b"1e999"]))
    def raw_bytes(body: bytes) -> None:
        status, answer = _post(server, body)
        if status == 200:
            _typed(answer)

    documents()
    deep()
    raw_bytes()


@pytest.mark.timeout(60)
def test_found_by_fuzzing_integers_past_64_bits_are_invalid_params(
    live: tuple[LiveServer, list[str]],
) -> None:
    """Shrunk cases: each was an ``internal`` error (an OverflowError in the runtime's
    msgpack size check, or in SQLite's binding of ``after``)."""
    server, (root, _, _) = live
    cases = [
        ("session.open", {"driver": SCRIPTED, "config": {"": -9223372036854775809}}),
        ("session.prompt", {"session": root, "content": "x", "data": {"a": [2**64]}}),
        ("subagent.transcript", {"session": root, "after": 2**63}),
    ]
    for method, params in cases:
        _, answer = _post(server, json.dumps(_envelope(method, params)).encode())
        (a,) = _typed(answer)
        assert (a["error"]["code"], a["error"]["data"]["code"]) == (-32602, "invalid-params")
    # The edges themselves are fine.
    data = {"a": [-(2**63), 2**63 - 1]}
    server.call("session.prompt", {"session": root, "content": "x", "data": data})
    # accepted is not started: the turn is listed once the host has started it
    turns = eventually(
        lambda: server.call("subagent.turns", {"session": root})["turns"] or None,
        what="the prompt's turn",
    )
    assert turns[0]["message"]


def _events_status(server: LiveServer, header: bytes) -> tuple[int, bytes]:
    """``GET /events`` with ``Last-Event-ID: header``; the status and the head's body."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(
            b"GET /events HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            + f"Authorization: Bearer {server.token}\r\n".encode()
            + b"Last-Event-ID: "
            + header
            + b"\r\nConnection: close\r\n\r\n"
        )
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = sock.recv(4096)
            if not chunk:
                break
            buf += chunk
        head, _, body = buf.partition(b"\r\n\r\n")
        status = int(head.split()[1])
        if status != 200:  # a refusal says why and closes
            while chunk := sock.recv(4096):
                body += chunk
        return status, body


@pytest.mark.timeout(120)
def test_last_event_id_values_are_served_or_refused_with_400(
    live: tuple[LiveServer, list[str]],
) -> None:
    server, _ = live
    values = st.one_of(
        st.integers(-(10**25), 10**25).map(lambda n: str(n).encode()),
        st.binary(max_size=40).filter(lambda b: b"\r" not in b and b"\n" not in b),
        st.text(alphabet="0123456789 +-_.eE٣", max_size=25).map(str.encode),
        st.just(b"9" * 5000),
    )

    @settings(FUZZ, max_examples=150)
    @given(value=values)
    def check(value: bytes) -> None:
        status, body = _events_status(server, value)
        if status == 200:
            # Only an id (ASCII digits, at most 19), or none at all (an empty header),
            # after HTTP's own trimming.
            assert re.fullmatch(rb"[0-9]{0,19}", value.strip(b" \t")), value
        elif status == 400 and body.startswith(b"{"):
            assert "error" in json.loads(body)  # ours: the id was not an id
        else:
            assert status == 400, (status, value, body[:200])  # the HTTP parser's own

    check()
