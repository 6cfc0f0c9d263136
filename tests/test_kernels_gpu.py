"""The compiled Triton kernels against their references at serving sizes, on a CUDA device, and the
batch invariance that the interpreter cannot show: on a GPU a tile's shape picks the MMA instruction,
so only compiled kernels can tell whether a row's bits change with the rows beside it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pdfabric.kernels.attention_ref import paged_attention_ref, store_kv_ref
from pdfabric.kernels.kv_pack_ref import gather_blocks_ref, scatter_blocks_ref
from pdfabric.kernels.layer_ops_ref import rms_norm_ref
from pdfabric.kernels.metadata import AttentionMetadata
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
        assert dispatch.runs_triton(torch.zeros(1, device="cuda"))
        assert not dispatch.runs_triton(torch.zeros(1))
    finally:
        dispatch.set_backend(saved)


# (in_features, out_features): SmolLM2-135M's projections and head, and an 8B model's up projection
SMOL_SHAPES = [(576, 960), (576, 1728), (1536, 576), (576, 49152)]
ROW_COUNTS = [1, 2, 3, 8, 17, 32, 64, 100, 128, 300, 512, 1000, 2048]


def _rows_alone_and_batched(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, counts: list[int]
) -> None:
    """``fn`` of rows alone against the same rows inside the first ``n`` rows, for each count: equal bits."""
    rows = sorted({0, 1, 7, 31, 63, 64, 65, 127, 999, x.shape[0] - 1})
    alone = {r: fn(x[r : r + 1])[0] for r in rows}
    for n in counts:
        got = fn(x[:n])
        for r in rows:
            if r < n:
                assert torch.equal(got[r], alone[r]), (n, r)
    got = fn(x[5:305])  # at an offset: another tile position for every row
    assert all(torch.equal(got[r - 5], alone[r]) for r in rows if 5 <= r < 305)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("k", "n"), [*SMOL_SHAPES, (4096, 14336)])
def test_linear_matches_reference_and_gives_a_row_the_same_bits_in_any_batch(
    dtype: torch.dtype, k: int, n: int
) -> None:
    from pdfabric.kernels.linear_triton import linear_ref, linear_triton

    if dtype == torch.float32 and k == 4096:
        pytest.skip("float32 runs on CUDA cores: 2048 rows of the 8B shape take seconds")
    gen = torch.Generator(device="cuda").manual_seed(k + n)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(dtype)  # [out, in]
    b = torch.randn(n, device="cuda", generator=gen).to(dtype) if n == 960 else None  # a Qwen2-like bias
    x = torch.randn(2048, k, device="cuda", generator=gen).to(dtype)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(linear_triton(x, w, b).float(), linear_ref(x, w, b).float(), **tol)
    _rows_alone_and_batched(lambda rows: linear_triton(rows, w, b), x, ROW_COUNTS)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("k", "n"), [*SMOL_SHAPES, (4096, 14336)])
def test_grouped_linear_matches_reference_and_gives_a_row_the_same_bits_in_any_batch(
    bits: int, k: int, n: int
) -> None:
    from pdfabric.kernels.quantized import GroupedWeight, quantize_int4
    from pdfabric.kernels.quantized_triton import TritonGroupedLinear, grouped_linear_ref

    gen = torch.Generator().manual_seed(k + n + bits)
    if bits == 4:
        g = quantize_int4(torch.randn(n, k, generator=gen) / k**0.5)
    else:
        q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8).view(torch.uint8)
        g = GroupedWeight(q, torch.rand(n, k // 32, generator=gen) / (64 * k**0.5), None, 8)
    layer = TritonGroupedLinear(g, None, torch.device("cuda"))
    x = torch.randn(2048, k, generator=gen).to(device="cuda", dtype=torch.bfloat16)
    tol = {"atol": 3e-2, "rtol": 2e-2}
    torch.testing.assert_close(layer(x).float(), grouped_linear_ref(x, g, None).float(), **tol)
    _rows_alone_and_batched(layer, x, ROW_COUNTS)


@pytest.mark.parametrize(("group", "offsets"), [(16, False), (32, True)])  # Q6_K's; Q5_1's and Q5_K's
def test_cpu_only_gguf_blocks_leave_a_cuda_layer_in_its_dtype(group: int, offsets: bool) -> None:
    """The Triton grouped matmul takes groups of 32 inputs, with offsets for 4 bits only: GGUF's Q6_K
    (groups of 16) and Q5_1 / Q5_K (8 bits with offsets) are multiplied in the compute dtype on CUDA,
    as the weights the loader dequantized."""
    from torch import nn

    from pdfabric.kernels.linear import packed
    from pdfabric.kernels.linear_triton import TritonLinear
    from pdfabric.kernels.quantized import GroupedWeight, dequantize

    q = torch.randint(0, 32, (512, 256), dtype=torch.int8).view(torch.uint8)
    m = torch.randn(512, 256 // group) * 1e-2 if offsets else None
    blocks = GroupedWeight(q, torch.rand(512, 256 // group) * 1e-3, m, 8, group)
    linear = nn.Linear(256, 512, bias=False, device="cuda", dtype=torch.bfloat16)
    linear.weight.data.copy_(dequantize(blocks))
    linear.gguf_blocks = blocks
    layer = packed(linear, "invariant", "gguf")
    assert isinstance(layer, TritonLinear)
    x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(layer(x).float(), linear(x).float(), atol=2e-2, rtol=2e-2)


def test_linear_adds_the_bias_before_its_one_rounding() -> None:
    """Integer inputs make every sum exact in any order; a bias of a fraction then shows the rounding:
    ``round(sum + b)`` (``nn.Linear``'s, one rounding) and not ``round(round(sum) + b)``."""
    from pdfabric.kernels.linear_triton import linear_ref, linear_triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randint(-8, 9, (64, 256), device="cuda", generator=gen).to(torch.bfloat16)
    w = torch.randint(-8, 9, (192, 256), device="cuda", generator=gen).to(torch.bfloat16)
    b = (torch.rand(192, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    got = linear_triton(x, w, b)
    assert torch.equal(got, linear_ref(x, w, b))
    twice = (linear_triton(x, w) + b).to(torch.bfloat16)
    assert not torch.equal(got, twice)  # the data tells the two roundings apart


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 4096])
def test_rms_norm_matches_reference_and_gives_a_row_the_same_bits_in_any_batch(
    dtype: torch.dtype, hidden: int
) -> None:
    from pdfabric.kernels.rms_norm_triton import rms_norm_triton

    gen = torch.Generator(device="cuda").manual_seed(hidden)
    x = (torch.randn(2048, hidden, device="cuda", generator=gen) * 3).to(dtype)
    w = (1 + torch.randn(hidden, device="cuda", generator=gen) / 4).to(dtype)
    tol = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 2**-6}[dtype]  # about an ulp
    torch.testing.assert_close(rms_norm_triton(x, w, 1e-5).float(), rms_norm_ref(x, w, 1e-5).float(),
                               atol=tol, rtol=tol)
    _rows_alone_and_batched(lambda rows: rms_norm_triton(rows, w, 1e-5), x, ROW_COUNTS)


