"""Quantized weights (``[worker] quantization``: int8, int4, gguf, w8a8): the quantizers and the GGUF block
readers (equal to the ``gguf`` package's dequantization to the bit), the linear kernels against a torch
reference that dequantizes and multiplies (w8a8: its torch twin, to the bit), a row's result the same in
any batch, and fabrics serving
them token-exact against the single-process reference with the same weights. Greedy text is not
expected to equal the unquantized model's; the tests check closeness of logits and first tokens."""

from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np
import pytest
import torch

from pdfabric.engine.generate import ReferenceEngine
from pdfabric.kernels.cpu_build import cpu_has_half_math
from pdfabric.kernels.linear_cpu import InvariantLinear
from pdfabric.kernels.quantized import GroupedWeight, dequantize, from_gguf, quantize_int4
from pdfabric.kernels.w8a8_ref import fma32, quantize_rows, w4a8_reference, w8a8_reference
from pdfabric.kernels.weight_forms import quantize_int8
from pdfabric.sampling_params import SamplingParams
from tests.fabric import get_json, post_json, running_fabric, wait_blocks_free

DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not cpu_has_half_math(), reason="bfloat16 needs a CPU that multiplies it natively"))]  # fmt: skip


def test_quantization_is_symmetric_per_row_within_half_a_step() -> None:
    torch.manual_seed(0)
    w = torch.randn(37, 53) * torch.linspace(0.01, 3.0, 37)[:, None]
    w[5] = 0.0  # a row of zeros keeps a scale of 1
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (37,) and int(q.abs().max()) == 127
    assert scale[5] == 1.0 and not q[5].any()
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(64, 64), (100, 77), (1536, 576), (49, 1536)])
def test_int8_linear_equals_dequantized_weights_and_is_batch_invariant(
    dtype: torch.dtype, shape: tuple
) -> None:
    n, k = shape
    torch.manual_seed(n + k)
    w, b = (torch.randn(n, k) * 0.05).to(dtype), (torch.randn(n) * 0.1).to(dtype)
    lin = InvariantLinear(w, b, "int8")
    q, scale = quantize_int8(w)
    x = torch.randn(40, k).to(dtype)
    y = lin(x)
    reference = x.double() @ (q.double() * scale.double()[:, None]).t() + b.double()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.double(), reference, rtol=tol, atol=tol * reference.abs().max().item())
    for rows in (1, 2, 7, 33):  # each row's bits alone and among others
        assert torch.equal(lin(x[:rows]), y[:rows])
    assert torch.equal(lin(x[5:6]), y[5:6])
    # a byte a weight (columns padded to panels of 64, an odd K to pairs in bfloat16) and a scale a column
    panels, width = -(-n // 64), k + k % 2 if dtype == torch.bfloat16 else k
    assert lin.packed_weight.numel() * lin.packed_weight.element_size() == panels * 64 * (4 + width)


def test_activation_groups_of_32_are_quantized_symmetrically_half_to_even() -> None:
    x = torch.zeros(3, 64)
    x[0, :32] = torch.linspace(-2.0, 2.0, 32)
    x[0, 32] = 127 * 0.5 / 127  # a group whose largest value is 0.5: scale 0.5 / 127
    x[0, 33] = 1.5 * 0.5 / 127  # 1.5 steps: rounds to 2 (half to even)
    x[0, 34] = 2.5 * 0.5 / 127  # 2.5 steps: rounds to 2
    x[1] = 3.0  # a constant row
    q, scale = quantize_rows(x)  # row 2: zeros everywhere, every scale 0
    assert q.dtype == torch.int8 and scale.shape == (3, 2)
    assert q[0, 0] == -127 and q[0, 31] == 127
    assert torch.equal(q[0, 32:35], torch.tensor([127, 2, 2], dtype=torch.int8))
    assert (q[1] == 127).all() and torch.equal(scale[1], torch.full((2,), 3.0 / 127))
    assert not q[2].any() and not scale[2].any() and not q[0, 35:].any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(64, 64), (100, 96), (1536, 576), (49, 1536)])
