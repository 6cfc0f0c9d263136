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
3. A pass only counts when the trial *loaded* the deployment (``Trial.loaded``): its requests kept
   arriving at least 1 / ``LOAD_TAIL`` times as long as the deployment then needed to finish them.
   A workload too small for that (a burst that a big enough deployment absorbs whole, at any rate)
   proves nothing about a sustained rate, so ``grown`` replays it again repeated (``copies``, up to
   ``max_growth``) until the trial misses the SLO or loads the deployment. A pass that never loads
   it is *unloaded*: neither pass nor failure.
4. A goodput needs a failing rate above it. A search in which no rate failed has no goodput
   (``bounded`` is False), only a ``lower_bound``: the rate could not be bounded with this workload.

The SLO-scale sweep needs no new runs: a request meets the SLO times s when s >= its required scale
(the larger of TTFT/TTFT-SLO and ITL/ITL-SLO), so the attainment at every scale, and the smallest scale
that reaches the target, come straight from one run's records.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pdfabric.bench.metrics import SLO, attainment, counted, required_scale
from pdfabric.bench.records import RequestRecord

LOAD_TAIL = 0.25  # a trial loads the deployment when its last request ends within this share of its span


@dataclass(frozen=True)
class Trial:
    """One run at one rate: its attainment, how long its requests kept arriving (``span_s``) and how
    long the deployment needed after the last arrival to finish them (``tail_s``)."""

    attainment: float
    span_s: float = 0.0
    tail_s: float = 0.0
    requests: int = 0

    @property
    def loaded(self) -> bool:
        """Whether the arrivals lasted long enough to test a sustained rate (see the module doc, 3)."""
        return self.tail_s <= LOAD_TAIL * self.span_s

    @staticmethod
    def of(records: list[RequestRecord], slo: SLO) -> Trial:
        done = counted(records)
        if not done:
            return Trial(0.0, requests=len(records))
        arrivals = [r.scheduled_s for r in done]
        ends = [r.sent_s + (r.e2e_ms or 0.0) / 1e3 for r in done]
        span, tail = max(arrivals) - min(arrivals), max(0.0, max(ends) - max(arrivals))
        return Trial(attainment(records, slo) or 0.0, span, tail, len(records))


Measure = Callable[[float], Awaitable["Trial | float"]]  # rate (req/s) -> its trial (a float: a loaded one)
Run = Callable[[float, int], Awaitable[Trial]]  # (rate, copies of the workload) -> the trial


@dataclass(frozen=True)
class SearchConfig:
    """The attainment target and the bisection's budget."""

    target: float = 0.9
    rel_tol: float = 0.05
    max_trials: int = 8
    max_growth: int = 16  # the most copies of the workload one trial may replay to load the deployment

    def __post_init__(self) -> None:
        if not 0 < self.target <= 1:
            raise ValueError(f"target attainment must be in (0, 1], got {self.target}")
        if not self.rel_tol > 0:
            raise ValueError(f"rel_tol must be > 0, got {self.rel_tol}")
        if self.max_trials < 1:
            raise ValueError(f"max_trials must be >= 1, got {self.max_trials}")
        if self.max_growth < 1:
            raise ValueError(f"max_growth must be >= 1, got {self.max_growth}")


