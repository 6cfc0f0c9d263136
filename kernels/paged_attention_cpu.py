"""Paged attention on the CPU: C kernels for one-token rows and for bfloat16 prompt chunks.

In bfloat16 on a CPU with AVX512-BF16, and in float32 on a CPU with AVX-512, decode rows (sequences
with one new token) and prompt chunks both run the prompt kernel's arithmetic (``csrc/paged_prefill_cpu.c``,
``csrc/paged_prefill_f32_cpu.c``; a decode row is a one-token chunk), so a position's attention is
the same to the bit in a decode step, in a prompt chunk of any size, alone or in any batch
(``decodes_as_prefill``). Other decode rows go to ``csrc/paged_decode_cpu.c``, which reads each
sequence's keys and values in place through its block table: no gathered copy, no float32 copy of
the cache, no padding to the longest sequence, and a row's result does not depend on the batch (but
differs in the last bits from a prompt chunk's).
Prompt chunks in bfloat16 on a CPU with AVX512-BF16 go to ``csrc/paged_prefill_cpu.c``: it packs the
sequence's keys and values once through the block table and runs tiled Q K^T, an exact softmax and P V
on VDPBF16PS, four to seven times PyTorch's fused CPU attention (on CPUs with AMX both products run on
its tiles instead, prompt chunks and decode rows alike: ``attention_amx``). A tiled cache
(``AttentionMetadata.tiled_kv``, written by ``tiled_kv_cpu.store_kv_tiled``; ``ModelRunner`` tiles
bfloat16 caches where ``tiled_kv_supported``) holds each block in those layouts already, so both kernels
read it in place instead of packing it every call: decode rows read the cache twice as fast, and the
results are the same to the bit. An int8 cache (``kv_int8_ref``; ``ModelRunner(kv_cache_dtype="int8")``,
written by ``store_kv_tiled`` too) is read in place by the same kernel's int8 twin (``csrc/kv_int8.h``:
scores on VPDPBUSD against the query quantized per row, P V over the values widened to bfloat16): half
the bytes from memory, and the same bits for a position in a decode step and in any prompt chunk.
Float32 chunks go to its plain-C twin ``csrc/paged_prefill_f32_cpu.c``. Other prompt chunks (bfloat16 on
a CPU without AVX512-BF16, float16) gather their cached blocks and run that fused attention in the
cache's dtype, causal without a mask when the chunk is the whole prompt. ``paged_attention_ref`` stays
the float32 oracle all of these are tested against.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from pdfabric import envs
from pdfabric.kernels import cpu_build, kv_int8_ref
from pdfabric.kernels.metadata import AttentionMetadata

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_MAX_GROUP, _MAX_HEAD_DIM, _LANES = 16, 256, 16  # the C kernel's limits


def _library() -> ctypes.CDLL | None:
    lib = cpu_build.load("paged_decode_cpu")
    if lib is not None and not hasattr(lib, "_pdfabric_typed"):
        fn = lib.pd_paged_decode_attention
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        fn.argtypes = [p, i64, p, p, p, i64, p, p, p, p, i32, i32, i32, i32, i32, ctypes.c_float, i32, i32]
        fn.restype = ctypes.c_int
        lib._pdfabric_typed = True
    return lib


@functools.cache
def prefill_library(dtype: torch.dtype) -> ctypes.CDLL | None:
    """The prompt kernel for ``dtype``: ``paged_prefill_cpu`` (bfloat16, AVX512-BF16) or
    ``paged_prefill_f32_cpu`` (float32, any CPU the compiler vectorises for); ``None`` for others."""
    name, fn_name, ok_name = {
        torch.bfloat16: ("paged_prefill_cpu", "pd_paged_prefill_attention", "pd_prefill_supported"),
        torch.float32: ("paged_prefill_f32_cpu", "pd_paged_prefill_f32", "pd_prefill_f32_supported"),
    }.get(dtype, (None, None, None))
    lib = cpu_build.load(name) if name else None
    if lib is not None:
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        fn = getattr(lib, fn_name)
        fn.argtypes = [p, i64, p, p, p, p, i32, i32, i32, i32, i32, i32, ctypes.c_float, i32]
        fn.restype = ctypes.c_int
        lib.attention = fn
        getattr(lib, ok_name).argtypes = [i32]
        lib.supported = getattr(lib, ok_name)
        if hasattr(lib, "pd_paged_prefill_tiled"):
            lib.pd_paged_prefill_tiled.argtypes = fn.argtypes
            lib.pd_paged_prefill_tiled.restype = ctypes.c_int
            lib.pd_store_kv_tiled.argtypes = [p, i64, p, i64, p, p, p, i64, i32, i32, i32, i32, i32]
            lib.pd_store_kv_tiled.restype = ctypes.c_int
        if hasattr(lib, "pd_paged_prefill_int8"):
            lib.pd_paged_prefill_int8.argtypes = fn.argtypes
            lib.pd_paged_prefill_int8.restype = ctypes.c_int
            lib.pd_store_kv_int8.argtypes = lib.pd_store_kv_tiled.argtypes
            lib.pd_store_kv_int8.restype = ctypes.c_int
        if hasattr(lib, "pd_prefill_amx"):
            lib.pd_prefill_amx.argtypes = [i32]
            lib.pd_prefill_amx.restype = ctypes.c_int
            lib.pd_prefill_amx(int(envs.get("PDFABRIC_CPU_AMX") == "on"))
        for name in ("pd_paged_decode_rows", "pd_paged_decode_rows_tiled", "pd_paged_decode_rows_int8"):
            if hasattr(lib, name):
                getattr(lib, name).argtypes = [
                    p, i64, p, p, p, i64, p, p, p, p, i32, i32, i32, i32, i32, ctypes.c_float, i32,
                ]  # fmt: skip
                getattr(lib, name).restype = ctypes.c_int
    return lib


def attention_amx(use: bool | None = None) -> bool:
    """Whether bfloat16 attention over a dense or tiled cache (prompt chunks and decode rows alike) runs
    its two products on AMX tiles (Intel CPUs since Sapphire Rapids, where the kernel grants their
    state; on there unless ``PDFABRIC_CPU_AMX=off``, ``csrc/paged_prefill_cpu.c``). ``use`` turns them on
    or off for this process, to compare the two paths; returns the state after."""
    lib = prefill_library(torch.bfloat16)
    if lib is None or not hasattr(lib, "pd_prefill_amx"):
        return False
    return bool(lib.pd_prefill_amx(-1 if use is None else int(use)))


def tiled_kv_supported(
    dtype: torch.dtype, q_heads: int, kv_heads: int, head_dim: int, block_size: int
) -> bool:
    """Whether a cache of this shape can be tiled for the bfloat16 prompt kernel on this CPU
    (``AttentionMetadata.tiled_kv``): bfloat16 on AVX512-BF16, a head size the kernel takes, blocks of
    a multiple of 16 tokens and at most 16 query heads per kv head. Decode rows and prompt chunks then
    read keys and values in place instead of packing them for every call."""
    lib = prefill_library(dtype)
    return (
        dtype == torch.bfloat16
        and lib is not None
        and hasattr(lib, "pd_paged_prefill_tiled")
        and bool(lib.supported(head_dim))
        and block_size % 16 == 0
        and q_heads % kv_heads == 0
        and q_heads // kv_heads <= _MAX_GROUP
    )


@functools.cache  # asked on every attention call over an int8 cache
def int8_kv_supported(q_heads: int, kv_heads: int, head_dim: int, block_size: int) -> bool:
    """Whether an int8 cache of this shape can be served on this CPU: where a bfloat16 cache would be
    tiled (``tiled_kv_supported``), by a library that has the int8 entry points."""
    return tiled_kv_supported(torch.bfloat16, q_heads, kv_heads, head_dim, block_size) and hasattr(
        prefill_library(torch.bfloat16), "pd_paged_decode_rows_int8"
    )


def supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the C kernel can serve this batch: CPU tensors of a supported dtype and shape, and a
    library that built on this machine."""
    _, _, block_size, kv_heads, _ = kv_cache.shape
    q_heads, head_dim = q.shape[1], q.shape[2]
    if kv_cache.dtype == torch.int8:
        return (
            q.device.type == "cpu"
            and q.dtype == torch.bfloat16
            and kv_cache.is_contiguous()
            and kv_int8_ref.head_dim_of(kv_cache) == head_dim
            and int8_kv_supported(q_heads, kv_heads, head_dim, block_size)
        )
    return (
        q.device.type == "cpu"
        and kv_cache.dtype in DTYPE_CODES
        and q.dtype == kv_cache.dtype
        and kv_cache.is_contiguous()
        and q_heads % kv_heads == 0
        and q_heads // kv_heads <= _MAX_GROUP
        and head_dim <= _MAX_HEAD_DIM
        and head_dim % _LANES == 0
        and _library() is not None
    )


