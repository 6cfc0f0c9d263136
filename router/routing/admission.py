"""Admission control: what to do with a request when no route fits its budgets (wait, or reject).

A request's life here:
1. ``pdfabric.router.routing.slo.resolve`` fixes its budgets and class;
2. ``AdmissionQueue.arrive`` first lets waiting requests take any room that opened, then admits the
   new one if a route fits; if none does, it is rejected at once (its class does not wait, or the
   predicted wait passes its deadline, or nothing could ever fit) with a Retry-After from the
   predicted drain time, or it waits;
3. waiting requests are ordered by class priority, then by start-time fair queuing between tenants
   (a tenant's requests are spaced by 1 / weight in virtual time, so a burst from one tenant queues
   behind the others' requests); ``poll`` admits them in that order as routes fit, with their TTFT
   budget reduced by the time waited, and rejects those whose deadline passed; a later request
   that fits may be admitted past one that does not (a short prompt past a long one waiting for KV
   room), until its deadline or, with ``max_overtake_ms`` set, until it has waited that long: from
   then on, requests of its model version and of its priority or lower wait behind it (reason
   ``behind_waiting``) while the workers drain until it fits;
4. when the queue is full, an arrival displaces the newest request of the tenant most over its share
   of the queue, if that tenant is further over its share than the arrival's would be; else it is
   rejected.

Every outcome carries its reason; counting them is the caller's. Times are the caller's clock in
seconds (``now``), budgets and Retry-After in milliseconds. Nothing here reads a clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from pdfabric.router.routing.routes import Budgets, Ranking
from pdfabric.routing_config import AdmissionConfig

ADMIT, QUEUE, REJECT = "admit", "queue", "reject"
QUEUE_FULL, DEADLINE, BEHIND = "queue_full", "deadline", "behind_waiting"

# --- the wait queue -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Ticket:
    """A request asking for admission. ``arrived`` is on the caller's clock (seconds); ``cost`` is
    what it takes from its tenant's fair share (1 per request, or e.g. its tokens / 1000)."""

    request_id: str
    tenant: str
    slo_class: str
    budgets: Budgets
    prompt_len: int
    arrived: float
    cost: float = 1.0
    prefix: tuple[bytes, ...] = ()  # its prompt's prefix hashes (``prefix_index.prompt_hashes``)
    prefix_key: tuple[int, str] = (0, "")  # the (block size, model) they were computed for
    max_wait_ms: float | None = None  # how long it may wait for a route (None: its class's max_wait_ms)
    served: str = ""  # the model version it runs on: only that version's workers (``Register.served``)

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or not (math.isfinite(self.cost) and self.cost > 0):
            raise ValueError(f"{self.request_id}: prompt_len must be >= 1 and cost > 0")


@dataclass(frozen=True)
class Outcome:
    """What happened to a ticket: ADMIT (with the routes to try, best first), QUEUE or REJECT (with
    the reason and, for a rejection, how long the client should wait before retrying)."""

    ticket: Ticket
    action: str
    reason: str = ""
    retry_after_ms: int = 0
    ranking: Ranking | None = None
    waited_ms: float = 0.0


# Predicts the routes for a ticket under the given (remaining) budgets. When it returns a ranking that
# fits, the ticket is admitted, so the caller must count that request in the loads it predicts from
# on later calls (e.g. with ``WorkerLoad.with_prefill`` / ``with_decode`` on its first choice).
FitFn = Callable[[Ticket, Budgets], Ranking]


@dataclass
class _Waiting:
    ticket: Ticket
    priority: int
    deadline: float
    start: float  # virtual start tag: the order among tenants
    finish: float
    seq: int
    last: Ranking


