"""Int8 weights (``[worker] quantization = "int8"``): the linear kernel against a torch reference that
dequantizes and multiplies, a row's result the same in any batch, and a fabric serving them token-exact
against the single-process reference with the same weights."""

from __future__ import annotations

import pytest
import torch

from pdfabric.engine.generate import ReferenceEngine
from pdfabric.kernels.cpu_build import cpu_has_half_math
from pdfabric.kernels.linear_cpu import InvariantLinear, quantize_int8
from pdfabric.sampling_params import SamplingParams
from tests.fabric import post_json, running_fabric, wait_blocks_free

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


def test_the_int8_reference_engine_answers_close_to_the_full_one() -> None:
    full, int8 = ReferenceEngine("tiny"), ReferenceEngine("tiny", quantization="int8")
    prompt = list(range(10, 60))
    a = full.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    b = int8.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    assert a.token_ids[:2] == b.token_ids[:2]  # tiny random weights: the first tokens agree
    assert b.logprobs[0] == pytest.approx(a.logprobs[0], abs=0.05)


@pytest.mark.parametrize("flags", [("--colocated", "1"), ("--prefill", "1", "--decode", "1")])
def test_a_fabric_with_int8_weights_serves_what_the_int8_reference_gives(flags: tuple[str, ...]) -> None:
    reference = ReferenceEngine("tiny", quantization="int8")
    prompts = [[5 + i] * (4 + 9 * i) for i in range(6)]
    with running_fabric("--model", "tiny", "--num-blocks", "128", "--quantization", "int8", *flags) as url:
        for prompt in prompts:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}  # fmt: skip
            status, data = post_json(url + "/v1/completions", body)
            assert status == 200, data
            want = reference.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True)).token_ids
            assert data["choices"][0]["token_ids"] == want
        wait_blocks_free(url)


def test_bench_perplexity_scores_each_format_on_the_same_windows(tmp_path) -> None:  # noqa: ANN001
    import json
    import subprocess
    import sys

    text = tmp_path / "held.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 40)
    out = tmp_path / "ppl.json"
    done = subprocess.run(
        [sys.executable, "-m", "pdfabric.cli", "bench", "perplexity", "--model", "tiny", "--text", str(text),
         "--tokens", "600", "--context", "128", "--quantization", "none,int8", "--json", str(out),
         "--no-progress"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    r = json.loads(out.read_text())
    assert r["windows"] == 4 and r["tokens"] == 512
    none, int8 = r["formats"]
    assert (none["quantization"], int8["quantization"]) == ("none", "int8")
    assert none["scored_tokens"] == int8["scored_tokens"] == 4 * 127
    assert 1 < none["perplexity"] < 1000 and abs(int8["perplexity"] / none["perplexity"] - 1) < 0.05
    assert "int8" in done.stdout
    command = [sys.executable, "-m", "pdfabric.cli", "bench", "perplexity", "--quantization", "int4"]
    bad = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2 and "none and/or int8" in bad.stderr


def test_a_config_asks_for_int8_only_with_the_kernel_that_holds_it() -> None:
    from pdfabric.worker_config import WorkerConfig

    with pytest.raises(ValueError, match="invariant linears"):
        WorkerConfig(kind="colocated", quantization="int8", linears="onednn")
    with pytest.raises(ValueError, match="quantization must be one of"):
        WorkerConfig(kind="colocated", quantization="int4")
    assert WorkerConfig(kind="colocated", quantization="int8").quantization == "int8"
