"""The compiled Triton kernels against their references at serving sizes, on a CUDA device."""

from __future__ import annotations

import pytest
import torch

from pdfabric.kernels.attention_ref import paged_attention_ref, store_kv_ref
from pdfabric.kernels.kv_pack_ref import gather_blocks_ref, scatter_blocks_ref
from pdfabric.kernels.testing import assert_close, make_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads", [32, 16, 8, 4])
def test_decode_long_contexts(dtype: torch.dtype, kv_heads: int) -> None:
    from pdfabric.kernels.paged_attention_triton import paged_attention_triton

    seq_lens = [1, 15, 16, 17, 255, 1000, 4097, 9000]
    q, kv, meta = make_batch([1] * len(seq_lens), seq_lens, q_heads=32, kv_heads=kv_heads, head_dim=128,
                             block_size=16, dtype=dtype, seed=kv_heads, device="cuda")
    ref = paged_attention_ref(q, kv, meta, 128**-0.5)
    for splits in (None, 1, 7):
        assert_close(paged_attention_triton(q, kv, meta, 128**-0.5, splits), ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("group", "head_dim", "block_size"), [(1, 64, 16), (4, 128, 32), (7, 96, 16)])
def test_chunked_prefill(dtype: torch.dtype, group: int, head_dim: int, block_size: int) -> None:
    from pdfabric.kernels.paged_attention_triton import paged_attention_triton

    query_lens = [512, 300, 1, 1, 77, 1]
    seq_lens = [512, 1800, 3000, 1, 100, 63]
    q, kv, meta = make_batch(query_lens, seq_lens, q_heads=4 * group, kv_heads=4, head_dim=head_dim,
                             block_size=block_size, dtype=dtype, seed=group, device="cuda")
    ref = paged_attention_ref(q, kv, meta, head_dim**-0.5)
    for splits in (None, 3):
        assert_close(paged_attention_triton(q, kv, meta, head_dim**-0.5, splits), ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_gather_scatter(dtype: torch.dtype) -> None:
    from pdfabric.kernels.kv_pack_triton import gather_blocks_triton, scatter_blocks_triton
    from pdfabric.kernels.store_kv_triton import store_kv_triton

    kv = torch.randn(2, 300, 16, 8, 128, device="cuda").to(dtype)  # [2, nb, bs, Hkv, D]
    slots = torch.randperm(300 * 16, device="cuda")[:1000]
    key = torch.randn(1000, 8, 128, device="cuda").to(dtype)
    value = torch.randn(1000, 8, 128, device="cuda").to(dtype)
    kv_ref = kv.clone()
    store_kv_ref(key, value, kv_ref, slots)
    store_kv_triton(key, value, kv, slots)
    torch.testing.assert_close(kv, kv_ref, atol=0, rtol=0)

    ids = torch.randperm(300, device="cuda")[:97].to(torch.int32)
    packed = gather_blocks_triton(kv, ids)
    torch.testing.assert_close(packed, gather_blocks_ref(kv, ids), atol=0, rtol=0)
    dst_ids = torch.randperm(300, device="cuda")[:97]
    scatter_blocks_ref(kv_ref, dst_ids, packed)
    scatter_blocks_triton(kv, dst_ids, packed)
    torch.testing.assert_close(kv, kv_ref, atol=0, rtol=0)


def test_auto_backend_picks_triton_on_cuda() -> None:
    from pdfabric.kernels import dispatch

    saved = dispatch.get_backend()
    dispatch.set_backend("auto")
    try:
        assert dispatch._use_triton(torch.zeros(1, device="cuda"))
        assert not dispatch._use_triton(torch.zeros(1))
    finally:
        dispatch.set_backend(saved)