class AdmissionQueue:
    """The bounded wait queue with priorities, weighted fair sharing between tenants and deadlines."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self._waiting: dict[str, _Waiting] = {}
        self._vtime = 0.0  # virtual time: the start tag of the last admitted request
        self._finish: dict[str, float] = {}  # tenant -> finish tag of its last request
        self._seq = 0

    def __len__(self) -> int:
        return len(self._waiting)

    def queued(self, tenant: str) -> int:
        return sum(1 for w in self._waiting.values() if w.ticket.tenant == tenant)

    def next_deadline(self) -> float | None:
        """When ``poll`` must run next at the latest (the earliest deadline), or None."""
        return min((w.deadline for w in self._waiting.values()), default=None)

    def arrive(self, ticket: Ticket, now: float, fit: FitFn) -> list[Outcome]:
        """Decides a new request; the outcomes of waiting requests admitted or expired first come
        before the new one's (which is always the last)."""
        if ticket.request_id in self._waiting:
            raise ValueError(f"request {ticket.request_id!r} is already waiting")
        cls = self.config.slo_class(ticket.slo_class)
        outcomes = self.poll(now, fit)
        budgets = _remaining(ticket, now)
        if budgets is None:
            return [*outcomes, self._reject(ticket, now, DEADLINE, None)]
        ahead = self._overtaken(ticket, cls.priority, now)
        # ``fit`` counts an admitted ticket's load at once: it is not asked for one that must wait
        ranking = fit(ticket, budgets) if ahead is None else Ranking((), BEHIND, ahead.last.drain_ms)
        if ranking.fits:
            start, _ = self._tags(ticket)
            self._vtime = max(self._vtime, start)
            return [*outcomes, Outcome(ticket, ADMIT, ranking=ranking, waited_ms=_ms(now - ticket.arrived))]
        max_wait = cls.max_wait_ms if ticket.max_wait_ms is None else ticket.max_wait_ms
        deadline = ticket.arrived + min(max_wait, ticket.budgets.ttft_ms) / 1e3
        if ranking.unreachable or max_wait == 0 or ranking.wait_ms > (deadline - now) * 1e3:
            return [*outcomes, self._reject(ticket, now, ranking.reason, ranking)]
        if len(self._waiting) >= self.config.queue_capacity:
            victim = self._victim(ticket, cls.priority)
            if victim is None:
                return [*outcomes, self._reject(ticket, now, QUEUE_FULL, ranking)]
            outcomes.append(self._drop(victim, now, QUEUE_FULL))
        start, finish = self._tags(ticket)
        self._seq += 1
        self._waiting[ticket.request_id] = _Waiting(
            ticket, cls.priority, deadline, start, finish, self._seq, ranking
        )
        return [*outcomes, Outcome(ticket, QUEUE, ranking.reason, ranking=ranking)]

    def poll(self, now: float, fit: FitFn) -> list[Outcome]:
        """Rejects expired requests, then admits waiting ones in order while routes fit. Call it when
        load changes (a heartbeat, a request ending) and at ``next_deadline()``."""
        outcomes = [self._drop(w, now, DEADLINE) for w in list(self._waiting.values()) if w.deadline <= now]
        order = sorted(self._waiting.values(), key=lambda w: (-w.priority, w.start, w.seq))
        misses = 0
        held: dict[str, int] = {}  # model version -> the priority of its first request overtaken too long
        for w in order:
            ahead = held.get(w.ticket.served)
            if ahead is not None and ahead >= w.priority:
                continue  # behind a request that has waited long enough
            budgets = _remaining(w.ticket, now)
            if budgets is None:
                outcomes.append(self._drop(w, now, DEADLINE))
                continue
            ranking = fit(w.ticket, budgets)
            if ranking.fits:
                del self._waiting[w.ticket.request_id]
                self._vtime = max(self._vtime, w.start)
                waited = _ms(now - w.ticket.arrived)
                outcomes.append(Outcome(w.ticket, ADMIT, ranking=ranking, waited_ms=waited))
            elif ranking.unreachable or math.isinf(ranking.wait_ms):
                w.last = ranking
                outcomes.append(self._drop(w, now, ranking.reason))
            else:
                w.last = ranking
                if self._passed_over_too_long(w, now):
                    held.setdefault(w.ticket.served, w.priority)
                misses += 1
                if misses >= self.config.poll_probes:
                    break
        self._finish = {t: f for t, f in self._finish.items() if f > self._vtime}
        return outcomes

    def cancel(self, request_id: str) -> Ticket | None:
        """Forgets a waiting request (its client went away); returns it if it was waiting."""
        w = self._waiting.pop(request_id, None)
        if w is None:
            return None
        self._refund(w)
        return w.ticket

    # --- helpers --------------------------------------------------------------------------------

    def _overtaken(self, ticket: Ticket, priority: int, now: float) -> _Waiting | None:
        """The waiting request of ``ticket``'s model version and of ``priority`` or higher that has
        waited ``max_overtake_ms`` or longer, if any: ``ticket`` may not be admitted past it."""
        for w in self._waiting.values():
            if (
                w.ticket.served == ticket.served
                and w.priority >= priority
                and self._passed_over_too_long(w, now)
            ):
                return w
        return None

    def _passed_over_too_long(self, w: _Waiting, now: float) -> bool:
        limit_ms = self.config.max_overtake_ms
        return limit_ms is not None and (now - w.ticket.arrived) * 1e3 >= limit_ms

    def _weight(self, ticket: Ticket) -> float:
        return self.config.tenant(ticket.tenant).weight

    def _tags(self, ticket: Ticket) -> tuple[float, float]:
        """Start-time fair queuing: a tenant's next request starts where its last one finished, or
        now (virtual time) if it has been idle; it finishes ``cost / weight`` later."""
        start = max(self._vtime, self._finish.get(ticket.tenant, 0.0))
        finish = start + ticket.cost / self._weight(ticket)
        self._finish[ticket.tenant] = finish
        return start, finish

    def _victim(self, ticket: Ticket, priority: int) -> _Waiting | None:
        """The waiting request an arrival may displace from a full queue, if any: the newest one of
        the lowest priority below the arrival's, else of the tenant most over its share."""
        lower = [w for w in self._waiting.values() if w.priority < priority]
        if lower:
            return max(lower, key=lambda w: (-w.priority, w.seq))
        counts: dict[str, int] = {}
        for w in self._waiting.values():
            if w.priority == priority:
                counts[w.ticket.tenant] = counts.get(w.ticket.tenant, 0) + 1
        if not counts:
            return None
        share = {t: n / self.config.tenant(t).weight for t, n in counts.items()}
        top = max(share, key=lambda t: (share[t], t))
        mine = (counts.get(ticket.tenant, 0) + 1) / self._weight(ticket)
        if top == ticket.tenant or share[top] <= mine:
            return None
        return max((w for w in self._waiting.values() if w.ticket.tenant == top), key=lambda w: w.seq)

    def _drop(self, w: _Waiting, now: float, reason: str) -> Outcome:
        del self._waiting[w.ticket.request_id]
        self._refund(w)
        return self._reject(w.ticket, now, reason, w.last)

    def _refund(self, w: _Waiting) -> None:
        """Gives a tenant back the virtual time of its newest request, if that one never ran."""
        if self._finish.get(w.ticket.tenant) == w.finish:
            self._finish[w.ticket.tenant] = w.start

    def _reject(self, ticket: Ticket, now: float, reason: str, ranking: Ranking | None) -> Outcome:
        cfg = self.config
        if ranking is None or ranking.unreachable:
            retry = cfg.max_retry_ms if ranking is not None else cfg.min_retry_ms
        else:
            retry = min(cfg.max_retry_ms, max(cfg.min_retry_ms, math.ceil(ranking.drain_ms)))
        return Outcome(ticket, REJECT, reason, retry, ranking, _ms(now - ticket.arrived))


def _remaining(ticket: Ticket, now: float) -> Budgets | None:
    """The ticket's budgets with the time it has waited taken from its TTFT budget (None: spent)."""
    left = ticket.budgets.ttft_ms - _ms(now - ticket.arrived)
    return Budgets(left, ticket.budgets.itl_ms) if left > 0 else None


def _ms(seconds: float) -> float:
    return max(0.0, seconds * 1e3)
