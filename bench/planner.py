"""The prefill:decode planner: which deployment of measured workers serves a workload best.

A candidate is a deployment shape: ``p`` prefill + ``d`` decode workers, or ``c`` colocated ones,
with a decode batch cap (``max_running``) and a chunk budget (``max_batch_tokens``). Its goodput is
found as ``pdfabric bench goodput`` finds a server's (``bench.goodput``: sweep and bisection, same
settle rule, the same growth of a workload too small to load it), but each trial is a simulation
(``bench.simulator``) of the workload, repeated as needed, rescaled to the trial's rate
(``Workload.with_rate``), judged with ``bench.metrics`` (same SLO and ITL statistic). A candidate
whose search never missed the target has no goodput, only a lower bound, and is never chosen.

1. ``candidates(W)``: every split ``p + d = W`` (p, d >= 1) and ``W`` colocated, times each cap;
2. ``evaluate``: a candidate's goodput search, keeping each trial's records;
3. ``plan_for_workers(W)`` picks the candidate with the highest goodput; ``plan_for_rate(R)`` the
   fewest workers whose best candidate meets the attainment target at ``R`` (highest goodput among
   those that do).

Pure: no processes, no files; the simulator is a parameter so tests can replace it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdfabric.bench.goodput import GoodputResult, Measure, Trial, find_goodput, grown, settle
from pdfabric.bench.metrics import SLO, summarize
from pdfabric.bench.plan_space import (
    Candidate,
    PlanSettings,
    candidates,
    caps,
    check_profiles,
    deployment,
    profile_for,
)
from pdfabric.bench.records import RequestRecord
from pdfabric.bench.workload import Workload
from pdfabric.config import ServeConfig
from pdfabric.profile_file import ProfileFile

# (deployment, workload at one rate) -> one record per request
Simulate = Callable[[ServeConfig, Workload], list[RequestRecord]]


@dataclass
class Evaluation:
    """A candidate's search: every trial's attainment and records, the goodput, and the headline
    numbers at ``at_rate`` (the goodput, or the rate asked for)."""

    candidate: Candidate
    result: GoodputResult
    records: dict[float, list[RequestRecord]] = field(default_factory=dict)
    at_rate: float | None = None

    @property
    def goodput(self) -> float | None:
        return self.result.goodput

    @property
    def bounded_or_lower(self) -> str:
        """The goodput as a table cell: the rate, ``>= R`` when not bounded, else ``-``."""
        if self.result.goodput is not None:
            return f"{self.result.goodput:.3g}"
        return f">={self.result.lower_bound:.3g}" if self.result.lower_bound is not None else "-"

    @property
    def goodput_per_worker(self) -> float | None:
        g = self.result.goodput
        return None if g is None else g / self.candidate.workers

    def stats(self, slo: SLO) -> dict[str, Any]:
        """Attainment and p90 TTFT / ITL (pooled gaps, as the bench reports them) at ``at_rate``."""
        recs = self.records.get(self.at_rate) if self.at_rate is not None else None
        if not recs:
            return {"attainment": None, "ttft_p90_ms": None, "itl_p90_ms": None}
        s = summarize(recs, slo)
        return {"attainment": s["attainment"], "ttft_p90_ms": s["ttft_ms"]["p90"],
                "itl_p90_ms": s["itl_ms"]["p90"]}  # fmt: skip

    def to_json(self, slo: SLO) -> dict[str, Any]:
        c = self.candidate
        return {
            "name": c.name, "prefill": c.prefill, "decode": c.decode, "colocated": c.colocated,
            "workers": c.workers, "max_running": c.max_running, "chunk_tokens": c.chunk_tokens,
            "goodput_rps": self.goodput, "goodput_per_worker": self.goodput_per_worker,
            "goodput": self.result.to_json(), "at_rate_rps": self.at_rate, **self.stats(slo),
        }  # fmt: skip


@dataclass
class Plan:
    """Every evaluated candidate (in evaluation order) and the chosen one (``None``: none passed)."""

    evaluations: list[Evaluation]
    best: Evaluation | None
    rate: float | None = None  # rate mode: the rate asked for
    notes: list[str] = field(default_factory=list)


def default_simulate(profiles: Sequence[ProfileFile], transport: str | None) -> Simulate:
    """``bench.simulator.simulate`` of ``bench.sim_deploy.sim_config(deployment, profiles)``."""
    from pdfabric.bench.sim_deploy import sim_config
    from pdfabric.bench.simulator import simulate

    return lambda serve, workload: simulate(sim_config(serve, profiles, transport), workload)


def capacity_estimate(candidate: Candidate, profiles: Sequence[ProfileFile], workload: Workload) -> float:
    """A rough request rate the candidate can sustain (full batches, no queueing), in req/s: the
    search's starting bracket, nothing more."""
    n = len(workload.requests)
    mean_in = sum(r.input_len for r in workload.requests) / n
    mean_out = sum(r.output_len for r in workload.requests) / n
    b = candidate.max_running
    kinds = ("colocated",) if candidate.colocated else ("prefill", "decode")
    prof = {k: profile_for(profiles, k).profile for k in kinds}  # type: ignore[union-attr]
    # decode time per request, amortised over a full batch
    decode_s = mean_out * prof[kinds[-1]].decode_seconds_per_token(b, mean_in + mean_out / 2)
    prefill_s = prof[kinds[0]].prefill_seconds(round(mean_in), candidate.chunk_tokens)
    if candidate.colocated:
        per = prefill_s + decode_s
        return candidate.colocated / per if per > 0 else 1.0
    rates = [candidate.prefill / prefill_s if prefill_s > 0 else float("inf"),
             candidate.decode / decode_s if decode_s > 0 else float("inf")]  # fmt: skip
    rate = min(rates)
    return rate if 0 < rate < float("inf") else 1.0


