"""The serving router's I/O around its ``core.RouterCore``: the control socket, the event loop, and the
request streams the HTTP handlers read.

Every decision (admission, the route walk, reservations and their timeouts, who holds what, token
order, what a dead worker means) is the core's; the ``Dispatcher`` feeds it the calls and worker
messages, carries out the effects it returns (sends on the socket, starts and refusals to the
waiting ``submit``, deltas to the request's ``RequestStream``) and wakes it at its next deadline.
A request's life is in ``core``'s docstring; here:
1. ``submit`` awaits the request's start (``Started``) or refusal (``Refusal``, which the HTTP front
   answers as a 429 or a 503); a client gone while it waits ends it in the core (its holders get
   ``Abort``);
2. the stream gets the request's deltas in output order, ending with the one that carries a finish
   reason; a failed worker's requests move to others (``FailedOver``: logged and counted) and their
   streams go on, and an error ends a stream only when a request cannot move;
3. the HTTP handler calls ``release`` when it is done with the request, however it ended.

Others read the core through ``fleet`` (a read-only view) and hear of hand-offs and failovers as
``DispatchEvents`` (``listen``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection
from typing import Protocol

import zmq
import zmq.asyncio

from pdfabric.cluster_secret import REFUSED_EVENTS, ClusterSecret, Refusals, authenticate, stop_authenticating
from pdfabric.control import Embedded, HandedOff, Heartbeat, Register, Shutdown
from pdfabric.router.dispatch.core import RouterCore
from pdfabric.router.dispatch.effects import Deliver, FailedOver, Refused, Send, Started, Transferred
from pdfabric.router.dispatch.embedder import EmbedCore, EmbedDone
from pdfabric.router.dispatch.fleet import Fleet
from pdfabric.router.dispatch.stream import RequestStream
from pdfabric.router.routing.batcher import Batch
from pdfabric.router.routing.registry import WorkerInfo
from pdfabric.router.routing.slo import Resolved
from pdfabric.routing_config import AdmissionConfig, EmbeddingConfig, PredictorConfig
from pdfabric.sampling_params import SamplingParams
from pdfabric.wire import WireError, decode, encode

log = logging.getLogger("pdfabric.router")
CLOSE_WAIT_S = 5.0  # how long close() waits for its loops to stop once cancelled


class Refusal(Exception):
    """``submit``'s answer for a request that never started: ``refused.outcome`` when admission
    control turned it away, else no worker could take it (``refused.message``)."""

    def __init__(self, refused: Refused) -> None:
        super().__init__(refused.message)
        self.refused = refused


class DispatchEvents(Protocol):
    """What a listener (``Dispatcher.listen``) hears: each KV hand-off, with the prefill worker that
    reported it (None: gone meanwhile), each request moved to other workers, and each batch of
    embedding inputs sent to a worker."""

    def handed_off(self, msg: HandedOff, worker: WorkerInfo | None) -> None: ...

    def failed_over(self, moved: FailedOver) -> None: ...

    def batched(self, batch: Batch) -> None: ...


class Dispatcher:
    def __init__(
        self,
        bind: str,
        worker_timeout_s: float,
        reserve_timeout_s: float = 5.0,
        admission: AdmissionConfig | None = None,
        predictor: PredictorConfig | None = None,
        max_failovers: int = 2,
        secret: ClusterSecret | None = None,
        embeddings: EmbeddingConfig | None = None,
    ) -> None:
        """Binds the control socket at ``bind`` (a port of 0: a free one; ``address`` says which).
        With a ``secret`` (what ``pdfabric serve`` always gives) only peers that hold it can speak on
        it (ZeroMQ CURVE; ``pdfabric.cluster_secret``); the others' handshakes are refused, logged
        and counted (``fleet.refused_peers``). Construct it on the event loop that will run it."""
        self._core = RouterCore(admission, predictor, reserve_timeout_s, max_failovers=max_failovers)
        self._registry = self._core.registry
        self._embedder = EmbedCore(
            self._registry, embeddings or EmbeddingConfig(), self._core.clock, max_failovers
        )
        self._embeds: dict[str, asyncio.Future[EmbedDone]] = {}
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.refusals = Refusals("control")
        self._monitor: zmq.asyncio.Socket | None = None
        if secret is not None:
            authenticate(self.ctx, secret)
            secret.serve(self.sock)
            self._monitor = self.sock.get_monitor_socket(REFUSED_EVENTS)
        port = self.sock.bind_to_random_port(bind.rsplit(":", 1)[0]) if bind.endswith(":0") else None
        if port is None:
            self.sock.bind(bind)
            self.address = bind
        else:
            self.address = f"{bind.rsplit(':', 1)[0]}:{port}"
        self.worker_timeout_s = worker_timeout_s
        self.streams: dict[str, RequestStream] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._listeners: list[DispatchEvents] = []
        self.restarts: dict[str, int] = {}  # worker id -> times its supervisor started it again
        self.down: dict[str, str] = {}  # worker id -> why its supervisor gave up on it
        self.fleet = Fleet(self._core, self.restarts, self.down, self.refusals)

    def listen(self, listener: DispatchEvents) -> None:
        """Tells ``listener`` of every hand-off and failover from now on (e.g. metrics)."""
        self._listeners.append(listener)

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._liveness_loop())]
        if self._monitor is not None:
            self._tasks.append(asyncio.create_task(self._refusals_loop(self._monitor)))

    async def close(self, shutdown: Collection[str] | None = None) -> None:
        """Stops the router. The workers in ``shutdown`` (default: all) are told to exit; the others
        (workers that joined from elsewhere) stay and register again with the next router."""
        for w in list(self._registry.workers):
            if shutdown is None or w in shutdown:
                self._send(w, Shutdown("router stopping"))
        if self._timer is not None:
            self._timer.cancel()
        for t in self._tasks:
            t.cancel()
        if self._tasks:  # bounded: a loop stuck in a socket call must not hold the router's exit
            done, stuck = await asyncio.wait(self._tasks, timeout=CLOSE_WAIT_S)
            for t in done:  # a loop that had died of an error before: say so (and retrieve it)
                if not t.cancelled() and t.exception() is not None:
                    log.error("router loop %s had failed", t, exc_info=t.exception())
            for t in stuck:
                log.warning("router loop %s did not stop within %.0f s of being cancelled", t, CLOSE_WAIT_S)
        if self._monitor is not None:
            self.sock.disable_monitor()
            self._monitor.close(linger=0)
        stop_authenticating(self.ctx)
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
        *,
        deadline: float | None = None,
        n: int = 1,
        served: str = "",
    ) -> RequestStream:
        """Starts the request on a route that meets its budgets (``resolved``) and its ``deadline``
        (``time.monotonic()`` seconds; None: none), with ``n`` outputs from one computed prompt.
        Raises ``Refusal`` when admission control turns it away or no worker can take it. Its TTFT
        budget counts from here. ``served``: the model version whose workers run it
        (``catalog.Version.key``)."""
        stream = RequestStream(request_id, len(prompt_ids), n)
        stream.started = asyncio.get_running_loop().create_future()
        self.streams[request_id] = stream
        try:
            self._apply(
                self._core.submit(
                    request_id, prompt_ids, params, eos_token_ids, resolved.tenant.name,
                    resolved.slo_class.name, resolved.budgets, deadline=deadline, n=n, served=served,
                )  # fmt: skip
            )
            await stream.started
        except BaseException:  # refused, or cancelled (client gone) while waiting or starting
            self.release(request_id, "request cancelled")
            raise
        finally:
            stream.started = None
        return stream

    def release(self, request_id: str, abort_reason: str | None) -> None:
        """Forgets a request; if ``abort_reason`` is given, tells every worker still holding it."""
        self.streams.pop(request_id, None)
        self._apply(self._core.end(request_id, abort_reason))

    async def embed(
        self, request_id: str, inputs: list[tuple[int, ...]], pooling: str, normalize: bool, served: str,
        deadline: float, priority: int = 0, background: bool = False,
    ) -> list[EmbedDone]:  # fmt: skip
        """Each input's pooled vector (or error), in order: batched with other requests' inputs of the
        same kind (``embedder``), due at ``deadline`` (``time.monotonic()`` seconds). A caller that is
        cancelled ends its inputs (those running get an ``Abort``)."""
        loop = asyncio.get_running_loop()
        ids = [f"{request_id}-{i}" for i in range(len(inputs))]
        futures = [loop.create_future() for _ in ids]
        self._embeds.update(zip(ids, futures, strict=True))
        try:
            embedder = self._embedder
            for rid, prompt_ids in zip(ids, inputs, strict=True):
                self._apply(
                    embedder.submit(
                        rid, prompt_ids, pooling, normalize, served, deadline, priority, background
                    )
                )
            return list(await asyncio.gather(*futures))
        finally:
            for rid in ids:
                self._embeds.pop(rid, None)
                self._apply(self._embedder.end(rid))

    # --- workers --------------------------------------------------------------------------------

    def drain_worker(self, worker_id: str, reason: str) -> None:
        """Tells a worker to drain (``KeyError``: no such worker); new requests go elsewhere at once."""
        log.warning("draining worker %s: %s", worker_id, reason)
        self._apply(self._core.drain(worker_id, reason))

    def worker_gone(self, worker_id: str, why: str) -> None:
        """Drops a worker; each request it held ends with an error."""
        if worker_id in self._registry.workers:
            log.warning("worker %s gone: %s", worker_id, why)
        self._apply(self._core.worker_gone(worker_id, why))
        self._apply(self._embedder.worker_gone(worker_id, why))

    # --- the core's effects ---------------------------------------------------------------------

    def _apply(self, effects: list) -> None:  # the cores' effects (``Effect``, ``EmbedDone``)
        for effect in effects:
            if isinstance(effect, EmbedDone):
                future = self._embeds.get(effect.request_id)
                if future is not None and not future.done():
                    future.set_result(effect)
                continue
            if isinstance(effect, Batch):
                for listener in self._listeners:
                    listener.batched(effect)
                continue
            if isinstance(effect, Send):
                self._send(effect.worker_id, effect.msg)
                continue
            if isinstance(effect, FailedOver):
                log.warning(
                    "request %s moves to other workers after %d tokens: %s",
                    effect.request_id, effect.resumed_at, effect.message,
                )  # fmt: skip
                for listener in self._listeners:
                    listener.failed_over(effect)
            stream = self.streams.get(effect.request_id)
            if stream is None:
                continue
            if isinstance(effect, Deliver):
                stream.cached_tokens = max(stream.cached_tokens, effect.delta.cached_tokens)
                stream.generated += len(effect.delta.token_ids)
                stream.put(effect.delta)
            elif isinstance(effect, Started):
                stream.route, stream.choice, stream.waited_ms = effect.route, effect.choice, effect.waited_ms
                if effect.choice.colocated:
                    stream.transfer_s = 0.0  # its KV never moves
                if stream.started is not None and not stream.started.done():
                    stream.started.set_result(None)
            elif isinstance(effect, Refused):
                self.streams.pop(effect.request_id, None)
                if stream.started is not None and not stream.started.done():
                    stream.started.set_exception(Refusal(effect))
            elif isinstance(effect, Transferred):
                stream.transfer_s = effect.msg.kv_seconds
        self._arm()

    def _arm(self) -> None:
        """Wakes the core at its next deadline (one timer at a time)."""
        times = [t for t in (self._core.next_deadline(), self._embedder.next_deadline()) if t is not None]
        at = min(times) if times else None
        if at == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = None, at
        if at is not None:
            delay = max(0.0, at - self._core.clock())
            self._timer = asyncio.get_running_loop().call_later(delay, self._wake)

    def _wake(self) -> None:
        self._timer = self._timer_at = None
        self._apply(self._core.poll())
        self._apply(self._embedder.poll())

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
        if isinstance(msg, Embedded):
            self._apply(self._embedder.on_result(msg))
            return
        if isinstance(msg, Register) and msg.worker_id in self._registry.workers:  # a new process
            self._apply(self._embedder.worker_gone(msg.worker_id, "it registered again (restarted)"))
        self._apply(self._core.on_message(msg))
        if isinstance(msg, Heartbeat | Register):  # a worker's load or a new worker: batches may be due
            self._apply(self._embedder.poll())
        if isinstance(msg, Register):
            log.info("worker %s registered (%s, pool %s)", msg.worker_id, msg.kind, msg.pool)
        elif isinstance(msg, HandedOff):
            for listener in self._listeners:
                listener.handed_off(msg, self._registry.workers.get(msg.worker_id))

    async def _refusals_loop(self, monitor: zmq.asyncio.Socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self.refusals.note(await monitor.recv_multipart(), loop.time())

    async def _liveness_loop(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.worker_timeout_s / 4))
            for worker_id in self._registry.expired(self.worker_timeout_s):
                self.worker_gone(worker_id, f"no heartbeat for {self.worker_timeout_s:.0f}s")
