"""Torch references for the element-wise parts of a decoder layer: RMSNorm, rotary embedding, SiLU-gated
product. They are the path on every device without a fused kernel and the oracle for
``layer_ops_cpu``; each rounds to the model dtype where the Hugging Face implementation does.
"""

from __future__ import annotations

import torch
from torch import nn


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [T, hidden]; normalised in float32, scaled in the model dtype
    h = nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * h.to(x.dtype)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, head_dim]; cos: [T, 1, head_dim], sin: [T, 1, head_dim] with the first half
    # negated (so the rotation needs no negation of x), both float32
    half = x.shape[-1] // 2
    xf = x.float()
    rotated = torch.cat((xf[..., half:], xf[..., :half]), dim=-1)
    return torch.addcmul(xf * cos, rotated, sin).to(x.dtype)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up: [T, 2 * intermediate] (gate, then up) -> [T, intermediate]
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


_BITS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bitmasks ``[rows, ceil(vocab / 32)]`` int32 (bit ``t % 32`` of word ``t // 32`` set: token ``t``
    allowed) as bools ``[rows, vocab_size]``."""
    bits = (words[..., None] >> _BITS.to(words.device)) & 1
    return bits.reshape(*words.shape[:-1], -1)[..., :vocab_size].bool()


def mask_logits_ref(logits: torch.Tensor, words: torch.Tensor) -> None:
    """In place: ``logits [rows, vocab]`` to -inf where the token's bit in ``words`` is clear."""
    logits.masked_fill_(~unpack_bitmask(words.to(logits.device), logits.shape[-1]), float("-inf"))
