"""A discrete-event simulator of the fabric, for capacity planning: a trace through the real policies.

The simulator runs the fabric's own decision code and replaces only what takes time, the model steps
and the KV transfers, by the fitted ``WorkerProfile`` and a transfer rate:

- the router: a ``Registry`` of the workers' registrations and last heartbeats, ``Routing`` (candidates
  with the load sent since each heartbeat, the routing policy and the predictor, the
  ``AdmissionQueue`` with its classes and deadlines), and the dispatcher's walk over the ranked routes;
- every worker: the torch-free ``Scheduler`` over ``BlockTables`` of its own block count (continuous
  batching, chunked prefill, preemption, hand-off), with ``on_prefilled="handoff"`` on prefill workers.

A request's life in the simulation, following the real processes:

1. it reaches the router at its arrival time (the bench client sends no ``slo``, no tenant header);
   ``AdmissionQueue.arrive`` admits, queues or rejects it (429). Waiting requests are polled when load
   changes (heartbeats, hand-offs, request ends) and at the queue's next deadline;
2. admitted: its routes are tried best first. A colocated worker gets the prompt. For a pair, the
   decode worker is asked to reserve blocks; it answers at its next step boundary; with blocks, the
   prefill worker gets the prompt, without, the next route is tried; none left: 503;
3. a worker handles messages only between steps, as the real loop does: KV arrivals and
   acknowledgements first, then control messages, then the next step if it has work. A step lasts
   ``profile.step_seconds(shape)`` of what ``schedule()`` returned and its tokens leave at its end;
4. prefill worker: the step that completes a prompt sends its first token to the router at once (the
   client's TTFT does not include the transfer) and starts the KV push of the prompt's blocks (whole
   blocks, ``kv_bytes_per_token`` each token) at the slower of the two workers' ``kv_bytes_per_s``,
   one push at a time per worker link; the blocks stay held until the decode worker's acknowledgement
   is handled at the prefill worker's next boundary;
5. decode worker: the KV is handled at its next boundary (the first token rides on it); the sequence
   joins the running batch and gets one token per step until its output length (the bench sends
   ``ignore_eos``);
6. heartbeats: after a step once ``heartbeat_s`` has passed since the last one (a busy worker's heartbeat
   waits for its step to end), on time when idle; each reports the scheduler's load as the real one
   does (and a KV rate of 0, as the real workers do today) and clears the router's pending load.

Client times are event times plus ``overhead_ms`` (router, HTTP and network, per token); a request
is sent exactly at its arrival time.

Left out: the router's own CPU time and tokenization (use ``overhead_ms``), contention between
workers that share cores or a memory bus (profile each worker as it will be deployed), variance of step
times around the fit, the loop-blocking KV pack and unpack copies (a few ms for a 512-token prompt on a
CPU, against steps of tens to hundreds), online refits of the profile, prefix caching, client aborts,
timeouts and failures (a request that could never finish ends as ``timeout``).
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdfabric.bench.records import ERROR, OK, REJECTED, TIMEOUT, RequestRecord
from pdfabric.bench.workload import Request, Workload
from pdfabric.control import COLOCATED, DECODE, KINDS, PREFILL, Heartbeat, Register
from pdfabric.engine.block_pool import BlockPool, BlockTables
from pdfabric.engine.sampling_params import SamplingParams
from pdfabric.engine.scheduler import Chunk, Scheduler, SchedulerConfig, step_shape
from pdfabric.engine.sequence import SeqState, Sequence
from pdfabric.profile import WorkerProfile
from pdfabric.router.admission import ADMIT, REJECT, Outcome, Ticket
from pdfabric.router.predictor import Choice, PredictorConfig
from pdfabric.router.registry import Registry
from pdfabric.router.routing import Routing
from pdfabric.router.slo import AdmissionConfig, resolve

Progress = Callable[[int, int], None]  # (requests finished, requests in all)


@dataclass(frozen=True)
class SimWorker:
    """One simulated worker: its kind and pool, its scheduler limits and cache, and its step-time fit."""

    worker_id: str
    kind: str  # pdfabric.control PREFILL | DECODE | COLOCATED
    profile: WorkerProfile
    pool: str = "default"
    max_running: int = 64
    max_batch_tokens: int = 512
    num_blocks: int = 4096
    block_size: int = 16
    max_model_len: int = 4096
    kv_bytes_per_token: int = 0
    kv_bytes_per_s: float = 1e9  # KV transfer rate of this worker's link
    heartbeat_s: float = 0.0  # 0: the config's

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.worker_id}: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        for name in ("max_running", "max_batch_tokens", "num_blocks", "block_size", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{self.worker_id}: {name} must be at least 1, got {getattr(self, name)}")
        if self.kv_bytes_per_token < 0 or self.heartbeat_s < 0:
            raise ValueError(f"{self.worker_id}: kv_bytes_per_token and heartbeat_s must be >= 0")
        if not (math.isfinite(self.kv_bytes_per_s) and self.kv_bytes_per_s > 0):
            raise ValueError(f"{self.worker_id}: kv_bytes_per_s must be > 0, got {self.kv_bytes_per_s}")


@dataclass(frozen=True)
class SimConfig:
    """A simulated deployment: its workers, the router's ``[routing]`` settings and the timing knobs."""

    workers: tuple[SimWorker, ...]
    routing: AdmissionConfig = field(default_factory=AdmissionConfig)
    predictor: PredictorConfig = field(default_factory=PredictorConfig)
    heartbeat_s: float = 0.25
    overhead_ms: float = 0.0  # added to every time the client sees (router, HTTP, network)

    def __post_init__(self) -> None:
        ids = [w.worker_id for w in self.workers]
        if len(set(ids)) != len(ids):
            raise ValueError(f"worker ids must be unique, got {ids}")
        kinds = {w.kind for w in self.workers}
        if COLOCATED not in kinds and not {PREFILL, DECODE} <= kinds:
            raise ValueError("a deployment needs a colocated worker, or prefill and decode workers")
        if not self.heartbeat_s > 0 or not (math.isfinite(self.overhead_ms) and self.overhead_ms >= 0):
            raise ValueError("heartbeat_s must be > 0 and overhead_ms >= 0")


