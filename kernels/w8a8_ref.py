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


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` rounded once to float32 (to nearest, ties to even), as a fused multiply-add
    rounds it: float32 tensors, broadcast. The product is exact in float64 and the sum's error exact
    by Knuth's two-sum; the float64 sum rounded to float32 is right unless it lies on a midpoint
    between two float32 values that the exact sum does not, where the error's sign picks the side."""
    p, c64 = a.double() * b.double(), c.double()
    s = p + c64
    back = s - p
    err = (p - (s - back)) + (c64 - back)
    r = s.float()
    other = torch.nextafter(r, torch.where(s > r.double(), torch.inf, -torch.inf).float())  # s's other side
    mid = (s != r.double()) & (r.double() + other.double() == 2 * s)
    above, below = torch.maximum(r, other), torch.minimum(r, other)
    return torch.where(mid & (err > 0), above, torch.where(mid & (err < 0), below, r))


def w4a8_reference(x: torch.Tensor, weight: GroupedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """The ``w4a8`` linear in torch, to the bit: ``x`` quantized by ``quantize_rows``; for each group,
    the integer sums P of its products with the 4-bit levels and S of its quantized inputs (exact),
    then in float32 and in this order: P times the inputs' scale sx, the group's scale d times that
    added to the running sum in one fused multiply-add (``fma32``), its offset o times S sx in
    another, group after group; plus the bias, rounded to ``x``'s dtype. ``weight``:
    ``quantize_int4``'s (4 bits, groups of 32, offsets)."""
    qx, sx = quantize_rows(x)
    m, k = qx.shape
    groups = k // GROUP
    xg = qx.double().reshape(m, groups, GROUP)
    parts = torch.einsum("mgi,ngi->gmn", xg, weight.q.double().reshape(-1, groups, GROUP)).float()
    sums = xg.sum(dim=2).float() * sx  # [m, groups]: each group's inputs summed, rounded once
    d, o = weight.scales.float(), weight.offsets.float()  # [n, groups]
    y = torch.zeros(m, weight.q.shape[0])
    for g in range(groups):  # each step rounded as the kernel rounds it
        y = fma32(d[None, :, g], parts[g] * sx[:, g : g + 1], y)
        y = fma32(o[None, :, g], sums[:, g : g + 1], y)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
