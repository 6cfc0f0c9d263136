"""Triton paged attention: decode and chunked prefill over the paged KV cache, with split-K.

One kernel serves every batch that ``AttentionMetadata`` describes. A program owns one sequence, one
tile of its new query tokens, one KV head and one slice ("split") of the context:

1. its rows are the tile's tokens times the query heads that share the KV head (grouped-query
   attention packs the group into the rows, so each key block is read once per group);
2. it walks the split's keys in tiles of ``BLOCK_N`` tokens, finding each token's cache block through
   the block table, with an online softmax in float32 (causal within the chunk, full over the cached
   prefix, since a query at position ``p`` sees keys ``0..p``);
3. with one split it writes the normalised output; with several it writes the unnormalised partial
   sum and its running max and denominator, and ``_merge_splits_kernel`` combines the splits.

A position's result is the same to the bit whatever the batch, decoded or in a prompt chunk of any
size, after any cached prefix, because the floating-point operations that make it never change:

- Decode rows are one-token prompt tiles: the same ``TILE_ROWS``-row tile shape (so the same MMA
  instruction, register layout and order of every row sum) and the same compiled kernel. A row's
  result does not depend on its place in the tile or on the rows beside it.
- Splits are a fixed ``_SPLIT_TOKENS`` keys from key 0, never sized by the batch, and inside a split
  key tiles start at the same keys, so a position meets its keys in the same tiles. A prompt tile also
  walks keys past a row's position (the tile's later tokens); for that row they are masked to
  ``-inf``, so such a tile leaves its max, denominator and sum exactly as they were (the rescale factor
  is exactly 1 when the max does not move, and the probabilities are exact zeros).
- The merge adds the splits in chunks of a fixed ``_SPLIT_CHUNK``, slot by slot, then sums the slots:
  one shape of sum whatever the batch's split count. A split past a row's position (empty) adds an
  exact zero, and a single split merges as ``acc * 1 / (l * 1)``, the same division the one-split path
  does, so a row with one split gets the same bits merged or not.

Decode rows pay for a 64-row tile where the group needs fewer rows (four times the MMA and softmax
work of a 16-row tile, on a path bound by reading the cache; ``pdfabric bench kernels`` measures it,
``docs/kernels.md``). The reference is ``attention_ref.paged_attention_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from pdfabric.kernels.launch_checks import FLOAT_DTYPES, check_block_tables, check_kv_cache, require
from pdfabric.kernels.metadata import AttentionMetadata

_LOG2E = 1.4426950408889634
_BLOCK_N = 64  # keys per inner step
TILE_ROWS = 64  # query rows (tokens x group heads) per tile, decode rows and prompt chunks alike
_SPLIT_TOKENS = 512  # keys per split, whatever the batch: a row's sums then do not depend on it
_MAX_SPLITS = 256
_SPLIT_CHUNK = 32  # splits the merge adds in one step, whatever the batch's split count


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    if INTERPRET:
        # The CPU interpreter's tl.dot is numpy's matmul: it multiplies bf16 tiles wrongly, and a row's
        # result depends on its place in the tile (the BLAS kernel's edges). Products and sums in float32,
        # k in order, depend on the row's own inputs only, as the GPU's MMA does.
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _paged_attn_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_o_ptr, part_m_ptr, part_l_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_ptr,
    qk_scale, head_dim, q_heads, split_len, num_splits,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_ot, stride_oh, stride_bt,
    KV_BLOCK: tl.constexpr, GROUP: tl.constexpr, TILE_TOKENS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
):
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    kv_head = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    tile_tok = tile * TILE_TOKENS
    if tile_tok < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        rows = tl.arange(0, BLOCK_M)
        tok = tile_tok + rows // GROUP  # [BLOCK_M] query token within the sequence
        head = kv_head * GROUP + rows % GROUP  # [BLOCK_M] query head
        row_ok = (rows < TILE_TOKENS * GROUP) & (tok < q_len)
        q_pos = seq_len - q_len + tok  # [BLOCK_M] absolute position: sees keys 0..q_pos
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_dim
        q_rows = (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh  # [BLOCK_M]
        q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        # q: [BLOCK_M, BLOCK_D]

        kv_stop = seq_len - q_len + tl.minimum(tile_tok + TILE_TOKENS, q_len)  # causal end of the tile
        kv_lo = split * split_len
        kv_hi = tl.minimum(kv_lo + split_len, kv_stop)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, log2 domain
        l_i = tl.zeros([BLOCK_M], tl.float32)  # running denominator
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        for start in range(kv_lo, kv_hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
            n_ok = n < kv_hi
            block = tl.load(table + n // KV_BLOCK, mask=n_ok, other=0)
            kv_off = block.to(tl.int64) * stride_kb + (n % KV_BLOCK) * stride_ks + kv_head * stride_kh
            k = tl.load(k_ptr + kv_off[None, :] + d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
            # k: [BLOCK_D, BLOCK_N]
            s = _dot(q, k, DOT_PRECISION, INTERPRET) * qk_scale  # [BLOCK_M, BLOCK_N]
            s = tl.where(n_ok[None, :] & (n[None, :] <= q_pos[:, None]), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
            p = tl.exp2(s - m_safe[:, None])  # [BLOCK_M, BLOCK_N]
            # an unchanged max rescales by exactly 1: a tile of keys a row cannot see is a no-op for it
            alpha = tl.where(m_new == m_i, 1.0, tl.exp2(m_i - m_safe))
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + kv_off[:, None] + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            # v: [BLOCK_N, BLOCK_D]
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, INTERPRET)
            m_i = m_new

        if SPLIT:
            part = ((q_start + tok).to(tl.int64) * q_heads + head) * num_splits + split  # [BLOCK_M]
            # partials: m, l [T, q_heads, num_splits]; o [T, q_heads, num_splits, head_dim]
            tl.store(part_m_ptr + part, m_i, mask=row_ok)
            tl.store(part_l_ptr + part, l_i, mask=row_ok)
            tl.store(part_o_ptr + part[:, None] * head_dim + d[None, :], acc,
                     mask=row_ok[:, None] & d_ok[None, :])
        else:
            out_rows = (q_start + tok).to(tl.int64) * stride_ot + head * stride_oh  # [BLOCK_M]
            o = acc / l_i[:, None]
            tl.store(out_ptr + out_rows[:, None] + d[None, :], o.to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_splits_kernel(
    out_ptr, part_o_ptr, part_m_ptr, part_l_ptr, head_dim, num_splits, q_heads, stride_ot, stride_oh,
    SPLIT_CHUNK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    first = (token.to(tl.int64) * q_heads + head) * num_splits  # this row's split 0
    sp = tl.arange(0, SPLIT_CHUNK)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    # Split 0 always holds key 0, which every query sees, so the max is finite.
    top = tl.full([SPLIT_CHUNK], float("-inf"), tl.float32)
    for c in range(0, num_splits, SPLIT_CHUNK):
        m = tl.load(part_m_ptr + first + c + sp, mask=c + sp < num_splits, other=float("-inf"))
        top = tl.maximum(top, m)
    m_max = tl.max(top, 0)
    # Chunks of SPLIT_CHUNK splits are added slot by slot, then the slots summed once: the same shape
    # of sum for every row, whatever the batch's split count (empty splits and slots add exact zeros).
    o_acc = tl.zeros([SPLIT_CHUNK, BLOCK_D], tl.float32)
    l_acc = tl.zeros([SPLIT_CHUNK], tl.float32)
    for c in range(0, num_splits, SPLIT_CHUNK):
        sp_ok = c + sp < num_splits
        part = first + c + sp  # [SPLIT_CHUNK]
        m = tl.load(part_m_ptr + part, mask=sp_ok, other=float("-inf"))
        w = tl.where(m == m_max, 1.0, tl.exp2(m - m_max))  # [SPLIT_CHUNK]; exactly 1 for the top split
        l_acc += tl.load(part_l_ptr + part, mask=sp_ok, other=0.0) * w
        o = tl.load(part_o_ptr + part[:, None] * head_dim + d[None, :],
                    mask=sp_ok[:, None] & d_ok[None, :], other=0.0)  # [SPLIT_CHUNK, BLOCK_D]
        o_acc += o * w[:, None]
    res = tl.sum(o_acc, 0) / tl.sum(l_acc, 0)  # [BLOCK_D]
    dst = out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + d
    tl.store(dst, res.to(out_ptr.dtype.element_ty), mask=d_ok)


# The kernels were built for the CPU interpreter (TRITON_INTERPRET=1 when this module was imported).
INTERPRETED = isinstance(_paged_attn_kernel, InterpretedFunction)


def split_tokens(max_seq_len: int) -> int:
    """Keys per split for a batch whose longest context is ``max_seq_len``: ``_SPLIT_TOKENS``, fixed so
    that a row is cut at the same keys alone or in any batch (its partial sums, and so its result,
    are the same); doubled only when ``_MAX_SPLITS`` such splits cannot cover the longest context
    (past 131,072 tokens, where a row's sums then depend on the batch's longest context)."""
    tokens = _SPLIT_TOKENS
    while tokens * _MAX_SPLITS < max_seq_len:
        tokens *= 2
    return tokens


def choose_num_splits(max_seq_len: int) -> int:
    """How many splits a batch whose longest context is ``max_seq_len`` runs (1: no merge)."""
    return max(1, -(-max_seq_len // split_tokens(max_seq_len)))


def _check(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    require(q.dim() == 3, f"q must be [tokens, q_heads, head_dim], got {tuple(q.shape)}")
    require(q.dtype in FLOAT_DTYPES, f"q dtype {q.dtype} is not fp16, bf16 or fp32")
    require(q.stride(-1) == 1, f"q must have unit stride on head_dim, got {q.stride()}")
    check_kv_cache(kv_cache)
    require(kv_cache.dtype == q.dtype, f"q is {q.dtype} but kv_cache is {kv_cache.dtype}")
    require(kv_cache.device == q.device, f"q is on {q.device} but kv_cache is on {kv_cache.device}")
    _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
    require(q.shape[2] == head_dim, f"q head_dim {q.shape[2]} != kv_cache head_dim {head_dim}")
    require(q.shape[1] % kv_heads == 0, f"q_heads {q.shape[1]} is not a multiple of kv_heads {kv_heads}")
    require(q.shape[0] == meta.num_tokens, f"q has {q.shape[0]} tokens, metadata {meta.num_tokens}")
    for name in ("query_start_loc", "seq_lens", "block_tables"):
        t = getattr(meta, name)
        require(t.device == q.device, f"metadata {name} is on {t.device}, q on {q.device}")
        require(t.dtype == torch.int32, f"metadata {name} must be int32, got {t.dtype}")
    require(tuple(meta.query_start_loc.shape) == (meta.num_seqs + 1,), "query_start_loc must be [S + 1]")
    require(tuple(meta.seq_lens.shape) == (meta.num_seqs,), "seq_lens must be [S]")
    check_block_tables(meta.block_tables, meta.seq_lens_host, block_size, num_blocks)


def paged_attention_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Same contract as ``paged_attention_ref``. Contexts are split every ``split_tokens`` keys;
    ``num_splits`` overrides that (for tests: a row's result then depends on the batch)."""
    # q: [T, q_heads, head_dim]; kv_cache: [2, num_blocks, block_size, kv_heads, head_dim]
    _check(q, kv_cache, meta)
    num_tokens, q_heads, head_dim = q.shape
    block_size, kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    out = torch.empty((num_tokens, q_heads, head_dim), dtype=q.dtype, device=q.device)  # [T, Hq, D]
    if num_tokens == 0:
        return out
    group = q_heads // kv_heads
    # one tile shape for decode rows and prompt chunks alike (module docstring)
    block_m = max(TILE_ROWS, triton.next_power_of_2(group))
    tile_tokens = block_m // group
    q_tiles = -(-max(meta.query_lens_host) // tile_tokens)
    longest = max(meta.max_seq_len, 1)
    if num_splits is None:
        split_len = split_tokens(longest)
    else:
        require(1 <= num_splits <= _MAX_SPLITS, f"num_splits must be in 1..{_MAX_SPLITS}, got {num_splits}")
        split_len = triton.cdiv(triton.cdiv(longest, num_splits), _BLOCK_N) * _BLOCK_N
    splits = triton.cdiv(longest, split_len)
    use_split = splits > 1
    if use_split:
        part_o = torch.empty((num_tokens, q_heads, splits, head_dim), dtype=torch.float32, device=q.device)
        part_m = torch.empty((num_tokens, q_heads, splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_o = part_m = part_l = out  # unused
    block_d = max(16, triton.next_power_of_2(head_dim))
    k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, kv_heads, head_dim]
    _paged_attn_kernel[(meta.num_seqs, q_tiles, kv_heads * splits)](
        q, k_cache, v_cache, out, part_o, part_m, part_l,
        meta.block_tables, meta.seq_lens, meta.query_start_loc,
        scale * _LOG2E, head_dim, q_heads, split_len, splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), meta.block_tables.stride(0),
        KV_BLOCK=block_size, GROUP=group, TILE_TOKENS=tile_tokens,
        BLOCK_M=block_m, BLOCK_N=_BLOCK_N, BLOCK_D=block_d,
        SPLIT=use_split, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        INTERPRET=INTERPRETED,
        num_warps=4, num_stages=2,
    )
    if use_split:
        _merge_splits_kernel[(num_tokens, q_heads)](
            out, part_o, part_m, part_l, head_dim, splits, q_heads, out.stride(0), out.stride(1),
            SPLIT_CHUNK=_SPLIT_CHUNK, BLOCK_D=block_d,
        )
    return out
