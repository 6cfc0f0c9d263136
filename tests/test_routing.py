"""The router's route choice without processes: candidates from registrations and heartbeats, pending
load and pool limits over a ``Registry``, and the config tables (admission: test_router_core.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdfabric.config import load_serve_config
from pdfabric.control import Heartbeat, Register
from pdfabric.profile import WorkerProfile
from pdfabric.router.routing.admission import Ticket
from pdfabric.router.routing.choice import RATE_WINDOW_S, Routing, candidate, route_of, with_pending
from pdfabric.router.routing.registry import Registry
from pdfabric.router.routing.routes import Budgets, WorkerLoad
from pdfabric.routing_config import AdmissionConfig, PoolConfig

# prefill: 2 ms a step + 40 us a token; decode: 5 ms + 1 ms a sequence
PROFILE = WorkerProfile(prefill=(2e-3, 4e-5, 0.0), decode=(5e-3, 1e-3, 0.0))


def register(
    registry: Registry, wid: str, kind: str, pool: str = "default", max_running: int = 64, blocks: int = 100
) -> None:
    registry.register(
        Register(wid, kind, pool, "tiny", 4096, 16, blocks, "", 1, max_running, 512, 1000, PROFILE)
    )


def heartbeat(wid: str, running: int = 0, waiting: int = 0, queued: int = 0, free: int = 100) -> Heartbeat:
    return Heartbeat(wid, queued, running, waiting, free, 100, 1.0, 50 * (running + waiting), 2e9, PROFILE)


def test_candidate_from_registration_then_heartbeat() -> None:
    registry = Registry()
    register(registry, "d", "decode", max_running=32, blocks=10)
    info = registry.workers["d"]
    c = candidate(info, AdmissionConfig())
    assert c.load == WorkerLoad(free_kv_tokens=160) and c.max_batch == 32 and c.chunk_tokens == 512
    assert c.profile == PROFILE and c.kv_bytes_per_token == 1000 and c.cost == 1.0
    registry.heartbeat(heartbeat("d", running=3, waiting=1, free=7))
    c = candidate(info, AdmissionConfig())
    assert c.load == WorkerLoad(0, 3, 1, 200, 7 * 16, 2e9)


def test_pool_limits_take_the_lower_of_pool_and_worker() -> None:
    registry = Registry()
    register(registry, "t", "decode", pool="tight", max_running=32)
    register(registry, "b", "decode", pool="bulk", max_running=16)
    cfg = AdmissionConfig(
        pools=(
            PoolConfig("tight", "decode", max_batch=4, cost=3),
            PoolConfig("bulk", "decode", max_batch=64, chunk_tokens=128),
        )
    )
    tight, bulk = (candidate(registry.workers[w], cfg) for w in ("t", "b"))
    assert (tight.max_batch, tight.chunk_tokens, tight.cost) == (4, 512, 3)
    assert (bulk.max_batch, bulk.chunk_tokens, bulk.cost) == (16, 128, 1)
    register(registry, "p", "prefill", pool="tight")  # a pool of another kind: no limit
    assert candidate(registry.workers["p"], cfg).max_batch == 64


def test_pending_load_by_kind() -> None:
    base = WorkerLoad(queued_tokens=10, running=1, waiting=1, context_tokens=40, free_kv_tokens=100)
    assert with_pending(base, "prefill", 30) == WorkerLoad(40, 1, 2, 40, 100)
    assert with_pending(base, "decode", 30) == WorkerLoad(10, 1, 2, 70, 70)
    assert with_pending(base, "colocated", 30) == WorkerLoad(40, 1, 2, 70, 70)
    busy = WorkerLoad(free_kv_tokens=100, kv_bytes_per_s=2e9, prompt_tokens_per_s=500.0)
    assert with_pending(busy, "colocated", 30).prompt_tokens_per_s == 500.0  # its rate is kept
    assert with_pending(busy, "colocated", 30).kv_bytes_per_s == 2e9


def _ticket(rid: str, prompt_len: int = 20, ttft: float = 5000, itl: float = 100, t: float = 0.0) -> Ticket:
    return Ticket(rid, "default", "interactive", Budgets(ttft, itl), prompt_len, t)


def test_admitted_requests_count_as_pending_until_the_next_heartbeat() -> None:
    registry = Registry()
    register(registry, "p", "prefill")
    register(registry, "d", "decode")
    routing = Routing(registry, clock=lambda: 0.0)
    ranking = routing.fit(_ticket("r1", 20), Budgets(5000, 100))
    assert ranking.fits and route_of(registry, ranking.choices[0]) is not None
    loads = {c.worker_id: c.load for c in routing.candidates()}
    assert loads["p"].queued_tokens == 20 and loads["d"].waiting == 1 and loads["d"].context_tokens == 20
    routing.holders.sent("r1", "p")
    routing.holders.sent("r1", "d")
    routing.on_heartbeat("p", 1)  # the prefill worker's report now counts it; the decode worker's not yet
    loads = {c.worker_id: c.load for c in routing.candidates()}
    assert loads["p"].queued_tokens == 0 and loads["d"].waiting == 1
    routing.forget("r1")
    assert {c.worker_id: c.load.waiting for c in routing.candidates()} == {"p": 0, "d": 0}


def test_tight_itl_goes_to_the_small_pool_loose_to_the_cheap_one() -> None:
    registry = Registry()
    register(registry, "p", "prefill")
    register(registry, "tight", "decode", pool="tight")
    register(registry, "bulk", "decode", pool="bulk")
    registry.heartbeat(heartbeat("bulk", running=20))  # ITL 5 + 21 ms (x1.1) on bulk, 6 ms (x1.1) on tight
    cfg = AdmissionConfig(
        pools=(PoolConfig("tight", "decode", max_batch=4, cost=3), PoolConfig("bulk", "decode", cost=1))
    )
    routing = Routing(registry, cfg, clock=lambda: 0.0)
    assert routing.fit(_ticket("loose", itl=100), Budgets(5000, 100)).choices[0].decode == "bulk"
    assert routing.fit(_ticket("tight", itl=10), Budgets(5000, 10)).choices[0].decode == "tight"


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded"])
def test_baseline_policies_spread_over_routes_and_count_only_admissions(policy: str) -> None:
    """Round robin alternates between the two pairs whatever their load; least loaded alternates too,
    because each request it sends counts as pending load until the next heartbeat. A request that
    finds every batch full waits (it is not rejected for its budgets) and does not move the turn."""
    registry = Registry()
    register(registry, "p", "prefill")
    register(registry, "d0", "decode", max_running=3)
    register(registry, "d1", "decode", max_running=3)
    routing = Routing(registry, AdmissionConfig(policy=policy), clock=lambda: 0.0)
    tight = Budgets(1.0, 1.0)  # unreachable for the budget policy
    firsts = [routing.fit(_ticket(f"r{i}", ttft=1.0, itl=1.0), tight).choices[0].decode for i in range(6)]
    assert sorted(firsts[:2]) == ["d0", "d1"] and firsts[2:] == firsts[:2] * 2
    assert routing.turn == 6
    full = routing.fit(_ticket("r6"), Budgets(5000, 100))
    assert not full.fits and full.reason == "batch_full" and not full.unreachable
    assert routing.turn == 6


def test_config_tables(tmp_path: Path) -> None:
    cfg = load_serve_config(Path(__file__).parent.parent / "configs" / "slo-pools.toml", {})
    ids = [wid for wid, _ in cfg.launch_plan()]
    assert ids == ["prefill-0", "decode-tight-0", "decode-bulk-0"]
    assert cfg.groups[0].worker.max_running == 4 and cfg.groups[0].worker.kv_memory_mb == 128
    assert cfg.routing.pool("decode", "tight").max_batch == 4 and cfg.predictor.safety_margin == 0.1
    assert cfg.routing.policy == "budget"
    path = tmp_path / "rr.toml"
    path.write_text('[routing]\npolicy = "round_robin"\n')
    assert load_serve_config(path, {}).routing.policy == "round_robin"
    overridden = load_serve_config(path, {"routing_policy": "least_loaded", "port": None})
    assert overridden.routing.policy == "least_loaded" and overridden.routing.classes  # the rest kept
    plain = load_serve_config(None, {})
    assert [wid for wid, _ in plain.launch_plan()] == ["prefill-0", "decode-0"]
    for body, word in (
        ('[[workers]]\nkind = "decode"\nmax_runing = 3\n', "max_runing"),
        ('[[workers]]\nkind = "decode"\n', "both prefill and decode"),
        ("[routing]\nttft = 5\n", "ttft"),
        ('[routing]\npolicy = "random"\n', "budget, round_robin, least_loaded"),
        ('[[routing.pools]]\nname = "x"\nkind = "decode"\nbatch = 3\n', "batch"),
        ("[[workers]]\ncount = 2\n", "needs a kind"),
    ):
        path = tmp_path / "bad.toml"
        path.write_text(body)
        with pytest.raises(ValueError, match=word):
            load_serve_config(path, {})


def test_prompt_rate_sent_to_a_worker_feeds_the_colocated_itl() -> None:
    """Prompt tokens sent to a colocated worker are averaged over the last RATE_WINDOW_S, and a higher
    rate predicts a longer mean inter-token gap (more of its steps carry a prompt chunk)."""
    registry = Registry()
    register(registry, "c", "colocated")
    now = [0.0]
    routing = Routing(registry, AdmissionConfig(), clock=lambda: now[0])
    loose = Budgets(60_000, 5_000)
    idle_itl = routing.fit(_ticket("r0", prompt_len=200), loose).choices[0].itl_ms
    assert routing.prompt_rate("c", now[0]) == pytest.approx(200.0)  # younger than a second: per 1 s
    now[0] = 10.0
    routing.fit(_ticket("r1", prompt_len=300), loose)
    assert routing.prompt_rate("c", now[0]) == pytest.approx(500 / 10)
    registry.heartbeat(heartbeat("c"))  # the worker's report includes what was sent: pending is spent
    routing.holders.sent("r0", "c")
    routing.holders.sent("r1", "c")
    routing.on_heartbeat("c", 2)
    now[0] = 20.0
    busy_itl = routing.fit(_ticket("r2", prompt_len=200), loose).choices[0].itl_ms
    assert busy_itl > idle_itl
    now[0] = 20.0 + RATE_WINDOW_S - 1  # the window has moved past every prompt but the last
    assert routing.prompt_rate("c", now[0]) == pytest.approx(200 / RATE_WINDOW_S)


def test_a_background_request_goes_only_where_it_spares_the_foreground() -> None:
    """A request of a background class (the default ``batch``) goes to a decode worker only if it slows
    the foreground sequences there by at most ``background_slowdown`` (predicted ITL), and waits when
    no worker is spared; a worker with no foreground sequence takes any number."""
    registry = Registry()
    register(registry, "p", "prefill")
    register(registry, "busy", "decode")
    register(registry, "idle", "decode")
    registry.heartbeat(heartbeat("busy", running=2))  # 2 foreground: 7 ms a step alone, 8 ms with a third

    def line(rid: str) -> Ticket:
        return Ticket(rid, "default", "batch", Budgets(60_000, 1000), 20, 0.0)

    routing = Routing(registry, AdmissionConfig(background_slowdown=0.1), clock=lambda: 0.0)
    ranking = routing.fit(line("b0"), Budgets(60_000, 1000))
    assert [c.decode for c in ranking.choices] == ["idle"]  # 8 / 7 ms is more than 10% slower
    busy = next(
        c
        for c in Routing(registry, clock=lambda: 0.0).fit(_ticket("x"), Budgets(5000, 100)).choices
        if c.decode == "busy"
    )
    assert busy.foreground_itl_ms == pytest.approx(1.1 * 7) and busy.itl_ms == pytest.approx(1.1 * 8)
    generous = Routing(registry, AdmissionConfig(background_slowdown=0.2), clock=lambda: 0.0)
    assert {c.decode for c in generous.fit(line("g"), Budgets(60_000, 1000)).choices} == {"busy", "idle"}

    for i in range(1, 5):  # the idle worker holds no foreground sequence: it takes them all
        assert routing.fit(line(f"b{i}"), Budgets(60_000, 1000)).choices[0].decode == "idle"
    online = routing.fit(_ticket("online"), Budgets(5000, 100))  # the foreground is never held back
    assert online.fits
    routing.routed("online", 20, next(c for c in online.choices if c.decode == "idle"))
    held = routing.fit(line("b5"), Budgets(60_000, 1000))  # now both workers run foreground sequences
    assert not held.fits and held.reason == "foreground" and not held.unreachable
    assert 0 < held.wait_ms < 60_000
    assert {c.worker_id: c.background for c in routing.candidates()} == {"p": 5, "busy": 0, "idle": 5}
    for i in range(5):
        routing.forget(f"b{i}")  # the lines ended
    assert {c.worker_id: c.background for c in routing.candidates()} == {"p": 0, "busy": 0, "idle": 0}
