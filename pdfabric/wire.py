"""msgpack encoding for the small frozen dataclasses that travel between processes.

A message is encoded as ``[tag, field, field, ...]`` in declaration order; a field whose type is
itself a registered dataclass (or a ``tuple[...]`` of them) is encoded the same way, nested. Bulk
tensor bytes never pass through here: they travel as separate frames.

Decoding trusts nothing: a frame over ``MAX_FRAME_BYTES``, bytes that are not msgpack, an unknown tag,
a field of the wrong type (checked against the dataclass's annotations, nested messages and arrays
included; a bool is never an int), a field too many or a required one missing, or a value the
message's own ``__post_init__`` refuses is a ``WireError`` naming the field, and nothing is built.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack

T = TypeVar("T")

_BY_TAG: dict[int, type] = {}
_TAG_OF: dict[type, int] = {}
_NESTED: dict[type, dict[int, tuple[str, type]]] = {}  # class -> field index -> ("one" | "many", type)


class WireError(ValueError):
    """A frame that does not decode into a known message."""


def message(tag: int):  # noqa: ANN201 - class decorator
    """Registers a frozen dataclass under ``tag`` (unique per process-wide registry)."""

    def register(cls: type[T]) -> type[T]:
        if not (dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen):  # type: ignore[attr-defined]
            raise TypeError(f"{cls.__name__} must be a frozen dataclass")
        if tag in _BY_TAG:
            raise TypeError(f"tag {tag} is taken by {_BY_TAG[tag].__name__}")
        _BY_TAG[tag], _TAG_OF[cls] = cls, tag
        return cls

    return register


def _nested(cls: type) -> dict[int, tuple[str, type]]:
    if cls not in _NESTED:
        hints = typing.get_type_hints(cls)
        found: dict[int, tuple[str, type]] = {}
        for i, f in enumerate(dataclasses.fields(cls)):
            hint = hints[f.name]
            args = typing.get_args(hint)
            if dataclasses.is_dataclass(hint):
                found[i] = ("one", hint)
            elif typing.get_origin(hint) is tuple and args and dataclasses.is_dataclass(args[0]):
                found[i] = ("many", args[0])
        _NESTED[cls] = found
    return _NESTED[cls]


def _to_list(obj: Any) -> list[Any]:
    cls = type(obj)
    values = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    for i, (kind, _) in _nested(cls).items():
        if values[i] is not None:
            values[i] = _to_list(values[i]) if kind == "one" else [_to_list(v) for v in values[i]]
    return values


# --- decoding: every value checked against its field's type before a message is built -----------

# value -> the value to use; a WireError (saying where inside) when it does not fit
Check = Callable[[Any], Any]
_CHECKS: dict[type, list[tuple[str, Check]]] = {}


def _bad(want: str, value: Any) -> WireError:
    return WireError(f"expected {want}, got {type(value).__name__}")


def _scalar(kind: type) -> Check:
    if kind is float:

        def number(value: Any) -> float:
            if type(value) is float:
                return value
            if type(value) is int:  # msgpack keeps 2.0 and 2 apart; a float field takes either
                return float(value)
            raise _bad("float", value)

        return number

    def check(value: Any) -> Any:
        if type(value) is not kind:  # exact: a bool is no int here
            raise _bad(kind.__name__, value)
        return value

    return check


def _at(where: str, check: Check, value: Any) -> Any:
    try:
        return check(value)
    except WireError as exc:
        raise WireError(f"{where}: {exc}") from None


def _checker(hint: Any) -> Check:
    """How to check (and build) a value of type ``hint``: scalars, ``X | None``, ``tuple[X, ...]``,
    fixed tuples, ``dict[K, V]`` and nested dataclasses (sent as lists of their fields)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return lambda value: _build(hint, value)
    if origin in (typing.Union, types.UnionType):
        options = [_checker(a) for a in args if a is not type(None)]
        nullable = type(None) in args

        def union(value: Any) -> Any:
            if value is None and nullable:
                return None
            for option in options:
                try:
                    return option(value)
                except WireError:
                    continue
            raise _bad(" | ".join(getattr(a, "__name__", str(a)) for a in args), value)

        return union
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            if args[0] in (int, str, bytes, bool):  # the long arrays (token ids, block ids, hashes)
                kind = args[0]

                def many_scalars(value: Any) -> tuple:
                    # the element types as one set, at C speed (a bool's type is bool, never int)
                    if type(value) is not tuple or not set(map(type, value)) <= {kind}:
                        raise _bad(f"an array of {kind.__name__}", value)
                    return value

                return many_scalars
            item = _checker(args[0])

            def many(value: Any) -> tuple:
                if type(value) is not tuple:
                    raise _bad("an array", value)
                return tuple(_at(f"[{i}]", item, v) for i, v in enumerate(value))

            return many
        items = [_checker(a) for a in args]

        def fixed(value: Any) -> tuple:
            if type(value) is not tuple or len(value) != len(items):
                raise _bad(f"an array of {len(items)}", value)
            pairs = enumerate(zip(items, value, strict=True))
            return tuple(_at(f"[{i}]", check, v) for i, (check, v) in pairs)

        return fixed
    if origin is dict:
        key, val = _checker(args[0]), _checker(args[1])

        def mapping(value: Any) -> dict:
            if type(value) is not dict:
                raise _bad("a map", value)
            return {_at("key", key, k): _at(f"[{k!r}]", val, v) for k, v in value.items()}

        return mapping
    if hint in (int, float, str, bool, bytes):
        return _scalar(hint)
    raise TypeError(f"no wire check for {hint!r}")


