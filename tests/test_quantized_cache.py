"""Weights quantized at start kept in the model cache (``engine/quantized_cache.py``): the next start
reads every layer instead of quantizing it and packs the same bytes; a torn file is quantized again
and replaced; another checkpoint gets other files; a cache that cannot be written still serves."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pdfabric.engine.default_model import ensure_preset
from pdfabric.engine.loader import load_model
from pdfabric.engine.quantized_cache import CachedQuantizer, cached_quantizer, quantizer_for
from pdfabric.engine.runner import ModelRunner
from pdfabric.kernels import linear_cpu, weight_forms


def _packed(path: Path, quantization: str, quantizer: CachedQuantizer | None) -> list[torch.Tensor]:
    """The packed weights of ``path``'s model held as ``quantization``, in module order."""
    runner = ModelRunner(load_model(path, quantization=quantization), 2, 16, quantization=quantization,
                         quantizer=quantizer)  # fmt: skip
    return [b for name, b in runner.model.named_buffers() if name.endswith("packed_weight")]


def _quantized_layers(path: Path, quantization: str) -> int:
    """How many of the model's layers ``quantization`` holds quantized (the head too; tiny's down
    projection has 176 inputs, not groups of 32, so int4 and w8a8 keep it in float32)."""
    runner = ModelRunner(load_model(path, quantization=quantization), 2, 16, quantization=quantization)
    held = [m for m in runner.model.modules() if isinstance(m, linear_cpu.InvariantLinear)]
    return sum(m.quantization != "none" for m in held)


def _no_quantizing(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(weight: torch.Tensor) -> None:
        raise AssertionError("quantized again instead of read from the cache")

    for module, name in (
        (weight_forms, "quantize_int8"),
        (weight_forms, "quantize_int4"),
        (linear_cpu, "quantize_int8"),
    ):
        monkeypatch.setattr(module, name, refuse)


@pytest.mark.parametrize("quantization", ["int8", "int4", "w8a8", "w4a8"])
def test_the_next_start_reads_every_layer_and_packs_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quantization: str
) -> None:
    path = ensure_preset("tiny")
    computed = _packed(path, quantization, None)
    first = cached_quantizer(path, torch.float32, tmp_path)
    written = _packed(path, quantization, first)
    layers = _quantized_layers(path, quantization)  # the head too (int4 keeps it in int8)
    assert layers > 1 and (first.read, first.written) == (0, layers)
    assert all(torch.equal(a, b) for a, b in zip(computed, written, strict=True))
    _no_quantizing(monkeypatch)
    second = cached_quantizer(path, torch.float32, tmp_path)
    again = _packed(path, quantization, second)
    assert (second.read, second.written) == (layers, 0)
    assert all(torch.equal(a, b) for a, b in zip(computed, again, strict=True))


def test_a_torn_file_is_quantized_again_and_replaced(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = ensure_preset("tiny")
    computed = _packed(path, "int4", cached_quantizer(path, torch.float32, tmp_path))
    root = cached_quantizer(path, torch.float32, tmp_path).root
    torn = sorted(root.glob("*.int4.safetensors"))[0]
    torn.write_bytes(torn.read_bytes()[:100])
    foreign = sorted(root.glob("*.int4.safetensors"))[1]  # another layer's file under this one's name
    foreign.write_bytes(sorted(root.glob("*.int8.safetensors"))[0].read_bytes())
    third = cached_quantizer(path, torch.float32, tmp_path)
    again = _packed(path, "int4", third)
    assert third.written == 2 and "unreadable" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(computed, again, strict=True))
    fourth = cached_quantizer(path, torch.float32, tmp_path)
    _packed(path, "int4", fourth)
    assert fourth.written == 0  # replaced by whole files
    assert not list(root.glob(".tmp-*"))


def test_another_checkpoint_or_dtype_has_files_of_its_own(tmp_path: Path) -> None:
    path = ensure_preset("tiny")
    root = cached_quantizer(path, torch.float32, tmp_path).root
    assert cached_quantizer(path, torch.bfloat16, tmp_path).root != root
    weights = path / "model.safetensors"
    stat = weights.stat()
    try:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # the file changed
        assert cached_quantizer(path, torch.float32, tmp_path).root != root
    finally:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_a_cache_that_cannot_be_written_still_serves(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = ensure_preset("tiny")
    (tmp_path / "quantized").write_text("a file where the directory would be")
    blocked = cached_quantizer(path, torch.float32, tmp_path)
    packed = _packed(path, "int8", blocked)
    assert (blocked.read, blocked.written) == (0, 0) and "cannot keep quantized weights" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(_packed(path, "int8", None), packed, strict=True))


def test_only_weights_quantized_at_start_are_kept() -> None:
    path = ensure_preset("tiny")
    model = load_model(path)
    assert quantizer_for(path, model, "none") is None and quantizer_for(path, model, "gguf") is None
    assert isinstance(quantizer_for(path, model, "int4"), CachedQuantizer)
