"""Metric math on hand-made records: percentiles, the token-spreading rule, SLO attainment (with
rejected, failed and cancelled requests), the SLO-scale sweep and the goodput rate search."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import numpy as np
import pytest

from pdfabric.bench.goodput import SearchConfig, bisect, min_slo_scale, slo_scale_sweep, sweep
from pdfabric.bench.metrics import SLO, attainment, itl_value, meets_slo, percentile, summarize
from pdfabric.bench.records import CANCELLED, ERROR, OK, REJECTED, TIMEOUT, RequestRecord
from pdfabric.bench.sse import chunk_text, iter_events, spread_tokens


def rec(i: int, status: str = OK, ttft: float = 100.0, itl: list[float] | None = None) -> RequestRecord:
    """A finished request; failed ones carry no token timings."""
    gaps = [20.0] * 4 if itl is None else itl
    if status != OK:
        return RequestRecord(index=i, scheduled_s=i * 0.1, sent_s=i * 0.1, input_len=10, output_len=5,
                             status=status, e2e_ms=5.0)
    return RequestRecord(index=i, scheduled_s=i * 0.1, sent_s=i * 0.1 + 0.001, input_len=10, output_len=5,
                         status=status, ttft_ms=ttft, e2e_ms=ttft + sum(gaps), output_tokens=len(gaps) + 1,
                         itl_ms=gaps)


def test_percentile_matches_numpy() -> None:
    rng = random.Random(0)
    xs = [rng.expovariate(1.0) for _ in range(101)]
    for q in (0, 1, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([], 50) is None and percentile([3.0], 99) == 3.0


def test_spread_tokens_rule() -> None:
    assert spread_tokens([10.0, 20.0, 35.0], None) == (3, [10.0, 15.0])  # no usage: one token per chunk
    assert spread_tokens([10.0, 20.0, 35.0], 3) == (3, [10.0, 15.0])
    # 7 tokens in 3 chunks: the 6 after the first split 3 + 3 over the two intervals
    n, gaps = spread_tokens([10.0, 40.0, 100.0], 7)
    assert n == 7 and gaps == pytest.approx([10, 10, 10, 20, 20, 20])
    # 6 tokens in 3 chunks: 5 after the first split 3 + 2 (earlier interval takes the remainder)
    n, gaps = spread_tokens([0.0, 30.0, 50.0], 6)
    assert gaps == pytest.approx([10, 10, 10, 10, 10]) and sum(gaps) == pytest.approx(50.0)
    assert spread_tokens([50.0], 4) == (4, [0.0, 0.0, 0.0])  # all arrived in one chunk
    assert spread_tokens([1.0, 2.0, 4.0], 2) == (2, [1.0, 2.0])  # fewer tokens than chunks: as observed
    assert spread_tokens([], 5) == (5, [])


def test_sse_parsing() -> None:
    async def lines() -> AsyncIterator[bytes]:
        for line in [b": comment\n", b"data: {\"choices\": [{\"text\": \"a\"}]}\n", b"\n", b"event: x\n",
                     b"data: {\"choices\": [],\n", b"data: \"usage\": {\"completion_tokens\": 2}}\n", b"\r\n",
                     b"data: [DONE]\n", b"\n", b"data: {\"never\": 1}\n", b"\n"]:
            yield line

    async def collect() -> list[dict]:
        return [c async for c in iter_events(lines())]

    chunks = asyncio.run(collect())
    assert len(chunks) == 2 and chunk_text(chunks[0]) == "a" and chunks[1]["usage"]["completion_tokens"] == 2
    assert chunk_text({"choices": [{"delta": {"content": "hi"}}]}) == "hi" and chunk_text({}) == ""


def test_attainment_counts_rejected_and_failed_as_misses() -> None:
    slo = SLO(ttft_ms=200, itl_ms=50)
    records = [rec(0), rec(1), rec(2, ttft=300.0), rec(3, itl=[10, 10, 200]), rec(4, REJECTED), rec(5, ERROR),
               rec(6, TIMEOUT), rec(7, CANCELLED), rec(8), rec(9)]
    # 9 counted (not the cancelled one); 0, 1, 8, 9 meet; 2 misses TTFT, 3 misses ITL, 4-6 failed
    assert not meets_slo(records[3], slo)  # mean gap 73.3 ms > 50
    assert meets_slo(records[3], SLO(200, 50, itl_stat="p50"))  # median gap 10 ms
    assert attainment(records, slo) == pytest.approx(4 / 9)  # 0, 1, 8, 9 meet
    s = summarize(records, slo, not_sent=3)
    assert s["requests"] == {"total": 10, "ok": 6, "rejected": 1, "error": 1, "timeout": 1, "cancelled": 1,
                             "not_sent": 3}
    assert s["attainment"] == pytest.approx(4 / 9, abs=1e-4)
    assert s["attainment_ttft_only"] == pytest.approx(5 / 9, abs=1e-4)
    assert s["ttft_ms"]["count"] == 6 and s["ttft_ms"]["p50"] == 100.0
    assert s["itl_ms"]["count"] == 5 * 4 + 3
    assert attainment([rec(0, CANCELLED)], slo) is None


def test_itl_statistics_and_single_token_requests() -> None:
    r = rec(0, itl=[1.0, 2.0, 3.0, 100.0])
    assert itl_value(r, "mean") == 26.5 and itl_value(r, "max") == 100.0
    assert itl_value(r, "p50") == 2.5
    one = rec(1, itl=[])
    assert itl_value(one, "mean") is None and meets_slo(one, SLO(200, 1))  # judged on TTFT alone
    with pytest.raises(ValueError):
        SLO(0, 10)
    with pytest.raises(ValueError):
        SLO(10, 10, itl_stat="p75")


def test_slo_scale_sweep_known_answer() -> None:
    slo = SLO(ttft_ms=100, itl_ms=10)
    # required scales: TTFT/100 vs mean ITL/10 -> 0.5, 1.0, 2.0, 3.0 and one rejection (never)
    records = [rec(0, ttft=50.0, itl=[1.0]), rec(1, ttft=100.0, itl=[5.0]), rec(2, ttft=20.0, itl=[20.0]),
               rec(3, ttft=300.0, itl=[30.0]), rec(4, REJECTED)]
    pts = dict(slo_scale_sweep(records, slo, [0.5, 1.0, 2.0, 3.0, 100.0]))
    assert pts == {0.5: 0.2, 1.0: 0.4, 2.0: 0.6, 3.0: 0.8, 100.0: 0.8}
    assert min_slo_scale(records, slo, target=0.6) == 2.0
    assert min_slo_scale(records, slo, target=0.8) == 3.0
    assert min_slo_scale(records, slo, target=0.9) is None  # the rejected request can never meet it
    ten = [rec(i, ttft=10.0 * (i + 1), itl=[1.0]) for i in range(10)]
    assert min_slo_scale(ten, slo, target=0.9) == 0.9  # 9 of 10 must meet: the 9th smallest, 90 ms


def _queue_measure(capacity: float, calls: list[float]):
    """Attainment of a synthetic M/D/1-like run: request i's TTFT grows once the rate passes capacity."""
    slo = SLO(ttft_ms=1000, itl_ms=100)

    async def measure(rate: float) -> float:
        calls.append(rate)
        over = max(0.0, rate / capacity - 1.0)
        records = [rec(i, ttft=200.0 + 8000.0 * over * i / 20, itl=[20.0]) for i in range(20)]
        return attainment(records, slo) or 0.0

    return measure


