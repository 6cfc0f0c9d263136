"""Scaling a recorded trace to a small machine: a faster or slower clock, shorter lengths, fewer requests.

Applied in this order, and recorded in the workload's ``scaling`` so every report states it:

1. ``time_scale`` X: arrival times are divided by X (X > 1 replays faster, X < 1 slower).
2. ``duration_s``: keep the requests that arrive within the first S seconds of the scaled clock.
3. ``max_requests``: keep the first N of those.
4. ``hash_block_tokens`` B (Mooncake traces): each hash id names B tokens instead of 512, and input
   lengths are multiplied by B/512, so a prompt keeps every block id and the trace's whole pattern of
   shared prefixes (which blocks repeat, and where) at a fraction of its tokens.
5. ``length_ratio`` R: input and output lengths are multiplied by R (rounded, at least 1 token).
6. ``max_input_len`` / ``max_output_len``: lengths above the cap are cut to the cap.

Mooncake ``hash_ids`` follow the cut input: a prompt of L tokens keeps its first ceil(L/B) block ids
(B = 512 unless ``hash_block_tokens``), so shared prefixes stay shared (the last block may be partial).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from pdfabric.bench.workload import PREFIX_BLOCK_TOKENS, Request, Workload


@dataclass(frozen=True)
class Scaling:
    """How to shrink a workload; the defaults change nothing."""

    time_scale: float = 1.0
    duration_s: float | None = None
    max_requests: int | None = None
    length_ratio: float = 1.0
    max_input_len: int | None = None
    max_output_len: int | None = None
    hash_block_tokens: int | None = None

    def __post_init__(self) -> None:
        if not (self.time_scale > 0 and math.isfinite(self.time_scale)):
            raise ValueError(f"time_scale must be a finite number > 0, got {self.time_scale}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {self.max_requests}")
        if not (self.length_ratio > 0 and math.isfinite(self.length_ratio)):
            raise ValueError(f"length_ratio must be a finite number > 0, got {self.length_ratio}")
        b = self.hash_block_tokens
        if b is not None and not 1 <= b <= PREFIX_BLOCK_TOKENS:
            raise ValueError(f"hash_block_tokens must be in 1..{PREFIX_BLOCK_TOKENS}, got {b}")
        for name in ("max_input_len", "max_output_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")

    def is_identity(self) -> bool:
        return self == Scaling()

    def _length(self, n: int, cap: int | None) -> int:
        n = max(1, round(n * self.length_ratio))
        return n if cap is None else min(n, cap)

    def apply(self, workload: Workload) -> Workload:
        """The scaled workload; ``scaling`` in the result holds these settings and before/after counts."""
        before = _stats(workload)
        reqs = [replace(r, arrival_s=r.arrival_s / self.time_scale) for r in workload.requests]
        if self.duration_s is not None:
            reqs = [r for r in reqs if r.arrival_s < self.duration_s]
        if self.max_requests is not None:
            reqs = reqs[: self.max_requests]
        out: list[Request] = []
        for k, r in enumerate(reqs):
            block, n_in = r.hash_block, r.input_len
            if self.hash_block_tokens is not None and r.hash_ids:
                block = self.hash_block_tokens
                n_in = math.ceil(n_in * block / r.hash_block)  # every block keeps a token
            n_in = self._length(n_in, self.max_input_len)
            n_out = self._length(r.output_len, self.max_output_len)
            hashes = r.hash_ids
            if hashes is not None:
                hashes = hashes[: math.ceil(n_in / block)]
            out.append(
                replace(r, index=k, input_len=n_in, output_len=n_out, hash_ids=hashes, hash_block=block)
            )
        scaled = replace(workload, requests=tuple(out))
        record = {**asdict(self), "before": before, "after": _stats(scaled)}
        return replace(scaled, scaling={**workload.scaling, **record})


def _stats(w: Workload) -> dict[str, float | int | None]:
    d = w.describe()
    return {k: d[k] for k in ("requests", "span_s", "mean_rate", "input_tokens", "output_tokens")}
