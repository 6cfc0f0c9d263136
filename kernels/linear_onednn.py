"""oneDNN's packed GEMM for a CPU's linear layers: the weight reordered once into oneDNN's blocked
layout (the ops PyTorch's compiler uses when it freezes a model). oneDNN picks its blocking per shape,
so a row's sums change with the rows beside it; kept for measurement (``[worker] linears = "onednn"``,
``pdfabric bench engine --linears onednn``), not served by default (``linear_cpu.py``)."""

from __future__ import annotations

import torch
from torch import nn


def onednn_available() -> bool:
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


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
