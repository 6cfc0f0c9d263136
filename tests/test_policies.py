"""The routing policies on synthetic workers (no processes): the budget ranking and the round-robin and
least-loaded baselines behind ``rank_routes``."""

from __future__ import annotations

import math

import pytest

from pdfabric.profile import WorkerProfile
from pdfabric.router.routing.policies import rank_routes
from pdfabric.router.routing.predictor import rank
from pdfabric.router.routing.routes import BATCH_FULL, KV_FULL, NO_WORKERS, Budgets, Candidate, WorkerLoad
from pdfabric.routing_config import (
    BUDGET,
    LEAST_LOADED,
    POLICIES,
    ROUND_ROBIN,
    AdmissionConfig,
    PredictorConfig,
)

# prefill: 2 ms a step + 40 us a token; decode: 5 ms + 1 ms a sequence
PROFILE = WorkerProfile(prefill=(2e-3, 4e-5, 0.0), decode=(5e-3, 1e-3, 0.0))
EXACT = PredictorConfig(safety_margin=0.0)
LOOSE = Budgets(100_000, 10_000)
BASELINES = (ROUND_ROBIN, LEAST_LOADED)


def worker(wid: str, kind: str, max_batch: int = 64, **load: int) -> Candidate:
    load_ = WorkerLoad(**{"free_kv_tokens": 100_000, **load})
    return Candidate(wid, kind, "default", PROFILE, load_, max_batch, 512, 1000)


def routes(policy: str, cands: list[Candidate], budgets: Budgets = LOOSE, turn: int = 0) -> list[str]:
    ranking = rank_routes(policy, 100, budgets, cands, EXACT, turn)
    return [f"{c.prefill}->{c.decode}" for c in ranking.choices]


def test_budget_is_the_predictor_ranking() -> None:
    cands = [worker("p", "prefill"), worker("d0", "decode", running=3), worker("d1", "decode")]
    for turn in range(5):
        assert rank_routes(BUDGET, 100, LOOSE, cands, EXACT, turn) == rank(100, LOOSE, cands, EXACT, turn)


def test_round_robin_cycles_over_every_route_whatever_the_load() -> None:
    cands = [
        worker("p1", "prefill"),
        worker("p0", "prefill", queued_tokens=5000, waiting=10),
        worker("d1", "decode"),
        worker("d0", "decode", running=40, context_tokens=40_000),
        worker("c", "colocated", running=20),
    ]
    order = ["p0->d0", "p0->d1", "p1->d0", "p1->d1", "c->c"]
    firsts = [routes(ROUND_ROBIN, cands, turn=t)[0] for t in range(10)]
    assert firsts == order + order
    assert routes(ROUND_ROBIN, cands, turn=2) == order[2:] + order[:2]  # the rest follow, for fallback


def test_least_loaded_picks_the_emptiest_decode_side_then_the_shortest_prefill_queue() -> None:
    cands = [
        worker("p0", "prefill", queued_tokens=900, waiting=3),
        worker("p1", "prefill", queued_tokens=100, waiting=1),
        worker("d0", "decode", running=5),
        worker("d1", "decode", running=1, waiting=1),
        worker("d2", "decode", waiting=3),
    ]
    got = routes(LEAST_LOADED, cands)
    assert got == ["p1->d1", "p0->d1", "p1->d2", "p0->d2", "p1->d0", "p0->d0"]
    assert all(routes(LEAST_LOADED, cands, turn=t) == got for t in range(5))  # no rotation
    colocated = [worker("c0", "colocated", running=2), worker("c1", "colocated", running=1)]
    assert routes(LEAST_LOADED, colocated)[0] == "c1->c1"


@pytest.mark.parametrize("policy", BASELINES)
def test_baselines_ignore_budgets_but_keep_the_predictions(policy: str) -> None:
    cands = [worker("p", "prefill", queued_tokens=2000, waiting=2), worker("d", "decode", running=30)]
    tight = Budgets(1.0, 1.0)  # no route could meet it even on idle workers
    assert rank(100, tight, cands, EXACT).unreachable
    (choice,) = rank_routes(policy, 100, tight, cands, EXACT).choices
    (predicted,) = rank(100, LOOSE, cands, EXACT).choices
    assert (choice.ttft_ms, choice.itl_ms, choice.queue_ms) == (
        predicted.ttft_ms,
        predicted.itl_ms,
        predicted.queue_ms,
    )
    assert choice.load == pytest.approx(max(choice.ttft_ms, choice.itl_ms) / 1.0) and choice.load > 1


@pytest.mark.parametrize("policy", BASELINES)
def test_baselines_skip_full_batches_and_kv(policy: str) -> None:
    p = worker("p", "prefill")
    full = worker("full", "decode", max_batch=4, running=3, waiting=1, context_tokens=400)
    no_kv = worker("nokv", "decode", free_kv_tokens=50)
    free = worker("free", "decode", running=50, context_tokens=50_000)
    for turn in range(4):
        assert routes(policy, [p, full, no_kv, free], turn=turn) == ["p->free"]
    ranking = rank_routes(policy, 100, LOOSE, [p, full, no_kv], EXACT)
    assert not ranking.fits and ranking.reason in (BATCH_FULL, KV_FULL)
    assert 0 < ranking.drain_ms < math.inf and not ranking.unreachable  # it may wait for room
    assert rank_routes(policy, 100, LOOSE, [p], EXACT).reason == NO_WORKERS


def test_unknown_policy_is_rejected_naming_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match="budget, round_robin, least_loaded"):
        rank_routes("random", 100, LOOSE, [], EXACT)
    with pytest.raises(ValueError, match="'fastest'"):
        AdmissionConfig(policy="fastest")
    assert AdmissionConfig().policy == BUDGET
    assert all(AdmissionConfig(policy=p).policy == p for p in POLICIES)