def paged_attention_cpu(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal attention of the batch's new queries ``[T, q_heads, head_dim]`` over the paged cache,
    in ``q``'s dtype. The caller checks ``supports`` first."""
    out = torch.empty(q.shape, dtype=q.dtype)  # [T, q_heads, head_dim]
    rows = meta.single_query_rows
    if rows.seqs_host:
        decode_rows(q, kv_cache, meta, scale, out)
    if len(rows.seqs_host) < meta.num_seqs:
        start = 0
        for s, (q_len, s_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host, strict=True)):
            if q_len > 1:
                chunk = slice(start, start + q_len)
                if meta.tiled_kv or prefill_supported(q, kv_cache):
                    prefill_rows(
                        q[chunk], kv_cache, meta.block_tables[s], s_len, scale, out[chunk], meta.tiled_kv
                    )
                else:
                    out[chunk] = _prompt_attention(q[chunk], kv_cache, meta.block_tables[s], s_len, scale)
            start += q_len
    return out


def decode_rows(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, out: torch.Tensor
) -> None:
    """Writes ``out`` at the batch's one-token rows (``meta.single_query_rows``) with the C kernel."""
    # q: [T, q_heads, head_dim] (rows may be strided: a view into the fused QKV projection)
    _, _, block_size, kv_heads, _ = kv_cache.shape
    head_dim = q.shape[2]
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    rows = meta.single_query_rows
    tables = meta.block_tables
    if meta.tiled_kv or (prefill_supported(q, kv_cache) and decodes_as_prefill(q.dtype)):
        # the prompt kernel's own arithmetic, so a position's result is the same in a decode step as
        # in any prompt chunk (a failover's re-prefill, a chunked prompt, a cache hit)
        kernel = _decode_rows_kernel(q.dtype, meta.tiled_kv, kv_cache.dtype == torch.int8)
        with cpu_build.profiled("paged_decode_rows_cpu"):
            status = kernel(
                q.data_ptr(), q.stride(0), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), tables.data_ptr(),
                tables.stride(0), rows.token.data_ptr(), rows.seq.data_ptr(), rows.ctx_len.data_ptr(),
                out.data_ptr(), len(rows.seqs_host), q.shape[1], kv_heads, head_dim, block_size, scale,
                torch.get_num_threads(),
            )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"paged_decode_rows failed with status {status} (1: bad arguments, 2: memory)")
        return
    with cpu_build.profiled("paged_decode_cpu"):
        status = _library().pd_paged_decode_attention(
            q.data_ptr(),
            q.stride(0),
            kv_cache[0].data_ptr(),
            kv_cache[1].data_ptr(),
            tables.data_ptr(),
            tables.stride(0),
            rows.token.data_ptr(),
            rows.seq.data_ptr(),
            rows.ctx_len.data_ptr(),
            out.data_ptr(),
            len(rows.seqs_host),
            q.shape[1],
            kv_heads,
            head_dim,
            block_size,
            scale,
            DTYPE_CODES[kv_cache.dtype],
            torch.get_num_threads(),
        )
    if status != 0:
        raise RuntimeError(f"paged_decode_cpu failed with status {status} (1: bad arguments, 2: no memory)")