def _build(cls: type[T], values: Any) -> T:
    """``cls`` from the list of its fields' values, each checked; trailing fields may be left out
    when they have defaults."""
    if cls not in _CHECKS:
        hints = typing.get_type_hints(cls)
        _CHECKS[cls] = [(f.name, _checker(hints[f.name])) for f in dataclasses.fields(cls)]
    checks = _CHECKS[cls]
    if type(values) is not tuple or len(values) > len(checks):
        raise WireError(f"{cls.__name__}: expected an array of at most {len(checks)} fields")
    args = []
    for (name, check), value in zip(checks, values, strict=False):
        try:
            args.append(check(value))
        except WireError as exc:
            raise WireError(f"{cls.__name__}.{name}: {exc}") from None
    try:
        return cls(*args)
    except (TypeError, ValueError) as exc:  # a field missing, or the class's own validation
        raise WireError(f"{cls.__name__}: {exc}") from None


def encode(msg: Any) -> bytes:
    tag = _TAG_OF.get(type(msg))
    if tag is None:
        raise TypeError(f"{type(msg).__name__} is not a registered message")
    return msgpack.packb([tag, *_to_list(msg)], use_bin_type=True)


MAX_FRAME_BYTES = 64 << 20  # a control message is small; a frame this large is refused unread


def decode(frame: bytes | memoryview) -> Any:
    """The message in ``frame``, every field checked against its type (nested ones too); a
    ``WireError`` naming what is wrong for anything else: undecodable bytes, an unknown tag, a wrong
    type, a field too many or missing."""
    if len(frame) > MAX_FRAME_BYTES:
        raise WireError(f"a {len(frame)}-byte frame (at most {MAX_FRAME_BYTES})")
    try:
        raw = msgpack.unpackb(frame, use_list=False, raw=False)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError, TypeError) as exc:
        raise WireError(f"undecodable message: {exc}") from None
    tag = raw[0] if type(raw) is tuple and raw else None
    if type(tag) is not int or tag not in _BY_TAG:  # a map is no tag (nor hashable)
        raise WireError(f"unknown message tag {tag!r}")
    cls = _BY_TAG[tag]
    return _build(cls, raw[1:])
