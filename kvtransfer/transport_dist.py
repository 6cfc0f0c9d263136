"""torch.distributed point-to-point transport (gloo on CPU, NCCL on GPUs); ZeroMQ carries control.

The caller initialises the process group (both workers in it). Per chunk the sender posts one
``isend`` per frame (keys, values per layer; tags ``tag .. tag + frames - 1``) and then sends the
chunk's control message; the receiver, having checked the message, posts the matching ``irecv``s
into a staging buffer, polls them, then checks and writes the frames into the reserved blocks.

gloo's point-to-point work never reports completion to ``is_completed()``, only to ``wait()``; so
each chunk's works are waited on a daemon thread and the state machines poll that wait instead.
"""

from __future__ import annotations

import logging
import threading
import zlib
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import zmq

from pdfabric.kvtransfer.frames import as_bytes, crc32, host, pack_layer, unpack_layer
from pdfabric.kvtransfer.messages import KVChunk, PeerInfo
from pdfabric.kvtransfer.transport import Incoming, Outgoing

log = logging.getLogger(__name__)
_TAG_SPACE = 1 << 30
_WAIT_LIMIT = timedelta(seconds=120)  # a wait for a vanished peer ends here; transfers fail sooner


class _Waited:
    """The completion of a list of works, waited on a daemon thread (never holds up interpreter exit);
    polled with ``is_completed()``."""

    def __init__(self, works: list[Any]) -> None:
        self._done = threading.Event()
        threading.Thread(target=self._wait, args=(works,), name="pdfabric-kv-dist", daemon=True).start()

    def _wait(self, works: list[Any]) -> None:
        try:
            for work in works:
                work.wait(_WAIT_LIMIT)
        except RuntimeError as exc:  # peer gone or wait limit: the transfer's own deadline reports it
            log.warning("kv dist: wait ended: %s", exc)
        finally:
            self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()


def _on_wire_device(t: torch.Tensor) -> bool:
    """Whether ``t`` can be sent where it is: NCCL sends GPU tensors, gloo host tensors."""
    return (t.device.type == "cuda") == (dist.get_backend() == "nccl")


def _check_group() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("the dist transport needs torch.distributed initialised in both workers")


class DistSendPath:
    def __init__(self, info: PeerInfo) -> None:
        _check_group()
        if info.rank < 0:
            raise ValueError("receiver announced no torch.distributed rank")
        self.dst = info.rank
        self.rank = dist.get_rank()
        self._next_tag = 0

    def send(
        self,
        caches: list[torch.Tensor],
        src_blocks: tuple[int, ...],
        dst_blocks: tuple[int, ...],
        layers: range,
        checksum: bool,
    ) -> Outgoing:
        out = Outgoing(tag=self._next_tag, src_rank=self.rank)
        sums: list[int] = []
        works: list[Any] = []
        for layer in layers:
            for t in pack_layer(caches[layer], src_blocks):  # keys, values: [n, block_size, H, D]
                t = t if _on_wire_device(t) else host(t)
                flat = t.reshape(-1).view(torch.uint8)
                out.keepalive.append(flat)
                works.append(dist.isend(flat, dst=self.dst, tag=self._next_tag))
                self._next_tag = (self._next_tag + 1) % _TAG_SPACE
                out.nbytes += flat.numel()
                if checksum:
                    sums.append(crc32(t))
        out.checksums = tuple(sums)
        out.works = [_Waited(works)]
        return out

    def close(self) -> None:
        pass


class DistRecvPath:
    def __init__(self) -> None:
        _check_group()

    def info(self) -> dict[str, Any]:
        return {"rank": dist.get_rank()}

    def begin(self, chunk: KVChunk, frames: list[zmq.Frame], caches: list[torch.Tensor]) -> Incoming | str:
        if frames:
            return f"dist chunk carries {len(frames)} unexpected tensor frames"
        if chunk.src_rank < 0 or chunk.tag < 0:
            return "dist chunk names no source rank or tag"
        device = caches[0].device if _on_wire_device(caches[0]) else torch.device("cpu")
        staging = torch.empty((chunk.num_frames, chunk.frame_nbytes), dtype=torch.uint8, device=device)
        works = [
            dist.irecv(staging[i], src=chunk.src_rank, tag=(chunk.tag + i) % _TAG_SPACE)
            for i in range(chunk.num_frames)
        ]

        def finish() -> str:
            if chunk.checksums:
                for i in range(chunk.num_frames):
                    if zlib.crc32(as_bytes(host(staging[i]))) != chunk.checksums[i]:
                        return f"checksum mismatch in frame {i} (layer {chunk.layer_start + i // 2})"
            cache0 = caches[0]
            shape = (len(chunk.blocks), *cache0.shape[2:])
            for j, layer in enumerate(range(chunk.layer_start, chunk.layer_end)):
                keys = staging[2 * j].view(cache0.dtype).view(shape)
                values = staging[2 * j + 1].view(cache0.dtype).view(shape)
                unpack_layer(caches[layer], chunk.blocks, keys, values)
            return ""

        return Incoming(chunk, chunk.frame_nbytes * chunk.num_frames, finish, [_Waited(works)])

    def close(self) -> None:
        pass
