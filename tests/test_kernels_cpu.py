"""The CPU kernels against their torch references: C decode and prefill attention, SDPA prompt
attention where the prefill kernel does not apply, packed linear layers, and the build cache behind
the C kernels."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdfabric.kernels import cpu_build, dispatch, paged_attention
from pdfabric.kernels.attention_ref import paged_attention_ref, store_kv_ref
from pdfabric.kernels.layer_ops_cpu import can_store_kv, rms_norm_cpu, rope_cpu, silu_mul_cpu, store_kv_cpu
from pdfabric.kernels.layer_ops_ref import rms_norm_ref, rope_ref, silu_mul_ref
from pdfabric.kernels.linear import pack_linears
from pdfabric.kernels.linear_cpu import LINEAR_KINDS, InvariantLinear, amx_tiles, can_pack, packed
from pdfabric.kernels.paged_attention_cpu import (
    attention_amx,
    decodes_as_prefill,
    paged_attention_cpu,
    prefill_rows,
    prefill_supported,
    supports,
)
from pdfabric.kernels.testing import assert_close, make_batch


@pytest.fixture
def c_kernel() -> None:
    """Skips a case where the C kernel cannot be built (no C compiler)."""
    if cpu_build.load("paged_decode_cpu") is None:
        pytest.skip("the C kernel cannot be built on this machine")


needs_kernel = pytest.mark.usefixtures("c_kernel")

CASES = [
    # query_lens, seq_lens, q_heads, kv_heads, head_dim, block_size
    ([1], [1], 2, 2, 16, 4),  # one cached token
    ([1, 1, 1], [5, 64, 17], 8, 2, 64, 16),  # decode, GQA 4
    ([1] * 6, [300, 1, 33, 16, 17, 90], 16, 8, 64, 16),  # cpu-small's heads
    ([1, 1], [40, 7], 4, 1, 128, 1),  # MQA, block size 1
    ([13, 1, 4, 1], [13, 31, 20, 2], 4, 2, 32, 4),  # mixed: prefill, decode, chunk, decode
    ([9], [9], 8, 8, 16, 16),  # prompt only, no GQA
]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"q{c[0]}-s{c[1]}-h{c[2]}x{c[3]}-d{c[4]}-b{c[5]}")
def test_cpu_attention_matches_reference(case: tuple, dtype: torch.dtype) -> None:
    query_lens, seq_lens, q_heads, kv_heads, head_dim, block = case
    q, kv, meta = make_batch(query_lens, seq_lens, q_heads, kv_heads, head_dim, block, dtype, seed=7)
    assert supports(q, kv)
    assert_close(
        paged_attention_cpu(q, kv, meta, head_dim**-0.5), paged_attention_ref(q, kv, meta, head_dim**-0.5)
    )


@needs_kernel
def test_decode_rows_read_strided_queries() -> None:
    # In the model, q is a view into the fused QKV projection: rows are further apart than heads.
    q, kv, meta = make_batch([1, 1, 1], [10, 3, 40], 4, 2, 16, 4, torch.float32, seed=3)
    wide = torch.randn(3, 8, 16)
    wide[:, :4] = q
    strided = wide[:, :4]
    assert not strided.is_contiguous()
    torch.testing.assert_close(
        paged_attention_cpu(strided, kv, meta, 0.25), paged_attention_ref(q, kv, meta, 0.25)
    )


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_row_does_not_depend_on_the_batch(dtype: torch.dtype) -> None:
    """Bit for bit: a sequence's decode output is the same alone and in any batch (token-exactness
    across batch shapes rests on this)."""
    q, kv, meta = make_batch([1] * 5, [70, 3, 129, 16, 1], 16, 8, 64, 16, dtype, seed=11)
    batched = paged_attention_cpu(q, kv, meta, 0.125)
    for s in range(5):
        one = type(meta).build([1], [meta.seq_lens_host[s]], [meta.block_tables[s].tolist()], 16)
        alone = paged_attention_cpu(q[s : s + 1], kv, one, 0.125)
        assert torch.equal(alone[0], batched[s])


@needs_kernel
def test_auto_backend_runs_the_cpu_kernel_and_torch_backend_the_reference() -> None:
    q, kv, meta = make_batch([1, 3], [9, 3], 4, 2, 16, 4, torch.bfloat16, seed=5)
    saved = dispatch.get_backend()
    try:
        dispatch.set_backend("auto")
        assert torch.equal(paged_attention(q, kv, meta, 0.25), paged_attention_cpu(q, kv, meta, 0.25))
        dispatch.set_backend("torch")
        assert torch.equal(paged_attention(q, kv, meta, 0.25), paged_attention_ref(q, kv, meta, 0.25))
    finally:
        dispatch.set_backend(saved)


def test_unsupported_shapes_fall_back_to_the_reference() -> None:
    # head_dim 8 is not a multiple of the kernel's 16 lanes; float16 is not a kernel dtype.
    q, kv, meta = make_batch([1], [5], 2, 1, 8, 4, torch.float32)
    assert not supports(q, kv)
    torch.testing.assert_close(paged_attention(q, kv, meta, 0.3), paged_attention_ref(q, kv, meta, 0.3))
    q, kv, meta = make_batch([1], [5], 2, 1, 16, 4, torch.float16)
    assert not supports(q, kv)


def _need_prefill_kernel(q: torch.Tensor, kv: torch.Tensor) -> None:
    """Skips a case where the C prefill kernel does not serve (no compiler; bfloat16 without AVX512-BF16)."""
    if not prefill_supported(q, kv):
        pytest.skip(f"the C prefill kernel does not serve {kv.dtype} on this machine")


PREFILL_CASES = [
    # query_lens, seq_lens, q_heads, kv_heads, head_dim, block_size
    ([100], [100], 16, 8, 64, 16),  # cpu-small's heads, a whole prompt
    ([37], [90], 16, 8, 128, 16),  # a chunk after 53 cached tokens
    ([300, 1, 17], [300, 20, 17], 8, 2, 64, 4),  # prompts around a decode row, GQA 4
    ([5], [5], 4, 4, 64, 1),  # shorter than a tile, no GQA, block size 1
    ([65], [129], 16, 1, 64, 16),  # MQA 16, keys past one 64-key panel
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: f"q{c[0]}-s{c[1]}-h{c[2]}x{c[3]}-d{c[4]}")
def test_prefill_kernel_matches_reference(case: tuple, dtype: torch.dtype) -> None:
    q, kv, meta = make_batch(*case, dtype, seed=5)
    _need_prefill_kernel(q, kv)
    assert_close(paged_attention_cpu(q, kv, meta, 0.125), paged_attention_ref(q, kv, meta, 0.125))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_kernel_reads_strided_queries_and_ignores_the_thread_count(dtype: torch.dtype) -> None:
    q, kv, meta = make_batch([70], [90], 8, 2, 64, 16, dtype, seed=2)
    _need_prefill_kernel(q, kv)
    wide = torch.zeros(70, 12, 64, dtype=dtype)  # q inside a fused QKV row, as in the model
    wide[:, :8] = q
    runs = []
    saved = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            out = torch.empty_like(q)
            prefill_rows(wide[:, :8], kv, meta.block_tables[0], 90, 0.125, out)
            runs.append(out)
    finally:
        torch.set_num_threads(saved)
    assert all(torch.equal(runs[0], other) for other in runs[1:])  # bit for bit
    assert_close(runs[0], paged_attention_ref(q, kv, meta, 0.125))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape", [(9, 3, 64, 16), (16, 8, 64, 16), (8, 2, 128, 16), (4, 4, 64, 4), (16, 1, 64, 1)]
)
def test_a_decode_row_equals_the_same_position_in_any_prompt_chunk(shape: tuple, dtype: torch.dtype) -> None:
    """Bit for bit, in bfloat16 and float32: the attention of the last token of a sequence is the same
    computed as a decode row (alone or among others) as inside a prompt chunk of any length ending
    there, so a sequence's KV and logits do not depend on how its tokens were split into steps (chunked
    prefill, a prefix-cache hit, a failover's re-prefill of prompt and streamed tokens)."""
    q_heads, kv_heads, head_dim, block = shape
    seq_len = 150  # past two 64-key panels and not a multiple of 16
    q, kv, meta = make_batch([seq_len], [seq_len], q_heads, kv_heads, head_dim, block, dtype, seed=4)
    _need_prefill_kernel(q, kv)
    if not decodes_as_prefill(dtype):
        pytest.skip(f"{dtype} decode rows run the prompt kernel's arithmetic only on CPUs with AVX-512")
    table = meta.block_tables[0].tolist()
    build = type(meta).build
    for last in (seq_len, 149, 97, 64, 17, 1):  # the position whose row is compared
        want = None
        for chunk in (1, 2, 15, 16, 33, last):
            if chunk > last:
                continue
            chunk_meta = build([chunk], [last], [table], block)
            got = paged_attention_cpu(q[last - chunk : last], kv, chunk_meta, 0.125)[-1]
            want = got if want is None else want
            assert torch.equal(got, want), (last, chunk)
        # and as one decode row among others of other lengths
        rows = build([1, 1, 1], [5, last, 120], [table, table, table], block)
        batched = paged_attention_cpu(torch.stack([q[4], q[last - 1], q[119]]), kv, rows, 0.125)
        assert torch.equal(batched[1], want), last


