"""The form each linear layer's weight is held in under a worker's ``quantization``, whatever the
device: int8 with a scale per output (``quantize_int8``), groups of 32 inputs (``grouped_form``:
int4 computed by a ``Quantizer``, or the blocks a GGUF file gave the layer), a stacked projection's
parts in different GGUF formats (``gguf_parts``), or the compute dtype. The kernels that multiply
them are ``linear_cpu.py`` (CPUs) and ``quantized_triton.py`` (CUDA), behind ``linear.py``."""

from __future__ import annotations

import torch
from torch import nn

from pdfabric.kernels.quantized import GROUP, GroupedWeight, quantize_int4


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[n, k]`` as int8 and one float32 scale per row: symmetric, ``q = round(w / s)`` with
    ``s = max |w| / 127`` over the row (1 for a row of zeros), so ``q * s`` is the weight to within half
    a step."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


Int8Form = tuple[torch.Tensor, torch.Tensor]  # quantize_int8's: int8 [n, k] and a float32 scale per row


class Quantizer:
    """Where packing gets a layer's quantized weight: computed here (``quantize_int8``,
    ``quantize_int4``); ``engine/quantized_cache.py`` keeps what it computes in the model cache.
    ``name``: the layer's module path in the model, ``weight``: its ``[n, k]`` weight."""

    def int8(self, name: str, weight: torch.Tensor) -> Int8Form:
        return quantize_int8(weight)

    def int4(self, name: str, weight: torch.Tensor) -> GroupedWeight:
        return quantize_int4(weight)


COMPUTE = Quantizer()


Parts = tuple[tuple[int, GroupedWeight | None], ...]  # each part's outputs and blocks (None: the dtype)


def gguf_parts(linear: nn.Linear, quantization: str) -> Parts | None:
    """A stacked projection's parts when the loader found them in different formats (``gguf_parts``:
    a GGUF file's q and k in Q4_K beside v in Q6_K, say), under ``gguf``; else None."""
    return getattr(linear, "gguf_parts", None) if quantization == "gguf" else None


def grouped_form(
    linear: nn.Linear, quantization: str, quantizer: Quantizer = COMPUTE, name: str = ""
) -> GroupedWeight | None:
    """The grouped weight ``linear`` (the model's ``name``) is held as under ``quantization``: its int4
    quantization (from ``quantizer``), the GGUF blocks the loader gave it (``gguf_blocks``), or None
    where it keeps its own dtype (another quantization, an input count that is not a multiple of 32,
    no blocks). Under ``w4a8`` a GGUF file's 4-bit blocks (Q4_0, Q4_1, Q4_K: a scale and an offset
    per 32 inputs, as int4's) are taken as they are: the file's own weights, nothing quantized again."""
    if linear.in_features % GROUP:
        return None
    blocks = getattr(linear, "gguf_blocks", None)
    if quantization == "w4a8" and blocks is not None and blocks.bits == 4:
        return blocks
    if quantization in ("int4", "w4a8"):
        return quantizer.int4(name, linear.weight)
    return blocks if quantization == "gguf" else None


def layer_quantization(quantization: str, in_features: int) -> str:
    """The quantization a layer of ``in_features`` inputs gets: ``w8a8`` and ``w4a8`` quantize
    activations in groups of 32 inputs, so a layer of other widths keeps its dtype (``none``)."""
    return "none" if quantization in ("w8a8", "w4a8") and in_features % GROUP else quantization
