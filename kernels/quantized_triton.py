"""Linear layers with weights in groups of 32 inputs on CUDA: ``y = x W^T (+ b)`` by a Triton matmul
that reads the quantized weights as they are (``kernels/quantized.py``: int4, and a GGUF file's Q4_0,
Q4_1, Q4_K and Q8_0 blocks) and whose sums do not depend on the batch.

A program walks the inputs 64 at a time (two groups) from the first. It loads the two groups' 4-bit
values (32 bytes an output: input j of the first group in byte j's low nibble, of the second in its
high one) or 8-bit ones, dequantizes them in float32 (``d * q + m``, the group's scale and offset),
rounds them to ``x``'s dtype and multiplies them on the tensor cores into the float32 running sum,
as ``linear_triton`` does with plain weights. Scaling the weights rather than each group's partial
sum keeps the per-group work off the CUDA cores (scaling partial sums, the CPU kernel's way, made
prompts 8x slower than cuBLAS on an H100); the price is that each weight is rounded to ``x``'s dtype
before it is multiplied (for bfloat16, 2^-9 of the weight: far below the 4-bit step), so results are
close to, not bit-equal with, the CPU kernel's. As in ``linear_triton``, one tile configuration
serves every row count, so a row's result is the same to the bit alone or in any batch, decoded or
prefilled; an output is rounded once, to ``x``'s dtype, after the bias is added in float32.

Layout on the device (``device_form``): 4 bits: ``q`` ``[n, k64 / 2]`` uint8 with ``k64`` the inputs
rounded up to 64 (a missing last group is zeros); 8 bits: ``q`` ``[n, k]`` int8; scales and offsets
``[k64 / 32, n]`` float32, a group's row read whole by a tile. The reference is
``grouped_linear_ref``: the dequantized weight (``quantized.dequantize``) multiplied in float32,
rounded to ``x``'s dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn
from triton.runtime.interpreter import InterpretedFunction

from pdfabric.kernels.launch_checks import FLOAT_DTYPES, require
from pdfabric.kernels.linear_triton import CONFIG as PLAIN_CONFIG
from pdfabric.kernels.linear_triton import tile_of
from pdfabric.kernels.quantized import GROUP, GroupedWeight, dequantize

# One configuration whatever the number of rows: linear_triton's tile (64 x 128, 4 warps, 4 stages),
# two groups (64 inputs) a step.
CONFIG = PLAIN_CONFIG[torch.bfloat16]
_GROUP_M = 8


@triton.jit(do_not_specialize=["rows"])
def _grouped_kernel(
    x_ptr, q_ptr, s_ptr, m_ptr, b_ptr, y_ptr, rows, cols, depth, stride_xm, stride_qn, stride_sg, stride_ym,
    BITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    tile_m, tile_n = tile_of(rows, cols, BLOCK_M, BLOCK_N, GROUP_M)
    m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of x and y
    n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] outputs
    kk = tl.arange(0, 32)  # the inputs of a group
    m_ok = m < rows
    n_ok = n < cols
    x_ptrs = x_ptr + m.to(tl.int64)[:, None] * stride_xm + kk[None, :]  # [BLOCK_M, 32]
    q_ptrs = q_ptr + n.to(tl.int64)[None, :] * stride_qn + kk[:, None]  # [32, BLOCK_N]
    s_ptrs = s_ptr + n  # [BLOCK_N]: a group's scales, one row of [groups, n]
    o_ptrs = m_ptr + n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, depth, 64):  # from input 0 in steps of two groups, whatever the row count
        ok_lo = (k0 + kk) < depth  # inputs past the end load as zeros and add nothing
        ok_hi = (k0 + 32 + kk) < depth
        a_lo = tl.load(x_ptrs, mask=m_ok[:, None] & ok_lo[None, :], other=0.0)
        a_hi = tl.load(x_ptrs + 32, mask=m_ok[:, None] & ok_hi[None, :], other=0.0)
        if BITS == 4:
            byte = tl.load(q_ptrs, mask=n_ok[None, :], other=0)  # the padded last step is in range
            q_lo, q_hi = byte & 0xF, byte >> 4
            q_ptrs += 32
        else:
            q_lo = tl.load(q_ptrs, mask=n_ok[None, :] & ok_lo[:, None], other=0)
            q_hi = tl.load(q_ptrs + 32, mask=n_ok[None, :] & ok_hi[:, None], other=0)
            q_ptrs += 64
        g = k0 // 32
        w_lo = q_lo.to(tl.float32) * tl.load(s_ptrs + g * stride_sg, mask=n_ok, other=0.0)[None, :]
        w_hi = q_hi.to(tl.float32) * tl.load(s_ptrs + (g + 1) * stride_sg, mask=n_ok, other=0.0)[None, :]
        if BITS == 4:
            w_lo += tl.load(o_ptrs + g * stride_sg, mask=n_ok, other=0.0)[None, :]
            w_hi += tl.load(o_ptrs + (g + 1) * stride_sg, mask=n_ok, other=0.0)[None, :]
        w_lo = w_lo.to(x_ptr.dtype.element_ty)
        w_hi = w_hi.to(x_ptr.dtype.element_ty)
        if INTERPRET:  # as linear_triton: numpy's matmul is not row-independent
            acc += tl.sum(a_lo.to(tl.float32)[:, :, None] * w_lo.to(tl.float32)[None, :, :], 1)
            acc += tl.sum(a_hi.to(tl.float32)[:, :, None] * w_hi.to(tl.float32)[None, :, :], 1)
        else:
            acc = tl.dot(a_lo, w_lo, acc, input_precision=DOT_PRECISION)
            acc = tl.dot(a_hi, w_hi, acc, input_precision=DOT_PRECISION)
        x_ptrs += 64
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + m.to(tl.int64)[:, None] * stride_ym + n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


INTERPRETED = isinstance(_grouped_kernel, InterpretedFunction)


def device_form(weight: GroupedWeight, device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """``weight`` laid out for the kernel on ``device``: ``(q, scales, offsets)`` (module docstring;
    for 8 bits the offsets are zeros, never read)."""
    n, k = weight.shape
    groups = -(-k // 64) * 2  # rounded up to whole steps of two groups
    scales = torch.zeros(groups, n)
    scales[: k // GROUP] = weight.scales.float().t()
    offsets = torch.zeros(groups, n)
    if weight.offsets is not None:
        offsets[: k // GROUP] = weight.offsets.float().t()
    if weight.bits == 4:  # byte j of a step: input j in the low nibble, input 32 + j in the high one
        q = torch.zeros(n, groups * GROUP, dtype=torch.uint8)
        q[:, :k] = weight.q
        halves = q.reshape(n, -1, 2, GROUP)
        q = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, -1)
    else:
        q = weight.q.view(torch.int8)
    return tuple(t.contiguous().to(device) for t in (q, scales, offsets))


def grouped_linear_ref(x: torch.Tensor, weight: GroupedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """The dequantized weight multiplied in float32, rounded once to ``x``'s dtype."""
    b = None if bias is None else bias.float().to(x.device)
    return nn.functional.linear(x.float(), dequantize(weight).to(x.device), b).to(x.dtype)