@pytest.mark.parametrize("shape", [(9, 3, 64, 16), (8, 2, 128, 4), (4, 4, 64, 1)])
def test_attention_on_amx_tiles_keeps_a_positions_bits_decoded_or_prefilled(shape: tuple) -> None:
    """On a CPU with AMX both products of bfloat16 attention run on the tiles for every row
    (csrc/paged_prefill_cpu.c): a decode row (a tile of its query heads) gets the bits of the same
    position inside prompt chunks of any length (tiles of 16 rows), and the results are as close to
    the float32 reference as the VDPBF16PS path's, which the same build takes with the tiles off."""
    if not attention_amx():
        pytest.skip("no AMX tiles on this CPU (or not granted by the kernel)")
    q_heads, kv_heads, head_dim, block = shape
    seq_len = 150
    q, kv, meta = make_batch([seq_len], [seq_len], q_heads, kv_heads, head_dim, block, torch.bfloat16, seed=7)
    table = meta.block_tables[0].tolist()
    build = type(meta).build
    ref = paged_attention_ref(q, kv, meta, 0.125)
    try:
        outs = {}
        for tiles in (True, False):
            assert attention_amx(tiles) == tiles
            whole = paged_attention_cpu(q, kv, meta, 0.125)
            assert_close(whole, ref)
            for last in (150, 97, 64, 17, 1):
                rows = build([1, 1], [5, last], [table, table], block)
                decoded = paged_attention_cpu(torch.stack([q[4], q[last - 1]]), kv, rows, 0.125)[1]
                assert torch.equal(decoded, whole[last - 1]), (tiles, last)
                for chunk in (c for c in (2, 15, 33) if c <= last):
                    part_meta = build([chunk], [last], [table], block)
                    part = paged_attention_cpu(q[last - chunk : last], kv, part_meta, 0.125)
                    assert torch.equal(part[-1], whole[last - 1]), (tiles, last, chunk)
            outs[tiles] = whole
    finally:
        attention_amx(True)
    assert not torch.equal(outs[True], outs[False])  # the tiles' own order of summation: another path


