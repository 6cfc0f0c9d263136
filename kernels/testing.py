"""Random paged-attention batches and tolerances for checking kernels against their references.

Shared by the kernel tests (CPU interpreter and GPU) and the kernel benchmark.
"""

from __future__ import annotations

import torch

from pdfabric.kernels.metadata import AttentionMetadata

# dtype -> (atol, rtol) of a kernel's output against the float32-softmax reference
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-5, 1e-4),
    torch.float16: (4e-3, 1e-2),
    torch.bfloat16: (3e-2, 2e-2),
}


def make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    device: str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A query batch, a filled cache and metadata whose block tables are shuffled, non-contiguous
    block ids drawn from a pool with spare blocks (so stray reads would hit other data)."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + 3
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in needed:
        tables.append(pool[used : used + n])
        used += n
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, device=device)
    kv_shape = (2, num_blocks, block_size, kv_heads, head_dim)
    dev_gen = torch.Generator(device=device).manual_seed(seed)
    kv_cache = torch.randn(kv_shape, generator=dev_gen, device=device).to(dtype)  # [2, nb, bs, Hkv, D]
    q_shape = (sum(query_lens), q_heads, head_dim)
    q = torch.randn(q_shape, generator=dev_gen, device=device).to(dtype)  # [T, Hq, D]
    return q, kv_cache, meta


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    atol, rtol = TOLERANCES[ref.dtype]
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
