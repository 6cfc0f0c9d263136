"""The int8 KV cache in torch: its layout, the write, and reading it back (the C kernels' twin).

An int8 cache is one ``[2, num_blocks, block_size, kv_heads, head_dim + 4]`` int8 tensor per layer. Each
row (a token's keys or values in one kv head) is ``head_dim`` int8 values and a float32 scale:
``scale = max|x| / 127``, ``q = round_half_even(x / scale)`` (0 for an all-zero row). Within a block of
keys (or values) each kv head has ``block_size * (head_dim + 4)`` bytes. Keys come in 16-key groups,
each its 16 scales then its values ``[dim quad][key % 16][4 dims]`` stored as ``q + 128`` (unsigned, for
VPDPBUSD); values are the block's ``block_size`` scales then ``[key pair][dim][2 keys]``. The C kernels
(``csrc/kv_int8.h``) attend over the rows in place, quantizing each query row by the same rule for the
scores; ``dequantize_blocks`` gives the rows' values (``q * scale``) for the float32 reference they are
tested against.
"""

from __future__ import annotations

import functools

import torch

SCALE_BYTES = 4  # the float32 scale after each row's values


def head_dim_of(kv_cache: torch.Tensor) -> int:
    """The head size a cache holds: its last dimension, less the scale's bytes in an int8 cache."""
    width = kv_cache.shape[-1]
    return width - SCALE_BYTES if kv_cache.dtype == torch.int8 else width


@functools.cache
def _positions(block_size: int, head_dim: int) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """Where token ``t``'s dim ``c`` (``[block_size, head_dim]``) and its scale's first byte
    (``[block_size]``) lie among a kv head's ``block_size * (head_dim + 4)`` bytes: for keys, for values."""
    t = torch.arange(block_size)[:, None]
    c = torch.arange(head_dim)[None, :]
    group = t // 16 * 16 * (head_dim + SCALE_BYTES)  # a key group: its 16 scales, then its values
    keys = group + 16 * SCALE_BYTES + c // 4 * 64 + t % 16 * 4 + c % 4
    key_scales = (group + t % 16 * SCALE_BYTES)[:, 0]
    values = block_size * SCALE_BYTES + t // 2 * 2 * head_dim + c * 2 + t % 2
    value_scales = t[:, 0] * SCALE_BYTES
    return (keys, key_scales), (values, value_scales)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[..., head_dim]`` as int8 values and float32 scales ``[...]`` (the C write's rule)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.where(scale[..., None] > 0, (xf / safe[..., None]).round(), torch.zeros_like(xf))
    return q.clamp(-127, 127).to(torch.int8), scale


def store_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Writes new keys and values ``[T, kv_heads, head_dim]`` into their slots of an int8 cache."""
    _, num_blocks, block_size, kv_heads, width = kv_cache.shape
    head_dim = width - SCALE_BYTES
    head_bytes = block_size * width
    slots = slot_mapping.long()
    block, t = slots // block_size, slots % block_size  # [T]
    base = (block[:, None] * kv_heads + torch.arange(kv_heads)[None, :]) * head_bytes  # [T, kv_heads]
    places = _positions(block_size, head_dim)
    for half, (rows, (where, scale_at)) in enumerate(zip((key, value), places, strict=True)):
        q, scale = quantize_rows(rows)  # [T, kv_heads, head_dim], [T, kv_heads]
        if half == 0:  # keys as q + 128, unsigned: the same byte as int8 (q + 128) - 256 where above 127
            q = (q.to(torch.int16) + 128).to(torch.uint8).view(torch.int8)
        flat = kv_cache[half].view(-1)
        flat[(base[..., None] + where[t][:, None, :]).reshape(-1)] = q.reshape(-1)
        at = base + scale_at[t][:, None]  # [T, kv_heads]
        scale_bytes = scale.contiguous().view(torch.int8)  # [T, kv_heads * 4]
        flat[(at[..., None] + torch.arange(SCALE_BYTES)).reshape(-1)] = scale_bytes.reshape(-1)


def dequantize_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """Int8 blocks ``[2, n, block_size, kv_heads, head_dim + 4]`` as dense float32 blocks ``[2, n,
    block_size, kv_heads, head_dim]`` of each row's values times its scale."""
    _, n, block_size, kv_heads, width = blocks.shape
    head_dim = width - SCALE_BYTES
    flat = blocks.reshape(2, n, kv_heads, block_size * width)
    out = []
    for half, (where, scale_at) in enumerate(_positions(block_size, head_dim)):
        q = flat[half][..., where.reshape(-1)].float()  # [n, kv_heads, block_size * head_dim], token-major
        if half == 0:
            q = (q + 256) % 256 - 128  # keys are stored as q + 128
        at = (scale_at[:, None] + torch.arange(SCALE_BYTES)).reshape(-1)
        scales = flat[half][..., at].contiguous().view(torch.float32)  # [n, kv_heads, block_size]
        rows = q.reshape(n, kv_heads, block_size, head_dim) * scales[..., None]
        out.append(rows.permute(0, 2, 1, 3))  # [n, block_size, kv_heads, head_dim]
    return torch.stack(out)
