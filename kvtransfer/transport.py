"""The one small interface every transport implements, on each side, and the factory that picks one.

The sender and receiver state machines (``sender.py``, ``receiver.py``) own the ZeroMQ control
channel, the transfer records, the checks and the deadlines. A transport only moves the bytes of one
``Chunk`` (layers ``[l0, l1)`` of one request):

- ``SendPath.send(...)`` starts moving them and returns an ``Outgoing``: frames to append to the
  chunk's control message (ZeroMQ only), tensors to keep alive, and a ``done()`` test;
- ``RecvPath.begin(...)`` receives them (or a reason they are unacceptable) as an ``Incoming`` that
  is polled with ``done()`` and then ``finish()``-ed: checked and written into the reserved blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import zmq

from pdfabric.kvtransfer.messages import Chunk, PeerInfo


@dataclass
class Outgoing:
    frames: list[memoryview] = field(default_factory=list)
    keepalive: list[torch.Tensor] = field(default_factory=list)
    checksums: tuple[int, ...] = ()
    tag: int = -1
    src_rank: int = -1
    works: list[Any] = field(default_factory=list)  # torch.distributed Work handles
    nbytes: int = 0

    def done(self) -> bool:
        return all(w.is_completed() for w in self.works)


@dataclass
class Incoming:
    chunk: Chunk
    nbytes: int
    finish: Callable[[], str]  # checks and writes into the cache; returns a reason or ""
    works: list[Any] = field(default_factory=list)

    def done(self) -> bool:
        return all(w.is_completed() for w in self.works)


class SendPath(Protocol):
    def send(
        self,
        caches: list[torch.Tensor],
        src_blocks: tuple[int, ...],
        dst_blocks: tuple[int, ...],
        layers: range,
        checksum: bool,
    ) -> Outgoing: ...

    def close(self) -> None: ...


class RecvPath(Protocol):
    def info(self) -> dict[str, Any]: ...  # extra PeerInfo fields (shm paths, rank)

    def begin(self, chunk: Chunk, frames: list[zmq.Frame], caches: list[torch.Tensor]) -> Incoming | str: ...

    def close(self) -> None: ...


def make_send_path(info: PeerInfo, caches: list[torch.Tensor]) -> SendPath:
    """The sender's half of the transport the receiver announced in ``info``."""
    if info.transport == "zmq":
        from pdfabric.kvtransfer.transport_zmq import ZmqSendPath

        return ZmqSendPath()
    if info.transport == "shm":
        from pdfabric.kvtransfer.transport_shm import ShmSendPath

        return ShmSendPath(info)
    if info.transport == "dist":
        from pdfabric.kvtransfer.transport_dist import DistSendPath

        return DistSendPath(info)
    raise ValueError(f"receiver announced unknown transport {info.transport!r}")


def make_recv_path(transport: str, shm_paths: tuple[str, ...] = ()) -> RecvPath:
    """The receiver's half; ``shm`` needs the files backing the receiver's cache (``SharedKVPool``)."""
    if transport == "zmq":
        from pdfabric.kvtransfer.transport_zmq import ZmqRecvPath

        return ZmqRecvPath()
    if transport == "shm":
        from pdfabric.kvtransfer.transport_shm import ShmRecvPath

        return ShmRecvPath(shm_paths)
    if transport == "dist":
        from pdfabric.kvtransfer.transport_dist import DistRecvPath

        return DistRecvPath()
    raise ValueError(f"unknown transport {transport!r}")
