"""The ``w8a8`` and ``w4a8`` linears in torch, the bits the C kernels (``csrc/linear_w8a8.h``,
``csrc/linear_w4a8.h``) must give: how they quantize their input rows, and the sums they make of them."""

from __future__ import annotations

import torch

from pdfabric.kernels.quantized import GROUP, GroupedWeight


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


def w4a8_reference(x: torch.Tensor, weight: GroupedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """The ``w4a8`` linear in torch, to the bit: ``x`` quantized by ``quantize_rows``; for each group,
    the integer sums of its products with the 4-bit levels and of its quantized inputs (exact), then
    in float32 and in this order: the group's scale d times the first, its offset o times the second,
    their sum, times the inputs' scale, added group after group; plus the bias, rounded to ``x``'s
    dtype. ``weight``: ``quantize_int4``'s (4 bits, groups of 32, offsets)."""
    qx, sx = quantize_rows(x)
    m, k = qx.shape
    groups = k // GROUP
    xg = qx.double().reshape(m, groups, GROUP)
    parts = torch.einsum("mgi,ngi->gmn", xg, weight.q.double().reshape(-1, groups, GROUP)).float()
    sums = xg.sum(dim=2).float()  # [m, groups]
    d, o = weight.scales.float(), weight.offsets.float()  # [n, groups]
    y = torch.zeros(m, weight.q.shape[0])
    for g in range(groups):  # each step rounded as the kernel rounds it
        t = d[None, :, g] * parts[g] + o[None, :, g] * sums[:, g : g + 1]
        y = y + t * sx[:, g : g + 1]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