def simulate(config: SimConfig, workload: Workload, progress: Progress | None = None) -> list[RequestRecord]:
    """One RequestRecord per workload request, in index order; deterministic."""
    return Simulation(config, workload, progress).run()


# --- router side --------------------------------------------------------------------------------


@dataclass(eq=False)
class _Req:
    """One request as the router and the client see it."""

    request: Request
    rid: str
    params: SamplingParams
    choices: tuple[Choice, ...] = ()
    tried: int = 0  # routes tried so far
    holders: set[str] = field(default_factory=set)
    times: list[float] = field(default_factory=list)  # client arrival of each token
    end: float | None = None
    status: str = TIMEOUT
    http_status: int | None = None
    finish_reason: str | None = None
    error: str | None = None


class _Routing(Routing):
    """``Routing`` whose polls hand their outcomes to the simulation (no event loop, no futures)."""

    def __init__(self, sim: Simulation, registry: Registry, config: SimConfig) -> None:
        super().__init__(registry, config.routing, config.predictor, clock=lambda: sim.now)
        self.sim = sim

    def poll(self) -> None:
        if len(self.queue):
            self.sim.settle(self.queue.poll(self.clock(), self.fit))


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
        self._armed: float | None = None  # the admission deadline a poll is queued for
        self._poll_queued = False
        self._overhead = config.overhead_ms / 1e3
        self.registry = Registry()
        self.routing = _Routing(self, self.registry, config)
        self.workers = {w.worker_id: _Worker(self, w) for w in config.workers}
        self._link_free = dict.fromkeys(self.workers, 0.0)  # when each worker's KV link is next free
        self._reqs: dict[str, _Req] = {}
        resolved = resolve(config.routing, None, "default")  # what the bench client gets
        self._budgets, self._class, self._tenant = (
            resolved.budgets,
            resolved.slo_class.name,
            resolved.tenant.name,
        )
        for w in self.workers.values():
            self.registry.register(w.registration())
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
        r = self.workload.requests[i]
        rid = str(i)
        req = _Req(r, rid, SamplingParams(max_tokens=r.output_len, ignore_eos=True))
        self._reqs[rid] = req
        limit = self.registry.max_model_len
        if r.input_len >= limit or r.output_len > limit - r.input_len:  # the router's 400
            self._end(req, ERROR, 400, f"prompt and output exceed the {limit}-token context window")
            return
        ticket = Ticket(rid, self._tenant, self._class, self._budgets, r.input_len, self.now)
        outcomes = self.routing.queue.arrive(ticket, self.now, self.routing.fit)
        self.settle([outcomes[-1], *outcomes[:-1]])  # the arrival's own dispatch goes first

    def settle(self, outcomes: list[Outcome]) -> None:
        """Dispatches admitted requests, ends rejected ones, and re-arms the deadline poll."""
        for outcome in outcomes:
            req = self._reqs[outcome.ticket.request_id]
            if outcome.action == ADMIT:
                assert outcome.ranking is not None
                req.choices = outcome.ranking.choices
                self._dispatch(req)
            elif outcome.action == REJECT:
                self._end(req, REJECTED, 429, f"HTTP 429 ({outcome.reason})")
        deadline = self.routing.queue.next_deadline()
        if deadline is not None and deadline != self._armed:
            self._armed = deadline
            self.at(deadline + 1e-3, self._deadline_poll, deadline)

    def _deadline_poll(self, deadline: float) -> None:
        if deadline == self._armed:
            self._armed = None
            self.routing.poll()

    def _dispatch(self, req: _Req) -> None:
        """Tries the next route (the dispatcher's ``_start``): colocated at once, a pair after its reply."""
        if req.tried == len(req.choices):
            self.routing.forget(req.rid)
            self._end(req, REJECTED, 503, "no worker could take the request")
            return
        choice = req.choices[req.tried]
        req.tried += 1
        if choice.colocated:
            req.holders.add(choice.decode)
            self.workers[choice.decode].post(("generate", req))
            self.routing.routed(req.rid, req.request.input_len, choice)
        else:
            self.workers[choice.decode].post(("reserve", req))

    def reserved(self, reply: tuple[_Req, bool]) -> None:
        """A decode worker's answer to a reservation: send the prompt on, or try the next route."""
        req, ok = reply
        if not ok:
            self._dispatch(req)
            return
        choice = req.choices[req.tried - 1]
        req.holders.update((choice.decode, choice.prefill))
        self.workers[choice.prefill].post(("prefill", req, choice.decode))
        self.routing.routed(req.rid, req.request.input_len, choice)

    def token(self, req: _Req, worker_id: str, has_token: bool, finish: str | None) -> None:
        """A delta from a worker: a token (or none) and maybe the request's finish reason."""
        if req.end is not None:
            return
        if has_token:
            req.times.append(self.now + self._overhead)
        if finish is not None:
            req.holders.discard(worker_id)
            if finish == "error" or not req.times:
                self._end(req, ERROR, 200, f"finish_reason {finish}")
            else:
                req.finish_reason = finish
                self._end(req, OK, 200, None)

    def handed_off(self, handoff: tuple[_Req, str]) -> None:
        req, worker_id = handoff
        req.holders.discard(worker_id)
        self.routing.poll()

    def heartbeat(self, hb: Heartbeat) -> None:
        self.registry.heartbeat(hb)
        self.routing.on_heartbeat(hb.worker_id)

    def _end(self, req: _Req, status: str, http_status: int, error: str | None) -> None:
        """Ends a request (the HTTP handler's ``release``): workers still holding it get an abort."""
        req.end = self.now + self._overhead
        req.status, req.http_status, req.error = status, http_status, error
        for worker_id in sorted(req.holders):
            self.workers[worker_id].post(("abort", req))
        req.holders.clear()
        self._done += 1
        if self.progress is not None and self._done % 1024 == 0:
            self.progress(self._done, len(self.workload.requests))
        if not self._poll_queued:  # the handler's ``release`` runs after this event, then polls
            self._poll_queued = True
            self.at(self.now, self._poll)

    def _poll(self, _: Any) -> None:
        self._poll_queued = False
        self.routing.poll()

    def _record(self, req: _Req | None, r: Request) -> RequestRecord:
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
        gaps = [b - a for a, b in zip(ms[:-1], ms[1:], strict=True)]
        return RequestRecord(
            index=r.index, scheduled_s=r.arrival_s, sent_s=r.arrival_s, input_len=r.input_len,
            output_len=r.output_len, status=req.status, http_status=req.http_status,
            ttft_ms=ms[0] if ms else None, e2e_ms=(req.end - r.arrival_s) * 1e3, output_tokens=len(ms),
            token_count_source="usage", chunk_ms=ms, itl_ms=gaps,
            finish_reason=req.finish_reason, error=req.error,
        )  # fmt: skip

    # --- KV transfers ---------------------------------------------------------------------------

    def push_kv(self, prefill: _Worker, req: _Req, decode_id: str, nbytes: int) -> None:
        """Starts a prefill worker's KV push: one push at a time on each end's link."""
        decode = self.workers[decode_id]
        rate = min(prefill.spec.kv_bytes_per_s, decode.spec.kv_bytes_per_s)
        pid, did = prefill.spec.worker_id, decode_id
        start = max(self.now, self._link_free[pid], self._link_free[did])
        done = start + nbytes / rate
        self._link_free[pid] = self._link_free[did] = done
        self.at(done, decode.post_transfer, ("kv", req, pid))


