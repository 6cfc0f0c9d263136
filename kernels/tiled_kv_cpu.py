"""The paged KV write into a tiled or int8 CPU cache (``csrc/paged_prefill_cpu.c``'s ``pd_store_kv_tiled``
and ``pd_store_kv_int8``): each block holds, per KV head, its keys as 16-key groups ``[dim pair][key]``
and its values as ``[key pair][dim]``, the layouts the prompt kernel reads in place
(``paged_attention_cpu``, docs/kernels.md "The tiled KV cache"); an int8 cache holds them quantized
with a scale per row (``kv_int8_ref``). The GPU's twin is ``store_kv_triton``.
"""

from __future__ import annotations

import ctypes

import torch

from pdfabric.kernels import cpu_build, kv_int8_ref
from pdfabric.kernels.paged_attention_cpu import prefill_library


def store_kv_tiled_address(int8: bool = False) -> int:
    """The address of ``pd_store_kv_tiled`` (``pd_store_kv_int8`` for an int8 cache), for C code that
    calls it; ``tiled_kv_supported`` must hold."""
    lib = prefill_library(torch.bfloat16)
    return ctypes.cast(lib.pd_store_kv_int8 if int8 else lib.pd_store_kv_tiled, ctypes.c_void_p).value


def store_kv_tiled(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Writes new keys and values ``[T, kv_heads, head_dim]`` (bfloat16) into their slots of a tiled
    cache, or quantized into an int8 one; ``tiled_kv_supported`` must hold for it."""
    _, num_blocks, block_size, kv_heads, _ = kv_cache.shape
    head_dim = key.shape[2]
    if key.stride(2) != 1 or key.stride(1) != head_dim:
        key = key.contiguous()
    if value.stride(2) != 1 or value.stride(1) != head_dim:
        value = value.contiguous()
    int8 = kv_cache.dtype == torch.int8
    takes = torch.bfloat16 if int8 else kv_cache.dtype
    if key.dtype != takes or value.dtype != takes or not kv_cache.is_contiguous():
        raise ValueError(f"a tiled cache takes contiguous {takes}, got {key.dtype} and {value.dtype}")
    if int8 and kv_int8_ref.head_dim_of(kv_cache) != head_dim:
        raise ValueError(f"an int8 cache of {kv_int8_ref.head_dim_of(kv_cache)}-dim heads, got {head_dim}")
    slots = slot_mapping.to(torch.int64).contiguous()
    lib = prefill_library(takes)
    with cpu_build.profiled("store_kv_tiled_cpu"):
        status = (lib.pd_store_kv_int8 if int8 else lib.pd_store_kv_tiled)(
            key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), kv_cache[0].data_ptr(),
            kv_cache[1].data_ptr(), slots.data_ptr(), num_blocks * block_size, key.shape[0], kv_heads,
            head_dim, block_size, torch.get_num_threads(),
        )  # fmt: skip
    if status != 0:
        raise RuntimeError(f"pd_store_kv_tiled rejected its arguments (status {status})")
