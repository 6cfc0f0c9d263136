"""Chooses, per call, the implementation of each kernel: torch reference, C kernel for the CPU, or Triton.

``auto`` runs the Triton kernels (attention, RMSNorm, KV write and block copies) on CUDA tensors
(when Triton imports), the CPU attention (``paged_attention_cpu``: C kernels for decode rows and
bfloat16 prompts, fused SDPA elsewhere), the fused layer ops (``layer_ops_cpu``: RMSNorm, rotary
embedding, SiLU-gated product) and the sampler's draws (``sample_cpu``) on CPU tensors they support,
and the torch references everywhere else; ``torch`` always runs the references; ``cpu`` runs the CPU
attention wherever it can; ``triton`` always runs the Triton kernels, which on CPU tensors needs
``TRITON_INTERPRET=1`` set before the kernel modules are first imported. Kernel modules are imported
on first use, so a CPU-only process never imports Triton. A tiled cache
(``AttentionMetadata.tiled_kv``, CPU bfloat16) is read and written by the CPU kernels, or by the
references under the ``torch`` backend; never by Triton.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from pdfabric import envs
from pdfabric.kernels.attention_ref import paged_attention_ref, store_kv_ref
from pdfabric.kernels.kv_pack_ref import gather_blocks_ref, scatter_blocks_ref
from pdfabric.kernels.layer_ops_ref import mask_logits_ref, rms_norm_ref, rope_ref, silu_mul_ref
from pdfabric.kernels.metadata import AttentionMetadata
from pdfabric.kernels.sample_ref import gumbel_argmax_ref, gumbel_top_ref

BACKENDS = ("auto", "torch", "cpu", "triton")
_backend: str = envs.get("PDFABRIC_KERNEL_BACKEND")


def set_backend(name: str) -> None:
    """Forces a backend for every later call (``auto`` restores the device-based choice)."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; expected one of {', '.join(BACKENDS)}")
    _backend = name


def get_backend() -> str:
    return _backend


def runs_triton(t: torch.Tensor) -> bool:
    """Whether the Triton kernels serve tensors like ``t`` under the current backend."""
    if _backend in ("torch", "cpu"):
        return False
    if _backend == "triton":
        return True
    return t.is_cuda and _triton_ready()