def test_w8a8_linear_equals_its_torch_twin_to_the_bit_and_is_batch_invariant(
    dtype: torch.dtype, shape: tuple
) -> None:
    n, k = shape
    torch.manual_seed(n + k)
    w, b = (torch.randn(n, k) * 0.05).to(dtype), (torch.randn(n) * 0.1).to(dtype)
    lin = InvariantLinear(w, b, "w8a8")
    assert (lin.quantization, lin.bits) == ("w8a8", 8)
    x = (torch.randn(200, k) * torch.rand(200, 1) * 4).to(dtype)  # rows of many ranges, several blocks
    x[3] = 0.0
    x[4, 32:64] = 0.0  # a group of zeros beside others
    x[6, 7] = 50.0  # an outlier: only its group's scale grows
    y = lin(x)
    q, scale = quantize_int8(w)
    assert torch.equal(y, w8a8_reference(x, q, scale, b))  # the integer sums are exact: same bits
    close = x.double() @ w.double().t() + b.double()
    assert (y.double() - close).abs().max() < 0.02 * close.abs().max()
    for rows in (1, 2, 5, 33, 97):  # each row's bits alone and among others
        assert torch.equal(lin(x[:rows]), y[:rows])
    assert torch.equal(lin(x[5:6]), y[5:6]) and torch.equal(y[3], b)
    # a byte a weight and a scale a column, columns padded to panels of 64
    assert lin.packed_weight.numel() == -(-n // 64) * 64 * (4 + k)


def test_fma32_rounds_once_as_the_c_librarys_fmaf() -> None:
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.fmaf.restype, libm.fmaf.argtypes = ctypes.c_float, [ctypes.c_float] * 3
    torch.manual_seed(7)
    a, b, c = (torch.randn(3000) * torch.logspace(-20, 20, 3000)[torch.randperm(3000)] for _ in range(3))
    # where the float64 sum lands on a float32 midpoint the exact sum is below: 1 + 2^-23 is odd, so
    # rounding the float64 sum 1 + 3 * 2^-24 would give 1 + 2^-22, the exact sum's nearest is 1 + 2^-23
    a[0], b[0], c[0] = 2.0**-24 * (1 + 2.0**-15), 1 - 2.0**-15, 1 + 2.0**-23
    a[1], b[1], c[1] = -a[0], b[0], -c[0]
    want = torch.tensor([libm.fmaf(*v) for v in zip(a.tolist(), b.tolist(), c.tolist(), strict=True)])
    naive = (a[0].double() * b[0].double() + c[0].double()).float()  # rounded twice
    assert want[0].item() == 1 + 2.0**-23 and naive != want[0]
    assert torch.equal(fma32(a, b, c), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(64, 64), (100, 96), (1536, 576), (49, 1536)])
