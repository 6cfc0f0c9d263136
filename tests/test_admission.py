"""Budgets, classes, pools config and the fair wait queue, against a fake fleet (no processes)."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from pdfabric.router.routing.admission import (
    ADMIT,
    BEHIND,
    DEADLINE,
    QUEUE,
    QUEUE_FULL,
    REJECT,
    AdmissionQueue,
    Outcome,
    Ticket,
)
from pdfabric.router.routing.routes import BATCH_FULL, KV_FULL, Budgets, Choice, Ranking
from pdfabric.router.routing.slo import BudgetError, resolve
from pdfabric.routing_config import AdmissionConfig, PoolConfig, SloClass, Tenant

ROUTE = Choice("d", "p", False, 10.0, 5.0, 0.0, 10.0, 0.0, 1.0, 0.1)
CLASSES = (
    SloClass("interactive", priority=10, max_wait_ms=5000),
    SloClass("batch", priority=0, ttft_ms=60_000, itl_ms=1000, max_wait_ms=60_000),
    SloClass("now", priority=10),  # never waits
)


class Fleet:
    """Admits while it has free slots; otherwise no route fits and one frees in ``drain_ms``."""

    def __init__(self, slots: int = 0, drain_ms: float = 50.0, wait_ms: float = 50.0) -> None:
        self.slots, self.drain_ms, self.wait_ms = slots, drain_ms, wait_ms
        self.seen: list[tuple[str, Budgets]] = []

    def fit(self, ticket: Ticket, budgets: Budgets) -> Ranking:
        self.seen.append((ticket.request_id, budgets))
        if self.slots > 0:
            self.slots -= 1  # the admitted request takes its slot, as the router's loads would show
            return Ranking((ROUTE,))
        return Ranking((), BATCH_FULL, self.drain_ms, self.wait_ms)


def config(**kw: object) -> AdmissionConfig:
    return AdmissionConfig(classes=CLASSES, **kw)  # type: ignore[arg-type]


def ticket(
    rid: str, tenant: str = "a", cls: str = "interactive", t: float = 0.0, ttft: float = 2000
) -> Ticket:
    return Ticket(rid, tenant, cls, Budgets(ttft, 100), 100, t)


def last(outcomes: list[Outcome]) -> Outcome:
    return outcomes[-1]


# --- budgets and config ---------------------------------------------------------------------------


def test_budgets_resolve_field_by_field() -> None:
    cfg = AdmissionConfig(
        ttft_ms=3000,
        itl_ms=300,
        classes=CLASSES,
        tenants=(Tenant("acme", slo_class="batch", itl_ms=500), Tenant("solo", ttft_ms=800)),
    )
    assert resolve(cfg, None).budgets == Budgets(3000, 300)  # config default (interactive sets none)
    r = resolve(cfg, None, "acme")
    assert r.budgets == Budgets(60_000, 500) and r.slo_class.name == "batch"  # class, then tenant
    assert resolve(cfg, {"ttft_ms": 250}, "acme").budgets == Budgets(250, 500)  # request first
    assert resolve(cfg, {"itl_ms": 40.5}, "solo").budgets == Budgets(800, 40.5)
    assert resolve(cfg, {}, "stranger").tenant.weight == 1.0


@pytest.mark.parametrize(
    ("slo", "param"),
    [
        ({"ttft_ms": -1}, "slo.ttft_ms"),
        ({"itl_ms": 0}, "slo.itl_ms"),
        ({"ttft_ms": "fast"}, "slo.ttft_ms"),
        ({"ttft_ms": True}, "slo.ttft_ms"),
        ({"itl_ms": float("nan")}, "slo.itl_ms"),
        ({"ttft_ms": 1e12}, "slo.ttft_ms"),
        ({"ttft": 100}, "slo.ttft"),
        ([100, 10], "slo"),
    ],
)
def test_invalid_budgets_name_the_field(slo: object, param: str) -> None:
    with pytest.raises(BudgetError) as err:
        resolve(config(), slo)
    assert err.value.param == param and param in str(err.value)


def test_config_validation_and_toml_table() -> None:
    cfg = AdmissionConfig.from_mapping(
        {
            "ttft_ms": 1500,
            "default_class": "interactive",
            "classes": [{"name": "interactive", "priority": 5}],
            "tenants": [{"name": "acme", "weight": 3}],
            "pools": [{"name": "tight", "kind": "decode", "max_batch": 8, "cost": 2}],
        }
    )
    assert cfg.ttft_ms == 1500 and cfg.tenant("acme").weight == 3
    tight = cfg.pool("decode", "tight")
    assert tight.limits(64, 512) == (8, 512) and tight.cost == 2
    assert cfg.pool("prefill", "other").limits(64, 512) == (64, 512)  # undeclared: no extra limit
    with pytest.raises(ValueError, match="unknown key.*max_batchh"):
        AdmissionConfig.from_mapping({"pools": [{"name": "x", "kind": "decode", "max_batchh": 8}]})
    with pytest.raises(ValueError, match="unknown key.*colour"):
        AdmissionConfig.from_mapping({"colour": "blue"})
    with pytest.raises(ValueError, match="duplicate class"):
        AdmissionConfig(classes=(SloClass("a"), SloClass("a")), default_class="a")
    with pytest.raises(ValueError, match="unknown class"):
        AdmissionConfig(tenants=(Tenant("t", slo_class="gold"),))
    with pytest.raises(ValueError, match="default_class"):
        AdmissionConfig(default_class="gold")
    with pytest.raises(ValueError, match="duplicate pools"):
        AdmissionConfig(pools=(PoolConfig("p", "decode"), PoolConfig("p", "decode")))
    with pytest.raises(ValueError, match="kind"):
        PoolConfig("p", "gpu")
    with pytest.raises(ValueError, match="weight"):
        Tenant("t", weight=0)
    with pytest.raises(ValueError, match="max_wait_ms"):
        SloClass("c", max_wait_ms=-5)


# --- the queue ----------------------------------------------------------------------------------


def test_admitted_at_once_when_a_route_fits() -> None:
    q, fleet = AdmissionQueue(config()), Fleet(slots=1)
    out = last(q.arrive(ticket("r1", t=0.0), 0.01, fleet.fit))
    assert out.action == ADMIT and out.ranking is not None and out.ranking.choices == (ROUTE,)
    assert out.waited_ms == pytest.approx(10)
    assert fleet.seen[-1][1] == Budgets(1990, 100)  # the TTFT budget less the time already spent
    assert len(q) == 0


def test_rejected_at_once_with_retry_after_from_the_drain() -> None:
    q = AdmissionQueue(config(min_retry_ms=100, max_retry_ms=10_000))
    out = last(q.arrive(ticket("r1", cls="now"), 0.0, Fleet(drain_ms=1234.2).fit))
    assert (out.action, out.reason, out.retry_after_ms) == (REJECT, BATCH_FULL, 1235)
    out = last(q.arrive(ticket("r2", cls="now"), 0.0, Fleet(drain_ms=3).fit))
    assert out.retry_after_ms == 100  # clamped to the minimum
    # a predicted wait past the deadline is rejected now rather than later
    out = last(q.arrive(ticket("r3"), 0.0, Fleet(drain_ms=9000, wait_ms=9000).fit))
    assert (out.action, out.retry_after_ms) == (REJECT, 9000)


def test_unreachable_budget_is_rejected_with_the_longest_retry() -> None:
    q = AdmissionQueue(config(max_retry_ms=30_000))

    def never(t: Ticket, b: Budgets) -> Ranking:
        return Ranking((), "ttft_unreachable", math.inf, math.inf, True)

    out = last(q.arrive(ticket("r1"), 0.0, never))
    assert (out.action, out.reason, out.retry_after_ms) == (REJECT, "ttft_unreachable", 30_000)


def test_waits_then_admitted_as_soon_as_a_route_fits() -> None:
    q, fleet = AdmissionQueue(config()), Fleet()
    assert last(q.arrive(ticket("r1"), 0.0, fleet.fit)).action == QUEUE
    assert q.poll(0.1, fleet.fit) == [] and len(q) == 1
    fleet.slots = 1
    (out,) = q.poll(0.5, fleet.fit)
    assert out.action == ADMIT and out.waited_ms == pytest.approx(500)
    assert fleet.seen[-1][1] == Budgets(1500, 100)


def test_deadline_expires() -> None:
    q, fleet = AdmissionQueue(config()), Fleet(drain_ms=700)
    q.arrive(ticket("r1", ttft=2000), 0.0, fleet.fit)  # deadline: min(max wait 5 s, TTFT 2 s)
    q.arrive(ticket("r2", cls="batch", ttft=60_000), 0.0, fleet.fit)  # deadline: 60 s
    assert q.next_deadline() == pytest.approx(2.0)
    assert q.poll(1.99, fleet.fit) == []
    (out,) = q.poll(2.0, fleet.fit)
    assert (out.ticket.request_id, out.action, out.reason) == ("r1", REJECT, DEADLINE)
    assert out.retry_after_ms == 700 and out.waited_ms == pytest.approx(2000)
    assert q.next_deadline() == pytest.approx(60.0) and len(q) == 1


def test_hopeless_waiting_request_is_rejected_before_its_deadline() -> None:
    q, fleet = AdmissionQueue(config()), Fleet()
    q.arrive(ticket("r1"), 0.0, fleet.fit)
    fleet.wait_ms = math.inf
    fleet.drain_ms = 400
    (out,) = q.poll(0.2, fleet.fit)
    assert (out.action, out.reason, out.retry_after_ms) == (REJECT, BATCH_FULL, 400)


def test_priority_classes_go_first() -> None:
    q, fleet = AdmissionQueue(config()), Fleet()
    q.arrive(ticket("b1", cls="batch"), 0.0, fleet.fit)
    q.arrive(ticket("b2", cls="batch"), 0.0, fleet.fit)
    q.arrive(ticket("i1", cls="interactive"), 0.1, fleet.fit)
    fleet.slots = 2
    assert [o.ticket.request_id for o in q.poll(0.2, fleet.fit)] == ["i1", "b1"]


def test_one_tenants_burst_does_not_starve_another() -> None:
    q, fleet = AdmissionQueue(config()), Fleet()
    for i in range(30):
        q.arrive(ticket(f"a{i}", "a", t=0.0), 0.0, fleet.fit)
    for i in range(5):
        q.arrive(ticket(f"b{i}", "b", t=0.05), 0.05, fleet.fit)
    admitted = []
    for step in range(10):  # one slot frees at a time
        fleet.slots = 1
        admitted += [o.ticket.request_id for o in q.poll(0.1 + step * 0.01, fleet.fit) if o.action == ADMIT]
    assert sorted(r for r in admitted if r.startswith("b")) == [f"b{i}" for i in range(5)]
    assert admitted[:2] in (["a0", "b0"], ["b0", "a0"])  # interleaved, not after a's whole burst


def test_weights_set_the_shares() -> None:
    cfg = config(tenants=(Tenant("gold", weight=2), Tenant("tin", weight=1)))
    q, fleet = AdmissionQueue(cfg), Fleet()
    for i in range(40):
        q.arrive(ticket(f"g{i}", "gold"), 0.0, fleet.fit)
        q.arrive(ticket(f"t{i}", "tin"), 0.0, fleet.fit)
    fleet.slots = 30
    counts = Counter(o.ticket.tenant for o in q.poll(0.1, fleet.fit) if o.action == ADMIT)
    assert counts == {"gold": 20, "tin": 10}


def test_directly_admitted_requests_count_against_their_tenant() -> None:
    q, fleet = AdmissionQueue(config()), Fleet(slots=20)
    for i in range(20):  # a's burst fits and is admitted at once
        assert last(q.arrive(ticket(f"a{i}", "a"), 0.0, fleet.fit)).action == ADMIT
    q.arrive(ticket("a-late", "a"), 0.0, fleet.fit)
    q.arrive(ticket("b0", "b"), 0.01, fleet.fit)
    fleet.slots = 1
    assert [o.ticket.request_id for o in q.poll(0.02, fleet.fit)] == ["b0"]


def test_full_queue_displaces_the_tenant_most_over_its_share() -> None:
    q, fleet = AdmissionQueue(config(queue_capacity=4)), Fleet()
    for i in range(4):
        assert last(q.arrive(ticket(f"a{i}", "a"), 0.0, fleet.fit)).action == QUEUE
    out = last(q.arrive(ticket("a4", "a"), 0.0, fleet.fit))
    assert (out.action, out.reason) == (REJECT, QUEUE_FULL)
    outs = q.arrive(ticket("b0", "b"), 0.0, fleet.fit)
    assert [(o.ticket.request_id, o.action, o.reason) for o in outs] == [
        ("a3", REJECT, QUEUE_FULL),
        ("b0", QUEUE, BATCH_FULL),
    ]
    assert q.queued("a") == 3 and q.queued("b") == 1
    q.arrive(ticket("x", "c", cls="batch"), 0.0, fleet.fit)  # a lower class displaces nobody
    assert q.queued("c") == 0 and len(q) == 4


def test_full_queue_higher_class_displaces_the_newest_lower_one() -> None:
    q, fleet = AdmissionQueue(config(queue_capacity=2)), Fleet()
    q.arrive(ticket("b0", "a", cls="batch"), 0.0, fleet.fit)
    q.arrive(ticket("b1", "a", cls="batch"), 0.0, fleet.fit)
    outs = q.arrive(ticket("i0", "a", cls="interactive"), 0.0, fleet.fit)
    assert [(o.ticket.request_id, o.action) for o in outs] == [("b1", REJECT), ("i0", QUEUE)]


def test_cancel_forgets_a_waiting_request() -> None:
    q, fleet = AdmissionQueue(config()), Fleet()
    q.arrive(ticket("r1"), 0.0, fleet.fit)
    assert q.cancel("r1") is not None and q.cancel("r1") is None and len(q) == 0
    fleet.slots = 1
    assert q.poll(0.1, fleet.fit) == []
    with pytest.raises(ValueError, match="already waiting"):
        q.arrive(ticket("r2"), 0.0, Fleet().fit)
        q.arrive(ticket("r2"), 0.0, Fleet().fit)
    with pytest.raises(ValueError, match="unknown class"):
        q.arrive(ticket("r3", cls="gold"), 0.0, fleet.fit)


def test_spent_ttft_budget_is_a_deadline_rejection() -> None:
    q = AdmissionQueue(config())
    out = last(q.arrive(ticket("r1", t=0.0, ttft=100), 0.2, Fleet(slots=1).fit))
    assert (out.action, out.reason) == (REJECT, DEADLINE)


class Room:
    """A fleet of ``free`` KV tokens: a prompt fits while it has room for it, and takes that room."""

    def __init__(self, free: int) -> None:
        self.free = free
        self.asked: list[str] = []

    def fit(self, ticket: Ticket, budgets: Budgets) -> Ranking:
        self.asked.append(ticket.request_id)
        if ticket.prompt_len <= self.free:
            self.free -= ticket.prompt_len
            return Ranking((ROUTE,))
        return Ranking((), KV_FULL, 300.0, 300.0)


def sized(rid: str, prompt_len: int, t: float, cls: str = "interactive", served: str = "") -> Ticket:
    return Ticket(rid, "a", cls, Budgets(600_000, 100), prompt_len, t, served=served)


def test_a_long_prompt_is_passed_over_only_until_it_has_waited_max_overtake_ms() -> None:
    """Short prompts that fit go past a long one waiting for KV room, for max_overtake_ms; then they
    wait behind it (asked nothing of the fleet, so no load is counted for them) until it fits, and
    follow it. Another model version's requests, and a higher class's, still go past."""
    cfg = AdmissionConfig(classes=(*CLASSES, SloClass("vip", priority=20)), max_overtake_ms=1000)
    q, room = AdmissionQueue(cfg), Room(free=300)
    assert last(q.arrive(sized("long", 1000, 0.0), 0.0, room.fit)).action == QUEUE
    assert last(q.arrive(sized("s1", 100, 0.5), 0.5, room.fit)).action == ADMIT  # long waited 0.5 s
    assert last(q.arrive(sized("s2", 100, 0.9), 0.9, room.fit)).action == ADMIT
    room.asked.clear()
    out = last(q.arrive(sized("s3", 100, 1.2), 1.2, room.fit))  # long has waited 1.2 s
    assert (out.action, out.reason) == (QUEUE, BEHIND) and room.asked == ["long"]
    assert last(q.arrive(sized("other", 100, 1.3, served="v2"), 1.3, room.fit)).action == ADMIT
    room.free = 100  # room for a short prompt, not the long one: nothing passes it now
    assert q.poll(1.4, room.fit) == [] and room.asked[-1] == "long" and "s3" not in room.asked
    assert last(q.arrive(sized("vip", 100, 1.5, cls="vip"), 1.5, room.fit)).action == ADMIT
    room.free = 1100  # the fleet drained
    admitted = [o.ticket.request_id for o in q.poll(2.0, room.fit) if o.action == ADMIT]
    assert admitted == ["long", "s3"] and len(q) == 0


def test_max_overtake_ms_zero_keeps_arrival_order() -> None:
    q, room = AdmissionQueue(config(max_overtake_ms=0)), Room(free=300)
    q.arrive(sized("long", 1000, 0.0), 0.0, room.fit)
    out = last(q.arrive(sized("short", 100, 0.0), 0.0, room.fit))
    assert (out.action, out.reason) == (QUEUE, BEHIND)
    with pytest.raises(ValueError, match="max_overtake_ms"):
        AdmissionConfig(max_overtake_ms=-1)
