"""Batch-invariant numerics on a real model in bfloat16 and float32: SmolLM2-135M-Instruct (30 layers,
9 query and 3 KV heads, a 49,152-token vocabulary, a tied head).

A sequence's logits are the same to the bit whatever it is computed with: alone or in a batch of any
size and order, beside a long prompt chunk, its prompt in one chunk or many, its prefix computed or
taken from the cache, a token decoded or prefilled (a failover re-prefills prompt and streamed tokens
on another worker). Float32 and a tiny vocabulary hide reduction-order differences; this does not.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pdfabric.engine.default_model import resolve_model
from pdfabric.engine.loader import load_model
from pdfabric.engine.runner import ModelRunner, StepEntry
from pdfabric.kernels.cpu_build import cpu_has_half_math
from pdfabric.kernels.paged_attention_cpu import decodes_as_prefill
from tests.invariance_helpers import Tables, prefill, prompts
from tests.test_gguf import packaged

pytestmark = packaged
BLOCK = 16
SEQ_BLOCKS = 40  # blocks a test sequence may use: 640 tokens


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def runner(request: pytest.FixtureRequest) -> ModelRunner:
    """SmolLM2 in bfloat16 where the CPU computes it natively, and in float32 (how CPUs without native
    bfloat16 serve it)."""
    if request.param == "bfloat16" and not cpu_has_half_math():
        pytest.skip("bfloat16 is computed in float32 on a CPU without native bfloat16")
    model = load_model(resolve_model("smollm2-135m"), request.param)
    return ModelRunner(model, num_blocks=24 * SEQ_BLOCKS, block_size=BLOCK)


@pytest.fixture
def tables() -> Iterator[Tables]:
    yield Tables(24 * SEQ_BLOCKS, SEQ_BLOCKS)


def test_prompts_alone_and_batched_in_any_size_and_order(runner: ModelRunner, tables: Tables) -> None:
    ps = prompts(6)
    alone = [prefill(runner, p, tables.take(), []) for p in ps]
    for order in ([0, 1], [5, 2, 0], [3, 1, 4, 0, 5, 2]):
        got = runner.step([StepEntry(ps[i], 0, tables.take()) for i in order])
        for row, i in enumerate(order):
            assert torch.equal(got[row], alone[i]), (order, i)


def test_a_prompt_in_any_chunks_and_after_a_cache_hit(runner: ModelRunner, tables: Tables) -> None:
    prompt = prompts(1, seed=1)[0] * 4  # 92 tokens
    want = prefill(runner, prompt, tables.take(), [])
    for chunks in ([1], [16], [37, 20], [5, 5, 5, 5, 50], [90]):
        assert torch.equal(prefill(runner, prompt, tables.take(), chunks), want), chunks
    # a cache hit: the first 64 tokens' blocks were computed by another sequence, this one reuses them
    other, mine = tables.take(), tables.take()
    runner.step([StepEntry(prompt[:64] + (7, 8, 9), 0, other, needs_logits=False)])
    shared = other[:4] + mine[4:]
    assert torch.equal(runner.step([StepEntry(prompt[64:], 64, shared)])[0], want)


def test_decoded_tokens_equal_a_re_prefill_of_prompt_and_output(runner: ModelRunner, tables: Tables) -> None:
    """A failover's recovery: the surviving stream is re-prefilled elsewhere as prompt + tokens so far
    and must continue as the fault-free stream would."""
    if not decodes_as_prefill(runner.model.model.norm.weight.dtype):
        pytest.skip("float32 decode rows run the prompt kernel's arithmetic only on CPUs with AVX-512")
    ps = prompts(5, seed=2)
    seqs = [(p, tables.take()) for p in ps]
    first = runner.step([StepEntry(p, 0, t) for p, t in seqs])
    outputs = [[int(row.argmax())] for row in first]
    decoded = []
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


def test_decode_rows_beside_a_long_prompt_chunk(runner: ModelRunner, tables: Tables) -> None:
    """Colocated steps mix decode rows with a prompt chunk of hundreds of tokens: the matmuls then see
    600 rows instead of 4, and a row's sums must not change with them."""
    ps = prompts(4, seed=3)
    seqs = [(p, tables.take()) for p in ps]
    for p, t in seqs:
        runner.step([StepEntry(p[:-1], 0, t, needs_logits=False)])
    alone = [runner.step([StepEntry(p[-1:], len(p) - 1, t)])[0] for p, t in seqs]
    long_prompt = prompts(1, seed=4)[0] * 30
    entries = [StepEntry(p[-1:], len(p) - 1, t) for p, t in seqs]
    mixed = runner.step(entries[:2] + [StepEntry(long_prompt[:600], 0, tables.take())] + entries[2:])
    for row, want in zip((0, 1, 3, 4), alone, strict=True):
        assert torch.equal(mixed[row], want)
