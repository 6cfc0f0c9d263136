"""Torch reference for paged attention and the KV-cache write: the CPU path and the oracle for kernels.

Cache layout, one tensor per layer: ``kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 keys, 1 values). Scores and softmax are computed in float32 whatever the cache dtype.
A tiled cache (``tiled=True``, ``AttentionMetadata.tiled_kv``) has the same shape and block size in
bytes, but each block holds its values in the order the CPU prompt kernel multiplies them
(``csrc/paged_prefill_cpu.c``, ``pd_store_kv_tiled``): per kv head, keys as 16-key groups ``[dim pair][16
keys]`` and values as ``[key pair][dim]``, each pair of bfloat16 in one 32-bit word. ``untile_blocks`` and
``tile_blocks`` convert whole blocks. An int8 cache (``kv_int8_ref``), its rows in int8 with a scale each,
is read here as the values its rows hold.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdfabric.kernels import kv_int8_ref
from pdfabric.kernels.metadata import AttentionMetadata


def untile_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """Blocks of a tiled cache, ``[2, n, block_size, kv_heads, head_dim]``, in the dense layout (a copy)."""
    _, n, bs, h, d = blocks.shape
    # keys: [n][head][group][dim pair][16 keys][2 dims] -> [n][group][16 keys][head][dim pair][2 dims]
    k = blocks[0].reshape(n, h, bs // 16, d // 2, 16, 2).permute(0, 2, 4, 1, 3, 5).reshape(n, bs, h, d)
    # values: [n][head][key pair][dim][2 keys] -> [n][key pair][2 keys][head][dim]
    v = blocks[1].reshape(n, h, bs // 2, d, 2).permute(0, 2, 4, 1, 3).reshape(n, bs, h, d)
    return torch.stack((k, v))


def tile_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """Dense blocks ``[2, n, block_size, kv_heads, head_dim]`` in the tiled layout (a copy)."""
    _, n, bs, h, d = blocks.shape
    k = blocks[0].reshape(n, bs // 16, 16, h, d // 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(n, bs, h, d)
    v = blocks[1].reshape(n, bs // 2, 2, h, d).permute(0, 3, 1, 4, 2).reshape(n, bs, h, d)
    return torch.stack((k, v))


def store_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    tiled: bool = False,
) -> None:
    """Writes the new tokens' keys and values into their cache slots."""
    # key, value: [T, kv_heads, head_dim]; slot_mapping: [T]
    _, _, block_size, kv_heads, head_dim = kv_cache.shape
    if kv_cache.dtype == torch.int8:
        kv_int8_ref.store_kv(key, value, kv_cache, slot_mapping)
        return
    if tiled:  # the touched blocks, untiled, written, tiled again
        ids, where = torch.unique(slot_mapping // block_size, return_inverse=True)
        blocks = untile_blocks(kv_cache.index_select(1, ids))
        store_kv_ref(key, value, blocks, where * block_size + slot_mapping % block_size)
        kv_cache.index_copy_(1, ids, tile_blocks(blocks))
        return
    flat = kv_cache.view(2, -1, kv_heads, head_dim)  # [2, num_blocks * block_size, kv_heads, head_dim]
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def gather_seq_kv(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, tiled: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``seq_len`` cached keys and values of one sequence, contiguous."""
    _, _, block_size, kv_heads, _ = kv_cache.shape
    head_dim = kv_int8_ref.head_dim_of(kv_cache)
    num_blocks = -(-seq_len // block_size)
    # index_select, not advanced indexing: several times faster on the CPU for this gather.
    blocks = kv_cache.index_select(
        1, block_table[:num_blocks].long()
    )  # [2, n, block_size, kv_heads, head_dim]
    if kv_cache.dtype == torch.int8:  # dense rows of the values it holds
        blocks = kv_int8_ref.dequantize_blocks(blocks)
    elif tiled:
        blocks = untile_blocks(blocks)
    kv = blocks.reshape(2, num_blocks * block_size, kv_heads, head_dim)[:, :seq_len]
    return kv[0], kv[1]


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    # q: [B, Lq, Hq, D]; k, v: [B, Lk, Hkv, D]; mask: [B, Lq, Lk] bool (True = may attend; every
    # query row attends to at least itself, so no row is fully masked). Returns [B, Lq, Hq, D] float32.
    out = F.scaled_dot_product_attention(
        q.float().transpose(1, 2),  # [B, Hq, Lq, D]
        k.float().transpose(1, 2),  # [B, Hkv, Lk, D]
        v.float().transpose(1, 2),
        attn_mask=mask[:, None],  # [B, 1, Lq, Lk]
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2)


def paged_attention_ref(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole cached context.

    The new tokens' KV must already be in the cache (``store_kv_ref``). Returns ``[T, q_heads,
    head_dim]`` in ``q``'s dtype.
    """
    # q: [T, q_heads, head_dim]
    if meta.is_decode_only:
        return _decode_ref(q, kv_cache, meta, scale)
    out = torch.empty_like(q)
    start = 0
    for s, (q_len, s_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host, strict=True)):
        # k, v: [s_len, kv_heads, head_dim]
        k, v = gather_seq_kv(kv_cache, meta.block_tables[s], s_len, meta.tiled_kv)
        q_pos = torch.arange(s_len - q_len, s_len, device=q.device)
        mask = torch.arange(s_len, device=q.device)[None, :] <= q_pos[:, None]  # [q_len, s_len]
        o = _attend(q[None, start : start + q_len], k[None], v[None], mask[None], scale)
        out[start : start + q_len] = o[0].to(q.dtype)
        start += q_len
    return out


def _decode_ref(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """One query per sequence: all sequences at once over block tables padded to the longest."""
    _, _, block_size, kv_heads, _ = kv_cache.shape
    head_dim = kv_int8_ref.head_dim_of(kv_cache)
    max_len = meta.max_seq_len
    num_blocks = -(-max_len // block_size)
    tables = meta.block_tables[:, :num_blocks].long()  # [S, n]
    kv = kv_cache.index_select(1, tables.reshape(-1))  # [2, S * n, block_size, kv_heads, head_dim]
    if kv_cache.dtype == torch.int8:  # dense rows of the values it holds
        kv = kv_int8_ref.dequantize_blocks(kv)
    elif meta.tiled_kv:
        kv = untile_blocks(kv)
    kv = kv.reshape(2, meta.num_seqs, num_blocks * block_size, kv_heads, head_dim)[:, :, :max_len]
    mask = torch.arange(max_len, device=q.device)[None, :] < meta.seq_lens[:, None]  # [S, max_len]
    out = _attend(q[:, None], kv[0], kv[1], mask[:, None], scale)  # [S, 1, q_heads, head_dim]
    return out[:, 0].to(q.dtype)
