"""Batch-invariant numerics of a whole model of a real shape, on every kind of device: a sequence's
logits are the same to the bit whatever it is computed with: alone or in a batch of any size and
order, beside a long prompt chunk, its prompt in one chunk or many, its prefix computed or taken from
the cache, a token decoded or prefilled (a failover re-prefills prompt and streamed tokens on another
worker). Float32 and a tiny vocabulary hide reduction-order differences; this does not.

The setups (one checker for all):
- ``bfloat16`` and ``float32``: the packaged SmolLM2-135M-Instruct (30 layers, 9 query and 3 KV heads,
  a 49,152-token vocabulary, a tied head) on the CPU's C kernels, in bfloat16 where the CPU computes
  it natively and in float32 (how CPUs without native bfloat16 serve it), and in bfloat16 over an
  int8 KV cache (``int8-kv``: rows stored as int8 with a scale each, read by the same kernels);
- ``cuda`` (``-m gpu``): a bfloat16 model of SmolLM2's shape with random weights drawn on the device,
  on the Triton kernels (linear layers and head, RMSNorm, attention), with prompts long enough to cross
  the attention's 512-key splits: what is checked is the order of the sums, not the text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from pdfabric.engine.config import ModelConfig
from pdfabric.engine.model import LlamaForCausalLM
from pdfabric.engine.runner import ModelRunner, StepEntry
from tests.invariance_helpers import Tables, prefill, prompts
from tests.test_gguf import packaged

BLOCK = 16
SMOLLM2_SHAPE = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, dtype="bfloat16",
)  # fmt: skip
GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@dataclass(frozen=True)
class Setup:
    """A runner and the sizes its checks use (a GPU's are longer, to cross the attention's splits)."""

    runner: ModelRunner
    pool: int  # the runner's KV blocks
    seq_blocks: int  # blocks one test sequence may use
    prompts: Callable[..., list[tuple[int, ...]]]  # (count, seed) -> prompts
    repeat: int  # the chunked prompt is a prompt repeated this often
    chunkings: tuple[tuple[int, ...], ...]
    cached: int  # tokens of the chunked prompt computed by another sequence, for the cache hit
    long_chunk: int  # tokens of the prompt chunk the decode rows run beside

    def tables(self) -> Tables:
        return Tables(self.pool, self.seq_blocks)


def random_model(cfg: ModelConfig, seed: int = 0) -> LlamaForCausalLM:
    """``cfg``'s model on CUDA with weights drawn there (norm weights near 1, the rest N(0, 0.02))."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    state = {}
    for name, p in model.named_parameters():
        t = torch.randn(p.shape, generator=gen, device="cuda")
        state[name] = (1 + 0.1 * t if name.endswith("norm.weight") else 0.02 * t).to(torch.bfloat16)
    model.load_state_dict(state, strict=True, assign=True)
    model.inv_freq = model.inv_freq.to("cuda")
    return model.eval().requires_grad_(False)


def _cpu(dtype: str, kv_cache_dtype: str = "auto") -> Setup:
    from pdfabric.engine.default_model import resolve_model
    from pdfabric.engine.loader import load_model
    from pdfabric.kernels.cpu_build import cpu_has_half_math
    from pdfabric.kernels.paged_attention_cpu import int8_kv_supported

    if dtype == "bfloat16" and not cpu_has_half_math():
        pytest.skip("bfloat16 is computed in float32 on a CPU without native bfloat16")
    if kv_cache_dtype == "int8" and not int8_kv_supported(9, 3, 64, BLOCK):
        pytest.skip("an int8 KV cache needs a CPU with AVX512-BF16")
    pool = 24 * 40
    model = load_model(resolve_model("smollm2-135m"), dtype)
    runner = ModelRunner(model, num_blocks=pool, block_size=BLOCK, kv_cache_dtype=kv_cache_dtype)
    chunkings = ((1,), (16,), (37, 20), (5, 5, 5, 5, 50), (90,))
    return Setup(runner, pool, 40, prompts, 4, chunkings, 64, 600)  # prompts of 23 to 162 tokens


def _cuda() -> Setup:
    from pdfabric.kernels.linear_triton import TritonLinear  # imports Triton: only once CUDA is there

    pool = 40 * 80
    runner = ModelRunner(random_model(SMOLLM2_SHAPE), num_blocks=pool, block_size=BLOCK)
    assert isinstance(runner.model.lm_head, TritonLinear)  # the tied head too
    assert isinstance(runner.model.model.layers[0].mlp.down_proj, TritonLinear)

    def long_prompts(count: int, seed: int = 0) -> list[tuple[int, ...]]:  # 23 to 900 tokens
        return prompts(count, seed, step=211, longest=900)

    chunkings = ((1,), (16,), (37, 20), (512,), (300, 300, 300), (5, 600, 5), (919,))
    return Setup(runner, pool, 80, long_prompts, 40, chunkings, 640, 1000)


