"""The int8 KV cache: rows of int8 values with a float32 scale each, attended over in place.

The C write must give the torch write's bytes; attention over an int8 cache must stay close to float32
attention over the values the rows hold, give a position the same bits in a decode step as in any
prompt chunk and in any batch, and never read what a sequence did not write.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pdfabric.engine.config import ModelConfig
from pdfabric.engine.kv_cache import allocate_kv_cache, kv_bytes_per_token
from pdfabric.engine.model import LlamaForCausalLM
from pdfabric.engine.runner import ModelRunner, StepEntry
from pdfabric.kernels import kv_int8_ref
from pdfabric.kernels.attention_ref import paged_attention_ref, store_kv_ref
from pdfabric.kernels.paged_attention_cpu import int8_kv_supported, paged_attention_cpu
from pdfabric.kernels.testing import make_batch
from pdfabric.kernels.tiled_kv_cpu import store_kv_tiled
from pdfabric.kvtransfer.frames import layout_of
from pdfabric.sampling_params import SamplingParams
from tests.test_gguf import packaged

BF16 = torch.bfloat16
needs_int8 = pytest.mark.skipif(
    not int8_kv_supported(4, 1, 64, 16), reason="needs AVX512-BF16, AVX512-VNNI and a C compiler"
)

CASES = [  # (q_heads, kv_heads, head_dim, block_size, query_lens, seq_lens)
    (9, 3, 64, 16, [1] * 6, [1, 15, 16, 17, 300, 1000]),  # SmolLM2's heads, decode rows
    (9, 3, 64, 16, [77, 1, 40], [77, 513, 700]),  # a fresh prompt, a decode row, a chunk after a prefix
    (4, 4, 128, 32, [1, 33, 1], [65, 100, 2]),
    (16, 1, 64, 64, [5, 1], [5, 130]),
]


def _int8_batch(case: tuple, seed: int, poison: bool = False) -> tuple[torch.Tensor, torch.Tensor, object]:
    """The batch of ``make_batch`` with its context written into an int8 cache (``poison``: the other
    slots hold random values with NaN scales, as an earlier sequence might have left them)."""
    q_heads, kv_heads, head_dim, block_size, query_lens, seq_lens = case
    q, kv, meta = make_batch(query_lens, seq_lens, q_heads, kv_heads, head_dim, block_size, BF16, seed=seed)
    cache = torch.zeros(*kv.shape[:-1], head_dim + kv_int8_ref.SCALE_BYTES, dtype=torch.int8)
    if poison:  # every 32-bit word a NaN as a float32 (scales lie on such words), bytes random otherwise
        cache.view(-1)[:] = torch.randint(-128, 128, (cache.numel(),), dtype=torch.int8)
        cache.view(-1)[2::4], cache.view(-1)[3::4] = -1, 127
    for s_len, table in zip(seq_lens, meta.block_tables.tolist(), strict=True):
        slots = torch.tensor([table[i // block_size] * block_size + i % block_size for i in range(s_len)])
        rows = kv.view(2, -1, kv_heads, head_dim)[:, slots]  # this sequence's keys and values, dense
        store_kv_tiled(rows[0], rows[1], cache, slots)
    return q, cache, replace(meta, tiled_kv=True)


def test_quantized_rows_round_half_to_even_with_one_scale_each() -> None:
    x = torch.tensor([[127.0, 0.5, -1.5, 2.5, -127.0, 0.0], [0.0] * 6]).to(BF16)
    q, scale = kv_int8_ref.quantize_rows(x)
    assert scale.tolist() == [1.0, 0.0]
    assert q.tolist() == [[127, 0, -2, 2, -127, 0], [0] * 6]


@needs_int8
def test_the_c_write_gives_the_torch_writes_bytes() -> None:
    by_c = torch.zeros(2, 20, 32, 3, 68, dtype=torch.int8)
    by_ref = by_c.clone()
    slots = torch.randperm(20 * 32)[:150]
    qkv = torch.randn(150, 9, 64).mul(3).to(BF16)
    qkv[5, 3] = 0  # an all-zero row: scale 0, values 0
    key, value = qkv[:, 3:6], qkv[:, 6:]  # strided rows, as the model passes them
    store_kv_tiled(key, value, by_c, slots)
    store_kv_ref(key, value, by_ref, slots, tiled=True)
    assert torch.equal(by_c, by_ref)
    with pytest.raises(RuntimeError, match="pd_store_kv_tiled"):
        store_kv_tiled(key, value, by_c, torch.tensor([20 * 32] * 150))
    # read back, a row is the written one to within half its scale
    back = kv_int8_ref.dequantize_blocks(by_c)
    for half, rows in enumerate((key, value)):
        got, want = back[half].reshape(-1, 3, 64)[slots], rows.float()
        step = want.abs().amax(-1, keepdim=True) / 127
        assert ((got - want).abs() <= step * 0.5001).all()


@needs_int8
@pytest.mark.parametrize("case", CASES)
def test_int8_attention_is_float32_attention_over_the_rows_values(case: tuple) -> None:
    q, cache, meta = _int8_batch(case, seed=3)
    scale = case[2] ** -0.5
    out = paged_attention_cpu(q, cache, meta, scale)
    # the reference reads the values the rows hold; the kernel also quantizes each query row
    want = paged_attention_ref(q, cache, meta, scale)
    torch.testing.assert_close(out.float(), want.float(), atol=3e-2, rtol=3e-2)
    # and each sequence's rows alone give its rows of the batch, to the bit
    start = 0
    for s, q_len in enumerate(meta.query_lens_host):
        table = meta.block_tables[s : s + 1].tolist()
        one = type(meta).build([q_len], [meta.seq_lens_host[s]], table, case[3], tiled_kv=True)
        assert torch.equal(
            paged_attention_cpu(q[start : start + q_len], cache, one, scale), out[start : start + q_len]
        )
        start += q_len


@needs_int8
def test_a_decode_row_gets_the_bits_of_the_prompt_chunk_ending_at_it() -> None:
    """A position's attention must not depend on how its tokens were split into steps."""
    case = (9, 3, 64, 16, [200], [200])
    q, cache, meta = _int8_batch(case, seed=4)
    chunk = paged_attention_cpu(q, cache, meta, 0.125)
    for pos in (0, 15, 16, 199):
        table = meta.block_tables[:1]
        one = replace(type(meta).build([1], [pos + 1], table.tolist(), 16, tiled_kv=True), block_tables=table)
        assert torch.equal(paged_attention_cpu(q[pos : pos + 1], cache, one, 0.125), chunk[pos : pos + 1])