_PROMPTS: dict[int, tuple[int, ...]] = {}


def _prompt(n: int) -> tuple[int, ...]:
    """A prompt of ``n`` tokens (the ids do not matter to the scheduler; one tuple per length)."""
    ids = _PROMPTS.get(n)
    if ids is None:
        ids = _PROMPTS[n] = (0,) * n
    return ids


# --- worker side --------------------------------------------------------------------------------


class _Worker:
    """One worker's loop: messages between steps, then a step of ``profile.step_seconds`` if it has work."""

    def __init__(self, sim: Simulation, spec: SimWorker) -> None:
        self.sim = sim
        self.spec = spec
        self.tables = BlockTables(BlockPool(spec.num_blocks, spec.block_size))
        on_prefilled = "handoff" if spec.kind == PREFILL else "decode"
        cfg = SchedulerConfig(spec.max_batch_tokens, spec.max_running, spec.max_model_len, on_prefilled)
        self.scheduler = Scheduler(self.tables, cfg)
        self.heartbeat_s = spec.heartbeat_s or sim.config.heartbeat_s
        self.busy = False  # a step is running
        self._wake = False  # a boundary is queued for an idle worker
        self._control: list[tuple[Any, ...]] = []
        self._transfers: list[tuple[Any, ...]] = []
        self._chunks: list[Chunk] = []
        self._sampled: list[tuple[int, float]] = []
        self._block_bytes = spec.block_size * spec.kv_bytes_per_token
        self._targets: dict[str, str] = {}  # prefill worker: request -> its decode worker
        self._reqs: dict[str, _Req] = {}
        self._next_hb = 0.0
        self._hb_armed: float | None = 0.0
        self._recent_ms: deque[float] = deque(maxlen=32)

    def registration(self) -> Register:
        s = self.spec
        endpoint = f"sim://{s.worker_id}" if s.kind == DECODE else ""
        return Register(
            s.worker_id,
            s.kind,
            s.pool,
            "simulated",
            s.max_model_len,
            s.block_size,
            s.num_blocks,
            endpoint,
            0,
            s.max_running,
            s.max_batch_tokens,
            s.kv_bytes_per_token,
            s.profile,
        )

    # --- messages -------------------------------------------------------------------------------

    def post(self, msg: tuple[Any, ...]) -> None:
        """A control message from the router, handled at the next step boundary."""
        self._control.append(msg)
        self._poke()

    def post_transfer(self, msg: tuple[Any, ...]) -> None:
        """A KV arrival or acknowledgement, handled at the next step boundary before control messages."""
        self._transfers.append(msg)
        self._poke()

    def _poke(self) -> None:
        if not self.busy and not self._wake:
            self._wake = True
            self.sim.at(self.sim.now, self._woken)  # after everything else arriving at this instant

    def _woken(self, _: Any) -> None:
        self._wake = False
        if not self.busy:
            self._boundary()

    def _boundary(self) -> None:
        """The top of the real loop: transfers, control messages, then a step if there is work."""
        while self._transfers or self._control:
            transfers, self._transfers = self._transfers, []
            for msg in transfers:
                self._transfer(msg)
            control, self._control = self._control, []
            for msg in control:
                self._handle(msg)
        self._step()

    def _transfer(self, msg: tuple[Any, ...]) -> None:
        sim, req = self.sim, msg[1]
        if msg[0] == "kv":  # decode side: the prompt's KV (and its first token) is in
            seq = self.scheduler.kv_arrived(req.rid, 0, 0.0)
            if seq is not None and seq.finish_reason is not None:  # the first token ended it
                del self._reqs[req.rid]
                sim.token(req, self.spec.worker_id, False, seq.finish_reason)
            sim.at(sim.now, sim.workers[msg[2]].post_transfer, ("ack", req))
        else:  # prefill side: the decode worker has the blocks
            self._targets.pop(req.rid, None)
            self._reqs.pop(req.rid, None)
            if self.scheduler.finish(req.rid, "handed_off") is not None:
                sim.at(sim.now, sim.handed_off, (req, self.spec.worker_id))

    def _handle(self, msg: tuple[Any, ...]) -> None:
        sim, kind, req = self.sim, msg[0], msg[1]
        rid, prompt_len = req.rid, req.request.input_len
        if kind == "abort":
            self._targets.pop(rid, None)
            self._reqs.pop(rid, None)
            self.scheduler.finish(rid, "abort")
            return
        seq = Sequence(rid, _prompt(prompt_len), req.params)
        if kind == "reserve":
            ok = prompt_len < self.spec.max_model_len and self.scheduler.reserve(seq) is not None
            if ok:
                self._reqs[rid] = req
            sim.at(sim.now, sim.reserved, (req, ok))
            return
        if prompt_len >= self.spec.max_model_len:  # ``Worker.fits``: an error delta
            sim.token(req, self.spec.worker_id, False, "error")
            return
        if kind == "prefill":
            self._targets[rid] = msg[2]
        self._reqs[rid] = req
        self.scheduler.add(seq)

    # --- steps ----------------------------------------------------------------------------------

    def _step(self) -> None:
        chunks = self.scheduler.schedule() if self.scheduler.has_work else []
        if not chunks:  # idle, or waiting for blocks: the next message wakes it
            self._idle()
            return
        self.busy = True
        self._chunks = chunks
        sampled = sum(1 for c in chunks if c.seq.state is SeqState.RUNNING or c.sample)
        self._sampled = [(0, 0.0)] * sampled
        seconds = self.spec.profile.step_seconds(step_shape(chunks))
        self._recent_ms.append(seconds * 1e3)
        self.sim.at(self.sim.now + seconds, self._step_end)

    def _step_end(self, _: Any) -> None:
        sim, chunks = self.sim, self._chunks
        self.busy, self._chunks = False, []
        wid, token = self.spec.worker_id, sim.token
        for seq in self.scheduler.complete(chunks, self._sampled):
            req = self._reqs[seq.request_id]
            if seq.state is SeqState.HANDOFF:  # first token to the router, KV to the decode worker
                token(req, wid, True, None)
                blocks = len(self.tables.table(seq.request_id))
                sim.push_kv(self, req, self._targets[seq.request_id], blocks * self._block_bytes)
                continue
            token(req, wid, True, seq.finish_reason)
            if seq.state is SeqState.FINISHED:
                del self._reqs[seq.request_id]
        if sim.now >= self._next_hb:
            self._heartbeat()
        self._boundary()

    # --- heartbeats -----------------------------------------------------------------------------

    def _idle(self) -> None:
        if self._hb_armed != self._next_hb:
            self._hb_armed = self._next_hb
            self.sim.at(max(self._next_hb, self.sim.now), self.heartbeat_timer, self._next_hb, work=False)

    def heartbeat_timer(self, due: float) -> None:
        if self._hb_armed == due:
            self._hb_armed = None
        if self.busy or due != self._next_hb:
            return
        self._heartbeat()
        self._idle()

    def _heartbeat(self) -> None:
        sim, s = self.sim, self.scheduler
        self._next_hb = sim.now + self.heartbeat_s
        pool = self.tables.pool
        step_ms = statistics.median(self._recent_ms) if self._recent_ms else 0.0
        hb = Heartbeat(
            self.spec.worker_id,
            s.queued_tokens,
            len(s.running),
            len(s.waiting) + len(s.awaiting_kv),
            pool.num_free,
            pool.num_blocks,
            step_ms,
            s.context_tokens,
            0.0,
            self.spec.profile,
        )
        sim.at(sim.now, sim.heartbeat, hb)
