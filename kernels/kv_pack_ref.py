"""Torch reference for packing a request's KV blocks into one contiguous buffer and back.

The transfer layer ships a request's blocks of one layer as a single frame: the sender gathers them
out of its paged cache (``[2, num_blocks, block_size, kv_heads, head_dim]``) into
``[2, n, block_size, kv_heads, head_dim]``; the receiver scatters the frame into the blocks it
reserved, which need not be the same ids nor contiguous.
"""

from __future__ import annotations

import torch


def gather_blocks_ref(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Returns (or fills ``out`` with) ``kv_cache[:, block_ids]`` as one contiguous tensor."""
    # kv_cache: [2, num_blocks, block_size, kv_heads, head_dim]; block_ids: [n] int
    if out is None:
        return kv_cache.index_select(1, block_ids.long())
    torch.index_select(kv_cache, 1, block_ids.long(), out=out)
    return out


def scatter_blocks_ref(kv_cache: torch.Tensor, block_ids: torch.Tensor, packed: torch.Tensor) -> None:
    """Writes ``packed`` (``[2, n, block_size, kv_heads, head_dim]``) into ``kv_cache[:, block_ids]``."""
    kv_cache.index_copy_(1, block_ids.long(), packed.to(kv_cache.dtype))
