"""Linear layers on the CPU, with weights laid out once at start-up for the kernel that multiplies them.

Two kernels, behind the seam ``kernels/linear.py`` (``pack_linears``) that also serves CUDA:

- ``invariant`` (the default): ``csrc/linear_cpu.c``. Every output is one float32 sum over the inputs in
  a fixed order, whatever the number of rows, the thread count or the kind of step, so a token's
  logits are the same to the bit alone, in any batch, in a prefill chunk or a decode step. Measured on
  a 2-core AMD EPYC with AVX512-BF16 on SmolLM2-135M's shapes (``docs/engine.md``): faster than
  oneDNN at 1 to 32 rows (it reads the weight panels at memory speed with no per-call set-up), as
  fast at 512 rows. On CPUs with AMX tiles bfloat16 runs on them for every row count
  (``csrc/linear_amx.h``, ``amx_tiles``): 8-10x VDPBF16PS's rate at 512 rows on a Sapphire Rapids VM.
- ``onednn``: the weight reordered once into oneDNN's blocked layout (the ops PyTorch's compiler uses
  when it freezes a model). oneDNN picks its blocking per shape; on SmolLM2's down projection
  (K = 1536) a row's sum changes with the rows beside it, so greedy text changed with the batch.
  Kept for measurement (``pdfabric bench engine --linears onednn``), not served.

Both take CPU tensors in float32, or in bfloat16 on a CPU that multiplies it natively (AVX512-BF16;
elsewhere bfloat16 checkpoints are computed in float32, ``engine/loader.py``). Layers that neither
can take stay ``nn.Linear``.

The invariant kernel also holds weights quantized (a worker's ``quantization``, in the forms
``weight_forms.py`` chooses), the inputs and outputs staying in the compute dtype: ``int8`` (a scale per
output, ``quantize_int8``), ``int4`` (groups of 32 inputs, ``quantized.quantize_int4``) and ``gguf`` (a
GGUF checkpoint's own Q4_0, Q4_1, Q4_K and Q8_0 blocks, ``quantized.from_gguf``; a layer whose blocks
are of another type stays in the compute dtype). Grouped weights need an input count that is a multiple
of 32; other layers stay in the compute dtype too. ``w8a8`` holds the weights as ``int8`` does and
quantizes the activations too, each row in groups of 32 inputs with a scale each, as the call starts
(``w8a8_ref.quantize_rows``): the products are integers, summed exactly by an instruction that does
twice bfloat16's multiply-adds on CPUs with AVX512-VNNI (``csrc/linear_w8a8.h``), so prompts and large
batches, which are bound by arithmetic, run faster (1.2-1.4x on SmolLM2's shapes).
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import nn

from pdfabric import envs
from pdfabric.kernels import cpu_build
from pdfabric.kernels.linear_onednn import PackedLinear, onednn_available
from pdfabric.kernels.quantized import GROUP, GroupedWeight
from pdfabric.kernels.weight_forms import (
    COMPUTE,
    Int8Form,
    Parts,
    Quantizer,
    gguf_parts,
    grouped_form,
    layer_quantization,
    quantize_int8,
)
from pdfabric.worker_config import QUANTIZATIONS  # the worker's setting, named there so configs need no torch

LINEAR_KINDS = ("invariant", "onednn")
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
INT8_CODES = {torch.bfloat16: 2, torch.float32: 3}  # int8 weights beside inputs and outputs of this dtype
OUT_F32 = 64  # a flag on pd_linear's dtype: float32 out, unrounded, whatever the input's dtype
W8A8_CODES = {torch.bfloat16: 8, torch.float32: 9}  # int8 weights times rows quantized to int8 per call
W4A8_CODES = {torch.bfloat16: 14, torch.float32: 15}  # int4's weights times rows quantized as W8A8's
# weights in groups of inputs, by bits, inputs a group (Q3_K's and Q6_K's 16), offsets held and the
# inputs' dtype
GROUPED_CODES = {
    (4, 32, True, torch.bfloat16): 4, (4, 32, True, torch.float32): 5,
    (8, 32, False, torch.bfloat16): 6, (8, 32, False, torch.float32): 7,
    (8, 16, False, torch.bfloat16): 10, (8, 16, False, torch.float32): 11,
    (8, 32, True, torch.bfloat16): 12, (8, 32, True, torch.float32): 13,
}  # fmt: skip


def grouped_code(grouped: GroupedWeight, dtype: torch.dtype) -> int:
    """pd_linear's dtype for a grouped weight beside inputs of ``dtype``."""
    return GROUPED_CODES[grouped.bits, grouped.group, grouped.offsets is not None, dtype]


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = cpu_build.load("linear_cpu")
    if lib is not None:
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.pd_linear.argtypes = [p, i64, p, p, p, i64, i64, i64, i64, i32, i32]
        lib.pd_linear_pack.argtypes = [p, i64, i64, i64, i32, p]
        lib.pd_linear_pack_int8.argtypes = [p, i64, p, i64, i64, i32, p]
        lib.pd_linear_pack_int8.restype = ctypes.c_int
        lib.pd_linear_pack_w8a8.argtypes = [p, i64, p, i64, i64, p]
        lib.pd_linear_pack_w8a8.restype = ctypes.c_int
        lib.pd_linear_pack_w4a8.argtypes = [p, i64, p, p, i64, i64, p]
        lib.pd_linear_pack_w4a8.restype = ctypes.c_int
        lib.pd_linear_pack_grouped.argtypes = [p, i64, p, p, i64, i64, i32, i32, p]
        lib.pd_linear_pack_grouped.restype = ctypes.c_int
        lib.pd_linear_pack_parts.argtypes = [i64, p, p, i64, p, p]
        lib.pd_linear_pack_parts.restype = i64
        lib.pd_linear_packed_elems.argtypes = [i64, i64, i32]
        lib.pd_linear_packed_elems.restype = i64
        lib.pd_linear_supported.argtypes = [i32]
        lib.pd_linear_amx.argtypes = [i32]
        lib.pd_linear_amx(int(envs.get("PDFABRIC_CPU_AMX") == "on"))
        for fn in (lib.pd_linear, lib.pd_linear_pack, lib.pd_linear_supported, lib.pd_linear_amx):
            fn.restype = ctypes.c_int
    return lib


