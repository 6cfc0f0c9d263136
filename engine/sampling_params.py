"""Per-request sampling parameters: validated once, then passed around unchanged (no torch here)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` is greedy. Sampling is keyed by ``seed`` and the token's index in the
    output, not by a generator's state, so the same seed gives the same output on any worker, in any
    batch, and across the prefill/decode hand-over. ``output_offset`` is how many output tokens a
    request already produced elsewhere before it was resumed here (its prompt then ends with them):
    token ``i`` of this run is output token ``output_offset + i``, so a request moved to another worker
    mid-stream samples exactly what it would have sampled where it started.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int = 0  # how many top log-probabilities to return per token (0: none)
    output_offset: int = 0  # output tokens produced before this run (a resumed request)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.output_offset < 0:
            raise ValueError(f"output_offset must be >= 0, got {self.output_offset}")
        if not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
