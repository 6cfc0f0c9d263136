"""Sends requests to workers over the control socket and routes their tokens back.

A request's life in the router:
1. ``submit`` asks admission control (``routing.Routing``) for routes that meet the request's budgets,
   waiting in its queue if need be (``Rejected``, a 429, if none will); then it tries them best first:
   a colocated worker gets ``Generate``; for a disaggregated pair the decode worker is asked to
   ``Reserve`` blocks first (the next route is tried if it has no room), then the prefill worker gets
   ``Prefill`` with those block ids.
2. Token deltas arrive from the workers (the first token from the prefill worker, the rest from the
   decode worker), are put back in output order and handed to the request's ``RequestStream``.
3. The request ends on the finishing delta, on ``abort`` (client gone, stop string), on an error
   from any worker holding it, on that worker's death, or on a timeout; every worker still holding it
   is sent ``Abort`` so its blocks come back. ``holders.Holders`` is the one record of which workers
   hold it (a reservation asked for included) and ``release`` the one place that lets them go.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from pdfabric.control import (
    Abort,
    Generate,
    HandedOff,
    Heartbeat,
    Prefill,
    Register,
    Reserve,
    Reserved,
    Shutdown,
    StepOutputs,
    TokenDelta,
)
from pdfabric.engine.sampling_params import SamplingParams
from pdfabric.router.admission import REJECT, Ticket
from pdfabric.router.holders import Holders
from pdfabric.router.openai_api import ApiError
from pdfabric.router.registry import Registry, Route, WorkerInfo, has_route
from pdfabric.router.routes import Choice, PredictorConfig
from pdfabric.router.routing import Rejected, Routing, route_of
from pdfabric.router.slo import AdmissionConfig, Resolved
from pdfabric.wire import WireError, decode, encode

log = logging.getLogger("pdfabric.router")


@dataclass
class RequestStream:
    """One request's deltas, in output order, for the HTTP handler to consume."""

    request_id: str
    prompt_len: int
    queue: asyncio.Queue[TokenDelta] = field(default_factory=asyncio.Queue)
    next_index: int = 0
    pending: dict[int, TokenDelta] = field(default_factory=dict)
    finished: bool = False
    route: str = ""
    choice: Choice | None = None  # the route taken, with its predicted latencies
    waited_ms: float = 0.0  # time spent waiting for admission in the router
    transfer_s: float | None = None  # KV push, start to acknowledgement (0 colocated; None: not yet told)

    def deliver(self, delta: TokenDelta) -> None:
        """Queues ``delta`` once everything before it has been queued."""
        if self.finished:
            return
        if delta.finish_reason in ("error", "abort"):  # failures jump the queue
            self._put(delta)
            return
        self.pending[delta.index] = delta
        while self.next_index in self.pending:
            d = self.pending.pop(self.next_index)
            self.next_index += len(d.token_ids)
            self._put(d)
            if self.finished or not d.token_ids:
                break

    def fail(self, message: str) -> None:
        self.deliver(TokenDelta(self.request_id, self.next_index, (), (), "error", message))

    def _put(self, delta: TokenDelta) -> None:
        if delta.finish_reason is not None:
            self.finished = True
        self.queue.put_nowait(delta)


