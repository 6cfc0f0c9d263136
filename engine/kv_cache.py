"""The paged KV-cache tensors: one ``[2, num_blocks, block_size, kv_heads, head_dim]`` tensor per layer."""

from __future__ import annotations

import torch

from pdfabric.engine.config import ModelConfig
from pdfabric.engine.loader import DTYPES


def block_bytes(cfg: ModelConfig, block_size: int) -> int:
    """Bytes one block takes across all layers (keys and values)."""
    return cfg.kv_bytes_per_token * block_size


def blocks_in_budget(cfg: ModelConfig, block_size: int, budget_bytes: int) -> int:
    """How many blocks fit in ``budget_bytes`` of KV memory."""
    n = budget_bytes // block_bytes(cfg, block_size)
    if n <= 0:
        raise ValueError(
            f"a KV budget of {budget_bytes} bytes holds no block of {block_bytes(cfg, block_size)} bytes"
        )
    return int(n)


def allocate_kv_cache(
    cfg: ModelConfig, num_blocks: int, block_size: int, device: str | torch.device = "cpu"
) -> list[torch.Tensor]:
    """Zeroed cache tensors, one per layer, in the model's dtype."""
    shape = (2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return [torch.zeros(shape, dtype=DTYPES[cfg.dtype], device=device) for _ in range(cfg.num_layers)]
