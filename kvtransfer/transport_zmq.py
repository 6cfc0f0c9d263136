"""ZeroMQ transport: a chunk's tensor bytes ride as raw frames after its control message.

Frames are sent with ``copy=False``: they are views of the sender's cache (blocks in one run) or of
a packed buffer, kept alive by the sender until the receiver acknowledges. The receiver reads them
zero-copy (``recv_multipart(copy=False)``) and copies them once into the reserved blocks.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
import zmq

from pdfabric.kvtransfer.frames import as_bytes, crc32, frame_tensor, host, pack_layer, unpack_layer
from pdfabric.kvtransfer.messages import Chunk
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


class ZmqRecvPath:
    def info(self) -> dict[str, Any]:
        return {}

    def begin(self, chunk: Chunk, frames: list[zmq.Frame], caches: list[torch.Tensor]) -> Incoming | str:
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