class Dispatcher:
    def __init__(
        self,
        bind: str,
        worker_timeout_s: float,
        reserve_timeout_s: float = 5.0,
        admission: AdmissionConfig | None = None,
        predictor: PredictorConfig | None = None,
    ) -> None:
        self.registry = Registry()
        self.routing = Routing(self.registry, admission, predictor)
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        port = self.sock.bind_to_random_port(bind.rsplit(":", 1)[0]) if bind.endswith(":0") else None
        if port is None:
            self.sock.bind(bind)
            self.address = bind
        else:
            self.address = f"{bind.rsplit(':', 1)[0]}:{port}"
        self.worker_timeout_s = worker_timeout_s
        self.reserve_timeout_s = reserve_timeout_s
        self.streams: dict[str, RequestStream] = {}
        self.holders: Holders[asyncio.Future[Reserved]] = self.routing.holders
        self._tasks: list[asyncio.Task[None]] = []
        self.on_register: Callable[[WorkerInfo], None] | None = None
        self.on_handed_off: Callable[[HandedOff], None] | None = None  # e.g. transfer metrics

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._liveness_loop())]

    async def close(self) -> None:
        for w in list(self.registry.workers):
            self._send(w, Shutdown("router stopping"))
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.sock.close(linger=200)
        self.ctx.term()

    # --- requests -------------------------------------------------------------------------------

    async def submit(
        self,
        request_id: str,
        prompt_ids: tuple[int, ...],
        params: SamplingParams,
        eos_token_ids: tuple[int, ...],
        resolved: Resolved,
    ) -> RequestStream:
        """Starts the request on a route that meets its budgets (``resolved``). Raises ``Rejected``
        (429) when admission control turns it away and ``ApiError`` (503) when no worker can take it.
        Its TTFT budget counts from here."""
        if not has_route(self.registry):
            raise ApiError(
                503, "no worker can serve this request now", kind="server_error", retry_after_s=1.0
            )
        tenant, cls = resolved.tenant.name, resolved.slo_class.name
        arrived = self.routing.clock()
        ticket = Ticket(request_id, tenant, cls, resolved.budgets, len(prompt_ids), arrived)
        outcome = await self.routing.admit(ticket)
        if outcome.action == REJECT:
            raise Rejected(outcome)
        assert outcome.ranking is not None
        stream = RequestStream(request_id, len(prompt_ids), waited_ms=outcome.waited_ms)
        self.streams[request_id] = stream
        reasons = []
        try:
            for choice in outcome.ranking.choices:
                route = route_of(self.registry, choice)
                if route is None:
                    reasons.append(f"{choice.prefill}/{choice.decode} is gone")
                    continue
                reason = await self._start(stream, route, prompt_ids, params, eos_token_ids)
                if reason is None:
                    self.routing.routed(request_id, len(prompt_ids), choice)
                    stream.choice = choice
                    return stream
                reasons.append(reason)
        except BaseException:  # cancelled (client gone) while starting: abort what was started
            self.routing.forget(request_id)
            self.release(request_id, "request cancelled")
            raise
        self.routing.forget(request_id)
        self.release(request_id, None)  # every route let go of it already
        raise ApiError(
            503,
            "no worker could take the request: " + "; ".join(reasons),
            kind="server_error",
            retry_after_s=1.0,
        )

    async def _start(
        self,
        stream: RequestStream,
        route: Route,
        prompt_ids: tuple[int, ...],
        params: SamplingParams,
        eos: tuple[int, ...],
    ) -> str | None:
        rid = stream.request_id
        if route.colocated is not None:
            self.holders.hold(rid, route.colocated.worker_id)
            stream.route = route.colocated.worker_id
            stream.transfer_s = 0.0  # its KV never moves
            self._send(route.colocated.worker_id, Generate(rid, prompt_ids, params, eos))
            return None
        assert route.decode is not None and route.prefill is not None
        decode_id = route.decode.worker_id
        future: asyncio.Future[Reserved] = asyncio.get_running_loop().create_future()
        self.holders.reserving(rid, decode_id, future)  # a cancel from here on aborts it there too
        self._send(decode_id, Reserve(rid, prompt_ids, params, eos))
        try:
            reply = await asyncio.wait_for(future, self.reserve_timeout_s)
        except TimeoutError:
            self._let_go(rid, decode_id, "reserve timed out")
            return f"{decode_id} did not answer a reservation in {self.reserve_timeout_s:.0f}s"
        if not reply.block_ids:
            self.holders.done(rid, decode_id)
            return f"{decode_id}: {reply.reason}"
        if route.prefill.worker_id not in self.registry.workers or stream.finished:
            self._let_go(rid, decode_id, "prefill worker gone")
            return f"{route.prefill.worker_id} is gone"
        self.holders.hold(rid, route.prefill.worker_id)  # the decode worker holds it since `reserving`
        stream.route = f"{route.prefill.worker_id}->{decode_id}"
        self._send(
            route.prefill.worker_id,
            Prefill(rid, prompt_ids, params, eos, route.decode.reg.kv_endpoint, reply.block_ids),
        )
        return None

    def _let_go(self, request_id: str, worker_id: str, abort_reason: str) -> None:
        """One worker stops holding a request that goes on elsewhere (or nowhere): it gets an ``Abort``."""
        if self.holders.done(request_id, worker_id):
            self._send(worker_id, Abort(request_id, abort_reason))

    def release(self, request_id: str, abort_reason: str | None) -> None:
        """Forgets a request; if ``abort_reason`` is given, tells every worker still holding it."""
        stream = self.streams.pop(request_id, None)
        if stream is None:
            return
        for worker_id in self.holders.end(request_id):
            if abort_reason is not None and worker_id in self.registry.workers:
                self._send(worker_id, Abort(request_id, abort_reason))
        self.routing.poll()

    # --- workers --------------------------------------------------------------------------------

    def worker_gone(self, worker_id: str, why: str) -> None:
        """Drops a worker; each request it held ends with an error."""
        info = self.registry.remove(worker_id)
        if info is None:
            return
        log.warning("worker %s gone: %s", worker_id, why)
        failed, waiting = self.holders.worker_gone(worker_id)
        for rid in failed:
            stream = self.streams.get(rid)
            if stream is not None:
                stream.fail(f"worker {worker_id} failed: {why}")
        for fut in waiting:  # their requests try the next route
            if not fut.done():
                fut.set_result(Reserved(worker_id, "", (), f"worker gone: {why}"))
        self.routing.poll()

    def _send(self, worker_id: str, msg: object) -> None:
        try:
            self.sock.send_multipart([worker_id.encode(), encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # unroutable (worker gone) or its queue full
            log.warning("cannot send %s to %s: %s", type(msg).__name__, worker_id, exc)

    async def _recv_loop(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            if len(frames) != 2:
                log.error("dropping a control message of %d frames", len(frames))
                continue
            try:
                msg = decode(frames[1])
            except WireError as exc:
                log.error("bad control frame from %r: %s", frames[0], exc)
                continue
            try:
                self._on_message(msg)
            except Exception:  # one bad message must not stop the router from hearing its workers
                log.exception("error handling %s", type(msg).__name__)

    def _on_message(self, msg: object) -> None:
        if isinstance(msg, StepOutputs):
            for delta in msg.deltas:
                self._on_delta(msg.worker_id, delta)
        elif isinstance(msg, HandedOff):
            self.holders.done(msg.request_id, msg.worker_id)
            stream = self.streams.get(msg.request_id)
            if stream is not None:
                stream.transfer_s = msg.kv_seconds
            if self.on_handed_off is not None:
                self.on_handed_off(msg)
            self.routing.poll()
        elif isinstance(msg, Heartbeat):
            if not self.registry.heartbeat(msg):
                self._send(msg.worker_id, Shutdown("unknown worker: register first"))
            else:
                self.routing.on_heartbeat(msg.worker_id)
        elif isinstance(msg, Reserved):
            fut = self.holders.replied(msg.request_id, msg.worker_id)
            if fut is not None and not fut.done():
                fut.set_result(msg)
            elif msg.block_ids:  # the reservation was given up on: give the blocks back
                self._send(msg.worker_id, Abort(msg.request_id, "reservation no longer wanted"))
        elif isinstance(msg, Register):
            info = self.registry.register(msg)
            log.info(
                "worker %s registered (%s, pool %s, %d blocks)",
                msg.worker_id,
                msg.kind,
                msg.pool,
                msg.num_blocks,
            )
            if self.on_register is not None:
                self.on_register(info)
            self.routing.poll()
        else:
            log.error("unexpected %s on the control socket", type(msg).__name__)

    def _on_delta(self, worker_id: str, delta: TokenDelta) -> None:
        stream = self.streams.get(delta.request_id)
        if stream is None:
            return  # already ended (aborted, failed or timed out)
        if delta.finish_reason is not None:
            self.holders.done(delta.request_id, worker_id)
            self.routing.poll()
        stream.deliver(delta)

    async def _liveness_loop(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.worker_timeout_s / 4))
            for worker_id in self.registry.expired(self.worker_timeout_s):
                self.worker_gone(worker_id, f"no heartbeat for {self.worker_timeout_s:.0f}s")
