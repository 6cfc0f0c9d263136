"""The one small interface every transport implements, on each side, and how a sender picks one.

The sender and receiver state machines (``sender.py``, ``receiver.py``) own the ZeroMQ control
channel, the transfer records, the checks and the deadlines. A transport only moves the bytes of one
``KVChunk`` (layers ``[l0, l1)`` of one request):

- ``SendPath.send(...)`` starts moving them and returns an ``Outgoing``: frames to append to the
  chunk's control message (ZeroMQ only), tensors to keep alive, and a ``done()`` test;
- ``RecvPath.begin(...)`` receives them (or a reason they are unacceptable) as an ``Incoming`` that
  is polled with ``done()`` and then ``finish()``-ed: checked and written into the reserved blocks.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import zmq

from pdfabric.kvtransfer.messages import KVChunk, PeerInfo


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
    chunk: KVChunk
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

    def begin(
        self, chunk: KVChunk, frames: list[zmq.Frame], caches: list[torch.Tensor]
    ) -> Incoming | str: ...

    def close(self) -> None: ...


def host_id() -> str:
    """This machine's identity for choosing shared memory: host name and boot id (containers on two
    machines can share a host name, not a boot)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def dist_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def choose_transport(
    wanted: str, info: PeerInfo, caches: list[torch.Tensor], dist_allowed: bool = True
) -> str:
    """The transport a sender set to ``wanted`` uses towards the receiver that sent ``info``
    (``dist`` under ``auto`` only if ``dist_allowed``: ``TransferConfig.dist_allowed``)."""
    if wanted != "auto":
        return wanted
    if info.transport != "auto":
        return info.transport
    if dist_allowed and info.rank >= 0 and caches[0].device.type == "cuda" and dist_ready():
        return "dist"
    if info.shm_paths and info.host == host_id():
        return "shm"
    return "zmq"