def test_prefill_kernel_declines_what_it_cannot_do() -> None:
    # bfloat16 head_dim 32 is below one 64-dim register block, float32 head_dim 8 below a 16-float
    # vector; float16 has no kernel. They take SDPA.
    for head_dim, dtype in ((32, torch.bfloat16), (8, torch.float32), (64, torch.float16)):
        q, kv, meta = make_batch([9], [9], 4, 2, head_dim, 4, dtype)
        assert not prefill_supported(q, kv)
    q, kv, meta = make_batch([9], [9], 4, 2, 32, 4, torch.bfloat16)
    assert_close(paged_attention(q, kv, meta, 0.2), paged_attention_ref(q, kv, meta, 0.2))


@pytest.fixture
def layer_ops() -> None:
    if cpu_build.load("layer_ops_cpu") is None:
        pytest.skip("the C layer ops cannot be built on this machine")


def _rope_tables(tokens: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.arange(tokens).float()[:, None] * inv_freq[None, :]
    return freqs.cos().repeat(1, 2)[:, None], torch.cat((-freqs.sin(), freqs.sin()), -1)[:, None]


def _layer_tol(dtype: torch.dtype) -> dict[str, float]:
    # float32 may differ by an ulp (another rsqrt, exp); bfloat16 by one rounding step where a float32
    # result sits on a bfloat16 tie
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}


