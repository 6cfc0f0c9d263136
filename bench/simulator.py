"""A discrete-event simulator of the fabric, for capacity planning: a trace through the real policies.

The simulator runs the fabric's own decision code and replaces only what takes time, the model steps
and the KV transfers, by the fitted ``WorkerProfile`` and a transfer rate:

- the router: the server's own ``RouterCore`` (the registry of registrations and last heartbeats,
  candidates with the load sent since each heartbeat, the routing policy and the predictor, the
  ``AdmissionQueue`` with its classes and deadlines, the walk over the ranked routes, reservations,
  holders), fed the real worker messages; the simulation only carries out its effects;
- every worker (``bench.sim_worker``): the server's own worker core (``PrefillCore``, ``DecodeCore``,
  ``ColocatedCore``: admission, continuous batching, chunked prefill, preemption, hand-off, block
  accounting, heartbeats), fed the real control messages; only its step times come from the profile.

What the simulation adds to a request's life (told once in docs/architecture.md) is time:

1. arrival: at its arrival time (the bench client sends no ``slo``, no tenant header); waiting
   requests are polled when load changes (heartbeats, hand-offs, request ends) and at the core's
   next deadline;
2. a worker handles messages only between steps, as the real loop does: KV arrivals and
   acknowledgements first, then control messages, then the next step if it has work. A step lasts
   ``profile.step_seconds(shape)`` of what ``schedule()`` returned and its tokens leave at its end
   (token 0: the bench sends ``ignore_eos``);
3. a KV push starts at the end of the step that completes the prompt (whose first token goes to the
   router at once), moves whole blocks (``kv_bytes_per_token`` each token) at the slower of the two
   workers' ``kv_bytes_per_s``, one push at a time per worker link; the decode worker takes the KV at
   its next boundary and the prefill worker handles the acknowledgement at its next one, so its
   blocks are held until then and the push's bytes and seconds feed its heartbeat's KV rate exactly
   as in the server;
4. heartbeats: after a step once ``heartbeat_s`` has passed since the last one (a busy worker's waits
   for its step to end), on time when idle.

Client times are event times plus ``overhead_ms`` (router, HTTP and network, per token); a request
is sent exactly at its arrival time.

Left out: the router's own CPU time and tokenization (use ``overhead_ms``), contention between
workers that share cores or a memory bus (profile each worker as it will be deployed), variance of step
times around the fit, the loop-blocking KV pack and unpack copies (a few ms for a 512-token prompt on a
CPU, against steps of tens to hundreds), online refits of the profile, prefix caching, client aborts,
timeouts and failures (a request that could never finish ends as ``timeout``).

Embedding inputs (``Request.embed``) go through the router's own embedding core and batcher
(``router/dispatch/embedder.py``, ``[embeddings]`` of the config) to the workers' cores, which compute
them in their steps beside the rest; the client sees one event, the vector (its TTFT and end).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdfabric.bench.records import ERROR, OK, REJECTED, TIMEOUT, RequestRecord
from pdfabric.bench.sim_link import SimLink
from pdfabric.bench.sim_spec import SimWorker
from pdfabric.bench.sim_worker import SimulatedWorker
from pdfabric.bench.sse import spread_tokens
from pdfabric.bench.workload import Request, Workload
from pdfabric.control import COLOCATED, DECODE, PREFILL, Embedded, Heartbeat, Register, TokenDelta
from pdfabric.router.dispatch.core import RouterCore
from pdfabric.router.dispatch.effects import Deliver, Effect, Refused, Send
from pdfabric.router.dispatch.embedder import EmbedCore, EmbedDone
from pdfabric.router.routing.batcher import Batch
from pdfabric.router.routing.slo import resolve
from pdfabric.routing_config import AdmissionConfig, EmbeddingConfig, PredictorConfig
from pdfabric.sampling_params import SamplingParams

Progress = Callable[[int, int], None]  # (requests finished, requests in all)


def _prompt(r: Request) -> tuple[int, ...]:
    """Stand-in token ids for ``r``'s prompt that share a prefix with another request's exactly when
    the real prompts would, so that the workers' prefix caches hit as they would: block by
    ``hash_block``-token block along ``hash_ids`` (Mooncake traces), otherwise never (the
    request's own index leads)."""
    if not r.hash_ids:
        return (-1 - r.index,) + (0,) * (r.input_len - 1)
    ids: list[int] = []
    for h in r.hash_ids:
        ids += [h] * r.hash_block
    if len(ids) < r.input_len:  # more tokens than named blocks: the rest is the request's own
        ids += [-1 - r.index] * (r.input_len - len(ids))
    return tuple(ids[: r.input_len])


@dataclass(frozen=True)
class SimConfig:
    """A simulated deployment: its workers, the router's ``[routing]`` settings and the timing knobs."""

    workers: tuple[SimWorker, ...]
    routing: AdmissionConfig = field(default_factory=AdmissionConfig)
    predictor: PredictorConfig = field(default_factory=PredictorConfig)
    overhead_ms: float = 0.0  # added to every time the client sees (router, HTTP, network)
    embeddings: EmbeddingConfig = field(default_factory=EmbeddingConfig)  # how embedding inputs are batched

    def __post_init__(self) -> None:
        ids = [w.worker_id for w in self.workers]
        if len(set(ids)) != len(ids):
            raise ValueError(f"worker ids must be unique, got {ids}")
        kinds = {w.kind for w in self.workers}
        if COLOCATED not in kinds and not {PREFILL, DECODE} <= kinds:
            raise ValueError("a deployment needs a colocated worker, or prefill and decode workers")
        if not (math.isfinite(self.overhead_ms) and self.overhead_ms >= 0):
            raise ValueError(f"overhead_ms must be >= 0, got {self.overhead_ms}")


def simulate(config: SimConfig, workload: Workload, progress: Progress | None = None) -> list[RequestRecord]:
    """One RequestRecord per workload request, in index order; deterministic."""
    return Simulation(config, workload, progress).run()


# --- router side --------------------------------------------------------------------------------


@dataclass(eq=False)
class SimulatedRequest:
    """One request as the client sees it."""

    request: Request
    rid: str
    params: SamplingParams
    times: list[float] = field(default_factory=list)  # client arrival of each delta with tokens
    tokens: int = 0  # tokens those deltas carried (several when a speculating worker keeps proposals)
    end: float | None = None
    status: str = TIMEOUT
    http_status: int | None = None
    finish_reason: str | None = None
    error: str | None = None


class Simulation:
    """The event loop, the router and the workers of one run; ``run()`` once."""

    def __init__(self, config: SimConfig, workload: Workload, progress: Progress | None = None) -> None:
        self.config = config
        self.workload = workload
        self.progress = progress
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[Any], None], Any, bool]] = []
        self._seq = 0
        self._work = 0  # queued events other than heartbeat timers
        self._done = 0
        self._armed: float | None = None  # the router's deadline a poll is queued for
        self._overhead = config.overhead_ms / 1e3
        self.router = RouterCore(config.routing, config.predictor, clock=lambda: self.now)
        self.registry = self.router.registry
        self.embedder = EmbedCore(self.registry, config.embeddings, lambda: self.now, max_failovers=0)
        self.batches: list[Batch] = []  # every batch of embedding inputs sent, in order
        self._embed_armed: float | None = None
        self.workers = {w.worker_id: SimulatedWorker(self, w) for w in config.workers}
        self.link = SimLink(self.workers, lambda: self.now, self.at)  # the workers' KV side
        self._reqs: dict[str, SimulatedRequest] = {}
        resolved = resolve(config.routing, None, "default")  # what the bench client gets
        self._budgets, self._class, self._tenant = (
            resolved.budgets,
            resolved.slo_class.name,
            resolved.tenant.name,
        )
        for w in self.workers.values():
            self._apply(self.router.on_message(w.registration()))
            self.at(0.0, w.heartbeat_timer, 0.0, work=False)
        for i, r in enumerate(workload.requests):
            self.at(r.arrival_s, self._arrive, i)

    def at(self, t: float, fn: Callable[[Any], None], arg: Any = None, work: bool = True) -> None:
        """Runs ``fn(arg)`` at time ``t`` (after everything queued before for that time)."""
        self._seq += 1
        self._work += work
        heapq.heappush(self._heap, (t, self._seq, fn, arg, work))

    def run(self) -> list[RequestRecord]:
        total = len(self.workload.requests)
        heap, pop = self._heap, heapq.heappop
        while heap and self._work:  # heartbeat timers alone never end a run
            t, _, fn, arg, work = pop(heap)
            self.now = t
            self._work -= work
            fn(arg)
        if self.progress is not None:
            self.progress(self._done, total)
        return [self._record(self._reqs.get(str(i)), r) for i, r in enumerate(self.workload.requests)]

    def free_blocks(self) -> dict[str, tuple[int, int]]:
        """(free, total) KV blocks of every worker (after ``run``: all free unless blocks leaked)."""
        return {wid: (w.tables.pool.num_free, w.tables.pool.num_blocks) for wid, w in self.workers.items()}

    # --- requests -------------------------------------------------------------------------------

    def _arrive(self, i: int) -> None:
        """The HTTP handler: the context-window check, then the router's ``submit``."""
        r = self.workload.requests[i]
        rid = str(i)
        req = SimulatedRequest(r, rid, SamplingParams(max_tokens=r.output_len, ignore_eos=True))
        self._reqs[rid] = req
        limit = self.registry.max_model_len()
        if (
            r.embed
            and r.input_len > limit
            or not r.embed
            and (r.input_len >= limit or r.output_len > limit - r.input_len)
        ):  # the router's 400
            self._end(req, ERROR, 400, f"prompt and output exceed the {limit}-token context window")
            return
        prompt = _prompt(r)
        if r.embed:
            budget_s = (self.config.embeddings.budget_ms or self._budgets.ttft_ms) / 1e3
            self._apply(self.embedder.submit(rid, prompt, "last", True, "", self.now + budget_s))
            return
        self._apply(self.router.submit(rid, prompt, req.params, (), self._tenant, self._class, self._budgets))

    def receive(self, msg: object) -> None:
        """A message from a worker to the router."""
        if isinstance(msg, Embedded):
            self._apply(self.embedder.on_result(msg))
            return
        self._apply(self.router.on_message(msg))
        if isinstance(msg, Heartbeat | Register):  # a worker's load changed: embedding batches may be due
            self._apply(self.embedder.poll())

    def _apply(self, effects: list[Effect]) -> None:
        """Carries out the router's effects (the dispatcher's part), then re-arms its deadline poll."""
        for effect in effects:
            if isinstance(effect, Send):
                self.workers[effect.worker_id].post(effect.msg)
            elif isinstance(effect, Deliver):
                self._token(self._reqs[effect.request_id], effect.delta)
            elif isinstance(effect, Refused):
                req = self._reqs[effect.request_id]
                why = f"HTTP 429 ({effect.message})" if effect.status == 429 else effect.message
                self._end(req, REJECTED, effect.status, why)
            elif isinstance(effect, EmbedDone):
                self._embedded(self._reqs[effect.request_id], effect)
            elif isinstance(effect, Batch):
                self.batches.append(effect)
        deadline = self.router.next_deadline()
        if deadline is not None and deadline != self._armed:
            self._armed = deadline
            self.at(deadline, self._deadline_poll, deadline)
        due = self.embedder.next_deadline()
        if due is not None and due != self._embed_armed:
            self._embed_armed = due
            self.at(due, self._embed_poll, due)

    def _embed_poll(self, due: float) -> None:
        if due == self._embed_armed:
            self._embed_armed = None
            self._apply(self.embedder.poll())

    def _embedded(self, req: SimulatedRequest, done: EmbedDone) -> None:
        """An embedding input's vector (or error) reaching the client: its one event."""
        if done.error:
            self._end(req, ERROR, 503, done.error)
            return
        req.times.append(self.now + self._overhead)
        req.finish_reason = "stop"
        self._end(req, OK, 200, None)

    def _deadline_poll(self, deadline: float) -> None:
        if deadline == self._armed:
            self._armed = None
            self._apply(self.router.poll())

    def _token(self, req: SimulatedRequest, delta: TokenDelta) -> None:
        """A delta reaching the client: a token (or none) and maybe the request's finish reason."""
        if req.end is not None:
            return
        if delta.token_ids:
            req.times.append(self.now + self._overhead)
            req.tokens += len(delta.token_ids)
        if delta.finish_reason is not None:
            if delta.finish_reason == "error" or not req.times:
                self._end(req, ERROR, 200, f"finish_reason {delta.finish_reason}")
            else:
                req.finish_reason = delta.finish_reason
                self._end(req, OK, 200, None)

    def _end(self, req: SimulatedRequest, status: str, http_status: int, error: str | None) -> None:
        """The request is over for the client; the handler's ``release`` runs after this event (workers
        still holding it get an abort)."""
        req.end = self.now + self._overhead
        req.status, req.http_status, req.error = status, http_status, error
        self._done += 1
        if self.progress is not None and self._done % 1024 == 0:
            self.progress(self._done, len(self.workload.requests))
        self.at(self.now, self._release, req.rid)

    def _release(self, rid: str) -> None:
        if self._reqs[rid].request.embed:
            self._apply(self.embedder.end(rid))
            return
        self._apply(self.router.end(rid, "request ended"))

    def _record(self, req: SimulatedRequest | None, r: Request) -> RequestRecord:
        if req is None or req.end is None:  # never finished: the run ran out of events
            return RequestRecord(
                r.index,
                r.arrival_s,
                r.arrival_s,
                r.input_len,
                r.output_len,
                TIMEOUT,
                error="no progress: the simulated deployment could not finish it",
            )
        ms = [(t - r.arrival_s) * 1e3 for t in req.times]
        # as the bench client counts a stream's tokens (an embedding input streams none)
        tokens, gaps = spread_tokens(ms, req.tokens) if not r.embed else (0, [])
        return RequestRecord(
            index=r.index, scheduled_s=r.arrival_s, sent_s=r.arrival_s, input_len=r.input_len,
            output_len=r.output_len, status=req.status, http_status=req.http_status,
            ttft_ms=ms[0] if ms else None, e2e_ms=(req.end - r.arrival_s) * 1e3, output_tokens=tokens,
            token_count_source="usage", chunk_ms=ms, itl_ms=gaps,
            finish_reason=req.finish_reason, error=req.error,
        )  # fmt: skip
