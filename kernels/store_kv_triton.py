"""Triton KV-cache write: each new token's keys and values into its cache slot.

One program per token: it reads the token's ``[kv_heads, head_dim]`` key and value rows and writes
them to slot ``slot_mapping[t]`` (block ``slot // block_size``, row ``slot % block_size``), casting
to the cache dtype. The reference is ``attention_ref.store_kv_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdfabric.kernels.launch_checks import FLOAT_DTYPES, check_index_range, check_kv_cache, require


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, kv_heads, head_dim,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
    KV_BLOCK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    ok = (h[:, None] < kv_heads) & (d[None, :] < head_dim)  # [BLOCK_H, BLOCK_D]
    dst = (slot // KV_BLOCK) * stride_cb + (slot % KV_BLOCK) * stride_cs + h[:, None] * stride_ch + d[None, :]
    k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=ok)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=ok)
    v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=ok)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=ok)


def store_kv_triton(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Same contract as ``store_kv_ref``."""
    # key, value: [T, kv_heads, head_dim]; slot_mapping: [T] int64
    check_kv_cache(kv_cache)
    _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
    for t, name in ((key, "key"), (value, "value")):
        require(tuple(t.shape) == (slot_mapping.shape[0], kv_heads, head_dim),
                f"{name} must be [{slot_mapping.shape[0]}, {kv_heads}, {head_dim}], got {tuple(t.shape)}")
        require(t.dtype in FLOAT_DTYPES, f"{name} dtype {t.dtype} is not fp16, bf16 or fp32")
        require(t.stride(-1) == 1, f"{name} must have unit stride on head_dim, got {t.stride()}")
        require(t.device == kv_cache.device, f"{name} is on {t.device}, kv_cache on {kv_cache.device}")
    require(slot_mapping.dim() == 1 and slot_mapping.dtype == torch.int64, "slot_mapping must be [T] int64")
    require(slot_mapping.is_contiguous(), "slot_mapping must be contiguous")
    require(slot_mapping.device == kv_cache.device, "slot_mapping must be on the cache's device")
    if slot_mapping.numel() == 0:
        return
    check_index_range(slot_mapping, num_blocks * block_size, "slot_mapping")
    k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, kv_heads, head_dim]
    _store_kv_kernel[(slot_mapping.shape[0],)](
        key, value, k_cache, v_cache, slot_mapping, kv_heads, head_dim,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        KV_BLOCK=block_size, BLOCK_H=triton.next_power_of_2(kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