def test_goodput_bisection_finds_the_known_rate() -> None:
    # with capacity 10 req/s: request i misses when 8000 * (r/10 - 1) * i / 20 > 800, i.e. i > 2 / (r/10 - 1);
    # >= 90% (18 of 20 pass, i <= 17) holds while 2 / (r/10 - 1) >= 17, i.e. r <= 10 * (1 + 2/17) = 11.18
    calls: list[float] = []
    cfg = SearchConfig(0.9, rel_tol=0.01, max_trials=20)
    res = asyncio.run(bisect(_queue_measure(10.0, calls), 1.0, 2.0, cfg))
    assert res.goodput is not None and res.first_fail is not None
    assert 11.18 * 0.99 <= res.goodput <= 11.18 + 1e-9 < res.first_fail <= 11.18 * 1.02
    assert len(calls) == len(set(calls)) <= 20  # no rate measured twice
    assert res.to_json()["goodput_rps"] == res.goodput
    assert res.goodput <= res.interpolated <= res.first_fail


def test_goodput_bisection_reaches_down_and_respects_budget() -> None:
    calls: list[float] = []
    cfg = SearchConfig(0.9, rel_tol=0.05, max_trials=3)
    res = asyncio.run(bisect(_queue_measure(1.0, calls), 8.0, 16.0, cfg))
    assert calls == [8.0, 4.0, 2.0] and res.goodput is None and res.first_fail == 2.0
    calls.clear()
    res = asyncio.run(bisect(_queue_measure(1.0, calls), 0.1, 0.2, SearchConfig(0.9, max_trials=6)))
    assert calls[:4] == [0.1, 0.2, 0.4, 0.8] and len(calls) == 6 and res.goodput is not None


def test_sweep_treats_a_pass_after_a_failure_as_noise() -> None:
    table = {1.0: 1.0, 2.0: 0.95, 3.0: 0.5, 4.0: 0.92, 5.0: 0.1, 6.0: 0.0, 7.0: 1.0}

    async def measure(rate: float) -> float:
        return table[rate]

    res = asyncio.run(sweep(measure, list(table), target=0.9))
    assert res.goodput == 2.0 and res.first_fail == 3.0
    assert [r for r, _ in res.trials] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # stops after two failures in a row
    assert res.interpolated == pytest.approx(2.0 + (0.95 - 0.9) / (0.95 - 0.5))