def grouped_linear_triton(
    x: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    bits: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x W^T + b`` for ``x: [rows, in]`` and a grouped weight in ``device_form``; float32 sums, one
    rounding to ``x``'s dtype. A row's result does not depend on the other rows."""
    require(x.dim() == 2 and x.stride(1) == 1, f"x must be [rows, in] with unit stride, got {x.shape}")
    require(x.dtype in FLOAT_DTYPES, f"x dtype {x.dtype} is not fp16, bf16 or fp32")
    require(bits in (4, 8), f"bits must be 4 or 8, got {bits}")
    rows, depth = x.shape
    cols = q.shape[0]
    require(depth % GROUP == 0, f"in_features {depth} is not a multiple of {GROUP}")
    groups = -(-depth // 64) * 2
    width = groups * GROUP // 2 if bits == 4 else depth
    require(tuple(q.shape) == (cols, width), f"q {tuple(q.shape)} does not fit {depth} inputs in {bits} bits")
    require(tuple(scales.shape) == tuple(offsets.shape) == (groups, cols), "scales/offsets misshapen")
    require(q.device == x.device == scales.device == offsets.device, "x and the weight on different devices")
    if bias is not None:
        require(tuple(bias.shape) == (cols,) and bias.dtype == x.dtype, "bias must be [out] in x's dtype")
    y = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
    if rows == 0:
        return y
    grid = (triton.cdiv(rows, CONFIG.block_m) * triton.cdiv(cols, CONFIG.block_n),)
    _grouped_kernel[grid](
        x, q, scales, offsets, scales if bias is None else bias, y, rows, cols, depth,
        x.stride(0), q.stride(0), scales.stride(0), y.stride(0),
        BITS=bits, HAS_BIAS=bias is not None, BLOCK_M=CONFIG.block_m, BLOCK_N=CONFIG.block_n,
        GROUP_M=_GROUP_M, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        INTERPRET=INTERPRETED, num_warps=CONFIG.num_warps, num_stages=CONFIG.num_stages,
    )  # fmt: skip
    return y


class TritonGroupedLinear(nn.Module):
    """``y = x W^T + b`` by ``grouped_linear_triton``; called like ``nn.Linear``; inference only."""

    def __init__(self, weight: GroupedWeight, bias: torch.Tensor | None, device: torch.device) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bits = weight.bits
        q, scales, offsets = device_form(weight, device)
        self.register_buffer("q", q)
        self.register_buffer("scales", scales)
        self.register_buffer("offsets", offsets)
        self.register_buffer("bias", None if bias is None else bias.detach().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.stride(1) != 1:
            flat = flat.contiguous()
        y = grouped_linear_triton(flat, self.q, self.scales, self.offsets, self.bits, self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}"