@functools.cache
def kernel_address() -> int:
    """The address of ``pd_linear``, for C code that calls it (``decoder_cpu``); the library must load."""
    return ctypes.cast(_library().pd_linear, ctypes.c_void_p).value


def amx_tiles(use: bool | None = None) -> bool:
    """Whether the invariant kernel runs bfloat16 layers on AMX tiles (Intel CPUs since Sapphire Rapids,
    where the kernel grants their state; on there unless ``PDFABRIC_CPU_AMX=off``, ``csrc/linear_amx.h``).
    ``use`` turns them on or off for this process, to compare the two paths; returns the state after."""
    lib = _library()
    if lib is None:
        return False
    return bool(lib.pd_linear_amx(-1 if use is None else int(use)))


PARTS_CODE = 16  # pd_linear's dtype for a weight of parts in different formats (csrc/linear_cpu.c)


def _dtype_code(dtype: torch.dtype, quantization: str, grouped: GroupedWeight | None) -> int:
    if quantization == "w4a8" and grouped is not None:
        return W4A8_CODES[dtype]
    if grouped is not None:
        return grouped_code(grouped, dtype)
    if quantization == "w8a8":
        return W8A8_CODES[dtype]
    return INT8_CODES[dtype] if quantization == "int8" else DTYPE_CODES[dtype]


def can_pack(linear: nn.Linear, kind: str = "invariant", quantization: str = "none") -> bool:
    """Whether ``linear``'s weight can be packed for ``kind``: a CPU float32 weight, or a bfloat16 one
    on a CPU that multiplies bfloat16 natively, and a kernel that built (or oneDNN) here; quantized,
    the invariant kernel's form of ``quantization`` for that dtype."""
    if kind not in LINEAR_KINDS:
        raise ValueError(f"unknown linear kernel {kind!r}; expected one of {', '.join(LINEAR_KINDS)}")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; expected one of {', '.join(QUANTIZATIONS)}")
    w = linear.weight
    if w.device.type != "cpu" or w.dtype not in DTYPE_CODES:
        return False
    if w.dtype == torch.bfloat16 and not cpu_build.cpu_has_half_math():
        return False
    if kind == "onednn":
        return quantization == "none" and onednn_available()
    lib = _library()
    if lib is None:
        return False
    quantization = layer_quantization(quantization, linear.in_features)
    blocks = getattr(linear, "gguf_blocks", None) if quantization == "gguf" else None
    parts = gguf_parts(linear, quantization)
    if parts is not None:
        return all(lib.pd_linear_supported(c) for c in _part_codes(w.dtype, parts))
    if quantization == "int4" and linear.in_features % GROUP == 0:
        code = GROUPED_CODES[4, GROUP, True, w.dtype]
    elif quantization == "w4a8":  # (its input count a multiple of 32: _w8a8_or_none)
        code = W4A8_CODES[w.dtype]
    elif blocks is not None:
        code = grouped_code(blocks, w.dtype)
    else:
        code = _dtype_code(w.dtype, quantization, None)
    return bool(lib.pd_linear_supported(code))


