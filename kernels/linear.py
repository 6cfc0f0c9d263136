"""Which kernel runs a model's linear layers and LM head: one seam over the CPU and CUDA kernels.

``pack_linears(model, kind)`` replaces each ``nn.Linear`` by a module of the kind asked for, on the
layer's device; the model calls it like ``nn.Linear`` and never learns which it got. Kinds:

- ``invariant`` (what pdfabric serves): every output summed in one fixed order whatever the number of
  rows, so a token's logits are the same to the bit in any batch, chunking or step kind. On CPUs
  ``linear_cpu.InvariantLinear`` (C, weights packed once); on CUDA ``linear_triton.TritonLinear``
  (Triton, one tile configuration for every row count), when the kernel backend runs Triton there.
- ``onednn`` (CPUs) and ``cublas`` (CUDA): the vendor library (a worker's ``linears`` setting); its
  blocking follows the problem's shape, so a row's sums change with the batch. ``cublas`` is what
  ``nn.Linear`` runs on CUDA, so it leaves the layers as they are.

A layer that no kernel of the kind takes (a dtype the CPU cannot multiply natively, no C compiler, no
Triton) stays ``nn.Linear``.

A worker's ``quantization`` setting holds the invariant kernel's weights quantized, weight-only:
``int8`` with a scale per output (CPUs only: ``weight_forms.quantize_int8``; ``w8a8`` the same weights
times activations quantized in groups of 32 inputs, CPUs only), ``int4`` and ``gguf`` in
groups of 32 inputs (``quantized.py``; on CPUs ``linear_cpu``, on CUDA ``quantized_triton``; GGUF's
Q3_K and Q6_K in groups of 16 and Q5_1/Q5_K as 8 bits with offsets, CPUs only). A layer the format cannot
hold (inputs not a multiple of 32, a GGUF tensor of another type, those three on CUDA) keeps its
dtype. ``w4a8`` holds ``int4``'s weights and multiplies them by activations quantized as ``w8a8``'s
(CPUs only).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from pdfabric.kernels import dispatch, linear_cpu, weight_forms
from pdfabric.kernels.launch_checks import FLOAT_DTYPES
from pdfabric.kernels.quantized import GROUP
from pdfabric.worker_config import LINEARS

LINEAR_KINDS = LINEARS  # the worker's `linears` setting names these
DEVICE_KINDS = {"cpu": ("invariant", "onednn"), "cuda": ("invariant", "cublas")}


def check_kind(kind: str, device: str) -> None:
    """``ValueError`` unless ``kind`` is a linear kernel, and one for ``device`` if that has kernels."""
    if kind not in LINEAR_KINDS:
        raise ValueError(f"unknown linear kernel {kind!r}; expected one of {', '.join(LINEAR_KINDS)}")
    kinds = DEVICE_KINDS.get(device)
    if kinds is not None and kind not in kinds:
        raise ValueError(f"linear kernel {kind!r} does not run on {device}; there: {', '.join(kinds)}")


def check_quantization(quantization: str, kind: str, device: str) -> None:
    """``ValueError`` unless the linear kernel ``kind`` on ``device`` holds weights as ``quantization``."""
    if quantization not in linear_cpu.QUANTIZATIONS:
        raise ValueError(
            f"unknown quantization {quantization!r}; expected one of {', '.join(linear_cpu.QUANTIZATIONS)}"
        )
    if quantization == "none":
        return
    cpu_only = quantization in ("int8", "w8a8", "w4a8")
    if kind != "invariant" or device not in ("cpu", "cuda") or (cpu_only and device != "cpu"):
        where = "CPUs" if cpu_only else "CPUs and CUDA"
        raise ValueError(f"quantization {quantization!r} runs on {where} with the invariant linears only")


def can_pack(linear: nn.Linear, kind: str = "invariant", quantization: str = "none") -> bool:
    """Whether ``linear`` gets a module of ``kind`` on its device (``False``: it stays ``nn.Linear``)."""
    device = linear.weight.device.type
    check_kind(kind, device)
    check_quantization(quantization, kind, device)
    if device == "cpu":
        return linear_cpu.can_pack(linear, kind, quantization)
    if device != "cuda" or kind == "cublas":
        return False  # other devices have no kernel of their own; on CUDA nn.Linear already is cuBLAS
    return dispatch.runs_triton(linear.weight) and linear.weight.dtype in FLOAT_DTYPES


def packed(
    linear: nn.Linear,
    kind: str = "invariant",
    quantization: str = "none",
    quantizer: weight_forms.Quantizer | None = None,
    name: str = "",
    float_out: bool = False,
) -> nn.Module:
    """``linear`` (the model's ``name``) as a module of ``kind`` (the caller checks ``can_pack`` first).
    ``quantizer``: where a CPU layer's quantized weight comes from (``weight_forms.Quantizer``; default:
    computed). ``float_out``: the CPU's invariant kernel returns float32 sums, not rounded to the compute
    dtype (a head's logits); the other modules round them."""
    if linear.weight.device.type == "cpu":
        compute = quantizer or weight_forms.COMPUTE
        return linear_cpu.packed(linear, kind, quantization, compute, name, float_out)
    grouped = weight_forms.grouped_form(linear, quantization)
    # the Triton matmul takes groups of 32, offsets for 4 bits only: Q3_K, Q6_K, Q5_1, Q5_K in the
    # compute dtype
    triton_form = grouped is not None and grouped.group == GROUP
    if triton_form and (grouped.bits == 4) == (grouped.offsets is not None):
        from pdfabric.kernels.quantized_triton import TritonGroupedLinear  # imports Triton

        bias = None if linear.bias is None else linear.bias.detach().to(linear.weight.dtype)
        return TritonGroupedLinear(grouped, bias, linear.weight.device)
    from pdfabric.kernels.linear_triton import TritonLinear  # imports Triton: only for CUDA layers

    return TritonLinear(linear.weight, linear.bias)


def pack_linears(
    module: nn.Module,
    kind: str = "invariant",
    quantization: str = "none",
    quantizer: weight_forms.Quantizer | None = None,
    prefix: str = "",
) -> int:
    """Replaces every ``nn.Linear`` under ``module`` that ``can_pack`` by its module of ``kind``; returns
    how many. The plain weights are released, so the model's weights stay in memory once. ``prefix``:
    ``module``'s path in the model, which names each layer to ``quantizer``."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and can_pack(child, kind, quantization):
            setattr(module, name, packed(child, kind, quantization, quantizer, prefix + name))
            count += 1
        else:
            count += pack_linears(child, kind, quantization, quantizer, f"{prefix}{name}.")
    return count


def row_reader(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A function of token ids giving rows of a packed module's weight as the module multiplies them
    (``[len(ids), in_features]``, the compute dtype), or None where its layout is not read back (oneDNN's,
    CUDA's modules, which keep the weight they were given)."""
    if isinstance(module, linear_cpu.InvariantLinear) and module.parts is None:
        from pdfabric.kernels.packed_rows import packed_rows

        return functools.partial(packed_rows, module)
    return None
