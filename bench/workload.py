"""A workload: the requests to replay, each with an arrival time and its input and output lengths.

Trace loaders, the synthetic generator and scaling all produce and consume ``Workload`` values; the
replay client turns each ``Request`` into one streaming completion call at ``arrival_s``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Any

# Mooncake's prefix-hash block size, in tokens; also the block size used to build shared prefixes.
PREFIX_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class Request:
    """One request to send: when (seconds after the run starts), how long a prompt, how many tokens.

    ``hash_ids`` (Mooncake traces only) name the prompt's ``hash_block``-token blocks
    (``PREFIX_BLOCK_TOKENS`` unless scaling shrank them): two requests whose ids agree on a leading
    run share that many blocks of identical prompt tokens.
    """

    index: int
    arrival_s: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] | None = None
    hash_block: int = PREFIX_BLOCK_TOKENS  # tokens each hash id names
    embed: bool = False  # an embedding input (output_len unused): the simulator batches it as the router does

    def __post_init__(self) -> None:
        if self.arrival_s < 0:
            raise ValueError(f"request {self.index}: arrival_s must be >= 0, got {self.arrival_s}")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError(
                f"request {self.index}: input_len and output_len must be >= 1, "
                f"got {self.input_len} and {self.output_len}"
            )
        if not 1 <= self.hash_block <= PREFIX_BLOCK_TOKENS:
            raise ValueError(
                f"request {self.index}: hash_block must be in 1..{PREFIX_BLOCK_TOKENS}, got {self.hash_block}"
            )


@dataclass(frozen=True)
class Workload:
    """Requests sorted by arrival, with a name and a description of how they were made and scaled."""

    name: str
    requests: tuple[Request, ...]
    source: dict[str, Any] = field(default_factory=dict)
    scaling: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        arrivals = [r.arrival_s for r in self.requests]
        if arrivals != sorted(arrivals):
            raise ValueError(f"workload {self.name!r}: requests must be sorted by arrival time")

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def span_s(self) -> float:
        """Seconds from the first arrival to the last."""
        if not self.requests:
            return 0.0
        return self.requests[-1].arrival_s - self.requests[0].arrival_s

    def mean_rate(self) -> float:
        """Mean arrival rate in requests/s, ``(n - 1) / span``; ``inf`` when all arrive at once."""
        if len(self.requests) < 2:
            return 0.0
        span = self.span_s
        return float("inf") if span <= 0 else (len(self.requests) - 1) / span

    def with_rate(self, rate: float) -> Workload:
        """The same requests with arrival times stretched or squeezed so that the mean rate is ``rate``.

        The shape of the arrival process (bursts, gaps) is kept; only the clock runs faster or slower.
        """
        if rate <= 0:
            raise ValueError(f"rate must be > 0, got {rate}")
        current = self.mean_rate()
        if current in (0.0, float("inf")):
            raise ValueError(f"workload {self.name!r} has no arrival span to rescale to {rate} req/s")
        factor = current / rate
        t0 = self.requests[0].arrival_s
        reqs = tuple(replace(r, arrival_s=(r.arrival_s - t0) * factor) for r in self.requests)
        return replace(self, requests=reqs, scaling={**self.scaling, "target_rate": rate})

    def repeated(self, copies: int) -> Workload:
        """The requests ``copies`` times over, each copy starting one mean gap after the previous one
        ends: the same mean rate and arrival shape, lasting ``copies`` times as long (the goodput
        search grows a workload too small to load a deployment this way)."""
        if copies < 1:
            raise ValueError(f"copies must be >= 1, got {copies}")
        if copies == 1:
            return self
        rate = self.mean_rate()
        if rate in (0.0, float("inf")):
            raise ValueError(f"workload {self.name!r} has no arrival span to repeat")
        period = self.span_s + 1.0 / rate
        t0 = self.requests[0].arrival_s
        reqs = tuple(
            replace(r, index=k * len(self.requests) + i, arrival_s=(r.arrival_s - t0) + k * period)
            for k in range(copies)
            for i, r in enumerate(self.requests)
        )
        return replace(self, requests=reqs, scaling={**self.scaling, "repeated": copies})

    def with_embeddings(self, share: float, seed: int = 0) -> Workload:
        """The same requests with a seeded ``share`` of them (0 to 1) made embedding inputs."""
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"the embedding share must be in [0, 1], got {share}")
        if share == 0.0:
            return self
        rng = random.Random(seed)
        reqs = tuple(replace(r, embed=rng.random() < share) for r in self.requests)
        return replace(self, requests=reqs, scaling={**self.scaling, "embed_share": share})

    def describe(self) -> dict[str, Any]:
        """Counts and length totals for reports."""
        n = len(self.requests)
        rate = self.mean_rate()
        return {
            "name": self.name,
            "requests": n,
            "span_s": round(self.span_s, 3),
            "mean_rate": round(rate, 4) if 0 < rate < float("inf") else None,
            "embedding_inputs": sum(r.embed for r in self.requests),
            "input_tokens": sum(r.input_len for r in self.requests),
            "output_tokens": sum(r.output_len for r in self.requests),
            "shared_prefix_tokens": shared_prefix_tokens(self.requests),
            "source": self.source,
            "scaling": self.scaling,
        }


def shared_prefix_tokens(requests: tuple[Request, ...] | list[Request]) -> int | None:
    """Prompt tokens that repeat the start of an earlier request's prompt (in arrival order), as the
    prompt builder lays out ``hash_ids``: what a prefix cache of unbounded size could reuse at token
    granularity, an upper bound on any server's hit. ``None`` when no request has hash ids."""
    if not any(r.hash_ids for r in requests):
        return None
    seen: dict[tuple[int, ...], int] = {}  # a chain of leading block ids -> most tokens seen in its last
    shared = 0
    for r in sorted(requests, key=lambda r: (r.arrival_s, r.index)):
        ids = r.hash_ids or ()
        matching = True
        b = r.hash_block
        for i in range(min(len(ids), -(-r.input_len // b))):
            chain, own = ids[: i + 1], min(b, r.input_len - i * b)
            if matching:
                before = seen.get(chain, 0)
                shared += min(before, own)
                matching = before >= own
            seen[chain] = max(seen.get(chain, 0), own)
    return shared
