"""The Triton kernels against their torch references on the CPU, through Triton's interpreter.

Isolation: ``triton.jit`` decides when a function is decorated, at import, whether it is compiled or
interpreted, by reading ``TRITON_INTERPRET``; that includes Triton's own library functions
(``tl.max``, ``tl.sum``), decorated when ``triton`` is first imported. So the interpreter works only
in a process that had the variable set before anything imported Triton, which a shared pytest
process cannot promise. ``test_kernels_in_interpreter_process`` therefore runs this file in a child
pytest process with ``TRITON_INTERPRET=1``; in the parent the cases below are skipped, and in the
child the runner is. Nothing leaks: the parent's environment and modules are never touched. To
debug one case, run ``TRITON_INTERPRET=1 pytest tests/test_kernels_interpreter.py -k NAME``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pdfabric.kernels import dispatch
from pdfabric.kernels.attention_ref import paged_attention_ref, store_kv_ref
from pdfabric.kernels.kv_pack_ref import gather_blocks_ref, scatter_blocks_ref
from pdfabric.kernels.layer_ops_ref import rms_norm_ref
from pdfabric.kernels.metadata import AttentionMetadata
from pdfabric.kernels.testing import assert_close, make_batch

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
in_child = pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 child process")

if INTERPRETING:
    pytest.importorskip("triton")
    from pdfabric.kernels import kv_pack_triton as pack
    from pdfabric.kernels import linear_triton as lin
    from pdfabric.kernels import paged_attention_triton as pa
    from pdfabric.kernels import quantized_triton as qt
    from pdfabric.kernels import rms_norm_triton as norm
    from pdfabric.kernels import store_kv_triton as store


@pytest.mark.skipif(INTERPRETING, reason="this is the child process")
def test_kernels_in_interpreter_process() -> None:
    """Runs this file's cases in a fresh process whose Triton is imported in interpreter mode."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", __file__]
    proc = subprocess.run(
        cmd, env=env, cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, f"interpreter cases failed:\n{proc.stdout[-8000:]}\n{proc.stderr[-2000:]}"
    assert " passed" in proc.stdout and " failed" not in proc.stdout, proc.stdout[-2000:]


@pytest.fixture(autouse=True)
def _triton_backend() -> Iterator[None]:
    """In the child, forces the public entry points to Triton for each case; restores the choice."""
    saved = dispatch.get_backend()
    if INTERPRETING:
        dispatch.set_backend("triton")
    yield
    dispatch.set_backend(saved)


# (query_lens, seq_lens): one-token contexts, lengths off the block size, a context over many blocks
DECODE = ([1, 1, 1, 1], [1, 17, 16, 150])
# fresh prefill, a chunk continuing a cached prompt, decode steps, a one-token prompt
MIXED = ([20, 7, 1, 1], [20, 45, 33, 1])


@in_child
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_decode_gqa(group: int) -> None:
    q, kv, meta = make_batch(
        *DECODE, q_heads=2 * group, kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32, seed=group
    )
    out = pa.paged_attention_triton(q, kv, meta, 0.2)
    assert_close(out, paged_attention_ref(q, kv, meta, 0.2))


@in_child
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [None, 3])
def test_decode_dtypes_and_splits(dtype: torch.dtype, num_splits: int | None) -> None:
    # 16-token blocks, head_dim 24 (padded to 32 inside the kernel), 3 query heads per KV head
    q, kv, meta = make_batch(
        [1, 1, 1], [1, 300, 97], q_heads=6, kv_heads=2, head_dim=24, block_size=16, dtype=dtype, seed=7
    )
    out = pa.paged_attention_triton(q, kv, meta, 24**-0.5, num_splits)
    assert_close(out, paged_attention_ref(q, kv, meta, 24**-0.5))


@in_child
@pytest.mark.parametrize(
    ("dtype", "group", "block_size", "num_splits"),
    [
        (torch.float32, 1, 16, None),
        (torch.float16, 4, 8, None),
        (torch.bfloat16, 2, 16, 2),
        (torch.float32, 3, 32, 2),
    ],
)
@in_child
def test_mixed_prefill_chunks(
    dtype: torch.dtype, group: int, block_size: int, num_splits: int | None
) -> None:
    q, kv, meta = make_batch(
        *MIXED, q_heads=group, kv_heads=1, head_dim=32, block_size=block_size, dtype=dtype, seed=group
    )
    out = pa.paged_attention_triton(q, kv, meta, 0.17, num_splits)
    assert_close(out, paged_attention_ref(q, kv, meta, 0.17))