def test_w4a8_linear_equals_its_torch_twin_to_the_bit_and_is_batch_invariant(
    dtype: torch.dtype, shape: tuple
) -> None:
    n, k = shape
    torch.manual_seed(n + k + 1)
    w, b = (torch.randn(n, k) * 0.05).to(dtype), (torch.randn(n) * 0.1).to(dtype)
    g = quantize_int4(w)
    lin = InvariantLinear(w, b, "w4a8", g)
    assert (lin.quantization, lin.bits, lin.dtype_code) == ("w4a8", 4, 14 if dtype == torch.bfloat16 else 15)
    x = (torch.randn(200, k) * torch.rand(200, 1) * 4).to(dtype)  # rows of many ranges, several blocks
    x[3] = 0.0
    x[4, 32:64] = 0.0  # a group of zeros beside others
    x[6, 7] = 50.0  # an outlier: only its group's scale grows
    y = lin(x)
    assert torch.equal(y, w4a8_reference(x, g, b))  # the integer sums are exact: same bits
    close = x.double() @ dequantize(g).double().t() + b.double()
    assert (y.double() - close).abs().max() < 0.02 * close.abs().max()
    for rows in (1, 2, 5, 33, 97):  # each row's bits alone and among others
        assert torch.equal(lin(x[:rows]), y[:rows])
    assert torch.equal(lin(x[5:6]), y[5:6]) and torch.equal(y[3], b)
    # half a byte a weight, a scale and an offset a group and column, columns padded to panels of 64
    assert lin.packed_weight.numel() == -(-n // 64) * 64 * (k // 2 + 8 * (k // 32))


def test_integer_tiles_hold_a_groups_largest_sums_exactly() -> None:
    """Every input at the quantizer's bound against every weight at its own: the largest sums a group's
    integer lanes hold (on AVX2, 16-bit pairs summed: 30480 for 4 bits, 32258 a pair for 8), each sign."""
    n, k = 64, 128
    sign = torch.ones(n, k)
    sign[1::2] = -1.0  # odd columns negative
    x = torch.ones(4, k)
    x[1] = -1.0
    x[2, 64:] = -1.0  # a row of each sign, and one whose later groups turn
    x[3] = torch.where(torch.arange(k) % 2 == 0, 1.0, -1.0)
    q, scale = torch.full((n, k), 127, dtype=torch.int8) * sign.to(torch.int8), torch.full((n,), 0.5)
    eight = InvariantLinear(q.float() * 0.5, None, "w8a8", int8=(q, scale))
    assert torch.equal(eight(x), w8a8_reference(x, q, scale, None))
    assert eight(x)[0, 0].item() == 127 * 127 * k * 0.5 / 127  # x's scale 1 / 127: the whole sum, exact
    top = GroupedWeight(torch.full((n, k), 15, dtype=torch.uint8), torch.full((n, k // 32), 0.25),
                        torch.full((n, k // 32), -2.0), bits=4)  # fmt: skip
    four = InvariantLinear(dequantize(top), None, "w4a8", top)
    assert torch.equal(four(x), w4a8_reference(x, top, None))
    with pytest.raises(ValueError, match="rejected"):  # -128 is no symmetric int8 weight
        InvariantLinear(q.float(), None, "w8a8", int8=(torch.full((n, k), -128, dtype=torch.int8), scale))


def test_int4_groups_span_their_range_within_half_a_step() -> None:
    torch.manual_seed(0)
    w = torch.randn(37, 96) * torch.linspace(0.01, 3.0, 37)[:, None]
    w[5, 32:64] = 0.25  # a group of one value dequantizes to it exactly
    g = quantize_int4(w)
    assert g.bits == 4 and g.q.dtype == torch.uint8 and int(g.q.max()) == 15 and g.scales.shape == (37, 3)
    groups = w.reshape(37, 3, 32)
    assert torch.equal(g.offsets, groups.amin(dim=2))  # the smallest weight is level 0 exactly
    step = g.scales.repeat_interleave(32, dim=1)
    assert ((dequantize(g) - w).abs() <= step / 2 + 1e-6).all()
    assert torch.equal(dequantize(g)[5, 32:64], w[5, 32:64]) and g.scales[5, 1] == 0


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_blocks_unpack_to_the_gguf_packages_dequantization_to_the_bit(kind: str) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize
    from gguf.quants import quantize as gguf_quantize

    rng = np.random.default_rng(7)
    qtype = GGMLQuantizationType[kind]
    if kind.endswith("_K"):  # no quantizer in the package: random blocks, finite half-precision d
        size, halves_at = {
            "Q3_K": (110, ((108, 110),)), "Q4_K": (144, ((0, 2), (2, 4))), "Q5_K": (176, ((0, 2), (2, 4))),
            "Q6_K": (210, ((208, 210),)),
        }[kind]  # fmt: skip
        raw = rng.integers(0, 256, (24, 2, size), dtype=np.uint8)
        for lo, hi in halves_at:
            halves = (rng.random((24, 2)) * 0.01).astype(np.float16)
            raw[..., lo:hi] = halves.view(np.uint8).reshape(24, 2, 2)
        blocks = raw.reshape(24, 2 * size)
    else:
        blocks = gguf_quantize((rng.standard_normal((24, 512)) * 0.05).astype(np.float32), qtype)
    g = from_gguf(kind, blocks, (24, 512))
    eight = {
        "Q8_0": (8, 32),
        "Q5_0": (8, 32),
        "Q5_1": (8, 32),
        "Q5_K": (8, 32),
        "Q6_K": (8, 16),
        "Q3_K": (8, 16),
    }
    assert (g.bits, g.group) == eight.get(kind, (4, 32))
    assert (g.offsets is not None) == (kind in ("Q4_0", "Q4_1", "Q4_K", "Q5_1", "Q5_K"))
    assert np.array_equal(dequantize(g).numpy(), gguf_dequantize(blocks, qtype).reshape(24, 512))
    with pytest.raises(ValueError, match="no kernel"):
        from_gguf("Q2_K", blocks, (24, 512))


def _q8_groups(n: int, k: int, group: int = 32, offsets: bool = False) -> GroupedWeight:
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    m = torch.randn(n, k // group) * 0.02 if offsets else None
    return GroupedWeight(q.view(torch.uint8), torch.rand(n, k // group) * 0.002, m, 8, group)


@pytest.mark.parametrize("dtype", DTYPES)
# 8 bits in groups of 16: Q6_K's; with offsets: Q5_1's and Q5_K's
@pytest.mark.parametrize(
    ("bits", "group", "offsets"), [(4, 32, True), (8, 32, False), (8, 16, False), (8, 32, True)]
)
@pytest.mark.parametrize("shape", [(64, 64), (100, 96), (1536, 576), (49, 1536)])
def test_grouped_linear_equals_dequantized_weights_and_is_batch_invariant(
    dtype: torch.dtype, bits: int, group: int, offsets: bool, shape: tuple
) -> None:
    n, k = shape
    torch.manual_seed(n + k + bits + group)
    w, b = (torch.randn(n, k) * 0.05).to(dtype), (torch.randn(n) * 0.1).to(dtype)
    g = quantize_int4(w) if bits == 4 else _q8_groups(n, k, group, offsets)
    lin = InvariantLinear(w, b, "int4" if bits == 4 else "gguf", g)
    x = torch.randn(200, k).to(dtype)  # more rows than a block of 96: widened panels, several blocks
    y = lin(x)
    reference = x.double() @ dequantize(g).double().t() + b.double()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.double(), reference, rtol=tol, atol=tol * reference.abs().max().item())
    for rows in (1, 2, 4, 7, 33, 97):  # each row's bits alone and among others
        assert torch.equal(lin(x[:rows]), y[:rows])
    assert torch.equal(lin(x[5:6]), y[5:6])
    header = -(-n // 64) * 64 * (k // group) * 4 * (2 if offsets else 1)  # scales (and offsets) a group
    assert lin.packed_weight.numel() == header + -(-n // 64) * 64 * k * bits // 8


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(200, 96), (130, 64), (49, 1536)])
def test_packed_rows_are_the_weights_each_format_multiplies(dtype: torch.dtype, shape: tuple) -> None:
    """``packed_rows`` reads rows back from every packed layout (columns past a panel's 64 too): the
    weight itself, or its dequantized form, to the bit."""
    from pdfabric.kernels.packed_rows import packed_rows

    n, k = shape
    torch.manual_seed(n)
    w = torch.randn(n, k).to(dtype)
    ids = torch.tensor([0, 5, n - 1, 64 % n, min(63, n - 2), 7, 7])
    q, scale = quantize_int8(w)
    as_int8 = (q.float() * scale[:, None]).to(dtype)
    int4 = quantize_int4(w)
    q8 = GroupedWeight(q, torch.rand(n, k // 32) * scale[:, None], None, 8)  # Q8_0-like groups
    q6 = GroupedWeight(q, torch.rand(n, k // 16) * scale[:, None], None, 8, 16)  # Q6_K-like groups
    q5 = GroupedWeight(q, torch.rand(n, k // 32) * scale[:, None], torch.randn(n, k // 32), 8)  # Q5_1-like
    cases = [
        (InvariantLinear(w, None), w),
        (InvariantLinear(w, None, "int8"), as_int8),
        (InvariantLinear(w, None, "w8a8"), as_int8),
        (InvariantLinear(w, None, "int4", int4), dequantize(int4).to(dtype)),
        (InvariantLinear(w, None, "gguf", q8), dequantize(q8).to(dtype)),
        (InvariantLinear(w, None, "gguf", q6), dequantize(q6).to(dtype)),
        (InvariantLinear(w, None, "gguf", q5), dequantize(q5).to(dtype)),
    ]
    for lin, want in cases:
        assert torch.equal(packed_rows(lin, ids), want[ids]), lin.extra_repr()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_weight_of_parts_gives_each_parts_own_outputs_to_the_bit(dtype: torch.dtype) -> None:
    """A stacked projection whose parts come in different formats (4-bit, Q6_K-like 8-bit groups of 16,
    the compute dtype) is one layer of parts: its outputs are each part's own layer's, bias included,
    to the bit, and a row's are the same in any batch."""
    torch.manual_seed(3)
    k = 256
    g4 = quantize_int4(torch.randn(192, k) * 0.05)
    q6 = _q8_groups(64, k, 16)
    plain = torch.randn(70, k) * 0.05
    w = torch.cat([dequantize(g4), dequantize(q6), plain]).to(dtype)
    b = (torch.randn(w.shape[0]) * 0.1).to(dtype)
    layer = InvariantLinear(w, b, "gguf", None, ((192, g4), (64, q6), (70, None)))
    assert (layer.dtype_code, layer.parts) == (16, ((192, 4), (64, 8), (70, None)))
    x = torch.randn(150, k).to(dtype)
    y = layer(x)
    alone = [
        InvariantLinear(w[:192], b[:192], "gguf", g4),
        InvariantLinear(w[192:256], b[192:256], "gguf", q6),
        InvariantLinear(w[256:], b[256:]),
    ]
    assert torch.equal(y, torch.cat([part(x) for part in alone], dim=1))
    for rows in (1, 3, 97):
        assert torch.equal(layer(x[:rows]), y[:rows])
    with pytest.raises(ValueError, match="do not make"):
        InvariantLinear(w, b, "gguf", None, ((192, g4), (64, q6)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_float_out_gives_each_formats_sums_before_they_are_rounded(dtype: torch.dtype) -> None:
    """``float_out`` (a model's head: its logits): every format writes float32 outputs that round to the
    very bits its rounded layer writes, bias included, and a row's are the same in any batch; in
    bfloat16 they are not all bfloat16 values (the rounding is really left out)."""
    torch.manual_seed(5)
    n, k = 200, 256
    w = (torch.randn(n, k) * 0.05).to(dtype)
    b = (torch.randn(n) * 0.1).to(dtype)
    int4 = quantize_int4(w.float())
    parts = ((136, quantize_int4(w[:136].float())), (64, _q8_groups(64, k, 16)))  # Q4-like beside Q6_K-like
    forms = [
        ("none", None, None), ("int8", None, None), ("w8a8", None, None), ("int4", int4, None),
        ("w4a8", int4, None), ("gguf", _q8_groups(n, k, 32), None), ("gguf", _q8_groups(n, k, 16), None),
        ("gguf", None, parts),
    ]  # fmt: skip
    x = torch.randn(40, k).to(dtype)
    for quantization, grouped, held_parts in forms:
        rounded = InvariantLinear(w, b, quantization, grouped, held_parts)
        exact = InvariantLinear(w, b, quantization, grouped, held_parts, float_out=True)
        y = exact(x)
        assert y.dtype == torch.float32, rounded.extra_repr()
        assert torch.equal(y.to(dtype), rounded(x)), rounded.extra_repr()
        for start, rows in ((0, 1), (3, 7), (1, 33)):
            assert torch.equal(exact(x[start : start + rows]), y[start : start + rows]), rounded.extra_repr()
        if dtype == torch.bfloat16:
            assert not torch.equal(y, y.to(dtype).float()), rounded.extra_repr()


def test_a_layer_whose_inputs_are_not_groups_of_32_keeps_the_model_dtype() -> None:
    from torch import nn

    from pdfabric.kernels.linear import pack_linears

    for quantization in ("int4", "w8a8"):
        model = nn.Sequential(nn.Linear(64, 40), nn.Linear(40, 64))
        assert pack_linears(model, "invariant", quantization) == 2
        assert (model[0].quantization, model[0].bits) == (quantization, 4 if quantization == "int4" else 8)
        assert (model[1].quantization, model[1].bits) == ("none", None)


@pytest.mark.parametrize("quantization", ["int8", "int4", "w8a8", "w4a8"])
def test_a_quantized_reference_engine_answers_close_to_the_full_one(quantization: str) -> None:
    full, quantized = ReferenceEngine("tiny"), ReferenceEngine("tiny", quantization=quantization)
    prompt = list(range(10, 60))
    a = full.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    b = quantized.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    assert quantized.model.lm_head.bits == 8  # int4 keeps the head in int8 (runner.head_quantization)
    four = quantization in ("int4", "w4a8")
    agree = 1 if four else 2  # tiny random weights, the worst case for 4 bits
    assert a.token_ids[:agree] == b.token_ids[:agree]
    assert b.logprobs[0] == pytest.approx(a.logprobs[0], abs=0.3 if four else 0.05)


@pytest.mark.parametrize("quantization", ["int8", "int4", "w8a8", "w4a8"])
@pytest.mark.parametrize("flags", [("--colocated", "1"), ("--prefill", "1", "--decode", "1")])
def test_a_fabric_with_quantized_weights_serves_what_the_quantized_reference_gives(
    flags: tuple[str, ...], quantization: str
) -> None:
    reference = ReferenceEngine("tiny", quantization=quantization)
    prompts = [[5 + i] * (4 + 9 * i) for i in range(6)]
    args = ("--model", "tiny", "--num-blocks", "128", "--quantization", quantization, *flags)
    with running_fabric(*args) as url:
        for prompt in prompts:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}  # fmt: skip
            status, data = post_json(url + "/v1/completions", body)
            assert status == 200, data
            want = reference.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True)).token_ids
            assert data["choices"][0]["token_ids"] == want
        wait_blocks_free(url)
        _, health = get_json(url + "/health")  # each worker says how it holds its weights
        assert {w["weights"] for w in health["workers"]} == {quantization}


def test_bench_perplexity_scores_each_format_on_the_same_windows(tmp_path) -> None:  # noqa: ANN001
    import json
    import subprocess
    import sys

    text = tmp_path / "held.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 40)
    out = tmp_path / "ppl.json"
    done = subprocess.run(
        [sys.executable, "-m", "pdfabric.cli", "bench", "perplexity", "--model", "tiny", "--text", str(text),
         "--tokens", "600", "--context", "128", "--quantization", "none,int8,int4", "--json", str(out),
         "--no-progress"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    r = json.loads(out.read_text())
    assert r["windows"] == 4 and r["tokens"] == 512
    none, int8, int4 = r["formats"]
    assert [f["quantization"] for f in r["formats"]] == ["none", "int8", "int4"]
    assert none["scored_tokens"] == int8["scored_tokens"] == int4["scored_tokens"] == 4 * 127
    assert 1 < none["perplexity"] < 1000 and abs(int8["perplexity"] / none["perplexity"] - 1) < 0.05
    assert abs(int4["perplexity"] / none["perplexity"] - 1) < 0.5
    assert "int4" in done.stdout
    command = [sys.executable, "-m", "pdfabric.cli", "bench", "perplexity", "--quantization", "int3"]
    bad = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2 and "none, int8, int4, gguf, w8a8" in bad.stderr


def test_a_config_asks_for_int8_only_with_the_kernel_that_holds_it() -> None:
    from pdfabric.worker_config import WorkerConfig

    with pytest.raises(ValueError, match="invariant linears"):
        WorkerConfig(kind="colocated", quantization="int8", linears="onednn")
    with pytest.raises(ValueError, match="quantization must be one of"):
        WorkerConfig(kind="colocated", quantization="int3")
    assert WorkerConfig(kind="colocated", quantization="int8").quantization == "int8"