@pytest.fixture(
    scope="module",
    params=[
        pytest.param("bfloat16", marks=packaged),
        pytest.param("float32", marks=packaged),
        pytest.param("int8-kv", marks=packaged),
        pytest.param("cuda", marks=GPU),
    ],
)
def setup(request: pytest.FixtureRequest) -> Setup:
    if request.param == "int8-kv":
        return _cpu("bfloat16", "int8")
    return _cuda() if request.param == "cuda" else _cpu(request.param)


def test_prompts_alone_and_batched_in_any_size_and_order(setup: Setup) -> None:
    runner, tables, ps = setup.runner, setup.tables(), setup.prompts(6)
    alone = [prefill(runner, p, tables.take(), []) for p in ps]
    for order in ([0, 1], [5, 2, 0], [3, 1, 4, 0, 5, 2]):
        got = runner.step([StepEntry(ps[i], 0, tables.take()) for i in order])
        for row, i in enumerate(order):
            assert torch.equal(got[row], alone[i]), (order, i)


def test_a_prompt_in_any_chunks_and_after_a_cache_hit(setup: Setup) -> None:
    runner, tables = setup.runner, setup.tables()
    prompt = setup.prompts(1, seed=1)[0] * setup.repeat
    want = prefill(runner, prompt, tables.take(), [])
    for chunks in setup.chunkings:
        assert torch.equal(prefill(runner, prompt, tables.take(), list(chunks)), want), chunks
    # a cache hit: the first blocks were computed by another sequence, this one reuses them
    other, mine, cut = tables.take(), tables.take(), setup.cached
    runner.step([StepEntry(prompt[:cut] + (7, 8, 9), 0, other, needs_logits=False)])
    shared = other[: cut // BLOCK] + mine[cut // BLOCK :]
    assert torch.equal(runner.step([StepEntry(prompt[cut:], cut, shared)])[0], want)


def test_decoded_tokens_equal_a_re_prefill_of_prompt_and_output(setup: Setup) -> None:
    """A failover's recovery: the surviving stream is re-prefilled elsewhere as prompt + tokens so far
    and must continue as the fault-free stream would."""
    runner, tables = setup.runner, setup.tables()
    if runner.device.type == "cpu":
        from pdfabric.kernels.paged_attention_cpu import decodes_as_prefill

        if not decodes_as_prefill(runner.model.model.norm.weight.dtype):
            pytest.skip("float32 decode rows run the prompt kernel's arithmetic only on CPUs with AVX-512")
    seqs = [(p, tables.take()) for p in setup.prompts(5, seed=2)]
    first = runner.step([StepEntry(p, 0, t) for p, t in seqs])
    outputs = [[int(row.argmax())] for row in first]
    decoded = first
    for _ in range(8):  # decode all five together, as a decode worker does
        entries = [
            StepEntry((out[-1],), len(p) + len(out) - 1, t) for (p, t), out in zip(seqs, outputs, strict=True)
        ]
        decoded = runner.step(entries)
        for out, row in zip(outputs, decoded, strict=True):
            out.append(int(row.argmax()))
    for (p, _), out, logits in zip(seqs, outputs, decoded, strict=True):
        again = prefill(runner, p + tuple(out[:-1]), tables.take(), [])
        assert torch.equal(again, logits)


def test_decode_rows_beside_a_long_prompt_chunk(setup: Setup) -> None:
    """Colocated steps mix decode rows with a prompt chunk of hundreds of tokens: the matmuls then see
    hundreds of rows instead of 4 (and a GPU's attention more splits); a row's sums must not change."""
    runner, tables = setup.runner, setup.tables()
    seqs = [(p, tables.take()) for p in setup.prompts(4, seed=3)]
    for p, t in seqs:
        runner.step([StepEntry(p[:-1], 0, t, needs_logits=False)])
    alone = [runner.step([StepEntry(p[-1:], len(p) - 1, t)])[0] for p, t in seqs]
    long_prompt = setup.prompts(1, seed=4)[0] * 50
    entries = [StepEntry(p[-1:], len(p) - 1, t) for p, t in seqs]
    chunk = StepEntry(long_prompt[: setup.long_chunk], 0, tables.take())
    mixed = runner.step(entries[:2] + [chunk] + entries[2:])
    for row, want in zip((0, 1, 3, 4), alone, strict=True):
        assert torch.equal(mixed[row], want)