def decodes_as_prefill(dtype: torch.dtype) -> bool:
    """Whether decode rows in ``dtype`` run the prompt kernel's arithmetic on this CPU (bfloat16 with
    AVX512-BF16, float32 with AVX-512; the head size must suit the prompt kernel too)."""
    return hasattr(prefill_library(dtype), "pd_paged_decode_rows")


def decode_rows_address(dtype: torch.dtype, tiled: bool = False, int8: bool = False) -> int:
    """The address of the prompt kernel's ``pd_paged_decode_rows`` (``_tiled`` over a tiled cache,
    ``_int8`` over an int8 one) for ``dtype``, for C code that calls it (``decoder_cpu``);
    ``decodes_as_prefill(dtype)`` must hold."""
    return ctypes.cast(_decode_rows_kernel(dtype, tiled, int8), ctypes.c_void_p).value


def decode_kernel_rows_address() -> int:
    """The address of ``csrc/paged_decode_cpu.c``'s ``pd_paged_decode_rows_f32``: float32 decode rows on
    the decode kernel with ``pd_paged_decode_rows``'s arguments, for C code that calls it where
    ``decodes_as_prefill(torch.float32)`` does not hold (``decoder_cpu``: what ``decode_rows`` runs)."""
    return ctypes.cast(_library().pd_paged_decode_rows_f32, ctypes.c_void_p).value


