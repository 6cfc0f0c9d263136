"""Turning a request's blocks of one layer into raw frames and back, with the checks on arrival.

A layer travels as two frames, keys then values, each ``[n, block_size, kv_heads, head_dim]``: the
request's blocks in reservation order. Where the blocks are one consecutive run the frames are views
of the cache (no copy); otherwise ``gather_blocks`` packs them. On arrival each frame is checked for
size (and crc32 when enabled) and written into the reserved blocks, by a slice copy for a consecutive
run or by ``scatter_blocks`` otherwise.
"""

from __future__ import annotations

import warnings
import zlib

import torch

from pdfabric.kernels import gather_blocks, scatter_blocks
from pdfabric.kvtransfer.messages import KVLayout


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name``; ``ValueError`` for anything that is not one."""
    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def layout_of(kv_caches: list[torch.Tensor], tiled: bool = False) -> KVLayout:
    """The layout every cache tensor shares (``tiled``: their blocks are tiled, as the worker's runner
    says); ``ValueError`` if they differ or are not 5-d ``[2, ...]``."""
    if not kv_caches:
        raise ValueError("no KV cache tensors")
    first = kv_caches[0]
    for i, cache in enumerate(kv_caches):
        if cache.dim() != 5 or cache.shape[0] != 2 or not cache.is_contiguous():
            raise ValueError(
                f"layer {i}: expected contiguous [2, blocks, block_size, H, D], got {cache.shape}"
            )
        if cache.shape != first.shape or cache.dtype != first.dtype:
            raise ValueError(f"layer {i}: {cache.shape} {cache.dtype} differs from layer 0")
    _, _, block_size, heads, head_dim = first.shape
    return KVLayout(
        len(kv_caches), block_size, heads, head_dim, dtype_name(first.dtype), first.element_size(), tiled
    )


def runs(blocks: tuple[int, ...] | list[int]) -> list[tuple[int, int]]:
    """``(start, length)`` of each maximal run of consecutive ids, in order."""
    out: list[tuple[int, int]] = []
    for b in blocks:
        if out and out[-1][0] + out[-1][1] == b:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((b, 1))
    return out


def single_run(blocks: tuple[int, ...]) -> int | None:
    """The first id when ``blocks`` are consecutive ascending ids (checked at C speed), else ``None``."""
    if blocks and blocks == tuple(range(blocks[0], blocks[0] + len(blocks))):
        return blocks[0]
    return None


def block_ids(blocks: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(blocks, dtype=torch.int64, device=device)


def pack_layer(cache: torch.Tensor, blocks: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of ``blocks`` as two contiguous ``[n, block_size, H, D]`` tensors."""
    start, n = single_run(blocks), len(blocks)
    if start is not None:
        return cache[0, start : start + n], cache[1, start : start + n]  # views, no copy
    packed = gather_blocks(cache, block_ids(blocks, cache.device))  # [2, n, block_size, H, D]
    return packed[0], packed[1]


def host(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself on the CPU, else a host copy (GPU caches: frames and checksums need host bytes)."""
    return t if t.device.type == "cpu" else t.cpu()


def as_bytes(t: torch.Tensor) -> memoryview:
    """A flat byte view of a contiguous CPU tensor (zero-copy; keep ``t`` alive while it is used)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def crc32(t: torch.Tensor) -> int:
    return zlib.crc32(as_bytes(host(t)))


def crc32_blocks(cache: torch.Tensor, kv: int, blocks: tuple[int, ...]) -> int:
    """crc32 of ``cache[kv, blocks]`` as it would be packed, without packing it."""
    crc = 0
    first = single_run(blocks)
    for start, n in runs(blocks) if first is None else [(first, len(blocks))]:
        crc = zlib.crc32(as_bytes(host(cache[kv, start : start + n])), crc)
    return crc


def frame_tensor(buf: memoryview | bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A read-only view of a received frame as ``shape``; the caller checked its length."""
    with warnings.catch_warnings():  # torch warns that the buffer is not writable; it is only read
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=dtype).view(shape)


def unpack_layer(
    cache: torch.Tensor, blocks: tuple[int, ...], keys: torch.Tensor, values: torch.Tensor
) -> None:
    """Writes one layer's key and value frames into ``cache[:, blocks]``."""
    start, n = single_run(blocks), len(blocks)
    if start is not None:  # one slice copy per frame (host-to-device included)
        cache[0, start : start + n].copy_(keys)
        cache[1, start : start + n].copy_(values)
        return
    # scattered blocks: stage [2, n, block_size, H, D] on the cache's device for scatter_blocks
    packed = torch.empty((2, *keys.shape), dtype=cache.dtype, device=cache.device)
    packed[0].copy_(keys)
    packed[1].copy_(values)
    scatter_blocks(cache, block_ids(blocks, cache.device), packed)


def copy_blocks(
    src: torch.Tensor, src_blocks: tuple[int, ...], dst: torch.Tensor, dst_blocks: tuple[int, ...]
) -> None:
    """``dst[:, dst_blocks] = src[:, src_blocks]`` in one copy where both sides run together."""
    s0, d0, n = single_run(src_blocks), single_run(dst_blocks), len(src_blocks)
    if s0 is not None and d0 is not None and n == len(dst_blocks):
        dst[:, d0 : d0 + n].copy_(src[:, s0 : s0 + n])
        return
    pieces: list[tuple[int, int, int]] = []  # (src start, dst start, length)
    for s, d in zip(src_blocks, dst_blocks, strict=True):
        if pieces and pieces[-1][0] + pieces[-1][2] == s and pieces[-1][1] + pieces[-1][2] == d:
            pieces[-1] = (pieces[-1][0], pieces[-1][1], pieces[-1][2] + 1)
        else:
            pieces.append((s, d, 1))
    if len(pieces) * 4 > len(src_blocks) + 3:  # scattered: two vectorised copies beat many small ones
        packed = gather_blocks(src, block_ids(src_blocks, src.device))
        scatter_blocks(dst, block_ids(dst_blocks, dst.device), packed.to(dst.device))
        return
    for s, d, n in pieces:
        dst[:, d : d + n].copy_(src[:, s : s + n])


def check_blocks(blocks: tuple[int, ...], num_blocks: int) -> str:
    """Why ``blocks`` cannot be destination ids in a cache of ``num_blocks`` blocks, or ``""``."""
    if not blocks:
        return "no destination blocks"
    if any(b < 0 or b >= num_blocks for b in blocks):
        return f"block id out of range 0..{num_blocks - 1}"
    if len(set(blocks)) != len(blocks):
        return "duplicate destination block ids"
    return ""
