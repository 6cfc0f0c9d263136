"""The model matches Hugging Face transformers on random weights, config by config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pdfabric.engine.generate import ReferenceEngine  # noqa: E402
from pdfabric.engine.loader import load_model  # noqa: E402
from pdfabric.engine.runner import ModelRunner, StepEntry  # noqa: E402
from pdfabric.sampling_params import SamplingParams  # noqa: E402

COMMON = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    max_position_embeddings=512,
)
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _configs() -> dict[str, object]:
    t = transformers
    return {
        "llama-mha": t.LlamaConfig(**COMMON, num_key_value_heads=8),
        "llama-gqa4-tied": t.LlamaConfig(**COMMON, num_key_value_heads=2, tie_word_embeddings=True),
        "llama3-rope-scaling": t.LlamaConfig(
            **COMMON, num_key_value_heads=4, rope_theta=500000.0, rope_scaling=LLAMA3_SCALING
        ),
        "llama-attention-bias": t.LlamaConfig(**COMMON, num_key_value_heads=1, attention_bias=True),
        "qwen2-qkv-bias": t.Qwen2Config(**COMMON, num_key_value_heads=2, tie_word_embeddings=True),
        "mistral": t.MistralConfig(**COMMON, num_key_value_heads=2, sliding_window=None),
    }


@pytest.fixture(scope="module", params=list(_configs()))
def checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, object]:
    cfg = _configs()[request.param]
    torch.manual_seed(0)
    model_cls = {
        "LlamaConfig": transformers.LlamaForCausalLM,
        "Qwen2Config": transformers.Qwen2ForCausalLM,
        "MistralConfig": transformers.MistralForCausalLM,
    }[type(cfg).__name__]
    hf = model_cls(cfg).float().eval()
    with torch.no_grad():  # biases start at zero; make them matter
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return path, hf


def _prompt(n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(n)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def test_logits_match(checkpoint: tuple[Path, object]) -> None:
    path, hf = checkpoint
    ids = _prompt(37, 300)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()  # [L, vocab]
    model = load_model(path)
    runner = ModelRunner(model, num_blocks=16, block_size=16)
    prepared = runner.prepare([StepEntry(tuple(ids), 0, tuple(range(3)))])
    with torch.inference_mode():
        hidden = model(prepared.input_ids, prepared.positions, runner.kv_caches, prepared.meta)
        ours = model.compute_logits(hidden)
    rel = (ours - ref).abs().max() / ref.abs().max()
    assert rel < 1e-4, f"max relative logit error {rel:.2e}"


def test_greedy_tokens_match(checkpoint: tuple[Path, object]) -> None:
    path, hf = checkpoint
    prompt = _prompt(11, 300)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(32):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    engine = ReferenceEngine(path, num_blocks=32)
    out = engine.generate(prompt, SamplingParams(max_tokens=32, ignore_eos=True))
    assert out.token_ids == ids[len(prompt) :]
    assert engine.tables.pool.num_free == 32
