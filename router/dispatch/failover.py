"""Failover: moving a started request off a failed attempt onto other workers, for ``core.RouterCore``
(which notices the failure and hands the new attempt to admission); no sockets, no clock of its own.

A request's life here:

1. An attempt fails for one of three causes: a worker holding it is gone (``WORKER_GONE``), a worker
   reported an error, a failed KV transfer included (``ERROR``), or every worker let go of it while
   the client still misses tokens, a message lost on the way (``TOKENS_LOST``).
2. ``move`` ends the request with the error instead (``fail``) once it has moved ``max_failovers``
   times or its deadline has passed. Otherwise the workers of the failed attempt get ``Abort``, an
   output whose every token is out gets its finish, and the request resumes
   (``RouterRequest.resume``): the new attempt prefills the prompt plus every token already
   delivered, asks for the remaining tokens only, and samples them with
   ``SamplingParams.output_offset`` so that a seeded or greedy request continues exactly as it would
   have (``FailedOver`` says so; the client sees no gap and no duplicate). Each attempt has its own id
   on the wire (``rid``, ``rid~1``, ...), so a late message from a failed attempt is ignored.
3. The new attempt asks admission like a new request, with ``retry_ticket``: any route that can hold
   it, until the request's deadline; with every worker full it waits for room instead of failing.
4. ``fail``: with no attempt left, or no worker able to take it, one error delta is delivered.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from pdfabric.control import TokenDelta
from pdfabric.router.dispatch.effects import Effect, FailedOver, deliver
from pdfabric.router.dispatch.placement import Placement
from pdfabric.router.dispatch.request import RouterRequest
from pdfabric.router.routing.admission import Ticket
from pdfabric.router.routing.choice import Routing
from pdfabric.router.routing.routes import Budgets

WORKER_GONE, ERROR, TOKENS_LOST = "worker_gone", "error", "tokens_lost"  # failover causes
_ANY = Budgets(3_600_000.0, 3_600_000.0)  # a failover takes any route that can hold it


class Failover:
    """Moves started requests off their failed attempts, at most ``max_failovers`` times each."""

    def __init__(
        self, placement: Placement, routing: Routing, clock: Callable[[], float], max_failovers: int
    ) -> None:
        self.placement = placement
        self.routing = routing
        self.clock = clock
        self.max_failovers = max_failovers

    def move(
        self, req: RouterRequest, cause: str, worker_id: str, message: str, out: list[Effect]
    ) -> Ticket | None:
        """Takes a started request off its failed attempt and sets up the next one, whose admission
        ticket it returns (the attempt has no routes yet). None: the request is finished, has nothing
        left to run, or has ended with the error (no failover left, or its deadline passed)."""
        if req.finished:
            return None
        if req.failovers >= self.max_failovers:
            tried = f" (after {req.failovers} failovers)" if req.failovers else " (failover is off)"
            fail(req, message + tried, out)
            return None
        left_s = req.deadline - self.clock() if req.deadline is not None else math.inf
        if left_s <= 0:
            fail(req, message + " (and the request's deadline has passed)", out)
            return None
        self.placement.drop_attempt(req, "moved to another worker", out)
        for spent in req.spent():  # every token of that output is out; only its finish was lost
            deliver(req, spent, out)
        if not req.resume():
            return None
        out.append(FailedOver(req.request_id, cause, worker_id, message, req.delivered))
        ticket = self.retry_ticket(req)
        req.choices, req.tried, req.reasons = (), 0, [message]
        return ticket

    def retry_ticket(self, req: RouterRequest) -> Ticket:
        """The admission ticket of the request's current attempt: its own for a first attempt (its TTFT
        budget still counts from its arrival); for a failover's, one that takes any route that can
        hold the prompt and what was delivered, until the request's deadline."""
        if not req.started:
            return req.ticket
        left_s = req.deadline - self.clock() if req.deadline is not None else math.inf
        key, prefix = self.routing.prefix_of(req.run_prompt, req.ticket.served)
        ttft_ms = max(1e-3, min(_ANY.ttft_ms, left_s * 1e3))
        return replace(
            req.ticket, request_id=req.wire_id, prompt_len=len(req.run_prompt), prefix=prefix,
            prefix_key=key, budgets=replace(_ANY, ttft_ms=ttft_ms), arrived=self.clock(), max_wait_ms=ttft_ms,
        )  # fmt: skip


def fail(req: RouterRequest, message: str, out: list[Effect]) -> None:
    """Ends a started request's stream with one error delta (a failure ends every output)."""
    index = req.outs[0].next_index  # where the first output stopped
    deliver(req, TokenDelta(req.request_id, index, (), (), "error", message), out)