def _decode_rows_kernel(dtype: torch.dtype, tiled: bool, int8: bool) -> ctypes._CFuncPtr:
    lib = prefill_library(dtype)
    if int8:
        return lib.pd_paged_decode_rows_int8
    return lib.pd_paged_decode_rows_tiled if tiled else lib.pd_paged_decode_rows


def prefill_supported(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether prompt chunks take a C prefill kernel: bfloat16 on a CPU with AVX512-BF16 or float32
    anywhere, a head size the kernel handles, and a library that built here."""
    if kv_cache.dtype == torch.int8:
        return supports(q, kv_cache)
    lib = prefill_library(kv_cache.dtype)
    return q.dtype == kv_cache.dtype and lib is not None and bool(lib.supported(q.shape[2]))


def prefill_rows(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    table: torch.Tensor,
    seq_len: int,
    scale: float,
    out: torch.Tensor,
    tiled: bool = False,
) -> None:
    """Writes ``out`` (``[q_len, q_heads, head_dim]``, contiguous) with the causal attention of one
    sequence's prompt chunk ``q``, the last ``q_len`` of its ``seq_len`` cached tokens."""
    _, _, block_size, kv_heads, _ = kv_cache.shape
    head_dim = q.shape[2]
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    table = table.contiguous()
    lib = prefill_library(q.dtype)
    if kv_cache.dtype == torch.int8:
        kernel = lib.pd_paged_prefill_int8
    else:
        kernel = lib.pd_paged_prefill_tiled if tiled else lib.attention
    with cpu_build.profiled("paged_prefill_cpu"):
        status = kernel(
            q.data_ptr(),
            q.stride(0),
            kv_cache[0].data_ptr(),
            kv_cache[1].data_ptr(),
            table.data_ptr(),
            out.data_ptr(),
            q.shape[0],
            seq_len,
            q.shape[1],
            kv_heads,
            head_dim,
            block_size,
            scale,
            torch.get_num_threads(),
        )
    if status != 0:
        raise RuntimeError(
            f"paged_prefill_cpu failed with status {status} (1: bad arguments, 2: no memory, 3: unsupported)"
        )


def _prompt_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, table: torch.Tensor, seq_len: int, scale: float
) -> torch.Tensor:
    # q: [q_len, q_heads, head_dim], the last q_len of the sequence's seq_len tokens
    _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
    used = -(-seq_len // block_size)
    flat = kv_cache.view(2, num_blocks, block_size * kv_heads * head_dim)
    kv = flat.index_select(1, table[:used].long())  # [2, used, block_size * kv_heads * head_dim]
    kv = kv.view(2, used * block_size, kv_heads, head_dim)[:, :seq_len]
    q_len = q.shape[0]
    mask = None
    if q_len != seq_len:  # a chunk after cached tokens: causal, aligned to the sequence's end
        mask = torch.ones(q_len, seq_len, dtype=torch.bool).tril_(seq_len - q_len)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],  # [1, q_heads, q_len, head_dim]
        kv[0].transpose(0, 1)[None],  # [1, kv_heads, seq_len, head_dim]
        kv[1].transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1)  # [q_len, q_heads, head_dim]