@in_child
@pytest.mark.parametrize("seed", range(6))
def test_random_batches(seed: int) -> None:
    """Random mixes of decode steps and prefill chunks, one long context over ~60 blocks."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [int(x) for x in torch.randint(1, 70, (4,), generator=gen)] + [1000]
    query_lens = [
        int(torch.randint(1, s + 1, (1,), generator=gen)) if i % 2 else 1 for i, s in enumerate(seq_lens)
    ]
    group = (1, 2, 4, 8)[seed % 4]
    dtype = (torch.float32, torch.float16, torch.bfloat16)[seed % 3]
    q, kv, meta = make_batch(
        query_lens,
        seq_lens,
        q_heads=group,
        kv_heads=1,
        head_dim=16,
        block_size=(16, 8, 32)[seed % 3],
        dtype=dtype,
        seed=seed,
    )
    assert_close(dispatch.paged_attention(q, kv, meta, 0.25), paged_attention_ref(q, kv, meta, 0.25))


@in_child
def test_strided_query_and_dispatch() -> None:
    """q as a view into a fused projection, through the public entry point forced to Triton."""
    _, kv, meta = make_batch(
        *MIXED, q_heads=4, kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32, seed=3
    )
    qkv = torch.randn(meta.num_tokens, 8, 32)  # [T, Hq + 2 * Hkv, D]
    q = qkv[:, :4]  # [T, Hq, D], token stride 8 * 32
    assert not q.is_contiguous()
    assert_close(dispatch.paged_attention(q, kv, meta, 0.3), paged_attention_ref(q, kv, meta, 0.3))


@in_child
def test_splits_are_a_fixed_length_that_covers_the_context() -> None:
    assert pa.choose_num_splits(100) == 1 and pa.choose_num_splits(512) == 1
    assert pa.choose_num_splits(513) == 2 and pa.choose_num_splits(4096) == 8
    assert pa.split_tokens(131_072) == 512 and pa.split_tokens(131_073) == 1024  # past 256 splits


@in_child
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_row_is_the_same_alone_and_beside_longer_contexts(dtype: torch.dtype) -> None:
    """Splits are cut at the same keys whatever the batch: a row alone (one split, no merge) and beside
    a 1,300-token context (three splits, merged) gives the same bits."""
    q, kv, meta = make_batch([1, 1, 1], [300, 1300, 700], 8, 1, 32, 16, dtype, seed=6)  # MQA
    together = pa.paged_attention_triton(q, kv, meta, 0.2)
    tables = meta.block_tables.tolist()
    for row, ctx in enumerate((300, 1300, 700)):
        blocks = tables[row][: -(-ctx // 16)]
        alone_meta = AttentionMetadata.build([1], [ctx], [blocks], 16)
        alone = pa.paged_attention_triton(q[row : row + 1], kv, alone_meta, 0.2)
        assert torch.equal(alone[0], together[row]), row


def _position_alone_and_in_chunks(
    q: torch.Tensor, kv: torch.Tensor, table: list[int], pos: int, chunks: list[tuple[int, int]],
    beside: int | None,
) -> None:
    """``pos`` decoded (one query after ``pos`` cached keys) against the same position inside each prompt
    chunk ``[start, end)`` after ``start`` cached keys, optionally beside a decode row of ``beside`` keys
    (more splits in the batch); all of one sequence whose keys are ``kv`` through ``table``."""
    bs = kv.shape[2]

    def run(query_lens: list[int], seq_lens: list[int], rows: torch.Tensor) -> torch.Tensor:
        tables = [table[: -(-n // bs)] for n in seq_lens]
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, bs)
        return pa.paged_attention_triton(rows, kv, meta, 0.2)

    want = run([1], [pos + 1], q[pos : pos + 1])[0]  # [Hq, D]
    for start, end in chunks:
        lens, seqs, rows = [end - start], [end], [q[start:end]]
        if beside is not None:
            lens, seqs, rows = [1, *lens], [beside, *seqs], [q[beside - 1 : beside], *rows]
        got = run(lens, seqs, torch.cat(rows))
        assert torch.equal(got[pos - start + len(lens) - 1], want), (pos, start, end, beside)


@in_child
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_row_equals_the_same_position_in_any_prompt_chunk(dtype: torch.dtype) -> None:
    """Decode rows and prompt tiles share one tile shape, split boundaries and merge: a position gets the
    same bits decoded, in a prompt chunk of any size, after a cached prefix, and across the 512-key
    splits (contexts of 700 and 1,300 keys; 3 query heads per KV head: tiles of 21 tokens)."""
    q, kv, meta = make_batch([1300], [1300], 3, 1, head_dim=16, block_size=16, dtype=dtype, seed=9)
    table = meta.block_tables[0].tolist()
    _position_alone_and_in_chunks(q, kv, table, 20, [(0, 21), (15, 22)], beside=None)
    _position_alone_and_in_chunks(q, kv, table, 512, [(505, 526)], beside=None)  # first key of split 1
    _position_alone_and_in_chunks(q, kv, table, 699, [(680, 700), (690, 701)], beside=1300)
    _position_alone_and_in_chunks(q, kv, table, 1299, [(1285, 1300)], beside=None)


@in_child
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_reference(dtype: torch.dtype, bias: bool) -> None:
    """96 inputs (a full and a part step of 64), 200 outputs (a full and a part tile of 128)."""
    gen = torch.Generator().manual_seed(2)
    w = (torch.randn(200, 96, generator=gen) / 96**0.5).to(dtype)  # [out, in]
    b = torch.randn(200, generator=gen).to(dtype) if bias else None
    layer = lin.TritonLinear(w, b)
    for rows in (1, 70):
        x = torch.randn(rows, 96, generator=gen).to(dtype)
        got = layer(x)
        tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
        torch.testing.assert_close(got.float(), lin.linear_ref(x, w, b).float(), **tol)
    x = torch.randn(2, 5, 96, generator=gen).to(dtype)
    assert layer(x).shape == (2, 5, 200)
    assert torch.equal(layer(x)[1], layer(x[1]))


@in_child
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_gives_a_row_the_same_bits_in_any_batch(dtype: torch.dtype) -> None:
    """A row alone and among 2 to 300 rows (one row tile to five, at any offset) gets the same bits."""
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(136, 100, generator=gen) / 10).to(dtype)
    b = torch.randn(136, generator=gen).to(dtype)
    x = torch.randn(300, 100, generator=gen).to(dtype)
    batches = ((0, 2), (5, 3), (40, 17), (100, 64), (0, 300))
    rows = sorted({r for start, n in batches for r in (start, start + n - 1, start + n // 2)} | {63, 64, 299})
    alone = {r: lin.linear_triton(x[r : r + 1], w, b)[0] for r in rows}
    for start, n in batches:
        got = lin.linear_triton(x[start : start + n], w, b)
        for r in rows:
            if start <= r < start + n:
                assert torch.equal(got[r - start], alone[r]), (start, n, r)


def _grouped(n: int, k: int, bits: int, gen: torch.Generator):  # noqa: ANN202 - GroupedWeight
    from pdfabric.kernels.quantized import GroupedWeight, quantize_int4

    if bits == 4:  # int4, with offsets of their own (as Q4_1's) so that the offset term is checked
        g = quantize_int4(torch.randn(n, k, generator=gen) / k**0.5)
        return GroupedWeight(g.q, g.scales, torch.randn(n, k // 32, generator=gen) * 0.01, 4)
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8).view(torch.uint8)
    return GroupedWeight(q, torch.rand(n, k // 32, generator=gen) * 0.002, None, 8)


@in_child
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
def test_grouped_linear_matches_reference_and_gives_a_row_the_same_bits_in_any_batch(
    dtype: torch.dtype, bits: int
) -> None:
    """96 inputs (three groups), 200 outputs (a full and a part tile of 128), rows alone and in batches."""
    gen = torch.Generator().manual_seed(bits)
    g = _grouped(200, 96, bits, gen)
    b = torch.randn(200, generator=gen).to(dtype)
    layer = qt.TritonGroupedLinear(g, b, torch.device("cpu"))
    x = torch.randn(70, 96, generator=gen).to(dtype)
    got = layer(x)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}
    torch.testing.assert_close(got.float(), qt.grouped_linear_ref(x, g, b).float(), **tol)
    for start, n in ((0, 1), (3, 2), (5, 64), (60, 10)):
        assert torch.equal(layer(x[start : start + n]), got[start : start + n]), (start, n)
    with pytest.raises(ValueError, match="multiple of 32"):
        qt.grouped_linear_triton(torch.randn(3, 40).to(dtype), layer.q, layer.scales, layer.offsets, bits)


@in_child
def test_linear_rejects_bad_arguments() -> None:
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match="in_features"):
        lin.linear_triton(torch.randn(3, 15), w)
    with pytest.raises(ValueError, match="weight is torch.float16"):
        lin.linear_triton(torch.randn(3, 16), w.half())
    with pytest.raises(ValueError, match="unit stride"):
        lin.linear_triton(torch.randn(16, 3).t(), w)
    with pytest.raises(ValueError, match="bias must be"):
        lin.linear_triton(torch.randn(3, 16), w, torch.randn(7))


@in_child
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rms_norm_matches_reference(dtype: torch.dtype) -> None:
    """SmolLM2's hidden size (576, a block of 1,024), rows read through a stride, the dispatch entry."""
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(7, 700, generator=gen) * 3).to(dtype)[:, :576]  # row stride 700
    w = (1 + torch.randn(576, generator=gen) / 4).to(dtype)
    got = norm.rms_norm_triton(x, w, 1e-5)
    want = rms_norm_ref(x, w, 1e-5)
    # fp32 to an ulp; fp16 to an ulp of h and of the product; bf16 wider: the interpreter truncates to
    # bf16 where compiled Triton rounds to nearest (the GPU test checks that)
    tol = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert torch.equal(dispatch.rms_norm(x, w, 1e-5), got)
    assert torch.equal(norm.rms_norm_triton(x[3:4], w, 1e-5)[0], got[3])
    with pytest.raises(ValueError, match="weight is"):
        norm.rms_norm_triton(x, w.float() if dtype != torch.float32 else w.half(), 1e-5)


