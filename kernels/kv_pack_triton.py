"""Triton KV block gather/scatter: one request's blocks of one layer to a contiguous frame and back.

A cache block (``[block_size, kv_heads, head_dim]``) is contiguous in memory, so packing is a copy of
``2 * n`` runs of ``block_size * kv_heads * head_dim`` elements, each run chosen through the block
ids. One kernel does both directions: a program copies one chunk of one run of keys or values,

1. gather: run ``i`` of ``kv_cache[kv, block_ids[i]]`` -> ``packed[kv, i]``;
2. scatter: run ``i`` of ``packed[kv, i]`` -> ``kv_cache[kv, block_ids[i]]``, casting to the cache
   dtype.

The references are ``kv_pack_ref.gather_blocks_ref`` and ``scatter_blocks_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdfabric.kernels.launch_checks import check_index_range, check_kv_cache, require

_CHUNK = 2048  # elements per program


@triton.jit
def _copy_blocks_kernel(
    src_ptr, dst_ptr, ids_ptr, run_len, num_ids,
    src_stride_kv, src_stride_blk, dst_stride_kv, dst_stride_blk,
    GATHER: tl.constexpr, CHUNK: tl.constexpr,
):
    kv = tl.program_id(0) // num_ids
    i = tl.program_id(0) % num_ids
    block = tl.load(ids_ptr + i).to(tl.int64)
    if GATHER:
        src_blk = block
        dst_blk = i.to(tl.int64)
    else:
        src_blk = i.to(tl.int64)
        dst_blk = block
    offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)  # [CHUNK] element within the run
    ok = offs < run_len
    x = tl.load(src_ptr + kv * src_stride_kv + src_blk * src_stride_blk + offs, mask=ok)
    tl.store(dst_ptr + kv * dst_stride_kv + dst_blk * dst_stride_blk + offs,
             x.to(dst_ptr.dtype.element_ty), mask=ok)


def _blocks_contiguous(t: torch.Tensor) -> bool:
    """Each ``t[kv, b]`` (``[block_size, kv_heads, head_dim]``) is one dense run."""
    _, _, block_size, kv_heads, head_dim = t.shape
    return t.stride(4) == 1 and t.stride(3) == head_dim and t.stride(2) == kv_heads * head_dim


def _check(kv_cache: torch.Tensor, block_ids: torch.Tensor, packed: torch.Tensor, name: str) -> None:
    check_kv_cache(kv_cache)
    require(_blocks_contiguous(kv_cache), f"kv_cache blocks must be dense, got strides {kv_cache.stride()}")
    require(block_ids.dim() == 1, f"block_ids must be [n], got {tuple(block_ids.shape)}")
    require(block_ids.dtype in (torch.int32, torch.int64), f"block_ids dtype {block_ids.dtype} is not int")
    require(block_ids.is_contiguous(), "block_ids must be contiguous")
    expect = (2, block_ids.shape[0], *kv_cache.shape[2:])
    require(tuple(packed.shape) == expect, f"{name} must be {expect}, got {tuple(packed.shape)}")
    require(_blocks_contiguous(packed), f"{name} blocks must be dense, got strides {packed.stride()}")
    for t, what in ((block_ids, "block_ids"), (packed, name)):
        require(t.device == kv_cache.device, f"{what} is on {t.device}, kv_cache on {kv_cache.device}")
    check_index_range(block_ids, kv_cache.shape[1], "block_ids")


def _launch(src: torch.Tensor, dst: torch.Tensor, block_ids: torch.Tensor, gather: bool) -> None:
    n = block_ids.shape[0]
    run_len = src[0, 0].numel()
    if n == 0 or run_len == 0:
        return
    grid = (2 * n, triton.cdiv(run_len, _CHUNK))
    _copy_blocks_kernel[grid](
        src, dst, block_ids, run_len, n,
        src.stride(0), src.stride(1), dst.stride(0), dst.stride(1),
        GATHER=gather, CHUNK=_CHUNK,
    )


def gather_blocks_triton(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Same contract as ``gather_blocks_ref``: ``kv_cache[:, block_ids]`` as one dense tensor."""
    # kv_cache: [2, num_blocks, block_size, kv_heads, head_dim]; block_ids: [n]
    if out is None:
        shape = (2, block_ids.shape[0], *kv_cache.shape[2:])
        out = torch.empty(shape, dtype=kv_cache.dtype, device=kv_cache.device)  # [2, n, bs, Hkv, D]
    require(out.dtype == kv_cache.dtype, f"out is {out.dtype} but kv_cache is {kv_cache.dtype}")
    _check(kv_cache, block_ids, out, "out")
    _launch(kv_cache, out, block_ids, gather=True)
    return out


def scatter_blocks_triton(kv_cache: torch.Tensor, block_ids: torch.Tensor, packed: torch.Tensor) -> None:
    """Same contract as ``scatter_blocks_ref``: ``kv_cache[:, block_ids] = packed`` (cast to its dtype)."""
    # packed: [2, n, block_size, kv_heads, head_dim]
    _check(kv_cache, block_ids, packed, "packed")
    require(packed.dtype.is_floating_point, f"packed dtype {packed.dtype} is not a float dtype")
    _launch(packed, kv_cache, block_ids, gather=False)
