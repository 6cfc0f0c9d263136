"""The KV channel's messages (prefill sender <-> decode receiver), encoded with msgpack; no torch here.

One ZeroMQ message is one msgpack-encoded control message, followed, for a ``Chunk`` sent over the
ZeroMQ transport, by its raw tensor frames (two per layer: keys then values, each
``[n, block_size, kv_heads, head_dim]`` in the cache's dtype). Tensor bytes never go through msgpack.

sender -> receiver: ``Hello`` (once per connection), ``Chunk`` (one per layer range), ``Abort``.
receiver -> sender: ``PeerInfo`` (answers ``Hello``), ``Ack`` (transfer DONE or FAILED), ``Abort``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack

# What rides along with a transfer (the first token and its log-probabilities): msgpack-able values.
Meta = dict[str, int | float | str | tuple[tuple[int, float], ...]]


@dataclass(frozen=True)
class KVLayout:
    """What both sides must agree on: one cache tensor per layer, ``[2, blocks, block_size, H, D]``."""

    num_layers: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    itemsize: int
    tiled: bool = False  # blocks tiled for the CPU prompt kernel (AttentionMetadata.tiled_kv), not dense

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "kv_heads", "head_dim", "itemsize"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be positive, got {getattr(self, name)}")

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's keys (or values) in one layer."""
        return self.block_size * self.kv_heads * self.head_dim * self.itemsize

    def transfer_bytes(self, num_blocks: int) -> int:
        """Bytes moved for ``num_blocks`` blocks over all layers, keys and values."""
        return 2 * self.num_layers * num_blocks * self.block_bytes


@dataclass(frozen=True)
class Hello:
    sender: str  # a name for logs and reasons


@dataclass(frozen=True)
class PeerInfo:
    transport: str  # "zmq", "shm" or "dist"
    layout: KVLayout
    num_blocks: int
    shm_paths: tuple[str, ...] = ()  # shm: one file per layer holding that layer's cache tensor
    rank: int = -1  # dist: the receiver's rank in the process group
    host: str = ""  # the receiver's host identity (``transport.host_id``): shm only where it is ours
    name: str = ""  # the receiver's name (a decode worker's id), for reasons


@dataclass(frozen=True)
class Chunk:
    """Layers ``[layer_start, layer_end)`` of one request, for destination ``blocks``."""

    request_id: str
    seq: int  # 0, 1, ... per request; the receiver rejects gaps and repeats
    layer_start: int
    layer_end: int
    blocks: tuple[int, ...]
    dtype: str
    frame_nbytes: int  # bytes of each of the 2 * (layer_end - layer_start) frames
    checksums: tuple[int, ...] = ()  # crc32 per frame when enabled
    tag: int = -1  # dist: tag of the first frame's isend; frame i uses tag + i
    src_rank: int = -1  # dist: the sender's rank
    meta: Meta = field(default_factory=dict)
    transport: str = ""  # how the tensor bytes moved ("": the receiver's own transport)

    @property
    def num_frames(self) -> int:
        return 2 * (self.layer_end - self.layer_start)


@dataclass(frozen=True)
class Ack:
    request_id: str
    ok: bool
    reason: str = ""


@dataclass(frozen=True)
class Abort:
    request_id: str
    reason: str


Message = Hello | PeerInfo | Chunk | Ack | Abort
_KINDS: dict[str, type] = {cls.__name__: cls for cls in (Hello, PeerInfo, Chunk, Ack, Abort)}
_TUPLES = {"blocks", "checksums", "shm_paths"}


def _fields(obj: Any) -> dict[str, Any]:
    """Shallow field dict (``dataclasses.asdict`` deep-copies every block id: too slow per chunk)."""
    return {
        f.name: _fields(v) if isinstance(v := getattr(obj, f.name), KVLayout) else v
        for f in dataclasses.fields(obj)
    }


def encode(msg: Message) -> bytes:
    return msgpack.packb([type(msg).__name__, _fields(msg)], use_bin_type=True)


def decode(raw: bytes | memoryview) -> Message:
    """Parses one control message; ``ValueError`` naming what is wrong for anything malformed."""
    try:
        kind, body = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise ValueError(f"undecodable control message: {exc}") from None
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None or not isinstance(body, dict):
        raise ValueError(f"unknown control message kind {kind!r}")
    return _build(cls, body)


def _build(cls: type, body: dict[str, Any]) -> Any:
    names, tests = _spec(cls)
    unknown = body.keys() - names
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown fields {sorted(unknown)}")
    kwargs: dict[str, Any] = {}
    for name, value in body.items():
        if name == "layout":
            value = _build(KVLayout, value) if isinstance(value, dict) else value
        elif name in _TUPLES and isinstance(value, list):
            value = tuple(value)
        kwargs[name] = value
    try:
        msg = cls(**kwargs)
    except TypeError as exc:
        raise ValueError(f"{cls.__name__}: {exc}") from None
    for name, test in tests:
        value = getattr(msg, name)
        if not test(value):
            raise ValueError(f"{cls.__name__}.{name}: bad value {value!r}")
    return msg


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _ints(v: Any) -> bool:  # one set of element types at C speed: a chunk carries hundreds of block ids
    return isinstance(v, tuple) and set(map(type, v)) <= {int, bool}


def _strs(v: Any) -> bool:
    return isinstance(v, tuple) and set(map(type, v)) <= {str}


_TYPE_TESTS: dict[str, Callable[[Any], bool]] = {
    "str": lambda v: isinstance(v, str),
    "int": _is_int,
    "bool": lambda v: isinstance(v, bool),
    "KVLayout": lambda v: isinstance(v, KVLayout),
    "Meta": lambda v: isinstance(v, dict),
    "tuple[int, ...]": _ints,
    "tuple[str, ...]": _strs,
}


@functools.cache
def _spec(cls: type) -> tuple[frozenset[str], tuple[tuple[str, Callable[[Any], bool]], ...]]:
    """``cls``'s field names and a type test per field whose annotation names one (found once)."""
    fields = dataclasses.fields(cls)
    tests = tuple((f.name, _TYPE_TESTS[str(f.type)]) for f in fields if str(f.type) in _TYPE_TESTS)
    return frozenset(f.name for f in fields), tests
