"""RMSNorm on CUDA: one Triton program per row, so a row's sum of squares never depends on the batch.

``torch``'s CUDA reduction behind the reference picks its strategy (threads per row, rows per block,
vectorisation) from the tensor's shape, so a row's sum may be ordered differently in a decode step and
in a prompt chunk. Here each row is one program over a fixed block of the hidden size (the next power
of two, with a warp count that depends on it alone), so the order of its sum is fixed by the model.

Arithmetic as ``layer_ops_ref.rms_norm_ref``: in float32, ``h = x * rsqrt(mean(x^2) + eps)``, then
``h`` rounded to the model dtype and multiplied by the weight in that dtype (one rounding of the exact
product, as torch multiplies half-precision tensors). The sum's order, and ``rsqrt``'s last bit, may
differ from torch's, so the two agree to an ulp of the model dtype, not to the bit.

The rotary embedding and the SiLU product need no kernel of their own: their references are
element-wise, and an element's result never depends on the others.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdfabric.kernels.launch_checks import FLOAT_DTYPES, require


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, hidden, eps, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)  # [BLOCK]
    mean_sq = tl.sum(x * x, 0) / hidden
    h = x * tl.rsqrt(mean_sq + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    dtype = out_ptr.dtype.element_ty
    y = h.to(dtype).to(tl.float32) * w.to(tl.float32)  # exact for 16-bit h and w: one rounding below
    tl.store(out_ptr + row * stride_o + cols, y.to(dtype), mask=ok)


def _warps(block: int) -> int:
    """Warps per row for a block of ``block`` elements: from the hidden size alone, never the batch."""
    return min(16, max(1, block // 256))


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as ``rms_norm_ref`` for ``x: [T, hidden]`` and ``weight: [hidden]`` of ``x``'s dtype."""
    require(x.dim() == 2, f"x must be [tokens, hidden], got {tuple(x.shape)}")
    require(x.dtype in FLOAT_DTYPES, f"x dtype {x.dtype} is not fp16, bf16 or fp32")
    require(x.stride(1) == 1, f"x must have unit stride on hidden, got {x.stride()}")
    require(tuple(weight.shape) == (x.shape[1],),
            f"weight must be [hidden={x.shape[1]}], got {tuple(weight.shape)}")
    require(weight.dtype == x.dtype, f"x is {x.dtype} but weight is {weight.dtype}")
    require(weight.device == x.device, f"x is on {x.device} but weight is on {weight.device}")
    require(weight.stride(0) == 1, f"weight must be contiguous, got stride {weight.stride()}")
    tokens, hidden = x.shape
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)  # [T, hidden]
    if tokens == 0:
        return out
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(tokens,)](
        x, weight, out, hidden, eps, x.stride(0), out.stride(0), BLOCK=block, num_warps=_warps(block)
    )
    return out
