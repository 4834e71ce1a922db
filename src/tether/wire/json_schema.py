"""A JSON value checked against a tool's JSON Schema: an approval's edited arguments
(semantics §17.2) are refused before anything changes when the tool would refuse them.

The keywords tools' schemas use (``type``, ``properties``, ``required``,
``additionalProperties``, ``items``, ``enum``, ``const``, the length, size and range
bounds, ``anyOf``/``oneOf``/``allOf``, local ``$ref``s); a keyword it does not know
constrains nothing. No dependency: the host checks an edit without a schema library.
"""

from __future__ import annotations

from typing import Any

__all__ = ["schema_errors"]

_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "boolean": (bool,),
    "null": (type(None),),
}
_DEPTH = 64


def schema_errors(value: Any, schema: dict[str, Any]) -> list[str]:
    """What is wrong with ``value`` under ``schema``, one line each (empty: it fits)."""
    out: list[str] = []
    _check(value, schema, schema, "arguments", out, 0)
    return out


def _is(value: Any, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, _TYPES.get(kind, (object,)))


def _resolve(ref: str, root: dict[str, Any]) -> dict[str, Any] | None:
    if not ref.startswith("#/"):
        return None
    node: Any = root
    for part in ref[2:].split("/"):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node if isinstance(node, dict) else None


def _check(
    value: Any, schema: Any, root: dict[str, Any], at: str, out: list[str], depth: int
) -> None:
    if not isinstance(schema, dict) or depth > _DEPTH:
        return
    ref = schema.get("$ref")
    if isinstance(ref, str):
        target = _resolve(ref, root)
        if target is not None:
            _check(value, target, root, at, out, depth + 1)
    kind = schema.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        if not any(_is(value, k) for k in kinds):
            out.append(f"{at}: expected {' or '.join(map(str, kinds))}")
            return
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{at}: must be one of {schema['enum']}")
    if "const" in schema and value != schema["const"]:
        out.append(f"{at}: must be {schema['const']!r}")
    _bounds(value, schema, at, out)
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            fits = [o for o in options if not _sub(value, o, root, at, depth)]
            if not fits:
                out.append(f"{at}: matches none of its {key} options")
    for option in schema.get("allOf") or ():
        _check(value, option, root, at, out, depth + 1)
    if isinstance(value, dict):
        _object(value, schema, root, at, out, depth)
    elif isinstance(value, list):
        items = schema.get("items")
        if isinstance(items, dict):
            for i, item in enumerate(value):
                _check(item, items, root, f"{at}[{i}]", out, depth + 1)


def _sub(value: Any, schema: Any, root: dict[str, Any], at: str, depth: int) -> list[str]:
    found: list[str] = []
    _check(value, schema, root, at, found, depth + 1)
    return found


def _object(
    value: dict[str, Any],
    schema: dict[str, Any],
    root: dict[str, Any],
    at: str,
    out: list[str],
    depth: int,
) -> None:
    props = schema.get("properties") or {}
    for name in schema.get("required") or ():
        if name not in value:
            out.append(f"{at}: {name!r} is required")
    extra = schema.get("additionalProperties", True)
    for name, item in value.items():
        if name in props:
            _check(item, props[name], root, f"{at}.{name}", out, depth + 1)
        elif extra is False:
            out.append(f"{at}: unknown property {name!r}")
        elif isinstance(extra, dict):
            _check(item, extra, root, f"{at}.{name}", out, depth + 1)


def _bounds(value: Any, schema: dict[str, Any], at: str, out: list[str]) -> None:
    if isinstance(value, str | list | dict):
        n = len(value)
        low = schema.get("minLength" if isinstance(value, str) else "minItems")
        high = schema.get("maxLength" if isinstance(value, str) else "maxItems")
        if isinstance(value, dict):
            low, high = schema.get("minProperties"), schema.get("maxProperties")
        if isinstance(low, int) and n < low:
            out.append(f"{at}: at least {low} long")
        if isinstance(high, int) and n > high:
            out.append(f"{at}: at most {high} long")
    elif _is(value, "number"):
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            bound: Any = schema.get(key)
            if _is(bound, "number") and _beyond(key, value, bound):
                out.append(f"{at}: {key} {bound}")


def _beyond(key: str, value: float, bound: float) -> bool:
    match key:
        case "minimum":
            return value < bound
        case "maximum":
            return value > bound
        case "exclusiveMinimum":
            return value <= bound
        case _:
            return value >= bound
