"""Wrappers for ``csrc/sample_cpu.c``: greedy rows' argmax, a batch's temperature draws in one call
(plain rows, and rows with top-k / top-p), and the Gumbel noise itself (for tests). ``available`` says
whether the library built here; ``sample_ref`` (and ``torch.argmax``) give the same results everywhere
else.
"""

from __future__ import annotations

import ctypes

import torch

from pdfabric.kernels import cpu_build
from pdfabric.kernels.sample_ref import _signed


def _library() -> ctypes.CDLL | None:
    lib = cpu_build.load("sample_cpu")
    if lib is not None and not hasattr(lib, "_pdfabric_typed"):
        p, i64, i32, u64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_uint64
        lib.pd_gumbel_noise.argtypes = [u64, p, i64, p]
        lib.pd_gumbel_argmax.argtypes = [p, i64, i32, i32, p, p, p, i32]
        lib.pd_argmax_rows.argtypes = [p, i64, i32, i32, p, i32]
        lib.pd_gumbel_top.argtypes = [p, i64, i32, i32, p, p, p, p, p, i32]
        for fn in (lib.pd_gumbel_noise, lib.pd_gumbel_argmax, lib.pd_argmax_rows, lib.pd_gumbel_top):
            fn.restype = ctypes.c_int
        lib._pdfabric_typed = True
    return lib


def available() -> bool:
    return _library() is not None


def _check(status: int, name: str) -> None:
    if status != 0:
        raise RuntimeError(f"{name} rejected its arguments (status {status})")


def _key_words(keys: list[int]) -> torch.Tensor:
    """Noise keys (any Python ints, taken modulo 2^64) as the int64 words the kernels read as uint64."""
    return torch.tensor([_signed(key & 0xFFFFFFFFFFFFFFFF) for key in keys], dtype=torch.int64)


def gumbel_noise_cpu(key: int, ids: torch.Tensor | None, n: int = 0) -> torch.Tensor:
    """float32 Gumbel noise for the token ids ``ids`` (None: ``0..n-1``) under ``key``."""
    if ids is not None:
        ids = ids.to("cpu", torch.int64).contiguous()
        n = ids.numel()
    out = torch.empty(n, dtype=torch.float32)
    ptr = ids.data_ptr() if ids is not None else None
    _check(_library().pd_gumbel_noise(key & 0xFFFFFFFFFFFFFFFF, ptr, n, out.data_ptr()), "pd_gumbel_noise")
    return out if ids is None else out.view(ids.shape)


def gumbel_argmax_cpu(scores: torch.Tensor, temps: list[float], keys: list[int]) -> list[int]:
    """Row r's draw from ``softmax(scores[r] / temps[r])`` with the noise of ``keys[r]`` (``scores``:
    float32 ``[rows, vocab]`` on the CPU, rows contiguous)."""
    rows, vocab = scores.shape
    t = torch.tensor(temps, dtype=torch.float32)
    k = _key_words(keys)
    out = torch.empty(rows, dtype=torch.int64)
    with cpu_build.profiled("gumbel_argmax_cpu"):
        status = _library().pd_gumbel_argmax(
            scores.data_ptr(), scores.stride(0), rows, vocab, t.data_ptr(), k.data_ptr(), out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
    _check(status, "pd_gumbel_argmax")
    return out.tolist()


def argmax_rows_cpu(scores: torch.Tensor) -> list[int]:
    """The first maximum's index in each row of ``scores`` (float32 ``[rows, vocab]`` on the CPU, rows
    contiguous), as ``scores.argmax(-1)`` gives it."""
    rows, vocab = scores.shape
    out = torch.empty(rows, dtype=torch.int64)
    with cpu_build.profiled("argmax_rows_cpu"):
        status = _library().pd_argmax_rows(
            scores.data_ptr(), scores.stride(0), rows, vocab, out.data_ptr(), torch.get_num_threads()
        )
    _check(status, "pd_argmax_rows")
    return out.tolist()


def gumbel_top_cpu(
    scores: torch.Tensor, temps: list[float], top_ks: list[int], top_ps: list[float], keys: list[int]
) -> list[int]:
    """Row r's draw among its top-k / top-p candidates (``sample_ref.gumbel_top_ref`` says which), with
    the noise of ``keys[r]`` (``scores``: float32 ``[rows, vocab]`` on the CPU, rows contiguous)."""
    rows, vocab = scores.shape
    t = torch.tensor(temps, dtype=torch.float32)
    k = torch.tensor(top_ks, dtype=torch.int32)
    p = torch.tensor(top_ps, dtype=torch.float64)
    keyed = _key_words(keys)
    out = torch.empty(rows, dtype=torch.int64)
    with cpu_build.profiled("gumbel_top_cpu"):
        status = _library().pd_gumbel_top(
            scores.data_ptr(), scores.stride(0), rows, vocab, t.data_ptr(), k.data_ptr(), p.data_ptr(),
            keyed.data_ptr(), out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
    _check(status, "pd_gumbel_top")
    return out.tolist()
