"""Goodput as DistServe defines it: the highest request rate at which at least ``target`` (90% by
default) of requests meet both the TTFT and the ITL SLO; and the SLO-scale sweep.

The rate search measures attainment at a rate by replaying the same requests squeezed or stretched to
that mean rate (``Workload.with_rate``). It assumes attainment falls as the rate rises:

1. ``sweep``: measure a list of rates; the goodput is the highest passing rate below the first failing
   one (a pass after a failure is treated as noise).
2. ``bisect``: from a bracket [lo, hi] (lo halved while it fails, hi doubled while it passes), split the
   bracket at its geometric midpoint until hi/lo - 1 <= ``rel_tol`` or the trial budget is spent. The
   goodput is ``lo``, the highest rate measured to pass; ``interpolated`` is where the straight line
   between (lo, its attainment) and (hi, its attainment) crosses the target.

The SLO-scale sweep needs no new runs: a request meets the SLO times s when s >= its required scale
(the larger of TTFT/TTFT-SLO and ITL/ITL-SLO), so the attainment at every scale, and the smallest scale
that reaches the target, come straight from one run's records.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pdfabric.bench.metrics import SLO, counted, required_scale
from pdfabric.bench.records import RequestRecord

Measure = Callable[[float], Awaitable[float]]  # rate (req/s) -> attainment (0..1)


@dataclass(frozen=True)
class SearchConfig:
    """The attainment target and the bisection's budget."""

    target: float = 0.9
    rel_tol: float = 0.05
    max_trials: int = 8

    def __post_init__(self) -> None:
        if not 0 < self.target <= 1:
            raise ValueError(f"target attainment must be in (0, 1], got {self.target}")
        if not self.rel_tol > 0:
            raise ValueError(f"rel_tol must be > 0, got {self.rel_tol}")
        if self.max_trials < 1:
            raise ValueError(f"max_trials must be >= 1, got {self.max_trials}")


@dataclass
class GoodputResult:
    """Every (rate, attainment) measured, and the goodput they support (``None``: no rate passed)."""

    target: float
    trials: list[tuple[float, float]] = field(default_factory=list)
    goodput: float | None = None
    first_fail: float | None = None

    @property
    def interpolated(self) -> float | None:
        """Rate where the attainment line between the goodput and the first failing rate hits target."""
        if self.goodput is None or self.first_fail is None:
            return self.goodput
        a_lo = max(a for r, a in self.trials if r == self.goodput)
        a_hi = min(a for r, a in self.trials if r == self.first_fail)
        if a_lo == a_hi:
            return self.goodput
        frac = (a_lo - self.target) / (a_lo - a_hi)
        return self.goodput + frac * (self.first_fail - self.goodput)

    def to_json(self) -> dict[str, Any]:
        interp = self.interpolated
        return {
            "target": self.target,
            "goodput_rps": self.goodput,
            "goodput_interpolated_rps": None if interp is None else round(interp, 4),
            "first_failing_rps": self.first_fail,
            "trials": [{"rate": r, "attainment": a} for r, a in sorted(self.trials)],
        }


def settle(res: GoodputResult) -> GoodputResult:
    """Goodput = highest passing rate below the lowest failing rate."""
    fails = sorted(r for r, a in res.trials if a < res.target)
    res.first_fail = fails[0] if fails else None
    passes = [r for r, a in res.trials if a >= res.target and (res.first_fail is None or r < res.first_fail)]
    res.goodput = max(passes) if passes else None
    return res


async def sweep(measure: Measure, rates: list[float], target: float = 0.9) -> GoodputResult:
    """Measure each rate in increasing order (stopping after two failures in a row)."""
    res = GoodputResult(target=target)
    fails_in_row = 0
    for rate in sorted(rates):
        att = await measure(rate)
        res.trials.append((rate, att))
        fails_in_row = fails_in_row + 1 if att < target else 0
        if fails_in_row >= 2:
            break
    return settle(res)


async def bisect(
    measure: Measure, lo: float, hi: float, cfg: SearchConfig, prior: GoodputResult | None = None
) -> GoodputResult:
    """Bracket and bisect the goodput; ``prior`` trials (e.g. from a sweep) are reused, not re-run."""
    if not 0 < lo < hi:
        raise ValueError(f"need 0 < lo < hi, got lo={lo} hi={hi}")
    res = GoodputResult(target=cfg.target, trials=list(prior.trials) if prior else [])
    known = dict(res.trials)
    budget = cfg.max_trials

    async def passes(rate: float) -> bool:
        nonlocal budget
        if rate not in known:
            budget -= 1
            known[rate] = await measure(rate)
            res.trials.append((rate, known[rate]))
        return known[rate] >= cfg.target

    while not await passes(lo) and budget > 0:
        lo, hi = lo / 2, lo
    if known[lo] >= cfg.target:
        while budget > 0 and await passes(hi):
            lo, hi = hi, hi * 2
        while budget > 0 and hi / lo - 1 > cfg.rel_tol and known.get(hi, 0.0) < cfg.target:
            mid = _round_rate(math.sqrt(lo * hi), lo, hi)  # geometric: brackets can span decades
            if await passes(mid):
                lo = mid
            else:
                hi = mid
    return settle(res)


async def find_goodput(
    measure: Measure, rates: list[float] | None, lo_hi: tuple[float, float], cfg: SearchConfig
) -> GoodputResult:
    """The search every goodput command runs: sweep ``rates``, then bisect between the last pass and
    the first failure with the trials left; without ``rates``, bisect from ``lo_hi``."""
    if not rates:
        return await bisect(measure, lo_hi[0], lo_hi[1], cfg)
    prior = await sweep(measure, rates, cfg.target)
    left = cfg.max_trials - len(prior.trials)
    if prior.goodput is None or prior.first_fail is None or left <= 0:
        return prior
    sub = SearchConfig(target=cfg.target, rel_tol=cfg.rel_tol, max_trials=left)
    return await bisect(measure, prior.goodput, prior.first_fail, sub, prior=prior)


def _round_rate(rate: float, lo: float, hi: float) -> float:
    """``rate`` to 4 significant digits (readable trial names), unless that leaves (lo, hi)."""
    short = float(f"{rate:.4g}")
    return short if lo < short < hi else rate


def slo_scale_sweep(records: list[RequestRecord], slo: SLO, scales: list[float]) -> list[tuple[float, float]]:
    """Attainment at each SLO scale (both SLOs times the scale), from one run's records."""
    needs = [required_scale(r, slo) for r in counted(records)]
    if not needs:
        return []
    return [(s, sum(n <= s for n in needs) / len(needs)) for s in scales]


def min_slo_scale(records: list[RequestRecord], slo: SLO, target: float = 0.9) -> float | None:
    """The smallest SLO scale at which attainment reaches ``target``; ``None`` if no scale can."""
    needs = sorted(required_scale(r, slo) for r in counted(records))
    if not needs:
        return None
    k = math.ceil(target * len(needs) - 1e-9)  # this many requests must meet it
    s = needs[max(k, 1) - 1]
    return None if math.isinf(s) else s