class InvariantLinear(nn.Module):
    """``y = x W^T + b`` by ``csrc/linear_cpu.c``: each output summed in one fixed order; inference only.
    With ``quantization="int8"`` the weight is held as int8 with a scale per output (``quantize_int8``):
    half the bytes of bfloat16 to read; with ``"w8a8"`` the same weight multiplies the input rows
    quantized to int8 in groups of 32 as each call starts (``w8a8_ref.w8a8_reference``): integer products.
    With ``grouped`` (``grouped_form``: int4, or a GGUF tensor's blocks) it is held in groups of 32
    inputs (16 for Q3_K's and Q6_K's); under ``"w4a8"`` the int4 weight multiplies input rows quantized
    as ``"w8a8"`` quantizes them (``w8a8_ref.w4a8_reference``); with ``parts`` (``gguf_parts``) each
    part of a stacked projection in its own format. The inputs stay in the compute dtype, and so do the
    outputs unless ``float_out``: then they are the float32 sums plus the bias, not rounded (a model's
    head: its logits)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        quantization: str = "none",
        grouped: GroupedWeight | None = None,
        parts: Parts | None = None,
        int8: Int8Form | None = None,
        float_out: bool = False,
    ) -> None:
        super().__init__()
        # weight: [out_features, in_features]; bias: [out_features] or None, both in the compute dtype
        self.out_features, self.in_features = weight.shape
        quantization = layer_quantization(quantization, self.in_features)
        if grouped is not None and grouped.shape != tuple(weight.shape):
            raise ValueError(f"grouped weight {grouped.shape} does not fit a {tuple(weight.shape)} layer")
        eight = quantization in ("int8", "w8a8")
        self.quantization = quantization if grouped is not None or eight else "none"
        self.bits = grouped.bits if grouped is not None else 8 if eight else None
        self.group = grouped.group if grouped is not None else None  # inputs a scale covers, where grouped
        self.offsets = grouped is not None and grouped.offsets is not None  # an offset per group too
        self.dtype_code = _dtype_code(weight.dtype, quantization, grouped)
        weight = weight.detach()
        if weight.stride(1) != 1:
            weight = weight.contiguous()
        if parts is not None:  # each part as it is held alone, in one buffer (dtype 16)
            self.dtype_code, self.quantization = PARTS_CODE, "gguf"
            packed = _packed_parts(weight, parts)
        else:
            packed = _packed_weight(weight, quantization, grouped, self.dtype_code, int8)
        self.parts = None if parts is None else tuple((n, None if b is None else b.bits) for n, b in parts)
        self.register_buffer("packed_weight", packed)
        self.register_buffer("bias", None if bias is None else bias.detach().to(weight.dtype).contiguous())
        # Plain attributes for the hot path (a module's buffer lookup costs about a microsecond a call);
        # buffers never move, and the model is not moved after packing (CPU only).
        self._dtype = weight.dtype
        self.float_out = float_out
        self._out_dtype = torch.float32 if float_out else weight.dtype
        self._call_code = self.dtype_code | (OUT_F32 if float_out else 0)
        self._weight_ptr = self.packed_weight.data_ptr()
        self._bias_ptr = None if self.bias is None else self.bias.data_ptr()
        self._kernel = _library().pd_linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features]
        if x.dim() != 2:
            return self.forward(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)
        rows, width = x.shape
        if width != self.in_features or x.dtype != self._dtype:
            raise ValueError(f"input {tuple(x.shape)} {x.dtype} does not fit {self.extra_repr()}")
        if x.stride(1) != 1:
            x = x.contiguous()
        out = torch.empty((rows, self.out_features), dtype=self._out_dtype)
        with cpu_build.profiled("linear_cpu"):
            status = self._kernel(
                x.data_ptr(), x.stride(0), self._weight_ptr, self._bias_ptr, out.data_ptr(),
                self.out_features, rows, self.out_features, self.in_features, self._call_code,
                torch.get_num_threads(),
            )  # fmt: skip
        if status != 0:
            raise RuntimeError(
                f"pd_linear failed with status {status} (1: bad arguments, 2: out of memory, 3: unsupported)"
            )
        return out

    def extra_repr(self) -> str:
        quantized = ""
        if self.parts is not None:
            quantized = f", quantization={self.quantization} (parts of outputs, bits: {self.parts})"
        elif self.quantization != "none":
            quantized = f", quantization={self.quantization} ({self.bits} bits)"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
            + quantized
            + (", float32 out" if self.float_out else "")
        )


def _packed_weight(
    weight: torch.Tensor,
    quantization: str,
    grouped: GroupedWeight | None,
    code: int,
    int8: Int8Form | None = None,
) -> torch.Tensor:
    """``weight`` ``[n, k]`` packed for pd_linear's dtype ``code``: ``grouped``'s blocks, its int8 form
    (``int8``, ``w8a8``: ``int8`` where given, else ``quantize_int8``'s) or itself."""
    lib = _library()
    n, k = weight.shape
    size = lib.pd_linear_packed_elems(n, k, code)
    if grouped is not None and code in W4A8_CODES.values():  # scales, offsets, panels (linear_w4a8.h)
        packed = torch.empty(size, dtype=torch.uint8)
        q, scales = grouped.q.contiguous(), grouped.scales.float().contiguous()
        offsets = grouped.offsets.float().contiguous()
        status = lib.pd_linear_pack_w4a8(
            q.data_ptr(), q.stride(0), scales.data_ptr(), offsets.data_ptr(), n, k, packed.data_ptr()
        )
    elif grouped is not None:
        packed = torch.empty(size, dtype=torch.uint8)  # scales, offsets, then the panels (linear_cpu.c)
        q, scales = grouped.q.contiguous(), grouped.scales.float().contiguous()
        offsets = None if grouped.offsets is None else grouped.offsets.float().contiguous()
        status = lib.pd_linear_pack_grouped(
            q.data_ptr(), q.stride(0), scales.data_ptr(), None if offsets is None else offsets.data_ptr(),
            n, k, grouped.bits, grouped.group, packed.data_ptr(),
        )  # fmt: skip
    elif quantization in ("int8", "w8a8"):
        q, scale = int8 if int8 is not None else quantize_int8(weight)
        if q.shape != weight.shape:
            raise ValueError(f"int8 weight {tuple(q.shape)} does not fit a {tuple(weight.shape)} layer")
        packed = torch.empty(size, dtype=torch.uint8)  # the scales, then int8 panels or quads of weights
        if quantization == "w8a8":
            status = lib.pd_linear_pack_w8a8(
                q.data_ptr(), q.stride(0), scale.data_ptr(), n, k, packed.data_ptr()
            )
        else:
            status = lib.pd_linear_pack_int8(
                q.data_ptr(), q.stride(0), scale.data_ptr(), n, k, code, packed.data_ptr()
            )  # fmt: skip
    else:
        packed = torch.empty(size, dtype=weight.dtype)  # 64-column panels, see linear_cpu.c
        status = lib.pd_linear_pack(weight.data_ptr(), weight.stride(0), n, k, code, packed.data_ptr())
    if status != 0:
        raise ValueError(f"pd_linear_pack rejected a {tuple(weight.shape)} weight")
    return packed


def _part_codes(dtype: torch.dtype, parts: Parts) -> list[int]:
    """pd_linear's dtype of each part: its blocks' format, or the compute dtype."""
    return [_dtype_code(dtype, "none", blocks) for _, blocks in parts]


def _packed_parts(weight: torch.Tensor, parts: Parts) -> torch.Tensor:
    """A weight whose parts (rows one after another) are packed each in its own format, behind a header
    (pd_linear_pack_parts): blocks where a part has them, else the compute dtype."""
    lib = _library()
    if sum(n for n, _ in parts) != weight.shape[0]:
        raise ValueError(
            f"parts of {[n for n, _ in parts]} outputs do not make a {tuple(weight.shape)} weight"
        )
    codes = _part_codes(weight.dtype, parts)
    outputs = (ctypes.c_int64 * len(parts))(*(n for n, _ in parts))
    dtypes, offsets = (ctypes.c_int32 * len(parts))(*codes), (ctypes.c_int64 * len(parts))()
    total = lib.pd_linear_pack_parts(len(parts), outputs, dtypes, weight.shape[1], None, offsets)
    packed = torch.zeros(total, dtype=torch.uint8)
    lib.pd_linear_pack_parts(len(parts), outputs, dtypes, weight.shape[1], packed.data_ptr(), offsets)
    start = 0
    for (n, blocks), code, offset in zip(parts, codes, offsets, strict=True):
        part = _packed_weight(weight[start : start + n].contiguous(), "none", blocks, code).view(torch.uint8)
        packed[offset : offset + part.numel()] = part
        start += n
    return packed


def packed(
    linear: nn.Linear,
    kind: str = "invariant",
    quantization: str = "none",
    quantizer: Quantizer = COMPUTE,
    name: str = "",
    float_out: bool = False,
) -> nn.Module:
    """``linear`` (the model's ``name``) packed for ``kind``, its quantized weight from ``quantizer``
    (the caller checks ``can_pack`` first). ``float_out``: the invariant kernel writes float32 outputs,
    not rounded to the compute dtype (oneDNN's module rounds them)."""
    if kind == "onednn":
        return PackedLinear(linear)
    parts = gguf_parts(linear, quantization)
    grouped = grouped_form(linear, quantization, quantizer, name)
    eight = layer_quantization(quantization, linear.in_features) in ("int8", "w8a8")
    int8 = quantizer.int8(name, linear.weight) if eight and grouped is None and parts is None else None
    return InvariantLinear(linear.weight, linear.bias, quantization, grouped, parts, int8, float_out)
