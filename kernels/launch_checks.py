"""Argument checks that every Triton wrapper runs before a launch.

A Triton kernel trusts its pointers: a wrong stride or an out-of-range block id reads or writes some
other request's memory instead of failing. The wrappers therefore check shapes, dtypes and strides
(host metadata, free) and the range of block ids and cache slots (device data). The range check
reads the tensor back, so it is done once per index tensor and remembered: the attention metadata of
one step is shared by every layer, so a step pays for one check, not one per layer.
"""

from __future__ import annotations

import weakref

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# id(index tensor) -> (a weak reference to it, the exclusive upper bound it was found to respect).
# Keyed by identity: tensors compare element-wise, so they cannot be dictionary keys by value.
_checked_bounds: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}


def _known_bound(index: torch.Tensor) -> int | None:
    entry = _checked_bounds.get(id(index))
    if entry is None or entry[0]() is not index:
        return None
    return entry[1]


def _remember_bound(index: torch.Tensor, upper: int) -> None:
    key = id(index)
    _checked_bounds[key] = (weakref.ref(index, lambda _: _checked_bounds.pop(key, None)), upper)


def require(cond: bool, message: str) -> None:
    """Raises ``ValueError(message)`` unless ``cond`` holds."""
    if not cond:
        raise ValueError(message)


def check_kv_cache(kv_cache: torch.Tensor, name: str = "kv_cache") -> None:
    """``[2, num_blocks, block_size, kv_heads, head_dim]`` in a float dtype with unit head_dim stride."""
    require(kv_cache.dim() == 5 and kv_cache.shape[0] == 2,
            f"{name} must be [2, num_blocks, block_size, kv_heads, head_dim], got {tuple(kv_cache.shape)}")
    require(kv_cache.dtype in FLOAT_DTYPES, f"{name} dtype {kv_cache.dtype} is not fp16, bf16 or fp32")
    require(kv_cache.stride(-1) == 1, f"{name} must have unit stride on head_dim, got {kv_cache.stride()}")


def check_index_range(index: torch.Tensor, upper: int, name: str, valid: torch.Tensor | None = None) -> None:
    """Checks ``0 <= index < upper`` (where ``valid``, if given, is True); remembered per tensor.

    ``valid`` masks padding entries (block-table columns past a sequence's last block), which may
    hold anything. The memo is keyed on the tensor object; it assumes index tensors are not
    rewritten in place after their first use, which holds for per-step metadata.
    """
    if index.numel() == 0:
        return
    known = _known_bound(index)
    if known is not None and known <= upper and valid is None:
        return
    bad = (index < 0) | (index >= upper)
    if valid is not None:
        bad &= valid
    if bool(bad.any()):
        first = int(index[bad].flatten()[0])
        raise ValueError(f"{name} holds {first}, outside 0..{upper - 1}")
    if valid is None:
        _remember_bound(index, upper)


def check_block_tables(
    block_tables: torch.Tensor, seq_lens_host: tuple[int, ...], block_size: int, num_blocks: int
) -> None:
    """Every block a sequence uses (its first ``ceil(seq_len / block_size)`` entries) is a real block."""
    # block_tables: [S, max_blocks] int32
    require(block_tables.dim() == 2 and block_tables.shape[0] == len(seq_lens_host),
            f"block_tables must be [num_seqs={len(seq_lens_host)}, max_blocks], "
            f"got {tuple(block_tables.shape)}")
    require(block_tables.dtype == torch.int32, f"block_tables must be int32, got {block_tables.dtype}")
    require(block_tables.stride(-1) == 1, "block_tables must have unit stride on its last dim")
    max_len = max(seq_lens_host, default=0)
    require(block_tables.shape[1] * block_size >= max_len,
            f"block_tables of {block_tables.shape[1]} columns cannot hold a sequence of {max_len} tokens")
    if block_tables.numel() == 0:
        return
    known = _known_bound(block_tables)
    if known is not None and known <= num_blocks:
        return
    used = torch.tensor([-(-n // block_size) for n in seq_lens_host], device=block_tables.device)  # [S]
    cols = torch.arange(block_tables.shape[1], device=block_tables.device)  # [max_blocks]
    valid = cols[None, :] < used[:, None]  # [S, max_blocks]
    check_index_range(block_tables, num_blocks, "block_tables", valid)
    _remember_bound(block_tables, num_blocks)
