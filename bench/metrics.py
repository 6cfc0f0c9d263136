"""Latency percentiles, SLO attainment and throughput from replayed request records.

Definitions (all latencies as the client saw them, in ms):

- TTFT: from sending the request to the first token event.
- ITL: every inter-token gap of every ok request, pooled (see ``pdfabric.bench.sse`` for how gaps are
  derived when a chunk carries several tokens). TPOT: one value per request, the mean of its gaps.
- E2E: from sending the request to the end of its stream.
- A request *meets the SLO* when its status is ok, its TTFT is within the TTFT SLO and its ITL statistic
  (``SLO.itl_stat``: the mean of its gaps by default, i.e. its TPOT, as DistServe defines the decode SLO;
  or its p50 / p90 / p99 / max gap) is within the ITL SLO. A request with a single token has no gaps
  and is judged on TTFT alone. Rejected, failed and timed-out requests count as misses.
- Attainment: the fraction of requests that meet the SLO, out of every request the run finished
  (cancelled requests, stopped by Ctrl-C or the run's time bound, are left out; so are unsent ones).
- Prefix-cache hit rate: the prompt tokens the server reported as cached
  (``usage.prompt_tokens_details.cached_tokens``) over the prompt tokens of the ok requests it
  reported them for.

Percentiles interpolate linearly between order statistics (numpy's default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pdfabric.bench.records import CANCELLED, OK, STATUSES, RequestRecord

ITL_STATS = ("mean", "p50", "p90", "p99", "max")


@dataclass(frozen=True)
class SLO:
    """A TTFT and an ITL target; ``itl_stat`` says which per-request ITL statistic is compared."""

    ttft_ms: float
    itl_ms: float
    itl_stat: str = "mean"

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "itl_ms"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} SLO must be a finite number > 0, got {value}")
        if self.itl_stat not in ITL_STATS:
            raise ValueError(f"itl_stat must be one of {ITL_STATS}, got {self.itl_stat!r}")

    def scaled(self, factor: float) -> SLO:
        """Both targets times ``factor`` (the SLO-scale sweep)."""
        return SLO(self.ttft_ms * factor, self.itl_ms * factor, self.itl_stat)

    def to_json(self) -> dict[str, Any]:
        return {"ttft_ms": self.ttft_ms, "itl_ms": self.itl_ms, "itl_stat": self.itl_stat}


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100), interpolating linearly as numpy does; ``None`` for no values."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def distribution(values: list[float]) -> dict[str, float | int | None]:
    """count, mean, p50, p90, p99 and max, rounded to microseconds."""

    def r(x: float | None) -> float | None:
        return None if x is None else round(x, 3)

    return {
        "count": len(values),
        "mean": r(sum(values) / len(values)) if values else None,
        "p50": r(percentile(values, 50)),
        "p90": r(percentile(values, 90)),
        "p99": r(percentile(values, 99)),
        "max": r(max(values)) if values else None,
    }


def itl_value(rec: RequestRecord, stat: str) -> float | None:
    """The request's ITL statistic, ``None`` when it has no gaps."""
    if not rec.itl_ms:
        return None
    if stat == "mean":
        return sum(rec.itl_ms) / len(rec.itl_ms)
    if stat == "max":
        return max(rec.itl_ms)
    return percentile(rec.itl_ms, float(stat[1:]))


def required_scale(rec: RequestRecord, slo: SLO) -> float:
    """The smallest SLO scale at which this request meets the SLO (``inf`` if it never can)."""
    if rec.status != OK or rec.ttft_ms is None:
        return math.inf
    itl = itl_value(rec, slo.itl_stat)
    return max(rec.ttft_ms / slo.ttft_ms, 0.0 if itl is None else itl / slo.itl_ms)


def meets_slo(rec: RequestRecord, slo: SLO) -> bool:
    return required_scale(rec, slo) <= 1.0


def counted(records: list[RequestRecord]) -> list[RequestRecord]:
    """The records that count for attainment: every finished request (not the cancelled ones)."""
    return [r for r in records if r.status != CANCELLED]


def attainment(records: list[RequestRecord], slo: SLO) -> float | None:
    """Fraction of counted requests that meet ``slo``; ``None`` when none were counted."""
    pool = counted(records)
    if not pool:
        return None
    return sum(meets_slo(r, slo) for r in pool) / len(pool)


def summarize(records: list[RequestRecord], slo: SLO, not_sent: int = 0) -> dict[str, Any]:
    """The headline numbers of one run, as stored in ``report.json``."""
    ok = [r for r in records if r.status == OK]
    pool = counted(records)
    by_status = {s: sum(r.status == s for r in records) for s in STATUSES}
    requests = {"total": len(records), **by_status, "not_sent": not_sent}
    starts = [r.sent_s for r in records]
    ends = [r.sent_s + (r.e2e_ms or 0.0) / 1000.0 for r in records]
    duration = (max(ends) - min(starts)) if records else 0.0
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.input_len for r in ok)

    def per_s(x: float) -> float | None:
        return round(x / duration, 4) if duration > 0 else None

    met_ttft = sum(r.status == OK and r.ttft_ms is not None and r.ttft_ms <= slo.ttft_ms for r in pool)
    met_itl = sum(r.status == OK and (itl_value(r, slo.itl_stat) or 0.0) <= slo.itl_ms for r in pool)
    att = attainment(records, slo)
    return {
        "requests": requests,
        "ttft_ms": distribution([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        "itl_ms": distribution([g for r in ok for g in r.itl_ms]),
        "tpot_ms": distribution([t for r in ok if (t := r.tpot_ms) is not None]),
        "e2e_ms": distribution([r.e2e_ms for r in ok if r.e2e_ms is not None]),
        "send_lateness_ms": distribution([r.lateness_ms for r in records]),
        "duration_s": round(duration, 3),
        "throughput": {
            "requests_per_s": per_s(len(ok)),
            "output_tokens_per_s": per_s(out_tokens),
            "input_tokens_per_s": per_s(in_tokens),
            "offered_requests_per_s": per_s(len(records)),
        },
        "slo": slo.to_json(),
        "attainment": None if att is None else round(att, 4),
        "attainment_ttft_only": round(met_ttft / len(pool), 4) if pool else None,
        "attainment_itl_only": round(met_itl / len(pool), 4) if pool else None,
        "short_outputs": sum(r.output_tokens < r.output_len for r in ok),
        "token_counts_from_usage": sum(r.token_count_source == "usage" for r in ok),
        "prefix_cache": prefix_cache(ok),
    }


def prefix_cache(ok: list[RequestRecord]) -> dict[str, Any] | None:
    """Prompt tokens the server said came from its prefix cache (``usage.prompt_tokens_details``), over
    the ok requests it said it for; ``None`` when it said it for none."""
    said = [r for r in ok if r.cached_tokens is not None]
    if not said:
        return None
    prompt, cached = sum(r.input_len for r in said), sum(r.cached_tokens or 0 for r in said)
    return {
        "requests": len(said),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": round(cached / prompt, 4) if prompt else None,
    }
