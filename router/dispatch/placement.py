"""Where a request's current attempt runs: putting it on its next ranked route, the decode worker's
reservation on the way, and letting go of the workers that hold it (``core.RouterCore`` decides what
happens to the request; this walks its routes). No sockets and no clock of its own.

An attempt's life here:

1. ``next_route`` tries the attempt's routes (``RouterRequest.choices``) best first, skipping any
   whose workers are gone. A colocated worker gets ``Generate`` and holds it at once; for a
   disaggregated pair the decode worker is asked to ``Reserve`` blocks and holds it from then on.
   With no route left (and none to wait for, 4.) it says so: the core refuses the request, or fails
   a failover's attempt.
2. ``reserved``: a ``Reserved`` reply with blocks sends the prefill worker ``Prefill`` with them. A
   refusal (marking the decode worker ``out_of_blocks`` when it had no free blocks), or a prefill
   worker gone meanwhile, sends the attempt on to its next route; so does a reservation not answered
   within ``reserve_timeout_s`` (``expired``, then ``time_out``).
3. The first route that takes a request makes it ``Started``; a failover's new route goes
   unannounced (the client's stream just goes on).
4. With every route refused, the attempt waits if a refusal was for want of free blocks
   (``Reserved.no_room``): the router's view of that worker was stale, so the attempt asks admission
   again when the worker next reports, or a worker joins or leaves (``reported``; ``stop_waiting``
   when the request ends first).
5. ``let_go`` takes the attempt off one worker, ``drop_attempt`` off every worker; each still holding
   it gets ``Abort`` so that its blocks come back.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator

from pdfabric.control import Abort, Generate, Prefill, Reserve, Reserved
from pdfabric.router.dispatch.effects import Effect, Send, Started
from pdfabric.router.dispatch.request import RouterRequest
from pdfabric.router.routing.choice import Routing, route_of
from pdfabric.router.routing.holders import Holders
from pdfabric.router.routing.registry import Registry, has_route
from pdfabric.router.routing.routes import Choice


class Placement:
    """Puts the router's attempts on their routes and takes them off again. A method given ``out``
    appends the effects to carry out to it, in order."""

    def __init__(
        self, registry: Registry, routing: Routing, clock: Callable[[], float], reserve_timeout_s: float
    ) -> None:
        self.registry = registry
        self.routing = routing
        self.holders: Holders[float] = routing.holders  # a reservation's waiter: its deadline
        self.clock = clock
        self.reserve_timeout_s = reserve_timeout_s
        self._timeouts: list[tuple[float, str, str]] = []  # (deadline, wire id, decode worker id)
        self._await_report: set[str] = set()  # attempts every route refused for want of KV blocks

    def next_route(self, req: RouterRequest, out: list[Effect]) -> bool:
        """Starts the attempt on its next route that exists: at once if colocated, else after the
        decode worker's reservation reply; with every route refused, one for want of blocks, it waits
        for a report (``reported``). False: no route is left (nothing holds the attempt now)."""
        rid, prompt, params, branches = req.wire_id, req.run_prompt, req.run_params, req.run_branches
        while req.tried < len(req.choices):
            choice = req.choices[req.tried]
            req.tried += 1
            route = route_of(self.registry, choice)
            if route is None:
                req.reasons.append(f"{choice.prefill}/{choice.decode} is gone")
                continue
            if route.colocated is not None:
                self.holders.hold(rid, choice.decode)
                self._send_work(choice.decode, Generate(rid, prompt, params, req.eos, branches), out)
                self._started(req, choice, choice.decode, out)
                return True
            deadline = self.clock() + self.reserve_timeout_s
            self.holders.reserving(rid, choice.decode, deadline)  # an end from here on aborts it there
            heapq.heappush(self._timeouts, (deadline, rid, choice.decode))
            self._send_work(choice.decode, Reserve(rid, prompt, params, req.eos, branches), out)
            return True
        self.routing.forget(rid)
        self.holders.end(rid)  # every route let go of it already
        if req.no_room and has_route(self.registry, req.ticket.served):
            # Fuller than the router knew (it saw free blocks): the attempt asks admission again when
            # a refusing worker next reports how full it is, or a worker joins or leaves.
            req.no_room = False
            self._await_report.add(rid)
            return True
        return False

    def reserved(self, reply: Reserved, req: RouterRequest | None, out: list[Effect]) -> bool:
        """A decode worker's reply to ``Reserve``; ``req``: the request whose current attempt it is
        for (None: ended, or a failed attempt). True: the attempt must try its next route."""
        rid, decode_id = reply.request_id, reply.worker_id
        if self.holders.replied(rid, decode_id) is None or req is None:  # given up on (ended, timed out)
            if reply.block_ids:  # its blocks come back
                out.append(Send(decode_id, Abort(rid, "reservation no longer wanted")))
            return False
        choice = req.choices[req.tried - 1]
        if not reply.block_ids:
            self.holders.done(rid, decode_id)
            req.reasons.append(f"{decode_id}: {reply.reason}")
            if reply.no_room and decode_id in self.registry.workers:
                self.registry.workers[decode_id].out_of_blocks = req.no_room = True
            return True
        if choice.prefill not in self.registry.workers:
            self.let_go(rid, decode_id, "prefill worker gone", out)
            req.reasons.append(f"{choice.prefill} is gone")
            return True
        self.holders.hold(rid, choice.prefill)  # the decode worker holds it since `reserving`
        kv_endpoint = self.registry.workers[decode_id].reg.kv_endpoint
        prefill = Prefill(
            rid, req.run_prompt, req.run_params, req.eos, kv_endpoint, reply.block_ids, reply.cached_blocks
        )
        self._send_work(choice.prefill, prefill, out)
        self._started(req, choice, f"{choice.prefill}->{decode_id}", out)
        return False

    def expired(self, now: float) -> Iterator[tuple[str, str]]:
        """The reservations still unanswered at their deadline, up to ``now``: (wire id, decode worker
        id) each, one at a time (what the caller does with one may time another)."""
        while self._timeouts and self._timeouts[0][0] <= now:
            deadline, wire_id, worker_id = heapq.heappop(self._timeouts)
            if self.holders.awaiting(wire_id, worker_id) == deadline:  # else answered or ended meanwhile
                yield wire_id, worker_id

    def time_out(self, req: RouterRequest, worker_id: str, out: list[Effect]) -> None:
        """Gives up on the decode worker's reservation for ``req``'s attempt (``expired``); the attempt
        tries its next route next."""
        self.let_go(req.wire_id, worker_id, "reservation timed out", out)
        req.reasons.append(f"{worker_id} did not answer a reservation in {self.reserve_timeout_s:g}s")

    def next_timeout(self) -> float | None:
        """The earliest deadline of a reservation still unanswered, on ``clock`` (None: none is)."""
        timeouts = self._timeouts
        while timeouts and self.holders.awaiting(timeouts[0][1], timeouts[0][2]) != timeouts[0][0]:
            heapq.heappop(timeouts)  # answered or ended: no longer timed
        return timeouts[0][0] if timeouts else None

    def reported(self) -> list[str]:
        """A worker reported after refusing for want of blocks, or workers came or went: the attempts
        that waited for such news (wire ids, in order), to ask admission again; they wait no more."""
        held, self._await_report = self._await_report, set()
        return sorted(held)

    def stop_waiting(self, wire_id: str) -> None:
        """The attempt waits for a report no more (its request ended)."""
        self._await_report.discard(wire_id)

    def let_go(self, request_id: str, worker_id: str, abort_reason: str, out: list[Effect]) -> None:
        """One worker stops holding a request that goes on elsewhere (or nowhere): it gets an ``Abort``."""
        if self.holders.done(request_id, worker_id):
            out.append(Send(worker_id, Abort(request_id, abort_reason)))

    def drop_attempt(self, req: RouterRequest, abort_reason: str | None, out: list[Effect]) -> None:
        """Lets go of the current attempt everywhere; its workers still holding it get an ``Abort``
        (none with ``abort_reason`` None)."""
        self.routing.forget(req.wire_id)
        for worker_id in self.holders.end(req.wire_id):
            if abort_reason is not None and worker_id in self.registry.workers:
                out.append(Send(worker_id, Abort(req.wire_id, abort_reason)))

    def _send_work(self, worker_id: str, msg: Generate | Reserve | Prefill, out: list[Effect]) -> None:
        self.holders.sent(msg.request_id, worker_id)  # numbered, for the heartbeat that counts it
        out.append(Send(worker_id, msg))

    def _started(self, req: RouterRequest, choice: Choice, route: str, out: list[Effect]) -> None:
        self.routing.routed(req.wire_id, len(req.run_prompt), choice)
        if not req.started:  # a failover's new route goes unannounced: the stream just goes on
            req.started = True
            out.append(Started(req.request_id, choice, route, req.waited_ms))
