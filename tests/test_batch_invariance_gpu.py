"""Batch-invariant numerics of a whole model on CUDA (``-m gpu``): a bfloat16 model of SmolLM2-135M's
shape (30 layers, 9 query and 3 KV heads, a 49,152-token vocabulary, a tied head) with random weights,
run through ``ModelRunner`` on the Triton kernels (linear layers and head, RMSNorm, attention).

As ``test_batch_invariance.py`` on CPUs: a sequence's logits are the same to the bit alone or in any
batch, its prompt in one chunk or many, after a cache hit, decoded or re-prefilled, beside a long
prompt chunk. Prompts cross the attention's 512-key splits. The weights are drawn on the device (the
packaged SmolLM2 is not needed): what is checked is the order of the sums, not the text.
"""

from __future__ import annotations

import pytest
import torch

from pdfabric.engine.config import ModelConfig
from pdfabric.engine.model import LlamaForCausalLM
from pdfabric.engine.runner import ModelRunner, StepEntry
from tests.invariance_helpers import Tables, prefill
from tests.invariance_helpers import prompts as shared_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SMOLLM2_SHAPE = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, dtype="bfloat16",
)  # fmt: skip
BLOCK = 16
SEQ_BLOCKS = 80  # blocks a test sequence may use: 1,280 tokens
POOL = 40 * SEQ_BLOCKS


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


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    from pdfabric.kernels.linear_triton import TritonLinear  # imports Triton: only once CUDA is there

    r = ModelRunner(random_model(SMOLLM2_SHAPE), num_blocks=POOL, block_size=BLOCK)
    assert isinstance(r.model.lm_head, TritonLinear)  # the tied head too
    assert isinstance(r.model.model.layers[0].mlp.down_proj, TritonLinear)
    return r


def prompts(count: int, seed: int = 0) -> list[tuple[int, ...]]:
    """Random prompts of 23 to 900 tokens: long enough to cross the attention's 512-key splits."""
    return shared_prompts(count, seed, step=211, longest=900)


def test_prompts_alone_and_batched_in_any_size_and_order(runner: ModelRunner) -> None:
    tables = Tables(POOL, SEQ_BLOCKS)
    ps = prompts(6)  # 23 to 867 tokens
    alone = [prefill(runner, p, tables.take(), []) for p in ps]
    for order in ([0, 1], [5, 2, 0], [3, 1, 4, 0, 5, 2]):
        got = runner.step([StepEntry(ps[i], 0, tables.take()) for i in order])
        for row, i in enumerate(order):
            assert torch.equal(got[row], alone[i]), (order, i)


def test_a_prompt_in_any_chunks_and_after_a_cache_hit(runner: ModelRunner) -> None:
    tables = Tables(POOL, SEQ_BLOCKS)
    prompt = prompts(1, seed=1)[0] * 40  # 920 tokens
    want = prefill(runner, prompt, tables.take(), [])
    for chunks in ([1], [16], [37, 20], [512], [300, 300, 300], [5, 600, 5], [919]):
        assert torch.equal(prefill(runner, prompt, tables.take(), chunks), want), chunks
    # a cache hit: the first 640 tokens' blocks were computed by another sequence, this one reuses them
    other, mine = tables.take(), tables.take()
    runner.step([StepEntry(prompt[:640] + (7, 8, 9), 0, other, needs_logits=False)])
    shared = other[:40] + mine[40:]
    assert torch.equal(runner.step([StepEntry(prompt[640:], 640, shared)])[0], want)


def test_decoded_tokens_equal_a_re_prefill_of_prompt_and_output(runner: ModelRunner) -> None:
    tables = Tables(POOL, SEQ_BLOCKS)
    seqs = [(p, tables.take()) for p in prompts(5, seed=2)]
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


def test_decode_rows_beside_a_long_prompt_chunk(runner: ModelRunner) -> None:
    """Colocated steps mix decode rows with a prompt chunk: the matmuls then see 1,000 rows instead of
    4, and the attention more splits; a row's sums must not change with them."""
    tables = Tables(POOL, SEQ_BLOCKS)
    seqs = [(p, tables.take()) for p in prompts(4, seed=3)]
    for p, t in seqs:
        runner.step([StepEntry(p[:-1], 0, t, needs_logits=False)])
    alone = [runner.step([StepEntry(p[-1:], len(p) - 1, t)])[0] for p, t in seqs]
    long_prompt = prompts(1, seed=4)[0] * 50
    entries = [StepEntry(p[-1:], len(p) - 1, t) for p, t in seqs]
    mixed = runner.step(entries[:2] + [StepEntry(long_prompt[:1000], 0, tables.take())] + entries[2:])
    for row, want in zip((0, 1, 3, 4), alone, strict=True):
        assert torch.equal(mixed[row], want)
