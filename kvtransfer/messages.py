"""The KV channel's messages (prefill sender <-> decode receiver); no torch here.

They are registered with the one codec every socket speaks (``pdfabric.wire``: ``wire.encode`` and
``wire.decode``, every field checked on arrival), under tags of their own. One ZeroMQ message is one
encoded message, followed, for a ``KVChunk`` sent over the ZeroMQ transport, by its raw tensor frames
(two per layer: keys then values, each ``[n, block_size, kv_heads, head_dim]`` in the cache's dtype).
Tensor bytes never go through msgpack.

sender -> receiver: ``Hello`` (once per connection), ``KVChunk`` (one per layer range), ``KVAbort``.
(``KVChunk`` and ``KVAbort``, so that they are never taken for the scheduler's ``Chunk``, a piece of a
step, or the control channel's ``Abort``, which ends a request on a worker.)
receiver -> sender: ``PeerInfo`` (answers ``Hello``), ``Ack`` (transfer DONE or FAILED), ``KVAbort``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdfabric.wire import message

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


@message(40)
@dataclass(frozen=True)
class Hello:
    sender: str  # a name for logs and reasons


@message(41)
@dataclass(frozen=True)
class PeerInfo:
    transport: str  # "zmq", "shm" or "dist"
    layout: KVLayout
    num_blocks: int
    shm_paths: tuple[str, ...] = ()  # shm: one file per layer holding that layer's cache tensor
    rank: int = -1  # dist: the receiver's rank in the process group
    host: str = ""  # the receiver's host identity (``transport.host_id``): shm only where it is ours
    name: str = ""  # the receiver's name (a decode worker's id), for reasons


@message(42)
@dataclass(frozen=True)
class KVChunk:
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


@message(43)
@dataclass(frozen=True)
class Ack:
    request_id: str
    ok: bool
    reason: str = ""


@message(44)
@dataclass(frozen=True)
class KVAbort:
    request_id: str
    reason: str


Message = Hello | PeerInfo | KVChunk | Ack | KVAbort