@pytest.mark.usefixtures("layer_ops")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_ops_match_their_references(dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    for rows in (1, 5, 300):  # one thread below PARALLEL_MIN elements, all threads above
        x = (torch.randn(rows, 1000) * 3).to(dtype)  # hidden not a multiple of 16: a tail
        weight = (torch.rand(1000) + 0.5).to(dtype)
        tol = _layer_tol(dtype)
        torch.testing.assert_close(rms_norm_cpu(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5), **tol)
        qkv = torch.randn(rows, 12, 64).to(dtype)  # q and k heads inside a wider fused row
        cos, sin = _rope_tables(rows, 64)
        torch.testing.assert_close(rope_cpu(qkv[:, :8], cos, sin), rope_ref(qkv[:, :8], cos, sin), **tol)
        gate_up = (torch.randn(rows, 2 * 352) * 4).to(dtype)
        torch.testing.assert_close(silu_mul_cpu(gate_up), silu_mul_ref(gate_up), **tol)


@pytest.mark.usefixtures("layer_ops")
def test_layer_ops_rows_do_not_depend_on_the_batch() -> None:
    torch.manual_seed(4)
    x = torch.randn(200, 512, dtype=torch.bfloat16)
    weight = torch.rand(512, dtype=torch.bfloat16)
    batched = rms_norm_cpu(x, weight, 1e-6)
    gate_up = torch.randn(200, 1024, dtype=torch.bfloat16)
    act = silu_mul_cpu(gate_up)
    for r in (0, 77, 199):
        assert torch.equal(rms_norm_cpu(x[r : r + 1], weight, 1e-6)[0], batched[r])
        assert torch.equal(silu_mul_cpu(gate_up[r : r + 1])[0], act[r])


@pytest.mark.usefixtures("layer_ops")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_matches_the_reference_and_checks_slots(dtype: torch.dtype) -> None:
    torch.manual_seed(5)
    qkv = torch.randn(40, 8, 16).to(dtype)  # k and v inside a fused row, as in the model
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    slots = torch.randperm(12 * 4)[:40]
    want, got = torch.zeros(2, 12, 4, 2, 16, dtype=dtype), torch.zeros(2, 12, 4, 2, 16, dtype=dtype)
    store_kv_ref(key, value, want, slots)
    assert can_store_kv(key, got)
    store_kv_cpu(key, value, got, slots)
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="pd_store_kv"):
        store_kv_cpu(key[:1], value[:1], got, torch.tensor([48]))  # past the cache's last slot


def test_the_torch_backend_runs_the_layer_references() -> None:
    x = torch.randn(3, 32)
    saved = dispatch.get_backend()
    try:
        dispatch.set_backend("torch")
        assert torch.equal(dispatch.silu_and_mul(x), silu_mul_ref(x))
        assert torch.equal(dispatch.rms_norm(x, torch.ones(32), 1e-6), rms_norm_ref(x, torch.ones(32), 1e-6))
    finally:
        dispatch.set_backend(saved)


