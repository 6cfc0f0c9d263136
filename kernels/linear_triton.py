"""Linear layers on CUDA: ``y = x W^T (+ b)`` by a Triton matmul whose sums do not depend on the batch.

cuBLAS picks its algorithm (tile shape, split-K, MMA instruction) from the problem's shape, so a token's
row is summed in one order in a decode step of 4 rows and in another inside a 600-row prompt chunk, and
its logits change in the last bits with the batch. This kernel fixes everything that decides the order
of a row's sums:

1. one tile configuration (``CONFIG``: rows, columns and inputs per step, warps, pipeline stages) for
   every row count; a different row tile could select another MMA instruction (Hopper's ``wgmma``
   needs 64-row tiles, smaller ones run ``mma.sync``), which rounds differently inside a step;
2. the input dimension is walked from 0 in fixed ``BLOCK_K`` steps by one program, accumulating in
   float32 (no split-K); an input past the end is loaded as zero, which adds nothing;
3. an output is rounded once, to ``x``'s dtype, after the bias is added in float32: what ``nn.Linear``
   does on CUDA (cuBLASLt's bias epilogue, or ``addmm`` with the bias as its ``C``) and on CPUs.

A row's products meet the same weights in the same instruction whatever rows sit beside it in the tile
(unused rows are zeros), so its result is the same to the bit alone, in any batch, decoded or
prefilled. Float32 inputs multiply in IEEE float32 (``input_precision="ieee"``), never TF32.

Why this configuration (64 x 128 tiles, 64 inputs per step, 4 warps, 4 stages; per dtype only):
decode steps multiply 1 to 32 rows and are bound by reading the weight once, prompt chunks multiply
hundreds to thousands of rows and are bound by the tensor cores. 64 rows is the smallest tile that
runs one warpgroup's ``wgmma`` on Hopper, so prefill keeps the fast instruction and a decode step
pays for at most 63 zero rows on tensor cores that would otherwise idle while the weights stream in;
128 columns keep enough programs for a decode step's weight stream on an 8B model's projections
(14,336 columns: 112 programs) while reusing each 64-row tile of ``x`` across 128 outputs in a prompt
chunk; four stages of 24 KiB (16-bit inputs) keep about 96 KiB in flight per SM, two programs per SM.
Float32 inputs use three stages (48 KiB each) to fit the shared memory. Of the tiles tried on an
H100, 128 x 128 with 8 warps multiplied long prompts faster but slowed decode steps, and 64 x 64
sped up decode steps of narrow layers a little but slowed long prompts; decode is the
latency-critical case. ``pdfabric bench kernels`` measures it against
cuBLAS (``docs/kernels.md``).

The reference is ``linear_ref``: ``F.linear`` in float32, rounded to the input's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import nn
from triton.runtime.interpreter import InterpretedFunction

from pdfabric.kernels.launch_checks import FLOAT_DTYPES, require


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# One configuration per input dtype, whatever the number of rows (module docstring).
CONFIG = {
    torch.float16: TileConfig(64, 128, 64, num_warps=4, num_stages=4),
    torch.bfloat16: TileConfig(64, 128, 64, num_warps=4, num_stages=4),
    torch.float32: TileConfig(64, 128, 64, num_warps=4, num_stages=3),
}
_GROUP_M = 8  # row tiles launched together, so that they share each weight tile in L2


@triton.jit
def tile_of(rows, cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """The (row tile, column tile) this program computes: ``GROUP_M`` row tiles launched together, so
    that they share each weight tile in L2. Launch order only: it never changes a sum."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(rows, BLOCK_M)
    tiles_n = tl.cdiv(cols, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows


@triton.jit(do_not_specialize=["rows"])  # no separate build for one row: every row count runs one binary
def _linear_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, rows, cols, depth, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
):
    tile_m, tile_n = tile_of(rows, cols, BLOCK_M, BLOCK_N, GROUP_M)
    m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of x and y
    n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] outputs: rows of W, columns of y
    k = tl.arange(0, BLOCK_K)
    m_ok = m < rows
    n_ok = n < cols
    x_ptrs = x_ptr + m.to(tl.int64)[:, None] * stride_xm + k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + n.to(tl.int64)[None, :] * stride_wn + k[:, None]  # [BLOCK_K, BLOCK_N]: W^T
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, depth, BLOCK_K):  # from input 0 in fixed steps, whatever the row count
        k_ok = k0 + k < depth
        a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if INTERPRET:  # as paged_attention_triton._dot: numpy's matmul is not row-independent
            acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)
        else:
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + m.to(tl.int64)[:, None] * stride_ym + n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# The kernel was built for the CPU interpreter (TRITON_INTERPRET=1 when this module was imported).
INTERPRETED = isinstance(_linear_kernel, InterpretedFunction)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` in float32, rounded once to ``x``'s dtype (the bias added before the rounding)."""
    b = None if bias is None else bias.float()
    return nn.functional.linear(x.float(), weight.float(), b).to(x.dtype)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    require(x.dim() == 2, f"x must be [rows, in_features], got {tuple(x.shape)}")
    require(weight.dim() == 2, f"weight must be [out_features, in_features], got {tuple(weight.shape)}")
    require(x.dtype in FLOAT_DTYPES, f"x dtype {x.dtype} is not fp16, bf16 or fp32")
    require(weight.dtype == x.dtype, f"x is {x.dtype} but weight is {weight.dtype}")
    require(weight.device == x.device, f"x is on {x.device} but weight is on {weight.device}")
    require(x.shape[1] == weight.shape[1],
            f"x has {x.shape[1]} in_features, weight {tuple(weight.shape)} takes {weight.shape[1]}")
    require(x.stride(1) == 1, f"x must have unit stride on in_features, got {x.stride()}")
    require(weight.stride(1) == 1, f"weight must have unit stride on in_features, got {weight.stride()}")
    if bias is not None:
        require(tuple(bias.shape) == (weight.shape[0],),
                f"bias must be [out_features={weight.shape[0]}], got {tuple(bias.shape)}")
        require(bias.dtype == x.dtype, f"x is {x.dtype} but bias is {bias.dtype}")
        require(bias.device == x.device, f"x is on {x.device} but bias is on {bias.device}")
        require(bias.stride(0) == 1, f"bias must be contiguous, got stride {bias.stride()}")


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b`` for ``x: [rows, in]``, ``weight: [out, in]``, ``bias: [out]``, all of one dtype;
    float32 sums, one rounding to ``x``'s dtype. A row's result does not depend on the other rows."""
    _check(x, weight, bias)
    rows, depth = x.shape
    cols = weight.shape[0]
    y = torch.empty((rows, cols), dtype=x.dtype, device=x.device)  # [rows, out]
    if rows == 0 or cols == 0:
        return y
    cfg = CONFIG[x.dtype]
    grid = (triton.cdiv(rows, cfg.block_m) * triton.cdiv(cols, cfg.block_n),)
    _linear_kernel[grid](
        x, weight, weight if bias is None else bias, y, rows, cols, depth,
        x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=_GROUP_M, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        INTERPRET=INTERPRETED,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return y


class TritonLinear(nn.Module):
    """``y = x W^T + b`` by ``linear_triton``; called like ``nn.Linear``; inference only. Holds the
    layer's own weight (no copy: a tied head shares the embedding table)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        # weight: [out_features, in_features]; bias: [out_features] or None
        self.out_features, self.in_features = weight.shape
        weight = weight.detach()
        self.register_buffer("weight", weight if weight.stride(1) == 1 else weight.contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(weight.dtype).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features]
        flat = x.reshape(-1, self.in_features)  # [rows, in_features]
        if flat.stride(1) != 1:
            flat = flat.contiguous()
        return linear_triton(flat, self.weight, self.bias).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )
