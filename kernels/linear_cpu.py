"""Linear layers whose weights are laid out once, at start-up, for oneDNN, the CPU's GEMM library.

``F.linear`` on the CPU hands oneDNN a plain row-major weight, which it re-blocks on every call. A
weight reordered once into oneDNN's own blocked layout (the same ops PyTorch's compiler uses when it
freezes a model) skips that work. Measured on a 2-core AMD EPYC with AVX512-BF16, 24 weights of
2816 x 1024 streamed from memory (``docs/engine.md``): bfloat16 1.4x faster at 1 row, 1.9x at
32 rows, 1.6x at 512 rows; float32 1.6x to 2.9x. The results equal ``F.linear``'s in bfloat16 and
agree to rounding in float32.
"""

from __future__ import annotations

import functools

import torch
from torch import nn


@functools.cache
def _ops_available() -> bool:
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def can_pack(linear: nn.Linear) -> bool:
    """Whether ``linear`` can be packed: a CPU float32 layer, or a bfloat16 one on a CPU that multiplies
    bfloat16 natively."""
    from pdfabric.engine.loader import cpu_has_half_math

    w = linear.weight
    if w.device.type != "cpu" or not _ops_available():
        return False
    return w.dtype == torch.float32 or (w.dtype == torch.bfloat16 and cpu_has_half_math())


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` held in oneDNN's layout; inference only."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, None))
        bias = None if linear.bias is None else linear.bias.detach()
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


def pack_linears(module: nn.Module) -> int:
    """Replaces every packable ``nn.Linear`` under ``module`` by a ``PackedLinear``; returns how many.
    The plain weights are released, so the model's weights stay in memory once."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and can_pack(child):
            setattr(module, name, PackedLinear(child))
            count += 1
        else:
            count += pack_linears(child)
    return count
