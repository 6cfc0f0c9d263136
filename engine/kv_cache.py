"""The paged KV-cache tensors: one ``[2, num_blocks, block_size, kv_heads, head_dim]`` tensor per layer.

``kv_cache_dtype`` chooses what a row is stored as: ``"auto"``, the model's dtype; ``"int8"``, int8 values
and a float32 scale per row (``kernels/kv_int8_ref.py``: the last dimension is ``head_dim + 4`` bytes),
half the memory and half the bytes decode attention reads, for bfloat16 models on CPUs whose prompt
kernel reads a tiled cache (``kernels.paged_attention_cpu.int8_kv_supported``).
"""

from __future__ import annotations

import torch

from pdfabric.engine.config import ModelConfig
from pdfabric.engine.loader import DTYPES
from pdfabric.kernels.kv_int8_ref import SCALE_BYTES
from pdfabric.worker_config import KV_CACHE_DTYPES


def allocate_kv_cache(
    cfg: ModelConfig,
    num_blocks: int,
    block_size: int,
    device: str | torch.device = "cpu",
    kv_cache_dtype: str = "auto",
) -> list[torch.Tensor]:
    """Zeroed cache tensors, one per layer, in the model's dtype or (``"int8"``) int8 rows with scales."""
    if kv_cache_dtype == "int8":
        shape = (2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim + SCALE_BYTES)
        dtype = torch.int8
    elif kv_cache_dtype == "auto":
        shape = (2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        dtype = DTYPES[cfg.dtype]
    else:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]


def kv_bytes_per_token(cfg: ModelConfig, kv_cache_dtype: str = "auto") -> int:
    """Bytes of K and V one token takes across all layers, scales included."""
    if kv_cache_dtype == "int8":
        return 2 * cfg.num_layers * cfg.num_kv_heads * (cfg.head_dim + SCALE_BYTES)
    return cfg.kv_bytes_per_token