@dataclass
class GoodputResult:
    """Every (rate, attainment) measured, and the goodput they support (``None``: no rate passed, or
    none failed: then ``lower_bound`` is the highest that passed)."""

    target: float
    trials: list[tuple[float, float]] = field(default_factory=list)
    goodput: float | None = None
    first_fail: float | None = None
    lower_bound: float | None = None  # the highest loaded pass below the first failure
    unloaded: list[float] = field(default_factory=list)  # rates that passed without loading it
    requests: dict[float, int] = field(default_factory=dict)  # requests each rate's trial replayed

    @property
    def bounded(self) -> bool:
        """Whether some rate failed: without one, no rate is shown to be too much."""
        return self.first_fail is not None

    def record(self, rate: float, trial: Trial | float) -> bool:
        """Adds ``rate``'s trial; whether it passed (met the target and loaded the deployment)."""
        t = trial if isinstance(trial, Trial) else Trial(trial)
        self.trials.append((rate, t.attainment))
        if t.requests:
            self.requests[rate] = t.requests
        if t.attainment >= self.target and not t.loaded:
            self.unloaded.append(rate)
        return self.passed(rate, t.attainment)

    def passed(self, rate: float, attainment: float) -> bool:
        return attainment >= self.target and rate not in self.unloaded

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
            "bounded": self.bounded,
            "lower_bound_rps": self.lower_bound,
            "unloaded_rps": sorted(self.unloaded),
            "trials": [{"rate": r, "attainment": a, "requests": self.requests.get(r), "loaded": r not in
                        self.unloaded} for r, a in sorted(self.trials)],  # fmt: skip
        }

    def describe(self) -> str:
        """The goodput in words, saying plainly when there is none."""
        if self.goodput is not None:
            return f"{self.goodput:g} req/s"
        if self.lower_bound is not None:
            most = max(self.requests.values(), default=0)
            return (f"not bounded: every rate tried up to {max(r for r, _ in self.trials):g} req/s met the "
                    f"target (at least {self.lower_bound:g} req/s, trials of up to {most} requests); "
                    "replay more requests or allow more growth")  # fmt: skip
        if self.unloaded and not self.bounded:
            return "not bounded: no trial loaded the deployment; replay more requests or allow more growth"
        return "none: no rate tried met the target"


def settle(res: GoodputResult) -> GoodputResult:
    """Goodput = highest passing rate below the lowest failing rate, if some rate failed; unloaded
    passes count as neither."""
    fails = sorted(r for r, a in res.trials if a < res.target)
    res.first_fail = fails[0] if fails else None
    passes = [r for r, a in res.trials if res.passed(r, a) and (res.first_fail is None or r < res.first_fail)]
    res.lower_bound = max(passes) if passes else None
    res.goodput = res.lower_bound if res.bounded else None
    return res


def grown(run: Run, cfg: SearchConfig) -> Measure:
    """``Measure`` from ``run``: a trial that meets the target without loading the deployment is run
    again with the workload repeated, as many copies as its tail says it needs (at least twice as
    many, at most ``cfg.max_growth``), until it misses the target, loads it, or may not grow."""

    async def measure(rate: float) -> Trial:
        copies = 1
        trial = await run(rate, copies)
        while trial.attainment >= cfg.target and not trial.loaded and copies < cfg.max_growth:
            need = trial.tail_s / (LOAD_TAIL * trial.span_s) if trial.span_s > 0 else math.inf
            copies = min(cfg.max_growth, max(2 * copies, math.ceil(copies * min(need, 1e6))))
            trial = await run(rate, copies)
        return trial

    return measure


async def sweep(measure: Measure, rates: list[float], target: float = 0.9) -> GoodputResult:
    """Measure each rate in increasing order (stopping after two failures in a row)."""
    res = GoodputResult(target=target)
    fails_in_row = 0
    for rate in sorted(rates):
        res.record(rate, await measure(rate))
        fails_in_row = fails_in_row + 1 if res.trials[-1][1] < target else 0
        if fails_in_row >= 2:
            break
    return settle(res)


async def bisect(
    measure: Measure, lo: float, hi: float, cfg: SearchConfig, prior: GoodputResult | None = None
) -> GoodputResult:
    """Bracket and bisect the goodput; ``prior`` trials (e.g. from a sweep) are reused, not re-run."""
    if not 0 < lo < hi:
        raise ValueError(f"need 0 < lo < hi, got lo={lo} hi={hi}")
    res = GoodputResult(target=cfg.target)
    if prior is not None:
        res.trials, res.unloaded = list(prior.trials), list(prior.unloaded)
        res.requests = dict(prior.requests)
    known = dict(res.trials)
    budget = cfg.max_trials

    async def passes(rate: float) -> bool:
        nonlocal budget
        if rate not in known:
            budget -= 1
            res.record(rate, await measure(rate))
            known[rate] = res.trials[-1][1]
        return res.passed(rate, known[rate])

    while not await passes(lo) and budget > 0:
        lo, hi = lo / 2, lo
    if res.passed(lo, known[lo]):
        while budget > 0 and await passes(hi):
            lo, hi = hi, hi * 2
        while budget > 0 and hi / lo - 1 > cfg.rel_tol and not res.passed(hi, known.get(hi, 0.0)):
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
    sub = SearchConfig(target=cfg.target, rel_tol=cfg.rel_tol, max_trials=left, max_growth=cfg.max_growth)
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
