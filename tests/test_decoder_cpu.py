"""Decode steps (and steps of short chunks) run from C (``kernels/decoder_cpu.py``) give the model's
op-by-op logits to the bit, on
checkpoints of several shapes (GQA ratios, q/k/v and output biases, tied heads) in float32 and
bfloat16, and on SmolLM2; and the runner takes that path only where every kernel of a layer is a C one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdfabric.engine.default_model import resolve_model
from pdfabric.engine.loader import load_model
from pdfabric.engine.runner import ModelRunner, StepEntry
from pdfabric.kernels import set_backend
from pdfabric.kernels.cpu_build import cpu_has_half_math
from pdfabric.kernels.paged_attention_cpu import decodes_as_prefill
from tests.test_gguf import packaged

transformers = pytest.importorskip("transformers")

BLOCK = 16
COMMON = {"vocab_size": 300, "hidden_size": 256, "intermediate_size": 344, "num_hidden_layers": 3,
          "num_attention_heads": 4, "max_position_embeddings": 1024}  # fmt: skip
SHAPES = {
    "llama-gqa2-output-bias": ("LlamaConfig", {"num_key_value_heads": 2, "attention_bias": True}),
    "qwen2-mqa-qkv-bias-tied": ("Qwen2Config", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
    "llama-mha-rope-theta": ("LlamaConfig", {"num_key_value_heads": 4, "rope_theta": 500000.0}),
}
DTYPES = ["float32", "bfloat16"]


def _need(dtype: str) -> None:
    if dtype == "bfloat16" and not cpu_has_half_math():
        pytest.skip("bfloat16 is computed in float32 on a CPU without native bfloat16")
    if dtype != "float32" and not decodes_as_prefill(getattr(torch, dtype)):
        pytest.skip(f"{dtype} decode rows run the decode kernel on this CPU: no C decoder path")


@pytest.fixture(scope="module", params=list(SHAPES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    kind, extra = SHAPES[request.param]
    cfg = getattr(transformers, kind)(**COMMON, **extra)
    torch.manual_seed(1)
    hf = (transformers.Qwen2ForCausalLM if kind == "Qwen2Config" else transformers.LlamaForCausalLM)(cfg)
    with torch.no_grad():  # biases start at zero; make them matter
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    path = tmp_path_factory.mktemp(request.param)
    hf.float().save_pretrained(path)
    return path


def _pair(
    path: Path, dtype: str, num_blocks: int = 64, quantization: str = "none"
) -> tuple[ModelRunner, ModelRunner]:
    """Two runners of the same weights: the first with the C decoder, the second without."""
    fused = ModelRunner(
        load_model(path, dtype, quantization=quantization), num_blocks=num_blocks, block_size=BLOCK,
        quantization=quantization,
    )  # fmt: skip
    plain = ModelRunner(
        load_model(path, dtype, quantization=quantization), num_blocks=num_blocks, block_size=BLOCK,
        quantization=quantization,
    )  # fmt: skip
    assert fused.decoder is not None
    plain.decoder = None
    return fused, plain


def _decode_equal(fused: ModelRunner, plain: ModelRunner, prompts: list[tuple[int, ...]], steps: int) -> None:
    """Prefills the prompts, then decodes them together (greedy) ``steps`` times on both runners; every
    step's logits must be the same to the bit, and so every token."""
    per_seq = fused.num_blocks // len(prompts)
    tables = [tuple(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    first = [StepEntry(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
    assert torch.equal(a := fused.step(first), plain.step(first))
    tokens = [[int(row.argmax())] for row in a]
    for _ in range(steps):
        seqs = zip(prompts, tables, tokens, strict=True)
        entries = [StepEntry((out[-1],), len(p) + len(out) - 1, t) for p, t, out in seqs]
        got = fused.step(entries)
        assert torch.equal(got, plain.step(entries))
        for out, row in zip(tokens, got, strict=True):
            out.append(int(row.argmax()))


# int4 leaves the down projection (344 inputs: not groups of 32) in the model dtype: formats mixed in a layer
@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_c_decoder_gives_the_models_logits_to_the_bit(
    checkpoint: Path, dtype: str, quantization: str
) -> None:
    _need(dtype)
    fused, plain = _pair(checkpoint, dtype, quantization=quantization)
    gen = torch.Generator().manual_seed(2)
    prompts = [tuple(torch.randint(0, 300, (n,), generator=gen).tolist()) for n in (5, 40, 17)]
    _decode_equal(fused, plain, prompts[:1], 4)  # one sequence
    _decode_equal(fused, plain, prompts, 6)  # a batch of several lengths


@pytest.mark.parametrize("quantization", ["none", "int4"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_short_chunks_run_from_c_as_decode_rows_with_the_forwards_bits(
    checkpoint: Path, dtype: str, quantization: str
) -> None:
    """A step whose sequences have at most DECODER_CHUNK_TOKENS new tokens each (speculation's checks
    and drafts: a few tokens after a cached context, beside decode rows) runs from C, each token a
    decode row attending up to itself, with the logits of every token the forward gives; a longer
    chunk runs the forward."""
    from pdfabric.engine.runner import DECODER_CHUNK_TOKENS

    _need(dtype)
    fused, plain = _pair(checkpoint, dtype, quantization=quantization)
    calls = []
    decoder = fused.decoder

    class Counted:  # the decoder, its calls counted
        rows_only = decoder.rows_only

        def __call__(self, *args) -> None:  # noqa: ANN002
            calls.append(1)
            decoder(*args)

    fused.decoder = Counted()  # type: ignore[assignment]
    # where decode rows take the decode kernel (float32 without AVX-512), only one-token steps come here
    limit = 1 if decoder.rows_only else DECODER_CHUNK_TOKENS
    assert decoder.rows_only == (not decodes_as_prefill(getattr(torch, dtype)))
    gen = torch.Generator().manual_seed(4)
    tokens = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (60, 60, 60)]
    tables = [tuple(range(i * 20, (i + 1) * 20)) for i in range(3)]
    cached = (30, 40, 20)
    first = [
        StepEntry(tuple(t[:c]), 0, tb, needs_logits=False)
        for t, c, tb in zip(tokens, cached, tables, strict=True)
    ]
    for runner in (fused, plain):
        runner.step(first)
    for lens in ((5, 1, DECODER_CHUNK_TOKENS), (2, 2, 1), (1, 1, 1), (1, 3, DECODER_CHUNK_TOKENS + 1)):
        entries = [
            StepEntry(tuple(t[c : c + n]), c, tb, all_logits=True)
            for t, c, n, tb in zip(tokens, cached, lens, tables, strict=True)
        ]
        before = len(calls)
        assert torch.equal(fused.step(entries), plain.step(entries)), lens
        assert len(calls) - before == (max(lens) <= limit), lens
        cached = tuple(c + n for c, n in zip(cached, lens, strict=True))


def test_c_decoder_calls_after_layer_for_each_layer_in_order(checkpoint: Path) -> None:
    _need("float32")
    fused, plain = _pair(checkpoint, "float32")
    table = tuple(range(8))
    for runner in (fused, plain):
        runner.step([StepEntry((1, 2, 3), 0, table, needs_logits=False)])
    seen: list[int] = []
    entry = [StepEntry((4,), 3, table)]
    assert torch.equal(fused.step(entry, seen.append), plain.step(entry))
    assert seen == list(range(fused.config.num_layers))


@pytest.mark.parametrize("quantization", ["none", "int8", "int4", "w8a8"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_tied_heads_packed_weight_serves_the_embedding_lookup(
    checkpoint: Path, dtype: str, quantization: str
) -> None:
    """A tied head packed for the CPU kernels is the embedding table too: the lookup reads its packed
    rows (dequantized where the head is quantized), and the table is not held a second time; an untied
    model keeps its own table."""
    from pdfabric.engine.model import HeadEmbedding
    from pdfabric.kernels.weight_forms import quantize_int8

    _need(dtype)
    model = load_model(checkpoint, dtype, quantization=quantization)
    tied = model.lm_head is None
    table = model.model.embed_tokens.weight.detach().clone()
    runner = ModelRunner(model, num_blocks=8, block_size=BLOCK, quantization=quantization)
    lookup = model.model.embed_tokens
    if not tied:
        assert isinstance(lookup, torch.nn.Embedding)
        return
    assert isinstance(lookup, HeadEmbedding)
    ids = torch.arange(table.shape[0]).flip(0).reshape(3, -1)  # any shape of ids, every row
    want = table
    if quantization != "none":  # an int4 model's head is int8 on CPUs (runner.head_quantization)
        q, scale = quantize_int8(table)
        want = (q.float() * scale[:, None]).to(table.dtype)
    assert torch.equal(lookup(ids), want[ids])
    assert not any(t.shape == table.shape for t in (*model.parameters(), *model.buffers()))
    assert runner.step([StepEntry((1, 2, 3), 0, (0,))]).isfinite().all()


@packaged
@pytest.mark.parametrize("quantization", ["none", "int8", "int4", "gguf", "w8a8", "w4a8"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_c_decoder_on_smollm2(dtype: str, quantization: str) -> None:
    _need(dtype)
    fused, plain = _pair(resolve_model("smollm2-135m"), dtype, num_blocks=96, quantization=quantization)
    gen = torch.Generator().manual_seed(3)
    prompts = [tuple(torch.randint(0, 49152, (n,), generator=gen).tolist()) for n in (70, 3, 130)]
    _decode_equal(fused, plain, prompts, 3)


def test_the_runner_takes_the_c_decoder_only_where_every_kernel_is_a_c_one(checkpoint: Path) -> None:
    _need("float32")
    assert ModelRunner(load_model(checkpoint, "float32"), 8, BLOCK).decoder is not None
    assert ModelRunner(load_model(checkpoint, "float32"), 8, BLOCK, linears="onednn").decoder is None
    set_backend("torch")
    try:
        assert ModelRunner(load_model(checkpoint, "float32"), 8, BLOCK).decoder is None
    finally:
        set_backend("auto")


def test_caches_moved_after_the_runner_was_built_are_the_ones_the_c_decoder_writes(checkpoint: Path) -> None:
    """A decode worker moves its caches into shared memory after building its runner."""
    _need("float32")
    fused, plain = _pair(checkpoint, "float32")
    fused.kv_caches = [torch.zeros_like(c) for c in fused.kv_caches]
    assert fused.decoder is not None
    _decode_equal(fused, plain, [(3, 1, 4, 1, 5, 9, 2, 6)], 3)
    assert any(c.count_nonzero() > 0 for c in fused.kv_caches)
