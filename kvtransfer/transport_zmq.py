"""ZeroMQ transport: a chunk's tensor bytes ride as raw frames after its control message.

Frames are sent with ``copy=False``: they are views of the sender's cache (blocks in one run) or of
a packed buffer, kept alive by the sender until the receiver acknowledges. The receiver reads them
zero-copy (``recv_multipart(copy=False)``) and copies them once into the reserved blocks.

libzmq allocates each received frame with ``malloc``. glibc serves blocks of 128 KiB and more with
fresh ``mmap``s and gives them back at once, so every megabyte-sized frame costs its page faults
again; the receiving process therefore asks glibc (where it is the C library) to keep up to 256 MiB
of freed memory and to serve blocks below 64 MiB from its heap, which about doubles ZeroMQ tcp's
rate for 1 MiB frames on loopback.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import zlib
from typing import Any

import torch
import zmq

from pdfabric.kvtransfer.frames import as_bytes, crc32, frame_tensor, host, pack_layer, unpack_layer
from pdfabric.kvtransfer.messages import KVChunk
from pdfabric.kvtransfer.transport import Incoming, Outgoing


class ZmqSendPath:
    def send(
        self,
        caches: list[torch.Tensor],
        src_blocks: tuple[int, ...],
        dst_blocks: tuple[int, ...],
        layers: range,
        checksum: bool,
    ) -> Outgoing:
        out = Outgoing()
        sums: list[int] = []
        for layer in layers:
            for t in pack_layer(caches[layer], src_blocks):  # keys, values: [n, block_size, H, D]
                t = host(t)  # a GPU cache's frames are copied to host memory first
                out.keepalive.append(t)
                out.frames.append(as_bytes(t))
                out.nbytes += t.numel() * t.element_size()
                if checksum:
                    sums.append(crc32(t))
        out.checksums = tuple(sums)
        return out

    def close(self) -> None:
        pass


log = logging.getLogger(__name__)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
_KEPT = False


def keep_freed_memory() -> None:
    """Makes glibc reuse freed frame memory instead of mapping it afresh (once per process; a no-op
    with another C library)."""
    global _KEPT
    if _KEPT:
        return
    _KEPT = True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = getattr(libc, "mallopt", None)
    except OSError:
        mallopt = None
    if mallopt is None or not hasattr(libc, "gnu_get_libc_version"):
        return
    if not (mallopt(_M_MMAP_THRESHOLD, 64 << 20) and mallopt(_M_TRIM_THRESHOLD, 256 << 20)):
        log.debug("mallopt refused; ZeroMQ frames keep their page faults")


class ZmqRecvPath:
    def __init__(self) -> None:
        keep_freed_memory()

    def info(self) -> dict[str, Any]:
        return {}

    def begin(self, chunk: KVChunk, frames: list[zmq.Frame], caches: list[torch.Tensor]) -> Incoming | str:
        if len(frames) != chunk.num_frames:
            return f"expected {chunk.num_frames} tensor frames, got {len(frames)}"
        bufs = [f.buffer for f in frames]
        for i, buf in enumerate(bufs):
            if len(buf) != chunk.frame_nbytes:
                return f"frame {i} is {len(buf)} bytes, expected {chunk.frame_nbytes} (truncated)"

        def finish() -> str:
            if chunk.checksums:
                for i, buf in enumerate(bufs):
                    if zlib.crc32(buf) != chunk.checksums[i]:
                        return f"checksum mismatch in frame {i} (layer {chunk.layer_start + i // 2})"
            cache0 = caches[0]
            shape = (len(chunk.blocks), *cache0.shape[2:])
            for j, layer in enumerate(range(chunk.layer_start, chunk.layer_end)):
                keys = frame_tensor(bufs[2 * j], cache0.dtype, shape)
                values = frame_tensor(bufs[2 * j + 1], cache0.dtype, shape)
                unpack_layer(caches[layer], chunk.blocks, keys, values)
            return ""

        return Incoming(chunk, chunk.frame_nbytes * chunk.num_frames, finish)

    def close(self) -> None:
        pass