@pytest.fixture
def fresh_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty kernel cache and a forgotten library, restored afterwards."""
    monkeypatch.setenv("PDFABRIC_CACHE_DIR", str(tmp_path))
    cpu_build.load.cache_clear()
    yield tmp_path / "kernels"
    cpu_build.load.cache_clear()


def test_without_a_compiler_the_reference_serves(
    fresh_build: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    q, kv, meta = make_batch([1, 2], [6, 2], 4, 2, 16, 4, torch.float32)
    assert not supports(q, kv)
    assert "no C compiler" in caplog.text
    torch.testing.assert_close(paged_attention(q, kv, meta, 0.25), paged_attention_ref(q, kv, meta, 0.25))


@needs_kernel
def test_the_library_is_built_once_per_cache(fresh_build: Path) -> None:
    assert cpu_build.load("paged_decode_cpu") is not None
    built = list(fresh_build.glob("paged_decode_cpu-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    cpu_build.load.cache_clear()
    assert cpu_build.load("paged_decode_cpu") is not None
    assert built[0].stat().st_mtime_ns == stamp  # loaded from the cache, not rebuilt
    assert not list(fresh_build.glob(".*"))  # no temporary file left behind


def test_a_failing_build_falls_back(fresh_build: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    assert cpu_build.load("paged_decode_cpu") is None
    assert not list(fresh_build.glob("*.so"))


@pytest.mark.parametrize("kind", LINEAR_KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_linear(kind: str, dtype: torch.dtype, bias: bool) -> None:
    torch.manual_seed(0)
    # 80 outputs: one full 64-column panel and a part one; 97 inputs: an odd count (a bfloat16 pair short)
    layer = nn.Linear(97, 80, bias=bias).to(dtype)
    if not can_pack(layer, kind):
        pytest.skip(f"{dtype} layers are not packed for {kind} on this CPU")
    packed_layer = packed(layer, kind)
    for rows in (1, 7, 64, 200):
        x = torch.randn(rows, 97, dtype=dtype)
        bias_ = None if layer.bias is None else layer.bias.double()
        want = F.linear(x.double(), layer.weight.double(), bias_)
        tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
        torch.testing.assert_close(packed_layer(x).double(), want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_linear_gives_a_row_the_same_bits_in_any_batch(dtype: torch.dtype) -> None:
    """A row's output alone, among 2 to 300 rows (several register tiles and row blocks), at any offset
    and on one or two threads is the same to the bit: its sum never changes order. oneDNN fails this
    for a 1536-input projection (the row alone is summed in another order than in a batch)."""
    torch.manual_seed(0)
    layer = nn.Linear(1536, 200).to(dtype)
    if not can_pack(layer, "invariant"):
        pytest.skip(f"{dtype} layers are not packed on this CPU")
    packed_layer = InvariantLinear(layer.weight, layer.bias)
    x = torch.randn(300, 1536, dtype=dtype)
    alone = torch.cat([packed_layer(x[i : i + 1]) for i in range(300)])
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for start, rows in ((0, 2), (5, 7), (1, 33), (0, 97), (3, 200), (0, 300)):
                got = packed_layer(x[start : start + rows])
                assert torch.equal(got, alone[start : start + rows]), (count, start, rows)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("shape", [(200, 1536), (80, 97), (130, 31)])
def test_bfloat16_on_amx_tiles_keeps_a_rows_bits_in_any_batch(shape: tuple) -> None:
    """On a CPU with AMX every bfloat16 row goes through the tiles (csrc/linear_amx.h): a row alone (padded
    to a tile of 16), in part tiles and in whole ones, with K a multiple of 32, odd or below one step,
    gets the same bits; the tiles' sums are as close to float64's as VDPBF16PS's, whose path the same
    build takes with the tiles turned off."""
    if not amx_tiles():
        pytest.skip("no AMX tiles on this CPU (or not granted by the kernel)")
    n, k = shape
    torch.manual_seed(n + k)
    layer = nn.Linear(k, n).to(torch.bfloat16)
    packed_layer = InvariantLinear(layer.weight, layer.bias)
    x = torch.randn(100, k, dtype=torch.bfloat16)
    want = F.linear(x.double(), layer.weight.double(), layer.bias.double())
    try:
        results = {}
        for tiles in (True, False):
            assert amx_tiles(tiles) == tiles
            y = packed_layer(x)
            alone = torch.cat([packed_layer(x[i : i + 1]) for i in range(100)])
            assert torch.equal(y, alone), tiles
            for start, rows in ((0, 2), (5, 17), (1, 33), (3, 97)):
                got = packed_layer(x[start : start + rows])
                assert torch.equal(got, y[start : start + rows]), (tiles, rows)
            results[tiles] = (y.double() - want).abs().max().item()
    finally:
        amx_tiles(True)
    bound = 2e-2 * want.abs().max().item()
    assert results[True] < bound and results[False] < bound, results


def test_invariant_linear_rejects_an_input_that_does_not_fit() -> None:
    layer = nn.Linear(32, 16)
    if not can_pack(layer, "invariant"):
        pytest.skip("the linear kernel cannot be built here")
    packed_layer = InvariantLinear(layer.weight, layer.bias)
    with pytest.raises(ValueError, match="does not fit"):
        packed_layer(torch.randn(3, 31))
    with pytest.raises(ValueError, match="does not fit"):
        packed_layer(torch.randn(3, 32, dtype=torch.float64))
    assert packed_layer(torch.randn(2, 5, 32)).shape == (2, 5, 16)


@pytest.mark.parametrize("kind", LINEAR_KINDS)
def test_pack_linears_replaces_every_linear_and_keeps_the_output(kind: str) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 48), nn.SiLU(), nn.Sequential(nn.Linear(48, 16, bias=False)))
    if not can_pack(net[0], kind):
        pytest.skip(f"float32 layers are not packed for {kind} here")
    x = torch.randn(5, 32)
    with torch.inference_mode():
        want = net(x)
        assert pack_linears(net, kind) == 2
        assert not any(isinstance(m, nn.Linear) for m in net.modules())
        torch.testing.assert_close(net(x), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("march", ["native", "x86-64-v2"])
@pytest.mark.parametrize(
    "name", ["paged_decode_cpu", "paged_prefill_cpu", "paged_prefill_f32_cpu", "layer_ops_cpu", "linear_cpu"]
)
def test_the_c_source_compiles_without_warnings(tmp_path: Path, name: str, march: str) -> None:
    """The runtime build tolerates warnings (a newer compiler must not turn the kernel off), so this
    keeps the source itself warning-free: for this CPU, and (on x86) for one without AVX-512, whose
    plain-C branches this CPU's build leaves out."""
    import platform
    import shutil
    import subprocess

    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    if march != "native" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("an x86 target")
    src = cpu_build.SOURCES / f"{name}.c"
    flags = [f if f != "-march=native" else f"-march={march}" for f in cpu_build.FLAGS]
    cmd = [cc, *flags, "-Wextra", "-Werror", "-o", str(tmp_path / "k.so"), str(src), "-lm"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
