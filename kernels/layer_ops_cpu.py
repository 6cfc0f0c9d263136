"""Wrappers for ``csrc/layer_ops_cpu.c``: RMSNorm, rotary embedding, the SiLU-gated product, the paged
KV write and a grammar's token mask, each one pass over its rows on the CPU. ``supports`` says whether
a tensor can take them; the references in ``layer_ops_ref`` and ``attention_ref`` serve everywhere
else.
"""

from __future__ import annotations

import ctypes

import torch

from pdfabric.kernels import cpu_build

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


def _library() -> ctypes.CDLL | None:
    lib = cpu_build.load("layer_ops_cpu")
    if lib is not None and not hasattr(lib, "_pdfabric_typed"):
        p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        lib.pd_rms_norm.argtypes = [p, i64, p, p, i32, i32, f32, i32, i32]
        lib.pd_rope.argtypes = [p, i64, p, p, p, i32, i32, i32, i32, i32]
        lib.pd_silu_mul.argtypes = [p, i64, p, i32, i32, i32, i32]
        lib.pd_store_kv.argtypes = [p, i64, p, i64, p, p, p, i64, i32, i32, i32, i32]
        lib.pd_mask_logits.argtypes = [p, i64, p, i32, i32, i32]
        for fn in (lib.pd_rms_norm, lib.pd_rope, lib.pd_silu_mul, lib.pd_store_kv, lib.pd_mask_logits):
            fn.restype = ctypes.c_int
        lib._pdfabric_typed = True
    return lib


def kernel_addresses() -> dict[str, int]:
    """The addresses of ``pd_rms_norm``, ``pd_rope``, ``pd_silu_mul`` and ``pd_store_kv`` (keys without
    the prefix), for C code that calls them (``decoder_cpu``); the library must load."""
    lib = _library()
    names = ("rms_norm", "rope", "silu_mul", "store_kv")
    return {n: ctypes.cast(getattr(lib, f"pd_{n}"), ctypes.c_void_p).value for n in names}


def supports(x: torch.Tensor) -> bool:
    """Whether ``x`` can take these kernels: a CPU tensor of a supported dtype whose last dimension is
    contiguous, and a library that built on this machine."""
    return x.is_cpu and x.dtype in DTYPE_CODES and x.stride(-1) == 1 and _library() is not None


def _check(status: int, name: str) -> None:
    if status != 0:
        raise RuntimeError(f"{name} rejected its arguments (status {status})")


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [T, hidden] with contiguous rows; weight: [hidden] in x's dtype
    if weight.dtype != x.dtype or not weight.is_contiguous():
        weight = weight.to(x.dtype).contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    with cpu_build.profiled("rms_norm_cpu"):
        status = _library().pd_rms_norm(
            x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1],
            eps, DTYPE_CODES[x.dtype], torch.get_num_threads(),
        )  # fmt: skip
    _check(status, "pd_rms_norm")
    return out


def rope_cpu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, head_dim], heads contiguous within a token; cos, sin: [T, 1, head_dim] float32
    tokens, heads, head_dim = x.shape
    if x.stride(1) != head_dim:
        x = x.contiguous()
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)  # [T, heads, head_dim]
    with cpu_build.profiled("rope_cpu"):
        status = _library().pd_rope(
            x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), tokens, heads,
            head_dim, DTYPE_CODES[x.dtype], torch.get_num_threads(),
        )  # fmt: skip
    _check(status, "pd_rope")
    return out


def silu_mul_cpu(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up: [T, 2 * intermediate] with contiguous rows -> [T, intermediate]
    tokens, width = gate_up.shape
    out = torch.empty(tokens, width // 2, dtype=gate_up.dtype)
    with cpu_build.profiled("silu_mul_cpu"):
        status = _library().pd_silu_mul(
            gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), tokens, width // 2,
            DTYPE_CODES[gate_up.dtype], torch.get_num_threads(),
        )  # fmt: skip
    _check(status, "pd_silu_mul")
    return out


def can_store_kv(key: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether ``store_kv_cpu`` can write ``key`` (which ``supports``) into ``kv_cache``: the same
    dtype, a contiguous cache and heads contiguous within a token."""
    return kv_cache.dtype == key.dtype and kv_cache.is_contiguous() and key.stride(1) == kv_cache.shape[-1]


def store_kv_cpu(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    # key, value: [T, kv_heads, head_dim] (token rows may be strided); slot_mapping: [T] int64
    _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
    if value.stride(1) != head_dim or value.stride(2) != 1:
        value = value.contiguous()
    slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.to(torch.int64)
    slots = slots.contiguous()
    keys = kv_cache.data_ptr()  # the cache is contiguous (can_store_kv): values start one half later
    values = keys + kv_cache.stride(0) * kv_cache.element_size()
    with cpu_build.profiled("store_kv_cpu"):
        status = _library().pd_store_kv(
            key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), keys,
            values, slots.data_ptr(), num_blocks * block_size, key.shape[0],
            kv_heads * head_dim, key.element_size(), torch.get_num_threads(),
        )  # fmt: skip
    _check(status, "pd_store_kv")


def mask_logits_cpu(logits: torch.Tensor, words: torch.Tensor) -> None:
    """In place: ``logits`` (float32 ``[rows, vocab]``, rows contiguous) to -inf where ``words`` (int32
    ``[rows, ceil(vocab / 32)]``) has the token's bit clear."""
    words = words.contiguous()
    with cpu_build.profiled("mask_logits_cpu"):
        status = _library().pd_mask_logits(
            logits.data_ptr(), logits.stride(0), words.data_ptr(), logits.shape[0], logits.shape[1],
            torch.get_num_threads(),
        )  # fmt: skip
    _check(status, "pd_mask_logits")
