"""Shared-memory transport for workers on one host: the sender writes into the receiver's blocks.

The receiver's cache lives in a ``SharedKVPool``; its ``PeerInfo`` names the files. The sender maps
them once per receiver and, per chunk, copies its blocks straight into the reserved destination
blocks (one copy). The chunk's control message then says which layers landed; with checksums on,
the receiver verifies the destination blocks against the sender's crc32 of its source blocks.
"""

from __future__ import annotations

from typing import Any

import torch
import zmq

from pdfabric.kvtransfer.frames import copy_blocks, crc32_blocks, torch_dtype
from pdfabric.kvtransfer.messages import KVChunk, PeerInfo
from pdfabric.kvtransfer.shm_pool import map_caches
from pdfabric.kvtransfer.transport import Incoming, Outgoing


class ShmSendPath:
    def __init__(self, info: PeerInfo) -> None:
        lay = info.layout
        if len(info.shm_paths) != lay.num_layers:
            raise ValueError(
                f"receiver announced {len(info.shm_paths)} shared files for {lay.num_layers} layers"
            )
        shape = (2, info.num_blocks, lay.block_size, lay.kv_heads, lay.head_dim)
        self.remote = map_caches(info.shm_paths, shape, torch_dtype(lay.dtype))

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
            copy_blocks(caches[layer], src_blocks, self.remote[layer], dst_blocks)
            out.nbytes += 2 * len(src_blocks) * caches[layer][0, 0].numel() * caches[layer].element_size()
            if checksum:
                sums += [crc32_blocks(caches[layer], kv, src_blocks) for kv in (0, 1)]
        out.checksums = tuple(sums)
        return out

    def close(self) -> None:
        self.remote = []


class ShmRecvPath:
    def __init__(self, shm_paths: tuple[str, ...]) -> None:
        if not shm_paths:
            raise ValueError("the shm transport needs the receiver's cache in a SharedKVPool (shm_paths)")
        self.shm_paths = shm_paths

    def info(self) -> dict[str, Any]:
        return {"shm_paths": self.shm_paths}

    def begin(self, chunk: KVChunk, frames: list[zmq.Frame], caches: list[torch.Tensor]) -> Incoming | str:
        if frames:
            return f"shm chunk carries {len(frames)} unexpected tensor frames"

        def finish() -> str:
            if chunk.checksums:
                for j, layer in enumerate(range(chunk.layer_start, chunk.layer_end)):
                    for kv in (0, 1):
                        if crc32_blocks(caches[layer], kv, chunk.blocks) != chunk.checksums[2 * j + kv]:
                            return f"checksum mismatch in layer {layer} {'values' if kv else 'keys'}"
            return ""

        return Incoming(chunk, chunk.frame_nbytes * chunk.num_frames, finish)

    def close(self) -> None:
        pass
