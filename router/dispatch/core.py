"""The router's handling of requests and workers, without sockets, an event loop or a clock of its own:
calls and worker messages in, effects out.

The serving router (``dispatcher.Dispatcher``, over its ZeroMQ socket and asyncio) and the capacity
planner's simulator (``pdfabric.bench.simulator``, in simulated time) both drive one ``RouterCore``
and act on the effects it returns; neither keeps decisions of its own. A request's life here:

1. ``submit`` asks admission control (``Routing``'s ranking and its ``AdmissionQueue``) for routes
   that meet the request's budgets: admitted now, refused now (``Refused``, 429), or waiting until a
   ``poll`` admits or refuses it. Its TTFT budget counts from ``submit``.
2. An admitted request tries its routes best first (``placement.Placement``): a colocated worker
   gets ``Generate``, a disaggregated pair ``Reserve`` then ``Prefill``; either way the request is
   ``Started``. A decode worker that refuses, does not answer within ``reserve_timeout_s`` or is gone
   moves the request to its next route; with none left it is ``Refused`` (503) with every route's
   reason, unless a refusal was for want of free blocks: then it asks admission again when the
   worker next reports (or a worker joins or leaves) and starts, waits for room or is refused with a
   429, a failover's attempt included.
3. Token deltas come out as ``Deliver`` in output order, each index once, the last with its finish
   reason.
4. Failover (``failover.Failover``): when a worker holding a started request dies (``worker_gone``),
   reports an error (a failed KV transfer included) or lets go of it with tokens never received, the
   request resumes on healthy workers from what the client has, at most ``max_failovers`` times and
   only before its deadline, asking admission again like a new request. With no attempt left, or no
   worker able to take it, one error delta is delivered.
5. ``end`` forgets the request (its client's handler is done with it: finished, gone, timed out);
   every worker still holding it is sent ``Abort`` so that its blocks come back. ``holders.Holders``
   is the one record of which workers hold it; ``request.RouterRequest`` keeps the rest (its output
   so far, its order, its attempts).

Admission is re-polled whenever load changes (heartbeats, hand-offs, finished requests, workers
joining or leaving); the driver also calls ``poll`` at ``next_deadline()`` (a waiting request's
deadline, a reservation's timeout). Times are the ``clock`` given (seconds).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from pdfabric.control import (
    Drain,
    HandedOff,
    Heartbeat,
    Register,
    Reregister,
    Reserved,
    StepOutputs,
    TokenDelta,
)
from pdfabric.router.dispatch.effects import Effect, Refused, Send, Transferred, deliver
from pdfabric.router.dispatch.failover import ERROR, TOKENS_LOST, WORKER_GONE, Failover, fail
from pdfabric.router.dispatch.placement import Placement
from pdfabric.router.dispatch.request import RouterRequest
from pdfabric.router.routing.admission import ADMIT, REJECT, Outcome, Ticket
from pdfabric.router.routing.choice import Routing
from pdfabric.router.routing.registry import Registry, has_route
from pdfabric.router.routing.routes import Budgets
from pdfabric.routing_config import AdmissionConfig, PredictorConfig
from pdfabric.sampling_params import SamplingParams


class RouterCore:
    """Requests, workers and admission for one router. Every method returns the effects to carry out,
    in order."""

    def __init__(
        self,
        admission: AdmissionConfig | None = None,
        predictor: PredictorConfig | None = None,
        reserve_timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        max_failovers: int = 2,
    ) -> None:
        self.registry = Registry()
        self.routing = Routing(self.registry, admission, predictor, clock)
        self.clock = clock
        self._placement = Placement(self.registry, self.routing, clock, reserve_timeout_s)
        self.holders = self._placement.holders
        self._failovers = Failover(self._placement, self.routing, clock, max_failovers)
        self._requests: dict[str, RouterRequest] = {}
        self._wire: dict[str, RouterRequest] = {}  # every attempt's wire id -> its request

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        """Requests submitted and not yet ended (waiting, starting or streaming)."""
        return len(self._requests)

    # --- requests -------------------------------------------------------------------------------

    def submit(
        self,
        request_id: str,
        prompt_ids: tuple[int, ...],
        params: SamplingParams,
        eos_token_ids: tuple[int, ...],
        tenant: str,
        slo_class: str,
        budgets: Budgets,
        *,
        deadline: float | None = None,
        n: int = 1,
        served: str = "",
    ) -> list[Effect]:
        """A new request: ``Started`` or ``Refused`` now, or later from ``poll`` or a worker's reply.
        With a ``deadline`` (on the clock) its first token must come before it (the TTFT budget is
        cut to fit), and a failover after it ends the request instead (the driver ends it at the
        deadline itself). ``n``: its outputs, run on one route from one computed prompt; each
        output's deltas carry its ``choice``. ``served``: the model version whose workers run it
        (``Register.served``), for this attempt and every failover."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already in the router")
        if not has_route(self.registry, served):
            return [Refused(request_id, 503, "no worker can serve this request now")]
        now = self.clock()
        if deadline is not None:
            budgets = replace(budgets, ttft_ms=max(1e-3, min(budgets.ttft_ms, (deadline - now) * 1e3)))
        key, prefix = self.routing.prefix_of(prompt_ids, served)
        ticket = Ticket(
            request_id, tenant, slo_class, budgets, len(prompt_ids), now, prefix=prefix, prefix_key=key,
            served=served,
        )  # fmt: skip
        req = RouterRequest(ticket, prompt_ids, params, eos_token_ids, deadline, n)
        self._requests[request_id] = self._wire[request_id] = req
        out: list[Effect] = []
        self._settle(self.routing.queue.arrive(ticket, ticket.arrived, self.routing.fit), out)
        return out

    def end(self, request_id: str, abort_reason: str | None = "request ended") -> list[Effect]:
        """Forgets a request; each worker still holding it gets an ``Abort`` (unless ``abort_reason``
        is None: the caller knows none holds it any more)."""
        req = self._requests.get(request_id)
        if req is None:
            return []
        out: list[Effect] = []
        self.routing.queue.cancel(req.wire_id)
        self._placement.stop_waiting(req.wire_id)
        self._forget(req)
        self._placement.drop_attempt(req, abort_reason, out)
        self._poll(out)
        return out

    def poll(self) -> list[Effect]:
        """Times out reservations past their deadline and re-runs admission (waiting requests whose
        route now fits or whose deadline passed). Call it at ``next_deadline()``."""
        out: list[Effect] = []
        for wire_id, worker_id in self._placement.expired(self.clock()):
            req = self._current(wire_id)
            if req is not None:  # else ended meanwhile
                self._placement.time_out(req, worker_id, out)
                self._try_next(req, out)
        self._poll(out)
        return out

    def next_deadline(self) -> float | None:
        """When ``poll`` must run next, on ``clock`` (None: nothing is timed)."""
        timed = (self._placement.next_timeout(), self.routing.queue.next_deadline())
        times = [t for t in timed if t is not None]
        return min(times) + 1e-3 if times else None  # a hair after: the deadline has surely passed

    # --- workers --------------------------------------------------------------------------------

    def on_message(self, msg: object) -> list[Effect]:
        """A control message from a worker."""
        out: list[Effect] = []
        if isinstance(msg, StepOutputs):
            for delta in msg.deltas:
                self._on_delta(msg.worker_id, delta, out)
        elif isinstance(msg, HandedOff):
            self.holders.done(msg.request_id, msg.worker_id)
            req = self._current(msg.request_id)
            if req is not None:
                out.append(Transferred(req.request_id, msg))
                self._released(req, msg.worker_id, out)
            self._poll(out)
        elif isinstance(msg, Heartbeat):
            info = self.registry.workers.get(msg.worker_id)
            refused_before = info is not None and info.out_of_blocks
            if not self.registry.heartbeat(msg):  # this router restarted, or gave the worker up
                out.append(Send(msg.worker_id, Reregister("the router does not know this worker")))
            else:
                self.routing.on_heartbeat(msg.worker_id, msg.received)
                if refused_before:
                    self._reports_changed(out)
                self._poll(out)
        elif isinstance(msg, Reserved):
            req = self._current(msg.request_id)
            if self._placement.reserved(msg, req, out):
                assert req is not None
                self._try_next(req, out)
        elif isinstance(msg, Register):
            if msg.worker_id in self.registry.workers:  # a new process under the old id: the old is gone
                out += self.worker_gone(msg.worker_id, "it registered again (restarted)")
            self.registry.register(msg)
            self._reports_changed(out)
            self._poll(out)
        else:
            raise TypeError(f"unexpected {type(msg).__name__} from a worker")
        return out

    def drain(self, worker_id: str, reason: str) -> list[Effect]:
        """Tells a worker to drain (no new requests from now on; it exits once those it holds are done,
        or after its ``drain_timeout_s``, when the ones left move elsewhere). ``KeyError``: unknown."""
        info = self.registry.workers[worker_id]
        info.drain_sent = True
        return [Send(worker_id, Drain(reason))]

    def worker_gone(self, worker_id: str, why: str) -> list[Effect]:
        """Drops a worker: each request it held ends with an error; a reservation it will never
        answer moves its request to the next route."""
        out: list[Effect] = []
        if self.registry.remove(worker_id) is None:
            return out
        failed, waiting = self.holders.worker_gone(worker_id)
        for wire_id in failed:
            req = self._current(wire_id)
            if req is not None:
                self._failover(req, WORKER_GONE, worker_id, f"worker {worker_id} failed: {why}", out)
        for wire_id in waiting:
            req = self._current(wire_id)
            if req is not None:
                req.reasons.append(f"{worker_id} is gone: {why}")
                self._try_next(req, out)
        self._reports_changed(out)
        self._poll(out)
        return out

    # --- internals ------------------------------------------------------------------------------

    def _poll(self, out: list[Effect]) -> None:
        if len(self.routing.queue):
            self._settle(self.routing.queue.poll(self.clock(), self.routing.fit), out)

    def _settle(self, outcomes: list[Outcome], out: list[Effect]) -> None:
        for outcome in outcomes:
            req = self._current(outcome.ticket.request_id)  # a request's first attempt, or a failover's
            if req is None:  # ended while waiting (the queue forgets it then; never in practice)
                self.routing.forget(outcome.ticket.request_id)
            elif outcome.action == ADMIT:
                assert outcome.ranking is not None
                req.choices, req.tried, req.no_room = outcome.ranking.choices, 0, False
                if not req.started:
                    req.waited_ms = outcome.waited_ms
                self._try_next(req, out)
            elif req.started and outcome.action == REJECT:  # a failover that found no room in time
                self.routing.forget(req.wire_id)
                fail(req, "; ".join([*req.reasons, f"no worker could take it ({outcome.reason})"]), out)
            elif outcome.action == REJECT:
                self._forget(req)
                out.append(Refused(req.request_id, 429, outcome.reason, outcome))

    def _try_next(self, req: RouterRequest, out: list[Effect]) -> None:
        """Starts the request on its next route that exists (``Placement.next_route``). With none left
        it is refused (503), or a failover's attempt fails."""
        if self._placement.next_route(req, out):
            return
        why = "no worker could take the request: " + "; ".join(req.reasons or ["no route fits it"])
        if req.started:  # a failover found no home: the client's stream ends with the error
            fail(req, why, out)
        else:
            self._forget(req)
            out.append(Refused(req.request_id, 503, why))

    def _on_delta(self, worker_id: str, delta: TokenDelta, out: list[Effect]) -> None:
        req = self._current(delta.request_id)
        if req is None:
            return  # already ended (aborted, failed or timed out), or from an attempt that failed
        if delta.finish_reason == "error":
            self.holders.done(req.wire_id, worker_id)
            self._failover(req, ERROR, worker_id, delta.error or f"worker {worker_id} reported an error", out)
            self._poll(out)
            return
        mine = req.from_wire(delta)
        if mine is None:
            return  # an output this attempt does not run
        if mine.finish_reason is not None:
            done = req.attempt_done(mine.choice)
            if done:  # the worker holds the request no longer
                self.holders.done(req.wire_id, worker_id)
            deliver(req, mine, out)
            if done:
                self._released(req, worker_id, out)
            self._poll(out)
        else:
            deliver(req, mine, out)

    def _released(self, req: RouterRequest, worker_id: str, out: list[Effect]) -> None:
        """A worker let go of ``req``'s attempt. If none holds it now and the client still misses
        tokens (a message lost on the way), nothing more will come: the request moves on from what
        the client has, as after a worker's failure, instead of waiting out its timeout."""
        if not req.finished and not self.holders.holders(req.wire_id):
            self._failover(req, TOKENS_LOST, worker_id, "the attempt ended with tokens never received", out)

    def _current(self, wire_id: str) -> RouterRequest | None:
        """The live request whose current attempt is ``wire_id`` (None: ended, or a failed attempt)."""
        req = self._wire.get(wire_id)
        return req if req is not None and req.wire_id == wire_id else None

    def _forget(self, req: RouterRequest) -> None:
        """Drops the request and every attempt's wire id."""
        self._requests.pop(req.request_id, None)
        for wire_id in req.wire_ids():
            self._wire.pop(wire_id, None)

    def _failover(
        self, req: RouterRequest, cause: str, worker_id: str, message: str, out: list[Effect]
    ) -> None:
        """Moves a started request off a failed attempt onto other workers (``Failover.move``), or ends
        it with the error when it has no failover left."""
        ticket = self._failovers.move(req, cause, worker_id, message, out)
        if ticket is None:
            return
        self._wire[req.wire_id] = req  # the new attempt's id on the wire
        if not has_route(self.registry, req.ticket.served):  # nothing to wait for: no worker pair left
            req.reasons.append("no route fits it (no_workers)")
            self._try_next(req, out)  # fails it, naming the reasons
            return
        # The new attempt asks admission like a new request, so with every worker full it waits for
        # room (until its deadline, or until the client's handler gives up on it) instead of failing.
        self._readmit(req, ticket, out)

    def _readmit(self, req: RouterRequest, ticket: Ticket, out: list[Effect]) -> None:
        """Hands the attempt back to admission: it starts when a route fits, waits, or is refused."""
        self._settle(self.routing.queue.arrive(ticket, self.clock(), self.routing.fit), out)

    def _reports_changed(self, out: list[Effect]) -> None:
        """A worker reported after refusing for want of blocks, or workers came or went: the attempts
        held for such news ask admission again."""
        for wire_id in self._placement.reported():
            req = self._current(wire_id)
            if req is not None:
                self._readmit(req, self._failovers.retry_ticket(req), out)
