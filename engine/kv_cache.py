"""The paged KV-cache tensors: one ``[2, num_blocks, block_size, kv_heads, head_dim]`` tensor per layer."""

from __future__ import annotations

import torch

from pdfabric.engine.config import ModelConfig
from pdfabric.engine.loader import DTYPES


def allocate_kv_cache(
    cfg: ModelConfig, num_blocks: int, block_size: int, device: str | torch.device = "cpu"
) -> list[torch.Tensor]:
    """Zeroed cache tensors, one per layer, in the model's dtype."""
    shape = (2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return [torch.zeros(shape, dtype=DTYPES[cfg.dtype], device=device) for _ in range(cfg.num_layers)]