@needs_int8
def test_slots_a_sequence_has_not_written_are_never_read() -> None:
    case = (9, 3, 64, 16, [1, 1, 30], [17, 41, 30])
    q, clean, meta = _int8_batch(case, seed=5)
    _, poisoned, _ = _int8_batch(case, seed=5, poison=True)
    assert kv_int8_ref.dequantize_blocks(poisoned).isnan().any()
    assert not torch.equal(poisoned, clean)
    out = paged_attention_cpu(q, poisoned, meta, 0.125)
    assert not out.isnan().any()
    assert torch.equal(out, paged_attention_cpu(q, clean, meta, 0.125))


def _runner(kv_cache_dtype: str) -> ModelRunner:
    cfg = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=64, hidden_size=256, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=256, rms_norm_eps=1e-5,
        rope_theta=10000.0, dtype="bfloat16",
    )  # fmt: skip
    torch.manual_seed(0)
    return ModelRunner(
        LlamaForCausalLM(cfg).to(BF16), num_blocks=8, block_size=16, kv_cache_dtype=kv_cache_dtype
    )


@needs_int8
def test_a_runner_with_an_int8_cache() -> None:
    runner = _runner("int8")
    cfg = runner.config
    assert runner.kv_caches[0].dtype == torch.int8 and runner.kv_caches[0].shape[-1] == 68
    assert runner.decoder is not None  # decode steps in one C call write and read int8 rows too
    per_token = kv_bytes_per_token(cfg, "int8")
    assert per_token == 2 * cfg.num_layers * cfg.num_kv_heads * 68
    assert sum(c.numel() for c in allocate_kv_cache(cfg, 8, 16, "cpu", "int8")) == 8 * 16 * per_token
    # an int8 worker and a bfloat16 one do not take each other's blocks
    assert layout_of(runner.kv_caches, True) != layout_of(_runner("auto").kv_caches, True)
    assert runner.prepare([StepEntry((1, 2), 0, (0,))]).meta.tiled_kv


def test_an_int8_cache_is_refused_where_no_kernel_reads_it() -> None:
    cfg = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=1,
        num_heads=2, num_kv_heads=1, head_dim=32, max_position_embeddings=64, rms_norm_eps=1e-5,
        rope_theta=10000.0, dtype="float32",
    )  # fmt: skip
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8' needs a bfloat16 model"):
        ModelRunner(LlamaForCausalLM(cfg), num_blocks=4, block_size=16, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        allocate_kv_cache(cfg, 4, 16, "cpu", "fp8")


@needs_int8
@packaged
def test_speculation_over_an_int8_cache_gives_plain_decodings_tokens() -> None:
    """Checking proposals runs several tokens of a sequence as a prompt chunk, plain decoding one a
    step: over an int8 cache on SmolLM2 both must give the same greedy tokens."""
    from pdfabric.engine.generate import ReferenceEngine
    from tests.test_speculate import run

    reference = ReferenceEngine("smollm2-135m", kv_cache_dtype="int8")
    prompts = [([3, 4, 5, 6, 7, 8] * 12)[: 20 + 7 * i] for i in range(3)] + [list(range(1000, 1040))]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    got, seqs, core, _ = run(
        reference, prompts, params, speculative="ngram", speculative_k=6, speculative_below=8
    )
    assert core.scheduler.speculation.proposer is not None and sum(s.accepted for s in seqs) > 0  # some kept
    assert got == [reference.generate(p, params).token_ids for p in prompts]
    assert core.tables.pool.num_free == core.tables.pool.num_blocks
