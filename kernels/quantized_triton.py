"""Linear layers with weights in groups of 32 inputs on CUDA: ``y = x W^T (+ b)`` by a Triton matmul
that reads the quantized weights as they are (``kernels/quantized.py``: int4, and a GGUF file's Q4_0,
Q4_1, Q4_K and Q8_0 blocks) and whose sums do not depend on the batch.

A program walks the inputs one group (32) at a time from the first: it loads the group's 4-bit
values (16 bytes an output, the first input of each pair in the low nibble) or 8-bit ones, widens
them to ``x``'s dtype (exactly: 0..15 and -128..127 are integers every float dtype holds), multiplies
them with the group's inputs into a fresh float32 sum, and adds ``d`` times that sum and, for 4 bits,
``m`` times the sum of the group's inputs to the output's running sum: the CPU kernel's order
(``csrc/linear_cpu.c``), group by group. As in ``linear_triton``, one tile configuration serves every
row count, so a row's result is the same to the bit alone or in any batch, decoded or prefilled; an
output is rounded once, to ``x``'s dtype, after the bias is added in float32.

Layout on the device: 4 bits: ``q`` ``[n, k / 2]`` uint8; 8 bits: ``[n, k]`` int8; scales and offsets
``[n, k / 32]`` float32. The reference is ``grouped_linear_ref``: the dequantized weight
(``quantized.dequantize``) multiplied in float32, rounded to ``x``'s dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn
from triton.runtime.interpreter import InterpretedFunction

from pdfabric.kernels.launch_checks import FLOAT_DTYPES, require
from pdfabric.kernels.linear_triton import TileConfig
from pdfabric.kernels.quantized import GROUP, GroupedWeight, dequantize

# One configuration whatever the number of rows (as linear_triton's): 64-row tiles keep Hopper's wgmma
# for prompts; a group a step is what one pair of scale and offset covers.
CONFIG = TileConfig(64, 128, GROUP, num_warps=4, num_stages=4)
_GROUP_M = 8


@triton.jit(do_not_specialize=["rows"])
def _grouped_kernel(
    x_ptr, q_ptr, s_ptr, m_ptr, b_ptr, y_ptr, rows, cols, depth, stride_xm, stride_qn, stride_sn, stride_ym,
    BITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP_SIZE: tl.constexpr, GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)  # launch order only, as in linear_triton
    tiles_m = tl.cdiv(rows, BLOCK_M)
    tiles_n = tl.cdiv(cols, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % per_group) % group_rows
    tile_n = (pid % per_group) // group_rows

    m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of x and y
    n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] outputs
    k = tl.arange(0, GROUP_SIZE)
    m_ok = m < rows
    n_ok = n < cols
    x_ptrs = x_ptr + m.to(tl.int64)[:, None] * stride_xm + k[None, :]  # [BLOCK_M, GROUP]
    if BITS == 4:
        q_ptrs = q_ptr + n.to(tl.int64)[None, :] * stride_qn + tl.arange(0, GROUP_SIZE // 2)[:, None]
    else:
        q_ptrs = q_ptr + n.to(tl.int64)[None, :] * stride_qn + k[:, None]  # [GROUP, BLOCK_N]
    s_ptrs = s_ptr + n.to(tl.int64) * stride_sn
    m_ptrs = m_ptr + n.to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(0, depth // GROUP_SIZE):  # from the first group, whatever the row count
        a = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        if BITS == 4:
            byte = tl.load(q_ptrs, mask=n_ok[None, :], other=0)  # [GROUP / 2, BLOCK_N]
            pairs = tl.join(byte & 0xF, byte >> 4)  # [GROUP / 2, BLOCK_N, 2]: inputs 2i, 2i + 1
            w = tl.reshape(tl.permute(pairs, (0, 2, 1)), (GROUP_SIZE, BLOCK_N))
        else:
            w = tl.load(q_ptrs, mask=n_ok[None, :], other=0)
        if INTERPRET:  # as linear_triton: numpy's matmul is not row-independent (and has no bfloat16)
            part = tl.sum(a.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], 1)
        else:
            part = tl.dot(a, w.to(x_ptr.dtype.element_ty), input_precision=DOT_PRECISION)
        acc += part * tl.load(s_ptrs + g, mask=n_ok, other=0.0)[None, :]
        if BITS == 4:
            sums = tl.sum(a.to(tl.float32), 1)  # [BLOCK_M]: the group's inputs
            acc += sums[:, None] * tl.load(m_ptrs + g, mask=n_ok, other=0.0)[None, :]
        x_ptrs += GROUP_SIZE
        q_ptrs += GROUP_SIZE // 2 if BITS == 4 else GROUP_SIZE
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + m.to(tl.int64)[:, None] * stride_ym + n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


INTERPRETED = isinstance(_grouped_kernel, InterpretedFunction)


def device_form(weight: GroupedWeight, device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """``weight`` laid out for the kernel on ``device``: ``(q, scales, offsets)`` (module docstring;
    offsets are the scales for 8 bits, never read)."""
    q = weight.q
    if weight.bits == 4:
        q = q[:, 0::2] | (q[:, 1::2] << 4)  # the pair's first input in the low nibble
    else:
        q = q.view(torch.int8)
    scales = weight.scales.float()
    offsets = scales if weight.offsets is None else weight.offsets.float()
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
    require(tuple(q.shape) == (cols, depth * bits // 8), f"q {tuple(q.shape)} does not fit {depth} inputs")
    require(tuple(scales.shape) == tuple(offsets.shape) == (cols, depth // GROUP), "scales/offsets misshapen")
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
        GROUP_SIZE=GROUP, GROUP_M=_GROUP_M, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
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
