"""Synthetic workloads: Poisson or gamma arrivals and fixed, uniform or trace-sampled lengths.

Burstiness is the coefficient of variation (CV) of the gaps between arrivals: 1 is a Poisson process,
above 1 is burstier (requests bunch up, then pause), below 1 is smoother, and 0 is a fixed interval.
Gaps are gamma-distributed with shape 1/CV^2 and mean 1/rate, so the mean rate never changes with CV.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pdfabric.bench.workload import Request, Workload


@dataclass(frozen=True)
class LengthSpec:
    """A length distribution: ``fixed`` (lo), ``uniform`` integers in [lo, hi], or ``trace`` (sampled)."""

    kind: str
    lo: int = 0
    hi: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "trace"):
            raise ValueError(f"length kind must be fixed, uniform or trace, got {self.kind!r}")
        if self.kind != "trace" and self.lo < 1:
            raise ValueError(f"lengths must be >= 1, got {self.lo}")
        if self.kind == "uniform" and self.hi < self.lo:
            raise ValueError(f"uniform length range {self.lo}:{self.hi} is empty")

    @staticmethod
    def parse(text: str) -> LengthSpec:
        """``"512"`` is fixed, ``"256:1024"`` is uniform, ``"trace"`` samples from ``--lengths-from``."""
        text = text.strip()
        if text == "trace":
            return LengthSpec("trace")
        try:
            if ":" in text:
                lo, hi = (int(p) for p in text.split(":", 1))
                return LengthSpec("uniform", lo, hi)
            return LengthSpec("fixed", int(text))
        except ValueError:
            raise ValueError(f"bad length {text!r}: expected N, LO:HI or trace") from None

    def __str__(self) -> str:
        return {"fixed": f"{self.lo}", "uniform": f"{self.lo}:{self.hi}", "trace": "trace"}[self.kind]


@dataclass(frozen=True)
class SyntheticConfig:
    """A synthetic workload: ``num_requests`` arrivals at ``rate`` req/s with the given burstiness."""

    rate: float
    num_requests: int
    input_len: LengthSpec = LengthSpec("fixed", 512)
    output_len: LengthSpec = LengthSpec("fixed", 64)
    burstiness: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError(f"rate must be a finite number > 0, got {self.rate}")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if not (self.burstiness >= 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"burstiness (CV of inter-arrival gaps) must be >= 0, got {self.burstiness}")


def arrival_times(rate: float, n: int, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """``n`` arrival times starting at 0 with mean gap 1/rate and gap CV ``burstiness``."""
    if n <= 1:
        return np.zeros(n)
    if burstiness == 0:
        gaps = np.full(n - 1, 1.0 / rate)
    else:
        shape = 1.0 / burstiness**2
        gaps = rng.gamma(shape, 1.0 / (rate * shape), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def generate(cfg: SyntheticConfig, lengths_from: Workload | None = None) -> Workload:
    """Build the workload. ``trace`` lengths draw (input, output) pairs together from ``lengths_from``."""
    uses_trace = "trace" in (cfg.input_len.kind, cfg.output_len.kind)
    if uses_trace and (lengths_from is None or not lengths_from.requests):
        raise ValueError("trace-sampled lengths need a trace to sample from (--lengths-from FILE)")
    rng = np.random.default_rng(cfg.seed)
    times = arrival_times(cfg.rate, cfg.num_requests, cfg.burstiness, rng)
    picks = rng.integers(0, len(lengths_from), size=cfg.num_requests) if uses_trace and lengths_from else None

    def draw(spec: LengthSpec, k: int, field: str) -> int:
        if spec.kind == "fixed":
            return spec.lo
        if spec.kind == "uniform":
            return int(rng.integers(spec.lo, spec.hi + 1))
        assert picks is not None and lengths_from is not None  # checked above
        return getattr(lengths_from.requests[int(picks[k])], field)

    reqs = tuple(
        Request(index=k, arrival_s=float(times[k]), input_len=draw(cfg.input_len, k, "input_len"),
                output_len=draw(cfg.output_len, k, "output_len"))
        for k in range(cfg.num_requests)
    )
    source = {
        "kind": "synthetic",
        "rate": cfg.rate,
        "arrival": "poisson" if cfg.burstiness == 1.0 else "gamma",
        "burstiness_cv": cfg.burstiness,
        "input_len": str(cfg.input_len),
        "output_len": str(cfg.output_len),
        "seed": cfg.seed,
    }
    if uses_trace and lengths_from is not None:
        source["lengths_from"] = lengths_from.source.get("file", lengths_from.name)
    return Workload(name="synthetic", requests=reqs, source=source)