def evaluate(
    candidate: Candidate,
    workload: Workload,
    profiles: Sequence[ProfileFile],
    settings: PlanSettings,
    simulate: Simulate,
) -> Evaluation:
    """The candidate's goodput: a sweep of ``settings.rates`` refined by bisection, or a bisection
    from its capacity estimate; every trial a simulation of ``workload`` rescaled to the rate."""
    ev = Evaluation(candidate, GoodputResult(target=settings.search.target))
    cfg = settings.search
    serve = deployment(candidate, profiles, settings)
    measure = trial_measure(serve, workload, settings, simulate, ev.records)
    est = capacity_estimate(candidate, profiles, workload) if not settings.rates else 0.0
    ev.result = settle(asyncio.run(find_goodput(measure, list(settings.rates), (est / 2, est), cfg)))
    ev.at_rate = ev.result.goodput if ev.result.goodput is not None else ev.result.lower_bound
    return ev


def trial_measure(
    serve: ServeConfig,
    workload: Workload,
    settings: PlanSettings,
    simulate: Simulate,
    records: dict[float, list[RequestRecord]],
) -> Measure:
    """The search's ``Measure`` for one deployment: a simulation of ``workload`` at the rate, grown
    (``bench.goodput.grown``) until it misses the target or loads the deployment; ``records`` keeps
    each rate's last run."""

    async def run(rate: float, copies: int) -> Trial:
        records[rate] = simulate(serve, workload.repeated(copies).with_rate(rate))
        return Trial.of(records[rate], settings.slo)

    return grown(run, settings.search)


def _rank(ev: Evaluation) -> tuple[float, float]:
    return (ev.goodput or ev.result.lower_bound or 0.0, ev.result.interpolated or 0.0)


def plan_for_workers(
    workers: int,
    workload: Workload,
    profiles: Sequence[ProfileFile],
    settings: PlanSettings,
    simulate: Simulate | None = None,
    on_done: Callable[[Evaluation, int, int], None] | None = None,
) -> Plan:
    """Every candidate of ``workers`` workers, and the one with the highest goodput (first on ties)."""
    check_profiles(profiles)
    notes: list[str] = []
    caps(profiles, settings, notes)
    sim = simulate or default_simulate(profiles, settings.transport)
    cands = candidates(workers, profiles, settings)
    if not cands:
        raise ValueError(f"no candidate deployment of {workers} worker(s) for these profiles and caps")
    evals = []
    for i, c in enumerate(cands):
        evals.append(evaluate(c, workload, profiles, settings, sim))
        if on_done:
            on_done(evals[-1], i + 1, len(cands))
    passing = [e for e in evals if e.goodput is not None]
    best = max(passing, key=_rank) if passing else None
    notes += _unbounded(evals, chosen=False)
    return Plan(evals, best, notes=notes)


def _unbounded(evals: list[Evaluation], chosen: bool) -> list[str]:
    """Notes for searches that never missed the target: the workload, even grown, was too small to
    load those candidates, so their rate could not be bounded."""
    unbounded = [e for e in evals if not e.result.bounded and (e.result.lower_bound or e.result.unloaded)]
    if not unbounded:
        return []
    most = max((n for e in unbounded for n in e.result.requests.values()), default=0)
    names = ", ".join(f"{e.candidate.name} ({e.bounded_or_lower})" for e in unbounded)
    why = "" if chosen else ", so none of them is chosen"
    return [
        f"{names}: met the target at every rate tried, with trials of up to {most} requests; their "
        f"goodput could not be bounded{why}: give more requests (--num-requests, --max-requests) or "
        "allow more growth (--max-growth)"
    ]


def plan_for_rate(
    rate: float,
    workload: Workload,
    profiles: Sequence[ProfileFile],
    settings: PlanSettings,
    max_workers: int = 16,
    simulate: Simulate | None = None,
    on_done: Callable[[Evaluation, int, int], None] | None = None,
) -> Plan:
    """The fewest workers (1, 2, ... ``max_workers``) whose candidates include one meeting the target
    at ``rate``; among those that do, the one with the highest goodput. Candidates of smaller budgets
    are kept with their attainment at ``rate`` only (no goodput search)."""
    if not rate > 0:
        raise ValueError(f"--rate must be > 0, got {rate}")
    if max_workers < 1:
        raise ValueError(f"--max-workers must be >= 1, got {max_workers}")
    check_profiles(profiles)
    notes: list[str] = []
    caps(profiles, settings, notes)
    sim = simulate or default_simulate(profiles, settings.transport)
    evals: list[Evaluation] = []
    for w in range(1, max_workers + 1):
        cands = candidates(w, profiles, settings)
        meets = []
        for i, c in enumerate(cands):
            records: dict[float, list[RequestRecord]] = {}
            measure = trial_measure(deployment(c, profiles, settings), workload, settings, sim, records)
            one = GoodputResult(settings.search.target)
            met = one.record(rate, asyncio.run(measure(rate)))  # loaded, or it counts as not met
            ev = Evaluation(c, settle(one), records, rate)
            if met:
                full = evaluate(c, workload, profiles, settings, sim)
                full.records.setdefault(rate, records[rate])
                if rate not in dict(full.result.trials):
                    full.result.record(rate, Trial.of(records[rate], settings.slo))
                ev = Evaluation(c, settle(full.result), full.records, rate)
                meets.append(ev)
            evals.append(ev)
            if on_done:
                on_done(ev, i + 1, len(cands))
        if meets:
            return Plan(evals, max(meets, key=_rank), rate, notes + _unbounded(meets, chosen=True))
    notes.append(f"no deployment of up to {max_workers} workers meets the target at {rate:g} req/s")
    return Plan(evals, None, rate, notes)
