"""Prompt token ids of an exact length, so the server sees exactly the input length the workload asks for.

Ids are drawn uniformly from ``[0, vocab_size)`` with a seeded generator, so the same workload and seed
give the same prompts against every deployment. A request with Mooncake ``hash_ids`` is built block by
block: block ``h`` is the same ``PREFIX_BLOCK_TOKENS`` ids wherever ``h`` appears, so requests that share
leading hash ids share a real token prefix (the last block is cut to the prompt's length).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from pdfabric.bench.workload import PREFIX_BLOCK_TOKENS, Request

_BLOCK_STREAM = 1  # keeps hash-block ids and per-request ids in separate random streams
_REQUEST_STREAM = 2


@dataclass(frozen=True)
class PromptConfig:
    """``vocab_size`` bounds the random ids (keep it <= the served model's vocabulary)."""

    vocab_size: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {self.vocab_size}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")


class PromptBuilder:
    """Makes the token-id prompt of each request; blocks named by hash ids are cached (LRU)."""

    def __init__(self, cfg: PromptConfig, cache_blocks: int = 4096) -> None:
        self.cfg = cfg
        self._block = lru_cache(maxsize=cache_blocks)(self._make_block)

    def _make_block(self, hash_id: int) -> np.ndarray:
        rng = np.random.default_rng([self.cfg.seed, _BLOCK_STREAM, hash_id])
        return rng.integers(0, self.cfg.vocab_size, size=PREFIX_BLOCK_TOKENS, dtype=np.int32)

    def _random(self, index: int, n: int) -> np.ndarray:
        rng = np.random.default_rng([self.cfg.seed, _REQUEST_STREAM, index])
        return rng.integers(0, self.cfg.vocab_size, size=n, dtype=np.int32)

    def tokens(self, req: Request) -> list[int]:
        """Exactly ``req.input_len`` token ids."""
        if not req.hash_ids:
            return self._random(req.index, req.input_len).tolist()
        parts: list[np.ndarray] = []
        have = 0
        for h in req.hash_ids:
            if have >= req.input_len:
                break
            block = self._block(h)[: req.input_len - have]
            parts.append(block)
            have += len(block)
        if have < req.input_len:  # fewer hash ids than blocks: the rest is private to this request
            parts.append(self._random(req.index, req.input_len - have))
        return np.concatenate(parts).tolist()