@functools.cache
def _triton_ready() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _use_cpu_attention(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    if _backend not in ("auto", "cpu") or q.device.type != "cpu":
        return False
    from pdfabric.kernels.paged_attention_cpu import supports

    return supports(q, kv_cache)


def _use_cpu_layer_ops(x: torch.Tensor) -> bool:
    if _backend not in ("auto", "cpu") or not x.is_cpu:
        return False
    return _layer_ops().supports(x)


@functools.cache
def _layer_ops() -> ModuleType:
    """``layer_ops_cpu``, imported on first use (a decode step asks about 150 times)."""
    from pdfabric.kernels import layer_ops_cpu

    return layer_ops_cpu


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / rms(x)`` per row of ``x: [T, hidden]``, normalised in float32."""
    if runs_triton(x) and weight.dtype == x.dtype:
        from pdfabric.kernels.rms_norm_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    if _use_cpu_layer_ops(x):
        from pdfabric.kernels.layer_ops_cpu import rms_norm_cpu

        return rms_norm_cpu(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


# The rotary embedding and the SiLU product have no Triton kernel: on CUDA their references are
# element-wise torch ops (no sum across a row), so an element's result never depends on the batch.


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x: [T, heads, head_dim]`` with float32 ``cos``, ``sin: [T, 1, head_dim]``
    (``sin``'s first half negated), in ``x``'s dtype."""
    if _use_cpu_layer_ops(x):
        from pdfabric.kernels.layer_ops_cpu import rope_cpu

        return rope_cpu(x, cos, sin)
    return rope_ref(x, cos, sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up: [T, 2 * intermediate]`` holding gate then up."""
    if _use_cpu_layer_ops(gate_up):
        from pdfabric.kernels.layer_ops_cpu import silu_mul_cpu

        return silu_mul_cpu(gate_up)
    return silu_mul_ref(gate_up)


def mask_logits(logits: torch.Tensor, words: torch.Tensor) -> None:
    """In place: each row of ``logits [rows, vocab]`` to -inf where its bitmask in ``words`` (int32
    ``[rows, ceil(vocab / 32)]``, bit ``t % 32`` of word ``t // 32`` for token ``t``) is clear."""
    if _use_cpu_layer_ops(logits) and logits.dtype == torch.float32:
        _layer_ops().mask_logits_cpu(logits, words)
    else:
        mask_logits_ref(logits, words)


def _use_cpu_sampler() -> bool:
    if _backend not in ("auto", "cpu"):
        return False
    from pdfabric.kernels.sample_cpu import available

    return available()


def prepare_sampler() -> None:
    """Builds (or loads from the cache) the sampler's C kernels now, so that no step pays for it."""
    _use_cpu_sampler()


def _fits_cpu_sampler(scores: torch.Tensor) -> bool:
    return scores.is_cpu and scores.dtype == torch.float32 and scores.stride(-1) == 1 and _use_cpu_sampler()


def _on_cpu(scores: torch.Tensor) -> torch.Tensor:
    """``scores`` as float32 rows on the CPU for the sampler's C kernels: a GPU worker's temperature
    rows are drawn there from one copy of the batch's logits (the same tokens as a CPU worker's, and
    far faster than the reference's whole-vocabulary passes per row)."""
    if scores.is_cpu and scores.dtype == torch.float32 and scores.stride(-1) == 1:
        return scores
    return scores.to("cpu", torch.float32).contiguous()


def argmax_rows(scores: torch.Tensor) -> list[int]:
    """The first maximum's index in each row of ``scores`` ``[rows, vocab]`` (greedy rows)."""
    if _fits_cpu_sampler(scores):
        from pdfabric.kernels.sample_cpu import argmax_rows_cpu

        return argmax_rows_cpu(scores)
    return scores.argmax(dim=-1).tolist()


def gumbel_argmax(scores: torch.Tensor, temps: list[float], keys: list[int]) -> list[int]:
    """Row r's draw from ``softmax(scores[r] / temps[r])`` (``scores`` float32 ``[rows, vocab]``) under
    the noise of ``keys[r]``: ``argmax(scores[r] / temperature + noise)`` (``sample_ref``)."""
    if _use_cpu_sampler():
        from pdfabric.kernels.sample_cpu import gumbel_argmax_cpu

        return gumbel_argmax_cpu(_on_cpu(scores), temps, keys)
    return gumbel_argmax_ref(scores, temps, keys)


def gumbel_top(
    scores: torch.Tensor, temps: list[float], top_ks: list[int], top_ps: list[float], keys: list[int]
) -> list[int]:
    """Row r's Gumbel-max draw among its top-k / top-p candidates (``top_ks[r]`` 0: no top-k;
    ``top_ps[r]`` 1: no top-p); ``sample_ref.gumbel_top_ref`` defines which tokens those are."""
    if _use_cpu_sampler():
        from pdfabric.kernels.sample_cpu import gumbel_top_cpu

        return gumbel_top_cpu(_on_cpu(scores), temps, top_ks, top_ps, keys)
    return gumbel_top_ref(scores, temps, top_ks, top_ps, keys)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    tiled: bool = False,
) -> None:
    """Writes new keys/values ``[T, kv_heads, head_dim]`` into their slots of ``kv_cache`` (a tiled one:
    ``AttentionMetadata.tiled_kv``)."""
    if tiled:
        if _use_cpu_layer_ops(key):
            from pdfabric.kernels.tiled_kv_cpu import store_kv_tiled

            store_kv_tiled(key, value, kv_cache, slot_mapping)
        else:
            store_kv_ref(key, value, kv_cache, slot_mapping, tiled=True)
    elif runs_triton(kv_cache):
        from pdfabric.kernels.store_kv_triton import store_kv_triton

        store_kv_triton(key, value, kv_cache, slot_mapping)
    elif _use_cpu_layer_ops(key):
        from pdfabric.kernels.layer_ops_cpu import can_store_kv, store_kv_cpu

        if can_store_kv(key, kv_cache):
            store_kv_cpu(key, value, kv_cache, slot_mapping)
        else:
            store_kv_ref(key, value, kv_cache, slot_mapping)
    else:
        store_kv_ref(key, value, kv_cache, slot_mapping)


def paged_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal attention of the batch's new queries ``[T, q_heads, head_dim]`` over the paged cache."""
    if meta.tiled_kv and not _use_cpu_attention(q, kv_cache):
        # only the CPU kernels and the reference read a tiled cache
        return paged_attention_ref(q, kv_cache, meta, scale)
    if runs_triton(q):
        from pdfabric.kernels.paged_attention_triton import paged_attention_triton

        return paged_attention_triton(q, kv_cache, meta, scale)
    if _use_cpu_attention(q, kv_cache):
        from pdfabric.kernels.paged_attention_cpu import paged_attention_cpu

        return paged_attention_cpu(q, kv_cache, meta, scale)
    return paged_attention_ref(q, kv_cache, meta, scale)


def gather_blocks(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Packs ``kv_cache[:, block_ids]`` into one contiguous ``[2, n, block_size, kv_heads, head_dim]``."""
    if runs_triton(kv_cache):
        from pdfabric.kernels.kv_pack_triton import gather_blocks_triton

        return gather_blocks_triton(kv_cache, block_ids, out)
    return gather_blocks_ref(kv_cache, block_ids, out)


def scatter_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, packed: torch.Tensor) -> None:
    """Unpacks ``packed`` into ``kv_cache[:, block_ids]``."""
    if runs_triton(kv_cache):
        from pdfabric.kernels.kv_pack_triton import scatter_blocks_triton

        scatter_blocks_triton(kv_cache, block_ids, packed)
    else:
        scatter_blocks_ref(kv_cache, block_ids, packed)
