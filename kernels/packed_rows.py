"""Rows of a packed weight read back: a tied head's embedding lookup reads the rows the head
multiplies instead of keeping the table a second time (``engine/model.HeadEmbedding``).

``packed_rows(linear, ids)`` gives rows of an ``InvariantLinear``'s weight in the compute dtype, read
from its panels (``csrc/linear_cpu.c`` describes each layout): float32 and bfloat16 as they are,
quantized ones dequantized in float32 as ``quantized.dequantize`` and ``weight_forms.quantize_int8``
define them, then rounded once, so the rows are the weights the kernel multiplies.
"""

from __future__ import annotations

import torch

from pdfabric.kernels.linear_cpu import GROUPED_CODES, INT8_CODES, W8A8_CODES, InvariantLinear

COLS = 64  # output columns per panel


def packed_rows(linear: InvariantLinear, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of ``linear``'s weight, ``[len(ids), in_features]`` in its compute dtype."""
    n, k = linear.out_features, linear.in_features
    panels, pairs = -(-n // COLS), -(-k // 2)
    ids = ids.long()
    p, c = ids // COLS, ids % COLS
    buf, code = linear.packed_weight, linear.dtype_code
    if code in (0, 1):  # float32 panel[k][64]; bfloat16 panel[k / 2][64][2]
        if code == 0:
            return buf.view(panels, k, COLS)[p, :, c]
        return buf.view(panels, pairs, COLS, 2)[p, :, c].reshape(len(ids), 2 * pairs)[:, :k].contiguous()
    head = panels * COLS * 4  # bytes of the per-output scales (int8, w8a8) or 0 (grouped)
    if code in GROUPED_CODES.values():
        group = linear.group
        groups = k // group
        scales = buf[: panels * groups * COLS * 4].view(torch.float32).view(panels, groups, COLS)
        body = buf[len(buf) - panels * pairs * (COLS if linear.bits == 4 else 2 * COLS) :]
        if linear.bits == 4:  # panel[k / 2][64] bytes, a pair's first input in the low nibble
            byte = body.view(panels, pairs, COLS)[p, :, c]
            q = torch.stack((byte & 15, byte >> 4), dim=-1).reshape(len(ids), k).float()
        else:  # panel[k / 2][64][2] int8
            q = body.view(torch.int8).view(panels, pairs, COLS, 2)[p, :, c].reshape(len(ids), k).float()
        w = q.reshape(len(ids), groups, group) * scales[p, :, c][..., None]
        if linear.offsets:
            offsets = buf[panels * groups * COLS * 4 : 2 * panels * groups * COLS * 4].view(torch.float32)
            w = w + offsets.view(panels, groups, COLS)[p, :, c][..., None]
        return w.reshape(len(ids), k).to(linear._dtype)
    scale = buf[:head].view(torch.float32)[ids]
    body = buf[head:]
    if code in W8A8_CODES.values():  # panel[k / 4][64][4] of q + 128
        q = body.view(panels, k // 4, COLS, 4)[p, :, c].reshape(len(ids), k).float() - 128.0
    elif code == INT8_CODES[torch.bfloat16]:  # panel[k / 2][64][2]
        q = body.view(torch.int8).view(panels, pairs, COLS, 2)[p, :, c].reshape(len(ids), 2 * pairs)
        q = q[:, :k].float()
    else:  # panel[k][64]
        q = body.view(torch.int8).view(panels, k, COLS)[p, :, c].float()
    return (q * scale[:, None]).to(linear._dtype)