def _attend(
    q: torch.Tensor, kv: torch.Tensor, table: list[int], entries: list[tuple[int, int]]
) -> torch.Tensor:
    """Attention of one sequence's queries ``q[start:end]`` after ``start`` cached keys, for each entry
    ``(start, end)`` of one batch (entries share the sequence's blocks, read only)."""
    from pdfabric.kernels.paged_attention_triton import paged_attention_triton

    bs = kv.shape[2]
    meta = AttentionMetadata.build([e - s for s, e in entries], [e for _, e in entries],
                                   [table[: -(-e // bs)] for _, e in entries], bs, device="cuda")
    return paged_attention_triton(torch.cat([q[s:e] for s, e in entries]), kv, meta, q.shape[2] ** -0.5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim"), [(9, 3, 64), (32, 8, 128), (28, 4, 128)])
def test_a_position_gets_the_same_bits_decoded_and_in_any_prompt_chunk(
    dtype: torch.dtype, q_heads: int, kv_heads: int, head_dim: int
) -> None:
    """Every position of a 3,000-token sequence: decoded (all as one batch of decode rows, and a few
    alone), prefilled in one chunk, in 512-token chunks and in 300-token chunks after a cached prefix,
    and beside a 3,000-token decode row (more splits in the batch): the same bits."""
    length = 3000
    q, kv, meta = make_batch([length], [length], q_heads, kv_heads, head_dim, 16, dtype, seed=q_heads,
                             device="cuda")
    table = meta.block_tables[0].tolist()
    decoded = _attend(q, kv, table, [(p, p + 1) for p in range(length)])  # [length, Hq, D]
    assert_close(decoded, paged_attention_ref(q, kv, meta, head_dim**-0.5))
    for p in (0, 63, 511, 512, 1500, length - 1):
        assert torch.equal(_attend(q, kv, table, [(p, p + 1)])[0], decoded[p]), p
    assert torch.equal(_attend(q, kv, table, [(0, length)]), decoded)
    for size in (512, 300, 77):
        chunks = [_attend(q, kv, table, [(s, min(s + size, length))]) for s in range(0, length, size)]
        assert torch.equal(torch.cat(chunks), decoded), size
    got = _attend(q, kv, table, [(length - 1, length), (700, 1300), (40, 41)])
    assert torch.equal(got[1:601], decoded[700:1300]) and torch.equal(got[601], decoded[40])
