"""The ``w8a8`` linear in torch, the bits the C kernel (``csrc/linear_w8a8.h``) must give: how it
quantizes its input rows, and the sums it makes of them."""

from __future__ import annotations

import torch

from pdfabric.kernels.quantized import GROUP


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the ``w8a8`` kernel does to its input rows before it multiplies: ``x`` ``[m, k]`` (K a
    multiple of 32) as int8 with a float32 scale per 32 inputs of a row ``[m, k / 32]``: symmetric,
    ``q = round(x / s)`` (half to even) with ``s = max |x| / 127`` over the group (0 for a group of
    zeros, whose q are 0)."""
    m, k = x.shape
    xf = x.detach().float().reshape(m, k // GROUP, GROUP)
    scale = xf.abs().amax(dim=2) / 127.0
    q = torch.round(xf / torch.where(scale > 0, scale, 1.0)[..., None]).clamp_(-127, 127)
    q = torch.where(scale[..., None] > 0, q, 0.0)
    return q.reshape(m, k).to(torch.int8), scale


def w8a8_reference(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The ``w8a8`` linear in torch, to the bit: ``x`` quantized by ``quantize_rows``; each group's
    integer products summed exactly, times the group's scale, added group after group in float32;
    then times the weight's scale, plus the bias, rounded to ``x``'s dtype. ``q``, ``scale``: the
    weight as ``quantize_int8`` gives it."""
    qx, sx = quantize_rows(x)
    m, k = qx.shape
    groups = k // GROUP
    # [groups, m, n]: exact, every partial sum is an integer far below 2**24
    parts = torch.einsum(
        "mgi,ngi->gmn", qx.double().reshape(m, groups, GROUP), q.double().reshape(-1, groups, GROUP)
    ).float()
    y = torch.zeros(m, q.shape[0])
    for g in range(groups):  # in order, a multiply and an add, as the kernel rounds them
        y = y + parts[g] * sx[:, g : g + 1]
    y = y * scale[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
