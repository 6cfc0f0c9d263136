"""msgpack encoding for the small frozen dataclasses that travel between processes.

A message is encoded as ``[tag, field, field, ...]`` in declaration order; a field whose type is
itself a registered dataclass (or a ``tuple[...]`` of them) is encoded the same way, nested. Bulk
tensor bytes never pass through here: they travel as separate frames.
"""

from __future__ import annotations

import dataclasses
import typing
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


def _from_list(cls: type[T], values: Any) -> T:
    values = list(values)
    for i, (kind, sub) in _nested(cls).items():
        if i < len(values) and values[i] is not None:
            values[i] = (
                _from_list(sub, values[i]) if kind == "one" else tuple(_from_list(sub, v) for v in values[i])
            )
    return cls(*values)


def encode(msg: Any) -> bytes:
    tag = _TAG_OF.get(type(msg))
    if tag is None:
        raise TypeError(f"{type(msg).__name__} is not a registered message")
    return msgpack.packb([tag, *_to_list(msg)], use_bin_type=True)


def decode(frame: bytes | memoryview) -> Any:
    try:
        raw = msgpack.unpackb(frame, use_list=False, raw=False)
        cls = _BY_TAG[raw[0]]
        return _from_list(cls, raw[1:])
    except (msgpack.ExtraData, msgpack.FormatError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise WireError(f"undecodable message: {exc}") from None