@in_child
@pytest.mark.parametrize(
    ("src_dtype", "cache_dtype"),
    [(torch.float32, torch.float32), (torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16)],
)
def test_store_kv(src_dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    kv_ref = torch.randn(2, 6, 4, 2, 24).to(cache_dtype)  # [2, nb, bs, Hkv, D]
    kv_tri = kv_ref.clone()
    slots = torch.tensor([5, 0, 23, 9, 10], dtype=torch.int64)
    fused = torch.randn(5, 6, 24).to(src_dtype)  # [T, Hq + 2 * Hkv, D]: key and value as strided views
    key, value = fused[:, 2:4], fused[:, 4:6]
    store_kv_ref(key, value, kv_ref, slots)
    store.store_kv_triton(key, value, kv_tri, slots)
    torch.testing.assert_close(kv_tri, kv_ref, atol=0, rtol=0)


@in_child
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_gather_then_scatter(ids_dtype: torch.dtype) -> None:
    kv = torch.randn(2, 9, 8, 2, 16).to(torch.float16)  # [2, nb, bs, Hkv, D]
    ids = torch.tensor([7, 2, 3, 0], dtype=ids_dtype)
    packed = pack.gather_blocks_triton(kv, ids)
    torch.testing.assert_close(packed, gather_blocks_ref(kv, ids), atol=0, rtol=0)
    out = torch.empty_like(packed)
    assert pack.gather_blocks_triton(kv, ids, out) is out
    torch.testing.assert_close(out, packed, atol=0, rtol=0)

    dst_ref, dst_tri = torch.zeros_like(kv), torch.zeros_like(kv)
    dst_ids = torch.tensor([1, 8, 4, 5], dtype=ids_dtype)
    frame = packed.float() * 2  # a float32 frame into a float16 cache
    scatter_blocks_ref(dst_ref, dst_ids, frame)
    pack.scatter_blocks_triton(dst_tri, dst_ids, frame)
    torch.testing.assert_close(dst_tri, dst_ref, atol=0, rtol=0)


@in_child
def test_bad_block_table_is_rejected_before_launch() -> None:
    q, kv, meta = make_batch(
        [1, 1], [5, 40], q_heads=2, kv_heads=1, head_dim=16, block_size=16, dtype=torch.float32
    )
    tables = meta.block_tables.clone()
    tables[1, 2] = kv.shape[1]  # one past the last block
    bad = type(meta)(
        meta.query_start_loc,
        meta.seq_lens,
        tables,
        meta.slot_mapping,
        meta.query_lens_host,
        meta.seq_lens_host,
    )
    with pytest.raises(ValueError, match="block_tables"):
        pa.paged_attention_triton(q, kv, bad, 1.0)
    tables[1, 2] = meta.block_tables[1, 2]
    tables[0, 1] = 10_000  # padding past sequence 0's single block is never read
    ok = type(meta)(
        meta.query_start_loc,
        meta.seq_lens,
        tables,
        meta.slot_mapping,
        meta.query_lens_host,
        meta.seq_lens_host,
    )
    assert_close(pa.paged_attention_triton(q, kv, ok, 1.0), paged_attention_ref(q, kv, meta, 1.0))


@in_child
def test_bad_arguments_are_rejected() -> None:
    q, kv, meta = make_batch([1], [5], q_heads=2, kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32)
    with pytest.raises(ValueError, match="kv_cache is torch.float16"):
        pa.paged_attention_triton(q, kv.half(), meta, 1.0)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        pa.paged_attention_triton(torch.randn(1, 3, 16), kv, meta, 1.0)
    with pytest.raises(ValueError, match="unit stride"):
        pa.paged_attention_triton(torch.randn(1, 2, 32)[:, :, ::2], kv, meta, 1.0)
    with pytest.raises(ValueError, match="block_ids holds 99"):
        pack.gather_blocks_triton(kv, torch.tensor([0, 99]))
    with pytest.raises(ValueError, match="packed must be"):
        pack.scatter_blocks_triton(kv, torch.tensor([0]), torch.zeros(2, 2, 16, 2, 16))
    with pytest.raises(ValueError, match="slot_mapping holds -1"):
        store.store_kv_triton(torch.zeros(1, 2, 16), torch.zeros(1, 2, 16), kv, torch.tensor([-1]))
