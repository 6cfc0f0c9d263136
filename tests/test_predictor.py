"""Latency prediction and route ranking on synthetic profiles (no processes)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import pytest

from pdfabric.profile import WorkerProfile
from pdfabric.router.routing.predictor import rank
from pdfabric.router.routing.routes import (
    BATCH_FULL,
    ITL,
    KV_FULL,
    NO_WORKERS,
    TTFT,
    TTFT_UNREACHABLE,
    Budgets,
    Candidate,
    Choice,
    WorkerLoad,
)
from pdfabric.routing_config import PredictorConfig

# prefill: 2 ms a step + 40 us a token (+ attention); decode: 5 ms + 0.1 ms a sequence + 0.2 us a token
PROFILE = WorkerProfile(prefill=(2e-3, 4e-5, 1e-8), decode=(5e-3, 1e-4, 2e-7))
EXACT = PredictorConfig(safety_margin=0.0)
KV_PER_TOKEN = 100_000


def worker(
    wid: str, kind: str, pool: str = "default", max_batch: int = 64, cost: float = 1.0, **load: float
) -> Candidate:
    defaults = {"free_kv_tokens": 1_000_000}
    return Candidate(
        wid, kind, pool, PROFILE, WorkerLoad(**{**defaults, **load}), max_batch, 512, KV_PER_TOKEN, cost
    )


def test_ttft_and_itl_are_the_sum_of_their_parts() -> None:
    cands = [
        worker("p", "prefill", queued_tokens=2048, waiting=2, kv_bytes_per_s=2e9),
        worker("d", "decode", running=10, context_tokens=5000, kv_bytes_per_s=1e9),
    ]
    (best,) = rank(1000, Budgets(10_000, 100), cands, EXACT).choices
    a, b, c = PROFILE.prefill
    assert best.queue_ms == pytest.approx((4 * a + b * 2048 + c * 2 * 1024 * 1025 / 2) * 1e3)
    assert best.prefill_ms == pytest.approx((2 * a + b * 1000 + c * 1000 * 1001 / 2) * 1e3)
    assert best.transfer_ms == pytest.approx(1000 * KV_PER_TOKEN / 1e9 * 1e3)  # the slower end
    assert best.ttft_ms == pytest.approx(best.queue_ms + best.prefill_ms + best.transfer_ms)
    assert best.itl_ms == pytest.approx(PROFILE.decode_step_seconds(11, 6000) * 1e3)
    assert not best.colocated and (best.decode, best.prefill) == ("d", "p")
    margin = rank(1000, Budgets(10_000, 100), cands, PredictorConfig(safety_margin=0.2)).choices[0]
    assert margin.ttft_ms == pytest.approx(1.2 * best.ttft_ms)
    assert margin.itl_ms == pytest.approx(1.2 * best.itl_ms)


def test_tight_itl_lands_on_the_small_batch_pool() -> None:
    cands = [
        worker("p", "prefill"),
        worker("small", "decode", pool="tight", max_batch=4, cost=3.0, running=2, context_tokens=2000),
        worker("big", "decode", pool="bulk", max_batch=256, running=200, context_tokens=200_000),
    ]
    itl_big = PROFILE.decode_step_seconds(201, 200_000 + 500) * 1e3  # ~65 ms
    tight = rank(500, Budgets(1000, 20), cands, EXACT)
    assert [c.decode for c in tight.choices] == ["small"]
    loose = rank(500, Budgets(1000, itl_big + 1), cands, EXACT)
    assert [c.decode for c in loose.choices] == ["big", "small"]  # the cheaper pool first


def test_less_loaded_first_and_equals_spread_reproducibly() -> None:
    cands = [
        worker("p", "prefill"),
        worker("d0", "decode", running=5, context_tokens=5000),
        worker("d1", "decode", running=5, context_tokens=5000),
        worker("d2", "decode", running=60, context_tokens=60_000),
    ]
    budgets = Budgets(1000, 30)
    firsts = Counter(rank(100, budgets, cands, EXACT, turn).choices[0].decode for turn in range(200))
    assert set(firsts) == {"d0", "d1"} and min(firsts.values()) > 60
    for turn in range(20):
        assert rank(100, budgets, cands, EXACT, turn).choices[-1].decode == "d2"
    def firsts_of(config: PredictorConfig) -> list[str]:
        return [rank(100, budgets, cands, config, turn).choices[0].decode for turn in range(30)]

    seq1 = firsts_of(EXACT)
    assert seq1 == firsts_of(EXACT)  # reproducible for a seed
    assert seq1 != firsts_of(PredictorConfig(safety_margin=0.0, seed=5))


def test_ttft_over_budget_reports_the_drain_and_cannot_wait() -> None:
    cands = [worker("p", "prefill", queued_tokens=20_000, waiting=20), worker("d", "decode")]
    no_cap = PredictorConfig(safety_margin=0.0, max_queue_share=1.0)
    full = rank(500, Budgets(100_000, 100), cands, no_cap).choices[0]
    budget = full.ttft_ms - 200
    ranking = rank(500, Budgets(budget, 100), cands, no_cap)
    assert not ranking.fits and ranking.reason == TTFT and not ranking.unreachable
    assert ranking.drain_ms == pytest.approx(200)  # a new request fits once 200 ms of queue is done
    assert math.isinf(ranking.wait_ms)  # waiting eats this request's own TTFT budget
    assert ranking.reasons == ((TTFT, 1),)
    # with the default cap, a new request also waits until the queue ahead is within half its budget
    capped = rank(500, Budgets(budget, 100), cands, EXACT)
    assert capped.drain_ms == pytest.approx(full.queue_ms - 0.5 * budget)


def test_queue_share_keeps_worker_queues_short() -> None:
    cands = [worker("p", "prefill", queued_tokens=2000, waiting=2), worker("d", "decode")]
    free = rank(100, Budgets(10_000, 100), cands, EXACT).choices[0]
    budget = free.ttft_ms * 1.5  # TTFT fits, but the queue ahead is over half of the budget
    config = PredictorConfig(safety_margin=0.0, max_queue_share=0.5)
    ranking = rank(100, Budgets(budget, 100), cands, config)
    assert not ranking.fits and ranking.reason == TTFT
    excess = free.queue_ms - 0.5 * budget
    assert ranking.drain_ms == pytest.approx(excess)
    assert ranking.wait_ms == pytest.approx(excess / 0.5)  # the budget shrinks while it waits
    assert rank(100, Budgets(budget, 100), cands, PredictorConfig(safety_margin=0, max_queue_share=1)).fits


def test_full_decode_batch_and_kv_give_a_finite_drain() -> None:
    p = worker("p", "prefill")
    full = worker("d", "decode", max_batch=8, running=8, context_tokens=8000)
    ranking = rank(100, Budgets(1000, 100), [p, full], EXACT)
    assert ranking.reason == BATCH_FULL and 0 < ranking.drain_ms < math.inf and ranking.wait_ms < math.inf
    # one of 8 sequences must finish: 2 * 128 / 8 steps of the current batch
    assert ranking.drain_ms == pytest.approx(2 * 128 / 8 * PROFILE.decode_step_seconds(8, 8000) * 1e3)
    no_kv = worker("d", "decode", running=8, context_tokens=8000, free_kv_tokens=50)
    assert rank(100, Budgets(1000, 100), [p, no_kv], EXACT).reason == KV_FULL
    slow = worker("d", "decode", running=60, context_tokens=60_000)
    ranking = rank(100, Budgets(1000, 15), [p, slow], EXACT)
    assert ranking.reason == ITL and ranking.drain_ms > 0


def test_unreachable_and_empty() -> None:
    cands = [worker("p", "prefill"), worker("d", "decode")]
    ranking = rank(4000, Budgets(5, 100), cands, EXACT)
    assert ranking.unreachable and ranking.reason == TTFT_UNREACHABLE and math.isinf(ranking.drain_ms)
    ranking = rank(10, Budgets(1000, 1), cands, EXACT)
    assert ranking.unreachable and ranking.reason == "itl_unreachable"
    assert rank(10, Budgets(1000, 100), [], EXACT).reason == NO_WORKERS
    assert rank(10, Budgets(1000, 100), [worker("p", "prefill")], EXACT).reason == NO_WORKERS


def test_colocated_itl_carries_prefill_chunks_as_often_as_prompts_arrive() -> None:
    load = {"running": 10, "context_tokens": 10_000}

    def itls(rate: float, config: PredictorConfig = EXACT) -> tuple[Choice, Choice]:
        colocated = worker("c", "colocated", **load, prompt_tokens_per_s=rate)
        cands = [worker("p", "prefill"), worker("d", "decode", **load), colocated]
        choices = {c.decode: c for c in rank(100, Budgets(10_000, 1000), cands, config).choices}
        return choices["c"], choices["d"]

    colo, disagg = itls(0.0)  # no prompts arriving: its decode steps carry none
    assert colo.colocated and colo.transfer_ms == 0 and colo.prefill == "c"
    assert colo.itl_ms == pytest.approx(disagg.itl_ms)
    chunk = 512 - 11
    decode_s, chunk_s = disagg.itl_ms / 1e3, PROFILE.prefill_seconds(chunk, chunk)
    saturated, _ = itls(10 * chunk / chunk_s)  # prefill alone would need 10x the worker's time
    assert saturated.itl_ms == pytest.approx((decode_s + chunk_s) * 1e3)  # a chunk in every step
    rate = 0.2 * chunk / chunk_s  # prefill takes a fifth of the worker's time: mean step d / (1 - 0.2)
    moderate, _ = itls(rate)
    assert moderate.itl_ms == pytest.approx(decode_s / 0.8 * 1e3)
    capped, _ = itls(10 * chunk / chunk_s, PredictorConfig(safety_margin=0.0, colocated_prefill_share=0.0))
    assert capped.itl_ms == pytest.approx(disagg.itl_ms)
    colo = saturated
    # prompt chunks share each step with the 10 decoding sequences
    steps = math.ceil(100 / (512 - 10))
    assert colo.prefill_ms == pytest.approx(
        (PROFILE.prefill_seconds(100, 502) + steps * PROFILE.decode_step_seconds(10, 10_000)) * 1e3
    )
    busy = worker("c", "colocated", **load, prompt_tokens_per_s=10 * chunk / chunk_s)
    cands = [worker("p", "prefill"), worker("d", "decode", **load), busy]
    tight = rank(100, Budgets(10_000, disagg.itl_ms + 1), cands, EXACT)
    assert [c.decode for c in tight.choices] == ["d"]


def test_loads_count_what_the_router_sent_since() -> None:
    load = WorkerLoad(queued_tokens=10, running=2, waiting=1, context_tokens=300, free_kv_tokens=1000)
    assert load.with_prefill(50) == WorkerLoad(60, 2, 2, 300, 1000)
    assert load.with_decode(50) == WorkerLoad(10, 2, 2, 350, 950)


def test_a_pair_transfers_at_the_rate_measured_over_its_own_transport() -> None:
    """Shared memory between workers on one host, ZeroMQ across hosts; the overall rate when the pair's
    transport was never measured, the default when nothing was."""
    rates = {"shm": 8e9, "zmq": 1e9}
    p = replace(worker("p", "prefill", kv_bytes_per_s=4e9), host="a", kv_rates=rates)
    near, far = (replace(worker(w, "decode"), host=h) for w, h in (("near", "a"), ("far", "b")))
    got = {c.decode: c.transfer_ms for c in rank(1000, Budgets(60_000, 100), [p, near, far], EXACT).choices}
    ms = 1000 * KV_PER_TOKEN * 1e3  # the prompt's KV bytes, in milliseconds at 1 byte/s
    assert got == pytest.approx({"near": ms / 8e9, "far": ms / 1e9})
    unmeasured = replace(p, kv_rates={"shm": 8e9})
    [c] = rank(1000, Budgets(60_000, 100), [unmeasured, far], EXACT).choices
    assert c.transfer_ms == pytest.approx(ms / 4e9)  # the overall rate
    [c] = rank(1000, Budgets(60_000, 100), [worker("p", "prefill"), far], EXACT).choices
    assert c.transfer_ms == pytest.approx(ms / EXACT.default_kv_bytes_per_s)


def test_invalid_inputs() -> None:
    for bad in (0, -1, float("nan"), float("inf"), True, "5"):
        with pytest.raises(ValueError, match="ttft_ms"):
            Budgets(bad, 10)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kind"):
        worker("x", "router")
    with pytest.raises(ValueError, match="max_batch"):
        worker("x", "decode", max_batch=0)
    with pytest.raises(ValueError, match="max_queue_share"):
        PredictorConfig(max_queue_share=0)
    with pytest.raises(ValueError, match="prompt_len"):
        rank(0, Budgets(10, 10), [], EXACT)


def test_a_decode_worker_holding_most_of_the_prompt_may_prefill_the_rest_itself() -> None:
    """A decode worker that caches all but a short rest of the prompt is also ranked as a route of its
    own (a colocated choice: no KV moves); it wins when its TTFT is lower, and is not offered when the
    rest is longer than ``local_prefill_tokens`` or the setting is 0."""
    prefill = worker("p", "prefill", kv_bytes_per_s=1e8)  # a slow link: moving KV costs
    holder = replace(worker("d", "decode", running=4, context_tokens=4000), cached_tokens=960)
    budgets = Budgets(10_000, 100)
    choices = rank(1000, budgets, [prefill, holder], EXACT).choices
    assert [(c.decode, c.prefill, c.colocated) for c in choices] == [("d", "d", True), ("d", "p", False)]
    local, remote = choices
    assert local.local_prefill and not remote.local_prefill and local.cached_tokens == 960
    assert local.transfer_ms == 0 and local.ttft_ms < remote.ttft_ms
    assert remote.transfer_ms == pytest.approx(40 * KV_PER_TOKEN / 1e8 * 1e3)  # only the rest moves
    short = PredictorConfig(safety_margin=0.0, local_prefill_tokens=39)
    assert [c.colocated for c in rank(1000, budgets, [prefill, holder], short).choices] == [False]
    never = PredictorConfig(safety_margin=0.0, local_prefill_tokens=0)
    assert [c.colocated for c in rank(1000, budgets, [prefill, holder], never).choices] == [False]
    cold = replace(holder, cached_tokens=0)  # nothing cached: a short prompt still goes through prefill
    assert [c.colocated for c in rank(30, budgets, [prefill, cold], EXACT).choices] == [False]
    with pytest.raises(ValueError, match="local_prefill_tokens"):
        PredictorConfig(local_prefill_tokens=-1)


def test_a_speculating_worker_s_itl_is_its_step_over_its_measured_speed_up() -> None:
    plain = worker("d", "decode", running=1, context_tokens=500)
    fast = replace(plain, speculate_below=2, load=replace(plain.load, speculation=2.5))
    prefill = worker("p", "prefill", kv_bytes_per_s=2e9)

    def itl(decode: Candidate) -> float:
        return rank(1000, Budgets(10_000, 100), [prefill, decode], EXACT).choices[0].itl_ms

    step = PROFILE.decode_step_seconds(2, 1500) * 1e3  # with the new sequence: 2 decoding
    assert itl(plain) == pytest.approx(step) and itl(fast) == pytest.approx(step / 2.5)
    # above speculate_below the worker decodes plainly
    busy = replace(fast, load=replace(fast.load, running=2, context_tokens=1000))
    assert itl(busy) == pytest.approx(PROFILE.decode_step_seconds(3, 2000) * 1e3)
    # a colocated worker's decode share is divided alike
    co = worker("c", "colocated", running=1, context_tokens=500)
    co_fast = replace(co, speculate_below=4, load=replace(co.load, speculation=2.0))
    a = rank(1000, Budgets(10_000, 100), [co], EXACT).choices[0].itl_ms
    b = rank(1000, Budgets(10_000, 100), [co_fast], EXACT).choices[0].itl_ms
    assert b == pytest.approx(a - step / 2)  # no prompt rate: the decode step is the whole gap
