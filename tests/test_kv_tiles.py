"""The tiled KV cache: blocks laid out the way the CPU prompt kernel multiplies them, read in place.

Tiling changes where a block's values lie, never which values are summed in which order, so every
attention result over a tiled cache must equal the dense cache's to the bit, values a sequence never
wrote must never be read, and the references must read a tiled cache too.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pdfabric.engine.config import ModelConfig
from pdfabric.engine.model import LlamaForCausalLM
from pdfabric.engine.runner import ModelRunner, StepEntry
from pdfabric.kernels import dispatch
from pdfabric.kernels.attention_ref import paged_attention_ref, store_kv_ref, tile_blocks, untile_blocks
from pdfabric.kernels.metadata import AttentionMetadata
from pdfabric.kernels.paged_attention_cpu import paged_attention_cpu, tiled_kv_supported
from pdfabric.kernels.testing import make_batch
from pdfabric.kernels.tiled_kv_cpu import store_kv_tiled
from pdfabric.kvtransfer.frames import layout_of

BF16 = torch.bfloat16
needs_tiles = pytest.mark.skipif(
    not tiled_kv_supported(BF16, 4, 1, 64, 16), reason="needs a CPU with AVX512-BF16 and a C compiler"
)

CASES = [  # (q_heads, kv_heads, head_dim, block_size, query_lens, seq_lens)
    (9, 3, 64, 16, [1] * 6, [1, 15, 16, 17, 300, 1000]),  # SmolLM2's heads, decode rows
    (9, 3, 64, 16, [77, 1, 40], [77, 513, 700]),  # a fresh prompt, a decode row, a chunk after a prefix
    (4, 4, 128, 32, [1, 33, 1], [65, 100, 2]),
    (16, 1, 64, 64, [5, 1], [5, 130]),
    (8, 2, 256, 16, [1, 20], [90, 20]),
]


def test_tiling_is_a_permutation_of_each_block() -> None:
    kv = torch.randn(2, 5, 32, 3, 64).to(BF16)
    tiled = tile_blocks(kv)
    assert torch.equal(untile_blocks(tiled), kv)
    assert not torch.equal(tiled, kv)
    # a block's bytes stay in the block: blocks move between like caches as bytes
    assert torch.equal(tile_blocks(kv[:, 2:3]), tiled[:, 2:3])


@needs_tiles
@pytest.mark.parametrize("case", CASES)
def test_attention_over_a_tiled_cache_equals_the_dense_cache_to_the_bit(case: tuple) -> None:
    q_heads, kv_heads, head_dim, block_size, query_lens, seq_lens = case
    q, kv, meta = make_batch(query_lens, seq_lens, q_heads, kv_heads, head_dim, block_size, BF16, seed=3)
    tiled, tiled_meta = tile_blocks(kv), replace(meta, tiled_kv=True)
    scale = head_dim**-0.5
    dense_out = paged_attention_cpu(q, kv, meta, scale)
    assert torch.equal(paged_attention_cpu(q, tiled, tiled_meta, scale), dense_out)
    # and the reference reads a tiled cache as it reads the dense one
    want = paged_attention_ref(q, kv, meta, scale)
    assert torch.equal(paged_attention_ref(q, tiled, tiled_meta, scale), want)


@needs_tiles
def test_slots_a_sequence_has_not_written_are_never_read() -> None:
    """A block's slots past a sequence's end hold whatever an earlier sequence left (here NaN): a zero
    probability times NaN is NaN, so such values must not reach the sums."""
    query_lens, seq_lens = [1, 1, 30], [17, 40, 30]
    q, kv, meta = make_batch(query_lens, seq_lens, 9, 3, 64, 16, BF16, seed=5)
    clean = torch.zeros_like(kv)
    poisoned = torch.full_like(kv, float("nan"))
    for cache in (clean, poisoned):
        for s, (s_len, table) in enumerate(zip(seq_lens, meta.block_tables.tolist(), strict=True)):
            slots = torch.tensor([table[i // 16] * 16 + i % 16 for i in range(s_len)])
            gen = torch.Generator().manual_seed(s)
            key, value = torch.randn(2, s_len, 3, 64, generator=gen).to(BF16)
            store_kv_tiled(key, value, cache, slots)
    tiled_meta = replace(meta, tiled_kv=True)
    out = paged_attention_cpu(q, poisoned, tiled_meta, 0.125)
    assert not out.isnan().any()
    assert torch.equal(out, paged_attention_cpu(q, clean, tiled_meta, 0.125))


@needs_tiles
def test_the_tiled_write_matches_the_reference_and_the_dense_write() -> None:
    dense, tiled = torch.zeros(2, 20, 32, 3, 64, dtype=BF16), torch.zeros(2, 20, 32, 3, 64, dtype=BF16)
    by_ref = tiled.clone()
    slots = torch.randperm(20 * 32)[:150]
    qkv = torch.randn(150, 9, 64).to(BF16)
    key, value = qkv[:, 3:6], qkv[:, 6:]  # strided rows, as the model passes them
    store_kv_ref(key, value, dense, slots)
    store_kv_tiled(key, value, tiled, slots)
    store_kv_ref(key, value, by_ref, slots, tiled=True)
    assert torch.equal(tiled, by_ref)
    assert torch.equal(untile_blocks(tiled), dense)
    with pytest.raises(RuntimeError, match="pd_store_kv_tiled"):
        store_kv_tiled(key, value, tiled, torch.tensor([20 * 32] * 150))


@needs_tiles
def test_dispatch_writes_and_reads_tiles_under_every_cpu_backend() -> None:
    q, kv, meta = make_batch([3, 1], [3, 20], 4, 2, 64, 16, BF16, seed=7)
    tiled_meta = replace(meta, tiled_kv=True)
    saved = dispatch.get_backend()
    try:
        outs = []
        for backend in ("auto", "torch"):
            dispatch.set_backend(backend)
            cache = torch.zeros_like(kv)
            key, value = torch.randn(2, 4, 2, 64, generator=torch.Generator().manual_seed(1)).to(BF16)
            dispatch.store_kv(key, value, cache, tiled_meta.slot_mapping, tiled=True)
            outs.append((cache, dispatch.paged_attention(q, cache, tiled_meta, 0.125)))
        assert torch.equal(outs[0][0], outs[1][0])
        torch.testing.assert_close(outs[0][1].float(), outs[1][1].float(), atol=2e-2, rtol=2e-2)
    finally:
        dispatch.set_backend(saved)


def _runner(dtype: str, backend: str) -> ModelRunner:
    cfg = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=64, hidden_size=256, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=256, rms_norm_eps=1e-5,
        rope_theta=10000.0, dtype=dtype,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    saved = dispatch.get_backend()
    dispatch.set_backend(backend)
    try:
        return ModelRunner(model, num_blocks=8, block_size=16)
    finally:
        dispatch.set_backend(saved)


@needs_tiles
def test_a_runner_tiles_bfloat16_caches_where_the_kernel_reads_them() -> None:
    assert _runner("bfloat16", "auto").kv_tiled
    assert not _runner("bfloat16", "torch").kv_tiled  # the plain reference path stays dense
    assert not _runner("float32", "auto").kv_tiled
    runner = _runner("bfloat16", "auto")
    assert runner.decoder is not None  # decode steps in one C call write and read the tiles too
    assert runner.prepare([StepEntry((1, 2), 0, (0,))]).meta.tiled_kv
    assert layout_of(runner.kv_caches, runner.kv_tiled) != layout_of(runner.kv_caches)


def test_metadata_is_dense_unless_told() -> None:
    meta = AttentionMetadata.build([1], [1], [[0]], 16)
    assert not meta.tiled_kv
    assert AttentionMetadata.build([1], [1], [[0]], 16, tiled_kv=True).tiled_kv
